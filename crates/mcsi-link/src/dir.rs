//! One direction of a path: loss on arrival, a drop-tail queue, a serializer at a fixed rate
//! and a delay line with jitter. Time is virtual (nanoseconds) and passed in.

use crate::config::{DirConfig, JitterDist, QueueLimit};
use crate::link::{Dir, FlowKey};
use crate::loss::Loss;
use crate::stats::DirStats;
use crate::Nanos;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

/// Why a packet did not cross the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum DropCause {
    /// The loss model (Bernoulli or Gilbert-Elliott).
    Loss,
    /// The queue was full (drop-tail).
    Queue,
    /// 802.11: every attempt up to the retry limit failed.
    RetryLimit,
    /// The path was down (a route brought down by a path event).
    Down,
}

impl DropCause {
    pub fn as_str(self) -> &'static str {
        match self {
            DropCause::Loss => "loss",
            DropCause::Queue => "queue",
            DropCause::RetryLimit => "retry-limit",
            DropCause::Down => "path-down",
        }
    }
}

#[derive(Debug)]
pub(crate) struct Pending {
    pub pkt: Vec<u8>,
    pub arrival: Nanos,
}

/// Drop-tail FIFO with a packet or byte limit.
#[derive(Debug)]
pub(crate) struct Queue {
    q: VecDeque<Pending>,
    bytes: u64,
    limit: QueueLimit,
}

impl Queue {
    pub fn new(limit: QueueLimit) -> Self {
        Queue {
            q: VecDeque::new(),
            bytes: 0,
            limit,
        }
    }

    pub fn admits(&self, len: usize) -> bool {
        match self.limit {
            QueueLimit::Packets(n) => self.q.len() < n,
            QueueLimit::Bytes(b) => self.bytes + len as u64 <= b,
        }
    }

    pub fn push(&mut self, p: Pending, stats: &mut DirStats) {
        self.bytes += p.pkt.len() as u64;
        self.q.push_back(p);
        stats.peak_queue_packets = stats.peak_queue_packets.max(self.q.len() as u64);
        stats.peak_queue_bytes = stats.peak_queue_bytes.max(self.bytes);
    }

    pub fn pop(&mut self) -> Option<Pending> {
        let p = self.q.pop_front()?;
        self.bytes -= p.pkt.len() as u64;
        Some(p)
    }

    pub fn front(&self) -> Option<&Pending> {
        self.q.front()
    }

    pub fn len(&self) -> usize {
        self.q.len()
    }
}

#[derive(Debug)]
struct Delayed {
    release: Nanos,
    seq: u64,
    arrival: Nanos,
    pkt: Vec<u8>,
}

impl PartialEq for Delayed {
    fn eq(&self, o: &Self) -> bool {
        (self.release, self.seq) == (o.release, o.seq)
    }
}
impl Eq for Delayed {}
impl PartialOrd for Delayed {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Delayed {
    // Reversed: BinaryHeap is a max-heap and the earliest release must come out first.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.release, o.seq).cmp(&(self.release, self.seq))
    }
}

/// Samples a one-way delay: `delay + jitter * Z` with Z of unit variance, never negative.
pub fn sample_delay<R: Rng>(cfg: &DirConfig, rng: &mut R) -> Nanos {
    let mean = cfg.delay.as_nanos() as f64;
    if cfg.jitter.is_zero() {
        return mean as Nanos;
    }
    let j = cfg.jitter.as_nanos() as f64;
    let z = match cfg.dist {
        // Uniform on [-1, 1] as netem without a table: the jitter is the half-width.
        JitterDist::Uniform => rng.gen::<f64>() * 2.0 - 1.0,
        JitterDist::Normal => std_normal(rng),
        JitterDist::Pareto => std_pareto(rng),
        JitterDist::ParetoNormal => {
            (0.25 * std_normal(rng) + 0.75 * std_pareto(rng))
                / (0.25f64.powi(2) + 0.75f64.powi(2)).sqrt()
        }
    };
    (mean + j * z).max(0.0) as Nanos
}

/// Box-Muller.
fn std_normal<R: Rng>(rng: &mut R) -> f64 {
    let u1: f64 = 1.0 - rng.gen::<f64>(); // (0, 1]
    let u2: f64 = rng.gen();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Pareto with shape 3 and scale 1 (mean 3/2, variance 3/4), standardized to mean 0, sd 1.
fn std_pareto<R: Rng>(rng: &mut R) -> f64 {
    let u: f64 = 1.0 - rng.gen::<f64>();
    let x = u.powf(-1.0 / 3.0);
    (x - 1.5) / 0.75f64.sqrt()
}

/// Counts a packet in, then loss, then `queue`'s limit (as netem: a lost packet costs no queue
/// space or airtime).
fn admit_to(
    queue: &mut Queue,
    loss: &mut Loss,
    stats: &mut DirStats,
    rng: &mut ChaCha8Rng,
    pkt: Vec<u8>,
    now: Nanos,
) -> Result<(), DropCause> {
    stats.packets_in += 1;
    stats.bytes_in += pkt.len() as u64;
    if loss.lose(rng) {
        stats.drop_loss += 1;
        return Err(DropCause::Loss);
    }
    if !queue.admits(pkt.len()) {
        stats.drop_queue += 1;
        return Err(DropCause::Queue);
    }
    queue.push(Pending { pkt, arrival: now }, stats);
    Ok(())
}

/// Memory cap of one direction's delay line (64 MiB: 1 Gbit/s for half a second).
pub const DELAY_LINE_MAX_BYTES: u64 = 64 << 20;

/// Everything a direction does except the service discipline (serializer or 802.11 medium).
#[derive(Debug)]
pub(crate) struct DirState {
    pub cfg: DirConfig,
    pub queue: Queue,
    loss: Loss,
    line: BinaryHeap<Delayed>,
    line_bytes: u64,
    last_release: Nanos,
    seq: u64,
    pub stats: DirStats,
    pub rng: ChaCha8Rng,
}

impl DirState {
    pub fn new(cfg: DirConfig, rng: ChaCha8Rng) -> Self {
        DirState {
            queue: Queue::new(cfg.queue),
            loss: Loss::new(cfg.loss),
            cfg,
            line: BinaryHeap::new(),
            line_bytes: 0,
            last_release: 0,
            seq: 0,
            stats: DirStats::default(),
            rng,
        }
    }

    /// Loss, then the queue limit (as netem: a lost packet costs no queue space or airtime).
    pub fn admit(&mut self, pkt: Vec<u8>, now: Nanos) -> Result<(), DropCause> {
        let DirState {
            queue,
            loss,
            stats,
            rng,
            ..
        } = self;
        admit_to(queue, loss, stats, rng, pkt, now)
    }

    /// A packet finished service at `done`: it enters the delay line. The line is a wire,
    /// not a queue, but its memory is capped so that a flood behind a long delay cannot
    /// exhaust the host; what does not fit counts as a queue drop.
    pub fn served(&mut self, p: Pending, done: Nanos) {
        if self.line_bytes + p.pkt.len() as u64 > DELAY_LINE_MAX_BYTES {
            self.stats.drop_queue += 1;
            return;
        }
        self.line_bytes += p.pkt.len() as u64;
        let mut release = done.saturating_add(sample_delay(&self.cfg, &mut self.rng));
        if !self.cfg.reorder {
            release = release.max(self.last_release);
        }
        self.last_release = self.last_release.max(release);
        self.seq += 1;
        self.line.push(Delayed {
            release,
            seq: self.seq,
            arrival: p.arrival,
            pkt: p.pkt,
        });
    }

    pub fn next_release(&self) -> Option<Nanos> {
        self.line.peek().map(|d| d.release)
    }

    /// The next packet due at or before `now`, with its release and arrival times.
    pub fn pop_due(&mut self, now: Nanos) -> Option<(Nanos, Nanos, Vec<u8>)> {
        if self.line.peek()?.release > now {
            return None;
        }
        let d = self.line.pop()?;
        self.line_bytes -= d.pkt.len() as u64;
        self.stats.packets_out += 1;
        self.stats.bytes_out += d.pkt.len() as u64;
        self.stats.delay_sum_ns += d.release.saturating_sub(d.arrival);
        Some((d.release, d.arrival, d.pkt))
    }

    pub fn in_flight(&self) -> usize {
        self.line.len()
    }
}

/// A wired direction: a serializer at a fixed rate between the queue and the delay line,
/// with, when the direction has a reservation, a second queue for the reserved class served
/// first while its token bucket allows (see [`crate::config::Reserve`]).
#[derive(Debug)]
pub(crate) struct Pipe {
    pub st: DirState,
    /// The packet being serialized and when its last bit leaves.
    busy: Option<(Pending, Nanos)>,
    /// When the serializer last went idle.
    free_at: Nanos,
    class: Option<Class>,
}

/// The reserved class of a direction: its queue and token bucket.
#[derive(Debug)]
struct Class {
    port: u16,
    /// Bytes per nanosecond.
    rate: f64,
    burst: f64,
    tokens: f64,
    /// When `tokens` was last brought up to date.
    at: Nanos,
    queue: Queue,
}

impl Class {
    fn tokens_at(&self, t: Nanos) -> f64 {
        (self.tokens + t.saturating_sub(self.at) as f64 * self.rate).min(self.burst)
    }

    /// The earliest time from `from` on at which the bucket holds `len` bytes (or is full,
    /// for a packet longer than the bucket).
    fn eligible(&self, len: usize, from: Nanos) -> Nanos {
        let t = from.max(self.at);
        let need = (len as f64).min(self.burst);
        let have = self.tokens_at(t);
        if have >= need {
            t
        } else {
            t.saturating_add(((need - have) / self.rate).ceil() as Nanos)
        }
    }

    fn take(&mut self, len: usize, t: Nanos) {
        self.tokens = self.tokens_at(t) - len as f64;
        self.at = self.at.max(t);
    }

    fn matches(&self, pkt: &[u8]) -> bool {
        FlowKey::of(Dir::Up, pkt)
            .is_some_and(|k| k.proto == 6 && (k.cmd_port == self.port || k.host_port == self.port))
    }
}

impl Pipe {
    pub fn new(cfg: DirConfig, rng: ChaCha8Rng) -> Self {
        let class = cfg.reserve.map(|r| Class {
            port: r.port,
            rate: r.rate / 8e9,
            burst: r.burst as f64,
            tokens: r.burst as f64,
            at: 0,
            queue: Queue::new(cfg.queue),
        });
        Pipe {
            st: DirState::new(cfg, rng),
            busy: None,
            free_at: 0,
            class,
        }
    }

    /// Serialization time of a packet of `len` bytes.
    fn service(&self, len: usize) -> Nanos {
        match self.st.cfg.rate {
            None => 0,
            Some(r) => {
                ((len as f64 + self.st.cfg.overhead as f64) * 8.0 * 1e9 / r).round() as Nanos
            }
        }
    }

    pub fn enqueue(&mut self, pkt: Vec<u8>, now: Nanos) -> Result<(), DropCause> {
        self.advance(now);
        match &mut self.class {
            Some(c) if c.matches(&pkt) => {
                let st = &mut self.st;
                let len = pkt.len() as u64;
                admit_to(
                    &mut c.queue,
                    &mut st.loss,
                    &mut st.stats,
                    &mut st.rng,
                    pkt,
                    now,
                )?;
                st.stats.reserved_bytes_in += len;
            }
            _ => self.st.admit(pkt, now)?,
        }
        self.advance(now);
        Ok(())
    }

    /// When the next packet could start and whether it is the reserved class's: the class
    /// goes first whenever its head is in the queue and its bucket holds it.
    fn next_start(&self) -> Option<(Nanos, bool)> {
        let plain = self.st.queue.front().map(|p| p.arrival.max(self.free_at));
        let reserved = self.class.as_ref().and_then(|c| {
            let p = c.queue.front()?;
            Some(c.eligible(p.pkt.len(), p.arrival.max(self.free_at)))
        });
        match (reserved, plain) {
            (Some(r), Some(p)) if r <= p => Some((r, true)),
            (_, Some(p)) => Some((p, false)),
            (Some(r), None) => Some((r, true)),
            (None, None) => None,
        }
    }

    /// Runs the serializer up to `now`, with the event times it would have had.
    pub fn advance(&mut self, now: Nanos) {
        loop {
            if let Some((_, done)) = &self.busy {
                if *done > now {
                    return;
                }
                if let Some((p, done)) = self.busy.take() {
                    self.st.served(p, done);
                    self.free_at = done;
                }
                continue;
            }
            let Some((start, reserved)) = self.next_start() else {
                return;
            };
            if start > now {
                // A packet of the other queue may still arrive before then.
                return;
            }
            let p = if reserved {
                let Some(c) = self.class.as_mut() else { return };
                let Some(p) = c.queue.pop() else { return };
                c.take(p.pkt.len(), start);
                self.st.stats.reserved_bytes_out += p.pkt.len() as u64;
                p
            } else {
                let Some(p) = self.st.queue.pop() else { return };
                p
            };
            let done = start.saturating_add(self.service(p.pkt.len()));
            self.busy = Some((p, done));
        }
    }

    pub fn next_event(&self) -> Option<Nanos> {
        let b = match &self.busy {
            Some((_, d)) => Some(*d),
            None => self.next_start().map(|(t, _)| t),
        };
        match (b, self.st.next_release()) {
            (Some(a), Some(c)) => Some(a.min(c)),
            (a, c) => a.or(c),
        }
    }

    /// Packets waiting in the reserved class's queue.
    #[cfg(test)]
    fn reserved_queued(&self) -> usize {
        self.class.as_ref().map_or(0, |c| c.queue.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use std::time::Duration;

    const MS: Nanos = 1_000_000;

    fn rng() -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(1)
    }

    fn drain(p: &mut Pipe, until: Nanos) -> Vec<(Nanos, Vec<u8>)> {
        let mut out = vec![];
        let mut now = 0;
        while now <= until {
            p.advance(now);
            while let Some((t, _, x)) = p.st.pop_due(now) {
                out.push((t, x));
            }
            match p.next_event() {
                Some(t) => now = t,
                None => break,
            }
        }
        out
    }

    #[test]
    fn rate_and_delay_exact() {
        // 1500 B at 1 Mbit/s = 12 ms each; plus 5 ms delay. Back-to-back at t=0:
        // departures 12, 24, 36 ms -> releases 17, 29, 41 ms.
        let cfg = DirConfig {
            rate: Some(1e6),
            delay: Duration::from_millis(5),
            ..Default::default()
        };
        let mut p = Pipe::new(cfg, rng());
        for i in 0..3u8 {
            p.enqueue(vec![i; 1500], 0).unwrap();
        }
        let out = drain(&mut p, 100 * MS);
        let t: Vec<Nanos> = out.iter().map(|x| x.0).collect();
        assert_eq!(t, vec![17 * MS, 29 * MS, 41 * MS]);
        assert_eq!(out[2].1[0], 2);
    }

    #[test]
    fn overhead_counts_in_serialization() {
        // (100 + 25) B * 8 / 1 Mbit/s = 1 ms.
        let cfg = DirConfig {
            rate: Some(1e6),
            overhead: 25,
            ..Default::default()
        };
        let mut p = Pipe::new(cfg, rng());
        p.enqueue(vec![0; 100], 3 * MS).unwrap();
        let out = drain(&mut p, 100 * MS);
        assert_eq!(out[0].0, 4 * MS);
    }

    #[test]
    fn idle_gap_restarts_serializer_at_arrival() {
        let cfg = DirConfig {
            rate: Some(8e6), // 1 us per byte
            ..Default::default()
        };
        let mut p = Pipe::new(cfg, rng());
        p.enqueue(vec![0; 1000], 0).unwrap();
        p.advance(50 * MS); // long idle
        let _ = p.st.pop_due(50 * MS);
        p.enqueue(vec![0; 1000], 50 * MS).unwrap();
        assert_eq!(p.next_event(), Some(50 * MS + MS));
    }

    #[test]
    fn throughput_saturated_equals_rate() {
        // 10 000 packets of 1000 B at 5 Mbit/s: last one leaves at 10 000 * 1.6 ms = 16 s.
        let cfg = DirConfig {
            rate: Some(5e6),
            queue: QueueLimit::Packets(20_000),
            ..Default::default()
        };
        let mut p = Pipe::new(cfg, rng());
        for _ in 0..10_000 {
            p.enqueue(vec![0; 1000], 0).unwrap();
        }
        let out = drain(&mut p, 100_000 * MS);
        assert_eq!(out.len(), 10_000);
        assert_eq!(out.last().unwrap().0, 16_000 * MS);
    }

    #[test]
    fn drop_tail_packets_and_bytes() {
        let cfg = DirConfig {
            rate: Some(1e6),
            queue: QueueLimit::Packets(3),
            ..Default::default()
        };
        let mut p = Pipe::new(cfg, rng());
        // The first goes straight into service; three wait; the fifth is dropped.
        let r: Vec<_> = (0..5).map(|_| p.enqueue(vec![0; 100], 0)).collect();
        assert_eq!(r[..4].iter().filter(|x| x.is_ok()).count(), 4);
        assert_eq!(r[4], Err(DropCause::Queue));
        assert_eq!(p.st.stats.peak_queue_packets, 3);

        let cfg = DirConfig {
            rate: Some(1e6),
            queue: QueueLimit::Bytes(250),
            ..Default::default()
        };
        let mut p = Pipe::new(cfg, rng());
        let r: Vec<_> = (0..4).map(|_| p.enqueue(vec![0; 100], 0)).collect();
        // One in service, two (200 B) wait, the fourth would make 300 B > 250 B.
        assert_eq!(r[3], Err(DropCause::Queue));
        assert_eq!(p.st.stats.peak_queue_bytes, 200);
        assert_eq!(p.st.stats.drop_queue, 1);
    }

    #[test]
    fn delay_line_memory_is_capped() {
        let cfg = DirConfig {
            delay: Duration::from_secs(10),
            queue: QueueLimit::Packets(1_000_000),
            ..Default::default()
        };
        let mut p = Pipe::new(cfg, rng());
        let n = DELAY_LINE_MAX_BYTES / 65536 + 10;
        for _ in 0..n {
            p.enqueue(vec![0; 65536], 0).unwrap();
        }
        assert_eq!(p.st.in_flight() as u64, DELAY_LINE_MAX_BYTES / 65536);
        assert_eq!(p.st.stats.drop_queue, 10);
    }

    #[test]
    fn queue_drains_then_admits_again() {
        let cfg = DirConfig {
            rate: Some(8e6), // 100 B = 100 us
            queue: QueueLimit::Packets(1),
            ..Default::default()
        };
        let mut p = Pipe::new(cfg, rng());
        assert!(p.enqueue(vec![0; 100], 0).is_ok());
        assert!(p.enqueue(vec![0; 100], 0).is_ok());
        assert!(p.enqueue(vec![0; 100], 0).is_err());
        // At 100 us the first has left, the second is in service, the queue is empty.
        assert!(p.enqueue(vec![0; 100], 100_000).is_ok());
    }

    fn jitter_stats(dist: JitterDist, reorder: bool) -> (f64, f64, usize) {
        let cfg = DirConfig {
            delay: Duration::from_millis(50),
            jitter: Duration::from_millis(5),
            dist,
            reorder,
            queue: QueueLimit::Packets(1_000_000),
            ..Default::default()
        };
        let mut p = Pipe::new(cfg, ChaCha8Rng::seed_from_u64(99));
        let n = 100_000u64;
        // One packet per ms carrying its send time.
        let mut out = vec![];
        for i in 0..n {
            let now = i * MS;
            p.advance(now);
            while let Some((t, _, x)) = p.st.pop_due(now) {
                out.push((t, x));
            }
            p.enqueue(i.to_be_bytes().to_vec(), now).unwrap();
        }
        out.extend(drain(&mut p, u64::MAX / 2));
        let mut reordered = 0;
        let mut prev = 0u64;
        let d: Vec<f64> = out
            .iter()
            .map(|(t, b)| {
                let sent = u64::from_be_bytes(b[..8].try_into().unwrap());
                if sent < prev {
                    reordered += 1;
                }
                prev = prev.max(sent);
                (t - sent * MS) as f64 / 1e6
            })
            .collect();
        let mean = d.iter().sum::<f64>() / d.len() as f64;
        let var = d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / d.len() as f64;
        (mean, var.sqrt(), reordered)
    }

    #[test]
    fn jitter_distributions_mean_and_sd() {
        // With reordering allowed each packet keeps its own sample: mean 50 ms, and sd 5 ms
        // for normal / pareto / paretonormal, 5/sqrt(3) = 2.887 ms for uniform (half-width 5).
        // 100k samples: sd of the mean 0.016 ms.
        let (m, s, r) = jitter_stats(JitterDist::Uniform, true);
        assert!(
            (m - 50.0).abs() < 0.1 && (s - 2.887).abs() < 0.05,
            "{m} {s}"
        );
        assert!(r > 0);
        let (m, s, _) = jitter_stats(JitterDist::Normal, true);
        assert!((m - 50.0).abs() < 0.1 && (s - 5.0).abs() < 0.1, "{m} {s}");
        // Pareto tails converge slowly (infinite 4th moment at shape 3): wider bounds.
        let (m, s, _) = jitter_stats(JitterDist::Pareto, true);
        assert!((m - 50.0).abs() < 0.2 && (s - 5.0).abs() < 0.6, "{m} {s}");
        let (m, s, _) = jitter_stats(JitterDist::ParetoNormal, true);
        assert!((m - 50.0).abs() < 0.2 && (s - 5.0).abs() < 0.6, "{m} {s}");
    }

    #[test]
    fn jitter_without_reorder_keeps_order() {
        let (m, _, r) = jitter_stats(JitterDist::Normal, false);
        assert_eq!(r, 0);
        // Holding packets behind later-released ones only adds delay.
        assert!(m > 50.0, "{m}");
    }

    /// A 1000-byte TCP packet between port `port` on the command's side and 3260 or 5201.
    fn tcp(port: u16, storage: bool) -> Vec<u8> {
        let mut p = vec![0u8; 1000];
        p[0] = 0x45;
        p[9] = 6;
        p[12..16].copy_from_slice(&[100, 64, 0, 2]);
        p[16..20].copy_from_slice(&[100, 64, 0, 1]);
        p[20..22].copy_from_slice(&port.to_be_bytes());
        let host: u16 = if storage { 3260 } else { 5201 };
        p[22..24].copy_from_slice(&host.to_be_bytes());
        p
    }

    fn reserved_pipe(spec: &str) -> Pipe {
        let mut path = crate::PathConfig::default();
        path.apply_spec(spec).unwrap();
        Pipe::new(path.up, rng())
    }

    #[test]
    fn reserved_class_keeps_its_rate_beside_a_flood() {
        // 10 Mbit/s with 2 Mbit/s reserved for port 3260; both queues always full for 10 s.
        let mut p = reserved_pipe("rate=10mbit,reserve=3260:2mbit,queue=100p");
        let (mut storage, mut bulk) = (0u64, 0u64);
        let mut now = 0;
        while now < 10_000 * MS {
            while p.enqueue(tcp(40000, true), now).is_ok() {}
            while p.enqueue(tcp(40001, false), now).is_ok() {}
            now += MS;
            p.advance(now);
            while let Some((_, _, pkt)) = p.st.pop_due(now) {
                if pkt[22..24] == 3260u16.to_be_bytes() {
                    storage += pkt.len() as u64;
                } else {
                    bulk += pkt.len() as u64;
                }
            }
        }
        // 2 Mbit/s over 10 s is 2.5 MB, the rest 10 MB: within one bucket and one packet.
        assert!(
            (storage as i64 - 2_500_000).abs() <= 5_000,
            "storage {storage}"
        );
        assert!((bulk as i64 - 10_000_000).abs() <= 5_000, "bulk {bulk}");
        assert!(p.reserved_queued() > 0);
        assert!(p.st.stats.reserved_bytes_out >= storage);
    }

    #[test]
    fn reserved_class_never_exceeds_its_rate_alone() {
        let mut p = reserved_pipe("rate=100mbit,reserve=3260:1mbit:1000");
        for _ in 0..100 {
            p.enqueue(tcp(40000, true), 0).unwrap();
        }
        let out = drain(&mut p, 10_000 * MS);
        assert_eq!(out.len(), 100);
        // The first goes at once (full bucket), each next 8 ms later: 1000 B at 1 Mbit/s,
        // plus 80 us of serialization at 100 Mbit/s for the first.
        assert_eq!(out[0].0, 80_000);
        assert_eq!(out[99].0, 99 * 8 * MS + 80_000);
    }

    #[test]
    fn reserved_packet_waits_at_most_one_packet_behind_the_flood() {
        // 1000 bulk packets queued (800 ms at 10 Mbit/s); a storage packet arriving at 5 ms
        // leaves when the bulk packet then on the wire is done, plus its own 0.8 ms.
        let mut p = reserved_pipe("rate=10mbit,reserve=3260:1mbit,queue=2000p");
        for _ in 0..1000 {
            p.enqueue(tcp(40001, false), 0).unwrap();
        }
        p.enqueue(tcp(40000, true), 5 * MS).unwrap();
        let out = drain(&mut p, 2_000 * MS);
        let at = out
            .iter()
            .find(|(_, pkt)| pkt[22..24] == 3260u16.to_be_bytes())
            .unwrap()
            .0;
        assert_eq!(at, 5_600_000 + 800_000);
        assert_eq!(out.len(), 1001);
    }

    #[test]
    fn reserve_spec_errors_say_what_to_write() {
        let mut path = crate::PathConfig::default();
        for (spec, want) in [
            ("reserve=iscsi:1mbit", "TCP port"),
            ("reserve=3260", "PORT:RATE"),
            ("reserve=3260:10bit", "at least 1kbit"),
            ("reserve=3260:1mbit:0", "at least one byte"),
            ("reserve=3260:1mbit:1KiB:x", "PORT:RATE[:BURST]"),
            ("profile=802.11b,reserve=3260:1mbit", "wired path"),
            (
                "rate=1mbit,reserve=3260:2mbit",
                "more than the direction's rate",
            ),
        ] {
            let e = path.clone().apply_spec(spec).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
        path.apply_spec("reserve-up=3260:1mbit,reserve-down=3260:2mbit:8KiB")
            .unwrap();
        assert_eq!(path.up.reserve.unwrap().rate, 1e6);
        assert_eq!(path.down.reserve.unwrap().burst, 8192);
        assert_eq!(
            path.up.reserve.unwrap().burst,
            crate::config::Reserve::DEFAULT_BURST
        );
    }
}
