//! What the target counts, per LUN and per connection, and how it is shown: a JSON snapshot of
//! every session's connections with their TCP state ([`snapshot`], read by `mcsi monitor`) and
//! the Prometheus exposition format ([`Metrics::encode`]).
//!
//! The hot path only touches atomics: per-LUN counters and histograms are created once when the
//! target starts, and per-connection counters live in the connection. Session and connection
//! series are rebuilt from the live sessions at each scrape, so that ended connections leave.

use crate::session::{Conn, Session, Shared};
use mcsi_tcp::TcpState;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use crate::counters::{account, ConnCounters, LunMetrics};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LunLabels {
    target: String,
    lun: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TargetLabels {
    target: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConnLabels {
    target: String,
    initiator: String,
    session: String,
    cid: String,
    peer: String,
    congestion: String,
}

fn latency_histogram() -> Histogram {
    // 20 us to about 84 s.
    Histogram::new(exponential_buckets(20e-6, 2.0, 23))
}

/// Families rebuilt at every scrape from the live connections.
#[derive(Default)]
struct Live {
    sessions: Family<TargetLabels, Gauge>,
    commands: Family<ConnLabels, Counter>,
    read_bytes: Family<ConnLabels, Counter>,
    write_bytes: Family<ConnLabels, Counter>,
    errors: Family<ConnLabels, Counter>,
    digest_errors: Family<ConnLabels, Counter>,
    snacks: Family<ConnLabels, Counter>,
    resent: Family<ConnLabels, Counter>,
    tcp: TcpFamilies<ConnLabels>,
}

/// The TCP state of connections as Prometheus families, for any label set (the target's and
/// the initiator's connections).
pub struct TcpFamilies<L> {
    cwnd: Family<L, Gauge>,
    cwnd_bytes: Family<L, Gauge>,
    ssthresh: Family<L, Gauge>,
    mss: Family<L, Gauge>,
    rtt: Family<L, Gauge<f64, AtomicU64>>,
    min_rtt: Family<L, Gauge<f64, AtomicU64>>,
    delivery_rate: Family<L, Gauge>,
    in_flight: Family<L, Gauge>,
    unsent: Family<L, Gauge>,
    retrans: Family<L, Counter>,
    lost: Family<L, Gauge>,
    ca_state: Family<L, Gauge>,
    rwnd_limited: Family<L, Counter<f64, AtomicU64>>,
    sndbuf_limited: Family<L, Counter<f64, AtomicU64>>,
    busy: Family<L, Counter<f64, AtomicU64>>,
}

impl<L> Default for TcpFamilies<L>
where
    L: Clone + std::hash::Hash + Eq,
{
    fn default() -> Self {
        TcpFamilies {
            cwnd: Family::default(),
            cwnd_bytes: Family::default(),
            ssthresh: Family::default(),
            mss: Family::default(),
            rtt: Family::default(),
            min_rtt: Family::default(),
            delivery_rate: Family::default(),
            in_flight: Family::default(),
            unsent: Family::default(),
            retrans: Family::default(),
            lost: Family::default(),
            ca_state: Family::default(),
            rwnd_limited: Family::default(),
            sndbuf_limited: Family::default(),
            busy: Family::default(),
        }
    }
}

impl<L> TcpFamilies<L>
where
    L: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
{
    /// Registers the families under `r`'s prefix, named `tcp_*`; `whose` says whose socket
    /// they describe ("the target's", "the initiator's").
    pub fn register(&self, r: &mut Registry, whose: &str) {
        r.register(
            "tcp_cwnd_segments",
            format!("Congestion window of {whose} socket (TCP_INFO), segments"),
            self.cwnd.clone(),
        );
        r.register_with_unit(
            "tcp_cwnd",
            format!("Congestion window of {whose} socket, bytes (cwnd x MSS)"),
            Unit::Bytes,
            self.cwnd_bytes.clone(),
        );
        r.register(
            "tcp_ssthresh_segments",
            "Slow-start threshold, segments",
            self.ssthresh.clone(),
        );
        r.register_with_unit("tcp_mss", "Sender MSS", Unit::Bytes, self.mss.clone());
        r.register_with_unit(
            "tcp_rtt",
            "Smoothed round-trip time",
            Unit::Seconds,
            self.rtt.clone(),
        );
        r.register_with_unit(
            "tcp_min_rtt",
            "Lowest round-trip time seen",
            Unit::Seconds,
            self.min_rtt.clone(),
        );
        r.register(
            "tcp_delivery_rate_bytes_per_second",
            "Latest delivery-rate sample",
            self.delivery_rate.clone(),
        );
        r.register_with_unit(
            "tcp_in_flight",
            "Bytes sent and not yet acknowledged (nor known lost)",
            Unit::Bytes,
            self.in_flight.clone(),
        );
        r.register_with_unit(
            "tcp_unsent",
            "Bytes queued in the socket and not yet sent",
            Unit::Bytes,
            self.unsent.clone(),
        );
        r.register(
            "tcp_retransmitted_segments",
            "Segments retransmitted over the connection's life",
            self.retrans.clone(),
        );
        r.register(
            "tcp_lost_segments",
            "Segments currently marked lost",
            self.lost.clone(),
        );
        r.register(
            "tcp_ca_state",
            "Congestion-avoidance state: 0 open, 1 disorder, 2 cwr, 3 recovery, 4 loss",
            self.ca_state.clone(),
        );
        r.register_with_unit(
            "tcp_rwnd_limited",
            "Time sending was limited by the peer's receive window",
            Unit::Seconds,
            self.rwnd_limited.clone(),
        );
        r.register_with_unit(
            "tcp_sndbuf_limited",
            "Time sending was limited by the send buffer",
            Unit::Seconds,
            self.sndbuf_limited.clone(),
        );
        r.register_with_unit(
            "tcp_busy",
            "Time spent sending data",
            Unit::Seconds,
            self.busy.clone(),
        );
    }

    /// Forgets every connection (before a scrape fills them again).
    pub fn clear(&self) {
        for f in [
            &self.cwnd,
            &self.cwnd_bytes,
            &self.ssthresh,
            &self.mss,
            &self.delivery_rate,
            &self.in_flight,
            &self.unsent,
            &self.lost,
            &self.ca_state,
        ] {
            f.clear();
        }
        self.retrans.clear();
        self.rtt.clear();
        self.min_rtt.clear();
        for f in [&self.rwnd_limited, &self.sndbuf_limited, &self.busy] {
            f.clear();
        }
    }

    /// One connection's state.
    pub fn set(&self, k: &L, t: &TcpState) {
        let g = |f: &Family<L, Gauge>, v: u64| {
            f.get_or_create(k).set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        g(&self.cwnd, u64::from(t.cwnd));
        g(&self.cwnd_bytes, t.cwnd_bytes());
        g(&self.ssthresh, u64::from(t.ssthresh));
        g(&self.mss, u64::from(t.snd_mss));
        g(&self.in_flight, t.in_flight_bytes());
        g(&self.lost, u64::from(t.lost));
        g(&self.ca_state, ca_code(t));
        if let Some(v) = t.delivery_rate {
            g(&self.delivery_rate, v);
        }
        if let Some(v) = t.notsent_bytes {
            g(&self.unsent, u64::from(v));
        }
        self.retrans
            .get_or_create(k)
            .inc_by(u64::from(t.total_retrans));
        self.rtt.get_or_create(k).set(f64::from(t.rtt_us) / 1e6);
        if let Some(v) = t.min_rtt_us {
            self.min_rtt.get_or_create(k).set(f64::from(v) / 1e6);
        }
        let secs = |f: &Family<L, Counter<f64, AtomicU64>>, v: Option<u64>| {
            if let Some(us) = v {
                f.get_or_create(k).inc_by(us as f64 / 1e6);
            }
        };
        secs(&self.rwnd_limited, t.rwnd_limited_us);
        secs(&self.sndbuf_limited, t.sndbuf_limited_us);
        secs(&self.busy, t.busy_us);
    }
}

/// The target's Prometheus registry.
pub struct Metrics {
    registry: Registry,
    lun_commands: Family<LunLabels, Counter>,
    lun_read_bytes: Family<LunLabels, Counter>,
    lun_write_bytes: Family<LunLabels, Counter>,
    lun_errors: Family<LunLabels, Counter>,
    lun_latency: Family<LunLabels, Histogram, fn() -> Histogram>,
    live: Live,
    /// One scrape at a time rebuilds the live families.
    scrape: Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut r = Registry::with_prefix("mcsi_target");
        let lun_commands = Family::<LunLabels, Counter>::default();
        let lun_read_bytes = Family::<LunLabels, Counter>::default();
        let lun_write_bytes = Family::<LunLabels, Counter>::default();
        let lun_errors = Family::<LunLabels, Counter>::default();
        let lun_latency = Family::<LunLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram,
        );
        r.register(
            "lun_commands",
            "SCSI commands completed, per LUN",
            lun_commands.clone(),
        );
        r.register_with_unit(
            "lun_read",
            "Data-In bytes of completed commands, per LUN",
            Unit::Bytes,
            lun_read_bytes.clone(),
        );
        r.register_with_unit(
            "lun_write",
            "Data-Out bytes of completed commands, per LUN",
            Unit::Bytes,
            lun_write_bytes.clone(),
        );
        r.register(
            "lun_errors",
            "SCSI commands that ended with a status other than GOOD, per LUN",
            lun_errors.clone(),
        );
        r.register_with_unit(
            "lun_command_latency",
            "Time from the target taking a command up to its status being queued, per LUN",
            Unit::Seconds,
            lun_latency.clone(),
        );
        let live = Live::default();
        r.register(
            "sessions",
            "Sessions logged in, per target",
            live.sessions.clone(),
        );
        r.register(
            "connection_commands",
            "SCSI commands completed that arrived on the connection",
            live.commands.clone(),
        );
        r.register_with_unit(
            "connection_read",
            "Data-In bytes of the connection's commands",
            Unit::Bytes,
            live.read_bytes.clone(),
        );
        r.register_with_unit(
            "connection_write",
            "Data-Out bytes of the connection's commands",
            Unit::Bytes,
            live.write_bytes.clone(),
        );
        r.register(
            "connection_errors",
            "Commands of the connection that ended with a status other than GOOD",
            live.errors.clone(),
        );
        r.register(
            "connection_data_digest_errors",
            "PDUs that arrived on the connection with a data digest error (from ErrorRecoveryLevel 1 on, their data is asked for again)",
            live.digest_errors.clone(),
        );
        r.register(
            "connection_snacks",
            "SNACKs the connection took (ErrorRecoveryLevel 1)",
            live.snacks.clone(),
        );
        r.register(
            "connection_resent_pdus",
            "PDUs the connection sent again for SNACKs",
            live.resent.clone(),
        );
        live.tcp.register(&mut r, "the target's");
        Metrics {
            registry: r,
            lun_commands,
            lun_read_bytes,
            lun_write_bytes,
            lun_errors,
            lun_latency,
            live,
            scrape: Mutex::new(()),
        }
    }

    /// The handles of one LUN (made once, when the target starts).
    pub fn lun(&self, target: &str, lun: u16) -> LunMetrics {
        let l = LunLabels {
            target: target.to_string(),
            lun: lun.to_string(),
        };
        LunMetrics {
            commands: self.lun_commands.get_or_create(&l).clone(),
            read_bytes: self.lun_read_bytes.get_or_create(&l).clone(),
            write_bytes: self.lun_write_bytes.get_or_create(&l).clone(),
            errors: self.lun_errors.get_or_create(&l).clone(),
            latency: Some(self.lun_latency.get_or_create(&l).clone()),
        }
    }

    /// The exposition text, with session and connection series taken from `sessions` now.
    pub fn encode(&self, sessions: &[SessionSnapshot]) -> String {
        let _one = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        let l = &self.live;
        l.sessions.clear();
        for f in [
            &l.commands,
            &l.read_bytes,
            &l.write_bytes,
            &l.errors,
            &l.digest_errors,
            &l.snacks,
            &l.resent,
        ] {
            f.clear();
        }
        l.tcp.clear();
        for s in sessions {
            let Some(target) = &s.target else { continue };
            l.sessions
                .get_or_create(&TargetLabels {
                    target: target.clone(),
                })
                .inc();
            for c in &s.connections {
                let k = ConnLabels {
                    target: label_value(target),
                    initiator: label_value(&s.initiator),
                    session: s.tsih.to_string(),
                    cid: c.cid.to_string(),
                    peer: label_value(&c.peer),
                    congestion: c.congestion.clone().unwrap_or_default(),
                };
                l.commands.get_or_create(&k).inc_by(c.commands);
                l.read_bytes.get_or_create(&k).inc_by(c.read_bytes);
                l.write_bytes.get_or_create(&k).inc_by(c.write_bytes);
                l.errors.get_or_create(&k).inc_by(c.errors);
                l.digest_errors.get_or_create(&k).inc_by(c.digest_errors);
                l.snacks.get_or_create(&k).inc_by(c.snacks);
                l.resent.get_or_create(&k).inc_by(c.resent);
                if let Some(t) = &c.tcp {
                    l.tcp.set(&k, t);
                }
            }
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

fn ca_code(t: &TcpState) -> u64 {
    u64::from(t.ca_state.code())
}

/// Sends the initiator the TCP state of the connection's socket (`X-org.mcsi.TcpReport`), every
/// [`mcsi_proto::vendor::TCP_REPORT_INTERVAL_MS`] while the socket has sent something new, until
/// the connection stops.
pub async fn report_tcp(conn: Arc<Conn>, mut stop: tokio::sync::watch::Receiver<bool>) {
    use mcsi_proto::vendor::TCP_REPORT_INTERVAL_MS;
    let Some(sock) = conn.sock.as_ref() else {
        return;
    };
    let period = std::time::Duration::from_millis(TCP_REPORT_INTERVAL_MS);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reporter = mcsi_target_core::report::TcpReporter::default();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = crate::session::flag_set(&mut stop) => return,
        }
        if conn.is_closed() {
            return;
        }
        if !reporter.wants_sample(conn.counters.commands.load(Ordering::Relaxed) > 0) {
            continue;
        }
        let Ok(t) = mcsi_tcp::tcp_state(sock) else {
            return;
        };
        if let Some(p) = reporter.on_sample(&t) {
            conn.send(p);
        }
    }
}

/// One connection as the monitor and the metrics see it.
#[derive(Debug, Clone, Serialize)]
pub struct ConnSnapshot {
    pub cid: u16,
    pub role: &'static str,
    pub peer: String,
    pub local: String,
    /// The congestion control the socket runs.
    pub congestion: Option<String>,
    pub commands: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    /// PDUs that arrived with a data digest error; SNACKs taken and the PDUs they sent again
    /// (ErrorRecoveryLevel 1).
    pub digest_errors: u64,
    pub snacks: u64,
    pub resent: u64,
    /// Bytes queued for sending and not yet taken by the socket, and the connection's output
    /// budget (at the budget its requests wait).
    pub queued_bytes: u64,
    pub output_budget: u64,
    /// The target's sending side: TCP_INFO of its socket.
    pub tcp: Option<TcpState>,
}

/// One session.
#[derive(Debug, Clone, Serialize)]
pub struct SessionSnapshot {
    pub tsih: u16,
    /// None for a discovery session.
    pub target: Option<String>,
    pub initiator: String,
    pub isid: String,
    pub connections: Vec<ConnSnapshot>,
}

/// A label value as the text exposition format wants it: backslash, double quote and line feed
/// escaped (prometheus-client writes values as given). Initiator names are checked at login
/// ([`crate::name::check_peer`]); this keeps any other value from breaking a scrape.
pub fn label_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Every session's connections with their TCP state, sampled now.
pub fn snapshot(shared: &Shared) -> Vec<SessionSnapshot> {
    let mut out: Vec<SessionSnapshot> =
        shared.all_sessions().iter().map(session_snapshot).collect();
    out.sort_by_key(|s| s.tsih);
    out
}

fn session_snapshot(s: &Arc<Session>) -> SessionSnapshot {
    let mut conns: Vec<Arc<Conn>> = s.conns();
    conns.sort_by_key(|c| c.cid);
    SessionSnapshot {
        tsih: s.tsih,
        target: s.target.as_ref().map(|t| t.name.clone()),
        initiator: s.initiator_name.clone(),
        isid: s.isid.0.iter().map(|b| format!("{b:02x}")).collect(),
        connections: conns.iter().map(|c| conn_snapshot(c)).collect(),
    }
}

fn conn_snapshot(c: &Conn) -> ConnSnapshot {
    let n = &c.counters;
    ConnSnapshot {
        cid: c.cid,
        role: c.role.as_str(),
        peer: c.peer.to_string(),
        local: c.local.to_string(),
        congestion: c
            .sock
            .as_ref()
            .and_then(|s| mcsi_tcp::congestion::current(s).ok()),
        commands: n.commands.load(Ordering::Relaxed),
        read_bytes: n.read_bytes.load(Ordering::Relaxed),
        write_bytes: n.write_bytes.load(Ordering::Relaxed),
        errors: n.errors.load(Ordering::Relaxed),
        digest_errors: n.digest_errors.load(Ordering::Relaxed),
        snacks: n.snacks.load(Ordering::Relaxed),
        resent: n.resent.load(Ordering::Relaxed),
        queued_bytes: c.out.queued(),
        output_budget: c.out.budget(),
        tcp: c.sock.as_ref().and_then(|s| mcsi_tcp::tcp_state(s).ok()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_cannot_end_their_quotes_or_lines() {
        assert_eq!(label_value("iqn.2026-01.org.x:a"), "iqn.2026-01.org.x:a");
        assert_eq!(label_value("a\"} 1\nfake 2 \\"), "a\\\"} 1\\nfake 2 \\\\");
    }
}
