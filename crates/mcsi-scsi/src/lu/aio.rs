//! The asynchronous device path: a command split into [`LogicalUnit::prepare`] (CDB, ranges,
//! unit attentions, reservations), backend operations that complete through a callback
//! ([`crate::AsyncBackend`]), and [`Pending::finish`] (status and sense). It serves READ, WRITE,
//! WRITE AND VERIFY, SYNCHRONIZE CACHE and COMPARE AND WRITE on a backend that has an
//! asynchronous interface; every other command, and these on any other backend, stay on
//! [`LogicalUnit::execute`].
//!
//! A write holds its blocks in the unit's range locks from `prepare` until its data is written,
//! as on the synchronous path, so COMPARE AND WRITE, ORWRITE and WRITE ATOMIC stay atomic with
//! respect to it. `prepare` only tries the lock: when an overlapping write holds it, the
//! command goes to the synchronous path, which waits for it on a thread of its own. Nothing of
//! the command has been done then.

use super::{op, rw_fields, Cdb, LogicalUnit, Planned, WritePlan};
use crate::backend::{AioCompletion, AioDone, AioOp, BackendError};
use crate::{Command, Outcome};
use bytes::Bytes;
use std::io;
use std::sync::Arc;

/// What [`LogicalUnit::prepare`] made of a command.
pub enum Prepared {
    /// It ended without backend I/O: an error, a unit attention, nothing to move.
    Done(Outcome),
    /// Backend I/O to submit ([`Pending::submit`]), then [`Pending::finish`].
    Io(Pending),
    /// Not for the asynchronous path: run it with [`LogicalUnit::execute`] (on a blocking pool
    /// where [`LogicalUnit::needs_thread`] says so). Nothing of it has been done.
    Sync,
}

/// What a finished backend operation leads to.
pub enum Step {
    /// The command's outcome.
    Done(Outcome),
    /// Another operation (the flush after a FUA write).
    Next(Pending),
    /// The rest has to wait on a lock: run this on a thread that may block. Only a READ that
    /// overlapped a WRITE ATOMIC in time comes here, to read again with its blocks held.
    Blocking(Box<dyn FnOnce() -> Outcome + Send>),
}

/// What the command does with its operation's result (the operation itself says where and
/// how much).
#[derive(Debug, Clone, Copy)]
enum Then {
    Read {
        unread: u32,
        /// WRITE ATOMICs under way and started when the read was prepared.
        atomic: (usize, u64),
    },
    Write {
        flush: bool,
    },
    Flush,
    CompareAndWrite {
        flush: bool,
    },
}

/// A command's backend operation, prepared or in flight. A write's blocks stay held until its
/// operation completes: dropping a `Pending` not yet submitted lets them go at once; once
/// submitted, the completion does, even if the `Pending` is dropped meanwhile.
pub struct Pending {
    lu: Arc<LogicalUnit>,
    op: AioOp,
    then: Then,
    /// The bytes this write holds in the unit's range locks, until it is submitted.
    held: Option<Held>,
}

/// Bytes held in a unit's range locks, let go when dropped.
struct Held {
    lu: Arc<LogicalUnit>,
    range: (u64, u64),
}

impl Drop for Held {
    fn drop(&mut self) {
        self.lu.ranges.unlock(self.range);
    }
}

impl Pending {
    /// Starts the operation; `done` gets its result, possibly on another thread, possibly
    /// before this returns. The write's blocks are let go when it completes, before `done`.
    pub fn submit(&mut self, done: AioCompletion) {
        let done: AioCompletion = match self.held.take() {
            Some(held) => Box::new(move |r| {
                drop(held);
                done(r)
            }),
            None => done,
        };
        match self.lu.backend.aio() {
            Some(a) => a.submit(self.op.clone(), done),
            None => done(Err(BackendError::Io {
                op: "submit",
                offset: 0,
                cause: io::Error::other("the backend has no asynchronous path"),
            })),
        }
    }

    /// Ends the command with the operation's result, or goes on to the next one.
    pub fn finish(mut self, r: Result<AioDone, BackendError>) -> Step {
        let lu = self.lu.clone();
        // Submitted, the blocks went with the completion; never submitted, they go now.
        self.held = None;
        let write = !matches!(self.then, Then::Read { .. });
        let r = match r {
            Ok(d) => d,
            Err(e) => return Step::Done(lu.outcome(Err(lu.medium_error(e, write)))),
        };
        match (self.then, &self.op, r) {
            (Then::Read { unread, atomic }, &AioOp::Read { offset, len }, AioDone::Read(buf))
                if buf.len() == len =>
            {
                if atomic.0 != 0 || lu.atomic_snapshot() != atomic {
                    // A WRITE ATOMIC ran meanwhile and may have been half done when read.
                    return Step::Blocking(Box::new(move || {
                        let r = lu.read_locked(offset, len).map(|b| {
                            let mut o = Outcome::good(b);
                            o.data_in_unread = unread;
                            o
                        });
                        lu.outcome(r)
                    }));
                }
                let mut o = Outcome::good(buf);
                o.data_in_unread = unread;
                Step::Done(o)
            }
            (Then::Write { flush } | Then::CompareAndWrite { flush }, _, AioDone::Done) => {
                if flush {
                    Step::Next(Pending {
                        lu,
                        op: AioOp::Flush,
                        then: Then::Flush,
                        held: None,
                    })
                } else {
                    Step::Done(Outcome::good(Bytes::new()))
                }
            }
            (Then::Flush, _, AioDone::Done) => Step::Done(Outcome::good(Bytes::new())),
            (Then::CompareAndWrite { .. }, _, AioDone::Miscompare { at }) => {
                Step::Done(lu.outcome(Err(super::miscompare(at))))
            }
            (then, _, got) => {
                let e = BackendError::Io {
                    op: "complete",
                    offset: 0,
                    cause: io::Error::other(format!("{got:?} does not answer {then:?}")),
                };
                Step::Done(lu.outcome(Err(lu.medium_error(e, write))))
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Read,
    Write,
    SyncCache,
    CompareAndWrite,
}

impl LogicalUnit {
    /// Which asynchronous operation the command is, None when it is not for that path (or the
    /// backend has none).
    pub(super) fn aio_kind(&self, c: &Cdb) -> Option<Kind> {
        self.backend.aio()?;
        Some(match c.op() {
            op::READ_6 | op::READ_10 | op::READ_12 | op::READ_16 => Kind::Read,
            op::WRITE_6
            | op::WRITE_10
            | op::WRITE_12
            | op::WRITE_16
            | op::WRITE_VERIFY_10
            | op::WRITE_VERIFY_12
            | op::WRITE_VERIFY_16 => Kind::Write,
            op::SYNCHRONIZE_CACHE_10 | op::SYNCHRONIZE_CACHE_16 => Kind::SyncCache,
            op::COMPARE_AND_WRITE => Kind::CompareAndWrite,
            _ => return None,
        })
    }

    /// The bytes a write's CDB names, None when they overflow.
    fn cdb_bytes(&self, c: &Cdb) -> Option<(u64, u64)> {
        let r = rw_fields(c)?;
        let off = r.lba.checked_mul(self.block_size)?;
        let len = r.nlb.checked_mul(self.block_size)?;
        Some((off, off.checked_add(len)?))
    }

    /// The first half of a command on the asynchronous path: its checks, and the backend
    /// operation it needs.
    pub fn prepare(self: &Arc<Self>, cmd: &Command<'_>) -> Prepared {
        if self.backend.aio().is_none() {
            return Prepared::Sync;
        }
        let c = Cdb::new(cmd.cdb);
        let Some(kind) = self.aio_kind(&c) else {
            return Prepared::Sync;
        };
        let mut held = None;
        if matches!(kind, Kind::Write | Kind::CompareAndWrite) {
            let Some((start, end)) = self.cdb_bytes(&c) else {
                return Prepared::Sync;
            };
            let aio = self.backend.aio();
            if kind == Kind::CompareAndWrite
                && !aio.is_some_and(|a| a.compare_and_write_ok(start, end - start))
            {
                return Prepared::Sync;
            }
            if start < end {
                if !self.ranges.try_lock(start, end) {
                    return Prepared::Sync;
                }
                held = Some(Held {
                    lu: self.clone(),
                    range: (start, end),
                });
            }
        }
        // From here on the blocks (if any) are let go whenever `held` is dropped.
        if let Some(o) = self.admit(cmd, &c) {
            return Prepared::Done(o);
        }
        let planned = match kind {
            Kind::Read => self.read_plan(cmd, &c).map(|r| match r {
                Planned::Done(o) => Err(o),
                Planned::Read { off, len, unread } => Ok((
                    AioOp::Read { offset: off, len },
                    Then::Read {
                        unread,
                        atomic: self.atomic_snapshot(),
                    },
                )),
            }),
            Kind::Write => self.write_plan(cmd, &c).map(|w| match w {
                None => Err(Outcome::good(Bytes::new())),
                Some(WritePlan {
                    off, len, flush, ..
                }) => Ok((
                    AioOp::Write {
                        offset: off,
                        data: cmd.data_out.slice(..len),
                    },
                    Then::Write { flush },
                )),
            }),
            Kind::SyncCache => self
                .sync_cache_plan(&c)
                .map(|()| Ok((AioOp::Flush, Then::Flush))),
            Kind::CompareAndWrite => self.caw_plan(cmd, &c).map(|w| match w {
                None => Err(Outcome::good(Bytes::new())),
                Some((off, n, flush)) => Ok((
                    AioOp::CompareAndWrite {
                        offset: off,
                        compare: cmd.data_out.slice(..n),
                        data: cmd.data_out.slice(n..2 * n),
                    },
                    Then::CompareAndWrite { flush },
                )),
            }),
        };
        match planned {
            Err(fail) => Prepared::Done(self.outcome(Err(fail))),
            Ok(Err(o)) => Prepared::Done(o),
            Ok(Ok((op, then))) => Prepared::Io(Pending {
                lu: self.clone(),
                op,
                then,
                held,
            }),
        }
    }
}
