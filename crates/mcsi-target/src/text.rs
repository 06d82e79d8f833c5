//! Text Requests in full feature phase: SendTargets (RFC 7143 section 11.10, appendix C), with
//! long answers sent in pieces under a Target Transfer Tag.

use crate::session::{Conn, Session, Shared, Target};
use bytes::{Bytes, BytesMut};
use mcsi_proto::pdu::{Pdu, TextRequest, TextResponse, RESERVED_TAG};
use std::net::SocketAddr;

/// The rest of an answer the initiator has not fetched yet.
#[derive(Debug)]
pub struct Pending {
    pub itt: u32,
    pub ttt: u32,
    pub rest: Bytes,
}

/// Most key=value pairs one Text Request may carry before the target gives up on it.
const MAX_KEYS: usize = 64;

/// Splits a text data segment into (key, value) pairs (RFC 7143 6.1: `key=value` each ended by
/// a NUL). Malformed pairs come back with an empty key so the caller can reject them.
pub fn pairs(data: &[u8]) -> Vec<(String, String)> {
    data.split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .take(MAX_KEYS)
        .map(|kv| {
            let s = String::from_utf8_lossy(kv);
            match s.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (String::new(), s.to_string()),
            }
        })
        .collect()
}

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
/// session's own), a name lists that target, an empty value lists the session's target.
pub fn send_targets(shared: &Shared, session: &Session, value: &str, local: SocketAddr) -> Vec<u8> {
    let own = session.target.as_ref();
    let list: Vec<&Target> = match value {
        "All" if session.is_discovery() => shared.targets.iter().map(|t| t.as_ref()).collect(),
        "All" | "" => own.map(|t| vec![t.as_ref()]).unwrap_or_default(),
        name => shared
            .targets
            .iter()
            .filter(|t| {
                t.name == name && (session.is_discovery() || own.is_some_and(|o| o.name == name))
            })
            .map(|t| t.as_ref())
            .collect(),
    };
    let mut out = Vec::new();
    for t in list {
        out.extend_from_slice(format!("TargetName={}\0", t.name).as_bytes());
        for p in &t.portals {
            out.extend_from_slice(
                format!("TargetAddress={}\0", portal_text(*p, local, t.tpgt)).as_bytes(),
            );
        }
    }
    out
}

/// Answers one Text Request on `conn`.
pub fn handle(shared: &Shared, session: &Session, conn: &Conn, req: TextRequest) {
    let mut pending = conn.text.lock().unwrap_or_else(|p| p.into_inner());
    // A continuation: the initiator asks for the next piece with the TTT we gave (11.10.4).
    if req.ttt != RESERVED_TAG {
        match pending.take() {
            Some(p) if p.ttt == req.ttt && p.itt == req.itt => {
                send_piece(session, conn, &mut pending, req.itt, req.lun, p.rest);
            }
            _ => {
                // Unknown TTT: Reject invalid PDU field (11.17.1).
                conn.send(crate::conn::reject_pdu(
                    mcsi_proto::pdu::reject_reason::INVALID_PDU_FIELD,
                    &Pdu::TextRequest(req),
                ));
            }
        }
        return;
    }
    // A new request resets any unfinished answer (11.10.2).
    *pending = None;
    let mut out = BytesMut::new();
    for (k, v) in pairs(&req.data) {
        if k == "SendTargets" {
            out.extend_from_slice(&send_targets(shared, session, &v, conn.local));
        } else if k.is_empty() {
            continue;
        } else {
            // Full feature phase renegotiation is not offered; unknown keys are NotUnderstood.
            let ans = if k.starts_with("X-") || k.starts_with("X#") {
                "NotUnderstood"
            } else {
                "Reject"
            };
            out.extend_from_slice(format!("{k}={ans}\0").as_bytes());
        }
    }
    send_piece(session, conn, &mut pending, req.itt, req.lun, out.freeze());
}

fn send_piece(
    session: &Session,
    conn: &Conn,
    pending: &mut Option<Pending>,
    itt: u32,
    lun: u64,
    mut data: Bytes,
) {
    let max = conn.ops.send_mrdsl.max(512) as usize;
    let (final_, ttt, piece) = if data.len() > max {
        let piece = data.split_to(max);
        let ttt = session.alloc_ttt();
        *pending = Some(Pending {
            itt,
            ttt,
            rest: data,
        });
        (false, ttt, piece)
    } else {
        (true, RESERVED_TAG, data)
    };
    conn.send(Pdu::TextResponse(TextResponse {
        final_,
        continue_: !final_,
        lun,
        itt,
        ttt,
        stat_sn: 0,
        exp_cmd_sn: 0,
        max_cmd_sn: 0,
        data: piece,
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pairs() {
        assert_eq!(
            pairs(b"SendTargets=All\0X-a=1\0junk\0"),
            vec![
                ("SendTargets".into(), "All".into()),
                ("X-a".into(), "1".into()),
                (String::new(), "junk".into())
            ]
        );
    }

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
