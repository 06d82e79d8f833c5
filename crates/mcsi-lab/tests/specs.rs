#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Every shipped spec parses, and a broken spec is refused with an error that names the field.

use mcsi_lab::spec::parse;

#[test]
fn every_shipped_spec_parses_and_expands() {
    for (name, text) in mcsi_lab::BUILTIN {
        let e = parse(name, name, text).unwrap_or_else(|e| panic!("{e}"));
        assert!(!e.points(false).is_empty(), "{name}: no points");
        assert!(!e.points(true).is_empty(), "{name}: no quick points");
        assert!(!e.claims.is_empty(), "{name}: no claims");
        assert!(!e.figures.is_empty(), "{name}: no figures");
        // Quick mode is for CI: about a minute of load at most.
        assert!(
            e.load_seconds(true) <= 90.0,
            "{name}: quick mode {} s",
            e.load_seconds(true)
        );
        // Points are distinct.
        let mut keys: Vec<String> = e.points(false).iter().map(|p| p.key()).collect();
        let n = keys.len();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), n, "{name}: duplicate points");
    }
}

const GOOD: &str = r#"
title = "t"
source = "s"
about = "a"
[base]
profile = "802.11b"
[sweep]
bs = ["2KiB", "4KiB"]
[[series]]
name = "one"
label = "one connection"
set = { connections = 1 }
[[series]]
name = "two"
label = "two connections"
set = { connections = 2, iodepth = 2 }
[[figure]]
name = "f"
title = "f"
x = "bs"
y = "bw_mbs"
[[claim]]
id = "c"
source = "s"
text = "t"
metric = "bw_mbs"
at = { series = "one", bs = "2KiB" }
published = 1.0
tolerance = 0.2
"#;

fn broken(from: &str, to: &str) -> String {
    assert!(GOOD.contains(from), "{from}");
    let text = GOOD.replacen(from, to, 1);
    match parse("x", "x.toml", &text) {
        Ok(_) => panic!("accepted a spec with {to}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_example_is_good() {
    let e = parse("x", "x.toml", GOOD).unwrap();
    assert_eq!(e.points(false).len(), 4);
    assert_eq!(e.points(false)[0].key(), "series=one;target=mcsi;client=mcsi-bench;rw=read;bs=2048;iodepth=1;connections=1;policy=round-robin;asymmetric=false;runtime=8;lun=ram:64MiB;profile=802.11b;mtu=1500");
}

#[test]
fn errors_name_the_field() {
    let cases = [
        (
            r#"bs = ["2KiB", "4KiB"]"#,
            r#"bs = ["2KiB", "4 furlongs"]"#,
            "sweep.bs[1]",
        ),
        (
            r#"bs = ["2KiB", "4KiB"]"#,
            r#"bz = ["2KiB"]"#,
            "unknown parameter 'bz'",
        ),
        (
            r#"bs = ["2KiB", "4KiB"]"#,
            r#"bs = "2KiB""#,
            "expected a list",
        ),
        (
            "set = { connections = 1 }",
            "set = { connections = 9 }",
            "series[0].set.connections",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { bs = "8KiB" }"#,
            "series[0].set.bs",
        ),
        (
            r#"profile = "802.11b""#,
            r#"profile = "802.11z""#,
            "base.profile",
        ),
        (r#"y = "bw_mbs""#, r#"y = "speed""#, "figure[0].y"),
        (r#"x = "bs""#, r#"x = "connections""#, "figure[0].x"),
        (
            r#"metric = "bw_mbs""#,
            r#"metric = "joy""#,
            "claim[0].metric",
        ),
        (
            r#"at = { series = "one", bs = "2KiB" }"#,
            r#"at = { series = "three", bs = "2KiB" }"#,
            "claim[0].at.series",
        ),
        (
            r#"at = { series = "one", bs = "2KiB" }"#,
            r#"at = { bs = "2KiB" }"#,
            "claim[0].at: selects 2 points",
        ),
        ("tolerance = 0.2", "tolerance = 0", "claim[0].tolerance"),
        (r#"name = "two""#, r#"name = "one""#, "series[1].name"),
        ("title = \"t\"", "titel = \"t\"", "unknown field `titel`"),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, client = "iscsi-perf", rw = "write" }"#,
            "iscsi-perf (libiscsi) only reads",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, target = "tgt", cc = "cubic" }"#,
            "only mcsi's target and bench do",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, cc = "cubic", initiator_cc = "reno" }"#,
            "not both",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, cc = "vegas2" }"#,
            "series[0].set.cc",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, policy = "fastest" }"#,
            "series[0].set.policy",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, policy = "weighted:0,0" }"#,
            "weighted:W1,W2",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, paths = "delay=1ms" }"#,
            "two or more paths",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, paths = "delay=1ms;delay=slow" }"#,
            "path 2 'delay=slow'",
        ),
        (
            "tolerance = 0.2",
            "tolerance = 0.2\nbound = \"above\"",
            "claim[0].bound",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, only = { bs = "3KiB" } }"#,
            "unknown parameter 'only'",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, client = "nbd-fio", rw = "read", bs_auto = "bdp" }"#,
            "the nbd-fio client reads fixed sizes",
        ),
    ];
    for (from, to, want) in cases {
        let e = broken(from, to);
        assert!(e.contains(want), "{to}: error '{e}' does not name '{want}'");
        assert!(e.starts_with("x.toml: "), "{e}");
    }
}

#[test]
fn link_errors_are_caught_before_running() {
    let e = broken(
        r#"profile = "802.11b""#,
        "profile = \"802.11b\"\nrate = \"5mbit\"",
    );
    assert!(e.contains("point series=one"), "{e}");
}

/// The nbd-fio client: mcsi nbd gets the session's parameters, fio the I/O's.
#[test]
fn nbd_fio_client_command() {
    let exp = mcsi_lab::builtin("nbd-wan").unwrap().unwrap();
    let points = exp.points(false);
    let p = points
        .iter()
        .find(|p| p.series == "nbd-cubic-c4")
        .expect("the point");
    let c = mcsi_lab::run::command(
        std::path::Path::new("/usr/bin/mcsi"),
        p,
        7,
        std::path::Path::new("/tmp/s.json"),
    )
    .unwrap();
    let args: Vec<String> = c
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let script = args.last().unwrap();
    assert!(
        script.contains("/usr/bin/mcsi nbd iscsi://$MCSI_LINK_PEER:"),
        "{script}"
    );
    assert!(script.contains("--connections 4"), "{script}");
    assert!(script.contains("--congestion cubic"), "{script}");
    assert!(script.contains("--ioengine=nbd"), "{script}");
    assert!(
        script.contains("--rw=read --bs=131072 --iodepth=8"),
        "{script}"
    );
    assert!(script.contains("--runtime=15 --randseed=7"), "{script}");
    // The target gets the congestion control too.
    let host = &args[args.iter().position(|a| a == "--host").unwrap() + 1];
    assert!(host.contains("--congestion cubic"), "{host}");
}
