//! Requests other than SCSI commands: NOP-Out (11.18), Text (11.10), Logout (11.14) and Task
//! Management (11.5, with the semantics of RFC 7143 4.2.3).

use crate::conn::reject_pdu;
use crate::session::{wait_all, Conn, InOrder, Run, Session, Target};
use mcsi_proto::pdu::{
    reject_reason, LogoutRequest, LogoutResponse, NopIn, NopOut, Pdu, TaskMgmtRequest,
    TaskMgmtResponse, RESERVED_TAG,
};
use mcsi_proto::serial::Sn;
use mcsi_scsi::TaskAttribute;
use std::sync::Arc;
use tracing::{debug, info, Instrument};

/// TMF response codes (11.6.1).
pub mod tmf_response {
    pub const COMPLETE: u8 = 0;
    pub const NO_TASK: u8 = 1;
    pub const NO_LUN: u8 = 2;
    pub const REASSIGN_NOT_SUPPORTED: u8 = 4;
    pub const NOT_SUPPORTED: u8 = 5;
}

/// TMF function codes (11.5.1).
pub mod tmf_function {
    pub const ABORT_TASK: u8 = 1;
    pub const ABORT_TASK_SET: u8 = 2;
    pub const CLEAR_ACA: u8 = 3;
    pub const CLEAR_TASK_SET: u8 = 4;
    pub const LUN_RESET: u8 = 5;
    pub const TARGET_WARM_RESET: u8 = 6;
    pub const TARGET_COLD_RESET: u8 = 7;
    pub const TASK_REASSIGN: u8 = 8;

    /// The function's name in RFC 7143 11.5.1, for logs.
    pub fn name(f: u8) -> &'static str {
        match f {
            ABORT_TASK => "ABORT TASK",
            ABORT_TASK_SET => "ABORT TASK SET",
            CLEAR_ACA => "CLEAR ACA",
            CLEAR_TASK_SET => "CLEAR TASK SET",
            LUN_RESET => "LOGICAL UNIT RESET",
            TARGET_WARM_RESET => "TARGET WARM RESET",
            TARGET_COLD_RESET => "TARGET COLD RESET",
            TASK_REASSIGN => "TASK REASSIGN",
            _ => "unknown",
        }
    }
}

/// Runs what came up in CmdSN order: control requests, and held SCSI commands (on this
/// reader, or as tasks of their own when an ORDERED task is pending).
pub fn run_all(session: &Arc<Session>, ready: InOrder) {
    let mut queue: std::collections::VecDeque<Run> = ready.into();
    while let Some(r) = queue.pop_front() {
        match r {
            Run::Control(c, p) => run(session, c, p),
            Run::Inline(d, claim) => {
                if let Some(t) = &session.target {
                    crate::scsi::run_inline(
                        session,
                        &t.dev,
                        &d.conn,
                        &d.cmd,
                        d.phase,
                        d.transfer.as_ref(),
                        claim,
                    );
                }
            }
            Run::Task(d) => {
                let Some(t) = &session.target else { continue };
                let crate::session::Deferred {
                    conn,
                    cmd,
                    phase,
                    transfer,
                } = *d;
                let more = crate::scsi::start_task(
                    session,
                    &conn,
                    &t.dev,
                    cmd,
                    phase,
                    TaskAttribute::Simple,
                    transfer,
                    true,
                );
                queue.extend(more);
            }
        }
    }
}

/// Runs one request on its connection.
pub fn run(session: &Arc<Session>, conn: Arc<Conn>, p: Pdu) {
    match p {
        Pdu::NopOut(n) => nop(&conn, n),
        Pdu::TextRequest(t) => crate::text::handle(&session.shared, session, &conn, t),
        Pdu::LogoutRequest(l) => {
            let s = session.clone();
            let span = conn.span.clone();
            tokio::spawn(async move { logout(&s, &conn, l).await }.instrument(span));
        }
        Pdu::TaskMgmtRequest(t) => {
            let s = session.clone();
            let span = conn.span.clone();
            tokio::spawn(async move { tmf(&s, &conn, t).await }.instrument(span));
        }
        other => conn.send(reject_pdu(reject_reason::PROTOCOL_ERROR, &other)),
    }
}

/// NOP-Out: a ping (ITT set) is echoed with its data (11.19); an answer to our NOP-In (TTT set)
/// or a NOP-Out with the reserved ITT needs no reply.
fn nop(conn: &Conn, n: NopOut) {
    if n.itt == RESERVED_TAG {
        return;
    }
    let mut data = n.data;
    data.truncate(conn.ops.send_mrdsl as usize);
    conn.send(Pdu::NopIn(NopIn {
        lun: n.lun,
        itt: n.itt,
        ttt: RESERVED_TAG,
        stat_sn: 0,
        exp_cmd_sn: 0,
        max_cmd_sn: 0,
        data,
    }));
}

fn logout_response(itt: u32, response: u8) -> Pdu {
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

/// Logout (11.14): reason 0 closes the session, 1 closes a connection (possibly another one of
/// the session), 2 asks for recovery which ErrorRecoveryLevel 0 does not support (11.15.1).
async fn logout(session: &Arc<Session>, conn: &Arc<Conn>, l: LogoutRequest) {
    match l.reason {
        0 => {
            info!("logout: closing the session");
            let others: Vec<Arc<Conn>> = session.conns();
            for c in &others {
                c.mark_clean();
            }
            // Tasks still running are aborted; the response goes out once they ended.
            let aborted = session.abort_where(|_| true);
            wait_all(aborted.waits).await;
            conn.send(logout_response(l.itt, 0));
            conn.close_after_flush();
            for c in others.iter().filter(|c| c.cid != conn.cid) {
                c.stop();
            }
        }
        1 => {
            let Some(target) = session.conn(l.cid) else {
                conn.send(logout_response(l.itt, 1));
                return;
            };
            info!(cid = l.cid, "logout: closing the connection");
            target.mark_clean();
            let aborted = session.abort_where(|t| t.cid == l.cid);
            wait_all(aborted.waits).await;
            conn.send(logout_response(l.itt, 0));
            if Arc::ptr_eq(&target, conn) {
                conn.close_after_flush();
            } else {
                target.stop();
            }
        }
        2 => conn.send(logout_response(l.itt, 2)),
        _ => conn.send(reject_pdu(
            reject_reason::INVALID_PDU_FIELD,
            &Pdu::LogoutRequest(l),
        )),
    }
}

fn tmf_response(itt: u32, response: u8) -> Pdu {
    Pdu::TaskMgmtResponse(TaskMgmtResponse {
        response,
        itt,
        stat_sn: 0,
        exp_cmd_sn: 0,
        max_cmd_sn: 0,
    })
}

/// Task management (11.5, 4.2.3). Affected tasks are aborted (their status is not sent) and the
/// response goes out only after they have ended.
async fn tmf(session: &Arc<Session>, conn: &Arc<Conn>, t: TaskMgmtRequest) {
    use tmf_function::*;
    let Some(target) = session.target.clone() else {
        conn.send(reject_pdu(
            reject_reason::PROTOCOL_ERROR,
            &Pdu::TaskMgmtRequest(t),
        ));
        return;
    };
    let lun_exists = target.dev.lu(t.lun).is_some();
    let response = match t.function {
        ABORT_TASK => abort_task(session, &t).await,
        ABORT_TASK_SET | CLEAR_TASK_SET | LUN_RESET if !lun_exists => tmf_response::NO_LUN,
        ABORT_TASK_SET => {
            let aborted =
                session.abort_where(|e| e.lun == t.lun && Sn::lt(Sn(e.cmd_sn), Sn(t.cmd_sn)));
            wait_all(aborted.waits).await;
            session.inline_quiesced().await;
            tmf_response::COMPLETE
        }
        CLEAR_TASK_SET => {
            // The task set is shared by every initiator of the LU (SAM-5 7.5).
            abort_on_target(session, &target, Some(t.lun)).await;
            tmf_response::COMPLETE
        }
        LUN_RESET => {
            abort_on_target(session, &target, Some(t.lun)).await;
            if let Some(lu) = target.dev.lu(t.lun) {
                lu.reset();
            }
            tmf_response::COMPLETE
        }
        TARGET_WARM_RESET => {
            abort_on_target(session, &target, None).await;
            target.dev.reset_all();
            tmf_response::COMPLETE
        }
        TASK_REASSIGN => tmf_response::REASSIGN_NOT_SUPPORTED,
        CLEAR_ACA | TARGET_COLD_RESET => tmf_response::NOT_SUPPORTED,
        _ => tmf_response::NOT_SUPPORTED,
    };
    // Resets are rare and change what every initiator of the LU sees: the log says so. Aborts
    // (an initiator's timeouts) stay at debug.
    let name = tmf_function::name(t.function);
    let lun = mcsi_scsi::lun::decode(t.lun);
    if matches!(
        t.function,
        LUN_RESET | TARGET_WARM_RESET | TARGET_COLD_RESET
    ) {
        tracing::info!(function = name, ?lun, response, "task management");
    } else {
        debug!(function = name, ?lun, response, "task management");
    }
    conn.send(tmf_response(t.itt, response));
}

/// ABORT TASK (11.5.1): a found task is aborted. A task not found whose RefCmdSN lies in the
/// window before this request is taken as received (its CmdSN is used up) and the answer is
/// "function complete"; otherwise "task does not exist".
async fn abort_task(session: &Arc<Session>, t: &TaskMgmtRequest) -> u8 {
    let aborted = session.abort_where(|e| e.itt == t.referenced_task_tag && e.lun == t.lun);
    if aborted.found > 0 {
        wait_all(aborted.waits).await;
        return tmf_response::COMPLETE;
    }
    // The task may be running inline on another connection's reader: its status goes out
    // before this answer.
    session.inline_quiesced().await;
    match session.take_as_received(t.ref_cmd_sn, t.cmd_sn) {
        Some(ctl) => {
            run_all(session, ctl);
            tmf_response::COMPLETE
        }
        None => tmf_response::NO_TASK,
    }
}

/// Aborts the tasks of every session of this target (on one LUN or all).
async fn abort_on_target(session: &Arc<Session>, target: &Arc<Target>, lun: Option<u64>) {
    let mut waits = Vec::new();
    for s in session.shared.all_sessions() {
        if s.target.as_ref().is_some_and(|x| Arc::ptr_eq(x, target)) {
            waits.extend(s.abort_where(|e| lun.is_none_or(|l| l == e.lun)).waits);
        }
    }
    wait_all(waits).await;
    for s in session.shared.all_sessions() {
        if s.target.as_ref().is_some_and(|x| Arc::ptr_eq(x, target)) {
            s.inline_quiesced().await;
        }
    }
}
