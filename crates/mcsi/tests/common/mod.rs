//! Helpers shared by the integration tests that drive real peers (tgt, qemu-img, mcsi target).
// Each test binary that includes this module uses part of it.
#![allow(dead_code)]

use std::process::{Command, Stdio};

/// Whether `tool` is on PATH.
pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Under CI=true a missing tool is a failure, never a silent skip.
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// A test (or part of one, `what`) that cannot run here: under CI=true a failure; otherwise it
/// says why on stderr and appends the reason to `$MCSI_SKIP_LOG`, where `scripts/test` counts
/// it as skipped (cargo shows a passing test's output only with --nocapture).
pub fn skip(what: &str, why: &str) {
    assert!(!ci(), "{what}: {why} (CI=true: nothing is skipped)");
    eprintln!("{what}: SKIPPED: {why}");
    if let Some(path) = std::env::var_os("MCSI_SKIP_LOG") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{what}: {why}");
        }
    }
}

/// Whether `test` may run: `missing` is why it cannot ([`skip`]), or `None`.
pub fn runs(test: &str, missing: Option<String>) -> bool {
    match missing {
        None => true,
        Some(why) => {
            skip(test, &why);
            false
        }
    }
}

/// `GET path` from an HTTP server on `addr` (the `--metrics` endpoints); the body of a 200.
pub fn get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    body.to_string()
}

/// A port number no program on this machine serves now, from a loopback socket the kernel
/// picks it for (a server of a test binds it, or the same number on another address).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until something accepts TCP connections on 127.0.0.1:`port` (a server the test
/// started), 20 s at most.
pub fn wait_listening(port: u16) {
    let t0 = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "nothing listened on 127.0.0.1:{port} within 20 s: the server did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// An `mcsi target` (binary `bin`) on 127.0.0.1, stopped when dropped.
pub struct LocalTarget {
    child: std::process::Child,
    pub port: u16,
}

impl LocalTarget {
    /// Serves `iqn` with one LUN `lun` on a free port, quietly; listening when this returns.
    pub fn start(bin: &str, iqn: &str, lun: &str) -> LocalTarget {
        LocalTarget::start_at(bin, free_port(), iqn, lun)
    }

    /// [`LocalTarget::start`] on `port` (a target restarted where its initiators expect it).
    pub fn start_at(bin: &str, port: u16, iqn: &str, lun: &str) -> LocalTarget {
        let child = Command::new(bin)
            .args(["target", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--iqn", iqn, "--lun", lun])
            .env("MCSI_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting mcsi target");
        wait_listening(port);
        LocalTarget { child, port }
    }

    /// `iscsi://127.0.0.1:PORT/IQN/0`.
    pub fn url(&self, iqn: &str) -> String {
        format!("iscsi://127.0.0.1:{}/{iqn}/0", self.port)
    }
}

impl Drop for LocalTarget {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
