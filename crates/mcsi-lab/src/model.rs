//! The models a figure or claim can be set beside, evaluated with `mcsi-model` (the same
//! functions as `mcsi model`) at a point's parameters. All return MB/s (10^6 bytes/s) of payload.

use crate::point::{Metric, ModelRef, Point};
use mcsi_model::{tcp, wlan};

/// The kinds of model known, with what each computes.
pub const KINDS: &[(&str, &str)] = &[
    ("wlan-goodput", "TCP goodput of a saturated 802.11 cell (thesis eq. 3.1-3.7; the point's profile and MTU as the packet size, delayed ACKs, the point's frame error rate)"),
    ("mathis", "Mathis et al.: MSS/RTT x sqrt(3/2)/sqrt(p) per connection (MSS = MTU - 52), times the connections, capped at the link rate"),
    ("padhye", "Padhye et al. with timeouts (RTO = 4 x RTT, one segment per ACK), per connection, times the connections, capped at the link rate"),
    ("link-rate", "the link's rate, as payload bytes"),
];

/// Checks that a model reference names a known kind.
pub fn check(m: &ModelRef) -> Result<(), String> {
    if KINDS.iter().any(|(k, _)| *k == m.kind) {
        Ok(())
    } else {
        let all: Vec<_> = KINDS.iter().map(|(k, _)| *k).collect();
        Err(format!(
            "unknown model '{}' (use {})",
            m.kind,
            all.join(", ")
        ))
    }
}

/// What the model says at point `p` in the unit of `metric`: MB/s, or for IOPS that divided by
/// the I/O size. For the model's connections or, when it names none, the point's.
pub fn value(m: &ModelRef, p: &Point, metric: Metric) -> Result<f64, String> {
    let mbs = mbs(m, p)?;
    match metric {
        Metric::BwMbs => Ok(mbs),
        Metric::Iops => {
            let kib = p.num("bs").ok_or("needs an I/O size")?;
            Ok(mbs * 1e6 / (kib * 1024.0))
        }
        other => Err(format!(
            "the {} model says nothing of {}",
            m.kind,
            other.column()
        )),
    }
}

fn mbs(m: &ModelRef, p: &Point) -> Result<f64, String> {
    let conns = m
        .connections
        .map_or_else(|| p.num("connections").unwrap_or(1.0), f64::from);
    let rate_mbs = p.num("rate").map(|mbit| mbit * 1e6 / 8.0 / 1e6);
    // IPv4 + TCP headers with timestamps.
    let mss = p.num("mtu").unwrap_or(1500.0) - 52.0;
    let rtt_s = || -> Result<f64, String> {
        let ms = p
            .num("rtt")
            .or_else(|| p.num("delay").map(|d| 2.0 * d))
            .ok_or("needs rtt or delay")?;
        if ms <= 0.0 {
            return Err("needs an RTT above 0".into());
        }
        Ok(ms / 1e3)
    };
    let loss = p.num("loss").unwrap_or(0.0) / 100.0;
    match m.kind.as_str() {
        "wlan-goodput" => {
            let std = match p.text("profile") {
                "802.11b" => wlan::Standard::B,
                "802.11g" => wlan::Standard::G,
                _ => return Err("needs an 802.11 profile".into()),
            };
            let mut input = wlan::Input::new(std);
            input.payload_bytes = p.num("mtu").unwrap_or(1500.0) as u32;
            input.packet_error = p.num("per").unwrap_or(0.0) / 100.0;
            let r = wlan::throughput(&input).map_err(|e| e.to_string())?;
            Ok(r.failure.tcp_goodput_bps / 8.0 / 1e6)
        }
        "mathis" | "padhye" => {
            // As `mcsi model tcp --mss M --rtt R --loss P --connections N --link-rate L`
            // computes it: RTO 4 x RTT, one segment per ACK.
            let input = tcp::Input {
                mss_bytes: mss,
                rtt_s: rtt_s()?,
                loss,
                rto_s: None,
                wmax_bytes: None,
                connections: conns as u32,
                link_rate_bps: rate_mbs.map(|r| r * 8e6),
                packets_per_ack: 1.0,
            };
            let r = tcp::throughput(&input).map_err(|e| e.to_string())?;
            let bps = if m.kind == "mathis" {
                r.aggregate_mathis_bps
            } else {
                r.aggregate_bps
            };
            Ok(bps / 8.0 / 1e6)
        }
        "link-rate" => rate_mbs.ok_or_else(|| "needs a rate".to_string()),
        other => Err(format!("unknown model '{other}'")),
    }
}
