//! `mcsi target --metrics`: `mcsi monitor` follows a running session's connections (JSON lines,
//! at least one sample a second, and a PNG of the congestion windows), and the Prometheus
//! endpoint passes promtool's check.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{get, have, skip};

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const IQN: &str = "iqn.2026-01.org.mcsi:monitor-test";

struct Target {
    child: Child,
    portal: String,
    metrics: String,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_target() -> Target {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mcsi"))
        .args([
            "target",
            "--listen",
            "127.0.0.1:0",
            "--iqn",
            IQN,
            "--lun",
            "ram:64MiB",
        ])
        .args(["--metrics", "127.0.0.1:0", "--congestion", "reno"])
        .env("MCSI_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut portal, mut metrics) = (None, None);
    while portal.is_none() || metrics.is_none() {
        let l = lines.next().expect("target output ended").unwrap();
        if let Some(a) = l.strip_prefix("mcsi target listening on ") {
            portal = Some(a.trim().to_string());
        }
        if let Some(a) = l.strip_prefix("metrics on http://") {
            metrics = a.split('/').next().map(str::to_string);
        }
    }
    // Keep draining stdout so the target never blocks on it.
    std::thread::spawn(move || for _ in lines {});
    Target {
        child,
        portal: portal.unwrap(),
        metrics: metrics.unwrap(),
    }
}

#[test]
fn monitor_follows_a_running_sessions_connections() {
    let t = start_target();
    let url = format!("iscsi://{}/{IQN}/0", t.portal);
    let mut bench = Command::new(env!("CARGO_BIN_EXE_mcsi"))
        .args([
            "bench",
            &url,
            "--connections",
            "2",
            "--iodepth",
            "4",
            "--bs",
            "64KiB",
        ])
        .args(["--rw", "randread", "--runtime", "5"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait for the session to be there.
    let t0 = Instant::now();
    while !get(&t.metrics, "/state").contains("\"cid\":1") {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no session appeared"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("cwnd.png");
    let out = Command::new(env!("CARGO_BIN_EXE_mcsi"))
        .args([
            "monitor",
            &t.metrics,
            "--json",
            "--interval",
            "500ms",
            "--duration",
            "3s",
        ])
        .arg("--plot")
        .arg(&png)
        .output()
        .unwrap();
    let _ = bench.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for cid in [0, 1] {
        let mine: Vec<&serde_json::Value> = rows.iter().filter(|r| r["cid"] == cid).collect();
        assert!(mine.len() >= 5, "cid {cid}: {} samples", mine.len());
        let ts: Vec<f64> = mine.iter().map(|r| r["t"].as_f64().unwrap()).collect();
        for w in ts.windows(2) {
            assert!(
                w[1] > w[0] && w[1] - w[0] <= 1.0,
                "cid {cid}: samples at {ts:?}"
            );
        }
        assert!(mine
            .iter()
            .all(|r| r["congestion"] == "reno" && r["side"] == "target"));
        assert!(mine.iter().all(|r| r["cwnd"].as_u64().unwrap() > 0));
        // The connection is moving data while it is watched.
        assert!(
            mine.iter()
                .any(|r| r["send_rate"].as_f64().is_some_and(|v| v > 0.0)),
            "cid {cid}: {mine:?}"
        );
    }
    let png = std::fs::read(&png).unwrap();
    assert!(png.starts_with(b"\x89PNG") && png.len() > 5000);
}

#[test]
fn metrics_pass_promtool() {
    if !have("promtool") {
        skip(
            "metrics_pass_promtool",
            "promtool is not installed (apt-get install prometheus)",
        );
        return;
    }
    let t = start_target();
    let url = format!("iscsi://{}/{IQN}/0", t.portal);
    // A login whose InitiatorName would forge metric lines is refused (2/00), and leaves no
    // series behind.
    let hostile = "iqn.2026-01.org.x:a\"} 1\nmcsi_forged_total 99\n#";
    let out = Command::new(env!("CARGO_BIN_EXE_mcsi"))
        .args(["bench", &url, "--initiator-name", hostile, "--runtime", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "the hostile login was accepted");
    let out = Command::new(env!("CARGO_BIN_EXE_mcsi"))
        .args([
            "bench",
            &url,
            "--connections",
            "2",
            "--iodepth",
            "2",
            "--bs",
            "4KiB",
        ])
        .args(["--rw", "randwrite", "--size", "1MiB"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let mut bench = Command::new(env!("CARGO_BIN_EXE_mcsi"))
        .args([
            "bench",
            &url,
            "--connections",
            "2",
            "--iodepth",
            "2",
            "--runtime",
            "3",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let text = loop {
        let m = get(&t.metrics, "/metrics");
        if m.contains("mcsi_target_tcp_cwnd_segments{") {
            break m;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no connection series:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = bench.wait();
    assert!(!text.contains("mcsi_forged_total"), "{text}");
    assert!(
        text.contains(&format!("mcsi_target_sessions{{target=\"{IQN}\"}} 1")),
        "{text}"
    );
    assert!(
        text.contains("mcsi_target_lun_write_bytes_total{") && text.contains("lun=\"0\""),
        "{text}"
    );
    assert!(text.contains("congestion=\"reno\""), "{text}");
    let mut check = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let res = check.wait_with_output().unwrap();
    assert!(
        res.status.success(),
        "promtool check metrics:\n{}{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
    eprintln!(
        "promtool check metrics: ok ({} lines scraped)",
        text.lines().count()
    );
}

#[test]
fn monitor_follows_an_initiator_run() {
    let t = start_target();
    let url = format!("iscsi://{}/{IQN}/0", t.portal);
    let mut bench = Command::new(env!("CARGO_BIN_EXE_mcsi"))
        .args([
            "bench",
            &url,
            "--connections",
            "2",
            "--iodepth",
            "4",
            "--bs",
            "64KiB",
        ])
        .args([
            "--rw",
            "randwrite",
            "--runtime",
            "4",
            "--congestion",
            "cubic",
        ])
        .args(["--metrics", "127.0.0.1:0"])
        .env("MCSI_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(bench.stderr.take().unwrap()).lines();
    let addr = loop {
        let l = lines.next().expect("bench output ended").unwrap();
        if let Some(a) = l.strip_prefix("metrics on http://") {
            break a.split('/').next().unwrap().to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let out = Command::new(env!("CARGO_BIN_EXE_mcsi"))
        .args([
            "monitor",
            &addr,
            "--json",
            "--interval",
            "250ms",
            "--duration",
            "2s",
        ])
        .output()
        .unwrap();
    let _ = bench.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for cid in [0, 1] {
        let mine: Vec<&serde_json::Value> = rows.iter().filter(|r| r["cid"] == cid).collect();
        assert!(mine.len() >= 5, "cid {cid}: {rows:?}");
        assert!(mine
            .iter()
            .all(|r| r["side"] == "initiator" && r["congestion"] == "cubic"));
        // Writes: the initiator is the sender.
        assert!(mine
            .iter()
            .any(|r| r["send_rate"].as_f64().is_some_and(|v| v > 0.0)));
    }
}
