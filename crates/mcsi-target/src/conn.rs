//! One connection in full feature phase: a reader that decodes PDUs and dispatches them, and a
//! writer that stamps sequence numbers and sends queued PDUs with vectored writes.

use crate::control;
use crate::scsi;
use crate::session::{Arrival, Conn, Out, OutQueue, Session, Units};
use crate::session_core::RunNow;
use bytes::BytesMut;
use mcsi_proto::pdu::{self, DecodeError, Encoded, Framing, Gather, Pdu, SnackRequest};
use mcsi_proto::vendor::ConnRole;
use mcsi_target_core::retain::{SentLog, SnackRefused};
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, warn};

/// Most bytes gathered into one vectored write.
const BATCH_BYTES: usize = 4 << 20;
/// Most slices per `writev` call (well under IOV_MAX).
const MAX_IOV: usize = 64;

/// Why a connection in full feature phase ended, as the reader saw it. Logged, and handed to
/// the session: at ErrorRecoveryLevel 0 every end but a logout takes the session with it.
#[derive(Debug, thiserror::Error)]
pub enum ConnEnd {
    #[error("closed by the initiator")]
    ClosedByInitiator,
    #[error("read failed: {0}")]
    Read(#[source] io::Error),
    /// The target dropped it (logout, reinstatement, session close, shutdown).
    #[error("dropped by the target")]
    Dropped,
    /// The writer gave up: the initiator took no data for the send timeout, or a write failed.
    #[error("the connection's writer ended (send timeout or write error)")]
    WriterEnded,
    /// A PDU that cannot be decoded and cannot be answered with a Reject.
    #[error("unrecoverable PDU error: {0}")]
    Decode(#[source] DecodeError),
    /// A protocol error ErrorRecoveryLevel 0 cannot recover (a Data-Out on the wrong
    /// connection or breaking its transfer).
    #[error(transparent)]
    Fault(#[from] mcsi_target_core::session::Fault),
}

/// Writes every slice of every PDU, resuming after partial writes.
pub async fn write_batch<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    batch: &[Encoded],
) -> io::Result<()> {
    write_batch_within(w, batch, None).await
}

/// The least a connection with data waiting must send: [`SEND_MIN_RATE`] bytes per second over
/// each period of the send timeout. A peer that reads a packet now and then (one every 29 s
/// against a 30 s timeout) would otherwise hold its connection, its session and their memory
/// for ever.
#[derive(Debug)]
pub struct SendPace {
    timeout: Duration,
    /// Bytes due in each period.
    due: u64,
    start: Instant,
    sent: u64,
}

/// 4 KiB/s (32 kbit/s): far below any link this target serves, far above a peer that reads a
/// packet per timeout.
pub const SEND_MIN_RATE: u64 = 4096;

/// Why the writer gave up on a slow or stalled peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooSlow {
    /// Bytes the socket took in the last period.
    pub sent: u64,
    pub due: u64,
}

impl SendPace {
    /// `None` when the timeout is off (zero).
    pub fn new(timeout: Duration) -> Option<SendPace> {
        (!timeout.is_zero()).then(|| SendPace {
            timeout,
            due: (SEND_MIN_RATE as f64 * timeout.as_secs_f64()) as u64,
            start: Instant::now(),
            sent: 0,
        })
    }

    /// A new period begins (the writer had nothing to send before this batch).
    pub fn restart(&mut self) {
        self.start = Instant::now();
        self.sent = 0;
    }

    fn deadline(&self) -> Instant {
        self.start + self.timeout
    }

    /// The socket took `n` bytes (or `0` at the deadline): at the end of a period, the period's
    /// bytes must reach its due (or the batch be done) for a new one to start.
    fn progress(&mut self, n: u64, batch_done: bool) -> Result<(), TooSlow> {
        self.sent += n;
        let now = Instant::now();
        if now < self.deadline() {
            return Ok(());
        }
        if self.sent < self.due && !batch_done {
            return Err(TooSlow {
                sent: self.sent,
                due: self.due,
            });
        }
        self.start = now;
        self.sent = 0;
        Ok(())
    }
}

/// Like [`write_batch`], failing with `TimedOut` when the socket falls below the pace (a peer
/// that does not read, or reads only a trickle); the pace's [`TooSlow`] says by how much.
pub async fn write_batch_within<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    batch: &[Encoded],
    mut pace: Option<&mut SendPace>,
) -> io::Result<()> {
    let mut g = Gather::new(batch);
    let mut slices = Vec::with_capacity(MAX_IOV.min(3 * batch.len()));
    while !g.done() {
        g.fill(&mut slices, MAX_IOV);
        let n = match pace.as_deref_mut() {
            None => w.write_vectored(&slices).await?,
            Some(p) => match tokio::time::timeout_at(p.deadline(), w.write_vectored(&slices)).await
            {
                Ok(r) => r?,
                Err(_) => {
                    p.progress(0, false).map_err(too_slow)?;
                    continue;
                }
            },
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        g.advance(n);
        if let Some(p) = pace.as_deref_mut() {
            p.progress(n as u64, g.done()).map_err(too_slow)?;
        }
    }
    Ok(())
}

fn too_slow(t: TooSlow) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, SlowPeer(t))
}

/// The error inside a `TimedOut` from [`write_batch_within`].
#[derive(Debug, thiserror::Error)]
#[error("the initiator took {} bytes in the last period ({} due)", .0.sent, .0.due)]
pub struct SlowPeer(pub TooSlow);

/// The writer of one connection: drains the queue, stamps, coalesces into vectored writes, and
/// gives the connection's output budget back as it goes ([`OutQueue`]). A socket that takes no
/// byte for `send_timeout`, or falls below the least rate ([`SendPace`]), or fails, ends the
/// connection (its reader is stopped through `conn`, which may be parked in a read of a socket
/// the peer sends nothing on: a response connection).
#[allow(clippy::too_many_arguments)]
pub async fn writer<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::UnboundedReceiver<Out>,
    conn: std::sync::Weak<Conn>,
    session: Arc<Session>,
    out: Arc<OutQueue>,
    log: Option<Arc<std::sync::Mutex<SentLog>>>,
    framing: Framing,
    mut stat_sn: u32,
    send_timeout: Duration,
) {
    let mut batch: Vec<Encoded> = Vec::new();
    // What this batch sent for the first time, for the log (ErrorRecoveryLevel 1 and above).
    let mut sent: Vec<Pdu> = Vec::new();
    let mut pace = SendPace::new(send_timeout);
    let mut failed = false;
    // With a bandwidth toward the client, a batch is no larger than the bucket's burst (one
    // PDU at least): what goes out at once stays what the rate allows.
    let qos = session.qos().filter(|q| q.to_client.is_some());
    let batch_limit = qos
        .and_then(|q| q.to_client)
        .map_or(BATCH_BYTES, |(_, burst)| (burst as usize).min(BATCH_BYTES));
    loop {
        // A period of the pace starts with the first batch after the writer had nothing to do.
        let idle = out.queued() == 0;
        let Some(first) = rx.recv().await else { break };
        if idle {
            if let Some(p) = pace.as_mut() {
                p.restart();
            }
        }
        let mut close = false;
        let mut bytes = 0usize;
        let mut queued = 0u64;
        let mut next = Some(first);
        // One look at the window per batch (published by the session core, no lock taken).
        let (exp, max) = session.cmd_sns();
        while let Some(out) = next.take() {
            match out {
                Out::Pdu(mut p) => {
                    queued += OutQueue::size_of(&p);
                    p.stamp(&mut stat_sn, exp, max);
                    // A logged PDU is encoded from a borrow (its data shared, not copied) and
                    // then moved into the log: no copy of the PDU itself.
                    let e = if log.is_some() {
                        let e = p.encode(&framing);
                        sent.push(p);
                        e
                    } else {
                        p.encode_owned(&framing)
                    };
                    bytes += e.len();
                    batch.push(e);
                }
                Out::Again(mut p) => {
                    queued += OutQueue::size_of(&p);
                    p.restamp(stat_sn, exp, max);
                    let e = p.encode_owned(&framing);
                    bytes += e.len();
                    batch.push(e);
                }
                Out::Close => {
                    close = true;
                    break;
                }
            }
            if bytes < batch_limit {
                next = rx.try_recv().ok();
            }
        }
        if let (Some(log), false) = (&log, sent.is_empty()) {
            let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
            for p in sent.drain(..) {
                log.record(p);
            }
        }
        if let Some(q) = qos {
            q.send(bytes as u64).await;
            // The wait was the target's own, not the peer's: the pace starts over.
            if let Some(p) = pace.as_mut() {
                p.restart();
            }
        }
        match write_batch_within(&mut w, &batch, pace.as_mut()).await {
            Ok(()) => out.sent(queued),
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                let sent = e
                    .get_ref()
                    .and_then(|i| i.downcast_ref::<SlowPeer>())
                    .map_or(0, |s| s.0.sent);
                if sent == 0 {
                    warn!(
                        "send timeout: the initiator took no data for {send_timeout:?} ({} bytes queued); dropping the connection",
                        out.queued()
                    );
                } else {
                    warn!(
                        "send timeout: the initiator took {sent} bytes in {send_timeout:?}, below {} bytes/s ({} bytes queued); dropping the connection",
                        SEND_MIN_RATE,
                        out.queued()
                    );
                }
                failed = true;
                break;
            }
            Err(e) => {
                debug!("write failed: {e}");
                failed = true;
                break;
            }
        }
        batch.clear();
        if close {
            break;
        }
    }
    // Nothing queued will be sent now: a reader waiting for room must not wait for it. What
    // was queued and not sent is kept for reassignment (ErrorRecoveryLevel 2).
    if let Some(log) = &log {
        let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
        while let Ok(o) = rx.try_recv() {
            if let Out::Pdu(p) | Out::Again(p) = o {
                log.record_unsent(p);
            }
        }
    }
    out.close();
    if failed {
        if let Some(c) = conn.upgrade() {
            c.stop();
        }
    }
    drop(rx);
    let _ = w.shutdown().await;
}

/// The bytes of a PDU by its header: the header and the data segment it announces.
fn pdu_bytes(header: &[u8]) -> u64 {
    let data = header
        .get(5..8)
        .map_or(0, |b| u32::from_be_bytes([0, b[0], b[1], b[2]]));
    (pdu::BHS_LEN as u64) + u64::from(data)
}

/// The reader side of one connection in full feature phase.
pub struct Reader {
    pub session: Arc<Session>,
    pub conn: Arc<Conn>,
    pub framing: Framing,
    pub buf: BytesMut,
    /// How often at most the session's core is told that bytes arrived (for its keepalive,
    /// which pings at most this much early); zero: never (pings are off).
    pub heard_every: Duration,
    /// Bytes of the last PDU taken (header and data segment), to size the next reservation.
    pub last_pdu: usize,
    /// When the core is next told that bytes arrived ([`Reader::heard`]).
    pub next_heard: Instant,
    /// The last ExpStatSN handed to the connection's log (ErrorRecoveryLevel 1 and above).
    pub exp_stat_sn: Option<u32>,
}

impl Reader {
    /// Reads and dispatches until the connection ends. Returns whether it ended cleanly (logout
    /// or replaced by connection reinstatement).
    pub async fn run<R: AsyncRead + Unpin>(mut self, mut rd: R, mut stop: watch::Receiver<bool>) {
        // Whether PDUs were handled since the last read.
        let mut handled = false;
        let why = loop {
            // Output budget spent (a peer that does not read what it asked for): take no more
            // requests until the writer has sent some; TCP's flow control then stops the peer.
            if self.conn.out.full() {
                tokio::select! {
                    _ = self.conn.out.room() => {}
                    _ = crate::session::flag_set(&mut stop) => break ConnEnd::Dropped,
                }
                if self.conn.out.is_closed() {
                    break ConnEnd::WriterEnded;
                }
                continue;
            }
            // In the asymmetric mode this connection's commands are answered on the response
            // connections: when every one of them is at its budget, wait for room there too.
            if self.session.ops.asymmetric
                && self.conn.role == ConnRole::Requests
                && self.session.responses_full()
            {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                    _ = crate::session::flag_set(&mut stop) => break ConnEnd::Dropped,
                }
                continue;
            }
            // Decode everything buffered first.
            match pdu::decode(&mut self.buf, &self.framing) {
                Ok(Some(p)) => {
                    self.last_pdu = pdu::BHS_LEN + p.data_len();
                    // With a bandwidth toward storage, what no R2T asked for costs it now
                    // (solicited data was charged when its R2T went out).
                    if self.session.storage_paced()
                        && !matches!(&p, Pdu::DataOut(d) if d.ttt != pdu::RESERVED_TAG)
                    {
                        self.session.charge_storage(self.last_pdu as u64);
                    }
                    if let Err(e) = self.dispatch(p) {
                        break e;
                    }
                    handled = true;
                    continue;
                }
                Ok(None) => {}
                Err(DecodeError::DataDigest {
                    header, damaged, ..
                }) => {
                    // Rejected; from ErrorRecoveryLevel 1 on its data is asked for again.
                    debug!("data digest error: rejecting the PDU's data");
                    // Its bytes cost the bandwidth toward storage, unless it names an R2T (the
                    // core charges those it does not take as part of one).
                    if self.session.storage_paced()
                        && !matches!(damaged.as_deref(), Some(Pdu::DataOut(d)) if d.ttt != pdu::RESERVED_TAG)
                    {
                        self.session.charge_storage(pdu_bytes(&header));
                    }
                    self.conn
                        .counters
                        .digest_errors
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let (a, units) = self.session.handle_data_digest_error(
                        &self.conn,
                        header,
                        damaged.map(|p| *p),
                    );
                    if let Err(e) = self.carry_out(a, &units) {
                        break e;
                    }
                    continue;
                }
                Err(e) => {
                    if let (true, Some(reason), Some(h)) =
                        (e.consumed(), e.reject_reason(), e.rejected_header())
                    {
                        debug!("rejecting PDU: {e}");
                        if self.session.storage_paced() {
                            self.session.charge_storage(pdu_bytes(h));
                        }
                        let runs = self
                            .session
                            .handle_undecodable(&self.conn, reason, h.clone());
                        control::run_all(&self.session, runs);
                        continue;
                    }
                    break ConnEnd::Decode(e);
                }
            }
            if *stop.borrow() {
                break ConnEnd::Dropped;
            }
            if handled {
                // Let the writer send the responses of this batch (it was woken on this worker
                // thread and runs when the reader yields) before the next read, so that one
                // write carries them all.
                handled = false;
                tokio::task::yield_now().await;
            }
            // Reserve for the next PDU (capped by the codec's limit on data segment length),
            // and at least for one as large as the last with room for the header after it: PDUs
            // are handed on as slices of this buffer, so one that straddles two allocations is
            // copied into the second, and a stream of PDUs just over the reservation (64 KiB
            // writes) would have each of them copied.
            let need = pdu::pdu_len(&self.buf, &self.framing).unwrap_or(pdu::BHS_LEN);
            let len = self.buf.len();
            if self.buf.capacity() - len < need.saturating_sub(len).max(4096) {
                let room = need
                    .saturating_sub(len)
                    .max(64 * 1024)
                    .max(self.last_pdu + 4096);
                self.buf.reserve(room);
            }
            // With a bandwidth toward storage, the next read waits while the session's bucket
            // is in deficit: the initiator's sends then wait in TCP's flow control.
            if self.session.storage_paced() {
                tokio::select! {
                    _ = self.session.before_read() => {}
                    _ = crate::session::flag_set(&mut stop) => break ConnEnd::Dropped,
                }
            }
            tokio::select! {
                r = rd.read_buf(&mut self.buf) => match r {
                    Ok(0) => break ConnEnd::ClosedByInitiator,
                    Ok(_) => self.heard(),
                    Err(e) => break ConnEnd::Read(e),
                },
                _ = crate::session::flag_set(&mut stop) => break ConnEnd::Dropped,
            }
        };
        self.conn.stop();
        self.session
            .connection_ended(&self.conn, &why.to_string())
            .await;
    }

    /// Bytes arrived: the session's core hears of it, at most once per `heard_every`.
    fn heard(&mut self) {
        if self.heard_every.is_zero() {
            return;
        }
        let now = Instant::now();
        if now >= self.next_heard {
            self.session.heard(&self.conn, now.into_std());
            self.next_heard = now + self.heard_every;
        }
    }

    /// Handles one PDU: the session's core takes it ([`Session::handle_pdu`]); this reader
    /// runs what is to run now and carries out what came up in CmdSN order. An Err ends the
    /// connection.
    fn dispatch(&mut self, p: Pdu) -> Result<(), ConnEnd> {
        // Only a connection that keeps a log looks at ExpStatSN, and takes its lock only when
        // it moved.
        if let Some(log) = &self.conn.log {
            if let Some(e) = p.exp_stat_sn().filter(|e| self.exp_stat_sn != Some(*e)) {
                self.exp_stat_sn = Some(e);
                log.lock().unwrap_or_else(|e| e.into_inner()).ack(e);
            }
        }
        let (a, units) = self.session.handle_pdu(&self.conn, p);
        self.carry_out(a, &units)
    }

    /// Carries out what the session's core decided for a PDU: runs what is to run now on this
    /// reader, what came up in CmdSN order, or answers a SNACK. An Err ends the connection.
    fn carry_out(&mut self, a: Arrival, units: &Units) -> Result<(), ConnEnd> {
        match a {
            Arrival::Now(now) => {
                if let Some(units) = units.as_ref() {
                    let RunNow {
                        cmd,
                        phase,
                        data,
                        claim,
                    } = now;
                    scsi::run_inline(&self.session, units, &self.conn, &cmd, phase, data, claim);
                }
            }
            Arrival::Taken { runs, note } => {
                if let Some(note) = note {
                    debug!(parent: &self.conn.span, "{note}");
                }
                control::run_all(&self.session, runs);
            }
            Arrival::Snack(s) => self.snack(s),
            // At ErrorRecoveryLevel 0 the connection, and with it the session, ends (RFC 7143
            // 7.1.4.1, 7.2).
            Arrival::End(fault) => return Err(fault.into()),
        }
        Ok(())
    }

    /// A SNACK (ErrorRecoveryLevel 1 and above): what it asks for is sent again from the
    /// connection's log, or it is rejected (11.16, 11.17.1).
    fn snack(&mut self, s: SnackRequest) {
        use std::sync::atomic::Ordering::Relaxed;
        self.conn.counters.snacks.fetch_add(1, Relaxed);
        let answer = match &self.conn.log {
            Some(log) => log
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .snack(&s, self.conn.ops.send_mrdsl),
            None => Err(SnackRefused::NothingKept),
        };
        match answer {
            Ok(pdus) => {
                debug!(
                    parent: &self.conn.span,
                    snack_type = s.snack_type,
                    itt = format_args!("{:#x}", s.itt),
                    beg_run = s.beg_run,
                    run_length = s.run_length,
                    "SNACK: sending {} PDUs again",
                    pdus.len()
                );
                self.conn
                    .counters
                    .resent
                    .fetch_add(pdus.len() as u64, Relaxed);
                self.conn.send_again(pdus);
            }
            Err(e) => {
                warn!(parent: &self.conn.span, "SNACK rejected: {e}");
                let reason = e.reject_reason();
                self.conn
                    .send(Pdu::reject_of(reason, &Pdu::SnackRequest(s)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use mcsi_proto::pdu::NopIn;

    /// A NOP-In carrying `data`, encoded.
    fn nop_in(data: Bytes) -> Encoded {
        Pdu::NopIn(NopIn {
            lun: 0,
            itt: 1,
            ttt: 0xffff_ffff,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            data,
        })
        .encode(&Framing {
            max_data_segment_length: 1 << 20,
            ..Framing::default()
        })
    }

    #[tokio::test]
    async fn a_socket_that_takes_nothing_times_out() {
        struct Stuck;
        impl tokio::io::AsyncWrite for Stuck {
            fn poll_write(
                self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
                _: &[u8],
            ) -> std::task::Poll<io::Result<usize>> {
                std::task::Poll::Pending
            }
            fn poll_flush(
                self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<io::Result<()>> {
                std::task::Poll::Ready(Ok(()))
            }
            fn poll_shutdown(
                self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<io::Result<()>> {
                std::task::Poll::Ready(Ok(()))
            }
        }
        let batch = vec![nop_in(Bytes::from_static(b"ping"))];
        let mut pace = SendPace::new(Duration::from_millis(30)).expect("a pace");
        let e = write_batch_within(&mut Stuck, &batch, Some(&mut pace))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }

    /// A peer that reads a little now and then, on tokio's paused clock: 1 KiB every 29 s
    /// against a 30 s timeout is below the least rate (4 KiB/s, 120 KiB per period) and ends the
    /// write within two periods; 8 KiB/s keeps it going to the end.
    #[tokio::test(start_paused = true)]
    async fn a_peer_that_reads_a_trickle_is_cut_off() {
        async fn run(chunk: usize, every: Duration) -> (io::Result<()>, Duration) {
            let (mut near, mut far) = tokio::io::duplex(16 << 10);
            let reader = tokio::spawn(async move {
                let mut buf = vec![0u8; chunk];
                loop {
                    tokio::time::sleep(every).await;
                    match tokio::io::AsyncReadExt::read(&mut far, &mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                }
            });
            let batch = vec![nop_in(Bytes::from(vec![0u8; 1 << 20]))];
            let t0 = Instant::now();
            let mut pace = SendPace::new(Duration::from_secs(30)).expect("a pace");
            let r = write_batch_within(&mut near, &batch, Some(&mut pace)).await;
            let took = t0.elapsed();
            drop(near);
            reader.abort();
            (r, took)
        }
        let (r, took) = run(1024, Duration::from_secs(29)).await;
        let e = r.expect_err("a trickle is cut off");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        let slow = e
            .get_ref()
            .and_then(|i| i.downcast_ref::<SlowPeer>())
            .expect("the pace says why");
        assert!(slow.0.sent < slow.0.due, "{:?}", slow.0);
        assert!(took <= Duration::from_secs(60), "cut off after {took:?}");
        // 8 KiB/s: 1 MiB in about 128 s, never below the pace.
        let (r, took) = run(8192, Duration::from_secs(1)).await;
        assert!(r.is_ok(), "{r:?}");
        assert!(took >= Duration::from_secs(100), "{took:?}");
    }

    #[tokio::test]
    async fn partial_vectored_writes_resume() {
        // A writer that accepts at most 7 bytes per call.
        struct Trickle(Vec<u8>);
        impl tokio::io::AsyncWrite for Trickle {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<io::Result<usize>> {
                let n = buf.len().min(7);
                self.0.extend_from_slice(&buf[..n]);
                std::task::Poll::Ready(Ok(n))
            }
            fn poll_flush(
                self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<io::Result<()>> {
                std::task::Poll::Ready(Ok(()))
            }
            fn poll_shutdown(
                self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<io::Result<()>> {
                std::task::Poll::Ready(Ok(()))
            }
        }
        let data = Bytes::from((0..=250u8).collect::<Vec<u8>>());
        let p = Pdu::NopIn(NopIn {
            lun: 0,
            itt: 3,
            ttt: pdu::RESERVED_TAG,
            stat_sn: 1,
            exp_cmd_sn: 2,
            max_cmd_sn: 3,
            data,
        });
        let f = Framing::default();
        let batch = vec![p.encode(&f), p.encode(&f)];
        let mut expect = batch[0].to_vec();
        expect.extend(batch[1].to_vec());
        let mut w = Trickle(Vec::new());
        write_batch(&mut w, &batch).await.unwrap();
        assert_eq!(w.0, expect);
        // 48-byte header + 251 data + 1 pad byte, twice.
        assert_eq!(w.0.len(), 2 * (48 + 252));
    }
}
