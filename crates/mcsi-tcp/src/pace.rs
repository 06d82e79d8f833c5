//! Pacing what a session sends: a token bucket on passed-in time, and the bytes a send costs on
//! the wire. The target holds each session to its QoS rates with it (seed 004); the initiator
//! shapes its own sending the same way.
//!
//! A bucket lets a send go while its balance is not negative and then charges it in full, so
//! the balance may go below zero by one send (a deficit, paid back at the rate before the next
//! send): the long-run rate is exactly the bucket's, whatever the sizes of the sends, and a
//! send larger than the burst is never stuck. The balance starts full and never exceeds the
//! burst, so no more than a burst (and one send) goes out at line rate after an idle spell.

use std::time::{Duration, Instant};

/// TCP/IP (40) and Ethernet (18) header bytes per frame, as seed 004 counts them beside the
/// 48-byte iSCSI header (its `ov_prot` of 106 bytes is the three together).
pub const FRAME_HEADERS: u64 = 58;

/// Bytes on the wire for `n` bytes of iSCSI PDUs sent in segments of `mss`: the PDUs and one
/// frame's TCP/IP and Ethernet headers per segment.
pub fn wire_bytes(n: u64, mss: u32) -> u64 {
    n + n.div_ceil(u64::from(mss.max(1))) * FRAME_HEADERS
}

/// A token bucket of `rate` bytes per second holding at most `burst` bytes.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    /// Bytes that may go now; below zero after a send larger than what was there.
    balance: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket. A zero rate is taken as one byte per second (never zero: nothing would
    /// ever go); a zero burst as one byte.
    pub fn new(rate: u64, burst: u64, now: Instant) -> TokenBucket {
        let burst = burst.max(1) as f64;
        TokenBucket {
            rate: rate.max(1) as f64,
            burst,
            balance: burst,
            last: now,
        }
    }

    /// Bytes per second.
    pub fn rate(&self) -> u64 {
        self.rate as u64
    }

    /// Most bytes held.
    pub fn burst(&self) -> u64 {
        self.burst as u64
    }

    fn refill(&mut self, now: Instant) {
        // Time never runs backwards here: an earlier `now` adds nothing.
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        if dt > 0.0 {
            self.balance = (self.balance + dt * self.rate).min(self.burst);
            self.last = now;
        }
    }

    /// When the next send may go: `None` for now, else the moment the deficit is paid back.
    pub fn ready_at(&self, now: Instant) -> Option<Instant> {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        let balance = (self.balance + dt * self.rate).min(self.burst);
        if balance >= 0.0 {
            return None;
        }
        Some(now + Duration::from_secs_f64(-balance / self.rate))
    }

    /// Charges a send of `bytes`.
    pub fn spend(&mut self, bytes: u64, now: Instant) {
        self.refill(now);
        self.balance -= bytes as f64;
    }

    /// The balance now (negative: a deficit), for logs and tests.
    pub fn balance(&mut self, now: Instant) -> f64 {
        self.refill(now);
        self.balance
    }
}
