//! A mirror member's health and the regions it missed, as one state machine.
//!
//! A member is active (it takes every change and serves reads), failed (no command goes to
//! it; the regions changed meanwhile are marked as missed) or resyncing (it came back: it takes
//! every change, and serves reads only of regions it did not miss, while those are copied to
//! it). Its state and its marks change together, under one lock, through the transitions
//! below; nothing reads the state in one place and acts on it in another:
//!
//! - a change decides once per member what to do with it ([`Health::plan`]): a member failed
//!   at that moment is marked as missing the change in the same step, any other is sent it;
//! - a member that did not take a change it was sent (gone, or it answered with an error
//!   while another took it) is failed and marked in one step ([`Health::missed`]);
//! - a resync ends only if the member is still resyncing and has no region left to copy
//!   ([`Health::finish_resync`]), so a failure during its last steps is never overwritten.
//!
//! So for every change that is acknowledged and every member, the member took the change or
//! its regions are marked as missed.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A member's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    Active,
    Failed,
    Resyncing,
}

impl State {
    fn code(self) -> u8 {
        match self {
            State::Active => 0,
            State::Failed => 1,
            State::Resyncing => 2,
        }
    }

    fn of(code: u8) -> State {
        match code {
            0 => State::Active,
            2 => State::Resyncing,
            _ => State::Failed,
        }
    }
}

/// What a change does with one member ([`Health::plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plan {
    /// Send it the change. `active`: it was active, so its taking the change counts as a copy.
    Send { active: bool },
    /// It is failed: the change's regions are marked as missed. `new`: a region was not marked
    /// before, so the record must be saved before the change is acknowledged.
    Skip { new: bool },
}

/// How a resync's end went ([`Health::finish_resync`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Finish {
    /// The member is active again.
    Active,
    /// Regions were marked meanwhile: copy them too.
    More,
    /// The member failed meanwhile: it stays failed.
    Failed,
}

/// Regions `first..=last` of a bitmap (grown to `words` words) are marked; true when one was
/// not. Shared by the members' marks and the volume's write-intent record.
pub(super) fn mark(bits: &mut Vec<u64>, first: u64, last: u64, words: usize) -> bool {
    if bits.len() < words {
        bits.resize(words, 0);
    }
    let mut new = false;
    for r in first..=last {
        if let Some(w) = bits.get_mut((r / 64) as usize) {
            new |= *w & (1 << (r % 64)) == 0;
            *w |= 1 << (r % 64);
        }
    }
    new
}

/// One member's state and the regions it missed (one bit each).
#[derive(Debug)]
pub(super) struct Health {
    /// Read without the lock (to choose a member to read from); written only under `dirty`'s.
    state: AtomicU8,
    dirty: Mutex<Vec<u64>>,
}

impl Health {
    pub(super) fn new(state: State) -> Health {
        Health {
            state: AtomicU8::new(state.code()),
            dirty: Mutex::new(Vec::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<u64>> {
        self.dirty.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, s: State) {
        self.state.store(s.code(), Ordering::Release);
    }

    pub(super) fn state(&self) -> State {
        State::of(self.state.load(Ordering::Acquire))
    }

    /// Decides what a change of regions `first..=last` does with this member: a failed member
    /// is marked as missing it (in the same step), any other is sent it.
    pub(super) fn plan(&self, first: u64, last: u64, words: usize) -> Plan {
        let mut bits = self.lock();
        match self.state() {
            State::Failed => Plan::Skip {
                new: mark(&mut bits, first, last, words),
            },
            s => Plan::Send {
                active: s == State::Active,
            },
        }
    }

    /// The member did not take a change of regions `first..=last` that it was sent: it is
    /// failed and the regions marked, in one step. Returns (it was not failed before, a region
    /// was not marked before).
    pub(super) fn missed(&self, first: u64, last: u64, words: usize) -> (bool, bool) {
        let mut bits = self.lock();
        let was = self.state();
        self.set(State::Failed);
        let new = mark(&mut bits, first, last, words);
        (was != State::Failed, new)
    }

    /// The member is gone (no particular change lost): no more commands go to it. True when
    /// it was not failed before.
    pub(super) fn fail(&self) -> bool {
        let _bits = self.lock();
        let was = self.state();
        self.set(State::Failed);
        was != State::Failed
    }

    /// A failed member is open again: it takes changes from now on and gets the regions it
    /// missed copied. False when it was not failed (nothing changes then).
    pub(super) fn begin_resync(&self) -> bool {
        let _bits = self.lock();
        if self.state() != State::Failed {
            return false;
        }
        self.set(State::Resyncing);
        true
    }

    /// At open, from the record: the member's missed regions, and an open member that missed
    /// some resyncs before it serves their reads.
    pub(super) fn load(&self, bits: Vec<u64>) {
        let mut b = self.lock();
        if bits.iter().any(|&w| w != 0) && self.state() == State::Active {
            self.set(State::Resyncing);
        }
        *b = bits;
    }

    /// The first region left to copy.
    pub(super) fn next_dirty(&self) -> Option<u64> {
        self.lock()
            .iter()
            .enumerate()
            .find(|(_, w)| **w != 0)
            .map(|(i, w)| i as u64 * 64 + u64::from(w.trailing_zeros()))
    }

    /// Region `r` was copied to the member (while no change to it was in flight).
    pub(super) fn copied(&self, r: u64) {
        if let Some(w) = self.lock().get_mut((r / 64) as usize) {
            *w &= !(1 << (r % 64));
        }
    }

    /// A resync found nothing left to copy: the member is active again, unless it failed
    /// meanwhile or regions were marked since it looked.
    pub(super) fn finish_resync(&self) -> Finish {
        let bits = self.lock();
        match self.state() {
            State::Failed => Finish::Failed,
            _ if bits.iter().any(|&w| w != 0) => Finish::More,
            _ => {
                self.set(State::Active);
                Finish::Active
            }
        }
    }

    /// Whether it holds every change to regions `first..=last`: an active member does, a
    /// resyncing one for the regions it did not miss, a failed one does not.
    pub(super) fn holds(&self, first: u64, last: u64) -> bool {
        match self.state() {
            State::Active => true,
            State::Failed => false,
            State::Resyncing => {
                // The state again under the lock, with the marks: it may have failed (and its
                // marks grown) or become active since the look above.
                let bits = self.lock();
                match self.state() {
                    State::Active => true,
                    State::Failed => false,
                    State::Resyncing => (first..=last).all(|r| {
                        bits.get((r / 64) as usize)
                            .is_none_or(|w| w & (1 << (r % 64)) == 0)
                    }),
                }
            }
        }
    }

    /// Regions marked as missed.
    pub(super) fn dirty_regions(&self) -> u64 {
        self.lock().iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// The marks, for the record.
    pub(super) fn bits(&self) -> Vec<u64> {
        self.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORDS: usize = 4;

    fn dirty(h: &Health) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some(r) = h.next_dirty() {
            out.push(r);
            h.copied(r);
        }
        out
    }

    /// The interleaving that lost a write: W plans while the member is active, another command
    /// fails the member, W's command on it then fails too (its session is gone). Planned once,
    /// W was sent; its failure marks the region, so the resync copies it. (Before: W looked
    /// at the state again after the failure, sent nothing, marked nothing, and was
    /// acknowledged with region 5 stale on the member.)
    #[test]
    fn a_change_planned_before_its_member_failed_is_marked_when_it_does_not_land() {
        let h = Health::new(State::Active);
        assert_eq!(h.plan(5, 5, WORDS), Plan::Send { active: true });
        assert!(h.fail(), "another command fails the member");
        // W's command on the member comes back with the session's failure.
        assert_eq!(h.missed(5, 5, WORDS), (false, true));
        assert!(h.begin_resync());
        assert!(!h.holds(5, 5));
        assert_eq!(dirty(&h), [5]);
        assert_eq!(h.finish_resync(), Finish::Active);
    }

    /// A change planned while the member is failed marks its regions in the same step; a member
    /// that comes back right after still has them to copy.
    #[test]
    fn a_change_that_skips_a_failed_member_marks_it_in_the_same_step() {
        let h = Health::new(State::Failed);
        assert_eq!(h.plan(1, 2, WORDS), Plan::Skip { new: true });
        assert_eq!(h.plan(2, 2, WORDS), Plan::Skip { new: false });
        assert!(h.begin_resync());
        // Changes now go to it.
        assert_eq!(h.plan(7, 7, WORDS), Plan::Send { active: false });
        assert!(h.holds(7, 7) && !h.holds(1, 1));
        assert_eq!(dirty(&h), [1, 2]);
    }

    /// A resync's end does not overwrite a failure that came during its last steps (a write
    /// that timed out on the member while the resync saved its record): the member stays
    /// failed, with the region marked. (Before: the resync stored "active" over it, and the
    /// member served reads of a region it missed.)
    #[test]
    fn a_resync_that_ends_after_its_member_failed_leaves_it_failed() {
        let h = Health::new(State::Failed);
        assert_eq!(h.plan(3, 3, WORDS), Plan::Skip { new: true });
        assert!(h.begin_resync());
        assert_eq!(dirty(&h), [3]);
        // Its record is being saved; meanwhile a write to region 9 times out on the member.
        assert_eq!(h.plan(9, 9, WORDS), Plan::Send { active: false });
        assert_eq!(h.missed(9, 9, WORDS), (true, true));
        assert_eq!(h.finish_resync(), Finish::Failed);
        assert_eq!(h.state(), State::Failed);
        assert!(!h.holds(9, 9));
        assert!(h.begin_resync());
        assert_eq!(dirty(&h), [9]);
        assert_eq!(h.finish_resync(), Finish::Active);
    }

    /// A member that answers a change with an error while another member took it is failed and
    /// marked: the two differ there until the region is copied. (Before: the user's write
    /// failed, and nothing recorded the difference.)
    #[test]
    fn a_task_error_on_one_member_is_recorded_as_a_difference() {
        let (a, b) = (Health::new(State::Active), Health::new(State::Active));
        assert_eq!(a.plan(4, 4, WORDS), Plan::Send { active: true });
        assert_eq!(b.plan(4, 4, WORDS), Plan::Send { active: true });
        // A took it; B answered CHECK CONDITION.
        assert_eq!(b.missed(4, 4, WORDS), (true, true));
        assert!(a.holds(4, 4) && !b.holds(4, 4));
        assert!(b.begin_resync());
        assert_eq!(dirty(&b), [4]);
    }

    /// Regions marked after the resync looked for the last time (its member failed and came
    /// back in between) make it go on rather than end.
    #[test]
    fn a_resync_goes_on_while_regions_are_left() {
        let h = Health::new(State::Resyncing);
        h.load(vec![1 << 6]);
        assert_eq!(h.finish_resync(), Finish::More);
        assert_eq!(dirty(&h), [6]);
        assert_eq!(h.finish_resync(), Finish::Active);
        assert!(!h.begin_resync(), "an active member does not resync");
    }

    /// A read's choice looks at a resyncing member, and before it reads the marks the member
    /// fails with another region marked: the choice must see the failure, not only that the
    /// region it reads is unmarked (before, it read the state once, outside the lock, and sent
    /// the read to a failed member).
    #[test]
    fn a_member_that_fails_while_a_read_looks_at_it_is_not_chosen() {
        use std::sync::Arc;
        let h = Arc::new(Health::new(State::Resyncing));
        let guard = h.lock();
        let looker = {
            let h = h.clone();
            std::thread::spawn(move || h.holds(5, 5))
        };
        // The looker has seen "resyncing" and waits for the marks.
        std::thread::sleep(std::time::Duration::from_millis(50));
        let mut guard = guard;
        mark(&mut guard, 9, 9, WORDS);
        h.set(State::Failed);
        drop(guard);
        assert!(
            !looker.join().unwrap(),
            "a failed member was chosen to read from"
        );
    }

    /// The state machine from many threads: changes, failures and resyncs in any order never
    /// leave an acknowledged change both unsent and unmarked, and never end a resync with a
    /// region left.
    #[test]
    fn no_interleaving_loses_a_change() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let h = Arc::new(Health::new(State::Active));
        let stop = Arc::new(AtomicBool::new(false));
        let failer = {
            let (h, stop) = (h.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    h.fail();
                    std::thread::yield_now();
                    if h.begin_resync() {
                        while let Some(r) = h.next_dirty() {
                            h.copied(r);
                        }
                        let _ = h.finish_resync();
                    }
                }
            })
        };
        for i in 0..20_000u64 {
            let r = i % 200;
            match h.plan(r, r, WORDS * 2) {
                // Sent: it lands when the member still lives at the end of the command, else
                // the command fails and marks it.
                Plan::Send { .. } => {
                    if h.state() == State::Failed {
                        h.missed(r, r, WORDS * 2);
                    }
                }
                Plan::Skip { .. } => {}
            }
            // An active member never has a region marked.
            let bits = h.dirty.lock().unwrap_or_else(|p| p.into_inner());
            if h.state() == State::Active {
                assert!(bits.iter().all(|&w| w == 0), "active with regions left");
            }
        }
        stop.store(true, Ordering::Relaxed);
        failer.join().unwrap();
    }
}
