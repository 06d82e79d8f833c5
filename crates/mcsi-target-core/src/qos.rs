//! Per-session bandwidth for a storage QoS requirement (seed 004): a token bucket per direction,
//! on passed-in time, shared by every connection of a session.
//!
//! The buckets meter bytes on the wire as seed 004's equations count them: a PDU of `n` bytes
//! costs `n` plus the TCP/IP and Ethernet headers of the frames it fills ([`wire_bytes`]). A
//! bucket lets a send go while its balance is not negative and then charges it in full, so the
//! balance may go below zero by one send (a deficit, paid back at the rate before the next
//! send): the long-run rate is exactly the bucket's, whatever the sizes of the sends, and a
//! send larger than the burst is never stuck. The balance starts full and never exceeds the
//! burst, so no more than a burst (and one send) goes out at line rate after an idle spell.

use std::time::Instant;

pub use mcsi_tcp::pace::{wire_bytes, TokenBucket, FRAME_HEADERS};

/// Admission against a link's capacity: whether a session needing `need` bytes per second
/// (to the client, to storage) fits beside `used` within `capacity` each way. When it does not,
/// what is left each way.
pub fn admit(need: (u64, u64), used: (u64, u64), capacity: u64) -> Result<(), (u64, u64)> {
    let left = (
        capacity.saturating_sub(used.0),
        capacity.saturating_sub(used.1),
    );
    if need.0 > left.0 || need.1 > left.1 {
        return Err(left);
    }
    Ok(())
}

/// The rates and bursts of one session, per direction (`None`: not limited).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rates {
    /// Target to initiator: Data-In, responses, R2Ts, NOP-Ins.
    pub to_client: Option<(u64, u64)>,
    /// Initiator to target: commands, immediate, unsolicited and solicited data.
    pub to_storage: Option<(u64, u64)>,
}

/// The bucket toward storage, kept by a session's core on passed-in time. Every PDU the
/// initiator sends costs its wire bytes when it is read ([`StoragePacer::charge`]), except the
/// Data-Out an R2T asked for: an R2T charges the bytes it asks for when it goes out, and goes
/// out only while the bucket has no deficit. So solicited data arrives at the bucket's rate
/// rather than piling up in TCP's buffers ahead of the session's commands, and what comes
/// unasked (commands, immediate and unsolicited data) waits in TCP's flow control: the reader
/// takes no more while [`StoragePacer::ready_at`] says to wait.
#[derive(Debug, Clone)]
pub struct StoragePacer {
    bucket: TokenBucket,
    mss: u32,
    /// The longest Data-Out data segment (the target's MaxRecvDataSegmentLength): an R2T's
    /// data comes in PDUs of at most this, each with its 48-byte header.
    segment: u32,
    now: Instant,
}

impl StoragePacer {
    /// `rate` bytes per second on the wire, bursts of `burst`, for TCP segments of `mss` and
    /// Data-Out data segments of at most `segment`.
    pub fn new(rate: u64, burst: u64, mss: u32, segment: u32, now: Instant) -> StoragePacer {
        StoragePacer {
            bucket: TokenBucket::new(rate, burst, now),
            mss,
            segment: segment.max(512),
            now,
        }
    }

    /// The time is `now` (an earlier time is ignored).
    pub fn advance(&mut self, now: Instant) {
        self.now = self.now.max(now);
    }

    /// The time it was last told.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// When the next R2T or read may go: `None` for now.
    pub fn ready_at(&self) -> Option<Instant> {
        self.bucket.ready_at(self.now)
    }

    /// Charges `bytes` of PDUs (their wire bytes) at the current time.
    pub fn charge(&mut self, bytes: u64) {
        self.bucket.spend(wire_bytes(bytes, self.mss), self.now);
    }

    /// Charges the Data-Out an R2T for `len` bytes asks for: the data and a header per PDU.
    pub fn charge_solicited(&mut self, len: u32) {
        let pdus = u64::from(len.div_ceil(self.segment).max(1));
        self.charge(u64::from(len) + pdus * mcsi_proto::pdu::BHS_LEN as u64);
    }

    /// The most one R2T asks for: the bucket's burst (at least 4 KiB), so that no more than
    /// what the rate allows at once is on its way.
    pub fn r2t_len(&self) -> u32 {
        u32::try_from(self.bucket.burst())
            .unwrap_or(u32::MAX)
            .max(4096)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    /// Sends `size`-byte messages as fast as the bucket lets them go for `secs` of virtual
    /// time; returns the bytes sent.
    fn run(rate: u64, burst: u64, size: u64, secs: u64) -> u64 {
        let base = Instant::now();
        let mut b = TokenBucket::new(rate, burst, base);
        let end = base + Duration::from_secs(secs);
        let mut now = base;
        let mut sent = 0;
        while now < end {
            if let Some(t) = b.ready_at(now) {
                now = t;
                continue;
            }
            b.spend(size, now);
            sent += size;
        }
        sent
    }

    #[test]
    fn the_long_run_rate_is_the_buckets_whatever_the_send_size() {
        for size in [512u64, 8192, 65536, 1 << 20, 8 << 20] {
            let rate = 10_000_000;
            let sent = run(rate, 65536, size, 10);
            let got = sent as f64 / 10.0;
            // One burst and one send beyond the rate at most.
            let slack = (65536 + size) as f64 / 10.0;
            assert!(
                (got - rate as f64).abs() <= slack,
                "size {size}: {got} B/s against {rate}"
            );
        }
    }

    #[test]
    fn a_full_bucket_lets_a_burst_go_then_paces() {
        let base = Instant::now();
        let mut b = TokenBucket::new(1000, 4000, base);
        for _ in 0..4 {
            assert_eq!(b.ready_at(base), None);
            b.spend(1000, base);
        }
        // Empty: the next may go (balance 0), then 1 s for each 1000 bytes.
        assert_eq!(b.ready_at(base), None);
        b.spend(1000, base);
        assert_eq!(b.ready_at(base), Some(at(base, 1000)));
        assert_eq!(b.ready_at(at(base, 1000)), None);
        // Idle for an hour: no more than a burst has built up.
        let later = base + Duration::from_secs(3600);
        assert!((b.balance(later) - 4000.0).abs() < 1e-6);
    }

    #[test]
    fn a_send_larger_than_the_burst_goes_and_leaves_a_deficit() {
        let base = Instant::now();
        let mut b = TokenBucket::new(1_000_000, 10_000, base);
        b.spend(1_000_000, base);
        let t = b.ready_at(base).unwrap();
        assert_eq!(t.duration_since(base).as_millis(), 990);
        assert_eq!(b.ready_at(t), None);
    }

    #[test]
    fn time_running_backwards_adds_nothing() {
        let base = Instant::now() + Duration::from_secs(10);
        let mut b = TokenBucket::new(1000, 1000, base);
        b.spend(1000, base);
        assert_eq!(b.balance(base - Duration::from_secs(5)), 0.0);
    }

    #[test]
    fn admission_fits_each_way() {
        assert_eq!(admit((4, 4), (4, 4), 10), Ok(()));
        assert_eq!(admit((4, 4), (8, 0), 10), Err((2, 10)));
        assert_eq!(admit((0, 11), (0, 0), 10), Err((10, 10)));
        assert_eq!(admit((1, 1), (12, 0), 10), Err((0, 10)));
    }

    #[test]
    fn wire_bytes_adds_headers_per_segment() {
        assert_eq!(wire_bytes(0, 1448), 0);
        assert_eq!(wire_bytes(1448, 1448), 1448 + 58);
        assert_eq!(wire_bytes(1449, 1448), 1449 + 2 * 58);
        assert_eq!(wire_bytes(100, 0), 100 + 100 * 58);
    }
}
