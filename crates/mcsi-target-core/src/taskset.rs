//! Task attribute ordering within a task set (SAM-5 8.6, RFC 7143 section 4.2.2.1 hands commands
//! to SCSI in CmdSN order). Tasks enter in delivery order:
//!
//! - HEAD OF QUEUE runs at once;
//! - ORDERED runs once every task that entered before it has ended;
//! - SIMPLE (and untagged / ACA, which mcsi treats as SIMPLE) runs once no ORDERED task that
//!   entered before it is still pending.

use mcsi_scsi::TaskAttribute;
use std::collections::VecDeque;

#[derive(Debug)]
struct Entry<K> {
    key: K,
    attr: TaskAttribute,
    running: bool,
}

/// One task set: keys identify tasks (the session uses ITTs).
#[derive(Debug)]
pub struct TaskSet<K> {
    entries: VecDeque<Entry<K>>,
    /// SIMPLE tasks running without an entry (executed on a connection's reader as they
    /// arrive): an ORDERED task waits for them too.
    inline: u32,
}

impl<K> Default for TaskSet<K> {
    fn default() -> Self {
        TaskSet {
            entries: VecDeque::new(),
            inline: 0,
        }
    }
}

impl<K: PartialEq + Clone> TaskSet<K> {
    #[cfg(test)]
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether a SIMPLE task entering now would run at once (no ORDERED task pending).
    pub fn admits_simple(&self) -> bool {
        !self
            .entries
            .iter()
            .any(|e| e.attr == TaskAttribute::Ordered)
    }

    /// A SIMPLE task that runs at once without an entry (see [`TaskSet::admits_simple`]).
    pub fn enter_inline(&mut self) {
        self.inline += 1;
    }

    /// An inline task ended; returns the tasks that may run now.
    pub fn leave_inline(&mut self) -> Vec<K> {
        self.inline = self.inline.saturating_sub(1);
        self.ready_now()
    }

    /// Adds a task; returns whether it may run now.
    pub fn enter(&mut self, key: K, attr: TaskAttribute) -> bool {
        let ready = match attr {
            TaskAttribute::HeadOfQueue => true,
            TaskAttribute::Ordered => self.entries.is_empty() && self.inline == 0,
            TaskAttribute::Simple | TaskAttribute::Aca => !self
                .entries
                .iter()
                .any(|e| e.attr == TaskAttribute::Ordered),
        };
        self.entries.push_back(Entry {
            key,
            attr,
            running: ready,
        });
        ready
    }

    /// Removes an ended (or aborted) task; returns the tasks that may run now.
    pub fn leave(&mut self, key: &K) -> Vec<K> {
        if let Some(pos) = self.entries.iter().position(|e| &e.key == key) {
            self.entries.remove(pos);
        }
        self.ready_now()
    }

    /// Marks and returns the waiting tasks whose turn has come.
    fn ready_now(&mut self) -> Vec<K> {
        let mut ready = Vec::new();
        let mut before_any = self.inline > 0;
        let mut before_ordered = false;
        for e in self.entries.iter_mut() {
            if !e.running {
                let can = match e.attr {
                    TaskAttribute::HeadOfQueue => true,
                    TaskAttribute::Ordered => !before_any,
                    TaskAttribute::Simple | TaskAttribute::Aca => !before_ordered,
                };
                if can {
                    e.running = true;
                    ready.push(e.key.clone());
                }
            }
            before_any = true;
            if e.attr == TaskAttribute::Ordered {
                before_ordered = true;
            }
        }
        ready
    }

    /// No task in the set, running or waiting, and no inline one.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.inline == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TaskAttribute::*;

    #[test]
    fn admits_simple_unless_an_ordered_task_is_pending() {
        let mut t = TaskSet::new();
        assert!(t.admits_simple());
        t.enter(1, Simple);
        t.enter(2, HeadOfQueue);
        assert!(t.admits_simple());
        t.enter(3, Ordered);
        assert!(!t.admits_simple());
        t.leave(&1);
        t.leave(&2);
        // The ORDERED task now runs; it still blocks SIMPLE tasks until it ends.
        assert!(!t.admits_simple());
        t.leave(&3);
        assert!(t.admits_simple());
    }

    #[test]
    fn ordered_waits_for_inline_simple_tasks() {
        let mut t = TaskSet::new();
        t.enter_inline();
        t.enter_inline();
        assert!(!t.is_empty());
        // An ORDERED task behind two running inline SIMPLE tasks waits for both.
        assert!(!t.enter(1, Ordered));
        assert!(!t.admits_simple());
        assert_eq!(t.leave_inline(), Vec::<i32>::new());
        assert_eq!(t.leave_inline(), vec![1]);
        assert_eq!(t.leave(&1), Vec::<i32>::new());
        assert!(t.is_empty());
        // HEAD OF QUEUE does not wait for them.
        t.enter_inline();
        assert!(t.enter(2, HeadOfQueue));
    }

    #[test]
    fn simple_tasks_run_in_parallel() {
        let mut t = TaskSet::new();
        assert!(t.enter(1, Simple));
        assert!(t.enter(2, Simple));
        assert!(t.enter(3, Simple));
        assert_eq!(t.leave(&2), Vec::<i32>::new());
    }

    #[test]
    fn ordered_waits_for_earlier_and_blocks_later() {
        let mut t = TaskSet::new();
        assert!(t.enter(1, Simple));
        assert!(t.enter(2, Simple));
        assert!(!t.enter(3, Ordered));
        assert!(!t.enter(4, Simple));
        assert!(t.enter(5, HeadOfQueue));
        assert_eq!(t.leave(&1), Vec::<i32>::new());
        assert_eq!(t.leave(&5), Vec::<i32>::new());
        // Task 2 ending leaves the ORDERED task first in line.
        assert_eq!(t.leave(&2), vec![3]);
        // Only once it ends may the SIMPLE task behind it run.
        assert_eq!(t.leave(&3), vec![4]);
        assert_eq!(t.leave(&4), Vec::<i32>::new());
        assert!(t.is_empty());
    }

    #[test]
    fn consecutive_ordered_tasks_run_one_at_a_time() {
        let mut t = TaskSet::new();
        assert!(t.enter('a', Ordered));
        assert!(!t.enter('b', Ordered));
        assert!(!t.enter('c', Simple));
        assert!(!t.enter('d', Simple));
        assert_eq!(t.leave(&'a'), vec!['b']);
        assert_eq!(t.leave(&'b'), vec!['c', 'd']);
    }

    #[test]
    fn aborting_a_waiting_task_removes_it() {
        let mut t = TaskSet::new();
        assert!(t.enter(1, Simple));
        assert!(!t.enter(2, Ordered));
        assert!(!t.enter(3, Simple));
        // With the ORDERED task gone nothing holds the SIMPLE one back.
        assert_eq!(t.leave(&2), vec![3]);
        assert_eq!(t.leave(&1), Vec::<i32>::new());
    }
}
