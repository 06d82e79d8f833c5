//! Persistent reservations that persist through power loss (SPC-4 5.9.5): APTPL refused by a
//! unit that cannot keep it, and kept (written before GOOD, read back at open) by one that can.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use mcsi_scsi::backend::RamBackend;
use mcsi_scsi::{status, LogicalUnit, LuConfig};
use std::path::Path;
use std::sync::Arc;

const ILLEGAL_REQUEST: u8 = 0x5;

fn unit(pr_file: Option<&Path>) -> LogicalUnit {
    let cfg = LuConfig {
        pr_file: pr_file.map(Path::to_path_buf),
        ..LuConfig::default()
    };
    let lu = LogicalUnit::new(Arc::new(RamBackend::new(1 << 20).unwrap()), cfg);
    lu.load_reservations().unwrap();
    for i in 0..10 {
        seen(&lu, &nexus(i));
    }
    lu
}

/// The power-on unit attention taken by a TEST UNIT READY from `n`.
fn seen(lu: &LogicalUnit, n: &mcsi_scsi::Nexus) {
    run(lu, n, &[0; 6], &[]);
}

/// PERSISTENT RESERVE OUT: `sa` with `type`, reservation key, service action key, APTPL.
fn pr_out(lu: &LogicalUnit, i: u8, sa: u8, ty: u8, rk: u64, sark: u64, aptpl: bool) -> u8 {
    let mut p = [0u8; 24];
    p[0..8].copy_from_slice(&rk.to_be_bytes());
    p[8..16].copy_from_slice(&sark.to_be_bytes());
    p[20] = u8::from(aptpl);
    let cdb = [0x5f, sa, ty, 0, 0, 0, 0, 0, 24, 0];
    run(lu, &nexus(i), &cdb, &p).status
}

/// PERSISTENT RESERVE IN `sa`: its data.
fn pr_in(lu: &LogicalUnit, sa: u8) -> Vec<u8> {
    let o = run(lu, &nexus(9), &[0x5e, sa, 0, 0, 0, 0, 0, 0x10, 0, 0], &[]);
    assert_eq!(o.status, status::GOOD, "{o:?}");
    o.data_in.to_vec()
}

/// REPORT CAPABILITIES' PTPL_C and PTPL_A.
fn ptpl(lu: &LogicalUnit) -> (bool, bool) {
    let d = pr_in(lu, 2);
    (d[2] & 1 != 0, d[3] & 1 != 0)
}

/// READ KEYS: the keys, and READ RESERVATION: the holder's key and type.
fn keys_and_reservation(lu: &LogicalUnit) -> (Vec<u64>, Option<(u64, u8)>) {
    let k = pr_in(lu, 0);
    let n = u32::from_be_bytes(k[4..8].try_into().unwrap()) as usize / 8;
    let keys = (0..n)
        .map(|i| u64::from_be_bytes(k[8 + 8 * i..16 + 8 * i].try_into().unwrap()))
        .collect();
    let r = pr_in(lu, 1);
    let res = (u32::from_be_bytes(r[4..8].try_into().unwrap()) == 16).then(|| {
        (
            u64::from_be_bytes(r[8..16].try_into().unwrap()),
            r[21] & 0x0f,
        )
    });
    (keys, res)
}

#[test]
fn a_unit_that_cannot_persist_refuses_aptpl() {
    let lu = unit(None);
    assert_eq!(ptpl(&lu), (false, false));
    let o = {
        let mut p = [0u8; 24];
        p[8..16].copy_from_slice(&7u64.to_be_bytes());
        p[20] = 1;
        run(&lu, &nexus(1), &[0x5f, 0, 0, 0, 0, 0, 0, 0, 24, 0], &p)
    };
    let s = expect(&o, ILLEGAL_REQUEST, (0x26, 0x00));
    assert_eq!(keys_and_reservation(&lu), (vec![], None), "{s:?}");
    // Without APTPL it registers as before.
    assert_eq!(pr_out(&lu, 1, 0, 0, 0, 7, false), status::GOOD);
    assert_eq!(keys_and_reservation(&lu).0, vec![7]);
}

#[test]
fn aptpl_state_is_on_disk_when_good_comes_back_and_read_at_the_next_open() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pr").join("lu.json");
    let lu = unit(Some(&file));
    assert_eq!(ptpl(&lu), (true, false));
    // Two initiators register (one with APTPL), one holds WRITE EXCLUSIVE, REGISTRANTS ONLY.
    assert_eq!(pr_out(&lu, 1, 0, 0, 0, 0xaaaa, true), status::GOOD);
    assert!(file.exists(), "written before GOOD");
    assert_eq!(ptpl(&lu), (true, true));
    assert_eq!(pr_out(&lu, 2, 0, 0, 0, 0xbbbb, true), status::GOOD);
    assert_eq!(pr_out(&lu, 1, 1, 5, 0xaaaa, 0, false), status::GOOD);
    let before = keys_and_reservation(&lu);
    assert_eq!(before, (vec![0xaaaa, 0xbbbb], Some((0xaaaa, 5))));
    // The unit goes away without a word (power loss: no flush, no shutdown) and opens again.
    drop(lu);
    let lu = unit(Some(&file));
    assert_eq!(keys_and_reservation(&lu), before);
    assert_eq!(ptpl(&lu), (true, true));
    // Restored, it is enforced: an unregistered initiator's write conflicts, the holder's not.
    let write = [0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    let block = [0u8; 512];
    assert_eq!(
        run(&lu, &nexus(3), &write, &block).status,
        status::RESERVATION_CONFLICT
    );
    assert_eq!(run(&lu, &nexus(1), &write, &block).status, status::GOOD);
    // Initiator 2 preempts initiator 1; that is on disk too.
    assert_eq!(pr_out(&lu, 2, 4, 5, 0xbbbb, 0xaaaa, false), status::GOOD);
    drop(lu);
    let lu = unit(Some(&file));
    assert_eq!(keys_and_reservation(&lu), (vec![0xbbbb], Some((0xbbbb, 5))));
    // A REGISTER with APTPL = 0 ends persistence: the file goes, and with it the state at
    // the next open.
    assert_eq!(pr_out(&lu, 2, 0, 0, 0xbbbb, 0xcccc, false), status::GOOD);
    assert!(!file.exists());
    assert_eq!(ptpl(&lu), (true, false));
    drop(lu);
    let lu = unit(Some(&file));
    assert_eq!(keys_and_reservation(&lu), (vec![], None));
}

#[test]
fn a_damaged_file_stops_the_unit_from_opening_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lu.json");
    std::fs::write(&file, "{ not json").unwrap();
    let cfg = LuConfig {
        pr_file: Some(file.clone()),
        ..LuConfig::default()
    };
    let lu = LogicalUnit::new(Arc::new(RamBackend::new(1 << 20).unwrap()), cfg);
    let e = lu.load_reservations().unwrap_err().to_string();
    assert!(e.contains("persistent reservations"), "{e}");
    assert!(e.contains("move the file away"), "{e}");
}

#[test]
fn a_unit_that_cannot_write_its_file_keeps_its_state_and_fails_the_command() {
    let dir = tempfile::tempdir().unwrap();
    // The file's directory is a file: nothing can be written under it.
    let blocker = dir.path().join("pr");
    std::fs::write(&blocker, "").unwrap();
    let cfg = LuConfig {
        pr_file: Some(blocker.join("lu.json")),
        ..LuConfig::default()
    };
    let lu = LogicalUnit::new(Arc::new(RamBackend::new(1 << 20).unwrap()), cfg);
    seen(&lu, &nexus(1));
    seen(&lu, &nexus(9));
    let mut p = [0u8; 24];
    p[8..16].copy_from_slice(&5u64.to_be_bytes());
    p[20] = 1;
    let o = run(&lu, &nexus(1), &[0x5f, 0, 0, 0, 0, 0, 0, 0, 24, 0], &p);
    expect(&o, ILLEGAL_REQUEST, (0x55, 0x04));
    assert_eq!(keys_and_reservation(&lu), (vec![], None), "nothing changed");
}

#[test]
fn registrations_are_bounded() {
    let lu = unit(None);
    for i in 0..mcsi_scsi::MAX_REGISTRATIONS {
        let n = mcsi_scsi::Nexus {
            initiator_port: format!("iqn.2026-01.test:many,i,0x{i:012x}").into(),
            target_port: "iqn.2026-01.test:disk,t,0x0001".into(),
            relative_port: 1,
        };
        seen(&lu, &n);
        let mut p = [0u8; 24];
        p[8..16].copy_from_slice(&1u64.to_be_bytes());
        let o = run(&lu, &n, &[0x5f, 0, 0, 0, 0, 0, 0, 0, 24, 0], &p);
        assert_eq!(o.status, status::GOOD);
    }
    let mut p = [0u8; 24];
    p[8..16].copy_from_slice(&1u64.to_be_bytes());
    let o = run(&lu, &nexus(1), &[0x5f, 0, 0, 0, 0, 0, 0, 0, 24, 0], &p);
    expect(&o, ILLEGAL_REQUEST, (0x55, 0x04));
}

#[test]
fn an_unregistered_initiator_unregistering_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lu.json");
    let lu = unit(Some(&file));
    assert_eq!(pr_out(&lu, 1, 0, 0, 0, 0xaaaa, true), status::GOOD);
    let gen = |lu: &LogicalUnit| u32::from_be_bytes(pr_in(lu, 0)[0..4].try_into().unwrap());
    let g = gen(&lu);
    // A fencing idiom: REGISTER AND IGNORE EXISTING KEY with key 0, from a nexus that holds no
    // registration, APTPL clear. GOOD, and APTPL stays on, the file stays.
    assert_eq!(pr_out(&lu, 2, 6, 0, 0, 0, false), status::GOOD);
    assert_eq!(ptpl(&lu), (true, true));
    assert_eq!(gen(&lu), g);
    assert!(file.exists());
}

/// PERSISTENT RESERVE OUT with the parameter list's byte 20 as given.
fn pr_out_flags(lu: &LogicalUnit, i: u8, sa: u8, ty: u8, rk: u64, sark: u64, flags: u8) -> u8 {
    let mut p = [0u8; 24];
    p[0..8].copy_from_slice(&rk.to_be_bytes());
    p[8..16].copy_from_slice(&sark.to_be_bytes());
    p[20] = flags;
    run(lu, &nexus(i), &[0x5f, sa, ty, 0, 0, 0, 0, 0, 24, 0], &p).status
}

/// READ FULL STATUS: each registration's key and its ALL_TG_PT and R_HOLDER bits.
fn full_status(lu: &LogicalUnit) -> Vec<(u64, bool, bool)> {
    let d = pr_in(lu, 3);
    let len = u32::from_be_bytes(d[4..8].try_into().unwrap()) as usize;
    let mut out = Vec::new();
    let mut at = 8;
    while at < 8 + len {
        let key = u64::from_be_bytes(d[at..at + 8].try_into().unwrap());
        let bits = d[at + 12];
        out.push((key, bits & 0x02 != 0, bits & 0x01 != 0));
        let tid = u32::from_be_bytes(d[at + 20..at + 24].try_into().unwrap()) as usize;
        at += 24 + tid;
    }
    out
}

#[test]
fn all_target_ports_registrations_are_taken_reported_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lu.json");
    let lu = unit(Some(&file));
    assert_eq!(pr_in(&lu, 2)[2] & 0x04, 0x04, "ATP_C");
    // ALL_TG_PT with APTPL, and a plain registration beside it.
    assert_eq!(pr_out_flags(&lu, 1, 0, 0, 0, 0x11, 0x05), status::GOOD);
    assert_eq!(pr_out_flags(&lu, 2, 0, 0, 0, 0x22, 0x01), status::GOOD);
    // The bit means nothing to RESERVE: ignored, not refused.
    assert_eq!(pr_out_flags(&lu, 1, 1, 1, 0x11, 0, 0x04), status::GOOD);
    let want = vec![(0x11, true, true), (0x22, false, false)];
    assert_eq!(full_status(&lu), want);
    drop(lu);
    let lu = unit(Some(&file));
    assert_eq!(full_status(&lu), want, "kept through a restart");
    // Unregistered, the flag goes with the registration.
    assert_eq!(pr_out_flags(&lu, 1, 2, 1, 0x11, 0, 0x01), status::GOOD);
    assert_eq!(pr_out_flags(&lu, 1, 0, 0, 0x11, 0, 0x01), status::GOOD);
    assert_eq!(pr_out_flags(&lu, 1, 0, 0, 0, 0x33, 0x01), status::GOOD);
    assert_eq!(
        full_status(&lu),
        vec![(0x22, false, false), (0x33, false, false)]
    );
    // SPEC_I_PT without its list of TransportIDs is refused.
    assert_ne!(pr_out_flags(&lu, 3, 0, 0, 0, 0x44, 0x08), status::GOOD);
}

/// An iSCSI TransportID with an ISID (format 01b) naming `nexus(i)`'s initiator port.
fn transport_id(i: u8) -> Vec<u8> {
    // The ISID in upper case: hex digits compare without regard to case.
    let port = nexus(i).initiator_port.to_string();
    let (name, isid) = port.rsplit_once(",i,0x").unwrap();
    tid_of(&format!("{name},i,0x{}", isid.to_uppercase()))
}

/// The iSCSI TransportID (format 01b) of initiator port `port` ("name,i,0xISID").
fn tid_of(port: &str) -> Vec<u8> {
    let mut name = port.as_bytes().to_vec();
    name.push(0);
    name.resize(name.len().div_ceil(4).max(5) * 4, 0);
    let mut t = vec![0x45, 0];
    t.extend_from_slice(&(name.len() as u16).to_be_bytes());
    t.extend_from_slice(&name);
    t
}

#[test]
fn spec_i_pt_registers_the_listed_initiator_ports_with_the_same_key() {
    let lu = unit(None);
    assert_eq!(pr_in(&lu, 2)[2] & 0x08, 0x08, "SIP_C");
    let tids: Vec<u8> = [4u8, 5, 4].iter().flat_map(|i| transport_id(*i)).collect();
    let mut p = vec![0u8; 28];
    p[8..16].copy_from_slice(&0x77u64.to_be_bytes());
    p[20] = 0x08;
    p[24..28].copy_from_slice(&(tids.len() as u32).to_be_bytes());
    p.extend_from_slice(&tids);
    let cdb = |len: usize| {
        let mut c = vec![0x5f, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        c[5..9].copy_from_slice(&(len as u32).to_be_bytes());
        c
    };
    assert_eq!(run(&lu, &nexus(1), &cdb(p.len()), &p).status, status::GOOD);
    // Nexus 1 and the two listed (one listed twice) hold the key; nexus 4 reserves with it.
    assert_eq!(keys_and_reservation(&lu).0, vec![0x77, 0x77, 0x77]);
    assert_eq!(pr_out(&lu, 4, 1, 1, 0x77, 0, false), status::GOOD);
    assert_eq!(
        pr_out(&lu, 6, 1, 1, 0x77, 0, false),
        status::RESERVATION_CONFLICT
    );
    // A registered nexus cannot name others; a name-only TransportID (format 00b) that
    // carries an ISID is refused; a list whose length does not add up is refused.
    assert_eq!(
        run(&lu, &nexus(1), &cdb(p.len()), &p).status,
        status::CHECK_CONDITION
    );
    let mut bare = transport_id(7);
    bare[0] = 0x05;
    let mut q = p[..28].to_vec();
    q[24..28].copy_from_slice(&(bare.len() as u32).to_be_bytes());
    q.extend_from_slice(&bare);
    let o = run(&lu, &nexus(8), &cdb(q.len()), &q);
    expect(&o, 0x5, (0x26, 0x00));
    let mut short = p.clone();
    short[27] += 4;
    let o = run(&lu, &nexus(9), &cdb(short.len()), &short);
    expect(&o, 0x5, (0x1A, 0x00));
    assert_eq!(
        keys_and_reservation(&lu).0.len(),
        3,
        "nothing registered by the refusals"
    );
    // An unregistered nexus "unregistering" with a list: GOOD, and nothing changes.
    let mut zero = p.clone();
    zero[8..16].fill(0);
    assert_eq!(
        run(&lu, &nexus(9), &cdb(zero.len()), &zero).status,
        status::GOOD
    );
    assert_eq!(keys_and_reservation(&lu).0.len(), 3);
}

#[test]
fn spec_i_pt_refuses_a_list_longer_than_the_unit_holds_and_registers_nothing() {
    let lu = unit(None);
    // 1,100 distinct initiator ports: more than the 1,024 registrations a unit holds.
    let tids: Vec<u8> = (0..1100u32)
        .flat_map(|i| tid_of(&format!("iqn.2026-01.test:many,i,0x0000{i:08x}")))
        .collect();
    let mut p = vec![0u8; 28];
    p[8..16].copy_from_slice(&0x99u64.to_be_bytes());
    p[20] = 0x08;
    p[24..28].copy_from_slice(&(tids.len() as u32).to_be_bytes());
    p.extend_from_slice(&tids);
    let mut c = vec![0x5f, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    c[5..9].copy_from_slice(&(p.len() as u32).to_be_bytes());
    expect(&run(&lu, &nexus(1), &c, &p), 0x5, (0x55, 0x04));
    assert!(keys_and_reservation(&lu).0.is_empty(), "nothing registered");
}

/// REGISTER AND MOVE's parameter list: keys, UNREG and APTPL, relative target port 1, and
/// `nexus(dest)`'s TransportID.
fn move_params(rk: u64, sark: u64, unreg: bool, dest: u8) -> Vec<u8> {
    let tid = transport_id(dest);
    let mut p = vec![0u8; 24];
    p[0..8].copy_from_slice(&rk.to_be_bytes());
    p[8..16].copy_from_slice(&sark.to_be_bytes());
    p[17] = if unreg { 0x02 } else { 0 };
    p[18..20].copy_from_slice(&1u16.to_be_bytes());
    p[20..24].copy_from_slice(&(tid.len() as u32).to_be_bytes());
    p.extend_from_slice(&tid);
    p
}

fn register_and_move(lu: &LogicalUnit, i: u8, p: &[u8]) -> mcsi_scsi::Outcome {
    let mut c = vec![0x5f, 0x07, 0x01, 0, 0, 0, 0, 0, 0, 0];
    c[5..9].copy_from_slice(&(p.len() as u32).to_be_bytes());
    run(lu, &nexus(i), &c, p)
}

#[test]
fn register_and_move_hands_the_reservation_to_another_initiator_port() {
    let lu = unit(None);
    assert_eq!(pr_out(&lu, 1, 0, 0, 0, 0xA1, false), status::GOOD);
    assert_eq!(pr_out(&lu, 2, 0, 0, 0, 0xB2, false), status::GOOD);
    // Not the holder: conflict. Nothing reserved yet.
    let o = register_and_move(&lu, 1, &move_params(0xA1, 0xC3, false, 3));
    assert_eq!(o.status, status::RESERVATION_CONFLICT);
    assert_eq!(pr_out(&lu, 1, 1, 1, 0xA1, 0, false), status::GOOD);
    let o = register_and_move(&lu, 2, &move_params(0xB2, 0xC3, false, 3));
    assert_eq!(
        o.status,
        status::RESERVATION_CONFLICT,
        "only the holder moves it"
    );
    // To itself, with a zero key, or through another relative port: refused.
    expect(
        &register_and_move(&lu, 1, &move_params(0xA1, 0xC3, false, 1)),
        0x5,
        (0x26, 0x00),
    );
    expect(
        &register_and_move(&lu, 1, &move_params(0xA1, 0, false, 3)),
        0x5,
        (0x26, 0x00),
    );
    let mut other_port = move_params(0xA1, 0xC3, false, 3);
    other_port[19] = 2;
    expect(&register_and_move(&lu, 1, &other_port), 0x5, (0x26, 0x00));
    // Moved to nexus 3 (registered with 0xC3), nexus 1 staying registered.
    let o = register_and_move(&lu, 1, &move_params(0xA1, 0xC3, false, 3));
    assert_eq!(o.status, status::GOOD, "{o:?}");
    assert_eq!(
        keys_and_reservation(&lu),
        (vec![0xA1, 0xB2, 0xC3], Some((0xC3, 1)))
    );
    // Nexus 1 no longer holds it: its WRITE conflicts, nexus 3's goes through.
    let write = [0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    assert_eq!(
        run(&lu, &nexus(1), &write, &[0; 512]).status,
        status::RESERVATION_CONFLICT
    );
    assert_eq!(run(&lu, &nexus(3), &write, &[0; 512]).status, status::GOOD);
    // Moved on to nexus 2, already registered (its key replaced), with UNREG: nexus 3 goes.
    let o = register_and_move(&lu, 3, &move_params(0xC3, 0xD4, true, 2));
    assert_eq!(o.status, status::GOOD);
    assert_eq!(
        keys_and_reservation(&lu),
        (vec![0xA1, 0xD4], Some((0xD4, 1)))
    );
    // An all-registrants reservation has no one holder to move it.
    assert_eq!(pr_out(&lu, 2, 2, 1, 0xD4, 0, false), status::GOOD);
    assert_eq!(pr_out(&lu, 2, 1, 7, 0xD4, 0, false), status::GOOD);
    let o = register_and_move(&lu, 2, &move_params(0xD4, 0xE5, false, 5));
    assert_eq!(o.status, status::RESERVATION_CONFLICT);
}

/// The iSCSI TransportID (format 00b) of initiator device `name`: its name alone.
fn device_tid(name: &str) -> Vec<u8> {
    let mut t = tid_of(name);
    t[0] = 0x05;
    t
}

/// PERSISTENT RESERVE OUT through `n`, with the basic parameter list.
fn pr_out_at(lu: &LogicalUnit, n: &mcsi_scsi::Nexus, sa: u8, ty: u8, rk: u64, sark: u64) -> u8 {
    let mut p = [0u8; 24];
    p[0..8].copy_from_slice(&rk.to_be_bytes());
    p[8..16].copy_from_slice(&sark.to_be_bytes());
    run(lu, n, &[0x5f, sa, ty, 0, 0, 0, 0, 0, 24, 0], &p).status
}

#[test]
fn a_name_only_transport_id_registers_every_port_of_that_initiator() {
    let lu = unit(None);
    // Ports of one initiator device: one iSCSI name, an ISID each.
    let port = |isid: u8| mcsi_scsi::Nexus {
        initiator_port: Arc::from(format!("iqn.2026-01.test:node-a,i,0x00023d00000{isid}")),
        ..nexus(1)
    };
    let (p1, p2) = (port(1), port(2));
    seen(&lu, &p1);
    seen(&lu, &p2);
    // Nexus 1 registers itself and, with SPEC_I_PT, the device by its name (in upper case:
    // names compare normalized).
    let tids = device_tid("IQN.2026-01.TEST:NODE-A");
    let mut p = vec![0u8; 28];
    p[8..16].copy_from_slice(&0x99u64.to_be_bytes());
    p[20] = 0x08;
    p[24..28].copy_from_slice(&(tids.len() as u32).to_be_bytes());
    p.extend_from_slice(&tids);
    let len = (p.len() as u32).to_be_bytes();
    let cdb = [0x5f, 0, 0, 0, 0, len[0], len[1], len[2], len[3], 0];
    let o = run(&lu, &nexus(1), &cdb, &p);
    assert_eq!(o.status, status::GOOD, "{o:?}");
    assert_eq!(keys_and_reservation(&lu).0, vec![0x99, 0x99]);
    // READ FULL STATUS names the device with a format 00b TransportID.
    let d = pr_in(&lu, 3);
    let second = 8 + 24 + u32::from_be_bytes(d[28..32].try_into().unwrap()) as usize;
    let tid = &d[second + 24..];
    assert_eq!(tid[0], 0x05, "format 00b, iSCSI");
    let tlen = u16::from_be_bytes([tid[2], tid[3]]) as usize;
    assert!(tlen >= 20 && tlen.is_multiple_of(4), "{tlen}");
    assert!(tid[4..4 + tlen].starts_with(b"iqn.2026-01.test:node-a\0"));

    // One port of the device reserves with its key; every port of it holds the reservation,
    // one that logs in only now included; another initiator's write conflicts.
    assert_eq!(pr_out_at(&lu, &p2, 1, 1, 0x99, 0), status::GOOD);
    let p3 = port(3);
    seen(&lu, &p3);
    let write = |n: &mcsi_scsi::Nexus| run(&lu, n, &[0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[1; 512]);
    for n in [&p1, &p2, &p3] {
        assert_eq!(write(n).status, status::GOOD, "{n:?}");
    }
    assert_eq!(write(&nexus(2)).status, status::RESERVATION_CONFLICT);

    // Nexus 1 preempts the key: the device's registration goes, each of its ports hears it.
    assert_eq!(pr_out_at(&lu, &nexus(1), 4, 1, 0x99, 0x99), status::GOOD);
    assert_eq!(keys_and_reservation(&lu), (vec![0x99], Some((0x99, 1))));
    for n in [&p1, &p2, &p3] {
        expect(&write(n), 0x6, (0x2A, 0x05));
        assert_eq!(write(n).status, status::RESERVATION_CONFLICT, "{n:?}");
    }

    // A name that carries a port's separator is not a name.
    let mut q = p[..28].to_vec();
    let bad = device_tid("iqn.2026-01.test:node-b,x");
    q[24..28].copy_from_slice(&(bad.len() as u32).to_be_bytes());
    q.extend_from_slice(&bad);
    let len = (q.len() as u32).to_be_bytes();
    let cdb = [0x5f, 0, 0, 0, 0, len[0], len[1], len[2], len[3], 0];
    expect(
        &run(&lu, &nexus(5), &cdb, &q),
        ILLEGAL_REQUEST,
        (0x26, 0x00),
    );
}

#[test]
fn register_and_move_to_an_initiator_device_hands_it_to_every_port() {
    let lu = unit(None);
    let port = |isid: u8| mcsi_scsi::Nexus {
        initiator_port: Arc::from(format!("iqn.2026-01.test:node-b,i,0x00023d00000{isid}")),
        ..nexus(1)
    };
    let (p1, p2) = (port(1), port(2));
    seen(&lu, &p1);
    seen(&lu, &p2);
    assert_eq!(pr_out(&lu, 1, 0, 0, 0, 0x11, false), status::GOOD);
    assert_eq!(pr_out(&lu, 1, 1, 3, 0x11, 0, false), status::GOOD);
    // REGISTER AND MOVE to the device "iqn.2026-01.test:node-b", UNREG set.
    let tid = device_tid("iqn.2026-01.test:node-b");
    let mut p = vec![0u8; 24];
    p[0..8].copy_from_slice(&0x11u64.to_be_bytes());
    p[8..16].copy_from_slice(&0x22u64.to_be_bytes());
    p[17] = 0x02;
    p[18..20].copy_from_slice(&1u16.to_be_bytes());
    p[20..24].copy_from_slice(&(tid.len() as u32).to_be_bytes());
    p.extend_from_slice(&tid);
    let len = (p.len() as u32).to_be_bytes();
    let cdb = [0x5f, 7, 3, 0, 0, len[0], len[1], len[2], len[3], 0];
    let o = run(&lu, &nexus(1), &cdb, &p);
    assert_eq!(o.status, status::GOOD, "{o:?}");
    assert_eq!(keys_and_reservation(&lu), (vec![0x22], Some((0x22, 3))));
    // EXCLUSIVE ACCESS held by the device: both its ports read; nexus 1, unregistered, cannot.
    let read = |n: &mcsi_scsi::Nexus| run(&lu, n, &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[]);
    assert_eq!(read(&p1).status, status::GOOD);
    assert_eq!(read(&p2).status, status::GOOD);
    assert_eq!(read(&nexus(1)).status, status::RESERVATION_CONFLICT);
    // Either port releases it for the device.
    assert_eq!(pr_out_at(&lu, &p2, 2, 3, 0x22, 0), status::GOOD);
    assert_eq!(keys_and_reservation(&lu), (vec![0x22], None));
}

/// SPEC_I_PT from `from` with the TransportIDs `tids`, key `sark`: its outcome.
fn spec_i_pt(
    lu: &LogicalUnit,
    from: &mcsi_scsi::Nexus,
    sark: u64,
    tids: &[u8],
) -> mcsi_scsi::Outcome {
    let mut p = vec![0u8; 28];
    p[8..16].copy_from_slice(&sark.to_be_bytes());
    p[20] = 0x08;
    p[24..28].copy_from_slice(&(tids.len() as u32).to_be_bytes());
    p.extend_from_slice(tids);
    let len = (p.len() as u32).to_be_bytes();
    run(
        lu,
        from,
        &[0x5f, 0, 0, 0, 0, len[0], len[1], len[2], len[3], 0],
        &p,
    )
}

#[test]
fn a_port_is_registered_by_itself_or_through_its_device_never_both() {
    let lu = unit(None);
    let port = |isid: u8| mcsi_scsi::Nexus {
        initiator_port: Arc::from(format!("iqn.2026-01.test:node-c,i,0x00023d00000{isid}")),
        ..nexus(1)
    };
    let (p1, p2) = (port(1), port(2));
    seen(&lu, &p1);
    seen(&lu, &p2);
    // Port 1 registers by itself; a list naming its device is refused, nothing registered.
    assert_eq!(pr_out_at(&lu, &p1, 0, 0, 0, 0x10), status::GOOD);
    let o = spec_i_pt(&lu, &nexus(2), 0x20, &device_tid("iqn.2026-01.test:node-c"));
    let s = expect(&o, ILLEGAL_REQUEST, (0x26, 0x00));
    assert_eq!(s.sks, Some([0x80, 0, 28]), "{s:?}");
    // So is a list naming a port and its device.
    let both = [
        tid_of(&port(3).initiator_port),
        device_tid("iqn.2026-01.test:node-c"),
    ]
    .concat();
    expect(
        &spec_i_pt(&lu, &nexus(4), 0x30, &both),
        ILLEGAL_REQUEST,
        (0x26, 0x00),
    );
    assert_eq!(keys_and_reservation(&lu).0, vec![0x10]);
}

#[test]
fn a_release_through_one_port_of_a_device_tells_its_other_ports() {
    let lu = unit(None);
    let port = |isid: u8| mcsi_scsi::Nexus {
        initiator_port: Arc::from(format!("iqn.2026-01.test:node-d,i,0x00023d00000{isid}")),
        ..nexus(1)
    };
    let (p1, p2) = (port(1), port(2));
    seen(&lu, &p1);
    seen(&lu, &p2);
    let o = spec_i_pt(&lu, &nexus(5), 0x50, &device_tid("iqn.2026-01.test:node-d"));
    assert_eq!(o.status, status::GOOD, "{o:?}");
    // WRITE EXCLUSIVE, REGISTRANTS ONLY through port 1, released through port 1: port 2 and
    // nexus 5 hear RESERVATIONS RELEASED; port 1, which released it, does not.
    assert_eq!(pr_out_at(&lu, &p1, 1, 5, 0x50, 0), status::GOOD);
    assert_eq!(pr_out_at(&lu, &p1, 2, 5, 0x50, 0), status::GOOD);
    let tur = |n: &mcsi_scsi::Nexus| run(&lu, n, &[0; 6], &[]);
    expect(&tur(&p2), 0x6, (0x2A, 0x04));
    expect(&tur(&nexus(5)), 0x6, (0x2A, 0x04));
    assert_eq!(tur(&p1).status, status::GOOD);
    // Port 2 unregisters the device: the reservation it no longer has stays gone, and port 1
    // is unregistered with it.
    assert_eq!(pr_out_at(&lu, &p1, 1, 1, 0x50, 0), status::GOOD);
    assert_eq!(pr_out_at(&lu, &p2, 0, 0, 0x50, 0), status::GOOD);
    assert_eq!(keys_and_reservation(&lu), (vec![0x50], None));
    assert_eq!(
        pr_out_at(&lu, &p1, 1, 1, 0x50, 0),
        status::RESERVATION_CONFLICT
    );
}
