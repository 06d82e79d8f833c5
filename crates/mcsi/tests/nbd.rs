//! `mcsi nbd` against libnbd's tools: an export of a 4-connection session to mcsi's target,
//! described by `nbdinfo`, written and read back byte-exact by `nbdcopy`, stopped cleanly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{get, have, skip};

use std::path::{Path, PathBuf};
use std::process::{Child, Command as Proc, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());
const IQN: &str = "iqn.2026-01.org.mcsi:nbd-test";

fn tools_or_skip() -> bool {
    for t in ["nbdinfo", "nbdcopy"] {
        if !have(t) {
            skip(
                "nbd tests",
                &format!("{t} is not installed (apt-get install libnbd-bin)"),
            );
            return false;
        }
    }
    true
}

struct Proc2 {
    child: Child,
    log: PathBuf,
}

impl Drop for Proc2 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool, child: &mut Child, log: &Path) {
    let t0 = Instant::now();
    while !ok() {
        if let Ok(Some(st)) = child.try_wait() {
            panic!(
                "{what} exited ({st}) before it was ready:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{what} did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn target(dir: &Path, size_mib: u64) -> (Proc2, u16) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    let log = dir.join("target.log");
    let mut child = Proc::new(env!("CARGO_BIN_EXE_mcsi"))
        .args([
            "target",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--iqn",
            IQN,
            "--lun",
            &format!("ram:{size_mib}MiB"),
            "--max-connections",
            "8",
        ])
        .env("MCSI_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn mcsi target");
    wait_for(
        "mcsi target",
        || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        &mut child,
        &log,
    );
    (Proc2 { child, log }, port)
}

fn nbd(dir: &Path, port: u16, extra: &[&str]) -> (Proc2, PathBuf) {
    nbd_of(dir, &format!("iscsi://127.0.0.1:{port}/{IQN}/0"), extra)
}

/// `mcsi nbd` of `what` (a URL or volume:SPEC) on a Unix socket in `dir`.
fn nbd_of(dir: &Path, what: &str, extra: &[&str]) -> (Proc2, PathBuf) {
    let sock = dir.join("nbd.sock");
    let log = dir.join("nbd.log");
    let mut child = Proc::new(env!("CARGO_BIN_EXE_mcsi"))
        .args(["nbd", what, "--socket", sock.to_str().unwrap()])
        .args(extra)
        .env("MCSI_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn mcsi nbd");
    wait_for(
        "mcsi nbd",
        || std::os::unix::net::UnixStream::connect(&sock).is_ok(),
        &mut child,
        &log,
    );
    (Proc2 { child, log }, sock)
}

fn uri(sock: &Path) -> String {
    format!("nbd+unix:///?socket={}", sock.display())
}

fn run(cmd: &mut Proc) -> String {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// SIGTERM, then the exit status and the log.
fn stop(mut p: Proc2) -> (std::process::ExitStatus, String) {
    sigterm(p.child.id());
    let t0 = Instant::now();
    let st = loop {
        if let Some(st) = p.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    (st, std::fs::read_to_string(&p.log).unwrap_or_default())
}

fn sigterm(pid: u32) {
    let st = Proc::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn nbdinfo_and_nbdcopy_through_a_four_connection_session() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if !tools_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (_t, port) = target(dir.path(), 320);
    let metrics = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let (n, sock) = nbd(
        dir.path(),
        port,
        &["--connections", "4", "--metrics", &metrics],
    );
    let log = std::fs::read_to_string(&n.log).unwrap();
    assert!(log.contains("connections=4"), "{log}");

    // nbdinfo: size, block sizes, flags.
    let j: serde_json::Value =
        serde_json::from_str(&run(Proc::new("nbdinfo").args(["--json", &uri(&sock)]))).unwrap();
    let e = &j["exports"][0];
    assert_eq!(e["export-name"], format!("{IQN}/0"));
    assert_eq!(e["export-size"], 320u64 << 20);
    assert_eq!(e["block_size_minimum"], 512);
    assert!(e["block_size_maximum"].as_u64().unwrap() >= 1 << 20);
    for flag in [
        "can_flush",
        "can_fua",
        "can_multi_conn",
        "can_trim",
        "can_zero",
    ] {
        assert_eq!(e[flag], true, "{flag} in {e}");
    }
    assert_eq!(e["is_read_only"], false);

    // 256 MiB of random data in through nbdcopy (several NBD connections at once: multi-conn),
    // and back out, byte-exact.
    let src = dir.path().join("src.bin");
    let mut data = vec![0u8; 256 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for c in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    std::fs::write(&src, &data).unwrap();
    run(Proc::new("nbdcopy").arg(&src).arg(uri(&sock)));
    let back = dir.path().join("back.bin");
    run(Proc::new("nbdcopy").arg(uri(&sock)).arg(&back));
    let got = std::fs::read(&back).unwrap();
    assert_eq!(got.len(), 320 << 20, "the whole export is copied out");
    assert!(
        got[..data.len()] == data[..],
        "data read back differs from what was written"
    );
    assert!(
        got[data.len()..].iter().all(|&b| b == 0),
        "the rest reads as zeros"
    );

    // The metrics endpoint counts what went through the export, beside the session's
    // connections.
    let text = get(&metrics, "/metrics");
    let writes = text
        .lines()
        .find(|l| {
            l.starts_with("mcsi_initiator_nbd_request_bytes_total")
                && l.contains("request=\"write\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .expect("NBD write bytes in /metrics");
    assert_eq!(writes, 256 << 20, "{text}");
    assert!(
        text.contains("mcsi_initiator_connection_tasks_total"),
        "{text}"
    );
    let state: serde_json::Value = serde_json::from_str(&get(&metrics, "/state")).unwrap();
    // The whole export was read back (and nbdinfo read a little to guess the content).
    let read = state["nbd"][0]["read_bytes"].as_u64().unwrap();
    assert!(read >= 320 << 20, "{read}");
    assert_eq!(
        state["sessions"][0]["connections"]
            .as_array()
            .unwrap()
            .len(),
        4
    );

    // A clean stop: flush and logout, exit 0.
    let (st, log) = stop(n);
    assert!(st.success(), "mcsi nbd exited {st}:\n{log}");
    assert!(log.contains("flushed and logged out"), "{log}");
    assert!(!sock.exists(), "the socket file is removed at exit");
}

#[test]
fn read_only_export_and_unknown_export_name() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if !tools_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (_t, port) = target(dir.path(), 16);
    let (n, sock) = nbd(dir.path(), port, &["--read-only", "--name", "disk"]);
    let out = run(Proc::new("nbdinfo").args([
        "--json",
        &format!("nbd+unix:///disk?socket={}", sock.display()),
    ]));
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["exports"][0]["is_read_only"], true);
    // A write is refused.
    let src = dir.path().join("one.bin");
    std::fs::write(&src, vec![1u8; 4096]).unwrap();
    let w = Proc::new("nbdcopy")
        .arg(&src)
        .arg(uri(&sock))
        .output()
        .unwrap();
    assert!(
        !w.status.success(),
        "a write to a read-only export succeeded"
    );
    // An unknown export name is refused; the list names the one there is.
    let bad = Proc::new("nbdinfo")
        .arg(format!("nbd+unix:///nope?socket={}", sock.display()))
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("nope"), "{err}");
    let list = run(Proc::new("nbdinfo").args(["--list", "--json", &uri(&sock)]));
    let j: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(j["exports"].as_array().unwrap().len(), 1);
    assert_eq!(j["exports"][0]["export-name"], "disk");
    let (st, log) = stop(n);
    assert!(st.success(), "{log}");
}

#[test]
fn a_striped_volume_of_two_targets_as_one_export() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if !tools_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (da, db) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let (a, pa) = target(&da, 32);
    let (b, pb) = target(&db, 32);
    let spec = dir.path().join("two.toml");
    std::fs::write(
        &spec,
        format!(
            "layout = \"stripe\"\nchunk = \"128KiB\"\n[[member]]\nurl = \"iscsi://127.0.0.1:{pa}/{IQN}/0\"\n[[member]]\nurl = \"iscsi://127.0.0.1:{pb}/{IQN}/0\"\n"
        ),
    )
    .unwrap();
    let (n, sock) = nbd_of(
        dir.path(),
        &format!("volume:{}", spec.display()),
        &["--connections", "2"],
    );
    let j: serde_json::Value =
        serde_json::from_str(&run(Proc::new("nbdinfo").args(["--json", &uri(&sock)]))).unwrap();
    let e = &j["exports"][0];
    assert_eq!(e["export-name"], "two");
    assert_eq!(e["export-size"], 64u64 << 20, "both members");
    for flag in ["can_flush", "can_fua", "can_trim", "can_zero"] {
        assert_eq!(e[flag], true, "{flag} in {e}");
    }
    let src = dir.path().join("src.bin");
    let data: Vec<u8> = (0..48u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 9) as u8)
        .collect();
    std::fs::write(&src, &data).unwrap();
    run(Proc::new("nbdcopy").arg(&src).arg(uri(&sock)));
    let back = dir.path().join("back.bin");
    run(Proc::new("nbdcopy").arg(uri(&sock)).arg(&back));
    let got = std::fs::read(&back).unwrap();
    assert!(
        got[..data.len()] == data[..],
        "the volume reads back what was written"
    );
    let (st, log) = stop(n);
    assert!(st.success(), "{log}");
    assert!(log.contains("flushed and logged out"), "{log}");
    drop((a, b));
}

#[test]
fn a_degraded_mirror_export_shows_its_missing_member_in_metrics() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if !tools_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (a, pa) = target(dir.path(), 16);
    // Member 1's target is not running: with a bitmap, the mirror opens degraded.
    let pb = common::free_port();
    let spec = dir.path().join("pair.toml");
    std::fs::write(
        &spec,
        format!(
            "layout = \"mirror\"\nbitmap = \"pair.bitmap\"\n[[member]]\nurl = \"iscsi://127.0.0.1:{pa}/{IQN}/0\"\n[[member]]\nurl = \"iscsi://127.0.0.1:{pb}/{IQN}/0\"\n"
        ),
    )
    .unwrap();
    let metrics = {
        let p = common::free_port();
        format!("127.0.0.1:{p}")
    };
    let (n, sock) = nbd_of(
        dir.path(),
        &format!("volume:{}", spec.display()),
        &["--metrics", &metrics],
    );
    let src = dir.path().join("src.bin");
    std::fs::write(&src, vec![0x5au8; 3 << 20]).unwrap();
    run(Proc::new("nbdcopy").arg(&src).arg(uri(&sock)));
    let text = get(&metrics, "/metrics");
    let line = |name: &str, member: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name) && l.contains(&format!("member=\"{member}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} for member {member} in:\n{text}"))
    };
    assert_eq!(line("mcsi_initiator_volume_member_failed{", "0"), 0.0);
    assert_eq!(line("mcsi_initiator_volume_member_failed{", "1"), 1.0);
    assert_eq!(
        line("mcsi_initiator_volume_member_dirty_bytes{", "1"),
        f64::from(3u32 << 20),
        "the three 1 MiB regions written while member 1 was away"
    );
    let state: serde_json::Value = serde_json::from_str(&get(&metrics, "/state")).unwrap();
    assert_eq!(state["volumes"][0]["members"][1]["failed"], true, "{state}");
    let (st, log) = stop(n);
    assert!(st.success(), "{log}");
    assert!(log.contains("starts degraded"), "{log}");
    drop(a);
}

/// `--socket PATH` replaces only a socket nobody answers on: a regular file there is refused
/// with a clear error and left as it was.
#[test]
fn a_file_at_the_socket_path_is_never_deleted() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (_t, port) = target(dir.path(), 16);
    let path = dir.path().join("precious.txt");
    std::fs::write(&path, b"not a socket").unwrap();
    let log = dir.path().join("nbd.log");
    let mut child = Proc::new(env!("CARGO_BIN_EXE_mcsi"))
        .args([
            "nbd",
            &format!("iscsi://127.0.0.1:{port}/{IQN}/0"),
            "--socket",
            path.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // It must refuse at once, not replace the file and serve.
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("mcsi nbd took the path of a regular file and kept running");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = std::fs::read_to_string(&log).unwrap();
    assert!(!status.success(), "{err}");
    assert!(err.contains("exists and is not a socket"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
}
