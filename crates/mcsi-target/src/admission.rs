//! Limits a peer cannot exceed: logins per second and connections in the login phase per
//! source address, TCP connections held by the server, and sessions and connections per target. Bookkeeping only; [`crate::server`] and
//! [`crate::login`] decide what to answer.
//!
//! Per-target limits are checked twice, like MaxConnections: on the first Login Request, so
//! that a full target refuses before any authentication work, and again when the session is
//! set up ([`Gate::admit_session`], [`Gate::admit_connection`]), where counting and taking a
//! place happen together so that concurrent logins cannot both take the last one.

use crate::config::ServerLimits;
use crate::session::{Shared, Target};
use mcsi_proto::login::status;
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// A counted resource with a ceiling: the connections of the server or of one target.
#[derive(Debug)]
pub struct Slots {
    used: Arc<AtomicUsize>,
    max: usize,
}

/// One place in [`Slots`], given back when dropped.
#[derive(Debug)]
pub struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Slots {
    pub fn new(max: usize) -> Self {
        Slots {
            used: Arc::new(AtomicUsize::new(0)),
            max,
        }
    }

    pub fn max(&self) -> usize {
        self.max
    }

    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// A place, if one is free.
    pub fn try_take(&self) -> Option<Slot> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                (u < self.max).then_some(u + 1)
            })
            .ok()
            .map(|_| Slot(self.used.clone()))
    }

    /// A place even when all are taken: for a reinstatement, whose predecessor is about to
    /// give its place back.
    pub fn take_anyway(&self) -> Slot {
        self.used.fetch_add(1, Ordering::AcqRel);
        Slot(self.used.clone())
    }
}

/// A login the limits refuse: the Login Response status (RFC 7143 11.13.5) and why, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied {
    pub status: (u8, u8),
    pub why: String,
}

/// Sources whose buckets are remembered at most. Beyond it, new sources pass unchecked: under a
/// flood from that many addresses the server-wide connection limit is what holds.
const MAX_SOURCES: usize = 16_384;

/// Logins per second per source: one token bucket per IPv4 address or IPv6 /64.
#[derive(Debug)]
pub struct LoginRate {
    rate: u32,
    burst: u32,
    buckets: Mutex<HashMap<IpAddr, Bucket>>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
    /// Refused since the last log line.
    refused: u64,
    logged: Option<Instant>,
}

impl Bucket {
    fn refill(&mut self, now: Instant, rate: u32, burst: u32) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * f64::from(rate)).min(f64::from(burst));
        self.at = now;
    }
}

/// A login over the rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverRate {
    /// When a log line is due (at most one a second per source, so that a flood does not flood
    /// the log too): how many logins from the source were refused since the last one.
    pub log: Option<u64>,
}

/// The unit a rate applies to: an IPv4 address, or an IPv6 /64. A host usually owns a whole /64
/// (RFC 4291 2.5.4, SLAAC), so a limit per IPv6 address would be no limit.
pub fn source(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX))),
        },
        v4 => v4,
    }
}

impl LoginRate {
    /// `rate` logins per second after a first `burst`; a rate of 0 lets everything through.
    pub fn new(rate: u32, burst: u32) -> Self {
        LoginRate {
            rate,
            burst,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a token for one login from `ip` at `now`.
    pub fn check(&self, ip: IpAddr, now: Instant) -> Result<(), OverRate> {
        if self.rate == 0 {
            return Ok(());
        }
        let (rate, burst) = (self.rate, self.burst);
        let key = source(ip);
        let mut map = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if !map.contains_key(&key) && map.len() >= MAX_SOURCES {
            // A full bucket is what a new source gets anyway: nothing to remember.
            map.retain(|_, b| {
                b.refill(now, rate, burst);
                b.tokens < f64::from(burst)
            });
            if map.len() >= MAX_SOURCES {
                return Ok(());
            }
        }
        let b = map.entry(key).or_insert(Bucket {
            tokens: f64::from(burst),
            at: now,
            refused: 0,
            logged: None,
        });
        b.refill(now, rate, burst);
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            return Ok(());
        }
        b.refused += 1;
        let due = b
            .logged
            .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1));
        if !due {
            return Err(OverRate { log: None });
        }
        b.logged = Some(now);
        let n = std::mem::take(&mut b.refused);
        Err(OverRate { log: Some(n) })
    }
}

/// Connections of one source being refused (answered 3/02 once their Login Request comes, or
/// after a short wait), at most.
pub const REFUSING_PER_SOURCE: usize = 8;

/// A plain count per source with a ceiling.
#[derive(Debug)]
pub struct PerSource {
    max: usize,
    counts: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// One place in [`PerSource`], given back when dropped.
#[derive(Debug)]
pub struct SourceSlot {
    key: IpAddr,
    counts: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut m = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.key);
            }
        }
    }
}

impl PerSource {
    pub fn new(max: usize) -> Self {
        PerSource {
            max,
            counts: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// A place for the source of `ip`, if it has fewer than the ceiling. Only sources holding a
    /// place are remembered.
    pub fn try_take(&self, ip: IpAddr) -> Option<SourceSlot> {
        let key = source(ip);
        let mut m = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(key).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(SourceSlot {
            key,
            counts: self.counts.clone(),
        })
    }
}

/// Connections in the login phase per source (an IPv4 address or an IPv6 /64). At the limit the
/// source's oldest login is dropped to make room, rather than the new one refused: resources
/// stay bounded, yet connections parked by one peer cannot lock out an initiator that shares
/// its address (NAT, or the same host) and logs in within milliseconds.
#[derive(Debug)]
pub struct InLogin {
    max: usize,
    state: Arc<Mutex<InLoginState>>,
}

#[derive(Debug, Default)]
struct InLoginState {
    /// Per source, its logins in progress, oldest first.
    sources: HashMap<IpAddr, VecDeque<(u64, Arc<Notify>)>>,
    next_id: u64,
    /// Logins dropped since the last log line, and when that was.
    evicted: u64,
    logged: Option<Instant>,
}

/// One connection's place among its source's logins in progress, given back when dropped
/// (full feature phase reached, or the connection gone).
#[derive(Debug)]
pub struct LoginPlace {
    key: IpAddr,
    id: u64,
    evict: Arc<Notify>,
    state: Arc<Mutex<InLoginState>>,
}

impl LoginPlace {
    /// Resolves when a newer login of the same source took this one's place.
    pub async fn evicted(&self) {
        self.evict.notified().await
    }
}

impl Drop for LoginPlace {
    fn drop(&mut self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = st.sources.get_mut(&self.key) {
            q.retain(|(id, _)| *id != self.id);
            if q.is_empty() {
                st.sources.remove(&self.key);
            }
        }
    }
}

/// What taking a place did besides: a login of the same source dropped, and whether a log line
/// is due for it (at most one a second for the whole server, with the count since the last).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Evicted {
    pub one: bool,
    pub log: Option<u64>,
}

impl InLogin {
    /// At most `max` per source; 0 is no limit.
    pub fn new(max: u32) -> Self {
        InLogin {
            max: max as usize,
            state: Arc::new(Mutex::new(InLoginState::default())),
        }
    }

    /// A place for one more connection of `ip` in the login phase (None without a limit),
    /// dropping the source's oldest login when it is at the limit. Only sources with a login
    /// under way are remembered, so the map is bounded by the server's connection limit.
    pub fn take(&self, ip: IpAddr, now: Instant) -> (Option<LoginPlace>, Evicted) {
        if self.max == 0 {
            return (None, Evicted::default());
        }
        let key = source(ip);
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let id = st.next_id;
        st.next_id += 1;
        let evict = Arc::new(Notify::new());
        let q = st.sources.entry(key).or_default();
        let mut out = Evicted::default();
        if q.len() >= self.max {
            if let Some((_, oldest)) = q.pop_front() {
                // A permit is kept if the login is not waiting on it yet.
                oldest.notify_one();
                out.one = true;
            }
        }
        q.push_back((id, evict.clone()));
        if out.one {
            st.evicted += 1;
            let due = st
                .logged
                .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1));
            if due {
                st.logged = Some(now);
                out.log = Some(std::mem::take(&mut st.evicted));
            }
        }
        let place = LoginPlace {
            key,
            id,
            evict,
            state: self.state.clone(),
        };
        (Some(place), out)
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Logins in progress of the source of `ip`.
    #[cfg(test)]
    fn held(&self, ip: IpAddr) -> usize {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.sources.get(&source(ip)).map_or(0, VecDeque::len)
    }
}

/// The server's admission state, built from [`ServerLimits`] and the targets' limits.
#[derive(Debug)]
pub struct Gate {
    pub limits: ServerLimits,
    pub logins: LoginRate,
    /// Connections logging in, per source.
    pub in_login: InLogin,
    /// Connections being refused for the login rate, per source.
    pub refusing: PerSource,
    /// Every TCP connection the server holds.
    pub connections: Slots,
    /// Full feature phase connections per target served (by name): a target has an entry from
    /// [`Gate::open_target`] to [`Gate::close_target`], and a login to one without is refused.
    target_connections: Mutex<HashMap<String, Arc<Slots>>>,
    /// Held while a new session is counted and registered.
    admission: Mutex<()>,
}

impl Gate {
    pub fn new(limits: ServerLimits) -> Self {
        Gate {
            limits,
            logins: LoginRate::new(limits.login_rate, limits.login_burst),
            in_login: InLogin::new(limits.max_logins_per_source),
            refusing: PerSource::new(REFUSING_PER_SOURCE),
            connections: Slots::new(limits.max_server_connections as usize),
            target_connections: Mutex::new(HashMap::new()),
            admission: Mutex::new(()),
        }
    }

    /// Counts the connections of `target` from now on (a target begins to be served).
    pub fn open_target(&self, target: &Target) {
        let max = target.limits.max_target_connections as usize;
        self.target_connections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(target.name.clone(), Arc::new(Slots::new(max)));
    }

    /// Stops admitting sessions and connections to the target `name`. Once this returns, no
    /// session of it is registered by a login that was under way: [`Gate::admit_session`]
    /// registers under the same lock.
    pub fn close_target(&self, name: &str) {
        let _g = self.admission.lock().unwrap_or_else(|p| p.into_inner());
        self.target_connections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
    }

    fn slots(&self, target: &Target) -> Result<Arc<Slots>, Denied> {
        self.target_connections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&target.name)
            .cloned()
            .ok_or(Denied {
                status: status::NOT_FOUND,
                why: format!("target {} is no longer served", target.name),
            })
    }

    /// Whether `target` has room for one more session and its first connection; `reinstates`:
    /// the login replaces a session of the same initiator port, which is not counted.
    pub fn check_session(
        &self,
        shared: &Shared,
        target: &Arc<Target>,
        reinstates: bool,
    ) -> Result<(), Denied> {
        let max = target.limits.max_sessions as usize;
        let now = sessions_of(shared, target).saturating_sub(usize::from(reinstates));
        if now >= max {
            return Err(Denied {
                status: status::OUT_OF_RESOURCES,
                why: format!(
                    "target {} already has {now} sessions (max_sessions = {max})",
                    target.name
                ),
            });
        }
        let slots = self.slots(target)?;
        if !reinstates && slots.used() >= slots.max() {
            return Err(full(target, &slots, status::OUT_OF_RESOURCES));
        }
        Ok(())
    }

    /// Registers a new session with `insert` if the target has room for it, and takes the
    /// place of its first connection. An older session it reinstates must be closed (out of
    /// the registry) already; its connections may still be counted, so the place is taken
    /// regardless then.
    pub fn admit_session(
        &self,
        shared: &Shared,
        target: &Arc<Target>,
        reinstates: bool,
        insert: impl FnOnce(),
    ) -> Result<Slot, Denied> {
        let _g = self.admission.lock().unwrap_or_else(|p| p.into_inner());
        // The target the login found must still be the one served under its name: removed
        // (and perhaps added again) meanwhile, the login is refused.
        if !shared
            .target(&target.name)
            .is_some_and(|t| Arc::ptr_eq(&t, target))
        {
            return Err(Denied {
                status: status::NOT_FOUND,
                why: format!("target {} is no longer served", target.name),
            });
        }
        self.check_session(shared, target, false)?;
        let slots = self.slots(target)?;
        let slot = if reinstates {
            slots.take_anyway()
        } else {
            slots
                .try_take()
                .ok_or_else(|| full(target, &slots, status::OUT_OF_RESOURCES))?
        };
        insert();
        Ok(slot)
    }

    /// Whether `target` has room for one more connection of an existing session. Refused with
    /// 2/06 (too many connections), the status MaxConnections gives: class 2 tells the
    /// initiator not to retry (RFC 7143 11.13.5), and the session goes on over the connections
    /// it has.
    pub fn check_connection(&self, target: &Target) -> Result<(), Denied> {
        let slots = self.slots(target)?;
        if slots.used() >= slots.max() {
            return Err(full(target, &slots, status::TOO_MANY_CONNECTIONS));
        }
        Ok(())
    }

    /// Takes the place of a connection joining a session of `target`; `reinstates`: it
    /// replaces a connection with the same CID (RFC 7143 6.3.4).
    pub fn admit_connection(&self, target: &Target, reinstates: bool) -> Result<Slot, Denied> {
        let slots = self.slots(target)?;
        if reinstates {
            return Ok(slots.take_anyway());
        }
        slots
            .try_take()
            .ok_or_else(|| full(target, &slots, status::TOO_MANY_CONNECTIONS))
    }
}

fn full(target: &Target, slots: &Slots, status: (u8, u8)) -> Denied {
    Denied {
        status,
        why: format!(
            "target {} already has {} connections (max_target_connections = {})",
            target.name,
            slots.used(),
            slots.max()
        ),
    }
}

/// Sessions of `target` in the registry.
fn sessions_of(shared: &Shared, target: &Arc<Target>) -> usize {
    shared
        .all_sessions()
        .iter()
        .filter(|s| s.target.as_ref().is_some_and(|t| Arc::ptr_eq(t, target)))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn bucket_allows_the_burst_then_the_rate() {
        let r = LoginRate::new(10, 3);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let a = ip("192.0.2.1");
        for _ in 0..3 {
            assert_eq!(r.check(a, t0), Ok(()));
        }
        // The first refusal is logged, the next ones within a second only counted.
        assert_eq!(r.check(a, t0), Err(OverRate { log: Some(1) }));
        assert_eq!(r.check(a, t0), Err(OverRate { log: None }));
        // Another source has its own bucket.
        assert_eq!(r.check(ip("192.0.2.2"), t0), Ok(()));
        // 10 per second: half a token after 50 ms, one and a half after 150 ms.
        assert_eq!(r.check(a, at(50)), Err(OverRate { log: None }));
        assert_eq!(r.check(a, at(150)), Ok(()));
        assert_eq!(r.check(a, at(150)), Err(OverRate { log: None }));
        // A second later the bucket is full again (3, not 9), and the next log line counts the
        // refusals since the last one: t0, 50 ms, 150 ms and this one.
        for _ in 0..3 {
            assert_eq!(r.check(a, at(1001)), Ok(()));
        }
        assert_eq!(r.check(a, at(1001)), Err(OverRate { log: Some(4) }));
    }

    #[test]
    fn zero_rate_is_no_limit() {
        let r = LoginRate::new(0, 0);
        let t0 = Instant::now();
        for _ in 0..1000 {
            assert_eq!(r.check(ip("192.0.2.1"), t0), Ok(()));
        }
    }

    #[test]
    fn sources_are_ipv4_addresses_and_ipv6_slash_64s() {
        assert_eq!(
            source(ip("2001:db8:1:2:aaaa:bbbb:cccc:dddd")),
            ip("2001:db8:1:2::")
        );
        assert_eq!(source(ip("::ffff:192.0.2.7")), ip("192.0.2.7"));
        assert_eq!(source(ip("192.0.2.7")), ip("192.0.2.7"));
        let r = LoginRate::new(1, 1);
        let t0 = Instant::now();
        assert_eq!(r.check(ip("2001:db8::1"), t0), Ok(()));
        assert!(
            r.check(ip("2001:db8::2"), t0).is_err(),
            "same /64, same bucket"
        );
        assert_eq!(r.check(ip("2001:db8:0:1::1"), t0), Ok(()));
    }

    #[test]
    fn remembered_sources_are_bounded() {
        let r = LoginRate::new(1, 1);
        let t0 = Instant::now();
        for i in 0..MAX_SOURCES as u32 {
            let a = IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i));
            assert_eq!(r.check(a, t0), Ok(()));
        }
        let len = |r: &LoginRate| r.buckets.lock().unwrap().len();
        assert_eq!(len(&r), MAX_SOURCES);
        // All buckets empty: a new source passes without being remembered.
        assert_eq!(r.check(ip("192.0.2.1"), t0), Ok(()));
        assert_eq!(len(&r), MAX_SOURCES);
        // Once the old buckets are full again they are forgotten and new sources counted.
        let later = t0 + Duration::from_secs(2);
        assert_eq!(r.check(ip("192.0.2.1"), later), Ok(()));
        assert_eq!(len(&r), 1);
        assert!(r.check(ip("192.0.2.1"), later).is_err());
    }

    #[tokio::test]
    async fn the_oldest_login_of_a_source_at_the_limit_makes_room() {
        let l = InLogin::new(2);
        let t0 = Instant::now();
        let take = |a: &str| l.take(ip(a), t0);
        let (a, e) = take("192.0.2.1");
        assert_eq!(e, Evicted::default());
        let (b, _) = take("192.0.2.1");
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(l.held(ip("192.0.2.1")), 2);
        // A third: the first goes, logged; the count stays at the limit.
        let (c, e) = take("192.0.2.1");
        assert_eq!(
            e,
            Evicted {
                one: true,
                log: Some(1)
            }
        );
        assert_eq!(l.held(ip("192.0.2.1")), 2);
        let gone = tokio::time::timeout(Duration::from_secs(5), a.evicted()).await;
        assert!(gone.is_ok(), "the oldest login is told to go");
        let still = tokio::time::timeout(Duration::from_millis(50), b.evicted()).await;
        assert!(still.is_err(), "the second is not");
        // Dropping an evicted place changes nothing; dropping a live one frees its place.
        drop(a);
        assert_eq!(l.held(ip("192.0.2.1")), 2);
        drop(b);
        assert_eq!(l.held(ip("192.0.2.1")), 1);
        // Another source, and the same /64 counted as one; the next eviction within a second is
        // counted but not logged, the one after a second reports both.
        assert_eq!(take("192.0.2.2").1, Evicted::default());
        let mut v6: Vec<_> = ["2001:db8::1", "2001:db8::2"]
            .iter()
            .map(|a| take(a).0)
            .collect();
        let (p3, e) = take("2001:db8::3");
        assert_eq!(
            e,
            Evicted {
                one: true,
                log: None
            }
        );
        v6.push(p3);
        let later = t0 + Duration::from_secs(1);
        let (p4, e) = l.take(ip("2001:db8::4"), later);
        assert_eq!(e.log, Some(2));
        v6.push(p4);
        drop((c, v6));
        // Sources with nothing under way are forgotten.
        assert!(l.state.lock().unwrap().sources.is_empty());
        // 0: no limit, nothing remembered.
        let off = InLogin::new(0);
        for _ in 0..100 {
            assert!(off.take(ip("192.0.2.1"), t0).0.is_none());
        }
        assert!(off.state.lock().unwrap().sources.is_empty());
    }

    #[test]
    fn per_source_counts_have_a_ceiling() {
        let p = PerSource::new(2);
        let a = p.try_take(ip("192.0.2.1"));
        let b = p.try_take(ip("::ffff:192.0.2.1"));
        assert!(a.is_some() && b.is_some());
        assert!(p.try_take(ip("192.0.2.1")).is_none());
        assert!(p.try_take(ip("192.0.2.2")).is_some());
        drop(a);
        let c = p.try_take(ip("192.0.2.1"));
        assert!(c.is_some());
        drop((b, c));
        assert!(p.counts.lock().unwrap().is_empty());
    }

    #[test]
    fn slots_count_and_give_back() {
        let s = Slots::new(2);
        let a = s.try_take();
        let b = s.try_take();
        assert!(a.is_some() && b.is_some());
        assert!(s.try_take().is_none());
        assert_eq!(s.used(), 2);
        let c = s.take_anyway();
        assert_eq!(s.used(), 3);
        drop((a, c));
        assert_eq!(s.used(), 1);
        assert!(s.try_take().is_some());
    }
}
