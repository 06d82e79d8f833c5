#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Device server behaviour, command by command. Expected bytes come from the SPC-4/SBC-3
//! layouts, written out by hand.

mod common;

use bytes::Bytes;
use common::{expect, nexus, run};
use mcsi_scsi::sense::{asc, key};
use mcsi_scsi::{
    status, Backend, BackendError, Command, DeviceServer, FailingBackend, LogicalUnit, LuConfig,
    Nexus, Outcome, RamBackend, TaskAttribute,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const BS: usize = 512;
/// Blocks per allocation chunk of the RAM backend (what an UNMAP must cover to deallocate).
const CH: usize = mcsi_scsi::backend::RAM_CHUNK as usize / BS;

fn ram_lu(blocks: u64, cfg: LuConfig) -> LogicalUnit {
    LogicalUnit::new(Arc::new(RamBackend::new(blocks * BS as u64).unwrap()), cfg)
}

/// Consumes the power-on unit attention of a new nexus.
fn ready(lu: &LogicalUnit, n: &Nexus) {
    let o = run(lu, n, &[0x00, 0, 0, 0, 0, 0], &[]);
    if o.status != status::GOOD {
        let o = run(lu, n, &[0x00, 0, 0, 0, 0, 0], &[]);
        assert_eq!(o.status, status::GOOD);
    }
}

fn good(o: &Outcome) -> &Bytes {
    assert_eq!(o.status, status::GOOD, "{o:?}");
    &o.data_in
}

fn read10(lba: u32, n: u16) -> Vec<u8> {
    let l = lba.to_be_bytes();
    let c = n.to_be_bytes();
    vec![0x28, 0, l[0], l[1], l[2], l[3], 0, c[0], c[1], 0]
}

fn write10(lba: u32, n: u16, flags: u8) -> Vec<u8> {
    let mut v = read10(lba, n);
    v[0] = 0x2A;
    v[1] = flags;
    v
}

fn lu_default() -> (LogicalUnit, Nexus) {
    let lu = ram_lu(2048, LuConfig::default());
    let n = nexus(1);
    ready(&lu, &n);
    (lu, n)
}

#[test]
fn power_on_unit_attention_then_request_sense_clears() {
    let lu = ram_lu(64, LuConfig::default());
    let n = nexus(1);
    // INQUIRY neither reports nor clears the unit attention (SAM-5 5.14).
    good(&run(&lu, &n, &[0x12, 0, 0, 0, 36, 0], &[]));
    // REQUEST SENSE returns it (fixed format, 06/29/00) and clears it.
    let o = run(&lu, &n, &[0x03, 0, 0, 0, 252, 0], &[]);
    let d = good(&o);
    assert_eq!(d.len(), 18);
    assert_eq!(d[0], 0x70);
    assert_eq!(d[2], 0x06);
    assert_eq!((d[12], d[13]), (0x29, 0x00));
    // Then NO SENSE.
    let o = run(&lu, &n, &[0x03, 0, 0, 0, 252, 0], &[]);
    let d = good(&o);
    assert_eq!((d[2], d[12], d[13]), (0, 0, 0));
    good(&run(&lu, &n, &[0, 0, 0, 0, 0, 0], &[]));
    // A second nexus gets its own unit attention, through TEST UNIT READY this time.
    let n2 = nexus(2);
    expect(
        &run(&lu, &n2, &[0, 0, 0, 0, 0, 0], &[]),
        key::UNIT_ATTENTION,
        asc::POWER_ON_RESET,
    );
    good(&run(&lu, &n2, &[0, 0, 0, 0, 0, 0], &[]));
}

#[test]
fn lu_reset_reports_29_03() {
    let (lu, n) = lu_default();
    lu.reset();
    expect(
        &run(&lu, &n, &[0, 0, 0, 0, 0, 0], &[]),
        key::UNIT_ATTENTION,
        asc::BUS_DEVICE_RESET,
    );
    good(&run(&lu, &n, &[0, 0, 0, 0, 0, 0], &[]));
}

#[test]
fn standard_inquiry_layout_and_truncation() {
    let cfg = LuConfig {
        vendor: "ACME".into(),
        product: "DISK".into(),
        revision: "1.0".into(),
        ..LuConfig::default()
    };
    let lu = ram_lu(64, cfg);
    let n = nexus(1);
    let o = run(&lu, &n, &[0x12, 0, 0, 0, 255, 0], &[]);
    let d = good(&o);
    assert_eq!(d.len(), 96);
    assert_eq!(d[0], 0x00); // qualifier 0, direct access
    assert_eq!(d[2], 0x06); // SPC-4
    assert_eq!(d[3] & 0x0F, 2); // response data format
    assert_eq!(d[4] as usize, 96 - 5);
    assert_eq!(d[7] & 0x02, 0x02); // CMDQUE
    assert_eq!(&d[8..16], b"ACME    ");
    assert_eq!(&d[16..32], b"DISK            ");
    assert_eq!(&d[32..36], b"1.0 ");
    // SBC-3 version descriptor 04C0h is listed.
    assert!(d[58..74].chunks(2).any(|v| v == [0x04, 0xC0]));
    // Allocation length truncates.
    let o = run(&lu, &n, &[0x12, 0, 0, 0, 5, 0], &[]);
    assert_eq!(good(&o).len(), 5);
    // EVPD=0 with a page code: INVALID FIELD IN CDB pointing at byte 2 (SPC-4 6.6.1).
    let o = run(&lu, &n, &[0x12, 0, 0x80, 0, 255, 0], &[]);
    let s = expect(&o, key::ILLEGAL_REQUEST, asc::INVALID_FIELD_IN_CDB);
    assert_eq!(s.sks, Some([0xC0, 0x00, 0x02]));
    // Unknown VPD page.
    let o = run(&lu, &n, &[0x12, 1, 0xC7, 0, 255, 0], &[]);
    expect(&o, key::ILLEGAL_REQUEST, asc::INVALID_FIELD_IN_CDB);
}

#[test]
fn vpd_pages() {
    let cfg = LuConfig {
        serial: "SN1234".into(),
        naa_id: [0x60, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
        ..LuConfig::default()
    };
    let lu = ram_lu(64, cfg);
    let n = nexus(1);
    let vpd = |p: u8| run(&lu, &n, &[0x12, 1, p, 0x01, 0, 0], &[]);
    let o = vpd(0x00);
    assert_eq!(
        &good(&o)[..],
        &[0, 0, 0, 7, 0x00, 0x80, 0x83, 0x8F, 0xB0, 0xB1, 0xB2]
    );
    let o = vpd(0x80);
    assert_eq!(&good(&o)[..], b"\x00\x80\x00\x06SN1234");
    let o = vpd(0x83);
    let d = good(&o).clone();
    assert_eq!(&d[0..2], &[0x00, 0x83]);
    assert_eq!(u16::from_be_bytes([d[2], d[3]]) as usize, d.len() - 4);
    // First designator: NAA, binary, LU association, 16 bytes.
    assert_eq!(&d[4..8], &[0x01, 0x03, 0x00, 0x10]);
    assert_eq!(d[8], 0x60);
    // Walk the designators and find the relative target port and the SCSI name string.
    let mut pos = 4;
    let mut seen_rel = false;
    let mut seen_name = false;
    while pos + 4 <= d.len() {
        let len = d[pos + 3] as usize;
        let body = &d[pos + 4..pos + 4 + len];
        match d[pos + 1] & 0x0F {
            4 => {
                assert_eq!(d[pos + 1] & 0x30, 0x10); // target port association
                assert_eq!(body, &[0, 0, 0, 1]);
                seen_rel = true;
            }
            8 => {
                assert_eq!(len % 4, 0);
                let name: Vec<u8> = body.iter().copied().take_while(|&b| b != 0).collect();
                assert_eq!(name, b"iqn.2026-01.test:disk,t,0x0001");
                seen_name = true;
            }
            _ => {}
        }
        pos += 4 + len;
    }
    assert!(seen_rel && seen_name);
    let o = vpd(0xB0);
    let d = good(&o);
    assert_eq!(d.len(), 0x40);
    assert_eq!(d[3], 0x3C);
    assert_ne!(u32::from_be_bytes([d[20], d[21], d[22], d[23]]), 0); // max unmap LBA count
    assert_ne!(u32::from_be_bytes([d[24], d[25], d[26], d[27]]), 0); // max unmap descriptors
                                                                     // MAXIMUM WRITE SAME LENGTH (bytes 36..44).
    assert_eq!(&d[36..44], &0xFFFFu64.to_be_bytes());
    assert_eq!(
        d[4] & 0x01,
        0,
        "WSNZ clear: WRITE SAME of zero blocks is served"
    );
    // MAXIMUM ATOMIC TRANSFER LENGTH (bytes 44..48): the maximum transfer (8 MiB); no atomic
    // alignment, granularity or boundaries.
    assert_eq!(&d[44..48], &((8u32 << 20) / BS as u32).to_be_bytes());
    assert!(d[48..64].iter().all(|&b| b == 0));
    let o = vpd(0xB1);
    let d = good(&o);
    assert_eq!((d[3], d[4], d[5]), (0x3C, 0, 1)); // non-rotating medium
    let o = vpd(0xB2);
    let d = good(&o);
    assert_eq!(d[5], 0xE4); // LBPU LBPWS LBPWS10 LBPRZ
    assert_eq!(d[6] & 0x07, 2); // thin
}

#[test]
fn read_capacity() {
    let (lu, n) = lu_default();
    let o = run(&lu, &n, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]);
    assert_eq!(&good(&o)[..], &[0, 0, 0x07, 0xFF, 0, 0, 0x02, 0]);
    let o = run(
        &lu,
        &n,
        &[0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0],
        &[],
    );
    let d = good(&o);
    assert_eq!(d.len(), 32);
    assert_eq!(&d[0..12], &[0, 0, 0, 0, 0, 0, 0x07, 0xFF, 0, 0, 0x02, 0]);
    assert_eq!(d[14] & 0xC0, 0xC0); // LBPME, LBPRZ
                                    // Allocation length 12 cuts the data.
    let o = run(
        &lu,
        &n,
        &[0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 0, 0],
        &[],
    );
    assert_eq!(good(&o).len(), 12);
    // Thick unit: no LBPME.
    let lu = ram_lu(
        16,
        LuConfig {
            thin_provisioning: false,
            ..LuConfig::default()
        },
    );
    ready(&lu, &n);
    let o = run(
        &lu,
        &n,
        &[0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0],
        &[],
    );
    assert_eq!(good(&o)[14], 0);
}

#[test]
fn write_read_round_trip_all_sizes() {
    let (lu, n) = lu_default();
    let data: Vec<u8> = (0..4 * BS).map(|i| (i % 251) as u8).collect();
    good(&run(&lu, &n, &write10(10, 4, 0), &data));
    assert_eq!(&good(&run(&lu, &n, &read10(10, 4), &[]))[..], &data[..]);
    // READ(6): LBA 10, 2 blocks.
    let o = run(&lu, &n, &[0x08, 0, 0, 10, 2, 0], &[]);
    assert_eq!(&good(&o)[..], &data[..2 * BS]);
    // READ(6) with transfer length 0 means 256 blocks (SBC-3 5.13).
    let o = run(&lu, &n, &[0x08, 0, 0, 0, 0, 0], &[]);
    assert_eq!(good(&o).len(), 256 * BS);
    // READ(12) and READ(16).
    let o = run(&lu, &n, &[0xA8, 0, 0, 0, 0, 11, 0, 0, 0, 1, 0, 0], &[]);
    assert_eq!(&good(&o)[..], &data[BS..2 * BS]);
    let mut r16 = [0u8; 16];
    r16[0] = 0x88;
    r16[9] = 12;
    r16[13] = 2;
    let o = run(&lu, &n, &r16, &[]);
    assert_eq!(&good(&o)[..], &data[2 * BS..4 * BS]);
    // WRITE(16) then WRITE(12) and WRITE(6).
    let mut w16 = r16;
    w16[0] = 0x8A;
    w16[9] = 100;
    w16[13] = 1;
    good(&run(&lu, &n, &w16, &[0xAB; BS]));
    good(&run(
        &lu,
        &n,
        &[0xAA, 0, 0, 0, 0, 101, 0, 0, 0, 1, 0, 0],
        &[0xCD; BS],
    ));
    good(&run(&lu, &n, &[0x0A, 0, 0, 102, 1, 0], &[0xEF; BS]));
    let o = run(&lu, &n, &read10(100, 3), &[]);
    let d = good(&o);
    assert!(d[..BS].iter().all(|&b| b == 0xAB));
    assert!(d[BS..2 * BS].iter().all(|&b| b == 0xCD));
    assert!(d[2 * BS..].iter().all(|&b| b == 0xEF));
    // Zero blocks is a no-op.
    assert!(good(&run(&lu, &n, &read10(0, 0), &[])).is_empty());
    good(&run(&lu, &n, &write10(0, 0, 0), &[]));
}

#[test]
fn out_of_range_and_bad_fields() {
    let (lu, n) = lu_default();
    // Last block is fine, one past it is not.
    good(&run(&lu, &n, &read10(2047, 1), &[]));
    expect(
        &run(&lu, &n, &read10(2047, 2), &[]),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
    expect(
        &run(&lu, &n, &read10(2048, 1), &[]),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
    expect(
        &run(&lu, &n, &write10(4000, 1, 0), &[0; BS]),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
    // READ(16) with an LBA that overflows when the length is added.
    let mut r16 = [0xFFu8; 16];
    r16[0] = 0x88;
    r16[1] = 0;
    r16[10..14].copy_from_slice(&2u32.to_be_bytes());
    r16[14] = 0;
    r16[15] = 0;
    expect(
        &run(&lu, &n, &r16, &[]),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
    // RDPROTECT/WRPROTECT without protection information: field pointer byte 1, bit 7.
    let mut c = read10(0, 1);
    c[1] = 0x20;
    let s = expect(
        &run(&lu, &n, &c, &[]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    assert_eq!(s.sks, Some([0xCF, 0x00, 0x01]));
    let s = expect(
        &run(&lu, &n, &write10(0, 1, 0x40), &[0; BS]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    assert_eq!(s.sks.map(|b| b[2]), Some(1));
    // Unknown opcode.
    expect(
        &run(&lu, &n, &[0xC5, 0, 0, 0, 0, 0], &[]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_COMMAND_OPERATION_CODE,
    );
    // NACA in the control byte is not supported.
    expect(
        &run(&lu, &n, &[0x00, 0, 0, 0, 0, 0x04], &[]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
}

#[test]
fn read_only_unit_refuses_writes() {
    let lu = ram_lu(
        64,
        LuConfig {
            read_only: true,
            ..LuConfig::default()
        },
    );
    let n = nexus(1);
    ready(&lu, &n);
    expect(
        &run(&lu, &n, &write10(0, 1, 0), &[0; BS]),
        key::DATA_PROTECT,
        asc::WRITE_PROTECTED,
    );
    expect(
        &run(&lu, &n, &[0x41, 0x08, 0, 0, 0, 0, 0, 0, 1, 0], &[0; BS]),
        key::DATA_PROTECT,
        asc::WRITE_PROTECTED,
    );
    good(&run(&lu, &n, &read10(0, 1), &[]));
    // MODE SENSE reports WP in the device-specific parameter.
    let o = run(&lu, &n, &[0x1A, 0x08, 0x3F, 0, 255, 0], &[]);
    assert_eq!(good(&o)[2] & 0x80, 0x80);
}

#[test]
fn short_data_out_writes_only_whole_blocks_received() {
    let (lu, n) = lu_default();
    good(&run(&lu, &n, &write10(0, 2, 0), &[b'a'; 2 * BS]));
    // Two blocks asked for, one sent: only the first block changes.
    good(&run(&lu, &n, &write10(0, 2, 0), &[b'b'; BS]));
    let o = run(&lu, &n, &read10(0, 2), &[]);
    let d = good(&o);
    assert!(d[..BS].iter().all(|&b| b == b'b'));
    assert!(d[BS..].iter().all(|&b| b == b'a'));
}

/// Records the order of writes and flushes, and the bytes read.
struct Recording {
    inner: RamBackend,
    log: Mutex<Vec<&'static str>>,
    read: AtomicU64,
}

impl Backend for Recording {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, o: u64, b: &mut [u8]) -> Result<(), BackendError> {
        self.read.fetch_add(b.len() as u64, Ordering::Relaxed);
        self.inner.read_at(o, b)
    }
    fn write_at(&self, o: u64, d: &[u8]) -> Result<(), BackendError> {
        self.log.lock().unwrap().push("write");
        self.inner.write_at(o, d)
    }
    fn flush(&self) -> Result<(), BackendError> {
        self.log.lock().unwrap().push("flush");
        Ok(())
    }
    fn unmap(&self, o: u64, l: u64) -> Result<(), BackendError> {
        self.inner.unmap(o, l)
    }
    fn mapped(&self, o: u64, l: u64) -> Result<Vec<(u64, u64, bool)>, BackendError> {
        self.inner.mapped(o, l)
    }
    fn blocking(&self) -> bool {
        false
    }
    fn describe(&self) -> String {
        "recording".into()
    }
}

/// A 64-block LU over a [`Recording`] backend, with a nexus past its power-on unit attention.
fn recording_lu() -> (Arc<Recording>, LogicalUnit, Nexus) {
    let rec = Arc::new(Recording {
        inner: RamBackend::new(64 * BS as u64).unwrap(),
        log: Mutex::new(vec![]),
        read: AtomicU64::new(0),
    });
    let lu = LogicalUnit::new(rec.clone(), LuConfig::default());
    let n = nexus(1);
    ready(&lu, &n);
    (rec, lu, n)
}

/// A READ reads from the backend only the blocks the initiator will receive (its expected
/// length, rounded up to whole blocks), and counts the rest as unread for the residual.
#[test]
fn read_stops_at_the_expected_length() {
    let (rec, lu, n) = recording_lu();
    good(&run(&lu, &n, &write10(0, 16, 0), &[7; 16 * BS]));
    let mut c = read10(0, 16).to_vec();
    c.resize(16, 0);
    for (limit, bytes) in [
        (u32::MAX, 16 * BS),
        (16 * BS as u32, 16 * BS),
        (1000, 2 * BS),
        (BS as u32, BS),
        (0, 0),
    ] {
        rec.read.store(0, Ordering::Relaxed);
        let o = lu.execute(Command {
            nexus: &n,
            cdb: &c,
            data_out: Bytes::new(),
            data_in_limit: limit,
            attr: TaskAttribute::Simple,
            pace: None,
        });
        assert_eq!(o.status, status::GOOD, "limit {limit}");
        assert_eq!(o.data_in.len(), bytes, "limit {limit}");
        assert!(o.data_in.iter().all(|&b| b == 7));
        assert_eq!(o.data_in_unread as usize, 16 * BS - bytes, "limit {limit}");
        assert_eq!(
            rec.read.load(Ordering::Relaxed),
            bytes as u64,
            "backend bytes read, limit {limit}"
        );
    }
    // The range is still checked against the whole CDB, whatever the limit.
    let mut past = read10(60, 16).to_vec();
    past.resize(16, 0);
    let o = lu.execute(Command {
        nexus: &n,
        cdb: &past,
        data_out: Bytes::new(),
        data_in_limit: 0,
        attr: TaskAttribute::Simple,
        pace: None,
    });
    expect(&o, key::ILLEGAL_REQUEST, asc::LBA_OUT_OF_RANGE);
}

#[test]
fn fua_flushes_after_the_write_and_before_good() {
    let (rec, lu, n) = recording_lu();
    // Write cache on, no FUA: no flush.
    good(&run(&lu, &n, &write10(0, 1, 0), &[1; BS]));
    assert_eq!(*rec.log.lock().unwrap(), vec!["write"]);
    rec.log.lock().unwrap().clear();
    // FUA (byte 1 bit 3): write, then flush, then GOOD.
    good(&run(&lu, &n, &write10(0, 1, 0x08), &[2; BS]));
    assert_eq!(*rec.log.lock().unwrap(), vec!["write", "flush"]);
    rec.log.lock().unwrap().clear();
    // SYNCHRONIZE CACHE(10) flushes.
    good(&run(&lu, &n, &[0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]));
    assert_eq!(*rec.log.lock().unwrap(), vec!["flush"]);
    rec.log.lock().unwrap().clear();
    // Write cache disabled by MODE SELECT: every write is flushed.
    let mut page = vec![0u8, 0, 0, 0, 0x08, 0x12];
    page.resize(4 + 20, 0);
    good(&run(
        &lu,
        &n,
        &[0x15, 0x10, 0, 0, page.len() as u8, 0],
        &page,
    ));
    rec.log.lock().unwrap().clear();
    good(&run(&lu, &n, &write10(1, 1, 0), &[3; BS]));
    assert_eq!(*rec.log.lock().unwrap(), vec!["write", "flush"]);
}

#[test]
fn verify_bytchk_and_miscompare_offset() {
    let (lu, n) = lu_default();
    let mut data = vec![7u8; 2 * BS];
    good(&run(&lu, &n, &write10(5, 2, 0), &data));
    // BYTCHK=0: medium check only.
    good(&run(&lu, &n, &[0x2F, 0, 0, 0, 0, 5, 0, 0, 2, 0], &[]));
    // BYTCHK=1 equal data.
    good(&run(&lu, &n, &[0x2F, 0x02, 0, 0, 0, 5, 0, 0, 2, 0], &data));
    // BYTCHK=3: one block compared against each.
    good(&run(
        &lu,
        &n,
        &[0x2F, 0x06, 0, 0, 0, 5, 0, 0, 2, 0],
        &data[..BS],
    ));
    // Miscompare at byte 600: MISCOMPARE 1D/00, INFORMATION 600.
    data[600] = 8;
    let s = expect(
        &run(&lu, &n, &[0x2F, 0x02, 0, 0, 0, 5, 0, 0, 2, 0], &data),
        key::MISCOMPARE,
        asc::MISCOMPARE_DURING_VERIFY,
    );
    assert_eq!(s.information, Some(600));
    // BYTCHK=2 is reserved.
    expect(
        &run(&lu, &n, &[0x2F, 0x04, 0, 0, 0, 5, 0, 0, 2, 0], &data),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    // VERIFY(16) past the end.
    let mut v16 = [0u8; 16];
    v16[0] = 0x8F;
    v16[9] = 0xFF;
    v16[8] = 0x07;
    v16[13] = 2;
    expect(
        &run(&lu, &n, &v16, &[]),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
}

fn caw(lba: u64, nlb: u8) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = 0x89;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[13] = nlb;
    c
}

#[test]
fn compare_and_write() {
    let (lu, n) = lu_default();
    good(&run(&lu, &n, &write10(3, 1, 0), &[b'A'; BS]));
    let mut buf = vec![b'A'; BS];
    buf.extend_from_slice(&[b'B'; BS]);
    good(&run(&lu, &n, &caw(3, 1), &buf));
    assert!(good(&run(&lu, &n, &read10(3, 1), &[]))
        .iter()
        .all(|&b| b == b'B'));
    // Miscompare: verify data 'A' no longer matches; offset of first difference is 0.
    let s = expect(
        &run(&lu, &n, &caw(3, 1), &buf),
        key::MISCOMPARE,
        asc::MISCOMPARE_DURING_VERIFY,
    );
    assert_eq!(s.information, Some(0));
    // One byte off at offset 485 (27 from the end).
    let mut buf2 = vec![b'B'; BS];
    buf2[BS - 27] = b'C';
    buf2.extend_from_slice(&[b'D'; BS]);
    let s = expect(
        &run(&lu, &n, &caw(3, 1), &buf2),
        key::MISCOMPARE,
        asc::MISCOMPARE_DURING_VERIFY,
    );
    assert_eq!(s.information, Some((BS - 27) as u64));
    assert!(good(&run(&lu, &n, &read10(3, 1), &[]))
        .iter()
        .all(|&b| b == b'B'));
    // Wrong data-out size.
    expect(
        &run(&lu, &n, &caw(3, 1), &buf[..BS]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    // Past the end.
    expect(
        &run(&lu, &n, &caw(2048, 1), &buf),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
    // 256 blocks do not fit the one-byte length: it wraps to 0 and the data-out no longer
    // matches, which is an invalid field.
    expect(
        &run(&lu, &n, &caw(0, 0), &vec![0u8; 512 * BS]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    good(&run(&lu, &n, &caw(0, 0), &[]));
}

#[test]
fn compare_and_write_is_atomic_under_concurrency() {
    let lu = Arc::new(ram_lu(16, LuConfig::default()));
    let threads = 4;
    let per = 50u64;
    for t in 0..threads {
        ready(&lu, &nexus(t));
    }
    good(&run(&lu, &nexus(0), &write10(0, 1, 0), &[0u8; BS]));
    let mut hs = vec![];
    for t in 0..threads {
        let lu = lu.clone();
        hs.push(std::thread::spawn(move || {
            let n = nexus(t);
            let mut done = 0;
            while done < per {
                // Read the counter, then compare-and-swap counter -> counter+1.
                let cur = run(&lu, &n, &read10(0, 1), &[]).data_in.to_vec();
                let v = u64::from_be_bytes(cur[..8].try_into().unwrap());
                let mut next = cur.clone();
                next[..8].copy_from_slice(&(v + 1).to_be_bytes());
                let mut buf = cur;
                buf.extend_from_slice(&next);
                if run(&lu, &n, &caw(0, 1), &buf).status == status::GOOD {
                    done += 1;
                }
            }
        }));
    }
    for h in hs {
        h.join().unwrap();
    }
    let d = run(&lu, &nexus(0), &read10(0, 1), &[]).data_in;
    assert_eq!(
        u64::from_be_bytes(d[..8].try_into().unwrap()),
        threads as u64 * per
    );
}

fn get_lba_status(lba: u64, alloc: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = 0x9E;
    c[1] = 0x12;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&alloc.to_be_bytes());
    c
}

fn unmap_list(ranges: &[(u64, u32)]) -> Vec<u8> {
    let mut d = vec![0u8; 8];
    for (l, n) in ranges {
        d.extend_from_slice(&l.to_be_bytes());
        d.extend_from_slice(&n.to_be_bytes());
        d.extend_from_slice(&[0; 4]);
    }
    let len = d.len() as u16;
    d[0..2].copy_from_slice(&(len - 2).to_be_bytes());
    d[2..4].copy_from_slice(&(len - 8).to_be_bytes());
    d
}

#[test]
fn unmap_reads_zeros_and_reports_deallocated() {
    let (lu, n) = lu_default();
    good(&run(
        &lu,
        &n,
        &write10(0, 2 * CH as u16, 0),
        &vec![0x5A; 2 * CH * BS],
    ));
    // GET LBA STATUS: mapped from 0.
    let o = run(&lu, &n, &get_lba_status(0, 24), &[]);
    let d = good(&o);
    assert_eq!(d.len(), 24);
    assert_eq!(&d[8..16], &0u64.to_be_bytes());
    assert_eq!(d[20], 0); // mapped
                          // Unmap the first chunk of blocks (one allocation chunk).
    let list = unmap_list(&[(0, CH as u32)]);
    let c = [0x42, 0, 0, 0, 0, 0, 0, 0, list.len() as u8, 0];
    good(&run(&lu, &n, &c, &list));
    assert!(good(&run(&lu, &n, &read10(0, CH as u16), &[]))
        .iter()
        .all(|&b| b == 0));
    assert!(good(&run(&lu, &n, &read10(CH as u32, CH as u16), &[]))
        .iter()
        .all(|&b| b == 0x5A));
    let o = run(&lu, &n, &get_lba_status(0, 1024), &[]);
    let d = good(&o);
    // First descriptor: LBA 0, one chunk of blocks, deallocated; second: the next chunk, mapped.
    assert_eq!(&d[8..16], &0u64.to_be_bytes());
    assert_eq!(&d[16..20], &(CH as u32).to_be_bytes());
    assert_eq!(d[20], 1);
    assert_eq!(&d[24..32], &(CH as u64).to_be_bytes());
    assert_eq!(d[36], 0);
    // An unaligned single block unmap still reads back zeros.
    let list = unmap_list(&[(CH as u64 + 2, 1)]);
    good(&run(
        &lu,
        &n,
        &[0x42, 0, 0, 0, 0, 0, 0, 0, list.len() as u8, 0],
        &list,
    ));
    assert!(good(&run(&lu, &n, &read10(CH as u32 + 2, 1), &[]))
        .iter()
        .all(|&b| b == 0));
    // Past the end, parameter list too short, ANCHOR.
    let list = unmap_list(&[(2040, 9)]);
    expect(
        &run(
            &lu,
            &n,
            &[0x42, 0, 0, 0, 0, 0, 0, 0, list.len() as u8, 0],
            &list,
        ),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
    expect(
        &run(&lu, &n, &[0x42, 0, 0, 0, 0, 0, 0, 0, 4, 0], &[0, 2, 0, 0]),
        key::ILLEGAL_REQUEST,
        asc::PARAMETER_LIST_LENGTH_ERROR,
    );
    expect(
        &run(
            &lu,
            &n,
            &[0x42, 1, 0, 0, 0, 0, 0, 0, 24, 0],
            &unmap_list(&[(0, 1)]),
        ),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    // Parameter list length 0 is a no-op.
    good(&run(&lu, &n, &[0x42, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]));
    // GET LBA STATUS past the end.
    expect(
        &run(&lu, &n, &get_lba_status(2048, 24), &[]),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
}

#[test]
fn write_same() {
    let (lu, n) = lu_default();
    // WRITE SAME(10): 3 blocks at 20 from one block of 0x11.
    good(&run(
        &lu,
        &n,
        &[0x41, 0, 0, 0, 0, 20, 0, 0, 3, 0],
        &[0x11; BS],
    ));
    let o = run(&lu, &n, &read10(19, 5), &[]);
    let d = good(&o);
    assert!(d[..BS].iter().all(|&b| b == 0));
    assert!(d[BS..4 * BS].iter().all(|&b| b == 0x11));
    assert!(d[4 * BS..].iter().all(|&b| b == 0));
    // Data-out must be exactly one block.
    expect(
        &run(
            &lu,
            &n,
            &[0x41, 0, 0, 0, 0, 20, 0, 0, 3, 0],
            &[0x11; BS / 2],
        ),
        key::ILLEGAL_REQUEST,
        asc::PARAMETER_LIST_LENGTH_ERROR,
    );
    // Zero blocks past the end is out of range before it is a zero-length request.
    expect(
        &run(
            &lu,
            &n,
            &[0x41, 0, 0, 0, 0x08, 0x01, 0, 0, 0, 0],
            &[0x11; BS],
        ),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
    // Zero blocks (WSNZ clear): from the LBA to the end of the medium; at the end, nothing.
    let blocks = 2048u32;
    good(&run(
        &lu,
        &n,
        &[0x41, 0, 0, 0, 0x07, 0xF0, 0, 0, 0, 0],
        &[0x22; BS],
    ));
    let o = run(&lu, &n, &read10(blocks - 17, 17), &[]);
    let d = good(&o);
    assert!(
        d[..BS].iter().all(|&b| b == 0),
        "the block before is untouched"
    );
    assert!(d[BS..].iter().all(|&b| b == 0x22), "to the last block");
    good(&run(
        &lu,
        &n,
        &[0x41, 0, 0, 0, 0x08, 0x00, 0, 0, 0, 0],
        &[0x22; BS],
    ));
    // WRITE SAME(16) with UNMAP deallocates whatever the data (LBPRZ: reads zeros).
    // One whole allocation chunk, starting at LBA CH.
    good(&run(
        &lu,
        &n,
        &write10(CH as u32, CH as u16, 0),
        &vec![9; CH * BS],
    ));
    let mut c = [0u8; 16];
    c[0] = 0x93;
    c[1] = 0x08;
    c[2..10].copy_from_slice(&(CH as u64).to_be_bytes());
    c[10..14].copy_from_slice(&(CH as u32).to_be_bytes());
    good(&run(&lu, &n, &c, &[0xFF; BS]));
    assert!(good(&run(&lu, &n, &read10(CH as u32, CH as u16), &[]))
        .iter()
        .all(|&b| b == 0));
    let o = run(&lu, &n, &get_lba_status(CH as u64, 24), &[]);
    assert_eq!(good(&o)[20], 1);
    // NDOB: no data-out, zeros written.
    good(&run(&lu, &n, &write10(400, 2, 0), &[3; 2 * BS]));
    let mut c = [0u8; 16];
    c[0] = 0x93;
    c[1] = 0x01;
    c[8] = 0x01;
    c[9] = (400u16 - 256) as u8;
    c[13] = 2;
    good(&run(&lu, &n, &c, &[]));
    assert!(good(&run(&lu, &n, &read10(400, 2), &[]))
        .iter()
        .all(|&b| b == 0));
    // Past the end.
    expect(
        &run(&lu, &n, &[0x41, 0, 0, 0, 0x07, 0xFF, 0, 0, 2, 0], &[0; BS]),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
}

#[test]
fn mode_sense_and_select() {
    let lu = ram_lu(2048, LuConfig::default());
    let a = nexus(1);
    let b = nexus(2);
    ready(&lu, &a);
    ready(&lu, &b);
    // MODE SENSE(6), all pages, with block descriptor.
    let o = run(&lu, &a, &[0x1A, 0, 0x3F, 0, 255, 0], &[]);
    let d = good(&o).clone();
    assert_eq!(d[0] as usize, d.len() - 1);
    assert_eq!(d[2] & 0x10, 0x10); // DPOFUA
    assert_eq!(d[3], 8);
    assert_eq!(&d[4..12], &[0, 0, 0x08, 0x00, 0, 0, 0x02, 0x00]);
    // Pages 01h, 08h, 0Ah in order.
    assert_eq!((d[12], d[13]), (0x01, 0x0A));
    assert_eq!((d[24], d[25]), (0x08, 0x12));
    assert_eq!(d[26] & 0x04, 0x04); // WCE
    assert_eq!((d[44], d[45]), (0x0A, 0x0A));
    assert_eq!(d.len(), 56);
    // Allocation length truncation.
    let o = run(&lu, &a, &[0x1A, 0, 0x3F, 0, 4, 0], &[]);
    assert_eq!(good(&o).len(), 4);
    // Saved values are not supported.
    expect(
        &run(&lu, &a, &[0x1A, 0, 0xC8, 0, 255, 0], &[]),
        key::ILLEGAL_REQUEST,
        asc::SAVING_PARAMETERS_NOT_SUPPORTED,
    );
    // Changeable values of the caching page: WCE only.
    let o = run(&lu, &a, &[0x1A, 0x08, 0x48, 0, 255, 0], &[]);
    let d = good(&o);
    assert_eq!(d[3], 0);
    assert_eq!(&d[4..7], &[0x08, 0x12, 0x04]);
    // MODE SENSE(10) with LLBAA: 16-byte block descriptor.
    let o = run(&lu, &a, &[0x5A, 0x10, 0x08, 0, 0, 0, 0, 0, 255, 0], &[]);
    let d = good(&o);
    assert_eq!(d[4] & 1, 1);
    assert_eq!(u16::from_be_bytes([d[6], d[7]]), 16);
    assert_eq!(&d[8..16], &2048u64.to_be_bytes());
    // Unsupported page.
    expect(
        &run(&lu, &a, &[0x1A, 0, 0x19, 0, 255, 0], &[]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    // MODE SELECT(6): clear WCE. Others get MODE PARAMETERS CHANGED.
    let mut p = vec![0u8, 0, 0, 0, 0x08, 0x12];
    p.resize(24, 0);
    good(&run(&lu, &a, &[0x15, 0x10, 0, 0, 24, 0], &p));
    good(&run(&lu, &a, &[0, 0, 0, 0, 0, 0], &[]));
    expect(
        &run(&lu, &b, &[0, 0, 0, 0, 0, 0], &[]),
        key::UNIT_ATTENTION,
        asc::MODE_PARAMETERS_CHANGED,
    );
    let o = run(&lu, &a, &[0x1A, 0x08, 0x08, 0, 255, 0], &[]);
    assert_eq!(good(&o)[6] & 0x04, 0);
    // Changing a bit that is not changeable (RCD) is refused.
    p[6] = 0x01;
    expect(
        &run(&lu, &a, &[0x15, 0x10, 0, 0, 24, 0], &p),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_PARAMETER_LIST,
    );
    // D_SENSE: sense data switches to descriptor format (72h).
    let mut c = vec![0u8, 0, 0, 0, 0x0A, 0x0A, 0x04, 0x10];
    c.resize(16, 0);
    good(&run(&lu, &a, &[0x15, 0x10, 0, 0, 16, 0], &c));
    let o = run(&lu, &a, &read10(5000, 1), &[]);
    assert_eq!(o.sense.as_ref().unwrap()[0], 0x72);
    expect(&o, key::ILLEGAL_REQUEST, asc::LBA_OUT_OF_RANGE);
}

fn prout(sa: u8, ty: u8, rk: u64, sark: u64) -> ([u8; 10], Vec<u8>) {
    let c = [0x5F, sa, ty, 0, 0, 0, 0, 0, 24, 0];
    let mut p = Vec::new();
    p.extend_from_slice(&rk.to_be_bytes());
    p.extend_from_slice(&sark.to_be_bytes());
    p.resize(24, 0);
    (c, p)
}

fn pr(lu: &LogicalUnit, n: &Nexus, sa: u8, ty: u8, rk: u64, sark: u64) -> Outcome {
    let (c, p) = prout(sa, ty, rk, sark);
    run(lu, n, &c, &p)
}

#[test]
fn persistent_reservations() {
    let lu = ram_lu(64, LuConfig::default());
    let a = nexus(1);
    let b = nexus(2);
    ready(&lu, &a);
    ready(&lu, &b);
    good(&pr(&lu, &a, 0x00, 0, 0, 0xAAAA));
    good(&pr(&lu, &b, 0x06, 0, 0, 0xBBBB));
    // REGISTER with a wrong key conflicts.
    assert_eq!(
        pr(&lu, &a, 0x00, 0, 0x1234, 0xCCCC).status,
        status::RESERVATION_CONFLICT
    );
    // READ KEYS: generation 2, two keys.
    let o = run(&lu, &a, &[0x5E, 0x00, 0, 0, 0, 0, 0, 0x10, 0, 0], &[]);
    let d = good(&o);
    assert_eq!(&d[0..4], &2u32.to_be_bytes());
    assert_eq!(&d[4..8], &16u32.to_be_bytes());
    assert_eq!(&d[8..16], &0xAAAAu64.to_be_bytes());
    assert_eq!(&d[16..24], &0xBBBBu64.to_be_bytes());
    // Truncation keeps the header's length field.
    let o = run(&lu, &a, &[0x5E, 0x00, 0, 0, 0, 0, 0, 0, 12, 0], &[]);
    assert_eq!(good(&o).len(), 12);
    // WRITE EXCLUSIVE by A: B may read but not write.
    good(&pr(&lu, &a, 0x01, 0x01, 0xAAAA, 0));
    let o = run(&lu, &a, &[0x5E, 0x01, 0, 0, 0, 0, 0, 0x10, 0, 0], &[]);
    let d = good(&o);
    assert_eq!(&d[4..8], &16u32.to_be_bytes());
    assert_eq!(&d[8..16], &0xAAAAu64.to_be_bytes());
    assert_eq!(d[21], 0x01);
    good(&run(&lu, &a, &write10(0, 1, 0), &[1; BS]));
    good(&run(&lu, &b, &read10(0, 1), &[]));
    assert_eq!(
        run(&lu, &b, &write10(0, 1, 0), &[1; BS]).status,
        status::RESERVATION_CONFLICT
    );
    // RESERVE(6) conflicts with persistent reservations.
    assert_eq!(
        run(&lu, &a, &[0x16, 0, 0, 0, 0, 0], &[]).status,
        status::RESERVATION_CONFLICT
    );
    // B preempts A: A loses its registration and gets 2A/05.
    good(&pr(&lu, &b, 0x04, 0x03, 0xBBBB, 0xAAAA));
    expect(
        &run(&lu, &a, &[0, 0, 0, 0, 0, 0], &[]),
        key::UNIT_ATTENTION,
        asc::REGISTRATIONS_PREEMPTED,
    );
    // Now EXCLUSIVE ACCESS by B: A cannot even read.
    assert_eq!(
        run(&lu, &a, &read10(0, 1), &[]).status,
        status::RESERVATION_CONFLICT
    );
    // But INQUIRY and PR IN still work.
    good(&run(&lu, &a, &[0x12, 0, 0, 0, 36, 0], &[]));
    // REPORT CAPABILITIES.
    let o = run(&lu, &a, &[0x5E, 0x02, 0, 0, 0, 0, 0, 0, 8, 0], &[]);
    assert_eq!(&good(&o)[0..2], &[0, 8]);
    // READ FULL STATUS lists B as holder.
    let o = run(&lu, &b, &[0x5E, 0x03, 0, 0, 0, 0, 0, 0x10, 0, 0], &[]);
    let d = good(&o);
    assert_eq!(&d[8..16], &0xBBBBu64.to_be_bytes());
    assert_eq!(d[20] & 1, 1);
    assert_eq!(d[21], 0x03);
    // RELEASE with the wrong type.
    expect(
        &pr(&lu, &b, 0x02, 0x01, 0xBBBB, 0),
        key::ILLEGAL_REQUEST,
        asc::INVALID_RELEASE_OF_PERSISTENT_RESERVATION,
    );
    // CLEAR.
    good(&pr(&lu, &b, 0x03, 0, 0xBBBB, 0));
    good(&run(&lu, &a, &read10(0, 1), &[]));
    let o = run(&lu, &a, &[0x5E, 0x00, 0, 0, 0, 0, 0, 0x10, 0, 0], &[]);
    assert_eq!(&good(&o)[4..8], &[0, 0, 0, 0]);
}

#[test]
fn registrants_only_access() {
    let lu = ram_lu(64, LuConfig::default());
    let (a, b, c) = (nexus(1), nexus(2), nexus(3));
    for n in [&a, &b, &c] {
        ready(&lu, n);
    }
    good(&pr(&lu, &a, 0x06, 0, 0, 1));
    good(&pr(&lu, &b, 0x06, 0, 0, 2));
    // EXCLUSIVE ACCESS - REGISTRANTS ONLY: registrant B reads and writes, C does neither.
    good(&pr(&lu, &a, 0x01, 0x06, 1, 0));
    good(&run(&lu, &b, &write10(0, 1, 0), &[1; BS]));
    good(&run(&lu, &b, &read10(0, 1), &[]));
    assert_eq!(
        run(&lu, &c, &read10(0, 1), &[]).status,
        status::RESERVATION_CONFLICT
    );
    good(&pr(&lu, &a, 0x02, 0x06, 1, 0));
    // Releasing a registrants-only reservation tells the other registrants (SPC-4 5.9.11.2).
    expect(
        &run(&lu, &b, &[0, 0, 0, 0, 0, 0], &[]),
        key::UNIT_ATTENTION,
        asc::RESERVATIONS_RELEASED,
    );
    good(&run(&lu, &c, &[0, 0, 0, 0, 0, 0], &[]));
    // WRITE EXCLUSIVE - ALL REGISTRANTS: reservation key reads as 0.
    good(&pr(&lu, &a, 0x01, 0x07, 1, 0));
    let o = run(&lu, &c, &[0x5E, 0x01, 0, 0, 0, 0, 0, 0x10, 0, 0], &[]);
    let d = good(&o);
    assert_eq!(&d[8..16], &[0; 8]);
    assert_eq!(d[21], 0x07);
    good(&run(&lu, &c, &read10(0, 1), &[]));
    assert_eq!(
        run(&lu, &c, &write10(0, 1, 0), &[1; BS]).status,
        status::RESERVATION_CONFLICT
    );
    good(&run(&lu, &b, &write10(0, 1, 0), &[1; BS]));
}

#[test]
fn spc2_reserve_release() {
    let lu = ram_lu(64, LuConfig::default());
    let (a, b) = (nexus(1), nexus(2));
    ready(&lu, &a);
    ready(&lu, &b);
    good(&run(&lu, &a, &[0x16, 0, 0, 0, 0, 0], &[]));
    good(&run(&lu, &a, &read10(0, 1), &[]));
    assert_eq!(
        run(&lu, &b, &read10(0, 1), &[]).status,
        status::RESERVATION_CONFLICT
    );
    assert_eq!(
        run(&lu, &b, &[0x16, 0, 0, 0, 0, 0], &[]).status,
        status::RESERVATION_CONFLICT
    );
    good(&run(&lu, &b, &[0x12, 0, 0, 0, 36, 0], &[]));
    // RELEASE from B is GOOD and does nothing.
    good(&run(&lu, &b, &[0x17, 0, 0, 0, 0, 0], &[]));
    assert_eq!(
        run(&lu, &b, &read10(0, 1), &[]).status,
        status::RESERVATION_CONFLICT
    );
    // Nexus loss of A frees the unit.
    lu.nexus_lost(&a);
    good(&run(&lu, &b, &read10(0, 1), &[]));
    // So does a LU reset.
    good(&run(&lu, &b, &[0x56, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]));
    lu.reset();
    let _ = run(&lu, &a, &[0, 0, 0, 0, 0, 0], &[]);
    let _ = run(&lu, &a, &[0, 0, 0, 0, 0, 0], &[]);
    good(&run(&lu, &a, &read10(0, 1), &[]));
}

#[test]
fn report_supported_opcodes() {
    let (lu, n) = lu_default();
    let o = run(&lu, &n, &[0xA3, 0x0C, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0], &[]);
    let d = good(&o).clone();
    let len = u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize;
    assert_eq!(len, d.len() - 4);
    assert_eq!(len % 8, 0);
    let descs: Vec<&[u8]> = d[4..].chunks(8).collect();
    // READ(10): no service action, CDB length 10.
    let r10 = descs.iter().find(|x| x[0] == 0x28).unwrap();
    assert_eq!(r10[5], 0);
    assert_eq!(&r10[6..8], &[0, 10]);
    // PR IN READ KEYS has SERVACTV.
    assert!(descs.iter().any(|x| x[0] == 0x5E && x[5] & 1 == 1));
    // With RCTD every descriptor carries a 12-byte timeout descriptor.
    let o = run(
        &lu,
        &n,
        &[0xA3, 0x0C, 0x80, 0, 0, 0, 0, 0, 0x10, 0, 0, 0],
        &[],
    );
    let d = good(&o);
    assert_eq!((d.len() - 4) % 20, 0);
    assert_eq!(d[4 + 5] & 0x02, 0x02);
    assert_eq!(&d[12..14], &[0, 0x0A]);
    // One command: WRITE(10) usage data.
    let o = run(
        &lu,
        &n,
        &[0xA3, 0x0C, 0x01, 0x2A, 0, 0, 0, 0, 0x10, 0, 0, 0],
        &[],
    );
    let d = good(&o);
    assert_eq!(&d[0..4], &[0, 0x03, 0, 10]);
    assert_eq!(d[4], 0x2A);
    assert_eq!(d[5] & 0x18, 0x18); // DPO and FUA are examined
                                   // Reporting option 1 on a command with service actions is an invalid field.
    expect(
        &run(
            &lu,
            &n,
            &[0xA3, 0x0C, 0x01, 0x5E, 0, 0, 0, 0, 0x10, 0, 0, 0],
            &[],
        ),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    // Option 2 with the service action works.
    let o = run(
        &lu,
        &n,
        &[0xA3, 0x0C, 0x02, 0x9E, 0, 0x10, 0, 0, 0x10, 0, 0, 0],
        &[],
    );
    assert_eq!(good(&o)[1] & 0x07, 0x03);
    // Unsupported opcode: SUPPORT = 001b.
    let o = run(
        &lu,
        &n,
        &[0xA3, 0x0C, 0x01, 0xC7, 0, 0, 0, 0, 0x10, 0, 0, 0],
        &[],
    );
    assert_eq!(good(&o)[1] & 0x07, 0x01);
}

#[test]
fn device_server_luns() {
    let lu0 = Arc::new(ram_lu(16, LuConfig::default()));
    let lu3 = Arc::new(ram_lu(16, LuConfig::default()));
    let ds = DeviceServer::new(vec![(3, lu3), (0, lu0)]);
    let n = nexus(1);
    let cmd = |lun: u64, cdb: &[u8]| {
        let mut c = cdb.to_vec();
        c.resize(16, 0);
        ds.execute(
            lun,
            Command {
                nexus: &n,
                cdb: &c,
                data_out: Bytes::new(),
                data_in_limit: 4096,
                attr: TaskAttribute::Simple,
                pace: None,
            },
        )
    };
    let o = cmd(0, &[0xA0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0]);
    assert_eq!(
        &good(&o)[..],
        &[0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0]
    );
    // Allocation length below 16 is invalid (SPC-4 6.33).
    expect(
        &cmd(0, &[0xA0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    // Absent LUN 1: INQUIRY says qualifier 011b, TUR says LUN NOT SUPPORTED.
    let lun1 = mcsi_scsi::lun::encode(1);
    let o = cmd(lun1, &[0x12, 0, 0, 0, 36, 0]);
    assert_eq!(good(&o)[0], 0x7F);
    expect(
        &cmd(lun1, &[0, 0, 0, 0, 0, 0]),
        key::ILLEGAL_REQUEST,
        asc::LUN_NOT_SUPPORTED,
    );
    assert!(ds.lu(mcsi_scsi::lun::encode(3)).is_some());
    assert!(ds.lu(lun1).is_none());
    let dp = ds.data_phase(0, &read10(0, 4));
    assert_eq!((dp.data_out_len, dp.data_in_len), (0, 4 * BS as u32));
}

#[test]
fn data_phase_from_cdb() {
    let lu = ram_lu(16, LuConfig::default());
    let dp = |c: &[u8]| {
        let d = lu.data_phase(c);
        (d.data_out_len, d.data_in_len)
    };
    assert_eq!(dp(&write10(0, 3, 0)), (3 * BS as u32, 0));
    assert_eq!(dp(&[0x08, 0, 0, 0, 0, 0]), (0, 256 * BS as u32));
    assert_eq!(dp(&caw(0, 2)), (4 * BS as u32, 0));
    // CAW of zero blocks asks for one byte so that stray data-out is caught.
    assert_eq!(dp(&caw(0, 0)), (1, 0));
    assert_eq!(dp(&[0x41, 0, 0, 0, 0, 0, 0, 0, 9, 0]), (BS as u32, 0));
    assert_eq!(dp(&[0x42, 0, 0, 0, 0, 0, 0, 0, 24, 0]), (24, 0));
    assert_eq!(dp(&[0x12, 1, 0xB0, 0, 64, 0]), (0, 64));
    assert_eq!(
        dp(&[0x2F, 0x02, 0, 0, 0, 0, 0, 0, 2, 0]),
        (2 * BS as u32, 0)
    );
    assert_eq!(dp(&[0x2F, 0x00, 0, 0, 0, 0, 0, 0, 2, 0]), (0, 0));
    // A huge READ(16) is not buffered; execute rejects it.
    let mut r16 = [0u8; 16];
    r16[0] = 0x88;
    r16[10..14].copy_from_slice(&u32::MAX.to_be_bytes());
    assert_eq!(dp(&r16), (0, 0));
    // A WRITE beyond the maximum transfer length (8 MiB) asks for no data (execute refuses
    // it); one at the maximum asks for all of it.
    let max_blocks = (8u32 << 20) / BS as u32;
    let mut w16 = [0u8; 16];
    w16[0] = 0x8A;
    w16[10..14].copy_from_slice(&(2 * max_blocks).to_be_bytes());
    assert_eq!(dp(&w16), (0, 0));
    w16[10..14].copy_from_slice(&max_blocks.to_be_bytes());
    assert_eq!(dp(&w16), (8 << 20, 0));
}

#[test]
fn data_phase_bounds_data_in_of_large_allocation_lengths() {
    // An allocation length above the transfer limit still gets its answer, so data_phase must
    // not promise less than execute returns (it used to say 0 for these).
    let lu = ram_lu(64, LuConfig::default());
    let n = nexus(1);
    ready(&lu, &n);
    let big = (16u32 << 20).to_be_bytes();
    let mut rl = vec![0xA0, 0, 0, 0, 0, 0];
    rl.extend_from_slice(&big);
    rl.extend_from_slice(&[0, 0]);
    let mut opcodes = vec![0xA3, 0x0C, 0, 0, 0, 0];
    opcodes.extend_from_slice(&big);
    opcodes.extend_from_slice(&[0, 0]);
    let mut rc16 = vec![0x9E, 0x10, 0, 0, 0, 0, 0, 0, 0, 0];
    rc16.extend_from_slice(&big);
    rc16.extend_from_slice(&[0, 0]);
    let mut defects = vec![0xB7, 0x05];
    defects.extend_from_slice(&[0, 0, 0, 0]);
    defects.extend_from_slice(&big);
    defects.extend_from_slice(&[0, 0]);
    for cdb in [rl, opcodes, rc16, defects] {
        let o = run(&lu, &n, &cdb, &[]);
        let d = good(&o);
        assert!(!d.is_empty(), "{cdb:02x?}");
        let promised = lu.data_phase(&cdb).data_in_len;
        assert!(
            d.len() <= promised as usize,
            "{cdb:02x?}: {} > {promised}",
            d.len()
        );
    }
}

#[test]
fn backend_failures_are_medium_errors_with_lba() {
    let ram: Arc<dyn Backend> = Arc::new(RamBackend::new(64 * BS as u64).unwrap());
    let fb = Arc::new(FailingBackend::new(ram, 1));
    let lu = LogicalUnit::new(fb.clone(), LuConfig::default());
    let n = nexus(1);
    ready(&lu, &n);
    good(&run(&lu, &n, &write10(5, 1, 0), &[1; BS]));
    let s = expect(
        &run(&lu, &n, &read10(7, 1), &[]),
        key::MEDIUM_ERROR,
        asc::UNRECOVERED_READ_ERROR,
    );
    assert_eq!(s.information, Some(7));
    let s = expect(
        &run(&lu, &n, &write10(9, 1, 0), &[1; BS]),
        key::MEDIUM_ERROR,
        asc::WRITE_ERROR,
    );
    assert_eq!(s.information, Some(9));
    assert_eq!(fb.failures(), 2);
    fb.heal();
    assert_eq!(good(&run(&lu, &n, &read10(5, 1), &[]))[0], 1);
}

#[test]
fn start_stop_and_prevent_allow() {
    let (lu, n) = lu_default();
    good(&run(&lu, &n, &[0x1B, 0, 0, 0, 0x01, 0], &[]));
    good(&run(&lu, &n, &[0x1B, 0x01, 0, 0, 0x00, 0], &[]));
    // LOEJ on a non-removable medium.
    expect(
        &run(&lu, &n, &[0x1B, 0, 0, 0, 0x02, 0], &[]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    good(&run(&lu, &n, &[0x1E, 0, 0, 0, 1, 0], &[]));
    good(&run(&lu, &n, &[0x1E, 0, 0, 0, 0, 0], &[]));
    good(&run(&lu, &n, &[0x34, 0, 0, 0, 0, 0, 0, 0, 8, 0], &[]));
    expect(
        &run(&lu, &n, &[0x34, 0, 0, 0, 0x08, 0, 0, 0, 8, 0], &[]),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
}

#[test]
fn read_defect_data_is_an_empty_list() {
    let (lu, n) = lu_default();
    // READ DEFECT DATA(10), REQ_GLIST, format 101b: header echoes GLISTV and the format.
    let o = run(&lu, &n, &[0x37, 0, 0x0D, 0, 0, 0, 0, 0, 32, 0], &[]);
    assert_eq!(&good(&o)[..], &[0, 0x0D, 0, 0]);
    let o = run(&lu, &n, &[0xB7, 0x0D, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0], &[]);
    assert_eq!(&good(&o)[..], &[0, 0x0D, 0, 0, 0, 0, 0, 0]);
}

#[test]
fn unit_attentions_are_not_duplicated_and_request_sense_desc() {
    let lu = ram_lu(64, LuConfig::default());
    let (a, b) = (nexus(1), nexus(2));
    ready(&lu, &a);
    ready(&lu, &b);
    let mut p = vec![0u8, 0, 0, 0, 0x08, 0x12, 0x00];
    p.resize(24, 0);
    let mut q = p.clone();
    q[6] = 0x04;
    // Two changes: B is told once.
    good(&run(&lu, &a, &[0x15, 0x10, 0, 0, 24, 0], &p));
    good(&run(&lu, &a, &[0x15, 0x10, 0, 0, 24, 0], &q));
    // REQUEST SENSE with DESC=1 returns the unit attention in descriptor format.
    let o = run(&lu, &b, &[0x03, 0x01, 0, 0, 252, 0], &[]);
    let d = good(&o);
    assert_eq!(&d[..4], &[0x72, 0x06, 0x2A, 0x01]);
    good(&run(&lu, &b, &[0, 0, 0, 0, 0, 0], &[]));
}

#[test]
fn orwrite_ors_into_the_medium() {
    let (lu, n) = lu_default();
    good(&run(&lu, &n, &write10(8, 1, 0), &[0x0F; BS]));
    let mut c = [0u8; 16];
    c[0] = 0x8B;
    c[9] = 8;
    c[13] = 1;
    good(&run(&lu, &n, &c, &[0x30; BS]));
    assert!(good(&run(&lu, &n, &read10(8, 1), &[]))
        .iter()
        .all(|&b| b == 0x3F));
    // REPORT SUPPORTED OPERATION CODES lists it with DPO/FUA examined.
    let o = run(
        &lu,
        &n,
        &[0xA3, 0x0C, 0x01, 0x8B, 0, 0, 0, 0, 0x10, 0, 0, 0],
        &[],
    );
    let d = good(&o);
    assert_eq!(&d[0..4], &[0, 0x03, 0, 16]);
    assert_eq!(d[5] & 0x18, 0x18);
    // ORPROTECT without protection information.
    c[1] = 0x20;
    expect(
        &run(&lu, &n, &c, &[0; BS]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    c[1] = 0;
    c[9] = 0xFF;
    c[8] = 0x07;
    c[13] = 2;
    expect(
        &run(&lu, &n, &c, &[0; 2 * BS]),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
}

#[test]
fn a_512e_unit_reports_its_physical_block() {
    let lu = ram_lu(
        64,
        LuConfig {
            lbppb_exponent: 3,
            ..LuConfig::default()
        },
    );
    let n = nexus(1);
    ready(&lu, &n);
    // READ CAPACITY(16): LOGICAL BLOCKS PER PHYSICAL BLOCK EXPONENT 3, lowest aligned LBA 0.
    let mut c = [0u8; 16];
    c[0] = 0x9E;
    c[1] = 0x10;
    c[13] = 32;
    let d = good(&run(&lu, &n, &c, &[])).to_vec();
    assert_eq!(d[13] & 0x0F, 3);
    assert_eq!((d[14] & 0x3F, d[15]), (0, 0));
    // Block Limits: OPTIMAL TRANSFER LENGTH GRANULARITY is a physical block.
    let d = good(&run(&lu, &n, &[0x12, 1, 0xB0, 0, 0x40, 0], &[])).to_vec();
    assert_eq!(u16::from_be_bytes([d[6], d[7]]), 8);
}

#[test]
fn fixed_size_data_out_with_more_data_than_the_cdb_asks_is_refused() {
    let lu0 = Arc::new(ram_lu(16, LuConfig::default()));
    let ds = DeviceServer::new(vec![(0, lu0)]);
    let mut ws = [0u8; 16];
    ws[..10].copy_from_slice(&[0x41, 0, 0, 0, 0, 2, 0, 0, 1, 0]);
    // WRITE SAME(10) of one block needs one block: two are an error, one is not.
    let o = ds.overflow_refused(0, &ws, 2 * BS as u32).expect("refused");
    expect(&o, key::ILLEGAL_REQUEST, asc::INVALID_FIELD_IN_CDB);
    assert!(ds.overflow_refused(0, &ws, BS as u32).is_none());
    // COMPARE AND WRITE of one block: two blocks of data-out, not four.
    let mut caw = [0u8; 16];
    caw[0] = 0x89;
    caw[13] = 1;
    assert!(ds.overflow_refused(0, &caw, 4 * BS as u32).is_some());
    assert!(ds.overflow_refused(0, &caw, 2 * BS as u32).is_none());
    // A WRITE(10) that overflows runs and reports the residual.
    let w = [0x2A, 0, 0, 0, 0, 2, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0];
    assert!(ds.overflow_refused(0, &w, 8 * BS as u32).is_none());
}

/// A file LUN grows while a nexus uses it: the nexus is told once (CAPACITY DATA HAS CHANGED)
/// and then sees the new capacity and can use it; a smaller size, or a store that cannot grow,
/// is refused and changes nothing.
#[test]
fn a_grown_unit_tells_its_nexuses_and_serves_the_new_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lun.img");
    let file = mcsi_scsi::FileBackend::create(&path, 64 * BS as u64).unwrap();
    let lu = LogicalUnit::new(Arc::new(file), LuConfig::default());
    let n = nexus(1);
    ready(&lu, &n);
    let cap10 = [0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    assert_eq!(&good(&run(&lu, &n, &cap10, &[]))[..4], &63u32.to_be_bytes());
    expect(
        &run(&lu, &n, &read10(100, 1), &[]),
        key::ILLEGAL_REQUEST,
        asc::LBA_OUT_OF_RANGE,
    );
    assert_eq!(lu.grow(Some(128 * BS as u64)).unwrap(), (64, 128));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 128 * BS as u64);
    expect(
        &run(&lu, &n, &cap10, &[]),
        key::UNIT_ATTENTION,
        asc::CAPACITY_DATA_CHANGED,
    );
    assert_eq!(
        &good(&run(&lu, &n, &cap10, &[]))[..4],
        &127u32.to_be_bytes()
    );
    let data = vec![0x5A; BS];
    good(&run(&lu, &n, &write10(100, 1, 0), &data));
    assert_eq!(&good(&run(&lu, &n, &read10(100, 1), &[]))[..], &data[..]);
    // The file extended behind the unit's back: taken as it is now.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(256 * BS as u64)
        .unwrap();
    assert_eq!(lu.grow(None).unwrap(), (128, 256));
    // Never smaller; a RAM unit cannot change size.
    let e = lu.grow(Some(64 * BS as u64)).unwrap_err().to_string();
    assert!(e.contains("only grows"), "{e}");
    assert_eq!(lu.blocks(), 256);
    let ram = ram_lu(64, LuConfig::default());
    let e = ram.grow(Some(128 * BS as u64)).unwrap_err().to_string();
    assert!(e.contains("cannot change size"), "{e}");
    assert_eq!(ram.blocks(), 64);
}
