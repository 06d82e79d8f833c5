//! What the target does with requests other than SCSI commands (RFC 7143): NOP-Out (11.18),
//! Logout (11.14) and Task Management (11.5, with the semantics of 4.2.3). Each request becomes
//! a plan: an answer to send at once, or tasks to abort before the answer. Which tasks, in what
//! scope and with which answer is decided here; task management within one session is carried
//! out here too ([`task_management`]: the core aborts and answers once the aborted tasks have
//! ended). Resetting devices, and what spans the target's sessions, is the layer above's.

use crate::session::{Close, CoreConn, InOrder, SessionCore, TaskRef};
use mcsi_proto::pdu::{
    reject_reason, LogoutRequest, LogoutResponse, NopIn, NopOut, Pdu, TaskMgmtRequest,
    TaskMgmtResponse, RESERVED_TAG,
};
use mcsi_proto::serial::Sn;

pub use mcsi_proto::codes::{logout_response, tmf_function, tmf_response};

/// What a NOP-Out asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Nop {
    /// The answer to the target's ping with this TTT (11.18: ITT reserved, TTT the ping's).
    PingAnswered { ttt: u32 },
    /// A ping from the initiator: echo this NOP-In.
    Echo(Pdu),
    /// Nothing to answer (ITT reserved, no TTT: the initiator only confirms ExpStatSN).
    Nothing,
}

/// The TTT of the target's ping a NOP-Out answers (ITT reserved, TTT set, 11.18), if it is one.
pub fn answers_ping(n: &NopOut) -> Option<u32> {
    (n.itt == RESERVED_TAG && n.ttt != RESERVED_TAG).then_some(n.ttt)
}

/// A NOP-Out: an answer to our ping, or a ping (ITT set) echoed with its data (11.19), cut to
/// `max_data` (the initiator's MaxRecvDataSegmentLength).
pub fn nop_out(n: NopOut, max_data: u32) -> Nop {
    if let Some(ttt) = answers_ping(&n) {
        return Nop::PingAnswered { ttt };
    }
    if n.itt == RESERVED_TAG {
        return Nop::Nothing;
    }
    let mut data = n.data;
    data.truncate(max_data as usize);
    Nop::Echo(Pdu::NopIn(NopIn {
        lun: n.lun,
        itt: n.itt,
        ttt: RESERVED_TAG,
        stat_sn: 0,
        exp_cmd_sn: 0,
        max_cmd_sn: 0,
        data,
    }))
}

/// What a Logout Request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logout {
    /// Reason 0: every connection of the session logs out (a clean exit), every task is
    /// aborted, and once they ended the response (0) goes out and the connections close.
    CloseSession,
    /// Reason 1 for a connection of the session (this one or another): it logs out, its tasks
    /// are aborted, and once they ended the response (0) goes out on the requesting
    /// connection and the named one closes.
    CloseConnection { cid: u16 },
    /// Answer at once with this response code ([`logout_response`]): 1 for a CID the session
    /// does not have, 2 for reason 2 (removing a connection for recovery needs
    /// ErrorRecoveryLevel 2, 11.15.1).
    Respond(u8),
    /// A reason code RFC 7143 does not define: Reject (invalid PDU field).
    Reject,
}

impl Logout {
    /// The plan for a Logout Request with `reason` and `cid`; `has_conn` says whether the
    /// session has a connection with that CID.
    pub fn plan(reason: u8, cid: u16, has_conn: impl FnOnce(u16) -> bool) -> Logout {
        match reason {
            0 => Logout::CloseSession,
            1 if has_conn(cid) => Logout::CloseConnection { cid },
            1 => Logout::Respond(logout_response::CID_NOT_FOUND),
            2 => Logout::Respond(logout_response::RECOVERY_NOT_SUPPORTED),
            _ => Logout::Reject,
        }
    }

    /// Whether a task is aborted by this logout.
    pub fn aborts(&self, task: &TaskRef) -> bool {
        match self {
            Logout::CloseSession => true,
            Logout::CloseConnection { cid } => task.cid == *cid,
            Logout::Respond(_) | Logout::Reject => false,
        }
    }
}

/// An immediate Logout Request while [`crate::session::MAX_PARKED_IMMEDIATE`] answers wait
/// already: the caller rejects it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// Logout Request `l` on `conn` (11.14): the connections that log out leave (picked for no new
/// replies, their end clean), the tasks the plan names are aborted (`on_abort` tells a running
/// one to stop), and once those that were running have ended the answer goes out on `conn`
/// through [`SessionCore::poll_transmit`], then the connections close
/// ([`SessionCore::poll_close`]): `conn` once its answer is sent, when it leaves, and another
/// one named now. Returns the plan, for the log.
pub fn logout<C: CoreConn, T>(
    core: &mut SessionCore<C, T>,
    conn: &C,
    l: &LogoutRequest,
    on_abort: impl FnMut(&mut T),
) -> Result<Logout, Busy> {
    // The connection named is looked up once: the plan and the connection that leaves are the
    // same one.
    let named = core.conn(l.cid).cloned();
    let plan = Logout::plan(l.reason, l.cid, |_| named.is_some());
    let leaving: Vec<C> = match plan {
        Logout::CloseSession => core.conns().cloned().collect(),
        Logout::CloseConnection { .. } => named.into_iter().collect(),
        Logout::Respond(code) => {
            let answer = logout_pdu(l.itt, code);
            core.answer_when_ended(conn, answer, |_| false, false, l.immediate, Vec::new());
            return Ok(plan);
        }
        Logout::Reject => {
            let answer = Pdu::reject_of(
                reject_reason::INVALID_PDU_FIELD,
                &Pdu::LogoutRequest(l.clone()),
            );
            core.answer_when_ended(conn, answer, |_| false, false, l.immediate, Vec::new());
            return Ok(plan);
        }
    };
    if !core.answer_room(l.immediate) {
        return Err(Busy);
    }
    for c in &leaving {
        core.leave(c);
    }
    core.abort_where(|t| plan.aborts(t), on_abort);
    let mut then = Vec::new();
    if plan == Logout::CloseSession || leaving.iter().any(|c| c.same(conn)) {
        then.push((conn.clone(), Close::AfterFlush));
    }
    then.extend(
        leaving
            .into_iter()
            .filter(|c| !c.same(conn))
            .map(|c| (c, Close::Now)),
    );
    let answer = logout_pdu(l.itt, logout_response::CLOSED);
    core.answer_when_ended(conn, answer, |t| plan.aborts(t), false, l.immediate, then);
    Ok(plan)
}

/// A Logout Response; the sequence numbers are stamped when it is sent.
pub fn logout_pdu(itt: u32, response: u8) -> Pdu {
    Pdu::LogoutResponse(LogoutResponse {
        response,
        itt,
        stat_sn: 0,
        exp_cmd_sn: 0,
        max_cmd_sn: 0,
        time2wait: 0,
        time2retain: 0,
    })
}

/// What is reset once a TMF's tasks have ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reset {
    Nothing,
    /// The LU's state (reservations, unit attention for the other nexuses).
    Lun(u64),
    /// Every LU of the target.
    Target,
    /// Every LU of the target, then every session of the target is closed once the answer is
    /// out (TARGET COLD RESET, RFC 7143 11.5.1).
    TargetCold,
}

/// What a Task Management request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tmf {
    /// Answer at once with this response code ([`tmf_response`]).
    Respond(u8),
    /// ABORT TASK: the task with this ITT on this LUN is aborted (answer 0 once it ended). If
    /// the session has no such task, one whose RefCmdSN lies in the window before this request
    /// is taken as received (its CmdSN used up) and answered 0; otherwise "no task" (11.5.1).
    AbortTask {
        itt: u32,
        lun: u64,
        ref_cmd_sn: u32,
        cmd_sn: u32,
    },
    /// ABORT TASK SET: this session's tasks on the LUN that came before the request in CmdSN
    /// order (4.2.3.2).
    AbortTaskSet { lun: u64, before: u32 },
    /// CLEAR TASK SET, LOGICAL UNIT RESET, TARGET WARM RESET, TARGET COLD RESET: the tasks of
    /// every session of the target on the LUN (`None`: on every LUN) are aborted, as the task
    /// set is shared by all initiators of the LU (SAM-5 7.5); then `reset`.
    AbortOnTarget { lun: Option<u64>, reset: Reset },
    /// TASK REASSIGN: the task with this ITT moves to the connection the request came on
    /// (ErrorRecoveryLevel 2, [`SessionCore::reassign`]); `exp_data_sn`: the first Data-In
    /// the initiator still needs.
    Reassign { itt: u32, exp_data_sn: u32 },
}

impl Tmf {
    /// The plan for a request; `lun_exists` says whether the target has the request's LUN.
    pub fn plan(t: &TaskMgmtRequest, lun_exists: bool) -> Tmf {
        use tmf_function::*;
        match t.function {
            ABORT_TASK => Tmf::AbortTask {
                itt: t.referenced_task_tag,
                lun: t.lun,
                ref_cmd_sn: t.ref_cmd_sn,
                cmd_sn: t.cmd_sn,
            },
            ABORT_TASK_SET | CLEAR_TASK_SET | LUN_RESET if !lun_exists => {
                Tmf::Respond(tmf_response::NO_LUN)
            }
            ABORT_TASK_SET => Tmf::AbortTaskSet {
                lun: t.lun,
                before: t.cmd_sn,
            },
            CLEAR_TASK_SET => Tmf::AbortOnTarget {
                lun: Some(t.lun),
                reset: Reset::Nothing,
            },
            LUN_RESET => Tmf::AbortOnTarget {
                lun: Some(t.lun),
                reset: Reset::Lun(t.lun),
            },
            TARGET_WARM_RESET => Tmf::AbortOnTarget {
                lun: None,
                reset: Reset::Target,
            },
            TARGET_COLD_RESET => Tmf::AbortOnTarget {
                lun: None,
                reset: Reset::TargetCold,
            },
            TASK_REASSIGN => Tmf::Reassign {
                itt: t.referenced_task_tag,
                exp_data_sn: t.exp_data_sn,
            },
            _ => Tmf::Respond(tmf_response::NOT_SUPPORTED),
        }
    }

    /// Whether a task of the requesting session is aborted by this request (for
    /// [`Tmf::AbortOnTarget`], also whether a task of another session of the target is).
    pub fn aborts(&self, task: &TaskRef) -> bool {
        match *self {
            Tmf::Respond(_) | Tmf::Reassign { .. } => false,
            Tmf::AbortTask { itt, lun, .. } => task.itt == itt && task.lun == lun,
            Tmf::AbortTaskSet { lun, before } => {
                task.lun == lun && Sn::lt(Sn(task.cmd_sn), Sn(before))
            }
            Tmf::AbortOnTarget { lun, .. } => lun.is_none_or(|l| l == task.lun),
        }
    }

    /// Whether the request changes what every initiator of the LU sees (a reset): worth a log
    /// line above debug.
    pub fn is_reset(function: u8) -> bool {
        use tmf_function::*;
        matches!(function, LUN_RESET | TARGET_WARM_RESET | TARGET_COLD_RESET)
    }
}

/// What [`task_management`] did with a request.
pub enum TmfStep<C> {
    /// Its answer is out, or waits in the core for the tasks it aborted to end
    /// ([`SessionCore::answer_when_ended`]); `runs` came up in CmdSN order meanwhile (ABORT TASK
    /// of a command never received takes its CmdSN as received), for the caller to run.
    Answered { response: u8, runs: InOrder<C> },
    /// ABORT TASK found no task while inline commands run (one may be the task, its status
    /// about to go out): once none runs, the caller takes the referenced CmdSN as received
    /// ([`SessionCore::take_as_received`]) and answers.
    AfterInline { ref_cmd_sn: u32, cmd_sn: u32 },
    /// It reaches the target's other sessions (and resets): the caller's.
    OnTarget,
    /// An immediate request while [`crate::session::MAX_PARKED_IMMEDIATE`] answers wait
    /// already: the caller rejects it.
    Busy,
}

/// Task management `plan` (request `itt` on `conn`, `immediate` or in CmdSN order) within one
/// session: tasks are aborted (`on_abort` tells a running one to stop) and the answer goes out
/// through [`SessionCore::poll_transmit`] once those that were running have ended. ABORT TASK
/// answers "function complete" for a task found, or for one never received whose RefCmdSN
/// lies in the window before the request (its CmdSN is taken as received), and "task does not
/// exist" otherwise (11.5.1); ABORT TASK SET also waits for the session's inline commands.
pub fn task_management<C: CoreConn, T>(
    core: &mut SessionCore<C, T>,
    conn: &C,
    itt: u32,
    plan: &Tmf,
    immediate: bool,
    on_abort: impl FnMut(&mut T),
) -> TmfStep<C> {
    let after_inline = match *plan {
        Tmf::Respond(code) => {
            core.answer_when_ended(
                conn,
                tmf_pdu(itt, code),
                |_| false,
                false,
                immediate,
                Vec::new(),
            );
            return TmfStep::Answered {
                response: code,
                runs: Vec::new(),
            };
        }
        Tmf::AbortOnTarget { .. } => return TmfStep::OnTarget,
        Tmf::Reassign {
            itt: task,
            exp_data_sn,
        } => {
            let r = core.reassign(conn, itt, task, exp_data_sn);
            return TmfStep::Answered {
                response: r.response(),
                runs: Vec::new(),
            };
        }
        Tmf::AbortTask { .. } => false,
        Tmf::AbortTaskSet { .. } => true,
    };
    if !core.answer_room(immediate) {
        return TmfStep::Busy;
    }
    let found = core.abort_where(|t| plan.aborts(t), on_abort);
    let mut runs = Vec::new();
    if let Tmf::AbortTask {
        ref_cmd_sn, cmd_sn, ..
    } = *plan
    {
        if found == 0 {
            if core.inline_running() > 0 {
                return TmfStep::AfterInline { ref_cmd_sn, cmd_sn };
            }
            let Some(r) = core.take_as_received(ref_cmd_sn, cmd_sn) else {
                core.answer_when_ended(
                    conn,
                    tmf_pdu(itt, tmf_response::NO_TASK),
                    |_| false,
                    false,
                    immediate,
                    Vec::new(),
                );
                return TmfStep::Answered {
                    response: tmf_response::NO_TASK,
                    runs,
                };
            };
            runs = r;
        }
    }
    core.answer_when_ended(
        conn,
        tmf_pdu(itt, tmf_response::COMPLETE),
        |t| plan.aborts(t),
        after_inline,
        immediate,
        Vec::new(),
    );
    TmfStep::Answered {
        response: tmf_response::COMPLETE,
        runs,
    }
}

/// A Task Management Function Response; the sequence numbers are stamped when it is sent.
pub fn tmf_pdu(itt: u32, response: u8) -> Pdu {
    Pdu::TaskMgmtResponse(TaskMgmtResponse {
        response,
        itt,
        stat_sn: 0,
        exp_cmd_sn: 0,
        max_cmd_sn: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::Turn;
    use bytes::Bytes;
    use tmf_function::*;

    /// A connection of the tests below.
    #[derive(Debug, Clone)]
    struct Tc(u16);

    impl CoreConn for Tc {
        fn cid(&self) -> u16 {
            self.0
        }
        fn role(&self) -> mcsi_proto::vendor::ConnRole {
            mcsi_proto::vendor::ConnRole::Both
        }
        fn same(&self, other: &Self) -> bool {
            self.0 == other.0
        }
        fn max_data_in(&self) -> u32 {
            8192
        }
    }

    #[derive(Default)]
    struct Io {
        aborted: bool,
    }

    /// Registers a SIMPLE task in CmdSN order on LUN 0 and hands it out to run.
    fn start(core: &mut SessionCore<Tc, Io>, on: &Tc, itt: u32, cmd_sn: u32) {
        let t = crate::session::NewTask {
            id: u64::from(itt) + 1000,
            itt,
            lun: 0,
            cmd_sn,
            immediate: false,
            attr: mcsi_scsi::TaskAttribute::Simple,
            bytes: 0,
            answer: None,
        };
        let (reg, _) = core.register(on, t, None, Io::default());
        assert_eq!(reg, crate::session::Register::Ok);
        assert_eq!(core.poll_ready().map(|r| r.itt), Some(itt), "it runs");
    }

    /// Logout in the core: the connection named leaves, its running task is aborted, and the
    /// answer, then the closes, come once it has ended.
    #[test]
    fn a_logout_answers_once_its_aborted_tasks_have_ended_then_closes() {
        use crate::session::Close;
        let (a, b) = (Tc(1), Tc(2));
        let mut core: SessionCore<Tc, Io> = SessionCore::new(1, 8, false, None);
        assert!(core.add_conn(a.clone()).is_ok());
        assert!(core.add_conn(b.clone()).is_ok());
        start(&mut core, &b, 1, 1);
        let request = |itt: u32, reason: u8, cid: u16| LogoutRequest {
            immediate: true,
            reason,
            itt,
            cid,
            cmd_sn: 2,
            exp_stat_sn: 0,
        };
        let mut told = 0;
        let plan = logout(&mut core, &a, &request(50, 1, 2), |io: &mut Io| {
            io.aborted = true;
            told += 1;
        });
        assert_eq!(plan, Ok(Logout::CloseConnection { cid: 2 }));
        assert_eq!(told, 1);
        assert!(core.poll_transmit().is_none(), "the task still runs");
        assert!(core.poll_close().is_none());
        let id = core.task(1).expect("running").id;
        assert!(core.finish(1, id, &b, None).expect("ended").aborted);
        let (on, answer) = core.poll_transmit().expect("answered");
        assert_eq!(on.0, 1);
        assert!(
            matches!(answer, Pdu::LogoutResponse(r) if r.itt == 50 && r.response == logout_response::CLOSED)
        );
        let (closed, how) = core.poll_close().expect("closes");
        assert_eq!((closed.0, how), (2, Close::Now));
        assert!(core.ends_cleanly(&b), "its end is a logout");
        assert!(
            !core.take_nexus_ended(),
            "connection 1 stays: the nexus too"
        );
        // A CID the session does not have, then the whole session with nothing running.
        assert_eq!(
            logout(&mut core, &a, &request(51, 1, 9), |_| {}),
            Ok(Logout::Respond(logout_response::CID_NOT_FOUND))
        );
        assert!(
            matches!(core.poll_transmit(), Some((_, Pdu::LogoutResponse(r))) if r.response == logout_response::CID_NOT_FOUND)
        );
        assert_eq!(
            logout(&mut core, &a, &request(52, 0, 1), |_| {}),
            Ok(Logout::CloseSession)
        );
        assert!(
            core.take_nexus_ended(),
            "the session's end is answered: the nexus ends"
        );
        assert!(!core.take_nexus_ended(), "once");
        assert!(matches!(core.poll_transmit(), Some((_, Pdu::LogoutResponse(r))) if r.itt == 52));
        let closes: Vec<(u16, Close)> = std::iter::from_fn(|| core.poll_close())
            .map(|(c, h)| (c.0, h))
            .collect();
        assert!(closes.contains(&(1, Close::AfterFlush)), "{closes:?}");
    }

    /// Task management within the session: the answer to ABORT TASK of a running task waits
    /// for its end, ABORT TASK SET also for the inline commands, and immediate requests whose
    /// answers wait are bounded.
    #[test]
    fn task_management_answers_once_the_aborted_tasks_have_ended() {
        let (a, b) = (Tc(1), Tc(2));
        let mut core: SessionCore<Tc, Io> = SessionCore::new(1, 8, false, None);
        assert!(core.add_conn(a.clone()).is_ok());
        assert!(core.add_conn(b.clone()).is_ok());
        start(&mut core, &a, 1, 1);

        let answers = |core: &mut SessionCore<Tc, Io>| -> Vec<(u32, u8)> {
            std::iter::from_fn(|| core.poll_transmit())
                .filter_map(|(_, p)| match p {
                    Pdu::TaskMgmtResponse(r) => Some((r.itt, r.response)),
                    _ => None,
                })
                .collect()
        };
        let abort_1 = Tmf::AbortTask {
            itt: 1,
            lun: 0,
            ref_cmd_sn: 1,
            cmd_sn: 2,
        };
        let mut told = 0;
        let step = task_management(&mut core, &a, 100, &abort_1, true, |io: &mut Io| {
            io.aborted = true;
            told += 1;
        });
        assert!(matches!(
            step,
            TmfStep::Answered {
                response: tmf_response::COMPLETE,
                ..
            }
        ));
        assert_eq!(told, 1);
        assert!(answers(&mut core).is_empty(), "the task still runs");
        let id = core.task(1).expect("running").id;
        let f = core.finish(1, id, &a, None).expect("ended");
        assert!(f.aborted);
        assert_eq!(answers(&mut core), vec![(100, tmf_response::COMPLETE)]);
        // Not found, nothing inline: its CmdSN (5, never received) is taken as received.
        let abort_5 = Tmf::AbortTask {
            itt: 5,
            lun: 0,
            ref_cmd_sn: 2,
            cmd_sn: 3,
        };
        let step = task_management(&mut core, &a, 101, &abort_5, true, |_| {});
        assert!(matches!(
            step,
            TmfStep::Answered {
                response: tmf_response::COMPLETE,
                ..
            }
        ));
        assert_eq!(answers(&mut core), vec![(101, tmf_response::COMPLETE)]);
        // ABORT TASK SET while a command runs inline: its answer waits for it.
        let Turn::Now(claim) = core.claim(7, 0, 3, false) else {
            panic!("runs now")
        };
        assert!(claim.tracked);
        let set = Tmf::AbortTaskSet { lun: 0, before: 9 };
        let step = task_management(&mut core, &b, 102, &set, true, |_| {});
        assert!(matches!(step, TmfStep::Answered { .. }));
        assert!(answers(&mut core).is_empty());
        // Meanwhile ABORT TASK of a task not found must wait for the inline command too.
        let step = task_management(&mut core, &b, 103, &abort_5, true, |_| {});
        assert!(matches!(
            step,
            TmfStep::AfterInline {
                ref_cmd_sn: 2,
                cmd_sn: 3
            }
        ));
        core.release_inline(0);
        assert_eq!(answers(&mut core), vec![(102, tmf_response::COMPLETE)]);
        // Immediate answers that wait are bounded.
        start(&mut core, &a, 8, 4);
        let abort_8 = Tmf::AbortTask {
            itt: 8,
            lun: 0,
            ref_cmd_sn: 4,
            cmd_sn: 5,
        };
        for i in 0..crate::session::MAX_PARKED_IMMEDIATE as u32 {
            let step = task_management(&mut core, &a, 200 + i, &abort_8, true, |_| {});
            assert!(matches!(step, TmfStep::Answered { .. }));
        }
        let step = task_management(&mut core, &a, 300, &abort_8, true, |_| {});
        assert!(matches!(step, TmfStep::Busy));
        let step = task_management(&mut core, &a, 301, &abort_8, false, |_| {});
        assert!(
            matches!(step, TmfStep::Answered { .. }),
            "in CmdSN order: bounded by the window"
        );
        let id = core.task(8).expect("running").id;
        core.finish(8, id, &a, None);
        assert_eq!(
            answers(&mut core).len(),
            crate::session::MAX_PARKED_IMMEDIATE + 1
        );
    }

    fn task(itt: u32, cid: u16, lun: u64, cmd_sn: u32) -> TaskRef {
        TaskRef {
            itt,
            cid,
            lun,
            cmd_sn,
        }
    }

    fn tmf(function: u8, lun: u64, referenced: u32, cmd_sn: u32) -> TaskMgmtRequest {
        TaskMgmtRequest {
            immediate: true,
            function,
            lun,
            itt: 0x99,
            referenced_task_tag: referenced,
            cmd_sn,
            exp_stat_sn: 0,
            ref_cmd_sn: 0,
            exp_data_sn: 0,
        }
    }

    #[test]
    fn nop_out_pings_are_echoed_within_the_initiators_segment_length() {
        let ping = NopOut {
            immediate: true,
            lun: 0,
            itt: 5,
            ttt: RESERVED_TAG,
            cmd_sn: 0,
            exp_stat_sn: 0,
            data: Bytes::from(vec![7u8; 1000]),
        };
        match nop_out(ping.clone(), 512) {
            Nop::Echo(Pdu::NopIn(n)) => {
                assert_eq!((n.itt, n.ttt, n.data.len()), (5, RESERVED_TAG, 512));
            }
            other => panic!("expected an echo, got {other:?}"),
        }
        let answer = NopOut {
            itt: RESERVED_TAG,
            ttt: 0x44,
            ..ping.clone()
        };
        assert_eq!(nop_out(answer, 512), Nop::PingAnswered { ttt: 0x44 });
        let quiet = NopOut {
            itt: RESERVED_TAG,
            ..ping
        };
        assert_eq!(nop_out(quiet, 512), Nop::Nothing);
    }

    #[test]
    fn logout_reasons_and_the_tasks_they_abort() {
        let known = |cid| cid == 1 || cid == 2;
        assert_eq!(Logout::plan(0, 9, known), Logout::CloseSession);
        assert_eq!(
            Logout::plan(1, 2, known),
            Logout::CloseConnection { cid: 2 }
        );
        assert_eq!(
            Logout::plan(1, 3, known),
            Logout::Respond(logout_response::CID_NOT_FOUND)
        );
        assert_eq!(
            Logout::plan(2, 1, known),
            Logout::Respond(logout_response::RECOVERY_NOT_SUPPORTED)
        );
        assert_eq!(Logout::plan(3, 1, known), Logout::Reject);
        let on1 = task(1, 1, 0, 10);
        let on2 = task(2, 2, 0, 11);
        assert!(Logout::CloseSession.aborts(&on1) && Logout::CloseSession.aborts(&on2));
        let close2 = Logout::CloseConnection { cid: 2 };
        assert!(!close2.aborts(&on1) && close2.aborts(&on2));
    }

    #[test]
    fn task_management_scopes() {
        // ABORT TASK: that ITT on that LUN only.
        let p = Tmf::plan(&tmf(ABORT_TASK, 1, 0x10, 20), true);
        assert!(p.aborts(&task(0x10, 1, 1, 5)));
        assert!(!p.aborts(&task(0x10, 1, 2, 5)) && !p.aborts(&task(0x11, 1, 1, 5)));
        // ABORT TASK SET: the LUN's tasks before the request in CmdSN order, across the
        // wrap of serial numbers.
        let p = Tmf::plan(&tmf(ABORT_TASK_SET, 1, 0, 3), true);
        assert!(p.aborts(&task(1, 1, 1, 2)) && p.aborts(&task(2, 2, 1, u32::MAX)));
        assert!(!p.aborts(&task(3, 1, 1, 3)) && !p.aborts(&task(4, 1, 1, 4)));
        assert!(!p.aborts(&task(5, 1, 0, 2)));
        // The shared task set: every session's tasks on the LUN, then what is reset.
        let p = Tmf::plan(&tmf(LUN_RESET, 1, 0, 3), true);
        assert_eq!(
            p,
            Tmf::AbortOnTarget {
                lun: Some(1),
                reset: Reset::Lun(1)
            }
        );
        assert!(p.aborts(&task(1, 1, 1, 9)) && !p.aborts(&task(1, 1, 0, 9)));
        let p = Tmf::plan(&tmf(TARGET_WARM_RESET, 7, 0, 3), false);
        assert!(p.aborts(&task(1, 1, 0, 9)) && p.aborts(&task(1, 1, 5, 9)));
        assert_eq!(
            Tmf::plan(&tmf(CLEAR_TASK_SET, 1, 0, 3), true),
            Tmf::AbortOnTarget {
                lun: Some(1),
                reset: Reset::Nothing
            }
        );
        // Answers without aborting anything.
        for f in [ABORT_TASK_SET, CLEAR_TASK_SET, LUN_RESET] {
            assert_eq!(
                Tmf::plan(&tmf(f, 9, 0, 3), false),
                Tmf::Respond(tmf_response::NO_LUN)
            );
        }
        assert_eq!(
            Tmf::plan(&tmf(TASK_REASSIGN, 0, 0, 3), true),
            Tmf::Reassign {
                itt: 0,
                exp_data_sn: 0
            }
        );
        assert_eq!(
            Tmf::plan(&tmf(TARGET_COLD_RESET, 0, 0, 3), false),
            Tmf::AbortOnTarget {
                lun: None,
                reset: Reset::TargetCold
            }
        );
        for f in [CLEAR_ACA, 0, 9, 127] {
            let p = Tmf::plan(&tmf(f, 0, 0, 3), true);
            assert_eq!(p, Tmf::Respond(tmf_response::NOT_SUPPORTED), "function {f}");
            assert!(!p.aborts(&task(1, 1, 0, 1)));
        }
    }
}
