#![allow(clippy::unwrap_used, clippy::expect_used)]

//! The `session_core` fuzz target's body on pseudo-random inputs (fixed seeds, so a failure
//! reproduces), so that `cargo test` drives the session core through many PDU sequences too;
//! `scripts/fuzz` runs the same body under libFuzzer.

mod fuzz_body;

/// xorshift64*: a fixed sequence of bytes from a seed.
struct Bytes(u64);

impl Bytes {
    fn next(&mut self) -> u8 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
    }
}

#[test]
fn the_session_core_survives_arbitrary_pdu_sequences() {
    let mut total = fuzz_body::Stats::default();
    for seed in 1..=1500u64 {
        let mut g = Bytes(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let len = 64 + usize::from(g.next()) * 4;
        let input: Vec<u8> = (0..len).map(|_| g.next()).collect();
        let s = fuzz_body::run(&input);
        total.steps += s.steps;
        total.statuses += s.statuses;
        total.r2ts += s.r2ts;
        total.data_in_bytes += s.data_in_bytes;
        total.rejects += s.rejects;
        total.ended_early += s.ended_early;
        total.snacks += s.snacks;
        total.resent += s.resent;
        total.damaged += s.damaged;
        total.joined += s.joined;
        total.reassigned += s.reassigned;
    }
    println!("1500 inputs: {total:?}");
    // The inputs reach every part of the session, not only its errors.
    assert!(total.statuses > 5000, "{total:?}");
    assert!(total.r2ts > 500, "{total:?}");
    assert!(total.data_in_bytes > 1 << 20, "{total:?}");
    assert!(total.rejects > 100, "{total:?}");
    // ErrorRecoveryLevel 1: SNACKs answered from the connections' logs, and refused.
    assert!(total.snacks > 500 && total.resent > 300, "{total:?}");
    assert!(total.damaged > 200, "{total:?}");
    // ErrorRecoveryLevel 2: connections fail and others log in; tasks are reassigned.
    assert!(total.joined > 50 && total.reassigned > 20, "{total:?}");
}
