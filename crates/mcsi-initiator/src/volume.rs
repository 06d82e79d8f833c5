//! Several LUNs as one volume (seed 003: "access to two targets in parallel as one large
//! store"): striped (RAID-0, in chunks) or mirrored (RAID-1) across members, each member a LUN
//! with its own session, connections and routes.
//!
//! [`Volume`] offers what a [`Lun`] does (read, write, flush, unmap, write zeroes), so a tool
//! that moves blocks can take either. The stripe arithmetic ([`Stripe`]) is pure and tested
//! apart from any session.

use crate::error::Error;
use crate::error::Scope;
use crate::lun::{Capabilities, Capacity, Lun};
use crate::session::{connect, reinstate, ConnectOptions};
use crate::url::IscsiUrl;
use bytes::{Bytes, BytesMut};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

mod bitmap;
mod health;
use bitmap::{BitmapFile, Snapshot};
use health::{Finish, Health, Plan, State};

/// How the members hold the volume's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// RAID-0: chunks of `chunk` bytes in turn, chunk i on member i mod n.
    Stripe { chunk: u64 },
    /// RAID-1: every member holds every block.
    Mirror,
    /// One logical unit through several targets (gateways onto shared storage, such as an RBD
    /// image exported by two mcsi targets): each command goes to one member. Reads go to the
    /// member expected to finish first, as a mirror's do; writes, UNMAP and WRITE SAME go to
    /// the first live member (the preferred path), so that storage with a single writer lock,
    /// like RBD's exclusive lock, does not pass it back and forth; SYNCHRONIZE CACHE goes to
    /// every member, each gateway having a cache of its own, and fails once when a member died
    /// holding writes no flush had covered. A member that is gone is failed
    /// and the command goes to the next; a failed member comes back without a copy, the storage
    /// being shared. The members must report the same logical-unit designators (VPD 83h).
    Paths,
}

/// Which member serves a mirror's read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MirrorReads {
    /// The member expected to complete it first: each member session's tcp-aware estimate
    /// ([`crate::Session::expected_completion`]: queued bytes at the measured rate plus the
    /// path's smallest round-trip time); the least busy while a member has no measurement yet.
    /// A member given less than half its even share of reads over a second is measured afresh.
    #[default]
    Soonest,
    /// The member with the fewest of the volume's commands in flight.
    LeastBusy,
}

/// One member: a LUN URL and how to open its session.
#[derive(Debug, Clone)]
pub struct MemberSpec {
    pub url: IscsiUrl,
    pub options: ConnectOptions,
}

/// A volume to open.
#[derive(Debug, Clone)]
pub struct VolumeSpec {
    pub layout: Layout,
    pub members: Vec<MemberSpec>,
    /// A mirror's record of what each member missed ([`bitmap`]'s file). With it a mirror also
    /// opens while a member is away, and a process that starts again knows which members are
    /// stale; without it, every member must open and is trusted to hold the same blocks.
    pub bitmap: Option<std::path::PathBuf>,
    /// The most a mirror's resync copies per second (bytes); it always yields half the time to
    /// the volume's own commands while they run.
    pub resync_rate: Option<u64>,
    /// Which member serves a mirror's read.
    pub reads: MirrorReads,
}

/// Where a run of volume blocks lies on a stripe's members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stripe {
    /// Chunk size in blocks.
    pub chunk_blocks: u64,
    pub members: usize,
}

/// A contiguous run of blocks on one member, and where its data sits in the request's buffer
/// (in blocks from the request's start; one run may gather several pieces of the request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    pub member: usize,
    pub lba: u64,
    pub blocks: u64,
    /// `(offset in the request, offset in this run, blocks)` for each piece.
    pub pieces: Vec<(u64, u64, u64)>,
}

impl Stripe {
    /// Member and member LBA of volume block `lba`.
    pub fn locate(&self, lba: u64) -> (usize, u64) {
        let n = self.members as u64;
        let chunk = lba / self.chunk_blocks;
        let member = (chunk % n) as usize;
        let row = chunk / n;
        (member, row * self.chunk_blocks + lba % self.chunk_blocks)
    }

    /// The member runs of volume blocks `[lba, lba + blocks)`: pieces cut at chunk
    /// boundaries, those of one member that follow each other on it merged into one run.
    pub fn split(&self, lba: u64, blocks: u64) -> Vec<Extent> {
        let mut out: Vec<Extent> = Vec::new();
        let mut at = 0;
        while at < blocks {
            let v = lba + at;
            let n = (self.chunk_blocks - v % self.chunk_blocks).min(blocks - at);
            let (member, mlba) = self.locate(v);
            match out
                .iter_mut()
                .rev()
                .find(|e| e.member == member)
                .filter(|e| e.lba + e.blocks == mlba)
            {
                Some(e) => {
                    e.pieces.push((at, e.blocks, n));
                    e.blocks += n;
                }
                None => out.push(Extent {
                    member,
                    lba: mlba,
                    blocks: n,
                    pieces: vec![(at, 0, n)],
                }),
            }
            at += n;
        }
        out
    }
}

/// A member once open.
#[derive(Debug)]
struct Member {
    /// Replaced when a failed member comes back with a new session; None for a member that
    /// has not opened since the volume did.
    lun: std::sync::RwLock<Option<Lun>>,
    name: String,
    /// Commands in flight on it, for reads of a mirror.
    busy: AtomicUsize,
    /// Reads sent to it since its volume's `window` began (counted where a read goes out, not
    /// in [`Volume::reader`], which a failover also asks whether another member is left).
    picked: AtomicU64,
    /// Active, failed (a mirror member whose session was lost, or that did not take a change:
    /// no commands go to it, and the regions it missed are marked) or resyncing (back: it takes
    /// writes, and reads only of regions it did not miss, while those are copied to it), with
    /// one bit per region ([`region_bytes`]) it missed ([`health`]).
    health: Health,
    /// Paths: changes this member acknowledged without Force Unit Access, and how many of them
    /// a SYNCHRONIZE CACHE through it has covered since.
    changes: AtomicU64,
    flushed: AtomicU64,
    /// Paths: the member failed with changes no flush had covered; the next
    /// [`Volume::flush`] reports them as possibly lost, once.
    lost_unflushed: AtomicBool,
}

impl Member {
    fn lun(&self) -> Option<Lun> {
        self.lun.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Paths: counts every change it acknowledged as flushed from now on; true if some were
    /// not (a member that is gone may have lost them).
    fn settle_changes(&self) -> bool {
        let c = self.changes.load(Ordering::Acquire);
        self.flushed.fetch_max(c, Ordering::AcqRel) < c
    }

    /// Its LUN, or [`Error::Closed`] for a member that is not open (only a failed mirror
    /// member, which no command is sent to).
    fn open_lun(&self) -> Result<Lun, Error> {
        self.lun().ok_or(Error::Closed)
    }

    fn state(&self) -> State {
        self.health.state()
    }
}

/// Writes in flight per region, and the region a resync copies: a resync waits for the writes
/// on its region and holds new ones back while it copies, so that it never lays older data over
/// a newer write.
#[derive(Debug, Default)]
struct Regions {
    state: Mutex<RegionState>,
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct RegionState {
    writing: std::collections::HashMap<u64, u32>,
    copying: Option<u64>,
    /// The write-intent record ([`bitmap`]): regions named as being written, one bit each.
    /// A region joins it when a write starts on it and leaves at a sweep
    /// ([`Regions::sweep`]) that finds no write on it in flight or since the sweep before.
    intent: Vec<u64>,
    /// Regions a write started on since the last sweep.
    touched: Vec<u64>,
    /// Counts the regions that joined `intent`: a write goes out once a save of at least this
    /// generation is on file.
    intent_generation: u64,
}

impl Regions {
    fn lock(&self) -> std::sync::MutexGuard<'_, RegionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a write on regions `first..=last` (of `words` words of regions), once none
    /// of them is being copied, and names them in the write-intent record. Returns the
    /// generation of that record which must be on file before the write goes out.
    async fn share(&self, first: u64, last: u64, words: usize) -> (RegionShare<'_>, u64) {
        loop {
            let wait = self.changed.notified();
            {
                let mut st = self.lock();
                if !st.copying.is_some_and(|c| (first..=last).contains(&c)) {
                    for r in first..=last {
                        *st.writing.entry(r).or_insert(0) += 1;
                    }
                    let new = health::mark(&mut st.intent, first, last, words);
                    health::mark(&mut st.touched, first, last, words);
                    if new {
                        st.intent_generation += 1;
                    }
                    let share = RegionShare {
                        regions: self,
                        first,
                        last,
                    };
                    return (share, st.intent_generation);
                }
            }
            wait.await;
        }
    }

    /// Lets go of the regions in the write-intent record that no write has touched since the
    /// last sweep and none has in flight. True when one left.
    fn sweep(&self) -> bool {
        self.let_go(true)
    }

    /// Lets go of every region in the write-intent record that no write is in flight on (a
    /// clean stop).
    fn settle(&self) {
        self.let_go(false);
    }

    /// Clears the write-intent record's regions that have no write in flight and, when
    /// `spare_touched`, none started since the last sweep (whose marks it then clears).
    fn let_go(&self, spare_touched: bool) -> bool {
        let mut st = self.lock();
        let st = &mut *st;
        let mut left = false;
        for (i, w) in st.intent.iter_mut().enumerate() {
            let touched = match st.touched.get(i) {
                Some(&t) if spare_touched => t,
                _ => 0,
            };
            let mut bits = *w & !touched;
            while bits != 0 {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                if !st.writing.contains_key(&(i as u64 * 64 + u64::from(b))) {
                    *w &= !(1 << b);
                    left = true;
                }
            }
        }
        if spare_touched {
            st.touched.iter_mut().for_each(|w| *w = 0);
        }
        left
    }

    /// The write-intent record and its generation, taken together.
    fn intent(&self) -> (Vec<u64>, u64) {
        let st = self.lock();
        (st.intent.clone(), st.intent_generation)
    }

    /// Takes region `r` for a copy: new writes on it wait, and this waits for those in flight.
    async fn exclusive(&self, r: u64) -> RegionCopy<'_> {
        loop {
            let wait = self.changed.notified();
            {
                let mut st = self.lock();
                if st.copying.is_none() {
                    st.copying = Some(r);
                    break;
                }
            }
            wait.await;
        }
        loop {
            let wait = self.changed.notified();
            if self.lock().writing.get(&r).copied().unwrap_or(0) == 0 {
                return RegionCopy { regions: self };
            }
            wait.await;
        }
    }
}

struct RegionShare<'a> {
    regions: &'a Regions,
    first: u64,
    last: u64,
}

impl Drop for RegionShare<'_> {
    fn drop(&mut self) {
        let mut st = self.regions.lock();
        for r in self.first..=self.last {
            if let Some(n) = st.writing.get_mut(&r) {
                *n -= 1;
                if *n == 0 {
                    st.writing.remove(&r);
                }
            }
        }
        drop(st);
        self.regions.changed.notify_waiters();
    }
}

struct UserOp<'a>(&'a AtomicUsize);

impl Drop for UserOp<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

struct RegionCopy<'a> {
    regions: &'a Regions,
}

impl Drop for RegionCopy<'_> {
    fn drop(&mut self) {
        self.regions.lock().copying = None;
        self.regions.changed.notify_waiters();
    }
}

/// How long a region stays in the write-intent record after its last write: each such period
/// a sweep lets go of the regions no write touched since the last one (md's bitmap daemon runs
/// every 5 s too). Longer costs more copying after a crash; shorter, more saves of the record
/// under a steady workload.
const INTENT_SWEEP: std::time::Duration = std::time::Duration::from_secs(5);

/// How often a resync saves the regions it has cleaned so far.
const RESYNC_SAVE_PERIOD: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a member coming back waits for its earlier session's logout.
const OLD_SESSION_LOGOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Why a resync stopped.
#[derive(Debug)]
enum ResyncError {
    /// Reading member `src`, the copy's source, failed (`copied` bytes were copied by then).
    Source {
        src: usize,
        error: Error,
        copied: u64,
    },
    /// Writing the member being brought up to date failed.
    Target(Error),
    /// The record could not be saved.
    Record(Error),
}

/// How often a failed mirror member is tried again.
const REJOIN_PERIOD: std::time::Duration = std::time::Duration::from_secs(2);

/// The unit a failed mirror member's missed writes are recorded in, for volumes up to
/// [`MAX_REGIONS`] of them; larger volumes take larger regions ([`region_bytes`]).
pub const REGION_BYTES: u64 = 1 << 20;

/// The most regions a mirror tracks per member: its record is at most 128 KiB in memory however
/// large the members say they are.
pub const MAX_REGIONS: u64 = 1 << 20;

/// The region size of a mirror of `bytes`: [`REGION_BYTES`], doubled until the volume has at
/// most [`MAX_REGIONS`] regions.
pub fn region_bytes(bytes: u64) -> u64 {
    let mut r = REGION_BYTES;
    while bytes.div_ceil(r) > MAX_REGIONS {
        r *= 2;
    }
    r
}

/// The most a resync reads or writes in one command.
const COPY_BYTES: u64 = 1 << 20;

/// A member's state as the volume sees it ([`Volume::member_states`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberState {
    pub url: String,
    pub failed: bool,
    /// Bytes of regions written while it was failed (what a resync would copy).
    pub dirty_bytes: u64,
}

/// Whether `e` means the member itself is gone (its connection or session), rather than an
/// answer about the command (a SCSI status) or a bad request.
fn member_gone(e: &Error) -> bool {
    matches!(e.scope(), Scope::Connection | Scope::Session)
}

/// An open volume. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Volume {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    layout: Layout,
    stripe: Option<Stripe>,
    members: Vec<Member>,
    cap: Capacity,
    /// How to open each member again (a failed mirror member's return).
    specs: Vec<MemberSpec>,
    regions: Regions,
    /// A task tries failed members again.
    rejoining: AtomicBool,
    /// Which member serves a mirror's read.
    reads: MirrorReads,
    /// When the volume opened, and when (microseconds since) the members' `picked` counts
    /// began: [`MirrorReads::Soonest`] looks at them once a [`REMEASURE_US`].
    epoch: std::time::Instant,
    window: AtomicU64,
    /// A mirror's record of what each member missed, kept in a file.
    bitmap: Option<BitmapFile>,
    /// The unit of that record ([`region_bytes`] of the volume's size).
    region_bytes: u64,
    /// The most a resync copies per second (bytes), when the spec caps it.
    resync_rate: Option<u64>,
    /// Commands of the volume's users in flight (reads, writes, flushes...), which a resync
    /// makes room for.
    user_ops: AtomicUsize,
    /// Set by [`Volume::logout`]: members going away now are not failures.
    closing: AtomicBool,
    /// A paths volume's logical unit (its VPD 83h designators), which a member that comes
    /// back must still be.
    identity: Option<Vec<(u8, Bytes)>>,
}

impl Volume {
    /// Opens every member's session and LUN (at once), checks that they agree in block size,
    /// and sizes the volume: a stripe takes the smallest member's whole chunks from each, a
    /// mirror the smallest member.
    ///
    /// A mirror with a bitmap file also opens while members are away, as long as one member
    /// that missed nothing is open: the others start failed (tried again in the background) or,
    /// when the file says they missed writes, take writes but no reads until those regions are
    /// copied to them.
    pub async fn open(spec: &VolumeSpec) -> Result<Volume, Error> {
        if spec.members.len() < 2 {
            return Err(Error::InvalidArgument(format!(
                "a volume needs two members or more, got {}",
                spec.members.len()
            )));
        }
        let urls: Vec<String> = spec.members.iter().map(|m| m.url.to_string()).collect();
        if spec.bitmap.is_some() && spec.layout != Layout::Mirror {
            return Err(Error::InvalidArgument(
                "a bitmap records what a mirror member missed; only a mirror keeps one".to_string(),
            ));
        }
        // A mirror that sends each read where it completes first needs every member's rates.
        let specs: Vec<MemberSpec> = spec
            .members
            .iter()
            .cloned()
            .map(|mut m| {
                if !matches!(spec.layout, Layout::Stripe { .. })
                    && spec.reads == MirrorReads::Soonest
                {
                    m.options.measure_rates = true;
                }
                m
            })
            .collect();
        let mut opening = tokio::task::JoinSet::new();
        for (i, m) in specs.iter().cloned().enumerate() {
            opening.spawn(async move {
                let r = async {
                    let s = connect(&m.url, m.options.clone()).await?;
                    s.open_lun(m.url.lun).await
                }
                .await;
                (i, r)
            });
        }
        let mut opened: Vec<Option<Result<Lun, Error>>> =
            (0..spec.members.len()).map(|_| None).collect();
        while let Some(j) = opening.join_next().await {
            let (i, r) = j.map_err(|e| Error::Protocol(format!("opening a member failed: {e}")))?;
            opened[i] = Some(r);
        }
        let mut members = Vec::with_capacity(opened.len());
        let mut away = Vec::new();
        for (i, r) in opened.into_iter().enumerate() {
            let name = urls[i].clone();
            let lun = match r {
                Some(Ok(l)) => Some(l),
                Some(Err(e)) if spec.bitmap.is_some() => {
                    away.push((i, e));
                    None
                }
                Some(Err(e)) => {
                    return Err(Error::InvalidArgument(format!(
                        "member {i} ({name}) cannot be opened: {e}"
                    )))
                }
                None => return Err(Error::Protocol(format!("member {i} was never opened"))),
            };
            members.push(Member {
                health: Health::new(if lun.is_some() {
                    State::Active
                } else {
                    State::Failed
                }),
                lun: std::sync::RwLock::new(lun),
                name,
                busy: AtomicUsize::new(0),
                picked: AtomicU64::new(0),
                changes: AtomicU64::new(0),
                flushed: AtomicU64::new(0),
                lost_unflushed: AtomicBool::new(false),
            });
        }
        let open: Vec<(usize, Lun)> = members
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.lun().map(|l| (i, l)))
            .collect();
        let Some((first, first_lun)) = open.first().cloned() else {
            let why: Vec<String> = away
                .iter()
                .map(|(i, e)| format!("member {i} ({}): {e}", urls[*i]))
                .collect();
            return Err(Error::InvalidArgument(format!(
                "no member can be opened: {}",
                why.join("; ")
            )));
        };
        let bs = first_lun.block_size();
        for (i, l) in &open {
            if l.block_size() != bs {
                return Err(Error::InvalidArgument(format!(
                    "member {i} ({}) has {}-byte blocks, member {first} ({}) {bs}: a volume's members must agree",
                    urls[*i],
                    l.block_size(),
                    urls[first]
                )));
            }
        }
        let smallest = open
            .iter()
            .map(|(_, l)| l.geometry().blocks)
            .min()
            .unwrap_or(0);
        let mut identity = None;
        let (stripe, blocks) = match spec.layout {
            Layout::Stripe { chunk } => {
                if chunk == 0 || !chunk.is_multiple_of(u64::from(bs)) {
                    return Err(Error::InvalidArgument(format!(
                        "chunk {chunk} bytes is not a multiple of the members' {bs}-byte blocks"
                    )));
                }
                let chunk_blocks = chunk / u64::from(bs);
                let per_member = smallest / chunk_blocks * chunk_blocks;
                if per_member == 0 {
                    return Err(Error::InvalidArgument(format!(
                        "the smallest member holds less than one {chunk}-byte chunk"
                    )));
                }
                let s = Stripe {
                    chunk_blocks,
                    members: members.len(),
                };
                (Some(s), per_member * members.len() as u64)
            }
            Layout::Mirror => (None, smallest),
            Layout::Paths => {
                // One logical unit through every member, or this is a misconfiguration that
                // would scatter the volume's blocks over several disks.
                let (_, first_lun) = &open[0];
                let want = first_lun.identity().await?;
                if want.is_empty() {
                    return Err(Error::InvalidArgument(format!(
                        "member 0 ({}) reports no logical-unit designator (VPD 83h), so it cannot be told to be the same LUN as the others",
                        urls[open[0].0]
                    )));
                }
                for (i, l) in open.iter().skip(1) {
                    if l.identity().await? != want {
                        return Err(Error::InvalidArgument(format!(
                            "member {i} ({}) is another logical unit than member {} ({}): their VPD 83h designators differ; the members of a paths volume are one LUN through several targets",
                            urls[*i], open[0].0, urls[open[0].0]
                        )));
                    }
                }
                identity = Some(want);
                (None, smallest)
            }
        };
        let cap = Capacity {
            block_size: bs,
            blocks,
        };
        // What the file says each member missed, in regions sized to the volume.
        let region_bytes = region_bytes(cap.bytes());
        let bitmap = spec
            .bitmap
            .as_ref()
            .map(|p| BitmapFile::new(p, urls.clone(), region_bytes));
        let recorded = match &bitmap {
            Some(b) => b.load()?,
            None => None,
        };
        let region = (region_bytes / u64::from(bs)).max(1);
        let regions = blocks.div_ceil(region);
        let words = regions.div_ceil(64) as usize;
        let mut stale = Vec::new();
        let mut unsettled = 0;
        if let (Some(rec), Some(file)) = (&recorded, &bitmap) {
            let bad = |what: String, why: String| {
                Error::InvalidArgument(format!(
                    "mirror bitmap {}: {what}: {why}",
                    file.path().display()
                ))
            };
            let mut all = Vec::with_capacity(members.len());
            for i in 0..members.len() {
                all.push(
                    rec.bits(i, regions, words)
                        .map_err(|why| bad(format!("member {i}"), why))?,
                );
            }
            // Regions a write was in flight on when the volume last stopped may differ between
            // members: one that is open and missed nothing is their source, and they are
            // marked as missed on every other, to be copied before those serve them.
            let writing = rec
                .writing(regions, words)
                .map_err(|why| bad("writing".to_string(), why))?;
            unsettled = writing.iter().map(|w| w.count_ones() as u64).sum::<u64>();
            let source = (0..members.len())
                .find(|&i| members[i].state() == State::Active && all[i].iter().all(|&w| w == 0));
            if let (Some(src), true) = (source, unsettled > 0) {
                tracing::warn!(regions = unsettled, source = src, "{unsettled} regions were being written when the mirror last stopped; they are copied from member {src} to the others before those serve them");
                for (i, bits) in all.iter_mut().enumerate() {
                    if i != src {
                        for (b, w) in bits.iter_mut().zip(&writing) {
                            *b |= w;
                        }
                    }
                }
            }
            for (i, (m, bits)) in members.iter_mut().zip(all).enumerate() {
                if bits.iter().any(|&w| w != 0) {
                    stale.push(i);
                }
                m.health.load(bits);
            }
        }
        if !members.iter().any(|m| m.state() == State::Active) {
            let why: Vec<String> = members
                .iter()
                .enumerate()
                .map(|(i, m)| match away.iter().find(|(a, _)| *a == i) {
                    Some((_, e)) => format!("member {i} ({}) cannot be opened: {e}", m.name),
                    None => format!(
                        "member {i} ({}) missed writes while the volume ran without it",
                        m.name
                    ),
                })
                .collect();
            return Err(Error::InvalidArgument(format!(
                "no member holds every write (bitmap {}): {}",
                bitmap
                    .as_ref()
                    .map_or_else(String::new, |b| b.path().display().to_string()),
                why.join("; ")
            )));
        }
        let v = Volume {
            inner: Arc::new(Inner {
                layout: spec.layout,
                stripe,
                cap,
                members,
                specs,
                reads: spec.reads,
                epoch: std::time::Instant::now(),
                window: AtomicU64::new(0),
                regions: Regions::default(),
                rejoining: AtomicBool::new(false),
                bitmap,
                region_bytes,
                resync_rate: spec.resync_rate,
                user_ops: AtomicUsize::new(0),
                closing: AtomicBool::new(false),
                identity,
            }),
        };
        tracing::info!(
            layout = ?v.inner.layout,
            members = v.inner.members.len(),
            bytes = v.inner.cap.bytes(),
            "volume open"
        );
        if v.inner.layout == Layout::Mirror && v.inner.bitmap.is_none() {
            tracing::warn!(
                "mirror without a bitmap file: a member that misses writes is tracked only while this process runs; add bitmap = \"FILE\" to the spec so that a restart knows which member is stale"
            );
        }
        // The file exists from now on, so that its absence later means a new volume; and the
        // regions being written at the last stop are on record as missed before anything else.
        if recorded.is_none() || unsettled > 0 {
            v.record().await?;
        }
        if v.inner.bitmap.is_some() {
            tokio::spawn(Volume::sweep_intent(Arc::downgrade(&v.inner)));
        }
        for (i, e) in &away {
            tracing::error!(member = i, url = %urls[*i], error = %e, "mirror member {i} cannot be opened; the volume starts degraded, recording what it misses");
        }
        if !away.is_empty() && !v.inner.rejoining.swap(true, Ordering::AcqRel) {
            let w = v.clone();
            tokio::spawn(async move { w.rejoin().await });
        }
        for m in stale {
            let state = v.member_states()[m].clone();
            if v.inner.members[m].state() == State::Resyncing {
                tracing::warn!(member = m, url = %state.url, dirty = state.dirty_bytes, "mirror member {m} missed {} of writes before this process started (bitmap); it serves no reads of them until they are copied to it", mcsi_units::Bytes(state.dirty_bytes as f64));
                let w = v.clone();
                tokio::spawn(async move { w.catch_up(m).await });
            }
        }
        Ok(v)
    }

    pub fn geometry(&self) -> Capacity {
        self.inner.cap
    }

    pub fn block_size(&self) -> u32 {
        self.inner.cap.block_size
    }

    pub fn layout(&self) -> Layout {
        self.inner.layout
    }

    /// The members' LUNs, in the spec's order; None for a mirror member that has not opened.
    pub fn members(&self) -> Vec<Option<Lun>> {
        self.inner.members.iter().map(Member::lun).collect()
    }

    fn check(&self, lba: u64, blocks: u64) -> Result<(), Error> {
        if lba
            .checked_add(blocks)
            .is_none_or(|end| end > self.inner.cap.blocks)
        {
            return Err(Error::InvalidArgument(format!(
                "blocks {lba}..{} lie beyond the volume's {} blocks",
                lba.saturating_add(blocks),
                self.inner.cap.blocks
            )));
        }
        Ok(())
    }

    /// Reads `blocks` blocks from `lba`: a stripe reads every member's part at once; a mirror
    /// reads from the member with the fewest commands in flight.
    pub async fn read(&self, lba: u64, blocks: u32) -> Result<Bytes, Error> {
        let _user = self.user_op();
        self.check(lba, u64::from(blocks))?;
        let bs = u64::from(self.block_size());
        let Some(stripe) = self.inner.stripe else {
            // The member expected to finish first (or the least busy) of those that hold these
            // blocks; one that turns out to be gone is failed and the read goes to the next.
            let span = self.region_span(lba, u64::from(blocks));
            loop {
                let Some(m) = self.reader(u64::from(blocks) * bs, span, None) else {
                    return Err(Error::Closed);
                };
                self.inner.members[m].picked.fetch_add(1, Ordering::Relaxed);
                match self
                    .on_member(m, |l| async move { l.read(lba, blocks).await })
                    .await
                {
                    Err(e) if self.fail_over(m, &e, || self.reader(0, span, Some(m)).is_some()) => {
                    }
                    r => return r.map_err(|e| self.member_error(m, e)),
                }
            }
        };
        let extents = stripe.split(lba, u64::from(blocks));
        let reads = extents.iter().map(|e| async move {
            let data = self.inner.members[e.member]
                .open_lun()?
                .read(e.lba, e.blocks as u32)
                .await
                .map_err(|err| self.member_error(e.member, err))?;
            Ok::<_, Error>((e, data))
        });
        let parts = futures_join(reads).await?;
        let mut out = BytesMut::zeroed((u64::from(blocks) * bs) as usize);
        for (e, data) in parts {
            for &(at, off, n) in &e.pieces {
                let (dst, src, len) = ((at * bs) as usize, (off * bs) as usize, (n * bs) as usize);
                let piece = data.get(src..src + len).ok_or_else(|| {
                    Error::Protocol(format!(
                        "member {} returned {} bytes for {} blocks",
                        e.member,
                        data.len(),
                        e.blocks
                    ))
                })?;
                out[dst..dst + len].copy_from_slice(piece);
            }
        }
        Ok(out.freeze())
    }

    /// Writes `data` (whole blocks) at `lba`; done when every member that holds a part (a
    /// stripe) or every member (a mirror) has it.
    pub async fn write(&self, lba: u64, data: Bytes) -> Result<(), Error> {
        self.write_fua(lba, data, false).await
    }

    /// [`Volume::write`] with Force Unit Access on every member's part.
    pub async fn write_fua(&self, lba: u64, data: Bytes, fua: bool) -> Result<(), Error> {
        let _user = self.user_op();
        let bs = u64::from(self.block_size());
        let blocks = crate::lun::whole_blocks(data.len(), self.block_size())?;
        self.check(lba, blocks)?;
        if self.inner.layout == Layout::Paths {
            return self
                .path_op(fua, move |lun| {
                    let d = data.clone();
                    async move { lun.write_fua(lba, d, fua).await }
                })
                .await;
        }
        let Some(stripe) = self.inner.stripe else {
            return self.mirror_write(lba, blocks, data, fua).await;
        };
        let extents = stripe.split(lba, blocks);
        let writes = extents.iter().map(|e| {
            let part = gather(&data, e, bs);
            async move {
                self.inner.members[e.member]
                    .open_lun()?
                    .write_fua(e.lba, part, fua)
                    .await
                    .map_err(|err| self.member_error(e.member, err))
            }
        });
        futures_join(writes).await?;
        Ok(())
    }

    /// SYNCHRONIZE CACHE on every (live) member. Paths: it fails if a member that acknowledged
    /// changes since the last flush through it was lost before one: they were in that
    /// member's cache only, and may be gone (reported once, as fsync reports a writeback error).
    pub async fn flush(&self) -> Result<(), Error> {
        let _user = self.user_op();
        if self.inner.layout == Layout::Paths {
            return self.paths_flush().await;
        }
        let all = (0..self.inner.members.len()).map(|m| (m, 0, 0)).collect();
        self.on_runs(all, false, |lun, _, _| async move { lun.flush().await })
            .await
    }

    /// UNMAP of `[lba, lba + blocks)`, split across the members like data.
    pub async fn unmap(&self, lba: u64, blocks: u64) -> Result<(), Error> {
        let _user = self.user_op();
        self.check(lba, blocks)?;
        if self.inner.layout == Layout::Paths {
            return self
                .path_op(
                    false,
                    move |lun| async move { lun.unmap(lba, blocks).await },
                )
                .await;
        }
        let runs = self.runs(lba, blocks);
        self.on_runs(runs, true, |lun, l, n| async move { lun.unmap(l, n).await })
            .await
    }

    /// Zeroes `[lba, lba + blocks)` (WRITE SAME, at most `max_per_command` blocks a command),
    /// split across the members like data.
    pub async fn write_zeroes(
        &self,
        lba: u64,
        blocks: u64,
        unmap: bool,
        max_per_command: u64,
    ) -> Result<(), Error> {
        let _user = self.user_op();
        self.check(lba, blocks)?;
        if self.inner.layout == Layout::Paths {
            return self
                .path_op(false, move |lun| async move {
                    lun.write_zeroes(lba, blocks, unmap, max_per_command).await
                })
                .await;
        }
        let runs = self.runs(lba, blocks);
        self.on_runs(runs, true, move |lun, l, n| async move {
            lun.write_zeroes(l, n, unmap, max_per_command).await
        })
        .await
    }

    /// Runs `op` on each `(member, lba, blocks)` run at once. In a mirror a failed member is
    /// skipped and the run marked for it when `changes`, a member that turns out to be gone is
    /// failed, and a member coming back (resyncing) takes the changes but does not count as a
    /// copy yet; the stripe has no copy to go on with, so there any error is the caller's.
    async fn on_runs<F, Fut>(
        &self,
        runs: Vec<(usize, u64, u64)>,
        changes: bool,
        op: F,
    ) -> Result<(), Error>
    where
        F: Fn(Lun, u64, u64) -> Fut,
        Fut: std::future::Future<Output = Result<(), Error>>,
    {
        let mirror = self.inner.stripe.is_none();
        let words = self.region_words();
        // A mirror's change holds its regions against a resync copying them meanwhile, and
        // names them in the write-intent record.
        let (_share, intent) = match runs.first() {
            Some(&(_, l, n)) if mirror && changes => {
                let (first, last) = self.region_span(l, n);
                let (share, generation) = self.inner.regions.share(first, last, words).await;
                (Some(share), Some(generation))
            }
            _ => (None, None),
        };
        // Each member's part of the change is planned once: a member failed now is marked as
        // missing it in the same step (and that is on record, in the file if there is one,
        // before any member takes the change); any other is sent it ([`health`]).
        let mut plans = Vec::with_capacity(runs.len());
        let mut new = false;
        for &(m, l, n) in &runs {
            let member = &self.inner.members[m];
            let plan = if !mirror {
                Plan::Send { active: true }
            } else if changes {
                let (first, last) = self.region_span(l, n);
                member.health.plan(first, last, words)
            } else {
                match member.state() {
                    State::Failed => Plan::Skip { new: false },
                    s => Plan::Send {
                        active: s == State::Active,
                    },
                }
            };
            new |= matches!(plan, Plan::Skip { new: true });
            plans.push(plan);
        }
        // The record is on file before any member takes the change: its marks, and the change's
        // regions as being written (a crash from here on copies them at the next start).
        if new {
            self.record().await?;
        } else if let Some(generation) = intent {
            self.record_upto(generation).await?;
        }
        let ops = runs.iter().zip(&plans).map(|(&(m, l, n), plan)| {
            let fut = match plan {
                Plan::Send { .. } => {
                    Some(self.inner.members[m].open_lun().map(|lun| op(lun, l, n)))
                }
                Plan::Skip { .. } => None,
            };
            async move {
                let r = match fut {
                    Some(Ok(f)) => Some(f.await),
                    Some(Err(e)) => Some(Err(e)),
                    None => None,
                };
                (m, l, n, r)
            }
        });
        let results = futures_util::future::join_all(ops).await;
        let took = |active_only: bool| {
            results.iter().zip(&plans).any(|((_, _, _, r), p)| {
                matches!(r, Some(Ok(())))
                    && (!active_only || matches!(p, Plan::Send { active: true }))
            })
        };
        // A member that did not take a change another active member took is failed and
        // marked in one step: they differ there until its region is copied.
        let copied = mirror && changes && took(true);
        let mut done = 0;
        let mut answer = None;
        let mut new = false;
        for ((m, l, n, r), plan) in results.into_iter().zip(&plans) {
            let Some(r) = r else { continue };
            match r {
                Ok(()) => done += usize::from(matches!(plan, Plan::Send { active: true })),
                Err(e) if mirror && changes && (member_gone(&e) || copied) => {
                    let (first, last) = self.region_span(l, n);
                    let (failed_now, marked) =
                        self.inner.members[m].health.missed(first, last, words);
                    new |= marked;
                    if failed_now {
                        self.log_failed(m, &e);
                    }
                    if !self.inner.closing.load(Ordering::Acquire) {
                        self.start_rejoin();
                    }
                }
                Err(e) if mirror && member_gone(&e) => self.fail_member(m, &e),
                Err(e) => {
                    answer.get_or_insert(self.member_error(m, e));
                }
            }
        }
        // The change is acknowledged only once what the failed members missed is on record.
        if new {
            self.record().await?;
        }
        match answer {
            Some(e) => Err(e),
            None if done == 0 => Err(Error::Closed),
            None => Ok(()),
        }
    }

    /// The regions `[lba, lba + blocks)` touches.
    fn region_span(&self, lba: u64, blocks: u64) -> (u64, u64) {
        let region = self.region_blocks();
        (lba / region, (lba + blocks.max(1) - 1) / region)
    }

    fn region_blocks(&self) -> u64 {
        (self.inner.region_bytes / u64::from(self.block_size())).max(1)
    }

    /// Words of a member's bitmap of regions.
    fn region_words(&self) -> usize {
        self.inner
            .cap
            .blocks
            .div_ceil(self.region_blocks())
            .div_ceil(64) as usize
    }

    /// What every member offers: a feature only when all have it, each limit the smallest
    /// (of the members open now: a mirror member away is not asked).
    pub async fn capabilities(&self) -> Result<Capabilities, Error> {
        let open: Vec<(usize, Lun)> = (0..self.inner.members.len())
            .filter_map(|m| self.inner.members[m].lun().map(|l| (m, l)))
            .collect();
        let each = open.into_iter().map(|(m, lun)| async move {
            lun.capabilities()
                .await
                .map_err(|e| self.member_error(m, e))
        });
        let all = futures_join(each).await?;
        let min32 = |f: fn(&Capabilities) -> Option<u32>| all.iter().filter_map(f).min();
        Ok(Capabilities {
            max_transfer_blocks: min32(|c| c.max_transfer_blocks),
            optimal_transfer_blocks: min32(|c| c.optimal_transfer_blocks),
            max_unmap_blocks: min32(|c| c.max_unmap_blocks),
            max_write_same_blocks: all.iter().filter_map(|c| c.max_write_same_blocks).min(),
            unmap: all.iter().all(|c| c.unmap),
            write_same_unmap: all.iter().all(|c| c.write_same_unmap),
            write_protected: all.iter().any(|c| c.write_protected),
            fua: all.iter().all(|c| c.fua),
        })
    }

    /// `(member, member LBA, blocks)` runs that hold `[lba, lba + blocks)`.
    fn runs(&self, lba: u64, blocks: u64) -> Vec<(usize, u64, u64)> {
        match self.inner.stripe {
            Some(s) => s
                .split(lba, blocks)
                .into_iter()
                .map(|e| (e.member, e.lba, e.blocks))
                .collect(),
            None => (0..self.inner.members.len())
                .map(|m| (m, lba, blocks))
                .collect(),
        }
    }

    /// A mirror write: to every live member at once; done when each has it or is gone. A
    /// member that is gone is failed (the volume goes on degraded) and the region marked for
    /// it; the write fails only when no member took it, or one answered with an error about
    /// the command itself.
    async fn mirror_write(
        &self,
        lba: u64,
        blocks: u64,
        data: Bytes,
        fua: bool,
    ) -> Result<(), Error> {
        let all = (0..self.inner.members.len())
            .map(|m| (m, lba, blocks))
            .collect();
        self.on_runs(all, true, |lun, l, _| {
            let d = data.clone();
            async move { lun.write_fua(l, d, fua).await }
        })
        .await
    }

    /// A paths volume's change (write, UNMAP, WRITE SAME): to the first live member; one that
    /// turns out to be gone is failed and the change goes to the next. A change that reached
    /// a gateway before it died may be done or not, as with any command whose connection
    /// failed; sending it again through another is what a multipath initiator does.
    async fn path_op<F, Fut>(&self, durable: bool, op: F) -> Result<(), Error>
    where
        F: Fn(Lun) -> Fut,
        Fut: std::future::Future<Output = Result<(), Error>>,
    {
        let live = |besides: Option<usize>| {
            (0..self.inner.members.len())
                .find(|&i| Some(i) != besides && self.inner.members[i].state() == State::Active)
        };
        loop {
            let Some(m) = live(None) else {
                return Err(Error::Closed);
            };
            match self.on_member(m, &op).await {
                Ok(()) => {
                    if !durable {
                        self.inner.members[m].changes.fetch_add(1, Ordering::AcqRel);
                    }
                    return Ok(());
                }
                // Another command may have failed this member meanwhile: what counts is
                // whether a live one other than it is left.
                Err(e) if self.fail_over(m, &e, || live(Some(m)).is_some()) => {}
                Err(e) => return Err(self.member_error(m, e)),
            }
        }
    }

    /// [`Volume::flush`] of a paths volume: SYNCHRONIZE CACHE through every live member, each
    /// covering the changes it had acknowledged when the flush was sent.
    async fn paths_flush(&self) -> Result<(), Error> {
        let live: Vec<usize> = (0..self.inner.members.len())
            .filter(|&m| self.inner.members[m].state() == State::Active)
            .collect();
        let flushes = live.into_iter().map(|m| async move {
            let upto = self.inner.members[m].changes.load(Ordering::Acquire);
            (
                m,
                upto,
                self.on_member(m, |lun| async move { lun.flush().await })
                    .await,
            )
        });
        let mut done = 0;
        let mut answer = None;
        for (m, upto, r) in futures_util::future::join_all(flushes).await {
            match r {
                Ok(()) => {
                    done += 1;
                    self.inner.members[m]
                        .flushed
                        .fetch_max(upto, Ordering::AcqRel);
                }
                Err(e) if member_gone(&e) => self.fail_member(m, &e),
                Err(e) => {
                    answer.get_or_insert(self.member_error(m, e));
                }
            }
        }
        let lost: Vec<&str> = self
            .inner
            .members
            .iter()
            .filter(|member| {
                // Also a member failed between acknowledging a change and counting it.
                let lost = member.lost_unflushed.swap(false, Ordering::AcqRel);
                lost | (member.state() != State::Active && member.settle_changes())
            })
            .map(|member| member.name.as_str())
            .collect();
        if let Some(e) = answer {
            return Err(e);
        }
        if !lost.is_empty() {
            return Err(Error::SessionLost {
                attempts: 0,
                last: format!(
                    "{} acknowledged writes that no SYNCHRONIZE CACHE had covered, and was lost before one: they may be gone",
                    lost.join(", ")
                ),
            });
        }
        if done == 0 {
            return Err(Error::Closed);
        }
        Ok(())
    }

    /// Runs `op` on member `m`'s LUN, counted among the member's commands in flight.
    async fn on_member<T, F, Fut>(&self, m: usize, op: F) -> Result<T, Error>
    where
        F: FnOnce(Lun) -> Fut,
        Fut: std::future::Future<Output = Result<T, Error>>,
    {
        let member = &self.inner.members[m];
        member.busy.fetch_add(1, Ordering::Relaxed);
        let r = match member.open_lun() {
            Ok(l) => op(l).await,
            Err(e) => Err(e),
        };
        member.busy.fetch_sub(1, Ordering::Relaxed);
        r
    }

    /// Whether a command that failed on member `m` with `e` goes to another member: `m` is
    /// gone, the volume is not closing and `other` says another can take it. `m` is failed
    /// then.
    fn fail_over(&self, m: usize, e: &Error, other: impl FnOnce() -> bool) -> bool {
        let go = member_gone(e) && !self.inner.closing.load(Ordering::Acquire) && other();
        if go {
            self.fail_member(m, e);
        }
        go
    }

    /// Member `m` is gone: no more commands go to it, logged once, and a task tries it again
    /// every [`REJOIN_PERIOD`] to bring it back ([`Volume::rejoin`]).
    fn fail_member(&self, m: usize, e: &Error) {
        if self.inner.closing.load(Ordering::Acquire) {
            return;
        }
        let member = &self.inner.members[m];
        // Whatever it does on coming back, what it held in its cache may be gone.
        if self.inner.layout == Layout::Paths && member.settle_changes() {
            member.lost_unflushed.store(true, Ordering::Release);
        }
        if member.health.fail() {
            self.log_failed(m, e);
        }
        self.start_rejoin();
    }

    /// Logs that member `m` failed (once per failure).
    fn log_failed(&self, m: usize, e: &Error) {
        let member = &self.inner.members[m];
        let (kind, how) = match self.inner.layout {
            Layout::Paths => ("paths", " through the others"),
            _ => ("mirror", ", recording what it misses"),
        };
        tracing::error!(
            member = m,
            url = %member.name,
            error = %e,
            live = self.live_members(),
            "{kind} member {m} failed; the volume goes on degraded{how}"
        );
    }

    /// Starts the task that tries failed members again, unless it runs.
    fn start_rejoin(&self) {
        if !self.inner.rejoining.swap(true, Ordering::AcqRel) {
            let v = self.clone();
            tokio::spawn(async move { v.rejoin().await });
        }
    }

    /// Tries the failed members again until none is left: one that opens (same block size, big
    /// enough) takes writes at once and gets the regions it missed copied from a live member,
    /// one at a time; meanwhile it serves reads of the regions it did not miss.
    async fn rejoin(self) {
        loop {
            tokio::time::sleep(REJOIN_PERIOD).await;
            let failed: Vec<usize> = (0..self.inner.members.len())
                .filter(|&m| self.inner.members[m].state() == State::Failed)
                .collect();
            if failed.is_empty() {
                self.inner.rejoining.store(false, Ordering::Release);
                // A member that failed just now found the flag still set: look once more.
                if self
                    .inner
                    .members
                    .iter()
                    .any(|m| m.state() == State::Failed)
                    && !self.inner.rejoining.swap(true, Ordering::AcqRel)
                {
                    continue;
                }
                return;
            }
            if Arc::strong_count(&self.inner) == 1 || self.inner.closing.load(Ordering::Acquire) {
                return; // the volume was dropped or closed
            }
            for m in failed {
                self.try_back(m).await;
            }
        }
    }

    async fn try_back(&self, m: usize) {
        let spec = &self.inner.specs[m];
        let member = &self.inner.members[m];
        // Its earlier session ends first: logged out if it still answers, and in any case
        // fenced by logging in with its ISID (session reinstatement: the target ends it and
        // aborts its tasks), so that a write it still had in flight cannot land after its
        // region was copied.
        let old = member.lun();
        if let Some(old) = &old {
            let _ = tokio::time::timeout(OLD_SESSION_LOGOUT, old.session().logout()).await;
        }
        let lun = match async {
            let s = match &old {
                Some(o) => reinstate(&spec.url, spec.options.clone(), o.session().isid()).await?,
                None => connect(&spec.url, spec.options.clone()).await?,
            };
            s.open_lun(spec.url.lun).await
        }
        .await
        {
            Ok(l) => l,
            Err(e) => {
                tracing::info!(member = m, url = %member.name, error = %e, "mirror member {m} still away");
                return;
            }
        };
        let (bs, blocks) = (lun.block_size(), lun.geometry().blocks);
        if let Some(want) = &self.inner.identity {
            // Still the logical unit the volume opened (a paths member is not copied to, so
            // another LUN behind the same address would go unnoticed).
            if !matches!(lun.identity().await, Ok(id) if id == *want) {
                tracing::error!(member = m, url = %member.name, "paths member {m} came back as another logical unit (VPD 83h); it stays failed");
                let _ = lun.session().logout().await;
                return;
            }
        }
        if bs != self.block_size() || blocks < self.inner.cap.blocks {
            tracing::error!(member = m, url = %member.name, block_size = bs, blocks, "mirror member {m} came back with another geometry; it stays failed");
            let _ = lun.session().logout().await;
            return;
        }
        *member.lun.write().unwrap_or_else(|p| p.into_inner()) = Some(lun);
        if member.health.begin_resync() {
            self.catch_up(m).await;
        }
    }

    /// Member `m` is open again (or was stale when the volume opened): copies it what it missed
    /// and lets it serve reads again, or fails it once more.
    async fn catch_up(&self, m: usize) {
        let member = &self.inner.members[m];
        let t0 = std::time::Instant::now();
        let mut bytes = 0;
        loop {
            match self.resync(m).await {
                Ok(b) => {
                    bytes += b;
                    match member.health.finish_resync() {
                        Finish::Active => {
                            tracing::info!(
                                member = m,
                                url = %member.name,
                                bytes,
                                "mirror member {m} back in sync: {} copied in {:.1?}",
                                mcsi_units::Bytes(bytes as f64),
                                t0.elapsed()
                            );
                            return;
                        }
                        // Regions were marked since it looked (it failed and came back).
                        Finish::More => continue,
                        // It failed meanwhile: it is tried again.
                        Finish::Failed => return,
                    }
                }
                Err(_) if self.inner.closing.load(Ordering::Acquire) => {
                    let left = self.member_states()[m].dirty_bytes;
                    tracing::info!(member = m, url = %member.name, left, "the resync of member {m} stops with the volume; {} left to copy (kept in the bitmap, if there is one)", mcsi_units::Bytes(left as f64));
                    return;
                }
                // The member it copied from failed: that one is failed, and the copy goes on
                // from another, if one is left.
                Err(ResyncError::Source {
                    src,
                    error: e,
                    copied,
                }) => {
                    bytes += copied;
                    if member_gone(&e) {
                        self.fail_member(src, &e);
                    } else {
                        self.member_error(src, e);
                    }
                    if self.live_members() == 0 {
                        tracing::error!(member = m, url = %member.name, "mirror member {m} cannot be brought up to date: no active member is left to copy from; it stays failed");
                        if member.health.fail() {
                            self.start_rejoin();
                        }
                        return;
                    }
                }
                Err(ResyncError::Target(e)) => {
                    self.fail_member(m, &e);
                    return;
                }
                Err(ResyncError::Record(e)) => {
                    tracing::error!(member = m, url = %member.name, error = %e, "the resync of mirror member {m} cannot save its record; it stays failed");
                    self.fail_member(m, &e);
                    return;
                }
            }
        }
    }

    /// Logs out of every member's session (the current one: a member that came back has a new
    /// session), stopping any resync and rejoin first. Returns the logouts that failed.
    pub async fn logout(&self) -> Vec<(String, Error)> {
        self.inner.closing.store(true, Ordering::Release);
        let mut failed = Vec::new();
        // A clean stop: the regions no write is in flight on leave the write-intent record,
        // so that the next start copies nothing it need not.
        if self.inner.bitmap.is_some() {
            self.inner.regions.settle();
            if let Err(e) = self.record().await {
                tracing::warn!(error = %e, "the mirror's record cannot be saved at logout; the next start copies the regions it names as being written");
            }
        }
        for l in self.members().into_iter().flatten() {
            if let Err(e) = l.session().logout().await {
                failed.push((l.session().url().to_string(), e));
            }
        }
        failed
    }

    /// Copies member `m`'s dirty regions from a live member, one region at a time, each held
    /// against writes while it is copied. Returns the bytes copied.
    async fn resync(&self, m: usize) -> Result<u64, ResyncError> {
        let member = &self.inner.members[m];
        let region = self.region_blocks();
        let bs = u64::from(self.block_size());
        let mut copied = 0;
        let dirty: u64 = self.member_states()[m].dirty_bytes;
        tracing::info!(member = m, url = %member.name, dirty, "mirror member {m} is back; copying the regions it missed");
        let t0 = tokio::time::Instant::now();
        let mut saved = t0;
        loop {
            let Some(r) = member.health.next_dirty() else {
                // Clean on record too, so that a restart does not copy it all again.
                self.record().await.map_err(ResyncError::Record)?;
                return Ok(copied);
            };
            let began = tokio::time::Instant::now();
            let users_before = self.inner.user_ops.load(Ordering::Relaxed);
            {
                let _copy = self.inner.regions.exclusive(r).await;
                let lba = r * region;
                let n = region.min(self.inner.cap.blocks.saturating_sub(lba));
                let src = (0..self.inner.members.len())
                    .find(|&i| i != m && self.inner.members[i].state() == State::Active)
                    .ok_or(ResyncError::Source {
                        src: m,
                        error: Error::Closed,
                        copied,
                    })?;
                let step = (COPY_BYTES / bs).max(1);
                let mut at = 0;
                while at < n {
                    let k = step.min(n - at);
                    let data = match self.inner.members[src].open_lun() {
                        Ok(l) => l.read(lba + at, k as u32).await,
                        Err(e) => Err(e),
                    }
                    .map_err(|error| ResyncError::Source {
                        src,
                        error,
                        copied,
                    })?;
                    member
                        .open_lun()
                        .map_err(ResyncError::Target)?
                        .write(lba + at, data)
                        .await
                        .map_err(ResyncError::Target)?;
                    copied += k * bs;
                    at += k;
                }
                member.health.copied(r);
            }
            if saved.elapsed() >= RESYNC_SAVE_PERIOD {
                self.record().await.map_err(ResyncError::Record)?;
                saved = tokio::time::Instant::now();
            }
            // Pacing: while the volume's users have commands going, the copy takes at most
            // half the time (it waits as long as its last region took), and never more than
            // the spec's resync_rate.
            let took = began.elapsed();
            let users = self.inner.user_ops.load(Ordering::Relaxed);
            let mut wait = if users > 0 || users_before > 0 {
                took
            } else {
                std::time::Duration::ZERO
            };
            if let Some(rate) = self.inner.resync_rate {
                let due = std::time::Duration::from_secs_f64(copied as f64 / rate as f64);
                wait = wait.max(due.saturating_sub(t0.elapsed()));
            }
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
        }
    }

    /// Saves what each member missed, and the regions being written, to the bitmap file, if
    /// there is one; durable on return.
    async fn record(&self) -> Result<(), Error> {
        self.save_record(None).await
    }

    /// As [`Volume::record`], unless a save of write-intent generation `generation` or later is
    /// on file already.
    async fn record_upto(&self, generation: u64) -> Result<(), Error> {
        self.save_record(Some(generation)).await
    }

    async fn save_record(&self, upto: Option<u64>) -> Result<(), Error> {
        let Some(file) = &self.inner.bitmap else {
            return Ok(());
        };
        file.save(upto, || {
            let (writing, generation) = self.inner.regions.intent();
            Snapshot {
                dirty: self.inner.members.iter().map(|m| m.health.bits()).collect(),
                writing,
                generation,
            }
        })
        .await
    }

    /// Every [`INTENT_SWEEP`], lets go of the regions no write touched since the last sweep
    /// and saves the record without them; ends with the volume.
    async fn sweep_intent(inner: std::sync::Weak<Inner>) {
        loop {
            tokio::time::sleep(INTENT_SWEEP).await;
            let Some(inner) = inner.upgrade() else { return };
            if inner.closing.load(Ordering::Acquire) {
                return;
            }
            if inner.regions.sweep() {
                let v = Volume { inner };
                if let Err(e) = v.record().await {
                    tracing::warn!(error = %e, "the mirror's write-intent record cannot be saved; its regions stay named until the next sweep");
                }
            }
        }
    }

    /// Counts a command of the volume's users until the guard drops.
    fn user_op(&self) -> UserOp<'_> {
        self.inner.user_ops.fetch_add(1, Ordering::Relaxed);
        UserOp(&self.inner.user_ops)
    }

    fn live_members(&self) -> usize {
        self.inner
            .members
            .iter()
            .filter(|m| m.state() == State::Active)
            .count()
    }

    /// Each member's state: failed or not, and how much it missed.
    pub fn member_states(&self) -> Vec<MemberState> {
        self.inner
            .members
            .iter()
            .map(|m| {
                let regions = m.health.dirty_regions();
                MemberState {
                    url: m.name.clone(),
                    failed: m.state() != State::Active,
                    dirty_bytes: regions * self.inner.region_bytes,
                }
            })
            .collect()
    }

    /// The live member a mirror's read of `bytes` goes to ([`MirrorReads`]).
    /// Only members that hold regions `span` are candidates ([`Volume::holds`]), and never
    /// `besides`.
    fn reader(&self, bytes: u64, span: (u64, u64), besides: Option<usize>) -> Option<usize> {
        let can = |i: usize| Some(i) != besides && self.holds(i, span);
        if self.inner.reads == MirrorReads::Soonest {
            self.remeasure_neglected();
            let mut best: Option<(usize, std::time::Duration)> = None;
            let mut unmeasured = false;
            for (i, m) in self.inner.members.iter().enumerate() {
                if !can(i) {
                    continue;
                }
                match m.lun().and_then(|l| l.session().expected_completion(bytes)) {
                    Some(eta) if best.is_none_or(|(_, b)| eta < b) => best = Some((i, eta)),
                    Some(_) => {}
                    None => unmeasured = true,
                }
            }
            // A member not measured yet: the least busy, so that it gets measured.
            if let (Some((i, _)), false) = (best, unmeasured) {
                return Some(i);
            }
        }
        self.inner
            .members
            .iter()
            .enumerate()
            .filter(|&(i, _)| can(i))
            .min_by_key(|(_, m)| m.busy.load(Ordering::Relaxed))
            .map(|(i, _)| i)
    }

    /// Once a [`REMEASURE_US`], has every live member that got less than half its
    /// even share of the reads measured afresh ([`crate::Session::remeasure`]). A member's rate
    /// is measured at the load it is given: one that was slow for a moment (a cold cache, a
    /// busy host) and so was given a read at a time shows the rate of one read at a time,
    /// which keeps it at one read at a time for good when it is as fast as the others. Costed
    /// by what TCP reports instead, it takes reads until it is measured at a load like theirs;
    /// a member that is really slower is measured slow again within a few reads.
    fn remeasure_neglected(&self) {
        let now = self.inner.epoch.elapsed().as_micros() as u64;
        if !overdue(&self.inner.window, now, REMEASURE_US) {
            return;
        }
        let members = &self.inner.members;
        let counts: Vec<u64> = members
            .iter()
            .map(|m| m.picked.swap(0, Ordering::Relaxed))
            .collect();
        let live: Vec<usize> = (0..members.len())
            .filter(|&i| members[i].state() == State::Active)
            .collect();
        let total: u64 = live.iter().map(|&i| counts[i]).sum();
        for &i in &live {
            if counts[i] * 2 * (live.len() as u64) < total {
                if let Some(l) = members[i].lun() {
                    tracing::debug!(
                        member = i,
                        reads = counts[i],
                        of = total,
                        "volume member given few reads: its rate is measured afresh"
                    );
                    l.session().remeasure();
                }
            }
        }
    }

    /// Whether member `m` holds every write to regions `span`: a live member does, a member
    /// catching up does for the regions it did not miss (it has taken every write since it came
    /// back, and a region it missed stays marked until it is copied), a failed one does not.
    fn holds(&self, m: usize, (first, last): (u64, u64)) -> bool {
        self.inner.members[m].health.holds(first, last)
    }

    fn member_error(&self, m: usize, e: Error) -> Error {
        let name = self.inner.members.get(m).map_or("?", |x| x.name.as_str());
        tracing::warn!(member = m, url = name, error = %e, "volume member failed a command");
        e
    }
}

/// How often [`MirrorReads::Soonest`] looks for members it neglects
/// ([`Volume::remeasure_neglected`]), in microseconds.
const REMEASURE_US: u64 = 1_000_000;

/// Whether `last` (microseconds) is at least `idle` before `now`, and if so moves it to `now`:
/// of the readers that find it overdue at once, exactly one is told so.
fn overdue(last: &AtomicU64, now: u64, idle: u64) -> bool {
    let seen = last.load(Ordering::Relaxed);
    now.saturating_sub(seen) >= idle
        && last
            .compare_exchange(seen, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// A LUN or a volume: what a tool that moves blocks reads and writes.
#[derive(Debug, Clone)]
pub enum Device {
    Lun(Lun),
    Volume(Volume),
}

impl Device {
    pub fn geometry(&self) -> Capacity {
        match self {
            Device::Lun(l) => l.geometry(),
            Device::Volume(v) => v.geometry(),
        }
    }

    pub fn block_size(&self) -> u32 {
        self.geometry().block_size
    }

    /// The sessions under it: one for a LUN, one per member for a volume.
    pub fn sessions(&self) -> Vec<crate::session::Session> {
        match self {
            Device::Lun(l) => vec![l.session().clone()],
            Device::Volume(v) => v
                .members()
                .iter()
                .flatten()
                .map(|l| l.session().clone())
                .collect(),
        }
    }

    /// Logs out of the sessions under it (a volume's current ones, its resync stopped first).
    /// Returns the logouts that failed, with each session's URL.
    pub async fn logout(&self) -> Vec<(String, Error)> {
        match self {
            Device::Lun(l) => match l.session().logout().await {
                Ok(()) => Vec::new(),
                Err(e) => vec![(l.session().url().to_string(), e)],
            },
            Device::Volume(v) => v.logout().await,
        }
    }

    /// "LUN n" or "the volume", for messages.
    pub fn describe(&self) -> String {
        match self {
            Device::Lun(l) => format!("LUN {}", l.number()),
            Device::Volume(_) => "the volume".to_string(),
        }
    }

    pub async fn read(&self, lba: u64, blocks: u32) -> Result<Bytes, Error> {
        match self {
            Device::Lun(l) => l.read(lba, blocks).await,
            Device::Volume(v) => v.read(lba, blocks).await,
        }
    }

    pub async fn write(&self, lba: u64, data: Bytes) -> Result<(), Error> {
        match self {
            Device::Lun(l) => l.write(lba, data).await,
            Device::Volume(v) => v.write(lba, data).await,
        }
    }

    pub async fn write_fua(&self, lba: u64, data: Bytes, fua: bool) -> Result<(), Error> {
        match self {
            Device::Lun(l) => l.write_fua(lba, data, fua).await,
            Device::Volume(v) => v.write_fua(lba, data, fua).await,
        }
    }

    pub async fn flush(&self) -> Result<(), Error> {
        match self {
            Device::Lun(l) => l.flush().await,
            Device::Volume(v) => v.flush().await,
        }
    }

    pub async fn unmap(&self, lba: u64, blocks: u64) -> Result<(), Error> {
        match self {
            Device::Lun(l) => l.unmap(lba, blocks).await,
            Device::Volume(v) => v.unmap(lba, blocks).await,
        }
    }

    pub async fn write_zeroes(
        &self,
        lba: u64,
        blocks: u64,
        unmap: bool,
        max_per_command: u64,
    ) -> Result<(), Error> {
        match self {
            Device::Lun(l) => l.write_zeroes(lba, blocks, unmap, max_per_command).await,
            Device::Volume(v) => v.write_zeroes(lba, blocks, unmap, max_per_command).await,
        }
    }

    pub async fn capabilities(&self) -> Result<Capabilities, Error> {
        match self {
            Device::Lun(l) => l.capabilities().await,
            Device::Volume(v) => v.capabilities().await,
        }
    }
}

/// The bytes of extent `e` gathered from the request's buffer (one slice when it is one piece).
fn gather(data: &Bytes, e: &Extent, bs: u64) -> Bytes {
    if let [(at, _, n)] = e.pieces.as_slice() {
        return data.slice((at * bs) as usize..((at + n) * bs) as usize);
    }
    let mut out = BytesMut::with_capacity((e.blocks * bs) as usize);
    for &(at, _, n) in &e.pieces {
        out.extend_from_slice(&data[(at * bs) as usize..((at + n) * bs) as usize]);
    }
    out.freeze()
}

/// Runs the futures at once and returns their results in order, or the first error.
async fn futures_join<T, F>(futs: impl Iterator<Item = F>) -> Result<Vec<T>, Error>
where
    F: std::future::Future<Output = Result<T, Error>>,
{
    futures_util::future::try_join_all(futs).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(chunk_blocks: u64, members: usize) -> Stripe {
        Stripe {
            chunk_blocks,
            members,
        }
    }

    /// Readers that find the volume's members due a look at the same moment: exactly one of
    /// them looks, and the next look is due a whole interval later.
    #[test]
    fn an_overdue_member_is_measured_again_once() {
        let last = std::sync::Arc::new(AtomicU64::new(0));
        assert!(!overdue(&last, 999_999, 1_000_000), "not yet a second");
        let start = std::sync::Arc::new(std::sync::Barrier::new(8));
        let told: usize = (0..8)
            .map(|_| {
                let (last, start) = (last.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    usize::from(overdue(&last, 1_000_000, 1_000_000))
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(told, 1);
        assert_eq!(last.load(Ordering::Relaxed), 1_000_000);
        assert!(!overdue(&last, 1_999_999, 1_000_000));
        assert!(overdue(&last, 2_000_000, 1_000_000));
    }

    #[test]
    fn blocks_go_to_members_chunk_by_chunk() {
        let st = s(4, 2);
        assert_eq!(st.locate(0), (0, 0));
        assert_eq!(st.locate(3), (0, 3));
        assert_eq!(st.locate(4), (1, 0));
        assert_eq!(st.locate(8), (0, 4));
        assert_eq!(st.locate(13), (1, 5));
    }

    #[test]
    fn a_request_splits_at_chunk_edges_and_merges_per_member() {
        let st = s(4, 2);
        // Blocks 2..14: member 0 has 2..4 and 8..12 (its 2..4 and 4..8: one run), member 1
        // has 4..8 and 12..14 (its 0..4 and 4..6: one run).
        let e = st.split(2, 12);
        assert_eq!(
            e,
            vec![
                Extent {
                    member: 0,
                    lba: 2,
                    blocks: 6,
                    pieces: vec![(0, 0, 2), (6, 2, 4)],
                },
                Extent {
                    member: 1,
                    lba: 0,
                    blocks: 6,
                    pieces: vec![(2, 0, 4), (10, 4, 2)],
                },
            ]
        );
    }

    #[test]
    fn every_block_is_placed_once_and_back() {
        for members in 2..5 {
            for chunk in [1u64, 3, 8] {
                let st = s(chunk, members);
                for lba in 0..40 {
                    for blocks in 1..30 {
                        let ex = st.split(lba, blocks);
                        let mut seen = vec![false; blocks as usize];
                        for e in &ex {
                            let mut in_run = 0;
                            for &(at, off, n) in &e.pieces {
                                assert_eq!(off, in_run, "pieces fill the run in order");
                                in_run += n;
                                for k in 0..n {
                                    let (m, l) = st.locate(lba + at + k);
                                    assert_eq!((m, l), (e.member, e.lba + off + k));
                                    assert!(!seen[(at + k) as usize]);
                                    seen[(at + k) as usize] = true;
                                }
                            }
                            assert_eq!(in_run, e.blocks);
                        }
                        assert!(seen.iter().all(|&x| x));
                    }
                }
            }
        }
    }

    #[test]
    fn regions_grow_so_that_a_record_stays_small_whatever_size_a_target_reports() {
        assert_eq!(region_bytes(16 << 20), 1 << 20);
        assert_eq!(region_bytes(1 << 40), 1 << 20);
        assert_eq!(region_bytes((1 << 40) + 1), 2 << 20);
        for bytes in [1u64 << 50, u64::MAX] {
            let r = region_bytes(bytes);
            assert!(
                bytes.div_ceil(r) <= MAX_REGIONS,
                "{bytes} bytes in regions of {r}"
            );
        }
    }

    #[test]
    fn gathered_pieces_keep_their_order() {
        let data = Bytes::from((0u8..16).collect::<Vec<_>>());
        let e = Extent {
            member: 0,
            lba: 0,
            blocks: 3,
            pieces: vec![(0, 0, 1), (2, 1, 2)],
        };
        assert_eq!(
            &gather(&data, &e, 4)[..],
            &[0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]
        );
    }
}
