#![allow(clippy::unwrap_used, clippy::expect_used)]
//! SANITIZE: what each service action leaves on the medium, the NOT READY state while one runs
//! (with its progress), that it outlives resets and nexus loss, and sanitize failure mode.

mod common;

use bytes::Bytes;
use common::{expect, nexus, run, sense_of};
use mcsi_scsi::sense::{asc, key};
use mcsi_scsi::{
    status, Backend, FailingBackend, LogicalUnit, LuConfig, Nexus, Outcome, RamBackend, Sense,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BS: usize = 512;
const BLOCKS: u64 = 2048;

/// A unit that honours SANITIZE (as `allow_sanitize` configures it).
fn unit(backend: Arc<dyn Backend>, cfg: LuConfig) -> (LogicalUnit, Nexus) {
    let lu = LogicalUnit::new(
        backend,
        LuConfig {
            allow_sanitize: true,
            ..cfg
        },
    );
    let n = nexus(1);
    run(&lu, &n, &[0, 0, 0, 0, 0, 0], &[]);
    (lu, n)
}

fn ram() -> Arc<dyn Backend> {
    Arc::new(RamBackend::new(BLOCKS * BS as u64).unwrap())
}

fn good(o: &Outcome) {
    assert_eq!(o.status, status::GOOD, "{o:?}");
}

/// SANITIZE with IMMED, AUSE, service action and parameter list length.
fn sanitize(immed: bool, ause: bool, sa: u8, plen: u16) -> Vec<u8> {
    let mut b1 = sa;
    if immed {
        b1 |= 0x80;
    }
    if ause {
        b1 |= 0x20;
    }
    let l = plen.to_be_bytes();
    vec![0x48, b1, 0, 0, 0, 0, 0, l[0], l[1], 0]
}

/// OVERWRITE parameter data: INVERT, passes and the pattern.
fn overwrite(invert: bool, passes: u8, pattern: &[u8]) -> Vec<u8> {
    let mut p = vec![passes | if invert { 0x80 } else { 0 }, 0];
    p.extend_from_slice(&(pattern.len() as u16).to_be_bytes());
    p.extend_from_slice(pattern);
    p
}

fn read(lu: &LogicalUnit, n: &Nexus, lba: u64, blocks: u32) -> Bytes {
    let mut c = vec![0x88, 0];
    c.extend_from_slice(&lba.to_be_bytes());
    c.extend_from_slice(&blocks.to_be_bytes());
    let o = run(lu, n, &c, &[]);
    good(&o);
    o.data_in
}

fn write(lu: &LogicalUnit, n: &Nexus, lba: u64, data: &[u8]) {
    let mut c = vec![0x8A, 0];
    c.extend_from_slice(&lba.to_be_bytes());
    c.extend_from_slice(&((data.len() / BS) as u32).to_be_bytes());
    good(&run(lu, n, &c, data));
}

#[test]
fn overwrite_repeats_the_pattern_over_every_block() {
    let (lu, n) = unit(ram(), LuConfig::default());
    write(&lu, &n, 0, &vec![b'a'; 64 * BS]);
    let p = overwrite(false, 1, &[1, 2, 3]);
    good(&run(
        &lu,
        &n,
        &sanitize(false, false, 1, p.len() as u16),
        &p,
    ));
    let want: Vec<u8> = [1u8, 2, 3].iter().copied().cycle().take(BS).collect();
    for lba in [0, 1, BLOCKS / 2, BLOCKS - 1] {
        assert_eq!(&read(&lu, &n, lba, 1)[..], &want[..], "block {lba}");
    }
    // Two passes with INVERT: the second, last pass writes the inverted pattern.
    let p = overwrite(true, 2, &[0x0F]);
    good(&run(
        &lu,
        &n,
        &sanitize(false, false, 1, p.len() as u16),
        &p,
    ));
    assert!(read(&lu, &n, 7, 1).iter().all(|&b| b == 0xF0));
}

#[test]
fn block_and_crypto_erase_deallocate_everything() {
    for sa in [2u8, 3] {
        let (lu, n) = unit(ram(), LuConfig::default());
        write(&lu, &n, 0, &vec![b'a'; 256 * BS]);
        write(&lu, &n, BLOCKS - 256, &vec![b'a'; 256 * BS]);
        good(&run(&lu, &n, &sanitize(false, false, sa, 0), &[]));
        assert!(read(&lu, &n, 0, 256).iter().all(|&b| b == 0));
        assert!(read(&lu, &n, BLOCKS - 256, 256).iter().all(|&b| b == 0));
        // GET LBA STATUS: one deallocated extent over the whole unit.
        let mut c = vec![0x9E, 0x12];
        c.extend_from_slice(&0u64.to_be_bytes());
        c.extend_from_slice(&256u32.to_be_bytes());
        let o = run(&lu, &n, &c, &[]);
        good(&o);
        let d = &o.data_in;
        assert_eq!(u32::from_be_bytes([d[0], d[1], d[2], d[3]]), 4 + 16);
        assert_eq!(
            u32::from_be_bytes([d[16], d[17], d[18], d[19]]) as u64,
            BLOCKS
        );
        assert_eq!(d[20] & 0x0F, 1, "deallocated");
    }
}

#[test]
fn malformed_sanitize_commands_are_refused() {
    let (lu, n) = unit(ram(), LuConfig::default());
    let p = overwrite(false, 1, &[0xAA; BS]);
    // Service actions other than 01h, 02h, 03h and 1Fh.
    for sa in [0u8, 4, 0x10, 0x1E] {
        expect(
            &run(&lu, &n, &sanitize(false, false, sa, 0), &[]),
            key::ILLEGAL_REQUEST,
            asc::INVALID_FIELD_IN_CDB,
        );
    }
    // OVERWRITE parameter list lengths of 0 to 4 and of a block + 5.
    for plen in [0u16, 1, 4, BS as u16 + 5] {
        let mut data = p.clone();
        data.resize(BS + 8, 0);
        expect(
            &run(&lu, &n, &sanitize(false, false, 1, plen), &data),
            key::ILLEGAL_REQUEST,
            asc::INVALID_FIELD_IN_CDB,
        );
    }
    // OVERWRITE COUNT 0; pattern length 0 or beyond a block.
    let mut zero_count = p.clone();
    zero_count[0] = 0;
    let mut no_pattern = p.clone();
    no_pattern[2..4].copy_from_slice(&[0, 0]);
    let mut long_pattern = p.clone();
    long_pattern[2..4].copy_from_slice(&(BS as u16 + 4).to_be_bytes());
    for bad in [zero_count, no_pattern, long_pattern] {
        expect(
            &run(&lu, &n, &sanitize(false, false, 1, bad.len() as u16), &bad),
            key::ILLEGAL_REQUEST,
            asc::INVALID_FIELD_IN_PARAMETER_LIST,
        );
    }
    // Erase and EXIT FAILURE MODE take no parameter list; reserved bytes and ZNR.
    for sa in [2u8, 3, 0x1F] {
        expect(
            &run(&lu, &n, &sanitize(false, false, sa, 8), &[0; 8]),
            key::ILLEGAL_REQUEST,
            asc::INVALID_FIELD_IN_CDB,
        );
    }
    let mut c = sanitize(false, false, 2, 0);
    c[1] |= 0x40;
    expect(
        &run(&lu, &n, &c, &[]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_CDB,
    );
    for i in 2..7 {
        let mut c = sanitize(false, false, 2, 0);
        c[i] = 1;
        expect(
            &run(&lu, &n, &c, &[]),
            key::ILLEGAL_REQUEST,
            asc::INVALID_FIELD_IN_CDB,
        );
    }
    // A read-only unit is not sanitized.
    let (ro, n) = unit(
        ram(),
        LuConfig {
            read_only: true,
            ..LuConfig::default()
        },
    );
    expect(
        &run(&ro, &n, &sanitize(false, false, 2, 0), &[]),
        key::DATA_PROTECT,
        asc::WRITE_PROTECTED,
    );
}

/// Without `allow_sanitize` a unit knows no SANITIZE: any admitted initiator could otherwise
/// erase it. The command is refused as unsupported, changes nothing, and REPORT SUPPORTED
/// OPERATION CODES leaves it out (it lists it when allowed).
#[test]
fn sanitize_is_refused_unless_the_lun_allows_it() {
    let lu = LogicalUnit::new(ram(), LuConfig::default());
    let n = nexus(1);
    run(&lu, &n, &[0, 0, 0, 0, 0, 0], &[]);
    let before = read(&lu, &n, 0, 4);
    let p = overwrite(false, 1, &[0xa5; 4]);
    expect(
        &run(&lu, &n, &sanitize(false, false, 1, p.len() as u16), &p),
        key::ILLEGAL_REQUEST,
        asc::INVALID_COMMAND_OPERATION_CODE,
    );
    assert_eq!(
        read(&lu, &n, 0, 4),
        before,
        "the refused SANITIZE changed data"
    );
    // REPORT SUPPORTED OPERATION CODES, one command: SANITIZE (48h) service action 1.
    let rsoc = |lu: &LogicalUnit| {
        let o = run(
            lu,
            &n,
            &[0xa3, 0x0c, 0x02, 0x48, 0, 1, 0, 0, 1, 0, 0, 0],
            &[],
        );
        good(&o);
        o.data_in[1] & 0x07
    };
    assert_eq!(rsoc(&lu), 1, "not supported");
    let (allowed, _) = unit(ram(), LuConfig::default());
    assert_eq!(rsoc(&allowed), 3, "supported");
}

#[test]
fn a_running_sanitize_makes_the_unit_not_ready_and_outlives_resets() {
    // 1 MiB at 2 MiB/s: about half a second.
    let cfg = LuConfig {
        sanitize_rate: 2 << 20,
        allow_sanitize: true,
        ..LuConfig::default()
    };
    let (lu, n) = unit(ram(), cfg);
    let p = overwrite(false, 1, &[0x5A]);
    let started = Instant::now();
    good(&run(&lu, &n, &sanitize(true, false, 1, p.len() as u16), &p));
    assert!(
        started.elapsed() < Duration::from_millis(400),
        "IMMED returns at once"
    );
    let tur = [0u8, 0, 0, 0, 0, 0];
    expect(
        &run(&lu, &n, &tur, &[]),
        key::NOT_READY,
        asc::SANITIZE_IN_PROGRESS,
    );
    let mut c = vec![0x88, 0];
    c.extend_from_slice(&[0; 12]);
    c[13] = 1;
    expect(
        &run(&lu, &n, &c, &[]),
        key::NOT_READY,
        asc::SANITIZE_IN_PROGRESS,
    );
    // A second sanitize waits its turn.
    expect(
        &run(&lu, &n, &sanitize(true, false, 2, 0), &[]),
        key::NOT_READY,
        asc::SANITIZE_IN_PROGRESS,
    );
    // INQUIRY runs; REQUEST SENSE says how far it is.
    good(&run(&lu, &n, &[0x12, 0, 0, 0, 96, 0], &[]));
    let o = run(&lu, &n, &[0x03, 0, 0, 0, 18, 0], &[]);
    good(&o);
    let s = Sense::parse(&o.data_in).unwrap();
    assert_eq!((s.key, s.asc, s.ascq), (key::NOT_READY, 0x04, 0x1B));
    assert_eq!(
        s.sks.map(|k| k[0] & 0x80),
        Some(0x80),
        "progress indication"
    );
    // Resets and the loss of the nexus leave it running.
    lu.reset();
    lu.nexus_lost(&n);
    let n2 = nexus(2);
    let mut saw_running = false;
    loop {
        let o = run(&lu, &n2, &tur, &[]);
        if o.status == status::GOOD {
            break;
        }
        let s = sense_of(&o);
        if (s.key, s.asc, s.ascq) == (key::NOT_READY, 0x04, 0x1B) {
            saw_running = true;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "sanitize never ended"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(saw_running, "still running after the resets");
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "paced to the rate: {:?}",
        started.elapsed()
    );
    assert!(read(&lu, &n2, BLOCKS - 1, 1).iter().all(|&b| b == 0x5A));
}

#[test]
fn a_failed_sanitize_leaves_failure_mode_until_exit_or_success() {
    let failing = Arc::new(FailingBackend::new(ram(), u64::MAX));
    let (lu, n) = unit(failing.clone(), LuConfig::default());
    let p = overwrite(false, 1, &[0x11]);
    let read1 = [0x28u8, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    for ause in [false, true] {
        failing.fail_after(0);
        expect(
            &run(&lu, &n, &sanitize(false, ause, 1, p.len() as u16), &p),
            key::MEDIUM_ERROR,
            asc::SANITIZE_COMMAND_FAILED,
        );
        failing.heal();
        expect(
            &run(&lu, &n, &read1, &[]),
            key::MEDIUM_ERROR,
            asc::SANITIZE_COMMAND_FAILED,
        );
        let exit = run(&lu, &n, &sanitize(false, false, 0x1F, 0), &[]);
        if ause {
            good(&exit);
            good(&run(&lu, &n, &read1, &[]));
        } else {
            // Without AUSE only a sanitize that completes ends failure mode.
            expect(&exit, key::ILLEGAL_REQUEST, asc::INVALID_FIELD_IN_CDB);
            good(&run(&lu, &n, &sanitize(false, false, 2, 0), &[]));
            good(&run(&lu, &n, &read1, &[]));
        }
    }
}

#[test]
fn stopping_the_unit_ends_a_sanitize_and_the_command_waiting_for_it() {
    // 4 MiB at 64 KiB/s: a minute if left alone.
    let cfg = LuConfig {
        sanitize_rate: 64 << 10,
        allow_sanitize: true,
        ..LuConfig::default()
    };
    let (lu, n) = unit(Arc::new(RamBackend::new(4 << 20).unwrap()), cfg);
    let lu = Arc::new(lu);
    let p = overwrite(false, 1, &[0x77]);
    let (l2, n2) = (lu.clone(), n.clone());
    let started = Instant::now();
    let waiter =
        std::thread::spawn(move || run(&l2, &n2, &sanitize(false, false, 1, p.len() as u16), &p));
    // Once it runs (another nexus sees SANITIZE IN PROGRESS): waited on, not slept for, since
    // a busy machine may start the thread late.
    let n3 = nexus(3);
    loop {
        let o = run(&lu, &n3, &[0, 0, 0, 0, 0, 0], &[]);
        if o.status != status::GOOD {
            let s = sense_of(&o);
            if (s.key, s.asc, s.ascq) == (key::NOT_READY, 0x04, 0x1B) {
                break;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the sanitize never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(lu.stop_background(), "a sanitize was running");
    let o = waiter.join().unwrap();
    expect(&o, key::MEDIUM_ERROR, asc::SANITIZE_COMMAND_FAILED);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the wait ended with the stop: {:?}",
        started.elapsed()
    );
    assert!(!lu.stop_background(), "nothing runs any more");
}
