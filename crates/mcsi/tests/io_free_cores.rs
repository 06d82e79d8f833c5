#![allow(clippy::unwrap_used, clippy::expect_used)]

//! The two session cores, the target's and the initiator's, do no I/O of their own: no async
//! runtime, no sockets, no clock reads, no threads, no files, no randomness. They run the same
//! on sockets, in-process pipes and virtual time. Two checks per core, on every machine: its
//! crate's dependency graph (from the workspace's Cargo.lock) holds no async runtime, and its
//! source names nothing that does I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The IO-free crates, by package name (each in `crates/NAME`).
const CORES: &[&str] = &["mcsi-target-core", "mcsi-initiator-core"];

fn crate_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name)
}

/// What a core's source may not name. Time is passed in: the `Instant` type is allowed,
/// reading the clock is not. Of `std::io`, only the error types may be named ([`ALLOWED`]): an
/// error the driver met is carried as data. (`mcsi_tcp` is a dependency for its pure parts, the response
/// policies and the `TcpState` type; reading a socket's state is forbidden.)
const FORBIDDEN: &[&str] = &[
    "tokio",
    "std::net",
    "socket2",
    "std::thread",
    "std::fs",
    "std::io",
    "std::process",
    "Instant::now",
    "SystemTime",
    "mcsi_tcp::tcp_state",
    "mcsi_tcp::info::tcp_state",
    "mcsi_tcp::congestion",
    "libc::",
    "rand::",
    "getrandom",
];

/// Names that contain a forbidden one and are allowed: types that describe an I/O error and do
/// none.
const ALLOWED: &[&str] = &["std::io::ErrorKind", "std::io::Error"];

/// Packages that must not be in the core's dependency graph.
const FORBIDDEN_PACKAGES: &[&str] = &["tokio", "mio", "async-std", "smol", "async-io"];

/// A line's code, without a `//` comment (doc comments included).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

/// What a source file's code names that the core may not. The unit tests (from a `#[cfg(test)]`
/// at the start of a line, the tests module, on) are not the core: they may read the clock for
/// an origin of virtual time. A test-only item inside the code (an indented `#[cfg(test)]`) is
/// checked like the rest.
fn violations(file: &str, src: &str) -> Vec<String> {
    let mut out = Vec::new();
    let code_lines = src.lines().take_while(|l| l.trim_end() != "#[cfg(test)]");
    for (n, line) in code_lines.enumerate() {
        let mut c = code(line).to_string();
        for a in ALLOWED {
            c = c.replace(a, "");
        }
        for f in FORBIDDEN {
            if c.contains(f) {
                out.push(format!("{file}:{}: names `{f}`: {}", n + 1, line.trim()));
            }
        }
    }
    out
}

/// Every package reachable from `root` in a Cargo.lock (dev-dependencies included: the lock
/// file does not tell them apart, which only makes the check stricter).
fn reachable(lock: &str, root: &str) -> BTreeSet<String> {
    let doc: toml::Value = lock.parse().expect("Cargo.lock parses as TOML");
    let mut deps: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for p in doc["package"]
        .as_array()
        .expect("Cargo.lock lists packages")
    {
        let name = p["name"].as_str().unwrap_or_default().to_string();
        let list: Vec<String> = p
            .get("dependencies")
            .and_then(|d| d.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|d| d.as_str())
                    // "name", "name version" or "name version (source)".
                    .map(|d| d.split(' ').next().unwrap_or(d).to_string())
                    .collect()
            })
            .unwrap_or_default();
        deps.entry(name).or_default().extend(list);
    }
    let mut seen = BTreeSet::new();
    let mut todo = vec![root.to_string()];
    while let Some(n) = todo.pop() {
        if seen.insert(n.clone()) {
            todo.extend(deps.get(&n).cloned().unwrap_or_default());
        }
    }
    seen
}

/// The workspace's Cargo.lock.
fn workspace_lock() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

#[test]
fn the_session_cores_do_no_io() {
    for core in CORES {
        let src_dir = crate_dir(core).join("src");
        let mut found = Vec::new();
        let mut files = 0;
        for entry in std::fs::read_dir(&src_dir).expect("src/ is readable") {
            let path = entry.expect("a directory entry").path();
            if path.extension().is_some_and(|e| e == "rs") {
                let src = std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
                let name = format!("{core}/src/{}", path.file_name().unwrap().to_string_lossy());
                found.extend(violations(&name, &src));
                files += 1;
            }
        }
        assert!(files >= 5, "only {files} source files found in {src_dir:?}");
        assert!(
            found.is_empty(),
            "the session core {core} must stay free of I/O:\n{}",
            found.join("\n")
        );
    }
}

#[test]
fn no_async_runtime_in_the_dependency_graphs() {
    let lock = workspace_lock();
    for core in CORES {
        let graph = reachable(&lock, core);
        assert!(graph.contains("mcsi-proto"), "graph walk found {graph:?}");
        let bad: Vec<&&str> = FORBIDDEN_PACKAGES
            .iter()
            .filter(|p| graph.contains(**p))
            .collect();
        assert!(
            bad.is_empty(),
            "the session core {core} depends (directly or not) on {bad:?}"
        );
    }
}

/// The simulator runs the cores on virtual time: it needs no runtime and no metrics, so it must
/// not reach them through the tokio layers either. (socket2 stays reachable: mcsi-tcp, whose
/// TCP state types the cores take, reads TCP_INFO with it.)
#[test]
fn the_simulator_depends_on_no_async_runtime_and_no_tokio_layer() {
    let lock = workspace_lock();
    let graph = reachable(&lock, "mcsi-sim");
    for needed in ["mcsi-target-core", "mcsi-initiator-core", "mcsi-scsi"] {
        assert!(graph.contains(needed), "graph walk found {graph:?}");
    }
    let bad: Vec<&str> = FORBIDDEN_PACKAGES
        .iter()
        .copied()
        .chain(["mcsi-target", "mcsi-initiator", "prometheus-client"])
        .filter(|p| graph.contains(*p))
        .collect();
    assert!(
        bad.is_empty(),
        "mcsi-sim depends (directly or not) on {bad:?}"
    );
}

#[test]
fn the_checks_see_what_they_forbid() {
    let bad = "use tokio::sync::mpsc;\nlet t = std::time::Instant::now(); // fine here\nlet s = mcsi_tcp::tcp_state(fd);\n/// tokio in a doc comment is fine\n";
    let v = violations("x", bad);
    assert_eq!(v.len(), 3, "{v:#?}");
    assert!(violations("x", "fn f(now: std::time::Instant) {}\n").is_empty());
    // An I/O error's types may be named; reading or writing may not.
    assert!(violations("x", "fn io(e: &std::io::Error) -> std::io::ErrorKind {}\n").is_empty());
    assert_eq!(
        violations(
            "x",
            "fn f(e: std::io::Error, r: &mut dyn std::io::Read) {}\n"
        )
        .len(),
        1
    );
    assert!(violations(
        "x",
        "#[cfg(test)]\nmod tests { fn t() { Instant::now(); } }\n"
    )
    .is_empty());
    // A test-only method of the code does not end the scan.
    let v = violations(
        "x",
        "impl X {\n    #[cfg(test)]\n    fn len(&self) {}\n    fn f() { std::thread::spawn(|| ()); }\n}\n",
    );
    assert_eq!(v.len(), 1, "{v:#?}");
    // The graph walk follows dependencies given with versions, and only from the root.
    let lock = r#"
[[package]]
name = "core"
dependencies = ["a", "b 1.0.0"]
[[package]]
name = "a"
[[package]]
name = "b"
version = "1.0.0"
dependencies = ["tokio"]
[[package]]
name = "tokio"
[[package]]
name = "other"
dependencies = ["mio"]
"#;
    let g = reachable(lock, "core");
    assert!(g.contains("tokio") && !g.contains("mio"), "{g:?}");
}
