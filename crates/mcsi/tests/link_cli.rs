#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `mcsi link run` end to end: real namespaces and TUN devices, iperf3 and ping through the
//! emulated link. Every server is started with `--host` and binds only the link's host-side
//! address. Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN), /dev/net/tun, iperf3 and ping.
//! Without them the tests say so and pass, except under CI=true, where they fail.

mod common;
use common::free_port;

use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The measurements share two CPUs; one at a time keeps them honest.
static SERIAL: Mutex<()> = Mutex::new(());

fn mcsi() -> &'static str {
    env!("CARGO_BIN_EXE_mcsi")
}

/// Why this machine cannot run the tests, if it cannot.
fn missing() -> Option<String> {
    if let Some(why) = mcsi_link::run::missing_privileges() {
        return Some(why);
    }
    for tool in ["iperf3", "ping", "sh"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Some(format!("needs {tool} on PATH"));
        }
    }
    None
}

/// True if the test may run; under CI a missing prerequisite is a failure.
fn ready(test: &str) -> bool {
    common::runs(test, missing())
}

/// Whether a process named `name` (its comm) descends from `pid`.
fn has_descendant(pid: u32, name: &str) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    let parent = |p: u32| -> Option<(u32, String)> {
        let st = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        let (head, rest) = st.rsplit_once(") ")?;
        let comm = head.split_once(" (")?.1.to_string();
        let ppid = rest.split_whitespace().nth(1)?.parse().ok()?;
        Some((ppid, comm))
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != pid)
        .any(|p| {
            let Some((mut up, comm)) = parent(p) else {
                return false;
            };
            if comm != name {
                return false;
            }
            for _ in 0..16 {
                if up == pid {
                    return true;
                }
                match parent(up) {
                    Some((next, _)) if up > 1 => up = next,
                    _ => return false,
                }
            }
            false
        })
}

#[test]
fn paths_by_source_address_follow_the_connections_bind() {
    if !ready("paths_by_source_address_follow_the_connections_bind") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // One stream from the second address, which is path 1's: the slow path carries it all,
    // the control connection from the first address takes path 0.
    let (j, s) = iperf_over_two_paths("source", |port| {
        format!(
            "test \"$MCSI_LINK_ADDR_0\" = \"$MCSI_LINK_ADDR\" && test -n \"$MCSI_LINK_ADDR_1\" && \
             iperf3 -c \"$MCSI_LINK_PEER\" -p {port} -t 4 -B \"$MCSI_LINK_ADDR_1\" -J"
        )
    });
    let g = j["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap()
        / 1e6;
    eprintln!("goodput {g} Mbit/s from the second address");
    assert!(
        (1.5..=1.95).contains(&g),
        "{g} Mbit/s: not held to path 1's 2 Mbit/s"
    );
    let up = |p: usize| {
        s["summary"]["paths"][p]["up"]["bytes_out"]
            .as_u64()
            .unwrap()
    };
    assert!(up(1) > 500_000, "path 1 carried {} bytes", up(1));
    assert!(
        up(0) < 100_000,
        "path 0 carried {} bytes of a stream bound to path 1",
        up(0)
    );
}

#[test]
fn the_control_socket_fails_and_restores_a_path_on_command() {
    if !ready("the_control_socket_fails_and_restores_a_path_on_command") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let sock = std::env::temp_dir().join(format!("mcsi-link-ctl-{}.sock", std::process::id()));
    let sock_arg = sock.to_string_lossy().into_owned();
    // 40 pings 100 ms apart; the path goes down on command for about a second.
    let child = Command::new(mcsi())
        .args([
            "link",
            "run",
            "--delay",
            "1ms",
            "--control",
            &sock_arg,
            "--",
        ])
        .args([
            "sh",
            "-c",
            "ping -q -n -c 40 -i 0.1 -W 1 \"$MCSI_LINK_PEER\"",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let ctl = |words: &[&str]| {
        let out = Command::new(mcsi())
            .args(["link", "control", &sock_arg])
            .args(words)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let t0 = Instant::now();
    while !sock.exists() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(1500));
    let down = ctl(&["down", "0"]);
    let state = ctl(&["paths"]);
    let bad = ctl(&["down", "3"]);
    std::thread::sleep(Duration::from_millis(1000));
    let up = ctl(&["up", "0"]);
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(down.0 && down.1.contains("ok path 0 down"), "{down:?}");
    assert!(state.0 && state.1.contains("0 down"), "{state:?}");
    assert!(!bad.0 && bad.1.contains("path 3 does not exist"), "{bad:?}");
    assert!(up.0 && up.1.contains("ok path 0 up"), "{up:?}");
    let loss: f64 = text
        .split(',')
        .find_map(|p| p.trim().strip_suffix("% packet loss"))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no loss figure in ping output: {text}"));
    assert!((10.0..=40.0).contains(&loss), "{loss} % lost");
    assert!(!sock.exists(), "the socket file outlived the link");
}

#[test]
fn a_path_brought_down_and_up_loses_pings_only_between() {
    if !ready("a_path_brought_down_and_up_loses_pings_only_between") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // 40 pings 100 ms apart; the only path is down from 1.5 s to 2.5 s: about 10 lost.
    let (loss, _) = ping(
        &[
            "--delay",
            "1ms",
            "--path-down",
            "0@1.5s",
            "--path-up",
            "0@2.5s",
        ],
        40,
        "0.1",
    );
    assert!((15.0..=35.0).contains(&loss), "{loss} % lost");
    // Bad events are refused before the link starts.
    for (args, want) in [
        (
            ["--path-down", "1@1s"],
            "--path-down 1@1s: path 1 does not exist: the link has 1 path(s)",
        ),
        (["--path-up", "0"], "--path-up '0': expected PATH@TIME"),
        (["--mptcp", "--quiet"], "--mptcp needs --path-by source"),
    ] {
        let out = link_run(&args, "true");
        assert!(!out.status.success());
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(want), "{e}");
    }
}

/// iperf3 behind a link of two paths (4 Mbit/s 5 ms, 2 Mbit/s 20 ms) pinned `by`, its server on
/// the host side, the client from `client(port)`: iperf3's JSON and the link's summary.
fn iperf_over_two_paths(
    by: &str,
    client: impl Fn(&str) -> String,
) -> (serde_json::Value, serde_json::Value) {
    let port = free_port().to_string();
    let server = format!("iperf3 -s -1 -B \"$MCSI_LINK_PEER\" -p {port}");
    let summary = std::env::temp_dir().join(format!("mcsi-link-{by}-{}.json", std::process::id()));
    let summary_arg = summary.to_string_lossy().into_owned();
    let out = link_run(
        &[
            "--path",
            "rate=4mbit,delay=5ms",
            "--path",
            "rate=2mbit,delay=20ms",
            "--path-by",
            by,
            "--summary-json",
            &summary_arg,
            "--host",
            &server,
            "--host-wait",
            &port,
        ],
        &client(&port),
    );
    assert!(out.status.success(), "{out:?}");
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    let _ = std::fs::remove_file(&summary);
    (j, s)
}

fn link_run(opts: &[&str], script: &str) -> Output {
    let mut args = vec!["link", "run"];
    args.extend_from_slice(opts);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    let out = Command::new(mcsi()).args(&args).output().unwrap();
    eprintln!(
        "mcsi {}\n--- stderr ---\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// iperf3 client inside the link, a one-shot server on the host bound to the link's host-side
/// address; returns the receiver's goodput, Mbit/s.
fn iperf3_goodput(opts: &[&str], secs: u32) -> f64 {
    let port = free_port().to_string();
    let server = format!("iperf3 -s -1 -B \"$MCSI_LINK_PEER\" -p {port}");
    let mut all = opts.to_vec();
    all.extend_from_slice(&["--host", &server, "--host-wait", &port]);
    let out = link_run(
        &all,
        &format!("iperf3 -c \"$MCSI_LINK_PEER\" -p {port} -t {secs} -J"),
    );
    assert!(out.status.success(), "iperf3 client failed: {out:?}");
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bps = j["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap();
    eprintln!("iperf3 goodput {:.3} Mbit/s", bps / 1e6);
    bps / 1e6
}

/// Runs ping inside the link; returns (loss percent, average RTT in ms).
fn ping(opts: &[&str], count: u32, interval: &str) -> (f64, f64) {
    let out = link_run(
        opts,
        &format!("ping -q -n -c {count} -i {interval} -W 1 \"$MCSI_LINK_PEER\""),
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{text}");
    let loss: f64 = text
        .split(',')
        .find_map(|p| p.trim().strip_suffix("% packet loss"))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no loss figure in ping output: {text}"));
    // rtt min/avg/max/mdev = 20.111/20.195/20.639/0.078 ms
    let avg = text
        .lines()
        .find_map(|l| l.split_once(" = "))
        .and_then(|(_, v)| v.split('/').nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN);
    (loss, avg)
}

#[test]
fn rate_5mbit_delay_5ms_tcp_goodput() {
    if !ready("rate_5mbit_delay_5ms_tcp_goodput") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // 1500-byte packets carry 1448 bytes of TCP payload: at most 5 * 1448/1500 = 4.83 Mbit/s.
    let g = iperf3_goodput(&["--rate", "5mbit", "--delay", "5ms", "--seed", "1"], 6);
    assert!((4.3..=5.05).contains(&g), "goodput {g} Mbit/s");
}

#[test]
fn delay_10ms_ping_rtt() {
    if !ready("delay_10ms_ping_rtt") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (loss, avg) = ping(&["--delay", "10ms"], 50, "0.05");
    assert_eq!(loss, 0.0);
    assert!((19.0..=23.0).contains(&avg), "avg RTT {avg} ms");
}

#[test]
fn loss_5pct_both_ways_ping() {
    if !ready("loss_5pct_both_ways_ping") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Lost on the way out or back: 1 - 0.95^2 = 9.75 %; 400 pings, sd 1.5 %.
    let (loss, _) = ping(&["--loss", "5%", "--seed", "7"], 400, "0.01");
    assert!((4.0..=16.0).contains(&loss), "loss {loss} %");
}

#[test]
fn profile_80211b_tcp_goodput() {
    if !ready("profile_80211b_tcp_goodput") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Seed 000 section 3.2: 6.1 Mbit/s MAC, 4.9-5.2 Mbit/s TCP with 1500-byte packets.
    let g = iperf3_goodput(&["--profile", "802.11b", "--seed", "1"], 6);
    assert!((4.5..=5.4).contains(&g), "goodput {g} Mbit/s");
}

#[test]
fn two_paths_by_port_carry_separate_connections() {
    if !ready("two_paths_by_port_carry_separate_connections") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // iperf3 opens its control connection first (path 0), then the two data streams take
    // paths 1 and 0 in turn.
    let (j, s) = iperf_over_two_paths("port", |port| {
        format!("iperf3 -c \"$MCSI_LINK_PEER\" -p {port} -t 5 -P 2 -J")
    });
    let mut g: Vec<f64> = j["end"]["streams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["receiver"]["bits_per_second"].as_f64().unwrap() / 1e6)
        .collect();
    g.sort_by(f64::total_cmp);
    eprintln!("per-stream goodput {g:?} Mbit/s");
    // Each stream is held to its own path's rate (x 1448/1500 for headers).
    assert!((1.5..=1.95).contains(&g[0]), "{g:?}");
    assert!((3.2..=3.9).contains(&g[1]), "{g:?}");
    for p in 0..2 {
        let bytes = s["summary"]["paths"][p]["up"]["bytes_out"]
            .as_u64()
            .unwrap();
        assert!(bytes > 500_000, "path {p} carried {bytes} bytes");
    }
}

fn leftover_devices() -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("mcsil"))
        .filter(|n| {
            // Devices of other runs still alive are not ours to judge.
            let pid = n.trim_start_matches("mcsil").trim_end_matches('h');
            !std::path::Path::new(&format!("/proc/{pid}")).exists()
        })
        .collect()
}

#[test]
fn exit_status_environment_and_isolation() {
    if !ready("exit_status_environment_and_isolation") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let out = link_run(
        &["--quiet"],
        // The peer is set and inside 100.64.0.0/10; nothing but the peer is routable.
        "case \"$MCSI_LINK_PEER\" in 100.*) ;; *) exit 3;; esac; \
         ping -c 1 -W 1 192.0.2.1 >/dev/null 2>&1 && exit 4; exit 7",
    );
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert!(leftover_devices().is_empty(), "{:?}", leftover_devices());

    let out = Command::new(mcsi())
        .args(["link", "run", "--", "/nonexistent/program"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot run"));
}

#[test]
fn sigterm_stops_command_and_cleans_up() {
    if !ready("sigterm_stops_command_and_cleans_up") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut child = Command::new(mcsi())
        .args(["link", "run", "--delay", "1ms", "--", "sleep", "30"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let dev = format!("mcsil{}h", child.id());
    let t = Instant::now();
    while !std::path::Path::new(&format!("/sys/class/net/{dev}")).exists() {
        assert!(t.elapsed() < Duration::from_secs(5), "{dev} never appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SIGTERM once the command runs (not a fixed sleep: on a busy machine it may start late).
    let t = Instant::now();
    while !has_descendant(child.id(), "sleep") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the command never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(8), "mcsi did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    // sleep died of the forwarded SIGTERM: 128 + 15.
    assert_eq!(status.code(), Some(143));
    assert!(!std::path::Path::new(&format!("/sys/class/net/{dev}")).exists());
}

#[test]
fn sigkill_leaves_nothing_that_blocks_the_next_run() {
    if !ready("sigkill_leaves_nothing_that_blocks_the_next_run") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut child = Command::new(mcsi())
        .args(["link", "run", "--", "sleep", "30"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let dev = format!("mcsil{}h", child.id());
    let t = Instant::now();
    while !std::path::Path::new(&format!("/sys/class/net/{dev}")).exists() {
        assert!(t.elapsed() < Duration::from_secs(5), "{dev} never appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let t = Instant::now();
    while std::path::Path::new(&format!("/sys/class/net/{dev}")).exists() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{dev} outlived its process"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // A persistent leftover named after a pid that cannot exist (above the default
    // pid_max) is removed by the next run.
    let stale = "mcsil4194399h";
    let made = Command::new("ip")
        .args(["tuntap", "add", "dev", stale, "mode", "tun"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        made,
        "ip tuntap add {stale} failed: the stale-device check cannot run"
    );
    let out = link_run(&["--quiet"], "exit 0");
    assert!(out.status.success());
    assert!(!std::path::Path::new(&format!("/sys/class/net/{stale}")).exists());
}

#[test]
fn host_commands_see_the_link_and_keep_stdout_clean() {
    if !ready("host_commands_see_the_link_and_keep_stdout_clean") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let out = link_run(
        &[
            "--quiet",
            "--host",
            "echo \"host $MCSI_LINK_PEER $MCSI_LINK_ADDR\"",
        ],
        "sleep 0.3; echo \"cmd $MCSI_LINK_PEER $MCSI_LINK_ADDR\"",
    );
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    // Only the command writes to stdout; the host command's line went to stderr.
    let cmd_line = stdout.trim();
    assert!(cmd_line.starts_with("cmd 100."), "{stdout:?}");
    let host_line = cmd_line.replacen("cmd", "host", 1);
    assert!(
        stderr.contains(&host_line),
        "{host_line:?} not in {stderr:?}"
    );
    let addrs: Vec<&str> = cmd_line.split(' ').skip(1).collect();
    assert_eq!(addrs.len(), 2);
    assert_ne!(addrs[0], addrs[1]);
}

#[test]
fn host_wait_fails_clearly_when_the_server_dies() {
    if !ready("host_wait_fails_clearly_when_the_server_dies") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let port = free_port().to_string();
    let t = Instant::now();
    let out = link_run(
        &["--host", "sleep 0.2; exit 3", "--host-wait", &port],
        "echo must-not-run",
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "the command ran: {out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("host command 'sleep 0.2; exit 3' ended (exit status 3)")
            && err.contains(&format!(":{port} accepted")),
        "{err}"
    );

    // Nobody ever listens: the timeout names the port and what was still running.
    let out = link_run(
        &[
            "--host",
            "sleep 30",
            "--host-wait",
            &port,
            "--host-wait-timeout",
            "500ms",
        ],
        "echo must-not-run",
    );
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "the command ran: {out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(":{port} within 500ms")) && err.contains("'sleep 30'"),
        "{err}"
    );
}

#[test]
fn host_commands_are_stopped_and_reported() {
    if !ready("host_commands_are_stopped_and_reported") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    // What a run with nothing to stop costs on this machine now (namespaces, TUN, threads): the
    // bounds below are on top of it, so that a busy machine does not fail them.
    let t = Instant::now();
    assert!(link_run(&["--quiet"], "exit 0").status.success());
    let base = t.elapsed();
    // A grandchild of the host shell: the whole process group gets SIGTERM.
    let host = format!("sleep 30 & echo $! > {}; wait", pidfile.display());
    let t = Instant::now();
    let out = link_run(
        &["--host", &host, "--host", "sleep 0.2; exit 5"],
        "sleep 1; exit 4",
    );
    // The command's status, not the host commands'.
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    // The command's 1 s and the setup, not the host commands' 30 s nor the 5 s grace period
    // that a host command which missed its SIGTERM would wait for.
    assert!(
        t.elapsed() < base + Duration::from_secs(4),
        "{:?} (an empty run took {base:?})",
        t.elapsed()
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "host command 'sleep 0.2; exit 5' ended (exit status 5) while the command was running"
        ),
        "{err}"
    );
    let pid = std::fs::read_to_string(&pidfile).unwrap();
    // Once killed it is gone or a zombie waiting for init to reap it (state Z).
    let alive = || {
        std::fs::read_to_string(format!("/proc/{}/stat", pid.trim()))
            .ok()
            .and_then(|st| st.rsplit_once(") ").map(|(_, r)| !r.starts_with('Z')))
            .unwrap_or(false)
    };
    let t = Instant::now();
    while alive() && t.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!alive(), "the host command's child {pid} outlived the run");

    // A host command that ignores SIGTERM is killed after the 5 s grace period. The command
    // waits until the host shell has set its trap (else a SIGTERM sent before the trap, on a busy
    // machine, ends the shell at once).
    let ready = dir.path().join("trap-set");
    let host = format!("trap '' TERM; touch {}; sleep 30", ready.display());
    let cmd = format!("while [ ! -e {} ]; do sleep 0.05; done", ready.display());
    let t = Instant::now();
    let out = link_run(&["--quiet", "--host", &host], &cmd);
    let took = t.elapsed();
    assert!(out.status.success(), "{out:?}");
    // The 5 s grace period, and not much more than the setup on top of it.
    assert!(
        took >= Duration::from_millis(4500) && took < base + Duration::from_secs(8),
        "{took:?} (an empty run took {base:?})"
    );
}

#[test]
fn sigkill_also_ends_what_host_commands_started() {
    if !ready("sigkill_also_ends_what_host_commands_started") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let host = format!("sleep 30 & echo $! > {}; wait", pidfile.display());
    let mut child = Command::new(mcsi())
        .args(["link", "run", "-q", "--host", &host, "--", "sleep", "30"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let pid = loop {
        if let Some(p) = std::fs::read_to_string(&pidfile)
            .ok()
            .filter(|p| p.ends_with('\n'))
        {
            break p.trim().to_string();
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "host command never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    child.kill().unwrap();
    child.wait().unwrap();
    let alive = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|st| st.rsplit_once(") ").map(|(_, r)| !r.starts_with('Z')))
            .unwrap_or(false)
    };
    let t = Instant::now();
    while alive() && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        !alive(),
        "{pid}, started by a host command, outlived a SIGKILLed mcsi link"
    );
}
