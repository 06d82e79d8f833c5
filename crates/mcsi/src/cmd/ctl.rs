//! `mcsi ctl`: the administration of a running target over its control socket, and the socket's
//! server side (`mcsi target --control PATH`, or `control = "PATH"` in its file).
//!
//! The socket is a Unix stream socket, created owner-only (mode 0600), and a client whose user
//! is not the server's own (or root) is refused by its credentials as well. Each request is one
//! line of JSON, `{"op": "sessions"}`, and each answer one line, `{"ok": true, "result": ...}`
//! or `{"ok": false, "error": "why"}`. A request that fails changes nothing.

use anyhow::{bail, Context};
use mcsi_target::admin::Admin;
use mcsi_target::config::ServerConfig;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// Where `mcsi ctl` looks unless told (`--socket`, or MCSI_CONTROL), as the packaged service's
/// file sets it.
pub const DEFAULT_SOCKET: &str = "/run/mcsi/control.sock";
/// Clients served at once; one more is answered with an error and closed.
pub const MAX_CLIENTS: usize = 8;
/// The longest request line taken.
pub const MAX_LINE: usize = 64 << 10;
/// A client that sends no complete request for this long is dropped.
pub const CLIENT_IDLE: Duration = Duration::from_secs(30);
/// The longest an initiator may be given to log out when its session is ended.
pub const MAX_GRACE: Duration = Duration::from_secs(300);

/// One request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// The targets with their portals and LUNs.
    Targets,
    /// The sessions with their connections.
    Sessions,
    /// End a session: ask its initiator to log out, and drop it after `grace_ms`.
    EndSession { tsih: u16, grace_ms: u64 },
    /// Add LUN `lun` to `target` (the only one when absent) from a `--lun` spec.
    AddLun {
        #[serde(default)]
        target: Option<String>,
        lun: u16,
        spec: String,
    },
    /// Grow LUN `lun` of `target` to `size` (e.g. "20GiB"), or to its file's size now.
    GrowLun {
        #[serde(default)]
        target: Option<String>,
        lun: u16,
        #[serde(default)]
        size: Option<String>,
    },
    /// Remove LUN `lun` of `target`.
    RemoveLun {
        #[serde(default)]
        target: Option<String>,
        lun: u16,
    },
    /// Allow an initiator name to log in to `target`.
    AllowInitiator {
        #[serde(default)]
        target: Option<String>,
        initiator: String,
    },
    /// Take an initiator name off `target`'s allowed list (the last only with `open`).
    DisallowInitiator {
        #[serde(default)]
        target: Option<String>,
        initiator: String,
        #[serde(default)]
        open: bool,
    },
    /// Allow a source network (`10.0.0.0/8`, or an address) to log in to `target`.
    AllowNetwork {
        #[serde(default)]
        target: Option<String>,
        network: String,
    },
    /// Take a source network off `target`'s list (the last only with `open`).
    DisallowNetwork {
        #[serde(default)]
        target: Option<String>,
        network: String,
        #[serde(default)]
        open: bool,
    },
    /// Add a CHAP user to `target`.
    AddChapUser {
        #[serde(default)]
        target: Option<String>,
        user: String,
        secret: String,
        /// Mutual CHAP: the name and secret the target answers this user's challenge with.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mutual_user: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mutual_secret: Option<String>,
    },
    /// Remove a CHAP user of `target` (the last only with `open`).
    RemoveChapUser {
        #[serde(default)]
        target: Option<String>,
        user: String,
        #[serde(default)]
        open: bool,
    },
    /// Map the target's LUN `target_lun` as LUN `lun` of `initiator`.
    MapLun {
        #[serde(default)]
        target: Option<String>,
        initiator: String,
        lun: u16,
        target_lun: u16,
    },
    /// Take LUN `lun` out of `initiator`'s map, or (no `lun`) the map itself.
    UnmapLun {
        #[serde(default)]
        target: Option<String>,
        initiator: String,
        #[serde(default)]
        lun: Option<u16>,
    },
    /// Serve a new target, with LUNs 0, 1, ... from `luns` (`--lun` specs), on `portals`
    /// (none: the server's), open to `allow_initiators` (none: any initiator).
    AddTarget {
        iqn: String,
        #[serde(default)]
        alias: Option<String>,
        #[serde(default)]
        portals: Vec<String>,
        luns: Vec<String>,
        #[serde(default)]
        allow_initiators: Vec<String>,
    },
    /// Stop serving a target: its sessions are asked to log out within `grace_ms`.
    RemoveTarget { target: String, grace_ms: u64 },
    /// Add a portal (ADDR:PORT) to `target`.
    AddPortal {
        #[serde(default)]
        target: Option<String>,
        portal: String,
    },
    /// Take a portal from `target`.
    RemovePortal {
        #[serde(default)]
        target: Option<String>,
        portal: String,
    },
    /// Read the configuration file again and apply the difference.
    Reload,
    /// The running configuration as TOML (CHAP secrets only when `secrets`).
    ShowConfig {
        #[serde(default)]
        secrets: bool,
    },
    /// Write the running configuration to `to` (an absolute path), or to the server's file.
    Save {
        #[serde(default)]
        to: Option<PathBuf>,
    },
}

/// One answer.
#[derive(Debug, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Reply {
    fn ok(v: impl Serialize) -> Reply {
        Reply {
            ok: true,
            result: Some(serde_json::to_value(v).unwrap_or(serde_json::Value::Null)),
            error: None,
        }
    }

    fn err(e: impl std::fmt::Display) -> Reply {
        Reply {
            ok: false,
            result: None,
            error: Some(e.to_string()),
        }
    }
}

/// The control socket while it is served; dropping it removes the file.
pub struct ControlSocket {
    path: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// How the server reads its configuration file again (with its command line's settings).
pub type Reload = std::sync::Arc<dyn Fn() -> anyhow::Result<ServerConfig> + Send + Sync>;

/// Reads the configuration again and applies the difference; a summary of what changed.
pub async fn reload(admin: &Admin, r: &Reload) -> anyhow::Result<String> {
    let c = admin.reload(|| r()).await??;
    let mut parts = Vec::new();
    for (t, l) in &c.luns_added {
        parts.push(format!("{t} LUN {l} added"));
    }
    for (t, l) in &c.luns_removed {
        parts.push(format!("{t} LUN {l} removed"));
    }
    for t in &c.access_changed {
        parts.push(format!("{t} access replaced"));
    }
    for t in &c.targets_added {
        parts.push(format!("target {t} added"));
    }
    for t in &c.targets_removed {
        parts.push(format!("target {t} removed"));
    }
    for t in &c.portals_changed {
        parts.push(format!("{t} portals changed"));
    }
    for t in &c.port_groups_changed {
        parts.push(format!("{t} ALUA port groups changed"));
    }
    for t in &c.lun_maps_changed {
        parts.push(format!("{t} LUN maps changed"));
    }
    Ok(if parts.is_empty() {
        String::from("no change")
    } else {
        parts.join(", ")
    })
}

/// Listens on `path` and answers requests about `admin`'s server until dropped. A socket left
/// by an earlier run is replaced; a live one, or a file that is not a socket, is an error.
pub fn serve(path: &Path, admin: Admin, reloader: Option<Reload>) -> anyhow::Result<ControlSocket> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let shown = path.display();
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            bail!("control socket {shown}: the path exists and is not a socket; remove it or choose another path");
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("control socket {shown}: another server is already listening there");
        }
        std::fs::remove_file(path)
            .with_context(|| format!("control socket {shown}: removing the stale socket"))?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("control socket {shown}: creating {}", dir.display()))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        }
    }
    let l = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("control socket {shown}: cannot listen"))?;
    // Owner-only from here on; a client that connected in between is refused by its
    // credentials below.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("control socket {shown}: cannot make it owner-only"))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_CLIENTS));
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = l.accept().await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let allowed = stream
                .peer_cred()
                .is_ok_and(|c| c.uid() == me || c.uid() == 0);
            let admin = admin.clone();
            let reloader = reloader.clone();
            let slot = slots.clone().try_acquire_owned();
            tokio::spawn(async move {
                let (rd, mut wr) = stream.into_split();
                let refuse = if !allowed {
                    Some("refused: the control socket serves only the user the target runs as")
                } else if slot.is_err() {
                    Some("refused: too many control clients at once; try again")
                } else {
                    None
                };
                if let Some(why) = refuse {
                    tracing::warn!("control socket: {why}");
                    let _ = send(&mut wr, &Reply::err(why)).await;
                    return;
                }
                let _slot = slot;
                let mut rd = BufReader::new(rd);
                let mut line = Vec::new();
                loop {
                    line.clear();
                    let read = tokio::time::timeout(
                        CLIENT_IDLE,
                        (&mut rd)
                            .take(MAX_LINE as u64 + 1)
                            .read_until(b'\n', &mut line),
                    )
                    .await;
                    let n = match read {
                        Ok(Ok(n)) => n,
                        _ => return,
                    };
                    if n == 0 {
                        return;
                    }
                    if line.last() != Some(&b'\n') {
                        let _ = send(&mut wr, &Reply::err(format!("a request longer than {MAX_LINE} bytes, or not ended by a new line"))).await;
                        return;
                    }
                    let reply = match serde_json::from_slice::<Request>(&line) {
                        Ok(Request::Reload) => match &reloader {
                            None => Reply::err(
                                "nothing to reload: the target was started without --config",
                            ),
                            Some(r) => match reload(&admin, r).await {
                                Ok(summary) => {
                                    Reply::ok(serde_json::json!({ "reloaded": summary }))
                                }
                                Err(e) => {
                                    Reply::err(format!("not reloaded, nothing changed: {e:#}"))
                                }
                            },
                        },
                        Ok(req) => answer(&admin, req).await,
                        Err(e) => Reply::err(format!("a request that does not parse: {e}")),
                    };
                    if send(&mut wr, &reply).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(ControlSocket {
        path: path.to_path_buf(),
        task,
    })
}

async fn send(w: &mut tokio::net::unix::OwnedWriteHalf, r: &Reply) -> std::io::Result<()> {
    let mut b = serde_json::to_vec(r).map_err(std::io::Error::other)?;
    b.push(b'\n');
    // A client that does not read its answer gives up its place.
    tokio::time::timeout(CLIENT_IDLE, w.write_all(&b))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
}

/// Carries out one request.
pub async fn answer(admin: &Admin, req: Request) -> Reply {
    match req {
        Request::Targets => Reply::ok(admin.targets()),
        Request::Sessions => Reply::ok(admin.sessions()),
        Request::EndSession { tsih, grace_ms } => {
            let grace = Duration::from_millis(grace_ms);
            if grace > MAX_GRACE || grace < Duration::from_secs(1) {
                return Reply::err(format!(
                    "grace: {grace:?} is outside 1 s to {} s",
                    MAX_GRACE.as_secs()
                ));
            }
            match admin.end_session(tsih, grace).await {
                Ok(e) => Reply::ok(serde_json::json!({ "tsih": tsih, "ended": e })),
                Err(e) => Reply::err(e),
            }
        }
        Request::AddLun { target, lun, spec } => {
            match admin.add_lun(target.as_deref(), lun, &spec).await {
                Ok(()) => Reply::ok(serde_json::json!({ "lun": lun, "added": spec })),
                Err(e) => Reply::err(e),
            }
        }
        Request::GrowLun { target, lun, size } => {
            let size = match size.as_deref().map(mcsi_units::parse_size).transpose() {
                Ok(s) => s,
                Err(e) => return Reply::err(format!("size: {e} (e.g. 20GiB)")),
            };
            match admin.grow_lun(target.as_deref(), lun, size).await {
                Ok((old, new)) => {
                    Reply::ok(serde_json::json!({ "lun": lun, "old_blocks": old, "blocks": new }))
                }
                Err(e) => Reply::err(e),
            }
        }
        Request::RemoveLun { target, lun } => {
            match admin.remove_lun(target.as_deref(), lun).await {
                Ok(()) => Reply::ok(serde_json::json!({ "lun": lun, "removed": true })),
                Err(e) => Reply::err(e),
            }
        }
        Request::AllowInitiator { target, initiator } => {
            done(admin.allow_initiator(target.as_deref(), &initiator).await)
        }
        Request::DisallowInitiator {
            target,
            initiator,
            open,
        } => done(
            admin
                .disallow_initiator(target.as_deref(), &initiator, open)
                .await,
        ),
        Request::AllowNetwork { target, network } => {
            done(admin.allow_network(target.as_deref(), &network).await)
        }
        Request::DisallowNetwork {
            target,
            network,
            open,
        } => done(
            admin
                .disallow_network(target.as_deref(), &network, open)
                .await,
        ),
        Request::AddChapUser {
            target,
            user,
            secret,
            mutual_user,
            mutual_secret,
        } => {
            if mutual_user.is_some() != mutual_secret.is_some() {
                return Reply::err("mutual CHAP needs both mutual_user and mutual_secret");
            }
            done(
                admin
                    .add_chap_user(
                        target.as_deref(),
                        mcsi_target::config::ChapUser {
                            user,
                            secret,
                            mutual_user,
                            mutual_secret,
                        },
                    )
                    .await,
            )
        }
        Request::RemoveChapUser { target, user, open } => {
            done(admin.remove_chap_user(target.as_deref(), &user, open).await)
        }
        Request::MapLun {
            target,
            initiator,
            lun,
            target_lun,
        } => done(
            admin
                .map_lun(target.as_deref(), &initiator, lun, target_lun)
                .await,
        ),
        Request::UnmapLun {
            target,
            initiator,
            lun,
        } => done(admin.unmap_lun(target.as_deref(), &initiator, lun).await),
        Request::AddTarget {
            iqn,
            alias,
            portals,
            luns,
            allow_initiators,
        } => match target_spec(iqn, alias, &portals, &luns, allow_initiators) {
            Ok(spec) => match admin.add_target(spec).await {
                Ok(c) => {
                    let bound: Vec<String> = admin
                        .targets()
                        .into_iter()
                        .filter(|t| c.targets_added.contains(&t.name))
                        .flat_map(|t| t.portals)
                        .collect();
                    Reply::ok(serde_json::json!({ "added": c.targets_added, "portals": bound }))
                }
                Err(e) => Reply::err(e),
            },
            Err(e) => Reply::err(e),
        },
        Request::RemoveTarget { target, grace_ms } => {
            let grace = Duration::from_millis(grace_ms);
            if grace > MAX_GRACE || grace < Duration::from_secs(1) {
                return Reply::err(format!(
                    "grace: {grace:?} is outside 1 s to {} s",
                    MAX_GRACE.as_secs()
                ));
            }
            match admin.remove_target(&target, grace).await {
                Ok(()) => Reply::ok(serde_json::json!({ "removed": target })),
                Err(e) => Reply::err(e),
            }
        }
        Request::AddPortal { target, portal } => match mcsi_target::config::parse_portal(&portal) {
            Ok(a) => match admin.add_portal(target.as_deref(), a).await {
                Ok(p) => Reply::ok(serde_json::json!({ "portals": p })),
                Err(e) => Reply::err(e),
            },
            Err(e) => Reply::err(format!("portal {portal:?}: {e}")),
        },
        Request::RemovePortal { target, portal } => {
            match mcsi_target::config::parse_portal(&portal) {
                Ok(a) => done(admin.remove_portal(target.as_deref(), a).await),
                Err(e) => Reply::err(format!("portal {portal:?}: {e}")),
            }
        }
        Request::Reload => Reply::err("a reload needs the server's file; ask the server"),
        Request::ShowConfig { secrets } => match admin.show_config(secrets).await {
            Ok(r) => Reply::ok(serde_json::json!({ "toml": r.text, "not_saved": r.notes })),
            Err(e) => Reply::err(e),
        },
        Request::Save { to } => {
            if to.as_ref().is_some_and(|p| !p.is_absolute()) {
                return Reply::err("save: `to` must be an absolute path");
            }
            match admin.save(to.as_deref()).await {
                Ok(s) => Reply::ok(s),
                Err(e) => Reply::err(e),
            }
        }
    }
}

/// A new target from an add-target request: its LUNs numbered from 0 in the order given, the
/// target's limits and timers the defaults (a target that needs others goes in the file).
fn target_spec(
    iqn: String,
    alias: Option<String>,
    portals: &[String],
    luns: &[String],
    allow_initiators: Vec<String>,
) -> anyhow::Result<mcsi_target::config::TargetSpec> {
    let portals = mcsi_target::config::parse_portals("portal", portals)?;
    let luns = luns
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let mut spec = mcsi_target::config::parse_lun_arg(&format!("LUN {i}"), l)?;
            spec.lun = Some(i as u16);
            Ok(spec)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for n in &allow_initiators {
        mcsi_target::name::validate(n).with_context(|| format!("initiator name {n:?}"))?;
    }
    Ok(mcsi_target::config::TargetSpec {
        iqn,
        alias,
        portals,
        advertise: Vec::new(),
        redirect: None,
        luns,
        limits: Default::default(),
        auth: mcsi_target::config::AuthSpec {
            allow_initiators,
            ..Default::default()
        },
        qos_initiators: Vec::new(),
        tpgt: 1,
        alua: None,
        lun_maps: Vec::new(),
    })
}

fn done(r: Result<(), mcsi_target::admin::AdminError>) -> Reply {
    match r {
        Ok(()) => Reply::ok(serde_json::json!({ "done": true })),
        Err(e) => Reply::err(e),
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// The target's control socket (its `--control`, or `control` in its file).
    #[arg(long, value_name = "PATH", env = "MCSI_CONTROL", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Print the answer as JSON instead of text.
    #[arg(long)]
    json: bool,
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// The targets served, with their portals, LUNs and sessions.
    Targets,
    /// The sessions, each connection with its address, TCP state and counters.
    Sessions,
    /// End a session: ask its initiator to log out (an Async Message), and drop its
    /// connections if it has not within the grace time.
    EndSession {
        /// The session's TSIH (`mcsi ctl sessions` lists them).
        tsih: u16,
        /// How long the initiator has to log out (e.g. 5s; 1s to 300s).
        #[arg(long, default_value = "5s")]
        grace: String,
    },
    /// Add a LUN while the target runs; its sessions are told that the LUN inventory changed
    /// (unit attention REPORTED LUNS DATA HAS CHANGED) and go on without a pause.
    AddLun {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The LUN number (not in use on that target).
        lun: u16,
        /// The LUN, as `mcsi target --lun` takes it: ram:SIZE, file:PATH[:SIZE], block:PATH,
        /// rbd:POOL/IMAGE, with ,block_size=N ,read_only ,serial=S ...
        spec: String,
    },
    /// Grow a LUN while the target runs: a file or rbd LUN to --size, or any LUN to the size
    /// its file, block device or rbd image has now (grown by its own tools); its sessions are
    /// told (unit attention CAPACITY DATA HAS CHANGED) and go on. A LUN never shrinks.
    GrowLun {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The LUN number.
        lun: u16,
        /// The new size (e.g. 20GiB); without it, the size the LUN's storage has now.
        #[arg(long, value_name = "SIZE")]
        size: Option<String>,
    },
    /// Remove a LUN while the target runs: commands on it finish, it is flushed, and it then
    /// answers as absent; its sessions are told that the LUN inventory changed.
    RemoveLun {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The LUN number.
        lun: u16,
    },
    /// Allow an initiator to log in (the first name allowed closes the target to others;
    /// sessions already logged in stay).
    AllowInitiator {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The initiator's name (iqn., eui. or naa.).
        initiator: String,
    },
    /// Take an initiator off the allowed list (its sessions stay: `end-session` ends them; the
    /// last name goes only with --open, as an empty list admits any initiator).
    DisallowInitiator {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The initiator's name.
        initiator: String,
        /// Let the last name go, which opens the target to any initiator.
        #[arg(long)]
        open: bool,
    },
    /// Allow logins from a source network (10.0.0.0/8, 2001:db8::/32, or an address; the
    /// first closes the target to sources outside the list; sessions already in stay).
    AllowNetwork {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The network, ADDR/PREFIX or an address.
        network: String,
    },
    /// Take a source network off the allowed list (its sessions stay; the last goes only with
    /// --open, as an empty list admits any source).
    DisallowNetwork {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The network, as it was allowed.
        network: String,
        /// Let the last network go, which opens the target to any source.
        #[arg(long)]
        open: bool,
    },
    /// Add a CHAP user (the first makes CHAP required for new logins). The secret, 12 bytes or
    /// more, comes from a file or a variable, never the command line.
    AddChapUser {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The CHAP user name.
        user: String,
        /// Read the secret from this file (its first line).
        #[arg(
            long,
            value_name = "PATH",
            required_unless_present = "secret_env",
            conflicts_with = "secret_env"
        )]
        secret_file: Option<PathBuf>,
        /// Read the secret from this environment variable.
        #[arg(long, value_name = "VAR")]
        secret_env: Option<String>,
        /// Mutual CHAP: the name the target answers this user's challenge with (its secret from
        /// --mutual-secret-file or --mutual-secret-env).
        #[arg(long, value_name = "NAME")]
        mutual_user: Option<String>,
        /// Read the target's mutual CHAP secret from this file (its first line).
        #[arg(
            long,
            value_name = "PATH",
            requires = "mutual_user",
            conflicts_with = "mutual_secret_env"
        )]
        mutual_secret_file: Option<PathBuf>,
        /// Read the target's mutual CHAP secret from this environment variable.
        #[arg(long, value_name = "VAR", requires = "mutual_user")]
        mutual_secret_env: Option<String>,
    },
    /// Show an initiator the target's LUN TARGET_LUN as its LUN LUN (its first mapping gives it
    /// a LUN map: from then on it sees only its mapped LUNs). Its sessions are told at their
    /// next command (REPORTED LUNS DATA HAS CHANGED).
    MapLun {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The initiator's name.
        initiator: String,
        /// The mapping, the initiator's LUN = the target's LUN (e.g. 0=3).
        #[arg(value_name = "LUN=TARGET_LUN", value_parser = parse_mapping)]
        mapping: (u16, u16),
    },
    /// Take a LUN out of an initiator's map (its last leaves an empty map: it sees none), or
    /// with --all the map itself (it sees every LUN of the target again).
    UnmapLun {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The initiator's name.
        initiator: String,
        /// The initiator's LUN number to take out.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        lun: Option<u16>,
        /// Remove the whole map.
        #[arg(long)]
        all: bool,
    },
    /// Serve a new target while the server runs: its LUNs open and its portals listen before
    /// it takes logins. Its negotiation limits and timers are the defaults (for others, add it
    /// to the file and reload).
    AddTarget {
        /// The target's name (iqn., eui. or naa.).
        iqn: String,
        /// A LUN, as `mcsi target --lun` takes it; LUNs 0, 1, ... in the order given.
        #[arg(long = "lun", value_name = "SPEC", required = true)]
        luns: Vec<String>,
        /// A portal, ADDR[:PORT] (repeat it for several; default: the server's portals).
        #[arg(long = "listen", value_name = "ADDR:PORT")]
        portals: Vec<String>,
        /// Allow only this initiator (repeat it; default: any initiator).
        #[arg(long = "allow-initiator", value_name = "IQN")]
        allow_initiators: Vec<String>,
        /// The target's alias (TargetAlias).
        #[arg(long)]
        alias: Option<String>,
    },
    /// Stop serving a target: new logins to it are refused, its sessions are asked to log
    /// out (and dropped after the grace time), and its LUNs are flushed. Portals no other
    /// target has close.
    RemoveTarget {
        /// The target's name.
        iqn: String,
        /// How long its initiators have to log out (e.g. 5s; 1s to 300s).
        #[arg(long, default_value = "5s")]
        grace: String,
    },
    /// Add a portal to a target: it listens there from now on (sessions elsewhere go on).
    AddPortal {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// ADDR[:PORT] (port 3260 when not given).
        portal: String,
    },
    /// Take a portal from a target: no new login reaches it there (sessions through it stay);
    /// the socket closes once no target has it. A target keeps at least one portal.
    RemovePortal {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The portal as configured (`mcsi ctl show-config` shows it).
        portal: String,
    },
    /// Read the target's configuration file again and apply the difference (as SIGHUP does):
    /// targets, portals and LUNs added and removed, access replaced; a change that needs a
    /// restart is refused whole.
    Reload,
    /// Print the running configuration as TOML: the file the target read, with its LUNs and
    /// access as they run now (CHAP secrets hidden unless --secrets).
    ShowConfig {
        /// Show the CHAP secrets.
        #[arg(long)]
        secrets: bool,
    },
    /// Save the running configuration to the target's file (or --to PATH), whole or not at
    /// all: the running LUNs, each with its number, and access go into the file, comments and
    /// other settings stay. The file is written owner-only (it may hold CHAP secrets).
    Save {
        /// Write here instead (needed when the target was started without --config).
        #[arg(long, value_name = "PATH")]
        to: Option<PathBuf>,
    },
    /// Remove a CHAP user (its sessions stay; the last goes only with --open, as a target
    /// without CHAP users takes logins without CHAP).
    RemoveChapUser {
        /// The target (needed when the server has several).
        #[arg(long, value_name = "IQN")]
        target: Option<String>,
        /// The CHAP user name.
        user: String,
        /// Let the last user go, after which logins need no CHAP.
        #[arg(long)]
        open: bool,
    },
}

/// A secret from `--secret-file` (its first line) or `--secret-env`.
fn secret(file: &Option<PathBuf>, env: &Option<String>) -> anyhow::Result<String> {
    match (file, env) {
        (Some(p), _) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("--secret-file {}", p.display()))?;
            Ok(text.lines().next().unwrap_or("").to_string())
        }
        (None, Some(v)) => {
            std::env::var(v).with_context(|| format!("--secret-env {v}: the variable is not set"))
        }
        (None, None) => bail!("give the secret with --secret-file PATH or --secret-env VAR"),
    }
}

/// Sends one request and returns its answer.
pub async fn request(socket: &Path, req: &Request) -> anyhow::Result<Reply> {
    let shown = socket.display();
    let stream = tokio::net::UnixStream::connect(socket).await.map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::NotFound => {
                "no such socket: is the target running with --control (or `control` in its file)?"
            }
            std::io::ErrorKind::PermissionDenied => {
                "permission denied: the socket is owner-only; run as the target's user"
            }
            std::io::ErrorKind::ConnectionRefused => {
                "connection refused: the target that made this socket is not running"
            }
            _ => "cannot connect",
        };
        anyhow::anyhow!("{shown}: {hint} ({e})")
    })?;
    let (rd, mut wr) = stream.into_split();
    let mut b = serde_json::to_vec(req)?;
    b.push(b'\n');
    // A server that refuses the client answers at once and closes, perhaps before the request
    // is written: the refusal is still there to read.
    let sent = wr.write_all(&b).await;
    let mut line = String::new();
    let read = BufReader::new(rd).read_line(&mut line).await;
    if line.is_empty() {
        if let Err(e) = sent {
            bail!("{shown}: sending the request: {e}");
        }
        read.with_context(|| format!("{shown}: reading the answer"))?;
        bail!("{shown}: the target closed the connection without an answer");
    }
    serde_json::from_str(&line).with_context(|| format!("{shown}: an answer that does not parse"))
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let req = match &args.what {
        What::Reload => Request::Reload,
        What::ShowConfig { secrets } => Request::ShowConfig { secrets: *secrets },
        What::Save { to } => Request::Save {
            to: to
                .as_ref()
                .map(std::path::absolute)
                .transpose()
                .context("--to")?,
        },
        What::AllowNetwork { target, network } => Request::AllowNetwork {
            target: target.clone(),
            network: network.clone(),
        },
        What::DisallowNetwork {
            target,
            network,
            open,
        } => Request::DisallowNetwork {
            target: target.clone(),
            network: network.clone(),
            open: *open,
        },
        What::AllowInitiator { target, initiator } => Request::AllowInitiator {
            target: target.clone(),
            initiator: initiator.clone(),
        },
        What::DisallowInitiator {
            target,
            initiator,
            open,
        } => Request::DisallowInitiator {
            target: target.clone(),
            initiator: initiator.clone(),
            open: *open,
        },
        What::AddChapUser {
            target,
            user,
            secret_file,
            secret_env,
            mutual_user,
            mutual_secret_file,
            mutual_secret_env,
        } => Request::AddChapUser {
            target: target.clone(),
            user: user.clone(),
            secret: secret(secret_file, secret_env)?,
            mutual_user: mutual_user.clone(),
            mutual_secret: match mutual_user {
                Some(_) => Some(secret(mutual_secret_file, mutual_secret_env).context(
                    "--mutual-user needs --mutual-secret-file PATH or --mutual-secret-env VAR",
                )?),
                None => None,
            },
        },
        What::RemoveChapUser { target, user, open } => Request::RemoveChapUser {
            target: target.clone(),
            user: user.clone(),
            open: *open,
        },
        What::MapLun {
            target,
            initiator,
            mapping,
        } => Request::MapLun {
            target: target.clone(),
            initiator: initiator.clone(),
            lun: mapping.0,
            target_lun: mapping.1,
        },
        What::UnmapLun {
            target,
            initiator,
            lun,
            ..
        } => Request::UnmapLun {
            target: target.clone(),
            initiator: initiator.clone(),
            lun: *lun,
        },
        What::AddLun { target, lun, spec } => Request::AddLun {
            target: target.clone(),
            lun: *lun,
            spec: spec.clone(),
        },
        What::GrowLun { target, lun, size } => Request::GrowLun {
            target: target.clone(),
            lun: *lun,
            size: size.clone(),
        },
        What::RemoveLun { target, lun } => Request::RemoveLun {
            target: target.clone(),
            lun: *lun,
        },
        What::AddTarget {
            iqn,
            luns,
            portals,
            allow_initiators,
            alias,
        } => Request::AddTarget {
            iqn: iqn.clone(),
            alias: alias.clone(),
            portals: portals.clone(),
            luns: luns.clone(),
            allow_initiators: allow_initiators.clone(),
        },
        What::RemoveTarget { iqn, grace } => {
            let d = mcsi_units::parse_duration(grace, mcsi_units::BareUnit::Refuse)
                .map_err(|e| anyhow::anyhow!("--grace {grace}: {e}"))?;
            Request::RemoveTarget {
                target: iqn.clone(),
                grace_ms: d.as_millis() as u64,
            }
        }
        What::AddPortal { target, portal } => Request::AddPortal {
            target: target.clone(),
            portal: portal.clone(),
        },
        What::RemovePortal { target, portal } => Request::RemovePortal {
            target: target.clone(),
            portal: portal.clone(),
        },
        What::Targets => Request::Targets,
        What::Sessions => Request::Sessions,
        What::EndSession { tsih, grace } => {
            let d = mcsi_units::parse_duration(grace, mcsi_units::BareUnit::Refuse)
                .map_err(|e| anyhow::anyhow!("--grace {grace}: {e}"))?;
            Request::EndSession {
                tsih: *tsih,
                grace_ms: d.as_millis() as u64,
            }
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let reply = rt.block_on(request(&args.socket, &req))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reply)?);
    } else if let (true, Some(v)) = (reply.ok, &reply.result) {
        print_human(&req, v)?;
    }
    if !reply.ok {
        eprintln!(
            "mcsi ctl: {}",
            reply.error.as_deref().unwrap_or("the request failed")
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// Names on stderr what runs but is not in the configuration written.
fn not_saved(v: &serde_json::Value) {
    for n in v.as_array().into_iter().flatten() {
        eprintln!(
            "mcsi ctl: not in the file, keep it on the command line: {}",
            n.as_str().unwrap_or("")
        );
    }
}

fn print_human(req: &Request, v: &serde_json::Value) -> anyhow::Result<()> {
    let text = |x: &serde_json::Value| match x {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => String::from("-"),
        other => other.to_string(),
    };
    let empty = Vec::new();
    let list = |x: &serde_json::Value| x.as_array().cloned().unwrap_or_default();
    match req {
        Request::Targets => {
            for t in list(v) {
                let portals: Vec<String> = list(&t["portals"]).iter().map(text).collect();
                let alias = t["alias"]
                    .as_str()
                    .map(|a| format!(" ({a})"))
                    .unwrap_or_default();
                println!(
                    "{}{alias}  portals {}  sessions {}",
                    text(&t["name"]),
                    portals.join(" "),
                    text(&t["sessions"])
                );
                let names = |k: &str| {
                    let v: Vec<String> = list(&t[k]).iter().map(text).collect();
                    if v.is_empty() {
                        String::from("any")
                    } else {
                        v.join(" ")
                    }
                };
                println!(
                    "  initiators {}  networks {}  CHAP users {}",
                    names("allowed_initiators"),
                    names("allowed_networks"),
                    if list(&t["chap_users"]).is_empty() {
                        String::from("none")
                    } else {
                        names("chap_users")
                    }
                );
                for g in t["port_groups"].as_array().unwrap_or(&empty) {
                    let ports: Vec<String> = list(&g["ports"]).iter().map(text).collect();
                    println!(
                        "  port group {} {}{}  ports {}{}",
                        text(&g["id"]),
                        text(&g["state"]),
                        if g["preferred"].as_bool() == Some(true) {
                            " (preferred)"
                        } else {
                            ""
                        },
                        ports.join(" "),
                        if list(&g["ports"]).contains(&t["portal_group_tag"]) {
                            "  (this gateway)"
                        } else {
                            ""
                        }
                    );
                }
                for m in t["lun_maps"].as_array().unwrap_or(&empty) {
                    let luns: Vec<String> = list(&m["luns"])
                        .iter()
                        .map(|p| format!("{}={}", text(&p[0]), text(&p[1])))
                        .collect();
                    println!("  LUN map {}  {}", text(&m["initiator"]), luns.join(" "));
                }
                for l in t["luns"].as_array().unwrap_or(&empty) {
                    println!(
                        "  LUN {:<3} {:>12} blocks of {:>4} B  {}  serial {}  naa {}",
                        text(&l["lun"]),
                        text(&l["blocks"]),
                        text(&l["block_size"]),
                        if l["read_only"].as_bool() == Some(true) {
                            "ro"
                        } else {
                            "rw"
                        },
                        text(&l["serial"]),
                        text(&l["naa"])
                    );
                    let shared: Vec<String> = list(&l["shared_port_groups"])
                        .iter()
                        .map(|g| format!("{}={}", text(&g[0]), text(&g[1])))
                        .collect();
                    if !shared.is_empty() {
                        println!(
                            "        port group states kept with the image: {}",
                            shared.join(" ")
                        );
                    }
                }
            }
        }
        Request::Sessions => {
            let ss = list(v);
            if ss.is_empty() {
                println!("no sessions");
            }
            for s in ss {
                let conns = list(&s["connections"]);
                let target = s["target"].as_str().unwrap_or("(discovery)");
                println!(
                    "TSIH {:<5} {target}  initiator {}  ISID {}  {} connection(s)",
                    text(&s["tsih"]),
                    text(&s["initiator"]),
                    text(&s["isid"]),
                    conns.len()
                );
                for c in conns {
                    let t = &c["tcp"];
                    let tcp = if t.is_null() {
                        String::from("no TCP_INFO")
                    } else {
                        format!(
                            "cwnd {} rtt {} us retrans {}",
                            text(&t["cwnd"]),
                            text(&t["rtt_us"]),
                            text(&t["total_retrans"])
                        )
                    };
                    println!(
                        "  CID {:<3} {:<8} {} -> {}  commands {}  read {} B  written {} B  {tcp}",
                        text(&c["cid"]),
                        text(&c["role"]),
                        text(&c["peer"]),
                        text(&c["local"]),
                        text(&c["commands"]),
                        text(&c["read_bytes"]),
                        text(&c["write_bytes"]),
                    );
                }
            }
        }
        Request::AddLun { lun, spec, .. } => println!("LUN {lun} added: {spec}"),
        Request::RemoveLun { lun, .. } => println!("LUN {lun} removed"),
        Request::GrowLun { lun, .. } => println!(
            "LUN {lun}: {} blocks, was {}",
            text(&v["blocks"]),
            text(&v["old_blocks"])
        ),
        Request::AllowInitiator { initiator, .. } => println!("{initiator} allowed"),
        Request::AllowNetwork { network, .. } => println!("network {network} allowed"),
        Request::DisallowNetwork { network, .. } => {
            println!("network {network} no longer allowed (its sessions, if any, stay)")
        }
        Request::DisallowInitiator { initiator, .. } => {
            println!("{initiator} no longer allowed (its sessions, if any, stay)")
        }
        Request::AddChapUser { user, .. } => println!("CHAP user {user} added"),
        Request::Reload => println!("reloaded: {}", text(&v["reloaded"])),
        Request::AddTarget { iqn, luns, .. } => {
            let p: Vec<String> = list(&v["portals"]).iter().map(text).collect();
            println!(
                "target {iqn} added with {} LUN(s), on {}",
                luns.len(),
                p.join(" ")
            )
        }
        Request::RemoveTarget { target, .. } => println!("target {target} removed"),
        Request::MapLun {
            initiator,
            lun,
            target_lun,
            ..
        } => println!("{initiator} sees the target's LUN {target_lun} as its LUN {lun}"),
        Request::UnmapLun { initiator, lun, .. } => match lun {
            Some(l) => println!("LUN {l} taken out of {initiator}'s map"),
            None => println!("{initiator}'s LUN map removed: it sees every LUN of the target"),
        },
        Request::AddPortal { portal, .. } => {
            let p: Vec<String> = list(&v["portals"]).iter().map(text).collect();
            println!(
                "portal {portal} added; the target listens on {}",
                p.join(" ")
            )
        }
        Request::RemovePortal { portal, .. } => println!("portal {portal} removed"),
        Request::ShowConfig { .. } => {
            print!("{}", v["toml"].as_str().unwrap_or(""));
            not_saved(&v["not_saved"]);
        }
        Request::Save { .. } => {
            println!("saved {} ({} bytes)", text(&v["path"]), text(&v["bytes"]));
            not_saved(&v["not_saved"]);
        }
        Request::RemoveChapUser { user, .. } => println!("CHAP user {user} removed"),
        Request::EndSession { tsih, .. } => match v["ended"].as_str() {
            Some("logged_out") => println!("session {tsih}: the initiator logged out"),
            _ => println!(
                "session {tsih}: no logout within the grace time; its connections were dropped"
            ),
        },
    }
    Ok(())
}

/// `LUN=TARGET_LUN` of `mcsi ctl map-lun`.
fn parse_mapping(s: &str) -> Result<(u16, u16), String> {
    let (a, b) = s
        .split_once('=')
        .ok_or_else(|| format!("'{s}': write the initiator's LUN = the target's LUN, e.g. 0=3"))?;
    let num = |x: &str| {
        x.trim()
            .parse::<u16>()
            .ok()
            .filter(|n| *n < 16384)
            .ok_or_else(|| format!("'{x}' is not a LUN number (0 to 16383)"))
    };
    Ok((num(a)?, num(b)?))
}
