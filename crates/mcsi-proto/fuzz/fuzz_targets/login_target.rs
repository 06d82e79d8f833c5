//! The target's login state machine driven by arbitrary Login Requests. Each request is built
//! from the input (header fields, text from the key table or raw bytes, optionally the right
//! CHAP answer to the last challenge), serialized, and passed through the decoder. Never panics;
//! refusals carry a status class, a full feature step carries a TSIH, and every response encodes
//! and decodes back.
#![no_main]

mod common;

use bytes::BytesMut;
use common::{pairs, raw_text, Challenge, Input, SECRET, TARGET, TARGET_SECRET, TARGET_USER, USER};
use libfuzzer_sys::fuzz_target;
use mcsi_proto::chap::{ChapCredentials, ChapTarget, ChapUsers};
use mcsi_proto::keys::{LocalParams, SessionType};
use mcsi_proto::login::{
    status, LoginEnv, LoginNumbers, LoginStep, NoAuth, Refusal, TargetAccess, TargetLogin,
    TargetLoginConfig,
};
use mcsi_proto::pdu::{decode, Framing, Isid, LoginRequest, Pdu, Stage};
use mcsi_proto::text::{self, TextLimits};

struct Env {
    chap: bool,
    tsih: u16,
    stat_sn: u32,
}

impl LoginEnv for Env {
    fn target(
        &mut self,
        session_type: SessionType,
        target_name: Option<&str>,
        _initiator_name: &str,
    ) -> Result<TargetAccess, Refusal> {
        if session_type == SessionType::Normal && target_name != Some(TARGET) {
            return Err(status::NOT_FOUND.into());
        }
        let authenticator: Box<dyn mcsi_proto::login::Authenticator> = if self.chap {
            let mut users = ChapUsers::new();
            let _ = users
                .insert(ChapCredentials::new(USER, SECRET).with_mutual(TARGET_USER, TARGET_SECRET));
            let mut n = 0u8;
            Box::new(ChapTarget::new(users, move |b: &mut [u8]| {
                for x in b {
                    n = n.wrapping_add(37);
                    *x = n;
                }
            }))
        } else {
            Box::new(NoAuth)
        };
        Ok(TargetAccess {
            params: LocalParams::default(),
            authenticator,
            target_alias: Some("fuzz".into()),
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
        match tsih {
            0 => {
                self.tsih = self.tsih.wrapping_add(1).max(1);
                Ok(self.tsih)
            }
            1..=4 => Ok(tsih),
            _ => Err(status::SESSION_DOES_NOT_EXIST.into()),
        }
    }

    fn numbers(&mut self, req: &LoginRequest) -> LoginNumbers {
        self.stat_sn = self.stat_sn.wrapping_add(1);
        LoginNumbers {
            stat_sn: self.stat_sn,
            exp_cmd_sn: req.cmd_sn,
            max_cmd_sn: req.cmd_sn.wrapping_add(8),
        }
    }
}

fn bhs(inp: &mut Input<'_>, dsl: usize) -> [u8; 48] {
    let mut h = [0u8; 48];
    let ctl = inp.u8();
    // Mostly a well-formed immediate Login Request; sometimes any opcode byte.
    h[0] = if ctl & 0x80 != 0 { inp.u8() } else { 0x43 };
    h[1] = inp.u8();
    if ctl & 0x40 == 0 {
        h[2] = 0;
        h[3] = 0;
    } else {
        h[2] = inp.u8();
        h[3] = inp.u8();
    }
    let dsl = dsl.min(0xff_ffff) as u32;
    h[5..8].copy_from_slice(&dsl.to_be_bytes()[1..]);
    h[8..14].copy_from_slice(&[0x80, 0, 0, 0x12, 0x34, 0x01]);
    if ctl & 0x20 != 0 {
        h[8..14].copy_from_slice(inp.take(6).try_into().unwrap_or([0; 6]).as_slice());
        h[14..16].copy_from_slice(&inp.u16().to_be_bytes());
        h[20..22].copy_from_slice(&inp.u16().to_be_bytes());
    }
    h[16..20].copy_from_slice(&7u32.to_be_bytes());
    h[24..28].copy_from_slice(&inp.u32().to_be_bytes());
    h[28..32].copy_from_slice(&inp.u32().to_be_bytes());
    h
}

fn wire_back(p: Pdu) {
    let f = Framing::default();
    let mut buf = BytesMut::from(&p.encode(&f).to_vec()[..]);
    let back = decode(&mut buf, &f)
        .expect("response does not decode")
        .expect("incomplete");
    assert_eq!(back, p);
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mut env = Env {
        chap: inp.bool(),
        tsih: 0,
        stat_sn: 0,
    };
    let mut login = TargetLogin::new(TargetLoginConfig::default());
    let mut challenge = Challenge::default();
    let framing = Framing::default();
    let mut stream = BytesMut::new();
    for _ in 0..64 {
        if inp.is_empty() {
            break;
        }
        let kind = inp.u8();
        let body = if kind & 1 == 0 {
            raw_text(&pairs(&mut inp, 24, &challenge))
        } else {
            let n = usize::from(inp.u16()) % 9000;
            inp.take(n).to_vec()
        };
        let mut pdu = bhs(&mut inp, body.len()).to_vec();
        pdu.extend_from_slice(&body);
        while pdu.len() % 4 != 0 {
            pdu.push(0);
        }
        stream.extend_from_slice(&pdu);
        let req = match decode(&mut stream, &framing) {
            Ok(Some(Pdu::LoginRequest(r))) => r,
            Ok(Some(_)) | Err(_) => {
                stream.clear();
                continue;
            }
            Ok(None) => {
                stream.clear();
                continue;
            }
        };
        match login.handle(&req, &mut env) {
            LoginStep::Continue(resp) => {
                assert_eq!(resp.status_class, 0);
                assert_eq!(resp.itt, req.itt);
                assert!(resp.data.len() <= 8192, "login response over 8192 bytes");
                if let Ok(p) = text::parse(&resp.data, &TextLimits::default()) {
                    challenge.learn(&p);
                }
                wire_back(Pdu::LoginResponse(resp));
            }
            LoginStep::Fail(resp) => {
                assert_ne!(resp.status_class, 0);
                wire_back(Pdu::LoginResponse(resp));
                login = TargetLogin::new(TargetLoginConfig::default());
                challenge = Challenge::default();
            }
            LoginStep::FullFeature { response, tsih, .. } => {
                assert_eq!(response.status_class, 0);
                assert!(response.transit && response.nsg == Stage::FullFeature);
                assert!(tsih != 0 && response.tsih == tsih);
                wire_back(Pdu::LoginResponse(response));
                login = TargetLogin::new(TargetLoginConfig::default());
                challenge = Challenge::default();
            }
        }
    }
});
