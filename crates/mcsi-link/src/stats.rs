//! Counters kept per path and direction, and the summary printed at exit.

use mcsi_units::{Bytes, Dur};
use std::fmt;
use std::time::Duration;

#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct DirStats {
    pub packets_in: u64,
    pub bytes_in: u64,
    pub packets_out: u64,
    pub bytes_out: u64,
    pub drop_loss: u64,
    pub drop_queue: u64,
    pub drop_retry_limit: u64,
    /// Packets lost because their path was down (on arrival, or queued when it went down).
    pub drop_down: u64,
    pub peak_queue_packets: u64,
    pub peak_queue_bytes: u64,
    /// Sum over delivered packets of (release - arrival), for the mean sojourn time.
    pub delay_sum_ns: u64,
    /// 802.11 only: transmission attempts, retransmissions, attempts lost to collisions.
    pub attempts: u64,
    pub retries: u64,
    pub collisions: u64,
    /// Bytes of the reserved class (`reserve=`) taken in and served; both also count in
    /// `bytes_in`.
    pub reserved_bytes_in: u64,
    pub reserved_bytes_out: u64,
}

impl DirStats {
    pub fn drops(&self) -> u64 {
        self.drop_loss + self.drop_queue + self.drop_retry_limit + self.drop_down
    }

    pub fn mean_delay(&self) -> Option<Duration> {
        (self.packets_out > 0).then(|| Duration::from_nanos(self.delay_sum_ns / self.packets_out))
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct PathStats {
    pub up: DirStats,
    pub down: DirStats,
    /// 802.11 only: time the medium was busy (transmissions, SIFS and ACKs, not DIFS/backoff).
    pub airtime_busy_ns: u64,
}

/// What the link did, for the summary at exit.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Summary {
    pub elapsed_ns: u64,
    pub paths: Vec<PathStats>,
    /// Packets not forwarded because they were not IPv4 between the two link addresses.
    pub filtered: u64,
    /// How late packets left compared with their due time (timer precision of the I/O layer).
    pub timer_late_mean_ns: u64,
    pub timer_late_max_ns: u64,
    /// Packets the kernel refused when written to a TUN device.
    pub write_errors: u64,
}

/// Bits per second of `bytes` over `secs` (0 over no time).
fn bit_rate(bytes: u64, secs: f64) -> mcsi_units::Rate {
    mcsi_units::Rate(if secs > 0.0 {
        bytes as f64 * 8.0 / secs
    } else {
        0.0
    })
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.elapsed_ns as f64 / 1e9;
        writeln!(f, "mcsi link: {:.2} s", secs)?;
        for (i, p) in self.paths.iter().enumerate() {
            for (name, d) in [("up", &p.up), ("down", &p.down)] {
                write!(
                    f,
                    "  path {i} {name:>4}: {} pkts ({}) in, {} pkts ({}, {}) out, drops loss {} queue {}",
                    d.packets_in,
                    Bytes(d.bytes_in as f64),
                    d.packets_out,
                    Bytes(d.bytes_out as f64),
                    bit_rate(d.bytes_out, secs),
                    d.drop_loss,
                    d.drop_queue,
                )?;
                if d.drop_down > 0 {
                    write!(f, " path-down {}", d.drop_down)?;
                }
                if d.reserved_bytes_in > 0 {
                    write!(
                        f,
                        "; reserved class {} in, {} ({}) out",
                        Bytes(d.reserved_bytes_in as f64),
                        Bytes(d.reserved_bytes_out as f64),
                        bit_rate(d.reserved_bytes_out, secs)
                    )?;
                }
                if d.attempts > 0 {
                    write!(
                        f,
                        " retry-limit {}; attempts {} retries {} collisions {}",
                        d.drop_retry_limit, d.attempts, d.retries, d.collisions
                    )?;
                }
                write!(
                    f,
                    "; peak queue {} pkts / {}",
                    d.peak_queue_packets,
                    Bytes(d.peak_queue_bytes as f64)
                )?;
                if let Some(m) = d.mean_delay() {
                    write!(f, "; mean delay {}", Dur(m))?;
                }
                writeln!(f)?;
            }
            if p.airtime_busy_ns > 0 && self.elapsed_ns > 0 {
                writeln!(
                    f,
                    "  path {i} medium busy {:.1}%",
                    p.airtime_busy_ns as f64 * 100.0 / self.elapsed_ns as f64
                )?;
            }
        }
        if self.timer_late_max_ns > 0 {
            writeln!(
                f,
                "  timer lateness: mean {}, max {}",
                Dur(Duration::from_nanos(self.timer_late_mean_ns)),
                Dur(Duration::from_nanos(self.timer_late_max_ns))
            )?;
        }
        if self.write_errors > 0 {
            writeln!(f, "  TUN write errors: {}", self.write_errors)?;
        }
        if self.filtered > 0 {
            writeln!(
                f,
                "  filtered (not IPv4 between the link addresses): {}",
                self.filtered
            )?;
        }
        Ok(())
    }
}
