//! One SCSI task from command to status: data-out collection (immediate, unsolicited, R2T),
//! waiting for its turn (CmdSN order and task attributes), execution by the device server
//! (on tokio's blocking pool when the LU says so), then Data-In and status.

use crate::datain::{residual, split, Residual};
use crate::session::{Conn, Inline, Register, Session, TaskHandles};
use crate::transfer::WriteTransfer;
use bytes::Bytes;
use mcsi_proto::pdu::{DataIn, Pdu, ScsiCommand, ScsiResponse, RESERVED_TAG};
use mcsi_scsi::{status, Command, DataPhase, DeviceServer, Outcome, TaskAttribute};
use std::sync::Arc;
use tracing::{debug, warn, Instrument};

/// Everything one task's future needs.
pub struct TaskCtx {
    pub session: Arc<Session>,
    pub conn: Arc<Conn>,
    pub dev: Arc<DeviceServer>,
    pub attr: TaskAttribute,
    pub cmd: ScsiCommand,
    pub phase: DataPhase,
    pub handles: TaskHandles,
}

/// Registers a command as a task of its own and starts it: it waits for its data, its turn in
/// CmdSN order (unless `in_order`: its CmdSN was consumed already, it only enters the task set)
/// and its task attribute. Returns what came up in CmdSN order meanwhile, for the caller to run.
#[allow(clippy::too_many_arguments)]
pub fn start_task(
    session: &Arc<Session>,
    conn: &Arc<Conn>,
    dev: &Arc<DeviceServer>,
    cmd: ScsiCommand,
    phase: DataPhase,
    attr: TaskAttribute,
    transfer: Option<WriteTransfer>,
    in_order: bool,
) -> crate::session::InOrder {
    let write = transfer.map(|transfer| crate::session_core::NewWrite {
        transfer,
        immediate: cmd.data.clone(),
        first_burst_length: session.ops.first_burst_length,
    });
    let (reg, handles, ready) = session.register_task(
        conn,
        cmd.itt,
        cmd.lun,
        cmd.cmd_sn,
        cmd.immediate || in_order,
        attr,
        write,
        u64::from(cmd.expected_data_transfer_length),
    );
    match (reg, handles) {
        (Register::Ok, Some(h)) => {
            let span = tracing::debug_span!(parent: &conn.span, "task", itt = cmd.itt, cmd_sn = cmd.cmd_sn);
            let ctx = TaskCtx {
                session: session.clone(),
                conn: conn.clone(),
                dev: dev.clone(),
                attr,
                cmd,
                phase,
                handles: h,
            };
            tokio::spawn(run(ctx).instrument(span));
        }
        (Register::OutOfWindow, _) => {
            // Silently ignored (RFC 7143 4.2.2.1).
            debug!(parent: &conn.span, cmd_sn = cmd.cmd_sn, "command outside the CmdSN window or a duplicate dropped");
        }
        (Register::IttInUse, _) => {
            conn.send(crate::conn::reject_pdu(
                mcsi_proto::pdu::reject_reason::TASK_IN_PROGRESS,
                &Pdu::ScsiCommand(cmd),
            ));
        }
        _ => {}
    }
    ready
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
        session.ops.max_burst_length,
    ) {
        out.send(p);
    }
    if claim.tracked {
        session.release_inline(cmd.lun);
    }
}

/// Runs the task to its end. The task always leaves the session's table at the end, so the
/// window and task set move on; an aborted task sends nothing (RFC 7143 4.2.3).
pub async fn run(ctx: TaskCtx) {
    let TaskCtx {
        session,
        conn,
        dev,
        attr,
        cmd,
        phase,
        handles,
    } = ctx;
    let TaskHandles {
        id,
        ready_rx,
        mut abort_rx,
        done_tx,
    } = handles;
    let itt = cmd.itt;
    let started = std::time::Instant::now();
    let outcome = async {
        // Its turn, with all of its data (gathered by the session core as Data-Out arrives).
        let data_out = tokio::select! {
            biased;
            _ = crate::session::flag_set(&mut abort_rx) => return None,
            r = ready_rx => r.ok()?,
        };
        let read_expected = read_expected(&cmd);
        // The data the backend fills waits for the session's read budget.
        let permit = tokio::select! {
            biased;
            _ = crate::session::flag_set(&mut abort_rx) => return None,
            p = session.read_permit(read_expected) => p,
        };
        let o = execute(&session, &dev, &cmd, attr, data_out, read_expected).await;
        Some((o, permit))
    }
    .await;
    let (outcome, permit) = match outcome {
        Some((o, p)) => (Some(o), p),
        None => (None, None),
    };
    if let Some(o) = &outcome {
        account(&session, &conn, &cmd, o, started);
    }
    let max_burst = session.ops.max_burst_length;
    let mut queue = None;
    let sent = session.finish_task(itt, id, &conn, |out| {
        queue = Some(out.out.clone());
        match outcome {
            Some(o) => response_pdus(&cmd, phase, o, out.ops.send_mrdsl, max_burst),
            None => Vec::new(),
        }
    });
    if !sent {
        debug!("task ended without status (aborted or connection gone)");
    }
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
    crate::stats::account(
        lun,
        conn,
        o.data_in.len(),
        write,
        o.status == status::GOOD,
        started,
    );
}

/// The data-in length the initiator expects: EDTL for a read, the Bidirectional Read Expected
/// Data Transfer Length AHS for a bidirectional command (11.3.6), else nothing.
pub fn read_expected(cmd: &ScsiCommand) -> u32 {
    match (cmd.read, cmd.write) {
        (true, false) => cmd.expected_data_transfer_length,
        (true, true) => cmd.bidi_read_length.unwrap_or(0),
        _ => 0,
    }
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

/// The PDUs that end a task (11.4, 11.7): Data-In split by the initiator's
/// MaxRecvDataSegmentLength with sequences of at most MaxBurstLength, status in the last Data-In
/// when it is GOOD without sense (phase collapse) and the command is not bidirectional, else a
/// SCSI Response. Residuals compare the initiator's expected lengths with what the command
/// moved (reads) or needed (writes).
pub fn response_pdus(
    cmd: &ScsiCommand,
    phase: DataPhase,
    outcome: Outcome,
    mrdsl: u32,
    max_burst: u32,
) -> Vec<Pdu> {
    let read_exp = read_expected(cmd);
    let write_exp = if cmd.write {
        cmd.expected_data_transfer_length
    } else {
        0
    };
    let produced = u32::try_from(outcome.data_in.len())
        .unwrap_or(u32::MAX)
        .saturating_add(outcome.data_in_unread);
    let read_res = residual(read_exp, produced);
    let write_res = residual(write_exp, phase.data_out_len);
    let (main, bidi) = match (cmd.read, cmd.write) {
        (true, false) => (read_res, None),
        (false, true) => (write_res, None),
        (true, true) => (write_res, Some(read_res)),
        // No direction flagged (EDTL 0): report what the CDB wanted as overflow.
        (false, false) if produced > 0 || phase.data_in_len > 0 => (read_res, None),
        (false, false) => (write_res, None),
    };
    let have = u32::try_from(outcome.data_in.len()).unwrap_or(u32::MAX);
    let send_len = if cmd.read {
        produced.min(read_exp).min(have)
    } else {
        0
    };
    let collapse =
        outcome.status == status::GOOD && outcome.sense.is_none() && send_len > 0 && bidi.is_none();
    let pieces = split(send_len, mrdsl, max_burst);
    let n = pieces.len();
    let mut out = Vec::with_capacity(n + 1);
    // The pieces follow each other from offset 0, so each is split off the front. The last (for
    // a read in one Data-In, the only) one takes what is left as it is: slicing a buffer that
    // came from a Vec would allocate a shared header first.
    let mut rest = outcome.data_in;
    if rest.len() > send_len as usize {
        rest.truncate(send_len as usize);
    }
    for (i, p) in pieces.into_iter().enumerate() {
        debug_assert_eq!(p.offset as usize + rest.len(), send_len as usize);
        let last = i + 1 == n;
        let with_status = last && collapse;
        out.push(Pdu::DataIn(DataIn {
            final_: p.final_ || last,
            ack: false,
            overflow: with_status && main.overflow,
            underflow: with_status && main.underflow,
            status: with_status.then_some(outcome.status),
            lun: cmd.lun,
            itt: cmd.itt,
            ttt: RESERVED_TAG,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            data_sn: i as u32,
            buffer_offset: p.offset,
            residual_count: if with_status { main.count } else { 0 },
            data: rest.split_to(p.len as usize),
        }));
    }
    if !collapse {
        let b = bidi.unwrap_or(Residual::default());
        out.push(Pdu::ScsiResponse(ScsiResponse {
            bidi_overflow: b.overflow,
            bidi_underflow: b.underflow,
            overflow: main.overflow,
            underflow: main.underflow,
            response: 0,
            status: outcome.status,
            itt: cmd.itt,
            snack_tag: 0,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            exp_data_sn: n as u32,
            bidi_residual_count: b.count,
            residual_count: main.count,
            sense: outcome.sense.unwrap_or_default(),
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use mcsi_proto::pdu::TaskAttr;

    fn cmd(read: bool, write: bool, edtl: u32) -> ScsiCommand {
        ScsiCommand {
            immediate: false,
            final_: true,
            read,
            write,
            attr: TaskAttr::Simple,
            lun: 0,
            itt: 0x42,
            expected_data_transfer_length: edtl,
            cmd_sn: 1,
            exp_stat_sn: 1,
            cdb: Bytes::from_static(&[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]),
            bidi_read_length: None,
            data: Bytes::new(),
        }
    }

    fn read_phase(n: u32) -> DataPhase {
        DataPhase {
            data_out_len: 0,
            data_in_len: n,
        }
    }

    #[test]
    fn read_with_phase_collapse() {
        // 20000 bytes to an initiator with MRDSL 8192: 3 Data-In, status in the last.
        let data = Bytes::from(vec![7u8; 20000]);
        let pdus = response_pdus(
            &cmd(true, false, 20000),
            read_phase(20000),
            Outcome::good(data),
            8192,
            1 << 20,
        );
        assert_eq!(pdus.len(), 3);
        let Pdu::DataIn(last) = &pdus[2] else {
            panic!("{pdus:?}")
        };
        assert_eq!(
            (last.data_sn, last.buffer_offset, last.data.len()),
            (2, 16384, 3616)
        );
        assert_eq!(last.status, Some(0));
        assert!(last.final_ && !last.underflow && !last.overflow);
        let Pdu::DataIn(first) = &pdus[0] else {
            panic!()
        };
        assert!(first.status.is_none() && !first.final_);
    }

    #[test]
    fn read_residuals_of_libiscsi_read10_invalid() {
        let block = Bytes::from(vec![1u8; 512]);
        // EDTL 10000: one block sent, underflow 9488 in the status-carrying Data-In.
        let p = response_pdus(
            &cmd(true, false, 10000),
            read_phase(512),
            Outcome::good(block.clone()),
            8192,
            1 << 20,
        );
        let Pdu::DataIn(d) = &p[0] else { panic!() };
        assert_eq!(
            (d.data.len(), d.underflow, d.residual_count),
            (512, true, 9488)
        );
        // EDTL 200: 200 bytes sent, overflow 312.
        let p = response_pdus(
            &cmd(true, false, 200),
            read_phase(512),
            Outcome::good(block.clone()),
            8192,
            1 << 20,
        );
        let Pdu::DataIn(d) = &p[0] else { panic!() };
        assert_eq!(
            (d.data.len(), d.overflow, d.residual_count),
            (200, true, 312)
        );
        // EDTL 0 and no direction flag: no data, SCSI Response GOOD with overflow 512.
        let p = response_pdus(
            &cmd(false, false, 0),
            read_phase(512),
            Outcome::good(block),
            8192,
            1 << 20,
        );
        assert_eq!(p.len(), 1);
        let Pdu::ScsiResponse(r) = &p[0] else {
            panic!()
        };
        assert_eq!(
            (r.status, r.overflow, r.residual_count, r.exp_data_sn),
            (0, true, 512, 0)
        );
    }

    /// A READ the device server cut to the expected length (the rest unread) gets the same
    /// residuals as one it read whole.
    #[test]
    fn unread_data_in_counts_for_the_residual() {
        for (edtl, read, have, unread) in [(200u32, true, 512, 7680), (0, false, 0, 8192)] {
            let mut o = Outcome::good(Bytes::from(vec![1u8; have]));
            o.data_in_unread = unread;
            let mut whole = Outcome::good(Bytes::from(vec![1u8; 8192]));
            whole.data_in_unread = 0;
            let cut = response_pdus(&cmd(read, false, edtl), read_phase(8192), o, 8192, 1 << 20);
            let full = response_pdus(
                &cmd(read, false, edtl),
                read_phase(8192),
                whole,
                8192,
                1 << 20,
            );
            assert_eq!(cut, full, "EDTL {edtl}");
        }
    }

    #[test]
    fn write_residuals() {
        // WRITE10 of 2 blocks with EDTL one block: overflow 512 (test_write10_residuals).
        let phase = DataPhase {
            data_out_len: 1024,
            data_in_len: 0,
        };
        let p = response_pdus(
            &cmd(false, true, 512),
            phase,
            Outcome::good(Bytes::new()),
            8192,
            1 << 20,
        );
        let Pdu::ScsiResponse(r) = &p[0] else {
            panic!()
        };
        assert_eq!(
            (r.overflow, r.underflow, r.residual_count),
            (true, false, 512)
        );
        // EDTL 10000 for one block: underflow 9488.
        let phase = DataPhase {
            data_out_len: 512,
            data_in_len: 0,
        };
        let p = response_pdus(
            &cmd(false, true, 10000),
            phase,
            Outcome::good(Bytes::new()),
            8192,
            1 << 20,
        );
        let Pdu::ScsiResponse(r) = &p[0] else {
            panic!()
        };
        assert_eq!(
            (r.overflow, r.underflow, r.residual_count),
            (false, true, 9488)
        );
    }

    #[test]
    fn check_condition_goes_in_a_response_with_sense() {
        let sense =
            Bytes::from_static(&[0x70, 0, 5, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x21, 0, 0, 0, 0, 0]);
        let o = Outcome {
            status: status::CHECK_CONDITION,
            sense: Some(sense.clone()),
            data_in: Bytes::new(),
            data_in_unread: 0,
        };
        let p = response_pdus(&cmd(true, false, 512), read_phase(512), o, 8192, 1 << 20);
        assert_eq!(p.len(), 1);
        let Pdu::ScsiResponse(r) = &p[0] else {
            panic!()
        };
        assert_eq!(
            (r.status, &r.sense, r.underflow, r.residual_count),
            (2, &sense, true, 512)
        );
    }
}
