//! What an administrator may ask of a running server (through `mcsi ctl`): its targets and
//! LUNs, its sessions with their connections, and ending a session.

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
                    .map(|(i, lu)| LunView {
                        lun: i,
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
