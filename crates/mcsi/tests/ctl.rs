//! `mcsi ctl` against a running `mcsi target --control`: what it lists, how it ends a session,
//! how it refuses bad requests (changing nothing), and that the socket serves only its owner.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_mcsi");
const IQN: &str = "iqn.2026-01.org.mcsi:ctl";

struct Target {
    child: Child,
    port: u16,
    sock: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> Target {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("run/control.sock");
    let port = free_port();
    let child = Command::new(BIN)
        .args([
            "target",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--iqn",
            IQN,
        ])
        .args(["--lun", "ram:64MiB", "--control"])
        .arg(&sock)
        .env("MCSI_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(port);
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no control socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    Target {
        child,
        port,
        sock,
        _dir: dir,
    }
}

fn ctl(sock: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("ctl")
        .arg("--socket")
        .arg(sock)
        .args(args)
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `mcsi bench URL` over two connections, mixed reads and writes for `secs` seconds (verified
/// if asked), running in the background with its output captured.
fn spawn_bench(url: &str, secs: u32, verify: bool) -> Child {
    let secs = secs.to_string();
    let mut args = vec![
        "bench",
        url,
        "--connections",
        "2",
        "--runtime",
        &secs,
        "--rw",
        "randrw",
    ];
    if verify {
        args.push("--verify");
    }
    Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// One raw request line, and the answer line.
fn raw(sock: &Path, line: &str) -> serde_json::Value {
    let mut s = std::os::unix::net::UnixStream::connect(sock).unwrap();
    s.write_all(line.as_bytes()).unwrap();
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).unwrap();
    serde_json::from_str(&answer).unwrap()
}

#[test]
fn ctl_lists_the_targets_and_sessions_and_ends_a_session() {
    let t = start();
    let mode = std::fs::metadata(&t.sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the socket is owner-only");
    let o = ctl(&t.sock, &["targets"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains(IQN) && stdout(&o).contains("LUN 0"),
        "{}",
        stdout(&o)
    );
    let o = ctl(&t.sock, &["sessions"]);
    assert_eq!(stdout(&o).trim(), "no sessions");

    // A bench of two connections runs for a while; ctl sees its session and ends it. mcsi's
    // initiator logs out when asked and logs in again, so the bench goes on to its end.
    let url = format!("iscsi://127.0.0.1:{}/{IQN}/0", t.port);
    let bench = spawn_bench(&url, 10, false);
    let t0 = Instant::now();
    let session = loop {
        let o = ctl(&t.sock, &["--json", "sessions"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let list = v["result"].as_array().unwrap().clone();
        if let Some(s) = list
            .iter()
            .find(|s| s["connections"].as_array().unwrap().len() == 2)
        {
            break s.clone();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no session of two connections: {v}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(session["target"], IQN);
    let tsih = session["tsih"].as_u64().unwrap().to_string();
    let o = ctl(&t.sock, &["end-session", &tsih, "--grace", "3s"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("the initiator logged out"),
        "{}",
        stdout(&o)
    );
    let o = ctl(&t.sock, &["--json", "sessions"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["result"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["tsih"].as_u64().unwrap().to_string() != tsih),
        "the ended session is gone: {v}"
    );
    let out = bench.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bad_requests_get_a_clear_error_and_change_nothing() {
    let t = start();
    let before = stdout(&ctl(&t.sock, &["--json", "targets"]));
    let o = ctl(&t.sock, &["end-session", "77"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no session with TSIH 77"),
        "{}",
        stderr(&o)
    );
    let o = ctl(&t.sock, &["end-session", "1", "--grace", "0s"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("outside 1 s to 300 s"),
        "{}",
        stderr(&o)
    );
    let o = ctl(&t.sock, &["end-session", "1", "--grace", "soon"]);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("--grace soon"), "{}", stderr(&o));
    // Lines that are not requests.
    let v = raw(&t.sock, "not json\n");
    assert_eq!(v["ok"], false);
    assert!(
        v["error"].as_str().unwrap().contains("does not parse"),
        "{v}"
    );
    let v = raw(&t.sock, "{\"op\": \"format-everything\"}\n");
    assert_eq!(v["ok"], false);
    assert!(
        v["error"].as_str().unwrap().contains("unknown variant"),
        "{v}"
    );
    let long = format!("{}\n", "x".repeat(70 << 10));
    let v = raw(&t.sock, &long);
    assert!(v["error"].as_str().unwrap().contains("longer than"), "{v}");
    let o = ctl(&t.sock, &["add-lun", "0", "ram:1MiB"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("LUN 0 is already in use"),
        "{}",
        stderr(&o)
    );
    let o = ctl(
        &t.sock,
        &[
            "add-lun",
            "--target",
            "iqn.2026-01.org.mcsi:nobody",
            "1",
            "ram:1MiB",
        ],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no target named iqn.2026-01.org.mcsi:nobody"),
        "{}",
        stderr(&o)
    );
    let o = ctl(&t.sock, &["add-lun", "1", "ram:lots"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("LUN 1"), "{}", stderr(&o));
    let o = ctl(&t.sock, &["remove-lun", "5"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no LUN 5"), "{}", stderr(&o));
    // A CHAP secret too short, or none at all; a name that is not an initiator name.
    let o = Command::new(BIN)
        .args(["ctl", "--socket"])
        .arg(&t.sock)
        .args(["add-chap-user", "bob", "--secret-env", "MCSI_TEST_SECRET"])
        .env("MCSI_TEST_SECRET", "short")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("a secret of 5 bytes is too short"),
        "{}",
        stderr(&o)
    );
    let o = ctl(&t.sock, &["add-chap-user", "bob"]);
    assert_eq!(o.status.code(), Some(2), "a usage error");
    assert!(stderr(&o).contains("--secret-file"), "{}", stderr(&o));
    let o = ctl(&t.sock, &["allow-initiator", "not a name"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("initiator name"), "{}", stderr(&o));
    // The last allowed name goes only with --open (an empty list admits any initiator).
    let host = "iqn.1993-08.org.debian:01:host1";
    assert!(ctl(&t.sock, &["allow-initiator", host]).status.success());
    let o = ctl(&t.sock, &["disallow-initiator", host]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("last allowed initiator"),
        "{}",
        stderr(&o)
    );
    let o = ctl(&t.sock, &["disallow-initiator", "--open", host]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Nothing changed, and the target still serves.
    assert_eq!(stdout(&ctl(&t.sock, &["--json", "targets"])), before);
    // No socket at all: says what to check.
    let o = ctl(Path::new("/nonexistent/mcsi.sock"), &["targets"]);
    assert_ne!(o.status.code(), Some(0));
    assert!(
        stderr(&o).contains("is the target running with --control"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn the_control_socket_refuses_other_users() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip(
            "the_control_socket_refuses_other_users",
            "needs root to run a client as another user",
        );
        return;
    }
    use std::os::unix::process::CommandExt;
    let t = start();
    // Let others reach the directory, so that only the socket's own mode stands in the way.
    std::fs::set_permissions(
        t.sock.parent().unwrap(),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    std::fs::set_permissions(t._dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_nobody = |sock: &Path| {
        Command::new(BIN)
            .arg("ctl")
            .arg("--socket")
            .arg(sock)
            .arg("sessions")
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap()
    };
    let o = as_nobody(&t.sock);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("permission denied"), "{}", stderr(&o));
    // With the file's mode opened, the server still refuses by the client's credentials.
    std::fs::set_permissions(&t.sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let o = as_nobody(&t.sock);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("serves only the user the target runs as"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_second_target_on_a_live_socket_is_refused_and_a_stale_one_is_replaced() {
    let mut t = start();
    let port = free_port();
    let o = Command::new(BIN)
        .args([
            "target",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--control",
        ])
        .arg(&t.sock)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(1),
        "an error while running, not a usage error"
    );
    assert!(
        stderr(&o).contains("another server is already listening"),
        "{}",
        stderr(&o)
    );
    // Killed, it leaves its socket file; the next start takes the path over.
    t.child.kill().unwrap();
    t.child.wait().unwrap();
    assert!(t.sock.exists());
    let mut again = Command::new(BIN)
        .args([
            "target",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--control",
        ])
        .arg(&t.sock)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(port);
    let t0 = Instant::now();
    let o = loop {
        let o = ctl(&t.sock, &["targets"]);
        if o.status.success() || t0.elapsed() > Duration::from_secs(10) {
            break o;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = again.kill();
    let _ = again.wait();
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn luns_come_and_go_while_a_verified_bench_runs_on_lun_0() {
    let t = start();
    let url = format!("iscsi://127.0.0.1:{}/{IQN}/0", t.port);
    let mut bench = spawn_bench(&url, 8, true);
    let t0 = Instant::now();
    let tsih = loop {
        let o = ctl(&t.sock, &["--json", "sessions"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        if let Some(s) = v["result"].as_array().unwrap().first() {
            break s["tsih"].clone();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no session");
        std::thread::sleep(Duration::from_millis(50));
    };
    let o = ctl(&t.sock, &["add-lun", "1", "ram:32MiB,block_size=4096"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A CHAP user from a file: new logins need it; the running session is not disturbed.
    let secret = t._dir.path().join("secret");
    std::fs::write(&secret, "carol-secret-42\n").unwrap();
    let o = Command::new(BIN)
        .args(["ctl", "--socket"])
        .arg(&t.sock)
        .args(["add-chap-user", "carol", "--secret-file"])
        .arg(&secret)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ctl(&t.sock, &["targets"]);
    assert!(stdout(&o).contains("CHAP users carol"), "{}", stdout(&o));
    // The last CHAP user goes only with --open (without one, logins need no CHAP).
    let o = ctl(&t.sock, &["remove-chap-user", "carol"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("last CHAP user"), "{}", stderr(&o));
    let o = ctl(&t.sock, &["remove-chap-user", "--open", "carol"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ctl(&t.sock, &["--json", "targets"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let luns = &v["result"][0]["luns"];
    assert_eq!(luns[1]["lun"], 1, "{v}");
    assert_eq!(luns[1]["block_size"], 4096, "{v}");
    // The new LUN serves I/O of its own.
    let url1 = format!("iscsi://127.0.0.1:{}/{IQN}/1", t.port);
    let o = Command::new(BIN)
        .args([
            "bench",
            &url1,
            "--runtime",
            "1",
            "--rw",
            "randwrite",
            "--verify",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ctl(&t.sock, &["remove-lun", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // The bench's session was never ended: the one there from the start is still there (the
    // bench runs 8 s, and this is well inside them).
    let o = ctl(&t.sock, &["--json", "sessions"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let now: Vec<_> = v["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["tsih"].clone())
        .collect();
    assert!(
        bench.try_wait().unwrap().is_none(),
        "the bench ended before the sessions were listed: too slow to tell"
    );
    assert_eq!(now, vec![tsih], "{v}");
    let out = bench.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(" 0 errors"), "{text}");
}

/// A configuration file with LUN 0 and `extra` LUN lines, on `port`, with the control socket.
fn file(port: u16, sock: &Path, extra: &str) -> String {
    format!(
        "listen = [\"127.0.0.1:{port}\"]\ncontrol = \"{}\"\n\n[[targets]]\niqn = \"{IQN}\"\nluns = [\n  {{ backend = \"ram:64MiB\" }},\n{extra}]\n",
        sock.display()
    )
}

#[test]
fn a_reload_applies_the_edited_file_and_refuses_what_needs_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("control.sock");
    let conf = dir.path().join("mcsi.toml");
    let port = free_port();
    std::fs::write(&conf, file(port, &sock, "")).unwrap();
    let mut child = spawn_config(&conf, port, &sock, &[]);
    let luns = || {
        let o = ctl(&sock, &["--json", "targets"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["result"][0]["luns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["lun"].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    let url = format!("iscsi://127.0.0.1:{port}/{IQN}/0");
    let bench = spawn_bench(&url, 6, true);

    // SIGHUP after adding LUN 1 to the file.
    std::fs::write(&conf, file(port, &sock, "  { backend = \"ram:16MiB\" },\n")).unwrap();
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
    let t0 = Instant::now();
    while luns() != vec![0, 1] {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "LUN 1 never came: {:?}",
            luns()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A change that needs a restart, and a file that does not parse: refused, nothing changes.
    std::fs::write(
        &conf,
        format!(
            "session_threads = 7\n{}",
            file(
                port,
                &sock,
                "  { backend = \"ram:16MiB\" },\n  { backend = \"ram:8MiB\" },\n",
            )
        ),
    )
    .unwrap();
    let o = ctl(&sock, &["reload"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot change while the target runs"),
        "{}",
        stderr(&o)
    );
    std::fs::write(&conf, "listen = [oops\n").unwrap();
    let o = ctl(&sock, &["reload"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("not reloaded, nothing changed"),
        "{}",
        stderr(&o)
    );
    assert_eq!(luns(), vec![0, 1]);
    // LUN 1 out of the file again: reload removes it.
    std::fs::write(&conf, file(port, &sock, "")).unwrap();
    let o = ctl(&sock, &["reload"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("LUN 1 removed"), "{}", stdout(&o));
    assert_eq!(luns(), vec![0]);

    let out = bench.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(" 0 errors"), "{text}");
    let _ = child.kill();
    let _ = child.wait();
}

/// `mcsi target --config FILE` with `extra` arguments, waited for until it listens on `port`
/// and `sock` exists.
fn spawn_config(conf: &Path, port: u16, sock: &Path, extra: &[&str]) -> Child {
    let _ = std::fs::remove_file(sock);
    let child = Command::new(BIN)
        .args(["target", "--config"])
        .arg(conf)
        .args(extra)
        .env("MCSI_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(port);
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no control socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn a_saved_configuration_is_what_a_restart_serves() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("control.sock");
    let conf = dir.path().join("mcsi.toml");
    let port = free_port();
    let text = format!("# the site's own comment\n{}", file(port, &sock, ""));
    std::fs::write(&conf, &text).unwrap();
    let mut child = spawn_config(&conf, port, &sock, &[]);
    let o = ctl(
        &sock,
        &["add-lun", "5", "ram:16MiB,block_size=4096,serial=five"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ctl(&sock, &["allow-initiator", "iqn.2026-01.org.x:host1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "carol-secret-42\n").unwrap();
    let o = Command::new(BIN)
        .args(["ctl", "--socket"])
        .arg(&sock)
        .args(["add-chap-user", "carol", "--secret-file"])
        .arg(&secret)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // Mutual CHAP: the target's answer to dave comes from a file too; half of it is refused.
    let tsecret = dir.path().join("target-secret");
    std::fs::write(&tsecret, "target-secret-99\n").unwrap();
    let o = Command::new(BIN)
        .args(["ctl", "--socket"])
        .arg(&sock)
        .args(["add-chap-user", "dave", "--secret-file"])
        .arg(&secret)
        .args(["--mutual-user", "tgt-dave", "--mutual-secret-file"])
        .arg(&tsecret)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let half = raw(
        &sock,
        "{\"op\": \"add-chap-user\", \"user\": \"erin\", \"secret\": \"erin-secret-123\", \"mutual_user\": \"t\"}\n",
    );
    assert_eq!(half["ok"], false, "{half}");
    assert!(half["error"].as_str().unwrap().contains("both"), "{half}");
    // Shown, the secret is hidden unless asked for.
    let o = ctl(&sock, &["show-config"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let shown = stdout(&o);
    assert!(
        shown.contains("lun = 5") && shown.contains("(hidden)"),
        "{shown}"
    );
    assert!(!shown.contains("carol-secret-42"), "{shown}");
    // The file is untouched until saved.
    assert_eq!(std::fs::read_to_string(&conf).unwrap(), text);
    let o = ctl(&sock, &["save"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("saved "), "{}", stdout(&o));
    let saved = std::fs::read_to_string(&conf).unwrap();
    for want in [
        "# the site's own comment",
        "lun = 5",
        "serial = \"five\"",
        "carol-secret-42",
        "iqn.2026-01.org.x:host1",
        "mutual_user = \"tgt-dave\"",
        "target-secret-99",
    ] {
        assert!(saved.contains(want), "{want} not in:\n{saved}");
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&conf).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "it holds a CHAP secret");
    // The file now says what runs: a reload finds nothing to do.
    let o = ctl(&sock, &["reload"]);
    assert!(stdout(&o).contains("no change"), "{}", stdout(&o));
    // Restarted, the target serves what was saved.
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let mut child = spawn_config(&conf, port, &sock, &[]);
    let o = ctl(&sock, &["--json", "targets"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let t = &v["result"][0];
    let luns: Vec<u64> = t["luns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["lun"].as_u64().unwrap())
        .collect();
    assert_eq!(luns, [0, 5], "{v}");
    assert_eq!(t["luns"][1]["block_size"], 4096, "{v}");
    assert_eq!(t["luns"][1]["serial"], "five", "{v}");
    assert_eq!(t["allowed_initiators"][0], "iqn.2026-01.org.x:host1", "{v}");
    assert_eq!(t["chap_users"][0], "carol", "{v}");
    assert_eq!(t["chap_users"][1], "dave", "{v}");
    // An edit on disk not yet reloaded is not overwritten by a save; after a reload it is kept.
    let edited = format!("{saved}\n# an edit on disk\n");
    std::fs::write(&conf, &edited).unwrap();
    let o = ctl(&sock, &["save"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("changed since the target read it"),
        "{}",
        stderr(&o)
    );
    assert_eq!(std::fs::read_to_string(&conf).unwrap(), edited);
    let o = ctl(&sock, &["reload"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ctl(&sock, &["save"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::read_to_string(&conf)
        .unwrap()
        .contains("# an edit on disk"));
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn a_target_started_from_flags_saves_only_where_told() {
    let t = start();
    let o = ctl(&t.sock, &["save"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("started without --config"),
        "{}",
        stderr(&o)
    );
    let to = t._dir.path().join("saved.toml");
    let o = Command::new(BIN)
        .args(["ctl", "--socket"])
        .arg(&t.sock)
        .arg("save")
        .arg("--to")
        .arg(&to)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // The file loads: a target started from it checks it whole before it listens.
    let text = std::fs::read_to_string(&to).unwrap();
    assert!(text.contains(IQN) && text.contains("lun = 0"), "{text}");
    assert!(text.contains(&format!("127.0.0.1:{}", t.port)), "{text}");
    let o = Command::new(BIN)
        .args(["target", "--config"])
        .arg(&to)
        .args(["--listen", "127.0.0.1:1", "--control"])
        .arg(&t.sock)
        .output()
        .unwrap();
    // Refused for its live control socket, after the file was read and checked.
    assert!(
        stderr(&o).contains("another server is already listening"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_file_lun_grows_while_the_target_runs_and_is_saved_at_its_new_size() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("control.sock");
    let conf = dir.path().join("mcsi.toml");
    let img = dir.path().join("lun0.img");
    let port = free_port();
    std::fs::write(
        &conf,
        format!(
            "listen = [\"127.0.0.1:{port}\"]\ncontrol = \"{}\"\n[[targets]]\niqn = \"{IQN}\"\nluns = [{{ backend = \"file:{}:16MiB\" }}]\n",
            sock.display(),
            img.display()
        ),
    )
    .unwrap();
    let mut child = spawn_config(&conf, port, &sock, &[]);
    let blocks = |sock: &Path| {
        let o = ctl(sock, &["--json", "targets"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["result"][0]["luns"][0]["blocks"].as_u64().unwrap()
    };
    assert_eq!(blocks(&sock), 32768);
    let o = ctl(&sock, &["grow-lun", "0", "--size", "8MiB"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("only grows"), "{}", stderr(&o));
    let o = ctl(&sock, &["grow-lun", "0", "--size", "32MiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("65536 blocks, was 32768"),
        "{}",
        stdout(&o)
    );
    assert_eq!(blocks(&sock), 65536);
    // The new blocks serve I/O: a verified write run over the whole grown LUN.
    let o = Command::new(BIN)
        .args(["bench", &format!("iscsi://127.0.0.1:{port}/{IQN}/0")])
        .args(["--rw", "write", "--bs", "1MiB", "--verify", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["mcsi"]["verify"]["blocks_checked"], 32, "{v}");
    // Saved, the file opens the LUN at its new size after a restart.
    let o = ctl(&sock, &["save"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let saved = std::fs::read_to_string(&conf).unwrap();
    assert!(saved.contains(":33554432\""), "{saved}");
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let mut child = spawn_config(&conf, port, &sock, &[]);
    assert_eq!(blocks(&sock), 65536);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn access_given_on_the_command_line_is_not_saved_over_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("control.sock");
    let conf = dir.path().join("mcsi.toml");
    let port = free_port();
    let text = format!(
        "{}[targets.auth]\nallow_initiators = [\"iqn.2026-01.org.x:only\"]\n",
        file(port, &sock, "")
    );
    std::fs::write(&conf, &text).unwrap();
    let mut child = spawn_config(&conf, port, &sock, &["--allow-any"]);
    // --allow-any opened the target; saved, the file would lose its ACL for good.
    let o = ctl(&sock, &["save"]);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("command line"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&conf).unwrap(), text);
}

#[test]
fn allowed_networks_change_live_and_the_last_goes_only_with_open() {
    let t = start();
    let url = format!("iscsi://127.0.0.1:{}/{IQN}/0", t.port);
    let bench = || {
        Command::new(BIN)
            .args(["bench", &url, "--runtime", "0.2", "--rw", "randread"])
            .output()
            .unwrap()
    };
    let o = ctl(&t.sock, &["allow-network", "10.9.0.0/16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Loopback is not in the list now: the login is refused (authorization).
    let o = bench();
    assert!(
        !o.status.success(),
        "a login from outside the allowed networks went in"
    );
    let o = ctl(&t.sock, &["allow-network", "127.0.0.1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = bench();
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ctl(&t.sock, &["targets"]);
    assert!(
        stdout(&o).contains("networks 10.9.0.0/16 127.0.0.1/32"),
        "{}",
        stdout(&o)
    );
    for (args, why) in [
        (&["allow-network", "10.9.0.0/16"][..], "already allowed"),
        (&["allow-network", "10.9.0.0/99"][..], "network"),
        (&["disallow-network", "192.0.2.0/24"][..], "not on its list"),
    ] {
        let o = ctl(&t.sock, args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(stderr(&o).contains(why), "{args:?}: {}", stderr(&o));
    }
    let o = ctl(&t.sock, &["disallow-network", "10.9.0.0/16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ctl(&t.sock, &["disallow-network", "127.0.0.1"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("last allowed network"),
        "{}",
        stderr(&o)
    );
    let o = ctl(&t.sock, &["disallow-network", "--open", "127.0.0.1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ctl(&t.sock, &["targets"]);
    assert!(stdout(&o).contains("networks any"), "{}", stdout(&o));
}

/// The targets a server lists: (name, portals).
fn targets_of(sock: &Path) -> Vec<(String, Vec<String>)> {
    let o = ctl(sock, &["--json", "targets"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let p = t["portals"].as_array().unwrap();
            (
                t["name"].as_str().unwrap().to_string(),
                p.iter().map(|x| x.as_str().unwrap().to_string()).collect(),
            )
        })
        .collect()
}

#[test]
fn targets_and_portals_added_live_are_saved_and_served_after_a_restart() {
    const TWO: &str = "iqn.2026-01.org.mcsi:two";
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("control.sock");
    let conf = dir.path().join("mcsi.toml");
    let (p1, p2, p3) = (free_port(), free_port(), free_port());
    std::fs::write(&conf, file(p1, &sock, "")).unwrap();
    let mut child = spawn_config(&conf, p1, &sock, &[]);
    let url = format!("iscsi://127.0.0.1:{p1}/{IQN}/0");
    let bench = spawn_bench(&url, 8, true);

    // A second target on a portal of its own, served at once.
    let a2 = format!("127.0.0.1:{p2}");
    let o = ctl(
        &sock,
        &["add-target", TWO, "--lun", "ram:8MiB", "--listen", &a2],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(&a2), "{}", stdout(&o));
    let two = spawn_bench(&format!("iscsi://{a2}/{TWO}/0"), 1, true)
        .wait_with_output()
        .unwrap();
    assert!(
        two.status.success(),
        "{}",
        String::from_utf8_lossy(&two.stderr)
    );
    assert!(String::from_utf8_lossy(&two.stdout).contains(" 0 errors"));
    // Refused, nothing changed: the same name again; a portal that cannot bind; no target named.
    let o = ctl(&sock, &["add-target", TWO, "--lun", "ram:8MiB"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("served already"), "{}", stderr(&o));
    let o = ctl(&sock, &["add-portal", "--target", IQN, "192.0.2.1:3260"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot listen on 192.0.2.1:3260"),
        "{}",
        stderr(&o)
    );
    let o = ctl(&sock, &["add-portal", &format!("127.0.0.1:{p3}")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("name the target"), "{}", stderr(&o));
    // The first target gets a second portal.
    let a3 = format!("127.0.0.1:{p3}");
    let o = ctl(&sock, &["add-portal", "--target", IQN, &a3]);
    assert!(o.status.success(), "{}", stderr(&o));
    let a1 = format!("127.0.0.1:{p1}");
    assert_eq!(
        targets_of(&sock),
        vec![
            (IQN.to_string(), vec![a1.clone(), a3.clone()]),
            (TWO.to_string(), vec![a2.clone()])
        ]
    );

    // Saved, and a restart serves the same.
    let o = ctl(&sock, &["save"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let saved = std::fs::read_to_string(&conf).unwrap();
    assert!(saved.contains(TWO) && saved.contains(&a3), "{saved}");
    let out = bench.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(" 0 errors"), "{text}");
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let mut child = spawn_config(&conf, p1, &sock, &[]);
    assert_eq!(
        targets_of(&sock),
        vec![
            (IQN.to_string(), vec![a1.clone(), a3.clone()]),
            (TWO.to_string(), vec![a2.clone()])
        ]
    );

    // The second target goes, and its portal with it; the file keeps it until saved.
    let o = ctl(&sock, &["remove-target", TWO, "--grace", "1s"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(targets_of(&sock).len(), 1);
    assert!(
        std::net::TcpStream::connect(&a2).is_err(),
        "{a2} still listens"
    );
    let o = ctl(&sock, &["remove-portal", "--target", IQN, &a3]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ctl(&sock, &["save"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let saved = std::fs::read_to_string(&conf).unwrap();
    assert!(!saved.contains(TWO) && !saved.contains(&a3), "{saved}");
    let o = ctl(&sock, &["reload"]);
    assert!(stdout(&o).contains("no change"), "{}", stdout(&o));
    let _ = child.kill();
    let _ = child.wait();
}

/// A loop device over a file of `bytes`, detached when dropped.
struct Loop {
    dev: String,
    file: PathBuf,
}

impl Loop {
    fn new(file: PathBuf, bytes: u64) -> Result<Loop, String> {
        let f = std::fs::File::create(&file).map_err(|e| e.to_string())?;
        f.set_len(bytes).map_err(|e| e.to_string())?;
        let o = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(&file)
            .output()
            .map_err(|e| format!("losetup: {e}"))?;
        if !o.status.success() {
            return Err(format!(
                "losetup: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        let dev = String::from_utf8_lossy(&o.stdout).trim().to_string();
        Ok(Loop { dev, file })
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

#[test]
fn a_block_lun_grows_after_its_device_did() {
    let dir = tempfile::tempdir().unwrap();
    let lo = match Loop::new(dir.path().join("dev.img"), 16 << 20) {
        Ok(l) => l,
        Err(why) => return skip("a_block_lun_grows_after_its_device_did", &why),
    };
    let t = start();
    let o = ctl(&t.sock, &["add-lun", "1", &format!("block:{}", lo.dev)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let blocks = || {
        let o = ctl(&t.sock, &["--json", "targets"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["result"][0]["luns"][1]["blocks"].as_u64().unwrap()
    };
    assert_eq!(blocks(), 32768);
    // mcsi does not grow a device: it says how, and changes nothing.
    let o = ctl(&t.sock, &["grow-lun", "1", "--size", "32MiB"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("grow the device itself"),
        "{}",
        stderr(&o)
    );
    assert_eq!(blocks(), 32768);
    // The device grows (its file, then the loop driver told), and the LUN follows.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&lo.file)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let o = Command::new("losetup")
        .args(["-c", &lo.dev])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = ctl(&t.sock, &["grow-lun", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(blocks(), 65536);
    // The new blocks serve I/O: a verified write run over the whole grown LUN.
    let o = Command::new(BIN)
        .args(["bench", &format!("iscsi://127.0.0.1:{}/{IQN}/1", t.port)])
        .args(["--rw", "write", "--bs", "1MiB", "--verify", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["mcsi"]["verify"]["blocks_checked"], 32, "{v}");
    let o = ctl(&t.sock, &["remove-lun", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A LUN's identity as an initiator reads it: VPD 80h (serial) and the logical unit's
/// designators of VPD 83h, through libiscsi's iscsi-inq.
fn identity(port: u16, iqn: &str, lun: u16) -> String {
    let url = format!("iscsi://127.0.0.1:{port}/{iqn}/{lun}");
    let mut out = String::new();
    for page in ["128", "131"] {
        let o = Command::new("iscsi-inq")
            .args(["-e", "1", "-c", page, &url])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        out.push_str(&String::from_utf8_lossy(&o.stdout));
    }
    // VPD 83h also names the target port (it follows the target's name): the LU's part only.
    let mut lu = false;
    let mut keep = Vec::new();
    for l in out.lines() {
        if l.starts_with("Association:") {
            lu = l.contains("LOGICAL_UNIT");
        }
        if l.contains("Serial") || (lu && l.starts_with("Designator")) {
            keep.push(l);
        }
    }
    keep.join("\n")
}

#[test]
fn a_saved_lun_keeps_its_identity_when_it_moves() {
    if !runs(
        "a_saved_lun_keeps_its_identity_when_it_moves",
        (!have("iscsi-inq")).then(|| "no iscsi-inq (libiscsi-bin)".to_string()),
    ) {
        return;
    }
    const MOVED: &str = "iqn.2026-01.org.mcsi:renamed";
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("control.sock");
    let conf = dir.path().join("mcsi.toml");
    let img = dir.path().join("lun1.img");
    let port = free_port();
    let lun1 = format!("  {{ backend = \"file:{}:16MiB\" }},\n", img.display());
    std::fs::write(&conf, file(port, &sock, &lun1)).unwrap();
    let mut child = spawn_config(&conf, port, &sock, &[]);
    let first = identity(port, IQN, 1);
    assert!(first.contains("Designator"), "{first}");
    let o = ctl(&sock, &["save"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let saved = std::fs::read_to_string(&conf).unwrap();
    assert!(saved.contains("naa = \"6"), "{saved}");

    // Unsaved, a LUN's identity follows its number and its target's name: the control.
    let unsaved = file(port, &sock, &lun1)
        .replace(IQN, MOVED)
        .replace("{ backend = \"file:", "{ lun = 7, backend = \"file:");
    std::fs::write(&conf, &unsaved).unwrap();
    let mut child = spawn_config(&conf, port, &sock, &[]);
    assert_ne!(identity(port, MOVED, 7), first);
    let _ = child.kill();
    let _ = child.wait();

    // Saved, it keeps it under another number and another target name.
    let moved = saved.replace(IQN, MOVED).replace("lun = 1,", "lun = 7,");
    assert_ne!(moved, saved.replace(IQN, MOVED), "the LUN moved");
    std::fs::write(&conf, &moved).unwrap();
    let mut child = spawn_config(&conf, port, &sock, &[]);
    assert_eq!(identity(port, MOVED, 7), first);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn lun_maps_change_live_are_saved_and_served_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("control.sock");
    let conf = dir.path().join("mcsi.toml");
    let port = free_port();
    std::fs::write(
        &conf,
        format!(
            "# kept\n{}",
            file(port, &sock, "  { backend = \"ram:16MiB\" },\n")
        ),
    )
    .unwrap();
    let mut child = spawn_config(&conf, port, &sock, &[]);
    let maps = || {
        let o = ctl(&sock, &["--json", "targets"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["result"][0]["lun_maps"].clone()
    };
    const HOST: &str = "iqn.2026-01.org.x:Host1";
    let o = ctl(&sock, &["map-lun", HOST, "0=1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("as its LUN 0"), "{}", stdout(&o));
    let o = ctl(&sock, &["map-lun", HOST, "4=0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        maps(),
        serde_json::json!([{"initiator": "iqn.2026-01.org.x:host1", "luns": [[0, 1], [4, 0]]}])
    );
    // Wrong requests say what is wrong and change nothing.
    for (args, why) in [
        (vec!["map-lun", HOST, "0=0"], "already"),
        (vec!["map-lun", HOST, "1=1"], "names a LUN once"),
        (vec!["map-lun", HOST, "2=9"], "no LUN 9"),
        (vec!["map-lun", HOST, "2"], "e.g. 0=3"),
        (vec!["unmap-lun", HOST, "7"], "has no LUN 7"),
        (
            vec!["unmap-lun", "iqn.2026-01.org.x:nobody", "--all"],
            "has no LUN map",
        ),
    ] {
        let o = ctl(&sock, &args);
        assert_ne!(o.status.code(), Some(0), "{args:?}");
        assert!(stderr(&o).contains(why), "{args:?}: {}", stderr(&o));
    }
    assert_eq!(maps()[0]["luns"], serde_json::json!([[0, 1], [4, 0]]));
    // Saved with the file's comment; a restart serves the map.
    let o = ctl(&sock, &["save"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let saved = std::fs::read_to_string(&conf).unwrap();
    assert!(
        saved.contains("# kept") && saved.contains("[[targets.lun_maps]]"),
        "{saved}"
    );
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let mut child = spawn_config(&conf, port, &sock, &[]);
    assert_eq!(maps()[0]["luns"], serde_json::json!([[0, 1], [4, 0]]));
    // One LUN out, then the whole map: the initiator sees every LUN again.
    let o = ctl(&sock, &["unmap-lun", HOST, "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(maps()[0]["luns"], serde_json::json!([[0, 1]]));
    let o = ctl(&sock, &["unmap-lun", HOST, "--all"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(maps(), serde_json::json!([]));
    let o = ctl(&sock, &["save"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!std::fs::read_to_string(&conf).unwrap().contains("lun_maps"));
    let _ = child.kill();
    let _ = child.wait();
}
