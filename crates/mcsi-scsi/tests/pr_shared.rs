//! Persistent reservations shared by the gateways of one stored image
//! (`Backend::shared_reservations`, an RBD image's record in production): two units over one
//! store, each with its own target port, play two gateways. A registration and a reservation
//! made through one bind the other; a preemption through the other reaches the first's
//! initiator as a unit attention; a change another gateway stored first is applied again on
//! the new record, never over it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use mcsi_scsi::backend::RamBackend;
use mcsi_scsi::sense::asc;
use mcsi_scsi::{status, Backend, BackendError, LogicalUnit, LuConfig, Nexus, SharedState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

type Heard = Box<dyn Fn() + Send + Sync>;

/// The record every gateway reads and replaces, with the gateways that watch it.
#[derive(Default)]
struct Record {
    stored: Mutex<(Vec<u8>, u64)>,
    watchers: Mutex<Vec<(usize, Heard)>>,
    /// Replaces still to lose, as if another gateway had stored first each time.
    lose: AtomicUsize,
    announced: AtomicUsize,
}

/// One gateway's view of the record, and its storage (the image: shared too).
struct Gateway {
    id: usize,
    record: Arc<Record>,
    data: Arc<RamBackend>,
}

impl SharedState for Gateway {
    fn read(&self) -> Result<(Vec<u8>, u64), BackendError> {
        Ok(self.record.stored.lock().unwrap().clone())
    }
    fn replace(&self, bytes: &[u8], version: u64) -> Result<bool, BackendError> {
        let mut s = self.record.stored.lock().unwrap();
        if self
            .record
            .lose
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            s.1 += 1;
            return Ok(false);
        }
        if s.1 != version {
            return Ok(false);
        }
        *s = (bytes.to_vec(), version + 1);
        Ok(true)
    }
    fn announce(&self) -> Result<(), BackendError> {
        self.record.announced.fetch_add(1, Ordering::AcqRel);
        for (id, heard) in self.record.watchers.lock().unwrap().iter() {
            if *id != self.id {
                heard();
            }
        }
        Ok(())
    }
    fn watch(&self, heard: Heard) -> Result<(), BackendError> {
        self.record.watchers.lock().unwrap().push((self.id, heard));
        Ok(())
    }
}

impl Backend for Gateway {
    fn size(&self) -> u64 {
        self.data.size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.data.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.data.write_at(offset, data)
    }
    fn flush(&self) -> Result<(), BackendError> {
        self.data.flush()
    }
    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.data.unmap(offset, len)
    }
    fn mapped(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, BackendError> {
        self.data.mapped(offset, len)
    }
    fn blocking(&self) -> bool {
        false
    }
    fn describe(&self) -> String {
        format!("gateway {}", self.id)
    }
    fn shared_reservations(&self) -> Option<&dyn SharedState> {
        Some(self)
    }
}

/// Two gateways' units over one image and one record.
fn gateways() -> (LogicalUnit, LogicalUnit, Arc<Record>) {
    let record = Arc::new(Record::default());
    let data = Arc::new(RamBackend::new(1 << 20).unwrap());
    let unit = |id| {
        let g = Gateway {
            id,
            record: record.clone(),
            data: data.clone(),
        };
        let lu = LogicalUnit::new(Arc::new(g), LuConfig::default());
        lu.load_reservations().unwrap();
        lu
    };
    (unit(0), unit(1), record)
}

/// Initiator `i` through gateway `g` (target port g+1).
fn at(i: u8, g: u16) -> Nexus {
    let mut n = nexus(i);
    n.target_port = Arc::from(format!("iqn.2026-01.test:disk,t,0x000{}", g + 1));
    n.relative_port = g + 1;
    n
}

fn pr_out(lu: &LogicalUnit, n: &Nexus, sa: u8, ty: u8, rk: u64, sark: u64) -> mcsi_scsi::Outcome {
    let mut p = [0u8; 24];
    p[0..8].copy_from_slice(&rk.to_be_bytes());
    p[8..16].copy_from_slice(&sark.to_be_bytes());
    run(lu, n, &[0x5f, sa, ty, 0, 0, 0, 0, 0, 24, 0], &p)
}

fn keys(lu: &LogicalUnit, n: &Nexus) -> Vec<u64> {
    let o = run(lu, n, &[0x5e, 0, 0, 0, 0, 0, 0, 0x10, 0, 0], &[]);
    assert_eq!(o.status, status::GOOD, "{o:?}");
    let d = o.data_in;
    let len = u32::from_be_bytes(d[4..8].try_into().unwrap()) as usize;
    d[8..8 + len]
        .chunks(8)
        .map(|k| u64::from_be_bytes(k.try_into().unwrap()))
        .collect()
}

fn write(lu: &LogicalUnit, n: &Nexus) -> mcsi_scsi::Outcome {
    run(lu, n, &[0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[7; 512])
}

fn read(lu: &LogicalUnit, n: &Nexus) -> mcsi_scsi::Outcome {
    run(lu, n, &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[])
}

#[test]
fn a_reservation_made_through_one_gateway_binds_the_other_and_a_preemption_reaches_back() {
    let (a, b, record) = gateways();
    let (na, nb) = (at(1, 0), at(2, 1));
    // The power-on unit attentions.
    run(&a, &na, &[0; 6], &[]);
    run(&b, &nb, &[0; 6], &[]);

    assert_eq!(pr_out(&a, &na, 0, 0, 0, 0xaa).status, status::GOOD);
    assert_eq!(pr_out(&a, &na, 1, 1, 0xaa, 0).status, status::GOOD);
    assert!(record.announced.load(Ordering::Acquire) >= 2);
    assert_eq!(
        keys(&b, &nb),
        [0xaa],
        "gateway 2 does not see the registration"
    );
    let o = write(&b, &nb);
    assert_eq!(o.status, status::RESERVATION_CONFLICT, "{o:?}");
    assert_eq!(read(&b, &nb).status, status::GOOD);
    assert_eq!(write(&a, &na).status, status::GOOD);

    // Gateway 2's initiator registers and preempts gateway 1's.
    assert_eq!(pr_out(&b, &nb, 0, 0, 0, 0xbb).status, status::GOOD);
    assert_eq!(pr_out(&b, &nb, 4, 1, 0xbb, 0xaa).status, status::GOOD);
    assert_eq!(write(&b, &nb).status, status::GOOD);
    expect(&write(&a, &na), 0x6, asc::REGISTRATIONS_PREEMPTED);
    let o = write(&a, &na);
    assert_eq!(o.status, status::RESERVATION_CONFLICT, "{o:?}");
    assert_eq!(keys(&a, &na), [0xbb]);
}

#[test]
fn a_change_another_gateway_stored_first_is_applied_again_and_never_lost() {
    let (a, b, record) = gateways();
    let (na, nb) = (at(1, 0), at(2, 1));
    run(&a, &na, &[0; 6], &[]);
    run(&b, &nb, &[0; 6], &[]);
    assert_eq!(pr_out(&b, &nb, 0, 0, 0, 0xbb).status, status::GOOD);
    // Gateway 1's register loses the race twice, then stores on the record as it is then.
    record.lose.store(2, Ordering::Release);
    assert_eq!(pr_out(&a, &na, 0, 0, 0, 0xaa).status, status::GOOD);
    assert_eq!(record.lose.load(Ordering::Acquire), 0);
    let mut k = keys(&b, &nb);
    k.sort_unstable();
    assert_eq!(k, [0xaa, 0xbb], "a registration was lost");
    // A record that keeps changing under it: BUSY, and nothing stored.
    record.lose.store(100, Ordering::Release);
    let o = pr_out(&a, &na, 0, 0, 0xaa, 0xcc);
    assert_eq!(o.status, status::BUSY, "{o:?}");
    record.lose.store(0, Ordering::Release);
    let mut k = keys(&b, &nb);
    k.sort_unstable();
    assert_eq!(k, [0xaa, 0xbb]);
}

#[test]
fn shared_reservations_persist_so_aptpl_is_taken_and_a_new_gateway_reads_them() {
    let (a, _b, record) = gateways();
    let na = at(1, 0);
    run(&a, &na, &[0; 6], &[]);
    let mut p = [0u8; 24];
    p[8..16].copy_from_slice(&0xaau64.to_be_bytes());
    p[20] = 1;
    let o = run(&a, &na, &[0x5f, 0, 0, 0, 0, 0, 0, 0, 24, 0], &p);
    assert_eq!(o.status, status::GOOD, "APTPL refused: {o:?}");
    // A gateway started later on the same record.
    let g = Gateway {
        id: 2,
        record: record.clone(),
        data: Arc::new(RamBackend::new(1 << 20).unwrap()),
    };
    let c = LogicalUnit::new(Arc::new(g), LuConfig::default());
    assert!(c.load_reservations().unwrap(), "nothing read");
    let nc = at(3, 2);
    run(&c, &nc, &[0; 6], &[]);
    assert_eq!(keys(&c, &nc), [0xaa]);
    // REPORT CAPABILITIES: PTPL_C and PTPL_A.
    let o = run(&c, &nc, &[0x5e, 2, 0, 0, 0, 0, 0, 0, 8, 0], &[]);
    assert_eq!((o.data_in[2] & 1, o.data_in[3] & 1), (1, 1), "{o:?}");
}
