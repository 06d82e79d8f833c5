#![allow(dead_code)]
//! Helpers the device server's tests share: a nexus, one command on a unit, and its sense.

use bytes::Bytes;
use mcsi_scsi::{status, Command, LogicalUnit, Nexus, Outcome, Sense, TaskAttribute};
use std::sync::Arc;

pub fn nexus(i: u8) -> Nexus {
    Nexus {
        initiator_port: Arc::from(format!("iqn.2026-01.test:init{i},i,0x00023d000001")),
        target_port: Arc::from("iqn.2026-01.test:disk,t,0x0001"),
        relative_port: 1,
    }
}

pub fn run(lu: &LogicalUnit, n: &Nexus, cdb: &[u8], data: &[u8]) -> Outcome {
    let mut c = cdb.to_vec();
    c.resize(16.max(cdb.len()), 0);
    lu.execute(Command {
        nexus: n,
        cdb: &c,
        data_out: Bytes::copy_from_slice(data),
        data_in_limit: u32::MAX,
        attr: TaskAttribute::Simple,
        pace: None,
    })
}

pub fn sense_of(o: &Outcome) -> Sense {
    assert_eq!(
        o.status,
        status::CHECK_CONDITION,
        "expected CHECK CONDITION: {o:?}"
    );
    Sense::parse(o.sense.as_ref().unwrap()).unwrap()
}

pub fn expect(o: &Outcome, k: u8, code: (u8, u8)) -> Sense {
    let s = sense_of(o);
    assert_eq!((s.key, s.asc, s.ascq), (k, code.0, code.1), "{o:?}");
    s
}
