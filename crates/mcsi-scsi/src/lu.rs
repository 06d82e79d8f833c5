//! One logical unit: SPC-4/SBC-3 command handling over a [`Backend`].

use crate::backend::{Backend, BackendError, SharedState};
use crate::pr::{Access, PrError, PrState};
use crate::sense::{asc, key, Sense};
use crate::{status, Command, DataPhase, LuConfig, Nexus, Outcome};
use bytes::Bytes;
// Nexus sets and maps are consulted on every command: aHash (randomly keyed like SipHash, several
// times cheaper on the nexus's two port names).
use ahash::{AHashMap, AHashSet};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

mod aio;
mod sanitize;
mod xcopy;

pub use aio::{Pending, Prepared, Step};

/// Operation codes handled here.
pub(crate) mod op {
    pub const TEST_UNIT_READY: u8 = 0x00;
    pub const REQUEST_SENSE: u8 = 0x03;
    pub const READ_6: u8 = 0x08;
    pub const WRITE_6: u8 = 0x0A;
    pub const INQUIRY: u8 = 0x12;
    pub const MODE_SELECT_6: u8 = 0x15;
    pub const RESERVE_6: u8 = 0x16;
    pub const RELEASE_6: u8 = 0x17;
    pub const MODE_SENSE_6: u8 = 0x1A;
    pub const START_STOP_UNIT: u8 = 0x1B;
    pub const PREVENT_ALLOW: u8 = 0x1E;
    pub const READ_CAPACITY_10: u8 = 0x25;
    pub const READ_10: u8 = 0x28;
    pub const WRITE_10: u8 = 0x2A;
    pub const WRITE_VERIFY_10: u8 = 0x2E;
    pub const VERIFY_10: u8 = 0x2F;
    pub const PRE_FETCH_10: u8 = 0x34;
    pub const READ_DEFECT_DATA_10: u8 = 0x37;
    pub const READ_DEFECT_DATA_12: u8 = 0xB7;
    pub const SYNCHRONIZE_CACHE_10: u8 = 0x35;
    pub const WRITE_SAME_10: u8 = 0x41;
    pub const UNMAP: u8 = 0x42;
    pub const MODE_SELECT_10: u8 = 0x55;
    pub const RESERVE_10: u8 = 0x56;
    pub const RELEASE_10: u8 = 0x57;
    pub const MODE_SENSE_10: u8 = 0x5A;
    pub const SANITIZE: u8 = 0x48;
    pub const PERSISTENT_RESERVE_IN: u8 = 0x5E;
    pub const PERSISTENT_RESERVE_OUT: u8 = 0x5F;
    pub const EXTENDED_COPY: u8 = 0x83;
    pub const RECEIVE_COPY_RESULTS: u8 = 0x84;
    pub const READ_16: u8 = 0x88;
    pub const COMPARE_AND_WRITE: u8 = 0x89;
    pub const ORWRITE_16: u8 = 0x8B;
    pub const WRITE_16: u8 = 0x8A;
    pub const WRITE_VERIFY_16: u8 = 0x8E;
    pub const VERIFY_16: u8 = 0x8F;
    pub const PRE_FETCH_16: u8 = 0x90;
    pub const SYNCHRONIZE_CACHE_16: u8 = 0x91;
    pub const WRITE_SAME_16: u8 = 0x93;
    pub const WRITE_ATOMIC_16: u8 = 0x9C;
    pub const SERVICE_ACTION_IN_16: u8 = 0x9E;
    pub const REPORT_LUNS: u8 = 0xA0;
    pub const MAINTENANCE_IN: u8 = 0xA3;
    pub const MAINTENANCE_OUT: u8 = 0xA4;
    pub const LOG_SELECT: u8 = 0x4C;
    pub const LOG_SENSE: u8 = 0x4D;
    pub const RECEIVE_DIAGNOSTIC_RESULTS: u8 = 0x1C;
    pub const SEND_DIAGNOSTIC: u8 = 0x1D;
    pub const READ_12: u8 = 0xA8;
    pub const WRITE_12: u8 = 0xAA;
    pub const WRITE_VERIFY_12: u8 = 0xAE;
    pub const VERIFY_12: u8 = 0xAF;
    // Service actions.
    pub const SA_READ_CAPACITY_16: u8 = 0x10;
    pub const SA_GET_LBA_STATUS: u8 = 0x12;
    pub const SA_REPORT_SUPPORTED_OPCODES: u8 = 0x0C;
    pub const SA_REPORT_SUPPORTED_TMF: u8 = 0x0D;
    pub const SA_REPORT_TARGET_PORT_GROUPS: u8 = 0x0A;
    /// MAINTENANCE OUT's SET TARGET PORT GROUPS.
    pub const SA_SET_TARGET_PORT_GROUPS: u8 = 0x0A;
}

/// Limits advertised in the Block Limits VPD page (SBC-3 6.5.3) and enforced.
const MAX_TRANSFER_BYTES: u64 = 8 << 20;
const MAX_UNMAP_LBA_COUNT: u32 = 1 << 20;
const MAX_UNMAP_DESCRIPTORS: u32 = 256;
// Below 65536 so that a WRITE SAME(16) the size of a 16-bit length never needs a larger
// data transfer than MAX_TRANSFER_BYTES to set up or check.
/// MAXIMUM WRITE SAME LENGTH, in blocks: one command stays bounded. NUMBER OF LOGICAL BLOCKS
/// zero ("to the end of the medium") is served when the end is within it.
const MAX_WRITE_SAME_BLOCKS: u64 = 0xFFFF;
const MAX_COMPARE_AND_WRITE_BLOCKS: u8 = 255;

/// Why a command did not complete with GOOD.
pub(crate) enum Fail {
    Sense(Sense),
    Status(u8),
}

impl From<Sense> for Fail {
    fn from(s: Sense) -> Self {
        Fail::Sense(s)
    }
}

pub(crate) type Res = Result<Outcome, Fail>;

fn illegal(code: (u8, u8)) -> Fail {
    Fail::Sense(Sense::new(key::ILLEGAL_REQUEST, code))
}

pub(crate) fn bad_cdb(byte: u16, bit: Option<u8>) -> Fail {
    Fail::Sense(Sense::invalid_cdb_field(byte, bit))
}

fn lba_oor() -> Fail {
    illegal(asc::LBA_OUT_OF_RANGE)
}

/// A CDB copied into a zero-padded array so that field access cannot run off the end.
pub(crate) struct Cdb([u8; 32]);

impl Cdb {
    pub(crate) fn new(raw: &[u8]) -> Self {
        let mut b = [0u8; 32];
        let n = raw.len().min(32);
        b[..n].copy_from_slice(&raw[..n]);
        Cdb(b)
    }
    pub(crate) fn b(&self, i: usize) -> u8 {
        self.0[i]
    }
    fn u16(&self, i: usize) -> u16 {
        u16::from_be_bytes([self.0[i], self.0[i + 1]])
    }
    fn u24(&self, i: usize) -> u32 {
        u32::from_be_bytes([0, self.0[i], self.0[i + 1], self.0[i + 2]])
    }
    pub(crate) fn u32(&self, i: usize) -> u32 {
        u32::from_be_bytes([self.0[i], self.0[i + 1], self.0[i + 2], self.0[i + 3]])
    }
    fn u64(&self, i: usize) -> u64 {
        let mut v = [0u8; 8];
        v.copy_from_slice(&self.0[i..i + 8]);
        u64::from_be_bytes(v)
    }
    pub(crate) fn op(&self) -> u8 {
        self.0[0]
    }
    fn sa(&self) -> u8 {
        self.0[1] & 0x1F
    }
    /// Length of the CDB from its group code (SPC-4 4.2.5.1).
    fn len(&self) -> usize {
        match self.0[0] >> 5 {
            0 => 6,
            1 | 2 => 10,
            4 => 16,
            5 => 12,
            _ => 16,
        }
    }
    fn control(&self) -> u8 {
        self.0[self.len() - 1]
    }
}

/// LBA, block count and byte-1 flags of a read/write-style CDB (SBC-3 5.x).
#[derive(Debug, Clone, Copy)]
struct Rw {
    lba: u64,
    nlb: u64,
    flags: u8,
}

fn rw_fields(c: &Cdb) -> Option<Rw> {
    let o = c.op();
    let r = match o {
        op::READ_6 | op::WRITE_6 => {
            let n = c.b(4) as u64;
            Rw {
                lba: (c.u24(1) & 0x1F_FFFF) as u64,
                // A transfer length of 0 means 256 blocks (SBC-3 5.13).
                nlb: if n == 0 { 256 } else { n },
                flags: 0,
            }
        }
        op::READ_10
        | op::WRITE_10
        | op::WRITE_VERIFY_10
        | op::VERIFY_10
        | op::PRE_FETCH_10
        | op::SYNCHRONIZE_CACHE_10
        | op::WRITE_SAME_10 => Rw {
            lba: c.u32(2) as u64,
            nlb: c.u16(7) as u64,
            flags: c.b(1),
        },
        op::READ_12 | op::WRITE_12 | op::WRITE_VERIFY_12 | op::VERIFY_12 => Rw {
            lba: c.u32(2) as u64,
            nlb: c.u32(6) as u64,
            flags: c.b(1),
        },
        op::READ_16
        | op::WRITE_16
        | op::ORWRITE_16
        | op::WRITE_VERIFY_16
        | op::VERIFY_16
        | op::PRE_FETCH_16
        | op::SYNCHRONIZE_CACHE_16
        | op::WRITE_SAME_16 => Rw {
            lba: c.u64(2),
            nlb: c.u32(10) as u64,
            flags: c.b(1),
        },
        op::COMPARE_AND_WRITE => Rw {
            lba: c.u64(2),
            nlb: c.b(13) as u64,
            flags: c.b(1),
        },
        // SBC-4 5.48: ATOMIC BOUNDARY in bytes 10-11, a two-byte TRANSFER LENGTH in 12-13.
        op::WRITE_ATOMIC_16 => Rw {
            lba: c.u64(2),
            nlb: c.u16(12) as u64,
            flags: c.b(1),
        },
        _ => return None,
    };
    Some(r)
}

/// Mode parameters that MODE SELECT may change.
#[derive(Debug, Clone, Copy)]
struct ModeState {
    wce: bool,
    d_sense: bool,
    swp: bool,
}

struct State {
    /// Nexuses that have been told about the power-on (SAM-5 6.3.2).
    seen: AHashSet<Nexus>,
    ua: AHashMap<Nexus, VecDeque<Sense>>,
    pr: PrState,
    /// With reservations shared by gateways: the announcements heard when `pr` was read.
    pr_heard: u64,
    /// SPC-2 RESERVE(6)/(10) holder.
    spc2: Option<Nexus>,
    mode: ModeState,
    prevent: AHashSet<Nexus>,
    /// EXTENDED COPY results held for RECEIVE COPY RESULTS, bounded.
    copies: VecDeque<xcopy::CopyRecord>,
    /// Target port groups and their access states as served (none: no ALUA, TPGS 0): the
    /// configured groups, with the states stored with the data where it is shared.
    alua: Option<Arc<crate::alua::Alua>>,
    /// The groups as configured ([`LogicalUnit::set_alua`]).
    alua_config: Option<Arc<crate::alua::Alua>>,
    /// Groups whose state changed since the unit began, and who changed it (the STATUS CODE in
    /// their descriptor).
    alua_changed: Vec<(u16, crate::alua::ChangedBy)>,
    /// With port group states shared by gateways: the announcements heard when they were read
    /// (u64::MAX: read them again before the next command).
    alua_heard: u64,
    /// Whether the shared port group states are watched yet.
    alua_watched: bool,
}

impl Drop for LogicalUnit {
    fn drop(&mut self) {
        // A sanitize still running stops with the unit rather than outlive it.
        let _ = self.stop_background();
    }
}

/// Byte ranges held by writers, so that COMPARE AND WRITE is atomic w.r.t. other writes.
#[derive(Default)]
struct RangeLocks {
    held: Mutex<Vec<(u64, u64)>>,
    cv: Condvar,
}

struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    range: (u64, u64),
}

impl RangeLocks {
    fn held(&self) -> MutexGuard<'_, Vec<(u64, u64)>> {
        match self.held.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Takes `[start, end)` when no holder overlaps it; false (and nothing taken) otherwise.
    /// The caller lets it go with [`RangeLocks::unlock`].
    fn try_lock(&self, start: u64, end: u64) -> bool {
        let mut held = self.held();
        if held.iter().any(|&(s, e)| s < end && start < e) {
            return false;
        }
        held.push((start, end));
        true
    }

    fn unlock(&self, range: (u64, u64)) {
        let mut held = self.held();
        if let Some(i) = held.iter().position(|r| *r == range) {
            held.swap_remove(i);
        }
        drop(held);
        self.cv.notify_all();
    }

    fn lock(&self, start: u64, end: u64) -> RangeGuard<'_> {
        let mut held = self.held();
        while held.iter().any(|&(s, e)| s < end && start < e) {
            held = match self.cv.wait(held) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
        held.push((start, end));
        RangeGuard {
            locks: self,
            range: (start, end),
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.locks.unlock(self.range);
    }
}

/// A WRITE ATOMIC(16) under way, counted from before it takes its range lock until after it
/// lets it go.
struct AtomicWrite<'a>(&'a LogicalUnit);

impl<'a> AtomicWrite<'a> {
    fn begin(lu: &'a LogicalUnit) -> Self {
        lu.atomic_active.fetch_add(1, Ordering::SeqCst);
        lu.atomic_started.fetch_add(1, Ordering::SeqCst);
        AtomicWrite(lu)
    }
}

impl Drop for AtomicWrite<'_> {
    fn drop(&mut self) {
        self.0.atomic_active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A SCSI block device (peripheral device type 0). Send + Sync: commands may run concurrently
/// from many threads; the state lock is never held across backend I/O.
pub struct LogicalUnit {
    backend: Arc<dyn Backend>,
    cfg: LuConfig,
    block_size: u64,
    /// Capacity in blocks; only grows ([`LogicalUnit::grow`]).
    blocks: AtomicU64,
    state: Mutex<State>,
    ranges: RangeLocks,
    /// WRITE ATOMIC(16)s under way, and how many have started: a read that saw none of them
    /// overlap it in time needs no lock; otherwise it reads again under the range lock, which
    /// an atomic write holds for all of its blocks (a read never sees one half written).
    atomic_active: AtomicUsize,
    atomic_started: AtomicU64,
    /// A SANITIZE under way, or the failure mode one left.
    sanitize: Mutex<sanitize::SanitizeState>,
    /// Whether `sanitize` holds either, so that commands take its lock only then.
    sanitize_pending: std::sync::atomic::AtomicBool,
    /// The EXTENDED COPY this unit's copy manager runs (TOTAL CONCURRENT COPIES is 1): its
    /// nexus, and the flag that stops it at its next chunk.
    copy: Mutex<Option<(Nexus, Arc<std::sync::atomic::AtomicBool>)>>,
    /// With reservations shared by gateways ([`Backend::shared_reservations`]): the other
    /// gateways' announcements heard so far; a command that finds more than its unit had when
    /// it read the reservations reads them again first.
    pr_heard: Arc<AtomicU64>,
    /// The same for the port group states ([`Backend::shared_port_groups`]).
    alua_heard: Arc<AtomicU64>,
}

impl LogicalUnit {
    /// A logical unit over `backend`. The capacity is the backend size rounded down to whole
    /// blocks; a block size that is zero or not a multiple of 512 is replaced by 512.
    pub fn new(backend: Arc<dyn Backend>, cfg: LuConfig) -> Self {
        let bs = if cfg.block_size >= 512
            && cfg.block_size.is_multiple_of(512)
            && cfg.block_size <= 65536
        {
            cfg.block_size as u64
        } else {
            512
        };
        let blocks = backend.size() / bs;
        let ptpl_capable = cfg.pr_file.is_some() || backend.shared_reservations().is_some();
        let mode = ModeState {
            wce: cfg.write_cache,
            d_sense: false,
            swp: false,
        };
        LogicalUnit {
            backend,
            block_size: bs,
            blocks: AtomicU64::new(blocks),
            cfg,
            state: Mutex::new(State {
                seen: AHashSet::new(),
                ua: AHashMap::new(),
                pr: PrState::new(ptpl_capable),
                pr_heard: 0,
                spc2: None,
                mode,
                prevent: AHashSet::new(),
                copies: VecDeque::new(),
                alua: None,
                alua_config: None,
                alua_changed: Vec::new(),
                alua_heard: 0,
                alua_watched: false,
            }),
            ranges: RangeLocks::default(),
            atomic_active: AtomicUsize::new(0),
            atomic_started: AtomicU64::new(0),
            sanitize: Mutex::default(),
            sanitize_pending: std::sync::atomic::AtomicBool::new(false),
            copy: Mutex::new(None),
            pr_heard: Arc::new(AtomicU64::new(0)),
            alua_heard: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Reads the persistent reservations this unit persisted (`LuConfig::pr_file`) before it
    /// serves: true if there were any. A file that cannot be read is an error, as serving
    /// without the reservations initiators relied on would break their promise.
    ///
    /// With reservations shared by gateways ([`Backend::shared_reservations`]) they are read
    /// from there instead, and the unit starts hearing the other gateways' changes.
    pub fn load_reservations(&self) -> Result<bool, BackendError> {
        if let Some(sh) = self.backend.shared_reservations() {
            let heard = self.pr_heard.clone();
            sh.watch(Box::new(move || {
                heard.fetch_add(1, Ordering::AcqRel);
            }))?;
            let mut st = self.st();
            self.take_stored(sh, &mut st)?;
            return Ok(st.pr.active());
        }
        let Some(path) = &self.cfg.pr_file else {
            return Ok(false);
        };
        let loaded = PrState::load(path).map_err(|e| BackendError::Open {
            path: path.clone(),
            why: format!("persistent reservations: {e} (move the file away to start without them)"),
        })?;
        let mut st = self.st();
        match loaded {
            Some(pr) => {
                st.pr = pr;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The settings this unit was created with.
    pub fn config(&self) -> &LuConfig {
        &self.cfg
    }

    /// The storage behind this unit.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Capacity in logical blocks.
    pub fn blocks(&self) -> u64 {
        self.blocks.load(Ordering::Acquire)
    }

    /// Grows the unit's store to `size` bytes, or (None) takes the size the store has now
    /// (a file extended behind the target's back): `(old, new)` capacity in blocks. A unit that
    /// grew tells every nexus it has seen, with the unit attention CAPACITY DATA HAS CHANGED
    /// (SBC-3 4.10); commands see the new capacity from then on. It never shrinks.
    pub fn grow(&self, size: Option<u64>) -> Result<(u64, u64), BackendError> {
        let old = self.blocks();
        let bytes = self.backend.grow(size)?;
        let new = bytes / self.block_size;
        if new > old {
            self.blocks.fetch_max(new, Ordering::AcqRel);
            self.unit_attention_all(Sense::new(key::UNIT_ATTENTION, asc::CAPACITY_DATA_CHANGED));
        }
        Ok((old, self.blocks()))
    }

    /// Logical block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.block_size as u32
    }

    fn st(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn max_transfer_blocks(&self) -> u64 {
        MAX_TRANSFER_BYTES / self.block_size
    }

    /// Whether the CDB's data-out is a structure of fixed size rather than a range of blocks
    /// (WRITE SAME's one block, COMPARE AND WRITE's two halves): more data than that is an
    /// error, not a residual.
    pub fn data_out_fixed(&self, cdb: &[u8]) -> bool {
        matches!(
            Cdb::new(cdb).op(),
            op::WRITE_SAME_10 | op::WRITE_SAME_16 | op::COMPARE_AND_WRITE
        )
    }

    /// Data-out and data-in sizes the CDB asks for. Invalid CDBs give zeros; the command then
    /// fails in `execute` with the right sense.
    pub fn data_phase(&self, cdb: &[u8]) -> DataPhase {
        let c = Cdb::new(cdb);
        let bs = self.block_size;
        let cap = |v: u64| v.min(u32::MAX as u64) as u32;
        let mut out = 0u64;
        let mut inl = 0u64;
        match c.op() {
            op::READ_6 | op::READ_10 | op::READ_12 | op::READ_16 => {
                if let Some(r) = rw_fields(&c) {
                    inl = r.nlb * bs;
                }
            }
            op::WRITE_6
            | op::ORWRITE_16
            | op::WRITE_10
            | op::WRITE_12
            | op::WRITE_16
            | op::WRITE_ATOMIC_16
            | op::WRITE_VERIFY_10
            | op::WRITE_VERIFY_12
            | op::WRITE_VERIFY_16 => {
                if let Some(r) = rw_fields(&c) {
                    out = r.nlb * bs;
                }
            }
            op::VERIFY_10 | op::VERIFY_12 | op::VERIFY_16 => {
                if let Some(r) = rw_fields(&c) {
                    out = match (r.flags >> 1) & 3 {
                        1 => r.nlb * bs,
                        3 => bs,
                        _ => 0,
                    };
                }
            }
            op::WRITE_SAME_10 | op::WRITE_SAME_16 => {
                let ndob = c.op() == op::WRITE_SAME_16 && c.b(1) & 0x01 != 0;
                out = if ndob { 0 } else { bs };
            }
            op::COMPARE_AND_WRITE => {
                // NUMBER OF LOGICAL BLOCKS 0 carries no data. Ask for one byte anyway so that an
                // initiator that sent data (e.g. 256 blocks wrapped to 0 in the one-byte field)
                // is seen and refused in execute instead of silently succeeding.
                out = match c.b(13) {
                    0 => 1,
                    n => 2 * n as u64 * bs,
                }
            }
            op::UNMAP => out = c.u16(7) as u64,
            op::MODE_SELECT_6 => out = c.b(4) as u64,
            op::MODE_SELECT_10 => out = c.u16(7) as u64,
            op::PERSISTENT_RESERVE_OUT => out = c.u32(5) as u64,
            op::MAINTENANCE_OUT => out = c.u32(6) as u64,
            op::SANITIZE => out = c.u16(7) as u64,
            op::EXTENDED_COPY if c.u32(10) <= xcopy::MAX_PARAMETER_LIST => out = c.u32(10) as u64,
            op::RECEIVE_COPY_RESULTS => inl = c.u32(10) as u64,
            op::INQUIRY => inl = c.u16(3) as u64,
            op::REQUEST_SENSE | op::MODE_SENSE_6 => inl = c.b(4) as u64,
            op::MODE_SENSE_10 | op::PERSISTENT_RESERVE_IN => inl = c.u16(7) as u64,
            op::READ_CAPACITY_10 => inl = 8,
            op::READ_DEFECT_DATA_10 => inl = c.u16(7) as u64,
            op::READ_DEFECT_DATA_12 => inl = c.u32(6) as u64,
            op::SERVICE_ACTION_IN_16 => inl = c.u32(10) as u64,
            op::REPORT_LUNS | op::MAINTENANCE_IN => inl = c.u32(6) as u64,
            _ => {}
        }
        // Oversized transfers fail in execute; do not ask the transport to buffer them (a write
        // beyond the maximum transfer length is refused before any of its data is asked for).
        // An allocation length only caps what a command returns, so a large one stays: the
        // command still succeeds and its data must fit within the promise.
        let limit = MAX_TRANSFER_BYTES + bs;
        let out_limit = if c.op() == op::COMPARE_AND_WRITE {
            // The compare data and the write data, each up to the maximum.
            2 * limit
        } else {
            limit
        };
        if out > out_limit {
            out = 0;
        }
        let read = matches!(c.op(), op::READ_6 | op::READ_10 | op::READ_12 | op::READ_16);
        if read && inl > limit {
            inl = 0;
        }
        DataPhase {
            data_out_len: cap(out),
            data_in_len: cap(inl),
        }
    }

    /// Whether the command only waits for work the unit goes on with anyway (a SANITIZE
    /// without IMMED: the sanitize runs to its end whatever happens to the command), so that
    /// aborting it may end it at once.
    pub fn abort_ends_wait(&self, cdb: &[u8]) -> bool {
        let c = Cdb::new(cdb);
        c.op() == op::SANITIZE && c.b(1) & 0x80 == 0
    }

    /// Whether this CDB may wait for backend I/O, on the asynchronous path or a thread (so it
    /// is not run inline on the connection's reader).
    pub fn blocking(&self, cdb: &[u8]) -> bool {
        let c = Cdb::new(cdb);
        self.aio_kind(&c).is_some() || self.needs_thread_for(&c)
    }

    /// Whether [`LogicalUnit::execute`] of this CDB may block its thread on backend I/O (run it
    /// on a blocking pool).
    pub fn needs_thread(&self, cdb: &[u8]) -> bool {
        self.needs_thread_for(&Cdb::new(cdb))
    }

    fn needs_thread_for(&self, c: &Cdb) -> bool {
        // A copy may move up to a segment list's worth of data, between units of any kind; a
        // SANITIZE without IMMED waits for the whole sanitize.
        if matches!(c.op(), op::EXTENDED_COPY | op::SANITIZE) {
            return true;
        }
        if !self.backend.blocking() {
            return false;
        }
        if c.op() == op::SERVICE_ACTION_IN_16 && c.sa() == op::SA_READ_CAPACITY_16 {
            return false;
        }
        !matches!(
            c.op(),
            op::TEST_UNIT_READY
                | op::REQUEST_SENSE
                | op::INQUIRY
                | op::MODE_SENSE_6
                | op::MODE_SENSE_10
                | op::MODE_SELECT_6
                | op::MODE_SELECT_10
                | op::READ_CAPACITY_10
                | op::REPORT_LUNS
                | op::MAINTENANCE_IN
                | op::PERSISTENT_RESERVE_IN
                | op::PERSISTENT_RESERVE_OUT
                | op::RESERVE_6
                | op::RELEASE_6
                | op::RESERVE_10
                | op::RELEASE_10
                | op::PREVENT_ALLOW
                | op::READ_DEFECT_DATA_10
                | op::READ_DEFECT_DATA_12
                | op::RECEIVE_COPY_RESULTS
        )
    }

    /// Logical unit reset (SAM-5 6.3.3): unit attention 29/03 on every nexus, SPC-2
    /// reservation released; persistent reservations survive.
    pub fn reset(&self) {
        self.stop_copy(None);
        let mut st = self.st();
        st.spc2 = None;
        st.prevent.clear();
        let seen: Vec<Nexus> = st.seen.iter().cloned().collect();
        for n in seen {
            let q = st.ua.entry(n).or_default();
            q.clear();
            q.push_back(Sense::new(key::UNIT_ATTENTION, asc::BUS_DEVICE_RESET));
        }
    }

    /// A unit attention for every I_T nexus this unit has seen (a change of the target's
    /// inventory, of this unit's capacity).
    pub fn unit_attention_all(&self, s: Sense) {
        let mut st = self.st();
        let seen: Vec<Nexus> = st.seen.iter().cloned().collect();
        for n in &seen {
            push_ua(&mut st, n, s);
        }
    }

    /// Sets the target port groups and their configured states (None: no ALUA). A change of
    /// any group's state, or of the groups, tells every nexus this unit has seen with the unit
    /// attention ASYMMETRIC ACCESS STATE CHANGED (SPC-4 5.15.2.6); commands see the new states
    /// from then on. True if something changed.
    ///
    /// With port group states shared by gateways ([`Backend::shared_port_groups`]), the states
    /// stored there are served over the configured ones: a gateway that starts takes the states
    /// the others serve, and a group whose configured state this call changes (a reload) is
    /// stored and announced, so that every gateway serves it.
    pub fn set_alua(&self, next: Option<crate::alua::Alua>) -> bool {
        use crate::alua::ChangedBy;
        let mut st = self.st();
        if st.alua_config.as_deref() == next.as_ref() {
            return false;
        }
        let was = std::mem::replace(&mut st.alua_config, next.map(Arc::new));
        let (Some(sh), Some(config)) = (self.backend.shared_port_groups(), st.alua_config.clone())
        else {
            let served = st.alua_config.clone();
            return self.serve_alua(&mut st, served, |_| ChangedBy::Implicit, None);
        };
        if !st.alua_watched {
            let heard = self.alua_heard.clone();
            match sh.watch(Box::new(move || {
                heard.fetch_add(1, Ordering::AcqRel);
            })) {
                Ok(()) => st.alua_watched = true,
                Err(e) => {
                    tracing::warn!(backend = %self.backend.describe(), "{e}; the port group states are read before each command instead")
                }
            }
        }
        // The groups whose configured state changed: stored for every gateway.
        let changes: Vec<(u16, crate::alua::AccessState)> = match &was {
            Some(was) => config
                .groups()
                .iter()
                .filter(|g| was.group(g.id).is_some_and(|w| w.state != g.state))
                .map(|g| (g.id, g.state))
                .collect(),
            None => Vec::new(),
        };
        let mut announce = false;
        let mut left = None;
        if !changes.is_empty() {
            match self.store_alua(sh, &mut st, &changes, ChangedBy::Implicit) {
                Ok((stored, changed)) => {
                    announce = changed;
                    left = Some(stored);
                }
                Err(e) => {
                    tracing::error!(backend = %self.backend.describe(), "the configured port group states were not stored with the data, so the gateways keep serving the stored ones: {e}")
                }
            }
        }
        let read = match left {
            Some(stored) => Ok(stored),
            None => self.read_alua(sh, &mut st),
        };
        let (served, stored) = match read {
            Ok(stored) => (Some(Arc::new(config.with_stored(&stored))), Some(stored)),
            Err(e) => {
                tracing::warn!(backend = %self.backend.describe(), "the shared port group states were not read; the configured ones are served until they are: {e}");
                st.alua_heard = u64::MAX;
                (Some(config.clone()), None)
            }
        };
        let changed = self.serve_alua(&mut st, served, |_| ChangedBy::Implicit, None);
        if let Some(stored) = stored {
            changed_as_stored(&mut st, &stored);
        }
        drop(st);
        if announce {
            self.announce_alua(sh);
        }
        changed
    }

    /// The port group states this unit serves, where they are shared by the gateways of its
    /// data (None elsewhere: they are the configured ones): read again first if another gateway
    /// announced a change.
    pub fn shared_port_group_states(&self) -> Option<Vec<(u16, crate::alua::AccessState)>> {
        self.backend.shared_port_groups()?;
        let mut st = self.st();
        self.sync_alua(&mut st);
        st.alua
            .as_ref()
            .map(|a| a.groups().iter().map(|g| (g.id, g.state)).collect())
    }

    /// Serves `next` as the unit's groups and states: true if they differ from those served,
    /// and then a unit attention ASYMMETRIC ACCESS STATE CHANGED for every nexus seen but
    /// `except` (the nexus whose SET TARGET PORT GROUPS made the change, SPC-4 5.15.2.6).
    fn serve_alua(
        &self,
        st: &mut State,
        next: Option<Arc<crate::alua::Alua>>,
        by: impl Fn(u16) -> crate::alua::ChangedBy,
        except: Option<&Nexus>,
    ) -> bool {
        if st.alua == next {
            return false;
        }
        if let (Some(was), Some(now)) = (&st.alua, &next) {
            for id in was.changed_groups(now) {
                st.alua_changed.retain(|(g, _)| *g != id);
                st.alua_changed.push((id, by(id)));
            }
        } else {
            st.alua_changed.clear();
        }
        st.alua = next;
        let seen: Vec<Nexus> = st.seen.iter().cloned().collect();
        let s = Sense::new(key::UNIT_ATTENTION, asc::ASYMMETRIC_ACCESS_STATE_CHANGED);
        for n in seen.iter().filter(|n| Some(*n) != except) {
            push_ua(st, n, s);
        }
        true
    }

    /// Reads the shared port group states; the announcements heard are counted before the
    /// read, so that one arriving during it makes the next command read again.
    fn read_alua(
        &self,
        sh: &dyn SharedState,
        st: &mut State,
    ) -> Result<crate::alua::Stored, BackendError> {
        let heard = self.alua_heard.load(Ordering::Acquire);
        let (bytes, _) = sh.read()?;
        let stored = crate::alua::Stored::parse(&bytes).map_err(|e| BackendError::Shared(e.0))?;
        self.read_at(st, heard);
        Ok(stored)
    }

    /// The shared port group states were read when `heard` announcements had been heard;
    /// unwatched, every command reads them again.
    fn read_at(&self, st: &mut State, heard: u64) {
        st.alua_heard = if st.alua_watched { heard } else { u64::MAX };
    }

    /// Stores `changes` on the shared port group states as they are now (read, changed, and
    /// replaced at the version read; again when another gateway stored first, an error after
    /// 8 tries). The record as it now stands, and whether this changed it (and must announce
    /// it).
    fn store_alua(
        &self,
        sh: &dyn SharedState,
        st: &mut State,
        changes: &[(u16, crate::alua::AccessState)],
        by: crate::alua::ChangedBy,
    ) -> Result<(crate::alua::Stored, bool), BackendError> {
        for _ in 0..8 {
            let heard = self.alua_heard.load(Ordering::Acquire);
            let (bytes, version) = sh.read()?;
            let mut stored =
                crate::alua::Stored::parse(&bytes).map_err(|e| BackendError::Shared(e.0))?;
            let before = stored.clone();
            for &(id, state) in changes {
                stored.states.insert(id, (state, by));
            }
            // Groups the configuration no longer has go, so that renumbered groups cannot
            // grow the record past what it may hold.
            if let Some(config) = &st.alua_config {
                stored.states.retain(|id, _| config.group(*id).is_some());
            }
            if stored == before {
                self.read_at(st, heard);
                return Ok((stored, false));
            }
            if sh.replace(&stored.to_bytes(), version)? {
                // What this gateway read is current up to its own change.
                self.read_at(st, heard);
                return Ok((stored, true));
            }
        }
        Err(BackendError::Shared(
            "the shared port group states kept changing under 8 tries to store them".into(),
        ))
    }

    fn announce_alua(&self, sh: &dyn SharedState) {
        if let Err(e) = sh.announce() {
            tracing::warn!(backend = %self.backend.describe(), "port group states changed, and a gateway did not hear it in time (it reads them again when it next does): {e}");
        }
    }

    /// Reads the shared port group states again when another gateway announced a change since
    /// this unit last read them, and serves them (the command being admitted meets them).
    fn sync_alua(&self, st: &mut State) {
        let Some(sh) = self.backend.shared_port_groups() else {
            return;
        };
        if st.alua_heard != u64::MAX && self.alua_heard.load(Ordering::Acquire) == st.alua_heard {
            return;
        }
        let Some(config) = st.alua_config.clone() else {
            return;
        };
        match self.read_alua(sh, st) {
            Ok(stored) => {
                let next = Some(Arc::new(config.with_stored(&stored)));
                self.serve_alua(st, next, |_| crate::alua::ChangedBy::Implicit, None);
                changed_as_stored(st, &stored);
            }
            Err(e) => {
                tracing::warn!(backend = %self.backend.describe(), "shared port group states not read: {e}")
            }
        }
    }

    /// A unit attention for each of `nexuses` (whether or not this unit has seen them).
    pub fn unit_attention_for(&self, nexuses: &[Nexus], s: Sense) {
        if nexuses.is_empty() {
            return;
        }
        let mut st = self.st();
        for n in nexuses {
            push_ua(&mut st, n, s);
        }
    }

    /// The I_T nexuses this unit has seen.
    pub fn seen_nexuses(&self) -> Vec<Nexus> {
        self.st().seen.iter().cloned().collect()
    }

    /// Another I_T nexus's CLEAR TASK SET aborted tasks of `nexus` on this unit. With TAS 0
    /// (the control mode page's, always here) their statuses are not sent, so `nexus` is told
    /// with a unit attention, COMMANDS CLEARED BY ANOTHER INITIATOR (SAM-5 7.5, SPC-4 7.5.8).
    pub fn tasks_cleared_by_another(&self, nexus: &Nexus) {
        let mut st = self.st();
        push_ua(
            &mut st,
            nexus,
            Sense::new(
                key::UNIT_ATTENTION,
                asc::COMMANDS_CLEARED_BY_ANOTHER_INITIATOR,
            ),
        );
    }

    /// The I_T nexus ended: drop its SPC-2 reservation, prevent state and unit attentions.
    /// Persistent reservation registrations survive nexus loss (SPC-4 5.9.4).
    pub fn nexus_lost(&self, nexus: &Nexus) {
        self.stop_copy(Some(nexus));
        let mut st = self.st();
        if st.spc2.as_ref() == Some(nexus) {
            st.spc2 = None;
        }
        st.prevent.remove(nexus);
        st.ua.remove(nexus);
        st.seen.remove(nexus);
        st.copies.retain(|r| !r.belongs_to(nexus));
    }

    /// Stops background work (a SANITIZE under way stops at its next piece, and a command
    /// waiting for it ends); true if there was some.
    pub fn stop_background(&self) -> bool {
        let st = match self.sanitize.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        st.cancel()
    }

    /// Makes every completed write durable (used at shutdown).
    pub fn flush(&self) -> Result<(), BackendError> {
        self.backend.flush()
    }

    fn encode_sense(&self, s: &Sense) -> Bytes {
        let d = self.st().mode.d_sense;
        s.encode(d)
    }

    fn check(&self, s: &Sense) -> Outcome {
        Outcome {
            status: status::CHECK_CONDITION,
            sense: Some(self.encode_sense(s)),
            data_in: Bytes::new(),
            data_in_unread: 0,
        }
    }

    /// Runs one command. May block on backend I/O. EXTENDED COPY reaches only this unit; through
    /// [`crate::DeviceServer::execute`] it reaches every unit of the target.
    pub fn execute(&self, cmd: Command<'_>) -> Outcome {
        self.execute_in(cmd, &[])
    }

    /// Runs one command with the target's other units at hand (for EXTENDED COPY).
    pub(crate) fn execute_in(&self, cmd: Command<'_>, units: &[&LogicalUnit]) -> Outcome {
        let c = Cdb::new(cmd.cdb);
        if let Some(o) = self.admit(&cmd, &c) {
            return o;
        }
        let res = match c.op() {
            op::EXTENDED_COPY => self.extended_copy(&cmd, &c, units),
            _ => self.dispatch(&cmd, &c),
        };
        self.outcome(res)
    }

    fn outcome(&self, res: Res) -> Outcome {
        match res {
            Ok(o) => o,
            Err(Fail::Sense(s)) => self.check(&s),
            Err(Fail::Status(s)) => Outcome::status(s),
        }
    }

    /// What every command passes before its own handling: unit attentions, reservations, a
    /// sanitize under way, NACA. Some outcome when the command ends here.
    fn admit(&self, cmd: &Command<'_>, c: &Cdb) -> Option<Outcome> {
        let opc = c.op();
        // Unit attention and reservation checks (SAM-5 5.14, SPC-4 5.9.1, SPC-2 5.5.1).
        {
            let mut st = self.st();
            self.sync_shared(&mut st);
            self.sync_alua(&mut st);
            // A lookup before the insert: the common case (a known nexus) then costs one hash and
            // no clone.
            if !st.seen.contains(cmd.nexus) {
                st.seen.insert(cmd.nexus.clone());
                push_ua(
                    &mut st,
                    cmd.nexus,
                    Sense::new(key::UNIT_ATTENTION, asc::POWER_ON_RESET),
                );
            }
            if !matches!(opc, op::INQUIRY | op::REPORT_LUNS | op::REQUEST_SENSE) {
                if let Some(s) = pop_ua(&mut st, cmd.nexus) {
                    return Some(Outcome::check_as(&s, st.mode.d_sense));
                }
            }
            // A port in standby or unavailable refuses media access (SPC-4 5.15.2.4).
            if let Some(a) = &st.alua {
                let state = a.state_of(cmd.nexus.relative_port);
                if !crate::alua::allowed(state, opc, c.sa()) {
                    use crate::alua::AccessState;
                    let code = if state == AccessState::Standby {
                        asc::TARGET_PORT_IN_STANDBY_STATE
                    } else {
                        asc::TARGET_PORT_IN_UNAVAILABLE_STATE
                    };
                    let s = Sense::new(key::NOT_READY, code);
                    return Some(Outcome::check_as(&s, st.mode.d_sense));
                }
            }
            if self.conflicts(&st, cmd.nexus, c) {
                return Some(Outcome::status(status::RESERVATION_CONFLICT));
            }
        }
        // While a sanitize runs, or after one failed (SBC-4 4.33.3).
        if let Some(s) = self.sanitize_blocks(opc) {
            return Some(self.check(&s));
        }
        // NACA is not supported (SAM-5 5.10, SPC-4 4.2.5.5).
        if c.control() & 0x04 != 0 {
            return Some(self.check(&Sense::invalid_cdb_field(c.len() as u16 - 1, Some(2))));
        }
        None
    }

    fn access_of(c: &Cdb) -> Access {
        match c.op() {
            op::INQUIRY
            | op::REPORT_LUNS
            | op::REQUEST_SENSE
            | op::READ_CAPACITY_10
            | op::TEST_UNIT_READY
            | op::PERSISTENT_RESERVE_IN
            | op::PERSISTENT_RESERVE_OUT
            | op::MAINTENANCE_IN => Access::Always,
            op::SERVICE_ACTION_IN_16 if c.sa() == op::SA_READ_CAPACITY_16 => Access::Always,
            op::PREVENT_ALLOW if c.b(4) & 0x03 == 0 => Access::Always,
            op::READ_6
            | op::READ_10
            | op::READ_12
            | op::READ_16
            | op::VERIFY_10
            | op::VERIFY_12
            | op::VERIFY_16
            | op::PRE_FETCH_10
            | op::PRE_FETCH_16
            | op::MODE_SENSE_6
            | op::MODE_SENSE_10
            | op::READ_DEFECT_DATA_10
            | op::READ_DEFECT_DATA_12
            | op::RECEIVE_COPY_RESULTS
            | op::SERVICE_ACTION_IN_16 => Access::Read,
            _ => Access::Write,
        }
    }

    fn conflicts(&self, st: &State, n: &Nexus, c: &Cdb) -> bool {
        let opc = c.op();
        if let Some(holder) = &st.spc2 {
            if holder != n {
                // SPC-2 7.21/7.24: a RELEASE from another nexus is GOOD and does nothing;
                // INQUIRY, REPORT LUNS, REQUEST SENSE and READ CAPACITY stay allowed.
                let allowed = matches!(
                    opc,
                    op::INQUIRY
                        | op::REPORT_LUNS
                        | op::REQUEST_SENSE
                        | op::RELEASE_6
                        | op::RELEASE_10
                        | op::READ_CAPACITY_10
                ) || (opc == op::SERVICE_ACTION_IN_16
                    && c.sa() == op::SA_READ_CAPACITY_16)
                    || (opc == op::PREVENT_ALLOW && c.b(4) & 0x03 == 0);
                if !allowed {
                    return true;
                }
            }
        }
        if matches!(
            opc,
            op::RESERVE_6 | op::RELEASE_6 | op::RESERVE_10 | op::RELEASE_10
        ) {
            // SPC-4 5.9.1: RESERVE/RELEASE conflict with any persistent reservation.
            return st.pr.active();
        }
        st.pr.conflicts(n, Self::access_of(c))
    }

    fn dispatch(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        match c.op() {
            op::TEST_UNIT_READY => Ok(Outcome::good(Bytes::new())),
            op::REQUEST_SENSE => self.request_sense(cmd, c),
            op::INQUIRY => self.inquiry(cmd, c),
            op::READ_6 | op::READ_10 | op::READ_12 | op::READ_16 => self.read(cmd, c),
            op::WRITE_6 | op::WRITE_10 | op::WRITE_12 | op::WRITE_16 | op::ORWRITE_16 => {
                self.write(cmd, c)
            }
            op::WRITE_ATOMIC_16 if self.backend.atomic_writes() => self.write(cmd, c),
            op::WRITE_VERIFY_10 | op::WRITE_VERIFY_12 | op::WRITE_VERIFY_16 => self.write(cmd, c),
            op::VERIFY_10 | op::VERIFY_12 | op::VERIFY_16 => self.verify(cmd, c),
            op::READ_CAPACITY_10 => self.read_capacity10(c),
            op::SERVICE_ACTION_IN_16 => match c.sa() {
                op::SA_READ_CAPACITY_16 => self.read_capacity16(c),
                op::SA_GET_LBA_STATUS if self.cfg.thin_provisioning => self.get_lba_status(c),
                _ => Err(bad_cdb(1, Some(4))),
            },
            op::SYNCHRONIZE_CACHE_10 | op::SYNCHRONIZE_CACHE_16 => self.sync_cache(c),
            op::PRE_FETCH_10 | op::PRE_FETCH_16 => self.prefetch(c),
            op::READ_DEFECT_DATA_10 | op::READ_DEFECT_DATA_12 => self.read_defect_data(c),
            op::MODE_SENSE_6 | op::MODE_SENSE_10 => self.mode_sense(c),
            op::MODE_SELECT_6 | op::MODE_SELECT_10 => self.mode_select(cmd, c),
            op::START_STOP_UNIT => self.start_stop(c),
            op::PREVENT_ALLOW => self.prevent_allow(cmd, c),
            op::UNMAP if self.cfg.thin_provisioning => self.unmap(cmd, c),
            op::WRITE_SAME_10 | op::WRITE_SAME_16 => self.write_same(cmd, c),
            op::COMPARE_AND_WRITE => self.compare_and_write(cmd, c),
            op::PERSISTENT_RESERVE_IN => self.pr_in(cmd, c),
            op::PERSISTENT_RESERVE_OUT => self.pr_out(cmd, c),
            op::RESERVE_6 | op::RESERVE_10 => self.reserve(cmd, c),
            op::RELEASE_6 | op::RELEASE_10 => self.release(cmd),
            op::RECEIVE_COPY_RESULTS => self.receive_copy_results(cmd, c),
            op::SANITIZE if self.cfg.allow_sanitize => self.sanitize(cmd, c),
            op::REPORT_LUNS => crate::server::report_luns(c, &[0]),
            op::MAINTENANCE_IN => match c.sa() {
                op::SA_REPORT_SUPPORTED_OPCODES => self.report_opcodes(c),
                op::SA_REPORT_SUPPORTED_TMF => self.report_tmf(c),
                op::SA_REPORT_TARGET_PORT_GROUPS => self.report_target_port_groups(c),
                _ => Err(bad_cdb(1, Some(4))),
            },
            op::MAINTENANCE_OUT if c.sa() == op::SA_SET_TARGET_PORT_GROUPS => {
                self.set_target_port_groups(cmd, c)
            }
            _ => Err(illegal(asc::INVALID_COMMAND_OPERATION_CODE)),
        }
    }

    // ---- SPC --------------------------------------------------------------------------------

    fn request_sense(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let desc = c.b(1) & 0x01 != 0;
        let alloc = c.b(4) as usize;
        let pending = {
            let mut st = self.st();
            pop_ua(&mut st, cmd.nexus)
        };
        // SPC-4 6.29: REQUEST SENSE returns (and clears) a pending unit attention, else the
        // progress of a sanitize under way (SBC-4 4.33.3), else NO SENSE.
        let s = pending
            .or_else(|| self.sanitize_sense())
            .unwrap_or(Sense::new(key::NO_SENSE, asc::NO_ADDITIONAL_SENSE));
        let mut b = s.encode(desc).to_vec();
        b.truncate(alloc);
        Ok(Outcome::good(Bytes::from(b)))
    }

    fn inquiry(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let evpd = c.b(1) & 0x01 != 0;
        // CMDDT (obsolete bit 1) is not supported.
        if c.b(1) & 0x02 != 0 {
            return Err(bad_cdb(1, Some(1)));
        }
        let page = c.b(2);
        let alloc = c.u16(3) as usize;
        if !evpd && page != 0 {
            // SPC-4 6.6.1: PAGE CODE must be zero when EVPD is zero.
            return Err(bad_cdb(2, None));
        }
        let mut d = if evpd {
            self.vpd(cmd.nexus, page)?
        } else {
            self.standard_inquiry()
        };
        d.truncate(alloc);
        Ok(Outcome::good(Bytes::from(d)))
    }

    fn standard_inquiry(&self) -> Vec<u8> {
        let mut d = vec![0u8; 96];
        d[0] = 0x00; // connected, direct access block device
        d[1] = 0x00; // not removable
        d[2] = 0x06; // SPC-4
        d[3] = 0x12; // HISUP, response data format 2
        d[4] = (d.len() - 5) as u8;
        d[5] = 0x08; // 3PC: EXTENDED COPY
        if self.st().alua.is_some() {
            // TPGS 01b: implicit asymmetric access; 11b: explicit too, where the states are
            // shared by the gateways.
            d[5] |= if self.explicit_alua() { 0x30 } else { 0x10 };
        }
        d[6] = 0x00;
        d[7] = 0x02; // CMDQUE
        pad_into(&mut d[8..16], &self.cfg.vendor);
        pad_into(&mut d[16..32], &self.cfg.product);
        pad_into(&mut d[32..36], &self.cfg.revision);
        // Version descriptors (SPC-4 table 148): SAM-5, iSCSI, SPC-4, SBC-3.
        let versions: [u16; 4] = [0x00A0, 0x0960, 0x0460, 0x04C0];
        for (i, v) in versions.iter().enumerate() {
            d[58 + 2 * i..60 + 2 * i].copy_from_slice(&v.to_be_bytes());
        }
        d
    }

    fn supported_vpd(&self) -> Vec<u8> {
        let mut v = vec![0x00, 0x80, 0x83, 0x8F, 0xB0, 0xB1];
        if self.cfg.thin_provisioning {
            v.push(0xB2);
        }
        v
    }

    fn vpd(&self, nexus: &Nexus, page: u8) -> Result<Vec<u8>, Fail> {
        let mut d = vec![0x00, page, 0, 0];
        match page {
            0x00 => d.extend_from_slice(&self.supported_vpd()),
            0x80 => {
                let s = self.cfg.serial.as_bytes();
                d.extend_from_slice(&s[..s.len().min(250)]);
            }
            0x83 => self.device_identification(nexus, &mut d),
            0x8F => d.extend_from_slice(&self.third_party_copy_vpd()),
            0xB0 => {
                // Block Limits (SBC-3 6.5.3), page length 3Ch.
                let mut p = [0u8; 0x3C];
                // WSNZ clear: WRITE SAME with zero blocks writes to the end of the medium.
                p[1] = MAX_COMPARE_AND_WRITE_BLOCKS;
                // OPTIMAL TRANSFER LENGTH GRANULARITY: a physical block.
                let per_physical = 1u16 << (self.cfg.lbppb_exponent & 0x0F);
                p[2..4].copy_from_slice(&per_physical.to_be_bytes());
                p[4..8].copy_from_slice(&(self.max_transfer_blocks() as u32).to_be_bytes());
                p[8..12].copy_from_slice(&((1u32 << 20) / self.block_size as u32).to_be_bytes());
                if self.cfg.thin_provisioning {
                    p[16..20].copy_from_slice(&MAX_UNMAP_LBA_COUNT.to_be_bytes());
                    p[20..24].copy_from_slice(&MAX_UNMAP_DESCRIPTORS.to_be_bytes());
                    p[24..28].copy_from_slice(&1u32.to_be_bytes());
                }
                // MAXIMUM WRITE SAME LENGTH, page bytes 36..44.
                p[32..40].copy_from_slice(&MAX_WRITE_SAME_BLOCKS.to_be_bytes());
                // MAXIMUM ATOMIC TRANSFER LENGTH (page bytes 44..48): any write up to the
                // maximum transfer is atomic where the backend keeps that promise, none
                // elsewhere (0: WRITE ATOMIC is not supported); no alignment or granularity
                // (48..56), no atomic boundaries (56..64).
                if self.backend.atomic_writes() {
                    p[40..44].copy_from_slice(&(self.max_transfer_blocks() as u32).to_be_bytes());
                }
                d.extend_from_slice(&p);
            }
            0xB1 => {
                // Block Device Characteristics (SBC-4 6.6.2): non-rotating medium; WABEREQ and
                // WACEREQ 01b: a read after BLOCK ERASE or CRYPTOGRAPHIC ERASE succeeds (zeros).
                let mut p = [0u8; 0x3C];
                p[0..2].copy_from_slice(&1u16.to_be_bytes());
                p[3] = 0x40 | 0x10;
                d.extend_from_slice(&p);
            }
            0xB2 if self.cfg.thin_provisioning => {
                // Logical Block Provisioning (SBC-3 6.5.4): LBPU, LBPWS, LBPWS10, LBPRZ; thin.
                d.extend_from_slice(&[0x00, 0x80 | 0x40 | 0x20 | 0x04, 0x02, 0x00]);
            }
            _ => return Err(bad_cdb(2, None)),
        }
        let len = (d.len() - 4) as u16;
        d[2..4].copy_from_slice(&len.to_be_bytes());
        Ok(d)
    }

    /// Device Identification VPD page (SPC-4 7.8.6).
    fn device_identification(&self, nexus: &Nexus, d: &mut Vec<u8>) {
        // NAA designator: NAA 6 (registered extended) is 16 bytes, NAA 5/others 8 bytes.
        let naa_len = if self.cfg.naa_id[0] >> 4 == 6 { 16 } else { 8 };
        d.extend_from_slice(&[0x01, 0x03, 0x00, naa_len as u8]);
        d.extend_from_slice(&self.cfg.naa_id[..naa_len]);
        // T10 vendor ID designator: vendor (8 bytes) + serial.
        let mut t10 = vec![b' '; 8];
        pad_into(&mut t10[..8], &self.cfg.vendor);
        t10.extend_from_slice(self.cfg.serial.as_bytes());
        t10.truncate(200);
        d.extend_from_slice(&[0x02, 0x01, 0x00, t10.len() as u8]);
        d.extend_from_slice(&t10);
        // Relative target port designator (PIV=1, association target port, iSCSI).
        d.extend_from_slice(&[0x51, 0x94, 0x00, 0x04, 0, 0]);
        d.extend_from_slice(&nexus.relative_port.to_be_bytes());
        // Target port group designator (association target port, binary).
        if let Some(g) = self
            .st()
            .alua
            .as_ref()
            .and_then(|a| a.group_of(nexus.relative_port).map(|g| g.id))
        {
            d.extend_from_slice(&[0x01, 0x15, 0x00, 0x04, 0, 0]);
            d.extend_from_slice(&g.to_be_bytes());
        }
        // SCSI name string of the target port, UTF-8, NUL-terminated, padded to 4.
        let name = nexus.target_port.as_bytes();
        let name = &name[..name.len().min(220)];
        let n = (name.len() + 1).div_ceil(4) * 4;
        d.extend_from_slice(&[0x53, 0x98, 0x00, n as u8]);
        let start = d.len();
        d.extend_from_slice(name);
        d.resize(start + n, 0);
    }

    /// Whether initiators may set the port group states (SET TARGET PORT GROUPS): only where
    /// every gateway reads them from one record, since a gateway's own copy would leave the
    /// others serving the old states.
    fn explicit_alua(&self) -> bool {
        self.backend.shared_port_groups().is_some()
    }

    /// SET TARGET PORT GROUPS (SPC-4 6.46): the states of the groups named, stored for every
    /// gateway in one change (all or none), with ASYMMETRIC ACCESS STATE CHANGED for every
    /// other nexus. GOOD once the other gateways have heard of it.
    fn set_target_port_groups(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let Some(sh) = self.backend.shared_port_groups() else {
            return Err(illegal(asc::INVALID_COMMAND_OPERATION_CODE));
        };
        // The unit's groups, read once: a reload may change them meanwhile.
        let mut st = self.st();
        let Some(config) = st.alua_config.clone() else {
            return Err(illegal(asc::INVALID_COMMAND_OPERATION_CODE));
        };
        let len = c.u32(6) as usize;
        if len == 0 {
            return Ok(Outcome::good(Bytes::new()));
        }
        // A 4-byte header, then 4-byte descriptors: at most one per group a unit may have.
        if len < 4 || !len.is_multiple_of(4) || len > 4 + 4 * crate::alua::MAX_GROUPS {
            return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
        }
        if cmd.data_out.len() < len {
            return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
        }
        let mut changes = Vec::new();
        for (i, d) in cmd.data_out[4..len].chunks_exact(4).enumerate() {
            let at = (4 + 4 * i) as u16;
            let Some(state) = crate::alua::AccessState::from_code(d[0] & 0x0F) else {
                return Err(Fail::Sense(Sense::invalid_param_field(at, Some(3))));
            };
            let id = u16::from_be_bytes([d[2], d[3]]);
            // A group the unit does not have, or one named twice (which state would it take?).
            if config.group(id).is_none() || changes.iter().any(|(g, _)| *g == id) {
                return Err(Fail::Sense(Sense::invalid_param_field(at + 2, None)));
            }
            changes.push((id, state));
        }
        use crate::alua::ChangedBy;
        let (stored, changed) = self
            .store_alua(sh, &mut st, &changes, ChangedBy::Explicit)
            .map_err(shared_failed)?;
        let next = Some(Arc::new(config.with_stored(&stored)));
        self.serve_alua(&mut st, next, |_| ChangedBy::Explicit, Some(cmd.nexus));
        changed_as_stored(&mut st, &stored);
        drop(st);
        if changed {
            self.announce_alua(sh);
        }
        Ok(Outcome::good(Bytes::new()))
    }

    /// REPORT TARGET PORT GROUPS (SPC-4 6.37), where the unit has target port groups.
    fn report_target_port_groups(&self, c: &Cdb) -> Res {
        let (alua, changed) = {
            let st = self.st();
            (st.alua.clone(), st.alua_changed.clone())
        };
        let Some(alua) = alua else {
            return Err(bad_cdb(1, Some(4)));
        };
        let format = c.b(1) >> 5;
        if format > 1 {
            return Err(bad_cdb(1, Some(7)));
        }
        let alloc = c.u32(6) as usize;
        let mut d = alua.report(format == 1, &changed);
        d.truncate(alloc);
        Ok(Outcome::good(Bytes::from(d)))
    }

    fn report_tmf(&self, c: &Cdb) -> Res {
        let alloc = c.u32(6) as usize;
        // SPC-4 6.36: ABORT TASK, ABORT TASK SET, CLEAR TASK SET, LU RESET; I_T NEXUS RESET.
        let mut d = vec![0x80 | 0x40 | 0x20 | 0x08, 0x01, 0, 0];
        d.truncate(alloc);
        Ok(Outcome::good(Bytes::from(d)))
    }

    fn report_opcodes(&self, c: &Cdb) -> Res {
        let rctd = c.b(2) & 0x80 != 0;
        let opts = c.b(2) & 0x07;
        let req_op = c.b(3);
        let req_sa = c.u16(4);
        let alloc = c.u32(6) as usize;
        let mut table: Vec<&crate::opcodes::Entry> = crate::opcodes::supported(
            self.cfg.thin_provisioning,
            self.st().alua.is_some(),
            self.explicit_alua(),
        );
        if !self.cfg.allow_sanitize {
            table.retain(|e| e.op != op::SANITIZE);
        }
        if !self.backend.atomic_writes() {
            table.retain(|e| e.op != op::WRITE_ATOMIC_16);
        }
        let timeout = |d: &mut Vec<u8>| {
            // Command timeouts descriptor (SPC-4 6.35.4): length 0Ah, no timeouts given.
            d.extend_from_slice(&[0x00, 0x0A, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        };
        let mut d = Vec::new();
        match opts {
            0 => {
                d.extend_from_slice(&[0, 0, 0, 0]);
                for e in &table {
                    d.push(e.op);
                    d.push(0);
                    d.extend_from_slice(&e.sa.unwrap_or(0).to_be_bytes());
                    d.push(0);
                    let mut f = 0u8;
                    if rctd {
                        f |= 0x02;
                    }
                    if e.sa.is_some() {
                        f |= 0x01;
                    }
                    d.push(f);
                    d.extend_from_slice(&(e.usage.len() as u16).to_be_bytes());
                    if rctd {
                        timeout(&mut d);
                    }
                }
                let len = (d.len() - 4) as u32;
                d[0..4].copy_from_slice(&len.to_be_bytes());
            }
            1..=3 => {
                let has_sa = table.iter().any(|e| e.op == req_op && e.sa.is_some());
                let found = match opts {
                    1 => {
                        if has_sa {
                            return Err(bad_cdb(2, Some(0)));
                        }
                        table.iter().find(|e| e.op == req_op)
                    }
                    2 => {
                        if !has_sa && table.iter().any(|e| e.op == req_op) {
                            return Err(bad_cdb(2, Some(0)));
                        }
                        table
                            .iter()
                            .find(|e| e.op == req_op && e.sa == Some(req_sa))
                    }
                    _ => table
                        .iter()
                        .find(|e| e.op == req_op && (e.sa.is_none() || e.sa == Some(req_sa))),
                };
                match found {
                    Some(e) => {
                        d.push(0);
                        d.push(if rctd { 0x80 | 0x03 } else { 0x03 });
                        d.extend_from_slice(&(e.usage.len() as u16).to_be_bytes());
                        d.extend_from_slice(e.usage);
                        if rctd {
                            timeout(&mut d);
                        }
                    }
                    // SUPPORT 001b: not supported.
                    None => d.extend_from_slice(&[0, 0x01, 0, 0]),
                }
            }
            _ => return Err(bad_cdb(2, Some(0))),
        }
        d.truncate(alloc);
        Ok(Outcome::good(Bytes::from(d)))
    }

    // ---- Mode pages (SPC-4 7.5, SBC-3 6.4) --------------------------------------------------

    /// One mode page as (current, changeable, default) bytes.
    fn mode_page(&self, page: u8, pc: u8, m: &ModeState) -> Option<Vec<u8>> {
        match page {
            0x01 => {
                // Read-Write Error Recovery: AWRE/ARRE set by default, nothing changeable.
                let mut p = vec![0x01, 0x0A, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
                if pc != 1 {
                    p[2] = 0xC0;
                }
                Some(p)
            }
            0x08 => {
                let mut p = vec![0u8; 20];
                p[0] = 0x08;
                p[1] = 0x12;
                p[2] = match pc {
                    0 => u8::from(m.wce) << 2,
                    1 => 0x04,
                    _ => u8::from(self.cfg.write_cache) << 2,
                };
                Some(p)
            }
            0x0A => {
                let mut p = vec![0u8; 12];
                p[0] = 0x0A;
                p[1] = 0x0A;
                match pc {
                    0 => {
                        p[2] = u8::from(m.d_sense) << 2;
                        p[3] = 0x10; // QUEUE ALGORITHM MODIFIER 1: unrestricted reordering
                        p[4] = u8::from(m.swp) << 3;
                    }
                    1 => {
                        p[2] = 0x04;
                        p[4] = 0x08;
                    }
                    _ => p[3] = 0x10,
                }
                Some(p)
            }
            _ => None,
        }
    }

    fn mode_sense(&self, c: &Cdb) -> Res {
        let ten = c.op() == op::MODE_SENSE_10;
        let dbd = c.b(1) & 0x08 != 0;
        let llbaa = ten && c.b(1) & 0x10 != 0;
        let pc = c.b(2) >> 6;
        let page = c.b(2) & 0x3F;
        let sub = c.b(3);
        let alloc = if ten {
            c.u16(7) as usize
        } else {
            c.b(4) as usize
        };
        if pc == 3 {
            return Err(illegal(asc::SAVING_PARAMETERS_NOT_SUPPORTED));
        }
        if sub != 0 && sub != 0xFF {
            return Err(bad_cdb(3, None));
        }
        let m = self.st().mode;
        let mut pages = Vec::new();
        if page == 0x3F {
            for p in [0x01, 0x08, 0x0A] {
                if let Some(b) = self.mode_page(p, pc, &m) {
                    pages.extend_from_slice(&b);
                }
            }
        } else {
            match self.mode_page(page, pc, &m) {
                Some(b) => pages.extend_from_slice(&b),
                None => return Err(bad_cdb(2, Some(5))),
            }
        }
        // Block descriptor (SPC-4 7.5.5): short unless LLBAA.
        let mut bd = Vec::new();
        if !dbd {
            if llbaa {
                bd.extend_from_slice(&self.blocks().to_be_bytes());
                bd.extend_from_slice(&[0, 0, 0, 0]);
                bd.extend_from_slice(&(self.block_size as u32).to_be_bytes());
            } else {
                let n = u32::try_from(self.blocks()).unwrap_or(u32::MAX);
                bd.extend_from_slice(&n.to_be_bytes());
                bd.push(0);
                bd.extend_from_slice(&(self.block_size as u32).to_be_bytes()[1..4]);
            }
        }
        // Device-specific parameter (SBC-3 6.4.1): WP, DPOFUA.
        let wp = self.cfg.read_only || m.swp;
        let dsp = (u8::from(wp) << 7) | 0x10;
        let mut d = Vec::new();
        if ten {
            let len = (6 + bd.len() + pages.len()) as u16;
            d.extend_from_slice(&len.to_be_bytes());
            d.push(0);
            d.push(dsp);
            d.push(u8::from(llbaa && !dbd));
            d.push(0);
            d.extend_from_slice(&(bd.len() as u16).to_be_bytes());
        } else {
            let len = (3 + bd.len() + pages.len()).min(255) as u8;
            d.extend_from_slice(&[len, 0, dsp, bd.len() as u8]);
        }
        d.extend_from_slice(&bd);
        d.extend_from_slice(&pages);
        d.truncate(alloc);
        Ok(Outcome::good(Bytes::from(d)))
    }

    fn mode_select(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let ten = c.op() == op::MODE_SELECT_10;
        let sp = c.b(1) & 0x01 != 0;
        let len = if ten {
            c.u16(7) as usize
        } else {
            c.b(4) as usize
        };
        if sp {
            return Err(illegal(asc::SAVING_PARAMETERS_NOT_SUPPORTED));
        }
        if len == 0 {
            return Ok(Outcome::good(Bytes::new()));
        }
        let data = &cmd.data_out[..cmd.data_out.len().min(len)];
        let hdr = if ten { 8 } else { 4 };
        if data.len() < hdr {
            return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
        }
        let bdl = if ten {
            u16::from_be_bytes([data[6], data[7]]) as usize
        } else {
            data[3] as usize
        };
        let mut pos = hdr;
        if bdl > 0 {
            let Some(bd) = data.get(pos..pos + bdl) else {
                return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
            };
            // The block length in the descriptor must match ours (no format change).
            let bl = if bdl >= 16 && ten && data[4] & 0x01 != 0 {
                u32::from_be_bytes([bd[12], bd[13], bd[14], bd[15]])
            } else if bdl >= 8 {
                u32::from_be_bytes([0, bd[5], bd[6], bd[7]])
            } else {
                return Err(Fail::Sense(Sense::invalid_param_field(
                    hdr as u16 - 1,
                    None,
                )));
            };
            if bl != 0 && bl as u64 != self.block_size {
                return Err(Fail::Sense(Sense::invalid_param_field(
                    (pos + bdl - 3) as u16,
                    None,
                )));
            }
            pos += bdl;
        }
        let mut m = self.st().mode;
        let before = m;
        while pos < data.len() {
            let pcode = data[pos] & 0x3F;
            if data[pos] & 0x40 != 0 {
                return Err(Fail::Sense(Sense::invalid_param_field(pos as u16, Some(6))));
            }
            let Some(&plen) = data.get(pos + 1) else {
                return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
            };
            let Some(p) = data.get(pos..pos + 2 + plen as usize) else {
                return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
            };
            let (Some(cur), Some(chg)) =
                (self.mode_page(pcode, 0, &m), self.mode_page(pcode, 1, &m))
            else {
                return Err(Fail::Sense(Sense::invalid_param_field(pos as u16, None)));
            };
            if p.len() != cur.len() {
                return Err(Fail::Sense(Sense::invalid_param_field(
                    pos as u16 + 1,
                    None,
                )));
            }
            // Only changeable bits may differ from the current values (SPC-4 6.11).
            for i in 2..p.len() {
                if (p[i] ^ cur[i]) & !chg[i] != 0 {
                    return Err(Fail::Sense(Sense::invalid_param_field(
                        (pos + i) as u16,
                        None,
                    )));
                }
            }
            match pcode {
                0x08 => m.wce = p[2] & 0x04 != 0,
                0x0A => {
                    m.d_sense = p[2] & 0x04 != 0;
                    m.swp = p[4] & 0x08 != 0;
                }
                _ => {}
            }
            pos += p.len();
        }
        let changed = before.wce != m.wce || before.d_sense != m.d_sense || before.swp != m.swp;
        if before.wce && !m.wce {
            // Turning the write cache off makes cached data durable first.
            self.backend
                .flush()
                .map_err(|e| self.medium_error(e, true))?;
        }
        let mut st = self.st();
        st.mode = m;
        if changed {
            // SPC-4 6.11: MODE PARAMETERS CHANGED to every other I_T nexus.
            let others: Vec<Nexus> = st
                .seen
                .iter()
                .filter(|n| *n != cmd.nexus)
                .cloned()
                .collect();
            for n in others {
                push_ua(
                    &mut st,
                    &n,
                    Sense::new(key::UNIT_ATTENTION, asc::MODE_PARAMETERS_CHANGED),
                );
            }
        }
        Ok(Outcome::good(Bytes::new()))
    }

    fn start_stop(&self, c: &Cdb) -> Res {
        let loej = c.b(4) & 0x02 != 0;
        let start = c.b(4) & 0x01 != 0;
        // SBC-3 5.25: the medium is not removable, so load/eject is refused.
        if loej {
            return Err(bad_cdb(4, Some(1)));
        }
        if !start && c.b(4) & 0x04 == 0 {
            self.backend
                .flush()
                .map_err(|e| self.medium_error(e, true))?;
        }
        Ok(Outcome::good(Bytes::new()))
    }

    fn prevent_allow(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let prevent = c.b(4) & 0x03;
        let mut st = self.st();
        match prevent {
            0 => {
                st.prevent.remove(cmd.nexus);
            }
            1 => {
                st.prevent.insert(cmd.nexus.clone());
            }
            _ => return Err(bad_cdb(4, Some(1))),
        }
        Ok(Outcome::good(Bytes::new()))
    }

    fn reserve(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        // Third-party and extent reservations are not supported (SPC-2 7.21).
        let third = if c.op() == op::RESERVE_10 {
            c.b(1) & 0x10 != 0
        } else {
            false
        };
        if c.b(1) & 0x01 != 0 {
            return Err(bad_cdb(1, Some(0)));
        }
        if third {
            return Err(bad_cdb(1, Some(4)));
        }
        let mut st = self.st();
        match &st.spc2 {
            Some(h) if h != cmd.nexus => Err(Fail::Status(status::RESERVATION_CONFLICT)),
            _ => {
                st.spc2 = Some(cmd.nexus.clone());
                Ok(Outcome::good(Bytes::new()))
            }
        }
    }

    fn release(&self, cmd: &Command<'_>) -> Res {
        let mut st = self.st();
        if st.spc2.as_ref() == Some(cmd.nexus) {
            st.spc2 = None;
        }
        Ok(Outcome::good(Bytes::new()))
    }

    fn pr_in(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let alloc = c.u16(7) as usize;
        let mut st = self.st();
        // Shared reservations are read again for each report, announced or not: a gateway
        // that did not answer an announcement in time still reports what is stored.
        if let Some(sh) = self.backend.shared_reservations() {
            self.take_stored(sh, &mut st).map_err(shared_failed)?;
        }
        let mut d = st.pr.pr_in(cmd.nexus, c.sa()).map_err(Fail::Sense)?;
        d.truncate(alloc);
        Ok(Outcome::good(Bytes::from(d)))
    }

    fn pr_out(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let len = c.u32(5) as usize;
        // The basic list is 24 bytes; SPEC_I_PT and REGISTER AND MOVE add TransportIDs, which the
        // reservation state checks ([`crate::pr`]). A unit takes at most 1,024 of them, each at
        // most 248 bytes (a 223-byte name, its ISID and padding).
        if !(24..=28 + 1024 * 248).contains(&len) {
            return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
        }
        if cmd.data_out.len() < len {
            return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
        }
        let mut st = self.st();
        if st.spc2.is_some() {
            return Err(Fail::Status(status::RESERVATION_CONFLICT));
        }
        if let Some(sh) = self.backend.shared_reservations() {
            return self.pr_out_shared(sh, st, cmd, c, len);
        }
        let before = st.pr.clone();
        match st
            .pr
            .pr_out(cmd.nexus, c.sa(), c.b(2), &cmd.data_out[..len])
        {
            Ok(uas) => {
                // Persisted (or, APTPL turned off, removed) before GOOD; a unit that cannot
                // write it keeps the state it had and fails the command.
                if let (Some(path), true) = (&self.cfg.pr_file, before.aptpl || st.pr.aptpl) {
                    if let Err(e) = st.pr.persist(path) {
                        tracing::error!(file = %path.display(), "persistent reservations not saved: {e}");
                        st.pr = before;
                        return Err(Fail::Sense(Sense::new(
                            key::ILLEGAL_REQUEST,
                            asc::INSUFFICIENT_REGISTRATION_RESOURCES,
                        )));
                    }
                }
                push_pr_uas(&mut st, uas, false, Some(cmd.nexus));
                Ok(Outcome::good(Bytes::new()))
            }
            Err(PrError::Conflict) => Err(Fail::Status(status::RESERVATION_CONFLICT)),
            Err(PrError::Sense(s)) => Err(Fail::Sense(s)),
        }
    }

    /// PERSISTENT RESERVE OUT on reservations shared by gateways: the record is read, the
    /// request applied to it, and the result stored only if no gateway replaced the record
    /// meanwhile (else all again: BUSY after 8 tries). GOOD once the other gateways have
    /// heard of it, so that a command through any of them afterwards meets the new state.
    /// The unit's other commands wait only for the read and the store: the announcement,
    /// which waits for every gateway (up to its timeout when one is gone), is made after the
    /// unit's state is released.
    fn pr_out_shared(
        &self,
        sh: &dyn SharedState,
        mut st: MutexGuard<'_, State>,
        cmd: &Command<'_>,
        c: &Cdb,
        len: usize,
    ) -> Res {
        let mut stored = false;
        for _ in 0..8 {
            let version = self.take_stored(sh, &mut st).map_err(shared_failed)?;
            let mut next = st.pr.clone();
            let uas = match next.pr_out(cmd.nexus, c.sa(), c.b(2), &cmd.data_out[..len]) {
                Ok(uas) => uas,
                Err(PrError::Conflict) => return Err(Fail::Status(status::RESERVATION_CONFLICT)),
                Err(PrError::Sense(s)) => return Err(Fail::Sense(s)),
            };
            if !sh
                .replace(&next.to_bytes(), version)
                .map_err(shared_failed)?
            {
                continue;
            }
            st.pr = next;
            // This gateway's nexuses now; the others' when their gateway reads the change.
            push_ua_seen(&mut st, uas, Some(cmd.nexus));
            stored = true;
            break;
        }
        drop(st);
        if !stored {
            return Err(Fail::Status(status::BUSY));
        }
        if let Err(e) = sh.announce() {
            tracing::warn!(backend = %self.backend.describe(), "persistent reservations changed, and a gateway did not hear it in time (it reads them again when it next does): {e}");
        }
        Ok(Outcome::good(Bytes::new()))
    }

    /// Reads the shared reservations again when another gateway announced a change since this
    /// unit last read them (the command being admitted then meets the change). A record that
    /// cannot be read leaves the state as it was, and the next command tries again.
    fn sync_shared(&self, st: &mut State) {
        let Some(sh) = self.backend.shared_reservations() else {
            return;
        };
        if self.pr_heard.load(Ordering::Acquire) == st.pr_heard {
            return;
        }
        if let Err(e) = self.take_stored(sh, st) {
            tracing::warn!(backend = %self.backend.describe(), "shared persistent reservations not read: {e}")
        }
    }

    /// Reads the shared reservations and takes them as another gateway left them, with the
    /// unit attentions the change owes this gateway's nexuses (SPC-4 5.12.11); the version
    /// read. The announcements heard are counted before the read, so that one arriving
    /// during it makes the next command read again.
    fn take_stored(&self, sh: &dyn SharedState, st: &mut State) -> Result<u64, BackendError> {
        let heard = self.pr_heard.load(Ordering::Acquire);
        let (bytes, version) = sh.read()?;
        let next = parse_shared(&bytes)?;
        let uas = st.pr.changed_elsewhere(&next);
        st.pr = next;
        st.pr_heard = heard;
        push_ua_seen(st, uas, None);
        Ok(version)
    }

    // ---- SBC --------------------------------------------------------------------------------

    fn medium_error(&self, e: BackendError, write: bool) -> Fail {
        tracing::warn!(error = %e, backend = %self.backend.describe(), "backend I/O failed");
        let code = if write {
            asc::WRITE_ERROR
        } else {
            asc::UNRECOVERED_READ_ERROR
        };
        let mut s = Sense::new(key::MEDIUM_ERROR, code);
        if let Some(off) = e.offset() {
            s = s.with_info(off / self.block_size);
        }
        Fail::Sense(s)
    }

    /// LBA range check (SBC-3 4.5): LBA OUT OF RANGE when any block is past the end.
    fn check_range(&self, lba: u64, nlb: u64) -> Result<(), Fail> {
        match lba.checked_add(nlb) {
            Some(end) if end <= self.blocks() && lba <= self.blocks() => Ok(()),
            _ => Err(lba_oor()),
        }
    }

    fn write_protected(&self) -> bool {
        self.cfg.read_only || self.st().mode.swp
    }

    fn read(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        match self.read_plan(cmd, c)? {
            Planned::Done(o) => Ok(o),
            Planned::Read { off, len, unread } => {
                let mut o = Outcome::good(self.read_stable(off, len)?);
                o.data_in_unread = unread;
                Ok(o)
            }
        }
    }

    /// A READ checked: ended (an error, nothing to read) or the bytes to read.
    fn read_plan(&self, cmd: &Command<'_>, c: &Cdb) -> Result<Planned, Fail> {
        let Some(r) = rw_fields(c) else {
            return Err(illegal(asc::INVALID_COMMAND_OPERATION_CODE));
        };
        // No protection information: RDPROTECT must be zero (SBC-3 5.13).
        if r.flags & 0xE0 != 0 {
            return Err(bad_cdb(1, Some(7)));
        }
        self.check_range(r.lba, r.nlb)?;
        if r.nlb > self.max_transfer_blocks() {
            return Err(bad_cdb(if c.len() == 16 { 10 } else { 7 }, None));
        }
        if r.nlb == 0 {
            return Ok(Planned::Done(Outcome::good(Bytes::new())));
        }
        // Only the blocks the initiator will receive are read: a READ whose expected length is
        // smaller than the CDB asks for would otherwise cost a backend read of up to the maximum
        // transfer for a few bytes on the wire. The rest is counted, for the residual. A medium
        // error in the unread blocks therefore goes unreported: GOOD with an overflow residual
        // for the data the initiator did not ask to receive.
        let total = r.nlb * self.block_size;
        let wanted = u64::from(cmd.data_in_limit)
            .div_ceil(self.block_size)
            .saturating_mul(self.block_size)
            .min(total);
        let unread = (total - wanted) as u32;
        if wanted == 0 {
            let mut o = Outcome::good(Bytes::new());
            o.data_in_unread = unread;
            return Ok(Planned::Done(o));
        }
        Ok(Planned::Read {
            off: r.lba * self.block_size,
            len: wanted as usize,
            unread,
        })
    }

    /// Reads `len` bytes at byte offset `off`, never showing a WRITE ATOMIC half done.
    fn read_stable(&self, off: u64, len: usize) -> Result<Bytes, Fail> {
        let (active, started) = self.atomic_snapshot();
        let buf = self
            .backend
            .read_bytes(off, len)
            .map_err(|e| self.medium_error(e, false))?;
        if active == 0 && self.atomic_snapshot() == (0, started) {
            return Ok(buf);
        }
        // A WRITE ATOMIC ran meanwhile and may have been half done when read: again, with its
        // blocks held.
        self.read_locked(off, len)
    }

    /// Reads with the blocks held in the range locks (no write of them in progress).
    fn read_locked(&self, off: u64, len: usize) -> Result<Bytes, Fail> {
        let _g = self.ranges.lock(off, off + len as u64);
        self.backend
            .read_bytes(off, len)
            .map_err(|e| self.medium_error(e, false))
    }

    /// WRITE ATOMICs under way and started so far.
    fn atomic_snapshot(&self) -> (usize, u64) {
        (
            self.atomic_active.load(Ordering::SeqCst),
            self.atomic_started.load(Ordering::SeqCst),
        )
    }

    /// Durability of a write: FUA, or the write cache disabled, means fdatasync before GOOD.
    fn write_through(&self, fua: bool) -> bool {
        fua || !self.st().mode.wce
    }

    fn write(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let Some(WritePlan {
            off,
            len,
            flush,
            atomic,
        }) = self.write_plan(cmd, c)?
        else {
            return Ok(Outcome::good(Bytes::new()));
        };
        {
            // Reads that overlap an atomic write in time read again under the range lock.
            let _atomic = atomic.then(|| AtomicWrite::begin(self));
            let _g = self.ranges.lock(off, off + len as u64);
            if c.op() == op::ORWRITE_16 {
                // ORWRITE (SBC-3 5.12): OR the data into the medium, atomic with respect to
                // other writes of the range through the range lock.
                let mut cur = vec![0u8; len];
                self.backend
                    .read_at(off, &mut cur)
                    .map_err(|e| self.medium_error(e, false))?;
                for (m, d) in cur.iter_mut().zip(&cmd.data_out[..len]) {
                    *m |= d;
                }
                self.backend
                    .write_at(off, &cur)
                    .map_err(|e| self.medium_error(e, true))?;
            } else {
                self.backend
                    .write_at(off, &cmd.data_out[..len])
                    .map_err(|e| self.medium_error(e, true))?;
            }
        }
        if flush {
            self.backend
                .flush()
                .map_err(|e| self.medium_error(e, true))?;
        }
        Ok(Outcome::good(Bytes::new()))
    }

    /// A write checked: None when there is nothing to write (GOOD), else what to write.
    fn write_plan(&self, cmd: &Command<'_>, c: &Cdb) -> Result<Option<WritePlan>, Fail> {
        let Some(r) = rw_fields(c) else {
            return Err(illegal(asc::INVALID_COMMAND_OPERATION_CODE));
        };
        let verify = matches!(
            c.op(),
            op::WRITE_VERIFY_10 | op::WRITE_VERIFY_12 | op::WRITE_VERIFY_16
        );
        let atomic = c.op() == op::WRITE_ATOMIC_16;
        if r.flags & 0xE0 != 0 {
            return Err(bad_cdb(1, Some(7)));
        }
        // No atomic boundaries are offered (MAXIMUM ATOMIC BOUNDARY SIZE 0): ATOMIC BOUNDARY
        // must be zero (SBC-4 5.48).
        if atomic && c.u16(10) != 0 {
            return Err(bad_cdb(10, None));
        }
        if self.write_protected() {
            return Err(Fail::Sense(Sense::new(
                key::DATA_PROTECT,
                asc::WRITE_PROTECTED,
            )));
        }
        self.check_range(r.lba, r.nlb)?;
        if r.nlb > self.max_transfer_blocks() {
            return Err(bad_cdb(if c.len() == 16 { 10 } else { 7 }, None));
        }
        // Only whole blocks the initiator actually sent are written; the transport reports the
        // residual (RFC 7143 11.4.5.2).
        let have = (cmd.data_out.len() as u64 / self.block_size).min(r.nlb);
        if atomic && have < r.nlb {
            // All or nothing: part of an atomic write is not written.
            return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
        }
        if have == 0 {
            return Ok(None);
        }
        let fua = verify || r.flags & 0x08 != 0;
        Ok(Some(WritePlan {
            off: r.lba * self.block_size,
            len: (have * self.block_size) as usize,
            flush: self.write_through(fua),
            atomic,
        }))
    }

    fn verify(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let Some(r) = rw_fields(c) else {
            return Err(illegal(asc::INVALID_COMMAND_OPERATION_CODE));
        };
        if r.flags & 0xE0 != 0 {
            return Err(bad_cdb(1, Some(7)));
        }
        let bytchk = (r.flags >> 1) & 0x03;
        if bytchk == 2 {
            return Err(bad_cdb(1, Some(2)));
        }
        self.check_range(r.lba, r.nlb)?;
        if r.nlb > self.max_transfer_blocks() {
            return Err(bad_cdb(if c.len() == 16 { 10 } else { 7 }, None));
        }
        if r.nlb == 0 {
            return Ok(Outcome::good(Bytes::new()));
        }
        let bs = self.block_size as usize;
        let mut buf = vec![0u8; r.nlb as usize * bs];
        self.backend
            .read_at(r.lba * self.block_size, &mut buf)
            .map_err(|e| self.medium_error(e, false))?;
        let data = &cmd.data_out;
        let mismatch = match bytchk {
            0 => None,
            1 => {
                if data.len() < buf.len() {
                    return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
                }
                first_diff(&buf, &data[..buf.len()])
            }
            _ => {
                if data.len() < bs {
                    return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
                }
                buf.chunks(bs)
                    .enumerate()
                    .find_map(|(i, b)| first_diff(b, &data[..bs]).map(|o| i * bs + o))
            }
        };
        match mismatch {
            // SBC-3 5.29: MISCOMPARE DURING VERIFY OPERATION, offset in INFORMATION.
            Some(o) => Err(miscompare(o as u64)),
            None => Ok(Outcome::good(Bytes::new())),
        }
    }

    fn read_capacity10(&self, c: &Cdb) -> Res {
        let pmi = c.b(8) & 0x01 != 0;
        // SBC-3 5.15: without PMI the LBA field must be zero.
        if !pmi && c.u32(2) != 0 {
            return Err(bad_cdb(2, None));
        }
        let last = self.blocks().saturating_sub(1);
        let last32 = u32::try_from(last).unwrap_or(u32::MAX);
        let mut d = Vec::with_capacity(8);
        d.extend_from_slice(&last32.to_be_bytes());
        d.extend_from_slice(&(self.block_size as u32).to_be_bytes());
        Ok(Outcome::good(Bytes::from(d)))
    }

    fn read_capacity16(&self, c: &Cdb) -> Res {
        let alloc = c.u32(10) as usize;
        let mut d = vec![0u8; 32];
        d[0..8].copy_from_slice(&self.blocks().saturating_sub(1).to_be_bytes());
        d[8..12].copy_from_slice(&(self.block_size as u32).to_be_bytes());
        // LOGICAL BLOCKS PER PHYSICAL BLOCK EXPONENT; the lowest aligned LBA is 0.
        d[13] = self.cfg.lbppb_exponent & 0x0F;
        if self.cfg.thin_provisioning {
            d[14] = 0x80 | 0x40; // LBPME, LBPRZ (SBC-3 5.16.2)
        }
        d.truncate(alloc);
        Ok(Outcome::good(Bytes::from(d)))
    }

    fn get_lba_status(&self, c: &Cdb) -> Res {
        let lba = c.u64(2);
        let alloc = c.u32(10) as usize;
        if lba >= self.blocks() {
            return Err(lba_oor());
        }
        let bs = self.block_size;
        // Look at a bounded window; the initiator asks again for the rest (SBC-3 5.6).
        let max_desc = alloc.saturating_sub(8) / 16;
        let window = (self.blocks() - lba).min(1 << 20);
        let ext = self
            .backend
            .mapped(lba * bs, window * bs)
            .map_err(|e| self.medium_error(e, false))?;
        let mut d = vec![0u8; 8];
        // Extents are in bytes; convert to whole blocks. A partially mapped block is mapped.
        let mut descs: Vec<(u64, u64, u8)> = Vec::new();
        for (off, len, mapped) in ext {
            let first = off / bs;
            let end = (off + len).div_ceil(bs);
            let st = u8::from(!mapped);
            let last = descs.last().copied();
            match last {
                Some(l) if l.0 + l.1 >= first => {
                    let lend = l.0 + l.1;
                    if l.2 == st {
                        if let Some(m) = descs.last_mut() {
                            m.1 = end.max(lend) - l.0;
                        }
                    } else if end > lend {
                        descs.push((lend, end - lend, st));
                    }
                }
                _ => descs.push((first, end - first, st)),
            }
        }
        for (l, n, s) in descs.iter().take(max_desc.max(1)) {
            let n = u32::try_from(*n).unwrap_or(u32::MAX);
            d.extend_from_slice(&l.to_be_bytes());
            d.extend_from_slice(&n.to_be_bytes());
            d.push(*s);
            d.extend_from_slice(&[0, 0, 0]);
        }
        let len = (d.len() - 4) as u32;
        d[0..4].copy_from_slice(&len.to_be_bytes());
        d.truncate(alloc);
        Ok(Outcome::good(Bytes::from(d)))
    }

    fn sync_cache(&self, c: &Cdb) -> Res {
        self.sync_cache_plan(c)?;
        self.backend
            .flush()
            .map_err(|e| self.medium_error(e, true))?;
        Ok(Outcome::good(Bytes::new()))
    }

    fn sync_cache_plan(&self, c: &Cdb) -> Result<(), Fail> {
        let Some(r) = rw_fields(c) else {
            return Err(illegal(asc::INVALID_COMMAND_OPERATION_CODE));
        };
        self.check_range(r.lba, r.nlb)
    }

    fn prefetch(&self, c: &Cdb) -> Res {
        let Some(r) = rw_fields(c) else {
            return Err(illegal(asc::INVALID_COMMAND_OPERATION_CODE));
        };
        self.check_range(r.lba, r.nlb)?;
        // There is no separate cache to load, so nothing was prefetched: GOOD rather than
        // CONDITION MET (SBC-3 5.8).
        Ok(Outcome::good(Bytes::new()))
    }

    /// READ DEFECT DATA (SBC-3 5.17/5.18): there are no defects, so an empty list in the
    /// requested format.
    fn read_defect_data(&self, c: &Cdb) -> Res {
        let d = if c.op() == op::READ_DEFECT_DATA_10 {
            let f = c.b(2) & 0x1F;
            let alloc = c.u16(7) as usize;
            let mut d = vec![0, f, 0, 0];
            d.truncate(alloc);
            d
        } else {
            let f = c.b(1) & 0x1F;
            let alloc = c.u32(6) as usize;
            let mut d = vec![0, f, 0, 0, 0, 0, 0, 0];
            d.truncate(alloc);
            d
        };
        Ok(Outcome::good(Bytes::from(d)))
    }

    fn unmap(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        if c.b(1) & 0x01 != 0 {
            // ANCHOR without ANC_SUP (SBC-3 5.28).
            return Err(bad_cdb(1, Some(0)));
        }
        if self.write_protected() {
            return Err(Fail::Sense(Sense::new(
                key::DATA_PROTECT,
                asc::WRITE_PROTECTED,
            )));
        }
        let len = c.u16(7) as usize;
        if len == 0 {
            return Ok(Outcome::good(Bytes::new()));
        }
        let data = &cmd.data_out[..cmd.data_out.len().min(len)];
        if data.len() < 8 {
            return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
        }
        let bdl = u16::from_be_bytes([data[2], data[3]]) as usize;
        let descs = &data[8..data.len().min(8 + bdl)];
        let n = descs.len() / 16;
        if n as u32 > MAX_UNMAP_DESCRIPTORS {
            return Err(Fail::Sense(Sense::invalid_param_field(2, None)));
        }
        let mut ranges = Vec::with_capacity(n);
        let mut total = 0u64;
        for (i, d) in descs.chunks_exact(16).enumerate() {
            let mut l = [0u8; 8];
            l.copy_from_slice(&d[0..8]);
            let lba = u64::from_be_bytes(l);
            let nlb = u32::from_be_bytes([d[8], d[9], d[10], d[11]]) as u64;
            self.check_range(lba, nlb)?;
            total += nlb;
            if nlb > MAX_UNMAP_LBA_COUNT as u64 || total > MAX_UNMAP_LBA_COUNT as u64 * 16 {
                return Err(Fail::Sense(Sense::invalid_param_field(
                    (8 + i * 16 + 8) as u16,
                    None,
                )));
            }
            ranges.push((lba, nlb));
        }
        let bs = self.block_size;
        for (lba, nlb) in ranges {
            if nlb == 0 {
                continue;
            }
            let _g = self.ranges.lock(lba * bs, (lba + nlb) * bs);
            self.backend
                .unmap(lba * bs, nlb * bs)
                .map_err(|e| self.medium_error(e, true))?;
        }
        Ok(Outcome::good(Bytes::new()))
    }

    fn write_same(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let Some(r) = rw_fields(c) else {
            return Err(illegal(asc::INVALID_COMMAND_OPERATION_CODE));
        };
        let sixteen = c.op() == op::WRITE_SAME_16;
        let unmap = r.flags & 0x08 != 0;
        let anchor = r.flags & 0x10 != 0;
        let ndob = sixteen && r.flags & 0x01 != 0;
        if r.flags & 0xE0 != 0 {
            return Err(bad_cdb(1, Some(7)));
        }
        if anchor {
            return Err(bad_cdb(1, Some(4)));
        }
        if unmap && !self.cfg.thin_provisioning {
            return Err(bad_cdb(1, Some(3)));
        }
        if self.write_protected() {
            return Err(Fail::Sense(Sense::new(
                key::DATA_PROTECT,
                asc::WRITE_PROTECTED,
            )));
        }
        self.check_range(r.lba, r.nlb)?;
        // WSNZ is clear in the Block Limits page: zero blocks means from the LBA to the end of
        // the medium (SBC-4 5.49), within MAXIMUM WRITE SAME LENGTH like any other count.
        let nlb = if r.nlb == 0 {
            self.blocks() - r.lba
        } else {
            r.nlb
        };
        if nlb > MAX_WRITE_SAME_BLOCKS {
            return Err(bad_cdb(if sixteen { 10 } else { 7 }, None));
        }
        if nlb == 0 {
            // Zero blocks at the end of the medium: nothing to write.
            return Ok(Outcome::good(Bytes::new()));
        }
        let r = Rw { nlb, ..r };
        let bs = self.block_size as usize;
        let block: Vec<u8> = if ndob {
            vec![0u8; bs]
        } else {
            // Exactly one block of data-out (SBC-3 5.42).
            if cmd.data_out.len() != bs {
                return Err(illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
            }
            cmd.data_out.to_vec()
        };
        let off = r.lba * self.block_size;
        let end = off + r.nlb * self.block_size;
        let _g = self.ranges.lock(off, end);
        if unmap {
            // With UNMAP the blocks are deallocated whatever the data-out holds; LBPRZ says
            // they then read as zeros (SBC-3 5.43, 4.7.3.3).
            self.backend
                .unmap(off, end - off)
                .map_err(|e| self.medium_error(e, true))?;
        } else if block.iter().all(|&b| b == 0) {
            // Zeros: the store's own write-zeroes where it has one (no data sent).
            self.backend
                .write_zeroes(off, end - off)
                .map_err(|e| self.medium_error(e, true))?;
        } else {
            // Write in pieces of up to 1 MiB built from the pattern, no larger than the range.
            let per = ((1usize << 20) / bs).max(1).min(r.nlb as usize);
            let chunk: Vec<u8> = block.repeat(per);
            let mut pos = off;
            while pos < end {
                let n = ((end - pos) as usize).min(chunk.len());
                self.backend
                    .write_at(pos, &chunk[..n])
                    .map_err(|e| self.medium_error(e, true))?;
                pos += n as u64;
            }
        }
        drop(_g);
        if self.write_through(false) {
            self.backend
                .flush()
                .map_err(|e| self.medium_error(e, true))?;
        }
        Ok(Outcome::good(Bytes::new()))
    }

    fn compare_and_write(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let Some((off, n, flush)) = self.caw_plan(cmd, c)? else {
            return Ok(Outcome::good(Bytes::new()));
        };
        let _g = self.ranges.lock(off, off + n as u64);
        let mut cur = vec![0u8; n];
        self.backend
            .read_at(off, &mut cur)
            .map_err(|e| self.medium_error(e, false))?;
        if let Some(o) = first_diff(&cur, &cmd.data_out[..n]) {
            return Err(miscompare(o as u64));
        }
        self.backend
            .write_at(off, &cmd.data_out[n..2 * n])
            .map_err(|e| self.medium_error(e, true))?;
        drop(_g);
        if flush {
            self.backend
                .flush()
                .map_err(|e| self.medium_error(e, true))?;
        }
        Ok(Outcome::good(Bytes::new()))
    }

    /// A COMPARE AND WRITE checked: None when it has no blocks (GOOD), else its byte offset,
    /// its length (of each half of the data-out) and whether a flush follows.
    fn caw_plan(&self, cmd: &Command<'_>, c: &Cdb) -> Result<Option<(u64, usize, bool)>, Fail> {
        let Some(r) = rw_fields(c) else {
            return Err(illegal(asc::INVALID_COMMAND_OPERATION_CODE));
        };
        if r.flags & 0xE0 != 0 {
            return Err(bad_cdb(1, Some(7)));
        }
        if self.write_protected() {
            return Err(Fail::Sense(Sense::new(
                key::DATA_PROTECT,
                asc::WRITE_PROTECTED,
            )));
        }
        self.check_range(r.lba, r.nlb)?;
        if r.nlb > MAX_COMPARE_AND_WRITE_BLOCKS as u64 {
            return Err(bad_cdb(13, None));
        }
        let bs = self.block_size as usize;
        let n = r.nlb as usize * bs;
        // SBC-3 5.2: the data-out buffer holds the verify data then the write data. A buffer
        // that does not match NUMBER OF LOGICAL BLOCKS (e.g. 256 blocks wrapped to 0 in the
        // one-byte field) is an invalid CDB.
        if cmd.data_out.len() != 2 * n {
            return Err(bad_cdb(13, None));
        }
        if r.nlb == 0 {
            return Ok(None);
        }
        Ok(Some((
            r.lba * self.block_size,
            n,
            self.write_through(r.flags & 0x08 != 0),
        )))
    }
}

/// MISCOMPARE DURING VERIFY OPERATION (SBC-3 5.2, 5.29), the offset of the first differing
/// byte in INFORMATION.
fn miscompare(at: u64) -> Fail {
    Fail::Sense(Sense::new(key::MISCOMPARE, asc::MISCOMPARE_DURING_VERIFY).with_info(at))
}

/// A READ after its checks.
enum Planned {
    Done(Outcome),
    Read { off: u64, len: usize, unread: u32 },
}

/// A write after its checks: `len` bytes of its data-out at byte `off`.
struct WritePlan {
    off: u64,
    len: usize,
    /// FUA, WRITE AND VERIFY, or the write cache disabled: flushed before GOOD.
    flush: bool,
    atomic: bool,
}

/// Most unit attentions kept per nexus; older ones beyond this are dropped (SAM-5 5.14 lets
/// a device server report fewer when it runs out of space).
const MAX_UA_QUEUE: usize = 8;

/// The oldest pending unit attention of `n`, removed. A drained queue leaves the map, so that
/// with no unit attention pending anywhere (the usual state) the check costs no lookup.
fn pop_ua(st: &mut State, n: &Nexus) -> Option<Sense> {
    if st.ua.is_empty() {
        return None;
    }
    let q = st.ua.get_mut(n)?;
    let s = q.pop_front();
    if q.is_empty() {
        st.ua.remove(n);
    }
    s
}

/// The shared reservations in `bytes` (none stored yet: none, able to persist).
fn parse_shared(bytes: &[u8]) -> Result<PrState, BackendError> {
    if bytes.is_empty() {
        return Ok(PrState::new(true));
    }
    PrState::from_bytes(bytes).map_err(|e| {
        BackendError::Shared(format!(
            "the shared persistent reservations do not parse: {e}"
        ))
    })
}

/// The unit attentions of a shared change for the nexuses this gateway has seen (the others
/// are another gateway's: it raises theirs when it reads the change).
fn push_ua_seen(st: &mut State, uas: Vec<(Nexus, Sense)>, except: Option<&Nexus>) {
    push_pr_uas(st, uas, true, except);
}

/// The unit attentions a reservation change owes: each to its nexus (`only_seen`: if this unit
/// has seen it), and one owed to an initiator device's registration to each port of it this
/// unit has seen; none to `except`, the nexus whose command made the change.
fn push_pr_uas(st: &mut State, uas: Vec<(Nexus, Sense)>, only_seen: bool, except: Option<&Nexus>) {
    for (n, s) in uas {
        if crate::pr::is_device(&n) {
            let ports: Vec<Nexus> = st
                .seen
                .iter()
                .filter(|m| crate::pr::covers(&n, m) && Some(*m) != except)
                .cloned()
                .collect();
            for m in &ports {
                push_ua(st, m, s);
            }
        } else if Some(&n) != except && (!only_seen || st.seen.contains(&n)) {
            push_ua(st, &n, s);
        }
    }
}

/// With port group states shared by gateways, who changed each group is what the record
/// says, the same through every gateway (one started since included).
fn changed_as_stored(st: &mut State, stored: &crate::alua::Stored) {
    st.alua_changed = stored
        .states
        .iter()
        .map(|(id, (_, by))| (*id, *by))
        .collect();
}

fn shared_failed(e: impl std::fmt::Display) -> Fail {
    tracing::error!("shared persistent reservations: {e}");
    Fail::Sense(Sense::new(
        key::HARDWARE_ERROR,
        asc::INTERNAL_TARGET_FAILURE,
    ))
}

fn push_ua(st: &mut State, n: &Nexus, s: Sense) {
    let q = st.ua.entry(n.clone()).or_default();
    if q.contains(&s) {
        return;
    }
    if q.len() >= MAX_UA_QUEUE {
        q.pop_front();
    }
    q.push_back(s);
}

/// The index of the first byte where `a` and `b` differ.
pub(crate) fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b.iter()).position(|(x, y)| x != y)
}

/// Copies `s` into `dst`, space padded and cut to fit (SPC-4 4.4.1 ASCII fields).
fn pad_into(dst: &mut [u8], s: &str) {
    dst.fill(b' ');
    for (d, b) in dst
        .iter_mut()
        .zip(s.bytes().filter(|b| (0x20..0x7F).contains(b)))
    {
        *d = b;
    }
}
