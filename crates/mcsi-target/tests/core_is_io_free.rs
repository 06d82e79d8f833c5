//! The session core and the plain-data modules it is built from do no I/O of their own: no
//! tokio, no sockets, no clock reads, no threads, no files, and nothing of the tokio layer. They
//! run the same on sockets, in-process pipes and (later) virtual time. This check reads their
//! source, so a change that breaks the rule fails here, on every machine.

use std::path::Path;

/// The core's modules (src/, without .rs).
const CORE: &[&str] = &[
    "session_core",
    "keepalive",
    "taskset",
    "transfer",
    "datain",
    "window",
];

/// What none of them may name. Time is passed in: the `Instant` type is allowed, reading the
/// clock is not.
const FORBIDDEN: &[&str] = &[
    "tokio",
    "std::net",
    "socket2",
    "std::thread",
    "std::fs",
    "std::io",
    "Instant::now",
    "SystemTime",
    "mcsi_tcp::tcp_state",
    "rand::",
    "getrandom",
];

/// The modules of this crate they may use.
const CRATE_ALLOWED: &[&str] = CORE;

/// A line's code, without a `//` comment (doc comments included).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

/// What the module's code names that the core may not. Its unit tests (from `#[cfg(test)]` on)
/// are not the core: they may read the clock for an origin of virtual time.
fn violations(module: &str, src: &str) -> Vec<String> {
    let mut out = Vec::new();
    let code_lines = src.lines().take_while(|l| l.trim() != "#[cfg(test)]");
    for (n, line) in code_lines.enumerate() {
        let c = code(line);
        for f in FORBIDDEN {
            if c.contains(f) {
                out.push(format!(
                    "src/{module}.rs:{}: names `{f}`: {}",
                    n + 1,
                    line.trim()
                ));
            }
        }
        for (i, _) in c.match_indices("crate::") {
            let rest = &c[i + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|ch| ch.is_alphanumeric() || *ch == '_')
                .collect();
            if !CRATE_ALLOWED.contains(&name.as_str()) {
                out.push(format!(
                    "src/{module}.rs:{}: uses crate::{name}, outside the core: {}",
                    n + 1,
                    line.trim()
                ));
            }
        }
    }
    out
}

#[test]
fn the_session_core_does_no_io() {
    let src_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for m in CORE {
        let path = src_dir.join(format!("{m}.rs"));
        let src = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        found.extend(violations(m, &src));
    }
    assert!(
        found.is_empty(),
        "the session core must stay free of I/O:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_sees_what_it_forbids() {
    let bad = "use tokio::sync::mpsc;\nlet t = std::time::Instant::now(); // fine here\nuse crate::conn::Conn;\n/// tokio in a doc comment is fine\n";
    let v = violations("x", bad);
    assert_eq!(v.len(), 3, "{v:#?}");
    assert!(violations("x", "fn f(now: std::time::Instant) {}\n").is_empty());
    assert!(violations(
        "x",
        "#[cfg(test)]\nmod tests { fn t() { Instant::now(); } }\n"
    )
    .is_empty());
    assert!(violations("x", "use crate::taskset::TaskSet;\n").is_empty());
}
