//! SendTargets discovery (RFC 7143 12.3, appendix C): a Discovery session, one Text exchange
//! (with continuations), logout.

use crate::conn::{self, LoginOutcome};
use crate::error::Error;
use crate::negotiate::{LoginConfig, Offers, SessionKind};
use bytes::BytesMut;
use mcsi_proto::pdu::{Framing, Isid, LogoutRequest, Pdu, TextRequest, RESERVED_TAG};
use mcsi_proto::text::{encode as encode_text, parse, TextLimits};
use std::time::Duration;

/// Most SendTargets text buffered across continuations.
const MAX_TEXT: usize = 1 << 20;

/// One target and the portals it is reachable at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredTarget {
    pub name: String,
    /// `host:port,tpgt` as the target reported them (empty means the discovery portal itself).
    pub addresses: Vec<String>,
}

/// Group `TargetName`/`TargetAddress` pairs: each address belongs to the name before it.
pub fn parse_send_targets(keys: &[(String, String)]) -> Result<Vec<DiscoveredTarget>, Error> {
    let mut out: Vec<DiscoveredTarget> = Vec::new();
    for (k, v) in keys {
        match k.as_str() {
            "TargetName" => out.push(DiscoveredTarget {
                name: v.clone(),
                addresses: Vec::new(),
            }),
            "TargetAddress" => match out.last_mut() {
                Some(t) => t.addresses.push(v.clone()),
                None => {
                    return Err(Error::Protocol(
                        "SendTargets response has a TargetAddress before any TargetName".into(),
                    ))
                }
            },
            _ => {}
        }
    }
    Ok(out)
}

/// Ask the portal at `addr` (`host:port`) which targets it offers.
pub async fn discover(
    addr: &str,
    initiator_name: &str,
    timeout: Duration,
) -> Result<Vec<DiscoveredTarget>, Error> {
    let mut s = conn::connect_tcp(
        addr,
        &conn::Dial {
            timeout,
            ..Default::default()
        },
    )
    .await?;
    let cfg = LoginConfig {
        initiator_name: initiator_name.to_string(),
        target_name: None,
        kind: SessionKind::Discovery,
        isid: Isid([0x80, 0x4d, 0x43, 0x53, 0x49, 0x01]),
        tsih: 0,
        cid: 0,
        itt: 0,
        cmd_sn: 1,
        offers: Offers::default(),
        chap: None,
        chap_algorithms: Vec::new(),
        role: mcsi_proto::vendor::ConnRole::Both,
        random: crate::session::os_random,
    };
    let done = match conn::login(&mut s, cfg, timeout).await? {
        LoginOutcome::Done(d, rest) => {
            if !rest.is_empty() {
                return Err(Error::Protocol(
                    "the discovery portal sent PDUs after the final login response before any request".into(),
                ));
            }
            d
        }
        LoginOutcome::Redirect(a) => {
            return Err(Error::Protocol(format!(
                "the discovery portal redirects to {a}; connect there instead"
            )))
        }
    };
    let send = Framing {
        max_data_segment_length: done.params.target_max_recv_dsl,
        ..Framing::default()
    };
    let recv = Framing {
        max_data_segment_length: done.params.initiator_max_recv_dsl,
        ..Framing::default()
    };
    let mut exp_stat_sn = done.stat_sn.wrapping_add(1);
    let cmd_sn = done.exp_cmd_sn;
    let mut buf = BytesMut::new();
    let mut text = Vec::new();
    let mut ttt = RESERVED_TAG;
    let mut data = encode_text(&[("SendTargets", "All")]);
    let fut = async {
        loop {
            let req = Pdu::TextRequest(TextRequest {
                immediate: true,
                final_: true,
                continue_: false,
                lun: 0,
                itt: 1,
                ttt,
                cmd_sn,
                exp_stat_sn,
                data: std::mem::take(&mut data),
            });
            conn::write_encoded(&mut s, &[req.encode(&send)])
                .await
                .map_err(|e| Error::io("sending SendTargets", &e))?;
            let r = match conn::read_pdu(&mut s, &mut buf, &recv).await? {
                Pdu::TextResponse(r) => r,
                other => {
                    return Err(Error::Protocol(format!(
                        "expected a Text Response, got {:?}",
                        other.opcode()
                    )))
                }
            };
            exp_stat_sn = r.stat_sn.wrapping_add(1);
            if text.len() + r.data.len() > MAX_TEXT {
                return Err(Error::Protocol(format!(
                    "SendTargets response exceeds {MAX_TEXT} bytes"
                )));
            }
            text.extend_from_slice(&r.data);
            if r.final_ {
                break;
            }
            // More follows: an empty request with the target's TTT asks for it (11.10.4).
            ttt = r.ttt;
        }
        let logout = Pdu::LogoutRequest(LogoutRequest {
            immediate: true,
            reason: 0,
            itt: 2,
            cid: 0,
            cmd_sn,
            exp_stat_sn,
        });
        conn::write_encoded(&mut s, &[logout.encode(&send)])
            .await
            .map_err(|e| Error::io("sending Logout", &e))?;
        // The target's Logout Response; its absence does not spoil the answer.
        let _ = conn::read_pdu(&mut s, &mut buf, &recv).await;
        Ok(())
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| Error::Timeout(format!("SendTargets took longer than {timeout:?}")))??;
    let limits = TextLimits {
        max_pairs: 16384,
        max_total: MAX_TEXT,
    };
    let keys =
        parse(&text, &limits).map_err(|e| Error::Protocol(format!("SendTargets response: {e}")))?;
    parse_send_targets(&keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_addresses_under_names() {
        let keys = parse(
            b"TargetName=iqn.a:1\0TargetAddress=10.0.0.1:3260,1\0TargetAddress=[::1]:3260,2\0TargetName=iqn.b:2\0",
            &TextLimits::default(),
        )
        .unwrap();
        let t = parse_send_targets(&keys).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].name, "iqn.a:1");
        assert_eq!(t[0].addresses, vec!["10.0.0.1:3260,1", "[::1]:3260,2"]);
        assert!(t[1].addresses.is_empty());
        let bad = parse(b"TargetAddress=1.2.3.4:3260,1\0", &TextLimits::default()).unwrap();
        assert!(parse_send_targets(&bad).is_err());
    }
}
