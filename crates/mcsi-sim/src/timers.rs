//! Timers by key, one per key: setting a key's time again replaces what it had. A heap of
//! (time, key) whose stale entries (no longer the key's time) are dropped when they reach the
//! top, so that the top is always live. The hosts' sockets, the target's sessions and the
//! loop's initiators each keep theirs here, so that an event asks only what is due.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

pub struct Timers<T> {
    at: Vec<Option<T>>,
    heap: BinaryHeap<Reverse<(T, usize)>>,
}

impl<T: Ord + Copy> Timers<T> {
    pub fn new() -> Timers<T> {
        Timers {
            at: Vec::new(),
            heap: BinaryHeap::new(),
        }
    }

    /// Key `k`'s time is now `t` (None: no timer).
    pub fn set(&mut self, k: usize, t: Option<T>) {
        if self.at.len() <= k {
            self.at.resize(k + 1, None);
        }
        if self.at[k] != t {
            self.at[k] = t;
            if let Some(t) = t {
                self.heap.push(Reverse((t, k)));
            }
        }
        self.settle();
    }

    /// The earliest time of any key.
    pub fn next(&self) -> Option<T> {
        self.heap.peek().map(|r| r.0 .0)
    }

    /// Takes the keys due at `now` (their timers cleared) into `into`, in key order.
    pub fn pop_due(&mut self, now: T, into: &mut Vec<usize>) {
        let from = into.len();
        while let Some(&Reverse((t, k))) = self.heap.peek() {
            if t > now {
                break;
            }
            self.heap.pop();
            if self.at[k] == Some(t) {
                self.at[k] = None;
                into.push(k);
            }
        }
        into[from..].sort_unstable();
        self.settle();
    }

    fn settle(&mut self) {
        while let Some(&Reverse((t, k))) = self.heap.peek() {
            if self.at[k] == Some(t) {
                break;
            }
            self.heap.pop();
        }
    }
}

impl<T: Ord + Copy> Default for Timers<T> {
    fn default() -> Self {
        Timers::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_holds_one_time_and_due_keys_come_in_key_order() {
        let mut t = Timers::new();
        t.set(2, Some(5));
        t.set(0, Some(9));
        t.set(1, Some(5));
        t.set(2, Some(20));
        assert_eq!(t.next(), Some(5));
        let mut due = Vec::new();
        t.pop_due(10, &mut due);
        assert_eq!(due, [0, 1]);
        assert_eq!(t.next(), Some(20));
        t.set(2, None);
        assert_eq!(t.next(), None);
    }
}
