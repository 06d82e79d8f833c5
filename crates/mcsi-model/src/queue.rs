//! M/M/1 and M/M/m queues, as thesis 000 (section 4.3.4) uses them to compare one iSCSI
//! connection with several:
//!
//! ```text
//! (4.1) T_1 = 1 / (mu_1 - lambda)
//! (4.2) T_m = 1 / mu_m + P_Q / (m mu_m - lambda)
//! (4.3) P_Q = p_0 (m rho)^m / (m! (1 - rho)),   rho = lambda / (m mu_m)    (Erlang C)
//! (4.4) light load (rho << 1): P_Q ~ 0, T_m ~ 1 / mu_m
//! (4.5) heavy load (rho -> 1): P_Q ~ 1, T_m ~ 1 / (m mu_m - lambda)
//! ```
//!
//! `mu` is the service rate of one server (one connection's channel); rates are per second.

use crate::{positive, ModelError};
use serde::Serialize;

/// Largest number of servers accepted; the Erlang recursion is linear in it.
pub const MAX_SERVERS: u32 = 1_000_000;

/// Steady state of one queue.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Queue {
    /// m.
    pub servers: u32,
    /// lambda, arrivals per second.
    pub arrival_per_s: f64,
    /// mu, services per second of one server.
    pub service_per_s: f64,
    /// rho = lambda / (m mu).
    pub utilization: f64,
    /// P_Q: probability that an arrival has to wait (Erlang C; rho for M/M/1).
    pub queuing_probability: f64,
    /// Mean time waiting before service, P_Q / (m mu - lambda).
    pub mean_wait_s: f64,
    /// Mean time in the system, eq. 4.1 / 4.2.
    pub mean_delay_s: f64,
    /// Mean number in the system (Little's law, lambda T).
    pub mean_in_system: f64,
}

/// Erlang C: the probability that an arrival waits in M/M/m with offered load `a = lambda/mu`
/// (eq. 4.3). Computed through the Erlang B recursion `B_k = a B_{k-1} / (k + a B_{k-1})`,
/// `C = m B_m / (m - a (1 - B_m))`, which stays finite where `(m rho)^m / m!` would overflow.
/// Requires `a < m`.
pub fn erlang_c(a: f64, m: u32) -> f64 {
    let mut b = 1.0;
    for k in 1..=m {
        let k = f64::from(k);
        b = a * b / (k + a * b);
    }
    let m = f64::from(m);
    m * b / (m - a * (1.0 - b))
}

/// M/M/m with arrival rate `lambda` and per-server service rate `mu` (eq. 4.2-4.3).
pub fn mmm(lambda: f64, mu: f64, m: u32) -> Result<Queue, ModelError> {
    positive("arrival rate", lambda)?;
    positive("service rate", mu)?;
    if m == 0 || m > MAX_SERVERS {
        return Err(ModelError::OutOfRange {
            name: "servers",
            value: f64::from(m),
            allowed: "must be between 1 and 1000000",
        });
    }
    let capacity = f64::from(m) * mu;
    let rho = lambda / capacity;
    if rho >= 1.0 {
        return Err(ModelError::Unstable {
            model: if m == 1 { "M/M/1" } else { "M/M/m" },
            utilization: rho,
            arrival: lambda,
            capacity,
        });
    }
    let pq = erlang_c(lambda / mu, m);
    let wait = pq / (capacity - lambda);
    let delay = 1.0 / mu + wait;
    Ok(Queue {
        servers: m,
        arrival_per_s: lambda,
        service_per_s: mu,
        utilization: rho,
        queuing_probability: pq,
        mean_wait_s: wait,
        mean_delay_s: delay,
        mean_in_system: lambda * delay,
    })
}

/// M/M/1 (eq. 4.1): `T = 1 / (mu - lambda)`.
pub fn mm1(lambda: f64, mu: f64) -> Result<Queue, ModelError> {
    mmm(lambda, mu, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn mm1_by_hand() {
        // lambda 80/s, mu 100/s: rho 0.8, T = 1/20 s, W = 0.8/20 = 0.04 s, L = 4.
        let q = mm1(80.0, 100.0).unwrap();
        assert!(close(q.utilization, 0.8));
        assert!(close(q.queuing_probability, 0.8));
        assert!(close(q.mean_delay_s, 0.05));
        assert!(close(q.mean_wait_s, 0.04));
        assert!(close(q.mean_in_system, 4.0));
    }

    #[test]
    fn mm2_by_hand() {
        // lambda 1, mu 1, m 2: rho 1/2, p0 = 1/(1 + 1 + 1/(2 x 1/2)) = 1/3,
        // P_Q = p0 x 1^2 / (2! x 1/2) = 1/3, T = 1 + (1/3)/(2 - 1) = 4/3.
        let q = mmm(1.0, 1.0, 2).unwrap();
        assert!(close(q.queuing_probability, 1.0 / 3.0));
        assert!(close(q.mean_delay_s, 4.0 / 3.0));
        // lambda 3, mu 2, m 3: a = 1.5, rho = 0.5. Sum_{k<3} a^k/k! = 1 + 1.5 + 1.125 = 3.625,
        // a^3/(3! (1 - 0.5)) = 3.375/3 = 1.125, P_Q = 1.125 / 4.75 = 0.236842...
        // T = 1/2 + P_Q/(6 - 3).
        let q = mmm(3.0, 2.0, 3).unwrap();
        assert!(close(q.queuing_probability, 1.125 / 4.75));
        assert!(close(q.mean_delay_s, 0.5 + (1.125 / 4.75) / 3.0));
    }

    #[test]
    fn light_and_heavy_load_limits() {
        // Eq. 4.4: rho << 1 gives T_2 ~ 1/mu.
        let q = mmm(0.001, 1.0, 2).unwrap();
        assert!(q.queuing_probability < 1e-6);
        assert!((q.mean_delay_s - 1.0).abs() < 1e-6);
        // Eq. 4.5: rho -> 1 gives P_Q -> 1 and T ~ 1/(m mu - lambda).
        let q = mmm(1.999, 1.0, 2).unwrap();
        assert!(q.queuing_probability > 0.99);
        assert!((q.mean_delay_s * (2.0 - 1.999) - 1.0).abs() < 0.01);
        // The thesis's comparison: at light load two channels of the same speed keep the
        // service time but remove most of M/M/1's waiting.
        let one = mm1(0.5, 1.0).unwrap();
        let two = mmm(0.5, 1.0, 2).unwrap();
        assert!(two.mean_delay_s < one.mean_delay_s);
    }

    #[test]
    fn many_servers_stay_finite() {
        // (m rho)^m / m! overflows f64 here; the recursion does not.
        let q = mmm(900.0, 1.0, 1000).unwrap();
        assert!(q.queuing_probability.is_finite());
        // Against the textbook formula evaluated in log space, a different computation:
        // P_Q = [a^m/m! / (1 - rho)] / [sum_{k<m} a^k/k! + a^m/m! / (1 - rho)].
        let direct = |a: f64, m: u32| {
            let rho = a / f64::from(m);
            let mut ln_fact = 0.0;
            let mut terms = Vec::new();
            for k in 0..m {
                if k > 0 {
                    ln_fact += f64::from(k).ln();
                }
                terms.push(f64::from(k) * a.ln() - ln_fact);
            }
            ln_fact += f64::from(m).ln();
            let last = f64::from(m) * a.ln() - ln_fact - (1.0 - rho).ln();
            let top = terms.iter().copied().fold(last, f64::max);
            let sum: f64 = terms.iter().map(|t| (t - top).exp()).sum::<f64>() + (last - top).exp();
            (last - top).exp() / sum
        };
        for (a, m) in [(900.0, 1000), (1.5, 3), (7.2, 8), (95.0, 100), (0.3, 1)] {
            let want = direct(a, m);
            let got = erlang_c(a, m);
            assert!(
                (got - want).abs() <= 1e-9 * want.max(1e-300),
                "Erlang C({a}, {m}): {got} against {want}"
            );
        }
        let want = direct(900.0, 1000);
        assert!((q.queuing_probability - want).abs() <= 1e-9 * want);
    }

    #[test]
    fn rejects_saturation_and_bad_input() {
        let e = mm1(100.0, 100.0).unwrap_err();
        assert!(matches!(e, ModelError::Unstable { .. }));
        let msg = e.to_string();
        assert!(msg.contains("utilization 1.000 >= 1"), "{msg}");
        assert!(msg.contains("M/M/1"), "{msg}");
        assert!(mmm(250.0, 100.0, 2).is_err());
        assert!(mmm(1.0, 1.0, 0).is_err());
        assert!(mmm(0.0, 1.0, 1).is_err());
        assert!(mmm(1.0, -1.0, 1).is_err());
        assert!(mmm(f64::NAN, 1.0, 1).is_err());
    }
}
