//! A session's bandwidth per direction (seed 004): the `qos` grammar of the file and of
//! `--qos`, named requirements, and the rates each target's sessions get.

use super::error::{cerr, ConfigError};
use super::file::{FileQos, SizeValue};
use crate::name;

/// A target's per-session bandwidth, validated.
#[derive(Debug, Clone, Copy)]
pub enum QosSpec {
    /// Seed 004's requirement; the rates follow from it and the connection's MSS at login.
    Requirement(mcsi_model::qos::Requirement),
    /// Rates per direction in bytes per second (None: that direction is not limited) and the
    /// burst (None: the larger of 64 KiB and 10 ms of the rate).
    Rates {
        to_client: Option<u64>,
        to_storage: Option<u64>,
        burst: Option<u64>,
    },
}

impl PartialEq for QosSpec {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (QosSpec::Requirement(a), QosSpec::Requirement(b)) => {
                a.read_ratio.to_bits() == b.read_ratio.to_bits()
                    && a.iops.to_bits() == b.iops.to_bits()
                    && a.size_bytes == b.size_bytes
                    && a.rt_s.to_bits() == b.rt_s.to_bits()
                    && a.alpha.to_bits() == b.alpha.to_bits()
            }
            (
                QosSpec::Rates {
                    to_client: a,
                    to_storage: b,
                    burst: c,
                },
                QosSpec::Rates {
                    to_client: x,
                    to_storage: y,
                    burst: z,
                },
            ) => (a, b, c) == (x, y, z),
            _ => false,
        }
    }
}

impl Eq for QosSpec {}

impl QosSpec {
    /// The rates for a session whose leading connection sends segments of `mss` bytes, and
    /// whose FirstBurstLength is `first_burst`.
    pub fn plan(&self, mss: u32, first_burst: u32) -> Result<QosPlan, mcsi_model::ModelError> {
        let frame = u64::from(mss) + mcsi_target_core::qos::FRAME_HEADERS;
        let default_burst = |rate: u64| (rate / 100).max(64 << 10);
        match *self {
            QosSpec::Rates {
                to_client,
                to_storage,
                burst,
            } => {
                let r = |rate: Option<u64>| rate.map(|r| (r, burst.unwrap_or(default_burst(r))));
                Ok(QosPlan {
                    rates: mcsi_target_core::qos::Rates {
                        to_client: r(to_client),
                        to_storage: r(to_storage),
                    },
                    report: None,
                    frame,
                })
            }
            QosSpec::Requirement(q) => {
                let framing = mcsi_model::qos::Framing {
                    frame_bytes: frame,
                    first_burst_bytes: u64::from(first_burst),
                    ..mcsi_model::qos::Framing::default()
                };
                let rep = mcsi_model::qos::bandwidth(&q, &framing)?;
                let p = rep.per_request;
                // A burst of the largest request each way, of the kinds that occur: what the
                // response-time floor (eq. 7-8) moves at once, and no more.
                let (reads, writes) = (q.read_ratio > 0.0, q.read_ratio < 1.0);
                let largest =
                    |r: u64, w: u64| (if reads { r } else { 0 }).max(if writes { w } else { 0 });
                let rates = mcsi_target_core::qos::Rates {
                    to_client: Some((
                        rep.s_to_c.bandwidth.ceil() as u64,
                        largest(p.read_s_to_c, p.write_s_to_c),
                    )),
                    to_storage: Some((
                        rep.c_to_s.bandwidth.ceil() as u64,
                        largest(p.read_c_to_s, p.write_c_to_s),
                    )),
                };
                Ok(QosPlan {
                    rates,
                    report: Some(rep),
                    frame,
                })
            }
        }
    }
}

/// Validates a `[targets.qos]` table (or `--qos`'s pairs) at `field`.
pub fn qos_from(q: &FileQos, field: &str) -> Result<QosSpec, ConfigError> {
    let at = |f: &str| format!("{field}.{f}");
    let req_keys = [
        q.read_ratio.is_some(),
        q.iops.is_some(),
        q.size.is_some(),
        q.rt.is_some(),
        q.alpha.is_some(),
    ];
    let rate_keys = q.to_client.is_some() || q.to_storage.is_some();
    if req_keys.iter().any(|&k| k) {
        if rate_keys {
            return Err(cerr(
                field,
                "give either a requirement (read_ratio, iops, size, rt, alpha) or rates (to_client, to_storage), not both",
            ));
        }
        let (Some(f), Some(iops), Some(size), Some(rt)) = (q.read_ratio, q.iops, &q.size, &q.rt)
        else {
            return Err(cerr(
                field,
                "a requirement needs read_ratio, iops, size and rt (alpha defaults to 0.2)",
            ));
        };
        let size_bytes = size.bytes(&at("size"))?;
        let rt_s = mcsi_units::parse_duration(rt, mcsi_units::BareUnit::Refuse)
            .map_err(|e| cerr(at("rt"), format!("{e} (e.g. \"10ms\")")))?
            .as_secs_f64();
        let req = mcsi_model::qos::Requirement {
            read_ratio: f,
            iops,
            size_bytes,
            rt_s,
            alpha: q.alpha.unwrap_or(0.2),
        };
        // The model checks its ranges; a frame of 1500 stands in for the MSS here.
        mcsi_model::qos::bandwidth(&req, &mcsi_model::qos::Framing::default())
            .map_err(|e| cerr(field, e.to_string()))?;
        if q.burst.is_some() {
            return Err(cerr(
                at("burst"),
                "a requirement sets its own burst (its largest request); burst goes with rates",
            ));
        }
        return Ok(QosSpec::Requirement(req));
    }
    if !rate_keys {
        return Err(cerr(
            field,
            "give a requirement (read_ratio, iops, size, rt, alpha) or rates (to_client, to_storage)",
        ));
    }
    let rate = |v: &Option<SizeValue>, f: &str| -> Result<Option<u64>, ConfigError> {
        match v {
            None => Ok(None),
            Some(v) => match v.bytes(&at(f))? {
                0 => Err(cerr(
                    at(f),
                    "must be above zero (leave it out for no limit)",
                )),
                b => Ok(Some(b)),
            },
        }
    };
    Ok(QosSpec::Rates {
        to_client: rate(&q.to_client, "to_client")?,
        to_storage: rate(&q.to_storage, "to_storage")?,
        burst: rate(&q.burst, "burst")?,
    })
}

/// QoS specs of named initiators, sorted by name.
pub type NamedQos = Vec<(String, QosSpec)>;

/// Validates a target's `[targets.qos]` table at `field`: what applies to initiators not named
/// (None: they are not limited) and the specs of those named in `initiators`.
pub fn target_qos(q: &FileQos, field: &str) -> Result<(Option<QosSpec>, NamedQos), ConfigError> {
    let mut named = Vec::new();
    for (name, e) in &q.initiators {
        let f = format!("{field}.initiators.\"{name}\"");
        name::validate(name).map_err(|e| cerr(&f, e.to_string()))?;
        if e.capacity.is_some() {
            return Err(cerr(
                format!("{f}.capacity"),
                "the capacity is the target's: set it in the target's [targets.qos]",
            ));
        }
        if !e.initiators.is_empty() {
            return Err(cerr(
                format!("{f}.initiators"),
                "initiators are named once, in the target's [targets.qos.initiators]",
            ));
        }
        named.push((name.clone(), qos_from(e, &f)?));
    }
    let own_keys = FileQos {
        capacity: None,
        initiators: Default::default(),
        ..q.clone()
    } != FileQos::default();
    let default = if own_keys || named.is_empty() {
        Some(qos_from(q, field)?)
    } else {
        None
    };
    Ok((default, named))
}

/// Parses `--qos`: `key=value` pairs separated by commas, the keys of `[targets.qos]`
/// (`to_client=10MiB,to_storage=2MiB` or `read_ratio=1,iops=82,size=1KiB,rt=10ms,alpha=0.2`,
/// either with `capacity=SIZE`). Returns the spec and the capacity.
pub fn parse_qos_arg(field: &str, arg: &str) -> Result<(QosSpec, Option<u64>), ConfigError> {
    let mut q = FileQos::default();
    for pair in arg.split(',').filter(|p| !p.is_empty()) {
        let Some((k, v)) = pair.split_once('=') else {
            return Err(cerr(field, format!("'{pair}' is not key=value")));
        };
        let num = |v: &str| {
            v.parse::<f64>()
                .map_err(|_| cerr(field, format!("{k} '{v}' is not a number")))
        };
        let size = || SizeValue::Text(v.to_string());
        match k {
            "read_ratio" => q.read_ratio = Some(num(v)?),
            "iops" => q.iops = Some(num(v)?),
            "alpha" => q.alpha = Some(num(v)?),
            "size" => q.size = Some(size()),
            "rt" => q.rt = Some(v.to_string()),
            "to_client" => q.to_client = Some(size()),
            "to_storage" => q.to_storage = Some(size()),
            "burst" => q.burst = Some(size()),
            "capacity" => q.capacity = Some(size()),
            _ => {
                return Err(cerr(
                    field,
                    format!("unknown key '{k}' (use read_ratio, iops, size, rt, alpha, or to_client, to_storage, burst; and capacity)"),
                ))
            }
        }
    }
    let capacity = match &q.capacity {
        Some(v) => Some(v.bytes(&format!("{field}.capacity"))?).filter(|&c| c > 0),
        None => None,
    };
    Ok((qos_from(&q, field)?, capacity))
}

/// The spec named for `initiator` in `named`, else `default`.
pub fn qos_for(
    named: &[(String, QosSpec)],
    default: Option<QosSpec>,
    initiator: &str,
) -> Option<QosSpec> {
    // eui. and naa. names may come in either case of hex digits.
    named
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(initiator))
        .map(|(_, q)| *q)
        .or(default)
}

/// What a session's buckets are, from a target's [`QosSpec`]: bytes per second and burst per
/// direction, and the figures behind them for the log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QosPlan {
    pub rates: mcsi_target_core::qos::Rates,
    /// The model's report, for a requirement.
    pub report: Option<mcsi_model::qos::Report>,
    /// The Ethernet frame the model assumed (the connection's MSS plus TCP/IP and Ethernet
    /// headers).
    pub frame: u64,
}
