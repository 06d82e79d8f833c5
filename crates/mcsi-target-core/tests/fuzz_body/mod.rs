//! The target's session core driven by arbitrary PDU sequences, with no runtime, no sockets and
//! no threads: the body of the `session_core` fuzz target (`crates/mcsi-target-core/fuzz`), and
//! of a test that runs it on pseudo-random inputs under `cargo test`.
//!
//! One session of one to three connections, burst values, queue depth and Data-Out timeout from
//! the input, a RAM LUN 0 (LUN 1 does not exist), and the server's unsolicited budget counted.
//! The input is a sequence of actions: SCSI commands (READ/WRITE 10 and 16, TEST UNIT READY,
//! INQUIRY, SYNCHRONIZE CACHE or arbitrary CDBs; arbitrary flags, task attribute, expected
//! length, immediate data, CmdSN near the window or anywhere, fresh or reused ITTs), Data-Out
//! answering the R2Ts and unsolicited bursts the target is owed (mostly right, sometimes with a
//! wrong offset, DataSN or connection), arbitrary Data-Out, NOP-Out, task management, logout,
//! undecodable PDUs, and time passing. The driver does what the tokio layer does: runs what the
//! core hands out on the device server, answers task management that spans the target, and
//! closes what the core closes.
//!
//! In half the inputs the session is at ErrorRecoveryLevel 1: what the core sends is stamped and
//! recorded in each connection's log as the tokio layer's writer does, PDUs acknowledge
//! statuses, and SNACKs of every type (for tasks and ranges sent or not) are answered from the
//! log, whose bounds come from the input. Now and then a command's immediate data or a Data-Out
//! arrives with a data digest error: rejected, and at level 1 asked for again by recovery R2Ts
//! that the driver pays like any other. In a third of the inputs the session is at level 2:
//! connections die now and then (their tasks wait to be reassigned for DefaultTime2Retain, on
//! virtual time), others log in, and TASK REASSIGN moves tasks of failed connections.
//!
//! Checked: nothing panics; every PDU the core sends is a target PDU; R2Ts ask for at most
//! MaxBurstLength and within the expected length; Data-In fits the connection's
//! MaxRecvDataSegmentLength and the expected length; responses answer commands that were sent;
//! ExpCmdSN never goes back and MaxCmdSN >= ExpCmdSN - 1. When the session closes, no task is
//! left and the unsolicited budget is whole again. What a SNACK has sent again is a PDU of the
//! task it names, within MaxRecvDataSegmentLength, with a StatSN sent before, and the logs stay
//! within their bounds.

use bytes::Bytes;
use mcsi_proto::codes::tmf_function::TASK_REASSIGN;
use mcsi_proto::codes::tmf_response;
use mcsi_proto::pdu::{
    reject_reason, DataOut, LogoutRequest, NopOut, Pdu, ScsiCommand, SnackRequest, TaskAttr,
    TaskMgmtRequest, RESERVED_TAG,
};
use mcsi_proto::serial::Sn;
use mcsi_proto::vendor::ConnRole;
use mcsi_scsi::{DeviceServer, LogicalUnit, LuConfig, Nexus, Outcome, TaskAttribute};
use mcsi_target_core::control::{tmf_pdu, Reset, Tmf};
use mcsi_target_core::datain::{read_expected, response_pdus};
use mcsi_target_core::retain::{LogBounds, SentLog};
use mcsi_target_core::session::{
    Arrival, Close, CoreConn, OrderedRun, SessionCore, SharedBudget, TmfStep,
};
use mcsi_target_core::transfer::BurstParams;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The initiator's MaxRecvDataSegmentLength on every connection.
const MRDSL: u32 = 8192;
/// The server's unsolicited budget: small, so that writes are refused now and then.
const UNSOLICITED: u64 = 64 << 10;
/// Most actions per input.
const MAX_STEPS: usize = 400;

/// One of the session's connections, as the core knows it.
#[derive(Debug, Clone)]
struct Tc(u16);

impl CoreConn for Tc {
    fn cid(&self) -> u16 {
        self.0
    }
    fn role(&self) -> ConnRole {
        ConnRole::Both
    }
    fn same(&self, o: &Self) -> bool {
        self.0 == o.0
    }
    fn max_data_in(&self) -> u32 {
        MRDSL
    }
}

/// The server's unsolicited budget, counted in bytes.
struct Budget(AtomicU64);

impl SharedBudget for Budget {
    fn try_take(&self, bytes: u32) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| {
                f.checked_sub(u64::from(bytes))
            })
            .is_ok()
    }
    fn give_back(&self, bytes: u32) {
        self.0.fetch_add(u64::from(bytes), Ordering::AcqRel);
    }
}

/// The device server, shared by every input (what LUN 0 keeps carries over, as on a real
/// target).
fn dev() -> &'static DeviceServer {
    static DEV: OnceLock<DeviceServer> = OnceLock::new();
    DEV.get_or_init(|| {
        let backend = mcsi_scsi::backend::open_backend("ram:1MiB").expect("a RAM LUN");
        DeviceServer::new(vec![(
            0,
            Arc::new(LogicalUnit::new(backend, LuConfig::default())),
        )])
    })
}

/// The fuzz input, read a field at a time; zeros once it is used up.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn done(&self) -> bool {
        self.0.is_empty()
    }
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
    /// True about once in `n`.
    fn one_in(&mut self, n: u8) -> bool {
        self.u8().is_multiple_of(n)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.u8()).collect()
    }
}

/// Data the target is owed for a write: an R2T's, or the rest of an unsolicited burst.
#[derive(Debug, Clone)]
struct Owed {
    cid: u16,
    itt: u32,
    ttt: u32,
    offset: u32,
    len: u32,
}

/// What an input made the session do.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub steps: u64,
    /// SCSI responses (status, alone or with the last Data-In).
    pub statuses: u64,
    pub r2ts: u64,
    pub data_in_bytes: u64,
    pub rejects: u64,
    /// SNACKs taken at ErrorRecoveryLevel 1, and the PDUs they had sent again.
    pub snacks: u64,
    pub resent: u64,
    /// PDUs that arrived with a data digest error.
    pub damaged: u64,
    /// Level 2: connections that logged in after others failed, and tasks reassigned.
    pub joined: u64,
    pub reassigned: u64,
    /// Inputs whose session ended before the input did (a fault, a logout).
    pub ended_early: u64,
}

struct World {
    stats: Stats,
    core: SessionCore<Tc, ()>,
    conns: Vec<u16>,
    burst: BurstParams,
    budget: Arc<Budget>,
    nexus: Nexus,
    now: Instant,
    /// The next CmdSN the initiator would use.
    cmd_sn: u32,
    next_itt: u32,
    /// The expected data transfer length of each ITT sent (the largest, for a reused ITT).
    edtl: HashMap<u32, u32>,
    owed: Vec<Owed>,
    /// Data-In bytes sent per ITT.
    data_in: HashMap<u32, u64>,
    /// The target's pings not answered yet: connection and TTT.
    pings: Vec<(u16, u32)>,
    /// The last (ExpCmdSN, MaxCmdSN) seen.
    window: (u32, u32),
    ended: bool,
    erl: u8,
    /// ErrorRecoveryLevel 1: what each connection sent (the tokio layer's writer stamps and
    /// records it), its next StatSN, and the bounds of its log.
    logs: Option<HashMap<u16, (SentLog, u32)>>,
    bounds: LogBounds,
}

/// Runs one input through a fresh session.
pub fn run(data: &[u8]) -> Stats {
    let mut inp = Input(data);
    let fbl = 512 * (1 + u32::from(inp.u8() % 64));
    let burst = BurstParams {
        initial_r2t: inp.bool(),
        immediate_data: inp.bool(),
        first_burst_length: fbl,
        max_burst_length: fbl.max(512 * (1 + u32::from(inp.u8() % 128))),
        max_outstanding_r2t: 1 + u32::from(inp.u8() % 4),
    };
    let conns = 1 + u16::from(inp.u8() % 3);
    let queue_depth = 1 + u32::from(inp.u8() % 16);
    let mut core = SessionCore::new(1, queue_depth, false, None);
    core.set_burst(burst);
    core.set_data_out_timeout(Duration::from_secs(1 + u64::from(inp.u8() % 8)));
    let budget = Arc::new(Budget(AtomicU64::new(UNSOLICITED)));
    core.set_unsolicited_budget(budget.clone());
    // Keepalive pings now and then (their intervals pass in a few time steps).
    let ping = Duration::from_millis(u64::from(inp.u8()) * 20);
    // ErrorRecoveryLevel 1 in half the inputs, with a log small enough to let things go.
    // ErrorRecoveryLevel 0, 1 or 2 (a failed connection's tasks wait to be reassigned).
    let erl = inp.u8() % 3;
    core.set_error_recovery_level(erl);
    core.set_time2retain(Duration::from_secs(1 + u64::from(inp.u8() % 8)));
    let bounds = LogBounds {
        bytes: 1024 * (1 + u64::from(inp.u8())),
        statuses: 1 + usize::from(inp.u8() % 32),
        tasks: 1 + usize::from(inp.u8() % 16),
    };
    let now = Instant::now();
    for cid in 0..conns {
        assert!(core.add_conn(Tc(cid)).is_ok());
        core.start_keepalive(cid, ping, ping, now);
    }
    let window = core.cmd_sns();
    let mut w = World {
        stats: Stats::default(),
        core,
        conns: (0..conns).collect(),
        burst,
        budget,
        nexus: Nexus {
            initiator_port: "iqn.2026-01.org.mcsi:fuzzer,i,0x800000000001".into(),
            target_port: "iqn.2026-01.org.mcsi:fuzz,t,0x0001".into(),
            relative_port: 1,
        },
        now,
        pings: Vec::new(),
        cmd_sn: 1,
        next_itt: 1,
        edtl: HashMap::new(),
        owed: Vec::new(),
        data_in: HashMap::new(),
        window,
        ended: false,
        erl,
        logs: (erl > 0).then(|| {
            (0..conns)
                .map(|cid| (cid, (SentLog::new(bounds), 1)))
                .collect()
        }),
        bounds,
    };
    let mut steps = 0;
    while !inp.done() && !w.ended && steps < MAX_STEPS {
        steps += 1;
        w.step(&mut inp);
        w.settle();
    }
    w.stats.steps = steps as u64;
    if w.ended {
        w.stats.ended_early = 1;
    } else {
        w.core.close(|_| ());
        w.settle();
    }
    assert_eq!(
        w.core.task_count(),
        0,
        "tasks left after the session closed"
    );
    assert_eq!(
        w.budget.0.load(Ordering::Acquire),
        UNSOLICITED,
        "the unsolicited budget is not whole after the session closed"
    );
    w.stats
}

impl World {
    /// One of the session's connections (at level 2 there may be none for a while: then a
    /// CID no PDU is delivered on).
    fn cid(&self, inp: &mut Input<'_>) -> u16 {
        let i = usize::from(inp.u8());
        if self.conns.is_empty() {
            return u16::MAX;
        }
        self.conns[i % self.conns.len()]
    }

    /// The CmdSN of the next request: mostly the next one, sometimes near it, now and then
    /// anywhere.
    fn next_cmd_sn(&mut self, inp: &mut Input<'_>, immediate: bool) -> u32 {
        match inp.u8() % 16 {
            0 => inp.u32(),
            1 => self.cmd_sn.wrapping_add(u32::from(inp.u8() % 4)),
            2 => self.cmd_sn.wrapping_sub(1 + u32::from(inp.u8() % 3)),
            _ => {
                let sn = self.cmd_sn;
                if !immediate {
                    self.cmd_sn = sn.wrapping_add(1);
                }
                sn
            }
        }
    }

    fn itt(&mut self, inp: &mut Input<'_>) -> u32 {
        if inp.one_in(8) && !self.edtl.is_empty() {
            // One in use, or used before.
            let n = usize::from(inp.u8()) % self.edtl.len();
            return *self.edtl.keys().nth(n).unwrap_or(&1);
        }
        self.next_itt = self.next_itt.wrapping_add(1);
        self.next_itt
    }

    fn step(&mut self, inp: &mut Input<'_>) {
        match inp.u8() % 16 {
            0..=5 => self.command(inp),
            6..=8 => self.pay(inp),
            // Data-Out for anything: most likely the end of the session, so not too often.
            9 if inp.one_in(4) => {
                let cid = self.cid(inp);
                let d = DataOut {
                    final_: inp.bool(),
                    lun: 0,
                    itt: inp.u32() % 64,
                    ttt: if inp.bool() {
                        RESERVED_TAG
                    } else {
                        inp.u32() % 64
                    },
                    exp_stat_sn: 0,
                    data_sn: u32::from(inp.u8() % 4),
                    buffer_offset: u32::from(inp.u16()),
                    data: Bytes::from(vec![0x5a; usize::from(inp.u16() % 9000)]),
                };
                self.deliver(cid, Pdu::DataOut(d));
            }
            // The answer to one of the target's pings (or to none).
            10 if !self.pings.is_empty() && inp.bool() => {
                let (cid, ttt) = self.pings.remove(usize::from(inp.u8()) % self.pings.len());
                let n = NopOut {
                    immediate: true,
                    lun: 0,
                    itt: RESERVED_TAG,
                    ttt: if inp.one_in(8) {
                        ttt.wrapping_add(1)
                    } else {
                        ttt
                    },
                    cmd_sn: self.cmd_sn,
                    exp_stat_sn: 0,
                    data: Bytes::new(),
                };
                self.deliver(cid, Pdu::NopOut(n));
            }
            10 => {
                let cid = self.cid(inp);
                let immediate = inp.bool();
                let n = NopOut {
                    immediate,
                    lun: 0,
                    itt: if inp.one_in(4) {
                        RESERVED_TAG
                    } else {
                        self.itt(inp)
                    },
                    ttt: if inp.one_in(4) {
                        inp.u32()
                    } else {
                        RESERVED_TAG
                    },
                    cmd_sn: self.next_cmd_sn(inp, immediate),
                    exp_stat_sn: 0,
                    data: {
                        let n = usize::from(inp.u8() % 32);
                        Bytes::from(inp.bytes(n))
                    },
                };
                self.deliver(cid, Pdu::NopOut(n));
            }
            11 => {
                let cid = self.cid(inp);
                let immediate = inp.bool();
                // Level 2: TASK REASSIGN now and then.
                let function = if self.erl == 2 && inp.one_in(3) {
                    TASK_REASSIGN
                } else {
                    1 + inp.u8() % 8
                };
                // TASK REASSIGN mostly names a task of a failed connection (as the initiator
                // knows them), else any command sent.
                let pick = usize::from(inp.u8());
                let orphans: Vec<u32> = self
                    .edtl
                    .keys()
                    .copied()
                    .filter(|i| self.core.task(*i).is_some_and(|t| t.orphaned))
                    .collect();
                let referenced_task_tag = match (
                    orphans.get(pick % orphans.len().max(1)),
                    self.edtl.keys().nth(pick % self.edtl.len().max(1)),
                ) {
                    (Some(itt), _) if function == TASK_REASSIGN && !inp.one_in(4) => *itt,
                    (_, Some(itt)) if function == TASK_REASSIGN || inp.bool() => *itt,
                    _ => inp.u32() % 64,
                };
                let t = TaskMgmtRequest {
                    immediate,
                    function,
                    lun: u64::from(inp.one_in(8)) << 48,
                    itt: self.itt(inp),
                    referenced_task_tag,
                    cmd_sn: self.next_cmd_sn(inp, immediate),
                    exp_stat_sn: 0,
                    ref_cmd_sn: self.cmd_sn.wrapping_sub(u32::from(inp.u8() % 4)),
                    exp_data_sn: 0,
                };
                self.deliver(cid, Pdu::TaskMgmtRequest(t));
            }
            // Level 2: a connection logs in (a new CID, or that of one that failed).
            12 if self.erl == 2 && self.conns.len() < 3 && inp.one_in(3) => {
                let cid = u16::from(inp.u8() % 4);
                if !self.conns.contains(&cid) && self.core.add_conn(Tc(cid)).is_ok() {
                    self.conns.push(cid);
                    self.stats.joined += 1;
                    if let Some(logs) = self.logs.as_mut() {
                        logs.insert(cid, (SentLog::new(self.bounds), 1));
                    }
                }
            }
            12 if inp.one_in(4) => {
                let cid = self.cid(inp);
                let immediate = inp.bool();
                let l = LogoutRequest {
                    immediate,
                    reason: inp.u8() % 4,
                    itt: self.itt(inp),
                    cid: if inp.bool() {
                        cid
                    } else {
                        u16::from(inp.u8() % 4)
                    },
                    cmd_sn: self.next_cmd_sn(inp, immediate),
                    exp_stat_sn: 0,
                };
                self.deliver(cid, Pdu::LogoutRequest(l));
            }
            // Level 2: a connection dies (a reset, a route gone).
            13 if self.erl == 2 && inp.one_in(3) => {
                let cid = self.cid(inp);
                if self.conns.contains(&cid) {
                    self.lose(cid);
                }
            }
            13 => {
                let cid = self.cid(inp);
                let mut h = inp.bytes(48);
                h[0] &= 0x7f;
                let runs = self.core.handle_undecodable(
                    &Tc(cid),
                    reject_reason::PROTOCOL_ERROR,
                    Bytes::from(h),
                );
                self.carry_out(runs.into());
            }
            15 if self.logs.is_some() => self.snack(inp),
            14 => {
                // Mostly less than the Data-Out timeout, now and then far more.
                let ms = if inp.one_in(8) {
                    u64::from(inp.u16()) * 4
                } else {
                    u64::from(inp.u8()) * 4
                };
                self.now += Duration::from_millis(ms);
                for f in self.core.handle_timeout(self.now) {
                    // A write whose data stopped coming ends its connection, and at
                    // ErrorRecoveryLevel 0 its session.
                    self.lose(f.cid());
                }
                // Level 2: no connection, and nothing left to reassign: the session is over.
                if !self.ended && self.conns.is_empty() && !self.core.retaining() {
                    self.core.close(|_| ());
                    self.ended = true;
                }
            }
            _ => {}
        }
    }

    fn command(&mut self, inp: &mut Input<'_>) {
        let cid = self.cid(inp);
        let lun = u64::from(inp.one_in(8)) << 48;
        let blocks = u32::from(inp.u8() % 64);
        let lba = u32::from(inp.u16() % 2100);
        let (cdb, write): (Vec<u8>, bool) = match inp.u8() % 10 {
            0..=2 => {
                let mut c = vec![0x28, 0, 0, 0, 0, 0, 0, 0, 0, 0];
                c[2..6].copy_from_slice(&lba.to_be_bytes());
                c[7..9].copy_from_slice(&(blocks as u16).to_be_bytes());
                (c, false)
            }
            3..=5 => {
                let mut c = vec![0x2a, 0, 0, 0, 0, 0, 0, 0, 0, 0];
                c[2..6].copy_from_slice(&lba.to_be_bytes());
                c[7..9].copy_from_slice(&(blocks as u16).to_be_bytes());
                (c, true)
            }
            6 => {
                let mut c = vec![0x8a; 16];
                c[1] = 0;
                c[2..10].copy_from_slice(&u64::from(lba).to_be_bytes());
                c[10..14].copy_from_slice(&blocks.to_be_bytes());
                c[14] = 0;
                c[15] = 0;
                (c, true)
            }
            7 => (vec![0x00; 6], false),
            8 => (vec![0x12, 0, 0, 0, 96, 0], false),
            _ => {
                let len = [6, 10, 12, 16][usize::from(inp.u8() % 4)];
                let c = inp.bytes(len);
                let write = inp.bool();
                (c, write)
            }
        };
        let natural = blocks * 512;
        let edtl = match inp.u8() % 8 {
            0 => u32::from(inp.u16()),
            1 => natural / 2,
            _ => natural,
        };
        let immediate = inp.one_in(6);
        let imm_len = if write && self.burst.immediate_data && inp.bool() {
            (u32::from(inp.u16()) % (self.burst.first_burst_length + 1024)).min(edtl + 512)
        } else if inp.one_in(16) {
            u32::from(inp.u8())
        } else {
            0
        };
        // F clear: the unsolicited burst goes on after the immediate data.
        let final_ = if write && !self.burst.initial_r2t {
            inp.bool()
        } else {
            !inp.one_in(16)
        };
        let attr = match inp.u8() % 8 {
            0 => TaskAttr::Ordered,
            1 => TaskAttr::HeadOfQueue,
            2 => TaskAttr::Aca,
            _ => TaskAttr::Simple,
        };
        let itt = self.itt(inp);
        let c = ScsiCommand {
            immediate,
            final_,
            read: !write,
            write,
            attr,
            lun,
            itt,
            expected_data_transfer_length: edtl,
            cmd_sn: self.next_cmd_sn(inp, immediate),
            exp_stat_sn: 0,
            cdb: Bytes::from(cdb),
            bidi_read_length: None,
            data: Bytes::from(vec![0xa5; imm_len as usize]),
        };
        let e = self.edtl.entry(itt).or_insert(0);
        *e = (*e).max(edtl);
        if write && !final_ {
            let end = self.burst.first_burst_length.min(edtl);
            if end > imm_len {
                self.owed.push(Owed {
                    cid,
                    itt,
                    ttt: RESERVED_TAG,
                    offset: imm_len,
                    len: end - imm_len,
                });
            }
        }
        if !c.data.is_empty() && inp.one_in(12) {
            self.deliver_damaged(cid, Pdu::ScsiCommand(c));
        } else {
            self.deliver(cid, Pdu::ScsiCommand(c));
        }
    }

    /// `p` arrives with a data digest error: what the tokio layer's reader does with it.
    fn deliver_damaged(&mut self, cid: u16, p: Pdu) {
        if !self.conns.contains(&cid) {
            return;
        }
        self.stats.damaged += 1;
        let header = p.encode(&mcsi_proto::pdu::Framing {
            header_digest: false,
            data_digest: false,
            max_data_segment_length: u32::MAX,
        });
        let header = Bytes::copy_from_slice(&header.header()[..48]);
        let a = self
            .core
            .handle_data_digest_error(&Tc(cid), header, Some(p), dev(), || ());
        self.arrived(cid, a);
    }

    /// A SNACK (ErrorRecoveryLevel 1) of any type, for tasks sent or not, for ranges sent or
    /// not, acknowledging statuses up to near the connection's next StatSN.
    fn snack(&mut self, inp: &mut Input<'_>) {
        let cid = self.cid(inp);
        let next = self
            .logs
            .as_ref()
            .and_then(|l| l.get(&cid))
            .map_or(1, |l| l.1);
        // Mostly a read that got Data-In, else any command sent, now and then any ITT.
        let pick = usize::from(inp.u8());
        let read = self.data_in.keys().nth(pick % self.data_in.len().max(1));
        let sent = self.edtl.keys().nth(pick % self.edtl.len().max(1));
        let itt = match (inp.u8() % 8, read, sent) {
            (0..=4, Some(itt), _) | (0..=6, _, Some(itt)) => *itt,
            _ => inp.u32() % 64,
        };
        let s = SnackRequest {
            snack_type: inp.u8() % 5,
            lun: 0,
            itt,
            ttt: if inp.bool() {
                RESERVED_TAG
            } else {
                inp.u32() % 64
            },
            // Half the time acknowledging nothing new, so that there is something to ask for.
            exp_stat_sn: if inp.bool() {
                0
            } else {
                next.wrapping_sub(u32::from(inp.u8() % 8))
            },
            beg_run: match inp.u8() % 4 {
                0 => 0,
                1 => next.wrapping_sub(u32::from(inp.u8() % 8)),
                2 => inp.u32(),
                _ => u32::from(inp.u8() % 8),
            },
            run_length: u32::from(inp.u8() % 4),
        };
        self.deliver(cid, Pdu::SnackRequest(s));
    }

    /// Sends data the target is owed: mostly right, sometimes with a fault.
    fn pay(&mut self, inp: &mut Input<'_>) {
        if self.owed.is_empty() {
            return;
        }
        let o = self.owed.remove(usize::from(inp.u8()) % self.owed.len());
        let fault = inp.u8() % 48;
        let cid = if fault == 0 { self.cid(inp) } else { o.cid };
        let mut offset = o.offset;
        let mut data_sn = 0;
        let end = o.offset + o.len;
        while offset < end {
            let n = (end - offset).min(MRDSL);
            let d = DataOut {
                final_: offset + n == end,
                lun: 0,
                itt: o.itt,
                ttt: o.ttt,
                exp_stat_sn: 0,
                data_sn: if fault == 1 { data_sn + 1 } else { data_sn },
                buffer_offset: if fault == 2 { offset + 512 } else { offset },
                data: Bytes::from(vec![0x3c; n as usize]),
            };
            // Now and then its data digest fails: rejected, and at ErrorRecoveryLevel 1 asked
            // for again with a recovery R2T.
            if fault == 3 || (fault == 4 && offset == o.offset) {
                self.deliver_damaged(cid, Pdu::DataOut(d));
            } else {
                self.deliver(cid, Pdu::DataOut(d));
            }
            if self.ended {
                return;
            }
            offset += n;
            data_sn += 1;
        }
    }

    fn deliver(&mut self, cid: u16, p: Pdu) {
        if !self.conns.contains(&cid) {
            return;
        }
        self.core.conn_heard(cid, self.now);
        if let (Some(logs), Some(e)) = (self.logs.as_mut(), p.exp_stat_sn()) {
            if let Some((log, _)) = logs.get_mut(&cid) {
                log.ack(e);
            }
        }
        let a = self.core.handle_pdu(&Tc(cid), p, dev(), || ());
        self.arrived(cid, a);
    }

    /// Carries out what the core decided for a PDU that arrived on `cid`.
    fn arrived(&mut self, cid: u16, a: Arrival<Tc>) {
        match a {
            Arrival::Now(now) => {
                let o = self.execute(&now.cmd, now.data, TaskAttribute::Simple);
                let out = now.claim.reply.unwrap_or(Tc(cid));
                self.respond(&out, &now.cmd, now.phase, o);
                if now.claim.tracked {
                    self.core.release_inline(now.cmd.lun);
                }
            }
            Arrival::Taken { runs, .. } => self.carry_out(runs.into()),
            Arrival::Snack(s) => self.answer_snack(cid, s),
            Arrival::End(_) => self.lose(cid),
        }
    }

    /// What the tokio layer's reader does with a SNACK: answered from the connection's log, or
    /// rejected. What is sent again must be what was sent, within the rules.
    fn answer_snack(&mut self, cid: u16, s: SnackRequest) {
        let Some((log, next)) = self.logs.as_mut().and_then(|l| l.get_mut(&cid)) else {
            panic!("a SNACK reached the core at ErrorRecoveryLevel 0: {s:?}");
        };
        let next = *next;
        self.stats.snacks += 1;
        match log.snack(&s, MRDSL) {
            Ok(pdus) => {
                // Data/R2T and R-Data SNACKs name their task; a Status SNACK does not.
                let task = matches!(s.snack_type, 0 | 3).then_some(s.itt);
                for p in &pdus {
                    let itt = match p {
                        Pdu::DataIn(d) => {
                            assert!(d.data.len() as u32 <= MRDSL, "Data-In beyond MRDSL");
                            Some(d.itt)
                        }
                        Pdu::R2t(r) => Some(r.itt),
                        Pdu::ScsiResponse(r) => Some(r.itt),
                        _ => None,
                    };
                    if task.is_some() {
                        assert_eq!(itt, task, "resent for {s:?}");
                    }
                    if let Some((sn, true)) = p.stat_sn() {
                        assert!(Sn::lt(Sn(sn), Sn(next)), "StatSN {sn} never sent: {p:?}");
                    }
                }
                self.stats.resent += pdus.len() as u64;
            }
            Err(_) => self.stats.rejects += 1,
        }
        assert!(log.statuses() <= self.bounds.statuses && log.tasks() <= self.bounds.tasks);
    }

    /// A connection ended by a fault: at ErrorRecoveryLevel 0 the session ends with it.
    fn lose(&mut self, cid: u16) {
        // At level 2 its tasks wait to be reassigned and the session goes on.
        let lost = self.core.conn_failed(&Tc(cid), self.now, |_| ());

        self.conns.retain(|c| *c != cid);
        if lost.session_ends || (self.conns.is_empty() && !self.core.retaining()) {
            self.core.close(|_| ());
            self.ended = true;
        }
    }

    fn carry_out(&mut self, mut runs: VecDeque<OrderedRun<Tc>>) {
        while let Some(r) = runs.pop_front() {
            match r {
                OrderedRun::Inline(d, claim) => {
                    let data = d.data_out();
                    let o = self.execute(&d.cmd, data, TaskAttribute::Simple);
                    let out = claim.reply.clone().unwrap_or_else(|| d.conn.clone());
                    self.respond(&out, &d.cmd, d.phase, o);
                    if claim.tracked {
                        self.core.release_inline(d.cmd.lun);
                    }
                }
                OrderedRun::Task(d) => {
                    let (more, _) = self.core.start_held(*d, ());
                    runs.extend(more);
                }
                OrderedRun::Control(c, Pdu::TaskMgmtRequest(t)) => self.tmf(&c, t, &mut runs),
                OrderedRun::Control(c, Pdu::LogoutRequest(l)) => {
                    // Busy: an immediate logout beyond the answers that may wait; rejected.
                    let _ = self.core.logout(&c, &l, |_| ());
                }
                OrderedRun::Control(..) => {}
            }
        }
    }

    fn tmf(&mut self, c: &Tc, t: TaskMgmtRequest, runs: &mut VecDeque<OrderedRun<Tc>>) {
        let plan = Tmf::plan(&t, dev().lu(t.lun).is_some());

        let response = match self
            .core
            .task_management(c, t.itt, &plan, t.immediate, |_| ())
        {
            TmfStep::Answered {
                runs: more,
                response,
            } => {
                if matches!(plan, Tmf::Reassign { .. }) && response == tmf_response::COMPLETE {
                    self.stats.reassigned += 1;
                }
                runs.extend(more);
                return;
            }
            TmfStep::Busy => return,
            // Nothing runs inline here between two inputs.
            TmfStep::AfterInline { ref_cmd_sn, cmd_sn } => {
                match self.core.take_as_received(ref_cmd_sn, cmd_sn) {
                    Some(more) => {
                        runs.extend(more);
                        tmf_response::COMPLETE
                    }
                    None => tmf_response::NO_TASK,
                }
            }
            TmfStep::OnTarget => {
                let _ = self.core.abort_where(|e| plan.aborts(e), |_| ());
                if let Tmf::AbortOnTarget { reset, .. } = plan {
                    match reset {
                        Reset::Nothing => {}
                        Reset::Lun(lun) => {
                            if let Some(lu) = dev().lu(lun) {
                                lu.reset();
                            }
                        }
                        Reset::Target | Reset::TargetCold => dev().reset_all(),
                    }
                }
                tmf_response::COMPLETE
            }
        };
        self.check(c.0, &tmf_pdu(t.itt, response));
    }

    /// Grants, runs what the core hands out, and checks what it sends, until it is quiet.
    fn settle(&mut self) {
        loop {
            let mut progress = false;
            while let Some(g) = self.core.poll_grant() {
                let _ = self.core.grant(g.itt, g.id);
                progress = true;
            }
            let mut ready = Vec::new();
            while let Some(r) = self.core.poll_ready() {
                let a = r.answer.expect("a task registered with its command");
                ready.push((r.itt, r.id, r.conn, r.attr, r.data, a.cmd.clone()));
            }
            for (itt, id, conn, attr, data, cmd) in ready {
                let o = self.execute(&cmd, data, attr);
                let _ = self.core.finish(itt, id, &conn, Some(o));
                progress = true;
            }
            while let Some((c, p)) = self.core.poll_transmit() {
                self.check(c.0, &p);
                progress = true;
            }
            while let Some((c, how)) = self.core.poll_close() {
                assert!(matches!(how, Close::AfterFlush | Close::Now));
                let lost = self.core.conn_lost(&c, |_| ());
                self.conns.retain(|x| *x != c.0);
                if lost.session_ends {
                    self.core.close(|_| ());
                    self.ended = true;
                }
                progress = true;
            }
            if !progress {
                return;
            }
        }
    }

    fn execute(&self, c: &ScsiCommand, data_out: Bytes, attr: TaskAttribute) -> Outcome {
        dev().execute(
            c.lun,
            mcsi_scsi::Command {
                nexus: &self.nexus,
                cdb: &c.cdb,
                data_out,
                data_in_limit: read_expected(c),
                attr,
                pace: None,
            },
        )
    }

    fn respond(&mut self, out: &Tc, c: &ScsiCommand, phase: mcsi_scsi::DataPhase, o: Outcome) {
        for p in response_pdus(c, phase, o, out.max_data_in(), self.burst.max_burst_length) {
            self.check(out.0, &p);
        }
    }

    /// What the target sends must be a target PDU within the rules. At ErrorRecoveryLevel 1
    /// it is stamped and recorded as the writer does.
    fn check(&mut self, cid: u16, p: &Pdu) {
        if let Some((log, stat_sn)) = self.logs.as_mut().and_then(|l| l.get_mut(&cid)) {
            let (exp, max) = self.core.cmd_sns();
            let mut q = p.clone();
            q.stamp(stat_sn, exp, max);
            log.record(q);
        }
        let edtl = |itt: u32| self.edtl.get(&itt).copied();
        match p {
            Pdu::R2t(r) => {
                self.stats.r2ts += 1;
                let e = edtl(r.itt).expect("an R2T for a command sent");
                assert!(r.desired_data_transfer_length > 0, "{r:?}");
                assert!(
                    r.desired_data_transfer_length <= self.burst.max_burst_length,
                    "R2T beyond MaxBurstLength: {r:?}"
                );
                assert!(
                    u64::from(r.buffer_offset) + u64::from(r.desired_data_transfer_length)
                        <= u64::from(e),
                    "R2T beyond the expected length {e}: {r:?}"
                );
                let cid = self.conns.first().copied().unwrap_or(0);
                self.owed.push(Owed {
                    cid: self.task_cid(r.itt).unwrap_or(cid),
                    itt: r.itt,
                    ttt: r.ttt,
                    offset: r.buffer_offset,
                    len: r.desired_data_transfer_length,
                });
            }
            Pdu::DataIn(d) => {
                let e = edtl(d.itt).expect("Data-In for a command sent");
                assert!(d.data.len() as u32 <= MRDSL, "Data-In beyond MRDSL");
                assert!(
                    u64::from(d.buffer_offset) + d.data.len() as u64 <= u64::from(e),
                    "Data-In beyond the expected length {e}"
                );
                *self.data_in.entry(d.itt).or_default() += d.data.len() as u64;
                self.stats.data_in_bytes += d.data.len() as u64;
                self.stats.statuses += u64::from(d.status.is_some());
            }
            Pdu::ScsiResponse(r) => {
                self.stats.statuses += 1;
                assert!(edtl(r.itt).is_some(), "a response to no command: {r:?}");
            }
            Pdu::Reject(_) => self.stats.rejects += 1,
            Pdu::NopIn(n) if n.itt == RESERVED_TAG => {
                assert_ne!(n.ttt, RESERVED_TAG, "a ping asks for an answer");
                self.pings.push((cid, n.ttt));
            }
            Pdu::NopIn(_)
            | Pdu::TaskMgmtResponse(_)
            | Pdu::LogoutResponse(_)
            | Pdu::TextResponse(_) => {}
            other => panic!("not a target PDU here: {other:?}"),
        }
        let (exp, max) = self.core.cmd_sns();
        assert!(
            !Sn::lt(Sn(exp), Sn(self.window.0)),
            "ExpCmdSN went back from {} to {exp}",
            self.window.0
        );
        assert!(
            !Sn::lt(Sn(max), Sn(exp.wrapping_sub(1))),
            "MaxCmdSN {max} < ExpCmdSN {exp} - 1"
        );
        self.window = (exp, max);
    }

    /// The connection a task's Data-Out must come on.
    fn task_cid(&self, itt: u32) -> Option<u16> {
        self.core.task(itt).map(|t| t.cid)
    }
}
