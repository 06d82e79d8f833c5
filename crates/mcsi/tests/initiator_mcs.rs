//! The initiator against mcsi's own target, which offers MaxConnections > 1: sessions of four
//! TCP connections for `mcsi copy` and `mcsi bench`, checked byte for byte against qemu-img,
//! and recovery of a many-connection session.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{ci, have};

use mcsi_initiator::{connect, ConnectOptions, IscsiUrl};
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Proc, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());
const IQN: &str = "iqn.2026-01.org.mcsi:mcs-test";

struct Target {
    child: Child,
    port: u16,
    img: PathBuf,
}

impl Target {
    fn start(size_mib: u64) -> Target {
        Target::start_with(size_mib, &[])
    }

    /// With more `mcsi target` arguments.
    fn start_with(size_mib: u64, extra: &[&str]) -> Target {
        Target::start_full(size_mib, "", extra)
    }

    /// With options after the LUN's size (`,service_time=10ms`) and more arguments.
    fn start_full(size_mib: u64, lun_opts: &str, extra: &[&str]) -> Target {
        for port in 3290..3300u16 {
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
                continue;
            }
            let img = PathBuf::from(format!("/dev/shm/mcsi-mcs-test-{port}.img"));
            let _ = std::fs::remove_file(&img);
            let mut child = Proc::new(env!("CARGO_BIN_EXE_mcsi"))
                .args([
                    "target",
                    "--listen",
                    &format!("127.0.0.1:{port}"),
                    "--iqn",
                    IQN,
                    "--lun",
                    &format!("file:{}:{size_mib}MiB{lun_opts}", img.display()),
                    "--max-connections",
                    "8",
                ])
                .args(extra)
                .env("MCSI_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn mcsi target");
            let t0 = Instant::now();
            loop {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Target { child, port, img };
                }
                if let Ok(Some(_)) = child.try_wait() {
                    break; // port taken meanwhile: next one
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(20),
                    "mcsi target did not start"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("no free port in 3290-3299");
    }

    fn url(&self) -> String {
        format!("iscsi://127.0.0.1:{}/{IQN}/0", self.port)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.img);
    }
}

/// ESTABLISHED TCP connections from this host to 127.0.0.1:`port` (initiator side only:
/// the remote port is the portal's).
fn established_to(port: u16) -> usize {
    let Ok(s) = std::fs::read_to_string("/proc/net/tcp") else {
        return 0;
    };
    let want = format!("0100007F:{port:04X}");
    // By local address: /proc/net/tcp is read in several chunks, and when sockets come and go
    // between two of them (a busy machine) the kernel can list a socket twice.
    s.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 3 && f[2] == want && f[3] == "01").then(|| f[1].to_owned())
        })
        .collect::<std::collections::HashSet<_>>()
        .len()
}

fn random_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = vec![0u8; len];
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    std::fs::write(path, &v).unwrap();
    v
}

/// Run `mcsi ARGS` and record the most connections to `port` seen while it ran.
fn run_watching(args: &[&str], port: u16) -> (std::process::Output, usize) {
    let mut child = Proc::new(env!("CARGO_BIN_EXE_mcsi"))
        .args(args)
        .env("MCSI_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut most = 0;
    while child.try_wait().unwrap().is_none() {
        most = most.max(established_to(port));
        std::thread::sleep(Duration::from_millis(2));
    }
    (child.wait_with_output().unwrap(), most)
}

const MIB64: usize = 64 << 20;

/// `n` 64 KiB writes, each read back and compared, in flight together on LUN 0 while connection
/// `sever` is cut as a network failure would: every one must complete (recovery re-issues).
/// `len` bytes that no other (`task`, `round`) gives: each 512-byte block starts with the
/// task, the round and its own place, then pseudo-random bytes from the three. A read that
/// returns another task's or another round's data, or a block moved, cannot match.
fn unique(task: u64, round: u64, len: usize) -> bytes::Bytes {
    let mut out = Vec::with_capacity(len);
    for b in 0..(len / 512) as u64 {
        out.extend_from_slice(&task.to_be_bytes());
        out.extend_from_slice(&round.to_be_bytes());
        out.extend_from_slice(&b.to_be_bytes());
        let mut x = (task << 40) ^ (round << 20) ^ b ^ 0x2545_f491_4f6c_dd1d;
        for _ in 0..(512 - 24) / 8 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    bytes::Bytes::from(out)
}

async fn write_read_while_severing(s: &mcsi_initiator::Session, n: u64, sever: usize) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    // Each task writes and reads back its blocks several times, so that I/O is still flowing
    // when the connection goes however fast the machine is.
    const ROUNDS: u64 = 4;
    let lun = s.open_lun(0).await.unwrap();
    let done = Arc::new(AtomicU64::new(0));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let l = lun.clone();
        let done = done.clone();
        set.spawn(async move {
            for r in 0..ROUNDS {
                let d = unique(i, r, 65536);
                l.write(i * 128, d.clone()).await?;
                assert_eq!(l.read(i * 128, 128).await?, d);
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, mcsi_initiator::Error>(())
        });
    }
    // Sever once the first round trip is through, with nearly all the work still to do.
    let deadline = Instant::now() + Duration::from_secs(30);
    while done.load(Ordering::Relaxed) == 0 {
        assert!(Instant::now() < deadline, "no I/O completed in 30 s");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(s.sever_connection(sever));
    let at_sever = done.load(Ordering::Relaxed);
    assert!(
        at_sever < n * ROUNDS,
        "all {} round trips were done before the connection was severed",
        n * ROUNDS
    );
    while let Some(r) = set.join_next().await {
        r.unwrap().unwrap();
    }
    assert_eq!(done.load(Ordering::Relaxed), n * ROUNDS);
}

#[test]
fn copy_over_four_connections_is_byte_exact_against_qemu_img() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let t = Target::start(80);
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    let data = random_file(&src, MIB64, 0xabc);

    let (out, most) = run_watching(
        &[
            "copy",
            src.to_str().unwrap(),
            &t.url(),
            "--connections",
            "4",
            "--iodepth",
            "16",
            "--bs",
            "256KiB",
        ],
        t.port,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("4 connection(s)"), "{err}");
    assert_eq!(
        most, 4,
        "expected 4 TCP connections to the target during the copy; its log:\n{err}"
    );

    let have_qemu = have("qemu-img");
    if !have_qemu {
        assert!(!ci(), "qemu-img missing; required under CI=true");
    }
    if have_qemu {
        // What mcsi wrote, as qemu-img reads it.
        let q = dir.path().join("q.bin");
        let st = Proc::new("qemu-img")
            .args(["convert", "-O", "raw", &t.url(), q.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(st.success());
        assert!(
            std::fs::read(&q).unwrap()[..MIB64] == data[..],
            "qemu-img reads other bytes"
        );
    }
    // And through the target's backing file.
    assert!(std::fs::read(&t.img).unwrap()[..MIB64] == data[..]);

    // What qemu-img wrote, as mcsi reads it over 4 connections.
    let src2 = dir.path().join("src2.bin");
    let data2 = random_file(&src2, MIB64, 0xdef);
    if have_qemu {
        let st = Proc::new("qemu-img")
            .args([
                "convert",
                "-n",
                "-f",
                "raw",
                "-O",
                "raw",
                src2.to_str().unwrap(),
                &t.url(),
            ])
            .status()
            .unwrap();
        assert!(st.success());
    } else {
        std::fs::write(&t.img, &data2).unwrap();
    }
    let back = dir.path().join("back.bin");
    let (out, most) = run_watching(
        &[
            "copy",
            &t.url(),
            back.to_str().unwrap(),
            "--connections",
            "4",
            "--length",
            "64MiB",
        ],
        t.port,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(most, 4);
    assert!(
        std::fs::read(&back).unwrap() == data2,
        "mcsi reads other bytes than were written"
    );
}

#[test]
fn bench_over_four_connections_spreads_tasks() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let t = Target::start(40);
    for policy in ["round-robin", "least-outstanding"] {
        let out = Proc::new(env!("CARGO_BIN_EXE_mcsi"))
            .args([
                "bench",
                &t.url(),
                "--connections",
                "4",
                "--iodepth",
                "32",
                "--bs",
                "4KiB",
                "--rw",
                "randwrite",
                "--size",
                "32MiB",
                "--verify",
                "--json",
                "--policy",
                policy,
            ])
            .env("MCSI_LOG", "warn")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let j = &v["jobs"][0];
        assert_eq!(j["error"], 0);
        assert_eq!(j["write"]["total_ios"], 8192);
        assert!(j["write"]["iops"].as_f64().unwrap() > 0.0);
        assert_eq!(v["mcsi"]["verify"]["errors"], 0);
        assert_eq!(v["mcsi"]["policy"], policy);
        let conns = v["mcsi"]["connections"].as_array().unwrap();
        assert_eq!(conns.len(), 4);
        let tasks: Vec<u64> = conns.iter().map(|c| c["tasks"].as_u64().unwrap()).collect();
        let total: u64 = tasks.iter().sum();
        // 8192 writes + 8192 verify reads + READ CAPACITY (sent again after the unit
        // attention a new nexus may report first).
        assert!((2 * 8192 + 1..=2 * 8192 + 4).contains(&total), "{tasks:?}");
        for n in &tasks {
            // Each connection carries a fair share (round-robin exactly a quarter).
            assert!(*n > total / 8, "{policy}: {tasks:?}");
        }
        if policy == "round-robin" {
            let (lo, hi) = (tasks.iter().min().unwrap(), tasks.iter().max().unwrap());
            assert!(hi - lo <= 1, "{tasks:?}");
        }
    }
}

#[test]
fn four_connection_session_recovers_and_reissues() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // Each read and write takes 5 ms at the target, so that when the connection is cut the
    // target holds tasks of it in service (to be reassigned at level 2), however busy the
    // machine: on a bare RAM-speed LUN under load, one run found a single task on the
    // connection, still in its socket.
    let t = Target::start_full(16, ",service_time=5ms", &[]);
    let url = IscsiUrl::parse(&t.url()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // ErrorRecoveryLevel 0: the session is logged in again and every command without
        // status issued again.
        let s = connect(
            &url,
            ConnectOptions {
                connections: 4,
                max_erl: 0,
                ..ConnectOptions::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(s.connection_count(), 4);
        assert_eq!(s.params().max_connections, 4);
        write_read_while_severing(&s, 256, 2).await;
        assert!(s.stats().recoveries >= 1);
        assert_eq!(
            s.connection_count(),
            4,
            "recovery re-opens all four connections"
        );
        s.logout().await.unwrap();

        // ErrorRecoveryLevel 2 (the default with mcsi's target): the severed connection's
        // tasks move to the other three with TASK REASSIGN; the session is never logged in
        // again, and the connection's route rejoins.
        let s = connect(
            &url,
            ConnectOptions {
                connections: 4,
                ..ConnectOptions::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(s.params().error_recovery_level, 2);
        write_read_while_severing(&s, 256, 2).await;
        let st = s.stats();
        println!(
            "level 2: {} recoveries, {} failovers, {} rejoins",
            st.recoveries, st.failovers, st.rejoins
        );
        assert_eq!(st.recoveries, 0, "the session was logged in again");
        assert!(st.failovers >= 1, "{st:?}");
        // Level 2 for what it is: the severed connection's tasks that the target had went on
        // elsewhere by TASK REASSIGN (an initiator that reissued them all would show 0), and
        // the connection came back. Those still in its socket when it died (64 KiB writes
        // fill the target's receive window: 27 of 32 in one run here) never reached the
        // target, which answers "no such task", and are reissued, as RFC 7143 wants; so
        // reassigned is not asked to exceed reissued.
        println!(
            "level 2: {} reassigned, {} reissued",
            st.reassigned, st.reissued
        );
        assert!(st.reassigned >= 1, "no task was reassigned: {st:?}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while s.stats().rejoins == 0 {
            assert!(
                Instant::now() < deadline,
                "no connection rejoined in 20 s: {:?}",
                s.stats()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        s.logout().await.unwrap();
    });
}

/// Every way a write's data can travel: immediate data, unsolicited Data-Out (ImmediateData=No
/// with InitialR2T=No), R2T only (InitialR2T=Yes, ImmediateData=No), also with CRC32C digests
/// offered, over two connections.
#[test]
fn write_paths_and_digests_round_trip() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let t = Target::start(16);
    let url = IscsiUrl::parse(&t.url()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for (n, (immediate, initial_r2t, digests)) in [
            (true, false, false),
            (false, false, false),
            (false, true, false),
            (true, false, true),
            (false, false, true),
        ]
        .into_iter()
        .enumerate()
        {
            let o = ConnectOptions {
                connections: 2,
                immediate_data: immediate,
                initial_r2t,
                digests,
                ..ConnectOptions::default()
            };
            let s = connect(&url, o).await.unwrap();
            let p = s.params();
            assert_eq!(p.immediate_data, immediate, "case {n}");
            assert!(p.initial_r2t || !initial_r2t, "case {n}");
            // Digests are the target's choice too; without our offer there are none.
            if !digests {
                assert!(!p.header_digest && !p.data_digest, "case {n}");
            }
            let lun = s.open_lun(0).await.unwrap();
            for (i, len) in [512usize, 65536, 300 * 1024, 1 << 20]
                .into_iter()
                .enumerate()
            {
                let lba = (n * 4096 + i * 2048) as u64;
                let d: Vec<u8> = (0..len).map(|x| (x * 31 + n + i) as u8).collect();
                lun.write(lba, bytes::Bytes::from(d.clone())).await.unwrap();
                let r = lun.read(lba, (len / 512) as u32).await.unwrap();
                assert!(r[..] == d[..], "case {n}: {len} bytes differ");
            }
            s.logout().await.unwrap();
        }
    });
}

/// A timed write run with --verify that ends before its first pass has written every block
/// reads back only what it wrote: the blocks it never reached hold whatever the LUN held (here
/// zeros), which is no error of the target's.
#[test]
fn a_timed_verify_run_checks_only_the_blocks_it_wrote() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let t = Target::start(16);
    let out = Proc::new(env!("CARGO_BIN_EXE_mcsi"))
        .args([
            "bench",
            &t.url(),
            "--rw",
            "randwrite",
            "--bs",
            "4KiB",
            "--rate-iops",
            "200",
            "--runtime",
            "0.5",
            "--verify",
            "--json",
        ])
        .env("MCSI_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let written = v["jobs"][0]["write"]["total_ios"].as_u64().unwrap();
    assert!(written > 0 && written < 4096, "{written} of 4096 blocks");
    assert_eq!(v["mcsi"]["verify"]["errors"], 0);
    assert_eq!(v["mcsi"]["verify"]["blocks_checked"], written, "{v}");
}

/// The asymmetric mode between mcsi peers (thesis 4.3.2-4.3.3): `mcsi bench` and `mcsi copy`
/// over four connections, two carrying commands and two carrying R2T, Data-In and status.
#[test]
fn asymmetric_mode_puts_replies_on_response_connections() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let t = Target::start(40);
    let out = Proc::new(env!("CARGO_BIN_EXE_mcsi"))
        .args([
            "bench",
            &t.url(),
            "--connections",
            "4",
            "--asymmetric",
            "--iodepth",
            "32",
            "--bs",
            "4KiB",
            "--rw",
            "randwrite",
            "--size",
            "16MiB",
            "--verify",
            "--json",
        ])
        .env("MCSI_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"][0]["error"], 0);
    assert_eq!(v["mcsi"]["verify"]["errors"], 0);
    assert_eq!(v["mcsi"]["verify"]["blocks_checked"], 4096);
    assert_eq!(v["mcsi"]["asymmetric"], true);
    let conns = v["mcsi"]["connections"].as_array().unwrap();
    let roles: Vec<&str> = conns.iter().map(|c| c["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["requests", "requests", "responses", "responses"]);
    let n = |c: &serde_json::Value, k: &str| c[k].as_u64().unwrap();
    let issued: u64 = conns.iter().map(|c| n(c, "tasks")).sum();
    for c in conns {
        if c["role"] == "requests" {
            // Each request connection issues half the tasks and receives no status.
            assert!(n(c, "tasks") >= issued / 2 - 1, "{conns:?}");
            assert_eq!(n(c, "statuses_in"), 0, "{conns:?}");
            assert_eq!(n(c, "data_in_bytes"), 0, "{conns:?}");
        } else {
            // Each response connection gets half the statuses and Data-In, and issues nothing.
            assert_eq!(n(c, "tasks"), 0, "{conns:?}");
            assert!(n(c, "statuses_in") >= issued / 2 - 1, "{conns:?}");
            assert!(n(c, "data_in_bytes") >= 4 << 20, "{conns:?}");
        }
    }

    // A copy in and out over an asymmetric session is byte-exact.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    let data = random_file(&src, 16 << 20, 0x5a5a);
    let (out, _) = run_watching(
        &[
            "copy",
            src.to_str().unwrap(),
            &t.url(),
            "--connections",
            "4",
            "--asymmetric",
            "--bs",
            "256KiB",
        ],
        t.port,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // The session's own report (a 16 MiB copy is too short to count sockets reliably).
    assert!(err.contains("4 connection(s)"), "{err}");
    let back = dir.path().join("back.bin");
    let (out, _) = run_watching(
        &[
            "copy",
            &t.url(),
            back.to_str().unwrap(),
            "--connections",
            "4",
            "--asymmetric",
            "--length",
            "16MiB",
        ],
        t.port,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::read(&back).unwrap() == data, "copy differs");
}

/// `mcsi copy --bs auto` reads a LUN in chunks sized to the window the target reports, and the
/// copy is byte-exact; from a file source it is refused with what to do instead.
#[test]
fn copy_with_reads_sized_to_the_window_is_byte_exact() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let t = Target::start(40);
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    let data = random_file(&src, 32 << 20, 11);
    let mcsi = |args: &[&str]| {
        Proc::new(env!("CARGO_BIN_EXE_mcsi"))
            .args(args)
            .env("MCSI_LOG", "warn")
            .output()
            .unwrap()
    };
    let out = mcsi(&[
        "copy",
        src.to_str().unwrap(),
        &t.url(),
        "--connections",
        "2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let refused = mcsi(&["copy", src.to_str().unwrap(), &t.url(), "--bs", "auto"]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("give a fixed --bs"),
        "{err}"
    );
    for rule in ["bdp", "cwnd"] {
        let back = dir.path().join(format!("back-{rule}.bin"));
        let out = mcsi(&[
            "copy",
            &t.url(),
            back.to_str().unwrap(),
            "--connections",
            "2",
            "--iodepth",
            "2",
            "--length",
            "32MiB",
            "--bs",
            "auto",
            "--bs-rule",
            rule,
            "--bs-min",
            "16KiB",
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        // The target reported its window, so the size left its 16 KiB start.
        assert!(err.contains(&format!("bs auto ({rule}):")), "{err}");
        assert!(!err.contains("sent no TCP state reports"), "{err}");
        assert!(!err.contains("0 size changes"), "{err}");
        assert!(
            std::fs::read(&back).unwrap() == data,
            "copy ({rule}) differs"
        );
    }
}

/// The target's response policy (`--response-policy`) decides which response connection carries
/// each task's replies: failover keeps them all on the first, weighted:3,1 splits them 3 to 1,
/// and tcp-aware serves verified I/O.
#[test]
fn target_response_policy_places_the_replies() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let run = |policy: &str, rw: &str| -> Vec<(u64, u64)> {
        let t = Target::start_with(24, &["--response-policy", policy]);
        let out = Proc::new(env!("CARGO_BIN_EXE_mcsi"))
            .args(["bench", &t.url(), "--connections", "4", "--asymmetric"])
            .args(["--iodepth", "16", "--bs", "4KiB", "--rw", rw])
            .args(["--size", "8MiB", "--verify", "--json"])
            .env("MCSI_LOG", "warn")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{policy}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["jobs"][0]["error"], 0, "{policy}");
        assert_eq!(v["mcsi"]["verify"]["errors"], 0, "{policy}");
        v["mcsi"]["connections"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["role"] == "responses")
            .map(|c| {
                (
                    c["statuses_in"].as_u64().unwrap(),
                    c["data_in_bytes"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let f = run("failover", "randwrite");
    assert_eq!(f.len(), 2, "{f:?}");
    assert!(f[0].0 >= 2048 && f[1].0 == 0, "failover: {f:?}");
    let w = run("weighted:3,1", "randwrite");
    let share = w[0].0 as f64 / (w[0].0 + w[1].0) as f64;
    assert!(
        (0.70..=0.80).contains(&share),
        "weighted:3,1 gave {share:.3}: {w:?}"
    );
    let a = run("tcp-aware", "randwrite");
    assert!(a[0].0 + a[1].0 >= 2048, "tcp-aware: {a:?}");
}

/// Every write path (immediate, unsolicited, R2T-solicited) in an asymmetric session, then the
/// loss of a response connection: the session is recovered with its roles and every task
/// completes.
#[test]
fn asymmetric_session_write_paths_and_recovery() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let t = Target::start(16);
    let url = IscsiUrl::parse(&t.url()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for (n, (immediate, initial_r2t)) in [(true, false), (false, false), (false, true)]
            .into_iter()
            .enumerate()
        {
            let o = ConnectOptions {
                connections: 4,
                asymmetric: true,
                immediate_data: immediate,
                initial_r2t,
                ..ConnectOptions::default()
            };
            let s = connect(&url, o).await.unwrap();
            assert!(s.params().asymmetric);
            let lun = s.open_lun(0).await.unwrap();
            for (i, len) in [512usize, 65536, 300 * 1024, 1 << 20]
                .into_iter()
                .enumerate()
            {
                let lba = (n * 4096 + i * 2048) as u64;
                let d: Vec<u8> = (0..len).map(|x| (x * 31 + n + i) as u8).collect();
                lun.write(lba, bytes::Bytes::from(d.clone())).await.unwrap();
                let r = lun.read(lba, (len / 512) as u32).await.unwrap();
                assert!(r[..] == d[..], "case {n}: {len} bytes differ");
            }
            let st = s.stats();
            for c in &st.connections {
                use mcsi_initiator::core::ConnRole;
                match c.counters.role {
                    ConnRole::Requests => assert_eq!(c.counters.statuses_in, 0, "case {n}"),
                    ConnRole::Responses => assert_eq!(c.counters.tasks, 0, "case {n}"),
                    ConnRole::Both => panic!("case {n}: a connection without a role"),
                }
            }
            s.logout().await.unwrap();
        }

        let s = connect(
            &url,
            ConnectOptions {
                connections: 4,
                asymmetric: true,
                ..ConnectOptions::default()
            },
        )
        .await
        .unwrap();
        // Connection 3 carries responses.
        write_read_while_severing(&s, 128, 3).await;
        let st = s.stats();
        assert!(st.recoveries >= 1);
        let roles: Vec<_> = st
            .connections
            .iter()
            .map(|c| c.counters.role.as_str())
            .collect();
        assert_eq!(roles, ["requests", "requests", "responses", "responses"]);
        s.logout().await.unwrap();
    });
}

/// What [`churn`] saw: I/Os done, and for each kill the longest an I/O in flight across it took.
struct Churn {
    ops: u64,
    kills: Vec<Duration>,
}

/// 32 loops of 16 KiB write-then-verify, each on its own blocks, for `run`, while connection
/// `k % 4` is severed every `every` (k = 0, 1, ...). Every I/O must succeed and read back what
/// was written.
async fn churn(s: &mcsi_initiator::Session, run: Duration, every: Duration) -> Churn {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    let lun = s.open_lun(0).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    // (start, end) of every I/O.
    let spans = Arc::new(Mutex::new(Vec::<(Instant, Instant)>::new()));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..32u64 {
        let (l, stop, ops, spans) = (lun.clone(), stop.clone(), ops.clone(), spans.clone());
        set.spawn(async move {
            let mut r = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let d = unique(i, r, 16384);
                let t0 = Instant::now();
                l.write(i * 64, d.clone()).await?;
                let t1 = Instant::now();
                assert_eq!(l.read(i * 64, 32).await?, d, "loop {i} round {r}");
                let t2 = Instant::now();
                spans.lock().unwrap().extend([(t0, t1), (t1, t2)]);
                ops.fetch_add(2, Ordering::Relaxed);
                r += 1;
            }
            Ok::<_, mcsi_initiator::Error>(())
        });
    }
    let start = Instant::now();
    let mut kills = Vec::new();
    let mut k = 0usize;
    while start.elapsed() < run {
        tokio::time::sleep(every).await;
        if s.sever_connection(k % 4) {
            kills.push(Instant::now());
        }
        k += 1;
    }
    tokio::time::sleep(every).await;
    stop.store(true, Ordering::Relaxed);
    while let Some(r) = set.join_next().await {
        r.unwrap().unwrap();
    }
    let spans = spans.lock().unwrap();
    let worst = |at: Instant| {
        spans
            .iter()
            .filter(|(a, b)| *a <= at && *b >= at)
            .map(|(a, b)| *b - *a)
            .max()
            .unwrap_or_default()
    };
    Churn {
        ops: ops.load(Ordering::Relaxed),
        kills: kills.into_iter().map(worst).collect(),
    }
}

/// A connection of a four-connection session killed every 1.5 s for 9 s under 32 verified
/// write/read loops: at ErrorRecoveryLevel 2 nothing fails and the session is never logged in
/// again; the longest I/O across each kill is printed beside level 0's, where every kill logs
/// the whole session in again.
#[test]
fn killing_a_connection_every_few_seconds_costs_nothing_at_level_2() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let t = Target::start(16);
    let url = IscsiUrl::parse(&t.url()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let ms = |d: &Duration| format!("{:.0}", d.as_secs_f64() * 1e3);
        for erl in [2u8, 0] {
            let s = connect(
                &url,
                ConnectOptions {
                    connections: 4,
                    max_erl: erl,
                    ..ConnectOptions::default()
                },
            )
            .await
            .unwrap();
            let c = churn(&s, Duration::from_secs(9), Duration::from_millis(1500)).await;
            let st = s.stats();
            println!(
                "level {erl}: {} I/Os verified, {} kills, {} session recoveries, {} failovers; longest I/O across each kill (ms): {}",
                c.ops,
                c.kills.len(),
                st.recoveries,
                st.failovers,
                c.kills.iter().map(ms).collect::<Vec<_>>().join(" ")
            );
            assert!(c.kills.len() >= 5, "{} kills", c.kills.len());
            if erl == 2 {
                assert_eq!(st.recoveries, 0, "the session was logged in again");
                assert!(st.failovers as usize >= c.kills.len() - 1, "{st:?}");
                // At least one task per kill or two went on by TASK REASSIGN (see
                // four_connection_session_recovers_and_reissues on why not more than reissued).
                println!("level 2: {} reassigned, {} reissued", st.reassigned, st.reissued);
                assert!(
                    st.reassigned as usize >= c.kills.len() / 2,
                    "{} reassigned over {} kills: {st:?}",
                    st.reassigned,
                    c.kills.len()
                );
            } else {
                assert!(st.recoveries >= 1);
            }
            let _ = s.logout().await;
        }
    });
}
