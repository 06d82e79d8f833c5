//! Reports: for each experiment `report.md` (each claim with the published value, the model's,
//! the measured median with min and max, and a verdict; the figures; every point), and for a
//! directory of experiments an index in markdown and HTML.

use crate::model;
use crate::plot;
use crate::results::{self, Aggregate, RunRow};
use crate::spec::{Bound, Claim, Experiment, Kind, Null, Piece, Selector, Stat, ValueRef};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What a run directory records about how it was made (`meta.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Meta {
    pub experiment: String,
    pub quick: bool,
    pub mcsi_version: String,
    pub started_utc: String,
    pub finished_utc: Option<String>,
    /// The host's default TCP congestion control (the target's sockets use it).
    pub congestion: String,
    pub kernel: String,
    pub cpus: usize,
}

impl Meta {
    pub fn new(exp: &Experiment, quick: bool, started: String, congestion: String) -> Meta {
        Meta {
            experiment: exp.name.clone(),
            quick,
            mcsi_version: env!("CARGO_PKG_VERSION").to_string(),
            started_utc: started,
            finished_utc: None,
            congestion,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "unknown".into()),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }

    pub fn load(dir: &Path) -> Result<Meta, String> {
        let p = dir.join("meta.json");
        let s = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        serde_json::from_str(&s).map_err(|e| format!("{}: {e}", p.display()))
    }

    pub fn save(&self, dir: &Path) -> Result<(), String> {
        let p = dir.join("meta.json");
        let s = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        std::fs::write(&p, s + "\n").map_err(|e| format!("{}: {e}", p.display()))
    }
}

/// The verdict on one claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Verdict {
    /// The measurement is in the accepted range and the null is not: reproduced (a seed's or a
    /// model's claim) or met (a goal).
    Holds,
    /// The measurement is outside the accepted range: differs, or missed.
    Fails,
    /// The measurement is in the accepted range, but so is the null: the run cannot tell the
    /// effect from its absence.
    Inconclusive,
    NotMeasured,
}

impl Verdict {
    /// The word for a claim of kind `k`.
    pub fn word(self, k: Kind) -> &'static str {
        match self {
            Verdict::Holds => k.holds().0,
            Verdict::Fails => k.holds().1,
            Verdict::Inconclusive => "inconclusive",
            Verdict::NotMeasured => "not measured",
        }
    }
}

/// A claim set beside its measurement.
#[derive(Debug, Clone)]
pub struct Judged {
    pub claim: Claim,
    pub model: Option<Result<f64, String>>,
    /// Median, min and max.
    pub measured: Option<(f64, f64, f64)>,
    /// The null's value, when the claim has one and it was measured.
    pub null: Option<f64>,
    pub runs: usize,
    pub verdict: Verdict,
}

impl Judged {
    pub fn word(&self) -> &'static str {
        self.verdict.word(self.claim.kind)
    }
}

fn find<'a>(aggs: &'a [Aggregate], sel: &Selector) -> Option<&'a Aggregate> {
    aggs.iter().find(|a| sel.matches(&a.point))
}

/// Whether `x` is in the claim's accepted range (for a strict bound: beyond the published value).
pub fn accepted(c: &Claim, x: f64) -> bool {
    let p = c.published;
    match c.bound {
        None => (x - p).abs() <= c.tolerance * p,
        Some(Bound::AtLeast) => x >= p * (1.0 - c.tolerance),
        Some(Bound::AtMost) => x <= p * (1.0 + c.tolerance),
        Some(Bound::Above) => x > p,
        Some(Bound::Below) => x < p,
    }
}

/// The accepted range in words: `0.90-1.06 x`, `≥ 1.27 x`, `< 1.00 x`.
pub fn range_text(c: &Claim) -> String {
    let p = c.published;
    let u = unit(c);
    match c.bound {
        None => format!(
            "{}-{} {u}",
            num(p * (1.0 - c.tolerance)),
            num(p * (1.0 + c.tolerance))
        ),
        Some(Bound::AtLeast) => format!("≥ {} {u}", num(p * (1.0 - c.tolerance))),
        Some(Bound::AtMost) => format!("≤ {} {u}", num(p * (1.0 + c.tolerance))),
        Some(Bound::Above) => format!("> {} {u} in every run", num(p)),
        Some(Bound::Below) => format!("< {} {u} in every run", num(p)),
    }
}

/// The median, min or max of `metric` at one point, or the ratio of the medians at two.
pub fn value_of(aggs: &[Aggregate], v: &ValueRef) -> Option<f64> {
    let at = find(aggs, &v.at)?.metrics.get(&v.metric)?;
    match &v.over {
        None => Some(match v.stat {
            Stat::Median => at.median,
            Stat::Min => at.min,
            Stat::Max => at.max,
        }),
        Some(o) => {
            let o = find(aggs, o)?.metrics.get(&v.metric)?;
            (o.median > 0.0).then(|| at.median / o.median)
        }
    }
}

/// Judges one claim against the aggregated runs.
pub fn judge(c: &Claim, aggs: &[Aggregate]) -> Judged {
    let at = find(aggs, &c.at);
    let over = c.over.as_ref().map(|s| find(aggs, s));
    let spread = |a: Option<&Aggregate>| a.and_then(|a| a.metrics.get(&c.metric).copied());
    let measured = match over {
        None => spread(at).map(|s| (s.median, s.min, s.max)),
        Some(o) => match (spread(at), spread(o)) {
            (Some(a), Some(b)) if b.min > 0.0 && b.median > 0.0 => {
                Some((a.median / b.median, a.min / b.max, a.max / b.min))
            }
            _ => None,
        },
    };
    let model = c.model.as_ref().and_then(|m| {
        let a = at?;
        Some(match over {
            None => model::value(m, &a.point, c.metric),
            Some(o) => {
                let o = o?;
                model::value(m, &a.point, c.metric)
                    .and_then(|x| model::value(m, &o.point, c.metric).map(|y| x / y))
            }
        })
    });
    let null = match &c.null {
        Null::Value(v) => Some(*v),
        Null::At(sel) => spread(find(aggs, sel)).map(|s| s.median),
        Null::None(_) => None,
    };
    let runs = at.map_or(0, |a| a.runs);
    let verdict = match measured {
        None => Verdict::NotMeasured,
        Some((m, lo, hi)) => {
            let holds = match c.bound {
                Some(Bound::Above) => lo > c.published,
                Some(Bound::Below) => hi < c.published,
                _ => accepted(c, m),
            };
            let null_in = match (&c.null, null) {
                (Null::None(_), _) => false,
                // A null point that was not measured cannot rule the null out.
                (_, None) => true,
                (_, Some(n)) => accepted(c, n),
            };
            match (holds, null_in) {
                (false, _) => Verdict::Fails,
                (true, true) => Verdict::Inconclusive,
                (true, false) => Verdict::Holds,
            }
        }
    };
    Judged {
        claim: c.clone(),
        model,
        measured,
        null,
        runs,
        verdict,
    }
}

fn num(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn unit(c: &Claim) -> &'static str {
    if c.over.is_some() {
        "x"
    } else {
        c.metric.unit()
    }
}

/// The measured cell of a claim: `0.41 MB/s (0.40-0.42)`.
fn measured_cell(j: &Judged) -> String {
    match j.measured {
        None => "no successful run".into(),
        Some((m, lo, hi)) if j.runs > 1 => {
            format!("{} {} ({}-{})", num(m), unit(&j.claim), num(lo), num(hi))
        }
        Some((m, _, _)) => format!("{} {} (1 run)", num(m), unit(&j.claim)),
    }
}

fn published_cell(c: &Claim) -> String {
    match c.bound {
        None => num(c.published),
        Some(b) => format!("{} {}", b.sign(), num(c.published)),
    }
}

fn verdict_cell(j: &Judged) -> String {
    let word = j.word();
    match (j.verdict, j.measured) {
        (Verdict::Fails, Some((m, _, _))) => {
            let pct = (m / j.claim.published - 1.0) * 100.0;
            format!("**{word}** ({pct:+.0} %)")
        }
        (Verdict::Holds, Some((m, _, _))) => {
            let pct = (m / j.claim.published - 1.0) * 100.0;
            match j.claim.bound {
                None => format!(
                    "**{word}** ({pct:+.0} %, within ±{:.0} %)",
                    j.claim.tolerance * 100.0
                ),
                Some(b) if b.strict() => format!("**{word}** ({} holds in every run)", b.sign()),
                Some(b) => format!("**{word}** ({pct:+.0} %, {} holds)", b.sign()),
            }
        }
        (Verdict::Inconclusive, _) => match j.null {
            Some(n) => format!(
                "**{word}** (the null, {} {}, is inside {})",
                num(n),
                unit(&j.claim),
                range_text(&j.claim)
            ),
            None => format!("**{word}** (the null point was not measured)"),
        },
        _ => format!("**{word}**"),
    }
}

fn null_cell(j: &Judged) -> String {
    match (&j.claim.null, j.null) {
        (Null::None(_), _) => "none (see below)".into(),
        (Null::Value(_), Some(n)) => format!("{} {}", num(n), unit(&j.claim)),
        (Null::At(sel), Some(n)) => format!("{} {} ({sel})", num(n), unit(&j.claim)),
        (Null::At(sel), None) => format!("not measured ({sel})"),
        (Null::Value(_), None) => "-".into(),
    }
}

/// A discussion with its numbers filled in from the data.
pub fn discussion(j: &Judged, pieces: &[Piece], aggs: &[Aggregate]) -> String {
    fill(pieces, aggs, Some(j))
}

/// Text with its placeholders filled: numbers from the data, and a claim's published and
/// model values when there is a claim (the spec refuses them elsewhere).
fn fill(pieces: &[Piece], aggs: &[Aggregate], j: Option<&Judged>) -> String {
    let mut out = String::new();
    for p in pieces {
        match (p, j) {
            (Piece::Text(t) | Piece::Quote(t), _) => out.push_str(t),
            (Piece::Published, Some(j)) => out.push_str(&num(j.claim.published)),
            (
                Piece::Model,
                Some(Judged {
                    model: Some(Ok(v)), ..
                }),
            ) => out.push_str(&num(*v)),
            (Piece::Published | Piece::Model, _) => out.push_str("n/a"),
            (Piece::Value(v), _) => out.push_str(&value_of(aggs, v).map_or("n/a".into(), num)),
        }
    }
    out
}

fn model_cell(j: &Judged) -> String {
    match &j.model {
        None => "-".into(),
        Some(Ok(v)) => format!(
            "{} {} ({})",
            num(*v),
            unit(&j.claim),
            j.claim.model.as_ref().map_or("", |m| m.label.as_str())
        ),
        Some(Err(e)) => format!("n/a: {e}"),
    }
}

/// What `write` produced.
#[derive(Debug, Clone)]
pub struct Written {
    pub report: PathBuf,
    pub figures: Vec<PathBuf>,
    pub judged: Vec<Judged>,
    pub meta: Meta,
}

/// Writes the figures and `report.md` of the experiment in `dir` (DIR/NAME).
pub fn write(exp: &Experiment, dir: &Path) -> Result<Written, String> {
    let meta = Meta::load(dir)?;
    let runs_csv = dir.join("runs.csv");
    let runs: Vec<RunRow> = results::load_runs(&runs_csv).map_err(|e| e.to_string())?;
    let aggs = results::aggregate(exp, meta.quick, &runs);
    results::write_results(exp, meta.quick, &runs, &dir.join("results.csv"))
        .map_err(|e| e.to_string())?;
    let reps = exp.repetitions(meta.quick);
    let runtime = aggs.first().map_or(0.0, |a| a.point.runtime());
    let mode = if meta.quick { "quick mode" } else { "full run" };
    let link = exp
        .base
        .iter()
        .filter(|(d, _)| d.role == crate::params::Role::Link)
        .map(|(d, v)| format!("{} {}", d.name, d.show(v)))
        .collect::<Vec<_>>()
        .join(", ");
    // An experiment whose points are all simulated does not touch the host's TCP.
    let all_sim = !aggs.is_empty() && aggs.iter().all(|a| crate::point::simulated(&a.point));
    let tcp_note = if all_sim {
        "simulated (mcsi sim's Linux-like TCP, CUBIC unless set)".to_string()
    } else {
        format!(
            "host TCP congestion control: {} ({})",
            meta.congestion,
            cc_use(&aggs)
        )
    };
    let note = format!(
        "mcsi {} ({mode}), median of {reps} run(s) of {runtime} s, bars min-max; link: {}; {tcp_note}; {}",
        meta.mcsi_version,
        if link.is_empty() { "see sweep".to_string() } else { link.clone() },
        meta.started_utc.get(..10).unwrap_or(""),
    );
    let mut figures = Vec::new();
    for f in &exp.figures {
        let p = dir.join(format!("{}.png", f.name));
        if plot::draw(exp, f, &aggs, &note, &p)? {
            figures.push((f, p));
        }
    }
    let judged: Vec<Judged> = exp.claims.iter().map(|c| judge(c, &aggs)).collect();

    let mut md = String::new();
    let _ = writeln!(md, "# {}\n", exp.title);
    let _ = writeln!(md, "Source: {}.\n", exp.source);
    let _ = writeln!(md, "{}\n", exp.about.trim());
    let total = runs.len();
    let retried = runs.iter().filter(|r| r.retried()).count();
    let failed = runs.iter().filter(|r| !r.ok() && !r.retried()).count();
    let total = total - retried;
    let wall: f64 = runs.iter().map(|r| r.wall_s).sum();
    let _ = writeln!(md, "## How it ran\n");
    let _ = writeln!(md, "- {mode}: `mcsi lab run {}{}`, {} points x {reps} repetition(s) of {runtime} s; {total} runs ({failed} failed{}), {:.1} min of wall time", exp.name, if meta.quick { " --quick" } else { "" }, aggs.len(), if retried > 0 { format!("; {retried} more attempt(s) failed for the machine's sake and were run again, listed below") } else { String::new() }, wall / 60.0);
    let _ = writeln!(
        md,
        "- started {} UTC{}",
        meta.started_utc,
        meta.finished_utc
            .as_ref()
            .map_or(String::new(), |f| format!(", finished {f} UTC"))
    );
    if all_sim {
        let _ = writeln!(
            md,
            "- mcsi {}, Linux {}, {} CPUs; every point simulated: the host's TCP takes no part",
            meta.mcsi_version, meta.kernel, meta.cpus
        );
    } else {
        let _ = writeln!(
            md,
            "- mcsi {}, Linux {}, {} CPUs; host TCP congestion control: **{}** ({})",
            meta.mcsi_version,
            meta.kernel,
            meta.cpus,
            meta.congestion,
            cc_use(&aggs)
        );
    }
    if !link.is_empty() {
        let _ = writeln!(md, "- link (every run): {link}");
    }
    let points = exp.points(meta.quick);
    let named = |param: &str, names: &[(&str, &str)]| {
        let mut v: Vec<&str> = Vec::new();
        for p in &points {
            let t = p.text(param);
            let n = names.iter().find(|(k, _)| *k == t).map_or(t, |(_, n)| *n);
            if !v.contains(&n) {
                v.push(n);
            }
        }
        v.join(" or ")
    };
    let targets = named("target", &[("mcsi", "`mcsi target`"), ("tgt", "tgt")]);
    let clients = named(
        "client",
        &[
            ("mcsi-bench", "`mcsi bench`"),
            ("iscsi-perf", "libiscsi's iscsi-perf"),
            ("nbd-fio", "fio's nbd engine through `mcsi nbd`"),
        ],
    );
    if all_sim {
        let _ = writeln!(md, "- each run: `mcsi sim` (mcsi's initiator and target cores on virtual time, the simulator's TCP, the link emulator's models; LUN as the spec says); seeds {}..{}", exp.seed, exp.seed + u64::from(reps) - 1);
    } else {
        let _ = writeln!(md, "- each run: `mcsi link run` with {targets} on the host side (RAM LUN) and {clients} behind the link (per series); seeds {}..{}", exp.seed, exp.seed + u64::from(reps) - 1);
    }
    let _ = writeln!(
        md,
        "- series: {}\n",
        exp.series
            .iter()
            .map(|s| format!("`{}` {}", s.name, s.label))
            .collect::<Vec<_>>()
            .join("; ")
    );

    let _ = writeln!(md, "## Claims\n");
    let _ = writeln!(md, "{}\n", counts_line(&judged));
    let _ = writeln!(
        md,
        "| claim | kind | source | published | model | null (no effect) | measured median (min-max) | verdict |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
    for j in &judged {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} {} | {} | {} | {} | {} |",
            j.claim.text,
            j.claim.kind.word(),
            j.claim.source,
            published_cell(&j.claim),
            unit(&j.claim),
            model_cell(j),
            null_cell(j),
            measured_cell(j),
            verdict_cell(j)
        );
    }
    let _ = writeln!(md);
    for j in &judged {
        let _ = writeln!(
            md,
            "- **{}** ({}, {}): measured at {}{}; {}; accepted {}.",
            j.claim.id,
            j.claim.kind.word(),
            j.word(),
            j.claim.at,
            j.claim
                .over
                .as_ref()
                .map_or(String::new(), |o| format!(", over {o}")),
            match j.claim.bound {
                None => format!("tolerance ±{:.0} %", j.claim.tolerance * 100.0),
                Some(b) if b.strict() =>
                    format!("strict ({} {})", b.sign(), num(j.claim.published)),
                Some(b) => format!(
                    "one-sided ({} {}), slack {:.0} %",
                    b.sign(),
                    num(j.claim.published),
                    j.claim.tolerance * 100.0
                ),
            },
            range_text(&j.claim)
        );
        if let Some(why) = &j.claim.no_quick_gate {
            let stop = if why.ends_with('.') { "" } else { "." };
            let _ = writeln!(
                md,
                "  Not gated in quick runs (a quick run that misses it does not fail): {why}{stop}"
            );
        }
        if let Some(why) = &j.claim.known_miss {
            let stop = if why.ends_with('.') { "" } else { "." };
            let _ = writeln!(
                md,
                "  Known to be missed (a run of the lab does not fail on it): {why}{stop}"
            );
        }
        match (&j.claim.null, j.null) {
            (Null::None(why), _) => {
                let stop = if why.ends_with('.') { "" } else { "." };
                let _ = writeln!(md, "  No null: {why}{stop}");
            }
            (_, Some(n)) => {
                let _ = writeln!(
                    md,
                    "  Null (no effect): {} {}, {} the accepted range.",
                    num(n),
                    unit(&j.claim),
                    if accepted(&j.claim, n) {
                        "inside"
                    } else {
                        "outside"
                    }
                );
            }
            (_, None) => {
                let _ = writeln!(md, "  Null (no effect): not measured.");
            }
        }
        if let Some(d) = &j.claim.discussion {
            let _ = writeln!(
                md,
                "  Analysis{}: {}",
                if meta.quick {
                    " (written from the full run; numbers from this one)"
                } else {
                    ""
                },
                discussion(j, d, &aggs).trim().replace('\n', "\n  ")
            );
        }
    }
    let _ = writeln!(md, "\n## Figures\n");
    for (f, p) in &figures {
        let file = p
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned());
        let _ = writeln!(md, "### {}\n\n![{}]({file})\n", f.title, f.title);
    }
    let swept: Vec<_> = exp.sweep.iter().map(|(d, _)| *d).collect();
    agreement(&mut md, &aggs, &swept, exp.agreement.as_deref());
    let _ = writeln!(md, "## Every point\n");
    let mut head = String::from("| series |");
    for d in &swept {
        let _ = write!(head, " {} |", d.name);
    }
    head.push_str(" MB/s | IOPS | mean ms | p99 ms | retrans. | runs |");
    let _ = writeln!(md, "{head}");
    let _ = writeln!(md, "|{}", "---|".repeat(swept.len() + 7));
    use crate::spec::Metric::*;
    for a in &aggs {
        let mut row = format!("| {} |", a.point.series);
        for d in &swept {
            let _ = write!(
                row,
                " {} |",
                a.point
                    .params
                    .get(d.name)
                    .map_or(String::new(), |v| d.show(v))
            );
        }
        for m in [BwMbs, Iops, LatMeanMs, LatP99Ms, Retransmits] {
            let cell = a.metrics.get(&m).map_or("-".into(), |s| {
                if s.n > 1 {
                    format!("{} ({}-{})", num(s.median), num(s.min), num(s.max))
                } else {
                    num(s.median)
                }
            });
            let _ = write!(row, " {cell} |");
        }
        let _ = write!(
            row,
            " {}{} |",
            a.runs,
            if a.failed > 0 {
                format!(" ({} failed)", a.failed)
            } else {
                String::new()
            }
        );
        let _ = writeln!(md, "{row}");
    }
    let fails: Vec<&RunRow> = runs.iter().filter(|r| !r.ok()).collect();
    if !fails.is_empty() {
        let _ = writeln!(md, "\n## Failed runs\n");
        let _ = writeln!(md, "Their logs are in `logs/` beside runs.csv (kept by the run that made them). An attempt marked retried failed for the machine's sake (a port in use, a server slow to start) and was run once more.\n");
        for r in fails {
            let _ = writeln!(md, "- {} rep {}: {}", r.key, r.rep, r.status);
        }
    }
    let report = dir.join("report.md");
    std::fs::write(&report, md).map_err(|e| format!("{}: {e}", report.display()))?;
    Ok(Written {
        report,
        figures: figures.into_iter().map(|(_, p)| p).collect(),
        judged,
        meta,
    })
}

/// "Simulated against emulated": each point of a series `sim-X` (engine = "sim") beside the
/// same point of series `X` run emulated, with the ratios of their medians.
fn agreement(
    md: &mut String,
    aggs: &[Aggregate],
    swept: &[&'static crate::params::Def],
    note: Option<&[Piece]>,
) {
    use crate::spec::Metric::{BwMbs, LatMeanMs};
    let others = |p: &crate::spec::Point| -> Vec<(String, String)> {
        p.params
            .iter()
            .filter(|(d, _)| d.name != "engine")
            .map(|(d, v)| (d.name.to_string(), v.text.clone()))
            .collect()
    };
    let pairs: Vec<(&Aggregate, &Aggregate)> = aggs
        .iter()
        .filter(|a| crate::point::simulated(&a.point))
        .filter_map(|a| {
            let name = a.point.series.strip_prefix("sim-")?;
            let want = others(&a.point);
            aggs.iter()
                .find(|b| {
                    b.point.series == name
                        && !crate::point::simulated(&b.point)
                        && others(&b.point) == want
                })
                .map(|b| (b, a))
        })
        .collect();
    if pairs.is_empty() {
        return;
    }
    let median = |a: &Aggregate, m| a.metrics.get(&m).map(|s| s.median);
    let ratios: Vec<f64> = pairs
        .iter()
        .filter_map(|(e, s)| Some(median(s, BwMbs)? / median(e, BwMbs)?))
        .filter(|r| r.is_finite())
        .collect();
    let within = ratios.iter().filter(|r| (*r - 1.0).abs() <= 0.1).count();
    // Points outside 10 % whose emulated runs alone stray more than 10 % from their median:
    // there the emulated median cannot settle a 10 % question.
    let spread = |a: &Aggregate| {
        a.metrics
            .get(&BwMbs)
            .filter(|s| s.median > 0.0)
            .map(|s| (s.max - s.min) / s.median)
    };
    let outside: Vec<&(&Aggregate, &Aggregate)> = pairs
        .iter()
        .filter(|(e, s)| match (median(s, BwMbs), median(e, BwMbs)) {
            (Some(y), Some(x)) if x > 0.0 => (y / x - 1.0).abs() > 0.1,
            _ => false,
        })
        .collect();
    let noisy = outside
        .iter()
        .filter(|(e, _)| spread(e).is_some_and(|w| w / 2.0 > 0.1))
        .count();
    let _ = writeln!(md, "## Simulated against emulated\n");
    let _ = writeln!(
        md,
        "Each series `sim-X` is series `X` run by `mcsi sim` (engine = \"sim\": the same protocol cores on virtual time, the simulator's Linux-like TCP, the same link model) instead of behind `mcsi link run`. Throughput within 10 % of the emulated median at {within} of {} points{}.\n",
        ratios.len(),
        match (
            ratios.iter().copied().reduce(f64::min),
            ratios.iter().copied().reduce(f64::max)
        ) {
            (Some(lo), Some(hi)) => format!("; simulated over emulated from {lo:.2} to {hi:.2}"),
            _ => String::new(),
        }
    );
    if !outside.is_empty() {
        let _ = writeln!(
            md,
            "Of the {} points outside 10 %, {noisy} are points whose emulated runs differ from one another by more than 20 % of their median (the column \"emulated spread\": (max - min) / median); a 10 % agreement cannot be read from so few runs there.\n",
            outside.len()
        );
    }
    if let Some(note) = note {
        let _ = writeln!(md, "{}\n", fill(note, aggs, None).trim());
    }
    let mut head = String::from("| series |");
    for d in swept {
        let _ = write!(head, " {} |", d.name);
    }
    head.push_str(
        " MB/s emulated | emulated spread | MB/s simulated | ratio | mean ms emulated | mean ms simulated | ratio |",
    );
    let _ = writeln!(md, "{head}");
    let _ = writeln!(md, "|{}", "---|".repeat(swept.len() + 8));
    for (e, s) in &pairs {
        let mut row = format!("| {} |", e.point.series);
        for d in swept {
            let _ = write!(
                row,
                " {} |",
                e.point
                    .params
                    .get(d.name)
                    .map_or(String::new(), |v| d.show(v))
            );
        }
        for m in [BwMbs, LatMeanMs] {
            let (x, y) = (median(e, m), median(s, m));
            let cell = |v: Option<f64>| v.map_or("-".into(), num);
            let ratio = match (x, y) {
                (Some(x), Some(y)) if x > 0.0 => format!("{:.2}", y / x),
                _ => "-".into(),
            };
            if m == BwMbs {
                let w = spread(e).map_or("-".into(), |w| format!("{:.0} %", w * 100.0));
                let _ = write!(row, " {} | {w} | {} | {ratio} |", cell(x), cell(y));
            } else {
                let _ = write!(row, " {} | {} | {ratio} |", cell(x), cell(y));
            }
        }
        let _ = writeln!(md, "{row}");
    }
    let _ = writeln!(md);
}

/// `seeds: 3 of 9 reproduced (2 inconclusive, 4 differ); mcsi goals: 2 of 2 met`.
pub fn counts_line(judged: &[Judged]) -> String {
    let mut parts = Vec::new();
    for k in Kind::ALL {
        let of: Vec<&Judged> = judged.iter().filter(|j| j.claim.kind == k).collect();
        if of.is_empty() {
            continue;
        }
        let n = |v: Verdict| of.iter().filter(|j| j.verdict == v).count();
        let mut rest = Vec::new();
        for v in [Verdict::Inconclusive, Verdict::Fails, Verdict::NotMeasured] {
            if n(v) > 0 {
                // "3 differ", "1 missed", "2 inconclusive".
                let w = match v.word(k) {
                    "differs" => "differ",
                    w => w,
                };
                rest.push(format!("{} {w}", n(v)));
            }
        }
        parts.push(format!(
            "{}: {} of {} {}{}",
            k.plural(),
            n(Verdict::Holds),
            of.len(),
            Verdict::Holds.word(k),
            if rest.is_empty() {
                String::new()
            } else {
                format!(" ({})", rest.join(", "))
            }
        ));
    }
    parts.join("; ")
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Writes the reports of every experiment under `dir` and an index (`index.md`, `index.html`).
/// Returns the reports written.
pub fn write_index(dir: &Path) -> Result<Vec<(Experiment, Written)>, String> {
    let mut done = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("meta.json").exists() && p.join("runs.csv").exists())
        .collect();
    entries.sort();
    if entries.is_empty() {
        return Err(format!("{}: no experiment results here (no NAME/meta.json with NAME/runs.csv); run mcsi lab run NAME --out {} first", dir.display(), dir.display()));
    }
    for e in entries {
        let name = e
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned());
        let spec = e.join("spec.toml");
        let exp = if spec.exists() {
            crate::load(&spec.to_string_lossy())?
        } else {
            crate::load(&name)?
        };
        let mut exp = exp;
        exp.name = name;
        let w = write(&exp, &e)?;
        done.push((exp, w));
    }
    let all: Vec<Judged> = done.iter().flat_map(|(_, w)| w.judged.clone()).collect();
    let mut md = format!("# mcsi lab results\n\nAll experiments: {}.\n\nA seed's claim is a published result, a model's is an analytical prediction, and a goal is mcsi's own design target; each kind is counted apart. A claim is inconclusive when the value it would take without the effect (its null) also falls in its accepted range.\n\n| experiment | mode | run | claims |\n|---|---|---|---|\n", counts_line(&all));
    let mut html = String::from("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>mcsi lab results</title>\n<style>body{font-family:sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}.holds{color:#176117}.fails{color:#a31515}.inconclusive{color:#8a6d00}</style></head><body>\n<h1>mcsi lab results</h1>\n");
    for (exp, w) in &done {
        let mode = if w.meta.quick { "quick" } else { "full" };
        let _ = writeln!(
            md,
            "| [{}]({}/report.md): {} | {mode} | {} | {} |",
            exp.name,
            exp.name,
            exp.title,
            w.meta.started_utc,
            counts_line(&w.judged)
        );
        let _ = writeln!(html, "<h2 id=\"{0}\">{0}: {1}</h2>\n<p>{2}. {mode} run of {3} UTC, host TCP congestion control {4}. {5}. <a href=\"{0}/report.md\">report</a>, <a href=\"{0}/results.csv\">results.csv</a></p>", html_escape(&exp.name), html_escape(&exp.title), html_escape(&exp.source), html_escape(&w.meta.started_utc), html_escape(&w.meta.congestion), html_escape(&counts_line(&w.judged)));
        html.push_str("<table><tr><th>claim</th><th>kind</th><th>source</th><th>published</th><th>model</th><th>null (no effect)</th><th>measured median (min-max)</th><th>verdict</th></tr>\n");
        for j in &w.judged {
            let class = match j.verdict {
                Verdict::Holds => "holds",
                Verdict::Fails => "fails",
                Verdict::Inconclusive => "inconclusive",
                Verdict::NotMeasured => "not-measured",
            };
            let _ = writeln!(html, "<tr><td>{}</td><td>{}</td><td>{}</td><td>{} {}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"{class}\">{}</td></tr>", html_escape(&j.claim.text), j.claim.kind.word(), html_escape(&j.claim.source), html_escape(&published_cell(&j.claim)), unit(&j.claim), html_escape(&model_cell(j)), html_escape(&null_cell(j)), html_escape(&measured_cell(j)), html_escape(&verdict_cell(j).replace("**", "")));
        }
        html.push_str("</table>\n");
        for p in &w.figures {
            let file = p
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned());
            let _ = writeln!(
                html,
                "<img src=\"{}/{}\" alt=\"{}\">",
                html_escape(&exp.name),
                html_escape(&file),
                html_escape(&file)
            );
        }
    }
    html.push_str("</body></html>\n");
    std::fs::write(dir.join("index.md"), md).map_err(|e| format!("{}: {e}", dir.display()))?;
    std::fs::write(dir.join("index.html"), html).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(done)
}

/// Who runs the host's congestion control: the target's sockets and the initiator's namespace
/// use it unless every point sets its own (`cc`, `target_cc`, `initiator_cc`).
fn cc_use(aggs: &[Aggregate]) -> String {
    // The values every point sets for `name`, or None when some point leaves it to the host.
    let every = |name: &str| -> Option<String> {
        let mut vals = Vec::new();
        for a in aggs {
            vals.push(a.point.params.get(name)?.text.as_str());
        }
        vals.sort_unstable();
        vals.dedup();
        match vals.as_slice() {
            [] => None,
            [one] => Some(format!("runs {one}")),
            many => Some(format!("is set by each point ({})", many.join(", "))),
        }
    };
    if let Some(cc) = every("cc") {
        return format!("not used: the congestion control of every socket {cc}");
    }
    let target = match every("target_cc") {
        Some(cc) => format!("the target side {cc}, set on its route to the initiator"),
        None => "the target's sockets use it".to_string(),
    };
    let initiator = match every("initiator_cc") {
        Some(cc) => format!("the initiator's namespace {cc}"),
        None => "the initiator's namespace inherits it".to_string(),
    };
    format!("{target}; {initiator}")
}
