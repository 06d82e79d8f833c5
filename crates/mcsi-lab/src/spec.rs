//! Experiment specs: TOML files that say which claims an experiment tests, on which link, with
//! which workload sweep, and how the results are drawn. Parsing checks everything that can be
//! checked before a run starts, and every error names the field (`sweep.bs[2]`, `claim[1].at`).

use crate::params::{self, Def, Value};
pub use crate::point::{Metric, ModelRef, Params, Point};
use serde::Deserialize;
use std::fmt;

/// A spec error: the file, the field and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {field}: {message}")]
pub struct SpecError {
    pub file: String,
    pub field: String,
    pub message: String,
}

/// Parameters with the value every run gets unless the spec sets them.
const DEFAULTS: &[(&str, &str)] = &[
    ("target", "mcsi"),
    ("client", "mcsi-bench"),
    ("rw", "read"),
    ("bs", "4KiB"),
    ("iodepth", "1"),
    ("connections", "1"),
    ("policy", "round-robin"),
    ("asymmetric", "false"),
    ("runtime", "8"),
    ("lun", "ram:64MiB"),
    ("mtu", "1500"),
];

/// One line of a figure: a named variant of the workload.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub label: String,
    pub set: Params,
    /// The series has only the points of the sweep with these values (e.g. reads only).
    pub only: Params,
}

/// Points drawn as markers: what a paper published.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Published {
    pub label: String,
    /// `[x, y]` in the figure's axis units.
    pub points: Vec<[f64; 2]>,
}

/// A selection of points: parameter values, and optionally a series by name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selector {
    pub series: Option<String>,
    pub params: Params,
}

impl Selector {
    pub fn matches(&self, p: &Point) -> bool {
        if self.series.as_deref().is_some_and(|s| s != p.series) {
            return false;
        }
        self.params
            .0
            .iter()
            .all(|(k, v)| p.params.get(k).is_some_and(|pv| pv.text == v.text))
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(s) = &self.series {
            parts.push(format!("series {s}"));
        }
        for (d, v) in self.params.iter() {
            parts.push(format!("{} {}", d.name, d.show(v)));
        }
        write!(f, "{}", parts.join(", "))
    }
}

/// A figure: one metric against one swept parameter, a line per series.
#[derive(Debug, Clone)]
pub struct Figure {
    pub name: String,
    pub title: String,
    pub x: &'static Def,
    pub y: Metric,
    pub filter: Selector,
    /// The series drawn (all when the spec names none).
    pub series: Vec<String>,
    pub x_log: bool,
    /// A logarithmic y axis (base 10), for a metric spanning orders of magnitude.
    pub y_log: bool,
    /// Where the legend goes: upper-left, upper-right, middle-right, lower-left or lower-right.
    pub legend: String,
    pub published: Vec<Published>,
    pub models: Vec<ModelRef>,
}

/// Whose claim it is: a published result, a model's prediction, or one of mcsi's own goals.
/// Reports count each kind apart, so that a goal met never passes for a result reproduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// A result published in one of the seeds (a table, figure or section).
    Seed,
    /// What an analytical model predicts (Mathis, Padhye, the 802.11 airtime model).
    Model,
    /// A design target of mcsi ("tcp-aware at least 1.3x round-robin").
    Goal,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Seed, Kind::Model, Kind::Goal];

    pub fn word(self) -> &'static str {
        match self {
            Kind::Seed => "seed",
            Kind::Model => "model",
            Kind::Goal => "goal",
        }
    }

    /// The heading of the kind's count ("seeds: 3 of 9 reproduced").
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Seed => "seeds",
            Kind::Model => "models",
            Kind::Goal => "mcsi goals",
        }
    }

    /// The verdict words of a claim of this kind that holds and one that does not.
    pub fn holds(self) -> (&'static str, &'static str) {
        match self {
            Kind::Goal => ("met", "missed"),
            Kind::Seed | Kind::Model => ("reproduced", "differs"),
        }
    }

    fn parse(s: &str) -> Result<Kind, String> {
        Kind::ALL
            .into_iter()
            .find(|k| k.word() == s)
            .ok_or_else(|| format!("'{s}': use seed (a published result), model (a model's prediction) or goal (a target of mcsi's own)"))
    }
}

/// What the measurement would show if the claimed effect did not exist. A claim whose null
/// falls inside its accepted range cannot tell the effect from its absence: it is judged
/// inconclusive.
#[derive(Debug, Clone)]
pub enum Null {
    /// A value in the claim's units (1.0 for a ratio: "no gain").
    Value(f64),
    /// The median at another point (the same metric): "one connection" for a claim about two.
    At(Selector),
    /// The claim has no null, and says why (a baseline value, or a claim of no change).
    None(String),
}

/// A published claim the experiment tests.
#[derive(Debug, Clone)]
pub struct Claim {
    pub id: String,
    pub kind: Kind,
    /// Where the claim is published (seed, figure or table).
    pub source: String,
    pub text: String,
    pub metric: Metric,
    /// The point measured.
    pub at: Selector,
    /// When set, the claim is the ratio of `at` to `over`.
    pub over: Option<Selector>,
    pub published: f64,
    /// Relative tolerance: reproduced when |measured - published| <= tolerance x published;
    /// with a bound, the slack below (at least) or above (at most) the published value.
    pub tolerance: f64,
    /// A one-sided claim ("at least 1.3x", "lower than"): None for "about this value".
    pub bound: Option<Bound>,
    pub model: Option<ModelRef>,
    pub null: Null,
    /// What the measurement shows, written after looking at the data; its numbers are
    /// placeholders filled from the data (see [`Piece`]).
    pub discussion: Option<Vec<Piece>>,
    /// A goal known to be missed today, and why (an open issue, a limit): a run of the lab
    /// that misses it does not fail. Every other missed goal fails the run.
    pub known_miss: Option<String>,
    /// A goal that the quick form's few short runs cannot decide, and why: a quick run that
    /// misses it does not fail (a full run does).
    pub no_quick_gate: Option<String>,
}

/// The side of a one-sided claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// The median at least the published value, less the slack.
    AtLeast,
    /// The median at most the published value, plus the slack.
    AtMost,
    /// Every run strictly above the published value ("more than one connection").
    Above,
    /// Every run strictly below the published value ("a lower p99").
    Below,
}

impl Bound {
    /// The sign put before the published value in reports.
    pub fn sign(self) -> &'static str {
        match self {
            Bound::AtLeast => "≥",
            Bound::AtMost => "≤",
            Bound::Above => ">",
            Bound::Below => "<",
        }
    }

    /// Whether the claim is judged on every run rather than on the median, without slack.
    pub fn strict(self) -> bool {
        matches!(self, Bound::Above | Bound::Below)
    }
}

/// A piece of a discussion: text, or a number taken from the data when the report is written.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    /// `{quote:TEXT}`: a number from a source, not measured, written as is.
    Quote(String),
    /// `{published}`: the claim's published value.
    Published,
    /// `{model}`: the claim's model value.
    Model,
    /// `{metric=M, stat=S, series=X, param=V, ...}`, or a ratio of two medians with `/`.
    Value(ValueRef),
}

/// A statistic of the runs at one point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stat {
    Median,
    Min,
    Max,
}

/// A number in a discussion: the median (or min, max) of a metric at one point, or the ratio
/// of the medians at two points.
#[derive(Debug, Clone, PartialEq)]
pub struct ValueRef {
    pub metric: Metric,
    pub stat: Stat,
    pub at: Selector,
    pub over: Option<Selector>,
    /// The placeholder as written, for messages.
    pub text: String,
}

/// A parsed, checked experiment.
#[derive(Debug, Clone)]
pub struct Experiment {
    pub name: String,
    pub title: String,
    pub source: String,
    pub about: String,
    pub base: Params,
    /// Swept parameters and their values, in the order of [`params::DEFS`].
    pub sweep: Vec<(&'static Def, Vec<Value>)>,
    pub series: Vec<Series>,
    pub repetitions: u32,
    pub seed: u64,
    pub quick: Quick,
    pub figures: Vec<Figure>,
    pub claims: Vec<Claim>,
    /// What the report says after "Simulated against emulated" about why points differ
    /// (field `agreement`, a discussion with the claims' placeholders).
    pub agreement: Option<Vec<Piece>>,
    /// The spec as written, kept beside the results of each run.
    pub text: String,
}

/// What `--quick` changes.
#[derive(Debug, Clone, Default)]
pub struct Quick {
    pub base: Params,
    pub sweep: Vec<(&'static Def, Vec<Value>)>,
    pub repetitions: Option<u32>,
    pub series: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    title: String,
    source: String,
    about: String,
    #[serde(default)]
    base: toml::Table,
    #[serde(default)]
    sweep: toml::Table,
    #[serde(default)]
    series: Vec<RawSeries>,
    #[serde(default = "one")]
    repetitions: u32,
    #[serde(default = "one_u64")]
    seed: u64,
    #[serde(default)]
    quick: Option<RawQuick>,
    #[serde(default)]
    agreement: Option<String>,
    #[serde(default, rename = "figure")]
    figures: Vec<RawFigure>,
    #[serde(default, rename = "claim")]
    claims: Vec<RawClaim>,
}

fn one() -> u32 {
    1
}
fn one_u64() -> u64 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSeries {
    name: String,
    label: String,
    #[serde(default)]
    set: toml::Table,
    #[serde(default)]
    only: toml::Table,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQuick {
    #[serde(default)]
    base: toml::Table,
    #[serde(default)]
    sweep: toml::Table,
    repetitions: Option<u32>,
    series: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFigure {
    name: String,
    title: String,
    x: String,
    y: String,
    #[serde(default, rename = "where")]
    filter: toml::Table,
    series: Option<Vec<String>>,
    #[serde(default)]
    x_log: bool,
    #[serde(default)]
    y_log: bool,
    legend: Option<String>,
    #[serde(default)]
    published: Vec<Published>,
    #[serde(default)]
    model: Vec<ModelRef>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClaim {
    id: String,
    kind: Option<String>,
    source: String,
    text: String,
    metric: String,
    at: toml::Table,
    over: Option<toml::Table>,
    published: f64,
    tolerance: Option<f64>,
    bound: Option<String>,
    model: Option<ModelRef>,
    null: Option<toml::Value>,
    no_null: Option<String>,
    discussion: Option<String>,
    known_miss: Option<String>,
    no_quick_gate: Option<String>,
}

struct Ctx<'a> {
    file: &'a str,
}

impl Ctx<'_> {
    fn err(&self, field: impl Into<String>, message: impl Into<String>) -> SpecError {
        SpecError {
            file: self.file.to_string(),
            field: field.into(),
            message: message.into(),
        }
    }

    fn def(&self, field: &str, name: &str) -> Result<&'static Def, SpecError> {
        params::def(name).ok_or_else(|| {
            self.err(
                field,
                format!("unknown parameter '{name}' (known: {})", params::names()),
            )
        })
    }

    fn params(&self, field: &str, t: &toml::Table) -> Result<Params, SpecError> {
        let mut p = Params::default();
        for (k, v) in t {
            let d = self.def(field, k)?;
            let val = d
                .parse(v)
                .map_err(|m| self.err(format!("{field}.{k}"), m))?;
            p.0.insert(d.name, val);
        }
        Ok(p)
    }

    fn sweep(
        &self,
        field: &str,
        t: &toml::Table,
    ) -> Result<Vec<(&'static Def, Vec<Value>)>, SpecError> {
        let mut axes = Vec::new();
        for (k, v) in t {
            let d = self.def(field, k)?;
            let f = format!("{field}.{k}");
            let arr = v
                .as_array()
                .ok_or_else(|| self.err(&f, "expected a list of values, e.g. [1, 2, 4]"))?;
            if arr.is_empty() {
                return Err(self.err(&f, "empty list"));
            }
            let mut vals: Vec<Value> = Vec::new();
            for (i, x) in arr.iter().enumerate() {
                let val = d.parse(x).map_err(|m| self.err(format!("{f}[{i}]"), m))?;
                if vals.iter().any(|o| o.text == val.text) {
                    return Err(self.err(format!("{f}[{i}]"), "listed twice"));
                }
                vals.push(val);
            }
            axes.push((d, vals));
        }
        axes.sort_by_key(|(d, _)| params::DEFS.iter().position(|x| x.name == d.name));
        Ok(axes)
    }

    fn selector(
        &self,
        field: &str,
        t: &toml::Table,
        series: &[Series],
    ) -> Result<Selector, SpecError> {
        let mut sel = Selector::default();
        let mut rest = t.clone();
        if let Some(s) = rest.remove("series") {
            let name = s
                .as_str()
                .ok_or_else(|| self.err(format!("{field}.series"), "expected a series name"))?;
            if !series.iter().any(|x| x.name == name) {
                return Err(self.err(
                    format!("{field}.series"),
                    format!("no series named '{name}' (have {})", series_names(series)),
                ));
            }
            sel.series = Some(name.to_string());
        }
        sel.params = self.params(field, &rest)?;
        Ok(sel)
    }
}

/// Parses a discussion: text with `{...}` placeholders for the numbers (see [`Piece`]). A
/// number of a measured quantity (MB/s, IOPS, a ratio) written as text is refused: it would go
/// stale when the run is redone.
fn discussion(
    cx: &Ctx<'_>,
    field: &str,
    text: &str,
    series: &[Series],
) -> Result<Vec<Piece>, SpecError> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find('{') {
        let (before, after) = rest.split_at(open);
        if !before.is_empty() {
            out.push(Piece::Text(before.to_string()));
        }
        let close = after
            .find('}')
            .filter(|&c| !after[1..c].contains('{'))
            .ok_or_else(|| {
                cx.err(
                    field,
                    format!(
                        "'{}': a {{ without its }}",
                        after.chars().take(30).collect::<String>()
                    ),
                )
            })?;
        let inner = &after[1..close];
        out.push(placeholder(cx, field, inner, series)?);
        rest = &after[close + 1..];
    }
    if !rest.is_empty() {
        out.push(Piece::Text(rest.to_string()));
    }
    for p in &out {
        if let Piece::Text(t) = p {
            if let Some(n) = measured_number(t) {
                return Err(cx.err(
                    field,
                    format!("'{n}' is written as text: take a measured number from the data with {{metric=bw_mbs, series=NAME, PARAM=VALUE}} (a ratio: {{metric=bw_mbs, series=A / series=B}}), or mark a number quoted from a source as {{quote:{n}}}"),
                ));
            }
        }
    }
    Ok(out)
}

/// The first number in `t` followed by a unit of a measured quantity (MB/s, IOPS, x, times),
/// with its unit.
fn measured_number(t: &str) -> Option<String> {
    let b = t.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii_digit()
            || (i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'.'))
        {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < b.len()
            && (b[j].is_ascii_digit()
                || (b[j] == b'.' && b.get(j + 1).is_some_and(u8::is_ascii_digit)))
        {
            j += 1;
        }
        let after = t[j..].trim_start_matches(' ');
        let word: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '/')
            .collect();
        if ["MB/s", "IOPS", "x", "times"].contains(&word.as_str()) {
            let end = t.len() - after.len() + word.len();
            return Some(t[i..end].to_string());
        }
        i = j;
    }
    None
}

/// `s` cut at each `sep` that is not inside double quotes: a placeholder's value may hold commas
/// or slashes when quoted (`paths="rate=10mbit,delay=10ms;rate=5mbit"`).
fn split_unquoted(s: &str, sep: char) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in s.char_indices() {
        if c == '"' {
            quoted = !quoted;
        } else if c == sep && !quoted {
            out.push(&s[start..i]);
            start = i + c.len_utf8();
        }
    }
    out.push(&s[start..]);
    out
}

/// One `{...}` of a discussion.
fn placeholder(
    cx: &Ctx<'_>,
    field: &str,
    inner: &str,
    series: &[Series],
) -> Result<Piece, SpecError> {
    let inner_t = inner.trim();
    if let Some(q) = inner_t.strip_prefix("quote:") {
        return Ok(Piece::Quote(q.trim().to_string()));
    }
    match inner_t {
        "published" => return Ok(Piece::Published),
        "model" => return Ok(Piece::Model),
        _ => {}
    }
    let bad = |m: String| cx.err(field, format!("{{{inner}}}: {m}"));
    let mut metric = None;
    let mut stat = Stat::Median;
    let mut sels = Vec::new();
    for (si, part) in split_unquoted(inner_t, '/').into_iter().enumerate() {
        let mut t = toml::Table::new();
        for kv in split_unquoted(part, ',') {
            let kv = kv.trim();
            if kv.is_empty() {
                continue;
            }
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| bad(format!("'{kv}': expected NAME=VALUE")))?;
            let (k, v) = (k.trim(), v.trim().trim_matches('"'));
            match k {
                "metric" if si == 0 => {
                    metric = Some(Metric::parse(v).map_err(bad)?);
                }
                "stat" if si == 0 => {
                    stat = match v {
                        "median" => Stat::Median,
                        "min" => Stat::Min,
                        "max" => Stat::Max,
                        _ => return Err(bad(format!("stat '{v}': use median, min or max"))),
                    }
                }
                "metric" | "stat" => {
                    return Err(bad(format!("{k} goes before the /")));
                }
                _ => {
                    t.insert(k.to_string(), toml::Value::String(v.to_string()));
                }
            }
        }
        sels.push(cx.selector(field, &t, series).map_err(|e| bad(e.message))?);
    }
    let metric = metric.ok_or_else(|| {
        bad("no metric: write {metric=bw_mbs, series=NAME, PARAM=VALUE}, {quote:TEXT}, {published} or {model}".into())
    })?;
    if sels.len() > 2 {
        return Err(bad("one / at most (a ratio of two points)".into()));
    }
    if sels.len() == 2 && stat != Stat::Median {
        return Err(bad("a ratio is of the medians: leave stat out".into()));
    }
    let mut sels = sels.into_iter();
    let at = sels.next().unwrap_or_default();
    Ok(Piece::Value(ValueRef {
        metric,
        stat,
        at,
        over: sels.next(),
        text: inner_t.to_string(),
    }))
}

fn series_names(series: &[Series]) -> String {
    series
        .iter()
        .map(|s| s.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses and checks the spec `text` of the experiment `name` (`file` is for messages).
pub fn parse(name: &str, file: &str, text: &str) -> Result<Experiment, SpecError> {
    let cx = Ctx { file };
    let raw: RawSpec = toml::from_str(text).map_err(|e| {
        let field = e
            .span()
            .map(|s| {
                let line = text[..s.start.min(text.len())].lines().count().max(1);
                format!("line {line}")
            })
            .unwrap_or_else(|| "spec".into());
        cx.err(field, e.message().to_string())
    })?;
    let mut base = cx.params("base", &raw.base)?;
    let sweep = cx.sweep("sweep", &raw.sweep)?;
    for (d, _) in &sweep {
        if base.0.contains_key(d.name) {
            return Err(cx.err(
                format!("sweep.{}", d.name),
                "also set in [base]; set it in one place",
            ));
        }
    }
    for (k, v) in DEFAULTS {
        if !base.0.contains_key(k) && !sweep.iter().any(|(d, _)| d.name == *k) {
            let d = cx.def("defaults", k)?;
            let val = d.parse_str(v).map_err(|m| cx.err("defaults", m))?;
            base.0.insert(d.name, val);
        }
    }
    if base.0.contains_key("rtt") && base.0.contains_key("delay") {
        return Err(cx.err("base.rtt", "set rtt or delay, not both"));
    }
    let mut series = Vec::new();
    for (i, s) in raw.series.iter().enumerate() {
        let f = format!("series[{i}]");
        if s.name.is_empty() || s.name.contains([';', '=', ',']) {
            return Err(cx.err(
                format!("{f}.name"),
                "must be a non-empty word without ; = ,",
            ));
        }
        if series.iter().any(|x: &Series| x.name == s.name) {
            return Err(cx.err(format!("{f}.name"), format!("'{}' used twice", s.name)));
        }
        let set = cx.params(&format!("{f}.set"), &s.set)?;
        for (d, _) in set.iter() {
            if sweep.iter().any(|(a, _)| a.name == d.name) {
                return Err(cx.err(
                    format!("{f}.set.{}", d.name),
                    "is swept in [sweep]; a series cannot also fix it",
                ));
            }
        }
        let only = cx.params(&format!("{f}.only"), &s.only)?;
        for (d, v) in only.iter() {
            let swept = sweep.iter().find(|(a, _)| a.name == d.name);
            if !swept.is_some_and(|(_, vals)| vals.iter().any(|x| x.text == v.text)) {
                return Err(cx.err(
                    format!("{f}.only.{}", d.name),
                    "must be one of the values swept in [sweep]",
                ));
            }
        }
        series.push(Series {
            name: s.name.clone(),
            label: s.label.clone(),
            set,
            only,
        });
    }
    if series.is_empty() {
        series.push(Series {
            name: "all".into(),
            label: "mcsi".into(),
            set: Params::default(),
            only: Params::default(),
        });
    }
    if raw.repetitions == 0 || raw.repetitions > 100 {
        return Err(cx.err("repetitions", "must be 1 to 100"));
    }
    let quick = match &raw.quick {
        None => Quick::default(),
        Some(q) => {
            let qb = cx.params("quick.base", &q.base)?;
            let qs = cx.sweep("quick.sweep", &q.sweep)?;
            for (d, _) in &qs {
                if !sweep.iter().any(|(a, _)| a.name == d.name) {
                    return Err(cx.err(
                        format!("quick.sweep.{}", d.name),
                        "not swept in [sweep]; quick mode can only narrow a sweep",
                    ));
                }
            }
            if let Some(names) = &q.series {
                for (i, n) in names.iter().enumerate() {
                    if !series.iter().any(|s| &s.name == n) {
                        return Err(cx.err(
                            format!("quick.series[{i}]"),
                            format!("no series named '{n}' (have {})", series_names(&series)),
                        ));
                    }
                }
            }
            if q.repetitions.is_some_and(|r| r == 0 || r > 100) {
                return Err(cx.err("quick.repetitions", "must be 1 to 100"));
            }
            Quick {
                base: qb,
                sweep: qs,
                repetitions: q.repetitions,
                series: q.series.clone(),
            }
        }
    };
    let mut figures = Vec::new();
    for (i, f) in raw.figures.iter().enumerate() {
        let fld = format!("figure[{i}]");
        let x = cx.def(&format!("{fld}.x"), &f.x)?;
        match sweep.iter().find(|(d, _)| d.name == x.name) {
            None => {
                return Err(cx.err(
                    format!("{fld}.x"),
                    format!("'{}' is not swept in [sweep]", f.x),
                ))
            }
            Some((_, vals)) if vals.iter().any(|v| v.num.is_none()) => {
                return Err(cx.err(format!("{fld}.x"), format!("'{}' is not a number", f.x)))
            }
            Some(_) => {}
        }
        let y = Metric::parse(&f.y).map_err(|m| cx.err(format!("{fld}.y"), m))?;
        let filter = cx.selector(&format!("{fld}.where"), &f.filter, &series)?;
        let names = match &f.series {
            None => series.iter().map(|s| s.name.clone()).collect(),
            Some(ns) => {
                for (j, n) in ns.iter().enumerate() {
                    if !series.iter().any(|s| &s.name == n) {
                        return Err(cx.err(
                            format!("{fld}.series[{j}]"),
                            format!("no series named '{n}' (have {})", series_names(&series)),
                        ));
                    }
                }
                ns.clone()
            }
        };
        if f.name.is_empty()
            || !f
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(cx.err(
                format!("{fld}.name"),
                "use letters, digits, - and _ (it names the PNG)",
            ));
        }
        for (j, m) in f.model.iter().enumerate() {
            crate::model::check(m).map_err(|e| cx.err(format!("{fld}.model[{j}].kind"), e))?;
        }
        if !f.model.is_empty() && !matches!(y, Metric::BwMbs | Metric::Iops) {
            return Err(cx.err(
                format!("{fld}.model"),
                format!("the models give bw_mbs or iops, not {}", y.column()),
            ));
        }
        let legend = f.legend.clone().unwrap_or_else(|| "lower-right".into());
        if ![
            "upper-left",
            "upper-right",
            "middle-right",
            "lower-left",
            "lower-right",
        ]
        .contains(&legend.as_str())
        {
            return Err(cx.err(
                format!("{fld}.legend"),
                "use upper-left, upper-right, middle-right, lower-left or lower-right",
            ));
        }
        figures.push(Figure {
            name: f.name.clone(),
            title: f.title.clone(),
            x,
            y,
            filter,
            series: names,
            x_log: f.x_log,
            y_log: f.y_log,
            legend,
            published: f.published.clone(),
            models: f.model.clone(),
        });
    }
    let mut claims = Vec::new();
    for (i, c) in raw.claims.iter().enumerate() {
        let fld = format!("claim[{i}]");
        if claims.iter().any(|x: &Claim| x.id == c.id) {
            return Err(cx.err(format!("{fld}.id"), format!("'{}' used twice", c.id)));
        }
        let metric = Metric::parse(&c.metric).map_err(|m| cx.err(format!("{fld}.metric"), m))?;
        let at = cx.selector(&format!("{fld}.at"), &c.at, &series)?;
        let over = match &c.over {
            Some(t) => Some(cx.selector(&format!("{fld}.over"), t, &series)?),
            None => None,
        };
        let bound = match c.bound.as_deref() {
            None => None,
            Some("at-least") => Some(Bound::AtLeast),
            Some("at-most") => Some(Bound::AtMost),
            Some("above") => Some(Bound::Above),
            Some("below") => Some(Bound::Below),
            Some(other) => {
                return Err(cx.err(
                    format!("{fld}.bound"),
                    format!("'{other}': use at-least or at-most (the median, with the tolerance as slack), above or below (every run, strictly), or leave it out for \"about\""),
                ))
            }
        };
        let tolerance = match (bound, c.tolerance) {
            (Some(b), Some(_)) if b.strict() => {
                return Err(cx.err(
                    format!("{fld}.tolerance"),
                    format!("bound {} is strict (every run beyond the published value): it takes no tolerance", c.bound.as_deref().unwrap_or_default()),
                ))
            }
            (Some(b), None) if b.strict() => 0.0,
            (_, None) => {
                return Err(cx.err(
                    format!("{fld}.tolerance"),
                    "missing: a fraction of the published value (0.2 is 20 %)",
                ))
            }
            (_, Some(t)) if !(t > 0.0 && t <= 10.0) => {
                return Err(cx.err(
                    format!("{fld}.tolerance"),
                    "must be above 0 (a fraction: 0.2 is 20 %)",
                ))
            }
            (_, Some(t)) => t,
        };
        let kind = match &c.kind {
            None => {
                return Err(cx.err(
                    format!("{fld}.kind"),
                    "missing: seed (a published result), model (a model's prediction) or goal (a target of mcsi's own)",
                ))
            }
            Some(k) => Kind::parse(k).map_err(|m| cx.err(format!("{fld}.kind"), m))?,
        };
        for (key, why) in [
            ("known_miss", &c.known_miss),
            ("no_quick_gate", &c.no_quick_gate),
        ] {
            let Some(why) = why else { continue };
            if kind != Kind::Goal {
                return Err(cx.err(
                    format!("{fld}.{key}"),
                    "only a goal (a target of mcsi's own) gates a run of the lab",
                ));
            }
            if why.trim().is_empty() {
                return Err(cx.err(format!("{fld}.{key}"), "say why"));
            }
        }
        let null = match (&c.null, &c.no_null) {
            (Some(_), Some(_)) => {
                return Err(cx.err(
                    format!("{fld}.no_null"),
                    "give null or no_null, not both",
                ))
            }
            (None, None) => {
                return Err(cx.err(
                    format!("{fld}.null"),
                    "missing: what would be measured if the effect did not exist, as a value (null = 1.0 for a ratio) or a point (null = { series = \"c1\", bs = \"2KiB\" }); a plain absolute value or a claim of no change says so with no_null = \"why\"",
                ))
            }
            (None, Some(why)) if why.trim().is_empty() => {
                return Err(cx.err(
                    format!("{fld}.no_null"),
                    "say why the claim has no null",
                ))
            }
            (None, Some(why)) => Null::None(why.trim().to_string()),
            (Some(toml::Value::Float(v)), None) => Null::Value(*v),
            (Some(toml::Value::Integer(v)), None) => Null::Value(*v as f64),
            (Some(toml::Value::Table(t)), None) => {
                if c.over.is_some() {
                    return Err(cx.err(
                        format!("{fld}.null"),
                        "a ratio's null is a value (1.0: no effect), not a point",
                    ));
                }
                Null::At(cx.selector(&format!("{fld}.null"), t, &series)?)
            }
            (Some(_), None) => {
                return Err(cx.err(
                    format!("{fld}.null"),
                    "expected a number or a point ({ series = \"c1\", ... })",
                ))
            }
        };
        if let Null::Value(v) = null {
            if !v.is_finite() || v < 0.0 {
                return Err(cx.err(format!("{fld}.null"), "must be a number of 0 or more"));
            }
        }
        if !c.published.is_finite() || c.published <= 0.0 {
            return Err(cx.err(format!("{fld}.published"), "must be a positive number"));
        }
        if let Some(m) = &c.model {
            crate::model::check(m).map_err(|e| cx.err(format!("{fld}.model.kind"), e))?;
            if !matches!(metric, Metric::BwMbs | Metric::Iops) {
                return Err(cx.err(
                    format!("{fld}.model"),
                    format!("the models give bw_mbs or iops, not {}", metric.column()),
                ));
            }
        }
        claims.push(Claim {
            id: c.id.clone(),
            kind,
            source: c.source.clone(),
            text: c.text.clone(),
            metric,
            at,
            over,
            published: c.published,
            tolerance,
            bound,
            model: c.model.clone(),
            null,
            discussion: match &c.discussion {
                None => None,
                Some(d) => Some(discussion(&cx, &format!("{fld}.discussion"), d, &series)?),
            },
            known_miss: c.known_miss.clone(),
            no_quick_gate: c.no_quick_gate.clone(),
        });
    }
    let agreement = match &raw.agreement {
        None => None,
        Some(d) => {
            let pieces = discussion(&cx, "agreement", d, &series)?;
            if pieces
                .iter()
                .any(|p| matches!(p, Piece::Published | Piece::Model))
            {
                return Err(cx.err(
                    "agreement",
                    "{published} and {model} belong to a claim's discussion; give the number with {quote:...} or {metric=...}",
                ));
            }
            Some(pieces)
        }
    };
    let exp = Experiment {
        name: name.to_string(),
        title: raw.title,
        source: raw.source,
        about: raw.about,
        base,
        sweep,
        series,
        repetitions: raw.repetitions,
        seed: raw.seed,
        quick,
        figures,
        claims,
        agreement,
        text: text.to_string(),
    };
    // Every point must make a valid link, and every claim must name exactly one point, in the
    // full run and in the quick one.
    for quick in [false, true] {
        let mode = if quick { " (quick)" } else { "" };
        let points = exp.points(quick);
        let one = |field: String, sel: &Selector, what: &str| {
            let n = points.iter().filter(|p| sel.matches(p)).count();
            if n == 1 {
                Ok(())
            } else {
                Err(cx.err(
                    field,
                    format!("{what}selects {n} points ({sel}); it must select exactly one"),
                ))
            }
        };
        for p in &points {
            crate::point::link_args(p)
                .and_then(|_| crate::point::check_point(p))
                .map_err(|m| cx.err(format!("point {}{mode}", p.key()), m))?;
        }
        if !quick {
            for v in exp.agreement.iter().flatten() {
                let Piece::Value(v) = v else { continue };
                for sel in std::iter::once(&v.at).chain(v.over.as_ref()) {
                    one("agreement".into(), sel, &format!("{{{}}} ", v.text))?;
                }
            }
        }
        for (i, c) in exp.claims.iter().enumerate() {
            let null = match &c.null {
                Null::At(s) => Some(s),
                _ => None,
            };
            for (which, sel) in [
                ("at", Some(&c.at)),
                ("over", c.over.as_ref()),
                ("null", null),
            ] {
                let Some(sel) = sel else { continue };
                one(format!("claim[{i}].{which}{mode}"), sel, "")?;
            }
            // A discussion is written from the full run; quick mode shows what it has.
            if quick {
                continue;
            }
            for v in c.discussion.iter().flatten() {
                let Piece::Value(v) = v else { continue };
                for sel in std::iter::once(&v.at).chain(v.over.as_ref()) {
                    one(
                        format!("claim[{i}].discussion"),
                        sel,
                        &format!("{{{}}} ", v.text),
                    )?;
                }
            }
        }
    }
    Ok(exp)
}

/// With `qos_q`, the requirement's workload: rw, bs and rate_iops.
fn qos_workload(params: &mut Params) {
    let Some(q) = params.get("qos_q").and_then(|v| v.num) else {
        return;
    };
    let Some(r) = mcsi_model::qos::SEED_004.get((q as usize).saturating_sub(1)) else {
        return;
    };
    let rw = if r.read_ratio >= 1.0 {
        "randread"
    } else if r.read_ratio <= 0.0 {
        "randwrite"
    } else {
        "randrw"
    };
    for (k, v) in [
        ("rw", rw.to_string()),
        ("bs", r.size_bytes.to_string()),
        ("rate_iops", format!("{}", r.iops.ceil() as u64)),
    ] {
        if let Some(d) = params::def(k) {
            if let Ok(val) = d.parse_str(&v) {
                params.0.insert(d.name, val);
            }
        }
    }
}

impl Experiment {
    /// The points of the full run or of the quick one, series by series, the sweep's first
    /// parameter varying slowest.
    pub fn points(&self, quick: bool) -> Vec<Point> {
        let mut base = self.base.clone();
        let mut sweep = self.sweep.clone();
        if quick {
            for (k, v) in &self.quick.base.0 {
                base.0.insert(k, v.clone());
            }
            for (d, vals) in &self.quick.sweep {
                if let Some(a) = sweep.iter_mut().find(|(x, _)| x.name == d.name) {
                    a.1 = vals.clone();
                }
            }
        }
        let mut out = Vec::new();
        for s in &self.series {
            if quick
                && self
                    .quick
                    .series
                    .as_ref()
                    .is_some_and(|n| !n.contains(&s.name))
            {
                continue;
            }
            let mut p = base.clone();
            for (k, v) in &s.set.0 {
                p.0.insert(k, v.clone());
            }
            let mut combos: Vec<Params> = vec![p];
            for (d, vals) in &sweep {
                combos = combos
                    .into_iter()
                    .flat_map(|c| {
                        vals.iter().map(move |v| {
                            let mut c = c.clone();
                            c.0.insert(d.name, v.clone());
                            c
                        })
                    })
                    .collect();
            }
            combos.retain(|c| {
                s.only
                    .0
                    .iter()
                    .all(|(k, v)| c.get(k).is_some_and(|x| x.text == v.text))
            });
            out.extend(combos.into_iter().map(|mut params| {
                qos_workload(&mut params);
                Point {
                    series: s.name.clone(),
                    params,
                }
            }));
        }
        out
    }

    pub fn repetitions(&self, quick: bool) -> u32 {
        if quick {
            self.quick.repetitions.unwrap_or(self.repetitions)
        } else {
            self.repetitions
        }
    }

    pub fn series_label<'a>(&'a self, name: &'a str) -> &'a str {
        self.series
            .iter()
            .find(|s| s.name == name)
            .map_or(name, |s| s.label.as_str())
    }

    /// Seconds of load a run takes (startup not counted).
    pub fn load_seconds(&self, quick: bool) -> f64 {
        let reps = f64::from(self.repetitions(quick));
        self.points(quick).iter().map(|p| p.runtime() * reps).sum()
    }
}
