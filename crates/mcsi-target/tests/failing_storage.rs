#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Failing storage behind a running target, over real sockets. LUN 0 of the target is a
//! `FailingBackend` (given to the server as an opened backend, `LunBackend::Opened`), LUN 1 a
//! healthy RAM disk. A backend error must reach the initiator as CHECK CONDITION, MEDIUM ERROR
//! with the failed LBA in the sense data's INFORMATION field: WRITE ERROR (0C/00) for writes,
//! UNRECOVERED READ ERROR (11/00) for reads (SBC-4 4.18, SPC-5 4.4.3). Nothing may be
//! acknowledged GOOD that was not written, a FUA write whose flush failed included, and the
//! other LUN and other sessions keep serving verified I/O meanwhile. Writes take both of the
//! target's paths: all-immediate data (run on the connection's reader) and R2T-solicited data
//! (a task of its own). Each test runs twice: on the synchronous device path and on the
//! asynchronous one.

mod common;

use bytes::Bytes;
use common::*;
use mcsi_proto::pdu::*;
use mcsi_scsi::backend::{open_backend, AioRamBackend, Backend, FailingBackend};
use mcsi_target::config::LunSpec;
use mcsi_target::Server;
use std::collections::HashMap;
use std::sync::Arc;

const GOOD: u8 = 0x00;
const CHECK_CONDITION: u8 = 0x02;
const MEDIUM_ERROR: u8 = 0x03;

struct Rig {
    server: Server,
    failing: Arc<FailingBackend>,
    /// LUN 0's store when it is on the asynchronous path.
    aio: Option<Arc<AioRamBackend>>,
}

/// LUN 0 on a failing RAM backend (healthy until told otherwise), LUN 1 on a plain one. With
/// `aio`, LUN 0's RAM sits behind a completion thread, so its reads, writes and flushes take the
/// asynchronous device path.
async fn rig(aio: bool) -> Rig {
    let aio =
        aio.then(|| Arc::new(AioRamBackend::new(4 << 20, std::time::Duration::ZERO).unwrap()));
    let inner: Arc<dyn Backend> = match &aio {
        Some(a) => a.clone(),
        None => open_backend("ram:4MiB").unwrap(),
    };
    let failing = Arc::new(FailingBackend::new(inner, u64::MAX));
    let lun0 = LunSpec::new(failing.clone() as Arc<dyn Backend>);
    let server = start_with(|c| c.targets[0].luns = vec![lun0, LunSpec::new("ram:4MiB")]).await;
    Rig {
        server,
        failing,
        aio,
    }
}

/// A session with immediate data allowed and unsolicited data possible, unit attentions of
/// both LUNs cleared.
async fn session(server: &Server, isid: [u8; 6]) -> Client {
    let keys = [("ImmediateData", "Yes"), ("InitialR2T", "No")];
    let mut c = Client::normal_isid(server, isid, &keys).await;
    for _ in 0..3 {
        if exec(&mut c, 1, &[0; 6], None, 0).await.status == GOOD {
            break;
        }
    }
    c
}

/// How a write's data goes to the target.
#[derive(Debug, Clone, Copy)]
enum Out {
    /// All of it as immediate data in the command PDU.
    Immediate,
    /// None in the command: the target asks for it with an R2T.
    Solicited,
}

#[derive(Debug)]
struct Done {
    data: Vec<u8>,
    status: u8,
    sense: Bytes,
}

fn command(
    c: &mut Client,
    lun: u16,
    cdb: &[u8],
    write: Option<(&Bytes, Out)>,
    read_len: u32,
) -> ScsiCommand {
    let mut cmd = match write {
        Some((d, Out::Immediate)) => c.command(cdb, false, true, d.len() as u32, d.clone(), true),
        Some((d, Out::Solicited)) => {
            c.command(cdb, false, true, d.len() as u32, Bytes::new(), true)
        }
        None => c.command(cdb, read_len > 0, false, read_len, Bytes::new(), true),
    };
    cmd.lun = mcsi_scsi::lun::encode(lun);
    cmd
}

/// Waits for the end of task `itt`, answering its R2Ts from `data_out`.
async fn finish(c: &mut Client, itt: u32, data_out: &Bytes) -> Done {
    let mut data = Vec::new();
    loop {
        match c.recv().await {
            Pdu::DataIn(d) if d.itt == itt => {
                data.extend_from_slice(&d.data);
                if let Some(status) = d.status {
                    let sense = Bytes::new();
                    return Done {
                        data,
                        status,
                        sense,
                    };
                }
            }
            Pdu::R2t(r) if r.itt == itt => {
                let o = r.buffer_offset as usize;
                let n = r.desired_data_transfer_length as usize;
                c.send(Pdu::DataOut(DataOut {
                    final_: true,
                    lun: r.lun,
                    itt,
                    ttt: r.ttt,
                    exp_stat_sn: 0,
                    data_sn: 0,
                    buffer_offset: r.buffer_offset,
                    data: data_out.slice(o..o + n),
                }))
                .await;
            }
            Pdu::ScsiResponse(r) if r.itt == itt => {
                return Done {
                    data,
                    status: r.status,
                    sense: r.sense,
                }
            }
            other => panic!("unexpected {other:?} while waiting for ITT {itt:#x}"),
        }
    }
}

async fn exec(
    c: &mut Client,
    lun: u16,
    cdb: &[u8],
    write: Option<(&Bytes, Out)>,
    read_len: u32,
) -> Done {
    let cmd = command(c, lun, cdb, write, read_len);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let data_out = write.map(|(d, _)| d.clone()).unwrap_or_default();
    finish(c, itt, &data_out).await
}

async fn write(c: &mut Client, lun: u16, lba: u32, data: &Bytes, how: Out) -> Done {
    let blocks = (data.len() / 512) as u16;
    exec(c, lun, &rw10(0x2a, lba, blocks), Some((data, how)), 0).await
}

async fn read(c: &mut Client, lun: u16, lba: u32, blocks: u16) -> Done {
    let len = u32::from(blocks) * 512;
    exec(c, lun, &rw10(0x28, lba, blocks), None, len).await
}

/// Fixed-format sense (SPC-5 4.4.3): (key, ASC, ASCQ, INFORMATION if VALID).
fn sense_fields(s: &[u8]) -> (u8, u8, u8, Option<u32>) {
    assert!(s.len() >= 14, "sense too short: {s:02x?}");
    assert_eq!(
        s[0] & 0x7f,
        0x70,
        "not current fixed-format sense: {s:02x?}"
    );
    let info = (s[0] & 0x80 != 0).then(|| u32::from_be_bytes([s[3], s[4], s[5], s[6]]));
    (s[2] & 0x0f, s[12], s[13], info)
}

/// The task ended in CHECK CONDITION with MEDIUM ERROR `asc`/00 at `lba`, and without data.
fn assert_medium_error(d: &Done, asc: u8, lba: u32, what: &str) {
    assert_eq!(d.status, CHECK_CONDITION, "{what}: status");
    assert!(d.data.is_empty(), "{what}: data came with a failed command");
    assert_eq!(
        sense_fields(&d.sense),
        (MEDIUM_ERROR, asc, 0x00, Some(lba)),
        "{what}: sense (key, ASC, ASCQ, LBA)"
    );
}

/// A write of a fresh pattern to the healthy LUN 1 and its read back.
async fn verified_io(c: &mut Client, lba: u32, seed: u8) {
    let data = pattern(4096, seed);
    let w = write(c, 1, lba, &data, Out::Immediate).await;
    assert_eq!(w.status, GOOD, "LUN 1 write at {lba}");
    let r = read(c, 1, lba, 8).await;
    assert_eq!(r.status, GOOD, "LUN 1 read at {lba}");
    assert_eq!(&r.data[..], &data[..], "LUN 1 data at {lba}");
}

#[tokio::test]
async fn failed_writes_are_medium_errors_and_only_good_writes_persist() {
    failed_writes_are_medium_errors_and_only_good_writes_persist_on(false).await;
}

#[tokio::test]
async fn failed_writes_are_medium_errors_and_only_good_writes_persist_on_the_asynchronous_path() {
    failed_writes_are_medium_errors_and_only_good_writes_persist_on(true).await;
}

async fn failed_writes_are_medium_errors_and_only_good_writes_persist_on(aio: bool) {
    let r = rig(aio).await;
    let mut a = session(&r.server, [0x80, 0, 0, 0, 0, 1]).await;
    let mut b = session(&r.server, [0x80, 0, 0, 0, 0, 2]).await;
    // What LUN 0 should hold at the end: LBA -> data.
    let mut expect: HashMap<u32, Bytes> = HashMap::new();

    // One write at a time, the storage failing for some: each path, failing and not.
    for i in 0..16u32 {
        let lba = 64 * i;
        let old = pattern(4096, i as u8);
        assert_eq!(
            write(&mut a, 0, lba, &old, Out::Immediate).await.status,
            GOOD
        );
        expect.insert(lba, old);
        let how = if i % 2 == 0 {
            Out::Immediate
        } else {
            Out::Solicited
        };
        let fail = matches!(i % 4, 1 | 2);
        if fail {
            r.failing.fail_after(0);
        }
        let new = pattern(4096, 100 + i as u8);
        let d = write(&mut a, 0, lba, &new, how).await;
        r.failing.heal();
        if fail {
            assert_medium_error(&d, 0x0c, lba, &format!("{how:?} write {i}"));
            // The same session on the other LUN, and another session, go on.
            verified_io(&mut a, 8 * i, i as u8).await;
            verified_io(&mut b, 1024 + 8 * i, 50 + i as u8).await;
        } else {
            assert_eq!(d.status, GOOD, "{how:?} write {i}");
            expect.insert(lba, new);
        }
    }

    // Twelve writes in flight when the storage gives out after five operations (a write
    // without FUA under the write cache is one backend write).
    let lbas: Vec<u32> = (0..12).map(|i| 4096 + 16 * i).collect();
    for (i, &lba) in lbas.iter().enumerate() {
        let old = pattern(4096, 200 + i as u8);
        assert_eq!(
            write(&mut a, 0, lba, &old, Out::Immediate).await.status,
            GOOD
        );
        expect.insert(lba, old);
    }
    r.failing.fail_after(5);
    let mut sent = HashMap::new();
    for (i, &lba) in lbas.iter().enumerate() {
        let new = pattern(4096, 150 + i as u8);
        let cmd = command(
            &mut a,
            0,
            &rw10(0x2a, lba, 8),
            Some((&new, Out::Immediate)),
            0,
        );
        sent.insert(cmd.itt, (lba, new));
        a.send(Pdu::ScsiCommand(cmd)).await;
    }
    let mut good = 0;
    for _ in 0..lbas.len() {
        let Pdu::ScsiResponse(resp) = a.recv().await else {
            panic!("expected a SCSI Response")
        };
        let (lba, new) = sent
            .remove(&resp.itt)
            .expect("a response for a command sent");
        let d = Done {
            data: Vec::new(),
            status: resp.status,
            sense: resp.sense,
        };
        if d.status == GOOD {
            good += 1;
            expect.insert(lba, new);
        } else {
            assert_medium_error(&d, 0x0c, lba, &format!("write in flight at {lba}"));
        }
    }
    r.failing.heal();
    assert_eq!(good, 5, "GOOD for exactly the writes the storage took");
    verified_io(&mut b, 2048, 7).await;

    // Read back from the other session: exactly the writes that got GOOD are there.
    for (lba, data) in &expect {
        let d = read(&mut b, 0, *lba, 8).await;
        assert_eq!(d.status, GOOD, "read back at {lba}");
        assert_eq!(&d.data[..], &data[..], "LUN 0 at LBA {lba}");
    }
    // The failing session is still up.
    verified_io(&mut a, 3000, 9).await;
    // On the asynchronous path the writes and reads went through its queue (one operation
    // each at least), not through the synchronous calls.
    if let Some(q) = &r.aio {
        assert!(q.submitted() >= 16 + 5, "{} operations", q.submitted());
    }
}

#[tokio::test]
async fn failed_read_is_an_unrecovered_read_error_with_the_lba() {
    failed_read_is_an_unrecovered_read_error_with_the_lba_on(false).await;
}

#[tokio::test]
async fn failed_read_is_an_unrecovered_read_error_with_the_lba_on_the_asynchronous_path() {
    failed_read_is_an_unrecovered_read_error_with_the_lba_on(true).await;
}

async fn failed_read_is_an_unrecovered_read_error_with_the_lba_on(aio: bool) {
    let r = rig(aio).await;
    let mut a = session(&r.server, [0x80, 0, 0, 0, 0, 1]).await;
    let mut b = session(&r.server, [0x80, 0, 0, 0, 0, 2]).await;
    let data = pattern(8192, 33);
    assert_eq!(
        write(&mut a, 0, 300, &data, Out::Immediate).await.status,
        GOOD
    );

    r.failing.fail_after(0);
    let d = read(&mut a, 0, 300, 16).await;
    assert_medium_error(&d, 0x11, 300, "read in session A");
    // Another session sees the same medium error: it is the storage, not the session.
    let d = read(&mut b, 0, 304, 4).await;
    assert_medium_error(&d, 0x11, 304, "read in session B");
    // The other LUN serves both sessions meanwhile.
    verified_io(&mut a, 0, 1).await;
    verified_io(&mut b, 64, 2).await;
    assert!(r.failing.failures() >= 2);

    r.failing.heal();
    let d = read(&mut a, 0, 300, 16).await;
    assert_eq!(d.status, GOOD);
    assert_eq!(&d.data[..], &data[..], "the data survived the failed reads");
}

#[tokio::test]
async fn fua_write_whose_flush_fails_is_not_acknowledged() {
    fua_write_whose_flush_fails_is_not_acknowledged_on(false).await;
}

#[tokio::test]
async fn fua_write_whose_flush_fails_is_not_acknowledged_on_the_asynchronous_path() {
    fua_write_whose_flush_fails_is_not_acknowledged_on(true).await;
}

async fn fua_write_whose_flush_fails_is_not_acknowledged_on(aio: bool) {
    let r = rig(aio).await;
    let mut a = session(&r.server, [0x80, 0, 0, 0, 0, 1]).await;
    // WRITE (10) with FUA (SBC-4 5.40): GOOD promises the data is on the medium, so when the
    // data write succeeds but the flush behind it fails, the command must not report GOOD.
    // One backend operation is allowed (the data write); the flush is the one that fails.
    for how in [Out::Immediate, Out::Solicited] {
        let mut cdb = rw10(0x2a, 500, 8);
        cdb[1] = 0x08;
        let data = pattern(4096, 42);
        r.failing.fail_after(1);
        let d = exec(&mut a, 0, &cdb, Some((&data, how)), 0).await;
        r.failing.heal();
        assert_eq!(
            d.status, CHECK_CONDITION,
            "{how:?}: a FUA write whose flush failed was acknowledged"
        );
        let (key, asc, ascq, _) = sense_fields(&d.sense);
        assert_eq!((key, asc, ascq), (MEDIUM_ERROR, 0x0c, 0x00), "{how:?}");
    }
    assert_eq!(r.failing.failures(), 2);
}

#[tokio::test]
async fn failed_synchronize_cache_is_reported() {
    failed_synchronize_cache_is_reported_on(false).await;
}

#[tokio::test]
async fn failed_synchronize_cache_is_reported_on_the_asynchronous_path() {
    failed_synchronize_cache_is_reported_on(true).await;
}

async fn failed_synchronize_cache_is_reported_on(aio: bool) {
    let r = rig(aio).await;
    let mut a = session(&r.server, [0x80, 0, 0, 0, 0, 1]).await;
    let sync = [0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    r.failing.fail_after(0);
    let d = exec(&mut a, 0, &sync, None, 0).await;
    r.failing.heal();
    assert_eq!(
        d.status, CHECK_CONDITION,
        "a failed flush must not report GOOD"
    );
    assert_eq!(sense_fields(&d.sense).0, MEDIUM_ERROR);
    // LUN 1 flushes fine, and LUN 0 again once healed.
    assert_eq!(exec(&mut a, 1, &sync, None, 0).await.status, GOOD);
    assert_eq!(exec(&mut a, 0, &sync, None, 0).await.status, GOOD);
}
