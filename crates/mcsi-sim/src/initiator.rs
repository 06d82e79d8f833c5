//! The simulated initiator: mcsi-initiator-core's login machine and session core driven
//! synchronously on virtual time over byte streams, with a workload like `mcsi bench`'s (a
//! fixed number of commands outstanding, sequential or random, for a run time).

use crate::stream::Stream;
use crate::TARGET_NAME;
use bytes::Bytes;
use hdrhistogram::Histogram;
use mcsi_initiator_core::core::{Action, Command, ConnStart, DataDir, Event, SessionCore, Timers};
use mcsi_initiator_core::negotiate::{
    Login, LoginConfig, LoginDone, LoginStep, Offers, SessionKind,
};
use mcsi_initiator_core::window::CmdWindow;
use mcsi_proto::pdu::{Framing, Isid, Pdu};
use mcsi_proto::vendor::ConnRole;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The I/O pattern, as `mcsi bench --rw` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rw {
    Read,
    Write,
    RandRead,
    RandWrite,
}

impl Rw {
    pub fn parse(s: &str) -> Result<Rw, crate::UnknownName> {
        match s {
            "read" => Ok(Rw::Read),
            "write" => Ok(Rw::Write),
            "randread" => Ok(Rw::RandRead),
            "randwrite" => Ok(Rw::RandWrite),
            other => Err(crate::UnknownName::new(
                "rw",
                other,
                "expected read, write, randread or randwrite",
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::RandRead => "randread",
            Rw::RandWrite => "randwrite",
        }
    }

    fn writes(self) -> bool {
        matches!(self, Rw::Write | Rw::RandWrite)
    }

    fn random(self) -> bool {
        matches!(self, Rw::RandRead | Rw::RandWrite)
    }
}

/// What one initiator does once its session is up.
#[derive(Debug, Clone)]
pub struct Workload {
    pub rw: Rw,
    /// Bytes per command, a multiple of 512.
    pub bs: u32,
    /// Commands outstanding.
    pub iodepth: u32,
    /// How long commands are issued; the run ends when the last one completes.
    pub runtime: Duration,
    /// The region used, in 512-byte blocks from LBA 0.
    pub blocks: u64,
}

/// What an initiator measured.
#[derive(Debug, Clone)]
pub struct Measured {
    pub ios: u64,
    pub bytes: u64,
    pub errors: u64,
    /// From the first command to the last completion.
    pub elapsed: Duration,
    /// Response times, µs.
    pub lat: Histogram<u64>,
    /// Events the core raised other than completions (no status in time, a stalled connection).
    pub events: u64,
    /// Time from the first SYN to the session being up.
    pub login: Duration,
}

struct IConn {
    stream: Stream,
    login: Option<Login>,
    tx: Framing,
    rx: Framing,
    /// Its TCP connection is established.
    established: bool,
    start: Option<ConnStart>,
}

/// The handle of the command that opens the LUN.
const OPEN: u64 = u64::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    LoggingIn,
    /// READ CAPACITY, as `mcsi bench` opens its LUN (it clears the unit attention a new
    /// nexus meets first).
    Opening(u32),
    Running,
    Draining,
    Done,
}

/// One initiator with one session of `conns` connections.
pub struct Initiator {
    name: String,
    isid: Isid,
    conns: Vec<IConn>,
    core: SessionCore<u64>,
    phase: Phase,
    leading: Option<Box<LoginDone>>,
    window: Option<CmdWindow>,
    work: Workload,
    rng: ChaCha8Rng,
    next_lba: u64,
    inflight: HashMap<u64, Instant>,
    next_handle: u64,
    began: Option<Instant>,
    connect_at: Option<Instant>,
    end_issue: Option<Instant>,
    last_done: Option<Instant>,
    m: Measured,
    out: Vec<Action<u64>>,
    payload: Bytes,
    failure: Option<String>,
    /// The tcp-aware scheduler's inputs, sampled every [`TCP_SAMPLE`] as the tokio layer does.
    meters: Vec<mcsi_initiator_core::sched::RateMeter>,
    next_sample: Option<Instant>,
    /// The MaxRecvDataSegmentLength it offers, if not its default.
    pdu: Option<u32>,
}

/// How often the TCP state of each connection is read for the scheduler (mcsi-initiator's
/// period).
const TCP_SAMPLE: Duration = Duration::from_millis(20);

/// Why a simulated initiator could not be made.
#[derive(Debug, thiserror::Error)]
pub enum InitiatorError {
    /// The scheduler policy names none there is.
    #[error(transparent)]
    Policy(#[from] mcsi_initiator_core::sched::PolicyError),
    #[error("latency histogram: {0}")]
    Histogram(#[from] hdrhistogram::CreationError),
}

impl Initiator {
    /// Initiator `index` (its name and ISID follow from it), `conns` connections, the
    /// scheduler `policy` (as `mcsi bench --policy`), the MaxRecvDataSegmentLength it offers
    /// (its default if None), a seed for its random offsets.
    pub fn new(
        index: usize,
        conns: usize,
        policy: &str,
        work: Workload,
        pdu: Option<u32>,
        seed: u64,
    ) -> Result<Initiator, InitiatorError> {
        let scheduler = mcsi_initiator_core::sched::policy(policy)?;
        let mut core = SessionCore::new(scheduler);
        core.set_timers(Timers {
            response: Duration::from_secs(30),
            stall: Duration::from_secs(4),
        });
        let i = index as u32;
        let payload = Bytes::from(vec![0xa5; work.bs as usize]);
        Ok(Initiator {
            name: format!("iqn.2026-01.org.mcsi:sim-{index}"),
            isid: Isid([0x80, 0, (i >> 16) as u8, (i >> 8) as u8, i as u8, 1]),
            conns: (0..conns.max(1))
                .map(|_| IConn {
                    stream: Stream::default(),
                    login: None,
                    tx: Framing::default(),
                    rx: Framing::default(),
                    established: false,
                    start: None,
                })
                .collect(),
            core,
            phase: Phase::LoggingIn,
            leading: None,
            window: None,
            rng: ChaCha8Rng::seed_from_u64(seed),
            next_lba: 0,
            work,
            inflight: HashMap::new(),
            next_handle: 0,
            began: None,
            connect_at: None,
            end_issue: None,
            last_done: None,
            m: Measured {
                ios: 0,
                bytes: 0,
                errors: 0,
                elapsed: Duration::ZERO,
                lat: Histogram::new(3)?,
                events: 0,
                login: Duration::ZERO,
            },
            out: Vec::new(),
            payload,
            failure: None,
            meters: Vec::new(),
            next_sample: None,
            pdu,
        })
    }

    pub fn conn_count(&self) -> usize {
        self.conns.len()
    }

    pub fn stream(&mut self, i: usize) -> &mut Stream {
        &mut self.conns[i].stream
    }

    /// The run is over: every command issued has completed, or the session failed.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    pub fn measured(&self) -> &Measured {
        &self.m
    }

    /// The connection's SYN left now (for the login time).
    pub fn connecting(&mut self, now: Instant) {
        self.connect_at.get_or_insert(now);
    }

    /// Connection `i`'s TCP handshake completed.
    pub fn established(&mut self, i: usize, now: Instant) {
        self.conns[i].established = true;
        if i == 0 || self.leading.is_some() {
            self.start_login(i, now);
        }
    }

    fn start_login(&mut self, i: usize, now: Instant) {
        let (tsih, cmd_sn) = match (&self.leading, &self.window) {
            (Some(d), Some(w)) => (d.tsih, w.next_cmd_sn()),
            _ => (0, 1),
        };
        let cfg = LoginConfig {
            initiator_name: self.name.clone(),
            target_name: Some(TARGET_NAME.into()),
            kind: SessionKind::Normal,
            isid: self.isid,
            tsih,
            cid: i as u16,
            itt: i as u32,
            cmd_sn,
            offers: Offers {
                max_connections: self.conns.len() as u16,
                max_recv_data_segment_length: self
                    .pdu
                    .unwrap_or(Offers::default().max_recv_data_segment_length),
                ..Offers::default()
            },
            chap: None,
            chap_algorithms: Vec::new(),
            role: ConnRole::Both,
            random: |b| b.fill(0x5a),
        };
        match Login::new(&cfg) {
            Ok(mut l) => {
                let req = l.start_at(now, Duration::from_secs(15));
                self.conns[i]
                    .stream
                    .send(&Pdu::LoginRequest(req), &Framing::default());
                self.conns[i].login = Some(l);
            }
            Err(e) => self.fail(format!("login on connection {i}: {e}")),
        }
    }

    fn fail(&mut self, why: String) {
        if self.failure.is_none() {
            self.failure = Some(why);
        }
        self.phase = Phase::Done;
    }

    /// When the session core's timers next want [`Initiator::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.phase {
            Phase::Opening(_) | Phase::Running | Phase::Draining => {
                [self.core.poll_timeout(), self.next_sample]
                    .into_iter()
                    .flatten()
                    .min()
            }
            _ => None,
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        if matches!(
            self.phase,
            Phase::Opening(_) | Phase::Running | Phase::Draining
        ) {
            let mut out = std::mem::take(&mut self.out);
            self.core.handle_timeout(now, &mut out);
            self.act(out, now);
        }
    }

    /// Whether the scheduler wants its connections' TCP state read now.
    pub fn wants_tcp_sample(&self, now: Instant) -> bool {
        self.next_sample.is_some_and(|t| t <= now) && self.phase != Phase::Done
    }

    /// Each connection's TCP state (`None` where the stack does not expose it) and the rate
    /// each completes data at, for the scheduler.
    pub fn sample_tcp(&mut self, now: Instant, states: &[Option<mcsi_tcp::TcpState>]) {
        for (i, st) in states.iter().enumerate() {
            if let Some(st) = st {
                self.core.set_tcp(i, *st);
            }
        }
        let secs = now
            .saturating_duration_since(self.connect_at.unwrap_or(now))
            .as_secs_f64();
        let stats = self.core.conn_stats();
        self.meters.resize_with(stats.len(), Default::default);
        for (i, (c, m)) in stats.iter().zip(self.meters.iter_mut()).enumerate() {
            m.sample(
                secs,
                c.bytes.saturating_sub(c.outstanding_bytes),
                c.outstanding_tasks > 0,
            );
            self.core.set_rate(i, m.rate(), m.peak());
        }
        self.next_sample = Some(now + TCP_SAMPLE);
    }

    /// Decodes and handles what connection `i` received.
    pub fn receive(&mut self, i: usize, now: Instant) {
        loop {
            if self.phase == Phase::Done {
                return;
            }
            let rx = self.conns[i].rx;
            let pdu = match self.conns[i].stream.decode(&rx) {
                Ok(Some(p)) => p,
                Ok(None) => return,
                Err(e) => return self.fail(format!("connection {i}: {e}")),
            };
            if let Some(login) = self.conns[i].login.as_mut() {
                let Pdu::LoginResponse(resp) = pdu else {
                    return self.fail(format!("connection {i}: not a Login Response in login"));
                };
                match login.handle(&resp) {
                    Ok(LoginStep::Send(req)) => {
                        self.conns[i]
                            .stream
                            .send(&Pdu::LoginRequest(req), &Framing::default());
                    }
                    Ok(LoginStep::Done(d)) => self.logged_in(i, d, now),
                    Ok(LoginStep::Redirect(a)) => {
                        return self.fail(format!("connection {i}: redirected to {a}"))
                    }
                    Err(e) => return self.fail(format!("login on connection {i}: {e}")),
                }
                continue;
            }
            self.core.conn_heard(i, now);
            let mut out = std::mem::take(&mut self.out);
            if let Err(e) = self.core.handle_pdu(i, pdu, &mut out) {
                return self.fail(format!("connection {i}: {e}"));
            }
            self.act(out, now);
        }
    }

    fn logged_in(&mut self, i: usize, d: Box<LoginDone>, now: Instant) {
        let c = &mut self.conns[i];
        c.login = None;
        c.tx = d.connection.tx_framing();
        c.rx = d.connection.rx_framing();
        c.start = Some(ConnStart {
            max_send_dsl: Some(d.connection.max_send_data_segment_length),
            ..ConnStart::new(i as u16, ConnRole::Both, d.stat_sn)
        });
        match &mut self.window {
            Some(w) => {
                let _ = w.update(d.exp_cmd_sn, d.max_cmd_sn);
            }
            None => self.window = Some(CmdWindow::new(d.exp_cmd_sn, d.max_cmd_sn)),
        }
        if self.leading.is_none() {
            if usize::from(d.params.max_connections) < self.conns.len() {
                let n = usize::from(d.params.max_connections).max(1);
                self.conns.truncate(n);
            }
            self.leading = Some(d);
            for j in 1..self.conns.len() {
                if self.conns[j].established {
                    self.start_login(j, now);
                }
            }
        }
        if self.conns.iter().all(|c| c.start.is_some()) {
            self.run(now);
        }
    }

    /// Every connection is logged in: the session core starts and the workload begins.
    fn run(&mut self, now: Instant) {
        let (Some(d), Some(w)) = (&self.leading, self.window) else {
            return;
        };
        let starts: Vec<ConnStart> = self.conns.iter().filter_map(|c| c.start).collect();
        let mut out = std::mem::take(&mut self.out);
        self.core.start(d.params.clone(), w, &starts, &mut out);
        self.m.login = now.saturating_duration_since(self.connect_at.unwrap_or(now));
        if self.core.scheduler_wants_tcp_info() {
            self.next_sample = Some(now);
        }
        self.phase = Phase::Opening(0);
        self.act(out, now);
        self.open(now);
    }

    fn open(&mut self, now: Instant) {
        let mut out = std::mem::take(&mut self.out);
        let mut cdb = vec![0; 10];
        cdb[0] = 0x25;
        self.core.submit(
            Command {
                lun: 0,
                cdb: Bytes::from(cdb),
                dir: DataDir::Read(8),
            },
            OPEN,
            &mut out,
        );
        self.act(out, now);
    }

    /// READ CAPACITY answered.
    fn opened(&mut self, ok: bool, now: Instant) {
        let Phase::Opening(tries) = self.phase else {
            return;
        };
        if !ok && tries < 3 {
            self.phase = Phase::Opening(tries + 1);
            return self.open(now);
        }
        if !ok {
            return self.fail("READ CAPACITY failed 4 times".into());
        }
        self.phase = Phase::Running;
        self.began = Some(now);
        self.end_issue = Some(now + self.work.runtime);
        for _ in 0..self.work.iodepth {
            self.issue(now);
        }
    }

    fn issue(&mut self, now: Instant) {
        let blocks = u64::from(self.work.bs / 512).max(1);
        let slots = (self.work.blocks / blocks).max(1);
        let lba = if self.work.rw.random() {
            self.rng.gen_range(0..slots) * blocks
        } else {
            let l = self.next_lba;
            self.next_lba = if l + 2 * blocks > slots * blocks {
                0
            } else {
                l + blocks
            };
            l
        };
        let op = if self.work.rw.writes() { 0x2a } else { 0x28 };
        let mut cdb = vec![op, 0];
        cdb.extend_from_slice(&(lba as u32).to_be_bytes());
        cdb.push(0);
        cdb.extend_from_slice(&(blocks as u16).to_be_bytes());
        cdb.push(0);
        let dir = if self.work.rw.writes() {
            DataDir::Write(self.payload.clone())
        } else {
            DataDir::Read(self.work.bs)
        };
        let h = self.next_handle;
        self.next_handle += 1;
        self.inflight.insert(h, now);
        let mut out = std::mem::take(&mut self.out);
        self.core.submit(
            Command {
                lun: 0,
                cdb: Bytes::from(cdb),
                dir,
            },
            h,
            &mut out,
        );
        self.act(out, now);
    }

    fn act(&mut self, mut out: Vec<Action<u64>>, now: Instant) {
        let mut completed = 0;
        let mut opened = None;
        for a in out.drain(..) {
            match a {
                Action::Send { conn, pdu } | Action::Urgent { conn, pdu } => {
                    if let Some(c) = self.conns.get_mut(conn) {
                        let tx = c.tx;
                        c.stream.send(&pdu, &tx);
                    }
                }
                Action::Complete {
                    handle: OPEN,
                    result,
                } => {
                    opened = Some(result.and_then(|r| r.check()).is_ok());
                }
                Action::Complete { handle, result } => {
                    let started = self.inflight.remove(&handle);
                    match result.and_then(|r| r.check()) {
                        Ok(_) => {
                            self.m.ios += 1;
                            self.m.bytes += u64::from(self.work.bs);
                            if let Some(t) = started {
                                let us = now.saturating_duration_since(t).as_micros() as u64;
                                let _ = self.m.lat.record(us.max(1));
                            }
                        }
                        Err(e) => {
                            self.m.errors += 1;
                            tracing::debug!(handle, error = %e, "simulated command failed");
                        }
                    }
                    self.last_done = Some(now);
                    completed += 1;
                }
                Action::Event { event, .. } => {
                    if !matches!(event, Event::Control(_)) {
                        self.m.events += 1;
                    }
                }
            }
        }
        self.out = out;
        if let Some(ok) = opened {
            self.opened(ok, now);
        }
        if completed == 0 {
            return;
        }
        let issuing = self.phase == Phase::Running && self.end_issue.is_some_and(|e| now < e);
        if issuing {
            for _ in 0..completed {
                self.issue(now);
            }
        } else if self.phase == Phase::Running {
            self.phase = Phase::Draining;
        }
        if self.phase == Phase::Draining && self.inflight.is_empty() {
            self.phase = Phase::Done;
            if let (Some(b), Some(l)) = (self.began, self.last_done) {
                self.m.elapsed = l.saturating_duration_since(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_policy_is_refused_with_its_own_error() {
        let work = Workload {
            rw: Rw::Read,
            bs: 4096,
            iodepth: 1,
            runtime: Duration::from_secs(1),
            blocks: 8,
        };
        let e = Initiator::new(0, 1, "fastest-please", work, None, 1)
            .err()
            .expect("an unknown policy was taken");
        assert!(matches!(e, InitiatorError::Policy(_)), "{e:?}");
        assert!(e.to_string().contains("fastest-please"), "{e}");
    }
}
