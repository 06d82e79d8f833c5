//! `mcsi`: iSCSI target, initiator tools, link emulator and models for difficult networks.

use clap::{Parser, Subcommand};
use std::io::IsTerminal;
use std::process::ExitCode;

mod cmd;

#[derive(Parser)]
#[command(name = "mcsi", version, about, propagate_version = true)]
struct Cli {
    /// Log filter (tracing's RUST_LOG syntax), e.g. "info" or "mcsi_target=debug".
    #[arg(long, global = true, env = "MCSI_LOG", default_value = "info")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start-up, so the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Serve SCSI block devices over iSCSI.
    Target(cmd::target::Args),
    /// Closed-form models: 802.11 MAC, TCP throughput, queues, QoS bandwidth.
    #[command(subcommand)]
    Model(cmd::model::Command),
    /// Run a command behind an emulated link (rate, delay, loss, 802.11 airtime, several paths).
    #[command(subcommand)]
    Link(cmd::link::Command),
    /// Copy between files and iSCSI LUNs (iscsi://host[:port]/iqn/lun), over many connections.
    Copy(cmd::copy::Args),
    /// fio-like load generator against an iSCSI LUN.
    Bench(cmd::bench::Args),
    /// The research's experiments, rerun on emulated links: CSV, plots, reports with verdicts.
    #[command(subcommand)]
    Lab(cmd::lab::Command),
    /// Export iSCSI LUNs over NBD (sessions of many connections for the kernel, QEMU, fio...).
    Nbd(cmd::nbd::Args),
    /// The protocol cores on virtual time: initiators, a target, a Linux-like TCP (or
    /// smoltcp's) and the link emulator's models, deterministic and faster than real time.
    Sim(cmd::sim::Args),
    /// Administer a running target through its control socket: targets, LUNs, sessions.
    Ctl(cmd::ctl::Args),
    /// Man pages and shell completions, for packages and installs by hand.
    #[command(subcommand)]
    Generate(cmd::generate::Command),
    /// Each connection's TCP state, live, from a running target's or bench's --metrics address.
    Monitor(cmd::monitor::Args),
}

/// Keeps glibc's allocator from handing the buffers of the data path back to the kernel and
/// mapping them again. Reads and Data-In arrive in buffers of 128 KiB and more, above glibc's
/// mmap threshold or at the top of the heap; by default each free unmaps or trims them, and the
/// next I/O pays page faults and page clearing for a fresh buffer. A profile of 128 KiB reads in
/// `mcsi bench` showed page-fault handling at about 40% of its CPU time. With these settings
/// freed buffers stay in the process for reuse (trimmed only past 64 MiB of free space).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_allocator() {
    // SAFETY: mallopt only changes allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

fn main() -> ExitCode {
    tune_allocator();
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let result = match cli.command {
        Command::Target(args) => cmd::target::run(args),
        Command::Model(c) => cmd::model::run(c),
        Command::Link(c) => cmd::link::run(c),
        Command::Copy(args) => cmd::copy::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Lab(c) => cmd::lab::run(c),
        Command::Monitor(args) => cmd::monitor::run(args),
        Command::Ctl(args) => cmd::ctl::run(args),
        Command::Generate(c) => cmd::generate::run(c, <Cli as clap::CommandFactory>::command()),
        Command::Nbd(args) => cmd::nbd::run(args),
        Command::Sim(args) => cmd::sim::run(args),
    };
    // 2 is a usage error (clap's, above); an error while running is 1.
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("mcsi: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
