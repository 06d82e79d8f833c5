//! The sans-IO link: packets in with a timestamp, packets out when their time has come.

use crate::config::{LinkConfig, PathBy, PathConfig};
use crate::dir::{DirState, DropCause, Pipe};
use crate::stats::{PathStats, Summary};
use crate::wifi::Cell;
use crate::{ConfigError, Nanos};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// Direction of a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Dir {
    /// From the command toward the host.
    Up,
    /// From the host toward the command.
    Down,
}

impl Dir {
    pub fn as_str(self) -> &'static str {
        match self {
            Dir::Up => "up",
            Dir::Down => "down",
        }
    }
    fn index(self) -> usize {
        match self {
            Dir::Up => 0,
            Dir::Down => 1,
        }
    }
}

/// A packet leaving the link.
#[derive(Debug)]
pub struct Delivery {
    pub dir: Dir,
    pub path: usize,
    /// When it was due (at or before the `now` of the poll).
    pub at: Nanos,
    /// When it entered the link.
    pub arrived: Nanos,
    pub pkt: Vec<u8>,
}

/// The flow a packet belongs to, seen from the command's side so that both directions match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub proto: u8,
    pub cmd_addr: [u8; 4],
    pub cmd_port: u16,
    pub host_addr: [u8; 4],
    pub host_port: u16,
}

impl FlowKey {
    /// Reads the 5-tuple of an IPv4 packet. Ports are those of TCP and UDP (first fragment
    /// only), the identifier of ICMP echo, else 0. `None` if the packet is not IPv4.
    pub fn of(dir: Dir, pkt: &[u8]) -> Option<FlowKey> {
        if pkt.len() < 20 || pkt[0] >> 4 != 4 {
            return None;
        }
        let ihl = usize::from(pkt[0] & 0x0f) * 4;
        if ihl < 20 || pkt.len() < ihl {
            return None;
        }
        let proto = pkt[9];
        let src: [u8; 4] = pkt[12..16].try_into().ok()?;
        let dst: [u8; 4] = pkt[16..20].try_into().ok()?;
        let frag_offset = u16::from_be_bytes([pkt[6], pkt[7]]) & 0x1fff;
        let l4 = &pkt[ihl..];
        let (sport, dport) = match proto {
            6 | 17 if frag_offset == 0 && l4.len() >= 4 => (
                u16::from_be_bytes([l4[0], l4[1]]),
                u16::from_be_bytes([l4[2], l4[3]]),
            ),
            // ICMP echo request/reply: the identifier plays the port on both sides.
            1 if frag_offset == 0 && l4.len() >= 6 && matches!(l4[0], 0 | 8) => {
                let id = u16::from_be_bytes([l4[4], l4[5]]);
                (id, id)
            }
            _ => (0, 0),
        };
        Some(match dir {
            Dir::Up => FlowKey {
                proto,
                cmd_addr: src,
                cmd_port: sport,
                host_addr: dst,
                host_port: dport,
            },
            Dir::Down => FlowKey {
                proto,
                cmd_addr: dst,
                cmd_port: dport,
                host_addr: src,
                host_port: sport,
            },
        })
    }

    fn hash(&self, seed: u64) -> u64 {
        // FNV-1a: stable across runs and builds, unlike std's hasher.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
        let mut eat = |b: &[u8]| {
            for &x in b {
                h ^= u64::from(x);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        eat(&[self.proto]);
        eat(&self.cmd_addr);
        eat(&self.cmd_port.to_be_bytes());
        eat(&self.host_addr);
        eat(&self.host_port.to_be_bytes());
        h
    }
}

#[derive(Debug)]
enum PathCore {
    Wired { up: Box<Pipe>, down: Box<Pipe> },
    Wifi(Box<Cell>),
}

impl PathCore {
    fn new(cfg: &PathConfig, seed: u64, index: u64) -> Self {
        let rng = |s: u64| {
            let mut r = ChaCha8Rng::seed_from_u64(seed);
            r.set_stream(index * 3 + s);
            r
        };
        match &cfg.wifi {
            None => PathCore::Wired {
                up: Box::new(Pipe::new(cfg.up.clone(), rng(0))),
                down: Box::new(Pipe::new(cfg.down.clone(), rng(1))),
            },
            Some(w) => PathCore::Wifi(Box::new(Cell::new(
                w.clone(),
                cfg.up.clone(),
                cfg.down.clone(),
                [rng(0), rng(1), rng(2)],
            ))),
        }
    }

    fn enqueue(&mut self, dir: Dir, pkt: Vec<u8>, now: Nanos) -> Result<(), DropCause> {
        match self {
            PathCore::Wired { up, down } => match dir {
                Dir::Up => up.enqueue(pkt, now),
                Dir::Down => down.enqueue(pkt, now),
            },
            PathCore::Wifi(c) => c.enqueue(dir.index(), pkt, now),
        }
    }

    fn advance(&mut self, now: Nanos) {
        match self {
            PathCore::Wired { up, down } => {
                up.advance(now);
                down.advance(now);
            }
            PathCore::Wifi(c) => c.advance(now),
        }
    }

    fn dir(&mut self, dir: Dir) -> &mut DirState {
        match (self, dir) {
            (PathCore::Wired { up, .. }, Dir::Up) => &mut up.st,
            (PathCore::Wired { down, .. }, Dir::Down) => &mut down.st,
            (PathCore::Wifi(c), d) => c.dir(d.index()),
        }
    }

    fn next_event(&self) -> Option<Nanos> {
        match self {
            PathCore::Wired { up, down } => match (up.next_event(), down.next_event()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
            PathCore::Wifi(c) => c.next_event(),
        }
    }

    fn stats(&self) -> PathStats {
        match self {
            PathCore::Wired { up, down } => PathStats {
                up: up.st.stats.clone(),
                down: down.st.stats.clone(),
                airtime_busy_ns: 0,
            },
            PathCore::Wifi(c) => c.stats(),
        }
    }
}

/// An emulated link of one or more paths, driven by the caller's clock (nanoseconds, any
/// origin, never going backwards).
#[derive(Debug)]
pub struct Link {
    paths: Vec<PathCore>,
    path_by: PathBy,
    seed: u64,
    by_port: HashMap<u16, usize>,
    next_port_path: usize,
    /// The command side's address of each path ([`PathBy::Source`]).
    sources: Vec<[u8; 4]>,
    /// Path events not yet applied, earliest last.
    events: Vec<PathEvent>,
    /// Each path's outages: since when it has been down (None: up), and the past ones
    /// (from, to).
    down_since: Vec<Option<Nanos>>,
    outages: Vec<Vec<(Nanos, Nanos)>>,
    now: Nanos,
}

/// A path going down or coming back up at a time of the link's clock: a route that fails, scripted
/// so that the failure can be repeated exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathEvent {
    pub at: Nanos,
    pub path: usize,
    pub up: bool,
}

/// A path event (`--path-down`, `--path-up`) or control command that names no path of the
/// link, or is not written as one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("'{0}': expected PATH@TIME, e.g. 1@5s")]
    EventSyntax(String),
    #[error("'{event}': '{number}' is not a path number (0 is the first --path)")]
    EventPath { event: String, number: String },
    #[error("'{event}': {source}")]
    EventTime {
        event: String,
        source: mcsi_units::UnitError,
    },
    #[error("'{0}': expected 'down PATH', 'up PATH' or 'paths'")]
    CommandSyntax(String),
    #[error("'{0}' is not a path number (0 is the first --path)")]
    NotANumber(String),
    #[error("path {path} does not exist: the link has {paths} path(s), numbered from 0 in the order of --path")]
    NoSuchPath { path: usize, paths: usize },
}

impl PathEvent {
    /// Parses `I@TIME` (`1@5s`, `0@250ms`) for path `I` going down (`up` false) or up.
    pub fn parse(s: &str, up: bool) -> Result<PathEvent, PathError> {
        let (i, t) = s
            .split_once('@')
            .ok_or_else(|| PathError::EventSyntax(s.to_string()))?;
        let path = i
            .trim()
            .parse::<usize>()
            .map_err(|_| PathError::EventPath {
                event: s.to_string(),
                number: i.to_string(),
            })?;
        let at = mcsi_units::parse_duration(t.trim(), mcsi_units::BareUnit::Seconds)
            .map_err(|source| PathError::EventTime {
                event: s.to_string(),
                source,
            })?
            .as_nanos() as Nanos;
        Ok(PathEvent { at, path, up })
    }

    /// Checks the event against a link of `paths` paths.
    pub fn check(&self, paths: usize) -> Result<(), PathError> {
        if self.path < paths {
            Ok(())
        } else {
            Err(PathError::NoSuchPath {
                path: self.path,
                paths,
            })
        }
    }
}

impl Link {
    pub fn new(cfg: &LinkConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(Link {
            paths: cfg
                .paths
                .iter()
                .enumerate()
                .map(|(i, p)| PathCore::new(p, cfg.seed, i as u64))
                .collect(),
            path_by: cfg.path_by,
            seed: cfg.seed,
            by_port: HashMap::new(),
            next_port_path: 0,
            sources: Vec::new(),
            events: Vec::new(),
            down_since: vec![None; cfg.paths.len()],
            outages: vec![Vec::new(); cfg.paths.len()],
            now: 0,
        })
    }

    /// Schedules paths going down and up. A path that is down drops what arrives for it and
    /// what it held when it went down. Events naming a path the link lacks are an error.
    pub fn schedule(&mut self, mut events: Vec<PathEvent>) -> Result<(), PathError> {
        for e in &events {
            e.check(self.paths.len())?;
        }
        events.sort_by_key(|e| std::cmp::Reverse(e.at));
        self.events = events;
        Ok(())
    }

    /// Path `path` goes down (`up` false) or comes back at `now` (the control socket), as an
    /// event scheduled for that time would.
    pub fn set_path(&mut self, path: usize, up: bool, now: Nanos) {
        if path < self.paths.len() {
            // Events are kept earliest last; one at `now` is no later than any pending one.
            self.events.push(PathEvent { at: now, path, up });
            self.apply_events(now);
        }
    }

    /// Whether path `path` is down now.
    pub fn is_down(&self, path: usize) -> bool {
        self.down_since.get(path).is_some_and(Option::is_some)
    }

    /// Applies the path events due at `now`.
    fn apply_events(&mut self, now: Nanos) {
        while self.events.last().is_some_and(|e| e.at <= now) {
            if let Some(e) = self.events.pop() {
                let since = &mut self.down_since[e.path];
                match (*since, e.up) {
                    (None, false) => {
                        tracing::info!(path = e.path, "path down");
                        *since = Some(e.at);
                    }
                    (Some(from), true) => {
                        tracing::info!(path = e.path, "path up");
                        *since = None;
                        self.outages[e.path].push((from, e.at));
                    }
                    _ => {}
                }
            }
        }
    }

    fn count_down_drop(&mut self, path: usize, dir: Dir) {
        if let Some(p) = self.paths.get_mut(path) {
            p.dir(dir).stats.drop_down += 1;
        }
    }

    /// The command side's address of each path, for [`PathBy::Source`]: a packet from (or to)
    /// `sources[i]` takes path i, any other path 0.
    pub fn set_sources(&mut self, sources: Vec<[u8; 4]>) {
        self.sources = sources;
    }

    pub fn path_count(&self) -> usize {
        self.paths.len()
    }

    /// The path a packet takes: its flow's hash, or its command-side port's turn.
    pub fn classify(&mut self, dir: Dir, pkt: &[u8]) -> usize {
        let n = self.paths.len();
        if n == 1 {
            return 0;
        }
        let Some(key) = FlowKey::of(dir, pkt) else {
            return 0;
        };
        match self.path_by {
            PathBy::Port if key.cmd_port != 0 && matches!(key.proto, 6 | 17) => {
                let next = &mut self.next_port_path;
                *self.by_port.entry(key.cmd_port).or_insert_with(|| {
                    let p = *next % n;
                    *next += 1;
                    p
                })
            }
            PathBy::Source => self
                .sources
                .iter()
                .position(|a| *a == key.cmd_addr)
                .map_or(0, |i| i % n),
            _ => (key.hash(self.seed) % n as u64) as usize,
        }
    }

    /// Offers a packet to the link at time `now`. Ok: the path that took it.
    pub fn enqueue(
        &mut self,
        dir: Dir,
        pkt: Vec<u8>,
        now: Nanos,
    ) -> Result<usize, (usize, DropCause)> {
        let now = now.max(self.now);
        self.now = now;
        self.apply_events(now);
        let path = self.classify(dir, &pkt);
        if self.down_since.get(path).is_some_and(Option::is_some) {
            self.count_down_drop(path, dir);
            return Err((path, DropCause::Down));
        }
        let core = self.paths.get_mut(path).ok_or((path, DropCause::Queue))?;
        core.enqueue(dir, pkt, now).map_err(|c| (path, c))?;
        Ok(path)
    }

    /// The next packet due at or before `now`, earliest first; `None` when nothing is due.
    pub fn poll_transmit(&mut self, now: Nanos) -> Option<Delivery> {
        let now = now.max(self.now);
        self.now = now;
        self.apply_events(now);
        loop {
            let d = self.poll_one(now)?;
            // What a path held while it was down is lost with it.
            let p = d.path;
            let lost = self.down_since[p].is_some_and(|from| from <= d.at)
                || self.outages[p]
                    .iter()
                    .any(|&(from, to)| from <= d.at && to > d.arrived);
            if lost {
                self.count_down_drop(d.path, d.dir);
                continue;
            }
            return Some(d);
        }
    }

    fn poll_one(&mut self, now: Nanos) -> Option<Delivery> {
        let mut best: Option<(Nanos, usize, Dir)> = None;
        for (i, p) in self.paths.iter_mut().enumerate() {
            p.advance(now);
            for d in [Dir::Up, Dir::Down] {
                if let Some(t) = p.dir(d).next_release() {
                    if t <= now && best.is_none_or(|b| t < b.0) {
                        best = Some((t, i, d));
                    }
                }
            }
        }
        let (_, path, dir) = best?;
        let (at, arrived, pkt) = self.paths.get_mut(path)?.dir(dir).pop_due(now)?;
        Some(Delivery {
            dir,
            path,
            at,
            arrived,
            pkt,
        })
    }

    /// When something next happens inside the link (a packet due, a serializer or the medium
    /// freeing); `None` when the link is empty.
    pub fn next_deadline(&self) -> Option<Nanos> {
        let events = self.events.last().map(|e| e.at);
        self.paths
            .iter()
            .filter_map(PathCore::next_event)
            .chain(events)
            .min()
    }

    /// Packets inside the link (queued, in service or in a delay line).
    pub fn in_flight(&mut self) -> usize {
        self.paths
            .iter_mut()
            .map(|p| {
                let mut n = 0;
                for d in [Dir::Up, Dir::Down] {
                    let s = p.dir(d);
                    n += s.queue.len() + s.in_flight();
                }
                n
            })
            .sum()
    }

    pub fn summary(&self) -> Summary {
        Summary {
            elapsed_ns: 0,
            paths: self.paths.iter().map(PathCore::stats).collect(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::LossModel;
    use std::time::Duration;

    fn tcp(dir: Dir, cmd_port: u16, host_port: u16) -> Vec<u8> {
        let mut p = vec![0u8; 40];
        p[0] = 0x45;
        p[9] = 6;
        let (cmd, host) = ([100, 64, 0, 2], [100, 64, 0, 1]);
        let (src, dst, sp, dp) = match dir {
            Dir::Up => (cmd, host, cmd_port, host_port),
            Dir::Down => (host, cmd, host_port, cmd_port),
        };
        p[12..16].copy_from_slice(&src);
        p[16..20].copy_from_slice(&dst);
        p[20..22].copy_from_slice(&sp.to_be_bytes());
        p[22..24].copy_from_slice(&dp.to_be_bytes());
        p
    }

    #[test]
    fn a_path_that_goes_down_loses_what_it_holds_and_what_comes() {
        let mut p = PathConfig::default();
        p.apply_spec("delay=3ms").unwrap();
        let mut l = Link::new(&cfg(vec![p], PathBy::Hash)).unwrap();
        let ms = 1_000_000;
        l.schedule(vec![
            PathEvent::parse("0@2ms", true).unwrap(),
            PathEvent::parse("0@1ms", false).unwrap(),
        ])
        .unwrap();
        assert!(l
            .schedule(vec![PathEvent::parse("1@1ms", false).unwrap()])
            .is_err());
        l.schedule(vec![
            PathEvent {
                at: 2 * ms,
                path: 0,
                up: true,
            },
            PathEvent {
                at: ms,
                path: 0,
                up: false,
            },
        ])
        .unwrap();
        // Queued before the failure, due after it: lost.
        assert!(l.enqueue(Dir::Up, tcp(Dir::Up, 1, 2), 0).is_ok());
        assert_eq!(l.next_deadline(), Some(ms), "the event wakes the caller");
        // Arrives while the path is down: refused.
        assert_eq!(
            l.enqueue(Dir::Up, tcp(Dir::Up, 1, 2), ms + ms / 2),
            Err((0, DropCause::Down))
        );
        // After the path is back: delivered.
        assert!(l
            .enqueue(Dir::Down, tcp(Dir::Down, 1, 2), 2 * ms + ms / 2)
            .is_ok());
        let mut got = Vec::new();
        for t in (0..20).map(|i| i * ms / 2) {
            while let Some(d) = l.poll_transmit(t) {
                got.push((d.dir, d.at));
            }
        }
        assert_eq!(got, vec![(Dir::Down, 5 * ms + ms / 2)]);
        let s = l.summary();
        assert_eq!((s.paths[0].up.drop_down, s.paths[0].down.drop_down), (2, 0));
    }

    #[test]
    fn path_events_parse() {
        assert_eq!(
            PathEvent::parse("1@5s", false).unwrap(),
            PathEvent {
                at: 5_000_000_000,
                path: 1,
                up: false
            }
        );
        assert_eq!(PathEvent::parse("0@250ms", true).unwrap().at, 250_000_000);
        assert_eq!(
            PathEvent::parse("1", false),
            Err(PathError::EventSyntax("1".into()))
        );
        assert!(PathError::EventSyntax("1".into())
            .to_string()
            .contains("PATH@TIME"));
        assert_eq!(
            PathEvent::parse("x@1s", false),
            Err(PathError::EventPath {
                event: "x@1s".into(),
                number: "x".into()
            })
        );
        assert!(matches!(
            PathEvent::parse("1@soon", false),
            Err(PathError::EventTime { .. })
        ));
    }

    #[test]
    fn source_addresses_pick_their_paths_in_both_directions() {
        let mut l = Link::new(&cfg(vec![PathConfig::default(); 2], PathBy::Source)).unwrap();
        l.set_sources(vec![[100, 64, 0, 2], [100, 64, 0, 3]]);
        let from = |src: [u8; 4], dir: Dir| {
            let mut p = tcp(dir, 40000, 3260);
            let at = if dir == Dir::Up { 12 } else { 16 };
            p[at..at + 4].copy_from_slice(&src);
            p
        };
        for dir in [Dir::Up, Dir::Down] {
            // Whatever the port, the source address decides.
            assert_eq!(l.classify(dir, &from([100, 64, 0, 2], dir)), 0);
            assert_eq!(l.classify(dir, &from([100, 64, 0, 3], dir)), 1);
            // An address of no path takes path 0.
            assert_eq!(l.classify(dir, &from([100, 64, 0, 9], dir)), 0);
        }
    }

    fn cfg(paths: Vec<PathConfig>, by: PathBy) -> LinkConfig {
        LinkConfig {
            paths,
            path_by: by,
            seed: 5,
        }
    }

    #[test]
    fn both_directions_of_a_flow_take_one_path() {
        let mut l = Link::new(&cfg(vec![PathConfig::default(); 4], PathBy::Hash)).unwrap();
        let mut used = [0; 4];
        for port in 40000..40400 {
            let a = l.classify(Dir::Up, &tcp(Dir::Up, port, 5201));
            let b = l.classify(Dir::Down, &tcp(Dir::Down, port, 5201));
            assert_eq!(a, b);
            used[a] += 1;
        }
        // 400 flows over 4 paths: each gets 100 +- 30 (> 5 sd of a binomial).
        assert!(used.iter().all(|&u| (70..=130).contains(&u)), "{used:?}");
    }

    #[test]
    fn by_port_spreads_connections_in_turn() {
        let mut l = Link::new(&cfg(vec![PathConfig::default(); 2], PathBy::Port)).unwrap();
        // Even ports only, as Linux picks them for connect(): still alternate.
        let p: Vec<usize> = [40000u16, 40002, 40004, 40006]
            .iter()
            .map(|&port| l.classify(Dir::Up, &tcp(Dir::Up, port, 3260)))
            .collect();
        assert_eq!(p, vec![0, 1, 0, 1]);
        assert_eq!(l.classify(Dir::Down, &tcp(Dir::Down, 40002, 3260)), 1);
    }

    #[test]
    fn paths_have_their_own_delay() {
        let mut a = PathConfig::default();
        a.apply_spec("delay=10ms").unwrap();
        let mut b = PathConfig::default();
        b.apply_spec("delay=30ms").unwrap();
        let mut l = Link::new(&cfg(vec![a, b], PathBy::Port)).unwrap();
        assert_eq!(l.enqueue(Dir::Up, tcp(Dir::Up, 1000, 1), 0).unwrap(), 0);
        assert_eq!(l.enqueue(Dir::Up, tcp(Dir::Up, 1002, 1), 0).unwrap(), 1);
        assert_eq!(l.next_deadline(), Some(10_000_000));
        let d = l.poll_transmit(10_000_000).unwrap();
        assert_eq!((d.path, d.at), (0, 10_000_000));
        assert!(l.poll_transmit(29_999_999).is_none());
        let d = l.poll_transmit(30_000_000).unwrap();
        assert_eq!((d.path, d.dir), (1, Dir::Up));
        assert_eq!(l.next_deadline(), None);
        let s = l.summary();
        assert_eq!(s.paths[1].up.packets_out, 1);
    }

    #[test]
    fn seeded_runs_repeat_and_loss_applies_per_direction() {
        let run = |seed| {
            let mut p = PathConfig::default();
            p.up.loss = LossModel::Bernoulli(0.3);
            p.down.delay = Duration::from_micros(10);
            let mut l = Link::new(&LinkConfig {
                paths: vec![p],
                path_by: PathBy::Hash,
                seed,
            })
            .unwrap();
            let mut fate = vec![];
            for i in 0..1000u64 {
                fate.push(l.enqueue(Dir::Up, tcp(Dir::Up, 1, 2), i * 1000).is_ok());
                assert!(l.enqueue(Dir::Down, tcp(Dir::Down, 1, 2), i * 1000).is_ok());
            }
            fate
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
        let kept = run(1).iter().filter(|&&x| x).count();
        assert!((620..=780).contains(&kept), "{kept}");
    }

    #[test]
    fn flow_key_parsing() {
        assert!(FlowKey::of(Dir::Up, &[0x60; 40]).is_none());
        assert!(FlowKey::of(Dir::Up, &[0x45; 10]).is_none());
        let k = FlowKey::of(Dir::Down, &tcp(Dir::Down, 40000, 3260)).unwrap();
        assert_eq!((k.cmd_port, k.host_port), (40000, 3260));
        // Truncated TCP header: no ports, no panic.
        let mut t = tcp(Dir::Up, 1, 2);
        t.truncate(22);
        assert_eq!(FlowKey::of(Dir::Up, &t).unwrap().cmd_port, 0);
    }
}
