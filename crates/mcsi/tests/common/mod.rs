//! Helpers shared by the integration tests that drive real peers (tgt, qemu-img, mcsi target).

use std::process::{Command, Stdio};

/// Whether `tool` is on PATH.
pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Under CI=true a missing tool is a failure, never a silent skip.
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}
