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
kind = "seed"
source = "s"
text = "t"
metric = "bw_mbs"
at = { series = "one", bs = "2KiB" }
published = 1.0
tolerance = 0.2
no_null = "a baseline"
discussion = "one connection moves {metric=bw_mbs, series=one, bs=2KiB} MB/s, {metric=bw_mbs, series=two, bs=2KiB / series=one, bs=2KiB} times less than two; the paper says {quote:0.25 MB/s}"
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
            r#"set = { connections = 1, cc = "cubic", target_cc = "reno" }"#,
            "or target_cc (the target side's route), not both",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, target_cc = "vegas2" }"#,
            "series[0].set.target_cc",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, sessions = 2, target = "tgt" }"#,
            "sessions runs several mcsi bench against mcsi's target",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, sessions = 9 }"#,
            "series[0].set.sessions",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, routes = 2 }"#,
            "set paths and path_by = \"source\"",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, path_by = "source" }"#,
            "path_by says how connections find their path: set paths too",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, paths = "delay=1ms;delay=2ms", path_by = "source", routes = 3 }"#,
            "routes 3 is more than the 2 paths",
        ),
        (
            "set = { connections = 1 }",
            r#"set = { connections = 1, path_by = "moon" }"#,
            "series[0].set.path_by",
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
            "tolerance = 0.2\nbound = \"over\"",
            "claim[0].bound",
        ),
        (
            "tolerance = 0.2",
            "tolerance = 0.2\nbound = \"above\"",
            "claim[0].tolerance: bound above is strict",
        ),
        ("tolerance = 0.2\n", "", "claim[0].tolerance: missing"),
        ("kind = \"seed\"\n", "", "claim[0].kind: missing"),
        (
            "kind = \"seed\"",
            "kind = \"paper\"",
            "claim[0].kind: 'paper'",
        ),
        (
            "no_null = \"a baseline\"\n",
            "",
            "claim[0].null: missing: what would be measured if the effect did not exist",
        ),
        (
            "no_null = \"a baseline\"",
            "no_null = \"a baseline\"\nnull = 1.0",
            "claim[0].no_null: give null or no_null, not both",
        ),
        ("no_null = \"a baseline\"", "no_null = \" \"", "say why"),
        (
            "no_null = \"a baseline\"",
            "null = { series = \"two\" }",
            "claim[0].null: selects 2 points",
        ),
        (
            "no_null = \"a baseline\"",
            "null = \"none\"",
            "claim[0].null: expected a number or a point",
        ),
        (
            "{metric=bw_mbs, series=one, bs=2KiB} MB/s",
            "0.41 MB/s",
            "claim[0].discussion: '0.41 MB/s' is written as text",
        ),
        (
            "times less",
            "times less, 3 times more, 1.5x",
            "'3 times' is written as text",
        ),
        (
            "{metric=bw_mbs, series=one, bs=2KiB}",
            "{metric=bw_mbs, series=one}",
            "selects 2 points",
        ),
        (
            "{metric=bw_mbs, series=one, bs=2KiB}",
            "{metric=speed, series=one, bs=2KiB}",
            "unknown metric 'speed'",
        ),
        (
            "{metric=bw_mbs, series=one, bs=2KiB}",
            "{series=one, bs=2KiB}",
            "no metric",
        ),
        (
            "{metric=bw_mbs, series=one, bs=2KiB}",
            "{metric=bw_mbs, series=six, bs=2KiB}",
            "no series named 'six'",
        ),
        (
            "{metric=bw_mbs, series=one, bs=2KiB}",
            "{metric=bw_mbs, series=one, bs=2KiB",
            "without its }",
        ),
        (
            "{metric=bw_mbs, series=one, bs=2KiB}",
            "{metric=bw_mbs, stat=mean, series=one, bs=2KiB}",
            "stat 'mean'",
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
fn claims_carry_their_kind_null_and_discussion() {
    use mcsi_lab::spec::{Kind, Null, Piece, Stat};
    let e = parse("x", "x.toml", GOOD).unwrap();
    let c = &e.claims[0];
    assert_eq!(c.kind, Kind::Seed);
    assert!(matches!(&c.null, Null::None(w) if w == "a baseline"));
    let d = c.discussion.as_ref().unwrap();
    assert_eq!(d.len(), 6, "{d:?}");
    let Piece::Value(v) = &d[1] else {
        panic!("{d:?}")
    };
    assert_eq!(
        (v.stat, v.at.series.as_deref(), v.over.is_none()),
        (Stat::Median, Some("one"), true)
    );
    let Piece::Value(r) = &d[3] else {
        panic!("{d:?}")
    };
    assert_eq!(
        r.over.as_ref().and_then(|o| o.series.as_deref()),
        Some("one")
    );
    assert_eq!(d[5], Piece::Quote("0.25 MB/s".into()));
    // A ratio's null is a value; an absolute claim's may be a point.
    let t = GOOD.replace(
        "no_null = \"a baseline\"",
        "null = { series = \"two\", bs = \"2KiB\" }",
    );
    let e = parse("x", "x.toml", &t).unwrap();
    assert!(matches!(&e.claims[0].null, Null::At(s) if s.series.as_deref() == Some("two")));
    let t = GOOD.replace("no_null = \"a baseline\"", "null = 1");
    assert!(matches!(parse("x", "x.toml", &t).unwrap().claims[0].null, Null::Value(v) if v == 1.0));
}

#[test]
fn every_shipped_claim_has_a_kind_and_a_null_or_says_why_not() {
    use mcsi_lab::spec::Null;
    for (name, text) in mcsi_lab::BUILTIN {
        let e = parse(name, name, text).unwrap();
        for c in &e.claims {
            if let Null::None(why) = &c.null {
                assert!(why.len() > 10, "{name}: {}: no_null needs a reason", c.id);
            }
        }
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

#[test]
fn only_the_machines_faults_are_retried() {
    use mcsi_lab::run::machine_fault;
    assert_eq!(
        machine_fault(
            "mcsi link run exited with exit status: 1",
            "mcsi: error: bind 100.64.0.1:3260: Address already in use (os error 98)"
        ),
        Some("a port was in use")
    );
    assert_eq!(
        machine_fault(
            "mcsi link run exited with exit status: 1",
            "nothing listened on 100.64.0.1:3260 within 10s (host commands still running: 1)"
        ),
        Some("the server was slow to start")
    );
    assert_eq!(
        machine_fault("x", "tgtd did not start"),
        Some("the server was slow to start")
    );
    // A fault of the software is never retried: a crash, a protocol error, a hang.
    for e in [
        "bench reported error 5",
        "no I/O completed",
        "timed out after 68 s",
        "the target ended during the run",
        "connection 1 ran congestion control bbr instead of cubic",
    ] {
        assert_eq!(machine_fault(e, "thread 'main' panicked"), None, "{e}");
    }
}

#[test]
fn an_agreement_note_takes_numbers_from_the_data_or_quotes() {
    let with = |note: &str| {
        GOOD.replacen(
            "about = \"a\"",
            &format!("about = \"a\"\nagreement = \"{note}\""),
            1,
        )
    };
    let e = parse(
        "x",
        "x.toml",
        &with("the RTT was {quote:11.6 ms} against {metric=bw_mbs, series=one, bs=2KiB} MB/s"),
    )
    .unwrap();
    let pieces = e.agreement.expect("the note is kept");
    assert_eq!(pieces.len(), 5, "{pieces:?}");
    for (note, says) in [
        ("{published} is a claim's", "agreement"),
        ("{metric=bw_mbs, series=three, bs=2KiB}", "agreement"),
        ("it moved 1.45 MB/s", "written as text"),
    ] {
        let e = parse("x", "x.toml", &with(note)).unwrap_err().to_string();
        assert!(e.contains(says), "{note}: {e}");
    }
}
