//! Text Requests in full feature phase: SendTargets (RFC 7143 section 11.10, appendix C), with
//! long answers sent in pieces under a Target Transfer Tag.

use crate::session::{Conn, Session, Shared, Target};
use bytes::{Bytes, BytesMut};
use mcsi_proto::keys::{NOT_UNDERSTOOD, REJECT};
use mcsi_proto::pdu::{Pdu, TextRequest, TextResponse, RESERVED_TAG};
use mcsi_proto::text::{self, TextAccumulator, TextLimits};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use tracing::debug;

/// The rest of an answer the initiator has not fetched yet.
#[derive(Debug)]
pub struct Pending {
    pub itt: u32,
    pub ttt: u32,
    pub rest: Bytes,
}

/// A request whose text arrives over several PDUs (C bit, RFC 7143 11.10.2): the pieces so far,
/// and the tag the next piece must carry.
#[derive(Debug)]
pub struct Incoming {
    pub itt: u32,
    pub ttt: u32,
    pub text: TextAccumulator,
}

/// The one Text Request exchange a connection may have under way (11.10: at most one
/// outstanding Text Request per connection).
#[derive(Debug, Default)]
pub struct Exchange {
    pub answer: Option<Pending>,
    pub request: Option<Incoming>,
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
    let visible = |t: &&Arc<Target>| t.auth.allows(&session.initiator_name, peer);
    let list: Vec<&Target> = match value {
        "All" if session.is_discovery() => shared
            .targets
            .iter()
            .filter(visible)
            .map(|t| t.as_ref())
            .collect(),
        "All" | "" => own.map(|t| vec![t.as_ref()]).unwrap_or_default(),
        name => shared
            .targets
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
        for p in &t.portals {
            pairs.push(("TargetAddress", portal_text(*p, local, t.tpgt)));
        }
    }
    text::encode(&pairs).to_vec()
}

/// Answers one Text Request on `conn`.
pub fn handle(shared: &Shared, session: &Session, conn: &Conn, req: TextRequest) {
    let mut ex = conn.text.lock().unwrap_or_else(|p| p.into_inner());
    let reject = |req: TextRequest| {
        conn.send(crate::conn::reject_pdu(
            mcsi_proto::pdu::reject_reason::INVALID_PDU_FIELD,
            &Pdu::TextRequest(req),
        ))
    };
    // A Text Request with the C bit must not have the F bit (11.10.2), on any piece.
    if req.continue_ && req.final_ {
        *ex = Exchange::default();
        return reject(req);
    }
    let keys = if req.ttt != RESERVED_TAG {
        // A follow-on PDU carries the TTT we gave: either the next piece of a request the
        // initiator is still sending, or a request for the next piece of our answer.
        if let Some(mut incoming) = ex.request.take() {
            if incoming.ttt != req.ttt || incoming.itt != req.itt {
                return reject(req);
            }
            match incoming.text.push(&req.data, req.continue_) {
                Ok(Some(keys)) => keys,
                Ok(None) => {
                    let (itt, ttt, lun) = (incoming.itt, incoming.ttt, req.lun);
                    ex.request = Some(incoming);
                    return acknowledge_piece(conn, itt, ttt, lun);
                }
                Err(e) => {
                    debug!("Text Request continuation refused: {e}");
                    return reject(req);
                }
            }
        } else {
            match ex.answer.take() {
                // Asking for more of an answer carries no text of its own (11.10.2, 11.11.1).
                Some(p)
                    if p.ttt == req.ttt
                        && p.itt == req.itt
                        && !req.continue_
                        && req.data.is_empty() =>
                {
                    send_piece(session, conn, &mut ex, req.itt, req.lun, p.rest);
                }
                // Unknown TTT: Reject invalid PDU field (11.17.1).
                _ => reject(req),
            }
            return;
        }
    } else {
        // A new request resets any unfinished exchange (11.10.4).
        *ex = Exchange::default();
        if req.continue_ {
            let mut text = TextAccumulator::new(TextLimits::default());
            if let Err(e) = text.push(&req.data, true) {
                debug!("Text Request continuation refused: {e}");
                return reject(req);
            }
            let ttt = session.alloc_ttt();
            ex.request = Some(Incoming {
                itt: req.itt,
                ttt,
                text,
            });
            return acknowledge_piece(conn, req.itt, ttt, req.lun);
        }
        match text::parse(&req.data, &TextLimits::default()) {
            Ok(k) => k,
            Err(e) => {
                debug!("malformed Text Request: {e}");
                return reject(req);
            }
        }
    };
    let mut out = BytesMut::new();
    let mut answers: Vec<(String, String)> = Vec::new();
    for (k, v) in keys {
        if k == "SendTargets" {
            out.extend_from_slice(&send_targets(
                shared,
                session,
                &v,
                conn.local,
                conn.peer.ip(),
            ));
        } else {
            // Full feature phase renegotiation is not offered (RFC 7143 6.2): vendor keys are
            // not understood, standard ones rejected.
            let ans = if k.starts_with("X-") || k.starts_with("X#") {
                NOT_UNDERSTOOD
            } else {
                REJECT
            };
            answers.push((k, ans.to_owned()));
        }
    }
    out.extend_from_slice(&text::encode(&answers));
    send_piece(session, conn, &mut ex, req.itt, req.lun, out.freeze());
}

/// The answer to a piece of a request that has more to come: no data, F and C clear, and the
/// tag the initiator puts on the next piece (11.11.1, 11.11.4).
fn acknowledge_piece(conn: &Conn, itt: u32, ttt: u32, lun: u64) {
    conn.send(text_response(false, false, lun, itt, ttt, Bytes::new()));
}

/// A Text Response; the sequence numbers are stamped by the connection's writer.
fn text_response(final_: bool, continue_: bool, lun: u64, itt: u32, ttt: u32, data: Bytes) -> Pdu {
    Pdu::TextResponse(TextResponse {
        final_,
        continue_,
        lun,
        itt,
        ttt,
        stat_sn: 0,
        exp_cmd_sn: 0,
        max_cmd_sn: 0,
        data,
    })
}

fn send_piece(
    session: &Session,
    conn: &Conn,
    ex: &mut Exchange,
    itt: u32,
    lun: u64,
    mut data: Bytes,
) {
    let max = conn.ops.send_mrdsl.max(512) as usize;
    let (final_, ttt, piece) = if data.len() > max {
        let piece = data.split_to(max);
        let ttt = session.alloc_ttt();
        ex.answer = Some(Pending {
            itt,
            ttt,
            rest: data,
        });
        (false, ttt, piece)
    } else {
        (true, RESERVED_TAG, data)
    };
    conn.send(text_response(final_, !final_, lun, itt, ttt, piece));
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
