//! Logout and task management within one session, carried out by the core: the plans are
//! [`crate::control`]'s ([`Logout`], [`Tmf`]), pure; here the core aborts what a plan names and
//! answers once the aborted tasks have ended.

use super::{Close, CoreConn, InOrder, SessionCore};
use crate::control::{logout_pdu, logout_response, tmf_pdu, tmf_response, Logout, Tmf};
use mcsi_proto::pdu::{reject_reason, LogoutRequest, Pdu};

/// An immediate Logout Request while [`crate::session::MAX_PARKED_IMMEDIATE`] answers wait
/// already: the caller rejects it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// What [`SessionCore::task_management`] did with a request.
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

impl<C: CoreConn, T> SessionCore<C, T> {
    /// Logout Request `l` on `conn` (11.14): the connections that log out leave (picked for no new
    /// replies, their end clean), the tasks the plan names are aborted (`on_abort` tells a running
    /// one to stop), and once those that were running have ended the answer goes out on `conn`
    /// through [`SessionCore::poll_transmit`], then the connections close
    /// ([`SessionCore::poll_close`]): `conn` once its answer is sent, when it leaves, and another
    /// one named now. Returns the plan, for the log.
    pub fn logout(
        &mut self,
        conn: &C,
        l: &LogoutRequest,
        on_abort: impl FnMut(&mut T),
    ) -> Result<Logout, Busy> {
        // The connection named is looked up once: the plan and the connection that leaves are the
        // same one.
        let named = self.conn(l.cid).cloned();
        let plan = Logout::plan(l.reason, l.cid, |_| named.is_some());
        let leaving: Vec<C> = match plan {
            Logout::CloseSession => self.conns().cloned().collect(),
            Logout::CloseConnection { .. } => named.into_iter().collect(),
            Logout::Respond(code) => {
                let answer = logout_pdu(l.itt, code);
                self.answer_when_ended(conn, answer, |_| false, false, l.immediate, Vec::new());
                return Ok(plan);
            }
            Logout::Reject => {
                let answer = Pdu::reject_of(
                    reject_reason::INVALID_PDU_FIELD,
                    &Pdu::LogoutRequest(l.clone()),
                );
                self.answer_when_ended(conn, answer, |_| false, false, l.immediate, Vec::new());
                return Ok(plan);
            }
        };
        if !self.answer_room(l.immediate) {
            return Err(Busy);
        }
        for c in &leaving {
            self.leave(c);
        }
        self.abort_where(|t| plan.aborts(t), on_abort);
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
        self.answer_when_ended(conn, answer, |t| plan.aborts(t), false, l.immediate, then);
        Ok(plan)
    }

    /// Task management `plan` (request `itt` on `conn`, `immediate` or in CmdSN order) within one
    /// session: tasks are aborted (`on_abort` tells a running one to stop) and the answer goes out
    /// through [`SessionCore::poll_transmit`] once those that were running have ended. ABORT TASK
    /// answers "function complete" for a task found, or for one never received whose RefCmdSN
    /// lies in the window before the request (its CmdSN is taken as received), and "task does not
    /// exist" otherwise (11.5.1); ABORT TASK SET also waits for the session's inline commands.
    pub fn task_management(
        &mut self,
        conn: &C,
        itt: u32,
        plan: &Tmf,
        immediate: bool,
        on_abort: impl FnMut(&mut T),
    ) -> TmfStep<C> {
        let after_inline = match *plan {
            Tmf::Respond(code) => {
                self.answer_when_ended(
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
                let r = self.reassign(conn, itt, task, exp_data_sn);
                return TmfStep::Answered {
                    response: r.response(),
                    runs: Vec::new(),
                };
            }
            Tmf::AbortTask { .. } => false,
            Tmf::AbortTaskSet { .. } => true,
        };
        if !self.answer_room(immediate) {
            return TmfStep::Busy;
        }
        let found = self.abort_where(|t| plan.aborts(t), on_abort);
        let mut runs = Vec::new();
        if let Tmf::AbortTask {
            ref_cmd_sn, cmd_sn, ..
        } = *plan
        {
            if found == 0 {
                if self.inline_running() > 0 {
                    return TmfStep::AfterInline { ref_cmd_sn, cmd_sn };
                }
                let Some(r) = self.take_as_received(ref_cmd_sn, cmd_sn) else {
                    self.answer_when_ended(
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
        self.answer_when_ended(
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::ClaimOutcome;

    use crate::session::test_conn::Tc;

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
        assert_eq!(reg, crate::session::RegisterOutcome::Ok);
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
        let plan = core.logout(&a, &request(50, 1, 2), |io: &mut Io| {
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
            core.logout(&a, &request(51, 1, 9), |_| {}),
            Ok(Logout::Respond(logout_response::CID_NOT_FOUND))
        );
        assert!(
            matches!(core.poll_transmit(), Some((_, Pdu::LogoutResponse(r))) if r.response == logout_response::CID_NOT_FOUND)
        );
        assert_eq!(
            core.logout(&a, &request(52, 0, 1), |_| {}),
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
        let step = core.task_management(&a, 100, &abort_1, true, |io: &mut Io| {
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
        let step = core.task_management(&a, 101, &abort_5, true, |_| {});
        assert!(matches!(
            step,
            TmfStep::Answered {
                response: tmf_response::COMPLETE,
                ..
            }
        ));
        assert_eq!(answers(&mut core), vec![(101, tmf_response::COMPLETE)]);
        // ABORT TASK SET while a command runs inline: its answer waits for it.
        let ClaimOutcome::Now(claim) = core.claim(7, 0, 3, false) else {
            panic!("runs now")
        };
        assert!(claim.tracked);
        let set = Tmf::AbortTaskSet { lun: 0, before: 9 };
        let step = core.task_management(&b, 102, &set, true, |_| {});
        assert!(matches!(step, TmfStep::Answered { .. }));
        assert!(answers(&mut core).is_empty());
        // Meanwhile ABORT TASK of a task not found must wait for the inline command too.
        let step = core.task_management(&b, 103, &abort_5, true, |_| {});
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
            let step = core.task_management(&a, 200 + i, &abort_8, true, |_| {});
            assert!(matches!(step, TmfStep::Answered { .. }));
        }
        let step = core.task_management(&a, 300, &abort_8, true, |_| {});
        assert!(matches!(step, TmfStep::Busy));
        let step = core.task_management(&a, 301, &abort_8, false, |_| {});
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
}
