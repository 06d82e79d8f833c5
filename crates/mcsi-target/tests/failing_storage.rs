#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Failing storage: a backend error must surface as CHECK CONDITION MEDIUM ERROR with the LBA,
//! nothing may be acknowledged that was not written, and other LUNs keep serving.
//!
//! `mcsi_target::Server` opens LUN backends from spec strings only (`LunSpec::backend`), so a
//! `FailingBackend` cannot be put behind a LUN of a running target; these tests drive the
//! device server the target uses (`mcsi_scsi::DeviceServer`) directly at the SCSI level.

use bytes::Bytes;
use mcsi_scsi::backend::{open_backend, Backend, FailingBackend};
use mcsi_scsi::{lun, Command, DeviceServer, LogicalUnit, LuConfig, Nexus, TaskAttribute};
use std::sync::Arc;

const BS: usize = 512;

fn nexus() -> Nexus {
    Nexus {
        initiator_port: "iqn.2026-01.org.mcsi:client,i,0x800102030405".into(),
        target_port: "iqn.2026-01.org.mcsi:test,t,0x1".into(),
        relative_port: 1,
    }
}

fn rw10(op: u8, lba: u32, blocks: u16) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn pattern(n: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..n)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect::<Vec<u8>>(),
    )
}

struct Rig {
    dev: DeviceServer,
    failing: Arc<FailingBackend>,
    n: Nexus,
}

impl Rig {
    /// LUN 0 on a failing RAM backend, LUN 1 on a plain RAM backend.
    fn new() -> Rig {
        let failing = Arc::new(FailingBackend::new(
            open_backend("ram:1MiB").unwrap(),
            u64::MAX,
        ));
        let lu0 = Arc::new(LogicalUnit::new(
            failing.clone() as Arc<dyn Backend>,
            LuConfig::default(),
        ));
        let lu1 = Arc::new(LogicalUnit::new(
            open_backend("ram:1MiB").unwrap(),
            LuConfig::default(),
        ));
        assert_eq!(lu0.config().block_size as usize, BS);
        let rig = Rig {
            dev: DeviceServer::new(vec![(0, lu0), (1, lu1)]),
            failing,
            n: nexus(),
        };
        // Clear the power-on unit attention of both LUNs.
        for l in [0, 1] {
            for _ in 0..3 {
                if rig.exec(l, &[0; 16], Bytes::new(), 0).0 == 0 {
                    break;
                }
            }
        }
        rig
    }

    fn exec(
        &self,
        l: u16,
        cdb: &[u8],
        data_out: Bytes,
        data_in_limit: u32,
    ) -> (u8, Option<Bytes>, Bytes) {
        let o = self.dev.execute(
            lun::encode(l),
            Command {
                nexus: &self.n,
                cdb,
                data_out,
                data_in_limit,
                attr: TaskAttribute::Simple,
            },
        );
        (o.status, o.sense, o.data_in)
    }

    fn write(&self, l: u16, lba: u32, data: Bytes) -> (u8, Option<Bytes>) {
        let blocks = (data.len() / BS) as u16;
        let (st, sense, _) = self.exec(l, &rw10(0x2a, lba, blocks), data, 0);
        (st, sense)
    }

    fn read(&self, l: u16, lba: u32, blocks: u16) -> (u8, Option<Bytes>, Bytes) {
        self.exec(
            l,
            &rw10(0x28, lba, blocks),
            Bytes::new(),
            u32::from(blocks) * BS as u32,
        )
    }
}

/// Fixed-format sense (SPC-5 4.4.3): (key, ASC, ASCQ, INFORMATION if VALID).
fn sense_fields(s: &[u8]) -> (u8, u8, u8, Option<u32>) {
    assert!(s.len() >= 14, "sense too short: {s:02x?}");
    assert_eq!(
        s[0] & 0x7f,
        0x70,
        "not current fixed-format sense: {s:02x?}"
    );
    let info = (s[0] & 0x80 != 0).then(|| u32::from_be_bytes([s[3], s[4], s[5], s[6]]));
    (s[2] & 0x0f, s[12], s[13], info)
}

#[test]
fn failed_write_is_medium_error_with_lba_and_not_acknowledged() {
    let r = Rig::new();
    let old = pattern(16 * BS, 1);
    assert_eq!(r.write(0, 100, old.clone()).0, 0);

    r.failing.fail_after(0);
    let (st, sense) = r.write(0, 100, pattern(16 * BS, 99));
    assert_eq!(st, 2, "a failed write must be CHECK CONDITION");
    let (key, asc, _, info) = sense_fields(&sense.unwrap());
    // SBC-4: WRITE ERROR is MEDIUM ERROR (3) with ASC 0Ch; INFORMATION = first failed LBA.
    assert_eq!((key, asc), (3, 0x0c));
    assert_eq!(info, Some(100));
    assert!(r.failing.failures() >= 1);

    // The other LUN serves meanwhile.
    let other = pattern(8 * BS, 5);
    assert_eq!(r.write(1, 7, other.clone()).0, 0);
    let (st, _, got) = r.read(1, 7, 8);
    assert_eq!(st, 0);
    assert_eq!(got, other);

    // Reads of the failing LUN fail too, as MEDIUM ERROR (11h unrecovered read error).
    let (st, sense, _) = r.read(0, 104, 4);
    assert_eq!(st, 2);
    let (key, asc, _, info) = sense_fields(&sense.unwrap());
    assert_eq!((key, asc, info), (3, 0x11, Some(104)));

    // After healing, the failed range still holds the old data.
    r.failing.heal();
    let (st, _, got) = r.read(0, 100, 16);
    assert_eq!(st, 0);
    assert_eq!(got, old, "data of a failed write became visible");
}

#[test]
fn fua_write_whose_flush_fails_is_not_acknowledged() {
    let r = Rig::new();
    // WRITE (10) with FUA (SBC-4 5.40): GOOD promises the data is on the medium, so when the
    // data write succeeds but the flush behind it fails, the command must not report GOOD.
    // One backend operation is allowed (the data write); the flush is the one that fails.
    let mut cdb = rw10(0x2a, 300, 8);
    cdb[1] = 0x08;
    r.failing.fail_after(1);
    let (st, sense, _) = r.exec(0, &cdb, pattern(8 * BS, 42), 0);
    r.failing.heal();
    assert_eq!(st, 2, "a FUA write whose flush failed was acknowledged");
    let (key, asc, _, _) = sense_fields(&sense.unwrap());
    assert_eq!((key, asc), (3, 0x0c));
    assert_eq!(r.failing.failures(), 1);
}

#[test]
fn flush_failure_is_reported() {
    let r = Rig::new();
    r.failing.fail_after(0);
    // SYNCHRONIZE CACHE (10).
    let mut cdb = [0u8; 16];
    cdb[0] = 0x35;
    let (st, sense, _) = r.exec(0, &cdb, Bytes::new(), 0);
    assert_eq!(st, 2, "a failed flush must not report GOOD");
    let (key, _, _, _) = sense_fields(&sense.unwrap());
    assert_eq!(key, 3);
    // LUN 1 flushes fine.
    assert_eq!(r.exec(1, &cdb, Bytes::new(), 0).0, 0);
}
