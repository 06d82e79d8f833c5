#![allow(clippy::unwrap_used, clippy::expect_used)]
//! EXTENDED COPY through the target, end to end over a raw-PDU client: a copy is counted
//! under its session's bandwidth toward storage, and ABORT TASK or LOGICAL UNIT RESET ends a
//! running copy at its next chunk (8 MiB), before it writes the rest.

mod common;

use bytes::Bytes;
use common::*;
use mcsi_proto::pdu::*;
use std::time::{Duration, Instant};

/// A target with one 64 MiB RAM LUN whose reads and writes each take `service_time`, and a
/// bandwidth toward storage of `to_storage` bytes per second when given.
async fn target(service_time: Duration, to_storage: Option<u64>) -> mcsi_target::Server {
    start_with(|c| {
        let mut lun = mcsi_target::config::LunSpec::new("ram:64MiB");
        lun.service_time = service_time;
        c.targets[0].luns = vec![lun];
        c.targets[0].limits.qos = to_storage.map(|r| mcsi_target::config::QosSpec::Rates {
            to_client: None,
            to_storage: Some(r),
            burst: None,
        });
    })
    .await
}

/// The LUN's NAA designator, from VPD page 83h.
async fn naa(c: &mut Client) -> Vec<u8> {
    let cmd = c.command(
        &[0x12, 1, 0x83, 0, 255, 0],
        true,
        false,
        255,
        Bytes::new(),
        true,
    );
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (page, st, ..) = c.read_result(itt).await;
    assert_eq!(st, 0);
    let mut at = 4;
    while at + 4 <= page.len() {
        let (kind, len) = (page[at + 1], usize::from(page[at + 3]));
        // Association 0 (the logical unit), type 3 (NAA).
        if kind & 0x3f == 0x03 {
            return page[at..at + 4 + len].to_vec();
        }
        at += 4 + len;
    }
    panic!("no NAA designator in {page:?}");
}

/// An EXTENDED COPY (LID1) parameter list: `blocks` of 512 bytes from LBA `src` to LBA `dst`
/// of the unit that `designator` names.
fn copy_params(designator: &[u8], blocks: u16, src: u64, dst: u64) -> Vec<u8> {
    let mut cscd = vec![0u8; 32];
    cscd[0] = 0xE4;
    cscd[4..4 + designator.len()].copy_from_slice(designator);
    cscd[29..32].copy_from_slice(&[0, 2, 0]);
    let mut seg = vec![0u8; 28];
    seg[0] = 0x02;
    seg[2..4].copy_from_slice(&0x18u16.to_be_bytes());
    seg[10..12].copy_from_slice(&blocks.to_be_bytes());
    seg[12..20].copy_from_slice(&src.to_be_bytes());
    seg[20..28].copy_from_slice(&dst.to_be_bytes());
    let mut p = vec![0u8; 16];
    p[1] = 3 << 3; // LIST ID USAGE 11b: no list identifier held
    p[2..4].copy_from_slice(&32u16.to_be_bytes());
    p[8..12].copy_from_slice(&28u32.to_be_bytes());
    p.extend_from_slice(&cscd);
    p.extend_from_slice(&seg);
    p
}

/// Sends an EXTENDED COPY with its parameter list as immediate data; returns its ITT and CmdSN.
async fn send_copy(c: &mut Client, params: Vec<u8>) -> (u32, u32) {
    let mut cdb = vec![0x83, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    cdb.extend_from_slice(&(params.len() as u32).to_be_bytes());
    let n = params.len() as u32;
    let cmd = c.command(&cdb, false, true, n, Bytes::from(params), true);
    let (itt, sn) = (cmd.itt, cmd.cmd_sn);
    c.send(Pdu::ScsiCommand(cmd)).await;
    (itt, sn)
}

fn read16(lba: u64, blocks: u32) -> Vec<u8> {
    let mut cdb = vec![0x88, 0];
    cdb.extend_from_slice(&lba.to_be_bytes());
    cdb.extend_from_slice(&blocks.to_be_bytes());
    cdb.extend_from_slice(&[0, 0]);
    cdb
}

fn write16(lba: u64, blocks: u32) -> Vec<u8> {
    let mut cdb = vec![0x8A, 0];
    cdb.extend_from_slice(&lba.to_be_bytes());
    cdb.extend_from_slice(&blocks.to_be_bytes());
    cdb.extend_from_slice(&[0, 0]);
    cdb
}

async fn read(c: &mut Client, lba: u64, blocks: u32) -> Vec<u8> {
    let cmd = c.command(
        &read16(lba, blocks),
        true,
        false,
        blocks * 512,
        Bytes::new(),
        true,
    );
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (data, st, ..) = c.read_result(itt).await;
    assert_eq!(st, 0);
    data
}

const KEYS: [(&str, &str); 3] = [
    ("ImmediateData", "Yes"),
    ("InitialR2T", "No"),
    ("FirstBurstLength", "65536"),
];

/// A copy of 12 MiB moves nothing over the network, but with a bandwidth toward storage of
/// 4 MiB/s it is charged as if written: its second chunk waits for the first's 8 MiB, about
/// 2 s (unpaced, a RAM copy of 12 MiB takes milliseconds), and the data arrive whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_is_counted_under_the_sessions_bandwidth_toward_storage() {
    let mut took = Vec::new();
    for rate in [None, Some(4u64 << 20)] {
        let server = target(Duration::ZERO, rate).await;
        let mut c = Client::normal(&server, &KEYS).await;
        let mark = pattern(512, 9);
        let cmd = c.command(&write16(24575, 1), false, true, 512, mark.clone(), true);
        let itt = cmd.itt;
        c.send(Pdu::ScsiCommand(cmd)).await;
        assert_eq!(c.read_result(itt).await.1, 0);
        let d = naa(&mut c).await;
        let t0 = Instant::now();
        let (itt, _) = send_copy(&mut c, copy_params(&d, 24576, 0, 65536)).await;
        let (_, st, ..) = c.read_result(itt).await;
        took.push(t0.elapsed());
        assert_eq!(st, 0);
        assert_eq!(read(&mut c, 65536 + 24575, 1).await, mark.to_vec());
    }
    println!(
        "a 12 MiB copy: {:?} unpaced, {:?} at 4 MiB/s",
        took[0], took[1]
    );
    assert!(
        took[1] >= Duration::from_millis(1500),
        "at 4 MiB/s a copy of 12 MiB took {:?}: it was not paced",
        took[1]
    );
    assert!(took[0] < took[1] / 2, "{took:?}");
}

/// A copy of 24 MiB (three chunks of 8 MiB, each a 150 ms read and a 150 ms write) is ended
/// 200 ms in, by ABORT TASK and, in a second round, by LOGICAL UNIT RESET: the function
/// completes at the next chunk, the aborted copy sends no status, and the last chunk is never
/// written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_task_and_lun_reset_end_a_running_copy_at_its_next_chunk() {
    for (name, function) in [("ABORT TASK", 1u8), ("LOGICAL UNIT RESET", 5)] {
        let server = target(Duration::from_millis(150), None).await;
        let mut c = Client::normal(&server, &KEYS).await;
        // A mark in the source's last chunk (16-24 MiB).
        let mark = pattern(512, 5);
        let cmd = c.command(&write16(40000, 1), false, true, 512, mark, true);
        let itt = cmd.itt;
        c.send(Pdu::ScsiCommand(cmd)).await;
        assert_eq!(c.read_result(itt).await.1, 0);
        let d = naa(&mut c).await;
        let t0 = Instant::now();
        let (itt, sn) = send_copy(&mut c, copy_params(&d, 49152, 0, 65536)).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        c.send(Pdu::TaskMgmtRequest(TaskMgmtRequest {
            immediate: true,
            function,
            lun: 0,
            itt: 900,
            referenced_task_tag: if function == 1 { itt } else { 0xffff_ffff },
            cmd_sn: c.cmd_sn,
            exp_stat_sn: 0,
            ref_cmd_sn: sn,
            exp_data_sn: 0,
        }))
        .await;
        // The copy's own answer, if any, comes before the function's (a LUN reset's tasks end
        // with CHECK CONDITION or nothing; an aborted task sends nothing).
        let r = loop {
            match c.recv().await {
                Pdu::TaskMgmtResponse(r) => break r,
                Pdu::ScsiResponse(s) if s.itt == itt => {
                    assert!(function != 1, "{name}: the aborted copy sent its status");
                    assert_ne!(s.status, 0, "{name}: the copy ran to its end");
                }
                other => panic!("{name}: unexpected {other:?}"),
            }
        };
        let ended = t0.elapsed();
        println!(
            "{name}: the function completed {ended:?} after the copy began (about 900 ms whole)"
        );
        assert_eq!((r.itt, r.response), (900, 0), "{name}");
        assert!(ended < Duration::from_millis(800), "{name}: {ended:?}");
        if function == 5 {
            // The reset's unit attention first.
            let cmd = c.command(&[0; 6], false, false, 0, Bytes::new(), true);
            let itt = cmd.itt;
            c.send(Pdu::ScsiCommand(cmd)).await;
            c.read_result(itt).await;
        }
        let last = read(&mut c, 65536 + 40000, 1).await;
        assert!(
            last.iter().all(|&b| b == 0),
            "{name}: the last chunk was written"
        );
    }
}
