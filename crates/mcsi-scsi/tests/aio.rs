#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The asynchronous device path (prepare, backend operations completing on another thread,
//! finish) against the synchronous one, on a RAM store behind one completion thread
//! (`AioRamBackend`): the same commands give the same outcomes and the same medium; a FUA write
//! is a write then a flush; COMPARE AND WRITE goes through the store's own compare-and-write,
//! atomically; a write whose blocks another write holds goes to the synchronous path; an abandoned
//! operation lets its blocks go; backend failures become MEDIUM ERROR with the LBA; a READ never
//! shows a WRITE ATOMIC half done.

use bytes::Bytes;
use mcsi_scsi::{
    status, AioRamBackend, Backend, Command, FailingBackend, LogicalUnit, LuConfig, Nexus, Outcome,
    Prepared, RamBackend, Step, TaskAttribute,
};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

const BS: usize = 512;
const SIZE: u64 = 4 << 20;

fn nexus(i: u8) -> Nexus {
    Nexus {
        initiator_port: Arc::from(format!("iqn.2026-01.test:init{i},i,0x00023d00000{i}")),
        target_port: Arc::from("iqn.2026-01.test:disk,t,0x0001"),
        relative_port: 1,
    }
}

fn cmd<'a>(n: &'a Nexus, cdb: &'a [u8], data: Bytes) -> Command<'a> {
    Command {
        nexus: n,
        cdb,
        data_out: data,
        data_in_limit: u32::MAX,
        attr: TaskAttribute::Simple,
        pace: None,
    }
}

/// Runs a command the way the target does: the asynchronous path when it takes it, waiting
/// for each completion on a channel; the synchronous one otherwise. Also returns how many
/// backend operations it submitted.
fn run(lu: &Arc<LogicalUnit>, n: &Nexus, cdb: &[u8], data: Bytes) -> (Outcome, usize) {
    match lu.prepare(&cmd(n, cdb, data.clone())) {
        Prepared::Done(o) => (o, 0),
        Prepared::Sync => (lu.execute(cmd(n, cdb, data)), 0),
        Prepared::Io(mut p) => {
            let mut ops = 0;
            loop {
                let (tx, rx) = mpsc::channel();
                p.submit(Box::new(move |r| tx.send(r).unwrap()));
                ops += 1;
                let r = rx.recv_timeout(Duration::from_secs(10)).unwrap();
                match p.finish(r) {
                    Step::Done(o) => return (o, ops),
                    Step::Next(next) => p = next,
                    Step::Blocking(f) => return (f(), ops),
                }
            }
        }
    }
}

fn aio_lu(latency: Duration) -> (Arc<LogicalUnit>, Arc<AioRamBackend>) {
    let b = Arc::new(AioRamBackend::new(SIZE, latency).unwrap());
    let lu = Arc::new(LogicalUnit::new(
        b.clone() as Arc<dyn Backend>,
        LuConfig::default(),
    ));
    (lu, b)
}

fn rw10(op: u8, lba: u32, blocks: u16, flags: u8) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = op;
    c[1] = flags;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn caw(lba: u64, blocks: u8) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = 0x89;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[13] = blocks;
    c
}

const READ_10: u8 = 0x28;
const WRITE_10: u8 = 0x2A;
const SYNC_CACHE_10: u8 = 0x35;

/// A small deterministic generator, so that the mixed sequence is the same on every run.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

#[test]
fn the_asynchronous_path_gives_what_the_synchronous_one_gives() {
    let (alu, ab) = aio_lu(Duration::ZERO);
    let slu = Arc::new(LogicalUnit::new(
        Arc::new(RamBackend::new(SIZE).unwrap()),
        LuConfig::default(),
    ));
    let n = nexus(1);
    let blocks = (SIZE / BS as u64) as u32;
    let mut g = Lcg(7);
    let mut async_ops = 0;
    for i in 0..400 {
        // Some commands out of range, some with flags the unit refuses, FUA, reads of
        // unwritten blocks, zero-length transfers, COMPARE AND WRITE that matches or not.
        let lba = (g.next() as u32) % (blocks + 8);
        let nlb = (g.next() % 64) as u16;
        let (cdb, data): (Vec<u8>, Bytes) = match g.next() % 6 {
            0 | 1 => (rw10(READ_10, lba, nlb, 0).to_vec(), Bytes::new()),
            2 => {
                let flags = [0, 0x08, 0x20][(g.next() % 3) as usize];
                let fill = (i % 251) as u8;
                (
                    rw10(WRITE_10, lba, nlb, flags).to_vec(),
                    Bytes::from(vec![fill; nlb as usize * BS]),
                )
            }
            3 => (rw10(SYNC_CACHE_10, lba, nlb, 0).to_vec(), Bytes::new()),
            4 => {
                let k = (g.next() % 4) as u8;
                // Half of them compare against zeros (unwritten blocks match).
                let cmp = u8::from(!g.next().is_multiple_of(2));
                let mut d = vec![cmp; k as usize * BS];
                d.extend(vec![0xC0 | k; k as usize * BS]);
                (caw(lba as u64, k).to_vec(), Bytes::from(d))
            }
            _ => {
                // A write with less data than its CDB names: the whole blocks sent are written.
                let d = Bytes::from(vec![0x5A; (nlb as usize * BS) / 2 + 7]);
                (rw10(WRITE_10, lba, nlb, 0).to_vec(), d)
            }
        };
        let (a, ops) = run(&alu, &n, &cdb, data.clone());
        async_ops += ops;
        let s = slu.execute(cmd(&n, &cdb, data));
        assert_eq!(a, s, "command {i}: {cdb:02x?}");
    }
    // The whole medium is the same.
    let mut x = vec![0u8; SIZE as usize];
    let mut y = vec![0u8; SIZE as usize];
    alu.backend().read_at(0, &mut x).unwrap();
    slu.backend().read_at(0, &mut y).unwrap();
    assert!(x == y, "the media differ");
    // And the asynchronous path was taken, not the synchronous one under another name.
    assert!(
        ab.submitted() as usize == async_ops && async_ops > 200,
        "{async_ops} operations"
    );
}

#[test]
fn a_fua_write_is_a_write_then_a_flush() {
    let (lu, _) = aio_lu(Duration::ZERO);
    let n = nexus(1);
    run(&lu, &n, &[0u8; 6], Bytes::new()); // power-on unit attention
    let d = Bytes::from(vec![9u8; 4 * BS]);
    let (o, ops) = run(&lu, &n, &rw10(WRITE_10, 8, 4, 0x08), d.clone());
    assert_eq!((o.status, ops), (status::GOOD, 2));
    let (o, ops) = run(&lu, &n, &rw10(WRITE_10, 8, 4, 0), d);
    assert_eq!((o.status, ops), (status::GOOD, 1));
    let (o, ops) = run(&lu, &n, &rw10(SYNC_CACHE_10, 0, 0, 0), Bytes::new());
    assert_eq!((o.status, ops), (status::GOOD, 1));
}

#[test]
fn compare_and_write_racing_from_many_threads_lets_each_value_win_once() {
    // Eight threads each take a counter in block 0 from v to v+1 with COMPARE AND WRITE, reading
    // it first. With an atomic compare-and-write every value is won exactly once.
    let (lu, _) = aio_lu(Duration::from_micros(50));
    let won = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let (lu, won) = (lu.clone(), won.clone());
            std::thread::spawn(move || {
                let n = nexus(t);
                run(&lu, &n, &[0u8; 6], Bytes::new());
                for _ in 0..40 {
                    let (o, _) = run(&lu, &n, &rw10(READ_10, 0, 1, 0), Bytes::new());
                    let v = u64::from_be_bytes(o.data_in[..8].try_into().unwrap());
                    let mut d = o.data_in.to_vec();
                    d.extend_from_slice(&(v + 1).to_be_bytes());
                    d.resize(2 * BS, 0);
                    let (o, _) = run(&lu, &n, &caw(0, 1), Bytes::from(d));
                    if o.status == status::GOOD {
                        won.fetch_add(1, Ordering::SeqCst);
                    } else {
                        // MISCOMPARE, at the counter's first differing byte (0..8).
                        let s = o.sense.unwrap();
                        assert_eq!((s[2] & 0x0F, s[12]), (0x0E, 0x1D), "{s:02x?}");
                        let info = u32::from_be_bytes(s[3..7].try_into().unwrap());
                        assert!(info < 8, "INFORMATION {info}");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut b = [0u8; 8];
    lu.backend().read_at(0, &mut b).unwrap();
    let v = u64::from_be_bytes(b);
    assert_eq!(v as usize, won.load(Ordering::SeqCst));
    assert!(v >= 40, "only {v} increments won");
}

#[test]
fn a_write_whose_blocks_are_held_goes_to_the_synchronous_path_and_dropping_lets_them_go() {
    let (lu, _) = aio_lu(Duration::ZERO);
    let n = nexus(1);
    run(&lu, &n, &[0u8; 6], Bytes::new());
    let d = Bytes::from(vec![1u8; 8 * BS]);
    let cdb = rw10(WRITE_10, 16, 8, 0);
    let Prepared::Io(held) = lu.prepare(&cmd(&n, &cdb, d.clone())) else {
        panic!("not on the asynchronous path");
    };
    // Overlapping (blocks 20..28) while the first holds 16..24: synchronous.
    let cdb2 = rw10(WRITE_10, 20, 8, 0);
    assert!(matches!(
        lu.prepare(&cmd(&n, &cdb2, d.clone())),
        Prepared::Sync
    ));
    // Beside it (24..32): asynchronous.
    let cdb3 = rw10(WRITE_10, 24, 8, 0);
    assert!(matches!(
        lu.prepare(&cmd(&n, &cdb3, d.clone())),
        Prepared::Io(_)
    ));
    // A read does not take the lock.
    assert!(matches!(
        lu.prepare(&cmd(&n, &rw10(READ_10, 16, 8, 0), Bytes::new())),
        Prepared::Io(_)
    ));
    drop(held);
    assert!(matches!(lu.prepare(&cmd(&n, &cdb2, d)), Prepared::Io(_)));
}

#[test]
fn unit_attentions_and_checks_end_a_command_before_any_io() {
    let (lu, b) = aio_lu(Duration::ZERO);
    let n = nexus(1);
    let (o, ops) = run(&lu, &n, &rw10(READ_10, 0, 1, 0), Bytes::new());
    assert_eq!((o.status, ops), (status::CHECK_CONDITION, 0), "power-on UA");
    let (o, ops) = run(&lu, &n, &rw10(READ_10, u32::MAX, 1, 0), Bytes::new());
    assert_eq!(
        (o.status, ops),
        (status::CHECK_CONDITION, 0),
        "out of range"
    );
    assert_eq!(b.submitted(), 0);
}

#[test]
fn a_failed_operation_is_a_medium_error_at_its_lba() {
    let inner: Arc<dyn Backend> = Arc::new(AioRamBackend::new(SIZE, Duration::ZERO).unwrap());
    let failing = Arc::new(FailingBackend::new(inner, u64::MAX));
    let lu = Arc::new(LogicalUnit::new(
        failing.clone() as Arc<dyn Backend>,
        LuConfig::default(),
    ));
    let n = nexus(1);
    run(&lu, &n, &[0u8; 6], Bytes::new());
    failing.fail_after(0);
    for (cdb, data, asc) in [
        (rw10(READ_10, 77, 2, 0), Bytes::new(), 0x11),
        (
            rw10(WRITE_10, 78, 2, 0),
            Bytes::from(vec![1u8; 2 * BS]),
            0x0C,
        ),
    ] {
        let (o, ops) = run(&lu, &n, &cdb, data);
        assert_eq!((o.status, ops), (status::CHECK_CONDITION, 1));
        let s = o.sense.unwrap();
        assert_eq!((s[2] & 0x0F, s[12]), (0x03, asc), "{s:02x?}");
        assert_eq!(
            u32::from_be_bytes(s[3..7].try_into().unwrap()),
            cdb[5] as u32
        );
    }
    // A FUA write whose flush fails is not GOOD.
    failing.fail_after(1);
    let (o, ops) = run(
        &lu,
        &n,
        &rw10(WRITE_10, 80, 1, 0x08),
        Bytes::from(vec![2u8; BS]),
    );
    assert_eq!((o.status, ops), (status::CHECK_CONDITION, 2));
    assert_eq!(failing.failures(), 3);
}

#[test]
fn an_asynchronous_read_never_shows_a_write_atomic_half_done() {
    // 1 MiB WRITE ATOMIC(16)s of one byte value after another on the synchronous path, READs
    // of the same range on the asynchronous one: every read holds one value.
    const BLOCKS: usize = 2048;
    let (lu, _) = aio_lu(Duration::ZERO);
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (lu, done) = (lu.clone(), done.clone());
        std::thread::spawn(move || {
            let n = nexus(2);
            run(&lu, &n, &[0u8; 6], Bytes::new());
            let mut c = [0u8; 16];
            c[0] = 0x88;
            c[10..14].copy_from_slice(&(BLOCKS as u32).to_be_bytes());
            let mut torn = 0;
            for _ in 0..300 {
                let (o, _) = run(&lu, &n, &c, Bytes::new());
                let first = o.data_in.first().copied();
                if o.status != status::GOOD || o.data_in.iter().any(|&b| Some(b) != first) {
                    torn += 1;
                }
            }
            done.store(true, Ordering::SeqCst);
            torn
        })
    };
    let n = nexus(1);
    run(&lu, &n, &[0u8; 6], Bytes::new());
    let mut c = [0u8; 16];
    c[0] = 0x9C;
    c[12..14].copy_from_slice(&(BLOCKS as u16).to_be_bytes());
    let mut g = 0u8;
    while !done.load(Ordering::SeqCst) {
        g = g.wrapping_add(1);
        let (o, _) = run(&lu, &n, &c, Bytes::from(vec![g; BLOCKS * BS]));
        assert_eq!(o.status, status::GOOD);
    }
    assert_eq!(reader.join().unwrap(), 0, "torn reads");
}

#[test]
fn a_submitted_write_holds_its_blocks_until_it_completes_even_when_given_up() {
    let (lu, _) = aio_lu(Duration::from_millis(300));
    let n = nexus(1);
    run(&lu, &n, &[0u8; 6], Bytes::new());
    let d = Bytes::from(vec![3u8; 8 * BS]);
    let cdb = rw10(WRITE_10, 40, 8, 0);
    let Prepared::Io(mut p) = lu.prepare(&cmd(&n, &cdb, d.clone())) else {
        panic!("not on the asynchronous path");
    };
    let (tx, rx) = mpsc::channel();
    p.submit(Box::new(move |r| tx.send(r).unwrap()));
    // The task is given up while the write is in flight: its blocks stay held.
    drop(p);
    assert!(matches!(
        lu.prepare(&cmd(&n, &cdb, d.clone())),
        Prepared::Sync
    ));
    // Once it completes they are free.
    rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
    assert!(matches!(lu.prepare(&cmd(&n, &cdb, d)), Prepared::Io(_)));
}
