#![allow(clippy::unwrap_used, clippy::expect_used)]
//! EXTENDED COPY (LID1) and RECEIVE COPY RESULTS: copies within a unit and between the units of
//! one target, and the errors SPC-4 names for malformed parameter lists.

mod common;

use bytes::Bytes;
use common::{expect, nexus, sense_of};
use mcsi_scsi::sense::{asc, key};
use mcsi_scsi::{
    lun, status, Command, DeviceServer, LogicalUnit, LuConfig, Nexus, Outcome, RamBackend,
    TaskAttribute,
};
use std::sync::Arc;

const BS: u64 = 512;

fn naa(i: u8) -> [u8; 16] {
    let mut n = [0u8; 16];
    n[0] = 0x60;
    n[15] = i;
    n
}

fn unit(blocks: u64, id: u8, read_only: bool) -> Arc<LogicalUnit> {
    let cfg = LuConfig {
        naa_id: naa(id),
        read_only,
        ..LuConfig::default()
    };
    Arc::new(LogicalUnit::new(
        Arc::new(RamBackend::new(blocks * BS).unwrap()),
        cfg,
    ))
}

/// Blocks per READ or WRITE of the helpers below.
const PIECE_BLOCKS: u64 = 8192;

struct Target {
    ds: DeviceServer,
    n: Nexus,
}

impl Target {
    /// LUN 0 and 1 read-write (100,000 and 600 blocks), LUN 2 read-only.
    fn new() -> Self {
        let ds = DeviceServer::new(vec![
            (0, unit(100_000, 1, false)),
            (1, unit(600, 2, false)),
            (2, unit(600, 3, true)),
        ]);
        let t = Target { ds, n: nexus(1) };
        for l in 0..3 {
            // The power-on unit attention.
            t.run(l, &[0x00, 0, 0, 0, 0, 0], &[]);
        }
        t
    }

    fn run(&self, l: u16, cdb: &[u8], data: &[u8]) -> Outcome {
        let mut c = cdb.to_vec();
        c.resize(16, 0);
        self.ds.execute(
            lun::encode(l),
            Command {
                nexus: &self.n,
                cdb: &c,
                data_out: Bytes::copy_from_slice(data),
                data_in_limit: u32::MAX,
                attr: TaskAttribute::Simple,
                pace: None,
            },
        )
    }

    /// Writes `data` at `lba`, in commands of at most 4 MiB (below the maximum transfer).
    fn write(&self, l: u16, lba: u64, data: &[u8]) {
        for (k, piece) in data.chunks(PIECE_BLOCKS as usize * BS as usize).enumerate() {
            let mut c = vec![0x8A, 0];
            c.extend_from_slice(&(lba + k as u64 * PIECE_BLOCKS).to_be_bytes());
            c.extend_from_slice(&((piece.len() as u64 / BS) as u32).to_be_bytes());
            assert_eq!(self.run(l, &c, piece).status, status::GOOD);
        }
    }

    /// Reads `blocks` at `lba`, in commands of at most 4 MiB.
    fn read(&self, l: u16, lba: u64, blocks: u32) -> Bytes {
        let mut out = Vec::with_capacity(blocks as usize * BS as usize);
        let mut at = 0u64;
        while at < u64::from(blocks) {
            let n = PIECE_BLOCKS.min(u64::from(blocks) - at);
            let mut c = vec![0x88, 0];
            c.extend_from_slice(&(lba + at).to_be_bytes());
            c.extend_from_slice(&(n as u32).to_be_bytes());
            let o = self.run(l, &c, &[]);
            assert_eq!(o.status, status::GOOD);
            out.extend_from_slice(&o.data_in);
            at += n;
        }
        Bytes::from(out)
    }

    fn xcopy(&self, l: u16, params: &[u8]) -> Outcome {
        let mut c = vec![0x83, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        c.extend_from_slice(&(params.len() as u32).to_be_bytes());
        self.run(l, &c, params)
    }

    fn results(&self, l: u16, sa: u8, list_id: u8) -> Outcome {
        let mut c = vec![0x84, sa, list_id, 0, 0, 0, 0, 0, 0, 0];
        c.extend_from_slice(&1024u32.to_be_bytes());
        self.run(l, &c, &[])
    }
}

/// An identification CSCD descriptor naming the unit with NAA `id`.
fn cscd(id: u8) -> Vec<u8> {
    let mut d = vec![0u8; 32];
    d[0] = 0xE4;
    d[4] = 0x01; // binary
    d[5] = 0x03; // association: logical unit, type NAA
    d[7] = 16;
    d[8..24].copy_from_slice(&naa(id));
    d[29..32].copy_from_slice(&[0, 2, 0]); // disk block length 512
    d
}

fn segment(src: u16, dst: u16, blocks: u16, src_lba: u64, dst_lba: u64) -> Vec<u8> {
    let mut d = vec![0u8; 28];
    d[0] = 0x02;
    d[2..4].copy_from_slice(&0x18u16.to_be_bytes());
    d[4..6].copy_from_slice(&src.to_be_bytes());
    d[6..8].copy_from_slice(&dst.to_be_bytes());
    d[10..12].copy_from_slice(&blocks.to_be_bytes());
    d[12..20].copy_from_slice(&src_lba.to_be_bytes());
    d[20..28].copy_from_slice(&dst_lba.to_be_bytes());
    d
}

/// A parameter list: header (list id, LIST ID USAGE), CSCD and segment descriptors.
fn params(list_id: u8, usage: u8, cscds: &[Vec<u8>], segs: &[Vec<u8>]) -> Vec<u8> {
    let c: Vec<u8> = cscds.concat();
    let s: Vec<u8> = segs.concat();
    let mut d = vec![0u8; 16];
    d[0] = list_id;
    d[1] = usage << 3;
    d[2..4].copy_from_slice(&(c.len() as u16).to_be_bytes());
    d[8..12].copy_from_slice(&(s.len() as u32).to_be_bytes());
    d.extend_from_slice(&c);
    d.extend_from_slice(&s);
    d
}

/// `blocks` blocks, each unlike any other: its first 16 bytes name `seed` and its place
/// (block `i` of the pattern), the rest is pseudo-random from both. A block copied from the
/// wrong place, or read after it was overwritten, cannot match.
fn pattern(blocks: u64, seed: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity((blocks * BS) as usize);
    for i in 0..blocks {
        let mut x = (u64::from(seed) << 56) ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5bd1;
        out.extend_from_slice(&u64::from(seed).to_be_bytes());
        out.extend_from_slice(&i.to_be_bytes());
        for _ in 0..(BS - 16) / 8 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    out
}

#[test]
fn copies_within_a_unit_and_between_units() {
    let t = Target::new();
    let a = pattern(100, 7);
    t.write(0, 10, &a);
    // Within LUN 0: blocks 10..110 to 800..900.
    let p = params(0, 3, &[cscd(1)], &[segment(0, 0, 100, 10, 800)]);
    assert_eq!(t.xcopy(0, &p).status, status::GOOD);
    assert_eq!(&t.read(0, 800, 100)[..], &a[..]);
    // From LUN 0 to LUN 1, asked through LUN 1, in two segments.
    let p = params(
        0,
        3,
        &[cscd(1), cscd(2)],
        &[segment(0, 1, 60, 10, 0), segment(0, 1, 40, 70, 60)],
    );
    assert_eq!(t.xcopy(1, &p).status, status::GOOD);
    assert_eq!(&t.read(1, 0, 100)[..], &a[..]);
}

/// The first block of `got` that is not `want`'s, as "block N holds pattern block M".
fn first_wrong(got: &[u8], want: &[u8]) -> Option<String> {
    got.chunks(BS as usize)
        .zip(want.chunks(BS as usize))
        .enumerate()
        .find(|(_, (g, w))| g != w)
        .map(|(i, (g, _))| {
            let named = u64::from_be_bytes(g[8..16].try_into().unwrap());
            format!("block {i} holds pattern block {named}")
        })
}

/// Overlapping ranges of 40,000 blocks (20 MiB: three chunks of at most 8 MiB) on one unit:
/// the copy runs backwards when the destination lies after the source, so that no chunk is
/// read after an earlier one overwrote it, and forwards when it lies before.
#[test]
fn overlapping_ranges_copy_as_if_read_first() {
    let t = Target::new();
    let a = pattern(40_000, 3);
    t.write(0, 0, &a);
    // Destination after the source, overlapping: the copy must not read what it wrote.
    let p = params(0, 3, &[cscd(1)], &[segment(0, 0, 40_000, 0, 10_000)]);
    assert_eq!(t.xcopy(0, &p).status, status::GOOD);
    let got = t.read(0, 10_000, 40_000);
    assert_eq!(first_wrong(&got, &a), None, "destination after the source");
    // And before it.
    t.write(0, 55_000, &a);
    let p = params(0, 3, &[cscd(1)], &[segment(0, 0, 40_000, 55_000, 50_000)]);
    assert_eq!(t.xcopy(0, &p).status, status::GOOD);
    let got = t.read(0, 50_000, 40_000);
    assert_eq!(first_wrong(&got, &a), None, "destination before the source");
}

#[test]
fn malformed_parameter_lists_are_refused_with_the_standard_codes() {
    let t = Target::new();
    let good = params(0, 3, &[cscd(1)], &[segment(0, 0, 8, 0, 100)]);
    // Zero-length parameter list: nothing to do.
    assert_eq!(t.xcopy(0, &[]).status, status::GOOD);
    // Truncated inside the CSCD descriptor and inside the segment descriptor.
    expect(
        &t.xcopy(0, &good[..16 + 31]),
        key::ILLEGAL_REQUEST,
        asc::PARAMETER_LIST_LENGTH_ERROR,
    );
    expect(
        &t.xcopy(0, &good[..good.len() - 1]),
        key::ILLEGAL_REQUEST,
        asc::PARAMETER_LIST_LENGTH_ERROR,
    );
    // Nine CSCD descriptors, 65 segment descriptors.
    let p = params(0, 3, &vec![cscd(1); 9], &[segment(0, 0, 8, 0, 100)]);
    expect(&t.xcopy(0, &p), key::ILLEGAL_REQUEST, (0x26, 0x06));
    let p = params(0, 3, &[cscd(1)], &vec![segment(0, 0, 8, 0, 100); 65]);
    expect(&t.xcopy(0, &p), key::ILLEGAL_REQUEST, (0x26, 0x08));
    // Lists longer than MAXIMUM DESCRIPTOR LIST LENGTH, whatever their counts.
    let p = params(0, 3, &vec![cscd(1); 9], &vec![segment(0, 0, 8, 0, 100); 70]);
    expect(
        &t.xcopy(0, &p),
        key::ILLEGAL_REQUEST,
        asc::PARAMETER_LIST_LENGTH_ERROR,
    );
    // A Fibre Channel CSCD descriptor and a stream-to-stream segment.
    let mut fc = cscd(1);
    fc[0] = 0xE0;
    let p = params(0, 3, &[fc], &[segment(0, 0, 8, 0, 100)]);
    expect(&t.xcopy(0, &p), key::ILLEGAL_REQUEST, (0x26, 0x07));
    let mut stream = segment(0, 0, 8, 0, 100);
    stream[0] = 0x03;
    let p = params(0, 3, &[cscd(1)], &[stream]);
    expect(&t.xcopy(0, &p), key::ILLEGAL_REQUEST, (0x26, 0x09));
    // Reserved LIST ID USAGE.
    let p = params(0, 1, &[cscd(1)], &[segment(0, 0, 8, 0, 100)]);
    expect(
        &t.xcopy(0, &p),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_PARAMETER_LIST,
    );
}

#[test]
fn unreachable_units_and_ranges_abort_the_copy_before_any_block_moves() {
    let t = Target::new();
    let a = pattern(8, 1);
    t.write(0, 0, &a);
    // A destination index past the CSCD list.
    let p = params(0, 3, &[cscd(1)], &[segment(0, 1, 8, 0, 100)]);
    expect(&t.xcopy(0, &p), key::COPY_ABORTED, (0x08, 0x04));
    // A unit this target does not have.
    let p = params(0, 3, &[cscd(1), cscd(9)], &[segment(0, 1, 8, 0, 100)]);
    expect(&t.xcopy(0, &p), key::COPY_ABORTED, (0x08, 0x04));
    // Past the destination's end: the first segment must not have been copied either.
    let p = params(
        0,
        3,
        &[cscd(1), cscd(2)],
        &[segment(0, 1, 8, 0, 0), segment(0, 1, 8, 0, 595)],
    );
    let s = sense_of(&t.xcopy(0, &p));
    assert_eq!(s.key, key::COPY_ABORTED);
    assert_eq!(s.information, Some(1), "the failing segment's number");
    assert!(t.read(1, 0, 8).iter().all(|&b| b == 0));
    // A read-only destination.
    let p = params(0, 3, &[cscd(1), cscd(3)], &[segment(0, 1, 8, 0, 0)]);
    expect(&t.xcopy(0, &p), key::DATA_PROTECT, asc::WRITE_PROTECTED);
}

#[test]
fn receive_copy_results_reports_status_and_operating_parameters() {
    let t = Target::new();
    // Nothing copied under list id 5 yet.
    expect(
        &t.results(0, 0x00, 5),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    let p = params(5, 0, &[cscd(1)], &[segment(0, 0, 16, 0, 100)]);
    assert_eq!(t.xcopy(0, &p).status, status::GOOD);
    let o = t.results(0, 0x00, 5);
    assert_eq!(o.status, status::GOOD);
    let d = &o.data_in;
    assert_eq!(&d[0..4], &8u32.to_be_bytes());
    assert_eq!(d[4], 0x01, "completed without errors");
    assert_eq!(u16::from_be_bytes([d[5], d[6]]), 1);
    assert_eq!(d[7], 0, "bytes");
    assert_eq!(&d[8..12], &(16 * 512u32).to_be_bytes());
    // Another nexus does not see it; LIST ID USAGE 10b keeps nothing.
    let other = nexus(2);
    let c: &'static [u8] = &[0x84, 0x00, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0];
    let cmd = |c: &'static [u8]| Command {
        nexus: &other,
        cdb: c,
        data_out: Bytes::new(),
        data_in_limit: u32::MAX,
        attr: TaskAttribute::Simple,
        pace: None,
    };
    t.ds.execute(lun::encode(0), cmd(c)); // unit attention
    expect(
        &t.ds.execute(lun::encode(0), cmd(c)),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    let p = params(6, 2, &[cscd(1)], &[segment(0, 0, 16, 0, 100)]);
    assert_eq!(t.xcopy(0, &p).status, status::GOOD);
    expect(
        &t.results(0, 0x00, 6),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    // Operating parameters (SPC-4 6.18.4).
    let o = t.results(0, 0x03, 0);
    assert_eq!(o.status, status::GOOD);
    let d = &o.data_in;
    assert_eq!(
        u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize,
        d.len() - 4
    );
    assert_eq!(u16::from_be_bytes([d[8], d[9]]), 8);
    assert_eq!(u16::from_be_bytes([d[10], d[11]]), 64);
    assert_eq!(
        u32::from_be_bytes([d[12], d[13], d[14], d[15]]),
        8 * 32 + 64 * 28
    );
    assert_eq!(d[43], 2);
    assert_eq!(&d[44..46], &[0x02, 0xE4]);
}

#[test]
fn third_party_copy_vpd_lists_the_commands() {
    let t = Target::new();
    let o = t.run(0, &[0x12, 0x01, 0x8F, 0x04, 0x00, 0], &[]);
    assert_eq!(o.status, status::GOOD);
    let d = &o.data_in;
    assert_eq!(d[1], 0x8F);
    assert_eq!(u16::from_be_bytes([d[2], d[3]]) as usize, d.len() - 4);
    // Walk the descriptors; each length is a multiple of four.
    let mut at = 4;
    let mut types = Vec::new();
    while at < d.len() {
        let ty = u16::from_be_bytes([d[at], d[at + 1]]);
        let len = u16::from_be_bytes([d[at + 2], d[at + 3]]) as usize;
        assert_eq!(len % 4, 0);
        if ty == 0x0001 {
            assert_eq!(
                &d[at + 4..at + 12],
                &[7, 0x83, 1, 0x00, 0x84, 2, 0x00, 0x03]
            );
        }
        types.push(ty);
        at += 4 + len;
    }
    assert_eq!(at, d.len());
    assert_eq!(types, vec![0x0001, 0x0004, 0x0008, 0x000C, 0x8001]);
}

/// Runs `cdb` on LUN `l` of `ds` as `n`.
fn run_as(ds: &DeviceServer, n: &Nexus, l: u16, cdb: &[u8], data: &[u8]) -> Outcome {
    let mut c = cdb.to_vec();
    c.resize(16, 0);
    ds.execute(
        lun::encode(l),
        Command {
            nexus: n,
            cdb: &c,
            data_out: Bytes::copy_from_slice(data),
            data_in_limit: u32::MAX,
            attr: TaskAttribute::Simple,
            pace: None,
        },
    )
}

fn xcopy_cdb(params: &[u8]) -> Vec<u8> {
    let mut c = vec![0x83, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    c.extend_from_slice(&(params.len() as u32).to_be_bytes());
    c
}

/// A copy acts for its initiator on every unit it touches: a RESERVE(6) another initiator
/// holds on the destination refuses it with RESERVATION CONFLICT (before, only persistent
/// reservations were looked at, so one initiator could overwrite a unit another had reserved),
/// and nothing is written.
#[test]
fn a_destination_reserved_by_another_initiator_refuses_the_copy() {
    let t = Target::new();
    let other = nexus(2);
    assert_eq!(
        run_as(&t.ds, &other, 1, &[0; 6], &[]).status,
        status::CHECK_CONDITION
    );
    assert_eq!(
        run_as(&t.ds, &other, 1, &[0x16, 0, 0, 0, 0, 0], &[]).status,
        status::GOOD
    );
    let before = t.read(0, 0, 8);
    let p = params(0, 3, &[cscd(1), cscd(2)], &[segment(0, 1, 8, 0, 0)]);
    // Through LUN 0 (the source), so that only the copy's own check can see the destination.
    assert_eq!(t.xcopy(0, &p).status, status::RESERVATION_CONFLICT);
    // Released, the copy goes through.
    assert_eq!(
        run_as(&t.ds, &other, 1, &[0x17, 0, 0, 0, 0, 0], &[]).status,
        status::GOOD
    );
    assert_eq!(t.xcopy(0, &p).status, status::GOOD);
    assert_eq!(t.read(1, 0, 8), before);
}

/// A source that is being sanitized answers the copy as it would a READ: NOT READY, SANITIZE
/// IN PROGRESS.
#[test]
fn a_source_being_sanitized_is_not_ready_for_a_copy() {
    let src = Arc::new(LogicalUnit::new(
        Arc::new(RamBackend::new(2048 * BS).unwrap()),
        LuConfig {
            naa_id: naa(2),
            allow_sanitize: true,
            // 1 MiB at 256 KiB/s: about four seconds.
            sanitize_rate: 256 << 10,
            ..LuConfig::default()
        },
    ));
    let ds = DeviceServer::new(vec![(0, unit(1000, 1, false)), (1, src)]);
    let n = nexus(1);
    for l in 0..2 {
        run_as(&ds, &n, l, &[0; 6], &[]);
    }
    // SANITIZE OVERWRITE with IMMED: it answers at once and runs on.
    let ow = [1u8, 0, 0, 4, 0xa5, 0xa5, 0xa5, 0xa5];
    let o = run_as(&ds, &n, 1, &[0x48, 0x81, 0, 0, 0, 0, 0, 0, 8, 0], &ow);
    assert_eq!(o.status, status::GOOD, "{o:?}");
    let p = params(0, 3, &[cscd(1), cscd(2)], &[segment(1, 0, 8, 0, 0)]);
    let o = run_as(&ds, &n, 0, &xcopy_cdb(&p), &p);
    expect(&o, key::NOT_READY, asc::SANITIZE_IN_PROGRESS);
    assert!(ds.lu(lun::encode(1)).unwrap().stop_background());
}

/// A unit whose reads and writes take 50 ms each, so that a copy of several chunks runs long
/// enough to be seen running.
fn slow_target() -> DeviceServer {
    let slow = Arc::new(mcsi_scsi::backend::ServiceTimeBackend::new(
        Arc::new(RamBackend::new(64 << 20).unwrap()),
        std::time::Duration::from_millis(50),
    ));
    let lu = Arc::new(LogicalUnit::new(
        slow,
        LuConfig {
            naa_id: naa(1),
            ..LuConfig::default()
        },
    ));
    DeviceServer::new(vec![(0, lu)])
}

/// 32 MiB of LUN 0 to its second half: four chunks of 8 MiB, each a 50 ms read and write.
fn long_copy() -> Vec<u8> {
    params(0, 3, &[cscd(1)], &[segment(0, 0, 65535, 0, 65536)])
}

/// The copy manager advertises TOTAL CONCURRENT COPIES 1 and keeps to it: of 64 copies sent at
/// once, one runs at a time and the others are refused with ILLEGAL REQUEST, INSUFFICIENT
/// RESOURCES (before, every one ran, each on its own blocking thread).
#[test]
fn concurrent_copies_beyond_the_advertised_one_are_refused() {
    let ds = Arc::new(slow_target());
    let n = nexus(1);
    run_as(&ds, &n, 0, &[0; 6], &[]);
    let p = Arc::new(long_copy());
    let outcomes: Vec<Outcome> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..64)
            .map(|i| {
                let (ds, p) = (ds.clone(), p.clone());
                s.spawn(move || {
                    // Its power-on unit attention first.
                    let n = nexus(10 + i);
                    run_as(&ds, &n, 0, &[0; 6], &[]);
                    run_as(&ds, &n, 0, &xcopy_cdb(&p), &p)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut ran = 0;
    let mut refused = 0;
    for o in &outcomes {
        if o.status == status::GOOD {
            ran += 1;
        } else {
            expect(o, key::ILLEGAL_REQUEST, asc::INSUFFICIENT_RESOURCES);
            refused += 1;
        }
    }
    println!("64 concurrent copies: {ran} ran, {refused} refused");
    // A copy takes 400 ms (4 chunks of a 50 ms read and write); the 64 start within a few
    // milliseconds of each other, so nearly all find one running.
    assert_eq!(ran + refused, 64);
    assert!(ran >= 1 && refused >= 16, "{ran} ran, {refused} refused");
}

/// A copy stops at its next chunk when its unit is reset or its nexus's copy is stopped (the
/// transport does so when the task is aborted), instead of running to its end: stopped during
/// its first chunks, it never writes its last one.
#[test]
fn a_reset_or_an_abort_ends_a_copy_within_one_chunk() {
    for how in ["LU reset", "task abort"] {
        let ds = Arc::new(slow_target());
        let n = nexus(1);
        run_as(&ds, &n, 0, &[0; 6], &[]);
        // A marked block in the source's last chunk (bytes 24-32 MiB of the segment).
        let mark = vec![0x5au8; BS as usize];
        let mut w = vec![0x8A, 0];
        w.extend_from_slice(&49152u64.to_be_bytes());
        w.extend_from_slice(&1u32.to_be_bytes());
        assert_eq!(run_as(&ds, &n, 0, &w, &mark).status, status::GOOD);
        let p = long_copy();
        let t0 = std::time::Instant::now();
        let o = std::thread::scope(|s| {
            let h = s.spawn(|| run_as(&ds, &n, 0, &xcopy_cdb(&p), &p));
            // Stopped once it runs (not after a guess at when its thread starts): the stop
            // then lands in its first chunks, long before the last.
            let lu = ds.lu(lun::encode(0)).unwrap();
            while !lu.copy_running() {
                assert!(
                    !h.is_finished(),
                    "{how}: the copy ended before it was seen running"
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if how == "LU reset" {
                lu.reset();
            } else {
                lu.stop_copy(Some(&n));
            }
            h.join().unwrap()
        });
        println!(
            "{how}: the copy ended after {:?} (400 ms whole)",
            t0.elapsed()
        );
        assert_ne!(o.status, status::GOOD, "{how}: the copy ran to its end");
        let mut r = vec![0x88, 0];
        r.extend_from_slice(&(65536u64 + 49152).to_be_bytes());
        r.extend_from_slice(&1u32.to_be_bytes());
        let back = run_as(&ds, &n, 0, &r, &[]);
        // A reset leaves a unit attention first.
        let back = if back.status == status::GOOD {
            back
        } else {
            run_as(&ds, &n, 0, &r, &[])
        };
        assert_eq!(back.status, status::GOOD);
        assert!(
            back.data_in.iter().all(|&b| b == 0),
            "{how}: the last chunk was written"
        );
    }
}
