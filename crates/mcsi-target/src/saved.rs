//! The running configuration as a TOML file (`mcsi ctl show-config` and `mcsi ctl save`).
//!
//! A server started from a file keeps that file's text: saving writes the running LUNs (each
//! with its number) and each target's access (allowed initiators and networks, CHAP users) into
//! it, and leaves everything else as the administrator wrote it, comments included. A server
//! started from flags alone gets a new file with its portals, targets, LUNs and access. Either
//! way the text is read back and compared with what runs before it is written, and it is
//! written whole or not at all (a temporary file beside it, synced, then renamed).

use crate::config::{AuthSpec, ChapUser, LunBackend, LunSpec, ServerConfig};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use toml_edit::{Array, DocumentMut, InlineTable, Item, Table, TableLike, Value};

/// What a secret reads as when it is hidden.
pub const HIDDEN: &str = "(hidden)";

/// What runs: the configuration the server started from (or last reloaded), with each target's
/// LUNs by number and access as they are now.
pub struct Running<'a> {
    pub base: &'a ServerConfig,
    pub luns: &'a BTreeMap<String, BTreeMap<u16, LunSpec>>,
    pub auth: &'a BTreeMap<String, AuthSpec>,
}

/// Why the running configuration was not saved (nothing was written).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SaveError {
    #[error("{path}: the file the server read no longer parses as TOML: {cause}")]
    SourceUnparsable { path: PathBuf, cause: String },
    #[error("target {0} is in the file but not running")]
    NotRunning(String),
    #[error("target {0} runs but its [[targets]] entry could not be written")]
    EntryNotWritten(String),
    #[error(
        "LUN {0} is served by a backend handed to the server by a program: it has no spec to write"
    )]
    NoSpec(u16),
    #[error("LUN {0}: its sanitize_rate is too large to write")]
    SanitizeRate(u16),
    #[error("the text written would not load: {0}")]
    WouldNotLoad(String),
    /// What was written reads back as something else than what runs (`what`: "the LUNs",
    /// "the LUN maps", "the access", "the portals").
    #[error("target {iqn}: {what} written would not read back as what runs")]
    ReadsBackOther { iqn: String, what: &'static str },
    #[error("the targets written are not the running ones")]
    OtherTargets,
    #[error("access was given on the command line (--chap, --allow-initiator or --allow-any) over the file's: saving would write it into the file; start the target without those flags, or save --to another file")]
    AccessFromFlags,
    #[error("{path}: {cause}")]
    Unreadable { path: PathBuf, cause: String },
    #[error("{0} changed since the target read it: reload it first (mcsi ctl reload), or save --to another file")]
    ChangedSince(PathBuf),
    #[error("{path}: {cause}")]
    Write { path: PathBuf, cause: String },
    #[error("the writer stopped: {0}")]
    Writer(String),
}

/// A rendered configuration, and what it leaves out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// Settings that run but are not in the text (given on the command line only).
    pub notes: Vec<String>,
}

/// The running configuration as TOML; CHAP secrets shown or [`HIDDEN`].
pub fn render(r: &Running<'_>, secrets: bool) -> Result<Rendered, SaveError> {
    let mut notes = Vec::new();
    let mut doc = match &r.base.source {
        Some(src) => src
            .text
            .parse::<DocumentMut>()
            .map_err(|e| SaveError::SourceUnparsable {
                path: src.path.clone(),
                cause: e.to_string(),
            })?,
        None => fresh(r.base, secrets, &mut notes),
    };
    // Discovery's access is the file's (it changes only by a reload): only its secrets may
    // need hiding.
    if let Some(a) = doc
        .get_mut("discovery")
        .and_then(Item::as_table_like_mut)
        .and_then(|d| d.get_mut("auth"))
        .and_then(Item::as_table_like_mut)
    {
        auth_keys(a, &r.base.discovery_auth, secrets);
    }
    // The portals each target of the file has there (its own `listen`, or the top level's),
    // and its LUN maps.
    type FileTarget = (Vec<std::net::SocketAddr>, Vec<crate::config::LunMap>);
    let in_text: BTreeMap<String, FileTarget> = match &r.base.source {
        Some(src) => ServerConfig::from_toml(&src.text)
            .map(|c| {
                c.targets
                    .into_iter()
                    .map(|t| (t.iqn, (t.portals, t.lun_maps)))
                    .collect()
            })
            .unwrap_or_default(),
        None => BTreeMap::new(),
    };
    let iqn_of = |t: &dyn TableLike| t.get("iqn").and_then(Item::as_str).map(str::to_string);
    let runs = |t: &dyn TableLike| iqn_of(t).is_none_or(|n| r.luns.contains_key(&n));
    // Targets removed since go; targets added since are written as a new one is.
    let mut in_file = Vec::new();
    match doc.get_mut("targets") {
        Some(Item::ArrayOfTables(a)) => {
            a.retain(|t| runs(t));
            in_file.extend(a.iter().filter_map(|t| iqn_of(t)));
        }
        Some(Item::Value(Value::Array(a))) => {
            a.retain(|v| v.as_inline_table().is_none_or(|t| runs(t)));
            in_file.extend(
                a.iter()
                    .filter_map(|v| v.as_inline_table().and_then(|t| iqn_of(t))),
            );
        }
        _ => {}
    }
    for t in &r.base.targets {
        if in_file.contains(&t.iqn) {
            continue;
        }
        let tt = target_table(t, &mut notes);
        match doc.get_mut("targets") {
            Some(Item::Value(Value::Array(a))) => {
                a.push(Value::InlineTable(tt.into_inline_table()))
            }
            Some(Item::ArrayOfTables(a)) => a.push(tt),
            _ => {
                let mut a = toml_edit::ArrayOfTables::new();
                a.push(tt);
                doc.insert("targets", Item::ArrayOfTables(a));
            }
        }
    }
    let mut seen = Vec::new();
    let mut each = |t: &mut dyn TableLike, inline: bool| -> Result<(), SaveError> {
        let Some(iqn) = iqn_of(t) else {
            return Ok(());
        };
        let luns = r
            .luns
            .get(&iqn)
            .ok_or_else(|| SaveError::NotRunning(iqn.clone()))?;
        set(t, "luns", Item::Value(Value::Array(lun_array(luns)?)));
        let auth = r.auth.get(&iqn).cloned().unwrap_or_default();
        set_auth(t, &auth, secrets, inline);
        // Portals moved since: the target's own `listen` says where it runs now.
        if let Some(spec) = r.base.targets.iter().find(|x| x.iqn == iqn) {
            let file = in_text.get(&iqn);
            if file.map(|f| &f.0) != Some(&spec.portals) {
                let p: Array = spec.portals.iter().map(|p| p.to_string()).collect();
                set(t, "listen", Item::Value(Value::Array(p)));
            }
            // LUN maps changed since (`mcsi ctl map-lun`): written as they run.
            if file.map_or(&[][..], |f| &f.1[..]) != &spec.lun_maps[..] {
                set_lun_maps(t, &spec.lun_maps, inline);
            }
        }
        seen.push(iqn);
        Ok(())
    };
    match doc.get_mut("targets") {
        Some(Item::ArrayOfTables(a)) => {
            for t in a.iter_mut() {
                each(t, false)?;
            }
        }
        Some(Item::Value(Value::Array(a))) => {
            for v in a.iter_mut() {
                if let Value::InlineTable(t) = v {
                    each(t, true)?;
                }
            }
        }
        _ => {}
    }
    for name in r.luns.keys() {
        if !seen.contains(name) {
            return Err(SaveError::EntryNotWritten(name.clone()));
        }
    }
    Ok(Rendered {
        text: doc.to_string(),
        notes,
    })
}

/// A new document for a server started without a file: its control socket and Multipath TCP
/// setting, each target with its portals and alias, and discovery's access. What the command
/// line set beyond that is named in `notes`.
fn fresh(base: &ServerConfig, secrets: bool, notes: &mut Vec<String>) -> DocumentMut {
    let mut doc = DocumentMut::new();
    doc.decor_mut().set_prefix(
        "# The running configuration of an mcsi target (mcsi ctl save).\n# Every key: examples/mcsi.toml in the source, or man mcsi-target.\n\n",
    );
    if let Some(c) = &base.control {
        doc["control"] = toml_edit::value(c.display().to_string());
    }
    if base.mptcp {
        doc["mptcp"] = toml_edit::value(true);
    }
    if let Some(d) = &base.state_dir {
        doc["state_dir"] = toml_edit::value(d.display().to_string());
    }
    if base.session_threads != crate::config::default_session_threads() {
        doc["session_threads"] = toml_edit::value(base.session_threads as i64);
    }
    if base.limits != Default::default() {
        notes.push("the server-wide [limits] given on the command line".into());
    }
    if base.discovery_auth != AuthSpec::default() {
        let mut d = Table::new();
        d.set_implicit(true);
        let mut a = Table::new();
        auth_keys(&mut a, &base.discovery_auth, secrets);
        d.insert("auth", Item::Table(a));
        doc.insert("discovery", Item::Table(d));
    }
    let mut targets = toml_edit::ArrayOfTables::new();
    for t in &base.targets {
        targets.push(target_table(t, notes));
    }
    doc.insert("targets", Item::ArrayOfTables(targets));
    doc
}

/// A `[[targets]]` entry for a target: its name, alias, portals and advertised addresses (its
/// LUNs and access are filled in by render). What it cannot hold is named in `notes`.
fn target_table(t: &crate::config::TargetSpec, notes: &mut Vec<String>) -> Table {
    let mut tt = Table::new();
    tt.insert("iqn", toml_edit::value(t.iqn.clone()));
    if let Some(a) = &t.alias {
        tt.insert("alias", toml_edit::value(a.clone()));
    }
    let mut portals = Array::new();
    for p in &t.portals {
        portals.push(p.to_string());
    }
    tt.insert("listen", Item::Value(Value::Array(portals)));
    if !t.advertise.is_empty() {
        let a: Array = t.advertise.iter().map(String::as_str).collect();
        tt.insert("advertise", Item::Value(Value::Array(a)));
    }
    if t.redirect.is_some() {
        notes.push(format!("target {}: its redirection", t.iqn));
    }
    // Filled in by render, from what runs.
    tt.insert("luns", Item::Value(Value::Array(Array::new())));
    if t.limits != crate::config::Limits::default() || !t.qos_initiators.is_empty() {
        notes.push(format!(
            "target {}: its negotiation limits, timers or QoS given on the command line",
            t.iqn
        ));
    }
    tt
}

/// A target's LUN maps: `[[targets.lun_maps]]` tables (inline tables in an inline target), or
/// none.
fn set_lun_maps(t: &mut dyn TableLike, maps: &[crate::config::LunMap], inline: bool) {
    if maps.is_empty() {
        t.remove("lun_maps");
        return;
    }
    let luns = |m: &crate::config::LunMap| {
        let mut l = InlineTable::new();
        for (seen, n) in &m.luns {
            l.insert(seen.to_string(), Value::from(i64::from(*n)));
        }
        l
    };
    let item = if inline {
        let mut a = Array::new();
        for m in maps {
            let mut e = InlineTable::new();
            e.insert("initiator", Value::from(m.initiator.clone()));
            e.insert("luns", Value::InlineTable(luns(m)));
            a.push(Value::InlineTable(e));
        }
        Item::Value(Value::Array(a))
    } else {
        let mut a = toml_edit::ArrayOfTables::new();
        for m in maps {
            let mut e = Table::new();
            e.insert("initiator", toml_edit::value(m.initiator.clone()));
            e.insert("luns", Item::Value(Value::InlineTable(luns(m))));
            a.push(e);
        }
        Item::ArrayOfTables(a)
    };
    set(t, "lun_maps", item);
}

/// Sets `key` in a table, keeping the key (and the comment above it) when it is there.
fn set(t: &mut dyn TableLike, key: &str, item: Item) {
    match t.get_mut(key) {
        Some(slot) => *slot = item,
        None => {
            t.insert(key, item);
        }
    }
}

/// A target's LUNs as an array of inline tables, one per line, each with its number.
fn lun_array(luns: &BTreeMap<u16, LunSpec>) -> Result<Array, SaveError> {
    let mut arr = Array::new();
    for (n, l) in luns {
        let LunBackend::Spec(backend) = &l.backend else {
            return Err(SaveError::NoSpec(*n));
        };
        let mut it = InlineTable::new();
        it.insert("lun", i64::from(*n).into());
        it.insert("backend", backend.as_str().into());
        if l.block_size != 512 {
            it.insert("block_size", i64::from(l.block_size).into());
        }
        if let Some(p) = l.physical_block_size {
            it.insert("physical_block_size", i64::from(p).into());
        }
        if l.read_only {
            it.insert("read_only", true.into());
        }
        if let Some(s) = &l.serial {
            it.insert("serial", s.as_str().into());
        }
        if let Some(n) = &l.naa {
            it.insert("naa", crate::config::naa_text(n).into());
        }
        if l.sanitize_rate != 0 {
            let rate = i64::try_from(l.sanitize_rate).map_err(|_| SaveError::SanitizeRate(*n))?;
            it.insert("sanitize_rate", rate.into());
        }
        if l.allow_sanitize {
            it.insert("allow_sanitize", true.into());
        }
        if !l.service_time.is_zero() {
            it.insert(
                "service_time",
                format!("{}ns", l.service_time.as_nanos()).into(),
            );
        }
        arr.push_formatted(Value::InlineTable(it).decorated("\n  ", ""));
    }
    arr.set_trailing("\n");
    arr.set_trailing_comma(true);
    Ok(arr)
}

/// Writes a target's access into its `auth` table (made if missing and needed): the CHAP users,
/// allowed initiators and networks as they run; other keys of the table stay as they are.
fn set_auth(t: &mut dyn TableLike, auth: &AuthSpec, secrets: bool, inline: bool) {
    let empty = auth.chap.is_empty()
        && auth.allow_initiators.is_empty()
        && auth.allow_networks.is_empty()
        && auth.chap_algorithms.is_empty();
    match t.get_mut("auth").and_then(Item::as_table_like_mut) {
        Some(a) => auth_keys(a, auth, secrets),
        None if empty => {}
        None if inline => {
            let mut a = InlineTable::new();
            auth_keys(&mut a, auth, secrets);
            t.insert("auth", Item::Value(Value::InlineTable(a)));
        }
        None => {
            let mut a = Table::new();
            auth_keys(&mut a, auth, secrets);
            t.insert("auth", Item::Table(a));
        }
    }
}

fn auth_keys(a: &mut dyn TableLike, auth: &AuthSpec, secrets: bool) {
    let list = |items: Vec<String>| -> Option<Item> {
        (!items.is_empty()).then(|| Item::Value(Value::Array(items.into_iter().collect())))
    };
    let mut put = |key: &str, v: Option<Item>| match v {
        Some(v) => set(a, key, v),
        None => {
            a.remove(key);
        }
    };
    put("allow_initiators", list(auth.allow_initiators.clone()));
    put(
        "allow_networks",
        list(auth.allow_networks.iter().map(|n| n.to_string()).collect()),
    );
    let chap = (!auth.chap.is_empty()).then(|| {
        let mut arr = Array::new();
        for u in &auth.chap {
            arr.push_formatted(Value::InlineTable(chap_user(u, secrets)).decorated("\n  ", ""));
        }
        arr.set_trailing("\n");
        arr.set_trailing_comma(true);
        Item::Value(Value::Array(arr))
    });
    put("chap", chap);
    put(
        "chap_algorithms",
        list(
            auth.chap_algorithms
                .iter()
                .map(|a| a.name().to_string())
                .collect(),
        ),
    );
}

fn chap_user(u: &ChapUser, secrets: bool) -> InlineTable {
    let hide = |s: &str| {
        if secrets {
            s.to_string()
        } else {
            HIDDEN.into()
        }
    };
    let mut it = InlineTable::new();
    it.insert("user", u.user.as_str().into());
    it.insert("secret", hide(&u.secret).into());
    if let (Some(mu), Some(ms)) = (&u.mutual_user, &u.mutual_secret) {
        it.insert("mutual_user", mu.as_str().into());
        it.insert("mutual_secret", hide(ms).into());
    }
    it
}

/// Reads `text` back and checks that it gives what runs: the same targets, each with the same
/// LUNs under the same numbers and the same access.
pub fn check(text: &str, r: &Running<'_>) -> Result<(), SaveError> {
    let back = ServerConfig::from_toml(text).map_err(|e| SaveError::WouldNotLoad(e.to_string()))?;
    let other = |iqn: &str, what| SaveError::ReadsBackOther {
        iqn: iqn.to_string(),
        what,
    };
    for t in &back.targets {
        if r.luns.get(&t.iqn) != Some(&t.luns_by_number()) {
            return Err(other(&t.iqn, "the LUNs"));
        }
        let maps = r
            .base
            .targets
            .iter()
            .find(|x| x.iqn == t.iqn)
            .map(|x| &x.lun_maps);
        if maps.is_some_and(|m| *m != t.lun_maps) {
            return Err(other(&t.iqn, "the LUN maps"));
        }
        if r.auth.get(&t.iqn).cloned().unwrap_or_default() != t.auth {
            return Err(other(&t.iqn, "the access"));
        }
    }
    if back.targets.len() != r.luns.len() {
        return Err(SaveError::OtherTargets);
    }
    for t in &r.base.targets {
        let written = back.targets.iter().find(|b| b.iqn == t.iqn);
        if written.map(|b| &b.portals) != Some(&t.portals) {
            return Err(other(&t.iqn, "the portals"));
        }
    }
    Ok(())
}

/// Writes `text` to `path` whole or not at all: a temporary file in the same directory, owner
/// only (it may hold CHAP secrets), synced, renamed over the file, and the directory synced. A
/// symbolic link is followed: the file it names is replaced.
pub fn write_atomic(path: &Path, text: &str) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => path.to_path_buf(),
        Err(e) => return Err(e),
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("not a file name"))?
        .to_string_lossy()
        .into_owned();
    // A name no other writer picks (another process, or an earlier save of this one).
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!(".{name}.mcsi-save-{}-{nonce}", std::process::id()));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    // The file is replaced; a directory that cannot be synced leaves the rename to the
    // kernel's own time, which is no reason to report the save as failed.
    if let Err(e) = std::fs::File::open(&dir).and_then(|d| d.sync_all()) {
        tracing::warn!(
            "saved {}, but syncing its directory failed: {e}",
            path.display()
        );
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn running(
        cfg: &ServerConfig,
    ) -> (
        BTreeMap<String, BTreeMap<u16, LunSpec>>,
        BTreeMap<String, AuthSpec>,
    ) {
        let luns = cfg
            .targets
            .iter()
            .map(|t| (t.iqn.clone(), t.luns_by_number()))
            .collect();
        let auth = cfg
            .targets
            .iter()
            .map(|t| (t.iqn.clone(), t.auth.clone()))
            .collect();
        (luns, auth)
    }

    const FILE: &str = r#"# the site's target
listen = ["127.0.0.1:3260"]

[discovery.auth]
chap = [{ user = "disco", secret = "discovery-secret-7" }]

[[targets]]
iqn = "iqn.2026-01.org.mcsi:a"
# the disks
luns = [
  { backend = "ram:8MiB" },
  { backend = "ram:4MiB", block_size = 4096, lun = 7 },
]
queue_depth = 64

[targets.auth]
chap_algorithms = ["SHA256"]
allow_initiators = ["iqn.2026-01.org.x:h1"]
"#;

    #[test]
    fn a_file_keeps_its_comments_and_gets_the_running_luns_and_access() {
        let mut cfg = ServerConfig::from_toml(FILE).unwrap();
        cfg.source = Some(crate::config::ConfigSource {
            path: "/x/mcsi.toml".into(),
            text: FILE.into(),
        });
        let (mut luns, mut auth) = running(&cfg);
        let a = luns.get_mut("iqn.2026-01.org.mcsi:a").unwrap();
        assert_eq!(a.keys().copied().collect::<Vec<_>>(), [0, 7]);
        a.remove(&0);
        a.insert(
            3,
            crate::config::parse_lun_arg("x", "ram:2MiB,ro,serial=s3").unwrap(),
        );
        let au = auth.get_mut("iqn.2026-01.org.mcsi:a").unwrap();
        au.allow_initiators.push("iqn.2026-01.org.x:h2".into());
        au.chap.push(ChapUser {
            user: "carol".into(),
            secret: "carol-secret-42".into(),
            mutual_user: None,
            mutual_secret: None,
        });
        let r = Running {
            base: &cfg,
            luns: &luns,
            auth: &auth,
        };
        let out = render(&r, true).unwrap();
        assert!(out.notes.is_empty());
        let text = &out.text;
        for kept in [
            "# the site's target",
            "# the disks",
            "queue_depth = 64",
            "chap_algorithms = [\"SHA256\"]",
        ] {
            assert!(text.contains(kept), "{kept} lost:\n{text}");
        }
        check(text, &r).unwrap();
        let back = ServerConfig::from_toml(text).unwrap();
        let nums: Vec<u16> = back.targets[0].numbered().iter().map(|(n, _)| *n).collect();
        assert_eq!(nums, [3, 7]);
        assert!(back.targets[0].luns[0].read_only);
        assert_eq!(back.targets[0].auth.allow_initiators.len(), 2);
        assert_eq!(back.targets[0].limits.offer.queue_depth, 64);
        // Hidden, the secret is not in the text.
        let hidden = render(&r, false).unwrap().text;
        assert!(
            !hidden.contains("carol-secret-42") && hidden.contains(HIDDEN),
            "{hidden}"
        );
        assert!(!hidden.contains("discovery-secret-7"), "{hidden}");
        assert!(text.contains("discovery-secret-7"), "{text}");
        // What does not read back as what runs is refused.
        luns.get_mut("iqn.2026-01.org.mcsi:a")
            .unwrap()
            .insert(9, LunSpec::new("ram:1MiB"));
        let r2 = Running {
            base: &cfg,
            luns: &luns,
            auth: &auth,
        };
        assert_eq!(
            check(text, &r2).unwrap_err(),
            SaveError::ReadsBackOther {
                iqn: "iqn.2026-01.org.mcsi:a".into(),
                what: "the LUNs"
            }
        );
    }

    #[test]
    fn flags_alone_get_a_whole_file_and_name_what_it_leaves_out() {
        let mut cfg = ServerConfig::from_toml(FILE).unwrap();
        cfg.control = Some("/run/mcsi/control.sock".into());
        let (luns, auth) = running(&cfg);
        let r = Running {
            base: &cfg,
            luns: &luns,
            auth: &auth,
        };
        let out = render(&r, true).unwrap();
        check(&out.text, &r).unwrap();
        assert!(
            out.text.contains("control = \"/run/mcsi/control.sock\""),
            "{}",
            out.text
        );
        // queue_depth = 64 came from the file here, but without a file it is a flag's.
        assert_eq!(out.notes.len(), 1, "{:?}", out.notes);
        assert!(out.notes[0].contains("iqn.2026-01.org.mcsi:a"));
    }

    #[test]
    fn numbers_given_twice_are_refused_and_a_number_moves_no_other_lun() {
        let file = |luns: &str| {
            ServerConfig::from_toml(&format!(
                "listen=[\"127.0.0.1:1\"]\n[[targets]]\niqn=\"iqn.2026-01.org.x:t\"\nluns=[{luns}]\n"
            ))
        };
        let e = file("{backend=\"ram:1MiB\",lun=3},{backend=\"ram:1MiB\",lun=3}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("LUN 3 is given twice"), "{e}");
        let nums = |luns: &str| -> Vec<u16> {
            file(luns).unwrap().targets[0]
                .numbered()
                .iter()
                .map(|(n, _)| *n)
                .collect()
        };
        let r = "{backend=\"ram:1MiB\"}";
        assert_eq!(nums(&format!("{r},{r}")), [0, 1]);
        // A numbered LUN put first takes its number; the others keep theirs.
        assert_eq!(
            nums(&format!("{{backend=\"ram:1MiB\",lun=2}},{r},{r}")),
            [2, 0, 1]
        );
        assert_eq!(nums(&format!("{r},{{backend=\"ram:1MiB\",lun=0}}")), [1, 0]);
        assert_eq!(
            nums(&format!("{r},{{backend=\"ram:1MiB\",lun=10}},{r}")),
            [0, 10, 1]
        );
    }

    #[test]
    fn an_atomic_write_replaces_the_file_whole_and_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("mcsi.toml");
        std::fs::write(&p, "old").unwrap();
        let link = dir.path().join("link.toml");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        let at = write_atomic(&link, "new\n").unwrap();
        assert_eq!(at, std::fs::canonicalize(&p).unwrap());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "new\n");
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 2, "no temporary file left");
        // A directory that cannot be written: an error, and the file is as it was.
        let e = write_atomic(Path::new("/proc/mcsi-no.toml"), "x");
        assert!(e.is_err());
    }
}
