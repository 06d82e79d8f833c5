#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Header and data digests (CRC32C, RFC 7143 13.1) negotiated by mcsi-proto's `InitiatorLogin`
//! against the target, I/O with digests on, and the ERL 0 actions for digest errors
//! (RFC 7143 7.8: data digest error -> discard and Reject reason 0x02; header digest error ->
//! the PDU's extent is unknown, the connection is dropped).

mod common;

use bytes::Bytes;
use common::*;
use mcsi_proto::keys::{Digest, LocalParams};
use mcsi_proto::login::{InitiatorLogin, InitiatorLoginConfig, InitiatorStep};
use mcsi_proto::pdu::*;
use tokio::io::AsyncWriteExt;

/// Logs in with `InitiatorLogin` offering the given digests and switches the client's framing.
async fn login_with(server: &mcsi_target::Server, offer: Vec<Digest>) -> (Client, bool, bool) {
    login_erl(server, offer, 0).await
}

/// [`login_with`], offering ErrorRecoveryLevel `erl`.
async fn login_erl(
    server: &mcsi_target::Server,
    offer: Vec<Digest>,
    erl: u8,
) -> (Client, bool, bool) {
    let mut c = Client::connect(server).await;
    let mut cfg = InitiatorLoginConfig::normal(
        "iqn.2026-01.org.mcsi:digests",
        IQN,
        Isid([0x80, 3, 3, 3, 3, 3]),
    );
    cfg.cmd_sn = 1;
    cfg.params = LocalParams {
        header_digest: offer.clone(),
        data_digest: offer,
        error_recovery_level: erl,
        ..LocalParams::default()
    };
    let mut il = InitiatorLogin::new(cfg);
    let mut req = il.start();
    for _ in 0..8 {
        c.send(Pdu::LoginRequest(req)).await;
        let Pdu::LoginResponse(r) = c.recv().await else {
            panic!("not a login response")
        };
        match il.handle(&r) {
            InitiatorStep::Send(next) => req = next,
            InitiatorStep::FullFeature(o) => {
                let h = o.connection.header_digest == Digest::Crc32c;
                let d = o.connection.data_digest == Digest::Crc32c;
                c.framing = Framing {
                    header_digest: h,
                    data_digest: d,
                    max_data_segment_length: o.connection.max_send_data_segment_length,
                };
                c.cmd_sn = o.exp_cmd_sn;
                c.tsih = o.tsih;
                // Clear the power-on unit attention.
                for _ in 0..3 {
                    let tur = c.command(&[0; 6], false, false, 0, Bytes::new(), true);
                    let itt = tur.itt;
                    c.send(Pdu::ScsiCommand(tur)).await;
                    if c.read_result(itt).await.1 == 0 {
                        break;
                    }
                }
                return (c, h, d);
            }
            InitiatorStep::Failed(e) => panic!("login failed: {e}"),
        }
    }
    panic!("login did not finish in 8 rounds")
}

async fn write_read(c: &mut Client, lba: u32, data: Bytes) {
    let blocks = (data.len() / 512) as u16;
    let cmd = c.command(
        &rw10(0x2a, lba, blocks),
        false,
        true,
        data.len() as u32,
        Bytes::new(),
        true,
    );
    let itt = cmd.itt;
    // Solicited data: wait for R2Ts and answer them with Data-Out (data digest on each).
    c.send(Pdu::ScsiCommand(cmd)).await;
    loop {
        match c.recv().await {
            Pdu::R2t(r) => {
                let off = r.buffer_offset as usize;
                let len = r.desired_data_transfer_length as usize;
                let mut sent = 0;
                let mut sn = 0;
                while sent < len {
                    let n = (len - sent).min(c.framing.max_data_segment_length as usize);
                    c.send(Pdu::DataOut(DataOut {
                        final_: sent + n == len,
                        lun: 0,
                        itt,
                        ttt: r.ttt,
                        exp_stat_sn: 0,
                        data_sn: sn,
                        buffer_offset: (off + sent) as u32,
                        data: data.slice(off + sent..off + sent + n),
                    }))
                    .await;
                    sent += n;
                    sn += 1;
                }
            }
            Pdu::ScsiResponse(r) => {
                assert_eq!((r.itt, r.status), (itt, 0));
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let cmd = c.command(
        &rw10(0x28, lba, blocks),
        true,
        false,
        data.len() as u32,
        Bytes::new(),
        true,
    );
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (got, st, _, _, _) = c.read_result(itt).await;
    assert_eq!(st, 0);
    assert_eq!(got, &data[..]);
}

#[tokio::test]
async fn crc32c_negotiated_and_used_both_ways() {
    let server = start(|_| {}).await;
    let (mut c, h, d) = login_with(&server, vec![Digest::Crc32c, Digest::None]).await;
    assert!(h && d, "the target offers CRC32C: both digests must be on");
    // Larger than one data segment each way: several Data-In / Data-Out PDUs, each digested.
    write_read(&mut c, 64, pattern(1 << 20, 9)).await;
    // Immediate data with digests.
    let data = pattern(4096, 4);
    let cmd = c.command(&rw10(0x2a, 8, 8), false, true, 4096, data.clone(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    assert_eq!(c.read_result(itt).await.1, 0);
    // The client's decoder checks every digest the target sent; a wrong one fails here.
    let cmd = c.command(&rw10(0x28, 8, 8), true, false, 4096, Bytes::new(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    assert_eq!(&c.read_result(itt).await.0[..], &data[..]);
}

#[tokio::test]
async fn none_preferred_gives_no_digests() {
    let server = start(|_| {}).await;
    let (mut c, h, d) = login_with(&server, vec![Digest::None, Digest::Crc32c]).await;
    assert!(
        !h && !d,
        "the target must take the initiator's first acceptable choice"
    );
    write_read(&mut c, 0, pattern(65536, 1)).await;
}

#[tokio::test]
async fn corrupted_data_digest_is_rejected_and_the_connection_survives() {
    let server = start(|_| {}).await;
    let (mut c, _, _) = login_with(&server, vec![Digest::Crc32c]).await;
    let old = pattern(4096, 1);
    let cmd = c.command(&rw10(0x2a, 16, 8), false, true, 4096, old.clone(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    assert_eq!(c.read_result(itt).await.1, 0);

    // WRITE with immediate data whose data digest is wrong (last trailer byte flipped).
    let cmd = c.command(
        &rw10(0x2a, 16, 8),
        false,
        true,
        4096,
        pattern(4096, 50),
        true,
    );
    let bad_itt = cmd.itt;
    let mut raw = Pdu::ScsiCommand(cmd).encode(&c.framing).to_vec();
    *raw.last_mut().unwrap() ^= 0x01;
    c.s.write_all(&raw).await.unwrap();
    match c.recv().await {
        Pdu::Reject(r) => {
            assert_eq!(
                r.reason, 0x02,
                "RFC 7143 7.8: Reject reason data digest error"
            );
            // The Reject carries the rejected PDU's header.
            assert_eq!(
                u32::from_be_bytes(r.header[16..20].try_into().unwrap()),
                bad_itt
            );
        }
        other => panic!("expected Reject 0x02, got {other:?}"),
    }
    // The connection still works, and the corrupted write did not reach the medium.
    let cmd = c.command(&rw10(0x28, 16, 8), true, false, 4096, Bytes::new(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (got, st, _, _, _) = c.read_result(itt).await;
    assert_eq!(st, 0);
    assert_eq!(&got[..], &old[..]);
}

#[tokio::test]
async fn corrupted_header_digest_drops_the_connection() {
    let server = start(|_| {}).await;
    let (mut c, _, _) = login_with(&server, vec![Digest::Crc32c]).await;
    let cmd = c.command(&[0; 6], false, false, 0, Bytes::new(), true);
    let mut raw = Pdu::ScsiCommand(cmd).encode(&c.framing).to_vec();
    // Header digest: bytes 48..52 of a PDU without AHS.
    raw[50] ^= 0x80;
    c.s.write_all(&raw).await.unwrap();
    assert!(
        c.closed_by_target().await,
        "header digest error must drop the connection at ERL 0"
    );
    // The target serves a new login afterwards.
    let (mut c2, _, _) = login_with(&server, vec![Digest::Crc32c]).await;
    write_read(&mut c2, 32, pattern(8192, 3)).await;
}

/// Sends `p` with its data digest spoiled (the last trailer byte flipped).
async fn send_damaged(c: &mut Client, p: Pdu) {
    let mut raw = p.encode(&c.framing).to_vec();
    *raw.last_mut().unwrap() ^= 0x01;
    c.s.write_all(&raw).await.unwrap();
}

async fn expect_reject(c: &mut Client, reason: u8) {
    match c.recv().await {
        Pdu::Reject(r) => assert_eq!(r.reason, reason),
        other => panic!("expected Reject {reason:#x}, got {other:?}"),
    }
}

async fn expect_r2t(c: &mut Client, itt: u32) -> R2t {
    match c.recv().await {
        Pdu::R2t(r) if r.itt == itt => r,
        other => panic!("expected an R2T for {itt:#x}, got {other:?}"),
    }
}

fn data_out(r: &R2t, data_sn: u32, offset: u32, data: Bytes, final_: bool) -> Pdu {
    Pdu::DataOut(DataOut {
        final_,
        lun: 0,
        itt: r.itt,
        ttt: r.ttt,
        exp_stat_sn: 0,
        data_sn,
        buffer_offset: offset,
        data,
    })
}

/// At ErrorRecoveryLevel 1 data lost to a digest error is asked for again with a recovery R2T
/// (RFC 7143 7.8 a): the write completes with the right data, on the same connection.
#[tokio::test]
async fn at_level_1_damaged_data_is_asked_for_again_and_the_write_completes() {
    let server = start(|l| l.offer.max_erl = 1).await;
    let (mut c, _, d) = login_erl(&server, vec![Digest::Crc32c], 1).await;
    assert!(d);
    // Immediate data damaged: the command stays, its data is asked for again.
    let good = pattern(4096, 50);
    let cmd = c.command(&rw10(0x2a, 16, 8), false, true, 4096, good.clone(), true);
    let itt = cmd.itt;
    send_damaged(&mut c, Pdu::ScsiCommand(cmd)).await;
    expect_reject(&mut c, 0x02).await;
    let r = expect_r2t(&mut c, itt).await;
    assert_eq!((r.buffer_offset, r.desired_data_transfer_length), (0, 4096));
    c.send(data_out(&r, 0, 0, good.clone(), true)).await;
    assert_eq!(c.read_result(itt).await.1, 0);

    // A Data-Out damaged in the middle of an R2T's burst: asked for again after the burst.
    let more = pattern(8192, 60);
    let cmd = c.command(&rw10(0x2a, 24, 16), false, true, 8192, Bytes::new(), true);
    let itt2 = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let r = expect_r2t(&mut c, itt2).await;
    assert_eq!((r.buffer_offset, r.desired_data_transfer_length), (0, 8192));
    send_damaged(&mut c, data_out(&r, 0, 0, more.slice(..4096), false)).await;
    expect_reject(&mut c, 0x02).await;
    c.send(data_out(&r, 1, 4096, more.slice(4096..), true))
        .await;
    let again = expect_r2t(&mut c, itt2).await;
    assert_eq!(
        (
            again.buffer_offset,
            again.desired_data_transfer_length,
            again.r2t_sn
        ),
        (0, 4096, 1)
    );
    assert_ne!(again.ttt, r.ttt);
    c.send(data_out(&again, 0, 0, more.slice(..4096), true))
        .await;
    assert_eq!(c.read_result(itt2).await.1, 0);

    // Both writes reached the medium whole.
    let cmd = c.command(&rw10(0x28, 16, 24), true, false, 12288, Bytes::new(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (got, st, ..) = c.read_result(itt).await;
    assert_eq!(st, 0);
    assert_eq!(&got[..4096], &good[..]);
    assert_eq!(&got[4096..], &more[..]);
}
