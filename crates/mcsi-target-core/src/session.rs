//! The session core: what a session decides, with no tokio, no sockets, no clock reads and no
//! threads. It keeps CmdSN order across all of a session's connections (commands reach SCSI in
//! CmdSN order whichever connection carried them, RFC 7143 4.2.2.1), the task registry keyed by
//! ITT with each task's connection allegiance, one task set per LUN (SAM-5 8.6), the commands
//! held in the window until the gap before them is filled, a write's data (immediate data, the
//! unsolicited burst, Data-Out answering R2Ts, with MaxOutstandingR2T R2Ts in flight), and the
//! choice of a task's response connection in the asymmetric mode. A task is handed out to run
//! once its turn has come and all of its data is in; until then nothing runs for it, so an
//! abort ends it in the core at once.
//!
//! Inputs are method calls: a SCSI command arriving on a connection ([`SessionCore::command`]:
//! planned against the logical units, run on its reader, held, registered or answered, its
//! unsolicited data counted against the server's budget), Data-Out, a control request, a task
//! ending, task management, a connection added, lost or logged out, the time. Outputs are what
//! the calls return (requests now in CmdSN order, a command to run now) and what the core
//! queued: tasks whose turn has come ([`SessionCore::poll_ready`]), writes asking for budget
//! ([`SessionCore::poll_grant`]), PDUs ([`SessionCore::poll_transmit`]: R2Ts, Data-In, status,
//! Rejects), connections to close ([`SessionCore::poll_close`]) and the next deadline
//! ([`SessionCore::poll_timeout`]). The tokio layer (`mcsi-target`'s `session` module)
//! holds the core under one lock and carries the outputs out: it wakes task futures, runs
//! control requests, queues PDUs on connections.
//!
//! The core is generic over the connection handle `C` ([`CoreConn`]: an `Arc` of the tokio
//! layer's connection, or a plain value in tests) and over `T`, what the tokio layer attaches to
//! each task (its channels); the core hands `T` back and never looks inside.

use crate::taskset::TaskSet;
use crate::transfer::{TransferError, WriteTransfer};
use ahash::AHashMap;
use bytes::{Bytes, BytesMut};
use mcsi_proto::pdu::{DataOut, Pdu};
use mcsi_proto::vendor::ConnRole;
use mcsi_proto::window::{OrderWindow as CmdWindow, Submit};
use mcsi_scsi::TaskAttribute;
use std::time::{Duration, Instant};

mod arrive;
mod recover;
mod requests;
pub use crate::control::TaskRef;
pub use arrive::{Arrival, Fault, Lus, NoUnits, Note, RunNow};
pub use recover::Reassigned;
pub use requests::{Busy, TmfStep};
/// Task Management response codes of TASK REASSIGN beyond [`mcsi_proto::codes::tmf_response`].
pub mod recover_codes {
    pub use super::recover::{FUNCTION_REJECTED, STILL_ALLEGIANT};
}

/// What the core needs to know of a connection.
pub trait CoreConn: Clone {
    fn cid(&self) -> u16;
    /// What the connection carries (asymmetric sessions; [`ConnRole::Both`] otherwise).
    fn role(&self) -> ConnRole;
    /// The same connection (not merely the same CID: a reinstated CID is another connection).
    fn same(&self, other: &Self) -> bool;
    /// The largest data segment the initiator takes on it (its MaxRecvDataSegmentLength): the
    /// size of the Data-In the core builds for it.
    fn max_data_in(&self) -> u32;
    /// Its output queue is at its budget: a response connection is picked for new replies only
    /// when every one is.
    fn full(&self) -> bool {
        false
    }
}

/// A connection as the layer above keeps it, shared by reference count: `Arc<T>` is a
/// [`CoreConn`] for any `T: ConnInfo`, two handles being the same connection when they point to
/// the same value.
pub trait ConnInfo {
    fn cid(&self) -> u16;
    fn role(&self) -> ConnRole;
    fn max_data_in(&self) -> u32;
    fn full(&self) -> bool {
        false
    }
}

impl<T: ConnInfo> CoreConn for std::sync::Arc<T> {
    fn cid(&self) -> u16 {
        T::cid(self)
    }

    fn role(&self) -> ConnRole {
        T::role(self)
    }

    fn same(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(self, other)
    }

    fn max_data_in(&self) -> u32 {
        T::max_data_in(self)
    }

    fn full(&self) -> bool {
        T::full(self)
    }
}

/// What a connection's end did to its session ([`SessionCore::conn_lost`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLost {
    /// It left on purpose, was replaced, or the session was already closing.
    pub clean: bool,
    /// Connections left in the session.
    pub remaining: usize,
    /// The session ends: the connection failed, or none is left.
    pub session_ends: bool,
}

impl ConnLost {
    fn new(clean: bool, remaining: usize) -> Self {
        ConnLost {
            clean,
            remaining,
            session_ends: !clean || remaining == 0,
        }
    }
}

/// A command that takes its turn in CmdSN order.
pub enum Ordered<C> {
    /// A SCSI task: its session-unique id and its ITT.
    Task(u64, u32),
    /// A non-SCSI request (NOP-Out, Text, Logout, Task Management) to run in order.
    Control(C, Pdu),
    /// A SIMPLE command with all its data, held without a task of its own
    /// ([`SessionCore::claim`]).
    Command(Box<Deferred<C>>),
    /// A CmdSN consumed without a command (a rejected command, an aborted gap).
    Nothing,
}

/// A SIMPLE command for a LU that does not block, with all its data at hand (none, or all of it
/// immediate): it needs no task of its own. It runs at once on the reader that received it
/// when it is next in CmdSN order; otherwise it waits in the window and runs on the reader of
/// whichever connection fills the gap before it (sessions of many connections).
pub struct Deferred<C> {
    /// The connection it came on (its status leaves there unless the asymmetric mode says
    /// otherwise).
    pub conn: C,
    pub cmd: mcsi_proto::pdu::ScsiCommand,
    pub phase: mcsi_scsi::DataPhase,
    /// The write's transfer state (all of its data came as immediate data).
    pub transfer: Option<crate::transfer::WriteTransfer>,
    /// Its immediate data's room in the server's unsolicited budget, held while it waits.
    pub room: Option<BudgetRoom>,
}

impl<C> Deferred<C> {
    /// The data-out it runs with: the immediate data its transfer takes.
    pub fn data_out(&self) -> Bytes {
        immediate_data_out(&self.cmd, self.transfer.as_ref())
    }
}

/// The data-out of a command that runs with its immediate data alone.
fn immediate_data_out(
    cmd: &mcsi_proto::pdu::ScsiCommand,
    transfer: Option<&crate::transfer::WriteTransfer>,
) -> Bytes {
    match transfer {
        Some(t) => cmd
            .data
            .slice(..t.accept_immediate(cmd.data.len() as u32).len as usize),
        None => Bytes::new(),
    }
}

/// A budget the server shares among its sessions (the room for data initiators send unasked):
/// the core takes from it when a command brings such data and gives back when the data is let
/// go, through a [`BudgetRoom`].
pub trait SharedBudget: Send + Sync {
    /// Takes room for `bytes` now, if there is.
    fn try_take(&self, bytes: u32) -> bool;
    /// Gives back what `try_take(bytes)` took.
    fn give_back(&self, bytes: u32);
}

/// Room taken from a [`SharedBudget`], given back when dropped.
pub struct BudgetRoom {
    budget: std::sync::Arc<dyn SharedBudget>,
    bytes: u32,
}

impl BudgetRoom {
    /// Room for `bytes` in `budget` now, if there is.
    pub fn take(budget: &std::sync::Arc<dyn SharedBudget>, bytes: u32) -> Option<BudgetRoom> {
        budget.try_take(bytes).then(|| BudgetRoom {
            budget: budget.clone(),
            bytes,
        })
    }
}

impl Drop for BudgetRoom {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes);
    }
}

/// What [`SessionCore::claim`] decided for a command that needs no task of its own.
pub enum ClaimOutcome<C> {
    /// Its turn has come: run it now on this reader.
    Now(Inline<C>),
    /// Commands before it have not arrived yet: hold it ([`SessionCore::hold`]).
    Wait,
    /// It needs a task of its own (ITT in use, an ORDERED task pending, closing).
    Task,
}

/// Something that came up in CmdSN order, for the caller to carry out outside the session lock.
pub enum OrderedRun<C> {
    /// A non-SCSI request.
    Control(C, Pdu),
    /// A held command to run now on this reader.
    Inline(Box<Deferred<C>>, Inline<C>),
    /// A held command whose turn came while an ORDERED task is pending: start it as a task
    /// (its CmdSN is consumed; it enters the task set like an immediate command).
    Task(Box<Deferred<C>>),
}

/// A command claimed for execution on its connection's reader.
pub struct Inline<C> {
    /// Entered in the task set; [`SessionCore::release_inline`] must follow its end.
    pub tracked: bool,
    /// Where its final PDUs go (a response connection in the asymmetric mode); `None`: the
    /// connection it came on.
    pub reply: Option<C>,
}

/// What came up in CmdSN order, with their connections.
pub type InOrder<C> = Vec<OrderedRun<C>>;

/// What [`SessionCore::hold`] did with a command.
pub enum HoldOutcome<C> {
    /// Held or run: what came up in CmdSN order meanwhile (possibly the command itself).
    InOrder(InOrder<C>),
    /// Outside the CmdSN window or a duplicate: dropped silently (RFC 7143 4.2.2.1); given
    /// back to be logged.
    Dropped(Box<Deferred<C>>),
    /// It needs a task of its own after all (the session changed since the claim).
    NeedsTask(Box<Deferred<C>>),
}

/// Why a new task could not be registered.
#[derive(Debug, PartialEq, Eq)]
pub enum RegisterOutcome {
    /// Registered.
    Ok,
    /// Outside the CmdSN window, or a duplicate of a held CmdSN: dropped silently (RFC 7143
    /// 4.2.2.1).
    OutOfWindow,
    /// The ITT is in use by another task (Reject 0x07... "task in progress").
    IttInUse,
    /// The session is closing.
    Closing,
    /// An immediate command while the session already has as many tasks as it takes: answer
    /// with status TASK SET FULL.
    TaskSetFull,
}

/// One task in the task table.
pub struct Task<T> {
    pub id: u64,
    /// The connection the command came on (connection allegiance: its Data-Out comes there).
    pub cid: u16,
    /// The connection its R2T, Data-In and status leave on: `cid`, or in an asymmetric session
    /// one of the response connections.
    pub reply_cid: u16,
    /// Data bytes the task moves (its expected data transfer length).
    pub bytes: u64,
    pub lun: u64,
    pub cmd_sn: u32,
    pub attr: TaskAttribute,
    /// Aborted: it sends nothing more (RFC 7143 4.2.3) and leaves at its end.
    pub aborted: bool,
    /// Its connection failed at ErrorRecoveryLevel 2: it waits to be reassigned to another
    /// (TASK REASSIGN), and its final PDUs wait with it ([`SessionCore::conn_failed`]).
    pub orphaned: bool,
    /// When it stops waiting to be reassigned: DefaultTime2Retain after the failure that
    /// orphaned it. Set once; a later failure of the same CID does not move it.
    retain_until: Option<Instant>,
    /// Its turn came: CmdSN order and its task set let it run.
    turn: bool,
    /// [`SessionCore::poll_ready`] handed it out.
    pub started: bool,
    /// A write's data still arriving.
    collect: Option<Box<Collect>>,
    /// Its data-out, all of it, until the task is handed out.
    data: Bytes,
    /// What its final PDUs are made from.
    answer: Option<Box<Answer>>,
    /// Refused for want of room for its unsolicited data ([`NewWrite::refused`]): answered TASK
    /// SET FULL by the core once that data has come, never handed out.
    refused: bool,
    /// Its unsolicited data's room in the server's unsolicited budget, until it ends or its
    /// grant puts the whole write under the write budgets.
    unsolicited: Option<BudgetRoom>,
    /// What the tokio layer attached to it.
    pub io: T,
}

/// A write's data being gathered: the transfer's state and the buffer it fills in offset order
/// (DataPDUInOrder and DataSequenceInOrder are Yes, so no zeroing first).
struct Collect {
    transfer: WriteTransfer,
    buf: BytesMut,
    /// Where its solicited data stands against the write budget ([`SessionCore::poll_grant`]).
    grant: Grant,
    /// Data bytes received so far (immediate and Data-Out, kept or not): the progress the
    /// Data-Out inactivity timeout watches ([`SessionCore::collecting`]).
    received: u64,
    /// Refused ([`NewWrite::refused`]): its unsolicited data is taken and dropped.
    refused: bool,
    /// What the Data-Out timer saw last: bytes received, and when it first saw that many
    /// ([`SessionCore::handle_timeout`]). None while the initiator owes nothing.
    watch: Option<(u64, Instant)>,
}

impl Collect {
    /// It must ask for the rest of its data with R2Ts now: not refused, its unsolicited burst
    /// over (no R2T may go before), and data still unasked for.
    fn must_solicit(&self) -> bool {
        !self.refused && !self.transfer.unsolicited_open() && self.transfer.solicits()
    }
}

/// A write's permission to ask for its data with R2Ts. A write only asks once its turn has come
/// (so that a write holding budget never waits on another task) and once the tokio layer has
/// taken the whole write's bytes from the write budgets; the unsolicited part needs no grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grant {
    /// Not asked for yet.
    None,
    /// Handed out by [`SessionCore::poll_grant`], not granted yet.
    Asked,
    /// Granted: R2Ts go out as the transfer allows.
    Granted,
}

/// The data phase of a new write task.
pub struct NewWrite {
    pub transfer: WriteTransfer,
    /// The command's immediate data.
    pub immediate: Bytes,
    /// The session's FirstBurstLength: room for the unsolicited part is made at once, for the
    /// rest as R2Ts ask for it, so a write whose data never comes holds no more memory than the
    /// initiator was allowed to send unasked (and was granted, [`SessionCore::grant`]); the
    /// number of such writes is bounded by the CmdSN window, and for immediate commands by the
    /// session's task limit.
    pub first_burst_length: u32,
    /// Refused for want of room for its unsolicited data: nothing it sends is kept, and once
    /// its unsolicited burst has ended the core answers it TASK SET FULL without running it
    /// (RFC 7143 11.4.x: a response waits for the last expected Data-Out); it is never handed
    /// out and never asks for a grant.
    pub refused: bool,
    /// Its unsolicited data's room in the server's unsolicited budget, kept until the task ends
    /// or is granted its write budget.
    pub room: Option<BudgetRoom>,
}

/// A task whose turn has come with all of its data ([`SessionCore::poll_ready`]).
pub struct ReadyTask<'a, C, T> {
    pub itt: u32,
    /// The task's session-unique id ([`NewTask::id`]).
    pub id: u64,
    /// The connection its command came on.
    pub conn: C,
    pub attr: TaskAttribute,
    /// Its command and data phase, when it was registered with them.
    pub answer: Option<&'a Answer>,
    pub io: &'a mut T,
    /// Its data-out (empty for a command without one).
    pub data: Bytes,
}

/// A write whose turn has come and that must solicit data: it asks for `bytes` of write budget
/// ([`SessionCore::poll_grant`], then [`SessionCore::grant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantRequest {
    pub itt: u32,
    pub id: u64,
    /// The whole write: its buffer, unsolicited part included.
    pub bytes: u32,
}

/// What a task's final PDUs are made from ([`SessionCore::finish`]): its command (without its
/// data) and the data phase its CDB asks for.
#[derive(Debug, Clone)]
pub struct Answer {
    pub cmd: mcsi_proto::pdu::ScsiCommand,
    pub phase: mcsi_scsi::DataPhase,
}

/// A write whose initiator sent none of the data it owes for the Data-Out timeout
/// ([`SessionCore::handle_timeout`]): the initiator has stopped sending, and at
/// ErrorRecoveryLevel 0 only the end of the connection (and with it the session) gives the
/// write's budget back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataOutTimedOut {
    /// The connection the write came on, to drop.
    pub cid: u16,
    pub itt: u32,
    /// Bytes it received in all.
    pub received: u64,
    pub timeout: Duration,
}

/// A connection to drop, from [`SessionCore::handle_timeout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expired {
    /// A write whose initiator stopped sending its data.
    DataOut(DataOutTimedOut),
    /// The initiator did not answer the NOP-In ping with this TTT within `timeout`.
    PingUnanswered {
        cid: u16,
        ttt: u32,
        timeout: Duration,
    },
}

impl Expired {
    /// The connection to drop.
    pub fn cid(&self) -> u16 {
        match self {
            Expired::DataOut(d) => d.cid,
            Expired::PingUnanswered { cid, .. } => *cid,
        }
    }
}

/// A write still gathering its data ([`SessionCore::collecting`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Collecting {
    /// It waits for its write budget (or its turn): the initiator owes nothing yet beyond the
    /// unsolicited part.
    pub waiting_for_grant: bool,
    /// Bytes received so far.
    pub received: u64,
}

/// What a Data-Out did ([`SessionCore::data_out`]).
#[derive(Debug, PartialEq, Eq)]
pub enum DataOutcome {
    /// Taken; the R2Ts it lets go out wait in [`SessionCore::poll_transmit`].
    Taken,
    /// For no task that takes data (ended, aborted, or never a write): discarded (4.2.3.1).
    Discarded,
    /// For a task that came on another connection (RFC 7143 4.2.2.3): a protocol error.
    NotAllegiant,
    /// Breaks the transfer's rules; at ErrorRecoveryLevel 0 the connection ends (7.1.4.1).
    Error(TransferError),
}

/// A task as a task set and the ready list know it: its session-unique id and its ITT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    id: u64,
    itt: u32,
}

/// A new task, as [`SessionCore::register`] takes it.
#[derive(Debug, Clone)]
pub struct NewTask {
    /// Session-unique, never reused (ITTs are).
    pub id: u64,
    pub itt: u32,
    pub lun: u64,
    pub cmd_sn: u32,
    /// Skips CmdSN ordering (an immediate command, or one whose CmdSN was consumed already);
    /// still enters its task set.
    pub immediate: bool,
    pub attr: TaskAttribute,
    pub bytes: u64,
    /// What its final PDUs are made from; without it, [`SessionCore::finish`] builds none.
    pub answer: Option<Box<Answer>>,
}

/// A task that left the table ([`SessionCore::finish`]).
pub struct Finished<C, T> {
    /// The connection its final PDUs leave on.
    pub out: C,
    pub aborted: bool,
    pub io: T,
}

/// A response policy other than round-robin ([`crate::config::ResponsePolicy`]) and the lists
/// it is given, kept to be reused.
struct ReplySched {
    policy: Box<dyn mcsi_tcp::sched::Scheduler>,
    loads: Vec<mcsi_tcp::sched::ConnLoad>,
    cids: Vec<u16>,
    /// The latest TCP state of each connection ([`SessionCore::handle_tcp_sample`]).
    samples: AHashMap<u16, mcsi_tcp::TcpState>,
}

/// One session's ordering, tasks and connections.
pub struct SessionCore<C, T> {
    window: CmdWindow<Ordered<C>>,
    conns: AHashMap<u16, C>,
    /// CIDs whose connection is leaving on purpose (logging out): picked for no new replies,
    /// and their end is clean.
    leaving: ahash::AHashSet<u16>,
    tasks: AHashMap<u32, Task<T>>,
    task_sets: AHashMap<u64, TaskSet<Key>>,
    /// Tasks whose turn came, for [`SessionCore::poll_ready`].
    ready: std::collections::VecDeque<Key>,
    /// Writes whose turn came that must solicit data, for [`SessionCore::poll_grant`].
    grants: std::collections::VecDeque<Key>,
    next_ttt: u32,
    asymmetric: bool,
    /// The response connection picked last; the next pick is the one with the next higher CID
    /// (asymmetric mode, round-robin).
    last_reply: Option<u16>,
    reply_sched: Option<ReplySched>,
    /// Tracked inline commands running ([`SessionCore::claim`]).
    inline: u32,
    /// Most tasks at once: immediate commands bypass the CmdSN window that bounds the others,
    /// so they are admitted only while the session has fewer tasks than this.
    max_tasks: usize,
    closing: bool,
    /// How long a write may receive nothing it is owed (zero: forever).
    data_out_timeout: Duration,
    /// When [`SessionCore::handle_timeout`] looks next; None: nothing to watch, and the timer
    /// sleeps until [`SessionCore::take_timer_wake`] says otherwise.
    next_data_check: Option<Instant>,
    /// A write to watch arrived while the timer slept.
    timer_wake: bool,
    /// The session's bandwidth toward storage (seed 004): R2Ts wait for it.
    pacer: Option<crate::qos::StoragePacer>,
    /// Granted writes that want an R2T the pacer holds back, in the order they asked; each
    /// gets one R2T when the bucket allows, then goes to the back if it wants more.
    paced: std::collections::VecDeque<Key>,
    /// PDUs the core decided, for [`SessionCore::poll_transmit`].
    transmit: std::collections::VecDeque<(C, Pdu)>,
    /// The session's burst values: the rules new writes follow ([`SessionCore::command`]), and
    /// MaxBurstLength, the longest Data-In sequence.
    burst: crate::transfer::BurstParams,
    /// The server's unsolicited data budget; without one, unsolicited data is not counted.
    unsolicited_budget: Option<std::sync::Arc<dyn SharedBudget>>,
    /// The id of the next task [`SessionCore::command`] registers.
    next_id: u64,
    /// A discovery session: Text, Logout and NOP-Out only (RFC 7143 4.3).
    discovery: bool,
    /// The ErrorRecoveryLevel agreed (RFC 7143 7.1): SNACKs are taken from 1 on.
    erl: u8,
    /// Each connection's NOP-In pings ([`SessionCore::start_keepalive`]).
    keepalives: AHashMap<u16, crate::keepalive::Keepalive>,
    /// Answers that go out once the tasks they name have ended ([`SessionCore::answer_when_ended`]).
    parked: Vec<Parked<C>>,
    /// Connections to close, for [`SessionCore::poll_close`].
    closes: std::collections::VecDeque<(C, Close)>,
    /// A logout's answer that ends the session has gone out ([`SessionCore::take_nexus_ended`]).
    nexus_ended: bool,
    /// ErrorRecoveryLevel 2: how long the tasks of a failed connection wait to be reassigned
    /// (DefaultTime2Retain), the failed connections' CIDs with their deadline, and the final
    /// PDUs of tasks that ended meanwhile ([`SessionCore::conn_failed`]).
    time2retain: Duration,
    /// One entry per failure (CID, deadline): a CID that fails again gets an entry of its own,
    /// so that what an earlier failure left keeps its own deadline.
    failed: Vec<(u16, Instant)>,
    retained: AHashMap<u32, recover::Retained>,
    /// The server's budget for answers kept for reassignment; an answer that finds no room is
    /// not kept (the task is then unknown to TASK REASSIGN, and the initiator issues it again).
    retention_budget: Option<std::sync::Arc<dyn SharedBudget>>,
    /// Answers not kept for want of room in the retention budget.
    retention_refused: u64,
}

/// How a connection is closed ([`SessionCore::poll_close`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    /// Once what is queued on it has been sent (a logout answered on it).
    AfterFlush,
    /// Now (another connection logged it out).
    Now,
}

/// An answer waiting for tasks to end.
struct Parked<C> {
    conn: C,
    pdu: Pdu,
    /// What closes once the answer is queued.
    then: Vec<(C, Close)>,
    /// The aborted tasks still running.
    waiting: Vec<Key>,
    /// It also waits until no inline command of the session runs.
    after_inline: bool,
    immediate: bool,
}

/// Answers to immediate requests a session holds at once, waiting for aborted tasks to end
/// ([`SessionCore::answer_when_ended`]); those in CmdSN order are bounded by the window.
pub const MAX_PARKED_IMMEDIATE: usize = 16;

impl<C: CoreConn, T> SessionCore<C, T> {
    /// A session whose first command carries `exp_cmd_sn`, taking `queue_depth` commands at a
    /// time. In the asymmetric mode `reply_policy` picks response connections (round-robin in
    /// CID order without one).
    pub fn new(
        exp_cmd_sn: u32,
        queue_depth: u32,
        asymmetric: bool,
        reply_policy: Option<Box<dyn mcsi_tcp::sched::Scheduler>>,
    ) -> Self {
        SessionCore {
            window: CmdWindow::new(exp_cmd_sn, queue_depth.max(1)),
            conns: AHashMap::new(),
            leaving: ahash::AHashSet::new(),
            tasks: AHashMap::new(),
            task_sets: AHashMap::new(),
            ready: std::collections::VecDeque::new(),
            grants: std::collections::VecDeque::new(),
            next_ttt: 1,
            asymmetric,
            last_reply: None,
            reply_sched: reply_policy
                .filter(|_| asymmetric)
                .map(|policy| ReplySched {
                    policy,
                    loads: Vec::new(),
                    cids: Vec::new(),
                    samples: AHashMap::new(),
                }),
            inline: 0,
            max_tasks: 2 * queue_depth.max(1) as usize,
            closing: false,
            data_out_timeout: Duration::ZERO,
            next_data_check: None,
            timer_wake: false,
            pacer: None,
            paced: std::collections::VecDeque::new(),
            transmit: std::collections::VecDeque::new(),
            burst: (&mcsi_proto::keys::SessionParams::default()).into(),
            unsolicited_budget: None,
            next_id: 1,
            discovery: false,
            erl: 0,
            time2retain: Duration::ZERO,
            failed: Vec::new(),
            retained: AHashMap::new(),
            retention_budget: None,
            retention_refused: 0,
            keepalives: AHashMap::new(),
            parked: Vec::new(),
            closes: std::collections::VecDeque::new(),
            nexus_ended: false,
        }
    }

    /// Whether a logout's answer that ends the session was queued since the last call: the
    /// I_T nexus ends now (its reservations, unit attentions and prevent state go), before the
    /// answer reaches the initiator.
    pub fn take_nexus_ended(&mut self) -> bool {
        std::mem::take(&mut self.nexus_ended)
    }

    /// The next connection to close and how, after the PDUs [`SessionCore::poll_transmit`]
    /// gave before it (a logout's answer first).
    pub fn poll_close(&mut self) -> Option<(C, Close)> {
        self.closes.pop_front()
    }

    /// Whether one more answer to an immediate request may wait for tasks to end
    /// ([`MAX_PARKED_IMMEDIATE`]); one in CmdSN order always may.
    pub fn answer_room(&self, immediate: bool) -> bool {
        !immediate || self.parked.iter().filter(|p| p.immediate).count() < MAX_PARKED_IMMEDIATE
    }

    /// Sends `pdu` on `conn` once every task `pred` picks that was aborted while running has
    /// ended (and, with `after_inline`, once no inline command of the session runs): at once
    /// when none is, otherwise from the input that ends the last of them, through
    /// [`SessionCore::poll_transmit`]. A task management answer goes out only after the tasks
    /// it affects have ended (SAM-5 7.1, RFC 7143 4.2.3). See [`SessionCore::answer_room`].
    /// `then`: connections to close once the answer is queued.
    pub fn answer_when_ended(
        &mut self,
        conn: &C,
        pdu: Pdu,
        mut pred: impl FnMut(&TaskRef) -> bool,
        after_inline: bool,
        immediate: bool,
        then: Vec<(C, Close)>,
    ) {
        let waiting: Vec<Key> = self
            .tasks
            .iter()
            .filter(|(itt, t)| {
                t.aborted
                    && t.started
                    && pred(&TaskRef {
                        itt: **itt,
                        cid: t.cid,
                        lun: t.lun,
                        cmd_sn: t.cmd_sn,
                    })
            })
            .map(|(itt, t)| Key {
                id: t.id,
                itt: *itt,
            })
            .collect();
        self.parked.push(Parked {
            conn: conn.clone(),
            pdu,
            then,
            waiting,
            after_inline,
            immediate,
        });
        self.resolve_parked();
    }

    /// Sends the parked answers whose tasks have all ended, in the order they were parked.
    fn resolve_parked(&mut self) {
        if self.parked.is_empty() {
            return;
        }
        let (tasks, inline) = (&self.tasks, self.inline);
        let mut i = 0;
        while i < self.parked.len() {
            let p = &mut self.parked[i];
            p.waiting
                .retain(|k| tasks.get(&k.itt).is_some_and(|t| t.id == k.id));
            if p.waiting.is_empty() && (!p.after_inline || inline == 0) {
                let p = self.parked.remove(i);
                // A logout that leaves the session no connection ends its I_T nexus with its
                // answer, not once the connections have wound down afterwards: an initiator
                // told "closed" may log in again, or another may ask at once for a
                // reservation this one held.
                if matches!(&p.pdu, Pdu::LogoutResponse(r) if r.response == mcsi_proto::codes::logout_response::CLOSED)
                    && self.conns.keys().all(|cid| self.leaving.contains(cid))
                {
                    self.nexus_ended = true;
                }
                self.transmit.push_back((p.conn, p.pdu));
                self.closes.extend(p.then);
            } else {
                i += 1;
            }
        }
    }

    /// The session's negotiated burst values (RFC defaults until set): the longest Data-In
    /// sequence, and the rules new writes follow ([`SessionCore::command`]).
    pub fn set_burst(&mut self, burst: crate::transfer::BurstParams) {
        self.burst = crate::transfer::BurstParams {
            max_burst_length: burst.max_burst_length.max(1),
            ..burst
        };
    }

    /// A discovery session takes Text, Logout and NOP-Out only ([`SessionCore::handle_pdu`]).
    pub fn set_discovery(&mut self, discovery: bool) {
        self.discovery = discovery;
    }

    /// The ErrorRecoveryLevel the session agreed: from 1 on, a SNACK is handed to the caller
    /// ([`Arrival::Snack`]) instead of rejected.
    pub fn set_error_recovery_level(&mut self, erl: u8) {
        self.erl = erl;
    }

    /// The server's budget for data initiators send unasked: the immediate data and
    /// unsolicited burst of new writes take room in it, and a write that finds none is refused
    /// (TASK SET FULL, [`SessionCore::command`]).
    pub fn set_unsolicited_budget(&mut self, budget: std::sync::Arc<dyn SharedBudget>) {
        self.unsolicited_budget = Some(budget);
    }

    /// The next PDU the core decided to send, and the connection it leaves on: R2Ts as writes
    /// are granted and their data arrives, a task's Data-In and SCSI Response as it finishes.
    /// Drained by the layer above after each input, in order (StatSN is stamped as they are
    /// sent).
    pub fn poll_transmit(&mut self) -> Option<(C, Pdu)> {
        self.transmit.pop_front()
    }

    /// How long a write may receive none of the data it is owed (its unsolicited burst, or
    /// what its R2Ts asked for) before its connection is dropped; zero: no limit.
    pub fn set_data_out_timeout(&mut self, timeout: Duration) {
        self.data_out_timeout = timeout;
    }

    /// Holds what the initiator sends to `pacer`'s rate (seed 004): R2Ts go out one at a time
    /// while its bucket has no deficit, each charging the data it asks for; the layer above
    /// charges every other PDU it reads ([`SessionCore::charge_storage`]) and reads no more
    /// while [`SessionCore::storage_ready_at`] says to wait. The time is passed in with
    /// [`SessionCore::advance`] and [`SessionCore::handle_timeout`].
    pub fn set_storage_pacer(&mut self, pacer: crate::qos::StoragePacer) {
        self.pacer = Some(pacer);
    }

    /// Whether R2Ts are paced ([`SessionCore::set_storage_pacer`]).
    pub fn storage_paced(&self) -> bool {
        self.pacer.is_some()
    }

    /// The time is `now`, for the pacer toward storage (the layer above tells it before each
    /// input when R2Ts are paced).
    pub fn advance(&mut self, now: Instant) {
        if let Some(p) = self.pacer.as_mut() {
            p.advance(now);
        }
    }

    /// A PDU of `bytes` (header and data) arrived that no R2T asked for: it costs the bucket
    /// toward storage.
    pub fn charge_storage(&mut self, bytes: u64) {
        if let Some(p) = self.pacer.as_mut() {
            p.charge(bytes);
        }
    }

    /// When the next read toward storage may go (`None`: now, or not paced).
    pub fn storage_ready_at(&self) -> Option<Instant> {
        self.pacer.as_ref().and_then(|p| p.ready_at())
    }

    /// Whether the session is closing (or closed).
    pub fn is_closing(&self) -> bool {
        self.closing
    }

    /// When [`SessionCore::handle_timeout`] has something to do next, if ever: the Data-Out
    /// timer's next look, or a connection's keepalive deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.closing {
            return None;
        }
        let data = self
            .next_data_check
            .filter(|_| !self.data_out_timeout.is_zero());
        // R2Ts held back: when the bucket next allows one.
        let paced = self
            .pacer
            .as_ref()
            .filter(|_| !self.paced.is_empty())
            .map(|p| p.ready_at().unwrap_or(p.now()));
        self.keepalives
            .values()
            .filter_map(|k| k.deadline())
            .chain(data)
            .chain(self.failed.iter().map(|(_, d)| *d))
            .chain(paced)
            .min()
    }

    /// Connection `cid` pings its initiator with a NOP-In after `interval` without receiving
    /// anything, and is given up when a ping goes unanswered for `timeout` (an `interval` of
    /// zero: never); it last received something at `now`. Its pings go out through
    /// [`SessionCore::poll_transmit`] from [`SessionCore::handle_timeout`], and their answers
    /// are taken by [`SessionCore::handle_pdu`].
    pub fn start_keepalive(
        &mut self,
        cid: u16,
        interval: Duration,
        timeout: Duration,
        now: Instant,
    ) {
        self.keepalives.insert(
            cid,
            crate::keepalive::Keepalive::new(interval, timeout, now),
        );
        if !interval.is_zero() {
            self.timer_wake = true;
        }
    }

    /// Asks the initiator to log out, on every connection: an Async Message with AsyncEvent 1
    /// (RFC 7143 11.9.1), which asks for a Logout within `within_secs` seconds (Parameter3).
    /// The messages go out through [`SessionCore::poll_transmit`]; what happens when no Logout
    /// comes is the caller's to decide (the target may then drop the connections). Returns how
    /// many connections were asked; none once the session is closing.
    pub fn request_logout(&mut self, within_secs: u16) -> usize {
        if self.closing {
            return 0;
        }
        let mut cids: Vec<u16> = self.conns.keys().copied().collect();
        cids.sort_unstable();
        for cid in &cids {
            let c = self.conns[cid].clone();
            self.transmit
                .push_back((c, logout_request_pdu(within_secs)));
        }
        cids.len()
    }

    /// Connection `cid` received bytes at `now`: it is not idle. The layer above may tell it
    /// now and then rather than at every read (a ping then goes out at most that much early).
    pub fn conn_heard(&mut self, cid: u16, now: Instant) {
        if let Some(k) = self.keepalives.get_mut(&cid) {
            k.received(now);
        }
    }

    /// Whether an input since the timer last looked gave it something to watch while it had
    /// nothing (a write that collects data): the layer above wakes its timer then, and only
    /// then. Reading clears it.
    pub fn take_timer_wake(&mut self) -> bool {
        std::mem::take(&mut self.timer_wake)
    }

    /// The time is `now`. Each connection's keepalive pings an idle initiator (the NOP-In
    /// waits in [`SessionCore::poll_transmit`]) or gives the connection up when its ping went
    /// unanswered ([`Expired::PingUnanswered`]). The Data-Out timer looks at every write still
    /// gathering data, each quarter of the timeout (at least 10 ms apart): a write the
    /// initiator owes data (its unsolicited burst is open, or its R2Ts went out) that received
    /// nothing since the timer first saw it at its current count, a timeout ago or more, is
    /// returned ([`Expired::DataOut`]). So a write is given up between one and one and a half
    /// timeouts after its last Data-Out. What is returned names connections to drop.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<Expired> {
        let mut out = Vec::new();
        if self.closing {
            self.next_data_check = None;
            return out;
        }
        let mut pings = Vec::new();
        for (cid, k) in self.keepalives.iter_mut() {
            if k.deadline().is_none_or(|d| now < d) {
                continue;
            }
            match k.on_deadline(now, || take_ttt(&mut self.next_ttt)) {
                crate::keepalive::Due::Nothing => {}
                crate::keepalive::Due::Ping { ttt } => pings.push((*cid, ttt)),
                crate::keepalive::Due::Unanswered { ttt } => out.push(Expired::PingUnanswered {
                    cid: *cid,
                    ttt,
                    timeout: k.timeout,
                }),
            }
        }
        for (cid, ttt) in pings {
            if let Some(c) = self.conns.get(&cid) {
                self.transmit
                    .push_back((c.clone(), crate::keepalive::ping_pdu(ttt)));
            }
        }
        // A connection given up pings no more.
        for e in &out {
            if let Expired::PingUnanswered { cid, .. } = e {
                self.keepalives.remove(cid);
            }
        }
        self.check_data_out(now, &mut out);
        self.expire_failed(now);
        self.advance(now);
        self.release_paced();
        out
    }

    /// R2Ts the pacer held back go out while its bucket allows, one per write in turn.
    fn release_paced(&mut self) {
        while self.pacer.as_ref().is_some_and(|p| p.ready_at().is_none()) {
            let Some(k) = self.paced.pop_front() else {
                return;
            };
            let Some(conn) = self
                .tasks
                .get(&k.itt)
                // An orphan (ErrorRecoveryLevel 2) asks again once reassigned.
                .filter(|t| t.id == k.id && !t.aborted && !t.orphaned)
                .and_then(|t| self.conns.get(&t.cid))
                .cloned()
            else {
                continue;
            };
            self.issue_r2ts(k.itt, &conn, true);
        }
    }

    fn check_data_out(&mut self, now: Instant, out: &mut Vec<Expired>) {
        let timeout = self.data_out_timeout;
        if timeout.is_zero() {
            self.next_data_check = None;
            return;
        }
        if self.next_data_check.is_some_and(|t| now < t) {
            return;
        }
        let mut watched = false;
        for (itt, t) in self.tasks.iter_mut() {
            let Some(c) = t.collect.as_mut().filter(|_| !t.aborted) else {
                continue;
            };
            watched = true;
            if t.orphaned {
                // Its connection failed: nothing is owed until it is reassigned.
                c.watch = None;
                continue;
            }
            if c.grant != Grant::Granted && c.must_solicit() {
                // It waits for its budget (or its turn): nothing is owed yet.
                c.watch = None;
                continue;
            }
            if !c.transfer.owed() {
                // Its next R2T waits for the bandwidth toward storage.
                c.watch = None;
                continue;
            }
            match c.watch {
                Some((seen, since)) if seen == c.received => {
                    if now.saturating_duration_since(since) >= timeout {
                        out.push(Expired::DataOut(DataOutTimedOut {
                            cid: t.cid,
                            itt: *itt,
                            received: c.received,
                            timeout,
                        }));
                        c.watch = Some((c.received, now));
                    }
                }
                _ => c.watch = Some((c.received, now)),
            }
        }
        self.next_data_check = watched.then(|| now + (timeout / 4).max(Duration::from_millis(10)));
    }

    /// Whether the response policy looks at TCP state: the layer above then feeds each response
    /// connection's samples ([`SessionCore::handle_tcp_sample`]) every few milliseconds.
    pub fn wants_tcp_samples(&self) -> bool {
        self.reply_sched
            .as_ref()
            .is_some_and(|rs| rs.policy.wants_tcp_info())
    }

    /// The TCP state of connection `cid`'s socket as sampled now; the response policy uses the
    /// latest one of each connection.
    pub fn handle_tcp_sample(&mut self, cid: u16, state: mcsi_tcp::TcpState) {
        if let Some(rs) = self.reply_sched.as_mut() {
            rs.samples.insert(cid, state);
        }
    }

    /// (ExpCmdSN, MaxCmdSN) to put in a PDU now.
    pub fn cmd_sns(&self) -> (u32, u32) {
        (self.window.exp_cmd_sn(), self.window.max_cmd_sn())
    }

    /// Commands held in the window for a gap before them.
    pub fn held(&self) -> usize {
        self.window.held()
    }

    pub fn conn(&self, cid: u16) -> Option<&C> {
        self.conns.get(&cid)
    }

    pub fn conns(&self) -> impl Iterator<Item = &C> {
        self.conns.values()
    }

    pub fn conn_count(&self) -> usize {
        self.conns.len()
    }

    /// Adds a connection; an existing one with the same CID is returned (to be dropped by the
    /// caller: connection reinstatement, RFC 7143 6.3.4). A closing session takes none: the
    /// connection is given back.
    pub fn add_conn(&mut self, conn: C) -> Result<Option<C>, C> {
        // A sample of a connection this CID named before says nothing of the new one.
        if let Some(rs) = self.reply_sched.as_mut() {
            rs.samples.remove(&conn.cid());
        }
        if self.closing {
            return Err(conn);
        }
        self.leaving.remove(&conn.cid());
        Ok(self.conns.insert(conn.cid(), conn))
    }

    /// `conn` is leaving on purpose (a logout, or a failure the session survives): from now on
    /// it is picked for no new replies, and its end ([`SessionCore::conn_lost`]) is clean.
    pub fn leave(&mut self, conn: &C) {
        if self.conns.get(&conn.cid()).is_some_and(|c| c.same(conn)) {
            self.leaving.insert(conn.cid());
        }
    }

    /// `conn` failed before it carried anything (its last login step, its move to a session
    /// thread): it leaves like a logout when the session has other connections, and fails
    /// (taking the session with it) when it is the last.
    pub fn fail_alone(&mut self, conn: &C) {
        if self.conns.len() > 1 {
            self.leave(conn);
        }
    }

    /// Whether `conn`'s end now would be clean: it is leaving ([`SessionCore::leave`]), or it is
    /// no longer the session's (another connection took over its CID, connection
    /// reinstatement, or the session closed). Only the failure of a member fails the session.
    pub fn ends_cleanly(&self, conn: &C) -> bool {
        match self.conns.get(&conn.cid()) {
            Some(c) if c.same(conn) => self.leaving.contains(&conn.cid()),
            _ => true,
        }
    }

    fn usable_for_replies(&self, c: &C) -> bool {
        !self.leaving.contains(&c.cid())
    }

    /// A Target Transfer Tag not equal to the reserved value.
    pub fn alloc_ttt(&mut self) -> u32 {
        take_ttt(&mut self.next_ttt)
    }

    pub fn task(&self, itt: u32) -> Option<&Task<T>> {
        self.tasks.get(&itt)
    }

    /// What the tokio layer attached to task `itt`, if it is still the task `id`.
    pub fn task_io_mut(&mut self, itt: u32, id: u64) -> Option<&mut T> {
        self.tasks
            .get_mut(&itt)
            .filter(|t| t.id == id)
            .map(|t| &mut t.io)
    }

    pub fn task_count(&self) -> usize {
        self.tasks.len()
    }

    /// Registers a SCSI task that came on `conn` and submits it to the CmdSN window. Returns
    /// whether it was registered (`io` is dropped if not) and the requests its arrival put in
    /// order. A registered task starts once [`SessionCore::poll_ready`] hands it out; a write
    /// that must solicit data asks for its budget through [`SessionCore::poll_grant`] once its
    /// turn has come.
    pub fn register(
        &mut self,
        conn: &C,
        t: NewTask,
        write: Option<NewWrite>,
        io: T,
    ) -> (RegisterOutcome, InOrder<C>) {
        if self.closing {
            return (RegisterOutcome::Closing, Vec::new());
        }
        if !t.immediate && !self.window.takes(t.cmd_sn) {
            return (RegisterOutcome::OutOfWindow, Vec::new());
        }
        if t.immediate && self.tasks.len() >= self.max_tasks {
            // Immediate commands are not bounded by the CmdSN window: beyond the session's
            // share they are answered TASK SET FULL (SAM-5 5.3), so a peer cannot pile up tasks
            // (and the buffers of their writes) without limit.
            return (RegisterOutcome::TaskSetFull, Vec::new());
        }
        if self.tasks.contains_key(&t.itt) {
            // The CmdSN is still consumed so that later commands are not held forever.
            let ctl = if t.immediate {
                Vec::new()
            } else {
                self.submit(t.cmd_sn, Ordered::Nothing)
            };
            return (RegisterOutcome::IttInUse, ctl);
        }
        let refused = write.as_ref().is_some_and(|w| w.refused);
        let (collect, data, unsolicited) = match write {
            None => (None, Bytes::new(), None),
            Some(mut w) => {
                let room = w.room.take();
                let (c, d) = start_write(w);
                (c, d, room)
            }
        };
        if collect.is_some() && self.next_data_check.is_none() && !self.data_out_timeout.is_zero() {
            self.timer_wake = true;
        }
        let cid = conn.cid();
        let reply_cid = if self.asymmetric {
            self.pick_reply(t.bytes).unwrap_or(cid)
        } else {
            cid
        };
        self.tasks.insert(
            t.itt,
            Task {
                id: t.id,
                cid,
                reply_cid,
                bytes: t.bytes,
                lun: t.lun,
                cmd_sn: t.cmd_sn,
                attr: t.attr,
                aborted: false,
                orphaned: false,
                retain_until: None,
                turn: false,
                started: false,
                collect,
                data,
                answer: t.answer,
                refused,
                unsolicited,
                io,
            },
        );
        self.window.task_started();
        // Immediate commands skip the ordering (RFC 7143 3.2.2.1) but still enter the task set;
        // a command next in CmdSN order with nothing held enters it at once, without the
        // window's delivery list.
        let ctl = if t.immediate || self.window.take_next(t.cmd_sn) {
            self.admit(Key {
                id: t.id,
                itt: t.itt,
            });
            Vec::new()
        } else {
            self.submit(t.cmd_sn, Ordered::Task(t.id, t.itt))
        };
        (RegisterOutcome::Ok, ctl)
    }

    /// The next write whose turn has come and that must solicit data, each once: the caller
    /// takes `bytes` from its write budgets and then calls [`SessionCore::grant`] (at once, or
    /// later when the budget has room). Until then the write asks for nothing, so the data that
    /// writes hold stays within the budgets whatever the initiator withholds.
    pub fn poll_grant(&mut self) -> Option<GrantRequest> {
        while let Some(k) = self.grants.pop_front() {
            let Some(t) = self
                .tasks
                .get_mut(&k.itt)
                .filter(|t| t.id == k.id && !t.aborted)
            else {
                continue;
            };
            let Some(c) = t.collect.as_mut().filter(|c| c.grant == Grant::None) else {
                continue;
            };
            c.grant = Grant::Asked;
            return Some(GrantRequest {
                itt: k.itt,
                id: k.id,
                bytes: c.transfer.want(),
            });
        }
        None
    }

    /// Write `itt` (still the task `id`) has its budget: its first R2Ts wait in
    /// [`SessionCore::poll_transmit`]. False when the task has ended, was aborted or no longer
    /// collects data (the caller gives the budget back).
    pub fn grant(&mut self, itt: u32, id: u64) -> bool {
        let Some(t) = self.tasks.get(&itt).filter(|t| t.id == id && !t.aborted) else {
            return false;
        };
        // Its connection gone, it is about to be aborted, or (orphaned, ErrorRecoveryLevel 2,
        // its CID perhaps taken by a new connection already) it asks again once reassigned:
        // nothing is planned for it now.
        let Some(command_conn) = self.conns.get(&t.cid).filter(|_| !t.orphaned).cloned() else {
            if let Some(c) = self.tasks.get_mut(&itt).and_then(|t| t.collect.as_mut()) {
                c.grant = Grant::None;
            }
            return false;
        };
        let Some(c) = self.tasks.get_mut(&itt).and_then(|t| t.collect.as_mut()) else {
            return false;
        };
        c.grant = Grant::Granted;
        // The whole write is under the write budgets now.
        if let Some(t) = self.tasks.get_mut(&itt) {
            t.unsolicited = None;
        }
        self.send_r2ts(itt, &command_conn);
        true
    }

    /// Queues the R2Ts write `itt`'s transfer lets go out now, on its reply connection. When
    /// R2Ts are paced, one goes out if the bucket allows and no other write waits before it;
    /// otherwise the write waits its turn ([`SessionCore::release_paced`]).
    fn send_r2ts(&mut self, itt: u32, command_conn: &C) {
        self.issue_r2ts(itt, command_conn, false);
    }

    /// [`SessionCore::send_r2ts`]; `turn`: the write's turn among paced writes has come.
    fn issue_r2ts(&mut self, itt: u32, command_conn: &C, turn: bool) {
        let Some(t) = self.tasks.get_mut(&itt) else {
            return;
        };
        let (lun, key) = (t.lun, Key { id: t.id, itt });
        let Some(c) = t.collect.as_mut() else { return };
        let r2ts = match self.pacer.as_mut() {
            None => c.transfer.next_r2ts(|| take_ttt(&mut self.next_ttt)),
            Some(p) => {
                let queued = self.paced.contains(&key);
                if queued || (!turn && (!self.paced.is_empty() || p.ready_at().is_some())) {
                    // Behind the writes already waiting, or the bucket is in deficit.
                    if !queued && c.transfer.can_solicit() {
                        self.paced.push_back(key);
                        self.timer_wake = true;
                    }
                    return;
                }
                let r2ts = c
                    .transfer
                    .next_r2ts_upto(1, p.r2t_len(), || take_ttt(&mut self.next_ttt));
                for r in &r2ts {
                    p.charge_solicited(r.len);
                }
                if !r2ts.is_empty() && c.transfer.can_solicit() {
                    self.paced.push_back(key);
                    self.timer_wake = true;
                }
                r2ts
            }
        };
        if r2ts.is_empty() {
            return;
        }
        c.buf.reserve(r2ts.iter().map(|r| r.len as usize).sum());
        // R2Ts leave with the task's other replies (a response connection in the asymmetric
        // mode).
        let out = self.reply_conn(itt, command_conn);
        for r in r2ts {
            self.transmit.push_back((out.clone(), r.pdu(lun, itt)));
        }
    }

    /// Where write `itt` (still the task `id`) stands while its data is arriving; `None` once
    /// it has all of it (or has ended).
    pub fn collecting(&self, itt: u32, id: u64) -> Option<Collecting> {
        let t = self.tasks.get(&itt).filter(|t| t.id == id)?;
        let c = t.collect.as_ref()?;
        Some(Collecting {
            // While its unsolicited burst is open the initiator owes data, grant or not.
            waiting_for_grant: c.grant != Grant::Granted && c.must_solicit(),
            received: c.received,
        })
    }

    /// Queues a grant request for task `k` when its turn has come and its write must solicit
    /// data it has not been granted, once its unsolicited burst has ended (no R2T may go out
    /// before: a write whose burst never ends holds no write budget).
    fn ask_grant(&mut self, k: Key) {
        if let Some(t) = self.tasks.get(&k.itt).filter(|t| t.id == k.id && t.turn) {
            if t.collect
                .as_ref()
                .is_some_and(|c| c.grant == Grant::None && c.must_solicit())
            {
                self.grants.push_back(k);
            }
        }
    }

    /// A Data-Out arrived on connection `cid`: its bytes go to the task's buffer; a task whose
    /// data is now complete runs once its turn has come ([`SessionCore::poll_ready`]).
    pub fn data_out(&mut self, cid: u16, d: &DataOut) -> DataOutcome {
        let asked = self.asked(d);
        let out = self.take_data_out(cid, d, false);
        self.charge_unasked(d, asked, &out);
        out
    }

    /// Whether Data-Out `d` answers an R2T its task sent (and paid for) that is still open.
    fn asked(&self, d: &DataOut) -> bool {
        self.pacer.is_some()
            && self
                .tasks
                .get(&d.itt)
                .and_then(|t| t.collect.as_ref())
                .is_some_and(|c| c.transfer.open_ttts().any(|x| x == d.ttt))
    }

    /// With a bandwidth toward storage, a Data-Out that names an R2T but was not taken as part
    /// of one (an unknown task or TTT, data beyond the R2T) was paid for by no R2T: it costs
    /// the bucket now. The layer above charges the unsolicited ones as it reads them.
    /// `asked`: it answered an open R2T before it was taken or refused (an aborted task's
    /// data, already paid for by its R2T).
    fn charge_unasked(&mut self, d: &DataOut, asked: bool, out: &DataOutcome) {
        if d.ttt != mcsi_proto::pdu::RESERVED_TAG && !asked && !matches!(out, DataOutcome::Taken) {
            self.charge_storage((mcsi_proto::pdu::BHS_LEN + d.data.len()) as u64);
        }
    }

    /// A Data-Out arrived on connection `cid` with a data digest error (ErrorRecoveryLevel 1
    /// and above; its header was sound): its sequence goes on as if its data had come, and the
    /// write asks for that data again with a recovery R2T (RFC 7143 7.8 a) once no sequence that
    /// could carry it is open.
    pub fn data_out_lost(&mut self, cid: u16, d: &DataOut) -> DataOutcome {
        let asked = self.asked(d);
        let out = self.take_data_out(cid, d, true);
        self.charge_unasked(d, asked, &out);
        out
    }

    fn take_data_out(&mut self, cid: u16, d: &DataOut, lost: bool) -> DataOutcome {
        let Some(task) = self.tasks.get_mut(&d.itt) else {
            return DataOutcome::Discarded;
        };
        if task.cid != cid {
            return DataOutcome::NotAllegiant;
        }
        if task.aborted {
            return DataOutcome::Discarded;
        }
        let Some(c) = task.collect.as_mut() else {
            return DataOutcome::Discarded;
        };
        let len = d.data.len() as u32;
        let a = if lost {
            c.transfer
                .on_lost_data_out(d.ttt, d.data_sn, d.buffer_offset, len, d.final_)
                .map(|()| crate::transfer::Accept {
                    offset: d.buffer_offset,
                    len: 0,
                })
        } else {
            c.transfer
                .on_data_out(d.ttt, d.data_sn, d.buffer_offset, len, d.final_)
        };
        let a = match a {
            Ok(a) => a,
            Err(e) => return DataOutcome::Error(e),
        };
        c.received += u64::from(len);
        // Data beyond what the command needs is accepted and dropped (len 0): nothing to place.
        if a.len > 0 && !c.refused {
            place(&mut c.buf, a.offset as usize, &d.data[..a.len as usize]);
        }
        let key = Key {
            id: task.id,
            itt: d.itt,
        };
        if c.refused && !c.transfer.unsolicited_open() {
            // A refused write ends with its unsolicited burst, with no data.
            task.collect = None;
            if task.turn {
                self.ready.push_back(key);
            }
            return DataOutcome::Taken;
        }
        if c.transfer.done() {
            let want = c.transfer.want() as usize;
            let mut buf = std::mem::take(&mut c.buf);
            buf.resize(want, 0);
            task.data = buf.freeze();
            task.collect = None;
            if task.turn {
                self.ready.push_back(key);
            }
            return DataOutcome::Taken;
        }
        if c.grant != Grant::Granted {
            // The unsolicited burst ended early: the rest must be asked for, once granted.
            self.ask_grant(key);
            return DataOutcome::Taken;
        }
        if let Some(command_conn) = self.conns.get(&cid).cloned() {
            self.send_r2ts(d.itt, &command_conn);
        }
        DataOutcome::Taken
    }

    /// The next task whose turn has come (CmdSN order and its task set allow it), with what is
    /// attached to it; each task once.
    #[inline]
    pub fn poll_ready(&mut self) -> Option<ReadyTask<'_, C, T>> {
        if self.ready.is_empty() {
            return None;
        }
        self.next_ready()
    }

    fn next_ready(&mut self) -> Option<ReadyTask<'_, C, T>> {
        let (k, conn) = loop {
            let k = self.ready.pop_front()?;
            let Some(t) = self
                .tasks
                .get(&k.itt)
                .filter(|t| t.id == k.id && !t.started && t.turn && t.collect.is_none())
            else {
                continue;
            };
            let (refused, orphaned, conn) =
                (t.refused, t.orphaned, self.conns.get(&t.cid).cloned());
            match conn {
                // Its connection failed (ErrorRecoveryLevel 2): it runs once reassigned.
                None if orphaned => continue,
                // Its unsolicited data has come (and was dropped): it is answered without
                // running.
                Some(c) if refused => {
                    let full = mcsi_scsi::Outcome::status(mcsi_scsi::status::TASK_SET_FULL);
                    let _ = self.finish(k.itt, k.id, &c, Some(full));
                }
                Some(c) => break (k, c),
                // Its connection has gone (its tasks are aborted with it).
                None => {
                    let _ = self.end(k);
                }
            }
        };
        let t = self.tasks.get_mut(&k.itt)?;
        t.started = true;
        Some(ReadyTask {
            itt: k.itt,
            id: k.id,
            conn,
            attr: t.attr,
            answer: t.answer.as_deref(),
            data: std::mem::take(&mut t.data),
            io: &mut t.io,
        })
    }

    /// The turn of these tasks came (CmdSN order, task set): each runs once its data is in.
    fn turn_came(&mut self, keys: Vec<Key>) {
        for k in keys {
            self.turn_came_one(k);
        }
    }

    fn turn_came_one(&mut self, k: Key) {
        if let Some(t) = self.tasks.get_mut(&k.itt).filter(|t| t.id == k.id) {
            t.turn = true;
            if t.collect.is_none() {
                self.ready.push_back(k);
            } else {
                self.ask_grant(k);
            }
        }
    }

    /// Decides when a [`Deferred`] command runs, without a task of its own. When it is next in
    /// CmdSN order (or immediate) and no ORDERED task is pending in its LUN's task set (SAM-5
    /// 8.6), its CmdSN is consumed and the caller runs it now ([`ClaimOutcome::Now`]) to its end, queues
    /// its final PDUs on [`Inline::reply`] (or its own connection) and, for a tracked claim,
    /// calls [`SessionCore::release_inline`]. A command ahead of ExpCmdSN (another connection
    /// has not delivered the ones before it yet) is given to [`SessionCore::hold`]. Nothing is
    /// allocated on the way of a command whose turn has come.
    ///
    /// With one connection no other reader can deliver a command or task management meanwhile,
    /// so nothing is tracked. With several, a running command counts in its LUN's task set as a
    /// running SIMPLE task, so that an ORDERED command arriving on another connection waits for
    /// it and task management waits for it to end ([`SessionCore::inline_running`]).
    pub fn claim(&mut self, itt: u32, lun: u64, cmd_sn: u32, immediate: bool) -> ClaimOutcome<C> {
        if self.closing || self.tasks.contains_key(&itt) {
            return ClaimOutcome::Task;
        }
        if self
            .task_sets
            .get(&lun)
            .is_some_and(|ts| !ts.admits_simple())
        {
            return ClaimOutcome::Task;
        }
        if immediate || self.window.take_next(cmd_sn) {
            return ClaimOutcome::Now(self.inline_claim(lun));
        }
        ClaimOutcome::Wait
    }

    /// Holds a command whose turn has not come ([`ClaimOutcome::Wait`]) in the window, with a queue
    /// slot, to run on the reader that fills the gap before it ([`OrderedRun::Inline`]).
    pub fn hold(&mut self, d: Box<Deferred<C>>) -> HoldOutcome<C> {
        if self.closing || self.tasks.contains_key(&d.cmd.itt) {
            return HoldOutcome::NeedsTask(d);
        }
        let cmd_sn = d.cmd.cmd_sn;
        if !self.window.takes(cmd_sn) {
            return HoldOutcome::Dropped(d);
        }
        self.window.task_started();
        HoldOutcome::InOrder(self.submit(cmd_sn, Ordered::Command(d)))
    }

    /// A tracked inline command ended: lets the LUN's task set go on. Returns true when no
    /// inline command is running any more.
    pub fn release_inline(&mut self, lun: u64) -> bool {
        let ready = self.in_task_set(lun, |ts| ts.leave_inline());
        self.turn_came(ready);
        self.inline = self.inline.saturating_sub(1);
        if self.inline == 0 {
            self.resolve_parked();
        }
        self.inline == 0
    }

    /// Tracked inline commands running.
    pub fn inline_running(&self) -> u32 {
        self.inline
    }

    /// Submits a non-SCSI non-immediate request (or a consumed CmdSN) to the window; returns
    /// whether it was taken and the requests now in order (possibly including this one).
    pub fn submit_ordered(&mut self, cmd_sn: u32, item: Ordered<C>) -> (bool, InOrder<C>) {
        if !self.window.accepts(cmd_sn) {
            return (false, Vec::new());
        }
        (true, self.submit(cmd_sn, item))
    }

    /// ABORT TASK for a task that was not found (RFC 7143 11.5.1): when its RefCmdSN lies before
    /// the request's own CmdSN and still in the window, the referenced command is taken as
    /// received (its CmdSN is used up, so the commands after it are not held for it) and the
    /// answer is "function complete": returns what that put in order. `None`: "task does not
    /// exist".
    pub fn take_as_received(&mut self, ref_cmd_sn: u32, cmd_sn: u32) -> Option<InOrder<C>> {
        use mcsi_proto::serial::Sn;
        if !Sn::lt(Sn(ref_cmd_sn), Sn(cmd_sn)) || !self.window.accepts(ref_cmd_sn) {
            return None;
        }
        Some(self.submit_ordered(ref_cmd_sn, Ordered::Nothing).1)
    }

    /// The connection task `itt`'s R2T, Data-In and status leave on: the one its command came
    /// on (connection allegiance, RFC 7143 5.3), or in the asymmetric mode the response
    /// connection chosen when the task was registered; when that one has gone or is logging
    /// out another is chosen. Falls back to `command_conn` when no response connection is left
    /// or the task is unknown.
    pub fn reply_conn(&mut self, itt: u32, command_conn: &C) -> C {
        if !self.asymmetric {
            // A task TASK REASSIGN moved (ErrorRecoveryLevel 2) answers on its new connection,
            // also when it was already running on the failed one. Below level 2 no task moves.
            if self.erl < 2 {
                return command_conn.clone();
            }
            let moved = self
                .tasks
                .get(&itt)
                .filter(|t| t.cid != command_conn.cid())
                .and_then(|t| self.conns.get(&t.cid));
            return moved.unwrap_or(command_conn).clone();
        }
        let Some((cid, bytes)) = self.tasks.get(&itt).map(|t| (t.reply_cid, t.bytes)) else {
            return command_conn.clone();
        };
        if let Some(c) = self.conns.get(&cid).filter(|c| self.usable_for_replies(c)) {
            return c.clone();
        }
        // The chosen response connection is logging out or gone: another one takes the rest.
        let cid = self.pick_reply(bytes).unwrap_or(command_conn.cid());
        if let Some(t) = self.tasks.get_mut(&itt) {
            t.reply_cid = cid;
        }
        self.conns
            .get(&cid)
            .cloned()
            .unwrap_or_else(|| command_conn.clone())
    }

    /// Ends task `itt` (if it is still the task `id`) with the device server's `outcome`
    /// (`None`: it did not run to one): it leaves the table, its task set goes on (tasks whose
    /// turn came wait in [`SessionCore::poll_ready`]) and its queue slot is given back. Unless
    /// it was aborted, its final PDUs (Data-In split by its reply connection's
    /// MaxRecvDataSegmentLength and the session's MaxBurstLength, then status, RFC 7143 11.4,
    /// 11.7) wait in [`SessionCore::poll_transmit`]. Returns the connection they leave on and
    /// what was attached to the task.
    pub fn finish(
        &mut self,
        itt: u32,
        id: u64,
        command_conn: &C,
        outcome: Option<mcsi_scsi::Outcome>,
    ) -> Option<Finished<C, T>> {
        if self.tasks.get(&itt)?.id != id {
            return None;
        }
        let out = self.reply_conn(itt, command_conn);
        let mut entry = self.end(Key { id, itt })?;
        if let (false, Some(o), Some(a)) = (entry.aborted, outcome, entry.answer.take()) {
            let pdus = crate::datain::response_pdus(
                &a.cmd,
                a.phase,
                o,
                out.max_data_in(),
                self.burst.max_burst_length,
            );
            if entry.orphaned {
                // Its connection failed: its answer waits to be reassigned, until the
                // deadline its failure set.
                if let Some(until) = entry.retain_until {
                    self.retain(itt, entry.cid, until, pdus);
                }
            } else {
                for p in pdus {
                    self.transmit.push_back((out.clone(), p));
                }
            }
        }
        Some(Finished {
            out,
            aborted: entry.aborted,
            io: entry.io,
        })
    }

    /// Aborts the tasks `pred` picks: a task of its own is marked aborted (its status will not
    /// be sent, RFC 7143 4.2.3) and handed to `on_abort`. A task that was not handed out to run
    /// ([`SessionCore::poll_ready`]: it waits for its turn, its budget or its data) ends here
    /// and then, as [`SessionCore::finish`] would end it: nothing runs for it that would have
    /// to be waited for. One that was handed out stays until its end, which `on_abort` tells it
    /// to hurry. A command held in the window without a task ([`Deferred`]) is dropped there,
    /// its CmdSN kept as consumed-without-command. Returns how many were found (running,
    /// waiting or held).
    pub fn abort_where(
        &mut self,
        mut pred: impl FnMut(&TaskRef) -> bool,
        mut on_abort: impl FnMut(&mut T),
    ) -> usize {
        let mut found = 0;
        let mut idle = Vec::new();
        for (itt, t) in self.tasks.iter_mut() {
            let r = TaskRef {
                itt: *itt,
                cid: t.cid,
                lun: t.lun,
                cmd_sn: t.cmd_sn,
            };
            if pred(&r) {
                t.aborted = true;
                on_abort(&mut t.io);
                if !t.started {
                    idle.push(Key {
                        id: t.id,
                        itt: *itt,
                    });
                }
                found += 1;
            }
        }
        for k in idle {
            self.end(k);
        }
        found + self.abort_held(pred)
    }

    /// Task `k` leaves the table: its task set goes on (tasks whose turn came wait in
    /// [`SessionCore::poll_ready`]) and its queue slot is given back.
    fn end(&mut self, k: Key) -> Option<Task<T>> {
        let entry = self.tasks.remove(&k.itt)?;
        let ready = self.in_task_set(entry.lun, |ts| ts.leave(&k));
        self.turn_came(ready);
        self.window.task_done();
        self.resolve_parked();
        Some(entry)
    }

    /// Closes the session: nothing more is taken, held commands are dropped, every task is
    /// aborted (`on_abort`). Returns the connections, to be dropped, and whether this was the
    /// first close.
    pub fn close(&mut self, on_abort: impl FnMut(&mut T)) -> (Vec<C>, bool) {
        let first = !self.closing;
        self.closing = true;
        let _ = self.window.drain_held();
        let conns = self.conns.drain().map(|(_, c)| c).collect();
        self.leaving.clear();
        self.keepalives.clear();
        self.abort_where(|_| true, on_abort);
        (conns, first)
    }

    /// Connection `conn` ended: it leaves the session, and the tasks that came on its CID,
    /// running or held, are aborted (`on_abort`). A connection whose CID another one has taken
    /// over (connection reinstatement) has had its tasks aborted then; the tasks of the CID now
    /// are the new connection's and go on. Says how many connections are left and whether the
    /// session ends with it: at ErrorRecoveryLevel 0 a connection that fails (did not leave on
    /// purpose) takes the session with it (RFC 7143 6.1, 7.1.5), and a session without
    /// connections ends.
    pub fn conn_lost(&mut self, conn: &C, on_abort: impl FnMut(&mut T)) -> ConnLost {
        let cid = conn.cid();
        let clean = self.ends_cleanly(conn);
        match self.conns.get(&cid) {
            Some(c) if c.same(conn) => {
                self.conns.remove(&cid);
                self.leaving.remove(&cid);
                self.keepalives.remove(&cid);
            }
            Some(_) => return ConnLost::new(clean, self.conns.len()),
            None => {}
        }
        // Tasks left behind for reassignment (ErrorRecoveryLevel 2) are not this end's.
        let orphans: Vec<u32> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.cid == cid && t.orphaned)
            .map(|(itt, _)| *itt)
            .collect();
        self.abort_where(|t| t.cid == cid && !orphans.contains(&t.itt), on_abort);
        ConnLost::new(clean, self.conns.len())
    }

    /// Runs `f` on `lun`'s task set, if it has one, and drops the set once it is empty: sets are
    /// keyed by the LUN field a peer sends, so only sets with tasks in them are kept.
    fn in_task_set(&mut self, lun: u64, f: impl FnOnce(&mut TaskSet<Key>) -> Vec<Key>) -> Vec<Key> {
        let Some(ts) = self.task_sets.get_mut(&lun) else {
            return Vec::new();
        };
        let ready = f(ts);
        if ts.is_empty() {
            self.task_sets.remove(&lun);
        }
        ready
    }

    /// Drops the held [`Deferred`] commands `pred` picks, keeping their CmdSNs as used; returns
    /// how many.
    fn abort_held(&mut self, mut pred: impl FnMut(&TaskRef) -> bool) -> usize {
        let mut n = 0;
        for (_, item) in self.window.held_mut() {
            let Ordered::Command(d) = item else { continue };
            let r = TaskRef {
                itt: d.cmd.itt,
                cid: d.conn.cid(),
                lun: d.cmd.lun,
                cmd_sn: d.cmd.cmd_sn,
            };
            if pred(&r) {
                *item = Ordered::Nothing;
                n += 1;
            }
        }
        for _ in 0..n {
            self.window.task_done();
        }
        n
    }

    /// Counts a command about to run without a task (tracked when other readers could deliver
    /// commands or task management meanwhile) and picks its reply connection.
    fn inline_claim(&mut self, lun: u64) -> Inline<C> {
        let tracked = self.conns.len() > 1;
        if tracked {
            self.task_sets.entry(lun).or_default().enter_inline();
            self.inline += 1;
        }
        let reply = if self.asymmetric {
            self.pick_reply(0)
                .and_then(|cid| self.conns.get(&cid).cloned())
        } else {
            None
        };
        Inline { tracked, reply }
    }

    /// Puts an item into the window and admits what became in order. Returns what the caller
    /// runs outside the lock: control requests and held commands.
    fn submit(&mut self, cmd_sn: u32, item: Ordered<C>) -> InOrder<C> {
        let mut out = Vec::new();
        let items = match self.window.submit(cmd_sn, item) {
            Submit::Deliver(items) => items,
            // SCSI commands are checked with takes() first, so only a duplicate or
            // out-of-window control request is dropped here (silently, RFC 7143 4.2.2.1).
            Submit::Held | Submit::Dropped(_) => Vec::new(),
        };
        for it in items {
            match it {
                Ordered::Task(id, itt) => self.admit(Key { id, itt }),
                // A NOP-Out ping is the core's to echo; the others are the caller's.
                Ordered::Control(c, Pdu::NopOut(n)) => self.echo(&c, n),
                Ordered::Control(c, p) => out.push(OrderedRun::Control(c, p)),
                Ordered::Command(d) => {
                    // Its queue slot is given back now; it runs right after the lock is let go.
                    self.window.task_done();
                    let lun = d.cmd.lun;
                    if self
                        .task_sets
                        .get(&lun)
                        .is_some_and(|ts| !ts.admits_simple())
                    {
                        out.push(OrderedRun::Task(d));
                    } else {
                        let claim = self.inline_claim(lun);
                        out.push(OrderedRun::Inline(d, claim));
                    }
                }
                Ordered::Nothing => {}
            }
        }
        out
    }

    /// A task's turn came in CmdSN order: enter its LUN's task set, start it if the set allows.
    fn admit(&mut self, k: Key) {
        let Some((lun, attr)) = self
            .tasks
            .get(&k.itt)
            .filter(|t| t.id == k.id && !t.aborted)
            .map(|t| (t.lun, t.attr))
        else {
            return;
        };
        if self.task_sets.entry(lun).or_default().enter(k, attr) {
            self.turn_came_one(k);
        }
    }

    /// The response connection for a task that moves `bytes`: by the target's response policy,
    /// or round-robin in CID order (thesis 4.3.3: responses spread over connections n+1..2n);
    /// `None` when the session has none.
    fn pick_reply(&mut self, bytes: u64) -> Option<u16> {
        if let Some(rs) = self.reply_sched.as_mut() {
            return pick_reply_by_policy(rs, &self.conns, &self.leaving, &self.tasks, bytes);
        }
        // Round-robin in CID order without collecting the connections: the next CID above the
        // last one picked, or the lowest once past the end. Called once per task in an
        // asymmetric session.
        // Connections at their output budget are skipped while another has room, so that a
        // peer that does not read one response connection does not have replies pile up there.
        let (conns, leaving, last) = (&self.conns, &self.leaving, self.last_reply);
        let next = |skip_full: bool| {
            let responses = || {
                conns
                    .values()
                    .filter(move |c| {
                        c.role() == ConnRole::Responses
                            && !leaving.contains(&c.cid())
                            && !(skip_full && c.full())
                    })
                    .map(|c| c.cid())
            };
            responses()
                .filter(|&cid| last.is_none_or(|l| cid > l))
                .min()
                .or_else(|| responses().min())
        };
        let cid = next(true).or_else(|| next(false))?;
        self.last_reply = Some(cid);
        Some(cid)
    }
}

/// Takes a write's immediate data: its collection state (`None` when the immediate data was all
/// of it) and its data so far. It asks for nothing yet ([`SessionCore::poll_grant`]).
fn start_write(w: NewWrite) -> (Option<Box<Collect>>, Bytes) {
    let transfer = w.transfer;
    if w.refused {
        // Nothing is kept; it waits only for the rest of its unsolicited burst, if any.
        let collect = transfer.unsolicited_open().then(|| {
            Box::new(Collect {
                transfer,
                buf: BytesMut::new(),
                grant: Grant::None,
                received: w.immediate.len() as u64,
                refused: true,
                watch: None,
            })
        });
        return (collect, Bytes::new());
    }
    let imm = transfer.accept_immediate(w.immediate.len() as u32).len as usize;
    if transfer.done() {
        // Everything came as immediate data: handed on without a copy.
        return (None, w.immediate.slice(..imm));
    }
    let want = transfer.want() as usize;
    let unsolicited = (w.first_burst_length as usize).max(imm);
    let mut buf = BytesMut::with_capacity(want.min(unsolicited));
    place(&mut buf, 0, &w.immediate[..imm]);
    let collect = Collect {
        transfer,
        buf,
        grant: Grant::None,
        received: w.immediate.len() as u64,
        refused: false,
        watch: None,
    };
    (Some(Box::new(collect)), Bytes::new())
}

/// The next Target Transfer Tag from `next`, never the reserved value.
fn take_ttt(next: &mut u32) -> u32 {
    let t = *next;
    *next = next.wrapping_add(1);
    if *next == mcsi_proto::pdu::RESERVED_TAG {
        *next = 1;
    }
    t
}

/// Puts `data` at `offset` of a write buffer. Data arrives in offset order, so this appends; a
/// gap (not allowed by the negotiated in-order keys, and refused by [`WriteTransfer`]) would be
/// zero-filled rather than left uninitialised.
fn place(buf: &mut BytesMut, offset: usize, data: &[u8]) {
    let end = offset + data.len();
    if buf.len() < offset {
        buf.resize(offset, 0);
    }
    let overlap = buf.len().min(end) - offset;
    buf[offset..offset + overlap].copy_from_slice(&data[..overlap]);
    buf.extend_from_slice(&data[overlap..]);
}

/// The policy's pick among the usable response connections in CID order. A connection's load
/// is what it still owes: the data of the tasks that reply on it and what its socket holds
/// unsent or unacknowledged; a load-aware policy also sees the socket's TCP state (the target
/// sends the reads, so its delivery rate is the connection's).
fn pick_reply_by_policy<C: CoreConn, T>(
    rs: &mut ReplySched,
    conns: &AHashMap<u16, C>,
    leaving: &ahash::AHashSet<u16>,
    tasks: &AHashMap<u32, Task<T>>,
    bytes: u64,
) -> Option<u16> {
    rs.cids.clear();
    rs.cids.extend(
        conns
            .values()
            .filter(|c| c.role() == ConnRole::Responses && !leaving.contains(&c.cid()))
            .map(|c| c.cid()),
    );
    rs.cids.sort_unstable();
    let wants_tcp = rs.policy.wants_tcp_info();
    rs.loads.clear();
    // Connections at their output budget are not usable while another has room.
    let all_full = rs
        .cids
        .iter()
        .all(|cid| conns.get(cid).is_none_or(|c| c.full()));
    for cid in &rs.cids {
        let tcp = wants_tcp.then(|| rs.samples.get(cid).copied()).flatten();
        let usable = all_full || conns.get(cid).is_some_and(|c| !c.full());
        let in_socket = tcp.map_or(0, |t| {
            u64::from(t.unacked) * u64::from(t.snd_mss) + u64::from(t.notsent_bytes.unwrap_or(0))
        });
        rs.loads.push(mcsi_tcp::sched::ConnLoad {
            usable,
            outstanding_tasks: 0,
            outstanding_bytes: in_socket,
            tcp,
            rate: None,
            peak: None,
            target_tcp: None,
        });
    }
    // The tasks that reply on each connection, in one pass over the task table.
    for t in tasks.values() {
        if let Ok(i) = rs.cids.binary_search(&t.reply_cid) {
            rs.loads[i].outstanding_tasks += 1;
            rs.loads[i].outstanding_bytes += t.bytes;
        }
    }
    let task = mcsi_tcp::sched::TaskInfo {
        bytes,
        write: false,
    };
    let i = rs.policy.pick(&rs.loads, &task)?;
    rs.cids.get(i).copied()
}

/// An Async Message asking the initiator to log out (AsyncEvent 1, RFC 7143 11.9.1) within
/// `within_secs` seconds (Parameter3); the sequence numbers are stamped when it is sent (it
/// takes a StatSN).
fn logout_request_pdu(within_secs: u16) -> Pdu {
    Pdu::AsyncMessage(mcsi_proto::pdu::AsyncMessage {
        lun: 0,
        stat_sn: 0,
        exp_cmd_sn: 0,
        max_cmd_sn: 0,
        async_event: 1,
        async_vcode: 0,
        parameter1: 0,
        parameter2: 0,
        parameter3: within_secs,
        data: bytes::Bytes::new(),
    })
}

/// The connection of the core's unit tests that need only a CID (8 KiB Data-In).
#[cfg(test)]
mod test_conn {
    use super::CoreConn;
    use mcsi_proto::vendor::ConnRole;

    #[derive(Debug, Clone)]
    pub(super) struct Tc(pub(super) u16);

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
            8192
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::R2tPlan;
    use bytes::Bytes;
    use mcsi_proto::pdu::{ScsiCommand, TaskAttr, RESERVED_TAG};
    use TaskAttribute::{Ordered as Ord_, Simple};

    /// A connection as the tests see it: a CID, a role, and which connection of that CID.
    #[derive(Clone)]
    struct C {
        cid: u16,
        role: ConnRole,
        generation: u32,
        /// Its output queue at the budget (shared by every handle of it).
        full: std::rc::Rc<std::cell::Cell<bool>>,
    }

    impl CoreConn for C {
        fn cid(&self) -> u16 {
            self.cid
        }
        fn role(&self) -> ConnRole {
            self.role
        }
        fn same(&self, other: &Self) -> bool {
            self.cid == other.cid && self.generation == other.generation
        }
        fn max_data_in(&self) -> u32 {
            8192
        }
        fn full(&self) -> bool {
            self.full.get()
        }
    }

    fn conn(cid: u16, role: ConnRole) -> C {
        C {
            cid,
            role,
            generation: 1,
            full: Default::default(),
        }
    }

    /// What the tests attach to a task: whether it was told to stop.
    #[derive(Default)]
    struct Io {
        aborted: bool,
    }

    type Core = SessionCore<C, Io>;

    fn core(conns: &[&C]) -> Core {
        let mut c = Core::new(1, 8, false, None);
        for x in conns {
            assert!(c.add_conn((*x).clone()).is_ok());
        }
        c
    }

    fn task(itt: u32, cmd_sn: u32, attr: TaskAttribute) -> NewTask {
        NewTask {
            id: u64::from(itt) + 1000,
            itt,
            lun: 0,
            cmd_sn,
            immediate: false,
            attr,
            bytes: 4096,
            answer: None,
        }
    }

    fn register(core: &mut Core, on: &C, t: NewTask) -> (RegisterOutcome, InOrder<C>) {
        let (reg, runs) = core.register(on, t, None, Io::default());
        assert_eq!(core.poll_grant(), None);
        (reg, runs)
    }

    /// Grants every write that asks, as a budget with room would: their first R2Ts.
    fn grant_all(core: &mut Core) -> Vec<R2tPlan> {
        while let Some(g) = core.poll_grant() {
            assert!(core.grant(g.itt, g.id), "a live write");
        }
        queued_r2ts(core)
    }

    /// The R2Ts the core queued since last asked ([`SessionCore::poll_transmit`]).
    fn queued_r2ts(core: &mut Core) -> Vec<R2tPlan> {
        std::iter::from_fn(|| core.poll_transmit())
            .filter_map(|(_, p)| match p {
                Pdu::R2t(r) => Some(R2tPlan {
                    ttt: r.ttt,
                    r2t_sn: r.r2t_sn,
                    offset: r.buffer_offset,
                    len: r.desired_data_transfer_length,
                }),
                _ => None,
            })
            .collect()
    }

    /// The ITTs of the tasks whose turn came, in the order they came.
    fn ready(core: &mut Core) -> Vec<u32> {
        std::iter::from_fn(|| core.poll_ready().map(|r| r.itt)).collect()
    }

    fn finish(core: &mut Core, itt: u32, on: &C) -> Finished<C, Io> {
        let id = core.task(itt).expect("task registered").id;
        core.finish(itt, id, on, None).expect("task finished")
    }

    fn deferred(on: &C, itt: u32, cmd_sn: u32) -> Deferred<C> {
        Deferred {
            conn: on.clone(),
            cmd: ScsiCommand {
                immediate: false,
                final_: true,
                read: true,
                write: false,
                attr: TaskAttr::Simple,
                lun: 0,
                itt,
                expected_data_transfer_length: 4096,
                cmd_sn,
                exp_stat_sn: 0,
                cdb: Bytes::from_static(&[0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0]),
                bidi_read_length: None,
                data: Bytes::new(),
            },
            phase: mcsi_scsi::DataPhase {
                data_out_len: 0,
                data_in_len: 4096,
            },
            transfer: None,
            room: None,
        }
    }

    /// A finished task's Data-In and status come out of `poll_transmit`, cut by its reply
    /// connection's MaxRecvDataSegmentLength; an aborted one's never do.
    #[test]
    fn a_finished_task_gets_its_final_pdus_and_an_aborted_one_none() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        for itt in [1, 2] {
            let d = deferred(&a, itt, itt);
            let t = NewTask {
                answer: Some(Box::new(Answer {
                    cmd: ScsiCommand {
                        expected_data_transfer_length: 16384,
                        ..d.cmd
                    },
                    phase: mcsi_scsi::DataPhase {
                        data_out_len: 0,
                        data_in_len: 16384,
                    },
                })),
                ..task(itt, itt, Simple)
            };
            assert_eq!(register(&mut core, &a, t).0, RegisterOutcome::Ok);
        }
        assert_eq!(ready(&mut core), vec![1, 2]);
        let good = || Some(mcsi_scsi::Outcome::good(Bytes::from(vec![7u8; 16384])));
        core.abort_where(|t| t.itt == 2, |_| ());
        for itt in [1, 2] {
            let id = core.task(itt).expect("running").id;
            core.finish(itt, id, &a, good()).expect("finished");
        }
        let sent: Vec<(u16, Pdu)> = std::iter::from_fn(|| core.poll_transmit())
            .map(|(c, p)| (c.cid, p))
            .collect();
        // 16 KiB at 8 KiB per Data-In, status in the last (phase collapse), all for task 1.
        assert_eq!(sent.len(), 2, "{sent:?}");
        assert!(sent.iter().all(|(cid, p)| *cid == 1
            && matches!(p, Pdu::DataIn(d) if d.itt == 1 && d.data.len() == 8192)));
        assert!(matches!(&sent[1].1, Pdu::DataIn(d) if d.status.is_some()));
    }

    /// The ITTs of held commands that came up to run inline, and whether each is tracked.
    fn inline(runs: &InOrder<C>) -> Vec<(u32, bool)> {
        runs.iter()
            .filter_map(|r| match r {
                OrderedRun::Inline(d, i) => Some((d.cmd.itt, i.tracked)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_cmdsn_gap_left_by_one_connection_is_filled_late_by_another() {
        let (a, b) = (conn(1, ConnRole::Both), conn(2, ConnRole::Both));
        let mut core = core(&[&a, &b]);
        // Connection 2 delivers CmdSN 2, 3 (tasks) and 4 (a command without a task) before
        // connection 1 delivers CmdSN 1: nothing may start.
        assert_eq!(
            register(&mut core, &b, task(20, 2, Simple)).0,
            RegisterOutcome::Ok
        );
        assert_eq!(
            register(&mut core, &b, task(21, 3, Simple)).0,
            RegisterOutcome::Ok
        );
        assert!(matches!(core.claim(40, 0, 4, false), ClaimOutcome::Wait));
        let HoldOutcome::InOrder(runs) = core.hold(Box::new(deferred(&b, 40, 4))) else {
            panic!("the command should be held")
        };
        assert!(runs.is_empty());
        assert_eq!(ready(&mut core), Vec::<u32>::new());
        assert_eq!(core.held(), 3);
        assert_eq!(core.cmd_sns().0, 1, "ExpCmdSN waits for the gap");
        // CmdSN 1 arrives: everything runs, in CmdSN order; the held command on the reader
        // that filled the gap, tracked because another reader could meanwhile deliver more.
        let (reg, runs) = register(&mut core, &a, task(10, 1, Simple));
        assert_eq!(reg, RegisterOutcome::Ok);
        assert_eq!(ready(&mut core), vec![10, 20, 21]);
        assert_eq!(inline(&runs), vec![(40, true)]);
        assert_eq!(core.held(), 0);
        // Three tasks hold queue slots (the inline command gave its slot back): MaxCmdSN =
        // ExpCmdSN - 1 + 8 - 3.
        assert_eq!(core.cmd_sns(), (5, 9));
        assert_eq!(core.inline_running(), 1);
        assert!(core.release_inline(0), "no inline command left");
        // Each task is handed out once.
        assert_eq!(ready(&mut core), Vec::<u32>::new());
        // Tasks reply on the connection their command came on.
        assert_eq!(finish(&mut core, 20, &b).out.cid, 2);
        assert_eq!(finish(&mut core, 10, &a).out.cid, 1);
    }

    #[test]
    fn a_command_in_order_on_a_single_connection_runs_at_once_untracked() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        let ClaimOutcome::Now(i) = core.claim(1, 0, 1, false) else {
            panic!("CmdSN 1 is next")
        };
        assert!(!i.tracked && i.reply.is_none());
        assert_eq!(core.cmd_sns().0, 2);
        // The next CmdSN but one waits; an immediate command does not.
        assert!(matches!(core.claim(2, 0, 3, false), ClaimOutcome::Wait));
        assert!(matches!(core.claim(3, 0, 99, true), ClaimOutcome::Now(_)));
    }

    #[test]
    fn commands_outside_the_window_and_duplicates_are_dropped() {
        let (a, b) = (conn(1, ConnRole::Both), conn(2, ConnRole::Both));
        let mut core = core(&[&a, &b]);
        // The window is [1, 8].
        assert_eq!(
            register(&mut core, &a, task(1, 9, Simple)).0,
            RegisterOutcome::OutOfWindow
        );
        assert_eq!(
            register(&mut core, &a, task(2, 3, Simple)).0,
            RegisterOutcome::Ok
        );
        assert_eq!(
            register(&mut core, &b, task(3, 3, Simple)).0,
            RegisterOutcome::OutOfWindow,
            "a duplicate of a held CmdSN"
        );
        assert!(matches!(
            core.hold(Box::new(deferred(&b, 4, 3))),
            HoldOutcome::Dropped(_)
        ));
        assert!(matches!(
            core.hold(Box::new(deferred(&b, 4, 0))),
            HoldOutcome::Dropped(_)
        ));
        assert_eq!(core.task_count(), 1);
        // An immediate command skips the window and still enters its task set.
        let mut imm = task(5, 1000, Simple);
        imm.immediate = true;
        assert_eq!(register(&mut core, &a, imm).0, RegisterOutcome::Ok);
        assert_eq!(ready(&mut core), vec![5]);
        assert_eq!(core.cmd_sns().0, 1);
    }

    #[test]
    fn an_itt_in_use_is_refused_and_its_cmdsn_consumed() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        assert_eq!(
            register(&mut core, &a, task(7, 1, Simple)).0,
            RegisterOutcome::Ok
        );
        assert_eq!(
            register(&mut core, &a, task(7, 2, Simple)).0,
            RegisterOutcome::IttInUse
        );
        assert_eq!(core.cmd_sns().0, 3, "CmdSN 2 is used up, so 3 is not held");
        assert_eq!(
            register(&mut core, &a, task(8, 3, Simple)).0,
            RegisterOutcome::Ok
        );
        assert_eq!(ready(&mut core), vec![7, 8]);
        // A command whose ITT is a running task's needs a task of its own (to be refused).
        assert!(matches!(core.claim(7, 0, 4, false), ClaimOutcome::Task));
    }

    #[test]
    fn an_ordered_task_waits_for_those_before_it_and_holds_back_those_after() {
        let (a, b) = (conn(1, ConnRole::Both), conn(2, ConnRole::Both));
        let mut core = core(&[&a, &b]);
        register(&mut core, &a, task(1, 1, Simple));
        register(&mut core, &b, task(2, 2, Ord_));
        register(&mut core, &a, task(3, 3, Simple));
        assert_eq!(ready(&mut core), vec![1]);
        // A SIMPLE command may not run inline past a pending ORDERED one.
        assert!(matches!(core.claim(4, 0, 4, false), ClaimOutcome::Task));
        finish(&mut core, 1, &a);
        assert_eq!(ready(&mut core), vec![2]);
        finish(&mut core, 2, &b);
        assert_eq!(ready(&mut core), vec![3]);
        // A held command whose turn comes while an ORDERED task is pending becomes a task.
        register(&mut core, &a, task(5, 5, Ord_));
        let HoldOutcome::InOrder(runs) = core.hold(Box::new(deferred(&b, 6, 6))) else {
            panic!("held")
        };
        assert!(runs.is_empty());
        let (_, runs) = core.submit_ordered(4, Ordered::Nothing);
        assert!(matches!(runs.as_slice(), [OrderedRun::Task(d)] if d.cmd.itt == 6));
    }

    #[test]
    fn task_management_aborts_running_tasks_and_held_commands() {
        let (a, b) = (conn(1, ConnRole::Both), conn(2, ConnRole::Both));
        let mut core = core(&[&a, &b]);
        register(&mut core, &a, task(10, 1, Simple));
        assert_eq!(ready(&mut core), vec![10]);
        // CmdSN 2 is missing; 3 (held command) and 4 (task) wait for it; 5 is another LUN.
        let HoldOutcome::InOrder(_) = core.hold(Box::new(deferred(&b, 30, 3))) else {
            panic!("held")
        };
        register(&mut core, &b, task(31, 4, Simple));
        let mut other_lun = task(32, 5, Simple);
        other_lun.lun = 1;
        register(&mut core, &b, other_lun);
        // ABORT TASK SET on LUN 0.
        let mut told = 0;
        let found = core.abort_where(
            |t| t.lun == 0,
            |io| {
                io.aborted = true;
                told += 1;
            },
        );
        assert_eq!(found, 3, "two tasks and one held command");
        assert_eq!(told, 2, "the tasks are told to stop");
        // The running one stays until its end; the one waiting for its turn ended at once.
        assert!(core.task(10).is_some_and(|t| t.aborted));
        assert!(core.task(31).is_none());
        assert!(core.task(32).is_some_and(|t| !t.aborted));
        // The gap fills: the aborted held command does not run, the aborted task does not start,
        // the other LUN's task does.
        let (taken, runs) = core.submit_ordered(2, Ordered::Nothing);
        assert!(taken);
        assert!(runs.is_empty());
        assert_eq!(ready(&mut core), vec![32]);
        assert_eq!(core.cmd_sns().0, 6);
        // An aborted running task still leaves the table at its end, and sends nothing.
        let f = finish(&mut core, 10, &a);
        assert!(f.aborted && f.io.aborted);
        assert!(!finish(&mut core, 32, &b).aborted);
        assert_eq!(core.task_count(), 0);
        // Every queue slot is free again: MaxCmdSN = ExpCmdSN - 1 + 8.
        assert_eq!(core.cmd_sns(), (6, 13));
    }

    #[test]
    fn a_lost_connection_ends_its_tasks_and_the_session_goes_on() {
        let (a, b) = (conn(1, ConnRole::Both), conn(2, ConnRole::Both));
        let mut core = core(&[&a, &b]);
        register(&mut core, &a, task(10, 1, Simple));
        register(&mut core, &b, task(20, 2, Simple));
        assert_eq!(ready(&mut core), vec![10, 20]);
        let HoldOutcome::InOrder(_) = core.hold(Box::new(deferred(&a, 11, 4))) else {
            panic!("held")
        };
        register(&mut core, &b, task(21, 5, Simple));
        // Connection 1 is replaced under the same CID before the old one is seen to end: the
        // new one stays; the old one's tasks (by CID) are aborted.
        let a2 = C {
            generation: 2,
            ..a.clone()
        };
        let old = core.add_conn(a2.clone()).ok().flatten();
        assert!(old.is_some_and(|old| old.same(&a)));
        // The caller aborts the old connection's tasks at once; when its reader then ends, the
        // new connection and the tasks of its CID stay.
        let mut told = Vec::new();
        core.abort_where(
            |t| t.cid == 1,
            |io| {
                io.aborted = true;
                told.push(());
            },
        );
        assert_eq!(told.len(), 1);
        register(&mut core, &a2, task(12, 3, Simple));
        // Its end is clean (it was replaced) and the session goes on.
        assert_eq!(
            core.conn_lost(&a, |_| panic!("nothing of the old one is left")),
            ConnLost {
                clean: true,
                remaining: 2,
                session_ends: false
            }
        );
        assert!(core.conn(1).is_some_and(|c| c.same(&a2)));
        assert!(core.task(10).is_some_and(|t| t.aborted));
        assert!(core.task(12).is_some_and(|t| !t.aborted));
        assert!(core.task(20).is_some_and(|t| !t.aborted));
        // CmdSN 3 filled the gap: the new connection's task and connection 2's run, the old
        // connection's held command not.
        assert_eq!(ready(&mut core), vec![12, 21]);
        // The new connection is lost with a task in flight: it is aborted; it failed, so at
        // ErrorRecoveryLevel 0 the session ends (the layer above closes it).
        // (Every task of the CID is told, the old connection's aborted one again: the caller
        // waits for both to end.)
        let mut told = 0;
        assert_eq!(
            core.conn_lost(&a2, |_| told += 1),
            ConnLost {
                clean: false,
                remaining: 1,
                session_ends: true
            }
        );
        assert_eq!(told, 2);
        assert!(core.task(12).is_some_and(|t| t.aborted));
        assert_eq!(core.conn_lost(&b, |_| {}).remaining, 0);
        // A closing session takes no connection.
        core.close(|_| {});
        assert!(core.add_conn(conn(3, ConnRole::Both)).is_err());
    }

    #[test]
    fn asymmetric_replies_go_round_robin_and_move_off_a_connection_logging_out() {
        let cmds = conn(1, ConnRole::Requests);
        let (r2, r3) = (conn(2, ConnRole::Responses), conn(3, ConnRole::Responses));
        let mut core = Core::new(1, 8, true, None);
        for c in [&cmds, &r2, &r3] {
            assert!(core.add_conn(c.clone()).is_ok());
        }
        for itt in 1..=4 {
            register(&mut core, &cmds, task(itt, itt, Simple));
        }
        let picks: Vec<u16> = (1..=4)
            .map(|itt| core.task(itt).map_or(0, |t| t.reply_cid))
            .collect();
        assert_eq!(picks, vec![2, 3, 2, 3]);
        // Inline commands take their turn in the same rotation.
        let ClaimOutcome::Now(i) = core.claim(9, 0, 5, false) else {
            panic!("in order")
        };
        assert_eq!(i.reply.map(|c| c.cid), Some(2));
        // Connection 2 logs out: its tasks' replies move to connection 3, and new tasks avoid it.
        core.leave(&r2);
        assert!(core.ends_cleanly(&r2) && !core.ends_cleanly(&r3));
        assert_eq!(core.reply_conn(1, &cmds).cid, 3);
        assert_eq!(core.task(1).map(|t| t.reply_cid), Some(3));
        assert_eq!(finish(&mut core, 3, &cmds).out.cid, 3);
        register(&mut core, &cmds, task(5, 6, Simple));
        assert_eq!(core.task(5).map(|t| t.reply_cid), Some(3));
        // Its end is clean: the session goes on.
        let lost = core.conn_lost(&r2, |_| {});
        assert!(lost.clean && !lost.session_ends && lost.remaining == 2);
        // With no response connection left, replies fall back to the command's connection.
        core.leave(&r3);
        assert_eq!(core.reply_conn(4, &cmds).cid, 1);
        // A connection that left and comes back under its CID (a new login) is usable again.
        let r3b = C {
            generation: 2,
            ..r3.clone()
        };
        assert!(core.add_conn(r3b.clone()).is_ok());
        assert!(!core.ends_cleanly(&r3b) && core.ends_cleanly(&r3));
        register(&mut core, &cmds, task(6, 7, Simple));
        assert_eq!(core.task(6).map(|t| t.reply_cid), Some(3));
    }

    #[test]
    fn replies_skip_response_connections_at_their_budget_while_another_has_room() {
        let cmds = conn(1, ConnRole::Requests);
        let (r2, r3) = (conn(2, ConnRole::Responses), conn(3, ConnRole::Responses));
        for policy in [None, Some("least-outstanding")] {
            let sched = policy.map(|p| mcsi_tcp::sched::policy(p).expect("a policy"));
            let mut core = Core::new(1, 8, true, sched);
            for c in [&cmds, &r2, &r3] {
                assert!(core.add_conn(c.clone()).is_ok());
            }
            r2.full.set(true);
            for itt in 1..=3 {
                register(&mut core, &cmds, task(itt, itt, Simple));
            }
            let picks: Vec<u16> = (1..=3)
                .map(|itt| core.task(itt).map_or(0, |t| t.reply_cid))
                .collect();
            assert_eq!(picks, vec![3, 3, 3], "{policy:?}");
            // When every one is full, replies still go somewhere (the reader has stopped).
            r3.full.set(true);
            register(&mut core, &cmds, task(4, 4, Simple));
            assert!(core
                .task(4)
                .is_some_and(|t| t.reply_cid == 2 || t.reply_cid == 3));
            r2.full.set(false);
            r3.full.set(false);
        }
    }

    #[test]
    fn a_load_aware_response_policy_follows_the_samples_it_is_fed() {
        let cmds = conn(1, ConnRole::Requests);
        let (r2, r3) = (conn(2, ConnRole::Responses), conn(3, ConnRole::Responses));
        let sched = mcsi_tcp::sched::policy("tcp-aware").ok();
        let mut core = Core::new(1, 8, true, sched);
        assert!(core.wants_tcp_samples());
        for c in [&cmds, &r2, &r3] {
            assert!(core.add_conn(c.clone()).is_ok());
        }
        // Both sockets move 1 MB/s in 10 ms round trips; connection 2 has 4 MB waiting in its
        // socket, connection 3 nothing: replies go to 3.
        let sample = |unsent: u32| mcsi_tcp::TcpState {
            rtt_us: 10_000,
            snd_mss: 1448,
            delivery_rate: Some(1_000_000),
            notsent_bytes: Some(unsent),
            ..Default::default()
        };
        core.handle_tcp_sample(2, sample(4_000_000));
        core.handle_tcp_sample(3, sample(0));
        register(&mut core, &cmds, task(1, 1, Simple));
        assert_eq!(core.task(1).map(|t| t.reply_cid), Some(3));
        // The next samples say the opposite.
        core.handle_tcp_sample(2, sample(0));
        core.handle_tcp_sample(3, sample(4_000_000));
        register(&mut core, &cmds, task(2, 2, Simple));
        assert_eq!(core.task(2).map(|t| t.reply_cid), Some(2));
        // Round-robin asks for none.
        assert!(!Core::new(1, 8, true, None).wants_tcp_samples());
    }

    #[test]
    fn immediate_commands_are_bounded_and_task_sets_do_not_outlive_their_tasks() {
        let a = conn(1, ConnRole::Both);
        // Queue depth 8: at most 16 tasks, immediate ones answered TASK SET FULL beyond that.
        let mut core = core(&[&a]);
        for itt in 0..16u32 {
            let t = NewTask {
                immediate: true,
                lun: u64::from(itt) << 48,
                ..task(itt, 1, Simple)
            };
            assert_eq!(
                register(&mut core, &a, t).0,
                RegisterOutcome::Ok,
                "task {itt}"
            );
        }
        let t = NewTask {
            immediate: true,
            ..task(99, 1, Simple)
        };
        assert_eq!(register(&mut core, &a, t).0, RegisterOutcome::TaskSetFull);
        // Every task on a LUN of its own, as a peer may choose: one set each while they run,
        // none once they ended.
        assert_eq!(core.task_sets.len(), 16);
        assert_eq!(ready(&mut core).len(), 16);
        for itt in 0..16u32 {
            finish(&mut core, itt, &a);
        }
        assert!(core.task_sets.is_empty());
        assert_eq!(core.task_count(), 0);
        let t = NewTask {
            immediate: true,
            ..task(99, 1, Simple)
        };
        assert_eq!(
            register(&mut core, &a, t).0,
            RegisterOutcome::Ok,
            "room again"
        );
    }

    #[test]
    fn a_connection_failing_before_it_carried_anything_takes_the_session_only_when_alone() {
        let (a, b) = (conn(1, ConnRole::Both), conn(2, ConnRole::Both));
        let mut core = core(&[&a, &b]);
        core.fail_alone(&b);
        let lost = core.conn_lost(&b, |_| {});
        assert!(lost.clean && !lost.session_ends && lost.remaining == 1);
        core.fail_alone(&a);
        let lost = core.conn_lost(&a, |_| {});
        assert!(!lost.clean && lost.session_ends && lost.remaining == 0);
    }

    #[test]
    fn a_closed_session_takes_nothing_more() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        register(&mut core, &a, task(1, 1, Simple));
        let HoldOutcome::InOrder(_) = core.hold(Box::new(deferred(&a, 2, 3))) else {
            panic!("held")
        };
        let mut told = 0;
        let (conns, first) = core.close(|io| {
            io.aborted = true;
            told += 1;
        });
        assert!(first);
        assert_eq!(conns.len(), 1);
        assert_eq!(told, 1);
        assert_eq!(core.held(), 0);
        assert!(!core.close(|_| {}).1, "closed once");
        assert_eq!(
            register(&mut core, &a, task(3, 2, Simple)).0,
            RegisterOutcome::Closing
        );
        assert!(matches!(core.claim(4, 0, 2, false), ClaimOutcome::Task));
        // It had not been handed out to run: it ended with the close.
        assert!(core.task(1).is_none());
    }

    #[test]
    fn write_data_is_placed_in_order_without_zeroing_first() {
        let mut b = BytesMut::with_capacity(16);
        place(&mut b, 0, b"abcd");
        place(&mut b, 4, b"efgh");
        assert_eq!(&b[..], b"abcdefgh");
        // A repeated range overwrites; a gap is zero-filled.
        place(&mut b, 2, b"XYZ");
        place(&mut b, 10, b"kl");
        assert_eq!(&b[..], b"abXYZfgh\0\0kl");
    }

    fn burst(max_outstanding_r2t: u32) -> crate::transfer::BurstParams {
        crate::transfer::BurstParams {
            initial_r2t: false,
            immediate_data: true,
            first_burst_length: 8,
            max_burst_length: 16,
            max_outstanding_r2t,
        }
    }

    /// A write of `len` bytes whose first `imm` came as immediate data, F bit set (no
    /// unsolicited Data-Out).
    fn write(len: u32, imm: &'static [u8], params: crate::transfer::BurstParams) -> NewWrite {
        NewWrite {
            transfer: WriteTransfer::new(params, len, len, imm.len() as u32, true).expect("valid"),
            immediate: Bytes::from_static(imm),
            first_burst_length: params.first_burst_length,
            refused: false,
            room: None,
        }
    }

    /// A write of `len` bytes under [`burst`]`(1)` (FirstBurstLength 8) whose first `imm` came as
    /// immediate data, with the command's F bit `final_` (false: unsolicited Data-Out follows).
    fn burst_write(len: u32, imm: &'static [u8], final_: bool, refused: bool) -> NewWrite {
        NewWrite {
            transfer: WriteTransfer::new(burst(1), len, len, imm.len() as u32, final_)
                .expect("valid"),
            immediate: Bytes::from_static(imm),
            first_burst_length: 8,
            refused,
            room: None,
        }
    }

    fn data_out(
        itt: u32,
        ttt: u32,
        data_sn: u32,
        offset: u32,
        data: &[u8],
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
            data: Bytes::copy_from_slice(data),
        }
    }

    /// The (offset, length) of each R2T.
    fn spans(r2ts: &[R2tPlan]) -> Vec<(u32, u32)> {
        r2ts.iter().map(|r| (r.offset, r.len)).collect()
    }

    /// A session paced toward storage, on virtual time: an initiator that answers every R2T
    /// at once gets its data asked for at the bucket's rate, one R2T at a time, the waiting
    /// writes in turn; a write whose R2T waits for the bucket is owed nothing, so the Data-Out
    /// timer leaves it alone; a PDU no R2T asked for costs the bucket too.
    #[test]
    fn r2ts_are_paced_by_the_bandwidth_toward_storage_on_passed_in_time() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        let t0 = Instant::now();
        let (rate, burst_bytes, mss) = (10_000u64, 1000u64, 1448u32);
        core.set_storage_pacer(crate::qos::StoragePacer::new(
            rate,
            burst_bytes,
            mss,
            8192,
            t0,
        ));
        core.set_data_out_timeout(Duration::from_secs(1));
        let params = crate::transfer::BurstParams {
            initial_r2t: true,
            immediate_data: false,
            first_burst_length: 8,
            max_burst_length: 1000,
            max_outstanding_r2t: 4,
        };
        for itt in 1..=3 {
            let (reg, _) = core.register(
                &a,
                task(itt, itt, Simple),
                Some(write(10_000, b"", params)),
                Io::default(),
            );
            assert_eq!(reg, RegisterOutcome::Ok);
        }
        // The initiator answers each R2T at once; the time moves to the core's next timeout.
        let mut now = t0;
        let mut r2ts = grant_all(&mut core);
        let mut issued: Vec<(Duration, u32)> = Vec::new();
        let mut counts = [0u32; 4];
        let mut done = Vec::new();
        loop {
            for r in r2ts.drain(..) {
                // One R2T's worth of wire bytes (1000 data + 48 header + 58 per frame) each.
                assert_eq!(r.len, 1000);
                let itt = (1..=3)
                    .find(|&i| owns(&core, i, r.ttt))
                    .expect("an R2T of a live write");
                issued.push((now - t0, itt));
                counts[itt as usize] += 1;
                let d = data_out(itt, r.ttt, 0, r.offset, &[7; 1000], true);
                assert_eq!(core.data_out(1, &d), DataOutcome::Taken);
            }
            let spread = counts[1..].iter().max().unwrap() - counts[1..].iter().min().unwrap();
            assert!(spread <= 2, "the writes take turns: {counts:?}");
            done.extend(ready(&mut core));
            r2ts = queued_r2ts(&mut core);
            if !r2ts.is_empty() {
                continue;
            }
            let Some(t) = core.poll_timeout() else { break };
            assert!(t >= now, "time runs forward");
            now = t;
            core.advance(now);
            let expired = core.handle_timeout(now);
            assert!(expired.is_empty(), "nothing owed times out: {expired:?}");
            r2ts = queued_r2ts(&mut core);
            if core.poll_timeout().is_none() && r2ts.is_empty() {
                break;
            }
        }
        done.sort();
        assert_eq!(done, vec![1, 2, 3], "every write got all of its data");
        assert_eq!(issued.len(), 30);
        // 30 R2Ts of 1106 wire bytes, the first 1000 bytes free: the last goes out when the
        // other 32,180 bytes have been paid for at 10,000 B/s, less one R2T's deficit.
        let last = issued.last().unwrap().0.as_secs_f64();
        let want = (30.0 * 1106.0 - 1000.0 - 1106.0) / rate as f64;
        assert!(
            (last - want).abs() < 0.01,
            "last R2T at {last} s, want {want}"
        );
        // Never faster than the rate: by each R2T, at most a burst more than the rate allows.
        for (k, (t, _)) in issued.iter().enumerate() {
            let allowed = burst_bytes as f64 + rate as f64 * t.as_secs_f64();
            assert!(k as f64 * 1106.0 <= allowed + 1e-6, "R2T {k} at {t:?}");
        }

        // A PDU no R2T asked for (a 50,000-byte command with its immediate data): the bucket
        // waits 5 s and more before the next R2T or read.
        core.charge_storage(50_000);
        let wait = core.storage_ready_at().expect("a deficit") - now;
        assert!(wait >= Duration::from_secs(5), "{wait:?}");
        // R2Ts ask for no more than the bucket's burst (4 KiB at least), below MaxBurstLength.
        let wide = crate::transfer::BurstParams {
            max_burst_length: 8192,
            ..params
        };
        let (reg, _) = core.register(
            &a,
            task(4, 4, Simple),
            Some(write(10_000, b"", wide)),
            Io::default(),
        );
        assert_eq!(reg, RegisterOutcome::Ok);
        assert!(
            grant_all(&mut core).is_empty(),
            "the R2T waits for the bucket"
        );
        let t = core.poll_timeout().expect("a timeout for the paced R2T");
        assert_eq!(t, now + wait);
        core.handle_timeout(t - Duration::from_millis(1));
        assert!(queued_r2ts(&mut core).is_empty(), "not before its time");
        core.handle_timeout(t);
        assert_eq!(spans(&queued_r2ts(&mut core)), vec![(0, 4096)]);
    }

    /// A peer that sends Data-Out naming R2Ts it was never sent (an unknown task, a TTT no R2T
    /// carried) pays for it: the core charges what it does not take as part of an R2T.
    #[test]
    fn data_out_no_r2t_asked_for_costs_the_bucket_toward_storage() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        let t0 = Instant::now();
        core.set_storage_pacer(crate::qos::StoragePacer::new(10_000, 1000, 1448, 8192, t0));
        assert_eq!(core.storage_ready_at(), None);
        // 20 Data-Out of 952 bytes (1000 with the header, 1058 on the wire) for no task.
        for n in 0..20 {
            let d = data_out(77, 0x1234, n, n * 952, &[0; 952], false);
            assert_eq!(core.data_out(1, &d), DataOutcome::Discarded);
        }
        let wait = core.storage_ready_at().expect("in deficit") - t0;
        let want = (20.0 * 1058.0 - 1000.0) / 10_000.0;
        assert!((wait.as_secs_f64() - want).abs() < 1e-3, "{wait:?}");
        // Unsolicited ones (TTT 0xffffffff) are the reader's to charge, not the core's.
        let d = data_out(77, RESERVED_TAG, 0, 0, &[0; 952], false);
        core.data_out(1, &d);
        assert_eq!(core.storage_ready_at().map(|t| t - t0), Some(wait));
    }

    /// Whether R2T `ttt` is one of write `itt`'s open sequences.
    fn owns(core: &Core, itt: u32, ttt: u32) -> bool {
        core.tasks
            .get(&itt)
            .and_then(|t| t.collect.as_ref())
            .is_some_and(|c| c.transfer.open_ttts().any(|x| x == ttt))
    }

    /// The Data-Out timer on virtual time: quiet while a write waits for its budget, then a
    /// write whose initiator sends nothing is given up between one and one and a half timeouts
    /// after its last Data-Out; data that comes puts the timer back.
    #[test]
    fn a_write_that_receives_nothing_it_is_owed_times_out_on_passed_in_time() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        let timeout = Duration::from_secs(4);
        core.set_data_out_timeout(timeout);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(core.poll_timeout(), None, "nothing to watch");
        let (reg, _) = core.register(
            &a,
            task(1, 1, Simple),
            Some(write(40, b"abcd", burst(2))),
            Io::default(),
        );
        assert_eq!(reg, RegisterOutcome::Ok);
        assert!(core.take_timer_wake(), "the sleeping timer is woken once");
        assert!(!core.take_timer_wake());
        // Drive the timer as a layer above does, to `until`: what timed out, and when.
        let run = |core: &mut Core, from: u64, until: u64| -> Vec<(u64, DataOutTimedOut)> {
            let mut fired = Vec::new();
            let mut now = at(from);
            while now <= at(until) {
                for f in core.handle_timeout(now) {
                    let Expired::DataOut(f) = f else {
                        panic!("no keepalive here: {f:?}")
                    };
                    fired.push(((now - t0).as_millis() as u64, f));
                }
                match core.poll_timeout() {
                    Some(next) => {
                        assert!(next > now);
                        now = next;
                    }
                    None => break,
                }
            }
            fired
        };
        // Waiting for its budget: nothing owed, however long.
        assert!(run(&mut core, 0, 20_000).is_empty());
        let g = core.poll_grant().expect("a grant request");
        assert!(core.grant(g.itt, g.id));
        let r2ts = queued_r2ts(&mut core);
        // Granted at 20 s; one Data-Out at 22 s, then nothing.
        assert!(run(&mut core, 20_000, 22_000).is_empty());
        let d = data_out(1, r2ts[0].ttt, 0, 4, &[b'e'; 8], false);
        assert!(matches!(core.data_out(1, &d), DataOutcome::Taken));
        let fired = run(&mut core, 22_000, 40_000);
        let (when, first) = fired.first().copied().expect("timed out");
        assert_eq!(
            first,
            DataOutTimedOut {
                cid: 1,
                itt: 1,
                received: 12,
                timeout
            }
        );
        assert!((26_000..=28_000).contains(&when), "given up at {when} ms");
        // Once the task leaves, nothing is watched and the timer sleeps.
        let _ = core.abort_where(|_| true, |_| ());
        assert!(run(&mut core, 40_000, 50_000).is_empty());
        assert_eq!(core.poll_timeout(), None);
    }

    #[test]
    fn r2ts_follow_max_outstanding_r2t_and_the_task_runs_with_all_of_its_data() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        // 40 bytes: 4 immediate, then R2Ts of at most MaxBurstLength 16, two at a time.
        let (reg, _) = core.register(
            &a,
            task(1, 1, Simple),
            Some(write(40, b"abcd", burst(2))),
            Io::default(),
        );
        assert_eq!(reg, RegisterOutcome::Ok);
        // Its turn came at once: it asks for the whole write's budget, and R2Ts go out once
        // granted.
        let g = core.poll_grant().expect("a grant request");
        assert_eq!((g.itt, g.bytes), (1, 40));
        assert_eq!(core.poll_grant(), None, "asked once");
        let waiting = core.collecting(1, g.id).expect("collecting");
        assert!(waiting.waiting_for_grant);
        assert!(core.grant(g.itt, g.id));
        let r2ts: Vec<(C, Pdu)> = std::iter::from_fn(|| core.poll_transmit()).collect();
        assert!(r2ts
            .iter()
            .all(|(c, p)| c.same(&a) && matches!(p, Pdu::R2t(r) if r.lun == 0 && r.itt == 1)));
        let r2ts: Vec<R2tPlan> = r2ts
            .into_iter()
            .filter_map(|(_, p)| match p {
                Pdu::R2t(r) => Some(R2tPlan {
                    ttt: r.ttt,
                    r2t_sn: r.r2t_sn,
                    offset: r.buffer_offset,
                    len: r.desired_data_transfer_length,
                }),
                _ => None,
            })
            .collect();
        assert_eq!(spans(&r2ts), vec![(4, 16), (20, 16)]);
        assert_eq!(
            r2ts.iter().map(|r| r.r2t_sn).collect::<Vec<_>>(),
            vec![0, 1]
        );
        // Its turn came, but its data has not: it does not run yet.
        assert!(ready(&mut core).is_empty());
        let (t0, t1) = (r2ts[0].ttt, r2ts[1].ttt);
        // The first R2T's burst in two PDUs; the third R2T goes out once it is complete.
        let d = data_out(1, t0, 0, 4, &[b'e'; 8], false);
        assert_eq!(core.data_out(1, &d), DataOutcome::Taken);
        assert!(queued_r2ts(&mut core).is_empty());
        assert_eq!(
            core.collecting(1, g.id),
            Some(Collecting {
                waiting_for_grant: false,
                received: 12
            })
        );
        let d = data_out(1, t0, 1, 12, &[b'f'; 8], true);
        assert_eq!(core.data_out(1, &d), DataOutcome::Taken);
        let next = queued_r2ts(&mut core);
        assert_eq!(spans(&next), vec![(36, 4)]);
        assert_eq!(next[0].r2t_sn, 2);
        let t2 = next[0].ttt;
        assert!(ready(&mut core).is_empty());
        // The bursts may complete in any order.
        let d = data_out(1, t2, 0, 36, b"wxyz", true);
        assert!(matches!(core.data_out(1, &d), DataOutcome::Taken));
        let d = data_out(1, t1, 0, 20, &[b'g'; 16], true);
        assert!(matches!(core.data_out(1, &d), DataOutcome::Taken));
        assert_eq!(core.collecting(1, g.id), None, "all data in");
        let r = core.poll_ready().expect("all data in");
        assert_eq!(r.itt, 1);
        let mut want = b"abcd".to_vec();
        want.extend([b'e'; 8]);
        want.extend([b'f'; 8]);
        want.extend([b'g'; 16]);
        want.extend(b"wxyz");
        assert_eq!(&r.data[..], &want[..]);
        // Data for the ended transfer, or for no task, is discarded.
        let d = data_out(1, t1, 1, 36, b"late", true);
        assert_eq!(core.data_out(1, &d), DataOutcome::Discarded);
        let d = data_out(99, t1, 0, 0, b"none", true);
        assert_eq!(core.data_out(1, &d), DataOutcome::Discarded);
    }

    #[test]
    fn a_write_asks_for_its_budget_only_once_its_turn_has_come() {
        let (a, b) = (conn(1, ConnRole::Both), conn(2, ConnRole::Both));
        let mut core = core(&[&a, &b]);
        // CmdSN 2, a write on connection 2, before CmdSN 1: it asks for nothing yet, so a
        // write holding budget never waits for a command the initiator has not sent.
        core.register(
            &b,
            task(2, 2, Simple),
            Some(write(8, b"", burst(1))),
            Io::default(),
        );
        assert_eq!(core.poll_grant(), None);
        let id = core.task(2).expect("registered").id;
        assert_eq!(
            core.collecting(2, id),
            Some(Collecting {
                waiting_for_grant: true,
                received: 0
            })
        );
        // CmdSN 1, an ORDERED write: CmdSN 2 comes in order but waits in the task set.
        core.register(
            &a,
            task(1, 1, Ord_),
            Some(write(16, b"", burst(1))),
            Io::default(),
        );
        let g = core.poll_grant().expect("the ORDERED write asks");
        assert_eq!((g.itt, g.bytes), (1, 16));
        assert_eq!(
            core.poll_grant(),
            None,
            "CmdSN 2 waits for the ORDERED write"
        );
        assert!(core.grant(1, g.id));
        let r2ts = queued_r2ts(&mut core);
        assert_eq!(spans(&r2ts), vec![(0, 16)]);
        let d = data_out(1, r2ts[0].ttt, 0, 0, &[7; 16], true);
        assert!(matches!(core.data_out(1, &d), DataOutcome::Taken));
        assert_eq!(ready(&mut core), vec![1]);
        finish(&mut core, 1, &a);
        // Its end lets CmdSN 2 go: now it asks.
        let r2ts = grant_all(&mut core);
        assert_eq!(spans(&r2ts), vec![(0, 8)]);
        // An aborted write asks no more, and a late grant finds nothing.
        core.register(
            &a,
            task(3, 3, Simple),
            Some(write(8, b"", burst(1))),
            Io::default(),
        );
        let id3 = core.task(3).expect("registered").id;
        core.abort_where(|t| t.itt == 3, |io| io.aborted = true);
        assert_eq!(core.poll_grant(), None);
        assert!(!core.grant(3, id3));
    }

    #[test]
    fn a_write_whose_data_came_first_waits_for_its_turn() {
        let (a, b) = (conn(1, ConnRole::Both), conn(2, ConnRole::Both));
        let mut core = core(&[&a, &b]);
        // CmdSN 2 (a write on connection 2, all of it unsolicited) before CmdSN 1.
        let w = burst_write(8, b"", false, false);
        core.register(&b, task(2, 2, Simple), Some(w), Io::default());
        let d = data_out(2, RESERVED_TAG, 0, 0, b"12345678", true);
        // Data-Out on the wrong connection breaks allegiance.
        assert_eq!(core.data_out(1, &d), DataOutcome::NotAllegiant);
        assert!(matches!(core.data_out(2, &d), DataOutcome::Taken));
        assert!(ready(&mut core).is_empty(), "CmdSN 1 has not come");
        register(&mut core, &a, task(1, 1, Simple));
        let got: Vec<(u32, Bytes)> =
            std::iter::from_fn(|| core.poll_ready().map(|r| (r.itt, r.data))).collect();
        assert_eq!(
            got,
            vec![(1, Bytes::new()), (2, Bytes::from_static(b"12345678"))]
        );
        assert_eq!(core.poll_grant(), None, "all of it came unasked");
        // A write all of whose data is immediate is ready with it, without a copy.
        let imm = b"immediate!";
        core.register(
            &a,
            task(3, 3, Simple),
            Some(write(
                10,
                imm,
                crate::transfer::BurstParams {
                    first_burst_length: 16,
                    ..burst(1)
                },
            )),
            Io::default(),
        );
        assert_eq!(core.poll_grant(), None);
        let r = core.poll_ready().expect("ready");
        assert_eq!(r.data.as_ptr(), imm.as_ptr());
    }

    #[test]
    fn an_unsolicited_burst_that_ends_early_asks_for_the_rest() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        // 16 bytes, FirstBurstLength 8: the unsolicited burst ends after 4.
        let w = burst_write(16, b"", false, false);
        core.register(&a, task(1, 1, Simple), Some(w), Io::default());
        // It will need R2Ts beyond the first burst, but asks for its budget only once the
        // unsolicited burst has ended: one that never ends holds none.
        assert_eq!(core.poll_grant(), None);
        let d = data_out(1, RESERVED_TAG, 0, 0, b"abcd", true);
        assert_eq!(core.data_out(1, &d), DataOutcome::Taken);
        assert!(
            queued_r2ts(&mut core).is_empty(),
            "nothing asked before the grant"
        );
        let g = core.poll_grant().expect("asks");
        assert_eq!(g.bytes, 16);
        assert!(core.grant(1, g.id));
        let r2ts = queued_r2ts(&mut core);
        assert_eq!(spans(&r2ts), vec![(4, 12)]);
    }

    #[test]
    fn a_refused_write_keeps_nothing_and_ends_with_its_unsolicited_burst() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        // 32 bytes, 4 immediate, unsolicited up to FirstBurstLength 8, the rest by R2T were it
        // not refused.
        // Registered with its command, so that the core can answer it.
        let with_answer = |itt: u32| NewTask {
            answer: Some(Box::new(Answer {
                cmd: ScsiCommand {
                    read: false,
                    write: true,
                    expected_data_transfer_length: 32,
                    ..deferred(&a, itt, itt).cmd
                },
                phase: mcsi_scsi::DataPhase {
                    data_out_len: 32,
                    data_in_len: 0,
                },
            })),
            ..task(itt, itt, Simple)
        };
        let w = burst_write(32, b"abcd", false, true);
        core.register(&a, with_answer(1), Some(w), Io::default());
        assert_eq!(core.poll_grant(), None, "a refused write asks for nothing");
        assert!(
            ready(&mut core).is_empty(),
            "its unsolicited burst is still open"
        );
        assert!(
            core.poll_transmit().is_none(),
            "no answer before its burst ends"
        );
        let c = core.collecting(1, 1001).expect("collecting");
        assert!(
            !c.waiting_for_grant,
            "the initiator owes its burst: the timeout watches"
        );
        let d = data_out(1, RESERVED_TAG, 0, 4, b"efgh", true);
        assert!(core.data_out(1, &d) == DataOutcome::Taken && queued_r2ts(&mut core).is_empty());
        assert_eq!(core.poll_grant(), None);
        // The core answers it TASK SET FULL without handing it out.
        let task_set_full = |core: &mut Core| -> Vec<(u32, u8)> {
            std::iter::from_fn(|| core.poll_transmit())
                .filter_map(|(_, p)| match p {
                    Pdu::ScsiResponse(r) => Some((r.itt, r.status)),
                    _ => None,
                })
                .collect()
        };
        assert!(core.poll_ready().is_none(), "never handed out");
        assert_eq!(
            task_set_full(&mut core),
            vec![(1, mcsi_scsi::status::TASK_SET_FULL)]
        );
        assert!(core.task(1).is_none(), "it has ended");
        // A refused write with no unsolicited Data-Out to come is answered at once.
        let w = burst_write(32, b"abcd", true, true);
        core.register(&a, with_answer(2), Some(w), Io::default());
        assert_eq!(core.poll_grant(), None);
        assert!(core.poll_ready().is_none());
        assert_eq!(
            task_set_full(&mut core),
            vec![(2, mcsi_scsi::status::TASK_SET_FULL)]
        );
    }

    #[test]
    fn an_open_unsolicited_burst_is_owed_data_even_before_its_grant() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        // 16 bytes, FirstBurstLength 8: it asks for its grant at once, but until its burst
        // ends the initiator owes data, so the Data-Out timeout must watch it.
        let w = burst_write(16, b"", false, false);
        core.register(&a, task(1, 1, Simple), Some(w), Io::default());
        assert!(
            !core
                .collecting(1, 1001)
                .expect("collecting")
                .waiting_for_grant
        );
        let d = data_out(1, RESERVED_TAG, 0, 0, b"abcdefgh", true);
        assert!(matches!(core.data_out(1, &d), DataOutcome::Taken));
        assert!(
            core.collecting(1, 1001)
                .expect("collecting")
                .waiting_for_grant
        );
    }

    #[test]
    fn a_data_out_sequence_error_is_reported_and_an_aborted_write_takes_no_more_data() {
        let a = conn(1, ConnRole::Both);
        let mut core = core(&[&a]);
        core.register(
            &a,
            task(1, 1, Simple),
            Some(write(16, b"", burst(1))),
            Io::default(),
        );
        let r2ts = grant_all(&mut core);
        let ttt = r2ts[0].ttt;
        let d = data_out(1, ttt, 1, 0, b"abcd", false);
        assert!(matches!(
            core.data_out(1, &d),
            DataOutcome::Error(TransferError::DataSn {
                expected: 0,
                got: 1
            })
        ));
        let d = data_out(1, ttt, 0, 4, b"abcd", false);
        assert!(matches!(
            core.data_out(1, &d),
            DataOutcome::Error(TransferError::Offset {
                expected: 0,
                got: 4
            })
        ));
        assert_eq!(core.abort_where(|t| t.itt == 1, |io| io.aborted = true), 1);
        // Still gathering data, it had not been handed out to run: it ends at once.
        assert!(core.task(1).is_none());
        assert_eq!(core.cmd_sns(), (2, 9), "its queue slot is free again");
        let d = data_out(1, ttt, 0, 0, b"abcd", false);
        assert_eq!(core.data_out(1, &d), DataOutcome::Discarded);
        assert!(ready(&mut core).is_empty());
    }

    #[test]
    fn abort_task_for_a_command_never_received_uses_up_its_cmdsn() {
        let (a, b) = (conn(1, ConnRole::Both), conn(2, ConnRole::Both));
        let mut core = core(&[&a, &b]);
        // CmdSN 2 waits for CmdSN 1, which the initiator gives up on: ABORT TASK with
        // RefCmdSN 1, itself CmdSN 3 (immediate).
        register(&mut core, &b, task(20, 2, Simple));
        assert!(ready(&mut core).is_empty());
        assert_eq!(
            core.abort_where(|t| t.itt == 10, |_| {}),
            0,
            "never received"
        );
        assert!(core.take_as_received(1, 3).is_some());
        assert_eq!(ready(&mut core), vec![20]);
        assert_eq!(core.cmd_sns().0, 3);
        // A RefCmdSN at or after the request's own, or outside the window: no such task.
        assert!(core.take_as_received(3, 3).is_none());
        assert!(core.take_as_received(1, 3).is_none(), "already used up");
        assert!(core.take_as_received(100, 200).is_none());
    }

    /// How a command of the property test arrives.
    #[derive(Debug, Clone, Copy)]
    enum Kind {
        /// A task of its own with this attribute.
        Task(TaskAttribute),
        /// A SIMPLE command that needs no task ([`SessionCore::claim`]).
        Deferred,
        /// A CmdSN used up without a command (a rejected command).
        Nothing,
    }

    /// A run of the property test: what ran, in which order, and the checks on the way.
    struct World {
        core: Core,
        conns: [C; 2],
        kinds: Vec<Kind>,
        arrived: Vec<bool>,
        /// CmdSNs that ran (handed out or inline), in order.
        ran: Vec<u32>,
        /// Handed-out tasks not finished yet.
        running: Vec<u32>,
    }

    impl World {
        fn kind(&self, sn: u32) -> Kind {
            self.kinds[sn as usize - 1]
        }

        fn attr(&self, sn: u32) -> TaskAttribute {
            match self.kind(sn) {
                Kind::Task(a) => a,
                _ => Simple,
            }
        }

        /// A command starts: every CmdSN before it has arrived, and its task attribute allows it
        /// beside the tasks still running.
        fn starts(&mut self, sn: u32) {
            assert!(!self.ran.contains(&sn), "CmdSN {sn} ran twice");
            assert!(
                (1..sn).all(|x| self.arrived[x as usize - 1]),
                "CmdSN {sn} ran before an earlier one arrived"
            );
            let earlier_running = self.running.iter().filter(|&&x| x < sn);
            match self.attr(sn) {
                Ord_ => assert_eq!(earlier_running.count(), 0, "ORDERED {sn} ran too early"),
                TaskAttribute::HeadOfQueue => {}
                _ => {
                    let ordered_before = earlier_running.filter(|&&x| self.attr(x) == Ord_).count();
                    assert_eq!(ordered_before, 0, "SIMPLE {sn} ran past an ORDERED one");
                }
            }
            // Nothing after a running ORDERED task may start, except HEAD OF QUEUE.
            if self.attr(sn) != TaskAttribute::HeadOfQueue {
                assert!(
                    !self.running.iter().any(|&x| x < sn && self.attr(x) == Ord_),
                    "{sn} started while an earlier ORDERED task runs"
                );
            }
            self.ran.push(sn);
        }

        fn drain(&mut self, runs: InOrder<C>) {
            for r in runs {
                match r {
                    OrderedRun::Inline(d, i) => {
                        self.starts(d.cmd.cmd_sn);
                        if i.tracked {
                            self.core.release_inline(d.cmd.lun);
                        }
                    }
                    OrderedRun::Task(d) => {
                        // Its CmdSN is used up: it enters its task set like an immediate task.
                        let mut t = task(d.cmd.itt, d.cmd.cmd_sn, Simple);
                        t.immediate = true;
                        let (reg, more) = self.core.register(&d.conn, t, None, Io::default());
                        assert_eq!(reg, RegisterOutcome::Ok);
                        assert!(more.is_empty());
                    }
                    OrderedRun::Control(..) => unreachable!("no control requests here"),
                }
            }
            while let Some(itt) = self.core.poll_ready().map(|r| r.itt) {
                self.starts(itt);
                self.running.push(itt);
            }
        }

        fn arrive(&mut self, sn: u32, on: usize) {
            self.arrived[sn as usize - 1] = true;
            let c = self.conns[on].clone();
            let runs = match self.kind(sn) {
                Kind::Task(a) => {
                    let (reg, runs) = self.core.register(&c, task(sn, sn, a), None, Io::default());
                    assert_eq!(reg, RegisterOutcome::Ok);
                    runs
                }
                Kind::Nothing => {
                    let (taken, runs) = self.core.submit_ordered(sn, Ordered::Nothing);
                    assert!(taken);
                    runs
                }
                Kind::Deferred => match self.core.claim(sn, 0, sn, false) {
                    ClaimOutcome::Now(i) => {
                        self.starts(sn);
                        if i.tracked {
                            self.core.release_inline(0);
                        }
                        Vec::new()
                    }
                    ClaimOutcome::Wait => match self.core.hold(Box::new(deferred(&c, sn, sn))) {
                        HoldOutcome::InOrder(runs) => runs,
                        _ => panic!("CmdSN {sn} could not be held"),
                    },
                    ClaimOutcome::Task => {
                        let (reg, runs) =
                            self.core
                                .register(&c, task(sn, sn, Simple), None, Io::default());
                        assert_eq!(reg, RegisterOutcome::Ok);
                        runs
                    }
                },
            };
            self.drain(runs);
        }

        /// The oldest running task ends.
        fn finish_one(&mut self) -> bool {
            if self.running.is_empty() {
                return false;
            }
            let itt = self.running.remove(0);
            let c = self.conns[0].clone();
            let f = finish(&mut self.core, itt, &c);
            assert!(!f.aborted);
            self.drain(Vec::new());
            true
        }
    }

    fn kind() -> impl proptest::strategy::Strategy<Value = Kind> {
        use proptest::prelude::*;
        prop_oneof![
            4 => Just(Kind::Task(Simple)),
            1 => Just(Kind::Task(Ord_)),
            1 => Just(Kind::Task(TaskAttribute::HeadOfQueue)),
            4 => Just(Kind::Deferred),
            1 => Just(Kind::Nothing),
        ]
    }

    proptest::proptest! {
        /// Commands over two connections in any arrival order, with tasks ending between
        /// arrivals: each runs once, never before an earlier CmdSN arrived, task attributes are
        /// kept, and at the end nothing is left held and every queue slot is free again.
        #[test]
        fn any_arrival_order_runs_each_command_once_in_order(
            (kinds, order, on, finishes) in proptest::strategy::Strategy::prop_flat_map(1usize..=8, |n| {
                use proptest::prelude::*;
                (
                    proptest::collection::vec(kind(), n),
                    Just((1..=n as u32).collect::<Vec<_>>()).prop_shuffle(),
                    proptest::collection::vec(0usize..2, n),
                    proptest::collection::vec(0usize..3, n),
                )
            })
        ) {
            let n = kinds.len() as u32;
            let conns = [conn(1, ConnRole::Both), conn(2, ConnRole::Both)];
            let mut w = World {
                core: core(&[&conns[0], &conns[1]]),
                conns,
                kinds,
                arrived: vec![false; n as usize],
                ran: Vec::new(),
                running: Vec::new(),
            };
            for (i, &sn) in order.iter().enumerate() {
                w.arrive(sn, on[i]);
                for _ in 0..finishes[i] {
                    w.finish_one();
                }
            }
            while w.finish_one() {}
            let mut ran = w.ran.clone();
            ran.sort_unstable();
            let want: Vec<u32> = (1..=n)
                .filter(|&sn| !matches!(w.kind(sn), Kind::Nothing))
                .collect();
            proptest::prop_assert_eq!(ran, want);
            proptest::prop_assert_eq!(w.core.task_count(), 0);
            proptest::prop_assert_eq!(w.core.held(), 0);
            proptest::prop_assert_eq!(w.core.inline_running(), 0);
            // Every slot free: MaxCmdSN = ExpCmdSN - 1 + depth.
            proptest::prop_assert_eq!(w.core.cmd_sns(), (n + 1, n + 8));
        }
    }
}
