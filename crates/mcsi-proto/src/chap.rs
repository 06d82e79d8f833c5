//! CHAP for the iSCSI security stage (RFC 7143 12.1.3 and 9.2.1, RFC 1994), sans-IO, as
//! [`Authenticator`]s for both sides: [`ChapTarget`] authenticates initiators against a table of
//! users ([`ChapUsers`]) and answers mutual challenges; [`ChapInitiator`] answers the target's
//! challenge and optionally challenges the target.
//!
//! The exchange (RFC 7143 12.1.3):
//!
//! ```text
//! I -> T  CHAP_A=<A1,A2,...>                 algorithms in order of preference
//! T -> I  CHAP_A=<A> CHAP_I=<I> CHAP_C=<C>    the first offered algorithm the target allows
//! I -> T  CHAP_N=<N> CHAP_R=<R> [CHAP_I=<I'> CHAP_C=<C'>]   (mutual: challenge the target)
//! T -> I  [CHAP_N=<N'> CHAP_R=<R'>]           (mutual only)
//! ```
//!
//! R = H(I || secret || C) with H one of MD5 (5), SHA-1 (6), SHA-256 (7), SHA3-256 (8).
//! Challenges and responses are binary values written `0x<hex>` or `0b<base64>` (RFC 7143 6.1),
//! at most 1024 bytes; answers use the encoding of the challenge they answer.
//!
//! Randomness (identifiers and challenges) comes from the caller through a closure, so the
//! module stays deterministic under test. Secrets live in [`Secret`], whose `Debug` is redacted;
//! no error or log line of this module carries a secret. Responses are compared in constant time.
//! Every failure is reported to the login as [`status::AUTH_FAILED`] (2/01); the reason is
//! available to an observer (see [`ChapTarget::with_observer`]).

use std::collections::BTreeMap;

use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine as _;
use subtle::ConstantTimeEq as _;

use crate::keys::parse_number;
use crate::login::{status, AuthProgress, Authenticator};

/// Longest challenge or response in binary form (RFC 7143 12.1.3: C and R are
/// large-binary-values of at most 1024 bytes).
pub const MAX_BINARY_LEN: usize = 1024;
/// Longest CHAP_N accepted.
pub const MAX_NAME_LEN: usize = 512;
/// Shortest challenge we send: the digest size, and never less than this.
pub const MIN_CHALLENGE_LEN: usize = 16;
/// Secrets shorter than this (96 bits) need IPsec or another protected channel
/// (RFC 7143 9.2.1); see [`Secret::is_short`].
pub const SHORT_SECRET_LEN: usize = 12;

/// The method name for AuthMethod.
pub const METHOD: &str = "CHAP";

/// A CHAP digest algorithm, by its CHAP_A code (IANA PPP authentication algorithms; 6-8 as used
/// by open-iscsi, LIO and SCST).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChapAlgorithm {
    Md5,
    Sha1,
    Sha256,
    Sha3_256,
}

impl ChapAlgorithm {
    /// Every algorithm, strongest first (the initiator's default offer, the same order as
    /// open-iscsi's suggested `node.session.auth.chap_algs = SHA3-256,SHA256,SHA1,MD5`).
    pub const ALL: [ChapAlgorithm; 4] = [
        ChapAlgorithm::Sha3_256,
        ChapAlgorithm::Sha256,
        ChapAlgorithm::Sha1,
        ChapAlgorithm::Md5,
    ];

    /// The CHAP_A value.
    pub fn code(self) -> u8 {
        match self {
            ChapAlgorithm::Md5 => 5,
            ChapAlgorithm::Sha1 => 6,
            ChapAlgorithm::Sha256 => 7,
            ChapAlgorithm::Sha3_256 => 8,
        }
    }

    pub fn from_code(code: u64) -> Option<ChapAlgorithm> {
        match code {
            5 => Some(ChapAlgorithm::Md5),
            6 => Some(ChapAlgorithm::Sha1),
            7 => Some(ChapAlgorithm::Sha256),
            8 => Some(ChapAlgorithm::Sha3_256),
            _ => None,
        }
    }

    /// The name used in configuration (`MD5`, `SHA1`, `SHA256`, `SHA3-256`).
    pub fn name(self) -> &'static str {
        match self {
            ChapAlgorithm::Md5 => "MD5",
            ChapAlgorithm::Sha1 => "SHA1",
            ChapAlgorithm::Sha256 => "SHA256",
            ChapAlgorithm::Sha3_256 => "SHA3-256",
        }
    }

    /// Parse a configuration name (case-insensitive, `SHA-256` and `SHA3_256` spellings too) or
    /// a CHAP_A code.
    pub fn parse(s: &str) -> Option<ChapAlgorithm> {
        let n: String = s
            .chars()
            .filter(|c| *c != '-' && *c != '_')
            .collect::<String>()
            .to_ascii_uppercase();
        match n.as_str() {
            "MD5" => Some(ChapAlgorithm::Md5),
            "SHA1" => Some(ChapAlgorithm::Sha1),
            "SHA256" => Some(ChapAlgorithm::Sha256),
            "SHA3256" => Some(ChapAlgorithm::Sha3_256),
            _ => parse_number(s).and_then(ChapAlgorithm::from_code),
        }
    }

    /// Digest size in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            ChapAlgorithm::Md5 => 16,
            ChapAlgorithm::Sha1 => 20,
            ChapAlgorithm::Sha256 | ChapAlgorithm::Sha3_256 => 32,
        }
    }

    /// The CHAP response H(id || secret || challenge) (RFC 1994 section 4.1).
    pub fn response(self, id: u8, secret: &Secret, challenge: &[u8]) -> Vec<u8> {
        fn h<D: md5::Digest>(id: u8, secret: &[u8], challenge: &[u8]) -> Vec<u8> {
            let mut d = D::new();
            d.update([id]);
            d.update(secret);
            d.update(challenge);
            d.finalize().to_vec()
        }
        let s = secret.expose();
        match self {
            ChapAlgorithm::Md5 => h::<md5::Md5>(id, s, challenge),
            ChapAlgorithm::Sha1 => h::<sha1::Sha1>(id, s, challenge),
            ChapAlgorithm::Sha256 => h::<sha2::Sha256>(id, s, challenge),
            ChapAlgorithm::Sha3_256 => h::<sha3::Sha3_256>(id, s, challenge),
        }
    }

    /// The default challenge length: the digest size, at least [`MIN_CHALLENGE_LEN`].
    pub fn challenge_len(self) -> usize {
        self.digest_len().max(MIN_CHALLENGE_LEN)
    }
}

impl std::fmt::Display for ChapAlgorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A CHAP secret. Its `Debug` output is `<redacted>`; it has no `Display`.
#[derive(Clone, Default)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Secret(bytes.into())
    }

    /// The secret's bytes, for computing responses.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Shorter than 96 bits: RFC 7143 9.2.1 only allows such secrets over IPsec.
    pub fn is_short(&self) -> bool {
        self.0.len() < SHORT_SECRET_LEN
    }

    /// Constant-time equality (for configuration checks such as "the same secret is configured
    /// in both directions").
    pub fn ct_eq(&self, other: &Secret) -> bool {
        bool::from(self.0.as_slice().ct_eq(other.0.as_slice()))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret(s.as_bytes().to_vec())
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret(s.into_bytes())
    }
}

impl From<Vec<u8>> for Secret {
    fn from(v: Vec<u8>) -> Self {
        Secret(v)
    }
}

/// One CHAP identity and, for mutual CHAP, the other side's.
///
/// On the initiator: `user`/`secret` answer the target's challenge; `mutual` is the name and
/// secret the target must answer our challenge with (None: one-way CHAP).
/// On the target (in [`ChapUsers`]): `user`/`secret` are what an initiator must prove; `mutual`
/// is the target's name and secret it answers that initiator's challenge with.
#[derive(Debug, Clone)]
pub struct ChapCredentials {
    pub user: String,
    pub secret: Secret,
    pub mutual: Option<(String, Secret)>,
}

impl ChapCredentials {
    /// One-way credentials.
    pub fn new(user: impl Into<String>, secret: impl Into<Secret>) -> Self {
        ChapCredentials {
            user: user.into(),
            secret: secret.into(),
            mutual: None,
        }
    }

    /// Add the other direction (mutual CHAP).
    pub fn with_mutual(mut self, user: impl Into<String>, secret: impl Into<Secret>) -> Self {
        self.mutual = Some((user.into(), secret.into()));
        self
    }

    /// Refuse what RFC 7143 9.2.1 forbids outright: empty names or secrets, and the same secret
    /// in both directions.
    pub fn validate(&self) -> Result<(), ChapError> {
        if self.user.is_empty() || self.user.len() > MAX_NAME_LEN {
            return Err(ChapError::BadCredentials(
                "the CHAP user name must be 1 to 512 bytes",
            ));
        }
        if self.secret.is_empty() {
            return Err(ChapError::BadCredentials("the CHAP secret is empty"));
        }
        if let Some((user, secret)) = &self.mutual {
            if user.is_empty() || user.len() > MAX_NAME_LEN {
                return Err(ChapError::BadCredentials(
                    "the mutual CHAP user name must be 1 to 512 bytes",
                ));
            }
            if secret.is_empty() {
                return Err(ChapError::BadCredentials("the mutual CHAP secret is empty"));
            }
            if secret.ct_eq(&self.secret) {
                return Err(ChapError::BadCredentials(
                    "the same CHAP secret is configured for both directions (RFC 7143 9.2.1)",
                ));
            }
        }
        Ok(())
    }
}

/// The target's table of CHAP users (per target, or for discovery sessions).
#[derive(Debug, Clone, Default)]
pub struct ChapUsers {
    by_user: BTreeMap<String, ChapCredentials>,
}

impl ChapUsers {
    pub fn new() -> Self {
        ChapUsers::default()
    }

    /// Add or replace a user (after [`ChapCredentials::validate`]); returns the replaced entry.
    pub fn insert(&mut self, creds: ChapCredentials) -> Result<Option<ChapCredentials>, ChapError> {
        creds.validate()?;
        Ok(self.by_user.insert(creds.user.clone(), creds))
    }

    pub fn get(&self, user: &str) -> Option<&ChapCredentials> {
        self.by_user.get(user)
    }

    pub fn len(&self) -> usize {
        self.by_user.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_user.is_empty()
    }
}

/// How a binary value is written (RFC 7143 6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Encoding {
    /// `0x` followed by hexadecimal digits.
    #[default]
    Hex,
    /// `0b` followed by base64 (RFC 4648).
    Base64,
}

const B64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Write a binary value.
pub fn encode_binary(data: &[u8], encoding: Encoding) -> String {
    match encoding {
        Encoding::Hex => {
            const DIGITS: &[u8; 16] = b"0123456789abcdef";
            let mut s = String::with_capacity(2 + 2 * data.len());
            s.push_str("0x");
            for b in data {
                s.push(char::from(DIGITS[usize::from(b >> 4)]));
                s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
            }
            s
        }
        Encoding::Base64 => format!("0b{}", B64.encode(data)),
    }
}

/// Read a binary value of 1 to [`MAX_BINARY_LEN`] bytes written `0x<hex>` or `0b<base64>`
/// (RFC 7143 6.1; an odd number of hex digits has an implied leading zero).
pub fn decode_binary(field: &'static str, s: &str) -> Result<(Vec<u8>, Encoding), ChapError> {
    let bad = |reason: &'static str| ChapError::BadBinary { field, reason };
    let (prefix, body) = (s.get(..2).unwrap_or(""), s.get(2..).unwrap_or(""));
    if body.is_empty() {
        return Err(bad("expected 0x<hex> or 0b<base64> with at least one byte"));
    }
    match prefix {
        "0x" | "0X" => {
            // Length check before decoding: two digits per byte.
            if body.len() > 2 * MAX_BINARY_LEN {
                return Err(bad("longer than 1024 bytes"));
            }
            let nibble = |c: u8| -> Option<u8> {
                match c {
                    b'0'..=b'9' => Some(c - b'0'),
                    b'a'..=b'f' => Some(c - b'a' + 10),
                    b'A'..=b'F' => Some(c - b'A' + 10),
                    _ => None,
                }
            };
            let digits = body.as_bytes();
            let mut out = Vec::with_capacity(digits.len().div_ceil(2));
            let (head, rest) = digits.split_at(digits.len() % 2);
            if let Some(&c) = head.first() {
                out.push(nibble(c).ok_or(bad("not a hexadecimal digit"))?);
            }
            for pair in rest.chunks_exact(2) {
                let hi = nibble(pair[0]).ok_or(bad("not a hexadecimal digit"))?;
                let lo = nibble(pair[1]).ok_or(bad("not a hexadecimal digit"))?;
                out.push(hi << 4 | lo);
            }
            Ok((out, Encoding::Hex))
        }
        "0b" | "0B" => {
            // Four characters per three bytes.
            if body.len() > MAX_BINARY_LEN.div_ceil(3) * 4 {
                return Err(bad("longer than 1024 bytes"));
            }
            let out = B64.decode(body).map_err(|_| bad("invalid base64"))?;
            if out.is_empty() || out.len() > MAX_BINARY_LEN {
                return Err(bad("must hold 1 to 1024 bytes"));
            }
            Ok((out, Encoding::Base64))
        }
        _ => Err(bad("expected 0x<hex> or 0b<base64>")),
    }
}

/// Why a CHAP exchange failed. Never carries a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChapError {
    #[error("none of the offered CHAP algorithms ({offered}) is allowed; allowed: {allowed}")]
    NoCommonAlgorithm { offered: String, allowed: String },
    #[error("the target chose CHAP_A={0}, which was not offered")]
    AlgorithmNotOffered(String),
    #[error("CHAP key {key} is not expected at this point of the exchange ({state})")]
    UnexpectedKey { key: String, state: &'static str },
    #[error("CHAP key {0} is missing")]
    MissingKey(&'static str),
    #[error("CHAP key {0} was sent with the exchange over")]
    ExchangeOver(String),
    #[error("{field}: {reason}")]
    BadBinary {
        field: &'static str,
        reason: &'static str,
    },
    #[error("CHAP_I={0:?} is not a number from 0 to 255")]
    BadIdentifier(String),
    #[error("CHAP_N is empty or longer than 512 bytes")]
    BadName,
    #[error("CHAP user {0:?} is not known")]
    UnknownUser(String),
    #[error("CHAP_R has {got} bytes; {algorithm} responses have {want}")]
    ResponseLength {
        got: usize,
        want: usize,
        algorithm: ChapAlgorithm,
    },
    #[error("wrong CHAP response for user {0:?}")]
    WrongResponse(String),
    #[error("the CHAP response matches this side's own secret: the same secret is used in both directions (RFC 7143 9.2.1)")]
    OwnSecret,
    #[error("the initiator's mutual challenge is the target's own challenge reflected back (RFC 7143 9.2.1)")]
    ReflectedChallenge,
    #[error("mutual CHAP requested but no target credentials are configured for user {0:?}")]
    MutualNotConfigured(String),
    #[error("mutual CHAP needs both CHAP_I and CHAP_C")]
    MutualIncomplete,
    #[error("the target answered with CHAP_N={got:?}; expected {want:?}")]
    WrongTargetName { got: String, want: String },
    #[error("the target did not answer the mutual challenge")]
    MutualMissing,
    #[error("authentication method {0:?} is not CHAP")]
    WrongMethod(String),
    #[error("invalid CHAP credentials: {0}")]
    BadCredentials(&'static str),
}

/// A successful exchange, as reported to an observer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChapSuccess {
    /// The authenticated CHAP name (the initiator's on the target, the target's on the initiator
    /// for mutual CHAP, else our own user).
    pub user: String,
    pub algorithm: ChapAlgorithm,
    pub mutual: bool,
}

type Random = Box<dyn FnMut(&mut [u8]) + Send>;
type Observer = Box<dyn FnMut(Result<&ChapSuccess, &ChapError>) + Send>;

fn get<'a>(keys: &'a [(String, String)], key: &str) -> Option<&'a str> {
    keys.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

fn parse_id(v: &str) -> Result<u8, ChapError> {
    parse_number(v)
        .and_then(|n| u8::try_from(n).ok())
        .ok_or_else(|| ChapError::BadIdentifier(v.chars().take(32).collect()))
}

/// Only these keys, else the first other one as an error.
fn only(keys: &[(String, String)], allowed: &[&str], state: &'static str) -> Result<(), ChapError> {
    match keys.iter().find(|(k, _)| !allowed.contains(&k.as_str())) {
        Some((k, _)) => Err(ChapError::UnexpectedKey {
            key: k.clone(),
            state,
        }),
        None => Ok(()),
    }
}

fn check_name(n: &str) -> Result<(), ChapError> {
    if n.is_empty() || n.len() > MAX_NAME_LEN {
        return Err(ChapError::BadName);
    }
    Ok(())
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    // Lengths are public (fixed by the algorithm); contents are compared in constant time.
    bool::from(a.ct_eq(b))
}

fn algorithm_list(list: &[ChapAlgorithm]) -> String {
    list.iter()
        .map(|a| a.code().to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Random bytes of `len`, retried once if they equal `avoid` (a reflected challenge).
fn fresh(rng: &mut Random, len: usize, avoid: Option<&[u8]>) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    for _ in 0..4 {
        rng(&mut buf);
        if avoid != Some(buf.as_slice()) {
            break;
        }
    }
    buf
}

#[derive(Debug)]
enum TargetState {
    AwaitAlgorithms,
    AwaitResponse {
        algorithm: ChapAlgorithm,
        id: u8,
        challenge: Vec<u8>,
    },
    Over,
}

/// Target side of CHAP: checks the initiator's response against [`ChapUsers`], answers a mutual
/// challenge with the user's `mutual` credentials.
pub struct ChapTarget {
    users: ChapUsers,
    algorithms: Vec<ChapAlgorithm>,
    challenge_len: Option<usize>,
    encoding: Encoding,
    rng: Random,
    observer: Option<Observer>,
    state: TargetState,
}

impl std::fmt::Debug for ChapTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChapTarget")
            .field("users", &self.users.len())
            .field("algorithms", &self.algorithms)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl ChapTarget {
    /// A CHAP target allowing every algorithm, with challenges of the digest size, written in
    /// hex. `random` fills buffers with unpredictable bytes (identifiers and challenges).
    pub fn new(users: ChapUsers, random: impl FnMut(&mut [u8]) + Send + 'static) -> Self {
        ChapTarget {
            users,
            algorithms: ChapAlgorithm::ALL.to_vec(),
            challenge_len: None,
            encoding: Encoding::Hex,
            rng: Box::new(random),
            observer: None,
            state: TargetState::AwaitAlgorithms,
        }
    }

    /// The algorithms this target allows (order does not matter: the initiator's order decides).
    pub fn with_algorithms(mut self, algorithms: &[ChapAlgorithm]) -> Self {
        self.algorithms = algorithms.to_vec();
        self
    }

    /// Challenge length in bytes, at most [`MAX_BINARY_LEN`]; never below the digest size of
    /// the chosen algorithm nor [`MIN_CHALLENGE_LEN`] (the default).
    pub fn with_challenge_len(mut self, len: usize) -> Self {
        self.challenge_len = Some(len.clamp(MIN_CHALLENGE_LEN, MAX_BINARY_LEN));
        self
    }

    /// How our challenge is written.
    pub fn with_encoding(mut self, encoding: Encoding) -> Self {
        self.encoding = encoding;
        self
    }

    /// Called once with the outcome (for logs and the authenticated user name).
    pub fn with_observer(
        mut self,
        observer: impl FnMut(Result<&ChapSuccess, &ChapError>) + Send + 'static,
    ) -> Self {
        self.observer = Some(Box::new(observer));
        self
    }

    fn run(&mut self, keys: &[(String, String)]) -> Result<AuthProgress, ChapError> {
        match std::mem::replace(&mut self.state, TargetState::Over) {
            TargetState::AwaitAlgorithms => {
                only(keys, &["CHAP_A"], "waiting for CHAP_A")?;
                let offered = get(keys, "CHAP_A").ok_or(ChapError::MissingKey("CHAP_A"))?;
                // 12.1.3: the first of the initiator's algorithms that we allow; values we do not
                // know are skipped.
                let algorithm = offered
                    .split(',')
                    .filter_map(|v| parse_number(v).and_then(ChapAlgorithm::from_code))
                    .find(|a| self.algorithms.contains(a))
                    .ok_or_else(|| ChapError::NoCommonAlgorithm {
                        offered: offered.chars().take(64).collect(),
                        allowed: algorithm_list(&self.algorithms),
                    })?;
                let mut id = [0u8; 1];
                (self.rng)(&mut id);
                // Never shorter than the digest (and 16 bytes), whatever was configured.
                let len = self
                    .challenge_len
                    .unwrap_or(0)
                    .max(algorithm.challenge_len());
                let challenge = fresh(&mut self.rng, len, None);
                let keys = vec![
                    ("CHAP_A".to_owned(), algorithm.code().to_string()),
                    ("CHAP_I".to_owned(), id[0].to_string()),
                    (
                        "CHAP_C".to_owned(),
                        encode_binary(&challenge, self.encoding),
                    ),
                ];
                self.state = TargetState::AwaitResponse {
                    algorithm,
                    id: id[0],
                    challenge,
                };
                Ok(AuthProgress::Continue(keys))
            }
            TargetState::AwaitResponse {
                algorithm,
                id,
                challenge,
            } => {
                only(
                    keys,
                    &["CHAP_N", "CHAP_R", "CHAP_I", "CHAP_C"],
                    "waiting for CHAP_N and CHAP_R",
                )?;
                let name = get(keys, "CHAP_N").ok_or(ChapError::MissingKey("CHAP_N"))?;
                let response = get(keys, "CHAP_R").ok_or(ChapError::MissingKey("CHAP_R"))?;
                check_name(name)?;
                let (response, _) = decode_binary("CHAP_R", response)?;
                if response.len() != algorithm.digest_len() {
                    return Err(ChapError::ResponseLength {
                        got: response.len(),
                        want: algorithm.digest_len(),
                        algorithm,
                    });
                }
                let mutual_request = match (get(keys, "CHAP_I"), get(keys, "CHAP_C")) {
                    (None, None) => None,
                    (Some(i), Some(c)) => Some((parse_id(i)?, decode_binary("CHAP_C", c)?)),
                    _ => return Err(ChapError::MutualIncomplete),
                };
                let Some(creds) = self.users.get(name).cloned() else {
                    // Same work as for a known user, so that timing does not tell names apart.
                    let expected = algorithm.response(id, &Secret::from("-"), &challenge);
                    let _ = ct_eq(&expected, &response);
                    return Err(ChapError::UnknownUser(name.chars().take(64).collect()));
                };
                let expected = algorithm.response(id, &creds.secret, &challenge);
                if !ct_eq(&expected, &response) {
                    return Err(ChapError::WrongResponse(name.to_owned()));
                }
                if let Some((_, target_secret)) = &creds.mutual {
                    // 9.2.1: a response we would have computed with our own secret means the
                    // secret is shared by both directions.
                    let own = algorithm.response(id, target_secret, &challenge);
                    if ct_eq(&own, &response) {
                        return Err(ChapError::OwnSecret);
                    }
                }
                let mut success = ChapSuccess {
                    user: name.to_owned(),
                    algorithm,
                    mutual: false,
                };
                let Some((their_id, (their_challenge, encoding))) = mutual_request else {
                    self.report(Ok(&success));
                    return Ok(AuthProgress::Done(Vec::new()));
                };
                // 9.2.1: the initiator must not reuse our challenge for the other direction.
                if their_challenge == challenge {
                    return Err(ChapError::ReflectedChallenge);
                }
                let Some((target_user, target_secret)) = &creds.mutual else {
                    return Err(ChapError::MutualNotConfigured(name.to_owned()));
                };
                let answer = algorithm.response(their_id, target_secret, &their_challenge);
                success.mutual = true;
                self.report(Ok(&success));
                Ok(AuthProgress::Done(vec![
                    ("CHAP_N".to_owned(), target_user.clone()),
                    ("CHAP_R".to_owned(), encode_binary(&answer, encoding)),
                ]))
            }
            TargetState::Over => Err(ChapError::ExchangeOver(
                keys.first().map(|(k, _)| k.clone()).unwrap_or_default(),
            )),
        }
    }

    fn report(&mut self, r: Result<&ChapSuccess, &ChapError>) {
        if let Some(o) = self.observer.as_mut() {
            o(r);
        }
    }
}

impl Authenticator for ChapTarget {
    fn methods(&self) -> Vec<String> {
        vec![METHOD.to_owned()]
    }

    fn step(&mut self, method: &str, keys: &[(String, String)]) -> Result<AuthProgress, (u8, u8)> {
        let r = if method == METHOD {
            self.run(keys)
        } else {
            Err(ChapError::WrongMethod(method.chars().take(16).collect()))
        };
        r.map_err(|e| {
            self.state = TargetState::Over;
            self.report(Err(&e));
            status::AUTH_FAILED
        })
    }
}

#[derive(Debug)]
enum InitiatorState {
    Start,
    AwaitChallenge,
    AwaitMutual {
        algorithm: ChapAlgorithm,
        id: u8,
        challenge: Vec<u8>,
    },
    Over,
}

/// Initiator side of CHAP: offers algorithms, answers the target's challenge, and with mutual
/// credentials challenges the target and checks its answer.
pub struct ChapInitiator {
    creds: ChapCredentials,
    algorithms: Vec<ChapAlgorithm>,
    challenge_len: usize,
    encoding: Encoding,
    rng: Random,
    observer: Option<Observer>,
    state: InitiatorState,
}

impl std::fmt::Debug for ChapInitiator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChapInitiator")
            .field("creds", &self.creds)
            .field("algorithms", &self.algorithms)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl ChapInitiator {
    /// An initiator offering every algorithm, strongest first ([`ChapAlgorithm::ALL`]).
    /// `random` is only used for mutual challenges. Credentials are checked with
    /// [`ChapCredentials::validate`].
    pub fn new(
        creds: ChapCredentials,
        random: impl FnMut(&mut [u8]) + Send + 'static,
    ) -> Result<Self, ChapError> {
        creds.validate()?;
        Ok(ChapInitiator {
            creds,
            algorithms: ChapAlgorithm::ALL.to_vec(),
            challenge_len: MIN_CHALLENGE_LEN,
            encoding: Encoding::Hex,
            rng: Box::new(random),
            observer: None,
            state: InitiatorState::Start,
        })
    }

    /// The algorithms offered, in order of preference (an empty list keeps the default).
    pub fn with_algorithms(mut self, algorithms: &[ChapAlgorithm]) -> Self {
        if !algorithms.is_empty() {
            self.algorithms = algorithms.to_vec();
        }
        self
    }

    /// Mutual challenge length, clamped to [`MIN_CHALLENGE_LEN`]..=[`MAX_BINARY_LEN`]; the
    /// default is the digest size of the chosen algorithm, at least 16.
    pub fn with_challenge_len(mut self, len: usize) -> Self {
        self.challenge_len = len.clamp(MIN_CHALLENGE_LEN, MAX_BINARY_LEN);
        self
    }

    /// How our mutual challenge is written.
    pub fn with_encoding(mut self, encoding: Encoding) -> Self {
        self.encoding = encoding;
        self
    }

    /// Called once with the outcome.
    pub fn with_observer(
        mut self,
        observer: impl FnMut(Result<&ChapSuccess, &ChapError>) + Send + 'static,
    ) -> Self {
        self.observer = Some(Box::new(observer));
        self
    }

    fn run(&mut self, keys: &[(String, String)]) -> Result<AuthProgress, ChapError> {
        match std::mem::replace(&mut self.state, InitiatorState::Over) {
            InitiatorState::Start => {
                if let Some((k, _)) = keys.first() {
                    return Err(ChapError::UnexpectedKey {
                        key: k.clone(),
                        state: "before CHAP_A was offered",
                    });
                }
                self.state = InitiatorState::AwaitChallenge;
                Ok(AuthProgress::Continue(vec![(
                    "CHAP_A".to_owned(),
                    algorithm_list(&self.algorithms),
                )]))
            }
            InitiatorState::AwaitChallenge => {
                only(
                    keys,
                    &["CHAP_A", "CHAP_I", "CHAP_C"],
                    "waiting for the challenge",
                )?;
                let a = get(keys, "CHAP_A").ok_or(ChapError::MissingKey("CHAP_A"))?;
                let algorithm = parse_number(a)
                    .and_then(ChapAlgorithm::from_code)
                    .filter(|x| self.algorithms.contains(x))
                    .ok_or_else(|| ChapError::AlgorithmNotOffered(a.chars().take(32).collect()))?;
                let id = parse_id(get(keys, "CHAP_I").ok_or(ChapError::MissingKey("CHAP_I"))?)?;
                let (challenge, encoding) = decode_binary(
                    "CHAP_C",
                    get(keys, "CHAP_C").ok_or(ChapError::MissingKey("CHAP_C"))?,
                )?;
                let response = algorithm.response(id, &self.creds.secret, &challenge);
                let mut out = vec![
                    ("CHAP_N".to_owned(), self.creds.user.clone()),
                    ("CHAP_R".to_owned(), encode_binary(&response, encoding)),
                ];
                if self.creds.mutual.is_none() {
                    self.report(Ok(&ChapSuccess {
                        user: self.creds.user.clone(),
                        algorithm,
                        mutual: false,
                    }));
                    return Ok(AuthProgress::Done(out));
                }
                let mut my_id = [0u8; 1];
                (self.rng)(&mut my_id);
                let len = self.challenge_len.max(algorithm.challenge_len());
                // 9.2.1: never send the target's own challenge back.
                let my_challenge = fresh(&mut self.rng, len, Some(&challenge));
                if my_challenge == challenge {
                    return Err(ChapError::ReflectedChallenge);
                }
                out.push(("CHAP_I".to_owned(), my_id[0].to_string()));
                out.push((
                    "CHAP_C".to_owned(),
                    encode_binary(&my_challenge, self.encoding),
                ));
                self.state = InitiatorState::AwaitMutual {
                    algorithm,
                    id: my_id[0],
                    challenge: my_challenge,
                };
                Ok(AuthProgress::Continue(out))
            }
            InitiatorState::AwaitMutual {
                algorithm,
                id,
                challenge,
            } => {
                only(
                    keys,
                    &["CHAP_N", "CHAP_R"],
                    "waiting for the target's answer",
                )?;
                let (Some(name), Some(r)) = (get(keys, "CHAP_N"), get(keys, "CHAP_R")) else {
                    return Err(ChapError::MutualMissing);
                };
                let Some((want_user, target_secret)) = &self.creds.mutual else {
                    return Err(ChapError::MutualMissing);
                };
                if name != want_user {
                    return Err(ChapError::WrongTargetName {
                        got: name.chars().take(64).collect(),
                        want: want_user.clone(),
                    });
                }
                let (response, _) = decode_binary("CHAP_R", r)?;
                if response.len() != algorithm.digest_len() {
                    return Err(ChapError::ResponseLength {
                        got: response.len(),
                        want: algorithm.digest_len(),
                        algorithm,
                    });
                }
                // 9.2.1: an answer computed with our own secret is refused.
                let own = algorithm.response(id, &self.creds.secret, &challenge);
                if ct_eq(&own, &response) {
                    return Err(ChapError::OwnSecret);
                }
                let expected = algorithm.response(id, target_secret, &challenge);
                if !ct_eq(&expected, &response) {
                    return Err(ChapError::WrongResponse(name.to_owned()));
                }
                self.report(Ok(&ChapSuccess {
                    user: name.to_owned(),
                    algorithm,
                    mutual: true,
                }));
                Ok(AuthProgress::Done(Vec::new()))
            }
            InitiatorState::Over => Err(ChapError::ExchangeOver(
                keys.first().map(|(k, _)| k.clone()).unwrap_or_default(),
            )),
        }
    }

    fn report(&mut self, r: Result<&ChapSuccess, &ChapError>) {
        if let Some(o) = self.observer.as_mut() {
            o(r);
        }
    }
}

impl Authenticator for ChapInitiator {
    fn methods(&self) -> Vec<String> {
        vec![METHOD.to_owned()]
    }

    fn step(&mut self, method: &str, keys: &[(String, String)]) -> Result<AuthProgress, (u8, u8)> {
        let r = if method == METHOD {
            self.run(keys)
        } else {
            Err(ChapError::WrongMethod(method.chars().take(16).collect()))
        };
        r.map_err(|e| {
            self.state = InitiatorState::Over;
            self.report(Err(&e));
            status::AUTH_FAILED
        })
    }

    fn awaiting_final(&self) -> bool {
        matches!(self.state, InitiatorState::AwaitMutual { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    // Expected responses computed independently with Python's hashlib:
    // hashlib.new(alg, bytes([id]) + secret + challenge).hexdigest()
    const INI_SECRET: &str = "initiator-secret";
    const TGT_SECRET: &str = "target-secret-99";
    /// id 16, challenge bytes 0x11, 0x12, ... (digest size), secret INI_SECRET.
    const RESP: [(ChapAlgorithm, &str); 4] = [
        (ChapAlgorithm::Md5, "69c2efac71eef26afb3d016a97daf5c0"),
        (
            ChapAlgorithm::Sha1,
            "64418d8d26f848a123c5902ca2887cc0fc5ade4c",
        ),
        (
            ChapAlgorithm::Sha256,
            "eb51904a62f3b9ef894d9f4dc6c79cca719b2e7be8065bd17a18d13d6534f96b",
        ),
        (
            ChapAlgorithm::Sha3_256,
            "533ae579def9e627342752a9dbf6546f2153b86bd3f8336b9bc0aa30fd435ee9",
        ),
    ];
    /// id 128, challenge bytes 0x81, 0x82, ... (digest size), secret TGT_SECRET.
    const MUTUAL: [(ChapAlgorithm, &str); 4] = [
        (ChapAlgorithm::Md5, "bf3acfd50e85b9b16817fcf7491da5e2"),
        (
            ChapAlgorithm::Sha1,
            "5e91e3f5348d47da06c68c3d8b99127bf6bfb5d1",
        ),
        (
            ChapAlgorithm::Sha256,
            "73821791f17d7307d263ec84b6b2bc0950b6086bbccbc4f0737a5b211c95aa3c",
        ),
        (
            ChapAlgorithm::Sha3_256,
            "b79b0926f8236e6286ec4a28629d69657557af173161332277721a7023e545cc",
        ),
    ];

    fn kv(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Deterministic "randomness": consecutive byte values from `seed`.
    fn counter(seed: u8) -> impl FnMut(&mut [u8]) + Send + 'static {
        let mut n = seed;
        move |buf: &mut [u8]| {
            for b in buf {
                *b = n;
                n = n.wrapping_add(1);
            }
        }
    }

    fn seq(from: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| from.wrapping_add(i as u8)).collect()
    }

    fn hex(bytes: &[u8]) -> String {
        encode_binary(bytes, Encoding::Hex)
    }

    fn users() -> ChapUsers {
        let mut u = ChapUsers::new();
        u.insert(ChapCredentials::new("alice", INI_SECRET).with_mutual("disk1", TGT_SECRET))
            .unwrap();
        u.insert(ChapCredentials::new("bob", "bob-secret-000"))
            .unwrap();
        u
    }

    type Log = Arc<Mutex<Vec<Result<ChapSuccess, ChapError>>>>;

    fn target(log: &Log) -> ChapTarget {
        let log = log.clone();
        ChapTarget::new(users(), counter(0x10)).with_observer(move |r| {
            log.lock().unwrap().push(r.cloned().map_err(Clone::clone));
        })
    }

    fn continue_keys(p: Result<AuthProgress, (u8, u8)>) -> Vec<(String, String)> {
        match p {
            Ok(AuthProgress::Continue(k)) => k,
            other => panic!("expected Continue, got {other:?}"),
        }
    }

    fn done_keys(p: Result<AuthProgress, (u8, u8)>) -> Vec<(String, String)> {
        match p {
            Ok(AuthProgress::Done(k)) => k,
            other => panic!("expected Done, got {other:?}"),
        }
    }

    #[test]
    fn responses_match_independent_vectors() {
        for (alg, want) in RESP {
            let ch = seq(0x11, alg.digest_len());
            let r = alg.response(16, &Secret::from(INI_SECRET), &ch);
            assert_eq!(hex(&r), format!("0x{want}"), "{alg}");
        }
        for (alg, want) in MUTUAL {
            let ch = seq(0x81, alg.digest_len());
            let r = alg.response(128, &Secret::from(TGT_SECRET), &ch);
            assert_eq!(hex(&r), format!("0x{want}"), "{alg}");
        }
        // A short textbook case: MD5(0x01 || "abc" || 00..0f).
        let r = ChapAlgorithm::Md5.response(1, &Secret::from("abc"), &seq(0, 16));
        assert_eq!(hex(&r), "0x7bb8ba97c7af4f2cb728063bbe66e0c1");
    }

    #[test]
    fn algorithm_codes_and_names() {
        for a in ChapAlgorithm::ALL {
            assert_eq!(ChapAlgorithm::from_code(a.code().into()), Some(a));
            assert_eq!(ChapAlgorithm::parse(a.name()), Some(a));
            assert_eq!(ChapAlgorithm::parse(&a.code().to_string()), Some(a));
        }
        assert_eq!(ChapAlgorithm::parse("sha-256"), Some(ChapAlgorithm::Sha256));
        assert_eq!(
            ChapAlgorithm::parse("SHA3_256"),
            Some(ChapAlgorithm::Sha3_256)
        );
        assert_eq!(ChapAlgorithm::parse("4"), None);
        assert_eq!(ChapAlgorithm::parse("md4"), None);
        assert_eq!(ChapAlgorithm::Md5.challenge_len(), 16);
        assert_eq!(ChapAlgorithm::Sha1.challenge_len(), 20);
        assert_eq!(ChapAlgorithm::Sha3_256.challenge_len(), 32);
    }

    #[test]
    fn binary_values() {
        let d = |s: &str| decode_binary("CHAP_C", s);
        assert_eq!(d("0x0102ff").unwrap(), (vec![1, 2, 0xff], Encoding::Hex));
        assert_eq!(d("0XABcd").unwrap(), (vec![0xab, 0xcd], Encoding::Hex));
        // Odd digit count: implied leading zero.
        assert_eq!(d("0x123").unwrap().0, vec![0x01, 0x23]);
        // "AQID" is base64 of 01 02 03, "AQI=" of 01 02; padding is optional.
        assert_eq!(d("0bAQID").unwrap(), (vec![1, 2, 3], Encoding::Base64));
        assert_eq!(d("0BAQI=").unwrap().0, vec![1, 2]);
        assert_eq!(d("0bAQI").unwrap().0, vec![1, 2]);
        assert_eq!(
            d("0bERITFBUWFxgZGhscHR4fIA==").unwrap().0,
            seq(0x11, 16),
            "base64 computed with Python"
        );
        for bad in [
            "", "0x", "0b", "1234", "0x12g4", "0b!!!!", "0bA", "x0", "0x1 2", "é0x12",
        ] {
            assert!(d(bad).is_err(), "{bad:?}");
        }
        // 1024 bytes is the most (RFC 7143 12.1.3).
        let max = hex(&[0xaa; 1024]);
        assert_eq!(d(&max).unwrap().0.len(), 1024);
        assert!(d(&hex(&[0xaa; 1025])).is_err());
        let b = encode_binary(&[7; 1024], Encoding::Base64);
        assert_eq!(d(&b).unwrap().0.len(), 1024);
        assert!(d(&encode_binary(&[7; 1025], Encoding::Base64)).is_err());
        // Round trips.
        for data in [vec![0u8], vec![0, 1, 2, 254, 255], seq(3, 77)] {
            for enc in [Encoding::Hex, Encoding::Base64] {
                assert_eq!(d(&encode_binary(&data, enc)).unwrap(), (data.clone(), enc));
            }
        }
    }

    #[test]
    fn secrets_never_printed() {
        let c = ChapCredentials::new("alice", "hunter2-hunter2").with_mutual("t", "s3cr3t-target");
        let dbg = format!("{c:?} {:?}", users());
        assert!(dbg.contains("<redacted>"));
        assert!(!dbg.contains("hunter2") && !dbg.contains("s3cr3t"));
        let i = ChapInitiator::new(c, counter(0)).unwrap();
        let dbg = format!("{i:?} {:?}", target(&Log::default()));
        assert!(!dbg.contains("hunter2") && !dbg.contains("s3cr3t"), "{dbg}");
        // Errors name users, never secrets.
        let mut t = target(&Log::default());
        continue_keys(t.step("CHAP", &kv(&[("CHAP_A", "5")])));
        let wrong = hex(&[0; 16]);
        assert!(t
            .step("CHAP", &kv(&[("CHAP_N", "alice"), ("CHAP_R", &wrong)]))
            .is_err());
        let e = ChapError::WrongResponse("alice".into()).to_string();
        assert!(!e.contains(INI_SECRET));
    }

    #[test]
    fn credentials_rules() {
        assert!(ChapCredentials::new("", "x").validate().is_err());
        assert!(ChapCredentials::new("a", "").validate().is_err());
        assert!(ChapCredentials::new("a", "x")
            .with_mutual("t", "")
            .validate()
            .is_err());
        assert!(ChapCredentials::new("a", "x")
            .with_mutual("", "y")
            .validate()
            .is_err());
        // RFC 7143 9.2.1: never the same secret both ways.
        let same = ChapCredentials::new("a", "same-secret-1").with_mutual("t", "same-secret-1");
        assert!(matches!(same.validate(), Err(ChapError::BadCredentials(_))));
        assert!(ChapUsers::new().insert(same.clone()).is_err());
        assert!(ChapInitiator::new(same, counter(0)).is_err());
        assert!(Secret::from("short").is_short());
        assert!(!Secret::from("twelve-bytes").is_short());
    }

    #[test]
    fn target_one_way_each_algorithm() {
        for (alg, want) in RESP {
            let log = Log::default();
            let mut t = target(&log).with_algorithms(&[alg]);
            let code = alg.code().to_string();
            let k = continue_keys(t.step("CHAP", &kv(&[("CHAP_A", &code)])));
            let ch = hex(&seq(0x11, alg.digest_len()));
            assert_eq!(
                k,
                kv(&[("CHAP_A", &code), ("CHAP_I", "16"), ("CHAP_C", &ch)])
            );
            let r = format!("0x{want}");
            let k = done_keys(t.step("CHAP", &kv(&[("CHAP_N", "alice"), ("CHAP_R", &r)])));
            assert!(k.is_empty());
            let log = log.lock().unwrap();
            assert_eq!(
                log.as_slice(),
                &[Ok(ChapSuccess {
                    user: "alice".into(),
                    algorithm: alg,
                    mutual: false
                })]
            );
        }
    }

    #[test]
    fn target_picks_first_allowed_of_initiator_list() {
        let pick = |offer: &str, allowed: &[ChapAlgorithm]| {
            let mut t = target(&Log::default()).with_algorithms(allowed);
            t.step("CHAP", &kv(&[("CHAP_A", offer)])).map(|p| match p {
                AuthProgress::Continue(k) => k[0].1.clone(),
                AuthProgress::Done(_) => panic!("done too early"),
            })
        };
        use ChapAlgorithm::*;
        assert_eq!(pick("8,7,6,5", &ChapAlgorithm::ALL).unwrap(), "8");
        assert_eq!(pick("5,7", &ChapAlgorithm::ALL).unwrap(), "5");
        assert_eq!(pick("8,7,6,5", &[Md5, Sha256]).unwrap(), "7");
        // Unknown values are skipped, hex numbers accepted.
        assert_eq!(pick("3,foo,0x5", &[Md5]).unwrap(), "5");
        // Nothing in common, or nothing valid: authentication failure (2/01).
        assert_eq!(pick("5", &[Sha256]), Err(status::AUTH_FAILED));
        assert_eq!(pick("1,2,3", &ChapAlgorithm::ALL), Err(status::AUTH_FAILED));
        assert_eq!(pick("", &ChapAlgorithm::ALL), Err(status::AUTH_FAILED));
        // The observer learns why.
        let log = Log::default();
        let mut t = target(&log).with_algorithms(&[Sha256]);
        assert!(t.step("CHAP", &kv(&[("CHAP_A", "5,6")])).is_err());
        assert_eq!(
            log.lock().unwrap()[0],
            Err(ChapError::NoCommonAlgorithm {
                offered: "5,6".into(),
                allowed: "7".into()
            })
        );
    }

    #[test]
    fn target_refusals() {
        let md5 = format!("0x{}", RESP[0].1);
        let fail = |keys2: &[(&str, &str)]| -> ChapError {
            let log = Log::default();
            let mut t = target(&log);
            continue_keys(t.step("CHAP", &kv(&[("CHAP_A", "5")])));
            assert_eq!(t.step("CHAP", &kv(keys2)), Err(status::AUTH_FAILED));
            // Over: nothing more is accepted.
            assert!(t.step("CHAP", &kv(&[("CHAP_A", "5")])).is_err());
            let e = log.lock().unwrap()[0].clone().unwrap_err();
            e
        };
        assert_eq!(
            fail(&[("CHAP_N", "alice"), ("CHAP_R", &hex(&[1; 16]))]),
            ChapError::WrongResponse("alice".into())
        );
        // The right response under another user's name.
        assert_eq!(
            fail(&[("CHAP_N", "bob"), ("CHAP_R", &md5)]),
            ChapError::WrongResponse("bob".into())
        );
        assert_eq!(
            fail(&[("CHAP_N", "mallory"), ("CHAP_R", &md5)]),
            ChapError::UnknownUser("mallory".into())
        );
        assert!(matches!(
            fail(&[("CHAP_N", "alice"), ("CHAP_R", &md5[..md5.len() - 2])]),
            ChapError::ResponseLength {
                got: 15,
                want: 16,
                ..
            }
        ));
        assert_eq!(fail(&[("CHAP_R", &md5)]), ChapError::MissingKey("CHAP_N"));
        assert_eq!(
            fail(&[("CHAP_N", "alice")]),
            ChapError::MissingKey("CHAP_R")
        );
        assert_eq!(
            fail(&[("CHAP_N", ""), ("CHAP_R", &md5)]),
            ChapError::BadName
        );
        assert!(matches!(
            fail(&[("CHAP_N", "alice"), ("CHAP_R", "69c2")]),
            ChapError::BadBinary { .. }
        ));
        assert!(matches!(
            fail(&[("CHAP_A", "5"), ("CHAP_N", "alice"), ("CHAP_R", &md5)]),
            ChapError::UnexpectedKey { .. }
        ));
        // Mutual: both CHAP_I and CHAP_C, a valid identifier, credentials configured.
        assert_eq!(
            fail(&[("CHAP_N", "alice"), ("CHAP_R", &md5), ("CHAP_I", "1")]),
            ChapError::MutualIncomplete
        );
        let c = hex(&seq(0x81, 16));
        assert!(matches!(
            fail(&[
                ("CHAP_N", "alice"),
                ("CHAP_R", &md5),
                ("CHAP_I", "256"),
                ("CHAP_C", &c)
            ]),
            ChapError::BadIdentifier(_)
        ));
        // Reflection (RFC 7143 9.2.1): our own challenge sent back.
        let ours = hex(&seq(0x11, 16));
        assert_eq!(
            fail(&[
                ("CHAP_N", "alice"),
                ("CHAP_R", &md5),
                ("CHAP_I", "9"),
                ("CHAP_C", &ours)
            ]),
            ChapError::ReflectedChallenge
        );
        // ... also when re-encoded in base64.
        let ours64 = encode_binary(&seq(0x11, 16), Encoding::Base64);
        assert_eq!(
            fail(&[
                ("CHAP_N", "alice"),
                ("CHAP_R", &md5),
                ("CHAP_I", "9"),
                ("CHAP_C", &ours64)
            ]),
            ChapError::ReflectedChallenge
        );
        // bob has no target credentials: his mutual request cannot be answered.
        let bob = ChapAlgorithm::Md5.response(16, &Secret::from("bob-secret-000"), &seq(0x11, 16));
        assert_eq!(
            fail(&[
                ("CHAP_N", "bob"),
                ("CHAP_R", &hex(&bob)),
                ("CHAP_I", "1"),
                ("CHAP_C", &c)
            ]),
            ChapError::MutualNotConfigured("bob".into())
        );
        // Keys before CHAP_A, and another method.
        let mut t = target(&Log::default());
        assert!(t.step("CHAP", &kv(&[("CHAP_N", "alice")])).is_err());
        let mut t = target(&Log::default());
        assert!(t.step("SRP", &kv(&[("CHAP_A", "5")])).is_err());
    }

    #[test]
    fn target_mutual_and_encodings() {
        for ((alg, resp), (_, mutual)) in RESP.into_iter().zip(MUTUAL) {
            for enc in [Encoding::Hex, Encoding::Base64] {
                let log = Log::default();
                let mut t = target(&log).with_encoding(enc);
                let k = continue_keys(t.step("CHAP", &kv(&[("CHAP_A", &alg.code().to_string())])));
                let ch = encode_binary(&seq(0x11, alg.digest_len()), enc);
                assert_eq!(k[2], ("CHAP_C".to_string(), ch));
                // Our response in the challenge's encoding; the initiator's challenge in the
                // other one: the answer follows the initiator's challenge.
                let (r, _) = decode_binary("t", &format!("0x{resp}")).unwrap();
                let other = match enc {
                    Encoding::Hex => Encoding::Base64,
                    Encoding::Base64 => Encoding::Hex,
                };
                let c = encode_binary(&seq(0x81, alg.digest_len()), other);
                let k = done_keys(t.step(
                    "CHAP",
                    &kv(&[
                        ("CHAP_N", "alice"),
                        ("CHAP_R", &encode_binary(&r, enc)),
                        ("CHAP_I", "128"),
                        ("CHAP_C", &c),
                    ]),
                ));
                let (m, _) = decode_binary("t", &format!("0x{mutual}")).unwrap();
                assert_eq!(
                    k,
                    kv(&[("CHAP_N", "disk1"), ("CHAP_R", &encode_binary(&m, other))])
                );
                assert!(log.lock().unwrap()[0].as_ref().unwrap().mutual);
            }
        }
    }

    #[test]
    fn target_challenge_length() {
        let mut t = target(&Log::default()).with_challenge_len(64);
        let k = continue_keys(t.step("CHAP", &kv(&[("CHAP_A", "5")])));
        assert_eq!(decode_binary("c", &k[2].1).unwrap().0, seq(0x11, 64));
        let mut t = target(&Log::default()).with_challenge_len(1);
        let k = continue_keys(t.step("CHAP", &kv(&[("CHAP_A", "5")])));
        assert_eq!(
            decode_binary("c", &k[2].1).unwrap().0.len(),
            MIN_CHALLENGE_LEN
        );
        // A configured length below the digest size is raised to it (found by fuzzing).
        let mut t = target(&Log::default()).with_challenge_len(16);
        let k = continue_keys(t.step("CHAP", &kv(&[("CHAP_A", "7")])));
        assert_eq!(decode_binary("c", &k[2].1).unwrap().0.len(), 32);
        let mut t = target(&Log::default()).with_challenge_len(5000);
        let k = continue_keys(t.step("CHAP", &kv(&[("CHAP_A", "8")])));
        assert_eq!(decode_binary("c", &k[2].1).unwrap().0.len(), MAX_BINARY_LEN);
    }

    fn initiator(mutual: bool, log: &Log) -> ChapInitiator {
        let mut c = ChapCredentials::new("alice", INI_SECRET);
        if mutual {
            c = c.with_mutual("disk1", TGT_SECRET);
        }
        let log = log.clone();
        ChapInitiator::new(c, counter(0x80))
            .unwrap()
            .with_observer(move |r| log.lock().unwrap().push(r.cloned().map_err(Clone::clone)))
    }

    #[test]
    fn initiator_one_way() {
        for (alg, want) in RESP {
            let log = Log::default();
            let mut i = initiator(false, &log);
            assert_eq!(i.methods(), vec!["CHAP".to_string()]);
            let k = continue_keys(i.step("CHAP", &[]));
            assert_eq!(k, kv(&[("CHAP_A", "8,7,6,5")]));
            let ch = seq(0x11, alg.digest_len());
            for enc in [Encoding::Hex, Encoding::Base64] {
                let mut i = initiator(false, &log);
                continue_keys(i.step("CHAP", &[]));
                let k = done_keys(i.step(
                    "CHAP",
                    &kv(&[
                        ("CHAP_A", &alg.code().to_string()),
                        ("CHAP_I", "0x10"),
                        ("CHAP_C", &encode_binary(&ch, enc)),
                    ]),
                ));
                let (r, _) = decode_binary("t", &format!("0x{want}")).unwrap();
                assert_eq!(
                    k,
                    kv(&[("CHAP_N", "alice"), ("CHAP_R", &encode_binary(&r, enc))])
                );
                assert!(!i.awaiting_final());
            }
        }
    }

    #[test]
    fn initiator_mutual() {
        for (alg, want) in MUTUAL {
            let log = Log::default();
            let mut i = initiator(true, &log).with_algorithms(&[alg]);
            assert_eq!(
                continue_keys(i.step("CHAP", &[])),
                kv(&[("CHAP_A", &alg.code().to_string())])
            );
            let ch = hex(&seq(0x11, alg.digest_len()));
            let code = alg.code().to_string();
            let k = continue_keys(i.step(
                "CHAP",
                &kv(&[("CHAP_A", &code), ("CHAP_I", "16"), ("CHAP_C", &ch)]),
            ));
            assert!(i.awaiting_final());
            // Our identifier and challenge come from the random source (seed 0x80).
            assert_eq!(k[2], ("CHAP_I".to_string(), "128".to_string()));
            assert_eq!(k[3].1, hex(&seq(0x81, alg.digest_len())));
            let k = done_keys(i.step(
                "CHAP",
                &kv(&[("CHAP_N", "disk1"), ("CHAP_R", &format!("0x{want}"))]),
            ));
            assert!(k.is_empty());
            assert!(log.lock().unwrap()[0].as_ref().unwrap().mutual);
        }
    }

    #[test]
    fn initiator_refusals() {
        let ch = hex(&seq(0x11, 16));
        let challenge = kv(&[("CHAP_A", "5"), ("CHAP_I", "16"), ("CHAP_C", &ch)]);
        // A target choosing an algorithm we did not offer.
        let mut i = initiator(false, &Log::default()).with_algorithms(&[ChapAlgorithm::Sha256]);
        continue_keys(i.step("CHAP", &[]));
        assert!(i.step("CHAP", &challenge).is_err());
        // CHAP keys before we offered CHAP_A.
        let mut i = initiator(false, &Log::default());
        assert!(i.step("CHAP", &challenge).is_err());
        let mutual_fail = |answer: Vec<(String, String)>| -> ChapError {
            let log = Log::default();
            let mut i = initiator(true, &log);
            continue_keys(i.step("CHAP", &[]));
            continue_keys(i.step("CHAP", &challenge));
            assert_eq!(i.step("CHAP", &answer), Err(status::AUTH_FAILED));
            let e = log.lock().unwrap()[0].clone().unwrap_err();
            e
        };
        let good = format!("0x{}", MUTUAL[0].1);
        assert!(matches!(
            mutual_fail(kv(&[("CHAP_N", "disk2"), ("CHAP_R", &good)])),
            ChapError::WrongTargetName { .. }
        ));
        assert_eq!(
            mutual_fail(kv(&[("CHAP_N", "disk1"), ("CHAP_R", &hex(&[0; 16]))])),
            ChapError::WrongResponse("disk1".into())
        );
        assert_eq!(
            mutual_fail(kv(&[("CHAP_N", "disk1")])),
            ChapError::MutualMissing
        );
        // A target answering with our own secret (RFC 7143 9.2.1).
        let own = ChapAlgorithm::Md5.response(128, &Secret::from(INI_SECRET), &seq(0x81, 16));
        assert_eq!(
            mutual_fail(kv(&[("CHAP_N", "disk1"), ("CHAP_R", &hex(&own))])),
            ChapError::OwnSecret
        );
        // A random source that would reflect the target's challenge is detected.
        let mut i = ChapInitiator::new(
            ChapCredentials::new("alice", INI_SECRET).with_mutual("disk1", TGT_SECRET),
            |b: &mut [u8]| {
                if b.len() > 1 {
                    b.copy_from_slice(&seq(0x11, b.len()));
                }
            },
        )
        .unwrap();
        continue_keys(i.step("CHAP", &[]));
        assert_eq!(i.step("CHAP", &challenge), Err(status::AUTH_FAILED));
    }
}
