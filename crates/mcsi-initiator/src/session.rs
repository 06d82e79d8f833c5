//! A session over one or more TCP connections, driven by tokio: a reader and a writer task per
//! connection around the sans-IO [`SessionCore`], session recovery after a lost connection, and
//! logout.

use crate::conn::{self, LoginOutcome};
use crate::core::{
    Action, Command, ConnRole, ConnStart, ConnStats, Event, Orphan, Response, SessionCore, Timers,
};
use crate::error::Error;
use crate::negotiate::{LoginConfig, LoginDone, Offers, SessionKind, SessionParams};
use crate::route::{self, Bind};
use crate::sched::{self, Scheduler};
use crate::url::IscsiUrl;
use crate::window::CmdWindow;
use bytes::BytesMut;
use mcsi_proto::codes::{logout_reason, logout_response, tmf_function, tmf_response};
use mcsi_proto::keys::ConnectionParams;
use mcsi_proto::pdu::{Isid, LogoutRequest, Pdu, TaskMgmtRequest};
use mcsi_proto::serial::Sn;
use mcsi_tcp::{tcp_state, Congestion, TcpState};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

type Completion = oneshot::Sender<Result<Response, Error>>;

/// How long a Logout or task management request may wait for its answer.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);

/// How often TCP_INFO is sampled for schedulers that look at it.
const TCP_INFO_PERIOD: Duration = Duration::from_millis(20);

/// How to connect.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Connections to open in the session (MC/S). The target's MaxConnections may lower it.
    pub connections: u16,
    /// Scheduler policy name (see [`sched::POLICIES`]).
    pub policy: String,
    pub initiator_name: String,
    pub max_recv_data_segment_length: u32,
    pub first_burst_length: u32,
    pub max_burst_length: u32,
    pub immediate_data: bool,
    pub initial_r2t: bool,
    /// Offer CRC32C header and data digests.
    pub digests: bool,
    /// Offer the asymmetric vendor mode (only mcsi targets accept it; off by default).
    pub asymmetric: bool,
    /// Session re-establishment attempts after a lost connection before giving up.
    pub reconnect_attempts: u32,
    /// A task without status for this long means the session is stuck (a black-holed path, a
    /// lost PDU at ErrorRecoveryLevel 0): it is recovered and the task issued again. Zero
    /// disables the check.
    pub response_timeout: Duration,
    /// A connection with work outstanding that receives nothing for this long (a NOP-Out ping
    /// goes out at half of it) is taken out of the session while the others go on: it is
    /// logged out through another connection, its tasks are cleared at the target (ABORT
    /// TASK) and issued again elsewhere, and its route is retried until a new connection
    /// rejoins. Symmetric sessions of two or more connections only; zero turns it off.
    pub stall_timeout: Duration,
    pub login_timeout: Duration,
    /// CmdSN of the leading login (the first command's CmdSN). Any value is legal.
    pub initial_cmd_sn: u32,
    /// CHAP algorithms to offer when the URL carries credentials, strongest first. The default
    /// is MD5 alone: tgt fails a login whose CHAP_A offers 7,6,5 (SHA3-256, SHA-256, MD5).
    pub chap_algorithms: Vec<mcsi_proto::chap::ChapAlgorithm>,
    /// TCP congestion control for every connection of the session (`TCP_CONGESTION`, set
    /// before the SYN); None leaves the system default.
    pub congestion: Option<Congestion>,
    /// Ask the target to report its sending side's TCP state (`X-org.mcsi.TcpReport`; only mcsi
    /// targets agree, others answer NotUnderstood and the session goes on without).
    pub tcp_report: bool,
    /// Sources of the connections, taken in turn (connection i: bind i mod n); empty: the
    /// system's choice. See [`crate::route`].
    pub binds: Vec<Bind>,
    /// Target portals (`HOST:PORT`, one portal group) of the connections, taken in turn; empty:
    /// the URL's.
    pub portals: Vec<String>,
    /// Open every connection with Multipath TCP (`IPPROTO_MPTCP`); the kernel's path manager
    /// adds subflows, and a target that does not speak it gets plain TCP on the same socket.
    pub mptcp: bool,
    /// When `portals` is empty: ask the URL's portal (SendTargets) for the target's portals
    /// and use those of the first one's portal group in turn.
    pub discover_portals: bool,
    /// Measure each connection's rate and TCP state even when the policy does not look at
    /// them, for [`Session::expected_completion`] (a mirror volume places its reads by it).
    pub measure_rates: bool,
    /// The highest ErrorRecoveryLevel offered (0 to 2): at 1 a PDU lost to a data digest
    /// error is asked for again with a SNACK instead of ending the connection and the session;
    /// at 2 the tasks of a connection that fails move to the session's others (TASK REASSIGN).
    /// Level 2 is offered only by a symmetric session of two or more connections (the only
    /// one it helps); others offer at most 1.
    pub max_erl: u8,
    /// The most the session sends, over all its connections: (bytes per second, burst bytes),
    /// counted on the wire (PDUs plus TCP/IP and Ethernet headers per segment). Commands and
    /// their data wait in the session until the bucket allows them; None: as fast as TCP goes.
    pub send_limit: Option<(u64, u64)>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        let o = Offers::default();
        ConnectOptions {
            connections: 1,
            policy: "round-robin".into(),
            initiator_name: default_initiator_name(),
            max_recv_data_segment_length: o.max_recv_data_segment_length,
            first_burst_length: o.first_burst_length,
            max_burst_length: o.max_burst_length,
            immediate_data: o.immediate_data,
            initial_r2t: o.initial_r2t,
            digests: false,
            asymmetric: false,
            reconnect_attempts: 5,
            response_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(4),
            login_timeout: Duration::from_secs(15),
            initial_cmd_sn: 1,
            chap_algorithms: vec![mcsi_proto::chap::ChapAlgorithm::Md5],
            congestion: None,
            tcp_report: false,
            binds: Vec::new(),
            portals: Vec::new(),
            mptcp: false,
            discover_portals: false,
            measure_rates: false,
            max_erl: o.max_erl,
            send_limit: None,
        }
    }
}

/// The host's initiator name from open-iscsi's `/etc/iscsi/initiatorname.iscsi` when it has
/// one, else `iqn.2026-01.org.mcsi:<hostname>`.
pub fn default_initiator_name() -> String {
    // The host's own name, as open-iscsi keeps it: the name its targets' ACLs already know.
    if let Some(n) = std::fs::read_to_string(OPEN_ISCSI_NAME_FILE)
        .ok()
        .and_then(|t| initiator_name_in(&t))
    {
        return n;
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_ascii_lowercase())
        .filter(|h| {
            !h.is_empty()
                && h.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        })
        .unwrap_or_else(|| "initiator".into());
    format!("iqn.2026-01.org.mcsi:{host}")
}

/// Where open-iscsi keeps the host's initiator name (`InitiatorName=iqn...`).
pub const OPEN_ISCSI_NAME_FILE: &str = "/etc/iscsi/initiatorname.iscsi";

/// The name an open-iscsi `initiatorname.iscsi` file gives: its `InitiatorName=` line, when
/// the name is an iqn., eui. or naa. name without white space; None otherwise.
pub fn initiator_name_in(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix("InitiatorName="))
        .map(str::trim)
        .filter(|n| {
            let lower = n.to_ascii_lowercase();
            (lower.starts_with("iqn.") || lower.starts_with("eui.") || lower.starts_with("naa."))
                && n.len() <= 223
                && !n.chars().any(|c| c.is_whitespace() || c.is_control())
        })
        .map(str::to_string)
}

/// Random bytes from the operating system's CSPRNG (the session core's logins draw CHAP's
/// challenges through this, [`LoginConfig::random`]).
pub fn os_random(buf: &mut [u8]) {
    use rand::RngCore;
    rand::rngs::OsRng.fill_bytes(buf);
}

/// A random ISID of type "random" (RFC 7143 11.12.5: T=10b, A and B/C random), from the
/// operating system's CSPRNG: two initiators on one host (or one restarted) must not pick the
/// same one, or the second login reinstates the first's session.
fn random_isid() -> Isid {
    let mut v = [0u8; 5];
    os_random(&mut v);
    Isid([0x80 | (v[0] & 0x3f), v[1], v[2], v[3], v[4], 0])
}

/// One connection's statistics, with the socket's TCP_INFO.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectionStats {
    pub index: usize,
    pub counters: ConnStats,
    pub tcp: Option<TcpState>,
    /// The congestion control the socket really runs.
    pub congestion: Option<String>,
    /// Its Multipath TCP subflows, when it runs MPTCP.
    pub mptcp: Option<mcsi_tcp::mptcp::MptcpState>,
    /// The target's address of this connection.
    pub peer: Option<std::net::SocketAddr>,
    /// This host's address of this connection.
    pub local: Option<std::net::SocketAddr>,
    /// The source the connection was asked to leave from (`--bind`), if any.
    pub bind: Option<String>,
    /// The target's sending side of this connection, as it last reported it
    /// (`X-org.mcsi.TcpReport`).
    pub target_tcp: Option<TcpState>,
}

/// A snapshot of the session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionStats {
    pub tsih: u16,
    pub policy: &'static str,
    pub connections: Vec<ConnectionStats>,
    /// Times the session was re-established after a failure.
    pub recoveries: u32,
    /// Connections taken out of the session because they stalled, with the session going on
    /// over the others, and new connections that rejoined in their place.
    pub failovers: u32,
    pub rejoins: u32,
    /// Commands issued again from the start after a failure: every command without status
    /// when the session was logged in again (with those still queued behind the CmdSN window,
    /// which go out then for the first time), a stalled connection's when it was taken out,
    /// and at ErrorRecoveryLevel 2 those of a failed connection that the target never received.
    pub reissued: u64,
    /// Tasks of a failed connection that went on at another with TASK REASSIGN
    /// (ErrorRecoveryLevel 2), without being issued again.
    pub reassigned: u64,
    /// Times a command waited because MaxCmdSN closed the window.
    pub window_waits: u64,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
}

struct ConnHandle {
    tx: mpsc::UnboundedSender<Pdu>,
    /// Immediate control PDUs (pings, Logout, task management): the writer sends them ahead
    /// of the data queued on `tx`.
    urgent: mpsc::UnboundedSender<Pdu>,
    /// A duplicate of the socket, to read TCP_INFO and to shut the connection down.
    sock: socket2::Socket,
    /// Which connection this is, over the session's life: its reader and writer report with
    /// it, so that reports of a connection another has replaced are ignored.
    serial: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    Recovering,
    Closing,
    Closed,
}

struct Inner {
    core: SessionCore<Completion>,
    conns: Vec<ConnHandle>,
    generation: u64,
    phase: Phase,
    control: HashMap<u32, oneshot::Sender<Pdu>>,
    tsih: u16,
    recoveries: u32,
    reissued: u64,
    reassigned: u64,
    /// Connections taken out of the session when they stalled, and new ones that rejoined.
    failovers: u32,
    rejoins: u32,
    next_serial: u64,
    /// Set by [`Session::remeasure`]: the sampler starts its rate meters afresh.
    remeasure: bool,
}

impl Inner {
    /// Whether `serial` is still the connection in slot `conn`.
    fn current(&self, conn: usize, serial: u64) -> bool {
        self.conns.get(conn).is_some_and(|h| h.serial == serial)
    }
}

struct Shared {
    inner: Mutex<Inner>,
    url: IscsiUrl,
    options: ConnectOptions,
    isid: Isid,
    /// Wakes the timer task ([`run_timers`]) when an input set an earlier deadline.
    timer_wake: tokio::sync::Notify,
    /// The bucket of [`ConnectOptions::send_limit`], shared by the session's writers.
    send_bucket: Option<Arc<Mutex<mcsi_tcp::pace::TokenBucket>>>,
}

/// An iSCSI session. Cheap to clone; all clones share the session.
#[derive(Clone)]
pub struct Session {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("url", &self.shared.url.to_string())
            .finish()
    }
}

/// Connections of a freshly established session.
struct Established {
    done: LoginDone,
    conns: Vec<EstablishedConn>,
    window: CmdWindow,
}

/// One logged-in connection.
struct EstablishedConn {
    stream: TcpStream,
    cid: u16,
    /// StatSN of its final login response.
    stat_sn: u32,
    /// What it carries, as the target agreed.
    role: ConnRole,
    /// What its own login negotiated (digests, data segment lengths).
    params: ConnectionParams,
    /// Bytes that came after its final login response.
    rest: BytesMut,
}

fn lock(shared: &Shared) -> MutexGuard<'_, Inner> {
    // A panic while holding the lock cannot leave the core half-updated in a way later calls
    // rely on; keep going with the data.
    shared.inner.lock().unwrap_or_else(|p| p.into_inner())
}

fn parse_target_address(a: &str) -> String {
    // "host:port,tpgt" or "[v6]:port,tpgt" (RFC 7143 13.8).
    a.split(',').next().unwrap_or(a).to_string()
}

async fn login_conn(
    addr: &str,
    cfg: LoginConfig,
    dial: &conn::Dial<'_>,
) -> Result<(TcpStream, Box<LoginDone>, BytesMut), Error> {
    let mut addr = addr.to_string();
    for _ in 0..4 {
        let mut s = conn::connect_tcp(&addr, dial).await?;
        match conn::login(&mut s, cfg.clone(), dial.timeout).await? {
            LoginOutcome::Done(d, rest) => return Ok((s, d, rest)),
            LoginOutcome::Redirect(to) => {
                let to = parse_target_address(&to);
                tracing::info!(from = %addr, to = %to, "target redirects the login");
                addr = to;
            }
        }
    }
    Err(Error::Protocol("more than 3 login redirections".into()))
}

fn dial<'a>(o: &ConnectOptions, bind: Option<&'a Bind>, timeout: Duration) -> conn::Dial<'a> {
    conn::Dial {
        timeout,
        congestion: o.congestion,
        bind,
        mptcp: o.mptcp,
    }
}

/// The leading login's configuration; connections added later change CID, TSIH, ITT and CmdSN.
fn login_config(url: &IscsiUrl, o: &ConnectOptions, isid: Isid) -> Result<LoginConfig, Error> {
    let offers = Offers {
        max_connections: o.connections.max(1),
        max_recv_data_segment_length: o.max_recv_data_segment_length,
        max_burst_length: o.max_burst_length,
        first_burst_length: o.first_burst_length,
        immediate_data: o.immediate_data,
        initial_r2t: o.initial_r2t,
        digests: o.digests,
        asymmetric: o.asymmetric,
        tcp_report: o.tcp_report,
        // Level 2 only where this initiator can use it (a failed connection's tasks move to
        // another: a symmetric session of several), since the target then keeps every
        // connection's Data-In until acknowledged (a fifth more of its work per 4 KiB read).
        max_erl: if o.connections >= 2 && !o.asymmetric {
            o.max_erl
        } else {
            o.max_erl.min(1)
        },
    };
    Ok(LoginConfig {
        initiator_name: o.initiator_name.clone(),
        target_name: Some(url.target.clone()),
        kind: SessionKind::Normal,
        isid,
        tsih: 0,
        cid: 0,
        itt: 0,
        cmd_sn: o.initial_cmd_sn,
        offers,
        chap: match &url.user {
            Some(u) => Some((u.clone(), url.chap_secret()?)),
            None => None,
        },
        chap_algorithms: o.chap_algorithms.clone(),
        // The leading connection carries requests (thesis 4.3.3: connections 1..n).
        role: ConnRole::Requests,
        random: os_random,
    })
}

async fn establish(url: &IscsiUrl, o: &ConnectOptions, isid: Isid) -> Result<Established, Error> {
    let want = o.connections.max(1);
    let cfg = login_config(url, o, isid)?;
    let default_portal = url.address();
    let (bind0, addr0) = route::of(&o.binds, &o.portals, &default_portal, 0);
    let (s0, done, rest0) =
        login_conn(addr0, cfg.clone(), &dial(o, bind0, o.login_timeout)).await?;
    let mut window = CmdWindow::new(done.exp_cmd_sn, done.max_cmd_sn);
    let n = want.min(done.params.max_connections.max(1));
    if n < want {
        tracing::warn!(
            requested = want,
            max_connections = done.params.max_connections,
            "the target allows {} connection(s) per session (MaxConnections={}); using {} instead of {}",
            done.params.max_connections,
            done.params.max_connections,
            n,
            want
        );
    }
    // Asymmetric mode: the first half (rounded up) of the connections carry requests, the
    // others responses. The target's answer to each login's role key is what counts.
    let asym = done.params.asymmetric && n >= 2;
    if o.asymmetric && !done.params.asymmetric {
        tracing::warn!("the target does not agree to the asymmetric mode; every connection carries requests and responses");
    }
    let agreed = |r: ConnRole| if asym { r } else { ConnRole::Both };
    let requests = n - n / 2;
    let mut conns = vec![EstablishedConn {
        stream: s0,
        cid: 0,
        stat_sn: done.stat_sn,
        role: agreed(done.role),
        params: done.connection,
        rest: rest0,
    }];
    for cid in 1..n {
        let c = LoginConfig {
            tsih: done.tsih,
            cid,
            itt: u32::from(cid),
            cmd_sn: window.next_cmd_sn(),
            role: if cid < requests {
                ConnRole::Requests
            } else {
                ConnRole::Responses
            },
            ..cfg.clone()
        };
        let (bind, addr) = route::of(&o.binds, &o.portals, &default_portal, usize::from(cid));
        match login_conn(addr, c, &dial(o, bind, o.login_timeout)).await {
            Ok((s, d, rest)) => {
                window.update(d.exp_cmd_sn, d.max_cmd_sn);
                conns.push(EstablishedConn {
                    stream: s,
                    cid,
                    stat_sn: d.stat_sn,
                    role: agreed(d.role),
                    params: d.connection,
                    rest,
                });
            }
            Err(e) => {
                tracing::warn!(cid, portal = %addr, bind = bind.map(|b| b.to_string()), error = %e, "could not add connection {cid} to the session; going on with {}", conns.len());
                break;
            }
        }
    }
    Ok(Established {
        done: *done,
        conns,
        window,
    })
}

/// Log in to `url` and open the session's connections.
pub async fn connect(url: &IscsiUrl, options: ConnectOptions) -> Result<Session, Error> {
    connect_as(url, options, random_isid()).await
}

/// [`connect`] with the ISID of an earlier session of this initiator to the same target (its
/// [`Session::isid`]): the target ends that session, and aborts its tasks, before this one
/// starts (session reinstatement, RFC 7143 6.3.5), so nothing the earlier session still had in
/// flight lands after this one has begun.
pub async fn reinstate(
    url: &IscsiUrl,
    options: ConnectOptions,
    isid: Isid,
) -> Result<Session, Error> {
    connect_as(url, options, isid).await
}

async fn connect_as(
    url: &IscsiUrl,
    mut options: ConnectOptions,
    isid: Isid,
) -> Result<Session, Error> {
    let scheduler: Box<dyn Scheduler> = sched::policy(&options.policy)?;
    if options.discover_portals && options.portals.is_empty() {
        options.portals = discovered_portals(url, &options).await?;
    }
    let est = establish(url, &options, isid).await?;
    let shared = Arc::new(Shared {
        inner: Mutex::new(Inner {
            core: {
                let mut core = SessionCore::new(scheduler);
                core.set_timers(Timers {
                    response: options.response_timeout,
                    stall: options.stall_timeout,
                });
                core
            },
            conns: Vec::new(),
            generation: 0,
            phase: Phase::Running,
            control: HashMap::new(),
            tsih: 0,
            recoveries: 0,
            reissued: 0,
            reassigned: 0,
            failovers: 0,
            rejoins: 0,
            next_serial: 0,
            remeasure: false,
        }),
        url: url.clone(),
        send_bucket: options.send_limit.map(|(rate, burst)| {
            Arc::new(Mutex::new(mcsi_tcp::pace::TokenBucket::new(
                rate,
                burst,
                std::time::Instant::now(),
            )))
        }),
        options,
        isid,
        timer_wake: tokio::sync::Notify::new(),
    });
    // Digests are per connection; the log names them once when every connection agrees.
    let digest_of = |c: &EstablishedConn| (c.params.header_digest, c.params.data_digest);
    let digests = match est.conns.first().map(digest_of) {
        Some((h, d)) if est.conns.iter().all(|c| digest_of(c) == (h, d)) => {
            format!("header {}, data {}", h.as_str(), d.as_str())
        }
        _ => "differ by connection".to_owned(),
    };
    install(&shared, est)?;
    let s = Session { shared };
    {
        let inner = lock(&s.shared);
        let p = inner.core.params();
        tracing::info!(
            target = %s.shared.url,
            tsih = inner.tsih,
            connections = inner.conns.len(),
            policy = inner.core.scheduler_name(),
            immediate_data = p.immediate_data,
            initial_r2t = p.initial_r2t,
            first_burst = p.first_burst_length,
            max_burst = p.max_burst_length,
            target_mrdsl = p.target_max_recv_dsl,
            digests = %digests,
            "session established"
        );
    }
    Ok(s)
}

/// The portals SendTargets at the URL's portal lists for the URL's target, in the portal group
/// of the first one (a session's connections must stay in one group, RFC 7143 4.4); none listed
/// means the URL's own portal.
async fn discovered_portals(url: &IscsiUrl, o: &ConnectOptions) -> Result<Vec<String>, Error> {
    let at = url.address();
    let targets = crate::discovery::discover(&at, &o.initiator_name, o.login_timeout).await?;
    let Some(t) = targets.iter().find(|t| t.name == url.target) else {
        return Err(Error::InvalidArgument(format!(
            "SendTargets at {at} does not list {} (it lists: {})",
            url.target,
            targets
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    };
    let group = |a: &str| a.rsplit_once(',').map(|(_, g)| g.to_string());
    let first = t.addresses.first().and_then(|a| group(a));
    let portals: Vec<String> = t
        .addresses
        .iter()
        .filter(|a| group(a) == first)
        .map(|a| parse_target_address(a))
        .collect();
    tracing::info!(
        target = %url.target,
        discovery = %at,
        portals = ?portals,
        "portals from SendTargets"
    );
    Ok(portals)
}

/// Put established connections to work: spawn reader and writer tasks, restart the core.
fn install(shared: &Arc<Shared>, est: Established) -> Result<(), Error> {
    let mut inner = lock(shared);
    inner.generation += 1;
    let generation = inner.generation;
    let params = est.done.params.clone();
    let mut handles = Vec::new();
    let mut starts = Vec::new();
    for (i, c) in est.conns.into_iter().enumerate() {
        let recover = params.error_recovery_level > 0;
        let (h, start) = spawn_conn(shared, &mut inner, i, c, recover)?;
        handles.push(h);
        starts.push(start);
    }
    inner.conns = handles;
    inner.tsih = est.done.tsih;
    inner.phase = Phase::Running;
    let mut out = Vec::new();
    inner.core.start(params, est.window, &starts, &mut out);
    run_actions(shared, &mut inner, out);
    let sh = Arc::clone(shared);
    tokio::spawn(async move { run_timers(sh, generation).await });
    if inner.core.scheduler_wants_tcp_info() || shared.options.measure_rates {
        let sh = Arc::clone(shared);
        tokio::spawn(async move { sample_tcp_info(sh, generation).await });
    }
    if !shared.options.stall_timeout.is_zero() && inner.conns.len() >= 2 && !inner.core.symmetric()
    {
        tracing::info!(
            "asymmetric session: a stalled connection is recovered with the whole session"
        );
    }
    Ok(())
}

/// The session core's timers (response watchdog, stall watch, logout deadlines) for one
/// generation of connections: sleep until the core's `poll_timeout` (or until an input sets an
/// earlier one), then hand it the time. What falls due comes out as events ([`handle_event`]).
async fn run_timers(shared: Arc<Shared>, generation: u64) {
    loop {
        let deadline = {
            let mut inner = lock(&shared);
            if inner.generation != generation || inner.phase != Phase::Running {
                // Recovery installs a new generation with its own timer task.
                return;
            }
            let mut out = Vec::new();
            inner
                .core
                .handle_timeout(Instant::now().into_std(), &mut out);
            run_actions(&shared, &mut inner, out);
            inner.core.poll_timeout()
        };
        match deadline {
            Some(t) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(Instant::from_std(t)) => {}
                    _ = shared.timer_wake.notified() => {}
                }
            }
            None => shared.timer_wake.notified().await,
        }
    }
}

/// Spawn the reader and writer of logged-in connection `c`, which takes slot `index`;
/// `recover`: the session is at ErrorRecoveryLevel 1 or above, so a PDU with a data digest error
/// goes to the core instead of ending the connection.
fn spawn_conn(
    shared: &Arc<Shared>,
    inner: &mut Inner,
    index: usize,
    c: EstablishedConn,
    recover: bool,
) -> Result<(ConnHandle, ConnStart), Error> {
    let EstablishedConn {
        stream,
        cid,
        stat_sn,
        role,
        params: cp,
        rest,
    } = c;
    // Each connection frames by what its own login negotiated.
    let (send_framing, recv_framing) = (cp.tx_framing(), cp.rx_framing());
    let sock = socket2::SockRef::from(&stream)
        .try_clone()
        .map_err(|e| Error::io("duplicating the socket", &e))?;
    inner.next_serial += 1;
    let serial = inner.next_serial;
    let pace = shared.send_bucket.as_ref().map(|b| conn::Pace {
        bucket: Arc::clone(b),
        mss: tcp_state(&sock).map_or(1448, |t| t.snd_mss).max(536),
    });
    let (r, w) = stream.into_split();
    let (tx, rx) = mpsc::unbounded_channel();
    let (urgent, urgent_rx) = mpsc::unbounded_channel();
    let sh = Arc::clone(shared);
    tokio::spawn(async move {
        if let Err(e) = conn::writer(w, rx, urgent_rx, send_framing, pace).await {
            connection_failed(&sh, index, serial, Error::io("writing to the target", &e));
        }
    });
    let sh = Arc::clone(shared);
    let sink_sh = Arc::clone(shared);
    tokio::spawn(async move {
        let err = conn::reader(r, recv_framing, rest, recover, move |pdus| {
            on_pdus(&sink_sh, index, serial, pdus)
        })
        .await;
        connection_failed(&sh, index, serial, err);
    });
    let handle = ConnHandle {
        tx,
        urgent,
        sock,
        serial,
    };
    let start = ConnStart {
        cid,
        role,
        stat_sn,
        max_send_dsl: Some(cp.max_send_data_segment_length),
    };
    Ok((handle, start))
}

/// Take connection `conn` out of the session: no new task goes to it, and [`evict`] clears
/// its tasks at the target and issues them again elsewhere.
/// ErrorRecoveryLevel 2 agreed with a DefaultTime2Retain, in a symmetric session with another
/// connection alive besides `conn`: a failed connection's tasks can move to the others.
fn can_reassign(inner: &Inner, conn: usize) -> bool {
    let p = inner.core.params();
    p.error_recovery_level >= 2
        && p.default_time2retain > 0
        && inner.core.symmetric()
        && (0..inner.conns.len()).any(|i| i != conn && inner.core.conn_alive(i))
}

/// ErrorRecoveryLevel 2 (RFC 7143 6.2): connection `conn` failed (`why`); its tasks move to the
/// session's other connections and its route is retried, the session going on.
fn fail_over_for_recovery(shared: &Arc<Shared>, inner: &mut Inner, conn: usize, why: &str) {
    let orphans = inner.core.fail_over(conn);
    inner.failovers += 1;
    let cid = inner.core.cid(conn).unwrap_or_default();
    tracing::warn!(
        conn,
        cid,
        tasks = orphans.len(),
        "connection {conn} {why}; taking it out of the session and moving its {} task(s) to the other connections (ErrorRecoveryLevel 2)",
        orphans.len()
    );
    let (sh, generation) = (Arc::clone(shared), inner.generation);
    tokio::spawn(async move { reassign_orphans(sh, conn, generation, cid, orphans).await });
}

/// Move the tasks of failed connection `conn` (CID `cid`) to the others (ErrorRecoveryLevel
/// 2): Logout "remove the connection for recovery" of its CID through another connection (the
/// target keeps its tasks for reassignment), then TASK REASSIGN of each task on another
/// connection: one the target took over goes on there (a read gets its Data-In from the first
/// it still needs, a write new R2Ts for what it still owes); one the target does not have (it
/// never received the command) is issued again. Anything else recovers the session, as before.
/// Then the route is retried ([`rejoin`]).
async fn reassign_orphans(
    shared: Arc<Shared>,
    conn: usize,
    generation: u64,
    cid: u16,
    orphans: Vec<Orphan>,
) {
    let started = Instant::now();
    let session = Session {
        shared: Arc::clone(&shared),
    };
    let result = async {
        use futures_util::future::{join, join_all};
        // RFC 7143 6.2.2: the Logout "remove the connection for recovery" MUST have completed
        // before any of the connection's tasks is reassigned; a target may act on the Logout
        // only when it answers it (LIO does), and a TASK REASSIGN that overtakes it finds no
        // task to move. A target that agreed to X-org.mcsi.ReassignBehindLogout (mcsi's: it
        // handles a connection's immediate requests in order) takes the first TASK REASSIGNs
        // right behind the Logout on the same connection, and the tasks move within one round
        // trip instead of two.
        let behind = lock(&shared).core.params().reassign_behind_logout;
        let early_ones = if behind {
            orphans.len().min(ABORTS_AT_ONCE)
        } else {
            0
        };
        let (first, rest) = orphans.split_at(early_ones);
        let (answer, early) = join(
            session.logout_elsewhere(conn, cid, logout_reason::RECOVERY),
            join_all(first.iter().map(|o| session.ask_reassign(conn, *o))),
        )
        .await;
        let mut answer = answer?;
        let mut moved = 0usize;
        let mut not_found = Vec::new();
        tally(first, early, &mut moved, &mut not_found)?;
        let mut pending: Vec<Orphan> = rest.to_vec();
        if answer == logout_response::CID_NOT_FOUND {
            // The target has not seen the connection fail (Linux's LIO keeps a connection for
            // recovery only once it has noticed the failure itself): its "task not found"
            // meant nothing yet. Asked again a moment later it may have; one that still has
            // not (a silent route: it may not notice for many seconds) holds the tasks on a
            // connection it thinks alive, and they are cleared as a stalled connection's are
            // ([`evict`]).
            if moved > 0 {
                return Err(Error::Protocol(format!(
                    "the target reassigned {moved} task(s) of connection {cid} but did not know the connection"
                )));
            }
            tokio::time::sleep(RECOVERY_LOGOUT_RETRY).await;
            answer = session
                .logout_elsewhere(conn, cid, logout_reason::RECOVERY)
                .await?;
            if answer == logout_response::CID_NOT_FOUND {
                return Ok(None);
            }
            pending.splice(0..0, not_found.drain(..));
        }
        for chunk in pending.chunks(ABORTS_AT_ONCE) {
            let answers = join_all(chunk.iter().map(|o| session.ask_reassign(conn, *o))).await;
            tally(chunk, answers, &mut moved, &mut not_found)?;
        }
        let answered = started.elapsed();
        // Never received whole: ABORT TASK takes each one's CmdSN as received (else the
        // target holds every later command), then it is issued again.
        for chunk in not_found.chunks(ABORTS_AT_ONCE) {
            for r in join_all(chunk.iter().map(|o| session.abort_orphan(conn, *o))).await {
                r?;
            }
        }
        let again: Vec<u32> = not_found.iter().map(|o| o.itt).collect();
        Ok(Some((moved, again, answered)))
    }
    .await;
    let mut inner = lock(&shared);
    if inner.generation != generation || inner.phase != Phase::Running {
        return;
    }
    let (moved, again, answered) = match result {
        Ok(Some(r)) => r,
        Ok(None) => {
            tracing::warn!(
                conn,
                cid,
                "the target does not hold connection {conn} for recovery (it answered \"CID not found\" twice): closing it and issuing its {} task(s) again",
                orphans.len()
            );
            let sh = Arc::clone(&shared);
            tokio::spawn(async move { evict(sh, conn, generation, cid, orphans, started).await });
            return;
        }
        Err(e) => {
            tracing::warn!(conn, error = %e, "could not move the failed connection's tasks; recovering the session");
            begin_recovery(&shared, &mut inner, generation, e, Duration::ZERO);
            return;
        }
    };
    if let Some(h) = inner.conns.get(conn) {
        let _ = h.sock.shutdown(std::net::Shutdown::Both);
    }
    inner.reissued += again.len() as u64;
    inner.reassigned += moved as u64;
    let mut out = Vec::new();
    inner.core.reissue(&again, &mut out);
    run_actions(&shared, &mut inner, out);
    tracing::info!(
        conn,
        moved,
        issued_again = again.len(),
        behind_logout = inner.core.params().reassign_behind_logout,
        "the failed connection's tasks moved to the others in {:.1?} (TASK REASSIGNs answered in {answered:.1?})",
        started.elapsed()
    );
    let sh = Arc::clone(&shared);
    tokio::spawn(async move { rejoin(sh, conn, generation).await });
}

/// Sorts the answers to the TASK REASSIGNs of `asked`: taken over (counted in `moved`), or
/// not found (kept in `not_found`); the first error stops it.
fn tally(
    asked: &[Orphan],
    answers: Vec<Result<bool, Error>>,
    moved: &mut usize,
    not_found: &mut Vec<Orphan>,
) -> Result<(), Error> {
    for (o, r) in asked.iter().zip(answers) {
        if r? {
            *moved += 1;
        } else {
            not_found.push(*o);
        }
    }
    Ok(())
}

fn fail_over(shared: &Arc<Shared>, inner: &mut Inner, conn: usize, silent: Duration) {
    if can_reassign(inner, conn) {
        let why = format!("received nothing for {silent:.1?} with work outstanding");
        fail_over_for_recovery(shared, inner, conn, &why);
        return;
    }
    let orphans = inner.core.fail_over(conn);
    inner.failovers += 1;
    let cid = inner.core.cid(conn).unwrap_or_default();
    let local = inner.conns[conn]
        .sock
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket());
    tracing::warn!(
        conn,
        cid,
        local = local.map(|a| a.to_string()),
        tasks = orphans.len(),
        "connection {conn} received nothing for {silent:.1?} with work outstanding; taking it out of the session and issuing its {} task(s) on the others",
        orphans.len()
    );
    let (sh, generation) = (Arc::clone(shared), inner.generation);
    let started = Instant::now() - silent;
    tokio::spawn(async move { evict(sh, conn, generation, cid, orphans, started).await });
}

/// Clear a stalled connection at the target and issue its tasks again: Logout of its CID
/// through another connection (the target aborts the tasks it received on it and closes it),
/// then ABORT TASK for each task (a command the target never received leaves a hole in the
/// CmdSN order that holds every later command; ABORT TASK of a task not found with its
/// RefCmdSN in the window takes the CmdSN as received, RFC 7143 11.5.1). A target that answers
/// otherwise gets session recovery, as before. Then the tasks go out again and the route is
/// retried ([`rejoin`]).
async fn evict(
    shared: Arc<Shared>,
    conn: usize,
    generation: u64,
    cid: u16,
    orphans: Vec<Orphan>,
    started: Instant,
) {
    let session = Session {
        shared: Arc::clone(&shared),
    };
    let result = async {
        session
            .logout_elsewhere(conn, cid, logout_reason::CLOSE_CONNECTION)
            .await?;
        // The Logout Response's ExpCmdSN says which commands the target had: those before it
        // were received (and ended by the logout). A command from it on left a hole, which
        // ABORT TASK fills; the aborts go out together, a few at a time.
        let exp = lock(&shared).core.window().exp_cmd_sn();
        let holes: Vec<Orphan> = orphans
            .iter()
            .filter(|o| !Sn::lt(Sn(o.cmd_sn), Sn(exp)))
            .copied()
            .collect();
        tracing::debug!(
            conn,
            tasks = orphans.len(),
            holes = holes.len(),
            exp_cmd_sn = exp,
            "stalled connection logged out; filling the CmdSN holes it left"
        );
        for chunk in holes.chunks(ABORTS_AT_ONCE) {
            let mut set = tokio::task::JoinSet::new();
            for o in chunk.iter().copied() {
                let s = session.clone();
                set.spawn(async move { s.abort_orphan(conn, o).await });
            }
            while let Some(r) = set.join_next().await {
                r.map_err(|e| Error::Protocol(format!("an ABORT TASK request failed: {e}")))??;
            }
        }
        Ok(())
    }
    .await;
    let mut inner = lock(&shared);
    if inner.generation != generation || inner.phase != Phase::Running {
        return;
    }
    if let Err(e) = result {
        tracing::warn!(conn, error = %e, "could not take the stalled connection out alone; recovering the session");
        begin_recovery(&shared, &mut inner, generation, e, Duration::ZERO);
        return;
    }
    if let Some(h) = inner.conns.get(conn) {
        let _ = h.sock.shutdown(std::net::Shutdown::Both);
    }
    let itts: Vec<u32> = orphans.iter().map(|o| o.itt).collect();
    inner.reissued += itts.len() as u64;
    let mut out = Vec::new();
    inner.core.reissue(&itts, &mut out);
    run_actions(&shared, &mut inner, out);
    tracing::info!(
        conn,
        tasks = itts.len(),
        remaining = inner.core.usable_conns(),
        "stalled connection logged out, its tasks issued again {:.1?} after it went silent",
        started.elapsed()
    );
    let sh = Arc::clone(&shared);
    tokio::spawn(async move { rejoin(sh, conn, generation).await });
}

/// Task management `function` (ABORT TASK, TASK REASSIGN) about orphan `o`, as request `itt`
/// on connection `via`. TASK REASSIGN gives the first Data-In the task still needs.
fn orphan_tmf(
    core: &SessionCore<Completion>,
    function: u8,
    o: Orphan,
    itt: u32,
    via: usize,
) -> Pdu {
    Pdu::TaskMgmtRequest(TaskMgmtRequest {
        immediate: true,
        function,
        lun: o.lun,
        itt,
        referenced_task_tag: o.itt,
        cmd_sn: core.immediate_cmd_sn(),
        exp_stat_sn: core.exp_stat_sn(via),
        ref_cmd_sn: o.cmd_sn,
        exp_data_sn: if function == tmf_function::TASK_REASSIGN {
            core.exp_data_sn(o.itt)
        } else {
            0
        },
    })
}

fn unexpected(wanted: &str, got: &Pdu) -> Error {
    Error::Protocol(format!("expected {wanted}, got {:?}", got.opcode()))
}

/// ABORT TASK requests in flight at once when clearing a stalled connection (mcsi's target
/// takes 16 immediate control requests at a time).
const ABORTS_AT_ONCE: usize = 8;

/// How long to wait before asking again for a failed connection's removal for recovery that
/// the target answered "CID not found" (it may not have noticed the failure yet).
const RECOVERY_LOGOUT_RETRY: Duration = Duration::from_millis(200);

/// Longest wait between two attempts to bring a failed-over connection's route back.
const REJOIN_MAX_DELAY: Duration = Duration::from_secs(10);

/// Log a new connection in on slot `conn`'s route (its bind and portal, the same CID) with
/// backoff, until it succeeds or the session ends; it then carries tasks again.
async fn rejoin(shared: Arc<Shared>, conn: usize, generation: u64) {
    let o = &shared.options;
    let default_portal = shared.url.address();
    let (bind, addr) = route::of(&o.binds, &o.portals, &default_portal, conn);
    let (bind, addr) = (bind.cloned(), addr.to_string());
    let gone = Instant::now();
    let mut delay = Duration::from_secs(1);
    let mut login_cid;
    for attempt in 1u32.. {
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(REJOIN_MAX_DELAY);
        let cfg = {
            let inner = lock(&shared);
            if inner.generation != generation || inner.phase != Phase::Running {
                return;
            }
            let Some(cid) = inner.core.cid(conn) else {
                return;
            };
            login_cid = cid;
            let base = match login_config(&shared.url, o, shared.isid) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!("connection {cid} cannot log in again: {e}");
                    return;
                }
            };
            LoginConfig {
                tsih: inner.tsih,
                cid,
                itt: u32::from(cid) | 0x8000_0000,
                cmd_sn: inner.core.immediate_cmd_sn(),
                ..base
            }
        };
        let connect_timeout = o.login_timeout.min(Duration::from_secs(5));
        match login_conn(&addr, cfg, &dial(o, bind.as_ref(), connect_timeout)).await {
            Ok((stream, d, rest)) => {
                let mut inner = lock(&shared);
                if inner.generation != generation
                    || inner.phase != Phase::Running
                    || inner.core.conn_alive(conn)
                {
                    return;
                }
                inner.core.update_window(d.exp_cmd_sn, d.max_cmd_sn);
                let c = EstablishedConn {
                    stream,
                    cid: login_cid,
                    stat_sn: d.stat_sn,
                    role: ConnRole::Both,
                    params: d.connection,
                    rest,
                };
                let recover = inner.core.params().error_recovery_level > 0;
                match spawn_conn(&shared, &mut inner, conn, c, recover) {
                    Ok((h, start)) => {
                        inner.conns[conn] = h;
                        inner.rejoins += 1;
                        let mut out = Vec::new();
                        inner.core.conn_up(conn, start, &mut out);
                        run_actions(&shared, &mut inner, out);
                        tracing::info!(
                            conn,
                            attempt,
                            portal = %addr,
                            "connection {conn} rejoined the session {:.1?} after it was taken out",
                            gone.elapsed()
                        );
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(conn, error = %e, "could not start the rejoined connection")
                    }
                }
            }
            Err(e) => {
                let level_warn = attempt == 1;
                if level_warn {
                    tracing::warn!(conn, portal = %addr, bind = bind.as_ref().map(|b| b.to_string()), error = %e, "route of connection {conn} still down; retrying with backoff up to {REJOIN_MAX_DELAY:?}");
                } else {
                    tracing::info!(conn, attempt, error = %e, "route of connection {conn} still down; next try in {delay:?}");
                }
            }
        }
    }
}

/// Feed each connection's TCP_INFO, and the rate it completes data at while busy, to the
/// scheduler while this generation of connections lives.
async fn sample_tcp_info(shared: Arc<Shared>, generation: u64) {
    let mut tick = tokio::time::interval(TCP_INFO_PERIOD);
    let t0 = tokio::time::Instant::now();
    let mut meters: Vec<crate::sched::RateMeter> = Vec::new();
    loop {
        tick.tick().await;
        let mut inner = lock(&shared);
        if inner.generation != generation || inner.phase == Phase::Closed {
            return;
        }
        let samples: Vec<(usize, TcpState)> = inner
            .conns
            .iter()
            .enumerate()
            .filter_map(|(i, h)| tcp_state(&h.sock).ok().map(|t| (i, t)))
            .collect();
        for (i, t) in samples {
            inner.core.set_tcp(i, t);
        }
        let now = t0.elapsed().as_secs_f64();
        if std::mem::take(&mut inner.remeasure) {
            meters.clear();
        }
        let stats = inner.core.conn_stats();
        meters.resize_with(stats.len(), Default::default);
        for (i, (c, m)) in stats.iter().zip(meters.iter_mut()).enumerate() {
            m.sample(
                now,
                c.bytes.saturating_sub(c.outstanding_bytes),
                c.outstanding_tasks > 0,
            );
            inner.core.set_rate(i, m.rate(), m.peak());
        }
    }
}

/// Carry out the core's actions. Called with the lock held so that PDUs reach each connection's
/// queue in the order the core produced them (CmdSN order per connection).
fn run_actions(shared: &Arc<Shared>, inner: &mut Inner, actions: Vec<Action<Completion>>) {
    for a in actions {
        match a {
            Action::Urgent { conn, pdu } => {
                if let Some(c) = inner.conns.get(conn) {
                    let _ = c.urgent.send(pdu);
                }
            }
            Action::Send { conn, pdu } => {
                if let Some(c) = inner.conns.get(conn) {
                    // A closed channel means the writer ended; its failure path recovers.
                    let _ = c.tx.send(pdu);
                }
            }
            Action::Complete { handle, result } => {
                let _ = handle.send(result);
            }
            Action::Event { conn, event } => handle_event(shared, inner, conn, event),
        }
    }
}

fn handle_event(shared: &Arc<Shared>, inner: &mut Inner, conn: usize, event: Event) {
    match event {
        Event::Control(pdu) => {
            if let Some(tx) = inner.control.remove(&pdu.itt()) {
                let _ = tx.send(pdu);
            } else {
                tracing::debug!(itt = pdu.itt(), "control response nobody waits for");
            }
        }
        Event::Rejected { reason } => {
            tracing::warn!(
                conn,
                reason,
                "target rejected a PDU that names no outstanding task"
            );
        }
        Event::Dropped {
            session, time2wait, ..
        } => {
            tracing::warn!(
                conn,
                session,
                time2wait,
                "target announces it drops the {}",
                if session { "session" } else { "connection" }
            );
            let generation = inner.generation;
            begin_recovery(
                shared,
                inner,
                generation,
                Error::Protocol("the target dropped the connection (async event)".into()),
                Duration::from_secs(u64::from(time2wait.max(1))),
            );
        }
        Event::LogoutRequested { cid, within_secs } => {
            // The core stops giving the connection tasks and says when the logout is due.
            tracing::info!(
                cid,
                within_secs,
                "target requests logout of connection {cid}"
            );
            shared.timer_wake.notify_one();
        }
        Event::LogoutDue { close_session } => {
            let sh = Arc::clone(shared);
            let generation = inner.generation;
            tokio::spawn(async move {
                logout_on_request(sh, conn, generation, close_session).await;
            });
        }
        Event::NoStatus { itt, waited } if inner.phase == Phase::Running => {
            let e = Error::Timeout(format!("task {itt:#x} has had no status for {waited:?}"));
            tracing::warn!(error = %e, task = inner.core.describe_task(itt), "recovering the session");
            let generation = inner.generation;
            begin_recovery(shared, inner, generation, e, Duration::ZERO);
        }
        Event::NoStatus { .. } => {}
        // Both may fall due in one look; the first to recover the session ends the other.
        Event::Stalled { silent } if inner.phase == Phase::Running => {
            fail_over(shared, inner, conn, silent)
        }
        Event::Stalled { .. } => {}
    }
}

/// Async event 1 (11.9.1), once the connection's tasks have ended or the time the target gave
/// ran out: log it out (or the whole session when it is the last one) and re-establish what is
/// needed.
async fn logout_on_request(shared: Arc<Shared>, conn: usize, generation: u64, last: bool) {
    let reason = if last {
        logout_reason::CLOSE_SESSION
    } else {
        logout_reason::CLOSE_CONNECTION
    };
    let session = Session {
        shared: Arc::clone(&shared),
    };
    let r = session.send_logout(conn, reason).await;
    let mut inner = lock(&shared);
    if inner.generation != generation {
        return;
    }
    if let Err(e) = &r {
        tracing::warn!(conn, error = %e, "logout requested by the target did not complete cleanly");
    }
    if last {
        let time2wait = inner.core.params().default_time2wait;
        begin_recovery(
            &shared,
            &mut inner,
            generation,
            Error::Protocol("the target asked for logout".into()),
            Duration::from_secs(u64::from(time2wait.max(1))),
        );
    } else {
        inner.core.conn_closed(conn);
        if let Some(c) = inner.conns.get(conn) {
            let _ = c.sock.shutdown(std::net::Shutdown::Both);
        }
        tracing::info!(
            conn,
            "connection logged out at the target's request; {} remain",
            inner.core.usable_conns()
        );
    }
}

fn on_pdus(shared: &Arc<Shared>, conn: usize, serial: u64, pdus: Vec<conn::Incoming>) -> bool {
    let mut inner = lock(shared);
    // A connection taken out of the session (failed over, logged out) reads no more: a late
    // PDU of a task issued again elsewhere must not reach the core.
    if !inner.current(conn, serial)
        || !inner.core.conn_alive(conn)
        || matches!(inner.phase, Phase::Closed | Phase::Recovering)
    {
        return false;
    }
    let generation = inner.generation;
    inner.core.conn_heard(conn, Instant::now().into_std());
    let mut out = Vec::new();
    let mut failure = None;
    for p in pdus {
        let r = match p {
            conn::Incoming::Whole(p) => inner.core.handle_pdu(conn, p, &mut out),
            conn::Incoming::Damaged(p) => inner.core.handle_damaged(conn, p, &mut out),
        };
        if let Err(e) = r {
            failure = Some(e);
            break;
        }
    }
    run_actions(shared, &mut inner, out);
    if let Some(e) = failure {
        tracing::warn!(conn, error = %e, "connection-level protocol error");
        begin_recovery(shared, &mut inner, generation, e, Duration::ZERO);
        return false;
    }
    true
}

fn connection_failed(shared: &Arc<Shared>, conn: usize, serial: u64, err: Error) {
    let mut inner = lock(shared);
    // A connection replaced, or taken out of the session on purpose, ends as expected.
    if !inner.current(conn, serial) || !inner.core.conn_alive(conn) {
        return;
    }
    let generation = inner.generation;
    match inner.phase {
        Phase::Running if can_reassign(&inner, conn) => {
            fail_over_for_recovery(shared, &mut inner, conn, &format!("was lost ({err})"));
        }
        Phase::Running => {
            tracing::warn!(conn, error = %err, "connection lost; recovering the session");
            begin_recovery(shared, &mut inner, generation, err, Duration::ZERO);
        }
        Phase::Closing => {
            // Logout in progress: the target closing the connection is expected.
        }
        Phase::Recovering | Phase::Closed => {}
    }
}

/// ERL 0 recovery (RFC 7143 7.1.5, 7.3): close every connection, log in again with the same
/// ISID and TSIH 0 (session reinstatement), and re-issue the commands that never got status.
fn begin_recovery(
    shared: &Arc<Shared>,
    inner: &mut Inner,
    generation: u64,
    err: Error,
    delay: Duration,
) {
    if inner.generation != generation || inner.phase != Phase::Running {
        return;
    }
    inner.phase = Phase::Recovering;
    inner.core.session_down();
    for c in inner.conns.drain(..) {
        let _ = c.sock.shutdown(std::net::Shutdown::Both);
    }
    for (_, tx) in inner.control.drain() {
        drop(tx);
    }
    let sh = Arc::clone(shared);
    tokio::spawn(async move { recover(sh, err, delay).await });
}

async fn recover(shared: Arc<Shared>, first: Error, delay: Duration) {
    let mut last = first;
    let attempts = shared.options.reconnect_attempts;
    let mut plan = crate::core::Reconnect::new(delay, attempts);
    let mut attempt = 0;
    while let Some(delay) = plan.next_delay() {
        attempt += 1;
        tokio::time::sleep(delay).await;
        if lock(&shared).phase != Phase::Recovering {
            return;
        }
        match establish(&shared.url, &shared.options, shared.isid).await {
            Ok(est) => {
                let waiting = {
                    let mut inner = lock(&shared);
                    if inner.phase != Phase::Recovering {
                        return;
                    }
                    inner.recoveries += 1;
                    let waiting = inner.core.outstanding();
                    inner.reissued += waiting as u64;
                    waiting
                };
                let n = est.conns.len();
                if let Err(e) = install(&shared, est) {
                    last = e;
                    let mut inner = lock(&shared);
                    inner.phase = Phase::Recovering;
                    inner.core.session_down();
                    continue;
                }
                tracing::info!(
                    attempt,
                    connections = n,
                    reissued = waiting,
                    "session re-established; re-issuing {waiting} command(s) that had no status"
                );
                return;
            }
            Err(e) => {
                tracing::warn!(attempt, attempts, error = %e, "reconnect failed");
                last = e;
            }
        }
    }
    let mut inner = lock(&shared);
    if inner.phase != Phase::Recovering {
        return;
    }
    inner.phase = Phase::Closed;
    let err = Error::SessionLost {
        attempts,
        last: last.to_string(),
    };
    tracing::error!(error = %err, "giving up on the session");
    let mut out = Vec::new();
    inner.core.fail_all(&err, &mut out);
    run_actions(&shared, &mut inner, out);
}

impl Session {
    /// Run one command to completion. A status other than GOOD is returned in the Response;
    /// use [`Response::check`] to turn it into an error.
    pub async fn execute(&self, cmd: Command) -> Result<Response, Error> {
        let (tx, rx) = oneshot::channel();
        {
            let mut inner = lock(&self.shared);
            if inner.phase == Phase::Closed || inner.phase == Phase::Closing {
                return Err(Error::Closed);
            }
            let mut out = Vec::new();
            inner.core.submit(cmd, tx, &mut out);
            run_actions(&self.shared, &mut inner, out);
        }
        rx.await.map_err(|_| Error::Closed)?
    }

    /// The negotiated parameters.
    pub fn params(&self) -> SessionParams {
        lock(&self.shared).core.params().clone()
    }

    /// What the session was opened with.
    pub fn options(&self) -> &ConnectOptions {
        &self.shared.options
    }

    /// Connections currently in the session.
    pub fn connection_count(&self) -> usize {
        lock(&self.shared).conns.len()
    }

    pub fn url(&self) -> &IscsiUrl {
        &self.shared.url
    }

    /// The session's ISID (to reinstate it, [`reinstate`]).
    pub fn isid(&self) -> Isid {
        self.shared.isid
    }

    /// How long a task of `bytes` would take to complete if issued now, on the connection
    /// expected to finish it first (queued work at each connection's measured rate, plus its
    /// round-trip time); None until a rate has been measured (the policy is tcp-aware, or the
    /// session was opened with [`ConnectOptions::measure_rates`]).
    pub fn expected_completion(&self, bytes: u64) -> Option<Duration> {
        let s = lock(&self.shared).core.expected_completion(bytes)?;
        Duration::try_from_secs_f64(s).ok()
    }

    /// Forgets the rates the connections were measured at, and measures them afresh from the
    /// next command on. Until then [`Session::expected_completion`] costs them by what TCP
    /// reports (congestion window over round-trip time). A volume calls this for a member it
    /// has given nothing for a while: a rate measured while the member was slow, or carried
    /// few commands, would otherwise keep it idle for good, since an idle member is not
    /// measured.
    pub fn remeasure(&self) {
        let mut inner = lock(&self.shared);
        inner.remeasure = true;
        for i in 0..inner.core.conn_count() {
            inner.core.set_rate(i, None, None);
        }
    }

    /// The target's latest report of each connection's sending side (`X-org.mcsi.TcpReport`;
    /// None where nothing was reported). Cheap: no system call.
    pub fn target_tcp(&self) -> Vec<Option<TcpState>> {
        lock(&self.shared).core.target_tcp()
    }

    /// Counters per connection, with TCP_INFO read now.
    pub fn stats(&self) -> SessionStats {
        let mut inner = lock(&self.shared);
        let counters = inner.core.conn_stats();
        let mut conns = Vec::with_capacity(counters.len());
        for (index, c) in counters.into_iter().enumerate() {
            let target_tcp = c.target_tcp;
            let tcp = inner.conns.get(index).and_then(|h| tcp_state(&h.sock).ok());
            if let Some(t) = tcp {
                inner.core.set_tcp(index, t);
            }
            let handle = inner.conns.get(index);
            let congestion = handle.and_then(|h| mcsi_tcp::congestion::current(&h.sock).ok());
            let peer = handle
                .and_then(|h| h.sock.peer_addr().ok())
                .and_then(|a| a.as_socket());
            let local = handle
                .and_then(|h| h.sock.local_addr().ok())
                .and_then(|a| a.as_socket());
            let bind = route::nth(&self.shared.options.binds, index).map(ToString::to_string);
            let mptcp = handle.and_then(|h| mcsi_tcp::mptcp::state(&h.sock));
            conns.push(ConnectionStats {
                index,
                counters: c,
                tcp,
                congestion,
                peer,
                local,
                bind,
                mptcp,
                target_tcp,
            });
        }
        SessionStats {
            tsih: inner.tsih,
            policy: inner.core.scheduler_name(),
            connections: conns,
            recoveries: inner.recoveries,
            reissued: inner.reissued,
            reassigned: inner.reassigned,
            failovers: inner.failovers,
            rejoins: inner.rejoins,
            window_waits: inner.core.window_waits(),
            exp_cmd_sn: inner.core.window().exp_cmd_sn(),
            max_cmd_sn: inner.core.window().max_cmd_sn(),
        }
    }

    /// Break connection `index` as a network failure would (both directions shut down), to
    /// exercise recovery. Returns false if there is no such connection.
    pub fn sever_connection(&self, index: usize) -> bool {
        let inner = lock(&self.shared);
        match inner.conns.get(index) {
            Some(c) => c.sock.shutdown(std::net::Shutdown::Both).is_ok(),
            None => false,
        }
    }

    /// Send a control request built by `build` (given the core, a fresh ITT and the
    /// connection it goes on) on connection `conn`, and wait for the PDU that answers it.
    async fn request(
        &self,
        conn: usize,
        build: impl FnOnce(&SessionCore<Completion>, u32, usize) -> Pdu,
    ) -> Result<Pdu, Error> {
        let (tx, rx) = oneshot::channel();
        let itt = {
            let mut inner = lock(&self.shared);
            let itt = inner.core.alloc_itt();
            let pdu = build(&inner.core, itt, conn);
            let Some(h) = inner.conns.get(conn) else {
                return Err(Error::Closed);
            };
            h.urgent.send(pdu).map_err(|_| Error::Closed)?;
            inner.control.insert(itt, tx);
            itt
        };
        let r = tokio::time::timeout(CONTROL_TIMEOUT, rx).await;
        lock(&self.shared).control.remove(&itt);
        r.map_err(|_| Error::Timeout(format!("no answer within {CONTROL_TIMEOUT:?}")))?
            .map_err(|_| Error::Closed)
    }

    /// TASK REASSIGN of orphan `o` of failed connection `avoid` on another connection: true
    /// when the target took it over there, false when it answered "task not found" (it never
    /// received the command whole, or has not seen the connection fail).
    async fn ask_reassign(&self, avoid: usize, o: Orphan) -> Result<bool, Error> {
        let (r, via) = self
            .request_elsewhere_via(avoid, |core, itt, via| {
                orphan_tmf(core, tmf_function::TASK_REASSIGN, o, itt, via)
            })
            .await?;
        match r {
            Pdu::TaskMgmtResponse(t) if t.response == tmf_response::COMPLETE => {
                lock(&self.shared).core.reassigned(o.itt, via);
                Ok(true)
            }
            Pdu::TaskMgmtResponse(t) if t.response == tmf_response::NO_TASK => Ok(false),
            Pdu::TaskMgmtResponse(t) => Err(Error::Protocol(format!(
                "the target answered TASK REASSIGN for task {:#x} with response {}",
                o.itt, t.response
            ))),
            other => Err(unexpected("a Task Management Function Response", &other)),
        }
    }

    /// ABORT TASK for task `o` of connection `avoid`, sent on another one: done when the target
    /// answers "function complete" (aborted, or its CmdSN taken as received) or "task does not
    /// exist" (it ended before).
    async fn abort_orphan(&self, avoid: usize, o: Orphan) -> Result<(), Error> {
        let r = self
            .request_elsewhere(avoid, |core, itt, via| {
                orphan_tmf(core, tmf_function::ABORT_TASK, o, itt, via)
            })
            .await?;
        match r {
            Pdu::TaskMgmtResponse(t)
                if t.response == tmf_response::COMPLETE || t.response == tmf_response::NO_TASK =>
            {
                Ok(())
            }
            Pdu::TaskMgmtResponse(t) => Err(Error::Protocol(format!(
                "the target answered ABORT TASK for task {:#x} of the stalled connection with response {}",
                o.itt, t.response
            ))),
            other => Err(unexpected("a Task Management Function Response", &other)),
        }
    }

    /// Logs connection `cid` (slot `avoid`) out with `reason` (close it, or remove it for
    /// recovery) through another connection: the target's answer, "closed" or "CID not found"
    /// (anything else is an error).
    async fn logout_elsewhere(&self, avoid: usize, cid: u16, reason: u8) -> Result<u8, Error> {
        let r = self
            .request_elsewhere(avoid, |core, itt, _via| {
                Pdu::LogoutRequest(LogoutRequest {
                    immediate: true,
                    reason,
                    itt,
                    cid,
                    cmd_sn: core.immediate_cmd_sn(),
                    // The last ExpStatSN of the connection logged out, not of the one that
                    // carries the request (RFC 7143 11.14): a target that keeps the failed
                    // connection's tasks for recovery drops those acknowledged below it.
                    exp_stat_sn: core.exp_stat_sn(avoid),
                })
            })
            .await?;
        match r {
            Pdu::LogoutResponse(l)
                if l.response == logout_response::CLOSED
                    || l.response == logout_response::CID_NOT_FOUND =>
            {
                Ok(l.response)
            }
            Pdu::LogoutResponse(l) => Err(Error::Protocol(format!(
                "the target refused to log out connection {cid} (reason {reason}, response {})",
                l.response
            ))),
            other => Err(unexpected("a Logout Response", &other)),
        }
    }

    /// [`Session::request`] on a connection that carries tasks, other than `avoid`.
    async fn request_elsewhere(
        &self,
        avoid: usize,
        build: impl FnOnce(&SessionCore<Completion>, u32, usize) -> Pdu,
    ) -> Result<Pdu, Error> {
        self.request_elsewhere_via(avoid, build).await.map(|r| r.0)
    }

    /// [`Session::request_elsewhere`], with the connection it went on.
    async fn request_elsewhere_via(
        &self,
        avoid: usize,
        build: impl FnOnce(&SessionCore<Completion>, u32, usize) -> Pdu,
    ) -> Result<(Pdu, usize), Error> {
        let via = {
            let inner = lock(&self.shared);
            (0..inner.conns.len()).find(|&i| i != avoid && inner.core.conn_alive(i))
        };
        let Some(via) = via else {
            return Err(Error::Protocol("no other connection left".into()));
        };
        self.request(via, build).await.map(|r| (r, via))
    }

    async fn send_logout(&self, conn: usize, reason: u8) -> Result<(), Error> {
        let cid = lock(&self.shared).core.cid(conn).ok_or(Error::Closed)?;
        let pdu = self
            .request(conn, |core, itt, via| {
                Pdu::LogoutRequest(LogoutRequest {
                    immediate: true,
                    reason,
                    itt,
                    cid,
                    cmd_sn: core.immediate_cmd_sn(),
                    exp_stat_sn: core.exp_stat_sn(via),
                })
            })
            .await?;
        match pdu {
            Pdu::LogoutResponse(r) if r.response == logout_response::CLOSED => Ok(()),
            Pdu::LogoutResponse(r) => Err(Error::Protocol(format!(
                "logout refused with response {} (1 CID not found, 2 recovery not supported, 3 cleanup failed)",
                r.response
            ))),
            other => Err(unexpected("a Logout Response", &other)),
        }
    }

    /// Close the session cleanly (Logout with reason "close the session", 11.14). Commands still
    /// waiting fail with [`Error::Closed`].
    pub async fn logout(&self) -> Result<(), Error> {
        let conn = {
            let mut inner = lock(&self.shared);
            match inner.phase {
                Phase::Closed => return Ok(()),
                Phase::Closing => return Err(Error::Closed),
                Phase::Recovering => {
                    inner.phase = Phase::Closed;
                    let mut out = Vec::new();
                    inner.core.fail_all(&Error::Closed, &mut out);
                    run_actions(&self.shared, &mut inner, out);
                    return Ok(());
                }
                Phase::Running => {}
            }
            inner.phase = Phase::Closing;
            (0..inner.conns.len())
                .find(|&i| inner.core.cid(i).is_some())
                .unwrap_or(0)
        };
        let r = self.send_logout(conn, logout_reason::CLOSE_SESSION).await;
        let mut inner = lock(&self.shared);
        inner.phase = Phase::Closed;
        let mut out = Vec::new();
        inner.core.fail_all(&Error::Closed, &mut out);
        run_actions(&self.shared, &mut inner, out);
        // Dropping the senders lets each writer flush and shut its half down.
        for c in inner.conns.drain(..) {
            drop(c.tx);
            let _ = c.sock.shutdown(std::net::Shutdown::Read);
        }
        r
    }
}

#[cfg(test)]
mod name_tests {
    use super::*;

    #[test]
    fn open_iscsi_s_name_file_gives_the_initiator_name() {
        let file = "## DO NOT EDIT OR REMOVE THIS FILE!\n## If you remove this file, the iSCSI daemon will not start.\n#InitiatorName=iqn.1993-08.org.debian:01:commented\nInitiatorName=iqn.1993-08.org.debian:01:5ee0c1a9b2\n";
        assert_eq!(
            initiator_name_in(file).as_deref(),
            Some("iqn.1993-08.org.debian:01:5ee0c1a9b2")
        );
        assert_eq!(initiator_name_in("InitiatorName=not a name\n"), None);
        assert_eq!(initiator_name_in("InitiatorName=\n"), None);
        assert_eq!(initiator_name_in(""), None);
    }

    #[test]
    fn the_documented_defaults_hold() {
        // docs/error-recovery.md: both sides default to ErrorRecoveryLevel 2.
        assert_eq!(ConnectOptions::default().max_erl, 2);
    }
}
