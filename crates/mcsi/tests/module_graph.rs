//! Every crate's modules import each other without a circle: every module can be read, tested
//! and replaced knowing only the modules below it. The check reads the source of each crate
//! under `crates/`, nested modules included (`src/session/recover.rs` is `session::recover`):
//! - each `crate::A::B` outside comments is an edge to the longest known module on that path
//!   (the names `lib.rs` re-exports, such as `crate::Server`, lead to their module), each
//!   `super::` and `self::` path is resolved from the file's own module, and a `use` of a child
//!   module is an edge to it;
//! - across a crate, a module and everything nested in it count as one (its top-level name):
//!   `control -> session` and `session::recover -> control` are a circle;
//! - inside a top-level module, its children must not import each other in a circle either. A
//!   child's use of its parent is not counted: that is a parent's type continued in another
//!   file (`impl SessionCore` in `session/recover.rs`), not a layer.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Circles that are known and not yet broken, by crate, each as the set of its modules (as the
/// check prints them): no other circle may appear, and none may grow. The session cores, the
/// target and the lab must have none at all (`the_cores_are_held_to_no_circle`).
const ALLOWED: &[(&str, &[&str])] = &[
    ("mcsi-initiator", &["discovery", "session"]),
    ("mcsi-link", &["config", "dir", "link", "loss", "wifi"]),
    ("mcsi-proto", &["codec", "pdu"]),
    ("mcsi-scsi", &["alua", "backend", "lu", "rbd", "server"]),
    ("mcsi-sim", &["net", "tcp"]),
];

/// The code of a line without its comment (a `//` outside a string literal).
fn code(line: &str) -> &str {
    let mut in_str = false;
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' if in_str => i += 1,
            b'"' => in_str = !in_str,
            b'/' if !in_str && b.get(i + 1) == Some(&b'/') => return &line[..i],
            _ => {}
        }
        i += 1;
    }
    line
}

/// The `::`-separated path that starts at `rest` (identifiers only; stops at `{`, `*`, etc.).
fn path_at(rest: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut s = rest;
    loop {
        let ident: String = s
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if ident.is_empty() {
            break;
        }
        s = &s[ident.len()..];
        out.push(ident);
        match s.strip_prefix("::") {
            Some(r) => s = r,
            None => break,
        }
    }
    out
}

/// Each path in `text`'s code that starts with `prefix` (`crate::`, `super::`, `self::`), with
/// the prefix removed, where the prefix is not the end of a longer name (`mcsi_target_core::`).
fn paths_after(text: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = code(line);
        let mut from = 0;
        while let Some(at) = line[from..].find(prefix).map(|i| from + i) {
            let before = line[..at].chars().last();
            let rest = &line[at + prefix.len()..];
            from = at + prefix.len();
            // `mcsi_target_core::`, or the second `super::` of `super::super::`.
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            // `super::super::x`
            let mut p = path_at(rest);
            if prefix == "super::" {
                let mut up = 1;
                while p.first().is_some_and(|s| s == "super") {
                    p.remove(0);
                    up += 1;
                }
                p.insert(0, format!("^{up}"));
            }
            if !p.is_empty() {
                out.push(p);
            }
        }
    }
    out
}

/// The first segment of each `use X::...` (and `pub use`, `pub(crate) use`) line.
fn use_heads(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines().map(code) {
        let t = line.trim_start();
        let t = t
            .strip_prefix("pub(crate) ")
            .or_else(|| t.strip_prefix("pub(super) "))
            .or_else(|| t.strip_prefix("pub "))
            .unwrap_or(t);
        if let Some(rest) = t.strip_prefix("use ") {
            if let Some(head) = path_at(rest.trim_start()).first() {
                out.push(head.clone());
            }
        }
    }
    out
}

/// `pub use MODULE::{A, B};` and `pub use MODULE::A;` lines of lib.rs: name -> module.
fn reexports(lib: &str, modules: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in lib.lines().map(code) {
        let Some(rest) = line.trim().strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, names)) = rest.trim_end_matches(';').split_once("::") else {
            continue;
        };
        if !modules.contains(module) {
            continue;
        }
        for name in names.trim_matches(|c| c == '{' || c == '}').split(',') {
            let name = name.split(" as ").last().unwrap_or("").trim();
            if !name.is_empty() {
                out.insert(name.to_string(), module.to_string());
            }
        }
    }
    out
}

/// Every `.rs` file under `dir`, by the module it is (`""` for the crate's root).
fn modules_in(src: &Path) -> BTreeMap<String, String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                // Other binaries have their own roots.
                if p.file_name().is_some_and(|n| n != "bin") {
                    walk(&p, out);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, &mut files);
    let mut out = BTreeMap::new();
    for p in files {
        let rel = p.strip_prefix(src).unwrap().with_extension("");
        let mut parts: Vec<String> = rel
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        if parts.last().is_some_and(|l| l == "mod") {
            parts.pop();
        }
        if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
            parts.clear();
        }
        out.insert(parts.join("::"), std::fs::read_to_string(&p).unwrap());
    }
    out
}

/// The longest module in `known` that `path` (segments from the crate's root) names.
fn resolve(path: &[String], known: &BTreeSet<String>) -> Option<String> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| known.contains(m))
}

/// Module -> the modules it imports, nested modules their own nodes.
fn edges(files: &BTreeMap<String, String>) -> Graph {
    let known: BTreeSet<String> = files.keys().filter(|m| !m.is_empty()).cloned().collect();
    let top: BTreeSet<String> = known
        .iter()
        .filter(|m| !m.contains("::"))
        .cloned()
        .collect();
    let names = reexports(files.get("").map_or("", String::as_str), &top);
    let mut g = Graph::new();
    for (m, text) in files {
        let here: Vec<String> = if m.is_empty() {
            Vec::new()
        } else {
            m.split("::").map(String::from).collect()
        };
        let mut targets = Vec::new();
        for p in paths_after(text, "crate::") {
            targets.push(resolve(&p, &known).or_else(|| names.get(&p[0]).cloned()));
        }
        for mut p in paths_after(text, "super::") {
            let up: usize = p.remove(0)[1..].parse().unwrap();
            let base = &here[..here.len().saturating_sub(up)];
            let full: Vec<String> = base.iter().cloned().chain(p).collect();
            targets.push(resolve(&full, &known).or(Some(base.join("::"))));
        }
        for p in paths_after(text, "self::") {
            let full: Vec<String> = here.iter().cloned().chain(p).collect();
            targets.push(resolve(&full, &known));
        }
        for head in use_heads(text) {
            let child: Vec<String> = here.iter().cloned().chain([head]).collect();
            let child = child.join("::");
            if known.contains(&child) {
                targets.push(Some(child));
            }
        }
        let deps = g.entry(m.clone()).or_default();
        for t in targets.into_iter().flatten() {
            if !t.is_empty() && t != *m {
                deps.insert(t);
            }
        }
    }
    g
}

/// The graph of top-level modules (each with everything nested in it), and for each top-level
/// module the graph of its children (each with what is nested in it; uses of the parent left
/// out).
fn levels(g: &Graph) -> (Graph, BTreeMap<String, Graph>) {
    let family = |m: &str| m.split("::").next().unwrap_or("").to_string();
    let child = |m: &str| m.split("::").take(2).collect::<Vec<_>>().join("::");
    let mut top = Graph::new();
    let mut inner: BTreeMap<String, Graph> = BTreeMap::new();
    for (m, deps) in g {
        if m.is_empty() {
            continue;
        }
        let f = family(m);
        top.entry(f.clone()).or_default();
        let c = child(m);
        if c.contains("::") {
            inner
                .entry(f.clone())
                .or_default()
                .entry(c.clone())
                .or_default();
        }
        for d in deps {
            let fd = family(d);
            if fd != f {
                top.get_mut(&f).unwrap().insert(fd);
            } else if c.contains("::") {
                let cd = child(d);
                if cd.contains("::") && cd != c {
                    inner.get_mut(&f).unwrap().get_mut(&c).unwrap().insert(cd);
                }
            }
        }
    }
    (top, inner)
}

/// The groups of modules that import each other in a circle (strongly connected, more than
/// one module), each sorted.
fn circles(g: &Graph) -> Vec<Vec<String>> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            for d in g.get(&m).into_iter().flatten() {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> = g.keys().map(|m| (m, reach(m))).collect();
    let mut out: Vec<Vec<String>> = Vec::new();
    let mut placed = BTreeSet::new();
    for m in g.keys() {
        if placed.contains(m) || !reached[m].contains(m) {
            continue;
        }
        let group: Vec<String> = reached[m]
            .iter()
            .filter(|o| reached.get(o).is_some_and(|r| r.contains(m)))
            .cloned()
            .collect();
        placed.extend(group.iter().cloned());
        out.push(group);
    }
    out
}

/// One path around `group`'s circle, to show which imports make it.
fn one_way_round(g: &Graph, group: &[String]) -> String {
    let start = &group[0];
    // Breadth-first from start's successors back to start, inside the group.
    let mut prev: BTreeMap<String, String> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start.clone()]);
    while let Some(m) = queue.pop_front() {
        for d in g.get(&m).into_iter().flatten() {
            if !group.contains(d) || prev.contains_key(d) {
                continue;
            }
            prev.insert(d.clone(), m.clone());
            if d == start {
                queue.clear();
                break;
            }
            queue.push_back(d.clone());
        }
    }
    let mut path = vec![start.clone()];
    let mut at = prev.get(start).cloned();
    while let Some(m) = at {
        if &m == start {
            break;
        }
        path.push(m.clone());
        at = prev.get(&m).cloned();
    }
    path.push(start.clone());
    path.reverse();
    path.join(" -> ")
}

/// The circles of crate `krate` that are not allowed, as text.
fn check(krate: &str) -> Vec<String> {
    let src = crates_dir().join(krate).join("src");
    let files = modules_in(&src);
    assert!(!files.is_empty(), "{krate}: no source in {}", src.display());
    let (top, inner) = levels(&edges(&files));
    let allowed: Vec<BTreeSet<&str>> = ALLOWED
        .iter()
        .filter(|(k, _)| *k == krate)
        .map(|(_, c)| c.iter().copied().collect())
        .collect();
    let mut bad = Vec::new();
    let graphs = std::iter::once(&top).chain(inner.values());
    for g in graphs {
        for c in circles(g) {
            let set: BTreeSet<&str> = c.iter().map(String::as_str).collect();
            if !allowed.contains(&set) {
                bad.push(format!(
                    "{krate}: {} (one way round: {})",
                    c.join(", "),
                    one_way_round(g, &c)
                ));
            }
        }
    }
    bad
}

fn crates_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn no_crate_has_modules_that_import_each_other_in_a_circle() {
    let mut crates: Vec<String> = std::fs::read_dir(crates_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("src").is_dir())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    crates.sort();
    for needed in [
        "mcsi-target",
        "mcsi-target-core",
        "mcsi-initiator-core",
        "mcsi-lab",
    ] {
        assert!(crates.iter().any(|c| c == needed), "found only {crates:?}");
    }
    let bad: Vec<String> = crates.iter().flat_map(|k| check(k)).collect();
    assert!(
        bad.is_empty(),
        "modules that import each other in a circle:\n{}",
        bad.join("\n")
    );
    // Every allowed circle still exists: an entry that no longer applies goes.
    for (krate, circle) in ALLOWED {
        let files = modules_in(&crates_dir().join(krate).join("src"));
        let (top, inner) = levels(&edges(&files));
        let want: BTreeSet<&str> = circle.iter().copied().collect();
        let found = std::iter::once(&top).chain(inner.values()).any(|g| {
            circles(g)
                .iter()
                .any(|c| c.iter().map(String::as_str).collect::<BTreeSet<_>>() == want)
        });
        assert!(
            found,
            "{krate}: the allowed circle {circle:?} is gone; remove it from ALLOWED"
        );
    }
}

#[test]
fn the_cores_are_held_to_no_circle() {
    for core in [
        "mcsi-target-core",
        "mcsi-initiator-core",
        "mcsi-target",
        "mcsi-lab",
    ] {
        assert!(
            ALLOWED.iter().all(|(k, _)| *k != core),
            "{core} may not have an allowed circle"
        );
        assert_eq!(check(core), Vec::<String>::new());
    }
}

#[test]
fn the_walk_finds_nested_modules() {
    let files = modules_in(&crates_dir().join("mcsi-target-core").join("src"));
    for m in ["", "session", "session::recover", "control"] {
        assert!(files.contains_key(m), "{m:?} not in {:?}", files.keys());
    }
    let g = edges(&files);
    assert!(
        g["session"].contains("session::recover"),
        "{:?}",
        g["session"]
    );
}

#[test]
fn the_check_sees_circles_and_the_edges_it_should() {
    let text = "use crate::conn;\n// crate::scsi in a comment\nlet s = \"crate::text\"; crate::session::x();\nuse mcsi_target_core::y;\n";
    let heads: Vec<String> = paths_after(text, "crate::")
        .into_iter()
        .map(|p| p[0].clone())
        .collect();
    assert_eq!(heads, vec!["conn", "text", "session"]);
    // A crate whose nested module closes a circle through another top-level module, and whose
    // children import each other in a circle; a child's use of its parent does not count.
    let files: BTreeMap<String, String> = [
        (
            "",
            "pub use server::{Server, StartError};\nmod control;\nmod session;\n",
        ),
        ("control", "use crate::session::Core;\n"),
        ("session", "mod recover;\nmod arrive;\nuse recover::x;\n"),
        (
            "session::recover",
            "use crate::control::plan;\nuse super::Core;\nuse super::arrive::y;\n",
        ),
        (
            "session::arrive",
            "use super::super::session::recover::z;\nuse self::inner::w;\n",
        ),
        ("session::arrive::inner", "use crate::Server;\n"),
        ("server", "pub struct Server;\n"),
    ]
    .into_iter()
    .map(|(m, t)| (m.to_string(), t.to_string()))
    .collect();
    let g = edges(&files);
    let set = |v: &[&str]| {
        v.iter()
            .map(|s| s.to_string())
            .collect::<BTreeSet<String>>()
    };
    assert_eq!(g["control"], set(&["session"]));
    assert_eq!(g["session"], set(&["session::recover"]));
    assert_eq!(
        g["session::recover"],
        set(&["control", "session", "session::arrive"])
    );
    assert_eq!(
        g["session::arrive"],
        set(&["session::recover", "session::arrive::inner"])
    );
    assert_eq!(g["session::arrive::inner"], set(&["server"]));
    let (top, inner) = levels(&g);
    assert_eq!(
        circles(&top),
        vec![vec!["control".to_string(), "session".to_string()]]
    );
    assert_eq!(
        circles(&inner["session"]),
        vec![vec![
            "session::arrive".to_string(),
            "session::recover".to_string()
        ]]
    );
    assert!(one_way_round(&top, &circles(&top)[0]).starts_with("control -> session -> control"));
    // Without the nested imports there is no circle.
    let mut g2 = g.clone();
    g2.get_mut("session::recover").unwrap().remove("control");
    g2.get_mut("session::arrive")
        .unwrap()
        .remove("session::recover");
    let (top, inner) = levels(&g2);
    assert!(circles(&top).is_empty() && circles(&inner["session"]).is_empty());
}
