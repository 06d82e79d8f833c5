//! What an administrator may ask of a running server (through `mcsi ctl`): its targets and
//! LUNs, adding and removing a LUN, its sessions with their connections, and ending a session.
//! Each request is checked whole before anything changes: one that fails changes nothing.

use crate::session::{SessionEnd, Shared};
use crate::stats::SessionSnapshot;
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a request could not be carried out; nothing was changed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdminError {
    #[error("no session with TSIH {0} (`mcsi ctl sessions` lists them)")]
    NoSession(u16),
    #[error("no target named {0} (`mcsi ctl targets` lists them)")]
    NoTarget(String),
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
    #[error("LUN {lun}: {why}")]
    Backend { lun: u16, why: String },
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
}

#[derive(Debug, Clone, Serialize)]
pub struct LunView {
    pub lun: u16,
    pub blocks: u64,
    pub block_size: u32,
    pub read_only: bool,
    pub serial: String,
}

/// A handle on a running server for its administration ([`crate::Server::admin`]).
#[derive(Clone)]
pub struct Admin {
    pub(crate) shared: Arc<Shared>,
    pub(crate) metrics: Arc<crate::stats::Metrics>,
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
            .targets
            .iter()
            .map(|t| TargetView {
                name: t.name.clone(),
                alias: t.alias.clone(),
                portals: t.portals.iter().map(|p| p.to_string()).collect(),
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
                    })
                    .collect(),
                sessions: sessions
                    .iter()
                    .filter(|s| s.target.as_ref().is_some_and(|x| Arc::ptr_eq(x, t)))
                    .count(),
            })
            .collect()
    }

    /// The target named `name`, or the only one when `name` is None.
    fn target(&self, name: Option<&str>) -> Result<Arc<crate::session::Target>, AdminError> {
        let ts = &self.shared.targets;
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
        // Opening a backend may wait on a disk or a cluster.
        let iqn = t.name.clone();
        let lu = tokio::task::spawn_blocking(move || crate::units::build_lu(&iqn, lun, &l))
            .await
            .map_err(|e| AdminError::Backend {
                lun,
                why: e.to_string(),
            })?
            .map_err(|e| AdminError::Backend {
                lun,
                why: format!("{e:#}"),
            })?;
        let m = self.metrics.lun(&t.name, lun);
        t.dev.add(lun, lu).map_err(|_| in_use())?;
        t.lun_metrics.rcu(|v| {
            let mut v = (**v).clone();
            v.retain(|(i, _)| *i != lun);
            v.push((lun, m.clone()));
            v
        });
        tracing::info!(target = %t.name, lun, spec, "the administrator added a LUN");
        Ok(())
    }

    /// Removes LUN `lun` from a target. Commands on it finish; it is flushed; the sessions of
    /// the target get REPORTED LUNS DATA HAS CHANGED, and the LUN answers as absent.
    pub async fn remove_lun(&self, target: Option<&str>, lun: u16) -> Result<(), AdminError> {
        let t = self.target(target)?;
        let lu = t.dev.remove(lun).map_err(|_| AdminError::NoLun {
            target: t.name.clone(),
            lun,
        })?;
        t.lun_metrics.rcu(|v| {
            let mut v = (**v).clone();
            v.retain(|(i, _)| *i != lun);
            v
        });
        lu.stop_background();
        let flushed = tokio::task::spawn_blocking(move || lu.flush()).await;
        if let Ok(Err(e)) = flushed {
            tracing::warn!(target = %t.name, lun, "the removed LUN's flush failed: {e}");
        }
        tracing::info!(target = %t.name, lun, "the administrator removed a LUN");
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
