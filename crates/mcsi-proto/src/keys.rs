//! Text key negotiation (RFC 7143 sections 6.2 and 13): one table of every key for both sides,
//! and a [`Negotiator`] that holds one side's offers and limits, answers the peer's keys and
//! checks the peer's answers to ours.
//!
//! Answers follow RFC 7143 6.2: a value (the result of the key's function), `NotUnderstood` for
//! unknown keys (including unregistered `X-` and `X#` keys), `Irrelevant` for keys that do not
//! apply (LO keys on a non-leading connection, session-wide keys in a discovery session,
//! FirstBurstLength when InitialR2T=Yes and ImmediateData=No), and `Reject` for malformed or
//! out-of-range values and keys not allowed here. A key sent twice in one negotiation is a protocol
//! error (RFC 7143 6.2, 6.6).

use std::collections::{BTreeMap, BTreeSet};

use crate::codec::Framing;
use crate::pdu::Stage;

/// Which side of the connection a negotiator speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Initiator,
    Target,
}

/// SessionType (RFC 7143 13.21).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SessionType {
    Discovery,
    #[default]
    Normal,
}

impl SessionType {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionType::Discovery => "Discovery",
            SessionType::Normal => "Normal",
        }
    }

    pub fn parse(s: &str) -> Option<SessionType> {
        match s {
            "Discovery" => Some(SessionType::Discovery),
            "Normal" => Some(SessionType::Normal),
            _ => None,
        }
    }
}

/// How a key's result is reached (RFC 7143 6.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyKind {
    /// The responder picks the first value of the offerer's list that it supports.
    List,
    /// Numerical, the result is the smaller value.
    NumericMin,
    /// Numerical, the result is the larger value.
    NumericMax,
    /// Boolean, the result is the AND of both values.
    BooleanAnd,
    /// Boolean, the result is the OR of both values.
    BooleanOr,
    /// Each side states its own value; no answer is expected.
    Declarative,
    /// Keys of an authentication exchange (CHAP_A, CHAP_I, CHAP_C, CHAP_N, CHAP_R), handed to
    /// the authenticator during the security stage.
    AuthExchange,
    /// Keys RFC 7143 13.25 obsoletes (markers): always answered with Reject.
    Obsolete,
}

/// The values a key admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueSpec {
    Boolean,
    /// A numerical value in `min..=max`, written in decimal or `0x` hexadecimal.
    Numeric {
        min: u64,
        max: u64,
    },
    /// One value (declarations) or a comma-separated list (offers) from these names.
    Names(&'static [&'static str]),
    /// Free text (names, aliases, addresses).
    Text,
}

/// In which phase a key may be sent (RFC 7143 section 13 "Use").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// IO/LO: login phase only.
    Login,
    /// FFPO: full feature phase only (SendTargets).
    FullFeature,
    /// ALL: login and full feature phase.
    Any,
}

/// Who may send a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Senders {
    Initiator,
    Target,
    Both,
}

impl Senders {
    fn includes(self, role: Role) -> bool {
        matches!(
            (self, role),
            (Senders::Both, _)
                | (Senders::Initiator, Role::Initiator)
                | (Senders::Target, Role::Target)
        )
    }
}

/// One row of the negotiation table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyDef {
    pub name: &'static str,
    pub kind: KeyKind,
    pub value: ValueSpec,
    /// The RFC default ("" when the key has none).
    pub default: &'static str,
    /// LO: negotiated only on the leading connection of a session.
    pub leading_only: bool,
    /// Scope CO (per connection) rather than SW (session wide).
    pub per_connection: bool,
    pub phase: Phase,
    pub senders: Senders,
    /// Relevant in discovery sessions (otherwise answered with Irrelevant there).
    pub discovery: bool,
}

const BOOL: ValueSpec = ValueSpec::Boolean;
const fn num(min: u64, max: u64) -> ValueSpec {
    ValueSpec::Numeric { min, max }
}
const LEN24: ValueSpec = num(512, 0x00ff_ffff);
const DIGESTS: ValueSpec = ValueSpec::Names(&["CRC32C", "None"]);

#[allow(clippy::too_many_arguments)]
const fn key(
    name: &'static str,
    kind: KeyKind,
    value: ValueSpec,
    default: &'static str,
    leading_only: bool,
    per_connection: bool,
    phase: Phase,
    senders: Senders,
    discovery: bool,
) -> KeyDef {
    KeyDef {
        name,
        kind,
        value,
        default,
        leading_only,
        per_connection,
        phase,
        senders,
        discovery,
    }
}

use KeyKind::*;
use Phase::{Any, FullFeature, Login};
use Senders::{Both, Initiator as I, Target as T};

/// Every key of RFC 7143 section 13 (and iSCSIProtocolLevel, RFC 7144), in the order offers are
/// made.
#[rustfmt::skip]
pub static KEYS: &[KeyDef] = &[
    // 13.1
    key("HeaderDigest", List, DIGESTS, "None", false, true, Login, Both, true),
    key("DataDigest", List, DIGESTS, "None", false, true, Login, Both, true),
    // 13.2
    key("MaxConnections", NumericMin, num(1, 65535), "1", true, false, Login, Both, false),
    // 13.3
    key("SendTargets", Declarative, ValueSpec::Text, "", false, false, FullFeature, I, true),
    // 13.4 - 13.9
    key("TargetName", Declarative, ValueSpec::Text, "", false, false, Login, I, true),
    key("InitiatorName", Declarative, ValueSpec::Text, "", false, false, Login, I, true),
    key("TargetAlias", Declarative, ValueSpec::Text, "", false, false, Any, T, true),
    key("InitiatorAlias", Declarative, ValueSpec::Text, "", false, false, Any, I, true),
    key("TargetAddress", Declarative, ValueSpec::Text, "", false, false, Any, T, true),
    key("TargetPortalGroupTag", Declarative, num(0, 65535), "", false, false, Login, T, true),
    // 13.10, 13.11
    key("InitialR2T", BooleanOr, BOOL, "Yes", true, false, Login, Both, false),
    key("ImmediateData", BooleanAnd, BOOL, "Yes", true, false, Login, Both, false),
    // 13.12
    key("MaxRecvDataSegmentLength", Declarative, LEN24, "8192", false, true, Any, Both, true),
    // 13.13, 13.14
    key("MaxBurstLength", NumericMin, LEN24, "262144", true, false, Login, Both, false),
    key("FirstBurstLength", NumericMin, LEN24, "65536", true, false, Login, Both, false),
    // 13.15, 13.16
    key("DefaultTime2Wait", NumericMax, num(0, 3600), "2", true, false, Login, Both, true),
    key("DefaultTime2Retain", NumericMin, num(0, 3600), "20", true, false, Login, Both, true),
    // 13.17
    key("MaxOutstandingR2T", NumericMin, num(1, 65535), "1", true, false, Login, Both, false),
    // 13.18, 13.19
    key("DataPDUInOrder", BooleanOr, BOOL, "Yes", true, false, Login, Both, false),
    key("DataSequenceInOrder", BooleanOr, BOOL, "Yes", true, false, Login, Both, false),
    // 13.20
    key("ErrorRecoveryLevel", NumericMin, num(0, 2), "0", true, false, Login, Both, true),
    // 13.21
    key("SessionType", Declarative, ValueSpec::Names(&["Discovery", "Normal"]), "Normal", true, false, Login, I, true),
    // 13.23
    key("TaskReporting", List, ValueSpec::Names(&["RFC3720", "ResponseFence", "FastAbort"]), "RFC3720", true, false, Login, Both, false),
    // RFC 7144 2.1
    key("iSCSIProtocolLevel", NumericMin, num(0, 31), "1", true, false, Login, Both, false),
    // 12.1 (security stage)
    key("AuthMethod", List, ValueSpec::Names(&["None", "CHAP", "SRP", "KRB5", "SPKM1", "SPKM2"]), "None", false, true, Login, Both, true),
    key("CHAP_A", AuthExchange, ValueSpec::Text, "", false, true, Login, Both, true),
    key("CHAP_I", AuthExchange, ValueSpec::Text, "", false, true, Login, Both, true),
    key("CHAP_C", AuthExchange, ValueSpec::Text, "", false, true, Login, Both, true),
    key("CHAP_N", AuthExchange, ValueSpec::Text, "", false, true, Login, Both, true),
    key("CHAP_R", AuthExchange, ValueSpec::Text, "", false, true, Login, Both, true),
    // 13.25: obsoleted marker keys
    key("IFMarker", Obsolete, BOOL, "No", false, true, Login, Both, true),
    key("OFMarker", Obsolete, BOOL, "No", false, true, Login, Both, true),
    key("IFMarkInt", Obsolete, ValueSpec::Text, "", false, true, Login, Both, true),
    key("OFMarkInt", Obsolete, ValueSpec::Text, "", false, true, Login, Both, true),
];

/// The table row of a standard key.
pub fn lookup(name: &str) -> Option<&'static KeyDef> {
    KEYS.iter().find(|k| k.name == name)
}

/// The special answers of RFC 7143 6.2.
pub const NOT_UNDERSTOOD: &str = "NotUnderstood";
pub const IRRELEVANT: &str = "Irrelevant";
pub const REJECT: &str = "Reject";

/// Whether offering `offered` for `def` decides the outcome whatever the peer holds: a Boolean
/// AND offered as No, an OR offered as Yes. RFC 7143 6.2.2 makes the answer to such an offer
/// optional.
pub fn outcome_settled_by_offer(def: &KeyDef, offered: &str) -> bool {
    matches!(def.kind, KeyKind::BooleanAnd | KeyKind::BooleanOr)
        && respond(def, offered, "Yes") == respond(def, offered, "No")
}

/// An answer to one offered key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Value(String),
    NotUnderstood,
    Irrelevant,
    Reject,
}

impl Answer {
    pub fn as_str(&self) -> &str {
        match self {
            Answer::Value(v) => v,
            Answer::NotUnderstood => NOT_UNDERSTOOD,
            Answer::Irrelevant => IRRELEVANT,
            Answer::Reject => REJECT,
        }
    }
}

/// Numerical value: decimal or `0x`/`0X` hexadecimal (RFC 7143 6.1).
pub fn parse_number(s: &str) -> Option<u64> {
    if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        if hex.is_empty() || hex.len() > 16 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(hex, 16).ok()
    } else {
        if s.is_empty() || s.len() > 20 || !s.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    }
}

pub fn parse_bool(s: &str) -> Option<bool> {
    match s {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

fn bool_str(b: bool) -> &'static str {
    if b {
        "Yes"
    } else {
        "No"
    }
}

fn valid_single(spec: ValueSpec, v: &str) -> bool {
    match spec {
        ValueSpec::Boolean => parse_bool(v).is_some(),
        ValueSpec::Numeric { min, max } => {
            parse_number(v).is_some_and(|n| (min..=max).contains(&n))
        }
        ValueSpec::Names(names) => names.contains(&v),
        ValueSpec::Text => true,
    }
}

/// The responder's answer to an offer, given its own value (RFC 7143 6.2.1, 6.2.2).
/// For lists, `local` is the responder's comma-separated list of supported values.
pub fn respond(def: &KeyDef, offered: &str, local: &str) -> Answer {
    match def.kind {
        KeyKind::List => {
            let ours: Vec<&str> = local.split(',').collect();
            if offered.is_empty() || offered.split(',').any(|v| v.is_empty()) {
                return Answer::Reject;
            }
            match offered.split(',').find(|v| ours.contains(v)) {
                Some(v) => Answer::Value(v.to_owned()),
                None => Answer::Reject,
            }
        }
        KeyKind::NumericMin | KeyKind::NumericMax => {
            let (Some(o), Some(l)) = (parse_number(offered), parse_number(local)) else {
                return Answer::Reject;
            };
            if !valid_single(def.value, offered) {
                return Answer::Reject;
            }
            let r = if def.kind == KeyKind::NumericMin {
                o.min(l)
            } else {
                o.max(l)
            };
            Answer::Value(r.to_string())
        }
        KeyKind::BooleanAnd | KeyKind::BooleanOr => {
            let (Some(o), Some(l)) = (parse_bool(offered), parse_bool(local)) else {
                return Answer::Reject;
            };
            let r = if def.kind == KeyKind::BooleanAnd {
                o && l
            } else {
                o || l
            };
            Answer::Value(bool_str(r).to_owned())
        }
        KeyKind::Obsolete => Answer::Reject,
        KeyKind::Declarative | KeyKind::AuthExchange => Answer::Value(offered.to_owned()),
    }
}

/// An answer outside what the key's function allows for our offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the answer does not fit the offer under the key's negotiation function")]
pub struct AnswerMismatch;

/// Check an answer to our offer against the key's function; `Ok(None)` when the answer leaves
/// the key at its default (NotUnderstood, Irrelevant, Reject).
pub fn check_answer(
    def: &KeyDef,
    offered: &str,
    answer: &str,
) -> Result<Option<String>, AnswerMismatch> {
    if matches!(answer, NOT_UNDERSTOOD | IRRELEVANT | REJECT) {
        return Ok(None);
    }
    match def.kind {
        KeyKind::List => {
            if offered.split(',').any(|v| v == answer) {
                Ok(Some(answer.to_owned()))
            } else {
                Err(AnswerMismatch)
            }
        }
        KeyKind::NumericMin | KeyKind::NumericMax => {
            let (Some(o), Some(a)) = (parse_number(offered), parse_number(answer)) else {
                return Err(AnswerMismatch);
            };
            let ok = valid_single(def.value, answer)
                && if def.kind == KeyKind::NumericMin {
                    a <= o
                } else {
                    a >= o
                };
            if ok {
                Ok(Some(a.to_string()))
            } else {
                Err(AnswerMismatch)
            }
        }
        KeyKind::BooleanAnd | KeyKind::BooleanOr => {
            let (Some(o), Some(a)) = (parse_bool(offered), parse_bool(answer)) else {
                return Err(AnswerMismatch);
            };
            // The answer must be what the function allows: AND can only lower, OR only raise.
            let r = if def.kind == KeyKind::BooleanAnd {
                o && a
            } else {
                o || a
            };
            if r == a {
                Ok(Some(bool_str(r).to_owned()))
            } else {
                Err(AnswerMismatch)
            }
        }
        KeyKind::Declarative | KeyKind::AuthExchange | KeyKind::Obsolete => Err(AnswerMismatch),
    }
}

/// Digest algorithms (RFC 7143 13.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Digest {
    None,
    Crc32c,
}

impl Digest {
    pub fn as_str(self) -> &'static str {
        match self {
            Digest::None => "None",
            Digest::Crc32c => "CRC32C",
        }
    }
}

fn digest_list(list: &[Digest]) -> String {
    if list.is_empty() {
        return "None".to_owned();
    }
    list.iter()
        .map(|d| d.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// TaskReporting values (RFC 7143 13.23).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TaskReporting {
    #[default]
    Rfc3720,
    ResponseFence,
    FastAbort,
}

impl TaskReporting {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskReporting::Rfc3720 => "RFC3720",
            TaskReporting::ResponseFence => "ResponseFence",
            TaskReporting::FastAbort => "FastAbort",
        }
    }

    pub fn parse(s: &str) -> Option<TaskReporting> {
        match s {
            "RFC3720" => Some(TaskReporting::Rfc3720),
            "ResponseFence" => Some(TaskReporting::ResponseFence),
            "FastAbort" => Some(TaskReporting::FastAbort),
            _ => None,
        }
    }
}

/// Session-wide operational values as negotiated (RFC defaults until negotiated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionParams {
    pub max_connections: u16,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub default_time2wait: u16,
    pub default_time2retain: u16,
    pub max_outstanding_r2t: u16,
    pub data_pdu_in_order: bool,
    pub data_sequence_in_order: bool,
    pub error_recovery_level: u8,
    pub task_reporting: TaskReporting,
    pub iscsi_protocol_level: u8,
    /// Agreed values of registered vendor (`X-`, `X#`) keys.
    pub extensions: BTreeMap<String, String>,
}

impl Default for SessionParams {
    /// RFC 7143 section 13 defaults.
    fn default() -> Self {
        SessionParams {
            max_connections: 1,
            initial_r2t: true,
            immediate_data: true,
            max_burst_length: 262_144,
            first_burst_length: 65_536,
            default_time2wait: 2,
            default_time2retain: 20,
            max_outstanding_r2t: 1,
            data_pdu_in_order: true,
            data_sequence_in_order: true,
            error_recovery_level: 0,
            task_reporting: TaskReporting::Rfc3720,
            iscsi_protocol_level: 1,
            extensions: BTreeMap::new(),
        }
    }
}

/// Per-connection values as negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionParams {
    pub header_digest: Digest,
    pub data_digest: Digest,
    /// What this side declared it receives (limits PDUs we accept).
    pub max_recv_data_segment_length: u32,
    /// What the peer declared it receives (limits PDUs we send).
    pub max_send_data_segment_length: u32,
}

impl Default for ConnectionParams {
    fn default() -> Self {
        ConnectionParams {
            header_digest: Digest::None,
            data_digest: Digest::None,
            max_recv_data_segment_length: 8192,
            max_send_data_segment_length: 8192,
        }
    }
}

impl ConnectionParams {
    /// Framing for PDUs we receive in full feature phase.
    pub fn rx_framing(&self) -> Framing {
        Framing {
            header_digest: self.header_digest == Digest::Crc32c,
            data_digest: self.data_digest == Digest::Crc32c,
            max_data_segment_length: self.max_recv_data_segment_length,
        }
    }

    /// Framing for PDUs we send in full feature phase.
    pub fn tx_framing(&self) -> Framing {
        Framing {
            header_digest: self.header_digest == Digest::Crc32c,
            data_digest: self.data_digest == Digest::Crc32c,
            max_data_segment_length: self.max_send_data_segment_length,
        }
    }
}

/// This side's preferences and limits: what it offers, and what it accepts when answering.
/// For minimum-function keys the value is the largest we accept; for DefaultTime2Wait (maximum
/// function) the smallest; for booleans our wish; digests in order of preference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalParams {
    pub header_digest: Vec<Digest>,
    pub data_digest: Vec<Digest>,
    pub max_recv_data_segment_length: u32,
    pub max_connections: u16,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub default_time2wait: u16,
    pub default_time2retain: u16,
    pub max_outstanding_r2t: u16,
    pub data_pdu_in_order: bool,
    pub data_sequence_in_order: bool,
    pub error_recovery_level: u8,
    pub task_reporting: Vec<TaskReporting>,
    pub iscsi_protocol_level: u8,
}

impl Default for LocalParams {
    /// The RFC defaults, no digests.
    fn default() -> Self {
        let s = SessionParams::default();
        LocalParams {
            header_digest: vec![Digest::None],
            data_digest: vec![Digest::None],
            max_recv_data_segment_length: 8192,
            max_connections: s.max_connections,
            initial_r2t: s.initial_r2t,
            immediate_data: s.immediate_data,
            max_burst_length: s.max_burst_length,
            first_burst_length: s.first_burst_length,
            default_time2wait: s.default_time2wait,
            default_time2retain: s.default_time2retain,
            max_outstanding_r2t: s.max_outstanding_r2t,
            data_pdu_in_order: s.data_pdu_in_order,
            data_sequence_in_order: s.data_sequence_in_order,
            error_recovery_level: s.error_recovery_level,
            task_reporting: vec![TaskReporting::Rfc3720],
            iscsi_protocol_level: s.iscsi_protocol_level,
        }
    }
}

impl LocalParams {
    /// Bring values into their RFC ranges; FirstBurstLength never above MaxBurstLength (13.14).
    fn normalized(mut self) -> Self {
        let len24 = |v: u32| v.clamp(512, 0x00ff_ffff);
        self.max_recv_data_segment_length = len24(self.max_recv_data_segment_length);
        self.max_burst_length = len24(self.max_burst_length);
        self.first_burst_length = len24(self.first_burst_length).min(self.max_burst_length);
        self.max_connections = self.max_connections.max(1);
        self.max_outstanding_r2t = self.max_outstanding_r2t.max(1);
        self.default_time2wait = self.default_time2wait.min(3600);
        self.default_time2retain = self.default_time2retain.min(3600);
        self.error_recovery_level = self.error_recovery_level.min(2);
        self.iscsi_protocol_level = self.iscsi_protocol_level.min(31);
        if self.task_reporting.is_empty() {
            self.task_reporting.push(TaskReporting::Rfc3720);
        }
        self
    }

    /// Our value of a standard key as it goes in an offer or drives an answer.
    fn value(&self, key: &str) -> Option<String> {
        Some(match key {
            "HeaderDigest" => digest_list(&self.header_digest),
            "DataDigest" => digest_list(&self.data_digest),
            "MaxConnections" => self.max_connections.to_string(),
            "InitialR2T" => bool_str(self.initial_r2t).to_owned(),
            "ImmediateData" => bool_str(self.immediate_data).to_owned(),
            "MaxRecvDataSegmentLength" => self.max_recv_data_segment_length.to_string(),
            "MaxBurstLength" => self.max_burst_length.to_string(),
            "FirstBurstLength" => self.first_burst_length.to_string(),
            "DefaultTime2Wait" => self.default_time2wait.to_string(),
            "DefaultTime2Retain" => self.default_time2retain.to_string(),
            "MaxOutstandingR2T" => self.max_outstanding_r2t.to_string(),
            "DataPDUInOrder" => bool_str(self.data_pdu_in_order).to_owned(),
            "DataSequenceInOrder" => bool_str(self.data_sequence_in_order).to_owned(),
            "ErrorRecoveryLevel" => self.error_recovery_level.to_string(),
            "TaskReporting" => self
                .task_reporting
                .iter()
                .map(|t| t.as_str())
                .collect::<Vec<_>>()
                .join(","),
            "iSCSIProtocolLevel" => self.iscsi_protocol_level.to_string(),
            _ => return None,
        })
    }
}

/// A negotiation that cannot go on (the login fails with Initiator Error, or the connection is
/// closed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NegotiationError {
    #[error("key {0} was sent more than once in one negotiation (RFC 7143 6.2)")]
    Repeated(String),
    #[error("answer {key}={value} does not fit our offer {key}={offered}")]
    InvalidAnswer {
        key: String,
        offered: String,
        value: String,
    },
    #[error("vendor key {0} must start with X- or X# and not be registered twice")]
    BadExtension(String),
}

/// The result of processing one batch of the peer's keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Processed {
    /// Our answers, in the order of the peer's offers.
    pub answers: Vec<(String, String)>,
    /// Declarations the peer made (InitiatorName, TargetName, SessionType, aliases, ...).
    pub declared: Vec<(String, String)>,
    /// Authentication exchange keys (CHAP_*), for the authenticator.
    pub auth: Vec<(String, String)>,
}

/// A registered vendor key (`X-org.mcsi.*`): its table row and our value.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Extension {
    def: KeyDef,
    local: String,
}

/// One side's key negotiation for one connection (login) and later text negotiations.
#[derive(Debug, Clone)]
pub struct Negotiator {
    role: Role,
    local: LocalParams,
    session_type: SessionType,
    leading: bool,
    offer_all: bool,
    extensions: Vec<Extension>,
    /// Negotiated results and the peer's declarations, by key.
    agreed: BTreeMap<String, String>,
    /// Our offers that await an answer. Those whose outcome the offer alone decides
    /// ([`outcome_settled_by_offer`]) are in `agreed` already; an answer to them is optional but
    /// still checked.
    pending: BTreeMap<String, String>,
    /// Keys we sent (offers and declarations) in this negotiation.
    sent: BTreeSet<String>,
    /// Keys the peer sent in this negotiation.
    seen: BTreeSet<String>,
}

impl Negotiator {
    /// A negotiator for `role` with our preferences. Initiators offer every relevant key;
    /// targets offer only keys whose result would differ from the default.
    pub fn new(role: Role, local: LocalParams) -> Self {
        Negotiator {
            role,
            local: local.normalized(),
            session_type: SessionType::Normal,
            leading: true,
            offer_all: role == Role::Initiator,
            extensions: Vec::new(),
            agreed: BTreeMap::new(),
            pending: BTreeMap::new(),
            sent: BTreeSet::new(),
            seen: BTreeSet::new(),
        }
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn local(&self) -> &LocalParams {
        &self.local
    }

    /// Register a vendor key (name starting with `X-` or `X#`) with our value for it. Unregistered
    /// vendor keys are answered with NotUnderstood.
    pub fn register(
        &mut self,
        def: KeyDef,
        local: impl Into<String>,
    ) -> Result<(), NegotiationError> {
        let ok_name = (def.name.starts_with("X-") || def.name.starts_with("X#"))
            && def.name.len() <= crate::text::MAX_KEY_LEN
            && self.extension(def.name).is_none();
        if !ok_name || matches!(def.kind, KeyKind::AuthExchange | KeyKind::Obsolete) {
            return Err(NegotiationError::BadExtension(def.name.to_owned()));
        }
        self.extensions.push(Extension {
            def,
            local: local.into(),
        });
        Ok(())
    }

    fn extension(&self, name: &str) -> Option<&Extension> {
        self.extensions.iter().find(|e| e.def.name == name)
    }

    fn def(&self, name: &str) -> Option<KeyDef> {
        lookup(name)
            .copied()
            .or_else(|| self.extension(name).map(|e| e.def))
    }

    fn local_value(&self, name: &str) -> Option<String> {
        self.local
            .value(name)
            .or_else(|| self.extension(name).map(|e| e.local.clone()))
    }

    pub fn set_session_type(&mut self, t: SessionType) {
        self.session_type = t;
    }

    pub fn session_type(&self) -> SessionType {
        self.session_type
    }

    /// Whether this is the leading connection of its session (TSIH 0 in the login).
    pub fn set_leading(&mut self, leading: bool) {
        self.leading = leading;
    }

    /// Start a new negotiation sequence (a Text Request exchange in full feature phase): keys may
    /// be sent again.
    pub fn begin_sequence(&mut self) {
        self.sent.clear();
        self.seen.clear();
        self.pending.clear();
    }

    /// Whether some of our offers still await an answer the peer must give (offers whose answer
    /// is optional do not count: LIO, for one, leaves `DataPDUInOrder=Yes` unanswered).
    pub fn has_pending(&self) -> bool {
        self.pending_keys().next().is_some()
    }

    /// Whether `key` is an offer of ours still without an answer (optional answers included).
    pub fn awaits_answer(&self, key: &str) -> bool {
        self.pending.contains_key(key)
    }

    /// The keys we offered that still await an answer the peer must give.
    pub fn pending_keys(&self) -> impl Iterator<Item = &str> {
        self.pending
            .iter()
            .filter(|(k, v)| !self.def(k).is_some_and(|d| outcome_settled_by_offer(&d, v)))
            .map(|(k, _)| k.as_str())
    }

    /// The negotiated value of a key, or the peer's declaration of it.
    pub fn agreed(&self, key: &str) -> Option<&str> {
        self.agreed.get(key).map(String::as_str)
    }

    /// Whether the peer sent `key` in this negotiation.
    pub fn peer_sent(&self, key: &str) -> bool {
        self.seen.contains(key)
    }

    /// Whether a key applies to this session and connection, and to the current phase;
    /// `Err(answer)` with the answer to give when it does not.
    fn applicable(&self, def: &KeyDef, stage: Option<Stage>, sender: Role) -> Result<(), Answer> {
        if !def.senders.includes(sender) {
            return Err(Answer::Reject);
        }
        match (def.phase, stage) {
            (Phase::Login, None) | (Phase::FullFeature, Some(_)) => return Err(Answer::Reject),
            _ => {}
        }
        if def.kind == KeyKind::AuthExchange && stage != Some(Stage::Security) {
            return Err(Answer::Reject);
        }
        if def.leading_only && !self.leading {
            return Err(Answer::Irrelevant);
        }
        if self.session_type == SessionType::Discovery && !def.discovery {
            return Err(Answer::Irrelevant);
        }
        Ok(())
    }

    /// Process the peer's keys from one (joined) text segment: answers to our offers are checked
    /// and recorded, the peer's offers are answered, declarations are recorded.
    /// `stage` is the login stage, or `None` in full feature phase.
    pub fn handle(
        &mut self,
        pairs: &[(String, String)],
        stage: Option<Stage>,
    ) -> Result<Processed, NegotiationError> {
        let peer = match self.role {
            Role::Initiator => Role::Target,
            Role::Target => Role::Initiator,
        };
        // SessionType decides the relevance of the other keys of the same request.
        if self.role == Role::Target {
            if let Some(t) = pairs
                .iter()
                .find(|(k, _)| k == "SessionType")
                .and_then(|(_, v)| SessionType::parse(v))
            {
                self.session_type = t;
            }
        }
        let mut out = Processed::default();
        for (key, value) in pairs {
            // TargetAddress may legitimately appear several times (redirection lists).
            if !self.seen.insert(key.clone()) && key != "TargetAddress" {
                return Err(NegotiationError::Repeated(key.clone()));
            }
            if let Some(offered) = self.pending.remove(key) {
                let Some(def) = self.def(key) else {
                    continue;
                };
                match check_answer(&def, &offered, value) {
                    Ok(Some(v)) => {
                        self.agreed.insert(key.clone(), v);
                    }
                    Ok(None) => {}
                    Err(AnswerMismatch) => {
                        return Err(NegotiationError::InvalidAnswer {
                            key: key.clone(),
                            offered,
                            value: value.clone(),
                        })
                    }
                }
                continue;
            }
            if self.sent.contains(key)
                && matches!(value.as_str(), NOT_UNDERSTOOD | IRRELEVANT | REJECT)
            {
                // The peer's verdict on one of our declarations: nothing to agree on.
                continue;
            }
            let Some(def) = self.def(key) else {
                out.answers.push((key.clone(), NOT_UNDERSTOOD.to_owned()));
                continue;
            };
            if let Err(a) = self.applicable(&def, stage, peer) {
                // Declarations that merely do not apply here need no answer.
                if !(def.kind == KeyKind::Declarative && a == Answer::Irrelevant) {
                    out.answers.push((key.clone(), a.as_str().to_owned()));
                }
                continue;
            }
            match def.kind {
                KeyKind::AuthExchange => out.auth.push((key.clone(), value.clone())),
                KeyKind::Declarative => {
                    if valid_single(def.value, value) {
                        self.agreed.insert(key.clone(), value.clone());
                        out.declared.push((key.clone(), value.clone()));
                    } else {
                        out.answers.push((key.clone(), REJECT.to_owned()));
                    }
                }
                _ => {
                    let local = self
                        .local_value(key)
                        .unwrap_or_else(|| def.default.to_owned());
                    let answer = respond(&def, value, &local);
                    if let Answer::Value(v) = &answer {
                        self.agreed.insert(key.clone(), v.clone());
                    }
                    // We answered: our own offer of this key is no longer needed.
                    self.sent.insert(key.clone());
                    out.answers.push((key.clone(), answer.as_str().to_owned()));
                }
            }
        }
        self.fix_first_burst(&mut out.answers);
        Ok(out)
    }

    /// FirstBurstLength is irrelevant when InitialR2T=Yes and ImmediateData=No, and never larger
    /// than MaxBurstLength (RFC 7143 13.14).
    fn fix_first_burst(&mut self, answers: &mut [(String, String)]) {
        let p = self.session_params();
        let raw_first = self
            .agreed
            .get("FirstBurstLength")
            .and_then(|v| parse_number(v));
        let too_big = raw_first.is_some_and(|f| f > u64::from(p.max_burst_length));
        let slot = answers.iter_mut().find(|(k, _)| k == "FirstBurstLength");
        let irrelevant = self.agreed.contains_key("InitialR2T")
            && self.agreed.contains_key("ImmediateData")
            && p.initial_r2t
            && !p.immediate_data;
        match slot {
            Some(slot) if slot.1 == IRRELEVANT || slot.1 == REJECT => {}
            Some(slot) if irrelevant => {
                slot.1 = IRRELEVANT.to_owned();
                self.agreed.remove("FirstBurstLength");
            }
            Some(slot) if too_big => {
                slot.1 = p.max_burst_length.to_string();
                self.agreed
                    .insert("FirstBurstLength".into(), slot.1.clone());
            }
            _ if too_big => {
                self.agreed
                    .insert("FirstBurstLength".into(), p.max_burst_length.to_string());
            }
            _ => {}
        }
    }

    /// Our offers and declarations still to be sent, for the given login stage (`None` in full
    /// feature phase). Offers are remembered as awaiting an answer. Login-specific declarations
    /// (names, SessionType, TargetPortalGroupTag) and AuthMethod are sent by the login machines.
    pub fn offers(&mut self, stage: Option<Stage>) -> Vec<(String, String)> {
        if stage == Some(Stage::Security) {
            return Vec::new();
        }
        let mut defs: Vec<KeyDef> = KEYS.to_vec();
        defs.extend(self.extensions.iter().map(|e| e.def));
        let mut out = Vec::new();
        for def in defs {
            let name = def.name;
            // Declarations go each way; negotiated keys once, by whoever offers first.
            let declared = def.kind == KeyKind::Declarative;
            if self.sent.contains(name) || (!declared && self.seen.contains(name)) {
                continue;
            }
            if self.applicable(&def, stage, self.role).is_err() {
                continue;
            }
            let Some(local) = self.local_value(name) else {
                continue;
            };
            match def.kind {
                KeyKind::Declarative => {
                    // Login declarations (names, SessionType, TargetPortalGroupTag) are made by
                    // the login machines; registered vendor declarations are made here.
                    let vendor = self.extension(name).is_some();
                    if name != "MaxRecvDataSegmentLength" && !vendor {
                        continue;
                    }
                }
                KeyKind::AuthExchange | KeyKind::Obsolete => continue,
                _ if name == "AuthMethod" => continue,
                _ => {
                    // A target only offers what would change the default result.
                    let changes = match respond(&def, &local, def.default) {
                        Answer::Value(v) => v != def.default,
                        _ => true,
                    };
                    if !self.offer_all && !changes {
                        continue;
                    }
                    if name == "FirstBurstLength" && self.first_burst_irrelevant_by_local() {
                        continue;
                    }
                    self.pending.insert(name.to_owned(), local.clone());
                    if outcome_settled_by_offer(&def, &local) {
                        self.agreed.insert(name.to_owned(), local.clone());
                    }
                }
            }
            self.sent.insert(name.to_owned());
            out.push((name.to_owned(), local));
        }
        out
    }

    fn first_burst_irrelevant_by_local(&self) -> bool {
        // With InitialR2T=Yes (OR: Yes wins) and ImmediateData=No (AND: No wins) offered by us,
        // the result makes FirstBurstLength irrelevant whatever the peer says.
        self.local.initial_r2t && !self.local.immediate_data
    }

    /// Remember a key we send outside [`Negotiator::offers`] (declarations, AuthMethod), so that
    /// it is not offered again; `expect_answer` marks it as awaiting the peer's answer.
    pub fn note_sent(&mut self, key: &str, value: &str, expect_answer: bool) {
        self.sent.insert(key.to_owned());
        if expect_answer {
            self.pending.insert(key.to_owned(), value.to_owned());
        }
    }

    /// The session-wide values agreed so far (defaults elsewhere).
    pub fn session_params(&self) -> SessionParams {
        let mut p = SessionParams::default();
        let n = |k: &str| self.agreed.get(k).and_then(|v| parse_number(v));
        let b = |k: &str| self.agreed.get(k).and_then(|v| parse_bool(v));
        if let Some(v) = n("MaxConnections") {
            p.max_connections = u16::try_from(v).unwrap_or(u16::MAX);
        }
        if let Some(v) = b("InitialR2T") {
            p.initial_r2t = v;
        }
        if let Some(v) = b("ImmediateData") {
            p.immediate_data = v;
        }
        if let Some(v) = n("MaxBurstLength") {
            p.max_burst_length = u32::try_from(v).unwrap_or(u32::MAX);
        }
        if let Some(v) = n("FirstBurstLength") {
            p.first_burst_length = u32::try_from(v).unwrap_or(u32::MAX);
        }
        if let Some(v) = n("DefaultTime2Wait") {
            p.default_time2wait = u16::try_from(v).unwrap_or(u16::MAX);
        }
        if let Some(v) = n("DefaultTime2Retain") {
            p.default_time2retain = u16::try_from(v).unwrap_or(u16::MAX);
        }
        if let Some(v) = n("MaxOutstandingR2T") {
            p.max_outstanding_r2t = u16::try_from(v).unwrap_or(u16::MAX);
        }
        if let Some(v) = b("DataPDUInOrder") {
            p.data_pdu_in_order = v;
        }
        if let Some(v) = b("DataSequenceInOrder") {
            p.data_sequence_in_order = v;
        }
        if let Some(v) = n("ErrorRecoveryLevel") {
            p.error_recovery_level = u8::try_from(v).unwrap_or(u8::MAX);
        }
        if let Some(t) = self
            .agreed
            .get("TaskReporting")
            .and_then(|v| TaskReporting::parse(v))
        {
            p.task_reporting = t;
        }
        if let Some(v) = n("iSCSIProtocolLevel") {
            p.iscsi_protocol_level = u8::try_from(v).unwrap_or(u8::MAX);
        }
        if self.session_type == SessionType::Discovery {
            // 13.21: a discovery session implies MaxConnections=1.
            p.max_connections = 1;
        }
        p.first_burst_length = p.first_burst_length.min(p.max_burst_length);
        for e in &self.extensions {
            if let Some(v) = self.agreed.get(e.def.name) {
                p.extensions.insert(e.def.name.to_owned(), v.clone());
            }
        }
        p
    }

    /// The connection values agreed so far.
    pub fn connection_params(&self) -> ConnectionParams {
        let digest = |k: &str| match self.agreed.get(k).map(String::as_str) {
            Some("CRC32C") => Digest::Crc32c,
            _ => Digest::None,
        };
        // Our own MaxRecvDataSegmentLength is what we declare; the peer's is what it declared.
        let peer_mrdsl = self
            .agreed
            .get("MaxRecvDataSegmentLength")
            .and_then(|v| parse_number(v))
            .and_then(|v| u32::try_from(v).ok())
            .unwrap_or(8192);
        let ours = if self.sent.contains("MaxRecvDataSegmentLength") {
            self.local.max_recv_data_segment_length
        } else {
            8192
        };
        ConnectionParams {
            header_digest: digest("HeaderDigest"),
            data_digest: digest("DataDigest"),
            max_recv_data_segment_length: ours,
            max_send_data_segment_length: peer_mrdsl,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn answer<'a>(p: &'a Processed, key: &str) -> Option<&'a str> {
        p.answers
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn table_has_every_key() {
        for k in [
            "HeaderDigest",
            "DataDigest",
            "MaxConnections",
            "SendTargets",
            "TargetName",
            "InitiatorName",
            "TargetAlias",
            "InitiatorAlias",
            "TargetAddress",
            "TargetPortalGroupTag",
            "InitialR2T",
            "ImmediateData",
            "MaxRecvDataSegmentLength",
            "MaxBurstLength",
            "FirstBurstLength",
            "DefaultTime2Wait",
            "DefaultTime2Retain",
            "MaxOutstandingR2T",
            "DataPDUInOrder",
            "DataSequenceInOrder",
            "ErrorRecoveryLevel",
            "SessionType",
            "AuthMethod",
            "TaskReporting",
            "iSCSIProtocolLevel",
        ] {
            assert!(lookup(k).is_some(), "{k} missing");
        }
        // Names are unique.
        let mut names: Vec<_> = KEYS.iter().map(|k| k.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), KEYS.len());
    }

    #[test]
    fn numbers() {
        assert_eq!(parse_number("8192"), Some(8192));
        assert_eq!(parse_number("0x2000"), Some(8192));
        assert_eq!(parse_number("0X2000"), Some(8192));
        assert_eq!(parse_number(""), None);
        assert_eq!(parse_number("0x"), None);
        assert_eq!(parse_number("-1"), None);
        assert_eq!(parse_number("+1"), None);
        assert_eq!(parse_number("12a"), None);
        assert_eq!(parse_number("99999999999999999999"), None);
    }

    #[test]
    fn respond_by_kind() {
        let d = |k| *lookup(k).unwrap();
        let v = |s: &str| Answer::Value(s.to_owned());
        // Minimum, maximum.
        assert_eq!(
            respond(&d("MaxBurstLength"), "1048576", "262144"),
            v("262144")
        );
        assert_eq!(respond(&d("MaxBurstLength"), "65536", "262144"), v("65536"));
        assert_eq!(respond(&d("DefaultTime2Wait"), "0", "2"), v("2"));
        assert_eq!(respond(&d("DefaultTime2Wait"), "5", "2"), v("5"));
        // Out of range and malformed: Reject.
        assert_eq!(
            respond(&d("MaxBurstLength"), "511", "262144"),
            Answer::Reject
        );
        assert_eq!(
            respond(&d("MaxBurstLength"), "16777216", "262144"),
            Answer::Reject
        );
        assert_eq!(
            respond(&d("MaxBurstLength"), "lots", "262144"),
            Answer::Reject
        );
        assert_eq!(respond(&d("ErrorRecoveryLevel"), "3", "0"), Answer::Reject);
        assert_eq!(respond(&d("MaxConnections"), "0", "4"), Answer::Reject);
        // Booleans: InitialR2T OR, ImmediateData AND, the in-order keys OR.
        assert_eq!(respond(&d("InitialR2T"), "No", "No"), v("No"));
        assert_eq!(respond(&d("InitialR2T"), "No", "Yes"), v("Yes"));
        assert_eq!(respond(&d("ImmediateData"), "Yes", "No"), v("No"));
        assert_eq!(respond(&d("ImmediateData"), "Yes", "Yes"), v("Yes"));
        assert_eq!(respond(&d("DataPDUInOrder"), "No", "Yes"), v("Yes"));
        assert_eq!(respond(&d("DataSequenceInOrder"), "No", "No"), v("No"));
        assert_eq!(respond(&d("ImmediateData"), "yes", "Yes"), Answer::Reject);
        // Lists: the offerer's order wins among what we support.
        assert_eq!(
            respond(&d("HeaderDigest"), "CRC32C,None", "None,CRC32C"),
            v("CRC32C")
        );
        assert_eq!(
            respond(&d("HeaderDigest"), "None,CRC32C", "CRC32C,None"),
            v("None")
        );
        assert_eq!(respond(&d("DataDigest"), "CRC32C", "None"), Answer::Reject);
        assert_eq!(
            respond(&d("DataDigest"), "CRC32C,,None", "None"),
            Answer::Reject
        );
        assert_eq!(respond(&d("AuthMethod"), "CHAP,None", "None"), v("None"));
        assert_eq!(
            respond(&d("AuthMethod"), "CHAP,SRP", "None"),
            Answer::Reject
        );
        // Obsolete marker keys.
        assert_eq!(respond(&d("OFMarker"), "No", "No"), Answer::Reject);
    }

    #[test]
    fn check_answers_by_kind() {
        let d = |k| *lookup(k).unwrap();
        assert_eq!(
            check_answer(&d("MaxBurstLength"), "262144", "65536"),
            Ok(Some("65536".into()))
        );
        assert_eq!(
            check_answer(&d("MaxBurstLength"), "65536", "262144"),
            Err(AnswerMismatch)
        );
        assert_eq!(
            check_answer(&d("DefaultTime2Wait"), "2", "1"),
            Err(AnswerMismatch)
        );
        assert_eq!(
            check_answer(&d("ImmediateData"), "No", "Yes"),
            Err(AnswerMismatch)
        );
        assert_eq!(
            check_answer(&d("ImmediateData"), "Yes", "No"),
            Ok(Some("No".into()))
        );
        assert_eq!(
            check_answer(&d("InitialR2T"), "Yes", "No"),
            Err(AnswerMismatch)
        );
        assert_eq!(
            check_answer(&d("HeaderDigest"), "CRC32C,None", "None"),
            Ok(Some("None".into()))
        );
        assert_eq!(
            check_answer(&d("HeaderDigest"), "None", "CRC32C"),
            Err(AnswerMismatch)
        );
        assert_eq!(
            check_answer(&d("HeaderDigest"), "CRC32C", "Reject"),
            Ok(None)
        );
        assert_eq!(
            check_answer(&d("MaxConnections"), "4", "NotUnderstood"),
            Ok(None)
        );
    }

    fn target(local: LocalParams) -> Negotiator {
        Negotiator::new(Role::Target, local)
    }

    #[test]
    fn target_answers_every_offer() {
        let mut t = target(LocalParams {
            header_digest: vec![Digest::Crc32c, Digest::None],
            max_burst_length: 131_072,
            max_recv_data_segment_length: 65536,
            ..LocalParams::default()
        });
        let offers = kv(&[
            ("HeaderDigest", "CRC32C,None"),
            ("DataDigest", "CRC32C,None"),
            ("MaxConnections", "8"),
            ("InitialR2T", "No"),
            ("ImmediateData", "Yes"),
            ("MaxRecvDataSegmentLength", "262144"),
            ("MaxBurstLength", "16776192"),
            ("FirstBurstLength", "262144"),
            ("DefaultTime2Wait", "0"),
            ("DefaultTime2Retain", "0"),
            ("MaxOutstandingR2T", "1"),
            ("DataPDUInOrder", "Yes"),
            ("DataSequenceInOrder", "Yes"),
            ("ErrorRecoveryLevel", "2"),
            ("X-com.example.thing", "1"),
            ("X#org.example.public", "1"),
            ("Bogus", "1"),
        ]);
        let p = t.handle(&offers, Some(Stage::Operational)).unwrap();
        let expect = [
            ("HeaderDigest", "CRC32C"),
            ("DataDigest", "None"),
            ("MaxConnections", "1"),
            ("InitialR2T", "Yes"),
            ("ImmediateData", "Yes"),
            ("MaxBurstLength", "131072"),
            // min(262144, 65536) = 65536 <= MaxBurstLength.
            ("FirstBurstLength", "65536"),
            ("DefaultTime2Wait", "2"),
            ("DefaultTime2Retain", "0"),
            ("MaxOutstandingR2T", "1"),
            ("DataPDUInOrder", "Yes"),
            ("DataSequenceInOrder", "Yes"),
            ("ErrorRecoveryLevel", "0"),
            ("X-com.example.thing", "NotUnderstood"),
            ("X#org.example.public", "NotUnderstood"),
            ("Bogus", "NotUnderstood"),
        ];
        for (k, v) in expect {
            assert_eq!(answer(&p, k), Some(v), "{k}");
        }
        // Every offer is answered; the declaration is not.
        assert_eq!(p.answers.len(), offers.len() - 1);
        assert_eq!(answer(&p, "MaxRecvDataSegmentLength"), None);
        // The target declares its own MaxRecvDataSegmentLength; nothing else needs offering.
        let o = t.offers(Some(Stage::Operational));
        assert_eq!(o, kv(&[("MaxRecvDataSegmentLength", "65536")]));
        assert!(!t.has_pending());
        let s = t.session_params();
        assert_eq!(s.max_burst_length, 131_072);
        assert_eq!(s.first_burst_length, 65_536);
        assert_eq!(s.default_time2retain, 0);
        assert!(s.initial_r2t && s.immediate_data);
        let c = t.connection_params();
        assert_eq!(c.header_digest, Digest::Crc32c);
        assert_eq!(c.data_digest, Digest::None);
        assert_eq!(c.max_send_data_segment_length, 262_144);
        assert_eq!(c.max_recv_data_segment_length, 65_536);
        assert!(c.rx_framing().header_digest && !c.rx_framing().data_digest);
        assert_eq!(c.tx_framing().max_data_segment_length, 262_144);
    }

    #[test]
    fn repeated_key_is_an_error() {
        let mut t = target(LocalParams::default());
        t.handle(
            &kv(&[("MaxBurstLength", "65536")]),
            Some(Stage::Operational),
        )
        .unwrap();
        assert_eq!(
            t.handle(
                &kv(&[("MaxBurstLength", "65536")]),
                Some(Stage::Operational)
            ),
            Err(NegotiationError::Repeated("MaxBurstLength".into()))
        );
        let mut t = target(LocalParams::default());
        assert!(matches!(
            t.handle(
                &kv(&[("InitialR2T", "No"), ("InitialR2T", "No")]),
                Some(Stage::Operational)
            ),
            Err(NegotiationError::Repeated(_))
        ));
        // A new text negotiation sequence may repeat keys.
        t.begin_sequence();
        assert!(t
            .handle(&kv(&[("MaxRecvDataSegmentLength", "4096")]), None)
            .is_ok());
    }

    #[test]
    fn discovery_and_non_leading_irrelevance() {
        let mut t = target(LocalParams::default());
        let p = t
            .handle(
                &kv(&[
                    ("MaxBurstLength", "4096"),
                    ("HeaderDigest", "None"),
                    ("SessionType", "Discovery"),
                    ("InitialR2T", "No"),
                    ("DefaultTime2Wait", "2"),
                    ("IFMarker", "No"),
                    ("OFMarkInt", "2048"),
                ]),
                Some(Stage::Security),
            )
            .unwrap();
        assert_eq!(t.session_type(), SessionType::Discovery);
        assert_eq!(answer(&p, "MaxBurstLength"), Some("Irrelevant"));
        assert_eq!(answer(&p, "InitialR2T"), Some("Irrelevant"));
        assert_eq!(answer(&p, "HeaderDigest"), Some("None"));
        assert_eq!(answer(&p, "DefaultTime2Wait"), Some("2"));
        assert_eq!(answer(&p, "IFMarker"), Some("Reject"));
        assert_eq!(answer(&p, "OFMarkInt"), Some("Reject"));
        assert_eq!(p.declared, kv(&[("SessionType", "Discovery")]));
        assert_eq!(t.session_params().max_burst_length, 262_144);

        let mut t = target(LocalParams::default());
        t.set_leading(false);
        let p = t
            .handle(
                &kv(&[("MaxConnections", "2"), ("DataDigest", "None")]),
                Some(Stage::Operational),
            )
            .unwrap();
        assert_eq!(answer(&p, "MaxConnections"), Some("Irrelevant"));
        assert_eq!(answer(&p, "DataDigest"), Some("None"));
    }

    #[test]
    fn first_burst_rules() {
        // Irrelevant when InitialR2T=Yes and ImmediateData=No.
        let mut t = target(LocalParams {
            immediate_data: false,
            ..LocalParams::default()
        });
        let p = t
            .handle(
                &kv(&[
                    ("InitialR2T", "Yes"),
                    ("ImmediateData", "Yes"),
                    ("FirstBurstLength", "8192"),
                ]),
                Some(Stage::Operational),
            )
            .unwrap();
        assert_eq!(answer(&p, "ImmediateData"), Some("No"));
        assert_eq!(answer(&p, "FirstBurstLength"), Some("Irrelevant"));
        // Never above MaxBurstLength, even when the offer breaks the rule.
        let mut t = target(LocalParams::default());
        let p = t
            .handle(
                &kv(&[("FirstBurstLength", "65536"), ("MaxBurstLength", "16384")]),
                Some(Stage::Operational),
            )
            .unwrap();
        assert_eq!(answer(&p, "MaxBurstLength"), Some("16384"));
        assert_eq!(answer(&p, "FirstBurstLength"), Some("16384"));
        assert_eq!(t.session_params().first_burst_length, 16384);
        // Our own configuration is normalized the same way.
        let n = Negotiator::new(
            Role::Initiator,
            LocalParams {
                first_burst_length: 1 << 20,
                max_burst_length: 1 << 16,
                ..LocalParams::default()
            },
        );
        assert_eq!(n.local().first_burst_length, 1 << 16);
    }

    #[test]
    fn wrong_phase_and_sender() {
        let mut t = target(LocalParams::default());
        let p = t
            .handle(
                &kv(&[
                    ("SendTargets", "All"),
                    ("TargetAlias", "x"),
                    ("CHAP_A", "5"),
                ]),
                Some(Stage::Operational),
            )
            .unwrap();
        assert_eq!(answer(&p, "SendTargets"), Some("Reject"));
        assert_eq!(answer(&p, "TargetAlias"), Some("Reject"));
        assert_eq!(answer(&p, "CHAP_A"), Some("Reject"));
        // Login-only keys in full feature phase.
        let mut t = target(LocalParams::default());
        let p = t.handle(&kv(&[("HeaderDigest", "None")]), None).unwrap();
        assert_eq!(answer(&p, "HeaderDigest"), Some("Reject"));
        // CHAP keys go to the authenticator in the security stage.
        let mut t = target(LocalParams::default());
        let p = t
            .handle(&kv(&[("CHAP_A", "5")]), Some(Stage::Security))
            .unwrap();
        assert_eq!(p.auth, kv(&[("CHAP_A", "5")]));
        assert!(p.answers.is_empty());
    }

    #[test]
    fn declarations_out_of_range_are_rejected() {
        let mut t = target(LocalParams::default());
        let p = t
            .handle(
                &kv(&[
                    ("MaxRecvDataSegmentLength", "100"),
                    ("SessionType", "Weird"),
                ]),
                Some(Stage::Operational),
            )
            .unwrap();
        assert_eq!(answer(&p, "MaxRecvDataSegmentLength"), Some("Reject"));
        assert_eq!(answer(&p, "SessionType"), Some("Reject"));
        assert_eq!(t.connection_params().max_send_data_segment_length, 8192);
    }

    #[test]
    fn initiator_offers_and_checks_answers() {
        let mut i = Negotiator::new(
            Role::Initiator,
            LocalParams {
                header_digest: vec![Digest::Crc32c, Digest::None],
                initial_r2t: false,
                max_recv_data_segment_length: 262_144,
                max_burst_length: 1 << 20,
                first_burst_length: 1 << 18,
                max_connections: 4,
                ..LocalParams::default()
            },
        );
        let offers = i.offers(Some(Stage::Operational));
        let get = |k: &str| offers.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("HeaderDigest"), Some("CRC32C,None"));
        assert_eq!(get("InitialR2T"), Some("No"));
        assert_eq!(get("MaxConnections"), Some("4"));
        assert_eq!(get("MaxRecvDataSegmentLength"), Some("262144"));
        assert_eq!(get("AuthMethod"), None);
        assert_eq!(get("OFMarker"), None);
        assert!(i.has_pending());
        // Offers are made once.
        assert!(i.offers(Some(Stage::Operational)).is_empty());

        let mut t = target(LocalParams {
            header_digest: vec![Digest::Crc32c],
            initial_r2t: false,
            max_burst_length: 1 << 18,
            max_connections: 2,
            ..LocalParams::default()
        });
        let answers = t.handle(&offers, Some(Stage::Operational)).unwrap();
        let mut reply = answers.answers.clone();
        reply.extend(t.offers(Some(Stage::Operational)));
        i.handle(&reply, Some(Stage::Operational)).unwrap();
        assert!(!i.has_pending());
        let (si, st) = (i.session_params(), t.session_params());
        assert_eq!(si, st);
        assert_eq!(si.max_connections, 2);
        assert!(!si.initial_r2t);
        assert_eq!(si.max_burst_length, 1 << 18);
        assert_eq!(si.first_burst_length, 1 << 16);
        let (ci, ct) = (i.connection_params(), t.connection_params());
        assert_eq!(ci.header_digest, Digest::Crc32c);
        assert_eq!(ct.header_digest, Digest::Crc32c);
        assert_eq!(
            ci.max_recv_data_segment_length,
            ct.max_send_data_segment_length
        );
        assert_eq!(
            ct.max_recv_data_segment_length,
            ci.max_send_data_segment_length
        );

        // An answer that breaks the function is refused.
        let mut i = Negotiator::new(Role::Initiator, LocalParams::default());
        let _ = i.offers(Some(Stage::Operational));
        assert!(matches!(
            i.handle(
                &kv(&[("MaxBurstLength", "1048576")]),
                Some(Stage::Operational)
            ),
            Err(NegotiationError::InvalidAnswer { .. })
        ));
    }

    #[test]
    fn answers_the_rfc_makes_optional_may_be_left_out() {
        // RFC 7143 6.2.2: an AND offered as No and an OR offered as Yes need no answer; their
        // outcome is the offer. LIO answers neither DataPDUInOrder=Yes nor DataSequenceInOrder=Yes.
        let mut i = Negotiator::new(
            Role::Initiator,
            LocalParams {
                immediate_data: false,
                ..LocalParams::default()
            },
        );
        let offers = i.offers(Some(Stage::Operational));
        let sent = |k: &str| offers.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(sent("DataPDUInOrder").as_deref(), Some("Yes"));
        assert_eq!(sent("ImmediateData").as_deref(), Some("No"));
        // The target answers everything else (echoing the offer, digests None) and leaves these
        // out; MaxRecvDataSegmentLength is a declaration, not an offer.
        const LEFT_OUT: [&str; 5] = [
            "DataPDUInOrder",
            "DataSequenceInOrder",
            "ImmediateData",
            "InitialR2T",
            "MaxRecvDataSegmentLength",
        ];
        let answers: Vec<(String, String)> = offers
            .iter()
            .filter(|(k, _)| !LEFT_OUT.contains(&k.as_str()))
            .map(|(k, v)| match k.as_str() {
                "HeaderDigest" | "DataDigest" => (k.clone(), "None".to_owned()),
                _ => (k.clone(), v.clone()),
            })
            .collect();
        i.handle(&answers, Some(Stage::Operational)).unwrap();
        // InitialR2T=Yes is an OR offered as Yes, so all four are settled without an answer.
        assert!(
            !i.has_pending(),
            "{:?}",
            i.pending_keys().collect::<Vec<_>>()
        );
        let p = i.session_params();
        assert!(p.data_pdu_in_order && p.data_sequence_in_order && p.initial_r2t);
        assert!(!p.immediate_data);

        // An OR offered as No must be answered; an answer that arrives is still checked.
        let mut i = Negotiator::new(
            Role::Initiator,
            LocalParams {
                initial_r2t: false,
                ..LocalParams::default()
            },
        );
        let _ = i.offers(Some(Stage::Operational));
        assert!(i.pending_keys().any(|k| k == "InitialR2T"));
        assert!(!i.pending_keys().any(|k| k == "DataPDUInOrder"));
        assert!(matches!(
            i.handle(&kv(&[("DataPDUInOrder", "No")]), Some(Stage::Operational)),
            Err(NegotiationError::InvalidAnswer { .. })
        ));
    }

    #[test]
    fn target_offers_only_what_changes_defaults() {
        let mut t = target(LocalParams {
            immediate_data: false,
            max_burst_length: 65536,
            first_burst_length: 65536,
            default_time2wait: 2,
            ..LocalParams::default()
        });
        let o = t.offers(Some(Stage::Operational));
        assert_eq!(
            o,
            kv(&[
                ("ImmediateData", "No"),
                ("MaxRecvDataSegmentLength", "8192"),
                ("MaxBurstLength", "65536"),
            ])
        );
        assert!(t.has_pending());
        let mut i = Negotiator::new(Role::Initiator, LocalParams::default());
        let p = i.handle(&o, Some(Stage::Operational)).unwrap();
        assert_eq!(answer(&p, "ImmediateData"), Some("No"));
        assert_eq!(answer(&p, "MaxBurstLength"), Some("65536"));
        t.handle(&p.answers, Some(Stage::Operational)).unwrap();
        assert!(!t.has_pending());
        assert!(!t.session_params().immediate_data);
    }

    #[test]
    fn vendor_keys_registered() {
        let def = KeyDef {
            name: "X-org.mcsi.split",
            kind: KeyKind::BooleanAnd,
            value: ValueSpec::Boolean,
            default: "No",
            leading_only: true,
            per_connection: false,
            phase: Phase::Login,
            senders: Senders::Both,
            discovery: false,
        };
        let mut t = target(LocalParams::default());
        t.register(def, "Yes").unwrap();
        assert!(t.register(def, "Yes").is_err());
        let bad = KeyDef {
            name: "Custom",
            ..def
        };
        assert!(t.register(bad, "Yes").is_err());
        let p = t
            .handle(
                &kv(&[("X-org.mcsi.split", "Yes"), ("X-org.mcsi.other", "1")]),
                Some(Stage::Operational),
            )
            .unwrap();
        assert_eq!(answer(&p, "X-org.mcsi.split"), Some("Yes"));
        assert_eq!(answer(&p, "X-org.mcsi.other"), Some("NotUnderstood"));
        assert_eq!(
            t.session_params()
                .extensions
                .get("X-org.mcsi.split")
                .map(String::as_str),
            Some("Yes")
        );
        // The initiator offers its registered keys too.
        let mut i = Negotiator::new(Role::Initiator, LocalParams::default());
        i.register(def, "Yes").unwrap();
        let o = i.offers(Some(Stage::Operational));
        assert!(o.contains(&("X-org.mcsi.split".to_owned(), "Yes".to_owned())));
    }
}
