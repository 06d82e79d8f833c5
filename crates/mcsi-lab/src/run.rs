//! Runs an experiment: each point, each repetition, as `mcsi link run` with `mcsi target` on
//! the host side and `mcsi bench` behind the link. One CSV row per run, appended as soon as the
//! run ends, so that an interrupted experiment resumes where it stopped.

use crate::params::Role;
use crate::point::{
    check_point, link_args, members, mptcp, qos_at, qos_rates, qos_requirement, ram_size, sessions,
    sim_congestion, sim_window, simulated, PORT,
};
use crate::results::{self, RunRow};
use crate::spec::{Experiment, Metric, Point};
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::HashSet;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The target's name in every run.
pub const IQN: &str = "iqn.2026-01.org.mcsi:target";
/// The competing bulk flow's iperf3 port.
const BULK_PORT: u16 = 5201;

/// How to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The mcsi binary that runs link, target and bench.
    pub mcsi: PathBuf,
    /// DIR: the experiment writes into DIR/NAME/.
    pub out: PathBuf,
    pub quick: bool,
    /// Keep rows already in DIR/NAME/runs.csv (resume); false starts afresh.
    pub resume: bool,
}

/// What a run of an experiment did.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// The experiment's report.md.
    pub report: Option<PathBuf>,
    pub done: usize,
    pub skipped: usize,
    /// Claims left without a measurement (every run they need failed).
    pub unmeasured: usize,
    /// Goals of mcsi's own that were missed and are not known to be
    /// ([`crate::spec::Claim::known_miss`]), nor left ungated in a quick run
    /// ([`crate::spec::Claim::no_quick_gate`]).
    pub missed_goals: Vec<String>,
    pub failed: usize,
    /// Attempts that failed for the machine's sake and were run again.
    pub retried: usize,
}

/// A run error that stops the experiment (not a failed run, which is recorded and skipped).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Results(#[from] results::ResultsError),
    #[error("{0}")]
    Other(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RunError + '_ {
    move |source| RunError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `mptcpize run ` before a standard program's name when the point runs over MPTCP: Debian's
/// wrapper turns its TCP sockets into MPTCP ones.
fn mptcpize(p: &Point) -> &'static str {
    if mptcp(p) {
        "mptcpize run "
    } else {
        ""
    }
}

/// The `mcsi bench` options for point `p`, after the URL.
pub fn bench_args(p: &Point, seed: u64) -> Vec<String> {
    let mut a = Vec::new();
    if mptcp(p) {
        a.push("--mptcp".to_string());
    }
    for (d, v) in p.params.iter().filter(|(d, _)| d.role == Role::Bench) {
        match d.name {
            "asymmetric" | "verify" => {
                if v.text == "true" {
                    a.push(format!("--{}", d.name));
                }
            }
            "cc" => {
                a.push("--congestion".to_string());
                a.push(v.text.clone());
            }
            // A rule replaces the fixed size.
            "bs" if p.params.get("bs_auto").is_some() => {}
            "bs_auto" => {
                a.extend(["--bs".to_string(), "auto".to_string()]);
                a.extend(["--bs-rule".to_string(), v.text.clone()]);
            }
            "bs_max" => {
                a.extend(["--bs-max".to_string(), d.arg(v)]);
            }
            // Its workload is in rw, bs and rate_iops already.
            "qos_q" => {}
            name => {
                a.push(format!("--{}", name.replace('_', "-")));
                a.push(d.arg(v));
            }
        }
    }
    a.push("--seed".into());
    a.push(seed.to_string());
    a.push("--json".into());
    a
}

/// Quotes a word for sh.
fn sh_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=%,@+".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The congestion control the host's new sockets use.
pub fn host_congestion() -> String {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The whole command line of one run.
pub fn command(mcsi: &Path, p: &Point, seed: u64, summary: &Path) -> Result<Command, String> {
    check_point(p)?;
    if simulated(p) {
        return sim_command(mcsi, p, seed);
    }
    let bin = sh_quote(&mcsi.to_string_lossy());
    let mut lun = p.text("lun").to_string();
    if let (Some(share), Some(q)) = (p.num("storage_share"), qos_requirement(p)) {
        let us = (share / 100.0 * q.rt_s * 1e6).round() as u64;
        lun.push_str(&format!(",service_time={us}us"));
    }
    let qos = match (qos_rates(p)?, qos_at(p)) {
        (Some((c2s, s2c)), (_, true)) => format!(
            " --qos to_client={},to_storage={}",
            s2c.ceil() as u64,
            c2s.ceil() as u64
        ),
        _ => String::new(),
    };
    let (target, lun_no) = match p.text("target") {
        "tgt" => (tgt_script(p)?, 1),
        _ => (
            format!(
                "exec {bin} target --listen $MCSI_LINK_PEER:{PORT} --iqn {IQN} --lun {}{}{qos}",
                vec![sh_quote(&lun); sessions(p).max(members(p))].join(" --lun "),
                p.params
                    .get("cc")
                    .map_or(String::new(), |cc| format!(" --congestion {}", cc.text)),
            ) + if mptcp(p) { " --mptcp" } else { "" },
            0,
        ),
    };
    // The target side's congestion control, as a route attribute: the link's host-side route
    // to each of the initiator's addresses gets its own /32 with congctl, which goes when the
    // link's device goes.
    let target = match p.params.get("target_cc") {
        Some(cc) => format!(
            "dev=$(ip -o route get $MCSI_LINK_ADDR | sed -n 's/.* dev \\([^ ]*\\).*/\\1/p'); \
             for a in $(env | sed -n 's/^MCSI_LINK_ADDR_[0-9]*=//p'); do \
             ip route replace $a/32 dev \"$dev\" src $MCSI_LINK_PEER congctl {cc} || \
             {{ echo \"cannot set congestion control {cc} on the route to $a (dev '$dev')\" >&2; exit 1; }}; done\n{target}",
            cc = cc.text
        ),
        None => target,
    };
    let url = format!("iscsi://$MCSI_LINK_PEER:{PORT}/{IQN}/{lun_no}");
    let client = match p.text("client") {
        "iscsi-perf" => iscsi_perf_script(p, &url),
        "nbd-fio" => nbd_fio_script(&bin, p, &url, seed),
        _ if p.params.get("volume").is_some() => volume_script(&bin, p, seed),
        _ if sessions(p) > 1 => {
            // One bench per session, each on its own LUN and seed; their JSON documents follow
            // one another on stdout, in session order.
            let mut s = String::from("d=$(mktemp -d); pids=''");
            for i in 0..sessions(p) {
                let bench: Vec<String> = bench_args(p, seed + i as u64 * 1000)
                    .iter()
                    .map(|a| sh_quote(a))
                    .collect();
                s.push_str(&format!(
                    "; {bin} bench {} iscsi://$MCSI_LINK_PEER:{PORT}/{IQN}/{i} > $d/{i}.json & pids=\"$pids $!\"",
                    bench.join(" ")
                ));
            }
            s.push_str("; rc=0; for p in $pids; do wait $p || rc=$?; done; cat");
            for i in 0..sessions(p) {
                s.push_str(&format!(" $d/{i}.json"));
            }
            s.push_str("; rm -rf $d; exit $rc");
            s
        }
        _ => {
            let bench: Vec<String> = bench_args(p, seed).iter().map(|a| sh_quote(a)).collect();
            // The path addresses the link exports, bound in turn (path_by = "source").
            let binds: String = (0..p.num("routes").map_or(0, |n| n as usize))
                .map(|i| format!(" --bind $MCSI_LINK_ADDR_{i}"))
                .collect();
            format!("exec {bin} bench {}{binds} {url}", bench.join(" "))
        }
    };
    // The namespace's congestion control (a per-namespace sysctl: the host is not touched).
    let client = match p.params.get("initiator_cc") {
        Some(cc) => format!(
            "sysctl -qw net.ipv4.tcp_congestion_control={} || {{ echo \"cannot set congestion control {} in the initiator's namespace (allowed: $(cat /proc/sys/net/ipv4/tcp_allowed_congestion_control))\" >&2; exit 1; }}; {client}",
            cc.text, cc.text
        ),
        None => client,
    };
    // A competing bulk flow: iperf3 with CUBIC from 2 s before the load until it ends.
    let bulk = match p.text("bulk") {
        "up" => Some(""),
        "down" => Some(" -R"),
        "both" => Some(" --bidir"),
        _ => None,
    };
    let client = match bulk {
        Some(dir) => format!(
            "iperf3 -c $MCSI_LINK_PEER -p {BULK_PORT} -C cubic -t {}{dir} >/dev/null 2>&1 & bulk=$!; sleep 2; \
             ( {} ); rc=$?; kill $bulk 2>/dev/null; wait $bulk 2>/dev/null; exit $rc",
            p.runtime().ceil() as u64 + 60,
            client.strip_prefix("exec ").unwrap_or(&client)
        ),
        None => client,
    };
    let mut c = Command::new(mcsi);
    c.arg("link").arg("run").args(link_args(p)?);
    c.arg("--seed").arg(seed.to_string());
    c.arg("--quiet").arg("--summary-json").arg(summary);
    c.arg("--host")
        .arg(target)
        .arg("--host-wait")
        .arg(PORT.to_string());
    if bulk.is_some() {
        c.arg("--host")
            .arg(format!(
                "exec iperf3 -s -B $MCSI_LINK_PEER -p {BULK_PORT} >/dev/null"
            ))
            .arg("--host-wait")
            .arg(BULK_PORT.to_string());
    }
    c.arg("--").arg("sh").arg("-c").arg(client);
    c.env("MCSI_LOG", "warn");
    Ok(c)
}

/// `mcsi sim` for a point: the link's options as `--path` specifications, the workload as
/// bench's, one initiator per session, the run's seed for both the link and the stacks.
fn sim_command(mcsi: &Path, p: &Point, seed: u64) -> Result<Command, String> {
    let link = link_args(p)?;
    let mut base = Vec::new();
    let mut paths = Vec::new();
    let mut extra = Vec::new();
    for pair in link.chunks(2) {
        let [k, v] = pair else {
            return Err(format!("link option {pair:?} without a value"));
        };
        match k.as_str() {
            "--path" => paths.push(v.clone()),
            "--path-by" | "--mtu" => extra.extend([k.clone(), v.clone()]),
            k => base.push(format!("{}={v}", k.trim_start_matches("--"))),
        }
    }
    let base = base.join(",");
    let mut c = Command::new(mcsi);
    c.arg("sim");
    if paths.is_empty() {
        c.args(["--path", &base]);
    }
    for spec in &paths {
        c.args(["--path", &format!("{base},{spec}")]);
    }
    c.args(&extra);
    let or = |name: &str, default: &str| -> String {
        match p.text(name) {
            "" => default.to_string(),
            v => v.to_string(),
        }
    };
    c.args(["--rw", &or("rw", "read")])
        .args(["--bs", &or("bs", "4096")])
        .args(["--iodepth", &or("iodepth", "1")])
        .args(["--connections", &or("connections", "1")])
        .args(["--policy", &or("policy", "round-robin")])
        .args(["--runtime", &format!("{}", p.runtime())])
        .args(match p.text("lun") {
            l if l.starts_with("cheetah-9lp") => ["--disk", l],
            "" => ["--lun", "ram:64MiB"],
            l => ["--lun", l],
        })
        .args(["--congestion", sim_congestion(p)])
        .args(["--initiators", &sessions(p).to_string()])
        .args(
            p.params
                .get("pdu")
                .map(|v| ["--pdu".to_string(), v.text.clone()])
                .into_iter()
                .flatten(),
        )
        .args(
            sim_window(p)?
                .map(|b| ["--tcp-buffer".to_string(), b])
                .into_iter()
                .flatten(),
        )
        .args(["--seed", &seed.to_string()])
        .args(["--link-seed", &seed.to_string()])
        .arg("--json");
    Ok(c)
}

/// The figures of one `mcsi sim --json` report.
fn measure_sim(out: &[u8]) -> Result<Vec<(Metric, f64)>, String> {
    let j: serde_json::Value =
        serde_json::from_slice(out).map_err(|e| format!("mcsi sim printed no JSON ({e})"))?;
    if let Some(f) = j["sessions"]
        .as_array()
        .and_then(|a| a.iter().find_map(|s| s["failure"].as_str()))
    {
        return Err(format!("a simulated session failed: {f}"));
    }
    // As for emulated runs (measure_one, combine): errors or no I/O fail the run, and with
    // several sessions the 99th percentile is the worst session's.
    let sessions = j["sessions"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let errors: u64 = sessions.iter().filter_map(|s| s["errors"].as_u64()).sum();
    if errors > 0 {
        return Err(format!("{errors} simulated commands ended in error"));
    }
    if sessions
        .iter()
        .filter_map(|s| s["ios"].as_u64())
        .sum::<u64>()
        == 0
    {
        return Err("no I/O completed".into());
    }
    let worst_p99 = sessions
        .iter()
        .filter_map(|s| s["lat_p99_ms"].as_f64())
        .reduce(f64::max);
    let mut m = Vec::new();
    for (metric, key) in [
        (Metric::BwMbs, "bw_mbs"),
        (Metric::Iops, "iops"),
        (Metric::LatMeanMs, "lat_mean_ms"),
        (Metric::LatP50Ms, "lat_p50_ms"),
        (Metric::LatP99Ms, "lat_p99_ms"),
        (Metric::IoKib, "io_kib"),
    ] {
        let v = match (metric, worst_p99) {
            (Metric::LatP99Ms, Some(w)) => w,
            _ => j[key]
                .as_f64()
                .ok_or_else(|| format!("mcsi sim's report has no {key}"))?,
        };
        m.push((metric, v));
    }
    if let (Some(i), Some(t)) = (
        j["retransmits"]["initiators"].as_f64(),
        j["retransmits"]["target"].as_f64(),
    ) {
        m.push((Metric::Retransmits, i));
        m.push((Metric::TargetRetransmits, t));
    }
    Ok(m)
}

/// The link-side script of a volume point: the spec (one member per LUN of the target, member i
/// bound to path address i mod routes) written to a temporary file, and mcsi bench over it.
fn volume_script(bin: &str, p: &Point, seed: u64) -> String {
    let mut spec = format!("layout = \"{}\"\n", p.text("volume"));
    if let Some(c) = p.params.get("chunk") {
        spec.push_str(&format!("chunk = {}\n", c.text));
    }
    let routes = p.num("routes").map(|n| (n as usize).max(1));
    for i in 0..members(p) {
        spec.push_str(&format!(
            "[[member]]\nurl = \"iscsi://$MCSI_LINK_PEER:{PORT}/{IQN}/{i}\"\n"
        ));
        if let Some(r) = routes {
            spec.push_str(&format!("bind = [\"$MCSI_LINK_ADDR_{}\"]\n", i % r));
        }
    }
    let bench: Vec<String> = bench_args(p, seed).iter().map(|a| sh_quote(a)).collect();
    format!(
        "d=$(mktemp -d); cat > $d/volume.toml <<SPEC\n{spec}SPEC\n{bin} bench {} volume:$d/volume.toml; rc=$?; rm -rf $d; exit $rc",
        bench.join(" ")
    )
}

/// tgt's management socket number for lab runs (tgtd -C), apart from the interop scripts'.
const TGT_CTL: u32 = 4260;

/// The host-side script that serves the point's LUN with tgtd: a file in /dev/shm (RAM, as
/// mcsi's ram LUN), the target configured before its portal opens, so that the link command,
/// which waits for the portal, never finds a target without its LUN.
fn tgt_script(p: &Point) -> Result<String, String> {
    let size = ram_size(p)?;
    let c = TGT_CTL;
    Ok(format!(
        r#"set -e
f=$(mktemp /dev/shm/mcsi-lab-tgt.XXXXXX)
truncate -s {size} "$f"
{wrap}tgtd -f -C {c} --iscsi portal=$MCSI_LINK_PEER:{alt} >&2 &
pid=$!
stop() {{
  tgtadm -C {c} --op update --mode sys --name State -v offline >/dev/null 2>&1 || true
  tgtadm -C {c} --op delete --mode system >/dev/null 2>&1 || true
  i=0
  while kill -0 $pid 2>/dev/null && [ $i -lt 20 ]; do sleep 0.1; i=$((i + 1)); done
  kill -9 $pid 2>/dev/null || true
  rm -f "$f"
}}
trap stop EXIT
trap 'exit 0' TERM INT
i=0
until tgtadm -C {c} --op show --mode system >/dev/null 2>&1; do
  i=$((i + 1)); [ $i -lt 200 ] || {{ echo "tgtd did not start" >&2; exit 1; }}; sleep 0.05
done
tgtadm -C {c} --lld iscsi --mode target --op new --tid 1 -T {IQN}
tgtadm -C {c} --lld iscsi --mode logicalunit --op new --tid 1 --lun 1 -b "$f"
tgtadm -C {c} --lld iscsi --mode target --op bind --tid 1 -I ALL
tgtadm -C {c} --lld iscsi --mode portal --op new --param portal=$MCSI_LINK_PEER:{PORT}
wait $pid"#,
        alt = PORT + 2,
        wrap = mptcpize(p),
    ))
}

/// The link-side script that runs iscsi-perf for the point's runtime (it has no duration
/// option: SIGINT stops it) and prints its per-second lines.
fn iscsi_perf_script(p: &Point, url: &str) -> String {
    let blocks = p.num("bs").map_or(8, |k| (k * 1024.0) as u64 / 512);
    let random = if p.text("rw") == "randread" {
        " -r"
    } else {
        ""
    };
    format!(
        "{}iscsi-perf -i iqn.2026-01.org.mcsi:lab-client -m {} -b {blocks}{random} {url} & pid=$!; \
         sleep {}; kill -INT $pid; wait $pid; exit 0",
        mptcpize(p),
        p.text("iodepth"),
        p.text("runtime"),
    )
}

/// The link-side script of client nbd-fio: `mcsi nbd` serves the LUN over a session shaped by
/// the point's bench parameters (connections, policy, congestion control, asymmetric mode) on a
/// Unix socket, and fio's nbd engine runs the point's I/O through it for its runtime. fio's JSON
/// (the layout `mcsi bench --json` prints) goes to stdout; a failure prints mcsi nbd's log.
fn nbd_fio_script(bin: &str, p: &Point, url: &str, seed: u64) -> String {
    let mut nbd = Vec::new();
    for (d, v) in p.params.iter().filter(|(d, _)| d.role == Role::Bench) {
        match d.name {
            "connections" | "policy" => nbd.push(format!("--{} {}", d.name, sh_quote(&d.arg(v)))),
            "cc" => nbd.push(format!("--congestion {}", sh_quote(&v.text))),
            "asymmetric" if v.text == "true" => nbd.push("--asymmetric".into()),
            _ => {}
        }
    }
    let bs = p.num("bs").map_or(4096, |k| (k * 1024.0) as u64);
    format!(
        r#"d=$(mktemp -d); trap 'rm -rf "$d"' EXIT
{bin} nbd {url} {nbd} --socket "$d/s" >"$d/nbd.log" 2>&1 & pid=$!
i=0
until [ -S "$d/s" ]; do
  i=$((i + 1))
  if [ $i -gt 300 ] || ! kill -0 $pid 2>/dev/null; then echo "mcsi nbd did not start:" >&2; cat "$d/nbd.log" >&2; exit 1; fi
  sleep 0.1
done
fio --name=lab --ioengine=nbd --uri="nbd+unix:///?socket=$d/s" --rw={rw} --bs={bs} --iodepth={depth} --time_based --runtime={runtime} --randseed={seed} --lat_percentiles=1 --output-format=json --output="$d/fio.json" >&2 || {{ echo "fio failed; mcsi nbd's log:" >&2; cat "$d/nbd.log" >&2; exit 1; }}
kill -TERM $pid; wait $pid || {{ echo "mcsi nbd did not stop cleanly:" >&2; cat "$d/nbd.log" >&2; exit 1; }}
cat "$d/fio.json""#,
        nbd = nbd.join(" "),
        rw = p.text("rw"),
        depth = p.text("iodepth"),
        runtime = p.text("runtime"),
    )
}

/// The mean of iscsi-perf's per-second `iops current N` figures, the first (ramp-up) left out
/// when the run printed more than two.
fn iscsi_perf_iops(out: &[u8]) -> Result<f64, String> {
    let text = String::from_utf8_lossy(out);
    let v: Vec<f64> = text
        .split(['\r', '\n'])
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            w.by_ref().find(|x| *x == "current")?;
            w.next()?.trim_end_matches(',').parse().ok()
        })
        .collect();
    // The first second includes the login; left out when there are others.
    let v = if v.len() > 2 { &v[1..] } else { &v[..] };
    if v.is_empty() {
        let last: Vec<&str> = text.lines().rev().take(3).collect();
        return Err(format!(
            "iscsi-perf printed {} rate line(s): {}",
            v.len(),
            last.join(" | ")
        ));
    }
    Ok(v.iter().sum::<f64>() / v.len() as f64)
}

/// Runs `c` with stdout and stderr to files, killing it after `limit`. Returns whether it
/// succeeded, or why not.
fn run_with_limit(
    mut c: Command,
    stdout: &Path,
    stderr: &Path,
    limit: Duration,
    tick: &dyn Fn(f64),
) -> Result<(), String> {
    let out = std::fs::File::create(stdout).map_err(|e| format!("{}: {e}", stdout.display()))?;
    let err = std::fs::File::create(stderr).map_err(|e| format!("{}: {e}", stderr.display()))?;
    let mut child = c
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start mcsi link run: {e}"))?;
    let t0 = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return Ok(()),
            Ok(Some(st)) => return Err(format!("mcsi link run exited with {st}")),
            Ok(None) => {}
            Err(e) => return Err(format!("waiting for mcsi link run: {e}")),
        }
        if t0.elapsed() > limit {
            // SIGTERM lets mcsi link stop its host commands; SIGKILL if it does not end.
            if let Ok(pid) = i32::try_from(child.id()) {
                // SAFETY: sends a signal to our own child, which has not been reaped yet.
                unsafe {
                    libc::kill(pid, libc::SIGTERM);
                }
            }
            std::thread::sleep(Duration::from_secs(3));
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("timed out after {:.0} s", limit.as_secs_f64()));
        }
        tick(t0.elapsed().as_secs_f64());
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Reads the figures of one run from `mcsi bench --json` output and the link's summary.
fn measure(bench: &[u8], summary: &Path, p: &Point) -> Result<Vec<(Metric, f64)>, String> {
    if simulated(p) {
        return measure_sim(bench);
    }
    // The target must have served the whole run, not died on its own.
    if let Ok(s) = std::fs::read_to_string(summary) {
        if let Ok(s) = serde_json::from_str::<serde_json::Value>(&s) {
            if s["host_commands"][0]["ended_early"].as_bool() == Some(true) {
                return Err("the target ended during the run".into());
            }
        }
    }
    if p.text("client") == "iscsi-perf" {
        let iops = iscsi_perf_iops(bench)?;
        let bs = p.num("bs").unwrap_or(4.0) * 1024.0;
        return Ok(vec![(Metric::BwMbs, iops * bs / 1e6), (Metric::Iops, iops)]);
    }
    let docs: Vec<serde_json::Value> = serde_json::Deserializer::from_slice(bench)
        .into_iter::<serde_json::Value>()
        .collect::<Result<_, _>>()
        .map_err(|e| format!("bench printed no JSON ({e})"))?;
    let want = sessions(p);
    if docs.len() != want {
        return Err(format!(
            "{} bench report(s) for {want} session(s)",
            docs.len()
        ));
    }
    let each = docs
        .iter()
        .enumerate()
        .map(|(i, j)| {
            measure_one(j, p).map_err(|e| {
                if want > 1 {
                    format!("session {}: {e}", i + 1)
                } else {
                    e
                }
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if want == 1 {
        return Ok(each.into_iter().flatten().collect());
    }
    let spans = docs
        .iter()
        .map(|j| {
            let end = j["timestamp_ms"].as_f64()?;
            let ms = j["jobs"][0]["job_runtime"].as_f64()?;
            Some((end - ms, end))
        })
        .collect::<Option<Vec<_>>>()
        .ok_or("a session's bench report has no timestamp_ms or job_runtime")?;
    Ok(combine(&docs, &each, &spans))
}

/// The figures of several sessions run at once. Throughput and IOPS are all the sessions moved
/// over their common span, from the first one's start to the last one's end (`spans`, in ms),
/// so that sessions that did not quite overlap are not counted as if they had; retransmissions
/// add up; mean response time, median and I/O size are weighted by each session's I/O count
/// (exact for the mean, an approximation for the median); the 99th percentile is the worst
/// session's.
fn combine(
    docs: &[serde_json::Value],
    each: &[Vec<(Metric, f64)>],
    spans: &[(f64, f64)],
) -> Vec<(Metric, f64)> {
    let start = spans.iter().map(|x| x.0).fold(f64::INFINITY, f64::min);
    let end = spans.iter().map(|x| x.1).fold(0.0, f64::max);
    let secs = ((end - start) / 1000.0).max(1e-3);
    let moved = |k: &str| -> Vec<f64> {
        docs.iter()
            .map(|j| {
                let job = &j["jobs"][0];
                job["read"][k].as_f64().unwrap_or(0.0) + job["write"][k].as_f64().unwrap_or(0.0)
            })
            .collect()
    };
    let (bytes, ios) = (moved("io_bytes"), moved("total_ios"));
    let total_ios: f64 = ios.iter().sum();
    let get = |v: &[(Metric, f64)], m: Metric| v.iter().find(|(k, _)| *k == m).map(|(_, x)| *x);
    let mut out = Vec::new();
    for m in Metric::ALL {
        let Some(vals) = each.iter().map(|v| get(v, m)).collect::<Option<Vec<f64>>>() else {
            continue;
        };
        let x = match m {
            Metric::BwMbs => bytes.iter().sum::<f64>() / secs / 1e6,
            Metric::Iops => total_ios / secs,
            Metric::Retransmits | Metric::TargetRetransmits => vals.iter().sum(),
            Metric::LatP99Ms => vals.iter().copied().fold(0.0, f64::max),
            Metric::LatMeanMs | Metric::LatP50Ms | Metric::IoKib if total_ios > 0.0 => {
                vals.iter().zip(&ios).map(|(v, w)| v * w).sum::<f64>() / total_ios
            }
            _ => continue,
        };
        out.push((m, x));
    }
    out
}

/// The figures of one `mcsi bench --json` report.
fn measure_one(j: &serde_json::Value, p: &Point) -> Result<Vec<(Metric, f64)>, String> {
    let job = &j["jobs"][0];
    let error = job["error"].as_i64().unwrap_or(-1);
    if error != 0 {
        return Err(format!("bench reported error {error}"));
    }
    let f = |d: &str, k: &str| job[d][k].as_f64().unwrap_or(0.0);
    let bw = f("read", "bw_bytes") + f("write", "bw_bytes");
    let ios = job["read"]["total_ios"].as_u64().unwrap_or(0)
        + job["write"]["total_ios"].as_u64().unwrap_or(0);
    if ios == 0 {
        return Err("no I/O completed".into());
    }
    let dir = if p.text("rw").contains("read") {
        "read"
    } else {
        "write"
    };
    let lat = &job[dir]["lat_ns"];
    let pct = |q: &str| lat["percentile"][q].as_f64().unwrap_or(0.0) / 1e6;
    if let Some(cc) = p.params.get("cc") {
        // The run only counts if every connection ran the congestion control asked for.
        let conns = j["mcsi"]["connections"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if let Some(c) = conns.iter().find(|c| c["congestion"] != cc.text.as_str()) {
            return Err(format!(
                "connection {} ran congestion control {} instead of {}",
                c["index"], c["congestion"], cc.text
            ));
        }
    }
    // Only mcsi bench reports its connections (fio through mcsi nbd does not).
    let retrans: Option<f64> = j["mcsi"]["connections"].as_array().map(|cs| {
        cs.iter()
            .map(|c| c["tcp"]["retransmits"].as_f64().unwrap_or(0.0))
            .sum()
    });
    let mut out = vec![
        (Metric::BwMbs, bw / 1e6),
        (Metric::Iops, f("read", "iops") + f("write", "iops")),
        (Metric::LatMeanMs, lat["mean"].as_f64().unwrap_or(0.0) / 1e6),
        (Metric::LatP50Ms, pct("50.000000")),
        (Metric::LatP99Ms, pct("99.000000")),
    ];
    if let Some(r) = retrans {
        out.push((Metric::Retransmits, r));
    }
    // The target's side, when it reported it (mcsi's target, X-org.mcsi.TcpReport).
    let target_retrans: Option<f64> = j["mcsi"]["connections"].as_array().and_then(|cs| {
        cs.iter()
            .map(|c| c["target_tcp"]["total_retrans"].as_f64())
            .sum::<Option<f64>>()
    });
    if let Some(t) = target_retrans {
        out.push((Metric::TargetRetransmits, t));
    }
    let ios = job["read"]["total_ios"].as_f64().unwrap_or(0.0)
        + job["write"]["total_ios"].as_f64().unwrap_or(0.0);
    let bytes = job["read"]["io_bytes"].as_f64().unwrap_or(0.0)
        + job["write"]["io_bytes"].as_f64().unwrap_or(0.0);
    if ios > 0.0 {
        out.push((Metric::IoKib, bytes / ios / 1024.0));
    }
    if let Some(q) = qos_requirement(p) {
        // Of the I/Os the rate's schedule asked for in the run (a Poisson schedule asks for
        // more or fewer than IOPS x runtime), else of IOPS x runtime.
        let done = job["read"]["total_ios"].as_f64().unwrap_or(0.0)
            + job["write"]["total_ios"].as_f64().unwrap_or(0.0);
        let pct = match j["mcsi"]["offered_ios"].as_f64() {
            Some(offered) if offered > 0.0 => done / offered * 100.0,
            _ => (f("read", "iops") + f("write", "iops")) / q.iops * 100.0,
        };
        out.push((Metric::IopsPct, pct));
        let mean_ms = lat["mean"].as_f64().unwrap_or(0.0) / 1e6;
        out.push((Metric::RtPct, mean_ms / (q.rt_s * 1e3) * 100.0));
    }
    let m = &j["mcsi"];
    if let (Some(r), Some(i)) = (m["recoveries"].as_f64(), m["reissued"].as_f64()) {
        out.push((Metric::Recoveries, r));
        out.push((Metric::Reissued, i));
    }
    if p.params.get("kill_every").is_some() {
        let pauses: Vec<f64> = m["kills"]
            .as_array()
            .map(|k| {
                k.iter()
                    .filter_map(|x| x["longest_io_ms"].as_f64())
                    .collect()
            })
            .unwrap_or_default();
        let Some(pause) = results::Spread::of(pauses) else {
            return Err("kill_every is set but no connection was killed during the run".into());
        };
        out.push((Metric::KillPauseMs, pause.median));
        out.push((Metric::KillPauseMaxMs, pause.max));
        if let Some(s) = m["longest_stall_ms"].as_f64() {
            out.push((Metric::StallMs, s));
        }
    }
    Ok(out)
}

/// The row of one run of `p`, without its outcome.
fn row_of(p: &Point, rep: u32, seed: u64, congestion: &str) -> RunRow {
    RunRow {
        key: p.key(),
        series: p.series.clone(),
        rep,
        seed,
        params: p
            .params
            .iter()
            .map(|(d, v)| (d.name.to_string(), v.text.clone()))
            .collect(),
        metrics: Vec::new(),
        status: String::new(),
        congestion: congestion.to_string(),
        started: String::new(),
        wall_s: 0.0,
    }
}

/// Why a failed run failed for the machine's sake rather than the software's, if it did: a
/// server that could not bind its port, or did not come up in time. Such a run is run once more.
pub fn machine_fault(error: &str, log: &str) -> Option<&'static str> {
    let both = format!("{error}\n{log}");
    if both.contains("Address already in use") || both.contains("address already in use") {
        Some("a port was in use")
    } else if both.contains("nothing listened on") || both.contains("did not start") {
        Some("the server was slow to start")
    } else {
        None
    }
}

/// Writes a failed attempt's record: the point, the command, the error and all it printed.
fn keep_log(
    log: &Path,
    p: &Point,
    rep: u32,
    cmdline: &str,
    error: &str,
    stdout: &Path,
    stderr: &str,
) -> Result<(), String> {
    if let Some(d) = log.parent() {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    let out = std::fs::read_to_string(stdout).unwrap_or_else(|e| format!("({e})"));
    let text = format!(
        "point: {}\nrepetition: {rep}\nerror: {error}\ncommand: {cmdline}\n\n--- stderr ---\n{stderr}\n--- stdout ---\n{out}\n",
        p.key(),
    );
    std::fs::write(log, text).map_err(|e| format!("{}: {e}", log.display()))
}

/// The last `n` non-empty lines of `text`.
fn last_lines(text: &str, n: usize) -> Vec<&str> {
    let v: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    v[v.len().saturating_sub(n)..].to_vec()
}

fn now_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    results::utc(secs)
}

/// Checks that the initiator's namespace may use every congestion control the points name: a
/// namespace other than the host's may only choose from the host's
/// net.ipv4.tcp_allowed_congestion_control.
/// The programs besides mcsi that point `p` runs on this host, each with the Debian package
/// that has it.
pub(crate) fn tools(p: &Point) -> Vec<(&'static str, &'static str)> {
    let mut t = Vec::new();
    if simulated(p) {
        return t;
    }
    let tgt = p.text("target") == "tgt";
    if tgt {
        t.extend([("tgtd", "tgt"), ("tgtadm", "tgt")]);
    }
    match p.text("client") {
        "iscsi-perf" => t.push(("iscsi-perf", "libiscsi-bin")),
        "nbd-fio" => t.push(("fio", "fio")),
        _ => {}
    }
    if matches!(p.text("bulk"), "up" | "down" | "both") {
        t.push(("iperf3", "iperf3"));
    }
    // tgtd and iscsi-perf speak MPTCP through Debian's wrapper (mcsi does by itself).
    if mptcp(p) && (tgt || p.text("client") == "iscsi-perf") {
        t.push(("mptcpize", "mptcpize"));
    }
    t
}

/// Every program the points need, looked up with `has` before the first run: a missing one
/// stops the experiment at once, naming the package to install, rather than failing each run
/// with what the missing program left undone.
pub fn check_tools(points: &[Point], has: impl Fn(&str) -> bool) -> Result<(), String> {
    let mut missing = std::collections::BTreeMap::new();
    for p in points {
        for (tool, package) in tools(p) {
            if !missing.contains_key(tool) && !has(tool) {
                missing.insert(tool, package);
            }
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    let mut packages: Vec<&str> = missing.values().copied().collect();
    packages.sort_unstable();
    packages.dedup();
    Err(format!(
        "its points run {} and this host has no such program{}: install {} (apt-get install {})",
        missing.keys().copied().collect::<Vec<_>>().join(", "),
        if missing.len() > 1 { "s" } else { "" },
        packages.join(", "),
        packages.join(" ")
    ))
}

/// Whether an executable named `tool` is on the PATH.
pub fn on_path(tool: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|d| {
            std::fs::metadata(d.join(tool))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

pub fn check_congestion(points: &[Point]) -> Result<(), String> {
    let read =
        |f: &str| std::fs::read_to_string(format!("/proc/sys/net/ipv4/{f}")).unwrap_or_default();
    let allowed = read("tcp_allowed_congestion_control");
    let available = read("tcp_available_congestion_control");
    // Per-socket choices (cc) and the target side's route (target_cc) only need the algorithm
    // to exist: the lab runs as root, in the host's namespace for the target.
    let points: Vec<&Point> = points.iter().filter(|p| !simulated(p)).collect();
    for p in &points {
        for name in ["cc", "target_cc"] {
            if let Some(cc) = p.params.get(name) {
                mcsi_tcp::Congestion::new(&cc.text)
                    .and_then(|c| c.check())
                    .map_err(|e| format!("{name}: {e}"))?;
            }
        }
    }
    let mut want: Vec<&str> = points
        .iter()
        .filter_map(|p| p.params.get("initiator_cc"))
        .map(|v| v.text.as_str())
        .collect();
    want.sort_unstable();
    want.dedup();
    for cc in want {
        if !available.split_whitespace().any(|a| a == cc) {
            return Err(format!(
                "congestion control {cc} is not available in this kernel (available: {})",
                available.trim()
            ));
        }
        if !allowed.split_whitespace().any(|a| a == cc) {
            let mut all: Vec<&str> = allowed.split_whitespace().collect();
            all.push(cc);
            return Err(format!(
                "the initiator's namespace cannot use {cc}: a network namespace may only choose from the host's net.ipv4.tcp_allowed_congestion_control ({}); allow it (this changes no default) with: sysctl -w net.ipv4.tcp_allowed_congestion_control='{}'",
                allowed.trim(),
                all.join(" ")
            ));
        }
    }
    Ok(())
}

/// Runs `exp` into `opts.out/NAME/runs.csv`, then writes `results.csv`.
pub fn run(exp: &Experiment, opts: &Options) -> Result<Outcome, RunError> {
    check_congestion(&exp.points(opts.quick))
        .map_err(|e| RunError::Other(format!("{}: {e}", exp.name)))?;
    check_tools(&exp.points(opts.quick), on_path)
        .map_err(|e| RunError::Other(format!("{}: {e}", exp.name)))?;
    let dir = opts.out.join(&exp.name);
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let runs_csv = dir.join("runs.csv");
    if !opts.resume && runs_csv.exists() {
        std::fs::remove_file(&runs_csv).map_err(io(&runs_csv))?;
    }
    let cc = host_congestion();
    let mut meta = match crate::report::Meta::load(&dir) {
        Ok(m) if runs_csv.exists() => {
            if m.quick != opts.quick {
                return Err(RunError::Other(format!(
                    "{} holds a {} run; resume it with{} --quick, start over with --fresh, or use another --out",
                    dir.display(),
                    if m.quick { "quick" } else { "full" },
                    if m.quick { "" } else { "out" },
                )));
            }
            m
        }
        _ => crate::report::Meta::new(exp, opts.quick, now_utc(), cc.clone()),
    };
    meta.finished_utc = None;
    meta.save(&dir).map_err(RunError::Other)?;
    let spec_path = dir.join("spec.toml");
    std::fs::write(&spec_path, &exp.text).map_err(io(&spec_path))?;
    let existing = if runs_csv.exists() {
        results::load_runs(&runs_csv)?
    } else {
        Vec::new()
    };
    let have: HashSet<(String, u32)> = existing
        .iter()
        .filter(|r| r.ok())
        .map(|r| (r.key.clone(), r.rep))
        .collect();
    let points = exp.points(opts.quick);
    let reps = exp.repetitions(opts.quick);
    let mut todo = Vec::new();
    // Repetitions outermost: a machine that is busy for a while disturbs one repetition of
    // many points rather than all repetitions of one, and an interrupted run has whole passes.
    for rep in 1..=reps {
        for p in &points {
            if !have.contains(&(p.key(), rep)) {
                todo.push((rep, p));
            }
        }
    }
    let mut out = Outcome {
        skipped: points.len() * reps as usize - todo.len(),
        ..Outcome::default()
    };
    let total: f64 = todo.iter().map(|(_, p)| p.runtime() + 1.0).sum();
    let tty = std::io::stderr().is_terminal();
    let bar = if tty {
        ProgressBar::new(total.ceil() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix} [{bar:30}] {elapsed_precise} ETA {eta_precise} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_prefix(exp.name.clone());
    if out.skipped > 0 {
        let m = format!(
            "{}: resuming, {} runs already in {}",
            exp.name,
            out.skipped,
            runs_csv.display()
        );
        if tty {
            bar.println(m)
        } else {
            eprintln!("{m}")
        }
    }
    // A simulated run's TCP is the simulator's, with the point's congestion control.
    let congestion_of = |p: &Point| {
        if simulated(p) {
            format!("sim-{}", sim_congestion(p))
        } else {
            cc.clone()
        }
    };
    let mut writer = results::RunWriter::open(&runs_csv)?;
    let stdout = dir.join(".bench.json");
    let stderr = dir.join(".stderr.txt");
    let summary = dir.join(".link-summary.json");
    let mut done_secs = 0.0;
    let n = todo.len();
    let logs = dir.join("logs");
    for (i, (rep, p)) in todo.into_iter().enumerate() {
        let seed = exp.seed.wrapping_add(u64::from(rep) - 1);
        let desc = describe(exp, p);
        let point_no = points.iter().position(|q| q.key() == p.key()).unwrap_or(i) + 1;
        let mut attempt = 0;
        let (measured, started, wall, status) = loop {
            attempt += 1;
            bar.set_message(format!("{}/{n} {desc}", i + 1));
            let started = now_utc();
            let t0 = Instant::now();
            let limit = Duration::from_secs_f64(p.runtime() + 60.0);
            let mut cmdline = String::new();
            let result = command(&opts.mcsi, p, seed, &summary).and_then(|c| {
                cmdline = format!("{c:?}");
                run_with_limit(c, &stdout, &stderr, limit, &|s| {
                    bar.set_position((done_secs + s.min(p.runtime() + 1.0)) as u64)
                })
            });
            let measured = result.and_then(|()| {
                let b = std::fs::read(&stdout).map_err(|e| format!("{}: {e}", stdout.display()))?;
                measure(&b, &summary, p)
            });
            let wall = t0.elapsed().as_secs_f64();
            let e = match measured {
                Ok(m) => break (Ok(m), started, wall, "ok".to_string()),
                Err(e) => e,
            };
            // Keep what the run printed beside runs.csv, and show its end now.
            let log = logs.join(format!(
                "{}-point{point_no}-rep{rep}-try{attempt}.log",
                p.series
            ));
            let err_text = std::fs::read_to_string(&stderr).unwrap_or_default();
            let kept = keep_log(&log, p, rep, &cmdline, &e, &stdout, &err_text);
            let t = last_lines(&err_text, 3).join(" | ");
            let why = if t.is_empty() {
                e.clone()
            } else {
                format!("{e}: {t}")
            };
            let mut msg = format!(
                "{} [{}/{n}] rep {rep} {desc}: attempt {attempt} failed: {e}\n  command: {cmdline}\n  log: {}",
                exp.name,
                i + 1,
                kept.as_ref().map_or_else(|k| format!("not kept ({k})"), |()| log.display().to_string())
            );
            for l in last_lines(&err_text, 12) {
                msg.push_str("\n    | ");
                msg.push_str(l);
            }
            if tty {
                bar.println(msg)
            } else {
                eprintln!("{msg}")
            }
            let fault = machine_fault(&e, &err_text);
            if let (1, Some(fault)) = (attempt, fault) {
                // Recorded, not counted: the report lists it.
                writer.append(&RunRow {
                    status: format!("retried: {fault}: {why}"),
                    started,
                    wall_s: wall,
                    ..row_of(p, rep, seed, &congestion_of(p))
                })?;
                out.retried += 1;
                std::thread::sleep(Duration::from_secs(2));
                continue;
            }
            out.failed += 1;
            break (Err(e), started, wall, format!("failed: {why}"));
        };
        let row = RunRow {
            metrics: measured.unwrap_or_default(),
            status: status.clone(),
            started,
            wall_s: wall,
            ..row_of(p, rep, seed, &congestion_of(p))
        };
        writer.append(&row)?;
        out.done += 1;
        done_secs += p.runtime() + 1.0;
        bar.set_position(done_secs as u64);
        let bw = row
            .metric(Metric::BwMbs)
            .map_or("-".into(), |v| format!("{v:.3} MB/s"));
        let iops = row
            .metric(Metric::Iops)
            .map_or("-".into(), |v| format!("{v:.0} IOPS"));
        let line = format!(
            "{} [{}/{n}] rep {rep} {desc}: {bw}, {iops} {}",
            exp.name,
            i + 1,
            if row.ok() { "" } else { &status }
        );
        if tty {
            bar.println(line)
        } else {
            eprintln!("{line}")
        }
    }
    bar.finish_and_clear();
    for f in [&stdout, &stderr, &summary] {
        let _ = std::fs::remove_file(f);
    }
    meta.finished_utc = Some(now_utc());
    meta.save(&dir).map_err(RunError::Other)?;
    let w = crate::report::write(exp, &dir).map_err(RunError::Other)?;
    out.unmeasured = w
        .judged
        .iter()
        .filter(|j| j.verdict == crate::report::Verdict::NotMeasured)
        .count();
    for j in w
        .judged
        .iter()
        .filter(|j| j.verdict == crate::report::Verdict::NotMeasured)
    {
        eprintln!("{}: claim {} has no measurement", exp.name, j.claim.id);
    }
    out.missed_goals = w
        .judged
        .iter()
        .filter(|j| {
            j.claim.kind == crate::spec::Kind::Goal
                && j.verdict == crate::report::Verdict::Fails
                && j.claim.known_miss.is_none()
                && !(opts.quick && j.claim.no_quick_gate.is_some())
        })
        .map(|j| j.claim.id.clone())
        .collect();
    out.report = Some(w.report);
    Ok(out)
}

/// `series label, bs 2 KiB, rw read` for progress lines: the series and the swept values.
pub fn describe(exp: &Experiment, p: &Point) -> String {
    let mut parts = vec![p.series.clone()];
    for (d, _) in &exp.sweep {
        if let Some(v) = p.params.get(d.name) {
            parts.push(format!("{} {}", d.name, d.show(v)));
        }
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn doc(
        end_ms: u64,
        runtime_ms: u64,
        bytes: u64,
        ios: u64,
        mean_ns: f64,
        p99_ns: f64,
    ) -> String {
        let secs = runtime_ms as f64 / 1000.0;
        serde_json::json!({
            "timestamp_ms": end_ms,
            "jobs": [{
                "error": 0,
                "job_runtime": runtime_ms,
                "read": {
                    "io_bytes": bytes, "total_ios": ios, "bw_bytes": bytes as f64 / secs,
                    "iops": ios as f64 / secs,
                    "lat_ns": { "mean": mean_ns, "percentile": { "50.000000": mean_ns, "99.000000": p99_ns } }
                },
                "write": { "io_bytes": 0, "total_ios": 0, "bw_bytes": 0, "iops": 0 }
            }]
        })
        .to_string()
    }

    fn point(sessions: u32) -> Point {
        let text = format!(
            "title = \"t\"\nsource = \"s\"\nabout = \"a\"\n[base]\nrate = \"10mbit\"\nsessions = {sessions}\n[sweep]\nbs = [\"4KiB\"]\n[[figure]]\nname = \"f\"\ntitle = \"f\"\nx = \"bs\"\ny = \"bw_mbs\"\n"
        );
        crate::spec::parse("t", "t.toml", &text)
            .unwrap()
            .points(false)[0]
            .clone()
    }

    #[test]
    fn a_simulated_run_with_errors_or_no_io_fails_and_p99_is_the_worst_sessions() {
        let report = |errors: u64, ios: u64| {
            serde_json::json!({
                "bw_mbs": 1.0, "iops": 10.0, "lat_mean_ms": 5.0, "lat_p50_ms": 4.0,
                "lat_p99_ms": 9.0, "io_kib": 64.0,
                "sessions": [
                    { "errors": 0, "ios": ios, "lat_p99_ms": 8.0 },
                    { "errors": errors, "ios": ios, "lat_p99_ms": 30.0 },
                ],
            })
            .to_string()
        };
        let m = measure_sim(report(0, 5).as_bytes()).unwrap();
        assert!(m.contains(&(Metric::LatP99Ms, 30.0)), "{m:?}");
        assert!(m.contains(&(Metric::BwMbs, 1.0)));
        let e = measure_sim(report(2, 5).as_bytes()).unwrap_err();
        assert!(e.contains("2 simulated commands ended in error"), "{e}");
        let e = measure_sim(report(0, 0).as_bytes()).unwrap_err();
        assert_eq!(e, "no I/O completed");
    }

    #[test]
    fn sessions_add_up_over_their_common_window() {
        let none = Path::new("/nonexistent");
        // Two sessions of 2 s each, the second ending 1 s after the first: 3 s in all.
        let two = format!(
            "{}\n{}",
            doc(10_000, 2000, 2_000_000, 100, 2e6, 9e6),
            doc(11_000, 2000, 4_000_000, 300, 4e6, 5e6)
        );
        let m = measure(two.as_bytes(), none, &point(2)).unwrap();
        let get = |k: Metric| m.iter().find(|(x, _)| *x == k).unwrap().1;
        assert!((get(Metric::BwMbs) - 2.0).abs() < 1e-9, "6 MB over 3 s");
        assert!((get(Metric::Iops) - 400.0 / 3.0).abs() < 1e-9);
        // Weighted by each session's I/O rate (50 and 150 IOPS): (2 x 50 + 4 x 150) / 200.
        assert!((get(Metric::LatMeanMs) - 3.5).abs() < 1e-9);
        assert!(
            (get(Metric::LatP99Ms) - 9.0).abs() < 1e-9,
            "the worst session's"
        );
        // A session that printed nothing fails the run.
        let e = measure(doc(1, 1, 1, 1, 1.0, 1.0).as_bytes(), none, &point(2)).unwrap_err();
        assert!(e.contains("1 bench report(s) for 2 session(s)"), "{e}");
        // One session: its own figures.
        let m = measure(
            doc(10_000, 2000, 2_000_000, 100, 2e6, 9e6).as_bytes(),
            none,
            &point(1),
        )
        .unwrap();
        assert_eq!(m.iter().find(|(x, _)| *x == Metric::BwMbs).unwrap().1, 1.0);
    }

    #[test]
    fn a_missing_program_stops_the_experiment_naming_its_package() {
        let text = "title = \"t\"\nsource = \"s\"\nabout = \"a\"\n[base]\npath_by = \"source\"\nmptcp = true\nbulk = \"up\"\npaths = \"rate=10mbit,delay=10ms;rate=10mbit,delay=10ms\"\n[sweep]\nconnections = [1]\n[[series]]\nname = \"m\"\nlabel = \"m\"\nset = { target = \"mcsi\" }\n[[series]]\nname = \"t\"\nlabel = \"t\"\nset = { target = \"tgt\" }\n[[figure]]\nname = \"f\"\ntitle = \"f\"\nx = \"connections\"\ny = \"bw_mbs\"\n";
        let points = crate::spec::parse("t", "t.toml", text)
            .unwrap()
            .points(false);
        let e = check_tools(&points, |t| t != "mptcpize" && t != "iperf3").unwrap_err();
        assert_eq!(
            e,
            "its points run iperf3, mptcpize and this host has no such programs: install iperf3, mptcpize (apt-get install iperf3 mptcpize)"
        );
        assert!(check_tools(&points, |_| true).is_ok());
        // mcsi alone over MPTCP needs no wrapper.
        let mcsi_only: Vec<Point> = points
            .iter()
            .filter(|p| p.text("target") != "tgt")
            .cloned()
            .collect();
        assert!(check_tools(&mcsi_only, |t| t != "mptcpize").is_ok());
        assert!(on_path("sh") && !on_path("no-such-program-here"));
    }

    #[test]
    fn kills_become_options_and_their_figures_metrics() {
        let text = "title = \"t\"\nsource = \"s\"\nabout = \"a\"\n[base]\nrate = \"10mbit\"\nrw = \"randrw\"\nverify = true\nmax_erl = 2\nkill_every = 5\nconnections = 4\n[sweep]\nrtt = [10]\n[[figure]]\nname = \"f\"\ntitle = \"f\"\nx = \"rtt\"\ny = \"kill_pause_ms\"\n";
        let p = crate::spec::parse("t", "t.toml", text)
            .unwrap()
            .points(false)[0]
            .clone();
        let a = bench_args(&p, 1).join(" ");
        for want in ["--verify", "--max-erl 2", "--kill-every 5", "--rw randrw"] {
            assert!(a.contains(want), "{want} not in {a}");
        }
        assert!(!a.contains("--verify true"), "{a}");
        let mut j: serde_json::Value =
            serde_json::from_str(&doc(10_000, 2000, 2_000_000, 100, 2e6, 9e6)).unwrap();
        j["mcsi"] = serde_json::json!({
            "recoveries": 0, "reissued": 3, "longest_stall_ms": 40.0,
            "kills": [{"longest_io_ms": 30.0}, {"longest_io_ms": 90.0}, {"longest_io_ms": 50.0}],
        });
        let m = measure_one(&j, &p).unwrap();
        let get = |k: Metric| m.iter().find(|(x, _)| *x == k).unwrap().1;
        assert_eq!(get(Metric::Recoveries), 0.0);
        assert_eq!(get(Metric::Reissued), 3.0);
        assert_eq!(get(Metric::KillPauseMs), 50.0, "the median kill");
        assert_eq!(get(Metric::KillPauseMaxMs), 90.0);
        assert_eq!(get(Metric::StallMs), 40.0);
        // A run meant to kill connections that killed none is not a result.
        j["mcsi"]["kills"] = serde_json::json!([]);
        assert!(measure_one(&j, &p)
            .unwrap_err()
            .contains("no connection was killed"));
    }

    fn sim_point(extra: &str) -> Point {
        let text = format!(
            "title = \"t\"\nsource = \"s\"\nabout = \"a\"\n[base]\nengine = \"sim\"\nrate = \"50mbit\"\nqueue = \"1000p\"\nrw = \"randwrite\"\nbs = \"16KiB\"\niodepth = 8\nconnections = 2\nruntime = 3\n{extra}\n[sweep]\nrtt = [40]\n[[figure]]\nname = \"f\"\ntitle = \"f\"\nx = \"rtt\"\ny = \"bw_mbs\"\n"
        );
        crate::spec::parse("t", "t.toml", &text)
            .unwrap()
            .points(false)[0]
            .clone()
    }

    #[test]
    fn a_simulated_point_becomes_mcsi_sim_and_its_report_metrics() {
        let p = sim_point("cc = \"reno\"\nloss = \"1%\"");
        let c = command(Path::new("/bin/mcsi"), &p, 7, Path::new("/none")).unwrap();
        assert_eq!(c.get_program(), "/bin/mcsi");
        let args: Vec<String> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let a = args.join(" ");
        assert!(a.starts_with("sim --path "), "{a}");
        // The link's options as one --path specification, as mcsi link run would get them.
        let spec = &args[2];
        for want in ["rate=50000000bit", "queue=1000p", "delay=20ms", "loss=1%"] {
            assert!(spec.split(',').any(|x| x == want), "{want} not in {spec}");
        }
        for want in [
            "--rw randwrite",
            "--bs 16384",
            "--iodepth 8",
            "--connections 2",
            "--runtime 3",
            "--congestion reno",
            "--initiators 1",
            "--seed 7",
            "--link-seed 7",
            "--json",
        ] {
            assert!(a.contains(want), "{want} not in {a}");
        }
        // Without cc: CUBIC, Linux's default.
        let a = format!(
            "{:?}",
            command(Path::new("m"), &sim_point(""), 1, Path::new("/n")).unwrap()
        );
        assert!(a.contains("\"--congestion\" \"cubic\""), "{a}");
        // Seed 001's disks are the simulator's: a LUN of theirs becomes --disk.
        let a = format!(
            "{:?}",
            command(
                Path::new("m"),
                &sim_point("lun = \"cheetah-9lp:4\""),
                1,
                Path::new("/n")
            )
            .unwrap()
        );
        assert!(a.contains("\"--disk\" \"cheetah-9lp:4\""), "{a}");
        // Seed 001's windows are in segments: of the point's MSS, so they grow with the MTU.
        for (extra, want) in [
            ("window_segments = 100", "\"--tcp-buffer\" \"144800\""),
            (
                "window_segments = 100\nmtu = 9000",
                "\"--tcp-buffer\" \"894800\"",
            ),
            ("window = \"116800\"", "\"--tcp-buffer\" \"116800\""),
        ] {
            let c = command(Path::new("m"), &sim_point(extra), 1, Path::new("/n")).unwrap();
            let a = format!("{c:?}");
            assert!(a.contains(want), "{extra}: {a}");
        }
        let out = serde_json::json!({
            "bw_mbs": 2.5, "iops": 152.0, "lat_mean_ms": 52.0, "lat_p50_ms": 50.0,
            "lat_p99_ms": 90.0, "io_kib": 16.0,
            "sessions": [{"failure": null, "errors": 0, "ios": 4560, "lat_p99_ms": 90.0}],
        });
        let m = measure(out.to_string().as_bytes(), Path::new("/n"), &p).unwrap();
        let get = |k: Metric| m.iter().find(|(x, _)| *x == k).unwrap().1;
        assert_eq!(get(Metric::BwMbs), 2.5);
        assert_eq!(get(Metric::LatP99Ms), 90.0);
        let failed = serde_json::json!({"sessions": [{"failure": "login refused"}]});
        let e = measure(failed.to_string().as_bytes(), Path::new("/n"), &p).unwrap_err();
        assert!(e.contains("login refused"), "{e}");
    }

    #[test]
    fn what_the_simulator_does_not_model_is_refused() {
        // When the spec is read, before anything runs.
        for (extra, says) in [
            ("target = \"tgt\"\nlun = \"ram:16MiB\"", "tgt"),
            ("cc = \"bbr\"", "BBR"),
            ("max_erl = 2", "error recovery"),
            (
                "client = \"iscsi-perf\"\nrw = \"read\"",
                "clients other than mcsi bench",
            ),
            ("kill_every = 5", "kill_every"),
        ] {
            let text = format!(
                "title = \"t\"\nsource = \"s\"\nabout = \"a\"\n[base]\nengine = \"sim\"\nrate = \"50mbit\"\n{extra}\n[sweep]\nrtt = [40]\n[[figure]]\nname = \"f\"\ntitle = \"f\"\nx = \"rtt\"\ny = \"bw_mbs\"\n"
            );
            let e = crate::spec::parse("t", "t.toml", &text)
                .unwrap_err()
                .message;
            assert!(
                e.contains(says) && e.contains("engine \"emulated\""),
                "{extra}: {e}"
            );
        }
        let text = "title = \"t\"\nsource = \"s\"\nabout = \"a\"\n[base]\nengine = \"sim\"\nwindow = \"64KiB\"\nwindow_segments = 80\n[sweep]\nrtt = [40]\n[[figure]]\nname = \"f\"\ntitle = \"f\"\nx = \"rtt\"\ny = \"bw_mbs\"\n";
        let e = crate::spec::parse("t", "t.toml", text).unwrap_err().message;
        assert!(e.contains("window and window_segments both set"), "{e}");
    }
}
