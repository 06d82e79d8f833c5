//! The login phase of one connection (RFC 7143 sections 6 and 11.12), driven over the socket.
//!
//! The key answers here are a narrow stand-in for mcsi-proto's `TargetLogin`: AuthMethod=None
//! only (the security stage is the seam for CHAP), operational keys answered with the result
//! functions of RFC 7143 section 13 for the keys a full feature phase uses. Session creation,
//! joining (non-leading login) and the reinstatement rules live in [`crate::server`].

use crate::config::Limits;
use crate::session::{ConnOps, SessionOps, Shared, Target};
use bytes::{Bytes, BytesMut};
use mcsi_proto::pdu::{self, Framing, Isid, LoginRequest, LoginResponse, Pdu, Stage};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Status class and detail (11.13.5).
pub mod status {
    pub const INITIATOR_ERROR: (u8, u8) = (2, 0);
    pub const AUTH_FAILED: (u8, u8) = (2, 1);
    pub const NOT_FOUND: (u8, u8) = (2, 3);
    pub const UNSUPPORTED_VERSION: (u8, u8) = (2, 5);
    pub const TOO_MANY_CONNECTIONS: (u8, u8) = (2, 6);
    pub const MISSING_PARAMETER: (u8, u8) = (2, 7);
    pub const SESSION_DOES_NOT_EXIST: (u8, u8) = (2, 10);
    pub const TARGET_ERROR: (u8, u8) = (3, 0);
}

/// Time a login may take in total.
const LOGIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Text of one login (all PDUs, with C-bit continuation) is capped.
const MAX_LOGIN_TEXT: usize = 64 * 1024;

/// Discovery or normal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionType {
    Discovery,
    Normal,
}

/// What a successful login agreed on.
#[derive(Debug, Clone)]
pub struct Negotiated {
    pub session_type: SessionType,
    pub initiator_name: String,
    pub target: Option<Arc<Target>>,
    pub isid: Isid,
    /// 0 for a leading login.
    pub tsih: u16,
    pub cid: u16,
    pub session: SessionOps,
    pub conn: ConnOps,
    /// CmdSN of the login request: the session's first ExpCmdSN for a leading login.
    pub cmd_sn: u32,
    /// StatSN for the first full feature phase status on this connection.
    pub next_stat_sn: u32,
    /// The final login response, to send once the session is set up (with its TSIH).
    pub final_response: LoginResponse,
}

/// How the login ended.
#[derive(Debug, thiserror::Error)]
pub enum LoginError {
    #[error("connection closed during login")]
    Closed,
    #[error("login timed out")]
    Timeout,
    #[error("I/O error during login: {0}")]
    Io(#[from] std::io::Error),
    #[error("PDU error during login: {0}")]
    Pdu(#[from] pdu::DecodeError),
    #[error("login refused (status {0}/{1}): {2}")]
    Refused(u8, u8, String),
    #[error("expected a Login Request, got {0:?}")]
    NotLogin(pdu::Opcode),
}

/// Keys agreed so far.
struct Agreed {
    initiator_name: Option<String>,
    target_name: Option<String>,
    session_type: SessionType,
    auth_ok: bool,
    ops: SessionOps,
    conn: ConnOps,
}

/// Reads one Login Request.
async fn read_login(
    stream: &mut TcpStream,
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

async fn send(stream: &mut TcpStream, r: LoginResponse) -> Result<(), LoginError> {
    let e = Pdu::LoginResponse(r).encode(&Framing::default());
    crate::conn::write_batch(stream, std::slice::from_ref(&e)).await?;
    stream.flush().await?;
    Ok(())
}

fn response(
    req: &LoginRequest,
    stat_sn: u32,
    exp: u32,
    max: u32,
    st: (u8, u8),
    data: Bytes,
) -> LoginResponse {
    LoginResponse {
        transit: false,
        continue_: false,
        csg: req.csg,
        nsg: req.nsg,
        version_max: 0,
        version_active: 0,
        isid: req.isid,
        tsih: req.tsih,
        itt: req.itt,
        stat_sn,
        exp_cmd_sn: exp,
        max_cmd_sn: max,
        status_class: st.0,
        status_detail: st.1,
        data,
    }
}

/// Runs the login phase. On success the final response has not been sent yet: the caller sets
/// up the session (TSIH, reinstatement) and sends it.
pub async fn run(
    shared: &Shared,
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    portal: std::net::SocketAddr,
) -> Result<Negotiated, LoginError> {
    tokio::time::timeout(LOGIN_TIMEOUT, run_inner(shared, stream, buf, portal))
        .await
        .map_err(|_| LoginError::Timeout)?
}

async fn run_inner(
    shared: &Shared,
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    portal: std::net::SocketAddr,
) -> Result<Negotiated, LoginError> {
    let mut stat_sn: u32 = 1;
    let mut text = BytesMut::new();
    let mut agreed = Agreed {
        initiator_name: None,
        target_name: None,
        session_type: SessionType::Normal,
        auth_ok: false,
        ops: SessionOps {
            max_connections: 1,
            initial_r2t: true,
            immediate_data: true,
            first_burst_length: 65536,
            max_burst_length: 262_144,
            max_outstanding_r2t: 1,
            queue_depth: Limits::default().queue_depth,
        },
        conn: ConnOps {
            header_digest: false,
            data_digest: false,
            recv_mrdsl: 8192,
            send_mrdsl: 8192,
        },
    };
    let mut first: Option<LoginRequest> = None;
    let mut declared_mrdsl = false;
    loop {
        let req = read_login(stream, buf).await?;
        let lead = first.get_or_insert_with(|| req.clone()).clone();
        let (exp, max) = match shared.session(req.tsih) {
            Some(s) if req.tsih != 0 => s.cmd_sns(),
            _ => (
                req.cmd_sn,
                req.cmd_sn.wrapping_add(Limits::default().queue_depth - 1),
            ),
        };
        let fail = |st: (u8, u8), why: String| (st, why);
        // Version (11.12.4): mcsi speaks version 0.
        if req.version_min > 0
            || req.isid != lead.isid
            || req.tsih != lead.tsih
            || req.cid != lead.cid
        {
            let (st, why) = fail(
                status::UNSUPPORTED_VERSION,
                "version or identity changed".into(),
            );
            send(stream, response(&req, stat_sn, exp, max, st, Bytes::new())).await?;
            return Err(LoginError::Refused(st.0, st.1, why));
        }
        text.extend_from_slice(&req.data);
        if text.len() > MAX_LOGIN_TEXT {
            let st = status::INITIATOR_ERROR;
            send(stream, response(&req, stat_sn, exp, max, st, Bytes::new())).await?;
            return Err(LoginError::Refused(
                st.0,
                st.1,
                "login text too long".into(),
            ));
        }
        if req.continue_ {
            // More text follows (C bit): acknowledge with an empty response (11.12.2).
            send(
                stream,
                response(&req, stat_sn, exp, max, (0, 0), Bytes::new()),
            )
            .await?;
            stat_sn = stat_sn.wrapping_add(1);
            continue;
        }
        let pairs = crate::text::pairs(&text);
        text.clear();
        let mut answers = String::new();
        let mut refuse: Option<((u8, u8), String)> = None;
        for (k, v) in pairs {
            if let Some(a) = answer(shared, &mut agreed, &k, &v, req.csg) {
                answers.push_str(&format!("{k}={a}\0"));
            }
        }
        // The initiator name and, for a normal session, an existing target (13.3, 13.4).
        if (lead.tsih == 0 || req.csg != Stage::Security) && agreed.initiator_name.is_none() {
            refuse = Some(fail(
                status::MISSING_PARAMETER,
                "InitiatorName missing".into(),
            ));
        }
        let target = match (&agreed.session_type, &agreed.target_name) {
            (SessionType::Discovery, _) => None,
            (SessionType::Normal, Some(n)) => match shared.target(n) {
                Some(t) if t.portals.iter().any(|p| p.port() == portal.port()) => Some(t.clone()),
                _ => {
                    refuse.get_or_insert(fail(
                        status::NOT_FOUND,
                        format!("no target '{n}' on this portal"),
                    ));
                    None
                }
            },
            (SessionType::Normal, None) => {
                refuse.get_or_insert(fail(status::MISSING_PARAMETER, "TargetName missing".into()));
                None
            }
        };
        if req.csg == Stage::Security && !agreed.auth_ok {
            refuse.get_or_insert(fail(
                status::AUTH_FAILED,
                "no AuthMethod the target supports (None)".into(),
            ));
        }
        if let Some((st, why)) = refuse {
            send(stream, response(&req, stat_sn, exp, max, st, Bytes::new())).await?;
            return Err(LoginError::Refused(st.0, st.1, why));
        }
        if let Some(t) = &target {
            // Apply the target's limits to the keys the initiator did not offer.
            agreed.ops.queue_depth = t.limits.queue_depth;
            if !declared_mrdsl && req.csg == Stage::Operational {
                answers.push_str(&format!(
                    "MaxRecvDataSegmentLength={}\0",
                    t.limits.max_recv_data_segment_length
                ));
                agreed.conn.recv_mrdsl = t.limits.max_recv_data_segment_length;
                declared_mrdsl = true;
            }
        } else if !declared_mrdsl && req.csg == Stage::Operational {
            answers.push_str("MaxRecvDataSegmentLength=8192\0");
            declared_mrdsl = true;
        }
        let mut r = response(
            &req,
            stat_sn,
            exp,
            max,
            (0, 0),
            Bytes::from(answers.into_bytes()),
        );
        stat_sn = stat_sn.wrapping_add(1);
        if req.transit {
            r.transit = true;
            r.nsg = req.nsg;
            if req.nsg == Stage::FullFeature {
                return Ok(Negotiated {
                    session_type: agreed.session_type,
                    initiator_name: agreed.initiator_name.clone().unwrap_or_default(),
                    target,
                    isid: lead.isid,
                    tsih: lead.tsih,
                    cid: lead.cid,
                    session: agreed.ops,
                    conn: agreed.conn,
                    cmd_sn: lead.cmd_sn,
                    next_stat_sn: stat_sn,
                    final_response: r,
                });
            }
        }
        send(stream, r).await?;
    }
}

fn num(v: &str) -> Option<u64> {
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else {
        v.parse().ok()
    }
}

fn yes(v: &str) -> Option<bool> {
    match v {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

fn yn(b: bool) -> &'static str {
    if b {
        "Yes"
    } else {
        "No"
    }
}

/// Answers one key (None: declarative, no answer), updating what is agreed.
fn answer(shared: &Shared, a: &mut Agreed, k: &str, v: &str, stage: Stage) -> Option<String> {
    let lim = a
        .target_name
        .as_deref()
        .and_then(|n| shared.target(n))
        .map(|t| t.limits)
        .unwrap_or_default();
    let discovery = a.session_type == SessionType::Discovery;
    match k {
        "InitiatorName" => {
            a.initiator_name = Some(v.to_string());
            None
        }
        "TargetName" => {
            a.target_name = Some(v.to_string());
            None
        }
        "SessionType" => {
            a.session_type = if v == "Discovery" {
                SessionType::Discovery
            } else {
                SessionType::Normal
            };
            None
        }
        "InitiatorAlias" => None,
        "AuthMethod" => {
            if v.split(',').any(|m| m == "None") {
                a.auth_ok = true;
                Some("None".into())
            } else {
                Some("Reject".into())
            }
        }
        "HeaderDigest" | "DataDigest" => {
            let pick = if v.split(',').any(|m| m == "None") {
                "None"
            } else if v.split(',').any(|m| m == "CRC32C") {
                "CRC32C"
            } else {
                "Reject"
            };
            let on = pick == "CRC32C";
            if k == "HeaderDigest" {
                a.conn.header_digest = on;
            } else {
                a.conn.data_digest = on;
            }
            Some(pick.into())
        }
        "MaxRecvDataSegmentLength" => {
            // Declarative: the initiator's receive limit (13.12), capped to the field's range.
            a.conn.send_mrdsl = num(v).unwrap_or(8192).clamp(512, (1 << 24) - 1) as u32;
            None
        }
        _ if discovery && stage != Stage::Security && is_normal_only(k) => {
            Some("Irrelevant".into())
        }
        "MaxConnections" => {
            let n = num(v)
                .unwrap_or(1)
                .clamp(1, 65535)
                .min(u64::from(lim.max_connections)) as u16;
            a.ops.max_connections = n;
            Some(n.to_string())
        }
        "InitialR2T" => {
            let r = yes(v).unwrap_or(true) || lim.initial_r2t;
            a.ops.initial_r2t = r;
            Some(yn(r).into())
        }
        "ImmediateData" => {
            let r = yes(v).unwrap_or(false) && lim.immediate_data;
            a.ops.immediate_data = r;
            Some(yn(r).into())
        }
        "MaxBurstLength" => {
            let n = num(v)
                .unwrap_or(262_144)
                .clamp(512, (1 << 24) - 1)
                .min(u64::from(lim.max_burst_length)) as u32;
            a.ops.max_burst_length = n;
            a.ops.first_burst_length = a.ops.first_burst_length.min(n);
            Some(n.to_string())
        }
        "FirstBurstLength" => {
            let n = num(v)
                .unwrap_or(65536)
                .clamp(512, (1 << 24) - 1)
                .min(u64::from(lim.first_burst_length))
                .min(u64::from(a.ops.max_burst_length)) as u32;
            a.ops.first_burst_length = n;
            Some(n.to_string())
        }
        "MaxOutstandingR2T" => {
            let n = num(v)
                .unwrap_or(1)
                .clamp(1, 65535)
                .min(u64::from(lim.max_outstanding_r2t)) as u16;
            a.ops.max_outstanding_r2t = n;
            Some(n.to_string())
        }
        "DefaultTime2Wait" => Some(num(v).unwrap_or(2).min(3600).to_string()),
        "DefaultTime2Retain" => Some("0".into()),
        "DataPDUInOrder" | "DataSequenceInOrder" => Some("Yes".into()),
        "ErrorRecoveryLevel" => Some("0".into()),
        "TargetAlias" | "TargetAddress" | "TargetPortalGroupTag" => Some("Reject".into()),
        _ => Some("NotUnderstood".into()),
    }
}

fn is_normal_only(k: &str) -> bool {
    matches!(
        k,
        "MaxConnections"
            | "InitialR2T"
            | "ImmediateData"
            | "MaxBurstLength"
            | "FirstBurstLength"
            | "MaxOutstandingR2T"
            | "DataPDUInOrder"
            | "DataSequenceInOrder"
    )
}

/// Sends the final login response (with the session's TSIH and window).
pub async fn send_final(
    stream: &mut TcpStream,
    mut r: LoginResponse,
    tsih: u16,
    exp: u32,
    max: u32,
) -> Result<(), LoginError> {
    r.tsih = tsih;
    r.exp_cmd_sn = exp;
    r.max_cmd_sn = max;
    send(stream, r).await
}

/// Sends a refusal as the final login response.
pub async fn send_refusal(
    stream: &mut TcpStream,
    mut r: LoginResponse,
    st: (u8, u8),
) -> Result<(), LoginError> {
    r.transit = false;
    r.status_class = st.0;
    r.status_detail = st.1;
    r.data = Bytes::new();
    send(stream, r).await
}
