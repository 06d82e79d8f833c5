//! The initiator against a small scripted target on loopback that checks the rules an
//! initiator must keep: every non-immediate CmdSN inside [ExpCmdSN, MaxCmdSN] (also across the
//! 2^32 wrap), NOP-In pings answered, and a Logout after an asynchronous logout request,
//! followed by a new session that finishes the commands.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::{Bytes, BytesMut};
use mcsi_initiator::{connect, Command, ConnectOptions, DataDir, IscsiUrl};
use mcsi_proto::pdu::{
    decode, AsyncMessage, DataIn, Framing, LoginResponse, LogoutResponse, NopIn, Pdu, Stage,
    RESERVED_TAG,
};
use mcsi_proto::serial::{in_window, Sn};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Default)]
struct Seen {
    commands: AtomicU32,
    violations: Mutex<Vec<String>>,
    logins: AtomicU32,
    logouts: AtomicU32,
    nop_answers: AtomicU32,
}

struct Script {
    /// Commands the target accepts beyond ExpCmdSN - 1 (MaxCmdSN = ExpCmdSN + window - 1).
    window: u32,
    /// After this many commands on the first session, ask for logout (async event 1).
    logout_after: Option<u32>,
    /// On the first session, never answer this command (1-based), as if it were lost.
    swallow: Option<u32>,
}

async fn send(s: &mut TcpStream, p: Pdu) {
    let e = p.encode(&Framing::default());
    s.write_all(&e.to_vec()).await.unwrap();
}

async fn recv(s: &mut TcpStream, buf: &mut BytesMut, f: &Framing) -> Option<Pdu> {
    loop {
        if let Some(p) = decode(buf, f).unwrap() {
            return Some(p);
        }
        if s.read_buf(buf).await.ok()? == 0 {
            return None;
        }
    }
}

/// Answer every offered key with its value (the first one of a list): agreeable, valid for
/// list, min/max and boolean keys alike.
fn answers(data: &[u8]) -> Bytes {
    let keys = mcsi_proto::text::parse(data, &Default::default()).unwrap();
    let out: Vec<(String, String)> = keys
        .into_iter()
        .filter(|(k, _)| {
            !matches!(
                k.as_str(),
                "InitiatorName" | "TargetName" | "SessionType" | "InitiatorAlias"
            )
        })
        .map(|(k, v)| {
            let first = v.split(',').next().unwrap_or("").to_string();
            (k, first)
        })
        .collect();
    mcsi_proto::text::encode(&out)
}

async fn serve_conn(mut s: TcpStream, script: Arc<Script>, seen: Arc<Seen>, session_no: u32) {
    let f = Framing {
        max_data_segment_length: 262_144,
        ..Framing::default()
    };
    let mut buf = BytesMut::new();
    let mut stat_sn = 100u32;
    let mut exp;
    let final_response;
    // Login: agree with everything, one request per stage.
    loop {
        let Some(Pdu::LoginRequest(r)) = recv(&mut s, &mut buf, &Framing::default()).await else {
            return;
        };
        exp = r.cmd_sn;
        let done = r.transit && r.nsg == Stage::FullFeature;
        let resp = Pdu::LoginResponse(LoginResponse {
            transit: r.transit,
            continue_: false,
            csg: r.csg,
            nsg: r.nsg,
            version_max: 0,
            version_active: 0,
            isid: r.isid,
            tsih: if done { 7 } else { 0 },
            itt: r.itt,
            stat_sn,
            exp_cmd_sn: exp,
            max_cmd_sn: exp.wrapping_add(script.window).wrapping_sub(1),
            status_class: 0,
            status_detail: 0,
            data: answers(&r.data),
        });
        stat_sn = stat_sn.wrapping_add(1);
        if done {
            // The final response goes out with the first full-feature PDU (the ping below) in
            // one write, so the initiator reads both at once and must keep the ping.
            final_response = Some(resp);
            break;
        }
        send(&mut s, resp).await;
    }
    seen.logins.fetch_add(1, Ordering::SeqCst);
    let max = |e: u32| e.wrapping_add(script.window).wrapping_sub(1);
    // A ping first: the initiator must echo TTT and data in an immediate NOP-Out.
    let ping = Pdu::NopIn(NopIn {
        lun: 0,
        itt: RESERVED_TAG,
        ttt: 0x7777,
        stat_sn,
        exp_cmd_sn: exp,
        max_cmd_sn: max(exp),
        data: Bytes::from_static(b"are you there"),
    });
    let mut both = Vec::new();
    for (p, fr) in [(final_response, Framing::default()), (Some(ping), f)] {
        if let Some(p) = p {
            let e = p.encode(&fr);
            for sl in e.io_slices() {
                both.extend_from_slice(&sl);
            }
        }
    }
    if s.write_all(&both).await.is_err() {
        return;
    }
    let mut on_this_session = 0u32;
    let mut asked_logout = false;
    while let Some(p) = recv(&mut s, &mut buf, &f).await {
        match p {
            Pdu::NopOut(n) => {
                if n.ttt == 0x7777
                    && n.itt == RESERVED_TAG
                    && n.immediate
                    && &n.data[..] == b"are you there"
                {
                    seen.nop_answers.fetch_add(1, Ordering::SeqCst);
                }
            }
            Pdu::ScsiCommand(c) => {
                if !in_window(Sn(c.cmd_sn), Sn(exp), Sn(max(exp))) {
                    seen.violations.lock().unwrap().push(format!(
                        "CmdSN {:#x} outside [{exp:#x}, {:#x}]",
                        c.cmd_sn,
                        max(exp)
                    ));
                }
                seen.commands.fetch_add(1, Ordering::SeqCst);
                on_this_session += 1;
                if session_no == 0 && script.swallow == Some(on_this_session) {
                    continue;
                }
                // Hold the window shut a moment so that the initiator has to wait.
                tokio::time::sleep(Duration::from_micros(200)).await;
                exp = c.cmd_sn.wrapping_add(1);
                let len = c.expected_data_transfer_length as usize;
                send(
                    &mut s,
                    Pdu::DataIn(DataIn {
                        final_: true,
                        ack: false,
                        overflow: false,
                        underflow: false,
                        status: Some(0),
                        lun: c.lun,
                        itt: c.itt,
                        ttt: RESERVED_TAG,
                        stat_sn,
                        exp_cmd_sn: exp,
                        max_cmd_sn: max(exp),
                        data_sn: 0,
                        buffer_offset: 0,
                        residual_count: 0,
                        data: Bytes::from(vec![(c.cmd_sn & 0xff) as u8; len]),
                    }),
                )
                .await;
                stat_sn = stat_sn.wrapping_add(1);
                if session_no == 0
                    && !asked_logout
                    && script.logout_after.is_some_and(|n| on_this_session >= n)
                {
                    asked_logout = true;
                    send(
                        &mut s,
                        Pdu::AsyncMessage(AsyncMessage {
                            lun: 0,
                            stat_sn,
                            exp_cmd_sn: exp,
                            max_cmd_sn: max(exp),
                            async_event: 1,
                            async_vcode: 0,
                            parameter1: 0,
                            parameter2: 0,
                            parameter3: 2,
                            data: Bytes::new(),
                        }),
                    )
                    .await;
                    stat_sn = stat_sn.wrapping_add(1);
                }
            }
            Pdu::LogoutRequest(l) => {
                seen.logouts.fetch_add(1, Ordering::SeqCst);
                send(
                    &mut s,
                    Pdu::LogoutResponse(LogoutResponse {
                        response: 0,
                        itt: l.itt,
                        stat_sn,
                        exp_cmd_sn: exp,
                        max_cmd_sn: max(exp),
                        time2wait: 0,
                        time2retain: 0,
                    }),
                )
                .await;
                return;
            }
            other => panic!("unexpected {:?}", other.opcode()),
        }
    }
}

async fn start(script: Script) -> (u16, Arc<Seen>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Arc::new(Seen::default());
    let script = Arc::new(script);
    let sn = Arc::clone(&seen);
    tokio::spawn(async move {
        let mut n = 0;
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve_conn(s, Arc::clone(&script), Arc::clone(&sn), n));
            n += 1;
        }
    });
    (port, seen)
}

fn read_cmd(len: u32) -> Command {
    let mut cdb = vec![0u8; 16];
    cdb[0] = 0x88;
    cdb[10..14].copy_from_slice(&(len / 512).to_be_bytes());
    Command {
        lun: 0,
        cdb: cdb.into(),
        dir: DataDir::Read(len),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_of_one_across_the_wrap_and_pings_answered() {
    let (port, seen) = start(Script {
        window: 1,
        logout_after: None,
        swallow: None,
    })
    .await;
    let url = IscsiUrl::parse(&format!(
        "iscsi://127.0.0.1:{port}/iqn.2026-01.org.mcsi:fake/0"
    ))
    .unwrap();
    let s = connect(
        &url,
        ConnectOptions {
            initial_cmd_sn: 0xffff_ffc0,
            ..ConnectOptions::default()
        },
    )
    .await
    .unwrap();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let s = s.clone();
        set.spawn(async move {
            for _ in 0..10 {
                let r = s.execute(read_cmd(4096)).await.unwrap().check().unwrap();
                assert_eq!(r.data.len(), 4096);
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    assert_eq!(seen.commands.load(Ordering::SeqCst), 160);
    let v = seen.violations.lock().unwrap().clone();
    assert!(v.is_empty(), "{v:?}");
    assert_eq!(seen.nop_answers.load(Ordering::SeqCst), 1);
    let st = s.stats();
    assert!(
        st.window_waits > 0,
        "the initiator never had to wait for the window"
    );
    // 160 commands from 0xffffffc0 end past the wrap.
    assert_eq!(st.exp_cmd_sn, 0xffff_ffc0u32.wrapping_add(160));
    s.logout().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_logout_request_is_honoured_then_the_session_resumes() {
    let (port, seen) = start(Script {
        window: 8,
        logout_after: Some(40),
        swallow: None,
    })
    .await;
    let url = IscsiUrl::parse(&format!(
        "iscsi://127.0.0.1:{port}/iqn.2026-01.org.mcsi:fake/0"
    ))
    .unwrap();
    let s = connect(&url, ConnectOptions::default()).await.unwrap();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let s = s.clone();
        set.spawn(async move {
            for _ in 0..25 {
                s.execute(read_cmd(512)).await.unwrap().check().unwrap();
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    assert_eq!(seen.commands.load(Ordering::SeqCst), 200);
    assert_eq!(
        seen.logouts.load(Ordering::SeqCst),
        1,
        "no Logout after the request"
    );
    assert_eq!(
        seen.logins.load(Ordering::SeqCst),
        2,
        "no new session after the logout"
    );
    assert!(s.stats().recoveries >= 1);
    let v = seen.violations.lock().unwrap().clone();
    assert!(v.is_empty(), "{v:?}");
    s.logout().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_without_status_is_reissued_on_a_new_session() {
    let (port, seen) = start(Script {
        window: 32,
        logout_after: None,
        swallow: Some(20),
    })
    .await;
    let url = IscsiUrl::parse(&format!(
        "iscsi://127.0.0.1:{port}/iqn.2026-01.org.mcsi:fake/0"
    ))
    .unwrap();
    let s = connect(
        &url,
        ConnectOptions {
            response_timeout: Duration::from_millis(300),
            ..ConnectOptions::default()
        },
    )
    .await
    .unwrap();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let s = s.clone();
        set.spawn(async move {
            for _ in 0..25 {
                s.execute(read_cmd(512)).await.unwrap().check().unwrap();
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    assert_eq!(s.stats().recoveries, 1);
    assert_eq!(seen.logins.load(Ordering::SeqCst), 2);
    // 100 commands completed; the swallowed one went out twice.
    assert!(seen.commands.load(Ordering::SeqCst) >= 101);
    s.logout().await.unwrap();
}
