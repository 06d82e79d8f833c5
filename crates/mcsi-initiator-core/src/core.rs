//! The session's state, sans-IO: task table, task tags, CmdSN window, scheduler, per-connection
//! StatSN, and the answers to target PDUs. The async driver feeds it PDUs and carries out the
//! [`Action`]s it returns; tests drive it with plain values.

use crate::error::Error;
use crate::negotiate::SessionParams;
use crate::sched::{ConnLoad, Scheduler, TaskInfo};
use crate::sense::Sense;
use crate::task::{answer_r2t, data_outs, plan_write, DataInAssembly, Push, Residual};
use crate::window::{CmdWindow, WindowUpdate};
use bytes::Bytes;
use mcsi_proto::pdu::{NopOut, Pdu, ScsiCommand, SnackRequest, TaskAttr, RESERVED_TAG};
use mcsi_proto::serial::Sn;
use mcsi_tcp::TcpState;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Direction and size of a command's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataDir {
    None,
    /// Read this many bytes.
    Read(u32),
    /// Write these bytes.
    Write(Bytes),
}

/// A SCSI command for one LUN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    /// LUN number (encoded to SAM-5 form on the wire).
    pub lun: u64,
    pub cdb: Bytes,
    pub dir: DataDir,
}

impl Command {
    fn bytes(&self) -> u64 {
        match &self.dir {
            DataDir::None => 0,
            DataDir::Read(n) => u64::from(*n),
            DataDir::Write(b) => b.len() as u64,
        }
    }
}

/// A completed command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// SCSI status (SAM-5).
    pub status: u8,
    pub sense: Option<Sense>,
    /// Read data (empty for other commands).
    pub data: Bytes,
    pub residual: Residual,
}

impl Response {
    /// Ok for GOOD (and CONDITION MET), else the status as a typed error.
    pub fn check(self) -> Result<Response, Error> {
        match self.status {
            crate::error::status::GOOD | crate::error::status::CONDITION_MET => Ok(self),
            status => Err(Error::Scsi(crate::error::ScsiError {
                status,
                sense: self.sense,
            })),
        }
    }
}

/// Role of a connection (the asymmetric mode gives requests and responses separate ones).
pub use mcsi_proto::vendor::ConnRole;

/// Things the driver must do.
#[derive(Debug)]
pub enum Action<C> {
    /// Queue this PDU on connection `conn`.
    Send { conn: usize, pdu: Pdu },
    /// Send this immediate PDU on connection `conn` ahead of the data queued there (a ping).
    Urgent { conn: usize, pdu: Pdu },
    /// Deliver a command's result.
    Complete {
        handle: C,
        result: Result<Response, Error>,
    },
    /// Something for the driver's control logic.
    Event { conn: usize, event: Event },
}

/// Target-initiated events and control responses.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Async event 1: log out this connection within `within_secs` (11.9.1).
    LogoutRequested { cid: u16, within_secs: u16 },
    /// Async events 2/3: the target drops the connection or the whole session.
    Dropped {
        session: bool,
        time2wait: u16,
        time2retain: u16,
    },
    /// A response to a control request the driver issued (Logout, Text, TMF).
    Control(Pdu),
    /// A Reject that names no outstanding task.
    Rejected { reason: u8 },
    /// Time to log the connection out, as the target asked ([`Event::LogoutRequested`]): its
    /// tasks have ended, or the time the target gave ran out. `close_session`: no other
    /// connection takes tasks, so the logout closes the session.
    LogoutDue { close_session: bool },
    /// A task has had no status for the response timeout ([`Timers::response`]): at
    /// ErrorRecoveryLevel 0 (a lost PDU, a black-holed path) only a new session gets it one.
    NoStatus { itt: u32, waited: Duration },
    /// The connection has received nothing for the stall timeout ([`Timers::stall`]) with work
    /// outstanding while another was heard: the driver takes it out of the session
    /// ([`SessionCore::fail_over`]).
    Stalled { silent: Duration },
}

/// The session's timers, on passed-in time ([`SessionCore::poll_timeout`],
/// [`SessionCore::handle_timeout`]). Zero turns one off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timers {
    /// How long a task may wait for its status ([`Event::NoStatus`]). Checked every quarter of
    /// it (at least 10 ms, at most 1 s apart), so it fires between the limit and the limit plus
    /// one check period after the task was first seen outstanding, and again each limit after
    /// that while the task still waits.
    pub response: Duration,
    /// How long a connection with work outstanding may stay silent in a symmetric session of
    /// several connections ([`Event::Stalled`]); at half of it the connection is pinged.
    /// Checked every eighth of it (10 to 250 ms apart).
    pub stall: Duration,
}

impl Timers {
    fn response_period(&self) -> Duration {
        (self.response / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
    }

    fn stall_period(&self) -> Duration {
        (self.stall / 8).clamp(Duration::from_millis(10), Duration::from_millis(250))
    }
}

/// A logout the target asked for, waiting for the connection's tasks to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogoutWait {
    /// Asked before the core knew the time: the deadline is set at the next look.
    Within(Duration),
    By(Instant),
}

/// A connection the session starts with ([`SessionCore::start`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnStart {
    pub cid: u16,
    /// What it carries (asymmetric mode), as the target agreed.
    pub role: ConnRole,
    /// StatSN of its final login response.
    pub stat_sn: u32,
    /// The largest data segment the target accepts on this connection (its
    /// MaxRecvDataSegmentLength, a connection-only key: each connection negotiates its own);
    /// None: the session's.
    pub max_send_dsl: Option<u32>,
}

impl ConnStart {
    pub fn new(cid: u16, role: ConnRole, stat_sn: u32) -> ConnStart {
        ConnStart {
            cid,
            role,
            stat_sn,
            max_send_dsl: None,
        }
    }
}

#[derive(Debug, Clone)]
struct ConnState {
    alive: bool,
    draining: bool,
    role: ConnRole,
    cid: u16,
    /// Next StatSN expected on this connection.
    exp_stat_sn: u32,
    /// Largest data segment the target takes on this connection.
    max_send_dsl: u32,
    outstanding_tasks: u32,
    outstanding_bytes: u64,
    tasks_total: u64,
    bytes_total: u64,
    statuses_in: u64,
    data_in_bytes: u64,
    tcp: Option<TcpState>,
    /// Bytes per second completed while busy, as the session measures it.
    rate: Option<f64>,
    /// The highest of those over the last few seconds.
    peak: Option<f64>,
    /// The target's sending side, as it last reported it.
    target_tcp: Option<TcpState>,
    /// When it last received something or had nothing outstanding ([`SessionCore::conn_heard`],
    /// [`SessionCore::handle_stall_timeout`]); None until the stall watch first looks.
    heard: Option<std::time::Instant>,
    /// A NOP-Out ping went out since `heard`.
    pinged: bool,
    /// The target asked for this connection's logout (async event 1).
    logout: Option<LogoutWait>,
    /// StatSNs of statuses that arrived damaged (a data digest error) and were asked for again:
    /// ExpStatSN stays at the first of them, so the target keeps them (ErrorRecoveryLevel 1).
    missing: Vec<u32>,
    /// StatSNs of statuses held while their read's Data-In asked for again is missing: not
    /// acknowledged either, or the target would let that data go.
    holding: Vec<u32>,
    /// SNACKs sent, and Data-In or statuses received again after one.
    snacks: u64,
    recovered: u64,
}

impl ConnState {
    fn new(c: &ConnStart, session_dsl: u32) -> ConnState {
        ConnState {
            alive: true,
            draining: false,
            role: c.role,
            cid: c.cid,
            exp_stat_sn: c.stat_sn.wrapping_add(1),
            max_send_dsl: c.max_send_dsl.unwrap_or(session_dsl),
            outstanding_tasks: 0,
            outstanding_bytes: 0,
            tasks_total: 0,
            bytes_total: 0,
            statuses_in: 0,
            data_in_bytes: 0,
            tcp: None,
            rate: None,
            peak: None,
            target_tcp: None,
            heard: None,
            pinged: false,
            logout: None,
            missing: Vec::new(),
            holding: Vec::new(),
            snacks: 0,
            recovered: 0,
        }
    }
}

/// When to try re-establishing a lost session: the first attempt after the delay asked for (at
/// least [`Reconnect::MIN_DELAY`]; DefaultTime2Wait when the target asked for a logout), each
/// next one twice as late, never more than [`Reconnect::MAX_DELAY`] apart, so many in all. The
/// driver sleeps each delay, on whatever clock it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconnect {
    delay: std::time::Duration,
    left: u32,
}

impl Reconnect {
    pub const MIN_DELAY: std::time::Duration = std::time::Duration::from_millis(100);
    pub const MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(10);

    pub fn new(first: std::time::Duration, attempts: u32) -> Reconnect {
        Reconnect {
            delay: first.max(Self::MIN_DELAY),
            left: attempts,
        }
    }

    /// The wait before the next attempt, or None once every attempt was made.
    pub fn next_delay(&mut self) -> Option<std::time::Duration> {
        self.left = self.left.checked_sub(1)?;
        let d = self.delay;
        self.delay = (d * 2).min(Self::MAX_DELAY);
        Some(d)
    }
}

/// A task of a failed-over connection, to clear at the target ([`SessionCore::fail_over`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Orphan {
    pub itt: u32,
    pub cmd_sn: u32,
    /// The LUN field it was sent with.
    pub lun: u64,
}

/// Counters of one connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnStats {
    pub cid: u16,
    pub alive: bool,
    /// What the connection carries (asymmetric mode).
    pub role: ConnRole,
    /// Tasks issued on this connection, and their data bytes.
    pub tasks: u64,
    pub bytes: u64,
    /// Task statuses (SCSI Response, or Data-In with status) received on this connection.
    pub statuses_in: u64,
    /// Data-In payload bytes received on this connection.
    pub data_in_bytes: u64,
    pub outstanding_tasks: u32,
    pub outstanding_bytes: u64,
    /// The target's sending side of the connection, as it last reported it.
    pub target_tcp: Option<TcpState>,
    /// SNACKs sent (ErrorRecoveryLevel 1: Data-In or a status lost to a digest error).
    pub snacks: u64,
    /// Data-In and statuses received again after a SNACK.
    pub recovered: u64,
}

#[derive(Debug)]
struct Queued<C> {
    cmd: Command,
    handle: C,
}

#[derive(Debug)]
struct Task<C> {
    cmd: Command,
    handle: C,
    conn: usize,
    cmd_sn: u32,
    bytes: u64,
    assembly: Option<DataInAssembly>,
    /// When the response watchdog first saw it outstanding ([`SessionCore::handle_timeout`]).
    seen: Option<std::time::Instant>,
    /// Its status, held while Data-In asked for again is still missing (ErrorRecoveryLevel 1).
    held: Option<Held>,
}

/// A read's status, waiting for the Data-In asked for again.
#[derive(Debug)]
struct Held {
    status: u8,
    sense: Option<Sense>,
    residual: Residual,
    /// The connection and StatSN it came with, not acknowledged until the read completes.
    stat_sn: Option<(usize, u32)>,
}

/// SNACK types (RFC 7143 11.16.1).
mod snack_type {
    pub const DATA_R2T: u8 = 0;
    pub const STATUS: u8 = 1;
}

/// Encode a LUN number as the 8-byte SAM-5 LUN (4.6, [`mcsi_scsi::lun::encode`]): peripheral
/// addressing below 256, flat space up to 16383, extended flat space up to 65535. The URL and
/// `mcsi_initiator::Session::open_lun` refuse larger numbers; one would be sent as 65535.
pub fn encode_lun(lun: u64) -> u64 {
    mcsi_scsi::lun::encode(u16::try_from(lun).unwrap_or(u16::MAX))
}

/// The session core. `C` is whatever the driver uses to deliver a result (a oneshot sender).
#[derive(Debug)]
pub struct SessionCore<C> {
    params: SessionParams,
    window: CmdWindow,
    conns: Vec<ConnState>,
    tasks: HashMap<u32, Task<C>>,
    pending: VecDeque<Queued<C>>,
    scheduler: Box<dyn Scheduler>,
    next_itt: u32,
    window_closed_events: u64,
    timers: Timers,
    /// The latest time an input brought ([`SessionCore::conn_heard`],
    /// [`SessionCore::handle_timeout`]).
    clock: Option<Instant>,
    /// When the response watchdog and the stall watch look next.
    next_response_check: Option<Instant>,
    next_stall_check: Option<Instant>,
}

impl<C> SessionCore<C> {
    pub fn new(scheduler: Box<dyn Scheduler>) -> Self {
        SessionCore {
            params: SessionParams::default(),
            window: CmdWindow::new(0, u32::MAX),
            conns: Vec::new(),
            tasks: HashMap::new(),
            pending: VecDeque::new(),
            scheduler,
            next_itt: 1,
            window_closed_events: 0,
            timers: Timers::default(),
            clock: None,
            next_response_check: None,
            next_stall_check: None,
        }
    }

    /// Set the session's timers (they start at the next [`SessionCore::handle_timeout`]).
    pub fn set_timers(&mut self, timers: Timers) {
        self.timers = timers;
        self.next_response_check = None;
        self.next_stall_check = None;
    }

    /// Whether the stall watch applies: a symmetric session of several connections (in the
    /// asymmetric mode a connection's silence is expected, and only the session recovers).
    fn stall_watched(&self) -> bool {
        !self.timers.stall.is_zero() && self.conns.len() >= 2 && self.symmetric()
    }

    /// When [`SessionCore::handle_timeout`] has something to do next, if ever: the next look
    /// of the response watchdog or the stall watch, or a logout deadline. Before the first
    /// `handle_timeout` there is no time base, and None.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut next = None;
        let mut consider = |t: Option<Instant>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n: Instant| n.min(t)));
            }
        };
        if !self.timers.response.is_zero() {
            consider(self.next_response_check);
        }
        if self.stall_watched() {
            consider(self.next_stall_check);
        }
        for c in &self.conns {
            if let Some(LogoutWait::By(t)) = c.logout {
                consider(Some(t));
            }
        }
        next
    }

    /// The time is `now`: run whatever timer is due. The response watchdog gives
    /// [`Event::NoStatus`], the stall watch pings silent connections and gives
    /// [`Event::Stalled`], a logout whose time ran out gives [`Event::LogoutDue`].
    pub fn handle_timeout(&mut self, now: Instant, out: &mut Vec<Action<C>>) {
        self.clock = Some(now);
        for i in 0..self.conns.len() {
            let due = match self.conns[i].logout {
                Some(LogoutWait::Within(d)) => {
                    self.conns[i].logout = Some(LogoutWait::By(now + d));
                    false
                }
                Some(LogoutWait::By(t)) => now >= t,
                None => false,
            };
            if due {
                tracing::info!(
                    conn = i,
                    tasks = self.conns[i].outstanding_tasks,
                    "the time the target gave for the logout ran out"
                );
                self.logout_due(i, out);
            }
        }
        let limit = self.timers.response;
        if !limit.is_zero() && self.next_response_check.is_none_or(|t| now >= t) {
            self.next_response_check = Some(now + self.timers.response_period());
            if let Some(itt) = self.oldest_without_status(now, limit) {
                // Named once per limit: a driver that lets the task wait on hears of it again
                // only a whole limit later.
                let conn = self.tasks.get_mut(&itt).map_or(0, |t| {
                    t.seen = Some(now);
                    t.conn
                });
                out.push(Action::Event {
                    conn,
                    event: Event::NoStatus { itt, waited: limit },
                });
            }
        }
        if self.stall_watched() && self.next_stall_check.is_none_or(|t| now >= t) {
            self.next_stall_check = Some(now + self.timers.stall_period());
            if let Some((conn, silent)) = self.watch_stalls(now, self.timers.stall, out) {
                out.push(Action::Event {
                    conn,
                    event: Event::Stalled { silent },
                });
            }
        }
    }

    /// The logout the target asked for on `conn` is due (once).
    fn logout_due(&mut self, conn: usize, out: &mut Vec<Action<C>>) {
        let Some(c) = self.conns.get_mut(conn) else {
            return;
        };
        if c.logout.take().is_none() {
            return;
        }
        let close_session = self.usable_conns() == 0;
        out.push(Action::Event {
            conn,
            event: Event::LogoutDue { close_session },
        });
    }

    /// Start (or restart after session recovery) with fresh connections. `conns` gives each
    /// connection's CID, role, the StatSN of its final login response and its own data segment
    /// limit. Tasks that were outstanding go back to the head of the queue in their CmdSN
    /// order, to be issued anew.
    pub fn start(
        &mut self,
        params: SessionParams,
        window: CmdWindow,
        conns: &[ConnStart],
        out: &mut Vec<Action<C>>,
    ) {
        self.requeue_outstanding();
        let session_dsl = params.target_max_recv_dsl;
        self.params = params;
        self.window = window;
        self.conns = conns
            .iter()
            .map(|c| ConnState::new(c, session_dsl))
            .collect();
        self.pump(out);
    }

    /// Every connection is gone (ERL 0 recovers the session as a whole, RFC 7143 7.1.5):
    /// outstanding tasks wait for the next [`SessionCore::start`].
    pub fn session_down(&mut self) {
        for c in &mut self.conns {
            c.alive = false;
        }
        self.requeue_outstanding();
    }

    fn requeue_outstanding(&mut self) {
        let mut tasks: Vec<Task<C>> = self.tasks.drain().map(|(_, t)| t).collect();
        let base = tasks.iter().map(|t| t.cmd_sn).min_by(|a, b| {
            if Sn::lt(Sn(*a), Sn(*b)) {
                std::cmp::Ordering::Less
            } else {
                std::cmp::Ordering::Greater
            }
        });
        if let Some(base) = base {
            tasks.sort_by_key(|t| t.cmd_sn.wrapping_sub(base));
        }
        for t in tasks.into_iter().rev() {
            self.pending.push_front(Queued {
                cmd: t.cmd,
                handle: t.handle,
            });
        }
        for c in &mut self.conns {
            c.outstanding_tasks = 0;
            c.outstanding_bytes = 0;
        }
    }

    /// Complete every task and queued command with `err`.
    pub fn fail_all(&mut self, err: &Error, out: &mut Vec<Action<C>>) {
        self.requeue_outstanding();
        while let Some(q) = self.pending.pop_front() {
            out.push(Action::Complete {
                handle: q.handle,
                result: Err(err.clone()),
            });
        }
    }

    pub fn params(&self) -> &SessionParams {
        &self.params
    }

    pub fn window(&self) -> &CmdWindow {
        &self.window
    }

    pub fn scheduler_name(&self) -> &'static str {
        self.scheduler.name()
    }

    pub fn scheduler_wants_tcp_info(&self) -> bool {
        self.scheduler.wants_tcp_info()
    }

    /// Tasks issued and not completed, plus those waiting for the window or a connection.
    pub fn outstanding(&self) -> usize {
        self.tasks.len() + self.pending.len()
    }

    /// Connection `conn` received something at `now` (the stall watch hears it).
    pub fn conn_heard(&mut self, conn: usize, now: std::time::Instant) {
        self.clock = Some(now);
        if let Some(c) = self.conns.get_mut(conn) {
            c.heard = Some(now);
            c.pinged = false;
        }
    }

    /// The stall watch on passed-in time ([`SessionCore::handle_timeout`] looks every so often
    /// in a symmetric session of several connections). A live connection with work outstanding that has received nothing
    /// for half of `limit` is pinged (an immediate NOP-Out, sent ahead of its queued data, whose
    /// answer proves the path); one silent for all of `limit` is returned with how long it has
    /// been silent, for the driver to take it out of the session ([`SessionCore::fail_over`]),
    /// but only while another connection was heard within `limit`: when every path is silent
    /// the target, not a path, is the likelier cause, and failing over would not help.
    fn watch_stalls(
        &mut self,
        now: std::time::Instant,
        limit: std::time::Duration,
        out: &mut Vec<Action<C>>,
    ) -> Option<(usize, std::time::Duration)> {
        let mut stalled = None;
        for i in 0..self.conns.len() {
            let Some(c) = self.conns.get_mut(i) else {
                continue;
            };
            if !c.alive {
                continue;
            }
            if c.outstanding_tasks == 0 {
                c.heard = Some(now);
                c.pinged = false;
                continue;
            }
            let silent = now.saturating_duration_since(*c.heard.get_or_insert(now));
            if silent >= limit / 2 && !c.pinged {
                c.pinged = true;
                tracing::debug!(
                    conn = i,
                    ?silent,
                    "connection silent with work outstanding; pinging it"
                );
                // A ping takes an ITT of its own.
                let ping = NopOut {
                    immediate: true,
                    lun: 0,
                    itt: self.alloc_itt(),
                    ttt: RESERVED_TAG,
                    cmd_sn: self.immediate_cmd_sn(),
                    exp_stat_sn: self.exp_stat_sn(i),
                    data: Bytes::new(),
                };
                out.push(Action::Urgent {
                    conn: i,
                    pdu: Pdu::NopOut(ping),
                });
            }
            if silent >= limit && stalled.is_none() {
                stalled = Some((i, silent));
            }
        }
        let (conn, silent) = stalled?;
        let others = self.conns.iter().enumerate().any(|(j, c)| {
            j != conn
                && c.alive
                && c.heard
                    .is_some_and(|h| now.saturating_duration_since(h) < limit)
        });
        others.then_some((conn, silent))
    }

    /// The response watchdog on passed-in time ([`SessionCore::handle_timeout`] looks every so
    /// often): each issued task is
    /// stamped with the first `now` that sees it, and the oldest one whose stamp is `limit` old
    /// is returned: it has had no status for that long, and at ErrorRecoveryLevel 0 (a lost PDU,
    /// a black-holed path) only a new session gets it one. A task issued again (failed over)
    /// starts a new stamp.
    fn oldest_without_status(
        &mut self,
        now: std::time::Instant,
        limit: std::time::Duration,
    ) -> Option<u32> {
        let mut oldest: Option<(std::time::Instant, u32)> = None;
        for (itt, t) in self.tasks.iter_mut() {
            let seen = *t.seen.get_or_insert(now);
            if oldest.is_none_or(|(s, _)| seen < s) {
                oldest = Some((seen, *itt));
            }
        }
        oldest
            .filter(|(seen, _)| now.saturating_duration_since(*seen) >= limit)
            .map(|(_, itt)| itt)
    }

    /// Times a command had to wait because the window was closed.
    pub fn window_waits(&self) -> u64 {
        self.window_closed_events
    }

    pub fn conn_count(&self) -> usize {
        self.conns.len()
    }

    pub fn cid(&self, conn: usize) -> Option<u16> {
        self.conns.get(conn).map(|c| c.cid)
    }

    pub fn conn_by_cid(&self, cid: u16) -> Option<usize> {
        self.conns.iter().position(|c| c.cid == cid)
    }

    pub fn conn_stats(&self) -> Vec<ConnStats> {
        self.conns
            .iter()
            .map(|c| ConnStats {
                cid: c.cid,
                alive: c.alive,
                role: c.role,
                tasks: c.tasks_total,
                bytes: c.bytes_total,
                statuses_in: c.statuses_in,
                data_in_bytes: c.data_in_bytes,
                outstanding_tasks: c.outstanding_tasks,
                outstanding_bytes: c.outstanding_bytes,
                target_tcp: c.target_tcp,
                snacks: c.snacks,
                recovered: c.recovered,
            })
            .collect()
    }

    /// Seconds until a task of `bytes` would complete, by the tcp-aware estimate over the
    /// connections ([`crate::sched::expected_completion`]), with the commands still waiting for
    /// the CmdSN window shared out among the usable connections first. None until a rate has
    /// been measured.
    pub fn expected_completion(&self, bytes: u64) -> Option<f64> {
        let mut loads = self.loads();
        let usable = loads.iter().filter(|c| c.usable).count() as u64;
        let waiting: u64 = self.pending.iter().map(|q| q.cmd.bytes()).sum();
        if let Some(share) = waiting.checked_div(usable) {
            for c in loads.iter_mut().filter(|c| c.usable) {
                c.outstanding_bytes += share;
            }
        }
        crate::sched::expected_completion(&loads, bytes)
    }

    /// The target's latest report of each connection's sending side.
    pub fn target_tcp(&self) -> Vec<Option<TcpState>> {
        self.conns.iter().map(|c| c.target_tcp).collect()
    }

    /// Record a TCP_INFO sample for the scheduler.
    pub fn set_tcp(&mut self, conn: usize, tcp: TcpState) {
        if let Some(c) = self.conns.get_mut(conn) {
            c.tcp = Some(tcp);
        }
    }

    /// Record the rate a connection completes data at while busy, and the highest of the last
    /// few seconds ([`crate::sched::RateMeter::rate`], [`crate::sched::RateMeter::peak`]).
    pub fn set_rate(&mut self, conn: usize, rate: Option<f64>, peak: Option<f64>) {
        if let Some(c) = self.conns.get_mut(conn) {
            c.rate = rate;
            c.peak = peak;
        }
    }

    /// Stop giving new tasks to a connection (before its logout).
    pub fn set_draining(&mut self, conn: usize) {
        if let Some(c) = self.conns.get_mut(conn) {
            c.draining = true;
        }
    }

    /// The connection has no outstanding task.
    pub fn conn_idle(&self, conn: usize) -> bool {
        self.conns
            .get(conn)
            .is_none_or(|c| c.outstanding_tasks == 0)
    }

    /// A connection was logged out cleanly: no more tasks on it.
    pub fn conn_closed(&mut self, conn: usize) {
        if let Some(c) = self.conns.get_mut(conn) {
            c.alive = false;
        }
    }

    /// Connections that can take tasks.
    pub fn usable_conns(&self) -> usize {
        self.loads().iter().filter(|l| l.usable).count()
    }

    /// Whether connection `conn` is in the session and carries tasks (not failed over, closed
    /// or lost with the session).
    pub fn conn_alive(&self, conn: usize) -> bool {
        self.conns.get(conn).is_some_and(|c| c.alive)
    }

    /// Whether every connection carries both requests and responses (no asymmetric mode).
    pub fn symmetric(&self) -> bool {
        self.conns.iter().all(|c| c.role == ConnRole::Both)
    }

    /// Connection `conn` stopped delivering (its route died, RFC 7143 allows a session to go
    /// on without one of its connections after logging it out): it takes no new task, and
    /// its outstanding tasks are returned, oldest CmdSN first, for the driver to clear at the
    /// target (Logout of the CID, ABORT TASK) before [`SessionCore::reissue`] issues them
    /// again. The tasks stay in the table until then: a status that still arrives on another
    /// connection completes them as usual.
    pub fn fail_over(&mut self, conn: usize) -> Vec<Orphan> {
        let Some(c) = self.conns.get_mut(conn) else {
            return Vec::new();
        };
        c.alive = false;
        let mut orphans: Vec<Orphan> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.conn == conn)
            .map(|(itt, t)| Orphan {
                itt: *itt,
                cmd_sn: t.cmd_sn,
                lun: encode_lun(t.cmd.lun),
            })
            .collect();
        if let Some(base) =
            orphans
                .iter()
                .map(|o| o.cmd_sn)
                .reduce(|a, b| if Sn::lt(Sn(a), Sn(b)) { a } else { b })
        {
            orphans.sort_by_key(|o| o.cmd_sn.wrapping_sub(base));
        }
        orphans
    }

    /// Task `itt` as the core sees it, for logs: connection, CmdSN, direction, Data-In state.
    pub fn describe_task(&self, itt: u32) -> String {
        match self.tasks.get(&itt) {
            None => "unknown".into(),
            Some(t) => format!(
                "conn {} (alive {}), CmdSN {}, {}, {} bytes, exp DataSN {:?}, status held {}",
                t.conn,
                self.conn_alive(t.conn),
                t.cmd_sn,
                if matches!(t.cmd.dir, DataDir::Write(_)) {
                    "write"
                } else {
                    "read or none"
                },
                t.bytes,
                t.assembly.as_ref().map(DataInAssembly::exp_data_sn),
                t.held.is_some()
            ),
        }
    }

    /// The first Data-In task `itt` still needs (0 for a task that reads nothing): TASK
    /// REASSIGN's ExpDataSN.
    pub fn exp_data_sn(&self, itt: u32) -> u32 {
        self.tasks
            .get(&itt)
            .and_then(|t| t.assembly.as_ref())
            .map_or(0, DataInAssembly::exp_data_sn)
    }

    /// ErrorRecoveryLevel 2: the target took task `itt` over to connection `conn` (TASK
    /// REASSIGN answered "function complete"): it goes on there, its Data-In, R2Ts and status
    /// arriving on it and its Data-Out leaving on it. False when the task is gone.
    pub fn reassigned(&mut self, itt: u32, conn: usize) -> bool {
        let Some(t) = self.tasks.get_mut(&itt) else {
            return false;
        };
        let (old, bytes) = (t.conn, t.bytes);
        t.conn = conn;
        t.seen = None;
        if let Some(c) = self.conns.get_mut(old) {
            c.outstanding_tasks = c.outstanding_tasks.saturating_sub(1);
            c.outstanding_bytes = c.outstanding_bytes.saturating_sub(bytes);
        }
        if let Some(c) = self.conns.get_mut(conn) {
            c.outstanding_tasks += 1;
            c.outstanding_bytes += bytes;
        }
        true
    }

    /// Issue the failed-over tasks `itts` again (new ITT and CmdSN, on the connections that
    /// remain), ahead of the queued commands and in their old CmdSN order. Tasks that completed
    /// meanwhile are skipped.
    pub fn reissue(&mut self, itts: &[u32], out: &mut Vec<Action<C>>) {
        for itt in itts.iter().rev() {
            let Some(t) = self.tasks.remove(itt) else {
                continue;
            };
            if let Some(c) = self.conns.get_mut(t.conn) {
                c.outstanding_tasks = c.outstanding_tasks.saturating_sub(1);
                c.outstanding_bytes = c.outstanding_bytes.saturating_sub(t.bytes);
            }
            self.pending.push_front(Queued {
                cmd: t.cmd,
                handle: t.handle,
            });
        }
        self.pump(out);
    }

    /// A new connection took slot `conn` (a failed-over connection's route came back): it
    /// carries tasks again from now on, with fresh counters.
    pub fn conn_up(&mut self, conn: usize, start: ConnStart, out: &mut Vec<Action<C>>) {
        let session_dsl = self.params.target_max_recv_dsl;
        if let Some(c) = self.conns.get_mut(conn) {
            *c = ConnState::new(&start, session_dsl);
        }
        self.pump(out);
    }

    /// Take a CmdSN window from a login response on a connection added to the session.
    pub fn update_window(&mut self, exp_cmd_sn: u32, max_cmd_sn: u32) {
        self.window.update(exp_cmd_sn, max_cmd_sn);
    }

    /// CmdSN for an immediate PDU (carried, not taken: 11.18 / 4.2.2.1).
    pub fn immediate_cmd_sn(&self) -> u32 {
        self.window.next_cmd_sn()
    }

    /// The largest data segment connection `conn` may carry.
    fn max_send_dsl(&self, conn: usize) -> u32 {
        self.conns
            .get(conn)
            .map_or(self.params.target_max_recv_dsl, |c| c.max_send_dsl)
    }

    /// The ExpStatSN to send on `conn`: the next StatSN expected, or the first status that
    /// arrived damaged and was asked for again (ErrorRecoveryLevel 1).
    pub fn exp_stat_sn(&self, conn: usize) -> u32 {
        self.conns.get(conn).map_or(0, |c| {
            c.missing
                .iter()
                .chain(&c.holding)
                .copied()
                .fold(
                    c.exp_stat_sn,
                    |a, m| if Sn::lt(Sn(m), Sn(a)) { m } else { a },
                )
        })
    }

    /// A fresh Initiator Task Tag, never the reserved value nor one in use.
    pub fn alloc_itt(&mut self) -> u32 {
        loop {
            let t = self.next_itt;
            self.next_itt = self.next_itt.wrapping_add(1);
            if t != RESERVED_TAG && !self.tasks.contains_key(&t) {
                return t;
            }
        }
    }

    /// Queue a command; it goes out as soon as the window and a connection allow.
    pub fn submit(&mut self, cmd: Command, handle: C, out: &mut Vec<Action<C>>) {
        self.pending.push_back(Queued { cmd, handle });
        self.pump(out);
    }

    fn loads(&self) -> Vec<ConnLoad> {
        self.conns
            .iter()
            .map(|c| ConnLoad {
                usable: c.alive && !c.draining && c.role != ConnRole::Responses,
                outstanding_tasks: c.outstanding_tasks,
                outstanding_bytes: c.outstanding_bytes,
                tcp: c.tcp,
                rate: c.rate,
                peak: c.peak,
                target_tcp: c.target_tcp,
            })
            .collect()
    }

    /// Issue queued commands while the window is open (never beyond MaxCmdSN).
    pub fn pump(&mut self, out: &mut Vec<Action<C>>) {
        let mut loads: Option<Vec<ConnLoad>> = None;
        while let Some(front) = self.pending.front() {
            if !self.window.can_send() {
                self.window_closed_events += 1;
                break;
            }
            let info = TaskInfo {
                bytes: front.cmd.bytes(),
                write: matches!(front.cmd.dir, DataDir::Write(_)),
            };
            let l = loads.get_or_insert_with(|| self.loads());
            let Some(conn) = self.scheduler.pick(l, &info) else {
                break;
            };
            let Some(cmd_sn) = self.window.take() else {
                break;
            };
            let Some(q) = self.pending.pop_front() else {
                break;
            };
            l[conn].outstanding_tasks += 1;
            l[conn].outstanding_bytes += info.bytes;
            self.issue(q, conn, cmd_sn, out);
        }
    }

    fn issue(&mut self, q: Queued<C>, conn: usize, cmd_sn: u32, out: &mut Vec<Action<C>>) {
        let itt = self.alloc_itt();
        let lun = encode_lun(q.cmd.lun);
        let exp_stat_sn = self.exp_stat_sn(conn);
        let bytes = q.cmd.bytes();
        let (read, write, len) = match &q.cmd.dir {
            DataDir::None => (false, false, 0),
            DataDir::Read(n) => (true, false, *n),
            DataDir::Write(b) => (false, true, b.len() as u32),
        };
        let (imm, unsolicited) = match &q.cmd.dir {
            DataDir::Write(b) => {
                let max_pdu = self.max_send_dsl(conn);
                let plan = plan_write(len, &self.params, max_pdu);
                let outs = if plan.has_data_out() {
                    data_outs(
                        lun,
                        itt,
                        RESERVED_TAG,
                        b,
                        plan.immediate,
                        plan.unsolicited_end - plan.immediate,
                        max_pdu,
                    )
                } else {
                    Vec::new()
                };
                (b.slice(0..plan.immediate as usize), outs)
            }
            _ => (Bytes::new(), Vec::new()),
        };
        out.push(Action::Send {
            conn,
            pdu: Pdu::ScsiCommand(ScsiCommand {
                immediate: false,
                final_: unsolicited.is_empty(),
                read,
                write,
                attr: TaskAttr::Simple,
                lun,
                itt,
                expected_data_transfer_length: len,
                cmd_sn,
                exp_stat_sn,
                cdb: q.cmd.cdb.clone(),
                bidi_read_length: None,
                data: imm,
            }),
        });
        for mut d in unsolicited {
            d.exp_stat_sn = exp_stat_sn;
            out.push(Action::Send {
                conn,
                pdu: Pdu::DataOut(d),
            });
        }
        if let Some(c) = self.conns.get_mut(conn) {
            c.outstanding_tasks += 1;
            c.outstanding_bytes += bytes;
            c.tasks_total += 1;
            c.bytes_total += bytes;
        }
        self.tasks.insert(
            itt,
            Task {
                assembly: read.then(|| {
                    let a = DataInAssembly::new(len);
                    if self.params.error_recovery_level > 0 {
                        a.recovering()
                    } else {
                        a
                    }
                }),
                cmd: q.cmd,
                handle: q.handle,
                conn,
                cmd_sn,
                bytes,
                seen: None,
                held: None,
            },
        );
    }

    fn finish(&mut self, itt: u32, result: Result<Response, Error>, out: &mut Vec<Action<C>>) {
        if let Some(t) = self.tasks.remove(&itt) {
            // A status it held unacknowledged may be acknowledged now.
            if let Some((conn, sn)) = t.held.as_ref().and_then(|h| h.stat_sn) {
                if let Some(c) = self.conns.get_mut(conn) {
                    c.holding.retain(|x| *x != sn);
                }
            }
            let mut drained = false;
            if let Some(c) = self.conns.get_mut(t.conn) {
                c.outstanding_tasks = c.outstanding_tasks.saturating_sub(1);
                c.outstanding_bytes = c.outstanding_bytes.saturating_sub(t.bytes);
                drained = c.outstanding_tasks == 0 && c.logout.is_some();
            }
            out.push(Action::Complete {
                handle: t.handle,
                result,
            });
            if drained {
                self.logout_due(t.conn, out);
            }
        }
    }

    /// The status StatSN `sn` on `conn` is held for missing Data-In: ExpStatSN stays at it.
    fn hold_stat_sn(&mut self, conn: usize, sn: u32) {
        if let Some(c) = self.conns.get_mut(conn) {
            if !c.holding.contains(&sn) && c.holding.len() < crate::task::MAX_HOLES {
                c.holding.push(sn);
            }
        }
    }

    /// Completes read `itt` with its held status once no Data-In is missing.
    fn finish_held(&mut self, itt: u32, out: &mut Vec<Action<C>>) {
        let Some(task) = self.tasks.get_mut(&itt) else {
            return;
        };
        let Some(h) = task.held.take() else { return };
        if let Some((conn, sn)) = h.stat_sn {
            if let Some(c) = self.conns.get_mut(conn) {
                c.holding.retain(|x| *x != sn);
            }
        }
        let data = match task.assembly.take() {
            Some(a) if h.status == crate::error::status::GOOD => a.finish(h.residual),
            _ => Ok(Bytes::new()),
        };
        let result = data.map(|data| Response {
            status: h.status,
            sense: h.sense,
            data,
            residual: h.residual,
        });
        self.finish(itt, result, out);
    }

    /// StatSN bookkeeping (RFC 7143 4.2.2.2, 11.19.3): PDUs that carry a status advance the
    /// connection's ExpStatSN past their StatSN; R2T and unsolicited NOP-In carry the next
    /// StatSN without consuming it ([`Pdu::stat_sn`], the same rule the target stamps by).
    fn note_stat_sn(&mut self, conn: usize, pdu: &Pdu) {
        let Some((sn, advances)) = pdu.stat_sn() else {
            return;
        };
        let next = if advances { sn.wrapping_add(1) } else { sn };
        if let Some(c) = self.conns.get_mut(conn) {
            if Sn::gt(Sn(next), Sn(c.exp_stat_sn)) {
                c.exp_stat_sn = next;
            }
            if advances {
                if let Some(i) = c.missing.iter().position(|m| *m == sn) {
                    c.missing.swap_remove(i);
                    c.recovered += 1;
                }
            }
        }
    }

    /// A PDU arrived on `conn` with a data digest error, its header sound (ErrorRecoveryLevel 1
    /// and above, RFC 7143 7.8): what it lost is asked for again with a SNACK on `conn` (the
    /// connection that sent it keeps it). A Data-In is asked for by its DataSN (with any gap
    /// before it); another PDU that took a StatSN by a Status SNACK, ExpStatSN staying at it
    /// until it comes. An error is connection-level, as for [`SessionCore::handle_pdu`].
    pub fn handle_damaged(
        &mut self,
        conn: usize,
        pdu: Pdu,
        out: &mut Vec<Action<C>>,
    ) -> Result<(), Error> {
        if self.params.error_recovery_level == 0 {
            return Err(Error::Protocol(format!(
                "{:?} PDU with a data digest error at ErrorRecoveryLevel 0",
                pdu.opcode()
            )));
        }
        self.note_window(&pdu);
        let took = match pdu.stat_sn() {
            Some((sn, true)) => Some(sn),
            _ => None,
        };
        if let (Some(sn), Some(c)) = (took, self.conns.get_mut(conn)) {
            if !c.missing.contains(&sn) && c.missing.len() < crate::task::MAX_HOLES {
                c.missing.push(sn);
            }
            if Sn::ge(Sn(sn), Sn(c.exp_stat_sn)) {
                c.exp_stat_sn = sn.wrapping_add(1);
            }
        }
        let snack = match &pdu {
            Pdu::DataIn(d) => {
                let Some(task) = self.tasks.get_mut(&d.itt) else {
                    tracing::debug!(itt = d.itt, "damaged Data-In for an unknown task; ignored");
                    return Ok(());
                };
                let lun = encode_lun(task.cmd.lun);
                let Some(a) = task.assembly.as_mut() else {
                    let e = Error::Protocol(format!(
                        "Data-In for ITT {:#x}, which is not a read",
                        d.itt
                    ));
                    self.finish(d.itt, Err(e.clone()), out);
                    return Err(e);
                };
                match a.lost(d.itt, d.data_sn) {
                    Ok(Some((beg_run, run_length))) => {
                        Some((snack_type::DATA_R2T, lun, d.itt, beg_run, run_length))
                    }
                    Ok(None) => None,
                    Err(e) => {
                        self.finish(d.itt, Err(e.clone()), out);
                        return Err(e);
                    }
                }
            }
            _ => took.map(|sn| (snack_type::STATUS, 0, RESERVED_TAG, sn, 1)),
        };
        if let Some((snack_type, lun, itt, beg_run, run_length)) = snack {
            let exp_stat_sn = self.exp_stat_sn(conn);
            if let Some(c) = self.conns.get_mut(conn) {
                c.snacks += 1;
            }
            tracing::debug!(
                conn,
                snack_type,
                itt = format_args!("{itt:#x}"),
                beg_run,
                run_length,
                "data digest error: asking for the PDU again"
            );
            out.push(Action::Send {
                conn,
                pdu: Pdu::SnackRequest(SnackRequest {
                    snack_type,
                    lun,
                    itt,
                    ttt: RESERVED_TAG,
                    exp_stat_sn,
                    beg_run,
                    run_length,
                }),
            });
        }
        Ok(())
    }

    fn note_window(&mut self, pdu: &Pdu) {
        let Some(pair) = pdu.cmd_window() else {
            return;
        };
        match self.window.update(pair.0, pair.1) {
            WindowUpdate::Invalid => tracing::debug!(
                exp = pair.0,
                max = pair.1,
                "ignoring ExpCmdSN/MaxCmdSN pair with MaxCmdSN < ExpCmdSN - 1"
            ),
            WindowUpdate::AheadOfSent => tracing::warn!(
                exp = pair.0,
                next = self.window.next_cmd_sn(),
                "target acknowledges CmdSNs never sent; ignoring its ExpCmdSN"
            ),
            _ => {}
        }
    }

    /// Take one PDU from connection `conn`. An error is connection-level: the driver drops the
    /// connection (and at ERL 0 recovers the session).
    pub fn handle_pdu(
        &mut self,
        conn: usize,
        pdu: Pdu,
        out: &mut Vec<Action<C>>,
    ) -> Result<(), Error> {
        if let Some(c) = self.conns.get_mut(conn) {
            match &pdu {
                Pdu::ScsiResponse(_) => c.statuses_in += 1,
                Pdu::DataIn(d) => {
                    c.data_in_bytes += d.data.len() as u64;
                    c.statuses_in += u64::from(d.status.is_some());
                }
                _ => {}
            }
        }
        self.note_stat_sn(conn, &pdu);
        self.note_window(&pdu);
        let r = self.dispatch(conn, pdu, out);
        self.pump(out);
        r
    }

    fn dispatch(&mut self, conn: usize, pdu: Pdu, out: &mut Vec<Action<C>>) -> Result<(), Error> {
        match pdu {
            Pdu::ScsiResponse(r) => {
                let Some(task) = self.tasks.get_mut(&r.itt) else {
                    tracing::debug!(itt = r.itt, "SCSI Response for an unknown task; ignored");
                    return Ok(());
                };
                let waits = r.response == 0
                    && r.status == crate::error::status::GOOD
                    && task.assembly.as_ref().is_some_and(|a| !a.complete());
                if waits {
                    // Data-In asked for again has not come yet: the status waits for it.
                    task.held = Some(Held {
                        status: r.status,
                        sense: Sense::parse(&r.sense),
                        residual: Residual::from_flags(r.underflow, r.overflow, r.residual_count),
                        stat_sn: Some((conn, r.stat_sn)),
                    });
                    self.hold_stat_sn(conn, r.stat_sn);
                    return Ok(());
                }
                let result = if r.response != 0 {
                    Err(Error::TargetFailure {
                        response: r.response,
                    })
                } else {
                    let residual = Residual::from_flags(r.underflow, r.overflow, r.residual_count);
                    let data = match task.assembly.take() {
                        Some(a) if r.status == crate::error::status::GOOD => a.finish(residual),
                        _ => Ok(Bytes::new()),
                    };
                    data.map(|data| Response {
                        status: r.status,
                        sense: Sense::parse(&r.sense),
                        data,
                        residual,
                    })
                };
                self.finish(r.itt, result, out);
            }
            Pdu::DataIn(d) => {
                let Some(task) = self.tasks.get_mut(&d.itt) else {
                    tracing::debug!(itt = d.itt, "Data-In for an unknown task; ignored");
                    return Ok(());
                };
                let Some(a) = task.assembly.as_mut() else {
                    let e = Error::Protocol(format!(
                        "Data-In for ITT {:#x}, which is not a read",
                        d.itt
                    ));
                    self.finish(d.itt, Err(e.clone()), out);
                    return Err(e);
                };
                let push = match a.push(&d) {
                    Ok(p) => p,
                    Err(e) => {
                        self.finish(d.itt, Err(e.clone()), out);
                        return Err(e);
                    }
                };
                let complete = a.complete();
                let lun = encode_lun(task.cmd.lun);
                if let Some(status) = d.status {
                    task.held = Some(Held {
                        status,
                        sense: None,
                        residual: Residual::from_flags(d.underflow, d.overflow, d.residual_count),
                        stat_sn: Some((conn, d.stat_sn)),
                    });
                    if !complete {
                        self.hold_stat_sn(conn, d.stat_sn);
                    }
                }
                match push {
                    Push::Duplicate => return Ok(()),
                    Push::Filled => {
                        if let Some(c) = self.conns.get_mut(conn) {
                            c.recovered += 1;
                        }
                    }
                    Push::Gap {
                        beg_run,
                        run_length,
                    } => {
                        let exp_stat_sn = self.exp_stat_sn(conn);
                        if let Some(c) = self.conns.get_mut(conn) {
                            c.snacks += 1;
                        }
                        out.push(Action::Send {
                            conn,
                            pdu: Pdu::SnackRequest(SnackRequest {
                                snack_type: snack_type::DATA_R2T,
                                lun,
                                itt: d.itt,
                                ttt: RESERVED_TAG,
                                exp_stat_sn,
                                beg_run,
                                run_length,
                            }),
                        });
                    }
                    Push::Taken => {}
                }
                if complete {
                    self.finish_held(d.itt, out);
                }
            }
            Pdu::R2t(r) => {
                let Some(task) = self.tasks.get(&r.itt) else {
                    tracing::debug!(itt = r.itt, "R2T for an unknown task; ignored");
                    return Ok(());
                };
                let DataDir::Write(data) = &task.cmd.dir else {
                    let e =
                        Error::Protocol(format!("R2T for ITT {:#x}, which is not a write", r.itt));
                    self.finish(r.itt, Err(e.clone()), out);
                    return Err(e);
                };
                // A task whose connection failed is answered where its R2T came: the target
                // moved it there (TASK REASSIGN, ErrorRecoveryLevel 2).
                let task_conn = if self.conn_alive(task.conn) {
                    task.conn
                } else {
                    conn
                };
                let max_pdu = self.max_send_dsl(task_conn);
                match answer_r2t(&r, encode_lun(task.cmd.lun), data, &self.params, max_pdu) {
                    Ok(outs) => {
                        let exp = self.exp_stat_sn(task_conn);
                        for mut d in outs {
                            d.exp_stat_sn = exp;
                            // Connection allegiance: Data-Out goes where the command went.
                            out.push(Action::Send {
                                conn: task_conn,
                                pdu: Pdu::DataOut(d),
                            });
                        }
                    }
                    Err(e) => {
                        self.finish(r.itt, Err(e.clone()), out);
                        return Err(e);
                    }
                }
            }
            Pdu::NopIn(n) => {
                if n.ttt != RESERVED_TAG {
                    // A ping from the target: answer on the same connection (11.18).
                    out.push(Action::Send {
                        conn,
                        pdu: Pdu::NopOut(NopOut {
                            immediate: true,
                            lun: n.lun,
                            itt: RESERVED_TAG,
                            ttt: n.ttt,
                            cmd_sn: self.window.next_cmd_sn(),
                            exp_stat_sn: self.exp_stat_sn(conn),
                            data: n.data,
                        }),
                    });
                }
            }
            Pdu::AsyncMessage(a) => {
                let event = match a.async_event {
                    0 => {
                        tracing::info!(
                            sense = ?Sense::parse(a.data.get(2..).unwrap_or_default()),
                            "target reports a SCSI asynchronous event"
                        );
                        return Ok(());
                    }
                    1 => {
                        // Stop giving it tasks; the logout is due when its tasks have ended or
                        // the time given runs out (at least a second).
                        let within = Duration::from_secs(u64::from(a.parameter3.max(1)));
                        let clock = self.clock;
                        if let Some(c) = self.conns.get_mut(conn) {
                            c.draining = true;
                            c.logout = Some(match clock {
                                Some(now) => LogoutWait::By(now + within),
                                None => LogoutWait::Within(within),
                            });
                        }
                        out.push(Action::Event {
                            conn,
                            event: Event::LogoutRequested {
                                cid: self.cid(conn).unwrap_or_default(),
                                within_secs: a.parameter3,
                            },
                        });
                        if self.conn_idle(conn) {
                            self.logout_due(conn, out);
                        }
                        return Ok(());
                    }
                    2 | 3 => Event::Dropped {
                        session: a.async_event == 3,
                        time2wait: a.parameter2,
                        time2retain: a.parameter3,
                    },
                    4 => {
                        tracing::info!("target asks for renegotiation; keeping current parameters");
                        return Ok(());
                    }
                    255 if a.async_vcode == mcsi_proto::vendor::TCP_REPORT_VCODE => {
                        let pairs = mcsi_proto::vendor::decode_report(&a.data);
                        if let Some(c) = self.conns.get_mut(conn) {
                            c.target_tcp = Some(TcpState::from_report(&pairs));
                        }
                        return Ok(());
                    }
                    other => {
                        tracing::debug!(event = other, "asynchronous message ignored");
                        return Ok(());
                    }
                };
                out.push(Action::Event { conn, event });
            }
            Pdu::Reject(r)
                if r.reason == mcsi_proto::pdu::reject_reason::DATA_DIGEST_ERROR
                    && self.params.error_recovery_level > 0
                    && matches!(r.header.first().map(|b| b & 0x3f), Some(0x01 | 0x05)) =>
            {
                // Data of ours the target discarded for a digest error: at ErrorRecoveryLevel 1
                // it asks for it again with a recovery R2T (7.8), nothing to do here.
                tracing::debug!(
                    conn,
                    "target discarded data for a digest error; it will ask again"
                );
            }
            Pdu::Reject(r) => {
                let itt = r
                    .header
                    .get(16..20)
                    .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
                match itt {
                    Some(itt) if self.tasks.contains_key(&itt) => {
                        self.finish(itt, Err(Error::Rejected { reason: r.reason }), out);
                    }
                    _ => out.push(Action::Event {
                        conn,
                        event: Event::Rejected { reason: r.reason },
                    }),
                }
            }
            p @ (Pdu::LogoutResponse(_) | Pdu::TextResponse(_) | Pdu::TaskMgmtResponse(_)) => {
                out.push(Action::Event {
                    conn,
                    event: Event::Control(p),
                });
            }
            other => {
                return Err(Error::Protocol(format!(
                    "unexpected {:?} PDU in full feature phase",
                    other.opcode()
                )))
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::{LeastOutstanding, RoundRobin};
    use mcsi_proto::pdu::{DataIn, NopIn, R2t, ScsiResponse};

    type Core = SessionCore<u32>;

    fn params() -> SessionParams {
        SessionParams {
            session: mcsi_proto::keys::SessionParams {
                max_connections: 4,
                initial_r2t: true,
                immediate_data: true,
                first_burst_length: 65536,
                max_burst_length: 262144,
                ..Default::default()
            },
            target_max_recv_dsl: 8192,
            ..SessionParams::default()
        }
    }

    fn core(n: usize, exp: u32, max: u32) -> (Core, Vec<Action<u32>>) {
        let mut c = Core::new(Box::new(RoundRobin::default()));
        let conns: Vec<ConnStart> = (0..n)
            .map(|i| ConnStart::new(i as u16, ConnRole::Both, 1000))
            .collect();
        let mut out = Vec::new();
        c.start(params(), CmdWindow::new(exp, max), &conns, &mut out);
        (c, out)
    }

    fn read(lun: u64, len: u32) -> Command {
        Command {
            lun,
            cdb: Bytes::from_static(&[0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0]),
            dir: DataDir::Read(len),
        }
    }

    /// TEST UNIT READY: no data, so a bare GOOD response completes it.
    fn tur() -> Command {
        Command {
            lun: 0,
            cdb: Bytes::from_static(&[0; 6]),
            dir: DataDir::None,
        }
    }

    fn sends(out: &[Action<u32>]) -> Vec<(usize, &Pdu)> {
        out.iter()
            .filter_map(|a| match a {
                Action::Send { conn, pdu } => Some((*conn, pdu)),
                _ => None,
            })
            .collect()
    }

    fn cmd_sns(out: &[Action<u32>]) -> Vec<(usize, u32, u32)> {
        sends(out)
            .into_iter()
            .filter_map(|(c, p)| match p {
                Pdu::ScsiCommand(s) => Some((c, s.cmd_sn, s.itt)),
                _ => None,
            })
            .collect()
    }

    fn good(itt: u32, stat_sn: u32, exp: u32, max: u32) -> Pdu {
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
            exp_cmd_sn: exp,
            max_cmd_sn: max,
            exp_data_sn: 0,
            bidi_residual_count: 0,
            residual_count: 0,
            sense: Bytes::new(),
        })
    }

    #[test]
    fn reconnects_back_off_to_ten_seconds_and_stop() {
        let ms = std::time::Duration::from_millis;
        let mut r = Reconnect::new(ms(0), 7);
        let delays: Vec<u64> = std::iter::from_fn(|| r.next_delay())
            .map(|d| d.as_millis() as u64)
            .collect();
        assert_eq!(delays, vec![100, 200, 400, 800, 1600, 3200, 6400]);
        let mut r = Reconnect::new(ms(6000), 3);
        assert_eq!(r.next_delay(), Some(ms(6000)));
        assert_eq!(r.next_delay(), Some(ms(10_000)));
        assert_eq!(r.next_delay(), Some(ms(10_000)));
        assert_eq!(r.next_delay(), None);
        assert_eq!(Reconnect::new(ms(500), 0).next_delay(), None);
    }

    /// The stall watch on virtual time: a silent connection is pinged at half the limit and
    /// named at the limit, only while another connection is heard.
    #[test]
    fn the_stall_watch_pings_then_names_a_silent_connection() {
        let (mut c, _) = core(2, 1, 10);
        let mut out = Vec::new();
        c.submit(tur(), 0, &mut out);
        c.submit(tur(), 1, &mut out);
        let t0 = std::time::Instant::now();
        let limit = std::time::Duration::from_secs(4);
        let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
        let urgent = |out: &[Action<u32>]| -> Vec<usize> {
            out.iter()
                .filter_map(|a| match a {
                    Action::Urgent {
                        conn,
                        pdu: Pdu::NopOut(n),
                    } if n.immediate && n.ttt == RESERVED_TAG => Some(*conn),
                    _ => None,
                })
                .collect()
        };
        let mut out = Vec::new();
        assert_eq!(c.watch_stalls(at(0), limit, &mut out), None);
        assert!(out.is_empty());
        // Connection 1 keeps hearing; connection 0 is pinged once at 2 s.
        c.conn_heard(1, at(1900));
        let mut out = Vec::new();
        assert_eq!(c.watch_stalls(at(2000), limit, &mut out), None);
        assert_eq!(urgent(&out), vec![0]);
        c.conn_heard(1, at(3900));
        let mut out = Vec::new();
        assert_eq!(c.watch_stalls(at(3000), limit, &mut out), None);
        assert!(urgent(&out).is_empty(), "one ping per silence");
        let mut out = Vec::new();
        assert_eq!(
            c.watch_stalls(at(4000), limit, &mut out),
            Some((0, std::time::Duration::from_secs(4)))
        );
        // When connection 1 is silent as long, neither is named (the target, not a path).
        let mut out = Vec::new();
        assert_eq!(c.watch_stalls(at(7900), limit, &mut out), None);
        // Connection 0 is heard again: now connection 1, silent since 3.9 s, is the one named.
        c.conn_heard(0, at(8000));
        let mut out = Vec::new();
        assert_eq!(
            c.watch_stalls(at(8100), limit, &mut out),
            Some((1, std::time::Duration::from_millis(4200)))
        );
    }

    /// The response watchdog on virtual time: no runtime, no clock read.
    #[test]
    fn the_watchdog_names_the_task_that_waited_too_long() {
        let (mut c, _) = core(1, 1, 10);
        let mut out = Vec::new();
        c.submit(tur(), 0, &mut out);
        c.submit(tur(), 1, &mut out);
        let itts: Vec<u32> = cmd_sns(&out).iter().map(|x| x.2).collect();
        let t0 = std::time::Instant::now();
        let limit = std::time::Duration::from_secs(30);
        let at = |s: u64| t0 + std::time::Duration::from_secs(s);
        assert_eq!(c.oldest_without_status(at(0), limit), None, "stamps both");
        // The first completes at 20 s; a third task is first seen at 25 s.
        let mut out = Vec::new();
        c.handle_pdu(0, good(itts[0], 1000, 3, 12), &mut out)
            .unwrap();
        c.submit(tur(), 2, &mut out);
        assert_eq!(c.oldest_without_status(at(25), limit), None);
        assert_eq!(c.oldest_without_status(at(29), limit), None);
        // At 30 s the second has waited 30 s; the third only 5.
        assert_eq!(c.oldest_without_status(at(30), limit), Some(itts[1]));
        let mut out = Vec::new();
        c.handle_pdu(0, good(itts[1], 1001, 3, 12), &mut out)
            .unwrap();
        assert_eq!(c.oldest_without_status(at(54), limit), None);
        assert!(
            c.oldest_without_status(at(55), limit).is_some(),
            "the third at 25 + 30 s"
        );
    }

    #[test]
    fn commands_wait_for_the_window_and_spread_round_robin() {
        // Window of 3 at the wrap: CmdSN 0xffffffff, 0, 1.
        let (mut c, _) = core(2, 0xffff_ffff, 1);
        let mut out = Vec::new();
        for h in 0..5 {
            c.submit(tur(), h, &mut out);
        }
        let issued = cmd_sns(&out);
        assert_eq!(
            issued.iter().map(|x| (x.0, x.1)).collect::<Vec<_>>(),
            vec![(0, 0xffff_ffff), (1, 0), (0, 1)]
        );
        assert_eq!(c.outstanding(), 5);
        // Completing the first frees no slot until MaxCmdSN moves.
        let mut out = Vec::new();
        c.handle_pdu(0, good(issued[0].2, 1000, 0, 1), &mut out)
            .unwrap();
        assert!(cmd_sns(&out).is_empty());
        assert!(matches!(
            out[0],
            Action::Complete {
                handle: 0,
                result: Ok(_)
            }
        ));
        // MaxCmdSN 3 opens two slots: CmdSN 2 and 3 go out, on connections 1 and 0.
        let mut out = Vec::new();
        c.handle_pdu(1, good(issued[1].2, 1000, 1, 3), &mut out)
            .unwrap();
        let more = cmd_sns(&out);
        assert_eq!(
            more.iter().map(|x| (x.0, x.1)).collect::<Vec<_>>(),
            vec![(1, 2), (0, 3)]
        );
        // Two completed, five submitted: three issued and outstanding.
        assert_eq!(c.outstanding(), 3);
    }

    #[test]
    fn reads_are_reassembled_and_status_in_data_in_completes() {
        let (mut c, _) = core(1, 10, 40);
        let mut out = Vec::new();
        c.submit(read(1, 12), 7, &mut out);
        let (_, _, itt) = cmd_sns(&out)[0];
        let Pdu::ScsiCommand(cmd) = sends(&out)[0].1 else {
            panic!()
        };
        // LUN 1 in peripheral addressing: byte 1 of the 8-byte LUN.
        assert_eq!(cmd.lun, 0x0001_0000_0000_0000);
        assert!(cmd.read && cmd.final_ && cmd.expected_data_transfer_length == 12);
        assert_eq!(cmd.exp_stat_sn, 1001);
        let mk = |sn: u32, off: u32, data: &'static [u8], status: Option<u8>| {
            Pdu::DataIn(DataIn {
                final_: status.is_some(),
                ack: false,
                overflow: false,
                underflow: false,
                status,
                lun: 0,
                itt,
                ttt: RESERVED_TAG,
                stat_sn: 1001,
                exp_cmd_sn: 11,
                max_cmd_sn: 40,
                data_sn: sn,
                buffer_offset: off,
                residual_count: 0,
                data: Bytes::from_static(data),
            })
        };
        let mut out = Vec::new();
        c.handle_pdu(0, mk(0, 0, b"hello ", None), &mut out)
            .unwrap();
        assert!(out.is_empty());
        c.handle_pdu(0, mk(1, 6, b"world!", Some(0)), &mut out)
            .unwrap();
        let Action::Complete {
            handle: 7,
            result: Ok(r),
        } = &out[0]
        else {
            panic!("{out:?}")
        };
        assert_eq!(&r.data[..], b"hello world!");
        // The status-bearing Data-In advanced ExpStatSN past its StatSN.
        assert_eq!(c.exp_stat_sn(0), 1002);
        assert_eq!(c.window().exp_cmd_sn(), 11);
    }

    /// At ErrorRecoveryLevel 1 a Data-In or a status lost to a data digest error is asked for
    /// again with a SNACK on its connection; the read completes whole once it comes, and
    /// ExpStatSN does not pass a status still missing.
    #[test]
    fn at_level_1_damaged_pdus_are_asked_for_again_and_the_read_completes() {
        let mut c = Core::new(Box::new(RoundRobin::default()));
        let mut p = params();
        p.session.error_recovery_level = 1;
        let mut out = Vec::new();
        c.start(
            p,
            CmdWindow::new(10, 40),
            &[ConnStart::new(0, ConnRole::Both, 1000)],
            &mut out,
        );
        let mut out = Vec::new();
        c.submit(read(0, 12), 7, &mut out);
        c.submit(tur(), 8, &mut out);
        let itts: Vec<u32> = cmd_sns(&out).iter().map(|x| x.2).collect();
        let (itt, tur_itt) = (itts[0], itts[1]);
        let mk = |sn: u32, off: u32, data: &'static [u8], status: Option<u8>| {
            Pdu::DataIn(DataIn {
                final_: status.is_some(),
                ack: false,
                overflow: false,
                underflow: false,
                status,
                lun: 0,
                itt,
                ttt: RESERVED_TAG,
                stat_sn: 1001,
                exp_cmd_sn: 11,
                max_cmd_sn: 40,
                data_sn: sn,
                buffer_offset: off,
                residual_count: 0,
                data: Bytes::from_static(data),
            })
        };
        let snacks = |out: &[Action<u32>]| -> Vec<(u8, u32, u32, u32, u32)> {
            sends(out)
                .into_iter()
                .filter_map(|(_, p)| match p {
                    Pdu::SnackRequest(s) => {
                        Some((s.snack_type, s.itt, s.beg_run, s.run_length, s.exp_stat_sn))
                    }
                    _ => None,
                })
                .collect()
        };
        let mut out = Vec::new();
        c.handle_pdu(0, mk(0, 0, b"hell", None), &mut out).unwrap();
        // DataSN 1 damaged: a Data SNACK for it.
        c.handle_damaged(0, mk(1, 4, b"XXXX", None), &mut out)
            .unwrap();
        assert_eq!(snacks(&out), [(0, itt, 1, 1, 1001)]);
        // The last, with status, comes whole: the read waits for DataSN 1.
        let mut out = Vec::new();
        c.handle_pdu(0, mk(2, 8, b"rld!", Some(0)), &mut out)
            .unwrap();
        assert!(!out.iter().any(|a| matches!(a, Action::Complete { .. })));
        // The TEST UNIT READY's status comes damaged (its sense data): a Status SNACK, and
        // ExpStatSN stays at it while a later status arrives.
        let mut damaged = good(tur_itt, 1002, 11, 40);
        if let Pdu::ScsiResponse(r) = &mut damaged {
            r.sense = Bytes::from_static(b"garbled");
        }
        c.handle_damaged(0, damaged, &mut out).unwrap();
        // The read's status (1001) is not acknowledged while its data is missing either, or
        // the target would let that data go.
        assert_eq!(snacks(&out), [(1, RESERVED_TAG, 1002, 1, 1001)]);
        c.submit(tur(), 9, &mut out);
        let third = cmd_sns(&out).last().map(|x| x.2).unwrap();
        c.handle_pdu(0, good(third, 1003, 12, 40), &mut out)
            .unwrap();
        assert_eq!(c.exp_stat_sn(0), 1001);
        // DataSN 1 again: the read completes whole.
        let mut out = Vec::new();
        c.handle_pdu(0, mk(1, 4, b"o wo", None), &mut out).unwrap();
        let Some(Action::Complete {
            handle: 7,
            result: Ok(r),
        }) = out.first()
        else {
            panic!("{out:?}")
        };
        assert_eq!(&r.data[..], b"hello world!");
        assert_eq!(c.exp_stat_sn(0), 1002);
        // The status again: ExpStatSN moves past everything received.
        c.handle_pdu(0, good(tur_itt, 1002, 12, 40), &mut out)
            .unwrap();
        assert_eq!(c.exp_stat_sn(0), 1004);
        let s = &c.conn_stats()[0];
        assert_eq!((s.snacks, s.recovered), (2, 2));
        // At level 0 a damaged PDU ends the connection.
        let (mut c0, _) = core(1, 10, 40);
        assert!(c0
            .handle_damaged(0, mk(1, 4, b"XXXX", None), &mut out)
            .is_err());
    }

    #[test]
    fn writes_use_immediate_data_then_answer_r2t_on_the_same_connection() {
        let (mut c, _) = core(3, 1, 100);
        let mut out = Vec::new();
        // Move the round-robin pointer so the write lands on connection 1.
        c.submit(read(0, 512), 0, &mut out);
        out.clear();
        let data = Bytes::from(vec![0xab; 20000]);
        c.submit(
            Command {
                lun: 0,
                cdb: Bytes::from_static(&[0x2a; 10]),
                dir: DataDir::Write(data),
            },
            1,
            &mut out,
        );
        let s = sends(&out);
        assert_eq!(
            s.len(),
            1,
            "InitialR2T=Yes: only the command with immediate data"
        );
        let (wconn, Pdu::ScsiCommand(cmd)) = s[0] else {
            panic!()
        };
        assert_eq!(wconn, 1);
        assert_eq!(cmd.data.len(), 8192);
        assert!(cmd.final_);
        let itt = cmd.itt;
        let mut out = Vec::new();
        // The R2T arrives (on any connection); Data-Out goes to connection 1.
        c.handle_pdu(
            2,
            Pdu::R2t(R2t {
                lun: 0,
                itt,
                ttt: 0x77,
                stat_sn: 1001,
                exp_cmd_sn: 2,
                max_cmd_sn: 100,
                r2t_sn: 0,
                buffer_offset: 8192,
                desired_data_transfer_length: 11808,
            }),
            &mut out,
        )
        .unwrap();
        let s = sends(&out);
        assert_eq!(s.len(), 2);
        assert!(s.iter().all(|(c, _)| *c == 1));
        let Pdu::DataOut(d1) = s[1].1 else { panic!() };
        assert_eq!(
            (d1.buffer_offset, d1.data.len(), d1.final_, d1.data_sn),
            (16384, 3616, true, 1)
        );
        // R2T does not consume a StatSN: connection 2's ExpStatSN is 1001, not 1002.
        assert_eq!(c.exp_stat_sn(2), 1001);
    }

    #[test]
    fn nop_in_ping_is_answered_and_does_not_take_a_cmd_sn() {
        let (mut c, _) = core(2, 5, 10);
        let mut out = Vec::new();
        c.handle_pdu(
            1,
            Pdu::NopIn(NopIn {
                lun: 0,
                itt: RESERVED_TAG,
                ttt: 0x1234,
                stat_sn: 1001,
                exp_cmd_sn: 5,
                max_cmd_sn: 10,
                data: Bytes::from_static(b"ping"),
            }),
            &mut out,
        )
        .unwrap();
        let s = sends(&out);
        let (1, Pdu::NopOut(n)) = s[0] else {
            panic!("{s:?}")
        };
        assert!(n.immediate);
        assert_eq!((n.itt, n.ttt, n.cmd_sn), (RESERVED_TAG, 0x1234, 5));
        assert_eq!(&n.data[..], b"ping");
        assert_eq!(c.window().next_cmd_sn(), 5);
    }

    #[test]
    fn session_down_requeues_in_cmd_sn_order_and_restart_reissues() {
        let (mut c, _) = core(2, 0xffff_fffe, 0xffff_fffeu32.wrapping_add(9));
        let mut out = Vec::new();
        for h in 0..4 {
            c.submit(tur(), h, &mut out);
        }
        let first = cmd_sns(&out);
        assert_eq!(first.len(), 4);
        // Complete handle 1, then lose the session.
        let mut out = Vec::new();
        c.handle_pdu(1, good(first[1].2, 1000, 0xffff_ffff, 20), &mut out)
            .unwrap();
        c.session_down();
        assert_eq!(c.usable_conns(), 0);
        let mut out = Vec::new();
        c.submit(tur(), 9, &mut out);
        assert!(
            cmd_sns(&out).is_empty(),
            "nothing goes out while the session is down"
        );
        // New session: tasks 0, 2, 3 (in their old CmdSN order, across the wrap) then 9.
        let mut out = Vec::new();
        c.start(
            params(),
            CmdWindow::new(1, 50),
            &[
                ConnStart::new(0, ConnRole::Both, 5),
                ConnStart::new(1, ConnRole::Both, 7),
            ],
            &mut out,
        );
        let again = cmd_sns(&out);
        assert_eq!(
            again.iter().map(|x| x.1).collect::<Vec<_>>(),
            vec![1, 2, 3, 4]
        );
        let mut done = Vec::new();
        for (conn, _, itt) in &again {
            let mut o = Vec::new();
            c.handle_pdu(*conn, good(*itt, 10, 1, 50), &mut o).unwrap();
            for a in o {
                if let Action::Complete { handle, result } = a {
                    assert!(result.is_ok());
                    done.push(handle);
                }
            }
        }
        assert_eq!(done, vec![0, 2, 3, 9]);
    }

    #[test]
    fn least_outstanding_and_draining() {
        let mut c = Core::new(Box::new(LeastOutstanding::default()));
        let mut out = Vec::new();
        c.start(
            params(),
            CmdWindow::new(1, 100),
            &[
                ConnStart::new(0, ConnRole::Both, 0),
                ConnStart::new(1, ConnRole::Both, 0),
            ],
            &mut out,
        );
        c.submit(read(0, 1 << 20), 0, &mut out);
        c.submit(read(0, 4096), 1, &mut out);
        c.submit(read(0, 4096), 2, &mut out);
        let conns: Vec<usize> = cmd_sns(&out).iter().map(|x| x.0).collect();
        // The 1 MiB read occupies connection 0; both small reads go to connection 1.
        assert_eq!(conns, vec![0, 1, 1]);
        c.set_draining(1);
        let mut out = Vec::new();
        c.submit(read(0, 4096), 3, &mut out);
        assert_eq!(cmd_sns(&out)[0].0, 0);
        assert!(!c.conn_idle(1));
    }

    #[test]
    fn a_failed_over_connection_gives_its_tasks_back_in_cmdsn_order() {
        // Round-robin over two connections: tasks 0, 2, 4 on connection 0, 1, 3, 5 on 1.
        let (mut c, _) = core(2, 1, 100);
        let mut out = Vec::new();
        for h in 0..6 {
            c.submit(tur(), h, &mut out);
        }
        let sent = cmd_sns(&out);
        let on1: Vec<(u32, u32)> = sent
            .iter()
            .filter(|x| x.0 == 1)
            .map(|x| (x.2, x.1))
            .collect();
        assert_eq!(on1.len(), 3);
        // The first of them completes on its own connection before the stall is noticed.
        let mut out = Vec::new();
        c.handle_pdu(1, good(on1[0].0, 1000, 1, 100), &mut out)
            .unwrap();
        let orphans = c.fail_over(1);
        assert!(!c.conn_alive(1) && c.conn_alive(0));
        assert_eq!(c.usable_conns(), 1);
        let got: Vec<(u32, u32)> = orphans.iter().map(|o| (o.itt, o.cmd_sn)).collect();
        assert_eq!(
            got,
            on1[1..].to_vec(),
            "the tasks still outstanding, oldest first"
        );
        // A new command meanwhile goes to connection 0 only.
        let mut out = Vec::new();
        c.submit(tur(), 6, &mut out);
        assert_eq!(
            cmd_sns(&out).iter().map(|x| x.0).collect::<Vec<_>>(),
            vec![0]
        );
        // Issued again: new ITTs and CmdSNs, on connection 0, ahead of anything queued.
        let mut out = Vec::new();
        let itts: Vec<u32> = orphans.iter().map(|o| o.itt).collect();
        c.reissue(&itts, &mut out);
        let again = cmd_sns(&out);
        assert_eq!(again.len(), 2);
        for (i, (conn, cmd_sn, itt)) in again.iter().enumerate() {
            assert_eq!(*conn, 0);
            assert_eq!(*cmd_sn, 8 + i as u32, "CmdSNs after the 7 already used");
            assert!(!itts.contains(itt), "a fresh ITT");
        }
        assert!(c.conn_idle(1), "its counters were given back");
        // The route returns: a new connection takes the slot and gets tasks again.
        let mut out = Vec::new();
        c.conn_up(1, ConnStart::new(1, ConnRole::Both, 2000), &mut out);
        assert!(c.conn_alive(1));
        assert_eq!(c.exp_stat_sn(1), 2001);
        let mut out = Vec::new();
        c.submit(tur(), 7, &mut out);
        c.submit(tur(), 8, &mut out);
        let conns: Vec<usize> = cmd_sns(&out).iter().map(|x| x.0).collect();
        assert!(conns.contains(&1), "{conns:?}");
    }

    #[test]
    fn reissue_skips_a_task_that_completed_meanwhile() {
        let (mut c, _) = core(2, 1, 100);
        let mut out = Vec::new();
        c.submit(tur(), 0, &mut out);
        c.submit(tur(), 1, &mut out);
        let on1 = cmd_sns(&out).into_iter().find(|x| x.0 == 1).unwrap();
        let orphans = c.fail_over(1);
        assert_eq!(orphans.len(), 1);
        // Its status still arrived (on a connection that carries it): it completes once.
        let mut out = Vec::new();
        c.handle_pdu(0, good(on1.2, 1000, 3, 100), &mut out)
            .unwrap();
        assert!(out
            .iter()
            .any(|a| matches!(a, Action::Complete { handle: 1, .. })));
        let mut out = Vec::new();
        c.reissue(&[on1.2], &mut out);
        assert!(cmd_sns(&out).is_empty());
    }

    #[test]
    fn asymmetric_roles_keep_requests_off_response_connections() {
        let mut c = Core::new(Box::new(RoundRobin::default()));
        let mut out = Vec::new();
        let conns = [
            ConnStart::new(0, ConnRole::Requests, 0),
            ConnStart::new(1, ConnRole::Requests, 0),
            ConnStart::new(2, ConnRole::Responses, 0),
            ConnStart::new(3, ConnRole::Responses, 0),
        ];
        c.start(params(), CmdWindow::new(1, 100), &conns, &mut out);
        for h in 0..6 {
            c.submit(tur(), h, &mut out);
        }
        let used: Vec<usize> = cmd_sns(&out).iter().map(|x| x.0).collect();
        assert_eq!(used, vec![0, 1, 0, 1, 0, 1]);
        // A response arriving on connection 3 completes a task sent on connection 0.
        let itt = cmd_sns(&out)[0].2;
        let mut o = Vec::new();
        c.handle_pdu(3, good(itt, 0, 2, 100), &mut o).unwrap();
        assert!(matches!(
            o[0],
            Action::Complete {
                handle: 0,
                result: Ok(_)
            }
        ));
    }

    #[test]
    fn check_condition_and_reject_become_typed_errors() {
        let (mut c, _) = core(1, 1, 10);
        let mut out = Vec::new();
        c.submit(read(0, 512), 1, &mut out);
        c.submit(tur(), 2, &mut out);
        let ids = cmd_sns(&out);
        let mut resp = good(ids[0].2, 1000, 2, 10);
        if let Pdu::ScsiResponse(r) = &mut resp {
            r.status = 0x02;
            r.sense = Bytes::from_static(&[
                0x70, 0, 0x05, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x24, 0, 0, 0, 0, 0,
            ]);
        }
        let mut out = Vec::new();
        c.handle_pdu(0, resp, &mut out).unwrap();
        let Action::Complete { result: Ok(r), .. } = out.remove(0) else {
            panic!()
        };
        let e = r.check().unwrap_err();
        assert!(
            e.to_string().contains("ILLEGAL REQUEST asc/ascq 24/00"),
            "{e}"
        );
        // Reject naming the second task's ITT in the rejected header.
        let mut header = vec![0u8; 48];
        header[0] = 0x01;
        header[16..20].copy_from_slice(&ids[1].2.to_be_bytes());
        let mut out = Vec::new();
        c.handle_pdu(
            0,
            Pdu::Reject(mcsi_proto::pdu::Reject {
                reason: 0x09,
                stat_sn: 1001,
                exp_cmd_sn: 3,
                max_cmd_sn: 10,
                data_sn_r2t_sn: 0,
                header: Bytes::from(header),
            }),
            &mut out,
        )
        .unwrap();
        let Action::Complete {
            handle: 2,
            result: Err(e),
        } = &out[0]
        else {
            panic!("{out:?}")
        };
        assert_eq!(*e, Error::Rejected { reason: 0x09 });
        assert_eq!(c.outstanding(), 0);
    }

    #[test]
    fn async_messages_become_events() {
        let (mut c, _) = core(2, 1, 10);
        let msg = |event: u8, p2: u16, p3: u16| {
            Pdu::AsyncMessage(mcsi_proto::pdu::AsyncMessage {
                lun: 0,
                stat_sn: 1000,
                exp_cmd_sn: 1,
                max_cmd_sn: 10,
                async_event: event,
                async_vcode: 0,
                parameter1: 0,
                parameter2: p2,
                parameter3: p3,
                data: Bytes::new(),
            })
        };
        let mut out = Vec::new();
        // Event 1 on connection 1 (CID 1): log out within 5 s (Parameter3, 11.9.1).
        c.handle_pdu(1, msg(1, 0, 5), &mut out).unwrap();
        c.handle_pdu(0, msg(3, 2, 20), &mut out).unwrap();
        c.handle_pdu(0, msg(4, 0, 0), &mut out).unwrap();
        let events: Vec<(usize, Event)> = out
            .into_iter()
            .filter_map(|a| match a {
                Action::Event { conn, event } => Some((conn, event)),
                _ => None,
            })
            .collect();
        assert_eq!(
            events,
            vec![
                (
                    1,
                    Event::LogoutRequested {
                        cid: 1,
                        within_secs: 5
                    }
                ),
                // Connection 1 has no task: its logout is due at once.
                (
                    1,
                    Event::LogoutDue {
                        close_session: false
                    }
                ),
                (
                    0,
                    Event::Dropped {
                        session: true,
                        time2wait: 2,
                        time2retain: 20
                    }
                ),
            ]
        );
        // Async messages carry a StatSN and advance ExpStatSN.
        assert_eq!(c.exp_stat_sn(1), 1001);
    }

    fn events(out: &[Action<u32>]) -> Vec<(usize, Event)> {
        out.iter()
            .filter_map(|a| match a {
                Action::Event { conn, event } => Some((*conn, event.clone())),
                _ => None,
            })
            .collect()
    }

    fn logout_request(within_secs: u16) -> Pdu {
        Pdu::AsyncMessage(mcsi_proto::pdu::AsyncMessage {
            lun: 0,
            stat_sn: 1000,
            exp_cmd_sn: 1,
            max_cmd_sn: 100,
            async_event: 1,
            async_vcode: 0,
            parameter1: 0,
            parameter2: 0,
            parameter3: within_secs,
            data: Bytes::new(),
        })
    }

    /// Drive the core's timers on virtual time from `from` to `until`, as a driver does: sleep
    /// to `poll_timeout`, then `handle_timeout`. Returns each event with the time it came out.
    fn run_timers(c: &mut Core, from: Instant, until: Instant) -> Vec<(Duration, usize, Event)> {
        let mut seen = Vec::new();
        let mut now = from;
        let mut wakes = 0;
        while now <= until {
            let mut out = Vec::new();
            c.handle_timeout(now, &mut out);
            for (conn, e) in events(&out) {
                seen.push((now - from, conn, e));
            }
            let Some(next) = c.poll_timeout() else { break };
            assert!(
                next > now,
                "poll_timeout must move on: {next:?} after {now:?}"
            );
            now = next;
            wakes += 1;
            assert!(wakes < 100_000, "the timers never settle");
        }
        seen
    }

    /// The response watchdog as a timer of the core: poll_timeout says when to look, and a task
    /// without status comes out as an event between the limit and the limit plus one period.
    #[test]
    fn the_response_timer_gives_a_task_without_status_as_an_event() {
        let (mut c, _) = core(1, 1, 10);
        assert_eq!(c.poll_timeout(), None, "no timer is set");
        c.set_timers(Timers {
            response: Duration::from_secs(30),
            stall: Duration::ZERO,
        });
        let t0 = Instant::now();
        let mut out = Vec::new();
        c.handle_timeout(t0, &mut out);
        assert!(out.is_empty());
        assert_eq!(c.poll_timeout(), Some(t0 + Duration::from_secs(1)));
        c.submit(tur(), 0, &mut out);
        let itt = cmd_sns(&out)[0].2;
        let fired = run_timers(&mut c, t0, t0 + Duration::from_secs(40));
        let (at, conn, event) = fired.first().expect("the watchdog fires").clone();
        assert_eq!(conn, 0);
        assert_eq!(
            event,
            Event::NoStatus {
                itt,
                waited: Duration::from_secs(30)
            }
        );
        assert!(
            at >= Duration::from_secs(30) && at <= Duration::from_secs(32),
            "fired at {at:?}"
        );
    }

    /// A logout the target asks for (async event 1): the connection takes no new task, and the
    /// logout is due when its last task ends, or when the time given runs out, once.
    #[test]
    fn a_logout_the_target_asks_for_is_due_when_its_tasks_end_or_its_time_runs_out() {
        let t0 = Instant::now();
        let (mut c, _) = core(2, 1, 100);
        let mut out = Vec::new();
        c.submit(tur(), 0, &mut out);
        c.submit(tur(), 1, &mut out);
        let issued = cmd_sns(&out);
        let on0 = issued
            .iter()
            .find(|x| x.0 == 0)
            .expect("a task on connection 0")
            .2;
        c.conn_heard(0, t0);
        let mut out = Vec::new();
        c.handle_pdu(0, logout_request(5), &mut out).unwrap();
        assert_eq!(
            events(&out),
            vec![(
                0,
                Event::LogoutRequested {
                    cid: 0,
                    within_secs: 5
                }
            )],
            "a task is still running on it"
        );
        assert_eq!(c.poll_timeout(), Some(t0 + Duration::from_secs(5)));
        // New tasks go to the other connection.
        let mut out = Vec::new();
        c.submit(tur(), 2, &mut out);
        c.submit(tur(), 3, &mut out);
        assert!(cmd_sns(&out).iter().all(|x| x.0 == 1), "{out:?}");
        // Its task ends: the logout is due, and once.
        let mut out = Vec::new();
        c.handle_pdu(0, good(on0, 1001, 1, 100), &mut out).unwrap();
        assert_eq!(
            events(&out),
            vec![(
                0,
                Event::LogoutDue {
                    close_session: false
                }
            )]
        );
        assert_eq!(c.poll_timeout(), None);
        assert!(run_timers(&mut c, t0, t0 + Duration::from_secs(10)).is_empty());

        // Another session: the task never ends, and the time runs out at 5 s.
        let (mut c, _) = core(1, 1, 100);
        let mut out = Vec::new();
        c.submit(tur(), 0, &mut out);
        c.conn_heard(0, t0);
        c.handle_pdu(0, logout_request(5), &mut out).unwrap();
        let fired = run_timers(&mut c, t0, t0 + Duration::from_secs(10));
        assert_eq!(
            fired,
            vec![(
                Duration::from_secs(5),
                0,
                Event::LogoutDue {
                    close_session: true
                }
            )],
            "the last connection's logout closes the session"
        );
    }

    /// The stall watch as a timer of the core: a ping at half the limit, the connection named
    /// at the limit, while the other connection is heard.
    #[test]
    fn the_stall_timer_pings_then_names_a_silent_connection() {
        let t0 = Instant::now();
        let (mut c, _) = core(2, 1, 100);
        c.set_timers(Timers {
            response: Duration::ZERO,
            stall: Duration::from_secs(4),
        });
        let mut out = Vec::new();
        c.submit(tur(), 0, &mut out);
        c.submit(tur(), 1, &mut out);
        // Connection 1 answers its task at once; connection 0 stays silent.
        let on1 = cmd_sns(&out).iter().find(|x| x.0 == 1).unwrap().2;
        let mut out = Vec::new();
        c.handle_timeout(t0, &mut out);
        c.conn_heard(1, t0 + Duration::from_millis(100));
        c.handle_pdu(1, good(on1, 1001, 1, 100), &mut out).unwrap();
        let fired = run_timers(&mut c, t0, t0 + Duration::from_secs(6));
        let (at, conn, event) = fired.first().expect("the stall watch fires").clone();
        assert_eq!(conn, 0);
        assert!(matches!(event, Event::Stalled { silent } if silent >= Duration::from_secs(4)));
        assert!(
            at >= Duration::from_secs(4) && at <= Duration::from_millis(4250),
            "{at:?}"
        );
    }

    /// A policy outside this crate's two: picks the largest congestion window. Shows the trait
    /// is enough for the planned congestion-aware scheduler.
    #[derive(Debug)]
    struct MaxCwnd;
    impl Scheduler for MaxCwnd {
        fn name(&self) -> &'static str {
            "max-cwnd"
        }
        fn pick(&mut self, conns: &[ConnLoad], _t: &TaskInfo) -> Option<usize> {
            (0..conns.len())
                .filter(|&i| conns[i].usable)
                .max_by_key(|&i| conns[i].tcp.map_or(0, |t| t.cwnd))
        }
        fn wants_tcp_info(&self) -> bool {
            true
        }
    }

    #[test]
    fn custom_scheduler_sees_tcp_state() {
        let mut c = Core::new(Box::new(MaxCwnd));
        assert!(c.scheduler_wants_tcp_info());
        let mut out = Vec::new();
        c.start(
            params(),
            CmdWindow::new(1, 100),
            &[
                ConnStart::new(0, ConnRole::Both, 0),
                ConnStart::new(1, ConnRole::Both, 0),
                ConnStart::new(2, ConnRole::Both, 0),
            ],
            &mut out,
        );
        c.set_tcp(
            2,
            TcpState {
                cwnd: 40,
                ..TcpState::default()
            },
        );
        c.set_tcp(
            0,
            TcpState {
                cwnd: 10,
                ..TcpState::default()
            },
        );
        c.submit(tur(), 0, &mut out);
        assert_eq!(cmd_sns(&out)[0].0, 2);
    }

    #[test]
    fn good_read_without_data_is_a_protocol_error() {
        // GOOD status, no residual, but no Data-In: the target lost data (11.4.5).
        let (mut c, _) = core(1, 1, 10);
        let mut out = Vec::new();
        c.submit(read(0, 4096), 5, &mut out);
        let itt = cmd_sns(&out)[0].2;
        let mut out = Vec::new();
        c.handle_pdu(0, good(itt, 1000, 2, 10), &mut out).unwrap();
        let Action::Complete {
            result: Err(Error::Protocol(m)),
            ..
        } = &out[0]
        else {
            panic!("{out:?}")
        };
        assert!(m.contains("0 bytes"), "{m}");
    }

    #[test]
    fn lun_encoding() {
        assert_eq!(encode_lun(0), 0);
        assert_eq!(encode_lun(5), 0x0005_0000_0000_0000);
        // Flat space (SAM-5 4.6.7): 01b in the top bits, 14-bit LUN.
        assert_eq!(encode_lun(300), 0x412c_0000_0000_0000);
        // Extended flat space (4.6.10) above 16383.
        assert_eq!(encode_lun(0x4000), 0xD200_4000_0000_0000);
    }

    /// MaxRecvDataSegmentLength is a connection-only key: a connection whose login declared a
    /// larger (or smaller) one than the leading connection's gets PDUs sized by its own, for
    /// immediate data, unsolicited Data-Out and Data-Out answering an R2T.
    #[test]
    fn each_connection_sizes_data_by_its_own_max_recv_dsl() {
        let mut c = Core::new(Box::new(RoundRobin::default()));
        let mut out = Vec::new();
        let conns = [
            // The leading connection: the session's 8 KiB.
            ConnStart::new(0, ConnRole::Both, 0),
            ConnStart {
                max_send_dsl: Some(65536),
                ..ConnStart::new(1, ConnRole::Both, 0)
            },
        ];
        let mut p = params();
        p.initial_r2t = false;
        c.start(p, CmdWindow::new(1, 100), &conns, &mut out);
        let write = |n: usize| Command {
            lun: 0,
            cdb: Bytes::from_static(&[0x2a, 0, 0, 0, 0, 0, 0, 0, 128, 0]),
            dir: DataDir::Write(Bytes::from(vec![7u8; n])),
        };
        c.submit(write(65536), 0, &mut out);
        c.submit(write(65536), 1, &mut out);
        let sent = sends(&out);
        let on = |conn: usize| -> Vec<(&'static str, usize)> {
            sent.iter()
                .filter(|(c, _)| *c == conn)
                .map(|(_, p)| match p {
                    Pdu::ScsiCommand(cmd) => ("cmd", cmd.data.len()),
                    Pdu::DataOut(d) => ("data-out", d.data.len()),
                    _ => ("other", 0),
                })
                .collect()
        };
        // Connection 0: 8 KiB immediate, then 7 unsolicited Data-Out of 8 KiB.
        let mut want0 = vec![("cmd", 8192)];
        want0.extend(std::iter::repeat_n(("data-out", 8192), 7));
        assert_eq!(on(0), want0);
        // Connection 1: the whole first burst as immediate data in one PDU.
        assert_eq!(on(1), vec![("cmd", 65536)]);
        // A write beyond the first burst on connection 1: the R2T is answered in 64 KiB PDUs.
        let mut out = Vec::new();
        c.submit(write(65536), 2, &mut out); // connection 0
        c.submit(write(256 << 10), 3, &mut out); // connection 1
        let itt = sends(&out)
            .iter()
            .find_map(|(conn, p)| match p {
                Pdu::ScsiCommand(cmd) if *conn == 1 => Some(cmd.itt),
                _ => None,
            })
            .expect("the write on connection 1");
        let mut out = Vec::new();
        c.handle_pdu(
            1,
            Pdu::R2t(R2t {
                lun: 0,
                itt,
                ttt: 9,
                stat_sn: 0,
                exp_cmd_sn: 1,
                max_cmd_sn: 100,
                r2t_sn: 0,
                buffer_offset: 65536,
                desired_data_transfer_length: 196608,
            }),
            &mut out,
        )
        .unwrap();
        let lens: Vec<usize> = sends(&out)
            .iter()
            .map(|(conn, p)| match p {
                Pdu::DataOut(d) if *conn == 1 => d.data.len(),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(lens, vec![65536, 65536, 65536]);
    }
}
