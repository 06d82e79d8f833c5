//! Text Requests in full feature phase: SendTargets (RFC 7143 section 11.10, appendix C). The
//! exchange itself (requests in pieces, long answers fetched under a Target Transfer Tag) is the
//! core's `mcsi_target_core::text`.

use crate::session::{Conn, Session, Shared, Target};
use mcsi_proto::pdu::{Pdu, TextRequest};
use mcsi_proto::text;
use mcsi_target_core::text::{answer_keys, TextStep};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use tracing::debug;

/// `TargetAddress` value of a portal: a wildcard address is replaced by the address the
/// initiator reached us on (RFC 7143 13.8 wants an address the initiator can use).
pub fn portal_text(portal: SocketAddr, local: SocketAddr, tpgt: u16) -> String {
    let ip = if portal.ip().is_unspecified() {
        local.ip()
    } else {
        portal.ip()
    };
    let addr = SocketAddr::new(ip, portal.port());
    format!("{addr},{tpgt}")
}

/// The SendTargets answer (appendix C): `All` lists every target (in a normal session only the
/// session's own), a name lists that target, an empty value lists the session's target. A
/// discovery session only learns of targets whose allow-list admits its initiator name and
/// address, so access control does not leak the names of targets it would refuse.
pub fn send_targets(
    shared: &Shared,
    session: &Session,
    value: &str,
    local: SocketAddr,
    peer: IpAddr,
) -> Vec<u8> {
    let own = session.target.as_ref();
    let visible = |t: &&Arc<Target>| t.auth.load().allows(&session.initiator_name, peer);
    let targets = shared.targets();
    let list: Vec<&Target> = match value {
        "All" if session.is_discovery() => {
            targets.iter().filter(visible).map(|t| t.as_ref()).collect()
        }
        "All" | "" => own.map(|t| vec![t.as_ref()]).unwrap_or_default(),
        name => targets
            .iter()
            .filter(visible)
            .filter(|t| {
                t.name == name && (session.is_discovery() || own.is_some_and(|o| o.name == name))
            })
            .map(|t| t.as_ref())
            .collect(),
    };
    let mut pairs = Vec::new();
    for t in list {
        pairs.push(("TargetName", t.name.clone()));
        if t.advertise.is_empty() {
            for p in t.portals.load().iter() {
                pairs.push(("TargetAddress", portal_text(*p, local, t.tpgt)));
            }
        } else {
            // Behind NAT the portals are not what the initiator can reach: the addresses
            // the administrator named are.
            for a in &t.advertise {
                pairs.push(("TargetAddress", format!("{a},{}", t.tpgt)));
            }
        }
    }
    text::encode(&pairs).to_vec()
}

/// Answers one Text Request on `conn`: the exchange's steps are the core's
/// ([`mcsi_target_core::text::TextExchange`]); the SendTargets answer is this layer's (it needs the target list).
pub fn handle(shared: &Shared, session: &Session, conn: &Conn, req: TextRequest) {
    let mut ex = conn.text.lock().unwrap_or_else(|p| p.into_inner());
    match ex.on_request(&req, || session.alloc_ttt()) {
        TextStep::Send(p) => conn.send(p),
        TextStep::Reject(why) => {
            debug!("Text Request refused: {why}");
            conn.send(Pdu::reject_of(
                mcsi_proto::pdu::reject_reason::INVALID_PDU_FIELD,
                &Pdu::TextRequest(req),
            ));
        }
        TextStep::Keys { itt, lun, keys } => {
            let answer = answer_keys(keys, |v| {
                send_targets(shared, session, v, conn.local, conn.peer.ip())
            });
            conn.send(ex.answer(itt, lun, answer, || session.alloc_ttt()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_portal_uses_local_address() {
        let local: SocketAddr = "192.0.2.7:3260".parse().unwrap();
        assert_eq!(
            portal_text("0.0.0.0:3261".parse().unwrap(), local, 1),
            "192.0.2.7:3261,1"
        );
        assert_eq!(
            portal_text("[::1]:3262".parse().unwrap(), local, 2),
            "[::1]:3262,2"
        );
    }
}
