//! The command line's parsers: `--listen` portals, `--lun` specs and service times.

use super::error::{cerr, ConfigError, ValueError};
use super::{check_backend_spec, check_physical_block_size, parse_naa, LunBackend, LunSpec};
use std::net::SocketAddr;
use std::time::Duration;

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
pub fn parse_portal(s: &str) -> Result<SocketAddr, ValueError> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = s
        .trim_matches(|c| c == '[' || c == ']')
        .parse::<std::net::IpAddr>()
    {
        return Ok(SocketAddr::new(ip, 3260));
    }
    Err(ValueError::NotAPortal { text: s.into() })
}

/// A LUN's `service_time`: a duration of at most 10 s, with its unit.
pub(super) fn parse_service_time(field: &str, v: &str) -> Result<Duration, ConfigError> {
    match mcsi_units::parse_duration(v, mcsi_units::BareUnit::Refuse) {
        Ok(d) if d <= Duration::from_secs(10) => Ok(d),
        Ok(_) => Err(cerr(field, format!("service_time '{v}' is above 10s"))),
        Err(e) => Err(cerr(
            field,
            format!("service_time '{v}': {e} (a duration, e.g. 8ms)"),
        )),
    }
}

/// Parses a `--lun` value: a backend spec optionally followed by `,block_size=N`,
/// `,physical_block_size=N`, `,read_only`, `,serial=S`, `,sanitize_rate=SIZE` (per second),
/// `,service_time=DURATION`.
pub fn parse_lun_arg(field: &str, arg: &str) -> Result<LunSpec, ConfigError> {
    let mut parts = arg.split(',');
    let backend = parts.next().unwrap_or("").to_string();
    check_backend_spec(field, &backend)?;
    let mut lun = LunSpec::new(backend);
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
            Some(("physical_block_size" | "pbs", v)) => {
                lun.physical_block_size = Some(v.parse().map_err(|_| {
                    cerr(
                        field,
                        format!("physical_block_size '{v}' is not a number of bytes"),
                    )
                })?)
            }
            Some(("serial", v)) if !v.is_empty() && v.len() <= 32 => lun.serial = Some(v.into()),
            Some(("naa", v)) => lun.naa = Some(parse_naa(v).map_err(|e| cerr(field, e))?),
            Some(("sanitize_rate", v)) => {
                lun.sanitize_rate = mcsi_units::parse_size(v).map_err(|e| {
                    cerr(
                        field,
                        format!("sanitize_rate '{v}': {e} (bytes per second, e.g. 64MiB)"),
                    )
                })?
            }
            Some(("service_time", v)) => lun.service_time = parse_service_time(field, v)?,
            // How an rbd: image's cluster is reached: part of the backend's spec.
            Some(("conf" | "id" | "cache", _))
                if matches!(&lun.backend, LunBackend::Spec(b) if b.starts_with("rbd:")) =>
            {
                if let LunBackend::Spec(b) = &mut lun.backend {
                    b.push(',');
                    b.push_str(p);
                }
            }
            None if p == "read_only" || p == "ro" => lun.read_only = true,
            None if p == "allow_sanitize" => lun.allow_sanitize = true,
            _ => {
                return Err(cerr(
                    field,
                    format!(
                        "unknown option '{p}' (use block_size=N, physical_block_size=N, read_only, serial=S, naa=HEX, sanitize_rate=SIZE, allow_sanitize, service_time=DURATION; for rbd: conf=PATH, id=NAME, cache=on|off)"
                    ),
                ))
            }
        }
    }
    if let Some(p) = lun.physical_block_size {
        check_physical_block_size(p, lun.block_size).map_err(|e| cerr(field, e))?;
    }
    Ok(lun)
}
