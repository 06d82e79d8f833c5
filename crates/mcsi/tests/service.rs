//! mcsi as a systemd service: the unit file verifies, and `mcsi target` tells systemd
//! (Type=notify) that it is ready once its portals listen, when it reloads and when it stops.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_mcsi");

/// The next notification, as sd_notify sends it ("READY=1", ...).
fn next(sock: &UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    let n = sock.recv(&mut buf).expect("no notification within 20 s");
    String::from_utf8_lossy(&buf[..n]).trim_end().to_string()
}

#[test]
fn the_target_notifies_systemd_when_ready_reloading_and_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let port = free_port();
    let conf = dir.path().join("mcsi.toml");
    std::fs::write(
        &conf,
        format!("listen = [\"127.0.0.1:{port}\"]\n[[targets]]\niqn = \"iqn.2026-01.org.mcsi:svc\"\nluns = [{{ backend = \"ram:8MiB\" }}]\n"),
    )
    .unwrap();
    let mut child = Command::new(BIN)
        .args(["target", "--config"])
        .arg(&conf)
        .env("NOTIFY_SOCKET", &notify)
        .env("MCSI_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert_eq!(next(&sock), "READY=1");
    // Ready means listening: no wait needed.
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        "ready before listening"
    );
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
    assert_eq!(next(&sock), "RELOADING=1");
    assert_eq!(next(&sock), "READY=1");
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(next(&sock), "STOPPING=1");
    assert!(child.wait().unwrap().success());
}

#[test]
fn the_unit_file_verifies() {
    if !have("systemd-analyze") {
        skip(
            "the_unit_file_verifies",
            "no systemd-analyze (apt-get install systemd)",
        );
        return;
    }
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let unit = std::fs::read_to_string(format!("{root}/packaging/mcsi.service")).unwrap();
    for line in [
        "Type=notify",
        "ExecReload=/usr/bin/mcsi ctl --socket /run/mcsi/control.sock reload",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
    ] {
        assert!(unit.lines().any(|l| l == line), "the unit lacks {line}");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mcsi.service");
    std::fs::write(&path, unit.replace("/usr/bin/mcsi", BIN)).unwrap();
    let o = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&path)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        o.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {said}"
    );
    // The service's own file is a configuration the target takes.
    let conf = std::fs::read_to_string(format!("{root}/packaging/mcsi.toml")).unwrap();
    assert!(conf.contains("control = \"/run/mcsi/control.sock\""));
    let parsed = mcsi_target::config::ServerConfig::from_toml(&conf).unwrap();
    assert_eq!(
        parsed.control.as_deref(),
        Some(std::path::Path::new("/run/mcsi/control.sock"))
    );
}

#[test]
fn man_pages_and_completions_come_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(BIN)
        .args(["generate", "man", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success());
    let page = std::fs::read_to_string(dir.path().join("mcsi-target.1")).unwrap();
    assert!(
        page.contains("Serve SCSI block devices over iSCSI") && page.contains("\\-\\-control"),
        "{page}"
    );
    assert!(dir.path().join("mcsi-ctl-add-lun.1").exists());
    let o = Command::new(BIN)
        .args(["generate", "completions", "bash"])
        .output()
        .unwrap();
    let script = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && script.contains("add-lun") && script.contains("complete"),
        "{script}"
    );
}
