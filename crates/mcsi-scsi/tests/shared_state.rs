//! State shared by the gateways of one stored image (`Backend::shared_reservations` and
//! `Backend::shared_port_groups`, an RBD image's records in production): two units over one
//! store, each with its own target port, play two gateways.
//!
//! Persistent reservations: a registration and a reservation made through one bind the other;
//! a preemption through the other reaches the first's initiator as a unit attention; a change
//! another gateway stored first is applied again on the new record, never over it.
//!
//! Port group states (explicit ALUA): SET TARGET PORT GROUPS through one gateway changes what
//! both serve, each other nexus hears ASYMMETRIC ACCESS STATE CHANGED, a gateway started later
//! serves the stored states over its configured ones, and a reload's changed state is stored.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use mcsi_scsi::alua::{AccessState, Alua, PortGroup};
use mcsi_scsi::backend::RamBackend;
use mcsi_scsi::sense::{asc, key};
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

/// One gateway's view of a record.
struct Share {
    id: usize,
    record: Arc<Record>,
}

/// One gateway: its views of the two records, and its storage (the image: shared too).
struct Gateway {
    id: usize,
    pr: Share,
    alua: Share,
    data: Arc<RamBackend>,
}

impl SharedState for Share {
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
        Some(&self.pr)
    }
    fn shared_port_groups(&self) -> Option<&dyn SharedState> {
        Some(&self.alua)
    }
}

/// Gateway `id`'s unit over the image `data` and the records.
fn gateway(id: usize, pr: &Arc<Record>, alua: &Arc<Record>, data: &Arc<RamBackend>) -> LogicalUnit {
    let g = Gateway {
        id,
        pr: Share {
            id,
            record: pr.clone(),
        },
        alua: Share {
            id,
            record: alua.clone(),
        },
        data: data.clone(),
    };
    let lu = LogicalUnit::new(Arc::new(g), LuConfig::default());
    lu.load_reservations().unwrap();
    lu
}

/// Two gateways' units over one image and one record of reservations.
fn gateways() -> (LogicalUnit, LogicalUnit, Arc<Record>) {
    let (pr, alua) = (Arc::new(Record::default()), Arc::new(Record::default()));
    let data = Arc::new(RamBackend::new(1 << 20).unwrap());
    (
        gateway(0, &pr, &alua, &data),
        gateway(1, &pr, &alua, &data),
        pr,
    )
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
        pr: Share {
            id: 2,
            record: record.clone(),
        },
        alua: Share {
            id: 2,
            record: Arc::new(Record::default()),
        },
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

// ---- port group states ----------------------------------------------------------------------

/// Gateway 1 (port 1) in group 10, gateway 2 (port 2) in group 20, as configured.
fn groups(g10: AccessState, g20: AccessState) -> Alua {
    let g = |id, state, port| PortGroup {
        id,
        state,
        preferred: false,
        ports: vec![port],
    };
    Alua::new(vec![g(10, g10, 1), g(20, g20, 2)]).unwrap()
}

/// Two gateways with groups 10 (active/optimized) and 20 (active/non-optimized) configured,
/// over one image, with the port group record.
fn alua_gateways() -> (
    LogicalUnit,
    LogicalUnit,
    Arc<Record>,
    Arc<Record>,
    Arc<RamBackend>,
) {
    let (pr, alua) = (Arc::new(Record::default()), Arc::new(Record::default()));
    let data = Arc::new(RamBackend::new(1 << 20).unwrap());
    let (a, b) = (gateway(0, &pr, &alua, &data), gateway(1, &pr, &alua, &data));
    for lu in [&a, &b] {
        lu.set_alua(Some(groups(
            AccessState::ActiveOptimized,
            AccessState::ActiveNonOptimized,
        )));
    }
    (a, b, pr, alua, data)
}

/// (group id, state code, status code) of each REPORT TARGET PORT GROUPS descriptor.
fn rtpg(lu: &LogicalUnit, n: &Nexus) -> Vec<(u16, u8, u8)> {
    let o = run(lu, n, &[0xA3, 0x0A, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[]);
    assert_eq!(o.status, status::GOOD, "{o:?}");
    mcsi_scsi::alua::read_report(&o.data_in)
        .iter()
        .map(|r| (r.id, r.state, r.status))
        .collect()
}

/// SET TARGET PORT GROUPS with one descriptor per (group, state code).
fn stpg(lu: &LogicalUnit, n: &Nexus, set: &[(u16, u8)]) -> mcsi_scsi::Outcome {
    let p = mcsi_scsi::alua::set_parameters(set);
    let len = (p.len() as u32).to_be_bytes();
    let cdb = [0xA4, 0x0A, 0, 0, 0, 0, len[0], len[1], len[2], len[3], 0, 0];
    run(lu, n, &cdb, &p)
}

#[test]
fn set_target_port_groups_through_one_gateway_changes_what_both_serve() {
    let (a, b, _pr, alua, _data) = alua_gateways();
    let (na, na2, nb) = (at(1, 0), at(3, 0), at(2, 1));
    run(&a, &na, &[0; 6], &[]);
    run(&a, &na2, &[0; 6], &[]);
    run(&b, &nb, &[0; 6], &[]);
    // Explicit and implicit ALUA (TPGS 11b), and SET TARGET PORT GROUPS listed as supported.
    let inq = run(&a, &na, &[0x12, 0, 0, 0, 96, 0], &[]);
    assert_eq!((inq.data_in[5] >> 4) & 0x03, 0x03, "TPGS");
    let o = run(
        &a,
        &na,
        &[0xA3, 0x0C, 0x02, 0xA4, 0, 0x0A, 0, 0, 1, 0, 0, 0],
        &[],
    );
    assert_eq!(
        o.data_in[1] & 0x07,
        0x03,
        "SET TARGET PORT GROUPS not listed: {o:?}"
    );
    assert_eq!(rtpg(&b, &nb), vec![(10, 0, 0), (20, 1, 0)]);

    // Initiator 1 through gateway 1 fails over: group 10 unavailable, 20 active/optimized.
    let o = stpg(&a, &na, &[(10, 3), (20, 0)]);
    assert_eq!(o.status, status::GOOD, "{o:?}");
    assert!(alua.announced.load(Ordering::Acquire) >= 1, "not announced");
    // The nexus that set it has no unit attention; every other does, on either gateway.
    assert_eq!(rtpg(&a, &na), vec![(10, 3, 1), (20, 0, 1)]);
    for (lu, n) in [(&a, &na2), (&b, &nb)] {
        expect(
            &run(lu, n, &[0; 6], &[]),
            key::UNIT_ATTENTION,
            asc::ASYMMETRIC_ACCESS_STATE_CHANGED,
        );
        assert_eq!(rtpg(lu, n), vec![(10, 3, 1), (20, 0, 1)]);
    }
    // Gateway 1 is unavailable now: it refuses media access; gateway 2 serves.
    expect(
        &read(&a, &na),
        key::NOT_READY,
        asc::TARGET_PORT_IN_UNAVAILABLE_STATE,
    );
    assert_eq!(write(&b, &nb).status, status::GOOD);
    // And back, through the unavailable gateway (SET TARGET PORT GROUPS is allowed there).
    assert_eq!(stpg(&a, &na, &[(10, 0), (20, 1)]).status, status::GOOD);
    expect(
        &run(&b, &nb, &[0; 6], &[]),
        key::UNIT_ATTENTION,
        asc::ASYMMETRIC_ACCESS_STATE_CHANGED,
    );
    assert_eq!(read(&a, &na).status, status::GOOD);
    assert_eq!(rtpg(&b, &nb), vec![(10, 0, 1), (20, 1, 1)]);
}

#[test]
fn set_target_port_groups_is_all_or_nothing_and_checked_before_it_stores() {
    let (a, b, _pr, alua, _data) = alua_gateways();
    let (na, nb) = (at(1, 0), at(2, 1));
    run(&a, &na, &[0; 6], &[]);
    run(&b, &nb, &[0; 6], &[]);
    // A group the unit does not have, a state it does not support (transitioning, 0Fh): the
    // whole list refused, pointing at the field, nothing stored.
    let o = stpg(&a, &na, &[(20, 0), (99, 2)]);
    let s = expect(
        &o,
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_PARAMETER_LIST,
    );
    assert_eq!(s.sks, Some([0x80, 0, 10]), "{s:?}");
    let o = stpg(&a, &na, &[(10, 0x0F)]);
    expect(
        &o,
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_PARAMETER_LIST,
    );
    // A group named twice.
    let o = stpg(&a, &na, &[(10, 0), (10, 3)]);
    let s = expect(
        &o,
        key::ILLEGAL_REQUEST,
        asc::INVALID_FIELD_IN_PARAMETER_LIST,
    );
    assert_eq!(s.sks, Some([0x80, 0, 10]), "{s:?}");
    assert_eq!(alua.stored.lock().unwrap().0, Vec::<u8>::new(), "stored");
    assert_eq!(rtpg(&b, &nb), vec![(10, 0, 0), (20, 1, 0)]);
    // A parameter list cut inside a descriptor, or longer than the data sent.
    let o = run(
        &a,
        &na,
        &[0xA4, 0x0A, 0, 0, 0, 0, 0, 0, 0, 6, 0, 0],
        &[0; 6],
    );
    expect(&o, key::ILLEGAL_REQUEST, asc::PARAMETER_LIST_LENGTH_ERROR);
    let o = run(
        &a,
        &na,
        &[0xA4, 0x0A, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0],
        &[0; 4],
    );
    expect(&o, key::ILLEGAL_REQUEST, asc::PARAMETER_LIST_LENGTH_ERROR);
    // A record that keeps changing under it: an error, and nothing served.
    alua.lose.store(100, Ordering::Release);
    let o = stpg(&a, &na, &[(10, 2)]);
    assert_eq!(o.status, status::CHECK_CONDITION, "{o:?}");
    alua.lose.store(0, Ordering::Release);
    assert_eq!(rtpg(&a, &na), vec![(10, 0, 0), (20, 1, 0)]);
}

#[test]
fn a_gateway_started_later_serves_the_stored_states_and_a_reload_stores_its_change() {
    let (a, b, pr, alua, data) = alua_gateways();
    let (na, nb) = (at(1, 0), at(2, 1));
    run(&a, &na, &[0; 6], &[]);
    run(&b, &nb, &[0; 6], &[]);
    assert_eq!(stpg(&a, &na, &[(10, 2), (20, 0)]).status, status::GOOD);
    // A third gateway starts with the configured states (10 optimized): it serves the stored.
    let c = gateway(2, &pr, &alua, &data);
    c.set_alua(Some(groups(
        AccessState::ActiveOptimized,
        AccessState::ActiveNonOptimized,
    )));
    let nc = at(4, 0);
    run(&c, &nc, &[0; 6], &[]);
    assert_eq!(rtpg(&c, &nc), vec![(10, 2, 1), (20, 0, 1)]);
    // Gateway 2 reloads a configuration in which group 20 is standby: stored, and gateway 1
    // serves it (group 10 as SET TARGET PORT GROUPS left it).
    assert!(b.set_alua(Some(groups(
        AccessState::ActiveOptimized,
        AccessState::Standby
    ))));
    expect(
        &run(&a, &na, &[0; 6], &[]),
        key::UNIT_ATTENTION,
        asc::ASYMMETRIC_ACCESS_STATE_CHANGED,
    );
    assert_eq!(rtpg(&a, &na), vec![(10, 2, 1), (20, 2, 2)]);
    // Where the states are not shared, SET TARGET PORT GROUPS is not offered.
    let lone = LogicalUnit::new(data.clone(), LuConfig::default());
    lone.set_alua(Some(groups(
        AccessState::ActiveOptimized,
        AccessState::ActiveNonOptimized,
    )));
    let nl = at(5, 0);
    run(&lone, &nl, &[0; 6], &[]);
    let inq = run(&lone, &nl, &[0x12, 0, 0, 0, 96, 0], &[]);
    assert_eq!((inq.data_in[5] >> 4) & 0x03, 0x01, "TPGS");
    expect(
        &stpg(&lone, &nl, &[(10, 2)]),
        key::ILLEGAL_REQUEST,
        asc::INVALID_COMMAND_OPERATION_CODE,
    );
}
