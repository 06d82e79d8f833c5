#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `mcsi model` end to end: the acceptance figures through `--json`, tables, and errors.

use serde_json::Value;
use std::process::{Command, Output};

const MIB: f64 = 1048576.0;

fn mcsi(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mcsi"))
        .arg("model")
        .args(args)
        .output()
        .expect("run mcsi")
}

fn json(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = mcsi(&all);
    assert!(
        out.status.success(),
        "mcsi model {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn num(v: &Value, path: &[&str]) -> f64 {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_f64()
        .unwrap_or_else(|| panic!("{path:?} is not a number: {v}"))
}

fn fails(args: &[&str]) -> String {
    let out = mcsi(args);
    assert!(!out.status.success(), "mcsi model {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Seed 004's Q1-Q4 as (f, iops, size, rt).
const PAPER: [(&str, &str, &str, &str); 4] = [
    ("1", "82", "1KiB", "10ms"),
    ("0", "266", "1KiB", "3ms"),
    ("1", "76", "64KiB", "18"), // a bare number is milliseconds
    ("0", "208", "64KiB", "22ms"),
];

fn qos(q: (&str, &str, &str, &str)) -> Value {
    json(&[
        "qos",
        "--read-ratio",
        q.0,
        "--iops",
        q.1,
        "--size",
        q.2,
        "--rt",
        q.3,
        "--alpha",
        "0.1954",
        "--frame",
        "1500",
    ])
}

#[test]
fn qos_table1_prot_rt_toward_ip_storage() {
    let printed = [0.05, 1.84, 0.03, 15.67];
    for (q, want) in PAPER.into_iter().zip(printed) {
        let got = num(&qos(q), &["c_to_s", "bandwidth"]) / MIB;
        assert!((got - want).abs() <= 0.05 * want, "{q:?}: {got} vs {want}");
    }
}

#[test]
fn qos_table2_prot_and_naive() {
    // "prot" toward IP storage: eq. 5. The two figures with two significant digits must be
    // within 5 %; 0.0083 and 0.0077 MiB/s (Q1, Q3) round to the printed 0.01.
    let printed = [0.01, 0.29, 0.01, 14.08];
    for (q, want) in PAPER.into_iter().zip(printed) {
        let got = num(&qos(q), &["c_to_s", "protocol"]) / MIB;
        let ok = (got - want).abs() <= 0.05 * want || (got * 100.0).round() / 100.0 == want;
        assert!(ok, "{q:?}: {got} vs {want}");
    }
    // Exact bytes by hand: Q2 1130 B x 266 = 300580 B/s; Q4 70624 B x 208 = 14689792 B/s.
    assert_eq!(num(&qos(PAPER[1]), &["c_to_s", "protocol"]), 300580.0);
    let q4 = qos(PAPER[3]);
    assert_eq!(num(&q4, &["c_to_s", "protocol"]), 14689792.0);
    assert_eq!(num(&q4, &["s_to_c", "protocol"]), 106.0 * 208.0);
    assert_eq!(num(&q4, &["c_to_s", "naive"]), 208.0 * 65536.0);
    assert_eq!(num(&q4, &["s_to_c", "naive"]), 208.0 * 65536.0);
    // Eq. 9: the larger of eq. 5 and eq. 7.
    let bw = num(&q4, &["c_to_s", "bandwidth"]);
    let rt = num(&q4, &["c_to_s", "min_for_rt"]);
    assert_eq!(bw, rt);
    assert!((rt - 70624.0 / (0.1954 * 0.022)).abs() < 1e-3);
}

#[test]
fn wlan_defaults_80211b() {
    let v = json(&["wlan"]);
    let mac = num(&v, &["mac_throughput_bps"]);
    let tcp = num(&v, &["tcp_goodput_bps"]);
    assert!((6.0e6..=6.4e6).contains(&mac), "MAC {mac}");
    assert!((4.9e6..=5.2e6).contains(&tcp), "TCP {tcp}");
    // 8 x 1460 / 1906.545 us, by hand.
    assert!((mac - 6.126_264e6).abs() < 10.0, "{mac}");
    assert!((num(&v, &["mean_backoff_s"]) - 310e-6).abs() < 1e-12);
    // Explicit flags give the same as the defaults.
    let w = json(&[
        "wlan",
        "--standard",
        "802.11b",
        "--payload",
        "1500",
        "--rate",
        "11",
        "--ack-rate",
        "11",
        "--stations",
        "1",
        "--per",
        "0",
    ]);
    assert_eq!(num(&w, &["mac_throughput_bps"]), mac);
    // 10 % packet errors and one sender: 90 % of it.
    let e = json(&["wlan", "--per", "10%"]);
    assert!((num(&e, &["failure", "mac_throughput_bps"]) - 0.9 * mac).abs() < 1.0);
}

#[test]
fn tcp_mathis_acceptance() {
    let v = json(&["tcp", "--mss", "1448", "--rtt", "100ms", "--loss", "0.01"]);
    let m = num(&v, &["mathis_bps"]);
    // 1448 x 8 / 0.1 x sqrt(1.5) / 0.1 = 1418744 bit/s.
    assert!((m - 1_418_744.5).abs() < 1.0, "{m}");
    assert!(num(&v, &["padhye_bps"]) < m);
    assert_eq!(num(&v, &["aggregate_bps"]), num(&v, &["padhye_bps"]));
    // A percent means the same loss.
    let p = json(&["tcp", "--mss", "1448", "--rtt", "100", "--loss", "1%"]);
    assert_eq!(num(&p, &["mathis_bps"]), m);
    // Four connections on a 5 Mbit/s link are bounded by it.
    let n = json(&[
        "tcp",
        "--mss",
        "1448",
        "--rtt",
        "100ms",
        "--loss",
        "0.01",
        "--connections",
        "4",
        "--link-rate",
        "5mbit",
    ]);
    assert_eq!(num(&n, &["aggregate_bps"]), 5e6);
    assert_eq!(n["aggregate_limit"], "link");
}

#[test]
fn tcp_zero_loss() {
    let e = fails(&["tcp", "--mss", "1448", "--rtt", "100ms", "--loss", "0"]);
    assert!(e.contains("--wmax") && e.contains("--link-rate"), "{e}");
    let v = json(&[
        "tcp", "--mss", "1448", "--rtt", "100ms", "--loss", "0", "--wmax", "64KiB",
    ]);
    // 65536 B x 8 / 0.1 s.
    assert_eq!(num(&v, &["mathis_bps"]), 5_242_880.0);
    assert_eq!(v["mathis_limit"], "window");
}

#[test]
fn queue_models() {
    // M/M/2 with lambda 1, mu 1: P_Q = 1/3, T = 4/3 s; M/M/1 with the same mu: T = inf,
    // reported as unstable next to it. With mu_1 = 2: T = 1 s.
    let v = json(&[
        "queue",
        "--arrival",
        "1",
        "--service",
        "1",
        "--servers",
        "2",
    ]);
    assert!((num(&v, &["mmm", "queuing_probability"]) - 1.0 / 3.0).abs() < 1e-12);
    assert!((num(&v, &["mmm", "mean_delay_s"]) - 4.0 / 3.0).abs() < 1e-12);
    assert!(v["mm1"]["error"].as_str().unwrap().contains(">= 1"));
    let v = json(&[
        "queue",
        "--arrival",
        "1",
        "--service",
        "1",
        "--servers",
        "2",
        "--single-service",
        "2",
    ]);
    assert!((num(&v, &["mm1", "mean_delay_s"]) - 1.0).abs() < 1e-12);
    // Bit rates with a packet size: 4 Mbit/s of 1000-byte packets is 500 per second.
    let v = json(&[
        "queue",
        "--arrival",
        "4mbit",
        "--service",
        "8mbit",
        "--servers",
        "1",
        "--packet",
        "1000",
    ]);
    assert_eq!(num(&v, &["mmm", "arrival_per_s"]), 500.0);
    assert!((num(&v, &["mm1", "mean_delay_s"]) - 1.0 / 500.0).abs() < 1e-12);
}

#[test]
fn errors_are_clear() {
    let e = fails(&[
        "queue",
        "--arrival",
        "100",
        "--service",
        "50",
        "--servers",
        "2",
    ]);
    assert!(e.contains("utilization 1.000 >= 1"), "{e}");
    let e = fails(&[
        "qos",
        "--read-ratio",
        "1",
        "--iops",
        "82",
        "--size",
        "1KiB",
        "--rt",
        "10ms",
        "--alpha",
        "1.5",
    ]);
    assert!(e.contains("alpha") && e.contains("between 0 and 1"), "{e}");
    let e = fails(&["tcp", "--mss", "1448", "--rtt", "0", "--loss", "0.01"]);
    assert!(e.contains("rtt"), "{e}");
    let e = fails(&["tcp", "--mss", "1448", "--rtt", "10ms", "--loss", "150%"]);
    assert!(e.contains("between 0 and 1"), "{e}");
    let e = fails(&["wlan", "--payload", "3000"]);
    assert!(e.contains("2304"), "{e}");
}

#[test]
fn tables_have_units() {
    let out = mcsi(&["wlan"]);
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("6.13 Mbit/s") && s.contains("5.02 Mbit/s"),
        "{s}"
    );
    let out = mcsi(&["tcp", "--mss", "1448", "--rtt", "100ms", "--loss", "1%"]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("1.42 Mbit/s"), "{s}");
    let out = mcsi(&[
        "qos",
        "--read-ratio",
        "0",
        "--iops",
        "208",
        "--size",
        "64KiB",
        "--rt",
        "22ms",
        "--alpha",
        "0.1954",
    ]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("15.66") && s.contains("MiB/s"), "{s}");
    let out = mcsi(&[
        "queue",
        "--arrival",
        "80",
        "--service",
        "100",
        "--servers",
        "2",
    ]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("M/M/1") && s.contains("M/M/2") && s.contains("ms"),
        "{s}"
    );
    // The alpha derivation is in qos's help.
    let out = mcsi(&["qos", "--help"]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("0.1954") && s.contains("15.67"), "{s}");
}
