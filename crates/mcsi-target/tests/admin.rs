//! Live administration of a running server (what `mcsi ctl` asks): listing its targets and
//! sessions, and ending a session with an Async Message that asks for a logout.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use mcsi_proto::pdu::Pdu;
use mcsi_target::admin::{AdminError, Ended};
use std::time::{Duration, Instant};

/// Reads until the Async Message; returns its event and Parameter3.
async fn async_message(c: &mut Client) -> (u8, u16, u32) {
    loop {
        if let Pdu::AsyncMessage(m) = c.recv().await {
            return (m.async_event, m.parameter3, m.stat_sn);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_session_is_asked_to_log_out_and_goes_when_it_does() {
    let server = start(|_| {}).await;
    let admin = server.admin();
    let mut a = Client::normal(&server, &[]).await;
    let (mut a2, _) = Client::join(&server, &a, 1).await;
    let b = Client::normal_isid(&server, [0x80, 0, 0, 0, 0, 9], &[]).await;
    let listed = admin.sessions();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed[0].connections.len(), 2);
    let t = admin.targets();
    assert_eq!(t[0].sessions, 2);
    assert_eq!(t[0].luns.len(), 1);

    let tsih = a.tsih;
    let ending = {
        let admin = admin.clone();
        tokio::spawn(async move { admin.end_session(tsih, Duration::from_secs(5)).await })
    };
    // Each connection is asked (AsyncEvent 1, Parameter3 the seconds it has), with a StatSN.
    assert_eq!(async_message(&mut a).await.0, 1);
    let (event, secs, _) = async_message(&mut a2).await;
    assert_eq!((event, secs), (1, 5));
    let t0 = Instant::now();
    let r = a.logout(0, 0).await;
    assert_eq!(r.response, 0, "the logout is accepted");
    // As an initiator does after a Logout Response: its connections close.
    drop(a);
    drop(a2);
    assert_eq!(ending.await.unwrap(), Ok(Ended::LoggedOut));
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "it went when it logged out, not at the grace's end"
    );
    // The other session was not touched.
    let left = admin.sessions();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].tsih, b.tsih);
    assert_eq!(
        admin.end_session(tsih, Duration::from_secs(1)).await,
        Err(AdminError::NoSession(tsih))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_does_not_log_out_is_dropped_at_the_end_of_its_grace() {
    let server = start(|_| {}).await;
    let admin = server.admin();
    let mut a = Client::normal(&server, &[]).await;
    let t0 = Instant::now();
    let ending = {
        let admin = admin.clone();
        let tsih = a.tsih;
        tokio::spawn(async move { admin.end_session(tsih, Duration::from_secs(1)).await })
    };
    assert_eq!(async_message(&mut a).await.0, 1);
    // The initiator ignores it.
    assert!(
        a.closed_by_target().await,
        "the target drops the connection"
    );
    assert_eq!(ending.await.unwrap(), Ok(Ended::Dropped));
    assert!(t0.elapsed() >= Duration::from_secs(1));
    assert!(admin.sessions().is_empty());
}

/// Runs a non-data command (TEST UNIT READY) or a read of `alloc` bytes on `lun`; returns the
/// status and the sense's (ASC, ASCQ) when there is one, and the data.
async fn run(c: &mut Client, lun: u16, cdb: &[u8], alloc: u32) -> (u8, Option<(u8, u8)>, Vec<u8>) {
    let mut cmd = c.command(cdb, alloc > 0, false, alloc, bytes::Bytes::new(), true);
    cmd.lun = mcsi_scsi::lun::encode(lun);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let mut data = Vec::new();
    loop {
        match c.recv().await {
            Pdu::DataIn(d) if d.itt == itt => {
                data.extend_from_slice(&d.data);
                if let Some(s) = d.status {
                    return (s, None, data);
                }
            }
            Pdu::ScsiResponse(r) if r.itt == itt => {
                // Fixed or descriptor format: ASC/ASCQ at 12/13 or 2/3.
                let s = &r.sense;
                let code = s.first().map(|b| b & 0x7f);
                let sense = match code {
                    Some(0x70 | 0x71) if s.len() >= 14 => Some((s[12], s[13])),
                    Some(0x72 | 0x73) if s.len() >= 4 => Some((s[2], s[3])),
                    _ => None,
                };
                return (r.status, sense, data);
            }
            _ => {}
        }
    }
}

const TUR: [u8; 6] = [0; 6];
const REPORTED_LUNS_CHANGED: Option<(u8, u8)> = Some((0x3F, 0x0E));

fn report_luns_cdb() -> Vec<u8> {
    let mut c = vec![0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    c[6..10].copy_from_slice(&4096u32.to_be_bytes());
    c
}

/// The LUN numbers REPORT LUNS lists.
async fn reported(c: &mut Client) -> Vec<u16> {
    let (status, _, d) = run(c, 0, &report_luns_cdb(), 4096).await;
    assert_eq!(status, 0);
    d[8..]
        .chunks(8)
        .map(|e| mcsi_scsi::lun::decode(u64::from_be_bytes(e.try_into().unwrap())).unwrap())
        .collect()
}

/// Until the unit attention of power-on is taken.
async fn settle(c: &mut Client, lun: u16) {
    for _ in 0..4 {
        if run(c, lun, &TUR, 0).await.0 == 0 {
            return;
        }
    }
    panic!("LUN {lun} never became ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lun_added_and_removed_live_is_announced_and_nothing_else_changes() {
    let server = start(|_| {}).await;
    let admin = server.admin();
    let mut a = Client::normal(&server, &[]).await;
    settle(&mut a, 0).await;
    assert_eq!(reported(&mut a).await, vec![0]);

    admin
        .add_lun(None, 3, "ram:8MiB,block_size=4096")
        .await
        .unwrap();
    // The session's next command to LUN 0 is told, once; REPORT LUNS lists the new LUN.
    assert_eq!(run(&mut a, 0, &TUR, 0).await.1, REPORTED_LUNS_CHANGED);
    assert_eq!(run(&mut a, 0, &TUR, 0).await.0, 0);
    assert_eq!(reported(&mut a).await, vec![0, 3]);
    settle(&mut a, 3).await;
    let (status, _, d) = run(&mut a, 3, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], 8).await;
    assert_eq!(status, 0);
    assert_eq!(
        u32::from_be_bytes(d[4..8].try_into().unwrap()),
        4096,
        "the block size asked for"
    );
    let views = admin.targets();
    assert_eq!(
        views[0].luns.iter().map(|l| l.lun).collect::<Vec<_>>(),
        vec![0, 3]
    );

    // Refusals change nothing and tell no one.
    let in_use = admin.add_lun(None, 3, "ram:1MiB").await.unwrap_err();
    assert!(
        matches!(in_use, AdminError::LunInUse { lun: 3, .. }),
        "{in_use}"
    );
    let bad = admin.add_lun(None, 4, "rom:1MiB").await.unwrap_err();
    assert!(
        matches!(&bad, AdminError::BadSpec(w) if w.contains("unknown backend")),
        "{bad}"
    );
    let missing = admin
        .add_lun(None, 4, "file:/nonexistent/dir/x.img")
        .await
        .unwrap_err();
    assert!(
        matches!(missing, AdminError::Backend { lun: 4, .. }),
        "{missing}"
    );
    let nobody = admin
        .add_lun(Some("iqn.2026-01.org.mcsi:nobody"), 4, "ram:1MiB")
        .await
        .unwrap_err();
    assert!(matches!(nobody, AdminError::NoTarget(_)), "{nobody}");
    assert_eq!(
        admin.remove_lun(None, 9).await.unwrap_err().to_string(),
        format!("target {IQN}: no LUN 9")
    );
    assert_eq!(
        run(&mut a, 0, &TUR, 0).await.0,
        0,
        "no unit attention for what did not change"
    );
    assert_eq!(reported(&mut a).await, vec![0, 3]);

    admin.remove_lun(None, 3).await.unwrap();
    assert_eq!(run(&mut a, 0, &TUR, 0).await.1, REPORTED_LUNS_CHANGED);
    assert_eq!(reported(&mut a).await, vec![0]);
    let (status, sense, _) = run(&mut a, 3, &TUR, 0).await;
    assert_eq!(
        (status, sense),
        (2, Some((0x25, 0))),
        "the removed LUN answers as absent"
    );
    assert_eq!(admin.sessions().len(), 1, "the session lives on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_running_on_a_removed_lun_finishes_on_it() {
    let server = start(|_| {}).await;
    let admin = server.admin();
    admin
        .add_lun(None, 1, "ram:8MiB,service_time=2s")
        .await
        .unwrap();
    let mut a = Client::normal(&server, &[]).await;
    settle(&mut a, 1).await;
    // A read that takes 2 s is under way when its LUN goes; the removal waits for it before
    // the flush.
    let mut cmd = a.command(
        &rw10(0x28, 0, 8),
        true,
        false,
        4096,
        bytes::Bytes::new(),
        true,
    );
    cmd.lun = mcsi_scsi::lun::encode(1);
    let itt = cmd.itt;
    a.send(Pdu::ScsiCommand(cmd)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let removing = {
        let admin = admin.clone();
        tokio::spawn(async move { admin.remove_lun(None, 1).await })
    };
    let (data, status, ..) = a.read_result(itt).await;
    assert_eq!(
        (status, data.len()),
        (0, 4096),
        "the read finished on the removed unit"
    );
    removing.await.unwrap().unwrap();
    let (status, sense, _) = run(&mut a, 1, &TUR, 0).await;
    assert_eq!((status, sense), (2, Some((0x25, 0))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_changes_what_differs_or_nothing() {
    let cfg = config(|_| {});
    let server = mcsi_target::Server::start(&cfg).await.unwrap();
    let admin = server.admin();
    assert_eq!(
        admin.apply(&cfg).await.unwrap(),
        Default::default(),
        "the same file: no change"
    );

    let mut next = cfg.clone();
    next.targets[0]
        .luns
        .push(mcsi_target::config::LunSpec::new("ram:4MiB"));
    next.targets[0].auth.allow_initiators = vec!["iqn.2026-01.org.mcsi:only".into()];
    let c = admin.apply(&next).await.unwrap();
    assert_eq!(c.luns_added, vec![(IQN.to_string(), 1)]);
    assert_eq!(c.access_changed, vec![IQN.to_string()]);
    assert_eq!(
        admin.targets()[0].allowed_initiators,
        vec!["iqn.2026-01.org.mcsi:only".to_string()]
    );

    // Refused whole: a LUN that cannot open beside an access change and a new target; a
    // portal that cannot bind beside a new target; a server-wide setting.
    let mut bad = next.clone();
    bad.targets[0]
        .luns
        .push(mcsi_target::config::LunSpec::new("file:/nonexistent/x.img"));
    bad.targets[0].auth.allow_initiators.clear();
    let mut t2 = next.targets[0].clone();
    t2.iqn = "iqn.2026-01.org.mcsi:second".into();
    bad.targets.push(t2.clone());
    assert!(matches!(
        admin.apply(&bad).await,
        Err(AdminError::Backend { lun: 2, .. })
    ));
    let mut unbound = next.clone();
    // TEST-NET-1: no interface of this host has it.
    t2.portals = vec!["192.0.2.1:3260".parse().unwrap()];
    unbound.targets.push(t2);
    assert!(
        matches!(admin.apply(&unbound).await, Err(AdminError::Listen { addr, .. }) if addr.port() == 3260),
    );
    let mut wide = next.clone();
    wide.mptcp = !wide.mptcp;
    assert!(
        matches!(admin.apply(&wide).await, Err(AdminError::NeedsRestart(w)) if w.contains("mptcp"))
    );
    assert_eq!(admin.targets().len(), 1, "no target added");
    let mut changed = next.clone();
    changed.targets[0].luns[1] = mcsi_target::config::LunSpec::new("ram:8MiB");
    assert!(
        matches!(admin.apply(&changed).await, Err(AdminError::BadSpec(w)) if w.contains("changed in place"))
    );
    let t = &admin.targets()[0];
    assert_eq!(t.luns.len(), 2, "nothing changed");
    assert_eq!(t.allowed_initiators.len(), 1, "nothing changed");

    // Back to the first file: LUN 1 goes, the target is open again.
    let c = admin.apply(&cfg).await.unwrap();
    assert_eq!(c.luns_removed, vec![(IQN.to_string(), 1)]);
    assert!(admin.targets()[0].allowed_initiators.is_empty());
}

/// The one target's TCP portal, as bound.
fn portal_of(admin: &mcsi_target::admin::Admin, name: &str) -> Vec<std::net::SocketAddr> {
    admin
        .targets()
        .into_iter()
        .find(|t| t.name == name)
        .map(|t| t.portals.iter().map(|p| p.parse().unwrap()).collect())
        .unwrap_or_default()
}

/// A login to `target` at `addr`: its status class and detail, or None if the connection was
/// refused or closed.
async fn login_at(addr: std::net::SocketAddr, target: &str) -> Option<(u8, u8)> {
    let mut c = Client::at(addr).await.ok()?;
    let r = c
        .try_login(
            [0x80, 7, 7, 7, 7, 7],
            0,
            0,
            &[("TargetName", target), ("SessionType", "Normal")],
        )
        .await?;
    Some((r.status_class, r.status_detail))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_and_portals_come_and_go_while_sessions_of_others_run() {
    const SECOND: &str = "iqn.2026-01.org.mcsi:second";
    let server = start(|_| {}).await;
    let admin = server.admin();
    let mut a = Client::normal(&server, &[]).await;
    let first = server.local_addrs()[0];

    // A second target on a portal of its own (127.0.0.2, port chosen by the kernel).
    let mut spec = server_config_target(SECOND);
    spec.portals = vec!["127.0.0.2:0".parse().unwrap()];
    let c = admin.add_target(spec.clone()).await.unwrap();
    assert_eq!(c.targets_added, vec![SECOND.to_string()]);
    let p2 = portal_of(&admin, SECOND)[0];
    assert_eq!(p2.ip().to_string(), "127.0.0.2");
    assert_ne!(p2.port(), 0, "the portal lists the port it got");
    assert_eq!(login_at(p2, SECOND).await, Some((0, 0)));
    // Each target only at its portals.
    assert_eq!(login_at(p2, IQN).await, Some((2, 3)));
    assert_eq!(login_at(first, SECOND).await, Some((2, 3)));
    assert_eq!(
        admin.add_target(spec).await.unwrap_err(),
        AdminError::TargetExists(SECOND.into())
    );

    // The first target gains that portal too, then loses it again.
    admin
        .add_portal(Some(IQN), "127.0.0.2:0".parse().unwrap())
        .await
        .unwrap();
    assert_eq!(login_at(p2, IQN).await, Some((0, 0)));
    admin
        .remove_portal(Some(IQN), "127.0.0.2:0".parse().unwrap())
        .await
        .unwrap();
    assert_eq!(login_at(p2, IQN).await, Some((2, 3)));
    assert!(matches!(
        admin.remove_portal(Some(IQN), "127.0.0.1:0".parse().unwrap()).await,
        Err(AdminError::BadSpec(w)) if w.contains("last portal")
    ));

    // The second target goes: its session is asked to log out, and dropped after the grace;
    // its portal closes, as no other target has it.
    let mut s2 = Client::at(p2).await.unwrap();
    let r = s2
        .login(
            [0x80, 8, 8, 8, 8, 8],
            0,
            0,
            &[("TargetName", SECOND), ("SessionType", "Normal")],
        )
        .await;
    assert_eq!(r.status_class, 0);
    let t0 = Instant::now();
    admin
        .remove_target(SECOND, Duration::from_secs(1))
        .await
        .unwrap();
    assert!(t0.elapsed() >= Duration::from_secs(1), "it had its grace");
    assert_eq!(async_message(&mut s2).await.0, 1, "asked to log out");
    assert!(s2.closed_within(Duration::from_secs(2)).await);
    assert!(
        tokio::net::TcpStream::connect(p2).await.is_err(),
        "the portal closed"
    );
    assert_eq!(
        admin.remove_target(SECOND, Duration::from_secs(1)).await,
        Err(AdminError::NoTarget(SECOND.into()))
    );
    assert_eq!(admin.targets().len(), 1);

    // The first target's session ran throughout.
    let (status, _, _) = run(&mut a, 0, &TUR, 0).await;
    assert_eq!(status, 0);
}

/// A target like the test server's, named `name`.
fn server_config_target(name: &str) -> mcsi_target::config::TargetSpec {
    let mut t = config(|_| {}).targets[0].clone();
    t.iqn = name.into();
    t
}

/// The race of a reload with another change: the reload has read its file and not yet applied
/// it when `mcsi ctl` asks for a change (or a save). The change waits until the reload has
/// applied what it read, so neither undoes the other unseen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_reads_its_file_under_the_lock_other_changes_take() {
    let cfg = config(|_| {});
    let server = mcsi_target::Server::start(&cfg).await.unwrap();
    let admin = server.admin();
    let (reading_tx, reading_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let reloading = {
        let (admin, cfg) = (admin.clone(), cfg.clone());
        tokio::spawn(async move {
            admin
                .reload(move || {
                    reading_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                    Ok::<_, String>(cfg)
                })
                .await
        })
    };
    tokio::task::spawn_blocking(move || reading_rx.recv().unwrap())
        .await
        .unwrap();
    let adding = {
        let admin = admin.clone();
        tokio::spawn(async move { admin.add_lun(None, 1, "ram:4MiB").await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !adding.is_finished(),
        "a change came between the reload's read and its apply"
    );
    go_tx.send(()).unwrap();
    assert_eq!(
        reloading.await.unwrap().unwrap().unwrap(),
        Default::default()
    );
    adding.await.unwrap().unwrap();
    assert_eq!(admin.targets()[0].luns.len(), 2, "the change came after");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_luns_with_one_identity_are_refused() {
    let cfg = config(|_| {});
    let server = mcsi_target::Server::start(&cfg).await.unwrap();
    let admin = server.admin();
    let mut next = cfg.clone();
    let naa = mcsi_target::config::parse_naa("6000000000000000000000000000abcd").unwrap();
    for _ in 0..2 {
        let mut l = mcsi_target::config::LunSpec::new("ram:4MiB");
        l.naa = Some(naa);
        next.targets[0].luns.push(l);
    }
    assert!(matches!(
        admin.apply(&next).await,
        Err(AdminError::BadSpec(w)) if w.contains("an identity names one LUN")
    ));
    assert_eq!(admin.targets()[0].luns.len(), 1, "nothing changed");
}

/// A target is reached at its own portals: on a socket it shares with another target, a login
/// to it on an address it no longer has is refused, though it has another on the same port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_portal_taken_from_a_target_refuses_it_though_the_socket_stays() {
    const SECOND: &str = "iqn.2026-01.org.mcsi:second";
    let server = start(|_| {}).await;
    let admin = server.admin();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let shared: std::net::SocketAddr = format!("127.0.0.3:{port}").parse().unwrap();
    let own: std::net::SocketAddr = format!("127.0.0.4:{port}").parse().unwrap();
    let mut spec = server_config_target(SECOND);
    spec.portals = vec![shared];
    admin.add_target(spec).await.unwrap();
    admin.add_portal(Some(IQN), own).await.unwrap();
    admin.add_portal(Some(IQN), shared).await.unwrap();
    assert_eq!(login_at(shared, IQN).await, Some((0, 0)));
    admin.remove_portal(Some(IQN), shared).await.unwrap();
    assert_eq!(
        login_at(shared, IQN).await,
        Some((2, 3)),
        "not its portal any more"
    );
    assert_eq!(login_at(own, IQN).await, Some((0, 0)));
    assert_eq!(login_at(shared, SECOND).await, Some((0, 0)));
}

/// REPORT TARGET PORT GROUPS on `lun`: (group, state code) of each descriptor.
async fn port_group_states(c: &mut Client, lun: u16) -> Vec<(u16, u8)> {
    let (status, sense, d) = run(c, lun, &[0xA3, 0x0A, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], 256).await;
    assert_eq!(status, 0, "REPORT TARGET PORT GROUPS: {sense:02x?}");
    let mut out = Vec::new();
    let mut i = 4;
    while i + 8 <= d.len() {
        out.push((u16::from_be_bytes([d[i + 2], d[i + 3]]), d[i] & 0x0F));
        i += 8 + 4 * d[i + 7] as usize;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_group_states_change_live_and_each_lun_tells_its_sessions() {
    use mcsi_scsi::alua::{AccessState, Alua, PortGroup};
    // This gateway is port 2 of group 20; the other gateway (port 1, group 10) is elsewhere.
    let groups = |ours: AccessState, theirs: AccessState| {
        Some(
            Alua::new(vec![
                PortGroup {
                    id: 10,
                    state: theirs,
                    preferred: false,
                    ports: vec![1],
                },
                PortGroup {
                    id: 20,
                    state: ours,
                    preferred: false,
                    ports: vec![2],
                },
            ])
            .unwrap(),
        )
    };
    let mut cfg = config(|_| {});
    cfg.targets[0].tpgt = 2;
    cfg.targets[0].alua = groups(
        AccessState::ActiveNonOptimized,
        AccessState::ActiveOptimized,
    );
    let server = mcsi_target::Server::start(&cfg).await.unwrap();
    let admin = server.admin();
    let mut c = Client::normal(&server, &[]).await;
    settle(&mut c, 0).await;
    assert_eq!(port_group_states(&mut c, 0).await, vec![(10, 0), (20, 1)]);
    let (_, _, inq) = run(&mut c, 0, &[0x12, 0, 0, 0, 96, 0], 96).await;
    assert_eq!((inq[5] >> 4) & 3, 1, "TPGS: implicit ALUA");

    // Failover: the other gateway goes unavailable and this one becomes active/optimized;
    // a LUN is added at the same time and has the same groups.
    let mut next = cfg.clone();
    next.targets[0].alua = groups(AccessState::ActiveOptimized, AccessState::Unavailable);
    next.targets[0]
        .luns
        .push(mcsi_target::config::LunSpec::new("ram:4MiB"));
    let ch = admin.apply(&next).await.unwrap();
    assert_eq!(ch.port_groups_changed, vec![IQN.to_string()]);
    assert_eq!(ch.luns_added, vec![(IQN.to_string(), 1)]);
    // Each unit attention once: the LUN inventory's and the states'.
    let mut told = Vec::new();
    for _ in 0..4 {
        match run(&mut c, 0, &TUR, 0).await {
            (0, _, _) => break,
            (_, sense, _) => told.push(sense),
        }
    }
    told.sort();
    assert_eq!(told, vec![Some((0x2A, 0x06)), REPORTED_LUNS_CHANGED]);
    assert_eq!(port_group_states(&mut c, 0).await, vec![(10, 3), (20, 0)]);
    settle(&mut c, 1).await;
    assert_eq!(port_group_states(&mut c, 1).await, vec![(10, 3), (20, 0)]);

    // This gateway to standby: media access refused, the session stays.
    let mut standby = next.clone();
    standby.targets[0].alua = groups(AccessState::Standby, AccessState::ActiveOptimized);
    admin.apply(&standby).await.unwrap();
    assert_eq!(run(&mut c, 0, &TUR, 0).await.1, Some((0x2A, 0x06)));
    let (s, sense, _) = run(&mut c, 0, &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], 512).await;
    assert_eq!(
        (s, sense),
        (2, Some((0x04, 0x0B))),
        "TARGET PORT IN STANDBY STATE"
    );
    // The same again changes nothing; a changed portal group tag is refused.
    assert!(admin
        .apply(&standby)
        .await
        .unwrap()
        .port_groups_changed
        .is_empty());
    let mut moved = standby.clone();
    moved.targets[0].tpgt = 3;
    assert!(
        matches!(admin.apply(&moved).await, Err(AdminError::BadSpec(w)) if w.contains("portal_group_tag"))
    );
}

/// WRITE(10) of one 512-byte block at LBA 0 of `lun`, its data sent with the command.
async fn write0(c: &mut Client, lun: u16, fill: u8) -> u8 {
    let cdb = [0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    let mut cmd = c.command(
        &cdb,
        false,
        true,
        512,
        bytes::Bytes::from(vec![fill; 512]),
        true,
    );
    cmd.lun = mcsi_scsi::lun::encode(lun);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    loop {
        match c.recv().await {
            Pdu::ScsiResponse(r) if r.itt == itt => return r.status,
            Pdu::R2t(_) => panic!("the write's data went with it"),
            _ => {}
        }
    }
}

/// The first byte of LBA 0 of `lun`.
async fn read0(c: &mut Client, lun: u16) -> Result<u8, Option<(u8, u8)>> {
    match run(c, lun, &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], 512).await {
        (0, _, d) => Ok(d[0]),
        (_, sense, _) => Err(sense),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_with_a_lun_map_sees_its_luns_under_its_numbers_only() {
    const HOST: &str = "iqn.2026-01.org.mcsi:host1";
    let mut cfg = config(|_| {});
    cfg.targets[0].luns = (0..3)
        .map(|_| mcsi_target::config::LunSpec::new("ram:1MiB"))
        .collect();
    // host1 sees the target's LUN 2 as its LUN 0 and LUN 1 as its LUN 5, and nothing else.
    cfg.targets[0].lun_maps = vec![mcsi_target::config::LunMap {
        initiator: HOST.into(),
        luns: [(0, 2), (5, 1)].into_iter().collect(),
    }];
    let server = mcsi_target::Server::start(&cfg).await.unwrap();
    let admin = server.admin();
    let mut all = Client::normal(&server, &[]).await;
    let mut host =
        Client::normal_isid(&server, [0x80, 9, 9, 9, 9, 9], &[("InitiatorName", HOST)]).await;
    for (c, luns) in [(&mut all, [0u16, 1, 2].as_slice()), (&mut host, &[0, 5])] {
        for &l in luns {
            settle(c, l).await;
        }
    }
    assert_eq!(reported(&mut all).await, vec![0, 1, 2]);
    assert_eq!(reported(&mut host).await, vec![0, 5]);
    assert_eq!(write0(&mut all, 1, 0x11).await, 0);
    assert_eq!(write0(&mut all, 2, 0x22).await, 0);
    assert_eq!(
        read0(&mut host, 0).await,
        Ok(0x22),
        "host1's LUN 0 is the target's LUN 2"
    );
    assert_eq!(
        read0(&mut host, 5).await,
        Ok(0x11),
        "host1's LUN 5 is the target's LUN 1"
    );
    assert_eq!(write0(&mut host, 5, 0x55).await, 0);
    assert_eq!(read0(&mut all, 1).await, Ok(0x55));
    // A LUN it is not mapped to is not there for it: LOGICAL UNIT NOT SUPPORTED, and INQUIRY
    // says no unit (peripheral qualifier 011b).
    let commands = |lun: u16| -> u64 {
        let want = format!("lun=\"{lun}\"");
        server
            .metrics_text()
            .lines()
            .find(|l| l.starts_with("mcsi_target_lun_commands_total{") && l.contains(&want))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    let before = (commands(1), commands(2));
    assert_eq!(read0(&mut host, 1).await, Err(Some((0x25, 0x00))));
    assert_eq!(read0(&mut host, 2).await, Err(Some((0x25, 0x00))));
    // Those went to numbers host1's map does not name: no LUN of the target counts them.
    assert_eq!((commands(1), commands(2)), before);
    assert_eq!(read0(&mut host, 5).await, Ok(0x55));
    assert_eq!(
        commands(1),
        before.0 + 1,
        "host1's LUN 5 counts as the target's LUN 1"
    );
    let (s, _, inq) = run(&mut host, 2, &[0x12, 0, 0, 0, 36, 0], 36).await;
    assert_eq!((s, inq[0]), (0, 0x7F));

    // LUN RESET of host1's LUN 0 resets the target's LUN 2: the other initiator sees it there
    // (a unit attention), not on LUN 1.
    let tmf = Pdu::TaskMgmtRequest(mcsi_proto::pdu::TaskMgmtRequest {
        immediate: true,
        function: 5,
        lun: mcsi_scsi::lun::encode(0),
        itt: 900,
        referenced_task_tag: 0xFFFF_FFFF,
        cmd_sn: host.cmd_sn,
        exp_stat_sn: 0,
        ref_cmd_sn: host.cmd_sn,
        exp_data_sn: 0,
    });
    host.send(tmf).await;
    let Pdu::TaskMgmtResponse(r) = host.recv().await else {
        panic!("no answer to LUN RESET")
    };
    assert_eq!(r.response, 0);
    assert_eq!(run(&mut all, 1, &TUR, 0).await.0, 0, "LUN 1 was not reset");
    let (s, sense, _) = run(&mut all, 2, &TUR, 0).await;
    assert_eq!((s, sense.map(|x| x.0)), (2, Some(0x29)), "LUN 2 was reset");
    // A TARGET WARM RESET from host1 would reach LUNs it does not see: refused (function
    // authorization failed), and LUN 1 untouched.
    host.send(Pdu::TaskMgmtRequest(mcsi_proto::pdu::TaskMgmtRequest {
        immediate: true,
        function: 6,
        lun: 0,
        itt: 901,
        referenced_task_tag: 0xFFFF_FFFF,
        cmd_sn: host.cmd_sn,
        exp_stat_sn: 0,
        ref_cmd_sn: host.cmd_sn,
        exp_data_sn: 0,
    }))
    .await;
    let Pdu::TaskMgmtResponse(r) = host.recv().await else {
        panic!("no answer to TARGET WARM RESET")
    };
    assert_eq!(r.response, 6);
    assert_eq!(run(&mut all, 1, &TUR, 0).await.0, 0, "LUN 1 was not reset");

    // The target's LUN 2 removed and added back live: host1 is told and sees it go and come
    // back as its LUN 0.
    admin.remove_lun(None, 2).await.unwrap();
    assert_eq!(run(&mut host, 5, &TUR, 0).await.1, REPORTED_LUNS_CHANGED);
    assert_eq!(reported(&mut host).await, vec![5]);
    admin.add_lun(None, 2, "ram:1MiB").await.unwrap();
    assert_eq!(run(&mut host, 5, &TUR, 0).await.1, REPORTED_LUNS_CHANGED);
    assert_eq!(reported(&mut host).await, vec![0, 5]);
    settle(&mut host, 0).await;
    assert_eq!(read0(&mut host, 0).await, Ok(0x00), "a new unit: zeros");

    // The maps change live (a reload or `mcsi ctl` applies them this way). host1's map in
    // place: it now sees the target's LUN 1 as its LUN 0 and LUN 0 as its LUN 3.
    let mut next = cfg.clone();
    next.targets[0].lun_maps[0].luns = [(0, 1), (3, 0)].into_iter().collect();
    let c = admin.apply(&next).await.unwrap();
    assert_eq!(c.lun_maps_changed, [cfg.targets[0].iqn.clone()]);
    assert!(
        unit_attentions(&mut host, 0).await.contains(&(0x3F, 0x0E)),
        "host1 was not told its LUNs changed"
    );
    assert_eq!(reported(&mut host).await, vec![0, 3]);
    assert_eq!(
        read0(&mut host, 0).await,
        Ok(0x55),
        "host1's LUN 0 is now LUN 1"
    );
    assert_eq!(read0(&mut host, 5).await, Err(Some((0x25, 0x00))));
    // The map goes: host1's session sees the whole target at its next command.
    let mut bare = next.clone();
    bare.targets[0].lun_maps.clear();
    admin.apply(&bare).await.unwrap();
    assert!(unit_attentions(&mut host, 1).await.contains(&(0x3F, 0x0E)));
    assert_eq!(reported(&mut host).await, vec![0, 1, 2]);
    assert_eq!(read0(&mut host, 1).await, Ok(0x55));
    // A map for the other initiator, logged in without one: its session is held to it now.
    let mut other = bare.clone();
    other.targets[0].lun_maps = vec![mcsi_target::config::LunMap {
        initiator: "iqn.2026-01.org.mcsi:client".into(),
        luns: [(7, 1)].into_iter().collect(),
    }];
    admin.apply(&other).await.unwrap();
    assert!(unit_attentions(&mut all, 7).await.contains(&(0x3F, 0x0E)));
    assert_eq!(reported(&mut all).await, vec![7]);
    assert_eq!(read0(&mut all, 7).await, Ok(0x55));
    assert_eq!(read0(&mut all, 0).await, Err(Some((0x25, 0x00))));
    // And what runs is what a save writes.
    let shown = admin.targets();
    assert_eq!(shown[0].lun_maps.len(), 1);
    assert_eq!(shown[0].lun_maps[0].luns, vec![(7, 1)]);
}

/// The unit attentions `lun` gives until a TEST UNIT READY is GOOD.
async fn unit_attentions(c: &mut Client, lun: u16) -> Vec<(u8, u8)> {
    let mut seen = Vec::new();
    for _ in 0..6 {
        match run(c, lun, &TUR, 0).await {
            (0, _, _) => return seen,
            (_, Some(s), _) => seen.push(s),
            other => panic!("LUN {lun}: {other:?}"),
        }
    }
    panic!("LUN {lun} never became ready: {seen:02x?}");
}
