//! `mcsi model`: the closed-form models of the research seeds (crate mcsi-model) on the command
//! line, as a readable table or as JSON for experiments that print "model vs measured".

use anyhow::Context;
use mcsi_model::{qos, queue, tcp, wlan, ModelError};
use mcsi_units::{parse_duration, parse_fraction, parse_rate, parse_size, BareUnit, UnitError};
use mcsi_units::{Bytes, Dur, Rate};
use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Subcommand)]
pub enum Command {
    /// 802.11 MAC throughput, TCP goodput and packet failures (thesis 000, eq. 3.1-3.15).
    ///
    /// MAC throughput is eq. 3.7: 8 L_DATA over DIFS + mean backoff (CW_min x slot / 2) +
    /// preamble + PLCP header + MAC overhead and payload at --rate + SIFS + ACK at --ack-rate +
    /// 2 x propagation. L_DATA is the payload less the TCP/IP header. TCP goodput adds one TCP
    /// ACK frame (a bare TCP/IP header in its own DCF cycle) per --segments-per-ack data frames
    /// (delayed ACKs). The failure model solves eq. 3.14-3.15 for --stations contending stations
    /// with packet error rate --per and scales both figures by eq. 3.12's success factor.
    ///
    /// 802.11b defaults (Table 3.2, ACKs at the data rate) give the thesis's 6.1 Mbit/s MAC and
    /// 4.9-5.2 Mbit/s TCP figures.
    #[command(verbatim_doc_comment)]
    Wlan(WlanArgs),
    /// TCP throughput under loss: Mathis et al., Padhye et al., N connections on a link.
    ///
    /// Mathis: MSS / RTT x sqrt(3/2) / sqrt(p). Padhye: the approximation with timeouts,
    /// 1 / (RTT sqrt(2bp/3) + RTO min(1, 3 sqrt(3bp/8)) p (1 + 32 p^2)) segments per second,
    /// bounded by Wmax / RTT. The aggregate is N x Padhye, bounded by --link-rate.
    /// With --loss 0 both models are unbounded: give --wmax or --link-rate.
    #[command(verbatim_doc_comment)]
    Tcp(TcpArgs),
    /// M/M/1 vs M/M/m mean delay and queuing probability (thesis 000, eq. 4.1-4.5).
    ///
    /// M/M/1: T = 1 / (mu_1 - lambda). M/M/m: T = 1 / mu + P_Q / (m mu - lambda) with P_Q the
    /// Erlang C probability of eq. 4.3. Rates are per second (bare numbers, optional k or M
    /// suffix); with --packet they are bit rates (5mbit) divided by the packet size.
    #[command(verbatim_doc_comment)]
    Queue(QueueArgs),
    /// Network bandwidth for an IP-storage QoS requirement (seed 004, eq. 1-10), both directions.
    ///
    /// Per request, eq. 1-4 count frames of --frame bytes with --overhead bytes of Ethernet,
    /// TCP/IP and iSCSI header each. "protocol" is eq. 5-6 (the paper's "prot"), "min_for_rt" is
    /// eq. 7-8 (the bandwidth that moves one request in alpha x rt), "bandwidth" is eq. 9-10 (the
    /// larger; the paper's "prot-rt") and "naive" is iops x size. Output is bytes per second;
    /// "toward IP storage" in the paper is c_to_s. --read-ratio 1 means all reads.
    ///
    /// ALPHA. The paper does not print alpha. Table 1's "toward IP storage" figures are eq. 7
    /// (they exceed eq. 5), so alpha = D / (rt x B) with MB = 2^20 bytes:
    ///   Q1 106 B / (10 ms x 0.05 MB/s)  = 0.202 (0.184..0.225 within the table's rounding)
    ///   Q2 1130 B / (3 ms x 1.84 MB/s)  = 0.1952 (0.1947..0.1958)
    ///   Q3 106 B / (18 ms x 0.03 MB/s)  = 0.187 (0.160..0.225)
    ///   Q4 70624 B / (22 ms x 15.67 MB/s) = 0.19537 (0.19531..0.19543)
    /// All four intervals meet at alpha = 0.1954, which gives 0.052, 1.838, 0.029 and 15.668 MB/s.
    ///
    /// Eq. 7-8 print floor(f) and floor(1 - f) as weights; they are read as "reads occur" and
    /// "writes occur", so mixed workloads keep a response-time bound (both agree for f = 0 or 1).
    #[command(verbatim_doc_comment)]
    Qos(QosArgs),
}

/// The 802.11 PHY.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum StandardArg {
    #[value(name = "802.11b", alias = "b")]
    B,
    #[value(name = "802.11g", alias = "g")]
    G,
}

#[derive(clap::Args)]
pub struct WlanArgs {
    /// PHY timing: 802.11b (thesis Table 3.2) or 802.11g (ERP-OFDM, short slots).
    #[arg(long, value_enum, default_value = "802.11b")]
    standard: StandardArg,
    /// Frame payload (the IP packet, L_DATA_TCP) in bytes.
    #[arg(long, value_name = "BYTES", default_value = "1500", value_parser = parse_size)]
    payload: u64,
    /// Data rate; a bare number is Mbit/s [default: 11 for 802.11b, 54 for 802.11g].
    #[arg(long, value_name = "MBIT", value_parser = parse_mbit)]
    rate: Option<f64>,
    /// MAC ACK rate; a bare number is Mbit/s [default: the data rate for 802.11b, as the
    /// thesis's figure assumes; the highest of 6/12/24 not above it for 802.11g].
    #[arg(long, value_name = "MBIT", value_parser = parse_mbit)]
    ack_rate: Option<f64>,
    /// Stations contending for the channel (n of eq. 3.14); 1 means no collisions.
    #[arg(long, value_name = "N", default_value_t = 1)]
    stations: u32,
    /// Packet error probability P_e, a fraction (0.1) or a percent (10%).
    #[arg(long, value_name = "P", default_value = "0", value_parser = parse_loss)]
    per: f64,
    /// TCP/IP header bytes in each packet.
    #[arg(long, value_name = "BYTES", default_value_t = 40)]
    tcp_ip_header: u32,
    /// Data segments per TCP ACK (2 with delayed ACKs).
    #[arg(long, value_name = "N", default_value_t = 2)]
    segments_per_ack: u32,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct TcpArgs {
    /// Maximum segment size.
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    mss: u64,
    /// Round-trip time (10ms, 0.1s; a bare number is milliseconds).
    #[arg(long, value_name = "DURATION", value_parser = parse_ms)]
    rtt: Duration,
    /// Segment loss probability, a fraction (0.01) or a percent (1%).
    #[arg(long, value_name = "P", value_parser = parse_loss)]
    loss: f64,
    /// Retransmission timeout for Padhye [default: 4 x RTT, as RFC 5348 simplifies it].
    #[arg(long, value_name = "DURATION", value_parser = parse_ms)]
    rto: Option<Duration>,
    /// Maximum (receiver) window; bounds each connection at wmax / RTT.
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    wmax: Option<u64>,
    /// Parallel connections.
    #[arg(long, value_name = "N", default_value_t = 1)]
    connections: u32,
    /// Rate of the link the connections share (5mbit; a bare number is bit/s).
    #[arg(long, value_name = "RATE", value_parser = parse_rate)]
    link_rate: Option<f64>,
    /// Segments acknowledged per ACK (b in Padhye's formula; 2 with delayed ACKs).
    #[arg(long, value_name = "B", default_value_t = 1.0)]
    packets_per_ack: f64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct QueueArgs {
    /// Arrival rate lambda (packets or requests per second).
    #[arg(long, value_name = "RATE")]
    arrival: String,
    /// Service rate mu of one server (one connection's channel).
    #[arg(long, value_name = "RATE")]
    service: String,
    /// Number of servers m (connections).
    #[arg(long, value_name = "M")]
    servers: u32,
    /// Service rate mu_1 of the single-connection M/M/1 [default: --service, the light-load
    /// case where the thesis takes mu_m ~ mu_1].
    #[arg(long, value_name = "RATE")]
    single_service: Option<String>,
    /// Packet size: rates are then bit rates (5mbit) and are divided by 8 x SIZE.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    packet: Option<u64>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct QosArgs {
    /// Fraction of requests that are reads (f): 1 = all reads, 0 = all writes; or a percent.
    #[arg(long, value_name = "F", value_parser = parse_loss)]
    read_ratio: f64,
    /// I/O requests per second.
    #[arg(long, value_name = "N")]
    iops: f64,
    /// Mean request size (1KiB, 64KiB).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    size: u64,
    /// Demanded mean response time (10ms; a bare number is milliseconds).
    #[arg(long, value_name = "DURATION", value_parser = parse_ms)]
    rt: Duration,
    /// Share of rt the network transfer of one request may take, 0 < alpha < 1
    /// (0.1954 reproduces the paper's Table 1; see above).
    #[arg(long, value_name = "A")]
    alpha: f64,
    /// Ethernet frame size S_f.
    #[arg(long, value_name = "BYTES", default_value = "1500", value_parser = parse_size)]
    frame: u64,
    /// iSCSI FirstBurstLength (RFC 7143's default, which Table 2 implies).
    #[arg(long, value_name = "SIZE", default_value = "64KiB", value_parser = parse_size)]
    first_burst: u64,
    /// Protocol overhead per frame: Ethernet 18 + TCP/IP 40 + iSCSI 48 bytes.
    #[arg(long, value_name = "BYTES", default_value = "106", value_parser = parse_size)]
    overhead: u64,
    /// Count TCP's acknowledgements against the direction opposite to the data: one frame of
    /// this many bytes per two data frames (58: Ethernet and TCP/IP headers). Not in the
    /// paper, whose figures are for 0; a reservation at the bottleneck carries them, and at 64
    /// KiB they are 24 frames per request.
    #[arg(long, value_name = "BYTES", default_value = "0", value_parser = parse_size)]
    ack_bytes: u64,
    /// Admission: a link of this capacity each way (a bare number is Mbit/s): does one more
    /// session of this requirement fit beside `--sessions` already in, and how many fit in all?
    /// The same test `mcsi target --qos ...,capacity=` makes at each login.
    #[arg(long, value_name = "RATE", value_parser = parse_mbit)]
    admit: Option<f64>,
    /// Sessions of this requirement already admitted (with `--admit`).
    #[arg(long, value_name = "N", default_value = "0", requires = "admit")]
    sessions: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// A rate where a bare number is Mbit/s.
fn parse_mbit(s: &str) -> Result<f64, UnitError> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v * 1e6),
        Ok(_) => Err(UnitError {
            what: "rate",
            input: s.to_string(),
            why: "must be a positive rate".into(),
        }),
        Err(_) => parse_rate(s),
    }
}

fn parse_ms(s: &str) -> Result<Duration, UnitError> {
    parse_duration(s, BareUnit::Millis)
}

fn parse_loss(s: &str) -> Result<f64, UnitError> {
    parse_fraction(s, false)
}

/// Events per second: `150`, `1.5k`, `2M`, optionally ending in `/s`.
fn parse_per_second(s: &str) -> Result<f64, UnitError> {
    let t = s.trim();
    let t = t.strip_suffix("/s").unwrap_or(t);
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1e3),
        Some((i, 'm' | 'M')) => (&t[..i], 1e6),
        _ => (t, 1.0),
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v * mult),
        _ => Err(UnitError {
            what: "rate",
            input: s.to_string(),
            why: "expected a positive number per second such as 150 or 1.5k \
                  (give --packet SIZE to use bit rates such as 5mbit)"
                .into(),
        }),
    }
}

pub fn run(c: Command) -> anyhow::Result<ExitCode> {
    match c {
        Command::Wlan(a) => run_wlan(a),
        Command::Tcp(a) => run_tcp(a),
        Command::Queue(a) => run_queue(a),
        Command::Qos(a) => run_qos(a),
    }?;
    Ok(ExitCode::SUCCESS)
}

/// Appends a line to a `String` (which cannot fail).
macro_rules! outln {
    ($out:expr, $($arg:tt)*) => {{
        let _ = writeln!($out, $($arg)*);
    }};
}

/// Writes the finished output; a reader that went away (`| head`) is not an error.
fn emit(text: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    emit(&(serde_json::to_string_pretty(v)? + "\n"))
}

fn run_wlan(a: WlanArgs) -> anyhow::Result<()> {
    let standard = match a.standard {
        StandardArg::B => wlan::Standard::B,
        StandardArg::G => wlan::Standard::G,
    };
    let mut input = wlan::Input::new(standard);
    input.payload_bytes = u32::try_from(a.payload).unwrap_or(u32::MAX);
    if let Some(r) = a.rate {
        input.rate_bps = r;
        input.ack_rate_bps = standard.default_ack_rate(r);
    }
    if let Some(r) = a.ack_rate {
        input.ack_rate_bps = r;
    }
    input.stations = a.stations;
    input.packet_error = a.per;
    input.tcp_ip_header_bytes = a.tcp_ip_header;
    input.segments_per_ack = a.segments_per_ack;
    let r = wlan::throughput(&input).context("wlan model")?;
    if a.json {
        return print_json(&r);
    }
    let mut out = String::new();
    let us = |s: f64| format!("{:.1} us", s * 1e6);
    let p = &input.phy;
    let f = &r.failure;
    let name = match standard {
        wlan::Standard::B => "802.11b",
        wlan::Standard::G => "802.11g",
    };
    outln!(
        out,
        "{name} DCF cycle, {} B payload ({} B of TCP data), data at {}, ACK at {}",
        input.payload_bytes,
        r.data_bytes,
        Rate(input.rate_bps),
        Rate(input.ack_rate_bps)
    );
    outln!(
        out,
        "  DIFS                            {:>12}",
        us(p.difs_s)
    );
    outln!(
        out,
        "  mean backoff (eq. 3.1)          {:>12}   {} x {} / 2",
        us(r.mean_backoff_s),
        p.cw_min,
        us(p.slot_s)
    );
    outln!(
        out,
        "  data frame (eq. 3.5)            {:>12}   preamble {} + PLCP {} + {} B MAC + {} B",
        us(r.data_delay_s),
        us(p.preamble_s),
        us(p.plcp_header_s),
        p.mac_overhead_bytes,
        input.payload_bytes
    );
    outln!(
        out,
        "  SIFS                            {:>12}",
        us(p.sifs_s)
    );
    outln!(
        out,
        "  ACK frame (eq. 3.6)             {:>12}   {} B MAC + {} B",
        us(r.ack_delay_s),
        p.mac_overhead_bytes,
        p.ack_bytes
    );
    outln!(
        out,
        "  2 x propagation                 {:>12}",
        us(r.round_trip_propagation_s)
    );
    outln!(
        out,
        "  cycle                           {:>12}",
        us(r.cycle_s)
    );
    outln!(
        out,
        "MAC throughput (eq. 3.7)          {:>12}",
        Rate(r.mac_throughput_bps).to_string()
    );
    outln!(
        out,
        "TCP goodput                       {:>12}   one {} B TCP ACK cycle ({}) per {} segments",
        Rate(r.tcp_goodput_bps).to_string(),
        input.tcp_ip_header_bytes,
        us(r.tcp_ack_cycle_s),
        input.segments_per_ack
    );
    outln!(
        out,
        "packet failures (eq. 3.8-3.15), {} station(s), W {}, m {}:",
        f.stations,
        f.window,
        f.backoff_stages
    );
    outln!(
        out,
        "  tau {:.4}  P_c {:.4}  P_e {:.4}  P_f {:.4}  success factor {:.4}",
        f.transmit_probability,
        f.collision_probability,
        f.error_probability,
        f.failure_probability,
        f.success_factor
    );
    outln!(
        out,
        "  MAC throughput {}   TCP goodput {}",
        Rate(f.mac_throughput_bps),
        Rate(f.tcp_goodput_bps)
    );
    emit(&out)
}

fn limit_name(l: tcp::Limit) -> &'static str {
    match l {
        tcp::Limit::Loss => "loss",
        tcp::Limit::Window => "window (wmax / RTT)",
        tcp::Limit::Link => "link rate",
    }
}

fn run_tcp(a: TcpArgs) -> anyhow::Result<()> {
    let input = tcp::Input {
        mss_bytes: a.mss as f64,
        rtt_s: a.rtt.as_secs_f64(),
        loss: a.loss,
        rto_s: a.rto.map(|d| d.as_secs_f64()),
        wmax_bytes: a.wmax.map(|w| w as f64),
        connections: a.connections,
        link_rate_bps: a.link_rate,
        packets_per_ack: a.packets_per_ack,
    };
    let r = match tcp::throughput(&input) {
        Err(ModelError::Unbounded) => anyhow::bail!(
            "--loss 0 makes the Mathis and Padhye throughput unbounded: \
             add --wmax BYTES (receiver window) or --link-rate RATE to bound it"
        ),
        other => other.context("tcp model")?,
    };
    if a.json {
        return print_json(&r);
    }
    let mut out = String::new();
    outln!(
        out,
        "MSS {} B, RTT {}, loss {:.4}%, RTO {}, {} connection(s){}{}",
        r.mss_bytes,
        Dur(a.rtt),
        r.loss * 100.0,
        Dur(Duration::from_secs_f64(r.rto_s)),
        r.connections,
        r.wmax_bytes
            .map(|w| format!(", wmax {}", Bytes(w)))
            .unwrap_or_default(),
        r.link_rate_bps
            .map(|l| format!(", link {}", Rate(l)))
            .unwrap_or_default(),
    );
    let rows = [
        (
            "Mathis (C = sqrt(3/2))".to_string(),
            r.mathis_bps,
            Some(r.mathis_limit),
        ),
        (
            format!("Padhye (b = {})", r.packets_per_ack),
            r.padhye_bps,
            Some(r.padhye_limit),
        ),
        (
            format!("{} x Padhye on the link", r.connections),
            r.aggregate_bps,
            Some(r.aggregate_limit),
        ),
        (
            format!("{} x Mathis on the link", r.connections),
            r.aggregate_mathis_bps,
            None,
        ),
    ];
    for (name, bps, limit) in rows {
        let limit = limit
            .map(|l| format!("   limited by {}", limit_name(l)))
            .unwrap_or_default();
        outln!(out, "{name:<26} {:>14}{limit}", Rate(bps).to_string());
    }
    emit(&out)
}

fn queue_rate(s: &str, packet: Option<u64>, flag: &str) -> anyhow::Result<f64> {
    match packet {
        Some(0) => anyhow::bail!("--packet must be at least 1 byte"),
        Some(p) => Ok(parse_rate(s).with_context(|| flag.to_string())? / (8.0 * p as f64)),
        None => Ok(parse_per_second(s).with_context(|| flag.to_string())?),
    }
}

fn queue_json(q: &Result<queue::Queue, ModelError>) -> serde_json::Value {
    match q {
        Ok(q) => serde_json::to_value(q).unwrap_or(serde_json::Value::Null),
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    }
}

fn run_queue(a: QueueArgs) -> anyhow::Result<()> {
    let lambda = queue_rate(&a.arrival, a.packet, "--arrival")?;
    let mu = queue_rate(&a.service, a.packet, "--service")?;
    let mu1 = match &a.single_service {
        Some(s) => queue_rate(s, a.packet, "--single-service")?,
        None => mu,
    };
    // The M/M/m queue is the one asked for: it must be stable. M/M/1 is the comparison and
    // is reported as unstable rather than failing the command.
    let mmm = queue::mmm(lambda, mu, a.servers)?;
    let mm1 = queue::mm1(lambda, mu1);
    if a.json {
        let v = serde_json::json!({
            "mm1": queue_json(&mm1),
            "mmm": queue_json(&Ok(mmm)),
        });
        return print_json(&v);
    }
    let mut out = String::new();
    outln!(
        out,
        "{:<8} {:>12} {:>12} {:>8} {:>8} {:>12} {:>12} {:>10}",
        "model",
        "arrival/s",
        "service/s",
        "rho",
        "P_Q",
        "wait",
        "delay",
        "in system"
    );
    let row = |out: &mut String, name: String, q: &queue::Queue| {
        outln!(
            out,
            "{:<8} {:>12.3} {:>12.3} {:>8.4} {:>8.4} {:>12} {:>12} {:>10.3}",
            name,
            q.arrival_per_s,
            q.service_per_s,
            q.utilization,
            q.queuing_probability,
            Dur(Duration::from_secs_f64(q.mean_wait_s)).to_string(),
            Dur(Duration::from_secs_f64(q.mean_delay_s)).to_string(),
            q.mean_in_system
        )
    };
    match &mm1 {
        Ok(q) => row(&mut out, "M/M/1".into(), q),
        Err(e) => outln!(out, "M/M/1    {e}"),
    }
    row(&mut out, format!("M/M/{}", a.servers), &mmm);
    emit(&out)
}

fn run_qos(a: QosArgs) -> anyhow::Result<()> {
    let req = qos::Requirement {
        read_ratio: a.read_ratio,
        iops: a.iops,
        size_bytes: a.size,
        rt_s: a.rt.as_secs_f64(),
        alpha: a.alpha,
    };
    let framing = qos::Framing {
        frame_bytes: a.frame,
        overhead_bytes: a.overhead,
        first_burst_bytes: a.first_burst,
        ack_bytes: a.ack_bytes,
    };
    let r = qos::bandwidth(&req, &framing).context("qos model")?;
    // Admission as the target reckons it: whole bytes per second each way, capacity in bytes.
    let admission = a.admit.map(|bits| {
        let capacity = (bits / 8.0) as u64;
        let need = (
            r.s_to_c.bandwidth.ceil() as u64,
            r.c_to_s.bandwidth.ceil() as u64,
        );
        let used = (need.0 * a.sessions, need.1 * a.sessions);
        let fits = mcsi_target::qos::admit(need, used, capacity);
        let most = [need.0, need.1]
            .iter()
            .filter(|&&n| n > 0)
            .map(|&n| capacity / n)
            .min()
            .unwrap_or(u64::MAX);
        (capacity, need, used, fits, most)
    });
    if a.json {
        let mut v = serde_json::json!({
            "c_to_s": r.c_to_s,
            "s_to_c": r.s_to_c,
            "per_request": r.per_request,
            "requirement": req,
            "framing": framing,
        });
        if let Some((capacity, need, used, fits, most)) = admission {
            let left = fits
                .err()
                .unwrap_or((capacity - used.0 - need.0, capacity - used.1 - need.1));
            v["admission"] = serde_json::json!({
                "capacity_bytes_per_s": capacity,
                "sessions_in": a.sessions,
                "fits": fits.is_ok(),
                "left_to_client": left.0,
                "left_to_storage": left.1,
                "sessions_that_fit": most,
            });
        }
        return print_json(&v);
    }
    let mut out = String::new();
    outln!(
        out,
        "f {}, {} IOPS, {} requests, rt {}, alpha {}; {} B frames, {} B overhead, \
         FirstBurstLength {}",
        req.read_ratio,
        req.iops,
        Bytes(req.size_bytes as f64),
        Dur(a.rt),
        req.alpha,
        framing.frame_bytes,
        framing.overhead_bytes,
        Bytes(framing.first_burst_bytes as f64)
    );
    if framing.ack_bytes > 0 {
        outln!(
            out,
            "TCP acknowledgements counted: one {} B frame per two data frames, against the other direction",
            framing.ack_bytes
        );
    }
    let mib = |b: f64| format!("{:.4} MiB/s", b / 1048576.0);
    outln!(
        out,
        "{:<24} {:>18} {:>18}",
        "",
        "toward storage",
        "toward client"
    );
    let (c, s) = (&r.c_to_s, &r.s_to_c);
    let rows = [
        ("bandwidth (eq. 9-10)", c.bandwidth, s.bandwidth),
        ("protocol (eq. 5-6)", c.protocol, s.protocol),
        ("min for rt (eq. 7-8)", c.min_for_rt, s.min_for_rt),
        ("naive (iops x size)", c.naive, s.naive),
    ];
    for (name, to_storage, to_client) in rows {
        outln!(
            out,
            "{name:<24} {:>18} {:>18}",
            mib(to_storage),
            mib(to_client)
        );
    }
    let pr = &r.per_request;
    outln!(
        out,
        "per request (eq. 1-4): read {} B / {} B, write {} B / {} B (toward storage / client)",
        pr.read_c_to_s,
        pr.read_s_to_c,
        pr.write_c_to_s,
        pr.write_s_to_c
    );
    if let Some((capacity, need, used, fits, most)) = admission {
        let mib = |b: u64| format!("{:.4} MiB/s", b as f64 / 1048576.0);
        match fits {
            Ok(()) => outln!(
                out,
                "admission: with {} session(s) in, one more fits in {} each way; {} to the client and {} to storage left after it ({most} fit in all)",
                a.sessions,
                mib(capacity),
                mib(capacity - used.0 - need.0),
                mib(capacity - used.1 - need.1)
            ),
            Err((c, s)) => outln!(
                out,
                "admission: with {} session(s) in, one more does not fit in {} each way: it needs {} to the client and {} to storage, {} and {} are left ({most} fit in all); the target refuses its login with 3/02",
                a.sessions,
                mib(capacity),
                mib(need.0),
                mib(need.1),
                mib(c),
                mib(s)
            ),
        }
    }
    emit(&out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_parsers() {
        assert_eq!(parse_mbit("11").unwrap(), 11e6);
        assert_eq!(parse_mbit("5.5").unwrap(), 5.5e6);
        assert_eq!(parse_mbit("2mbit").unwrap(), 2e6);
        assert!(parse_mbit("0").is_err());
        assert!(parse_mbit("fast").is_err());
        assert_eq!(parse_ms("10").unwrap(), Duration::from_millis(10));
        assert_eq!(parse_ms("0.1s").unwrap(), Duration::from_millis(100));
        assert_eq!(parse_loss("1%").unwrap(), 0.01);
        assert_eq!(parse_loss("0.01").unwrap(), 0.01);
        assert_eq!(parse_per_second("150").unwrap(), 150.0);
        assert_eq!(parse_per_second("1.5k").unwrap(), 1500.0);
        assert_eq!(parse_per_second("2M/s").unwrap(), 2e6);
        assert!(parse_per_second("5mbit").is_err());
        assert!(parse_per_second("-3").is_err());
        assert!(parse_per_second("k").is_err());
    }
}
