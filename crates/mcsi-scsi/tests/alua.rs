//! Asymmetric logical unit access (SPC-4 5.15): a unit with target port groups says so in
//! INQUIRY (TPGS), names its port's group in VPD 83h, reports the groups and their states, and
//! refuses media access through a port in standby or unavailable; a change of state reaches
//! every nexus as a unit attention.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use mcsi_scsi::alua::{AccessState, Alua, PortGroup};
use mcsi_scsi::backend::RamBackend;
use mcsi_scsi::sense::{asc, key};
use mcsi_scsi::{status, LogicalUnit, LuConfig, Nexus};
use std::sync::Arc;

/// A nexus through relative target port `port` (a gateway's portal group tag).
fn through(i: u8, port: u16) -> Nexus {
    Nexus {
        target_port: Arc::from(format!("iqn.2026-01.test:disk,t,0x{port:04x}")),
        relative_port: port,
        ..nexus(i)
    }
}

/// Gateway 1 in group 10, gateway 2 in group 20.
fn groups(g10: AccessState, g20: AccessState) -> Alua {
    Alua::new(vec![
        PortGroup {
            id: 10,
            state: g10,
            preferred: false,
            ports: vec![1],
        },
        PortGroup {
            id: 20,
            state: g20,
            preferred: false,
            ports: vec![2],
        },
    ])
    .unwrap()
}

fn unit() -> LogicalUnit {
    LogicalUnit::new(
        Arc::new(RamBackend::new(1 << 20).unwrap()),
        LuConfig::default(),
    )
}

/// The power-on unit attention taken.
fn seen(lu: &LogicalUnit, n: &Nexus) {
    expect(
        &run(lu, n, &[0; 6], &[]),
        key::UNIT_ATTENTION,
        asc::POWER_ON_RESET,
    );
}

fn rtpg(lu: &LogicalUnit, n: &Nexus) -> Vec<u8> {
    let o = run(lu, n, &[0xA3, 0x0A, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[]);
    assert_eq!(o.status, status::GOOD, "{o:?}");
    o.data_in.to_vec()
}

/// (group id, state code) of each descriptor.
fn states(d: &[u8]) -> Vec<(u16, u8)> {
    mcsi_scsi::alua::read_report(d)
        .iter()
        .map(|r| (r.id, r.state))
        .collect()
}

/// The target port group designator of VPD 83h (type 5, association target port), if any.
fn tpg_designator(lu: &LogicalUnit, n: &Nexus) -> Option<u16> {
    let o = run(lu, n, &[0x12, 0x01, 0x83, 0x01, 0x00, 0], &[]);
    assert_eq!(o.status, status::GOOD);
    let d = o.data_in;
    let mut i = 4;
    while i + 4 <= d.len() {
        let len = d[i + 3] as usize;
        if d[i + 1] & 0x3F == 0x15 {
            return Some(u16::from_be_bytes([d[i + 6], d[i + 7]]));
        }
        i += 4 + len;
    }
    None
}

fn tpgs(lu: &LogicalUnit, n: &Nexus) -> u8 {
    let o = run(lu, n, &[0x12, 0, 0, 0, 96, 0], &[]);
    (o.data_in[5] >> 4) & 0x03
}

#[test]
fn a_unit_without_groups_reports_no_alua() {
    let lu = unit();
    let n = through(1, 1);
    seen(&lu, &n);
    assert_eq!(tpgs(&lu, &n), 0);
    assert_eq!(tpg_designator(&lu, &n), None);
    let o = run(&lu, &n, &[0xA3, 0x0A, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[]);
    expect(&o, key::ILLEGAL_REQUEST, asc::INVALID_FIELD_IN_CDB);
}

#[test]
fn each_gateway_reports_every_group_and_its_own() {
    use AccessState::*;
    let lu = unit();
    lu.set_alua(Some(groups(ActiveOptimized, ActiveNonOptimized)));
    let (a, b) = (through(1, 1), through(2, 2));
    seen(&lu, &a);
    seen(&lu, &b);
    assert_eq!(tpgs(&lu, &a), 1, "implicit ALUA");
    assert_eq!(tpg_designator(&lu, &a), Some(10));
    assert_eq!(tpg_designator(&lu, &b), Some(20));
    for n in [&a, &b] {
        assert_eq!(states(&rtpg(&lu, n)), vec![(10, 0), (20, 1)]);
    }
    // REPORT SUPPORTED OPERATION CODES lists REPORT TARGET PORT GROUPS.
    let o = run(
        &lu,
        &a,
        &[0xA3, 0x0C, 0x02, 0xA3, 0, 0x0A, 0, 0, 1, 0, 0, 0],
        &[],
    );
    assert_eq!(o.status, status::GOOD, "{o:?}");
    assert_eq!(o.data_in[1] & 0x07, 0x03, "supported as the standard says");
    // Both active: both read and write.
    for n in [&a, &b] {
        assert_eq!(
            run(&lu, n, &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[]).status,
            0
        );
        let w = run(&lu, n, &[0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[0x55; 512]);
        assert_eq!(w.status, status::GOOD);
    }
}

#[test]
fn standby_and_unavailable_refuse_media_access_until_the_state_changes() {
    use AccessState::*;
    let lu = unit();
    lu.set_alua(Some(groups(ActiveOptimized, Standby)));
    let (a, b) = (through(1, 1), through(2, 2));
    seen(&lu, &a);
    seen(&lu, &b);
    let read = [0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    let write = [0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    expect(
        &run(&lu, &b, &read, &[]),
        key::NOT_READY,
        asc::TARGET_PORT_IN_STANDBY_STATE,
    );
    expect(
        &run(&lu, &b, &write, &[0x66; 512]),
        key::NOT_READY,
        asc::TARGET_PORT_IN_STANDBY_STATE,
    );
    expect(
        &run(&lu, &b, &[0; 6], &[]),
        key::NOT_READY,
        asc::TARGET_PORT_IN_STANDBY_STATE,
    );
    // Standby still answers INQUIRY, REPORT LUNS, MODE SENSE, PERSISTENT RESERVE IN and
    // REPORT TARGET PORT GROUPS.
    assert_eq!(states(&rtpg(&lu, &b)), vec![(10, 0), (20, 2)]);
    for cdb in [
        &[0x12u8, 0, 0, 0, 96, 0][..],
        &[0xA0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        &[0x1A, 0, 0x3F, 0, 0xFF, 0],
        &[0x5E, 0, 0, 0, 0, 0, 0, 0x10, 0, 0],
    ] {
        let o = run(&lu, &b, cdb, &[]);
        assert_eq!(o.status, status::GOOD, "{cdb:02x?}: {o:?}");
    }
    // The first gateway goes unavailable and the second takes over: a unit attention on each
    // nexus, then the new states.
    assert!(lu.set_alua(Some(groups(Unavailable, ActiveOptimized))));
    assert!(!lu.set_alua(Some(groups(Unavailable, ActiveOptimized))));
    for n in [&a, &b] {
        expect(
            &run(&lu, n, &read, &[]),
            key::UNIT_ATTENTION,
            asc::ASYMMETRIC_ACCESS_STATE_CHANGED,
        );
    }
    let d = rtpg(&lu, &a);
    assert_eq!(states(&d), vec![(10, 3), (20, 0)]);
    assert_eq!(
        (d[4 + 5], d[16 + 5]),
        (0x02, 0x02),
        "status: altered implicitly"
    );
    assert_eq!(run(&lu, &b, &write, &[0x77; 512]).status, status::GOOD);
    expect(
        &run(&lu, &a, &read, &[]),
        key::NOT_READY,
        asc::TARGET_PORT_IN_UNAVAILABLE_STATE,
    );
    // Unavailable refuses even MODE SENSE and PERSISTENT RESERVE IN; it still identifies.
    expect(
        &run(&lu, &a, &[0x1A, 0, 0x3F, 0, 0xFF, 0], &[]),
        key::NOT_READY,
        asc::TARGET_PORT_IN_UNAVAILABLE_STATE,
    );
    assert_eq!(
        run(&lu, &a, &[0x12, 0, 0, 0, 96, 0], &[]).status,
        status::GOOD
    );
    // Back to no ALUA: every command again, after the unit attention.
    assert!(lu.set_alua(None));
    expect(
        &run(&lu, &a, &read, &[]),
        key::UNIT_ATTENTION,
        asc::ASYMMETRIC_ACCESS_STATE_CHANGED,
    );
    assert_eq!(run(&lu, &a, &read, &[]).status, status::GOOD);
    assert_eq!(tpgs(&lu, &a), 0);
}
