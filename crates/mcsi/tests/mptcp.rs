//! Multipath TCP as the transport: `mcsi target --mptcp`, `mcsi bench --mptcp`, and `mcsi link
//! run --mptcp`, which gives the initiator's namespace one subflow endpoint per path. One MPTCP
//! connection then reads over both routes; a plain TCP target still serves an MPTCP initiator.
//! Needs root (namespaces, TUN), MPTCP in the kernel and iproute2; without them the tests say so
//! and pass, except under CI=true, where they fail.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{free_port, LocalTarget};

use std::process::Command;

const IQN: &str = "iqn.2026-01.org.mcsi:mptcp-test";

fn mcsi() -> &'static str {
    env!("CARGO_BIN_EXE_mcsi")
}

fn missing() -> Option<String> {
    if let Some(why) = mcsi_link::run::missing_privileges() {
        return Some(why);
    }
    if !common::have("ip") {
        return Some("needs iproute2's ip".into());
    }
    let enabled = std::fs::read_to_string("/proc/sys/net/mptcp/enabled").unwrap_or_default();
    (enabled.trim() != "1").then(|| "needs MPTCP (net.mptcp.enabled = 1)".into())
}

#[test]
fn one_mptcp_connection_reads_over_both_routes() {
    if !common::runs("one_mptcp_connection_reads_over_both_routes", missing()) {
        return;
    }
    let port = free_port().to_string();
    let summary = std::env::temp_dir().join(format!("mcsi-mptcp-{}.json", std::process::id()));
    let args = [
        "link",
        "run",
        "--mptcp",
        "--path",
        "rate=20mbit,delay=5ms",
        "--path",
        "rate=20mbit,delay=5ms",
        "--path-by",
        "source",
        "--quiet",
        "--summary-json",
        &summary.to_string_lossy(),
        "--host",
        &format!(
            "{} target --mptcp --listen \"$MCSI_LINK_PEER:{port}\" --iqn {IQN} --lun ram:64MiB",
            mcsi()
        ),
        "--host-wait",
        &port,
        "--",
        "sh",
        "-c",
        &format!(
            "{} bench \"iscsi://$MCSI_LINK_PEER:{port}/{IQN}/0\" --mptcp --rw read --bs 256KiB --iodepth 4 --runtime 4 --json",
            mcsi()
        ),
    ];
    let out = Command::new(mcsi()).args(args).output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    let _ = std::fs::remove_file(&summary);
    let conns = v["mcsi"]["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 1, "{v}");
    assert_eq!(conns[0]["mptcp"]["extra_subflows"], 1, "{v}");
    // The reads came down both paths, a good share on each.
    let down: Vec<u64> = (0..2)
        .map(|p| {
            s["summary"]["paths"][p]["down"]["bytes_out"]
                .as_u64()
                .unwrap()
        })
        .collect();
    eprintln!("bytes down per path: {down:?}");
    for (p, b) in down.iter().enumerate() {
        assert!(*b > 1 << 20, "path {p} carried {b} bytes: {down:?}");
    }
}

#[test]
fn a_plain_tcp_target_serves_an_mptcp_initiator() {
    let target = LocalTarget::start(mcsi(), IQN, "ram:8MiB");
    let out = Command::new(mcsi())
        .args(["bench", &target.url(IQN)])
        .args(["--mptcp", "--runtime", "1", "--json"])
        .output()
        .unwrap();
    drop(target);
    let log = String::from_utf8_lossy(&out.stderr);
    if log.contains("MPTCP is not available") {
        common::skip("a_plain_tcp_target_serves_an_mptcp_initiator", &log);
        return;
    }
    assert!(out.status.success(), "{log}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // The kernel fell back to TCP: no MPTCP state on the connection.
    assert_eq!(
        v["mcsi"]["connections"][0]["mptcp"],
        serde_json::Value::Null,
        "{v}"
    );
    assert!(
        v["jobs"][0]["read"]["total_ios"].as_u64().unwrap() > 0,
        "{v}"
    );
}
