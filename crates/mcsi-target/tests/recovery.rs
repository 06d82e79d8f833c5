#![allow(clippy::unwrap_used, clippy::expect_used)]
//! ErrorRecoveryLevel 1 on the wire (RFC 7143 7.1, 11.16): what is negotiated, and SNACKs
//! answered from what each connection kept of what it sent.

mod common;

use bytes::Bytes;
use common::*;
use mcsi_proto::pdu::*;

fn snack(t: u8, itt: u32, beg_run: u32, run_length: u32, exp_stat_sn: u32) -> Pdu {
    Pdu::SnackRequest(SnackRequest {
        snack_type: t,
        lun: 0,
        itt,
        ttt: RESERVED_TAG,
        exp_stat_sn,
        beg_run,
        run_length,
    })
}

fn nop(c: &mut Client, exp_stat_sn: u32) -> Pdu {
    Pdu::NopOut(NopOut {
        immediate: true,
        lun: 0,
        itt: c.next_itt(),
        ttt: RESERVED_TAG,
        cmd_sn: c.cmd_sn,
        exp_stat_sn,
        data: Bytes::new(),
    })
}

fn key<'a>(c: &'a Client, k: &str) -> Option<&'a str> {
    c.login_keys
        .iter()
        .rev()
        .find(|(n, _)| n == k)
        .map(|(_, v)| v.as_str())
}

#[tokio::test]
async fn the_level_agreed_is_the_lower_of_the_offer_and_the_targets_cap() {
    let default = start(|_| {}).await;
    let c = Client::normal(&default, &[("ErrorRecoveryLevel", "2")]).await;
    assert_eq!(key(&c, "ErrorRecoveryLevel"), Some("2"));
    let capped = start(|l| l.offer.max_erl = 1).await;
    let c = Client::normal(&capped, &[("ErrorRecoveryLevel", "2")]).await;
    assert_eq!(key(&c, "ErrorRecoveryLevel"), Some("1"));
    let c = Client::normal(&default, &[("ErrorRecoveryLevel", "0")]).await;
    assert_eq!(key(&c, "ErrorRecoveryLevel"), Some("0"));
    let capped = start(|l| l.offer.max_erl = 0).await;
    let c = Client::normal(&capped, &[("ErrorRecoveryLevel", "2")]).await;
    assert_eq!(key(&c, "ErrorRecoveryLevel"), Some("0"));
}

#[tokio::test]
async fn data_and_status_snacks_get_the_same_pdus_again_until_acknowledged() {
    let server = start(|l| l.offer.max_erl = 1).await;
    let mut c = Client::normal(
        &server,
        &[
            ("ErrorRecoveryLevel", "1"),
            ("MaxRecvDataSegmentLength", "8192"),
            ("DataDigest", "CRC32C"),
        ],
    )
    .await;
    assert_eq!(key(&c, "DataDigest"), Some("CRC32C"));
    assert!(c.framing.data_digest);
    // 24 KiB of a pattern, then read back in three Data-In.
    let data = pattern(24576, 7);
    let w = c.command(&rw10(0x2a, 0, 48), false, true, 24576, data.clone(), true);
    let mut w = w;
    w.data = data.slice(..8192);
    c.send(Pdu::ScsiCommand(w.clone())).await;
    // InitialR2T=Yes: the rest is asked for, and the R2T can be asked for again.
    let r2t = c.recv().await;
    let Pdu::R2t(r) = &r2t else {
        panic!("no R2T: {r2t:?}")
    };
    assert_eq!(
        (r.r2t_sn, r.buffer_offset, r.desired_data_transfer_length),
        (0, 8192, 16384)
    );
    c.send(snack(0, w.itt, 0, 1, 0)).await;
    assert_eq!(c.recv().await, r2t);
    for (sn, off) in [(0u32, 8192u32), (1, 16384)] {
        c.send(Pdu::DataOut(DataOut {
            final_: off == 16384,
            lun: 0,
            itt: w.itt,
            ttt: r.ttt,
            exp_stat_sn: 0,
            data_sn: sn,
            buffer_offset: off,
            data: data.slice(off as usize..off as usize + 8192),
        }))
        .await;
    }
    let r = match c.recv().await {
        Pdu::ScsiResponse(r) => r,
        p => panic!("no response to the write: {p:?}"),
    };
    assert_eq!(r.status, 0);
    let write_stat_sn = r.stat_sn;

    let read = c.command(&rw10(0x28, 0, 48), true, false, 24576, Bytes::new(), true);
    let itt = read.itt;
    c.send(Pdu::ScsiCommand(read)).await;
    let mut first = Vec::new();
    loop {
        let p = c.recv().await;
        let Pdu::DataIn(d) = &p else {
            panic!("unexpected {p:?}")
        };
        let last = d.status.is_some();
        first.push(p);
        if last {
            break;
        }
    }
    assert_eq!(first.len(), 3);
    let Pdu::DataIn(last) = &first[2] else {
        unreachable!()
    };
    let read_stat_sn = last.stat_sn;
    assert_eq!(read_stat_sn, write_stat_sn + 1);

    // DataSN 1 again: the same PDU.
    c.send(snack(0, itt, 1, 1, write_stat_sn)).await;
    assert_eq!(c.recv().await, first[1]);
    // All from DataSN 1 (RunLength 0): the status comes again with its StatSN.
    c.send(snack(0, itt, 1, 0, write_stat_sn)).await;
    assert_eq!(c.recv().await, first[1]);
    assert_eq!(c.recv().await, first[2]);
    // The write's status again (Status SNACK), same StatSN.
    c.send(snack(1, RESERVED_TAG, write_stat_sn, 1, write_stat_sn))
        .await;
    let Pdu::ScsiResponse(again) = c.recv().await else {
        panic!("no status again")
    };
    assert_eq!((again.itt, again.stat_sn), (w.itt, write_stat_sn));

    // A DataSN never sent: a protocol error.
    c.send(snack(0, itt, 3, 1, write_stat_sn)).await;
    let Pdu::Reject(rj) = c.recv().await else {
        panic!("not rejected")
    };
    assert_eq!(rj.reason, reject_reason::PROTOCOL_ERROR);

    // Acknowledged (ExpStatSN past the read's status), nothing of either is kept.
    let n = nop(&mut c, read_stat_sn + 2);
    c.send(n).await;
    let Pdu::NopIn(_) = c.recv().await else {
        panic!("no NOP-In")
    };
    c.send(snack(0, itt, 0, 0, read_stat_sn + 2)).await;
    let Pdu::Reject(rj) = c.recv().await else {
        panic!("not rejected")
    };
    assert_eq!(rj.reason, reject_reason::PROTOCOL_ERROR);
    c.send(snack(1, RESERVED_TAG, read_stat_sn, 1, read_stat_sn + 2))
        .await;
    let Pdu::Reject(rj) = c.recv().await else {
        panic!("not rejected")
    };
    assert_eq!(rj.reason, reject_reason::PROTOCOL_ERROR);
    // The session goes on.
    let read = c.command(&rw10(0x28, 0, 48), true, false, 24576, Bytes::new(), true);
    let itt = read.itt;
    c.send(Pdu::ScsiCommand(read)).await;
    let (back, status, ..) = c.read_result(itt).await;
    assert_eq!((status, &back[..]), (0, &data[..]));
}

/// Without data digests nothing a connection sends can arrive damaged, so it keeps nothing: a
/// SNACK is refused (SNACK Reject).
#[tokio::test]
async fn without_data_digests_nothing_is_kept_and_a_snack_is_refused() {
    let server = start(|_| {}).await;
    let mut c = Client::normal(&server, &[("ErrorRecoveryLevel", "1")]).await;
    assert_eq!(key(&c, "ErrorRecoveryLevel"), Some("1"));
    c.send(snack(1, RESERVED_TAG, 0, 0, 0)).await;
    let Pdu::Reject(rj) = c.recv().await else {
        panic!("not rejected")
    };
    assert_eq!(rj.reason, reject_reason::SNACK_REJECT);
}

#[tokio::test]
async fn at_level_0_a_snack_is_a_protocol_error() {
    let server = start(|l| l.offer.max_erl = 1).await;
    let mut c = Client::normal(&server, &[("ErrorRecoveryLevel", "0")]).await;
    c.send(snack(1, RESERVED_TAG, 0, 0, 0)).await;
    let Pdu::Reject(rj) = c.recv().await else {
        panic!("not rejected")
    };
    assert_eq!(rj.reason, reject_reason::PROTOCOL_ERROR);
}

/// TASK REASSIGN of `itt` (immediate, so that it takes no CmdSN) with the first DataSN still
/// needed.
fn reassign(c: &mut Client, itt: u32, exp_data_sn: u32) -> Pdu {
    Pdu::TaskMgmtRequest(TaskMgmtRequest {
        immediate: true,
        function: 8,
        lun: 0,
        itt: c.next_itt(),
        referenced_task_tag: itt,
        cmd_sn: c.cmd_sn,
        exp_stat_sn: 0,
        ref_cmd_sn: 0,
        exp_data_sn,
    })
}

async fn tmf_response(c: &mut Client) -> u8 {
    match c.recv().await {
        Pdu::TaskMgmtResponse(r) => r.response,
        p => panic!("no TMF response: {p:?}"),
    }
}

/// ErrorRecoveryLevel 2 (RFC 7143 6.2, 11.5.1): a connection of a two-connection session dies
/// (its socket closed, as a route that fails would leave it) with a read answered but unread and
/// a write half sent; the session stays up, TASK REASSIGN on the other connection brings the
/// read's data and status there, and the write asks there for the rest of its data.
#[tokio::test]
async fn at_level_2_tasks_of_a_dead_connection_complete_on_another() {
    let server = start(|l| l.offer.max_erl = 2).await;
    let mut a = Client::normal(
        &server,
        &[
            ("ErrorRecoveryLevel", "2"),
            ("MaxRecvDataSegmentLength", "8192"),
            ("InitialR2T", "Yes"),
        ],
    )
    .await;
    assert_eq!(key(&a, "ErrorRecoveryLevel"), Some("2"));
    let (mut b, r) = Client::join(&server, &a, 1).await;
    assert_eq!(r.status_class, 0);
    b.framing.max_data_segment_length = 8192;

    // A 24 KiB pattern, written and read on A; the read's answer is left unread.
    let data = pattern(24576, 3);
    let w = a.command(
        &rw10(0x2a, 0, 48),
        false,
        true,
        24576,
        data.slice(..8192),
        true,
    );
    let itt = w.itt;
    a.send(Pdu::ScsiCommand(w)).await;
    let r2t = match a.recv().await {
        Pdu::R2t(r) => r,
        p => panic!("{p:?}"),
    };
    a.send(Pdu::DataOut(DataOut {
        final_: true,
        lun: 0,
        itt,
        ttt: r2t.ttt,
        exp_stat_sn: 0,
        data_sn: 0,
        buffer_offset: 8192,
        data: data.slice(8192..),
    }))
    .await;
    assert_eq!(a.read_result(itt).await.1, 0);
    let read = a.command(&rw10(0x28, 0, 48), true, false, 24576, Bytes::new(), true);
    let read_itt = read.itt;
    a.send(Pdu::ScsiCommand(read)).await;
    // A second write, 16 KiB at LBA 64, of which only the first 4 KiB come before A dies.
    let more = pattern(16384, 9);
    let w2 = a.command(&rw10(0x2a, 64, 32), false, true, 16384, Bytes::new(), true);
    let w2_itt = w2.itt;
    a.send(Pdu::ScsiCommand(w2)).await;
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    // Find the write's R2T among what A was sent (the read's answer comes first).
    let r2t = loop {
        match a.recv().await {
            Pdu::R2t(r) if r.itt == w2_itt => break r,
            _ => continue,
        }
    };
    a.send(Pdu::DataOut(DataOut {
        final_: false,
        lun: 0,
        itt: w2_itt,
        ttt: r2t.ttt,
        exp_stat_sn: 0,
        data_sn: 0,
        buffer_offset: 0,
        data: more.slice(..4096),
    }))
    .await;
    b.cmd_sn = a.cmd_sn;
    b.itt = a.itt + 100;
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    drop(a);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;

    // The read: its three Data-In and status come again on B.
    let t = reassign(&mut b, read_itt, 0);
    b.send(t).await;
    assert_eq!(tmf_response(&mut b).await, 0);
    let (got, status, ..) = b.read_result(read_itt).await;
    assert_eq!(status, 0);
    assert!(got == data, "the read's data differs");

    // The write: an R2T on B for the 12 KiB still owed.
    let t = reassign(&mut b, w2_itt, 0);
    b.send(t).await;
    assert_eq!(tmf_response(&mut b).await, 0);
    let r2t = match b.recv().await {
        Pdu::R2t(r) => r,
        p => panic!("{p:?}"),
    };
    assert_eq!(
        (r2t.itt, r2t.buffer_offset, r2t.desired_data_transfer_length),
        (w2_itt, 4096, 12288)
    );
    b.send(Pdu::DataOut(DataOut {
        final_: true,
        lun: 0,
        itt: w2_itt,
        ttt: r2t.ttt,
        exp_stat_sn: 0,
        data_sn: 0,
        buffer_offset: 4096,
        data: more.slice(4096..),
    }))
    .await;
    assert_eq!(b.read_result(w2_itt).await.1, 0);
    let back = b.command(&rw10(0x28, 64, 32), true, false, 16384, Bytes::new(), true);
    let back_itt = back.itt;
    b.send(Pdu::ScsiCommand(back)).await;
    let (got, status, ..) = b.read_result(back_itt).await;
    assert_eq!(status, 0);
    assert!(got == more, "the write's data differs");
    // A task nobody knows: "task does not exist".
    let t = reassign(&mut b, 0xdead, 0);
    b.send(t).await;
    assert_eq!(tmf_response(&mut b).await, 1);
    // Logout "remove the connection for recovery" for the one that failed: done already, with
    // the times the session keeps.
    let itt = b.next_itt();
    b.send(Pdu::LogoutRequest(LogoutRequest {
        immediate: true,
        reason: 2,
        itt,
        cid: 0,
        cmd_sn: b.cmd_sn,
        exp_stat_sn: 0,
    }))
    .await;
    match b.recv().await {
        Pdu::LogoutResponse(r) => assert_eq!((r.response, r.time2retain), (0, 20)),
        p => panic!("{p:?}"),
    }

    // A live connection removed for recovery (its route gone silent, say): a read answered on
    // it but never received is reassigned at once.
    let (mut c, r) = Client::join(&server, &b, 2).await;
    assert_eq!(r.status_class, 0);
    c.itt = b.itt + 100;
    let read = c.command(&rw10(0x28, 0, 48), true, false, 24576, Bytes::new(), true);
    let read_itt = read.itt;
    c.send(Pdu::ScsiCommand(read)).await;
    b.cmd_sn = c.cmd_sn;
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let itt = b.next_itt();
    b.send(Pdu::LogoutRequest(LogoutRequest {
        immediate: true,
        reason: 2,
        itt,
        cid: 2,
        cmd_sn: b.cmd_sn,
        exp_stat_sn: 0,
    }))
    .await;
    match b.recv().await {
        Pdu::LogoutResponse(r) => assert_eq!(r.response, 0),
        p => panic!("{p:?}"),
    }
    let t = reassign(&mut b, read_itt, 0);
    b.send(t).await;
    assert_eq!(tmf_response(&mut b).await, 0);
    let (got, status, ..) = b.read_result(read_itt).await;
    assert_eq!(status, 0);
    assert!(got == data, "the read's data differs");
    assert!(c.closed_within(std::time::Duration::from_secs(5)).await);
}
