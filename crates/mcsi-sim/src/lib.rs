//! mcsi-sim: mcsi's own protocol code on virtual time.
//!
//! The initiator is `mcsi-initiator-core` (login machine, session core, scheduler, timers), the
//! target is mcsi-proto's login machine, `mcsi-target-core`'s session core and mcsi-scsi's
//! device server: the same crates the binaries run. Only what is around them is simulated:
//!
//! - [`tcp`]: a TCP written to behave as Linux's (Reno or CUBIC, SACK recovery, timestamps,
//!   Linux's timers and ACK rule), with its state readable as `TCP_INFO`; smoltcp's TCP can
//!   run instead;
//! - [`net`]: the hosts on a virtual clock, joined by `mcsi-link`'s link model (rate, delay,
//!   jitter, loss, Gilbert-Elliott, 802.11 airtime, several paths), the emulator's own code
//!   without its TUN devices;
//! - [`initiator`] and [`target`]: the drivers that `mcsi-initiator` and `mcsi-target` are on
//!   tokio, written synchronously;
//! - [`stream`]: PDUs to and from a socket's bytes.
//!
//! A run is deterministic: the same [`Scenario`] gives the same [`Report`] (wall time aside).

pub mod disk;
pub mod initiator;
pub mod net;
pub mod stream;
pub mod target;
pub mod tcp;
pub mod timers;

/// The target's name in every simulation.
pub const TARGET_NAME: &str = "iqn.2026-01.org.mcsi:sim";

use initiator::{Initiator, Workload};
use mcsi_link::{Link, LinkConfig, Nanos};
use mcsi_scsi::{DeviceServer, LogicalUnit, LuConfig};
use net::{Host, Net, TcpConfig};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use target::Target;

/// What to simulate.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub link: LinkConfig,
    pub tcp: TcpConfig,
    /// Initiators, each with one session.
    pub initiators: usize,
    /// Connections per session.
    pub connections: usize,
    /// The initiator's scheduler across connections (`mcsi bench --policy`).
    pub policy: String,
    pub work: Workload,
    /// The target's LUN (`ram:SIZE`).
    pub lun: String,
    /// Disks behind the LUN (seed 001's drives): commands wait for them, and the LUN takes
    /// their capacity (its data kept in sparse RAM).
    pub disk: Option<disk::DiskConfig>,
    /// The largest data segment (MaxRecvDataSegmentLength) both sides offer, seed 001's "PDU
    /// size"; None: each side's default (mcsi's initiator 256 KiB, its target's `[limits]`).
    pub pdu: Option<u32>,
    pub seed: u64,
}

/// What one initiator saw.
#[derive(Debug, Clone)]
pub struct SessionReport {
    pub ios: u64,
    pub bytes: u64,
    pub errors: u64,
    pub elapsed_s: f64,
    pub bw_mbs: f64,
    pub iops: f64,
    pub lat_mean_ms: f64,
    pub lat_p50_ms: f64,
    pub lat_p99_ms: f64,
    pub login_ms: f64,
    pub events: u64,
    pub failure: Option<String>,
}

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Report {
    pub sessions: Vec<SessionReport>,
    /// Simulated time from the first SYN to the last completion.
    pub simulated_s: f64,
    pub wall_s: f64,
    /// Throughput of all sessions together, 10^6 bytes per second of the longest session.
    pub bw_mbs: f64,
    /// I/Os of all sessions together per second of the longest session.
    pub iops: f64,
    /// Response times over every I/O of every session.
    pub lat_mean_ms: f64,
    pub lat_p50_ms: f64,
    pub lat_p99_ms: f64,
    /// Jain's fairness index over the sessions' throughputs (1: all equal).
    pub fairness: f64,
    pub target: target::TargetStats,
    /// Packets the link dropped (queue full, loss model, path down), up and down.
    pub drops: [u64; 2],
    /// Packets that entered the link, up and down.
    pub packets: [u64; 2],
    /// The disks' counts, when there are disks.
    pub disk: Option<DiskReport>,
    /// Segments the initiators' and the target's TCP retransmitted, and their retransmission
    /// timeouts (the simulator's own TCP counts them; smoltcp does not).
    pub retransmits: Option<[u64; 2]>,
    pub timeouts: Option<[u64; 2]>,
}

/// What the disks did.
#[derive(Debug, Clone, Copy)]
pub struct DiskReport {
    pub requests: u64,
    pub cache_hits: u64,
    /// Most requests queued at one drive at once.
    pub max_queue: usize,
}

/// A word (on the command line or in a scenario) that names nothing the simulator has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {given:?}: {expected}")]
pub struct UnknownName {
    /// What the word was to name ("TCP stack", "disk").
    pub what: &'static str,
    pub given: String,
    /// What it may be.
    pub expected: &'static str,
}

impl UnknownName {
    pub fn new(what: &'static str, given: &str, expected: &'static str) -> UnknownName {
        UnknownName {
            what,
            given: given.to_string(),
            expected,
        }
    }
}

/// Why a run could not be set up or did not end.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("{0}")]
    Setup(String),
    #[error("{0}")]
    Socket(#[from] net::SocketError),
    #[error("initiator: {0}")]
    Initiator(#[from] initiator::InitiatorError),
    #[error("the simulation stopped at {at_s:.3} s of virtual time: {why}")]
    Stuck { at_s: f64, why: String },
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// Runs `s` to its end: every session logged in, issued commands for the run time, and
/// drained.
pub fn run(s: &Scenario) -> Result<Report, SimError> {
    let wall = Instant::now();
    let setup = |e: String| SimError::Setup(e);
    if s.work.bs == 0 || !s.work.bs.is_multiple_of(512) {
        return Err(setup(format!("bs {}: a multiple of 512 bytes", s.work.bs)));
    }
    let lun = match &s.disk {
        Some(d) => format!("ram:{}", d.capacity()),
        None => s.lun.clone(),
    };
    let backend = mcsi_scsi::backend::open_backend(&lun).map_err(|e| setup(format!("lun: {e}")))?;
    let mut work = s.work.clone();
    work.blocks = work.blocks.min(backend.size() / 512);
    if work.blocks < u64::from(work.bs / 512) {
        return Err(setup(format!(
            "the LUN ({} bytes) is smaller than one I/O ({} bytes)",
            backend.size(),
            work.bs
        )));
    }
    let lu = Arc::new(LogicalUnit::new(backend, LuConfig::default()));
    let dev = Arc::new(DeviceServer::new(vec![(0, lu)]));
    let offer = mcsi_target_core::offer::TargetOffer::default();
    let base = Instant::now();
    let disks = s
        .disk
        .map(|d| disk::Disks::new(d, base, s.seed.wrapping_mul(0x9e37_79b9)));
    let mut params = offer.local_params();
    if let Some(pdu) = s.pdu {
        if !(512..=16_777_215).contains(&pdu) {
            return Err(setup(format!(
                "pdu {pdu}: MaxRecvDataSegmentLength is 512 to 16777215 bytes"
            )));
        }
        params.max_recv_data_segment_length = pdu;
    }
    let mut target = Target::new(dev, offer, params, disks);
    let link = Link::new(&s.link).map_err(|e| setup(format!("link: {e}")))?;

    let mut inis = Vec::with_capacity(s.initiators);
    let mut hosts = Vec::with_capacity(s.initiators);
    let mut handles = Vec::with_capacity(s.initiators);
    let mut tgt_host = Host::new(net::target_addr(), &s.tcp, s.seed ^ 0x7a7a);
    let mut listeners = Vec::new();
    for i in 0..s.initiators {
        let ini = Initiator::new(
            i,
            s.connections,
            &s.policy,
            work.clone(),
            s.pdu,
            s.seed.wrapping_add(i as u64),
        )?;
        let mut h = Host::new(
            net::initiator_addr(i),
            &s.tcp,
            s.seed.wrapping_add(1 + i as u64),
        );
        let mut hs = Vec::new();
        for c in 0..ini.conn_count() {
            hs.push(h.connect(&s.tcp, net::target_addr(), 40000 + c as u16)?);
            listeners.push((tgt_host.listen(&s.tcp)?, None::<usize>));
        }
        inis.push(ini);
        hosts.push(h);
        handles.push(hs);
    }
    let mut net = Net::new(link, hosts, tgt_host);
    let n = inis.len();
    let mut established: Vec<Vec<bool>> = handles.iter().map(|h| vec![false; h.len()]).collect();
    for ini in &mut inis {
        ini.connecting(base);
    }
    let horizon: Nanos = (s.work.runtime + Duration::from_secs(120)).as_nanos() as u64;
    let nanos = |d: Instant| d.saturating_duration_since(base).as_nanos() as u64;
    // Only what has something to do runs at an event: the initiators whose timers (their
    // driver's or their host's) are due or that were given packets, and the target's
    // connections that took in segments or were given bytes.
    let mut wake: timers::Timers<Nanos> = timers::Timers::new();
    for i in 0..n {
        wake.set(i, Some(0));
    }
    let mut picked = vec![false; n];
    let mut active: Vec<usize> = Vec::new();
    let mut delivered: Vec<usize> = Vec::new();
    let mut done = vec![false; n];
    let mut done_count = 0;
    let listener_of: HashMap<net::Sock, usize> = listeners
        .iter()
        .enumerate()
        .map(|(j, (h, _))| (*h, j))
        .collect();
    // Target connection index -> listener index.
    let mut listener_of_conn: Vec<usize> = Vec::new();
    let mut ready: Vec<net::Sock> = Vec::new();
    let mut scratch: Vec<usize> = Vec::new();
    let mut written: Vec<usize> = Vec::new();
    let mut tgt_cand: Vec<usize> = Vec::new();
    let mut in_cand = vec![false; listeners.len()];
    let mut now: Nanos = 0;
    loop {
        let t = base + Duration::from_nanos(now);
        net.carry(now, &[], &mut delivered);
        wake.pop_due(now, &mut delivered);
        for i in delivered.drain(..) {
            if !picked[i] {
                picked[i] = true;
                active.push(i);
            }
        }
        // In initiator order, as a loop over every initiator would run them.
        active.sort_unstable();
        for &i in &active {
            if net.initiator_due(i, now) {
                net.poll_initiator(i, now);
            }
        }
        if net.target_due(now) {
            net.poll_target(now);
        }
        if target.poll_timeout().is_some_and(|d| d <= t) {
            target.handle_timeout(t);
        }
        for &i in &active {
            let ini = &mut inis[i];
            if ini.wants_tcp_sample(t) {
                let states: Vec<_> = handles[i]
                    .iter()
                    .map(|h| net.initiators[i].tcp_state(*h))
                    .collect();
                ini.sample_tcp(t, &states);
            }
            if ini.poll_timeout().is_some_and(|d| d <= t) {
                ini.handle_timeout(t);
            }
        }
        // Bytes between sockets and drivers, until nothing moves.
        let mut touched_target = false;
        let mut touched = vec![false; active.len()];
        loop {
            let mut progress = false;
            for (a, &i) in active.iter().enumerate() {
                let ini = &mut inis[i];
                for (c, h) in handles[i].iter().enumerate().take(ini.conn_count()) {
                    let host = &mut net.initiators[i];
                    if !established[i][c] && host.established(*h) {
                        established[i][c] = true;
                        ini.established(c, t);
                        touched[a] = true;
                    }
                    if host.exchange(*h, ini.stream(c)) {
                        ini.receive(c, t);
                        progress = true;
                        touched[a] = true;
                    }
                }
            }
            net.target.take_ready(&mut ready, &mut scratch);
            target.take_written(&mut written);
            let conns = written.drain(..).map(|k| listener_of_conn[k]);
            for j in ready
                .drain(..)
                .filter_map(|h| listener_of.get(&h).copied())
                .chain(conns)
            {
                if !in_cand[j] {
                    in_cand[j] = true;
                    tgt_cand.push(j);
                }
            }
            // In listener order, as a loop over every connection would run them.
            tgt_cand.sort_unstable();
            for &j in &tgt_cand {
                let (h, conn) = &mut listeners[j];
                if conn.is_none() && net.target.established(*h) {
                    let k = target.accept(stream::Stream::default());
                    listener_of_conn.push(j);
                    debug_assert_eq!(listener_of_conn.len(), k + 1);
                    *conn = Some(k);
                }
                if let Some(k) = *conn {
                    if net.target.exchange(*h, target.stream(k)) {
                        if let Err(e) = target.receive(k, t) {
                            tracing::debug!(error = %e, "target connection ended");
                        }
                        progress = true;
                        touched_target = true;
                    }
                    let queued = target.stream(k).queued() + net.target.send_queue(*h);
                    target.note_send_queue(k, queued as u64);
                    if target.rtt_due(k, t) {
                        if let Some(st) = net.target.tcp_state(*h) {
                            target.note_rtt(k, t, st.rtt_us, st.min_rtt_us);
                        }
                    }
                }
            }
            if !progress {
                break;
            }
        }
        for j in tgt_cand.drain(..) {
            in_cand[j] = false;
        }
        for (a, &i) in active.iter().enumerate() {
            if touched[a] {
                net.poll_initiator(i, now);
            }
        }
        if touched_target {
            net.poll_target(now);
        }
        net.carry(now, &active, &mut delivered);
        for &i in &active {
            picked[i] = false;
            if !done[i] && inis[i].is_done() {
                done[i] = true;
                done_count += 1;
            }
            let w = [inis[i].poll_timeout().map(nanos), net.initiator_next(i)]
                .into_iter()
                .flatten()
                .min();
            wake.set(i, w);
        }
        active.clear();
        if done_count == n {
            break;
        }
        // A host given packets by the last carry takes them in now (a link without delay).
        let waiting = (!delivered.is_empty()).then_some(now);
        let next = [
            waiting,
            wake.next(),
            net.next_event(),
            target.poll_timeout().map(nanos),
        ]
        .into_iter()
        .flatten()
        .min();
        let Some(next) = next else {
            return Err(SimError::Stuck {
                at_s: now as f64 / 1e9,
                why: "nothing is due and the sessions have not ended".into(),
            });
        };
        // At least 1 µs on.
        now = next.max(now + 1000);
        if now > horizon {
            return Err(SimError::Stuck {
                at_s: now as f64 / 1e9,
                why: format!(
                    "the run time plus 120 s passed with sessions still running ({done_count} of {n} done)"
                ),
            });
        }
    }
    let sessions: Vec<SessionReport> = inis
        .iter()
        .map(|ini| {
            let m = ini.measured();
            let secs = m.elapsed.as_secs_f64();
            let per_s = |x: f64| if secs > 0.0 { x / secs } else { 0.0 };
            SessionReport {
                ios: m.ios,
                bytes: m.bytes,
                errors: m.errors,
                elapsed_s: secs,
                bw_mbs: per_s(m.bytes as f64) / 1e6,
                iops: per_s(m.ios as f64),
                lat_mean_ms: m.lat.mean() / 1000.0,
                lat_p50_ms: ms(m.lat.value_at_quantile(0.5)),
                lat_p99_ms: ms(m.lat.value_at_quantile(0.99)),
                login_ms: m.login.as_secs_f64() * 1000.0,
                events: m.events,
                failure: ini.failure().map(str::to_string),
            }
        })
        .collect();
    let longest = sessions.iter().map(|r| r.elapsed_s).fold(0.0, f64::max);
    let total: u64 = sessions.iter().map(|r| r.bytes).sum();
    let xs: Vec<f64> = sessions.iter().map(|r| r.bw_mbs).collect();
    let sum: f64 = xs.iter().sum();
    let sq: f64 = xs.iter().map(|x| x * x).sum();
    let mut lat = hdrhistogram::Histogram::<u64>::new(3)
        .map_err(|e| SimError::Setup(format!("histogram: {e}")))?;
    for ini in &inis {
        lat.add(&ini.measured().lat)
            .map_err(|e| SimError::Setup(format!("histogram: {e}")))?;
    }
    let ios: u64 = sessions.iter().map(|r| r.ios).sum();
    let counts = |h: &Host| h.retransmits();
    let ini_counts = net
        .initiators
        .iter()
        .map(counts)
        .try_fold((0, 0), |(r, t), c| c.map(|(a, b)| (r + a, t + b)));
    let tgt_counts = counts(&net.target);
    let (retransmits, timeouts) = match (ini_counts, tgt_counts) {
        (Some(i), Some(t)) => (Some([i.0, t.0]), Some([i.1, t.1])),
        _ => (None, None),
    };
    let summary = net.link.summary();
    let mut packets = [0; 2];
    for p in &summary.paths {
        packets[0] += p.up.packets_in;
        packets[1] += p.down.packets_in;
    }
    Ok(Report {
        sessions,
        simulated_s: now as f64 / 1e9,
        wall_s: wall.elapsed().as_secs_f64(),
        bw_mbs: if longest > 0.0 {
            total as f64 / longest / 1e6
        } else {
            0.0
        },
        iops: if longest > 0.0 {
            ios as f64 / longest
        } else {
            0.0
        },
        lat_mean_ms: lat.mean() / 1000.0,
        lat_p50_ms: ms(lat.value_at_quantile(0.5)),
        lat_p99_ms: ms(lat.value_at_quantile(0.99)),
        fairness: if sq > 0.0 {
            sum * sum / (xs.len() as f64 * sq)
        } else {
            1.0
        },
        target: target.stats(),
        drops: net.drops,
        packets,
        retransmits,
        timeouts,
        disk: target.disks().map(|d| DiskReport {
            requests: d.requests,
            cache_hits: d.cache_hits,
            max_queue: d.max_queue,
        }),
    })
}

impl Report {
    /// One row per session, with nothing that depends on the machine (no wall time): two runs
    /// of one scenario write the same bytes.
    pub fn write_csv(&self, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        writeln!(
            out,
            "session,ios,errors,bytes,elapsed_s,bw_mbs,iops,lat_mean_ms,lat_p50_ms,lat_p99_ms,login_ms,events"
        )?;
        for (i, s) in self.sessions.iter().enumerate() {
            writeln!(
                out,
                "{i},{},{},{},{:.6},{:.4},{:.2},{:.4},{:.4},{:.4},{:.3},{}",
                s.ios,
                s.errors,
                s.bytes,
                s.elapsed_s,
                s.bw_mbs,
                s.iops,
                s.lat_mean_ms,
                s.lat_p50_ms,
                s.lat_p99_ms,
                s.login_ms,
                s.events
            )?;
        }
        Ok(())
    }
}
