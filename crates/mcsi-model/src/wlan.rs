//! 802.11 DCF throughput as thesis 000 (section 3.2-3.3) computes it.
//!
//! One transmission cycle is DIFS, the mean backoff, the data frame, SIFS and the MAC ACK:
//!
//! ```text
//! (3.1) CW       = CW_min x T_slot / 2
//! (3.5) T_DATA'  = T_p + T_PHY + 8 (L_MAC + L_DATA_TCP) / R_DATA
//! (3.6) T_ACK'   = T_p + T_PHY + 8 (L_MAC + L_ACK) / R_ACK
//! (3.7) MAC throughput = 8 L_DATA / (T_DATA' + T_ACK' + 2 tau + T_DIFS + T_SIFS + CW)
//! ```
//!
//! `L_DATA_TCP` is the frame's payload (the IP packet, 1500 bytes by default) and `L_DATA` the
//! TCP payload in it (1460 bytes after 40 bytes of TCP/IP header). With Table 3.2's 802.11b
//! parameters and `R_ACK = R_DATA = 11 Mbit/s` this is 6.13 Mbit/s, the thesis's "about 6.1";
//! sending the ACK at 2 Mbit/s would give 5.66, so the thesis's figure assumes the data rate.
//!
//! TCP goodput adds what section 3.2.4 names and eq. 3.7 leaves out: the TCP ACKs. With delayed
//! ACKs the receiver sends one bare TCP/IP header (40 bytes) per `k` = 2 segments, in its own
//! DCF cycle, so `goodput = k 8 L_DATA / (k T_cycle(L_DATA_TCP) + T_cycle(40))`: 5.02 Mbit/s for
//! the defaults, 18 % below the MAC figure, inside the thesis's 4.9-5.2 Mbit/s (15-20 % lower).
//!
//! Packet failures (section 3.3): with `P_c` the collision and `P_e` the error probability,
//! `P_f = P_c + P_e - P_c P_e` (eq. 3.15) and the successful share of cycles is
//!
//! ```text
//! (3.12) r_success = 2 (1 - P_f) / (2 - P_f + P_e) x 1 / T_cycle
//! (3.14) P_c = 1 - (1 - tau)^(n - 1),   tau = 2 (1 - 2 P_f) / ((1 - P_f - P_f (2 P_f)^m) W)
//! ```
//!
//! for `n` contending stations, `W = CW_min + 1` and `m` backoff stages (`CW_max + 1 = 2^m W`).
//! Eq. 3.14 as printed carries an extra `W` in the fraction's denominator that eq. 3.15 does not;
//! eq. 3.15's form is Bianchi's transmission probability for large `W` and is the one used.
//! Because `1 - p - p (2p)^m = (1 - 2p) (1 + p sum_{k<m} (2p)^k)`, tau is evaluated as
//! `2 / (W (1 + p sum_{k<m} (2p)^k))`, which has no 0/0 at `P_f = 1/2`. `P_f` is the fixed point
//! of eq. 3.14-3.15, found by bisection (it is unique: the right side falls as `P_f` grows).
//! `T_cycle` is eq. 3.7's cycle, so failures scale both throughputs by eq. 3.12's factor.

use crate::{positive, probability, ModelError};
use serde::Serialize;

/// The largest MSDU 802.11 carries.
pub const MAX_MSDU: u32 = 2304;

/// The PHY whose timing the model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Standard {
    /// 802.11b DSSS/CCK with the long preamble: thesis 000, Table 3.2.
    #[serde(rename = "802.11b")]
    B,
    /// 802.11g ERP-OFDM without protection, short slots (IEEE 802.11-2007, clause 19).
    #[serde(rename = "802.11g")]
    G,
}

/// Timing and sizes of one PHY/MAC, as in thesis 000's Table 3.1.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Phy {
    pub standard: Standard,
    pub slot_s: f64,
    pub sifs_s: f64,
    pub difs_s: f64,
    pub cw_min: u32,
    pub cw_max: u32,
    /// T_p.
    pub preamble_s: f64,
    /// T_PHY.
    pub plcp_header_s: f64,
    /// L_MAC.
    pub mac_overhead_bytes: u32,
    /// L_ACK.
    pub ack_bytes: u32,
    /// tau.
    pub propagation_s: f64,
    /// Default R_DATA.
    pub rate_bps: f64,
}

impl Standard {
    /// The standard's parameters.
    pub fn phy(self) -> Phy {
        match self {
            Standard::B => Phy {
                standard: self,
                slot_s: 20e-6,
                sifs_s: 10e-6,
                difs_s: 50e-6,
                cw_min: 31,
                cw_max: 1023,
                preamble_s: 144e-6,
                plcp_header_s: 48e-6,
                mac_overhead_bytes: 34,
                ack_bytes: 14,
                propagation_s: 1e-6,
                rate_bps: 11e6,
            },
            Standard::G => Phy {
                standard: self,
                slot_s: 9e-6,
                sifs_s: 10e-6,
                difs_s: 28e-6,
                cw_min: 15,
                cw_max: 1023,
                preamble_s: 16e-6,
                plcp_header_s: 4e-6,
                mac_overhead_bytes: 34,
                ack_bytes: 14,
                propagation_s: 1e-6,
                rate_bps: 54e6,
            },
        }
    }

    /// The rate the MAC ACK is sent at when none is given. 802.11b: the data rate, the
    /// assumption behind the thesis's 6.1 Mbit/s. 802.11g: the highest mandatory OFDM rate
    /// (6, 12, 24 Mbit/s) not above the data rate (IEEE 802.11-2007, 9.6).
    pub fn default_ack_rate(self, rate_bps: f64) -> f64 {
        match self {
            Standard::B => rate_bps,
            Standard::G => [24e6, 12e6, 6e6]
                .into_iter()
                .find(|&r| r <= rate_bps)
                .unwrap_or(6e6),
        }
    }
}

/// Inputs of [`throughput`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Input {
    pub phy: Phy,
    /// L_DATA_TCP: the frame body (the IP packet) in bytes.
    pub payload_bytes: u32,
    /// R_DATA, bit/s.
    pub rate_bps: f64,
    /// R_ACK, bit/s.
    pub ack_rate_bps: f64,
    /// TCP/IP header bytes in each packet (L_DATA_TCP - L_DATA).
    pub tcp_ip_header_bytes: u32,
    /// Data segments per TCP ACK (2 with delayed ACKs).
    pub segments_per_ack: u32,
    /// Stations contending for the channel (n of eq. 3.14). 1 means no collisions.
    pub stations: u32,
    /// Packet error probability P_e.
    pub packet_error: f64,
}

impl Input {
    /// The thesis's case for `standard`: 1500-byte packets, 40 bytes of TCP/IP header, delayed
    /// ACKs, one sender, no packet errors.
    pub fn new(standard: Standard) -> Self {
        let phy = standard.phy();
        Input {
            phy,
            payload_bytes: 1500,
            rate_bps: phy.rate_bps,
            ack_rate_bps: standard.default_ack_rate(phy.rate_bps),
            tcp_ip_header_bytes: 40,
            segments_per_ack: 2,
            stations: 1,
            packet_error: 0.0,
        }
    }
}

/// The packet-failure model's figures (eq. 3.8-3.15).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Failure {
    pub stations: u32,
    /// W = CW_min + 1.
    pub window: u32,
    /// m: backoff stages.
    pub backoff_stages: u32,
    /// tau: probability a station transmits in a slot.
    pub transmit_probability: f64,
    /// P_c.
    pub collision_probability: f64,
    /// P_e.
    pub error_probability: f64,
    /// P_f.
    pub failure_probability: f64,
    /// 2 (1 - P_f) / (2 - P_f + P_e): successful share of cycles (eq. 3.12).
    pub success_factor: f64,
    /// Eq. 3.7 scaled by the success factor.
    pub mac_throughput_bps: f64,
    /// The TCP goodput scaled by the success factor.
    pub tcp_goodput_bps: f64,
}

/// Throughput and its terms, times in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Report {
    pub input: Input,
    /// L_DATA.
    pub data_bytes: u32,
    /// Eq. 3.1.
    pub mean_backoff_s: f64,
    /// Eq. 3.5.
    pub data_delay_s: f64,
    /// Eq. 3.6.
    pub ack_delay_s: f64,
    /// 2 tau.
    pub round_trip_propagation_s: f64,
    /// The denominator of eq. 3.7.
    pub cycle_s: f64,
    /// Eq. 3.7, bit/s.
    pub mac_throughput_bps: f64,
    /// The cycle of one TCP ACK (a bare TCP/IP header).
    pub tcp_ack_cycle_s: f64,
    /// TCP payload bit/s after TCP ACKs share the channel.
    pub tcp_goodput_bps: f64,
    pub failure: Failure,
}

/// Eq. 3.1: mean backoff.
pub fn mean_backoff(cw_min: u32, slot_s: f64) -> f64 {
    f64::from(cw_min) * slot_s / 2.0
}

/// Eq. 3.5/3.6: preamble, PLCP header and the MAC frame (`body` plus MAC overhead) at `rate`.
pub fn frame_delay(phy: &Phy, body_bytes: u32, rate_bps: f64) -> f64 {
    phy.preamble_s
        + phy.plcp_header_s
        + 8.0 * f64::from(phy.mac_overhead_bytes + body_bytes) / rate_bps
}

/// The denominator of eq. 3.7 for a frame body of `body_bytes`.
pub fn cycle(phy: &Phy, body_bytes: u32, rate_bps: f64, ack_rate_bps: f64) -> f64 {
    frame_delay(phy, body_bytes, rate_bps)
        + frame_delay(phy, phy.ack_bytes, ack_rate_bps)
        + 2.0 * phy.propagation_s
        + phy.difs_s
        + phy.sifs_s
        + mean_backoff(phy.cw_min, phy.slot_s)
}

/// Transmission probability per slot for failure probability `p` (eq. 3.15's fraction),
/// `2 / (W (1 + p sum_{k<m} (2p)^k))`.
pub fn transmit_probability(p: f64, window: u32, stages: u32) -> f64 {
    let mut sum = 0.0;
    let mut term = 1.0;
    for _ in 0..stages {
        sum += term;
        term *= 2.0 * p;
    }
    (2.0 / (f64::from(window.max(1)) * (1.0 + p * sum))).min(1.0)
}

/// Solves eq. 3.14-3.15 for `P_f`; returns `(P_f, P_c, tau)`.
pub fn failure_probability(stations: u32, window: u32, stages: u32, p_e: f64) -> (f64, f64, f64) {
    let others = i32::try_from(stations.saturating_sub(1)).unwrap_or(i32::MAX);
    let pc = |p: f64| 1.0 - (1.0 - transmit_probability(p, window, stages)).powi(others);
    let pf = |p: f64| 1.0 - (1.0 - pc(p)) * (1.0 - p_e);
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if pf(mid) > mid {
            lo = mid;
        } else {
            hi = mid;
        }
        if hi - lo < 1e-15 {
            break;
        }
    }
    let p = 0.5 * (lo + hi);
    (pf(p), pc(p), transmit_probability(p, window, stages))
}

/// Eq. 3.12's factor: the successful share of transmission cycles.
pub fn success_factor(p_f: f64, p_e: f64) -> f64 {
    2.0 * (1.0 - p_f) / (2.0 - p_f + p_e)
}

/// Evaluates the MAC, TCP and packet-failure models for `input`.
pub fn throughput(input: &Input) -> Result<Report, ModelError> {
    let phy = &input.phy;
    positive("rate", input.rate_bps)?;
    positive("ack rate", input.ack_rate_bps)?;
    probability("packet error rate", input.packet_error)?;
    if input.payload_bytes <= input.tcp_ip_header_bytes || input.payload_bytes > MAX_MSDU {
        return Err(ModelError::OutOfRange {
            name: "payload",
            value: f64::from(input.payload_bytes),
            allowed: "must exceed the TCP/IP header and be at most 2304 bytes (the 802.11 MSDU)",
        });
    }
    if input.segments_per_ack == 0 {
        return Err(ModelError::OutOfRange {
            name: "segments per ack",
            value: 0.0,
            allowed: "must be at least 1",
        });
    }
    if input.stations == 0 {
        return Err(ModelError::OutOfRange {
            name: "stations",
            value: 0.0,
            allowed: "must be at least 1",
        });
    }
    if phy.cw_max < phy.cw_min {
        return Err(ModelError::OutOfRange {
            name: "cw_max",
            value: f64::from(phy.cw_max),
            allowed: "must be at least cw_min",
        });
    }

    let data_bytes = input.payload_bytes - input.tcp_ip_header_bytes;
    let data_delay = frame_delay(phy, input.payload_bytes, input.rate_bps);
    let ack_delay = frame_delay(phy, phy.ack_bytes, input.ack_rate_bps);
    let cycle_s = cycle(phy, input.payload_bytes, input.rate_bps, input.ack_rate_bps);
    let bits = 8.0 * f64::from(data_bytes);
    let mac = bits / cycle_s;

    let k = f64::from(input.segments_per_ack);
    let ack_cycle = cycle(
        phy,
        input.tcp_ip_header_bytes,
        input.rate_bps,
        input.ack_rate_bps,
    );
    let tcp = k * bits / (k * cycle_s + ack_cycle);

    let window = phy.cw_min + 1;
    // CW_max + 1 = 2^m W.
    let stages = ((phy.cw_max + 1) / window).max(1).ilog2();
    let (p_f, p_c, tau) = failure_probability(input.stations, window, stages, input.packet_error);
    let factor = success_factor(p_f, input.packet_error);

    Ok(Report {
        input: *input,
        data_bytes,
        mean_backoff_s: mean_backoff(phy.cw_min, phy.slot_s),
        data_delay_s: data_delay,
        ack_delay_s: ack_delay,
        round_trip_propagation_s: 2.0 * phy.propagation_s,
        cycle_s,
        mac_throughput_bps: mac,
        tcp_ack_cycle_s: ack_cycle,
        tcp_goodput_bps: tcp,
        failure: Failure {
            stations: input.stations,
            window,
            backoff_stages: stages,
            transmit_probability: tau,
            collision_probability: p_c,
            error_probability: input.packet_error,
            failure_probability: p_f,
            success_factor: factor,
            mac_throughput_bps: mac * factor,
            tcp_goodput_bps: tcp * factor,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * b.abs()
    }

    #[test]
    fn thesis_80211b_by_hand() {
        let r = throughput(&Input::new(Standard::B)).unwrap();
        // Eq. 3.1: 31 x 20 us / 2 = 310 us.
        assert!(close(r.mean_backoff_s, 310e-6, 1e-12));
        // Eq. 3.5: 144 + 48 + 8 x 1534 / 11 = 192 + 1115.636 = 1307.636 us.
        assert!(close(r.data_delay_s, 1_307.636_36e-6, 1e-8));
        // Eq. 3.6: 192 + 8 x 48 / 11 = 226.909 us.
        assert!(close(r.ack_delay_s, 226.909_09e-6, 1e-8));
        // Cycle: 1307.636 + 226.909 + 2 + 50 + 10 + 310 = 1906.545 us.
        assert!(close(r.cycle_s, 1_906.545_45e-6, 1e-8));
        // Eq. 3.7: 8 x 1460 / 1906.545 us = 6.12626 Mbit/s (thesis: "approximately 6.1").
        assert!(close(r.mac_throughput_bps, 6.126_264e6, 1e-6));
        assert_eq!(r.data_bytes, 1460);
        // TCP ACK cycle: 192 + 8 x 74 / 11 + 226.909 + 372 = 844.727 us;
        // goodput 2 x 11680 / (2 x 1906.545 + 844.727) = 5.01523 Mbit/s.
        assert!(close(r.tcp_ack_cycle_s, 844.727_27e-6, 1e-8));
        assert!(close(r.tcp_goodput_bps, 5.015_23e6, 1e-5));
        // The acceptance ranges.
        assert!((6.0e6..=6.4e6).contains(&r.mac_throughput_bps));
        assert!((4.9e6..=5.2e6).contains(&r.tcp_goodput_bps));
        // One station, no errors: nothing fails.
        assert_eq!(r.failure.failure_probability, 0.0);
        assert_eq!(r.failure.success_factor, 1.0);
        assert_eq!(r.failure.backoff_stages, 5);
        assert_eq!(r.failure.window, 32);
    }

    #[test]
    fn slower_ack_rate() {
        // ACKs at 2 Mbit/s: 192 + 384/2 = 384 us; cycle 2063.636 us -> 5.6599 Mbit/s.
        let mut i = Input::new(Standard::B);
        i.ack_rate_bps = 2e6;
        let r = throughput(&i).unwrap();
        assert!(close(r.mac_throughput_bps, 11680.0 / 2_063.636_36e-6, 1e-8));
    }

    #[test]
    fn g_by_hand() {
        let i = Input::new(Standard::G);
        assert_eq!(i.ack_rate_bps, 24e6);
        let r = throughput(&i).unwrap();
        // 15 x 9 / 2 = 67.5; 20 + 12272/54 = 247.259; 20 + 384/24 = 36;
        // cycle 247.259 + 36 + 2 + 28 + 10 + 67.5 = 390.759 us -> 11680 / 390.759 = 29.8905 Mbit/s.
        assert!(close(r.cycle_s, 390.759_26e-6, 1e-8));
        assert!(close(r.mac_throughput_bps, 29.890_53e6, 1e-6));
        assert_eq!(r.failure.backoff_stages, 6);
        assert_eq!(Standard::G.default_ack_rate(9e6), 6e6);
        assert_eq!(Standard::G.default_ack_rate(18e6), 12e6);
    }

    #[test]
    fn errors_without_collisions() {
        // One sender: P_c = 0, P_f = P_e, and eq. 3.12's factor is 2(1-P_e)/2 = 1 - P_e.
        let mut i = Input::new(Standard::B);
        i.packet_error = 0.1;
        let r = throughput(&i).unwrap();
        assert_eq!(r.failure.collision_probability, 0.0);
        assert!(close(r.failure.failure_probability, 0.1, 1e-12));
        assert!(close(r.failure.success_factor, 0.9, 1e-12));
        assert!(close(
            r.failure.mac_throughput_bps,
            0.9 * r.mac_throughput_bps,
            1e-12
        ));
        // All packets lost: nothing gets through.
        i.packet_error = 1.0;
        let r = throughput(&i).unwrap();
        assert_eq!(r.failure.success_factor, 0.0);
    }

    #[test]
    fn two_stations_fixed_point() {
        // n = 2, P_e = 0: P_f = tau(P_f). Iterating p = 2 / (32 (1 + p (1 + 2p + 4p^2 + 8p^3
        // + 16p^4))) by hand from 0.0625: 0.058333, 0.058628, 0.058609, ... -> 0.05861.
        let (pf, pc, tau) = failure_probability(2, 32, 5, 0.0);
        assert!((pf - 0.05861).abs() < 1e-5, "{pf}");
        assert_eq!(pf, pc);
        assert!((tau - pf).abs() < 1e-12);
        // Eq. 3.12 with P_e = 0: 2 (1 - 0.05861) / (2 - 0.05861) = 0.96981.
        assert!((success_factor(pf, 0.0) - 0.96981).abs() < 1e-5);
    }

    #[test]
    fn more_stations_fail_more() {
        let mut last = 0.0;
        for n in [1, 2, 5, 10, 20, 50] {
            let (pf, _, _) = failure_probability(n, 32, 5, 0.0);
            assert!(pf >= last, "n {n}: {pf} < {last}");
            assert!((0.0..1.0).contains(&pf));
            last = pf;
        }
        // Errors and collisions combine: P_f = P_c + P_e - P_c P_e at the fixed point.
        let (pf, pc, _) = failure_probability(10, 32, 5, 0.1);
        assert!((pf - (pc + 0.1 - pc * 0.1)).abs() < 1e-12);
    }

    #[test]
    fn tau_has_no_singularity_at_one_half() {
        // (1 - 2p) / (1 - p - p (2p)^m) at p = 1/2 is 0/0 as printed; the factored form gives
        // 2 / (W (1 + 0.5 x m)) = 2 / (32 x 3.5) for m = 5.
        let t = transmit_probability(0.5, 32, 5);
        assert!((t - 2.0 / (32.0 * 3.5)).abs() < 1e-15);
        // And agrees with the printed form elsewhere: p = 0.2, m = 5, W = 32.
        let p: f64 = 0.2;
        let printed = 2.0 * (1.0 - 2.0 * p) / ((1.0 - p - p * (2.0 * p).powi(5)) * 32.0);
        assert!((transmit_probability(p, 32, 5) - printed).abs() < 1e-15);
    }

    #[test]
    fn rejects_bad_input() {
        let base = Input::new(Standard::B);
        let mut i = base;
        i.payload_bytes = 40;
        assert!(throughput(&i).is_err());
        i.payload_bytes = 2305;
        let e = throughput(&i).unwrap_err().to_string();
        assert!(e.contains("payload") && e.contains("2304"), "{e}");
        let mut i = base;
        i.rate_bps = 0.0;
        assert!(throughput(&i).is_err());
        let mut i = base;
        i.stations = 0;
        assert!(throughput(&i).is_err());
        let mut i = base;
        i.packet_error = 1.5;
        assert!(throughput(&i).is_err());
        let mut i = base;
        i.segments_per_ack = 0;
        assert!(throughput(&i).is_err());
    }
}
