#![allow(clippy::unwrap_used, clippy::expect_used)]
//! A hostile peer must neither crash the target nor disturb a well-behaved session: a good
//! session keeps doing verified WRITE/READ I/O while other connections send garbage, absurd
//! lengths, unknown opcodes, malformed logins, out-of-window commands, stray Data-Out and TMFs,
//! truncated PDUs, and hold hundreds of idle connections open.

mod common;

use bytes::Bytes;
use common::*;
use mcsi_proto::pdu::*;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Deterministic xorshift bytes, so a failure reproduces.
fn garbage(n: usize, mut seed: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

/// A raw 48-byte BHS: opcode byte, flags, TotalAHSLength (words), DataSegmentLength.
fn bhs(opcode: u8, flags: u8, ahs_words: u8, dsl: u32) -> Vec<u8> {
    let mut b = vec![0u8; 48];
    b[0] = opcode;
    b[1] = flags;
    b[4] = ahs_words;
    b[5..8].copy_from_slice(&dsl.to_be_bytes()[1..]);
    b[16..20].copy_from_slice(&0x1234u32.to_be_bytes());
    b
}

/// What the target did after `bytes` arrived on a fresh connection.
#[derive(Debug)]
struct Seen {
    reply: usize,
    closed: bool,
}

/// Sends `bytes` (ignoring write errors: the target may close early), optionally closes the
/// write side, and watches for up to 5 s whether the target answers and closes.
async fn probe(addr: SocketAddr, bytes: &[u8], shutdown_write: bool) -> Seen {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    if shutdown_write {
        let _ = s.shutdown().await;
    }
    let mut reply = 0;
    let mut tmp = vec![0u8; 65536];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut tmp)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                return Seen {
                    reply,
                    closed: true,
                }
            }
            Ok(Ok(n)) => reply += n,
            Err(_) => {
                return Seen {
                    reply,
                    closed: false,
                }
            }
        }
    }
}

fn login_req(csg: Stage, nsg: Stage, transit: bool, continue_: bool, data: Bytes) -> Pdu {
    Pdu::LoginRequest(LoginRequest {
        transit,
        continue_,
        csg,
        nsg,
        version_max: 0,
        version_min: 0,
        isid: Isid([0x80, 9, 9, 9, 9, 9]),
        tsih: 0,
        itt: 0,
        cid: 0,
        cmd_sn: 1,
        exp_stat_sn: 0,
        data,
    })
}

fn enc(p: &Pdu) -> Vec<u8> {
    p.encode(&Framing::default()).to_vec()
}

/// Sends login requests and returns the status of the Login Response that failed or completed
/// the login (transit), or None if the target closed or stayed silent without one.
async fn login_status(addr: SocketAddr, pdus: &[Pdu]) -> Option<(u8, u8)> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    for p in pdus {
        if s.write_all(&enc(p)).await.is_err() {
            break;
        }
    }
    let mut buf = bytes::BytesMut::new();
    let f = Framing {
        max_data_segment_length: 1 << 24,
        ..Framing::default()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // Skip responses that neither fail nor complete the login (answers to C-bit requests,
        // target-side stage steps) until a final status, a close, or the deadline.
        while let Ok(Some(p)) = decode(&mut buf, &f) {
            if let Pdu::LoginResponse(r) = p {
                if r.status_class != 0 || r.transit {
                    return Some((r.status_class, r.status_detail));
                }
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read_buf(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {}
            _ => return None,
        }
    }
}

/// The well-behaved session: write a pattern, read it back, compare, until `stop`.
/// Verified 4 KiB write-then-read rounds until `stop`; counts them in `done` and returns the
/// client with the longest wait between two rounds' ends (the session's worst stall).
async fn good_io(
    mut c: Client,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    seed: u8,
) -> (Client, Duration) {
    let mut i: u32 = 0;
    let mut last = Instant::now();
    let mut worst = Duration::ZERO;
    while !stop.load(Ordering::SeqCst) {
        let lba = 20_000 + (i % 512) * 8;
        let data = pattern(4096, seed.wrapping_add(i as u8));
        let cmd = c.command(&rw10(0x2a, lba, 8), false, true, 4096, data.clone(), true);
        let itt = cmd.itt;
        c.send(Pdu::ScsiCommand(cmd)).await;
        let (_, st, _, _, _) = c.read_result(itt).await;
        assert_eq!(st, 0, "good WRITE {i} at LBA {lba} failed");
        let cmd = c.command(&rw10(0x28, lba, 8), true, false, 4096, Bytes::new(), true);
        let itt = cmd.itt;
        c.send(Pdu::ScsiCommand(cmd)).await;
        let (got, st, _, _, _) = c.read_result(itt).await;
        assert_eq!(st, 0, "good READ {i} at LBA {lba} failed");
        assert_eq!(
            &got[..],
            &data[..],
            "good READ {i} at LBA {lba}: data differs"
        );
        i += 1;
        done.fetch_add(1, Ordering::SeqCst);
        worst = worst.max(last.elapsed());
        last = Instant::now();
    }
    (c, worst)
}

/// Byte-level attacks on fresh connections (no login). Each must end with the target closing
/// the connection (or at least not answering with anything but a login reject).
async fn raw_storm(addr: SocketAddr) {
    // 1. Random garbage (its first byte decides the "opcode").
    for seed in 1..=8u64 {
        let seen = probe(addr, &garbage(65536, seed), false).await;
        assert!(
            seen.closed,
            "garbage seed {seed}: target kept the connection: {seen:?}"
        );
    }
    // 2. A Login Request BHS declaring a 16 MiB - 1 data segment (0xffffff), nothing behind.
    let seen = probe(addr, &bhs(0x43, 0x87, 0, 0x00ff_ffff), false).await;
    assert!(seen.closed, "DSL 0xffffff: {seen:?}");
    // 3. Same with 16 MiB of the declared length actually streamed (first 1 MiB only).
    let mut b = bhs(0x43, 0x87, 0, 0x00ff_ffff);
    b.extend(garbage(1 << 20, 99));
    let seen = probe(addr, &b, false).await;
    assert!(seen.closed, "DSL 0xffffff + 1 MiB: {seen:?}");
    // 4. The maximum TotalAHSLength (255 words = 1020 bytes) on a Login and a SCSI Command.
    for op in [0x43u8, 0x01] {
        let mut b = bhs(op, 0x80, 255, 0);
        b.extend(garbage(1020, 5));
        let seen = probe(addr, &b, false).await;
        assert!(seen.closed, "AHS 255 words, opcode {op:#x}: {seen:?}");
    }
    // 5. Unknown / target-only opcodes before login.
    for op in [0x1fu8, 0x3c, 0x3f, 0x20, 0x21, 0x23, 0x25] {
        let seen = probe(addr, &bhs(op, 0x80, 0, 0), false).await;
        assert!(seen.closed, "opcode {op:#x} before login: {seen:?}");
    }
    // 6. Initiator PDUs that need full feature phase, before login.
    let mut scsi = bhs(0x01, 0xc0, 0, 0);
    scsi[32] = 0x28;
    for b in [
        scsi,
        bhs(0x00, 0x80, 0, 0), // NOP-Out
        bhs(0x02, 0x81, 0, 0), // TMF ABORT TASK
        bhs(0x04, 0x80, 0, 0), // Text
        bhs(0x05, 0x80, 0, 0), // Data-Out
        bhs(0x06, 0x80, 0, 0), // Logout
        bhs(0x10, 0x80, 0, 0), // SNACK
    ] {
        let seen = probe(addr, &b, false).await;
        assert!(seen.closed, "opcode {:#x} before login: {seen:?}", b[0]);
    }
    // 7. Truncated PDUs followed by close (the write side is shut down).
    let full = enc(&login_req(
        Stage::Operational,
        Stage::FullFeature,
        true,
        false,
        text(&[("InitiatorName", "iqn.2026-01.org.mcsi:h")]),
    ));
    for cut in [1, 20, 47, 48, 60, full.len() - 1] {
        let seen = probe(addr, &full[..cut], true).await;
        assert!(seen.closed, "truncated at {cut}: {seen:?}");
        assert_eq!(
            seen.reply, 0,
            "truncated at {cut}: the target answered a partial PDU"
        );
    }
}

/// Malformed logins: each gets a login reject (status class 2) or a close, never success.
async fn login_storm(addr: SocketAddr) {
    let iname = ("InitiatorName", "iqn.2026-01.org.mcsi:hostile");
    let tname = ("TargetName", IQN);
    // Thousands of keys, sent as a text segment continued over many PDUs (C bit).
    let mut keys = String::new();
    for i in 0..6000 {
        keys.push_str(&format!("X-org.hostile.k{i}=v{i}\0"));
    }
    let mut pdus = Vec::new();
    let chunks: Vec<&[u8]> = keys.as_bytes().chunks(8192).collect();
    for (i, c) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        pdus.push(login_req(
            Stage::Operational,
            Stage::FullFeature,
            last,
            !last,
            Bytes::copy_from_slice(c),
        ));
    }
    let st = login_status(addr, &pdus).await;
    assert!(st.is_none_or(|s| s.0 != 0), "6000 keys: {st:?}");
    // A single 8 KiB segment of 1000 distinct unknown keys in one PDU.
    let many: Vec<(String, String)> = (0..1000)
        .map(|i| (format!("X-h{i}"), "1".to_string()))
        .collect();
    let mut data = mcsi_proto::text::encode(&many).to_vec();
    data.truncate(8192);
    let st = login_status(
        addr,
        &[login_req(
            Stage::Operational,
            Stage::FullFeature,
            true,
            false,
            Bytes::from(data),
        )],
    )
    .await;
    assert!(st.is_none_or(|s| s.0 != 0), "1000 keys: {st:?}");
    // A huge value.
    let huge = "a".repeat(8000);
    let st = login_status(
        addr,
        &[login_req(
            Stage::Operational,
            Stage::FullFeature,
            true,
            false,
            text(&[("InitiatorName", &huge), tname]),
        )],
    )
    .await;
    assert!(st.is_none_or(|s| s.0 != 0), "huge InitiatorName: {st:?}");
    // Invalid UTF-8 in key and value, no '=' at all, no NUL terminator.
    for raw in [
        &b"InitiatorName=iqn.2026-01.org.mcsi:\xff\xfe\0TargetName=x\0"[..],
        &b"\xc3\x28=1\0"[..],
        &b"InitiatorNameiqn\0"[..],
        &b"InitiatorName=iqn.2026-01.org.mcsi:x"[..],
        &b"=\0=\0=\0"[..],
        &b"\0\0\0\0"[..],
    ] {
        let st = login_status(
            addr,
            &[login_req(
                Stage::Operational,
                Stage::FullFeature,
                true,
                false,
                Bytes::copy_from_slice(raw),
            )],
        )
        .await;
        assert!(st.is_none_or(|s| s.0 != 0), "segment {raw:?}: {st:?}");
    }
    // Repeated keys (RFC 7143 6.1: a key sent twice is a protocol error).
    for dup in [
        vec![iname, iname, tname],
        vec![
            iname,
            tname,
            ("HeaderDigest", "None"),
            ("HeaderDigest", "CRC32C"),
        ],
        vec![
            iname,
            tname,
            ("MaxBurstLength", "512"),
            ("MaxBurstLength", "16777215"),
        ],
    ] {
        let st = login_status(
            addr,
            &[login_req(
                Stage::Operational,
                Stage::FullFeature,
                true,
                false,
                text(&dup),
            )],
        )
        .await;
        assert!(st.is_none_or(|s| s.0 != 0), "repeated keys {dup:?}: {st:?}");
    }
    // Wrong stages: CSG full feature, transit backwards, transit to the reserved stage 2
    // (encoded as a raw byte: flags T=1, CSG=1, NSG=2).
    let ok = text(&[iname, tname]);
    for (csg, nsg) in [
        (Stage::FullFeature, Stage::FullFeature),
        (Stage::Operational, Stage::Security),
    ] {
        let st = login_status(addr, &[login_req(csg, nsg, true, false, ok.clone())]).await;
        assert!(
            st.is_none_or(|s| s.0 != 0),
            "stages {csg:?}->{nsg:?}: {st:?}"
        );
    }
    let mut raw = enc(&login_req(
        Stage::Operational,
        Stage::FullFeature,
        true,
        false,
        ok.clone(),
    ));
    raw[1] = 0x80 | (1 << 2) | 2;
    let seen = probe(addr, &raw, false).await;
    assert!(seen.closed, "NSG 2: {seen:?}");
    // T and C both set is invalid (RFC 7143 11.12.2).
    let st = login_status(
        addr,
        &[login_req(
            Stage::Operational,
            Stage::FullFeature,
            true,
            true,
            ok.clone(),
        )],
    )
    .await;
    // A login that does not decode is answered with 2/00 (initiator error) before the close.
    assert_eq!(st, Some((2, 0)), "T+C");
    // So is one whose data segment exceeds the 8192 bytes allowed during login (12.12).
    let big = text(&[iname, tname, ("X-org.example.Pad", &"p".repeat(9000))]);
    let st = login_status(
        addr,
        &[login_req(
            Stage::Operational,
            Stage::FullFeature,
            true,
            false,
            big,
        )],
    )
    .await;
    assert_eq!(st, Some((2, 0)), "9000-byte login data segment");
}

/// A logged-in session misbehaves; the target may reject or drop it but must stay up.
async fn session_storm(server: &mcsi_target::Server) {
    let mut h = Client::normal_isid(server, [0x80, 7, 7, 7, 7, 7], &[]).await;
    // Data-Out for tasks that do not exist.
    for k in 0..50u32 {
        h.send(Pdu::DataOut(DataOut {
            final_: k % 2 == 0,
            lun: 0,
            itt: 0xdead_0000 + k,
            ttt: 0x5eed_0000 ^ k,
            exp_stat_sn: 0,
            data_sn: k,
            buffer_offset: k * 512,
            data: pattern(512, k as u8),
        }))
        .await;
    }
    // TMFs for random tags, every function code including reserved ones, except the resets
    // (5, 6, 7): those act on every nexus by design (SAM-5 5.7, RFC 7143 11.5.1), so a logged-in
    // initiator may legitimately disturb others with them; access control is the defence.
    for k in 0..64u32 {
        let function = match (k % 16) as u8 {
            5..=7 => 1,
            f => f,
        };
        let itt = h.next_itt();
        h.send(Pdu::TaskMgmtRequest(TaskMgmtRequest {
            immediate: true,
            function,
            lun: u64::from(k) << 48,
            itt,
            referenced_task_tag: garbage(4, u64::from(k) + 7)
                .iter()
                .fold(0u32, |a, &b| (a << 8) | u32::from(b)),
            cmd_sn: h.cmd_sn,
            exp_stat_sn: 0,
            ref_cmd_sn: k.wrapping_mul(0x9e37_79b9),
            exp_data_sn: 0,
        }))
        .await;
    }
    // Commands far outside the CmdSN window (they must be dropped, RFC 7143 3.2.2.1).
    for off in [1_000_000u32, 0x8000_0000, 0xffff_0000] {
        let mut cmd = h.command(&rw10(0x28, 0, 1), true, false, 512, Bytes::new(), true);
        h.cmd_sn -= 1;
        cmd.cmd_sn = cmd.cmd_sn.wrapping_add(off);
        h.send(Pdu::ScsiCommand(cmd)).await;
    }
    // An unknown opcode in full feature phase.
    let _ = h.s.write_all(&bhs(0x1e, 0x80, 0, 0)).await;
    let _ = h.s.write_all(&bhs(0x1d, 0x80, 0, 0)).await;
    // Collect what comes back until a second of quiet (or a close), then check the session is
    // still consistent: the dropped out-of-window commands used no CmdSN, so the next one runs.
    let mut seen = std::collections::BTreeMap::<String, u32>::new();
    let mut closed = false;
    loop {
        match tokio::time::timeout(Duration::from_secs(1), h.s.read_buf(&mut h.buf)).await {
            Err(_) => break,
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed = true;
                break;
            }
            Ok(Ok(_)) => {}
        }
        let f = h.framing;
        while let Some(p) = decode(&mut h.buf, &f).unwrap() {
            let name = format!("{:?}", p.opcode());
            let name = match &p {
                Pdu::Reject(r) => format!("{name}(reason {:#04x})", r.reason),
                Pdu::TaskMgmtResponse(r) => format!("{name}(response {})", r.response),
                _ => name,
            };
            *seen.entry(name).or_default() += 1;
        }
    }
    println!("hostile session got {seen:?}, closed by target: {closed}");
    if !closed {
        let tur = h.command(&[0; 6], false, false, 0, Bytes::new(), true);
        let itt = tur.itt;
        h.send(Pdu::ScsiCommand(tur)).await;
        let (_, st, _, _, _) = h.read_result(itt).await;
        assert_eq!(st, 0, "the hostile session's next in-window command");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_peers_do_not_disturb_a_good_session() {
    let t0 = Instant::now();
    // Hundreds of connections from one address in a second: without the login rate limit
    // (tests/limits.rs covers it), so that every attack reaches the login and PDU parsers.
    let server = start_with(|c| c.limits.login_rate = 0).await;
    let addr = server.local_addrs()[0];
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let good = Client::normal_isid(&server, [0x80, 1, 1, 1, 1, 1], &[]).await;
    let good = tokio::spawn(good_io(good, stop.clone(), done.clone(), 3));

    // 300 idle connections: 150 stopped mid-login (one non-final Login Request answered, never
    // continued), 150 fully logged in and then silent.
    let mut idle = Vec::new();
    for i in 0..150u16 {
        let mut c = Client::connect(&server).await;
        c.send(login_req(
            Stage::Operational,
            Stage::FullFeature,
            false,
            false,
            text(&[
                ("InitiatorName", "iqn.2026-01.org.mcsi:idle"),
                ("TargetName", IQN),
            ]),
        ))
        .await;
        let Pdu::LoginResponse(r) = c.recv().await else {
            panic!("mid-login idle {i}: not a login response")
        };
        assert_eq!(r.status_class, 0, "mid-login idle {i}");
        idle.push(c);
    }
    for i in 0..150u16 {
        let isid = [0x80, 0x40, 0, 0, (i >> 8) as u8, i as u8];
        let mut c = Client::connect(&server).await;
        let r = c
            .login(
                isid,
                0,
                0,
                &[("TargetName", IQN), ("SessionType", "Normal")],
            )
            .await;
        assert_eq!(
            (r.status_class, r.status_detail),
            (0, 0),
            "idle session {i} login"
        );
        idle.push(c);
    }
    let mut rounds = vec![("idle setup", done.load(Ordering::SeqCst), t0.elapsed())];
    let mark = |rounds: &mut Vec<_>, phase| {
        rounds.push((phase, done.load(Ordering::SeqCst), t0.elapsed()));
    };
    raw_storm(addr).await;
    mark(&mut rounds, "raw storm");
    login_storm(addr).await;
    mark(&mut rounds, "login storm");
    session_storm(&server).await;
    mark(&mut rounds, "session storm");

    // The good session kept going during all of it: rounds during every phase that lasted
    // 200 ms or more, and no stall of 2 s (one round takes well under a millisecond on loopback
    // and the worst wait is about 10 ms here; a phase can be over in a few milliseconds when
    // the machine is quiet, too short to ask for a round).
    stop.store(true, Ordering::SeqCst);
    let (good, worst) = tokio::time::timeout(Duration::from_secs(10), good)
        .await
        .expect("good session stalled")
        .expect("good session's I/O failed");
    let (mut before, mut since) = (0, Duration::ZERO);
    for (phase, n, at) in &rounds {
        let took = *at - since;
        println!(
            "good session: {} rounds during the {phase} ({took:?})",
            n - before
        );
        assert!(
            *n > before || took < Duration::from_millis(200),
            "the good session did no I/O during the {phase} ({took:?})"
        );
        (before, since) = (*n, *at);
    }
    println!("good session: longest wait between rounds {worst:?}");
    assert!(
        worst < Duration::from_secs(2),
        "the good session stalled for {worst:?}"
    );
    drop(good);

    // With the 300 idle connections still open, a new session logs in and does I/O.
    let mut fresh = Client::normal_isid(&server, [0x80, 2, 2, 2, 2, 2], &[]).await;
    let data = pattern(8192, 77);
    let cmd = fresh.command(&rw10(0x2a, 4000, 16), false, true, 8192, data.clone(), true);
    let itt = cmd.itt;
    fresh.send(Pdu::ScsiCommand(cmd)).await;
    assert_eq!(fresh.read_result(itt).await.1, 0);
    let cmd = fresh.command(&rw10(0x28, 4000, 16), true, false, 8192, Bytes::new(), true);
    let itt = cmd.itt;
    fresh.send(Pdu::ScsiCommand(cmd)).await;
    let (got, st, _, _, _) = fresh.read_result(itt).await;
    assert_eq!(st, 0);
    assert_eq!(&got[..], &data[..]);
    drop(idle);
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t0.elapsed()
    );
}

/// Why the storm leaves out the reset functions: a LOGICAL UNIT RESET from any session reaches
/// every other nexus as a unit attention (SAM-5 6.3.3, ASC 29h), which is correct, and a
/// well-behaved initiator retries the command.
#[tokio::test]
async fn lu_reset_from_another_session_is_a_unit_attention_elsewhere() {
    let server = start(|_| {}).await;
    let mut good = Client::normal_isid(&server, [0x80, 1, 1, 1, 1, 1], &[]).await;
    let mut other = Client::normal_isid(&server, [0x80, 6, 6, 6, 6, 6], &[]).await;
    let itt = other.next_itt();
    other
        .send(Pdu::TaskMgmtRequest(TaskMgmtRequest {
            immediate: true,
            function: 5,
            lun: 0,
            itt,
            referenced_task_tag: RESERVED_TAG,
            cmd_sn: other.cmd_sn,
            exp_stat_sn: 0,
            ref_cmd_sn: 0,
            exp_data_sn: 0,
        }))
        .await;
    let Pdu::TaskMgmtResponse(r) = other.recv().await else {
        panic!("expected a TMF response")
    };
    assert_eq!(r.response, 0, "LU RESET done");
    let tur = good.command(&[0; 6], false, false, 0, Bytes::new(), true);
    let itt = tur.itt;
    good.send(Pdu::ScsiCommand(tur)).await;
    let Pdu::ScsiResponse(r) = good.recv().await else {
        panic!("expected a SCSI Response")
    };
    assert_eq!((r.itt, r.status), (itt, 2));
    let sense = &r.sense[..];
    assert!(sense.len() >= 14, "sense data: {sense:02x?}");
    assert_eq!(
        (sense[2] & 0x0f, sense[12]),
        (6, 0x29),
        "UNIT ATTENTION, reset occurred"
    );
    let tur = good.command(&[0; 6], false, false, 0, Bytes::new(), true);
    let itt = tur.itt;
    good.send(Pdu::ScsiCommand(tur)).await;
    assert_eq!(good.read_result(itt).await.1, 0, "the retry succeeds");
}

/// CLEAR TASK SET aborts every initiator's tasks on the LU; with TAS 0 their statuses are not
/// sent, so each other nexus that lost tasks is told by a unit attention, COMMANDS CLEARED BY
/// ANOTHER INITIATOR (2Fh/00h, SAM-5 7.5). A nexus that had no task there, and the requester,
/// get none.
#[tokio::test]
async fn clear_task_set_is_a_unit_attention_for_the_nexuses_it_cleared() {
    let server = start(|_| {}).await;
    let mut victim = Client::normal_isid(&server, [0x80, 1, 1, 1, 1, 1], &[]).await;
    let mut bystander = Client::normal_isid(&server, [0x80, 2, 2, 2, 2, 2], &[]).await;
    let mut clearer = Client::normal_isid(&server, [0x80, 6, 6, 6, 6, 6], &[]).await;
    // The victim's WRITE waits for its data: a task in the LU's task set.
    let w = victim.command(&rw10(0x2a, 100, 16), false, true, 8192, Bytes::new(), true);
    victim.send(Pdu::ScsiCommand(w)).await;
    assert!(
        matches!(victim.recv().await, Pdu::R2t(_)),
        "expected an R2T"
    );
    let itt = clearer.next_itt();
    clearer
        .send(Pdu::TaskMgmtRequest(TaskMgmtRequest {
            immediate: true,
            function: 4,
            lun: 0,
            itt,
            referenced_task_tag: RESERVED_TAG,
            cmd_sn: clearer.cmd_sn,
            exp_stat_sn: 0,
            ref_cmd_sn: 0,
            exp_data_sn: 0,
        }))
        .await;
    let Pdu::TaskMgmtResponse(r) = clearer.recv().await else {
        panic!("expected a TMF response")
    };
    assert_eq!(r.response, 0, "CLEAR TASK SET done");
    async fn tur(c: &mut Client) -> (u8, Vec<u8>) {
        let tur = c.command(&[0; 6], false, false, 0, Bytes::new(), true);
        let itt = tur.itt;
        c.send(Pdu::ScsiCommand(tur)).await;
        loop {
            match c.recv().await {
                Pdu::ScsiResponse(r) if r.itt == itt => return (r.status, r.sense.to_vec()),
                // Nothing of the aborted WRITE may come (TAS 0).
                Pdu::ScsiResponse(r) => panic!("a status for aborted task {:#x}", r.itt),
                _ => {}
            }
        }
    }
    let (st, sense) = tur(&mut victim).await;
    assert_eq!(st, 2, "the victim's next command: CHECK CONDITION");
    assert_eq!(
        (sense[2] & 0x0f, sense[12], sense[13]),
        (6, 0x2f, 0x00),
        "UNIT ATTENTION, COMMANDS CLEARED BY ANOTHER INITIATOR: {sense:02x?}"
    );
    assert_eq!(tur(&mut victim).await.0, 0, "reported once");
    assert_eq!(tur(&mut bystander).await.0, 0, "no task was cleared there");
    assert_eq!(tur(&mut clearer).await.0, 0, "the requester knows");
}
