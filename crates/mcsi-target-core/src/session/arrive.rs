//! What arrives in a session in full feature phase ([`SessionCore::handle_pdu`]): a SCSI
//! command ([`SessionCore::command`]: planned, then run at once on the reader that received it,
//! held for its turn, registered as a task, or answered with a Reject or TASK SET FULL), Data-Out,
//! a NOP-Out (echoed by the core), another control request (in CmdSN order, for the caller), the
//! answer to the target's ping (for the connection's keepalive), or something to reject. What the core sends for it waits in
//! [`SessionCore::poll_transmit`].

use super::{
    immediate_data_out, Answer, BudgetRoom, ClaimOutcome, CoreConn, Deferred, HoldOutcome, InOrder,
    Inline, NewTask, NewWrite, Ordered, RegisterOutcome, SessionCore,
};
use crate::command::CommandRefused;
use crate::control::{nop_out, Nop};
use crate::dispatch::{rejected_cmd_sn, route, Route};
use crate::transfer::{TransferError, WriteTransfer};
use bytes::Bytes;
use mcsi_proto::pdu::{reject_reason, Pdu, ScsiCommand};
use mcsi_scsi::{status, DataPhase, Outcome, TaskAttribute};

/// What the core asks of the logical units behind a session when a command arrives.
pub trait Lus {
    /// The data phase `cdb` asks for on `lun`: what it reads and writes, at most.
    fn data_phase(&self, lun: u64, cdb: &[u8]) -> DataPhase;
    /// Whether `lun` may block on `cdb` (a file or a block device): such a command runs in a
    /// task of its own, never on the reader.
    fn blocking(&self, lun: u64, cdb: &[u8]) -> bool;
}

impl Lus for mcsi_scsi::DeviceServer {
    fn data_phase(&self, lun: u64, cdb: &[u8]) -> DataPhase {
        mcsi_scsi::DeviceServer::data_phase(self, lun, cdb)
    }

    fn blocking(&self, lun: u64, cdb: &[u8]) -> bool {
        mcsi_scsi::DeviceServer::blocking(self, lun, cdb)
    }
}

/// No logical units: a discovery session's, which takes no SCSI command ([`route`] rejects
/// them before any is planned).
pub struct NoUnits;

impl Lus for NoUnits {
    fn data_phase(&self, _: u64, _: &[u8]) -> DataPhase {
        DataPhase {
            data_out_len: 0,
            data_in_len: 0,
        }
    }

    fn blocking(&self, _: u64, _: &[u8]) -> bool {
        true
    }
}

/// A command whose turn has come with all of its data, to run now on the reader that received
/// it, without a task ([`Arrival::Now`]).
pub struct RunNow<C> {
    pub cmd: ScsiCommand,
    pub phase: DataPhase,
    /// Its data-out (the immediate data its transfer takes).
    pub data: Bytes,
    /// Where its answer goes, and whether [`SessionCore::release_inline`] follows its end.
    pub claim: Inline<C>,
}

/// What [`SessionCore::handle_pdu`] (or [`SessionCore::command`]) did with a PDU.
pub enum Arrival<C> {
    /// Run it now: execute `cmd`, queue its final PDUs (`crate::datain::response_pdus`) on
    /// the claim's reply connection or else the one it came on, then release a tracked claim.
    Now(RunNow<C>),
    /// The core took it: registered as a task, held for its turn, dropped, or answered (its
    /// Reject or status waits in [`SessionCore::poll_transmit`]). `runs` came up in CmdSN order
    /// meanwhile, for the caller to carry out; `note` says what happened when it is worth a
    /// log line.
    Taken {
        runs: InOrder<C>,
        note: Option<Note>,
    },
    /// A SNACK (ErrorRecoveryLevel 1 and above): the caller answers it from what the
    /// connection kept of what it sent ([`crate::retain::SentLog::snack`]), beside the writer
    /// that stamps StatSNs.
    Snack(mcsi_proto::pdu::SnackRequest),
    /// The connection must end: an error ErrorRecoveryLevel 0 cannot recover.
    End(Fault),
}

/// An error on a connection that ends it at ErrorRecoveryLevel 0 (and with it the session).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Fault {
    /// Data-Out for a task on another connection (RFC 7143 4.2.2.3).
    #[error("Data-Out for ITT {itt:#x} on a connection it is not allegiant to")]
    NotAllegiant { itt: u32 },
    /// A Data-Out that breaks its task's transfer (7.1.4.1).
    #[error("Data-Out error for ITT {itt:#x}: {source}")]
    DataOut {
        itt: u32,
        #[source]
        source: TransferError,
    },
}

/// Why a command was not taken as asked, for the log.
#[derive(Debug, thiserror::Error)]
pub enum Note {
    /// Its data breaks the negotiated rules: rejected, its CmdSN used up.
    #[error("command rejected: {0}")]
    Rejected(CommandRefused),
    /// Outside the CmdSN window, or a duplicate: dropped silently (RFC 7143 4.2.2.1).
    #[error("command outside the CmdSN window or a duplicate dropped (CmdSN {cmd_sn})")]
    Dropped { cmd_sn: u32 },
    /// An immediate command beyond the session's tasks: TASK SET FULL.
    #[error("immediate command beyond the session's tasks: TASK SET FULL")]
    TaskSetFull,
    /// No room in the server's unsolicited budget for a write's unsolicited data: answered TASK
    /// SET FULL once that data has come.
    #[error("no room in the unsolicited budget for {unsolicited} bytes: the write is refused (TASK SET FULL) once its unsolicited data has come")]
    Refused { unsolicited: u32 },
    /// No room in the unsolicited budget for a command held for its turn: TASK SET FULL now.
    #[error("no room in the unsolicited budget for a held write: TASK SET FULL")]
    HeldWithoutRoom,
    /// Its ITT belongs to a task in progress: rejected.
    #[error("ITT in use by a task in progress: rejected")]
    IttInUse,
    /// A PDU with no place here (a SNACK at ErrorRecoveryLevel 0, a Login Request or a target
    /// opcode in full feature phase, a SCSI command in a discovery session): rejected.
    #[error("PDU with opcode {opcode:#04x} rejected (protocol error)")]
    Protocol { opcode: u8 },
    /// A PDU that could not be decoded but could be answered: rejected with `reason`.
    #[error("undecodable PDU rejected (reason {reason:#04x})")]
    Undecodable { reason: u8 },
    /// A NOP-Out answering no ping of the target's on its connection.
    #[error("NOP-Out answering no pending ping (TTT {ttt:#x})")]
    StrayPingAnswer { ttt: u32 },
    /// Data lost to a digest error (ErrorRecoveryLevel 1 and above): rejected, and asked for
    /// again with a recovery R2T.
    #[error("{len} bytes of data at offset {offset} for ITT {itt:#x} lost to a data digest error: asked for again")]
    DataLost { itt: u32, offset: u32, len: u32 },
    /// Data-Out for no task that takes data (ended, aborted, or never a write): discarded
    /// (4.2.3.1).
    #[error("Data-Out for ITT {itt:#x}, for no task that takes it: discarded")]
    Discarded { itt: u32 },
}

impl<C: CoreConn, T> SessionCore<C, T> {
    /// A PDU arrived on `conn` in full feature phase: the core routes it ([`route`]) and takes
    /// it. A SCSI command goes to [`SessionCore::command`] (with `lus` and `io`); Data-Out to
    /// its write; a NOP-Out ping is echoed, at once when immediate, else in CmdSN order; Text,
    /// Logout and Task Management come back in `runs` for the caller to carry out (at once when
    /// immediate, else when their turn has come); what has no place here is rejected, its CmdSN
    /// used up.
    #[inline]
    pub fn handle_pdu(
        &mut self,
        conn: &C,
        p: Pdu,
        lus: &impl Lus,
        io: impl FnOnce() -> T,
    ) -> Arrival<C> {
        let taken = |runs: InOrder<C>, note: Option<Note>| Arrival::Taken { runs, note };
        match route(p, self.discovery, self.erl) {
            Route::Command(c) => self.command(conn, c, lus, io),
            Route::DataOut(d) => match self.data_out(conn.cid(), &d) {
                super::DataOutcome::Taken => taken(Vec::new(), None),
                super::DataOutcome::Discarded => {
                    taken(Vec::new(), Some(Note::Discarded { itt: d.itt }))
                }
                super::DataOutcome::NotAllegiant => {
                    Arrival::End(Fault::NotAllegiant { itt: d.itt })
                }
                super::DataOutcome::Error(source) => {
                    Arrival::End(Fault::DataOut { itt: d.itt, source })
                }
            },
            // The answer to the target's ping (11.18): nothing to run or answer.
            Route::PingAnswer(ttt) => {
                let answered = self
                    .keepalives
                    .get_mut(&conn.cid())
                    .is_some_and(|k| k.answered(ttt));
                taken(
                    Vec::new(),
                    (!answered).then_some(Note::StrayPingAnswer { ttt }),
                )
            }
            Route::Control(p) if p.is_immediate() => match p {
                Pdu::NopOut(n) => {
                    self.echo(conn, n);
                    taken(Vec::new(), None)
                }
                p => taken(vec![super::OrderedRun::Control(conn.clone(), p)], None),
            },
            Route::Control(p) => {
                let cmd_sn = p.cmd_sn().unwrap_or(0);
                let (accepted, runs) =
                    self.submit_ordered(cmd_sn, Ordered::Control(conn.clone(), p));
                taken(runs, (!accepted).then_some(Note::Dropped { cmd_sn }))
            }
            Route::Snack(s) => Arrival::Snack(s),
            Route::Reject {
                reason,
                pdu,
                consume,
            } => {
                let opcode = pdu.opcode() as u8;
                self.transmit
                    .push_back((conn.clone(), Pdu::reject_of(reason, &pdu)));
                taken(self.consume(consume), Some(Note::Protocol { opcode }))
            }
        }
    }

    /// A PDU arrived on `conn` that could not be decoded but can be answered (its header came
    /// whole): it is rejected with `reason`, and a non-immediate request's CmdSN is used up.
    pub fn handle_undecodable(&mut self, conn: &C, reason: u8, header: Bytes) -> InOrder<C> {
        let consume = rejected_cmd_sn(&header);
        self.transmit
            .push_back((conn.clone(), Pdu::reject(reason, header)));
        self.consume(consume)
    }

    /// A PDU arrived on `conn` whose data digest did not match (`damaged`: the PDU as its header
    /// describes it, with the data as received). It is rejected with reason Data-Digest-Error
    /// and its data discarded (RFC 7143 7.8). From ErrorRecoveryLevel 1 on, a Data-Out keeps its
    /// place in its sequence and a SCSI command is kept without its immediate data; the write
    /// asks for what was lost with a recovery R2T. Any other PDU, and any PDU at level 0, is
    /// treated as undecodable ([`SessionCore::handle_undecodable`]).
    pub fn handle_data_digest_error(
        &mut self,
        conn: &C,
        header: Bytes,
        damaged: Option<Pdu>,
        lus: &impl Lus,
        io: impl FnOnce() -> T,
    ) -> Arrival<C> {
        let reason = reject_reason::DATA_DIGEST_ERROR;
        let taken = |runs: InOrder<C>, note: Option<Note>| Arrival::Taken { runs, note };
        match damaged {
            Some(Pdu::DataOut(d)) if self.erl > 0 && !self.discovery => {
                self.transmit
                    .push_back((conn.clone(), Pdu::reject(reason, header)));
                let note = Some(Note::DataLost {
                    itt: d.itt,
                    offset: d.buffer_offset,
                    len: d.data.len() as u32,
                });
                match self.data_out_lost(conn.cid(), &d) {
                    super::DataOutcome::Taken => taken(Vec::new(), note),
                    super::DataOutcome::Discarded => {
                        taken(Vec::new(), Some(Note::Discarded { itt: d.itt }))
                    }
                    super::DataOutcome::NotAllegiant => {
                        Arrival::End(Fault::NotAllegiant { itt: d.itt })
                    }
                    super::DataOutcome::Error(source) => {
                        Arrival::End(Fault::DataOut { itt: d.itt, source })
                    }
                }
            }
            Some(Pdu::ScsiCommand(c)) if self.erl > 0 && !self.discovery && !c.data.is_empty() => {
                self.transmit
                    .push_back((conn.clone(), Pdu::reject(reason, header)));
                let len = c.data.len() as u32;
                let itt = c.itt;
                match self.command_inner(conn, c, lus, io, len) {
                    Arrival::Taken { runs, note } => taken(
                        runs,
                        note.or(Some(Note::DataLost {
                            itt,
                            offset: 0,
                            len,
                        })),
                    ),
                    other => other,
                }
            }
            _ => taken(self.handle_undecodable(conn, reason, header), None),
        }
    }

    /// Echoes a NOP-Out ping (ITT set) with its data, cut to what the initiator takes (11.19);
    /// one with the reserved ITT needs no reply.
    pub(super) fn echo(&mut self, conn: &C, n: mcsi_proto::pdu::NopOut) {
        if let Nop::Echo(p) = nop_out(n, conn.max_data_in()) {
            self.transmit.push_back((conn.clone(), p));
        }
    }

    /// A SCSI command arrived on `conn`. The core plans it against the logical units (`lus`):
    /// its task attribute, its write's transfer, whether it may run on the reader. A SIMPLE
    /// command with all of its data, for a unit that does not block, needs no task: when its
    /// turn has come it is the caller's to run now ([`Arrival::Now`]); otherwise it waits in the
    /// window, its immediate data holding room in the unsolicited budget. Any other command
    /// becomes a task (with `io`, what the caller attaches to it), handed out by
    /// [`SessionCore::poll_ready`] once its turn has come with all of its data; its immediate
    /// data and unsolicited burst take room in the unsolicited budget, and a write that finds
    /// none is answered TASK SET FULL once that data has come. A command that breaks the
    /// negotiated rules is rejected and its CmdSN used up.
    #[inline]
    pub fn command(
        &mut self,
        conn: &C,
        c: ScsiCommand,
        lus: &impl Lus,
        io: impl FnOnce() -> T,
    ) -> Arrival<C> {
        self.command_inner(conn, c, lus, io, 0)
    }

    /// [`SessionCore::command`], for a command whose first `lost` bytes of immediate data were
    /// lost to a digest error: a write asks for them again, so it never runs inline.
    fn command_inner(
        &mut self,
        conn: &C,
        mut c: ScsiCommand,
        lus: &impl Lus,
        io: impl FnOnce() -> T,
        lost: u32,
    ) -> Arrival<C> {
        let phase = lus.data_phase(c.lun, &c.cdb);
        let plan = match crate::command::plan(&c, phase, self.burst, || lus.blocking(c.lun, &c.cdb))
        {
            Ok(mut p) => {
                if lost > 0 {
                    if let Some(t) = p.transfer.as_mut() {
                        t.mark_lost(0, lost);
                        p.inline = false;
                    }
                }
                p
            }
            Err(e) => {
                let consume = (!c.immediate).then_some(c.cmd_sn);
                let reject = Pdu::reject_of(e.reject_reason(), &Pdu::ScsiCommand(c));
                self.transmit.push_back((conn.clone(), reject));
                return Arrival::Taken {
                    runs: self.consume(consume),
                    note: Some(Note::Rejected(e)),
                };
            }
        };
        let (attr, mut transfer) = (plan.attr, plan.transfer);
        let mut held = None;
        if plan.inline {
            match self.claim(c.itt, c.lun, c.cmd_sn, c.immediate) {
                ClaimOutcome::Now(claim) => {
                    let data = immediate_data_out(&c, transfer.as_ref());
                    return Arrival::Now(RunNow {
                        cmd: c,
                        phase,
                        data,
                        claim,
                    });
                }
                ClaimOutcome::Wait => {
                    // Held, it keeps its own CDB (not the reader's buffer around it) and its
                    // immediate data's room in the unsolicited budget.
                    c.cdb = Bytes::copy_from_slice(&c.cdb);
                    let room = match self.take_unsolicited(c.data.len() as u32) {
                        Ok(room) => room,
                        Err(()) => {
                            // All of its data has come, so the answer may go now; one outside
                            // the window is dropped silently instead (RFC 7143 4.2.2.1).
                            let (taken, runs) = self.submit_ordered(c.cmd_sn, Ordered::Nothing);
                            if taken {
                                self.task_set_full(conn, &c, phase);
                            }
                            return Arrival::Taken {
                                runs,
                                note: Some(if taken {
                                    Note::HeldWithoutRoom
                                } else {
                                    Note::Dropped { cmd_sn: c.cmd_sn }
                                }),
                            };
                        }
                    };
                    let d = Box::new(Deferred {
                        conn: conn.clone(),
                        cmd: c,
                        phase,
                        transfer,
                        room,
                    });
                    match self.hold(d) {
                        HoldOutcome::InOrder(runs) => return Arrival::Taken { runs, note: None },
                        HoldOutcome::Dropped(d) => {
                            return Arrival::Taken {
                                runs: Vec::new(),
                                note: Some(Note::Dropped {
                                    cmd_sn: d.cmd.cmd_sn,
                                }),
                            }
                        }
                        // The session changed since the claim: a task of its own after all.
                        HoldOutcome::NeedsTask(d) => {
                            let d = *d;
                            c = d.cmd;
                            transfer = d.transfer;
                            held = Some(d.room);
                        }
                    }
                }
                ClaimOutcome::Task => {}
            }
        }
        let (runs, note) = self.start_task(conn, c, phase, attr, transfer, false, held, io);
        Arrival::Taken { runs, note }
    }

    /// A held command whose turn came while an ORDERED task is pending ([`super::OrderedRun::Task`])
    /// starts as a task of its own, with `io` attached: its CmdSN is consumed already, it only
    /// enters its task set. Returns what came up in order and what to log.
    pub fn start_held(&mut self, d: Deferred<C>, io: T) -> (InOrder<C>, Option<Note>) {
        let conn = d.conn;
        self.start_task(
            &conn,
            d.cmd,
            d.phase,
            TaskAttribute::Simple,
            d.transfer,
            true,
            Some(d.room),
            || io,
        )
    }

    /// Registers `cmd` as a task. `in_order`: its CmdSN was consumed already. `held`: the room
    /// its data holds already (a held command's); otherwise its unsolicited data takes room now.
    #[allow(clippy::too_many_arguments)]
    fn start_task(
        &mut self,
        conn: &C,
        mut cmd: ScsiCommand,
        phase: DataPhase,
        attr: TaskAttribute,
        transfer: Option<WriteTransfer>,
        in_order: bool,
        held: Option<Option<BudgetRoom>>,
        io: impl FnOnce() -> T,
    ) -> (InOrder<C>, Option<Note>) {
        let unsolicited = transfer.as_ref().map_or(0, |t| t.unsolicited_len());
        let (room, refused) = match held {
            Some(room) => (room, false),
            None => {
                // The task keeps its own CDB, not the reader's buffer around it.
                cmd.cdb = Bytes::copy_from_slice(&cmd.cdb);
                match self.take_unsolicited(unsolicited) {
                    Ok(room) => (room, false),
                    Err(()) => (None, true),
                }
            }
        };
        // The immediate data goes to the write (which keeps what it needs); the command kept for
        // the answer has none.
        let write = transfer.map(|transfer| NewWrite {
            transfer,
            immediate: std::mem::take(&mut cmd.data),
            first_burst_length: self.burst.first_burst_length,
            refused,
            room,
        });
        let id = self.next_id;
        self.next_id += 1;
        let task = NewTask {
            id,
            itt: cmd.itt,
            lun: cmd.lun,
            cmd_sn: cmd.cmd_sn,
            immediate: cmd.immediate || in_order,
            attr,
            bytes: u64::from(cmd.expected_data_transfer_length),
            answer: Some(Box::new(Answer {
                cmd: cmd.clone(),
                phase,
            })),
        };
        let (reg, runs) = self.register(conn, task, write, io());
        let note = match reg {
            RegisterOutcome::Ok => refused.then_some(Note::Refused { unsolicited }),
            RegisterOutcome::Closing => None,
            RegisterOutcome::OutOfWindow => Some(Note::Dropped { cmd_sn: cmd.cmd_sn }),
            RegisterOutcome::TaskSetFull => {
                self.task_set_full(conn, &cmd, phase);
                Some(Note::TaskSetFull)
            }
            RegisterOutcome::IttInUse => {
                let reject =
                    Pdu::reject_of(reject_reason::TASK_IN_PROGRESS, &Pdu::ScsiCommand(cmd));
                self.transmit.push_back((conn.clone(), reject));
                Some(Note::IttInUse)
            }
        };
        (runs, note)
    }

    /// Room for `bytes` of unsolicited data in the server's budget: `Ok(None)` when there is
    /// nothing to count, `Err` when there is no room.
    fn take_unsolicited(&mut self, bytes: u32) -> Result<Option<BudgetRoom>, ()> {
        match &self.unsolicited_budget {
            Some(b) if bytes > 0 => BudgetRoom::take(b, bytes).map(Some).ok_or(()),
            _ => Ok(None),
        }
    }

    /// A rejected non-immediate request still uses up its CmdSN, so that the commands after it
    /// are not held for ever: what that put in order.
    fn consume(&mut self, cmd_sn: Option<u32>) -> InOrder<C> {
        match cmd_sn {
            Some(sn) => self.submit_ordered(sn, Ordered::Nothing).1,
            None => Vec::new(),
        }
    }

    /// Answers `cmd` on `conn` with status TASK SET FULL.
    fn task_set_full(&mut self, conn: &C, cmd: &ScsiCommand, phase: DataPhase) {
        let full = Outcome::status(status::TASK_SET_FULL);
        let pdus = crate::datain::response_pdus(
            cmd,
            phase,
            full,
            conn.max_data_in(),
            self.burst.max_burst_length,
        );
        for p in pdus {
            self.transmit.push_back((conn.clone(), p));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::{CoreConn, OrderedRun};
    use mcsi_proto::pdu::{DataOut, TaskAttr};
    use mcsi_scsi::{DeviceServer, LogicalUnit, LuConfig};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    use crate::session::test_conn::Tc;

    /// The connection of a session of one.
    const TC: Tc = Tc(1);

    /// A shared budget of `free` bytes.
    struct Room(AtomicU32);

    impl crate::session::SharedBudget for Room {
        fn try_take(&self, bytes: u32) -> bool {
            self.0
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| {
                    f.checked_sub(bytes)
                })
                .is_ok()
        }
        fn give_back(&self, bytes: u32) {
            self.0.fetch_add(bytes, Ordering::AcqRel);
        }
    }

    type Core = SessionCore<Tc, ()>;

    /// A session whose next CmdSN is 1, with a budget of `room` bytes of unsolicited data.
    fn session(room: u32) -> (Core, Arc<Room>) {
        let mut core = Core::new(1, 8, false, None);
        assert!(core.add_conn(TC).is_ok());
        core.set_burst(crate::transfer::BurstParams {
            initial_r2t: false,
            immediate_data: true,
            first_burst_length: 4096,
            max_burst_length: 16384,
            max_outstanding_r2t: 1,
        });
        let budget = Arc::new(Room(AtomicU32::new(room)));
        core.set_unsolicited_budget(budget.clone());
        (core, budget)
    }

    fn dev() -> DeviceServer {
        let backend = mcsi_scsi::backend::open_backend("ram:1MiB").expect("a RAM LUN");
        DeviceServer::new(vec![(
            0,
            Arc::new(LogicalUnit::new(backend, LuConfig::default())),
        )])
    }

    /// READ(10) or WRITE(10) of `blocks` 512-byte blocks, with `data` as immediate data.
    fn cmd(itt: u32, cmd_sn: u32, write: bool, blocks: u8, data: &'static [u8]) -> ScsiCommand {
        let op = if write { 0x2a } else { 0x28 };
        ScsiCommand {
            immediate: false,
            final_: true,
            read: !write,
            write,
            attr: TaskAttr::Simple,
            lun: 0,
            itt,
            expected_data_transfer_length: u32::from(blocks) * 512,
            cmd_sn,
            exp_stat_sn: 0,
            cdb: Bytes::from(vec![op, 0, 0, 0, 0, 0, 0, 0, blocks, 0]),
            bidi_read_length: None,
            data: Bytes::from_static(data),
        }
    }

    /// Its unsolicited burst goes on after its immediate data (the F bit clear).
    fn unsolicited(c: ScsiCommand) -> ScsiCommand {
        ScsiCommand { final_: false, ..c }
    }

    /// What `pick` takes of the PDUs the core queued.
    fn sent<X>(core: &mut Core, pick: impl FnMut(Pdu) -> Option<X>) -> Vec<X> {
        std::iter::from_fn(|| core.poll_transmit().map(|(_, p)| p))
            .filter_map(pick)
            .collect()
    }

    fn statuses(core: &mut Core) -> Vec<(u32, u8)> {
        sent(core, |p| match p {
            Pdu::ScsiResponse(r) => Some((r.itt, r.status)),
            _ => None,
        })
    }

    #[test]
    fn a_read_in_turn_runs_now_and_one_ahead_of_a_gap_waits_for_it() {
        let (mut core, _) = session(0);
        let dev = dev();
        let Arrival::Taken { runs, note } =
            core.command(&TC, cmd(2, 2, false, 1, b""), &dev, || ())
        else {
            panic!("CmdSN 2 before 1 must wait");
        };
        assert!(runs.is_empty() && note.is_none());
        // CmdSN 1 fills the gap: both come up, in order, to run on this reader.
        let Arrival::Taken { runs, .. } = core.command(&TC, cmd(1, 1, false, 1, b""), &dev, || ())
        else {
            panic!("one is held, so 1 goes through the window");
        };
        let itts: Vec<u32> = runs
            .iter()
            .map(|r| match r {
                OrderedRun::Inline(d, _) => d.cmd.itt,
                _ => panic!("in order, to run inline"),
            })
            .collect();
        assert_eq!(itts, vec![1, 2]);
        // Next in order with nothing held: it runs now, without a task.
        match core.command(&TC, cmd(3, 3, false, 1, b""), &dev, || ()) {
            Arrival::Now(now) => {
                assert_eq!(now.cmd.itt, 3);
                assert!(!now.claim.tracked, "one connection: nothing to track");
            }
            _ => panic!("3 is next"),
        }
        assert_eq!(core.task_count(), 0);
    }

    /// Immediate data on a read breaks the rules: a Reject, and its CmdSN is used up so that
    /// the command after it is not held for ever.
    #[test]
    fn a_command_that_breaks_the_rules_is_rejected_and_uses_up_its_cmdsn() {
        let (mut core, _) = session(0);
        let dev = dev();
        let Arrival::Taken { note, .. } = core.command(&TC, cmd(1, 1, false, 1, b"x"), &dev, || ())
        else {
            panic!("rejected");
        };
        assert!(matches!(note, Some(Note::Rejected(_))), "{note:?}");
        assert!(matches!(core.poll_transmit(), Some((_, Pdu::Reject(_)))));
        assert!(matches!(
            core.command(&TC, cmd(2, 2, false, 1, b""), &dev, || ()),
            Arrival::Now(_)
        ));
    }

    /// A write's unsolicited data takes room in the shared budget until the write is granted
    /// or ends; a write that finds none is answered TASK SET FULL once its unsolicited data has
    /// come, and never runs.
    #[test]
    fn unsolicited_data_holds_room_and_a_write_without_room_is_refused() {
        static DATA: [u8; 1024] = [7; 1024];
        let (mut core, budget) = session(1024);
        let dev = dev();
        // 8 blocks, 1 KiB immediate: the rest of the first burst (3 KiB) comes unsolicited.
        let Arrival::Taken { note, .. } =
            core.command(&TC, unsolicited(cmd(1, 1, true, 8, &DATA)), &dev, || ())
        else {
            panic!("a write with data still to come is a task");
        };
        // 4 KiB (1 KiB immediate + 3 KiB unsolicited) does not fit in 1 KiB: refused.
        assert!(
            matches!(note, Some(Note::Refused { unsolicited: 4096 })),
            "{note:?}"
        );
        assert_eq!(core.task_count(), 1);
        assert_eq!(
            budget.0.load(Ordering::Acquire),
            1024,
            "refused, took nothing"
        );
        assert_eq!(
            statuses(&mut core),
            Vec::new(),
            "its unsolicited data is owed first"
        );
        let d = mcsi_proto::pdu::DataOut {
            final_: true,
            lun: 0,
            itt: 1,
            ttt: mcsi_proto::pdu::RESERVED_TAG,
            exp_stat_sn: 0,
            data_sn: 0,
            buffer_offset: 1024,
            data: Bytes::from_static(&[0; 3072]),
        };
        assert_eq!(core.data_out(1, &d), crate::session::DataOutcome::Taken);
        assert!(core.poll_ready().is_none(), "a refused write never runs");
        assert_eq!(statuses(&mut core), vec![(1, status::TASK_SET_FULL)]);
        assert_eq!(core.task_count(), 0);

        // With room, the unsolicited part (4 KiB of 8) is held until the write ends.
        let (mut core, budget) = session(8192);
        let Arrival::Taken { note, .. } =
            core.command(&TC, unsolicited(cmd(1, 1, true, 16, &DATA)), &dev, || ())
        else {
            panic!("a task");
        };
        assert!(note.is_none(), "{note:?}");
        assert_eq!(budget.0.load(Ordering::Acquire), 8192 - 4096);
        let _ = core.abort_where(|_| true, |_| ());
        assert_eq!(core.task_count(), 0);
        assert_eq!(
            budget.0.load(Ordering::Acquire),
            8192,
            "given back at its end"
        );
    }

    /// A command held for its turn keeps its immediate data, which holds room; without room it
    /// is answered TASK SET FULL at once (all of its data has come) and its CmdSN is used up.
    #[test]
    fn a_held_write_holds_room_for_its_data_or_is_answered_task_set_full() {
        static DATA: [u8; 512] = [1; 512];
        let (mut core, budget) = session(512);
        let dev = dev();
        // One block, all of it immediate, ahead of a gap: held with its 512 bytes.
        let Arrival::Taken { note, .. } = core.command(&TC, cmd(3, 3, true, 1, &DATA), &dev, || ())
        else {
            panic!("held");
        };
        assert!(note.is_none());
        assert_eq!(budget.0.load(Ordering::Acquire), 0);
        // Another one finds no room: TASK SET FULL now.
        let Arrival::Taken { note, .. } = core.command(&TC, cmd(2, 2, true, 1, &DATA), &dev, || ())
        else {
            panic!("answered");
        };
        assert!(matches!(note, Some(Note::HeldWithoutRoom)), "{note:?}");
        assert_eq!(statuses(&mut core), vec![(2, status::TASK_SET_FULL)]);
        // CmdSN 1 fills the gap; 2 was used up, so 3 comes up with it.
        let Arrival::Taken { runs, .. } = core.command(&TC, cmd(1, 1, false, 1, b""), &dev, || ())
        else {
            panic!("through the window");
        };
        assert_eq!(runs.len(), 2);
        drop(runs);
        assert_eq!(
            budget.0.load(Ordering::Acquire),
            512,
            "the held data let go"
        );
    }

    fn nop(itt: u32, cmd_sn: u32, immediate: bool) -> Pdu {
        Pdu::NopOut(mcsi_proto::pdu::NopOut {
            immediate,
            lun: 0,
            itt,
            ttt: mcsi_proto::pdu::RESERVED_TAG,
            cmd_sn,
            exp_stat_sn: 0,
            data: Bytes::from_static(b"ping"),
        })
    }

    fn echoes(core: &mut Core) -> Vec<u32> {
        sent(core, |p| match p {
            Pdu::NopIn(n) => Some(n.itt),
            _ => None,
        })
    }

    /// NOP-Out pings are the core's to echo: an immediate one at once, one in CmdSN order when
    /// its turn comes; the answer to the target's ping goes back to the keepalive.
    #[test]
    fn the_core_echoes_pings_in_their_order_and_hands_back_ping_answers() {
        let (mut core, _) = session(0);
        let dev = dev();
        let taken =
            |a: Arrival<Tc>| matches!(a, Arrival::Taken { runs, note: None } if runs.is_empty());
        assert!(taken(core.handle_pdu(&TC, nop(7, 1, true), &dev, || ())));
        assert_eq!(echoes(&mut core), vec![7]);
        // CmdSN 2 waits for 1.
        assert!(taken(core.handle_pdu(&TC, nop(9, 2, false), &dev, || ())));
        assert_eq!(echoes(&mut core), Vec::<u32>::new());
        assert!(taken(core.handle_pdu(&TC, nop(8, 1, false), &dev, || ())));
        assert_eq!(echoes(&mut core), vec![8, 9]);
        // The target's own ping, on passed-in time: sent after the interval without a byte
        // received, answered under its tag; an answer to no ping is noted.
        let t0 = std::time::Instant::now();
        let s = std::time::Duration::from_secs;
        core.start_keepalive(TC.cid(), s(5), s(2), t0);
        assert_eq!(core.poll_timeout(), Some(t0 + s(5)));
        core.conn_heard(TC.cid(), t0 + s(1));
        assert!(
            core.handle_timeout(t0 + s(5)).is_empty(),
            "heard since: not idle yet"
        );
        assert!(core.handle_timeout(t0 + s(6)).is_empty());
        let ttt = match core.poll_transmit() {
            Some((_, Pdu::NopIn(n))) if n.itt == mcsi_proto::pdu::RESERVED_TAG => n.ttt,
            other => panic!("a ping: {other:?}"),
        };
        let answer = |ttt: u32| {
            Pdu::NopOut(mcsi_proto::pdu::NopOut {
                immediate: true,
                lun: 0,
                itt: mcsi_proto::pdu::RESERVED_TAG,
                ttt,
                cmd_sn: 3,
                exp_stat_sn: 0,
                data: Bytes::new(),
            })
        };
        assert!(taken(core.handle_pdu(&TC, answer(ttt), &dev, || ())));
        assert!(matches!(
            core.handle_pdu(&TC, answer(ttt), &dev, || ()),
            Arrival::Taken {
                note: Some(Note::StrayPingAnswer { .. }),
                ..
            }
        ));
        // The next ping goes unanswered: the connection is given up.
        assert!(core.handle_timeout(t0 + s(11)).is_empty());
        assert!(matches!(core.poll_transmit(), Some((_, Pdu::NopIn(_)))));
        assert_eq!(
            core.handle_timeout(t0 + s(13)),
            vec![crate::session::Expired::PingUnanswered {
                cid: 1,
                ttt: ttt + 1,
                timeout: s(2)
            }]
        );
        assert_eq!(core.poll_timeout(), None, "it pings no more");
    }

    /// What has no place in a session is rejected and its CmdSN used up; Data-Out for a task
    /// of another connection ends this one.
    #[test]
    fn protocol_errors_are_rejected_or_end_the_connection() {
        let (mut core, _) = session(0);
        let dev = dev();
        // A SCSI command in a discovery session.
        core.set_discovery(true);
        let a = core.handle_pdu(&TC, Pdu::ScsiCommand(cmd(1, 1, false, 1, b"")), &dev, || ());
        assert!(matches!(
            a,
            Arrival::Taken {
                note: Some(Note::Protocol { opcode: 0x01 }),
                ..
            }
        ));
        assert!(matches!(core.poll_transmit(), Some((_, Pdu::Reject(_)))));
        core.set_discovery(false);
        // CmdSN 1 was used up: 2 is next and runs now.
        assert!(matches!(
            core.handle_pdu(&TC, Pdu::ScsiCommand(cmd(2, 2, false, 1, b"")), &dev, || ()),
            Arrival::Now(_)
        ));
        // An undecodable request with CmdSN 3 in its header: rejected, 3 used up.
        let mut h = vec![0u8; 48];
        h[0] = 0x01;
        h[24..28].copy_from_slice(&3u32.to_be_bytes());
        assert!(core
            .handle_undecodable(&TC, reject_reason::PROTOCOL_ERROR, Bytes::from(h))
            .is_empty());
        assert!(matches!(core.poll_transmit(), Some((_, Pdu::Reject(_)))));
        assert!(matches!(
            core.handle_pdu(&TC, Pdu::ScsiCommand(cmd(4, 4, false, 1, b"")), &dev, || ()),
            Arrival::Now(_)
        ));
        // A write on connection 1 of a session of two; its Data-Out on connection 2 ends that
        // one.
        let d = mcsi_proto::pdu::DataOut {
            final_: true,
            lun: 0,
            itt: 5,
            ttt: mcsi_proto::pdu::RESERVED_TAG,
            exp_stat_sn: 0,
            data_sn: 0,
            buffer_offset: 0,
            data: Bytes::from_static(&[0; 512]),
        };
        let mut other: SessionCore<Tc, ()> = SessionCore::new(1, 8, false, None);
        assert!(other.add_conn(Tc(1)).is_ok() && other.add_conn(Tc(2)).is_ok());
        let w = cmd(5, 1, true, 8, b"");
        assert!(matches!(
            other.handle_pdu(&Tc(1), Pdu::ScsiCommand(w), &dev, || ()),
            Arrival::Taken { note: None, .. }
        ));
        assert!(matches!(
            other.handle_pdu(&Tc(2), Pdu::DataOut(d), &dev, || ()),
            Arrival::End(Fault::NotAllegiant { itt: 5 })
        ));
    }

    /// Grants every write that asks, and returns the R2Ts that go out: (TTT, offset, length).
    fn r2ts(core: &mut Core) -> Vec<(u32, u32, u32)> {
        while let Some(g) = core.poll_grant() {
            assert!(core.grant(g.itt, g.id));
        }
        sent(core, |p| match p {
            Pdu::R2t(r) => Some((r.ttt, r.buffer_offset, r.desired_data_transfer_length)),
            _ => None,
        })
    }

    fn data_out(
        itt: u32,
        ttt: u32,
        data_sn: u32,
        offset: u32,
        data: Bytes,
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
            data,
        }
    }

    fn rejects(core: &mut Core) -> Vec<u8> {
        sent(core, |p| match p {
            Pdu::Reject(r) => Some(r.reason),
            _ => None,
        })
    }

    /// The bytes the ready task `itt` runs with.
    fn ready_data(core: &mut Core, itt: u32) -> Bytes {
        let r = core.poll_ready().expect("a task ready");
        assert_eq!(r.itt, itt);
        r.data.clone()
    }

    /// At ErrorRecoveryLevel 1 a data digest error loses only the data: a command keeps its
    /// place and asks for its immediate data again, a Data-Out keeps its place in its sequence
    /// and its bytes are asked for again once the sequence has ended (RFC 7143 7.8).
    #[test]
    fn data_lost_to_a_digest_error_is_asked_for_again_at_level_1() {
        let good = Bytes::from(vec![0x11u8; 4096]);
        let (mut core, budget) = session(1 << 20);
        core.set_error_recovery_level(1);
        let dev = dev();
        // A whole 4 KiB write as immediate data, damaged.
        let mut c = cmd(1, 1, true, 8, b"");
        c.data = Bytes::from(vec![0xeeu8; 4096]);
        let Arrival::Taken { note, .. } = core.handle_data_digest_error(
            &TC,
            Bytes::from(vec![0u8; 48]),
            Some(Pdu::ScsiCommand(c)),
            &dev,
            || (),
        ) else {
            panic!("the command is kept");
        };
        assert!(
            matches!(
                note,
                Some(Note::DataLost {
                    itt: 1,
                    offset: 0,
                    len: 4096
                })
            ),
            "{note:?}"
        );
        assert_eq!(rejects(&mut core), [reject_reason::DATA_DIGEST_ERROR]);
        let r = r2ts(&mut core);
        assert_eq!(
            r.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
            [(0, 4096)]
        );
        let a = core.data_out(1, &data_out(1, r[0].0, 0, 0, good.clone(), true));
        assert!(matches!(a, super::super::DataOutcome::Taken));
        assert_eq!(ready_data(&mut core, 1), good);
        let _ = core.finish(1, 0, &TC, None);

        // 8 KiB by R2T (InitialR2T stays No, but nothing comes unasked): the first 4 KiB PDU
        // is damaged, the second is sound.
        let c = cmd(2, 2, true, 16, b"");
        let Arrival::Taken { .. } = core.command(&TC, c, &dev, || ()) else {
            panic!("a write that needs R2Ts is a task");
        };
        let r = r2ts(&mut core);
        assert_eq!(
            r.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
            [(0, 8192)]
        );
        let damaged = data_out(2, r[0].0, 0, 0, Bytes::from(vec![0xeeu8; 4096]), false);
        let Arrival::Taken { note, .. } = core.handle_data_digest_error(
            &TC,
            Bytes::from(vec![0u8; 48]),
            Some(Pdu::DataOut(damaged)),
            &dev,
            || (),
        ) else {
            panic!("the Data-Out keeps its place");
        };
        assert!(
            matches!(
                note,
                Some(Note::DataLost {
                    itt: 2,
                    offset: 0,
                    len: 4096
                })
            ),
            "{note:?}"
        );
        assert_eq!(rejects(&mut core), [reject_reason::DATA_DIGEST_ERROR]);
        // Nothing is asked for again while its sequence is open.
        assert!(r2ts(&mut core).is_empty());
        let second = Bytes::from(vec![0x22u8; 4096]);
        core.data_out(1, &data_out(2, r[0].0, 1, 4096, second.clone(), true));
        let again = r2ts(&mut core);
        assert_eq!(
            again.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(),
            [(0, 4096)]
        );
        assert_ne!(again[0].0, r[0].0, "a recovery R2T has a TTT of its own");
        core.data_out(1, &data_out(2, again[0].0, 0, 0, good.clone(), true));
        let data = ready_data(&mut core, 2);
        assert_eq!((&data[..4096], &data[4096..]), (&good[..], &second[..]));
        let _ = core.finish(2, 0, &TC, None);
        core.close(|_| ());
        assert_eq!(budget.0.load(Ordering::Acquire), 1 << 20);
    }

    /// At level 0 a damaged command is rejected and its CmdSN used up, as before.
    #[test]
    fn at_level_0_a_damaged_command_is_rejected_and_gone() {
        let (mut core, _) = session(1 << 20);
        let dev = dev();
        let mut c = cmd(1, 1, true, 8, b"");
        c.data = Bytes::from(vec![0xeeu8; 4096]);
        let mut h = vec![0u8; 48];
        h[0] = 0x01;
        h[24..28].copy_from_slice(&1u32.to_be_bytes());
        let Arrival::Taken { .. } = core.handle_data_digest_error(
            &TC,
            Bytes::from(h),
            Some(Pdu::ScsiCommand(c)),
            &dev,
            || (),
        ) else {
            panic!("rejected");
        };
        assert_eq!(rejects(&mut core), [reject_reason::DATA_DIGEST_ERROR]);
        assert_eq!(core.task_count(), 0);
        assert_eq!(core.cmd_sns().0, 2, "its CmdSN is used up");
    }
}
