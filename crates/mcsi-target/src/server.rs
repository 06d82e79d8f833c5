//! Portals and the accept loop; a connection's life from login to its end; session creation,
//! joining and reinstatement; clean shutdown.

use crate::admission::{Denied, Gate, Slot};
use crate::config::ServerConfig;
use crate::conn::{self, Reader};
use crate::login::{self, status, Negotiated};
use crate::session::{
    Conn, ConnOps, OutQueue, Session, SessionClosing, SessionEnd, Shared, Target,
};
use crate::shard::Shards;
use crate::stats::{Metrics, SessionSnapshot};
use bytes::BytesMut;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn, Instrument};

/// How long a connection refused for the login rate may take to send the Login Request the
/// refusal answers (initiators send it as soon as TCP is up).
const REFUSAL_WAIT: Duration = Duration::from_secs(2);

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A LUN that does not open, or a configuration the server cannot take.
    #[error(transparent)]
    Config(crate::admin::AdminError),
    #[error("cannot start the session threads")]
    Threads(#[source] std::io::Error),
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

pub use crate::transport::Transport;

/// A running target server.
pub struct Server {
    shared: Arc<Shared>,
    gate: Arc<Gate>,
    /// The threads sessions run on.
    shards: Arc<Shards>,
    metrics: Arc<Metrics>,
    /// The listening sockets.
    portals: Arc<crate::portals::Portals>,
    /// The configuration as applied: what a reload compares the file with.
    applied: Arc<std::sync::Mutex<crate::admin::Applied>>,
}

/// Takes snapshots and metrics of a running server.
#[derive(Clone)]
pub struct Observer {
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
}

impl Observer {
    pub fn snapshot(&self) -> Vec<SessionSnapshot> {
        crate::stats::snapshot(&self.shared)
    }

    pub fn metrics_text(&self) -> String {
        self.metrics.encode(&self.snapshot())
    }
}

impl Server {
    /// Opens every LUN and listens on every portal: the configuration applied to an empty
    /// server, as a reload applies a difference ([`crate::admin::Admin::apply`]). A portal with
    /// port 0 gets an ephemeral port; [`Server::local_addrs`] tells which, and the targets'
    /// portal lists have it.
    pub async fn start(cfg: &ServerConfig) -> Result<Server, StartError> {
        let metrics = Arc::new(Metrics::new());
        let shared = Arc::new(Shared::with_budgets(
            Vec::new(),
            cfg.discovery_auth.clone(),
            &cfg.limits,
        ));
        let gate = Arc::new(Gate::new(cfg.limits));
        let shards = Arc::new(Shards::start(cfg.session_threads).map_err(StartError::Threads)?);
        let (s2, g2, sh2) = (shared.clone(), gate.clone(), shards.clone());
        let run: crate::portals::AcceptLoop = Arc::new(move |l, stop| {
            tokio::spawn(accept_loop(l, s2.clone(), g2.clone(), sh2.clone(), stop))
        });
        let portals = Arc::new(crate::portals::Portals::new(cfg.mptcp, run));
        let applied = Arc::new(std::sync::Mutex::new(crate::admin::Applied::empty(cfg)));
        let server = Server {
            shared,
            gate,
            shards,
            metrics,
            portals,
            applied,
        };
        server.admin().apply(cfg).await.map_err(|e| match e {
            crate::admin::AdminError::Listen { addr, why } => StartError::Listen {
                addr,
                source: std::io::Error::other(why),
            },
            e => StartError::Config(e),
        })?;
        Ok(server)
    }

    /// The addresses the server listens on now, in the order they were opened.
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        self.portals.locals()
    }

    /// Serves one connection that did not come through a portal: login, session, full feature
    /// phase, under the same limits as a portal's (`peer` is the source the login limits count).
    /// `false` if the server already holds `max_server_connections`.
    pub fn serve<S: Transport>(&self, stream: S, peer: SocketAddr, local: SocketAddr) -> bool {
        let Some(slot) = self.gate.connections.try_take() else {
            return false;
        };
        spawn_connection(
            &self.shared,
            &self.gate,
            &self.shards,
            slot,
            stream,
            peer,
            local,
        );
        true
    }

    /// The targets served now.
    pub fn targets(&self) -> Arc<Vec<Arc<Target>>> {
        self.shared.targets()
    }

    /// Every session's connections with their counters and TCP state, sampled now.
    pub fn snapshot(&self) -> Vec<SessionSnapshot> {
        crate::stats::snapshot(&self.shared)
    }

    /// The Prometheus exposition text (version 0.0.4), sampled now.
    pub fn metrics_text(&self) -> String {
        self.metrics.encode(&self.snapshot())
    }

    /// A handle for the server's administration while it runs (`mcsi ctl`).
    pub fn admin(&self) -> crate::admin::Admin {
        crate::admin::Admin {
            shared: self.shared.clone(),
            metrics: self.metrics.clone(),
            applied: self.applied.clone(),
            gate: self.gate.clone(),
            portals: self.portals.clone(),
        }
    }

    /// A handle that can take snapshots and metrics while the server runs (for an HTTP
    /// endpoint living beside it).
    pub fn observer(&self) -> Observer {
        Observer {
            shared: self.shared.clone(),
            metrics: self.metrics.clone(),
        }
    }

    /// Stops accepting, closes every session, flushes every LU.
    pub async fn shutdown(self) -> Result<(), mcsi_scsi::backend::BackendError> {
        self.portals.close_all().await;
        for s in self.shared.all_sessions() {
            s.close(SessionEnd::Shutdown).await;
        }
        let mut res = Ok(());
        for t in self.shared.targets().iter() {
            // A sanitize still running stops here (a command waiting for it then ends); it is
            // not resumed by the next start, and the LU is left partly sanitized.
            if t.dev.stop_background() > 0 {
                warn!(target = %t.name, "shutdown interrupted a SANITIZE; its LUN is partly sanitized");
            }
            let dev = t.dev.clone();
            let r = tokio::task::spawn_blocking(move || dev.flush_all()).await;
            if let Ok(Err(e)) = r {
                warn!(target = %t.name, "flush failed: {e}");
                res = Err(e);
            }
        }
        res
    }
}

async fn accept_loop(
    l: TcpListener,
    shared: Arc<Shared>,
    gate: Arc<Gate>,
    shards: Arc<Shards>,
    mut stop: watch::Receiver<bool>,
) {
    // Connections closed for max_server_connections since the last log line.
    let (mut over, mut logged) = (0u64, None::<Instant>);
    loop {
        tokio::select! {
            _ = crate::session::flag_set(&mut stop) => break,
            r = l.accept() => match r {
                Ok((stream, peer)) => {
                    let Some(slot) = gate.connections.try_take() else {
                        // Closed at once, without waiting for a Login Request to refuse: the
                        // limit is there to bound the sockets held, so none is kept.
                        drop(stream);
                        over += 1;
                        if logged.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                            warn!(
                                %peer,
                                "connection closed: the server holds max_server_connections = {} connections ({over} closed since the last report)",
                                gate.connections.max()
                            );
                            (over, logged) = (0, Some(Instant::now()));
                        }
                        continue;
                    };
                    let local = stream.local_addr().unwrap_or(peer);
                    spawn_connection(&shared, &gate, &shards, slot, stream, peer, local);
                }
                Err(e) => {
                    warn!("accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// Runs [`connection`] as a task of its own, in a span that names the peer.
fn spawn_connection<S: Transport>(
    shared: &Arc<Shared>,
    gate: &Arc<Gate>,
    shards: &Arc<Shards>,
    slot: Slot,
    stream: S,
    peer: SocketAddr,
    local: SocketAddr,
) {
    let span = tracing::info_span!("conn", %peer);
    let c = connection(
        shared.clone(),
        gate.clone(),
        shards.clone(),
        slot,
        stream,
        peer,
        local,
    );
    tokio::spawn(c.instrument(span));
}

/// One connection: login, join or create a session, then full feature phase on the session's
/// thread. `server_slot` is its place among the server's connections, held until it ends.
async fn connection<S: Transport>(
    shared: Arc<Shared>,
    gate: Arc<Gate>,
    shards: Arc<Shards>,
    server_slot: Slot,
    mut stream: S,
    peer: SocketAddr,
    local: SocketAddr,
) {
    if let Some(sock) = stream.socket() {
        let _ = sock.set_nodelay(true);
    }
    let mut buf = BytesMut::with_capacity(64 * 1024);
    if let Err(over) = gate.logins.check(peer.ip(), Instant::now()) {
        // Out of resources (RFC 7143 11.13.5, class 3: the initiator may retry later) rather
        // than a silent close, which an initiator cannot tell from a network failure.
        // Waiting for the Login Request to answer holds the connection for up to REFUSAL_WAIT;
        // a source already that many refusals deep is closed on at once, so that opening
        // connections faster than the rate cannot pile them up.
        let st = status::OUT_OF_RESOURCES;
        let Some(_refusing) = gate.refusing.try_take(peer.ip()) else {
            return;
        };
        let wait = REFUSAL_WAIT.min(gate.limits.login_timeout);
        let who = login::refuse_first(&mut stream, &mut buf, st, wait).await;
        if let Some(n) = over.log {
            let l = gate.limits;
            warn!(
                initiator = who.as_deref().unwrap_or("(no Login Request)"),
                %peer,
                "login refused with status 3/0x02 (out of resources): {} opens connections faster than login_rate = {} per second after login_burst = {} ({n} refused since the last report)",
                crate::admission::source(peer.ip()),
                l.login_rate,
                l.login_burst,
            );
        }
        return;
    }
    let (in_login, evicted) = gate.in_login.take(peer.ip(), Instant::now());
    if let Some(n) = evicted.log {
        warn!(
            %peer,
            "{} has max_logins_per_source = {} connections logging in: its oldest login was dropped to make room ({n} dropped since the last report)",
            crate::admission::source(peer.ip()),
            gate.in_login.max(),
        );
    }
    let login = login::run(&shared, &gate, &mut stream, &mut buf, local, peer);
    let n = match &in_login {
        Some(place) => tokio::select! {
            r = login => r,
            _ = place.evicted() => {
                debug!("login dropped: a newer connection of the same source took its place");
                return;
            }
        },
        None => login.await,
    };
    let n = match n {
        Ok(n) => n,
        Err(e) => {
            info!("login failed: {e}");
            return;
        }
    };
    drop(in_login);
    // The segment size of the leading connection sets the frame seed 004's model assumes.
    let mss = stream
        .socket()
        .and_then(|s| s.try_clone().ok())
        .and_then(|s| mcsi_tcp::tcp_state(&s).ok())
        .map(|t| t.snd_mss)
        .filter(|&m| m > 0)
        .unwrap_or(1448);
    let (session, old_conn, target_slot) = match attach(&shared, &gate, &n, mss).await {
        Ok(x) => x,
        Err(d) => {
            warn!(
                initiator = %n.initiator_name,
                %peer,
                "login refused with status {}/{:#04x} ({}): {}",
                d.status.0,
                d.status.1,
                status::describe(d.status),
                d.why
            );
            let _ = login::send_refusal(&mut stream, n.final_response, d.status).await;
            return;
        }
    };
    let limits = session
        .target
        .as_ref()
        .map(|t| t.limits)
        .unwrap_or_default();
    let (tx, rx) = mpsc::unbounded_channel();
    let cspan = tracing::info_span!(parent: &session.span, "conn", %peer, cid = n.cid);
    let sock = stream.socket().and_then(|s| s.try_clone().ok());
    // A response connection counts itself in its session while its queue is full.
    let full_count =
        (n.role == mcsi_proto::vendor::ConnRole::Responses).then(|| session.full_responses.clone());
    let out = OutQueue::counted(limits.output_budget, full_count);
    let (conn, stop_rx) = Conn::new(
        n.cid,
        n.role,
        ConnOps::from(&n.connection),
        peer,
        local,
        tx,
        cspan.clone(),
        sock,
        out.clone(),
        // ErrorRecoveryLevel 1 and above: the connection keeps what it sent for SNACKs, at
        // least for a full window of tasks. Only with data digests: without them nothing sent
        // can arrive damaged (TCP delivers it whole or the connection ends), so nothing could
        // be asked for again and keeping it would only cost (a quarter more instructions per
        // 4 KiB read).
        // At level 2 always: a task reassigned after a failure is answered from it.
        (session.ops.erl >= 2
            || (session.ops.erl > 0
                && n.connection.data_digest == mcsi_proto::keys::Digest::Crc32c))
            .then(|| {
                let d = mcsi_target_core::retain::LogBounds::default();
                let bounds = mcsi_target_core::retain::LogBounds {
                    tasks: d.tasks.max(2 * session.ops.queue_depth as usize),
                    ..d
                };
                // Every log of the server counts in one pool (limits.sent_log_budget).
                mcsi_target_core::retain::SentLog::pooled(bounds, session.shared.log_pool.clone())
            }),
    );
    // The connection joins its session before the one whose CID it takes over is stopped, so
    // the session never looks empty in between (connection reinstatement, RFC 7143 6.3.4: the
    // old connection goes, with its tasks).
    let replaced = match session.add_conn(conn.clone()) {
        Ok(prev) => prev,
        Err(SessionClosing) => {
            warn!(
                initiator = %n.initiator_name,
                %peer,
                "login refused with status 2/0x0a (session does not exist): its session is closing"
            );
            let st = status::SESSION_DOES_NOT_EXIST;
            let _ = login::send_refusal(&mut stream, n.final_response, st).await;
            return;
        }
    };
    let mut old: Vec<Arc<Conn>> = replaced.into_iter().collect();
    if let Some(o) = old_conn.filter(|o| !old.iter().any(|x| Arc::ptr_eq(x, o))) {
        old.push(o);
    }
    // The old connections' CID is now the new one's: their end is a clean one. At
    // ErrorRecoveryLevel 2 their tasks wait to be reassigned (TASK REASSIGN on the new one).
    for o in old {
        o.stop();
        if session.reinstated(&o) {
            continue;
        }
        let aborted = session.abort_where(|t| t.cid == o.cid);
        crate::session::wait_all(aborted.waits).await;
    }
    // A session of one connection stays here (crate::shard).
    let tsih = (session.ops.max_connections > 1).then_some(session.tsih);
    let (moved, moved_conn) = (session.clone(), conn.clone());
    let slots = (server_slot, target_slot);
    let ffp = FullFeature {
        session,
        conn,
        stop_rx,
        rx,
        out,
        cspan,
        limits,
        n,
        buf,
        peer,
    };
    let run = move |stream: S| full_feature(ffp, stream, slots);
    if let Err(e) = shards.run_on(tsih, stream, run).await {
        let why = format!("it could not move to its session's thread: {e}");
        // It fails alone when the session has others; alone, the session goes with it.
        moved.fail_alone(&moved_conn);
        moved.connection_ended(&moved_conn, &why).await;
    }
}

/// A connection that joined its session, ready for full feature phase.
struct FullFeature {
    session: Arc<Session>,
    conn: Arc<Conn>,
    stop_rx: watch::Receiver<bool>,
    rx: mpsc::UnboundedReceiver<crate::session::Out>,
    out: Arc<OutQueue>,
    cspan: tracing::Span,
    limits: crate::config::Limits,
    n: Negotiated,
    buf: BytesMut,
    peer: SocketAddr,
}

/// A logged-in connection in full feature phase, on its session's thread: it sends the final
/// Login Response, then runs its writer and its reader until it ends. `_slots` are its places
/// among the server's and its target's connections.
async fn full_feature<S: Transport>(f: FullFeature, mut stream: S, _slots: (Slot, Option<Slot>)) {
    let FullFeature {
        session,
        conn,
        stop_rx,
        rx,
        out,
        cspan,
        limits,
        n,
        buf,
        peer,
    } = f;
    if let Some(cc) = session.target.as_ref().and_then(|t| t.limits.congestion) {
        // Checked when the configuration was loaded; a refusal now leaves the default running.
        if let Some(Err(e)) = stream.socket().map(|s| cc.apply(&*s)) {
            warn!(%peer, "{e}; the connection keeps the system default");
        }
    }
    let (exp, max) = session.cmd_sns();
    if let Err(e) = login::send_final(&mut stream, n.final_response, exp, max).await {
        session.fail_alone(&conn);
        session
            .connection_ended(&conn, &format!("login failed at the last step: {e}"))
            .await;
        return;
    }
    info!(parent: &cspan, role = n.role.as_str(), "full feature phase");
    if session.ops.tcp_report {
        tokio::spawn(crate::stats::report_tcp(conn.clone(), stop_rx.clone()));
    }
    if n.role == mcsi_proto::vendor::ConnRole::Responses && session.wants_tcp_samples() {
        tokio::spawn(
            session
                .clone()
                .feed_tcp_samples(conn.clone(), stop_rx.clone()),
        );
    }
    session.start_keepalive(&conn, limits.offer.nop_interval, limits.offer.nop_timeout);
    let (rd, wr) = stream.split();
    let send_framing = n.connection.tx_framing();
    let recv_framing = n.connection.rx_framing();
    tokio::spawn(
        conn::writer(
            wr,
            rx,
            Arc::downgrade(&conn),
            session.clone(),
            out,
            conn.log.clone(),
            send_framing,
            n.next_stat_sn,
            limits.send_timeout,
        )
        .instrument(cspan.clone()),
    );
    let reader = Reader {
        session,
        conn,
        framing: recv_framing,
        buf,
        heard_every: limits.offer.nop_interval / 8,
        last_pdu: 0,
        next_heard: tokio::time::Instant::now(),
        exp_stat_sn: None,
    };
    reader.run(rd, stop_rx).instrument(cspan).await;
}

/// What a connection that joins or creates a session holds: the session, the connection a
/// reused CID replaces, and its place among its target's connections.
type Attached = (Arc<Session>, Option<Arc<Conn>>, Option<Slot>);

/// A QoS spec in words, for log lines.
fn describe_qos(q: &crate::config::QosSpec) -> String {
    match q {
        crate::config::QosSpec::Requirement(r) => format!(
            "requirement read_ratio={} iops={} size={} B rt={} ms alpha={}",
            r.read_ratio,
            r.iops,
            r.size_bytes,
            r.rt_s * 1e3,
            r.alpha
        ),
        crate::config::QosSpec::Rates { .. } => "the configured rates".into(),
    }
}

/// Gives a new session its bandwidth per direction and logs how it was reckoned.
fn set_qos(s: &Session, q: &crate::config::QosSpec, plan: &crate::config::QosPlan, mss: u32) {
    let show = |r: Option<(u64, u64)>| match r {
        Some((rate, burst)) => format!("{rate} B/s (burst {burst} B)"),
        None => "not limited".into(),
    };
    match (&plan.report, q) {
        (Some(rep), crate::config::QosSpec::Requirement(_)) => info!(
            parent: &s.span,
            "qos: {} with {} B frames (MSS {mss}): to client {} (protocol {:.0}, response-time floor {:.0}), to storage {} (protocol {:.0}, floor {:.0})",
            describe_qos(q),
            plan.frame,
            show(plan.rates.to_client),
            rep.s_to_c.protocol,
            rep.s_to_c.min_for_rt,
            show(plan.rates.to_storage),
            rep.c_to_s.protocol,
            rep.c_to_s.min_for_rt,
        ),
        _ => info!(
            parent: &s.span,
            "qos: to client {}, to storage {} (wire bytes, MSS {mss})",
            show(plan.rates.to_client),
            show(plan.rates.to_storage),
        ),
    }
    s.set_qos(plan, mss);
}

/// Creates the session of a leading login (closing the one it reinstates) or finds the session
/// a non-leading login joins, within the target's limits.
async fn attach(
    shared: &Arc<Shared>,
    gate: &Gate,
    n: &Negotiated,
    mss: u32,
) -> Result<Attached, Denied> {
    let target_name = n.target.as_ref().map(|t| t.name.as_str());
    let gone = |why: String| Denied {
        status: status::SESSION_DOES_NOT_EXIST,
        why,
    };
    if n.leading {
        // Session reinstatement (RFC 7143 6.3.5): same initiator port, TSIH 0.
        let old = shared.find_session(&n.initiator_name, n.isid, target_name);
        if let Some(old) = &old {
            info!(
                tsih = old.tsih,
                "reinstating session: closing the old one first"
            );
            old.close(SessionEnd::Reinstated).await;
        }
        // Admission control (seed 004): the session's rates must fit beside the others'.
        let plan = n.target.as_ref().and_then(|t| {
            let q = t.qos_for(&n.initiator_name)?;
            match q.plan(mss, n.session.burst.first_burst_length) {
                Ok(p) => Some((t, q, p)),
                Err(e) => {
                    warn!("qos: cannot compute the session's bandwidth ({e}); not limited");
                    None
                }
            }
        });
        let reservation = match plan.as_ref() {
            Some((t, q, p)) => match t.limits.qos_capacity {
                Some(cap) => match t.reserve_qos(&p.rates, cap) {
                    Ok(r) => Some(r),
                    Err(left) => {
                        let need = |r: Option<(u64, u64)>| r.map_or(0, |r| r.0);
                        return Err(Denied {
                            status: status::OUT_OF_RESOURCES,
                            why: format!(
                                "qos: a session needs {} B/s to the client and {} B/s to storage ({}); target {} has {} and {} B/s left of its capacity of {cap} B/s each way",
                                need(p.rates.to_client),
                                need(p.rates.to_storage),
                                describe_qos(q),
                                t.name,
                                left.to_client,
                                left.to_storage,
                            ),
                        });
                    }
                },
                None => None,
            },
            None => None,
        };
        let mut ops = n.session;
        if n.target.is_none() {
            // A discovery session has one connection (RFC 7143 13.21).
            ops.max_connections = 1;
        }
        let s = Session::new(
            shared.clone(),
            n.tsih,
            n.isid,
            n.initiator_name.clone(),
            n.target.clone(),
            ops,
            n.cmd_sn,
            crate::scsi::spawn,
        );
        let mut displaced = Vec::new();
        let slot = match &n.target {
            Some(t) => Some(gate.admit_session(shared, t, old.is_some(), || {
                displaced = shared.insert_reinstating(s.clone())
            })?),
            // Discovery sessions count among the server's connections only.
            None => {
                displaced = shared.insert_reinstating(s.clone());
                None
            }
        };
        // A parallel leading login of the same port got in between: this one reinstates it.
        for d in displaced {
            info!(
                tsih = d.tsih,
                "reinstating session: closing a concurrent login's session"
            );
            d.close(SessionEnd::Reinstated).await;
        }
        info!(parent: &s.span, "session created");
        if let Some((_, q, p)) = &plan {
            set_qos(&s, q, p, mss);
            *s.qos_reservation.lock().unwrap_or_else(|e| e.into_inner()) = reservation;
        }
        return Ok((s, None, slot));
    }
    let Some(s) = shared.session(n.tsih) else {
        return Err(gone(format!("session {} ended during the login", n.tsih)));
    };
    if s.isid != n.isid
        || s.initiator_name != n.initiator_name
        || s.target.as_ref().map(|t| t.name.as_str()) != target_name
    {
        return Err(gone(format!(
            "session {} belongs to another initiator port or target",
            n.tsih
        )));
    }
    let old = s.conn(n.cid);
    let max = usize::from(s.ops.max_connections);
    if old.is_none() && s.conn_count() >= max {
        return Err(Denied {
            status: status::TOO_MANY_CONNECTIONS,
            why: format!(
                "session {} already has MaxConnections={max} connections",
                s.tsih
            ),
        });
    }
    let slot = match &s.target {
        Some(t) => Some(gate.admit_connection(t, old.is_some())?),
        None => None,
    };
    debug!(parent: &s.span, cid = n.cid, "connection joins the session");
    Ok((s, old, slot))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn target(metrics: &[(u16, crate::counters::LunMetrics)]) -> Arc<Target> {
        let cfg = ServerConfig::from_toml(
            "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn=\"iqn.2026-01.org.x:t\"\nluns=[{backend=\"ram:1MiB\"}]\n",
        )
        .unwrap();
        Target::new(&cfg.targets[0], Vec::new(), Vec::new(), metrics)
    }

    /// The race of a login with the target's removal: the login looked its target up before
    /// the removal and asks to register its session after it. No session registers, and no
    /// connection joins, even once a target of the same name is served again.
    #[test]
    fn a_login_that_found_its_target_before_it_went_registers_nothing() {
        let metrics = Vec::new();
        let t = target(&metrics);
        let shared = Shared::new(vec![t.clone()], Default::default());
        let gate = Gate::new(Default::default());
        gate.open_target(&t);
        // The login has its target, and the target has room ...
        gate.check_session(&shared, &t, false).unwrap();
        // ... when the administrator removes it.
        gate.close_target(&t.name);
        let mut registered = false;
        let denied = gate
            .admit_session(&shared, &t, false, || registered = true)
            .unwrap_err();
        assert_eq!(denied.status, login::status::NOT_FOUND);
        assert!(!registered);
        assert_eq!(
            gate.check_connection(&t).unwrap_err().status,
            login::status::NOT_FOUND
        );
        // The same name served again: the login that found the old target is still refused,
        // a login that finds the new one is admitted.
        let again = target(&metrics);
        shared.set_targets(|_| vec![again.clone()]);
        gate.open_target(&again);
        let denied = gate
            .admit_session(&shared, &t, false, || registered = true)
            .unwrap_err();
        assert_eq!(denied.status, login::status::NOT_FOUND);
        assert!(!registered);
        let slot = gate.admit_session(&shared, &again, false, || registered = true);
        assert!(slot.is_ok() && registered);
    }
}
