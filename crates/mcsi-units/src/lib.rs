//! Units for mcsi's command line and reports: sizes (`4KiB`, `1GiB`), bit rates (`5mbit`),
//! durations (`10ms`) and fractions (`1%`, `0.01`).
//!
//! Sizes follow fio: every suffix is binary (`k`, `K`, `KiB` and `KB` all mean 1024), so that
//! `--bs 4k` means what storage people expect. Rates follow tc: `kbit`/`mbit`/`gbit` are decimal
//! bits per second, `kbps`/`mbps`/`gbps` are decimal *bytes* per second, a bare number is bit/s.

use std::fmt;
use std::time::Duration;

/// A value on the command line or in a config file that could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} '{input}': {why}")]
pub struct UnitError {
    pub what: &'static str,
    pub input: String,
    pub why: String,
}

fn err(what: &'static str, input: &str, why: impl Into<String>) -> UnitError {
    UnitError {
        what,
        input: input.to_string(),
        why: why.into(),
    }
}

/// Splits "12.5ms" into (12.5, "ms"). The number may use a decimal point.
fn split_number(s: &str) -> Option<(f64, &str)> {
    let s = s.trim();
    let end = s
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_digit() || *c == '.'))
        .map(|(i, _)| i)
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(end);
    if num.is_empty() {
        return None;
    }
    let v: f64 = num.parse().ok()?;
    Some((v, unit.trim()))
}

/// Parses a size in bytes: `4096`, `4k`, `4KiB`, `64M`, `1GiB`, `2T`. Suffixes are binary.
pub fn parse_size(s: &str) -> Result<u64, UnitError> {
    const WHAT: &str = "size";
    let (v, unit) = split_number(s).ok_or_else(|| {
        err(
            WHAT,
            s,
            "expected a number with an optional unit, e.g. 4KiB or 1GiB",
        )
    })?;
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        "p" | "pb" | "pib" => 1 << 50,
        other => {
            return Err(err(
                WHAT,
                s,
                format!("unknown unit '{other}' (use B, KiB, MiB, GiB, TiB)"),
            ))
        }
    };
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes > u64::MAX as f64 {
        return Err(err(WHAT, s, "too large"));
    }
    if bytes.fract() != 0.0 {
        return Err(err(WHAT, s, "not a whole number of bytes"));
    }
    Ok(bytes as u64)
}

/// Parses a bit rate into bits per second: `5mbit`, `100kbit`, `1gbit`, `5m`, `1000000`,
/// or bytes per second with tc's `bps` forms (`10mbps` = 80 Mbit/s).
pub fn parse_rate(s: &str) -> Result<f64, UnitError> {
    const WHAT: &str = "rate";
    let (v, unit) = split_number(s).ok_or_else(|| {
        err(
            WHAT,
            s,
            "expected a number with a unit, e.g. 5mbit or 100kbit",
        )
    })?;
    let bits: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "bit" | "bit/s" => 1.0,
        "k" | "kbit" | "kbit/s" => 1e3,
        "m" | "mbit" | "mbit/s" => 1e6,
        "g" | "gbit" | "gbit/s" => 1e9,
        "t" | "tbit" | "tbit/s" => 1e12,
        "bps" => 8.0,
        "kbps" => 8e3,
        "mbps" => 8e6,
        "gbps" => 8e9,
        other => {
            return Err(err(
                WHAT,
                s,
                format!("unknown unit '{other}' (use bit, kbit, mbit, gbit; or bps, kbps, mbps for bytes/s)"),
            ))
        }
    };
    let r = v * bits;
    if !r.is_finite() || r <= 0.0 {
        return Err(err(WHAT, s, "must be a positive rate"));
    }
    Ok(r)
}

/// The unit a bare number (no suffix) is taken in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BareUnit {
    Seconds,
    Millis,
    Micros,
    /// No unit is assumed: a bare number other than 0 is an error that asks for one (where
    /// seconds and milliseconds are both plausible, a guess would be a trap).
    Refuse,
}

/// Parses a duration: `10ms`, `1.5s`, `250us`, `2m`, `1h`, `100ns`. A bare number is taken in `bare`.
pub fn parse_duration(s: &str, bare: BareUnit) -> Result<Duration, UnitError> {
    const WHAT: &str = "duration";
    let (v, unit) = split_number(s)
        .ok_or_else(|| err(WHAT, s, "expected a number with a unit, e.g. 10ms or 2s"))?;
    let secs: f64 = match unit.to_ascii_lowercase().as_str() {
        "" => match bare {
            BareUnit::Seconds => 1.0,
            BareUnit::Millis => 1e-3,
            BareUnit::Micros => 1e-6,
            BareUnit::Refuse if v == 0.0 => 0.0,
            BareUnit::Refuse => {
                return Err(err(
                    WHAT,
                    s,
                    format!("a number without a unit: write {v}s or {v}ms (0 alone is zero)"),
                ))
            }
        },
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "s" | "sec" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => {
            return Err(err(
                WHAT,
                s,
                format!("unknown unit '{other}' (use ns, us, ms, s, m, h)"),
            ))
        }
    };
    let total = v * secs;
    if !total.is_finite() || total > 1e12 {
        return Err(err(WHAT, s, "too large"));
    }
    Ok(Duration::from_secs_f64(total))
}

/// Parses a fraction: `1%` is 0.01. A bare number is a percent if `bare_is_percent`, else a fraction.
/// The result must lie in [0, 1].
pub fn parse_fraction(s: &str, bare_is_percent: bool) -> Result<f64, UnitError> {
    const WHAT: &str = "fraction";
    let t = s.trim();
    let (num, pct) = match t.strip_suffix('%') {
        Some(n) => (n.trim(), true),
        None => (t, bare_is_percent),
    };
    let v: f64 = num.parse().map_err(|_| {
        err(
            WHAT,
            s,
            "expected a fraction such as 0.01 or a percent such as 1%",
        )
    })?;
    let f = if pct { v / 100.0 } else { v };
    if !(0.0..=1.0).contains(&f) || f.is_nan() {
        return Err(err(WHAT, s, "must lie between 0 and 1 (0% and 100%)"));
    }
    Ok(f)
}

/// Bytes with a binary unit: `1.50 MiB`.
pub struct Bytes(pub f64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut v = self.0;
        let mut i = 0;
        while v.abs() >= 1024.0 && i + 1 < UNITS.len() {
            v /= 1024.0;
            i += 1;
        }
        if i == 0 {
            write!(f, "{v:.0} {}", UNITS[i])
        } else {
            write!(f, "{v:.2} {}", UNITS[i])
        }
    }
}

/// A bit rate with a decimal unit: `4.93 Mbit/s`.
pub struct Rate(pub f64);

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["bit/s", "kbit/s", "Mbit/s", "Gbit/s", "Tbit/s"];
        let mut v = self.0;
        let mut i = 0;
        while v.abs() >= 1000.0 && i + 1 < UNITS.len() {
            v /= 1000.0;
            i += 1;
        }
        write!(f, "{v:.2} {}", UNITS[i])
    }
}

/// A duration with a readable unit: `812 us`, `10.0 ms`, `1.50 s`.
pub struct Dur(pub Duration);

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0.as_secs_f64();
        if s >= 1.0 {
            write!(f, "{s:.2} s")
        } else if s >= 1e-3 {
            write!(f, "{:.2} ms", s * 1e3)
        } else if s >= 1e-6 {
            write!(f, "{:.1} us", s * 1e6)
        } else {
            write!(f, "{:.0} ns", s * 1e9)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("1.5KiB").unwrap(), 1536);
        assert!(parse_size("1.3B").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("KiB").is_err());
        assert!(parse_size("99999999999P").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(parse_rate("5mbit").unwrap(), 5e6);
        assert_eq!(parse_rate("100kbit").unwrap(), 1e5);
        assert_eq!(parse_rate("5m").unwrap(), 5e6);
        assert_eq!(parse_rate("1Gbit").unwrap(), 1e9);
        assert_eq!(parse_rate("10mbps").unwrap(), 8e7);
        assert!(parse_rate("0mbit").is_err());
        assert!(parse_rate("5furlongs").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(
            parse_duration("10ms", BareUnit::Seconds).unwrap(),
            Duration::from_millis(10)
        );
        assert_eq!(
            parse_duration("10", BareUnit::Millis).unwrap(),
            Duration::from_millis(10)
        );
        assert_eq!(
            parse_duration("2.5s", BareUnit::Millis).unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(
            parse_duration("250us", BareUnit::Millis).unwrap(),
            Duration::from_micros(250)
        );
        assert!(parse_duration("10 fortnights", BareUnit::Millis).is_err());
    }

    #[test]
    fn fractions() {
        assert_eq!(parse_fraction("1%", false).unwrap(), 0.01);
        assert_eq!(parse_fraction("0.01", false).unwrap(), 0.01);
        assert_eq!(parse_fraction("5", true).unwrap(), 0.05);
        assert!(parse_fraction("150%", false).is_err());
        assert!(parse_fraction("-1", false).is_err());
        assert!(parse_fraction("lots", false).is_err());
    }

    #[test]
    fn printing() {
        assert_eq!(Bytes(1536.0).to_string(), "1.50 KiB");
        assert_eq!(Bytes(12.0).to_string(), "12 B");
        assert_eq!(Rate(4.93e6).to_string(), "4.93 Mbit/s");
        assert_eq!(Dur(Duration::from_millis(10)).to_string(), "10.00 ms");
    }
}
