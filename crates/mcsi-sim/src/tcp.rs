//! A TCP for the simulator, written to behave as Linux's does where the research looks: the
//! initial window of 10 segments, Reno or CUBIC (RFC 9438, β 0.7, C 0.4, fast convergence, the
//! Reno-friendly region), SACK-based loss recovery (RFC 6675: a segment is lost once three
//! segments above it are SACKed, or at the third duplicate ACK), a retransmission timeout of
//! RFC 6298 with Linux's 200 ms floor, and delayed ACKs (every second full segment, or 40 ms).
//! It keeps its state where a simulation can read it ([`Host::tcp_state`], the fields of
//! Linux's `TCP_INFO` that mcsi uses).
//!
//! Segments are IPv4 packets, so that the link model classifies and times them as it does real
//! ones: a 20-byte IP header, then ports, 32-bit sequence and acknowledgement numbers, flags and
//! the window; the header is as long as Linux's with timestamps (32 bytes) plus a SACK option
//! of up to 3 blocks. Left out: the FIN handshake (connections are never closed), window
//! scaling limits (the window field is 32 bits), HyStart, PRR (the window drops to ssthresh at
//! once), RACK and tail-loss probes, zero-window probes, and pacing.

use crate::stream::Stream;
use bytes::{Buf, BytesMut};
use mcsi_link::Nanos;
use std::collections::{BTreeMap, VecDeque};

const MS: Nanos = 1_000_000;
/// Linux's minimum RTO and its initial one (RFC 6298: 1 s).
const RTO_MIN: Nanos = 200 * MS;
const RTO_INIT: Nanos = 1000 * MS;
const RTO_MAX: Nanos = 120_000 * MS;
/// Linux's delayed-ACK timeout (its minimum, 40 ms).
const DELACK: Nanos = 40 * MS;
const IW_SEGMENTS: u64 = 10;
const DUP_THRESH: u64 = 3;
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
}

const BETA: f64 = 0.7;
const C: f64 = 0.4;

struct Socket {
    state: State,
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
    dupacks: u64,
    /// In loss recovery until `snd_una` reaches this.
    recover: Option<u64>,
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
    /// Data received since the last segment sent (which would have acknowledged it).
    rcv_unacked: bool,
    delack_at: Option<Nanos>,
    ack_now: bool,
    /// Ranges received out of order, most recent first, for the SACK option.
    sack_recent: Vec<(u64, u64)>,
}

/// A host: its address, its sockets, its packet queues to and from the link.
pub struct Host {
    pub addr: [u8; 4],
    socks: Vec<Socket>,
    pub rx: VecDeque<Vec<u8>>,
    pub tx: VecDeque<Vec<u8>>,
    mtu: usize,
    next: Option<Nanos>,
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
            dupacks: 0,
            recover: None,
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
                self.cubic = Cubic {
                    w_max,
                    k: ((w_max / mss) * (1.0 - BETA) / C).cbrt(),
                    epoch: None,
                    w_est: cwnd * BETA,
                };
                self.ssthresh = ((cwnd * BETA) as u64).max(2 * self.mss);
            }
        }
        let _ = now;
    }

    /// The window grows for `acked` new bytes outside recovery.
    fn grow(&mut self, acked: u64, now: Nanos) {
        if self.cwnd < self.ssthresh {
            // Slow start, with appropriate byte counting (at most 2 MSS per ACK).
            self.cwnd += acked.min(2 * self.mss);
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
                if c.w_max <= 0.0 {
                    c.w_max = cwnd;
                    c.k = 0.0;
                    c.w_est = cwnd;
                }
                let t = (now.saturating_sub(epoch) + self.srtt.unwrap_or(0)) as f64 / 1e9;
                let target = (C * (t - c.k).powi(3) * mss + c.w_max).max(cwnd);
                // RFC 9438 4.3: the Reno-friendly estimate.
                let alpha = 3.0 * (1.0 - BETA) / (1.0 + BETA);
                c.w_est += alpha * mss * acked as f64 / cwnd;
                let grow = if c.w_est > target {
                    c.w_est - cwnd
                } else {
                    (target - cwnd) / cwnd * acked as f64
                };
                self.cwnd += grow.max(0.0).min(acked as f64) as u64;
            }
        }
    }

    /// An ACK from the peer.
    fn on_ack(&mut self, seg: &Seg<'_>, now: Nanos) {
        let ack = unwrap(seg.ack, self.snd_una);
        if ack > self.snd_nxt {
            return;
        }
        self.snd_wnd = u64::from(seg.wnd);
        self.scoreboard |= !seg.sacks.is_empty();
        // SACK blocks mark what arrived above a hole.
        for &(l, r) in &seg.sacks {
            let (l, r) = (unwrap(l, self.snd_una), unwrap(r, self.snd_una));
            for s in self.sent.iter_mut() {
                if s.seq >= l && s.seq + s.len <= r {
                    s.sacked = true;
                }
            }
        }
        if ack > self.snd_una {
            let acked = ack - self.snd_una;
            self.bytes_acked += acked;
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
            self.sbuf.advance(acked as usize);
            self.snd_una = ack;
            self.dupacks = 0;
            if let Some(r) = sample {
                self.rtt_sample(r);
            }
            match self.recover {
                Some(p) if ack >= p => {
                    self.recover = None;
                    self.cwnd = self.ssthresh;
                }
                Some(_) => {}
                None => self.grow(acked, now),
            }
            self.rto_at = (!self.sent.is_empty()).then(|| now + self.rto);
        } else if seg.data.is_empty() && !self.sent.is_empty() {
            self.dupacks += 1;
        }
        if !seg.sacks.is_empty() || self.dupacks >= DUP_THRESH {
            self.detect_loss(now);
        }
    }

    /// RFC 6675's loss rule: a segment with DupThresh SACKed segments above it is lost, and so
    /// is the first one at the third duplicate ACK.
    fn detect_loss(&mut self, now: Nanos) {
        let mut above = 0;
        let mut newly = false;
        for s in self.sent.iter_mut().rev() {
            if s.sacked {
                above += 1;
            } else if above >= DUP_THRESH && !s.lost {
                s.lost = true;
                newly = true;
            }
        }
        if self.dupacks >= DUP_THRESH {
            if let Some(s) = self.sent.front_mut() {
                if !s.lost && !s.sacked {
                    s.lost = true;
                    newly = true;
                }
            }
        }
        self.scoreboard |= newly;
        if newly && self.recover.is_none() {
            self.recover = Some(self.snd_nxt);
            self.on_loss(now);
            self.cwnd = self.ssthresh;
        }
    }

    fn on_timeout(&mut self, now: Nanos) {
        self.timeouts += 1;
        if self.undo.is_none() {
            self.undo = Some((now, self.cwnd, self.ssthresh));
        }
        self.on_loss(now);
        self.cwnd = self.mss;
        self.recover = None;
        self.dupacks = 0;
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
        if seg.data.is_empty() {
            return;
        }
        let seq = unwrap(seg.seq, self.rcv_nxt);
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
            next: Some(0),
        }
    }

    fn mss(&self) -> u64 {
        (self.mtu - IP_HDR - TCP_HDR) as u64
    }

    pub fn listen(&mut self, cfg: &super::net::TcpConfig, port: u16, cc: Cc) -> usize {
        let s = Socket::new(port, cfg, self.mss(), cc);
        self.socks.push(s);
        self.socks.len() - 1
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
        self.next = Some(0);
        self.socks.len() - 1
    }

    pub fn state(&self, h: usize) -> State {
        self.socks[h].state
    }

    pub fn next_poll(&self) -> Option<Nanos> {
        self.next
    }

    /// Moves bytes between socket `h` and `stream` both ways. True when any moved.
    pub fn exchange(&mut self, h: usize, stream: &mut Stream) -> bool {
        let s = &mut self.socks[h];
        let mut moved = false;
        if !s.rbuf.is_empty() {
            stream.deliver(&s.rbuf);
            s.rbuf.clear();
            moved = true;
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
        let mss = self.mss();
        let mut next: Option<Nanos> = None;
        let mut out = std::mem::take(&mut self.tx);
        for s in &mut self.socks {
            match s.state {
                State::Listen => continue,
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
                        out.push_back(segment(self.addr, s, flags, s.snd_una, &[], &[], now));
                    }
                    next = min_opt(next, s.syn_at.map(|t| t + s.rto));
                    continue;
                }
                State::Established => {}
            }
            if s.rto_at.is_some_and(|t| now >= t) {
                s.on_timeout(now);
            }
            // Retransmit what is marked lost, lowest first, then send new data.
            let mut sent_any = false;
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
                    let x = s.sent[i];
                    if pipe + x.len > s.cwnd.max(mss) {
                        break;
                    }
                    let off = (x.seq - s.snd_una) as usize;
                    let data = s.sbuf[off..off + x.len as usize].to_vec();
                    out.push_back(segment(self.addr, s, ACK, x.seq, &data, &[], now));
                    let e = &mut s.sent[i];
                    e.retransmitted = true;
                    e.at = now;
                    s.retrans_total += 1;
                    pipe += x.len;
                    lost -= 1;
                    from = i + 1;
                    sent_any = true;
                    continue;
                }
                let unsent = (s.snd_una + s.sbuf.len() as u64).saturating_sub(s.snd_nxt);
                let wnd_room = (s.snd_una + s.snd_wnd).saturating_sub(s.snd_nxt);
                let len = unsent.min(mss).min(wnd_room);
                if len == 0 || pipe + len > s.cwnd {
                    break;
                }
                pipe += len;
                let off = (s.snd_nxt - s.snd_una) as usize;
                let data = s.sbuf[off..off + len as usize].to_vec();
                let seq = s.snd_nxt;
                out.push_back(segment(self.addr, s, ACK, seq, &data, &[], now));
                s.sent.push_back(Sent {
                    seq,
                    len,
                    at: now,
                    retransmitted: false,
                    sacked: false,
                    lost: false,
                });
                s.snd_nxt += len;
                sent_any = true;
            }
            if sent_any {
                // Data carries the acknowledgement.
                s.acked();
                if s.rto_at.is_none() {
                    s.rto_at = Some(now + s.rto);
                }
            }
            if s.ack_now || s.delack_at.is_some_and(|t| now >= t) {
                out.push_back(s.ack(self.addr, now));
            } else if s.rcv_unacked {
                s.delack_at.get_or_insert(now + DELACK);
            }
            next = min_opt(next, s.rto_at);
            next = min_opt(next, s.delack_at);
        }
        self.tx = out;
        self.next = next;
    }

    fn input(&mut self, p: &[u8], now: Nanos) {
        let Some(seg) = parse(p) else { return };
        let found = self.socks.iter().position(|s| {
            s.state != State::Listen
                && s.local_port == seg.dport
                && s.remote_port == seg.sport
                && s.remote == seg.src
        });
        let i = match found {
            Some(i) => i,
            None if seg.flags & SYN != 0 && seg.flags & ACK == 0 => {
                let Some(i) = self
                    .socks
                    .iter()
                    .position(|s| s.state == State::Listen && s.local_port == seg.dport)
                else {
                    return;
                };
                let s = &mut self.socks[i];
                s.state = State::SynReceived;
                s.remote = seg.src;
                s.remote_port = seg.sport;
                s.rcv_nxt = u64::from(seg.seq) + 1;
                s.rcv_wup = s.rcv_nxt;
                s.snd_wnd = u64::from(seg.wnd);
                s.syn_at = None;
                self.next = Some(now);
                return;
            }
            None => return,
        };
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
        self.next = Some(now);
    }

    /// The connection's TCP state, as `TCP_INFO` would give it.
    pub fn tcp_state(&self, h: usize) -> mcsi_tcp::TcpState {
        let s = &self.socks[h];
        let us = |n: Nanos| (n / 1000).min(u64::from(u32::MAX)) as u32;
        let mss = s.mss.max(1);
        mcsi_tcp::TcpState {
            ca_state: if s.recover.is_some() {
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

/// The timestamp clock: µs, wrapping, never 0 (0 means "no echo yet").
fn ns_to_us(n: Nanos) -> u32 {
    ((n / 1000) as u32).max(1)
}

fn min_opt(a: Option<Nanos>, b: Option<Nanos>) -> Option<Nanos> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
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

    /// Two hosts joined by a wire of `delay` each way; `drop(n)` says whether the n-th data
    /// segment from A is lost. Returns what B received, A's socket state and its counters.
    fn transfer(
        cc: Cc,
        bytes: usize,
        delay: Nanos,
        drop: impl Fn(usize) -> bool,
    ) -> (Vec<u8>, mcsi_tcp::TcpState, (u64, u64), u64) {
        let cfg = TcpConfig {
            stack: TcpStack::Linuxlike,
            congestion: Congestion::Cubic,
            buffer: 4 << 20,
            mtu: 1500,
        };
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
                let is_data = parse(&p).is_some_and(|s| !s.data.is_empty());
                if is_data {
                    data_segs += 1;
                    if drop(data_segs) {
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
        (received, a.tcp_state(sa), a.retransmits(), acks_from_b)
    }

    #[test]
    fn a_clean_transfer_arrives_whole_with_an_ack_per_two_segments() {
        let (got, st, (re, to), acks) = transfer(Cc::Cubic, 300_000, 10 * MS, |_| false);
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
            let (got, st, (re, to), _) = transfer(cc, 300_000, 10 * MS, |n| n == 30);
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
    fn a_lost_tail_waits_for_the_timeout() {
        // 10 segments, the last one lost: nothing follows it to raise duplicate ACKs.
        let (got, _, (re, to), _) = transfer(Cc::Cubic, 14_000, 10 * MS, |n| n == 10);
        assert_eq!(got.len(), 14_000);
        assert_eq!((re, to), (1, 1));
    }

    #[test]
    fn reno_halves_its_window_and_cubic_keeps_seventy_percent() {
        let cfg = TcpConfig {
            stack: TcpStack::Linuxlike,
            congestion: Congestion::Cubic,
            buffer: 1 << 20,
            mtu: 1500,
        };
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
