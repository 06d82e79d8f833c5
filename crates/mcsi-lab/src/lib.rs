//! mcsi's laboratory: the research's experiments as declarative specs (TOML, kept in
//! `experiments/`), run through the real binaries (`mcsi link run`, `mcsi target`,
//! `mcsi bench`), with results as CSV, figures as PNG and reports that set each published
//! claim beside the model and the measurement.

pub mod model;
pub mod params;
pub mod plot;
pub mod point;
pub mod report;
pub mod results;
pub mod run;
pub mod spec;

pub use spec::{Experiment, SpecError};

/// The experiments shipped with mcsi: name and spec text.
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "thesis-small-io",
        include_str!("../experiments/thesis-small-io.toml"),
    ),
    (
        "thesis-latency",
        include_str!("../experiments/thesis-latency.toml"),
    ),
    ("thesis-mtu", include_str!("../experiments/thesis-mtu.toml")),
    (
        "thesis-queue-depth",
        include_str!("../experiments/thesis-queue-depth.toml"),
    ),
    ("wan-loss", include_str!("../experiments/wan-loss.toml")),
    (
        "wan-loss-cc",
        include_str!("../experiments/wan-loss-cc.toml"),
    ),
    ("two-paths", include_str!("../experiments/two-paths.toml")),
    (
        "toyoda-table2",
        include_str!("../experiments/toyoda-table2.toml"),
    ),
    (
        "thesis-targets",
        include_str!("../experiments/thesis-targets.toml"),
    ),
    ("thesis-per", include_str!("../experiments/thesis-per.toml")),
    (
        "chishima-fig10",
        include_str!("../experiments/chishima-fig10.toml"),
    ),
    ("nbd-wan", include_str!("../experiments/nbd-wan.toml")),
    (
        "chishima-fig17",
        include_str!("../experiments/chishima-fig17.toml"),
    ),
    (
        "routes-vs-mptcp",
        include_str!("../experiments/routes-vs-mptcp.toml"),
    ),
    ("conn-kill", include_str!("../experiments/conn-kill.toml")),
    ("nam-tables", include_str!("../experiments/nam-tables.toml")),
    (
        "seed001-window",
        include_str!("../experiments/seed001-window.toml"),
    ),
    (
        "seed001-pdu",
        include_str!("../experiments/seed001-pdu.toml"),
    ),
    (
        "seed001-segment",
        include_str!("../experiments/seed001-segment.toml"),
    ),
    (
        "seed001-bandwidth",
        include_str!("../experiments/seed001-bandwidth.toml"),
    ),
];

/// Parses a shipped experiment.
pub fn builtin(name: &str) -> Option<Result<Experiment, SpecError>> {
    BUILTIN
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(n, text)| spec::parse(n, &format!("experiments/{n}.toml"), text))
}

/// Loads an experiment by name, or from a spec file when `name` ends in `.toml`.
pub fn load(name: &str) -> Result<Experiment, String> {
    if name.ends_with(".toml") {
        let path = std::path::Path::new(name);
        let text = std::fs::read_to_string(path).map_err(|e| format!("{name}: {e}"))?;
        let stem = path
            .file_stem()
            .map_or("experiment".into(), |s| s.to_string_lossy().into_owned());
        return spec::parse(&stem, name, &text).map_err(|e| e.to_string());
    }
    match builtin(name) {
        Some(r) => r.map_err(|e| e.to_string()),
        None => {
            let names: Vec<_> = BUILTIN.iter().map(|(n, _)| *n).collect();
            Err(format!(
                "no experiment named '{name}' (have {}; or give a spec file ending in .toml)",
                names.join(", ")
            ))
        }
    }
}
