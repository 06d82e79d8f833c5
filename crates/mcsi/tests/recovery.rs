//! ErrorRecoveryLevel 1 end to end: mcsi's initiator and `mcsi target` with CRC32C digests,
//! through a relay that spoils the data of every Nth Data-In and Data-Out after its digest was
//! computed. Each loss is asked for again (a Data SNACK one way, a recovery R2T the other), the
//! data arrives whole, and the session never goes down. At level 0 the same damage costs a
//! session recovery each time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use bytes::Bytes;
use mcsi_initiator::{connect, ConnectOptions, IscsiUrl};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const IQN: &str = "iqn.2026-01.org.mcsi:recovery-test";

/// `mcsi target` taking data segments of at most 8 KiB, so that a 256 KiB write travels in
/// 32 PDUs; stopped when dropped.
struct Target {
    child: std::process::Child,
    port: u16,
    /// Its Prometheus endpoint.
    metrics: String,
    _dir: tempfile::TempDir,
}

impl Target {
    fn start() -> Target {
        let port = common::free_port();
        let metrics = format!("127.0.0.1:{}", common::free_port());
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("target.toml");
        std::fs::write(
            &cfg,
            format!(
                "listen = [\"127.0.0.1:{port}\"]\n[[targets]]\niqn = \"{IQN}\"\nmax_recv_data_segment_length = \"8KiB\"\nluns = [{{ backend = \"ram:64MiB\" }}]\n"
            ),
        )
        .unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_mcsi"))
            .args(["target", "--metrics", &metrics, "--config"])
            .arg(&cfg)
            .env("MCSI_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        common::wait_listening(port);
        Target {
            child,
            port,
            metrics,
            _dir: dir,
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the relay spoiled.
#[derive(Default)]
struct Spoiled {
    data_in: AtomicU64,
    data_out: AtomicU64,
}

/// Forwards one direction PDU by PDU, flipping a data byte of every `every`th PDU with opcode
/// `opcode` once the session is in full feature phase (`ffp`, digests on: 4 bytes after the
/// header and after the padded data). `login_end`: this direction carries the final Login
/// Response, after which both directions are in full feature phase.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    ffp: Arc<AtomicBool>,
    login_end: bool,
    opcode: u8,
    every: u64,
    spoiled: Arc<Spoiled>,
) {
    let mut buf = Vec::new();
    let mut seen = 0u64;
    let mut chunk = vec![0u8; 256 * 1024];
    loop {
        // Whole PDUs first.
        loop {
            if buf.len() < 48 {
                break;
            }
            let on = ffp.load(Ordering::Acquire);
            let ahs = usize::from(buf[4]) * 4;
            let dsl =
                (usize::from(buf[5]) << 16) | (usize::from(buf[6]) << 8) | usize::from(buf[7]);
            let padded = dsl.div_ceil(4) * 4;
            let hd = if on { 4 } else { 0 };
            let dd = if on && dsl > 0 { 4 } else { 0 };
            let len = 48 + ahs + hd + padded + dd;
            if buf.len() < len {
                break;
            }
            let mut pdu: Vec<u8> = buf.drain(..len).collect();
            let op = pdu[0] & 0x3f;
            // Data-Out, or a command's immediate data; or Data-In.
            let carries = op == opcode || (opcode == 0x05 && op == 0x01);
            if on && carries && dsl > 0 {
                seen += 1;
                if seen.is_multiple_of(every) {
                    pdu[48 + ahs + hd] ^= 0x5a;
                    if opcode == 0x25 {
                        spoiled.data_in.fetch_add(1, Ordering::Relaxed);
                    } else {
                        spoiled.data_out.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            // The final Login Response (T set, NSG full feature phase): what follows in both
            // directions carries digests.
            let last_login = login_end && op == 0x23 && pdu[1] & 0x80 != 0 && pdu[1] & 0x03 == 3;
            if last_login {
                ffp.store(true, Ordering::Release);
            }
            if to.write_all(&pdu).await.is_err() {
                return;
            }
        }
        match from.read(&mut chunk).await {
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A relay on a free loopback port to the target at `port`, spoiling every `every`th Data-In
/// of each connection, and with `outbound` every `every`th Data-Out or command with data too.
async fn relay(port: u16, every: u64, outbound: bool) -> (u16, Arc<Spoiled>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let me = l.local_addr().unwrap().port();
    let spoiled = Arc::new(Spoiled::default());
    let s = spoiled.clone();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = l.accept().await else {
                return;
            };
            let Ok(server) = TcpStream::connect(("127.0.0.1", port)).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            let ffp = Arc::new(AtomicBool::new(false));
            let out_every = if outbound { every } else { u64::MAX };
            tokio::spawn(pump(cr, sw, ffp.clone(), false, 0x05, out_every, s.clone()));
            tokio::spawn(pump(sr, cw, ffp, true, 0x25, every, s.clone()));
        }
    });
    (me, spoiled)
}

fn pattern(len: usize, seed: u64) -> Bytes {
    let mut x = seed | 1;
    let mut v = vec![0u8; len];
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    Bytes::from(v)
}

/// At level 1, writes and reads back `rounds` x 256 KiB (in 8 KiB Data PDUs,
/// MaxRecvDataSegmentLength 8 KiB on both sides) through a relay that spoils every 7th Data-In
/// and Data-Out; returns the session's recoveries and the SNACKs and recovered PDUs its
/// connection counted.
async fn run(rounds: u64) -> (u32, u64, u64, Arc<Spoiled>) {
    let t = Target::start();
    let (port, spoiled) = relay(t.port, 7, true).await;
    let url = IscsiUrl::parse(&format!("iscsi://127.0.0.1:{port}/{IQN}/0")).unwrap();
    let opts = ConnectOptions {
        digests: true,
        max_erl: 1,
        max_recv_data_segment_length: 8192,
        ..ConnectOptions::default()
    };
    let s = connect(&url, opts).await.unwrap();
    let lun = s.open_lun(0).await.unwrap();
    for i in 0..rounds {
        let data = pattern(256 << 10, i + 1);
        let lba = i * 512;
        lun.write(lba, data.clone()).await.unwrap();
        let back = lun.read(lba, 512).await.unwrap();
        assert!(back == data, "round {i}: the data read back differs");
    }
    let st = s.stats();
    let (snacks, recovered) = st.connections.iter().fold((0, 0), |a, c| {
        (a.0 + c.counters.snacks, a.1 + c.counters.recovered)
    });
    // The target's side, from its metrics while the session is up.
    let addr = t.metrics.clone();
    let text = tokio::task::spawn_blocking(move || common::get(&addr, "/metrics"))
        .await
        .unwrap();
    let sum = |name: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(&format!("mcsi_target_{name}_total{{")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    let target = (
        sum("connection_data_digest_errors"),
        sum("connection_snacks"),
        sum("connection_resent_pdus"),
    );
    println!(
        "target: {} data digest errors, {} SNACKs, {} PDUs sent again",
        target.0, target.1, target.2
    );
    assert_eq!(target.0, spoiled.data_out.load(Ordering::Relaxed), "{text}");
    assert_eq!(target.1, snacks);
    assert!(target.2 >= snacks);
    let _ = s.logout().await;
    (st.recoveries, snacks, recovered, spoiled)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_level_1_spoiled_data_is_asked_for_again_and_the_session_stays_up() {
    let (recoveries, snacks, recovered, spoiled) = run(16).await;
    let (din, dout) = (
        spoiled.data_in.load(Ordering::Relaxed),
        spoiled.data_out.load(Ordering::Relaxed),
    );
    println!(
        "level 1: {din} Data-In and {dout} Data-Out spoiled; {snacks} SNACKs, {recovered} Data-In received again, {recoveries} session recoveries"
    );
    assert!(
        din > 50 && dout > 50,
        "the relay spoiled too little: {din} {dout}"
    );
    assert_eq!(recoveries, 0, "the session went down");
    // A Data-In sent again can be spoiled again, and is asked for again.
    assert_eq!(snacks, din, "one SNACK per spoiled Data-In");
    assert!(
        recovered > 0 && recovered <= snacks,
        "{recovered} of {snacks}"
    );
}

/// The same damage at level 0: a spoiled Data-In ends the connection, and with it the session;
/// the initiator re-establishes it and the read is tried again, but a 256 KiB read (32 Data-In)
/// always meets the 7th spoiled PDU, so it never completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_level_0_the_same_damage_ends_the_session_and_the_read_never_completes() {
    let t = Target::start();
    let (port, spoiled) = relay(t.port, 7, false).await;
    let url = IscsiUrl::parse(&format!("iscsi://127.0.0.1:{port}/{IQN}/0")).unwrap();
    let opts = ConnectOptions {
        digests: true,
        max_erl: 0,
        max_recv_data_segment_length: 8192,
        ..ConnectOptions::default()
    };
    let s = connect(&url, opts).await.unwrap();
    let lun = s.open_lun(0).await.unwrap();
    let data = pattern(256 << 10, 9);
    lun.write(0, data.clone()).await.unwrap();
    let mut failed = 0;
    for _ in 0..3 {
        if lun.read(0, 512).await.is_err() {
            failed += 1;
        }
    }
    let st = s.stats();
    println!(
        "level 0: {} Data-In spoiled; {failed} of 3 reads failed; {} session recoveries",
        spoiled.data_in.load(Ordering::Relaxed),
        st.recoveries
    );
    assert_eq!(failed, 3);
    assert!(st.recoveries >= 3, "{} recoveries", st.recoveries);
    let _ = s.logout().await;
}
