//! What a link does to packets: per-direction settings, 802.11 profiles and several paths.
//! Parsing of the `--path` specification lives here too, so that the command line and the
//! tests share one definition.

use crate::loss::LossModel;
use crate::wifi::WifiParams;
use mcsi_units::{parse_duration, parse_fraction, parse_rate, parse_size, BareUnit};
use std::time::Duration;

/// A configuration value that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Unit(#[from] mcsi_units::UnitError),
    #[error("invalid {what} '{input}': {why}")]
    Invalid {
        what: &'static str,
        input: String,
        why: String,
    },
}

pub(crate) fn invalid(what: &'static str, input: &str, why: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        what,
        input: input.to_string(),
        why: why.into(),
    }
}

/// Longest delay or jitter accepted: an hour keeps every clock sum far from overflow.
pub const MAX_DELAY: Duration = Duration::from_secs(3600);

fn bounded_duration(what: &'static str, value: &str) -> Result<Duration, ConfigError> {
    let d = parse_duration(value, BareUnit::Millis)?;
    if d > MAX_DELAY {
        return Err(invalid(what, value, "must be at most 1h"));
    }
    Ok(d)
}

/// Drop-tail limit of a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum QueueLimit {
    Packets(usize),
    Bytes(u64),
}

impl Default for QueueLimit {
    /// netem's default limit: 1000 packets.
    fn default() -> Self {
        QueueLimit::Packets(1000)
    }
}

impl QueueLimit {
    /// `100p`, `100pkt`, `100packets` are packets; anything else is a size in bytes (`64KiB`).
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        let t = s.trim();
        let lower = t.to_ascii_lowercase();
        for suffix in ["packets", "pkts", "pkt", "p"] {
            if let Some(n) = lower.strip_suffix(suffix) {
                let n: usize = n.trim().parse().map_err(|_| {
                    invalid("queue", s, "expected a whole number of packets, e.g. 100p")
                })?;
                if n == 0 {
                    return Err(invalid("queue", s, "must hold at least one packet"));
                }
                return Ok(QueueLimit::Packets(n));
            }
        }
        let b = parse_size(t)?;
        if b == 0 {
            return Err(invalid("queue", s, "must hold at least one byte"));
        }
        Ok(QueueLimit::Bytes(b))
    }
}

/// Distribution of the jitter around the mean delay (netem's `distribution`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum JitterDist {
    /// Uniform on [delay - jitter, delay + jitter] (netem's default without a table).
    #[default]
    Uniform,
    /// Normal with standard deviation `jitter`.
    Normal,
    /// Pareto (shape 3), shifted and scaled to mean `delay` and standard deviation `jitter`.
    Pareto,
    /// netem's paretonormal: 1/4 normal plus 3/4 Pareto, standard deviation `jitter`.
    ParetoNormal,
}

impl JitterDist {
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "uniform" => Ok(JitterDist::Uniform),
            "normal" => Ok(JitterDist::Normal),
            "pareto" => Ok(JitterDist::Pareto),
            "paretonormal" => Ok(JitterDist::ParetoNormal),
            _ => Err(invalid(
                "jitter distribution",
                s,
                "use uniform, normal, pareto or paretonormal",
            )),
        }
    }
}

/// One direction of one path: queue -> loss -> serializer at `rate` -> delay line.
#[derive(Debug, Clone, PartialEq)]
pub struct DirConfig {
    /// Bits per second; `None` is unlimited (no serialization delay).
    pub rate: Option<f64>,
    /// Bytes added to each packet's length for the serialization time (link framing).
    pub overhead: u32,
    pub delay: Duration,
    pub jitter: Duration,
    pub dist: JitterDist,
    /// Let jitter reorder packets (each keeps its own delay); off: a packet never leaves
    /// before the one ahead of it.
    pub reorder: bool,
    pub loss: LossModel,
    pub queue: QueueLimit,
    /// A share of the bottleneck reserved for one TCP port's packets (a storage session's).
    pub reserve: Option<Reserve>,
}

/// A reserved class at the bottleneck, as a token bucket per class with priority: TCP packets
/// from or to `port` wait in a queue of their own and go before all other packets while the
/// class's bucket holds their length; beyond `rate` they wait for tokens, so the class gets
/// at most `rate` and, whatever the other traffic does, at least `rate` (when the direction
/// is faster). The other packets use what is left. This is the reservation of seed 004's
/// testbed (Linux TBF at the storage session's allocation) with the rest of the link shared.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Reserve {
    pub port: u16,
    /// Bits per second.
    pub rate: f64,
    /// Bucket depth in bytes: a packet longer than it goes once the bucket is full.
    pub burst: u64,
}

impl Reserve {
    /// Default bucket depth: two full Ethernet frames, the smallest a TBF at this rate
    /// passes full-sized packets with.
    pub const DEFAULT_BURST: u64 = 3028;

    /// `PORT:RATE[:BURST]`, e.g. `3260:1.84mbit` or `3260:15mbit:16KiB`.
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        let mut it = s.split(':');
        let port = it
            .next()
            .and_then(|p| p.trim().parse::<u16>().ok())
            .filter(|p| *p != 0)
            .ok_or_else(|| {
                invalid(
                    "reserve",
                    s,
                    "expected PORT:RATE[:BURST], a TCP port 1..=65535 first (e.g. 3260:2mbit)",
                )
            })?;
        let rate = match it.next() {
            Some(r) => parse_rate(r.trim())?,
            None => {
                return Err(invalid(
                    "reserve",
                    s,
                    "expected PORT:RATE[:BURST] (e.g. 3260:2mbit)",
                ))
            }
        };
        if rate < 1e3 {
            return Err(invalid("reserve", s, "the rate must be at least 1kbit"));
        }
        let burst = match it.next() {
            Some(b) => {
                let b = parse_size(b.trim())?;
                if b == 0 {
                    return Err(invalid("reserve", s, "the burst must be at least one byte"));
                }
                b
            }
            None => Self::DEFAULT_BURST,
        };
        if it.next().is_some() {
            return Err(invalid("reserve", s, "expected PORT:RATE[:BURST]"));
        }
        Ok(Reserve { port, rate, burst })
    }
}

impl Default for DirConfig {
    fn default() -> Self {
        DirConfig {
            rate: None,
            overhead: 0,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            dist: JitterDist::Uniform,
            reorder: false,
            loss: LossModel::None,
            queue: QueueLimit::default(),
            reserve: None,
        }
    }
}

/// One path: two directions, or one shared 802.11 medium carrying both.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PathConfig {
    /// Toward the host (packets sent by the command).
    pub up: DirConfig,
    /// Toward the command.
    pub down: DirConfig,
    /// When set, the service time of every frame is its 802.11 airtime on one half-duplex
    /// medium shared by both directions, and `rate` must be unset.
    pub wifi: Option<WifiParams>,
}

impl PathConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.wifi.is_some() && (self.up.rate.is_some() || self.down.rate.is_some()) {
            return Err(invalid(
                "path",
                "rate with profile",
                "an 802.11 profile sets the service time from the airtime; drop the rate or the profile",
            ));
        }
        for d in [&self.up, &self.down] {
            d.loss.validate()?;
            if d.reserve.is_some() && self.wifi.is_some() {
                return Err(invalid(
                    "path",
                    "reserve with profile",
                    "a reservation needs a wired path (rate=...): an 802.11 medium has no per-class queues here",
                ));
            }
            if let (Some(r), Some(rate)) = (d.reserve, d.rate) {
                if r.rate > rate {
                    return Err(invalid(
                        "reserve",
                        &format!("{}:{}", r.port, r.rate),
                        format!("reserves more than the direction's rate ({rate} bit/s); lower it or raise rate"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Applies one `key=value` of a `--path` specification (or of a command-line option with
    /// the same name). Keys: rate, delay, jitter, jitter-dist, loss, loss-ge, queue, overhead,
    /// reorder, reserve, profile, per, retry-limit; each of the per-direction keys also with `-up` or
    /// `-down`.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let (base, dirs): (&str, &[bool]) = if let Some(b) = key.strip_suffix("-up") {
            (b, &[true])
        } else if let Some(b) = key.strip_suffix("-down") {
            (b, &[false])
        } else {
            (key, &[true, false])
        };
        match base {
            "profile" | "per" | "retry-limit" if dirs.len() == 1 => {
                return Err(invalid(
                    "path key",
                    key,
                    "the 802.11 medium is shared by both directions; set it without -up/-down",
                ))
            }
            "profile" => {
                self.wifi = match value.trim().to_ascii_lowercase().as_str() {
                    "none" | "wired" => None,
                    _ => Some(WifiParams::profile(value)?),
                };
                return Ok(());
            }
            "per" => {
                let per = parse_fraction(value, true)?;
                if per >= 1.0 {
                    return Err(invalid("per", value, "must be below 100%"));
                }
                let w = self.wifi.as_mut().ok_or_else(|| {
                    invalid("per", value, "needs an 802.11 profile (--profile 802.11b)")
                })?;
                w.per = per;
                return Ok(());
            }
            "retry-limit" => {
                let n: u32 = value
                    .trim()
                    .parse()
                    .ok()
                    .filter(|n| (1..=255).contains(n))
                    .ok_or_else(|| {
                        invalid(
                            "retry-limit",
                            value,
                            "expected attempts per frame, 1..=255 (802.11 default 7)",
                        )
                    })?;
                let w = self.wifi.as_mut().ok_or_else(|| {
                    invalid(
                        "retry-limit",
                        value,
                        "needs an 802.11 profile (--profile 802.11b)",
                    )
                })?;
                w.retry_limit = n;
                return Ok(());
            }
            _ => {}
        }
        for &up in dirs {
            let d = if up { &mut self.up } else { &mut self.down };
            match base {
                "rate" => {
                    d.rate = match value.trim() {
                        "0" | "none" | "unlimited" => None,
                        v => {
                            let r = parse_rate(v)?;
                            if r < 1e3 {
                                return Err(invalid("rate", value, "must be at least 1kbit"));
                            }
                            Some(r)
                        }
                    }
                }
                "delay" => d.delay = bounded_duration("delay", value)?,
                "jitter" => d.jitter = bounded_duration("jitter", value)?,
                "jitter-dist" => d.dist = JitterDist::parse(value)?,
                "loss" => {
                    let p = parse_fraction(value, true)?;
                    d.loss = if p == 0.0 {
                        LossModel::None
                    } else {
                        LossModel::Bernoulli(p)
                    };
                }
                "loss-ge" => d.loss = LossModel::parse_ge(value)?,
                "queue" => d.queue = QueueLimit::parse(value)?,
                "reserve" => {
                    d.reserve = match value.trim() {
                        "" | "none" | "off" => None,
                        v => Some(Reserve::parse(v)?),
                    }
                }
                "overhead" => {
                    d.overhead = value.trim().parse().map_err(|_| {
                        invalid("overhead", value, "expected bytes per packet, e.g. 14")
                    })?
                }
                "reorder" => {
                    d.reorder = match value.trim() {
                        "" | "1" | "yes" | "on" | "true" => true,
                        "0" | "no" | "off" | "false" => false,
                        _ => return Err(invalid("reorder", value, "use on or off")),
                    }
                }
                _ => {
                    return Err(invalid(
                        "path key",
                        key,
                        "known keys: rate, delay, jitter, jitter-dist, loss, loss-ge, queue, overhead, \
                         reorder, reserve (each also with -up/-down), profile, per, retry-limit",
                    ))
                }
            }
        }
        Ok(())
    }

    /// Applies a `--path` specification, `key=value` pairs separated by commas, on top of
    /// `self`. Values of `loss-ge` hold commas themselves and may be separated by `/` or `:`
    /// (`loss-ge=1%/10%/100%/0%`).
    pub fn apply_spec(&mut self, spec: &str) -> Result<(), ConfigError> {
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = match item.split_once('=') {
                Some((k, v)) => (k.trim(), v.trim()),
                None if item == "reorder" => ("reorder", "on"),
                None => {
                    return Err(invalid(
                        "path",
                        spec,
                        format!("'{item}' is not key=value (e.g. rate=5mbit,delay=20ms)"),
                    ))
                }
            };
            let v = if k.starts_with("loss-ge") {
                v.replace(['/', ':'], ",")
            } else {
                v.to_string()
            };
            self.set(k, &v)?;
        }
        self.validate()
    }
}

/// Most paths with [`PathBy::Source`]: the command side's addresses of a /28, less the host's.
pub const MAX_SOURCE_PATHS: usize = 14;

/// How flows are spread over several paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum PathBy {
    /// Hash of the 5-tuple (the same for both directions of a flow).
    #[default]
    Hash,
    /// By the command-side port: each new port takes the next path in turn, so the N
    /// connections of one session land on N different paths (a router routing by port, as in
    /// the VPN multi-routing of seed 003). Plain `port % N` would not do: Linux picks even
    /// ephemeral ports for connect().
    Port,
    /// By the command side's source address, as on a multi-homed host: the command's side has
    /// one address per path (`$MCSI_LINK_ADDR_0`, `$MCSI_LINK_ADDR_1`, ...), and a packet from
    /// (or to) address i takes path i. A connection chooses its route by binding its source.
    Source,
}

impl PathBy {
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "hash" | "5-tuple" | "flow" => Ok(PathBy::Hash),
            "port" => Ok(PathBy::Port),
            "source" | "src" => Ok(PathBy::Source),
            _ => Err(invalid("path-by", s, "use hash, port or source")),
        }
    }
}

/// The whole link.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkConfig {
    pub paths: Vec<PathConfig>,
    pub path_by: PathBy,
    pub seed: u64,
}

impl LinkConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.paths.is_empty() {
            return Err(invalid("link", "no paths", "needs at least one path"));
        }
        if self.path_by == PathBy::Source && self.paths.len() > MAX_SOURCE_PATHS {
            return Err(invalid(
                "path-by",
                "source",
                format!("at most {MAX_SOURCE_PATHS} paths: the command side has one address per path in a /28"),
            ));
        }
        if self.paths.len() > 64 {
            return Err(invalid(
                "link",
                &self.paths.len().to_string(),
                "at most 64 paths",
            ));
        }
        self.paths.iter().try_for_each(PathConfig::validate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_limits() {
        assert_eq!(QueueLimit::parse("100p").unwrap(), QueueLimit::Packets(100));
        assert_eq!(
            QueueLimit::parse("20packets").unwrap(),
            QueueLimit::Packets(20)
        );
        assert_eq!(
            QueueLimit::parse("64KiB").unwrap(),
            QueueLimit::Bytes(65536)
        );
        assert_eq!(QueueLimit::parse("3000").unwrap(), QueueLimit::Bytes(3000));
        assert!(QueueLimit::parse("0p").is_err());
        assert!(QueueLimit::parse("lots").is_err());
    }

    #[test]
    fn path_spec() {
        let mut p = PathConfig::default();
        p.apply_spec("rate=5mbit,delay-up=20ms,loss=1%,queue=50p,loss-ge-down=1%/10%/100%/0%")
            .unwrap();
        assert_eq!(p.up.rate, Some(5e6));
        assert_eq!(p.down.rate, Some(5e6));
        assert_eq!(p.up.delay, Duration::from_millis(20));
        assert_eq!(p.down.delay, Duration::ZERO);
        assert_eq!(p.up.loss, LossModel::Bernoulli(0.01));
        assert!(matches!(p.down.loss, LossModel::GilbertElliott { .. }));
        assert_eq!(p.down.queue, QueueLimit::Packets(50));
        assert!(PathConfig::default().apply_spec("speed=5").is_err());
        assert!(PathConfig::default().apply_spec("delay=2h").is_err());
        assert!(PathConfig::default().apply_spec("rate=10bit").is_err());
        assert!(PathConfig::default().apply_spec("rate").is_err());
        assert!(PathConfig::default()
            .apply_spec("profile=802.11b,rate=1mbit")
            .is_err());
        assert!(PathConfig::default().apply_spec("per=10%").is_err());
        let mut w = PathConfig::default();
        w.apply_spec("profile=802.11b,per=10%,retry-limit=4")
            .unwrap();
        let wp = w.wifi.unwrap();
        assert_eq!(wp.per, 0.1);
        assert_eq!(wp.retry_limit, 4);
    }
}
