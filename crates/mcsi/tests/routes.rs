//! Per-connection routes: `--bind` puts each connection of a session on its own source address
//! (or interface), `--portal` on its own portal, in turn; the bench JSON shows each
//! connection's addresses. Bad values are refused before anything connects.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{free_port, wait_listening, LocalTarget};

use std::process::{Command, Stdio};

const IQN: &str = "iqn.2026-01.org.mcsi:routes-test";

fn mcsi() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mcsi"))
}

/// An mcsi target of one 16 MiB LUN listening on two portals of 127.0.0.1.
fn two_portal_target() -> (std::process::Child, u16, u16) {
    let (p1, p2) = (free_port(), free_port());
    let target = mcsi()
        .args(["target", "--listen", &format!("127.0.0.1:{p1}")])
        .args(["--listen", &format!("127.0.0.1:{p2}"), "--iqn", IQN])
        .args(["--lun", "ram:16MiB"])
        .env("MCSI_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(p1);
    wait_listening(p2);
    (target, p1, p2)
}

#[test]
fn connections_take_their_binds_and_portals_in_turn() {
    let (mut target, p1, p2) = two_portal_target();
    let out = mcsi()
        .args(["bench", &format!("iscsi://127.0.0.1:{p1}/{IQN}/0")])
        .args(["--connections", "4", "--iodepth", "8", "--bs", "16KiB"])
        .args(["--rw", "randread", "--runtime", "1", "--json"])
        // Every 127/8 address is this host's: four sources, two portals.
        .args(["--bind", "127.0.0.2", "--bind", "127.0.0.3"])
        .args(["--portal", &format!("127.0.0.1:{p1}")])
        .args(["--portal", &format!("127.0.0.1:{p2}")])
        .output()
        .unwrap();
    // An interface as the source (SO_BINDTODEVICE).
    let dev = mcsi()
        .args(["bench", &format!("iscsi://127.0.0.1:{p1}/{IQN}/0")])
        .args(["--runtime", "1", "--json", "--bind", "lo"])
        .output()
        .unwrap();
    let _ = target.kill();
    let _ = target.wait();
    assert!(
        dev.status.success(),
        "{}",
        String::from_utf8_lossy(&dev.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&dev.stdout).unwrap();
    assert_eq!(v["mcsi"]["connections"][0]["bind"], "dev lo", "{v}");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let conns = v["mcsi"]["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 4, "{v}");
    for (i, c) in conns.iter().enumerate() {
        let src = ["127.0.0.2", "127.0.0.3"][i % 2];
        let port = [p1, p2][i % 2];
        let local = c["local"].as_str().unwrap();
        assert!(local.starts_with(&format!("{src}:")), "connection {i}: {c}");
        assert_eq!(
            c["peer"],
            format!("127.0.0.1:{port}"),
            "connection {i}: {c}"
        );
        assert_eq!(c["bind"], src, "connection {i}: {c}");
        assert!(
            c["tasks"].as_u64().unwrap() > 0,
            "connection {i} carried nothing: {c}"
        );
    }
}

#[test]
fn bad_routes_are_refused_with_what_is_wrong() {
    let url = "iscsi://127.0.0.1:9/iqn.2026-01.org.mcsi:x/0";
    for (args, want) in [
        (
            vec!["--bind", "192.0.2.77"],
            "--bind 192.0.2.77: 192.0.2.77 is not an address of this host",
        ),
        (
            vec!["--bind", "nosuchif0"],
            "--bind nosuchif0: no interface named 'nosuchif0' on this host (it has:",
        ),
        (
            vec!["--portal", "127.0.0.1"],
            "--portal 127.0.0.1: expected HOST:PORT",
        ),
        (
            vec!["--portal", "127.0.0.1:0"],
            "--portal 127.0.0.1:0: '0' is not a port",
        ),
        (vec!["--portal", "::1:3260"], "an IPv6 address in brackets"),
        (
            vec!["--stall-timeout", "soon"],
            "--stall-timeout soon: invalid duration 'soon'",
        ),
    ] {
        let out = mcsi()
            .args(["bench", url, "--runtime", "1"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} accepted");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(want), "{args:?}: {e}");
    }
    // A portal that refuses: the error names it and the source.
    let port = free_port();
    let out = mcsi()
        .args([
            "bench",
            &format!("iscsi://127.0.0.1:{port}/{IQN}/0"),
            "--runtime",
            "1",
        ])
        .args(["--bind", "127.0.0.2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains(&format!(
            "cannot connect to 127.0.0.1:{port} from 127.0.0.2"
        )) && e.contains("refused"),
        "{e}"
    );
}

#[test]
fn a_session_profile_shapes_the_session_and_the_command_line_wins() {
    let target = LocalTarget::start(env!("CARGO_BIN_EXE_mcsi"), IQN, "ram:16MiB");
    let dir = std::env::temp_dir();
    let profile = dir.join(format!("mcsi-profile-{}.toml", std::process::id()));
    std::fs::write(
        &profile,
        "connections = 2\nbind = [\"127.0.0.2\", \"127.0.0.3\"]\npolicy = \"least-outstanding\"\nstall_timeout = \"2s\"\n",
    )
    .unwrap();
    let bad = dir.join(format!("mcsi-profile-bad-{}.toml", std::process::id()));
    std::fs::write(&bad, "connections = 2\nconections = 4\n").unwrap();
    let url = target.url(IQN);
    let out = mcsi()
        .args(["bench", &url, "--runtime", "1", "--json"])
        .args(["--session-profile", &profile.to_string_lossy()])
        .args(["--policy", "round-robin"])
        .output()
        .unwrap();
    let refused = mcsi()
        .args(["bench", &url, "--runtime", "1"])
        .args(["--session-profile", &bad.to_string_lossy()])
        .output()
        .unwrap();
    drop(target);
    let _ = std::fs::remove_file(&profile);
    let _ = std::fs::remove_file(&bad);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["mcsi"]["policy"], "round-robin",
        "the command line wins: {v}"
    );
    let conns = v["mcsi"]["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 2, "{v}");
    for (i, c) in conns.iter().enumerate() {
        let src = ["127.0.0.2", "127.0.0.3"][i];
        assert!(
            c["local"].as_str().unwrap().starts_with(&format!("{src}:")),
            "{c}"
        );
    }
    assert!(!refused.status.success());
    let e = String::from_utf8_lossy(&refused.stderr);
    assert!(e.contains("unknown field `conections`"), "{e}");
}

#[test]
fn portals_learned_from_send_targets_take_the_connections_in_turn() {
    let (mut target, p1, p2) = two_portal_target();
    let out = mcsi()
        .args(["bench", &format!("iscsi://127.0.0.1:{p1}/{IQN}/0")])
        .args(["--connections", "2", "--discover-portals"])
        .args(["--runtime", "1", "--json"])
        .output()
        .unwrap();
    let unknown = mcsi()
        .args(["bench", &format!("iscsi://127.0.0.1:{p1}/{IQN}-not-here/0")])
        .args(["--discover-portals", "--runtime", "1"])
        .output()
        .unwrap();
    let _ = target.kill();
    let _ = target.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let peers: Vec<&str> = v["mcsi"]["connections"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["peer"].as_str().unwrap())
        .collect();
    assert_eq!(
        peers,
        [format!("127.0.0.1:{p1}"), format!("127.0.0.1:{p2}")],
        "{v}"
    );
    assert!(!unknown.status.success());
    let e = String::from_utf8_lossy(&unknown.stderr);
    assert!(e.contains("does not list"), "{e}");
}
