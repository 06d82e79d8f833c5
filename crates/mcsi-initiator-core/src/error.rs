//! Errors of the initiator, by reach: a single task (SCSI status, residuals), a connection or
//! session (I/O, protocol, login), or the caller's input.

use crate::sense::Sense;
use std::fmt;

/// Anything that can go wrong in the initiator. `Clone` because one session failure fails every
/// task that was waiting on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The `iscsi://` URL (or another argument) is malformed.
    #[error("{0}")]
    InvalidArgument(String),
    /// TCP connect, read or write failed.
    #[error("{context}: {message}")]
    Io {
        context: String,
        kind: std::io::ErrorKind,
        message: String,
    },
    /// The target refused the login (RFC 7143 11.13.5).
    #[error("login to {target} refused: {} (status class {class}, detail {detail})", login_status_name(*.class, *.detail))]
    Login {
        target: String,
        class: u8,
        detail: u8,
    },
    /// Negotiation did not produce usable parameters.
    #[error("login negotiation failed: {0}")]
    Negotiation(String),
    /// The peer broke a protocol rule; the connection cannot go on.
    #[error("protocol error from the target: {0}")]
    Protocol(String),
    /// A PDU from the target could not be decoded (a digest, a length, an opcode); at
    /// ErrorRecoveryLevel 0 the connection cannot go on (RFC 7143 7.1.1).
    #[error("undecodable PDU from the target: {0}")]
    Decode(mcsi_proto::pdu::DecodeError),
    /// The target answered a PDU with a Reject (RFC 7143 11.17).
    #[error("the target rejected the request: {}", reject_name(*.reason))]
    Rejected { reason: u8 },
    /// The command completed with a SCSI status other than GOOD.
    #[error("{0}")]
    Scsi(ScsiError),
    /// The target reported an iSCSI service response other than "command completed" (11.4.3).
    #[error("the target failed the command (iSCSI response {response:#04x})")]
    TargetFailure { response: u8 },
    /// Fewer bytes moved than asked for (a residual underflow, 11.4.5).
    #[error("short transfer: {actual} of {expected} bytes")]
    ShortTransfer { expected: u64, actual: u64 },
    /// The session was lost and could not be re-established.
    #[error("session lost after {attempts} reconnect attempt(s): {last}")]
    SessionLost { attempts: u32, last: String },
    /// The session was closed (logged out) while the request was waiting.
    #[error("the session is closed")]
    Closed,
    /// A reply did not arrive in time.
    #[error("timed out: {0}")]
    Timeout(String),
}

impl Error {
    /// An I/O error of the driver, kept as data (its kind and message).
    pub fn io(context: impl Into<String>, e: &std::io::Error) -> Error {
        Error::Io {
            context: context.into(),
            kind: e.kind(),
            message: e.to_string(),
        }
    }

    /// How far the error reaches: one task, the connection it came on, the whole session, or
    /// only the caller's request (nothing was sent).
    pub fn scope(&self) -> Scope {
        match self {
            Error::InvalidArgument(_) => Scope::Caller,
            Error::Scsi(_)
            | Error::TargetFailure { .. }
            | Error::ShortTransfer { .. }
            | Error::Rejected { .. } => Scope::Task,
            Error::Io { .. } | Error::Protocol(_) | Error::Decode(_) | Error::Timeout(_) => {
                Scope::Connection
            }
            Error::Login { .. }
            | Error::Negotiation(_)
            | Error::SessionLost { .. }
            | Error::Closed => Scope::Session,
        }
    }

    /// Whether this is a CHECK CONDITION with sense key UNIT ATTENTION, which is worth a retry.
    pub fn is_unit_attention(&self) -> bool {
        matches!(self, Error::Scsi(ScsiError { sense: Some(s), .. }) if s.key == crate::sense::SenseKey::UnitAttention)
    }
}

/// How far an [`Error`] reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The caller's input was wrong; nothing went to the target.
    Caller,
    /// One task failed; the session goes on (a SCSI status, a residual, a Reject of its PDU).
    Task,
    /// The connection it happened on cannot go on (I/O, a protocol or decode error, a reply
    /// that did not come); at ErrorRecoveryLevel 0 the session recovers as a whole.
    Connection,
    /// The session: a login refused or not negotiated, the session lost or closed.
    Session,
}

/// A SCSI status other than GOOD, with its sense data when the target sent any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScsiError {
    pub status: u8,
    pub sense: Option<Sense>,
}

impl fmt::Display for ScsiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SCSI status {}", status_name(self.status))?;
        if let Some(s) = &self.sense {
            write!(f, ": {s}")?;
        }
        Ok(())
    }
}

/// SAM-5 status codes.
pub use mcsi_scsi::status;

fn status_name(s: u8) -> String {
    let name = match s {
        status::GOOD => "GOOD",
        status::CHECK_CONDITION => "CHECK CONDITION",
        status::CONDITION_MET => "CONDITION MET",
        status::BUSY => "BUSY",
        status::RESERVATION_CONFLICT => "RESERVATION CONFLICT",
        status::TASK_SET_FULL => "TASK SET FULL",
        status::ACA_ACTIVE => "ACA ACTIVE",
        status::TASK_ABORTED => "TASK ABORTED",
        _ => return format!("{s:#04x}"),
    };
    format!("{name} ({s:#04x})")
}

/// Names of login status class/detail pairs (RFC 7143 11.13.5).
pub fn login_status_name(class: u8, detail: u8) -> &'static str {
    match (class, detail) {
        (0, 0) => "success",
        (1, 1) => "target moved temporarily",
        (1, 2) => "target moved permanently",
        (2, 0) => "initiator error",
        (2, 1) => "authentication failed",
        (2, 2) => "authorization failed (this initiator may not access the target)",
        (2, 3) => "target not found",
        (2, 4) => "target removed",
        (2, 5) => "unsupported iSCSI version",
        (2, 6) => "too many connections",
        (2, 7) => "missing parameter",
        (2, 8) => "cannot include this connection in the session",
        (2, 9) => "session type not supported",
        (2, 10) => "session does not exist",
        (2, 11) => "invalid request during login",
        (3, 0) => "target error",
        (3, 1) => "service unavailable",
        (3, 2) => "out of resources",
        (1, _) => "redirection",
        (2, _) => "initiator error",
        (3, _) => "target error",
        _ => "unknown status",
    }
}

fn reject_name(reason: u8) -> String {
    let name = match reason {
        0x02 => "data digest error",
        0x03 => "SNACK reject",
        0x04 => "protocol error",
        0x05 => "command not supported",
        0x06 => "immediate command rejected",
        0x07 => "task in progress",
        0x08 => "invalid data ack",
        0x09 => "invalid PDU field",
        0x0a => "long operation reject",
        0x0b => "deprecated",
        0x0c => "waiting for logout",
        _ => "unknown reason",
    };
    format!("{name} (reason {reason:#04x})")
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<mcsi_tcp::sched::PolicyError> for Error {
    fn from(e: mcsi_tcp::sched::PolicyError) -> Self {
        Error::InvalidArgument(e.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes() {
        let scsi = Error::Scsi(ScsiError {
            status: status::CHECK_CONDITION,
            sense: None,
        });
        assert_eq!(scsi.scope(), Scope::Task);
        assert_eq!(Error::Rejected { reason: 4 }.scope(), Scope::Task);
        let decode = Error::Decode(mcsi_proto::pdu::DecodeError::HeaderDigest {
            received: 1,
            computed: 2,
        });
        assert_eq!(decode.scope(), Scope::Connection);
        assert!(decode.to_string().contains("undecodable PDU"), "{decode}");
        assert_eq!(Error::Timeout("x".into()).scope(), Scope::Connection);
        assert_eq!(Error::Closed.scope(), Scope::Session);
        assert_eq!(Error::InvalidArgument("x".into()).scope(), Scope::Caller);
    }
}
