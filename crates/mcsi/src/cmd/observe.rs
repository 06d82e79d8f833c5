//! The `--metrics` endpoint of an initiator command: the session's connections, their counters
//! and the initiator's side of their TCP state, for `mcsi monitor` and Prometheus.

use mcsi_initiator::Session;
use mcsi_target::stats::TcpFamilies;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use serde_json::{json, Value};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConnLabels {
    target: String,
    session: String,
    cid: String,
    peer: String,
    local: String,
    congestion: String,
}

/// Serves one session.
pub struct SessionObserver {
    pub session: Session,
    pub initiator: String,
}

impl crate::cmd::http::Source for SessionObserver {
    fn state(&self) -> Value {
        let st = self.session.stats();
        let conns: Vec<Value> = st
            .connections
            .iter()
            .map(|c| {
                json!({
                    "index": c.index,
                    "cid": c.counters.cid,
                    "role": c.counters.role.as_str(),
                    "alive": c.counters.alive,
                    "peer": c.peer.map(|p| p.to_string()).unwrap_or_default(),
                    "local": c.local.map(|p| p.to_string()).unwrap_or_default(),
                    "bind": c.bind,
                    "mptcp": c.mptcp,
                    "congestion": c.congestion,
                    "tasks": c.counters.tasks,
                    "bytes": c.counters.bytes,
                    "outstanding_tasks": c.counters.outstanding_tasks,
                    "outstanding_bytes": c.counters.outstanding_bytes,
                    "tcp": c.tcp,
                    "target_tcp": c.target_tcp,
                })
            })
            .collect();
        json!({
            "side": "initiator",
            "time_ms": crate::cmd::http::unix_ms(),
            "sessions": [{
                "tsih": st.tsih,
                "target": self.session.url().to_string(),
                "initiator": self.initiator,
                "policy": st.policy,
                "recoveries": st.recoveries,
                "failovers": st.failovers,
                "rejoins": st.rejoins,
                "connections": conns,
            }],
        })
    }

    fn metrics(&self) -> String {
        // Built per scrape: one session's connections, a handful of series.
        let mut r = Registry::with_prefix("mcsi_initiator");
        self.fill(&mut r);
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        out
    }
}

impl SessionObserver {
    /// Registers the session's series in `r`, with their values now.
    pub fn fill(&self, r: &mut Registry) {
        let st = self.session.stats();
        let tasks = Family::<ConnLabels, Counter>::default();
        let bytes = Family::<ConnLabels, Counter>::default();
        let outstanding = Family::<ConnLabels, Gauge>::default();
        let tcp = TcpFamilies::<ConnLabels>::default();
        let recoveries = Counter::<u64>::default();
        let window_waits = Counter::<u64>::default();
        let failovers = Counter::<u64>::default();
        let rejoins = Counter::<u64>::default();
        r.register(
            "connection_tasks",
            "Tasks issued on the connection",
            tasks.clone(),
        );
        r.register_with_unit(
            "connection_task",
            "Data bytes of the tasks issued on the connection",
            Unit::Bytes,
            bytes.clone(),
        );
        r.register(
            "connection_outstanding_tasks",
            "Tasks issued on the connection and not completed",
            outstanding.clone(),
        );
        r.register(
            "session_recoveries",
            "Times the session was re-established after a failure",
            recoveries.clone(),
        );
        r.register(
            "session_failovers",
            "Connections taken out of the session when they stalled, the session going on over the others",
            failovers.clone(),
        );
        r.register(
            "session_rejoins",
            "New connections that took a failed-over connection's place",
            rejoins.clone(),
        );
        r.register(
            "session_window_waits",
            "Times a command waited for the target's CmdSN window",
            window_waits.clone(),
        );
        tcp.register(r, "the initiator's");
        recoveries.inc_by(u64::from(st.recoveries));
        window_waits.inc_by(st.window_waits);
        failovers.inc_by(u64::from(st.failovers));
        rejoins.inc_by(u64::from(st.rejoins));
        for c in &st.connections {
            let k = ConnLabels {
                target: self.session.url().to_string(),
                session: st.tsih.to_string(),
                cid: c.counters.cid.to_string(),
                peer: c.peer.map(|p| p.to_string()).unwrap_or_default(),
                local: c.local.map(|p| p.to_string()).unwrap_or_default(),
                congestion: c.congestion.clone().unwrap_or_default(),
            };
            tasks.get_or_create(&k).inc_by(c.counters.tasks);
            bytes.get_or_create(&k).inc_by(c.counters.bytes);
            outstanding
                .get_or_create(&k)
                .set(i64::from(c.counters.outstanding_tasks));
            if let Some(t) = &c.tcp {
                tcp.set(&k, t);
            }
        }
    }
}
