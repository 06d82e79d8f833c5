//! `mcsi lab`: the research's experiments, rerun on emulated links through the real binaries.

use anyhow::{bail, Context};
use mcsi_lab::run::{self, Options};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Subcommand)]
pub enum Command {
    /// List the experiments, with what each tests and how long it runs.
    List,
    /// Run experiments (by name, or spec files ending in .toml) into DIR/NAME/: runs.csv (one
    /// row per run, appended as runs end: an interrupted run resumes from it) and results.csv
    /// (median, min and max per point). Needs root (network namespaces) and /dev/net/tun.
    Run(RunArgs),
    /// Rewrite the figures and report.md of every experiment in DIR from its runs.csv, and an
    /// index of them all (index.md, index.html).
    Report {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
}

#[derive(clap::Args)]
pub struct RunArgs {
    /// Experiment names or spec files (.toml); `all` runs every shipped experiment.
    #[arg(required = true, value_name = "NAME")]
    names: Vec<String>,
    /// The experiment's short form: fewer points, shorter runs (about a minute each).
    #[arg(long)]
    quick: bool,
    /// Output directory; each experiment writes into DIR/NAME/.
    #[arg(long, value_name = "DIR", default_value = "lab-out")]
    out: PathBuf,
    /// Start afresh: discard runs.csv rows of an earlier run instead of resuming.
    #[arg(long)]
    fresh: bool,
}

fn minutes(secs: f64) -> String {
    if secs < 90.0 {
        format!("{secs:.0} s")
    } else {
        format!("{:.0} min", secs / 60.0)
    }
}

pub fn run(c: Command) -> anyhow::Result<ExitCode> {
    match c {
        Command::List => {
            for (name, _) in mcsi_lab::BUILTIN {
                let e = mcsi_lab::load(name).map_err(anyhow::Error::msg)?;
                let (pf, pq) = (e.points(false).len(), e.points(true).len());
                println!("{name}\n  {}\n  {}", e.title, e.source);
                println!(
                    "  full: {pf} points x {} repetitions, about {} of load; quick: {pq} points x {}, about {}",
                    e.repetitions(false),
                    minutes(e.load_seconds(false)),
                    e.repetitions(true),
                    minutes(e.load_seconds(true)),
                );
                println!(
                    "  claims: {}",
                    e.claims
                        .iter()
                        .map(|c| c.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Run(a) => {
            let names: Vec<String> = if a.names.iter().any(|n| n == "all") {
                mcsi_lab::BUILTIN
                    .iter()
                    .map(|(n, _)| n.to_string())
                    .collect()
            } else {
                a.names.clone()
            };
            // Parse every spec before running any, so a typo does not surface an hour in.
            let exps = names
                .iter()
                .map(|n| mcsi_lab::load(n).map_err(anyhow::Error::msg))
                .collect::<anyhow::Result<Vec<_>>>()?;
            for e in &exps {
                mcsi_lab::run::check_congestion(&e.points(a.quick))
                    .map_err(|m| anyhow::anyhow!("{}: {m}", e.name))?;
            }
            // Simulated points (engine = "sim") need no namespaces.
            let emulated = exps.iter().any(|e| {
                e.points(a.quick)
                    .iter()
                    .any(|p| !mcsi_lab::point::simulated(p))
            });
            if let Some(why) = mcsi_link::run::missing_privileges().filter(|_| emulated) {
                bail!(
                    "mcsi lab run: {why}; the experiments run behind mcsi link, which needs them"
                );
            }
            let mcsi = std::env::current_exe().context("finding the mcsi binary")?;
            let opts = Options {
                mcsi,
                out: a.out.clone(),
                quick: a.quick,
                resume: !a.fresh,
            };
            let mut failed = 0;
            for e in &exps {
                let o = run::run(e, &opts)?;
                eprintln!(
                    "{}: {} runs done, {} resumed from earlier, {} failed, {} retried after a failure of the machine's; results in {}",
                    e.name,
                    o.done,
                    o.skipped,
                    o.failed,
                    o.retried,
                    a.out.join(&e.name).display()
                );
                if let Some(r) = &o.report {
                    eprintln!("{}: report in {}", e.name, r.display());
                }
                // A claim without a measurement means the runs it needs all failed.
                failed += o.unmeasured;
                failed += o.failed;
                // A goal of mcsi's own that is missed fails the run, unless it is known to be.
                for g in &o.missed_goals {
                    eprintln!("{}: goal {g} missed", e.name);
                }
                failed += o.missed_goals.len();
            }
            mcsi_lab::report::write_index(&a.out).map_err(anyhow::Error::msg)?;
            eprintln!(
                "index of all results: {}",
                a.out.join("index.html").display()
            );
            Ok(if failed > 0 {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            })
        }
        Command::Report { dir } => {
            let done = mcsi_lab::report::write_index(&dir).map_err(anyhow::Error::msg)?;
            for (e, w) in &done {
                println!(
                    "{}: {}; {}",
                    e.name,
                    mcsi_lab::report::counts_line(&w.judged),
                    w.report.display()
                );
            }
            println!(
                "index: {} and {}",
                dir.join("index.md").display(),
                dir.join("index.html").display()
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}
