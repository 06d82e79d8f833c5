//! Back-pressure: a peer that asks for data and never reads its socket cannot make the target
//! queue without end. Each connection's queued output is bounded by its output budget (the
//! reader stops taking requests at the budget, and TCP's flow control stops the peer); the
//! stuck connection is dropped by the keepalive or the send timeout; another session's
//! verified I/O goes on meanwhile.
//!
//! The target runs in this process, so the figures are this process's resident memory (the
//! clients hold a few hundred KiB).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;

use bytes::Bytes;
use mcsi_proto::pdu::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// The tests measure this process's memory: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const BUDGET: u64 = 8 << 20;
const READ_BUDGET: u64 = 32 << 20;
/// Allocator and runtime noise on top of the budget: reader buffers, per-PDU bookkeeping, freed
/// pages the allocator keeps.
const SLACK: u64 = 48 << 20;

fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap()
}

/// Samples the resident size every 5 ms until dropped; `peak()` is the largest seen.
struct RssWatch {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl RssWatch {
    fn start() -> RssWatch {
        let peak = Arc::new(AtomicU64::new(rss()));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(rss(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        RssWatch { peak, stop }
    }

    fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
}

impl Drop for RssWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The target's log (warnings and up) of this test process, kept to be searched.
fn log() -> &'static std::sync::Mutex<Vec<u8>> {
    static LOG: std::sync::OnceLock<&'static std::sync::Mutex<Vec<u8>>> =
        std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let buf: &'static std::sync::Mutex<Vec<u8>> =
            Box::leak(Box::new(std::sync::Mutex::new(Vec::new())));
        struct W(&'static std::sync::Mutex<Vec<u8>>);
        impl std::io::Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || W(buf))
            .try_init();
        buf
    })
}

/// Log lines so far that contain `what`.
fn log_count(what: &str) -> usize {
    String::from_utf8_lossy(&log().lock().unwrap())
        .lines()
        .filter(|l| l.contains(what))
        .count()
}

/// Waits up to 5 s for the `n`th log line containing `what`.
async fn logged(what: &str, n: usize) -> Option<String> {
    for _ in 0..50 {
        let text = String::from_utf8_lossy(&log().lock().unwrap()).into_owned();
        if let Some(line) = text.lines().filter(|l| l.contains(what)).nth(n - 1) {
            return Some(line.to_string());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// The share of its speed alone that another session must keep beside a hostile peer. Beside a
/// target that holds the peer to its budgets it keeps about all of it (0.9-1.1x measured); a
/// target stuck on the peer gives it next to nothing. A quarter leaves room for a busy 2-core
/// machine, where the peer's own traffic takes CPU.
const KEPT: f64 = 0.25;

/// The other session kept its pace beside the hostile peer: at least [`KEPT`] of its speed
/// alone, over at least 3 verified rounds.
fn kept_pace(alone: f64, during: f64, rounds: u64) {
    assert!(rounds >= 3, "the other session made {rounds} rounds");
    assert!(
        during >= KEPT * alone,
        "the other session slowed from {alone:.1} MB/s alone to {during:.1} MB/s ({:.2}x, floor {KEPT})",
        during / alone
    );
}

fn mib(n: u64) -> f64 {
    n as f64 / (1u64 << 20) as f64
}

/// Writes `bytes` again and again until `total` bytes went out or one write makes no progress
/// for `stall`; returns the bytes written.
async fn flood(c: &mut Client, bytes: &[u8], total: u64, stall: Duration) -> u64 {
    let mut sent = 0u64;
    while sent < total {
        match tokio::time::timeout(stall, c.s.write_all(bytes)).await {
            Ok(Ok(())) => sent += bytes.len() as u64,
            _ => break,
        }
    }
    sent
}

/// Verified I/O on its own session for `secs`: 256 KiB written at a rotating LBA, read back and
/// compared. Returns (rounds, MB/s).
async fn verified_io(server: &mcsi_target::Server, isid: u8, secs: f64) -> (u64, f64) {
    let mut c = Client::normal_isid(server, [0x80, 9, 9, 9, 9, isid], &[]).await;
    let t0 = Instant::now();
    let mut rounds = 0u64;
    while t0.elapsed().as_secs_f64() < secs {
        // The second 8 MiB of the LUN (the stuck peers below read the first).
        let lba = (16384 + (rounds % 32) * 512) as u32;
        let data = pattern(256 << 10, (rounds % 251) as u8);
        let w = c.command(
            &rw10(0x2a, lba, 512),
            false,
            true,
            256 << 10,
            Bytes::new(),
            true,
        );
        let itt = w.itt;
        c.send(Pdu::ScsiCommand(w)).await;
        // Answer the R2Ts (ImmediateData is not offered by this client).
        let mut sent = 0usize;
        loop {
            match c.recv().await {
                Pdu::R2t(r) => {
                    let off = r.buffer_offset as usize;
                    let len = r.desired_data_transfer_length as usize;
                    let mut done = 0usize;
                    let mut data_sn = 0;
                    while done < len {
                        let n = (len - done).min(8192);
                        c.send(Pdu::DataOut(DataOut {
                            final_: done + n == len,
                            lun: 0,
                            itt,
                            ttt: r.ttt,
                            exp_stat_sn: 0,
                            data_sn,
                            buffer_offset: (off + done) as u32,
                            data: data.slice(off + done..off + done + n),
                        }))
                        .await;
                        data_sn += 1;
                        done += n;
                    }
                    sent += len;
                }
                Pdu::ScsiResponse(r) => {
                    assert_eq!((r.itt, r.status), (itt, 0), "write failed");
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(sent, 256 << 10);
        let r = c.command(
            &rw10(0x28, lba, 512),
            true,
            false,
            256 << 10,
            Bytes::new(),
            true,
        );
        let itt = r.itt;
        c.send(Pdu::ScsiCommand(r)).await;
        let (back, status, ..) = c.read_result(itt).await;
        assert_eq!(status, 0);
        assert!(back[..] == data[..], "read back differs in round {rounds}");
        rounds += 1;
    }
    let mb = (rounds * 2 * (256 << 10)) as f64 / 1e6 / t0.elapsed().as_secs_f64();
    (rounds, mb)
}

fn server_limits(l: &mut mcsi_target::config::Limits) {
    l.output_budget = BUDGET;
    l.offer.nop_interval = Duration::from_secs(1);
    l.offer.nop_timeout = Duration::from_secs(1);
    l.send_timeout = Duration::from_secs(3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_reads_is_held_to_the_output_budget() {
    let _one = SERIAL.lock().await;
    log();
    const NO_ANSWER: &str = "no answer to the NOP-In ping within";
    let seen = log_count(NO_ANSWER);
    let server = start(server_limits).await;
    // Warm up the allocator and the runtime with the good client's own run.
    let (_, alone) = verified_io(&server, 1, 2.0).await;
    let before = rss();
    let watch = RssWatch::start();

    // 2 GiB of NOP-Outs, each asking for an echo of its 64 KiB of ping data.
    let mut stuck = Client::normal_isid(
        &server,
        [0x80, 7, 7, 7, 7, 7],
        &[("MaxRecvDataSegmentLength", "262144")],
    )
    .await;
    let nop = Pdu::NopOut(NopOut {
        immediate: true,
        lun: 0,
        itt: 0x1234,
        ttt: 0xffff_ffff,
        cmd_sn: stuck.cmd_sn,
        exp_stat_sn: 0,
        data: Bytes::from(vec![0x5a; 64 << 10]),
    })
    .encode(&Framing {
        max_data_segment_length: 262_144,
        ..Framing::default()
    })
    .to_vec();
    let flood_task = async { flood(&mut stuck, &nop, 2 << 30, Duration::from_secs(2)).await };
    let (sent, (rounds, during)) = tokio::join!(flood_task, verified_io(&server, 2, 4.0));
    let peak = watch.peak();
    println!(
        "NOP-Out flood: {:.1} MiB accepted of 2048 before the target stopped reading; resident {:.1} MiB before, {:.1} MiB peak (+{:.1} MiB; output budget {:.0} MiB)",
        mib(sent),
        mib(before),
        mib(peak),
        mib(peak.saturating_sub(before)),
        mib(BUDGET)
    );
    println!(
        "other session's verified I/O: {alone:.1} MB/s alone, {during:.1} MB/s beside the stuck peer ({rounds} rounds, {:.2}x)",
        during / alone
    );
    assert!(sent < 2 << 30, "the target read all 2 GiB");
    assert!(
        peak.saturating_sub(before) <= BUDGET + SLACK,
        "resident memory rose by {:.1} MiB",
        mib(peak - before)
    );
    kept_pace(alone, during, rounds);

    // The stuck connection is dropped (keepalive 1 s + 1 s, send timeout 3 s): reading what is
    // left ends in EOF.
    let t0 = Instant::now();
    assert!(
        stuck.closed_within(Duration::from_secs(10)).await,
        "the stuck connection was not dropped"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = rss();
    println!(
        "stuck connection closed {:.1} s after the flood stalled; resident {:.1} MiB after",
        t0.elapsed().as_secs_f64(),
        mib(after)
    );
    assert!(after.saturating_sub(before) <= BUDGET + SLACK);
    // The keepalive dropped it (1 s idle, 1 s to answer), and the log says why.
    let line = logged(NO_ANSWER, seen + 1)
        .await
        .expect("no log line for the dropped connection");
    println!("log: {line}");
    // The target still serves.
    let (n, _) = verified_io(&server, 3, 0.5).await;
    assert!(n > 0);
}

/// The whole CmdSN window of the largest READs the LU takes (8 MiB), never read: on a file LUN
/// (reads run as tasks, under the session's read budget) and on a RAM LUN (reads run on the
/// connection's reader, under its output budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_of_large_reads_not_read_is_bounded() {
    let _one = SERIAL.lock().await;
    let img = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
    // Real data, so that every read fills its buffer.
    std::fs::write(img.path(), pattern(32 << 20, 3)).unwrap();
    let file = format!("file:{}:32MiB", img.path().display());
    log();
    const SEND_TIMEOUT: &str = "send timeout: the initiator took no data for 3s";
    for spec in [file.as_str(), "ram:32MiB"] {
        // Lines logged before this case (another test's connections may have timed out too).
        let seen = log_count(SEND_TIMEOUT);
        let server = start_with(|cfg| {
            server_limits(&mut cfg.targets[0].limits);
            // No keepalive: the send timeout (3 s) drops the stuck connection.
            cfg.targets[0].limits.offer.nop_interval = Duration::ZERO;
            cfg.targets[0].limits.read_budget = READ_BUDGET;
            cfg.targets[0].luns = vec![mcsi_target::config::LunSpec::new(spec)];
        })
        .await;
        let (_, alone) = verified_io(&server, 1, 1.0).await;
        let before = rss();
        let watch = RssWatch::start();
        let mut stuck = Client::normal_isid(
            &server,
            [0x80, 7, 7, 7, 7, 8],
            &[("MaxRecvDataSegmentLength", "262144")],
        )
        .await;
        let mut wire = Vec::new();
        let mut itts = Vec::new();
        // All of the first 8 MiB, which the other session does not write.
        for _ in 0..128u32 {
            let r = stuck.command(
                &rw10(0x28, 0, 16384),
                true,
                false,
                8 << 20,
                Bytes::new(),
                true,
            );
            itts.push(r.itt);
            wire.extend_from_slice(&Pdu::ScsiCommand(r).encode(&stuck.framing).to_vec());
        }
        flood(&mut stuck, &wire, wire.len() as u64, Duration::from_secs(2)).await;
        let (rounds, during) = verified_io(&server, 2, 3.0).await;
        let peak = watch.peak();
        println!(
            "{spec}: 128 READs of 8 MiB, never read: resident {:.1} MiB before, {:.1} MiB peak (+{:.1} MiB; read budget {:.0} MiB, output budget {:.0} MiB; unbounded: 1024 MiB); other session {alone:.1} MB/s alone, {during:.1} MB/s beside it",
            mib(before),
            mib(peak),
            mib(peak.saturating_sub(before)),
            mib(READ_BUDGET),
            mib(BUDGET)
        );
        assert!(
            peak.saturating_sub(before) <= READ_BUDGET + BUDGET + (8 << 20) + SLACK,
            "resident memory rose by {:.1} MiB",
            mib(peak - before)
        );
        kept_pace(alone, during, rounds);
        // The socket took nothing for 3 s: the connection is dropped, and the log says so.
        let line = logged(SEND_TIMEOUT, seen + 1)
            .await
            .expect("no log line for the send timeout");
        println!("log: {line}");
        // What the sockets still hold starts
        // with a read's first data, and the right data (file reads may finish in any order).
        match stuck.try_recv().await {
            Some(Pdu::DataIn(d)) => {
                assert!(itts.contains(&d.itt), "{spec}: not a READ's ITT");
                assert_eq!(d.buffer_offset, 0, "{spec}");
                if spec.starts_with("file:") {
                    assert!(
                        d.data[..] == pattern(d.data.len(), 3)[..],
                        "{spec}: wrong data"
                    );
                }
            }
            other => panic!("{spec}: expected the first read's Data-In, got {other:?}"),
        }
        assert!(
            stuck.closed_within(Duration::from_secs(10)).await,
            "{spec}: the stuck connection was not dropped"
        );
    }
}

const ASYM: &str = "X-org.mcsi.Asymmetric";
const ROLE: &str = "X-org.mcsi.ConnectionRole";

/// An asymmetric session of its own: a request connection and a response connection (CID 1).
async fn asymmetric_pair(server: &mcsi_target::Server, isid: [u8; 6]) -> (Client, Client) {
    let a = Client::normal_isid(server, isid, &[(ASYM, "Yes"), (ROLE, "requests")]).await;
    let mut b = Client::connect(server).await;
    b.cmd_sn = a.cmd_sn;
    b.itt = 1 << 20;
    let r = b
        .login(isid, a.tsih, 1, &[("TargetName", IQN), (ROLE, "responses")])
        .await;
    assert_eq!(r.status_class, 0, "the response connection joins");
    (a, b)
}

/// `n` READ(10)s (`op` 0x28) or WRITE(10)s (0x2a) of 8 MiB at LBA 0, the largest the LU takes,
/// encoded back to back.
fn window_of_8mib(c: &mut Client, n: u32, op: u8) -> Vec<u8> {
    let mut wire = Vec::new();
    for _ in 0..n {
        let cmd = c.command(
            &rw10(op, 0, 16384),
            op == 0x28,
            op == 0x2a,
            8 << 20,
            Bytes::new(),
            true,
        );
        wire.extend_from_slice(&Pdu::ScsiCommand(cmd).encode(&c.framing).to_vec());
    }
    wire
}

/// What one hostile writer did ([`withholding_writer`]).
struct Withheld {
    client: Client,
    /// Data-Out bytes it sent.
    sent: u64,
    /// R2Ts it answered, and those it left unanswered (each one a write's last burst).
    answered: u32,
    withheld: u32,
}

/// Logs in on its own session, sends `n` WRITE(10)s of 8 MiB (the largest the LU takes) at
/// once, and answers every R2T with its Data-Out except those for a write's last burst, so that
/// no write ever completes. Returns once no R2T came for `stall`.
async fn withholding_writer(
    server: Arc<mcsi_target::Server>,
    isid: u8,
    n: u32,
    stall: Duration,
) -> Withheld {
    const LEN: u32 = 8 << 20;
    let mut c = Client::normal_isid(&server, [0x80, 7, 7, 7, 9, isid], &[]).await;
    let chunk = pattern(64 << 10, isid);
    let wire = window_of_8mib(&mut c, n, 0x2a);
    c.s.write_all(&wire).await.unwrap();
    let (mut sent, mut answered, mut withheld) = (0u64, 0u32, 0u32);
    while let Ok(p) = tokio::time::timeout(stall, c.recv_inner()).await {
        let Pdu::R2t(r) = p else {
            panic!("unexpected {p:?}")
        };
        let (off, len) = (r.buffer_offset, r.desired_data_transfer_length);
        if off + len == LEN {
            withheld += 1;
            continue;
        }
        let mut done = 0u32;
        let mut data_sn = 0;
        let mut out = Vec::new();
        while done < len {
            let k = (len - done).min(chunk.len() as u32);
            let d = Pdu::DataOut(DataOut {
                final_: done + k == len,
                lun: 0,
                itt: r.itt,
                ttt: r.ttt,
                exp_stat_sn: 0,
                data_sn,
                buffer_offset: off + done,
                data: chunk.slice(..k as usize),
            });
            out.extend_from_slice(&d.encode(&c.framing).to_vec());
            data_sn += 1;
            done += k;
        }
        c.s.write_all(&out).await.unwrap();
        sent += u64::from(len);
        answered += 1;
    }
    Withheld {
        client: c,
        sent,
        answered,
        withheld,
    }
}

/// A target for writers that stop sending: a 3 s Data-Out timeout (the stuck connections are
/// dropped within the test), no NOP-In pings (the writers do not answer them), then `f`.
async fn stalled_writers_server(
    f: impl FnOnce(&mut mcsi_target::config::ServerConfig),
) -> Arc<mcsi_target::Server> {
    Arc::new(
        start_with(|cfg| {
            let l = &mut cfg.targets[0].limits;
            l.data_out_timeout = Duration::from_secs(3);
            l.offer.nop_interval = Duration::ZERO;
            f(cfg);
        })
        .await,
    )
}

/// The write flood: sessions that fill the CmdSN window with 8 MiB WRITEs and withhold each
/// one's last burst hold no more than the write budgets (unbounded, 1 GiB per session), the
/// Data-Out timeout drops them, and the target then serves writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_whose_data_never_finishes_are_held_to_the_write_budgets() {
    let _one = SERIAL.lock().await;
    log();
    const SESSION_BUDGET: u64 = 32 << 20;
    const SERVER_BUDGET: u64 = 96 << 20;
    const NO_DATA: &str = "no Data-Out for a write in 3s";
    for sessions in [1u8, 8] {
        let seen = log_count(NO_DATA);
        let server = stalled_writers_server(|cfg| {
            cfg.limits.write_budget = SERVER_BUDGET;
            cfg.targets[0].limits.write_budget = SESSION_BUDGET;
        })
        .await;
        let (_, alone) = verified_io(&server, 1, 1.0).await;
        let before = rss();
        let watch = RssWatch::start();
        let t0 = Instant::now();
        let mut floods = tokio::task::JoinSet::new();
        for i in 0..sessions {
            floods.spawn(withholding_writer(
                server.clone(),
                i,
                128,
                Duration::from_millis(1500),
            ));
        }
        let writers = floods.join_all().await;
        let peak = watch.peak();
        let sent: u64 = writers.iter().map(|w| w.sent).sum();
        let answered: u32 = writers.iter().map(|w| w.answered).sum();
        let withheld: u32 = writers.iter().map(|w| w.withheld).sum();
        let bound = SESSION_BUDGET
            .saturating_mul(u64::from(sessions))
            .min(SERVER_BUDGET);
        println!(
            "{sessions} session(s) x 128 WRITEs of 8 MiB withholding each last burst: {answered} R2Ts answered ({:.1} MiB), {withheld} withheld, in {:.1} s; resident {:.1} MiB before, {:.1} MiB peak (+{:.1} MiB; write budgets {:.0} MiB per session, {:.0} MiB server-wide; unbounded: {} MiB)",
            mib(sent),
            t0.elapsed().as_secs_f64(),
            mib(before),
            mib(peak),
            mib(peak.saturating_sub(before)),
            mib(SESSION_BUDGET),
            mib(SERVER_BUDGET),
            u64::from(sessions) * 1024,
        );
        // Each granted write asked for all its bursts; only the budgets' worth were granted.
        assert_eq!(u64::from(withheld) * (8 << 20), bound, "writes granted");
        assert!(
            peak.saturating_sub(before) <= bound + SLACK,
            "resident memory rose by {:.1} MiB",
            mib(peak - before)
        );
        // The Data-Out timeout drops every stuck connection, and the log says why.
        for mut w in writers {
            assert!(
                w.client.closed_within(Duration::from_secs(10)).await,
                "a stuck writer was not dropped"
            );
        }
        let line = logged(NO_DATA, seen + 1)
            .await
            .expect("no log line for the Data-Out timeout");
        println!("log: {line}");
        let (rounds, after) = verified_io(&server, 2, 1.0).await;
        println!("other session: {alone:.1} MB/s before, {after:.1} MB/s after ({rounds} rounds)");
        assert!(rounds > 0);
    }
}

/// The asymmetric mode: commands on one connection, their replies on another that the peer
/// never reads. The request connection's reader stops once every response connection is at
/// its budget, so a window of 8 MiB READs of a RAM LUN (run on the reader) queues about one
/// budget on the response connection, not the whole window (1 GiB). RAM LUN reads are slices
/// of the LUN's memory, so the figure is the response connection's queue, not the process's
/// resident size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_on_a_response_connection_never_read_are_bounded() {
    let _one = SERIAL.lock().await;
    log();
    const SEND_TIMEOUT: &str = "send timeout: the initiator took no data for 3s";
    let seen = log_count(SEND_TIMEOUT);
    let server = start(|l| {
        server_limits(l);
        l.offer.nop_interval = Duration::ZERO;
        l.offer.asymmetric = true;
    })
    .await;
    let (_, alone) = verified_io(&server, 1, 1.0).await;
    let isid = [0x80, 7, 7, 7, 7, 10];
    let (mut a, b) = asymmetric_pair(&server, isid).await;
    let wire = window_of_8mib(&mut a, 128, 0x28);
    a.s.write_all(&wire).await.unwrap();
    // The stuck session's queues and commands taken, sampled for 2 s beside another session.
    let stuck = |snap: &[mcsi_target::stats::SessionSnapshot]| {
        snap.iter()
            .find(|s| s.isid == "80070707070a")
            .map(|s| {
                let queued = s
                    .connections
                    .iter()
                    .map(|c| c.queued_bytes)
                    .max()
                    .unwrap_or(0);
                let commands: u64 = s.connections.iter().map(|c| c.commands).sum();
                (queued, commands)
            })
            .unwrap_or((0, 0))
    };
    let sample = async {
        let (mut queued, mut commands) = (0u64, 0u64);
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(2) {
            let (q, c) = stuck(&server.snapshot());
            queued = queued.max(q);
            commands = commands.max(c);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (queued, commands)
    };
    let ((queued, commands), (rounds, during)) = tokio::join!(sample, verified_io(&server, 2, 2.0));
    println!(
        "asymmetric, responses never read: 128 READs of 8 MiB sent, {commands} run; at most {:.1} MiB queued on a connection (output budget {:.0} MiB; unbounded: 1024 MiB); other session {alone:.1} MB/s alone, {during:.1} MB/s beside it",
        mib(queued),
        mib(BUDGET)
    );
    assert!(
        queued <= BUDGET + (8 << 20) + (1 << 20),
        "{:.1} MiB queued",
        mib(queued)
    );
    assert!(commands < 128, "every READ ran: the reader did not stop");
    kept_pace(alone, during, rounds);
    // The response connection took nothing: the send timeout drops it, and with it the
    // session (ErrorRecoveryLevel 0).
    let line = logged(SEND_TIMEOUT, seen + 1)
        .await
        .expect("no log line for the send timeout");
    println!("log: {line}");
    let closed = a.closed_within(Duration::from_secs(10)).await;
    if !closed {
        println!("{}", String::from_utf8_lossy(&log().lock().unwrap()));
        println!("{:?}", server.snapshot());
    }
    assert!(closed, "the request connection outlived its session");
    drop(b);
}

/// The write flood in the asymmetric mode, with the response connection (where R2Ts go) never
/// read: no write can get its data, the granted ones hold at most the write budgets, and the
/// Data-Out timeout ends the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_flood_whose_r2ts_are_never_read_is_bounded() {
    let _one = SERIAL.lock().await;
    log();
    const SESSION_BUDGET: u64 = 32 << 20;
    let server = start(|l| {
        server_limits(l);
        l.offer.nop_interval = Duration::ZERO;
        l.offer.asymmetric = true;
        l.write_budget = SESSION_BUDGET;
        l.data_out_timeout = Duration::from_secs(3);
    })
    .await;
    let (_, alone) = verified_io(&server, 1, 1.0).await;
    let before = rss();
    let watch = RssWatch::start();
    let isid = [0x80, 7, 7, 7, 7, 11];
    let (mut a, b) = asymmetric_pair(&server, isid).await;
    let wire = window_of_8mib(&mut a, 128, 0x2a);
    a.s.write_all(&wire).await.unwrap();
    let (rounds, during) = verified_io(&server, 2, 2.0).await;
    let peak = watch.peak();
    println!(
        "asymmetric, R2Ts never read: 128 WRITEs of 8 MiB; resident {:.1} MiB before, {:.1} MiB peak (+{:.1} MiB; write budget {:.0} MiB per session); other session {alone:.1} MB/s alone, {during:.1} MB/s beside it",
        mib(before),
        mib(peak),
        mib(peak.saturating_sub(before)),
        mib(SESSION_BUDGET)
    );
    assert!(
        peak.saturating_sub(before) <= SESSION_BUDGET + SLACK,
        "resident memory rose by {:.1} MiB",
        mib(peak - before)
    );
    kept_pace(alone, during, rounds);
    // No Data-Out ever comes: the Data-Out timeout ends the connection and the session.
    assert!(
        a.closed_within(Duration::from_secs(10)).await,
        "the request connection outlived the Data-Out timeout"
    );
    drop(b);
}

/// Login keys for a session that sends its first burst unasked: immediate data, then
/// unsolicited Data-Out, up to FirstBurstLength (256 KiB, the target's default).
const UNSOLICITED: &[(&str, &str)] = &[
    ("InitialR2T", "No"),
    ("ImmediateData", "Yes"),
    ("FirstBurstLength", "262144"),
    ("MaxBurstLength", "1048576"),
];

/// Sessions whose writes bring their first burst unasked (64 KiB immediate, then unsolicited
/// Data-Out) and withhold the burst's last PDU: each write would keep a 256 KiB buffer forever
/// (8 sessions x 128 writes: 256 MiB). The server's unsolicited budget (here 32 MiB) bounds
/// them; writes beyond it keep nothing; the Data-Out timeout then drops every such connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsolicited_bursts_that_never_end_are_held_to_the_unsolicited_budget() {
    let _one = SERIAL.lock().await;
    log();
    const UNSOLICITED_BUDGET: u64 = 32 << 20;
    const SESSIONS: u8 = 8;
    const NO_DATA: &str = "no Data-Out for a write in 3s";
    let seen = log_count(NO_DATA);
    let server =
        stalled_writers_server(|cfg| cfg.limits.unsolicited_budget = UNSOLICITED_BUDGET).await;
    let (_, alone) = verified_io(&server, 1, 1.0).await;
    let before = rss();
    let watch = RssWatch::start();
    let chunk = pattern(64 << 10, 5);
    let mut clients = Vec::new();
    for i in 0..SESSIONS {
        let mut c = Client::normal_isid(&server, [0x80, 7, 7, 8, 8, i], UNSOLICITED).await;
        // One write at a time on the wire, so that this process's own buffers stay small.
        for _ in 0..128 {
            let mut wire = Vec::new();
            // 8 MiB, of which the first 256 KiB come unasked: 64 KiB with the command, two
            // Data-Outs of 64 KiB, and the last one (F bit) withheld.
            let cmd = c.command(
                &rw10(0x2a, 0, 16384),
                false,
                true,
                8 << 20,
                chunk.clone(),
                false,
            );
            let itt = cmd.itt;
            wire.extend_from_slice(&Pdu::ScsiCommand(cmd).encode(&c.framing).to_vec());
            for k in 0..2u32 {
                let d = Pdu::DataOut(DataOut {
                    final_: false,
                    lun: 0,
                    itt,
                    ttt: RESERVED_TAG,
                    exp_stat_sn: 0,
                    data_sn: k,
                    buffer_offset: (k + 1) * (64 << 10),
                    data: chunk.clone(),
                });
                wire.extend_from_slice(&d.encode(&c.framing).to_vec());
            }
            c.s.write_all(&wire).await.unwrap();
        }
        clients.push(c);
    }
    let (rounds, during) = verified_io(&server, 2, 2.0).await;
    let peak = watch.peak();
    println!(
        "{SESSIONS} sessions x 128 WRITEs withholding the end of their unsolicited burst: resident {:.1} MiB before, {:.1} MiB peak (+{:.1} MiB; unsolicited budget {:.0} MiB; unbounded: {} MiB); other session {alone:.1} MB/s alone, {during:.1} MB/s beside them",
        mib(before),
        mib(peak),
        mib(peak.saturating_sub(before)),
        mib(UNSOLICITED_BUDGET),
        u64::from(SESSIONS) * 128 / 4,
    );
    assert!(
        peak.saturating_sub(before) <= UNSOLICITED_BUDGET + SLACK,
        "resident memory rose by {:.1} MiB",
        mib(peak - before)
    );
    kept_pace(alone, during, rounds);
    // Every such write owes its burst's end, kept or refused: the Data-Out timeout drops them.
    for mut c in clients {
        assert!(
            c.closed_within(Duration::from_secs(10)).await,
            "a stuck writer was not dropped"
        );
    }
    let line = logged(NO_DATA, seen + 1)
        .await
        .expect("no log line for the Data-Out timeout");
    println!("log: {line}");
}

/// Sessions that leave a gap in CmdSN and send a window of 256 KiB WRITEs with all their data
/// immediate: each is held for its turn with its data (8 sessions x 127: 254 MiB). Those held
/// take the unsolicited budget (32 MiB: exactly 128 of them); the rest are answered TASK SET
/// FULL at once. Once the gap is filled the held ones run and succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_held_behind_a_cmdsn_gap_are_held_to_the_unsolicited_budget() {
    let _one = SERIAL.lock().await;
    log();
    const UNSOLICITED_BUDGET: u64 = 32 << 20;
    const SESSIONS: u8 = 8;
    const LEN: u32 = 256 << 10;
    let server = start_with(|cfg| {
        cfg.limits.unsolicited_budget = UNSOLICITED_BUDGET;
        cfg.targets[0].limits.offer.nop_interval = Duration::ZERO;
    })
    .await;
    let before = rss();
    let watch = RssWatch::start();
    let data = pattern(LEN as usize, 9);
    let mut clients = Vec::new();
    for i in 0..SESSIONS {
        let mut c = Client::normal_isid(&server, [0x80, 7, 7, 9, 9, i], UNSOLICITED).await;
        let gap = c.cmd_sn;
        c.cmd_sn += 1;
        for _ in 0..127 {
            let cmd = c.command(&rw10(0x2a, 0, 512), false, true, LEN, data.clone(), true);
            c.send(Pdu::ScsiCommand(cmd)).await;
        }
        clients.push((c, gap));
    }
    // The refused ones are answered now; the held ones wait for the gap.
    let mut refused = 0u32;
    for (c, _) in &mut clients {
        while let Ok(p) = tokio::time::timeout(Duration::from_millis(500), c.recv_inner()).await {
            let Pdu::ScsiResponse(r) = p else {
                panic!("unexpected {p:?}")
            };
            assert_eq!(r.status, 0x28, "TASK SET FULL");
            refused += 1;
        }
    }
    let peak = watch.peak();
    let held = u32::from(SESSIONS) * 127 - refused;
    println!(
        "{SESSIONS} sessions x 127 WRITEs of 256 KiB behind a CmdSN gap: {held} held, {refused} answered TASK SET FULL; resident {:.1} MiB before, {:.1} MiB peak (+{:.1} MiB; unsolicited budget {:.0} MiB; unbounded: {:.0} MiB)",
        mib(before),
        mib(peak),
        mib(peak.saturating_sub(before)),
        mib(UNSOLICITED_BUDGET),
        mib(u64::from(SESSIONS) * 127 * u64::from(LEN)),
    );
    assert_eq!(
        u64::from(held),
        UNSOLICITED_BUDGET / u64::from(LEN),
        "writes held"
    );
    assert!(
        peak.saturating_sub(before) <= UNSOLICITED_BUDGET + SLACK,
        "resident memory rose by {:.1} MiB",
        mib(peak - before)
    );
    // The gap filled, every held write runs and succeeds, and the budget is free again.
    let mut good = 0u32;
    for (c, gap) in &mut clients {
        let next = c.cmd_sn;
        c.cmd_sn = *gap;
        let tur = c.command(&[0u8; 6], false, false, 0, Bytes::new(), true);
        c.cmd_sn = next;
        c.send(Pdu::ScsiCommand(tur)).await;
        while let Ok(p) = tokio::time::timeout(Duration::from_millis(500), c.recv_inner()).await {
            let Pdu::ScsiResponse(r) = p else {
                panic!("unexpected {p:?}")
            };
            assert_eq!(r.status, 0, "GOOD");
            good += 1;
        }
    }
    assert_eq!(
        good,
        held + u32::from(SESSIONS),
        "the held writes and the gaps' commands"
    );
    let (c, _) = &mut clients[0];
    let cmd = c.command(&rw10(0x2a, 0, 512), false, true, LEN, data.clone(), true);
    let itt = cmd.itt;
    c.send(Pdu::ScsiCommand(cmd)).await;
    let (_, status, ..) = c.read_result(itt).await;
    assert_eq!(status, 0, "a write with immediate data after the flood");
}

/// One hostile session at ErrorRecoveryLevel 2: `resets` times, its connection (CID 0,
/// reinstated after the first: same ISID, TSIH and CID) sends a full window of 4 MiB READs of
/// the file LUN, then is reset 0.3 s later without reading anything. Returns the READs sent.
async fn resetting_reader(server: Arc<mcsi_target::Server>, i: u8, resets: u32) -> u32 {
    let isid = [0x80, 6, 6, 6, 6, i];
    let mut tsih = 0u16;
    let mut sent = 0u32;
    for k in 0..resets {
        let s = tokio::net::TcpStream::connect(server.local_addrs()[0])
            .await
            .unwrap();
        s.set_nodelay(true).unwrap();
        // Closing it sends a reset, as a peer that vanishes mid-transfer does.
        socket2::SockRef::from(&s)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        let mut c = Client {
            s: Box::new(s),
            buf: bytes::BytesMut::new(),
            framing: Framing::default(),
            cmd_sn: 1,
            itt: k << 16,
            tsih: 0,
            login_keys: Vec::new(),
        };
        let r = if tsih == 0 {
            c.login(
                isid,
                0,
                0,
                &[
                    ("TargetName", IQN),
                    ("SessionType", "Normal"),
                    ("MaxConnections", "4"),
                    ("ErrorRecoveryLevel", "2"),
                ],
            )
            .await
        } else {
            c.login(isid, tsih, 0, &[("TargetName", IQN)]).await
        };
        assert_eq!(
            (r.status_class, r.status_detail),
            (0, 0),
            "login {k} of session {i}"
        );
        if k == 0 {
            assert!(
                c.login_keys
                    .iter()
                    .any(|(k, v)| k == "ErrorRecoveryLevel" && v == "2"),
                "the target did not agree to level 2: {:?}",
                c.login_keys
            );
        }
        tsih = r.tsih;
        c.cmd_sn = r.exp_cmd_sn;
        let window = r
            .max_cmd_sn
            .wrapping_sub(r.exp_cmd_sn)
            .wrapping_add(1)
            .min(128);
        let mut wire = Vec::new();
        for j in 0..window {
            let cmd = c.command(
                &rw10(0x28, (j % 8) * 8192, 8192),
                true,
                false,
                4 << 20,
                Bytes::new(),
                true,
            );
            wire.extend_from_slice(&Pdu::ScsiCommand(cmd).encode(&c.framing).to_vec());
        }
        flood(&mut c, &wire, wire.len() as u64, Duration::from_secs(2)).await;
        sent += window;
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(c);
    }
    sent
}

/// A peer at ErrorRecoveryLevel 2 that resets its connection under a window of large READs
/// and reinstates it, again and again, cannot make the target keep what it leaves behind
/// without bound: the answers of tasks that end after their connection failed are held to
/// `limits.retention_budget`, the failed connections' sent-PDU logs to
/// `limits.sent_log_budget` (and 16 per session), and each failure's deadline stays its own.
/// Unbounded, 8 resets under 128 READs of 4 MiB keep 4 GiB per session. Alone and from 8
/// sessions at once; a fresh session works afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_level_2_peer_that_resets_under_large_reads_cannot_grow_the_target() {
    let _one = SERIAL.lock().await;
    let img = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
    std::fs::write(img.path(), pattern(32 << 20, 5)).unwrap();
    let file = format!("file:{}:32MiB", img.path().display());
    /// What the acceptance allows the target to grow by, whatever the peer does.
    const CEILING: u64 = 512 << 20;
    for sessions in [1u8, 8] {
        let server = Arc::new(
            start_with(|cfg| {
                cfg.targets[0].luns = vec![mcsi_target::config::LunSpec::new(file.as_str())];
            })
            .await,
        );
        let limits = mcsi_target::config::ServerLimits::default();
        let (_, alone) = verified_io(&server, 1, 1.0).await;
        let before = rss();
        let watch = RssWatch::start();
        let t0 = Instant::now();
        let mut peers = tokio::task::JoinSet::new();
        for i in 0..sessions {
            peers.spawn(resetting_reader(server.clone(), i, 8));
        }
        let reads: u32 = peers.join_all().await.into_iter().sum();
        // The tasks left behind run to their end (their answers kept or dropped) meanwhile.
        let (rounds, during) = verified_io(&server, 2, 3.0).await;
        let peak = watch.peak();
        println!(
            "{sessions} level-2 session(s) x 8 resets under windows of 4 MiB READs ({reads} READs, {:.0} MiB asked for) in {:.1} s: resident {:.1} MiB before, {:.1} MiB peak (+{:.1} MiB; retention budget {:.0} MiB, sent-log budget {:.0} MiB; ceiling {:.0} MiB); other session {alone:.1} MB/s alone, {during:.1} MB/s after ({rounds} rounds)",
            f64::from(reads) * 4.0,
            t0.elapsed().as_secs_f64(),
            mib(before),
            mib(peak),
            mib(peak.saturating_sub(before)),
            mib(limits.retention_budget),
            mib(limits.sent_log_budget),
            mib(CEILING),
        );
        assert!(
            peak.saturating_sub(before) <= CEILING,
            "resident memory rose by {:.1} MiB",
            mib(peak - before)
        );
        assert!(rounds >= 3, "a fresh session made {rounds} rounds");
        // The next case starts from a server with nothing left behind.
        let Ok(server) = Arc::try_unwrap(server) else {
            panic!("the hostile sessions still hold the server")
        };
        server.shutdown().await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
