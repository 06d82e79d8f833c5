//! Portals and the accept loop; a connection's life from login to its end; session creation,
//! joining and reinstatement; clean shutdown.

use crate::config::{LunBackend, ServerConfig};
use crate::conn::{self, Keepalive, Reader};
use crate::login::{self, status, Negotiated};
use crate::session::{Conn, ConnOps, Session, Shared, Target};
use bytes::BytesMut;
use mcsi_scsi::backend::open_backend;
use mcsi_scsi::{DeviceServer, LogicalUnit, LuConfig};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn, Instrument};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("targets[{target}].luns[{lun}].backend")]
    Backend {
        target: usize,
        lun: usize,
        #[source]
        source: mcsi_scsi::backend::BackendError,
    },
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// A running target server.
pub struct Server {
    shared: Arc<Shared>,
    local_addrs: Vec<SocketAddr>,
    stop: watch::Sender<bool>,
    accept: JoinSet<()>,
}

/// Opens the LUNs of every target.
pub fn build_targets(cfg: &ServerConfig) -> Result<Vec<Arc<Target>>, StartError> {
    let mut out = Vec::new();
    for (ti, t) in cfg.targets.iter().enumerate() {
        let mut luns = Vec::new();
        for (li, l) in t.luns.iter().enumerate() {
            let backend = match &l.backend {
                LunBackend::Spec(spec) => {
                    open_backend(spec).map_err(|source| StartError::Backend {
                        target: ti,
                        lun: li,
                        source,
                    })?
                }
                LunBackend::Opened(b) => b.clone(),
            };
            // A stable identity per target and LUN: serial and NAA from a hash of the names.
            let h = fnv1a(format!("{}/{}", t.iqn, li).as_bytes());
            let mut naa = [0u8; 16];
            naa[0] = 0x60 | ((h >> 60) as u8 & 0x0f);
            naa[1..9].copy_from_slice(&h.to_be_bytes());
            naa[9..11].copy_from_slice(&(li as u16).to_be_bytes());
            let lu_cfg = LuConfig {
                block_size: l.block_size,
                read_only: l.read_only,
                serial: l
                    .serial
                    .clone()
                    .unwrap_or_else(|| format!("{:012x}{li:04x}", h & 0xffff_ffff_ffff)),
                naa_id: naa,
                ..LuConfig::default()
            };
            luns.push((li as u16, Arc::new(LogicalUnit::new(backend, lu_cfg))));
        }
        out.push(Arc::new(Target {
            name: t.iqn.clone(),
            alias: t.alias.clone(),
            portals: t.portals.clone(),
            tpgt: 1,
            limits: t.limits,
            auth: t.auth.clone(),
            dev: Arc::new(DeviceServer::new(luns)),
        }));
    }
    Ok(out)
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Server {
    /// Opens every LUN and listens on every portal. A portal with port 0 gets an ephemeral port;
    /// [`Server::local_addrs`] tells which, and the targets' portal lists are updated.
    pub async fn start(cfg: &ServerConfig) -> Result<Server, StartError> {
        let mut cfg = cfg.clone();
        let mut listeners = Vec::new();
        let mut local_addrs = Vec::new();
        for addr in cfg.portals() {
            let l = TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Listen { addr, source })?;
            let local = l
                .local_addr()
                .map_err(|source| StartError::Listen { addr, source })?;
            for t in cfg.targets.iter_mut() {
                for p in t.portals.iter_mut() {
                    if *p == addr {
                        *p = local;
                    }
                }
            }
            local_addrs.push(local);
            listeners.push(l);
        }
        let shared = Arc::new(Shared::new(
            build_targets(&cfg)?,
            cfg.discovery_auth.clone(),
        ));
        let (stop, stop_rx) = watch::channel(false);
        let mut accept = JoinSet::new();
        for l in listeners {
            accept.spawn(accept_loop(l, shared.clone(), stop_rx.clone()));
        }
        Ok(Server {
            shared,
            local_addrs,
            stop,
            accept,
        })
    }

    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.local_addrs
    }

    pub fn targets(&self) -> &[Arc<Target>] {
        &self.shared.targets
    }

    /// Stops accepting, closes every session, flushes every LU.
    pub async fn shutdown(mut self) -> Result<(), mcsi_scsi::backend::BackendError> {
        let _ = self.stop.send(true);
        while self.accept.join_next().await.is_some() {}
        for s in self.shared.all_sessions() {
            s.close().await;
        }
        let mut res = Ok(());
        for t in &self.shared.targets {
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

async fn accept_loop(l: TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = crate::session::flag_set(&mut stop) => break,
            r = l.accept() => match r {
                Ok((stream, peer)) => {
                    let local = stream.local_addr().unwrap_or(peer);
                    let span = tracing::info_span!("conn", %peer);
                    tokio::spawn(connection(shared.clone(), stream, peer, local).instrument(span));
                }
                Err(e) => {
                    warn!("accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// One connection: login, join or create a session, then full feature phase.
async fn connection(
    shared: Arc<Shared>,
    mut stream: TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
) {
    let _ = stream.set_nodelay(true);
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let n = match login::run(&shared, &mut stream, &mut buf, local, peer).await {
        Ok(n) => n,
        Err(e) => {
            info!("login failed: {e}");
            return;
        }
    };
    let (session, old_conn) = match attach(&shared, &n).await {
        Ok(x) => x,
        Err(st) => {
            info!(status = ?st, "login refused");
            let _ = login::send_refusal(&mut stream, n.final_response, st).await;
            return;
        }
    };
    if let Some(old) = old_conn {
        // Connection reinstatement (RFC 7143 6.3.4): the old connection goes first, with its tasks.
        old.mark_clean();
        old.stop();
        let waits = session.abort_where(|_, t| t.cid == old.cid);
        crate::session::wait_all(waits).await;
    }
    let (exp, max) = session.cmd_sns();
    let (tx, rx) = mpsc::unbounded_channel();
    let cspan = tracing::info_span!(parent: &session.span, "conn", %peer, cid = n.cid);
    let ops = ConnOps::from(&n.connection);
    let (conn, stop_rx) = Conn::new(n.cid, ops, peer, local, tx, cspan.clone());
    if let Some(prev) = session.add_conn(conn.clone()) {
        prev.mark_clean();
        prev.stop();
    }
    if let Err(e) = login::send_final(&mut stream, n.final_response, exp, max).await {
        info!("login failed at the last step: {e}");
        conn.mark_clean();
        session
            .connection_ended(&conn, session.conn_count() > 1)
            .await;
        return;
    }
    info!(parent: &cspan, "full feature phase");
    let (rd, wr) = stream.into_split();
    let send_framing = n.connection.tx_framing();
    let recv_framing = n.connection.rx_framing();
    tokio::spawn(
        conn::writer(wr, rx, session.clone(), send_framing, n.next_stat_sn)
            .instrument(cspan.clone()),
    );
    let limits = session
        .target
        .as_ref()
        .map(|t| t.limits)
        .unwrap_or_default();
    let reader = Reader {
        session,
        conn,
        framing: recv_framing,
        buf,
        keepalive: Keepalive::new(limits.nop_interval, limits.nop_timeout),
    };
    reader.run(rd, stop_rx).instrument(cspan).await;
}

/// Creates the session of a leading login (closing the one it reinstates) or finds the session
/// a non-leading login joins. Returns the session and the connection a reused CID replaces.
async fn attach(
    shared: &Arc<Shared>,
    n: &Negotiated,
) -> Result<(Arc<Session>, Option<Arc<Conn>>), (u8, u8)> {
    let target_name = n.target.as_ref().map(|t| t.name.as_str());
    if n.leading {
        // Session reinstatement (RFC 7143 6.3.5): same initiator port, TSIH 0.
        if let Some(old) = shared.find_session(&n.initiator_name, n.isid, target_name) {
            info!(
                tsih = old.tsih,
                "reinstating session: closing the old one first"
            );
            old.close().await;
        }
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
        );
        shared.insert(s.clone());
        info!(parent: &s.span, "session created");
        return Ok((s, None));
    }
    let Some(s) = shared.session(n.tsih) else {
        return Err(status::SESSION_DOES_NOT_EXIST);
    };
    if s.isid != n.isid
        || s.initiator_name != n.initiator_name
        || s.target.as_ref().map(|t| t.name.as_str()) != target_name
    {
        return Err(status::SESSION_DOES_NOT_EXIST);
    }
    let old = s.conn(n.cid);
    if old.is_none() && s.conn_count() >= usize::from(s.ops.max_connections) {
        return Err(status::TOO_MANY_CONNECTIONS);
    }
    debug!(parent: &s.span, cid = n.cid, "connection joins the session");
    Ok((s, old))
}
