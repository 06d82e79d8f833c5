//! I/O sized to the window (`--bs auto`): the size of the next sequential read, from the TCP
//! state the target reports for its sending side (`X-org.mcsi.TcpReport`). Pure: the caller
//! feeds samples and reads the size.
//!
//! Two rules:
//! - [`Rule::Cwnd`], seed 002's: the block is the target's congestion window in bytes
//!   (cwnd x MSS, averaged over the session's connections); it is lowered at once when a
//!   window shrinks and otherwise held at the largest window seen.
//! - [`Rule::Bdp`], mcsi's: enough bytes outstanding to fill the path. The session's measured
//!   bandwidth-delay product (the connections' delivery rates added up, times the lowest
//!   minimum RTT) is spread over the commands kept outstanding. Since that product is only as
//!   large as what the reads asked for, the size doubles while the target reports that it ran
//!   out of data to send (its delivery rate was application-limited) or while its window holds
//!   more than the reads ask for. Unlike the cwnd rule, a loss does not shrink the size with
//!   the window: the delivery rate and the minimum RTT barely move.

use mcsi_tcp::TcpState;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    Cwnd,
    Bdp,
}

impl Rule {
    pub fn parse(s: &str) -> Option<Rule> {
        match s {
            "cwnd" => Some(Rule::Cwnd),
            "bdp" => Some(Rule::Bdp),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Cwnd => "cwnd",
            Rule::Bdp => "bdp",
        }
    }
}

/// Chooses the size of the next read.
#[derive(Debug, Clone)]
pub struct Sizer {
    rule: Rule,
    min: u64,
    max: u64,
    /// Sizes are whole multiples of this (the LUN's block size).
    unit: u64,
    /// Commands kept outstanding.
    depth: u64,
    ceiling: u64,
    prev_cwnd: Vec<u32>,
    current: u64,
}

impl Sizer {
    /// `min` and `max` bound the size; both are rounded to `unit`. The size starts at `min`.
    pub fn new(rule: Rule, min: u64, max: u64, unit: u64, depth: u64) -> Sizer {
        let unit = unit.max(1);
        let min = min.max(unit).div_ceil(unit) * unit;
        let max = (max.max(min) / unit) * unit;
        Sizer {
            rule,
            min,
            max: max.max(min),
            unit,
            depth: depth.max(1),
            ceiling: 0,
            prev_cwnd: Vec::new(),
            current: min,
        }
    }

    pub fn rule(&self) -> Rule {
        self.rule
    }

    /// The size to use now.
    pub fn size(&self) -> u64 {
        self.current
    }

    /// A new sample of the target's reports, one entry per connection (None: nothing reported
    /// yet). Returns the size to use from now on.
    pub fn update(&mut self, conns: &[Option<TcpState>]) -> u64 {
        self.prev_cwnd.resize(conns.len(), 0);
        let reps: Vec<(usize, &TcpState)> = conns
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.as_ref().map(|t| (i, t)))
            .filter(|(_, t)| t.cwnd > 0 && t.snd_mss > 0)
            .collect();
        if reps.is_empty() {
            return self.current;
        }
        let target = match self.rule {
            Rule::Cwnd => {
                let window =
                    reps.iter().map(|(_, t)| t.cwnd_bytes()).sum::<u64>() / reps.len() as u64;
                let shrank = reps.iter().any(|(i, t)| {
                    let prev = self.prev_cwnd[*i];
                    prev > 0 && t.cwnd < prev
                });
                self.ceiling = if shrank {
                    window
                } else {
                    self.ceiling.max(window)
                };
                self.ceiling
            }
            Rule::Bdp => {
                let rate: u64 = reps.iter().filter_map(|(_, t)| t.delivery_rate).sum();
                let rtt = reps
                    .iter()
                    .filter_map(|(_, t)| t.min_rtt_us)
                    .min()
                    .unwrap_or(0);
                let bdp = rate.saturating_mul(u64::from(rtt)) / 1_000_000;
                let spread = bdp / self.depth;
                // The measured product is only as large as what was asked for: with few reads
                // outstanding, a read smaller than the path's product is what limits the rate.
                // So grow while the target says it ran out of data to send, or while its
                // window already holds more than the reads ask for.
                let window = reps.iter().map(|(_, t)| t.cwnd_bytes()).sum::<u64>() / self.depth;
                let starved = reps.iter().any(|(_, t)| t.delivery_rate_app_limited);
                if starved || window > self.current {
                    spread.max(self.current.saturating_mul(2))
                } else {
                    spread
                }
            }
        };
        for (i, t) in &reps {
            self.prev_cwnd[*i] = t.cwnd;
        }
        let clamped = target.clamp(self.min, self.max);
        self.current = (clamped.div_ceil(self.unit) * self.unit).min(self.max);
        self.current
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(cwnd: u32, rate: u64, min_rtt_us: u32, app_limited: bool) -> Option<TcpState> {
        Some(TcpState {
            cwnd,
            snd_mss: 1000,
            delivery_rate: Some(rate),
            min_rtt_us: Some(min_rtt_us),
            delivery_rate_app_limited: app_limited,
            ..TcpState::default()
        })
    }

    #[test]
    fn cwnd_rule_holds_the_ceiling_and_drops_on_a_reduction() {
        let mut s = Sizer::new(Rule::Cwnd, 4096, 1 << 20, 512, 8);
        assert_eq!(s.size(), 4096);
        assert_eq!(s.update(&[None]), 4096, "no report yet");
        assert_eq!(s.update(&[st(100, 0, 0, false)]), 100_352); // 100 000 rounded up to 512
        assert_eq!(s.update(&[st(200, 0, 0, false)]), 200_192);
        // Growing again after a plateau: the ceiling holds while nothing shrinks.
        assert_eq!(s.update(&[st(200, 0, 0, false)]), 200_192);
        // A reduction lowers it at once.
        assert_eq!(s.update(&[st(140, 0, 0, false)]), 140_288);
        // Bounds.
        assert_eq!(s.update(&[st(5000, 0, 0, false)]), 1 << 20);
        assert_eq!(s.update(&[st(1, 0, 0, false)]), 4096);
    }

    #[test]
    fn bdp_rule_spreads_the_product_over_the_depth_and_probes_when_app_limited() {
        // 10 MB/s x 40 ms = 400 000 bytes over 4 commands: 100 000 each.
        let mut s = Sizer::new(Rule::Bdp, 4096, 1 << 20, 4096, 4);
        assert_eq!(s.update(&[st(10, 10_000_000, 40_000, false)]), 102_400);
        // Two connections: rates add up, the lower minimum RTT counts.
        let r = s.update(&[
            st(10, 5_000_000, 40_000, false),
            st(10, 5_000_000, 50_000, false),
        ]);
        assert_eq!(r, 102_400);
        // The target ran out of data to send: the estimate is low, so double.
        assert_eq!(s.update(&[st(10, 1_000_000, 40_000, true)]), 204_800);
        assert_eq!(s.update(&[st(10, 1_000_000, 40_000, true)]), 409_600);
        // The window holds more than the reads ask for: grow.
        let mut s = Sizer::new(Rule::Bdp, 65536, 8 << 20, 4096, 1);
        assert_eq!(s.update(&[st(1000, 1_000_000, 40_000, false)]), 131_072);
        assert_eq!(s.update(&[st(1000, 1_000_000, 40_000, false)]), 262_144);
        // A loss halves the window below the read size: hold at the measured product.
        assert_eq!(s.update(&[st(100, 10_000_000, 40_000, false)]), 401_408);
        assert_eq!(s.rule().as_str(), "bdp");
        assert_eq!(Rule::parse("cwnd"), Some(Rule::Cwnd));
        assert_eq!(Rule::parse("x"), None);
    }
}
