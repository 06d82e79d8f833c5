#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Whole logins with CHAP: the initiator machine with a `ChapInitiator`, the target machine with a
//! `ChapTarget`, every PDU through the codec.

use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use mcsi_proto::chap::*;
use mcsi_proto::keys::{LocalParams, SessionType};
use mcsi_proto::login::*;
use mcsi_proto::pdu::*;
use mcsi_proto::text;

const INI: &str = "iqn.2024-01.org.mcsi:host1";
const TGT: &str = "iqn.2024-01.org.mcsi:disk1";
const ISID: Isid = Isid([0x80, 0, 0, 0x12, 0x34, 0x01]);
const INI_SECRET: &str = "initiator-secret";
const TGT_SECRET: &str = "target-secret-99";
const DISC_SECRET: &str = "discovery-secret";

type Log = Arc<Mutex<Vec<Result<ChapSuccess, ChapError>>>>;

/// Deterministic "randomness": consecutive byte values from `seed`.
fn counter(seed: u8) -> impl FnMut(&mut [u8]) + Send + 'static {
    let mut n = seed;
    move |buf: &mut [u8]| {
        for b in buf {
            *b = n;
            n = n.wrapping_add(1);
        }
    }
}

fn seq(from: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| from.wrapping_add(i as u8)).collect()
}

/// The target: per-target users, separate discovery users, CHAP options.
struct Env {
    users: ChapUsers,
    discovery_users: ChapUsers,
    algorithms: Vec<ChapAlgorithm>,
    encoding: Encoding,
    log: Log,
    next_tsih: u16,
    stat_sn: u32,
}

impl Env {
    fn new() -> Self {
        let mut users = ChapUsers::new();
        users
            .insert(ChapCredentials::new("alice", INI_SECRET).with_mutual("disk1", TGT_SECRET))
            .unwrap();
        let mut discovery_users = ChapUsers::new();
        discovery_users
            .insert(ChapCredentials::new("finder", DISC_SECRET))
            .unwrap();
        Env {
            users,
            discovery_users,
            algorithms: ChapAlgorithm::ALL.to_vec(),
            encoding: Encoding::Hex,
            log: Log::default(),
            next_tsih: 0x20,
            stat_sn: 0x100,
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
        let users = match session_type {
            SessionType::Discovery => self.discovery_users.clone(),
            SessionType::Normal if target_name == Some(TGT) => self.users.clone(),
            SessionType::Normal => return Err(status::NOT_FOUND.into()),
        };
        let log = self.log.clone();
        let auth = ChapTarget::new(users, counter(0x10))
            .with_algorithms(&self.algorithms)
            .with_encoding(self.encoding)
            .with_observer(move |r| log.lock().unwrap().push(r.cloned().map_err(Clone::clone)));
        Ok(TargetAccess {
            params: LocalParams::default(),
            authenticator: Box::new(auth),
            target_alias: None,
            portal_group_tag: None,
            extensions: Vec::new(),
        })
    }

    fn session(
        &mut self,
        _isid: Isid,
        tsih: u16,
        _cid: u16,
        _initiator_name: &str,
        _target_name: Option<&str>,
    ) -> Result<u16, Refusal> {
        if tsih != 0 {
            return Err(status::SESSION_DOES_NOT_EXIST.into());
        }
        self.next_tsih += 1;
        Ok(self.next_tsih)
    }

    fn numbers(&mut self, req: &LoginRequest) -> LoginNumbers {
        self.stat_sn += 1;
        LoginNumbers {
            stat_sn: self.stat_sn,
            exp_cmd_sn: req.cmd_sn,
            max_cmd_sn: req.cmd_sn.wrapping_add(31),
        }
    }
}

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

struct Run {
    initiator: Result<LoginOutcome, LoginError>,
    target_done: bool,
    requests: Vec<LoginRequest>,
    responses: Vec<LoginResponse>,
}

fn run(cfg: InitiatorLoginConfig, env: &mut Env) -> Run {
    let mut ini = InitiatorLogin::new(cfg);
    let mut tgt = TargetLogin::new(TargetLoginConfig::default());
    let mut req = ini.start();
    let (mut requests, mut responses) = (Vec::new(), Vec::new());
    for _ in 0..32 {
        requests.push(req.clone());
        let (resp, done) = match tgt.handle(&to_target(req.clone()), env) {
            LoginStep::Continue(r) | LoginStep::Fail(r) => (r, false),
            LoginStep::FullFeature { response, .. } => (response, true),
        };
        responses.push(resp.clone());
        match ini.handle(&to_initiator(resp)) {
            InitiatorStep::Send(r) => {
                assert!(!done, "target finished but initiator goes on");
                req = r;
            }
            InitiatorStep::FullFeature(o) => {
                assert!(done, "initiator finished alone");
                return Run {
                    initiator: Ok(*o),
                    target_done: done,
                    requests,
                    responses,
                };
            }
            InitiatorStep::Failed(e) => {
                return Run {
                    initiator: Err(e),
                    target_done: done,
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

fn key(data: &[u8], k: &str) -> Option<String> {
    keys_of(data)
        .into_iter()
        .find(|(a, _)| a == k)
        .map(|(_, v)| v)
}

fn chap_cfg(
    creds: ChapCredentials,
    algorithms: &[ChapAlgorithm],
    log: &Log,
) -> InitiatorLoginConfig {
    let mut cfg = InitiatorLoginConfig::normal(INI, TGT, ISID);
    let log = log.clone();
    cfg.authenticator = Box::new(
        ChapInitiator::new(creds, counter(0x80))
            .unwrap()
            .with_algorithms(algorithms)
            .with_observer(move |r| log.lock().unwrap().push(r.cloned().map_err(Clone::clone))),
    );
    cfg
}

fn auth_failed(r: &Run) {
    match &r.initiator {
        Err(LoginError::Status { class, detail, .. }) => {
            assert_eq!((*class, *detail), status::AUTH_FAILED)
        }
        other => panic!("expected 2/01, got {other:?}"),
    }
    assert!(!r.target_done);
    let last = r.responses.last().unwrap();
    assert_eq!((last.status_class, last.status_detail), (2, 1));
}

#[test]
fn one_way_login() {
    let mut env = Env::new();
    let log = Log::default();
    let r = run(
        chap_cfg(ChapCredentials::new("alice", INI_SECRET), &[], &log),
        &mut env,
    );
    let out = r.initiator.unwrap();
    assert!(out.tsih != 0 && r.target_done);
    // AuthMethod, CHAP_A, CHAP_N/CHAP_R (asking to leave security), operational.
    assert_eq!(r.requests.len(), 4);
    assert_eq!(key(&r.requests[0].data, "AuthMethod").unwrap(), "CHAP");
    assert!(!r.requests[0].transit);
    assert_eq!(key(&r.responses[0].data, "AuthMethod").unwrap(), "CHAP");
    // Strongest first; the target allows all and takes the initiator's first.
    assert_eq!(key(&r.requests[1].data, "CHAP_A").unwrap(), "8,7,6,5");
    assert_eq!(key(&r.responses[1].data, "CHAP_A").unwrap(), "8");
    assert_eq!(key(&r.responses[1].data, "CHAP_I").unwrap(), "16");
    assert_eq!(
        key(&r.responses[1].data, "CHAP_C").unwrap(),
        encode_binary(&seq(0x11, 32), Encoding::Hex)
    );
    // SHA3-256(0x10 || secret || 11..30), computed with Python's hashlib.
    assert_eq!(
        key(&r.requests[2].data, "CHAP_R").unwrap(),
        "0x533ae579def9e627342752a9dbf6546f2153b86bd3f8336b9bc0aa30fd435ee9"
    );
    assert_eq!(key(&r.requests[2].data, "CHAP_N").unwrap(), "alice");
    assert!(key(&r.requests[2].data, "CHAP_C").is_none());
    assert!(r.requests[2].transit);
    assert_eq!(r.requests[2].nsg, Stage::Operational);
    assert!(r.responses[2].transit);
    assert!(keys_of(&r.responses[2].data).is_empty());
    let tlog = env.log.lock().unwrap();
    assert_eq!(
        tlog.as_slice(),
        &[Ok(ChapSuccess {
            user: "alice".into(),
            algorithm: ChapAlgorithm::Sha3_256,
            mutual: false
        })]
    );
    assert!(log.lock().unwrap()[0].is_ok());
}

#[test]
fn libiscsi_style_md5_only() {
    // libiscsi offers CHAP_A=5 only; open-iscsi's built-in default is MD5 too.
    let mut env = Env::new();
    let log = Log::default();
    let r = run(
        chap_cfg(
            ChapCredentials::new("alice", INI_SECRET),
            &[ChapAlgorithm::Md5],
            &log,
        ),
        &mut env,
    );
    r.initiator.unwrap();
    assert_eq!(key(&r.requests[1].data, "CHAP_A").unwrap(), "5");
    assert_eq!(
        key(&r.requests[2].data, "CHAP_R").unwrap(),
        "0x69c2efac71eef26afb3d016a97daf5c0"
    );
}

#[test]
fn mutual_login() {
    let mut env = Env::new();
    env.algorithms = vec![ChapAlgorithm::Md5, ChapAlgorithm::Sha256];
    let log = Log::default();
    let creds = ChapCredentials::new("alice", INI_SECRET).with_mutual("disk1", TGT_SECRET);
    let r = run(chap_cfg(creds, &[], &log), &mut env);
    r.initiator.unwrap();
    // The target allows MD5 and SHA-256; the initiator's list (8,7,6,5) decides: SHA-256.
    assert_eq!(key(&r.responses[1].data, "CHAP_A").unwrap(), "7");
    // The request with our response and challenge already asks to leave security; the target
    // answers the challenge in the response that grants it: no extra round trip.
    assert_eq!(r.requests.len(), 4);
    let third = &r.requests[2];
    assert!(third.transit);
    assert_eq!(key(&third.data, "CHAP_I").unwrap(), "128");
    assert_eq!(
        key(&third.data, "CHAP_C").unwrap(),
        encode_binary(&seq(0x81, 32), Encoding::Hex)
    );
    assert_eq!(
        key(&third.data, "CHAP_R").unwrap(),
        "0xeb51904a62f3b9ef894d9f4dc6c79cca719b2e7be8065bd17a18d13d6534f96b"
    );
    let answer = &r.responses[2];
    assert!(answer.transit);
    assert_eq!(key(&answer.data, "CHAP_N").unwrap(), "disk1");
    assert_eq!(
        key(&answer.data, "CHAP_R").unwrap(),
        "0x73821791f17d7307d263ec84b6b2bc0950b6086bbccbc4f0737a5b211c95aa3c"
    );
    assert!(env.log.lock().unwrap()[0].as_ref().unwrap().mutual);
    assert_eq!(
        log.lock().unwrap()[0],
        Ok(ChapSuccess {
            user: "disk1".into(),
            algorithm: ChapAlgorithm::Sha256,
            mutual: true
        })
    );
}

#[test]
fn base64_challenges() {
    // Target challenges in base64: the initiator answers in base64. The initiator's mutual
    // challenge in hex: the target answers in hex.
    let mut env = Env::new();
    env.encoding = Encoding::Base64;
    env.algorithms = vec![ChapAlgorithm::Md5];
    let log = Log::default();
    let creds = ChapCredentials::new("alice", INI_SECRET).with_mutual("disk1", TGT_SECRET);
    let r = run(chap_cfg(creds, &[ChapAlgorithm::Md5], &log), &mut env);
    r.initiator.unwrap();
    // base64 of 11..20 and of the MD5 response, computed with Python.
    assert_eq!(
        key(&r.responses[1].data, "CHAP_C").unwrap(),
        "0bERITFBUWFxgZGhscHR4fIA=="
    );
    assert_eq!(
        key(&r.requests[2].data, "CHAP_R").unwrap(),
        "0bacLvrHHu8mr7PQFql9r1wA=="
    );
    assert_eq!(
        key(&r.responses[2].data, "CHAP_R").unwrap(),
        "0xbf3acfd50e85b9b16817fcf7491da5e2"
    );

    // And the other way round: a base64 mutual challenge gets a base64 answer.
    let mut env = Env::new();
    env.algorithms = vec![ChapAlgorithm::Md5];
    let mut cfg = InitiatorLoginConfig::normal(INI, TGT, ISID);
    cfg.authenticator = Box::new(
        ChapInitiator::new(
            ChapCredentials::new("alice", INI_SECRET).with_mutual("disk1", TGT_SECRET),
            counter(0x80),
        )
        .unwrap()
        .with_encoding(Encoding::Base64),
    );
    let r = run(cfg, &mut env);
    r.initiator.unwrap();
    assert!(key(&r.requests[2].data, "CHAP_C")
        .unwrap()
        .starts_with("0b"));
    assert!(key(&r.responses[2].data, "CHAP_R")
        .unwrap()
        .starts_with("0b"));
}

#[test]
fn wrong_secret_fails_with_2_01() {
    let mut env = Env::new();
    let r = run(
        chap_cfg(
            ChapCredentials::new("alice", "not-the-secret"),
            &[],
            &Log::default(),
        ),
        &mut env,
    );
    auth_failed(&r);
    assert_eq!(
        env.log.lock().unwrap()[0],
        Err(ChapError::WrongResponse("alice".into()))
    );
    // Unknown user: the same status.
    let mut env = Env::new();
    let r = run(
        chap_cfg(
            ChapCredentials::new("eve", INI_SECRET),
            &[],
            &Log::default(),
        ),
        &mut env,
    );
    auth_failed(&r);
    // Per-target and discovery credentials are separate: alice cannot log in to discovery.
    let mut env = Env::new();
    let mut cfg = InitiatorLoginConfig::discovery(INI, ISID);
    cfg.authenticator = Box::new(
        ChapInitiator::new(ChapCredentials::new("alice", INI_SECRET), counter(0)).unwrap(),
    );
    auth_failed(&run(cfg, &mut env));
    let mut cfg = InitiatorLoginConfig::discovery(INI, ISID);
    cfg.authenticator = Box::new(
        ChapInitiator::new(ChapCredentials::new("finder", DISC_SECRET), counter(0)).unwrap(),
    );
    run(cfg, &mut env).initiator.unwrap();
}

#[test]
fn wrong_target_secret_is_refused_by_the_initiator() {
    let mut env = Env::new();
    let log = Log::default();
    let creds =
        ChapCredentials::new("alice", INI_SECRET).with_mutual("disk1", "another-target-secret");
    let r = run(chap_cfg(creds, &[], &log), &mut env);
    assert_eq!(
        r.initiator.unwrap_err(),
        LoginError::Auth(status::AUTH_FAILED)
    );
    assert_eq!(
        log.lock().unwrap()[0],
        Err(ChapError::WrongResponse("disk1".into()))
    );
    // The target did authenticate the initiator and answered; the initiator closes.
    assert!(env.log.lock().unwrap()[0].is_ok());
}

#[test]
fn unsupported_algorithms_fail_with_2_01() {
    let mut env = Env::new();
    env.algorithms = vec![ChapAlgorithm::Sha3_256];
    let r = run(
        chap_cfg(
            ChapCredentials::new("alice", INI_SECRET),
            &[ChapAlgorithm::Md5, ChapAlgorithm::Sha1],
            &Log::default(),
        ),
        &mut env,
    );
    auth_failed(&r);
    assert_eq!(r.requests.len(), 2);
    assert!(matches!(
        env.log.lock().unwrap()[0],
        Err(ChapError::NoCommonAlgorithm { .. })
    ));
}

/// One login request in the security stage, built by hand.
fn request(keys: &str, transit: bool) -> LoginRequest {
    let pairs: Vec<(&str, &str)> = keys
        .split('|')
        .filter(|s| !s.is_empty())
        .map(|kv| kv.split_once('=').unwrap())
        .collect();
    to_target(LoginRequest {
        transit,
        continue_: false,
        csg: Stage::Security,
        nsg: if transit {
            Stage::Operational
        } else {
            Stage::Security
        },
        version_max: 0,
        version_min: 0,
        isid: ISID,
        tsih: 0,
        itt: 1,
        cid: 0,
        cmd_sn: 1,
        exp_stat_sn: 0,
        data: text::encode(&pairs),
    })
}

#[test]
fn reflected_challenge_is_refused() {
    let mut env = Env::new();
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let hello = format!("InitiatorName={INI}|TargetName={TGT}|AuthMethod=CHAP|");
    assert!(matches!(
        t.handle(&request(&hello, false), &mut env),
        LoginStep::Continue(_)
    ));
    let LoginStep::Continue(r) = t.handle(&request("CHAP_A=5|", false), &mut env) else {
        panic!("no challenge")
    };
    let challenge = key(&r.data, "CHAP_C").unwrap();
    let id: u8 = key(&r.data, "CHAP_I").unwrap().parse().unwrap();
    let (c, _) = decode_binary("CHAP_C", &challenge).unwrap();
    // A correct response, with the target's own challenge as the mutual challenge.
    let resp = ChapAlgorithm::Md5.response(id, &Secret::from(INI_SECRET), &c);
    let keys = format!(
        "CHAP_N=alice|CHAP_R={}|CHAP_I=7|CHAP_C={challenge}|",
        encode_binary(&resp, Encoding::Hex)
    );
    match t.handle(&request(&keys, true), &mut env) {
        LoginStep::Fail(r) => {
            assert_eq!((r.status_class, r.status_detail), status::AUTH_FAILED);
            // Nothing of the exchange leaks into the refusal.
            assert!(keys_of(&r.data).is_empty());
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(
        env.log.lock().unwrap()[0],
        Err(ChapError::ReflectedChallenge)
    );
}

#[test]
fn leaving_security_before_the_answer_is_refused() {
    // CHAP_A with T=1: the exchange is not over, the target refuses to leave security.
    let mut env = Env::new();
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let hello = format!("InitiatorName={INI}|TargetName={TGT}|AuthMethod=CHAP|");
    t.handle(&request(&hello, false), &mut env);
    match t.handle(&request("CHAP_A=5|", true), &mut env) {
        LoginStep::Fail(r) => assert_eq!((r.status_class, r.status_detail), (2, 1)),
        other => panic!("{other:?}"),
    }
    // AuthMethod=None is not accepted by a CHAP target.
    let mut t = TargetLogin::new(TargetLoginConfig::default());
    let hello = format!("InitiatorName={INI}|TargetName={TGT}|AuthMethod=None|");
    match t.handle(&request(&hello, true), &mut env) {
        LoginStep::Fail(r) => assert_eq!((r.status_class, r.status_detail), (2, 1)),
        other => panic!("{other:?}"),
    }
}
