//! `mcsi monitor ADDR`: each connection's TCP state, live, from the `--metrics` endpoint of a
//! running `mcsi target` (every session) or `mcsi bench` (its session): congestion window, RTT,
//! rates, retransmissions and window reductions, as a view that refreshes in place or as JSON
//! lines, and on exit a PNG of the congestion window over time with the reductions marked.

use anyhow::{bail, Context};
use mcsi_tcp::TcpState;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{IsTerminal, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// The --metrics address of a running mcsi target or mcsi bench (ADDR:PORT).
    pub addr: String,
    /// Time between samples, e.g. 1s or 100ms.
    #[arg(long, default_value = "1s")]
    pub interval: String,
    /// Print one JSON object per connection and sample (JSON lines) instead of the live view.
    #[arg(long)]
    pub json: bool,
    /// Stop after this long, e.g. 30s (default: until interrupted).
    #[arg(long)]
    pub duration: Option<String>,
    /// When the monitor stops, draw each connection's congestion window over time with its
    /// reductions marked, into this PNG.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
}

/// The `/state` document of a target or an initiator.
#[derive(Debug, Deserialize)]
struct State {
    side: String,
    #[serde(default)]
    sessions: Vec<SessionState>,
}

#[derive(Debug, Deserialize)]
struct SessionState {
    tsih: u16,
    #[serde(default)]
    target: Option<String>,
    #[serde(default)]
    initiator: String,
    #[serde(default)]
    connections: Vec<ConnState>,
}

#[derive(Debug, Deserialize)]
struct ConnState {
    cid: u16,
    #[serde(default)]
    peer: String,
    /// On the initiator side: the connection's own address (its route).
    #[serde(default)]
    local: String,
    #[serde(default)]
    congestion: Option<String>,
    #[serde(default)]
    tcp: Option<TcpState>,
    /// On the initiator side: the target's report of its sending side.
    #[serde(default)]
    target_tcp: Option<TcpState>,
}

/// Whether the sender cut its window between two samples: it entered CWR, Recovery or Loss, had
/// a retransmission timeout, or its window shrank by more than 15 % (and more than one segment).
pub fn reduced(prev: &TcpState, now: &TcpState) -> bool {
    let entered = now.ca_state.is_reducing() && !prev.ca_state.is_reducing();
    let rto = now.total_rto.unwrap_or(0) > prev.total_rto.unwrap_or(0);
    let shrank = f64::from(now.cwnd) < 0.85 * f64::from(prev.cwnd) && now.cwnd + 1 < prev.cwnd;
    entered || rto || shrank
}

/// One connection followed over the samples.
#[derive(Default)]
struct Track {
    label: String,
    prev: Option<(f64, TcpState)>,
    reductions: u64,
    points: Vec<(f64, f64)>,
    events: Vec<f64>,
    last: Option<Value>,
    seen_at: f64,
}

fn fetch(addr: SocketAddr, host: &str) -> anyhow::Result<State> {
    let timeout = Duration::from_secs(3);
    let mut s = TcpStream::connect_timeout(&addr, timeout).with_context(|| {
        format!("cannot reach {host}: is mcsi target or mcsi bench running with --metrics {host}?")
    })?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(s, "GET /state HTTP/1.0\r\nHost: {host}\r\n\r\n")?;
    let mut buf = Vec::new();
    // A snapshot of thousands of connections is well under this.
    s.take(64 << 20).read_to_end(&mut buf)?;
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("the answer is not HTTP")?;
    let head = String::from_utf8_lossy(&buf[..split]);
    let status = head.lines().next().unwrap_or("");
    if !status.contains(" 200") {
        bail!("{host} answered '{status}' to GET /state: is it an mcsi --metrics endpoint?");
    }
    serde_json::from_slice(&buf[split + 4..]).context("the /state document is not what mcsi writes")
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let interval = mcsi_units::parse_duration(&a.interval, mcsi_units::BareUnit::Seconds)
        .map_err(|e| anyhow::anyhow!("--interval: {e}"))?;
    if interval < Duration::from_millis(10) {
        bail!("--interval must be at least 10ms");
    }
    let duration = a
        .duration
        .as_deref()
        .map(|d| mcsi_units::parse_duration(d, mcsi_units::BareUnit::Seconds))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--duration: {e}"))?;
    let addr = a
        .addr
        .to_socket_addrs()
        .with_context(|| format!("{}: expected ADDR:PORT, e.g. 127.0.0.1:9464", a.addr))?
        .next()
        .with_context(|| format!("{}: no address", a.addr))?;
    let live = !a.json && std::io::stdout().is_terminal();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut tracks: BTreeMap<String, Track> = BTreeMap::new();
    let t0 = Instant::now();
    let outcome: anyhow::Result<()> = rt.block_on(async {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = tokio::signal::ctrl_c() => return Ok(()),
            }
            let t = t0.elapsed().as_secs_f64();
            let state = fetch(addr, &a.addr)?;
            let rows = sample(&state, t, &mut tracks);
            let text = if a.json {
                rows.iter().map(|r| format!("{r}\n")).collect::<String>()
            } else if live {
                format!("\x1b[H\x1b[2J{}", render(&a.addr, &state, t, &tracks))
            } else {
                format!("{}\n", render(&a.addr, &state, t, &tracks))
            };
            let mut out = std::io::stdout().lock();
            match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
                Ok(()) => {}
                // The reader went away (a pipe into head): stop quietly.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                Err(e) => return Err(e.into()),
            }
            if duration.is_some_and(|d| t0.elapsed() >= d) {
                return Ok(());
            }
        }
    });
    if let Some(path) = &a.plot {
        let traces: Vec<mcsi_lab::plot::Trace> = tracks
            .values()
            .filter(|t| !t.points.is_empty())
            .map(|t| mcsi_lab::plot::Trace {
                label: t.label.clone(),
                points: t.points.clone(),
                events: t.events.clone(),
            })
            .collect();
        if traces.is_empty() {
            eprintln!(
                "mcsi monitor: no connection was seen; {} not written",
                path.display()
            );
        } else {
            mcsi_lab::plot::traces(
                path,
                &format!(
                    "Congestion window over time ({}), reductions marked",
                    a.addr
                ),
                "congestion window (segments)",
                &traces,
            )
            .map_err(anyhow::Error::msg)?;
            eprintln!(
                "mcsi monitor: congestion windows drawn in {}",
                path.display()
            );
        }
    }
    outcome?;
    Ok(ExitCode::SUCCESS)
}

/// Updates the tracks with a sample and returns one JSON row per connection.
fn sample(state: &State, t: f64, tracks: &mut BTreeMap<String, Track>) -> Vec<Value> {
    let mut rows = Vec::new();
    for s in &state.sessions {
        for c in &s.connections {
            let key = format!("{}/{}/{}/{}", state.side, s.tsih, c.cid, c.peer);
            let tr = tracks.entry(key).or_default();
            tr.label = format!(
                "session {} cid {} ({})",
                s.tsih,
                c.cid,
                c.congestion.as_deref().unwrap_or("?")
            );
            tr.seen_at = t;
            let Some(tcp) = c.tcp else { continue };
            let mut send_rate = None;
            let mut cut = false;
            if let Some((pt, p)) = &tr.prev {
                cut = reduced(p, &tcp);
                let dt = t - pt;
                if let (Some(a), Some(b)) = (tcp.bytes_acked, p.bytes_acked) {
                    if dt > 0.0 {
                        send_rate = Some(a.saturating_sub(b) as f64 / dt);
                    }
                }
            }
            if cut {
                tr.reductions += 1;
                tr.events.push(t);
            }
            tr.points.push((t, f64::from(tcp.cwnd)));
            tr.prev = Some((t, tcp));
            let row = json!({
                "t": (t * 1000.0).round() / 1000.0,
                "side": state.side,
                "session": s.tsih,
                "target": s.target,
                "initiator": s.initiator,
                "cid": c.cid,
                "peer": c.peer,
                "local": c.local,
                "congestion": c.congestion,
                "ca_state": tcp.ca_state.as_str(),
                "cwnd": tcp.cwnd,
                "cwnd_bytes": tcp.cwnd_bytes(),
                "ssthresh": tcp.ssthresh,
                "mss": tcp.snd_mss,
                "rtt_ms": f64::from(tcp.rtt_us) / 1000.0,
                "min_rtt_ms": tcp.min_rtt_us.map(|v| f64::from(v) / 1000.0),
                "delivery_rate": tcp.delivery_rate,
                "send_rate": send_rate,
                "in_flight": tcp.in_flight_bytes(),
                "unsent": tcp.notsent_bytes,
                "retrans": tcp.total_retrans,
                "reduced": cut,
                "reductions": tr.reductions,
            });
            let mut row = row;
            if let (Some(t), Some(m)) = (c.target_tcp, row.as_object_mut()) {
                m.insert("target_cwnd".into(), json!(t.cwnd));
                m.insert("target_cwnd_bytes".into(), json!(t.cwnd_bytes()));
                m.insert("target_ca_state".into(), json!(t.ca_state.as_str()));
                m.insert("target_rtt_ms".into(), json!(f64::from(t.rtt_us) / 1000.0));
                m.insert("target_delivery_rate".into(), json!(t.delivery_rate));
                m.insert("target_retrans".into(), json!(t.total_retrans));
            }
            tr.last = Some(row.clone());
            rows.push(row);
        }
    }
    rows
}

fn render(addr: &str, state: &State, t: f64, tracks: &BTreeMap<String, Track>) -> String {
    use std::fmt::Write as _;
    let conns: usize = state.sessions.iter().map(|s| s.connections.len()).sum();
    let mut o = String::new();
    let _ = writeln!(
        o,
        "mcsi monitor {addr}: {} side, {} session(s), {conns} connection(s), t = {t:.1} s",
        state.side,
        state.sessions.len()
    );
    // An initiator's connections each leave from their own address (route): shown before the
    // peer's.
    let routes = state.side == "initiator";
    let _ =
        writeln!(
        o,
        "{:>5} {:>4} {}{:<22} {:<6} {:<9} {:>6} {:>9} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>6}",
        "sess",
        "cid",
        if routes { format!("{:<22} ", "local") } else { String::new() },
        "peer",
        "cc",
        "state",
        "cwnd",
        "cwnd KiB",
        "ssthresh",
        "rtt ms",
        "min ms",
        "rate MB/s",
        "sent MB/s",
        "retrans",
        "cuts"
    );
    for tr in tracks.values().filter(|tr| tr.seen_at == t) {
        let Some(r) = &tr.last else { continue };
        let f = |k: &str| r[k].as_f64();
        let ss = r["ssthresh"].as_u64().unwrap_or(0);
        let _ = writeln!(
            o,
            "{:>5} {:>4} {}{:<22} {:<6} {:<9} {:>6} {:>9.0} {:>8} {:>8.2} {:>8.2} {:>9.2} {:>9.2} {:>8} {:>6}",
            r["session"].to_string(),
            r["cid"].to_string(),
            if routes {
                format!("{:<22} ", r["local"].as_str().unwrap_or(""))
            } else {
                String::new()
            },
            r["peer"].as_str().unwrap_or(""),
            r["congestion"].as_str().unwrap_or("?"),
            r["ca_state"].as_str().unwrap_or(""),
            r["cwnd"].to_string(),
            f("cwnd_bytes").unwrap_or(0.0) / 1024.0,
            if ss >= 0x7fff_ffff { "-".to_string() } else { ss.to_string() },
            f("rtt_ms").unwrap_or(0.0),
            f("min_rtt_ms").unwrap_or(0.0),
            f("delivery_rate").unwrap_or(0.0) / 1e6,
            f("send_rate").unwrap_or(0.0) / 1e6,
            r["retrans"].to_string(),
            r["reductions"].to_string(),
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use mcsi_tcp::CaState;

    #[test]
    fn reductions_are_state_entries_timeouts_and_shrinking_windows() {
        let s = |cwnd, ca_state, rto| TcpState {
            cwnd,
            ca_state,
            total_rto: Some(rto),
            ..TcpState::default()
        };
        assert!(!reduced(
            &s(100, CaState::Open, 0),
            &s(110, CaState::Open, 0)
        ));
        assert!(!reduced(
            &s(100, CaState::Open, 0),
            &s(90, CaState::Open, 0)
        ));
        assert!(reduced(&s(100, CaState::Open, 0), &s(70, CaState::Open, 0)));
        assert!(reduced(
            &s(100, CaState::Open, 0),
            &s(100, CaState::Recovery, 0)
        ));
        assert!(!reduced(
            &s(100, CaState::Recovery, 0),
            &s(100, CaState::Recovery, 0)
        ));
        assert!(reduced(&s(10, CaState::Open, 0), &s(10, CaState::Open, 1)));
        // Small windows do not count one-segment wobbles.
        assert!(!reduced(&s(4, CaState::Open, 0), &s(3, CaState::Open, 0)));
    }
}
