//! `mcsi target`: serve SCSI block devices over iSCSI.

use anyhow::Context;
use mcsi_target::config::{self, Limits, ServerConfig, TargetSpec};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Portal to listen on (IP:PORT, repeatable). Default 127.0.0.1:3260.
    #[arg(long = "listen", value_name = "ADDR:PORT")]
    listen: Vec<String>,
    /// Target name (iqn./eui./naa. form). Default iqn.2026-01.org.mcsi:target.
    #[arg(long, value_name = "IQN")]
    iqn: Option<String>,
    /// A LUN, numbered from 0 in the order given: ram:SIZE, file:PATH[:SIZE] or block:PATH,
    /// optionally followed by ,block_size=N ,read_only ,serial=S. Default ram:1GiB.
    #[arg(long = "lun", value_name = "SPEC")]
    lun: Vec<String>,
    /// TOML file describing targets, portals, LUNs and negotiation limits.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["iqn", "lun"])]
    config: Option<PathBuf>,
    /// MaxConnections offered per session (1 to 65535).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    max_connections: Option<u16>,
}

fn build_config(args: &Args) -> anyhow::Result<ServerConfig> {
    let listen_override = config::parse_portals("--listen", &args.listen)?;
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
                luns,
                limits: Limits::default(),
            }],
        }
    };
    for t in cfg.targets.iter_mut() {
        if !listen_override.is_empty() {
            t.portals = listen_override.clone();
        }
        if let Some(n) = args.max_connections {
            t.limits.max_connections = n;
        }
    }
    Ok(cfg)
}

fn print_ready(server: &mcsi_target::Server) {
    let addrs: Vec<String> = server.local_addrs().iter().map(|a| a.to_string()).collect();
    println!("mcsi target listening on {}", addrs.join(" "));
    for t in server.targets() {
        let Some(p) = t.portals.first() else { continue };
        let luns: Vec<u16> = t.dev.luns().map(|(i, _)| i).collect();
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
    rt.block_on(async move {
        let server = mcsi_target::Server::start(&cfg).await?;
        print_ready(&server);
        wait_for_signal().await?;
        tracing::info!("shutting down");
        server
            .shutdown()
            .await
            .context("flushing the LUNs at shutdown")?;
        Ok(ExitCode::SUCCESS)
    })
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    Ok(())
}
