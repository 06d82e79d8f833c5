//! The server against a memory export, driven by a small client written from the protocol:
//! handshake and options, aligned and unaligned I/O, the errors a client can provoke, many
//! requests in flight, and a stop that answers what is in flight.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use mcsi_nbd::proto::{self, cflag, cmd, errno, info, opt, rep, Request};
use mcsi_nbd::{Export, ExportInfo, Listener, NbdError, Server, ServerOptions};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

struct Mem {
    info: ExportInfo,
    data: Mutex<Vec<u8>>,
    /// Every request the export saw: (kind, offset, len); all must be aligned.
    seen: Mutex<Vec<(&'static str, u64, u64)>>,
    delay: Duration,
    /// Reads and writes running now, and the most that ever ran at once.
    running: AtomicU32,
    most_running: AtomicU32,
}

impl Mem {
    fn new(name: &str, size: usize, read_only: bool) -> Arc<Mem> {
        Arc::new(Mem {
            info: ExportInfo {
                name: name.into(),
                description: "memory".into(),
                size: size as u64,
                block_size: 512,
                preferred: 4096,
                max_payload: 1 << 20,
                read_only,
                flush: true,
                fua: true,
                trim: true,
                write_zeroes: true,
                multi_conn: true,
            },
            data: Mutex::new((0..size).map(|i| (i % 251) as u8).collect()),
            seen: Mutex::new(Vec::new()),
            delay: Duration::ZERO,
            running: AtomicU32::new(0),
            most_running: AtomicU32::new(0),
        })
    }

    fn note(&self, kind: &'static str, off: u64, len: u64) {
        assert_eq!(off % 512, 0, "{kind} at unaligned offset {off}");
        assert_eq!(len % 512, 0, "{kind} of unaligned length {len}");
        self.seen.lock().unwrap().push((kind, off, len));
    }

    /// Waits `delay`, counted as running.
    async fn run(&self) {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_running.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(self.delay).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Export for Mem {
    fn info(&self) -> &ExportInfo {
        &self.info
    }
    async fn read(&self, offset: u64, len: u32) -> Result<Bytes, NbdError> {
        self.note("read", offset, len.into());
        self.run().await;
        let d = self.data.lock().unwrap();
        Ok(Bytes::copy_from_slice(
            &d[offset as usize..offset as usize + len as usize],
        ))
    }
    async fn write(&self, offset: u64, data: Bytes, _fua: bool) -> Result<(), NbdError> {
        self.note("write", offset, data.len() as u64);
        self.run().await;
        self.data.lock().unwrap()[offset as usize..offset as usize + data.len()]
            .copy_from_slice(&data);
        Ok(())
    }
    async fn flush(&self) -> Result<(), NbdError> {
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u32) -> Result<(), NbdError> {
        self.note("trim", offset, len.into());
        Ok(())
    }
    async fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        _may_trim: bool,
        _fua: bool,
    ) -> Result<(), NbdError> {
        self.note("zero", offset, len.into());
        self.data.lock().unwrap()[offset as usize..(offset + u64::from(len)) as usize].fill(0);
        Ok(())
    }
}

async fn start(
    exports: Vec<Arc<Mem>>,
    opts: ServerOptions,
) -> (
    std::net::SocketAddr,
    watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = Arc::new(Server::new(exports, opts).unwrap());
    let (stop_tx, stop_rx) = watch::channel(false);
    let h = tokio::spawn(async move {
        server.run(Listener::Tcp(l), stop_rx).await.unwrap();
    });
    (addr, stop_tx, h)
}

struct Client {
    s: TcpStream,
}

impl Client {
    async fn connect(addr: std::net::SocketAddr) -> Client {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // Requests sent back to back must reach the server at once (no Nagle delay).
        s.set_nodelay(true).unwrap();
        let mut g = [0u8; 18];
        s.read_exact(&mut g).await.unwrap();
        assert_eq!(&g[0..16], b"NBDMAGICIHAVEOPT");
        assert_eq!(u16::from_be_bytes([g[16], g[17]]) & 3, 3);
        s.write_u32(3).await.unwrap();
        Client { s }
    }

    async fn option(&mut self, o: u32, data: &[u8]) -> Vec<(u32, Vec<u8>)> {
        let mut b = Vec::new();
        b.extend_from_slice(b"IHAVEOPT");
        b.extend_from_slice(&o.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).await.unwrap();
        let mut out = Vec::new();
        loop {
            let magic = self.s.read_u64().await.unwrap();
            assert_eq!(magic, proto::OPT_REPLY_MAGIC);
            assert_eq!(self.s.read_u32().await.unwrap(), o);
            let kind = self.s.read_u32().await.unwrap();
            let len = self.s.read_u32().await.unwrap();
            let mut d = vec![0u8; len as usize];
            self.s.read_exact(&mut d).await.unwrap();
            let last = kind == rep::ACK || kind & (1 << 31) != 0;
            out.push((kind, d));
            if last {
                return out;
            }
        }
    }

    fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    async fn send(
        &mut self,
        flags: u16,
        kind: u16,
        cookie: u64,
        offset: u64,
        length: u32,
        data: &[u8],
    ) {
        let r = Request {
            flags,
            kind,
            cookie,
            offset,
            length,
        };
        self.s.write_all(&r.encode()).await.unwrap();
        self.s.write_all(data).await.unwrap();
    }

    /// One structured reply: (cookie, error, data of an OFFSET_DATA chunk).
    async fn reply(&mut self) -> (u64, u32, Vec<u8>) {
        assert_eq!(
            self.s.read_u32().await.unwrap(),
            proto::STRUCTURED_REPLY_MAGIC
        );
        let flags = self.s.read_u16().await.unwrap();
        assert_eq!(flags & proto::chunk::FLAG_DONE, 1, "one chunk per reply");
        let kind = self.s.read_u16().await.unwrap();
        let cookie = self.s.read_u64().await.unwrap();
        let len = self.s.read_u32().await.unwrap();
        let mut d = vec![0u8; len as usize];
        self.s.read_exact(&mut d).await.unwrap();
        match kind {
            proto::chunk::NONE => (cookie, 0, Vec::new()),
            proto::chunk::OFFSET_DATA => (cookie, 0, d[8..].to_vec()),
            proto::chunk::ERROR => (
                cookie,
                u32::from_be_bytes([d[0], d[1], d[2], d[3]]),
                Vec::new(),
            ),
            k => panic!("chunk type {k}"),
        }
    }

    async fn go_structured(addr: std::net::SocketAddr, name: &str) -> Client {
        let mut c = Client::connect(addr).await;
        assert_eq!(c.option(opt::STRUCTURED_REPLY, &[]).await[0].0, rep::ACK);
        let r = c
            .option(opt::GO, &Client::go_data(name, &[info::BLOCK_SIZE]))
            .await;
        assert_eq!(r.last().unwrap().0, rep::ACK);
        c
    }
}

#[tokio::test]
async fn options_list_info_and_unknown_names() {
    let (addr, stop, h) = start(
        vec![Mem::new("a", 1 << 20, false), Mem::new("b", 2 << 20, true)],
        ServerOptions::default(),
    )
    .await;
    let mut c = Client::connect(addr).await;
    let list = c.option(opt::LIST, &[]).await;
    let names: Vec<String> = list
        .iter()
        .filter(|(k, _)| *k == rep::SERVER)
        .map(|(_, d)| {
            let n = u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize;
            String::from_utf8(d[4..4 + n].to_vec()).unwrap()
        })
        .collect();
    assert_eq!(names, ["a", "b"]);
    // INFO on the second export: size, read-only flag, block sizes; always the block sizes.
    let r = c
        .option(opt::INFO, &Client::go_data("b", &[info::NAME]))
        .await;
    let export = r
        .iter()
        .find(|(k, d)| *k == rep::INFO && d[..2] == [0, 0])
        .unwrap();
    assert_eq!(
        u64::from_be_bytes(export.1[2..10].try_into().unwrap()),
        2 << 20
    );
    let flags = u16::from_be_bytes([export.1[10], export.1[11]]);
    assert_ne!(flags & proto::tflag::READ_ONLY, 0);
    assert_eq!(
        flags & proto::tflag::SEND_WRITE_ZEROES,
        0,
        "nothing to zero on a read-only export"
    );
    let bsz = r
        .iter()
        .find(|(k, d)| *k == rep::INFO && d[..2] == [0, 3])
        .unwrap();
    assert_eq!(&bsz.1[2..14], &[0, 0, 2, 0, 0, 0, 16, 0, 0, 16, 0, 0]);
    assert!(r
        .iter()
        .any(|(k, d)| *k == rep::INFO && d[..2] == [0, 1] && &d[2..] == b"b"));
    // Unknown export, malformed GO data, an unsupported option: errors, and the connection goes on.
    let r = c.option(opt::GO, &Client::go_data("nope", &[])).await;
    assert_eq!(r[0].0, rep::ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&r[0].1).contains("\"a\""));
    assert_eq!(
        c.option(opt::GO, &[0, 0, 0, 200, 1]).await[0].0,
        rep::ERR_INVALID
    );
    assert_eq!(
        c.option(opt::EXTENDED_HEADERS, &[]).await[0].0,
        rep::ERR_UNSUP
    );
    assert_eq!(c.option(opt::STARTTLS, &[]).await[0].0, rep::ERR_UNSUP);
    // The default export (empty name) is the first one.
    let r = c.option(opt::GO, &Client::go_data("", &[])).await;
    assert_eq!(r.last().unwrap().0, rep::ACK);
    stop.send(true).unwrap();
    h.await.unwrap();
}

#[tokio::test]
async fn aligned_and_unaligned_io_and_errors() {
    let mem = Mem::new("m", 1 << 20, false);
    let (addr, stop, h) = start(vec![Arc::clone(&mem)], ServerOptions::default()).await;
    let mut c = Client::go_structured(addr, "m").await;
    // Aligned write and read back.
    let pat: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
    c.send(cflag::FUA, cmd::WRITE, 1, 4096, 8192, &pat).await;
    assert_eq!(c.reply().await, (1, 0, vec![]));
    c.send(0, cmd::READ, 2, 4096, 8192, &[]).await;
    assert_eq!(c.reply().await, (2, 0, pat.clone()));
    // Unaligned write (read-modify-write) and unaligned read.
    c.send(0, cmd::WRITE, 3, 4096 + 100, 3, b"xyz").await;
    assert_eq!(c.reply().await.1, 0);
    c.send(0, cmd::READ, 4, 4096 + 99, 5, &[]).await;
    assert_eq!(c.reply().await.2, vec![pat[99], b'x', b'y', b'z', pat[103]]);
    // WRITE_ZEROES with unaligned edges: whole blocks through the export, the edges rewritten.
    c.send(0, cmd::WRITE_ZEROES, 5, 4096 + 10, 2000, &[]).await;
    assert_eq!(c.reply().await.1, 0);
    c.send(0, cmd::READ, 6, 4096, 4096, &[]).await;
    let got = c.reply().await.2;
    assert_eq!(&got[..10], &pat[..10]);
    assert!(got[10..2010].iter().all(|&b| b == 0));
    assert_eq!(&got[2010..], &pat[2010..4096]);
    assert!(mem.seen.lock().unwrap().contains(&("zero", 4608, 1024)));
    // TRIM: only the whole blocks inside.
    c.send(0, cmd::TRIM, 7, 100, 2000, &[]).await;
    assert_eq!(c.reply().await.1, 0);
    assert!(mem.seen.lock().unwrap().contains(&("trim", 512, 1536)));
    // Past the end, too large, unknown type: errors, connection goes on.
    c.send(0, cmd::READ, 8, (1 << 20) - 512, 1024, &[]).await;
    assert_eq!(c.reply().await.1, errno::EINVAL);
    c.send(0, cmd::WRITE, 9, (1 << 20) - 512, 1024, &[0u8; 1024])
        .await;
    assert_eq!(c.reply().await.1, errno::ENOSPC);
    c.send(0, cmd::READ, 10, 0, 2 << 20, &[]).await;
    assert_eq!(c.reply().await.1, errno::EINVAL);
    c.send(0, 99, 11, 0, 0, &[]).await;
    assert_eq!(c.reply().await.1, errno::EINVAL);
    c.send(0, cmd::BLOCK_STATUS, 12, 0, 512, &[]).await;
    assert_eq!(c.reply().await.1, errno::EINVAL);
    c.send(0, cmd::FLUSH, 13, 0, 0, &[]).await;
    assert_eq!(c.reply().await, (13, 0, vec![]));
    // A WRITE larger than the maximum payload ends the connection (its data cannot be skipped).
    c.send(0, cmd::WRITE, 14, 0, 64 << 20, &[]).await;
    let mut b = [0u8; 1];
    assert_eq!(c.s.read(&mut b).await.unwrap(), 0);
    stop.send(true).unwrap();
    h.await.unwrap();
}

#[tokio::test]
async fn read_only_and_simple_replies() {
    let (addr, stop, h) = start(
        vec![Mem::new("ro", 1 << 20, true)],
        ServerOptions::default(),
    )
    .await;
    // Old-style EXPORT_NAME, no structured replies: simple replies.
    let mut c = Client::connect(addr).await;
    c.s.write_all(b"IHAVEOPT").await.unwrap();
    c.s.write_u32(opt::EXPORT_NAME).await.unwrap();
    c.s.write_u32(2).await.unwrap();
    c.s.write_all(b"ro").await.unwrap();
    assert_eq!(c.s.read_u64().await.unwrap(), 1 << 20);
    let flags = c.s.read_u16().await.unwrap();
    assert_ne!(flags & proto::tflag::READ_ONLY, 0);
    c.send(0, cmd::WRITE, 1, 0, 512, &[1u8; 512]).await;
    assert_eq!(c.s.read_u32().await.unwrap(), proto::SIMPLE_REPLY_MAGIC);
    assert_eq!(c.s.read_u32().await.unwrap(), errno::EPERM);
    assert_eq!(c.s.read_u64().await.unwrap(), 1);
    c.send(0, cmd::READ, 2, 0, 512, &[]).await;
    assert_eq!(c.s.read_u32().await.unwrap(), proto::SIMPLE_REPLY_MAGIC);
    assert_eq!(c.s.read_u32().await.unwrap(), 0);
    assert_eq!(c.s.read_u64().await.unwrap(), 2);
    let mut d = vec![0u8; 512];
    c.s.read_exact(&mut d).await.unwrap();
    assert_eq!(d[1], 1);
    // A bad request magic ends the connection.
    c.s.write_all(&[0u8; 28]).await.unwrap();
    let mut b = [0u8; 1];
    assert_eq!(c.s.read(&mut b).await.unwrap(), 0);
    stop.send(true).unwrap();
    h.await.unwrap();
}

#[tokio::test]
async fn many_in_flight_and_a_stop_answers_them() {
    let mut m = Mem::new("slow", 4 << 20, false);
    Arc::get_mut(&mut m).unwrap().delay = Duration::from_millis(50);
    let opts = ServerOptions {
        max_requests: 8,
        ..ServerOptions::default()
    };
    let (addr, stop, h) = start(vec![Arc::clone(&m)], opts).await;
    let mut c = Client::go_structured(addr, "slow").await;
    // 32 reads sent at once: at most 8 run at a time; all are answered.
    for i in 0..32u64 {
        c.send(0, cmd::READ, i, i * 4096, 4096, &[]).await;
    }
    let t = std::time::Instant::now();
    let mut cookies: Vec<u64> = Vec::new();
    for _ in 0..32 {
        let (cookie, err, d) = c.reply().await;
        assert_eq!(err, 0);
        assert_eq!(d.len(), 4096);
        cookies.push(cookie);
    }
    cookies.sort_unstable();
    assert_eq!(cookies, (0..32).collect::<Vec<_>>());
    // 32 requests, 8 at a time: the export saw exactly 8 at once, never more.
    println!(
        "32 reads answered in {:?}, at most {} at once",
        t.elapsed(),
        m.most_running.load(Ordering::SeqCst)
    );
    assert_eq!(m.most_running.load(Ordering::SeqCst), 8, "reads at once");
    // Requests in flight when the stop comes are answered before the connection closes.
    for i in 0..4u64 {
        c.send(0, cmd::READ, 100 + i, 0, 512, &[]).await;
    }
    // Stop once all four have reached the export (they take 50 ms each there).
    while m.seen.lock().unwrap().len() < 36 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    stop.send(true).unwrap();
    for _ in 0..4 {
        assert_eq!(c.reply().await.1, 0);
    }
    let mut b = [0u8; 1];
    assert_eq!(c.s.read(&mut b).await.unwrap(), 0);
    h.await.unwrap();
}

/// A client that sends READs and never reads its socket: it holds at most its connection's
/// payload budget, another client is served meanwhile, and a stop still ends the server (the
/// stuck connection's writer gives up after the write timeout and its permits come back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_neither_blocks_the_stop_nor_locks_others_out() {
    let m = Mem::new("m", 16 << 20, false);
    let opts = ServerOptions {
        max_buffered: 4 << 20,
        max_buffered_total: 8 << 20,
        write_timeout: Duration::from_secs(2),
        ..ServerOptions::default()
    };
    let (addr, stop, h) = start(vec![Arc::clone(&m)], opts).await;
    let mut stuck = Client::go_structured(addr, "m").await;
    for i in 0..64u64 {
        stuck
            .send(0, cmd::READ, i, (i % 16) << 20, 1 << 20, &[])
            .await;
    }
    // Another client is answered while the stuck one holds its budget.
    let mut good = Client::go_structured(addr, "m").await;
    let t0 = std::time::Instant::now();
    for i in 0..64u64 {
        good.send(0, cmd::READ, 1000 + i, i << 16, 64 << 10, &[])
            .await;
        let (cookie, err, d) = tokio::time::timeout(Duration::from_secs(5), good.reply())
            .await
            .expect("the other client is answered");
        assert_eq!((cookie, err, d.len()), (1000 + i, 0, 64 << 10));
    }
    println!(
        "64 reads of 64 KiB beside a stuck client: {:?}",
        t0.elapsed()
    );
    // The stop ends the server although the stuck client never reads: within the write
    // timeout and a margin.
    let t0 = std::time::Instant::now();
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(10), h)
        .await
        .expect("the server stopped")
        .unwrap();
    println!("stopped {:?} after the stop was asked", t0.elapsed());
    drop(stuck);
}

/// With an idle timeout, a connection that sends nothing is closed.
#[tokio::test]
async fn an_idle_connection_is_closed_when_asked() {
    let m = Mem::new("m", 1 << 20, false);
    let opts = ServerOptions {
        idle_timeout: Duration::from_millis(300),
        ..ServerOptions::default()
    };
    let (addr, stop, h) = start(vec![Arc::clone(&m)], opts).await;
    let mut c = Client::go_structured(addr, "m").await;
    c.send(0, cmd::READ, 1, 0, 4096, &[]).await;
    assert_eq!(c.reply().await.1, 0);
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_secs(3), c.s.read(&mut b))
        .await
        .expect("closed within 3 s");
    assert_eq!(r.unwrap(), 0);
    stop.send(true).unwrap();
    h.await.unwrap();
}
