//! One module per subcommand. Each exposes its clap arguments and a `run` function.

pub mod bench;
pub mod copy;
pub mod ctl;
pub mod generate;
pub mod http;
pub mod lab;
pub mod link;
pub mod model;
pub mod monitor;
pub mod nbd;
pub mod observe;
pub mod sim;
pub mod target;
pub mod volume;

/// The runtime of an initiator command with `--threads N`: one thread runs everything on the
/// calling thread (like one fio job); more use a multi-threaded runtime.
pub fn runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(match threads {
        0 => anyhow::bail!("--threads must be at least 1"),
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build()?,
    })
}

/// `--congestion NAME`: checked against the kernel when the tool starts, so that a name it does
/// not offer is reported at once, with the names it does.
pub fn congestion_arg(name: Option<&str>) -> anyhow::Result<Option<mcsi_initiator::Congestion>> {
    let Some(name) = name else { return Ok(None) };
    let cc =
        mcsi_initiator::Congestion::new(name).map_err(|e| anyhow::anyhow!("--congestion: {e}"))?;
    cc.check()
        .map_err(|e| anyhow::anyhow!("--congestion: {e}"))?;
    Ok(Some(cc))
}

/// `--bs-rule`, `--bs-min`, `--bs-max`: how `--bs auto` sizes sequential reads (`mcsi bench`,
/// `mcsi copy`).
#[derive(clap::Args, Debug, Clone)]
pub struct BsAutoArgs {
    /// With --bs auto: `bdp` (the session's measured bandwidth-delay product spread over the
    /// reads outstanding, doubling while the target runs out of data to send) or `cwnd` (seed
    /// 002: the target's cwnd x MSS, lowered on a reduction, held at the ceiling while stable).
    #[arg(long, default_value = "bdp", value_name = "RULE")]
    pub bs_rule: String,
    /// With --bs auto: the smallest and largest size.
    #[arg(long, default_value = "64KiB", value_name = "SIZE")]
    pub bs_min: String,
    #[arg(long, default_value = "8MiB", value_name = "SIZE")]
    pub bs_max: String,
}

impl BsAutoArgs {
    /// The rule and the bounds, checked.
    pub fn parse(&self) -> anyhow::Result<(mcsi_initiator::iosize::Rule, u64, u64)> {
        let rule = mcsi_initiator::iosize::Rule::parse(&self.bs_rule)
            .ok_or_else(|| anyhow::anyhow!("--bs-rule {}: use bdp or cwnd", self.bs_rule))?;
        let min =
            mcsi_units::parse_size(&self.bs_min).map_err(|e| anyhow::anyhow!("--bs-min: {e}"))?;
        let max =
            mcsi_units::parse_size(&self.bs_max).map_err(|e| anyhow::anyhow!("--bs-max: {e}"))?;
        if min == 0 || max < min || max > 16 << 20 {
            anyhow::bail!("--bs-min {min} and --bs-max {max}: need 0 < min <= max <= 16MiB");
        }
        Ok((rule, min, max))
    }
}

/// How an initiator command opens its sessions: connections, scheduler, congestion control,
/// asymmetric mode, digests, initiator name, routes (`mcsi bench`, `mcsi copy`, `mcsi nbd`).
/// Each can also come from a TOML session profile (`--session-profile`); an option given on
/// the command line wins over the profile's.
#[derive(clap::Args, Debug, Clone)]
pub struct SessionArgs {
    /// TCP connections per iSCSI session (the target's MaxConnections may lower it) [default: 1].
    #[arg(long)]
    pub connections: Option<u16>,
    /// Connection scheduler: round-robin, least-outstanding, tcp-aware (earliest expected
    /// completion from each connection's measured rate and RTT), weighted:W1,W2,... (static
    /// weights per connection) or failover (one active connection, the others standby)
    /// [default: round-robin].
    #[arg(long)]
    pub policy: Option<String>,
    /// Ask an mcsi target to report the TCP state of its sending side of each connection (the
    /// one that carries reads); on by itself with --policy tcp-aware (and with `mcsi bench
    /// --metrics` or `--bs auto`).
    #[arg(long)]
    pub target_tcp: bool,
    /// TCP congestion control of every connection of the session (for example cubic, reno,
    /// bbr; default: the system's). An algorithm the kernel does not offer is an error that
    /// lists the ones it does.
    #[arg(long, value_name = "NAME")]
    pub congestion: Option<String>,
    /// Ask for the asymmetric mode (mcsi targets only): commands on the first half of the
    /// connections, R2T, Data-In and status on the other half. Needs --connections 2 or more.
    #[arg(long)]
    pub asymmetric: bool,
    /// Offer CRC32C header and data digests on every connection (the target may still answer
    /// None).
    #[arg(long)]
    pub digests: bool,
    /// The highest ErrorRecoveryLevel to offer: 0; 1 (a PDU lost to a data digest error is
    /// asked for again with a SNACK instead of ending the session; it matters with
    /// --digests); or 2 (the tasks of a connection that fails move to the others of the session
    /// with TASK REASSIGN instead of the whole session being logged in again; offered only
    /// with --connections 2 or more and without --asymmetric). The target's answer decides
    /// below it [default: 2].
    #[arg(long, value_name = "N")]
    pub max_erl: Option<u8>,
    /// iSCSI initiator name (default: the host's, from /etc/iscsi/initiatorname.iscsi as
    /// open-iscsi keeps it, else iqn.2026-01.org.mcsi:<hostname>).
    #[arg(long)]
    pub initiator_name: Option<String>,
    /// Source of the connections: an address of this host, or an interface (SO_BINDTODEVICE).
    /// Repeatable: connection i leaves from bind i mod n, so `--bind wlan0 --bind wwan0
    /// --connections 2` puts the session on two routes.
    #[arg(long, value_name = "ADDR|IFACE")]
    pub bind: Vec<String>,
    /// Target portal for the connections, HOST:PORT of the same target (one portal group).
    /// Repeatable: connection i goes to portal i mod n; default: the URL's.
    #[arg(long, value_name = "HOST:PORT")]
    pub portal: Vec<String>,
    /// A connection with work outstanding that receives nothing for this long (a ping goes
    /// out at half of it) is taken out of the session and its tasks are issued on the other
    /// connections; its route is retried until it rejoins. 0 turns it off (a stalled
    /// connection then waits for the 30 s response timeout and session recovery) [default: 4s].
    #[arg(long, value_name = "DURATION")]
    pub stall_timeout: Option<String>,
    /// Open every connection with Multipath TCP: the kernel's path manager adds subflows over
    /// the routes it knows (`ip mptcp endpoint`); a target without MPTCP gets plain TCP. Needs
    /// Linux 5.6 or later with net.mptcp.enabled = 1.
    #[arg(long)]
    pub mptcp: bool,
    /// Ask the URL's portal (SendTargets) for the target's portals and spread the connections
    /// over those of its portal group, connection i on portal i mod n (instead of --portal).
    #[arg(long, conflicts_with = "portal")]
    pub discover_portals: bool,
    /// Shape what the session sends, over all its connections, as `mcsi target --qos` does
    /// toward storage: `to_storage=RATE[,burst=SIZE]` (bytes per second on the wire, PDUs
    /// plus TCP/IP and Ethernet headers per segment; burst default: 10 ms at the rate, at
    /// least 64 KiB), or a requirement `read_ratio=F,iops=N,size=SIZE,rt=DURATION[,alpha=A]`
    /// (alpha 0.2 unless given, as on the target) whose bandwidth toward storage seed 004's
    /// eq. 9 gives (1500-byte frames, FirstBurstLength
    /// 64 KiB), the burst its largest request. Commands and data wait in the session until the
    /// bucket allows them. What the target sends is the target's to shape.
    #[arg(long, value_name = "SPEC")]
    pub qos: Option<String>,
    /// A TOML file with any of the options above under their own names, with `_` for `-`
    /// (connections = 2, policy = "tcp-aware", bind = ["wlan0", "wwan0"], stall_timeout =
    /// "2s", mptcp = false, ...): the session's shape kept in one place.
    #[arg(long, value_name = "FILE")]
    pub session_profile: Option<std::path::PathBuf>,
}

/// `--qos SPEC` of an initiator: (bytes per second, burst bytes) of what the session sends.
/// The spec is the target's (`mcsi target --qos`, [`mcsi_target::config::parse_qos_arg`]),
/// of which an initiator takes what concerns its own sending.
pub(crate) fn send_limit(spec: &str) -> anyhow::Result<(u64, u64)> {
    use mcsi_target::config::QosSpec;
    let bad = |why: &str| anyhow::anyhow!("--qos {spec}: {why}");
    let (q, capacity) = mcsi_target::config::parse_qos_arg("--qos", spec).map_err(|e| {
        anyhow::anyhow!("{e} (on an initiator: give to_storage=RATE, a rate above 0, with an optional burst=SIZE, or a requirement)")
    })?;
    if capacity.is_some() {
        return Err(bad(
            "capacity is a target's (admission); mcsi target --qos takes it",
        ));
    }
    match q {
        QosSpec::Rates {
            to_client: Some(_), ..
        } => Err(bad(
            "the initiator shapes what it sends (to_storage); what the target sends is shaped by mcsi target --qos",
        )),
        QosSpec::Rates {
            to_storage: Some(rate),
            burst,
            ..
        } => Ok((rate, burst.unwrap_or((rate / 100).max(64 << 10)).max(1))),
        QosSpec::Rates { .. } => Err(bad(
            "give to_storage=RATE (bytes per second), or a requirement",
        )),
        QosSpec::Requirement(req) => {
            // Eq. 9 toward storage with the paper's framing; bursts of the largest request
            // toward storage of the kinds that occur.
            let framing = mcsi_model::qos::Framing::default();
            let r = mcsi_model::qos::bandwidth(&req, &framing).map_err(|e| bad(&e.to_string()))?;
            let reads = if req.read_ratio > 0.0 {
                framing.read_c2s(req.size_bytes)
            } else {
                0
            };
            let writes = if req.read_ratio < 1.0 {
                framing.write_c2s(req.size_bytes)
            } else {
                0
            };
            Ok((r.c_to_s.bandwidth.ceil() as u64, reads.max(writes).max(1)))
        }
    }
}

/// A session profile (`--session-profile`): the same options as the command line.
#[derive(serde::Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct SessionProfile {
    connections: Option<u16>,
    policy: Option<String>,
    #[serde(default)]
    target_tcp: bool,
    congestion: Option<String>,
    #[serde(default)]
    asymmetric: bool,
    #[serde(default)]
    digests: bool,
    max_erl: Option<u8>,
    initiator_name: Option<String>,
    #[serde(default)]
    bind: Vec<String>,
    #[serde(default)]
    portal: Vec<String>,
    stall_timeout: Option<String>,
    #[serde(default)]
    mptcp: bool,
    #[serde(default)]
    discover_portals: bool,
    qos: Option<String>,
}

impl SessionArgs {
    /// These options with `over`'s on top (a volume member's own options over the command
    /// line's).
    pub(crate) fn under(&self, over: SessionProfile) -> anyhow::Result<SessionArgs> {
        let base = self.merged()?;
        let list = |mine: Vec<String>, base: &Vec<String>| {
            if mine.is_empty() {
                base.clone()
            } else {
                mine
            }
        };
        Ok(SessionArgs {
            connections: over.connections.or(base.connections),
            policy: over.policy.or(base.policy.clone()),
            target_tcp: over.target_tcp || base.target_tcp,
            congestion: over.congestion.or(base.congestion.clone()),
            asymmetric: over.asymmetric || base.asymmetric,
            digests: over.digests || base.digests,
            max_erl: over.max_erl.or(base.max_erl),
            initiator_name: over.initiator_name.or(base.initiator_name.clone()),
            bind: list(over.bind, &base.bind),
            portal: list(over.portal, &base.portal),
            stall_timeout: over.stall_timeout.or(base.stall_timeout.clone()),
            mptcp: over.mptcp || base.mptcp,
            discover_portals: over.discover_portals || base.discover_portals,
            qos: over.qos.or(base.qos.clone()),
            session_profile: None,
        })
    }

    /// The command line over the profile, if any: what the session is opened with.
    fn merged(&self) -> anyhow::Result<SessionArgs> {
        let Some(path) = &self.session_profile else {
            return Ok(self.clone());
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("--session-profile {}: {e}", path.display()))?;
        let f: SessionProfile = toml::from_str(&text)
            .map_err(|e| anyhow::anyhow!("--session-profile {}: {e}", path.display()))?;
        let list = |cli: &Vec<String>, file: Vec<String>| {
            if cli.is_empty() {
                file
            } else {
                cli.clone()
            }
        };
        Ok(SessionArgs {
            connections: self.connections.or(f.connections),
            policy: self.policy.clone().or(f.policy),
            target_tcp: self.target_tcp || f.target_tcp,
            congestion: self.congestion.clone().or(f.congestion),
            asymmetric: self.asymmetric || f.asymmetric,
            digests: self.digests || f.digests,
            max_erl: self.max_erl.or(f.max_erl),
            initiator_name: self.initiator_name.clone().or(f.initiator_name),
            bind: list(&self.bind, f.bind),
            portal: list(&self.portal, f.portal),
            stall_timeout: self.stall_timeout.clone().or(f.stall_timeout),
            mptcp: self.mptcp || f.mptcp,
            discover_portals: self.discover_portals || f.discover_portals,
            qos: self.qos.clone().or(f.qos),
            session_profile: None,
        })
    }

    /// The connect options, checked; `tcp_report`: ask for the target's TCP state regardless.
    pub fn options(&self, tcp_report: bool) -> anyhow::Result<mcsi_initiator::ConnectOptions> {
        let a = self.merged()?;
        let connections = a.connections.unwrap_or(1);
        let policy = a.policy.as_deref().unwrap_or("round-robin");
        if connections == 0 {
            anyhow::bail!("--connections must be at least 1");
        }
        if a.asymmetric && connections < 2 {
            anyhow::bail!(
                "--asymmetric needs --connections 2 or more (requests and responses each need one)"
            );
        }
        mcsi_initiator::sched::policy(policy).map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
        let max_erl = match a.max_erl {
            None => mcsi_initiator::ConnectOptions::default().max_erl,
            Some(n @ 0..=2) => n,
            Some(n) => anyhow::bail!("--max-erl {n}: RFC 7143 defines levels 0 to 2"),
        };
        let stall = a.stall_timeout.as_deref().unwrap_or("4s");
        let mut opts = mcsi_initiator::ConnectOptions {
            connections,
            policy: policy.to_string(),
            asymmetric: a.asymmetric,
            digests: a.digests,
            congestion: congestion_arg(a.congestion.as_deref())?,
            tcp_report: tcp_report || a.target_tcp || policy == "tcp-aware",
            stall_timeout: mcsi_units::parse_duration(stall, mcsi_units::BareUnit::Seconds)
                .map_err(|e| anyhow::anyhow!("--stall-timeout {stall}: {e}"))?,
            mptcp: a.mptcp,
            discover_portals: a.discover_portals,
            max_erl,
            send_limit: a.qos.as_deref().map(send_limit).transpose()?,
            ..mcsi_initiator::ConnectOptions::default()
        };
        if let Some(n) = &a.initiator_name {
            opts.initiator_name = n.clone();
        }
        for b in &a.bind {
            opts.binds.push(
                mcsi_initiator::Bind::parse(b).map_err(|e| anyhow::anyhow!("--bind {b}: {e}"))?,
            );
        }
        for p in &a.portal {
            opts.portals.push(
                mcsi_initiator::url::portal(p).map_err(|e| anyhow::anyhow!("--portal {p}: {e}"))?,
            );
        }
        Ok(opts)
    }
}

#[cfg(test)]
mod send_limit_tests {
    use super::send_limit;

    #[test]
    fn rates_and_requirements() {
        assert_eq!(send_limit("to_storage=1MiB").unwrap(), (1 << 20, 64 << 10));
        assert_eq!(
            send_limit("to_storage=100MiB,burst=4KiB").unwrap(),
            (100 << 20, 4096)
        );
        // Seed 004's Q4: 64 KiB writes at 208 IOPS within 22 ms need eq. 7's 15.67 MiB/s,
        // in bursts of one write (70,624 bytes on the wire).
        let (rate, burst) =
            send_limit("read_ratio=0,iops=208,size=64KiB,rt=22ms,alpha=0.1954").unwrap();
        assert!((rate as f64 / 1048576.0 - 15.668).abs() < 0.001, "{rate}");
        assert_eq!(burst, 70624);
        // Reads send commands only.
        assert_eq!(
            send_limit("read_ratio=1,iops=82,size=1KiB,rt=10ms")
                .unwrap()
                .1,
            106
        );
        for (spec, want) in [
            ("to_client=1MiB", "mcsi target --qos"),
            ("to_storage=0", "above 0"),
            ("iops=5", "needs read_ratio"),
            (
                "to_storage=1MiB,iops=5,read_ratio=1,size=4KiB,rt=5ms",
                "not both",
            ),
            ("speed=5", "unknown key"),
            ("burst=4KiB", "give to_storage"),
        ] {
            let e = send_limit(spec).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
    }
}
