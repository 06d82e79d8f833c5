//! `mcsi target`: serve SCSI block devices over iSCSI.

use anyhow::Context;
use mcsi_target::config::{self, Limits, ServerConfig, TargetSpec};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct Args {
    /// Portal to listen on (IP:PORT, repeatable). Default 127.0.0.1:3260.
    #[arg(long = "listen", value_name = "ADDR:PORT")]
    listen: Vec<String>,
    /// The address SendTargets gives for every target in place of its portals (HOST:PORT,
    /// repeatable; as `advertise` in the file): behind NAT, the public address initiators reach.
    #[arg(long, value_name = "HOST:PORT")]
    advertise: Vec<String>,
    /// Target name (iqn./eui./naa. form). Default iqn.2026-01.org.mcsi:target.
    #[arg(long, value_name = "IQN")]
    iqn: Option<String>,
    /// A LUN, numbered from 0 in the order given: ram:SIZE, file:PATH[:SIZE] or block:PATH,
    /// optionally followed by ,block_size=N ,physical_block_size=N ,read_only ,serial=S. Default
    /// ram:1GiB.
    #[arg(long = "lun", value_name = "SPEC")]
    lun: Vec<String>,
    /// TOML file describing targets, portals, LUNs and negotiation limits.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["iqn", "lun"])]
    config: Option<PathBuf>,
    /// MaxConnections offered per session (1 to 65535).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    max_connections: Option<u16>,
    /// Ping a connection idle this long with a NOP-In (e.g. 30s, 500ms; 0 turns pings off).
    #[arg(long, value_name = "DURATION")]
    nop_interval: Option<String>,
    /// TCP congestion control of every target's connections (for example cubic, reno, bbr;
    /// default: the system's). An algorithm the kernel does not offer is an error that lists
    /// the ones it does.
    #[arg(long, value_name = "NAME")]
    congestion: Option<String>,
    /// In the asymmetric mode, how each task's response connection is chosen: round-robin
    /// (the thesis's, default), least-outstanding, tcp-aware (earliest expected completion from
    /// what the connection still owes, its delivery rate and RTT), weighted:W1,W2,... (per
    /// response connection in CID order) or failover.
    #[arg(long, value_name = "POLICY")]
    response_policy: Option<String>,
    /// Serve Prometheus metrics (GET /metrics) and the sessions' connections with their TCP
    /// state (GET /state, for `mcsi monitor`) on this address, e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<String>,
    /// Serve live administration (`mcsi ctl`) on this Unix socket, created owner-only (as
    /// `control = "PATH"` in the file), e.g. /run/mcsi/control.sock.
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Keep persistent reservations made with APTPL in this directory, so that they survive a
    /// restart (as `state_dir = "PATH"` in the file), e.g. /var/lib/mcsi. Without it, APTPL is
    /// refused.
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Drop a connection that does not answer a NOP-In ping within this time (e.g. 15s).
    #[arg(long, value_name = "DURATION")]
    nop_timeout: Option<String>,
    /// Bytes a connection may have queued for sending before the target stops reading its
    /// requests (e.g. 8MiB, the default; 64KiB at least).
    #[arg(long, value_name = "SIZE")]
    output_budget: Option<String>,
    /// Drop a connection whose socket takes no byte for this long (e.g. 30s, the default; 0
    /// turns the check off).
    #[arg(long, value_name = "DURATION")]
    send_timeout: Option<String>,
    /// Bytes of READ data one session's commands may hold at once (e.g. 64MiB, the default).
    #[arg(long, value_name = "SIZE")]
    read_budget: Option<String>,
    /// Bytes of solicited WRITE data one session's commands may hold at once (e.g. 64MiB, the
    /// default); further writes wait for room before their first R2T.
    #[arg(long, value_name = "SIZE")]
    write_budget: Option<String>,
    /// Threads that run sessions, each session with all of its connections on one thread
    /// (default: one per CPU; 0 runs sessions on the runtime that accepts connections).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(0..=1024))]
    session_threads: Option<u16>,
    /// Listen with Multipath TCP on every portal (as `mptcp = true` in the file): an MPTCP
    /// initiator's subflows join its connections, and plain TCP initiators still connect.
    /// Needs Linux 5.6 or later with net.mptcp.enabled = 1.
    #[arg(long)]
    mptcp: bool,
    /// Require CHAP with this user and secret (repeatable; for every target and for discovery).
    /// The secret can also come from the environment: USER:env:VARIABLE.
    #[arg(long, value_name = "USER:SECRET")]
    chap: Vec<String>,
    /// Only this initiator name may log in (repeatable; for every target and for discovery).
    #[arg(long, value_name = "IQN", conflicts_with = "allow_any")]
    allow_initiator: Vec<String>,
    /// Any initiator may log in (the default unless the config file restricts it).
    #[arg(long)]
    allow_any: bool,
    /// Honour TARGET COLD RESET (as `allow_cold_reset = true` in the file): it ends every
    /// session of the target, other initiators' too. Without it the request is answered
    /// "function authorization failed".
    #[arg(long)]
    allow_cold_reset: bool,
    /// Bandwidth of every session, per direction (seed 004; as `[targets.qos]` in the file):
    /// rates on the wire, `to_client=10MiB,to_storage=2MiB[,burst=64KiB]`, or a storage QoS
    /// requirement they are computed from at each login,
    /// `read_ratio=1,iops=82,size=1KiB,rt=10ms[,alpha=0.2]`; `,capacity=SIZE` admits a new
    /// session only if its rates fit beside the others' (else the login gets 3/02).
    #[arg(long, value_name = "SPEC")]
    qos: Option<String>,
}

/// A `--chap` value: USER:SECRET or USER:env:VARIABLE.
fn chap_arg(arg: &str) -> anyhow::Result<config::ChapUser> {
    let Some((user, secret)) = arg.split_once(':') else {
        anyhow::bail!("--chap: expected USER:SECRET or USER:env:VARIABLE (no ':' found)");
    };
    let secret = match secret.strip_prefix("env:") {
        Some(var) => std::env::var(var)
            .with_context(|| format!("--chap {user}:env:{var}: the variable is not set"))?,
        None => secret.to_string(),
    };
    let u = config::ChapUser {
        user: user.to_string(),
        secret,
        mutual_user: None,
        mutual_secret: None,
    };
    u.credentials()
        .validate()
        .map_err(|e| anyhow::anyhow!("--chap {user}:...: {e}"))?;
    // Short secrets only through a configuration file that says allow_short_secrets.
    config::check_secret_len(&format!("--chap {user}:..."), &u.secret, false)?;
    Ok(u)
}

fn build_config(args: &Args) -> anyhow::Result<ServerConfig> {
    let listen_override = config::parse_portals("--listen", &args.listen)?;
    let advertise = args
        .advertise
        .iter()
        .map(|a| config::check_address("--advertise", a))
        .collect::<Result<Vec<_>, _>>()?;
    let mut cfg = if let Some(path) = &args.config {
        ServerConfig::from_file(path)?
    } else {
        let iqn = args
            .iqn
            .clone()
            .unwrap_or_else(|| config::DEFAULT_IQN.to_string());
        mcsi_target::name::validate(&iqn).context("--iqn")?;
        let luns = if args.lun.is_empty() {
            vec![config::parse_lun_arg("--lun", config::DEFAULT_LUN)?]
        } else {
            args.lun
                .iter()
                .enumerate()
                .map(|(i, l)| config::parse_lun_arg(&format!("--lun #{} ('{l}')", i + 1), l))
                .collect::<Result<Vec<_>, _>>()?
        };
        ServerConfig {
            targets: vec![TargetSpec {
                iqn,
                alias: None,
                portals: vec![
                    config::parse_portal(config::DEFAULT_LISTEN).map_err(anyhow::Error::msg)?
                ],
                advertise: Vec::new(),
                redirect: None,
                luns,
                limits: Limits::default(),
                auth: Default::default(),
                qos_initiators: Vec::new(),
                tpgt: 1,
                alua: None,
                lun_maps: Vec::new(),
            }],
            discovery_auth: Default::default(),
            limits: Default::default(),
            session_threads: config::default_session_threads(),
            mptcp: false,
            control: None,
            state_dir: None,
            source: None,
            access_from_flags: false,
        }
    };
    if let Some(n) = args.session_threads {
        cfg.session_threads = usize::from(n);
    }
    cfg.mptcp |= args.mptcp;
    if args.control.is_some() {
        cfg.control = args.control.clone();
    }
    if args.state_dir.is_some() {
        cfg.state_dir = args.state_dir.clone();
    }
    let nop_interval = args
        .nop_interval
        .as_ref()
        .map(|v| config::duration(&Some(v.clone()), "--nop-interval", Default::default()))
        .transpose()?;
    let nop_timeout = args
        .nop_timeout
        .as_ref()
        .map(|v| config::duration(&Some(v.clone()), "--nop-timeout", Default::default()))
        .transpose()?;
    if nop_timeout.is_some_and(|d| d.is_zero()) {
        anyhow::bail!("--nop-timeout: must be above zero (use --nop-interval 0 to turn pings off)");
    }
    let size_arg = |v: &Option<String>, flag: &str, min: u64| {
        let v = v.clone().map(config::SizeValue::Text);
        config::budget(&v, flag, min, 0).map(|n| v.is_some().then_some(n))
    };
    let output_budget = size_arg(
        &args.output_budget,
        "--output-budget",
        config::OUTPUT_BUDGET_MIN,
    )?;
    let read_budget = size_arg(&args.read_budget, "--read-budget", config::READ_BUDGET_MIN)?;
    let write_budget = size_arg(
        &args.write_budget,
        "--write-budget",
        config::WRITE_BUDGET_MIN,
    )?;
    let send_timeout = args
        .send_timeout
        .as_ref()
        .map(|v| config::duration(&Some(v.clone()), "--send-timeout", Default::default()))
        .transpose()?;
    let congestion = args
        .congestion
        .as_deref()
        .map(config::congestion)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--congestion: {e}"))?;
    let response_policy = args
        .response_policy
        .as_deref()
        .map(config::ResponsePolicy::parse)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--response-policy: {e}"))?;
    let chap = args
        .chap
        .iter()
        .map(|c| chap_arg(c))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for (i, n) in args.allow_initiator.iter().enumerate() {
        mcsi_target::name::validate(n).with_context(|| format!("--allow-initiator #{}", i + 1))?;
    }
    cfg.access_from_flags = !chap.is_empty() || !args.allow_initiator.is_empty() || args.allow_any;
    let auths = cfg
        .targets
        .iter_mut()
        .map(|t| &mut t.auth)
        .chain(std::iter::once(&mut cfg.discovery_auth));
    for a in auths {
        if !chap.is_empty() {
            a.chap = chap.clone();
        }
        if !args.allow_initiator.is_empty() {
            a.allow_initiators = args.allow_initiator.clone();
        }
        if args.allow_any {
            a.allow_initiators.clear();
            a.allow_networks.clear();
        }
    }
    let qos = match &args.qos {
        Some(q) => Some(config::parse_qos_arg("--qos", q)?),
        None => None,
    };
    for t in cfg.targets.iter_mut() {
        t.limits.allow_cold_reset |= args.allow_cold_reset;
        if let Some((q, capacity)) = qos {
            t.limits.qos = Some(q);
            t.limits.qos_capacity = capacity;
        }
        if let Some(d) = nop_interval {
            t.limits.offer.nop_interval = d;
        }
        if let Some(d) = nop_timeout {
            t.limits.offer.nop_timeout = d;
        }
        if let Some(n) = output_budget {
            t.limits.output_budget = n;
        }
        if let Some(d) = send_timeout {
            t.limits.send_timeout = d;
        }
        if let Some(n) = read_budget {
            t.limits.read_budget = n;
        }
        if let Some(n) = write_budget {
            t.limits.write_budget = n;
        }
        if !listen_override.is_empty() {
            t.portals = listen_override.clone();
        }
        if !advertise.is_empty() {
            t.advertise = advertise.clone();
        }
        if let Some(n) = args.max_connections {
            t.limits.offer.max_connections = n;
        }
        if congestion.is_some() {
            t.limits.congestion = congestion;
        }
        if let Some(p) = response_policy {
            t.limits.response_policy = p;
        }
    }
    Ok(cfg)
}

fn print_ready(server: &mcsi_target::Server) {
    let addrs: Vec<String> = server.local_addrs().iter().map(|a| a.to_string()).collect();
    println!("mcsi target listening on {}", addrs.join(" "));
    for t in server.targets().iter() {
        let portals = t.portals.load();
        let Some(p) = portals.first() else { continue };
        let luns: Vec<u16> = t.dev.luns().iter().map(|(i, _)| *i).collect();
        println!();
        println!("target {} (LUNs {:?})", t.name, luns);
        for l in &luns {
            println!("  iscsi://{p}/{}/{l}", t.name);
        }
        let url = format!("iscsi://{p}/{}/0", t.name);
        println!("reach it with:");
        println!("  iscsi-inq {url}");
        println!("  iscsi-ls -s iscsi://{p}");
        println!("  qemu-img info {url}");
        println!("  qemu-img convert -p -O raw disk.img {url}");
        println!("  iscsiadm -m discovery -t sendtargets -p {p}");
        println!("  iscsiadm -m node -T {} -p {p} --login", t.name);
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let cfg = build_config(&args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("mcsi-target")
        .build()
        .context("cannot start the tokio runtime")?;
    let args = Arc::new(args);
    rt.block_on(async move {
        // The signals are watched from before the first listener: a reload or a stop that
        // comes as soon as the service is ready must not meet the default action.
        let signals = Signals::new()?;
        let server = mcsi_target::Server::start(&cfg).await?;
        if let Some(addr) = &args.metrics {
            let at = crate::cmd::http::serve(addr, Arc::new(server.observer())).await?;
            println!("metrics on http://{at}/metrics, connections on http://{at}/state");
        }
        // A reload reads the file again, with the command line's settings over it as at start.
        let reload: Option<crate::cmd::ctl::Reload> = args.config.as_ref().map(|_| {
            let args = args.clone();
            Arc::new(move || build_config(&args)) as crate::cmd::ctl::Reload
        });
        let _control = match &cfg.control {
            Some(path) => {
                let c = crate::cmd::ctl::serve(path, server.admin(), reload.clone())?;
                println!(
                    "control socket {} (mcsi ctl --socket {})",
                    path.display(),
                    path.display()
                );
                Some(c)
            }
            None => None,
        };
        print_ready(&server);
        // systemd (Type=notify): every portal listens and the control socket is up.
        notify(&[sd_notify::NotifyState::Ready]);
        serve_until_stopped(&server, reload, signals).await?;
        notify(&[sd_notify::NotifyState::Stopping]);
        tracing::info!("shutting down");
        server
            .shutdown()
            .await
            .context("flushing the LUNs at shutdown")?;
        Ok(ExitCode::SUCCESS)
    })
}

/// Tells systemd (when it started us with NOTIFY_SOCKET) where the service is.
fn notify(state: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, state) {
        tracing::warn!("cannot notify systemd: {e}");
    }
}

/// The signals a target answers: SIGTERM and SIGINT stop it, SIGHUP reloads.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("cannot watch SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("cannot watch SIGINT")?,
            hup: signal(SignalKind::hangup()).context("cannot watch SIGHUP")?,
        })
    }
}

/// Waits for SIGTERM or SIGINT; each SIGHUP meanwhile reloads the file and applies the
/// difference (or logs why it cannot, changing nothing).
async fn serve_until_stopped(
    server: &mcsi_target::Server,
    reload: Option<crate::cmd::ctl::Reload>,
    mut sig: Signals,
) -> anyhow::Result<()> {
    loop {
        tokio::select! {
            _ = sig.term.recv() => return Ok(()),
            _ = sig.int.recv() => return Ok(()),
            _ = sig.hup.recv() => match &reload {
                None => tracing::warn!("SIGHUP: nothing to reload (the target was started without --config)"),
                Some(r) => {
                    notify(&[sd_notify::NotifyState::Reloading]);
                    match crate::cmd::ctl::reload(&server.admin(), r).await {
                        Ok(c) => tracing::info!("SIGHUP: configuration reloaded: {c}"),
                        Err(e) => tracing::error!("SIGHUP: the configuration was not reloaded, nothing changed: {e:#}"),
                    }
                    notify(&[sd_notify::NotifyState::Ready]);
                }
            },
        }
    }
}

pub(crate) async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    Ok(())
}

impl crate::cmd::http::Source for mcsi_target::server::Observer {
    fn metrics(&self) -> String {
        self.metrics_text()
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({
            "side": "target",
            "time_ms": crate::cmd::http::unix_ms(),
            "sessions": self.snapshot(),
        })
    }
}
