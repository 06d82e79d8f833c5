//! `mcsi sim`: mcsi's initiator and target protocol cores on virtual time, over the simulator's
//! Linux-like TCP (or smoltcp's) and the link emulator's models, with no sockets or devices.

use crate::cmd::bench::parse_runtime;
use anyhow::{bail, Context};
use mcsi_link::{LinkConfig, PathBy, PathConfig};
use mcsi_sim::initiator::{Rw, Workload};
use mcsi_sim::net::{Congestion, TcpConfig, TcpStack};
use mcsi_sim::{Report, Scenario};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    mcsi sim\n  \
    mcsi sim --path rate=50mbit,delay=20ms,loss=1% --congestion reno --bs 128KiB --iodepth 8 --connections 4\n  \
    mcsi sim --path profile=802.11b --rw write --bs 2KiB --connections 2 --iodepth 2\n  \
    mcsi sim --initiators 50 --path rate=1gbit,delay=1ms --bs 64KiB --iodepth 4 --csv sessions.csv")]
pub struct Args {
    /// The link between the initiators and the target, as `mcsi link run --path` takes it
    /// (rate, delay, jitter, loss, loss-ge, queue, profile=802.11b, ...); repeat it for
    /// several paths.
    #[arg(long, default_value = "rate=100mbit,delay=5ms")]
    path: Vec<String>,
    /// How connections are spread over several paths: hash, port or source.
    #[arg(long, default_value = "port")]
    path_by: String,
    /// Seed of the link's random draws (loss, jitter, 802.11 backoff).
    #[arg(long, default_value_t = 1)]
    link_seed: u64,
    /// The hosts' TCP: linuxlike (the simulator's own, with Linux's loss recovery, timers and
    /// TCP_INFO) or smoltcp (smoltcp's: 1 s RTO floor, no SACK-based recovery).
    #[arg(long, default_value = "linuxlike")]
    tcp: String,
    /// TCP congestion control on every socket, both sides: reno or cubic.
    #[arg(long, default_value = "cubic")]
    congestion: String,
    /// IP MTU; segments carry 40 bytes less.
    #[arg(long, default_value_t = 1500)]
    mtu: usize,
    /// Each socket's send and receive buffer (the largest window it offers and fills).
    #[arg(long, default_value = "4MiB")]
    tcp_buffer: String,
    /// The largest data segment both sides take (MaxRecvDataSegmentLength, 512B to 16MiB-1):
    /// seed 001's PDU size. Without it each side offers its default (the initiator 256 KiB,
    /// the target mcsi target's `[limits]`).
    #[arg(long)]
    pdu: Option<String>,
    /// Initiators, one session each, sharing the link.
    #[arg(long, default_value_t = 1)]
    initiators: usize,
    /// TCP connections per session (MC/S).
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// How the initiator spreads commands over its connections (as mcsi bench --policy).
    #[arg(long, default_value = "round-robin")]
    policy: String,
    /// I/O pattern: read, write, randread, randwrite.
    #[arg(long, default_value = "read")]
    rw: String,
    /// I/O size, a multiple of 512 bytes.
    #[arg(long, default_value = "4KiB")]
    bs: String,
    /// I/Os in flight per session.
    #[arg(long, default_value_t = 1)]
    iodepth: u32,
    /// Simulated time commands are issued for (seconds, or 500ms, 2m).
    #[arg(long, default_value = "10", value_parser = parse_runtime)]
    runtime: f64,
    /// The target's LUN.
    #[arg(long, default_value = "ram:64MiB")]
    lun: String,
    /// Disks behind the LUN, after seed 001: cheetah-9lp[:DRIVES] (Seagate Cheetah 9LP,
    /// 10,025 RPM, 8 drives striped by default, on 1 Gbit/s Fibre Channel); the LUN then takes
    /// their capacity instead of --lun.
    #[arg(long, value_name = "MODEL")]
    disk: Option<String>,
    /// Seed of the TCP stacks and random offsets.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write one row per session to this CSV file.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

fn scenario(a: &Args) -> anyhow::Result<Scenario> {
    let mut paths = Vec::new();
    for p in &a.path {
        let mut c = PathConfig::default();
        c.apply_spec(p).with_context(|| format!("--path {p}"))?;
        paths.push(c);
    }
    let buffer = mcsi_units::parse_size(&a.tcp_buffer).context("--tcp-buffer")?;
    if !(4096..=(1 << 30)).contains(&buffer) {
        bail!("--tcp-buffer {}: between 4KiB and 1GiB", a.tcp_buffer);
    }
    if !(576..=65535).contains(&a.mtu) {
        bail!("--mtu {}: between 576 and 65535", a.mtu);
    }
    let bs = mcsi_units::parse_size(&a.bs).context("--bs")?;
    if bs == 0 || bs % 512 != 0 || bs > 16 << 20 {
        bail!("--bs {}: a multiple of 512 bytes, at most 16MiB", a.bs);
    }
    if a.iodepth == 0 || a.initiators == 0 || a.connections == 0 {
        bail!("--iodepth, --initiators and --connections must be at least 1");
    }
    if a.connections > 8 {
        bail!(
            "--connections {}: the target takes at most 8 per session",
            a.connections
        );
    }
    if a.initiators > 60_000 {
        bail!("--initiators {}: at most 60000", a.initiators);
    }
    Ok(Scenario {
        link: LinkConfig {
            paths,
            path_by: PathBy::parse(&a.path_by).context("--path-by")?,
            seed: a.link_seed,
        },
        tcp: TcpConfig {
            stack: TcpStack::parse(&a.tcp).map_err(|e| anyhow::anyhow!("--tcp: {e}"))?,
            congestion: Congestion::parse(&a.congestion)
                .map_err(|e| anyhow::anyhow!("--congestion: {e}"))?,
            buffer: buffer as usize,
            mtu: a.mtu,
        },
        initiators: a.initiators,
        connections: a.connections,
        policy: a.policy.clone(),
        work: Workload {
            rw: Rw::parse(&a.rw).map_err(|e| anyhow::anyhow!("--rw: {e}"))?,
            bs: bs as u32,
            iodepth: a.iodepth,
            runtime: Duration::from_secs_f64(a.runtime),
            blocks: u64::MAX,
        },
        lun: a.lun.clone(),
        disk: a
            .disk
            .as_deref()
            .map(mcsi_sim::disk::DiskConfig::parse)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--disk: {e}"))?,
        pdu: match &a.pdu {
            None => None,
            Some(p) => {
                let n = mcsi_units::parse_size(p).context("--pdu")?;
                if !(512..=16_777_215).contains(&n) {
                    bail!("--pdu {p}: between 512B and 16MiB-1 (16777215 bytes)");
                }
                Some(n as u32)
            }
        },
        seed: a.seed,
    })
}

fn json(s: &Scenario, r: &Report) -> serde_json::Value {
    serde_json::json!({
        "simulated_s": r.simulated_s,
        "wall_s": r.wall_s,
        "bw_mbs": r.bw_mbs,
        "iops": r.iops,
        "lat_mean_ms": r.lat_mean_ms,
        "lat_p50_ms": r.lat_p50_ms,
        "lat_p99_ms": r.lat_p99_ms,
        "io_kib": f64::from(s.work.bs) / 1024.0,
        "fairness": r.fairness,
        "congestion": s.tcp.congestion.name(),
        "tcp": s.tcp.stack.name(),
        "drops": { "up": r.drops[0], "down": r.drops[1] },
        "packets": { "up": r.packets[0], "down": r.packets[1] },
        "retransmits": r.retransmits.map(|x| serde_json::json!({ "initiators": x[0], "target": x[1] })),
        "timeouts": r.timeouts.map(|x| serde_json::json!({ "initiators": x[0], "target": x[1] })),
        "disk": r.disk.map(|d| serde_json::json!({
            "requests": d.requests, "cache_hits": d.cache_hits, "max_queue": d.max_queue,
        })),
        "target": {
            "commands": r.target.commands,
            "r2ts": r.target.r2ts,
            "send_queue_max_bytes": r.target.send_queue_max,
            "send_queue_median_bytes": r.target.send_queue_median,
            "srtt_median_ms": r.target.srtt_median_us as f64 / 1000.0,
            "srtt_p90_ms": r.target.srtt_p90_us as f64 / 1000.0,
            "min_rtt_ms": r.target.min_rtt_us as f64 / 1000.0,
            "data_in": r.target.data_in,
            "max_tasks_per_session": r.target.max_tasks,
        },
        "sessions": r.sessions.iter().map(|x| serde_json::json!({
            "ios": x.ios, "errors": x.errors, "bytes": x.bytes, "elapsed_s": x.elapsed_s,
            "bw_mbs": x.bw_mbs, "iops": x.iops, "lat_mean_ms": x.lat_mean_ms,
            "lat_p50_ms": x.lat_p50_ms, "lat_p99_ms": x.lat_p99_ms, "login_ms": x.login_ms,
            "events": x.events, "failure": x.failure,
        })).collect::<Vec<_>>(),
    })
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let s = scenario(&a)?;
    let r = mcsi_sim::run(&s)?;
    if let Some(p) = &a.csv {
        let mut f = std::fs::File::create(p).with_context(|| format!("--csv {}", p.display()))?;
        r.write_csv(&mut f)
            .with_context(|| format!("--csv {}", p.display()))?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&json(&s, &r))?);
    } else {
        print_report(&s, &r);
    }
    let failed: Vec<String> = r
        .sessions
        .iter()
        .enumerate()
        .filter_map(|(i, x)| x.failure.as_ref().map(|f| format!("session {i}: {f}")))
        .collect();
    if !failed.is_empty() {
        for f in &failed {
            eprintln!("mcsi sim: {f}");
        }
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

fn print_report(s: &Scenario, r: &Report) {
    println!(
        "simulated {:.3} s in {:.3} s of wall time ({:.0}x); {} session(s) of {} connection(s), {} {} at depth {}, TCP {} {}",
        r.simulated_s,
        r.wall_s,
        r.simulated_s / r.wall_s.max(1e-9),
        s.initiators,
        s.connections,
        s.work.rw.name(),
        s.work.bs,
        s.work.iodepth,
        s.tcp.stack.name(),
        s.tcp.congestion.name()
    );
    println!(
        "throughput {:.3} MB/s in all; fairness {:.4}; link packets up {} down {}, dropped up {} down {}",
        r.bw_mbs, r.fairness, r.packets[0], r.packets[1], r.drops[0], r.drops[1]
    );
    if let (Some(x), Some(t)) = (r.retransmits, r.timeouts) {
        println!(
            "TCP retransmitted {} segments from the initiators ({} timeouts), {} from the target ({} timeouts)",
            x[0], t[0], x[1], t[1]
        );
    }
    println!(
        "target: {} commands, {} R2Ts, {} Data-In, at most {} tasks in one session; send queue per connection at most {} KiB (median of the connections' most {} KiB)",
        r.target.commands,
        r.target.r2ts,
        r.target.data_in,
        r.target.max_tasks,
        r.target.send_queue_max / 1024,
        r.target.send_queue_median / 1024
    );
    if r.target.srtt_median_us > 0 {
        println!(
            "target sockets: smoothed RTT {:.2} ms median, {:.2} ms at the 90th percentile (sampled every 100 ms per connection); minimum RTT {:.2} ms",
            r.target.srtt_median_us as f64 / 1000.0,
            r.target.srtt_p90_us as f64 / 1000.0,
            r.target.min_rtt_us as f64 / 1000.0
        );
    }
    if let Some(d) = r.disk {
        println!(
            "disks: {} requests, {} from the read-ahead cache, at most {} queued at one drive",
            d.requests, d.cache_hits, d.max_queue
        );
    }
    let shown = r.sessions.len().min(8);
    for (i, x) in r.sessions.iter().take(shown).enumerate() {
        println!(
            "session {i}: {:.3} MB/s, {:.1} IOPS, latency mean {:.3} ms p50 {:.3} p99 {:.3}, {} errors, login {:.1} ms{}",
            x.bw_mbs, x.iops, x.lat_mean_ms, x.lat_p50_ms, x.lat_p99_ms, x.errors, x.login_ms,
            x.failure.as_ref().map(|f| format!(", FAILED: {f}")).unwrap_or_default()
        );
    }
    if r.sessions.len() > shown {
        println!(
            "... {} more sessions (--csv writes them all)",
            r.sessions.len() - shown
        );
    }
}
