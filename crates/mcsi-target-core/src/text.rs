//! Text Request exchanges in full feature phase (RFC 7143 11.10, 11.11): a request whose text
//! comes in several PDUs (C bit), and an answer longer than the initiator's
//! MaxRecvDataSegmentLength sent in pieces it fetches under a Target Transfer Tag. At most one
//! exchange is under way per connection; a new request (TTT 0xffffffff) resets it (11.10.4).
//!
//! [`TextExchange::on_request`] takes each Text Request and says what to do: send a PDU (the
//! acknowledgement of a piece, the next piece of an answer), reject it, or answer the complete
//! request's keys; the layer above computes the answer's text (SendTargets needs the target
//! list) with [`answer_keys`] and hands it to [`TextExchange::answer`], which cuts it.

use bytes::{Bytes, BytesMut};
use mcsi_proto::keys::{NOT_UNDERSTOOD, REJECT};
use mcsi_proto::pdu::{Pdu, TextRequest, TextResponse, RESERVED_TAG};
use mcsi_proto::text::{self, TextAccumulator, TextError, TextLimits};

/// The rest of an answer the initiator has not fetched yet.
#[derive(Debug)]
struct Pending {
    itt: u32,
    ttt: u32,
    rest: Bytes,
}

/// A request whose text arrives over several PDUs: the pieces so far, and the tag the next
/// piece must carry.
#[derive(Debug)]
struct Incoming {
    itt: u32,
    ttt: u32,
    text: TextAccumulator,
}

/// The one Text Request exchange a connection may have under way.
#[derive(Debug)]
pub struct TextExchange {
    answer: Option<Pending>,
    request: Option<Incoming>,
    /// Most bytes of text per Text Response: the initiator's MaxRecvDataSegmentLength (at least
    /// 512, its smallest legal value).
    max_piece: usize,
}

/// Why a Text Request is rejected (with reason "invalid PDU field", 11.17.1).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TextRefused {
    #[error("C and F bits both set")]
    ContinueAndFinal,
    #[error("TTT {ttt:#x} / ITT {itt:#x} belongs to no exchange under way")]
    UnknownTag { itt: u32, ttt: u32 },
    #[error("a request for more of an answer carries text or the C bit")]
    TextWithFetch,
    #[error("malformed text: {0}")]
    Text(#[from] TextError),
}

/// What to do with one Text Request.
#[derive(Debug)]
pub enum TextStep {
    /// Send this Text Response (a piece acknowledged, or the next piece of an answer).
    Send(Pdu),
    /// Reject the request; the exchange under way is dropped.
    Reject(TextRefused),
    /// The request is complete: answer these keys ([`TextExchange::answer`]).
    Keys {
        itt: u32,
        lun: u64,
        keys: Vec<(String, String)>,
    },
}

impl TextExchange {
    /// No exchange under way, on a connection whose initiator takes `max_piece` bytes of data
    /// per PDU.
    pub fn new(max_piece: u32) -> Self {
        Self {
            answer: None,
            request: None,
            max_piece: (max_piece as usize).max(512),
        }
    }

    fn reset(&mut self) {
        self.answer = None;
        self.request = None;
    }

    /// Whether an exchange is under way (a request being received or an answer being fetched).
    pub fn in_progress(&self) -> bool {
        self.answer.is_some() || self.request.is_some()
    }

    /// Takes one Text Request. `alloc_ttt` gives a Target Transfer Tag unique in the session.
    pub fn on_request(&mut self, req: &TextRequest, alloc_ttt: impl FnOnce() -> u32) -> TextStep {
        // A Text Request with the C bit must not have the F bit (11.10.2), on any piece.
        if req.continue_ && req.final_ {
            self.reset();
            return TextStep::Reject(TextRefused::ContinueAndFinal);
        }
        if req.ttt == RESERVED_TAG {
            // A new request resets any unfinished exchange (11.10.4).
            self.reset();
            if req.continue_ {
                let mut text = TextAccumulator::new(TextLimits::default());
                if let Err(e) = text.push(&req.data, true) {
                    return TextStep::Reject(e.into());
                }
                let ttt = alloc_ttt();
                self.request = Some(Incoming {
                    itt: req.itt,
                    ttt,
                    text,
                });
                return TextStep::Send(acknowledgement(req.itt, ttt, req.lun));
            }
            return match text::parse(&req.data, &TextLimits::default()) {
                Ok(keys) => TextStep::Keys {
                    itt: req.itt,
                    lun: req.lun,
                    keys,
                },
                Err(e) => TextStep::Reject(e.into()),
            };
        }
        // A follow-on PDU carries the TTT we gave: the next piece of a request the initiator is
        // still sending, or a request for the next piece of our answer.
        let unknown = TextRefused::UnknownTag {
            itt: req.itt,
            ttt: req.ttt,
        };
        if let Some(mut incoming) = self.request.take() {
            if incoming.ttt != req.ttt || incoming.itt != req.itt {
                return TextStep::Reject(unknown);
            }
            return match incoming.text.push(&req.data, req.continue_) {
                Ok(Some(keys)) => TextStep::Keys {
                    itt: req.itt,
                    lun: req.lun,
                    keys,
                },
                Ok(None) => {
                    let (itt, ttt) = (incoming.itt, incoming.ttt);
                    self.request = Some(incoming);
                    TextStep::Send(acknowledgement(itt, ttt, req.lun))
                }
                Err(e) => TextStep::Reject(e.into()),
            };
        }
        match self.answer.take() {
            Some(p) if p.ttt == req.ttt && p.itt == req.itt => {
                // Asking for more of an answer carries no text of its own (11.10.2, 11.11.1).
                if req.continue_ || !req.data.is_empty() {
                    return TextStep::Reject(TextRefused::TextWithFetch);
                }
                TextStep::Send(self.piece(req.itt, req.lun, p.rest, alloc_ttt))
            }
            _ => TextStep::Reject(unknown),
        }
    }

    /// The first Text Response of the answer `data` to a complete request: all of it if it fits
    /// in one PDU, else its first piece with a TTT under which the initiator fetches the rest.
    pub fn answer(
        &mut self,
        itt: u32,
        lun: u64,
        data: Bytes,
        alloc_ttt: impl FnOnce() -> u32,
    ) -> Pdu {
        self.piece(itt, lun, data, alloc_ttt)
    }

    /// Cuts the next piece off `data`.
    fn piece(
        &mut self,
        itt: u32,
        lun: u64,
        mut data: Bytes,
        alloc_ttt: impl FnOnce() -> u32,
    ) -> Pdu {
        let max = self.max_piece;
        if data.len() > max {
            let piece = data.split_to(max);
            let ttt = alloc_ttt();
            self.answer = Some(Pending {
                itt,
                ttt,
                rest: data,
            });
            response(false, true, lun, itt, ttt, piece)
        } else {
            response(true, false, lun, itt, RESERVED_TAG, data)
        }
    }
}

/// The answer to a complete request's keys: SendTargets answered by `send_targets` (its value
/// in, the text of TargetName/TargetAddress pairs out, appendix C); any other key is answered
/// NotUnderstood when it is a vendor key (X- or X#) and Reject otherwise, as mcsi offers no
/// renegotiation in full feature phase (RFC 7143 6.2).
pub fn answer_keys(
    keys: Vec<(String, String)>,
    mut send_targets: impl FnMut(&str) -> Vec<u8>,
) -> Bytes {
    let mut out = BytesMut::new();
    let mut answers: Vec<(String, String)> = Vec::new();
    for (k, v) in keys {
        if k == "SendTargets" {
            out.extend_from_slice(&send_targets(&v));
        } else {
            let ans = if k.starts_with("X-") || k.starts_with("X#") {
                NOT_UNDERSTOOD
            } else {
                REJECT
            };
            answers.push((k, ans.to_owned()));
        }
    }
    out.extend_from_slice(&text::encode(&answers));
    out.freeze()
}

/// The answer to a piece of a request that has more to come: no data, F and C clear, and the
/// tag the initiator puts on the next piece (11.11.1, 11.11.4).
fn acknowledgement(itt: u32, ttt: u32, lun: u64) -> Pdu {
    response(false, false, lun, itt, ttt, Bytes::new())
}

/// A Text Response; the sequence numbers are stamped when it is sent.
fn response(final_: bool, continue_: bool, lun: u64, itt: u32, ttt: u32, data: Bytes) -> Pdu {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn req(itt: u32, ttt: u32, final_: bool, continue_: bool, data: &[u8]) -> TextRequest {
        TextRequest {
            immediate: false,
            final_,
            continue_,
            lun: 0,
            itt,
            ttt,
            cmd_sn: 0,
            exp_stat_sn: 0,
            data: Bytes::copy_from_slice(data),
        }
    }

    fn text_response(p: Pdu) -> TextResponse {
        match p {
            Pdu::TextResponse(r) => r,
            other => panic!("expected a Text Response, got {other:?}"),
        }
    }

    fn send(step: TextStep) -> TextResponse {
        match step {
            TextStep::Send(p) => text_response(p),
            other => panic!("expected a PDU to send, got {other:?}"),
        }
    }

    #[test]
    fn a_request_in_pieces_is_acknowledged_then_answered_whole() {
        let mut ex = TextExchange::new(512);
        let first = ex.on_request(&req(7, RESERVED_TAG, false, true, b"SendTar"), || 0x50);
        let ack = send(first);
        assert_eq!(
            (ack.itt, ack.ttt, ack.final_, ack.continue_),
            (7, 0x50, false, false)
        );
        assert!(ack.data.is_empty());
        match ex.on_request(&req(7, 0x50, true, false, b"gets=All\0"), || 0x51) {
            TextStep::Keys { itt, keys, .. } => {
                assert_eq!(itt, 7);
                assert_eq!(keys, vec![("SendTargets".into(), "All".into())]);
            }
            other => panic!("expected keys, got {other:?}"),
        }
        assert!(!ex.in_progress());
    }

    #[test]
    fn a_long_answer_is_fetched_in_pieces_under_its_tag() {
        let mut ex = TextExchange::new(512);
        let data = Bytes::from(vec![b'a'; 1200]);
        let mut ttts = 0x100..;
        let first = text_response(ex.answer(9, 0, data, || ttts.next().unwrap()));
        assert_eq!(
            (first.final_, first.continue_, first.ttt),
            (false, true, 0x100)
        );
        assert_eq!(first.data.len(), 512);
        let second = send(ex.on_request(&req(9, 0x100, true, false, b""), || ttts.next().unwrap()));
        assert_eq!(
            (second.final_, second.ttt, second.data.len()),
            (false, 0x101, 512)
        );
        let last = send(ex.on_request(&req(9, 0x101, true, false, b""), || ttts.next().unwrap()));
        assert_eq!(
            (last.final_, last.continue_, last.ttt),
            (true, false, RESERVED_TAG)
        );
        assert_eq!(last.data.len(), 1200 - 1024);
        assert!(!ex.in_progress());
        // The tag is used up: asking again is an unknown tag.
        assert!(matches!(
            ex.on_request(&req(9, 0x101, true, false, b""), || 0),
            TextStep::Reject(TextRefused::UnknownTag { .. })
        ));
    }

    #[test]
    fn bad_requests_are_refused_and_a_new_request_resets_the_exchange() {
        let mut ex = TextExchange::new(512);
        assert!(matches!(
            ex.on_request(&req(1, RESERVED_TAG, true, true, b"a=b\0"), || 0),
            TextStep::Reject(TextRefused::ContinueAndFinal)
        ));
        // An answer under way, then a fetch that carries text: refused.
        let _ = ex.answer(2, 0, Bytes::from(vec![b'x'; 600]), || 0x10);
        assert!(matches!(
            ex.on_request(&req(2, 0x10, true, false, b"k=v\0"), || 0),
            TextStep::Reject(TextRefused::TextWithFetch)
        ));
        // An answer under way, then a new request: the old one is gone.
        let _ = ex.answer(3, 0, Bytes::from(vec![b'x'; 600]), || 0x11);
        assert!(ex.in_progress());
        assert!(matches!(
            ex.on_request(
                &req(4, RESERVED_TAG, true, false, b"SendTargets=All\0"),
                || 0
            ),
            TextStep::Keys { itt: 4, .. }
        ));
        assert!(!ex.in_progress());
        assert!(matches!(
            ex.on_request(&req(3, 0x11, true, false, b""), || 0),
            TextStep::Reject(TextRefused::UnknownTag { .. })
        ));
        // A piece of a request under another ITT than the one being received.
        let _ = ex.on_request(&req(5, RESERVED_TAG, false, true, b"a="), || 0x12);
        assert!(matches!(
            ex.on_request(&req(6, 0x12, true, false, b"b\0"), || 0),
            TextStep::Reject(TextRefused::UnknownTag { itt: 6, ttt: 0x12 })
        ));
        // Malformed text.
        assert!(matches!(
            ex.on_request(&req(7, RESERVED_TAG, true, false, b"novalue\0"), || 0),
            TextStep::Reject(TextRefused::Text(_))
        ));
    }

    #[test]
    fn keys_other_than_send_targets_are_refused_by_kind() {
        let keys = vec![
            ("SendTargets".to_string(), "All".to_string()),
            ("X-com.example.Foo".to_string(), "1".to_string()),
            ("MaxBurstLength".to_string(), "1024".to_string()),
        ];
        let out = answer_keys(keys, |v| {
            assert_eq!(v, "All");
            b"TargetName=iqn.x\0".to_vec()
        });
        assert_eq!(
            &out[..],
            b"TargetName=iqn.x\0X-com.example.Foo=NotUnderstood\0MaxBurstLength=Reject\0"
        );
    }
}
