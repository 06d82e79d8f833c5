//! Text parsing and key negotiation on arbitrary input, for both roles and every stage: never
//! panics, parse/encode round-trips, answers only name keys the peer sent, and the negotiated
//! values stay within RFC 7143 section 13 ranges.
#![no_main]

mod common;

use common::{pairs, raw_text, Challenge, Input};
use libfuzzer_sys::fuzz_target;
use mcsi_proto::keys::{LocalParams, Negotiator, Role, SessionType};
use mcsi_proto::pdu::Stage;
use mcsi_proto::text::{self, TextAccumulator, TextLimits};

fn check(neg: &Negotiator) {
    let s = neg.session_params();
    assert!((1..=65535).contains(&s.max_connections));
    assert!((512..=0xff_ffff).contains(&s.max_burst_length));
    assert!(s.first_burst_length <= s.max_burst_length);
    assert!(s.first_burst_length >= 512);
    assert!(s.default_time2wait <= 3600 && s.default_time2retain <= 3600);
    assert!(s.max_outstanding_r2t >= 1);
    assert!(s.error_recovery_level <= 2);
    let c = neg.connection_params();
    assert!((512..=0xff_ffff).contains(&c.max_send_data_segment_length));
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mode = inp.u8();
    let limits = TextLimits {
        max_pairs: usize::from(inp.u8()) + 1,
        max_total: usize::from(inp.u16()) + 1,
    };
    let list = if mode & 1 == 0 {
        // Raw bytes, possibly split over continuation PDUs.
        let raw = inp.rest();
        let direct = text::parse(raw, &limits);
        let mut acc = TextAccumulator::new(limits);
        let piece = usize::from(mode >> 1).max(1);
        let chunks: Vec<&[u8]> = raw.chunks(piece).collect();
        let mut joined = None;
        for (i, c) in chunks.iter().enumerate() {
            match acc.push(c, i + 1 < chunks.len()) {
                Ok(Some(p)) => joined = Some(Ok(p)),
                Ok(None) => {}
                Err(e) => {
                    joined = Some(Err(e));
                    break;
                }
            }
        }
        if let (Ok(d), Some(Ok(j))) = (&direct, &joined) {
            assert_eq!(d, j, "continued text differs from the whole");
        }
        match direct {
            Ok(p) => p,
            Err(_) => return,
        }
    } else {
        let p = pairs(&mut inp, 40, &Challenge::default());
        match text::parse(&raw_text(&p), &TextLimits::default()) {
            Ok(p) => p,
            Err(_) => return,
        }
    };
    // Encoding what was parsed parses back to the same pairs.
    let enc = text::encode(&list);
    assert_eq!(
        text::parse(&enc, &TextLimits::default()).ok().as_ref(),
        Some(&list)
    );

    let role = if mode & 2 == 0 {
        Role::Initiator
    } else {
        Role::Target
    };
    let stage = match (mode >> 2) & 3 {
        0 => Some(Stage::Security),
        1 => Some(Stage::Operational),
        _ => None,
    };
    let mut neg = Negotiator::new(role, LocalParams::default());
    if mode & 16 != 0 {
        neg.set_session_type(SessionType::Discovery);
    }
    neg.set_leading(mode & 32 == 0);
    if mode & 64 != 0 {
        // Our offers first, so the peer's keys are answers.
        let _ = neg.offers(stage);
    }
    if let Ok(p) = neg.handle(&list, stage) {
        for (k, _) in &p.answers {
            assert!(list.iter().any(|(a, _)| a == k), "answer to unsent key {k}");
        }
        check(&neg);
        let _ = neg.offers(stage);
        // A second batch (the rest of the exchange).
        neg.begin_sequence();
        let _ = neg.handle(&list, stage);
        check(&neg);
    }
});
