//! One SCSI task from command to status: data-out collection (immediate, unsolicited, R2T),
//! waiting for its turn (CmdSN order and task attributes), execution by the device server
//! (on tokio's blocking pool when the LU says so), then Data-In and status.

use crate::datain::{read_expected, response_pdus};
use crate::session::{Bound, Conn, Inline, Session, Started};
use bytes::Bytes;
use mcsi_proto::pdu::ScsiCommand;
use mcsi_scsi::{
    status, BackendError, Command, DataPhase, DeviceServer, LogicalUnit, Outcome, Pending,
    Prepared, Step, TaskAttribute,
};
use std::sync::Arc;
use tracing::{debug, warn, Instrument};

/// Runs a command whose turn has come with `data_out`, all of its data
/// ([`crate::session_core::Arrival::Now`], [`crate::session_core::OrderedRun::Inline`]), to its end on
/// the calling reader and queues its final PDUs: on `claim.reply`, or else on `conn`, the
/// connection it came on. `units`: what the command was planned against.
pub fn run_inline(
    session: &Session,
    units: &Bound,
    conn: &Arc<Conn>,
    cmd: &ScsiCommand,
    phase: DataPhase,
    data_out: Bytes,
    claim: Inline,
) {
    let started = std::time::Instant::now();
    let dev = &*units.dev;
    let outcome = refused_overflow(dev, cmd).unwrap_or_else(|| {
        dev.execute(
            cmd.lun,
            Command {
                nexus: &session.nexus,
                cdb: &cmd.cdb,
                data_out,
                data_in_limit: read_expected(cmd),
                attr: TaskAttribute::Simple,
                pace: None,
            },
        )
    });
    account(session, units, conn, cmd, &outcome, started);
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
    let span =
        tracing::debug_span!(parent: &s.conn.span, "task", itt = s.cmd.itt, cmd_sn = s.cmd.cmd_sn);
    tokio::spawn(run(s).instrument(span));
}

/// Runs a task the core handed out (its turn came with all of its data-out) to its end. The
/// task always leaves the session's table at the end, so the window and task set move on; an
/// aborted task sends nothing (RFC 7143 4.2.3).
async fn run(s: Started) {
    let Started {
        session,
        conn,
        units,
        attr,
        cmd,
        phase,
        id,
        data: data_out,
        mut abort_rx,
        done_tx,
    } = s;
    let itt = cmd.itt;
    let dev = &units.dev;
    let started = std::time::Instant::now();
    let outcome = async {
        let read_expected = read_expected(&cmd);
        // The data the backend fills waits for the session's read budget.
        let permit = tokio::select! {
            biased;
            _ = crate::session::flag_set(&mut abort_rx) => return None,
            // Sized by what the CDB can produce, not by the expected length alone, which a
            // peer may set far above it.
            p = session.read_permit(read_expected.min(phase.data_in_len)) => p,
        };
        let run = execute(&session, dev, &cmd, attr, data_out, read_expected);
        // Only an EXTENDED COPY looks its unit up (the opcode first: this runs for every task).
        let copy = LogicalUnit::is_copy(&cmd.cdb)
            .then(|| dev.lu(cmd.lun))
            .flatten();
        let o = if dev.abort_ends_wait(cmd.lun, &cmd.cdb) {
            // It only waits for work the unit does anyway (a SANITIZE without IMMED): an abort
            // ends the wait, and the work goes on.
            tokio::select! {
                biased;
                _ = crate::session::flag_set(&mut abort_rx) => return None,
                o = run => o,
            }
        } else if let Some(lu) = copy {
            // An EXTENDED COPY runs on a thread until done: an abort stops it at its next
            // chunk, and the task ends when it has.
            tokio::pin!(run);
            tokio::select! {
                biased;
                o = &mut run => o,
                _ = crate::session::flag_set(&mut abort_rx) => {
                    lu.stop_copy(Some(&session.nexus));
                    run.await
                }
            }
        } else {
            run.await
        };
        Some((o, permit))
    }
    .await;
    let (outcome, permit) = match outcome {
        Some((o, p)) => (Some(o), p),
        None => (None, None),
    };
    if let Some(o) = &outcome {
        account(&session, &units, &conn, &cmd, o, started);
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

/// A write whose data-out has a fixed size (WRITE SAME, COMPARE AND WRITE) sent with more
/// than that: refused rather than run on the first part of its data.
fn refused_overflow(dev: &DeviceServer, cmd: &ScsiCommand) -> Option<Outcome> {
    cmd.write
        .then(|| dev.overflow_refused(cmd.lun, &cmd.cdb, cmd.expected_data_transfer_length))
        .flatten()
}

/// Counts a finished command on its LUN (through the map of `units`, what the command ran on)
/// and its connection.
fn account(
    session: &Session,
    units: &Bound,
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
    let account = |lun: Option<&crate::counters::LunMetrics>| {
        crate::counters::account(
            lun,
            &conn.counters,
            o.data_in.len(),
            write,
            o.status == status::GOOD,
            started,
        )
    };
    match &session.target {
        Some(t) => {
            // A LUN map's number counts for the target's LUN it names; one it does not map,
            // for none.
            let lun = mcsi_scsi::lun::decode(cmd.lun);
            let lun = match &units.view {
                Some(v) => lun.and_then(|n| v.map.load().get(&n).copied()),
                None => lun,
            };
            t.with_lun_metrics(lun, account)
        }
        None => account(None),
    }
}

async fn execute(
    session: &Arc<Session>,
    dev: &Arc<DeviceServer>,
    cmd: &ScsiCommand,
    attr: TaskAttribute,
    data_out: Bytes,
    data_in_limit: u32,
) -> Outcome {
    if let Some(o) = refused_overflow(dev, cmd) {
        return o;
    }
    let lun = cmd.lun;
    let command = Command {
        nexus: &session.nexus,
        cdb: &cmd.cdb,
        data_out,
        data_in_limit,
        attr,
        pace: None,
    };
    // The asynchronous path first: no thread waits for its I/O.
    match dev.prepare(lun, &command) {
        Prepared::Done(o) => return o,
        Prepared::Io(p) => return run_async(p).await,
        Prepared::Sync => {}
    }
    if !dev.needs_thread(lun, &cmd.cdb) {
        return dev.execute(lun, command);
    }
    let dev = dev.clone();
    let nexus = session.nexus.clone();
    let cdb = cmd.cdb.clone();
    let data_out = command.data_out;
    // An EXTENDED COPY moves data toward storage that the initiator never sends: with a
    // bandwidth toward storage, each of its chunks waits for it and is charged as if written.
    let paced =
        (LogicalUnit::is_copy(&cmd.cdb) && session.storage_paced()).then(|| session.clone());
    let r = tokio::task::spawn_blocking(move || {
        let pace = paced.map(|s| move |bytes: u64| s.pace_blocking(bytes));
        dev.execute(
            lun,
            Command {
                nexus: &nexus,
                cdb: &cdb,
                data_out,
                data_in_limit,
                attr,
                pace: pace.as_ref().map(|f| mcsi_scsi::Pace(f)),
            },
        )
    })
    .await;
    r.unwrap_or_else(|e| {
        warn!("device server failed: {e}");
        Outcome::status(status::BUSY)
    })
}

/// Runs a command's backend operations on the asynchronous path: each completes through a
/// callback into a oneshot, so the task waits without a thread.
async fn run_async(mut p: Pending) -> Outcome {
    loop {
        let (tx, rx) = tokio::sync::oneshot::channel();
        p.submit(Box::new(move |r| {
            let _ = tx.send(r);
        }));
        let r = rx.await.unwrap_or_else(|_| {
            Err(BackendError::Io {
                op: "complete",
                offset: 0,
                cause: std::io::Error::other("the backend dropped a completion"),
            })
        });
        match p.finish(r) {
            Step::Done(o) => return o,
            Step::Next(next) => p = next,
            Step::Blocking(f) => {
                return tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
                    warn!("device server failed: {e}");
                    Outcome::status(status::BUSY)
                })
            }
        }
    }
}
