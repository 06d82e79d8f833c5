//! `mcsi link`: run a command behind an emulated link.

use anyhow::Context;
use mcsi_link::run::{run as run_link, RunOptions};
use mcsi_link::{LinkConfig, PathBy, PathConfig};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Run COMMAND in a new network namespace whose traffic to the host crosses the emulated
    /// link. Inside, $MCSI_LINK_PEER is the host-side address; start servers for it with
    /// --host so that they bind that address only. Exits with COMMAND's status.
    Run(Box<RunArgs>),
    /// Send one command to a running link's control socket (`mcsi link run --control
    /// SOCKET`) and print its answer: `down PATH`, `up PATH` or `paths`.
    Control {
        /// The socket given to --control.
        socket: PathBuf,
        /// The command's words, e.g. `down 1`.
        #[arg(required = true, num_args = 1..)]
        command: Vec<String>,
    },
}

/// Per-direction options: `--X` sets both directions, `--X-up` the direction toward the host,
/// `--X-down` the direction toward COMMAND.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
                  mcsi link run --rate 5mbit --delay 5ms --host 'iperf3 -s -1 -B $MCSI_LINK_PEER -p 5201' \\\n      \
                  --host-wait 5201 -- sh -c 'iperf3 -c $MCSI_LINK_PEER -p 5201'\n  \
                  mcsi link run --profile 802.11b --per 5% -- sh -c 'ping -c 10 $MCSI_LINK_PEER'\n  \
                  mcsi link run --profile 802.11b --host 'mcsi target --listen $MCSI_LINK_PEER:3260' --host-wait 3260 \\\n      \
                  -- sh -c 'mcsi bench --runtime 10 iscsi://$MCSI_LINK_PEER:3260/iqn.2026-01.org.mcsi:target/0'\n  \
                  mcsi link run --path rate=10mbit,delay=5ms --path rate=2mbit,delay=40ms --path-by port -- ...")]
pub struct RunArgs {
    /// Bottleneck rate in bit/s (k/m/g suffixes: 5mbit, 500kbit); unset = unlimited.
    #[arg(long)]
    rate: Option<String>,
    #[arg(long)]
    rate_up: Option<String>,
    #[arg(long)]
    rate_down: Option<String>,
    /// Bytes added to each packet's length for its serialization time (framing overhead).
    #[arg(long)]
    overhead: Option<String>,
    /// One-way delay (10ms, 250us; a bare number is milliseconds).
    #[arg(long)]
    delay: Option<String>,
    #[arg(long)]
    delay_up: Option<String>,
    #[arg(long)]
    delay_down: Option<String>,
    /// Delay variation around --delay; see --jitter-dist.
    #[arg(long)]
    jitter: Option<String>,
    #[arg(long)]
    jitter_up: Option<String>,
    #[arg(long)]
    jitter_down: Option<String>,
    /// Jitter distribution: uniform (+-jitter, the default), normal, pareto, paretonormal
    /// (standard deviation = jitter).
    #[arg(long)]
    jitter_dist: Option<String>,
    /// Let jitter reorder packets; by default a packet never overtakes the one ahead of it.
    #[arg(long)]
    reorder: bool,
    /// Random loss, Bernoulli, in percent (5%, or 5).
    #[arg(long)]
    loss: Option<String>,
    #[arg(long)]
    loss_up: Option<String>,
    #[arg(long)]
    loss_down: Option<String>,
    /// Gilbert-Elliott loss as netem's gemodel: p,r,1-h,1-k in percent (r, 1-h, 1-k optional).
    #[arg(long)]
    loss_ge: Option<String>,
    #[arg(long)]
    loss_ge_up: Option<String>,
    #[arg(long)]
    loss_ge_down: Option<String>,
    /// Drop-tail queue limit: bytes (64KiB) or packets (100p). Default 1000 packets.
    #[arg(long)]
    queue: Option<String>,
    #[arg(long)]
    queue_up: Option<String>,
    #[arg(long)]
    queue_down: Option<String>,
    /// A share of the bottleneck reserved for one TCP port's packets, as PORT:RATE[:BURST]
    /// (e.g. 3260:2mbit): they queue apart and go first while a token bucket at RATE (depth
    /// BURST, default 3028 bytes) holds them, so they get RATE whatever else crosses the link,
    /// and never more. Other traffic uses the rest (without --rate, all it wants).
    #[arg(long, value_name = "PORT:RATE[:BURST]")]
    reserve: Option<String>,
    /// The reservation toward the host (what COMMAND sends).
    #[arg(long, value_name = "PORT:RATE[:BURST]")]
    reserve_up: Option<String>,
    /// The reservation toward COMMAND.
    #[arg(long, value_name = "PORT:RATE[:BURST]")]
    reserve_down: Option<String>,
    /// 802.11 airtime model for both directions on one medium: 802.11b or 802.11g.
    #[arg(long)]
    profile: Option<String>,
    /// 802.11 frame error rate per transmission attempt (needs --profile).
    #[arg(long)]
    per: Option<String>,
    /// 802.11 attempts per frame before it is dropped (default 7).
    #[arg(long)]
    retry_limit: Option<String>,
    /// A path: comma-separated key=value (rate, delay, jitter, loss, loss-ge, queue, reserve,
    /// profile, per, ... and their -up/-down forms) applied on top of the options above. Repeat for
    /// several paths; each flow stays on one path.
    #[arg(long = "path", value_name = "SPEC")]
    paths: Vec<String>,
    /// How flows are pinned to paths: hash (5-tuple), port (each new command-side port takes
    /// the next path in turn) or source (the command's side gets one address per path,
    /// $MCSI_LINK_ADDR_0, $MCSI_LINK_ADDR_1, ...; a packet takes the path of its source
    /// address, as on a multi-homed host: bind a connection's source to choose its route).
    #[arg(long, default_value = "hash")]
    path_by: String,
    /// Bring path PATH down at TIME after the link starts (PATH@TIME, e.g. 1@5s; repeatable):
    /// it drops what arrives for it and what it held, as a route that fails.
    #[arg(long, value_name = "PATH@TIME")]
    path_down: Vec<String>,
    /// Bring path PATH back up at TIME (PATH@TIME, e.g. 1@12s; repeatable).
    #[arg(long, value_name = "PATH@TIME")]
    path_up: Vec<String>,
    /// With --path-by source: set up the command namespace's MPTCP path manager so that an MPTCP
    /// connection (from $MCSI_LINK_ADDR_0) opens a subflow from each other address, one per
    /// path (`ip mptcp endpoint ... subflow`, `ip mptcp limits`). The host side keeps its own
    /// limits (Linux's default accepts 2 extra subflows).
    #[arg(long)]
    mptcp: bool,
    /// A Unix socket taking commands while the link runs, one per line: `down PATH`, `up
    /// PATH`, `paths`; each gets an `ok ...` or `error: ...` line back. `mcsi link control
    /// SOCKET down 1` sends one. A route fails when a script says so, not only at set times.
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Seed of every random draw (loss, jitter, backoff); same seed and traffic, same run.
    #[arg(long)]
    seed: Option<u64>,
    /// MTU of the link devices.
    #[arg(long, default_value_t = 1500)]
    mtu: u32,
    /// Write the delivered packets to this pcap file.
    #[arg(long)]
    pcap: Option<PathBuf>,
    /// Write one JSON line per packet event (deliver, drop with cause, filtered).
    #[arg(long, value_name = "FILE")]
    packet_log: Option<PathBuf>,
    /// Write the summary as JSON to this file.
    #[arg(long)]
    summary_json: Option<PathBuf>,
    /// Do not print the summary on exit.
    #[arg(long, short)]
    quiet: bool,
    /// A shell command (sh -c) run on the host side once the link is up, with $MCSI_LINK_PEER
    /// (host-side address: bind servers to it) and $MCSI_LINK_ADDR (COMMAND's address) set.
    /// Repeatable. Its standard output goes to standard error. Stopped (SIGTERM, SIGKILL after
    /// 5 s) when COMMAND exits; its status does not change mcsi link's.
    #[arg(long = "host", value_name = "SHELL COMMAND")]
    host: Vec<String>,
    /// Before starting COMMAND, wait until a TCP server listens on $MCSI_LINK_PEER:PORT
    /// (repeatable). Fails if a host command ends first or after --host-wait-timeout.
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    host_wait: Vec<u16>,
    /// How long --host-wait waits (10s, 500ms; a bare number is seconds).
    #[arg(long, value_name = "DURATION", default_value = "10s")]
    host_wait_timeout: String,
    /// Program and arguments to run behind the link.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

impl RunArgs {
    fn path_config(&self) -> anyhow::Result<PathConfig> {
        let mut p = PathConfig::default();
        // The profile first: --per and --retry-limit refine it. Then both-direction values,
        // then the per-direction ones, which override.
        let items: [(&str, &Option<String>); 26] = [
            ("profile", &self.profile),
            ("per", &self.per),
            ("retry-limit", &self.retry_limit),
            ("rate", &self.rate),
            ("overhead", &self.overhead),
            ("delay", &self.delay),
            ("jitter", &self.jitter),
            ("jitter-dist", &self.jitter_dist),
            ("loss", &self.loss),
            ("loss-ge", &self.loss_ge),
            ("queue", &self.queue),
            ("reserve", &self.reserve),
            ("rate-up", &self.rate_up),
            ("rate-down", &self.rate_down),
            ("delay-up", &self.delay_up),
            ("delay-down", &self.delay_down),
            ("jitter-up", &self.jitter_up),
            ("jitter-down", &self.jitter_down),
            ("loss-up", &self.loss_up),
            ("loss-down", &self.loss_down),
            ("loss-ge-up", &self.loss_ge_up),
            ("loss-ge-down", &self.loss_ge_down),
            ("queue-up", &self.queue_up),
            ("queue-down", &self.queue_down),
            ("reserve-up", &self.reserve_up),
            ("reserve-down", &self.reserve_down),
        ];
        for (k, v) in items {
            if let Some(v) = v {
                p.set(k, v).with_context(|| format!("--{k}"))?;
            }
        }
        if self.reorder {
            p.set("reorder", "on")?;
        }
        p.validate()?;
        Ok(p)
    }

    /// The --path-down and --path-up events, checked against the paths.
    fn path_events(&self) -> anyhow::Result<Vec<mcsi_link::PathEvent>> {
        let n = self.paths.len().max(1);
        let mut v = Vec::new();
        for (opt, list, up) in [
            ("--path-down", &self.path_down, false),
            ("--path-up", &self.path_up, true),
        ] {
            for s in list {
                let e =
                    mcsi_link::PathEvent::parse(s, up).map_err(|m| anyhow::anyhow!("{opt} {m}"))?;
                e.check(n).map_err(|m| anyhow::anyhow!("{opt} {s}: {m}"))?;
                v.push(e);
            }
        }
        Ok(v)
    }

    fn link_config(&self) -> anyhow::Result<LinkConfig> {
        let base = self.path_config()?;
        let paths = if self.paths.is_empty() {
            vec![base]
        } else {
            self.paths
                .iter()
                .map(|spec| {
                    let mut p = base.clone();
                    p.apply_spec(spec)
                        .with_context(|| format!("--path '{spec}'"))?;
                    Ok(p)
                })
                .collect::<anyhow::Result<Vec<_>>>()?
        };
        let seed = self.seed.unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            t ^ (u64::from(std::process::id()) << 32)
        });
        let cfg = LinkConfig {
            paths,
            path_by: PathBy::parse(&self.path_by)?,
            seed,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

pub fn run(c: Command) -> anyhow::Result<ExitCode> {
    match c {
        Command::Run(args) => run_cmd(*args),
        Command::Control { socket, command } => control_cmd(&socket, &command.join(" ")),
    }
}

fn control_cmd(socket: &std::path::Path, line: &str) -> anyhow::Result<ExitCode> {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).with_context(|| {
        format!(
            "connecting to {} (is `mcsi link run --control {}` running?)",
            socket.display(),
            socket.display()
        )
    })?;
    writeln!(s, "{line}").context("sending the command")?;
    let mut answer = String::new();
    std::io::BufReader::new(s)
        .read_line(&mut answer)
        .context("reading the answer")?;
    let answer = answer.trim();
    if let Some(e) = answer.strip_prefix("error: ") {
        anyhow::bail!("{e}");
    }
    println!("{answer}");
    Ok(ExitCode::SUCCESS)
}

fn run_cmd(args: RunArgs) -> anyhow::Result<ExitCode> {
    let link = args.link_config()?;
    if args.mptcp && link.path_by != PathBy::Source {
        anyhow::bail!(
            "--mptcp needs --path-by source: the subflows leave from one address per path"
        );
    }
    let seed = link.seed;
    let host_wait_timeout =
        mcsi_units::parse_duration(&args.host_wait_timeout, mcsi_units::BareUnit::Seconds)
            .context("--host-wait-timeout")?;
    let out = run_link(RunOptions {
        link,
        command: args.command.clone(),
        mtu: args.mtu,
        pcap: args.pcap.clone(),
        log: args.packet_log.clone(),
        kill_grace: Duration::from_secs(5),
        host_commands: args.host.clone(),
        host_wait: args.host_wait.clone(),
        host_wait_timeout,
        path_events: args.path_events()?,
        mptcp: args.mptcp,
        control: args.control.clone(),
    })?;
    if !args.quiet {
        eprint!("{}", out.summary);
        eprintln!(
            "  seed {seed}; link {} (host) <-> {} (command); command: {}",
            out.host_addr, out.command_addr, out.status
        );
        for h in &out.host {
            let when = if h.ended_early {
                "ended while the command ran"
            } else {
                "stopped after the command"
            };
            eprintln!("  host command '{}': {} ({when})", h.command, h.status);
        }
    }
    if let Some(p) = &args.summary_json {
        let v = serde_json::json!({
            "seed": seed,
            "host_addr": out.host_addr.to_string(),
            "command_addr": out.command_addr.to_string(),
            "status": out.status,
            "exit_code": out.code,
            "summary": out.summary,
            "host_commands": out.host.iter().map(|h| serde_json::json!({
                "command": h.command,
                "status": h.status,
                "exit_code": h.code,
                "ended_early": h.ended_early,
            })).collect::<Vec<_>>(),
        });
        std::fs::write(p, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("write summary to {}", p.display()))?;
    }
    Ok(ExitCode::from(out.code))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        c: Command,
    }

    fn cfg(args: &[&str]) -> anyhow::Result<LinkConfig> {
        let mut v = vec!["mcsi", "run"];
        v.extend_from_slice(args);
        v.extend_from_slice(&["--", "true"]);
        let Command::Run(a) = Cli::try_parse_from(v)?.c else {
            anyhow::bail!("not a run command");
        };
        a.link_config()
    }

    #[test]
    fn directions_and_paths() {
        let c = cfg(&["--rate", "5mbit", "--delay-down", "7ms", "--seed", "3"]).unwrap();
        assert_eq!(c.seed, 3);
        let p = &c.paths[0];
        assert_eq!((p.up.rate, p.down.rate), (Some(5e6), Some(5e6)));
        assert_eq!(p.down.delay, Duration::from_millis(7));
        assert_eq!(p.up.delay, Duration::ZERO);

        let c = cfg(&[
            "--delay",
            "5ms",
            "--path",
            "rate=1mbit",
            "--path",
            "rate=2mbit,delay=9ms",
            "--path-by",
            "port",
        ])
        .unwrap();
        assert_eq!(c.paths.len(), 2);
        assert_eq!(c.paths[0].up.delay, Duration::from_millis(5));
        assert_eq!(c.paths[1].up.delay, Duration::from_millis(9));
        assert_eq!(c.path_by, PathBy::Port);

        let c = cfg(&["--profile", "802.11b", "--per", "10%"]).unwrap();
        assert_eq!(c.paths[0].wifi.as_ref().unwrap().per, 0.1);
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(cfg(&["--rate", "fast"]).is_err());
        assert!(cfg(&["--per", "5%"]).is_err());
        assert!(cfg(&["--profile", "802.11z"]).is_err());
        assert!(cfg(&["--profile", "802.11b", "--rate", "1mbit"]).is_err());
        assert!(cfg(&["--path-by", "moon"]).is_err());
        assert!(cfg(&["--loss-ge", "1,2,3,4,5"]).is_err());
    }

    #[test]
    fn host_options_parse() {
        let v = [
            "mcsi",
            "run",
            "--host",
            "iperf3 -s -B $MCSI_LINK_PEER",
            "--host",
            "true",
            "--host-wait",
            "5201",
            "--host-wait",
            "3260",
            "--",
            "true",
        ];
        let Command::Run(a) = Cli::try_parse_from(v).unwrap().c else {
            panic!("not a run command");
        };
        assert_eq!(a.host, ["iperf3 -s -B $MCSI_LINK_PEER", "true"]);
        assert_eq!(a.host_wait, [5201, 3260]);
        assert_eq!(a.host_wait_timeout, "10s");
        for bad in ["0", "65536", "http"] {
            let v = ["mcsi", "run", "--host-wait", bad, "--", "true"];
            assert!(Cli::try_parse_from(v).is_err(), "--host-wait {bad}");
        }
    }
}
