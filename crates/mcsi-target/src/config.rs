//! Target configuration: a TOML file describing targets, portals, LUNs and per-target negotiation
//! limits, or the same built from command-line flags. Validation errors name the field and say
//! what is allowed.

use crate::name;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::Path;

/// Default target name when none is given.
pub const DEFAULT_IQN: &str = "iqn.2026-01.org.mcsi:target";
/// Default portal.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:3260";
/// Default LUN when none is given.
pub const DEFAULT_LUN: &str = "ram:1GiB";

/// A configuration value that is wrong, with the path of the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {why}")]
pub struct ConfigError {
    pub field: String,
    pub why: String,
}

fn cerr(field: impl Into<String>, why: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        why: why.into(),
    }
}

/// A size written as a number of bytes or as a string with a binary suffix ("256KiB").
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    fn bytes(&self, field: &str) -> Result<u64, ConfigError> {
        match self {
            SizeValue::Bytes(b) => Ok(*b),
            SizeValue::Text(s) => mcsi_units::parse_size(s).map_err(|e| cerr(field, e.to_string())),
        }
    }
}

/// The TOML file.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Portals every target is reachable on unless it lists its own.
    #[serde(default)]
    pub listen: Vec<String>,
    #[serde(default)]
    pub targets: Vec<FileTarget>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTarget {
    pub iqn: String,
    pub alias: Option<String>,
    /// Portals of this target (default: the top-level `listen`).
    #[serde(default)]
    pub listen: Vec<String>,
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
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileLun {
    /// `ram:SIZE`, `file:PATH`, `file:PATH:SIZE` or `block:PATH`.
    pub backend: String,
    pub block_size: Option<u32>,
    #[serde(default)]
    pub read_only: bool,
    pub serial: Option<String>,
}

/// Negotiation limits of one target (what it offers and accepts; RFC 7143 section 13).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: u16,
    pub max_recv_data_segment_length: u32,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub max_outstanding_r2t: u16,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub queue_depth: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 8,
            max_recv_data_segment_length: 262_144,
            max_burst_length: 1_048_576,
            first_burst_length: 65_536,
            max_outstanding_r2t: 8,
            // "No" lets initiators send the first burst without waiting a round trip for an R2T,
            // which matters on long links; InitialR2T is an OR key so an initiator may still ask.
            initial_r2t: false,
            immediate_data: true,
            queue_depth: 128,
        }
    }
}

/// One LUN, validated; the backend is opened when the server starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LunSpec {
    pub backend: String,
    pub block_size: u32,
    pub read_only: bool,
    pub serial: Option<String>,
}

/// One target, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetSpec {
    pub iqn: String,
    pub alias: Option<String>,
    pub portals: Vec<SocketAddr>,
    pub luns: Vec<LunSpec>,
    pub limits: Limits,
}

/// The whole server, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub targets: Vec<TargetSpec>,
}

impl ServerConfig {
    /// Every distinct portal, in first-seen order.
    pub fn portals(&self) -> Vec<SocketAddr> {
        let mut out: Vec<SocketAddr> = Vec::new();
        for t in &self.targets {
            for p in &t.portals {
                if !out.contains(p) {
                    out.push(*p);
                }
            }
        }
        out
    }

    /// Reads and validates a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| cerr(path.display().to_string(), format!("cannot read: {e}")))?;
        Self::from_toml(&text).map_err(|mut e| {
            e.field = format!("{}: {}", path.display(), e.field);
            e
        })
    }

    /// Parses and validates TOML text.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let file: FileConfig = toml::from_str(text).map_err(|e| {
            let msg = e.message().to_string();
            let at = e
                .span()
                .map(|s| {
                    let line = text[..s.start.min(text.len())].lines().count().max(1);
                    format!("line {line}")
                })
                .unwrap_or_else(|| "config".into());
            cerr(at, msg)
        })?;
        Self::from_file_config(&file)
    }

    /// Validates a parsed file.
    pub fn from_file_config(file: &FileConfig) -> Result<Self, ConfigError> {
        let global = parse_portals("listen", &file.listen)?;
        if file.targets.is_empty() {
            return Err(cerr(
                "targets",
                "at least one [[targets]] entry is required",
            ));
        }
        let mut targets = Vec::new();
        for (i, t) in file.targets.iter().enumerate() {
            let at = |f: &str| format!("targets[{i}].{f}");
            name::validate(&t.iqn).map_err(|e| cerr(at("iqn"), e.to_string()))?;
            if targets.iter().any(|x: &TargetSpec| x.iqn == t.iqn) {
                return Err(cerr(
                    at("iqn"),
                    format!("'{}' is used by two targets", t.iqn),
                ));
            }
            let mut portals = parse_portals(&at("listen"), &t.listen)?;
            if portals.is_empty() {
                portals = global.clone();
            }
            if portals.is_empty() {
                return Err(cerr(
                    at("listen"),
                    "no portal: give `listen = [\"ADDR:PORT\"]` at the top or in the target",
                ));
            }
            if t.luns.is_empty() {
                return Err(cerr(
                    at("luns"),
                    "a target needs at least one [[targets.luns]]",
                ));
            }
            let mut luns = Vec::new();
            for (j, l) in t.luns.iter().enumerate() {
                let f = |x: &str| format!("targets[{i}].luns[{j}].{x}");
                check_backend_spec(&f("backend"), &l.backend)?;
                let block_size = l.block_size.unwrap_or(512);
                if !matches!(block_size, 512 | 1024 | 2048 | 4096) {
                    return Err(cerr(
                        f("block_size"),
                        format!("{block_size} is not supported (use 512, 1024, 2048 or 4096)"),
                    ));
                }
                if let Some(s) = &l.serial {
                    if s.is_empty() || s.len() > 32 || !s.bytes().all(|b| b.is_ascii_graphic()) {
                        return Err(cerr(
                            f("serial"),
                            "must be 1 to 32 printable ASCII characters without spaces",
                        ));
                    }
                }
                luns.push(LunSpec {
                    backend: l.backend.clone(),
                    block_size,
                    read_only: l.read_only,
                    serial: l.serial.clone(),
                });
            }
            if luns.len() > 16384 {
                return Err(cerr(at("luns"), "at most 16384 LUNs per target"));
            }
            let limits = limits_from(t, &at)?;
            targets.push(TargetSpec {
                iqn: t.iqn.clone(),
                alias: t.alias.clone(),
                portals,
                luns,
                limits,
            });
        }
        Ok(ServerConfig { targets })
    }
}

fn limits_from(t: &FileTarget, at: &dyn Fn(&str) -> String) -> Result<Limits, ConfigError> {
    let d = Limits::default();
    // Ranges from RFC 7143 section 13.
    const SEG_MAX: u64 = (1 << 24) - 1;
    let size = |v: &Option<SizeValue>, f: &str, def: u32| -> Result<u32, ConfigError> {
        let Some(v) = v else { return Ok(def) };
        let b = v.bytes(&at(f))?;
        if !(512..=SEG_MAX).contains(&b) {
            return Err(cerr(
                at(f),
                format!("{b} is out of range (512 to {SEG_MAX} bytes)"),
            ));
        }
        Ok(b as u32)
    };
    let max_connections = match t.max_connections {
        None => d.max_connections,
        Some(n) if (1..=65535).contains(&n) => n as u16,
        Some(n) => {
            return Err(cerr(
                at("max_connections"),
                format!("{n} is out of range (1 to 65535)"),
            ))
        }
    };
    let max_outstanding_r2t = match t.max_outstanding_r2t {
        None => d.max_outstanding_r2t,
        Some(n) if (1..=65535).contains(&n) => n as u16,
        Some(n) => {
            return Err(cerr(
                at("max_outstanding_r2t"),
                format!("{n} is out of range (1 to 65535)"),
            ))
        }
    };
    let queue_depth = match t.queue_depth {
        None => d.queue_depth,
        Some(n) if (1..=65536).contains(&n) => n,
        Some(n) => {
            return Err(cerr(
                at("queue_depth"),
                format!("{n} is out of range (1 to 65536)"),
            ))
        }
    };
    let l = Limits {
        max_connections,
        max_recv_data_segment_length: size(
            &t.max_recv_data_segment_length,
            "max_recv_data_segment_length",
            d.max_recv_data_segment_length,
        )?,
        max_burst_length: size(&t.max_burst_length, "max_burst_length", d.max_burst_length)?,
        first_burst_length: size(
            &t.first_burst_length,
            "first_burst_length",
            d.first_burst_length,
        )?,
        max_outstanding_r2t,
        initial_r2t: t.initial_r2t.unwrap_or(d.initial_r2t),
        immediate_data: t.immediate_data.unwrap_or(d.immediate_data),
        queue_depth,
    };
    if l.first_burst_length > l.max_burst_length {
        return Err(cerr(
            at("first_burst_length"),
            format!(
                "{} exceeds max_burst_length {} (FirstBurstLength <= MaxBurstLength, RFC 7143 13.14)",
                l.first_burst_length, l.max_burst_length
            ),
        ));
    }
    Ok(l)
}

/// Checks the form of a backend spec without opening it.
pub fn check_backend_spec(field: &str, spec: &str) -> Result<(), ConfigError> {
    let allowed = "(use ram:SIZE, file:PATH[:SIZE], block:PATH)";
    let bad = |why: String| cerr(field, format!("{why} {allowed}"));
    let Some((kind, rest)) = spec.split_once(':') else {
        return Err(bad(format!("unknown backend '{spec}'")));
    };
    match kind {
        "ram" => {
            let size = mcsi_units::parse_size(rest).map_err(|e| bad(format!("{e};")))?;
            if size == 0 {
                return Err(bad(format!("'{spec}': size must be above zero;")));
            }
            Ok(())
        }
        "file" | "block" if !rest.is_empty() => Ok(()),
        "file" | "block" => Err(bad(format!("'{spec}': missing path;"))),
        _ => Err(bad(format!("unknown backend '{spec}'"))),
    }
}

/// Parses portal addresses; a bare host gets port 3260.
pub fn parse_portals(field: &str, list: &[String]) -> Result<Vec<SocketAddr>, ConfigError> {
    let mut out = Vec::new();
    for (i, s) in list.iter().enumerate() {
        let a = parse_portal(s).map_err(|why| cerr(format!("{field}[{i}]"), why))?;
        if !out.contains(&a) {
            out.push(a);
        }
    }
    Ok(out)
}

/// `ADDR:PORT`, `[V6]:PORT`, or an address alone (port 3260, the iSCSI well-known port).
pub fn parse_portal(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = s
        .trim_matches(|c| c == '[' || c == ']')
        .parse::<std::net::IpAddr>()
    {
        return Ok(SocketAddr::new(ip, 3260));
    }
    Err(format!(
        "'{s}' is not an address (use IP:PORT such as 127.0.0.1:3260 or [::1]:3260)"
    ))
}

/// Parses a `--lun` value: a backend spec optionally followed by `,block_size=N`, `,read_only`,
/// `,serial=S`.
pub fn parse_lun_arg(field: &str, arg: &str) -> Result<LunSpec, ConfigError> {
    let mut parts = arg.split(',');
    let backend = parts.next().unwrap_or("").to_string();
    check_backend_spec(field, &backend)?;
    let mut lun = LunSpec {
        backend,
        block_size: 512,
        read_only: false,
        serial: None,
    };
    for p in parts {
        match p.split_once('=') {
            Some(("block_size" | "bs", v)) => {
                lun.block_size = match v.parse() {
                    Ok(n @ (512 | 1024 | 2048 | 4096)) => n,
                    _ => {
                        return Err(cerr(
                            field,
                            format!(
                                "block_size '{v}' is not supported (use 512, 1024, 2048 or 4096)"
                            ),
                        ))
                    }
                }
            }
            Some(("serial", v)) if !v.is_empty() && v.len() <= 32 => lun.serial = Some(v.into()),
            None if p == "read_only" || p == "ro" => lun.read_only = true,
            _ => {
                return Err(cerr(
                    field,
                    format!("unknown option '{p}' (use block_size=N, read_only, serial=S)"),
                ))
            }
        }
    }
    Ok(lun)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_file() {
        let c = ServerConfig::from_toml(
            r#"
            listen = ["127.0.0.1:3261"]
            [[targets]]
            iqn = "iqn.2026-01.org.mcsi:a"
            max_connections = 4
            max_burst_length = "512KiB"
            first_burst_length = 65536
            initial_r2t = true
            queue_depth = 32
            [[targets.luns]]
            backend = "ram:64MiB"
            [[targets.luns]]
            backend = "ram:1GiB"
            block_size = 4096
            read_only = true
            serial = "disk2"
            [[targets]]
            iqn = "iqn.2026-01.org.mcsi:b"
            listen = ["127.0.0.1:3262", "[::1]:3262"]
            [[targets.luns]]
            backend = "file:/tmp/x.img:1G"
            "#,
        )
        .unwrap();
        assert_eq!(c.targets.len(), 2);
        let a = &c.targets[0];
        assert_eq!(a.limits.max_connections, 4);
        assert_eq!(a.limits.max_burst_length, 524_288);
        assert!(a.limits.initial_r2t);
        assert_eq!(a.limits.queue_depth, 32);
        assert_eq!(a.luns[1].block_size, 4096);
        assert!(a.luns[1].read_only);
        assert_eq!(a.portals, vec!["127.0.0.1:3261".parse().unwrap()]);
        assert_eq!(c.targets[1].portals.len(), 2);
        assert_eq!(c.portals().len(), 3);
    }

    #[test]
    fn errors_name_the_field() {
        let e = ServerConfig::from_toml(
            r#"
            listen = ["127.0.0.1:3261"]
            [[targets]]
            iqn = "iqn.2026-01.org.mcsi:a"
            [[targets.luns]]
            backend = "ram:1G"
            [[targets]]
            iqn = "iqn.2026-01.org.mcsi:b"
            [[targets.luns]]
            backend = "rom:1G"
            "#,
        )
        .unwrap_err();
        assert_eq!(e.field, "targets[1].luns[0].backend");
        assert!(e.to_string().contains("unknown backend 'rom:1G'"), "{e}");
        assert!(
            e.to_string()
                .contains("use ram:SIZE, file:PATH[:SIZE], block:PATH"),
            "{e}"
        );

        let e = ServerConfig::from_toml(
            "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"target0\"\n[[targets.luns]]\nbackend=\"ram:1M\"\n",
        )
        .unwrap_err();
        assert_eq!(e.field, "targets[0].iqn");

        let e = ServerConfig::from_toml("[[targets]]\niqn = \"iqn.2026-01.org.x\"\nbogus = 1\n")
            .unwrap_err();
        assert!(e.why.contains("bogus"), "{e}");

        let e = ServerConfig::from_toml(
            "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\nfirst_burst_length = \"2MiB\"\n[[targets.luns]]\nbackend=\"ram:1M\"\n",
        )
        .unwrap_err();
        assert_eq!(e.field, "targets[0].first_burst_length");
        let e = ServerConfig::from_toml(
            "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn = \"iqn.2026-01.org.x\"\nmax_recv_data_segment_length = 100\n[[targets.luns]]\nbackend=\"ram:1M\"\n",
        )
        .unwrap_err();
        assert!(e.why.contains("512 to 16777215"), "{e}");
    }

    #[test]
    fn lun_args_and_portals() {
        let l = parse_lun_arg("--lun", "ram:1GiB,bs=4096,ro,serial=abc").unwrap();
        assert_eq!(
            l,
            LunSpec {
                backend: "ram:1GiB".into(),
                block_size: 4096,
                read_only: true,
                serial: Some("abc".into())
            }
        );
        assert!(parse_lun_arg("--lun", "ram:1GiB,bs=333").is_err());
        assert!(parse_lun_arg("--lun", "disk:1").is_err());
        assert_eq!(
            parse_portal("10.0.0.1").unwrap(),
            "10.0.0.1:3260".parse().unwrap()
        );
        assert_eq!(
            parse_portal("[::1]:3261").unwrap(),
            "[::1]:3261".parse().unwrap()
        );
        assert!(parse_portal("localhost:x").is_err());
    }
}
