//! Requests other than SCSI commands: NOP-Out (11.18), Text (11.10), Logout (11.14) and Task
//! Management (11.5, with the semantics of RFC 7143 4.2.3). What each does is the core's plan
//! (`mcsi_target_core::control`); this layer aborts, waits for the aborted tasks to end, resets
//! devices and sends the answer.

use crate::session::{wait_all, Conn, InOrder, OrderedRun, Session, SessionEnd, Target};
use mcsi_proto::pdu::{reject_reason, LogoutRequest, Pdu, TaskMgmtRequest};
use mcsi_target_core::control::tmf_function;
use mcsi_target_core::control::{tmf_pdu, tmf_response, Logout, Reset, Tmf};
use mcsi_target_core::session::TmfStep;
use mcsi_target_core::session::MAX_PARKED_IMMEDIATE;
use std::sync::Arc;
use tracing::{debug, info, warn, Instrument};

/// Runs what came up in CmdSN order: control requests, and held SCSI commands (on this
/// reader, or as tasks of their own when an ORDERED task is pending). A held command whose
/// replies would go to a connection at its output budget, and everything after it, go on in a
/// task of their own that waits for room before each such command: a reader that fills a CmdSN
/// gap may release a whole window of commands held for another connection, and their output
/// must not land on a queue the initiator is not reading all at once.
pub fn run_all(session: &Arc<Session>, ready: InOrder) {
    let mut queue: std::collections::VecDeque<OrderedRun> = ready.into();
    while let Some(r) = queue.pop_front() {
        if let OrderedRun::Inline(d, claim) = &r {
            let out = claim.reply.as_ref().unwrap_or(&d.conn);
            if out.out.full() {
                queue.push_front(r);
                let s = session.clone();
                tokio::spawn(async move {
                    while let Some(r) = queue.pop_front() {
                        if let OrderedRun::Inline(d, claim) = &r {
                            let out = claim.reply.as_ref().unwrap_or(&d.conn);
                            out.out.room().await;
                        }
                        run_one(&s, r, &mut queue);
                    }
                });
                return;
            }
        }
        run_one(session, r, &mut queue);
    }
}

/// Runs one thing that came up in CmdSN order; what it puts in order goes to `queue`.
fn run_one(
    session: &Arc<Session>,
    r: OrderedRun,
    queue: &mut std::collections::VecDeque<OrderedRun>,
) {
    match r {
        OrderedRun::Control(c, p) => run(session, c, p),
        OrderedRun::Inline(d, claim) => {
            if let Some(units) = session.units().as_ref() {
                crate::scsi::run_inline(
                    session,
                    units,
                    &d.conn,
                    &d.cmd,
                    d.phase,
                    d.data_out(),
                    claim,
                );
            }
        }
        OrderedRun::Task(d) => {
            let (more, note) = session.start_held(d);
            if let Some(note) = note {
                debug!("{note}");
            }
            queue.extend(more);
        }
    }
}

/// Runs one request on its connection.
pub fn run(session: &Arc<Session>, conn: Arc<Conn>, p: Pdu) {
    match p {
        Pdu::TextRequest(t) => crate::text::handle(&session.shared, session, &conn, t),
        Pdu::LogoutRequest(l) => logout(session, &conn, l),
        Pdu::TaskMgmtRequest(t) => {
            let Some(slot) = control_slot(session, &conn, t.immediate, || {
                Pdu::TaskMgmtRequest(t.clone())
            }) else {
                return;
            };
            let s = session.clone();
            let span = conn.span.clone();
            tokio::spawn(
                async move {
                    tmf(&s, &conn, t).await;
                    drop(slot);
                }
                .instrument(span),
            );
        }
        other => conn.send(Pdu::reject_of(reject_reason::PROTOCOL_ERROR, &other)),
    }
}

use crate::session::MAX_CONTROL_TASKS;

/// A slot for one more task management or logout handler: `None`, with the request rejected,
/// when an immediate request finds them all taken. A request in CmdSN order always gets one
/// (the window bounds those).
fn control_slot(
    session: &Session,
    conn: &Conn,
    immediate: bool,
    pdu: impl FnOnce() -> Pdu,
) -> Option<Option<tokio::sync::OwnedSemaphorePermit>> {
    match session.control_slots.clone().try_acquire_owned() {
        Ok(p) => Some(Some(p)),
        Err(_) if !immediate => Some(None),
        Err(_) => {
            debug!(parent: &conn.span, "{MAX_CONTROL_TASKS} task management or logout requests in progress: rejecting an immediate one");
            conn.send(Pdu::reject_of(
                reject_reason::IMMEDIATE_COMMAND_REJECT,
                &pdu(),
            ));
            None
        }
    }
}

/// Logout (11.14): reason 0 closes the session, 1 closes a connection (possibly another one of
/// the session), 2 asks for recovery which ErrorRecoveryLevel 0 does not support (11.15.1). The
/// session core carries it out ([`Session::logout`]); its answer waits for the tasks it aborts.
fn logout(session: &Arc<Session>, conn: &Arc<Conn>, l: LogoutRequest) {
    if l.reason == 2 && session.ops.erl >= 2 {
        remove_for_recovery(session, conn, &l);
        return;
    }
    match session.logout(conn, &l) {
        Ok(Logout::CloseSession) => info!(parent: &conn.span, "logout: closing the session"),
        Ok(Logout::CloseConnection { cid }) => {
            info!(parent: &conn.span, cid, "logout: closing the connection")
        }
        Ok(_) => {}
        Err(_) => {
            debug!(parent: &conn.span, "{MAX_PARKED_IMMEDIATE} answers wait for aborted tasks: rejecting an immediate logout");
            conn.send(Pdu::reject_of(
                reject_reason::IMMEDIATE_COMMAND_REJECT,
                &Pdu::LogoutRequest(l),
            ));
        }
    }
}

/// Logout reason 2 at ErrorRecoveryLevel 2 (11.14.1, 6.2): connection `l.cid` is removed for
/// recovery. A live one is dropped as a failed one would be (its tasks wait to be reassigned);
/// one that failed already is gone. The answer gives DefaultTime2Wait and DefaultTime2Retain.
fn remove_for_recovery(session: &Arc<Session>, conn: &Arc<Conn>, l: &LogoutRequest) {
    use mcsi_proto::codes::logout_response;
    let response = match session.conn(l.cid) {
        // The connection that asks cannot be the one removed (it would not hear the answer).
        Some(c) if Arc::ptr_eq(&c, conn) => logout_response::CID_NOT_FOUND,
        Some(c) => {
            info!(parent: &conn.span, cid = l.cid, "logout: removing the connection for recovery");
            session.fail_now(&c);
            logout_response::CLOSED
        }
        None if session.failed_cid(l.cid) => logout_response::CLOSED,
        None => logout_response::CID_NOT_FOUND,
    };
    conn.send(Pdu::LogoutResponse(mcsi_proto::pdu::LogoutResponse {
        response,
        itt: l.itt,
        stat_sn: 0,
        exp_cmd_sn: 0,
        max_cmd_sn: 0,
        time2wait: 2,
        time2retain: u16::try_from(session.ops.time2retain.as_secs()).unwrap_or(u16::MAX),
    }));
}

/// Task management (11.5, 4.2.3). Affected tasks are aborted (their status is not sent) and the
/// response goes out only after they have ended: within the session the core sees to it
/// ([`Session::task_management`]); what spans the target's sessions (and resets) is done here.
async fn tmf(session: &Arc<Session>, conn: &Arc<Conn>, t: TaskMgmtRequest) {
    // A normal session has both (Session::new); a discovery session neither.
    let units = session.units().clone();
    let (Some(target), Some(units)) = (session.target.clone(), units.as_ref()) else {
        conn.send(Pdu::reject_of(
            reject_reason::PROTOCOL_ERROR,
            &Pdu::TaskMgmtRequest(t),
        ));
        return;
    };
    // The unit the request addresses, looked up once: a LUN removed meanwhile is then not
    // mistaken for another by its number.
    let unit = units.dev.lu(t.lun);
    let mut plan = Tmf::plan(&t, unit.is_some());
    if matches!(
        plan,
        Tmf::AbortOnTarget {
            reset: Reset::TargetCold,
            ..
        }
    ) && !target.limits.allow_cold_reset
    {
        // It would end every initiator's sessions: only where the operator allows it.
        plan = Tmf::Respond(tmf_response::AUTH_FAILED);
    }
    if matches!(
        plan,
        Tmf::AbortOnTarget {
            reset: Reset::Target | Reset::TargetCold,
            ..
        }
    ) && units.view.is_some()
    {
        // An initiator with a LUN map sees only some of the target's units: a reset of the
        // whole target would reach the others' LUNs.
        warn!(initiator = %session.initiator_name, "target reset refused: the initiator has a LUN map");
        plan = Tmf::Respond(tmf_response::AUTH_FAILED);
    }
    // TASK REASSIGN of a task that had ended when its connection failed (ErrorRecoveryLevel
    // 2): answered from what that connection had sent; the core has the others.
    if let Tmf::Reassign {
        itt: task,
        exp_data_sn,
    } = plan
    {
        if session.ops.erl >= 2 && !session.awaits_reassign(task) {
            if let Some(pdus) = session.reassign_from_logs(task, exp_data_sn) {
                let fits = pdus
                    .iter()
                    .all(|p| p.data_len() <= conn.ops.send_mrdsl as usize);
                if fits {
                    info!(
                        itt = format_args!("{task:#x}"),
                        "task reassigned: {} PDUs sent again on this connection",
                        pdus.len()
                    );
                    conn.send(tmf_pdu(t.itt, tmf_response::COMPLETE));
                    for p in pdus {
                        conn.send(p);
                    }
                    return;
                }
                info!(
                    itt = format_args!("{task:#x}"),
                    "task reassignment refused: its Data-In exceed this connection's MaxRecvDataSegmentLength"
                );
                conn.send(tmf_pdu(
                    t.itt,
                    mcsi_target_core::session::recover_codes::FUNCTION_REJECTED,
                ));
                return;
            }
        }
    }
    let response = match session.task_management(conn, t.itt, &plan, t.immediate) {
        TmfStep::Answered { response, runs } => {
            run_all(session, runs);
            log_tmf(&t, response);
            return;
        }
        TmfStep::Busy => {
            debug!("{MAX_PARKED_IMMEDIATE} task management answers wait for aborted tasks: rejecting an immediate request");
            conn.send(Pdu::reject_of(
                reject_reason::IMMEDIATE_COMMAND_REJECT,
                &Pdu::TaskMgmtRequest(t),
            ));
            return;
        }
        TmfStep::AfterInline { ref_cmd_sn, cmd_sn } => {
            // The task may be running inline on another connection's reader: its status goes
            // out before this answer.
            session.inline_quiesced().await;
            match session.take_as_received(ref_cmd_sn, cmd_sn) {
                Some(ctl) => {
                    run_all(session, ctl);
                    tmf_response::COMPLETE
                }
                None => tmf_response::NO_TASK,
            }
        }
        TmfStep::OnTarget => {
            abort_on_target(session, &target, &plan, unit.as_ref()).await;
            if let Tmf::AbortOnTarget { reset, .. } = plan {
                match reset {
                    Reset::Nothing => {}
                    Reset::Lun(_) => {
                        if let Some(lu) = &unit {
                            lu.reset();
                        }
                    }
                    Reset::Target => target.dev.reset_all(),
                    Reset::TargetCold => {
                        target.dev.reset_all();
                        log_tmf(&t, tmf_response::COMPLETE);
                        // The answer goes out first; closing a session stops its connections'
                        // readers and queues the close behind what their writers hold.
                        conn.send(tmf_pdu(t.itt, tmf_response::COMPLETE));
                        close_target_sessions(session, &target).await;
                        return;
                    }
                }
            }
            tmf_response::COMPLETE
        }
    };
    log_tmf(&t, response);
    conn.send(tmf_pdu(t.itt, response));
}

/// Resets are rare and change what every initiator of the LU sees: the log says so. Aborts (an
/// initiator's timeouts) stay at debug.
fn log_tmf(t: &TaskMgmtRequest, response: u8) {
    let name = tmf_function::name(t.function);
    let lun = mcsi_scsi::lun::decode(t.lun);
    if Tmf::is_reset(t.function) {
        tracing::info!(function = name, ?lun, response, "task management");
    } else {
        debug!(function = name, ?lun, response, "task management");
    }
}

/// TARGET COLD RESET: every session of this target ends, the requester's too (RFC 7143
/// 11.5.1); the initiators log in again.
async fn close_target_sessions(session: &Arc<Session>, target: &Arc<Target>) {
    let mut closing = Vec::new();
    for s in session.shared.all_sessions() {
        if s.target.as_ref().is_some_and(|x| Arc::ptr_eq(x, target)) {
            closing.push(s);
        }
    }
    tracing::info!(
        sessions = closing.len(),
        "target cold reset: closing every session of the target"
    );
    for s in closing {
        s.close(SessionEnd::ColdReset).await;
    }
}

/// Aborts the tasks of every session of this target that `plan` covers. A CLEAR TASK SET
/// tells each other session whose tasks it aborted with a unit attention (TAS is 0: their
/// statuses are not sent).
async fn abort_on_target(
    session: &Arc<Session>,
    target: &Arc<Target>,
    plan: &Tmf,
    unit: Option<&Arc<mcsi_scsi::LogicalUnit>>,
) {
    let mut waits = Vec::new();
    // `unit`: the one the request addresses, by this session's numbers; each other session
    // addresses it under its own (a LUN map may number it otherwise, or not show it at all).
    let (by_lun, reset) = match *plan {
        Tmf::AbortOnTarget { lun, reset } => (lun.is_some(), reset),
        _ => (false, Reset::Nothing),
    };
    let cleared = unit.filter(|_| by_lun && reset == Reset::Nothing);
    for s in session.shared.all_sessions() {
        if s.target.as_ref().is_some_and(|x| Arc::ptr_eq(x, target)) {
            let mine = Arc::ptr_eq(&s, session);
            let theirs = match (by_lun, unit, mine) {
                (_, _, true) | (false, _, _) => *plan,
                (true, Some(lu), false) => {
                    match s.units().as_ref().and_then(|u| u.dev.raw_lun_of(lu)) {
                        Some(lun) => Tmf::AbortOnTarget {
                            lun: Some(lun),
                            reset,
                        },
                        None => continue,
                    }
                }
                // The unit went away: only this session's tasks by that number.
                (true, None, false) => continue,
            };
            let aborted = s.abort_where(|e| theirs.aborts(e));
            if let Some(lu) = &cleared {
                if aborted.found > 0 && !mine {
                    lu.tasks_cleared_by_another(&s.nexus);
                }
            }
            waits.extend(aborted.waits);
        }
    }
    wait_all(waits).await;
    for s in session.shared.all_sessions() {
        if s.target.as_ref().is_some_and(|x| Arc::ptr_eq(x, target)) {
            s.inline_quiesced().await;
        }
    }
}
