//! The parameters an experiment can set or sweep: what each means, how its value is written,
//! and the unit it is plotted in. Values are kept in a canonical text form (sizes in bytes,
//! times in milliseconds, losses in percent) so that `2KiB` and `2048` are the same point.

use mcsi_units::{parse_duration, parse_fraction, parse_rate, parse_size, BareUnit};

/// Where a parameter goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// An option of `mcsi bench`.
    Bench,
    /// An option of `mcsi target`, or which target runs.
    Target,
    /// Which initiator runs the workload.
    Client,
    /// A property of the emulated link (`mcsi link run`).
    Link,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Bytes; plotted in KiB.
    Size,
    /// A whole number in a range.
    Int(u64, u64),
    /// One of a list of words.
    Choice(&'static [&'static str]),
    Bool,
    /// Seconds (a bare number is seconds).
    Seconds,
    /// Milliseconds (a bare number is milliseconds).
    Millis,
    /// Percent (a bare number is percent).
    Percent,
    /// Bit rate; plotted in Mbit/s.
    Rate,
    /// Free text, checked by the program that takes it.
    Text,
    /// A connection scheduler: one of [`POLICY`] or `weighted:W1,W2,...`.
    Policy,
}

/// One known parameter.
#[derive(Debug, Clone, Copy)]
pub struct Def {
    pub name: &'static str,
    pub role: Role,
    kind: Kind,
    /// Axis label with its unit.
    pub axis: &'static str,
    pub help: &'static str,
}

const RW: &[&str] = &["read", "write", "randread", "randwrite", "randrw"];
const POLICY: &[&str] = &["round-robin", "least-outstanding", "tcp-aware", "failover"];
const PROFILE: &[&str] = &["802.11b", "802.11g"];
const TARGET: &[&str] = &["mcsi", "tgt"];
const CLIENT: &[&str] = &["mcsi-bench", "iscsi-perf", "nbd-fio"];
const CC: &[&str] = &["reno", "cubic", "bbr"];
const BS_RULE: &[&str] = &["cwnd", "bdp"];
const VOLUME: &[&str] = &["stripe", "mirror"];
const PATH_BY: &[&str] = &["port", "source"];
const QOS_ALLOC: &[&str] = &["naive", "prot", "prot-rt", "prot-rt-ack", "full"];
const QOS_AT: &[&str] = &["both", "link", "target"];
const BULK: &[&str] = &["none", "up", "down", "both"];
const RATE_PROCESS: &[&str] = &["linear", "poisson"];
const ENGINE: &[&str] = &["emulated", "sim"];

/// Every parameter, in the order of the CSV columns.
pub const DEFS: &[Def] = &[
    Def {
        name: "target",
        role: Role::Target,
        kind: Kind::Choice(TARGET),
        axis: "target",
        help: "mcsi (mcsi target) or tgt (Debian's tgtd, a RAM-backed file)",
    },
    Def {
        name: "client",
        role: Role::Client,
        kind: Kind::Choice(CLIENT),
        axis: "initiator",
        help: "mcsi-bench, iscsi-perf (libiscsi: reads, one connection) or nbd-fio (fio's nbd engine through `mcsi nbd`, whose session takes the bench parameters)",
    },
    Def {
        name: "initiator_cc",
        role: Role::Client,
        kind: Kind::Choice(CC),
        axis: "initiator's TCP congestion control",
        help: "reno, cubic or bbr: the congestion control of the initiator's network namespace (the sender of writes; reads are sent by the target, with the host's default)",
    },
    Def {
        name: "target_cc",
        role: Role::Target,
        kind: Kind::Choice(CC),
        axis: "target side's TCP congestion control",
        help: "reno, cubic or bbr: the congestion control of the target's side of the link, set on the host's route to the initiator (ip route ... congctl), so that every socket the target accepts there uses it whatever the host's default; for targets that cannot set it themselves, such as tgt",
    },
    Def {
        name: "cc",
        role: Role::Bench,
        kind: Kind::Choice(CC),
        axis: "TCP congestion control",
        help: "reno, cubic or bbr: the congestion control of every socket of the session, on both sides (mcsi target and mcsi bench --congestion); the target's decides how reads are sent",
    },
    Def {
        name: "rw",
        role: Role::Bench,
        kind: Kind::Choice(RW),
        axis: "workload",
        help: "read, write, randread, randwrite or randrw (half reads, half writes)",
    },
    Def {
        name: "bs",
        role: Role::Bench,
        kind: Kind::Size,
        axis: "I/O size (KiB)",
        help: "I/O size, e.g. 2KiB",
    },
    Def {
        name: "bs_auto",
        role: Role::Bench,
        kind: Kind::Choice(BS_RULE),
        axis: "I/O size rule",
        help: "cwnd or bdp: sequential reads sized to the target's window (mcsi bench --bs auto --bs-rule), instead of bs",
    },
    Def {
        name: "bs_max",
        role: Role::Bench,
        kind: Kind::Size,
        axis: "largest I/O size (KiB)",
        help: "with bs_auto: the largest read the rule may choose (mcsi bench --bs-max; default 8MiB)",
    },
    Def {
        name: "iodepth",
        role: Role::Bench,
        kind: Kind::Int(1, 1024),
        axis: "commands outstanding (queue depth)",
        help: "I/Os in flight over the whole session",
    },
    Def {
        name: "connections",
        role: Role::Bench,
        kind: Kind::Int(1, 8),
        axis: "TCP connections",
        help: "connections in the session, 1 to 8",
    },
    Def {
        name: "sessions",
        role: Role::Client,
        kind: Kind::Int(1, 8),
        axis: "sessions (one LUN each)",
        help: "sessions run at once from the initiator's side, 1 to 8: the target serves one LUN per session and one mcsi bench per session reads its own, all for the same runtime; the run's throughput and IOPS are all the sessions moved over the span from the first one's start to the last one's end, response times I/O-weighted means (the p99 is the worst session's)",
    },
    Def {
        name: "volume",
        role: Role::Client,
        kind: Kind::Choice(VOLUME),
        axis: "volume layout",
        help: "stripe or mirror: mcsi bench runs over a volume of `members` LUNs of the target (mcsi bench volume:SPEC), each member its own session; with routes, member i binds path address i mod routes",
    },
    Def {
        name: "members",
        role: Role::Client,
        kind: Kind::Int(2, 8),
        axis: "volume members",
        help: "with volume: how many LUNs (each its own session) make the volume, 2 to 8 (default 2)",
    },
    Def {
        name: "chunk",
        role: Role::Client,
        kind: Kind::Size,
        axis: "stripe chunk (KiB)",
        help: "with volume = \"stripe\": the chunk size (default 256KiB)",
    },
    Def {
        name: "policy",
        role: Role::Bench,
        kind: Kind::Policy,
        axis: "scheduler",
        help: "round-robin, least-outstanding, tcp-aware, failover or weighted:W1,W2,...",
    },
    Def {
        name: "asymmetric",
        role: Role::Bench,
        kind: Kind::Bool,
        axis: "asymmetric mode",
        help: "true or false",
    },
    Def {
        name: "verify",
        role: Role::Bench,
        kind: Kind::Bool,
        axis: "verified data",
        help: "true: every block written carries its LBA, a version and a checksum, every read is checked against the last version written, and a workload that writes reads every block it wrote back at the end (mcsi bench --verify); a mismatch fails the run",
    },
    Def {
        name: "max_erl",
        role: Role::Bench,
        kind: Kind::Int(0, 2),
        axis: "ErrorRecoveryLevel offered",
        help: "the highest ErrorRecoveryLevel the initiator offers, 0 to 2 (mcsi bench --max-erl; default 2): 0 logs the whole session in again when a connection fails, 2 moves the failed connection's tasks to the others",
    },
    Def {
        name: "kill_every",
        role: Role::Bench,
        kind: Kind::Seconds,
        axis: "a connection killed every (s)",
        help: "fault injection: one connection of the session is shut down every so many seconds, in turn, while the run goes on (mcsi bench --kill-every); the longest I/O across each kill is reported",
    },
    Def {
        name: "rate_iops",
        role: Role::Bench,
        kind: Kind::Int(1, 10_000_000),
        axis: "target rate (IOPS)",
        help: "I/Os started per second at most, as fio's rate_iops (mcsi bench --rate-iops)",
    },
    Def {
        name: "rate_process",
        role: Role::Bench,
        kind: Kind::Choice(RATE_PROCESS),
        axis: "arrivals",
        help: "how rate_iops spaces the I/Os, as fio's rate_process: linear (evenly) or poisson (exponential gaps, as independent requests arrive)",
    },
    Def {
        name: "qos_q",
        role: Role::Bench,
        kind: Kind::Int(1, 4),
        axis: "seed 004's requirement Q_i",
        help: "seed 004's requirement Q1 to Q4 (1 KiB reads at 82 IOPS within 10 ms, 1 KiB writes at 266 within 3 ms, 64 KiB reads at 76 within 18 ms, 64 KiB writes at 208 within 22 ms): sets rw, bs and rate_iops (over any values given), and the bandwidths qos_alloc allocates",
    },
    Def {
        name: "qos_alloc",
        role: Role::Target,
        kind: Kind::Choice(QOS_ALLOC),
        axis: "bandwidth allocation",
        help: "naive (iops x size both ways), prot (seed 004's eq. 5-6), prot-rt (eq. 9-10) or prot-rt-ack (eq. 9-10 with TCP's acknowledgements counted against the direction opposite to the data, mcsi's extension) for qos_q's requirement, given to the target (--qos) and the link (--reserve) as qos_at says; full: none, the whole link",
    },
    Def {
        name: "qos_at",
        role: Role::Target,
        kind: Kind::Choice(QOS_AT),
        axis: "where the allocation is enforced",
        help: "both (default), link (a reservation at the bottleneck only, seed 004's TBF) or target (mcsi target --qos only, no reservation)",
    },
    Def {
        name: "storage_share",
        role: Role::Target,
        kind: Kind::Percent,
        axis: "storage's share of the response time (%)",
        help: "with qos_q: every read and write of the LUN takes this share of the requirement's response time (the LUN's service_time), standing in for the seed's disk",
    },
    Def {
        name: "bulk",
        role: Role::Client,
        kind: Kind::Choice(BULK),
        axis: "competing bulk TCP flow",
        help: "none, up (toward the target's side), down or both (iperf3 --bidir): an iperf3 flow with CUBIC across the link from 2 s before the load to its end",
    },
    Def {
        name: "runtime",
        role: Role::Bench,
        kind: Kind::Seconds,
        axis: "run time (s)",
        help: "seconds of load per run, e.g. 8 or \"8s\"",
    },
    Def {
        name: "lun",
        role: Role::Target,
        kind: Kind::Text,
        axis: "LUN",
        help: "an mcsi target LUN spec, e.g. ram:64MiB; with engine = \"sim\" also cheetah-9lp[:DRIVES], seed 001's disks (Seagate Cheetah 9LP, 8 striped by default)",
    },
    Def {
        name: "profile",
        role: Role::Link,
        kind: Kind::Choice(PROFILE),
        axis: "802.11 profile",
        help: "802.11b or 802.11g airtime model",
    },
    Def {
        name: "per",
        role: Role::Link,
        kind: Kind::Percent,
        axis: "802.11 frame error rate (%)",
        help: "frame error rate per attempt, e.g. 5%",
    },
    Def {
        name: "rate",
        role: Role::Link,
        kind: Kind::Rate,
        axis: "link rate (Mbit/s)",
        help: "bottleneck rate, e.g. 50mbit",
    },
    Def {
        name: "rtt",
        role: Role::Link,
        kind: Kind::Millis,
        axis: "added round-trip time (ms)",
        help: "added round-trip delay, split evenly between the directions, e.g. 20ms",
    },
    Def {
        name: "delay",
        role: Role::Link,
        kind: Kind::Millis,
        axis: "one-way delay (ms)",
        help: "one-way delay each way, e.g. 10ms",
    },
    Def {
        name: "jitter",
        role: Role::Link,
        kind: Kind::Millis,
        axis: "jitter (ms)",
        help: "delay variation, e.g. 1ms",
    },
    Def {
        name: "loss",
        role: Role::Link,
        kind: Kind::Percent,
        axis: "packet loss (%)",
        help: "random loss each way, e.g. 1%",
    },
    Def {
        name: "queue",
        role: Role::Link,
        kind: Kind::Text,
        axis: "queue limit",
        help: "drop-tail limit, bytes (64KiB) or packets (100p)",
    },
    Def {
        name: "paths",
        role: Role::Link,
        kind: Kind::Text,
        axis: "paths",
        help: "several paths, ';' between them, each key=value,... on top of the link's options (e.g. \"rate=20mbit,delay=2.5ms;rate=5mbit,delay=20ms\"); each new connection takes the next path",
    },
    Def {
        name: "path_by",
        role: Role::Link,
        kind: Kind::Choice(PATH_BY),
        axis: "how connections find their path",
        help: "port (default: each new connection takes the next path, the emulator's pinning) or source (each path has its own command-side address and a connection takes the path of the address it binds, as on a multi-homed host; see routes)",
    },
    Def {
        name: "routes",
        role: Role::Client,
        kind: Kind::Int(1, 14),
        axis: "routes the session's connections bind",
        help: "with path_by = \"source\": the connections of the session bind the first N path addresses in turn (mcsi bench --bind $MCSI_LINK_ADDR_0 ...); 1 puts every connection on path 0",
    },
    Def {
        name: "mptcp",
        role: Role::Client,
        kind: Kind::Bool,
        axis: "Multipath TCP",
        help: "true: every socket of the session is Multipath TCP. The link sets up the initiator namespace's path manager (a subflow from each path address; needs paths with path_by = \"source\"), mcsi's target and bench take --mptcp, tgt and iscsi-perf run under Debian's mptcpize",
    },
    Def {
        name: "mtu",
        role: Role::Link,
        kind: Kind::Int(576, 9000),
        axis: "MTU (bytes)",
        help: "MTU of the link devices",
    },
    Def {
        name: "engine",
        role: Role::Client,
        kind: Kind::Choice(ENGINE),
        axis: "engine",
        help: "emulated (the default: mcsi target and mcsi bench behind mcsi link run, Linux's TCP) or sim (mcsi sim: the same protocol cores on virtual time over its Linux-like TCP and the link emulator's models; mcsi targets and bench workloads only, no root needed)",
    },
    Def {
        name: "pdu",
        role: Role::Client,
        kind: Kind::Size,
        axis: "PDU size (KiB)",
        help: "simulated points only (engine = \"sim\"): the MaxRecvDataSegmentLength both sides offer, seed 001's PDU size (mcsi sim --pdu)",
    },
    Def {
        name: "window",
        role: Role::Client,
        kind: Kind::Size,
        axis: "TCP window (KiB)",
        help: "simulated points only (engine = \"sim\"): every socket's send and receive buffer, the largest window it offers and fills (mcsi sim --tcp-buffer); seed 001 gives windows in segments: 80 segments of 1460 bytes is 116800",
    },
    Def {
        name: "window_segments",
        role: Role::Client,
        kind: Kind::Int(4, 1_000_000),
        axis: "TCP window (segments)",
        help: "simulated points only (engine = \"sim\"): the window as seed 001 gives it, in segments of the point's MSS (mtu less 52 bytes of IP and TCP headers with timestamps): every socket's buffer is that many segments, so it grows with the segment size (instead of window)",
    },
];

/// The parameter called `name`.
pub fn def(name: &str) -> Option<&'static Def> {
    DEFS.iter().find(|d| d.name == name)
}

/// The names of all parameters, for error messages.
pub fn names() -> String {
    DEFS.iter().map(|d| d.name).collect::<Vec<_>>().join(", ")
}

/// A parameter value in canonical form.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct Value {
    /// Canonical text: sizes in bytes, times in ms (runtime in s), percentages in percent, rates
    /// in bit/s, booleans as true/false.
    pub text: String,
    /// The value on a plot axis in the parameter's axis unit, where it is a number.
    pub num: Option<f64>,
}

fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        let s = format!("{v:.6}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

impl Def {
    /// Parses a value written in a spec (a TOML string, integer, float or boolean).
    pub fn parse(&self, v: &toml::Value) -> Result<Value, String> {
        let raw = match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => return Err(format!("expected a value, found a {}", other.type_str())),
        };
        self.parse_str(&raw)
    }

    /// Parses a value from text.
    pub fn parse_str(&self, raw: &str) -> Result<Value, String> {
        let e = |m: String| format!("'{raw}': {m}; expected {}", self.help);
        let num = |v: f64| {
            Ok(Value {
                text: fmt_num(v),
                num: Some(v),
            })
        };
        match self.kind {
            Kind::Size => {
                let b = parse_size(raw).map_err(|x| e(x.to_string()))?;
                if b == 0 {
                    return Err(e("must be more than 0".into()));
                }
                Ok(Value {
                    text: b.to_string(),
                    num: Some(b as f64 / 1024.0),
                })
            }
            Kind::Int(lo, hi) => {
                let v: u64 = raw
                    .trim()
                    .parse()
                    .map_err(|_| e("not a whole number".into()))?;
                if !(lo..=hi).contains(&v) {
                    return Err(e(format!("out of range {lo} to {hi}")));
                }
                num(v as f64)
            }
            Kind::Choice(words) => {
                let w = raw.trim();
                if words.contains(&w) {
                    Ok(Value {
                        text: w.to_string(),
                        num: None,
                    })
                } else {
                    Err(e(format!("unknown value (use {})", words.join(", "))))
                }
            }
            Kind::Bool => match raw.trim() {
                "true" => Ok(Value {
                    text: "true".into(),
                    num: Some(1.0),
                }),
                "false" => Ok(Value {
                    text: "false".into(),
                    num: Some(0.0),
                }),
                _ => Err(e("not true or false".into())),
            },
            Kind::Seconds => {
                let d = parse_duration(raw, BareUnit::Seconds).map_err(|x| e(x.to_string()))?;
                if d.as_secs_f64() < 0.5 {
                    return Err(e("must be at least 0.5 s".into()));
                }
                num(d.as_secs_f64())
            }
            Kind::Millis => {
                let d = parse_duration(raw, BareUnit::Millis).map_err(|x| e(x.to_string()))?;
                num(d.as_secs_f64() * 1e3)
            }
            Kind::Percent => {
                let f = parse_fraction(raw, true).map_err(|x| e(x.to_string()))?;
                num(f * 100.0)
            }
            Kind::Rate => {
                let r = parse_rate(raw).map_err(|x| e(x.to_string()))?;
                Ok(Value {
                    text: fmt_num(r),
                    num: Some(r / 1e6),
                })
            }
            Kind::Policy => {
                let w = raw.trim();
                let weights_ok = w.strip_prefix("weighted:").is_some_and(|l| {
                    let ws: Option<Vec<u32>> =
                        l.split(',').map(|x| x.trim().parse().ok()).collect();
                    ws.is_some_and(|ws| ws.iter().any(|&x| x > 0) && ws.iter().all(|&x| x <= 1000))
                });
                if POLICY.contains(&w) || weights_ok {
                    Ok(Value {
                        text: w.to_string(),
                        num: None,
                    })
                } else {
                    Err(e(format!(
                        "unknown policy (use {}, or weighted:W1,W2,... with weights 0 to 1000)",
                        POLICY.join(", ")
                    )))
                }
            }
            Kind::Text => {
                if raw.trim().is_empty() {
                    return Err(e("empty".into()));
                }
                Ok(Value {
                    text: raw.trim().to_string(),
                    num: None,
                })
            }
        }
    }

    /// The value as the program that takes it expects it on its command line.
    pub fn arg(&self, v: &Value) -> String {
        match self.kind {
            Kind::Millis => format!("{}ms", v.text),
            Kind::Percent => format!("{}%", v.text),
            Kind::Rate => format!("{}bit", v.text),
            _ => v.text.clone(),
        }
    }

    /// A short human form: `2 KiB`, `20 ms`, `1 %`.
    pub fn show(&self, v: &Value) -> String {
        match (self.kind, v.num) {
            (Kind::Size, Some(k)) if k >= 1024.0 => format!("{} MiB", fmt_num(k / 1024.0)),
            (Kind::Size, Some(k)) => format!("{} KiB", fmt_num(k)),
            (Kind::Millis, _) => format!("{} ms", v.text),
            (Kind::Percent, _) => format!("{} %", v.text),
            (Kind::Seconds, _) => format!("{} s", v.text),
            (Kind::Rate, Some(m)) => format!("{} Mbit/s", fmt_num(m)),
            _ => v.text.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn p(name: &str, s: &str) -> Result<Value, String> {
        def(name).unwrap().parse_str(s)
    }

    #[test]
    fn canonical_forms() {
        assert_eq!(p("bs", "2KiB").unwrap().text, "2048");
        assert_eq!(p("bs", "2048").unwrap(), p("bs", "2k").unwrap());
        assert_eq!(p("bs", "128KiB").unwrap().num, Some(128.0));
        assert_eq!(p("rtt", "20ms").unwrap().text, "20");
        assert_eq!(p("rtt", "2.5").unwrap().text, "2.5");
        assert_eq!(p("rtt", "0.02s").unwrap().text, "20");
        assert_eq!(p("loss", "1%").unwrap().text, "1");
        assert_eq!(p("loss", "0.5").unwrap().text, "0.5");
        assert_eq!(p("rate", "50mbit").unwrap().text, "50000000");
        assert_eq!(p("runtime", "8s").unwrap().text, "8");
        let rtt = def("rtt").unwrap();
        assert_eq!(rtt.arg(&p("rtt", "2.5ms").unwrap()), "2.5ms");
    }

    #[test]
    fn bad_values_say_what_is_expected() {
        let e = p("connections", "9").unwrap_err();
        assert!(e.contains("out of range 1 to 8"), "{e}");
        let e = p("rw", "sideways").unwrap_err();
        assert!(e.contains("read, write"), "{e}");
        let e = p("bs", "0").unwrap_err();
        assert!(e.contains("more than 0"), "{e}");
        let e = p("loss", "150%").unwrap_err();
        assert!(e.contains("between 0 and 1"), "{e}");
    }
}
