//! What the hot path counts: a connection's counters and a LUN's metric handles, bumped with
//! atomics only. [`crate::stats`] makes the handles and shows the counts.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Counters of one connection (SCSI commands that arrived on it).
#[derive(Debug, Default)]
pub struct ConnCounters {
    pub commands: AtomicU64,
    /// Data-In bytes the commands produced (reads).
    pub read_bytes: AtomicU64,
    /// Data-Out bytes the commands carried (writes).
    pub write_bytes: AtomicU64,
    /// Commands that ended with a status other than GOOD.
    pub errors: AtomicU64,
    /// PDUs that arrived with a data digest error (rejected; from ErrorRecoveryLevel 1 on their
    /// data is asked for again with a recovery R2T).
    pub digest_errors: AtomicU64,
    /// SNACKs taken (ErrorRecoveryLevel 1), and the PDUs they had sent again.
    pub snacks: AtomicU64,
    pub resent: AtomicU64,
}

/// The metric handles of one LUN, created when the target starts.
#[derive(Debug, Clone, Default)]
pub struct LunMetrics {
    pub(crate) commands: Counter,
    pub(crate) read_bytes: Counter,
    pub(crate) write_bytes: Counter,
    pub(crate) errors: Counter,
    pub(crate) latency: Option<Histogram>,
}

/// Counts a finished command on its LUN and on the counters of the connection it came on. `started` is when
/// the target took the command up (its arrival for a task of its own; its turn in CmdSN order
/// for one run at once on the reader).
pub fn account(
    lun: Option<&LunMetrics>,
    conn: &ConnCounters,
    read: usize,
    write: usize,
    good: bool,
    started: Instant,
) {
    let c = conn;
    c.commands.fetch_add(1, Ordering::Relaxed);
    c.read_bytes.fetch_add(read as u64, Ordering::Relaxed);
    c.write_bytes.fetch_add(write as u64, Ordering::Relaxed);
    if !good {
        c.errors.fetch_add(1, Ordering::Relaxed);
    }
    if let Some(m) = lun {
        m.commands.inc();
        m.read_bytes.inc_by(read as u64);
        m.write_bytes.inc_by(write as u64);
        if !good {
            m.errors.inc();
        }
        if let Some(h) = &m.latency {
            h.observe(started.elapsed().as_secs_f64());
        }
    }
}
