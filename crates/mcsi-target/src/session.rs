//! Targets, sessions and the session registry.
//!
//! A session owns many connections from the start (RFC 7143 MC/S): one CmdSN window across all of
//! them (commands reach SCSI in CmdSN order whichever connection carried them), one task table
//! keyed by ITT with each task's connection allegiance, and one task set per LUN. StatSN is per
//! connection and assigned by the connection's writer.

use crate::config::{AuthSpec, Limits};
use crate::counters::{ConnCounters, LunMetrics};
use crate::session_core::{Expired, SessionCore};
use mcsi_proto::pdu::{Isid, Pdu};
use mcsi_proto::vendor::ConnRole;
use mcsi_scsi::{DeviceServer, Nexus, TaskAttribute};
use mcsi_target_core::retain::{LogPool, SentLog};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

/// Task management and logout requests a session handles at once (each waits for the tasks it
/// aborts to end). Immediate ones are not bounded by the CmdSN window: beyond this many, an
/// immediate request is rejected (reason 0x06, too many immediate commands, RFC 7143 11.17.1).
pub const MAX_CONTROL_TASKS: usize = 16;

/// How often a response connection's TCP state is fed to a load-aware response policy.
pub const TCP_SAMPLE_PERIOD: std::time::Duration = std::time::Duration::from_millis(10);

/// One iSCSI target: a name, its portals (one portal group) and its LUNs.
pub struct Target {
    pub name: String,
    pub alias: Option<String>,
    /// The addresses it is served on (bound: a portal asked with port 0 has its port here).
    /// `mcsi ctl` and a reload may change them while the target runs.
    pub portals: arc_swap::ArcSwap<Vec<SocketAddr>>,
    /// What SendTargets gives in place of the portals (empty: the portals).
    pub advertise: Vec<String>,
    /// Where logins are sent instead of being served (none: served).
    pub redirect: Option<crate::config::Redirect>,
    /// Target portal group tag (one portal group per target): the relative target port
    /// identifier of its port.
    pub tpgt: u16,
    /// ALUA target port groups, given to each of its LUNs (none: no ALUA). A reload may change
    /// them while the target runs ([`Target::set_alua`]).
    pub alua: arc_swap::ArcSwapOption<mcsi_scsi::alua::Alua>,
    /// The LUN maps: for each mapped initiator, the units of `dev` it sees, under its numbers.
    /// A LUN added to or removed from the target is added to or removed from them too; a
    /// reload or `mcsi ctl` changes them with [`Target::set_lun_maps`].
    pub views: arc_swap::ArcSwap<Vec<Arc<LunView>>>,
    /// Counts the changes of `views` that may switch an initiator between its map and the
    /// whole target: a session that resolved its units before the last one resolves them again
    /// ([`Session::units`]).
    views_gen: AtomicU64,
    /// Held through each change of the units and their port groups ([`Target::add_unit`],
    /// [`Target::remove_unit`], [`Target::set_alua`]): each is one transition, so a unit added
    /// while the port groups change cannot keep the old ones.
    changing: Mutex<()>,
    pub limits: Limits,
    /// Authentication and access control of this target (each login reads it once; `mcsi
    /// ctl` may replace it while the target runs).
    pub auth: arc_swap::ArcSwap<AuthSpec>,
    pub dev: Arc<DeviceServer>,
    /// Metric handles of each LUN, by LUN number (as the inventory changes, so does this).
    pub lun_metrics: arc_swap::ArcSwap<Vec<(u16, LunMetrics)>>,
    /// QoS rates of the sessions admitted so far (admission control against `qos_capacity`).
    pub qos_admitted: Arc<Mutex<QosLedger>>,
    /// QoS of the sessions of the initiators named here, in place of `limits.qos`.
    pub qos_initiators: Vec<(String, crate::config::QosSpec)>,
}

/// One initiator's view of a target's LUNs ([`crate::config::LunMap`]).
pub struct LunView {
    /// The initiator's name, lower case.
    pub initiator: String,
    /// Its LUN numbers, each to the target's (changed in place by [`Target::set_lun_maps`]).
    pub map: arc_swap::ArcSwap<std::collections::BTreeMap<u16, u16>>,
    /// The mapped units under its numbers: what its sessions address.
    pub dev: Arc<DeviceServer>,
}

impl LunView {
    /// The view `m` gives of the units `luns` (by the target's numbers).
    fn new(m: &crate::config::LunMap, luns: &[(u16, Arc<mcsi_scsi::LogicalUnit>)]) -> LunView {
        let units = m
            .luns
            .iter()
            .filter_map(|(seen, n)| {
                let (_, lu) = luns.iter().find(|(i, _)| i == n)?;
                Some((*seen, lu.clone()))
            })
            .collect();
        LunView {
            initiator: m.initiator.clone(),
            map: arc_swap::ArcSwap::from_pointee(m.luns.clone()),
            dev: Arc::new(DeviceServer::new(units)),
        }
    }
}

/// Bytes per second reserved by the sessions in, each way.
#[derive(Debug, Default, Clone, Copy)]
pub struct QosLedger {
    pub to_client: u64,
    pub to_storage: u64,
}

/// A session's share of its target's QoS capacity, given back when dropped.
#[derive(Debug)]
pub struct QosReservation {
    ledger: Arc<Mutex<QosLedger>>,
    to_client: u64,
    to_storage: u64,
}

impl Drop for QosReservation {
    fn drop(&mut self) {
        let mut l = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        l.to_client = l.to_client.saturating_sub(self.to_client);
        l.to_storage = l.to_storage.saturating_sub(self.to_storage);
    }
}

impl Target {
    /// The QoS of a session of `initiator`: its own if named, else the target's.
    pub fn qos_for(&self, initiator: &str) -> Option<crate::config::QosSpec> {
        crate::config::qos_for(&self.qos_initiators, self.limits.qos, initiator)
    }

    /// Reserves `rates` against `capacity` (each way), or says what is left.
    pub fn reserve_qos(
        &self,
        rates: &mcsi_target_core::qos::Rates,
        capacity: u64,
    ) -> Result<QosReservation, QosLedger> {
        let need_c = rates.to_client.map_or(0, |r| r.0);
        let need_s = rates.to_storage.map_or(0, |r| r.0);
        let mut l = self.qos_admitted.lock().unwrap_or_else(|e| e.into_inner());
        mcsi_target_core::qos::admit((need_c, need_s), (l.to_client, l.to_storage), capacity)
            .map_err(|(c, s)| QosLedger {
                to_client: c,
                to_storage: s,
            })?;
        l.to_client += need_c;
        l.to_storage += need_s;
        Ok(QosReservation {
            ledger: self.qos_admitted.clone(),
            to_client: need_c,
            to_storage: need_s,
        })
    }
}

impl Target {
    /// A target as it is served, with its LUNs opened (`luns`: by number, with their metric
    /// handles in `lun_metrics`) and its portals as bound.
    pub(crate) fn new(
        t: &crate::config::TargetSpec,
        luns: Vec<(u16, Arc<mcsi_scsi::LogicalUnit>)>,
        portals: Vec<SocketAddr>,
        lun_metrics: &[(u16, LunMetrics)],
    ) -> Arc<Target> {
        for (_, lu) in &luns {
            lu.set_alua(t.alua.clone());
        }
        let views = t
            .lun_maps
            .iter()
            .map(|m| Arc::new(LunView::new(m, &luns)))
            .collect();
        Arc::new(Target {
            views: arc_swap::ArcSwap::from_pointee(views),
            views_gen: AtomicU64::new(0),
            changing: Mutex::new(()),
            lun_metrics: arc_swap::ArcSwap::from_pointee(lun_metrics.to_vec()),
            name: t.iqn.clone(),
            alias: t.alias.clone(),
            portals: arc_swap::ArcSwap::from_pointee(portals),
            advertise: t.advertise.clone(),
            redirect: t.redirect.clone(),
            tpgt: t.tpgt,
            alua: arc_swap::ArcSwapOption::from(t.alua.clone().map(Arc::new)),
            limits: t.limits,
            auth: arc_swap::ArcSwap::from_pointee(t.auth.clone()),
            dev: Arc::new(mcsi_scsi::DeviceServer::new(luns)),
            qos_admitted: Arc::default(),
            qos_initiators: t.qos_initiators.clone(),
        })
    }

    /// Changes the ALUA target port groups of the target and every LUN it has: a LUN whose
    /// groups change tells its nexuses (ASYMMETRIC ACCESS STATE CHANGED). True if they changed.
    pub fn set_alua(&self, next: Option<mcsi_scsi::alua::Alua>) -> bool {
        let _one = self.changing.lock().unwrap_or_else(|p| p.into_inner());
        if self.alua.load().as_deref() == next.as_ref() {
            return false;
        }
        self.alua.store(next.clone().map(Arc::new));
        for (_, lu) in self.dev.luns().iter() {
            lu.set_alua(next.clone());
        }
        true
    }

    /// The LUN map of `initiator`, if it has one.
    pub fn view_of(&self, initiator: &str) -> Option<Arc<LunView>> {
        self.views
            .load()
            .iter()
            .find(|v| v.initiator.eq_ignore_ascii_case(initiator))
            .cloned()
    }

    /// Changes the LUN maps to `maps` (checked against the target's LUNs), as one transition
    /// of the units. A map that stays changes in place: its initiator's sessions meet the LUNs
    /// it gains and loses at their next command (REPORTED LUNS DATA HAS CHANGED). An initiator
    /// that gains or loses a map has its sessions switched to it, or to the whole target, at
    /// their next command, with the same unit attention. True if anything changed.
    pub fn set_lun_maps(&self, maps: &[crate::config::LunMap]) -> bool {
        let _one = self.changing.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.views.load_full();
        let units = self.dev.luns();
        let unit = |n: &u16| units.iter().find(|(i, _)| i == n).map(|(_, u)| u.clone());
        let mut next = Vec::with_capacity(maps.len());
        let mut changed = false;
        let mut switched = false;
        for m in maps {
            let Some(v) = now
                .iter()
                .find(|v| v.initiator.eq_ignore_ascii_case(&m.initiator))
            else {
                next.push(Arc::new(LunView::new(m, &units)));
                switched = true;
                continue;
            };
            let was = v.map.load_full();
            if *was != m.luns {
                for (seen, n) in was.iter() {
                    if m.luns.get(seen) != Some(n) {
                        let _ = v.dev.remove(*seen);
                    }
                }
                for (seen, n) in &m.luns {
                    if was.get(seen) != Some(n) {
                        if let Some(u) = unit(n) {
                            let _ = v.dev.add(*seen, u);
                        }
                    }
                }
                v.map.store(Arc::new(m.luns.clone()));
                changed = true;
            }
            next.push(v.clone());
        }
        switched |= now.iter().any(|v| {
            !maps
                .iter()
                .any(|m| m.initiator.eq_ignore_ascii_case(&v.initiator))
        });
        if switched {
            self.views.store(Arc::new(next));
            self.views_gen.fetch_add(1, Ordering::AcqRel);
        }
        changed || switched
    }

    /// Adds `unit` as LUN `n`: to the target's units, with the target's port groups, and to
    /// the LUN maps that name `n` (each view tells its nexuses REPORTED LUNS DATA HAS CHANGED).
    /// The views follow the inventory here and in [`Target::remove_unit`] only. The unit has
    /// its port groups before any command reaches it.
    pub fn add_unit(
        &self,
        n: u16,
        unit: Arc<mcsi_scsi::LogicalUnit>,
    ) -> Result<(), mcsi_scsi::InventoryError> {
        let _one = self.changing.lock().unwrap_or_else(|p| p.into_inner());
        unit.set_alua(self.alua.load().as_deref().cloned());
        self.dev.add(n, unit.clone())?;
        for v in self.views.load().iter() {
            for (seen, _) in v.map.load().iter().filter(|(_, t)| **t == n) {
                let _ = v.dev.add(*seen, unit.clone());
            }
        }
        Ok(())
    }

    /// Removes LUN `n` from the target's units and from the LUN maps that name it; returns
    /// its unit (commands that hold it finish on it).
    pub fn remove_unit(
        &self,
        n: u16,
    ) -> Result<Arc<mcsi_scsi::LogicalUnit>, mcsi_scsi::InventoryError> {
        let _one = self.changing.lock().unwrap_or_else(|p| p.into_inner());
        let unit = self.dev.remove(n)?;
        for v in self.views.load().iter() {
            for (seen, _) in v.map.load().iter().filter(|(_, t)| **t == n) {
                let _ = v.dev.remove(*seen);
            }
        }
        Ok(unit)
    }

    /// The metric handles of the target's LUN `lun` (None: no LUN), `f` with them (the
    /// handles are borrowed from the inventory of the moment).
    pub fn with_lun_metrics<R>(
        &self,
        lun: Option<u16>,
        f: impl FnOnce(Option<&LunMetrics>) -> R,
    ) -> R {
        let all = self.lun_metrics.load();
        let m = lun.and_then(|idx| all.iter().find(|(i, _)| *i == idx).map(|(_, m)| m));
        f(m)
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("name", &self.name)
            .field("portals", &self.portals.load())
            .finish()
    }
}

/// Resolves once the flag behind `rx` is true (or its sender is gone).
pub async fn flag_set(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// State shared by every connection of the server.
pub struct Shared {
    /// The targets served ([`Shared::targets`]); the administration adds and removes them.
    targets: arc_swap::ArcSwap<Vec<Arc<Target>>>,
    /// Authentication and access control of discovery sessions.
    pub discovery_auth: AuthSpec,
    sessions: Mutex<HashMap<u16, Arc<Session>>>,
    next_tsih: AtomicU16,
    /// The server-wide write budget in KiB ([`Session::write_permits`]).
    write_budget: Budget,
    /// The server-wide read budget in KiB ([`Session::read_permit`]).
    read_budget: Budget,
    /// The server-wide budget of unsolicited write data, counted by each session's core
    /// ([`SessionCore::set_unsolicited_budget`]).
    unsolicited_budget: Arc<Budget>,
    /// The server-wide budget of answers kept for reassignment, counted by each session's
    /// core ([`SessionCore::set_retention_budget`]).
    retention_budget: Arc<Budget>,
    /// What every connection's sent-PDU log keeps ([`LogPool`]).
    pub log_pool: Arc<LogPool>,
    /// CHAP users whose logins failed lately ([`ChapThrottle`]).
    pub chap_throttle: ChapThrottle,
    /// Administrative changes, one at a time ([`crate::admin::Admin`]): held across the
    /// opening of a LUN's backend, so an async lock.
    admin: tokio::sync::Mutex<()>,
}

/// Failed CHAP logins per configured user: the first failure is free (a typo), and after the
/// k-th in a row (k >= 2) the user's credentials are left out of logins for min(2^(k-2), 60)
/// seconds (such a login fails as an unknown user), which turns an online guess of a secret
/// into a crawl. A success clears the count, and so do 10 minutes without a failure. Only
/// configured users are counted, so the table is as large as the configuration.
#[derive(Debug, Default, Clone)]
pub struct ChapThrottle {
    users: Arc<Mutex<HashMap<String, (u32, std::time::Instant)>>>,
}

impl ChapThrottle {
    const FORGET: std::time::Duration = std::time::Duration::from_secs(600);
    const MAX_LOCK: std::time::Duration = std::time::Duration::from_secs(60);

    fn map(&self) -> MutexGuard<'_, HashMap<String, (u32, std::time::Instant)>> {
        self.users.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A failed response for `user` (a configured one).
    pub fn failed(&self, user: &str, now: std::time::Instant) {
        let mut m = self.map();
        let e = m.entry(user.to_string()).or_insert((0, now));
        if now.duration_since(e.1) > Self::FORGET {
            e.0 = 0;
        }
        e.0 = e.0.saturating_add(1);
        e.1 = now;
    }

    pub fn succeeded(&self, user: &str) {
        self.map().remove(user);
    }

    /// How much longer `user` is locked out, if at all.
    pub fn locked(&self, user: &str, now: std::time::Instant) -> Option<std::time::Duration> {
        let m = self.map();
        let (n, last) = *m.get(user)?;
        if n < 2 {
            return None;
        }
        let lock = std::time::Duration::from_secs(1u64 << (n - 2).min(6)).min(Self::MAX_LOCK);
        let until = last + lock;
        (now < until).then(|| until - now)
    }
}

/// A byte budget as a semaphore of KiB (the session's read and write budgets, the server's
/// write budget): a request larger than the whole budget waits for all of it.
#[derive(Debug)]
pub struct Budget {
    sem: Arc<tokio::sync::Semaphore>,
    kib: u32,
}

impl Budget {
    pub fn new(bytes: u64) -> Budget {
        let kib = bytes.div_ceil(1024).clamp(1, u64::from(u32::MAX)) as u32;
        Budget {
            sem: Arc::new(tokio::sync::Semaphore::new(kib as usize)),
            kib,
        }
    }

    fn share(&self, bytes: u32) -> u32 {
        bytes.div_ceil(1024).clamp(1, self.kib)
    }

    /// Takes room for `bytes` now, if there is.
    fn try_take(&self, bytes: u32) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.sem
            .clone()
            .try_acquire_many_owned(self.share(bytes))
            .ok()
    }

    /// Waits for room for `bytes` (first come, first served).
    async fn take(&self, bytes: u32) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.sem
            .clone()
            .acquire_many_owned(self.share(bytes))
            .await
            .ok()
    }
}

/// The core counts unsolicited data in it: room taken is forgotten by the semaphore and added
/// back when the core gives it back.
impl mcsi_target_core::session::SharedBudget for Budget {
    fn try_take(&self, bytes: u32) -> bool {
        self.sem
            .try_acquire_many(self.share(bytes))
            .map(|p| p.forget())
            .is_ok()
    }

    fn give_back(&self, bytes: u32) {
        self.sem.add_permits(self.share(bytes) as usize);
    }
}

/// A read's or a write's share of its session's and the server's budgets of its kind, given
/// back when dropped (a write's when its task ends, a read's once its Data-In is on its way).
pub struct Permits {
    _session: tokio::sync::OwnedSemaphorePermit,
    _server: tokio::sync::OwnedSemaphorePermit,
}

impl Permits {
    /// Room for `bytes` in both budgets now, if both have it.
    fn try_take(session: &Budget, server: &Budget, bytes: u32) -> Option<Permits> {
        Some(Permits {
            _session: session.try_take(bytes)?,
            _server: server.try_take(bytes)?,
        })
    }

    /// Waits for room in the session's budget, then in the server's (each first come, first
    /// served).
    async fn take(session: &Budget, server: &Budget, bytes: u32) -> Option<Permits> {
        Some(Permits {
            _session: session.take(bytes).await?,
            _server: server.take(bytes).await?,
        })
    }
}

impl Shared {
    pub fn new(targets: Vec<Arc<Target>>, discovery_auth: AuthSpec) -> Self {
        Self::with_budgets(
            targets,
            discovery_auth,
            &crate::config::ServerLimits::default(),
        )
    }

    /// With the server-wide write budgets of `limits`.
    pub fn with_budgets(
        targets: Vec<Arc<Target>>,
        discovery_auth: AuthSpec,
        limits: &crate::config::ServerLimits,
    ) -> Self {
        Shared {
            targets: arc_swap::ArcSwap::from_pointee(targets),
            discovery_auth,
            sessions: Mutex::new(HashMap::new()),
            next_tsih: AtomicU16::new(1),
            write_budget: Budget::new(limits.write_budget),
            read_budget: Budget::new(limits.read_budget),
            unsolicited_budget: Arc::new(Budget::new(limits.unsolicited_budget)),
            retention_budget: Arc::new(Budget::new(limits.retention_budget)),
            log_pool: LogPool::new(limits.sent_log_budget),
            chap_throttle: ChapThrottle::default(),
            admin: tokio::sync::Mutex::new(()),
        }
    }

    /// Held while an administrative change is made: changes do not interleave.
    pub async fn admin_lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.admin.lock().await
    }

    /// The targets served now (one read: a change meanwhile shows whole or not at all).
    pub fn targets(&self) -> Arc<Vec<Arc<Target>>> {
        self.targets.load_full()
    }

    pub fn target(&self, name: &str) -> Option<Arc<Target>> {
        self.targets.load().iter().find(|t| t.name == name).cloned()
    }

    /// Replaces the list of targets with `f` of it (the administration, under its lock).
    pub(crate) fn set_targets(&self, f: impl Fn(&[Arc<Target>]) -> Vec<Arc<Target>>) {
        self.targets.rcu(|v| f(v));
    }

    fn sessions(&self) -> MutexGuard<'_, HashMap<u16, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A TSIH not in use (never 0, RFC 7143 11.12.6); `None` when all 65,535 are.
    pub fn alloc_tsih(&self) -> Option<u16> {
        let map = self.sessions();
        if map.len() >= usize::from(u16::MAX) {
            return None;
        }
        (0..=u16::MAX).find_map(|_| {
            let t = self.next_tsih.fetch_add(1, Ordering::Relaxed);
            (t != 0 && !map.contains_key(&t)).then_some(t)
        })
    }

    pub fn session(&self, tsih: u16) -> Option<Arc<Session>> {
        self.sessions().get(&tsih).cloned()
    }

    /// The session of this initiator port (name + ISID) on this target, if any: the one a new
    /// leading login reinstates (RFC 7143 6.3.5).
    pub fn find_session(
        &self,
        initiator: &str,
        isid: Isid,
        target: Option<&str>,
    ) -> Option<Arc<Session>> {
        self.sessions()
            .values()
            .find(|s| {
                s.isid == isid
                    && s.initiator_name == initiator
                    && s.target.as_ref().map(|t| t.name.as_str()) == target
            })
            .cloned()
    }

    pub fn insert(&self, s: Arc<Session>) {
        self.sessions().insert(s.tsih, s);
    }

    /// Inserts a new session and takes out every other session of the same initiator port on
    /// the same target, in one step (reinstatement, RFC 7143 6.3.5): of leading logins of one
    /// port racing each other, the last one in keeps the only session. The caller closes what
    /// is returned.
    pub fn insert_reinstating(&self, s: Arc<Session>) -> Vec<Arc<Session>> {
        let mut map = self.sessions();
        let same: Vec<u16> = map
            .values()
            .filter(|o| {
                o.isid == s.isid
                    && o.initiator_name == s.initiator_name
                    && o.target.as_ref().map(|t| t.name.as_str())
                        == s.target.as_ref().map(|t| t.name.as_str())
            })
            .map(|o| o.tsih)
            .collect();
        let displaced = same.iter().filter_map(|t| map.remove(t)).collect();
        map.insert(s.tsih, s);
        displaced
    }

    fn remove(&self, s: &Session) {
        let mut map = self.sessions();
        if map
            .get(&s.tsih)
            .is_some_and(|x| std::ptr::eq(Arc::as_ptr(x), s))
        {
            map.remove(&s.tsih);
        }
    }

    /// Every live session, for target-wide task management and shutdown.
    pub fn all_sessions(&self) -> Vec<Arc<Session>> {
        self.sessions().values().cloned().collect()
    }
}

/// Operational values of a session that the full feature phase uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionOps {
    pub max_connections: u16,
    /// What shapes a write's data (InitialR2T, ImmediateData, FirstBurstLength, MaxBurstLength,
    /// MaxOutstandingR2T).
    pub burst: crate::transfer::BurstParams,
    pub queue_depth: u32,
    /// The asymmetric mode of thesis 4.3.2 (`X-org.mcsi.Asymmetric`, [`mcsi_proto::vendor`]),
    /// agreed only with an initiator that offered it: the R2T, Data-In and SCSI Response of a
    /// task leave on one of the session's response connections ([`Session::reply_conn`]); the
    /// command and its Data-Out keep to the connection the command came on, and control
    /// requests (NOP, Text, Logout, task management) are answered where they came.
    pub asymmetric: bool,
    /// `X-org.mcsi.TcpReport` agreed: each connection reports its socket's TCP state to the
    /// initiator ([`crate::stats::report_tcp`]).
    pub tcp_report: bool,
    /// The ErrorRecoveryLevel agreed (RFC 7143 7.1): from 1 on, each connection keeps what it
    /// sent until it is acknowledged and answers SNACKs from it ([`Conn::log`]).
    pub erl: u8,
    /// DefaultTime2Retain: at level 2, how long a failed connection's tasks wait to be
    /// reassigned.
    pub time2retain: std::time::Duration,
}

impl SessionOps {
    /// From the negotiated values, with the target's queue depth.
    pub fn new(p: &mcsi_proto::keys::SessionParams, queue_depth: u32) -> Self {
        SessionOps {
            max_connections: p.max_connections.max(1),
            burst: p.into(),
            queue_depth: queue_depth.max(1),
            asymmetric: mcsi_proto::vendor::asymmetric_agreed(&p.extensions),
            tcp_report: mcsi_proto::vendor::tcp_report_agreed(&p.extensions),
            erl: p.error_recovery_level,
            time2retain: std::time::Duration::from_secs(u64::from(p.default_time2retain)),
        }
    }
}

/// Operational values of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnOps {
    pub header_digest: bool,
    pub data_digest: bool,
    /// What we accept (our MaxRecvDataSegmentLength).
    pub recv_mrdsl: u32,
    /// What the initiator accepts (its MaxRecvDataSegmentLength): the Data-In size.
    pub send_mrdsl: u32,
}

impl From<&mcsi_proto::keys::ConnectionParams> for ConnOps {
    fn from(c: &mcsi_proto::keys::ConnectionParams) -> Self {
        let rx = c.rx_framing();
        ConnOps {
            header_digest: rx.header_digest,
            data_digest: rx.data_digest,
            recv_mrdsl: rx.max_data_segment_length,
            send_mrdsl: c.tx_framing().max_data_segment_length,
        }
    }
}

/// What the writer of a connection is asked to do.
#[derive(Debug)]
pub enum Out {
    /// Stamp StatSN / ExpCmdSN / MaxCmdSN and send.
    Pdu(Pdu),
    /// Send again a PDU sent before, asked for by a SNACK: it keeps the StatSN it took
    /// ([`Pdu::restamp`]) and is not recorded again.
    Again(Pdu),
    /// Send what is queued, then close the connection.
    Close,
}

/// What a connection's writer still has to send, in bytes (BHS plus data segment per PDU),
/// against the connection's output budget (`output_budget`). At the budget the connection's
/// reader takes no more requests until the writer has sent some, so a peer that asks for data
/// and does not read its socket is stopped by TCP's flow control instead of making the target
/// queue without end. What is already owed is never dropped: the budget is checked before a
/// request is taken, so it is exceeded by at most what one request produces.
#[derive(Debug)]
pub struct OutQueue {
    queued: AtomicU64,
    budget: u64,
    /// Woken when the queue falls below the budget, and when the writer ends.
    drained: tokio::sync::Notify,
    closed: AtomicBool,
    /// Counts this queue while it is at its budget (a response connection's, in its session's
    /// [`Session::full_responses`]).
    full_count: Option<Arc<AtomicUsize>>,
}

impl OutQueue {
    pub fn new(budget: u64) -> Arc<OutQueue> {
        Self::counted(budget, None)
    }

    /// A queue that counts itself in `full_count` while it is at its budget.
    pub fn counted(budget: u64, full_count: Option<Arc<AtomicUsize>>) -> Arc<OutQueue> {
        Arc::new(OutQueue {
            queued: AtomicU64::new(0),
            budget: budget.max(1),
            drained: tokio::sync::Notify::new(),
            closed: AtomicBool::new(false),
            full_count,
        })
    }

    /// What a PDU counts against the budget.
    pub fn size_of(p: &Pdu) -> u64 {
        (mcsi_proto::pdu::BHS_LEN + p.data_len()) as u64
    }

    fn add(&self, n: u64) {
        let prev = self.queued.fetch_add(n, Ordering::AcqRel);
        if let Some(c) = &self.full_count {
            if prev < self.budget && prev + n >= self.budget {
                c.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    /// The writer sent (or will never send) `n` bytes of what was queued.
    pub fn sent(&self, n: u64) {
        let prev = self.queued.fetch_sub(n, Ordering::AcqRel);
        if prev >= self.budget && prev.saturating_sub(n) < self.budget {
            if let Some(c) = &self.full_count {
                c.fetch_sub(1, Ordering::AcqRel);
            }
            self.drained.notify_waiters();
        }
    }

    /// Bytes queued and not yet sent.
    pub fn queued(&self) -> u64 {
        self.queued.load(Ordering::Acquire)
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// At or over the budget: take no more requests.
    pub fn full(&self) -> bool {
        self.queued() >= self.budget
    }

    /// The writer has ended: nothing queued will be sent.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.drained.notify_waiters();
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Waits until the queue is below the budget or the writer has ended.
    pub async fn room(&self) {
        loop {
            let woken = self.drained.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if !self.full() || self.is_closed() {
                return;
            }
            woken.await;
        }
    }
}

/// One connection of a session, as the session sees it.
pub struct Conn {
    pub cid: u16,
    /// What the connection carries (asymmetric sessions; [`ConnRole::Both`] otherwise).
    pub role: ConnRole,
    pub ops: ConnOps,
    pub peer: SocketAddr,
    pub local: SocketAddr,
    tx: mpsc::UnboundedSender<Out>,
    /// Set to true to make the connection's reader stop (connection dropped by the target).
    stop: watch::Sender<bool>,
    /// The Text Request exchange under way: a request still arriving in pieces (C bit) or an
    /// answer too long for one Text Response, sent in pieces (11.10, 11.11).
    pub text: Mutex<mcsi_target_core::text::TextExchange>,
    pub span: tracing::Span,
    /// A duplicate of the socket, to sample TCP_INFO and the congestion control.
    pub sock: Option<socket2::Socket>,
    pub counters: ConnCounters,
    /// What its writer still has to send, against its output budget.
    pub out: Arc<OutQueue>,
    /// At ErrorRecoveryLevel 1 and above: what the writer sent and the initiator has not
    /// acknowledged yet, for SNACKs (the writer records, the reader acknowledges and asks).
    pub log: Option<Arc<Mutex<SentLog>>>,
}

impl Conn {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cid: u16,
        role: ConnRole,
        ops: ConnOps,
        peer: SocketAddr,
        local: SocketAddr,
        tx: mpsc::UnboundedSender<Out>,
        span: tracing::Span,
        sock: Option<socket2::Socket>,
        out: Arc<OutQueue>,
        log: Option<SentLog>,
    ) -> (Arc<Conn>, watch::Receiver<bool>) {
        let (stop, stop_rx) = watch::channel(false);
        let c = Conn {
            cid,
            role,
            ops,
            peer,
            local,
            tx,
            stop,
            text: Mutex::new(mcsi_target_core::text::TextExchange::new(ops.send_mrdsl)),
            span,
            sock,
            counters: Default::default(),
            out,
            log: log.map(|l| Arc::new(Mutex::new(l))),
        };
        (Arc::new(c), stop_rx)
    }

    /// Queues a PDU (dropped silently if the connection is gone), counting it against the
    /// connection's output budget.
    pub fn send(&self, pdu: Pdu) {
        let n = OutQueue::size_of(&pdu);
        self.out.add(n);
        if let Err(e) = self.tx.send(Out::Pdu(pdu)) {
            self.out.sent(n);
            // Its writer has ended (the connection failed): a task's answer is kept for its
            // reassignment (ErrorRecoveryLevel 2).
            if let (Some(log), Out::Pdu(p)) = (&self.log, e.0) {
                log.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .record_unsent(p);
            }
        }
    }

    /// Sends again PDUs sent before (the answer to a SNACK).
    pub fn send_again(&self, pdus: Vec<Pdu>) {
        for pdu in pdus {
            let n = OutQueue::size_of(&pdu);
            self.out.add(n);
            if self.tx.send(Out::Again(pdu)).is_err() {
                self.out.sent(n);
            }
        }
    }

    /// Sends what is queued, then closes.
    pub fn close_after_flush(&self) {
        let _ = self.tx.send(Out::Close);
    }

    /// True once the connection's writer has ended.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Drops the connection now.
    pub fn stop(&self) {
        let _ = self.stop.send(true);
        let _ = self.tx.send(Out::Close);
    }
}

impl crate::session_core::ConnInfo for Conn {
    fn cid(&self) -> u16 {
        self.cid
    }

    fn role(&self) -> ConnRole {
        self.role
    }

    fn max_data_in(&self) -> u32 {
        self.ops.send_mrdsl
    }

    fn full(&self) -> bool {
        self.out.full()
    }
}

/// A command held without a task of its own ([`crate::session_core::Deferred`]).
pub type Deferred = crate::session_core::Deferred<Arc<Conn>>;
/// What the core did with an arriving command ([`crate::session_core::Arrival`]).
pub type Arrival = crate::session_core::Arrival<Arc<Conn>>;
pub use crate::session_core::Note;
/// Something that came up in CmdSN order ([`crate::session_core::OrderedRun`]).
pub type OrderedRun = crate::session_core::OrderedRun<Arc<Conn>>;
/// A command claimed to run on a reader ([`crate::session_core::Inline`]).
pub type Inline = crate::session_core::Inline<Arc<Conn>>;
/// What came up in CmdSN order, with their connections.
pub type InOrder = Vec<OrderedRun>;
pub use crate::session_core::TaskRef;

/// The session core as the tokio layer instantiates it.
pub type Core = SessionCore<Arc<Conn>, TaskIo>;

/// A task the core handed out to run ([`Session::wake`]), for the session's [`Runner`]. Nothing
/// runs for a task before: a task waiting for its turn, its budget or its data costs no
/// future, and aborting it waits for nothing.
pub struct Started {
    pub session: Arc<Session>,
    /// The connection its command came on.
    pub conn: Arc<Conn>,
    /// The units (and map) its command was planned against.
    pub units: Arc<Bound>,
    pub attr: TaskAttribute,
    /// Its command (without its data) and the data phase its CDB asks for, as the core keeps
    /// them for its final PDUs.
    pub cmd: mcsi_proto::pdu::ScsiCommand,
    pub phase: mcsi_scsi::DataPhase,
    /// The task's session-unique id.
    pub id: u64,
    /// All of its data-out.
    pub data: bytes::Bytes,
    /// Set when the task is aborted.
    pub abort_rx: watch::Receiver<bool>,
    /// Dropped when the task has ended, which wakes task management waiting for it.
    pub done_tx: watch::Sender<()>,
}

/// What runs a task the core handed out: the SCSI layer's, given at [`Session::new`] (the
/// session starts tasks; it does not know how they run).
pub type Runner = fn(Started);

/// What the tokio layer attaches to a task in the core.
#[derive(Default)]
pub struct TaskIo {
    /// The write's share of the write budgets, held until the task ends.
    permits: Option<Permits>,
    /// Once it runs: what tells its future to stop, and what resolves when it has ended.
    running: Option<(watch::Sender<bool>, watch::Receiver<()>)>,
}

impl TaskIo {
    /// Tells the task's future to stop; returns what resolves once it has ended (nothing when
    /// the task was not running: the core ends it at once).
    fn abort(&mut self) -> Option<watch::Receiver<()>> {
        let (tx, done) = self.running.as_ref()?;
        let _ = tx.send(true);
        Some(done.clone())
    }
}

/// ExpCmdSN and MaxCmdSN in one word.
fn pack_window((exp, max): (u32, u32)) -> u64 {
    (u64::from(exp) << 32) | u64::from(max)
}

/// The session core under its lock. When let go, the window the core leaves is published
/// ([`Session::cmd_sns`]); stores happen under the lock, so the published window only moves
/// forward.
struct CoreGuard<'a> {
    core: MutexGuard<'a, Core>,
    window: &'a AtomicU64,
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut Core {
        &mut self.core
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        self.window
            .store(pack_window(self.core.cmd_sns()), Ordering::Release);
    }
}

/// Write `itt` has its budget: it keeps the permits and its first R2Ts go out.
fn grant(core: &mut Core, itt: u32, id: u64, permits: Permits) {
    if !core.grant(itt, id) {
        return;
    }
    if let Some(io) = core.task_io_mut(itt, id) {
        io.permits = Some(permits);
    }
}

/// What a session addresses at one moment: its initiator's LUN map, if it has one, and the
/// units under it (the map's, or the whole target's). One value swapped whole, so that the
/// units a command runs on and the map its LUN number goes through are always each other's.
pub struct Bound {
    pub dev: Arc<DeviceServer>,
    pub view: Option<Arc<LunView>>,
}

impl Bound {
    fn of(t: &Target, view: Option<Arc<LunView>>) -> Bound {
        Bound {
            dev: view.as_ref().map_or(&t.dev, |v| &v.dev).clone(),
            view,
        }
    }
}

/// What a session addresses at one moment ([`Session::units`]); None for discovery.
pub type Units = arc_swap::Guard<Option<Arc<Bound>>>;

/// An iSCSI session: discovery (no target) or normal.
pub struct Session {
    pub tsih: u16,
    pub isid: Isid,
    pub initiator_name: String,
    pub target: Option<Arc<Target>>,
    /// The units this session addresses and the map they come from ([`Session::units`]
    /// keeps them as the target's maps are).
    units: arc_swap::ArcSwapOption<Bound>,
    /// The target's `views_gen` when `units` was resolved.
    views_seen: AtomicU64,
    pub ops: SessionOps,
    pub nexus: Nexus,
    pub shared: Arc<Shared>,
    pub span: tracing::Span,
    /// This session, for the futures it starts.
    me: std::sync::Weak<Session>,
    runner: Runner,
    core: Mutex<Core>,
    /// ExpCmdSN and MaxCmdSN as the core left them, published whenever its lock is let go and
    /// before its PDUs are queued, for the writers to stamp without taking the lock
    /// ([`Session::cmd_sns`]).
    window: AtomicU64,
    /// Woken when the last tracked inline command ends.
    inline_idle: tokio::sync::Notify,
    /// The session's read budget ([`Session::read_permit`]).
    read_budget: Budget,
    /// The session's write budget ([`Session::write_permits`]).
    write_budget: Budget,
    /// Task management and logout handlers running ([`MAX_CONTROL_TASKS`]).
    pub control_slots: Arc<tokio::sync::Semaphore>,
    /// Response connections at their output budget ([`OutQueue::counted`]), so that request
    /// readers look at the response connections only when one of them is full
    /// ([`Session::responses_full`]). A queue that closes while full stays counted, which only
    /// costs a look.
    pub full_responses: Arc<AtomicUsize>,
    /// Wakes the session's timer task ([`Session::run_timer`]), started with the first write
    /// the core's Data-Out timer watches.
    timer_wake: tokio::sync::Notify,
    timer_started: AtomicBool,
    /// The device server has been told the I_T nexus is gone ([`Session::close`], or earlier:
    /// the Logout Response that ends the session).
    nexus_released: AtomicBool,
    /// The session's bandwidth per direction (seed 004), set at its leading login.
    qos: std::sync::OnceLock<Qos>,
    /// Its share of the target's QoS capacity, given back when it closes.
    pub qos_reservation: Mutex<Option<QosReservation>>,
    /// ErrorRecoveryLevel 2: what failed connections had sent and not seen acknowledged, by
    /// CID, until DefaultTime2Retain runs out: the tasks that had ended by the failure are
    /// answered from here when reassigned ([`Session::reassign_from_logs`]).
    dead_logs: std::sync::Mutex<Vec<DeadLog>>,
}

/// A session's bandwidth (seed 004), shared by its connections: writers wait on the bucket
/// toward the client before each batch. The bucket toward storage is the core's
/// ([`mcsi_target_core::qos::StoragePacer`]): its R2Ts wait for it, and readers wait on it
/// before each read ([`Session::before_read`]).
pub struct Qos {
    /// The bucket toward the client (None: not limited).
    to_client_bucket: Option<Mutex<mcsi_target_core::qos::TokenBucket>>,
    /// Segment size the wire bytes are reckoned with.
    mss: u32,
    /// (rate, burst) per direction, as set.
    pub to_client: Option<(u64, u64)>,
    pub to_storage: Option<(u64, u64)>,
}

impl Qos {
    /// Waits until the bucket toward the client lets a batch go, then charges its `bytes`.
    pub async fn send(&self, bytes: u64) {
        let Some(bucket) = &self.to_client_bucket else {
            return;
        };
        loop {
            let wait = {
                let now = std::time::Instant::now();
                let mut b = bucket.lock().unwrap_or_else(|e| e.into_inner());
                let t = b.ready_at(now);
                if t.is_none() {
                    b.spend(mcsi_target_core::qos::wire_bytes(bytes, self.mss), now);
                }
                t
            };
            match wait {
                None => return,
                Some(t) => tokio::time::sleep_until(t.into()).await,
            }
        }
    }
}

/// Failed connections' logs a session keeps at once (ErrorRecoveryLevel 2): a peer that fails
/// and reinstates a connection again and again replaces the oldest.
pub const MAX_DEAD_LOGS: usize = 16;

/// The log of a failed connection (ErrorRecoveryLevel 2).
struct DeadLog {
    log: Arc<Mutex<SentLog>>,
    until: std::time::Instant,
}

impl Session {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        shared: Arc<Shared>,
        tsih: u16,
        isid: Isid,
        initiator_name: String,
        target: Option<Arc<Target>>,
        ops: SessionOps,
        exp_cmd_sn: u32,
        runner: Runner,
    ) -> Arc<Session> {
        let isid_hex: String = isid.0.iter().map(|b| format!("{b:02x}")).collect();
        let tpgt = target.as_ref().map(|t| t.tpgt).unwrap_or(1);
        // SCSI port names of RFC 7143 10.1.1 / SAM: "<name>,i,0x<ISID>" and "<name>,t,0x<TPGT>".
        let nexus = Nexus {
            initiator_port: format!("{initiator_name},i,0x{isid_hex}").into(),
            target_port: format!(
                "{},t,0x{tpgt:04x}",
                target
                    .as_ref()
                    .map(|t| t.name.as_str())
                    .unwrap_or("discovery")
            )
            .into(),
            relative_port: tpgt,
        };
        let span = tracing::info_span!(
            "session",
            tsih,
            initiator = %initiator_name,
            isid = %isid_hex,
            target = target.as_ref().map(|t| t.name.as_str()).unwrap_or("discovery"),
        );
        let write_budget = Budget::new(
            target
                .as_ref()
                .map_or(Limits::default().write_budget, |t| t.limits.write_budget),
        );
        let read_budget = Budget::new(
            target
                .as_ref()
                .map_or(Limits::default().read_budget, |t| t.limits.read_budget),
        );
        let reply_policy = target
            .as_ref()
            .and_then(|t| t.limits.response_policy.scheduler());
        let mut core = SessionCore::new(exp_cmd_sn, ops.queue_depth, ops.asymmetric, reply_policy);
        core.set_discovery(target.is_none());
        core.set_error_recovery_level(ops.erl);
        core.set_time2retain(ops.time2retain);
        core.set_burst(ops.burst);
        core.set_unsolicited_budget(shared.unsolicited_budget.clone());
        core.set_retention_budget(shared.retention_budget.clone());
        core.set_data_out_timeout(
            target
                .as_ref()
                .map_or(std::time::Duration::ZERO, |t| t.limits.data_out_timeout),
        );
        let window = AtomicU64::new(pack_window(core.cmd_sns()));
        // The generation before the maps: a change in between is met again at the first PDU.
        let views_seen = target
            .as_ref()
            .map_or(0, |t| t.views_gen.load(Ordering::Acquire));
        let units = target
            .as_ref()
            .map(|t| Arc::new(Bound::of(t, t.view_of(&initiator_name))));
        Arc::new_cyclic(|me| Session {
            units: arc_swap::ArcSwapOption::new(units),
            views_seen: AtomicU64::new(views_seen),
            me: me.clone(),
            window,
            runner,
            tsih,
            isid,
            initiator_name,
            target,
            ops,
            nexus,
            shared,
            span,
            inline_idle: tokio::sync::Notify::new(),
            read_budget,
            write_budget,
            control_slots: Arc::new(tokio::sync::Semaphore::new(MAX_CONTROL_TASKS)),
            full_responses: Arc::new(AtomicUsize::new(0)),
            core: Mutex::new(core),
            timer_wake: tokio::sync::Notify::new(),
            timer_started: AtomicBool::new(false),
            nexus_released: AtomicBool::new(false),
            dead_logs: std::sync::Mutex::new(Vec::new()),
            qos: std::sync::OnceLock::new(),
            qos_reservation: Mutex::new(None),
        })
    }

    /// Sets the session's bandwidth (once, at its leading login).
    pub fn set_qos(&self, plan: &crate::config::QosPlan, mss: u32) {
        if plan.rates.to_client.is_none() && plan.rates.to_storage.is_none() {
            return;
        }
        let now = std::time::Instant::now();
        if let Some((rate, burst)) = plan.rates.to_storage {
            let segment = self
                .target
                .as_ref()
                .map_or(Limits::default().offer.max_recv_data_segment_length, |t| {
                    t.limits.offer.max_recv_data_segment_length
                });
            self.lock()
                .set_storage_pacer(mcsi_target_core::qos::StoragePacer::new(
                    rate, burst, mss, segment, now,
                ));
        }
        let _ = self.qos.set(Qos {
            to_client_bucket: plan.rates.to_client.map(|(rate, burst)| {
                Mutex::new(mcsi_target_core::qos::TokenBucket::new(rate, burst, now))
            }),
            mss,
            to_client: plan.rates.to_client,
            to_storage: plan.rates.to_storage,
        });
    }

    /// The session's bandwidth, when it has one.
    pub fn qos(&self) -> Option<&Qos> {
        self.qos.get()
    }

    /// Whether what the initiator sends is paced (a bandwidth toward storage).
    pub fn storage_paced(&self) -> bool {
        self.qos.get().is_some_and(|q| q.to_storage.is_some())
    }

    /// Waits until the bandwidth toward storage lets the next read go.
    pub async fn before_read(&self) {
        loop {
            let Some(t) = self.lock().storage_ready_at() else {
                return;
            };
            tokio::time::sleep_until(t.into()).await;
        }
    }

    /// Blocks this thread until the bandwidth toward storage lets `bytes` go, and charges them
    /// (an EXTENDED COPY's chunk: data toward storage that no PDU carried).
    pub fn pace_blocking(&self, bytes: u64) {
        while let Some(t) = self.lock().storage_ready_at() {
            std::thread::sleep(t.saturating_duration_since(std::time::Instant::now()));
        }
        self.charge_storage(bytes);
    }

    /// A PDU of `bytes` that no R2T asked for was read: it costs the bandwidth toward storage.
    pub fn charge_storage(&self, bytes: u64) {
        self.lock().charge_storage(bytes);
    }

    /// Task `itt` of a failed connection waits in the core to be reassigned (ErrorRecoveryLevel
    /// 2): running, or ended with its answer kept.
    pub fn awaits_reassign(&self, itt: u32) -> bool {
        self.lock().awaits_reassign(itt)
    }

    /// Task `itt` had ended when its connection failed: its Data-In from `exp_data_sn` and its
    /// status, from what that connection had sent (ErrorRecoveryLevel 2), to send on the
    /// connection it is reassigned to.
    pub fn reassign_from_logs(
        &self,
        itt: u32,
        exp_data_sn: u32,
    ) -> Option<Vec<mcsi_proto::pdu::Pdu>> {
        let logs = self.dead_logs.lock().unwrap_or_else(|p| p.into_inner());
        logs.iter().find_map(|d| {
            d.log
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take_task(itt, exp_data_sn)
        })
    }

    /// A new login took over `old`'s CID (connection reinstatement): at ErrorRecoveryLevel 2
    /// its tasks wait to be reassigned and what it had sent is kept; returns whether they do
    /// (below, the caller aborts them).
    pub fn reinstated(self: &Arc<Self>, old: &Conn) -> bool {
        let now = std::time::Instant::now();
        if !self.lock().orphan_replaced(old.cid, now) {
            return false;
        }
        self.keep_log(old, now);
        true
    }

    /// Removes `conn` for recovery now (a Logout with reason 2 names it, ErrorRecoveryLevel 2):
    /// it fails as if its transport had, its tasks wait to be reassigned at once (so that a
    /// TASK REASSIGN right after the logout finds them), and it is stopped.
    pub fn fail_now(self: &Arc<Self>, conn: &Arc<Conn>) {
        let now = std::time::Instant::now();
        let lost = {
            let mut core = self.lock();
            let lost = core.conn_failed(conn, now, |_| ());
            self.wake(&mut core);
            lost
        };
        if !lost.clean && !lost.session_ends {
            self.keep_log(conn, now);
        }
        conn.stop();
    }

    /// Keeps what failed connection `conn` had sent, for DefaultTime2Retain from `now`, unless
    /// the server's logs are at their cap (`limits.sent_log_budget`): then the tasks that had
    /// ended by the failure are recovered as at level 0 (TASK REASSIGN finds no task and the
    /// initiator issues them again). A session keeps at most [`MAX_DEAD_LOGS`]; the oldest
    /// goes first.
    fn keep_log(self: &Arc<Self>, conn: &Conn, now: std::time::Instant) {
        if let Some(log) = &conn.log {
            let pool = &self.shared.log_pool;
            if pool.full() {
                tracing::warn!(
                    parent: &conn.span,
                    kept = pool.used(),
                    cap = pool.cap(),
                    "the server's sent-PDU logs are at limits.sent_log_budget: what the failed connection had sent is not kept for reassignment"
                );
            } else {
                let mut logs = self.dead_logs.lock().unwrap_or_else(|p| p.into_inner());
                if logs.len() >= MAX_DEAD_LOGS {
                    logs.remove(0);
                }
                logs.push(DeadLog {
                    log: log.clone(),
                    until: now + self.ops.time2retain,
                });
            }
        }
        self.wake_timer();
    }

    /// The core has something new for its timer: start the timer task, or wake it.
    fn wake_timer(self: &Arc<Self>) {
        if self.timer_started.swap(true, Ordering::AcqRel) {
            self.timer_wake.notify_one();
        } else {
            let s = Arc::clone(self);
            let span = self.span.clone();
            tokio::spawn(async move { s.run_timer().await }.instrument(span));
        }
    }

    /// The session core's timer (the Data-Out timeout, the connections' pings): sleep until the core's `poll_timeout`,
    /// or until an input gives it something new, then hand it the time. A write the initiator
    /// stopped sending data for drops its connection. Ends with the session.
    async fn run_timer(self: Arc<Self>) {
        loop {
            let (next, timed_out) = {
                let mut core = self.lock();
                if core.is_closing() {
                    return;
                }
                let now = tokio::time::Instant::now().into_std();
                let fired = core.handle_timeout(now);
                // ErrorRecoveryLevel 2: failed connections' logs whose time ran out go; a
                // session with no connection left and nothing to reassign ends.
                self.dead_logs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .retain(|d| d.until > now);
                if core.conn_count() == 0 && !core.retaining() && self.ops.erl >= 2 {
                    drop(core);
                    if let Some(me) = self.me.upgrade() {
                        tokio::spawn(async move {
                            me.close(SessionEnd::RetentionOver).await;
                        });
                    }
                    return;
                }
                let timed_out: Vec<(Expired, Option<Arc<Conn>>)> = fired
                    .into_iter()
                    .map(|f| (f, core.conn(f.cid()).cloned()))
                    .collect();
                // Its pings.
                self.wake(&mut core);
                (core.poll_timeout(), timed_out)
            };
            for (f, conn) in timed_out {
                let Some(conn) = conn else { continue };
                match f {
                    Expired::DataOut(f) => tracing::warn!(
                        parent: &conn.span,
                        itt = f.itt,
                        received = f.received,
                        "no Data-Out for a write in {:?} after its data was asked for; dropping the connection",
                        f.timeout
                    ),
                    Expired::PingUnanswered { ttt, timeout, .. } => tracing::warn!(
                        parent: &conn.span,
                        ttt,
                        "no answer to the NOP-In ping within {timeout:?}; dropping the connection"
                    ),
                }
                conn.stop();
            }
            match next {
                Some(t) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(tokio::time::Instant::from_std(t)) => {}
                        _ = self.timer_wake.notified() => {}
                    }
                }
                None => self.timer_wake.notified().await,
            }
        }
    }

    /// Waits for room for a write of `bytes` in the session's write budget, then in the
    /// server's (each first come, first served). A write larger than a whole budget waits for
    /// all of it.
    pub async fn write_permits(&self, bytes: u32) -> Option<Permits> {
        Permits::take(&self.write_budget, &self.shared.write_budget, bytes).await
    }

    /// Write `itt` (task `id`) waited for and got its budget: its first R2Ts go out. Nothing
    /// happens (the permits are given back) if it has ended meanwhile.
    pub fn grant(&self, itt: u32, id: u64, permits: Permits) {
        let mut core = self.lock();
        grant(&mut core, itt, id, permits);
        self.wake(&mut core);
    }

    /// Carries out what the core decided: starts the tasks whose turn came with all of their
    /// data, lets the writes whose turn came ask for their data (those the write budgets have
    /// room for at once send their first R2Ts now, the others wait for room in a future of
    /// their own, [`Session::grant`]), and queues the PDUs the core made on their connections,
    /// in its order, while the lock is held (so that nothing sent later overtakes them).
    #[inline]
    fn wake(&self, core: &mut Core) {
        // Resolved once per wake, and only when a task is ready: most wakes start none.
        let mut units = None;
        while let Some(r) = core.poll_ready() {
            let units = units.get_or_insert_with(|| self.units());
            let (Some(a), Some(units)) = (r.answer, units.as_ref()) else {
                continue;
            };
            let (cmd, phase) = (a.cmd.clone(), a.phase);
            let Some(me) = self.me.upgrade() else {
                return;
            };
            let (abort_tx, abort_rx) = watch::channel(false);
            let (done_tx, done_rx) = watch::channel(());
            r.io.running = Some((abort_tx, done_rx));
            (self.runner)(Started {
                session: me,
                conn: r.conn,
                units: units.clone(),
                attr: r.attr,
                cmd,
                phase,
                id: r.id,
                data: r.data,
                abort_rx,
                done_tx,
            });
        }
        while let Some(g) = core.poll_grant() {
            match Permits::try_take(&self.write_budget, &self.shared.write_budget, g.bytes) {
                Some(p) => grant(core, g.itt, g.id, p),
                None => {
                    let Some(me) = self.me.upgrade() else {
                        return;
                    };
                    tracing::debug!(
                        itt = g.itt,
                        bytes = g.bytes,
                        "write waits for room in the write budget"
                    );
                    tokio::spawn(async move {
                        // An aborted or ended write gives the budget back at once.
                        if let Some(p) = me.write_permits(g.bytes).await {
                            me.grant(g.itt, g.id, p);
                        }
                    });
                }
            }
        }
        // The window before the PDUs (tasks ended above may have opened it): the writers may
        // send them before the lock is let go.
        self.window
            .store(pack_window(core.cmd_sns()), Ordering::Release);
        // Before the logout's answer that ends the session is sent (libiscsi's
        // Reserve6.Logout reserves from another session right after it).
        if core.take_nexus_ended() {
            self.release_nexus();
        }
        while let Some((conn, pdu)) = core.poll_transmit() {
            conn.send(pdu);
        }
        while let Some((conn, close)) = core.poll_close() {
            match close {
                crate::session_core::Close::AfterFlush => conn.close_after_flush(),
                crate::session_core::Close::Now => conn.stop(),
            }
        }
        // An R2T waits for the bandwidth toward storage (granted out of band): the timer
        // lets it go.
        if core.storage_paced() && core.take_timer_wake() {
            if let Some(me) = self.me.upgrade() {
                me.wake_timer();
            }
        }
    }

    /// Waits until the session's read budget, then the server's, have room for a read of
    /// `bytes` (a read larger than a whole budget waits for all of it), so that the data commands pull from a backend
    /// stays bounded however many large READs the CmdSN window holds. The permit goes back when
    /// dropped: once the read's Data-In has been queued and its connection is below its output
    /// budget ([`OutQueue`]).
    pub async fn read_permit(&self, bytes: u32) -> Option<Permits> {
        if bytes == 0 {
            return None;
        }
        // The session's first, then the server's (`limits.read_budget`): a session waits on
        // its own budget before it takes room from the others.
        Permits::take(&self.read_budget, &self.shared.read_budget, bytes).await
    }

    fn lock(&self) -> CoreGuard<'_> {
        let mut g = CoreGuard {
            core: self.core.lock().unwrap_or_else(|p| p.into_inner()),
            window: &self.window,
        };
        // The pacer toward storage is told the time before each input.
        if g.core.storage_paced() {
            g.core.advance(std::time::Instant::now());
        }
        g
    }

    /// Whether the response policy wants each response connection's TCP state
    /// ([`Session::feed_tcp_samples`]).
    pub fn wants_tcp_samples(&self) -> bool {
        self.lock().wants_tcp_samples()
    }

    /// Every [`TCP_SAMPLE_PERIOD`], the TCP state of response connection `conn` for the session's
    /// load-aware response policy, until the connection stops.
    pub async fn feed_tcp_samples(
        self: Arc<Self>,
        conn: Arc<Conn>,
        mut stop: watch::Receiver<bool>,
    ) {
        let Some(sock) = conn.sock.as_ref() else {
            return;
        };
        let mut tick = tokio::time::interval(TCP_SAMPLE_PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = flag_set(&mut stop) => return,
            }
            if conn.is_closed() {
                return;
            }
            let Ok(t) = mcsi_tcp::tcp_state(sock) else {
                return;
            };
            self.lock().handle_tcp_sample(conn.cid, t);
        }
    }

    /// (ExpCmdSN, MaxCmdSN) to put in a PDU now, without the session's lock: as the core left
    /// them after its last input, published before that input's PDUs were queued (so a PDU
    /// never carries a window older than the one its own input opened).
    pub fn cmd_sns(&self) -> (u32, u32) {
        let w = self.window.load(Ordering::Acquire);
        ((w >> 32) as u32, w as u32)
    }

    pub fn is_discovery(&self) -> bool {
        self.target.is_none()
    }

    pub fn conn_count(&self) -> usize {
        self.lock().conn_count()
    }

    /// Every response connection of the session is at its output budget (asymmetric mode):
    /// the request connections take no more requests until one has room.
    pub fn responses_full(&self) -> bool {
        if self.full_responses.load(Ordering::Acquire) == 0 {
            return false;
        }
        let core = self.lock();
        let mut responses = core
            .conns()
            .filter(|c| c.role == ConnRole::Responses && !c.is_closed())
            .peekable();
        responses.peek().is_some() && responses.all(|c| c.out.full())
    }

    /// `conn` leaves on purpose (logout, or a failure the session survives): it is picked for
    /// no new replies, and its end is clean ([`crate::session_core::SessionCore::leave`]).
    pub fn leave(&self, conn: &Arc<Conn>) {
        self.lock().leave(conn);
    }

    /// `conn` failed before it carried anything: it leaves alone, unless it is the session's
    /// last ([`crate::session_core::SessionCore::fail_alone`]).
    pub fn fail_alone(&self, conn: &Arc<Conn>) {
        self.lock().fail_alone(conn);
    }

    pub fn conn(&self, cid: u16) -> Option<Arc<Conn>> {
        self.lock().conn(cid).cloned()
    }

    /// Connection `cid` failed and its tasks wait to be reassigned (ErrorRecoveryLevel 2).
    pub fn failed_cid(&self, cid: u16) -> bool {
        self.lock().failed_cid(cid)
    }

    /// Every connection of the session now.
    pub fn conns(&self) -> Vec<Arc<Conn>> {
        self.lock().conns().cloned().collect()
    }

    /// Adds a connection; an existing one with the same CID is returned (to be dropped by the
    /// caller: connection reinstatement, RFC 7143 6.3.4). A closing session takes none.
    pub fn add_conn(&self, conn: Arc<Conn>) -> Result<Option<Arc<Conn>>, SessionClosing> {
        self.lock().add_conn(conn).map_err(|_| SessionClosing)
    }

    /// A Target Transfer Tag not equal to the reserved value.
    pub fn alloc_ttt(&self) -> u32 {
        self.lock().alloc_ttt()
    }

    /// `conn` pings its initiator after `interval` without receiving anything, and is dropped
    /// when a ping goes unanswered for `timeout` ([`SessionCore::start_keepalive`]); the
    /// session's timer sends the pings.
    pub fn start_keepalive(
        &self,
        conn: &Conn,
        interval: std::time::Duration,
        timeout: std::time::Duration,
    ) {
        let mut core = self.lock();
        core.start_keepalive(
            conn.cid,
            interval,
            timeout,
            tokio::time::Instant::now().into_std(),
        );
        self.after_input(core);
    }

    /// `conn` received bytes at `now` ([`SessionCore::conn_heard`]).
    pub fn heard(&self, conn: &Conn, now: std::time::Instant) {
        self.lock().conn_heard(conn.cid, now);
    }

    /// A PDU arrived on `conn` ([`SessionCore::handle_pdu`]): the core takes it, and what it
    /// decided is carried out (tasks started, R2Ts and answers queued); a command to run now on
    /// this reader is handed back ([`Arrival::Now`]), with the units the PDU was planned
    /// against, so that it runs on those (and the session's map is read once per PDU).
    #[inline]
    pub fn handle_pdu(&self, conn: &Arc<Conn>, p: mcsi_proto::pdu::Pdu) -> (Arrival, Units) {
        let mut core = self.lock();
        let units = self.units();
        let a = match units.as_ref() {
            Some(u) => core.handle_pdu(conn, p, &*u.dev, TaskIo::default),
            None => core.handle_pdu(conn, p, &crate::session_core::NoUnits, TaskIo::default),
        };
        if let Arrival::Taken { .. } = a {
            self.wake(&mut core);
            self.after_input(core);
        }
        (a, units)
    }

    /// A PDU arrived on `conn` with a data digest error
    /// ([`SessionCore::handle_data_digest_error`]): rejected, and from ErrorRecoveryLevel 1 on
    /// its data asked for again.
    pub fn handle_data_digest_error(
        &self,
        conn: &Arc<Conn>,
        header: bytes::Bytes,
        damaged: Option<mcsi_proto::pdu::Pdu>,
    ) -> (Arrival, Units) {
        let mut core = self.lock();
        let units = self.units();
        let a = match units.as_ref() {
            Some(u) => {
                core.handle_data_digest_error(conn, header, damaged, &*u.dev, TaskIo::default)
            }
            None => core.handle_data_digest_error(
                conn,
                header,
                damaged,
                &crate::session_core::NoUnits,
                TaskIo::default,
            ),
        };
        if let Arrival::Taken { .. } = a {
            self.wake(&mut core);
            self.after_input(core);
        }
        (a, units)
    }

    /// A PDU arrived on `conn` that could not be decoded but can be answered
    /// ([`SessionCore::handle_undecodable`]).
    pub fn handle_undecodable(
        &self,
        conn: &Arc<Conn>,
        reason: u8,
        header: bytes::Bytes,
    ) -> InOrder {
        let mut core = self.lock();
        let runs = core.handle_undecodable(conn, reason, header);
        self.wake(&mut core);
        runs
    }

    /// A held command whose turn came while an ORDERED task is pending starts as a task of its
    /// own ([`SessionCore::start_held`]).
    pub fn start_held(&self, d: Box<Deferred>) -> (InOrder, Option<Note>) {
        let mut core = self.lock();
        let r = core.start_held(*d, TaskIo::default());
        self.wake(&mut core);
        self.after_input(core);
        r
    }

    /// Lets the lock go, then starts or wakes the timer when the input gave it a write to watch.
    fn after_input(&self, mut core: CoreGuard<'_>) {
        let timer = core.take_timer_wake();
        drop(core);
        if timer {
            if let Some(me) = self.me.upgrade() {
                me.wake_timer();
            }
        }
    }

    /// A tracked inline command ended: lets the LUN's task set go on.
    pub fn release_inline(&self, lun: u64) {
        let mut core = self.lock();
        let idle = core.release_inline(lun);
        self.wake(&mut core);
        if idle {
            self.inline_idle.notify_waiters();
        }
    }

    /// Waits until no inline command of this session is running (task management answers only
    /// after the tasks it affects have ended, SAM-5 7.1).
    pub async fn inline_quiesced(&self) {
        loop {
            let idle = self.inline_idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.lock().inline_running() == 0 {
                return;
            }
            idle.await;
        }
    }

    /// ABORT TASK for a task not found ([`SessionCore::take_as_received`]).
    pub fn take_as_received(&self, ref_cmd_sn: u32, cmd_sn: u32) -> Option<InOrder> {
        let mut core = self.lock();
        let r = core.take_as_received(ref_cmd_sn, cmd_sn);
        self.wake(&mut core);
        r
    }

    /// Ends a task with the device server's `outcome` (`None`: it did not run to one): the
    /// core removes it, lets the task set go on and, unless the task was aborted, makes its
    /// final PDUs for its reply connection, which are queued there while the lock is still
    /// held (so a later task management response cannot overtake them). Returns that
    /// connection when they were sent.
    pub fn finish_task(
        &self,
        itt: u32,
        id: u64,
        command_conn: &Arc<Conn>,
        outcome: Option<mcsi_scsi::Outcome>,
    ) -> Option<Arc<Conn>> {
        let mut core = self.lock();
        let sent = outcome.is_some();
        let done = core.finish(itt, id, command_conn, outcome)?;
        self.wake(&mut core);
        (!done.aborted && sent).then_some(done.out)
    }

    /// A Logout Request ([`SessionCore::logout`]): the core makes the
    /// connections leave, aborts, answers once the aborted tasks have ended, and closes.
    pub fn logout(
        &self,
        conn: &Arc<Conn>,
        l: &mcsi_proto::pdu::LogoutRequest,
    ) -> Result<mcsi_target_core::control::Logout, mcsi_target_core::session::Busy> {
        let mut core = self.lock();
        let plan = core.logout(conn, l, |io| {
            let _ = io.abort();
        });
        self.wake(&mut core);
        plan
    }

    /// Task management within this session ([`SessionCore::task_management`]):
    /// the core aborts (running tasks are told to stop) and its answer goes out once they have
    /// ended, or now.
    pub fn task_management(
        &self,
        conn: &Arc<Conn>,
        itt: u32,
        plan: &mcsi_target_core::control::Tmf,
        immediate: bool,
    ) -> mcsi_target_core::session::TmfStep<Arc<Conn>> {
        let mut core = self.lock();
        let step = core.task_management(conn, itt, plan, immediate, |io| {
            let _ = io.abort();
        });
        self.wake(&mut core);
        step
    }

    /// Aborts the tasks `pred` picks: a task of its own is marked aborted (its status will not
    /// be sent, RFC 7143 4.2.3) and its end is waited on through [`Aborted::waits`]; a command
    /// held in the window without a task ([`Deferred`]) is dropped there, its CmdSN kept as
    /// consumed-without-command.
    pub fn abort_where(&self, pred: impl FnMut(&TaskRef) -> bool) -> Aborted {
        let mut waits = Vec::new();
        let found = {
            let mut core = self.lock();
            let found = core.abort_where(pred, |io| waits.extend(io.abort()));
            // Tasks that ended with the abort may let others go on.
            self.wake(&mut core);
            found
        };
        Aborted { found, waits }
    }

    /// The units this session addresses, as the target's LUN maps are now: its initiator's
    /// map's, or the whole target's. A session whose initiator gained or lost a map since it
    /// last looked switches here, and its I_T nexus is told REPORTED LUNS DATA HAS CHANGED by
    /// the units it addresses now. One atomic load when nothing changed.
    #[inline]
    pub fn units(&self) -> Units {
        if let Some(t) = &self.target {
            let gen = t.views_gen.load(Ordering::Acquire);
            if self.views_seen.load(Ordering::Acquire) != gen {
                self.rebind(t, gen);
            }
        }
        self.units.load()
    }

    #[cold]
    fn rebind(&self, t: &Target, gen: u64) {
        let next = Bound::of(t, t.view_of(&self.initiator_name));
        let same = match (&next.view, self.units.load().as_ref().map(|b| &b.view)) {
            (Some(a), Some(Some(b))) => Arc::ptr_eq(a, b),
            (None, Some(None) | None) => true,
            _ => false,
        };
        if !same {
            let s = mcsi_scsi::Sense::new(
                mcsi_scsi::sense::key::UNIT_ATTENTION,
                mcsi_scsi::sense::asc::REPORTED_LUNS_DATA_HAS_CHANGED,
            );
            for (_, lu) in next.dev.luns().iter() {
                lu.unit_attention_for(std::slice::from_ref(&self.nexus), s);
            }
            tracing::info!(initiator = %self.initiator_name, tsih = self.tsih, mapped = next.view.is_some(), "the session now sees the target through its initiator's LUN map as changed");
        }
        self.units.store(Some(Arc::new(next)));
        self.views_seen.store(gen, Ordering::Release);
    }

    /// Asks the initiator to log out on every connection within `within` (an Async Message,
    /// AsyncEvent 1); returns how many connections were asked (none once closing).
    pub fn request_logout(&self, within: std::time::Duration) -> usize {
        let secs = within.as_secs().clamp(1, u64::from(u16::MAX)) as u16;
        let mut core = self.lock();
        let n = core.request_logout(secs);
        self.wake(&mut core);
        n
    }

    /// Closes the session: aborts every task, drops every connection, leaves the registry and
    /// tells the device server the I_T nexus is gone once the tasks have ended.
    pub async fn close(self: &Arc<Self>, why: SessionEnd) {
        let mut waits = Vec::new();
        let (conns, first) = self.lock().close(|io| waits.extend(io.abort()));
        // The timer task sees the session closing and ends.
        self.timer_wake.notify_one();
        for c in conns {
            c.stop();
        }
        self.shared.remove(self);
        // Its bandwidth goes back to the target at once, for the next login.
        drop(
            self.qos_reservation
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        wait_all(waits).await;
        if !first {
            return;
        }
        self.release_nexus();
        tracing::info!(parent: &self.span, "session closed: {why}");
    }

    /// Tells the device server this session's I_T nexus is gone (its SPC-2 reservation, unit
    /// attentions and prevent state go), once: a second time could wipe what a new session of
    /// the same nexus has taken since.
    fn release_nexus(&self) {
        if self.nexus_released.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(t) = &self.target {
            t.dev.nexus_lost(&self.nexus);
        }
    }

    /// A connection ended. At ErrorRecoveryLevel 0 a connection that fails (did not leave)
    /// takes the session with it (RFC 7143 7.1.5 / 6.1); one that left or was replaced only
    /// ends its own tasks. A session without connections ends. The core decides which.
    pub async fn connection_ended(self: &Arc<Self>, conn: &Arc<Conn>, why: &str) {
        let mut waits = Vec::new();
        let now = std::time::Instant::now();
        let lost = {
            let mut core = self.lock();
            let lost = core.conn_failed(conn, now, |io| waits.extend(io.abort()));
            self.wake(&mut core);
            lost
        };
        // ErrorRecoveryLevel 2: the connection failed and the session lives on; its tasks wait
        // to be reassigned, with what it had sent.
        if !lost.clean && !lost.session_ends {
            tracing::warn!(
                parent: &conn.span,
                "connection failed: {why}; its tasks wait {:?} to be reassigned",
                self.ops.time2retain
            );
            self.keep_log(conn, now);
            return;
        }
        // Logged as the core decided: a clean end (logout, reinstatement, a closing session) at
        // debug, a failure at warn.
        if lost.clean {
            tracing::debug!(parent: &conn.span, "connection ended: {why}");
        } else {
            tracing::warn!(parent: &conn.span, "connection ended: {why}");
        }
        if lost.session_ends {
            self.close(if lost.clean {
                SessionEnd::LastConnectionLoggedOut
            } else {
                SessionEnd::ConnectionLost {
                    cid: conn.cid,
                    why: why.to_string(),
                }
            })
            .await;
        } else {
            wait_all(waits).await;
        }
    }
}

/// A connection cannot join a session that is closing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionClosing;

/// Why a session ended (logged when it closes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionEnd {
    /// Its last connection logged out (or a logout closed the session).
    #[error("its last connection logged out")]
    LastConnectionLoggedOut,
    /// A connection failed: at ErrorRecoveryLevel 0 the session goes with it (RFC 7143 6.1).
    #[error("connection {cid} ended: {why}")]
    ConnectionLost { cid: u16, why: String },
    /// A new login of the same initiator port replaced it (6.3.5).
    #[error("reinstated by a new login of the same initiator port")]
    Reinstated,
    /// The target is shutting down.
    #[error("the target is shutting down")]
    Shutdown,
    /// The administrator ended it (`mcsi ctl end-session`) and it did not log out in time.
    #[error("ended by the administrator")]
    Administrator,
    /// An initiator asked for a TARGET COLD RESET.
    #[error("target cold reset")]
    ColdReset,
    /// ErrorRecoveryLevel 2: its last connection failed and DefaultTime2Retain ran out with
    /// no new one.
    #[error("no connection, and DefaultTime2Retain ran out")]
    RetentionOver,
}

/// What [`Session::abort_where`] did.
#[derive(Default)]
pub struct Aborted {
    /// Tasks found (running or held).
    pub found: usize,
    /// The ends of the running ones, to wait on ([`wait_all`]).
    pub waits: Vec<watch::Receiver<()>>,
}

/// Waits until every task future behind these receivers has ended.
pub async fn wait_all(waits: Vec<watch::Receiver<()>>) {
    for mut w in waits {
        while w.changed().await.is_ok() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A unit over 1 MiB of RAM.
    fn ram_unit() -> Arc<mcsi_scsi::LogicalUnit> {
        Arc::new(mcsi_scsi::LogicalUnit::new(
            Arc::new(mcsi_scsi::backend::RamBackend::new(1 << 20).unwrap()),
            mcsi_scsi::LuConfig::default(),
        ))
    }

    /// INQUIRY's TPGS field of `unit`: 1 while it has port groups, 0 without.
    fn tpgs(unit: &mcsi_scsi::LogicalUnit) -> u8 {
        let n = Nexus {
            initiator_port: "iqn.2026-01.test:i,i,0x000000000001".into(),
            target_port: "iqn.2026-01.test:t,t,0x0001".into(),
            relative_port: 1,
        };
        let cdb = [0x12, 0, 0, 0, 96, 0];
        let o = unit.execute(mcsi_scsi::Command {
            nexus: &n,
            cdb: &cdb,
            data_out: bytes::Bytes::new(),
            data_in_limit: 96,
            attr: mcsi_scsi::TaskAttribute::Simple,
            pace: None,
        });
        (o.data_in[5] >> 4) & 3
    }

    /// The interleaving a target's units and port groups must not have: a unit is being added
    /// (it took the port groups of the moment, it is not in the inventory yet) when the port
    /// groups change and every unit of the inventory is updated; the new unit would keep the
    /// old ones. The change arrives in the middle of the addition here, and must wait for it.
    #[test]
    fn a_port_group_change_waits_for_a_unit_being_added() {
        let cfg = crate::config::ServerConfig::from_toml(
            r#"
            listen = ["127.0.0.1:3260"]
            [[targets]]
            iqn = "iqn.2026-01.test:t"
            luns = [{ backend = "ram:1MiB" }]
            [[targets.port_groups]]
            id = 1
            state = "active/optimized"
            ports = [1]
            "#,
        )
        .unwrap();
        let t = Target::new(&cfg.targets[0], Vec::new(), Vec::new(), &[]);
        let unit = ram_unit();
        std::thread::scope(|s| {
            // The first half of an addition: the unit has the groups, not yet its place.
            let adding = t.changing.lock().unwrap();
            unit.set_alua(t.alua.load().as_deref().cloned());
            let change = s.spawn(|| t.set_alua(None));
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(
                t.alua.load().is_some(),
                "the change went ahead mid-addition"
            );
            // The second half, then the change proceeds.
            t.dev.add(1, unit.clone()).unwrap();
            drop(adding);
            assert!(change.join().unwrap());
        });
        assert_eq!(tpgs(&unit), 0, "the unit kept the old port groups");
    }

    /// The interleaving of a command and a change of the LUN maps: the reader reads the
    /// session's units, the map is removed, and the command runs and is counted. Its units and
    /// the map its LUN number goes through were read as one value: they stay each other's (the
    /// map's units with the map), and the next read is the whole target without one. With the
    /// units and the map as two values, the count went through the map read after the change.
    #[test]
    fn a_sessions_units_and_lun_map_are_read_as_one() {
        let cfg = crate::config::ServerConfig::from_toml(
            r#"
            listen = ["127.0.0.1:3260"]
            [[targets]]
            iqn = "iqn.2026-01.test:t"
            luns = [{ backend = "ram:1MiB" }, { backend = "ram:1MiB" }]
            "#,
        )
        .unwrap();
        let luns: Vec<_> = (0..2u16).map(|n| (n, ram_unit())).collect();
        let t = Target::new(&cfg.targets[0], luns, Vec::new(), &[]);
        let shared = Arc::new(Shared::new(vec![t.clone()], AuthSpec::default()));
        let name = "iqn.2026-01.test:host";
        let map = crate::config::LunMap {
            initiator: name.into(),
            luns: [(4, 1)].into_iter().collect(),
        };
        assert!(t.set_lun_maps(std::slice::from_ref(&map)));
        let s = Session::new(
            shared.clone(),
            1,
            Isid([0x80, 0, 0, 0, 0, 1]),
            name.into(),
            Some(t.clone()),
            SessionOps::new(&mcsi_proto::keys::SessionParams::default(), 8),
            1,
            |_| {},
        );
        shared.insert(s.clone());
        let read = s.units();
        assert!(t.set_lun_maps(&[]), "the map goes while the command runs");
        let b = read.as_ref().unwrap();
        let numbers: Vec<u16> = b.dev.luns().iter().map(|(n, _)| *n).collect();
        let view = b.view.as_ref().expect("read with its map");
        let mapped: Vec<u16> = view.map.load().keys().copied().collect();
        assert_eq!(numbers, mapped, "the units read are the map's");
        assert_eq!(numbers, [4]);
        let now = s.units();
        let now = now.as_ref().unwrap();
        assert!(now.view.is_none());
        assert_eq!(now.dev.luns().len(), 2);
    }

    /// The interleaving of a login and a change of the LUN maps: the session resolves its
    /// units (no map: the whole target) before the map for its initiator is stored, and is
    /// registered after the change. Its next command must see the map, not the whole target.
    #[test]
    fn a_session_resolved_before_a_lun_map_change_meets_the_change() {
        let cfg = crate::config::ServerConfig::from_toml(
            r#"
            listen = ["127.0.0.1:3260"]
            [[targets]]
            iqn = "iqn.2026-01.test:t"
            luns = [{ backend = "ram:1MiB" }, { backend = "ram:1MiB" }]
            "#,
        )
        .unwrap();
        let luns: Vec<_> = (0..2u16).map(|n| (n, ram_unit())).collect();
        let t = Target::new(&cfg.targets[0], luns, Vec::new(), &[]);
        let shared = Arc::new(Shared::new(vec![t.clone()], AuthSpec::default()));
        let name = "iqn.2026-01.test:host";
        let s = Session::new(
            shared.clone(),
            1,
            Isid([0x80, 0, 0, 0, 0, 1]),
            name.into(),
            Some(t.clone()),
            SessionOps::new(&mcsi_proto::keys::SessionParams::default(), 8),
            1,
            |_| {},
        );
        // Resolved at login: the whole target.
        assert!(s.units.load().as_ref().unwrap().view.is_none());
        let map = crate::config::LunMap {
            initiator: name.into(),
            luns: [(4, 1)].into_iter().collect(),
        };
        assert!(t.set_lun_maps(std::slice::from_ref(&map)));
        // Registered now, after the change; its first look at its units meets it.
        shared.insert(s.clone());
        let units = s.units();
        let numbers: Vec<u16> = units
            .as_ref()
            .unwrap()
            .dev
            .luns()
            .iter()
            .map(|(n, _)| *n)
            .collect();
        assert_eq!(numbers, [4], "the session kept the whole target");
        assert!(s.units().as_ref().unwrap().view.is_some());
        // And the map gone, the whole target again.
        assert!(t.set_lun_maps(&[]));
        assert_eq!(s.units().as_ref().unwrap().dev.luns().len(), 2);
        assert!(s.units().as_ref().unwrap().view.is_none());
        assert!(!t.set_lun_maps(&[]), "no change reported as one");
    }

    fn session(shared: &Arc<Shared>, tsih: u16, isid: u8, name: &str) -> Arc<Session> {
        Session::new(
            shared.clone(),
            tsih,
            Isid([0x80, 0, 0, 0, 0, isid]),
            name.into(),
            None,
            SessionOps::new(&mcsi_proto::keys::SessionParams::default(), 8),
            1,
            |_| {},
        )
    }

    #[test]
    fn failed_chap_logins_lock_their_user_out_for_longer_each_time() {
        let t = ChapThrottle::default();
        let t0 = std::time::Instant::now();
        let s = std::time::Duration::from_secs;
        assert_eq!(t.locked("alice", t0), None);
        t.failed("alice", t0);
        assert_eq!(t.locked("alice", t0), None, "the first failure is free");
        t.failed("alice", t0);
        assert_eq!(t.locked("alice", t0), Some(s(1)));
        assert_eq!(t.locked("alice", t0 + s(1)), None);
        for _ in 0..3 {
            t.failed("alice", t0);
        }
        assert_eq!(t.locked("alice", t0), Some(s(8)));
        for _ in 0..10 {
            t.failed("alice", t0);
        }
        assert_eq!(t.locked("alice", t0), Some(s(60)), "capped");
        assert_eq!(t.locked("bob", t0), None, "per user");
        // Ten quiet minutes, then one failure: free again.
        t.failed("alice", t0 + s(700));
        assert_eq!(t.locked("alice", t0 + s(700)), None);
        t.failed("alice", t0 + s(700));
        assert_eq!(t.locked("alice", t0 + s(700)), Some(s(1)));
        t.succeeded("alice");
        assert_eq!(t.locked("alice", t0 + s(700)), None);
    }

    #[test]
    fn tsihs_run_out_without_spinning() {
        let shared = Arc::new(Shared::new(Vec::new(), AuthSpec::default()));
        let mut held = 0u32;
        while let Some(t) = shared.alloc_tsih() {
            shared.insert(session(&shared, t, 1, "iqn.2026-01.org.mcsi:a"));
            held += 1;
            assert!(held <= 65_535);
        }
        assert_eq!(held, 65_535);
        assert_eq!(shared.alloc_tsih(), None);
        shared.remove(&shared.session(77).expect("held"));
        assert_eq!(shared.alloc_tsih(), Some(77));
    }

    #[test]
    fn a_leading_login_displaces_every_session_of_its_port() {
        let shared = Arc::new(Shared::new(Vec::new(), AuthSpec::default()));
        // Two logins of one port that both found no session to reinstate, and another port.
        shared.insert(session(&shared, 1, 7, "iqn.2026-01.org.mcsi:a"));
        shared.insert(session(&shared, 2, 7, "iqn.2026-01.org.mcsi:a"));
        shared.insert(session(&shared, 3, 8, "iqn.2026-01.org.mcsi:a"));
        let displaced = shared.insert_reinstating(session(&shared, 4, 7, "iqn.2026-01.org.mcsi:a"));
        let mut gone: Vec<u16> = displaced.iter().map(|s| s.tsih).collect();
        gone.sort_unstable();
        assert_eq!(gone, vec![1, 2]);
        let mut left: Vec<u16> = shared.all_sessions().iter().map(|s| s.tsih).collect();
        left.sort_unstable();
        assert_eq!(left, vec![3, 4]);
    }
}
