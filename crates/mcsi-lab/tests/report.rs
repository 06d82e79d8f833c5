#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Reports from synthetic runs: verdicts follow the numbers, ratios use medians, and the
//! figures and report are written (no root needed: nothing is run).

use mcsi_lab::report::{self, Meta, Verdict};
use mcsi_lab::results::{RunRow, RunWriter};
use mcsi_lab::spec::{parse, Metric};

const SPEC: &str = r#"
title = "synthetic"
source = "a test"
about = "numbers made up to check the report"
repetitions = 3
[base]
profile = "802.11b"
[sweep]
bs = ["2KiB", "8KiB", "128KiB"]
[[series]]
name = "one"
label = "one connection"
set = { connections = 1 }
[[series]]
name = "two"
label = "two connections"
set = { connections = 2, iodepth = 2 }
[[figure]]
name = "bw"
title = "throughput"
x = "bs"
y = "bw_mbs"
x_log = true
published = [{ label = "paper", points = [[2, 0.25], [128, 0.62]] }]
model = [{ label = "goodput", kind = "wlan-goodput" }]
[[claim]]
id = "single"
kind = "seed"
source = "s"
text = "one connection at 2 KiB: 0.25"
metric = "bw_mbs"
at = { series = "one", bs = "2KiB" }
published = 0.25
tolerance = 0.2
no_null = "a baseline"
[[claim]]
id = "gain"
kind = "seed"
source = "s"
text = "two connections double it"
metric = "bw_mbs"
at = { series = "two", bs = "2KiB" }
over = { series = "one", bs = "2KiB" }
published = 2.0
tolerance = 0.2
null = 1.0
discussion = "explained here: {metric=bw_mbs, series=two, bs=2KiB} against {metric=bw_mbs, stat=max, series=one, bs=2KiB}, {metric=bw_mbs, series=two, bs=2KiB / series=one, bs=2KiB} times; {published} against {quote:1.9 MB/s}"
[[claim]]
id = "big"
kind = "model"
source = "s"
text = "128 KiB"
metric = "bw_mbs"
at = { series = "one", bs = "128KiB" }
published = 0.62
tolerance = 0.1
null = { series = "two", bs = "128KiB" }
model = { label = "goodput", kind = "wlan-goodput" }
[[claim]]
id = "at-least"
kind = "goal"
source = "s"
text = "two connections add at least 10 %"
metric = "bw_mbs"
at = { series = "two", bs = "2KiB" }
over = { series = "one", bs = "2KiB" }
published = 1.1
tolerance = 0.01
bound = "at-least"
null = 1.0
[[claim]]
id = "at-most"
kind = "goal"
source = "s"
text = "two connections add at most 10 %"
metric = "bw_mbs"
at = { series = "two", bs = "2KiB" }
over = { series = "one", bs = "2KiB" }
published = 1.1
tolerance = 0.01
bound = "at-most"
null = 1.0
[[claim]]
id = "near-one"
kind = "seed"
source = "s"
text = "two connections add 10 %, give or take 15 %"
metric = "bw_mbs"
at = { series = "two", bs = "2KiB" }
over = { series = "one", bs = "2KiB" }
published = 1.1
tolerance = 0.15
null = 1.0
[[claim]]
id = "above"
kind = "goal"
source = "s"
text = "two connections move more than one in every run"
metric = "bw_mbs"
at = { series = "two", bs = "2KiB" }
over = { series = "one", bs = "2KiB" }
published = 1.0
bound = "above"
null = 1.0
[[claim]]
id = "below"
kind = "goal"
source = "s"
text = "at 8 KiB, two connections move less than one in every run"
metric = "bw_mbs"
at = { series = "two", bs = "8KiB" }
over = { series = "one", bs = "8KiB" }
published = 1.0
bound = "below"
null = 1.0
"#;

#[test]
fn verdicts_and_files() {
    let exp = parse("synthetic", "synthetic.toml", SPEC).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("synthetic");
    std::fs::create_dir_all(&d).unwrap();
    Meta::new(&exp, false, "2026-01-01 00:00:00".into(), "cubic".into())
        .save(&d)
        .unwrap();
    std::fs::write(d.join("spec.toml"), SPEC).unwrap();
    let mut w = RunWriter::open(&d.join("runs.csv")).unwrap();
    for rep in 1..=3u32 {
        for p in exp.points(false) {
            let kib = p.num("bs").unwrap();
            // one: 0.24/0.26/0.25 at 2 KiB (reproduced); two: 0.30 (gain 1.2, differs).
            let bw = match (p.series.as_str(), kib as u32) {
                ("one", 2) => [0.24, 0.26, 0.25][rep as usize - 1],
                ("two", 2) => 0.30,
                (_, 128) => 0.40,
                _ => 0.5,
            };
            // The 128 KiB point of series one fails in repetition 3.
            let failed = p.series == "one" && kib == 128.0 && rep == 3;
            w.append(&RunRow {
                key: p.key(),
                series: p.series.clone(),
                rep,
                seed: u64::from(rep),
                params: p
                    .params
                    .iter()
                    .map(|(d, v)| (d.name.to_string(), v.text.clone()))
                    .collect(),
                metrics: if failed {
                    vec![]
                } else {
                    vec![
                        (Metric::BwMbs, bw),
                        (Metric::Iops, bw * 1e6 / (kib * 1024.0)),
                    ]
                },
                status: if failed {
                    "failed: test".into()
                } else {
                    "ok".into()
                },
                congestion: "cubic".into(),
                started: "2026-01-01 00:00:00".into(),
                wall_s: 9.0,
            })
            .unwrap();
        }
    }
    // An attempt that failed for the machine's sake and was run again: listed, not counted.
    let p8 = exp
        .points(false)
        .into_iter()
        .find(|p| p.series == "two" && p.num("bs") == Some(8.0))
        .unwrap();
    w.append(&RunRow {
        key: p8.key(),
        series: p8.series.clone(),
        rep: 1,
        seed: 1,
        params: Default::default(),
        metrics: vec![],
        status: "retried: a port was in use: bind: Address already in use".into(),
        congestion: "cubic".into(),
        started: "2026-01-01 00:00:00".into(),
        wall_s: 1.0,
    })
    .unwrap();
    drop(w);
    let done = report::write_index(dir.path()).unwrap();
    assert_eq!(done.len(), 1);
    let j = &done[0].1.judged;
    assert_eq!(j[0].verdict, Verdict::Holds);
    assert_eq!(j[0].measured, Some((0.25, 0.24, 0.26)));
    assert_eq!(j[1].verdict, Verdict::Fails);
    let (m, lo, hi) = j[1].measured.unwrap();
    assert!(
        (m - 1.2).abs() < 1e-9
            && (lo - 0.30 / 0.26).abs() < 1e-9
            && (hi - 0.30 / 0.24).abs() < 1e-9
    );
    assert_eq!(j[2].verdict, Verdict::Fails, "0.40 against 0.62");
    assert_eq!(j[2].null, Some(0.40), "the null point's median");
    assert_eq!(j[2].runs, 2, "the failed run is not counted");
    // One-sided: 1.2x is at least 1.1x, and not at most 1.1x.
    assert_eq!(j[3].verdict, Verdict::Holds);
    assert_eq!(j[4].verdict, Verdict::Fails);
    // 1.2x is within 1.1x ± 15 %, but so is 1.0, the null: the run cannot tell.
    assert_eq!(j[5].verdict, Verdict::Inconclusive);
    // Strict bounds look at every run: 0.30 / 0.26 > 1 holds; at 8 KiB both move 0.5.
    assert_eq!(j[6].verdict, Verdict::Holds);
    assert_eq!(j[7].verdict, Verdict::Fails);
    assert_eq!(report::counts_line(j), "seeds: 1 of 3 reproduced (1 inconclusive, 1 differ); models: 0 of 1 reproduced (1 differ); mcsi goals: 2 of 4 met (2 missed)");
    let model = j[2].model.clone().unwrap().unwrap();
    assert!((0.6..0.66).contains(&model), "802.11b goodput {model}");
    let md = std::fs::read_to_string(d.join("report.md")).unwrap();
    assert!(
        md.contains("**reproduced**") && md.contains("**differs**"),
        "{md}"
    );
    assert!(
        md.contains("explained here: 0.300 against 0.260, 1.20 times; 2.00 against 1.9 MB/s"),
        "{md}"
    );
    assert!(
        md.contains("**inconclusive** (the null, 1.00 x, is inside 0.935-1.26 x)"),
        "{md}"
    );
    assert!(md.contains("| < 1.00 x |"), "{md}");
    assert!(
        md.contains("| ≥ 1.10 x |") && md.contains("| ≤ 1.10 x |"),
        "{md}"
    );
    assert!(md.contains("failed: test"));
    assert!(
        md.contains("18 runs (1 failed; 1 more attempt(s) failed for the machine's sake and were run again, listed below)"),
        "{md}"
    );
    assert!(md.contains("rep 1: retried: a port was in use"), "{md}");
    let png = std::fs::read(d.join("bw.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    assert!(dir.path().join("index.html").exists() && dir.path().join("index.md").exists());
    let results = std::fs::read_to_string(d.join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), 1 + 6);
}

#[test]
fn report_of_an_empty_directory_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let e = report::write_index(dir.path()).unwrap_err();
    assert!(e.contains("mcsi lab run"), "{e}");
}
