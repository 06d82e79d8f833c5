//! What the target does with requests other than SCSI commands (RFC 7143): NOP-Out (11.18),
//! Logout (11.14) and Task Management (11.5, with the semantics of 4.2.3). Each request becomes
//! a plan: an answer to send at once, or tasks to abort before the answer. Which tasks, in what
//! scope and with which answer is decided here, without the session: the session core carries
//! a plan out ([`crate::session::SessionCore::logout`] and
//! [`crate::session::SessionCore::task_management`]: it aborts and answers once the aborted
//! tasks have ended). Resetting devices, and what spans the target's sessions, is the layer
//! above's.

use mcsi_proto::pdu::{
    LogoutResponse, NopIn, NopOut, Pdu, TaskMgmtRequest, TaskMgmtResponse, RESERVED_TAG,
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

/// What identifies a task for task management, logout and connection loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskRef {
    pub itt: u32,
    /// The connection its command came on.
    pub cid: u16,
    pub lun: u64,
    pub cmd_sn: u32,
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
    /// (ErrorRecoveryLevel 2, [`crate::session::SessionCore::reassign`]); `exp_data_sn`: the first Data-In
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
    use bytes::Bytes;
    use tmf_function::*;

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
}
