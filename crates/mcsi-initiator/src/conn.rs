//! One TCP connection: connect, login exchange, and the reader and writer of full feature phase.

use crate::error::Error;
use crate::negotiate::{Login, LoginConfig, LoginDone, LoginStep};
use crate::route::Bind;
use bytes::BytesMut;
use mcsi_proto::pdu::{decode, pdu_len, DecodeError, Encoded, Framing, Pdu};
use mcsi_tcp::Congestion;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// Most PDUs gathered into one vectored write.
const WRITE_BATCH: usize = 64;
/// Most bytes gathered into one vectored write: an immediate PDU queued meanwhile waits for at
/// most this much.
const WRITE_BATCH_BYTES: usize = 1 << 20;
/// Unsent bytes the kernel may hold for a connection (`TCP_NOTSENT_LOWAT`): beyond it, data
/// waits in the session's queue, where an immediate PDU (a ping, a Logout, ABORT TASK) can go
/// ahead of it, instead of behind megabytes in the socket on a slow route.
const NOTSENT_LOWAT: libc::c_int = 1 << 20;

/// How a connection is opened: its time limit, congestion control, source, and whether it is
/// Multipath TCP.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Dial<'a> {
    pub timeout: Duration,
    pub congestion: Option<Congestion>,
    pub bind: Option<&'a Bind>,
    pub mptcp: bool,
}

impl Dial<'_> {
    fn socket(&self, a: std::net::SocketAddr) -> Result<tokio::net::TcpSocket, Error> {
        if !self.mptcp {
            let s = if a.is_ipv4() {
                tokio::net::TcpSocket::new_v4()
            } else {
                tokio::net::TcpSocket::new_v6()
            };
            return s.map_err(|e| Error::io("opening a TCP socket", &e));
        }
        let s = mcsi_tcp::mptcp::socket(&a).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        s.set_nonblocking(true)
            .map_err(|e| Error::io("opening an MPTCP socket", &e))?;
        Ok(tokio::net::TcpSocket::from_std_stream(s.into()))
    }
}

/// Connect with a timeout; TCP_NODELAY because iSCSI PDUs are latency-bound requests. With a
/// congestion control, the socket runs that algorithm from its first segment on.
pub(crate) async fn connect_tcp(addr: &str, dial: &Dial<'_>) -> Result<TcpStream, Error> {
    let timeout = dial.timeout;
    let attempt = async {
        let mut last = None;
        let addrs = tokio::net::lookup_host(addr)
            .await
            .map_err(|e| Error::io(format!("cannot resolve {addr}"), &e))?;
        for a in addrs {
            let sock = dial.socket(a)?;
            if let Some(cc) = dial.congestion {
                cc.apply(&sock)
                    .map_err(|e| Error::io("setting TCP_CONGESTION", &std::io::Error::other(e)))?;
            }
            if let Some(b) = dial.bind {
                if let Err(e) = b.apply(&sock, a) {
                    last = Some(e);
                    continue;
                }
            }
            match sock.connect(a).await {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        let e = last.unwrap_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "the name has no address")
        });
        Err(Error::io(
            format!("cannot connect to {addr}{}", from(dial)),
            &e,
        ))
    };
    let s = tokio::time::timeout(timeout, attempt).await.map_err(|_| {
        Error::Timeout(format!(
            "connecting to {addr}{} took longer than {timeout:?}",
            from(dial)
        ))
    })??;
    s.set_nodelay(true)
        .map_err(|e| Error::io("setting TCP_NODELAY", &e))?;
    set_notsent_lowat(&s);
    Ok(s)
}

/// Best effort: a kernel without `TCP_NOTSENT_LOWAT` (before 3.12) keeps its own buffering.
fn set_notsent_lowat(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let v = NOTSENT_LOWAT;
    // SAFETY: v outlives the call and its size is passed.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NOTSENT_LOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        tracing::debug!(
            "TCP_NOTSENT_LOWAT not set: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn from(dial: &Dial<'_>) -> String {
    let mut s = dial.bind.map_or(String::new(), |b| format!(" from {b}"));
    if dial.mptcp {
        s.push_str(" over MPTCP");
    }
    s
}

/// Slices per vectored write (well under the system's IOV_MAX of 1024).
const MAX_IOV: usize = 64;

/// Write PDUs with vectored writes: header, payload (not copied) and trailer of each.
pub(crate) async fn write_encoded<W: AsyncWrite + Unpin>(
    w: &mut W,
    batch: &[Encoded],
) -> std::io::Result<()> {
    let mut g = mcsi_proto::pdu::Gather::new(batch);
    let mut slices = Vec::with_capacity(MAX_IOV.min(3 * batch.len()));
    while !g.done() {
        g.fill(&mut slices, MAX_IOV);
        let n = w.write_vectored(&slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        g.advance(n);
    }
    Ok(())
}

/// Read one PDU (login, discovery: one request, one response at a time).
pub(crate) async fn read_pdu<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut BytesMut,
    framing: &Framing,
) -> Result<Pdu, Error> {
    loop {
        match decode(buf, framing) {
            Ok(Some(p)) => return Ok(p),
            Ok(None) => {}
            Err(e) => return Err(Error::Decode(e)),
        }
        let want = pdu_len(buf, framing).unwrap_or(48).max(4096);
        buf.reserve(want);
        let n = r
            .read_buf(buf)
            .await
            .map_err(|e| Error::io("reading from the target", &e))?;
        if n == 0 {
            return Err(Error::Io {
                context: "reading from the target".into(),
                kind: std::io::ErrorKind::UnexpectedEof,
                message: "the target closed the connection".into(),
            });
        }
    }
}

/// What a login on a fresh connection produced.
#[derive(Debug)]
pub(crate) enum LoginOutcome {
    /// Logged in, with the bytes that followed the final Login Response (PDUs the target sent
    /// before any request, such as a NOP-In or an Async Message), for the connection's reader.
    Done(Box<LoginDone>, BytesMut),
    Redirect(String),
}

/// Run the login exchange on a connected stream.
pub(crate) async fn login(
    stream: &mut TcpStream,
    cfg: LoginConfig,
    timeout: Duration,
) -> Result<LoginOutcome, Error> {
    // The login's deadline is the core's; this layer only sleeps to it.
    let mut login = Login::new(&cfg)?;
    let first = login.start_at(tokio::time::Instant::now().into_std(), timeout);
    let deadline = login.poll_timeout();
    let fut = async {
        // During login both sides accept 8192-byte data segments and no digests (12.12, 13.1).
        let framing = Framing::default();
        let mut req = first;
        let mut buf = BytesMut::with_capacity(16384);
        loop {
            let enc = Pdu::LoginRequest(req).encode(&framing);
            write_encoded(stream, std::slice::from_ref(&enc))
                .await
                .map_err(|e| Error::io("sending a login request", &e))?;
            let resp = match read_pdu(stream, &mut buf, &framing).await? {
                Pdu::LoginResponse(r) => r,
                other => {
                    return Err(Error::Protocol(format!(
                        "expected a Login Response, got {:?}",
                        other.opcode()
                    )))
                }
            };
            match login.handle(&resp)? {
                LoginStep::Send(next) => req = next,
                LoginStep::Done(d) => return Ok(LoginOutcome::Done(d, buf)),
                LoginStep::Redirect(a) => return Ok(LoginOutcome::Redirect(a)),
            }
        }
    };
    let Some(deadline) = deadline else {
        return fut.await;
    };
    match tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), fut).await {
        Ok(r) => r,
        Err(_) => {
            login.handle_timeout(tokio::time::Instant::now().into_std())?;
            Err(Error::Timeout(format!(
                "login took longer than {timeout:?}"
            )))
        }
    }
}

/// A session's sending limit as one connection's writer sees it: the bucket the session's
/// writers share, and this connection's segment size for the wire bytes of a send.
pub(crate) struct Pace {
    pub bucket: std::sync::Arc<std::sync::Mutex<mcsi_tcp::pace::TokenBucket>>,
    pub mss: u32,
}

impl Pace {
    /// Waits until the bucket lets a send go.
    async fn ready(&self) {
        loop {
            let at = {
                let b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
                b.ready_at(std::time::Instant::now())
            };
            match at {
                Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
                None => return,
            }
        }
    }

    fn burst(&self) -> usize {
        let b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        usize::try_from(b.burst()).unwrap_or(usize::MAX).max(1)
    }

    fn spend(&self, bytes: usize) {
        let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        b.spend(
            mcsi_tcp::pace::wire_bytes(bytes as u64, self.mss),
            std::time::Instant::now(),
        );
    }
}

/// Sending half of a connection: takes PDUs from the channel and writes them in batches. With
/// `pace`, each batch (no larger than the bucket's burst) waits for the session's bucket.
pub(crate) async fn writer<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::UnboundedReceiver<Pdu>,
    mut urgent: mpsc::UnboundedReceiver<Pdu>,
    framing: Framing,
    pace: Option<Pace>,
) -> std::io::Result<()> {
    let mut batch: Vec<Encoded> = Vec::with_capacity(WRITE_BATCH);
    let max_bytes = pace
        .as_ref()
        .map_or(WRITE_BATCH_BYTES, |p| p.burst().min(WRITE_BATCH_BYTES));
    loop {
        // Immediate control PDUs first; they carry no CmdSN order with the queued data.
        let first = tokio::select! {
            biased;
            Some(p) = urgent.recv() => p,
            p = rx.recv() => match p {
                Some(p) => p,
                None => break,
            },
        };
        batch.push(first.encode_owned(&framing));
        while let Ok(p) = urgent.try_recv() {
            batch.push(p.encode_owned(&framing));
        }
        let mut bytes: usize = batch.iter().map(Encoded::len).sum();
        while batch.len() < WRITE_BATCH && bytes < max_bytes {
            match rx.try_recv() {
                Ok(p) => {
                    let e = p.encode_owned(&framing);
                    bytes += e.len();
                    batch.push(e);
                }
                Err(_) => break,
            }
        }
        if let Some(p) = &pace {
            p.ready().await;
            p.spend(bytes);
        }
        write_encoded(&mut w, &batch).await?;
        batch.clear();
    }
    // The session closed the channel: finish the stream.
    w.shutdown().await
}

/// A PDU from the target: whole, or with a data digest error and its header sound (handed on
/// at ErrorRecoveryLevel 1 and above, where what it lost is asked for again).
pub(crate) enum Incoming {
    Whole(Pdu),
    Damaged(Pdu),
}

/// Receiving half: decodes PDUs and hands each read's worth to `sink` in one call. With
/// `recover` (ErrorRecoveryLevel 1 and above) a PDU with a data digest error is handed on as
/// [`Incoming::Damaged`]; otherwise, and for any other error, the connection ends.
pub(crate) async fn reader<R, F>(
    mut r: R,
    framing: Framing,
    leftover: BytesMut,
    recover: bool,
    mut sink: F,
) -> Error
where
    R: AsyncRead + Unpin,
    F: FnMut(Vec<Incoming>) -> bool,
{
    let mut buf = BytesMut::with_capacity(256 * 1024);
    // What arrived with the final Login Response is read first, in full-feature framing.
    buf.extend_from_slice(&leftover);
    loop {
        let mut pdus = Vec::new();
        loop {
            match decode(&mut buf, &framing) {
                Ok(Some(p)) => pdus.push(Incoming::Whole(p)),
                Ok(None) => break,
                Err(DecodeError::DataDigest {
                    damaged: Some(p), ..
                }) if recover => pdus.push(Incoming::Damaged(*p)),
                Err(e) => {
                    // At ERL 0 any digest or framing error ends the connection (7.1.1).
                    if !pdus.is_empty() {
                        sink(pdus);
                    }
                    return Error::Decode(e);
                }
            }
        }
        if !pdus.is_empty() && !sink(pdus) {
            return Error::Closed;
        }
        let want = pdu_len(&buf, &framing).unwrap_or(0).max(64 * 1024);
        if buf.capacity() - buf.len() < want {
            buf.reserve(want.max(256 * 1024));
        }
        match r.read_buf(&mut buf).await {
            Ok(0) => {
                return Error::Io {
                    context: "reading from the target".into(),
                    kind: std::io::ErrorKind::UnexpectedEof,
                    message: "the target closed the connection".into(),
                }
            }
            Ok(_) => {}
            Err(e) => return Error::io("reading from the target", &e),
        }
    }
}
