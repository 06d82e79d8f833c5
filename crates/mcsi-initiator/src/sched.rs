//! Which connection carries the next task. All PDUs of a task then stay on that connection
//! (connection allegiance, RFC 7143 4.2.3 / 7.1.1), so the choice is made once per task.
//!
//! Policies implement [`Scheduler`]; [`policy`] builds one by name for the command line.

use crate::error::Error;

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
    pub tcp: Option<mcsi_tcp::TcpState>,
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

/// Names accepted by [`policy`].
pub const POLICIES: &[&str] = &["round-robin", "least-outstanding"];

/// Build a policy by name.
pub fn policy(name: &str) -> Result<Box<dyn Scheduler>, Error> {
    match name {
        "round-robin" | "rr" => Ok(Box::new(RoundRobin::default())),
        "least-outstanding" | "lo" => Ok(Box::new(LeastOutstanding::default())),
        other => Err(Error::InvalidArgument(format!(
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
        assert!(e.contains("round-robin, least-outstanding"), "{e}");
    }
}
