#![allow(clippy::unwrap_used, clippy::expect_used)]
//! WRITE ATOMIC(16) against concurrent READs from another I_T nexus (another session): a read
//! returns the blocks all as they were before a write or all as it left them, never some of
//! each. The range spans several allocation chunks of the RAM backend (and many pages of a
//! file), so a plain write is not atomic there; the control run with WRITE(16) shows how often
//! that is seen.

use bytes::Bytes;
use mcsi_scsi::{
    status, Backend, Command, FileBackend, LogicalUnit, LuConfig, Nexus, RamBackend, TaskAttribute,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const BS: usize = 512;
/// 1 MiB: eight chunks of the RAM backend.
const BLOCKS: usize = 2048;

fn nexus(i: u8) -> Nexus {
    Nexus {
        initiator_port: Arc::from(format!("iqn.2026-01.test:init{i},i,0x00023d00000{i}")),
        target_port: Arc::from("iqn.2026-01.test:disk,t,0x0001"),
        relative_port: 1,
    }
}

fn exec(lu: &LogicalUnit, n: &Nexus, cdb: [u8; 16], data: Bytes) -> mcsi_scsi::Outcome {
    lu.execute(Command {
        nexus: n,
        cdb: &cdb,
        data_out: data,
        data_in_limit: u32::MAX,
        attr: TaskAttribute::Simple,
        pace: None,
    })
}

fn rw16(op: u8, blocks: usize) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    if op == 0x9C {
        // WRITE ATOMIC(16): two-byte TRANSFER LENGTH in bytes 12-13.
        c[12..14].copy_from_slice(&(blocks as u16).to_be_bytes());
    } else {
        c[10..14].copy_from_slice(&(blocks as u32).to_be_bytes());
    }
    c
}

/// Generation after generation written over the whole range with `write_op` while another
/// nexus reads it `reads` times: how many reads were torn (held bytes of two generations).
fn torn_reads(lu: Arc<LogicalUnit>, write_op: u8, reads: usize) -> usize {
    for i in [1u8, 2] {
        // The power-on unit attention of each nexus.
        exec(&lu, &nexus(i), [0u8; 16], Bytes::new());
    }
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (lu, done) = (Arc::clone(&lu), Arc::clone(&done));
        std::thread::spawn(move || {
            let n = nexus(2);
            let mut torn = 0;
            for _ in 0..reads {
                let o = exec(&lu, &n, rw16(0x88, BLOCKS), Bytes::new());
                assert_eq!(o.status, status::GOOD, "{o:?}");
                let first = o.data_in[0];
                if o.data_in.iter().any(|&b| b != first) {
                    torn += 1;
                }
            }
            done.store(true, Ordering::Relaxed);
            torn
        })
    };
    let n = nexus(1);
    let mut g = 0u8;
    while !done.load(Ordering::Relaxed) {
        g = g.wrapping_add(1);
        let data = Bytes::from(vec![g; BLOCKS * BS]);
        let o = exec(&lu, &n, rw16(write_op, BLOCKS), data);
        assert_eq!(o.status, status::GOOD, "{o:?}");
    }
    reader.join().unwrap()
}

#[test]
fn a_read_never_sees_a_write_atomic_half_done_on_ram() {
    let lu = || {
        let b: Arc<dyn Backend> = Arc::new(RamBackend::new((BLOCKS * BS) as u64).unwrap());
        Arc::new(LogicalUnit::new(b, LuConfig::default()))
    };
    // The control first: plain WRITE(16)s under the same reads must tear, or reads and writes
    // never overlapped here and the atomic run's 0 would prove nothing. (Up to five tries of
    // 2,000 reads: a busy machine may keep the two threads apart for a while.)
    // The control needs the reader and the writer to overlap, which a loaded two-core machine
    // (the fuzz targets build beside the tests) may not give in a few rounds: up to 40 rounds
    // (0.3 s each unloaded), until one tears.
    let mut control = 0;
    for _ in 0..40 {
        control += torn_reads(lu(), 0x8A, 2000);
        if control > 0 {
            break;
        }
    }
    println!("RAM, WRITE(16), the control: {control} torn reads");
    assert!(
        control > 0,
        "plain WRITE(16)s never tore a read: reads and writes did not overlap, so this test cannot tell an atomic write from another"
    );
    let torn = torn_reads(lu(), 0x9C, 2000);
    println!("RAM, WRITE ATOMIC(16): {torn} torn reads of 2000");
    assert_eq!(torn, 0, "a read saw a WRITE ATOMIC half done");
}

/// A file cannot keep the promise (a write can fail part way, ENOSPC on a sparse file, and
/// leave part of it written): its LUN offers no WRITE ATOMIC. The Block Limits page gives a
/// MAXIMUM ATOMIC TRANSFER LENGTH of 0, and the command is refused as unsupported, writing
/// nothing. (The RAM LUN above offers it.)
#[test]
fn a_file_lun_does_not_offer_write_atomic() {
    let dir = tempfile::tempdir().unwrap();
    let vpd_b0_max_atomic = |lu: &LogicalUnit, n: &Nexus| {
        let mut c = [0u8; 16];
        c[..6].copy_from_slice(&[0x12, 0x01, 0xB0, 0x00, 0xFF, 0x00]);
        let o = exec(lu, n, c, Bytes::new());
        assert_eq!(o.status, status::GOOD, "{o:?}");
        u32::from_be_bytes([o.data_in[44], o.data_in[45], o.data_in[46], o.data_in[47]])
    };
    let n = nexus(1);
    let b: Arc<dyn Backend> =
        Arc::new(FileBackend::create(&dir.path().join("f"), (BLOCKS * BS) as u64).unwrap());
    let file = LogicalUnit::new(b, LuConfig::default());
    exec(&file, &n, [0u8; 16], Bytes::new());
    assert_eq!(vpd_b0_max_atomic(&file, &n), 0);
    let o = exec(&file, &n, rw16(0x9C, 8), Bytes::from(vec![7u8; 8 * BS]));
    assert_eq!(o.status, status::CHECK_CONDITION, "{o:?}");
    let sense = o.sense.unwrap();
    assert_eq!(
        (sense[2] & 0x0f, sense[12], sense[13]),
        (5, 0x20, 0x00),
        "INVALID COMMAND OPERATION CODE"
    );
    let o = exec(&file, &n, rw16(0x88, 8), Bytes::new());
    assert!(o.data_in.iter().all(|&b| b == 0), "the refused write wrote");
    let b: Arc<dyn Backend> = Arc::new(RamBackend::new((BLOCKS * BS) as u64).unwrap());
    let ram = LogicalUnit::new(b, LuConfig::default());
    exec(&ram, &n, [0u8; 16], Bytes::new());
    assert_eq!(vpd_b0_max_atomic(&ram, &n), (8 << 20) / BS as u32);
}
