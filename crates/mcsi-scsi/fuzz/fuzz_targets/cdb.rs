//! The SCSI device server fed sequences of arbitrary commands from three I_T nexuses to two RAM
//! logical units (512- and 4096-byte blocks), with LU resets and nexus losses in between.
//!
//! Beyond "no panic", every command must end in a SAM-5 status; CHECK CONDITION carries sense
//! data that parses and says why; data-in stays within what the CDB allows; no allocation is
//! larger than the LU or the device server's 1 MiB WRITE SAME buffer; the first command of a new
//! nexus (and the first after a LU reset) reports the unit attention; and the medium behaves
//! like memory: a shadow copy follows every write-type command that returned GOOD, a command
//! that did not return GOOD changes nothing, and every GOOD READ returns the shadow's bytes.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use mcsi_scsi::sense::{asc, key};
use mcsi_scsi::{
    lun, status, Command, DeviceServer, LogicalUnit, LuConfig, Nexus, Outcome, RamBackend, Sense,
    TaskAttribute,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The largest single allocation since it was last reset.
static PEAK: AtomicUsize = AtomicUsize::new(0);

struct Peak;

// SAFETY: forwards to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for Peak {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        PEAK.fetch_max(l.size(), Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        PEAK.fetch_max(l.size(), Ordering::Relaxed);
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        PEAK.fetch_max(new, Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Peak = Peak;

/// (block size, capacity in bytes) of LUN 0 and 1; 384 KiB spans three RAM chunks.
const LUS: [(u32, usize); 2] = [(512, 256 << 10), (4096, 384 << 10)];
const MAX_LU_BYTES: usize = 384 << 10;
/// The device server builds WRITE SAME data in pieces of this size.
const WRITE_SAME_PIECE: usize = 1 << 20;
/// Far beyond any one command on these LUs, even under a sanitizer on a busy machine.
const SLOW: Duration = Duration::from_secs(5);

#[path = "../../../mcsi-proto/fuzz/fuzz_targets/input.rs"]
mod input;
use input::Input;

/// Operation codes the device server implements, then a few common ones it does not.
const OPS: &[u8] = &[
    0x00, 0x03, 0x08, 0x0A, 0x12, 0x15, 0x16, 0x17, 0x1A, 0x1B, 0x1E, 0x25, 0x28, 0x2A, 0x2E, 0x2F,
    0x34, 0x35, 0x37, 0x41, 0x42, 0x55, 0x56, 0x57, 0x5A, 0x5E, 0x5F, 0x88, 0x89, 0x8A, 0x8B, 0x8E,
    0x8F, 0x90, 0x91, 0x93, 0x9C, 0x9E, 0xA0, 0xA3, 0xA8, 0xAA, 0xAE, 0xAF, 0xB7, 0x04, 0x1D, 0x3B, 0x3C,
    0x48, 0x4D, 0x7F, 0x83, 0x84, 0x9F, 0xA4,
];

/// Reads and writes the shadow copy checks most closely.
const RW: &[u8] = &[0x28, 0x2A, 0x88, 0x8A];

/// What a command does to the medium when it returns GOOD.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Effect {
    None,
    Read,
    Write,
    OrWrite,
    CompareAndWrite,
    WriteSame,
    Unmap,
    /// Not known here: forget the LU's contents.
    Unknown,
}

fn effect(op: u8) -> Effect {
    match op {
        0x08 | 0x28 | 0xA8 | 0x88 => Effect::Read,
        0x0A | 0x2A | 0xAA | 0x8A | 0x2E | 0xAE | 0x8E | 0x9C => Effect::Write,
        0x8B => Effect::OrWrite,
        0x89 => Effect::CompareAndWrite,
        0x41 | 0x93 => Effect::WriteSame,
        0x42 => Effect::Unmap,
        0x00 | 0x03 | 0x12 | 0x15 | 0x16 | 0x17 | 0x1A | 0x1B | 0x1E | 0x25 | 0x2F | 0x34
        | 0x35 | 0x37 | 0x55 | 0x56 | 0x57 | 0x5A | 0x5E | 0x5F | 0x8F | 0x90 | 0x91 | 0x9E
        | 0xA0 | 0xA3 | 0xAF | 0xB7 => Effect::None,
        _ => Effect::Unknown,
    }
}

fn be(b: &[u8]) -> u64 {
    b.iter().fold(0, |v, &x| (v << 8) | u64::from(x))
}

/// LBA, block count and byte-1 flags of a read/write-type CDB (SBC-3), zero padded as the
/// device server reads it.
fn rw_fields(c: &[u8; 32]) -> Option<(u64, u64, u8)> {
    Some(match c[0] {
        0x08 | 0x0A => {
            let n = u64::from(c[4]);
            (be(&c[1..4]) & 0x1F_FFFF, if n == 0 { 256 } else { n }, 0)
        }
        0x28 | 0x2A | 0x2E | 0x2F | 0x34 | 0x35 | 0x41 => (be(&c[2..6]), be(&c[7..9]), c[1]),
        0xA8 | 0xAA | 0xAE | 0xAF => (be(&c[2..6]), be(&c[6..10]), c[1]),
        0x88 | 0x8A | 0x8B | 0x8E | 0x8F | 0x90 | 0x91 | 0x93 => {
            (be(&c[2..10]), be(&c[10..14]), c[1])
        }
        0x89 => (be(&c[2..10]), u64::from(c[13]), c[1]),
        // WRITE ATOMIC(16): a two-byte TRANSFER LENGTH in bytes 12-13.
        0x9C => (be(&c[2..10]), be(&c[12..14]), c[1]),
        _ => return None,
    })
}

/// The contents the LU must have: `known[b]` says whether block `b` of `data` is certain.
struct Shadow {
    bs: usize,
    data: Vec<u8>,
    known: Vec<bool>,
}

impl Shadow {
    fn new(bs: usize, bytes: usize) -> Self {
        // A RAM LU starts out zeroed (LBPRZ).
        Shadow {
            bs,
            data: vec![0; bytes],
            known: vec![true; bytes / bs],
        }
    }
    fn blocks(&self) -> u64 {
        self.known.len() as u64
    }
    fn range(&self, lba: u64, nlb: u64) -> std::ops::Range<usize> {
        let end = lba.saturating_add(nlb).min(self.blocks());
        lba.min(end) as usize..end as usize
    }
    fn set(&mut self, b: usize, bytes: &[u8]) {
        self.data[b * self.bs..(b + 1) * self.bs].copy_from_slice(bytes);
        self.known[b] = true;
    }
    fn block(&self, b: usize) -> Option<&[u8]> {
        self.known[b].then(|| &self.data[b * self.bs..(b + 1) * self.bs])
    }
    fn forget(&mut self, lba: u64, nlb: u64) {
        let r = self.range(lba, nlb);
        self.known[r].fill(false);
    }
}

fn nexus(i: usize) -> Nexus {
    // Two ports of one initiator (different ISIDs) and a second initiator.
    let port = match i {
        0 => "iqn.2026-01.org.mcsi:host1,i,0x800000000001",
        1 => "iqn.2026-01.org.mcsi:host1,i,0x800000000002",
        _ => "iqn.2026-01.org.mcsi:host2,i,0x400000000001",
    };
    Nexus {
        initiator_port: Arc::from(port),
        target_port: Arc::from("iqn.2026-01.org.mcsi:fuzz,t,0x0001"),
        relative_port: 1,
    }
}

/// Cheap distinct data, so that a stale block is told apart from a fresh one.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 4);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

fn put(c: &mut [u8], at: usize, v: u64, n: usize) {
    c[at..at + n].copy_from_slice(&v.to_be_bytes()[8 - n..]);
}

/// In-range LBA and block count (sometimes reaching exactly to the end, or one past it). LBAs
/// are often drawn from a few around the RAM chunk boundaries, so that writes and reads meet.
fn lba_nlb(inp: &mut Input<'_>, blocks: u64, bs: usize) -> (u64, u64) {
    let chunk = (128 << 10) / bs as u64;
    let lba = match inp.u8() {
        0..=0x7F => u64::from(inp.u16()) % blocks,
        x => {
            [0, 1, chunk - 1, chunk, 2 * chunk - 1, blocks - 1][usize::from(x) % 6].min(blocks - 1)
        }
    };
    let room = blocks - lba;
    let nlb = match inp.u8() {
        0xF8..=0xFB => room,
        0xFC..=0xFE => room + 1,
        0xFF => 0,
        x => u64::from(x) % room.min(48) + 1,
    };
    (lba, nlb)
}

const PR_KEYS: [u64; 4] = [0, 0x1111, 0x2222, 0xABCD_0000_0000_0001];

fn pr_key(inp: &mut Input<'_>) -> u64 {
    match inp.u8() {
        x if x < 0xF0 => PR_KEYS[usize::from(x) % PR_KEYS.len()],
        _ => inp.u64(),
    }
}

/// Fills in the fields of a CDB for the LU so that it stands a chance of doing something; returns
/// the parameter list for commands that take one.
fn shape(c: &mut [u8; 32], inp: &mut Input<'_>, blocks: u64, bs: usize) -> Option<Vec<u8>> {
    // No protection information, no NACA: the usual case.
    c[1] &= 0x1F;
    for b in [5, 9, 11, 15] {
        c[b] &= !0x04;
    }
    match c[0] {
        0x08 | 0x0A => {
            let (lba, nlb) = lba_nlb(inp, blocks, bs);
            let nlb = if nlb > 255 { 0 } else { nlb };
            put(c, 1, lba & 0x1F_FFFF, 3);
            c[4] = nlb as u8;
        }
        0x28 | 0x2A | 0x2E | 0x2F | 0x34 | 0x35 | 0x41 => {
            let (lba, nlb) = lba_nlb(inp, blocks, bs);
            put(c, 2, lba, 4);
            put(c, 7, nlb, 2);
        }
        0xA8 | 0xAA | 0xAE | 0xAF => {
            let (lba, nlb) = lba_nlb(inp, blocks, bs);
            put(c, 2, lba, 4);
            put(c, 6, nlb, 4);
        }
        0x88 | 0x8A | 0x8B | 0x8E | 0x8F | 0x90 | 0x91 | 0x93 => {
            let (lba, nlb) = lba_nlb(inp, blocks, bs);
            put(c, 2, lba, 8);
            put(c, 10, nlb, 4);
        }
        0x89 => {
            let (lba, nlb) = lba_nlb(inp, blocks, bs);
            put(c, 2, lba, 8);
            c[13] = nlb.min(255) as u8;
        }
        0x9C => {
            let (lba, nlb) = lba_nlb(inp, blocks, bs);
            put(c, 2, lba, 8);
            put(c, 12, nlb.min(0xFFFF), 2);
        }
        0x9E => {
            c[1] = if inp.u8() & 1 == 0 { 0x10 } else { 0x12 };
            let (lba, _) = lba_nlb(inp, blocks, bs);
            put(c, 2, lba, 8);
            put(c, 10, u64::from(inp.u16()), 4);
        }
        0x12 => {
            c[1] &= 0x01;
            c[2] = if c[1] == 0 {
                0
            } else {
                [0x00, 0x80, 0x83, 0xB0, 0xB1, 0xB2][usize::from(inp.u8()) % 6]
            };
        }
        0xA3 => c[1] = if inp.u8() & 1 == 0 { 0x0C } else { 0x0D },
        0x5F => {
            c[1] &= 0x07;
            let t = [1u8, 3, 5, 6, 7, 8][usize::from(inp.u8()) % 6];
            c[2] = t;
            put(c, 5, 24, 4);
            let mut p = vec![0u8; 24];
            put(&mut p, 0, pr_key(inp), 8);
            put(&mut p, 8, pr_key(inp), 8);
            if inp.u8() < 0x10 {
                p[20] = inp.u8();
            }
            return Some(p);
        }
        0x15 | 0x55 => {
            let ten = c[0] == 0x55;
            let mut p = vec![0u8; if ten { 8 } else { 4 }];
            let sel = inp.u8();
            if sel & 1 != 0 {
                // A short block descriptor with our block length, zero, or anything.
                let bl = match sel >> 6 {
                    0 | 1 => bs as u64,
                    2 => 0,
                    _ => u64::from(inp.u16()),
                };
                let mut bd = vec![0u8; 8];
                put(&mut bd, 0, blocks, 4);
                put(&mut bd, 5, bl, 3);
                if ten {
                    p[7] = 8;
                } else {
                    p[3] = 8;
                }
                p.extend_from_slice(&bd);
            }
            for _ in 0..1 + ((sel >> 1) & 1) {
                let bits = inp.u8();
                match inp.u8() % 4 {
                    0 => {
                        let mut pg = vec![0u8; 20];
                        pg[0] = 0x08;
                        pg[1] = 0x12;
                        pg[2] = bits & 0x04;
                        p.extend_from_slice(&pg);
                    }
                    1 | 2 => {
                        // Control page: D_SENSE and SWP are changeable.
                        let mut pg = vec![0u8; 12];
                        pg[0] = 0x0A;
                        pg[1] = 0x0A;
                        pg[2] = bits & 0x04;
                        pg[3] = 0x10;
                        pg[4] = if bits & 0x18 == 0x18 { 0x08 } else { 0 };
                        p.extend_from_slice(&pg);
                    }
                    _ => {
                        let n = usize::from(inp.u8() % 24);
                        p.extend_from_slice(inp.take(n));
                    }
                }
            }
            if ten {
                put(c, 7, p.len() as u64, 2);
            } else {
                c[4] = p.len().min(255) as u8;
            }
            return Some(p);
        }
        0x83 => {
            // EXTENDED COPY (LID1): one or two identification CSCDs naming LU 0 or 1 (sometimes
            // a unit that does not exist), and up to three block-to-block segments.
            c[1] = 0;
            let ncscd = 1 + usize::from(inp.u8() % 2);
            let nseg = usize::from(inp.u8() % 4);
            let mut p = vec![0u8; 16];
            p[0] = inp.u8();
            p[1] = (inp.u8() % 4) << 3;
            put(&mut p, 2, 32 * ncscd as u64, 2);
            put(&mut p, 8, 28 * nseg as u64, 4);
            for _ in 0..ncscd {
                let mut d = [0u8; 32];
                d[0] = 0xE4;
                d[4] = 0x01;
                d[5] = 0x03;
                d[7] = 16;
                d[8..24].copy_from_slice(&LuConfig::default().naa_id);
                d[23] = 1 + inp.u8() % 3;
                p.extend_from_slice(&d);
            }
            for _ in 0..nseg {
                let (src, n1) = lba_nlb(inp, blocks, bs);
                let (dst, n2) = lba_nlb(inp, blocks, bs);
                let mut d = [0u8; 28];
                d[0] = 0x02;
                put(&mut d, 2, 0x18, 2);
                put(&mut d, 4, u64::from(inp.u8() % 3), 2);
                put(&mut d, 6, u64::from(inp.u8() % 3), 2);
                put(&mut d, 10, n1.min(n2), 2);
                put(&mut d, 12, src, 8);
                put(&mut d, 20, dst, 8);
                p.extend_from_slice(&d);
            }
            put(c, 10, p.len() as u64, 4);
            return Some(p);
        }
        0x84 => {
            c[1] = [0x00, 0x03][usize::from(inp.u8() & 1)];
            put(c, 10, 1024, 4);
        }
        0x48 => {
            // SANITIZE: a service action, sometimes IMMED or AUSE; OVERWRITE with a pattern.
            let sa = [0x01, 0x02, 0x03, 0x1F][usize::from(inp.u8() % 4)];
            c[1] = sa | (inp.u8() & 0xA0);
            c[2..7].fill(0);
            if sa == 0x01 {
                let ilen = 1 + usize::from(inp.u8()) % bs;
                // One or two passes: the whole LU is written each time.
                let mut p = vec![(inp.u8() & 0x80) | (1 + inp.u8() % 2), 0, 0, 0];
                put(&mut p, 2, ilen as u64, 2);
                p.extend((0..ilen).map(|i| i as u8 ^ 0x5A));
                put(c, 7, p.len() as u64, 2);
                return Some(p);
            }
            put(c, 7, 0, 2);
        }
        0x42 => {
            c[1] &= 0xFE;
            let n = usize::from(inp.u8() % 5);
            let mut p = vec![0u8; 8];
            put(&mut p, 0, 6 + 16 * n as u64, 2);
            put(&mut p, 2, 16 * n as u64, 2);
            for _ in 0..n {
                let (lba, nlb) = lba_nlb(inp, blocks, bs);
                let mut d = [0u8; 16];
                put(&mut d, 0, lba, 8);
                put(&mut d, 8, nlb, 4);
                p.extend_from_slice(&d);
            }
            put(c, 7, p.len() as u64, 2);
            return Some(p);
        }
        _ => {}
    }
    None
}

fn sam_status(s: u8) -> bool {
    matches!(
        s,
        status::GOOD
            | status::CHECK_CONDITION
            | status::CONDITION_MET
            | status::BUSY
            | status::RESERVATION_CONFLICT
            | status::TASK_SET_FULL
            | status::ACA_ACTIVE
            | status::TASK_ABORTED
    )
}

/// Sense data of a CHECK CONDITION: fixed or descriptor format (SPC-4 4.5) with consistent
/// lengths, and a reason.
fn check_sense(o: &Outcome) -> Sense {
    let b = o
        .sense
        .as_ref()
        .expect("CHECK CONDITION without sense data");
    assert!(!b.is_empty(), "empty sense data");
    let code = b[0] & 0x7F;
    assert!(
        matches!(code, 0x70..=0x73),
        "sense response code {code:#04x}"
    );
    if code >= 0x72 {
        assert!(b.len() >= 8, "descriptor sense of {} bytes", b.len());
        assert_eq!(b.len(), 8 + usize::from(b[7]), "additional sense length");
        assert_eq!(b[1] & 0xF0, 0, "reserved bits beside the sense key");
    } else {
        assert!(b.len() >= 18, "fixed sense of {} bytes", b.len());
        assert!(b.len() >= 8 + usize::from(b[7]), "additional sense length");
    }
    let s = Sense::parse(b).expect("sense data does not parse");
    assert!(s.key <= 0x0F);
    // A block device has no filemark, end-of-medium or ILI condition to report under NO SENSE:
    // a CHECK CONDITION must say what went wrong.
    assert_ne!(s.key, key::NO_SENSE, "CHECK CONDITION with NO SENSE");
    assert!(o.data_in.is_empty(), "data-in with CHECK CONDITION");
    s
}

struct Lu {
    unit: Arc<LogicalUnit>,
    shadow: Shadow,
    /// Per nexus: has the LU seen it; the unit attention it must report next, if any.
    seen: [bool; 3],
    ua: [Option<(u8, u8)>; 3],
    /// LBA and block count of the last write that returned GOOD.
    last_write: Option<(u64, u64)>,
}

/// What a GOOD EXTENDED COPY did: each segment's source blocks, as known before the segment,
/// now sit at its destination (LU `naa[15] - 1` per CSCD descriptor).
fn copy_in_shadows(lus: &mut [Lu], p: &[u8]) {
    if p.len() < 16 {
        return;
    }
    let cl = be(&p[2..4]) as usize;
    let sl = be(&p[8..12]) as usize;
    let units: Vec<usize> = p[16..16 + cl]
        .chunks(32)
        .map(|d| usize::from(d[23]) - 1)
        .collect();
    for d in p[16 + cl..16 + cl + sl].chunks(28) {
        let (si, di) = (units[be(&d[4..6]) as usize], units[be(&d[6..8]) as usize]);
        let (n, src, dst) = (be(&d[10..12]), be(&d[12..20]), be(&d[20..28]));
        let blocks: Vec<Option<Vec<u8>>> = lus[si]
            .shadow
            .range(src, n)
            .map(|b| lus[si].shadow.block(b).map(<[u8]>::to_vec))
            .collect();
        let sh = &mut lus[di].shadow;
        for (k, b) in sh.range(dst, n).enumerate() {
            match &blocks[k] {
                Some(v) => sh.set(b, v),
                None => sh.forget(dst + k as u64, 1),
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mut lus: Vec<Lu> = LUS
        .iter()
        .enumerate()
        .map(|(i, &(bs, bytes))| {
            let backend = Arc::new(RamBackend::new(bytes as u64).expect("RAM backend"));
            let mut naa_id = LuConfig::default().naa_id;
            naa_id[15] = i as u8 + 1;
            let cfg = LuConfig {
                block_size: bs,
                serial: format!("fuzz{i}"),
                naa_id,
                ..LuConfig::default()
            };
            Lu {
                unit: Arc::new(LogicalUnit::new(backend, cfg)),
                shadow: Shadow::new(bs as usize, bytes),
                seen: [false; 3],
                ua: [None; 3],
                last_write: None,
            }
        })
        .collect();
    let server = DeviceServer::new(
        lus.iter()
            .enumerate()
            .map(|(i, l)| (i as u16, l.unit.clone()))
            .collect(),
    );
    let nexuses = [nexus(0), nexus(1), nexus(2)];

    for step in 0..48u32 {
        if inp.is_empty() {
            break;
        }
        let action = inp.u8();
        match action {
            0..=3 => {
                let l = &mut lus[usize::from(action & 1)];
                l.unit.reset();
                for n in 0..3 {
                    if l.seen[n] {
                        l.ua[n] = Some(asc::BUS_DEVICE_RESET);
                    }
                }
                continue;
            }
            4 => {
                server.reset_all();
                for l in lus.iter_mut() {
                    for n in 0..3 {
                        if l.seen[n] {
                            l.ua[n] = Some(asc::BUS_DEVICE_RESET);
                        }
                    }
                }
                continue;
            }
            5 => {
                let n = usize::from(inp.u8()) % 3;
                server.nexus_lost(&nexuses[n]);
                for l in lus.iter_mut() {
                    l.seen[n] = false;
                    l.ua[n] = None;
                }
                continue;
            }
            _ => {}
        }
        let ni = usize::from(action) % 3;
        // Which LU: by its usual LUN, LUN 1 in flat space addressing, or any 8 bytes.
        let (raw, li) = match inp.u8() {
            0..=119 => (lun::encode(0), Some(0)),
            120..=229 => (lun::encode(1), Some(1)),
            230..=239 => (0x4001_0000_0000_0000, Some(1)),
            _ => {
                let raw = inp.u64();
                (raw, lun::decode(raw).filter(|&i| i < 2).map(usize::from))
            }
        };
        let pick = inp.u8();
        // Sometimes read back the LU's last write, to check it often.
        let readback = match (pick, li) {
            (0xD0..=0xDF, Some(i)) => lus[i].last_write,
            _ => None,
        };
        let op = match pick {
            0..=0x8F => OPS[usize::from(pick) % OPS.len()],
            0x90..=0xCF => RW[usize::from(pick) % RW.len()],
            0xD0..=0xDF => [0x28, 0x88][usize::from(pick & 1)],
            _ => inp.u8(),
        };
        let form = if readback.is_some() { 0 } else { inp.u8() };
        let natural = match op >> 5 {
            0 => 6,
            1 | 2 => 10,
            5 => 12,
            _ => 16,
        };
        let len = match form & 7 {
            0..=3 => natural,
            4 => 16,
            5 => 32,
            6 => [6, 10, 12, 16, 32][usize::from(inp.u8()) % 5],
            _ => usize::from(inp.u8() % 41),
        };
        let mut c = [0u8; 32];
        let raw_cdb = inp.take(len.min(32));
        c[..raw_cdb.len()].copy_from_slice(raw_cdb);
        c[0] = op;
        let (bs, blocks) = match li {
            Some(i) => (lus[i].shadow.bs, lus[i].shadow.blocks()),
            None => (512, 64),
        };
        let params = if let Some((lba, nlb)) = readback {
            if op == 0x28 {
                put(&mut c, 2, lba, 4);
                put(&mut c, 7, nlb, 2);
            } else {
                put(&mut c, 2, lba, 8);
                put(&mut c, 10, nlb, 4);
            }
            c[1] = 0;
            c[len - 1] = 0;
            None
        } else if form & 0x08 != 0 {
            shape(&mut c, &mut inp, blocks, bs)
        } else {
            None
        };
        // Longer than 32 bytes: the rest is zeros.
        let mut cdb = c[..len.min(32)].to_vec();
        cdb.resize(len, 0);
        // What the device server sees: an empty CDB reads as TEST UNIT READY, fields past the
        // end as zeros.
        let mut c = [0u8; 32];
        c[..len.min(32)].copy_from_slice(&cdb[..len.min(32)]);
        let op = c[0];

        let phase = server.data_phase(raw, &cdb);
        let _ = server.blocking(raw, &cdb);
        let want = (phase.data_out_len as usize).min(MAX_LU_BYTES + 8192);
        let seed = (step << 16) ^ u32::from(inp.u16()) ^ 0x9E37_79B9;
        let sel = inp.u8();
        let mut data_out = match (sel & 3, params) {
            (3, _) => Vec::new(),
            (2, _) => {
                let n = usize::from(inp.u8());
                inp.take(n).to_vec()
            }
            (1, p) => {
                let mut v = p.unwrap_or_else(|| pattern(want, seed));
                v.truncate(usize::from(inp.u16()) % (v.len() + 64));
                v
            }
            (_, Some(p)) => p,
            (_, None) => pattern(want, seed),
        };
        // COMPARE AND WRITE and VERIFY with BYTCHK compare with the medium: offer them the
        // shadow's bytes sometimes, so that they can succeed.
        if let (Some(i), true) = (li, sel & 4 != 0) {
            let sh = &lus[i].shadow;
            if let Some((lba, nlb, flags)) = rw_fields(&c) {
                let bytchk = matches!(op, 0x2F | 0xAF | 0x8F) && flags & 0x06 == 0x02;
                if op == 0x89 || bytchk {
                    for (k, b) in sh.range(lba, nlb).enumerate() {
                        if let (Some(src), Some(dst)) =
                            (sh.block(b), data_out.get_mut(k * bs..(k + 1) * bs))
                        {
                            dst.copy_from_slice(src);
                        }
                    }
                }
            }
        }
        let data_in_limit = match (sel >> 4) & 3 {
            0 => u32::MAX,
            1 => phase.data_in_len,
            2 => inp.u32(),
            _ => u32::from(inp.u8()),
        };
        let attr = [
            TaskAttribute::Simple,
            TaskAttribute::Ordered,
            TaskAttribute::HeadOfQueue,
            TaskAttribute::Aca,
        ][usize::from(sel >> 6)];
        let data_out = Bytes::from(data_out);

        PEAK.store(0, Ordering::Relaxed);
        let t0 = Instant::now();
        let o = server.execute(
            raw,
            Command {
                nexus: &nexuses[ni],
                cdb: &cdb,
                data_out: data_out.clone(),
                data_in_limit,
                attr,
                pace: None,
            },
        );
        let took = t0.elapsed();
        let peak = PEAK.load(Ordering::Relaxed);

        assert!(took < SLOW, "{op:#04x} took {took:?}");
        let bound = MAX_LU_BYTES.max(WRITE_SAME_PIECE) + 64 * 1024;
        assert!(peak <= bound, "{op:#04x} allocated {peak} bytes at once");
        assert!(sam_status(o.status), "status {:#04x}", o.status);
        let sense = if o.status == status::CHECK_CONDITION {
            Some(check_sense(&o))
        } else {
            assert!(
                o.sense.is_none(),
                "sense data with status {:#04x}",
                o.status
            );
            None
        };
        // The device server promises at most data_phase's data-in before the command runs (the
        // transport then cuts it to data_in_limit and reports the residual).
        let produced = o.data_in.len() + o.data_in_unread as usize;
        assert!(
            produced <= phase.data_in_len as usize,
            "{op:#04x}: {produced} bytes of data-in, data_phase said at most {}",
            phase.data_in_len
        );
        // What is left unread lies beyond what the transport sends, and only whole blocks of a
        // READ are left unread.
        if o.data_in_unread > 0 {
            assert!(
                o.data_in.len() >= data_in_limit as usize,
                "{op:#04x}: {} bytes read, {} unread, limit {data_in_limit}",
                o.data_in.len(),
                o.data_in_unread
            );
            assert!(effect(op) == Effect::Read, "{op:#04x} left data-in unread");
        }

        let Some(i) = li else { continue };
        let l = &mut lus[i];
        // REPORT LUNS is answered for the whole target and never reaches the LU.
        if op == 0xA0 {
            continue;
        }
        if !l.seen[ni] {
            l.seen[ni] = true;
            l.ua[ni] = Some(asc::POWER_ON_RESET);
        }
        match op {
            // INQUIRY neither reports nor clears a unit attention (SAM-5 5.14).
            0x12 => {}
            // REQUEST SENSE returns it as data.
            0x03 => l.ua[ni] = None,
            _ => {
                if let Some(code) = l.ua[ni].take() {
                    let s = sense.expect("a pending unit attention was not reported");
                    assert_eq!(
                        (s.key, s.asc, s.ascq),
                        (key::UNIT_ATTENTION, code.0, code.1)
                    );
                    continue;
                }
            }
        }

        let sh = &mut l.shadow;
        let bsz = sh.bs;
        let eff = effect(op);
        if o.status != status::GOOD {
            // Not performed: nothing changed (checked by later reads).
            continue;
        }
        if op == 0x83 {
            let list = (be(&c[10..14]) as usize).min(data_out.len());
            copy_in_shadows(&mut lus, &data_out[..list]);
            continue;
        }
        let fields = rw_fields(&c);
        match (eff, fields) {
            (Effect::Read, Some((lba, nlb, _))) => {
                assert_eq!(produced as u64, nlb * bsz as u64, "GOOD READ length");
                assert_eq!(o.data_in.len() % bsz, 0, "GOOD READ of whole blocks");
                let read = (o.data_in.len() / bsz) as u64;
                for (k, b) in sh.range(lba, read).enumerate() {
                    let got = &o.data_in[k * bsz..(k + 1) * bsz];
                    match sh.block(b) {
                        Some(want) => assert!(
                            got == want,
                            "LU {i} block {b} read back other data than was written"
                        ),
                        None => sh.set(b, got),
                    }
                }
            }
            (Effect::Write, Some((lba, nlb, _))) => {
                // Only whole blocks that came are written.
                let have = (data_out.len() / bsz).min(nlb as usize);
                for (k, b) in sh.range(lba, have as u64).enumerate() {
                    sh.set(b, &data_out[k * bsz..(k + 1) * bsz]);
                }
                if have > 0 {
                    l.last_write = Some((lba, have as u64));
                }
            }
            (Effect::OrWrite, Some((lba, nlb, _))) => {
                let have = (data_out.len() / bsz).min(nlb as usize);
                for (k, b) in sh.range(lba, have as u64).enumerate() {
                    if let Some(cur) = sh.block(b) {
                        let v: Vec<u8> = cur
                            .iter()
                            .zip(&data_out[k * bsz..(k + 1) * bsz])
                            .map(|(a, d)| a | d)
                            .collect();
                        sh.set(b, &v);
                    }
                }
            }
            (Effect::CompareAndWrite, Some((lba, nlb, _))) => {
                let n = nlb as usize * bsz;
                for (k, b) in sh.range(lba, nlb).enumerate() {
                    if let Some(cur) = sh.block(b) {
                        assert!(
                            cur == &data_out[k * bsz..(k + 1) * bsz],
                            "COMPARE AND WRITE succeeded against other data"
                        );
                    }
                    sh.set(b, &data_out[n + k * bsz..n + (k + 1) * bsz]);
                }
            }
            (Effect::WriteSame, Some((lba, nlb, flags))) => {
                let zeros = flags & 0x08 != 0 || (op == 0x93 && flags & 0x01 != 0);
                let block = if zeros {
                    vec![0u8; bsz]
                } else {
                    data_out[..bsz].to_vec()
                };
                // Zero blocks: from the LBA to the end of the medium (WSNZ is clear).
                let nlb = if nlb == 0 {
                    sh.blocks().saturating_sub(lba)
                } else {
                    nlb
                };
                for b in sh.range(lba, nlb) {
                    sh.set(b, &block);
                }
            }
            (Effect::Unmap, _) => {
                // Deallocated blocks read as zeros (LBPRZ); which ones were is for reads to find.
                let n = sh.blocks();
                sh.forget(0, n);
            }
            (Effect::None, _) => {}
            _ => {
                let n = sh.blocks();
                sh.forget(0, n);
            }
        }
    }
});
