//! A TCP for the simulator, written to behave as Linux's does where the research looks: the
//! initial window of 10 segments, Reno or CUBIC (RFC 9438, β 0.7, C 0.4, fast convergence, the
//! Reno-friendly region), the window grown only while it limits the sender, and restarted
//! after an idle RTO (Linux's `tcp_slow_start_after_idle`); loss detection by RACK and tail
//! loss probes (RFC 8985, Linux's only mode since 5.10: a segment is lost once one sent after
//! it was delivered and a reordering window has passed, so a lost retransmission is found as
//! a first loss is), SACK, a retransmission timeout of RFC 6298 with Linux's 200 ms floor (one
//! window cut per loss episode, however many timeouts it takes), timestamps (an RTT sample per
//! ACK; a spurious timeout is undone), delayed ACKs (every second full segment, or 40 ms),
//! window updates when the application frees buffer, and zero-window probes. It keeps its state
//! where a simulation can read it ([`Host::tcp_state`], the fields of Linux's `TCP_INFO` that
//! mcsi uses).
//!
//! Segments are IPv4 packets, so that the link model classifies and times them as it does real
//! ones: a 20-byte IP header, then ports, 32-bit sequence and acknowledgement numbers, flags and
//! the window; the header is as long as Linux's with timestamps (32 bytes) plus a SACK option
//! of up to 3 blocks. Left out: the FIN handshake (connections are never closed), window
//! scaling limits (the window field is 32 bits), HyStart, PRR (the window drops to ssthresh at
//! once), DSACK (so reordering is never learnt and the reordering window stays at its start),
//! and pacing.

use crate::stream::Stream;
use crate::timers::Timers;
use bytes::{Buf, BytesMut};
use mcsi_link::Nanos;
use std::collections::{BTreeMap, HashMap, VecDeque};

const MS: Nanos = 1_000_000;
/// Linux's minimum RTO and its initial one (RFC 6298: 1 s).
const RTO_MIN: Nanos = 200 * MS;
const RTO_INIT: Nanos = 1000 * MS;
const RTO_MAX: Nanos = 120_000 * MS;
/// Linux's delayed-ACK timeout (its minimum, 40 ms).
const DELACK: Nanos = 40 * MS;
const IW_SEGMENTS: u64 = 10;
/// SACKed segments from which RACK stops waiting for reordering (Linux's `tp->reordering`
/// before any reordering is seen).
const DUP_THRESH: usize = 3;
/// Linux's worst-case delayed-ACK time, added to a tail loss probe when one segment is out.
const TLP_DELACK: Nanos = 200 * MS;
/// What Linux adds to a probe's two RTTs otherwise: two jiffies (HZ 250, as Debian builds).
const TLP_MIN: Nanos = 8 * MS;
/// TCP header with Linux's timestamp option: 20 + 12 bytes.
const TCP_HDR: usize = 32;
const IP_HDR: usize = 20;
const MAX_SACK_BLOCKS: usize = 3;

const SYN: u8 = 1;
const ACK: u8 = 2;

/// Congestion control.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cc {
    Reno,
    Cubic,
}

/// A socket's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Listen,
    SynSent,
    SynReceived,
    Established,
}

/// One segment sent and not yet acknowledged.
#[derive(Debug, Clone, Copy)]
struct Sent {
    seq: u64,
    len: u64,
    /// When it was last (re)transmitted.
    at: Nanos,
    retransmitted: bool,
    sacked: bool,
    lost: bool,
}

/// CUBIC's state (RFC 9438), windows in bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Cubic {
    w_max: f64,
    k: f64,
    epoch: Option<Nanos>,
    /// The Reno-friendly estimate.
    w_est: f64,
    /// Growth not yet added to the window (under a byte), carried to the next ACK.
    credit: f64,
    /// The curve started from the window, with no loss to give it a maximum.
    no_max: bool,
}

const BETA: f64 = 0.7;
const C: f64 = 0.4;

struct Socket {
    state: State,
    /// In the host's list of sockets to run, and in its list of sockets with news.
    dirty: bool,
    ready: bool,
    local_port: u16,
    remote: [u8; 4],
    remote_port: u16,
    mss: u64,
    cc: Cc,
    // Sender.
    /// Bytes from `snd_una` on: sent and unacknowledged, then not yet sent.
    sbuf: BytesMut,
    sbuf_cap: usize,
    snd_una: u64,
    snd_nxt: u64,
    /// The peer's window, bytes beyond its acknowledgement.
    snd_wnd: u64,
    sent: VecDeque<Sent>,
    cwnd: u64,
    ssthresh: u64,
    cubic: Cubic,
    /// In fast recovery (Linux's `TCP_CA_Recovery`) until `snd_una` reaches this.
    recover: Option<u64>,
    /// After a timeout (`TCP_CA_Loss`) until `snd_una` reaches this: no second window cut.
    loss: Option<u64>,
    /// RACK (RFC 8985): the send time, end and RTT of the most recently sent segment that was
    /// delivered, and the timer that marks what was sent before it once reordering is ruled out.
    rack_at: Option<Nanos>,
    rack_end: u64,
    rack_rtt: Nanos,
    reo_at: Option<Nanos>,
    /// Tail loss probe: when one is due, and while one is out, `snd_nxt` when it went, when
    /// and whether it was a retransmission.
    tlp_at: Option<Nanos>,
    tlp: Option<(u64, Nanos, bool)>,
    /// Zero-window probe timer and its backoff.
    persist_at: Option<Nanos>,
    persist_backoff: u32,
    /// Whether the window limited the sender in the current window of data (Linux's
    /// `is_cwnd_limited`), the most in flight then, and where that window ends.
    cwnd_limited: bool,
    max_out: u64,
    usage_end: u64,
    /// When data was last sent (Linux's `lsndtime`).
    last_send: Option<Nanos>,
    /// An ACK advanced `snd_una` since the last poll (which re-arms the tail loss probe).
    progressed: bool,
    /// Some segment in flight may be SACKed or marked lost: the pipe must be counted.
    scoreboard: bool,
    srtt: Option<Nanos>,
    rttvar: Nanos,
    rto: Nanos,
    min_rtt: Option<Nanos>,
    backoff: u32,
    rto_at: Option<Nanos>,
    syn_at: Option<Nanos>,
    retrans_total: u64,
    timeouts: u64,
    /// After a timeout, until the window is repaired: when it fired and the window before it,
    /// so that an acknowledgement of an original transmission (its timestamp echo older than
    /// the timeout) undoes it, as Linux's Eifel/F-RTO detection does.
    undo: Option<(Nanos, u64, u64)>,
    /// The peer's newest timestamp on in-order data, echoed on what this side sends.
    ts_recent: u32,
    bytes_acked: u64,
    // Receiver.
    rcv_nxt: u64,
    rbuf: BytesMut,
    rbuf_cap: usize,
    ooo: BTreeMap<u64, Vec<u8>>,
    /// `rcv_nxt` when the last segment (which acknowledged it) was sent: Linux's `rcv_wup`.
    rcv_wup: u64,
    /// The right edge of the window last advertised.
    adv_right: u64,
    /// Data received since the last segment sent (which would have acknowledged it).
    rcv_unacked: bool,
    delack_at: Option<Nanos>,
    ack_now: bool,
    /// Ranges received out of order, most recent first, for the SACK option.
    sack_recent: Vec<(u64, u64)>,
}

/// A host: its address, its sockets, its packet queues to and from the link. A poll runs only
/// the sockets that need it (a segment arrived, the application gave or took bytes, a timer is
/// due), so that a target with a thousand connections costs per event what one with one does.
pub struct Host {
    pub addr: [u8; 4],
    socks: Vec<Socket>,
    pub rx: VecDeque<Vec<u8>>,
    pub tx: VecDeque<Vec<u8>>,
    mtu: usize,
    /// Connected sockets by (peer address, peer port, local port).
    by_peer: HashMap<([u8; 4], u16, u16), usize>,
    /// Listening sockets by port, lowest first.
    listening: HashMap<u16, VecDeque<usize>>,
    /// Sockets to run at the next poll.
    dirty: Vec<usize>,
    /// Each socket's next timer.
    timers: Timers<Nanos>,
    /// Sockets that took in a segment since [`Host::take_ready`] last ran.
    ready: Vec<usize>,
    /// Sockets whose timers are due, kept between polls so that a poll does not allocate.
    due: Vec<usize>,
}

/// A parsed segment.
struct Seg<'a> {
    src: [u8; 4],
    sport: u16,
    dport: u16,
    seq: u32,
    ack: u32,
    flags: u8,
    wnd: u32,
    /// The timestamp option: the sender's clock (µs) and the echo of the peer's.
    tsval: u32,
    tsecr: u32,
    sacks: Vec<(u32, u32)>,
    data: &'a [u8],
}

fn parse(p: &[u8]) -> Option<Seg<'_>> {
    if p.len() < IP_HDR + TCP_HDR || p[9] != 6 {
        return None;
    }
    let t = &p[IP_HDR..];
    let hlen = usize::from(t[12] >> 4) * 4;
    if hlen < TCP_HDR || t.len() < hlen {
        return None;
    }
    let n = usize::from(t[13]).min(MAX_SACK_BLOCKS);
    let mut sacks = Vec::with_capacity(n);
    for i in 0..n {
        let o = TCP_HDR + 2 + 8 * i;
        if o + 8 > hlen {
            break;
        }
        sacks.push((
            u32::from_be_bytes([t[o], t[o + 1], t[o + 2], t[o + 3]]),
            u32::from_be_bytes([t[o + 4], t[o + 5], t[o + 6], t[o + 7]]),
        ));
    }
    Some(Seg {
        src: [p[12], p[13], p[14], p[15]],
        sport: u16::from_be_bytes([t[0], t[1]]),
        dport: u16::from_be_bytes([t[2], t[3]]),
        seq: u32::from_be_bytes([t[4], t[5], t[6], t[7]]),
        ack: u32::from_be_bytes([t[8], t[9], t[10], t[11]]),
        flags: t[14],
        wnd: u32::from_be_bytes([t[16], t[17], t[18], t[19]]),
        tsval: u32::from_be_bytes([t[20], t[21], t[22], t[23]]),
        tsecr: u32::from_be_bytes([t[24], t[25], t[26], t[27]]),
        sacks,
        data: &t[hlen..],
    })
}

/// The 64-bit sequence number nearest `reference` whose low 32 bits are `s`.
fn unwrap(s: u32, reference: u64) -> u64 {
    let d = s.wrapping_sub(reference as u32) as i32;
    reference.wrapping_add_signed(i64::from(d))
}

impl Socket {
    fn new(local_port: u16, cfg: &super::net::TcpConfig, mss: u64, cc: Cc) -> Socket {
        Socket {
            state: State::Listen,
            dirty: false,
            ready: false,
            local_port,
            remote: [0; 4],
            remote_port: 0,
            mss,
            cc,
            sbuf: BytesMut::new(),
            sbuf_cap: cfg.buffer,
            snd_una: 0,
            snd_nxt: 0,
            snd_wnd: 65535,
            sent: VecDeque::new(),
            cwnd: IW_SEGMENTS * mss,
            ssthresh: u64::MAX,
            cubic: Cubic::default(),
            recover: None,
            loss: None,
            rack_at: None,
            rack_end: 0,
            rack_rtt: 0,
            reo_at: None,
            tlp_at: None,
            tlp: None,
            persist_at: None,
            persist_backoff: 0,
            cwnd_limited: false,
            max_out: 0,
            usage_end: 0,
            last_send: None,
            progressed: false,
            scoreboard: false,
            srtt: None,
            rttvar: 0,
            rto: RTO_INIT,
            min_rtt: None,
            backoff: 0,
            rto_at: None,
            syn_at: None,
            retrans_total: 0,
            timeouts: 0,
            undo: None,
            ts_recent: 0,
            bytes_acked: 0,
            rcv_nxt: 0,
            rbuf: BytesMut::new(),
            rbuf_cap: cfg.buffer,
            ooo: BTreeMap::new(),
            rcv_wup: 0,
            adv_right: 0,
            rcv_unacked: false,
            delack_at: None,
            ack_now: false,
            sack_recent: Vec::new(),
        }
    }

    fn rcv_wnd(&self) -> u64 {
        let held: usize = self.rbuf.len() + self.ooo.values().map(Vec::len).sum::<usize>();
        self.rbuf_cap.saturating_sub(held) as u64
    }

    /// Bytes in flight by RFC 6675's pipe: sent, not SACKed, not marked lost (retransmitted
    /// lost ones count again).
    fn pipe(&self) -> u64 {
        self.sent
            .iter()
            .filter(|s| !s.sacked && (!s.lost || s.retransmitted))
            .map(|s| s.len)
            .sum()
    }

    fn rtt_sample(&mut self, r: Nanos) {
        self.min_rtt = Some(self.min_rtt.map_or(r, |m| m.min(r)));
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(r);
                self.rttvar = (3 * self.rttvar + diff) / 4;
                self.srtt = Some((7 * s + r) / 8);
            }
        }
        let s = self.srtt.unwrap_or(r);
        self.rto = (s + (4 * self.rttvar).max(RTO_MIN)).min(RTO_MAX);
        self.backoff = 0;
    }

    fn on_loss(&mut self, now: Nanos) {
        let cwnd = self.cwnd as f64;
        match self.cc {
            Cc::Reno => {
                self.ssthresh = (self.cwnd / 2).max(2 * self.mss);
            }
            Cc::Cubic => {
                // Fast convergence: a flow that lost below its last maximum gives way.
                let w_max = if cwnd < self.cubic.w_max {
                    cwnd * (1.0 + BETA) / 2.0
                } else {
                    cwnd
                };
                let mss = self.mss as f64;
                // RFC 9438 4.2: K = cbrt((W_max - cwnd_epoch) / C), in segments, from the
                // window the cut leaves.
                let epoch_cwnd = cwnd * BETA;
                self.cubic = Cubic {
                    w_max,
                    k: ((w_max - epoch_cwnd).max(0.0) / mss / C).cbrt(),
                    epoch: None,
                    w_est: epoch_cwnd,
                    credit: 0.0,
                    no_max: false,
                };
                self.ssthresh = (epoch_cwnd as u64).max(2 * self.mss);
            }
        }
        let _ = now;
    }

    /// Whether the window limited the sender lately (Linux's `tcp_is_cwnd_limited`): only then
    /// does it grow. In slow start it may grow to twice what was in flight.
    fn is_cwnd_limited(&self) -> bool {
        self.cwnd_limited || (self.cwnd < self.ssthresh && self.cwnd < 2 * self.max_out)
    }

    /// The window grows for `acked` new bytes outside recovery.
    fn grow(&mut self, acked: u64, now: Nanos) {
        if !self.is_cwnd_limited() {
            return;
        }
        if self.cwnd < self.ssthresh {
            // Slow start, with appropriate byte counting (at most 2 MSS per ACK), up to
            // ssthresh (Linux's tcp_slow_start).
            self.cwnd = (self.cwnd + acked.min(2 * self.mss)).min(self.ssthresh);
            return;
        }
        match self.cc {
            Cc::Reno => {
                self.cwnd += (self.mss * acked / self.cwnd.max(1)).max(1);
            }
            Cc::Cubic => {
                let mss = self.mss as f64;
                let cwnd = self.cwnd as f64;
                let c = &mut self.cubic;
                let epoch = *c.epoch.get_or_insert(now);
                // No loss since the curve was last reset (Linux's last_max_cwnd of 0): the
                // curve starts at the window, and grows at least a segment per 20 acked.
                if c.w_max <= 0.0 {
                    c.w_max = cwnd;
                    c.k = 0.0;
                    c.w_est = cwnd;
                    c.no_max = true;
                }
                // Linux evaluates the curve one minimum RTT ahead (bictcp_update's delay_min),
                // not one smoothed RTT: a standing queue does not advance it.
                let t = (now.saturating_sub(epoch) + self.min_rtt.unwrap_or(0)) as f64 / 1e9;
                let target = C * (t - c.k).powi(3) * mss + c.w_max;
                // RFC 9438 4.3: the Reno-friendly estimate.
                let alpha = 3.0 * (1.0 - BETA) / (1.0 + BETA);
                c.w_est += alpha * mss * acked as f64 / cwnd;
                // Whichever of the curve and the Reno-friendly window is ahead, the gap is
                // closed over one window's worth of ACKs (Linux's cnt = cwnd / (target -
                // cwnd)), not at once; below both, a segment per 100 windows acked.
                let ahead = target.max(c.w_est) - cwnd;
                let mut per_byte = if ahead > 0.0 {
                    ahead / cwnd
                } else {
                    mss / (100.0 * cwnd)
                };
                if c.no_max {
                    per_byte = per_byte.max(1.0 / 20.0);
                }
                // Linux's count of ACKs per increment stays at 2 or more: at most half a
                // segment per segment acknowledged.
                let grow = (per_byte * acked as f64).min(acked as f64 / 2.0);
                c.credit += grow;
                let whole = c.credit.floor();
                c.credit -= whole;
                self.cwnd += whole as u64;
            }
        }
    }

    /// Before new data goes out with nothing in flight: CUBIC's epoch moves on by the idle time
    /// (its `CA_EVENT_TX_START`), and after more than an RTO of idleness the window restarts
    /// (Linux's `tcp_cwnd_restart`: halved per RTO idle, not below the initial window).
    fn restart_after_idle(&mut self, now: Nanos) {
        let Some(last) = self.last_send else { return };
        let idle = now.saturating_sub(last);
        if let Some(e) = self.cubic.epoch.as_mut() {
            *e = (*e + idle).min(now);
        }
        if idle <= self.rto {
            return;
        }
        let restart = (IW_SEGMENTS * self.mss).min(self.cwnd);
        if self.recover.is_none() {
            self.ssthresh = self.ssthresh.max(self.cwnd / 2 + self.cwnd / 4);
        }
        let mut cwnd = self.cwnd;
        let mut left = idle - self.rto;
        while left > 0 && cwnd > restart {
            cwnd >>= 1;
            left = left.saturating_sub(self.rto);
        }
        self.cwnd = cwnd.max(restart);
    }

    /// An ACK from the peer.
    fn on_ack(&mut self, seg: &Seg<'_>, now: Nanos) {
        let ack = unwrap(seg.ack, self.snd_una);
        if ack > self.snd_nxt {
            return;
        }
        self.snd_wnd = u64::from(seg.wnd);
        let mut blocks = [(0u64, 0u64); MAX_SACK_BLOCKS];
        let n = seg.sacks.len().min(MAX_SACK_BLOCKS);
        for (b, &(l, r)) in blocks.iter_mut().zip(&seg.sacks) {
            *b = (unwrap(l, self.snd_una), unwrap(r, self.snd_una));
        }
        let blocks = &blocks[..n];
        // What this ACK delivers, cumulatively or by SACK, and RACK's newest delivered segment
        // (RFC 8985 6.2). A retransmission delivered sooner than the path's minimum RTT may
        // be the original's delivery: it gives no RACK sample.
        let min_rtt = self.min_rtt.unwrap_or(0);
        let (mut rack_at, mut rack_end, mut rack_rtt) =
            (self.rack_at, self.rack_end, self.rack_rtt);
        let mut delivered = false;
        for s in self.sent.iter_mut() {
            let end = s.seq + s.len;
            if end > ack && blocks.is_empty() {
                break;
            }
            if s.sacked {
                continue;
            }
            if end > ack {
                if !blocks.iter().any(|&(l, r)| s.seq >= l && end <= r) {
                    continue;
                }
                s.sacked = true;
                self.scoreboard = true;
            }
            delivered = true;
            let rtt = now.saturating_sub(s.at);
            if s.retransmitted && rtt < min_rtt {
                continue;
            }
            if rack_at.is_none_or(|t| s.at > t || (s.at == t && end > rack_end)) {
                (rack_at, rack_end, rack_rtt) = (Some(s.at), end, rtt);
            }
        }
        (self.rack_at, self.rack_end, self.rack_rtt) = (rack_at, rack_end, rack_rtt);
        if ack > self.snd_una {
            let acked = ack - self.snd_una;
            self.bytes_acked += acked;
            self.progressed = true;
            while let Some(s) = self.sent.front() {
                if s.seq + s.len > ack {
                    break;
                }
                self.sent.pop_front();
            }
            // Timestamps give a sample on every ACK that advances, retransmissions or not.
            let age = |at: Nanos| ns_to_us(at).wrapping_sub(seg.tsecr) as i32;
            let sample = (seg.tsecr != 0 && age(now) >= 0).then(|| age(now) as u64 * 1000);
            if let Some((fired, cwnd, ssthresh)) = self.undo {
                if seg.tsecr != 0 && age(fired) > 0 {
                    // The original transmission arrived: the timeout was spurious.
                    self.cwnd = self.cwnd.max(cwnd);
                    self.ssthresh = ssthresh;
                    self.loss = None;
                    for s in self.sent.iter_mut() {
                        if !s.retransmitted {
                            s.lost = false;
                        }
                    }
                    self.undo = None;
                } else if ack >= self.snd_nxt || self.sent.iter().all(|s| !s.lost) {
                    self.undo = None;
                }
            }
            // The tail loss probe is answered. When the probe was a retransmission and the
            // ACK echoes its timestamp, it repaired a loss: the window is cut once (Linux's
            // TLP-driven CWR); an older echo means the original arrived after all.
            if let Some((high, at, retrans)) = self.tlp {
                if ack >= high {
                    self.tlp = None;
                    let repaired = retrans && seg.tsecr != 0 && age(at) <= 0;
                    if repaired && self.recover.is_none() && self.loss.is_none() {
                        self.on_loss(now);
                        self.cwnd = self.ssthresh;
                    }
                }
            }
            self.sbuf.advance(acked as usize);
            self.snd_una = ack;
            if let Some(r) = sample {
                self.rtt_sample(r);
            }
            let in_recovery = self.recover.is_some();
            if self.recover.is_some_and(|p| ack >= p) {
                self.recover = None;
                self.cwnd = self.ssthresh;
            }
            if self.loss.is_some_and(|h| ack >= h) {
                self.loss = None;
            }
            if !in_recovery {
                self.grow(acked, now);
            }
            self.rto_at = (!self.sent.is_empty()).then(|| now + self.rto);
        }
        // With nothing SACKed or marked lost, every segment sent before a delivered one was
        // delivered too (first transmissions leave in sequence order): nothing to look at.
        if delivered && self.scoreboard {
            self.rack_detect(now);
        }
    }

    /// RACK's loss rule (RFC 8985 6.2): a segment sent before the newest delivered one is lost
    /// once that one's RTT and a reordering window have passed since it was sent. The window is
    /// a quarter of the minimum RTT, and none in recovery or once DupThresh segments are
    /// SACKed (Linux's `tcp_rack_reo_wnd` when no reordering was seen). What is not lost yet
    /// waits on the reordering timer.
    fn rack_detect(&mut self, now: Nanos) {
        let Some(rack_at) = self.rack_at else { return };
        let sacked = self.sent.iter().filter(|s| s.sacked).count();
        let reo = if self.recover.is_some() || self.loss.is_some() || sacked >= DUP_THRESH {
            0
        } else {
            (self.min_rtt.unwrap_or(0) / 4).min(self.srtt.unwrap_or(0))
        };
        let mut wait: Option<Nanos> = None;
        let mut newly = false;
        for s in self.sent.iter_mut() {
            if s.sacked || (s.lost && !s.retransmitted) {
                continue;
            }
            let end = s.seq + s.len;
            if !(s.at < rack_at || (s.at == rack_at && end < self.rack_end)) {
                continue;
            }
            let deadline = s.at + self.rack_rtt + reo;
            if now >= deadline {
                s.lost = true;
                s.retransmitted = false;
                newly = true;
            } else {
                wait = Some(wait.map_or(deadline, |w| w.max(deadline)));
            }
        }
        self.reo_at = wait;
        if newly {
            self.scoreboard = true;
            if self.recover.is_none() && self.loss.is_none() {
                self.recover = Some(self.snd_nxt);
                self.on_loss(now);
                self.cwnd = self.ssthresh;
            }
        }
    }

    /// Arms the tail loss probe (RFC 8985 7.2, as Linux's `tcp_schedule_loss_probe`): in the
    /// open state with data out and nothing SACKed, two smoothed RTTs on (plus the worst
    /// delayed ACK when one segment is out), never after the RTO.
    fn arm_tlp(&mut self, now: Nanos) {
        self.tlp_at = None;
        if self.sent.is_empty()
            || self.recover.is_some()
            || self.loss.is_some()
            || self.scoreboard
            || self.tlp.is_some()
        {
            return;
        }
        let pto = match self.srtt {
            Some(srtt) if self.sent.len() == 1 => 2 * srtt + TLP_DELACK,
            Some(srtt) => 2 * srtt + TLP_MIN,
            None => RTO_INIT,
        };
        let at = now + pto;
        self.tlp_at = Some(self.rto_at.map_or(at, |r| r.min(at)));
    }

    fn on_timeout(&mut self, now: Nanos) {
        self.timeouts += 1;
        if self.undo.is_none() {
            self.undo = Some((now, self.cwnd, self.ssthresh));
        }
        // One cut per loss episode: not again in recovery, nor at a repeated timeout (Linux's
        // tcp_enter_loss).
        if self.recover.is_none() && self.loss.is_none() {
            self.on_loss(now);
        }
        // Linux's CUBIC forgets its curve on entering the loss state (bictcp_reset): it
        // starts again from the window it has when slow start ends, with K = 0.
        self.cubic = Cubic::default();
        self.cwnd = self.mss;
        self.recover = None;
        self.loss = Some(self.snd_nxt);
        self.tlp = None;
        self.tlp_at = None;
        self.reo_at = None;
        self.scoreboard = true;
        for s in self.sent.iter_mut() {
            if !s.sacked {
                s.lost = true;
                s.retransmitted = false;
            }
        }
        self.backoff += 1;
        self.rto = (self.rto * 2).min(RTO_MAX);
        self.rto_at = Some(now + self.rto);
    }

    /// Data for the receiver.
    fn on_data(&mut self, seg: &Seg<'_>) {
        let seq = unwrap(seg.seq, self.rcv_nxt);
        if seg.data.is_empty() {
            // A segment below the window (a zero-window probe) is answered at once.
            if seq < self.rcv_nxt {
                self.ack_now = true;
            }
            return;
        }
        let end = seq + seg.data.len() as u64;
        if end <= self.rcv_nxt {
            // All old: a retransmission the peer did not need; answer at once.
            self.ack_now = true;
            return;
        }
        if seq > self.rcv_nxt {
            if (end - self.rcv_nxt) as usize <= self.rcv_wnd() as usize + seg.data.len() {
                self.ooo.entry(seq).or_insert_with(|| seg.data.to_vec());
                self.note_sack(seq, end);
            }
            self.ack_now = true;
            return;
        }
        self.rcv_unacked = true;
        self.ts_recent = seg.tsval;
        let skip = (self.rcv_nxt - seq) as usize;
        let had_holes = !self.ooo.is_empty();
        self.rbuf.extend_from_slice(&seg.data[skip..]);
        self.rcv_nxt = end;
        // What was waiting behind the hole.
        while let Some((&s, _)) = self.ooo.first_key_value() {
            if s > self.rcv_nxt {
                break;
            }
            let Some((s, d)) = self.ooo.pop_first() else {
                break;
            };
            let e = s + d.len() as u64;
            if e > self.rcv_nxt {
                self.rbuf
                    .extend_from_slice(&d[(self.rcv_nxt - s) as usize..]);
                self.rcv_nxt = e;
            }
        }
        self.sack_recent.retain(|&(_, r)| r > self.rcv_nxt);
        if had_holes {
            self.ack_now = true;
        }
        // Linux acknowledges at once when more than one full segment's worth arrived since
        // its last acknowledgement (__tcp_ack_snd_check), else within the delayed-ACK time.
        if self.rcv_nxt - self.rcv_wup > self.mss {
            self.ack_now = true;
        }
    }

    /// What this side received is now acknowledged (by a pure ACK or by data).
    fn acked(&mut self) {
        self.rcv_unacked = false;
        self.rcv_wup = self.rcv_nxt;
        self.adv_right = self.rcv_nxt + self.rcv_wnd();
        self.delack_at = None;
        self.ack_now = false;
    }

    /// A pure ACK, with the newest SACK blocks.
    fn ack(&mut self, src: [u8; 4], now: Nanos) -> Vec<u8> {
        let n = self.sack_recent.len().min(MAX_SACK_BLOCKS);
        let p = segment(
            src,
            self,
            ACK,
            self.snd_nxt,
            &[],
            &self.sack_recent[..n],
            now,
        );
        self.acked();
        p
    }

    /// Bytes the application gave that were never sent.
    fn unsent(&self) -> u64 {
        (self.snd_una + self.sbuf.len() as u64).saturating_sub(self.snd_nxt)
    }

    /// Room the peer's window leaves beyond `snd_nxt`.
    fn wnd_room(&self) -> u64 {
        (self.snd_una + self.snd_wnd).saturating_sub(self.snd_nxt)
    }

    /// Sends `len` new bytes from `snd_nxt`.
    fn send_new(&mut self, len: u64, addr: [u8; 4], now: Nanos, out: &mut VecDeque<Vec<u8>>) {
        let off = (self.snd_nxt - self.snd_una) as usize;
        let seq = self.snd_nxt;
        out.push_back(segment(
            addr,
            self,
            ACK,
            seq,
            &self.sbuf[off..off + len as usize],
            &[],
            now,
        ));
        self.sent.push_back(Sent {
            seq,
            len,
            at: now,
            retransmitted: false,
            sacked: false,
            lost: false,
        });
        self.snd_nxt += len;
        self.last_send = Some(now);
    }

    /// Sends segment `i` of the scoreboard again.
    fn retransmit(&mut self, i: usize, addr: [u8; 4], now: Nanos, out: &mut VecDeque<Vec<u8>>) {
        let x = self.sent[i];
        let off = (x.seq - self.snd_una) as usize;
        out.push_back(segment(
            addr,
            self,
            ACK,
            x.seq,
            &self.sbuf[off..off + x.len as usize],
            &[],
            now,
        ));
        let e = &mut self.sent[i];
        e.retransmitted = true;
        e.at = now;
        self.retrans_total += 1;
        self.last_send = Some(now);
    }

    /// The tail loss probe fires (RFC 8985 7.3): one new segment if the peer's window takes
    /// it, whatever the congestion window, else the last segment again; then the RTO runs.
    fn send_probe(&mut self, addr: [u8; 4], now: Nanos, out: &mut VecDeque<Vec<u8>>) {
        if self.tlp.is_some() || self.sent.is_empty() {
            return;
        }
        let len = self.unsent().min(self.mss).min(self.wnd_room());
        let retrans = len == 0;
        if retrans {
            let i = self.sent.len() - 1;
            self.retransmit(i, addr, now, out);
        } else {
            self.send_new(len, addr, now, out);
        }
        self.acked();
        self.tlp = Some((self.snd_nxt, now, retrans));
        self.rto_at = Some(now + self.rto);
    }

    fn note_sack(&mut self, l: u64, r: u64) {
        // Merge with the blocks it touches; the block of the newest segment goes first.
        let (mut l, mut r) = (l, r);
        self.sack_recent.retain(|&(a, b)| {
            if b < l || a > r {
                true
            } else {
                l = l.min(a);
                r = r.max(b);
                false
            }
        });
        self.sack_recent.insert(0, (l, r));
        self.sack_recent.truncate(8);
    }
}

impl Host {
    pub fn new(addr: [u8; 4], mtu: usize) -> Host {
        Host {
            addr,
            socks: Vec::new(),
            rx: VecDeque::new(),
            tx: VecDeque::new(),
            mtu,
            by_peer: HashMap::new(),
            listening: HashMap::new(),
            dirty: Vec::new(),
            timers: Timers::new(),
            ready: Vec::new(),
            due: Vec::new(),
        }
    }

    /// Socket `i` runs at the next poll.
    fn mark(&mut self, i: usize) {
        let s = &mut self.socks[i];
        if !s.dirty {
            s.dirty = true;
            self.dirty.push(i);
        }
    }

    /// The sockets that took in a segment since the last call (their application may have
    /// bytes to read, room to write, or a connection now up), in no set order.
    pub fn take_ready(&mut self, into: &mut Vec<usize>) {
        for &i in &self.ready {
            self.socks[i].ready = false;
        }
        into.append(&mut self.ready);
    }

    fn mss(&self) -> u64 {
        (self.mtu - IP_HDR - TCP_HDR) as u64
    }

    pub fn listen(&mut self, cfg: &super::net::TcpConfig, port: u16, cc: Cc) -> usize {
        let s = Socket::new(port, cfg, self.mss(), cc);
        self.socks.push(s);
        let i = self.socks.len() - 1;
        self.listening.entry(port).or_default().push_back(i);
        i
    }

    pub fn connect(
        &mut self,
        cfg: &super::net::TcpConfig,
        cc: Cc,
        to: [u8; 4],
        port: u16,
        local_port: u16,
    ) -> usize {
        let mut s = Socket::new(local_port, cfg, self.mss(), cc);
        s.state = State::SynSent;
        s.remote = to;
        s.remote_port = port;
        self.socks.push(s);
        let i = self.socks.len() - 1;
        self.by_peer.insert((to, port, local_port), i);
        self.mark(i);
        i
    }

    /// Bytes in socket `h`'s send buffer, sent and unacknowledged or not yet sent.
    pub fn send_queue(&self, h: usize) -> usize {
        self.socks[h].sbuf.len()
    }

    pub fn state(&self, h: usize) -> State {
        self.socks[h].state
    }

    /// When the host next needs a poll: now if a socket is waiting to run, else its earliest
    /// timer.
    pub fn next_poll(&self) -> Option<Nanos> {
        if !self.dirty.is_empty() || !self.rx.is_empty() {
            return Some(0);
        }
        self.timers.next()
    }

    /// Moves bytes between socket `h` and `stream` both ways. True when any moved.
    pub fn exchange(&mut self, h: usize, stream: &mut Stream) -> bool {
        let moved = self.exchange_inner(h, stream);
        if moved {
            self.mark(h);
        }
        moved
    }

    fn exchange_inner(&mut self, h: usize, stream: &mut Stream) -> bool {
        let s = &mut self.socks[h];
        let mut moved = false;
        if !s.rbuf.is_empty() {
            stream.deliver(&s.rbuf);
            s.rbuf.clear();
            moved = true;
            // Linux's tcp_cleanup_rbuf: a read that at least doubles a window fallen to half
            // the buffer or less is announced at once.
            let left = s.adv_right.saturating_sub(s.rcv_nxt);
            if 2 * left <= s.rbuf_cap as u64 && s.rcv_wnd() >= (2 * left).max(s.mss) {
                s.ack_now = true;
            }
        }
        if s.state == State::Established && stream.queued() > 0 {
            let room = s.sbuf_cap.saturating_sub(s.sbuf.len());
            if room > 0 {
                let mut left = room;
                stream.drain_into(|b| {
                    let n = b.len().min(left);
                    s.sbuf.extend_from_slice(&b[..n]);
                    left -= n;
                    n
                });
                moved |= left < room;
            }
        }
        moved
    }

    /// Runs the stack at `now`: takes in what arrived, fires timers, sends what the windows
    /// allow, and says when it next needs a poll.
    pub fn poll(&mut self, now: Nanos) {
        while let Some(p) = self.rx.pop_front() {
            self.input(&p, now);
        }
        // Sockets whose timers are due join those that took in a segment or were given bytes.
        let mut due = std::mem::take(&mut self.due);
        self.timers.pop_due(now, &mut due);
        for &i in &due {
            self.mark(i);
        }
        due.clear();
        self.due = due;
        let mss = self.mss();
        let addr = self.addr;
        let mut out = std::mem::take(&mut self.tx);
        let mut dirty = std::mem::take(&mut self.dirty);
        // In socket order, as a stack polling every socket would send.
        dirty.sort_unstable();
        for &i in &dirty {
            let s = &mut self.socks[i];
            s.dirty = false;
            let next = poll_socket(s, addr, mss, now, &mut out);
            self.timers.set(i, next);
        }
        dirty.clear();
        self.dirty = dirty;
        self.tx = out;
    }

    fn input(&mut self, p: &[u8], now: Nanos) {
        let Some(seg) = parse(p) else { return };
        let found = self.by_peer.get(&(seg.src, seg.sport, seg.dport)).copied();
        let i = match found {
            Some(i) => i,
            None if seg.flags & SYN != 0 && seg.flags & ACK == 0 => {
                let Some(i) = self
                    .listening
                    .get_mut(&seg.dport)
                    .and_then(VecDeque::pop_front)
                else {
                    return;
                };
                self.by_peer.insert((seg.src, seg.sport, seg.dport), i);
                self.note(i);
                let s = &mut self.socks[i];
                s.state = State::SynReceived;
                s.remote = seg.src;
                s.remote_port = seg.sport;
                s.rcv_nxt = u64::from(seg.seq) + 1;
                s.rcv_wup = s.rcv_nxt;
                s.snd_wnd = u64::from(seg.wnd);
                s.syn_at = None;
                return;
            }
            None => return,
        };
        self.note(i);
        let s = &mut self.socks[i];
        match s.state {
            State::SynSent if seg.flags & (SYN | ACK) == SYN | ACK => {
                s.state = State::Established;
                // The SYN took sequence number 0.
                s.snd_una = 1;
                s.snd_nxt = 1;
                s.rcv_nxt = u64::from(seg.seq) + 1;
                s.rcv_wup = s.rcv_nxt;
                s.snd_wnd = u64::from(seg.wnd);
                if let Some(t) = s.syn_at.take() {
                    s.rtt_sample(now.saturating_sub(t));
                }
                s.ack_now = true;
            }
            State::SynReceived if seg.flags & SYN == 0 && seg.flags & ACK != 0 => {
                s.state = State::Established;
                s.snd_una = 1;
                s.snd_nxt = 1;
                if let Some(t) = s.syn_at.take() {
                    s.rtt_sample(now.saturating_sub(t));
                }
                s.snd_wnd = u64::from(seg.wnd);
                s.on_data(&seg);
            }
            State::SynReceived if seg.flags & SYN != 0 => {
                // The SYN again: our SYN-ACK was lost.
                s.syn_at = None;
            }
            State::Established => {
                if seg.flags & SYN != 0 {
                    // A SYN-ACK again: our ACK was lost.
                    s.ack_now = true;
                    return;
                }
                s.on_ack(&seg, now);
                s.on_data(&seg);
                if s.ack_now {
                    // Acknowledged as it arrives, packet by packet, as Linux does.
                    self.tx.push_back(s.ack(self.addr, now));
                }
            }
            _ => {}
        }
    }

    /// Socket `i` took in a segment: it runs at the next poll, and its application is told.
    fn note(&mut self, i: usize) {
        self.mark(i);
        let s = &mut self.socks[i];
        if !s.ready {
            s.ready = true;
            self.ready.push(i);
        }
    }

    /// The connection's TCP state, as `TCP_INFO` would give it.
    pub fn tcp_state(&self, h: usize) -> mcsi_tcp::TcpState {
        let s = &self.socks[h];
        let us = |n: Nanos| (n / 1000).min(u64::from(u32::MAX)) as u32;
        let mss = s.mss.max(1);
        mcsi_tcp::TcpState {
            ca_state: if s.loss.is_some() {
                mcsi_tcp::CaState::Loss
            } else if s.recover.is_some() {
                mcsi_tcp::CaState::Recovery
            } else {
                mcsi_tcp::CaState::Open
            },
            cwnd: (s.cwnd / mss) as u32,
            ssthresh: (s.ssthresh / mss).min(u64::from(u32::MAX)) as u32,
            snd_mss: mss as u32,
            pmtu: self.mtu as u32,
            rtt_us: us(s.srtt.unwrap_or(0)),
            rttvar_us: us(s.rttvar),
            rto_us: us(s.rto),
            unacked: s.sent.len() as u32,
            sacked: s.sent.iter().filter(|x| x.sacked).count() as u32,
            lost: s.sent.iter().filter(|x| x.lost).count() as u32,
            retrans: s.sent.iter().filter(|x| x.retransmitted).count() as u32,
            total_retrans: s.retrans_total as u32,
            min_rtt_us: s.min_rtt.map(us),
            notsent_bytes: Some((s.snd_una + s.sbuf.len() as u64).saturating_sub(s.snd_nxt) as u32),
            bytes_acked: Some(s.bytes_acked),
            snd_wnd: Some(s.snd_wnd.min(u64::from(u32::MAX)) as u32),
            ..mcsi_tcp::TcpState::default()
        }
    }

    /// Retransmitted segments and retransmission timeouts of every socket.
    pub fn retransmits(&self) -> (u64, u64) {
        self.socks
            .iter()
            .fold((0, 0), |(r, t), s| (r + s.retrans_total, t + s.timeouts))
    }
}

/// Runs one socket at `now`: its timers, retransmissions and new data, and its ACK. Returns
/// when it next needs a poll for a timer.
fn poll_socket(
    s: &mut Socket,
    addr: [u8; 4],
    mss: u64,
    now: Nanos,
    out: &mut VecDeque<Vec<u8>>,
) -> Option<Nanos> {
    match s.state {
        State::Listen => return None,
        State::SynSent | State::SynReceived => {
            let due = s.syn_at.is_none_or(|t| now >= t + s.rto);
            if due {
                if s.syn_at.is_some() {
                    s.rto = (s.rto * 2).min(RTO_MAX);
                }
                s.syn_at = Some(now);
                let flags = if s.state == State::SynSent {
                    SYN
                } else {
                    SYN | ACK
                };
                out.push_back(segment(addr, s, flags, s.snd_una, &[], &[], now));
            }
            return s.syn_at.map(|t| t + s.rto);
        }
        State::Established => {}
    }
    // The probe goes first: armed for no later than the RTO, it takes the RTO's place
    // when both are due (Linux keeps one timer for the two).
    if s.tlp_at.is_some_and(|t| now >= t) {
        s.tlp_at = None;
        s.send_probe(addr, now, out);
    }
    if s.rto_at.is_some_and(|t| now >= t) {
        s.on_timeout(now);
    }
    if s.reo_at.is_some_and(|t| now >= t) {
        s.reo_at = None;
        s.rack_detect(now);
    }
    if s.persist_at.is_some_and(|t| now >= t) {
        // A segment below the window makes the peer announce its window again.
        out.push_back(segment(addr, s, ACK, s.snd_una - 1, &[], &[], now));
        s.persist_backoff += 1;
        s.persist_at = Some(now + (s.rto << s.persist_backoff.min(10)).min(RTO_MAX));
    }
    // Retransmit what is marked lost, lowest first, then send new data.
    let mut sent_any = false;
    let mut cwnd_bound = false;
    // Whole segments while they fit in the window: Linux counts the window in packets.
    let (mut pipe, mut lost) = if s.scoreboard {
        let lost = s.sent.iter().filter(|x| x.lost && !x.retransmitted).count();
        s.scoreboard = s.sent.iter().any(|x| x.lost || x.sacked);
        (s.pipe(), lost)
    } else {
        (s.snd_nxt - s.snd_una, 0)
    };
    let mut from = 0;
    loop {
        if lost > 0 {
            let Some(i) = s
                .sent
                .iter()
                .skip(from)
                .position(|x| x.lost && !x.retransmitted)
                .map(|i| i + from)
            else {
                lost = 0;
                continue;
            };
            let len = s.sent[i].len;
            if pipe + len > s.cwnd.max(mss) {
                cwnd_bound = true;
                break;
            }
            s.retransmit(i, addr, now, out);
            pipe += len;
            lost -= 1;
            from = i + 1;
            sent_any = true;
            continue;
        }
        let len = s.unsent().min(mss).min(s.wnd_room());
        if len == 0 {
            break;
        }
        if pipe + len > s.cwnd {
            cwnd_bound = true;
            break;
        }
        if s.sent.is_empty() {
            s.restart_after_idle(now);
        }
        s.send_new(len, addr, now, out);
        pipe += len;
        sent_any = true;
    }
    if sent_any || cwnd_bound {
        // Linux's tcp_cwnd_validate: whether the window limited this window of data,
        // and the most that was in flight in it.
        if s.snd_una >= s.usage_end || cwnd_bound || (!s.cwnd_limited && pipe > s.max_out) {
            s.cwnd_limited = cwnd_bound;
            s.max_out = pipe;
            s.usage_end = s.snd_nxt;
        }
    }
    if sent_any {
        // Data carries the acknowledgement.
        s.acked();
        if s.rto_at.is_none() {
            s.rto_at = Some(now + s.rto);
        }
    }
    if sent_any || s.progressed {
        s.progressed = false;
        s.arm_tlp(now);
    }
    // A window too small for anything, with data waiting and none in flight: probe.
    if s.sent.is_empty() && s.unsent() > 0 && s.wnd_room() == 0 {
        s.persist_at.get_or_insert(now + s.rto);
    } else {
        s.persist_at = None;
        s.persist_backoff = 0;
    }
    if s.ack_now || s.delack_at.is_some_and(|t| now >= t) {
        out.push_back(s.ack(addr, now));
    } else if s.rcv_unacked {
        s.delack_at.get_or_insert(now + DELACK);
    }
    [s.rto_at, s.reo_at, s.tlp_at, s.persist_at, s.delack_at]
        .into_iter()
        .flatten()
        .min()
}

/// The timestamp clock: µs, wrapping, never 0 (0 means "no echo yet").
fn ns_to_us(n: Nanos) -> u32 {
    ((n / 1000) as u32).max(1)
}

/// One IPv4 packet of socket `s`, carrying `data` from `seq` and the current acknowledgement.
fn segment(
    src: [u8; 4],
    s: &Socket,
    flags: u8,
    seq: u64,
    data: &[u8],
    sacks: &[(u64, u64)],
    now: Nanos,
) -> Vec<u8> {
    let opt = if sacks.is_empty() {
        0
    } else {
        (2 + 8 * sacks.len()).div_ceil(4) * 4
    };
    let hlen = TCP_HDR + opt;
    let total = IP_HDR + hlen + data.len();
    let mut p = vec![0u8; total];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total.min(0xffff) as u16).to_be_bytes());
    p[8] = 64;
    p[9] = 6;
    p[12..16].copy_from_slice(&src);
    p[16..20].copy_from_slice(&s.remote);
    let t = &mut p[IP_HDR..];
    t[0..2].copy_from_slice(&s.local_port.to_be_bytes());
    t[2..4].copy_from_slice(&s.remote_port.to_be_bytes());
    t[4..8].copy_from_slice(&(seq as u32).to_be_bytes());
    t[8..12].copy_from_slice(&(s.rcv_nxt as u32).to_be_bytes());
    t[12] = ((hlen / 4) as u8) << 4;
    t[13] = sacks.len() as u8;
    t[14] = flags;
    t[16..20].copy_from_slice(&(s.rcv_wnd().min(u64::from(u32::MAX)) as u32).to_be_bytes());
    t[20..24].copy_from_slice(&ns_to_us(now).to_be_bytes());
    t[24..28].copy_from_slice(&s.ts_recent.to_be_bytes());
    for (i, &(l, r)) in sacks.iter().enumerate() {
        let o = TCP_HDR + 2 + 8 * i;
        t[o..o + 4].copy_from_slice(&(l as u32).to_be_bytes());
        t[o + 4..o + 8].copy_from_slice(&(r as u32).to_be_bytes());
    }
    t[hlen..].copy_from_slice(data);
    p
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::net::{Congestion, TcpConfig, TcpStack};

    const A: [u8; 4] = [10, 2, 0, 1];
    const B: [u8; 4] = [10, 1, 0, 1];

    /// The simulator's TCP with `buffer` bytes each way (the congestion control is the
    /// socket's own, given when it is made).
    fn config(buffer: usize) -> TcpConfig {
        TcpConfig {
            stack: TcpStack::Linuxlike,
            congestion: Congestion::Cubic,
            buffer,
            mtu: 1500,
        }
    }

    /// Two hosts joined by a wire of `delay` each way; `drop(n, seq)` says whether the n-th
    /// data segment from A, which starts at `seq`, is lost. Returns what B received, A's
    /// socket state, its retransmissions and timeouts, B's ACKs and when B had it all.
    fn transfer(
        cc: Cc,
        bytes: usize,
        delay: Nanos,
        mut drop: impl FnMut(usize, u64) -> bool,
    ) -> (Vec<u8>, mcsi_tcp::TcpState, (u64, u64), u64, Nanos) {
        let cfg = config(4 << 20);
        let mut a = Host::new(A, 1500);
        let mut b = Host::new(B, 1500);
        let lb = b.listen(&cfg, 3260, cc);
        let sa = a.connect(&cfg, cc, B, 3260, 40000);
        let payload: Vec<u8> = (0..bytes).map(|i| (i * 7 % 251) as u8).collect();
        let mut out = Stream::default();
        let mut written = false;
        let mut got = Stream::default();
        let mut wire: Vec<(Nanos, bool, Vec<u8>)> = Vec::new();
        let mut data_segs = 0;
        let mut acks_from_b = 0;
        let mut now = 0;
        let mut received = Vec::new();
        while now < 60_000 * MS {
            wire.sort_by_key(|w| w.0);
            while wire.first().is_some_and(|w| w.0 <= now) {
                let (_, to_b, p) = wire.remove(0);
                if to_b {
                    b.rx.push_back(p);
                } else {
                    a.rx.push_back(p);
                }
            }
            a.poll(now);
            b.poll(now);
            if a.state(sa) == State::Established && !written {
                let pdu = mcsi_proto::pdu::Pdu::NopOut(mcsi_proto::pdu::NopOut {
                    immediate: false,
                    lun: 0,
                    itt: 1,
                    ttt: 0xffff_ffff,
                    cmd_sn: 1,
                    exp_stat_sn: 1,
                    data: bytes::Bytes::from(payload.clone()),
                });
                let f = mcsi_proto::pdu::Framing {
                    max_data_segment_length: 16 << 20,
                    ..Default::default()
                };
                out.send(&pdu, &f);
                written = true;
            }
            a.exchange(sa, &mut out);
            b.exchange(lb, &mut got);
            a.poll(now);
            b.poll(now);
            while let Some(p) = a.tx.pop_front() {
                if let Some(seg) = parse(&p).filter(|s| !s.data.is_empty()) {
                    data_segs += 1;
                    if drop(data_segs, u64::from(seg.seq)) {
                        continue;
                    }
                }
                wire.push((now + delay, true, p));
            }
            while let Some(p) = b.tx.pop_front() {
                acks_from_b += 1;
                wire.push((now + delay, false, p));
            }
            let f = mcsi_proto::pdu::Framing {
                max_data_segment_length: 16 << 20,
                ..Default::default()
            };
            if let Ok(Some(mcsi_proto::pdu::Pdu::NopOut(n))) = got.decode(&f) {
                received = n.data.to_vec();
                break;
            }
            let next = [a.next_poll(), b.next_poll(), wire.iter().map(|w| w.0).min()]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(now + MS);
            now = next.max(now + 1000);
        }
        (received, a.tcp_state(sa), a.retransmits(), acks_from_b, now)
    }

    #[test]
    fn a_clean_transfer_arrives_whole_with_an_ack_per_two_segments() {
        let (got, st, (re, to), acks, _) = transfer(Cc::Cubic, 300_000, 10 * MS, |_, _| false);
        assert_eq!(got.len(), 300_000);
        assert!(got
            .iter()
            .enumerate()
            .all(|(i, b)| *b == (i * 7 % 251) as u8));
        assert_eq!((re, to), (0, 0));
        // 208 segments: about one ACK for every second one, and the handshake's.
        assert!((100..=120).contains(&acks), "{acks} ACKs");
        // 20 ms of round trip, measured by timestamps (delayed ACKs add to some samples).
        assert!((20_000..=45_000).contains(&st.rtt_us), "{st:?}");
        assert_eq!(st.snd_mss, 1448);
    }

    #[test]
    fn one_loss_is_repaired_by_sack_without_a_timeout() {
        for cc in [Cc::Reno, Cc::Cubic] {
            let (got, st, (re, to), _, _) = transfer(cc, 300_000, 10 * MS, |n, _| n == 30);
            assert_eq!(got.len(), 300_000);
            assert!(got
                .iter()
                .enumerate()
                .all(|(i, b)| *b == (i * 7 % 251) as u8));
            assert_eq!((re, to), (1, 0), "{cc:?}: one fast retransmission");
            // The window was cut once: Reno to half, CUBIC to 70 %.
            assert!(st.ssthresh < 1000, "{cc:?}: {st:?}");
        }
    }

    #[test]
    fn a_lost_tail_is_repaired_by_the_loss_probe_without_a_timeout() {
        // 10 segments, the last one lost: nothing follows it to be SACKed. The probe (the last
        // segment again) goes at the RTO's time and takes its place: the window stays.
        let (got, st, (re, to), _, done) = transfer(Cc::Cubic, 14_000, 10 * MS, |n, _| n == 10);
        assert_eq!(got.len(), 14_000);
        assert_eq!((re, to), (1, 0));
        assert!(st.cwnd >= 10, "{st:?}");
        assert!(done < 400 * MS, "{done}");
        // Two segments lost of 20, the last two: the probe repairs the last, whose SACK shows
        // the other lost (RACK), and that is repaired within a round trip, not an RTO.
        let (got, _, (re, to), _, _) =
            transfer(Cc::Cubic, 28_000, 10 * MS, |n, _| n == 19 || n == 20);
        assert_eq!(got.len(), 28_000);
        assert_eq!((re, to), (2, 0));
    }

    #[test]
    fn a_lost_retransmission_is_found_by_rack_without_a_timeout() {
        // Segment 30 and its first retransmission are lost; data sent after the retransmission
        // is SACKed, so RACK marks it lost again.
        let mut lost_seq = None;
        let mut drops = 0;
        let (got, _, (re, to), _, _) = transfer(Cc::Reno, 600_000, 10 * MS, |n, seq| {
            if n == 30 {
                lost_seq = Some(seq);
            }
            let hit = lost_seq == Some(seq) && drops < 2;
            drops += usize::from(hit);
            hit
        });
        assert_eq!(got.len(), 600_000);
        assert_eq!(drops, 2);
        assert_eq!((re, to), (2, 0));
    }

    #[test]
    fn a_repeated_timeout_or_one_in_recovery_cuts_the_window_once() {
        let cfg = config(1 << 20);
        let mut s = Socket::new(1, &cfg, 1448, Cc::Cubic);
        s.cwnd = 100 * 1448;
        s.on_timeout(0);
        s.on_timeout(300 * MS);
        assert_eq!(s.ssthresh, 70 * 1448);
        assert_eq!(s.cwnd, 1448);
        let mut s = Socket::new(1, &cfg, 1448, Cc::Reno);
        s.cwnd = 100 * 1448;
        s.recover = Some(1);
        s.ssthresh = 50 * 1448;
        s.on_timeout(0);
        assert_eq!(s.ssthresh, 50 * 1448);
    }

    #[test]
    fn the_window_grows_only_while_it_limits_the_sender() {
        let cfg = config(1 << 20);
        for cc in [Cc::Reno, Cc::Cubic] {
            let mut s = Socket::new(1, &cfg, 1448, cc);
            s.cwnd = 20 * 1448;
            s.ssthresh = 10 * 1448;
            s.srtt = Some(10 * MS);
            // Four segments in flight at most: not limited by a window of 20.
            s.max_out = 4 * 1448;
            for i in 0..100 {
                s.grow(1448, i * MS);
            }
            assert_eq!(s.cwnd, 20 * 1448, "{cc:?}");
            s.cwnd_limited = true;
            for i in 100..200 {
                s.grow(1448, i * MS);
            }
            assert!(s.cwnd > 20 * 1448, "{cc:?}");
        }
        // In slow start, up to twice what was in flight.
        let mut s = Socket::new(1, &cfg, 1448, Cc::Cubic);
        s.max_out = 8 * 1448;
        for _ in 0..20 {
            s.grow(1448, 0);
        }
        assert_eq!(s.cwnd, 16 * 1448);
    }

    #[test]
    fn cubic_k_counts_from_the_window_the_cut_leaves() {
        let cfg = config(1 << 20);
        let mut s = Socket::new(1, &cfg, 1000, Cc::Cubic);
        s.cwnd = 100_000;
        s.on_loss(0);
        // K = cbrt((100 - 70) / 0.4) segments-seconds.
        assert!(
            (s.cubic.k - (30.0f64 / 0.4).cbrt()).abs() < 1e-9,
            "{}",
            s.cubic.k
        );
        // Fast convergence: a loss below the last maximum lowers W_max to (1 + β) / 2 of cwnd.
        s.cwnd = 80_000;
        s.on_loss(0);
        assert!((s.cubic.w_max - 68_000.0).abs() < 1e-6);
        assert!((s.cubic.k - ((68.0f64 - 56.0) / 0.4).cbrt()).abs() < 1e-9);
    }

    #[test]
    fn cubic_closes_its_gap_over_a_window_of_acks_and_looks_one_min_rtt_ahead() {
        let cfg = config(1 << 20);
        let mss = 1000u64;
        // A CUBIC socket of 1000-byte segments cut from 100 segments to 70, on a path of
        // 10 ms, its window limiting it.
        let after_a_cut = || {
            let mut s = Socket::new(1, &cfg, mss, Cc::Cubic);
            s.cwnd = 100 * mss;
            s.on_loss(0);
            s.cwnd = s.ssthresh;
            s.cwnd_limited = true;
            s.min_rtt = Some(10 * MS);
            s
        };
        let mut s = after_a_cut();
        // A standing queue: the smoothed RTT is ten times the path's.
        s.srtt = Some(100 * MS);
        // At the epoch's start the curve, one minimum RTT ahead, is a fraction of a segment
        // above the window: one ACK adds (target - cwnd) / cwnd of a segment, under a byte of
        // growth per byte acked, not the jump to the curve.
        let k = s.cubic.k;
        let target = C * (0.010 - k).powi(3) * mss as f64 + 100.0 * mss as f64;
        let before = s.cwnd;
        s.grow(mss, 0);
        let want = (target - before as f64) / before as f64 * mss as f64;
        assert!(
            (s.cwnd - before) as f64 <= want.ceil() && want < mss as f64 / 2.0,
            "grew {} for one segment acked, the curve says {want:.2}",
            s.cwnd - before
        );
        // Evaluated one smoothed RTT ahead the curve would be further on.
        let srtt_target = C * (0.100 - k).powi(3) * mss as f64 + 100.0 * mss as f64;
        assert!(srtt_target > target);
        // The Reno-friendly window ahead by 10 segments: one ACK adds 10/70 of a segment
        // (Linux's cnt = cwnd / (w_est - cwnd)), not half a segment towards a jump.
        let mut r = after_a_cut();
        r.cubic.w_est = 80.0 * mss as f64;
        let before = r.cwnd;
        r.grow(mss, 0);
        let grew = (r.cwnd - before) as f64;
        assert!((grew - 10_000.0 / 70.0).abs() < 2.0, "grew {grew}");
        // K seconds on, the curve is back at W_max, 30 segments above the window: a window's
        // worth of ACKs closes part of the gap (each a share of what is left), not all of it
        // at the first ACK.
        let at_k = (k * 1e9) as Nanos;
        let start = s.cwnd;
        let gap = 100.0 * mss as f64 - start as f64;
        s.grow(mss, at_k);
        let first = (s.cwnd - start) as f64;
        assert!(first < gap / 50.0, "one ACK grew {first} of a {gap} gap");
        for _ in 1..70 {
            s.grow(mss, at_k);
        }
        let grown = (s.cwnd - start) as f64;
        assert!(
            grown < gap && grown > 0.5 * gap,
            "grew {grown}, gap {gap:.1}"
        );
    }

    #[test]
    fn reno_halves_its_window_and_cubic_keeps_seventy_percent() {
        let cfg = config(1 << 20);
        for (cc, keep) in [(Cc::Reno, 0.5), (Cc::Cubic, 0.7)] {
            let mut s = Socket::new(1, &cfg, 1448, cc);
            s.cwnd = 100 * 1448;
            s.ssthresh = 50 * 1448;
            s.on_loss(0);
            let got = s.ssthresh as f64 / (100.0 * 1448.0);
            assert!((got - keep).abs() < 0.01, "{cc:?}: {got}");
        }
    }
}
