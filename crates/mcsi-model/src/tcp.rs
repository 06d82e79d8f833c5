//! Steady-state throughput of a bulk TCP connection under random loss.
//!
//! - Mathis, Semke, Mahdavi, Ott (1997): `B = (MSS / RTT) x C / sqrt(p)` with `C = sqrt(3/2)`
//!   (periodic loss, one ACK per segment).
//! - Padhye, Firoiu, Towsley, Kurose (1998), the approximation that includes retransmission
//!   timeouts and the receiver window:
//!
//! ```text
//! B = min( Wmax / RTT,
//!          1 / (RTT sqrt(2 b p / 3) + T0 min(1, 3 sqrt(3 b p / 8)) p (1 + 32 p^2)) )  segments/s
//! ```
//!
//!   with `b` segments acknowledged per ACK and `T0` the retransmission timeout.
//!
//! N connections share one link: their sum is bounded by the link rate. The models describe
//! one connection each; they know nothing of how the connections interact below that bound.

use crate::{positive, probability, ModelError};
use serde::Serialize;

/// `C` of Mathis et al. for periodic loss and one ACK per segment.
pub const MATHIS_C: f64 = 1.224_744_871_391_589; // sqrt(3/2)

/// What bounds a throughput figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Limit {
    /// The loss term of the model.
    Loss,
    /// The maximum window: `Wmax / RTT`.
    Window,
    /// The link rate.
    Link,
}

/// Mathis et al.'s throughput in bit/s. Loss must be greater than 0 (0 is unbounded).
pub fn mathis_bps(mss_bytes: f64, rtt_s: f64, loss: f64) -> Result<f64, ModelError> {
    positive("mss", mss_bytes)?;
    positive("rtt", rtt_s)?;
    probability("loss", loss)?;
    if loss == 0.0 {
        return Err(ModelError::Unbounded);
    }
    Ok(8.0 * mss_bytes / rtt_s * MATHIS_C / loss.sqrt())
}

/// Padhye et al.'s throughput in bit/s. With loss 0 it is `Wmax / RTT`, or unbounded without
/// a `wmax_bytes`.
pub fn padhye_bps(
    mss_bytes: f64,
    rtt_s: f64,
    loss: f64,
    rto_s: f64,
    packets_per_ack: f64,
    wmax_bytes: Option<f64>,
) -> Result<f64, ModelError> {
    positive("mss", mss_bytes)?;
    positive("rtt", rtt_s)?;
    probability("loss", loss)?;
    positive("rto", rto_s)?;
    positive("packets per ack", packets_per_ack)?;
    let window = match wmax_bytes {
        Some(w) => Some(8.0 * positive("wmax", w)? / rtt_s),
        None => None,
    };
    if loss == 0.0 {
        return window.ok_or(ModelError::Unbounded);
    }
    let (p, b) = (loss, packets_per_ack);
    let denom = rtt_s * (2.0 * b * p / 3.0).sqrt()
        + rto_s * (3.0 * (3.0 * b * p / 8.0).sqrt()).min(1.0) * p * (1.0 + 32.0 * p * p);
    let loss_bound = 8.0 * mss_bytes / denom;
    Ok(window.map_or(loss_bound, |w| w.min(loss_bound)))
}

/// Inputs of [`throughput`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Input {
    /// Maximum segment size in bytes.
    pub mss_bytes: f64,
    /// Round-trip time in seconds.
    pub rtt_s: f64,
    /// Segment loss probability in [0, 1].
    pub loss: f64,
    /// Retransmission timeout; `None` uses RFC 5348's simplification `4 x RTT`.
    pub rto_s: Option<f64>,
    /// Maximum window (the receiver's) in bytes.
    pub wmax_bytes: Option<f64>,
    /// Number of parallel connections.
    pub connections: u32,
    /// Rate of the link the connections share, bit/s.
    pub link_rate_bps: Option<f64>,
    /// Segments acknowledged per ACK (`b`): 1, or 2 with delayed ACKs.
    pub packets_per_ack: f64,
}

/// Throughput figures of [`throughput`], bit/s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Report {
    pub mss_bytes: f64,
    pub rtt_s: f64,
    pub loss: f64,
    /// The retransmission timeout used.
    pub rto_s: f64,
    pub packets_per_ack: f64,
    pub connections: u32,
    pub wmax_bytes: Option<f64>,
    pub link_rate_bps: Option<f64>,
    /// One connection by Mathis et al., bounded by `Wmax/RTT` and the link when given.
    pub mathis_bps: f64,
    pub mathis_limit: Limit,
    /// One connection by Padhye et al., bounded by the link when given.
    pub padhye_bps: f64,
    pub padhye_limit: Limit,
    /// N connections by Padhye et al., bounded by the link rate.
    pub aggregate_bps: f64,
    pub aggregate_limit: Limit,
    /// N connections by Mathis et al., bounded by the link rate.
    pub aggregate_mathis_bps: f64,
}

/// Smallest of the candidate bounds that are present, with which one it was.
fn bound(candidates: &[(Option<f64>, Limit)]) -> Option<(f64, Limit)> {
    candidates
        .iter()
        .filter_map(|&(v, l)| v.map(|v| (v, l)))
        .fold(None, |best, (v, l)| match best {
            Some((b, _)) if b <= v => best,
            _ => Some((v, l)),
        })
}

/// Mathis and Padhye for one connection and N connections on a link. With loss 0 the figures
/// are `Wmax/RTT` or the link rate; without either that is [`ModelError::Unbounded`].
pub fn throughput(input: &Input) -> Result<Report, ModelError> {
    let mss = positive("mss", input.mss_bytes)?;
    let rtt = positive("rtt", input.rtt_s)?;
    let loss = probability("loss", input.loss)?;
    let rto = match input.rto_s {
        Some(r) => positive("rto", r)?,
        None => 4.0 * rtt,
    };
    let b = positive("packets per ack", input.packets_per_ack)?;
    if input.connections == 0 {
        return Err(ModelError::OutOfRange {
            name: "connections",
            value: 0.0,
            allowed: "must be at least 1",
        });
    }
    let link = match input.link_rate_bps {
        Some(l) => Some(positive("link rate", l)?),
        None => None,
    };
    let window = match input.wmax_bytes {
        Some(w) => Some(8.0 * positive("wmax", w)? / rtt),
        None => None,
    };

    let mathis = if loss > 0.0 {
        Some(mathis_bps(mss, rtt, loss)?)
    } else {
        None
    };
    let (mathis_bps, mathis_limit) = bound(&[
        (mathis, Limit::Loss),
        (window, Limit::Window),
        (link, Limit::Link),
    ])
    .ok_or(ModelError::Unbounded)?;

    // Padhye's own min() already holds the window; tell which term won.
    let padhye_loss = if loss > 0.0 {
        Some(padhye_bps(mss, rtt, loss, rto, b, None)?)
    } else {
        None
    };
    let (padhye_bps, padhye_limit) = bound(&[
        (padhye_loss, Limit::Loss),
        (window, Limit::Window),
        (link, Limit::Link),
    ])
    .ok_or(ModelError::Unbounded)?;

    let n = f64::from(input.connections);
    let (aggregate_bps, aggregate_limit) = match link {
        Some(l) if l < n * padhye_bps => (l, Limit::Link),
        _ => (n * padhye_bps, padhye_limit),
    };
    let aggregate_mathis_bps = link.map_or(n * mathis_bps, |l| l.min(n * mathis_bps));
    Ok(Report {
        mss_bytes: mss,
        rtt_s: rtt,
        loss,
        rto_s: rto,
        packets_per_ack: b,
        connections: input.connections,
        wmax_bytes: input.wmax_bytes,
        link_rate_bps: link,
        mathis_bps,
        mathis_limit,
        padhye_bps,
        padhye_limit,
        aggregate_bps,
        aggregate_limit,
        aggregate_mathis_bps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(loss: f64) -> Input {
        Input {
            mss_bytes: 1448.0,
            rtt_s: 0.1,
            loss,
            rto_s: None,
            wmax_bytes: None,
            connections: 1,
            link_rate_bps: None,
            packets_per_ack: 1.0,
        }
    }

    fn rel(a: f64, b: f64) -> f64 {
        (a - b).abs() / b
    }

    #[test]
    fn constant() {
        assert!((MATHIS_C * MATHIS_C - 1.5).abs() < 1e-15);
    }

    #[test]
    fn mathis_by_hand() {
        // 1448 B x 8 / 0.1 s = 115840 bit/s; x 1.2247449 / sqrt(0.01) = 1418744.5 bit/s.
        let b = mathis_bps(1448.0, 0.1, 0.01).unwrap();
        assert!(rel(b, 1_418_744.5) < 1e-7, "{b}");
        // Quadrupling the loss halves it.
        let b4 = mathis_bps(1448.0, 0.1, 0.04).unwrap();
        assert!(rel(b4, 1_418_744.5 / 2.0) < 1e-7);
    }

    #[test]
    fn padhye_by_hand() {
        // p 0.01, RTT 0.1, T0 0.4, b 1:
        //   0.1 sqrt(0.02/3) = 0.00816497; 3 sqrt(0.00375) = 0.18371;
        //   0.4 x 0.18371 x 0.01 x 1.0032 = 0.00073720; sum 0.00890216 -> 112.332 seg/s
        //   x 11584 bit = 1301257 bit/s.
        let b = padhye_bps(1448.0, 0.1, 0.01, 0.4, 1.0, None).unwrap();
        assert!(rel(b, 1_301_257.0) < 1e-5, "{b}");
        // p 0.1, RTT 0.05, T0 1, b 2, MSS 1000:
        //   0.05 sqrt(0.4/3) = 0.0182574; min(1, 3 sqrt(0.075)) = 0.821584;
        //   1 x 0.821584 x 0.1 x 1.32 = 0.1084491; sum 0.1267065 -> 7.89225 seg/s x 8000 bit.
        let b = padhye_bps(1000.0, 0.05, 0.1, 1.0, 2.0, None).unwrap();
        assert!(rel(b, 63_138.0) < 1e-4, "{b}");
        // Heavy loss: the min(1, ...) caps the timeout factor at 1.
        // p 0.5, RTT 0.1, T0 1, b 1: 0.1 sqrt(1/3) + 1 x 1 x 0.5 x 9 = 4.557735 -> 0.219407 seg/s.
        let b = padhye_bps(1000.0, 0.1, 0.5, 1.0, 1.0, None).unwrap();
        assert!(rel(b, 8000.0 * 0.219_407) < 1e-5, "{b}");
        // Window bound: 64 KiB / 0.1 s = 5242880 bit/s is below the loss bound at p = 1e-6.
        let b = padhye_bps(1448.0, 0.1, 1e-6, 0.4, 1.0, Some(65536.0)).unwrap();
        assert_eq!(b, 5_242_880.0);
    }

    #[test]
    fn acceptance_figure() {
        let r = throughput(&input(0.01)).unwrap();
        assert!(rel(r.mathis_bps, 1.42e6) < 0.005, "{}", r.mathis_bps);
        assert_eq!(r.mathis_limit, Limit::Loss);
        assert_eq!(r.rto_s, 0.4);
        assert!(rel(r.padhye_bps, 1_301_257.0) < 1e-5);
        assert_eq!(r.aggregate_bps, r.padhye_bps);
    }

    #[test]
    fn connections_share_the_link() {
        let mut i = input(0.01);
        i.connections = 4;
        i.link_rate_bps = Some(5e6);
        let r = throughput(&i).unwrap();
        // 4 x 1.301 Mbit/s = 5.205 > 5 Mbit/s: the link decides.
        assert_eq!(r.aggregate_bps, 5e6);
        assert_eq!(r.aggregate_limit, Limit::Link);
        assert_eq!(r.aggregate_mathis_bps, 5e6);
        i.connections = 3;
        let r = throughput(&i).unwrap();
        assert!(rel(r.aggregate_bps, 3.0 * 1_301_257.0) < 1e-5);
        assert_eq!(r.aggregate_limit, Limit::Loss);
        assert!(rel(r.aggregate_mathis_bps, 3.0 * 1_418_744.5) < 1e-7);
    }

    #[test]
    fn zero_loss() {
        // Unbounded without a window or a link.
        let e = throughput(&input(0.0)).unwrap_err();
        assert_eq!(e, ModelError::Unbounded);
        assert!(e.to_string().contains("wmax"));
        assert_eq!(mathis_bps(1448.0, 0.1, 0.0), Err(ModelError::Unbounded));
        assert_eq!(
            padhye_bps(1448.0, 0.1, 0.0, 0.4, 1.0, None),
            Err(ModelError::Unbounded)
        );
        // The window: 65536 B / 0.1 s = 5242880 bit/s.
        let mut i = input(0.0);
        i.wmax_bytes = Some(65536.0);
        let r = throughput(&i).unwrap();
        assert_eq!(r.mathis_bps, 5_242_880.0);
        assert_eq!(r.mathis_limit, Limit::Window);
        assert_eq!(r.padhye_bps, 5_242_880.0);
        assert_eq!(r.padhye_limit, Limit::Window);
        // The link, when it is lower.
        i.link_rate_bps = Some(1e6);
        let r = throughput(&i).unwrap();
        assert_eq!((r.mathis_bps, r.mathis_limit), (1e6, Limit::Link));
        assert_eq!((r.aggregate_bps, r.aggregate_limit), (1e6, Limit::Link));
    }

    #[test]
    fn rejects_bad_input() {
        let mut i = input(0.01);
        i.rtt_s = 0.0;
        assert!(matches!(
            throughput(&i),
            Err(ModelError::OutOfRange { name: "rtt", .. })
        ));
        let mut i = input(1.5);
        assert!(throughput(&i).is_err());
        i = input(0.01);
        i.connections = 0;
        assert!(throughput(&i).is_err());
        i = input(0.01);
        i.mss_bytes = -1.0;
        assert!(throughput(&i).is_err());
        i = input(0.01);
        i.rto_s = Some(0.0);
        assert!(throughput(&i).is_err());
        i = input(0.01);
        i.wmax_bytes = Some(0.0);
        assert!(throughput(&i).is_err());
        i = input(0.01);
        i.link_rate_bps = Some(f64::INFINITY);
        assert!(throughput(&i).is_err());
    }
}
