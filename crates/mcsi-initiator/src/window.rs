//! The session's command window (RFC 7143 4.2.2.1), sans-IO.
//!
//! A non-immediate command takes the next CmdSN and may go out only while that number lies in
//! `[ExpCmdSN, MaxCmdSN]`. Immediate PDUs carry the next CmdSN without taking it. All
//! comparisons are serial (RFC 1982), so the window works across the 2^32 wrap.

use mcsi_proto::serial::Sn;

/// What [`CmdWindow::update`] did with a target's ExpCmdSN/MaxCmdSN pair.
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
pub struct CmdWindow {
    next: Sn,
    exp: Sn,
    max: Sn,
}

impl CmdWindow {
    /// The window as the final login response leaves it: the target expects `exp_cmd_sn` next
    /// and accepts up to `max_cmd_sn`. The leading login's CmdSN is what the target expects, so
    /// the next command takes `exp_cmd_sn`.
    pub fn new(exp_cmd_sn: u32, max_cmd_sn: u32) -> CmdWindow {
        CmdWindow {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_beyond_max_cmd_sn() {
        // Window [10, 13]: exactly four numbers, 10..=13, then closed.
        let mut w = CmdWindow::new(10, 13);
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
        let mut w = CmdWindow::new(100, 99);
        assert!(!w.can_send());
        assert_eq!(w.take(), None);
        assert_eq!(w.update(100, 100), WindowUpdate::Advanced);
        assert_eq!(w.take(), Some(100));
    }

    #[test]
    fn wraps_around_2_pow_32() {
        // Window [2^32-2, 1] serially contains 0xfffffffe, 0xffffffff, 0, 1.
        let mut w = CmdWindow::new(0xffff_fffe, 1);
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
        let mut w = CmdWindow::new(50, 60);
        // max (40) < exp (50) - 1: both ignored, even though exp would advance.
        assert_eq!(w.update(50, 40), WindowUpdate::Invalid);
        // Same rule across the wrap: exp 1, max 0xfffffffe (= exp - 3).
        let mut v = CmdWindow::new(0xffff_fff0, 0xffff_fff8);
        assert_eq!(v.update(1, 0xffff_fffe), WindowUpdate::Invalid);
        assert_eq!(v.max_cmd_sn(), 0xffff_fff8);
        assert_eq!(w.max_cmd_sn(), 60);
    }

    #[test]
    fn stale_values_do_not_shrink_the_window() {
        let mut w = CmdWindow::new(1000, 1031);
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
        let mut w = CmdWindow::new(7, 20);
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
        let mut w = CmdWindow::new(start, start.wrapping_add(3));
        let mut acked = start;
        for _ in 0..20_000 {
            if rnd() % 3 == 0 {
                let before = (w.exp_cmd_sn(), w.max_cmd_sn());
                if let Some(sn) = w.take() {
                    assert!(mcsi_proto::serial::in_window(
                        Sn(sn),
                        Sn(before.0),
                        Sn(before.1)
                    ));
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
