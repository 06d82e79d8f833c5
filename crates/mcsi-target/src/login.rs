//! The login phase of one connection (RFC 7143 sections 6 and 11.12), driven over the socket.
//!
//! The negotiation itself is mcsi-proto's sans-IO [`TargetLogin`]: this module reads Login
//! Requests, feeds them in, writes the responses, and answers the machine's questions from the
//! server's state through [`LoginEnv`] (does the target exist on this portal, which TSIH, does
//! the session a connection joins exist and have room, which StatSN / ExpCmdSN / MaxCmdSN).
//! Creating, joining and reinstating sessions happens in [`crate::server`] once the login has
//! succeeded.

use crate::admission::Gate;
use crate::config::AuthSpec;
use crate::config::Limits;
use crate::session::{Session, SessionOps, Shared, Target};
use bytes::BytesMut;
use mcsi_proto::chap::{ChapTarget, ChapUsers};
use mcsi_proto::keys::{ConnectionParams, KeyDef};
use mcsi_proto::login::{
    Authenticator, LoginEnv, LoginNumbers, LoginStep, NoAuth, Refusal, TargetAccess, TargetLogin,
    TargetLoginConfig,
};
use mcsi_proto::pdu::{self, Framing, Isid, LoginRequest, LoginResponse, Pdu};
use mcsi_proto::vendor::{
    ConnRole, ASYMMETRIC, CONNECTION_ROLE, REASSIGN_BEHIND_LOGOUT, TCP_REPORT,
};
use rand::RngCore;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::{debug, info, warn};

pub use mcsi_proto::keys::SessionType;
pub use mcsi_proto::login::status;

/// StatSN of the first Login Response on a new connection (any value will do, RFC 7143 11.13.4).
const FIRST_STAT_SN: u32 = 1;

/// The vendor keys a target registers (mcsi_proto::vendor): the asymmetric mode is agreed only
/// when the initiator offers it and the target allows it; a refusing target answers No.
fn vendor_keys(limits: &Limits) -> Vec<(KeyDef, String)> {
    // TCP state reports are agreed whenever an mcsi initiator asks for them.
    let report = (TCP_REPORT, "Yes".to_string());
    // The session core handles a connection's immediate requests in order, so TASK REASSIGNs
    // right behind their Logout find the tasks it left.
    let reassign = (REASSIGN_BEHIND_LOGOUT, "Yes".to_string());
    if limits.offer.asymmetric {
        vec![
            (ASYMMETRIC, "Yes".into()),
            (CONNECTION_ROLE, "requests,responses,both".into()),
            report,
            reassign,
        ]
    } else {
        vec![(ASYMMETRIC, "No".into()), report, reassign]
    }
}

/// What a successful login agreed on.
#[derive(Debug, Clone)]
pub struct Negotiated {
    pub initiator_name: String,
    pub target: Option<Arc<Target>>,
    pub isid: Isid,
    /// The TSIH of the session: newly assigned for a leading login, the joined one otherwise.
    pub tsih: u16,
    /// A leading login (TSIH 0 in the requests) creates a session.
    pub leading: bool,
    pub cid: u16,
    /// What this connection carries ([`ConnRole::Both`] outside an asymmetric session).
    pub role: ConnRole,
    /// Session-wide values (meaningful for a leading login; a joining connection uses its
    /// session's).
    pub session: SessionOps,
    pub connection: ConnectionParams,
    /// CmdSN of the login request: the session's first ExpCmdSN for a leading login.
    pub cmd_sn: u32,
    /// StatSN for the first full feature phase status on this connection.
    pub next_stat_sn: u32,
    /// The final login response, to send once the session is set up.
    pub final_response: LoginResponse,
}

/// How the login ended.
#[derive(Debug, thiserror::Error)]
pub enum LoginError {
    #[error("connection closed during login")]
    Closed,
    #[error("login timed out after {0:?}")]
    Timeout(Duration),
    #[error("I/O error during login: {0}")]
    Io(#[from] std::io::Error),
    #[error("PDU error during login: {0}")]
    Pdu(#[from] pdu::DecodeError),
    #[error("login refused with status {0}/{1:#04x} ({desc}){why}", desc = status::describe((*.0, *.1)), why = .2.as_deref().map(|w| format!(": {w}")).unwrap_or_default())]
    Refused(u8, u8, Option<String>),
    #[error("expected a Login Request, got {0:?}")]
    NotLogin(pdu::Opcode),
}

/// What a login runs over: a TCP socket, or any byte stream (an in-process pipe).
pub trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin {}
impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> Stream for S {}

/// Reads one Login Request (during login the default MaxRecvDataSegmentLength, 8192, applies:
/// RFC 7143 12.12).
async fn read_login<S: Stream>(
    stream: &mut S,
    buf: &mut BytesMut,
) -> Result<LoginRequest, LoginError> {
    let framing = Framing::default();
    loop {
        if let Some(p) = pdu::decode(buf, &framing)? {
            return match p {
                Pdu::LoginRequest(r) => Ok(r),
                other => Err(LoginError::NotLogin(other.opcode())),
            };
        }
        if stream.read_buf(buf).await? == 0 {
            return Err(LoginError::Closed);
        }
    }
}

/// How long one Login Response may take to leave. A response is a few KiB at most; a peer
/// whose socket takes none of it in this time (one that filled its receive window and stopped
/// reading) is dropped, also after the login phase's own deadline, when the final response or
/// a late refusal goes out and would otherwise hold its session and connection slots for ever.
pub const SEND_LIMIT: std::time::Duration = std::time::Duration::from_secs(15);

async fn send<S: Stream>(stream: &mut S, r: LoginResponse) -> Result<(), LoginError> {
    let e = Pdu::LoginResponse(r).encode(&Framing::default());
    let write = async {
        crate::conn::write_batch(stream, std::slice::from_ref(&e)).await?;
        stream.flush().await
    };
    match tokio::time::timeout(SEND_LIMIT, write).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the initiator took no Login Response for {SEND_LIMIT:?}"),
        )
        .into()),
    }
}

/// The server's side of the questions a login raises.
struct Env<'a> {
    shared: &'a Shared,
    gate: &'a Gate,
    /// ISID and TSIH of the first Login Request.
    first: Option<(Isid, u16)>,
    /// The address the connection arrived on (a target is only reachable on its portals).
    local: SocketAddr,
    /// The initiator's address (for access control and logs).
    peer: SocketAddr,
    /// The outcome of a CHAP exchange, as its observer saw it (never a secret).
    chap_note: Arc<Mutex<Option<String>>>,
    stat_sn: u32,
    target: Option<Arc<Target>>,
    /// The session a non-leading login joins.
    joins: Option<Arc<Session>>,
    /// Why the last refusal was made, for the log.
    why: Option<String>,
    /// The InitiatorName of the login, once seen.
    initiator: Option<String>,
}

impl Env<'_> {
    fn refuse(&mut self, st: (u8, u8), why: String) -> Refusal {
        self.why = Some(why);
        st.into()
    }

    /// Authorization, then the authenticator the login uses (RFC 7143 12.1): CHAP when users
    /// are configured, else AuthMethod=None.
    fn access(
        &mut self,
        auth: &AuthSpec,
        what: &str,
        initiator: &str,
    ) -> Result<Box<dyn Authenticator>, Refusal> {
        if !auth.allows(initiator, self.peer.ip()) {
            return Err(self.refuse(
                status::AUTHZ_FAILED,
                format!(
                    "initiator {initiator} from {} may not use {what}",
                    self.peer.ip()
                ),
            ));
        }
        if auth.chap.is_empty() {
            return Ok(Box::new(NoAuth));
        }
        let mut users = ChapUsers::new();
        let now = std::time::Instant::now();
        let mut locked = Vec::new();
        for u in &auth.chap {
            // A user whose logins failed lately sits out its lock ([`ChapThrottle`]).
            if let Some(left) = self.shared.chap_throttle.locked(&u.user, now) {
                locked.push(format!(
                    "{:?} ({:.0} s more)",
                    u.user,
                    left.as_secs_f64().ceil()
                ));
                continue;
            }
            // Validated with the configuration; a failure here leaves the user out.
            let _ = users.insert(u.credentials());
        }
        let note = self.chap_note.clone();
        let throttle = self.shared.chap_throttle.clone();
        let algorithms: &[mcsi_proto::chap::ChapAlgorithm] = if auth.chap_algorithms.is_empty() {
            &crate::config::DEFAULT_CHAP_ALGORITHMS
        } else {
            &auth.chap_algorithms
        };
        let chap = ChapTarget::new(users, |b: &mut [u8]| rand::rngs::OsRng.fill_bytes(b))
            .with_algorithms(algorithms)
            .with_observer(move |r| {
                let text = match r {
                    Ok(ok) => {
                        throttle.succeeded(&ok.user);
                        format!(
                            "CHAP user {:?} authenticated ({}{})",
                            ok.user,
                            ok.algorithm,
                            if ok.mutual { ", mutual" } else { "" }
                        )
                    }
                    Err(e) => {
                        if let mcsi_proto::chap::ChapError::WrongResponse(user) = e {
                            throttle.failed(user, std::time::Instant::now());
                        }
                        let held = if locked.is_empty() {
                            String::new()
                        } else {
                            format!(
                                " (locked out after failed logins: {})",
                                locked.join(", ")
                            )
                        };
                        let hint = if matches!(e, mcsi_proto::chap::ChapError::NoCommonAlgorithm { .. }) {
                            " (an initiator that offers only MD5, as open-iscsi does by default and libiscsi always, needs MD5 in the target's chap_algorithms; open-iscsi can offer more with node.session.auth.chap_algs = SHA3-256,SHA256,SHA1,MD5)"
                        } else {
                            ""
                        };
                        format!("CHAP failed: {e}{held}{hint}")
                    }
                };
                *note.lock().unwrap_or_else(|p| p.into_inner()) = Some(text);
            });
        Ok(Box::new(chap))
    }

    fn limits(&self) -> Limits {
        self.target.as_ref().map(|t| t.limits).unwrap_or_default()
    }
}

impl LoginEnv for Env<'_> {
    fn target(
        &mut self,
        session_type: SessionType,
        target_name: Option<&str>,
        initiator_name: &str,
    ) -> Result<TargetAccess, Refusal> {
        if let Err(e) = crate::name::check_peer(initiator_name) {
            return Err(self.refuse(status::INITIATOR_ERROR, format!("InitiatorName: {e}")));
        }
        self.initiator = Some(initiator_name.to_owned());
        match (session_type, target_name) {
            (SessionType::Discovery, _) => {
                let authenticator =
                    self.access(&self.shared.discovery_auth, "discovery", initiator_name)?;
                Ok(TargetAccess {
                    params: Limits::default().local_params(),
                    authenticator,
                    target_alias: None,
                    portal_group_tag: None,
                    extensions: Vec::new(),
                })
            }
            (SessionType::Normal, Some(name)) => {
                let local = self.local;
                // At one of its portals: that address, or a wildcard portal on its port.
                let Some(t) = self.shared.target(name).filter(|t| {
                    t.portals.load().iter().any(|p| {
                        p.port() == local.port()
                            && (p.ip() == local.ip() || p.ip().is_unspecified())
                    })
                }) else {
                    return Err(self.refuse(
                        status::NOT_FOUND,
                        format!("no target '{name}' on portal {}", self.local),
                    ));
                };
                let authenticator =
                    self.access(&t.auth.load(), &format!("target {name}"), initiator_name)?;
                // Only a new session's leading login moves: a connection joining a session, or
                // reinstating one of its connections, belongs where the session is. A login
                // that already arrived where `to` points is served (no loop, whatever the
                // configuration).
                let leading = matches!(self.first, Some((_, 0)));
                if let Some(r) = t
                    .redirect
                    .as_ref()
                    .filter(|r| leading && r.applies(self.local) && !r.points_at(self.local))
                {
                    // RFC 7143 11.13.5: "target moved", and where to log in instead; a
                    // redirection's TargetAddress carries no portal group tag (13.8).
                    self.why = Some(format!("redirected to {}", r.to));
                    return Err(Refusal {
                        status: if r.permanent {
                            status::TARGET_MOVED_PERM
                        } else {
                            status::TARGET_MOVED_TEMP
                        },
                        keys: vec![("TargetAddress".into(), r.to.clone())],
                    });
                }
                if let Some((isid, 0)) = self.first {
                    // A new session: refused now if the target is full, before authentication.
                    let reinstates = self
                        .shared
                        .find_session(initiator_name, isid, Some(name))
                        .is_some();
                    if let Err(d) = self.gate.check_session(self.shared, &t, reinstates) {
                        return Err(self.refuse(d.status, d.why));
                    }
                }
                let access = TargetAccess {
                    params: t.limits.local_params(),
                    authenticator,
                    target_alias: t.alias.clone(),
                    portal_group_tag: Some(t.tpgt),
                    extensions: vendor_keys(&t.limits),
                };
                self.target = Some(t);
                Ok(access)
            }
            (SessionType::Normal, None) => {
                Err(self.refuse(status::MISSING_PARAMETER, "TargetName missing".into()))
            }
        }
    }

    fn session(
        &mut self,
        isid: Isid,
        tsih: u16,
        cid: u16,
        initiator_name: &str,
        target_name: Option<&str>,
    ) -> Result<u16, Refusal> {
        if tsih == 0 {
            // Reinstating an older session of this initiator port happens once the login has
            // succeeded (crate::server::attach).
            return self.shared.alloc_tsih().ok_or_else(|| {
                self.refuse(
                    status::OUT_OF_RESOURCES,
                    "every TSIH (65,535 sessions) is in use".into(),
                )
            });
        }
        let Some(s) = self.shared.session(tsih).filter(|s| {
            s.isid == isid
                && s.initiator_name == initiator_name
                && s.target.as_ref().map(|t| t.name.as_str()) == target_name
        }) else {
            return Err(self.refuse(
                status::SESSION_DOES_NOT_EXIST,
                format!("no session with TSIH {tsih} for this initiator port and target"),
            ));
        };
        // A new CID must fit under MaxConnections (13.2); a known CID reinstates its
        // connection (6.3.4).
        let max = usize::from(s.ops.max_connections);
        if s.conn(cid).is_none() && s.conn_count() >= max {
            return Err(self.refuse(
                status::TOO_MANY_CONNECTIONS,
                format!("session {tsih} already has MaxConnections={max} connections"),
            ));
        }
        if let Some(t) = s.target.as_ref().filter(|_| s.conn(cid).is_none()) {
            if let Err(d) = self.gate.check_connection(t) {
                return Err(self.refuse(d.status, d.why));
            }
        }
        self.joins = Some(s);
        Ok(tsih)
    }

    fn numbers(&mut self, req: &LoginRequest) -> LoginNumbers {
        let stat_sn = self.stat_sn;
        self.stat_sn = self.stat_sn.wrapping_add(1);
        let (exp_cmd_sn, max_cmd_sn) = match &self.joins {
            Some(s) => s.cmd_sns(),
            // A leading login: the session will start at the login's CmdSN (login requests are
            // immediate and do not advance it).
            None => (
                req.cmd_sn,
                req.cmd_sn
                    .wrapping_add(self.limits().offer.queue_depth.max(1) - 1),
            ),
        };
        LoginNumbers {
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
        }
    }
}

/// Runs the login phase, which must be over within the server's login timeout. On success the
/// final response has not been sent yet: the caller sets up the session (reinstatement,
/// joining) and sends it with [`send_final`].
pub async fn run<S: Stream>(
    shared: &Shared,
    gate: &Gate,
    stream: &mut S,
    buf: &mut BytesMut,
    local: SocketAddr,
    peer: SocketAddr,
) -> Result<Negotiated, LoginError> {
    let limit = gate.limits.login_timeout;
    tokio::time::timeout(limit, run_inner(shared, gate, stream, buf, local, peer))
        .await
        .map_err(|_| LoginError::Timeout(limit))?
}

async fn run_inner<S: Stream>(
    shared: &Shared,
    gate: &Gate,
    stream: &mut S,
    buf: &mut BytesMut,
    local: SocketAddr,
    peer: SocketAddr,
) -> Result<Negotiated, LoginError> {
    let chap_note = Arc::new(Mutex::new(None));
    let mut env = Env {
        shared,
        gate,
        first: None,
        local,
        peer,
        chap_note: chap_note.clone(),
        stat_sn: FIRST_STAT_SN,
        target: None,
        joins: None,
        why: None,
        initiator: None,
    };
    let mut machine = TargetLogin::new(TargetLoginConfig {
        // One portal group per target: its own tag replaces this once the login names it
        // (TargetAccess::portal_group_tag).
        portal_group_tag: 1,
        ..TargetLoginConfig::default()
    });
    let mut first_cmd_sn = None;
    loop {
        let req = match read_login(stream, buf).await {
            Ok(r) => r,
            Err(LoginError::Pdu(e)) => {
                refuse_malformed(stream, buf, &e).await;
                return Err(LoginError::Pdu(e));
            }
            Err(e) => return Err(e),
        };
        let cmd_sn = *first_cmd_sn.get_or_insert(req.cmd_sn);
        env.first.get_or_insert((req.isid, req.tsih));
        match machine.handle(&req, &mut env) {
            LoginStep::Continue(r) => send(stream, r).await?,
            LoginStep::Fail(r) => {
                let (class, detail) = (r.status_class, r.status_detail);
                send(stream, r).await?;
                let chap = chap_note.lock().unwrap_or_else(|p| p.into_inner()).take();
                let why = env.why.take().or(chap);
                let who = env
                    .initiator
                    .clone()
                    .unwrap_or_else(|| machine_initiator(&req));
                if class == 1 {
                    tracing::info!(
                        initiator = %who,
                        peer = %peer,
                        "login {}",
                        why.as_deref().unwrap_or("redirected")
                    );
                } else {
                    warn!(
                        initiator = %who,
                        peer = %peer,
                        "login refused with status {class}/{detail:#04x} ({}){}",
                        status::describe((class, detail)),
                        why.as_deref().map(|w| format!(": {w}")).unwrap_or_default()
                    );
                }
                return Err(LoginError::Refused(class, detail, why));
            }
            LoginStep::FullFeature {
                response,
                session,
                connection,
                session_type: _,
                initiator_name,
                target_name,
                isid,
                tsih,
                cid,
            } => {
                if let Some(note) = chap_note.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    info!(initiator = %initiator_name, peer = %peer, "{note}");
                }
                debug!(
                    initiator = %initiator_name,
                    target = target_name.as_deref().unwrap_or("discovery"),
                    ?session,
                    ?connection,
                    "login negotiated"
                );
                let queue_depth = env.limits().offer.queue_depth;
                // A joining connection's role counts only in a session that agreed on the mode.
                let asymmetric = match &env.joins {
                    Some(s) => s.ops.asymmetric,
                    None => mcsi_proto::vendor::asymmetric_agreed(&session.extensions),
                };
                let role = ConnRole::agreed(asymmetric, &session.extensions);
                return Ok(Negotiated {
                    initiator_name,
                    target: env.target.clone(),
                    isid,
                    tsih,
                    leading: req.tsih == 0,
                    cid,
                    role,
                    session: SessionOps::new(&session, queue_depth),
                    connection,
                    cmd_sn,
                    next_stat_sn: env.stat_sn,
                    final_response: response,
                });
            }
        }
    }
}

/// Answers the first Login Request of a connection with a refusal, for a limit reached before
/// the login began, and returns the InitiatorName the request gave (for the log). Waits `wait`
/// at most for the request.
pub async fn refuse_first<S: Stream>(
    stream: &mut S,
    buf: &mut BytesMut,
    st: (u8, u8),
    wait: Duration,
) -> Result<String, LoginError> {
    let req = tokio::time::timeout(wait, read_login(stream, buf))
        .await
        .map_err(|_| LoginError::Timeout(wait))??;
    let r = LoginResponse {
        transit: false,
        continue_: false,
        csg: req.csg,
        nsg: req.csg,
        version_max: mcsi_proto::login::VERSION,
        version_active: mcsi_proto::login::VERSION,
        isid: req.isid,
        tsih: req.tsih,
        itt: req.itt,
        stat_sn: FIRST_STAT_SN,
        exp_cmd_sn: req.cmd_sn,
        max_cmd_sn: req.cmd_sn,
        status_class: st.0,
        status_detail: st.1,
        data: bytes::Bytes::new(),
    };
    send(stream, r).await?;
    Ok(machine_initiator(&req))
}

/// A Login Request that does not decode (T and C both set, a reserved stage, a data segment
/// over 8192 bytes, ...) is answered with 2/00, initiator error (RFC 7143 11.13.5), taken from
/// its header, before the connection is closed, so that the initiator learns why.
async fn refuse_malformed<S: Stream>(stream: &mut S, buf: &BytesMut, e: &pdu::DecodeError) {
    // A consumed PDU's header comes with the error; one too long to take is still in front.
    let header: &[u8] = match e.rejected_header() {
        Some(h) => h,
        None => buf,
    };
    let Some(bhs) = pdu::Bhs::new(header) else {
        return;
    };
    if bhs.opcode() != Some(pdu::Opcode::LoginRequest) {
        return;
    }
    let csg = pdu::Stage::from_u8((bhs.byte(1) >> 2) & 3).unwrap_or(pdu::Stage::Security);
    let mut isid = [0u8; 6];
    isid.copy_from_slice(&bhs.bytes()[8..14]);
    let cmd_sn = bhs.be32(24);
    let r = LoginResponse {
        transit: false,
        continue_: false,
        csg,
        nsg: csg,
        version_max: 0,
        version_active: 0,
        isid: Isid(isid),
        tsih: 0,
        itt: bhs.be32(16),
        stat_sn: FIRST_STAT_SN,
        exp_cmd_sn: cmd_sn,
        max_cmd_sn: cmd_sn,
        status_class: status::INITIATOR_ERROR.0,
        status_detail: status::INITIATOR_ERROR.1,
        data: bytes::Bytes::new(),
    };
    debug!("malformed login request answered with 2/00: {e}");
    let _ = send(stream, r).await;
}

/// The InitiatorName of a login request, if it carries one (for logs).
fn machine_initiator(req: &LoginRequest) -> String {
    mcsi_proto::text::parse(&req.data, &Default::default())
        .ok()
        .and_then(|k| k.into_iter().find(|(k, _)| k == "InitiatorName"))
        // Not yet checked: escaped, so that a name cannot forge log lines.
        .map(|(_, v)| {
            v.chars()
                .take(256)
                .collect::<String>()
                .escape_debug()
                .to_string()
        })
        .unwrap_or_else(|| "(not named in this request)".into())
}

/// Sends the final login response with the session's current window.
pub async fn send_final<S: Stream>(
    stream: &mut S,
    mut r: LoginResponse,
    exp: u32,
    max: u32,
) -> Result<(), LoginError> {
    r.exp_cmd_sn = exp;
    r.max_cmd_sn = max;
    send(stream, r).await
}

/// Turns the final login response into a refusal (the session could not be set up after all).
pub async fn send_refusal<S: Stream>(
    stream: &mut S,
    mut r: LoginResponse,
    st: (u8, u8),
) -> Result<(), LoginError> {
    r.transit = false;
    r.nsg = r.csg;
    r.tsih = 0;
    r.status_class = st.0;
    r.status_detail = st.1;
    r.data = bytes::Bytes::new();
    send(stream, r).await
}
