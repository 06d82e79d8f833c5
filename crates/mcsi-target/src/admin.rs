//! What an administrator may ask of a running server (through `mcsi ctl`): its targets and
//! LUNs, adding and removing a LUN, its sessions with their connections, and ending a session.
//! Each request is checked whole before anything changes: one that fails changes nothing.

use crate::config::{AuthSpec, LunSpec, ServerConfig};
use crate::session::{SessionEnd, Shared};
use crate::stats::SessionSnapshot;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest a removed LUN waits for the commands still on it before its flush.
pub const REMOVE_DRAIN: Duration = Duration::from_secs(30);

/// Why a request could not be carried out; nothing was changed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdminError {
    #[error("no session with TSIH {0} (`mcsi ctl sessions` lists them)")]
    NoSession(u16),
    #[error("no target named {0} (`mcsi ctl targets` lists them)")]
    NoTarget(String),
    #[error("a target named {0} is served already")]
    TargetExists(String),
    #[error("cannot listen on {addr}: {why}")]
    Listen {
        addr: std::net::SocketAddr,
        why: String,
    },
    #[error("name the target: this server has {0} (`mcsi ctl targets` lists them)")]
    WhichTarget(usize),
    #[error(
        "target {target}: LUN {lun} is already in use; remove it first or choose another number"
    )]
    LunInUse { target: String, lun: u16 },
    #[error("target {target}: no LUN {lun}")]
    NoLun { target: String, lun: u16 },
    #[error("{0}")]
    BadSpec(String),
    #[error("target {target}: {initiator} is already allowed")]
    AlreadyAllowed { target: String, initiator: String },
    #[error("target {target}: {initiator} is not on its list of allowed initiators")]
    NotAllowed { target: String, initiator: String },
    #[error(
        "target {target}: CHAP user {user} exists already; remove it first to change its secret"
    )]
    ChapUserExists { target: String, user: String },
    #[error("target {target}: no CHAP user {user}")]
    NoChapUser { target: String, user: String },
    #[error("LUN {lun}: {why}")]
    Backend { lun: u16, why: String },
    #[error("{0}")]
    WouldOpen(String),
    #[error("{0} cannot change while the target runs: restart it (nothing was changed)")]
    NeedsRestart(String),
    #[error(
        "the target was started without --config: name the file to write (mcsi ctl save --to PATH)"
    )]
    NoFile,
    #[error("not saved, nothing written: {0}")]
    NotSaved(#[from] crate::saved::SaveError),
}

/// What `save` wrote.
#[derive(Debug, Clone, Serialize)]
pub struct Saved {
    pub path: std::path::PathBuf,
    pub bytes: usize,
    /// Settings that run but are not in the file (given on the command line only).
    pub not_saved: Vec<String>,
}

/// How an ended session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ended {
    /// The initiator logged out when asked.
    LoggedOut,
    /// It did not within the time it was given: its connections were dropped.
    Dropped,
}

/// A target as it is served: its name, portals and LUNs.
#[derive(Debug, Clone, Serialize)]
pub struct TargetView {
    pub name: String,
    pub alias: Option<String>,
    pub portals: Vec<String>,
    pub luns: Vec<LunView>,
    pub sessions: usize,
    /// Initiator names allowed to log in (empty: any).
    pub allowed_initiators: Vec<String>,
    /// Source networks allowed (empty: any).
    pub allowed_networks: Vec<String>,
    /// CHAP user names (empty: no CHAP); secrets are never shown.
    pub chap_users: Vec<String>,
    /// This gateway's portal group tag.
    pub portal_group_tag: u16,
    /// ALUA target port groups and their states (empty: no ALUA).
    pub port_groups: Vec<PortGroupView>,
    /// Per-initiator LUN maps: initiator, and its LUN numbers to the target's.
    pub lun_maps: Vec<LunMapView>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PortGroupView {
    pub id: u16,
    pub state: String,
    pub preferred: bool,
    pub ports: Vec<u16>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LunMapView {
    pub initiator: String,
    /// (the initiator's LUN, the target's LUN)
    pub luns: Vec<(u16, u16)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LunView {
    pub lun: u16,
    pub blocks: u64,
    pub block_size: u32,
    pub read_only: bool,
    pub serial: String,
    /// The NAA identifier of VPD 83h, 32 hex digits.
    pub naa: String,
    /// Where the port group states live with the data (rbd): those served, as (group, state);
    /// empty where they are the target's configured ones.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shared_port_groups: Vec<(u16, String)>,
}

/// A handle on a running server for its administration ([`crate::Server::admin`]).
#[derive(Clone)]
pub struct Admin {
    pub(crate) shared: Arc<Shared>,
    pub(crate) metrics: Arc<crate::stats::Metrics>,
    pub(crate) applied: Arc<std::sync::Mutex<Applied>>,
    pub(crate) gate: Arc<crate::admission::Gate>,
    pub(crate) portals: Arc<crate::portals::Portals>,
}

/// How long the sessions of a target removed by a reload are given to log out.
pub const REMOVE_TARGET_GRACE: Duration = Duration::from_secs(5);

/// The configuration the server runs, as a reload compares it with the file: the file's
/// configuration it started from, with each target's LUNs by number and access as changed
/// since (by `mcsi ctl` or a reload).
#[derive(Debug, Clone)]
pub struct Applied {
    base: ServerConfig,
    luns: BTreeMap<String, BTreeMap<u16, LunSpec>>,
    auth: BTreeMap<String, AuthSpec>,
}

impl Applied {
    fn running(&self) -> crate::saved::Running<'_> {
        crate::saved::Running {
            base: &self.base,
            luns: &self.luns,
            auth: &self.auth,
        }
    }

    /// A server that runs `cfg`'s server-wide settings and no target yet: what starting
    /// applies `cfg` to.
    pub(crate) fn empty(cfg: &ServerConfig) -> Applied {
        let mut base = cfg.clone();
        base.targets.clear();
        base.source = None;
        Applied {
            base,
            luns: BTreeMap::new(),
            auth: BTreeMap::new(),
        }
    }

    /// What runs, as a configuration: applying it changes nothing, and a change made to it
    /// and applied is the change an administrator asked for.
    pub fn config(&self) -> ServerConfig {
        let mut c = self.base.clone();
        for t in c.targets.iter_mut() {
            if let Some(m) = self.luns.get(&t.iqn) {
                t.luns = m
                    .iter()
                    .map(|(n, l)| LunSpec {
                        lun: Some(*n),
                        ..l.clone()
                    })
                    .collect();
            }
            if let Some(a) = self.auth.get(&t.iqn) {
                t.auth = a.clone();
            }
        }
        c
    }
}

/// `file:PATH:SIZE` with its size replaced by `bytes`; None for other specs (a file without a
/// size opens whole, whatever its length).
fn file_spec_with_size(spec: &str, bytes: u64) -> Option<String> {
    let rest = spec.strip_prefix("file:")?;
    let (path, size) = rest.rsplit_once(':')?;
    mcsi_units::parse_size(size).ok()?;
    Some(format!("file:{path}:{bytes}"))
}

/// What a reload changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Changes {
    pub luns_added: Vec<(String, u16)>,
    pub luns_removed: Vec<(String, u16)>,
    pub targets_added: Vec<String>,
    pub targets_removed: Vec<String>,
    /// Targets whose portals changed.
    pub portals_changed: Vec<String>,
    /// Targets whose access (allowed initiators and networks, CHAP users) was replaced.
    pub access_changed: Vec<String>,
    /// Targets whose ALUA target port groups or states changed.
    pub port_groups_changed: Vec<String>,
    /// Targets whose per-initiator LUN maps changed.
    pub lun_maps_changed: Vec<String>,
}

impl Admin {
    /// Every session, with its connections' counters and TCP state sampled now, in TSIH order.
    pub fn sessions(&self) -> Vec<SessionSnapshot> {
        let mut v = crate::stats::snapshot(&self.shared);
        v.sort_by_key(|s| s.tsih);
        v
    }

    /// The targets served, with their LUNs and how many sessions each has.
    pub fn targets(&self) -> Vec<TargetView> {
        let sessions = self.shared.all_sessions();
        self.shared
            .targets()
            .iter()
            .map(|t| (t, t.auth.load()))
            .map(|(t, auth)| TargetView {
                name: t.name.clone(),
                alias: t.alias.clone(),
                portals: t.portals.load().iter().map(|p| p.to_string()).collect(),
                luns: t
                    .dev
                    .luns()
                    .iter()
                    .map(|(i, lu)| LunView {
                        lun: *i,
                        blocks: lu.blocks(),
                        block_size: lu.block_size(),
                        read_only: lu.config().read_only,
                        serial: lu.config().serial.clone(),
                        naa: crate::config::naa_text(&lu.config().naa_id),
                        shared_port_groups: lu
                            .shared_port_group_states()
                            .unwrap_or_default()
                            .into_iter()
                            .map(|(id, state)| (id, state.name().to_string()))
                            .collect(),
                    })
                    .collect(),
                sessions: sessions
                    .iter()
                    .filter(|s| s.target.as_ref().is_some_and(|x| Arc::ptr_eq(x, t)))
                    .count(),
                // One read of the access: a change meanwhile shows whole or not at all.
                allowed_initiators: auth.allow_initiators.clone(),
                allowed_networks: auth.allow_networks.iter().map(|n| n.to_string()).collect(),
                chap_users: auth.chap.iter().map(|u| u.user.clone()).collect(),
                portal_group_tag: t.tpgt,
                port_groups: t
                    .alua
                    .load()
                    .as_deref()
                    .map(|a| {
                        a.groups()
                            .iter()
                            .map(|g| PortGroupView {
                                id: g.id,
                                state: g.state.name().to_string(),
                                preferred: g.preferred,
                                ports: g.ports.clone(),
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                lun_maps: t
                    .views
                    .load()
                    .iter()
                    .map(|v| LunMapView {
                        initiator: v.initiator.clone(),
                        luns: v.map.load().iter().map(|(a, b)| (*a, *b)).collect(),
                    })
                    .collect(),
            })
            .collect()
    }

    /// The target named `name`, or the only one when `name` is None.
    fn target(&self, name: Option<&str>) -> Result<Arc<crate::session::Target>, AdminError> {
        let ts = self.shared.targets();
        match name {
            Some(n) => ts
                .iter()
                .find(|t| t.name == n)
                .cloned()
                .ok_or_else(|| AdminError::NoTarget(n.to_string())),
            None if ts.len() == 1 => Ok(ts[0].clone()),
            None => Err(AdminError::WhichTarget(ts.len())),
        }
    }

    /// Adds LUN `lun` to a target (the only one when `target` is None), from a LUN spec as
    /// `--lun` takes it (`file:/srv/d1.img:10GiB,block_size=4096`). Sessions of the target get
    /// REPORTED LUNS DATA HAS CHANGED on their next command to another LUN; nothing else pauses.
    pub async fn add_lun(
        &self,
        target: Option<&str>,
        lun: u16,
        spec: &str,
    ) -> Result<(), AdminError> {
        let _one = self.shared.admin_lock().await;
        let t = self.target(target)?;
        let in_use = || AdminError::LunInUse {
            target: t.name.clone(),
            lun,
        };
        if t.dev.luns().iter().any(|(i, _)| *i == lun) {
            return Err(in_use());
        }
        let l = crate::config::parse_lun_arg(&format!("LUN {lun}"), spec)
            .map_err(|e| AdminError::BadSpec(e.to_string()))?;
        if let Some(naa) = l.naa {
            for other in self.shared.targets().iter() {
                if let Some((n, _)) = other
                    .dev
                    .luns()
                    .iter()
                    .find(|(_, u)| u.config().naa_id == naa)
                {
                    return Err(AdminError::BadSpec(format!(
                        "LUN {n} of target {} has naa {} already; an identity names one LUN",
                        other.name,
                        crate::config::naa_text(&naa)
                    )));
                }
            }
        }
        let l2 = l.clone();
        // Opening a backend may wait on a disk or a cluster.
        let iqn = t.name.clone();
        let dir = self.applied().base.state_dir.clone();
        let lu = tokio::task::spawn_blocking(move || {
            crate::units::build_lu(&iqn, lun, &l, dir.as_deref())
        })
        .await
        .map_err(|e| AdminError::Backend {
            lun,
            why: e.to_string(),
        })?
        .map_err(|e| AdminError::Backend {
            lun,
            why: format!("{e:#}"),
        })?;
        self.install_lun(&t, lun, lu, l2)?;
        tracing::info!(target = %t.name, lun, spec, "the administrator added a LUN");
        Ok(())
    }

    /// Grows LUN `lun` of a target to `size` bytes, or (None) to the size its file has now
    /// (extended by the administrator): its sessions get CAPACITY DATA HAS CHANGED and see
    /// the new capacity; nothing pauses. A LUN never shrinks. A `file:PATH:SIZE` spec in the
    /// running configuration takes the new size, so that a saved file opens it whole.
    /// `(old, new)` capacity in blocks.
    pub async fn grow_lun(
        &self,
        target: Option<&str>,
        lun: u16,
        size: Option<u64>,
    ) -> Result<(u64, u64), AdminError> {
        let _one = self.shared.admin_lock().await;
        let t = self.target(target)?;
        let lu = t
            .dev
            .luns()
            .iter()
            .find(|(i, _)| *i == lun)
            .map(|(_, lu)| lu.clone())
            .ok_or_else(|| AdminError::NoLun {
                target: t.name.clone(),
                lun,
            })?;
        // The unit's own block size, from the unit that grows (not looked up again).
        let bs = u64::from(lu.block_size());
        let (old, new) = tokio::task::spawn_blocking(move || lu.grow(size))
            .await
            .map_err(|e| AdminError::Backend {
                lun,
                why: e.to_string(),
            })?
            .map_err(|e| AdminError::Backend {
                lun,
                why: e.to_string(),
            })?;
        let bytes = new * bs;
        let mut a = self.applied();
        if let Some(spec) = a.luns.get_mut(&t.name).and_then(|m| m.get_mut(&lun)) {
            if let crate::config::LunBackend::Spec(s) = &spec.backend {
                if let Some(grown) = file_spec_with_size(s, bytes) {
                    spec.backend = crate::config::LunBackend::Spec(grown);
                }
            }
        }
        tracing::info!(target = %t.name, lun, old, new, "the administrator grew a LUN (blocks)");
        Ok((old, new))
    }

    /// Removes LUN `lun` from a target: it answers as absent at once, and the sessions of the
    /// target get REPORTED LUNS DATA HAS CHANGED; the commands already on it finish (for at
    /// most [`REMOVE_DRAIN`]), and then it is flushed.
    pub async fn remove_lun(&self, target: Option<&str>, lun: u16) -> Result<(), AdminError> {
        let _one = self.shared.admin_lock().await;
        self.remove_lun_locked(target, lun).await
    }

    async fn remove_lun_locked(&self, target: Option<&str>, lun: u16) -> Result<(), AdminError> {
        let t = self.target(target)?;
        let lu = t.remove_unit(lun).map_err(|_| AdminError::NoLun {
            target: t.name.clone(),
            lun,
        })?;
        self.record_lun(&t, lun, None);
        drain_and_flush(&t.name, lun, lu).await;
        tracing::info!(target = %t.name, lun, "the administrator removed a LUN");
        Ok(())
    }

    /// Changes a target's access with `change`, which sees the access of the moment and says
    /// why it cannot apply; logins from then on see the result. Sessions already logged in stay.
    async fn change_access(
        &self,
        target: Option<&str>,
        change: impl Fn(&str, &mut AuthSpec) -> Result<(), AdminError>,
    ) -> Result<(), AdminError> {
        let _one = self.shared.admin_lock().await;
        self.change_access_locked(target, change)
    }

    fn change_access_locked(
        &self,
        target: Option<&str>,
        change: impl Fn(&str, &mut AuthSpec) -> Result<(), AdminError>,
    ) -> Result<(), AdminError> {
        let t = self.target(target)?;
        let mut next = (**t.auth.load()).clone();
        change(&t.name, &mut next)?;
        self.applied().auth.insert(t.name.clone(), next.clone());
        t.auth.store(Arc::new(next));
        Ok(())
    }

    fn applied(&self) -> std::sync::MutexGuard<'_, Applied> {
        self.applied.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Puts an opened unit into a target's inventory as LUN `lun`, with its metric handles
    /// and its place in the applied record: what adding a LUN and a reload both do.
    fn install_lun(
        &self,
        t: &crate::session::Target,
        lun: u16,
        unit: Arc<mcsi_scsi::LogicalUnit>,
        spec: LunSpec,
    ) -> Result<(), AdminError> {
        let spec = spec.with_identity(&unit.config().serial, unit.config().naa_id);
        t.add_unit(lun, unit).map_err(|_| AdminError::LunInUse {
            target: t.name.clone(),
            lun,
        })?;
        self.record_lun(t, lun, Some((spec, self.metrics.lun(&t.name, lun))));
        Ok(())
    }

    /// Records LUN `lun` of `t` as added (its spec and metric handles) or removed (None), in
    /// the applied record and the target's metric handles alike.
    fn record_lun(
        &self,
        t: &crate::session::Target,
        lun: u16,
        added: Option<(LunSpec, crate::counters::LunMetrics)>,
    ) {
        t.lun_metrics.rcu(|v| {
            let mut v = (**v).clone();
            v.retain(|(i, _)| *i != lun);
            if let Some((_, m)) = &added {
                v.push((lun, m.clone()));
            }
            v
        });
        let mut a = self.applied();
        let luns = a.luns.entry(t.name.clone()).or_default();
        match added {
            Some((spec, _)) => luns.insert(lun, spec),
            None => luns.remove(&lun),
        };
    }

    /// Applies `next` (the file, read again, or what runs with one change) to the running
    /// server: targets added and removed, their portals moved, LUNs added and removed, each
    /// target's access replaced. Everything is checked, every new LUN opened and every new
    /// portal bound before anything changes; a change that needs a restart (server-wide
    /// settings) or a LUN or target whose settings changed in place is refused whole. Sessions
    /// of targets and LUNs it does not touch go on without a pause. Starting the server is
    /// this, applied to a server with no target.
    pub async fn apply(&self, next: &ServerConfig) -> Result<Changes, AdminError> {
        // The plan and its changes under one lock: no other change comes between.
        let _one = self.shared.admin_lock().await;
        self.apply_locked(next, REMOVE_TARGET_GRACE).await
    }

    /// Reads the configuration with `read` (the file, again) and applies it, the read and the
    /// change under the one lock: a save or another change cannot come between them, so what
    /// is applied is the file as it is, and the file a save later compares is the one read.
    pub async fn reload<E>(
        &self,
        read: impl FnOnce() -> Result<ServerConfig, E>,
    ) -> Result<Result<Changes, AdminError>, E> {
        let _one = self.shared.admin_lock().await;
        let next = read()?;
        Ok(self.apply_locked(&next, REMOVE_TARGET_GRACE).await)
    }

    /// [`Admin::apply`] under the lock; the sessions of a target removed get `grace` to log
    /// out.
    async fn apply_locked(
        &self,
        next: &ServerConfig,
        grace: Duration,
    ) -> Result<Changes, AdminError> {
        let now = self.applied().clone();
        let restart = |what: String| Err(AdminError::NeedsRestart(what));
        let base = &now.base;
        if next.discovery_auth != base.discovery_auth {
            return restart("discovery access".into());
        }
        if next.limits != base.limits {
            return restart("[limits]".into());
        }
        if next.session_threads != base.session_threads {
            return restart("session_threads".into());
        }
        if next.mptcp != base.mptcp {
            return restart("mptcp".into());
        }
        if next.control != base.control {
            return restart("control".into());
        }
        if next.state_dir != base.state_dir {
            return restart("state_dir".into());
        }
        for (i, t) in next.targets.iter().enumerate() {
            if next.targets[..i].iter().any(|x| x.iqn == t.iqn) {
                return Err(AdminError::TargetExists(t.iqn.clone()));
            }
            if t.portals.is_empty() {
                return Err(AdminError::BadSpec(format!(
                    "target {}: no portal; it needs at least one",
                    t.iqn
                )));
            }
        }
        // An identity names one LUN: two with the same NAA would be one disk to a multipath
        // initiator, and would share their persistent reservations.
        let mut named: BTreeMap<[u8; 16], (String, u16)> = BTreeMap::new();
        for t in &next.targets {
            for (n, l) in t.luns_by_number() {
                let Some(naa) = l.naa else { continue };
                if let Some((t0, n0)) = named.insert(naa, (t.iqn.clone(), n)) {
                    return Err(AdminError::BadSpec(format!(
                        "target {}: LUN {n} has the naa of LUN {n0} of target {t0} ({}); an identity names one LUN",
                        t.iqn,
                        crate::config::naa_text(&naa)
                    )));
                }
            }
        }
        // Plan: targets to add and remove, (target, LUN, spec) to add, (target, LUN) to
        // remove, access to replace, targets whose portals move.
        let mut new_targets = Vec::new();
        let mut gone_targets = Vec::new();
        let mut adds = Vec::new();
        let mut removes = Vec::new();
        let mut access = Vec::new();
        let mut moved = Vec::new();
        let mut port_groups = Vec::new();
        let mut lun_maps = Vec::new();
        for t in &next.targets {
            let Some(was) = base.targets.iter().find(|b| b.iqn == t.iqn) else {
                new_targets.push(t);
                continue;
            };
            let in_place = |what: &str| {
                Err(AdminError::BadSpec(format!(
                    "target {}: {what} cannot change while it is served: remove the target and add it again (its sessions end), or restart",
                    t.iqn
                )))
            };
            if t.alias != was.alias {
                return in_place("its alias");
            }
            if t.advertise != was.advertise || t.redirect != was.redirect {
                return in_place("its advertised addresses or redirection");
            }
            if t.limits != was.limits || t.qos_initiators != was.qos_initiators {
                return in_place("its negotiation limits or QoS");
            }
            if t.tpgt != was.tpgt {
                return in_place("its portal_group_tag");
            }
            if t.lun_maps != was.lun_maps {
                lun_maps.push(t);
            }
            if t.portals != was.portals {
                moved.push(t);
            }
            if t.alua != was.alua {
                port_groups.push(t);
            }
            let running = now.luns.get(&t.iqn).cloned().unwrap_or_default();
            let wanted = t.luns_by_number();
            for (n, spec) in &wanted {
                match running.get(n) {
                    None => adds.push((t.iqn.clone(), *n, spec.clone())),
                    Some(r) if !r.matches(spec) => {
                        return Err(AdminError::BadSpec(format!(
                            "target {}: LUN {n} changed in place; remove it (one reload), then add it back (another), or use mcsi ctl",
                            t.iqn
                        )))
                    }
                    Some(_) => {}
                }
            }
            for n in running.keys() {
                if !wanted.contains_key(n) {
                    removes.push((t.iqn.clone(), *n));
                }
            }
            if now.auth.get(&t.iqn) != Some(&t.auth) {
                access.push((t.iqn.clone(), t.auth.clone()));
            }
        }
        for b in &base.targets {
            if !next.targets.iter().any(|t| t.iqn == b.iqn) {
                gone_targets.push(b.iqn.clone());
            }
        }
        // Bind every new portal first: one that cannot bind changes nothing (the sockets
        // bound so far close unserved).
        let had = base.portals();
        let wanted = next.portals();
        let mut bound = Vec::new();
        for a in wanted.iter().filter(|a| !had.contains(a)) {
            let b = self.portals.bind(*a).map_err(|e| AdminError::Listen {
                addr: *a,
                why: e.to_string(),
            })?;
            bound.push(b);
        }
        let local = |a: &std::net::SocketAddr| -> std::net::SocketAddr {
            bound
                .iter()
                .find(|b| b.asked == *a)
                .map(|b| b.local)
                .or_else(|| self.portals.local(*a))
                .unwrap_or(*a)
        };
        // Open every new LUN, of the targets served and of the new ones, likewise.
        let dir = base.state_dir.clone();
        let open = |iqn: String, n: u16, spec: LunSpec| {
            let dir = dir.clone();
            async move {
                let (i2, s2) = (iqn.clone(), spec.clone());
                tokio::task::spawn_blocking(move || {
                    crate::units::build_lu(&i2, n, &s2, dir.as_deref())
                })
                .await
                .map_err(|e| AdminError::Backend {
                    lun: n,
                    why: e.to_string(),
                })?
                .map_err(|e| AdminError::Backend {
                    lun: n,
                    why: format!("target {iqn}: {e:#}"),
                })
            }
        };
        let mut opened = Vec::new();
        for (iqn, n, spec) in adds {
            let lu = open(iqn.clone(), n, spec.clone()).await?;
            opened.push((iqn, n, spec, lu));
        }
        let mut built = Vec::new();
        let mut identities = BTreeMap::new();
        for t in &new_targets {
            let mut luns = Vec::new();
            for (n, spec) in t.luns_by_number() {
                luns.push((n, open(t.iqn.clone(), n, spec).await?));
            }
            let portals = t.portals.iter().map(local).collect();
            // Recorded with the identity each unit has, so that a save keeps it.
            identities.insert(
                t.iqn.clone(),
                t.luns_by_number()
                    .into_iter()
                    .filter_map(|(n, spec)| {
                        let (_, lu) = luns.iter().find(|(m, _)| *m == n)?;
                        Some((
                            n,
                            spec.with_identity(&lu.config().serial, lu.config().naa_id),
                        ))
                    })
                    .collect::<BTreeMap<u16, LunSpec>>(),
            );
            let metrics: Vec<_> = luns
                .iter()
                .map(|(n, _)| (*n, self.metrics.lun(&t.iqn, *n)))
                .collect();
            built.push(crate::session::Target::new(t, luns, portals, &metrics));
        }
        // Nothing below fails on what the plan checked.
        let mut changes = Changes::default();
        for name in gone_targets {
            self.remove_target_locked(&name, grace).await?;
            changes.targets_removed.push(name);
        }
        for (iqn, n) in removes {
            self.remove_lun_locked(Some(&iqn), n).await?;
            changes.luns_removed.push((iqn, n));
        }
        for (iqn, n, spec, lu) in opened {
            let t = self.target(Some(&iqn))?;
            self.install_lun(&t, n, lu, spec)?;
            changes.luns_added.push((iqn, n));
        }
        for (iqn, auth) in access {
            self.change_access_locked(Some(&iqn), |_, a| {
                *a = auth.clone();
                Ok(())
            })?;
            changes.access_changed.push(iqn);
        }
        for t in &moved {
            let running = self.target(Some(&t.iqn))?;
            running
                .portals
                .store(Arc::new(t.portals.iter().map(local).collect()));
            changes.portals_changed.push(t.iqn.clone());
        }
        for t in &port_groups {
            let running = self.target(Some(&t.iqn))?;
            running.set_alua(t.alua.clone());
            changes.port_groups_changed.push(t.iqn.clone());
        }
        // After the LUNs: a map names the target's LUNs as `next` has them.
        for t in &lun_maps {
            let running = self.target(Some(&t.iqn))?;
            running.set_lun_maps(&t.lun_maps);
            changes.lun_maps_changed.push(t.iqn.clone());
        }
        for t in built {
            self.gate.open_target(&t);
            self.shared.set_targets(|v| {
                let mut v = v.to_vec();
                v.push(t.clone());
                v
            });
            changes.targets_added.push(t.name.clone());
        }
        for b in bound {
            self.portals.start(b);
        }
        let mut closed = Vec::new();
        for a in had.iter().filter(|a| !wanted.contains(a)) {
            closed.extend(self.portals.close(*a));
        }
        for c in closed {
            let _ = c.await;
        }
        // What runs now: the targets as `next` has them (their LUNs and access in the maps).
        {
            let mut a = self.applied();
            a.base.targets = next.targets.clone();
            for t in &next.targets {
                if let Some(luns) = identities.remove(&t.iqn) {
                    a.luns.insert(t.iqn.clone(), luns);
                    a.auth.insert(t.iqn.clone(), t.auth.clone());
                }
            }
            for name in &changes.targets_removed {
                a.luns.remove(name);
                a.auth.remove(name);
            }
            // The file as read is what the next save edits.
            a.base.source = next.source.clone();
            a.base.access_from_flags = next.access_from_flags;
        }
        tracing::info!(?changes, "configuration applied");
        Ok(changes)
    }

    /// Stops serving target `name`: new logins to it are refused at once, its sessions are
    /// asked to log out within `grace` and dropped after it, and its LUNs are flushed once the
    /// commands on them are done (each as [`Admin::remove_lun`] does).
    async fn remove_target_locked(&self, name: &str, grace: Duration) -> Result<(), AdminError> {
        let t = self.target(Some(name))?;
        // Closed to sessions first, then unlisted: a login under way is refused by one or the
        // other, and none registers a session after this.
        self.gate.close_target(name);
        self.shared
            .set_targets(|v| v.iter().filter(|x| !Arc::ptr_eq(x, &t)).cloned().collect());
        let of_t = || -> Vec<Arc<crate::session::Session>> {
            self.shared
                .all_sessions()
                .into_iter()
                .filter(|s| s.target.as_ref().is_some_and(|x| Arc::ptr_eq(x, &t)))
                .collect()
        };
        for s in of_t() {
            s.request_logout(grace);
        }
        let until = Instant::now() + grace;
        while !of_t().is_empty() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for s in of_t() {
            s.close(SessionEnd::Administrator).await;
        }
        let luns: Vec<u16> = t.dev.luns().iter().map(|(n, _)| *n).collect();
        for n in luns {
            if let Ok(lu) = t.remove_unit(n) {
                drain_and_flush(&t.name, n, lu).await;
            }
        }
        tracing::info!(target = %t.name, "the target is no longer served");
        Ok(())
    }

    /// What runs as a configuration, changed by `change` and applied: the one way a request
    /// about targets and portals takes.
    async fn apply_change(
        &self,
        grace: Duration,
        change: impl FnOnce(&mut ServerConfig) -> Result<(), AdminError>,
    ) -> Result<Changes, AdminError> {
        let _one = self.shared.admin_lock().await;
        let mut next = self.applied().config();
        change(&mut next)?;
        self.apply_locked(&next, grace).await
    }

    /// Serves a new target: its LUNs opened and its portals bound (each already open, or
    /// opened now) before it is listed; it takes logins at once. A target with no portal
    /// given takes the server's (every portal some target has).
    pub async fn add_target(
        &self,
        mut spec: crate::config::TargetSpec,
    ) -> Result<Changes, AdminError> {
        crate::name::validate(&spec.iqn)
            .map_err(|e| AdminError::BadSpec(format!("target name {:?}: {e}", spec.iqn)))?;
        if spec.luns.is_empty() {
            return Err(AdminError::BadSpec(format!(
                "target {}: a target needs at least one LUN",
                spec.iqn
            )));
        }
        let c = self
            .apply_change(REMOVE_TARGET_GRACE, |next| {
                if next.targets.iter().any(|t| t.iqn == spec.iqn) {
                    return Err(AdminError::TargetExists(spec.iqn.clone()));
                }
                if spec.portals.is_empty() {
                    spec.portals = next.portals();
                }
                next.targets.push(spec);
                Ok(())
            })
            .await?;
        tracing::info!(targets = ?c.targets_added, "the administrator added a target");
        Ok(c)
    }

    /// Stops serving a target ([`Admin::apply`]'s removal, with `grace` for its sessions to
    /// log out). Portals no other target has are closed.
    pub async fn remove_target(&self, name: &str, grace: Duration) -> Result<(), AdminError> {
        self.apply_change(grace, |next| {
            let before = next.targets.len();
            next.targets.retain(|t| t.iqn != name);
            if next.targets.len() == before {
                return Err(AdminError::NoTarget(name.into()));
            }
            Ok(())
        })
        .await?;
        tracing::info!(target = name, "the administrator removed a target");
        Ok(())
    }

    /// Maps the target's LUN `target_lun` as LUN `lun` of `initiator` (the target: the only
    /// one when None). The initiator's first mapping gives it a map: from its next command it
    /// sees only its mapped LUNs. Its sessions meet the change at their next command, with
    /// REPORTED LUNS DATA HAS CHANGED; nothing else pauses.
    pub async fn map_lun(
        &self,
        target: Option<&str>,
        initiator: &str,
        lun: u16,
        target_lun: u16,
    ) -> Result<(), AdminError> {
        let iqn = self.target(target)?.name.clone();
        // Names compare without regard to case (RFC 3722 folds them to lower case).
        let name = initiator.to_ascii_lowercase();
        crate::name::validate(&name)
            .map_err(|e| AdminError::BadSpec(format!("initiator name {initiator:?}: {e}")))?;
        if lun >= 16384 {
            return Err(AdminError::BadSpec(format!(
                "LUN {lun}: a LUN number is 0 to 16383"
            )));
        }
        self.apply_change(Duration::ZERO, |next| {
            let t = target_spec(next, &iqn)?;
            if !t.luns_by_number().contains_key(&target_lun) {
                return Err(AdminError::NoLun {
                    target: iqn.clone(),
                    lun: target_lun,
                });
            }
            let i = match t.lun_maps.iter().position(|m| m.initiator == name) {
                Some(i) => i,
                None => {
                    t.lun_maps.push(crate::config::LunMap {
                        initiator: name.clone(),
                        luns: Default::default(),
                    });
                    t.lun_maps.len() - 1
                }
            };
            let m = &mut t.lun_maps[i];
            if let Some(n) = m.luns.get(&lun) {
                return Err(AdminError::BadSpec(format!(
                    "target {iqn}: {name} sees the target's LUN {n} as its LUN {lun} already; unmap it first"
                )));
            }
            if let Some((seen, _)) = m.luns.iter().find(|(_, n)| **n == target_lun) {
                return Err(AdminError::BadSpec(format!(
                    "target {iqn}: {name} sees the target's LUN {target_lun} as its LUN {seen} already; a map names a LUN once"
                )));
            }
            m.luns.insert(lun, target_lun);
            Ok(())
        })
        .await?;
        tracing::info!(target = %iqn, initiator = %name, lun, target_lun, "the administrator mapped a LUN");
        Ok(())
    }

    /// Takes LUN `lun` out of `initiator`'s map. With `whole`, the map itself goes instead and
    /// the initiator sees every LUN of the target again; otherwise its last LUN leaves an empty
    /// map (it sees none).
    pub async fn unmap_lun(
        &self,
        target: Option<&str>,
        initiator: &str,
        lun: Option<u16>,
    ) -> Result<(), AdminError> {
        let iqn = self.target(target)?.name.clone();
        let name = initiator.to_ascii_lowercase();
        self.apply_change(Duration::ZERO, |next| {
            let t = target_spec(next, &iqn)?;
            let no_map = || {
                AdminError::BadSpec(format!(
                    "target {iqn}: {name} has no LUN map (`mcsi ctl targets` lists them)"
                ))
            };
            let i = t
                .lun_maps
                .iter()
                .position(|m| m.initiator == name)
                .ok_or_else(no_map)?;
            match lun {
                None => {
                    t.lun_maps.remove(i);
                }
                Some(l) => {
                    if t.lun_maps[i].luns.remove(&l).is_none() {
                        return Err(AdminError::BadSpec(format!(
                            "target {iqn}: {name}'s map has no LUN {l}"
                        )));
                    }
                }
            }
            Ok(())
        })
        .await?;
        tracing::info!(target = %iqn, initiator = %name, ?lun, "the administrator unmapped a LUN");
        Ok(())
    }

    /// Adds a portal to a target (the only one when `target` is None): bound now unless
    /// another target listens there already.
    pub async fn add_portal(
        &self,
        target: Option<&str>,
        addr: std::net::SocketAddr,
    ) -> Result<Vec<String>, AdminError> {
        let name = self.target(target)?.name.clone();
        self.apply_change(REMOVE_TARGET_GRACE, |next| {
            let t = target_spec(next, &name)?;
            if t.portals.contains(&addr) {
                return Err(AdminError::BadSpec(format!(
                    "target {name}: {addr} is one of its portals already"
                )));
            }
            t.portals.push(addr);
            Ok(())
        })
        .await?;
        tracing::info!(target = name, %addr, "the administrator added a portal");
        Ok(self
            .target(Some(&name))?
            .portals
            .load()
            .iter()
            .map(|p| p.to_string())
            .collect())
    }

    /// Takes a portal from a target: no new login reaches it there (its sessions stay), and
    /// the socket closes once no target has it. A target keeps at least one portal.
    pub async fn remove_portal(
        &self,
        target: Option<&str>,
        addr: std::net::SocketAddr,
    ) -> Result<(), AdminError> {
        let name = self.target(target)?.name.clone();
        self.apply_change(REMOVE_TARGET_GRACE, |next| {
            let t = target_spec(next, &name)?;
            let before = t.portals.len();
            t.portals.retain(|p| *p != addr);
            if t.portals.len() == before {
                return Err(AdminError::BadSpec(format!(
                    "target {name}: {addr} is not one of its portals (`mcsi ctl targets` lists them, as configured)"
                )));
            }
            if t.portals.is_empty() {
                return Err(AdminError::BadSpec(format!(
                    "target {name}: {addr} is its last portal; add another first, or remove the target"
                )));
            }
            Ok(())
        })
        .await?;
        tracing::info!(target = name, %addr, "the administrator removed a portal");
        Ok(())
    }

    /// The running configuration as TOML (see [`crate::saved`]), CHAP secrets shown only when
    /// `secrets`.
    pub async fn show_config(&self, secrets: bool) -> Result<crate::saved::Rendered, AdminError> {
        let _one = self.shared.admin_lock().await;
        let a = self.applied().clone();
        let r = a.running();
        Ok(crate::saved::render(&r, secrets)?)
    }

    /// Writes the running configuration to `to`, or to the file the server was started from:
    /// checked by reading it back, then written whole (a temporary file, synced and renamed).
    /// Saved to the server's own file, it is what the next reload compares with.
    pub async fn save(&self, to: Option<&std::path::Path>) -> Result<Saved, AdminError> {
        use crate::saved::SaveError;
        let _one = self.shared.admin_lock().await;
        let a = self.applied().clone();
        let own = a.base.source.as_ref().map(|s| s.path.clone());
        let path = match (to, &own) {
            (Some(p), _) => p.to_path_buf(),
            (None, Some(p)) => p.clone(),
            (None, None) => return Err(AdminError::NoFile),
        };
        let to_own = to.is_none()
            || own.as_ref().is_some_and(|o| {
                std::fs::canonicalize(o).ok() == std::fs::canonicalize(&path).ok()
            });
        if to_own {
            if a.base.access_from_flags {
                return Err(SaveError::AccessFromFlags.into());
            }
            // The file as it is now must be the text the server read: an edit not yet reloaded
            // would be lost.
            if let Some(src) = &a.base.source {
                let now =
                    std::fs::read_to_string(&src.path).map_err(|e| SaveError::Unreadable {
                        path: src.path.clone(),
                        cause: e.to_string(),
                    })?;
                if now != src.text {
                    return Err(SaveError::ChangedSince(src.path.clone()).into());
                }
            }
        }
        let r = a.running();
        let out = crate::saved::render(&r, true)?;
        crate::saved::check(&out.text, &r)?;
        let text = out.text.clone();
        let p2 = path.clone();
        let written = tokio::task::spawn_blocking(move || crate::saved::write_atomic(&p2, &text))
            .await
            .map_err(|e| SaveError::Writer(e.to_string()))?
            .map_err(|e| SaveError::Write {
                path,
                cause: e.to_string(),
            })?;
        let same = own
            .as_ref()
            .is_some_and(|o| std::fs::canonicalize(o).is_ok_and(|o| o == written));
        if same {
            let mut a = self.applied();
            if let Some(src) = a.base.source.as_mut() {
                src.text = out.text.clone();
            }
        }
        tracing::info!(path = %written.display(), "the administrator saved the running configuration");
        Ok(Saved {
            path: written,
            bytes: out.text.len(),
            not_saved: out.notes,
        })
    }

    /// Allows `initiator` to log in to a target. The first name allowed turns a target open to
    /// any initiator into one open to the names listed.
    pub async fn allow_initiator(
        &self,
        target: Option<&str>,
        initiator: &str,
    ) -> Result<(), AdminError> {
        crate::name::validate(initiator)
            .map_err(|e| AdminError::BadSpec(format!("initiator name {initiator:?}: {e}")))?;
        self.change_access(target, |t, a| {
            if a.allow_initiators.iter().any(|i| i == initiator) {
                return Err(AdminError::AlreadyAllowed {
                    target: t.into(),
                    initiator: initiator.into(),
                });
            }
            a.allow_initiators.push(initiator.to_string());
            Ok(())
        })
        .await?;
        tracing::info!(target = ?target, initiator, "the administrator allowed an initiator");
        Ok(())
    }

    /// Takes `initiator` off a target's list (its sessions stay; `end_session` ends them). An
    /// empty list admits any initiator, so the last name goes only with `open`: revoking the
    /// last host must not open the target to every other.
    pub async fn disallow_initiator(
        &self,
        target: Option<&str>,
        initiator: &str,
        open: bool,
    ) -> Result<(), AdminError> {
        self.change_access(target, |t, a| {
            let before = a.allow_initiators.len();
            a.allow_initiators.retain(|i| i != initiator);
            if a.allow_initiators.len() == before {
                return Err(AdminError::NotAllowed {
                    target: t.into(),
                    initiator: initiator.into(),
                });
            }
            if a.allow_initiators.is_empty() && !open {
                return Err(AdminError::WouldOpen(format!(
                    "target {t}: {initiator} is the last allowed initiator, and an empty list admits any; allow another first, or say --open"
                )));
            }
            Ok(())
        })
        .await?;
        tracing::info!(target = ?target, initiator, "the administrator took an initiator off the allowed list");
        Ok(())
    }

    /// Allows logins from a source network (`10.0.0.0/8`, `2001:db8::/32`, or an address) to a
    /// target. The first network allowed closes the target to sources outside the list.
    pub async fn allow_network(&self, target: Option<&str>, net: &str) -> Result<(), AdminError> {
        let n = crate::config::Network::parse(net)
            .map_err(|e| AdminError::BadSpec(format!("network {net:?}: {e}")))?;
        self.change_access(target, |t, a| {
            if a.allow_networks.contains(&n) {
                return Err(AdminError::BadSpec(format!(
                    "target {t}: {n} is already allowed"
                )));
            }
            a.allow_networks.push(n);
            Ok(())
        })
        .await?;
        tracing::info!(target = ?target, network = %n, "the administrator allowed a network");
        Ok(())
    }

    /// Takes a source network off a target's list (sessions from it stay). An empty list admits
    /// any source, so the last network goes only with `open`.
    pub async fn disallow_network(
        &self,
        target: Option<&str>,
        net: &str,
        open: bool,
    ) -> Result<(), AdminError> {
        let n = crate::config::Network::parse(net)
            .map_err(|e| AdminError::BadSpec(format!("network {net:?}: {e}")))?;
        self.change_access(target, |t, a| {
            let before = a.allow_networks.len();
            a.allow_networks.retain(|x| *x != n);
            if a.allow_networks.len() == before {
                return Err(AdminError::BadSpec(format!(
                    "target {t}: {n} is not on its list of allowed networks"
                )));
            }
            if a.allow_networks.is_empty() && !open {
                return Err(AdminError::WouldOpen(format!(
                    "target {t}: {n} is the last allowed network, and an empty list admits any source; allow another first, or say --open"
                )));
            }
            Ok(())
        })
        .await?;
        tracing::info!(target = ?target, network = %n, "the administrator took a network off the allowed list");
        Ok(())
    }

    /// Adds a CHAP user to a target; its secret must be 12 bytes or more (RFC 7143 9.2.1). The
    /// first user makes CHAP required for new logins.
    pub async fn add_chap_user(
        &self,
        target: Option<&str>,
        user: crate::config::ChapUser,
    ) -> Result<(), AdminError> {
        user.credentials()
            .validate()
            .map_err(|e| AdminError::BadSpec(format!("CHAP user {}: {e}", user.user)))?;
        let short = |what: &str, secret: &str| {
            let n = secret.len();
            (n < mcsi_proto::chap::SHORT_SECRET_LEN).then(|| {
                AdminError::BadSpec(format!(
                    "CHAP user {}: a {what} of {n} bytes is too short: use at least {} (RFC 7143 9.2.1)",
                    user.user,
                    mcsi_proto::chap::SHORT_SECRET_LEN
                ))
            })
        };
        if let Some(e) = short("secret", &user.secret) {
            return Err(e);
        }
        if let Some(e) = user
            .mutual_secret
            .as_deref()
            .and_then(|m| short("mutual secret", m))
        {
            return Err(e);
        }
        let name = user.user.clone();
        self.change_access(target, |t, a| {
            if a.chap.iter().any(|u| u.user == user.user) {
                return Err(AdminError::ChapUserExists {
                    target: t.into(),
                    user: user.user.clone(),
                });
            }
            a.chap.push(user.clone());
            Ok(())
        })
        .await?;
        tracing::info!(target = ?target, user = name, "the administrator added a CHAP user");
        Ok(())
    }

    /// Removes a CHAP user (its sessions stay). Without CHAP users a target takes logins
    /// without CHAP, so the last user goes only with `open`.
    pub async fn remove_chap_user(
        &self,
        target: Option<&str>,
        user: &str,
        open: bool,
    ) -> Result<(), AdminError> {
        self.change_access(target, |t, a| {
            let before = a.chap.len();
            a.chap.retain(|u| u.user != user);
            if a.chap.len() == before {
                return Err(AdminError::NoChapUser {
                    target: t.into(),
                    user: user.into(),
                });
            }
            if a.chap.is_empty() && !open {
                return Err(AdminError::WouldOpen(format!(
                    "target {t}: {user} is the last CHAP user, and without one logins need no CHAP; add another first, or say --open"
                )));
            }
            Ok(())
        })
        .await?;
        tracing::info!(target = ?target, user, "the administrator removed a CHAP user");
        Ok(())
    }

    /// Ends session `tsih`: asks its initiator to log out within `grace` (an Async Message on
    /// each connection, RFC 7143 11.9.1), and drops its connections if it has not by then.
    /// An initiator that keeps its sessions (open-iscsi) logs in again unless its access is
    /// removed first.
    pub async fn end_session(&self, tsih: u16, grace: Duration) -> Result<Ended, AdminError> {
        let s = self
            .shared
            .session(tsih)
            .ok_or(AdminError::NoSession(tsih))?;
        let asked = s.request_logout(grace);
        tracing::info!(
            tsih,
            connections = asked,
            "the administrator ends the session: logout requested within {grace:?}"
        );
        let until = Instant::now() + grace;
        while Instant::now() < until {
            if !self.running(&s) {
                return Ok(Ended::LoggedOut);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if !self.running(&s) {
            return Ok(Ended::LoggedOut);
        }
        s.close(SessionEnd::Administrator).await;
        Ok(Ended::Dropped)
    }

    /// Whether `s` is still the running session of its TSIH.
    fn running(&self, s: &Arc<crate::session::Session>) -> bool {
        self.shared
            .session(s.tsih)
            .is_some_and(|x| Arc::ptr_eq(&x, s))
    }
}

/// The target `name` in a configuration being changed.
fn target_spec<'a>(
    c: &'a mut ServerConfig,
    name: &str,
) -> Result<&'a mut crate::config::TargetSpec, AdminError> {
    c.targets
        .iter_mut()
        .find(|t| t.iqn == name)
        .ok_or_else(|| AdminError::NoTarget(name.into()))
}

/// A LUN taken out of its target's inventory: its background work stopped, the commands
/// still on it finished (for at most [`REMOVE_DRAIN`]), then flushed.
async fn drain_and_flush(target: &str, lun: u16, lu: Arc<mcsi_scsi::LogicalUnit>) {
    lu.stop_background();
    // The commands that looked the unit up before it went hold it (or the inventory it was
    // in); a write acknowledged after the flush would not be on disk.
    let until = Instant::now() + REMOVE_DRAIN;
    while Arc::strong_count(&lu) > 1 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if Arc::strong_count(&lu) > 1 {
        tracing::warn!(
            target,
            lun,
            "commands still hold the removed LUN after {REMOVE_DRAIN:?}; flushing it anyway"
        );
    }
    let flushed = tokio::task::spawn_blocking(move || lu.flush()).await;
    if let Ok(Err(e)) = flushed {
        tracing::warn!(target, lun, "the removed LUN's flush failed: {e}");
    }
}
