//! The simulated target: mcsi-proto's login machine, mcsi-target-core's session core and
//! mcsi-scsi's device server, driven synchronously on virtual time over byte streams. It is
//! what `mcsi-target`'s tokio layer does per connection (decode, hand the PDU to the core, run
//! what the core hands out, stamp StatSN, encode), without tasks, locks or sockets.

use crate::stream::Stream;
use crate::timers::Timers;
use bytes::Bytes;
use hdrhistogram::Histogram;
use mcsi_proto::keys::{LocalParams, SessionType};
use mcsi_proto::login::{
    LoginEnv, LoginNumbers, LoginStep, NoAuth, Refusal, TargetAccess, TargetLogin,
    TargetLoginConfig,
};
use mcsi_proto::pdu::{Framing, Isid, LoginRequest, Pdu, ScsiCommand};
use mcsi_proto::vendor::ConnRole;
use mcsi_scsi::{DataPhase, DeviceServer, Nexus, Outcome, TaskAttribute};
use mcsi_target_core::control::Tmf;
use mcsi_target_core::datain::{read_expected, response_pdus};
use mcsi_target_core::offer::TargetOffer;
use mcsi_target_core::session::Lus;
use mcsi_target_core::session::{Arrival, Close, CoreConn, OrderedRun, SessionCore, TmfStep};
use mcsi_target_core::transfer::BurstParams;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::TARGET_NAME;

/// A connection as a session core knows it.
#[derive(Debug, Clone)]
pub struct Tc {
    cid: u16,
    /// Index of the connection in [`Target`]'s table: what tells two connections apart.
    index: usize,
    role: ConnRole,
    max_data_in: u32,
}

impl CoreConn for Tc {
    fn cid(&self) -> u16 {
        self.cid
    }
    fn role(&self) -> ConnRole {
        self.role
    }
    fn same(&self, other: &Self) -> bool {
        self.index == other.index
    }
    fn max_data_in(&self) -> u32 {
        self.max_data_in
    }
}

/// What the target attaches to a task: nothing (the core keeps its command).
struct Job;

/// Counters a report reads.
#[derive(Debug, Default, Clone, Copy)]
pub struct TargetStats {
    pub commands: u64,
    pub r2ts: u64,
    pub data_in: u64,
    pub responses: u64,
    /// Most tasks any session held at once (commands waiting for their data, their turn or
    /// the disks; a RAM LUN serves a read as it arrives, so none wait there).
    pub max_tasks: usize,
    /// Bytes waiting to leave the target on one connection (its iSCSI writer's queue and its
    /// socket's send buffer, sent or not, as `ss` counts Send-Q): the most on any connection,
    /// and the median over the connections of each one's most.
    pub send_queue_max: u64,
    pub send_queue_median: u64,
    /// The smoothed RTT of the target's sockets (the data's senders on reads), sampled every
    /// 100 ms of simulated time per connection while it moves bytes, as `ss` would show it:
    /// the median and the 90th percentile of the samples, and the smallest minimum RTT, µs.
    pub srtt_median_us: u64,
    pub srtt_p90_us: u64,
    pub min_rtt_us: u64,
}

struct Session {
    core: SessionCore<Tc, Job>,
    nexus: Nexus,
    burst: BurstParams,
    /// Its connections' indexes by CID.
    conns: Vec<(u16, usize)>,
    isid: Isid,
}

enum Phase {
    Login(Box<TargetLogin>),
    Full { session: usize, tc: Tc },
    Closed,
}

struct Conn {
    stream: Stream,
    phase: Phase,
    tx: Framing,
    rx: Framing,
    stat_sn: u32,
    /// In the target's list of connections given bytes.
    written: bool,
    send_queue_max: u64,
    /// When its socket's RTT is next sampled.
    rtt_sample_at: Option<Instant>,
}

/// The target: its LUs, sessions and connections.
pub struct Target {
    params: LocalParams,
    /// The command window and the keepalive (the core's defaults, as production's).
    offer: TargetOffer,
    dev: Arc<DeviceServer>,
    sessions: Vec<Session>,
    conns: Vec<Conn>,
    stats: TargetStats,
    /// Samples of the target's sockets' smoothed RTT, µs ([`Target::note_rtt`]).
    srtt: Option<Histogram<u64>>,
    min_rtt_us: Option<u64>,
    /// Disks behind the LUN: its commands wait for them.
    disks: Option<crate::disk::Disks>,
    /// Tasks the disks are serving, by when they are done.
    pending: BTreeMap<(Instant, u64), Done>,
    next_pending: u64,
    /// Each session's next timer, so that a target of a thousand sessions does not ask each
    /// at every event.
    timers: Timers<Instant>,
    /// Connections that were given bytes to send since [`Target::take_written`] last ran.
    written: Vec<usize>,
}

/// A task whose data the disks are moving.
struct Done {
    session: usize,
    itt: u32,
    id: u64,
    conn: Tc,
    outcome: Outcome,
}

/// The LUs as the session core asks about them: with disks behind them, every command runs as
/// a task of its own (as a file or block LUN's does in mcsi target).
struct SimLus<'a> {
    dev: &'a DeviceServer,
    blocking: bool,
}

impl Lus for SimLus<'_> {
    fn data_phase(&self, lun: u64, cdb: &[u8]) -> DataPhase {
        self.dev.data_phase(lun, cdb)
    }
    fn blocking(&self, _: u64, _: &[u8]) -> bool {
        self.blocking
    }
}

/// Where a READ or WRITE (10 or 16) transfers: byte offset, length, whether it writes.
fn transfer_of(cdb: &[u8]) -> Option<(u64, u64, bool)> {
    let be = |b: &[u8]| b.iter().fold(0u64, |a, x| a << 8 | u64::from(*x));
    let (lba, blocks, write) = match *cdb.first()? {
        0x28 | 0x2a if cdb.len() >= 10 => (be(&cdb[2..6]), be(&cdb[7..9]), cdb[0] == 0x2a),
        0x88 | 0x8a if cdb.len() >= 16 => (be(&cdb[2..10]), be(&cdb[10..14]), cdb[0] == 0x8a),
        _ => return None,
    };
    Some((lba * 512, blocks * 512, write))
}

/// The login's questions, answered from the target's sessions.
struct Env<'a> {
    params: &'a LocalParams,
    queue_depth: u32,
    sessions: &'a [Session],
    stat_sn: &'a mut u32,
}

impl LoginEnv for Env<'_> {
    fn target(
        &mut self,
        session_type: SessionType,
        target_name: Option<&str>,
        _: &str,
    ) -> Result<TargetAccess, Refusal> {
        if session_type == SessionType::Normal && target_name != Some(TARGET_NAME) {
            return Err(Refusal::from(mcsi_proto::login::status::NOT_FOUND));
        }
        Ok(TargetAccess {
            params: self.params.clone(),
            authenticator: Box::new(NoAuth),
            target_alias: None,
            portal_group_tag: None,
            extensions: Vec::new(),
        })
    }

    fn session(
        &mut self,
        isid: Isid,
        tsih: u16,
        _: u16,
        _: &str,
        _: Option<&str>,
    ) -> Result<u16, Refusal> {
        if tsih == 0 {
            // The next session's TSIH (sessions are never removed).
            return Ok(self.sessions.len() as u16 + 1);
        }
        match self.sessions.get(usize::from(tsih) - 1) {
            Some(s) if s.isid == isid => Ok(tsih),
            _ => Err(Refusal::from(
                mcsi_proto::login::status::SESSION_DOES_NOT_EXIST,
            )),
        }
    }

    fn numbers(&mut self, req: &LoginRequest) -> LoginNumbers {
        *self.stat_sn = self.stat_sn.wrapping_add(1);
        let (exp_cmd_sn, max_cmd_sn) = match usize::from(req.tsih)
            .checked_sub(1)
            .and_then(|i| self.sessions.get(i))
        {
            Some(s) => s.core.cmd_sns(),
            None => (
                req.cmd_sn,
                req.cmd_sn.wrapping_add(self.queue_depth.saturating_sub(1)),
            ),
        };
        LoginNumbers {
            stat_sn: self.stat_sn.wrapping_sub(1),
            exp_cmd_sn,
            max_cmd_sn,
        }
    }
}

/// Why the simulated target ended a connection: what came on it that the target does not take
/// (at ErrorRecoveryLevel 0 the session ends with it).
#[derive(Debug, thiserror::Error)]
pub enum ConnEnded {
    #[error("target connection {conn}: {source}")]
    Decode {
        conn: usize,
        source: mcsi_proto::pdu::DecodeError,
    },
    #[error("target connection {conn}: not a Login Request in login")]
    NotLogin { conn: usize },
    #[error("target connection {conn}: login refused")]
    LoginRefused { conn: usize },
    #[error("target connection {conn}: session {tsih} refused CID {cid}")]
    CidRefused { conn: usize, tsih: u16, cid: u16 },
    #[error("target connection {conn}: a SNACK at ErrorRecoveryLevel 0")]
    Snack { conn: usize },
    #[error("the target ends connection {conn}: {fault}")]
    Fault {
        conn: usize,
        fault: mcsi_target_core::session::Fault,
    },
}

impl Target {
    /// A target with `dev`'s LUs, offering `params` (`offer`'s, perhaps changed) and keeping to
    /// `offer`'s command window and keepalive, as `mcsi target` does with its `[limits]`.
    pub fn new(
        dev: Arc<DeviceServer>,
        offer: TargetOffer,
        params: LocalParams,
        disks: Option<crate::disk::Disks>,
    ) -> Target {
        Target {
            params,
            offer,
            dev,
            sessions: Vec::new(),
            conns: Vec::new(),
            stats: TargetStats::default(),
            srtt: Histogram::new(3).ok(),
            min_rtt_us: None,
            disks,
            pending: BTreeMap::new(),
            next_pending: 0,
            timers: Timers::new(),
            written: Vec::new(),
        }
    }

    /// Session `s`'s timers may have moved.
    fn touch(&mut self, s: usize) {
        let d = self.sessions[s].core.poll_timeout();
        self.timers.set(s, d);
    }

    /// The connections given bytes to send since the last call.
    pub fn take_written(&mut self, into: &mut Vec<usize>) {
        for &k in &self.written {
            self.conns[k].written = false;
        }
        into.append(&mut self.written);
    }

    pub fn disks(&self) -> Option<&crate::disk::Disks> {
        self.disks.as_ref()
    }

    pub fn stats(&self) -> TargetStats {
        let mut q: Vec<u64> = self.conns.iter().map(|c| c.send_queue_max).collect();
        q.sort_unstable();
        let (srtt_median_us, srtt_p90_us) = match &self.srtt {
            Some(h) if !h.is_empty() => (h.value_at_quantile(0.5), h.value_at_quantile(0.9)),
            _ => (0, 0),
        };
        TargetStats {
            send_queue_max: q.last().copied().unwrap_or(0),
            send_queue_median: q.get(q.len() / 2).copied().unwrap_or(0),
            srtt_median_us,
            srtt_p90_us,
            min_rtt_us: self.min_rtt_us.unwrap_or(0),
            ..self.stats
        }
    }

    /// Whether connection `k`'s RTT is due for a sample at `now`.
    pub fn rtt_due(&self, k: usize, now: Instant) -> bool {
        self.conns[k].rtt_sample_at.is_none_or(|at| now >= at)
    }

    /// Connection `k`'s socket has this smoothed and minimum RTT (µs) at `now`, when
    /// [`Target::rtt_due`] said so: the next sample is 100 ms of simulated time on.
    pub fn note_rtt(&mut self, k: usize, now: Instant, srtt_us: u32, min_rtt_us: Option<u32>) {
        if srtt_us == 0 {
            return;
        }
        self.conns[k].rtt_sample_at = Some(now + Duration::from_millis(100));
        if let Some(h) = self.srtt.as_mut() {
            // Recording only fails for values beyond the histogram's range, which it grows to.
            let _ = h.record(u64::from(srtt_us));
        }
        if let Some(m) = min_rtt_us {
            let m = u64::from(m);
            self.min_rtt_us = Some(self.min_rtt_us.map_or(m, |x| x.min(m)));
        }
    }

    /// Connection `k` has `bytes` waiting to leave (its writer's queue and its socket's).
    pub fn note_send_queue(&mut self, k: usize, bytes: u64) {
        let c = &mut self.conns[k];
        c.send_queue_max = c.send_queue_max.max(bytes);
    }

    /// A connection was accepted: it starts in login.
    pub fn accept(&mut self, stream: Stream) -> usize {
        self.conns.push(Conn {
            stream,
            phase: Phase::Login(Box::new(TargetLogin::new(TargetLoginConfig::default()))),
            tx: Framing::default(),
            rx: Framing::default(),
            stat_sn: 0x1000,
            written: false,
            send_queue_max: 0,
            rtt_sample_at: None,
        });
        self.conns.len() - 1
    }

    /// The stream of connection `i`, for the network to move bytes.
    pub fn stream(&mut self, i: usize) -> &mut Stream {
        &mut self.conns[i].stream
    }

    pub fn conn_count(&self) -> usize {
        self.conns.len()
    }

    /// When the target's timers next want [`Target::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers
            .next()
            .into_iter()
            .chain(self.pending.keys().next().map(|k| k.0))
            .min()
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(e) = self.pending.first_entry() {
            if e.key().0 > now {
                break;
            }
            let d = e.remove();
            let _ = self.sessions[d.session]
                .core
                .finish(d.itt, d.id, &d.conn, Some(d.outcome));
            self.flush(d.session, now);
            self.touch(d.session);
        }
        // In session order, as a target that looked at every session would.
        let mut due = Vec::new();
        self.timers.pop_due(now, &mut due);
        for s in due {
            let expired = self.sessions[s].core.handle_timeout(now);
            // A write whose data stopped coming, a ping not answered: the connection is
            // dropped, as mcsi target's timer does.
            for e in expired {
                tracing::debug!(session = s, expired = ?e, "target timer expired; dropping the connection");
                let cid = e.cid();
                if let Some(&(_, k)) = self.sessions[s].conns.iter().find(|(c, _)| *c == cid) {
                    self.conn_ended(k, now, true);
                }
            }
            self.flush(s, now);
            self.touch(s);
        }
    }

    /// Connection `k` ends: dropped by the target (`abort`: what waits to be sent goes with
    /// it), or closed once its last answer is sent (a logout). The session core is told, as
    /// mcsi target's `connection_ended` tells it: at ErrorRecoveryLevel 0 a connection that
    /// failed takes its session with it, and the session's other connections are dropped.
    fn conn_ended(&mut self, k: usize, now: Instant, abort: bool) {
        let c = &mut self.conns[k];
        if abort {
            c.stream.abort();
        } else {
            c.stream.close();
        }
        let Phase::Full { session: s, tc } = std::mem::replace(&mut c.phase, Phase::Closed) else {
            return;
        };
        let sess = &mut self.sessions[s];
        sess.conns.retain(|&(_, i)| i != k);
        let lost = sess.core.conn_failed(&tc, now, |_| ());
        if lost.session_ends && !sess.core.is_closing() {
            tracing::debug!(
                session = s,
                clean = lost.clean,
                "target session ends with its connection"
            );
            let (others, _) = sess.core.close(|_| ());
            for o in others {
                self.conn_ended(o.index, now, true);
            }
        }
        self.flush(s, now);
        self.touch(s);
    }

    /// Decodes and handles what connection `i` received. A PDU the target does not take ends
    /// the connection (and the session core is told); a refused login's answer is sent first.
    pub fn receive(&mut self, i: usize, now: Instant) -> Result<(), ConnEnded> {
        let r = self.receive_all(i, now);
        if let Err(e) = &r {
            let answered = matches!(
                e,
                ConnEnded::LoginRefused { .. } | ConnEnded::CidRefused { .. }
            );
            self.conn_ended(i, now, !answered);
        }
        r
    }

    fn receive_all(&mut self, i: usize, now: Instant) -> Result<(), ConnEnded> {
        loop {
            if matches!(self.conns[i].phase, Phase::Closed) {
                return Ok(());
            }
            let rx = self.conns[i].rx;
            let pdu = match self.conns[i].stream.decode(&rx) {
                Ok(Some(p)) => p,
                Ok(None) => return Ok(()),
                Err(e) => return Err(ConnEnded::Decode { conn: i, source: e }),
            };
            self.handle(i, pdu, now)?;
        }
    }

    fn handle(&mut self, i: usize, pdu: Pdu, now: Instant) -> Result<(), ConnEnded> {
        match &mut self.conns[i].phase {
            Phase::Closed => Ok(()),
            Phase::Login(_) => {
                let Pdu::LoginRequest(req) = pdu else {
                    self.conns[i].phase = Phase::Closed;
                    return Err(ConnEnded::NotLogin { conn: i });
                };
                self.login(i, req, now)
            }
            Phase::Full { session, tc } => {
                let (s, tc) = (*session, tc.clone());
                self.sessions[s].core.conn_heard(tc.cid, now);
                let r = self.full_feature(s, &tc, pdu, now);
                self.touch(s);
                r
            }
        }
    }

    fn login(&mut self, i: usize, req: LoginRequest, now: Instant) -> Result<(), ConnEnded> {
        let c = &mut self.conns[i];
        let Phase::Login(machine) = &mut c.phase else {
            return Ok(());
        };
        let mut env = Env {
            params: &self.params,
            queue_depth: self.offer.queue_depth,
            sessions: &self.sessions,
            stat_sn: &mut c.stat_sn,
        };
        let framing = Framing::default();
        match machine.handle(&req, &mut env) {
            LoginStep::Continue(resp) => {
                self.conns[i]
                    .stream
                    .send(&Pdu::LoginResponse(resp), &framing);
                Ok(())
            }
            LoginStep::Fail(resp) => {
                self.conns[i]
                    .stream
                    .send(&Pdu::LoginResponse(resp), &framing);
                self.conns[i].phase = Phase::Closed;
                Err(ConnEnded::LoginRefused { conn: i })
            }
            LoginStep::FullFeature {
                response,
                session,
                connection,
                initiator_name,
                isid,
                tsih,
                cid,
                ..
            } => {
                self.conns[i]
                    .stream
                    .send(&Pdu::LoginResponse(response), &framing);
                let c = &mut self.conns[i];
                c.tx = connection.tx_framing();
                c.rx = connection.rx_framing();
                let tc = Tc {
                    cid,
                    index: i,
                    role: ConnRole::Both,
                    max_data_in: c.tx.max_data_segment_length,
                };
                let s = usize::from(tsih) - 1;
                if s == self.sessions.len() {
                    let mut core =
                        SessionCore::new(req.cmd_sn, self.offer.queue_depth, false, None);
                    let burst: BurstParams = (&session).into();
                    core.set_burst(burst);
                    self.sessions.push(Session {
                        core,
                        nexus: Nexus {
                            initiator_port: format!(
                                "{initiator_name},i,0x{}",
                                isid.0
                                    .iter()
                                    .map(|b| format!("{b:02x}"))
                                    .collect::<String>()
                            )
                            .into(),
                            target_port: format!("{TARGET_NAME},t,0x0001").into(),
                            relative_port: 1,
                        },
                        burst,
                        conns: Vec::new(),
                        isid,
                    });
                }
                let sess = &mut self.sessions[s];
                if sess.core.add_conn(tc.clone()).is_err() {
                    self.conns[i].phase = Phase::Closed;
                    return Err(ConnEnded::CidRefused { conn: i, tsih, cid });
                }
                sess.conns.retain(|(c, _)| *c != cid);
                sess.conns.push((cid, i));
                let o = &self.offer;
                sess.core
                    .start_keepalive(cid, o.nop_interval, o.nop_timeout, now);
                self.conns[i].phase = Phase::Full { session: s, tc };
                self.touch(s);
                Ok(())
            }
        }
    }

    fn full_feature(&mut self, s: usize, tc: &Tc, pdu: Pdu, now: Instant) -> Result<(), ConnEnded> {
        if matches!(pdu, Pdu::ScsiCommand(_)) {
            self.stats.commands += 1;
        }
        let dev = Arc::clone(&self.dev);
        let lus = SimLus {
            dev: &dev,
            blocking: self.disks.is_some(),
        };
        let arrival = self.sessions[s].core.handle_pdu(tc, pdu, &lus, || Job);
        match arrival {
            Arrival::Now(run) => {
                let reply = run.claim.reply.clone().unwrap_or_else(|| tc.clone());
                let o = self.execute(s, &run.cmd, run.data);
                self.respond(s, &reply, &run.cmd, run.phase, o);
                if run.claim.tracked {
                    let _ = self.sessions[s].core.release_inline(run.cmd.lun);
                }
            }
            Arrival::Taken { runs, note } => {
                if let Some(n) = note {
                    tracing::debug!(session = s, note = ?n, "target core note");
                }
                self.runs(s, runs);
            }
            Arrival::Snack(_) => {
                return Err(ConnEnded::Snack { conn: tc.index });
            }
            Arrival::End(fault) => {
                return Err(ConnEnded::Fault {
                    conn: tc.index,
                    fault,
                });
            }
        }
        self.flush(s, now);
        Ok(())
    }

    /// Carries out what came up in CmdSN order.
    fn runs(&mut self, s: usize, runs: Vec<OrderedRun<Tc>>) {
        for r in runs {
            match r {
                OrderedRun::Control(c, Pdu::LogoutRequest(l)) => {
                    let _ = self.sessions[s].core.logout(&c, &l, |_| {});
                }
                OrderedRun::Control(c, Pdu::TaskMgmtRequest(t)) => {
                    let plan = Tmf::plan(&t, self.dev.lu(t.lun).is_some());
                    let step = self.sessions[s].core.task_management(
                        &c,
                        t.itt,
                        &plan,
                        t.immediate,
                        |_| {},
                    );
                    if let TmfStep::Answered { runs, .. } = step {
                        self.runs(s, runs);
                    }
                }
                OrderedRun::Control(_, other) => {
                    tracing::debug!(opcode = ?other.opcode(), "control request not simulated");
                }
                OrderedRun::Inline(d, claim) => {
                    let reply = claim.reply.clone().unwrap_or_else(|| d.conn.clone());
                    let data = d.data_out();
                    let o = self.execute(s, &d.cmd, data);
                    self.respond(s, &reply, &d.cmd, d.phase, o);
                    if claim.tracked {
                        let _ = self.sessions[s].core.release_inline(d.cmd.lun);
                    }
                }
                OrderedRun::Task(d) => {
                    let (more, _) = self.sessions[s].core.start_held(*d, Job);
                    self.runs(s, more);
                }
            }
        }
    }

    /// Grants writes their budget, runs the tasks the core hands out, and sends what it made.
    /// (Its callers look at the session's timers again once they are done with it.)
    fn flush(&mut self, s: usize, now: Instant) {
        loop {
            let mut progress = false;
            while let Some(g) = self.sessions[s].core.poll_grant() {
                let _ = self.sessions[s].core.grant(g.itt, g.id);
                progress = true;
            }
            let mut ready = Vec::new();
            while let Some(r) = self.sessions[s].core.poll_ready() {
                if let Some(a) = r.answer {
                    ready.push((r.itt, r.id, r.conn.clone(), r.data, a.cmd.clone()));
                }
            }
            self.stats.max_tasks = self.stats.max_tasks.max(self.sessions[s].core.task_count());
            for (itt, id, conn, data, cmd) in ready {
                let o = self.execute(s, &cmd, data);
                let due = match (self.disks.as_mut(), transfer_of(&cmd.cdb)) {
                    (Some(d), Some((off, len, write))) => Some(d.submit(now, off, len, write)),
                    _ => None,
                };
                match due {
                    Some(t) if t > now => {
                        self.next_pending += 1;
                        self.pending.insert(
                            (t, self.next_pending),
                            Done {
                                session: s,
                                itt,
                                id,
                                conn,
                                outcome: o,
                            },
                        );
                    }
                    _ => {
                        let _ = self.sessions[s].core.finish(itt, id, &conn, Some(o));
                    }
                }
                progress = true;
            }
            while let Some((c, p)) = self.sessions[s].core.poll_transmit() {
                self.send(s, &c, p);
                progress = true;
            }
            let mut closes = Vec::new();
            while let Some(c) = self.sessions[s].core.poll_close() {
                closes.push(c);
            }
            for (c, how) in closes {
                self.conn_ended(c.index, now, how == Close::Now);
                progress = true;
            }
            if !progress {
                return;
            }
        }
    }

    fn execute(&self, s: usize, c: &ScsiCommand, data_out: Bytes) -> Outcome {
        self.dev.execute(
            c.lun,
            mcsi_scsi::Command {
                nexus: &self.sessions[s].nexus,
                cdb: &c.cdb,
                data_out,
                data_in_limit: read_expected(c),
                attr: TaskAttribute::Simple,
                pace: None,
            },
        )
    }

    fn respond(&mut self, s: usize, conn: &Tc, c: &ScsiCommand, phase: DataPhase, o: Outcome) {
        let max_burst = self.sessions[s].burst.max_burst_length;
        for p in response_pdus(c, phase, o, conn.max_data_in, max_burst) {
            self.send(s, conn, p);
        }
    }

    /// A PDU leaves on `conn`: StatSN and the window stamped on, as the target's writer does.
    fn send(&mut self, s: usize, conn: &Tc, mut p: Pdu) {
        match &p {
            Pdu::R2t(_) => self.stats.r2ts += 1,
            Pdu::DataIn(_) => self.stats.data_in += 1,
            Pdu::ScsiResponse(_) => self.stats.responses += 1,
            _ => {}
        }
        let (exp, max) = self.sessions[s].core.cmd_sns();
        let c = &mut self.conns[conn.index];
        if matches!(c.phase, Phase::Closed) {
            return;
        }
        p.stamp(&mut c.stat_sn, exp, max);
        let tx = c.tx;
        c.stream.send(&p, &tx);
        if !c.written {
            c.written = true;
            self.written.push(conn.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::initiator::{Initiator, Rw, Workload};
    use mcsi_scsi::{LogicalUnit, LuConfig};

    /// A target with one RAM LU and an initiator of one connection wired to it stream to
    /// stream (no TCP): `pump` moves bytes both ways until the session is up.
    struct Bench {
        target: Target,
        ini: Initiator,
        k: usize,
    }

    impl Bench {
        fn new(rw: Rw, now: Instant) -> Bench {
            let backend = mcsi_scsi::backend::open_backend("ram:4MiB").unwrap();
            let lu = Arc::new(LogicalUnit::new(backend, LuConfig::default()));
            let dev = Arc::new(DeviceServer::new(vec![(0, lu)]));
            let offer = TargetOffer::default();
            let params = offer.local_params();
            let mut target = Target::new(dev, offer, params, None);
            let work = Workload {
                rw,
                bs: 4096,
                iodepth: 4,
                runtime: Duration::from_secs(3600),
                blocks: 8192,
            };
            let mut ini = Initiator::new(0, 1, "round-robin", work, None, 1).unwrap();
            let k = target.accept(Stream::default());
            ini.connecting(now);
            ini.established(0, now);
            Bench { target, ini, k }
        }

        /// Moves bytes until the session is up (the initiator then goes on issuing commands
        /// for as long as bytes move).
        fn pump(&mut self, now: Instant) {
            while self.target.sessions.is_empty() {
                let mut moved = false;
                let to_target = self.target.stream(self.k);
                self.ini.stream(0).drain_into(|b| {
                    to_target.deliver(b);
                    moved = true;
                    b.len()
                });
                let _ = self.target.receive(self.k, now);
                let to_ini = self.ini.stream(0);
                self.target.stream(self.k).drain_into(|b| {
                    to_ini.deliver(b);
                    moved = true;
                    b.len()
                });
                self.ini.receive(0, now);
                if !moved {
                    return;
                }
            }
        }

        fn session(&self) -> &SessionCore<Tc, Job> {
            &self.target.sessions[0].core
        }
    }

    /// The initiator stops answering (its link is cut) once the session is up: at the NOP-In
    /// ping's timeout the target drops the connection, as mcsi target does, and at
    /// ErrorRecoveryLevel 0 the session ends with it.
    #[test]
    fn an_unanswered_ping_drops_the_connection_and_ends_the_session() {
        let t0 = Instant::now();
        let mut b = Bench::new(Rw::Read, t0);
        b.pump(t0);
        assert_eq!(b.target.sessions.len(), 1, "logged in");
        assert_eq!(b.session().conn_count(), 1);
        let offer = TargetOffer::default();
        // The link is cut: the target's timers run alone.
        let mut now = t0;
        let end = t0 + offer.nop_interval + offer.nop_timeout + Duration::from_secs(1);
        while let Some(at) = b.target.poll_timeout().filter(|&at| at <= end) {
            now = at.max(now);
            b.target.handle_timeout(now);
            if b.target.stream(b.k).is_closed() {
                break;
            }
        }
        assert!(
            b.target.stream(b.k).is_closed(),
            "the connection was dropped by {:?}",
            now - t0
        );
        assert!(now - t0 >= offer.nop_interval + offer.nop_timeout);
        assert_eq!(b.session().conn_count(), 0);
        assert!(b.session().is_closing(), "the session ended with it");
        assert_eq!(b.session().task_count(), 0);
    }

    /// A PDU the target cannot take (a data segment beyond the one negotiated) ends the
    /// connection and, at ErrorRecoveryLevel 0, the session: the core is told, where the
    /// simulated target used to mark the connection closed and leave the session as it was.
    #[test]
    fn a_pdu_the_target_cannot_read_ends_the_connection_and_its_session() {
        let t0 = Instant::now();
        let mut b = Bench::new(Rw::Read, t0);
        b.pump(t0);
        assert_eq!(b.session().conn_count(), 1);
        let mut junk = [0u8; 48];
        junk[0] = 0x40; // an immediate NOP-Out
        junk[5..8].copy_from_slice(&[0xff; 3]); // of 16 MiB, beyond what was negotiated
        b.target.stream(b.k).deliver(&junk);
        let r = b.target.receive(b.k, t0);
        assert!(matches!(r, Err(ConnEnded::Decode { .. })), "{r:?}");
        assert!(b.target.stream(b.k).is_closed());
        assert_eq!(b.session().conn_count(), 0);
        assert!(b.session().is_closing());
    }

    /// A login to a target that is not there is refused with an answer that says so, and
    /// then the connection closes: the answer is sent, not dropped with the connection.
    #[test]
    fn a_refused_login_is_answered_before_the_connection_closes() {
        use mcsi_initiator_core::negotiate::{Login, LoginConfig, Offers, SessionKind};
        let t0 = Instant::now();
        let mut b = Bench::new(Rw::Read, t0);
        let cfg = LoginConfig {
            initiator_name: "iqn.2026-01.org.mcsi:lost".into(),
            target_name: Some("iqn.2026-01.org.mcsi:nobody".into()),
            kind: SessionKind::Normal,
            isid: Isid([0x80, 0, 0, 0, 9, 1]),
            tsih: 0,
            cid: 0,
            itt: 0,
            cmd_sn: 1,
            offers: Offers::default(),
            chap: None,
            chap_algorithms: Vec::new(),
            role: ConnRole::Both,
            random: |b: &mut [u8]| b.fill(0x5a),
        };
        let req = Login::new(&cfg)
            .unwrap()
            .start_at(t0, Duration::from_secs(15));
        let mut wire = Stream::default();
        wire.send(&Pdu::LoginRequest(req), &Framing::default());
        let to_target = b.target.stream(b.k);
        wire.drain_into(|x| {
            to_target.deliver(x);
            x.len()
        });
        let r = b.target.receive(b.k, t0);
        assert!(matches!(r, Err(ConnEnded::LoginRefused { .. })), "{r:?}");
        let out = b.target.stream(b.k);
        assert!(out.is_closed());
        let mut answer = Stream::default();
        out.drain_into(|x| {
            answer.deliver(x);
            x.len()
        });
        let Ok(Some(Pdu::LoginResponse(resp))) = answer.decode(&Framing::default()) else {
            panic!("no Login Response was sent");
        };
        assert_eq!(
            (resp.status_class, resp.status_detail),
            mcsi_proto::login::status::NOT_FOUND
        );
        assert!(b.target.sessions.is_empty());
    }
}
