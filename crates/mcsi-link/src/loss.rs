//! Random loss: Bernoulli and the Gilbert-Elliott model of netem's `loss gemodel`.

use crate::config::{invalid, ConfigError};
use mcsi_units::parse_fraction;
use rand::Rng;

/// Which packets a direction loses.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub enum LossModel {
    None,
    /// Each packet is lost with probability p, independently.
    Bernoulli(f64),
    /// Two states. `p`: good -> bad, `r`: bad -> good, `bad_loss` (netem's 1-h): loss
    /// probability in the bad state, `good_loss` (netem's 1-k): in the good state.
    GilbertElliott {
        p: f64,
        r: f64,
        bad_loss: f64,
        good_loss: f64,
    },
}

impl LossModel {
    /// `p[,r[,1-h[,1-k]]]` in percent (a `%` sign is optional), with netem's defaults:
    /// r = 100% - p, 1-h = 100%, 1-k = 0%.
    pub fn parse_ge(s: &str) -> Result<Self, ConfigError> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        if parts.is_empty() || parts.len() > 4 || parts.iter().any(|x| x.is_empty()) {
            return Err(invalid(
                "loss-ge",
                s,
                "expected p[,r[,1-h[,1-k]]] in percent, e.g. 1%,10%,100%,0%",
            ));
        }
        let v = parts
            .iter()
            .map(|x| parse_fraction(x, true))
            .collect::<Result<Vec<f64>, _>>()?;
        let p = v[0];
        let m = LossModel::GilbertElliott {
            p,
            r: v.get(1).copied().unwrap_or(1.0 - p),
            bad_loss: v.get(2).copied().unwrap_or(1.0),
            good_loss: v.get(3).copied().unwrap_or(0.0),
        };
        m.validate()?;
        Ok(m)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let ok = |x: f64| (0.0..=1.0).contains(&x);
        match *self {
            LossModel::None => Ok(()),
            LossModel::Bernoulli(p) if ok(p) => Ok(()),
            LossModel::Bernoulli(p) => Err(invalid("loss", &p.to_string(), "must be 0..100%")),
            LossModel::GilbertElliott {
                p,
                r,
                bad_loss,
                good_loss,
            } => {
                if ![p, r, bad_loss, good_loss].into_iter().all(ok) {
                    return Err(invalid(
                        "loss-ge",
                        &format!("{p},{r},{bad_loss},{good_loss}"),
                        "each value must be 0..100%",
                    ));
                }
                if p > 0.0 && r == 0.0 {
                    return Err(invalid(
                        "loss-ge",
                        &format!("{p},{r}"),
                        "r = 0 would leave the bad state never again",
                    ));
                }
                Ok(())
            }
        }
    }

    /// Long-run fraction of packets lost.
    pub fn mean_loss(&self) -> f64 {
        match *self {
            LossModel::None => 0.0,
            LossModel::Bernoulli(p) => p,
            LossModel::GilbertElliott {
                p,
                r,
                bad_loss,
                good_loss,
            } => {
                if p + r == 0.0 {
                    good_loss
                } else {
                    let pi_bad = p / (p + r);
                    pi_bad * bad_loss + (1.0 - pi_bad) * good_loss
                }
            }
        }
    }
}

/// The running state of a loss model.
#[derive(Debug, Clone)]
pub struct Loss {
    model: LossModel,
    bad: bool,
}

impl Loss {
    pub fn new(model: LossModel) -> Self {
        Loss { model, bad: false }
    }

    /// Decides the fate of one packet. For Gilbert-Elliott, as netem's `loss_gilb_ell`: the
    /// state moves first, and the loss is drawn with the probability of the state the packet
    /// found when it arrived.
    pub fn lose<R: Rng>(&mut self, rng: &mut R) -> bool {
        match self.model {
            LossModel::None => false,
            LossModel::Bernoulli(p) => p > 0.0 && rng.gen::<f64>() < p,
            LossModel::GilbertElliott {
                p,
                r,
                bad_loss,
                good_loss,
            } => {
                let was_bad = self.bad;
                if was_bad {
                    if rng.gen::<f64>() < r {
                        self.bad = false;
                    }
                } else if rng.gen::<f64>() < p {
                    self.bad = true;
                }
                let q = if was_bad { bad_loss } else { good_loss };
                q > 0.0 && rng.gen::<f64>() < q
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn parse_ge_defaults_follow_netem() {
        let m = LossModel::parse_ge("1%").unwrap();
        assert_eq!(
            m,
            LossModel::GilbertElliott {
                p: 0.01,
                r: 0.99,
                bad_loss: 1.0,
                good_loss: 0.0
            }
        );
        assert!(LossModel::parse_ge("1%,0%").is_err());
        assert!(LossModel::parse_ge("1,2,3,4,5").is_err());
        assert!(LossModel::parse_ge("x").is_err());
        assert!(LossModel::parse_ge("120").is_err());
    }

    #[test]
    fn bernoulli_rate() {
        // 200k draws at p = 5%: sd of the mean is 0.049%; the bound is > 6 sd.
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut l = Loss::new(LossModel::Bernoulli(0.05));
        let n = 200_000;
        let draws: Vec<bool> = (0..n).map(|_| l.lose(&mut rng)).collect();
        let lost = draws.iter().filter(|&&x| x).count();
        let f = lost as f64 / n as f64;
        assert!((f - 0.05).abs() < 0.003, "{f}");
        // Bernoulli losses do not cluster: P(lost | previous lost) is also p. About 10k losses
        // follow a loss here: sd of the conditional rate 0.22%, the bound is > 4.5 sd, while a
        // Gilbert-Elliott model of the same mean (bursts of 10) gives 90%.
        let after_loss: Vec<bool> = draws.windows(2).filter(|w| w[0]).map(|w| w[1]).collect();
        let c = after_loss.iter().filter(|&&x| x).count() as f64 / after_loss.len() as f64;
        assert!((c - 0.05).abs() < 0.01, "P(lost | previous lost) = {c}");
    }

    #[test]
    fn gilbert_elliott_mean_and_bursts() {
        // p = 1%, r = 10%, 1-h = 100%, 1-k = 0: stationary P(bad) = 0.01 / 0.11 = 9.09%,
        // every packet in the bad state is lost, bursts are geometric with mean 1/r = 10.
        let m = LossModel::parse_ge("1,10,100,0").unwrap();
        assert!((m.mean_loss() - 0.0909).abs() < 1e-3);
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut l = Loss::new(m);
        let n = 2_000_000;
        let mut lost = 0usize;
        let mut bursts = 0usize;
        let mut prev = false;
        for _ in 0..n {
            let x = l.lose(&mut rng);
            if x {
                lost += 1;
                if !prev {
                    bursts += 1;
                }
            }
            prev = x;
        }
        let f = lost as f64 / n as f64;
        // ~1800 bursts of mean 10 (sd 9.5): sd of the loss fraction ~0.2% absolute.
        assert!((f - 0.0909).abs() < 0.012, "loss {f}");
        let mean_burst = lost as f64 / bursts as f64;
        assert!((mean_burst - 10.0).abs() < 1.0, "burst {mean_burst}");
    }

    #[test]
    fn gilbert_elliott_partial_losses() {
        // 1-h = 50%, 1-k = 2%, p = 5%, r = 20%: P(bad) = 0.2, loss = 0.2*0.5 + 0.8*0.02 = 11.6%.
        let m = LossModel::parse_ge("5%,20%,50%,2%").unwrap();
        assert!((m.mean_loss() - 0.116).abs() < 1e-9);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut l = Loss::new(m);
        let n = 1_000_000;
        let lost = (0..n).filter(|_| l.lose(&mut rng)).count();
        let f = lost as f64 / n as f64;
        assert!((f - 0.116).abs() < 0.004, "{f}");
    }
}
