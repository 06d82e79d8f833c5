//! The copy manager: EXTENDED COPY (LID1) and RECEIVE COPY RESULTS (SPC-4 6.4, 6.18), with the
//! Third-party Copy VPD page (SPC-4 7.8.17). An initiator names source and destination logical
//! units by their NAA designator from VPD 83h and lists block-to-block segments; the target
//! copies between its own units without the data crossing the network (VMware's clone offload,
//! `sg_xcopy`, Windows' and Linux's copy offload of the LID1 kind).
//!
//! Supported: identification CSCD descriptors (E4h) naming any unit of this target, and
//! block-to-block segment descriptors (02h). The copy runs in chunks of the maximum transfer
//! length, each read with the same stability as a READ and written under the destination's range
//! lock, so a copy never shows a concurrent WRITE ATOMIC half done.
//!
//! The copy acts for its initiator on every unit it touches: each must admit that nexus as it
//! would a READ (the source) or a WRITE (the destination), persistent and RESERVE(6)/(10)
//! reservations and a SANITIZE under way or failed included. One copy runs per copy manager
//! (TOTAL CONCURRENT COPIES 1, as advertised); another is refused with INSUFFICIENT RESOURCES
//! while it runs. A copy stops at its next chunk when its task is aborted, its unit reset or its
//! nexus lost ([`LogicalUnit::stop_copy`]).

use super::{illegal, op, Fail, LogicalUnit, Res, MAX_TRANSFER_BYTES};
use crate::pr::Access;
use crate::sense::{asc, key, Sense};
use crate::{Command, Nexus, Outcome};
use bytes::Bytes;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// RECEIVE COPY RESULTS service actions (SPC-4 6.18).
const SA_COPY_STATUS: u8 = 0x00;
const SA_OPERATING_PARAMETERS: u8 = 0x03;
/// EXTENDED COPY service action for the LID1 form.
const SA_EXTENDED_COPY_LID1: u8 = 0x00;

/// Limits reported in the operating parameters and the Third-party Copy VPD page.
pub(super) const MAX_CSCD_DESCRIPTORS: u16 = 8;
pub(super) const MAX_SEGMENT_DESCRIPTORS: u16 = 64;
const CSCD_LEN: usize = 32;
const SEGMENT_B2B_LEN: usize = 28;
/// Room for the largest lists both counts allow.
pub(super) const MAX_DESCRIPTOR_LIST: u32 =
    MAX_CSCD_DESCRIPTORS as u32 * CSCD_LEN as u32 + MAX_SEGMENT_DESCRIPTORS as u32 * 28;
/// A block-to-block segment moves at most this many bytes (its count field is 16 bits of
/// blocks; 256 MiB covers 4 KiB blocks).
const MAX_SEGMENT_BYTES: u32 = 256 << 20;
/// The most parameter data an EXTENDED COPY may carry: more is refused before it is asked for.
pub(super) const MAX_PARAMETER_LIST: u32 = 64 << 10;
/// Copy results kept per logical unit for RECEIVE COPY RESULTS; the oldest finished one goes
/// first when full.
const HELD_RESULTS: usize = 32;

const HEADER_LEN: usize = 16;
const DESC_IDENTIFICATION: u8 = 0xE4;
const DESC_BLOCK_TO_BLOCK: u8 = 0x02;

/// Copy manager status (SPC-4 table 260).
const STATUS_IN_PROGRESS: u8 = 0x00;
const STATUS_DONE: u8 = 0x01;
const STATUS_FAILED: u8 = 0x02;

/// ASCs of the copy manager (SPC-4 annex D).
const TOO_MANY_CSCD_DESCRIPTORS: (u8, u8) = (0x26, 0x06);
const TOO_MANY_SEGMENT_DESCRIPTORS: (u8, u8) = (0x26, 0x08);
const UNSUPPORTED_CSCD_TYPE: (u8, u8) = (0x26, 0x07);
const UNSUPPORTED_SEGMENT_TYPE: (u8, u8) = (0x26, 0x09);
const UNREACHABLE_COPY_TARGET: (u8, u8) = (0x08, 0x04);
const OPERATION_IN_PROGRESS: (u8, u8) = (0x00, 0x16);

/// One copy's status as RECEIVE COPY RESULTS reports it, per I_T nexus and list identifier.
#[derive(Debug, Clone)]
pub(super) struct CopyRecord {
    nexus: Nexus,
    list_id: u8,
    /// Kept after completion (LIST ID USAGE 00b), or only while running (10b).
    hold: bool,
    status: u8,
    segments: u16,
    bytes: u64,
}

impl CopyRecord {
    /// Whether this copy was started through `nexus`.
    pub(super) fn belongs_to(&self, nexus: &Nexus) -> bool {
        &self.nexus == nexus
    }
}

/// One block-to-block segment.
struct Segment {
    src: usize,
    dst: usize,
    blocks: u64,
    src_lba: u64,
    dst_lba: u64,
}

fn param_len_error() -> Fail {
    illegal(asc::PARAMETER_LIST_LENGTH_ERROR)
}

fn be16(d: &[u8], i: usize) -> u16 {
    u16::from_be_bytes([d[i], d[i + 1]])
}

fn be32(d: &[u8], i: usize) -> u32 {
    u32::from_be_bytes([d[i], d[i + 1], d[i + 2], d[i + 3]])
}

fn be64(d: &[u8], i: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[i..i + 8]);
    u64::from_be_bytes(b)
}

/// COPY ABORTED for segment `seg` (its number in COMMAND-SPECIFIC INFORMATION's place, the
/// INFORMATION field), with `code`.
fn aborted(seg: usize, code: (u8, u8)) -> Fail {
    Fail::Sense(Sense::new(key::COPY_ABORTED, code).with_info(seg as u64))
}

/// Length of a CSCD descriptor by its type code, for the types SPC-4 defines (None: unknown).
fn cscd_len(code: u8) -> Option<usize> {
    match code {
        0xE0..=0xE9 => Some(32),
        0xEA | 0xEB => Some(64),
        _ => None,
    }
}

impl LogicalUnit {
    /// The copy manager's units: `units` when the server gave its inventory, else this one.
    pub(super) fn extended_copy(
        &self,
        cmd: &Command<'_>,
        c: &super::Cdb,
        units: &[&LogicalUnit],
    ) -> Res {
        if c.b(1) & 0x1F != SA_EXTENDED_COPY_LID1 {
            return Err(super::bad_cdb(1, Some(4)));
        }
        let list_len = c.u32(10);
        // SPC-4 6.4.1: a PARAMETER LIST LENGTH of zero is not an error; nothing is copied.
        if list_len == 0 {
            return Ok(Outcome::good(Bytes::new()));
        }
        if list_len > MAX_PARAMETER_LIST {
            return Err(param_len_error());
        }
        let have = (list_len as usize).min(cmd.data_out.len());
        let d = &cmd.data_out[..have];
        if d.len() < HEADER_LEN {
            return Err(param_len_error());
        }
        let list_id = d[0];
        let usage = (d[1] >> 3) & 0x03;
        if usage == 0x01 || (usage == 0x03 && list_id != 0) {
            return Err(Fail::Sense(Sense::invalid_param_field(1, Some(4))));
        }
        let cscd_list = be16(d, 2) as usize;
        let seg_list = be32(d, 8) as usize;
        let inline = be32(d, 12) as usize;
        if cscd_list + seg_list > MAX_DESCRIPTOR_LIST as usize {
            return Err(param_len_error());
        }
        if inline != 0 {
            // MAXIMUM INLINE DATA LENGTH is zero.
            return Err(Fail::Sense(Sense::invalid_param_field(12, None)));
        }
        if HEADER_LEN + cscd_list + seg_list > d.len() {
            return Err(param_len_error());
        }
        let cscds = self.parse_cscds(&d[HEADER_LEN..HEADER_LEN + cscd_list], units)?;
        let segs = parse_segments(
            &d[HEADER_LEN + cscd_list..HEADER_LEN + cscd_list + seg_list],
            HEADER_LEN + cscd_list,
        )?;
        // Every segment checked before any data moves: a copy that cannot finish does not start.
        for (i, s) in segs.iter().enumerate() {
            let (Some(src), Some(dst)) = (cscds.get(s.src).copied(), cscds.get(s.dst).copied())
            else {
                return Err(aborted(i, UNREACHABLE_COPY_TARGET));
            };
            let ok = |lu: &LogicalUnit, lba: u64| {
                lba.checked_add(s.blocks).is_some_and(|e| e <= lu.blocks())
            };
            if !ok(src, s.src_lba) || !ok(dst, s.dst_lba) {
                return Err(aborted(i, asc::NO_ADDITIONAL_SENSE));
            }
            if src.block_size != dst.block_size
                || s.blocks * dst.block_size > MAX_SEGMENT_BYTES as u64
            {
                return Err(aborted(i, asc::NO_ADDITIONAL_SENSE));
            }
            if dst.write_protected() {
                return Err(Fail::Sense(Sense::new(
                    key::DATA_PROTECT,
                    asc::WRITE_PROTECTED,
                )));
            }
            // The copy acts for the initiator: each unit admits it as it would a READ or a WRITE
            // of that nexus (this one did already, for the EXTENDED COPY itself).
            for (lu, access, opc) in [
                (src, Access::Read, op::READ_16),
                (dst, Access::Write, op::WRITE_16),
            ] {
                if std::ptr::eq(lu, self) {
                    continue;
                }
                if let Some(s) = lu.sanitize_blocks(opc) {
                    return Err(Fail::Sense(s));
                }
                let st = lu.st();
                let spc2 = st.spc2.as_ref().is_some_and(|h| h != cmd.nexus);
                if spc2 || st.pr.conflicts(cmd.nexus, access) {
                    return Err(Fail::Status(crate::status::RESERVATION_CONFLICT));
                }
            }
        }
        // One copy at a time per copy manager: the others are refused, not queued on the
        // blocking pool.
        let stop = Arc::new(AtomicBool::new(false));
        let _running = {
            let mut slot = self.copy.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_some() {
                return Err(illegal(asc::INSUFFICIENT_RESOURCES));
            }
            *slot = Some((cmd.nexus.clone(), stop.clone()));
            RunningCopy(self)
        };
        let track = usage != 0x03;
        if track {
            self.copy_begin(cmd.nexus, list_id, usage == 0x00)?;
        }
        let mut bytes = 0u64;
        let mut done = 0u16;
        let mut result = Ok(());
        for (i, s) in segs.iter().enumerate() {
            match copy_segment(cscds[s.src], cscds[s.dst], s, &stop, cmd.pace) {
                Ok(n) => {
                    bytes += n;
                    done += 1;
                }
                Err(e) => {
                    result = Err((i, e));
                    break;
                }
            }
        }
        // Each destination written through (its write cache off) is flushed once.
        let mut flushed = Ok(());
        let mut done_units: Vec<&LogicalUnit> = Vec::new();
        for (i, s) in segs.iter().enumerate() {
            let dst = cscds[s.dst];
            if done_units.iter().any(|u| std::ptr::eq(*u, dst)) || !dst.write_through(false) {
                continue;
            }
            done_units.push(dst);
            if let Err(e) = dst.backend.flush() {
                flushed = Err((i, dst.medium_error(e, true)));
                break;
            }
        }
        let result = result.and(flushed);
        if track {
            let status = if result.is_ok() {
                STATUS_DONE
            } else {
                STATUS_FAILED
            };
            self.copy_end(cmd.nexus, list_id, status, done, bytes);
        }
        match result {
            Ok(()) => Ok(Outcome::good(Bytes::new())),
            Err((i, Fail::Sense(s))) => Err(Fail::Sense(
                Sense::new(key::COPY_ABORTED, (s.asc, s.ascq)).with_info(i as u64),
            )),
            Err((_, f)) => Err(f),
        }
    }

    fn parse_cscds<'a>(
        &'a self,
        d: &[u8],
        units: &[&'a LogicalUnit],
    ) -> Result<Vec<&'a LogicalUnit>, Fail> {
        let mut out = Vec::new();
        let mut at = 0;
        let mut raw = Vec::new();
        while at < d.len() {
            let code = d[at];
            let Some(len) = cscd_len(code) else {
                return Err(illegal(UNSUPPORTED_CSCD_TYPE));
            };
            if at + len > d.len() {
                return Err(param_len_error());
            }
            raw.push((HEADER_LEN + at, &d[at..at + len]));
            at += len;
        }
        if raw.len() > MAX_CSCD_DESCRIPTORS as usize {
            return Err(illegal(TOO_MANY_CSCD_DESCRIPTORS));
        }
        for (off, desc) in raw {
            if desc[0] != DESC_IDENTIFICATION {
                return Err(illegal(UNSUPPORTED_CSCD_TYPE));
            }
            // LU ID TYPE and NUL are ignored (SPC-4: NUL is obsolete); only block devices.
            if desc[1] & 0x1F != 0x00 {
                return Err(Fail::Sense(Sense::invalid_param_field(
                    off as u16 + 1,
                    Some(4),
                )));
            }
            // The designation descriptor, bytes 4..24: code set, association/type, length.
            let dtype = desc[5] & 0x0F;
            let assoc = (desc[5] >> 4) & 0x03;
            let dlen = desc[7] as usize;
            if dlen > 20 || dtype != 0x03 || assoc != 0 {
                // Only NAA designators of a logical unit name units here.
                return Err(aborted(0, UNREACHABLE_COPY_TARGET));
            }
            let id = &desc[8..8 + dlen];
            let Some(lu) = std::iter::once(self)
                .chain(units.iter().copied())
                .find(|u| u.naa_designator() == id)
            else {
                return Err(aborted(0, UNREACHABLE_COPY_TARGET));
            };
            out.push(lu);
        }
        Ok(out)
    }

    /// The NAA designator this unit reports in VPD 83h.
    pub(super) fn naa_designator(&self) -> &[u8] {
        let n = if self.cfg.naa_id[0] >> 4 == 6 { 16 } else { 8 };
        &self.cfg.naa_id[..n]
    }

    /// Registers a copy under way for (nexus, list id): a second one with the same list
    /// identifier while the first runs is refused (SPC-4 6.4.3.2).
    fn copy_begin(&self, nexus: &Nexus, list_id: u8, hold: bool) -> Result<(), Fail> {
        let mut st = self.st();
        let q = &mut st.copies;
        if q.iter()
            .any(|r| r.list_id == list_id && r.status == STATUS_IN_PROGRESS && &r.nexus == nexus)
        {
            return Err(illegal(OPERATION_IN_PROGRESS));
        }
        q.retain(|r| !(r.list_id == list_id && &r.nexus == nexus));
        if q.len() >= HELD_RESULTS {
            if let Some(i) = q.iter().position(|r| r.status != STATUS_IN_PROGRESS) {
                q.remove(i);
            }
        }
        q.push_back(CopyRecord {
            nexus: nexus.clone(),
            list_id,
            hold,
            status: STATUS_IN_PROGRESS,
            segments: 0,
            bytes: 0,
        });
        Ok(())
    }

    fn copy_end(&self, nexus: &Nexus, list_id: u8, status: u8, segments: u16, bytes: u64) {
        let mut st = self.st();
        let q = &mut st.copies;
        let Some(i) = q
            .iter()
            .position(|r| r.list_id == list_id && &r.nexus == nexus)
        else {
            return;
        };
        if q[i].hold {
            let r = &mut q[i];
            r.status = status;
            r.segments = segments;
            r.bytes = bytes;
        } else {
            q.remove(i);
        }
    }

    /// RECEIVE COPY RESULTS: COPY STATUS and OPERATING PARAMETERS.
    pub(super) fn receive_copy_results(&self, cmd: &Command<'_>, c: &super::Cdb) -> Res {
        let alloc = c.u32(10) as usize;
        let mut d = match c.b(1) & 0x1F {
            SA_COPY_STATUS => {
                let list_id = c.b(2);
                let st = self.st();
                let Some(r) = st
                    .copies
                    .iter()
                    .find(|r| r.list_id == list_id && &r.nexus == cmd.nexus)
                else {
                    return Err(super::bad_cdb(2, None));
                };
                // TRANSFER COUNT in the smallest unit that fits 32 bits: bytes, KiB, MiB, ...
                let (mut units, mut count) = (0u8, r.bytes);
                while count > u32::MAX as u64 {
                    units += 1;
                    count = count.div_ceil(1024);
                }
                let mut d = vec![0u8; 12];
                d[0..4].copy_from_slice(&8u32.to_be_bytes());
                d[4] = r.status;
                d[5..7].copy_from_slice(&r.segments.to_be_bytes());
                d[7] = units;
                d[8..12].copy_from_slice(&(count as u32).to_be_bytes());
                d
            }
            SA_OPERATING_PARAMETERS => operating_parameters(self.block_size),
            _ => return Err(super::bad_cdb(1, Some(4))),
        };
        d.truncate(alloc);
        Ok(Outcome::good(Bytes::from(d)))
    }

    /// The Third-party Copy VPD page's descriptors (SPC-4 7.8.17), after the page header.
    pub(super) fn third_party_copy_vpd(&self) -> Vec<u8> {
        let mut d = Vec::new();
        let mut desc = |ty: u16, body: &[u8]| {
            let padded = body.len().div_ceil(4) * 4;
            d.extend_from_slice(&ty.to_be_bytes());
            d.extend_from_slice(&(padded as u16).to_be_bytes());
            d.extend_from_slice(body);
            d.resize(d.len() + padded - body.len(), 0);
        };
        // Supported Commands: EXTENDED COPY (LID1); RECEIVE COPY STATUS and OPERATING PARAMETERS.
        let cmds = [
            op::EXTENDED_COPY,
            1,
            SA_EXTENDED_COPY_LID1,
            op::RECEIVE_COPY_RESULTS,
            2,
            SA_COPY_STATUS,
            SA_OPERATING_PARAMETERS,
        ];
        let mut body = vec![cmds.len() as u8];
        body.extend_from_slice(&cmds);
        desc(0x0001, &body);
        // Parameter Data.
        let mut p = [0u8; 28];
        p[4..6].copy_from_slice(&MAX_CSCD_DESCRIPTORS.to_be_bytes());
        p[6..8].copy_from_slice(&MAX_SEGMENT_DESCRIPTORS.to_be_bytes());
        p[8..12].copy_from_slice(&MAX_DESCRIPTOR_LIST.to_be_bytes());
        desc(0x0004, &p);
        // Supported Descriptors: block to block, identification CSCD.
        desc(0x0008, &[2, DESC_BLOCK_TO_BLOCK, DESC_IDENTIFICATION]);
        // Supported CSCD Descriptor IDs: none.
        desc(0x000C, &[0, 0]);
        // General Copy Operations.
        let mut g = [0u8; 32];
        g[0..4].copy_from_slice(&1u32.to_be_bytes());
        g[4..8].copy_from_slice(&1u32.to_be_bytes());
        g[8..12].copy_from_slice(&MAX_SEGMENT_BYTES.to_be_bytes());
        g[12] = self.block_size.trailing_zeros() as u8;
        desc(0x8001, &g);
        d
    }
}

/// RECEIVE COPY RESULTS OPERATING PARAMETERS (SPC-4 6.18.4).
fn operating_parameters(block_size: u64) -> Vec<u8> {
    let impl_codes = [DESC_BLOCK_TO_BLOCK, DESC_IDENTIFICATION];
    let mut d = vec![0u8; 44];
    d[4] = 0x01; // SNLID: LIST ID USAGE 11b accepted
    d[8..10].copy_from_slice(&MAX_CSCD_DESCRIPTORS.to_be_bytes());
    d[10..12].copy_from_slice(&MAX_SEGMENT_DESCRIPTORS.to_be_bytes());
    d[12..16].copy_from_slice(&MAX_DESCRIPTOR_LIST.to_be_bytes());
    d[16..20].copy_from_slice(&MAX_SEGMENT_BYTES.to_be_bytes());
    // MAXIMUM INLINE DATA LENGTH, HELD DATA LIMIT, MAXIMUM STREAM DEVICE TRANSFER SIZE: 0.
    d[34..36].copy_from_slice(&1u16.to_be_bytes()); // TOTAL CONCURRENT COPIES
    d[36] = 1; // MAXIMUM CONCURRENT COPIES
    d[37] = block_size.trailing_zeros() as u8; // DATA SEGMENT GRANULARITY (log2)
    d[43] = impl_codes.len() as u8;
    d.extend_from_slice(&impl_codes);
    let len = (d.len() - 4) as u32;
    d[0..4].copy_from_slice(&len.to_be_bytes());
    d
}

/// Parses the segment descriptor list (`base`: its offset in the parameter data, for field
/// pointers).
fn parse_segments(d: &[u8], base: usize) -> Result<Vec<Segment>, Fail> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < d.len() {
        if at + 4 > d.len() {
            return Err(param_len_error());
        }
        let len = 4 + be16(d, at + 2) as usize;
        if d[at] != DESC_BLOCK_TO_BLOCK {
            return Err(illegal(UNSUPPORTED_SEGMENT_TYPE));
        }
        if len != SEGMENT_B2B_LEN {
            return Err(Fail::Sense(Sense::invalid_param_field(
                (base + at + 2) as u16,
                None,
            )));
        }
        if at + len > d.len() {
            return Err(param_len_error());
        }
        out.push(Segment {
            src: be16(d, at + 4) as usize,
            dst: be16(d, at + 6) as usize,
            blocks: be16(d, at + 10) as u64,
            src_lba: be64(d, at + 12),
            dst_lba: be64(d, at + 20),
        });
        at += len;
        if out.len() > MAX_SEGMENT_DESCRIPTORS as usize {
            return Err(illegal(TOO_MANY_SEGMENT_DESCRIPTORS));
        }
    }
    Ok(out)
}

/// The running copy's place in its copy manager, given up when it ends.
struct RunningCopy<'a>(&'a LogicalUnit);

impl Drop for RunningCopy<'_> {
    fn drop(&mut self) {
        *self.0.copy.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

impl LogicalUnit {
    /// Stops the copy this unit runs at its next chunk: any copy (`None`: the unit is reset),
    /// or only one of `nexus` (its task was aborted, or the nexus is gone). With one copy per
    /// copy manager, the copy of a nexus is the one its aborted EXTENDED COPY started.
    pub fn stop_copy(&self, nexus: Option<&Nexus>) {
        let slot = self.copy.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((n, stop)) = slot.as_ref() {
            if nexus.is_none_or(|x| x == n) {
                stop.store(true, Ordering::Release);
            }
        }
    }

    /// Whether this unit runs a copy now (its copy manager's one place is taken).
    pub fn copy_running(&self) -> bool {
        self.copy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Whether `cdb` is an EXTENDED COPY (it runs until done unless stopped:
    /// [`LogicalUnit::stop_copy`]).
    pub fn is_copy(cdb: &[u8]) -> bool {
        cdb.first() == Some(&op::EXTENDED_COPY)
    }
}

/// Copies one segment in chunks of at most the maximum transfer; backwards when the ranges
/// overlap on one unit with the destination after the source, so that no block is read after
/// it was overwritten. Each chunk waits for `pace` (the session's bandwidth toward storage)
/// first. Stops before a chunk once `stop` is set. Returns the bytes copied.
fn copy_segment(
    src: &LogicalUnit,
    dst: &LogicalUnit,
    s: &Segment,
    stop: &AtomicBool,
    pace: Option<crate::Pace<'_>>,
) -> Result<u64, Fail> {
    let bs = dst.block_size;
    let total = s.blocks * bs;
    let (so, doff) = (s.src_lba * bs, s.dst_lba * bs);
    let chunk = MAX_TRANSFER_BYTES.min(total.max(1));
    let backwards = std::ptr::eq(src, dst) && doff > so && doff < so + total;
    let n = total.div_ceil(chunk);
    for k in 0..n {
        let k = if backwards { n - 1 - k } else { k };
        let at = k * chunk;
        let len = chunk.min(total - at);
        if let Some(p) = pace {
            (p.0)(len);
        }
        if stop.load(Ordering::Acquire) {
            return Err(Fail::Sense(Sense::new(
                key::ABORTED_COMMAND,
                asc::NO_ADDITIONAL_SENSE,
            )));
        }
        let data = src.read_stable(so + at, len as usize)?;
        let _g = dst.ranges.lock(doff + at, doff + at + len);
        dst.backend
            .write_at(doff + at, &data)
            .map_err(|e| dst.medium_error(e, true))?;
    }
    Ok(total)
}
