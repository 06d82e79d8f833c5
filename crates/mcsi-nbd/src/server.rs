//! The NBD server: accepts connections, negotiates an export, then runs many requests at once
//! per connection against an [`Export`].

use crate::proto::{self, cflag, cmd, errno, handshake, info, opt, rep, InfoRequest, Request};
use bytes::{Bytes, BytesMut};
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::{debug, info, warn};

/// What a client sees of an export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
    pub size: u64,
    /// The device's block size: the minimum block size the server advertises. Requests that
    /// are not aligned to it are widened (reads) or read, modified and written back (writes)
    /// by the server; the export only ever sees aligned ones.
    pub block_size: u32,
    /// Preferred request size (a multiple of `block_size`).
    pub preferred: u32,
    /// Largest READ or WRITE payload (a multiple of `block_size`).
    pub max_payload: u32,
    pub read_only: bool,
    pub flush: bool,
    pub fua: bool,
    pub trim: bool,
    pub write_zeroes: bool,
    /// NBD_FLAG_CAN_MULTI_CONN: a flush on any connection makes the writes every connection
    /// completed durable, and all connections see the same data.
    pub multi_conn: bool,
}

impl ExportInfo {
    /// Transmission flags.
    pub fn flags(&self) -> u16 {
        use proto::tflag::*;
        let mut f = HAS_FLAGS;
        let mut set = |on: bool, bit: u16| {
            if on {
                f |= bit
            }
        };
        set(self.read_only, READ_ONLY);
        set(self.flush, SEND_FLUSH);
        set(self.fua && !self.read_only, SEND_FUA);
        set(self.trim && !self.read_only, SEND_TRIM);
        set(self.write_zeroes && !self.read_only, SEND_WRITE_ZEROES);
        set(self.multi_conn, CAN_MULTI_CONN);
        f
    }
}

/// A failed request: the errno the client gets, and the reason (in structured replies and the
/// log).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} ({})", errno::name(*.errno))]
pub struct NbdError {
    pub errno: u32,
    pub message: String,
}

impl NbdError {
    pub fn new(errno: u32, message: impl Into<String>) -> NbdError {
        NbdError {
            errno,
            message: message.into(),
        }
    }
}

/// A block device the server exports. The server calls it only with requests inside the
/// export and aligned to `info().block_size`. Reads and writes are at most `max_payload`, or
/// two blocks more when the server widened a client's unaligned request to whole blocks; trims
/// and zeroing may be up to 4 GiB. The export splits what its device cannot take at once.
pub trait Export: Send + Sync + 'static {
    fn info(&self) -> &ExportInfo;
    fn read(&self, offset: u64, len: u32) -> impl Future<Output = Result<Bytes, NbdError>> + Send;
    fn write(
        &self,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> impl Future<Output = Result<(), NbdError>> + Send;
    fn flush(&self) -> impl Future<Output = Result<(), NbdError>> + Send;
    fn trim(&self, offset: u64, len: u32) -> impl Future<Output = Result<(), NbdError>> + Send;
    /// Zero `len` bytes; `may_trim`: the blocks may be deallocated (the client did not set
    /// NBD_CMD_FLAG_NO_HOLE).
    fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        may_trim: bool,
        fua: bool,
    ) -> impl Future<Output = Result<(), NbdError>> + Send;
}

/// Limits of the server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Requests in flight per NBD connection (its replies included); the reader stops taking
    /// requests from the socket beyond it, and TCP's flow control stops the client.
    pub max_requests: usize,
    /// Bytes of READ and WRITE payload in flight per NBD connection.
    pub max_buffered: usize,
    /// Bytes of READ and WRITE payload in flight over all NBD connections together.
    pub max_buffered_total: usize,
    /// NBD connections at once; more are closed as they arrive.
    pub max_connections: usize,
    /// Time a client has to choose an export.
    pub handshake_timeout: Duration,
    /// A reply the client takes no byte of for this long ends its connection (its requests'
    /// permits come back, and the server can stop). Zero: never.
    pub write_timeout: Duration,
    /// A connection that sends no request for this long is closed. Zero (the default): never,
    /// since the kernel's nbd client keeps its connections for as long as the device is set up,
    /// however idle.
    pub idle_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_requests: 128,
            max_buffered: 64 << 20,
            max_buffered_total: 256 << 20,
            max_connections: 64,
            handshake_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            idle_timeout: Duration::ZERO,
        }
    }
}

/// Counters of one export (all connections).
#[derive(Debug, Default)]
pub struct ExportStats {
    pub connections: AtomicU64,
    pub connections_total: AtomicU64,
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    pub writes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub flushes: AtomicU64,
    pub trims: AtomicU64,
    pub zeroes: AtomicU64,
    /// Requests answered with an error.
    pub errors: AtomicU64,
    /// Writes or zeroing that were not block-aligned (read-modify-write).
    pub unaligned: AtomicU64,
}

/// Option data larger than this closes the connection (names are at most 4096 bytes).
const MAX_OPTION_DATA: u32 = 64 << 10;

struct Slot<E> {
    export: Arc<E>,
    /// Serializes read-modify-write cycles (two unaligned writes into one block must not undo
    /// each other).
    rmw: tokio::sync::Mutex<()>,
    stats: Arc<ExportStats>,
}

/// The server: a list of exports (the first is the default one) and its limits.
pub struct Server<E: Export> {
    slots: Vec<Slot<E>>,
    opts: ServerOptions,
    /// The payload budget of all connections together (bytes).
    total: Arc<Semaphore>,
}

/// Where the server listens.
pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

impl Listener {
    /// The next connection, split into halves that need no lock between them.
    async fn accept(&self) -> io::Result<(ReadHalf, WriteHalf, String)> {
        match self {
            Listener::Tcp(l) => {
                let (s, peer) = l.accept().await?;
                let _ = s.set_nodelay(true);
                let (r, w) = s.into_split();
                Ok((Box::new(r), Box::new(w), peer.to_string()))
            }
            Listener::Unix(l) => {
                let (s, _) = l.accept().await?;
                let (r, w) = s.into_split();
                Ok((Box::new(r), Box::new(w), "unix".to_string()))
            }
        }
    }
}

/// The export a client chose, and how it talks.
struct Chosen {
    slot: usize,
    structured: bool,
}

/// What a request returns to the writer.
enum Done {
    Empty,
    Data { offset: u64, data: Bytes },
}

struct Reply {
    cookie: u64,
    result: Result<Done, NbdError>,
    _permits: Permits,
}

struct Permits {
    _req: tokio::sync::OwnedSemaphorePermit,
    _bytes: Option<tokio::sync::OwnedSemaphorePermit>,
    _total: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Why a server cannot be set up with the exports and options given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SetupError {
    #[error("no export to serve")]
    NoExport,
    #[error("two exports are named {0:?}")]
    SameName(String),
    #[error("export {name:?}: block size {block_size}, preferred {preferred}, maximum payload {max_payload}: want a power of two and multiples of it")]
    BlockSizes {
        name: String,
        block_size: u32,
        preferred: u32,
        max_payload: u32,
    },
    #[error("{0} must be positive")]
    Zero(&'static str),
}

impl<E: Export> Server<E> {
    /// A server for `exports`; the first one is what a client asking for the default export
    /// (an empty name) gets. Names must differ.
    pub fn new(exports: Vec<Arc<E>>, opts: ServerOptions) -> Result<Server<E>, SetupError> {
        if exports.is_empty() {
            return Err(SetupError::NoExport);
        }
        for (i, e) in exports.iter().enumerate() {
            let inf = e.info();
            if exports[..i].iter().any(|o| o.info().name == inf.name) {
                return Err(SetupError::SameName(inf.name.clone()));
            }
            let bs = inf.block_size;
            if bs == 0
                || !bs.is_power_of_two()
                || inf.max_payload < bs
                || inf.max_payload % bs != 0
                || inf.preferred % bs != 0
            {
                return Err(SetupError::BlockSizes {
                    name: inf.name.clone(),
                    block_size: bs,
                    preferred: inf.preferred,
                    max_payload: inf.max_payload,
                });
            }
        }
        if opts.max_requests == 0 || opts.max_buffered == 0 || opts.max_buffered_total == 0 {
            return Err(SetupError::Zero(
                "max_requests, max_buffered and max_buffered_total",
            ));
        }
        if opts.max_connections == 0 {
            return Err(SetupError::Zero("max_connections"));
        }
        let total = Arc::new(Semaphore::new(
            opts.max_buffered_total.min(Semaphore::MAX_PERMITS),
        ));
        Ok(Server {
            total,
            slots: exports
                .into_iter()
                .map(|export| Slot {
                    export,
                    rmw: tokio::sync::Mutex::new(()),
                    stats: Arc::new(ExportStats::default()),
                })
                .collect(),
            opts,
        })
    }

    /// Counters of export `i` (in the order given to [`Server::new`]).
    pub fn stats(&self, i: usize) -> Option<Arc<ExportStats>> {
        self.slots.get(i).map(|s| Arc::clone(&s.stats))
    }

    /// Serves until `stop` turns true: then takes no new connections or requests, lets the
    /// requests in flight finish and their replies go out, and returns.
    pub async fn run(
        self: Arc<Self>,
        listener: Listener,
        mut stop: watch::Receiver<bool>,
    ) -> io::Result<()> {
        let mut conns = tokio::task::JoinSet::new();
        loop {
            if *stop.borrow() {
                break;
            }
            tokio::select! {
                a = listener.accept() => match a {
                    Ok((rd, wr, peer)) => {
                        if conns.len() >= self.opts.max_connections {
                            warn!(%peer, "NBD connection refused: {} connections already (the limit)", conns.len());
                            continue;
                        }
                        let me = Arc::clone(&self);
                        let stop = stop.clone();
                        conns.spawn(async move { me.serve(rd, wr, peer, stop).await });
                    }
                    Err(e) => {
                        // Out of descriptors and the like: wait rather than spin.
                        warn!("NBD accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                _ = stop.changed() => {}
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        while conns.join_next().await.is_some() {}
        Ok(())
    }

    async fn serve(
        self: Arc<Self>,
        rd: ReadHalf,
        mut wr: WriteHalf,
        peer: String,
        stop: watch::Receiver<bool>,
    ) {
        // Requests are 28 bytes: read them many at a time.
        let mut rd = BufReader::with_capacity(64 << 10, rd);
        let chosen = tokio::time::timeout(
            self.opts.handshake_timeout,
            self.negotiate(&mut rd, &mut wr, &peer),
        )
        .await;
        let chosen = match chosen {
            Ok(Ok(Some(c))) => c,
            Ok(Ok(None)) => return,
            Ok(Err(e)) => {
                warn!(%peer, "NBD handshake failed: {e}");
                return;
            }
            Err(_) => {
                warn!(%peer, "NBD handshake: no export chosen within {:?}; closing", self.opts.handshake_timeout);
                return;
            }
        };
        let slot = &self.slots[chosen.slot];
        slot.stats.connections.fetch_add(1, Relaxed);
        slot.stats.connections_total.fetch_add(1, Relaxed);
        info!(%peer, export = %slot.export.info().name, structured = chosen.structured, "NBD client connected");
        let why = Arc::clone(&self).transmit(rd, wr, chosen, stop).await;
        slot.stats.connections.fetch_sub(1, Relaxed);
        info!(%peer, "NBD client gone: {why}");
    }

    fn find(&self, name: &str) -> Option<usize> {
        if name.is_empty() {
            return Some(0);
        }
        self.slots.iter().position(|s| s.export.info().name == name)
    }

    fn names(&self) -> String {
        self.slots
            .iter()
            .map(|s| format!("{:?}", s.export.info().name))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The handshake: returns the export chosen, or None when the client aborted.
    async fn negotiate<R, W>(
        &self,
        rd: &mut R,
        wr: &mut W,
        peer: &str,
    ) -> io::Result<Option<Chosen>>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        let bad = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
        wr.write_all(&proto::greeting(
            handshake::FIXED_NEWSTYLE | handshake::NO_ZEROES,
        ))
        .await?;
        wr.flush().await?;
        let cflags = rd.read_u32().await?;
        let known = handshake::C_FIXED_NEWSTYLE | handshake::C_NO_ZEROES;
        if cflags & !known != 0 {
            return Err(bad(format!(
                "client flags {cflags:#x} carry bits this server does not know"
            )));
        }
        let fixed = cflags & handshake::C_FIXED_NEWSTYLE != 0;
        let no_zeroes = cflags & handshake::C_NO_ZEROES != 0;
        let mut structured = false;
        loop {
            let mut h = [0u8; proto::OptionHeader::LEN];
            rd.read_exact(&mut h).await?;
            let h = proto::OptionHeader::parse(&h)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            if h.len > MAX_OPTION_DATA {
                return Err(bad(format!(
                    "option {} carries {} bytes of data, more than the {MAX_OPTION_DATA} this server takes",
                    opt::name(h.option),
                    h.len
                )));
            }
            let mut data = vec![0u8; h.len as usize];
            rd.read_exact(&mut data).await?;
            debug!(%peer, option = opt::name(h.option), len = h.len, "NBD option");
            let reply = |kind: u32, d: &[u8]| proto::option_reply(h.option, kind, d);
            let err = |kind: u32, msg: String| proto::option_reply(h.option, kind, msg.as_bytes());
            match h.option {
                opt::EXPORT_NAME => {
                    let name = String::from_utf8_lossy(&data).into_owned();
                    let Some(i) = self.find(&name) else {
                        // No way to say why under this option: the connection just ends.
                        return Err(bad(format!(
                            "export {name:?} requested; exports: {}",
                            self.names()
                        )));
                    };
                    let inf = self.slots[i].export.info();
                    let mut b = Vec::with_capacity(134);
                    b.extend_from_slice(&inf.size.to_be_bytes());
                    b.extend_from_slice(&inf.flags().to_be_bytes());
                    if !no_zeroes {
                        b.extend_from_slice(&[0u8; 124]);
                    }
                    wr.write_all(&b).await?;
                    wr.flush().await?;
                    return Ok(Some(Chosen {
                        slot: i,
                        structured,
                    }));
                }
                _ if !fixed => {
                    return Err(bad(format!(
                        "option {} from a client without fixed newstyle",
                        opt::name(h.option)
                    )));
                }
                opt::ABORT => {
                    wr.write_all(&reply(rep::ACK, &[])).await?;
                    wr.flush().await?;
                    return Ok(None);
                }
                opt::LIST => {
                    if !data.is_empty() {
                        wr.write_all(&err(rep::ERR_INVALID, "LIST carries no data".into()))
                            .await?;
                    } else {
                        for s in &self.slots {
                            let inf = s.export.info();
                            wr.write_all(&reply(
                                rep::SERVER,
                                &proto::server_entry(&inf.name, &inf.description),
                            ))
                            .await?;
                        }
                        wr.write_all(&reply(rep::ACK, &[])).await?;
                    }
                }
                opt::INFO | opt::GO => {
                    let req = match InfoRequest::parse(&data) {
                        Ok(r) => r,
                        Err(e) => {
                            wr.write_all(&err(rep::ERR_INVALID, e.to_string())).await?;
                            wr.flush().await?;
                            continue;
                        }
                    };
                    let Some(i) = self.find(&req.name) else {
                        wr.write_all(&err(
                            rep::ERR_UNKNOWN,
                            format!("no export named {:?}; exports: {}", req.name, self.names()),
                        ))
                        .await?;
                        wr.flush().await?;
                        continue;
                    };
                    let inf = self.slots[i].export.info();
                    wr.write_all(&reply(
                        rep::INFO,
                        &proto::info_export(inf.size, inf.flags()),
                    ))
                    .await?;
                    if req.requests.contains(&info::NAME) {
                        wr.write_all(&reply(rep::INFO, &proto::info_text(info::NAME, &inf.name)))
                            .await?;
                    }
                    if req.requests.contains(&info::DESCRIPTION) && !inf.description.is_empty() {
                        wr.write_all(&reply(
                            rep::INFO,
                            &proto::info_text(info::DESCRIPTION, &inf.description),
                        ))
                        .await?;
                    }
                    // Always sent (the protocol allows it unasked): clients that honour it
                    // send aligned requests; the others are served anyway.
                    wr.write_all(&reply(
                        rep::INFO,
                        &proto::info_block_size(inf.block_size, inf.preferred, inf.max_payload),
                    ))
                    .await?;
                    wr.write_all(&reply(rep::ACK, &[])).await?;
                    wr.flush().await?;
                    if h.option == opt::GO {
                        return Ok(Some(Chosen {
                            slot: i,
                            structured,
                        }));
                    }
                }
                opt::STRUCTURED_REPLY => {
                    if !data.is_empty() {
                        wr.write_all(&err(
                            rep::ERR_INVALID,
                            "STRUCTURED_REPLY carries no data".into(),
                        ))
                        .await?;
                    } else if structured {
                        wr.write_all(&err(
                            rep::ERR_INVALID,
                            "structured replies already on".into(),
                        ))
                        .await?;
                    } else {
                        structured = true;
                        wr.write_all(&reply(rep::ACK, &[])).await?;
                    }
                }
                opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                    if !structured {
                        wr.write_all(&err(
                            rep::ERR_INVALID,
                            "meta contexts need structured replies first".into(),
                        ))
                        .await?;
                    } else {
                        // No meta context (such as base:allocation) is offered: an empty list.
                        wr.write_all(&reply(rep::ACK, &[])).await?;
                    }
                }
                opt::STARTTLS => {
                    wr.write_all(&err(
                        rep::ERR_UNSUP,
                        "TLS is not offered; use a Unix socket or a loopback address".into(),
                    ))
                    .await?;
                }
                other => {
                    wr.write_all(&err(
                        rep::ERR_UNSUP,
                        format!("option {other} ({}) is not supported", opt::name(other)),
                    ))
                    .await?;
                }
            }
            wr.flush().await?;
        }
    }

    /// The transmission phase of one connection; returns why it ended.
    async fn transmit<R, W>(
        self: Arc<Self>,
        mut rd: R,
        wr: W,
        chosen: Chosen,
        mut stop: watch::Receiver<bool>,
    ) -> String
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let opts = &self.opts;
        let reqs = Arc::new(Semaphore::new(opts.max_requests));
        let bytes = Arc::new(Semaphore::new(opts.max_buffered));
        let (tx, rx) = mpsc::channel::<Reply>(opts.max_requests);
        let (dead_tx, mut dead) = watch::channel(false);
        let writer = tokio::spawn(write_replies(
            wr,
            rx,
            chosen.structured,
            dead_tx,
            opts.write_timeout,
        ));
        let slot_index = chosen.slot;
        let max_payload = self.slots[slot_index].export.info().max_payload;
        let idle = opts.idle_timeout;
        let why = loop {
            let mut h = [0u8; Request::LEN];
            tokio::select! {
                r = rd.read_exact(&mut h) => if let Err(e) = r {
                    break if e.kind() == io::ErrorKind::UnexpectedEof {
                        "closed by the client".to_string()
                    } else {
                        format!("read failed: {e}")
                    };
                },
                _ = flag(&mut stop) => break "the server is stopping".into(),
                _ = flag(&mut dead) => break "writing a reply failed or timed out".into(),
                _ = tokio::time::sleep(idle), if !idle.is_zero() => {
                    break format!("no request for {idle:?}; closing");
                }
            }
            let req = match Request::parse(&h) {
                Ok(r) => r,
                Err(e) => break format!("protocol error: {e}; closing"),
            };
            if req.kind == cmd::DISC {
                break "disconnect requested".into();
            }
            let payload = matches!(req.kind, cmd::READ | cmd::WRITE) as u32 * req.length;
            if req.kind == cmd::WRITE && req.length > max_payload {
                // Its data cannot be skipped safely at this size: end the connection.
                break format!(
                    "WRITE of {} bytes, more than the {max_payload}-byte maximum payload; closing",
                    req.length
                );
            }
            // Bounds first: a request waits here, before its data is read or allocated, until
            // earlier ones have been answered (on this connection, and on all of them for the
            // server's payload budget). The wait ends when the server stops or the writer
            // gives up, so a client that stops reading cannot hold the server's stop.
            let want = payload.min(max_payload);
            let permits = tokio::select! {
                p = self.permits(&reqs, &bytes, want) => p,
                _ = flag(&mut stop) => break "the server is stopping".into(),
                _ = flag(&mut dead) => break "writing a reply failed or timed out".into(),
            };
            let Some(permits) = permits else {
                break "internal: a limit closed".into();
            };
            let data = if req.kind == cmd::WRITE {
                let mut b = BytesMut::zeroed(req.length as usize);
                let read = tokio::select! {
                    r = rd.read_exact(&mut b) => r.map(|_| ()),
                    _ = flag(&mut stop) => break "the server is stopping in a WRITE's data".into(),
                    _ = flag(&mut dead) => break "writing a reply failed or timed out".into(),
                };
                if let Err(e) = read {
                    break format!("reading the data of a WRITE failed: {e}");
                }
                b.freeze()
            } else {
                Bytes::new()
            };
            let me = Arc::clone(&self);
            let tx = tx.clone();
            tokio::spawn(async move {
                let slot = &me.slots[slot_index];
                let result = me.handle(slot, req, data).await;
                if let Err(e) = &result {
                    slot.stats.errors.fetch_add(1, Relaxed);
                    debug!(
                        cookie = req.cookie,
                        cmd = cmd::name(req.kind),
                        offset = req.offset,
                        len = req.length,
                        "NBD request failed: {e}"
                    );
                }
                let _ = tx
                    .send(Reply {
                        cookie: req.cookie,
                        result,
                        _permits: permits,
                    })
                    .await;
            });
        };
        // Let what is in flight finish and be answered.
        let _ = reqs.acquire_many(opts.max_requests as u32).await;
        drop(tx);
        let _ = writer.await;
        why
    }

    /// A request's permits: one of the connection's requests, and room for its payload in the
    /// connection's and the server's budgets (a payload larger than a whole budget waits for
    /// all of it).
    async fn permits(
        &self,
        reqs: &Arc<Semaphore>,
        bytes: &Arc<Semaphore>,
        want: u32,
    ) -> Option<Permits> {
        let req = Arc::clone(reqs).acquire_owned().await.ok()?;
        let (mut own, mut total) = (None, None);
        if want > 0 {
            let n = want.min(self.opts.max_buffered.min(u32::MAX as usize) as u32);
            own = Some(Arc::clone(bytes).acquire_many_owned(n).await.ok()?);
            let n = want.min(self.opts.max_buffered_total.min(u32::MAX as usize) as u32);
            total = Some(Arc::clone(&self.total).acquire_many_owned(n).await.ok()?);
        }
        Some(Permits {
            _req: req,
            _bytes: own,
            _total: total,
        })
    }

    async fn handle(&self, slot: &Slot<E>, req: Request, data: Bytes) -> Result<Done, NbdError> {
        let e = &slot.export;
        let inf = e.info();
        let st = &slot.stats;
        let fua = req.flags & cflag::FUA != 0 && inf.fua;
        let len = u64::from(req.length);
        let end = req.offset.checked_add(len);
        let in_range = end.is_some_and(|end| end <= inf.size);
        let range_error = |errno: u32| {
            NbdError::new(
                errno,
                format!(
                    "{} bytes at offset {} go past the end of the export ({} bytes)",
                    req.length, req.offset, inf.size
                ),
            )
        };
        let writable = || {
            if inf.read_only {
                Err(NbdError::new(errno::EPERM, "the export is read-only"))
            } else {
                Ok(())
            }
        };
        match req.kind {
            cmd::READ => {
                if !in_range {
                    return Err(range_error(errno::EINVAL));
                }
                if req.length > inf.max_payload {
                    return Err(NbdError::new(
                        errno::EINVAL,
                        format!(
                            "READ of {} bytes, more than the {}-byte maximum payload",
                            req.length, inf.max_payload
                        ),
                    ));
                }
                st.reads.fetch_add(1, Relaxed);
                st.read_bytes.fetch_add(len, Relaxed);
                let data = read_any(e.as_ref(), req.offset, req.length).await?;
                Ok(Done::Data {
                    offset: req.offset,
                    data,
                })
            }
            cmd::WRITE => {
                writable()?;
                if !in_range {
                    return Err(range_error(errno::ENOSPC));
                }
                st.writes.fetch_add(1, Relaxed);
                st.write_bytes.fetch_add(len, Relaxed);
                self.write_any(slot, req.offset, data, fua).await?;
                Ok(Done::Empty)
            }
            cmd::FLUSH => {
                if !inf.flush {
                    return Err(NbdError::new(errno::EINVAL, "FLUSH is not offered"));
                }
                st.flushes.fetch_add(1, Relaxed);
                e.flush().await?;
                Ok(Done::Empty)
            }
            cmd::TRIM => {
                writable()?;
                if !inf.trim {
                    return Err(NbdError::new(errno::EINVAL, "TRIM is not offered"));
                }
                if !in_range {
                    return Err(range_error(errno::EINVAL));
                }
                st.trims.fetch_add(1, Relaxed);
                // A hint: only the whole blocks inside the range are deallocated.
                let bs = u64::from(inf.block_size);
                let first = req.offset.div_ceil(bs) * bs;
                let last = (req.offset + len) / bs * bs;
                if last > first {
                    e.trim(first, (last - first) as u32).await?;
                }
                if fua && inf.flush {
                    e.flush().await?;
                }
                Ok(Done::Empty)
            }
            cmd::WRITE_ZEROES => {
                writable()?;
                if !inf.write_zeroes {
                    return Err(NbdError::new(errno::EINVAL, "WRITE_ZEROES is not offered"));
                }
                if !in_range {
                    return Err(range_error(errno::ENOSPC));
                }
                st.zeroes.fetch_add(1, Relaxed);
                let may_trim = req.flags & cflag::NO_HOLE == 0;
                let bs = u64::from(inf.block_size);
                let (start, stop) = (req.offset, req.offset + len);
                let first = start.div_ceil(bs) * bs;
                let last = stop / bs * bs;
                if last > first {
                    // Whole blocks in the middle; partial ones at the edges are written.
                    if first > start {
                        let n = (first - start) as usize;
                        self.write_any(slot, start, Bytes::from(vec![0u8; n]), fua)
                            .await?;
                    }
                    e.write_zeroes(first, (last - first) as u32, may_trim, fua)
                        .await?;
                    if stop > last {
                        let n = (stop - last) as usize;
                        self.write_any(slot, last, Bytes::from(vec![0u8; n]), fua)
                            .await?;
                    }
                } else if stop > start {
                    self.write_any(slot, start, Bytes::from(vec![0u8; len as usize]), fua)
                        .await?;
                }
                Ok(Done::Empty)
            }
            other => Err(NbdError::new(
                errno::EINVAL,
                format!("request type {other} ({}) is not offered", cmd::name(other)),
            )),
        }
    }

    /// A write of any alignment: whole blocks go straight to the export; otherwise the blocks
    /// it touches are read, patched and written back, one such cycle at a time per export.
    async fn write_any(
        &self,
        slot: &Slot<E>,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> Result<(), NbdError> {
        let e = &slot.export;
        let bs = u64::from(e.info().block_size);
        let len = data.len() as u64;
        if len == 0 {
            return Ok(());
        }
        if offset.is_multiple_of(bs) && len.is_multiple_of(bs) {
            return e.write(offset, data, fua).await;
        }
        slot.stats.unaligned.fetch_add(1, Relaxed);
        let start = offset / bs * bs;
        let stop = (offset + len).div_ceil(bs) * bs;
        let _g = slot.rmw.lock().await;
        let old = e.read(start, (stop - start) as u32).await?;
        let mut buf = BytesMut::from(&old[..]);
        let at = (offset - start) as usize;
        buf[at..at + data.len()].copy_from_slice(&data);
        e.write(start, buf.freeze(), fua).await
    }
}

/// A read of any alignment: widened to whole blocks, then cut.
async fn read_any<E: Export>(e: &E, offset: u64, len: u32) -> Result<Bytes, NbdError> {
    if len == 0 {
        return Ok(Bytes::new());
    }
    let bs = u64::from(e.info().block_size);
    let end = offset + u64::from(len);
    if offset.is_multiple_of(bs) && end.is_multiple_of(bs) {
        return e.read(offset, len).await;
    }
    let start = offset / bs * bs;
    let stop = end.div_ceil(bs) * bs;
    let wide = e.read(start, (stop - start) as u32).await?;
    let at = (offset - start) as usize;
    Ok(wide.slice(at..at + len as usize))
}

/// Resolves when the flag turns (or is) true; never when its sender is gone while false.
async fn flag(rx: &mut watch::Receiver<bool>) {
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Writes replies in the order requests finish, batching what is ready into one flush.
/// A reply (and the flush after a batch) that makes no progress for `timeout` fails the
/// connection: the client has stopped reading.
async fn write_replies<W: AsyncWrite + Unpin>(
    w: W,
    mut rx: mpsc::Receiver<Reply>,
    structured: bool,
    dead: watch::Sender<bool>,
    timeout: Duration,
) {
    let mut w = BufWriter::with_capacity(256 << 10, Stalls::new(w, timeout));
    let mut failed = false;
    while let Some(r) = rx.recv().await {
        if failed {
            // Keep taking replies so that their permits are given back.
            continue;
        }
        let res = write_reply(&mut w, &r, structured).await;
        let res = match res {
            Ok(()) if rx.is_empty() => w.flush().await,
            other => other,
        };
        if let Err(e) = res {
            if e.kind() == io::ErrorKind::TimedOut {
                warn!("NBD client took no reply data for {timeout:?}; closing its connection");
            } else {
                debug!("NBD reply write failed: {e}");
            }
            failed = true;
            let _ = dead.send(true);
        }
    }
    if !failed {
        let _ = w.flush().await;
        let _ = w.shutdown().await;
    }
}

/// A writer whose writes fail with `TimedOut` when the socket takes no byte for the timeout
/// (zero: never).
struct Stalls<W> {
    inner: W,
    timeout: Duration,
    /// Armed while a write is pending.
    timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<W> Stalls<W> {
    fn new(inner: W, timeout: Duration) -> Self {
        Stalls {
            inner,
            timeout,
            timer: None,
        }
    }

    /// What a poll of the inner writer gave, with the timer: a result disarms it; Pending arms
    /// it, and turns into `TimedOut` once it has run out.
    fn watch<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        r: std::task::Poll<io::Result<T>>,
    ) -> std::task::Poll<io::Result<T>> {
        use std::task::Poll;
        if r.is_ready() || self.timeout.is_zero() {
            self.timer = None;
            return r;
        }
        let timeout = self.timeout;
        let t = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match t.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::ErrorKind::TimedOut.into())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Stalls<W> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, r)
    }
}

async fn write_reply<W: AsyncWrite + Unpin>(
    w: &mut W,
    r: &Reply,
    structured: bool,
) -> io::Result<()> {
    match (&r.result, structured) {
        (Ok(Done::Empty), false) => w.write_all(&proto::simple_reply(r.cookie, 0)).await,
        (Ok(Done::Data { data, .. }), false) => {
            w.write_all(&proto::simple_reply(r.cookie, 0)).await?;
            w.write_all(data).await
        }
        (Err(e), false) => w.write_all(&proto::simple_reply(r.cookie, e.errno)).await,
        (Ok(Done::Empty), true) => {
            w.write_all(&proto::chunk_header(
                proto::chunk::FLAG_DONE,
                proto::chunk::NONE,
                r.cookie,
                0,
            ))
            .await
        }
        (Ok(Done::Data { offset, data }), true) => {
            w.write_all(&proto::chunk_offset_data(
                r.cookie,
                *offset,
                data.len() as u32,
            ))
            .await?;
            w.write_all(data).await
        }
        (Err(e), true) => {
            w.write_all(&proto::chunk_error(r.cookie, e.errno, &e.message))
                .await
        }
    }
}
