//! The session-wide command window (RFC 7143 section 4.2.2.1 and 3.2.2.1 of RFC 3720).
//!
//! Non-immediate commands of all connections of a session are handed on in CmdSN order: a command
//! whose CmdSN is ExpCmdSN is delivered at once (with every held command that follows it without a
//! gap); a command ahead of ExpCmdSN but inside the window is held until the gap is filled; a
//! command outside [ExpCmdSN, MaxCmdSN] is dropped silently, as is a duplicate.
//!
//! MaxCmdSN follows the number of outstanding tasks so that at most `depth` tasks are queued at
//! once, and never moves backwards (initiators ignore a smaller MaxCmdSN anyway).

use ahash::AHashMap;
use mcsi_proto::serial::{in_window, Sn};

/// What happened to a submitted command.
#[derive(Debug, PartialEq, Eq)]
pub enum Submit<T> {
    /// These items are now in order (the submitted one first, then held ones it unblocked).
    Deliver(Vec<T>),
    /// Held until the commands before it arrive.
    Held,
    /// Outside the window or a duplicate of a held CmdSN: dropped silently (4.2.2.1).
    Dropped(T),
}

/// The command window of one session.
#[derive(Debug)]
pub struct CmdWindow<T> {
    exp: Sn,
    /// Last advertised MaxCmdSN.
    max: Sn,
    depth: u32,
    outstanding: u32,
    held: AHashMap<u32, T>,
}

impl<T> CmdWindow<T> {
    /// A window starting at `exp_cmd_sn` allowing `depth` (>= 1) outstanding commands.
    pub fn new(exp_cmd_sn: u32, depth: u32) -> Self {
        let depth = depth.max(1);
        CmdWindow {
            exp: Sn(exp_cmd_sn),
            max: Sn(exp_cmd_sn) + (depth - 1),
            depth,
            outstanding: 0,
            held: AHashMap::new(),
        }
    }

    /// ExpCmdSN: the next CmdSN expected.
    pub fn exp_cmd_sn(&self) -> u32 {
        self.exp.0
    }

    /// MaxCmdSN as last advertised.
    pub fn max_cmd_sn(&self) -> u32 {
        self.max.0
    }

    /// Whether `cmd_sn` lies in [ExpCmdSN, MaxCmdSN].
    pub fn accepts(&self, cmd_sn: u32) -> bool {
        in_window(Sn(cmd_sn), self.exp, self.max)
    }

    /// Whether a command with `cmd_sn` would be taken: inside the window and not a duplicate of
    /// a held one (either is dropped silently, RFC 7143 4.2.2.1).
    pub fn takes(&self, cmd_sn: u32) -> bool {
        self.accepts(cmd_sn) && !self.held.contains_key(&cmd_sn)
    }

    /// Number of commands held behind a gap.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Submits a non-immediate command.
    pub fn submit(&mut self, cmd_sn: u32, item: T) -> Submit<T> {
        if !self.accepts(cmd_sn) || self.held.contains_key(&cmd_sn) {
            return Submit::Dropped(item);
        }
        if Sn(cmd_sn) != self.exp {
            self.held.insert(cmd_sn, item);
            return Submit::Held;
        }
        let mut out = vec![item];
        self.exp = self.exp.next();
        while let Some(next) = self.held.remove(&self.exp.0) {
            out.push(next);
            self.exp = self.exp.next();
        }
        self.refresh();
        Submit::Deliver(out)
    }

    /// Consumes `cmd_sn` if it is ExpCmdSN and no command is held behind a gap: the command is
    /// in order and nothing else becomes deliverable with it (no allocation, unlike `submit`).
    pub fn take_next(&mut self, cmd_sn: u32) -> bool {
        if Sn(cmd_sn) != self.exp || !self.held.is_empty() {
            return false;
        }
        self.exp = self.exp.next();
        self.refresh();
        true
    }

    /// A task started occupying a queue slot (counted until [`CmdWindow::task_done`]).
    pub fn task_started(&mut self) {
        self.outstanding = self.outstanding.saturating_add(1);
    }

    /// A task left the queue; the window may open further.
    pub fn task_done(&mut self) {
        self.outstanding = self.outstanding.saturating_sub(1);
        self.refresh();
    }

    /// Recomputes MaxCmdSN: ExpCmdSN - 1 + free slots, never smaller than before.
    fn refresh(&mut self) {
        let free = self.depth.saturating_sub(self.outstanding);
        let candidate = Sn(self.exp.0.wrapping_sub(1)) + free;
        if Sn::gt(candidate, self.max) {
            self.max = candidate;
        }
        // MaxCmdSN must not fall below ExpCmdSN - 1 (4.2.2.1).
        let floor = Sn(self.exp.0.wrapping_sub(1));
        if Sn::lt(self.max, floor) {
            self.max = floor;
        }
    }

    /// Drops every held command (session teardown) and returns them.
    /// The commands held behind a gap, by CmdSN (to abort some in place).
    pub fn held_mut(&mut self) -> impl Iterator<Item = (u32, &mut T)> {
        self.held.iter_mut().map(|(sn, v)| (*sn, v))
    }

    pub fn drain_held(&mut self) -> Vec<T> {
        self.held.drain().map(|(_, v)| v).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_cmd_sn_is_not_taken_twice() {
        let mut w: CmdWindow<u32> = CmdWindow::new(10, 4);
        assert!(w.takes(11));
        assert_eq!(w.submit(11, 1), Submit::Held);
        assert!(!w.takes(11), "a duplicate of a held command");
        assert!(w.takes(10) && w.takes(12) && !w.takes(14));
    }

    #[test]
    fn take_next_only_in_order_and_without_held_commands() {
        let mut w: CmdWindow<u32> = CmdWindow::new(10, 4);
        assert!(!w.take_next(11), "ahead of ExpCmdSN");
        assert!(w.take_next(10));
        // ExpCmdSN 11, MaxCmdSN 14 (nothing outstanding), as a delivery through submit gives.
        assert_eq!((w.exp_cmd_sn(), w.max_cmd_sn()), (11, 14));
        assert!(!w.take_next(10), "a duplicate");
        // A held command behind a gap: the gap filler must go through submit to release it.
        assert_eq!(w.submit(12, 12), Submit::Held);
        assert!(!w.take_next(11));
        assert_eq!(w.exp_cmd_sn(), 11);
        assert_eq!(w.submit(11, 11), Submit::Deliver(vec![11, 12]));
        assert!(w.take_next(13));
        assert_eq!((w.exp_cmd_sn(), w.max_cmd_sn()), (14, 17));
    }

    #[test]
    fn in_order_delivery_and_window_edges() {
        let mut w: CmdWindow<u32> = CmdWindow::new(10, 4);
        assert_eq!((w.exp_cmd_sn(), w.max_cmd_sn()), (10, 13));
        assert_eq!(w.submit(10, 10), Submit::Deliver(vec![10]));
        // ExpCmdSN 11; window 11..=14 (one slot freed by the delivery, none outstanding).
        assert_eq!((w.exp_cmd_sn(), w.max_cmd_sn()), (11, 14));
        assert_eq!(w.submit(10, 10), Submit::Dropped(10)); // too low
        assert_eq!(w.submit(15, 15), Submit::Dropped(15)); // too high
        assert_eq!(w.submit(14, 14), Submit::Held);
        assert_eq!(w.submit(14, 99), Submit::Dropped(99)); // duplicate
    }

    #[test]
    fn gap_holds_until_filled() {
        let mut w: CmdWindow<&str> = CmdWindow::new(1, 8);
        assert_eq!(w.submit(3, "c"), Submit::Held);
        assert_eq!(w.submit(2, "b"), Submit::Held);
        assert_eq!(w.held(), 2);
        assert_eq!(w.submit(1, "a"), Submit::Deliver(vec!["a", "b", "c"]));
        assert_eq!(w.exp_cmd_sn(), 4);
        assert_eq!(w.held(), 0);
    }

    #[test]
    fn outstanding_tasks_limit_the_window() {
        let mut w: CmdWindow<u32> = CmdWindow::new(0, 2);
        w.task_started();
        assert!(matches!(w.submit(0, 0), Submit::Deliver(_)));
        w.task_started();
        assert!(matches!(w.submit(1, 1), Submit::Deliver(_)));
        // Two outstanding, depth 2: MaxCmdSN stays at 1 (it never decreases), ExpCmdSN 2: closed.
        assert_eq!((w.exp_cmd_sn(), w.max_cmd_sn()), (2, 1));
        assert!(!w.accepts(2));
        w.task_done();
        assert_eq!(w.max_cmd_sn(), 2);
        assert!(w.accepts(2));
        w.task_done();
        assert_eq!(w.max_cmd_sn(), 3);
    }

    #[test]
    fn wraps_around_zero() {
        let mut w: CmdWindow<u32> = CmdWindow::new(u32::MAX, 4);
        assert_eq!(w.max_cmd_sn(), 2);
        assert_eq!(w.submit(1, 1), Submit::Held);
        assert_eq!(w.submit(0, 0), Submit::Held);
        assert_eq!(w.submit(u32::MAX, 7), Submit::Deliver(vec![7, 0, 1]));
        assert_eq!(w.exp_cmd_sn(), 2);
    }
}
