//! Closed-form models from mcsi's research seeds, as pure functions:
//!
//! - [`wlan`]: 802.11 MAC throughput (thesis 000, eq. 3.1-3.7), TCP goodput on top of it, and the
//!   packet-failure model for N stations (eq. 3.8-3.15).
//! - [`tcp`]: steady-state TCP throughput of Mathis et al. (1997) and Padhye et al. (1998), and
//!   N parallel connections bounded by a link rate.
//! - [`queue`]: M/M/1 and M/M/m mean delay and queuing probability (thesis 000, eq. 4.1-4.5).
//! - [`qos`]: network bandwidth for an IP-storage QoS requirement (seed 004, eq. 1-10).
//!
//! Times are seconds, sizes bytes, rates per second (bits for link rates, bytes for storage
//! bandwidth), all as `f64` so the formulas read like the papers. Inputs are checked and bad
//! ones come back as [`ModelError`]; nothing here panics on user input.

pub mod qos;
pub mod queue;
pub mod tcp;
pub mod wlan;

/// Why a model could not be evaluated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// A parameter is outside the range the model is defined for.
    #[error("{name} = {value} is out of range: {allowed}")]
    OutOfRange {
        name: &'static str,
        value: f64,
        allowed: &'static str,
    },
    /// Loss 0 in the Mathis/Padhye models means unbounded throughput and nothing bounds it.
    #[error(
        "with loss 0 the Mathis and Padhye models give unbounded throughput; \
         give a maximum window (wmax) or a link rate to bound it"
    )]
    Unbounded,
    /// A queue whose arrival rate reaches its capacity has no steady state.
    #[error(
        "{model} has no steady state: utilization {utilization:.3} >= 1 \
         (arrival {arrival} per s, capacity {capacity} per s); \
         the arrival rate must stay below servers x service rate"
    )]
    Unstable {
        model: &'static str,
        utilization: f64,
        arrival: f64,
        capacity: f64,
    },
}

/// Checks `value` is finite and `> 0`.
pub(crate) fn positive(name: &'static str, value: f64) -> Result<f64, ModelError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(ModelError::OutOfRange {
            name,
            value,
            allowed: "must be a finite number greater than 0",
        })
    }
}

/// Checks `value` is finite and `>= 0`.
pub(crate) fn non_negative(name: &'static str, value: f64) -> Result<f64, ModelError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(ModelError::OutOfRange {
            name,
            value,
            allowed: "must be a finite number of at least 0",
        })
    }
}

/// Checks `value` lies in [0, 1].
pub(crate) fn probability(name: &'static str, value: f64) -> Result<f64, ModelError> {
    if (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(ModelError::OutOfRange {
            name,
            value,
            allowed: "must lie between 0 and 1",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks() {
        assert_eq!(positive("x", 1.5), Ok(1.5));
        assert!(positive("x", 0.0).is_err());
        assert!(positive("x", f64::NAN).is_err());
        assert!(positive("x", f64::INFINITY).is_err());
        assert_eq!(non_negative("x", 0.0), Ok(0.0));
        assert!(non_negative("x", -1.0).is_err());
        assert_eq!(probability("p", 1.0), Ok(1.0));
        assert!(probability("p", 1.01).is_err());
        assert!(probability("p", f64::NAN).is_err());
        let e = positive("rtt", 0.0).unwrap_err().to_string();
        assert!(e.contains("rtt") && e.contains("greater than 0"), "{e}");
    }
}
