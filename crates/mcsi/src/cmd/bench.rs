//! `mcsi bench URL`: a fio-like load generator over an iSCSI session of many connections, with
//! fio's JSON layout plus an `mcsi` section (per-connection tasks, bytes, TCP_INFO).

use anyhow::{bail, Context};
use bytes::Bytes;
use hdrhistogram::Histogram;
use mcsi_initiator::{connect, Device, IscsiUrl, Lun, Session, Volume};
use serde_json::{json, Map, Value};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rw {
    Read,
    Write,
    Randread,
    Randwrite,
    Randrw,
}

impl Rw {
    fn name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::Randread => "randread",
            Rw::Randwrite => "randwrite",
            Rw::Randrw => "randrw",
        }
    }
    fn random(self) -> bool {
        matches!(self, Rw::Randread | Rw::Randwrite | Rw::Randrw)
    }
    fn writes(self) -> bool {
        !matches!(self, Rw::Read | Rw::Randread)
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// iscsi://[user[%password]@]host[:port]/target-iqn/lun, or volume:SPEC.toml (several
    /// LUNs as one volume; see mcsi copy).
    pub url: String,
    /// I/Os in flight.
    #[arg(long, default_value_t = 1)]
    pub iodepth: usize,
    /// I/O size, a multiple of the LUN block size; or `auto` for sequential reads sized to the
    /// target's congestion window (see --bs-rule; needs an mcsi target).
    #[arg(long, default_value = "4KiB")]
    pub bs: String,
    #[command(flatten)]
    pub auto: crate::cmd::BsAutoArgs,
    #[arg(long, value_enum, default_value = "read")]
    pub rw: Rw,
    /// Percentage of reads in randrw.
    #[arg(long, default_value_t = 50)]
    pub rwmixread: u8,
    /// Run for this long (passes over the region repeat): seconds, or a duration such as 8s,
    /// 500ms, 2m.
    #[arg(long, value_parser = parse_runtime)]
    pub runtime: Option<f64>,
    /// Region of the LUN to use, from offset 0 (default: the whole LUN); without --runtime the
    /// run ends after one pass over it.
    #[arg(long)]
    pub size: Option<String>,
    /// Write blocks that carry their LBA and a checksum, and check them when read back. Workloads
    /// that write also read back every block they wrote once the run ends, each of which must
    /// hold the last version written (a lost or replayed write shows there).
    #[arg(long)]
    pub verify: bool,
    /// Fault injection: shut down one TCP connection of the session every DURATION while the
    /// run goes on (connection 0, then 1, ..., in turn), as a route that fails would, and report
    /// for each kill the longest I/O in flight across it. Needs --runtime. What the session
    /// does about it depends on --max-erl: level 2 moves the connection's tasks to the others,
    /// level 0 logs the whole session in again.
    #[arg(long, value_name = "DURATION", value_parser = parse_runtime)]
    pub kill_every: Option<f64>,
    /// Serve the session's connections and their TCP state on this address while the run goes
    /// on (GET /state for `mcsi monitor`, GET /metrics for Prometheus), e.g. 127.0.0.1:9465.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics: Option<String>,
    /// Threads that run the initiator (1: everything on one thread, like one fio job).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Issue at most this many I/Os per second, as fio's rate_iops (its linear rate process: I/O
    /// number k starts no earlier than k/N seconds into the run, and a run that fell behind
    /// catches up). Latencies count from each I/O's start, not from its slot.
    #[arg(long, value_name = "N")]
    pub rate_iops: Option<f64>,
    /// How --rate-iops spaces the I/Os, as fio's rate_process: linear (every 1/N s) or
    /// poisson (exponential gaps of mean 1/N s drawn from --seed, as independent requests
    /// arrive).
    #[arg(long, value_name = "PROCESS", default_value = "linear", value_parser = ["linear", "poisson"])]
    pub rate_process: String,
    /// Print fio-style JSON.
    #[arg(long)]
    pub json: bool,
    /// Seed of the random offsets and data.
    #[arg(long, default_value_t = 0x6d63_7369)]
    pub seed: u64,
    #[command(flatten)]
    pub session: crate::cmd::SessionArgs,
}

/// CPU time this process used (getrusage), to report the initiator's own cost per I/O.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct CpuTimes {
    user: f64,
    sys: f64,
    /// Voluntary and involuntary context switches.
    ctx: u64,
}

impl CpuTimes {
    fn now() -> CpuTimes {
        let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage writes a complete rusage into the buffer we own; on failure it
        // stays zeroed, which is a valid rusage.
        let ru = unsafe {
            libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr());
            ru.assume_init()
        };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        CpuTimes {
            user: secs(ru.ru_utime),
            sys: secs(ru.ru_stime),
            ctx: (ru.ru_nvcsw + ru.ru_nivcsw).max(0) as u64,
        }
    }

    fn since(&self, start: &CpuTimes) -> CpuTimes {
        CpuTimes {
            user: (self.user - start.user).max(0.0),
            sys: (self.sys - start.sys).max(0.0),
            ctx: self.ctx.saturating_sub(start.ctx),
        }
    }

    /// Microseconds of CPU (user + system) per I/O.
    fn us_per_io(&self, ios: u64) -> f64 {
        if ios == 0 {
            return 0.0;
        }
        (self.user + self.sys) * 1e6 / ios as f64
    }
}

const MAGIC: &[u8; 8] = b"mcsiVRFY";
const HDR: usize = 32;
/// errno values fio reports in `error`.
const EIO: i32 = 5;
const EILSEQ: i32 = 84;

/// xorshift64*: fast, seedable, good enough for offsets and fill data.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng((seed ^ 0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A verify block: magic, LBA, generation, length, CRC32C (over the block with this field
/// zero), then pseudo-random payload derived from LBA and generation.
fn make_block(lba: u64, generation: u64, len: usize) -> Bytes {
    let mut b = vec![0u8; len];
    b[0..8].copy_from_slice(MAGIC);
    b[8..16].copy_from_slice(&lba.to_le_bytes());
    b[16..24].copy_from_slice(&generation.to_le_bytes());
    b[24..28].copy_from_slice(&(len as u32).to_le_bytes());
    let mut r = Rng::new(lba.wrapping_mul(0x100_0000_01b3) ^ generation);
    for chunk in b[HDR..].chunks_mut(8) {
        let v = r.next().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    let crc = mcsi_proto::digest::crc32c(&b);
    b[28..32].copy_from_slice(&crc.to_le_bytes());
    Bytes::from(b)
}

/// Check a block read back; `expect_gen` when this run wrote it. Returns what is wrong.
fn check_block(b: &[u8], lba: u64, expect_gen: Option<u64>) -> Result<(), String> {
    if b.len() < HDR {
        return Err(format!("block at LBA {lba} is {} bytes", b.len()));
    }
    if &b[0..8] != MAGIC {
        return Err(format!(
            "block at LBA {lba} has no verify header (never written by a verify run?)"
        ));
    }
    let rd = |r: std::ops::Range<usize>| {
        let mut v = [0u8; 8];
        v[..r.len()].copy_from_slice(&b[r]);
        u64::from_le_bytes(v)
    };
    let (got_lba, got_gen, got_len, got_crc) = (rd(8..16), rd(16..24), rd(24..28), rd(28..32));
    if got_lba != lba {
        return Err(format!(
            "block at LBA {lba} carries LBA {got_lba} (misplaced write)"
        ));
    }
    if got_len != b.len() as u64 {
        return Err(format!(
            "block at LBA {lba} was written with bs {got_len}, read with {}",
            b.len()
        ));
    }
    let mut c = b.to_vec();
    c[28..32].fill(0);
    let crc = u64::from(mcsi_proto::digest::crc32c(&c));
    if crc != got_crc {
        return Err(format!(
            "block at LBA {lba}: checksum {crc:#010x} != stored {got_crc:#010x} (corrupt data)"
        ));
    }
    if let Some(g) = expect_gen {
        if g != got_gen {
            return Err(format!(
                "block at LBA {lba} holds generation {got_gen}, {g} was written last (stale data)"
            ));
        }
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    Read,
    Write,
}

/// Hands out the next I/O; shared by the workers.
struct Gen {
    rw: Rw,
    mix_read: u8,
    blocks: u64,
    order: Vec<u32>,
    pos: u64,
    pass: u64,
    issued: u64,
    /// Stop after this many I/Os (size-bound runs).
    limit: Option<u64>,
    deadline: Option<Instant>,
    rng: Rng,
    stop: bool,
    /// In verify mode: generation last written per block (0 = not this run), and busy flags.
    gens: Vec<u64>,
    busy: Vec<bool>,
    verify_phase: bool,
}

impl Gen {
    fn next(&mut self) -> Option<(Op, u64)> {
        if self.stop {
            return None;
        }
        if let Some(d) = self.deadline {
            if Instant::now() >= d {
                return None;
            }
        }
        if let Some(l) = self.limit {
            if self.issued >= l {
                return None;
            }
        }
        for _ in 0..4 {
            if self.pos == self.blocks {
                self.pos = 0;
                self.pass += 1;
                if self.rw.random() && !self.verify_phase {
                    shuffle(&mut self.order, &mut self.rng);
                }
            }
            let i = if self.order.is_empty() {
                self.pos
            } else {
                u64::from(self.order[self.pos as usize])
            };
            self.pos += 1;
            if self.busy.get(i as usize).copied().unwrap_or(false) {
                continue;
            }
            let op = if self.verify_phase {
                Op::Read
            } else {
                match self.rw {
                    Rw::Read | Rw::Randread => Op::Read,
                    Rw::Write | Rw::Randwrite => Op::Write,
                    Rw::Randrw => {
                        if self.rng.below(100) < u64::from(self.mix_read) {
                            Op::Read
                        } else {
                            Op::Write
                        }
                    }
                }
            };
            if let Some(b) = self.busy.get_mut(i as usize) {
                *b = true;
            }
            self.issued += 1;
            return Some((op, i));
        }
        None
    }
}

fn shuffle(v: &mut [u32], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

#[derive(Default)]
struct DirStats {
    hist: Option<Histogram<u64>>,
    bytes: u64,
    ios: u64,
}

impl DirStats {
    fn record(&mut self, ns: u64, bytes: u64) {
        if self.hist.is_none() {
            self.hist = Histogram::new(3).ok();
        }
        if let Some(h) = &mut self.hist {
            let _ = h.record(ns.max(1));
        }
        self.bytes += bytes;
        self.ios += 1;
    }
    fn merge(&mut self, o: &DirStats) {
        if let Some(oh) = &o.hist {
            match &mut self.hist {
                Some(h) => {
                    let _ = h.add(oh);
                }
                None => self.hist = Some(oh.clone()),
            }
        }
        self.bytes += o.bytes;
        self.ios += o.ios;
    }
}

#[derive(Default)]
struct WorkerOut {
    read: DirStats,
    write: DirStats,
    verified: u64,
    verify_errors: u64,
    first_error: Option<(i32, String)>,
    /// With --kill-every: (ms into the run, connection, longest I/O across it in ms).
    kills: Vec<(f64, usize, f64)>,
    /// With --kill-every: the longest time in the run without any I/O completing, ms.
    longest_stall_ms: Option<f64>,
}

struct Ctx {
    dev: Device,
    bs: u64,
    lbas_per_io: u64,
    verify: bool,
    gen: Mutex<Gen>,
    fill: Bytes,
    write_gen: std::sync::atomic::AtomicU64,
    /// With --kill-every: each kill so far, the longest I/O seen across it, and the longest
    /// time without any I/O completing.
    kills: Option<Mutex<KillLog>>,
    /// With --rate-iops: the schedule the workers take their starts from.
    pacer: Option<Pacer>,
}

/// `--rate-iops`: I/O number k may start at `start + k x interval` at the earliest
/// (linear), or at the k-th point of a Poisson process of that rate (poisson).
struct Pacer {
    start: Instant,
    interval: f64,
    /// Seconds from `start` of the next slot, and the draws of a Poisson process (None: linear).
    next: Mutex<(f64, Option<Rng>)>,
    /// The Poisson process's seed, to count its slots again afterwards.
    seed: Option<u64>,
    /// Off for the read-back after a verified write run (not part of the rated workload).
    on: std::sync::atomic::AtomicBool,
}

impl Pacer {
    fn new(rate: f64, poisson: Option<u64>) -> Pacer {
        Pacer {
            start: Instant::now(),
            interval: 1.0 / rate,
            next: Mutex::new((0.0, poisson.map(Pacer::rng))),
            seed: poisson,
            on: std::sync::atomic::AtomicBool::new(true),
        }
    }

    fn rng(seed: u64) -> Rng {
        Rng::new(seed ^ 0x7261_7465)
    }

    /// The gap after a slot: the interval, or an exponential draw of that mean.
    fn gap(&self, rng: Option<&mut Rng>) -> f64 {
        match rng {
            // Inverse transform: -ln(U) x mean, U in (0, 1].
            Some(r) => {
                let u = ((r.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                -u.ln() * self.interval
            }
            None => self.interval,
        }
    }

    /// Slots the schedule holds in the first `secs` seconds: the I/Os the rate asked for,
    /// whether or not the device kept up with them.
    fn offered(&self, secs: f64) -> u64 {
        let mut rng = self.seed.map(Pacer::rng);
        let (mut t, mut n) = (0.0, 0u64);
        while t < secs {
            n += 1;
            t += self.gap(rng.as_mut());
        }
        n
    }

    /// When the next I/O may start (None: now).
    fn slot(&self) -> Option<Instant> {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.on.load(Relaxed) {
            return None;
        }
        let at = {
            let mut n = self.next.lock().unwrap_or_else(|p| p.into_inner());
            let at = n.0;
            n.0 += self.gap(n.1.as_mut());
            at
        };
        let at = self.start + Duration::from_secs_f64(at);
        (at > Instant::now()).then_some(at)
    }
}

#[derive(Default)]
struct KillLog {
    kills: Vec<Kill>,
    last_done: Option<Instant>,
    longest_stall: Duration,
}

/// One connection killed on purpose (--kill-every).
#[derive(Debug, Clone, Copy)]
struct Kill {
    at: Instant,
    conn: usize,
    /// The longest I/O in flight at `at` that has completed so far.
    longest: Duration,
}

impl Ctx {
    /// An I/O that ran from `t0` to `t1` completed: it counts for every kill in between.
    fn note_span(&self, t0: Instant, t1: Instant) {
        let Some(kills) = &self.kills else { return };
        let mut k = kills.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(last) = k.last_done {
            k.longest_stall = k.longest_stall.max(t1.saturating_duration_since(last));
        }
        k.last_done = Some(k.last_done.map_or(t1, |l| l.max(t1)));
        for x in k.kills.iter_mut().rev() {
            if x.at < t0 {
                break;
            }
            if x.at <= t1 {
                x.longest = x.longest.max(t1 - t0);
            }
        }
    }
}

fn lockg(c: &Ctx) -> std::sync::MutexGuard<'_, Gen> {
    c.gen.lock().unwrap_or_else(|p| p.into_inner())
}

async fn worker(c: Arc<Ctx>) -> WorkerOut {
    let mut out = WorkerOut::default();
    loop {
        if let Some(at) = c.pacer.as_ref().and_then(Pacer::slot) {
            // A slot past the run's end is not waited for: the run ends on time, rather than
            // up to iodepth - 1 intervals late with no I/O in that tail.
            if lockg(&c).deadline.is_some_and(|d| at >= d) {
                break;
            }
            tokio::time::sleep_until(at.into()).await;
        }
        let Some((op, idx)) = lockg(&c).next() else {
            break;
        };
        let lba = idx * c.lbas_per_io;
        let t0 = Instant::now();
        let (res, gen_written) = match op {
            Op::Read => {
                let r = c.dev.read(lba, c.lbas_per_io as u32).await;
                let ns = t0.elapsed().as_nanos() as u64;
                match r {
                    Ok(data) => {
                        out.read.record(ns, c.bs);
                        if c.verify {
                            let g = lockg(&c).gens.get(idx as usize).copied().unwrap_or(0);
                            let expect = (g != 0).then_some(g);
                            // Blocks this run never wrote are checked only in pure-read runs
                            // (a write run that ends before its first pass leaves some unwritten).
                            let check = expect.is_some() || !lockg(&c).rw.writes();
                            if check {
                                out.verified += 1;
                                if let Err(e) = check_block(&data, lba, expect) {
                                    out.verify_errors += 1;
                                    if out.verify_errors <= 5 {
                                        eprintln!("verify: {e}");
                                    }
                                    out.first_error.get_or_insert((EILSEQ, e));
                                }
                            }
                        }
                        (Ok(()), None)
                    }
                    Err(e) => (Err(e), None),
                }
            }
            Op::Write => {
                let (data, g) = if c.verify {
                    let g = c
                        .write_gen
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                        + 1;
                    (make_block(lba, g, c.bs as usize), Some(g))
                } else {
                    (c.fill.clone(), None)
                };
                let r = c.dev.write(lba, data).await;
                let ns = t0.elapsed().as_nanos() as u64;
                if r.is_ok() {
                    out.write.record(ns, c.bs);
                }
                (r, g)
            }
        };
        if res.is_ok() {
            c.note_span(t0, Instant::now());
        }
        {
            let mut g = lockg(&c);
            if let Some(b) = g.busy.get_mut(idx as usize) {
                *b = false;
            }
            if let (Ok(()), Some(gw)) = (&res, gen_written) {
                if let Some(s) = g.gens.get_mut(idx as usize) {
                    *s = gw;
                }
            }
            if let Err(e) = &res {
                // fio stops a job at its first I/O error (continue_on_error=none).
                g.stop = true;
                out.first_error.get_or_insert((EIO, e.to_string()));
            }
        }
    }
    out
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    // One thread, like one fio job: on a machine that also runs the target, a second thread
    // mostly adds wake-ups between threads (futex) and takes CPU time from the target.
    crate::cmd::runtime(args.threads)?.block_on(bench(args))
}

async fn bench(a: Args) -> anyhow::Result<ExitCode> {
    if let Some(path) = crate::cmd::volume::spec_path(&a.url) {
        return bench_volume(&a, path).await;
    }
    let url = IscsiUrl::parse(&a.url)?;
    let auto = (a.bs == "auto").then(|| auto_args(&a)).transpose()?;
    let bs = match &auto {
        Some(x) => x.min,
        None => mcsi_units::parse_size(&a.bs)
            .map_err(|e| anyhow::anyhow!("--bs: {e} (or auto, for sequential reads)"))?,
    };
    if a.iodepth == 0 || a.iodepth > 4096 {
        bail!("--iodepth must be between 1 and 4096, got {}", a.iodepth);
    }
    if let Some(r) = a.rate_iops {
        if !(r.is_finite() && r > 0.0) {
            bail!("--rate-iops must be a positive number of I/Os per second, got {r}");
        }
        if auto.is_some() {
            bail!("--rate-iops paces fixed-size I/Os: give --bs a size, not auto");
        }
    }
    if a.rwmixread > 100 {
        bail!("--rwmixread is a percentage (0-100), got {}", a.rwmixread);
    }
    let opts = a.session.options(a.metrics.is_some() || auto.is_some())?;
    let session = connect(&url, opts)
        .await
        .with_context(|| format!("connecting to {url}"))?;
    if let Some(addr) = &a.metrics {
        let observer = crate::cmd::observe::SessionObserver {
            session: session.clone(),
            initiator: a
                .session
                .initiator_name
                .clone()
                .unwrap_or_else(mcsi_initiator::session::default_initiator_name),
        };
        let at = crate::cmd::http::serve(addr, std::sync::Arc::new(observer)).await?;
        eprintln!("metrics on http://{at}/metrics, connections on http://{at}/state");
    }
    let result = match auto {
        Some(x) => run_auto(&a, &session, &url, x).await,
        None => match session.open_lun(url.lun).await {
            Ok(lun) => run_jobs(&a, Device::Lun(lun), &session, bs).await,
            Err(e) => Err(anyhow::Error::new(e).context(format!("opening {url}"))),
        },
    };
    if let Err(e) = session.logout().await {
        tracing::warn!(error = %e, "logout failed");
    }
    result
}

/// `mcsi bench volume:SPEC.toml`: the workload over a volume of several LUNs. The JSON's
/// session figures are the first member's; `mcsi.volume` lists every member's.
async fn bench_volume(a: &Args, path: &std::path::Path) -> anyhow::Result<ExitCode> {
    if a.bs == "auto" {
        bail!("--bs auto sizes reads from one LUN's session: give a volume a fixed --bs");
    }
    if a.metrics.is_some() {
        bail!("--metrics serves one session: bench a volume's members one at a time to watch them");
    }
    if a.iodepth == 0 || a.iodepth > 4096 {
        bail!("--iodepth must be between 1 and 4096, got {}", a.iodepth);
    }
    if a.rwmixread > 100 {
        bail!("--rwmixread is a percentage (0-100), got {}", a.rwmixread);
    }
    let bs = mcsi_units::parse_size(&a.bs).map_err(|e| anyhow::anyhow!("--bs: {e}"))?;
    let spec = crate::cmd::volume::load(path, &a.session, false)?;
    let v = Volume::open(&spec)
        .await
        .with_context(|| format!("opening {}", a.url))?;
    let dev = Device::Volume(v);
    let sessions = dev.sessions();
    let result = run_jobs(a, dev.clone(), &sessions[0], bs).await;
    for (url, e) in dev.logout().await {
        tracing::warn!(error = %e, "logout of {url} failed");
    }
    result
}

/// The workload over `dev`; `session` is the one whose figures the report gives (a LUN's, or
/// a volume's first member's).
async fn run_jobs(a: &Args, dev: Device, session: &Session, bs: u64) -> anyhow::Result<ExitCode> {
    let geo = dev.geometry();
    let dev_name = dev.describe();
    let lbs = u64::from(geo.block_size);
    if bs == 0 || !bs.is_multiple_of(lbs) || bs > 16 << 20 {
        bail!(
            "--bs {bs} must be a multiple of {dev_name}'s {lbs}-byte block size and at most 16MiB"
        );
    }
    if a.verify && bs < HDR as u64 {
        bail!("--verify needs --bs of at least {HDR} bytes");
    }
    let size = match &a.size {
        Some(s) => mcsi_units::parse_size(s).map_err(|e| anyhow::anyhow!("--size: {e}"))?,
        None => geo.bytes(),
    };
    if size > geo.bytes() {
        bail!("--size {size} exceeds {} ({} bytes)", dev_name, geo.bytes());
    }
    let blocks = size / bs;
    if blocks == 0 {
        bail!("--size {size} holds no block of --bs {bs}");
    }
    if a.rw.random() && blocks > u64::from(u32::MAX) {
        bail!("the region holds {blocks} blocks; random workloads support up to 2^32");
    }
    let mut rng = Rng::new(a.seed);
    let mut order: Vec<u32> = Vec::new();
    if a.rw.random() {
        order = (0..blocks as u32).collect();
        shuffle(&mut order, &mut rng);
    }
    let track = a.verify && blocks <= 1 << 28;
    if a.kill_every.is_some() && a.runtime.is_none() {
        bail!("--kill-every kills connections while the run goes on: give --runtime too");
    }
    if a.kill_every.is_some() && matches!(dev, Device::Volume(_)) {
        bail!("--kill-every kills the connections of one session: bench a LUN, not a volume");
    }
    let gen = Gen {
        rw: a.rw,
        mix_read: a.rwmixread,
        blocks,
        order,
        pos: 0,
        pass: 0,
        issued: 0,
        // --runtime makes the run time-based (passes repeat); otherwise one pass over the region.
        limit: if a.runtime.is_some() {
            None
        } else {
            Some(blocks)
        },
        deadline: a
            .runtime
            .map(|r| Instant::now() + Duration::from_secs_f64(r)),
        rng,
        stop: false,
        gens: if track {
            vec![0; blocks as usize]
        } else {
            Vec::new()
        },
        busy: if track {
            vec![false; blocks as usize]
        } else {
            Vec::new()
        },
        verify_phase: false,
    };
    let mut fill = vec![0u8; bs as usize];
    let mut r = Rng::new(a.seed ^ 0xf111);
    for c in fill.chunks_mut(8) {
        let v = r.next().to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
    let ctx = Arc::new(Ctx {
        dev,
        bs,
        lbas_per_io: bs / lbs,
        verify: a.verify,
        gen: Mutex::new(gen),
        fill: Bytes::from(fill),
        write_gen: std::sync::atomic::AtomicU64::new(0),
        kills: a.kill_every.map(|_| Mutex::new(KillLog::default())),
        pacer: a
            .rate_iops
            .map(|r| Pacer::new(r, (a.rate_process == "poisson").then_some(a.seed))),
    });
    let t0 = Instant::now();
    let cpu0 = CpuTimes::now();
    let killer = a.kill_every.zip(a.runtime).map(|(every, runtime)| {
        tokio::spawn(kill_connections(
            session.clone(),
            Arc::clone(&ctx),
            every,
            runtime,
        ))
    });
    let mut total = run_phase(&ctx, a.iodepth).await;
    let main_elapsed = t0.elapsed();
    let cpu = CpuTimes::now().since(&cpu0);
    if let Some(k) = killer {
        k.abort();
    }
    if let Some(kills) = &ctx.kills {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let log = kills.lock().unwrap_or_else(|p| p.into_inner());
        total.kills = log
            .kills
            .iter()
            .map(|k| (ms(k.at - t0), k.conn, ms(k.longest)))
            .collect();
        total.longest_stall_ms = Some(ms(log.longest_stall));
    }
    // Workloads that wrote with --verify read every block back afterwards (fio's do_verify):
    // each must hold the last version written.
    if a.verify && a.rw.writes() && total.first_error.is_none() {
        {
            if let Some(p) = &ctx.pacer {
                p.on.store(false, std::sync::atomic::Ordering::Relaxed);
            }
            let mut g = lockg(&ctx);
            let written = g.issued.min(blocks);
            g.verify_phase = true;
            g.pos = 0;
            g.issued = 0;
            g.limit = Some(if a.runtime.is_some() { blocks } else { written });
            g.deadline = None;
            g.order.clear(); // read back sequentially
        }
        let v = run_phase(&ctx, a.iodepth).await;
        total.verified += v.verified;
        total.verify_errors += v.verify_errors;
        if total.first_error.is_none() {
            total.first_error = v.first_error;
        }
        // Verify reads are not part of the measured workload.
    }
    let stats = session.stats();
    let params = session.params();
    let error = total.first_error.as_ref().map_or(0, |e| e.0);
    if a.json {
        let mut out = fio_json(
            a,
            bs,
            size,
            &total,
            main_elapsed,
            error,
            &stats,
            &params,
            session,
            &cpu,
        );
        if let (Device::Volume(v), Some(m)) = (&ctx.dev, out.get_mut("mcsi")) {
            m["volume"] = volume_json(v);
        }
        // With --rate-iops and --runtime: the I/Os the schedule asked for in the run.
        if let (Some(p), Some(rt), Some(m)) = (&ctx.pacer, a.runtime, out.get_mut("mcsi")) {
            m["offered_ios"] = Value::from(p.offered(rt));
        }
        emit(&format!("{}\n", serde_json::to_string_pretty(&out)?));
    } else {
        print_human(a, bs, &total, main_elapsed, &stats, session, &cpu);
    }
    if let Some((_, e)) = &total.first_error {
        eprintln!("mcsi bench: error: {e}");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// --kill-every: shut connection k mod n of the session down every `every` seconds until the
/// run's end.
async fn kill_connections(session: Session, ctx: Arc<Ctx>, every: f64, runtime: f64) {
    let n = session.stats().connections.len().max(1);
    let end = Instant::now() + Duration::from_secs_f64(runtime);
    let every = Duration::from_secs_f64(every);
    let mut k = 0usize;
    loop {
        tokio::time::sleep(every).await;
        let now = Instant::now();
        if now >= end {
            return;
        }
        let conn = k % n;
        k += 1;
        if session.sever_connection(conn) {
            tracing::info!(conn, "connection killed on purpose (--kill-every)");
            if let Some(kills) = &ctx.kills {
                kills
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .kills
                    .push(Kill {
                        at: now,
                        conn,
                        longest: Duration::ZERO,
                    });
            }
        }
    }
}

async fn run_phase(ctx: &Arc<Ctx>, iodepth: usize) -> WorkerOut {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..iodepth {
        set.spawn(worker(Arc::clone(ctx)));
    }
    let mut total = WorkerOut::default();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(w) => {
                total.read.merge(&w.read);
                total.write.merge(&w.write);
                total.verified += w.verified;
                total.verify_errors += w.verify_errors;
                if total.first_error.is_none() {
                    total.first_error = w.first_error;
                }
            }
            Err(e) => {
                total
                    .first_error
                    .get_or_insert((EIO, format!("worker failed: {e}")));
            }
        }
    }
    total
}

/// A volume's layout and each member's session, for the JSON.
fn volume_json(v: &Volume) -> Value {
    let states = v.member_states();
    let members: Vec<Value> = v
        .members()
        .iter()
        .zip(&states)
        .map(|(l, state)| {
            // A mirror member that never opened has no session to count.
            let st = l.as_ref().map(|l| l.session().stats());
            let sum = |f: fn(&mcsi_initiator::ConnectionStats) -> u64| {
                st.as_ref()
                    .map_or(0, |s| s.connections.iter().map(f).sum::<u64>())
            };
            json!({
                "url": state.url,
                "connections": st.as_ref().map_or(0, |s| s.connections.len()),
                "tasks": sum(|c| c.counters.tasks),
                "bytes": sum(|c| c.counters.bytes),
                "recoveries": st.as_ref().map_or(0, |s| s.recoveries),
                "failovers": st.as_ref().map_or(0, |s| s.failovers),
                "failed": state.failed,
                "dirty_bytes": state.dirty_bytes,
            })
        })
        .collect();
    let (layout, chunk) = match v.layout() {
        mcsi_initiator::Layout::Stripe { chunk } => ("stripe", Some(chunk)),
        mcsi_initiator::Layout::Mirror => ("mirror", None),
        mcsi_initiator::Layout::Paths => ("paths", None),
    };
    json!({"layout": layout, "chunk": chunk, "bytes": v.geometry().bytes(), "members": members})
}

/// Write to stdout; a closed pipe (`| head`) is not an error worth a panic.
fn emit(s: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(s.as_bytes()).and_then(|()| out.flush());
}

const PERCENTILES: [f64; 17] = [
    1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95,
    99.99,
];

fn lat_json(h: Option<&Histogram<u64>>) -> Value {
    let Some(h) = h.filter(|h| !h.is_empty()) else {
        return json!({"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0});
    };
    let mut p = Map::new();
    for q in PERCENTILES {
        p.insert(format!("{q:.6}"), json!(h.value_at_percentile(q)));
    }
    json!({
        "min": h.min(),
        "max": h.max(),
        "mean": h.mean(),
        "stddev": h.stdev(),
        "N": h.len(),
        "percentile": Value::Object(p),
    })
}

fn dir_json(d: &DirStats, secs: f64) -> Value {
    let secs = secs.max(1e-9);
    let bw = d.bytes as f64 / secs;
    let lat = lat_json(d.hist.as_ref());
    json!({
        "io_bytes": d.bytes,
        "io_kbytes": d.bytes / 1024,
        "bw_bytes": bw.round() as u64,
        "bw": (bw / 1024.0).round() as u64,
        "iops": d.ios as f64 / secs,
        "runtime": (secs * 1000.0).round() as u64,
        "total_ios": d.ios,
        "short_ios": 0,
        "drop_ios": 0,
        "slat_ns": {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0},
        "clat_ns": lat.clone(),
        "lat_ns": lat,
    })
}

#[allow(clippy::too_many_arguments)]
fn fio_json(
    a: &Args,
    bs: u64,
    size: u64,
    t: &WorkerOut,
    elapsed: Duration,
    error: i32,
    stats: &mcsi_initiator::SessionStats,
    params: &mcsi_initiator::SessionParams,
    session: &Session,
    cpu: &CpuTimes,
) -> Value {
    let secs = elapsed.as_secs_f64();
    let ios = t.read.ios + t.write.ios;
    // fio's usr_cpu / sys_cpu: percent of the run's wall time.
    let pct = |x: f64| if secs > 0.0 { x * 100.0 / secs } else { 0.0 };
    let conns: Vec<Value> = stats
        .connections
        .iter()
        .map(|c| {
            json!({
                "index": c.index,
                "cid": c.counters.cid,
                "role": c.counters.role.as_str(),
                "tasks": c.counters.tasks,
                "bytes": c.counters.bytes,
                "statuses_in": c.counters.statuses_in,
                "data_in_bytes": c.counters.data_in_bytes,
                "snacks": c.counters.snacks,
                "recovered": c.counters.recovered,
                "local": c.local.map(|a| a.to_string()),
                "peer": c.peer.map(|a| a.to_string()),
                "bind": c.bind,
                    "mptcp": c.mptcp,
                "congestion": c.congestion,
                "tcp": c.tcp.map(tcp_json),
                "target_tcp": c.target_tcp.map(tcp_json),
            })
        })
        .collect();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut v = json!({
        "fio version": concat!("mcsi-", env!("CARGO_PKG_VERSION")),
        "timestamp": now.as_secs(),
        "timestamp_ms": now.as_millis() as u64,
        "global options": {
            "rw": a.rw.name(),
            "bs": bs.to_string(),
            "iodepth": a.iodepth.to_string(),
            "size": size.to_string(),
        },
        "jobs": [{
            "jobname": "mcsi-bench",
            "groupid": 0,
            "error": error,
            "job options": {
                "rw": a.rw.name(),
                "bs": bs.to_string(),
                "iodepth": a.iodepth.to_string(),
                "rwmixread": a.rwmixread.to_string(),
                "verify": if a.verify { "crc32c" } else { "0" },
                "filename": session.url().to_string(),
            },
            "elapsed": secs.ceil() as u64,
            "job_runtime": (secs * 1000.0).round() as u64,
            "read": dir_json(&t.read, secs),
            "write": dir_json(&t.write, secs),
            "trim": dir_json(&DirStats::default(), secs),
            "usr_cpu": pct(cpu.user),
            "sys_cpu": pct(cpu.sys),
            "ctx": cpu.ctx,
        }],
        "mcsi": {
            "url": session.url().to_string(),
            "policy": stats.policy,
            "connections_requested": session.options().connections,
            "connections": conns,
            "asymmetric": params.asymmetric,
            "tsih": stats.tsih,
            "recoveries": stats.recoveries,
            "failovers": stats.failovers,
            "rejoins": stats.rejoins,
            "reissued": stats.reissued,
            "reassigned": stats.reassigned,
            "kills": t.kills.iter().map(|(at, conn, longest)| json!({
                "at_ms": at,
                "connection": conn,
                "longest_io_ms": longest,
            })).collect::<Vec<_>>(),
            "longest_stall_ms": t.longest_stall_ms,
            "window_waits": stats.window_waits,
            "exp_cmd_sn": stats.exp_cmd_sn,
            "max_cmd_sn": stats.max_cmd_sn,
            "session": {
                "max_connections": params.max_connections,
                "immediate_data": params.immediate_data,
                "initial_r2t": params.initial_r2t,
                "first_burst_length": params.first_burst_length,
                "max_burst_length": params.max_burst_length,
                "target_max_recv_data_segment_length": params.target_max_recv_dsl,
                "header_digest": params.header_digest,
                "data_digest": params.data_digest,
                "error_recovery_level": params.error_recovery_level,
                "default_time2retain": params.default_time2retain,
            },
            "verify": {"enabled": a.verify, "blocks_checked": t.verified, "errors": t.verify_errors},
            "threads": a.threads,
            "cpu": {
                "user_s": cpu.user,
                "sys_s": cpu.sys,
                "us_per_io": cpu.us_per_io(ios),
            },
        },
    });
    // fio lists rate_iops among a job's options only when it is set.
    if let Some(r) = a.rate_iops {
        v["jobs"][0]["job options"]["rate_iops"] = Value::from(r.to_string());
        v["jobs"][0]["job options"]["rate_process"] = Value::from(a.rate_process.clone());
    }
    v
}

fn print_human(
    a: &Args,
    bs: u64,
    t: &WorkerOut,
    elapsed: Duration,
    stats: &mcsi_initiator::SessionStats,
    session: &Session,
    cpu: &CpuTimes,
) {
    use std::fmt::Write as _;
    let mut o = String::new();
    let secs = elapsed.as_secs_f64().max(1e-9);
    let _ = writeln!(
        o,
        "mcsi bench: {} rw={} bs={} iodepth={} connections={} policy={}",
        session.url(),
        a.rw.name(),
        bs,
        a.iodepth,
        stats.connections.len(),
        stats.policy
    );
    for (name, d) in [("read", &t.read), ("write", &t.write)] {
        if d.ios == 0 {
            continue;
        }
        let bw = d.bytes as f64 / secs;
        let _ = writeln!(
            o,
            "  {name}: IOPS={:.0}, BW={}/s ({:.1}MB/s)({} in {:.3}s)",
            d.ios as f64 / secs,
            mcsi_units::Bytes(bw),
            bw / 1e6,
            mcsi_units::Bytes(d.bytes as f64),
            secs
        );
        if let Some(h) = &d.hist {
            let _ = writeln!(
                o,
                "    lat (usec): min={:.1}, max={:.1}, avg={:.1}, stdev={:.1}",
                h.min() as f64 / 1e3,
                h.max() as f64 / 1e3,
                h.mean() / 1e3,
                h.stdev() / 1e3
            );
            let _ = writeln!(
                o,
                "    lat percentiles (usec): 50.00th=[{:.1}], 99.00th=[{:.1}], 99.90th=[{:.1}]",
                h.value_at_percentile(50.0) as f64 / 1e3,
                h.value_at_percentile(99.0) as f64 / 1e3,
                h.value_at_percentile(99.9) as f64 / 1e3
            );
        }
    }
    let _ = writeln!(
        o,
        "  cpu: usr={:.2}s sys={:.2}s ({:.0}% of one core), {:.2} us per I/O, {} threads",
        cpu.user,
        cpu.sys,
        (cpu.user + cpu.sys) * 100.0 / secs,
        cpu.us_per_io(t.read.ios + t.write.ios),
        a.threads
    );
    if a.verify {
        let _ = writeln!(
            o,
            "  verify: {} blocks checked, {} errors",
            t.verified, t.verify_errors
        );
    }
    if a.kill_every.is_some() {
        let _ = writeln!(
            o,
            "  kills: {} connections killed; {} session recoveries, {} failovers, {} commands issued again, {} tasks reassigned; longest time without an I/O completing {:.1} ms",
            t.kills.len(),
            stats.recoveries,
            stats.failovers,
            stats.reissued,
            stats.reassigned,
            t.longest_stall_ms.unwrap_or(0.0)
        );
        for (at, conn, longest) in &t.kills {
            let _ = writeln!(
                o,
                "    at {:.1}s connection {conn}: longest I/O across it {longest:.1} ms",
                at / 1e3
            );
        }
    }
    for c in &stats.connections {
        let tcp = c.tcp.map_or(String::new(), |t| {
            format!(
                ", {} cwnd {}, rtt {} us, retransmits {}",
                c.congestion.as_deref().unwrap_or("?"),
                t.cwnd,
                t.rtt_us,
                t.total_retrans
            )
        });
        let role = match c.counters.role {
            mcsi_initiator::core::ConnRole::Both => String::new(),
            r => format!(" [{}]", r.as_str()),
        };
        // Error recovery level 1: PDUs lost to a digest error and asked for again.
        let snacks = if c.counters.snacks > 0 {
            format!(
                ", {} SNACKs, {} PDUs received again",
                c.counters.snacks, c.counters.recovered
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            o,
            "  connection {} (cid {}){role}: {} tasks ({}) issued, {} statuses and {} of Data-In received{snacks}{tcp}",
            c.index,
            c.counters.cid,
            c.counters.tasks,
            mcsi_units::Bytes(c.counters.bytes as f64),
            c.counters.statuses_in,
            mcsi_units::Bytes(c.counters.data_in_bytes as f64)
        );
    }
    emit(&o);
}

/// A connection's TCP state in the JSON report: every field of the sample, plus
/// `retransmits` (the life total, under the name earlier reports used).
fn tcp_json(t: mcsi_initiator::TcpState) -> Value {
    let mut v = serde_json::to_value(t).unwrap_or(Value::Null);
    if let Some(m) = v.as_object_mut() {
        m.insert("retransmits".into(), json!(t.total_retrans));
    }
    v
}

/// `--bs auto` settings.
#[derive(Debug, Clone, Copy)]
struct Auto {
    rule: mcsi_initiator::iosize::Rule,
    min: u64,
    max: u64,
}

fn auto_args(a: &Args) -> anyhow::Result<Auto> {
    if a.rw != Rw::Read {
        bail!("--bs auto sizes sequential reads: use it with --rw read (other workloads take a fixed --bs)");
    }
    if a.verify {
        bail!("--bs auto reads whatever is on the LUN: it does not go with --verify");
    }
    let (rule, min, max) = a.auto.parse()?;
    Ok(Auto { rule, min, max })
}

/// Shared by the readers of a `--bs auto` run.
struct AutoCtx {
    lun: Lun,
    lbs: u64,
    /// Blocks of the region read.
    blocks: u64,
    /// Next block to read, and whether a pass ended (one-pass runs stop there).
    cursor: Mutex<(u64, bool)>,
    size: std::sync::atomic::AtomicU64,
    deadline: Option<Instant>,
    stop: std::sync::atomic::AtomicBool,
}

async fn auto_reader(c: Arc<AutoCtx>) -> WorkerOut {
    use std::sync::atomic::Ordering::Relaxed;
    let mut out = WorkerOut::default();
    loop {
        if c.stop.load(Relaxed) || c.deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let want = (c.size.load(Relaxed) / c.lbs).max(1);
        let (lba, n) = {
            let mut cur = c.cursor.lock().unwrap_or_else(|p| p.into_inner());
            if cur.0 >= c.blocks {
                if c.deadline.is_none() {
                    cur.1 = true;
                }
                cur.0 = 0;
            }
            if cur.1 {
                break;
            }
            let n = want.min(c.blocks - cur.0);
            let lba = cur.0;
            cur.0 += n;
            (lba, n)
        };
        let t0 = Instant::now();
        match c.lun.read(lba, n as u32).await {
            Ok(_) => out.read.record(t0.elapsed().as_nanos() as u64, n * c.lbs),
            Err(e) => {
                c.stop.store(true, Relaxed);
                out.first_error.get_or_insert((EIO, e.to_string()));
                break;
            }
        }
    }
    out
}

/// Sequential reads whose size follows the target's reports (`--bs auto`).
async fn run_auto(
    a: &Args,
    session: &Session,
    url: &IscsiUrl,
    auto: Auto,
) -> anyhow::Result<ExitCode> {
    use std::sync::atomic::Ordering::Relaxed;
    let lun = session
        .open_lun(url.lun)
        .await
        .with_context(|| format!("opening {url}"))?;
    let geo = lun.geometry();
    let lbs = u64::from(geo.block_size);
    let size = match &a.size {
        Some(s) => mcsi_units::parse_size(s).map_err(|e| anyhow::anyhow!("--size: {e}"))?,
        None => geo.bytes(),
    };
    if size > geo.bytes() || size < lbs {
        bail!(
            "--size {size} must hold a block and fit the LUN ({} bytes)",
            geo.bytes()
        );
    }
    let mut sizer =
        mcsi_initiator::iosize::Sizer::new(auto.rule, auto.min, auto.max, lbs, a.iodepth as u64);
    let ctx = Arc::new(AutoCtx {
        lun,
        lbs,
        blocks: size / lbs,
        cursor: Mutex::new((0, false)),
        size: std::sync::atomic::AtomicU64::new(sizer.size()),
        deadline: a
            .runtime
            .map(|r| Instant::now() + Duration::from_secs_f64(r)),
        stop: std::sync::atomic::AtomicBool::new(false),
    });
    let t0 = Instant::now();
    let cpu0 = CpuTimes::now();
    let mut readers = tokio::task::JoinSet::new();
    for _ in 0..a.iodepth {
        readers.spawn(auto_reader(Arc::clone(&ctx)));
    }
    // The size follows the reports; every change is kept for the report (up to 100 000).
    let mut trace: Vec<(u64, u64)> = vec![(0, sizer.size())];
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    let mut total = WorkerOut::default();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let s = sizer.update(&session.target_tcp());
                if s != ctx.size.swap(s, Relaxed) && trace.len() < 100_000 {
                    trace.push((t0.elapsed().as_millis() as u64, s));
                }
            }
            r = readers.join_next() => match r {
                Some(Ok(w)) => {
                    total.read.merge(&w.read);
                    if total.first_error.is_none() {
                        total.first_error = w.first_error;
                    }
                }
                Some(Err(e)) => {
                    total.first_error.get_or_insert((EIO, format!("reader failed: {e}")));
                }
                None => break,
            },
        }
    }
    let elapsed = t0.elapsed();
    let cpu = CpuTimes::now().since(&cpu0);
    let stats = session.stats();
    let params = session.params();
    let mean = total
        .read
        .bytes
        .checked_div(total.read.ios)
        .unwrap_or(sizer.size());
    let reported = session.target_tcp().iter().any(Option::is_some);
    if !reported {
        eprintln!("mcsi bench: the target sent no TCP state reports (not an mcsi target?): --bs auto stayed at --bs-min");
    }
    let error = total.first_error.as_ref().map_or(0, |e| e.0);
    if a.json {
        let mut out = fio_json(
            a, mean, size, &total, elapsed, error, &stats, &params, session, &cpu,
        );
        out["mcsi"]["bs_auto"] = json!({
            "rule": auto.rule.as_str(),
            "min": auto.min,
            "max": auto.max,
            "reports": reported,
            "mean_bytes": mean,
            "sizes_ms_bytes": trace,
        });
        emit(&format!("{}\n", serde_json::to_string_pretty(&out)?));
    } else {
        print_human(a, mean, &total, elapsed, &stats, session, &cpu);
        let sizes: Vec<u64> = trace.iter().map(|t| t.1).collect();
        println!(
            "  bs auto ({}): mean {} per read, {} size changes, from {} to {}",
            auto.rule.as_str(),
            mcsi_units::Bytes(mean as f64),
            trace.len().saturating_sub(1),
            mcsi_units::Bytes(sizes.iter().copied().min().unwrap_or(0) as f64),
            mcsi_units::Bytes(sizes.iter().copied().max().unwrap_or(0) as f64),
        );
    }
    if let Some((_, e)) = &total.first_error {
        eprintln!("mcsi bench: error: {e}");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// `--runtime`: a positive duration, in seconds when it has no unit.
pub(crate) fn parse_runtime(s: &str) -> Result<f64, String> {
    let d =
        mcsi_units::parse_duration(s, mcsi_units::BareUnit::Seconds).map_err(|e| e.to_string())?;
    if d.is_zero() {
        return Err("must be longer than zero (e.g. 10 or 10s)".to_owned());
    }
    Ok(d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_blocks_roundtrip_and_detect_damage() {
        let b = make_block(1234, 7, 4096);
        assert_eq!(&b[0..8], MAGIC);
        assert!(check_block(&b, 1234, Some(7)).is_ok());
        assert!(check_block(&b, 1234, None).is_ok());
        assert!(check_block(&b, 1235, Some(7))
            .unwrap_err()
            .contains("carries LBA 1234"));
        assert!(check_block(&b, 1234, Some(8))
            .unwrap_err()
            .contains("stale"));
        let mut d = b.to_vec();
        d[2000] ^= 1;
        assert!(check_block(&d, 1234, Some(7))
            .unwrap_err()
            .contains("checksum"));
        assert!(check_block(&[0u8; 4096], 0, None)
            .unwrap_err()
            .contains("no verify header"));
        // Different LBAs give different payloads.
        assert_ne!(&make_block(1, 1, 512)[HDR..], &make_block(2, 1, 512)[HDR..]);
    }

    #[test]
    fn random_pass_covers_every_block_once() {
        let mut order: Vec<u32> = (0..1000).collect();
        shuffle(&mut order, &mut Rng::new(1));
        let mut seen = order.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..1000).collect::<Vec<u32>>());
        assert_ne!(order, (0..1000).collect::<Vec<u32>>());
    }
}
