//! What a connection keeps of what it sent, for ErrorRecoveryLevel 1 (RFC 7143 7.1, 11.16): its
//! statuses until ExpStatSN acknowledges them, and each task's Data-In and R2Ts until the
//! task's status is acknowledged (or a DataACK SNACK acknowledges its data), so that a SNACK can
//! have any of them sent again.
//!
//! [`SentLog::record`] takes each PDU as it leaves, stamped; [`SentLog::ack`] takes the
//! ExpStatSN of each PDU that arrives; [`SentLog::snack`] answers a SNACK with the PDUs to send
//! again (through [`mcsi_proto::pdu::Pdu::restamp`], which keeps the StatSN they took) or the
//! reason to reject it. What the log keeps is bounded in bytes and in entries; past either bound
//! the oldest goes first, and a SNACK that asks for it is rejected. Every log of a server can
//! also count its bytes in one [`LogPool`]: while the pool is over its cap, a log that records
//! lets its own oldest entries go until the pool is back under it (or it keeps nothing).

use ahash::AHashMap;
use bytes::{Bytes, BytesMut};
use mcsi_proto::pdu::{reject_reason, DataIn, Pdu, ScsiResponse, SnackRequest, RESERVED_TAG};
use mcsi_proto::seq::StatSnUse;
use mcsi_proto::serial::Sn;
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The bytes every sent-PDU log of a server keeps (those of live connections, and those kept
/// for reassignment after their connection failed), against one cap.
#[derive(Debug)]
pub struct LogPool {
    used: AtomicU64,
    cap: u64,
}

impl LogPool {
    pub fn new(cap: u64) -> Arc<LogPool> {
        Arc::new(LogPool {
            used: AtomicU64::new(0),
            cap,
        })
    }

    /// Bytes the logs keep now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// At or over the cap.
    pub fn full(&self) -> bool {
        self.used() >= self.cap
    }
}

/// SNACK types (11.16.1).
pub mod snack_type {
    pub const DATA_R2T: u8 = 0;
    pub const STATUS: u8 = 1;
    pub const DATA_ACK: u8 = 2;
    pub const R_DATA: u8 = 3;
}

/// How much a connection's log may keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogBounds {
    /// Bytes kept (data segments plus 48 per PDU).
    pub bytes: u64,
    /// Statuses kept (a peer that never acknowledges must not grow the log without end).
    pub statuses: usize,
    /// Tasks whose data or R2Ts are kept (those of aborted tasks get no status to free them).
    pub tasks: usize,
}

impl Default for LogBounds {
    fn default() -> Self {
        LogBounds {
            bytes: 16 << 20,
            statuses: 4096,
            tasks: 1024,
        }
    }
}

/// Why a SNACK is rejected, with the Reject reason to send (11.17.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SnackRefused {
    /// It asks for a PDU never sent, or one acknowledged already (11.16: protocol error).
    #[error("asks for {what} {sn} that was {state}")]
    NotOwed {
        what: &'static str,
        sn: u32,
        state: &'static str,
    },
    /// For a task this connection keeps nothing of.
    #[error("for ITT {itt:#x}, of which nothing is kept")]
    UnknownTask { itt: u32 },
    /// What it asks for was let go to keep the log within its bounds.
    #[error("asks for {what} {sn} that was let go to keep the log within its bounds")]
    LetGo { what: &'static str, sn: u32 },
    /// A DataACK for no Data-In that asked for one (its TTT).
    #[error("DataACK with TTT {ttt:#x} for no Data-In that asked for one")]
    InvalidDataAck { ttt: u32 },
    /// An R-Data SNACK for a task whose status has not been sent yet.
    #[error("R-Data SNACK for ITT {itt:#x} before its status was sent")]
    RDataEarly { itt: u32 },
    /// A SNACK type 4 to 15.
    #[error("unknown SNACK type {0}")]
    UnknownType(u8),
    /// The connection keeps nothing (no data digests: nothing it sends can arrive damaged).
    #[error("nothing is kept on a connection without data digests")]
    NothingKept,
}

impl SnackRefused {
    /// The Reject reason (11.17.1).
    pub fn reject_reason(&self) -> u8 {
        match self {
            SnackRefused::NotOwed { .. }
            | SnackRefused::UnknownTask { .. }
            | SnackRefused::RDataEarly { .. }
            | SnackRefused::UnknownType(_) => reject_reason::PROTOCOL_ERROR,
            SnackRefused::LetGo { .. } | SnackRefused::NothingKept => reject_reason::SNACK_REJECT,
            SnackRefused::InvalidDataAck { .. } => reject_reason::INVALID_DATA_ACK,
        }
    }
}

/// What a log did, for counters and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogStats {
    pub snacks: u64,
    pub retransmitted: u64,
    pub refused: u64,
    /// Entries let go to stay within the bounds.
    pub let_go: u64,
}

/// A status sent and not yet acknowledged.
#[derive(Debug)]
struct Status {
    sn: u32,
    /// None: the last Data-In of the task it ended carried it (kept in that task's log).
    pdu: Option<Pdu>,
    /// The task it ended, and which of that ITT's logs (ITTs are reused).
    ends: Option<(u32, u64)>,
}

/// One task's Data-In and R2Ts, by DataSN/R2TSN (one sequence per task, 11.7.4, 11.8.5).
#[derive(Debug)]
struct TaskLog {
    /// Which log of this ITT (ITTs are reused), and its place in the eviction order.
    gen: u64,
    /// SN of `pdus[0]`.
    first: u32,
    /// Most reads are one Data-In: kept without an allocation of its own.
    pdus: SmallVec<[Pdu; 1]>,
    bytes: u64,
    /// The TTT of the last Data-In sent with the A bit (a DataACK names it).
    ack_ttt: Option<u32>,
    /// The StatSN of the status that ended the task, once sent.
    status_sn: Option<u32>,
    /// Its status when it was queued but never sent (its connection failed first): boxed,
    /// since it is rare and the log of every read moves through a hash table.
    unsent_status: Option<Box<Pdu>>,
}

impl TaskLog {
    fn next(&self) -> u32 {
        self.first.wrapping_add(self.pdus.len() as u32)
    }

    /// Its last Data-In, when that carried the task's status.
    fn status_in_data(&self) -> Option<&Pdu> {
        self.pdus
            .last()
            .filter(|p| matches!(p, Pdu::DataIn(d) if d.status.is_some()))
    }
}

fn size(p: &Pdu) -> u64 {
    mcsi_proto::pdu::BHS_LEN as u64 + p.data_len() as u64
}

/// What one connection keeps of what it sent (module docs).
#[derive(Debug)]
pub struct SentLog {
    bounds: LogBounds,
    bytes: u64,
    /// The server's pool, and how much of `bytes` it has been told of.
    pool: Option<Arc<LogPool>>,
    charged: u64,
    statuses: VecDeque<Status>,
    /// The StatSN after the last status recorded; None before the first.
    next_stat_sn: Option<u32>,
    /// The ExpStatSN last heard: statuses before it are acknowledged.
    exp_stat_sn: Option<u32>,
    tasks: AHashMap<u32, TaskLog>,
    /// Task logs by age (gen, ITT), for letting the oldest go; entries of logs gone already
    /// are skipped, and dropped in bulk when they outnumber the live ones.
    order: VecDeque<(u64, u32)>,
    next_gen: u64,
    stats: LogStats,
}

impl SentLog {
    pub fn new(bounds: LogBounds) -> SentLog {
        SentLog {
            bounds,
            bytes: 0,
            pool: None,
            charged: 0,
            statuses: VecDeque::new(),
            next_stat_sn: None,
            exp_stat_sn: None,
            tasks: AHashMap::new(),
            order: VecDeque::new(),
            next_gen: 0,
            stats: LogStats::default(),
        }
    }

    /// A log that counts its bytes in `pool` too ([`LogPool`]).
    pub fn pooled(bounds: LogBounds, pool: Arc<LogPool>) -> SentLog {
        let mut log = SentLog::new(bounds);
        log.pool = Some(pool);
        log
    }

    pub fn stats(&self) -> LogStats {
        self.stats
    }

    /// Tells the pool what this log keeps now.
    fn settle(&mut self) {
        if let Some(p) = &self.pool {
            if self.bytes > self.charged {
                p.used
                    .fetch_add(self.bytes - self.charged, Ordering::Relaxed);
            } else if self.bytes < self.charged {
                p.used
                    .fetch_sub(self.charged - self.bytes, Ordering::Relaxed);
            }
            self.charged = self.bytes;
        }
    }

    /// Over its own byte bound, or the pool would be over its cap with what this log keeps now.
    fn over(&self) -> bool {
        self.bytes > self.bounds.bytes
            || self
                .pool
                .as_ref()
                .is_some_and(|p| p.used().saturating_sub(self.charged) + self.bytes > p.cap)
    }

    /// Bytes kept.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Statuses kept (sent, not yet acknowledged).
    pub fn statuses(&self) -> usize {
        self.statuses.len()
    }

    /// Tasks whose data or R2Ts are kept.
    pub fn tasks(&self) -> usize {
        self.tasks.len()
    }

    /// `p` was sent, stamped ([`Pdu::stamp`]). A PDU sent again (from [`SentLog::snack`]) is
    /// not recorded twice.
    pub fn record(&mut self, p: Pdu) {
        match &p {
            Pdu::DataIn(d) => {
                let (itt, ack, ttt) = (d.itt, d.ack, d.ttt);
                let status = d.status.is_some().then_some(d.stat_sn);
                let sn = d.data_sn;
                if let Some(sn) = status {
                    self.status(sn, None, Some(itt));
                }
                self.task_pdu(itt, sn, p);
                if let Some(t) = self.tasks.get_mut(&itt) {
                    if ack {
                        t.ack_ttt = Some(ttt);
                    }
                    if let Some(sn) = status {
                        t.status_sn = Some(sn);
                        if let Some(s) = self.statuses.back_mut() {
                            s.ends = Some((itt, t.gen));
                        }
                    }
                }
            }
            Pdu::R2t(r) => {
                let (itt, sn) = (r.itt, r.r2t_sn);
                self.task_pdu(itt, sn, p);
            }
            Pdu::ScsiResponse(r) => {
                let (itt, sn) = (r.itt, r.stat_sn);
                self.status(sn, Some(p), Some(itt));
            }
            _ => {
                if let (StatSnUse::Takes, Some((sn, _))) = (p.stat_sn_use(), p.stat_sn()) {
                    self.status(sn, Some(p), None);
                }
            }
        }
        self.trim();
    }

    fn task_pdu(&mut self, itt: u32, sn: u32, p: Pdu) {
        // Every task's first Data-In or R2T has SN 0: a log of the ITT before it is an ended
        // task's whose status was never acknowledged (aborted, or its ITT reused).
        if sn == 0 || !self.tasks.contains_key(&itt) {
            self.forget_task(itt);
            let gen = self.next_gen;
            self.next_gen += 1;
            self.order.push_back((gen, itt));
            self.tasks.insert(
                itt,
                TaskLog {
                    gen,
                    first: sn,
                    pdus: SmallVec::new(),
                    bytes: 0,
                    ack_ttt: None,
                    status_sn: None,
                    unsent_status: None,
                },
            );
        }
        let Some(t) = self.tasks.get_mut(&itt) else {
            return;
        };
        if sn != t.next() {
            // Not the next in the task's sequence (cannot happen from one sender): keep the
            // log contiguous by starting it again from here.
            self.bytes -= t.bytes;
            t.pdus.clear();
            t.bytes = 0;
            t.first = sn;
        }
        let n = size(&p);
        t.pdus.push(p);
        t.bytes += n;
        self.bytes += n;
    }

    fn status(&mut self, sn: u32, pdu: Option<Pdu>, itt: Option<u32>) {
        let ends = itt.and_then(|itt| {
            let t = self.tasks.get_mut(&itt)?;
            t.status_sn = Some(sn);
            Some((itt, t.gen))
        });
        self.bytes += pdu.as_ref().map_or(0, size);
        self.statuses.push_back(Status { sn, pdu, ends });
        self.next_stat_sn = Some(sn.wrapping_add(1));
    }

    fn forget_task(&mut self, itt: u32) {
        if let Some(t) = self.tasks.remove(&itt) {
            self.bytes -= t.bytes;
        }
        // Entries of logs gone outnumber the live ones: drop them.
        if self.order.len() > 2 * self.tasks.len() + 64 {
            let tasks = &self.tasks;
            self.order
                .retain(|(gen, itt)| tasks.get(itt).is_some_and(|t| t.gen == *gen));
        }
    }

    fn pop_status(&mut self) -> Option<Status> {
        let s = self.statuses.pop_front()?;
        self.bytes -= s.pdu.as_ref().map_or(0, size);
        Some(s)
    }

    /// Within the bounds (and the pool's cap) again: the oldest task logs, then the oldest
    /// statuses, go.
    fn trim(&mut self) {
        while self.tasks.len() > self.bounds.tasks || (self.over() && !self.tasks.is_empty()) {
            let Some((gen, itt)) = self.order.pop_front() else {
                break;
            };
            if self.tasks.get(&itt).is_some_and(|t| t.gen == gen) {
                if let Some(t) = self.tasks.remove(&itt) {
                    self.bytes -= t.bytes;
                    self.stats.let_go += 1;
                }
            }
        }
        while self.statuses.len() > self.bounds.statuses
            || (self.over() && !self.statuses.is_empty())
        {
            self.pop_status();
            self.stats.let_go += 1;
        }
        self.settle();
    }

    /// `p` was queued but never sent: its connection failed first (ErrorRecoveryLevel 2). A
    /// task's Data-In, R2T or status is kept for [`SentLog::take_task`]; anything else is of no
    /// use any more.
    pub fn record_unsent(&mut self, p: Pdu) {
        match &p {
            Pdu::DataIn(d) if d.status.is_none() => {
                let (itt, sn) = (d.itt, d.data_sn);
                self.task_pdu(itt, sn, p);
            }
            Pdu::DataIn(d) => {
                let (itt, sn) = (d.itt, d.data_sn);
                self.task_pdu(itt, sn, p);
                if let Some(t) = self.tasks.get_mut(&itt) {
                    t.status_sn = None;
                }
            }
            Pdu::R2t(r) => {
                let (itt, sn) = (r.itt, r.r2t_sn);
                self.task_pdu(itt, sn, p);
            }
            Pdu::ScsiResponse(r) => {
                let itt = r.itt;
                if !self.tasks.contains_key(&itt) {
                    let gen = self.next_gen;
                    self.next_gen += 1;
                    self.order.push_back((gen, itt));
                    self.tasks.insert(
                        itt,
                        TaskLog {
                            gen,
                            first: 0,
                            pdus: SmallVec::new(),
                            bytes: 0,
                            ack_ttt: None,
                            status_sn: None,
                            unsent_status: None,
                        },
                    );
                }
                if let Some(t) = self.tasks.get_mut(&itt) {
                    let n = size(&p);
                    t.bytes += n;
                    self.bytes += n;
                    t.unsent_status = Some(Box::new(p));
                }
            }
            _ => {}
        }
        self.trim();
    }

    /// Task `itt` of this (failed) connection is reassigned to another (ErrorRecoveryLevel 2,
    /// RFC 7143 11.5.1): its Data-In from `exp_data_sn` and its status, to send there (each
    /// takes the new connection's sequence numbers), or None when this connection keeps no
    /// ended task of that ITT. What is handed out leaves the log.
    pub fn take_task(&mut self, itt: u32, exp_data_sn: u32) -> Option<Vec<Pdu>> {
        let out = self.take_task_inner(itt, exp_data_sn);
        self.settle();
        out
    }

    fn take_task_inner(&mut self, itt: u32, exp_data_sn: u32) -> Option<Vec<Pdu>> {
        let from_statuses = |statuses: &VecDeque<Status>| {
            statuses.iter().rev().find_map(|st| match &st.pdu {
                Some(Pdu::ScsiResponse(r)) if r.itt == itt => Some(st.pdu.clone()?),
                _ => None,
            })
        };
        let Some(t) = self.tasks.get(&itt) else {
            // A write whose data all came unasked keeps no log of its own: its status only.
            return from_statuses(&self.statuses).map(|p| vec![p]);
        };
        let status = match t.status_in_data() {
            Some(_) => None,
            None => Some(
                t.unsent_status
                    .as_deref()
                    .cloned()
                    .or_else(|| from_statuses(&self.statuses))?,
            ),
        };
        let t = self.tasks.remove(&itt)?;
        self.bytes -= t.bytes;
        let mut out: Vec<Pdu> = t
            .pdus
            .into_iter()
            .filter(|p| match p {
                Pdu::DataIn(d) => d.status.is_some() || Sn::ge(Sn(d.data_sn), Sn(exp_data_sn)),
                // A task with its status has no R2T still to answer.
                _ => false,
            })
            .collect();
        out.extend(status);
        Some(out)
    }

    /// An initiator's PDU acknowledged every status before `exp_stat_sn`: they, and the logs
    /// of the tasks they ended, go. An ExpStatSN behind the last one heard, or past what was
    /// sent, acknowledges nothing.
    pub fn ack(&mut self, exp_stat_sn: u32) {
        self.ack_inner(exp_stat_sn);
        self.settle();
    }

    fn ack_inner(&mut self, exp_stat_sn: u32) {
        if self
            .exp_stat_sn
            .is_some_and(|e| Sn::le(Sn(exp_stat_sn), Sn(e)))
        {
            return;
        }
        if self
            .next_stat_sn
            .is_some_and(|n| Sn::gt(Sn(exp_stat_sn), Sn(n)))
        {
            return;
        }
        self.exp_stat_sn = Some(exp_stat_sn);
        while self
            .statuses
            .front()
            .is_some_and(|s| Sn::lt(Sn(s.sn), Sn(exp_stat_sn)))
        {
            if let Some(Status {
                ends: Some((itt, gen)),
                ..
            }) = self.pop_status()
            {
                if self.tasks.get(&itt).is_some_and(|t| t.gen == gen) {
                    self.forget_task(itt);
                }
            }
        }
    }

    /// A SNACK arrived (its ExpStatSN taken by [`SentLog::ack`] already): the PDUs to send
    /// again, in order, each to be restamped ([`Pdu::restamp`]), or why it is rejected. `mrdsl`
    /// is what the initiator takes in one Data-In now, for an R-Data SNACK's new segmentation.
    pub fn snack(&mut self, s: &SnackRequest, mrdsl: u32) -> Result<Vec<Pdu>, SnackRefused> {
        self.stats.snacks += 1;
        let r = match s.snack_type & 0x0f {
            snack_type::DATA_R2T => self.data_r2t(s),
            snack_type::STATUS => self.status_snack(s),
            snack_type::DATA_ACK => self.data_ack(s).map(|()| Vec::new()),
            snack_type::R_DATA => self.r_data(s, mrdsl),
            t => Err(SnackRefused::UnknownType(t)),
        };
        match &r {
            Ok(v) => self.stats.retransmitted += v.len() as u64,
            Err(_) => self.stats.refused += 1,
        }
        self.settle();
        r
    }

    /// The range a SNACK names in a sequence that runs from `first` to before `next`:
    /// BegRun and RunLength both 0 mean all that is kept, RunLength 0 all from BegRun (11.16.6).
    fn range(s: &SnackRequest, first: u32, next: u32) -> (u32, u32) {
        if s.beg_run == 0 && s.run_length == 0 {
            (first, next)
        } else if s.run_length == 0 {
            (s.beg_run, next)
        } else {
            (s.beg_run, s.beg_run.wrapping_add(s.run_length))
        }
    }

    fn data_r2t(&mut self, s: &SnackRequest) -> Result<Vec<Pdu>, SnackRefused> {
        let t = self
            .tasks
            .get(&s.itt)
            .ok_or(SnackRefused::UnknownTask { itt: s.itt })?;
        let (from, to) = Self::range(s, t.first, t.next());
        if Sn::lt(Sn(from), Sn(t.first)) {
            return Err(SnackRefused::NotOwed {
                what: "DataSN/R2TSN",
                sn: from,
                state: "acknowledged",
            });
        }
        if Sn::gt(Sn(to), Sn(t.next())) || Sn::gt(Sn(from), Sn(to)) {
            return Err(SnackRefused::NotOwed {
                what: "DataSN/R2TSN",
                sn: to.wrapping_sub(1),
                state: "never sent",
            });
        }
        // BegRun and RunLength are the initiator's: the range is checked above in serial
        // arithmetic, and sliced without a panic all the same.
        let a = from.wrapping_sub(t.first) as usize;
        let b = to.wrapping_sub(t.first) as usize;
        t.pdus
            .get(a..b)
            .map(<[Pdu]>::to_vec)
            .ok_or(SnackRefused::NotOwed {
                what: "DataSN/R2TSN",
                sn: from,
                state: "never sent",
            })
    }

    fn status_snack(&mut self, s: &SnackRequest) -> Result<Vec<Pdu>, SnackRefused> {
        let next = self.next_stat_sn.unwrap_or(0);
        let first = self.statuses.front().map_or(next, |f| f.sn);
        let (from, to) = Self::range(s, first, next);
        if Sn::lt(Sn(from), Sn(first)) {
            let acked = self.exp_stat_sn.is_some_and(|e| Sn::lt(Sn(from), Sn(e)));
            return Err(if acked {
                SnackRefused::NotOwed {
                    what: "StatSN",
                    sn: from,
                    state: "acknowledged",
                }
            } else {
                SnackRefused::LetGo {
                    what: "StatSN",
                    sn: from,
                }
            });
        }
        if Sn::gt(Sn(to), Sn(next)) || Sn::gt(Sn(from), Sn(to)) {
            return Err(SnackRefused::NotOwed {
                what: "StatSN",
                sn: to.wrapping_sub(1),
                state: "never sent",
            });
        }
        let a = from.wrapping_sub(first) as usize;
        let b = to.wrapping_sub(first) as usize;
        if a > b || b > self.statuses.len() {
            return Err(SnackRefused::NotOwed {
                what: "StatSN",
                sn: from,
                state: "never sent",
            });
        }
        self.statuses
            .range(a..b)
            .map(|st| match (&st.pdu, st.ends) {
                (Some(p), _) => Ok(p.clone()),
                // Carried by its task's last Data-In: sent again from the task's log.
                (None, Some((itt, gen))) => self
                    .tasks
                    .get(&itt)
                    .filter(|t| t.gen == gen)
                    .and_then(TaskLog::status_in_data)
                    .cloned()
                    .ok_or(SnackRefused::LetGo {
                        what: "StatSN",
                        sn: st.sn,
                    }),
                (None, None) => Err(SnackRefused::LetGo {
                    what: "StatSN",
                    sn: st.sn,
                }),
            })
            .collect()
    }

    /// A DataACK (11.16.2): the initiator has every Data-In before BegRun of the task whose
    /// Data-In asked for it with this TTT; those go.
    fn data_ack(&mut self, s: &SnackRequest) -> Result<(), SnackRefused> {
        let bad = SnackRefused::InvalidDataAck { ttt: s.ttt };
        if s.ttt == RESERVED_TAG {
            return Err(bad);
        }
        let Some(t) = self.tasks.values_mut().find(|t| t.ack_ttt == Some(s.ttt)) else {
            return Err(bad);
        };
        if Sn::gt(Sn(s.beg_run), Sn(t.next())) {
            return Err(bad);
        }
        let n = s.beg_run.wrapping_sub(t.first) as usize;
        if n < (1 << 31) && n > 0 {
            let gone: u64 = t.pdus.drain(..n).map(|p| size(&p)).sum();
            t.bytes -= gone;
            self.bytes -= gone;
            t.first = s.beg_run;
        }
        Ok(())
    }

    /// An R-Data SNACK (11.16.3): every Data-In not acknowledged by a DataACK, cut again to
    /// `mrdsl` and numbered from the first kept, then the status as a SCSI Response carrying
    /// the SNACK Tag (the SNACK's TTT) and the new ExpDataSN. Needs the status to have been
    /// sent: the tasks still running are answered when they end.
    fn r_data(&mut self, s: &SnackRequest, mrdsl: u32) -> Result<Vec<Pdu>, SnackRefused> {
        let t = self
            .tasks
            .get(&s.itt)
            .ok_or(SnackRefused::UnknownTask { itt: s.itt })?;
        let early = SnackRefused::RDataEarly { itt: s.itt };
        let status = match t.status_in_data() {
            Some(p) => p.clone(),
            None => {
                let sn = t.status_sn.ok_or(early)?;
                self.statuses
                    .iter()
                    .find(|st| st.sn == sn)
                    .and_then(|st| st.pdu.clone())
                    .ok_or(SnackRefused::LetGo { what: "StatSN", sn })?
            }
        };
        let ins: Vec<&DataIn> = t
            .pdus
            .iter()
            .filter_map(|p| match p {
                Pdu::DataIn(d) => Some(d),
                _ => None,
            })
            .collect();
        let mut out = Vec::new();
        let mut sn = t.first;
        if let Some(head) = ins.first() {
            let offset = head.buffer_offset;
            let data: Bytes = if ins.len() == 1 {
                head.data.clone()
            } else {
                let mut b = BytesMut::with_capacity(ins.iter().map(|d| d.data.len()).sum());
                for d in &ins {
                    b.extend_from_slice(&d.data);
                }
                b.freeze()
            };
            let step = mrdsl.max(512) as usize;
            let mut at = 0usize;
            while at < data.len() {
                let n = step.min(data.len() - at);
                out.push(Pdu::DataIn(DataIn {
                    final_: at + n == data.len(),
                    ack: false,
                    overflow: false,
                    underflow: false,
                    status: None,
                    lun: head.lun,
                    itt: head.itt,
                    ttt: RESERVED_TAG,
                    stat_sn: 0,
                    exp_cmd_sn: 0,
                    max_cmd_sn: 0,
                    data_sn: sn,
                    buffer_offset: offset + at as u32,
                    residual_count: 0,
                    data: data.slice(at..at + n),
                }));
                sn = sn.wrapping_add(1);
                at += n;
            }
        }
        let response = match status {
            Pdu::ScsiResponse(mut r) => {
                r.snack_tag = s.ttt;
                r.exp_data_sn = sn;
                r
            }
            Pdu::DataIn(d) => ScsiResponse {
                bidi_overflow: false,
                bidi_underflow: false,
                overflow: d.overflow,
                underflow: d.underflow,
                response: 0,
                status: d.status.unwrap_or(0),
                itt: d.itt,
                snack_tag: s.ttt,
                stat_sn: d.stat_sn,
                exp_cmd_sn: 0,
                max_cmd_sn: 0,
                exp_data_sn: sn,
                bidi_residual_count: 0,
                residual_count: d.residual_count,
                sense: Bytes::new(),
            },
            _ => return Err(early),
        };
        out.push(Pdu::ScsiResponse(response));
        Ok(out)
    }
}

impl Drop for SentLog {
    fn drop(&mut self) {
        if let Some(p) = &self.pool {
            p.used.fetch_sub(self.charged, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data_in(itt: u32, sn: u32, offset: u32, len: usize, status: Option<(u8, u32)>) -> Pdu {
        Pdu::DataIn(DataIn {
            final_: status.is_some(),
            ack: false,
            overflow: false,
            underflow: false,
            status: status.map(|s| s.0),
            lun: 0,
            itt,
            ttt: RESERVED_TAG,
            stat_sn: status.map_or(0, |s| s.1),
            exp_cmd_sn: 1,
            max_cmd_sn: 9,
            data_sn: sn,
            buffer_offset: offset,
            residual_count: 0,
            data: Bytes::from(vec![(offset / 1000) as u8; len]),
        })
    }

    fn response(itt: u32, stat_sn: u32) -> Pdu {
        Pdu::ScsiResponse(ScsiResponse {
            bidi_overflow: false,
            bidi_underflow: false,
            overflow: false,
            underflow: false,
            response: 0,
            status: 0,
            itt,
            snack_tag: 0,
            stat_sn,
            exp_cmd_sn: 1,
            max_cmd_sn: 9,
            exp_data_sn: 0,
            bidi_residual_count: 0,
            residual_count: 0,
            sense: Bytes::new(),
        })
    }

    fn r2t(itt: u32, sn: u32) -> Pdu {
        Pdu::R2t(mcsi_proto::pdu::R2t {
            lun: 0,
            itt,
            ttt: 100 + sn,
            stat_sn: 5,
            exp_cmd_sn: 1,
            max_cmd_sn: 9,
            r2t_sn: sn,
            buffer_offset: sn * 4096,
            desired_data_transfer_length: 4096,
        })
    }

    fn snack(t: u8, itt: u32, ttt: u32, beg: u32, len: u32) -> SnackRequest {
        SnackRequest {
            snack_type: t,
            lun: 0,
            itt,
            ttt,
            exp_stat_sn: 0,
            beg_run: beg,
            run_length: len,
        }
    }

    fn sns(v: &[Pdu]) -> Vec<u32> {
        v.iter()
            .map(|p| match p {
                Pdu::DataIn(d) => d.data_sn,
                Pdu::R2t(r) => r.r2t_sn,
                p => p.stat_sn().map_or(u32::MAX, |s| s.0),
            })
            .collect()
    }

    fn stat_sns(v: &[Pdu]) -> Vec<u32> {
        v.iter()
            .map(|p| p.stat_sn().map_or(u32::MAX, |s| s.0))
            .collect()
    }

    /// A read of three Data-In, the last with status StatSN 7.
    fn read(log: &mut SentLog, itt: u32, stat_sn: u32) {
        log.record(data_in(itt, 0, 0, 1000, None));
        log.record(data_in(itt, 1, 1000, 1000, None));
        log.record(data_in(itt, 2, 2000, 500, Some((0, stat_sn))));
    }

    /// Logs that share a pool keep no more than its cap between them: the one that records
    /// past it lets its own oldest go, the pool counts what each keeps as it changes, and a log
    /// that is dropped (its connection gone) gives its bytes back.
    #[test]
    fn logs_sharing_a_pool_keep_no_more_than_its_cap() {
        let pool = LogPool::new(12_000);
        let mut a = SentLog::pooled(LogBounds::default(), pool.clone());
        let mut b = SentLog::pooled(LogBounds::default(), pool.clone());
        // Each read keeps 2500 bytes of data and 3 headers of 48.
        read(&mut a, 1, 1);
        read(&mut a, 2, 2);
        read(&mut a, 3, 3);
        assert_eq!(pool.used(), a.bytes());
        assert_eq!(a.bytes(), 3 * 2644);
        // B's third read takes the pool past its cap: B lets its own oldest go.
        read(&mut b, 4, 1);
        assert_eq!(pool.used(), 4 * 2644);
        read(&mut b, 5, 2);
        assert!(pool.used() <= pool.cap(), "{} kept", pool.used());
        assert_eq!(a.bytes(), 3 * 2644, "A keeps what it had");
        assert_eq!(b.tasks(), 1, "B let its first read go: {} tasks", b.tasks());
        assert!(b.stats().let_go >= 1);
        let e = b.snack(&snack(0, 4, RESERVED_TAG, 0, 0), 8192).unwrap_err();
        assert_eq!(e.reject_reason(), reject_reason::PROTOCOL_ERROR);
        // Acknowledged statuses go, and the pool hears of it.
        a.ack(3);
        assert_eq!(a.bytes(), 2644);
        assert_eq!(pool.used(), a.bytes() + b.bytes());
        // A dead connection's log, taken from for a reassignment, then dropped.
        let taken = a.take_task(3, 0).expect("task 3 is kept");
        assert_eq!(taken.len(), 3);
        assert_eq!(pool.used(), b.bytes());
        drop(b);
        drop(a);
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn data_and_statuses_are_sent_again_as_asked_until_acknowledged() {
        let mut log = SentLog::new(LogBounds::default());
        read(&mut log, 1, 7);
        log.record(response(2, 8));
        assert_eq!(log.statuses(), 2);
        let again = log.snack(&snack(0, 1, RESERVED_TAG, 1, 1), 8192).unwrap();
        assert_eq!(again, vec![data_in(1, 1, 1000, 1000, None)]);
        // RunLength 0: from BegRun to the last sent; both 0: all kept.
        assert_eq!(
            sns(&log.snack(&snack(0, 1, 0, 1, 0), 8192).unwrap()),
            [1, 2]
        );
        assert_eq!(
            sns(&log.snack(&snack(0, 1, 0, 0, 0), 8192).unwrap()),
            [0, 1, 2]
        );
        // Beyond what was sent, or for a task with nothing kept: protocol errors.
        let e = log.snack(&snack(0, 1, 0, 2, 2), 8192).unwrap_err();
        assert_eq!(e.reject_reason(), reject_reason::PROTOCOL_ERROR);
        let e = log.snack(&snack(0, 9, 0, 0, 0), 8192).unwrap_err();
        assert_eq!(e, SnackRefused::UnknownTask { itt: 9 });
        // Status SNACK: StatSN 8 alone, then both.
        assert_eq!(
            stat_sns(&log.snack(&snack(1, RESERVED_TAG, 0, 8, 1), 8192).unwrap()),
            [8]
        );
        assert_eq!(
            stat_sns(&log.snack(&snack(1, RESERVED_TAG, 0, 7, 0), 8192).unwrap()),
            [7, 8]
        );
        // ExpStatSN 8 acknowledges StatSN 7: task 1's data goes with it.
        log.ack(8);
        assert_eq!(log.statuses(), 1);
        assert_eq!(log.tasks(), 0);
        let e = log
            .snack(&snack(1, RESERVED_TAG, 0, 7, 1), 8192)
            .unwrap_err();
        assert!(
            matches!(
                e,
                SnackRefused::NotOwed {
                    state: "acknowledged",
                    ..
                }
            ),
            "{e}"
        );
        let e = log.snack(&snack(0, 1, 0, 0, 0), 8192).unwrap_err();
        assert_eq!(e, SnackRefused::UnknownTask { itt: 1 });
        // An ExpStatSN going back, or past what was sent, changes nothing.
        log.ack(3);
        log.ack(100);
        assert_eq!(log.statuses(), 1);
        log.ack(9);
        assert_eq!((log.statuses(), log.bytes()), (0, 0));
        let s = log.stats();
        assert_eq!((s.snacks, s.retransmitted, s.refused), (9, 9, 4));
    }

    #[test]
    fn r2ts_are_sent_again_and_a_reused_itt_starts_a_new_log() {
        let mut log = SentLog::new(LogBounds::default());
        log.record(r2t(4, 0));
        log.record(r2t(4, 1));
        assert_eq!(sns(&log.snack(&snack(0, 4, 0, 1, 1), 8192).unwrap()), [1]);
        // The write was aborted (no status); its ITT is used again by a read.
        log.record(data_in(4, 0, 0, 100, None));
        assert_eq!(log.tasks(), 1);
        let again = log.snack(&snack(0, 4, 0, 0, 0), 8192).unwrap();
        assert_eq!(again, vec![data_in(4, 0, 0, 100, None)]);
        assert_eq!(log.bytes(), 148);
    }

    #[test]
    fn a_data_ack_frees_the_data_it_acknowledges() {
        let mut log = SentLog::new(LogBounds::default());
        let mut asks = data_in(3, 1, 1000, 1000, None);
        if let Pdu::DataIn(d) = &mut asks {
            d.ack = true;
            d.ttt = 0x55;
        }
        log.record(data_in(3, 0, 0, 1000, None));
        log.record(asks);
        let e = log
            .snack(&snack(2, RESERVED_TAG, 0x56, 2, 0), 8192)
            .unwrap_err();
        assert_eq!(e.reject_reason(), reject_reason::INVALID_DATA_ACK);
        assert!(log
            .snack(&snack(2, RESERVED_TAG, 0x55, 2, 0), 8192)
            .unwrap()
            .is_empty());
        assert_eq!(log.bytes(), 0);
        log.record(data_in(3, 2, 2000, 10, None));
        let e = log.snack(&snack(0, 3, 0, 1, 1), 8192).unwrap_err();
        assert!(
            matches!(
                e,
                SnackRefused::NotOwed {
                    state: "acknowledged",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(sns(&log.snack(&snack(0, 3, 0, 0, 0), 8192).unwrap()), [2]);
    }

    #[test]
    fn r_data_cuts_the_data_again_and_ends_with_a_tagged_response() {
        let mut log = SentLog::new(LogBounds::default());
        let e = log.snack(&snack(3, 1, 0x77, 0, 0), 1024).unwrap_err();
        assert_eq!(e, SnackRefused::UnknownTask { itt: 1 });
        log.record(data_in(1, 0, 0, 1000, None));
        let e = log.snack(&snack(3, 1, 0x77, 0, 0), 1024).unwrap_err();
        assert_eq!(e, SnackRefused::RDataEarly { itt: 1 });
        log.record(data_in(1, 1, 1000, 1000, None));
        log.record(data_in(1, 2, 2000, 500, Some((0, 7))));
        let again = log.snack(&snack(3, 1, 0x77, 0, 0), 1024).unwrap();
        assert_eq!(again.len(), 4);
        let mut joined = Vec::new();
        for (i, p) in again[..3].iter().enumerate() {
            let Pdu::DataIn(d) = p else { panic!("{p:?}") };
            assert_eq!(
                (d.data_sn, d.buffer_offset, d.status),
                (i as u32, i as u32 * 1024, None)
            );
            joined.extend_from_slice(&d.data);
        }
        assert_eq!(joined.len(), 2500);
        assert_eq!(&joined[1000..1003], &[1, 1, 1]);
        let Pdu::ScsiResponse(r) = &again[3] else {
            panic!()
        };
        assert_eq!(
            (r.snack_tag, r.exp_data_sn, r.stat_sn, r.status),
            (0x77, 3, 7, 0)
        );
    }

    #[test]
    fn the_log_stays_within_its_bounds_and_refuses_what_it_let_go() {
        let bounds = LogBounds {
            bytes: 6000,
            statuses: 3,
            tasks: 2,
        };
        let mut log = SentLog::new(bounds);
        for i in 0..5u32 {
            read(&mut log, i, 10 + i);
            assert!(log.bytes() <= 6000 && log.statuses() <= 3 && log.tasks() <= 2);
        }
        // StatSN 10 and 11 were let go, not acknowledged.
        let e = log
            .snack(&snack(1, RESERVED_TAG, 0, 10, 1), 8192)
            .unwrap_err();
        assert_eq!(e.reject_reason(), reject_reason::SNACK_REJECT);
        // StatSN 12 is still listed, but it came in task 2's last Data-In, whose log was let
        // go (two tasks at most): it cannot be sent again either.
        let e = log
            .snack(&snack(1, RESERVED_TAG, 0, 12, 0), 8192)
            .unwrap_err();
        assert_eq!(e.reject_reason(), reject_reason::SNACK_REJECT);
        assert_eq!(
            stat_sns(&log.snack(&snack(1, RESERVED_TAG, 0, 13, 0), 8192).unwrap()),
            [13, 14]
        );
        assert!(log.stats().let_go >= 5);
        // A peer that never acknowledges: statuses of other kinds stay bounded too.
        for sn in 15..100 {
            log.record(Pdu::reject(4, Bytes::from(vec![0u8; 48])).tap_stat(sn));
        }
        assert_eq!(log.statuses(), 3);
    }

    #[test]
    fn a_long_run_of_acknowledged_reads_leaves_nothing_behind() {
        let mut log = SentLog::new(LogBounds::default());
        // One read stays unacknowledged (its status lost, say), ten thousand go by.
        read(&mut log, 0, 1);
        for i in 1..10_000u32 {
            read(&mut log, i, 1 + i);
            log.ack(1);
        }
        assert_eq!(log.tasks(), 10_000.min(LogBounds::default().tasks));
        log.ack(10_001);
        assert_eq!((log.tasks(), log.statuses(), log.bytes()), (0, 0, 0));
        assert!(
            log.order.len() <= 64 + 2 * log.tasks.len(),
            "{}",
            log.order.len()
        );
    }

    trait TapStat {
        fn tap_stat(self, sn: u32) -> Pdu;
    }

    impl TapStat for Pdu {
        fn tap_stat(mut self, sn: u32) -> Pdu {
            let mut s = sn;
            self.stamp(&mut s, 1, 9);
            self
        }
    }
}
