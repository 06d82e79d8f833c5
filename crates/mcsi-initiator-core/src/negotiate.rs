//! Login of one connection: configures mcsi-proto's sans-IO [`InitiatorLogin`] (keys table,
//! negotiation, CHAP) from the initiator's options and flattens its outcome into the
//! [`SessionParams`] the session works with.

use crate::error::Error;
use mcsi_proto::chap::{ChapAlgorithm, ChapCredentials, ChapInitiator};
use mcsi_proto::keys::{Digest, LocalParams};
use mcsi_proto::login::{InitiatorLogin, InitiatorLoginConfig, InitiatorStep, LoginError};
use mcsi_proto::pdu::{Isid, LoginRequest, LoginResponse};
use mcsi_proto::vendor::{self, ConnRole};

/// Vendor key of the thesis's asymmetric mode (4.3.2-4.3.3), see [`mcsi_proto::vendor`]: offered
/// only when asked for, so a standard peer never sees it.
pub const ASYMMETRIC_KEY: &str = mcsi_proto::vendor::ASYMMETRIC.name;

/// The negotiated values a session works with: mcsi-proto's session-wide parameters as they
/// are (reached through `Deref`: `p.first_burst_length`), and the per-connection ones flattened
/// (every connection is offered the same values).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionParams {
    pub session: mcsi_proto::keys::SessionParams,
    pub header_digest: bool,
    pub data_digest: bool,
    /// Largest data segment we may send (the target's declared MaxRecvDataSegmentLength).
    pub target_max_recv_dsl: u32,
    /// Largest data segment we accept (our declaration).
    pub initiator_max_recv_dsl: u32,
    pub target_alias: Option<String>,
    pub target_portal_group_tag: Option<u16>,
    /// The asymmetric vendor mode was agreed.
    pub asymmetric: bool,
    /// The target reports its sending side's TCP state (`X-org.mcsi.TcpReport`).
    pub tcp_report: bool,
    /// TASK REASSIGNs may go right behind their Logout (`X-org.mcsi.ReassignBehindLogout`).
    pub reassign_behind_logout: bool,
}

impl std::ops::Deref for SessionParams {
    type Target = mcsi_proto::keys::SessionParams;
    fn deref(&self) -> &Self::Target {
        &self.session
    }
}

impl std::ops::DerefMut for SessionParams {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.session
    }
}

impl Default for SessionParams {
    /// RFC 7143 section 13 defaults.
    fn default() -> Self {
        let c = mcsi_proto::keys::ConnectionParams::default();
        SessionParams {
            session: mcsi_proto::keys::SessionParams::default(),
            header_digest: false,
            data_digest: false,
            target_max_recv_dsl: c.max_send_data_segment_length,
            initiator_max_recv_dsl: c.max_recv_data_segment_length,
            target_alias: None,
            target_portal_group_tag: None,
            asymmetric: false,
            tcp_report: false,
            reassign_behind_logout: false,
        }
    }
}

/// What the initiator offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offers {
    pub max_connections: u16,
    pub max_recv_data_segment_length: u32,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub immediate_data: bool,
    pub initial_r2t: bool,
    /// Offer CRC32C digests (header and data), None as fallback.
    pub digests: bool,
    pub asymmetric: bool,
    /// Ask an mcsi target for reports of its sending side's TCP state.
    pub tcp_report: bool,
    /// The highest ErrorRecoveryLevel offered (RFC 7143 7.1; the target's answer decides
    /// below it): at 1 a PDU lost to a data digest error is asked for again with a SNACK
    /// instead of ending the connection; at 2 (with DefaultTime2Retain 20 s) the tasks of a
    /// connection that fails move to the others (TASK REASSIGN).
    pub max_erl: u8,
}

impl Default for Offers {
    fn default() -> Self {
        Offers {
            max_connections: 1,
            max_recv_data_segment_length: 262_144,
            max_burst_length: 16_776_192,
            first_burst_length: 262_144,
            immediate_data: true,
            initial_r2t: false,
            digests: false,
            asymmetric: false,
            tcp_report: false,
            max_erl: 2,
        }
    }
}

/// The kind of session being logged into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionKind {
    Normal,
    Discovery,
}

/// Configuration of one connection's login.
#[derive(Debug, Clone)]
pub struct LoginConfig {
    pub initiator_name: String,
    pub target_name: Option<String>,
    pub kind: SessionKind,
    pub isid: Isid,
    /// 0 for the leading connection of a new session.
    pub tsih: u16,
    pub cid: u16,
    pub itt: u32,
    pub cmd_sn: u32,
    pub offers: Offers,
    /// CHAP user and secret (AuthMethod=CHAP is offered when set).
    pub chap: Option<(String, String)>,
    /// CHAP algorithms offered, in order of preference (empty: MD5 only).
    pub chap_algorithms: Vec<ChapAlgorithm>,
    /// The role this connection asks for when `offers.asymmetric` is set (the leading login
    /// offers the mode itself; every login offers its role).
    pub role: ConnRole,
    /// Fills a buffer with random bytes, for CHAP's mutual challenge and identifier (only used
    /// with mutual credentials): the operating system's CSPRNG under the tokio driver, a seeded
    /// generator under a simulator. The core draws no randomness of its own.
    pub random: fn(&mut [u8]),
}

/// The outcome of a successful login.
#[derive(Debug, Clone)]
pub struct LoginDone {
    pub params: SessionParams,
    /// What this connection negotiated for itself: HeaderDigest, DataDigest and
    /// MaxRecvDataSegmentLength are connection-only keys (RFC 7143 13), so each connection of a
    /// session frames its PDUs by its own login (`tx_framing`, `rx_framing`), not by the
    /// leading one's.
    pub connection: mcsi_proto::keys::ConnectionParams,
    /// The role the target agreed for this connection (meaningful once the leading login agreed
    /// on the asymmetric mode: [`SessionParams::asymmetric`]).
    pub role: ConnRole,
    pub tsih: u16,
    /// StatSN of the final response: the connection's next ExpStatSN is this + 1.
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
}

/// What to do after a login response.
#[derive(Debug, Clone)]
pub enum LoginStep {
    Send(LoginRequest),
    Done(Box<LoginDone>),
    /// Class 1: log in again at this `host:port[,tpgt]`.
    Redirect(String),
}

fn proto_config(cfg: &LoginConfig) -> Result<InitiatorLoginConfig, Error> {
    let o = &cfg.offers;
    let mut c = match cfg.kind {
        SessionKind::Normal => InitiatorLoginConfig::normal(
            &cfg.initiator_name,
            cfg.target_name.as_deref().unwrap_or_default(),
            cfg.isid,
        ),
        SessionKind::Discovery => InitiatorLoginConfig::discovery(&cfg.initiator_name, cfg.isid),
    };
    c.tsih = cfg.tsih;
    c.cid = cfg.cid;
    c.itt = cfg.itt;
    c.cmd_sn = cfg.cmd_sn;
    let digests = if o.digests {
        vec![Digest::Crc32c, Digest::None]
    } else {
        vec![Digest::None]
    };
    c.params = LocalParams {
        header_digest: digests.clone(),
        data_digest: digests,
        max_recv_data_segment_length: o.max_recv_data_segment_length,
        max_connections: o.max_connections.max(1),
        initial_r2t: o.initial_r2t,
        immediate_data: o.immediate_data,
        max_burst_length: o.max_burst_length,
        first_burst_length: o.first_burst_length.min(o.max_burst_length),
        // Level 2 asks the target to keep a failed connection's tasks for reassignment; below,
        // nothing is retained after a connection ends (7.1.5).
        default_time2retain: if o.max_erl >= 2 { 20 } else { 0 },
        error_recovery_level: o.max_erl.min(2),
        max_outstanding_r2t: 1,
        ..LocalParams::default()
    };
    if o.asymmetric && cfg.kind == SessionKind::Normal {
        // The mode key is leading-only: the negotiator leaves it out of non-leading logins.
        c.extensions.push((vendor::ASYMMETRIC, "Yes".into()));
        c.extensions
            .push((vendor::CONNECTION_ROLE, cfg.role.as_str().into()));
    }
    if o.tcp_report && cfg.kind == SessionKind::Normal {
        c.extensions.push((vendor::TCP_REPORT, "Yes".into()));
    }
    if o.max_erl >= 2 && cfg.kind == SessionKind::Normal {
        c.extensions
            .push((vendor::REASSIGN_BEHIND_LOGOUT, "Yes".into()));
    }
    if let Some((user, secret)) = &cfg.chap {
        let chap = ChapInitiator::new(
            ChapCredentials::new(user.clone(), secret.as_bytes().to_vec()),
            cfg.random,
        )
        .map_err(|e| Error::InvalidArgument(format!("CHAP credentials: {e}")))?
        .with_algorithms(if cfg.chap_algorithms.is_empty() {
            &[ChapAlgorithm::Md5]
        } else {
            &cfg.chap_algorithms
        });
        c.authenticator = Box::new(chap);
    }
    Ok(c)
}

/// Initiator login of one connection.
pub struct Login {
    inner: InitiatorLogin,
    target: String,
    /// The whole exchange must end by then ([`Login::start_at`]).
    deadline: Option<(std::time::Instant, std::time::Duration)>,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login").field("inner", &self.inner).finish()
    }
}

impl Login {
    pub fn new(cfg: &LoginConfig) -> Result<Login, Error> {
        Ok(Login {
            inner: InitiatorLogin::new(proto_config(cfg)?),
            target: cfg.target_name.clone().unwrap_or_default(),
            deadline: None,
        })
    }

    pub fn start(&mut self) -> LoginRequest {
        self.inner.start()
    }

    /// Start at `now`, with the whole exchange to end within `limit` (zero: no limit).
    pub fn start_at(
        &mut self,
        now: std::time::Instant,
        limit: std::time::Duration,
    ) -> LoginRequest {
        self.deadline = (!limit.is_zero()).then(|| (now + limit, limit));
        self.start()
    }

    /// When the login phase runs out of time, if it has a limit.
    pub fn poll_timeout(&self) -> Option<std::time::Instant> {
        self.deadline.map(|(at, _)| at)
    }

    /// The time is `now`: an error once the login phase has run out of time.
    pub fn handle_timeout(&mut self, now: std::time::Instant) -> Result<(), Error> {
        match self.deadline {
            Some((at, limit)) if now >= at => {
                Err(Error::Timeout(format!("login took longer than {limit:?}")))
            }
            _ => Ok(()),
        }
    }

    /// Take one Login Response.
    pub fn handle(&mut self, r: &LoginResponse) -> Result<LoginStep, Error> {
        match self.inner.handle(r) {
            InitiatorStep::Send(req) => Ok(LoginStep::Send(req)),
            InitiatorStep::FullFeature(o) => {
                let s = &o.session;
                let c = &o.connection;
                let params = SessionParams {
                    session: s.clone(),
                    header_digest: c.header_digest == Digest::Crc32c,
                    data_digest: c.data_digest == Digest::Crc32c,
                    target_max_recv_dsl: c.max_send_data_segment_length,
                    initiator_max_recv_dsl: c.max_recv_data_segment_length,
                    target_alias: o.target_alias.clone(),
                    target_portal_group_tag: o.target_portal_group_tag,
                    asymmetric: vendor::asymmetric_agreed(&s.extensions),
                    tcp_report: vendor::tcp_report_agreed(&s.extensions),
                    reassign_behind_logout: vendor::reassign_behind_logout_agreed(&s.extensions),
                };
                if params.error_recovery_level > 2 {
                    return Err(Error::Negotiation(format!(
                        "ErrorRecoveryLevel {} agreed; RFC 7143 defines 0 to 2",
                        params.error_recovery_level
                    )));
                }
                Ok(LoginStep::Done(Box::new(LoginDone {
                    role: ConnRole::agreed(true, &s.extensions),
                    params,
                    connection: *c,
                    tsih: o.tsih,
                    stat_sn: o.stat_sn,
                    exp_cmd_sn: o.exp_cmd_sn,
                    max_cmd_sn: o.max_cmd_sn,
                })))
            }
            InitiatorStep::Failed(LoginError::Status { class: 1, keys, .. }) => keys
                .into_iter()
                .find(|(k, _)| k == "TargetAddress")
                .map(|(_, v)| LoginStep::Redirect(v))
                .ok_or_else(|| Error::Protocol("login redirection without a TargetAddress".into())),
            InitiatorStep::Failed(LoginError::Status { class, detail, .. }) => Err(Error::Login {
                target: self.target.clone(),
                class,
                detail,
            }),
            InitiatorStep::Failed(e @ (LoginError::Negotiation(_) | LoginError::Auth(_))) => {
                Err(Error::Negotiation(e.to_string()))
            }
            InitiatorStep::Failed(e) => Err(Error::Protocol(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use mcsi_proto::pdu::Stage;

    #[test]
    fn the_login_phase_runs_out_of_time_on_passed_in_time() {
        let t0 = std::time::Instant::now();
        let limit = std::time::Duration::from_secs(15);
        let mut l = Login::new(&cfg(false)).unwrap();
        assert_eq!(l.poll_timeout(), None);
        let _ = l.start_at(t0, limit);
        assert_eq!(l.poll_timeout(), Some(t0 + limit));
        assert!(l.handle_timeout(t0 + limit / 2).is_ok());
        let e = l.handle_timeout(t0 + limit).unwrap_err();
        assert_eq!(e.to_string(), "timed out: login took longer than 15s");
        let mut unlimited = Login::new(&cfg(false)).unwrap();
        let _ = unlimited.start_at(t0, std::time::Duration::ZERO);
        assert_eq!(unlimited.poll_timeout(), None);
        assert!(unlimited.handle_timeout(t0 + limit * 100).is_ok());
    }

    fn cfg(asymmetric: bool) -> LoginConfig {
        LoginConfig {
            initiator_name: "iqn.2026-01.org.mcsi:test".into(),
            target_name: Some("iqn.2001-04.com.example:t1".into()),
            kind: SessionKind::Normal,
            isid: Isid([0x80, 1, 2, 3, 4, 5]),
            tsih: 0,
            cid: 0,
            itt: 0,
            cmd_sn: 1,
            offers: Offers {
                max_connections: 4,
                asymmetric,
                ..Offers::default()
            },
            chap: None,
            chap_algorithms: Vec::new(),
            role: ConnRole::Requests,
            random: |b| b.fill(7),
        }
    }

    fn resp(csg: Stage, nsg: Stage, tsih: u16, text: &str, status: (u8, u8)) -> LoginResponse {
        LoginResponse {
            transit: true,
            continue_: false,
            csg,
            nsg,
            version_max: 0,
            version_active: 0,
            isid: Isid([0x80, 1, 2, 3, 4, 5]),
            tsih,
            itt: 0,
            stat_sn: 100,
            exp_cmd_sn: 1,
            max_cmd_sn: 32,
            status_class: status.0,
            status_detail: status.1,
            data: Bytes::from(text.replace('|', "\0")),
        }
    }

    fn keys(req: &LoginRequest) -> Vec<(String, String)> {
        mcsi_proto::text::parse(&req.data, &Default::default()).unwrap()
    }

    /// Walk a login against a target that answers like tgt (MaxConnections=1) and check the
    /// flattened parameters.
    #[test]
    fn single_connection_target_is_flattened() {
        let mut l = Login::new(&cfg(false)).unwrap();
        let first = l.start();
        assert!(keys(&first).contains(&("AuthMethod".into(), "None".into())));
        let LoginStep::Send(op) = l
            .handle(&resp(
                Stage::Security,
                Stage::Operational,
                0,
                "AuthMethod=None|",
                (0, 0),
            ))
            .unwrap()
        else {
            panic!()
        };
        let offered = keys(&op);
        assert!(offered.contains(&("MaxConnections".into(), "4".into())));
        assert!(
            !offered.iter().any(|(k, _)| k == ASYMMETRIC_KEY),
            "vendor key sent unasked"
        );
        // Answer every offer the way tgt does.
        let answer: String = offered
            .iter()
            .map(|(k, v)| {
                let a = match k.as_str() {
                    "MaxConnections" => "1".to_string(),
                    "InitialR2T" => "Yes".to_string(),
                    "MaxBurstLength" => "262144".to_string(),
                    "FirstBurstLength" => "65536".to_string(),
                    "MaxRecvDataSegmentLength" => "8192".to_string(),
                    "HeaderDigest" | "DataDigest" => "None".to_string(),
                    _ => v.split(',').next().unwrap().to_string(),
                };
                format!("{k}={a}|")
            })
            .collect();
        let step = l
            .handle(&resp(
                Stage::Operational,
                Stage::FullFeature,
                0x1234,
                &answer,
                (0, 0),
            ))
            .unwrap();
        let LoginStep::Done(d) = step else {
            panic!("{step:?}")
        };
        assert_eq!(d.tsih, 0x1234);
        assert_eq!(d.params.max_connections, 1);
        assert!(d.params.initial_r2t);
        assert_eq!(d.params.first_burst_length, 65536);
        assert_eq!(d.params.max_burst_length, 262144);
        assert_eq!(d.params.target_max_recv_dsl, 8192);
        assert_eq!(d.params.initiator_max_recv_dsl, 262144);
        assert!(!d.params.asymmetric);
    }

    /// A login past the security stage (AuthMethod=None agreed) and the keys it offers next.
    fn operational_offers(c: &LoginConfig) -> (Login, Vec<(String, String)>) {
        let mut l = Login::new(c).unwrap();
        l.start();
        let step = l
            .handle(&resp(
                Stage::Security,
                Stage::Operational,
                c.tsih,
                "AuthMethod=None|",
                (0, 0),
            ))
            .unwrap();
        let LoginStep::Send(op) = step else {
            panic!("{step:?}")
        };
        let offered = keys(&op);
        (l, offered)
    }

    /// The target's last Login Response: each offer answered with its first value, or with
    /// what `answer` says for its key; the login's outcome.
    fn agree_to<'a>(
        l: &mut Login,
        offered: &[(String, String)],
        answer: impl Fn(&str) -> Option<&'a str>,
    ) -> LoginDone {
        let text: String = offered
            .iter()
            .map(|(k, v)| {
                let a = answer(k).unwrap_or_else(|| v.split(',').next().unwrap());
                format!("{k}={a}|")
            })
            .collect();
        match l
            .handle(&resp(
                Stage::Operational,
                Stage::FullFeature,
                7,
                &text,
                (0, 0),
            ))
            .unwrap()
        {
            LoginStep::Done(d) => *d,
            step => panic!("{step:?}"),
        }
    }

    #[test]
    fn asymmetric_key_only_when_asked_and_agreed() {
        let (mut l, offered) = operational_offers(&cfg(true));
        assert!(offered.contains(&(ASYMMETRIC_KEY.into(), "Yes".into())));
        assert!(offered.contains(&(vendor::CONNECTION_ROLE.name.into(), "requests".into())));
        let d = agree_to(&mut l, &offered, |_| None);
        assert!(d.params.asymmetric);
        assert_eq!(d.role, ConnRole::Requests);
        assert_eq!(d.params.max_connections, 4);
    }

    /// Agreed only when both sides say Yes; a standard target's NotUnderstood leaves it off,
    /// and an initiator that does not offer level 2 does not ask.
    #[test]
    fn reassign_behind_logout_only_with_level_2_and_a_target_that_agrees() {
        let key = vendor::REASSIGN_BEHIND_LOGOUT.name;
        for (target_says, agreed) in [("Yes", true), ("NotUnderstood", false)] {
            let (mut l, offered) = operational_offers(&cfg(false));
            assert!(offered.contains(&(key.into(), "Yes".into())), "{offered:?}");
            let d = agree_to(&mut l, &offered, |k| (k == key).then_some(target_says));
            assert_eq!(d.params.reassign_behind_logout, agreed, "{target_says}");
        }
        let mut c = cfg(false);
        c.offers.max_erl = 1;
        let (_, offered) = operational_offers(&c);
        assert!(!offered.iter().any(|(k, _)| k == key), "{offered:?}");
    }

    #[test]
    fn a_joining_login_offers_its_role_but_not_the_mode() {
        let c = LoginConfig {
            tsih: 7,
            cid: 1,
            role: ConnRole::Responses,
            ..cfg(true)
        };
        let (_, offered) = operational_offers(&c);
        assert!(
            !offered.iter().any(|(k, _)| k == ASYMMETRIC_KEY),
            "{offered:?}"
        );
        assert!(offered.contains(&(vendor::CONNECTION_ROLE.name.into(), "responses".into())));
    }

    #[test]
    fn refusals_and_redirects_are_typed() {
        let mut l = Login::new(&cfg(false)).unwrap();
        l.start();
        let e = l
            .handle(&resp(Stage::Security, Stage::Security, 0, "", (2, 3)))
            .unwrap_err();
        assert!(matches!(
            e,
            Error::Login {
                class: 2,
                detail: 3,
                ..
            }
        ));
        assert!(e.to_string().contains("target not found"), "{e}");
        let mut l = Login::new(&cfg(false)).unwrap();
        l.start();
        let step = l
            .handle(&resp(
                Stage::Security,
                Stage::Security,
                0,
                "TargetAddress=10.1.1.1:3261,1|",
                (1, 1),
            ))
            .unwrap();
        assert!(matches!(step, LoginStep::Redirect(a) if a == "10.1.1.1:3261,1"));
    }
}
