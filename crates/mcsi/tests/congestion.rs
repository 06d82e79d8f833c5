//! Congestion control per session: `mcsi target --congestion` and `mcsi bench --congestion`
//! set TCP_CONGESTION on every socket of the session, as `ss -ti` sees during the run, and the
//! bench JSON reports what each connection runs. Names the kernel lacks are refused up front.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{have, skip};

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const IQN: &str = "iqn.2026-01.org.mcsi:cc-test";

fn mcsi() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mcsi"))
}

/// Each established TCP socket with `port` at one end: ((local port, peer port), algorithm),
/// from `ss -ti`.
fn ss_algorithms(port: u16) -> Vec<((u16, u16), String)> {
    let filter = format!("( sport = :{port} or dport = :{port} )");
    let out = Command::new("ss")
        .args(["-tinH", "state", "established", &filter])
        .output()
        .expect("run ss");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut found = Vec::new();
    let mut local_port = None;
    for line in text.lines() {
        if line.starts_with(char::is_whitespace) {
            if let (Some(lp), Some(cc)) = (local_port.take(), line.split_whitespace().next()) {
                found.push((lp, cc.to_string()));
            }
        } else {
            // "Recv-Q Send-Q Local:Port Peer:Port" (state is filtered, so not printed).
            let port_of = |i: usize| -> Option<u16> {
                line.split_whitespace()
                    .nth(i)
                    .and_then(|a| a.rsplit(':').next())
                    .and_then(|p| p.parse().ok())
            };
            local_port = port_of(2).zip(port_of(3));
        }
    }
    found
}

#[test]
fn each_side_runs_the_algorithm_it_was_given_on_every_socket() {
    if !have("ss") {
        skip(
            "each_side_runs_the_algorithm_it_was_given_on_every_socket",
            "ss is not installed (apt-get install iproute2)",
        );
        return;
    }
    let port = common::free_port();
    let mut target = mcsi()
        .args([
            "target",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--iqn",
            IQN,
        ])
        .args(["--lun", "ram:64MiB", "--congestion", "cubic"])
        .env("MCSI_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::wait_listening(port);
    let url = format!("iscsi://127.0.0.1:{port}/{IQN}/0");
    let bench = mcsi()
        .args([
            "bench",
            &url,
            "--connections",
            "3",
            "--iodepth",
            "6",
            "--bs",
            "64KiB",
        ])
        .args([
            "--rw",
            "randread",
            "--runtime",
            "3",
            "--json",
            "--congestion",
            "reno",
            "--target-tcp",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Sample the sockets while the run is under way.
    let mut seen: BTreeMap<(u16, u16), String> = BTreeMap::new();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(2500) {
        for (lp, cc) in ss_algorithms(port) {
            seen.insert(lp, cc);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = bench.wait_with_output().unwrap();
    let _ = target.kill();
    let _ = target.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let target_side: Vec<&String> = seen
        .iter()
        .filter(|((local, _), _)| *local == port)
        .map(|(_, c)| c)
        .collect();
    let initiator_side: Vec<&String> = seen
        .iter()
        .filter(|((local, _), _)| *local != port)
        .map(|(_, c)| c)
        .collect();
    assert_eq!(initiator_side.len(), 3, "{seen:?}");
    assert!(initiator_side.iter().all(|c| *c == "reno"), "{seen:?}");
    assert_eq!(target_side.len(), 3, "{seen:?}");
    assert!(target_side.iter().all(|c| *c == "cubic"), "{seen:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let conns = v["mcsi"]["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 3);
    for c in conns {
        assert_eq!(c["congestion"], "reno", "{c}");
        assert!(c["tcp"]["cwnd"].as_u64().unwrap() > 0, "{c}");
        assert!(c["tcp"]["delivery_rate"].as_u64().is_some(), "{c}");
        // The target's report of its sending side (X-org.mcsi.TcpReport): it sent the reads.
        let t = &c["target_tcp"];
        assert!(t["cwnd"].as_u64().unwrap() > 0, "{c}");
        assert!(t["bytes_sent"].as_u64().unwrap() > 1 << 20, "{c}");
    }
}

#[test]
fn unknown_algorithms_are_refused_with_what_the_kernel_offers() {
    for args in [
        vec![
            "bench",
            "iscsi://127.0.0.1:9/iqn.2026-01.org.mcsi:x/0",
            "--congestion",
            "nosuchcc",
        ],
        vec![
            "copy",
            "iscsi://127.0.0.1:9/iqn.2026-01.org.mcsi:x/0",
            "/dev/null",
            "--congestion",
            "nosuchcc",
        ],
        vec![
            "target",
            "--listen",
            "127.0.0.1:0",
            "--congestion",
            "nosuchcc",
        ],
        vec![
            "target",
            "--listen",
            "127.0.0.1:0",
            "--congestion",
            "Not A Name",
        ],
    ] {
        let out = mcsi().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains("--congestion"), "{args:?}: {err}");
        if args.contains(&"nosuchcc") {
            assert!(
                err.contains("not available") && err.contains("reno"),
                "{args:?}: {err}"
            );
        } else {
            assert!(err.contains("not a valid name"), "{args:?}: {err}");
        }
    }
}
