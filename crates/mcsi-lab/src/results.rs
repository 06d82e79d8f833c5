//! The CSV files of an experiment: `runs.csv` (one row per run, appended as runs end) and
//! `results.csv` (one row per point: median, min and max of each metric over the repetitions).

use crate::point::param_columns;
use crate::spec::{Experiment, Metric, Point};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ResultsError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Csv { path: PathBuf, source: csv::Error },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
}

/// One run: a point, a repetition, its figures.
#[derive(Debug, Clone)]
pub struct RunRow {
    pub key: String,
    pub series: String,
    pub rep: u32,
    pub seed: u64,
    /// Parameter name to canonical value.
    pub params: BTreeMap<String, String>,
    pub metrics: Vec<(Metric, f64)>,
    /// `ok`, `failed: why`, or `retried: why` (an attempt that failed for the machine's sake,
    /// such as a port in use, and was run again).
    pub status: String,
    /// The host's default TCP congestion control when the run started.
    pub congestion: String,
    pub started: String,
    pub wall_s: f64,
}

impl RunRow {
    pub fn ok(&self) -> bool {
        self.status == "ok"
    }
    /// An attempt that failed for the machine's sake and was run again.
    pub fn retried(&self) -> bool {
        self.status.starts_with("retried")
    }
    pub fn metric(&self, m: Metric) -> Option<f64> {
        self.metrics.iter().find(|(k, _)| *k == m).map(|(_, v)| *v)
    }
}

fn header() -> Vec<String> {
    let mut h: Vec<String> = ["key", "series", "rep", "seed"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    h.extend(param_columns().iter().map(|s| s.to_string()));
    h.extend(Metric::ALL.iter().map(|m| m.column().to_string()));
    h.extend(
        ["status", "congestion", "started_utc", "wall_s"]
            .iter()
            .map(|s| s.to_string()),
    );
    h
}

/// Appends rows to `runs.csv`, flushing after each so a crash loses at most the run under way.
pub struct RunWriter {
    path: PathBuf,
    w: csv::Writer<std::fs::File>,
}

impl RunWriter {
    pub fn open(path: &Path) -> Result<RunWriter, ResultsError> {
        let exists = path.exists() && std::fs::metadata(path).is_ok_and(|m| m.len() > 0);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| ResultsError::Io {
                path: path.into(),
                source,
            })?;
        if exists {
            let (_, h) = open_csv(path)?;
            if h != header() {
                // Written before a parameter existed: carry its rows over to today's columns
                // (load_runs refuses anything else), so that a resumed run appends to them.
                let rows = load_runs(path).map_err(|_| ResultsError::Format {
                    path: path.into(),
                    message: "was written by another version of mcsi (other columns); finish it with that version, or start over with --fresh".into(),
                })?;
                let tmp = path.with_extension("csv.upgrade");
                let _ = std::fs::remove_file(&tmp);
                {
                    let mut up = RunWriter::open(&tmp)?;
                    for r in &rows {
                        up.append(r)?;
                    }
                }
                std::fs::rename(&tmp, path).map_err(|source| ResultsError::Io {
                    path: path.into(),
                    source,
                })?;
                return RunWriter::open(path);
            }
        }
        let mut w = csv::WriterBuilder::new()
            .has_headers(false)
            .from_writer(file);
        if !exists {
            w.write_record(header())
                .map_err(|source| ResultsError::Csv {
                    path: path.into(),
                    source,
                })?;
        }
        Ok(RunWriter {
            path: path.into(),
            w,
        })
    }

    pub fn append(&mut self, r: &RunRow) -> Result<(), ResultsError> {
        let mut rec = vec![
            r.key.clone(),
            r.series.clone(),
            r.rep.to_string(),
            r.seed.to_string(),
        ];
        for p in param_columns() {
            rec.push(r.params.get(p).cloned().unwrap_or_default());
        }
        for m in Metric::ALL {
            rec.push(r.metric(m).map_or(String::new(), |v| format!("{v:.6}")));
        }
        rec.extend([
            r.status.clone(),
            r.congestion.clone(),
            r.started.clone(),
            format!("{:.1}", r.wall_s),
        ]);
        let path = self.path.clone();
        self.w
            .write_record(&rec)
            .and_then(|()| self.w.flush().map_err(csv::Error::from))
            .map_err(|source| ResultsError::Csv { path, source })
    }
}

/// Opens a CSV file and reads its header.
fn open_csv(path: &Path) -> Result<(csv::Reader<std::fs::File>, Vec<String>), ResultsError> {
    let csv_err = |source| ResultsError::Csv {
        path: path.into(),
        source,
    };
    let mut rd = csv::Reader::from_path(path).map_err(csv_err)?;
    let h = rd
        .headers()
        .map_err(csv_err)?
        .iter()
        .map(String::from)
        .collect();
    Ok((rd, h))
}

/// Reads `runs.csv`.
pub fn load_runs(path: &Path) -> Result<Vec<RunRow>, ResultsError> {
    let (mut rd, h) = open_csv(path)?;
    // Files written before a parameter existed lack its column (the parameter was unset);
    // anything else must be exactly what this version writes.
    let full = header();
    let params = param_columns();
    // Metric columns may be missing too (measured only by later versions).
    let metrics: Vec<String> = Metric::ALL.iter().map(|m| m.column().to_string()).collect();
    let fits = h.iter().all(|c| full.contains(c))
        && full
            .iter()
            .all(|c| h.contains(c) || params.contains(&c.as_str()) || metrics.contains(c))
        && h.iter()
            .enumerate()
            .all(|(i, c)| h[..i].iter().all(|d| d != c));
    if !fits {
        return Err(ResultsError::Format {
            path: path.into(),
            message: "its columns are not those this version of mcsi writes; move it away or run without resuming (--fresh)".into(),
        });
    }
    let mut out = Vec::new();
    for (i, rec) in rd.records().enumerate() {
        let rec = rec.map_err(|source| ResultsError::Csv {
            path: path.into(),
            source,
        })?;
        let col = |name: &str| {
            h.iter()
                .position(|x| x == name)
                .and_then(|j| rec.get(j))
                .unwrap_or("")
        };
        let bad = |what: &str| ResultsError::Format {
            path: path.into(),
            message: format!("row {}: bad {what}", i + 2),
        };
        let mut params = BTreeMap::new();
        for p in param_columns() {
            let v = col(p);
            if !v.is_empty() {
                params.insert(p.to_string(), v.to_string());
            }
        }
        let mut metrics = Vec::new();
        for m in Metric::ALL {
            let v = col(m.column());
            if !v.is_empty() {
                metrics.push((m, v.parse::<f64>().map_err(|_| bad(m.column()))?));
            }
        }
        out.push(RunRow {
            key: col("key").to_string(),
            series: col("series").to_string(),
            rep: col("rep").parse().map_err(|_| bad("rep"))?,
            seed: col("seed").parse().map_err(|_| bad("seed"))?,
            params,
            metrics,
            status: col("status").to_string(),
            congestion: col("congestion").to_string(),
            started: col("started_utc").to_string(),
            wall_s: col("wall_s").parse().unwrap_or(0.0),
        });
    }
    Ok(out)
}

/// Median, min and max of one metric at one point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Spread {
    pub fn of(mut v: Vec<f64>) -> Option<Spread> {
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: v[0],
            max: v[n - 1],
            n,
        })
    }
}

/// A point with its successful runs summarised.
#[derive(Debug, Clone)]
pub struct Aggregate {
    pub point: Point,
    pub runs: usize,
    pub failed: usize,
    pub metrics: BTreeMap<Metric, Spread>,
}

/// Summarises `runs` for each point of the experiment (quick or full).
pub fn aggregate(exp: &Experiment, quick: bool, runs: &[RunRow]) -> Vec<Aggregate> {
    exp.points(quick)
        .into_iter()
        .map(|point| {
            let key = point.key();
            let mine: Vec<&RunRow> = runs.iter().filter(|r| r.key == key).collect();
            let ok: Vec<&&RunRow> = mine.iter().filter(|r| r.ok()).collect();
            let metrics = Metric::ALL
                .into_iter()
                .filter_map(|m| {
                    Spread::of(ok.iter().filter_map(|r| r.metric(m)).collect()).map(|s| (m, s))
                })
                .collect();
            Aggregate {
                point,
                runs: ok.len(),
                failed: mine.iter().filter(|r| !r.ok() && !r.retried()).count(),
                metrics,
            }
        })
        .collect()
}

/// Writes `results.csv`: one row per point.
pub fn write_results(
    exp: &Experiment,
    quick: bool,
    runs: &[RunRow],
    path: &Path,
) -> Result<(), ResultsError> {
    let e = |source| ResultsError::Csv {
        path: path.into(),
        source,
    };
    let mut w = csv::Writer::from_path(path).map_err(e)?;
    let mut h: Vec<String> = ["key", "series", "series_label"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    h.extend(param_columns().iter().map(|s| s.to_string()));
    h.extend(["runs", "failed"].iter().map(|s| s.to_string()));
    for m in Metric::ALL {
        for s in ["median", "min", "max"] {
            h.push(format!("{}_{s}", m.column()));
        }
    }
    w.write_record(&h).map_err(e)?;
    for a in aggregate(exp, quick, runs) {
        let mut rec = vec![
            a.point.key(),
            a.point.series.clone(),
            exp.series_label(&a.point.series).to_string(),
        ];
        for p in param_columns() {
            rec.push(a.point.text(p).to_string());
        }
        rec.push(a.runs.to_string());
        rec.push(a.failed.to_string());
        for m in Metric::ALL {
            match a.metrics.get(&m) {
                Some(s) => rec.extend([s.median, s.min, s.max].iter().map(|v| format!("{v:.6}"))),
                None => rec.extend(std::iter::repeat_n(String::new(), 3)),
            }
        }
        w.write_record(&rec).map_err(e)?;
    }
    w.flush().map_err(|source| ResultsError::Io {
        path: path.into(),
        source,
    })
}

/// `YYYY-MM-DD HH:MM:SS` UTC for seconds since the epoch.
pub fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn spread_median_min_max() {
        let s = Spread::of(vec![3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.n), (2.0, 1.0, 3.0, 3));
        let s = Spread::of(vec![4.0, 1.0]).unwrap();
        assert_eq!(s.median, 2.5);
        assert!(Spread::of(vec![]).is_none());
    }

    #[test]
    fn runs_written_before_a_parameter_existed_are_carried_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("runs.csv");
        let row = |series: &str| RunRow {
            key: format!("k-{series}"),
            series: series.into(),
            rep: 0,
            seed: 1,
            params: BTreeMap::from([("bs".to_string(), "4096".to_string())]),
            metrics: vec![(Metric::BwMbs, 1.5)],
            status: "ok".into(),
            congestion: "bbr".into(),
            started: "2026-11-25 00:00:00".into(),
            wall_s: 3.0,
        };
        RunWriter::open(&path).unwrap().append(&row("old")).unwrap();
        // Drop the "cc" column, as an older version wrote the file.
        let (mut rd, h) = open_csv(&path).unwrap();
        let drop = h.iter().position(|c| c == "cc").unwrap();
        let mut w = csv::Writer::from_path(dir.path().join("old.csv")).unwrap();
        let keep = |r: Vec<String>| -> Vec<String> {
            r.into_iter()
                .enumerate()
                .filter(|(i, _)| *i != drop)
                .map(|(_, v)| v)
                .collect()
        };
        w.write_record(keep(h.clone())).unwrap();
        for r in rd.records() {
            w.write_record(keep(r.unwrap().iter().map(String::from).collect()))
                .unwrap();
        }
        drop_writer(w);
        std::fs::rename(dir.path().join("old.csv"), &path).unwrap();
        assert_ne!(open_csv(&path).unwrap().1, header());

        RunWriter::open(&path).unwrap().append(&row("new")).unwrap();
        assert_eq!(open_csv(&path).unwrap().1, header());
        let rows = load_runs(&path).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].series.as_str(), rows[1].series.as_str()),
            ("old", "new")
        );
        assert_eq!(rows[0].params, row("old").params);
        assert_eq!(rows[0].metric(Metric::BwMbs), Some(1.5));
    }

    fn drop_writer(mut w: csv::Writer<std::fs::File>) {
        w.flush().unwrap();
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(1_795_000_000), "2026-11-18 11:06:40");
    }
}
