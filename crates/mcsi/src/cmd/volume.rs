//! Volume specs: several LUNs as one volume (`volume:FILE.toml` wherever a tool takes a URL).
//!
//! ```toml
//! layout = "stripe"        # or "mirror", or "paths" (one LUN through several targets)
//! chunk = "256KiB"         # stripe only: a multiple of the members' block size
//! bitmap = "m.bitmap"      # mirror only: what each member missed, kept in this file (relative
//!                          # to the spec's directory), so that a restart knows a stale member
//! resync_rate = "100mbit"  # mirror only: the most a resync copies (it also yields half the
//!                          # time to the volume's own commands while they run)
//! reads = "soonest"        # mirror and paths: each read to the member expected to finish it first
//!                          # (default), or "least-busy": the fewest commands in flight
//!
//! [[member]]
//! url = "iscsi://10.0.0.1:3260/iqn.2026-01.org.example:a/0"
//! connections = 2          # any session option, as in --session-profile; the member's own
//! bind = ["wlan0"]         # options win over the command line's
//!
//! [[member]]
//! url = "iscsi://10.0.0.2:3260/iqn.2026-01.org.example:b/0"
//! ```

use crate::cmd::{SessionArgs, SessionProfile};
use anyhow::{bail, Context};
use mcsi_initiator::{IscsiUrl, Layout, MemberSpec, MirrorReads, VolumeSpec};
use std::path::Path;

/// The prefix that names a volume spec where a URL is expected.
pub const PREFIX: &str = "volume:";

/// The spec file `arg` names, if it is `volume:PATH`.
pub fn spec_path(arg: &str) -> Option<&Path> {
    arg.strip_prefix(PREFIX).map(Path::new)
}

/// The chunk size of a stripe when the spec gives none.
pub const DEFAULT_CHUNK: u64 = 256 << 10;

/// Reads the spec at `path`: layout, chunk, and each member's URL and session options (the
/// member's own over `session`'s). `tcp_report` as in [`SessionArgs::options`].
pub fn load(path: &Path, session: &SessionArgs, tcp_report: bool) -> anyhow::Result<VolumeSpec> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).with_context(|| format!("volume spec {shown}"))?;
    let mut table: toml::Table =
        toml::from_str(&text).with_context(|| format!("volume spec {shown}"))?;
    let at = |field: &str| format!("volume spec {shown}: {field}");
    let layout_word = match table.remove("layout") {
        Some(toml::Value::String(s)) => s,
        Some(_) => bail!("{}: a word, stripe, mirror or paths", at("layout")),
        None => bail!(
            "{}: missing (layout = \"stripe\", \"mirror\" or \"paths\")",
            at("layout")
        ),
    };
    let chunk = match table.remove("chunk") {
        Some(toml::Value::String(s)) => {
            Some(mcsi_units::parse_size(&s).map_err(|e| anyhow::anyhow!("{}: {e}", at("chunk")))?)
        }
        Some(toml::Value::Integer(n)) if n > 0 => Some(n as u64),
        Some(_) => bail!("{}: a size such as \"256KiB\"", at("chunk")),
        None => None,
    };
    let layout = match layout_word.as_str() {
        "stripe" => Layout::Stripe {
            chunk: chunk.unwrap_or(DEFAULT_CHUNK),
        },
        "mirror" => {
            if chunk.is_some() {
                bail!("{}: a mirror has no chunks", at("chunk"));
            }
            Layout::Mirror
        }
        "paths" => {
            if chunk.is_some() {
                bail!(
                    "{}: the members of a paths volume are one LUN; it has no chunks",
                    at("chunk")
                );
            }
            Layout::Paths
        }
        other => bail!("{}: '{other}': use stripe, mirror or paths", at("layout")),
    };
    let members = match table.remove("member") {
        Some(toml::Value::Array(a)) => a,
        Some(_) => bail!("{}: give members as [[member]] tables", at("member")),
        None => bail!(
            "{}: no members: add [[member]] tables with url = \"iscsi://...\"",
            at("member")
        ),
    };
    let bitmap = match table.remove("bitmap") {
        Some(toml::Value::String(s)) if !s.is_empty() => {
            let p = Path::new(&s);
            Some(if p.is_absolute() {
                p.to_path_buf()
            } else {
                path.parent().unwrap_or(Path::new(".")).join(p)
            })
        }
        Some(_) => bail!("{}: a file name such as \"m.bitmap\"", at("bitmap")),
        None => None,
    };
    let resync_rate = match table.remove("resync_rate") {
        Some(toml::Value::String(s)) => Some(
            mcsi_units::parse_rate(&s)
                .map(|bits| (bits / 8.0).max(1.0) as u64)
                .map_err(|e| anyhow::anyhow!("{}: {e}", at("resync_rate")))?,
        ),
        Some(_) => bail!("{}: a rate such as \"100mbit\"", at("resync_rate")),
        None => None,
    };
    let reads = match table.remove("reads") {
        Some(toml::Value::String(s)) => match s.as_str() {
            "soonest" => Some(MirrorReads::Soonest),
            "least-busy" => Some(MirrorReads::LeastBusy),
            other => bail!("{}: '{other}': use soonest or least-busy", at("reads")),
        },
        Some(_) => bail!("{}: a word, soonest or least-busy", at("reads")),
        None => None,
    };
    if let Some(k) = table.keys().next() {
        bail!(
            "{}: unknown key (use layout, chunk, bitmap, resync_rate, reads, [[member]])",
            at(k)
        );
    }
    if members.len() < 2 {
        bail!(
            "{}: a volume needs two members or more, got {}",
            at("member"),
            members.len()
        );
    }
    let mut out = Vec::new();
    for (i, m) in members.into_iter().enumerate() {
        let field = format!("member[{i}]");
        let toml::Value::Table(mut m) = m else {
            bail!("{}: a table with url = \"iscsi://...\"", at(&field));
        };
        let url = match m.remove("url") {
            Some(toml::Value::String(u)) => u,
            _ => bail!(
                "{}: missing url = \"iscsi://HOST[:PORT]/IQN/LUN\"",
                at(&format!("{field}.url"))
            ),
        };
        let url = IscsiUrl::parse(&url)
            .map_err(|e| anyhow::anyhow!("{}: {e}", at(&format!("{field}.url"))))?;
        let own: SessionProfile = toml::Value::Table(m)
            .try_into()
            .map_err(|e| anyhow::anyhow!("{}: {e}", at(&field)))?;
        let options = session
            .under(own)?
            .options(tcp_report)
            .map_err(|e| anyhow::anyhow!("{}: {e}", at(&field)))?;
        out.push(MemberSpec { url, options });
    }
    if layout != Layout::Mirror {
        if bitmap.is_some() {
            bail!(
                "{}: a bitmap records what a mirror member missed; only a mirror keeps one",
                at("bitmap")
            );
        }
        if resync_rate.is_some() {
            bail!("{}: only a mirror resyncs", at("resync_rate"));
        }
    }
    if matches!(layout, Layout::Stripe { .. }) && reads.is_some() {
        bail!(
            "{}: a stripe reads each block from the one member that holds it",
            at("reads")
        );
    }
    Ok(VolumeSpec {
        layout,
        members: out,
        bitmap,
        resync_rate,
        reads: reads.unwrap_or_default(),
    })
}

/// The device `arg` names: a volume (`volume:SPEC.toml`, members opened with `session`'s options
/// under their own) or one LUN (an iscsi:// URL); None for anything else (a file).
pub async fn open_device(
    arg: &str,
    session: &SessionArgs,
    tcp_report: bool,
) -> anyhow::Result<Option<mcsi_initiator::Device>> {
    use mcsi_initiator::{connect, Device, Volume};
    if let Some(path) = spec_path(arg) {
        let spec = load(path, session, tcp_report)?;
        let v = Volume::open(&spec)
            .await
            .with_context(|| format!("opening {arg}"))?;
        return Ok(Some(Device::Volume(v)));
    }
    if !IscsiUrl::is_url(arg) {
        return Ok(None);
    }
    let u = IscsiUrl::parse(arg)?;
    let s = connect(&u, session.options(tcp_report)?)
        .await
        .with_context(|| format!("connecting to {u}"))?;
    let lun = s
        .open_lun(u.lun)
        .await
        .with_context(|| format!("opening {u}"))?;
    Ok(Some(Device::Lun(lun)))
}
