#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Whole login conversations: the initiator machine's requests go through the codec into the
//! target machine, and the target's responses back.

use bytes::BytesMut;
use mcsi_proto::keys::{Digest, LocalParams, SessionParams, SessionType};
use mcsi_proto::login::*;
use mcsi_proto::pdu::*;
use mcsi_proto::text;

const INI: &str = "iqn.2024-01.org.mcsi:host1";
const TGT: &str = "iqn.2024-01.org.mcsi:disk1";
const ISID: Isid = Isid([0x80, 0, 0, 0x12, 0x34, 0x01]);

struct Env {
    targets: Vec<&'static str>,
    params: LocalParams,
    methods: Vec<&'static str>,
    sessions: Vec<(Isid, u16)>,
    next_tsih: u16,
    stat_sn: u32,
    /// (TSIH, CID) of every `session` call.
    session_calls: Vec<(u16, u16)>,
}

impl Env {
    fn new() -> Self {
        Env {
            targets: vec![TGT],
            params: LocalParams::default(),
            methods: vec!["None"],
            sessions: Vec::new(),
            next_tsih: 0x10,
            stat_sn: 0x100,
            session_calls: Vec::new(),
        }
    }
}

/// Accepts the listed methods; finishes a CHAP-like exchange when it sees CHAP_R=ok.
struct TestAuth(Vec<&'static str>);

impl Authenticator for TestAuth {
    fn methods(&self) -> Vec<String> {
        self.0.iter().map(|s| s.to_string()).collect()
    }
    fn step(&mut self, _method: &str, keys: &[(String, String)]) -> Result<AuthProgress, (u8, u8)> {
        match keys.iter().find(|(k, _)| k == "CHAP_R") {
            Some((_, v)) if v == "ok" => Ok(AuthProgress::Done(vec![])),
            Some(_) => Err(status::AUTH_FAILED),
            None => Ok(AuthProgress::Continue(vec![(
                "CHAP_C".into(),
                "0x0102".into(),
            )])),
        }
    }
}

impl LoginEnv for Env {
    fn target(
        &mut self,
        session_type: SessionType,
        target_name: Option<&str>,
        _initiator_name: &str,
    ) -> Result<TargetAccess, Refusal> {
        if session_type == SessionType::Normal && !self.targets.contains(&target_name.unwrap()) {
            return Err(status::NOT_FOUND.into());
        }
        Ok(TargetAccess {
            params: self.params.clone(),
            authenticator: Box::new(TestAuth(self.methods.clone())),
            target_alias: Some("disk one".into()),
            portal_group_tag: None,
            extensions: Vec::new(),
        })
    }

    fn session(
        &mut self,
        isid: Isid,
        tsih: u16,
        cid: u16,
        _initiator_name: &str,
        _target_name: Option<&str>,
    ) -> Result<u16, Refusal> {
        self.session_calls.push((tsih, cid));
        if tsih == 0 {
            self.next_tsih += 1;
            self.sessions.push((isid, self.next_tsih));
            Ok(self.next_tsih)
        } else if self.sessions.contains(&(isid, tsih)) {
            Ok(tsih)
        } else {
            Err(status::SESSION_DOES_NOT_EXIST.into())
        }
    }

    fn numbers(&mut self, req: &LoginRequest) -> LoginNumbers {
        let n = LoginNumbers {
            stat_sn: self.stat_sn,
            exp_cmd_sn: req.cmd_sn,
            max_cmd_sn: req.cmd_sn.wrapping_add(31),
        };
        self.stat_sn += 1;
        n
    }
}

/// Send a PDU through the codec (login framing) and back.
fn wire(p: Pdu) -> Pdu {
    let f = Framing::default();
    let mut buf = BytesMut::from(&p.encode(&f).to_vec()[..]);
    let back = decode(&mut buf, &f).unwrap().unwrap();
    assert!(buf.is_empty());
    back
}

fn to_target(req: LoginRequest) -> LoginRequest {
    match wire(Pdu::LoginRequest(req)) {
        Pdu::LoginRequest(r) => r,
        other => panic!("{other:?}"),
    }
}

fn to_initiator(resp: LoginResponse) -> LoginResponse {
    match wire(Pdu::LoginResponse(resp)) {
        Pdu::LoginResponse(r) => r,
        other => panic!("{other:?}"),
    }
}

#[derive(Debug)]
struct TargetDone {
    session: SessionParams,
    connection: mcsi_proto::keys::ConnectionParams,
    session_type: SessionType,
    initiator_name: String,
    target_name: Option<String>,
    tsih: u16,
}

struct Run {
    initiator: Result<LoginOutcome, LoginError>,
    target: Option<TargetDone>,
    last: LoginResponse,
    requests: Vec<LoginRequest>,
    responses: Vec<LoginResponse>,
}

fn run(cfg: InitiatorLoginConfig, tcfg: TargetLoginConfig, env: &mut Env) -> Run {
    let mut ini = InitiatorLogin::new(cfg);
    let mut tgt = TargetLogin::new(tcfg);
    let mut req = ini.start();
    let mut requests = Vec::new();
    let mut responses = Vec::new();
    for _ in 0..32 {
        requests.push(req.clone());
        let step = tgt.handle(&to_target(req.clone()), env);
        let (resp, done) = match step {
            LoginStep::Continue(r) => (r, None),
            LoginStep::Fail(r) => {
                assert_ne!(r.status_class, 0);
                (r, None)
            }
            LoginStep::FullFeature {
                response,
                session,
                connection,
                session_type,
                initiator_name,
                target_name,
                isid,
                tsih,
                cid,
            } => {
                assert_eq!(isid, ISID);
                assert_eq!(cid, req.cid);
                (
                    response,
                    Some(TargetDone {
                        session,
                        connection,
                        session_type,
                        initiator_name,
                        target_name,
                        tsih,
                    }),
                )
            }
        };
        responses.push(resp.clone());
        match ini.handle(&to_initiator(resp.clone())) {
            InitiatorStep::Send(r) => {
                assert!(done.is_none(), "target finished but initiator goes on");
                req = r;
            }
            InitiatorStep::FullFeature(o) => {
                assert!(done.is_some(), "initiator finished alone");
                return Run {
                    initiator: Ok(*o),
                    target: done,
                    last: resp,
                    requests,
                    responses,
                };
            }
            InitiatorStep::Failed(e) => {
                return Run {
                    initiator: Err(e),
                    target: done,
                    last: resp,
                    requests,
                    responses,
                }
            }
        }
    }
    panic!("login did not finish");
}

fn keys_of(data: &[u8]) -> Vec<(String, String)> {
    text::parse(data, &text::TextLimits::default()).unwrap()
}

fn has(data: &[u8], k: &str, v: &str) -> bool {
    keys_of(data).iter().any(|(a, b)| a == k && b == v)
}

#[test]
fn normal_login_with_operational_stage() {
    let mut env = Env::new();
    env.params = LocalParams {
        header_digest: vec![Digest::Crc32c, Digest::None],
        max_recv_data_segment_length: 65536,
        max_burst_length: 1 << 20,
        first_burst_length: 1 << 18,
        initial_r2t: false,
        max_connections: 4,
        ..LocalParams::default()
    };
    let mut cfg = InitiatorLoginConfig::normal(INI, TGT, ISID);
    cfg.params = LocalParams {
        header_digest: vec![Digest::Crc32c, Digest::None],
        data_digest: vec![Digest::Crc32c, Digest::None],
        max_recv_data_segment_length: 262_144,
        max_burst_length: 512 * 1024,
        first_burst_length: 128 * 1024,
        initial_r2t: false,
        max_connections: 8,
        ..LocalParams::default()
    };
    cfg.cmd_sn = 7;
    let r = run(cfg, TargetLoginConfig::default(), &mut env);
    let out = r.initiator.unwrap();
    let t = r.target.unwrap();

    // Security -> operational -> full feature: two exchanges.
    assert_eq!(r.requests.len(), 2);
    let first = &r.requests[0];
    assert_eq!(
        (first.csg, first.nsg, first.transit),
        (Stage::Security, Stage::Operational, true)
    );
    assert!(has(&first.data, "InitiatorName", INI));
    assert!(has(&first.data, "TargetName", TGT));
    assert!(has(&first.data, "SessionType", "Normal"));
    assert!(has(&first.data, "AuthMethod", "None"));
    let r0 = &r.responses[0];
    assert_eq!(
        (r0.csg, r0.nsg, r0.transit),
        (Stage::Security, Stage::Operational, true)
    );
    assert!(has(&r0.data, "AuthMethod", "None"));
    assert!(has(&r0.data, "TargetPortalGroupTag", "1"));
    assert_eq!(r0.tsih, 0, "TSIH only in the final response");
    assert_eq!(r0.stat_sn, 0x100);
    assert_eq!(r0.exp_cmd_sn, 7);
    let second = &r.requests[1];
    assert_eq!(
        (second.csg, second.nsg, second.transit),
        (Stage::Operational, Stage::FullFeature, true)
    );
    assert_eq!(second.exp_stat_sn, 0x101);
    assert_eq!(
        second.cmd_sn, 7,
        "login requests are immediate: CmdSN stays"
    );
    assert_eq!(r.last.tsih, 0x11);
    assert!(has(&r.last.data, "MaxRecvDataSegmentLength", "65536"));

    // Both sides agree.
    assert_eq!(out.session, t.session);
    let s = &out.session;
    assert_eq!(s.max_connections, 4);
    assert!(!s.initial_r2t);
    assert!(s.immediate_data);
    assert_eq!(s.max_burst_length, 512 * 1024);
    assert_eq!(s.first_burst_length, 128 * 1024);
    assert_eq!(out.connection.header_digest, Digest::Crc32c);
    assert_eq!(out.connection.data_digest, Digest::None);
    assert_eq!(t.connection.header_digest, Digest::Crc32c);
    assert_eq!(out.connection.max_send_data_segment_length, 65536);
    assert_eq!(out.connection.max_recv_data_segment_length, 262_144);
    assert_eq!(t.connection.max_send_data_segment_length, 262_144);
    assert_eq!(t.connection.max_recv_data_segment_length, 65536);
    assert_eq!(out.tsih, 0x11);
    assert_eq!(t.tsih, 0x11);
    assert_eq!(out.target_portal_group_tag, Some(1));
    assert_eq!(out.target_alias.as_deref(), Some("disk one"));
    assert_eq!(out.stat_sn, 0x101);
    assert_eq!(t.session_type, SessionType::Normal);
    assert_eq!(t.initiator_name, INI);
    assert_eq!(t.target_name.as_deref(), Some(TGT));
}

#[test]
fn discovery_login() {
    let mut env = Env::new();
    let r = run(
        InitiatorLoginConfig::discovery(INI, ISID),
        TargetLoginConfig::default(),
        &mut env,
    );
    let out = r.initiator.unwrap();
    let t = r.target.unwrap();
    assert_eq!(t.session_type, SessionType::Discovery);
    assert_eq!(t.target_name, None);
    assert!(!has(&r.requests[0].data, "TargetName", TGT));
    assert!(keys_of(&r.responses[0].data)
        .iter()
        .all(|(k, _)| k != "TargetPortalGroupTag"));
    // Session-wide keys that are irrelevant for discovery are not even offered.
    assert!(keys_of(&r.requests[1].data)
        .iter()
        .all(|(k, _)| k != "MaxBurstLength" && k != "InitialR2T"));
    assert_eq!(out.session.max_connections, 1);
    assert_eq!(out.session, SessionParams::default());
    assert_ne!(out.tsih, 0);
}

#[test]
fn skipping_the_operational_stage() {
    let mut env = Env::new();
    let mut cfg = InitiatorLoginConfig::normal(INI, TGT, ISID);
    cfg.operational_stage = false;
    let r = run(cfg, TargetLoginConfig::default(), &mut env);
    let out = r.initiator.unwrap();
    assert_eq!(r.requests.len(), 1);
    assert_eq!(r.requests[0].nsg, Stage::FullFeature);
    assert_eq!(r.last.csg, Stage::Security);
    assert_eq!(r.last.nsg, Stage::FullFeature);
    assert_eq!(out.session, SessionParams::default());

    // A target that needs a non-default value offers it in the security stage and holds the
    // transit until the initiator has answered.
    let mut env = Env::new();
    env.params.immediate_data = false;
    let mut cfg = InitiatorLoginConfig::normal(INI, TGT, ISID);
    cfg.operational_stage = false;
    let r = run(cfg, TargetLoginConfig::default(), &mut env);
    let out = r.initiator.unwrap();
    assert_eq!(r.requests.len(), 2);
    assert!(!r.responses[0].transit);
    assert!(has(&r.responses[0].data, "ImmediateData", "No"));
    assert!(has(&r.requests[1].data, "ImmediateData", "No"));
    assert!(!out.session.immediate_data);
    assert_eq!(out.session, r.target.unwrap().session);
}

#[test]
fn unknown_target_is_not_found() {
    let mut env = Env::new();
    let r = run(
        InitiatorLoginConfig::normal(INI, "iqn.2024-01.org.mcsi:nope", ISID),
        TargetLoginConfig::default(),
        &mut env,
    );
    assert!(matches!(
        r.initiator,
        Err(LoginError::Status {
            class: 2,
            detail: 3,
            ..
        })
    ));
    assert_eq!(
        (r.last.status_class, r.last.status_detail),
        status::NOT_FOUND
    );
}

fn request(data: &str, csg: Stage, nsg: Stage, transit: bool) -> LoginRequest {
    LoginRequest {
        transit,
        continue_: false,
        csg,
        nsg,
        version_max: 0,
        version_min: 0,
        isid: ISID,
        tsih: 0,
        itt: 1,
        cid: 0,
        cmd_sn: 1,
        exp_stat_sn: 0,
        data: bytes::Bytes::from(data.replace('|', "\0")),
    }
}

fn fail_status(step: LoginStep) -> (u8, u8) {
    match step {
        LoginStep::Fail(r) => (r.status_class, r.status_detail),
        other => panic!("expected failure, got {other:?}"),
    }
}

fn cont(step: LoginStep) -> LoginResponse {
    match step {
        LoginStep::Continue(r) => r,
        other => panic!("expected continue, got {other:?}"),
    }
}

const SEC: Stage = Stage::Security;
const OP: Stage = Stage::Operational;
const FFP: Stage = Stage::FullFeature;

#[test]
fn missing_names() {
    let mut env = Env::new();
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let s = t.handle(
        &request("TargetName=x|AuthMethod=None|", SEC, OP, true),
        &mut env,
    );
    assert_eq!(fail_status(s), status::MISSING_PARAMETER);

    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let s = t.handle(
        &request(
            &format!("InitiatorName={INI}|SessionType=Normal|"),
            SEC,
            OP,
            true,
        ),
        &mut env,
    );
    assert_eq!(fail_status(s), status::MISSING_PARAMETER);
    // A failed login takes no more requests.
    let s = t.handle(&request("", SEC, OP, true), &mut env);
    assert_eq!(fail_status(s), status::INVALID_DURING_LOGIN);
}

#[test]
fn unsupported_version() {
    let mut env = Env::new();
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let mut req = request(
        &format!("InitiatorName={INI}|TargetName={TGT}|"),
        SEC,
        OP,
        true,
    );
    req.version_min = 1;
    req.version_max = 2;
    assert_eq!(
        fail_status(t.handle(&req, &mut env)),
        status::UNSUPPORTED_VERSION
    );
}

#[test]
fn auth_method_negotiation() {
    // CHAP offered first, only None acceptable: answered None.
    let mut env = Env::new();
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let r = cont(t.handle(
        &request(
            &format!("InitiatorName={INI}|TargetName={TGT}|AuthMethod=CHAP,None|"),
            SEC,
            OP,
            true,
        ),
        &mut env,
    ));
    assert!(has(&r.data, "AuthMethod", "None"));
    assert!(r.transit);

    // Nothing acceptable: Reject and 2/01.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let s = t.handle(
        &request(
            &format!("InitiatorName={INI}|TargetName={TGT}|AuthMethod=CHAP,SRP|"),
            SEC,
            OP,
            true,
        ),
        &mut env,
    );
    match s {
        LoginStep::Fail(r) => {
            assert_eq!((r.status_class, r.status_detail), status::AUTH_FAILED);
            assert!(has(&r.data, "AuthMethod", "Reject"));
        }
        other => panic!("{other:?}"),
    }

    // A target that requires CHAP: an initiator offering only None fails with 2/01.
    let mut env = Env::new();
    env.methods = vec!["CHAP"];
    let r = run(
        InitiatorLoginConfig::normal(INI, TGT, ISID),
        TargetLoginConfig::default(),
        &mut env,
    );
    assert!(matches!(
        r.initiator,
        Err(LoginError::Status {
            class: 2,
            detail: 1,
            ..
        })
    ));
    // ... and so does one that skips the security stage.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let s = t.handle(
        &request(
            &format!("InitiatorName={INI}|TargetName={TGT}|"),
            OP,
            FFP,
            true,
        ),
        &mut env,
    );
    assert_eq!(fail_status(s), status::AUTH_FAILED);
    // ... or leaves security without finishing the exchange.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let r = cont(t.handle(
        &request(
            &format!("InitiatorName={INI}|TargetName={TGT}|AuthMethod=CHAP|"),
            SEC,
            OP,
            false,
        ),
        &mut env,
    ));
    assert!(has(&r.data, "AuthMethod", "CHAP"));
    let r = cont(t.handle(&request("CHAP_A=5|", SEC, OP, false), &mut env));
    assert!(has(&r.data, "CHAP_C", "0x0102"));
    let s = t.handle(&request("", SEC, OP, true), &mut env);
    assert_eq!(fail_status(s), status::AUTH_FAILED);
    // A finished exchange lets the login go on.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    cont(t.handle(
        &request(
            &format!("InitiatorName={INI}|TargetName={TGT}|AuthMethod=CHAP|"),
            SEC,
            OP,
            false,
        ),
        &mut env,
    ));
    let r = cont(t.handle(&request("CHAP_N=me|CHAP_R=ok|", SEC, OP, true), &mut env));
    assert!(r.transit);
    assert_eq!(r.nsg, OP);
}

#[test]
fn stage_rules() {
    let mut env = Env::new();
    let hello = format!("InitiatorName={INI}|TargetName={TGT}|AuthMethod=None|");
    // NSG must move forward.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let s = t.handle(&request(&hello, OP, SEC, true), &mut env);
    assert_eq!(fail_status(s), status::INITIATOR_ERROR);
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let s = t.handle(&request(&hello, SEC, SEC, true), &mut env);
    assert_eq!(fail_status(s), status::INITIATOR_ERROR);
    // CSG must not go backwards after a transit.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let r = cont(t.handle(&request(&hello, SEC, OP, true), &mut env));
    assert!(r.transit);
    assert_eq!(t.stage(), OP);
    let s = t.handle(&request("", SEC, OP, true), &mut env);
    assert_eq!(fail_status(s), status::INITIATOR_ERROR);
    // Without a transit the stage stays.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let r = cont(t.handle(&request(&hello, SEC, SEC, false), &mut env));
    assert!(!r.transit);
    assert_eq!((r.csg, r.nsg), (SEC, SEC));
    let s = t.handle(&request("", OP, FFP, true), &mut env);
    assert_eq!(fail_status(s), status::INITIATOR_ERROR);
    // The CID and ISID stay the same over the login.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    cont(t.handle(&request(&hello, SEC, OP, true), &mut env));
    let mut req = request("", OP, FFP, true);
    req.cid = 9;
    assert_eq!(
        fail_status(t.handle(&req, &mut env)),
        status::INITIATOR_ERROR
    );
}

#[test]
fn repeated_and_conflicting_keys() {
    let mut env = Env::new();
    let hello = format!("InitiatorName={INI}|TargetName={TGT}|AuthMethod=None|");
    // The same key twice in one login: initiator error.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    cont(t.handle(&request(&hello, SEC, OP, true), &mut env));
    let s = t.handle(
        &request("MaxBurstLength=65536|MaxBurstLength=8192|", OP, FFP, true),
        &mut env,
    );
    assert_eq!(fail_status(s), status::INITIATOR_ERROR);
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    cont(t.handle(&request(&hello, SEC, OP, false), &mut env));
    let s = t.handle(&request("AuthMethod=None|", SEC, OP, true), &mut env);
    assert_eq!(fail_status(s), status::INITIATOR_ERROR);
    // Out-of-range values are answered with Reject, the login goes on.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    cont(t.handle(&request(&hello, SEC, OP, true), &mut env));
    let s = t.handle(
        &request(
            "MaxBurstLength=100|ErrorRecoveryLevel=7|ImmediateData=Maybe|X-com.example.k=1|",
            OP,
            FFP,
            true,
        ),
        &mut env,
    );
    let LoginStep::FullFeature {
        response, session, ..
    } = s
    else {
        panic!("{s:?}")
    };
    assert!(has(&response.data, "MaxBurstLength", "Reject"));
    assert!(has(&response.data, "ErrorRecoveryLevel", "Reject"));
    assert!(has(&response.data, "ImmediateData", "Reject"));
    assert!(has(&response.data, "X-com.example.k", "NotUnderstood"));
    assert_eq!(session, SessionParams::default());
    // Malformed text: initiator error.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let s = t.handle(&request("InitiatorName", SEC, OP, true), &mut env);
    assert_eq!(fail_status(s), status::INITIATOR_ERROR);
}

#[test]
fn continued_text_over_several_requests() {
    let mut env = Env::new();
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let mut a = request(&format!("InitiatorName={INI}|Target"), SEC, OP, false);
    a.continue_ = true;
    let r = cont(t.handle(&a, &mut env));
    assert!(r.data.is_empty() && !r.transit && !r.continue_);
    let b = request(&format!("Name={TGT}|AuthMethod=None|"), SEC, OP, true);
    let r = cont(t.handle(&b, &mut env));
    assert!(r.transit);
    assert!(has(&r.data, "TargetPortalGroupTag", "1"));

    // A long alias pushes the initiator's first request over 8192 bytes: it goes in pieces.
    let mut env = Env::new();
    let mut cfg = InitiatorLoginConfig::normal(INI, TGT, ISID);
    cfg.initiator_alias = Some("a".repeat(200));
    let mut ext = Vec::new();
    for i in 0..60 {
        let name: &'static str = Box::leak(format!("X-org.mcsi.k{i:02}").into_boxed_str());
        ext.push((
            mcsi_proto::keys::KeyDef {
                name,
                kind: mcsi_proto::keys::KeyKind::Declarative,
                value: mcsi_proto::keys::ValueSpec::Text,
                default: "",
                leading_only: false,
                per_connection: false,
                phase: mcsi_proto::keys::Phase::Any,
                senders: mcsi_proto::keys::Senders::Both,
                discovery: true,
            },
            "v".repeat(200),
        ));
    }
    cfg.extensions = ext;
    let r = run(cfg, TargetLoginConfig::default(), &mut env);
    r.initiator.unwrap();
    assert!(r.requests.iter().any(|q| q.continue_));
}

#[test]
fn non_leading_connection() {
    let mut env = Env::new();
    let r = run(
        InitiatorLoginConfig::normal(INI, TGT, ISID),
        TargetLoginConfig::default(),
        &mut env,
    );
    let tsih = r.initiator.unwrap().tsih;
    // A second connection joins the session.
    let mut cfg = InitiatorLoginConfig::normal(INI, TGT, ISID);
    cfg.tsih = tsih;
    cfg.cid = 1;
    cfg.params.max_connections = 4;
    let r = run(cfg, TargetLoginConfig::default(), &mut env);
    let out = r.initiator.unwrap();
    assert_eq!(out.tsih, tsih);
    // The target is told which connection logs in (leading: TSIH 0 with CID 0).
    assert_eq!(env.session_calls, vec![(0, 0), (tsih, 1)]);
    // LO keys are not offered on a non-leading connection.
    assert!(r
        .requests
        .iter()
        .all(|q| keys_of(&q.data).iter().all(|(k, _)| k != "MaxConnections")));
    // An unknown session: 2/0a.
    let mut cfg = InitiatorLoginConfig::normal(INI, TGT, ISID);
    cfg.tsih = 0x7777;
    let r = run(cfg, TargetLoginConfig::default(), &mut env);
    assert!(matches!(
        r.initiator,
        Err(LoginError::Status {
            class: 2,
            detail: 10,
            ..
        })
    ));
    // LO keys sent anyway are answered Irrelevant.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let mut req = request(
        &format!("InitiatorName={INI}|TargetName={TGT}|AuthMethod=None|MaxConnections=2|"),
        SEC,
        OP,
        true,
    );
    req.tsih = tsih;
    let r = cont(t.handle(&req, &mut env));
    assert!(has(&r.data, "MaxConnections", "Irrelevant"));
}

#[test]
fn initiator_rejects_bad_responses() {
    let mut ini = InitiatorLogin::new(InitiatorLoginConfig::normal(INI, TGT, ISID));
    let req = ini.start();
    let base = LoginResponse {
        transit: true,
        continue_: false,
        csg: SEC,
        nsg: OP,
        version_max: 0,
        version_active: 0,
        isid: ISID,
        tsih: 0,
        itt: req.itt,
        stat_sn: 1,
        exp_cmd_sn: 1,
        max_cmd_sn: 1,
        status_class: 0,
        status_detail: 0,
        data: text::encode(&[("AuthMethod", "CHAP")]),
    };
    // CHAP was not offered.
    assert!(matches!(
        ini.handle(&base),
        InitiatorStep::Failed(LoginError::Negotiation(_))
    ));
    // Version 1 was not offered.
    let mut ini = InitiatorLogin::new(InitiatorLoginConfig::normal(INI, TGT, ISID));
    ini.start();
    let mut r = base.clone();
    r.version_active = 1;
    r.data = text::encode(&[("AuthMethod", "None")]);
    assert!(matches!(
        ini.handle(&r),
        InitiatorStep::Failed(LoginError::Protocol(_))
    ));
    // Going to full feature phase without a TSIH.
    let mut ini = InitiatorLogin::new(InitiatorLoginConfig::normal(INI, TGT, ISID));
    let mut cfg_skip = InitiatorLoginConfig::normal(INI, TGT, ISID);
    cfg_skip.operational_stage = false;
    let mut skip = InitiatorLogin::new(cfg_skip);
    skip.start();
    let mut r = base.clone();
    r.nsg = FFP;
    r.data = text::encode(&[("AuthMethod", "None")]);
    assert!(matches!(
        skip.handle(&r),
        InitiatorStep::Failed(LoginError::Protocol(_))
    ));
    // Jumping further than asked.
    ini.start();
    assert!(matches!(
        ini.handle(&r),
        InitiatorStep::Failed(LoginError::Protocol(_))
    ));
}

#[test]
fn transit_asked_with_an_auth_method_list_waits_for_the_exchange() {
    // AuthMethod=CHAP,None with T=1 in the first request (libiscsi's opening): the target
    // picks CHAP and answers T=0; the exchange then finishes and the transit is granted.
    let mut env = Env::new();
    env.methods = vec!["CHAP"];
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let hello = format!("InitiatorName={INI}|TargetName={TGT}|AuthMethod=CHAP,None|");
    let r = cont(t.handle(&request(&hello, SEC, OP, true), &mut env));
    assert!(has(&r.data, "AuthMethod", "CHAP"));
    assert!(!r.transit && r.csg == Stage::Security);
    let r = cont(t.handle(&request("CHAP_A=5|", SEC, OP, false), &mut env));
    assert!(has(&r.data, "CHAP_C", "0x0102") && !r.transit);
    let r = cont(t.handle(&request("CHAP_R=ok|", SEC, OP, true), &mut env));
    assert!(r.transit && r.nsg == Stage::Operational);
}
