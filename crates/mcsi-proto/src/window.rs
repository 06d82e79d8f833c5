//! The session's command windows (RFC 7143 4.2.2.1), sans-IO, for both sides. CmdSN
//! comparisons are serial (RFC 1982), so both work across the 2^32 wrap.
//!
//! - [`CreditWindow`], the initiator's: a non-immediate command takes the next CmdSN and may go
//!   out only while that number lies in `[ExpCmdSN, MaxCmdSN]`, as the target last said;
//!   immediate PDUs carry the next CmdSN without taking it.
//! - [`OrderWindow`], the target's: non-immediate commands of all connections of a session are
//!   handed on in CmdSN order. A command whose CmdSN is ExpCmdSN is delivered at once (with every
//!   held command that follows it without a gap); a command ahead of ExpCmdSN but inside the
//!   window is held until the gap is filled; a command outside [ExpCmdSN, MaxCmdSN] is dropped
//!   silently, as is a duplicate. MaxCmdSN follows the number of outstanding tasks so that at
//!   most `depth` tasks are queued at once, and never moves backwards (initiators ignore a
//!   smaller MaxCmdSN anyway).

use crate::serial::{in_window, Sn};
use ahash::AHashMap;

/// What [`CreditWindow::update`] did with a target's ExpCmdSN/MaxCmdSN pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowUpdate {
    /// At least one of the two values moved forward.
    Advanced,
    /// Both values were old news (not serially greater than ours).
    Unchanged,
    /// MaxCmdSN < ExpCmdSN - 1: the pair is invalid and both are ignored (4.2.2.1).
    Invalid,
    /// ExpCmdSN acknowledges numbers never sent; ignored (the pair's MaxCmdSN is still applied).
    AheadOfSent,
}

/// CmdSN, ExpCmdSN and MaxCmdSN of one session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreditWindow {
    next: Sn,
    exp: Sn,
    max: Sn,
}

impl CreditWindow {
    /// The window as the final login response leaves it: the target expects `exp_cmd_sn` next
    /// and accepts up to `max_cmd_sn`. The leading login's CmdSN is what the target expects, so
    /// the next command takes `exp_cmd_sn`.
    pub fn new(exp_cmd_sn: u32, max_cmd_sn: u32) -> CreditWindow {
        CreditWindow {
            next: Sn(exp_cmd_sn),
            exp: Sn(exp_cmd_sn),
            max: Sn(max_cmd_sn),
        }
    }

    /// The CmdSN the next non-immediate command will take (immediate PDUs carry it as is).
    pub fn next_cmd_sn(&self) -> u32 {
        self.next.0
    }

    pub fn exp_cmd_sn(&self) -> u32 {
        self.exp.0
    }

    pub fn max_cmd_sn(&self) -> u32 {
        self.max.0
    }

    /// How many more non-immediate commands may be sent now.
    pub fn available(&self) -> u32 {
        if Sn::le(self.next, self.max) {
            // next <= max serially, so the distance is 0..2^31.
            Sn::diff(self.max, self.next) as u32 + 1
        } else {
            0
        }
    }

    /// Whether the next CmdSN lies inside the window.
    pub fn can_send(&self) -> bool {
        self.available() > 0
    }

    /// Commands sent but not yet acknowledged by ExpCmdSN.
    pub fn unacknowledged(&self) -> u32 {
        Sn::diff(self.next, self.exp).max(0) as u32
    }

    /// Take a CmdSN for a non-immediate command. None when the window is closed: the caller
    /// must hold the command until an update opens it. Never hands out a number beyond MaxCmdSN.
    pub fn take(&mut self) -> Option<u32> {
        if !self.can_send() {
            return None;
        }
        let sn = self.next;
        self.next += 1;
        Some(sn.0)
    }

    /// Apply ExpCmdSN/MaxCmdSN from a target PDU (RFC 7143 4.2.2.1): if MaxCmdSN < ExpCmdSN - 1
    /// serially, both are ignored; otherwise each replaces ours only if serially greater.
    pub fn update(&mut self, exp_cmd_sn: u32, max_cmd_sn: u32) -> WindowUpdate {
        let (exp, max) = (Sn(exp_cmd_sn), Sn(max_cmd_sn));
        if Sn::lt(max, exp + u32::MAX) {
            // max < exp - 1
            return WindowUpdate::Invalid;
        }
        let mut result = WindowUpdate::Unchanged;
        if Sn::gt(max, self.max) {
            self.max = max;
            result = WindowUpdate::Advanced;
        }
        if Sn::gt(exp, self.exp) {
            if Sn::gt(exp, self.next) {
                return WindowUpdate::AheadOfSent;
            }
            self.exp = exp;
            result = WindowUpdate::Advanced;
        }
        result
    }
}

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
pub struct OrderWindow<T> {
    exp: Sn,
    /// Last advertised MaxCmdSN.
    max: Sn,
    depth: u32,
    outstanding: u32,
    held: AHashMap<u32, T>,
}

impl<T> OrderWindow<T> {
    /// A window starting at `exp_cmd_sn` allowing `depth` (>= 1) outstanding commands.
    pub fn new(exp_cmd_sn: u32, depth: u32) -> Self {
        let depth = depth.max(1);
        OrderWindow {
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

    /// A task started occupying a queue slot (counted until [`OrderWindow::task_done`]).
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
mod credit_tests {
    use super::*;

    #[test]
    fn never_beyond_max_cmd_sn() {
        // Window [10, 13]: exactly four numbers, 10..=13, then closed.
        let mut w = CreditWindow::new(10, 13);
        assert_eq!(w.available(), 4);
        assert_eq!(w.take(), Some(10));
        assert_eq!(w.take(), Some(11));
        assert_eq!(w.take(), Some(12));
        assert_eq!(w.take(), Some(13));
        assert_eq!(w.take(), None);
        assert_eq!(w.available(), 0);
        assert_eq!(w.next_cmd_sn(), 14);
        // ExpCmdSN moving alone does not open it; MaxCmdSN does.
        assert_eq!(w.update(12, 13), WindowUpdate::Advanced);
        assert_eq!(w.take(), None);
        assert_eq!(w.update(12, 14), WindowUpdate::Advanced);
        assert_eq!(w.take(), Some(14));
        assert_eq!(w.take(), None);
    }

    #[test]
    fn zero_window_is_closed() {
        // MaxCmdSN = ExpCmdSN - 1 is a valid, empty window.
        let mut w = CreditWindow::new(100, 99);
        assert!(!w.can_send());
        assert_eq!(w.take(), None);
        assert_eq!(w.update(100, 100), WindowUpdate::Advanced);
        assert_eq!(w.take(), Some(100));
    }

    #[test]
    fn wraps_around_2_pow_32() {
        // Window [2^32-2, 1] serially contains 0xfffffffe, 0xffffffff, 0, 1.
        let mut w = CreditWindow::new(0xffff_fffe, 1);
        assert_eq!(w.available(), 4);
        let got: Vec<u32> = std::iter::from_fn(|| w.take()).collect();
        assert_eq!(got, vec![0xffff_fffe, 0xffff_ffff, 0, 1]);
        assert_eq!(w.next_cmd_sn(), 2);
        // A MaxCmdSN of 0xffffffff is now serially behind 1: ignored.
        assert_eq!(w.update(0xffff_ffff, 0xffff_ffff), WindowUpdate::Advanced);
        assert_eq!(w.max_cmd_sn(), 1);
        assert_eq!(w.exp_cmd_sn(), 0xffff_ffff);
        assert_eq!(w.update(2, 5), WindowUpdate::Advanced);
        assert_eq!(w.exp_cmd_sn(), 2);
        assert_eq!(w.available(), 4);
    }

    #[test]
    fn invalid_pairs_are_ignored() {
        let mut w = CreditWindow::new(50, 60);
        // max (40) < exp (50) - 1: both ignored, even though exp would advance.
        assert_eq!(w.update(50, 40), WindowUpdate::Invalid);
        // Same rule across the wrap: exp 1, max 0xfffffffe (= exp - 3).
        let mut v = CreditWindow::new(0xffff_fff0, 0xffff_fff8);
        assert_eq!(v.update(1, 0xffff_fffe), WindowUpdate::Invalid);
        assert_eq!(v.max_cmd_sn(), 0xffff_fff8);
        assert_eq!(w.max_cmd_sn(), 60);
    }

    #[test]
    fn stale_values_do_not_shrink_the_window() {
        let mut w = CreditWindow::new(1000, 1031);
        for _ in 0..8 {
            w.take();
        }
        assert_eq!(w.update(1004, 1040), WindowUpdate::Advanced);
        // A late PDU with older values (reordered across connections) changes nothing.
        assert_eq!(w.update(1002, 1033), WindowUpdate::Unchanged);
        assert_eq!((w.exp_cmd_sn(), w.max_cmd_sn()), (1004, 1040));
        assert_eq!(w.unacknowledged(), 4);
        assert_eq!(w.available(), 1040 - 1008 + 1);
    }

    #[test]
    fn exp_beyond_sent_is_refused() {
        let mut w = CreditWindow::new(7, 20);
        w.take(); // 7 sent; next is 8
        assert_eq!(w.update(9, 25), WindowUpdate::AheadOfSent);
        assert_eq!(w.exp_cmd_sn(), 7);
        assert_eq!(w.max_cmd_sn(), 25);
        assert_eq!(w.update(8, 25), WindowUpdate::Advanced);
    }

    #[test]
    fn property_never_sends_outside_window() {
        // Deterministic pseudo-random walk around the wrap; every taken CmdSN must satisfy
        // exp <= sn <= max at the moment it is taken.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let start = 0xffff_ff00u32;
        let mut w = CreditWindow::new(start, start.wrapping_add(3));
        let mut acked = start;
        for _ in 0..20_000 {
            if rnd() % 3 == 0 {
                let before = (w.exp_cmd_sn(), w.max_cmd_sn());
                if let Some(sn) = w.take() {
                    assert!(crate::serial::in_window(Sn(sn), Sn(before.0), Sn(before.1)));
                }
            } else {
                // The target acknowledges some of what was sent and grants a window of 0..8.
                let sent = Sn::diff(Sn(w.next_cmd_sn()), Sn(acked)) as u32;
                if sent > 0 {
                    acked = acked.wrapping_add((rnd() as u32) % (sent + 1));
                }
                let grant = (rnd() % 9) as u32;
                w.update(acked, acked.wrapping_add(grant).wrapping_sub(1));
            }
        }
        assert!(Sn::gt(Sn(w.next_cmd_sn()), Sn(start)));
    }
}

#[cfg(test)]
mod order_tests {
    use super::*;

    #[test]
    fn a_held_cmd_sn_is_not_taken_twice() {
        let mut w: OrderWindow<u32> = OrderWindow::new(10, 4);
        assert!(w.takes(11));
        assert_eq!(w.submit(11, 1), Submit::Held);
        assert!(!w.takes(11), "a duplicate of a held command");
        assert!(w.takes(10) && w.takes(12) && !w.takes(14));
    }

    #[test]
    fn take_next_only_in_order_and_without_held_commands() {
        let mut w: OrderWindow<u32> = OrderWindow::new(10, 4);
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
        let mut w: OrderWindow<u32> = OrderWindow::new(10, 4);
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
        let mut w: OrderWindow<&str> = OrderWindow::new(1, 8);
        assert_eq!(w.submit(3, "c"), Submit::Held);
        assert_eq!(w.submit(2, "b"), Submit::Held);
        assert_eq!(w.held(), 2);
        assert_eq!(w.submit(1, "a"), Submit::Deliver(vec!["a", "b", "c"]));
        assert_eq!(w.exp_cmd_sn(), 4);
        assert_eq!(w.held(), 0);
    }

    #[test]
    fn outstanding_tasks_limit_the_window() {
        let mut w: OrderWindow<u32> = OrderWindow::new(0, 2);
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
        let mut w: OrderWindow<u32> = OrderWindow::new(u32::MAX, 4);
        assert_eq!(w.max_cmd_sn(), 2);
        assert_eq!(w.submit(1, 1), Submit::Held);
        assert_eq!(w.submit(0, 0), Submit::Held);
        assert_eq!(w.submit(u32::MAX, 7), Submit::Deliver(vec![7, 0, 1]));
        assert_eq!(w.exp_cmd_sn(), 2);
    }
}
