//! The login phase (RFC 7143 sections 6.3 and 11.12-11.13): status codes and sans-IO state
//! machines for both sides.
//!
//! [`TargetLogin`] takes Login Requests and returns the response to send; whatever depends on
//! target state (does the target exist, may this initiator see it, which TSIH, which StatSN) is
//! asked through [`LoginEnv`]. [`InitiatorLogin`] produces Login Requests and takes responses.
//! Both walk security -> operational -> full feature phase with the [`Negotiator`] of
//! [`crate::keys`], join text spread over PDUs with the C bit, and split long text themselves.
//! Authentication goes through the [`Authenticator`] seam: [`NoAuth`] (AuthMethod=None) here,
//! CHAP in [`crate::chap`].

use std::collections::VecDeque;

use bytes::Bytes;

use crate::keys::{
    lookup, respond, Answer, ConnectionParams, KeyDef, LocalParams, NegotiationError, Negotiator,
    Role, SessionParams, SessionType,
};
use crate::pdu::{Isid, LoginRequest, LoginResponse, Stage};
use crate::text::{self, TextAccumulator, TextError, TextLimits};

/// Login status classes and details (RFC 7143 11.13.5), as (class, detail).
pub mod status {
    pub const SUCCESS: (u8, u8) = (0, 0);
    pub const TARGET_MOVED_TEMP: (u8, u8) = (1, 1);
    pub const TARGET_MOVED_PERM: (u8, u8) = (1, 2);
    pub const INITIATOR_ERROR: (u8, u8) = (2, 0);
    pub const AUTH_FAILED: (u8, u8) = (2, 1);
    pub const AUTHZ_FAILED: (u8, u8) = (2, 2);
    pub const NOT_FOUND: (u8, u8) = (2, 3);
    pub const TARGET_REMOVED: (u8, u8) = (2, 4);
    pub const UNSUPPORTED_VERSION: (u8, u8) = (2, 5);
    pub const TOO_MANY_CONNECTIONS: (u8, u8) = (2, 6);
    pub const MISSING_PARAMETER: (u8, u8) = (2, 7);
    pub const CANT_INCLUDE_IN_SESSION: (u8, u8) = (2, 8);
    pub const SESSION_TYPE_NOT_SUPPORTED: (u8, u8) = (2, 9);
    pub const SESSION_DOES_NOT_EXIST: (u8, u8) = (2, 10);
    pub const INVALID_DURING_LOGIN: (u8, u8) = (2, 11);
    pub const TARGET_ERROR: (u8, u8) = (3, 0);
    pub const SERVICE_UNAVAILABLE: (u8, u8) = (3, 1);
    pub const OUT_OF_RESOURCES: (u8, u8) = (3, 2);

    /// A short description of a status, for logs and error messages.
    pub fn describe(s: (u8, u8)) -> &'static str {
        match s {
            SUCCESS => "success",
            TARGET_MOVED_TEMP => "target moved temporarily",
            TARGET_MOVED_PERM => "target moved permanently",
            INITIATOR_ERROR => "initiator error",
            AUTH_FAILED => "authentication failure",
            AUTHZ_FAILED => "authorization failure",
            NOT_FOUND => "target not found",
            TARGET_REMOVED => "target removed",
            UNSUPPORTED_VERSION => "unsupported version",
            TOO_MANY_CONNECTIONS => "too many connections",
            MISSING_PARAMETER => "missing parameter",
            CANT_INCLUDE_IN_SESSION => "cannot include in session",
            SESSION_TYPE_NOT_SUPPORTED => "session type not supported",
            SESSION_DOES_NOT_EXIST => "session does not exist",
            INVALID_DURING_LOGIN => "invalid request during login",
            TARGET_ERROR => "target error",
            SERVICE_UNAVAILABLE => "service unavailable",
            OUT_OF_RESOURCES => "out of resources",
            _ => "unknown status",
        }
    }
}

/// The only protocol version (VersionMax/VersionMin/VersionActive, RFC 7143 11.12.4).
pub const VERSION: u8 = 0x00;

/// Largest data segment either side may send during login (RFC 7143 12.12: the default
/// MaxRecvDataSegmentLength applies until login completes).
pub const LOGIN_MAX_SEGMENT: usize = 8192;

/// Rounds after which a login that does not advance is abandoned.
const MAX_ROUNDS: u32 = 64;

/// The sequence numbers a target puts in one Login Response. Proto does not keep counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoginNumbers {
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
}

/// A refused login: the status to answer with and optional keys (e.g. TargetAddress for a
/// redirection, class 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: (u8, u8),
    pub keys: Vec<(String, String)>,
}

impl From<(u8, u8)> for Refusal {
    fn from(status: (u8, u8)) -> Self {
        Refusal {
            status,
            keys: Vec::new(),
        }
    }
}

/// The progress of an authentication exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthProgress {
    /// Send these keys and wait for more.
    Continue(Vec<(String, String)>),
    /// Authentication succeeded; send these keys (possibly none).
    Done(Vec<(String, String)>),
}

/// The authentication seam of the security stage (RFC 7143 6.3.1, 12.1). One value per
/// connection login. A CHAP implementation plugs in here.
pub trait Authenticator: Send {
    /// AuthMethod values this side accepts, in order of preference (`"None"`, `"CHAP"`, ...).
    fn methods(&self) -> Vec<String>;
    /// Handle the peer's keys of the exchange (`CHAP_*`) for the agreed method.
    /// `Err(status)` ends the login (normally [`status::AUTH_FAILED`]).
    fn step(&mut self, method: &str, keys: &[(String, String)]) -> Result<AuthProgress, (u8, u8)>;
    /// Initiator side: after `Continue`, whether this side only awaits the peer's last keys (the
    /// target's answer to a mutual CHAP challenge), so the request carrying ours may already ask
    /// to leave the security stage (RFC 7143 12.1.3). The stage is still left only after `Done`.
    fn awaiting_final(&self) -> bool {
        false
    }
}

/// AuthMethod=None: no authentication.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoAuth;

impl Authenticator for NoAuth {
    fn methods(&self) -> Vec<String> {
        vec!["None".to_owned()]
    }

    fn step(
        &mut self,
        _method: &str,
        _keys: &[(String, String)],
    ) -> Result<AuthProgress, (u8, u8)> {
        Ok(AuthProgress::Done(Vec::new()))
    }
}

/// What the target's environment allows for one login.
pub struct TargetAccess {
    /// Negotiation limits for this target (or for discovery sessions).
    pub params: LocalParams,
    pub authenticator: Box<dyn Authenticator>,
    /// Declared in the first response of a normal session, if set.
    pub target_alias: Option<String>,
    /// The target's portal group tag, declared in the first response of a normal session
    /// (None: [`TargetLoginConfig::portal_group_tag`]).
    pub portal_group_tag: Option<u16>,
    /// Vendor keys this target registers, with its values, beyond the server-wide
    /// [`TargetLoginConfig::extensions`] (a key registered in both keeps the server-wide value).
    pub extensions: Vec<(KeyDef, String)>,
}

impl std::fmt::Debug for TargetAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetAccess")
            .field("params", &self.params)
            .field("target_alias", &self.target_alias)
            .finish_non_exhaustive()
    }
}

/// The target's answers to questions a login raises. Keeps proto free of target state.
pub trait LoginEnv {
    /// The target exists and this initiator may use it (for discovery sessions `target_name` is
    /// `None`): the limits and authenticator to use. Typical refusals: [`status::NOT_FOUND`],
    /// [`status::AUTHZ_FAILED`], [`status::SESSION_TYPE_NOT_SUPPORTED`].
    fn target(
        &mut self,
        session_type: SessionType,
        target_name: Option<&str>,
        initiator_name: &str,
    ) -> Result<TargetAccess, Refusal>;

    /// Leading login (`tsih == 0`): assign the TSIH of the new session (reinstatement of an
    /// older session with the same ISID is the target's business). Non-leading login: check that
    /// the session exists for this ISID and initiator and may take one more connection, and
    /// return `tsih`; `cid` tells a new connection (refused with
    /// [`status::TOO_MANY_CONNECTIONS`] when the session is full, RFC 7143 13.2) from the
    /// reinstatement of an existing one (6.3.4). Called once the login is about to succeed
    /// (leading) or on the first request (non-leading).
    fn session(
        &mut self,
        isid: Isid,
        tsih: u16,
        cid: u16,
        initiator_name: &str,
        target_name: Option<&str>,
    ) -> Result<u16, Refusal>;

    /// StatSN, ExpCmdSN and MaxCmdSN for the response to `req` (called once per response).
    fn numbers(&mut self, req: &LoginRequest) -> LoginNumbers;
}

/// Target-wide login settings.
#[derive(Debug, Clone)]
pub struct TargetLoginConfig {
    /// TargetPortalGroupTag of the portal the connection arrived on (RFC 7143 13.9).
    pub portal_group_tag: u16,
    pub text_limits: TextLimits,
    /// Registered vendor keys and our values for them.
    pub extensions: Vec<(KeyDef, String)>,
}

impl Default for TargetLoginConfig {
    fn default() -> Self {
        TargetLoginConfig {
            portal_group_tag: 1,
            text_limits: TextLimits::default(),
            extensions: Vec::new(),
        }
    }
}

/// What the target does after one Login Request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoginStep {
    /// Send this response and wait for the next request.
    Continue(LoginResponse),
    /// Send this response: the connection is now in full feature phase with these parameters.
    FullFeature {
        response: LoginResponse,
        session: SessionParams,
        connection: ConnectionParams,
        session_type: SessionType,
        initiator_name: String,
        target_name: Option<String>,
        isid: Isid,
        tsih: u16,
        cid: u16,
    },
    /// Send this response (status class != 0) and close the connection.
    Fail(LoginResponse),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    Done,
    Failed,
}

/// The reply being built for one request.
struct Reply {
    keys: Vec<(String, String)>,
    transit: bool,
    nsg: Stage,
}

/// Target side of one connection's login, sans-IO.
pub struct TargetLogin {
    cfg: TargetLoginConfig,
    phase: Phase,
    stage: Stage,
    started: bool,
    isid: Isid,
    tsih: u16,
    cid: u16,
    rounds: u32,
    text: TextAccumulator,
    neg: Option<Negotiator>,
    auth: Option<Box<dyn Authenticator>>,
    auth_method: Option<String>,
    authenticated: bool,
    initiator_name: String,
    target_name: Option<String>,
    session_type: SessionType,
    target_alias: Option<String>,
    tpgt_sent: bool,
    /// Response text pieces still to send (C bit), and the reply they belong to.
    outgoing: VecDeque<Bytes>,
    deferred: Option<(bool, Stage)>,
}

impl std::fmt::Debug for TargetLogin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetLogin")
            .field("phase", &self.phase)
            .field("stage", &self.stage)
            .field("isid", &self.isid)
            .field("tsih", &self.tsih)
            .field("cid", &self.cid)
            .field("initiator_name", &self.initiator_name)
            .field("target_name", &self.target_name)
            .finish_non_exhaustive()
    }
}

fn get<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

impl TargetLogin {
    pub fn new(cfg: TargetLoginConfig) -> Self {
        let limits = cfg.text_limits;
        TargetLogin {
            cfg,
            phase: Phase::Running,
            stage: Stage::Security,
            started: false,
            isid: Isid::default(),
            tsih: 0,
            cid: 0,
            rounds: 0,
            text: TextAccumulator::new(limits),
            neg: None,
            auth: None,
            auth_method: None,
            authenticated: false,
            initiator_name: String::new(),
            target_name: None,
            session_type: SessionType::Normal,
            target_alias: None,
            tpgt_sent: false,
            outgoing: VecDeque::new(),
            deferred: None,
        }
    }

    /// The current login stage.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// Feed one Login Request; get the response to send and what happens next.
    pub fn handle(&mut self, req: &LoginRequest, env: &mut dyn LoginEnv) -> LoginStep {
        match self.step(req, env) {
            Ok(step) => step,
            Err(refusal) => {
                self.phase = Phase::Failed;
                let mut resp = self.response(req, env, false, self.stage, refusal.keys);
                resp.status_class = refusal.status.0;
                resp.status_detail = refusal.status.1;
                LoginStep::Fail(resp)
            }
        }
    }

    fn response(
        &self,
        req: &LoginRequest,
        env: &mut dyn LoginEnv,
        transit: bool,
        nsg: Stage,
        keys: Vec<(String, String)>,
    ) -> LoginResponse {
        let n = env.numbers(req);
        LoginResponse {
            transit,
            continue_: false,
            csg: self.stage,
            nsg: if transit { nsg } else { self.stage },
            version_max: VERSION,
            version_active: VERSION,
            isid: req.isid,
            tsih: req.tsih,
            itt: req.itt,
            stat_sn: n.stat_sn,
            exp_cmd_sn: n.exp_cmd_sn,
            max_cmd_sn: n.max_cmd_sn,
            status_class: 0,
            status_detail: 0,
            data: text::encode(&keys),
        }
    }

    fn step(&mut self, req: &LoginRequest, env: &mut dyn LoginEnv) -> Result<LoginStep, Refusal> {
        if self.phase != Phase::Running {
            return Err(status::INVALID_DURING_LOGIN.into());
        }
        self.rounds += 1;
        if self.rounds > MAX_ROUNDS {
            return Err(status::INITIATOR_ERROR.into());
        }
        if !self.started {
            // 11.12.4: we speak version 0 only (VersionMax cannot be below it).
            if req.version_min > VERSION {
                return Err(status::UNSUPPORTED_VERSION.into());
            }
            if req.csg == Stage::FullFeature {
                return Err(status::INITIATOR_ERROR.into());
            }
            self.started = true;
            self.isid = req.isid;
            self.tsih = req.tsih;
            self.cid = req.cid;
            self.stage = req.csg;
        } else if req.isid != self.isid || req.tsih != self.tsih || req.cid != self.cid {
            return Err(status::INITIATOR_ERROR.into());
        } else if req.csg != self.stage {
            // The stage only moves forward, and only through a transit we granted (6.3).
            return Err(status::INITIATOR_ERROR.into());
        }
        if req.transit {
            if req.continue_ {
                return Err(status::INITIATOR_ERROR.into());
            }
            let ok = matches!(
                (req.csg, req.nsg),
                (Stage::Security, Stage::Operational)
                    | (Stage::Security, Stage::FullFeature)
                    | (Stage::Operational, Stage::FullFeature)
            );
            if !ok {
                return Err(status::INITIATOR_ERROR.into());
            }
        }

        // The rest of a long response, fetched with empty requests.
        if !self.outgoing.is_empty() {
            if !req.data.is_empty() || req.continue_ {
                return Err(status::INITIATOR_ERROR.into());
            }
            return self.next_piece(req, env);
        }

        // 11.12.2: with the C bit the text goes on in the next request; acknowledge with an
        // empty response.
        let pairs = match self.text.push(&req.data, req.continue_) {
            Ok(None) => {
                return Ok(LoginStep::Continue(self.response(
                    req,
                    env,
                    false,
                    self.stage,
                    Vec::new(),
                )))
            }
            Ok(Some(p)) => p,
            Err(_) => return Err(status::INITIATOR_ERROR.into()),
        };

        let first = self.neg.is_none();
        if first {
            self.begin(req, &pairs, env)?;
        } else if get(&pairs, "SessionType").is_some()
            || get(&pairs, "InitiatorName").is_some()
            || get(&pairs, "TargetName").is_some()
        {
            // These are declared once, in the first request (RFC 7143 13.4, 13.5, 13.21).
            return Err(status::INITIATOR_ERROR.into());
        }

        let mut reply = Reply {
            keys: Vec::new(),
            transit: false,
            nsg: self.stage,
        };
        self.negotiate(req, &pairs, &mut reply, first)?;
        self.finish(req, env, reply)
    }

    /// The first request: names, session type, access, and the negotiator.
    fn begin(
        &mut self,
        req: &LoginRequest,
        pairs: &[(String, String)],
        env: &mut dyn LoginEnv,
    ) -> Result<(), Refusal> {
        // 13.5: InitiatorName in the first request of every connection.
        let Some(initiator) = get(pairs, "InitiatorName").filter(|v| !v.is_empty()) else {
            return Err(status::MISSING_PARAMETER.into());
        };
        let session_type = match get(pairs, "SessionType") {
            None => SessionType::Normal,
            Some(v) => SessionType::parse(v).ok_or(Refusal {
                status: status::INITIATOR_ERROR,
                keys: vec![("SessionType".into(), "Reject".into())],
            })?,
        };
        // 13.4: TargetName is required for normal sessions.
        let target = match session_type {
            SessionType::Normal => Some(
                get(pairs, "TargetName")
                    .filter(|v| !v.is_empty())
                    .ok_or(Refusal::from(status::MISSING_PARAMETER))?
                    .to_owned(),
            ),
            SessionType::Discovery => None,
        };
        let access = env.target(session_type, target.as_deref(), initiator)?;
        self.initiator_name = initiator.to_owned();
        self.target_name = target;
        self.session_type = session_type;
        self.target_alias = access.target_alias;
        if let Some(t) = access.portal_group_tag {
            self.cfg.portal_group_tag = t;
        }
        self.auth = Some(access.authenticator);
        let mut neg = Negotiator::new(Role::Target, access.params);
        neg.set_session_type(session_type);
        neg.set_leading(req.tsih == 0);
        for (def, local) in self.cfg.extensions.iter().chain(&access.extensions) {
            // Invalid or repeated registrations are left out; an unregistered key is answered
            // NotUnderstood.
            let _ = neg.register(*def, local.clone());
        }
        self.neg = Some(neg);
        if req.tsih != 0 {
            self.tsih = env.session(
                req.isid,
                req.tsih,
                req.cid,
                &self.initiator_name,
                self.target_name.as_deref(),
            )?;
        }
        // Starting in the operational stage skips authentication: only allowed when the
        // target accepts AuthMethod=None.
        if self.stage == Stage::Operational {
            if self.accepts_none() {
                self.authenticated = true;
            } else {
                return Err(status::AUTH_FAILED.into());
            }
        }
        Ok(())
    }

    fn accepts_none(&self) -> bool {
        self.auth
            .as_ref()
            .is_some_and(|a| a.methods().iter().any(|m| m == "None"))
    }

    fn negotiate(
        &mut self,
        req: &LoginRequest,
        pairs: &[(String, String)],
        reply: &mut Reply,
        first: bool,
    ) -> Result<(), Refusal> {
        let stage = self.stage;
        let Some(neg) = self.neg.as_mut() else {
            return Err(status::TARGET_ERROR.into());
        };
        let processed = neg
            .handle(pairs, Some(stage))
            .map_err(|_: NegotiationError| Refusal::from(status::INITIATOR_ERROR))?;
        reply.keys = processed.answers;

        let method_agreed_now = self.auth_method.is_none() && get(pairs, "AuthMethod").is_some();
        if let Some(offered) = get(pairs, "AuthMethod") {
            // The negotiator does not know our methods; answer AuthMethod here (12.1).
            let methods = self.auth.as_ref().map(|a| a.methods()).unwrap_or_default();
            let answer = match lookup("AuthMethod") {
                Some(def) if stage == Stage::Security => respond(def, offered, &methods.join(",")),
                _ => Answer::Reject,
            };
            if stage == Stage::Security && answer == Answer::Reject {
                return Err(Refusal {
                    status: status::AUTH_FAILED,
                    keys: vec![("AuthMethod".into(), "Reject".into())],
                });
            }
            if let Some(slot) = reply.keys.iter_mut().find(|(k, _)| k == "AuthMethod") {
                slot.1 = answer.as_str().to_owned();
            }
            if let Answer::Value(m) = answer {
                self.authenticated = m == "None";
                self.auth_method = Some(m);
            }
        }
        if !processed.auth.is_empty() {
            let (Some(method), Some(auth)) = (self.auth_method.clone(), self.auth.as_mut()) else {
                // Exchange keys before an AuthMethod was agreed.
                return Err(status::INITIATOR_ERROR.into());
            };
            if method == "None" {
                return Err(status::INITIATOR_ERROR.into());
            }
            match auth.step(&method, &processed.auth).map_err(Refusal::from)? {
                AuthProgress::Continue(keys) => reply.keys.extend(keys),
                AuthProgress::Done(keys) => {
                    reply.keys.extend(keys);
                    self.authenticated = true;
                }
            }
        }

        // 13.9: TargetPortalGroupTag in the first response of a normal session's login.
        if first && self.session_type == SessionType::Normal && !self.tpgt_sent {
            reply.keys.push((
                "TargetPortalGroupTag".into(),
                self.cfg.portal_group_tag.to_string(),
            ));
            self.tpgt_sent = true;
            if let Some(alias) = &self.target_alias {
                reply.keys.push(("TargetAlias".into(), alias.clone()));
            }
        }

        // An initiator offering a list such as AuthMethod=CHAP,None cannot know whether an
        // exchange follows, and may ask for the transit in the same request (libiscsi does):
        // the target then stays in the security stage with T=0 (RFC 7143 6.3). Asking for the
        // transit later, before the exchange is over, is refused.
        let mut hold = false;
        if req.transit && stage == Stage::Security && !self.authenticated {
            // Leaving security without an agreed method means AuthMethod=None (12.1 default).
            if self.auth_method.is_none() && self.accepts_none() {
                self.authenticated = true;
            } else if method_agreed_now && self.auth_method.as_deref().is_some_and(|m| m != "None")
            {
                hold = true;
            } else {
                return Err(status::AUTH_FAILED.into());
            }
        }

        // Our own offers once operational negotiation is under way (or is being skipped).
        let neg = match self.neg.as_mut() {
            Some(n) => n,
            None => return Err(status::TARGET_ERROR.into()),
        };
        let mut offered_now = false;
        if stage == Stage::Operational || (req.transit && req.nsg == Stage::FullFeature) {
            let offers = neg.offers(Some(Stage::Operational));
            offered_now = offers.iter().any(|(k, _)| neg.awaits_answer(k));
            reply.keys.extend(offers);
        }
        // Offers made in this response hold the transit (the initiator could not answer one made
        // in the final response); after that only answers the initiator must give hold it.
        reply.transit = req.transit && !hold && !offered_now && !neg.has_pending();
        reply.nsg = if reply.transit { req.nsg } else { stage };
        Ok(())
    }

    fn finish(
        &mut self,
        req: &LoginRequest,
        env: &mut dyn LoginEnv,
        reply: Reply,
    ) -> Result<LoginStep, Refusal> {
        let data = text::encode(&reply.keys);
        if data.len() <= LOGIN_MAX_SEGMENT {
            return self.emit(req, env, reply.transit, reply.nsg, data, false);
        }
        self.outgoing = text::split(&data, LOGIN_MAX_SEGMENT).into();
        self.deferred = Some((reply.transit, reply.nsg));
        self.next_piece(req, env)
    }

    fn next_piece(
        &mut self,
        req: &LoginRequest,
        env: &mut dyn LoginEnv,
    ) -> Result<LoginStep, Refusal> {
        let piece = self.outgoing.pop_front().unwrap_or_default();
        if self.outgoing.is_empty() {
            let (transit, nsg) = self.deferred.take().unwrap_or((false, self.stage));
            self.emit(req, env, transit, nsg, piece, false)
        } else {
            self.emit(req, env, false, self.stage, piece, true)
        }
    }

    fn emit(
        &mut self,
        req: &LoginRequest,
        env: &mut dyn LoginEnv,
        transit: bool,
        nsg: Stage,
        data: Bytes,
        continue_: bool,
    ) -> Result<LoginStep, Refusal> {
        let mut tsih = self.tsih;
        let ffp = transit && nsg == Stage::FullFeature;
        if ffp && tsih == 0 {
            // The TSIH goes in the final response of a leading login (11.13.3).
            tsih = env.session(
                self.isid,
                0,
                self.cid,
                &self.initiator_name,
                self.target_name.as_deref(),
            )?;
            if tsih == 0 {
                return Err(status::TARGET_ERROR.into());
            }
            self.tsih = tsih;
        }
        let mut resp = self.response(req, env, transit, nsg, Vec::new());
        resp.continue_ = continue_;
        resp.data = data;
        if ffp {
            resp.tsih = tsih;
        }
        if transit {
            self.stage = nsg;
        }
        if !ffp {
            return Ok(LoginStep::Continue(resp));
        }
        self.phase = Phase::Done;
        let (session, connection) = match &self.neg {
            Some(n) => (n.session_params(), n.connection_params()),
            None => (SessionParams::default(), ConnectionParams::default()),
        };
        Ok(LoginStep::FullFeature {
            response: resp,
            session,
            connection,
            session_type: self.session_type,
            initiator_name: self.initiator_name.clone(),
            target_name: self.target_name.clone(),
            isid: self.isid,
            tsih,
            cid: self.cid,
        })
    }
}

/// Initiator-side login settings.
pub struct InitiatorLoginConfig {
    pub initiator_name: String,
    pub initiator_alias: Option<String>,
    /// Required for normal sessions, absent for discovery.
    pub target_name: Option<String>,
    pub session_type: SessionType,
    pub isid: Isid,
    /// 0 for the leading connection of a new session, else the session's TSIH.
    pub tsih: u16,
    pub cid: u16,
    pub itt: u32,
    /// CmdSN of the login requests (the session's next CmdSN; login requests are immediate).
    pub cmd_sn: u32,
    /// ExpStatSN for the first request (0 on a new connection).
    pub exp_stat_sn: u32,
    pub params: LocalParams,
    pub authenticator: Box<dyn Authenticator>,
    /// Go through the operational stage (false: security straight to full feature phase, all
    /// operational keys at their defaults unless the target offers).
    pub operational_stage: bool,
    pub extensions: Vec<(KeyDef, String)>,
    pub text_limits: TextLimits,
}

impl InitiatorLoginConfig {
    /// A normal session to `target_name` with RFC defaults and AuthMethod=None.
    pub fn normal(initiator_name: &str, target_name: &str, isid: Isid) -> Self {
        InitiatorLoginConfig {
            initiator_name: initiator_name.to_owned(),
            initiator_alias: None,
            target_name: Some(target_name.to_owned()),
            session_type: SessionType::Normal,
            isid,
            tsih: 0,
            cid: 0,
            itt: 0,
            cmd_sn: 0,
            exp_stat_sn: 0,
            params: LocalParams::default(),
            authenticator: Box::new(NoAuth),
            operational_stage: true,
            extensions: Vec::new(),
            text_limits: TextLimits::default(),
        }
    }

    /// A discovery session (SendTargets) with RFC defaults and AuthMethod=None.
    pub fn discovery(initiator_name: &str, isid: Isid) -> Self {
        InitiatorLoginConfig {
            target_name: None,
            session_type: SessionType::Discovery,
            ..Self::normal(initiator_name, "", isid)
        }
    }
}

/// Why an initiator's login failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoginError {
    #[error("target refused the login with status {class}/{detail:#04x} ({})", status::describe((*class, *detail)))]
    Status {
        class: u8,
        detail: u8,
        /// Keys of the refusal (TargetAddress for a redirection).
        keys: Vec<(String, String)>,
    },
    #[error("login protocol error: {0}")]
    Protocol(&'static str),
    /// The final Login Response came while keys were still open: ours the target did not
    /// answer, or its own it offered in that last response.
    #[error("login protocol error: target ended the login with keys outstanding (unanswered: {}; offered by the target at the end: {})", list_or_none(.unanswered), list_or_none(.offered))]
    KeysOutstanding {
        unanswered: Vec<String>,
        offered: Vec<String>,
    },
    #[error(transparent)]
    Negotiation(#[from] NegotiationError),
    #[error("malformed login text from the target: {0}")]
    Text(#[from] TextError),
    #[error("authentication failed with status {0:?}")]
    Auth((u8, u8)),
}

fn list_or_none(keys: &[String]) -> String {
    if keys.is_empty() {
        "none".to_owned()
    } else {
        keys.join(", ")
    }
}

/// The outcome of a successful initiator login.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoginOutcome {
    pub session: SessionParams,
    pub connection: ConnectionParams,
    pub tsih: u16,
    pub target_portal_group_tag: Option<u16>,
    pub target_alias: Option<String>,
    /// From the final response: the next expected StatSN is `stat_sn + 1`.
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
}

/// What the initiator does after one Login Response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitiatorStep {
    /// Send this request and wait for the response.
    Send(LoginRequest),
    /// The connection is in full feature phase.
    FullFeature(Box<LoginOutcome>),
    /// The login failed; close the connection.
    Failed(LoginError),
}

/// Initiator side of one connection's login, sans-IO.
pub struct InitiatorLogin {
    cfg: InitiatorLoginConfig,
    neg: Negotiator,
    stage: Stage,
    phase: Phase,
    rounds: u32,
    exp_stat_sn: u32,
    text: TextAccumulator,
    auth_offer: String,
    auth_method: Option<String>,
    authenticated: bool,
    tpgt: Option<u16>,
    target_alias: Option<String>,
    /// Request text pieces still to send (C bit) and the transit they belong to.
    outgoing: VecDeque<Bytes>,
    deferred: Option<(bool, Stage)>,
    /// The transit our last request asked for.
    asked: Option<Stage>,
}

impl std::fmt::Debug for InitiatorLogin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InitiatorLogin")
            .field("stage", &self.stage)
            .field("phase", &self.phase)
            .field("isid", &self.cfg.isid)
            .field("tsih", &self.cfg.tsih)
            .finish_non_exhaustive()
    }
}

impl InitiatorLogin {
    pub fn new(cfg: InitiatorLoginConfig) -> Self {
        let mut neg = Negotiator::new(Role::Initiator, cfg.params.clone());
        neg.set_session_type(cfg.session_type);
        neg.set_leading(cfg.tsih == 0);
        for (def, local) in &cfg.extensions {
            let _ = neg.register(*def, local.clone());
        }
        let auth_offer = cfg.authenticator.methods().join(",");
        let text = TextAccumulator::new(cfg.text_limits);
        InitiatorLogin {
            exp_stat_sn: cfg.exp_stat_sn,
            cfg,
            neg,
            stage: Stage::Security,
            phase: Phase::Running,
            rounds: 0,
            text,
            auth_offer,
            auth_method: None,
            authenticated: false,
            tpgt: None,
            target_alias: None,
            outgoing: VecDeque::new(),
            deferred: None,
            asked: None,
        }
    }

    /// The stage after leaving security.
    fn after_security(&self) -> Stage {
        if self.cfg.operational_stage {
            Stage::Operational
        } else {
            Stage::FullFeature
        }
    }

    /// The first Login Request (security stage, RFC 7143 6.3).
    pub fn start(&mut self) -> LoginRequest {
        let mut keys = vec![("InitiatorName".to_owned(), self.cfg.initiator_name.clone())];
        if let Some(alias) = &self.cfg.initiator_alias {
            keys.push(("InitiatorAlias".into(), alias.clone()));
        }
        if let Some(t) = &self.cfg.target_name {
            keys.push(("TargetName".into(), t.clone()));
        }
        keys.push((
            "SessionType".into(),
            self.cfg.session_type.as_str().to_owned(),
        ));
        keys.push(("AuthMethod".into(), self.auth_offer.clone()));
        for (k, v) in &keys {
            self.neg.note_sent(k, v, k == "AuthMethod");
        }
        // With only None on offer, ask to leave the security stage right away.
        let transit = self.auth_offer == "None";
        self.request(keys, transit, self.after_security())
    }

    fn request(&mut self, keys: Vec<(String, String)>, transit: bool, nsg: Stage) -> LoginRequest {
        let data = text::encode(&keys);
        if data.len() > LOGIN_MAX_SEGMENT {
            self.outgoing = text::split(&data, LOGIN_MAX_SEGMENT).into();
            self.deferred = Some((transit, nsg));
            return self.next_piece();
        }
        self.raw_request(data, transit, nsg, false)
    }

    fn next_piece(&mut self) -> LoginRequest {
        let piece = self.outgoing.pop_front().unwrap_or_default();
        if self.outgoing.is_empty() {
            let (transit, nsg) = self.deferred.take().unwrap_or((false, self.stage));
            self.raw_request(piece, transit, nsg, false)
        } else {
            self.raw_request(piece, false, self.stage, true)
        }
    }

    fn raw_request(
        &mut self,
        data: Bytes,
        transit: bool,
        nsg: Stage,
        continue_: bool,
    ) -> LoginRequest {
        self.asked = transit.then_some(nsg);
        LoginRequest {
            transit,
            continue_,
            csg: self.stage,
            nsg: if transit { nsg } else { self.stage },
            version_max: VERSION,
            version_min: VERSION,
            isid: self.cfg.isid,
            tsih: self.cfg.tsih,
            itt: self.cfg.itt,
            cid: self.cfg.cid,
            cmd_sn: self.cfg.cmd_sn,
            exp_stat_sn: self.exp_stat_sn,
            data,
        }
    }

    /// Feed one Login Response.
    pub fn handle(&mut self, resp: &LoginResponse) -> InitiatorStep {
        if self.phase != Phase::Running {
            return InitiatorStep::Failed(LoginError::Protocol("login is already over"));
        }
        match self.step(resp) {
            Ok(s) => s,
            Err(e) => {
                self.phase = Phase::Failed;
                InitiatorStep::Failed(e)
            }
        }
    }

    fn step(&mut self, resp: &LoginResponse) -> Result<InitiatorStep, LoginError> {
        self.rounds += 1;
        if self.rounds > MAX_ROUNDS {
            return Err(LoginError::Protocol("login does not converge"));
        }
        if resp.status_class != 0 {
            let keys = text::parse(&resp.data, &self.cfg.text_limits).unwrap_or_default();
            return Err(LoginError::Status {
                class: resp.status_class,
                detail: resp.status_detail,
                keys,
            });
        }
        if resp.version_active != VERSION {
            return Err(LoginError::Protocol("target chose an unsupported version"));
        }
        if resp.itt != self.cfg.itt || resp.isid != self.cfg.isid {
            return Err(LoginError::Protocol(
                "response does not match the login (ITT or ISID)",
            ));
        }
        if resp.csg != self.stage {
            return Err(LoginError::Protocol("response is for another login stage"));
        }
        self.exp_stat_sn = resp.stat_sn.wrapping_add(1);

        if !self.outgoing.is_empty() {
            // The target acknowledges a piece of our long request.
            if resp.transit || !resp.data.is_empty() {
                return Err(LoginError::Protocol("target answered a partial request"));
            }
            return Ok(InitiatorStep::Send(self.next_piece()));
        }
        if resp.transit && resp.continue_ {
            return Err(LoginError::Protocol("T and C bits both set"));
        }
        let Some(pairs) = self.text.push(&resp.data, resp.continue_)? else {
            // Ask for the rest with an empty request.
            return Ok(InitiatorStep::Send(self.raw_request(
                Bytes::new(),
                false,
                self.stage,
                false,
            )));
        };

        let processed = self.neg.handle(&pairs, Some(self.stage))?;
        for (k, v) in &processed.declared {
            match k.as_str() {
                "TargetPortalGroupTag" => {
                    self.tpgt = crate::keys::parse_number(v).and_then(|n| u16::try_from(n).ok())
                }
                "TargetAlias" => self.target_alias = Some(v.clone()),
                _ => {}
            }
        }
        let mut opening = false;
        if get(&pairs, "AuthMethod").is_some() && self.auth_method.is_none() {
            let Some(m) = self.neg.agreed("AuthMethod") else {
                return Err(LoginError::Protocol("target did not accept any AuthMethod"));
            };
            self.authenticated = m == "None";
            // The initiator speaks first in an exchange (CHAP_A, RFC 7143 12.1.3).
            opening = m != "None";
            self.auth_method = Some(m.to_owned());
        }
        let mut keys = processed.answers;
        if !processed.auth.is_empty() || opening {
            let method = self.auth_method.clone().unwrap_or_default();
            match self
                .cfg
                .authenticator
                .step(&method, &processed.auth)
                .map_err(LoginError::Auth)?
            {
                AuthProgress::Continue(k) => keys.extend(k),
                AuthProgress::Done(k) => {
                    keys.extend(k);
                    self.authenticated = true;
                }
            }
        }

        if resp.transit {
            let Some(asked) = self.asked else {
                return Err(LoginError::Protocol("target moved on without being asked"));
            };
            if resp.nsg > asked || resp.nsg <= self.stage {
                return Err(LoginError::Protocol("target chose an invalid next stage"));
            }
            if self.stage == Stage::Security && !self.authenticated {
                if self.auth_method.is_none() && self.auth_offer.split(',').any(|m| m == "None") {
                    self.authenticated = true;
                } else {
                    return Err(LoginError::Protocol(
                        "target left security before authentication",
                    ));
                }
            }
            self.stage = resp.nsg;
            if self.stage == Stage::FullFeature {
                if !keys.is_empty() || self.neg.has_pending() {
                    return Err(LoginError::KeysOutstanding {
                        unanswered: self.neg.pending_keys().map(str::to_owned).collect(),
                        offered: keys.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
                    });
                }
                if self.cfg.tsih == 0 && resp.tsih == 0 {
                    return Err(LoginError::Protocol("final login response without a TSIH"));
                }
                if self.cfg.tsih != 0 && resp.tsih != self.cfg.tsih {
                    return Err(LoginError::Protocol(
                        "final login response with another TSIH",
                    ));
                }
                self.phase = Phase::Done;
                return Ok(InitiatorStep::FullFeature(Box::new(LoginOutcome {
                    session: self.neg.session_params(),
                    connection: self.neg.connection_params(),
                    tsih: resp.tsih,
                    target_portal_group_tag: self.tpgt,
                    target_alias: self.target_alias.clone(),
                    stat_sn: resp.stat_sn,
                    exp_cmd_sn: resp.exp_cmd_sn,
                    max_cmd_sn: resp.max_cmd_sn,
                })));
            }
        }
        if self.stage == Stage::Operational {
            keys.extend(self.neg.offers(Some(Stage::Operational)));
        }
        let (transit, nsg) = match self.stage {
            Stage::Security => (
                self.authenticated || self.cfg.authenticator.awaiting_final(),
                self.after_security(),
            ),
            _ => (true, Stage::FullFeature),
        };
        Ok(InitiatorStep::Send(self.request(keys, transit, nsg)))
    }
}
