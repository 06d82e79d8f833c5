//! One SCSI task from command to status: data-out collection (immediate, unsolicited, R2T),
//! waiting for its turn (CmdSN order and task attributes), execution by the device server
//! (on tokio's blocking pool when the LU says so), then Data-In and status.

use crate::datain::{read_expected, response_pdus};
use crate::session::{Conn, Inline, Pending, Register, Session, Started};
use crate::transfer::WriteTransfer;
use bytes::Bytes;
use mcsi_proto::pdu::{Pdu, ScsiCommand};
use mcsi_scsi::{status, Command, DataPhase, DeviceServer, Outcome, TaskAttribute};
use std::sync::Arc;
use tracing::{debug, warn, Instrument};

/// Registers a command as a task of its own: it waits in the core for its data, its turn in
/// CmdSN order (unless `in_order`: its CmdSN was consumed already, it only enters the task set)
/// and its task attribute, and runs when the core hands it out ([`run`]). Its immediate data
/// and unsolicited burst take room in the server's unsolicited budget, unless `accounted` (a
/// held command's data holds its room already, [`account_unsolicited`]); a write that finds
/// none is refused. Returns what came up in CmdSN order meanwhile, for the caller to run.
#[allow(clippy::too_many_arguments)]
pub fn start_task(
    session: &Arc<Session>,
    conn: &Arc<Conn>,
    dev: &Arc<DeviceServer>,
    mut cmd: ScsiCommand,
    phase: DataPhase,
    attr: TaskAttribute,
    transfer: Option<WriteTransfer>,
    in_order: bool,
    accounted: bool,
) -> crate::session::InOrder {
    let unsolicited = transfer.as_ref().map_or(0, |t| t.unsolicited_len());
    let (permit, refused) = if accounted || unsolicited == 0 {
        (None, false)
    } else {
        match session.unsolicited_permit(unsolicited) {
            Some(p) => (Some(p), false),
            None => {
                debug!(parent: &conn.span, itt = cmd.itt, unsolicited, "no room in the unsolicited budget: the write is refused (TASK SET FULL) once its unsolicited data has come");
                (None, true)
            }
        }
    };
    // The immediate data goes to the core (which keeps what the write needs) and the CDB is
    // copied out: the command the task keeps does not pin the reader's buffer (the PDU's
    // allocation, shared with the PDUs around it) for the task's life.
    cmd.cdb = Bytes::copy_from_slice(&cmd.cdb);
    let write = transfer.map(|transfer| crate::session_core::NewWrite {
        transfer,
        immediate: std::mem::take(&mut cmd.data),
        first_burst_length: session.ops.burst.first_burst_length,
        refused,
    });
    let pending = Box::new(Pending {
        conn: conn.clone(),
        dev: dev.clone(),
        attr,
        refused,
    });
    let answer = Box::new(crate::session_core::Answer {
        cmd: cmd.clone(),
        phase,
    });
    let (reg, ready) = session.register_task(
        conn,
        cmd.lun,
        cmd.immediate || in_order,
        write,
        u64::from(cmd.expected_data_transfer_length),
        permit,
        pending,
        answer,
    );
    match reg {
        Register::Ok | Register::Closing => {}
        Register::OutOfWindow => {
            // Silently ignored (RFC 7143 4.2.2.1).
            debug!(parent: &conn.span, cmd_sn = cmd.cmd_sn, "command outside the CmdSN window or a duplicate dropped");
        }
        Register::TaskSetFull => {
            debug!(parent: &conn.span, itt = cmd.itt, "immediate command beyond the session's tasks: TASK SET FULL");
            task_set_full(session, conn, &cmd, phase);
        }
        Register::IttInUse => {
            conn.send(Pdu::reject_of(
                mcsi_proto::pdu::reject_reason::TASK_IN_PROGRESS,
                &Pdu::ScsiCommand(cmd),
            ));
        }
    }
    ready
}

/// Answers `cmd` on `conn` with status TASK SET FULL.
pub fn task_set_full(session: &Session, conn: &Conn, cmd: &ScsiCommand, phase: DataPhase) {
    let full = Outcome::status(status::TASK_SET_FULL);
    let (mrdsl, max_burst) = (conn.ops.send_mrdsl, session.ops.burst.max_burst_length);
    for p in response_pdus(cmd, phase, full, mrdsl, max_burst) {
        conn.send(p);
    }
}

/// The data of a command held for its turn ([`crate::session::Session::hold`]), made to hold
/// room in the server's unsolicited budget for as long as it lives; `None` when there is none.
pub fn account_unsolicited(session: &Session, data: Bytes) -> Option<Bytes> {
    struct Held {
        data: Bytes,
        _permit: tokio::sync::OwnedSemaphorePermit,
    }
    impl AsRef<[u8]> for Held {
        fn as_ref(&self) -> &[u8] {
            &self.data
        }
    }
    let permit = session.unsolicited_permit(data.len() as u32)?;
    Some(Bytes::from_owner(Held {
        data,
        _permit: permit,
    }))
}

/// Runs a command whose turn has come ([`Session::claim`], [`crate::session_core::Run::Inline`]) to its end on the
/// calling reader and queues its final PDUs: on `claim.reply`, or else on `conn`, the
/// connection it came on.
pub fn run_inline(
    session: &Session,
    dev: &DeviceServer,
    conn: &Arc<Conn>,
    cmd: &ScsiCommand,
    phase: DataPhase,
    transfer: Option<&WriteTransfer>,
    claim: Inline,
) {
    let started = std::time::Instant::now();
    let data_out = match transfer {
        Some(t) => cmd
            .data
            .slice(..t.accept_immediate(cmd.data.len() as u32).len as usize),
        None => Bytes::new(),
    };
    let outcome = dev.execute(
        cmd.lun,
        Command {
            nexus: &session.nexus,
            cdb: &cmd.cdb,
            data_out,
            data_in_limit: read_expected(cmd),
            attr: TaskAttribute::Simple,
        },
    );
    account(session, conn, cmd, &outcome, started);
    let out = claim.reply.as_ref().unwrap_or(conn);
    for p in response_pdus(
        cmd,
        phase,
        outcome,
        out.ops.send_mrdsl,
        session.ops.burst.max_burst_length,
    ) {
        out.send(p);
    }
    if claim.tracked {
        session.release_inline(cmd.lun);
    }
}

/// The session's [`crate::session::Runner`]: a task the core handed out runs in a future of
/// its own.
pub fn spawn(s: Started) {
    let span = tracing::debug_span!(parent: &s.pending.conn.span, "task", itt = s.cmd.itt, cmd_sn = s.cmd.cmd_sn);
    tokio::spawn(run(s).instrument(span));
}

/// Runs a task the core handed out (its turn came with all of its data-out) to its end. The
/// task always leaves the session's table at the end, so the window and task set move on; an
/// aborted task sends nothing (RFC 7143 4.2.3).
async fn run(s: Started) {
    let Started {
        session,
        pending,
        cmd,
        phase,
        id,
        data: data_out,
        mut abort_rx,
        done_tx,
    } = s;
    let Pending {
        conn,
        dev,
        attr,
        refused,
    } = *pending;
    let itt = cmd.itt;
    let started = std::time::Instant::now();
    let outcome = async {
        if refused {
            return Some((Outcome::status(status::TASK_SET_FULL), None));
        }
        let read_expected = read_expected(&cmd);
        // The data the backend fills waits for the session's read budget.
        let permit = tokio::select! {
            biased;
            _ = crate::session::flag_set(&mut abort_rx) => return None,
            // Sized by what the CDB can produce, not by the expected length alone, which a
            // peer may set far above it.
            p = session.read_permit(read_expected.min(phase.data_in_len)) => p,
        };
        let o = execute(&session, &dev, &cmd, attr, data_out, read_expected).await;
        Some((o, permit))
    }
    .await;
    let (outcome, permit) = match outcome {
        Some((o, p)) => (Some(o), p),
        None => (None, None),
    };
    // A refused write did not run: like the other TASK SET FULL answers it moves no counter.
    if let (Some(o), false) = (&outcome, refused) {
        account(&session, &conn, &cmd, o, started);
    }
    let out = session.finish_task(itt, id, &conn, outcome);
    if out.is_none() {
        debug!("task ended without status (aborted or connection gone)");
    }
    let queue = out.map(|c| c.out.clone());
    drop(done_tx);
    // The read's budget comes back once its Data-In is on its way: queued, with the connection
    // below its output budget (or gone).
    if let (Some(p), Some(q)) = (permit, queue) {
        q.room().await;
        drop(p);
    }
}

/// Counts a finished command on its LUN and its connection.
fn account(
    session: &Session,
    conn: &Conn,
    cmd: &ScsiCommand,
    o: &Outcome,
    started: std::time::Instant,
) {
    let write = if cmd.write {
        cmd.expected_data_transfer_length as usize
    } else {
        0
    };
    let lun = session.target.as_ref().and_then(|t| t.lun_metrics(cmd.lun));
    crate::counters::account(
        lun,
        &conn.counters,
        o.data_in.len(),
        write,
        o.status == status::GOOD,
        started,
    );
}

async fn execute(
    session: &Session,
    dev: &Arc<DeviceServer>,
    cmd: &ScsiCommand,
    attr: TaskAttribute,
    data_out: Bytes,
    data_in_limit: u32,
) -> Outcome {
    let lun = cmd.lun;
    if dev.blocking(lun, &cmd.cdb) {
        let dev = dev.clone();
        let nexus = session.nexus.clone();
        let cdb = cmd.cdb.clone();
        let r = tokio::task::spawn_blocking(move || {
            dev.execute(
                lun,
                Command {
                    nexus: &nexus,
                    cdb: &cdb,
                    data_out,
                    data_in_limit,
                    attr,
                },
            )
        })
        .await;
        match r {
            Ok(o) => o,
            Err(e) => {
                warn!("device server failed: {e}");
                Outcome::status(status::BUSY)
            }
        }
    } else {
        dev.execute(
            lun,
            Command {
                nexus: &session.nexus,
                cdb: &cmd.cdb,
                data_out,
                data_in_limit,
                attr,
            },
        )
    }
}
