#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The target over real loopback sockets, driven by a small raw-PDU client built on mcsi-proto's
//! codec.

mod common;

use bytes::Bytes;
use common::*;
use mcsi_proto::pdu::*;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn discovery_send_targets() {
    let server = start(|_| {}).await;
    let mut c = Client::connect(&server).await;
    let r = c
        .login([0x80, 0, 0, 0, 0, 1], 0, 0, &[("SessionType", "Discovery")])
        .await;
    assert_eq!(r.status_class, 0);
    for value in ["All", IQN] {
        let itt = c.next_itt();
        c.send(Pdu::TextRequest(TextRequest {
            immediate: true,
            final_: true,
            continue_: false,
            lun: 0,
            itt,
            ttt: RESERVED_TAG,
            cmd_sn: c.cmd_sn,
            exp_stat_sn: 0,
            data: text(&[("SendTargets", value)]),
        }))
        .await;
        let Pdu::TextResponse(t) = c.recv().await else {
            panic!()
        };
        let expect = format!(
            "TargetName={IQN}\0TargetAddress={},1\0",
            server.local_addrs()[0]
        );
        assert_eq!(&t.data[..], expect.as_bytes());
        assert!(t.final_);
    }
    // An unknown name lists nothing.
    c.send(Pdu::TextRequest(TextRequest {
        immediate: true,
        final_: true,
        continue_: false,
        lun: 0,
        itt: 99,
        ttt: RESERVED_TAG,
        cmd_sn: c.cmd_sn,
        exp_stat_sn: 0,
        data: text(&[("SendTargets", "iqn.2026-01.org.mcsi:nope")]),
    }))
    .await;
    let Pdu::TextResponse(t) = c.recv().await else {
        panic!()
    };
    assert!(t.data.is_empty());
}

/// SendTargets in a discovery session lists only the targets whose allow-list admits the
/// initiator (the test client logs in as iqn.2026-01.org.mcsi:client from 127.0.0.1).
#[tokio::test]
async fn discovery_hides_targets_the_initiator_may_not_enter() {
    for (allowed, listed) in [
        ("iqn.2026-01.org.mcsi:someone-else", false),
        ("iqn.2026-01.org.mcsi:client", true),
    ] {
        let server =
            start_with(|c| c.targets[0].auth.allow_initiators = vec![allowed.into()]).await;
        let mut c = Client::connect(&server).await;
        let r = c
            .login([0x80, 0, 0, 0, 0, 3], 0, 0, &[("SessionType", "Discovery")])
            .await;
        assert_eq!(r.status_class, 0);
        for value in ["All", IQN] {
            let itt = c.next_itt();
            c.send(Pdu::TextRequest(TextRequest {
                immediate: true,
                final_: true,
                continue_: false,
                lun: 0,
                itt,
                ttt: RESERVED_TAG,
                cmd_sn: c.cmd_sn,
                exp_stat_sn: 0,
                data: text(&[("SendTargets", value)]),
            }))
            .await;
            let Pdu::TextResponse(t) = c.recv().await else {
                panic!()
            };
            let expect = if listed {
                format!(
                    "TargetName={IQN}\0TargetAddress={},1\0",
                    server.local_addrs()[0]
                )
            } else {
                String::new()
            };
            assert_eq!(
                &t.data[..],
                expect.as_bytes(),
                "allow-list {allowed}, SendTargets={value}"
            );
        }
    }
}

#[tokio::test]
async fn login_to_unknown_target_fails() {
    let server = start(|_| {}).await;
    let mut c = Client::connect(&server).await;
    let r = c
        .login(
            [0x80, 0, 0, 0, 0, 2],
            0,
            0,
            &[("TargetName", "iqn.2026-01.org.mcsi:nope")],
        )
        .await;
    assert_eq!((r.status_class, r.status_detail), (2, 3));
}

#[tokio::test]
async fn write_immediate_then_read_back() {
    let server = start(|_| {}).await;
    let mut c = Client::normal(&server, &[("ImmediateData", "Yes"), ("InitialR2T", "No")]).await;
    let data = pattern(4096, 7);
    let cmd = c.command(&rw10(0x2a, 10, 8), false, true, 4096, data.clone(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (_, st, o, u, _) = c.read_result(itt).await;
    assert_eq!((st, o, u), (0, false, false));
    let cmd = c.command(&rw10(0x28, 10, 8), true, false, 4096, Bytes::new(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (got, st, _, _, _) = c.read_result(itt).await;
    assert_eq!(st, 0);
    assert_eq!(&got[..], &data[..]);
}

#[tokio::test]
async fn unsolicited_data_then_r2t() {
    // FirstBurstLength 8192: 2048 immediate + 6144 unsolicited Data-Out, the rest by R2T.
    let server = start(|l| {
        l.offer.first_burst_length = 8192;
        l.offer.max_burst_length = 16384;
    })
    .await;
    let mut c = Client::normal(
        &server,
        &[
            ("ImmediateData", "Yes"),
            ("InitialR2T", "No"),
            ("FirstBurstLength", "8192"),
            ("MaxBurstLength", "16384"),
            ("MaxOutstandingR2T", "1"),
        ],
    )
    .await;
    let data = pattern(40960, 3);
    let cmd = c.command(
        &rw10(0x2a, 100, 80),
        false,
        true,
        40960,
        data.slice(..2048),
        false,
    );
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    c.send(Pdu::DataOut(DataOut {
        final_: true,
        lun: 0,
        itt,
        ttt: RESERVED_TAG,
        exp_stat_sn: 0,
        data_sn: 0,
        buffer_offset: 2048,
        data: data.slice(2048..8192),
    }))
    .await;
    // R2Ts: 8192+16384, then 24576+16384 (one outstanding at a time).
    let mut expect_off = 8192u32;
    for sn in 0..2u32 {
        let Pdu::R2t(r) = c.recv().await else {
            panic!("expected R2T")
        };
        assert_eq!(
            (r.r2t_sn, r.buffer_offset, r.desired_data_transfer_length),
            (sn, expect_off, 16384)
        );
        let (o, n) = (
            r.buffer_offset as usize,
            r.desired_data_transfer_length as usize,
        );
        // Two Data-Out PDUs per R2T, DataSN from 0.
        c.send(Pdu::DataOut(DataOut {
            final_: false,
            lun: 0,
            itt,
            ttt: r.ttt,
            exp_stat_sn: 0,
            data_sn: 0,
            buffer_offset: o as u32,
            data: data.slice(o..o + n / 2),
        }))
        .await;
        c.send(Pdu::DataOut(DataOut {
            final_: true,
            lun: 0,
            itt,
            ttt: r.ttt,
            exp_stat_sn: 0,
            data_sn: 1,
            buffer_offset: (o + n / 2) as u32,
            data: data.slice(o + n / 2..o + n),
        }))
        .await;
        expect_off += 16384;
    }
    let (_, st, _, _, _) = c.read_result(itt).await;
    assert_eq!(st, 0);
    let cmd = c.command(&rw10(0x28, 100, 80), true, false, 40960, Bytes::new(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (got, _, _, _, _) = c.read_result(itt).await;
    assert_eq!(&got[..], &data[..]);
}

#[tokio::test]
async fn residuals_for_reads_and_writes() {
    let server = start(|_| {}).await;
    let mut c = Client::normal(&server, &[("ImmediateData", "Yes"), ("InitialR2T", "No")]).await;
    // READ10 of one block with EDTL 10000: 512 bytes and underflow 9488.
    let cmd = c.command(&rw10(0x28, 0, 1), true, false, 10000, Bytes::new(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (got, st, o, u, res) = c.read_result(itt).await;
    assert_eq!((got.len(), st, o, u, res), (512, 0, false, true, 9488));
    // READ10 of two blocks with EDTL one block: 512 bytes, overflow 512.
    let cmd = c.command(&rw10(0x28, 0, 2), true, false, 512, Bytes::new(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (got, st, o, u, res) = c.read_result(itt).await;
    assert_eq!((got.len(), st, o, u, res), (512, 0, true, false, 512));
    // WRITE10 of one block with EDTL 1024 (all immediate): underflow 512.
    let cmd = c.command(&rw10(0x2a, 0, 1), false, true, 1024, pattern(1024, 1), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (_, st, o, u, res) = c.read_result(itt).await;
    assert_eq!((st, o, u, res), (0, false, true, 512));
}

#[tokio::test]
async fn many_outstanding_commands() {
    let server = start(|_| {}).await;
    let mut c = Client::normal(&server, &[("ImmediateData", "Yes"), ("InitialR2T", "No")]).await;
    let mut itts = Vec::new();
    for i in 0..64u32 {
        let cmd = c.command(
            &rw10(0x2a, i * 8, 8),
            false,
            true,
            4096,
            pattern(4096, i as u8),
            true,
        );
        itts.push(cmd.itt);
        c.send(Pdu::ScsiCommand(cmd)).await;
    }
    let mut seen = std::collections::HashSet::new();
    for _ in 0..64 {
        let Pdu::ScsiResponse(r) = c.recv().await else {
            panic!()
        };
        assert_eq!(r.status, 0);
        assert!(seen.insert(r.itt));
    }
    assert_eq!(seen.len(), 64);
    for i in 0..64u32 {
        let cmd = c.command(&rw10(0x28, i * 8, 8), true, false, 4096, Bytes::new(), true);
        let itt = cmd.itt;
        c.send(Pdu::ScsiCommand(cmd)).await;
        let (got, _, _, _, _) = c.read_result(itt).await;
        assert_eq!(&got[..], &pattern(4096, i as u8)[..]);
    }
}

#[tokio::test]
async fn cmd_sn_window_across_two_connections() {
    let server = start(|l| l.offer.queue_depth = 16).await;
    let mut a = Client::normal(&server, &[]).await;
    let first = a.cmd_sn;
    // Second connection of the same session: same ISID, the TSIH given, another CID.
    let mut b = Client::connect(&server).await;
    let tsih = a.tsih;
    b.cmd_sn = a.cmd_sn;
    let r = b
        .login([0x80, 1, 2, 3, 4, 5], tsih, 1, &[("TargetName", IQN)])
        .await;
    assert_eq!((r.status_class, r.tsih), (0, tsih));
    assert_eq!(r.exp_cmd_sn, first);

    // Out of window (too high): silently dropped.
    a.cmd_sn = first + 100;
    let cmd = a.command(&[0, 0, 0, 0, 0, 0], false, false, 0, Bytes::new(), true);
    a.send(Pdu::ScsiCommand(cmd)).await;
    assert!(a.silent(300).await);

    // CmdSN first+1 on connection b is held until first arrives on connection a.
    b.cmd_sn = first + 1;
    let cmd = b.command(&[0, 0, 0, 0, 0, 0], false, false, 0, Bytes::new(), true);
    let itt_b = cmd.itt;
    b.send(Pdu::ScsiCommand(cmd)).await;
    assert!(
        b.silent(300).await,
        "a command behind a CmdSN gap must wait"
    );
    a.cmd_sn = first;
    let cmd = a.command(&[0, 0, 0, 0, 0, 0], false, false, 0, Bytes::new(), true);
    let itt_a = cmd.itt;
    a.send(Pdu::ScsiCommand(cmd)).await;
    let Pdu::ScsiResponse(ra) = a.recv().await else {
        panic!()
    };
    let Pdu::ScsiResponse(rb) = b.recv().await else {
        panic!()
    };
    assert_eq!((ra.itt, rb.itt), (itt_a, itt_b));
    assert_eq!(rb.exp_cmd_sn, first + 2);
    // Nothing outstanding: MaxCmdSN = ExpCmdSN + queue depth (16) - 1.
    assert_eq!(rb.max_cmd_sn, first + 2 + 15);
    // Too low now: dropped.
    a.cmd_sn = first;
    let cmd = a.command(&[0, 0, 0, 0, 0, 0], false, false, 0, Bytes::new(), true);
    a.send(Pdu::ScsiCommand(cmd)).await;
    assert!(a.silent(300).await);
}

#[tokio::test]
async fn nop_ping_echoes_data() {
    let server = start(|_| {}).await;
    let mut c = Client::normal(&server, &[]).await;
    let itt = c.next_itt();
    c.send(Pdu::NopOut(NopOut {
        immediate: true,
        lun: 0,
        itt,
        ttt: RESERVED_TAG,
        cmd_sn: c.cmd_sn,
        exp_stat_sn: 0,
        data: Bytes::from_static(b"ping!"),
    }))
    .await;
    let Pdu::NopIn(n) = c.recv().await else {
        panic!()
    };
    assert_eq!(
        (n.itt, n.ttt, &n.data[..]),
        (itt, RESERVED_TAG, &b"ping!"[..])
    );
}

#[tokio::test]
async fn abort_of_unknown_task_and_lun_reset() {
    let server = start(|_| {}).await;
    let mut c = Client::normal(&server, &[]).await;
    let tmf = |function: u8, lun: u64, r: u32, cmd_sn: u32| {
        Pdu::TaskMgmtRequest(TaskMgmtRequest {
            immediate: true,
            function,
            lun,
            itt: 500 + u32::from(function),
            referenced_task_tag: r,
            cmd_sn,
            exp_stat_sn: 0,
            ref_cmd_sn: cmd_sn.wrapping_sub(5),
            exp_data_sn: 0,
        })
    };
    c.send(tmf(1, 0, 0x1234, c.cmd_sn)).await;
    let Pdu::TaskMgmtResponse(r) = c.recv().await else {
        panic!()
    };
    assert_eq!(r.response, 1, "task does not exist");
    c.send(tmf(5, 0, RESERVED_TAG, c.cmd_sn)).await;
    let Pdu::TaskMgmtResponse(r) = c.recv().await else {
        panic!()
    };
    assert_eq!(r.response, 0);
    c.send(tmf(5, mcsi_scsi::lun::encode(7), RESERVED_TAG, c.cmd_sn))
        .await;
    let Pdu::TaskMgmtResponse(r) = c.recv().await else {
        panic!()
    };
    assert_eq!(r.response, 2, "LUN does not exist");
    c.send(tmf(3, 0, RESERVED_TAG, c.cmd_sn)).await;
    let Pdu::TaskMgmtResponse(r) = c.recv().await else {
        panic!()
    };
    assert_eq!(r.response, 5, "CLEAR ACA: function not supported");
    // TARGET COLD RESET would end every initiator's sessions: not unless the operator allows.
    c.send(tmf(7, 0, RESERVED_TAG, c.cmd_sn)).await;
    let Pdu::TaskMgmtResponse(r) = c.recv().await else {
        panic!()
    };
    assert_eq!(r.response, 6, "function authorization failed");
    c.send(tmf(5, 0, RESERVED_TAG, c.cmd_sn)).await;
    let Pdu::TaskMgmtResponse(r) = c.recv().await else {
        panic!()
    };
    assert_eq!(r.response, 0, "the session goes on");
}

#[tokio::test]
async fn an_allowed_cold_reset_answers_then_ends_every_session_of_the_target() {
    let server = start(|l| l.allow_cold_reset = true).await;
    // Another initiator port (its own ISID), so that it is a session of its own.
    let mut other = Client::normal_isid(&server, [0x80, 9, 9, 9, 9, 9], &[]).await;
    let mut c = Client::normal(&server, &[]).await;
    let itt = other.next_itt();
    other
        .send(Pdu::NopOut(NopOut {
            immediate: true,
            lun: 0,
            itt,
            ttt: RESERVED_TAG,
            cmd_sn: other.cmd_sn,
            exp_stat_sn: 0,
            data: Bytes::new(),
        }))
        .await;
    let Pdu::NopIn(_) = other.recv().await else {
        panic!("the other session is alive before the reset")
    };
    c.send(Pdu::TaskMgmtRequest(TaskMgmtRequest {
        immediate: true,
        function: 7,
        lun: 0,
        itt: 0x77,
        referenced_task_tag: RESERVED_TAG,
        cmd_sn: c.cmd_sn,
        exp_stat_sn: 0,
        ref_cmd_sn: 0,
        exp_data_sn: 0,
    }))
    .await;
    let Pdu::TaskMgmtResponse(r) = c.recv().await else {
        panic!()
    };
    assert_eq!((r.itt, r.response), (0x77, 0), "cold reset done");
    assert!(c.closed_by_target().await, "the requester's session ends");
    assert!(other.closed_by_target().await, "and every other one");
}

#[tokio::test]
async fn abort_task_waiting_for_data_sends_no_status() {
    let server = start(|_| {}).await;
    let mut c = Client::normal(&server, &[("InitialR2T", "Yes"), ("ImmediateData", "No")]).await;
    let cmd = c.command(&rw10(0x2a, 0, 8), false, true, 4096, Bytes::new(), true);
    let (itt, cmd_sn) = (cmd.itt, cmd.cmd_sn);
    c.send(Pdu::ScsiCommand(cmd)).await;
    let Pdu::R2t(_) = c.recv().await else {
        panic!("expected R2T")
    };
    c.send(Pdu::TaskMgmtRequest(TaskMgmtRequest {
        immediate: true,
        function: 1,
        lun: 0,
        itt: 900,
        referenced_task_tag: itt,
        cmd_sn: c.cmd_sn,
        exp_stat_sn: 0,
        ref_cmd_sn: cmd_sn,
        exp_data_sn: 0,
    }))
    .await;
    let Pdu::TaskMgmtResponse(r) = c.recv().await else {
        panic!("the aborted task's status must not be sent")
    };
    assert_eq!((r.itt, r.response), (900, 0));
    assert!(c.silent(200).await);
}

#[tokio::test]
async fn malformed_pdu_is_rejected_and_the_session_goes_on() {
    let server = start(|_| {}).await;
    let mut c = Client::normal(&server, &[]).await;
    let mut other = Client::normal_isid(&server, [0x80, 9, 9, 9, 9, 9], &[]).await;
    // Opcode 0x1f is not defined by RFC 7143.
    let mut bhs = [0u8; 48];
    bhs[0] = 0x1f;
    bhs[16..20].copy_from_slice(&77u32.to_be_bytes());
    c.s.write_all(&bhs).await.unwrap();
    let Pdu::Reject(r) = c.recv().await else {
        panic!()
    };
    assert_eq!(r.reason, 0x04);
    assert_eq!(&r.header[..], &bhs[..]);
    for cl in [&mut c, &mut other] {
        let cmd = cl.command(&[0, 0, 0, 0, 0, 0], false, false, 0, Bytes::new(), true);
        let itt = cmd.itt;
        cl.send(Pdu::ScsiCommand(cmd)).await;
        let Pdu::ScsiResponse(r) = cl.recv().await else {
            panic!()
        };
        assert_eq!((r.itt, r.status), (itt, 0));
    }
}

#[tokio::test]
async fn logout_and_session_reinstatement() {
    let server = start(|_| {}).await;
    let mut old = Client::normal(&server, &[]).await;
    let old_tsih = old.tsih;
    // Same initiator name and ISID, TSIH 0: the old session is closed first.
    let new = Client::normal(&server, &[]).await;
    assert_ne!(new.tsih, old_tsih);
    let mut tmp = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(5), old.s.read(&mut tmp))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "the reinstated session's connection is closed");
    let mut c = new;
    let itt = c.next_itt();
    c.send(Pdu::LogoutRequest(LogoutRequest {
        immediate: true,
        reason: 0,
        itt,
        cid: 0,
        cmd_sn: c.cmd_sn,
        exp_stat_sn: 0,
    }))
    .await;
    let Pdu::LogoutResponse(r) = c.recv().await else {
        panic!()
    };
    assert_eq!((r.itt, r.response), (itt, 0));
    let n = tokio::time::timeout(Duration::from_secs(5), c.s.read(&mut tmp))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn keepalive_pings_idle_connections_and_drops_silent_ones() {
    let server = start(|l| {
        l.offer.nop_interval = Duration::from_millis(150);
        l.offer.nop_timeout = Duration::from_millis(300);
    })
    .await;
    let mut c = Client::normal(&server, &[]).await;
    // Answered pings keep the connection up; each carries a fresh Target Transfer Tag.
    let mut tags = Vec::new();
    for _ in 0..3 {
        let Pdu::NopIn(p) = c.recv().await else {
            panic!("expected a NOP-In ping")
        };
        assert_eq!(p.itt, RESERVED_TAG, "a target ping has the reserved ITT");
        assert_ne!(p.ttt, RESERVED_TAG, "a ping that wants an answer has a TTT");
        assert!(!tags.contains(&p.ttt));
        tags.push(p.ttt);
        c.send(Pdu::NopOut(NopOut {
            immediate: true,
            lun: 0,
            itt: RESERVED_TAG,
            ttt: p.ttt,
            cmd_sn: c.cmd_sn,
            exp_stat_sn: p.stat_sn,
            data: Bytes::new(),
        }))
        .await;
    }
    // An unanswered ping: the connection goes after the timeout, not before.
    let Pdu::NopIn(_) = c.recv().await else {
        panic!("expected a NOP-In ping")
    };
    let t0 = tokio::time::Instant::now();
    assert!(c.closed_by_target().await, "a silent initiator is dropped");
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
        "dropped after {waited:?}, the timeout is 300 ms"
    );

    // An interval of zero: no pings, even with a ping timeout shorter than the wait (a zero
    // taken for "the default" is caught by the config's and the keepalive's unit tests, which
    // need no 30 s wait).
    let server = start(|l| {
        l.offer.nop_interval = Duration::ZERO;
        l.offer.nop_timeout = Duration::from_millis(100);
    })
    .await;
    let mut c = Client::normal(&server, &[]).await;
    assert!(c.silent(600).await);
}

fn text_piece(c: &Client, itt: u32, ttt: u32, continue_: bool, data: &[u8]) -> Pdu {
    Pdu::TextRequest(TextRequest {
        immediate: true,
        final_: !continue_,
        continue_,
        lun: 0,
        itt,
        ttt,
        cmd_sn: c.cmd_sn,
        exp_stat_sn: 0,
        data: Bytes::copy_from_slice(data),
    })
}

/// A Text Request sent in pieces with the C bit (RFC 7143 11.10.2): each piece but the last is
/// answered by an empty Text Response carrying the tag for the next one, and the joined text is
/// answered as a whole. A chain past the text limit, and C with F, are rejected, and the
/// connection goes on working.
#[tokio::test]
async fn text_request_in_pieces() {
    let server = start(|_| {}).await;
    let mut c = Client::connect(&server).await;
    let r = c
        .login([0x80, 0, 0, 0, 0, 4], 0, 0, &[("SessionType", "Discovery")])
        .await;
    assert_eq!(r.status_class, 0);
    let expect = format!(
        "TargetName={IQN}\0TargetAddress={},1\0",
        server.local_addrs()[0]
    );
    let itt = c.next_itt();
    let mut ttt = RESERVED_TAG;
    let pieces: [&[u8]; 3] = [b"SendTa", b"rgets=A", b"ll\0"];
    for (i, piece) in pieces.iter().enumerate() {
        let last = i == pieces.len() - 1;
        c.send(text_piece(&c, itt, ttt, !last, piece)).await;
        let Pdu::TextResponse(t) = c.recv().await else {
            panic!("piece {i}: no Text Response")
        };
        assert_eq!(t.itt, itt);
        if last {
            assert!(t.final_ && !t.continue_);
            assert_eq!(t.ttt, RESERVED_TAG);
            assert_eq!(&t.data[..], expect.as_bytes());
        } else {
            assert!(!t.final_ && !t.continue_, "piece {i}");
            assert!(t.data.is_empty(), "piece {i}");
            assert_ne!(t.ttt, RESERVED_TAG, "piece {i}");
            ttt = t.ttt;
        }
    }

    // C and F together.
    let itt = c.next_itt();
    let mut bad = text_piece(&c, itt, RESERVED_TAG, true, b"SendTargets=All\0");
    if let Pdu::TextRequest(t) = &mut bad {
        t.final_ = true;
    }
    c.send(bad).await;
    assert!(matches!(c.recv().await, Pdu::Reject(_)));

    // C and F together on a later piece, and a piece with a tag the target did not give, each
    // end their chain with a Reject.
    for wrong_tag in [false, true] {
        let itt = c.next_itt();
        c.send(text_piece(&c, itt, RESERVED_TAG, true, b"SendTa"))
            .await;
        let Pdu::TextResponse(t) = c.recv().await else {
            panic!("first piece not acknowledged")
        };
        let mut next = text_piece(
            &c,
            itt,
            if wrong_tag { t.ttt ^ 1 } else { t.ttt },
            true,
            b"rgets=All\0",
        );
        if let Pdu::TextRequest(r) = &mut next {
            r.final_ = !wrong_tag;
        }
        c.send(next).await;
        assert!(
            matches!(c.recv().await, Pdu::Reject(_)),
            "wrong tag {wrong_tag}"
        );
        // The chain is gone: its tag is not taken any more.
        c.send(text_piece(&c, itt, t.ttt, false, b"ll\0")).await;
        assert!(
            matches!(c.recv().await, Pdu::Reject(_)),
            "wrong tag {wrong_tag}: the chain went on"
        );
    }

    // A chain that never ends is cut at the text limit (64 KiB).
    let itt = c.next_itt();
    let mut ttt = RESERVED_TAG;
    let chunk = vec![b'c'; 8192];
    let mut acked = 0;
    loop {
        c.send(text_piece(&c, itt, ttt, true, &chunk)).await;
        match c.recv().await {
            Pdu::TextResponse(t) => {
                acked += 1;
                ttt = t.ttt;
                assert!(acked < 16, "a 128 KiB chain was taken whole");
            }
            Pdu::Reject(_) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(acked, 8, "pieces taken before the 64 KiB limit");

    // The same connection still answers.
    let itt = c.next_itt();
    c.send(text_piece(
        &c,
        itt,
        RESERVED_TAG,
        false,
        b"SendTargets=All\0",
    ))
    .await;
    let Pdu::TextResponse(t) = c.recv().await else {
        panic!()
    };
    assert_eq!(&t.data[..], expect.as_bytes());
}

/// Status of a command without data; a unit attention (a new nexus's first command) is taken and
/// the command sent again.
async fn no_data_status(c: &mut Client, cdb: &[u8]) -> u8 {
    for _ in 0..3 {
        let cmd = c.command(cdb, false, false, 0, Bytes::new(), true);
        let itt = cmd.itt;
        c.send(Pdu::ScsiCommand(cmd)).await;
        let Pdu::ScsiResponse(r) = c.recv().await else {
            panic!("expected a SCSI Response")
        };
        assert_eq!(r.itt, itt);
        let unit_attention = r.status == 2 && r.sense.len() > 2 && r.sense[2] & 0x0f == 6;
        if !unit_attention {
            return r.status;
        }
    }
    panic!("unit attentions without end")
}

/// A logout that ends a session ends its I_T nexus when it is answered: the RESERVE(6) it held
/// is free for another initiator as soon as the Logout Response is in (SPC-2 reservations end
/// with the nexus), not once the target has wound the connection down.
#[tokio::test]
async fn a_logout_frees_the_reservation_before_it_is_answered() {
    const RESERVE6: [u8; 6] = [0x16, 0, 0, 0, 0, 0];
    const RELEASE6: [u8; 6] = [0x17, 0, 0, 0, 0, 0];
    const CONFLICT: u8 = 0x18;
    // Forty logins in a row from one address: without the login rate limit.
    let server = start_with(|c| c.limits.login_rate = 0).await;
    let mut b = Client::normal_isid(&server, [0x80, 9, 9, 9, 9, 9], &[]).await;
    for round in 0..40 {
        let mut a = Client::normal(&server, &[]).await;
        assert_eq!(no_data_status(&mut a, &RESERVE6).await, 0, "round {round}");
        assert_eq!(no_data_status(&mut b, &RESERVE6).await, CONFLICT);
        assert_eq!(a.logout(0, 0).await.response, 0);
        assert_eq!(
            no_data_status(&mut b, &RESERVE6).await,
            0,
            "round {round}: the reservation of the session that logged out is still held"
        );
        assert_eq!(no_data_status(&mut b, &RELEASE6).await, 0);
    }
    server.shutdown().await.unwrap();
}

/// Behind NAT the portal is not what initiators reach: SendTargets gives the address named in
/// `advertise` instead.
#[tokio::test]
async fn discovery_gives_the_advertised_address_in_place_of_the_portal() {
    let server = start_with(|c| c.targets[0].advertise = vec!["203.0.113.7:3260".into()]).await;
    let mut c = Client::connect(&server).await;
    let r = c
        .login([0x80, 0, 0, 0, 0, 4], 0, 0, &[("SessionType", "Discovery")])
        .await;
    assert_eq!(r.status_class, 0);
    let itt = c.next_itt();
    c.send(Pdu::TextRequest(TextRequest {
        immediate: true,
        final_: true,
        continue_: false,
        lun: 0,
        itt,
        ttt: RESERVED_TAG,
        cmd_sn: c.cmd_sn,
        exp_stat_sn: 0,
        data: text(&[("SendTargets", "All")]),
    }))
    .await;
    let Pdu::TextResponse(t) = c.recv().await else {
        panic!()
    };
    let expect = format!("TargetName={IQN}\0TargetAddress=203.0.113.7:3260,1\0");
    assert_eq!(&t.data[..], expect.as_bytes());
}

/// A redirected target answers a normal login "target moved" (temporarily or permanently, RFC
/// 7143 11.13.5) with the address to log in at; discovery is served as before.
#[tokio::test]
async fn a_redirected_login_is_told_where_to_go() {
    for (permanent, detail) in [(false, 1), (true, 2)] {
        let server = start_with(|c| {
            c.targets[0].redirect = Some(mcsi_target::config::Redirect {
                to: "192.0.2.9:3261".into(),
                from: Vec::new(),
                permanent,
            })
        })
        .await;
        let mut c = Client::connect(&server).await;
        let r = c
            .login([0x80, 0, 0, 0, 0, 5], 0, 0, &[("TargetName", IQN)])
            .await;
        assert_eq!((r.status_class, r.status_detail), (1, detail));
        let keys = String::from_utf8_lossy(&r.data).into_owned();
        // RFC 7143 13.8: a redirection's TargetAddress has no portal group tag.
        assert!(keys.contains("TargetAddress=192.0.2.9:3261\0"), "{keys:?}");
        let mut d = Client::connect(&server).await;
        let r = d
            .login([0x80, 0, 0, 0, 0, 6], 0, 0, &[("SessionType", "Discovery")])
            .await;
        assert_eq!(r.status_class, 0, "discovery is not redirected");
    }
}
