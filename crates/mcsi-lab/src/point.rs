//! What a point of an experiment is and means: its parameters, what it measures, and what it
//! asks of the machinery (the link's options, whether it runs simulated, how many sessions and
//! volume members, whether the stacks can run it at all). Every other module of the lab reads
//! points; this one reads only [`crate::params`], so the spec, the runner, the results and the
//! reports all stand on it without importing each other in a circle.

use crate::params::{self, Def, Role, Value};
use serde::Deserialize;
use std::collections::BTreeMap;

/// A measured quantity of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Metric {
    /// Read plus write throughput, 10^6 bytes per second.
    BwMbs,
    Iops,
    LatMeanMs,
    LatP50Ms,
    LatP99Ms,
    /// Segments retransmitted by the initiator's connections.
    Retransmits,
    /// Segments retransmitted by the target's connections (as it reports them to mcsi bench).
    TargetRetransmits,
    /// Mean I/O size, KiB (it varies with bs_auto).
    IoKib,
    /// Times the session was logged in again after a failure.
    Recoveries,
    /// Commands issued again from the start after a failure.
    Reissued,
    /// With kill_every: the median over the run's kills of the longest I/O in flight across
    /// each, ms.
    KillPauseMs,
    /// With kill_every: the longest I/O in flight across any kill, ms.
    KillPauseMaxMs,
    /// With kill_every: the longest time in the run without any I/O completing, ms.
    StallMs,
    /// With qos_q: I/Os completed as a percentage of those the rate's schedule asked for.
    IopsPct,
    /// With qos_q: mean response time as a percentage of the requirement's.
    RtPct,
}

impl Metric {
    pub const ALL: [Metric; 15] = [
        Metric::BwMbs,
        Metric::Iops,
        Metric::LatMeanMs,
        Metric::LatP50Ms,
        Metric::LatP99Ms,
        Metric::Retransmits,
        Metric::TargetRetransmits,
        Metric::IoKib,
        Metric::Recoveries,
        Metric::Reissued,
        Metric::KillPauseMs,
        Metric::KillPauseMaxMs,
        Metric::StallMs,
        Metric::IopsPct,
        Metric::RtPct,
    ];

    /// The CSV column.
    pub fn column(self) -> &'static str {
        match self {
            Metric::BwMbs => "bw_mbs",
            Metric::Iops => "iops",
            Metric::LatMeanMs => "lat_mean_ms",
            Metric::LatP50Ms => "lat_p50_ms",
            Metric::LatP99Ms => "lat_p99_ms",
            Metric::Retransmits => "retransmits",
            Metric::TargetRetransmits => "target_retransmits",
            Metric::IoKib => "io_kib",
            Metric::Recoveries => "recoveries",
            Metric::Reissued => "reissued",
            Metric::KillPauseMs => "kill_pause_ms",
            Metric::KillPauseMaxMs => "kill_pause_max_ms",
            Metric::StallMs => "stall_ms",
            Metric::IopsPct => "iops_pct",
            Metric::RtPct => "rt_pct",
        }
    }

    /// Axis label with unit.
    pub fn axis(self) -> &'static str {
        match self {
            Metric::BwMbs => "throughput (MB/s, 10^6 bytes/s)",
            Metric::Iops => "I/O operations per second",
            Metric::LatMeanMs => "mean response time (ms)",
            Metric::LatP50Ms => "median response time (ms)",
            Metric::LatP99Ms => "99th percentile response time (ms)",
            Metric::Retransmits => "TCP segments retransmitted",
            Metric::TargetRetransmits => "TCP segments retransmitted by the target",
            Metric::IoKib => "mean I/O size (KiB)",
            Metric::Recoveries => "session logins after a failure",
            Metric::Reissued => "commands issued again",
            Metric::KillPauseMs => "longest I/O across a kill, median over kills (ms)",
            Metric::KillPauseMaxMs => "longest I/O across any kill (ms)",
            Metric::StallMs => "longest time without an I/O completing (ms)",
            Metric::IopsPct => "I/Os done (% of those the requirement's rate asked for)",
            Metric::RtPct => "mean response time (% of the requirement)",
        }
    }

    /// Unit for tables.
    pub fn unit(self) -> &'static str {
        match self {
            Metric::BwMbs => "MB/s",
            Metric::Iops => "IOPS",
            Metric::LatMeanMs | Metric::LatP50Ms | Metric::LatP99Ms => "ms",
            Metric::Retransmits | Metric::TargetRetransmits => "segments",
            Metric::IoKib => "KiB",
            Metric::Recoveries => "logins",
            Metric::Reissued => "commands",
            Metric::KillPauseMs | Metric::KillPauseMaxMs | Metric::StallMs => "ms",
            Metric::IopsPct | Metric::RtPct => "%",
        }
    }

    pub fn parse(s: &str) -> Result<Metric, String> {
        Metric::ALL
            .into_iter()
            .find(|m| m.column() == s)
            .ok_or_else(|| {
                let all: Vec<_> = Metric::ALL.iter().map(|m| m.column()).collect();
                format!("unknown metric '{s}' (use {})", all.join(", "))
            })
    }
}

/// A set of parameter values, keyed by name, in the order of [`params::DEFS`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Params(pub BTreeMap<&'static str, Value>);

impl Params {
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name)
    }
    /// The parameters that are set, in the order of [`params::DEFS`].
    pub fn iter(&self) -> impl Iterator<Item = (&'static Def, &Value)> {
        params::DEFS
            .iter()
            .filter_map(|d| self.0.get(d.name).map(|v| (d, v)))
    }
}

/// A model curve or line on a figure, or a model value for a claim.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRef {
    pub label: String,
    /// Which model: see [`crate::model`].
    pub kind: String,
    /// Connections the model's figure is multiplied by (several TCP flows); default: the
    /// point's connections.
    #[serde(default)]
    pub connections: Option<u32>,
}

/// One workload on one link: every parameter set.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub series: String,
    pub params: Params,
}

impl Point {
    /// A stable identifier of the point, for resuming and joining.
    pub fn key(&self) -> String {
        let mut s = format!("series={}", self.series);
        for (d, v) in self.params.iter() {
            s.push_str(&format!(";{}={}", d.name, v.text));
        }
        s
    }

    pub fn text(&self, name: &str) -> &str {
        self.params.get(name).map_or("", |v| v.text.as_str())
    }

    pub fn num(&self, name: &str) -> Option<f64> {
        self.params.get(name).and_then(|v| v.num)
    }

    /// Seconds of load.
    pub fn runtime(&self) -> f64 {
        self.num("runtime").unwrap_or(8.0)
    }
}

pub(crate) const PORT: u16 = 3260;

/// The options of `mcsi link run` for point `p` (profile, rate, delay, loss, ..., mtu).
pub fn link_args(p: &Point) -> Result<Vec<String>, String> {
    let mut path = mcsi_link::PathConfig::default();
    let mut args = Vec::new();
    let mut set = |k: &str, v: String| -> Result<(), String> {
        path.set(k, &v).map_err(|e| format!("{k}: {e}"))?;
        args.push(format!("--{k}"));
        args.push(v);
        Ok(())
    };
    // The profile first: per refines it.
    for (d, v) in p.params.iter().filter(|(d, _)| d.role == Role::Link) {
        if d.name == "profile" {
            set("profile", d.arg(v))?;
        }
    }
    for (d, v) in p.params.iter().filter(|(d, _)| d.role == Role::Link) {
        match d.name {
            "profile" | "mtu" | "paths" | "path_by" => {}
            "rtt" => {
                let half = v.num.unwrap_or(0.0) / 2.0;
                set("delay", format!("{half}ms"))?;
            }
            name => set(name, d.arg(v))?,
        }
    }
    if let (Some((c2s, s2c)), (true, _)) = (qos_rates(p)?, qos_at(p)) {
        // The storage session's share at the bottleneck: up is toward the target.
        set("reserve-up", format!("{PORT}:{}bit", (c2s * 8.0).ceil()))?;
        set("reserve-down", format!("{PORT}:{}bit", (s2c * 8.0).ceil()))?;
    }
    path.validate().map_err(|e| e.to_string())?;
    if let Some(ps) = p.params.get("paths") {
        // Each path is the link's options with its own on top; connections take them in turn.
        let specs: Vec<&str> = ps.text.split(';').map(str::trim).collect();
        if specs.len() < 2 || specs.iter().any(|s| s.is_empty()) {
            return Err(format!(
                "paths: '{}': give two or more paths separated by ';'",
                ps.text
            ));
        }
        for (i, spec) in specs.iter().enumerate() {
            let mut one = path.clone();
            one.apply_spec(spec)
                .and_then(|()| one.validate())
                .map_err(|e| format!("paths: path {} '{spec}': {e}", i + 1))?;
            args.push("--path".into());
            args.push((*spec).to_string());
        }
        args.push("--path-by".into());
        args.push(
            p.params
                .get("path_by")
                .map_or("port".to_string(), |v| v.text.clone()),
        );
    }
    if let Some(m) = p.params.get("mtu") {
        args.push("--mtu".into());
        args.push(m.text.clone());
    }
    if mptcp(p) {
        args.push("--mptcp".into());
    }
    Ok(args)
}

/// Whether the point runs over Multipath TCP (parameter `mptcp`).
pub(crate) fn mptcp(p: &Point) -> bool {
    p.text("mptcp") == "true"
}

/// Seed 004's requirement the point runs (parameter `qos_q`).
pub(crate) fn qos_requirement(p: &Point) -> Option<&'static mcsi_model::qos::Requirement> {
    let q = p.num("qos_q")? as usize;
    mcsi_model::qos::SEED_004.get(q.checked_sub(1)?)
}

/// The bandwidths allocated to the point's requirement, bytes per second (client to storage,
/// storage to client), with seed 004's framing; `None` for `full` or no allocation.
pub(crate) fn qos_rates(p: &Point) -> Result<Option<(f64, f64)>, String> {
    let alloc = p.text("qos_alloc");
    if alloc.is_empty() || alloc == "full" {
        return Ok(None);
    }
    let q = qos_requirement(p).ok_or("qos_alloc needs qos_q, the requirement it allocates for")?;
    // prot-rt-ack: eq. 9-10 with TCP's acknowledgements counted (mcsi's extension).
    let (name, acks) = match alloc.strip_suffix("-ack") {
        Some(base) => (base, mcsi_model::qos::ACK_FRAME),
        None => (alloc, 0),
    };
    let a = mcsi_model::qos::Allocation::parse(name).ok_or_else(|| {
        format!("qos_alloc '{alloc}': use naive, prot, prot-rt, prot-rt-ack or full")
    })?;
    let framing = mcsi_model::qos::Framing {
        ack_bytes: acks,
        ..mcsi_model::qos::Framing::default()
    };
    let r = mcsi_model::qos::bandwidth(q, &framing).map_err(|e| e.to_string())?;
    Ok(Some(a.rates(&r)))
}

/// Where the allocation is enforced: (at the link, at the target).
pub(crate) fn qos_at(p: &Point) -> (bool, bool) {
    match p.text("qos_at") {
        "link" => (true, false),
        "target" => (false, true),
        _ => (true, true),
    }
}

/// Whether the point runs in `mcsi sim` (parameter `engine`) rather than behind `mcsi link run`.
pub fn simulated(p: &Point) -> bool {
    p.text("engine") == "sim"
}

/// The congestion control a simulated point uses: its `cc`, or CUBIC (Linux's default) where it
/// sets none. (A simulated point cannot use the host's default: it has no host.)
pub(crate) fn sim_congestion(p: &Point) -> &str {
    match p.text("cc") {
        "" => "cubic",
        cc => cc,
    }
}

/// What `mcsi sim` does not model: a point that needs it runs emulated.
/// The simulated sockets' buffer (`mcsi sim --tcp-buffer`): `window` in bytes, or
/// `window_segments` segments of the point's MSS (its MTU less 52 bytes of IP and TCP headers,
/// timestamps on); neither leaves the simulator's default.
pub(crate) fn sim_window(p: &Point) -> Result<Option<String>, String> {
    match (p.params.get("window"), p.num("window_segments")) {
        (Some(_), Some(_)) => {
            Err("window and window_segments both set: give the window one way".into())
        }
        (Some(v), None) => Ok(Some(v.text.clone())),
        (None, Some(n)) => {
            let mss = p.num("mtu").unwrap_or(1500.0) - 52.0;
            Ok(Some(format!("{}", (n * mss) as u64)))
        }
        (None, None) => Ok(None),
    }
}

pub(crate) fn check_sim(p: &Point) -> Result<(), String> {
    sim_window(p)?;
    let not = |what: &str| {
        Err(format!(
            "engine \"sim\" does not model {what}: run this series with engine \"emulated\""
        ))
    };
    if p.text("target") == "tgt" {
        return not("tgt (it runs mcsi's target core)");
    }
    if !matches!(p.text("client"), "" | "mcsi-bench") {
        return not("clients other than mcsi bench");
    }
    for k in [
        "volume",
        "kill_every",
        "rate_iops",
        "qos_q",
        "qos_alloc",
        "qos_at",
        "storage_share",
        "bulk",
        "routes",
        "bs_auto",
        "initiator_cc",
        "target_cc",
    ] {
        if p.params.get(k).is_some() {
            return not(k);
        }
    }
    if mptcp(p) {
        return not("Multipath TCP");
    }
    if p.text("asymmetric") == "true" {
        return not("the asymmetric mode");
    }
    if p.text("verify") == "true" {
        return not("verify");
    }
    if p.num("max_erl").is_some_and(|x| x > 0.0) {
        return not("error recovery (max_erl above 0)");
    }
    if sim_congestion(p) == "bbr" {
        return not("BBR (the simulator's TCP has Reno and CUBIC)");
    }
    if p.text("rw") == "randrw" {
        return not("randrw");
    }
    if p.text("path_by") == "source" {
        return not("paths chosen by source address");
    }
    Ok(())
}

/// LUNs of the point's volume (parameter `members`, default 2), or 0 without a volume.
pub fn members(p: &Point) -> usize {
    if p.params.get("volume").is_none() {
        return 0;
    }
    p.num("members").map_or(2, |n| n as usize).max(2)
}

/// Sessions the point runs at once (parameter `sessions`, default 1).
pub fn sessions(p: &Point) -> usize {
    p.num("sessions").map_or(1, |n| n as usize).max(1)
}

/// What the standard stack can run: libiscsi's iscsi-perf reads, over one connection (libiscsi
/// never negotiates more), without mcsi's extensions; tgt serves a RAM-backed file.
pub fn check_point(p: &Point) -> Result<(), String> {
    if simulated(p) {
        check_sim(p)?;
    } else if p.text("lun").starts_with("cheetah-9lp") {
        return Err("lun cheetah-9lp is the simulator's disk model: set engine = \"sim\"".into());
    }
    if !simulated(p) {
        for k in ["pdu", "window", "window_segments"] {
            if p.params.get(k).is_some() {
                return Err(format!(
                    "{k} is a parameter of simulated points: set engine = \"sim\""
                ));
            }
        }
    }
    if p.text("client") == "iscsi-perf" {
        if !matches!(p.text("rw"), "read" | "randread") {
            return Err("iscsi-perf (libiscsi) only reads: use rw read or randread".into());
        }
        if p.text("connections") != "1" || p.text("asymmetric") == "true" {
            return Err("iscsi-perf (libiscsi) uses one connection and no asymmetric mode".into());
        }
        if p.num("bs")
            .is_some_and(|k| !((k * 1024.0) as u64).is_multiple_of(512))
        {
            return Err(
                "iscsi-perf reads whole 512-byte blocks: bs must be a multiple of 512".into(),
            );
        }
    }
    if p.text("client") == "nbd-fio" && p.params.get("bs_auto").is_some() {
        return Err("bs_auto is mcsi bench's: the nbd-fio client reads fixed sizes (bs)".into());
    }
    if p.params.get("bs_auto").is_some() {
        if p.text("rw") != "read" {
            return Err("bs_auto sizes sequential reads: use it with rw = \"read\"".into());
        }
        if p.text("target") == "tgt" || p.text("client") == "iscsi-perf" {
            return Err("bs_auto needs mcsi's target (its TCP reports) and mcsi bench".into());
        }
    }
    if p.params.get("bs_max").is_some() && p.params.get("bs_auto").is_none() {
        return Err("bs_max bounds the sizes bs_auto chooses: set bs_auto too (or use bs)".into());
    }
    if p.params.get("cc").is_some() {
        if p.text("target") == "tgt" || p.text("client") == "iscsi-perf" {
            return Err("cc sets the congestion control per socket, which only mcsi's target and bench do; for the standard stack, initiator_cc sets the initiator namespace's".into());
        }
        if p.params.get("initiator_cc").is_some() {
            return Err("set cc (every socket of the session, both sides) or initiator_cc (the initiator's namespace), not both".into());
        }
        if p.params.get("target_cc").is_some() {
            return Err("set cc (every socket of the session, both sides) or target_cc (the target side's route), not both".into());
        }
    }
    if p.params.get("volume").is_some() {
        if p.text("target") != "mcsi" || p.text("client") != "mcsi-bench" || sessions(p) > 1 {
            return Err("volume runs mcsi bench over LUNs of mcsi's target, one session each: use target = \"mcsi\", client = \"mcsi-bench\" and no sessions".into());
        }
        if p.params.get("bs_auto").is_some() {
            return Err("bs_auto follows one session: give a volume a fixed bs".into());
        }
        if p.params.get("chunk").is_some() && p.text("volume") != "stripe" {
            return Err("chunk is a stripe's: set volume = \"stripe\"".into());
        }
    } else if p.params.get("members").is_some() || p.params.get("chunk").is_some() {
        return Err(
            "members and chunk shape a volume: set volume = \"stripe\" or \"mirror\"".into(),
        );
    }
    if p.params.get("routes").is_some() {
        if p.text("path_by") != "source" || p.params.get("paths").is_none() {
            return Err("routes binds the connections to the link's path addresses: set paths and path_by = \"source\"".into());
        }
        if p.text("client") != "mcsi-bench" || sessions(p) > 1 {
            return Err(
                "routes is for mcsi bench (one session): use client = \"mcsi-bench\"".into(),
            );
        }
        let n = p.text("paths").split(';').count();
        if p.num("routes").is_some_and(|r| r as usize > n) {
            return Err(format!(
                "routes {} is more than the {n} paths",
                p.text("routes")
            ));
        }
    }
    if mptcp(p) {
        if p.text("path_by") != "source" || p.params.get("paths").is_none() {
            return Err(
                "mptcp opens a subflow from each path address: set paths and path_by = \"source\""
                    .into(),
            );
        }
        if p.text("client") == "nbd-fio" {
            return Err("mptcp is for mcsi bench and iscsi-perf clients".into());
        }
    }
    let rates = qos_rates(p)?;
    if p.params.get("qos_at").is_some() && rates.is_none() {
        return Err("qos_at says where an allocation is enforced: set qos_alloc to naive, prot or prot-rt (and qos_q)".into());
    }
    if p.params.get("storage_share").is_some() && qos_requirement(p).is_none() {
        return Err("storage_share is a share of a requirement's response time: set qos_q".into());
    }
    if rates.is_some() {
        let (link, target) = qos_at(p);
        if target && p.text("target") != "mcsi" {
            return Err(
                "only mcsi's target enforces an allocation (--qos): use qos_at = \"link\" with tgt"
                    .into(),
            );
        }
        if link && p.params.get("rate").is_none() {
            return Err("a reservation is a share of the bottleneck: set rate".into());
        }
    }
    if p.params.get("path_by").is_some() && p.params.get("paths").is_none() {
        return Err("path_by says how connections find their path: set paths too".into());
    }
    if sessions(p) > 1 && (p.text("target") != "mcsi" || p.text("client") != "mcsi-bench") {
        return Err("sessions runs several mcsi bench against mcsi's target, one LUN each: use target = \"mcsi\" and client = \"mcsi-bench\"".into());
    }
    if p.text("target") == "tgt" {
        ram_size(p)?;
        if p.text("connections") != "1" {
            return Err("tgt offers one connection per session (MaxConnections=1)".into());
        }
    }
    Ok(())
}

pub(crate) fn ram_size(p: &Point) -> Result<u64, String> {
    p.text("lun")
        .strip_prefix("ram:")
        .and_then(|s| mcsi_units::parse_size(s).ok())
        .ok_or_else(|| {
            format!(
                "target tgt needs lun = \"ram:SIZE\", not '{}'",
                p.text("lun")
            )
        })
}

/// The parameter names, in CSV order.
pub fn param_columns() -> Vec<&'static str> {
    params::DEFS.iter().map(|d| d.name).collect()
}
