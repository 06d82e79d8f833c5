//! The target's full feature phase driven by arbitrary PDU sequences, in process: each connection
//! is a `tokio::io::duplex` pipe handed to `Server::serve` (no socket, no kernel in the loop).
//!
//! One `mcsi_target::Server` (three RAM LUNs, keepalive and login rate limit off, small bursts
//! and queue) runs for the whole fuzz run on a current-thread runtime that only this thread
//! drives, so the server and the fuzz input take turns deterministically. Each input logs in
//! properly (its own digests, segment and burst sizes), sometimes joins a second connection or
//! reinstates the session, then sends PDUs built from the input: SCSI commands with arbitrary
//! CDB, flags, EDTL, CmdSN and immediate data, Data-Out answering R2Ts (mostly right, sometimes
//! not) or arbitrary, NOP-Out, Text, Task Management, Logout, SNACK, Login, raw headers and
//! garbage, reading what the target answers in between. Then it closes its connections.
//!
//! Checked: the server never panics (libfuzzer-sys aborts on a panic in any thread, tokio tasks
//! included); everything the target sends decodes with the negotiated digests and our
//! MaxRecvDataSegmentLength, is a target PDU, and answers something the target received; StatSN
//! advances by one per status PDU, ExpCmdSN never goes back, MaxCmdSN >= ExpCmdSN - 1; Data-In
//! stays within the expected read length and R2Ts within the expected write length and
//! MaxBurstLength; NOP-In echoes the ping data; CHECK CONDITION carries sense that parses; the
//! target closes a connection the initiator closed, without a partial PDU. After every input a
//! fresh connection logs in, writes and reads back verified data (through R2Ts, immediate or
//! unsolicited data, digests, by turns) on a LUN the inputs cannot reach, and gets a status
//! from the two others, within a bounded time. Every input rather than every N: a failure then
//! shows with the input that caused it. Sessions end with each input, but what LUN 0 and 1 keep
//! (persistent reservations, mode pages) carries over, so a crash file may need the inputs
//! before it to reproduce.
#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use mcsi_proto::keys::{Digest, LocalParams};
use mcsi_proto::login::{InitiatorLogin, InitiatorLoginConfig, InitiatorStep, LoginOutcome};
use mcsi_proto::pdu::{
    decode, DataOut, Framing, Isid, LoginRequest, LogoutRequest, NopOut, Pdu, R2t, ScsiCommand,
    SnackRequest, Stage, TaskAttr, TaskMgmtRequest, TextRequest, RESERVED_TAG,
};
use mcsi_proto::serial::Sn;
use mcsi_proto::vendor;
use mcsi_scsi::{lun, status, Sense};
use mcsi_target::config::{
    AuthSpec, Limits, LunSpec, ServerConfig, ServerLimits, TargetOffer, TargetSpec,
};
use mcsi_target::Server;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

const IQN: &str = "iqn.2026-01.org.mcsi:fuzz";
const INITIATOR: &str = "iqn.2026-01.org.mcsi:fuzzer";
const CHECKER: &str = "iqn.2026-01.org.mcsi:checker";
/// LUN 2 belongs to the check after each input; inputs never address it.
const CHECK_LUN: u16 = 2;
/// A login, a closing connection or the whole check must be done by then (a sanitizer on a
/// busy machine included); beyond it the target is stuck.
const DEADLINE: Duration = Duration::from_secs(5);
/// The target's limits: small, so that bursts, R2T sequences and the window fill up quickly.
const TARGET_MRDSL: u32 = 8192;
const TARGET_FBL: u32 = 16384;
const TARGET_MBL: u32 = 32768;

struct World {
    rt: tokio::runtime::Runtime,
    addr: SocketAddr,
    server: Mutex<Server>,
    round: AtomicU64,
}

static WORLD: OnceLock<World> = OnceLock::new();

fn config() -> ServerConfig {
    let limits = Limits {
        offer: TargetOffer {
            max_connections: 4,
            max_recv_data_segment_length: TARGET_MRDSL,
            first_burst_length: TARGET_FBL,
            max_burst_length: TARGET_MBL,
            max_outstanding_r2t: 4,
            queue_depth: 16,
            nop_interval: Duration::ZERO,
            ..TargetOffer::default()
        },
        // Tight, so that a leaked session or connection shows up as refused logins.
        max_sessions: 8,
        max_target_connections: 16,
        ..Limits::default()
    };
    let lun4k = LunSpec {
        block_size: 4096,
        ..LunSpec::new("ram:512KiB")
    };
    ServerConfig {
        targets: vec![TargetSpec {
            iqn: IQN.into(),
            alias: None,
            portals: vec![SocketAddr::from(([127, 0, 0, 1], 0))],
            advertise: Vec::new(),
            redirect: None,
            luns: vec![
                LunSpec::new("ram:512KiB"),
                lun4k,
                LunSpec::new("ram:256KiB"),
            ],
            limits,
            auth: AuthSpec::default(),
            qos_initiators: Vec::new(),
            tpgt: 1,
            alua: None,
            lun_maps: Vec::new(),
        }],
        discovery_auth: AuthSpec::default(),
        limits: ServerLimits {
            login_rate: 0,
            login_timeout: Duration::from_secs(10),
            max_server_connections: 32,
            ..ServerLimits::default()
        },
        // Sessions on the fuzzer's own runtime: one thread, the same order every run.
        session_threads: 0,
        mptcp: false,
        control: None,
        state_dir: None,
        source: None,
        access_from_flags: false,
    }
}

fn world() -> &'static World {
    WORLD.get_or_init(|| {
        // A write to a socket the target closed must fail, not kill the process.
        // SAFETY: sets a signal disposition before any other thread exists.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let server = rt.block_on(Server::start(&config())).expect("server");
        let addr = server.local_addrs()[0];
        World {
            rt,
            addr,
            server: Mutex::new(server),
            round: AtomicU64::new(0),
        }
    })
}

#[path = "../../../mcsi-proto/fuzz/fuzz_targets/input.rs"]
mod input;
use input::Input;

fn pattern(len: usize, seed: u32) -> Bytes {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 4);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    Bytes::from(v)
}

// ---------------------------------------------------------------------------------------------
// What the target received, and checks on what it sends back.

/// What the target has been sent under one ITT (ITTs may be reused, so the union).
#[derive(Default)]
struct Sent {
    scsi: bool,
    /// Largest expected read and write lengths of the SCSI commands.
    read: u32,
    write: u32,
    pings: Vec<Bytes>,
    tmf: bool,
    text: bool,
    logout: bool,
}

#[derive(Default)]
struct Model {
    itts: HashMap<u32, Sent>,
    recent: Vec<u32>,
    /// R2Ts not answered yet: connection index and the R2T.
    r2ts: Vec<(usize, R2t)>,
    text_ttt: Option<u32>,
    cmd_sn: u32,
    next_itt: u32,
    /// The session's MaxBurstLength.
    max_burst: u32,
    /// The check keeps Data-In and the status of its one command at a time.
    collect: bool,
    data_in: Vec<u8>,
    done: Option<(u8, Vec<u8>)>,
}

impl Model {
    fn note(&mut self, p: &Pdu) {
        let itt = match p {
            Pdu::ScsiCommand(c) => {
                let s = self.itts.entry(c.itt).or_default();
                s.scsi = true;
                let read = match (c.read, c.write) {
                    (true, false) => c.expected_data_transfer_length,
                    (true, true) => c.bidi_read_length.unwrap_or(0),
                    _ => 0,
                };
                s.read = s.read.max(read);
                if c.write {
                    s.write = s.write.max(c.expected_data_transfer_length);
                }
                c.itt
            }
            Pdu::NopOut(n) => {
                if n.itt == RESERVED_TAG {
                    return;
                }
                self.itts
                    .entry(n.itt)
                    .or_default()
                    .pings
                    .push(n.data.clone());
                n.itt
            }
            Pdu::TaskMgmtRequest(t) => {
                self.itts.entry(t.itt).or_default().tmf = true;
                t.itt
            }
            Pdu::TextRequest(t) => {
                self.itts.entry(t.itt).or_default().text = true;
                t.itt
            }
            Pdu::LogoutRequest(l) => {
                self.itts.entry(l.itt).or_default().logout = true;
                l.itt
            }
            _ => return,
        };
        if self.recent.len() >= 16 {
            self.recent.remove(0);
        }
        self.recent.push(itt);
    }

    fn itt(&mut self) -> u32 {
        self.next_itt = self.next_itt.wrapping_add(1);
        self.next_itt
    }
}

fn sam_status(s: u8) -> bool {
    matches!(
        s,
        status::GOOD
            | status::CHECK_CONDITION
            | status::CONDITION_MET
            | status::BUSY
            | status::RESERVATION_CONFLICT
            | status::TASK_SET_FULL
            | status::ACA_ACTIVE
            | status::TASK_ABORTED
    )
}

/// Bytes each way a pipe buffers: far more than the target's output budget, so that the target
/// never waits on a full pipe while the fuzzer waits to write (a socket's buffers play that
/// part over TCP).
const PIPE_BYTES: usize = 16 << 20;

/// The fuzzer's end of an in-process connection, with the non-blocking read and the readiness
/// wait the checks use.
struct Pipe {
    s: DuplexStream,
    /// Bytes read by [`Pipe::readable`] and not handed out yet.
    pending: BytesMut,
    eof: bool,
}

impl Pipe {
    /// A connection to the server, as if from 127.0.0.1 to its portal `addr`.
    fn connect(addr: SocketAddr) -> Pipe {
        let (ours, theirs) = tokio::io::duplex(PIPE_BYTES);
        let peer = SocketAddr::from(([127, 0, 0, 1], 40000));
        let served = world()
            .server
            .lock()
            .expect("server lock")
            .serve(theirs, peer, addr);
        assert!(
            served,
            "the server refused a connection: it holds max_server_connections (leaked connections?)"
        );
        Pipe {
            s: ours,
            pending: BytesMut::new(),
            eof: false,
        }
    }

    async fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.s.write_all(bytes).await
    }

    async fn shutdown(&mut self) -> std::io::Result<()> {
        self.s.shutdown().await
    }

    /// Waits until something can be read (or the target has closed).
    async fn readable(&mut self) {
        if self.pending.is_empty() && !self.eof {
            match self.s.read_buf(&mut self.pending).await {
                Ok(0) | Err(_) => self.eof = true,
                Ok(_) => {}
            }
        }
    }

    fn take_pending(&mut self, buf: &mut BytesMut) -> Option<usize> {
        if !self.pending.is_empty() {
            let n = self.pending.len();
            buf.extend_from_slice(&self.pending.split());
            return Some(n);
        }
        self.eof.then_some(0)
    }

    async fn read_buf(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        if let Some(n) = self.take_pending(buf) {
            return Ok(n);
        }
        self.s.read_buf(buf).await
    }

    /// Reads what is there without waiting: `WouldBlock` when nothing is.
    fn try_read_buf(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        if let Some(n) = self.take_pending(buf) {
            return Ok(n);
        }
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut tmp = [0u8; 64 * 1024];
        let mut rb = tokio::io::ReadBuf::new(&mut tmp);
        match tokio::io::AsyncRead::poll_read(std::pin::Pin::new(&mut self.s), &mut cx, &mut rb) {
            std::task::Poll::Ready(Ok(())) => {
                buf.extend_from_slice(rb.filled());
                Ok(rb.filled().len())
            }
            std::task::Poll::Ready(Err(e)) => Err(e),
            std::task::Poll::Pending => Err(std::io::ErrorKind::WouldBlock.into()),
        }
    }
}

/// One connection of the fuzzing initiator.
struct Conn {
    s: Pipe,
    rx_buf: BytesMut,
    /// How we frame what we send, and the target's decoder fed the same bytes, so that the model
    /// knows what the target received (raw bytes and garbage included).
    tx: Framing,
    mirror: BytesMut,
    mirror_dead: bool,
    rx: Framing,
    /// The next StatSN a status must carry.
    stat_sn: u32,
    exp_cmd_sn: u32,
    cid: u16,
    writable: bool,
    eof: bool,
}

impl Conn {
    /// The target has closed this connection or is about to (it cannot decode what came).
    fn dead(&self) -> bool {
        self.mirror_dead || !self.writable || self.eof
    }

    fn new(s: Pipe, o: &LoginOutcome, rest: BytesMut, cid: u16) -> Conn {
        Conn {
            s,
            rx_buf: rest,
            tx: o.connection.tx_framing(),
            mirror: BytesMut::new(),
            mirror_dead: false,
            rx: o.connection.rx_framing(),
            stat_sn: o.stat_sn.wrapping_add(1),
            exp_cmd_sn: o.exp_cmd_sn,
            cid,
            writable: true,
            eof: false,
        }
    }

    async fn send_bytes(&mut self, m: &mut Model, bytes: &[u8]) {
        if !self.writable {
            return;
        }
        if !self.mirror_dead {
            self.mirror.extend_from_slice(bytes);
            loop {
                match decode(&mut self.mirror, &self.tx) {
                    Ok(Some(p)) => m.note(&p),
                    Ok(None) => break,
                    Err(e) if e.consumed() => {}
                    Err(_) => {
                        // The target drops the connection here.
                        self.mirror_dead = true;
                        break;
                    }
                }
            }
        }
        match tokio::time::timeout(DEADLINE, self.s.write_all(bytes)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => self.writable = false,
            Err(_) => panic!("the target stopped reading from connection {}", self.cid),
        }
    }

    async fn send(&mut self, m: &mut Model, p: &Pdu) {
        let bytes = p.encode(&self.tx).to_vec();
        self.send_bytes(m, &bytes).await;
    }

    /// Reads what is there without waiting; checks every complete PDU.
    fn poll(&mut self, m: &mut Model, me: usize) -> bool {
        let mut got = false;
        while !self.eof {
            match self.s.try_read_buf(&mut self.rx_buf) {
                Ok(0) => self.eof = true,
                Ok(_) => got = true,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    // Reset by the target: what was in flight is lost, nothing to check.
                    self.eof = true;
                    self.rx_buf.clear();
                }
            }
            if self.rx_buf.len() > (1 << 20) {
                break;
            }
        }
        self.drain(m, me);
        got
    }

    fn drain(&mut self, m: &mut Model, me: usize) {
        loop {
            match decode(&mut self.rx_buf, &self.rx) {
                Ok(Some(p)) => self.check(m, me, p),
                Ok(None) => return,
                Err(e) => panic!("the target sent a PDU that does not decode: {e}"),
            }
        }
    }

    /// Invariants of one PDU from the target.
    fn check(&mut self, m: &mut Model, me: usize, p: Pdu) {
        // (StatSN if the PDU carries a status, else the StatSN it repeats, ExpCmdSN, MaxCmdSN)
        let (status_sn, peek_sn, exp, max) = match &p {
            Pdu::NopIn(x) if x.itt != RESERVED_TAG => {
                (Some(x.stat_sn), None, x.exp_cmd_sn, x.max_cmd_sn)
            }
            Pdu::NopIn(x) => (None, Some(x.stat_sn), x.exp_cmd_sn, x.max_cmd_sn),
            Pdu::ScsiResponse(x) => (Some(x.stat_sn), None, x.exp_cmd_sn, x.max_cmd_sn),
            Pdu::DataIn(x) if x.status.is_some() => {
                (Some(x.stat_sn), None, x.exp_cmd_sn, x.max_cmd_sn)
            }
            Pdu::DataIn(x) => (None, None, x.exp_cmd_sn, x.max_cmd_sn),
            Pdu::R2t(x) => (None, Some(x.stat_sn), x.exp_cmd_sn, x.max_cmd_sn),
            Pdu::TaskMgmtResponse(x) => (Some(x.stat_sn), None, x.exp_cmd_sn, x.max_cmd_sn),
            Pdu::TextResponse(x) => (Some(x.stat_sn), None, x.exp_cmd_sn, x.max_cmd_sn),
            Pdu::LogoutResponse(x) => (Some(x.stat_sn), None, x.exp_cmd_sn, x.max_cmd_sn),
            Pdu::Reject(x) => (Some(x.stat_sn), None, x.exp_cmd_sn, x.max_cmd_sn),
            Pdu::AsyncMessage(x) => (Some(x.stat_sn), None, x.exp_cmd_sn, x.max_cmd_sn),
            other => panic!("the target sent {other:?} in full feature phase"),
        };
        if let Some(sn) = status_sn {
            assert_eq!(sn, self.stat_sn, "StatSN out of sequence in {p:?}");
            self.stat_sn = sn.wrapping_add(1);
        }
        if let Some(sn) = peek_sn {
            assert_eq!(
                sn, self.stat_sn,
                "R2T/NOP-In does not carry the next StatSN: {p:?}"
            );
        }
        assert!(
            Sn::ge(Sn(exp), Sn(self.exp_cmd_sn)),
            "ExpCmdSN went back from {} to {exp}",
            self.exp_cmd_sn
        );
        self.exp_cmd_sn = exp;
        assert!(
            Sn::ge(Sn(max.wrapping_add(1)), Sn(exp)),
            "MaxCmdSN {max} below ExpCmdSN {exp} - 1"
        );
        let none = Sent::default();
        let itt = match &p {
            Pdu::NopIn(x) => x.itt,
            Pdu::ScsiResponse(x) => x.itt,
            Pdu::DataIn(x) => x.itt,
            Pdu::R2t(x) => x.itt,
            Pdu::TaskMgmtResponse(x) => x.itt,
            Pdu::TextResponse(x) => x.itt,
            Pdu::LogoutResponse(x) => x.itt,
            _ => RESERVED_TAG,
        };
        let sent = m.itts.get(&itt).unwrap_or(&none);
        match &p {
            Pdu::NopIn(x) if x.itt != RESERVED_TAG => {
                let keep = self.rx.max_data_segment_length as usize;
                let echo = sent
                    .pings
                    .iter()
                    .any(|d| d[..d.len().min(keep)] == x.data[..]);
                assert!(echo, "NOP-In {:#x} does not echo a ping", x.itt);
            }
            Pdu::NopIn(_) => {}
            Pdu::ScsiResponse(x) => {
                assert!(
                    sent.scsi,
                    "SCSI Response for ITT {itt:#x} that carried no command"
                );
                assert!(x.response <= 1, "SCSI Response code {}", x.response);
                assert!(!(x.overflow && x.underflow), "both O and U");
                if x.response == 0 {
                    assert!(sam_status(x.status), "status {:#04x}", x.status);
                }
                if x.status == status::CHECK_CONDITION && x.response == 0 {
                    let s = &x.sense;
                    assert!(!s.is_empty(), "CHECK CONDITION without sense data");
                    assert!(
                        matches!(s[0] & 0x7F, 0x70..=0x73),
                        "sense code {:#04x}",
                        s[0]
                    );
                    assert!(Sense::parse(s).is_some(), "sense does not parse: {s:02x?}");
                }
                if m.collect {
                    m.done = Some((x.status, std::mem::take(&mut m.data_in)));
                }
            }
            Pdu::DataIn(x) => {
                assert!(
                    sent.scsi,
                    "Data-In for ITT {itt:#x} that carried no command"
                );
                let end = u64::from(x.buffer_offset) + x.data.len() as u64;
                assert!(
                    end <= u64::from(sent.read),
                    "Data-In up to {end} for ITT {itt:#x}, expected at most {}",
                    sent.read
                );
                if let Some(s) = x.status {
                    assert!(x.final_, "status in a Data-In without F");
                    assert!(sam_status(s), "status {s:#04x}");
                }
                if m.collect {
                    assert_eq!(x.buffer_offset as usize, m.data_in.len(), "Data-In offset");
                    m.data_in.extend_from_slice(&x.data);
                    if let Some(s) = x.status {
                        m.done = Some((s, std::mem::take(&mut m.data_in)));
                    }
                }
            }
            Pdu::R2t(x) => {
                assert!(sent.scsi, "R2T for ITT {itt:#x} that carried no command");
                let len = x.desired_data_transfer_length;
                let end = u64::from(x.buffer_offset) + u64::from(len);
                assert!(len > 0, "R2T for no data");
                assert!(len <= m.max_burst, "R2T of {len} bytes over MaxBurstLength");
                assert!(
                    end <= u64::from(sent.write),
                    "R2T up to {end} for ITT {itt:#x}, expected write {}",
                    sent.write
                );
                if m.r2ts.len() < 16 {
                    m.r2ts.push((me, x.clone()));
                }
            }
            Pdu::TaskMgmtResponse(x) => {
                assert!(sent.tmf, "TMF Response for ITT {itt:#x}");
                assert!(
                    matches!(x.response, 0..=6 | 255),
                    "TMF response {}",
                    x.response
                );
            }
            Pdu::TextResponse(x) => {
                assert!(sent.text, "Text Response for ITT {itt:#x}");
                m.text_ttt = (x.ttt != RESERVED_TAG).then_some(x.ttt);
            }
            Pdu::LogoutResponse(x) => {
                assert!(sent.logout, "Logout Response for ITT {itt:#x}");
                assert!(x.response <= 3, "Logout response {}", x.response);
                if m.collect {
                    m.done = Some((x.response, Vec::new()));
                }
            }
            Pdu::Reject(x) => {
                assert!(
                    matches!(x.reason, 0x02..=0x0c),
                    "Reject reason {:#x}",
                    x.reason
                );
                assert_eq!(x.header.len(), 48, "Reject without the rejected header");
            }
            _ => {}
        }
    }

    /// Closes our side and reads until the target closes too.
    async fn close(&mut self, m: &mut Model, me: usize) {
        let _ = self.s.shutdown().await;
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while !self.eof {
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "the target kept connection {} open after it was closed",
                    self.cid
                );
            }
            let _ = tokio::time::timeout(Duration::from_millis(50), self.s.readable()).await;
            self.poll(m, me);
        }
        assert!(
            self.rx_buf.is_empty(),
            "the target closed connection {} in the middle of a PDU",
            self.cid
        );
    }
}

/// Lets the target run until it has nothing more to say for a few turns.
async fn pump(conns: &mut [Conn], m: &mut Model, max: usize) {
    let mut idle = 0;
    for _ in 0..max {
        tokio::task::yield_now().await;
        let mut got = false;
        for (i, c) in conns.iter_mut().enumerate() {
            got |= c.poll(m, i);
        }
        idle = if got { 0 } else { idle + 1 };
        if idle >= 3 {
            break;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Login

struct Login {
    name: &'static str,
    isid: [u8; 6],
    tsih: u16,
    cid: u16,
    cmd_sn: u32,
    params: LocalParams,
    /// The asymmetric mode (vendor keys) with this connection role.
    role: Option<&'static str>,
}

/// A login the target must answer; Ok with the connection in full feature phase, Err with the
/// refusal's status class and detail.
async fn login(addr: SocketAddr, l: Login) -> Result<(Conn, LoginOutcome), (u8, u8)> {
    let mut s = Pipe::connect(addr);
    let mut cfg = InitiatorLoginConfig::normal(l.name, IQN, Isid(l.isid));
    cfg.tsih = l.tsih;
    cfg.cid = l.cid;
    cfg.cmd_sn = l.cmd_sn;
    cfg.itt = 0x4000_0000 | u32::from(l.cid);
    cfg.params = l.params;
    if let Some(role) = l.role {
        cfg.extensions = vec![
            (vendor::ASYMMETRIC, "Yes".into()),
            (vendor::CONNECTION_ROLE, role.into()),
        ];
    }
    let mut il = InitiatorLogin::new(cfg);
    let mut req = il.start();
    let f = Framing::default();
    let mut buf = BytesMut::new();
    loop {
        let bytes = Pdu::LoginRequest(req).encode(&f).to_vec();
        if s.write_all(&bytes).await.is_err() {
            return Err((0xFF, 0));
        }
        let resp = loop {
            match decode(&mut buf, &f) {
                Ok(Some(Pdu::LoginResponse(r))) => break r,
                Ok(Some(other)) => panic!("the target sent {other:?} during login"),
                Ok(None) => {}
                Err(e) => panic!("the target sent a login PDU that does not decode: {e}"),
            }
            let n = tokio::time::timeout(DEADLINE, s.read_buf(&mut buf))
                .await
                .expect("no Login Response in time");
            match n {
                Ok(0) | Err(_) => return Err((0xFF, 1)),
                Ok(_) => {}
            }
        };
        match il.handle(&resp) {
            InitiatorStep::Send(next) => req = next,
            InitiatorStep::FullFeature(o) => {
                let c = Conn::new(s, &o, buf, l.cid);
                return Ok((c, *o));
            }
            InitiatorStep::Failed(_) => return Err((resp.status_class, resp.status_detail)),
        }
    }
}

fn fuzz_params(inp: &mut Input<'_>) -> LocalParams {
    let sel = inp.u8();
    let digest = |b: u8| match b & 3 {
        0 | 1 => vec![Digest::None],
        2 => vec![Digest::Crc32c],
        _ => vec![Digest::Crc32c, Digest::None],
    };
    let mrdsl = match inp.u8() {
        0..=127 => 8192,
        128..=191 => 512,
        x => 512 + u32::from(x) * 97,
    };
    let mbl = [512, 4096, 8192, 65536][usize::from(inp.u8() & 3)];
    LocalParams {
        header_digest: digest(sel),
        data_digest: digest(sel >> 2),
        max_recv_data_segment_length: mrdsl,
        max_connections: 4,
        initial_r2t: sel & 0x10 != 0,
        immediate_data: sel & 0x20 == 0,
        max_burst_length: mbl,
        first_burst_length: mbl.min([512, 4096, 16384][usize::from(sel >> 6) % 3]),
        max_outstanding_r2t: 1 + u16::from(sel >> 7) * 3,
        default_time2retain: 0,
        error_recovery_level: 0,
        ..LocalParams::default()
    }
}

// ---------------------------------------------------------------------------------------------
// PDUs from the input

/// What the session negotiated, for well-formed writes.
#[derive(Clone, Copy)]
struct Ops {
    immediate_data: bool,
    initial_r2t: bool,
    first_burst: u32,
}

impl Ops {
    fn of(o: &LoginOutcome) -> Ops {
        Ops {
            immediate_data: o.session.immediate_data,
            initial_r2t: o.session.initial_r2t,
            first_burst: o.session.first_burst_length,
        }
    }
}

fn pick_lun(inp: &mut Input<'_>) -> u64 {
    match inp.u8() {
        0..=159 => lun::encode(0),
        160..=229 => lun::encode(1),
        230..=239 => lun::encode(7),
        _ => {
            let raw = inp.u64();
            if lun::decode(raw) == Some(CHECK_LUN) {
                lun::encode(7)
            } else {
                raw
            }
        }
    }
}

const OPS: &[u8] = &[
    0x00, 0x03, 0x12, 0x16, 0x17, 0x1A, 0x25, 0x28, 0x2A, 0x2F, 0x35, 0x41, 0x42, 0x55, 0x5E, 0x5F,
    0x88, 0x89, 0x8A, 0x9E, 0xA0, 0xA3, 0xA8, 0xAA, 0x28, 0x2A, 0x28, 0x2A,
];

fn put(c: &mut [u8], at: usize, v: u64, n: usize) {
    c[at..at + n].copy_from_slice(&v.to_be_bytes()[8 - n..]);
}

/// A CDB with its natural direction and data length.
fn cdb(inp: &mut Input<'_>, bs: u32) -> (Vec<u8>, bool, bool, u32, Option<Bytes>) {
    let sel = inp.u8();
    let op = if sel < 0xF0 {
        OPS[usize::from(sel) % OPS.len()]
    } else {
        inp.u8()
    };
    let len = if inp.u8() < 0xF0 {
        16
    } else {
        16 + 4 * usize::from(inp.u8() % 5)
    };
    let mut c = vec![0u8; len];
    let raw = inp.take(if sel & 1 == 0 { 0 } else { 16 });
    c[..raw.len()].copy_from_slice(raw);
    c[0] = op;
    let lba = u64::from(inp.u8() % 64);
    let nlb = u64::from(inp.u8() % 16) + 1;
    let alloc = u64::from(inp.u8());
    let blocks = u32::try_from(nlb).unwrap_or(1) * bs;
    let mut param = None;
    let (r, w, n) = match op {
        0x28 | 0x2A | 0x2F | 0x35 | 0x41 => {
            put(&mut c, 2, lba, 4);
            put(&mut c, 7, nlb, 2);
            match op {
                0x28 => (true, false, blocks),
                0x2A => (false, true, blocks),
                0x41 => (false, true, bs),
                _ => (false, false, 0),
            }
        }
        0xA8 | 0xAA => {
            put(&mut c, 2, lba, 4);
            put(&mut c, 6, nlb, 4);
            (op == 0xA8, op == 0xAA, blocks)
        }
        0x88..=0x8A => {
            put(&mut c, 2, lba, 8);
            if op == 0x89 {
                c[13] = nlb as u8;
                (false, true, 2 * blocks)
            } else {
                put(&mut c, 10, nlb, 4);
                (op == 0x88, op == 0x8A, blocks)
            }
        }
        0x12 | 0x03 | 0x1A => {
            if op == 0x12 {
                c[1] &= 1;
                put(&mut c, 3, alloc, 2);
            } else {
                c[4] = alloc as u8;
            }
            (true, false, alloc as u32)
        }
        0x5E | 0x9E | 0xA0 | 0xA3 | 0x25 => {
            match op {
                0x5E => put(&mut c, 7, alloc, 2),
                0x9E => {
                    c[1] = 0x10;
                    put(&mut c, 10, alloc, 4);
                }
                0x25 => {}
                _ => {
                    if op == 0xA3 {
                        c[1] = 0x0C;
                    }
                    put(&mut c, 6, alloc.max(16), 4);
                }
            }
            let n = if op == 0x25 { 8 } else { alloc.max(16) as u32 };
            (true, false, n)
        }
        0x5F => {
            c[1] &= 0x07;
            c[2] = [1u8, 3, 5, 6, 7, 8][usize::from(alloc as u8 % 6)];
            put(&mut c, 5, 24, 4);
            let mut p = vec![0u8; 24];
            put(&mut p, 0, [0u64, 0x11, 0x22][usize::from(inp.u8() % 3)], 8);
            put(&mut p, 8, [0u64, 0x11, 0x22][usize::from(inp.u8() % 3)], 8);
            param = Some(Bytes::from(p));
            (false, true, 24)
        }
        0x42 => {
            let mut p = vec![0u8; 24];
            put(&mut p, 0, 22, 2);
            put(&mut p, 2, 16, 2);
            put(&mut p, 8, lba, 8);
            put(&mut p, 16, nlb, 4);
            put(&mut c, 7, 24, 2);
            param = Some(Bytes::from(p));
            (false, true, 24)
        }
        _ => (false, false, 0),
    };
    (c, r, w, n, param)
}

enum Step {
    Command,
    AnswerR2t,
    DataOut,
    Nop,
    Text,
    Tmf,
    Logout,
    Snack,
    Login,
    RawHeader,
    Garbage,
    Pump,
    Switch,
    Join,
    Reinstate,
}

fn step(b: u8) -> Step {
    match b {
        0..=89 | 243..=255 => Step::Command,
        90..=119 => Step::AnswerR2t,
        120..=134 => Step::DataOut,
        135..=149 => Step::Nop,
        150..=161 => Step::Text,
        162..=177 => Step::Tmf,
        178..=182 => Step::Logout,
        183..=186 => Step::Snack,
        187..=190 => Step::Login,
        191..=202 => Step::RawHeader,
        203..=208 => Step::Garbage,
        209..=229 => Step::Pump,
        230..=236 => Step::Switch,
        237..=240 => Step::Join,
        _ => Step::Reinstate,
    }
}

/// CmdSN for a request: mostly the next one, sometimes ahead, behind or anywhere.
fn cmd_sn(inp: &mut Input<'_>, m: &mut Model, immediate: bool) -> u32 {
    let sn = match inp.u8() {
        0..=219 => m.cmd_sn,
        220..=234 => m.cmd_sn.wrapping_add(1 + u32::from(inp.u8() % 20)),
        235..=249 => m.cmd_sn.wrapping_sub(1 + u32::from(inp.u8() % 20)),
        _ => inp.u32(),
    };
    if !immediate && sn == m.cmd_sn {
        m.cmd_sn = m.cmd_sn.wrapping_add(1);
    }
    sn
}

fn itt(inp: &mut Input<'_>, m: &mut Model) -> u32 {
    match inp.u8() {
        0..=229 => m.itt(),
        230..=244 if !m.recent.is_empty() => m.recent[usize::from(inp.u8()) % m.recent.len()],
        245..=250 => RESERVED_TAG,
        _ => inp.u32(),
    }
}

/// Splits `data` at `offset` into Data-Out PDUs of at most `mrdsl` bytes.
fn data_outs(itt: u32, ttt: u32, offset: u32, data: &Bytes, mrdsl: u32) -> Vec<Pdu> {
    let step = mrdsl.max(1) as usize;
    let n = data.len().div_ceil(step).max(1);
    (0..n)
        .map(|i| {
            let a = (i * step).min(data.len());
            let b = ((i + 1) * step).min(data.len());
            Pdu::DataOut(DataOut {
                final_: i + 1 == n,
                lun: 0,
                itt,
                ttt,
                exp_stat_sn: 0,
                data_sn: i as u32,
                buffer_offset: offset + a as u32,
                data: data.slice(a..b),
            })
        })
        .collect()
}

struct Run {
    addr: SocketAddr,
    conns: Vec<Conn>,
    cur: usize,
    m: Model,
    ops: Ops,
    isid: [u8; 6],
    tsih: u16,
    seed: u32,
    /// The session asked for the asymmetric mode.
    asym: bool,
    /// The connection each command went on, by ITT.
    cmd_conn: HashMap<u32, usize>,
}

/// A connection role of the asymmetric mode.
fn role(inp: &mut Input<'_>) -> &'static str {
    ["requests", "responses", "both"][usize::from(inp.u8() % 3)]
}

impl Run {
    async fn command(&mut self, inp: &mut Input<'_>) {
        let lun_raw = pick_lun(inp);
        let bs = if lun::decode(lun_raw) == Some(1) {
            4096
        } else {
            512
        };
        let (cdb, mut r, mut w, n, param) = cdb(inp, bs);
        let form = inp.u8();
        if form & 0x07 == 0 {
            r = inp.bool();
            w = inp.bool();
        }
        let edtl = match (form >> 3) & 0x07 {
            0 => inp.u32(),
            1 => n.saturating_add(u32::from(inp.u8()) * 4),
            2 => n.saturating_sub(u32::from(inp.u8()) * 4),
            _ => n,
        };
        let immediate = form & 0x40 != 0 && inp.u8() < 0x20;
        let attr = if inp.u8() < 0xE0 {
            TaskAttr::Simple
        } else {
            TaskAttr::from_bits(inp.u8())
        };
        let ops = self.ops;
        let c = &self.conns[self.cur];
        let mrdsl = c.tx.max_data_segment_length;
        self.seed = self.seed.wrapping_add(0x9E37_79B9);
        let payload = param.unwrap_or_else(|| pattern(edtl.min(1 << 17) as usize, self.seed));
        // Immediate data and the unsolicited burst, as RFC 7143 allows them, or anything.
        let well_formed = form & 0x80 == 0;
        let unsolicited_end = if ops.initial_r2t {
            0
        } else {
            edtl.min(ops.first_burst)
        };
        let imm = if !w {
            0
        } else if well_formed {
            if ops.immediate_data {
                edtl.min(ops.first_burst).min(mrdsl)
            } else {
                0
            }
        } else {
            u32::from(inp.u16()) % (2 * mrdsl + 1)
        };
        let imm = (imm as usize).min(payload.len());
        let more_unsolicited = w && well_formed && (imm as u32) < unsolicited_end;
        let final_ = if well_formed {
            !more_unsolicited
        } else {
            inp.bool()
        };
        let bidi = (r && w && inp.u8() < 0x40).then(|| inp.u32() % 65536);
        let itt = itt(inp, &mut self.m);
        let sn = cmd_sn(inp, &mut self.m, immediate);
        let p = Pdu::ScsiCommand(ScsiCommand {
            immediate,
            final_,
            read: r,
            write: w,
            attr,
            lun: lun_raw,
            itt,
            expected_data_transfer_length: edtl,
            cmd_sn: sn,
            exp_stat_sn: c.stat_sn,
            cdb: Bytes::from(cdb),
            bidi_read_length: bidi,
            data: payload.slice(..imm),
        });
        let cur = self.cur;
        self.cmd_conn.insert(itt, cur);
        self.conns[cur].send(&mut self.m, &p).await;
        if more_unsolicited {
            let end = (unsolicited_end as usize).min(payload.len());
            let rest = payload.slice(imm..end);
            for d in data_outs(itt, RESERVED_TAG, imm as u32, &rest, mrdsl) {
                self.conns[cur].send(&mut self.m, &d).await;
            }
        }
    }

    async fn answer_r2t(&mut self, inp: &mut Input<'_>) {
        if self.m.r2ts.is_empty() {
            return;
        }
        let i = usize::from(inp.u8()) % self.m.r2ts.len();
        let (ci, r) = self.m.r2ts.swap_remove(i);
        // Data-Out goes where the command went (an R2T may come on a response connection).
        let ci = self.cmd_conn.get(&r.itt).copied().unwrap_or(ci);
        let ci = if inp.u8() < 0xF8 {
            ci
        } else {
            usize::from(inp.u8()) % self.conns.len()
        };
        let mrdsl = self.conns[ci].tx.max_data_segment_length;
        let mut len = r.desired_data_transfer_length.min(1 << 17);
        let how = inp.u8();
        if how >= 0xF0 {
            len = len
                .saturating_add(u32::from(inp.u8()))
                .saturating_sub(u32::from(inp.u8()));
        }
        self.seed = self.seed.wrapping_add(1);
        let data = pattern(len as usize, self.seed);
        let mut pdus = data_outs(r.itt, r.ttt, r.buffer_offset, &data, mrdsl);
        match how {
            0xE0..=0xE7 => {
                // Wrong DataSN, offset or F bit in one of them.
                let k = usize::from(inp.u8()) % pdus.len();
                if let Pdu::DataOut(d) = &mut pdus[k] {
                    match how & 3 {
                        0 => d.data_sn = d.data_sn.wrapping_add(1),
                        1 => d.buffer_offset = d.buffer_offset.wrapping_add(512),
                        2 => d.final_ = !d.final_,
                        _ => d.ttt = d.ttt.wrapping_add(1),
                    }
                }
            }
            0xE8..=0xEF => {
                // Some of it, or twice.
                let k = usize::from(inp.u8()) % (pdus.len() + 1);
                if how & 1 == 0 {
                    pdus.truncate(k);
                } else {
                    let again = pdus.clone();
                    pdus.extend(again);
                }
            }
            _ => {}
        }
        for p in pdus {
            self.conns[ci].send(&mut self.m, &p).await;
        }
    }

    async fn data_out(&mut self, inp: &mut Input<'_>) {
        let itt = match inp.u8() {
            0..=199 if !self.m.recent.is_empty() => {
                self.m.recent[usize::from(inp.u8()) % self.m.recent.len()]
            }
            _ => inp.u32(),
        };
        let ttt = match inp.u8() {
            0..=127 => RESERVED_TAG,
            128..=199 => self.m.r2ts.first().map_or(RESERVED_TAG, |r| r.1.ttt),
            _ => inp.u32(),
        };
        let len = usize::from(inp.u16()) % 2048;
        let p = Pdu::DataOut(DataOut {
            final_: inp.bool(),
            lun: 0,
            itt,
            ttt,
            exp_stat_sn: 0,
            data_sn: u32::from(inp.u8() % 4),
            buffer_offset: if inp.bool() {
                512 * u32::from(inp.u8() % 8)
            } else {
                inp.u32()
            },
            data: pattern(len, self.seed ^ 0x55),
        });
        let cur = self.cur;
        self.conns[cur].send(&mut self.m, &p).await;
    }

    async fn other(&mut self, inp: &mut Input<'_>, s: Step) {
        let cur = self.cur;
        let immediate = inp.u8() < 0xC0;
        let p = match s {
            Step::Nop => {
                let itt = if inp.u8() < 0xF0 {
                    self.m.itt()
                } else {
                    RESERVED_TAG
                };
                let n = match inp.u8() {
                    0..=199 => usize::from(inp.u8()),
                    _ => usize::from(inp.u16()) % 20000,
                };
                Pdu::NopOut(NopOut {
                    immediate: immediate || itt == RESERVED_TAG && inp.bool(),
                    lun: 0,
                    itt,
                    ttt: if inp.u8() < 0xF0 {
                        RESERVED_TAG
                    } else {
                        inp.u32()
                    },
                    cmd_sn: cmd_sn(inp, &mut self.m, immediate),
                    exp_stat_sn: self.conns[cur].stat_sn,
                    data: pattern(n, self.seed ^ 0x77),
                })
            }
            Step::Text => {
                let data = match inp.u8() {
                    0..=159 => Bytes::from_static(b"SendTargets=All\0"),
                    160..=199 => Bytes::from(format!("SendTargets={IQN}\0")),
                    _ => {
                        let n = usize::from(inp.u8());
                        Bytes::copy_from_slice(inp.take(n))
                    }
                };
                let (ttt, itt) = match (inp.u8(), self.m.text_ttt) {
                    (0..=127, Some(t)) => (t, *self.m.recent.last().unwrap_or(&0)),
                    (x, _) if x > 0xF0 => (inp.u32(), itt(inp, &mut self.m)),
                    _ => (RESERVED_TAG, itt(inp, &mut self.m)),
                };
                Pdu::TextRequest(TextRequest {
                    immediate,
                    final_: inp.u8() < 0xE0,
                    continue_: inp.u8() > 0xF0,
                    lun: 0,
                    itt,
                    ttt,
                    cmd_sn: cmd_sn(inp, &mut self.m, immediate),
                    exp_stat_sn: self.conns[cur].stat_sn,
                    data,
                })
            }
            Step::Tmf => {
                let function = match inp.u8() {
                    x if x < 0xF0 => 1 + x % 8,
                    _ => inp.u8(),
                };
                let referenced_task_tag = match inp.u8() {
                    0..=199 if !self.m.recent.is_empty() => {
                        self.m.recent[usize::from(inp.u8()) % self.m.recent.len()]
                    }
                    _ => inp.u32(),
                };
                let lun = pick_lun(inp);
                let ref_cmd_sn = self.m.cmd_sn.wrapping_sub(u32::from(inp.u8() % 8));
                let itt = self.m.itt();
                Pdu::TaskMgmtRequest(TaskMgmtRequest {
                    immediate,
                    function,
                    lun,
                    itt,
                    referenced_task_tag,
                    cmd_sn: cmd_sn(inp, &mut self.m, immediate),
                    exp_stat_sn: self.conns[cur].stat_sn,
                    ref_cmd_sn,
                    exp_data_sn: 0,
                })
            }
            Step::Logout => {
                let reason = match inp.u8() {
                    x if x < 0xF0 => x % 3,
                    x => x,
                };
                let cid = match inp.u8() {
                    0..=199 => self.conns[usize::from(inp.u8()) % self.conns.len()].cid,
                    _ => inp.u16(),
                };
                let itt = self.m.itt();
                Pdu::LogoutRequest(LogoutRequest {
                    immediate,
                    reason,
                    itt,
                    cid,
                    cmd_sn: cmd_sn(inp, &mut self.m, immediate),
                    exp_stat_sn: self.conns[cur].stat_sn,
                })
            }
            Step::Snack => Pdu::SnackRequest(SnackRequest {
                snack_type: inp.u8() % 4,
                lun: 0,
                itt: itt(inp, &mut self.m),
                ttt: inp.u32(),
                exp_stat_sn: self.conns[cur].stat_sn,
                beg_run: u32::from(inp.u8()),
                run_length: u32::from(inp.u8()),
            }),
            _ => Pdu::LoginRequest(LoginRequest {
                transit: inp.bool(),
                continue_: false,
                csg: Stage::Operational,
                nsg: Stage::FullFeature,
                version_max: 0,
                version_min: 0,
                isid: Isid(self.isid),
                tsih: self.tsih,
                itt: self.m.itt(),
                cid: self.conns[cur].cid,
                cmd_sn: self.m.cmd_sn,
                exp_stat_sn: self.conns[cur].stat_sn,
                data: Bytes::from_static(b"HeaderDigest=None\0"),
            }),
        };
        self.conns[cur].send(&mut self.m, &p).await;
    }

    /// A 48-byte header of any opcode with fields from the input, and a short data segment.
    async fn raw_header(&mut self, inp: &mut Input<'_>) {
        let mut h = [0u8; 48];
        let b = inp.take(48);
        h[..b.len()].copy_from_slice(b);
        h[0] = match inp.u8() {
            x if x < 0x80 => {
                [0x00, 0x01, 0x02, 0x04, 0x05, 0x06, 0x10, 0x03][usize::from(x % 8)] | (h[0] & 0x40)
            }
            _ => h[0],
        };
        let dsl = usize::from(inp.u8());
        if inp.u8() < 0xE0 {
            h[4] = 0;
            h[5..8].copy_from_slice(&(dsl as u32).to_be_bytes()[1..]);
        }
        let mut v = h.to_vec();
        v.extend_from_slice(inp.take(dsl));
        while v.len() % 4 != 0 {
            v.push(0);
        }
        let cur = self.cur;
        self.conns[cur].send_bytes(&mut self.m, &v).await;
    }

    async fn garbage(&mut self, inp: &mut Input<'_>) {
        let n = usize::from(inp.u8() % 64) + 1;
        let v = inp.take(n).to_vec();
        let cur = self.cur;
        self.conns[cur].send_bytes(&mut self.m, &v).await;
    }

    async fn join(&mut self, inp: &mut Input<'_>, leading: bool) {
        if self.conns.len() >= 6 {
            return;
        }
        let params = fuzz_params(inp);
        let role = self.asym.then(|| role(inp));
        let cid = if leading {
            0
        } else {
            self.conns.iter().map(|c| c.cid).max().unwrap_or(0) + 1
        };
        let l = Login {
            name: INITIATOR,
            isid: self.isid,
            tsih: if leading { 0 } else { self.tsih },
            cid,
            cmd_sn: self.m.cmd_sn,
            params,
            role,
        };
        if let Ok((c, o)) = login(self.addr, l).await {
            if leading {
                self.tsih = o.tsih;
                self.ops = Ops::of(&o);
                self.m.cmd_sn = o.exp_cmd_sn;
                self.m.max_burst = self.m.max_burst.max(o.session.max_burst_length);
            }
            self.conns.push(c);
            self.cur = self.conns.len() - 1;
        }
    }
}

async fn one_input(addr: SocketAddr, data: &[u8]) {
    let mut inp = Input::new(data);
    let isid = [0x80, 0, 0, 0, 0x10, inp.u8() % 4];
    let params = fuzz_params(&mut inp);
    let two = inp.u8() < 0x40;
    let asym = inp.u8() < 0x40;
    let first = Login {
        name: INITIATOR,
        isid,
        tsih: 0,
        cid: 0,
        cmd_sn: 1,
        params,
        role: asym.then(|| role(&mut inp)),
    };
    let (c, o) = login(addr, first)
        .await
        .unwrap_or_else(|st| panic!("a well-formed leading login was refused: {st:?}"));
    let mut run = Run {
        addr,
        conns: vec![c],
        cur: 0,
        m: Model {
            cmd_sn: o.exp_cmd_sn,
            max_burst: o.session.max_burst_length,
            ..Model::default()
        },
        ops: Ops::of(&o),
        isid,
        tsih: o.tsih,
        seed: u32::from_be_bytes([isid[5], 1, 2, 3]),
        asym,
        cmd_conn: HashMap::new(),
    };
    if two && o.session.max_connections >= 2 {
        let params = fuzz_params(&mut inp);
        let l = Login {
            name: INITIATOR,
            isid,
            tsih: o.tsih,
            cid: 1,
            cmd_sn: run.m.cmd_sn,
            params,
            role: asym.then(|| role(&mut inp)),
        };
        let (c, _) = login(addr, l)
            .await
            .unwrap_or_else(|st| panic!("a second connection was refused: {st:?}"));
        run.conns.push(c);
    }

    let mut relogins = 0;
    for _ in 0..40 {
        if inp.is_empty() {
            break;
        }
        // Once the target has dropped every connection, the rest of the input would go nowhere:
        // reinstate the session (a few times at most).
        if run.conns.iter().all(Conn::dead) && relogins < 3 {
            relogins += 1;
            run.join(&mut inp, true).await;
        }
        match step(inp.u8()) {
            Step::Command => run.command(&mut inp).await,
            Step::AnswerR2t => run.answer_r2t(&mut inp).await,
            Step::DataOut => run.data_out(&mut inp).await,
            s @ (Step::Nop | Step::Text | Step::Tmf | Step::Logout | Step::Snack | Step::Login) => {
                run.other(&mut inp, s).await
            }
            Step::RawHeader => run.raw_header(&mut inp).await,
            Step::Garbage => run.garbage(&mut inp).await,
            Step::Pump => {
                let n = 4 + usize::from(inp.u8() % 32);
                pump(&mut run.conns, &mut run.m, n).await;
            }
            Step::Switch => run.cur = usize::from(inp.u8()) % run.conns.len(),
            Step::Join => run.join(&mut inp, false).await,
            Step::Reinstate => run.join(&mut inp, true).await,
        }
        pump(&mut run.conns, &mut run.m, 6).await;
    }
    pump(&mut run.conns, &mut run.m, 16).await;
    for i in 0..run.conns.len() {
        let Run { conns, m, .. } = &mut run;
        conns[i].close(m, i).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The check after every input

/// One well-behaved SCSI command on `c`: immediate, unsolicited and R2T-solicited data as
/// negotiated; returns the status and the data-in.
async fn checked_command(
    c: &mut Conn,
    m: &mut Model,
    ops: Ops,
    lun_idx: u16,
    cdb: &[u8],
    read: u32,
    write: Bytes,
) -> (u8, Vec<u8>) {
    let mut cdb16 = [0u8; 16];
    cdb16[..cdb.len()].copy_from_slice(cdb);
    let itt = m.itt();
    let edtl = if write.is_empty() {
        read
    } else {
        write.len() as u32
    };
    let mrdsl = c.tx.max_data_segment_length;
    let imm = if ops.immediate_data {
        edtl.min(ops.first_burst).min(mrdsl) as usize
    } else {
        0
    }
    .min(write.len());
    let unsolicited = if ops.initial_r2t {
        0
    } else {
        (edtl.min(ops.first_burst) as usize).min(write.len())
    };
    let cmd = Pdu::ScsiCommand(ScsiCommand {
        immediate: false,
        final_: unsolicited <= imm,
        read: read > 0,
        write: !write.is_empty(),
        attr: TaskAttr::Simple,
        lun: lun::encode(lun_idx),
        itt,
        expected_data_transfer_length: edtl,
        cmd_sn: m.cmd_sn,
        exp_stat_sn: c.stat_sn,
        cdb: Bytes::copy_from_slice(&cdb16),
        bidi_read_length: None,
        data: write.slice(..imm),
    });
    m.cmd_sn = m.cmd_sn.wrapping_add(1);
    c.send(m, &cmd).await;
    if unsolicited > imm {
        for d in data_outs(
            itt,
            RESERVED_TAG,
            imm as u32,
            &write.slice(imm..unsolicited),
            mrdsl,
        ) {
            c.send(m, &d).await;
        }
    }
    loop {
        if c.rx_buf.is_empty() {
            assert!(!c.eof, "the target closed the check's connection");
            let _ = tokio::time::timeout(Duration::from_millis(100), c.s.readable()).await;
        }
        c.poll(m, 0);
        while let Some((_, r)) = m.r2ts.pop() {
            assert_eq!(r.itt, itt, "R2T for another task");
            let a = r.buffer_offset as usize;
            let b = a + r.desired_data_transfer_length as usize;
            for d in data_outs(itt, r.ttt, r.buffer_offset, &write.slice(a..b), mrdsl) {
                c.send(m, &d).await;
            }
        }
        if let Some(done) = m.done.take() {
            return done;
        }
    }
}

async fn check(addr: SocketAddr, round: u64) {
    let params = LocalParams {
        header_digest: vec![if round & 1 != 0 {
            Digest::Crc32c
        } else {
            Digest::None
        }],
        data_digest: vec![if round & 2 != 0 {
            Digest::Crc32c
        } else {
            Digest::None
        }],
        max_recv_data_segment_length: if round & 4 != 0 { 512 } else { 8192 },
        initial_r2t: round.is_multiple_of(3),
        immediate_data: !round.is_multiple_of(5),
        max_burst_length: 1024,
        first_burst_length: 512,
        max_outstanding_r2t: 1,
        default_time2retain: 0,
        ..LocalParams::default()
    };
    // A leaked session would make this refused as out of resources; one still closing gets
    // its turn first.
    let mut tries = 0;
    let (mut c, o) = loop {
        let l = Login {
            name: CHECKER,
            isid: [0x80, 0, 0, 0, 0xCC, 0xCC],
            tsih: 0,
            cid: 0,
            cmd_sn: 1,
            params: params.clone(),
            role: None,
        };
        match login(addr, l).await {
            Ok(x) => break x,
            Err(st) if tries < 20 => {
                tries += 1;
                let _ = st;
                tokio::time::sleep(Duration::from_millis(5 * tries)).await;
            }
            Err(st) => panic!("the check's login was refused: {st:?}"),
        }
    };
    let ops = Ops::of(&o);
    let mut m = Model {
        cmd_sn: o.exp_cmd_sn,
        max_burst: o.session.max_burst_length,
        next_itt: 0x2000_0000,
        collect: true,
        ..Model::default()
    };
    // Unit attentions first (power on for this nexus, resets the input made).
    let mut ready = false;
    for _ in 0..8 {
        let (st, _) =
            checked_command(&mut c, &mut m, ops, CHECK_LUN, &[0; 6], 0, Bytes::new()).await;
        if st == status::GOOD {
            ready = true;
            break;
        }
        assert_eq!(
            st,
            status::CHECK_CONDITION,
            "TEST UNIT READY status {st:#x}"
        );
    }
    assert!(ready, "TEST UNIT READY never succeeded");
    let lba = (round % 64) as u8;
    let blocks = 4u8;
    let data = pattern(512 * usize::from(blocks), round as u32);
    let w = [0x2A, 0, 0, 0, 0, lba, 0, 0, blocks, 0];
    let (st, _) = checked_command(&mut c, &mut m, ops, CHECK_LUN, &w, 0, data.clone()).await;
    assert_eq!(st, status::GOOD, "the check's WRITE failed");
    let r = [0x28, 0, 0, 0, 0, lba, 0, 0, blocks, 0];
    let (st, got) = checked_command(
        &mut c,
        &mut m,
        ops,
        CHECK_LUN,
        &r,
        data.len() as u32,
        Bytes::new(),
    )
    .await;
    assert_eq!(st, status::GOOD, "the check's READ failed");
    assert!(
        got == data[..],
        "the check read back other data than it wrote"
    );
    // The LUNs the input used still answer (whatever reservations or modes it left).
    for (l, bs) in [(0u16, 512u32), (1, 4096)] {
        let r = [0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0];
        let (st, got) = checked_command(&mut c, &mut m, ops, l, &r, bs, Bytes::new()).await;
        assert!(sam_status(st), "LUN {l} status {st:#x}");
        if st == status::GOOD {
            assert_eq!(got.len(), bs as usize);
        }
    }
    let itt = m.itt();
    let lo = Pdu::LogoutRequest(LogoutRequest {
        immediate: true,
        reason: 0,
        itt,
        cid: 0,
        cmd_sn: m.cmd_sn,
        exp_stat_sn: c.stat_sn,
    });
    c.send(&mut m, &lo).await;
    while m.done.is_none() {
        assert!(
            !c.eof,
            "the target closed the check's connection before its Logout Response"
        );
        let _ = tokio::time::timeout(Duration::from_millis(100), c.s.readable()).await;
        c.poll(&mut m, 0);
    }
    assert_eq!(
        m.done.take().map(|d| d.0),
        Some(0),
        "the check's logout failed"
    );
    c.close(&mut m, 0).await;
}

fuzz_target!(|data: &[u8]| {
    let w = world();
    let round = w.round.fetch_add(1, Ordering::Relaxed);
    w.rt.block_on(async {
        one_input(w.addr, data).await;
        tokio::time::timeout(DEADLINE, check(w.addr, round))
            .await
            .unwrap_or_else(|_| panic!("the target did not serve the check within {DEADLINE:?}"));
    });
});
