//! ErrorRecoveryLevel 2 in the session core (RFC 7143 6.2, 7.1.5, 11.5.1): a connection that
//! fails leaves its tasks behind for DefaultTime2Retain instead of taking the session with it
//! ([`SessionCore::conn_failed`]); TASK REASSIGN on another connection of the session moves a
//! task there ([`SessionCore::reassign`]): a task still running or gathering its data goes on
//! there (a write asks again for what its R2Ts were owed), and one that ended meanwhile sends
//! its Data-In from the DataSN the initiator expects, then its status. Tasks nobody reassigns
//! in time are aborted ([`SessionCore::handle_timeout`]).

use super::{BudgetRoom, ConnLost, CoreConn, Grant, Key, SessionCore, SharedBudget};
use mcsi_proto::codes::tmf_response;
use mcsi_proto::pdu::Pdu;
use std::time::{Duration, Instant};

/// The final PDUs of a task that ended after its connection failed, until it is reassigned or
/// `until` passes. Their room in the server's retention budget goes back when this is dropped.
pub(super) struct Retained {
    cid: u16,
    until: Instant,
    pdus: Vec<Pdu>,
    _room: Option<BudgetRoom>,
}

/// What TASK REASSIGN did ([`SessionCore::reassign`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reassigned {
    /// The task goes on on the new connection.
    Moved,
    /// The task had ended: this many of its PDUs were sent again on the new connection.
    Resent(usize),
    /// Its connection is still in the session (11.5.1: "task still allegiant").
    StillAllegiant,
    /// No such task waits to be reassigned (never received, or aborted): the initiator issues
    /// it again as a new command.
    NoTask,
    /// The session is below ErrorRecoveryLevel 2.
    NotSupported,
    /// Its Data-In do not fit the new connection's MaxRecvDataSegmentLength.
    Refused,
}

/// "Task still allegiant" (11.5.2).
pub use mcsi_proto::codes::tmf_response::STILL_ALLEGIANT;
/// "Function rejected" (11.5.2).
pub const FUNCTION_REJECTED: u8 = 255;

impl Reassigned {
    /// The Task Management response code.
    pub fn response(self) -> u8 {
        match self {
            Reassigned::Moved | Reassigned::Resent(_) => tmf_response::COMPLETE,
            Reassigned::StillAllegiant => STILL_ALLEGIANT,
            Reassigned::NoTask => tmf_response::NO_TASK,
            Reassigned::NotSupported => tmf_response::REASSIGN_NOT_SUPPORTED,
            Reassigned::Refused => FUNCTION_REJECTED,
        }
    }
}

impl<C: CoreConn, T> SessionCore<C, T> {
    /// How long the tasks of a failed connection wait to be reassigned (the DefaultTime2Retain
    /// agreed); zero keeps nothing.
    pub fn set_time2retain(&mut self, d: Duration) {
        self.time2retain = d;
    }

    /// The server's budget for the answers of tasks that end after their connection failed
    /// (ErrorRecoveryLevel 2): each takes room for its PDUs until it is reassigned or its time
    /// runs out. An answer that finds no room is dropped, as if the task had been aborted with
    /// its connection (recovery at level 0 for that task: TASK REASSIGN finds no task and the
    /// initiator issues the command again). Without one, answers are kept without a bound.
    pub fn set_retention_budget(&mut self, budget: std::sync::Arc<dyn SharedBudget>) {
        self.retention_budget = Some(budget);
    }

    /// Answers dropped for want of room in the retention budget.
    pub fn retention_refused(&self) -> u64 {
        self.retention_refused
    }

    /// Answers kept for reassignment, and their bytes (data segments plus 48 per PDU).
    pub fn retained(&self) -> (usize, u64) {
        let bytes = self.retained.values().map(|r| pdus_bytes(&r.pdus)).sum();
        (self.retained.len(), bytes)
    }

    /// Tasks of failed connections wait to be reassigned: the session lives on even without
    /// connections until they have been reassigned or their time has run out.
    pub fn retaining(&self) -> bool {
        !self.failed.is_empty()
    }

    /// `conn` failed at `now`. From ErrorRecoveryLevel 2 on (with a DefaultTime2Retain above
    /// zero) its tasks stay for DefaultTime2Retain, waiting to be reassigned to another
    /// connection (those running run on, and their answers wait with them), commands it
    /// brought that wait for their turn are dropped (their CmdSNs stay used: the initiator
    /// issues them again), and the session goes on, even with no connection left. Below that,
    /// or when the connection left on purpose or was replaced, as [`SessionCore::conn_lost`].
    pub fn conn_failed(
        &mut self,
        conn: &C,
        now: Instant,
        on_abort: impl FnMut(&mut T),
    ) -> ConnLost {
        if self.erl < 2 || self.time2retain.is_zero() || self.closing || self.ends_cleanly(conn) {
            return self.conn_lost(conn, on_abort);
        }
        let cid = conn.cid();
        self.conns.remove(&cid);
        self.leaving.remove(&cid);
        self.keepalives.remove(&cid);
        self.orphan(cid, now);
        ConnLost {
            clean: false,
            remaining: self.conns.len(),
            session_ends: false,
        }
    }

    /// Connection `cid` failed and its tasks wait to be reassigned.
    pub fn failed_cid(&self, cid: u16) -> bool {
        self.failed.iter().any(|(c, _)| *c == cid)
    }

    /// Task `itt` of a failed connection waits here to be reassigned (running, or ended with
    /// its answer kept).
    pub fn awaits_reassign(&self, itt: u32) -> bool {
        self.tasks
            .get(&itt)
            .is_some_and(|t| t.orphaned && !t.aborted)
            || self.retained.contains_key(&itt)
    }

    /// A new login took over CID `cid` at `now` (connection reinstatement, RFC 7143 6.3.4):
    /// at ErrorRecoveryLevel 2 the tasks the old connection carried wait to be reassigned, as
    /// for a failure ([`SessionCore::conn_failed`]); below, nothing changes. Returns whether
    /// they wait.
    pub fn orphan_replaced(&mut self, cid: u16, now: Instant) -> bool {
        if self.erl < 2 || self.time2retain.is_zero() || self.closing {
            return false;
        }
        self.orphan(cid, now);
        true
    }

    /// The tasks and held commands of `cid` at `now`: the tasks wait to be reassigned until
    /// DefaultTime2Retain from now, the commands are dropped (their CmdSNs stay used). Tasks an
    /// earlier failure of the CID orphaned keep their own deadline: a peer that fails a CID
    /// again and again does not keep what the first failure left.
    fn orphan(&mut self, cid: u16, now: Instant) {
        self.abort_held(|r| r.cid == cid);
        let until = now + self.time2retain;
        for t in self
            .tasks
            .values_mut()
            .filter(|t| t.cid == cid && !t.aborted)
        {
            if !t.orphaned {
                t.orphaned = true;
                t.retain_until = Some(until);
            }
            if let Some(c) = t.collect.as_mut() {
                // The Data-Out timer waits for the task's new connection.
                c.watch = None;
            }
        }
        // Earlier failures of this CID that have nothing left waiting go; the others keep
        // their deadline. (So there are at most as many entries as deadlines still pending.)
        let (tasks, retained) = (&self.tasks, &self.retained);
        self.failed.retain(|&(c, d)| {
            c != cid
                || tasks
                    .values()
                    .any(|t| t.orphaned && t.cid == cid && t.retain_until == Some(d))
                || retained.values().any(|r| r.cid == cid && r.until == d)
        });
        self.failed.push((cid, until));
    }

    /// Keeps the final PDUs of orphaned task `itt` (its connection `cid` failed) until `until`,
    /// if the retention budget has room for them.
    pub(super) fn retain(&mut self, itt: u32, cid: u16, until: Instant, pdus: Vec<Pdu>) {
        let room = match &self.retention_budget {
            None => None,
            Some(b) => {
                let bytes = u32::try_from(pdus_bytes(&pdus)).unwrap_or(u32::MAX);
                match BudgetRoom::take(b, bytes) {
                    Some(s) => Some(s),
                    None => {
                        // The task is forgotten: as if aborted with its connection.
                        self.retention_refused += 1;
                        self.retained.remove(&itt);
                        return;
                    }
                }
            }
        };
        self.retained.insert(
            itt,
            Retained {
                cid,
                until,
                pdus,
                _room: room,
            },
        );
    }

    /// TASK REASSIGN of task `itt` to `conn` (RFC 7143 11.5.1), asked for by request
    /// `request_itt`; `exp_data_sn`: the first Data-In the initiator still needs. The Task
    /// Management response goes out first, through [`SessionCore::poll_transmit`], then what
    /// the task sends on its new connection: for a write still gathering its data, R2Ts for
    /// what it was owed (once it may ask); for a task that ended while orphaned, its Data-In
    /// from `exp_data_sn` and its status.
    pub fn reassign(
        &mut self,
        conn: &C,
        request_itt: u32,
        itt: u32,
        exp_data_sn: u32,
    ) -> Reassigned {
        let r = self.reassign_inner(conn, itt, exp_data_sn);
        let answer = crate::control::tmf_pdu(request_itt, r.0.response());
        self.transmit.push_back((conn.clone(), answer));
        for p in r.1 {
            self.transmit.push_back((conn.clone(), p));
        }
        if r.0 == Reassigned::Moved {
            self.after_move(conn, itt);
        }
        r.0
    }

    fn reassign_inner(&mut self, conn: &C, itt: u32, exp_data_sn: u32) -> (Reassigned, Vec<Pdu>) {
        if self.erl < 2 {
            return (Reassigned::NotSupported, Vec::new());
        }
        let cid = conn.cid();
        if let Some(t) = self.tasks.get_mut(&itt) {
            if t.aborted {
                return (Reassigned::NoTask, Vec::new());
            }
            if !t.orphaned {
                return (Reassigned::StillAllegiant, Vec::new());
            }
            t.orphaned = false;
            t.retain_until = None;
            t.cid = cid;
            t.reply_cid = cid;
            if let Some(c) = t.collect.as_mut() {
                c.transfer.reopen();
            }
            return (Reassigned::Moved, Vec::new());
        }
        let max = conn.max_data_in() as usize;
        match self.retained.get(&itt) {
            None => return (Reassigned::NoTask, Vec::new()),
            Some(r) if r.pdus.iter().any(|p| p.data_len() > max) => {
                return (Reassigned::Refused, Vec::new())
            }
            Some(_) => {}
        }
        let Some(r) = self.retained.remove(&itt) else {
            return (Reassigned::NoTask, Vec::new());
        };
        let pdus: Vec<Pdu> = r
            .pdus
            .into_iter()
            .filter(|p| match p {
                // The Data-In the initiator has already stay behind; the status always goes.
                Pdu::DataIn(d) => {
                    d.status.is_some()
                        || mcsi_proto::serial::Sn::ge(
                            mcsi_proto::serial::Sn(d.data_sn),
                            mcsi_proto::serial::Sn(exp_data_sn),
                        )
                }
                _ => true,
            })
            .collect();
        (Reassigned::Resent(pdus.len()), pdus)
    }

    /// A task moved to `conn`: a write asks for what it was owed there, at once when it may
    /// ask already, else once granted.
    fn after_move(&mut self, conn: &C, itt: u32) {
        let Some(t) = self.tasks.get(&itt) else {
            return;
        };
        let key = Key { id: t.id, itt };
        let Some(grant) = t.collect.as_ref().map(|c| c.grant) else {
            // Its turn came while it was orphaned: it runs now.
            if t.turn && !t.started {
                self.ready.push_back(key);
            }
            return;
        };
        if grant == Grant::Granted {
            self.send_r2ts(itt, conn);
        } else {
            self.ask_grant(key);
        }
    }

    /// Failures whose DefaultTime2Retain ran out by `now`: the tasks they orphaned that
    /// nobody reassigned are aborted and their kept answers dropped.
    pub(super) fn expire_failed(&mut self, now: Instant) {
        if !self.failed.iter().any(|(_, d)| *d <= now) {
            return;
        }
        self.failed.retain(|(_, d)| *d > now);
        let itts: Vec<u32> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.orphaned && t.retain_until.is_some_and(|u| u <= now))
            .map(|(itt, _)| *itt)
            .collect();
        if !itts.is_empty() {
            self.abort_where(|t| itts.contains(&t.itt), |_| ());
        }
        self.retained.retain(|_, r| r.until > now);
    }
}

/// What `pdus` hold: their data segments plus 48 bytes each.
fn pdus_bytes(pdus: &[Pdu]) -> u64 {
    pdus.iter()
        .map(|p| mcsi_proto::pdu::BHS_LEN as u64 + p.data_len() as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::super::{Answer, ConnRole, NewTask, NewWrite, RegisterOutcome};
    use super::*;
    use crate::transfer::{BurstParams, WriteTransfer};
    use bytes::Bytes;
    use mcsi_proto::pdu::{DataOut, ScsiCommand, TaskAttr, RESERVED_TAG};
    use mcsi_scsi::{DataPhase, Outcome, TaskAttribute};

    /// A connection by CID and generation (a CID logged in again is another connection).
    #[derive(Debug, Clone)]
    struct Tc(u16, u8);

    impl CoreConn for Tc {
        fn cid(&self) -> u16 {
            self.0
        }
        fn role(&self) -> ConnRole {
            ConnRole::Both
        }
        fn same(&self, o: &Self) -> bool {
            self.0 == o.0 && self.1 == o.1
        }
        fn max_data_in(&self) -> u32 {
            4096
        }
    }

    #[derive(Default)]
    struct Io {
        told_to_stop: bool,
    }

    type Core = SessionCore<Tc, Io>;

    const BURST: BurstParams = BurstParams {
        initial_r2t: true,
        immediate_data: true,
        first_burst_length: 4096,
        max_burst_length: 16384,
        max_outstanding_r2t: 1,
    };

    fn core(erl: u8) -> Core {
        let mut c = Core::new(1, 8, false, None);
        c.set_burst(BURST);
        c.set_error_recovery_level(erl);
        c.set_time2retain(Duration::from_secs(10));
        assert!(c.add_conn(Tc(1, 1)).is_ok());
        assert!(c.add_conn(Tc(2, 1)).is_ok());
        c
    }

    /// A READ(10) of `len` bytes, registered as a task on `on` in CmdSN order.
    fn read(c: &mut Core, on: &Tc, itt: u32, cmd_sn: u32, len: u32) {
        let cmd = ScsiCommand {
            immediate: false,
            final_: true,
            read: true,
            write: false,
            attr: TaskAttr::Simple,
            lun: 0,
            itt,
            expected_data_transfer_length: len,
            cmd_sn,
            exp_stat_sn: 0,
            cdb: Bytes::from_static(&[0x28, 0, 0, 0, 0, 0, 0, 0, 24, 0]),
            bidi_read_length: None,
            data: Bytes::new(),
        };
        let t = NewTask {
            id: u64::from(itt),
            itt,
            lun: 0,
            cmd_sn,
            immediate: false,
            attr: TaskAttribute::Simple,
            bytes: u64::from(len),
            answer: Some(Box::new(Answer {
                cmd,
                phase: DataPhase {
                    data_out_len: 0,
                    data_in_len: len,
                },
            })),
        };
        let (reg, _) = c.register(on, t, None, Io::default());
        assert_eq!(reg, RegisterOutcome::Ok);
    }

    /// A write of `len` bytes asked for by R2Ts, registered on `on`.
    fn write(c: &mut Core, on: &Tc, itt: u32, cmd_sn: u32, len: u32) {
        let t = NewTask {
            id: u64::from(itt),
            itt,
            lun: 0,
            cmd_sn,
            immediate: false,
            attr: TaskAttribute::Simple,
            bytes: u64::from(len),
            answer: None,
        };
        let w = NewWrite {
            transfer: WriteTransfer::new(BURST, len, len, 0, true).expect("a valid write"),
            immediate: Bytes::new(),
            first_burst_length: BURST.first_burst_length,
            refused: false,
            room: None,
        };
        let (reg, _) = c.register(on, t, Some(w), Io::default());
        assert_eq!(reg, RegisterOutcome::Ok);
    }

    /// What the core queued: (CID, PDU).
    fn sent(c: &mut Core) -> Vec<(u16, Pdu)> {
        std::iter::from_fn(|| c.poll_transmit())
            .map(|(c, p)| (c.0, p))
            .collect()
    }

    fn grant_all(c: &mut Core) {
        while let Some(g) = c.poll_grant() {
            let _ = c.grant(g.itt, g.id);
        }
    }

    fn data_out(
        itt: u32,
        ttt: u32,
        data_sn: u32,
        offset: u32,
        len: usize,
        final_: bool,
    ) -> DataOut {
        DataOut {
            final_,
            lun: 0,
            itt,
            ttt,
            exp_stat_sn: 0,
            data_sn,
            buffer_offset: offset,
            data: Bytes::from(vec![offset as u8; len]),
        }
    }

    /// At level 2 a failed connection's tasks wait: a read that ends meanwhile keeps its
    /// answer and sends it from the DataSN asked for on the connection it is reassigned to; a
    /// write asks there for what its R2T was owed; the session never ends.
    #[test]
    fn a_failed_connections_tasks_move_to_another_and_complete_there() {
        let t0 = Instant::now();
        let (a, b) = (Tc(1, 1), Tc(2, 1));
        let mut c = core(2);
        read(&mut c, &a, 1, 1, 12288);
        let r = c.poll_ready().expect("the read runs");
        assert_eq!(r.itt, 1);
        write(&mut c, &a, 2, 2, 16384);
        grant_all(&mut c);
        let r2t = match sent(&mut c).as_slice() {
            [(1, Pdu::R2t(r))] => r.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            (r2t.buffer_offset, r2t.desired_data_transfer_length),
            (0, 16384)
        );
        c.data_out(1, &data_out(2, r2t.ttt, 0, 0, 4096, false));

        let lost = c.conn_failed(&a, t0, |io| io.told_to_stop = true);
        assert!(!lost.session_ends && lost.remaining == 1);
        assert!(c.retaining());
        assert_eq!(c.poll_timeout(), Some(t0 + Duration::from_secs(10)));
        // The read ends while orphaned: nothing goes out, its answer waits.
        let data = Bytes::from((0..12288u32).map(|i| i as u8).collect::<Vec<_>>());
        assert!(c
            .finish(1, 1, &a, Some(Outcome::good(data.clone())))
            .is_some());
        assert!(sent(&mut c).is_empty());

        // Reassigned on B, the initiator having DataSN 0: the TMF response, then DataSN 1
        // and 2 (the last with status).
        assert_eq!(c.reassign(&b, 0x70, 1, 1), Reassigned::Resent(2));
        let out = sent(&mut c);
        assert!(out.iter().all(|(cid, _)| *cid == 2));
        let Pdu::TaskMgmtResponse(r) = &out[0].1 else {
            panic!("{out:?}")
        };
        assert_eq!((r.itt, r.response), (0x70, tmf_response::COMPLETE));
        let ins: Vec<(u32, u32, bool)> = out[1..]
            .iter()
            .map(|(_, p)| match p {
                Pdu::DataIn(d) => (d.data_sn, d.buffer_offset, d.status.is_some()),
                p => panic!("{p:?}"),
            })
            .collect();
        assert_eq!(ins, [(1, 4096, false), (2, 8192, true)]);
        // Asked again: it is not there any more.
        assert_eq!(c.reassign(&b, 0x71, 1, 0), Reassigned::NoTask);
        assert!(matches!(&sent(&mut c)[..], [(2, Pdu::TaskMgmtResponse(r))] if r.response == 1));

        // The write moves: an R2T on B for the 12 KiB its first one was still owed.
        assert_eq!(c.reassign(&b, 0x72, 2, 0), Reassigned::Moved);
        let out = sent(&mut c);
        assert!(
            matches!(&out[0], (2, Pdu::TaskMgmtResponse(r)) if r.response == 0),
            "{out:?}"
        );
        let again = match &out[1..] {
            [(2, Pdu::R2t(r))] => r.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            (again.buffer_offset, again.desired_data_transfer_length),
            (4096, 12288)
        );
        assert_ne!(again.ttt, r2t.ttt);
        c.data_out(2, &data_out(2, again.ttt, 0, 4096, 12288, true));
        let r = c.poll_ready().expect("the write has all of its data");
        assert_eq!((r.itt, r.conn.0, r.data.len()), (2, 2, 16384));
        assert_eq!(&r.data[..4096], &[0u8; 4096][..]);
        // A task whose connection lives is not reassigned; one never received does not exist.
        read(&mut c, &b, 3, 3, 512);
        assert_eq!(c.reassign(&b, 0x73, 3, 0), Reassigned::StillAllegiant);
        assert_eq!(c.reassign(&b, 0x74, 99, 0), Reassigned::NoTask);
        let codes: Vec<u8> = sent(&mut c)
            .iter()
            .filter_map(|(_, p)| match p {
                Pdu::TaskMgmtResponse(r) => Some(r.response),
                _ => None,
            })
            .collect();
        assert_eq!(codes, [STILL_ALLEGIANT, tmf_response::NO_TASK]);
        let _ = RESERVED_TAG;
    }

    /// A read already running when its connection failed, moved before it ends: its Data-In
    /// and status leave on the connection it moved to, not the failed one it was started from.
    #[test]
    fn a_running_task_that_moved_answers_on_its_new_connection() {
        let t0 = Instant::now();
        let (a, b) = (Tc(1, 1), Tc(2, 1));
        let mut c = core(2);
        read(&mut c, &a, 1, 1, 8192);
        let r = c.poll_ready().expect("the read runs");
        assert_eq!((r.itt, r.conn.0), (1, 1));
        let lost = c.conn_failed(&a, t0, |_| ());
        assert!(!lost.session_ends);
        assert_eq!(c.reassign(&b, 0x70, 1, 0), Reassigned::Moved);
        assert!(matches!(&sent(&mut c)[..], [(2, Pdu::TaskMgmtResponse(r))] if r.response == 0));
        // The read ends on the runner that was given connection A.
        let data = Bytes::from(vec![7u8; 8192]);
        let f = c
            .finish(1, 1, &a, Some(Outcome::good(data)))
            .expect("it ends");
        assert_eq!(f.out.0, 2);
        let out = sent(&mut c);
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(out
            .iter()
            .all(|(cid, p)| *cid == 2 && matches!(p, Pdu::DataIn(_))));
    }

    /// Tasks nobody reassigns within DefaultTime2Retain are aborted, and their kept answers
    /// dropped; a read whose turn came while orphaned runs once reassigned.
    #[test]
    fn what_nobody_reassigns_in_time_is_aborted() {
        let t0 = Instant::now();
        let (a, b) = (Tc(1, 1), Tc(2, 1));
        let mut c = core(2);
        read(&mut c, &a, 1, 1, 4096);
        assert_eq!(c.poll_ready().map(|r| r.itt), Some(1));
        // A read that came on A ahead of CmdSN 2, which has not come yet.
        read(&mut c, &a, 2, 3, 4096);
        c.conn_failed(&a, t0, |_| ());
        assert!(c
            .finish(1, 1, &a, Some(Outcome::good(Bytes::from(vec![1; 4096]))))
            .is_some());
        // CmdSN 2 comes on B: both turns come, but the orphaned read waits for its new
        // connection.
        read(&mut c, &b, 5, 2, 4096);
        assert_eq!(c.poll_ready().map(|r| r.itt), Some(5));
        assert!(
            c.poll_ready().is_none(),
            "orphaned: it waits for its new connection"
        );
        let early = c.handle_timeout(t0 + Duration::from_secs(5));
        assert!(early.is_empty() && c.retaining());
        assert_eq!(c.reassign(&b, 0x80, 2, 0), Reassigned::Moved);
        assert_eq!(c.poll_ready().map(|r| (r.itt, r.conn.0)), Some((2, 2)));
        c.handle_timeout(t0 + Duration::from_secs(10));
        assert!(!c.retaining());
        assert_eq!(c.reassign(&b, 0x81, 1, 0), Reassigned::NoTask);
        // Task 2 was reassigned in time and is not touched.
        assert!(c.task(2).is_some_and(|t| !t.aborted));
    }

    /// Below level 2 a failed connection takes the session, and TASK REASSIGN is answered
    /// "not supported".
    #[test]
    fn below_level_2_a_failed_connection_ends_the_session() {
        let t0 = Instant::now();
        let (a, b) = (Tc(1, 1), Tc(2, 1));
        let mut c = core(1);
        read(&mut c, &a, 1, 1, 4096);
        let lost = c.conn_failed(&a, t0, |_| ());
        assert!(lost.session_ends);
        assert!(!c.retaining());
        assert_eq!(c.reassign(&b, 0x90, 1, 0), Reassigned::NotSupported);
        assert_eq!(Reassigned::NotSupported.response(), 4);
    }

    /// A CID that fails again (a peer that resets and reinstates it over and over) does not
    /// push back the deadline of what its first failure left: the first failure's tasks are
    /// aborted and its kept answers dropped DefaultTime2Retain after that failure.
    #[test]
    fn a_cid_that_fails_again_does_not_keep_what_its_first_failure_left() {
        let t0 = Instant::now();
        let (a, b) = (Tc(1, 1), Tc(2, 1));
        let mut c = core(2);
        read(&mut c, &a, 1, 1, 4096);
        read(&mut c, &a, 2, 2, 4096);
        assert_eq!(c.poll_ready().map(|r| r.itt), Some(1));
        assert_eq!(c.poll_ready().map(|r| r.itt), Some(2));
        c.conn_failed(&a, t0, |_| ());
        // Task 2 ends while orphaned: its answer is kept.
        assert!(c
            .finish(2, 2, &a, Some(Outcome::good(Bytes::from(vec![2; 4096]))))
            .is_some());
        assert_eq!(c.retained().0, 1);
        // CID 1 logs in again and fails again 8 s later, carrying a new read.
        let a2 = Tc(1, 2);
        assert!(c.add_conn(a2.clone()).is_ok());
        read(&mut c, &a2, 3, 3, 4096);
        assert_eq!(c.poll_ready().map(|r| r.itt), Some(3));
        c.conn_failed(&a2, t0 + Duration::from_secs(8), |_| ());
        assert_eq!(c.poll_timeout(), Some(t0 + Duration::from_secs(10)));
        // 10 s after the first failure: what it left is gone, what the second left is not.
        let _ = c.handle_timeout(t0 + Duration::from_millis(10_500));
        assert!(
            !c.awaits_reassign(1),
            "task 1 outlived its DefaultTime2Retain"
        );
        assert!(
            !c.awaits_reassign(2),
            "task 2's answer outlived its DefaultTime2Retain"
        );
        assert_eq!(c.retained(), (0, 0));
        assert!(c.awaits_reassign(3));
        assert!(c.retaining());
        assert_eq!(c.poll_timeout(), Some(t0 + Duration::from_secs(18)));
        assert_eq!(c.reassign(&b, 0x70, 1, 0), Reassigned::NoTask);
        assert_eq!(c.reassign(&b, 0x71, 3, 0), Reassigned::Moved);
        let _ = c.handle_timeout(t0 + Duration::from_secs(19));
        assert!(!c.retaining());
    }

    /// A byte-exact budget for the tests.
    struct Room(std::sync::atomic::AtomicU64);

    impl SharedBudget for Room {
        fn try_take(&self, bytes: u32) -> bool {
            use std::sync::atomic::Ordering::SeqCst;
            self.0
                .fetch_update(SeqCst, SeqCst, |l| l.checked_sub(u64::from(bytes)))
                .is_ok()
        }
        fn give_back(&self, bytes: u32) {
            self.0
                .fetch_add(u64::from(bytes), std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Answers kept for reassignment take room in the server's retention budget: one that
    /// finds none is dropped (TASK REASSIGN then finds no task, and the initiator issues the
    /// command again), and the room comes back when the kept answer is sent or expires.
    #[test]
    fn answers_kept_for_reassignment_are_held_to_the_retention_budget() {
        use std::sync::atomic::Ordering::SeqCst;
        let t0 = Instant::now();
        let (a, b) = (Tc(1, 1), Tc(2, 1));
        let room = std::sync::Arc::new(Room(std::sync::atomic::AtomicU64::new(10_000)));
        let mut c = core(2);
        c.set_retention_budget(room.clone());
        for itt in 1..=3 {
            read(&mut c, &a, itt, itt, 8192);
            assert_eq!(c.poll_ready().map(|r| r.itt), Some(itt));
        }
        c.conn_failed(&a, t0, |_| ());
        let good = || Some(Outcome::good(Bytes::from(vec![9; 8192])));
        assert!(c.finish(1, 1, &a, good()).is_some());
        // Two Data-In of 4 KiB (the connection's MaxRecvDataSegmentLength), 48 bytes each.
        assert_eq!(c.retained(), (1, 8192 + 96));
        assert_eq!(room.0.load(SeqCst), 10_000 - 8288);
        assert!(c.finish(2, 2, &a, good()).is_some());
        assert_eq!(c.retention_refused(), 1);
        assert_eq!(c.retained(), (1, 8288));
        assert!(!c.awaits_reassign(2));
        assert_eq!(c.reassign(&b, 0x70, 2, 0), Reassigned::NoTask);
        assert_eq!(c.reassign(&b, 0x71, 1, 0), Reassigned::Resent(2));
        assert_eq!(room.0.load(SeqCst), 10_000, "the room came back");
        // The third fits now, and its room comes back when its time runs out.
        assert!(c.finish(3, 3, &a, good()).is_some());
        assert_eq!(room.0.load(SeqCst), 10_000 - 8288);
        let _ = c.handle_timeout(t0 + Duration::from_secs(11));
        assert_eq!(c.retained(), (0, 0));
        assert_eq!(room.0.load(SeqCst), 10_000);
    }
}
