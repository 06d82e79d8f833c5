//! The target's modules, and the session core's, import each other without a circle: every
//! module can be read, tested and replaced knowing only the modules below it. The check reads
//! the source: each `crate::NAME` outside comments (and the names `lib.rs` re-exports, such as
//! `crate::Server`) is an edge to module NAME.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

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

/// Each `crate::IDENT` in `text`'s code.
fn crate_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut rest = code(line);
        while let Some(at) = rest.find("crate::") {
            let before = rest[..at].chars().last();
            rest = &rest[at + "crate::".len()..];
            // `mcsi_target_core::...` and the like end in "crate::" too.
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let ident: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !ident.is_empty() {
                out.push(ident);
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

/// The module graph of a crate whose modules are the files of `src` (flat).
fn graph(src: &Path) -> Graph {
    let mut files = BTreeMap::new();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "rs") {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            files.insert(name, std::fs::read_to_string(&p).unwrap());
        }
    }
    let lib = files.remove("lib").unwrap_or_default();
    let modules: BTreeSet<String> = files.keys().cloned().collect();
    let names = reexports(&lib, &modules);
    let mut g = Graph::new();
    for (m, text) in &files {
        let deps = g.entry(m.clone()).or_default();
        for ident in crate_paths(text) {
            let target = if modules.contains(&ident) {
                Some(ident)
            } else {
                names.get(&ident).cloned()
            };
            if let Some(t) = target.filter(|t| t != m) {
                deps.insert(t);
            }
        }
    }
    g
}

/// A circle in `g`, as the modules along it (first repeated at the end), if there is one.
fn find_circle(g: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    fn visit(
        g: &Graph,
        m: &str,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        marks.insert(m.to_string(), Mark::Open);
        path.push(m.to_string());
        for d in g.get(m).into_iter().flatten() {
            match marks.get(d).copied().unwrap_or(Mark::New) {
                Mark::Open => {
                    let from = path.iter().position(|x| x == d).unwrap_or(0);
                    let mut c = path[from..].to_vec();
                    c.push(d.clone());
                    return Some(c);
                }
                Mark::New => {
                    if let Some(c) = visit(g, d, marks, path) {
                        return Some(c);
                    }
                }
                Mark::Done => {}
            }
        }
        path.pop();
        marks.insert(m.to_string(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for m in g.keys() {
        if marks.get(m).copied().unwrap_or(Mark::New) == Mark::New {
            if let Some(c) = visit(g, m, &mut marks, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

fn check(krate: &str) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(krate)
        .join("src");
    let g = graph(&src);
    for (m, deps) in &g {
        let deps: Vec<&str> = deps.iter().map(String::as_str).collect();
        eprintln!("{krate}: {m} -> {}", deps.join(" "));
    }
    assert!(
        g.len() > 5,
        "{krate}: only {} modules found in {}",
        g.len(),
        src.display()
    );
    if let Some(c) = find_circle(&g) {
        panic!(
            "{krate}: modules import each other in a circle: {}",
            c.join(" -> ")
        );
    }
}

#[test]
fn the_target_modules_import_without_a_circle() {
    check("mcsi-target");
}

#[test]
fn the_session_core_modules_import_without_a_circle() {
    check("mcsi-target-core");
}

#[test]
fn the_check_sees_circles_and_the_edges_it_should() {
    let text = "use crate::conn;\n// crate::scsi in a comment\nlet s = \"crate::text\"; crate::session::x();\nuse mcsi_target_core::y;\n";
    assert_eq!(crate_paths(text), vec!["conn", "text", "session"]);
    let mut g = Graph::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        g.entry(a.into()).or_default().insert(b.into());
        g.entry(b.into()).or_default();
    }
    assert_eq!(
        find_circle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    g.get_mut("c").unwrap().remove("a");
    assert_eq!(find_circle(&g), None);
    let modules: BTreeSet<String> = ["server".to_string(), "session".to_string()].into();
    let names = reexports(
        "pub use server::{Server, StartError};\npub use session::{SessionEnd, Target};\n",
        &modules,
    );
    assert_eq!(names.get("Target").map(String::as_str), Some("session"));
    assert_eq!(names.get("StartError").map(String::as_str), Some("server"));
}
