//! The TOML file as serde reads it: every table and field as written, before validation
//! (`ServerConfig::from_toml` turns these into the validated specs of the parent module).

use super::error::{cerr, ConfigError};
use super::ChapUser;
use serde::Deserialize;

/// A size written as a number of bytes or as a string with a binary suffix ("256KiB").
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    pub(super) fn bytes(&self, field: &str) -> Result<u64, ConfigError> {
        match self {
            SizeValue::Bytes(b) => Ok(*b),
            SizeValue::Text(s) => mcsi_units::parse_size(s).map_err(|e| cerr(field, e.to_string())),
        }
    }
}

/// `[targets.qos]`: either a storage QoS requirement (seed 004: `read_ratio`, `iops`, `size`,
/// `rt`, `alpha`), from which each session's bandwidth per direction is computed, or the rates
/// themselves (`to_client`, `to_storage`, bytes per second on the wire), with an optional
/// `burst`.
#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileQos {
    pub read_ratio: Option<f64>,
    pub iops: Option<f64>,
    pub size: Option<SizeValue>,
    pub rt: Option<String>,
    pub alpha: Option<f64>,
    pub to_client: Option<SizeValue>,
    pub to_storage: Option<SizeValue>,
    pub burst: Option<SizeValue>,
    /// The link's capacity each way, bytes per second: a session is admitted only if its
    /// rates fit beside those of the sessions already in.
    pub capacity: Option<SizeValue>,
    /// `[targets.qos.initiators."NAME"]`: a requirement or rates for the sessions of one
    /// initiator, in place of the target's (whose keys then apply to the other initiators,
    /// and may be left out: those are not limited).
    #[serde(default)]
    pub initiators: std::collections::BTreeMap<String, FileQos>,
}

/// The TOML file.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Portals every target is reachable on unless it lists its own.
    #[serde(default)]
    pub listen: Vec<String>,
    /// Discovery sessions (SendTargets).
    pub discovery: Option<FileDiscovery>,
    /// Server-wide limits on logins and connections.
    pub limits: Option<FileLimits>,
    /// Threads that run sessions (default: one per CPU; 0: the main runtime).
    pub session_threads: Option<usize>,
    /// Every portal listens with Multipath TCP (plain TCP initiators still connect).
    #[serde(default)]
    pub mptcp: bool,
    /// The control socket of `mcsi ctl` (a path; created owner-only).
    pub control: Option<String>,
    /// Where persistent reservations made with APTPL are kept (a directory).
    pub state_dir: Option<String>,
    /// The addresses SendTargets gives for every target that has no `advertise` of its own,
    /// in place of its portals ("HOST:PORT"; behind NAT, the public address).
    #[serde(default)]
    pub advertise: Vec<String>,
    #[serde(default)]
    pub targets: Vec<FileTarget>,
}

/// `[limits]`: what any peer may take of the server before its login names a target.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FileLimits {
    /// New connections (each one a login) per second from one source address; 0: no limit.
    pub login_rate: Option<u32>,
    /// Connections a source may open in a row before `login_rate` applies.
    pub login_burst: Option<u32>,
    /// Time from accepting a connection to its full feature phase ("30s").
    pub login_timeout: Option<String>,
    /// TCP connections the server holds at once, logging in or logged in.
    pub max_server_connections: Option<u32>,
    /// Connections one source may have logging in at once; 0: no limit.
    pub max_logins_per_source: Option<u32>,
    /// Bytes of solicited WRITE data all sessions together may hold at once ("128MiB").
    pub write_budget: Option<SizeValue>,
    /// Bytes of READ data all sessions together may hold at once ("128MiB").
    pub read_budget: Option<SizeValue>,
    /// Bytes of unsolicited WRITE data (immediate data and unsolicited bursts) all sessions
    /// together may hold at once ("64MiB").
    pub unsolicited_budget: Option<SizeValue>,
    /// Bytes of answers all sessions together keep for TASK REASSIGN after their connection
    /// failed (ErrorRecoveryLevel 2, "128MiB").
    pub retention_budget: Option<SizeValue>,
    /// Bytes all connections' sent-PDU logs together keep for SNACK and reassignment
    /// (ErrorRecoveryLevel 1 and up, "128MiB").
    pub sent_log_budget: Option<SizeValue>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FileDiscovery {
    pub auth: Option<FileAuth>,
}

/// `auth` of a target or of discovery.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FileAuth {
    /// CHAP users; none means AuthMethod=None.
    #[serde(default)]
    pub chap: Vec<ChapUser>,
    /// Initiator names allowed in; none means any.
    #[serde(default)]
    pub allow_initiators: Vec<String>,
    /// Source networks allowed in ("10.0.0.0/8", "::1/128", or an address); none means any.
    #[serde(default)]
    pub allow_networks: Vec<String>,
    /// CHAP algorithms allowed ("SHA3-256", "SHA256", "SHA1", "MD5"); default all but MD5.
    pub chap_algorithms: Option<Vec<String>>,
    /// Accept CHAP secrets shorter than 12 bytes (RFC 7143 9.2.1 wants 12 or more unless the
    /// channel is protected otherwise, e.g. by IPsec).
    #[serde(default)]
    pub allow_short_secrets: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTarget {
    pub iqn: String,
    pub alias: Option<String>,
    /// Portals of this target (default: the top-level `listen`).
    #[serde(default)]
    pub listen: Vec<String>,
    /// The addresses SendTargets gives for this target in place of its portals ("HOST:PORT";
    /// default: the top-level `advertise`, else the portals).
    #[serde(default)]
    pub advertise: Vec<String>,
    /// Logins to this target are sent to another portal (RFC 7143 11.13.5).
    pub redirect: Option<FileRedirect>,
    #[serde(default)]
    pub luns: Vec<FileLun>,
    pub max_connections: Option<u32>,
    pub max_recv_data_segment_length: Option<SizeValue>,
    pub max_burst_length: Option<SizeValue>,
    pub first_burst_length: Option<SizeValue>,
    pub max_outstanding_r2t: Option<u32>,
    pub initial_r2t: Option<bool>,
    pub immediate_data: Option<bool>,
    /// Commands that may be queued per session (the MaxCmdSN window).
    pub queue_depth: Option<u32>,
    /// Authentication (CHAP) and access control.
    pub auth: Option<FileAuth>,
    /// Idle time after which the target pings a connection with a NOP-In ("30s"; "0" turns the
    /// keepalive off).
    pub nop_interval: Option<String>,
    /// Time the initiator has to answer a NOP-In ping before the connection is dropped ("15s").
    pub nop_timeout: Option<String>,
    /// Accept the asymmetric mode (`X-org.mcsi.Asymmetric`) when an mcsi initiator asks for it
    /// (default true; standard initiators never ask).
    pub asymmetric: Option<bool>,
    /// Sessions of this target at once.
    pub max_sessions: Option<u32>,
    /// Connections to this target at once, over all its sessions.
    pub max_target_connections: Option<u32>,
    /// TCP congestion control of this target's connections ("cubic", "bbr", ...; default: the
    /// system's).
    pub congestion: Option<String>,
    /// The highest ErrorRecoveryLevel agreed (0 to 2).
    pub max_erl: Option<u32>,
    /// Honour TARGET COLD RESET from any initiator: every session of the target ends
    /// (default false: answered "function authorization failed").
    pub allow_cold_reset: Option<bool>,
    /// Bandwidth per session (seed 004): a storage QoS requirement, or rates per direction.
    pub qos: Option<FileQos>,
    /// How each task's response connection is chosen in the asymmetric mode ("round-robin",
    /// "least-outstanding", "tcp-aware", "weighted:3,1", "failover").
    pub response_policy: Option<String>,
    /// Bytes a connection may have queued for sending before its reader stops taking
    /// requests ("8MiB").
    pub output_budget: Option<SizeValue>,
    /// A connection whose socket takes no byte for this long is dropped ("30s"; "0": never).
    pub send_timeout: Option<String>,
    /// Bytes of READ data a session's commands may hold at once ("64MiB").
    pub read_budget: Option<SizeValue>,
    /// Bytes of solicited WRITE data a session's commands may hold at once ("64MiB").
    pub write_budget: Option<SizeValue>,
    /// A write that was asked for its data and receives none for this long ends its
    /// connection ("20s"; "0": never).
    pub data_out_timeout: Option<String>,
    /// This gateway's target portal group tag (1 to 65535, default 1): the relative target
    /// port identifier of its port, which VPD 83h and REPORT TARGET PORT GROUPS name. Gateways
    /// of one LUN each take their own.
    pub portal_group_tag: Option<u16>,
    /// ALUA target port groups (`[[targets.port_groups]]`): every gateway of the LUN, grouped,
    /// each group in an access state. Absent: no ALUA (TPGS 0).
    #[serde(default)]
    pub port_groups: Vec<FilePortGroup>,
    /// Per-initiator LUN maps (`[[targets.lun_maps]]`): an initiator named in one sees only its
    /// mapped LUNs, under its own numbers; the others see every LUN.
    #[serde(default)]
    pub lun_maps: Vec<FileLunMap>,
}

/// `[[targets.lun_maps]]`: which LUNs one initiator sees, and under which numbers.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileLunMap {
    /// The initiator's iSCSI name.
    pub initiator: String,
    /// The initiator's LUN number = the target's LUN number: `luns = { 0 = 3, 1 = 5 }`.
    pub luns: std::collections::BTreeMap<String, u16>,
}

/// `[[targets.port_groups]]`: one ALUA target port group.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePortGroup {
    /// The group's identifier (1 to 65535).
    pub id: u16,
    /// "active/optimized", "active/non-optimized", "standby" or "unavailable".
    pub state: String,
    /// The portal group tags of the gateways in the group.
    pub ports: Vec<u16>,
    /// The PREF bit: the initiator's preferred group among the active ones.
    #[serde(default)]
    pub preferred: bool,
}

/// `[targets.redirect]`: logins that arrive on `from` (default: every portal of the target)
/// are answered "target moved" with `to` as the address to log in at instead.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRedirect {
    /// "HOST:PORT" of the portal to log in at.
    pub to: String,
    /// Portals of this target whose logins are redirected (default: all of them).
    #[serde(default)]
    pub from: Vec<String>,
    /// "Moved permanently" (the initiator may keep the new address) rather than temporarily.
    #[serde(default)]
    pub permanent: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileLun {
    /// The LUN's number (0 to 65535); without it, the lowest number that no LUN of the target
    /// names and none before it took.
    pub lun: Option<u16>,
    /// `ram:SIZE`, `file:PATH`, `file:PATH:SIZE` or `block:PATH`.
    pub backend: String,
    pub block_size: Option<u32>,
    /// The physical block the LUN reports (a power-of-two multiple of `block_size`, at most
    /// 2^15 blocks): 4096 on a 512-byte LUN stands for a 512e disk.
    pub physical_block_size: Option<u32>,
    #[serde(default)]
    pub read_only: bool,
    pub serial: Option<String>,
    /// The LUN's NAA identifier in VPD 83h (32 hex digits, NAA type 6): with `serial`, its
    /// identity, kept wherever the LUN moves (`mcsi ctl save` writes both).
    pub naa: Option<String>,
    /// The most a SANITIZE OVERWRITE writes per second ("64MiB"; unset: as fast as the
    /// backend goes).
    pub sanitize_rate: Option<SizeValue>,
    /// Honour SANITIZE, which erases the whole LUN (default false: refused as an unsupported
    /// command).
    #[serde(default)]
    pub allow_sanitize: bool,
    /// Each read and write takes at least this long ("8ms"): a stand-in for a disk's
    /// service time in experiments.
    pub service_time: Option<String>,
}
