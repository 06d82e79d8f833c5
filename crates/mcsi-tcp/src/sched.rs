//! Which connection carries the next task. All PDUs of a task then stay on that connection
//! (connection allegiance, RFC 7143 4.2.3 / 7.1.1), so the choice is made once per task.
//!
//! Policies implement [`Scheduler`]; [`policy`] builds one by name for the command line. The
//! initiator uses them to place each task on a connection, the target in the asymmetric mode
//! to choose each task's response connection.

/// A policy name [`policy`] does not know, or weights it cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PolicyError(pub String);

/// What a scheduler may look at for one connection.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConnLoad {
    /// False while the connection cannot take new tasks (lost, draining for logout, or a
    /// response-only connection in asymmetric mode).
    pub usable: bool,
    /// Tasks issued on the connection and not yet completed.
    pub outstanding_tasks: u32,
    /// Data bytes of those tasks (reads and writes), not yet completed.
    pub outstanding_bytes: u64,
    /// The socket's TCP state when the session samples it (for congestion-aware policies).
    pub tcp: Option<crate::TcpState>,
    /// Bytes per second the connection completes while it has tasks ([`RateMeter`]), in either
    /// direction; None until measured.
    pub rate: Option<f64>,
    /// The highest of those rates over the last few seconds ([`RateMeter::peak`]): what the
    /// connection can carry, where `rate` is what it carried at the load it was given.
    pub peak: Option<f64>,
    /// The target's sending side of the connection, when an mcsi target reports it.
    pub target_tcp: Option<crate::TcpState>,
}

/// The task being placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskInfo {
    /// Data bytes the task will move (either direction).
    pub bytes: u64,
    pub write: bool,
}

/// A connection-selection policy.
pub trait Scheduler: Send + std::fmt::Debug {
    /// The policy's name as given on the command line.
    fn name(&self) -> &'static str;
    /// Index into `conns` of the connection for `task`, or None when no connection is usable.
    fn pick(&mut self, conns: &[ConnLoad], task: &TaskInfo) -> Option<usize>;
    /// Whether the session should sample each socket's TCP_INFO into [`ConnLoad::tcp`]
    /// (a congestion-window-aware policy says yes; sampling costs a syscall per connection).
    fn wants_tcp_info(&self) -> bool {
        false
    }
}

/// Each new task on the next usable connection in turn (the 2007 VPN paper's peers).
#[derive(Debug, Default, Clone)]
pub struct RoundRobin {
    next: usize,
}

impl Scheduler for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn pick(&mut self, conns: &[ConnLoad], _task: &TaskInfo) -> Option<usize> {
        let n = conns.len();
        for i in 0..n {
            let idx = (self.next + i) % n;
            if conns[idx].usable {
                self.next = (idx + 1) % n;
                return Some(idx);
            }
        }
        None
    }
}

/// The usable connection with the fewest outstanding bytes; ties go to fewer outstanding
/// tasks, then rotate so that an idle session still spreads its tasks.
#[derive(Debug, Default, Clone)]
pub struct LeastOutstanding {
    rotor: usize,
}

impl Scheduler for LeastOutstanding {
    fn name(&self) -> &'static str {
        "least-outstanding"
    }

    fn pick(&mut self, conns: &[ConnLoad], _task: &TaskInfo) -> Option<usize> {
        let n = conns.len();
        let mut best: Option<(usize, (u64, u32))> = None;
        for i in 0..n {
            let idx = (self.rotor + i) % n;
            let c = &conns[idx];
            if !c.usable {
                continue;
            }
            let key = (c.outstanding_bytes, c.outstanding_tasks);
            if best.is_none_or(|(_, k)| key < k) {
                best = Some((idx, key));
            }
        }
        let idx = best?.0;
        self.rotor = (idx + 1) % n.max(1);
        Some(idx)
    }
}

/// Each task on the connection expected to complete it first: the bytes queued on the
/// connection plus the task's, at the rate the connection delivers, plus its round-trip time.
///
/// The rate is what the connection completed while it had work ([`RateMeter`], measured by the
/// session in both directions, since the initiator's own socket carries little of a read);
/// before a measurement, the kernel's delivery rate of the initiator's socket (writes), or its
/// window over its RTT. A connection not yet measured is costed at the best known rate, so it
/// gets work and a measurement. Unlike least-outstanding, which balances bytes as if every
/// path were equally fast, this keeps a slow or long path for the tasks that would otherwise
/// wait longer behind the fast one, which bounds the tail latency.
#[derive(Debug, Default, Clone)]
pub struct TcpAware {
    rotor: usize,
}

impl TcpAware {
    fn rate_of(c: &ConnLoad) -> Option<f64> {
        Self::rate_with(c, c.rate)
    }

    /// [`TcpAware::rate_of`] with `measured` in place of the connection's measured rate.
    fn rate_with(c: &ConnLoad, measured: Option<f64>) -> Option<f64> {
        let tcp_rate = c.tcp.and_then(|t| {
            t.delivery_rate
                .filter(|_| !t.delivery_rate_app_limited)
                .map(|r| r as f64)
                .or_else(|| {
                    (t.rtt_us > 0).then(|| t.cwnd_bytes() as f64 / (f64::from(t.rtt_us) / 1e6))
                })
        });
        measured.or(tcp_rate).filter(|r| *r > 0.0)
    }

    /// The fastest rate any usable connection is known to have.
    fn best_rate(conns: &[ConnLoad]) -> Option<f64> {
        conns
            .iter()
            .filter(|c| c.usable)
            .filter_map(Self::rate_of)
            .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.max(r))))
    }

    /// Seconds until `c` would complete `bytes` more: what it has queued plus these at its rate
    /// (or `fallback`), plus its round-trip time. None when no rate is known.
    fn cost(c: &ConnLoad, bytes: u64, fallback: Option<f64>) -> Option<f64> {
        let rtt = c.tcp.map_or(0.0, |t| f64::from(t.rtt_us) / 1e6);
        Self::cost_at(c, bytes, Self::rate_of(c).or(fallback), rtt)
    }

    /// Seconds until `c` would complete `bytes` more at `rate`, `delay` (a round-trip time)
    /// included.
    fn cost_at(c: &ConnLoad, bytes: u64, rate: Option<f64>, delay: f64) -> Option<f64> {
        Some((c.outstanding_bytes + bytes) as f64 / rate? + delay)
    }
}

/// Seconds until a task of `bytes` would complete on the usable connection expected to finish
/// it first, by [`TcpAware`]'s estimate; None while no connection's rate is known. A volume
/// compares this across sessions to send a mirror's read where it finishes first.
///
/// Unlike placement within a session, this costs each connection at its peak rate of the last
/// few seconds ([`ConnLoad::peak`]). A path bounded by latency rather than bandwidth (a
/// gateway whose storage answers in a millisecond) completes data in proportion to the
/// commands it is given: measured at two commands in flight it shows a quarter of the rate it
/// shows at eight, so a volume comparing the measured rates would keep sending to the member
/// it already loads most, and starve an equal one. The peak is what the member showed it can
/// carry; a member that gets fewer commands keeps it, and with it its share.
///
/// And it adds the connection's smallest round-trip time (the path's own delay), not the
/// smoothed one. On an iSCSI connection the ACK of a command rides on its answer, so the
/// smoothed RTT is the target's response time, queue included: the queue is already counted
/// (queued bytes at the rate), and on a member given nothing lately it is the response time
/// of whenever it last had work. Measured through two rbd gateways on one host under load,
/// it ranged from 0.2 to 5.6 ms from second to second, and a member that showed 5.6 ms once
/// was given nothing after.
pub fn expected_completion(conns: &[ConnLoad], bytes: u64) -> Option<f64> {
    // A read's path asks this for every member: no copy of the connections.
    let capacity = |c: &ConnLoad| TcpAware::rate_with(c, c.peak.or(c.rate));
    let best = conns
        .iter()
        .filter(|c| c.usable)
        .filter_map(capacity)
        .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.max(r))))?;
    conns
        .iter()
        .filter(|c| c.usable)
        .filter_map(|c| {
            let delay = c.tcp.map_or(0.0, |t| {
                f64::from(t.min_rtt_us.filter(|&m| m > 0).unwrap_or(t.rtt_us)) / 1e6
            });
            TcpAware::cost_at(c, bytes, capacity(c).or(Some(best)), delay)
        })
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.min(x))))
}

impl Scheduler for TcpAware {
    fn name(&self) -> &'static str {
        "tcp-aware"
    }

    fn pick(&mut self, conns: &[ConnLoad], task: &TaskInfo) -> Option<usize> {
        let n = conns.len();
        let best_rate = Self::best_rate(conns);
        let mut best: Option<(usize, f64)> = None;
        for i in 0..n {
            let idx = (self.rotor + i) % n;
            let c = &conns[idx];
            if !c.usable {
                continue;
            }
            // Nothing measured anywhere yet: fewest bytes queued.
            let cost = Self::cost(c, task.bytes, best_rate).unwrap_or(c.outstanding_bytes as f64);
            if best.is_none_or(|(_, b)| cost < b) {
                best = Some((idx, cost));
            }
        }
        let idx = best?.0;
        self.rotor = (idx + 1) % n.max(1);
        Some(idx)
    }

    fn wants_tcp_info(&self) -> bool {
        true
    }
}

/// Static weights, as Windows' Weighted Paths: connection i gets weights[i] of every
/// sum(weights) tasks, interleaved (smooth weighted round-robin); a connection without a weight
/// has weight 1, an unusable one is skipped.
#[derive(Debug, Clone)]
pub struct Weighted {
    weights: Vec<u32>,
    current: Vec<i64>,
}

impl Weighted {
    pub fn new(weights: Vec<u32>) -> Weighted {
        Weighted {
            weights,
            current: Vec::new(),
        }
    }
}

impl Scheduler for Weighted {
    fn name(&self) -> &'static str {
        "weighted"
    }

    fn pick(&mut self, conns: &[ConnLoad], _task: &TaskInfo) -> Option<usize> {
        self.current.resize(conns.len(), 0);
        let w = |i: usize| i64::from(self.weights.get(i).copied().unwrap_or(1));
        let mut total = 0;
        let mut best: Option<usize> = None;
        for (i, c) in conns.iter().enumerate() {
            if !c.usable || w(i) == 0 {
                continue;
            }
            self.current[i] += w(i);
            total += w(i);
            if best.is_none_or(|b| self.current[i] > self.current[b]) {
                best = Some(i);
            }
        }
        let b = best?;
        self.current[b] -= total;
        Some(b)
    }
}

/// One active connection, the others standby: every task goes to the first usable connection
/// in order, and to the next one only when that one is lost or draining.
#[derive(Debug, Default, Clone)]
pub struct Failover;

impl Scheduler for Failover {
    fn name(&self) -> &'static str {
        "failover"
    }

    fn pick(&mut self, conns: &[ConnLoad], _task: &TaskInfo) -> Option<usize> {
        conns.iter().position(|c| c.usable)
    }
}

/// The rate a connection completes data at while it has work: bytes completed over the time it
/// had tasks outstanding, over the last second or so of busy time. Time is passed in.
#[derive(Debug, Clone, Default)]
pub struct RateMeter {
    last: Option<(f64, u64, bool)>,
    /// (busy seconds, bytes) per sampling interval that started busy, newest last.
    window: std::collections::VecDeque<(f64, u64)>,
    /// (time, rate) of the rates measured over the last [`Self::PEAK_SPAN`], decreasing from
    /// the front: a running maximum, as BBR keeps its bottleneck bandwidth.
    peaks: std::collections::VecDeque<(f64, f64)>,
}

impl RateMeter {
    /// Busy time the estimate looks back over.
    const SPAN: f64 = 1.0;
    /// Time the peak looks back over: long enough to outlast a few seconds of a light load,
    /// short enough to forget a route that slowed.
    const PEAK_SPAN: f64 = 5.0;

    /// A sample at `now` (seconds): the connection's completed bytes so far and whether it has
    /// tasks outstanding.
    pub fn sample(&mut self, now: f64, completed: u64, busy: bool) {
        if let Some((t, b, was_busy)) = self.last {
            let dt = now - t;
            if dt > 0.0 && was_busy {
                self.window.push_back((dt, completed.saturating_sub(b)));
                let mut span: f64 = self.window.iter().map(|w| w.0).sum();
                while span > Self::SPAN && self.window.len() > 1 {
                    if let Some((d, _)) = self.window.pop_front() {
                        span -= d;
                    }
                }
            }
        }
        self.last = Some((now, completed, busy));
        while self
            .peaks
            .front()
            .is_some_and(|p| now - p.0 > Self::PEAK_SPAN)
        {
            self.peaks.pop_front();
        }
        if let Some(r) = self.rate() {
            while self.peaks.back().is_some_and(|p| p.1 <= r) {
                self.peaks.pop_back();
            }
            self.peaks.push_back((now, r));
        }
    }

    /// The highest [`Self::rate`] of the last five seconds: what the connection showed it can
    /// carry. None until a rate is measured, or after five seconds without one.
    pub fn peak(&self) -> Option<f64> {
        self.peaks.front().map(|p| p.1)
    }

    /// Bytes per second, once at least 50 ms of busy time with data has been seen.
    pub fn rate(&self) -> Option<f64> {
        let (t, b) = self
            .window
            .iter()
            .fold((0.0, 0u64), |(t, b), w| (t + w.0, b + w.1));
        (t >= 0.05 && b > 0).then(|| b as f64 / t)
    }
}

/// Names accepted by [`policy`] (`weighted` takes its weights: `weighted:3,1`).
pub const POLICIES: &[&str] = &[
    "round-robin",
    "least-outstanding",
    "tcp-aware",
    "weighted:W1,W2,...",
    "failover",
];

/// Build a policy by name.
pub fn policy(name: &str) -> Result<Box<dyn Scheduler>, PolicyError> {
    if let Some(w) = name.strip_prefix("weighted") {
        let list = w.strip_prefix(':').unwrap_or("");
        let weights: Result<Vec<u32>, _> =
            list.split(',').map(|x| x.trim().parse::<u32>()).collect();
        return match weights {
            Ok(ws) if !list.is_empty() && ws.iter().any(|&x| x > 0) && ws.iter().all(|&x| x <= 1000) => {
                Ok(Box::new(Weighted::new(ws)))
            }
            _ => Err(PolicyError(format!(
                "policy {name:?}: weighted needs one weight per connection, 0 to 1000, not all 0, e.g. weighted:3,1"
            ))),
        };
    }
    match name {
        "round-robin" | "rr" => Ok(Box::new(RoundRobin::default())),
        "least-outstanding" | "lo" => Ok(Box::new(LeastOutstanding::default())),
        "tcp-aware" => Ok(Box::new(TcpAware::default())),
        "failover" => Ok(Box::new(Failover)),
        other => Err(PolicyError(format!(
            "unknown scheduler policy {other:?}; known policies: {}",
            POLICIES.join(", ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(usable: bool, tasks: u32, bytes: u64) -> ConnLoad {
        ConnLoad {
            usable,
            outstanding_tasks: tasks,
            outstanding_bytes: bytes,
            tcp: None,
            rate: None,
            peak: None,
            target_tcp: None,
        }
    }

    const T: TaskInfo = TaskInfo {
        bytes: 4096,
        write: false,
    };

    #[test]
    fn round_robin_cycles_and_skips_unusable() {
        let mut rr = RoundRobin::default();
        let conns = vec![load(true, 0, 0); 4];
        let picks: Vec<_> = (0..9).map(|_| rr.pick(&conns, &T).unwrap()).collect();
        assert_eq!(picks, vec![0, 1, 2, 3, 0, 1, 2, 3, 0]);
        // Connection 2 goes away: 1 -> 3 -> 0 -> 1 ...
        let conns = vec![
            load(true, 0, 0),
            load(true, 0, 0),
            load(false, 0, 0),
            load(true, 0, 0),
        ];
        let picks: Vec<_> = (0..5).map(|_| rr.pick(&conns, &T).unwrap()).collect();
        assert_eq!(picks, vec![1, 3, 0, 1, 3]);
        // Load does not matter to round-robin.
        let conns = vec![load(true, 100, 1 << 30), load(true, 0, 0)];
        let mut rr = RoundRobin::default();
        assert_eq!(rr.pick(&conns, &T), Some(0));
        assert_eq!(rr.pick(&conns, &T), Some(1));
    }

    #[test]
    fn expected_completion_is_the_soonest_connection() {
        let rated = |bytes: u64, rate: f64| ConnLoad {
            rate: Some(rate),
            ..load(true, 1, bytes)
        };
        assert_eq!(expected_completion(&[load(true, 0, 0)], 1000), None);
        // 1 MB queued at 1 MB/s, or nothing queued at 0.5 MB/s: the second, 1 MB in 2 s.
        let conns = [rated(1_000_000, 1e6), rated(0, 0.5e6), load(false, 0, 0)];
        assert_eq!(expected_completion(&conns, 1_000_000), Some(2.0));
        // A connection not yet measured is costed at the best known rate.
        let conns = [rated(4_000_000, 1e6), load(true, 0, 0)];
        assert_eq!(expected_completion(&conns, 1_000_000), Some(1.0));
    }

    /// Two gateways alike (1 MB/s each), one busy with 8 KB queued and a smoothed RTT of
    /// 1 ms, the other idle with a smoothed RTT of 12 ms left from the last time it had work;
    /// both paths' own delay (the smallest RTT) is 10 µs. The idle one finishes a 1 KB read
    /// first: 1 ms + 10 µs against 9 ms + 10 µs, where the smoothed RTTs said 13 ms against
    /// 10 ms, the other way. Without a smallest RTT the smoothed one is what there is.
    #[test]
    fn expected_completion_adds_the_paths_own_delay_not_the_targets_response_time() {
        let gateway = |queued: u64, srtt_us: u32, min_rtt_us: Option<u32>| ConnLoad {
            rate: Some(1e6),
            tcp: Some(crate::TcpState {
                rtt_us: srtt_us,
                min_rtt_us,
                ..Default::default()
            }),
            ..load(true, (queued / 1000) as u32, queued)
        };
        let eta = |c: ConnLoad| expected_completion(&[c], 1000).unwrap();
        let busy = eta(gateway(8000, 1000, Some(10)));
        let idle = eta(gateway(0, 12_000, Some(10)));
        assert!((busy - 0.009_01).abs() < 1e-9, "{busy}");
        assert!((idle - 0.001_01).abs() < 1e-9, "{idle}");
        assert!((eta(gateway(0, 12_000, None)) - 0.013).abs() < 1e-9);
    }

    #[test]
    fn a_lightly_loaded_path_keeps_its_peak() {
        // A path bounded by latency: each command takes 1 ms whatever the load. At 8 commands
        // of 4 KiB it completes 32 MB/s; then for two seconds at 2 commands, 8 MB/s.
        let mut m = RateMeter::default();
        let mut done = 0u64;
        let mut t = 0.0;
        for _ in 0..50 {
            t += 0.02;
            done += 8 * 4096 * 20;
            m.sample(t, done, true);
        }
        let high = m.rate().unwrap();
        for _ in 0..100 {
            t += 0.02;
            done += 2 * 4096 * 20;
            m.sample(t, done, true);
        }
        let low = m.rate().unwrap();
        assert!(low < high / 3.0, "rate {low} after {high}");
        let peak = m.peak().unwrap();
        assert!(
            (peak - high).abs() < 1.0,
            "peak {peak}, highest rate {high}"
        );
        // A volume sends the next read to the path with fewer commands queued, not to the one
        // whose measured rate its own load made higher.
        let member = |tasks: u32, rate: f64, peak: Option<f64>| ConnLoad {
            rate: Some(rate),
            peak,
            ..load(true, tasks, u64::from(tasks) * 4096)
        };
        // The other member, at 14 commands of 1 ms each, completes 57 MB/s.
        let rate14 = 14.0 * 4096.0 * 1000.0;
        let busy = expected_completion(&[member(14, rate14, Some(rate14))], 4096).unwrap();
        let idle = expected_completion(&[member(2, low, Some(high))], 4096).unwrap();
        assert!(idle < busy, "{idle} vs {busy}");
        let naive = expected_completion(&[member(2, low, None)], 4096).unwrap();
        assert!(naive > busy, "the measured rate alone: {naive} vs {busy}");
        // Five seconds later, with nothing higher since, the peak is the rate measured now.
        for _ in 0..300 {
            t += 0.02;
            done += 2 * 4096 * 20;
            m.sample(t, done, true);
        }
        assert!(m.peak().unwrap() < high / 3.0);
    }

    #[test]
    fn none_when_nothing_usable() {
        let conns = vec![load(false, 0, 0); 3];
        assert_eq!(RoundRobin::default().pick(&conns, &T), None);
        assert_eq!(LeastOutstanding::default().pick(&conns, &T), None);
        assert_eq!(RoundRobin::default().pick(&[], &T), None);
        assert_eq!(LeastOutstanding::default().pick(&[], &T), None);
    }

    #[test]
    fn least_outstanding_prefers_fewest_bytes() {
        let mut lo = LeastOutstanding::default();
        let conns = vec![
            load(true, 1, 1 << 20),
            load(true, 8, 32 << 10),
            load(true, 2, 64 << 10),
            load(false, 0, 0),
        ];
        // Connection 1 has most tasks but fewest bytes; the unusable idle one is skipped.
        assert_eq!(lo.pick(&conns, &T), Some(1));
    }

    #[test]
    fn least_outstanding_ties_by_tasks_then_rotates() {
        let mut lo = LeastOutstanding::default();
        let conns = vec![
            load(true, 3, 4096),
            load(true, 1, 4096),
            load(true, 2, 4096),
        ];
        assert_eq!(lo.pick(&conns, &T), Some(1));
        let idle = vec![load(true, 0, 0); 3];
        let picks: Vec<_> = (0..4).map(|_| lo.pick(&idle, &T).unwrap()).collect();
        // After picking 1, the rotor starts at 2.
        assert_eq!(picks, vec![2, 0, 1, 2]);
    }

    #[test]
    fn least_outstanding_balances_a_simulated_load() {
        // Tasks of mixed sizes complete in FIFO order per connection; the policy keeps the
        // byte backlog of the busiest connection within one large task of the lightest.
        let mut lo = LeastOutstanding::default();
        let mut conns = vec![load(true, 0, 0); 4];
        let sizes = [4096u64, 1 << 20, 8192, 65536, 512, 1 << 20, 4096, 131072];
        for (i, &s) in sizes.iter().cycle().take(400).enumerate() {
            let t = TaskInfo {
                bytes: s,
                write: i % 2 == 0,
            };
            let c = lo.pick(&conns, &t).unwrap();
            conns[c].outstanding_bytes += s;
            conns[c].outstanding_tasks += 1;
        }
        let max = conns.iter().map(|c| c.outstanding_bytes).max().unwrap();
        let min = conns.iter().map(|c| c.outstanding_bytes).min().unwrap();
        assert!(max - min <= 1 << 20, "max {max} min {min}");
        // Round-robin with the same sequence and 4 connections puts every 1 MiB task on the
        // same two connections (sizes repeat with period 8): a large imbalance.
        let mut rr = RoundRobin::default();
        let mut rconns = vec![load(true, 0, 0); 4];
        for &s in sizes.iter().cycle().take(400) {
            let c = rr.pick(&rconns, &T).unwrap();
            rconns[c].outstanding_bytes += s;
        }
        let rmax = rconns.iter().map(|c| c.outstanding_bytes).max().unwrap();
        let rmin = rconns.iter().map(|c| c.outstanding_bytes).min().unwrap();
        assert!(rmax - rmin > 10 << 20, "rr max {rmax} min {rmin}");
    }

    #[test]
    fn policy_by_name() {
        assert_eq!(policy("round-robin").unwrap().name(), "round-robin");
        assert_eq!(
            policy("least-outstanding").unwrap().name(),
            "least-outstanding"
        );
        let e = policy("random").unwrap_err().to_string();
        assert!(
            e.contains("round-robin, least-outstanding, tcp-aware"),
            "{e}"
        );
        assert_eq!(policy("tcp-aware").unwrap().name(), "tcp-aware");
        assert_eq!(policy("failover").unwrap().name(), "failover");
        assert_eq!(policy("weighted:3,1").unwrap().name(), "weighted");
        for bad in [
            "weighted",
            "weighted:",
            "weighted:0,0",
            "weighted:a,1",
            "weighted:5000",
        ] {
            let e = policy(bad).unwrap_err().to_string();
            assert!(e.contains("e.g. weighted:3,1"), "{bad}: {e}");
        }
    }

    #[test]
    fn weighted_interleaves_by_weight_and_skips_unusable() {
        let mut w = Weighted::new(vec![3, 1]);
        let conns = vec![load(true, 0, 0); 2];
        let picks: Vec<_> = (0..8).map(|_| w.pick(&conns, &T).unwrap()).collect();
        assert_eq!(picks, vec![0, 0, 1, 0, 0, 0, 1, 0]);
        let conns = vec![load(false, 0, 0), load(true, 0, 0)];
        assert!((0..4).all(|_| w.pick(&conns, &T) == Some(1)));
        // A third connection without a weight counts 1.
        let mut w = Weighted::new(vec![2, 1]);
        let conns = vec![load(true, 0, 0); 3];
        let mut n = [0; 3];
        for _ in 0..400 {
            n[w.pick(&conns, &T).unwrap()] += 1;
        }
        assert_eq!(n, [200, 100, 100]);
    }

    #[test]
    fn failover_keeps_to_the_first_usable() {
        let mut f = Failover;
        let mut conns = vec![load(true, 5, 1 << 20), load(true, 0, 0), load(true, 0, 0)];
        assert!((0..3).all(|_| f.pick(&conns, &T) == Some(0)));
        conns[0].usable = false;
        assert_eq!(f.pick(&conns, &T), Some(1));
    }

    /// Two paths, 2.5 MB/s with 10 ms RTT and 0.625 MB/s with 80 ms, 16 tasks of 64 KiB kept
    /// outstanding; each path serves its queue in order. The time-to-complete policy keeps the
    /// slow path for what would wait longer on the fast one: more throughput than
    /// round-robin and a far shorter tail than least-outstanding.
    #[test]
    fn tcp_aware_beats_round_robin_and_least_outstanding_on_unequal_paths() {
        fn simulate(s: &mut dyn Scheduler) -> (f64, f64) {
            let rates = [2.5e6, 0.625e6];
            let rtts = [0.010, 0.080];
            let size = 65536u64;
            let mut conns = vec![load(true, 0, 0); 2];
            for (i, c) in conns.iter_mut().enumerate() {
                c.rate = Some(rates[i]);
                c.tcp = Some(crate::TcpState {
                    rtt_us: (rtts[i] * 1e6) as u32,
                    ..Default::default()
                });
            }
            // Per path: completion times of its queued tasks, in order.
            let mut queues: Vec<std::collections::VecDeque<(f64, f64)>> =
                vec![Default::default(); 2];
            let mut now = 0.0;
            let mut lat = Vec::new();
            let t = TaskInfo {
                bytes: size,
                write: false,
            };
            let issue = |now: f64,
                         conns: &mut Vec<ConnLoad>,
                         queues: &mut Vec<std::collections::VecDeque<(f64, f64)>>,
                         s: &mut dyn Scheduler| {
                let c = s.pick(conns, &t).unwrap();
                let start = queues[c].back().map_or(now, |b| b.1.max(now));
                let done = start + size as f64 / rates[c];
                queues[c].push_back((now, done));
                conns[c].outstanding_tasks += 1;
                conns[c].outstanding_bytes += size;
            };
            for _ in 0..16 {
                issue(now, &mut conns, &mut queues, s);
            }
            for _ in 0..4000 {
                // The next completion (plus the path's RTT for the status to arrive).
                let (c, _) = (0..2)
                    .filter_map(|c| queues[c].front().map(|f| (c, f.1 + rtts[c])))
                    .min_by(|a, b| a.1.total_cmp(&b.1))
                    .unwrap();
                let (issued, done) = queues[c].pop_front().unwrap();
                now = done + rtts[c];
                lat.push(now - issued);
                conns[c].outstanding_tasks -= 1;
                conns[c].outstanding_bytes -= size;
                issue(now, &mut conns, &mut queues, s);
            }
            lat.sort_by(f64::total_cmp);
            let mbs = lat.len() as f64 * size as f64 / now / 1e6;
            (mbs, lat[lat.len() * 99 / 100])
        }
        let (rr, rr_p99) = simulate(&mut RoundRobin::default());
        let (lo, lo_p99) = simulate(&mut LeastOutstanding::default());
        let (ta, ta_p99) = simulate(&mut TcpAware::default());
        eprintln!("simulated: round-robin {rr:.2} MB/s p99 {rr_p99:.3} s; least-outstanding {lo:.2} MB/s p99 {lo_p99:.3} s; tcp-aware {ta:.2} MB/s p99 {ta_p99:.3} s");
        assert!(
            ta >= 1.3 * rr,
            "tcp-aware {ta:.2} MB/s, round-robin {rr:.2}"
        );
        assert!(
            ta >= 0.95 * lo,
            "tcp-aware {ta:.2} MB/s, least-outstanding {lo:.2}"
        );
        assert!(
            ta_p99 < rr_p99 && ta_p99 < lo_p99,
            "p99: {ta_p99:.3} s, rr {rr_p99:.3}, lo {lo_p99:.3}"
        );
    }

    #[test]
    fn rate_meter_counts_busy_time_only() {
        let mut m = RateMeter::default();
        assert_eq!(m.rate(), None);
        m.sample(0.0, 0, true);
        m.sample(0.1, 100_000, false); // 1 MB/s while busy
        m.sample(5.0, 100_000, true); // idle for 4.9 s: not counted
        m.sample(5.1, 200_000, true);
        let r = m.rate().unwrap();
        assert!((r - 1e6).abs() < 1.0, "{r}");
        // Old busy time falls out of the window.
        for i in 0..30u32 {
            m.sample(
                5.2 + f64::from(i) * 0.1,
                200_000 + u64::from(i + 1) * 10_000,
                true,
            );
        }
        let r = m.rate().unwrap();
        assert!((r - 100_000.0).abs() < 1.0, "{r}");
    }
}
