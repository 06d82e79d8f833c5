#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Limits a peer cannot exceed, over real sockets: logins per second and logins in progress
//! per source address,
//! sessions and connections per target, connections of the server, the login timeout, the
//! number of R2Ts outstanding per task (MaxOutstandingR2T) and unsolicited data beyond
//! FirstBurstLength. Each test fails if its limit is taken away. The NOP-In keepalive that drops
//! a full feature phase connection whose peer stops answering is tested in tests/loopback.rs
//! (`keepalive_pings_idle_connections_and_drops_silent_ones`).
//!
//! Limits are configured small so that the tests are quick; the checks that something did not
//! happen wait with generous margins, and waits for something that must happen poll with a
//! deadline, so that a busy machine makes the tests slower but not flaky.

mod common;

use bytes::Bytes;
use common::*;
use mcsi_proto::pdu::*;
use mcsi_target::Server;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};
use tokio::net::TcpSocket;

const OUT_OF_RESOURCES: (u8, u8) = (3, 2);
const TOO_MANY_CONNECTIONS: (u8, u8) = (2, 6);
const NORMAL: [(&str, &str); 3] = [
    ("TargetName", IQN),
    ("SessionType", "Normal"),
    ("MaxConnections", "4"),
];

fn isid(n: u16) -> [u8; 6] {
    [0x80, 0x33, 0, 0, (n >> 8) as u8, n as u8]
}

fn status(r: &LoginResponse) -> (u8, u8) {
    (r.status_class, r.status_detail)
}

/// A raw client connected from `src` (any 127/8 address reaches a loopback portal).
async fn connect_from(server: &Server, src: Ipv4Addr) -> Client {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::new(src.into(), 0)).unwrap();
    let s = sock.connect(server.local_addrs()[0]).await.unwrap();
    s.set_nodelay(true).unwrap();
    Client {
        s: Box::new(s),
        buf: Default::default(),
        framing: Framing::default(),
        cmd_sn: 1,
        itt: 1,
        tsih: 0,
        login_keys: Vec::new(),
    }
}

/// A leading login of a new session (ISID `n`) on a fresh connection; None if the target
/// closed the connection instead of answering.
async fn new_session(server: &Server, n: u16) -> (Client, Option<(u8, u8)>) {
    let mut c = Client::connect(server).await;
    let st = c
        .try_login(isid(n), 0, 0, &NORMAL)
        .await
        .map(|r| status(&r));
    (c, st)
}

/// Another connection `cid` of the session `tsih` (ISID `n`).
async fn join(server: &Server, n: u16, tsih: u16, cid: u16) -> (Client, Option<(u8, u8)>) {
    let mut c = Client::connect(server).await;
    c.itt = u32::from(cid) << 20;
    let st = c
        .try_login(isid(n), tsih, cid, &[("TargetName", IQN)])
        .await
        .map(|r| status(&r));
    (c, st)
}

/// Repeats `attempt` until it gives `want` (a place freed by a closing session or connection
/// comes back asynchronously); panics after 10 s.
async fn eventually<F, Fut>(what: &str, want: Option<(u8, u8)>, mut attempt: F) -> Client
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = (Client, Option<(u8, u8)>)>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (c, st) = attempt().await;
        if st == want {
            return c;
        }
        assert!(Instant::now() < deadline, "{what}: still {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// TEST UNIT READY succeeds on `c` (a unit attention first is fine).
async fn serves(c: &mut Client) -> bool {
    for _ in 0..3 {
        let tur = c.command(&[0; 6], false, false, 0, Bytes::new(), true);
        let itt = tur.itt;
        c.send(Pdu::ScsiCommand(tur)).await;
        if c.read_result(itt).await.1 == 0 {
            return true;
        }
    }
    false
}

#[tokio::test]
async fn logins_beyond_the_rate_of_a_source_are_refused_out_of_resources() {
    // 1 login per second after a burst of 3.
    let server = start_with(|c| {
        c.limits.login_rate = 1;
        c.limits.login_burst = 3;
    })
    .await;
    // The burst has to be spent within a second for the fourth login to be over the rate; on a
    // machine too busy for that, try again from another source address (a bucket of its own).
    let mut checked = None;
    for round in 0..3u8 {
        let src = Ipv4Addr::new(127, 0, 0, 10 + round);
        let t0 = Instant::now();
        let mut burst = Vec::new();
        for k in 0..3u16 {
            let mut c = connect_from(&server, src).await;
            let r = c
                .login(isid(100 * u16::from(round) + k), 0, 0, &NORMAL)
                .await;
            assert_eq!(status(&r), (0, 0), "login {k} of the burst from {src}");
            burst.push(c);
        }
        let mut c = connect_from(&server, src).await;
        let st = c
            .try_login(isid(100 * u16::from(round) + 9), 0, 0, &NORMAL)
            .await
            .map(|r| status(&r));
        if st == Some(OUT_OF_RESOURCES) {
            assert!(c.closed_by_target().await, "a refused connection is closed");
            checked = Some((src, burst));
            break;
        }
        assert!(
            t0.elapsed() >= Duration::from_millis(900),
            "the fourth login from {src} in {:?} got {st:?}, not 3/02 (out of resources)",
            t0.elapsed()
        );
    }
    let (src, mut burst) = checked.expect("three rounds too slow to test the rate");
    // Sessions already in are not disturbed.
    assert!(serves(&mut burst[0]).await);
    // Another source has its own bucket.
    let mut other = connect_from(&server, Ipv4Addr::new(127, 0, 0, 50)).await;
    let r = other.login(isid(900), 0, 0, &NORMAL).await;
    assert_eq!(status(&r), (0, 0), "another source address");
    // A token comes back after a second.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut again = connect_from(&server, src).await;
    let r = again.login(isid(901), 0, 0, &NORMAL).await;
    assert_eq!(status(&r), (0, 0), "{src} after a second");
}

/// A refusal for the rate waits up to 2 s for the Login Request it answers; a source opening
/// connections much faster than the rate gets only 8 such waits at once, and the connections
/// beyond are closed right away rather than piling up.
#[tokio::test]
async fn connections_refused_for_the_rate_do_not_pile_up() {
    let server = start_with(|c| {
        c.limits.login_rate = 1;
        c.limits.login_burst = 1;
    })
    .await;
    let src = Ipv4Addr::new(127, 0, 0, 70);
    let t0 = Instant::now();
    let mut conns = Vec::new();
    for _ in 0..20 {
        conns.push(connect_from(&server, src).await);
    }
    // One connection took the token and waits in its login; eight wait to be refused (2 s);
    // the other eleven are closed at once.
    let deadline = t0 + Duration::from_secs(1);
    let mut closed = 0;
    for c in &mut conns {
        let left = deadline.saturating_duration_since(Instant::now());
        if c.closed_within(left).await {
            closed += 1;
        }
    }
    assert!(
        closed >= 11,
        "{closed} of 20 connections closed within a second"
    );
}

#[tokio::test]
async fn sessions_whose_qos_rates_do_not_fit_the_capacity_are_refused() {
    // Room for two sessions of 4 MiB/s each way in 10 MiB/s.
    let server = start_with(|c| {
        c.limits.login_rate = 0;
        c.targets[0].limits.qos = Some(mcsi_target::config::QosSpec::Rates {
            to_client: Some(4 << 20),
            to_storage: Some(4 << 20),
            burst: None,
        });
        c.targets[0].limits.qos_capacity = Some(10 << 20);
    })
    .await;
    let (mut a, st) = new_session(&server, 1).await;
    assert_eq!(st, Some((0, 0)));
    let (mut b, st) = new_session(&server, 2).await;
    assert_eq!(st, Some((0, 0)));
    let (_, st) = new_session(&server, 3).await;
    assert_eq!(st, Some(OUT_OF_RESOURCES), "a third session");
    assert!(serves(&mut a).await && serves(&mut b).await);
    // A session that ends gives its rates back.
    drop(b);
    let mut c = eventually("a session after one ended", Some((0, 0)), || {
        new_session(&server, 3)
    })
    .await;
    assert!(serves(&mut c).await);
}

#[tokio::test]
async fn an_initiator_named_in_the_qos_table_gets_its_own_rates() {
    // Only "db" is limited (4 MiB/s each way, room for two of its sessions in 10 MiB/s); the
    // other initiators are not limited and take nothing of the capacity.
    const DB: &str = "iqn.2026-01.org.mcsi:db";
    let server = start_with(|c| {
        c.limits.login_rate = 0;
        c.targets[0].limits.qos = None;
        c.targets[0].limits.qos_capacity = Some(10 << 20);
        c.targets[0].qos_initiators = vec![(
            DB.to_string(),
            mcsi_target::config::QosSpec::Rates {
                to_client: Some(4 << 20),
                to_storage: Some(4 << 20),
                burst: None,
            },
        )];
    })
    .await;
    let db = |n: u16| {
        let server = &server;
        async move {
            let mut c = Client::connect(server).await;
            let mut keys = NORMAL.to_vec();
            keys.push(("InitiatorName", DB));
            let st = c.try_login(isid(n), 0, 0, &keys).await.map(|r| status(&r));
            (c, st)
        }
    };
    let (mut a, st) = db(1).await;
    assert_eq!(st, Some((0, 0)));
    let (mut b, st) = db(2).await;
    assert_eq!(st, Some((0, 0)));
    let (_, st) = db(3).await;
    assert_eq!(st, Some(OUT_OF_RESOURCES), "db's third session");
    // Another initiator is let in: it has no QoS and reserves nothing.
    let mut others = Vec::new();
    for n in 10..13 {
        let (c, st) = new_session(&server, n).await;
        assert_eq!(st, Some((0, 0)), "session {n} of an initiator not named");
        others.push(c);
    }
    assert!(serves(&mut a).await && serves(&mut b).await);
    for c in &mut others {
        assert!(serves(c).await);
    }
}

#[tokio::test]
async fn sessions_beyond_max_sessions_are_refused_out_of_resources() {
    let server = start_with(|c| {
        c.limits.login_rate = 0;
        c.targets[0].limits.max_sessions = 2;
    })
    .await;
    let (mut a, st) = new_session(&server, 1).await;
    assert_eq!(st, Some((0, 0)));
    let (b, st) = new_session(&server, 2).await;
    assert_eq!(st, Some((0, 0)));
    let (_, st) = new_session(&server, 3).await;
    assert_eq!(st, Some(OUT_OF_RESOURCES), "a third session");
    assert!(serves(&mut a).await, "the sessions in are not disturbed");

    // Reinstating a session (same initiator port) replaces it, so it is let in at the limit.
    let (mut a2, st) = new_session(&server, 1).await;
    assert_eq!(st, Some((0, 0)), "reinstatement at the limit");
    assert!(
        a.closed_by_target().await,
        "the reinstated session's connection"
    );
    assert!(serves(&mut a2).await);

    // A session that ends makes room.
    drop(b);
    let mut c = eventually("a session after one ended", Some((0, 0)), || {
        new_session(&server, 3)
    })
    .await;
    assert!(serves(&mut c).await);

    // Logins racing for the last places: each place is given once.
    let server = start_with(|c| {
        c.limits.login_rate = 0;
        c.targets[0].limits.max_sessions = 3;
    })
    .await;
    let server = std::sync::Arc::new(server);
    let mut racers = Vec::new();
    for n in 0..12u16 {
        let server = server.clone();
        racers.push(tokio::spawn(async move { new_session(&server, n).await }));
    }
    let mut admitted = Vec::new();
    for r in racers {
        let (c, st) = r.await.unwrap();
        match st {
            Some((0, 0)) => admitted.push(c),
            Some(OUT_OF_RESOURCES) => {}
            other => panic!("racing login got {other:?}"),
        }
    }
    assert_eq!(admitted.len(), 3, "sessions let in with max_sessions = 3");
}

#[tokio::test]
async fn connections_beyond_max_target_connections_are_refused() {
    let server = start_with(|c| {
        c.limits.login_rate = 0;
        c.targets[0].limits.offer.max_connections = 4;
        c.targets[0].limits.max_target_connections = 3;
    })
    .await;
    // Session A with two connections, session B with one: the target is full.
    let (mut a0, st) = new_session(&server, 1).await;
    assert_eq!(st, Some((0, 0)));
    let (a1, st) = join(&server, 1, a0.tsih, 1).await;
    assert_eq!(st, Some((0, 0)));
    let (b0, st) = new_session(&server, 2).await;
    assert_eq!(st, Some((0, 0)));
    let tsih_b = b0.tsih;

    // Below its MaxConnections (4), a session still gets no connection beyond the target's.
    let (_, st) = join(&server, 1, a0.tsih, 2).await;
    assert_eq!(st, Some(TOO_MANY_CONNECTIONS), "A's third connection");
    let (_, st) = join(&server, 2, tsih_b, 1).await;
    assert_eq!(st, Some(TOO_MANY_CONNECTIONS), "B's second connection");
    // A new session needs a connection too.
    let (_, st) = new_session(&server, 3).await;
    assert_eq!(st, Some(OUT_OF_RESOURCES), "a new session");

    // Reinstating a connection (same CID) replaces it, so it is let in at the limit.
    let (_a1b, st) = join(&server, 1, a0.tsih, 1).await;
    assert_eq!(st, Some((0, 0)), "connection reinstatement at the limit");
    drop(a1);
    assert!(serves(&mut a0).await, "session A goes on");

    // B's connection ends (and with it B, ErrorRecoveryLevel 0): room for one connection.
    drop(b0);
    let _a2 = eventually("A's third connection once B ended", Some((0, 0)), || {
        join(&server, 1, a0.tsih, 2)
    })
    .await;
    let (_, st) = new_session(&server, 3).await;
    assert_eq!(st, Some(OUT_OF_RESOURCES), "full again");
}

#[tokio::test]
async fn server_connections_beyond_the_limit_are_closed_at_once() {
    let server = start_with(|c| {
        c.limits.login_rate = 0;
        c.limits.max_server_connections = 2;
    })
    .await;
    let (mut a, st) = new_session(&server, 1).await;
    assert_eq!(st, Some((0, 0)));
    // A connection that sends nothing holds the second place (its login has 30 s).
    let idle = Client::connect(&server).await;
    // So the third is closed right away, long before any login timeout.
    let mut third = Client::connect(&server).await;
    assert!(
        third.closed_by_target().await,
        "a connection beyond max_server_connections"
    );
    assert!(serves(&mut a).await, "the session in is not disturbed");
    drop(idle);
    let mut c = eventually(
        "a session once the idle connection left",
        Some((0, 0)),
        || new_session(&server, 2),
    )
    .await;
    assert!(serves(&mut c).await);
}

#[tokio::test]
async fn login_timeout_drops_connections_that_never_finish_logging_in() {
    let server = start_with(|c| {
        c.limits.login_rate = 0;
        c.limits.login_timeout = Duration::from_millis(500);
    })
    .await;
    // Nothing sent at all.
    let t0 = Instant::now();
    let mut silent = Client::connect(&server).await;
    assert!(silent.closed_by_target().await, "a silent connection");
    assert!(
        t0.elapsed() >= Duration::from_millis(400),
        "{:?}",
        t0.elapsed()
    );

    // One Login Request without the transit bit, answered, then nothing more.
    let t0 = Instant::now();
    let mut stalled = stalled_login(&server, Ipv4Addr::LOCALHOST, 1).await;
    assert!(stalled.closed_by_target().await, "a login that stalls");
    assert!(
        t0.elapsed() >= Duration::from_millis(400),
        "{:?}",
        t0.elapsed()
    );

    // The timeout is for the login only: a session in full feature phase outlives it.
    let mut c = Client::normal(&server, &[]).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(
        serves(&mut c).await,
        "a session older than the login timeout"
    );
}

/// A connection from `src` whose login stops after its first step (answered, so the target
/// has counted it), identified as ISID `n`.
async fn stalled_login(server: &Server, src: Ipv4Addr, n: u16) -> Client {
    let mut c = connect_from(server, src).await;
    c.send(Pdu::LoginRequest(LoginRequest {
        transit: false,
        continue_: false,
        csg: Stage::Operational,
        nsg: Stage::Operational,
        version_max: 0,
        version_min: 0,
        isid: Isid(isid(n)),
        tsih: 0,
        itt: 0,
        cid: 0,
        cmd_sn: 1,
        exp_stat_sn: 0,
        data: text(&[("InitiatorName", "iqn.2026-01.org.mcsi:slow"), NORMAL[0]]),
    }))
    .await;
    let Pdu::LoginResponse(r) = c.recv().await else {
        panic!("expected a Login Response")
    };
    assert_eq!(status(&r), (0, 0), "first step of a stalled login");
    c
}

#[tokio::test]
async fn logins_in_progress_of_one_source_are_capped_oldest_first() {
    let server = start_with(|c| {
        c.limits.login_rate = 0;
        c.limits.max_logins_per_source = 3;
    })
    .await;
    let src = Ipv4Addr::new(127, 0, 0, 60);
    // Sessions in full feature phase do not count: four of them from the source.
    let mut sessions = Vec::new();
    for k in 0..4u16 {
        let mut c = connect_from(&server, src).await;
        let r = c.login(isid(k), 0, 0, &NORMAL).await;
        assert_eq!(status(&r), (0, 0), "session {k}");
        sessions.push(c);
    }
    // Three logins left hanging take the source's places.
    let mut stalled = Vec::new();
    for k in 0..3u16 {
        stalled.push(stalled_login(&server, src, 10 + k).await);
    }
    // A login past the limit pushes the oldest hanging login out and goes through itself;
    // after another hanging login fills the place it left, the next does the same.
    for k in 0..2u16 {
        let mut c = connect_from(&server, src).await;
        let r = c.login(isid(20 + k), 0, 0, &NORMAL).await;
        assert_eq!(status(&r), (0, 0), "login {k} past the limit");
        assert!(
            stalled[usize::from(k)].closed_by_target().await,
            "hanging login {k}, the oldest, is dropped"
        );
        sessions.push(c);
        stalled.push(stalled_login(&server, src, 13 + k).await);
    }
    // The newer hanging logins stay.
    for (k, c) in stalled.iter_mut().enumerate().skip(2) {
        assert!(
            !c.closed_within(Duration::from_millis(300)).await,
            "hanging login {k}"
        );
    }
    // Another source is not affected, nor are the sessions in.
    let mut other = connect_from(&server, Ipv4Addr::new(127, 0, 0, 61)).await;
    let r = other.login(isid(30), 0, 0, &NORMAL).await;
    assert_eq!(status(&r), (0, 0), "another source address");
    for c in &mut sessions {
        assert!(serves(c).await);
    }
}

/// Sends the Data-Out an R2T asks for, from `data`.
async fn answer(c: &mut Client, r: &R2t, data: &Bytes) {
    let (o, n) = (
        r.buffer_offset as usize,
        r.desired_data_transfer_length as usize,
    );
    c.send(Pdu::DataOut(DataOut {
        final_: true,
        lun: 0,
        itt: r.itt,
        ttt: r.ttt,
        exp_stat_sn: 0,
        data_sn: 0,
        buffer_offset: r.buffer_offset,
        data: data.slice(o..o + n),
    }))
    .await;
}

async fn next_r2t(c: &mut Client) -> R2t {
    match c.recv().await {
        Pdu::R2t(r) => r,
        other => panic!("expected an R2T, got {other:?}"),
    }
}

#[tokio::test]
async fn outstanding_r2ts_never_exceed_max_outstanding_r2t() {
    let server = start_with(|c| {
        let l = &mut c.targets[0].limits;
        l.offer.max_outstanding_r2t = 2;
        l.offer.max_burst_length = 8192;
        l.offer.first_burst_length = 4096;
    })
    .await;
    // The initiator asks for more; MaxOutstandingR2T is a minimum key (RFC 7143 13.17).
    let mut c = Client::normal(
        &server,
        &[
            ("InitialR2T", "Yes"),
            ("ImmediateData", "No"),
            ("MaxBurstLength", "8192"),
            ("MaxOutstandingR2T", "8"),
        ],
    )
    .await;
    let agreed = c
        .login_keys
        .iter()
        .find(|(k, _)| k == "MaxOutstandingR2T")
        .map(|(_, v)| v.clone());
    assert_eq!(agreed.as_deref(), Some("2"));

    // 64 KiB in bursts of 8 KiB: 8 R2Ts, never more than 2 unanswered.
    let data = pattern(65536, 5);
    let cmd = c.command(
        &rw10(0x2a, 1000, 128),
        false,
        true,
        65536,
        Bytes::new(),
        true,
    );
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let mut open = vec![next_r2t(&mut c).await, next_r2t(&mut c).await];
    for (sn, r) in open.iter().enumerate() {
        let sn = sn as u32;
        assert_eq!((r.r2t_sn, r.buffer_offset), (sn, 8192 * sn));
    }
    let mut seen = 2;
    while !open.is_empty() {
        assert!(
            c.silent(250).await,
            "an R2T beyond MaxOutstandingR2T=2 with {} unanswered",
            open.len()
        );
        let r = open.remove(0);
        answer(&mut c, &r, &data).await;
        if seen < 8 {
            let n = next_r2t(&mut c).await;
            assert_eq!(
                (n.r2t_sn, n.buffer_offset, n.desired_data_transfer_length),
                (seen, 8192 * seen, 8192)
            );
            open.push(n);
            seen += 1;
        }
    }
    let (_, st, _, _, _) = c.read_result(itt).await;
    assert_eq!(st, 0);
    let cmd = c.command(
        &rw10(0x28, 1000, 128),
        true,
        false,
        65536,
        Bytes::new(),
        true,
    );
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (got, st, _, _, _) = c.read_result(itt).await;
    assert_eq!(st, 0);
    assert_eq!(&got[..], &data[..]);
}

/// A session that may send 4 KiB unsolicited (FirstBurstLength) although it asked for 64 KiB.
async fn first_burst_session(server: &Server) -> Client {
    let c = Client::normal(
        server,
        &[
            ("InitialR2T", "No"),
            ("ImmediateData", "Yes"),
            ("FirstBurstLength", "65536"),
        ],
    )
    .await;
    let agreed = c
        .login_keys
        .iter()
        .find(|(k, _)| k == "FirstBurstLength")
        .map(|(_, v)| v.clone());
    assert_eq!(agreed.as_deref(), Some("4096"), "a minimum key (13.14)");
    c
}

async fn first_burst_server() -> Server {
    start_with(|c| c.targets[0].limits.offer.first_burst_length = 4096).await
}

/// What LBA 2000.. holds, read by a new session.
async fn blocks_at_2000(server: &Server) -> Vec<u8> {
    let mut c = Client::normal_isid(server, isid(77), &[]).await;
    let cmd = c.command(&rw10(0x28, 2000, 16), true, false, 8192, Bytes::new(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (got, st, _, _, _) = c.read_result(itt).await;
    assert_eq!(st, 0);
    got
}

#[tokio::test]
async fn immediate_data_beyond_first_burst_length_is_rejected() {
    let server = first_burst_server().await;
    let mut c = first_burst_session(&server).await;
    // 8 KiB of immediate data with FirstBurstLength 4 KiB (RFC 7143 13.14).
    let cmd = c.command(
        &rw10(0x2a, 2000, 16),
        false,
        true,
        8192,
        pattern(8192, 1),
        true,
    );
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    match c.recv().await {
        Pdu::Reject(r) => {
            assert_eq!(r.reason, reject_reason::PROTOCOL_ERROR);
            assert_eq!(
                u32::from_be_bytes(r.header[16..20].try_into().unwrap()),
                itt
            );
        }
        other => panic!("expected a Reject, got {other:?}"),
    }
    // The session goes on (the command's CmdSN is used up) and nothing was written.
    assert!(serves(&mut c).await);
    assert!(blocks_at_2000(&server).await.iter().all(|&b| b == 0));
}

#[tokio::test]
async fn unsolicited_data_beyond_first_burst_length_drops_the_connection() {
    let server = first_burst_server().await;
    let mut c = first_burst_session(&server).await;
    // No immediate data, F=0: unsolicited Data-Out follows, 8 KiB where 4 KiB are allowed.
    let cmd = c.command(
        &rw10(0x2a, 2000, 32),
        false,
        true,
        16384,
        Bytes::new(),
        false,
    );
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    c.send(Pdu::DataOut(DataOut {
        final_: true,
        lun: 0,
        itt,
        ttt: RESERVED_TAG,
        exp_stat_sn: 0,
        data_sn: 0,
        buffer_offset: 0,
        data: pattern(8192, 2),
    }))
    .await;
    // A sequence error ends the connection at ErrorRecoveryLevel 0 (RFC 7143 7.1.4.1).
    assert!(c.closed_by_target().await);
    assert!(blocks_at_2000(&server).await.iter().all(|&b| b == 0));
}

/// A RAM backend whose reads take 1.5 s (on the blocking pool, where they cannot be cut short).
struct SlowReads(std::sync::Arc<dyn mcsi_scsi::backend::Backend>);

impl mcsi_scsi::backend::Backend for SlowReads {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), mcsi_scsi::backend::BackendError> {
        std::thread::sleep(std::time::Duration::from_millis(1500));
        self.0.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), mcsi_scsi::backend::BackendError> {
        self.0.write_at(offset, data)
    }
    fn flush(&self) -> Result<(), mcsi_scsi::backend::BackendError> {
        self.0.flush()
    }
    fn unmap(&self, offset: u64, len: u64) -> Result<(), mcsi_scsi::backend::BackendError> {
        self.0.unmap(offset, len)
    }
    fn mapped(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<(u64, u64, bool)>, mcsi_scsi::backend::BackendError> {
        self.0.mapped(offset, len)
    }
    fn blocking(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        "slow reads".into()
    }
}

/// Immediate task management requests bypass the CmdSN window: beyond 16 handlers waiting on
/// one session (each for the task it aborts to end), more are rejected with reason 0x06 (too
/// many immediate commands) instead of piling up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immediate_task_management_beyond_the_cap_is_rejected() {
    let slow = std::sync::Arc::new(SlowReads(
        mcsi_scsi::backend::open_backend("ram:4MiB").unwrap(),
    ));
    let server = start_with(|c| {
        c.targets[0].luns = vec![mcsi_target::config::LunSpec::new(
            slow as std::sync::Arc<dyn mcsi_scsi::backend::Backend>,
        )]
    })
    .await;
    let mut c = Client::normal(&server, &[]).await;
    // TEST UNIT READY until the power-on unit attention is gone.
    for _ in 0..3 {
        let t = c.command(&[0; 6], false, false, 0, Bytes::new(), true);
        c.send(Pdu::ScsiCommand(t)).await;
        if let Pdu::ScsiResponse(r) = c.recv().await {
            if r.status == 0 {
                break;
            }
        }
    }
    let r = c.command(&rw10(0x28, 0, 8), true, false, 4096, Bytes::new(), true);
    c.send(Pdu::ScsiCommand(r)).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let mut wire = Vec::new();
    for _ in 0..40 {
        let itt = c.next_itt();
        let t = Pdu::TaskMgmtRequest(TaskMgmtRequest {
            immediate: true,
            function: 2,
            lun: 0,
            itt,
            referenced_task_tag: RESERVED_TAG,
            cmd_sn: c.cmd_sn,
            exp_stat_sn: 0,
            ref_cmd_sn: 0,
            exp_data_sn: 0,
        });
        wire.extend_from_slice(&t.encode(&c.framing).to_vec());
    }
    tokio::io::AsyncWriteExt::write_all(&mut c.s, &wire)
        .await
        .unwrap();
    let (mut rejected, mut answered) = (0, 0);
    while rejected + answered < 40 {
        match c.recv().await {
            Pdu::Reject(r) => {
                assert_eq!(r.reason, 0x06, "too many immediate commands");
                rejected += 1;
            }
            Pdu::TaskMgmtResponse(r) => {
                assert_eq!(r.response, 0);
                answered += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    println!("40 immediate ABORT TASK SETs while a read holds them: {answered} answered, {rejected} rejected");
    assert_eq!((answered, rejected), (16, 24));
}
