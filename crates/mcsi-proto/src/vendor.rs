//! mcsi's vendor keys (RFC 7143 13.5.4: private keys start with `X-` and a reversed domain name).
//!
//! The asymmetric mode of the thesis (4.3.2-4.3.3) puts a session's requests on some of its
//! connections and its responses on the others. Two keys carry it, one table row each for both
//! sides:
//!
//! - [`ASYMMETRIC`] (`X-org.mcsi.Asymmetric`), session-wide, leading login only, Boolean AND:
//!   both sides must say Yes. Only an mcsi initiator offers it; a target registers it with Yes but
//!   never offers it itself (the AND result with the default No would be No, and targets offer
//!   only what changes the default), so standard initiators never see it. A standard target
//!   answers NotUnderstood and the key keeps its default, No.
//! - [`CONNECTION_ROLE`] (`X-org.mcsi.ConnectionRole`), per connection, offered by the initiator
//!   on every login of an asymmetric session: `requests` (commands and their Data-Out go here)
//!   or `responses` (the target sends the R2T, Data-In and SCSI Response of tasks here). The
//!   target answers with the role it takes. Without the key, or outside an asymmetric session, a
//!   connection carries both directions as RFC 7143 says.

use crate::keys::{KeyDef, KeyKind, Phase, Senders, ValueSpec};

/// `X-org.mcsi.Asymmetric`: requests and responses on separate connections.
pub const ASYMMETRIC: KeyDef = KeyDef {
    name: "X-org.mcsi.Asymmetric",
    kind: KeyKind::BooleanAnd,
    value: ValueSpec::Boolean,
    default: "No",
    leading_only: true,
    per_connection: false,
    phase: Phase::Login,
    senders: Senders::Both,
    discovery: false,
};

/// `X-org.mcsi.ConnectionRole`: what this connection carries in an asymmetric session.
pub const CONNECTION_ROLE: KeyDef = KeyDef {
    name: "X-org.mcsi.ConnectionRole",
    kind: KeyKind::List,
    value: ValueSpec::Names(&["both", "requests", "responses"]),
    default: "both",
    leading_only: false,
    per_connection: true,
    phase: Phase::Login,
    senders: Senders::Initiator,
    discovery: false,
};

/// `X-org.mcsi.TcpReport`: the target reports the TCP state of its sending side.
///
/// Session-wide, leading login only, Boolean AND, offered only by an mcsi initiator (a target
/// registers it and never offers it, so standard initiators never see it). When agreed, the
/// target sends on each connection, at most every [`TCP_REPORT_INTERVAL_MS`] while the
/// connection is sending, an Async Message with AsyncEvent 255 (vendor specific) and AsyncVCode
/// [`TCP_REPORT_VCODE`], whose data is SenseLength 0 followed by [`encode_report`]'s text:
/// `key=value` pairs of unsigned decimal numbers, each ended by a NUL, describing that
/// connection's socket (see mcsi-tcp's `TcpState::report_pairs` for the keys). A reader ignores
/// keys it does not know.
pub const TCP_REPORT: KeyDef = KeyDef {
    name: "X-org.mcsi.TcpReport",
    kind: KeyKind::BooleanAnd,
    value: ValueSpec::Boolean,
    default: "No",
    leading_only: true,
    per_connection: false,
    phase: Phase::Login,
    senders: Senders::Both,
    discovery: false,
};

/// `X-org.mcsi.ReassignBehindLogout`: the target takes TASK REASSIGNs sent right behind the
/// Logout "remove the connection for recovery" that they depend on.
///
/// RFC 7143 6.2.2 has the initiator wait until that Logout has completed before it reassigns a
/// task: a target may act on the Logout only when it answers it (Linux's LIO does), and a TASK
/// REASSIGN that overtakes it finds nothing to move. mcsi's target handles a connection's
/// immediate requests in the order they arrive, the Logout included, so with it the wait only
/// costs a round trip per failed connection. Session-wide, leading login only, Boolean AND,
/// offered only by an mcsi initiator that offers ErrorRecoveryLevel 2 (a target registers it and
/// never offers it); a standard target answers NotUnderstood and the initiator waits.
pub const REASSIGN_BEHIND_LOGOUT: KeyDef = KeyDef {
    name: "X-org.mcsi.ReassignBehindLogout",
    kind: KeyKind::BooleanAnd,
    value: ValueSpec::Boolean,
    default: "No",
    leading_only: true,
    per_connection: false,
    phase: Phase::Login,
    senders: Senders::Both,
    discovery: false,
};

/// Whether a login agreed that TASK REASSIGNs may follow their Logout without waiting.
pub fn reassign_behind_logout_agreed(
    extensions: &std::collections::BTreeMap<String, String>,
) -> bool {
    agreed(extensions, &REASSIGN_BEHIND_LOGOUT)
}

/// AsyncVCode of a TCP state report (AsyncEvent 255).
pub const TCP_REPORT_VCODE: u8 = 1;

/// Shortest time between two reports on one connection.
pub const TCP_REPORT_INTERVAL_MS: u64 = 50;

/// Whether a login agreed on TCP state reports.
pub fn tcp_report_agreed(extensions: &std::collections::BTreeMap<String, String>) -> bool {
    agreed(extensions, &TCP_REPORT)
}

/// Whether the login's agreed `extensions` hold Boolean key `def` at Yes.
fn agreed(extensions: &std::collections::BTreeMap<String, String>, def: &KeyDef) -> bool {
    extensions.get(def.name).map(String::as_str) == Some("Yes")
}

/// The data segment of a report Async Message: SenseLength 0, then `key=value\0` pairs.
pub fn encode_report(pairs: &[(&str, u64)]) -> bytes::Bytes {
    let mut v = vec![0u8, 0u8];
    for (k, val) in pairs {
        v.extend_from_slice(k.as_bytes());
        v.push(b'=');
        v.extend_from_slice(val.to_string().as_bytes());
        v.push(0);
    }
    bytes::Bytes::from(v)
}

/// The pairs of a report's data segment; malformed pairs are skipped, at most 64 are kept.
pub fn decode_report(data: &[u8]) -> Vec<(String, u64)> {
    let sense_len = data
        .get(..2)
        .map_or(0, |b| usize::from(u16::from_be_bytes([b[0], b[1]])));
    let body = data.get(2 + sense_len..).unwrap_or_default();
    body.split(|&b| b == 0)
        .filter_map(|p| {
            let s = std::str::from_utf8(p).ok()?;
            let (k, v) = s.split_once('=')?;
            let ok = !k.is_empty()
                && k.len() <= 32
                && k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
            ok.then_some(())?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .take(64)
        .collect()
}

/// The role of one connection of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum ConnRole {
    /// Requests and responses (every standard connection).
    #[default]
    Both,
    /// Initiator to target: commands, Data-Out, task management, NOP-Out, Text, Logout.
    Requests,
    /// Target to initiator: the R2T, Data-In and SCSI Response of tasks whose command came on a
    /// request connection.
    Responses,
}

impl ConnRole {
    /// The key's value for this role.
    pub fn as_str(self) -> &'static str {
        match self {
            ConnRole::Both => "both",
            ConnRole::Requests => "requests",
            ConnRole::Responses => "responses",
        }
    }

    pub fn parse(s: &str) -> Option<ConnRole> {
        match s {
            "both" => Some(ConnRole::Both),
            "requests" => Some(ConnRole::Requests),
            "responses" => Some(ConnRole::Responses),
            _ => None,
        }
    }

    /// The role a login agreed on: [`CONNECTION_ROLE`]'s value when the session is asymmetric
    /// (`extensions` are the login's agreed vendor keys), else [`ConnRole::Both`].
    pub fn agreed(
        asymmetric: bool,
        extensions: &std::collections::BTreeMap<String, String>,
    ) -> ConnRole {
        if !asymmetric {
            return ConnRole::Both;
        }
        extensions
            .get(CONNECTION_ROLE.name)
            .and_then(|v| ConnRole::parse(v))
            .unwrap_or_default()
    }
}

/// Whether a login agreed on the asymmetric mode (`extensions` are its agreed vendor keys).
pub fn asymmetric_agreed(extensions: &std::collections::BTreeMap<String, String>) -> bool {
    agreed(extensions, &ASYMMETRIC)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{LocalParams, Negotiator, Role, SessionType};
    use crate::pdu::Stage;

    fn target() -> Negotiator {
        let mut t = Negotiator::new(Role::Target, LocalParams::default());
        t.register(ASYMMETRIC, "Yes").unwrap();
        t.register(CONNECTION_ROLE, "requests,responses,both")
            .unwrap();
        t.set_session_type(SessionType::Normal);
        t
    }

    #[test]
    fn reports_round_trip_and_malformed_pairs_are_skipped() {
        let d = encode_report(&[("cwnd", 10), ("snd_mss", 1448)]);
        assert_eq!(&d[..], b"\0\0cwnd=10\0snd_mss=1448\0");
        assert_eq!(
            decode_report(&d),
            vec![("cwnd".into(), 10), ("snd_mss".into(), 1448)]
        );
        let junk = b"\0\0cwnd=x\0=5\0Bad=1\0rtt_us=7\0\xff\xfe\0noequals\0";
        assert_eq!(decode_report(junk), vec![("rtt_us".into(), 7)]);
        assert!(decode_report(b"").is_empty());
        assert!(decode_report(b"\0\xff").is_empty());
    }

    #[test]
    fn roles_round_trip() {
        for r in [ConnRole::Both, ConnRole::Requests, ConnRole::Responses] {
            assert_eq!(ConnRole::parse(r.as_str()), Some(r));
        }
        assert_eq!(ConnRole::parse("Responses"), None);
    }

    #[test]
    fn a_target_never_offers_the_vendor_keys_itself() {
        let mut t = target();
        let offers = t.offers(Some(Stage::Operational));
        assert!(
            !offers.iter().any(|(k, _)| k.starts_with("X-")),
            "{offers:?}"
        );
    }

    #[test]
    fn a_target_agrees_to_what_an_mcsi_initiator_offers() {
        let mut t = target();
        let p = t
            .handle(
                &[
                    (ASYMMETRIC.name.into(), "Yes".into()),
                    (CONNECTION_ROLE.name.into(), "responses".into()),
                ],
                Some(Stage::Operational),
            )
            .unwrap();
        assert!(p.answers.contains(&(ASYMMETRIC.name.into(), "Yes".into())));
        assert!(p
            .answers
            .contains(&(CONNECTION_ROLE.name.into(), "responses".into())));
        let ext = t.session_params().extensions;
        assert!(asymmetric_agreed(&ext));
        assert_eq!(ConnRole::agreed(true, &ext), ConnRole::Responses);
        assert_eq!(ConnRole::agreed(false, &ext), ConnRole::Both);
    }

    #[test]
    fn a_target_that_refuses_the_mode_answers_no() {
        let mut t = Negotiator::new(Role::Target, LocalParams::default());
        t.register(ASYMMETRIC, "No").unwrap();
        let p = t
            .handle(
                &[(ASYMMETRIC.name.into(), "Yes".into())],
                Some(Stage::Operational),
            )
            .unwrap();
        assert_eq!(p.answers, vec![(ASYMMETRIC.name.into(), "No".into())]);
        assert!(!asymmetric_agreed(&t.session_params().extensions));
    }
}
