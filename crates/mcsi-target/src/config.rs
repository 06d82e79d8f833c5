//! Target configuration: a TOML file describing targets, portals, LUNs and per-target negotiation
//! limits, or the same built from command-line flags. Validation errors name the field and say
//! what is allowed.
//!
//! Here: the validated specs (targets, LUNs, portals, authentication, the server's whole
//! configuration) and their checks. Below: `file` (the TOML as serde reads it), `limits`
//! (per-target and server-wide limits with their defaults), `qos` (the QoS grammar and plans),
//! `cli` (the command line's parsers) and `error`.

use crate::name;
use mcsi_proto::chap::ChapCredentials;
use mcsi_scsi::backend::Backend;
pub use mcsi_tcp::Congestion;
use serde::Deserialize;
use std::net::IpAddr;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

mod cli;
mod error;
mod file;
mod limits;
mod qos;
pub use cli::*;
use error::cerr;
pub use error::{ConfigError, ValueError};
pub use file::*;
pub use limits::*;
pub use mcsi_target_core::offer::TargetOffer;
pub use qos::*;

/// Default target name when none is given.
pub const DEFAULT_IQN: &str = "iqn.2026-01.org.mcsi:target";
/// Default portal.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:3260";
/// Default LUN when none is given.
pub const DEFAULT_LUN: &str = "ram:1GiB";

/// One CHAP user: the name and secret an initiator proves, and for mutual CHAP the name and
/// secret the target answers that initiator's challenge with. `Debug` leaves the secrets out.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChapUser {
    pub user: String,
    pub secret: String,
    pub mutual_user: Option<String>,
    pub mutual_secret: Option<String>,
}

impl std::fmt::Debug for ChapUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChapUser")
            .field("user", &self.user)
            .field("mutual_user", &self.mutual_user)
            .finish_non_exhaustive()
    }
}

impl ChapUser {
    /// As mcsi-proto's CHAP credentials.
    pub fn credentials(&self) -> ChapCredentials {
        let c = ChapCredentials::new(self.user.clone(), self.secret.as_str());
        match (&self.mutual_user, &self.mutual_secret) {
            (Some(u), Some(s)) => c.with_mutual(u.clone(), s.as_str()),
            _ => c,
        }
    }
}

/// A source network: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl std::fmt::Display for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl Network {
    /// `ADDR/PREFIX` or a bare address (a single host).
    pub fn parse(s: &str) -> Result<Network, ValueError> {
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = a
            .parse()
            .map_err(|_| ValueError::NotANetwork { text: s.into() })?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            None => max,
            Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(|| {
                ValueError::PrefixLength {
                    text: s.into(),
                    max,
                }
            })?,
        };
        Ok(Network { addr, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        // An IPv4 peer may arrive as an IPv4-mapped IPv6 address on a dual-stack socket.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        let bits = |a: IpAddr| -> u128 {
            match a {
                IpAddr::V4(v) => u128::from(u32::from(v)),
                IpAddr::V6(v) => u128::from(v),
            }
        };
        let width: u32 = if self.addr.is_ipv4() { 32 } else { 128 };
        if ip.is_ipv4() != self.addr.is_ipv4() {
            return false;
        }
        let host_bits = width - u32::from(self.prefix);
        if host_bits >= 128 {
            return true;
        }
        (bits(ip) >> host_bits) == (bits(self.addr) >> host_bits)
    }
}

/// Who may log in to a target (or to discovery), and how they prove it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AuthSpec {
    /// CHAP users; empty: AuthMethod=None.
    pub chap: Vec<ChapUser>,
    /// Allowed initiator names; empty: any.
    pub allow_initiators: Vec<String>,
    /// Allowed source networks; empty: any.
    pub allow_networks: Vec<Network>,
    /// CHAP algorithms allowed; empty: [`DEFAULT_CHAP_ALGORITHMS`].
    pub chap_algorithms: Vec<mcsi_proto::chap::ChapAlgorithm>,
}

/// The CHAP algorithms a target allows unless told otherwise: every one but MD5, which is
/// broken as a hash (an initiator that offers only MD5, such as libiscsi, needs
/// `chap_algorithms` to name it).
pub const DEFAULT_CHAP_ALGORITHMS: [mcsi_proto::chap::ChapAlgorithm; 3] = [
    mcsi_proto::chap::ChapAlgorithm::Sha3_256,
    mcsi_proto::chap::ChapAlgorithm::Sha256,
    mcsi_proto::chap::ChapAlgorithm::Sha1,
];

/// Checks that a CHAP secret is at least 12 bytes (RFC 7143 9.2.1), unless short ones are
/// allowed.
pub fn check_secret_len(field: &str, secret: &str, allow_short: bool) -> Result<(), ConfigError> {
    let len = secret.len();
    if !allow_short && len < mcsi_proto::chap::SHORT_SECRET_LEN {
        return Err(cerr(
            field,
            format!(
                "a CHAP secret of {len} bytes is too short: use at least {} (RFC 7143 9.2.1), or set allow_short_secrets = true where the channel is protected otherwise",
                mcsi_proto::chap::SHORT_SECRET_LEN
            ),
        ));
    }
    Ok(())
}

impl AuthSpec {
    /// Whether this initiator, connecting from `peer`, may log in (authorization, before any
    /// authentication).
    pub fn allows(&self, initiator: &str, peer: IpAddr) -> bool {
        (self.allow_initiators.is_empty() || self.allow_initiators.iter().any(|i| i == initiator))
            && (self.allow_networks.is_empty()
                || self.allow_networks.iter().any(|n| n.contains(peer)))
    }

    /// Validates a file's `auth` table.
    pub fn from_file(a: &FileAuth, field: &str) -> Result<AuthSpec, ConfigError> {
        let mut out = AuthSpec::default();
        for (i, u) in a.chap.iter().enumerate() {
            let f = format!("{field}.chap[{i}]");
            if u.mutual_user.is_some() != u.mutual_secret.is_some() {
                return Err(cerr(
                    f,
                    "mutual CHAP needs both mutual_user and mutual_secret",
                ));
            }
            u.credentials()
                .validate()
                .map_err(|e| cerr(f.clone(), e.to_string()))?;
            check_secret_len(&format!("{f}.secret"), &u.secret, a.allow_short_secrets)?;
            if let Some(m) = &u.mutual_secret {
                check_secret_len(&format!("{f}.mutual_secret"), m, a.allow_short_secrets)?;
            }
            if out.chap.iter().any(|x| x.user == u.user) {
                return Err(cerr(f, format!("CHAP user '{}' is listed twice", u.user)));
            }
            out.chap.push(u.clone());
        }
        if let Some(list) = &a.chap_algorithms {
            let f = format!("{field}.chap_algorithms");
            if list.is_empty() {
                return Err(cerr(f, "name at least one (SHA3-256, SHA256, SHA1, MD5)"));
            }
            for (i, n) in list.iter().enumerate() {
                let alg = mcsi_proto::chap::ChapAlgorithm::parse(n).ok_or_else(|| {
                    cerr(
                        format!("{f}[{i}]"),
                        format!("unknown CHAP algorithm '{n}' (use SHA3-256, SHA256, SHA1 or MD5)"),
                    )
                })?;
                if !out.chap_algorithms.contains(&alg) {
                    out.chap_algorithms.push(alg);
                }
            }
        }
        for (i, n) in a.allow_initiators.iter().enumerate() {
            name::validate(n)
                .map_err(|e| cerr(format!("{field}.allow_initiators[{i}]"), e.to_string()))?;
            out.allow_initiators.push(n.clone());
        }
        for (i, n) in a.allow_networks.iter().enumerate() {
            out.allow_networks.push(
                Network::parse(n)
                    .map_err(|why| cerr(format!("{field}.allow_networks[{i}]"), why))?,
            );
        }
        Ok(out)
    }
}

/// A validated LUN map: the initiator (lower case, as names compare) and its LUNs, by the
/// number it sees them under, to the target's number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LunMap {
    pub initiator: String,
    pub luns: std::collections::BTreeMap<u16, u16>,
}

/// `[[targets.lun_maps]]` checked against the target's LUN numbers `have`.
fn lun_maps(maps: &[FileLunMap], have: &[u16], at: &str) -> Result<Vec<LunMap>, ConfigError> {
    let mut out: Vec<LunMap> = Vec::with_capacity(maps.len());
    for (k, m) in maps.iter().enumerate() {
        let f = |x: &str| format!("{at}[{k}].{x}");
        let initiator = m.initiator.trim().to_ascii_lowercase();
        if initiator.is_empty() {
            return Err(cerr(f("initiator"), "empty; name the initiator (iqn....)"));
        }
        if out.iter().any(|o| o.initiator == initiator) {
            return Err(cerr(
                f("initiator"),
                format!("{initiator} has two maps; give it one"),
            ));
        }
        let mut luns = std::collections::BTreeMap::new();
        for (seen_as, &target_lun) in &m.luns {
            let n: u16 = seen_as.parse().ok().filter(|n| *n < 16384).ok_or_else(|| {
                cerr(
                    f("luns"),
                    format!("'{seen_as}' is not a LUN number (0 to 16383): write `luns = {{ 0 = 3 }}` for the target's LUN 3 seen as LUN 0"),
                )
            })?;
            if !have.contains(&target_lun) {
                return Err(cerr(
                    f("luns"),
                    format!("LUN {target_lun} is not one of this target's LUNs ({have:?})"),
                ));
            }
            if let Some((other, _)) = luns.iter().find(|(_, t)| **t == target_lun) {
                return Err(cerr(
                    f("luns"),
                    format!("the target's LUN {target_lun} is mapped twice (as {other} and {n})"),
                ));
            }
            luns.insert(n, target_lun);
        }
        if luns.is_empty() {
            return Err(cerr(
                f("luns"),
                "no LUN: an initiator that should see none belongs out of allow_initiators",
            ));
        }
        out.push(LunMap { initiator, luns });
    }
    Ok(out)
}

/// A validated `[targets.redirect]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redirect {
    /// "HOST:PORT", as TargetAddress gives it.
    pub to: String,
    /// Portals whose logins are redirected (empty: all).
    pub from: Vec<SocketAddr>,
    pub permanent: bool,
}

impl Redirect {
    /// Whether `to` is `local` itself (a login that arrived there is served, never sent on).
    pub fn points_at(&self, local: SocketAddr) -> bool {
        self.to.parse::<SocketAddr>().is_ok_and(|to| to == local)
    }

    /// Whether a login that arrived on `local` is redirected.
    pub fn applies(&self, local: SocketAddr) -> bool {
        self.from.is_empty()
            || self.from.iter().any(|p| {
                p.port() == local.port() && (p.ip().is_unspecified() || p.ip() == local.ip())
            })
    }
}

/// `HOST:PORT` as a TargetAddress may carry it: an IPv4 address, `[IPv6]` or a DNS name, and
/// a port.
pub fn check_address(field: &str, s: &str) -> Result<String, ConfigError> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a.to_string());
    }
    let bad = || {
        cerr(
            field,
            format!("'{s}' is not HOST:PORT (e.g. 203.0.113.7:3260, [2001:db8::7]:3260 or iscsi.example.com:3260)"),
        )
    };
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let name_ok = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if port == 0 || !name_ok {
        return Err(bad());
    }
    Ok(format!("{host}:{port}"))
}

/// Where a LUN's data lives: a spec opened when the server starts (what the TOML file and
/// `--lun` give), or a backend the caller opened itself (its own storage, or a wrapper such as
/// `FailingBackend` in tests).
#[derive(Clone)]
pub enum LunBackend {
    /// `ram:SIZE`, `file:PATH[:SIZE]`, `block:PATH` or
    /// `rbd:POOL/IMAGE[,conf=PATH][,id=NAME][,cache=on|off]`.
    Spec(String),
    Opened(Arc<dyn Backend>),
}

impl PartialEq for LunBackend {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (LunBackend::Spec(a), LunBackend::Spec(b)) => a == b,
            (LunBackend::Opened(a), LunBackend::Opened(b)) => {
                std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
            }
            _ => false,
        }
    }
}

impl Eq for LunBackend {}

impl std::fmt::Debug for LunBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LunBackend::Spec(s) => f.debug_tuple("Spec").field(s).finish(),
            LunBackend::Opened(b) => f.debug_tuple("Opened").field(&b.describe()).finish(),
        }
    }
}

impl From<&str> for LunBackend {
    fn from(s: &str) -> Self {
        LunBackend::Spec(s.to_owned())
    }
}

impl From<String> for LunBackend {
    fn from(s: String) -> Self {
        LunBackend::Spec(s)
    }
}

impl From<Arc<dyn Backend>> for LunBackend {
    fn from(b: Arc<dyn Backend>) -> Self {
        LunBackend::Opened(b)
    }
}

/// One LUN, validated; a backend spec is opened when the server starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LunSpec {
    /// The LUN's number as given (None: the lowest free one, [`TargetSpec::numbered`]).
    pub lun: Option<u16>,
    pub backend: LunBackend,
    pub block_size: u32,
    /// The physical block reported, a power-of-two multiple of `block_size` (None: the same).
    pub physical_block_size: Option<u32>,
    pub read_only: bool,
    pub serial: Option<String>,
    /// The NAA identifier (VPD 83h); none: derived from the rbd image, or from the target's
    /// name and the LUN's number.
    pub naa: Option<[u8; 16]>,
    /// Bytes per second a SANITIZE OVERWRITE may write (0: no limit).
    pub sanitize_rate: u64,
    /// Honour SANITIZE (any admitted initiator could otherwise erase the LUN).
    pub allow_sanitize: bool,
    /// Each read and write takes at least this long (zero: as fast as the backend).
    pub service_time: Duration,
}

impl LunSpec {
    /// A writable LUN of 512-byte blocks with a serial derived from the target and LUN.
    pub fn new(backend: impl Into<LunBackend>) -> Self {
        LunSpec {
            lun: None,
            backend: backend.into(),
            block_size: 512,
            physical_block_size: None,
            read_only: false,
            serial: None,
            naa: None,
            sanitize_rate: 0,
            allow_sanitize: false,
            service_time: Duration::ZERO,
        }
    }

    /// This spec with the identity a unit opened from it has (`serial`, `naa`): what the
    /// running configuration records, so that a saved file keeps the LUN's identity wherever
    /// it moves.
    pub fn with_identity(&self, serial: &str, naa: [u8; 16]) -> LunSpec {
        LunSpec {
            serial: Some(serial.to_string()),
            naa: Some(naa),
            ..self.clone()
        }
    }

    /// Whether the running LUN `self` is the one `wanted` (from a file) describes: the same in
    /// everything, its identity included where `wanted` names one.
    pub fn matches(&self, wanted: &LunSpec) -> bool {
        let bare = |l: &LunSpec| LunSpec {
            serial: None,
            naa: None,
            ..l.clone()
        };
        bare(self) == bare(wanted)
            && wanted
                .serial
                .as_ref()
                .is_none_or(|s| self.serial.as_ref() == Some(s))
            && wanted.naa.is_none_or(|n| self.naa == Some(n))
    }
}

/// A NAA identifier as written: 32 hex digits, NAA type 6 (registered extended).
pub fn parse_naa(s: &str) -> Result<[u8; 16], ValueError> {
    let bad = || ValueError::NotANaa { text: s.into() };
    if s.len() != 32 || !s.starts_with('6') {
        return Err(bad());
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2).ok_or_else(bad)?, 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// A NAA identifier as [`parse_naa`] reads it.
pub fn naa_text(naa: &[u8; 16]) -> String {
    naa.iter().map(|b| format!("{b:02x}")).collect()
}

/// `[[targets.port_groups]]` checked: None when there are none; else every group valid
/// ([`mcsi_scsi::alua::Alua::new`]) and this gateway's `tpgt` in one of them.
fn port_groups(
    groups: &[FilePortGroup],
    tpgt: u16,
) -> Result<Option<mcsi_scsi::alua::Alua>, String> {
    use mcsi_scsi::alua::{AccessState, Alua, PortGroup};
    if groups.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(groups.len());
    for g in groups {
        let state = AccessState::parse(&g.state).ok_or_else(|| {
            let names: Vec<&str> = AccessState::NAMES.iter().map(|(n, _)| *n).collect();
            format!(
                "group {}: state {:?}; use one of {}",
                g.id,
                g.state,
                names.join(", ")
            )
        })?;
        out.push(PortGroup {
            id: g.id,
            state,
            preferred: g.preferred,
            ports: g.ports.clone(),
        });
    }
    let alua = Alua::new(out).map_err(|e| e.0)?;
    if alua.group_of(tpgt).is_none() {
        return Err(format!(
            "this gateway's portal_group_tag {tpgt} is in no group; add it to the `ports` of its group"
        ));
    }
    Ok(Some(alua))
}

/// One target, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetSpec {
    pub iqn: String,
    pub alias: Option<String>,
    pub portals: Vec<SocketAddr>,
    /// What SendTargets gives in place of the portals ("HOST:PORT"; empty: the portals).
    pub advertise: Vec<String>,
    /// Where logins are sent instead (none: they are served).
    pub redirect: Option<Redirect>,
    pub luns: Vec<LunSpec>,
    pub limits: Limits,
    pub auth: AuthSpec,
    /// QoS of the sessions of the initiators named here, in place of `limits.qos`.
    pub qos_initiators: Vec<(String, QosSpec)>,
    /// Target portal group tag: the relative target port identifier of this gateway's port.
    pub tpgt: u16,
    /// ALUA target port groups (None: no ALUA); `tpgt` is in one of them.
    pub alua: Option<mcsi_scsi::alua::Alua>,
    /// Per-initiator LUN maps.
    pub lun_maps: Vec<LunMap>,
}

impl TargetSpec {
    /// The LUNs with their numbers: each its own `lun`, or the lowest number no LUN of the
    /// target names or took before it. [`ServerConfig::from_file_config`] refuses a number
    /// given twice.
    pub fn numbered(&self) -> Vec<(u16, &LunSpec)> {
        numbered(&self.luns)
    }

    /// The LUNs by number, each spec without its `lun` (the key is the number): what a reload
    /// compares and a save checks, so that a LUN given `lun = N` equals the same LUN numbered
    /// by its place.
    pub fn luns_by_number(&self) -> std::collections::BTreeMap<u16, LunSpec> {
        self.numbered()
            .into_iter()
            .map(|(n, l)| {
                let mut l = l.clone();
                l.lun = None;
                (n, l)
            })
            .collect()
    }

    /// The QoS of a session of `initiator`: its own if named (in any case), else the
    /// target's.
    pub fn qos_for(&self, initiator: &str) -> Option<QosSpec> {
        qos_for(&self.qos_initiators, self.limits.qos, initiator)
    }
}

/// The LUNs of a list with their numbers (see [`TargetSpec::numbered`]): a LUN without
/// `lun` takes the lowest number that no LUN of the list names and none before it took, so a
/// new LUN given an unused number moves no other (`[a, {lun = 2, b}, c]` is 0, 2, 1).
pub fn numbered(luns: &[LunSpec]) -> Vec<(u16, &LunSpec)> {
    let named: std::collections::BTreeSet<u16> = luns.iter().filter_map(|l| l.lun).collect();
    // At most 16384 LUNs: the numbers handed out stay below 2 x 16384.
    let mut next: u16 = 0;
    luns.iter()
        .map(|l| match l.lun {
            Some(n) => (n, l),
            None => {
                while named.contains(&next) {
                    next = next.wrapping_add(1);
                }
                let n = next;
                next = next.wrapping_add(1);
                (n, l)
            }
        })
        .collect()
}

/// Refuses a LUN number given twice.
pub fn check_numbers(luns: &[LunSpec]) -> Result<(), ValueError> {
    let mut seen = std::collections::BTreeMap::new();
    for (j, (n, _)) in numbered(luns).into_iter().enumerate() {
        if let Some(k) = seen.insert(n, j) {
            return Err(ValueError::LunGivenTwice {
                lun: n,
                first: k,
                second: j,
            });
        }
    }
    Ok(())
}

/// The whole server, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub targets: Vec<TargetSpec>,
    /// Who may open discovery sessions.
    pub discovery_auth: AuthSpec,
    /// Logins and connections, server-wide.
    pub limits: ServerLimits,
    /// Threads that run sessions, each session with all of its connections on one of them
    /// (the session threads of `shard`); 0 runs sessions on the runtime that starts the server.
    pub session_threads: usize,
    /// Portals listen with Multipath TCP (`IPPROTO_MPTCP`): an MPTCP initiator's subflows join
    /// its connection, and a plain TCP initiator is served as before (the kernel falls back).
    pub mptcp: bool,
    /// The control socket `mcsi ctl` talks to (none: no live administration).
    pub control: Option<std::path::PathBuf>,
    /// Where state that outlives the process is kept: persistent reservations made with
    /// APTPL (none: APTPL is refused, PTPL_C = 0).
    pub state_dir: Option<std::path::PathBuf>,
    /// The file this configuration was read from, as read (none: built from flags or code).
    pub source: Option<ConfigSource>,
    /// Access (CHAP users, allowed initiators) was set on the command line over the file's:
    /// saving to the file would write the flags' access into it.
    pub access_from_flags: bool,
}

/// A configuration file and its text as read: what `mcsi ctl save` writes the running LUNs and
/// access into, keeping the rest (comments included). `Debug` leaves the text out: it may hold
/// CHAP secrets.
#[derive(Clone, PartialEq, Eq)]
pub struct ConfigSource {
    pub path: std::path::PathBuf,
    pub text: String,
}

impl std::fmt::Debug for ConfigSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigSource")
            .field("path", &self.path)
            .field("bytes", &self.text.len())
            .finish()
    }
}

/// The default number of session threads: one per CPU the process may use.
pub fn default_session_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// At most this many session threads.
pub const MAX_SESSION_THREADS: usize = 1024;

impl ServerConfig {
    /// Every distinct portal, in first-seen order.
    pub fn portals(&self) -> Vec<SocketAddr> {
        let mut out: Vec<SocketAddr> = Vec::new();
        for t in &self.targets {
            for p in &t.portals {
                if !out.contains(p) {
                    out.push(*p);
                }
            }
        }
        out
    }

    /// Reads and validates a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| cerr(path.display().to_string(), format!("cannot read: {e}")))?;
        let mut cfg = Self::from_toml(&text).map_err(|mut e| {
            e.field = format!("{}: {}", path.display(), e.field);
            e
        })?;
        cfg.source = Some(ConfigSource {
            path: path.to_path_buf(),
            text,
        });
        Ok(cfg)
    }

    /// Parses and validates TOML text.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let file: FileConfig = toml::from_str(text).map_err(|e| {
            let msg = e.message().to_string();
            let at = e
                .span()
                .map(|s| {
                    let line = text[..s.start.min(text.len())].lines().count().max(1);
                    format!("line {line}")
                })
                .unwrap_or_else(|| "config".into());
            cerr(at, msg)
        })?;
        Self::from_file_config(&file)
    }

    /// Validates a parsed file.
    pub fn from_file_config(file: &FileConfig) -> Result<Self, ConfigError> {
        let global = parse_portals("listen", &file.listen)?;
        let advertise_all = file
            .advertise
            .iter()
            .enumerate()
            .map(|(i, a)| check_address(&format!("advertise[{i}]"), a))
            .collect::<Result<Vec<_>, _>>()?;
        if file.targets.is_empty() {
            return Err(cerr(
                "targets",
                "at least one [[targets]] entry is required",
            ));
        }
        let mut targets = Vec::new();
        for (i, t) in file.targets.iter().enumerate() {
            let at = |f: &str| format!("targets[{i}].{f}");
            name::validate(&t.iqn).map_err(|e| cerr(at("iqn"), e.to_string()))?;
            if targets.iter().any(|x: &TargetSpec| x.iqn == t.iqn) {
                return Err(cerr(
                    at("iqn"),
                    format!("'{}' is used by two targets", t.iqn),
                ));
            }
            let mut portals = parse_portals(&at("listen"), &t.listen)?;
            if portals.is_empty() {
                portals = global.clone();
            }
            if portals.is_empty() {
                return Err(cerr(
                    at("listen"),
                    "no portal: give `listen = [\"ADDR:PORT\"]` at the top or in the target",
                ));
            }
            if t.luns.is_empty() {
                return Err(cerr(
                    at("luns"),
                    "a target needs at least one [[targets.luns]]",
                ));
            }
            let mut luns = Vec::new();
            for (j, l) in t.luns.iter().enumerate() {
                let f = |x: &str| format!("targets[{i}].luns[{j}].{x}");
                check_backend_spec(&f("backend"), &l.backend)?;
                let block_size = l.block_size.unwrap_or(512);
                if !matches!(block_size, 512 | 1024 | 2048 | 4096) {
                    return Err(cerr(
                        f("block_size"),
                        format!("{block_size} is not supported (use 512, 1024, 2048 or 4096)"),
                    ));
                }
                if let Some(s) = &l.serial {
                    if s.is_empty() || s.len() > 32 || !s.bytes().all(|b| b.is_ascii_graphic()) {
                        return Err(cerr(
                            f("serial"),
                            "must be 1 to 32 printable ASCII characters without spaces",
                        ));
                    }
                }
                if let Some(p) = l.physical_block_size {
                    check_physical_block_size(p, block_size)
                        .map_err(|e| cerr(f("physical_block_size"), e))?;
                }
                let sanitize_rate = match &l.sanitize_rate {
                    Some(v) => v.bytes(&f("sanitize_rate"))?,
                    None => 0,
                };
                let service_time = match &l.service_time {
                    Some(v) => parse_service_time(&f("service_time"), v)?,
                    None => Duration::ZERO,
                };
                luns.push(LunSpec {
                    lun: l.lun,
                    backend: LunBackend::Spec(l.backend.clone()),
                    block_size,
                    physical_block_size: l.physical_block_size,
                    read_only: l.read_only,
                    serial: l.serial.clone(),
                    naa: l
                        .naa
                        .as_deref()
                        .map(parse_naa)
                        .transpose()
                        .map_err(|e| cerr(f("naa"), e))?,
                    sanitize_rate,
                    allow_sanitize: l.allow_sanitize,
                    service_time,
                });
            }
            if luns.len() > 16384 {
                return Err(cerr(at("luns"), "at most 16384 LUNs per target"));
            }
            check_numbers(&luns).map_err(|e| cerr(at("luns"), e))?;
            let limits = limits_from(t, &at)?;
            let auth = match &t.auth {
                Some(a) => AuthSpec::from_file(a, &at("auth"))?,
                None => AuthSpec::default(),
            };
            let qos_initiators = match &t.qos {
                Some(q) => target_qos(q, &at("qos"))?.1,
                None => Vec::new(),
            };
            let mut advertise = t
                .advertise
                .iter()
                .enumerate()
                .map(|(k, a)| check_address(&at(&format!("advertise[{k}]")), a))
                .collect::<Result<Vec<_>, _>>()?;
            if advertise.is_empty() {
                advertise = advertise_all.clone();
            }
            let redirect = match &t.redirect {
                None => None,
                Some(r) => {
                    let to = check_address(&at("redirect.to"), &r.to)?;
                    let from = parse_portals(&at("redirect.from"), &r.from)?;
                    for (k, f) in from.iter().enumerate() {
                        if !portals.contains(f) {
                            return Err(cerr(
                                at(&format!("redirect.from[{k}]")),
                                format!("{f} is not a portal of this target (its `listen`)"),
                            ));
                        }
                    }
                    let loops = to.parse::<SocketAddr>().ok().filter(|a| {
                        let r = Redirect {
                            to: String::new(),
                            from: from.clone(),
                            permanent: false,
                        };
                        // A wildcard portal on the same port takes logins to `to` as well.
                        let served = portals
                            .iter()
                            .any(|p| p == a || (p.ip().is_unspecified() && p.port() == a.port()));
                        served && r.applies(*a)
                    });
                    if let Some(a) = loops {
                        return Err(cerr(
                            at("redirect.to"),
                            format!("{a} is a portal whose logins are redirected: the initiator would go round in a loop (name the other portals in `from`)"),
                        ));
                    }
                    Some(Redirect {
                        to,
                        from,
                        permanent: r.permanent,
                    })
                }
            };
            let tpgt = match t.portal_group_tag {
                None => 1,
                Some(0) => {
                    return Err(cerr(
                        at("portal_group_tag"),
                        "0; portal group tags start at 1",
                    ))
                }
                Some(n) => n,
            };
            let alua = port_groups(&t.port_groups, tpgt).map_err(|e| cerr(at("port_groups"), e))?;
            let have: Vec<u16> = numbered(&luns).into_iter().map(|(n, _)| n).collect();
            let lun_maps = lun_maps(&t.lun_maps, &have, &at("lun_maps"))?;
            targets.push(TargetSpec {
                iqn: t.iqn.clone(),
                alias: t.alias.clone(),
                portals,
                advertise,
                redirect,
                luns,
                limits,
                auth,
                qos_initiators,
                tpgt,
                alua,
                lun_maps,
            });
        }
        let discovery_auth = match file.discovery.as_ref().and_then(|d| d.auth.as_ref()) {
            Some(a) => AuthSpec::from_file(a, "discovery.auth")?,
            None => AuthSpec::default(),
        };
        let limits = match &file.limits {
            Some(l) => ServerLimits::from_file(l)?,
            None => ServerLimits::default(),
        };
        let session_threads = match file.session_threads {
            None => default_session_threads(),
            Some(n) if n <= MAX_SESSION_THREADS => n,
            Some(n) => {
                return Err(cerr(
                    "session_threads",
                    format!("{n} is too many (at most {MAX_SESSION_THREADS}; 0 runs sessions on the main runtime)"),
                ))
            }
        };
        Ok(ServerConfig {
            targets,
            discovery_auth,
            limits,
            session_threads,
            mptcp: file.mptcp,
            control: match file.control.as_deref() {
                None => None,
                Some("") => {
                    return Err(cerr(
                        "control",
                        "an empty path; name the socket's file, e.g. /run/mcsi/control.sock",
                    ))
                }
                Some(p) => Some(std::path::PathBuf::from(p)),
            },
            state_dir: match file.state_dir.as_deref() {
                None => None,
                Some("") => {
                    return Err(cerr(
                        "state_dir",
                        "an empty path; name a directory, e.g. /var/lib/mcsi",
                    ))
                }
                Some(p) => Some(std::path::PathBuf::from(p)),
            },
            source: None,
            access_from_flags: false,
        })
    }
}

/// Checks the form of a backend spec without opening it.
pub fn check_backend_spec(field: &str, spec: &str) -> Result<(), ConfigError> {
    let allowed = "(use ram:SIZE, file:PATH[:SIZE], block:PATH, rbd:POOL/IMAGE)";
    let bad = |why: String| cerr(field, format!("{why} {allowed}"));
    let Some((kind, rest)) = spec.split_once(':') else {
        return Err(bad(format!("unknown backend '{spec}'")));
    };
    match kind {
        "ram" => {
            let size = mcsi_units::parse_size(rest).map_err(|e| bad(format!("{e};")))?;
            if size == 0 {
                return Err(bad(format!("'{spec}': size must be above zero;")));
            }
            Ok(())
        }
        "file" | "block" if !rest.is_empty() => Ok(()),
        // Checked in full when opened (librbd's pool and image names).
        "rbd" => match rest.split(',').next().and_then(|n| n.split_once('/')) {
            Some((p, i)) if !p.is_empty() && !i.is_empty() => Ok(()),
            _ => Err(bad(format!("'{spec}': give rbd:POOL/IMAGE;"))),
        },
        "file" | "block" => Err(bad(format!("'{spec}': missing path;"))),
        _ => Err(bad(format!("unknown backend '{spec}'"))),
    }
}

/// A physical block size must be a power-of-two multiple of the logical one, at most 2^15 of
/// them (the exponent READ CAPACITY(16) has room for).
fn check_physical_block_size(physical: u32, block_size: u32) -> Result<(), ValueError> {
    let ok = physical >= block_size
        && physical.is_multiple_of(block_size)
        && (physical / block_size).is_power_of_two()
        && (physical / block_size) <= 1 << 15;
    if ok {
        Ok(())
    } else {
        Err(ValueError::PhysicalBlockSize {
            physical,
            block_size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_turns_the_keepalive_and_timeouts_off_rather_than_picking_a_default() {
        let c = ServerConfig::from_toml(
            "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\nnop_interval = \"0\"\ndata_out_timeout = \"0s\"\n[[targets.luns]]\nbackend=\"ram:1M\"\n",
        )
        .unwrap();
        let l = &c.targets[0].limits;
        assert_eq!(l.offer.nop_interval, Duration::ZERO);
        assert_eq!(l.data_out_timeout, Duration::ZERO);
        assert_ne!(Limits::default().offer.nop_interval, Duration::ZERO);
    }

    #[test]
    fn service_time_parses_and_is_bounded() {
        let l = parse_lun_arg("--lun", "ram:1MiB,service_time=8ms").unwrap();
        assert_eq!(l.service_time, Duration::from_millis(8));
        assert_eq!(
            parse_lun_arg("--lun", "ram:1MiB,service_time=2.5ms")
                .unwrap()
                .service_time,
            Duration::from_micros(2500)
        );
        let e = parse_lun_arg("--lun", "ram:1MiB,service_time=11s").unwrap_err();
        assert!(e.to_string().contains("above 10s"), "{e}");
        let e = parse_lun_arg("--lun", "ram:1MiB,service_time=fast").unwrap_err();
        assert!(e.to_string().contains("e.g. 8ms"), "{e}");
    }

    #[test]
    fn rbd_lun_args_keep_the_cluster_options_in_the_backend_spec() {
        let l = parse_lun_arg(
            "--lun",
            "rbd:mcsi/disk,conf=/c/ceph.conf,id=admin,cache=on,read_only",
        )
        .unwrap();
        assert_eq!(
            l.backend,
            LunBackend::Spec("rbd:mcsi/disk,conf=/c/ceph.conf,id=admin,cache=on".into())
        );
        assert!(l.read_only);
        // Only an rbd: LUN takes them; an rbd: spec needs POOL/IMAGE.
        assert!(parse_lun_arg("--lun", "ram:1MiB,conf=/c").is_err());
        let e = parse_lun_arg("--lun", "rbd:disk").unwrap_err();
        assert!(e.to_string().contains("rbd:POOL/IMAGE"), "{e}");
    }

    #[test]
    fn port_groups_are_read_and_checked() {
        let file = |groups: &str, tag: &str| {
            ServerConfig::from_toml(&format!(
                r#"
                listen = ["127.0.0.1:3261"]
                [[targets]]
                iqn = "iqn.2026-01.org.mcsi:a"
                {tag}
                luns = [{{ backend = "ram:1MiB" }}]
                {groups}
                "#
            ))
        };
        let two = r#"
            [[targets.port_groups]]
            id = 1
            state = "active/optimized"
            ports = [1]
            preferred = true
            [[targets.port_groups]]
            id = 2
            state = "Standby"
            ports = [2, 3]
        "#;
        let c = file(two, "portal_group_tag = 3").unwrap();
        let t = &c.targets[0];
        assert_eq!(t.tpgt, 3);
        let a = t.alua.as_ref().unwrap();
        assert_eq!(a.state_of(3), mcsi_scsi::alua::AccessState::Standby);
        assert!(a.groups()[0].preferred);
        let c = file("", "").unwrap();
        assert_eq!((c.targets[0].tpgt, c.targets[0].alua.is_none()), (1, true));
        for (groups, tag, why) in [
            (
                two,
                "portal_group_tag = 4",
                "portal_group_tag 4 is in no group",
            ),
            (two, "portal_group_tag = 0", "portal group tags start at 1"),
            (
                "[[targets.port_groups]]\nid = 1\nstate = \"primary\"\nports = [1]",
                "",
                "use one of active/optimized",
            ),
            (
                "[[targets.port_groups]]\nid = 1\nstate = \"standby\"\nports = []",
                "",
                "has no port",
            ),
        ] {
            let e = file(groups, tag).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("targets[0]"), "{e}");
        }
    }

    #[test]
    fn lun_maps_are_read_and_checked() {
        let file = |maps: &str| {
            ServerConfig::from_toml(&format!(
                r#"
                listen = ["127.0.0.1:3261"]
                [[targets]]
                iqn = "iqn.2026-01.org.mcsi:a"
                luns = [{{ backend = "ram:1MiB" }}, {{ backend = "ram:1MiB", lun = 3 }}]
                {maps}
                "#
            ))
        };
        let c = file(
            "[[targets.lun_maps]]\ninitiator = \"IQN.2026-01.org.mcsi:Host\"\nluns = { 0 = 3, 7 = 0 }",
        )
        .unwrap();
        let m = &c.targets[0].lun_maps[0];
        assert_eq!(m.initiator, "iqn.2026-01.org.mcsi:host");
        assert_eq!(m.luns, [(0, 3), (7, 0)].into_iter().collect());
        for (maps, why) in [
            ("luns = { 0 = 4 }", "LUN 4 is not one of this target's LUNs"),
            ("luns = { 0 = 3, 1 = 3 }", "mapped twice"),
            ("luns = { x = 3 }", "'x' is not a LUN number"),
            ("luns = {}", "no LUN"),
        ] {
            let e = file(&format!(
                "[[targets.lun_maps]]\ninitiator = \"iqn.2026-01.org.mcsi:h\"\n{maps}"
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains(why) && e.contains("lun_maps[0]"), "{e}");
        }
        let twice = "[[targets.lun_maps]]\ninitiator = \"iqn.x:h\"\nluns = { 0 = 3 }\n[[targets.lun_maps]]\ninitiator = \"IQN.x:H\"\nluns = { 0 = 0 }";
        assert!(file(twice).unwrap_err().to_string().contains("two maps"));
    }

    #[test]
    fn full_file() {
        let c = ServerConfig::from_toml(
            r#"
            listen = ["127.0.0.1:3261"]
            [limits]
            login_rate = 5
            login_burst = 10
            login_timeout = "10s"
            max_server_connections = 100
            max_logins_per_source = 8
            unsolicited_budget = "32MiB"
            [[targets]]
            iqn = "iqn.2026-01.org.mcsi:a"
            max_connections = 4
            max_sessions = 16
            max_target_connections = 32
            max_burst_length = "512KiB"
            first_burst_length = 65536
            initial_r2t = true
            queue_depth = 32
            nop_interval = "10s"
            nop_timeout = "500ms"
            asymmetric = false
            [[targets.luns]]
            backend = "ram:64MiB"
            [[targets.luns]]
            backend = "ram:1GiB"
            block_size = 4096
            read_only = true
            serial = "disk2"
            [[targets]]
            iqn = "iqn.2026-01.org.mcsi:b"
            listen = ["127.0.0.1:3262", "[::1]:3262"]
            [[targets.luns]]
            backend = "file:/tmp/x.img:1G"
            "#,
        )
        .unwrap();
        assert_eq!(c.targets.len(), 2);
        let a = &c.targets[0];
        assert_eq!(a.limits.offer.max_connections, 4);
        assert_eq!(a.limits.offer.max_burst_length, 524_288);
        assert!(a.limits.offer.initial_r2t);
        assert_eq!(a.limits.offer.queue_depth, 32);
        assert_eq!(a.limits.offer.nop_interval, Duration::from_secs(10));
        assert_eq!(a.limits.offer.nop_timeout, Duration::from_millis(500));
        assert_eq!(
            c.targets[1].limits.offer.nop_interval,
            Duration::from_secs(30)
        );
        assert!(!a.limits.offer.asymmetric && c.targets[1].limits.offer.asymmetric);
        assert_eq!(
            (a.limits.max_sessions, a.limits.max_target_connections),
            (16, 32)
        );
        let b = c.targets[1].limits;
        assert_eq!((b.max_sessions, b.max_target_connections), (256, 1024));
        assert_eq!(
            c.limits,
            ServerLimits {
                login_rate: 5,
                login_burst: 10,
                login_timeout: Duration::from_secs(10),
                max_server_connections: 100,
                max_logins_per_source: 8,
                write_budget: 128 << 20,
                read_budget: 128 << 20,
                unsolicited_budget: 32 << 20,
                retention_budget: 128 << 20,
                sent_log_budget: 128 << 20,
            }
        );
        assert_eq!(a.luns[0].backend, LunBackend::Spec("ram:64MiB".into()));
        assert_eq!(a.luns[1].block_size, 4096);
        assert!(a.luns[1].read_only);
        assert_eq!(a.portals, vec!["127.0.0.1:3261".parse().unwrap()]);
        assert_eq!(c.targets[1].portals.len(), 2);
        assert_eq!(c.portals().len(), 3);
    }

    #[test]
    fn auth_tables() {
        let c = ServerConfig::from_toml(
            r#"
            listen = ["127.0.0.1:3261"]
            [discovery.auth]
            chap = [{ user = "disc", secret = "discovery-secret" }]
            [[targets]]
            iqn = "iqn.2026-01.org.mcsi:a"
            [targets.auth]
            chap = [{ user = "u1", secret = "secret-one-12", mutual_user = "tgt", mutual_secret = "secret-two-34" }]
            allow_initiators = ["iqn.2026-01.org.mcsi:host"]
            allow_networks = ["10.1.0.0/16", "::1"]
            [[targets.luns]]
            backend = "ram:1M"
            "#,
        )
        .unwrap();
        assert_eq!(c.discovery_auth.chap[0].user, "disc");
        let a = &c.targets[0].auth;
        assert_eq!(a.chap[0].mutual_user.as_deref(), Some("tgt"));
        assert!(
            !format!("{a:?}").contains("secret-one"),
            "Debug shows no secret"
        );
        assert!(a.chap_algorithms.is_empty(), "the default set");
        let host = "iqn.2026-01.org.mcsi:host";
        assert!(a.allows(host, "10.1.200.3".parse().unwrap()));
        assert!(a.allows(host, "::1".parse().unwrap()));
        assert!(a.allows(host, "::ffff:10.1.0.9".parse().unwrap()));
        assert!(!a.allows(host, "10.2.0.1".parse().unwrap()));
        assert!(!a.allows("iqn.2026-01.org.mcsi:other", "10.1.0.1".parse().unwrap()));
        assert!(AuthSpec::default().allows("anything", "192.0.2.1".parse().unwrap()));
        assert!(Network::parse("0.0.0.0/0")
            .unwrap()
            .contains("203.0.113.9".parse().unwrap()));
        assert!(Network::parse("10.0.0.0/33").is_err());

        let bad = |auth: &str| {
            ServerConfig::from_toml(&format!(
                "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\n[targets.auth]\n{auth}\n[[targets.luns]]\nbackend=\"ram:1M\"\n"
            ))
            .unwrap_err()
        };
        let e = bad(r#"chap = [{ user = "u", secret = "" }]"#);
        assert_eq!(e.field, "targets[0].auth.chap[0]");
        let e = bad(r#"chap = [{ user = "u", secret = "s1", mutual_user = "t" }]"#);
        assert!(e.why.contains("mutual_secret"), "{e}");
        let e = bad(
            r#"chap = [{ user = "u", secret = "same", mutual_user = "t", mutual_secret = "same" }]"#,
        );
        assert!(e.why.contains("9.2.1"), "{e}");
        let e = bad(r#"allow_networks = ["10.0.0.0/40"]"#);
        assert_eq!(e.field, "targets[0].auth.allow_networks[0]");
        // Secrets under 12 bytes, unless allowed; algorithms by name.
        let e = bad(r#"chap = [{ user = "u", secret = "short-1" }]"#);
        assert_eq!(e.field, "targets[0].auth.chap[0].secret");
        assert!(e.why.contains("allow_short_secrets"), "{e}");
        let e = bad(
            r#"chap = [{ user = "u", secret = "long-enough-1", mutual_user = "t", mutual_secret = "short" }]"#,
        );
        assert_eq!(e.field, "targets[0].auth.chap[0].mutual_secret");
        let e = bad(r#"chap_algorithms = ["SHA256", "ROT13"]"#);
        assert_eq!(e.field, "targets[0].auth.chap_algorithms[1]");
        let ok = |auth: &str| {
            ServerConfig::from_toml(&format!(
                "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\n[targets.auth]\n{auth}\n[[targets.luns]]\nbackend=\"ram:1M\"\n"
            ))
            .unwrap()
        };
        let c = ok("allow_short_secrets = true\nchap = [{ user = \"u\", secret = \"short-1\" }]\nchap_algorithms = [\"md5\", \"SHA-256\"]");
        assert_eq!(
            c.targets[0].auth.chap_algorithms,
            vec![
                mcsi_proto::chap::ChapAlgorithm::Md5,
                mcsi_proto::chap::ChapAlgorithm::Sha256
            ]
        );
    }

    #[test]
    fn errors_name_the_field() {
        let e = ServerConfig::from_toml(
            r#"
            listen = ["127.0.0.1:3261"]
            [[targets]]
            iqn = "iqn.2026-01.org.mcsi:a"
            [[targets.luns]]
            backend = "ram:1G"
            [[targets]]
            iqn = "iqn.2026-01.org.mcsi:b"
            [[targets.luns]]
            backend = "rom:1G"
            "#,
        )
        .unwrap_err();
        assert_eq!(e.field, "targets[1].luns[0].backend");
        assert!(e.to_string().contains("unknown backend 'rom:1G'"), "{e}");
        assert!(
            e.to_string()
                .contains("use ram:SIZE, file:PATH[:SIZE], block:PATH"),
            "{e}"
        );

        let e = ServerConfig::from_toml(
            "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"target0\"\n[[targets.luns]]\nbackend=\"ram:1M\"\n",
        )
        .unwrap_err();
        assert_eq!(e.field, "targets[0].iqn");

        let e = ServerConfig::from_toml("[[targets]]\niqn = \"iqn.2026-01.org.x\"\nbogus = 1\n")
            .unwrap_err();
        assert!(e.why.contains("bogus"), "{e}");

        let e = ServerConfig::from_toml(
            "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\nfirst_burst_length = \"2MiB\"\n[[targets.luns]]\nbackend=\"ram:1M\"\n",
        )
        .unwrap_err();
        assert_eq!(e.field, "targets[0].first_burst_length");
        let e = ServerConfig::from_toml(
            "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\nmax_recv_data_segment_length = 100\n[[targets.luns]]\nbackend=\"ram:1M\"\n",
        )
        .unwrap_err();
        assert!(e.why.contains("512 to 16777215"), "{e}");

        let erl = |v: &str| {
            ServerConfig::from_toml(&format!(
                "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\nmax_erl = {v}\n[[targets.luns]]\nbackend=\"ram:1M\"\n"
            ))
        };
        assert_eq!(erl("0").unwrap().targets[0].limits.offer.max_erl, 0);
        assert_eq!(erl("2").unwrap().targets[0].limits.offer.max_erl, 2);
        let e = erl("3").unwrap_err();
        assert_eq!(e.field, "targets[0].max_erl");
        assert!(e.why.contains("0 to 2"), "{e}");
    }

    #[test]
    fn response_policy_is_parsed_with_its_weights() {
        let with = |p: &str| {
            ServerConfig::from_toml(&format!(
                "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\nresponse_policy = \"{p}\"\n[[targets.luns]]\nbackend=\"ram:1M\"\n"
            ))
        };
        let c = with("tcp-aware").unwrap();
        assert_eq!(
            c.targets[0].limits.response_policy,
            ResponsePolicy::TcpAware
        );
        let c = with("weighted:3,1").unwrap();
        match c.targets[0].limits.response_policy {
            ResponsePolicy::Weighted { weights, n } => {
                assert_eq!((n, weights[0], weights[1], weights[2]), (2, 3, 1, 1));
            }
            other => panic!("{other:?}"),
        }
        let e = with("fastest").unwrap_err();
        assert_eq!(e.field, "targets[0].response_policy");
        assert!(e.why.contains("tcp-aware"), "{e}");
        let many = vec!["1"; 17].join(",");
        let e = with(&format!("weighted:{many}")).unwrap_err();
        assert!(e.why.contains("at most 16"), "{e}");
        assert!(with("weighted:0,0").is_err());
        assert!(ResponsePolicy::default().scheduler().is_none());
    }

    #[test]
    fn congestion_control_is_checked_against_the_kernel() {
        let with = |cc: &str| {
            ServerConfig::from_toml(&format!(
                "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\ncongestion = \"{cc}\"\n[[targets.luns]]\nbackend=\"ram:1M\"\n"
            ))
        };
        let c = with("reno").unwrap();
        assert_eq!(c.targets[0].limits.congestion.unwrap().as_str(), "reno");
        let e = with("nosuchcc").unwrap_err();
        assert_eq!(e.field, "targets[0].congestion");
        assert!(
            e.why.contains("not available") && e.why.contains("reno"),
            "{e}"
        );
        let e = with("Reno").unwrap_err();
        assert!(e.why.contains("not a valid name"), "{e}");
    }

    #[test]
    fn limits_are_checked() {
        let bad = |top: &str, target: &str| {
            ServerConfig::from_toml(&format!(
                "listen=[\"127.0.0.1:1\"]\n{top}\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\n{target}\n[[targets.luns]]\nbackend=\"ram:1M\"\n"
            ))
            .unwrap_err()
        };
        let e = bad("[limits]\nlogin_burst = 0", "");
        assert_eq!(e.field, "limits.login_burst");
        assert!(e.why.contains("login_rate = 0"), "{e}");
        assert_eq!(
            bad("[limits]\nlogin_timeout = \"0\"", "").field,
            "limits.login_timeout"
        );
        let e = bad("[limits]\nmax_server_connections = 0", "");
        assert_eq!(e.field, "limits.max_server_connections");
        assert!(bad("[limits]\nmax_connections = 1", "")
            .why
            .contains("max_connections"));
        assert_eq!(bad("", "max_sessions = 0").field, "targets[0].max_sessions");
        assert_eq!(
            bad("", "max_sessions = 65536").field,
            "targets[0].max_sessions"
        );
        let e = bad("", "max_target_connections = 0");
        assert_eq!(e.field, "targets[0].max_target_connections");
        // No rate limit at all is allowed, burst or not.
        let c = ServerConfig::from_toml(
            "listen=[\"127.0.0.1:1\"]\n[limits]\nlogin_rate = 0\nlogin_burst = 0\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\n[[targets.luns]]\nbackend=\"ram:1M\"\n",
        )
        .unwrap();
        assert_eq!(c.limits.login_rate, 0);
    }

    #[test]
    fn a_duration_without_its_unit_is_refused() {
        let f = |t: &str| {
            ServerConfig::from_toml(&format!(
                "listen=[\"127.0.0.1:3260\"]\n[[targets]]\niqn=\"iqn.2026-01.org.x:t\"\nluns=[{{backend=\"ram:1MiB\"}}]\n{t}\n"
            ))
        };
        for bare in [
            "nop_interval = \"30\"",
            "send_timeout = \"5\"",
            "data_out_timeout = \"20\"",
        ] {
            let e = f(bare).unwrap_err().to_string();
            assert!(
                e.contains("without a unit") && e.contains("ms"),
                "{bare}: {e}"
            );
        }
        assert_eq!(
            f("nop_interval = \"0\"").unwrap().targets[0]
                .limits
                .offer
                .nop_interval,
            Duration::ZERO
        );
        assert_eq!(
            f("nop_interval = \"1500ms\"").unwrap().targets[0]
                .limits
                .offer
                .nop_interval,
            Duration::from_millis(1500)
        );
        assert!(parse_lun_arg("--lun", "ram:1MiB,service_time=8").is_err());
        assert_eq!(
            parse_lun_arg("--lun", "ram:1MiB,service_time=8ms")
                .unwrap()
                .service_time,
            Duration::from_millis(8)
        );
    }

    #[test]
    fn advertise_and_redirect_are_checked() {
        let f = |t: &str| {
            ServerConfig::from_toml(&format!(
                "listen=[\"127.0.0.1:3260\", \"127.0.0.1:3261\"]\nadvertise=[\"iscsi.example.com:3260\"]\n[[targets]]\niqn=\"iqn.2026-01.org.x:t\"\nluns=[{{backend=\"ram:1MiB\"}}]\n{t}"
            ))
        };
        let c = f("").unwrap();
        assert_eq!(c.targets[0].advertise, ["iscsi.example.com:3260"]);
        let c = f("advertise=[\"[2001:db8::7]:3260\"]\n").unwrap();
        assert_eq!(c.targets[0].advertise, ["[2001:db8::7]:3260"]);
        for bad in [
            "advertise=[\"no port\"]",
            "advertise=[\"a..b:3260\"]",
            "advertise=[\"h:0\"]",
        ] {
            let e = f(&format!("{bad}\n")).unwrap_err().to_string();
            assert!(e.contains("is not HOST:PORT"), "{bad}: {e}");
        }
        let c =
            f("[targets.redirect]\nto=\"127.0.0.1:3261\"\nfrom=[\"127.0.0.1:3260\"]\n").unwrap();
        let r = c.targets[0].redirect.clone().unwrap();
        assert!(r.applies("127.0.0.1:3260".parse().unwrap()));
        assert!(!r.applies("127.0.0.1:3261".parse().unwrap()));
        // Every portal redirected to one of them: a loop.
        let e = f("[targets.redirect]\nto=\"127.0.0.1:3261\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("loop"), "{e}");
        // A wildcard portal on the port of `to` takes those logins too: a loop as well.
        let w = ServerConfig::from_toml(
            "listen=[\"0.0.0.0:3270\"]\n[[targets]]\niqn=\"iqn.2026-01.org.x:t\"\nluns=[{backend=\"ram:1MiB\"}]\n[targets.redirect]\nto=\"10.0.0.5:3270\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(w.contains("loop"), "{w}");
        let e = f("[targets.redirect]\nto=\"10.0.0.1:3260\"\nfrom=[\"127.0.0.1:9\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a portal of this target"), "{e}");
    }

    #[test]
    fn example_file_is_valid_and_shows_the_defaults() {
        let c = ServerConfig::from_toml(include_str!("../../../examples/mcsi.toml")).unwrap();
        assert_eq!(c.limits, ServerLimits::default());
        let (d, t) = (Limits::default(), c.targets[0].limits);
        assert_eq!(
            (t.max_sessions, t.max_target_connections),
            (d.max_sessions, d.max_target_connections)
        );
        let nums: Vec<u16> = c.targets[0].numbered().iter().map(|(n, _)| *n).collect();
        assert_eq!(nums, [0, 1, 10]);
    }

    #[test]
    fn qos_from_a_table_or_an_argument() {
        let file = |qos: &str| {
            ServerConfig::from_toml(&format!(
                "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\n[[targets.luns]]\nbackend=\"ram:1M\"\n[targets.qos]\n{qos}"
            ))
        };
        let c = file("to_client = \"10MiB\"\n").unwrap();
        assert_eq!(
            c.targets[0].limits.qos,
            Some(QosSpec::Rates {
                to_client: Some(10 << 20),
                to_storage: None,
                burst: None
            })
        );
        let c = file("read_ratio = 1.0\niops = 82\nsize = \"1KiB\"\nrt = \"10ms\"\n").unwrap();
        let Some(QosSpec::Requirement(q)) = c.targets[0].limits.qos else {
            panic!("{:?}", c.targets[0].limits.qos)
        };
        assert_eq!((q.size_bytes, q.alpha), (1024, 0.2));
        assert!((q.rt_s - 0.010).abs() < 1e-12);
        let e = file("read_ratio = 1.0\nto_storage = 5\n").unwrap_err();
        assert_eq!(e.field, "targets[0].qos");
        let e = file("to_client = 0\n").unwrap_err();
        assert_eq!(e.field, "targets[0].qos.to_client");
        assert!(file("speed = 3\n").is_err());
        // The same through --qos.
        assert_eq!(
            parse_qos_arg("--qos", "to_client=10MiB").unwrap(),
            (c_rates(Some(10 << 20), None), None)
        );
        assert_eq!(
            parse_qos_arg("--qos", "to_client=1MiB,capacity=4MiB").unwrap(),
            (c_rates(Some(1 << 20), None), Some(4 << 20))
        );
        let c = file("to_client = \"1MiB\"\ncapacity = \"3MiB\"\n").unwrap();
        assert_eq!(c.targets[0].limits.qos_capacity, Some(3 << 20));
        let e =
            parse_qos_arg("--qos", "iops=3,size=1KiB,rt=1ms,read_ratio=0.5,alpha=1.5").unwrap_err();
        assert!(e.to_string().contains("alpha"), "{e}");
        assert!(parse_qos_arg("--qos", "to_client").is_err());
    }

    #[test]
    fn qos_per_initiator() {
        let file = |qos: &str| {
            ServerConfig::from_toml(&format!(
                "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\n[[targets.luns]]\nbackend=\"ram:1M\"\n[targets.qos]\n{qos}"
            ))
        };
        let db = "iqn.2026-01.org.x:db";
        let q4 = "read_ratio = 0.0\niops = 208\nsize = \"64KiB\"\nrt = \"22ms\"\n";
        // Named initiators alone: the others are not limited.
        let c = file(&format!(
            "capacity = \"20MiB\"\n[targets.qos.initiators.\"{db}\"]\n{q4}"
        ))
        .unwrap();
        let t = &c.targets[0];
        assert_eq!(t.limits.qos, None);
        assert_eq!(t.limits.qos_capacity, Some(20 << 20));
        assert!(matches!(t.qos_for(db), Some(QosSpec::Requirement(r)) if r.iops == 208.0));
        assert_eq!(t.qos_for("iqn.2026-01.org.x:other"), None);
        assert!(
            t.qos_for(&db.to_uppercase()).is_some(),
            "names match in any case"
        );
        // With the target's own keys, they apply to the initiators not named.
        let c = file(&format!(
            "to_client = \"1MiB\"\n[targets.qos.initiators.\"{db}\"]\nto_storage = \"2MiB\"\n"
        ))
        .unwrap();
        let t = &c.targets[0];
        assert_eq!(t.qos_for(db), Some(c_rates(None, Some(2 << 20))));
        assert_eq!(
            t.qos_for("iqn.2026-01.org.x:other"),
            Some(c_rates(Some(1 << 20), None))
        );
        // Errors name the field.
        let e = file(&format!(
            "[targets.qos.initiators.\"{db}\"]\nto_client = \"1MiB\"\ncapacity = \"5MiB\"\n"
        ))
        .unwrap_err();
        assert_eq!(
            e.field,
            format!("targets[0].qos.initiators.\"{db}\".capacity")
        );
        let e =
            file("[targets.qos.initiators.\"not a name\"]\nto_client = \"1MiB\"\n").unwrap_err();
        assert_eq!(e.field, "targets[0].qos.initiators.\"not a name\"");
        let e = file(&format!("[targets.qos.initiators.\"{db}\"]\niops = 3\n")).unwrap_err();
        assert_eq!(e.field, format!("targets[0].qos.initiators.\"{db}\""));
        assert!(e.why.contains("read_ratio"), "{}", e.why);
        // An empty table is still an error.
        assert!(file("").is_err());
    }

    fn c_rates(to_client: Option<u64>, to_storage: Option<u64>) -> QosSpec {
        QosSpec::Rates {
            to_client,
            to_storage,
            burst: None,
        }
    }

    #[test]
    fn a_requirement_plans_seed_004s_bandwidth_for_the_connections_frame() {
        // Q1 of seed 004's Table 1 on 1500-byte frames (MSS 1442): the model's figures, with
        // a burst of one request each way.
        let (q, _) = parse_qos_arg(
            "--qos",
            "read_ratio=1,iops=82,size=1KiB,rt=10ms,alpha=0.1954",
        )
        .unwrap();
        let plan = q.plan(1442, 65536).unwrap();
        assert_eq!(plan.frame, 1500);
        let rep = mcsi_model::qos::bandwidth(
            &match q {
                QosSpec::Requirement(r) => r,
                _ => unreachable!(),
            },
            &mcsi_model::qos::Framing::default(),
        )
        .unwrap();
        let (rate, burst) = plan.rates.to_client.unwrap();
        assert_eq!(rate, rep.s_to_c.bandwidth.ceil() as u64);
        assert_eq!(burst, 2 * 106 + 1024);
        let (_, burst) = plan.rates.to_storage.unwrap();
        assert_eq!(burst, 106);
        // Rates: the burst defaults to 10 ms of the rate, 64 KiB at least.
        let plan = c_rates(Some(100 << 20), Some(1 << 20))
            .plan(1448, 65536)
            .unwrap();
        assert_eq!(plan.rates.to_client, Some((100 << 20, (100 << 20) / 100)));
        assert_eq!(plan.rates.to_storage, Some((1 << 20, 64 << 10)));
    }

    #[test]
    fn session_threads_default_to_the_cpus_and_are_bounded() {
        let file = |top: &str| {
            ServerConfig::from_toml(&format!(
                "{top}listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\n[[targets.luns]]\nbackend=\"ram:1M\"\n"
            ))
        };
        assert_eq!(file("").unwrap().session_threads, default_session_threads());
        assert_eq!(file("session_threads = 0\n").unwrap().session_threads, 0);
        assert_eq!(file("session_threads = 3\n").unwrap().session_threads, 3);
        let e = file("session_threads = 5000\n").unwrap_err();
        assert_eq!(e.field, "session_threads");
        assert!(e.to_string().contains("at most 1024"), "{e}");
        assert!(file("session_threads = -1\n").is_err());
    }

    #[test]
    fn the_documented_defaults_hold() {
        // docs/error-recovery.md: the target agrees to ErrorRecoveryLevel 2 by default.
        assert_eq!(Limits::default().offer.max_erl, 2);
    }

    #[test]
    fn the_control_socket_is_a_path_or_nothing() {
        let t = "[[targets]]\niqn = \"iqn.2026-01.org.mcsi:t\"\nlisten = [\"127.0.0.1:3260\"]\nluns = [{ backend = \"ram:1MiB\" }]\n";
        let c =
            ServerConfig::from_toml(&format!("control = \"/run/mcsi/control.sock\"\n{t}")).unwrap();
        assert_eq!(
            c.control.as_deref(),
            Some(std::path::Path::new("/run/mcsi/control.sock"))
        );
        assert_eq!(ServerConfig::from_toml(t).unwrap().control, None);
        let e = ServerConfig::from_toml(&format!("control = \"\"\n{t}")).unwrap_err();
        assert_eq!(e.field, "control");
        assert!(e.why.contains("empty path"), "{e}");
    }

    #[test]
    fn an_opened_backend_compares_by_identity() {
        let b = mcsi_scsi::backend::open_backend("ram:1MiB").unwrap();
        let l = LunSpec::new(b.clone());
        assert_eq!(l, LunSpec::new(b));
        let other = mcsi_scsi::backend::open_backend("ram:1MiB").unwrap();
        assert_ne!(l, LunSpec::new(other));
        assert_ne!(l, LunSpec::new("ram:1MiB"));
        assert!(format!("{l:?}").contains("Opened"), "{l:?}");
    }

    #[test]
    fn lun_args_and_portals() {
        let l = parse_lun_arg(
            "--lun",
            "ram:1GiB,bs=4096,ro,serial=abc,naa=600000000000000000000000000000a1",
        )
        .unwrap();
        let mut naa = [0u8; 16];
        naa[0] = 0x60;
        naa[15] = 0xa1;
        assert_eq!(
            l,
            LunSpec {
                lun: None,
                backend: "ram:1GiB".into(),
                block_size: 4096,
                physical_block_size: None,
                read_only: true,
                serial: Some("abc".into()),
                naa: Some(naa),
                sanitize_rate: 0,
                allow_sanitize: false,
                service_time: Duration::ZERO,
            }
        );
        assert!(parse_lun_arg("--lun", "ram:1GiB,bs=333").is_err());
        for bad in [
            "12",
            "500000000000000000000000000000a1",
            "6000000000000000000000000000000g",
        ] {
            let e = parse_lun_arg("--lun", &format!("ram:1GiB,naa={bad}")).unwrap_err();
            assert!(e.to_string().contains("NAA type 6"), "{e}");
        }
        assert!(
            parse_lun_arg("--lun", "ram:1GiB,allow_sanitize")
                .unwrap()
                .allow_sanitize
        );
        let l = parse_lun_arg("--lun", "ram:1GiB,sanitize_rate=16MiB").unwrap();
        assert_eq!(l.sanitize_rate, 16 << 20);
        let e = parse_lun_arg("--lun", "ram:1GiB,sanitize_rate=fast").unwrap_err();
        assert!(e.to_string().contains("bytes per second"), "{e}");
        // A physical block: a power-of-two multiple of the block, checked whatever the order.
        let l = parse_lun_arg("--lun", "ram:1GiB,physical_block_size=4096").unwrap();
        assert_eq!(l.physical_block_size, Some(4096));
        let l = parse_lun_arg("--lun", "ram:1GiB,pbs=32768,bs=4096").unwrap();
        assert_eq!((l.block_size, l.physical_block_size), (4096, Some(32768)));
        for bad in [
            "ram:1GiB,physical_block_size=256",
            "ram:1GiB,physical_block_size=1536",
            "ram:1GiB,physical_block_size=x",
            "ram:1GiB,bs=4096,pbs=2048",
        ] {
            let e = parse_lun_arg("--lun", bad).unwrap_err().to_string();
            assert!(
                e.contains("physical_block_size") || e.contains("block size"),
                "{bad}: {e}"
            );
        }
        let e = ServerConfig::from_toml(
            "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\n[[targets.luns]]\nbackend=\"ram:1M\"\nphysical_block_size = 3000\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("physical_block_size"), "{e}");
        assert!(parse_lun_arg("--lun", "disk:1").is_err());
        assert_eq!(
            parse_portal("10.0.0.1").unwrap(),
            "10.0.0.1:3260".parse().unwrap()
        );
        assert_eq!(
            parse_portal("[::1]:3261").unwrap(),
            "[::1]:3261".parse().unwrap()
        );
        assert!(parse_portal("localhost:x").is_err());
    }
}
