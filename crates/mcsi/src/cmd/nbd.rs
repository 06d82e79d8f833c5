//! `mcsi nbd URL... (--listen ADDR:PORT | --socket PATH)`: each LUN, reached over an mcsi
//! session of as many connections as asked, exported over NBD, so that the Linux kernel's nbd
//! client, QEMU, libnbd's tools or fio can use it.

use anyhow::{bail, Context};
use bytes::Bytes;
use mcsi_initiator::{connect, Capabilities, Device, Error, IscsiUrl, SenseKey, Session, Volume};
use mcsi_nbd::proto::errno;
use mcsi_nbd::{Export, ExportInfo, ExportStats, Listener, NbdError, Server, ServerOptions};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{error, info, warn};

#[derive(clap::Args)]
pub struct Args {
    /// The LUNs to export, iscsi://[user[%password]@]host[:port]/target-iqn/lun, or volumes,
    /// volume:SPEC.toml (see mcsi copy); each gets its own sessions. A client asking for the
    /// default export (an empty name) gets the first.
    #[arg(required = true)]
    pub urls: Vec<String>,
    #[command(flatten)]
    pub session: crate::cmd::SessionArgs,
    /// TCP address to serve NBD on (default 127.0.0.1:10809 when --socket is not given). NBD
    /// has no authentication: give an address others can reach only on purpose.
    #[arg(long, value_name = "ADDR:PORT", conflicts_with = "socket")]
    pub listen: Option<String>,
    /// Unix socket to serve NBD on instead of TCP (a stale socket file is replaced).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<std::path::PathBuf>,
    /// Export name, with a single URL (default: the URL's path, target-iqn/lun).
    #[arg(long)]
    pub name: Option<String>,
    /// Refuse writes, trims and zeroing.
    #[arg(long)]
    pub read_only: bool,
    /// NBD requests in flight per NBD connection (they go onto the session's window).
    #[arg(long, default_value_t = 128)]
    pub max_requests: usize,
    /// Largest READ or WRITE an NBD client may send (smaller if the LUN's Block Limits say so).
    #[arg(long, default_value = "32MiB", value_name = "SIZE")]
    pub max_payload: String,
    /// NBD connections at once; more are closed as they arrive.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_connections: u32,
    /// A connection whose client takes no reply data for this long is closed ("0": never).
    #[arg(long, default_value = "30s", value_name = "DURATION")]
    pub write_timeout: String,
    /// A connection that sends no request for this long is closed (default "0": never; the
    /// kernel's nbd client keeps its connection however idle the device is).
    #[arg(long, default_value = "0", value_name = "DURATION")]
    pub idle_timeout: String,
    /// Threads that run the server and the sessions (1: everything on one thread, which leaves
    /// the other cores to the client and, on a shared machine, the target).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Serve Prometheus metrics and a JSON state at ADDR:PORT (/metrics, /state): the (first)
    /// session's connections, for `mcsi monitor`, and each export's NBD counters.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics: Option<String>,
}

/// One LUN, or a volume of several, as an NBD export.
struct LunExport {
    lun: Device,
    info: ExportInfo,
    caps: Capabilities,
    url: String,
    /// Whether a lost session was reported (once).
    lost: AtomicBool,
}

impl LunExport {
    fn blocks(&self, offset: u64, len: u64) -> (u64, u64) {
        let bs = u64::from(self.info.block_size);
        (offset / bs, len / bs)
    }

    /// Most blocks one READ or WRITE command carries: the LUN's MAXIMUM TRANSFER LENGTH, else
    /// the advertised maximum payload.
    fn transfer_blocks(&self) -> u64 {
        let payload = u64::from(self.info.max_payload / self.info.block_size);
        self.caps
            .max_transfer_blocks
            .map_or(payload, u64::from)
            .max(1)
    }

    /// An initiator error as an NBD errno, with its text.
    fn error(&self, what: &str, e: Error) -> NbdError {
        let code = match &e {
            Error::Scsi(s) => match &s.sense {
                Some(sense) => match sense.key {
                    SenseKey::DataProtect if sense.asc == 0x27 && sense.ascq == 0x07 => {
                        errno::ENOSPC
                    }
                    SenseKey::DataProtect => errno::EPERM,
                    SenseKey::IllegalRequest if sense.asc == 0x21 => errno::EINVAL,
                    SenseKey::IllegalRequest => errno::ENOTSUP,
                    SenseKey::VolumeOverflow => errno::ENOSPC,
                    _ => errno::EIO,
                },
                None => errno::EIO,
            },
            Error::InvalidArgument(_) => errno::EINVAL,
            Error::Closed | Error::SessionLost { .. } => {
                if !self.lost.swap(true, Relaxed) {
                    error!(
                        "{}: the iSCSI session is gone ({e}); every request now fails with ESHUTDOWN",
                        self.url
                    );
                }
                errno::ESHUTDOWN
            }
            _ => errno::EIO,
        };
        NbdError::new(code, format!("{what}: {e}"))
    }
}

impl Export for LunExport {
    fn info(&self) -> &ExportInfo {
        &self.info
    }

    async fn read(&self, offset: u64, len: u32) -> Result<Bytes, NbdError> {
        let (lba, n) = self.blocks(offset, u64::from(len));
        let step = self.transfer_blocks();
        if n <= step {
            return self
                .lun
                .read(lba, n as u32)
                .await
                .map_err(|e| self.error("READ", e));
        }
        // Longer than the LUN takes in one command (a request the server widened to whole
        // blocks): in pieces.
        let mut out = bytes::BytesMut::with_capacity(len as usize);
        let (mut at, end) = (lba, lba + n);
        while at < end {
            let k = (end - at).min(step);
            let part = self
                .lun
                .read(at, k as u32)
                .await
                .map_err(|e| self.error("READ", e))?;
            out.extend_from_slice(&part);
            at += k;
        }
        Ok(out.freeze())
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), NbdError> {
        let (lba, n) = self.blocks(offset, data.len() as u64);
        let step = self.transfer_blocks();
        let bs = u64::from(self.info.block_size);
        // FUA as the SCSI FUA bit where the LUN honours it, else as a cache flush after.
        let mut at = 0;
        while at < n {
            let k = (n - at).min(step);
            let part = data.slice((at * bs) as usize..((at + k) * bs) as usize);
            self.lun
                .write_fua(lba + at, part, fua && self.caps.fua)
                .await
                .map_err(|e| self.error("WRITE", e))?;
            at += k;
        }
        if fua && !self.caps.fua {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&self) -> Result<(), NbdError> {
        self.lun.flush().await.map_err(|e| self.error("FLUSH", e))
    }

    async fn trim(&self, offset: u64, len: u32) -> Result<(), NbdError> {
        let (lba, n) = self.blocks(offset, u64::from(len));
        let step = u64::from(self.caps.max_unmap_blocks.unwrap_or(u32::MAX));
        let (mut at, mut left) = (lba, n);
        while left > 0 {
            let k = left.min(step);
            self.lun
                .unmap(at, k)
                .await
                .map_err(|e| self.error("TRIM (UNMAP)", e))?;
            at += k;
            left -= k;
        }
        Ok(())
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        may_trim: bool,
        fua: bool,
    ) -> Result<(), NbdError> {
        let (lba, n) = self.blocks(offset, u64::from(len));
        let step = self.caps.max_write_same_blocks.unwrap_or(0xFFFF);
        self.lun
            .write_zeroes(lba, n, may_trim && self.caps.write_same_unmap, step)
            .await
            .map_err(|e| self.error("WRITE_ZEROES (WRITE SAME)", e))?;
        if fua {
            self.flush().await?;
        }
        Ok(())
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    crate::cmd::runtime(args.threads)?.block_on(serve(args))
}

/// The LUN or volume `url` names, a default export name, and a description.
async fn open_device(url: &str, args: &Args) -> anyhow::Result<(Device, String, String)> {
    if let Some(path) = crate::cmd::volume::spec_path(url) {
        let spec = crate::cmd::volume::load(path, &args.session, false)?;
        let v = Volume::open(&spec)
            .await
            .with_context(|| format!("opening {url}"))?;
        let name = path.file_stem().map_or_else(
            || "volume".to_string(),
            |s| s.to_string_lossy().into_owned(),
        );
        let desc = format!(
            "a {} volume of {} members",
            match v.layout() {
                mcsi_initiator::Layout::Stripe { .. } => "striped",
                mcsi_initiator::Layout::Mirror => "mirrored",
                mcsi_initiator::Layout::Paths => "multipath",
            },
            v.members().len()
        );
        return Ok((Device::Volume(v), name, desc));
    }
    let u = IscsiUrl::parse(url)?;
    let opts = args.session.options(false)?;
    let session = connect(&u, opts)
        .await
        .with_context(|| format!("connecting to {u}"))?;
    let lun = session
        .open_lun(u.lun)
        .await
        .with_context(|| format!("opening {u}"))?;
    let desc = format!("{u} over {} connection(s)", session.connection_count());
    Ok((Device::Lun(lun), format!("{}/{}", u.target, u.lun), desc))
}

async fn open(
    url: &str,
    name: Option<&str>,
    args: &Args,
    max_payload: u64,
) -> anyhow::Result<(Vec<Session>, Arc<LunExport>)> {
    let (lun, default_name, description) = open_device(url, args).await?;
    let u = url;
    let session = lun.sessions()[0].clone();
    let caps = lun
        .capabilities()
        .await
        .with_context(|| format!("reading what {u} offers (VPD pages, MODE SENSE)"))?;
    let cap = lun.geometry();
    let bs = cap.block_size;
    if !bs.is_power_of_two() {
        bail!("{u}: block size {bs} is not a power of two, which NBD needs");
    }
    let bs64 = u64::from(bs);
    let mut max = max_payload.min(u64::from(u32::MAX) / bs64 * bs64);
    if let Some(m) = caps.max_transfer_blocks {
        max = max.min(u64::from(m) * bs64);
    }
    let max = (max / bs64 * bs64).max(bs64) as u32;
    let preferred = caps
        .optimal_transfer_blocks
        .map(|b| u64::from(b) * bs64)
        .unwrap_or(128 << 10)
        .clamp(bs64, u64::from(max)) as u32;
    let preferred = preferred / bs * bs;
    let read_only = args.read_only || caps.write_protected;
    let info = ExportInfo {
        name: name.map_or(default_name, str::to_string),
        description,
        size: cap.bytes(),
        block_size: bs,
        preferred,
        max_payload: max,
        read_only,
        flush: true,
        fua: true,
        trim: caps.unmap,
        write_zeroes: true,
        // Every NBD connection goes through this one session, and SYNCHRONIZE CACHE covers the
        // whole LUN: a flush on any of them makes the writes of all of them durable.
        multi_conn: true,
    };
    info!(
        export = %info.name,
        size = info.size,
        block_size = bs,
        max_payload = max,
        connections = session.connection_count(),
        policy = %session.stats().policy,
        trim = info.trim,
        fua_bit = caps.fua,
        read_only,
        "exporting {u}"
    );
    let sessions = lun.sessions();
    let export = Arc::new(LunExport {
        lun,
        info,
        caps,
        url: u.to_string(),
        lost: AtomicBool::new(false),
    });
    Ok((sessions, export))
}

async fn bind(args: &Args) -> anyhow::Result<(Listener, String)> {
    if let Some(path) = &args.socket {
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            // Only a socket is replaced: a regular file, a directory or a link there is the
            // user's, and stays.
            if !meta.file_type().is_socket() {
                bail!(
                    "--socket {}: exists and is not a socket; remove it or choose another path",
                    path.display()
                );
            }
            // A socket nobody answers on is left over from an earlier run: replace it.
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                bail!(
                    "--socket {}: a server is already listening there",
                    path.display()
                );
            }
            std::fs::remove_file(path)
                .with_context(|| format!("--socket {}: removing the stale file", path.display()))?;
        }
        let l = tokio::net::UnixListener::bind(path)
            .with_context(|| format!("--socket {}: cannot listen", path.display()))?;
        return Ok((Listener::Unix(l), format!("unix socket {}", path.display())));
    }
    let addr = args.listen.as_deref().unwrap_or("127.0.0.1:10809");
    let sa: std::net::SocketAddr = addr
        .parse()
        .with_context(|| format!("--listen {addr}: expected IP:PORT, e.g. 127.0.0.1:10809"))?;
    let l = tokio::net::TcpListener::bind(sa)
        .await
        .with_context(|| format!("--listen {addr}: cannot listen"))?;
    let at = l.local_addr()?;
    if !at.ip().is_loopback() {
        warn!("NBD on {at}: NBD has no authentication; anyone who reaches this address can read and write the LUN");
    }
    Ok((Listener::Tcp(l), format!("nbd://{at}")))
}

async fn serve(args: Args) -> anyhow::Result<ExitCode> {
    if args.name.is_some() && args.urls.len() > 1 {
        bail!(
            "--name names the export of a single URL; {} were given",
            args.urls.len()
        );
    }
    if args.max_requests == 0 || args.max_requests > 4096 {
        bail!(
            "--max-requests must be between 1 and 4096, got {}",
            args.max_requests
        );
    }
    let max_payload = mcsi_units::parse_size(&args.max_payload)
        .map_err(|e| anyhow::anyhow!("--max-payload: {e}"))?;
    if !(4096..=(256 << 20)).contains(&max_payload) {
        bail!(
            "--max-payload must be between 4KiB and 256MiB, got {}",
            args.max_payload
        );
    }
    let mut sessions = Vec::new();
    let mut exports = Vec::new();
    for url in &args.urls {
        let (s, e) = open(url, args.name.as_deref(), &args, max_payload).await?;
        sessions.push(s);
        exports.push(e);
    }
    let names: Vec<String> = exports.iter().map(|e| e.info.name.clone()).collect();
    let duration = |v: &str, flag: &str| {
        mcsi_units::parse_duration(v, mcsi_units::BareUnit::Seconds)
            .map_err(|e| anyhow::anyhow!("{flag}: {e} (e.g. 30s, 5m, 0 for never)"))
    };
    // Room for the largest request in flight, and a few more, per connection; four
    // connections' worth over all of them.
    let max_buffered = (64usize << 20).max(4 * max_payload as usize);
    let opts = ServerOptions {
        max_requests: args.max_requests,
        max_buffered,
        max_buffered_total: 4 * max_buffered,
        max_connections: args.max_connections as usize,
        write_timeout: duration(&args.write_timeout, "--write-timeout")?,
        idle_timeout: duration(&args.idle_timeout, "--idle-timeout")?,
        ..ServerOptions::default()
    };
    let server = Arc::new(Server::new(exports.clone(), opts)?);
    let stats: Vec<Arc<ExportStats>> = (0..exports.len()).filter_map(|i| server.stats(i)).collect();
    if let Some(addr) = &args.metrics {
        let observer = NbdObserver {
            session: crate::cmd::observe::SessionObserver {
                session: sessions[0][0].clone(),
                initiator: args
                    .session
                    .initiator_name
                    .clone()
                    .unwrap_or_else(mcsi_initiator::session::default_initiator_name),
            },
            exports: names.iter().cloned().zip(stats.iter().cloned()).collect(),
            volumes: exports
                .iter()
                .filter_map(|e| match &e.lun {
                    Device::Volume(v) => Some((e.info.name.clone(), v.clone())),
                    Device::Lun(_) => None,
                })
                .collect(),
        };
        let at = crate::cmd::http::serve(addr, Arc::new(observer)).await?;
        println!("metrics on http://{at}/metrics, connections on http://{at}/state");
    }
    let (listener, at) = bind(&args).await?;
    println!("serving {} on {at}", names.join(", "));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let progress = tokio::spawn(report_progress(names.clone(), stats));
    let run = tokio::spawn(Arc::clone(&server).run(listener, stop_rx));
    crate::cmd::target::wait_for_signal().await?;
    info!("stopping: no new NBD requests; answering those in flight");
    let _ = stop_tx.send(true);
    run.await.context("the NBD server task failed")??;
    progress.abort();
    let mut failed = false;
    let mut not_logged_out = 0;
    for e in exports.iter() {
        if !e.info.read_only {
            if let Err(err) = e.lun.flush().await {
                error!("{}: flushing at stop failed: {err}", e.url);
                failed = true;
            }
        }
        for (url, err) in e.lun.logout().await {
            warn!("{}: logout of {url} failed: {err}", e.url);
            not_logged_out += 1;
        }
    }
    if let Some(p) = &args.socket {
        let _ = std::fs::remove_file(p);
    }
    match (failed, not_logged_out) {
        (false, 0) => info!("flushed and logged out"),
        (false, n) => info!("flushed; {n} session(s) could not log out (above)"),
        (true, _) => error!(
            "stopped with a failed flush (above): writes not yet on stable storage may be lost"
        ),
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Every 10 s with activity: clients, requests and rates per export.
async fn report_progress(names: Vec<String>, stats: Vec<Arc<ExportStats>>) {
    const EVERY: Duration = Duration::from_secs(10);
    let snap = |s: &ExportStats| {
        [
            s.reads.load(Relaxed),
            s.read_bytes.load(Relaxed),
            s.writes.load(Relaxed),
            s.write_bytes.load(Relaxed),
            s.errors.load(Relaxed),
            s.flushes.load(Relaxed) + s.trims.load(Relaxed) + s.zeroes.load(Relaxed),
        ]
    };
    let mut last: Vec<[u64; 6]> = stats.iter().map(|s| snap(s)).collect();
    let mut t = Instant::now();
    loop {
        tokio::time::sleep(EVERY).await;
        let dt = t.elapsed().as_secs_f64();
        t = Instant::now();
        for (i, s) in stats.iter().enumerate() {
            let now = snap(s);
            let d: Vec<u64> = now.iter().zip(&last[i]).map(|(a, b)| a - b).collect();
            last[i] = now;
            if d.iter().all(|&x| x == 0) {
                continue;
            }
            info!(
                "{}: {} client(s); {} reads {:.1} MB/s, {} writes {:.1} MB/s, {} other, {} errors in {:.0} s",
                names[i],
                s.connections.load(Relaxed),
                d[0],
                d[1] as f64 / dt / 1e6,
                d[2],
                d[3] as f64 / dt / 1e6,
                d[5],
                d[4],
                dt
            );
        }
    }
}

/// The `--metrics` endpoint of `mcsi nbd`: the (first) session's connections, as for
/// `mcsi bench`, each export's NBD counters, and each volume's members (failed or live, and
/// what a failed mirror member missed).
struct NbdObserver {
    session: crate::cmd::observe::SessionObserver,
    exports: Vec<(String, Arc<ExportStats>)>,
    volumes: Vec<(String, mcsi_initiator::Volume)>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct MemberLabels {
    export: String,
    member: String,
    url: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct ExportLabels {
    export: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct RequestLabels {
    export: String,
    request: String,
}

impl crate::cmd::http::Source for NbdObserver {
    fn state(&self) -> serde_json::Value {
        let mut v = self.session.state();
        let exports: Vec<serde_json::Value> = self
            .exports
            .iter()
            .map(|(name, s)| {
                serde_json::json!({
                    "export": name,
                    "clients": s.connections.load(Relaxed),
                    "clients_total": s.connections_total.load(Relaxed),
                    "reads": s.reads.load(Relaxed),
                    "read_bytes": s.read_bytes.load(Relaxed),
                    "writes": s.writes.load(Relaxed),
                    "write_bytes": s.write_bytes.load(Relaxed),
                    "flushes": s.flushes.load(Relaxed),
                    "trims": s.trims.load(Relaxed),
                    "zeroes": s.zeroes.load(Relaxed),
                    "errors": s.errors.load(Relaxed),
                    "unaligned": s.unaligned.load(Relaxed),
                })
            })
            .collect();
        v["nbd"] = serde_json::Value::Array(exports);
        let volumes: Vec<serde_json::Value> = self
            .volumes
            .iter()
            .map(|(name, vol)| {
                let members: Vec<serde_json::Value> = vol
                    .member_states()
                    .into_iter()
                    .map(|m| {
                        serde_json::json!({
                            "url": m.url,
                            "failed": m.failed,
                            "dirty_bytes": m.dirty_bytes,
                        })
                    })
                    .collect();
                serde_json::json!({"export": name, "members": members})
            })
            .collect();
        v["volumes"] = serde_json::Value::Array(volumes);
        v
    }

    fn metrics(&self) -> String {
        use prometheus_client::metrics::counter::Counter;
        use prometheus_client::metrics::family::Family;
        use prometheus_client::metrics::gauge::Gauge;
        use prometheus_client::registry::{Registry, Unit};
        let mut r = Registry::with_prefix("mcsi_initiator");
        self.session.fill(&mut r);
        let sub = r.sub_registry_with_prefix("nbd");
        let clients = Family::<ExportLabels, Gauge>::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let bytes = Family::<RequestLabels, Counter>::default();
        let errors = Family::<ExportLabels, Counter>::default();
        sub.register(
            "clients",
            "NBD connections to the export now",
            clients.clone(),
        );
        sub.register(
            "requests",
            "NBD requests by type (read, write, flush, trim, zero)",
            requests.clone(),
        );
        sub.register_with_unit(
            "request",
            "Payload bytes of NBD reads and writes",
            Unit::Bytes,
            bytes.clone(),
        );
        sub.register(
            "errors",
            "NBD requests answered with an error",
            errors.clone(),
        );
        for (name, s) in &self.exports {
            let e = ExportLabels {
                export: name.clone(),
            };
            let rl = |request: &str| RequestLabels {
                export: name.clone(),
                request: request.to_string(),
            };
            clients
                .get_or_create(&e)
                .set(i64::try_from(s.connections.load(Relaxed)).unwrap_or(i64::MAX));
            errors.get_or_create(&e).inc_by(s.errors.load(Relaxed));
            for (kind, n) in [
                ("read", &s.reads),
                ("write", &s.writes),
                ("flush", &s.flushes),
                ("trim", &s.trims),
                ("zero", &s.zeroes),
            ] {
                requests.get_or_create(&rl(kind)).inc_by(n.load(Relaxed));
            }
            bytes
                .get_or_create(&rl("read"))
                .inc_by(s.read_bytes.load(Relaxed));
            bytes
                .get_or_create(&rl("write"))
                .inc_by(s.write_bytes.load(Relaxed));
        }
        let vsub = r.sub_registry_with_prefix("volume");
        let failed = Family::<MemberLabels, Gauge>::default();
        let dirty = Family::<MemberLabels, Gauge>::default();
        vsub.register(
            "member_failed",
            "1 while a volume member is failed or catching up (the volume runs degraded)",
            failed.clone(),
        );
        vsub.register_with_unit(
            "member_dirty",
            "Bytes of regions a failed mirror member missed (what its resync copies)",
            Unit::Bytes,
            dirty.clone(),
        );
        for (name, vol) in &self.volumes {
            for (i, m) in vol.member_states().into_iter().enumerate() {
                let l = MemberLabels {
                    export: name.clone(),
                    member: i.to_string(),
                    url: m.url,
                };
                failed.get_or_create(&l).set(i64::from(m.failed));
                dirty
                    .get_or_create(&l)
                    .set(i64::try_from(m.dirty_bytes).unwrap_or(i64::MAX));
            }
        }
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        out
    }
}
