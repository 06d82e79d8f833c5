//! 802.11 DCF airtime: one half-duplex medium shared by two stations, the command's side
//! (sending up) and the access point on the host's side (sending down).
//!
//! A frame's service time is its airtime: DIFS, a backoff drawn uniformly from 0..=CW slots,
//! preamble and PLCP header, MAC header and payload at the data rate, SIFS, ACK. A failed attempt
//! (frame error with probability `per`, or a collision when both stations end their backoff in
//! the same slot) doubles CW up to CWmax and retries; after `retry_limit` attempts the frame is
//! dropped. A station that loses the contention freezes its backoff counter and resumes it after
//! the next DIFS (802.11-2016 10.3.4.3).

use crate::config::{invalid, ConfigError, DirConfig};
use crate::dir::{DirState, DropCause, Pending};
use crate::stats::PathStats;
use crate::Nanos;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// PHY and MAC timing of one 802.11 variant.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WifiParams {
    pub name: String,
    pub slot: Nanos,
    pub sifs: Nanos,
    pub difs: Nanos,
    pub cw_min: u32,
    pub cw_max: u32,
    /// Attempts per frame before it is dropped (dot11ShortRetryLimit).
    pub retry_limit: u32,
    /// Physical preamble (T_p).
    pub preamble: Nanos,
    /// PLCP header (T_PHY).
    pub plcp_header: Nanos,
    /// OFDM PHYs: payload in 4 us symbols with 16 service and 6 tail bits, plus this signal
    /// extension (ERP-OFDM, 802.11-2016 18.3.2.4); DSSS PHYs: payload bits at the rate.
    pub ofdm: bool,
    pub signal_extension: Nanos,
    /// Bytes a data frame adds to the IP packet (MAC header, LLC/SNAP, FCS).
    pub mac_overhead: u32,
    /// Bytes of an ACK frame as transmitted after its PLCP header.
    pub ack_bytes: u32,
    pub data_rate: f64,
    pub ack_rate: f64,
    /// One-way propagation delay (tau); a cycle has two.
    pub prop_delay: Nanos,
    /// Frame error rate per attempt.
    pub per: f64,
}

const US: Nanos = 1_000;

impl WifiParams {
    /// 802.11b at 11 Mbit/s with the parameters of seed 000, Table 3.2: slot 20 us, SIFS 10 us,
    /// DIFS 50 us, CWmin 31, preamble 144 us, PLCP header 48 us, MAC overhead 34 bytes, ACK
    /// 14 bytes, tau 1 us. As in its eq. 3.6 the ACK also carries the 34 bytes of MAC overhead
    /// and goes at the data rate; with 1500-byte packets this gives its 6.1 Mbit/s.
    pub fn b() -> Self {
        WifiParams {
            name: "802.11b".into(),
            slot: 20 * US,
            sifs: 10 * US,
            difs: 50 * US,
            cw_min: 31,
            cw_max: 1023,
            retry_limit: 7,
            preamble: 144 * US,
            plcp_header: 48 * US,
            ofdm: false,
            signal_extension: 0,
            mac_overhead: 34,
            ack_bytes: 34 + 14,
            data_rate: 11e6,
            ack_rate: 11e6,
            prop_delay: US,
            per: 0.0,
        }
    }

    /// 802.11g (ERP-OFDM only, short slot) at 54 Mbit/s, ACK at 24 Mbit/s: slot 9 us, SIFS
    /// 10 us, DIFS 28 us, CWmin 15, preamble 16 us + SIGNAL 4 us, 6 us signal extension,
    /// 24-byte MAC header + 8 LLC/SNAP + 4 FCS, 14-byte ACK.
    pub fn g() -> Self {
        WifiParams {
            name: "802.11g".into(),
            slot: 9 * US,
            sifs: 10 * US,
            difs: 28 * US,
            cw_min: 15,
            cw_max: 1023,
            retry_limit: 7,
            preamble: 16 * US,
            plcp_header: 4 * US,
            ofdm: true,
            signal_extension: 6 * US,
            mac_overhead: 36,
            ack_bytes: 14,
            data_rate: 54e6,
            ack_rate: 24e6,
            prop_delay: US,
            per: 0.0,
        }
    }

    pub fn profile(name: &str) -> Result<Self, ConfigError> {
        match name.trim().to_ascii_lowercase().as_str() {
            "802.11b" | "80211b" | "11b" | "b" => Ok(Self::b()),
            "802.11g" | "80211g" | "11g" | "g" => Ok(Self::g()),
            _ => Err(invalid("profile", name, "known profiles: 802.11b, 802.11g")),
        }
    }

    fn bits_time(&self, bytes: u32, rate: f64) -> Nanos {
        let bits = 8.0 * bytes as f64;
        if self.ofdm {
            let per_symbol = (rate * 4e-6).round().max(1.0);
            let symbols = ((16.0 + bits + 6.0) / per_symbol).ceil();
            (symbols * 4_000.0) as Nanos + self.signal_extension
        } else {
            (bits * 1e9 / rate).round() as Nanos
        }
    }

    /// Airtime of a data frame carrying an IP packet of `len` bytes.
    pub fn data_airtime(&self, len: usize) -> Nanos {
        let bytes = (len as u64 + self.mac_overhead as u64).min(u32::MAX as u64) as u32;
        self.preamble + self.plcp_header + self.bits_time(bytes, self.data_rate)
    }

    pub fn ack_airtime(&self) -> Nanos {
        self.preamble + self.plcp_header + self.bits_time(self.ack_bytes, self.ack_rate)
    }

    /// From the first bit of the data frame to the end of its ACK: data, SIFS, ACK, 2 tau.
    /// A failed attempt keeps the medium for as long (the sender waits out the ACK timeout).
    pub fn exchange(&self, len: usize) -> Nanos {
        self.data_airtime(len) + self.sifs + self.ack_airtime() + 2 * self.prop_delay
    }
}

#[derive(Debug)]
struct Station {
    st: DirState,
    cw: u32,
    /// Backoff slots left for the head frame.
    backoff: u32,
    /// Attempts already made for the head frame.
    attempts: u32,
    /// When the head frame became head (its contention cannot start earlier).
    head_since: Nanos,
}

#[derive(Debug)]
struct Tx {
    /// Who transmits, and whether each attempt succeeds.
    ok: [Option<bool>; 2],
    data_end: Nanos,
    end: Nanos,
    delivered: bool,
}

/// One 802.11 cell: index 0 is the up direction (toward the host), 1 is down.
#[derive(Debug)]
pub(crate) struct Cell {
    p: WifiParams,
    sta: [Station; 2],
    rng: ChaCha8Rng,
    idle_since: Nanos,
    tx: Option<Tx>,
    busy_ns: u64,
}

impl Cell {
    pub fn new(p: WifiParams, up: DirConfig, down: DirConfig, rngs: [ChaCha8Rng; 3]) -> Self {
        let [a, b, c] = rngs;
        let mk = |cfg, rng| Station {
            st: DirState::new(cfg, rng),
            cw: p.cw_min,
            backoff: 0,
            attempts: 0,
            head_since: 0,
        };
        Cell {
            sta: [mk(up, a), mk(down, b)],
            p,
            rng: c,
            idle_since: 0,
            tx: None,
            busy_ns: 0,
        }
    }

    pub fn enqueue(&mut self, i: usize, pkt: Vec<u8>, now: Nanos) -> Result<(), DropCause> {
        self.advance(now);
        let was_empty = self.sta[i].st.queue.len() == 0;
        self.sta[i].st.admit(pkt, now)?;
        if was_empty {
            self.new_head(i, now);
        }
        self.advance(now);
        Ok(())
    }

    fn new_head(&mut self, i: usize, at: Nanos) {
        let s = &mut self.sta[i];
        s.head_since = at;
        s.attempts = 0;
        s.cw = self.p.cw_min;
        s.backoff = self.rng.gen_range(0..=s.cw);
    }

    /// When station i's backoff would reach zero if nothing else happened.
    fn start_time(&self, i: usize) -> Option<Nanos> {
        let s = &self.sta[i];
        let head = s.st.queue.front()?;
        let countdown = self.idle_since.max(s.head_since).max(head.arrival) + self.p.difs;
        Some(countdown + s.backoff as Nanos * self.p.slot)
    }

    pub fn advance(&mut self, now: Nanos) {
        loop {
            if let Some(tx) = &mut self.tx {
                if !tx.delivered {
                    if tx.data_end > now {
                        return;
                    }
                    tx.delivered = true;
                    let at = tx.data_end;
                    for i in 0..2 {
                        if tx.ok[i] == Some(true) {
                            // The receiver has the frame once its last bit arrived.
                            if let Some(head) = self.sta[i].st.queue.front() {
                                let p = Pending {
                                    pkt: head.pkt.clone(),
                                    arrival: head.arrival,
                                };
                                self.sta[i].st.served(p, at);
                            }
                        }
                    }
                    continue;
                }
                if tx.end > now {
                    return;
                }
                let (ok, end) = (tx.ok, tx.end);
                self.tx = None;
                self.finish(ok, end);
                continue;
            }
            let starts = [self.start_time(0), self.start_time(1)];
            let t0 = match starts {
                [Some(a), Some(b)] => a.min(b),
                [Some(a), None] | [None, Some(a)] => a,
                [None, None] => return,
            };
            if t0 > now {
                return;
            }
            self.begin(starts, t0);
        }
    }

    fn begin(&mut self, starts: [Option<Nanos>; 2], t0: Nanos) {
        // Stations whose backoff ends within the same slot cannot hear each other in time.
        let mut tx_on = [false; 2];
        for i in 0..2 {
            if let Some(s) = starts[i] {
                if s < t0 + self.p.slot {
                    tx_on[i] = true;
                } else {
                    // Freeze: count down the idle slots already passed.
                    let cs = s - self.sta[i].backoff as Nanos * self.p.slot;
                    if t0 > cs {
                        let passed = ((t0 - cs) / self.p.slot) as u32;
                        self.sta[i].backoff = self.sta[i].backoff.saturating_sub(passed);
                    }
                }
            }
        }
        let collision = tx_on[0] && tx_on[1];
        let mut ok = [None; 2];
        let mut data = 0;
        let mut exch = 0;
        for i in 0..2 {
            if !tx_on[i] {
                continue;
            }
            let len = self.sta[i].st.queue.front().map_or(0, |h| h.pkt.len());
            data = data.max(self.p.data_airtime(len));
            exch = exch.max(self.p.exchange(len));
            let frame_error = self.p.per > 0.0 && self.rng.gen::<f64>() < self.p.per;
            let success = !(collision || frame_error);
            ok[i] = Some(success);
            let s = &mut self.sta[i].st.stats;
            s.attempts += 1;
            if collision {
                s.collisions += 1;
            }
        }
        self.busy_ns += exch;
        self.tx = Some(Tx {
            ok,
            data_end: t0 + data + self.p.prop_delay,
            end: t0 + exch,
            delivered: false,
        });
    }

    fn finish(&mut self, ok: [Option<bool>; 2], end: Nanos) {
        self.idle_since = end;
        for (i, o) in ok.iter().enumerate() {
            let Some(success) = *o else { continue };
            let s = &mut self.sta[i];
            s.attempts += 1;
            if success || s.attempts >= self.p.retry_limit {
                if !success {
                    s.st.stats.drop_retry_limit += 1;
                }
                let _ = s.st.queue.pop();
                if s.st.queue.len() > 0 {
                    self.new_head(i, end);
                }
            } else {
                s.st.stats.retries += 1;
                s.cw = (2 * (s.cw + 1) - 1).min(self.p.cw_max);
                s.backoff = self.rng.gen_range(0..=s.cw);
            }
        }
    }

    pub fn next_event(&self) -> Option<Nanos> {
        let medium = match &self.tx {
            Some(tx) if !tx.delivered => Some(tx.data_end),
            Some(tx) => Some(tx.end),
            None => match (self.start_time(0), self.start_time(1)) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        };
        [
            medium,
            self.sta[0].st.next_release(),
            self.sta[1].st.next_release(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    pub fn dir(&mut self, i: usize) -> &mut DirState {
        &mut self.sta[i].st
    }

    pub fn stats(&self) -> PathStats {
        PathStats {
            up: self.sta[0].st.stats.clone(),
            down: self.sta[1].st.stats.clone(),
            airtime_busy_ns: self.busy_ns,
        }
    }

    #[cfg(test)]
    fn dir_stats(&self, i: usize) -> &crate::stats::DirStats {
        &self.sta[i].st.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::QueueLimit;
    use rand::SeedableRng;

    fn rngs(seed: u64) -> [ChaCha8Rng; 3] {
        let mk = |s| {
            let mut r = ChaCha8Rng::seed_from_u64(seed);
            r.set_stream(s);
            r
        };
        [mk(0), mk(1), mk(2)]
    }

    fn big_queue() -> DirConfig {
        DirConfig {
            queue: QueueLimit::Packets(1_000_000),
            ..Default::default()
        }
    }

    /// Runs the cell until idle, returning (delivery time, direction, packet).
    fn run(c: &mut Cell) -> Vec<(Nanos, usize, Vec<u8>)> {
        let mut out = vec![];
        let mut now = 0;
        loop {
            c.advance(now);
            for i in 0..2 {
                while let Some((t, _, p)) = c.dir(i).pop_due(now) {
                    out.push((t, i, p));
                }
            }
            match c.next_event() {
                Some(t) => now = t,
                None => return out,
            }
        }
    }

    #[test]
    fn airtime_golden() {
        let b = WifiParams::b();
        // 192 us + (34 + 1500) * 8 / 11 Mbit/s = 192 + 1115.636 us.
        assert_eq!(b.data_airtime(1500), 1_307_636);
        // 192 us + (34 + 14) * 8 / 11 Mbit/s = 192 + 34.909 us.
        assert_eq!(b.ack_airtime(), 226_909);
        let g = WifiParams::g();
        // 16 + 12288 + 6 bits / 216 per symbol -> 57 symbols = 228 us, + 20 + 6 us.
        assert_eq!(g.data_airtime(1500), 254_000);
        // 16 + 112 + 6 bits / 96 -> 2 symbols = 8 us, + 20 + 6 us.
        assert_eq!(g.ack_airtime(), 34_000);
    }

    #[test]
    fn mac_throughput_matches_thesis_6_1_mbit() {
        // Seed 000 eq. 3.7 with Table 3.2, 1460 bytes of TCP payload per 1500-byte packet:
        // cycle = 50 + 31*20/2 + 1307.636 + 10 + 226.909 + 2 = 1906.545 us,
        // throughput = 8 * 1460 / 1906.545 us = 6.126 Mbit/s.
        let mut c = Cell::new(WifiParams::b(), big_queue(), big_queue(), rngs(1));
        let n = 20_000;
        for _ in 0..n {
            c.enqueue(1, vec![0; 1500], 0).unwrap();
        }
        let out = run(&mut c);
        assert_eq!(out.len(), n);
        let t = out.last().unwrap().0 as f64 / 1e9;
        let mbit = n as f64 * 1460.0 * 8.0 / t / 1e6;
        eprintln!("saturated 802.11b: {mbit:.3} Mbit/s");
        assert!((mbit - 6.126).abs() < 0.03, "{mbit}");
        assert_eq!(c.dir_stats(1).attempts, n as u64);
    }

    #[test]
    fn tcp_like_exchange_matches_thesis_range() {
        // Two 1500-byte segments down, one 52-byte ACK up, in turn (delayed ACKs, no overlap).
        // cycle(52) = 50 + 310 + 192 + 86*8/11 + 10 + 226.909 + 2 = 853.454 us, so a round is
        // 2 * 1906.545 + 853.454 = 4666.545 us for 2 * 1448 bytes of goodput: 4.965 Mbit/s,
        // inside the 4.9-5.2 Mbit/s of seed 000 section 3.2.4.
        let mut c = Cell::new(WifiParams::b(), big_queue(), big_queue(), rngs(2));
        let rounds = 5_000;
        let mut now = 0;
        for _ in 0..rounds {
            for _ in 0..2 {
                c.enqueue(1, vec![0; 1500], now).unwrap();
            }
            let mut got = 0;
            while got < 2 {
                now = c.next_event().unwrap();
                c.advance(now);
                while c.dir(1).pop_due(now).is_some() {
                    got += 1;
                }
            }
            // Let the medium go idle before the ACK (the receiver answers the second segment).
            c.enqueue(0, vec![0; 52], now).unwrap();
            loop {
                now = c.next_event().unwrap();
                c.advance(now);
                if c.dir(0).pop_due(now).is_some() {
                    break;
                }
            }
        }
        let mbit = rounds as f64 * 2.0 * 1448.0 * 8.0 / (now as f64 / 1e9) / 1e6;
        eprintln!("data/ACK exchange: {mbit:.3} Mbit/s");
        assert!((mbit - 4.965).abs() < 0.05, "{mbit}");
    }

    #[test]
    fn frame_errors_retry_with_doubling_window_and_drop_after_limit() {
        // per = 50 %, 7 attempts: a frame is dropped with probability 0.5^7 = 1/128 and takes
        // sum_{k<7} 0.5^k = 1.984 attempts on average. Attempt k waits DIFS + CW_k/2 slots with
        // CW = 31, 63, 127, 255, 511, 1023, 1023, then holds the medium for one exchange.
        let mut p = WifiParams::b();
        p.per = 0.5;
        let mut c = Cell::new(p.clone(), big_queue(), big_queue(), rngs(3));
        let n = 40_000u64;
        for _ in 0..n {
            c.enqueue(0, vec![0; 1000], 0).unwrap();
        }
        let out = run(&mut c);
        let s = c.dir_stats(0).clone();
        let dropped = s.drop_retry_limit as f64 / n as f64;
        assert!((dropped - 1.0 / 128.0).abs() < 0.0025, "{dropped}");
        assert_eq!(out.len() as u64 + s.drop_retry_limit, n);
        let attempts = s.attempts as f64 / n as f64;
        eprintln!("per 50%: dropped {dropped:.5}, attempts {attempts:.3}");
        assert!((attempts - 1.984).abs() < 0.03, "{attempts}");
        let cws = [31.0, 63.0, 127.0, 255.0, 511.0, 1023.0, 1023.0];
        let exch = 192.0 + (34.0 + 1000.0) * 8.0 / 11.0 + 10.0 + 226.909 + 2.0;
        let per_frame: f64 = cws
            .iter()
            .enumerate()
            .map(|(k, cw)| 0.5f64.powi(k as i32) * (50.0 + cw / 2.0 * 20.0 + exch))
            .sum();
        // The medium is never idle beyond DIFS + backoff, so the run ends near n * per_frame.
        let total_us = c.idle_since as f64 / 1e3;
        let ratio = total_us / (n as f64 * per_frame);
        assert!((ratio - 1.0).abs() < 0.02, "{ratio}");
    }

    #[test]
    fn both_directions_share_one_medium() {
        // Saturated in both directions, the cell carries about what one direction alone would
        // (minus collisions), split about evenly: not two independent 6 Mbit/s pipes.
        let mut c = Cell::new(WifiParams::b(), big_queue(), big_queue(), rngs(4));
        let n = 10_000;
        for _ in 0..n {
            c.enqueue(0, vec![0; 1500], 0).unwrap();
            c.enqueue(1, vec![0; 1500], 0).unwrap();
        }
        let mut now = 0;
        let mut got = [0u64; 2];
        // Run for 10 s of virtual time.
        while now < 10_000_000_000 {
            c.advance(now);
            for (i, g) in got.iter_mut().enumerate() {
                while c.dir(i).pop_due(now).is_some() {
                    *g += 1;
                }
            }
            now = c.next_event().unwrap();
        }
        let total = (got[0] + got[1]) as f64 * 1460.0 * 8.0 / 10.0 / 1e6;
        // Single direction: 6.126 Mbit/s. Two contenders collide when they pick the same slot
        // and mean idle backoff shrinks (the minimum of two draws); the sum stays near it.
        assert!(total > 5.5 && total < 6.6, "{total}");
        let share = got[0] as f64 / (got[0] + got[1]) as f64;
        eprintln!("both directions: {total:.3} Mbit/s, up share {share:.3}");
        assert!((share - 0.5).abs() < 0.05, "{share}");
        let s0 = c.dir_stats(0);
        assert!(s0.collisions > 0);
    }
}
