//! `mcsi copy SRC DST`: copy between files and iSCSI LUNs over sessions of many connections.

use crate::cmd::volume::open_device;
use anyhow::{bail, Context};
use bytes::Bytes;
use mcsi_initiator::{Device, IscsiUrl};
use std::io::IsTerminal;
use std::os::unix::fs::FileExt;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Source: a file, iscsi://[user[%password]@]host[:port]/target-iqn/lun, or
    /// volume:SPEC.toml (several LUNs as one volume, striped or mirrored).
    pub src: String,
    /// Destination: a file (created if missing, cut to the copied length), an iscsi:// URL, or
    /// volume:SPEC.toml.
    pub dst: String,
    /// Chunks in flight at once.
    #[arg(long, default_value_t = 16)]
    pub iodepth: usize,
    /// Chunk size (a multiple of the LUN block size), e.g. 256KiB, 1MiB; or `auto` when the
    /// source is an mcsi target's LUN: reads sized to the target's TCP state (see --bs-rule).
    #[arg(long, default_value = "1MiB")]
    pub bs: String,
    #[command(flatten)]
    pub auto: crate::cmd::BsAutoArgs,
    /// Bytes to copy (default: the whole source).
    #[arg(long)]
    pub length: Option<String>,
    #[command(flatten)]
    pub session: crate::cmd::SessionArgs,
    /// No progress bar even on a terminal.
    #[arg(long)]
    pub no_progress: bool,
}

/// One side of the copy.
#[derive(Clone)]
enum End {
    File(Arc<std::fs::File>),
    Dev(Device),
}

impl End {
    /// Block size and name of a block end (a file has none).
    fn blocks(&self) -> Option<(u64, String)> {
        match self {
            End::File(_) => None,
            End::Dev(d) => Some((u64::from(d.block_size()), d.describe())),
        }
    }

    async fn flush(&self) -> anyhow::Result<()> {
        match self {
            End::Dev(d) => d
                .flush()
                .await
                .with_context(|| format!("flushing {}", d.describe())),
            End::File(f) => match f.sync_data() {
                // A special file that cannot be synchronised (/dev/null, a pipe): nothing to
                // make durable (fdatasync(2): EINVAL).
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
                Err(e) => Err(anyhow::Error::new(e).context("syncing the destination file")),
                Ok(()) => Ok(()),
            },
        }
    }

    async fn read(&self, off: u64, len: usize) -> anyhow::Result<Bytes> {
        match self {
            End::File(f) => {
                let f = Arc::clone(f);
                tokio::task::spawn_blocking(move || -> anyhow::Result<Bytes> {
                    let mut buf = vec![0u8; len];
                    f.read_exact_at(&mut buf, off)
                        .with_context(|| format!("reading {len} bytes at offset {off}"))?;
                    Ok(Bytes::from(buf))
                })
                .await?
            }
            End::Dev(d) => {
                let bs = u64::from(d.block_size());
                Ok(d.read(off / bs, (len as u64 / bs) as u32)
                    .await
                    .with_context(|| {
                        format!("reading {len} bytes at offset {off} of {}", d.describe())
                    })?)
            }
        }
    }

    async fn write(&self, off: u64, data: Bytes) -> anyhow::Result<()> {
        match self {
            End::File(f) => {
                let f = Arc::clone(f);
                tokio::task::spawn_blocking(move || {
                    f.write_all_at(&data, off)
                        .with_context(|| format!("writing {} bytes at offset {off}", data.len()))
                })
                .await?
            }
            End::Dev(d) => {
                let bs = u64::from(d.block_size());
                let n = data.len();
                d.write(off / bs, data).await.with_context(|| {
                    format!("writing {n} bytes at offset {off} of {}", d.describe())
                })
            }
        }
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    let (mut x, mut y) = (a.max(1), b.max(1));
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a.max(1) / x * b.max(1)
}

fn file_size(f: &std::fs::File, path: &str) -> anyhow::Result<u64> {
    let md = f.metadata().with_context(|| format!("stat {path}"))?;
    if md.is_file() {
        return Ok(md.len());
    }
    // Block devices report 0 in metadata: seek to the end instead.
    use std::io::Seek;
    let mut g = f.try_clone()?;
    Ok(g.seek(std::io::SeekFrom::End(0))?)
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(copy(args))
}

/// `--bs auto`: the rule and bounds of the chunk size.
fn auto_sizer(a: &Args) -> anyhow::Result<(mcsi_initiator::iosize::Rule, u64, u64)> {
    if !IscsiUrl::is_url(&a.src) {
        bail!(
            "--bs auto sizes reads from one iSCSI LUN: the source {} is not one (give a fixed --bs)",
            a.src
        );
    }
    a.auto.parse()
}

async fn copy(a: Args) -> anyhow::Result<ExitCode> {
    let auto = (a.bs == "auto").then(|| auto_sizer(&a)).transpose()?;
    let bs = match auto {
        Some((_, min, _)) => min,
        None => mcsi_units::parse_size(&a.bs)
            .map_err(|e| anyhow::anyhow!("--bs: {e} (or auto, to size reads from a LUN)"))?,
    };
    if bs == 0 || bs > 64 << 20 {
        bail!("--bs must be between 1 byte and 64MiB, got {}", a.bs);
    }
    if a.iodepth == 0 || a.iodepth > 1024 {
        bail!("--iodepth must be between 1 and 1024, got {}", a.iodepth);
    }
    let mut sessions = Vec::new();
    // The devices again at the end: a mirror member that came back has a new session by then.
    let mut devices = Vec::new();
    let (src, src_size) = if let Some(d) = open_device(&a.src, &a.session, auto.is_some()).await? {
        sessions.extend(d.sessions());
        devices.push(d.clone());
        let size = d.geometry().bytes();
        (End::Dev(d), size)
    } else {
        let f = std::fs::File::open(&a.src).with_context(|| format!("opening {}", a.src))?;
        let size = file_size(&f, &a.src)?;
        (End::File(Arc::new(f)), size)
    };
    let length = match &a.length {
        Some(l) => mcsi_units::parse_size(l).map_err(|e| anyhow::anyhow!("--length: {e}"))?,
        None => src_size,
    };
    if length > src_size {
        bail!("--length {length} is beyond the end of the source ({src_size} bytes)");
    }
    let dst = if let Some(d) = open_device(&a.dst, &a.session, false).await? {
        sessions.extend(d.sessions());
        devices.push(d.clone());
        let size = d.geometry().bytes();
        if length > size {
            bail!("the destination holds {size} bytes, {length} are to be copied");
        }
        End::Dev(d)
    } else {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&a.dst)
            .with_context(|| format!("opening {} for writing", a.dst))?;
        if f.metadata()?.is_file() {
            f.set_len(length)
                .with_context(|| format!("setting the length of {}", a.dst))?;
        }
        End::File(Arc::new(f))
    };
    for end in [&src, &dst] {
        if let Some((b, name)) = end.blocks() {
            if (auto.is_none() && !bs.is_multiple_of(b)) || !length.is_multiple_of(b) {
                bail!(
                    "--bs ({bs}) and the length ({length}) must be multiples of the {b}-byte block size of {name}"
                );
            }
        }
    }
    for s in &sessions {
        eprintln!(
            "{}: {} connection(s), policy {}",
            s.url(),
            s.connection_count(),
            s.stats().policy
        );
    }

    let bar = if a.no_progress || !std::io::stderr().is_terminal() {
        indicatif::ProgressBar::hidden()
    } else {
        let b = indicatif::ProgressBar::new(length);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    };
    // --bs auto: the chunk size follows the source session's reports of the target's sending
    // side, sampled every 20 ms (sizes in whole blocks of both ends).
    let mut sizer = match (auto, &src, sessions.first()) {
        (Some((rule, min, max)), End::Dev(Device::Lun(l)), Some(s)) => {
            let unit = match dst.blocks() {
                Some((d, _)) => lcm(u64::from(l.block_size()), d),
                None => u64::from(l.block_size()),
            };
            let sizer = mcsi_initiator::iosize::Sizer::new(rule, min, max, unit, a.iodepth as u64);
            Some((sizer, s.clone(), Vec::<(u64, u64)>::new()))
        }
        _ => None,
    };
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(20));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut chunk = sizer.as_ref().map_or(bs, |z| z.0.size());
    let t0 = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    let mut copied = 0u64;
    let mut first_err: Option<anyhow::Error> = None;
    let mut off = 0u64;
    while off < length || !set.is_empty() {
        while first_err.is_none() && off < length && set.len() < a.iodepth {
            let len = chunk.min(length - off) as usize;
            let (s, d) = (src.clone(), dst.clone());
            let at = off;
            set.spawn(async move {
                let data = s.read(at, len).await?;
                if data.len() != len {
                    bail!("short read at offset {at}: {} of {len} bytes", data.len());
                }
                d.write(at, data).await?;
                Ok(len as u64)
            });
            off += len as u64;
        }
        let r = tokio::select! {
            r = set.join_next() => r,
            _ = tick.tick(), if sizer.is_some() => {
                if let Some((z, s, trace)) = sizer.as_mut() {
                    let next = z.update(&s.target_tcp());
                    if next != chunk {
                        chunk = next;
                        if trace.len() < 100_000 {
                            trace.push((t0.elapsed().as_millis() as u64, chunk));
                        }
                    }
                }
                continue;
            }
        };
        let Some(r) = r else {
            break;
        };
        match r {
            Ok(Ok(n)) => {
                copied += n;
                bar.inc(n);
            }
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(anyhow::anyhow!("copy task failed: {e}"));
            }
        }
        if first_err.is_some() && off < length {
            off = length; // stop issuing; let in-flight chunks finish
        }
    }
    bar.finish_and_clear();
    if first_err.is_none() {
        if let Err(e) = dst.flush().await {
            first_err = Some(e);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    if let Some((z, s, trace)) = &sizer {
        if !s.target_tcp().iter().any(Option::is_some) {
            eprintln!("mcsi copy: the target sent no TCP state reports (not an mcsi target?): --bs auto stayed at --bs-min");
        }
        let sizes = trace.iter().map(|t| t.1);
        eprintln!(
            "bs auto ({}): {} size changes, between {} and {}, last {}",
            z.rule().as_str(),
            trace.len(),
            mcsi_units::Bytes(sizes.clone().min().unwrap_or(chunk) as f64),
            mcsi_units::Bytes(sizes.max().unwrap_or(chunk) as f64),
            mcsi_units::Bytes(chunk as f64),
        );
    }
    for d in &devices {
        for (url, e) in d.logout().await {
            tracing::warn!(error = %e, "logout of {url} failed");
        }
    }
    if let Some(e) = first_err {
        return Err(e.context(format!("copy stopped after {copied} of {length} bytes")));
    }
    if copied != length {
        bail!("short copy: {copied} of {length} bytes");
    }
    eprintln!(
        "copied {copied} bytes in {secs:.3} s ({}/s)",
        mcsi_units::Bytes(copied as f64 / secs.max(1e-9))
    );
    Ok(ExitCode::SUCCESS)
}
