//! The initiator (library, `mcsi copy`, `mcsi bench`) against tgt, the Linux SCSI target
//! framework daemon. Each test starts its own tgtd on a free port in 3280-3289 with its own
//! control port, backed by a file in /dev/shm. Without tgtd the tests are skipped, except under
//! CI=true where that is a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{have, skip};

use mcsi_initiator::{connect, Command, ConnectOptions, DataDir, Error, IscsiUrl, SenseKey};
use std::path::PathBuf;
use std::process::{Child, Command as Proc, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const IQN: &str = "iqn.2001-04.com.example:mcsi-test";
/// Tests share the port range and the two cores: run them one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

struct Tgt {
    child: Child,
    port: u16,
    img: PathBuf,
}

/// Run `tgtadm -C PORT --lld iscsi ARGS` against the tgtd whose control port is `port`.
fn tgtadm(port: u16, args: &[&str]) -> bool {
    Proc::new("tgtadm")
        .args(["-C", &port.to_string(), "--lld", "iscsi"])
        .args(args)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

impl Tgt {
    /// Start tgtd with one target and LUN 1 of `size` bytes. None when tgtd is missing (not CI).
    fn start(size: u64) -> Option<Tgt> {
        if !have("tgtd") || !have("tgtadm") {
            skip(
                "initiator_tgt",
                "tgtd/tgtadm are not installed (apt-get install tgt)",
            );
            return None;
        }
        for port in 3280..3290u16 {
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
                continue;
            }
            let ctl = port.to_string();
            let child = Proc::new("tgtd")
                .args([
                    "-f",
                    "-C",
                    &ctl,
                    "--iscsi",
                    &format!("portal=127.0.0.1:{port}"),
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn tgtd");
            let img = PathBuf::from(format!("/dev/shm/mcsi-init-test-{port}.img"));
            let f = std::fs::File::create(&img).unwrap();
            f.set_len(size).unwrap();
            let mut t = Tgt { child, port, img };
            let adm = |args: &[&str]| {
                Proc::new("tgtadm")
                    .args(["-C", &ctl, "--lld", "iscsi"])
                    .args(args)
                    .output()
                    .map(|o| o.status.success())
                    .unwrap_or(false)
            };
            let t0 = Instant::now();
            let mut ok = false;
            while t0.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = t.child.try_wait() {
                    break; // tgtd exited: port or control socket taken
                }
                if adm(&["--op", "new", "--mode", "target", "--tid", "1", "-T", IQN]) {
                    ok = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if !ok {
                continue; // Drop kills this tgtd; try the next port
            }
            let img_s = t.img.to_str().unwrap().to_string();
            assert!(adm(&[
                "--op",
                "new",
                "--mode",
                "logicalunit",
                "--tid",
                "1",
                "--lun",
                "1",
                "-b",
                &img_s
            ]));
            assert!(adm(&[
                "--op", "bind", "--mode", "target", "--tid", "1", "-I", "ALL"
            ]));
            // Wait until the portal accepts connections.
            let t0 = Instant::now();
            while std::net::TcpStream::connect(("127.0.0.1", t.port)).is_err() {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "tgtd portal never opened"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            return Some(t);
        }
        panic!("no free port in 3280-3289 for tgtd");
    }

    fn url(&self) -> String {
        format!("iscsi://127.0.0.1:{}/{IQN}/1", self.port)
    }

    fn adm(&self, args: &[&str]) {
        assert!(tgtadm(self.port, args), "tgtadm {args:?} failed");
    }
}

impl Drop for Tgt {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.img);
    }
}

fn mcsi() -> Proc {
    let mut c = Proc::new(env!("CARGO_BIN_EXE_mcsi"));
    c.env("MCSI_LOG", "info");
    c
}

fn random_file(path: &std::path::Path, len: usize, seed: u64) -> Vec<u8> {
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

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

const MIB64: usize = 64 << 20;

#[test]
fn copy_to_and_from_tgt_is_byte_exact() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(t) = Tgt::start(80 << 20) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    let data = random_file(&src, MIB64, 0x1234);

    // File -> LUN, asking for 4 connections: tgt allows 1, and the session says so.
    let out = mcsi()
        .args([
            "copy",
            src.to_str().unwrap(),
            &t.url(),
            "--connections",
            "4",
            "--iodepth",
            "8",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "copy failed: {err}");
    assert!(
        err.contains("MaxConnections=1"),
        "no fallback log line: {err}"
    );
    assert!(err.contains("1 connection(s)"), "{err}");
    let img = std::fs::read(&t.img).unwrap();
    assert!(
        img[..MIB64] == data[..],
        "LUN content differs from the source"
    );

    // LUN -> file.
    let back = dir.path().join("back.bin");
    let out = mcsi()
        .args([
            "copy",
            &t.url(),
            back.to_str().unwrap(),
            "--length",
            "64MiB",
            "--bs",
            "256KiB",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::read(&back).unwrap() == data, "read-back differs");

    // qemu-img reads what mcsi wrote, and mcsi reads what qemu-img wrote.
    if !have("qemu-img") {
        skip(
            "initiator_tgt: qemu-img against mcsi's writes",
            "qemu-img is not installed (apt-get install qemu-utils)",
        );
        return;
    }
    let q = dir.path().join("qemu.bin");
    let st = Proc::new("qemu-img")
        .args(["convert", "-O", "raw", &t.url(), q.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(st.success());
    assert!(
        std::fs::read(&q).unwrap()[..MIB64] == data[..],
        "qemu-img sees other bytes"
    );
    let src2 = dir.path().join("src2.bin");
    let data2 = random_file(&src2, MIB64, 0x9999);
    let st = Proc::new("qemu-img")
        .args([
            "convert",
            "-n",
            "-O",
            "raw",
            "-f",
            "raw",
            src2.to_str().unwrap(),
            &t.url(),
        ])
        .status()
        .unwrap();
    assert!(st.success());
    let back2 = dir.path().join("back2.bin");
    let out = mcsi()
        .args([
            "copy",
            &t.url(),
            back2.to_str().unwrap(),
            "--length",
            "64MiB",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        std::fs::read(&back2).unwrap() == data2,
        "mcsi reads other bytes than qemu-img wrote"
    );
}

#[test]
fn copy_fails_loudly() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(t) = Tgt::start(8 << 20) else { return };
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("big.bin");
    random_file(&src, 16 << 20, 1);
    // 16 MiB into an 8 MiB LUN.
    let out = mcsi()
        .args(["copy", src.to_str().unwrap(), &t.url()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds 8388608 bytes"));
    // Unknown target name: the login refusal is named.
    let bad = format!(
        "iscsi://127.0.0.1:{}/iqn.2001-04.com.example:nope/1",
        t.port
    );
    let out = mcsi()
        .args(["copy", &bad, dir.path().join("x").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("target not found"), "{e}");
}

/// Asking tgt for the asymmetric mode changes nothing: tgt does not know the vendor key
/// (NotUnderstood), the session is a standard one-connection session and I/O works.
#[test]
fn asymmetric_request_falls_back_against_tgt() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(t) = Tgt::start(8 << 20) else {
        return;
    };
    let url = IscsiUrl::parse(&t.url()).unwrap();
    rt().block_on(async {
        let o = ConnectOptions {
            connections: 4,
            asymmetric: true,
            ..ConnectOptions::default()
        };
        let s = connect(&url, o).await.unwrap();
        assert!(!s.params().asymmetric);
        assert_eq!(s.connection_count(), 1);
        let st = s.stats();
        assert_eq!(
            st.connections[0].counters.role,
            mcsi_initiator::core::ConnRole::Both
        );
        let lun = s.open_lun(1).await.unwrap();
        let d = bytes::Bytes::from(vec![0x3c; 65536]);
        lun.write(64, d.clone()).await.unwrap();
        assert_eq!(lun.read(64, 128).await.unwrap(), d);
        s.logout().await.unwrap();
    });
}

#[test]
fn library_commands_against_tgt() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(t) = Tgt::start(16 << 20) else {
        return;
    };
    let url = IscsiUrl::parse(&t.url()).unwrap();
    rt().block_on(async {
        let found = mcsi_initiator::discover(
            &url.address(),
            "iqn.2026-01.org.mcsi:test",
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert!(found.iter().any(|d| d.name == IQN), "{found:?}");

        let s = connect(&url, ConnectOptions::default()).await.unwrap();
        let lun = s.open_lun(1).await.unwrap();
        let cap = lun.capacity().await.unwrap();
        assert_eq!(cap.block_size, 512);
        assert_eq!(cap.blocks, (16 << 20) / 512);
        let inq = lun.inquiry().await.unwrap();
        assert_eq!(inq.device_type, 0, "direct-access block device");
        assert_eq!(inq.vendor, "IET");

        // Writes of several sizes: immediate data only, and R2T-driven beyond FirstBurstLength.
        for (lba, len) in [(0u64, 512usize), (8, 8192), (100, 65536), (1000, 1 << 20)] {
            let d: Vec<u8> = (0..len).map(|i| (i as u64 * 7 + lba) as u8).collect();
            lun.write(lba, bytes::Bytes::from(d.clone())).await.unwrap();
            let r = lun.read(lba, (len / 512) as u32).await.unwrap();
            assert!(r[..] == d[..], "mismatch at lba {lba} len {len}");
        }
        lun.flush().await.unwrap();

        // Local argument checks.
        assert!(matches!(
            lun.read(cap.blocks, 1).await,
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            lun.write(0, bytes::Bytes::from_static(&[1, 2, 3])).await,
            Err(Error::InvalidArgument(_))
        ));

        // A READ (16) past the end, sent raw: CHECK CONDITION, ILLEGAL REQUEST 21/00.
        let mut cdb = vec![0u8; 16];
        cdb[0] = 0x88;
        cdb[2..10].copy_from_slice(&cap.blocks.to_be_bytes());
        cdb[13] = 1;
        let r = s
            .execute(Command {
                lun: 1,
                cdb: cdb.into(),
                dir: DataDir::Read(512),
            })
            .await
            .unwrap();
        let e = r.check().unwrap_err();
        let Error::Scsi(se) = &e else { panic!("{e}") };
        let sense = se.sense.clone().unwrap();
        assert_eq!(sense.key, SenseKey::IllegalRequest);
        assert_eq!((sense.asc, sense.ascq), (0x21, 0x00));

        // Reading 1024 bytes with a 512-byte transfer length: the target has 512 bytes, so
        // it reports an underflow residual of 512 and the read is short.
        let mut cdb = vec![0u8; 16];
        cdb[0] = 0x88;
        cdb[13] = 1;
        let r = s
            .execute(Command {
                lun: 1,
                cdb: cdb.into(),
                dir: DataDir::Read(1024),
            })
            .await
            .unwrap()
            .check()
            .unwrap();
        assert_eq!(r.residual, mcsi_initiator::task::Residual::Underflow(512));
        assert_eq!(r.data.len(), 512);

        s.logout().await.unwrap();
        assert!(matches!(lun.read(0, 1).await, Err(Error::Closed)));
    });
}

#[test]
fn cmd_sn_wraps_around_against_tgt() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(t) = Tgt::start(8 << 20) else { return };
    let url = IscsiUrl::parse(&t.url()).unwrap();
    rt().block_on(async {
        let s = connect(
            &url,
            ConnectOptions {
                initial_cmd_sn: 0xffff_fff0,
                ..ConnectOptions::default()
            },
        )
        .await
        .unwrap();
        let lun = s.open_lun(1).await.unwrap();
        let mut set = tokio::task::JoinSet::new();
        for i in 0..64u64 {
            let l = lun.clone();
            set.spawn(async move {
                let d = bytes::Bytes::from(vec![i as u8; 4096]);
                l.write(i * 8, d.clone()).await.unwrap();
                assert_eq!(l.read(i * 8, 8).await.unwrap(), d);
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        let st = s.stats();
        // 128 I/Os plus READ CAPACITY from 0xfffffff0: ExpCmdSN went past the wrap.
        assert!(st.exp_cmd_sn < 0x1000, "ExpCmdSN {:#x}", st.exp_cmd_sn);
        s.logout().await.unwrap();
    });
}

#[test]
fn reconnects_and_reissues_after_a_dropped_connection() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(t) = Tgt::start(16 << 20) else {
        return;
    };
    let url = IscsiUrl::parse(&t.url()).unwrap();
    rt().block_on(async {
        let s = connect(&url, ConnectOptions::default()).await.unwrap();
        let lun = s.open_lun(1).await.unwrap();
        let mut set = tokio::task::JoinSet::new();
        let written = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for i in 0..256u64 {
            let l = lun.clone();
            let w = written.clone();
            set.spawn(async move {
                let d = bytes::Bytes::from(vec![(i % 251) as u8; 65536]);
                l.write(i * 128, d.clone()).await?;
                w.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let r = l.read(i * 128, 128).await?;
                assert_eq!(r, d);
                Ok::<_, Error>(())
            });
        }
        // Cut the connection while commands are in flight: once the first few writes are done
        // (a fixed delay let a fast machine finish them all first, and nothing was recovered).
        while written.load(std::sync::atomic::Ordering::Relaxed) < 4 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let done = written.load(std::sync::atomic::Ordering::Relaxed);
        assert!(done < 256, "every write was done before the cut");
        assert!(s.sever_connection(0));
        let mut ok = 0;
        while let Some(r) = set.join_next().await {
            r.unwrap().unwrap();
            ok += 1;
        }
        assert_eq!(ok, 256);
        assert!(s.stats().recoveries >= 1, "no recovery happened");
        s.logout().await.unwrap();
    });
}

#[test]
fn bench_randwrite_verify_json_against_tgt() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(t) = Tgt::start(40 << 20) else {
        return;
    };
    let out = mcsi()
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
            // tgt does not know mcsi's vendor key: it must answer NotUnderstood and the
            // session go on without reports.
            "--target-tcp",
        ])
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
    assert_eq!(j["write"]["io_bytes"], 32 << 20);
    assert!(j["write"]["iops"].as_f64().unwrap() > 0.0);
    assert!(j["write"]["bw_bytes"].as_u64().unwrap() > 0);
    assert!(j["write"]["lat_ns"]["mean"].as_f64().unwrap() > 0.0);
    assert!(
        j["write"]["lat_ns"]["percentile"]["99.000000"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(v["mcsi"]["verify"]["blocks_checked"], 8192);
    assert_eq!(v["mcsi"]["verify"]["errors"], 0);
    let conns = v["mcsi"]["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 1, "tgt allows one connection per session");
    assert!(conns[0]["tcp"]["cwnd"].as_u64().unwrap() > 0);
    assert!(conns[0]["target_tcp"].is_null());
    // Every block on the LUN now carries its own LBA: a read-only verify pass agrees.
    let out = mcsi()
        .args([
            "bench",
            &t.url(),
            "--rw",
            "read",
            "--size",
            "32MiB",
            "--bs",
            "4KiB",
            "--verify",
            "--iodepth",
            "4",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("8192 blocks checked, 0 errors"));
    // Damage one block behind the target's back: the next verify run must fail.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&t.img)
            .unwrap();
        f.write_all_at(&[0xff; 16], 4096 * 100 + 64).unwrap();
    }
    let out = mcsi()
        .args([
            "bench",
            &t.url(),
            "--rw",
            "read",
            "--size",
            "32MiB",
            "--verify",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"][0]["error"], 84);
    assert_eq!(v["mcsi"]["verify"]["errors"], 1);
}

#[test]
fn answers_tgt_nop_in_pings() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(t) = Tgt::start(8 << 20) else { return };
    // tgt pings every second and drops a connection after 3 unanswered pings.
    t.adm(&[
        "--op",
        "update",
        "--mode",
        "target",
        "--tid",
        "1",
        "--name",
        "nop_interval",
        "--value",
        "1",
    ]);
    t.adm(&[
        "--op",
        "update",
        "--mode",
        "target",
        "--tid",
        "1",
        "--name",
        "nop_count",
        "--value",
        "3",
    ]);
    let url = IscsiUrl::parse(&t.url()).unwrap();
    rt().block_on(async {
        let s = connect(&url, ConnectOptions::default()).await.unwrap();
        let lun = s.open_lun(1).await.unwrap();
        tokio::time::sleep(Duration::from_secs(6)).await;
        lun.read(0, 8).await.unwrap();
        assert_eq!(
            s.stats().recoveries,
            0,
            "tgt dropped the connection: NOP-In unanswered"
        );
        s.logout().await.unwrap();
    });
}

#[test]
fn chap_login_against_tgt() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(t) = Tgt::start(8 << 20) else { return };
    t.adm(&[
        "--op",
        "new",
        "--mode",
        "account",
        "--user",
        "mcsiuser",
        "--password",
        "mcsi-secret-0123",
    ]);
    t.adm(&[
        "--op", "bind", "--mode", "account", "--tid", "1", "--user", "mcsiuser",
    ]);
    let plain = IscsiUrl::parse(&t.url()).unwrap();
    let with = IscsiUrl::parse(
        &t.url()
            .replace("iscsi://", "iscsi://mcsiuser%mcsi-secret-0123@"),
    )
    .unwrap();
    let wrong = IscsiUrl::parse(
        &t.url()
            .replace("iscsi://", "iscsi://mcsiuser%not-the-secret@"),
    )
    .unwrap();
    rt().block_on(async {
        let opts = ConnectOptions {
            reconnect_attempts: 0,
            ..ConnectOptions::default()
        };
        let e = connect(&plain, opts.clone()).await.unwrap_err();
        assert!(
            matches!(e, Error::Login { .. } | Error::Negotiation(_)),
            "{e}"
        );
        let e = connect(&wrong, opts.clone()).await.unwrap_err();
        // tgt refuses a wrong CHAP response with class 2 (detail 0, not 1).
        assert!(matches!(e, Error::Login { class: 2, .. }), "{e}");
        let s = connect(&with, opts).await.unwrap();
        let lun = s.open_lun(1).await.unwrap();
        lun.write(0, bytes::Bytes::from(vec![0x5a; 512]))
            .await
            .unwrap();
        assert_eq!(&lun.read(0, 1).await.unwrap()[..], &[0x5a; 512][..]);
        s.logout().await.unwrap();
    });
}

#[test]
fn crc32c_digests_against_tgt() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(t) = Tgt::start(8 << 20) else { return };
    // tgt offers no digests unless told to.
    for key in ["HeaderDigest", "DataDigest"] {
        t.adm(&[
            "--op",
            "update",
            "--mode",
            "target",
            "--tid",
            "1",
            "--name",
            key,
            "--value",
            "CRC32C,None",
        ]);
    }
    let url = IscsiUrl::parse(&t.url()).unwrap();
    rt().block_on(async {
        let o = ConnectOptions {
            digests: true,
            ..ConnectOptions::default()
        };
        let s = connect(&url, o).await.unwrap();
        let p = s.params();
        assert!(
            p.header_digest && p.data_digest,
            "tgt should agree to CRC32C: {p:?}"
        );
        let lun = s.open_lun(1).await.unwrap();
        for (lba, len) in [(0u64, 512usize), (64, 1 << 20), (5000, 12800)] {
            let d: Vec<u8> = (0..len).map(|i| (i * 13 + 1) as u8).collect();
            lun.write(lba, bytes::Bytes::from(d.clone())).await.unwrap();
            assert!(lun.read(lba, (len / 512) as u32).await.unwrap()[..] == d[..]);
        }
        assert_eq!(s.stats().recoveries, 0);
        s.logout().await.unwrap();
    });
}
