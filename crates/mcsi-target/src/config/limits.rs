//! Per-target limits (`[limits]` and a target's own keys: negotiation, budgets, timers, the
//! response policy) and server-wide ones, with their defaults and checks. The protocol's
//! defaults are the session core's ([`TargetOffer`]).

use super::error::{cerr, ConfigError, ValueError};
use super::file::{FileLimits, FileTarget, SizeValue};
use super::qos::{target_qos, QosSpec};
use mcsi_proto::keys::LocalParams;
use mcsi_target_core::offer::TargetOffer;
use mcsi_tcp::Congestion;
use std::time::Duration;

/// How the target chooses each task's response connection in the asymmetric mode: the
/// initiator's policies ([`mcsi_tcp::sched`]) over the session's response connections in CID
/// order. Kept `Copy` (the weights in a fixed array) so that [`Limits`] stays a plain value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResponsePolicy {
    /// The thesis's (4.3.3): each task on the next response connection in turn.
    #[default]
    RoundRobin,
    LeastOutstanding,
    TcpAware,
    /// Weights per response connection in CID order; connections beyond `n` weigh 1.
    Weighted {
        weights: [u16; ResponsePolicy::MAX_WEIGHTS],
        n: u8,
    },
    Failover,
}

impl ResponsePolicy {
    pub const MAX_WEIGHTS: usize = 16;

    /// A policy name as `--policy` takes it (`weighted:3,1` with its weights).
    pub fn parse(name: &str) -> Result<ResponsePolicy, ValueError> {
        let p = mcsi_tcp::sched::policy(name)?;
        Ok(match p.name() {
            "round-robin" => ResponsePolicy::RoundRobin,
            "least-outstanding" => ResponsePolicy::LeastOutstanding,
            "tcp-aware" => ResponsePolicy::TcpAware,
            "failover" => ResponsePolicy::Failover,
            _ => {
                let list = name.strip_prefix("weighted:").unwrap_or("");
                let ws: Vec<u16> = list
                    .split(',')
                    .filter_map(|w| w.trim().parse().ok())
                    .collect();
                if ws.len() > Self::MAX_WEIGHTS {
                    return Err(ValueError::TooManyWeights {
                        name: name.into(),
                        max: Self::MAX_WEIGHTS,
                    });
                }
                let mut weights = [1u16; Self::MAX_WEIGHTS];
                weights[..ws.len()].copy_from_slice(&ws);
                ResponsePolicy::Weighted {
                    weights,
                    n: ws.len() as u8,
                }
            }
        })
    }

    /// The scheduler for one session; None for round-robin, which the session does itself
    /// without looking at the connections' load.
    pub fn scheduler(&self) -> Option<Box<dyn mcsi_tcp::sched::Scheduler>> {
        use mcsi_tcp::sched::{Failover, LeastOutstanding, TcpAware, Weighted};
        match *self {
            ResponsePolicy::RoundRobin => None,
            ResponsePolicy::LeastOutstanding => Some(Box::new(LeastOutstanding::default())),
            ResponsePolicy::TcpAware => Some(Box::new(TcpAware::default())),
            ResponsePolicy::Failover => Some(Box::new(Failover)),
            ResponsePolicy::Weighted { weights, n } => Some(Box::new(Weighted::new(
                weights[..usize::from(n)]
                    .iter()
                    .map(|&w| u32::from(w))
                    .collect(),
            ))),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            ResponsePolicy::RoundRobin => "round-robin",
            ResponsePolicy::LeastOutstanding => "least-outstanding",
            ResponsePolicy::TcpAware => "tcp-aware",
            ResponsePolicy::Weighted { .. } => "weighted",
            ResponsePolicy::Failover => "failover",
        }
    }
}

/// A congestion-control name the kernel accepts for this process's sockets.
pub fn congestion(name: &str) -> Result<Congestion, mcsi_tcp::CongestionError> {
    let cc = Congestion::new(name)?;
    cc.check()?;
    Ok(cc)
}

/// Limits of one target: what it offers and accepts at login (RFC 7143 section 13) and the
/// budgets, timers and policies of its sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// What the target offers at login and its protocol timers (negotiation limits, queue
    /// depth, keepalive, asymmetric mode, highest ErrorRecoveryLevel): the session core's type,
    /// with its defaults.
    pub offer: TargetOffer,
    /// Sessions of this target at once; a leading login beyond it is refused with 3/02 (out of
    /// resources).
    pub max_sessions: u32,
    /// Connections to this target at once, over all its sessions; a connection beyond it is
    /// refused with 2/06 (too many connections), a new session with 3/02.
    pub max_target_connections: u32,
    /// TCP congestion control set on each of the target's connections once its login names the
    /// target; None leaves the system default.
    pub congestion: Option<Congestion>,
    /// How each task's response connection is chosen in the asymmetric mode.
    pub response_policy: ResponsePolicy,
    /// Bytes a connection may have queued for sending (Data-In, NOP-In echoes, R2Ts, responses,
    /// rejects) before its reader stops taking requests until the writer has sent some
    /// (the connection's output queue).
    pub output_budget: u64,
    /// A connection whose socket takes no byte for this long is dropped (a peer that does not
    /// read); zero turns the check off.
    pub send_timeout: Duration,
    /// Bytes of READ data a session's tasks may hold at once, from the backend filling them
    /// until their Data-In is queued on a connection below its output budget
    /// (a semaphore of KiB per session).
    pub read_budget: u64,
    /// Bytes of WRITE data a session's solicited writes may hold at once: a write takes its
    /// whole length from it (and from the server's `write_budget`) before its first R2T, and
    /// gives it back when it ends (a semaphore of KiB per session).
    pub write_budget: u64,
    /// A write that has asked for its data (its R2Ts went out) and receives no Data-Out for
    /// this long ends its connection (at ErrorRecoveryLevel 0, the session); zero turns the
    /// check off.
    pub data_out_timeout: Duration,
    /// TARGET COLD RESET is honoured (it ends every session of the target, other initiators'
    /// too); otherwise it is answered "function authorization failed" (RFC 7143 11.6.1).
    pub allow_cold_reset: bool,
    /// Each session's bandwidth per direction (seed 004); None: not limited.
    pub qos: Option<QosSpec>,
    /// The capacity each way (bytes per second) the sessions' QoS rates are admitted against;
    /// a leading login whose rates do not fit is refused 3/02. None: no admission control.
    pub qos_capacity: Option<u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // The protocol's defaults are the core's, which the simulator starts from too.
            offer: TargetOffer::default(),
            max_sessions: 256,
            max_target_connections: 1024,
            congestion: None,
            response_policy: ResponsePolicy::RoundRobin,
            // Twice the largest burst the target sends by default (MaxBurstLength 1 MiB) several
            // times over: enough to keep a long fat link busy, small enough that 1000
            // connections stay within 8 GiB.
            output_budget: 8 << 20,
            send_timeout: Duration::from_secs(30),
            // 64 reads of 1 MiB in flight per session.
            read_budget: 64 << 20,
            // 64 writes of 1 MiB, or 8 of the largest a LUN takes (8 MiB), per session.
            write_budget: 64 << 20,
            // Longer than a NOP-In ping's interval and answer together on a healthy link, so
            // that only an initiator that has stopped sending is cut off.
            data_out_timeout: Duration::from_secs(60),
            // One initiator must not end every other's sessions unless the operator says so.
            allow_cold_reset: false,
            qos: None,
            qos_capacity: None,
        }
    }
}

/// Server-wide limits (`[limits]`): they apply before a login names its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// New connections per second from one source (an IPv4 address or an IPv6 /64); every
    /// connection is a login attempt. 0 turns the limit off.
    pub login_rate: u32,
    /// Connections a source may open in a row before the rate applies (the bucket's depth).
    pub login_burst: u32,
    /// A connection not in full feature phase this long after it was accepted is dropped.
    pub login_timeout: Duration,
    /// TCP connections the server holds at once, logging in or logged in; beyond it new
    /// connections are closed as soon as they are accepted.
    pub max_server_connections: u32,
    /// Connections from one source (as for `login_rate`) not yet in full feature phase; one
    /// more makes the source's oldest login be dropped. Without it a source could hold about
    /// login_rate x login_timeout + login_burst connections in the login phase. 0 turns it off.
    pub max_logins_per_source: u32,
    /// Bytes of solicited WRITE data all sessions together may hold at once (each write takes
    /// its length from its session's `write_budget` and from this one before its first R2T).
    pub write_budget: u64,
    /// Bytes of READ data all sessions together may hold at once (each read takes its length
    /// from its session's `read_budget` and from this one before the backend reads, and gives
    /// it back once its Data-In is queued on a connection below its output budget, or its
    /// connection is gone).
    pub read_budget: u64,
    /// Bytes of unsolicited WRITE data all sessions together may hold at once: a command that
    /// brings immediate data or announces an unsolicited burst and cannot run at once takes
    /// what it may send unasked (at most FirstBurstLength) from it when it arrives. A command
    /// that finds no room keeps nothing, takes the rest of its burst and drops it, and is
    /// answered TASK SET FULL, which initiators retry.
    pub unsolicited_budget: u64,
    /// Bytes of answers all sessions together keep for reassignment (ErrorRecoveryLevel 2): a
    /// task that ends after its connection failed keeps its Data-In and status for TASK
    /// REASSIGN until DefaultTime2Retain runs out. One that finds no room keeps nothing: it is
    /// recovered as at level 0 (TASK REASSIGN finds no task, and the initiator issues it
    /// again).
    pub retention_budget: u64,
    /// Bytes all connections' sent-PDU logs together keep (ErrorRecoveryLevel 1 and up: for
    /// SNACK, and at level 2 for reassigning what a failed connection had sent). Each log is
    /// also held to 16 MiB of its own. Past the cap, a log that records lets its own oldest
    /// entries go (a SNACK for them is rejected), and a failed connection's log is not kept.
    pub sent_log_budget: u64,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            // An initiator logs in once per connection; libiscsi's whole conformance suite
            // opens at most about 40 connections in any one second.
            login_rate: 20,
            login_burst: 40,
            login_timeout: Duration::from_secs(30),
            max_server_connections: 4096,
            // Far above what an initiator host needs (one per connection being opened, for
            // every session it starts at once), far below the 640 the rate alone allows.
            max_logins_per_source: 64,
            // Two sessions at their own budget; 16 writes of the largest size in flight.
            write_budget: 128 << 20,
            // Two sessions at their own budget.
            read_budget: 128 << 20,
            // Two sessions with a full window of first bursts at the defaults (128 x 256 KiB).
            unsolicited_budget: 64 << 20,
            // A window of 32 reads of 4 MiB, kept for a failed connection's reassignment.
            retention_budget: 128 << 20,
            // Eight connections' logs at their own bound (16 MiB each).
            sent_log_budget: 128 << 20,
        }
    }
}

impl ServerLimits {
    /// Validates a file's `[limits]` table.
    pub fn from_file(f: &FileLimits) -> Result<Self, ConfigError> {
        let d = ServerLimits::default();
        let l = ServerLimits {
            login_rate: f.login_rate.unwrap_or(d.login_rate),
            login_burst: f.login_burst.unwrap_or(d.login_burst),
            login_timeout: duration(&f.login_timeout, "limits.login_timeout", d.login_timeout)?,
            max_server_connections: f.max_server_connections.unwrap_or(d.max_server_connections),
            max_logins_per_source: f.max_logins_per_source.unwrap_or(d.max_logins_per_source),
            write_budget: budget(
                &f.write_budget,
                "limits.write_budget",
                WRITE_BUDGET_MIN,
                d.write_budget,
            )?,
            read_budget: budget(
                &f.read_budget,
                "limits.read_budget",
                READ_BUDGET_MIN,
                d.read_budget,
            )?,
            unsolicited_budget: budget(
                &f.unsolicited_budget,
                "limits.unsolicited_budget",
                WRITE_BUDGET_MIN,
                d.unsolicited_budget,
            )?,
            retention_budget: budget(
                &f.retention_budget,
                "limits.retention_budget",
                WRITE_BUDGET_MIN,
                d.retention_budget,
            )?,
            sent_log_budget: budget(
                &f.sent_log_budget,
                "limits.sent_log_budget",
                WRITE_BUDGET_MIN,
                d.sent_log_budget,
            )?,
        };
        if l.login_rate > 0 && l.login_burst == 0 {
            return Err(cerr(
                "limits.login_burst",
                "must be at least 1 (use login_rate = 0 to turn the limit off)",
            ));
        }
        if l.login_timeout.is_zero() {
            return Err(cerr("limits.login_timeout", "must be above zero"));
        }
        if l.max_server_connections == 0 {
            return Err(cerr("limits.max_server_connections", "must be at least 1"));
        }
        Ok(l)
    }
}

impl Limits {
    /// What the target offers and accepts in a login (RFC 7143 section 13): see
    /// [`TargetOffer::local_params`].
    pub fn local_params(&self) -> LocalParams {
        self.offer.local_params()
    }
}

pub(super) fn limits_from(
    t: &FileTarget,
    at: &dyn Fn(&str) -> String,
) -> Result<Limits, ConfigError> {
    let d = Limits::default();
    // Ranges from RFC 7143 section 13.
    const SEG_MAX: u64 = (1 << 24) - 1;
    let size = |v: &Option<SizeValue>, f: &str, def: u32| -> Result<u32, ConfigError> {
        let Some(v) = v else { return Ok(def) };
        let b = v.bytes(&at(f))?;
        if !(512..=SEG_MAX).contains(&b) {
            return Err(cerr(
                at(f),
                format!("{b} is out of range (512 to {SEG_MAX} bytes)"),
            ));
        }
        Ok(b as u32)
    };
    let max_connections = match t.max_connections {
        None => d.offer.max_connections,
        Some(n) if (1..=65535).contains(&n) => n as u16,
        Some(n) => {
            return Err(cerr(
                at("max_connections"),
                format!("{n} is out of range (1 to 65535)"),
            ))
        }
    };
    let max_outstanding_r2t = match t.max_outstanding_r2t {
        None => d.offer.max_outstanding_r2t,
        Some(n) if (1..=65535).contains(&n) => n as u16,
        Some(n) => {
            return Err(cerr(
                at("max_outstanding_r2t"),
                format!("{n} is out of range (1 to 65535)"),
            ))
        }
    };
    let max_sessions = match t.max_sessions {
        None => d.max_sessions,
        // A session needs a TSIH, a 16-bit number other than 0 (RFC 7143 11.12.6).
        Some(n) if (1..=65535).contains(&n) => n,
        Some(n) => {
            return Err(cerr(
                at("max_sessions"),
                format!("{n} is out of range (1 to 65535)"),
            ))
        }
    };
    let max_target_connections = match t.max_target_connections {
        None => d.max_target_connections,
        Some(0) => return Err(cerr(at("max_target_connections"), "must be at least 1")),
        Some(n) => n,
    };
    let max_erl = match t.max_erl {
        None => d.offer.max_erl,
        Some(n @ 0..=2) => n as u8,
        Some(n) => {
            return Err(cerr(
                at("max_erl"),
                format!("{n} is out of range (RFC 7143 defines levels 0 to 2)"),
            ))
        }
    };
    let queue_depth = match t.queue_depth {
        None => d.offer.queue_depth,
        Some(n) if (1..=65536).contains(&n) => n,
        Some(n) => {
            return Err(cerr(
                at("queue_depth"),
                format!("{n} is out of range (1 to 65536)"),
            ))
        }
    };
    let l = Limits {
        offer: TargetOffer {
            max_connections,
            max_recv_data_segment_length: size(
                &t.max_recv_data_segment_length,
                "max_recv_data_segment_length",
                d.offer.max_recv_data_segment_length,
            )?,
            max_burst_length: size(
                &t.max_burst_length,
                "max_burst_length",
                d.offer.max_burst_length,
            )?,
            first_burst_length: size(
                &t.first_burst_length,
                "first_burst_length",
                d.offer.first_burst_length,
            )?,
            max_outstanding_r2t,
            initial_r2t: t.initial_r2t.unwrap_or(d.offer.initial_r2t),
            immediate_data: t.immediate_data.unwrap_or(d.offer.immediate_data),
            queue_depth,
            nop_interval: duration(&t.nop_interval, &at("nop_interval"), d.offer.nop_interval)?,
            nop_timeout: duration(&t.nop_timeout, &at("nop_timeout"), d.offer.nop_timeout)?,
            asymmetric: t.asymmetric.unwrap_or(d.offer.asymmetric),
            max_erl,
        },
        max_sessions,
        max_target_connections,
        congestion: match &t.congestion {
            None => d.congestion,
            Some(name) => {
                Some(congestion(name).map_err(|e| cerr(at("congestion"), e.to_string()))?)
            }
        },
        output_budget: budget(
            &t.output_budget,
            &at("output_budget"),
            OUTPUT_BUDGET_MIN,
            d.output_budget,
        )?,
        send_timeout: duration(&t.send_timeout, &at("send_timeout"), d.send_timeout)?,
        read_budget: budget(
            &t.read_budget,
            &at("read_budget"),
            READ_BUDGET_MIN,
            d.read_budget,
        )?,
        write_budget: budget(
            &t.write_budget,
            &at("write_budget"),
            WRITE_BUDGET_MIN,
            d.write_budget,
        )?,
        data_out_timeout: duration(
            &t.data_out_timeout,
            &at("data_out_timeout"),
            d.data_out_timeout,
        )?,
        allow_cold_reset: t.allow_cold_reset.unwrap_or(d.allow_cold_reset),
        qos: match &t.qos {
            None => d.qos,
            Some(q) => target_qos(q, &at("qos"))?.0,
        },
        qos_capacity: match t.qos.as_ref().and_then(|q| q.capacity.as_ref()) {
            None => d.qos_capacity,
            Some(v) => Some(v.bytes(&at("qos.capacity"))?).filter(|&c| c > 0),
        },
        response_policy: match &t.response_policy {
            None => d.response_policy,
            Some(name) => {
                ResponsePolicy::parse(name).map_err(|e| cerr(at("response_policy"), e))?
            }
        },
    };
    if l.offer.nop_timeout.is_zero() {
        return Err(cerr(
            at("nop_timeout"),
            "must be above zero (use nop_interval = \"0\" to turn the keepalive off)",
        ));
    }
    if l.offer.first_burst_length > l.offer.max_burst_length {
        return Err(cerr(
            at("first_burst_length"),
            format!(
                "{} exceeds max_burst_length {} (FirstBurstLength <= MaxBurstLength, RFC 7143 13.14)",
                l.offer.first_burst_length, l.offer.max_burst_length
            ),
        ));
    }
    Ok(l)
}

/// The smallest `output_budget`: a few PDUs.
pub const OUTPUT_BUDGET_MIN: u64 = 64 << 10;

/// The smallest `read_budget`.
pub const READ_BUDGET_MIN: u64 = 1 << 20;

/// The smallest `write_budget` (per session or server-wide).
pub const WRITE_BUDGET_MIN: u64 = 1 << 20;

/// A byte budget (`output_budget`, `read_budget`) from `min` to 1 TiB, or `def` when unset.
pub fn budget(v: &Option<SizeValue>, field: &str, min: u64, def: u64) -> Result<u64, ConfigError> {
    let Some(v) = v else { return Ok(def) };
    match v.bytes(field)? {
        n if (min..=1 << 40).contains(&n) => Ok(n),
        n => Err(cerr(
            field,
            format!(
                "{n} bytes is out of range ({} to 1 TiB)",
                mcsi_units::Bytes(min as f64)
            ),
        )),
    }
}

/// A duration field: "30s", "500ms" (a number needs its unit; "0" alone is zero); at most one day.
pub fn duration(v: &Option<String>, field: &str, def: Duration) -> Result<Duration, ConfigError> {
    let Some(v) = v else { return Ok(def) };
    let d = mcsi_units::parse_duration(v, mcsi_units::BareUnit::Refuse)
        .map_err(|e| cerr(field, e.to_string()))?;
    if d > Duration::from_secs(86_400) {
        return Err(cerr(field, format!("'{v}' is too long (at most 1 day)")));
    }
    Ok(d)
}
