//! Discovery and login redirection with a standard initiator (libiscsi): a login redirected from
//! one portal to another lands where it was sent, and behind an emulated NAT (three network
//! namespaces, DNAT on the middle one) SendTargets gives the address the initiator can reach.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{free_port, have, runs, wait_listening};

use std::io::BufRead;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const IQN: &str = "iqn.2026-01.org.mcsi:discovery-test";
const BIN: &str = env!("CARGO_BIN_EXE_mcsi");

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Target A (a file with `[targets.redirect]`) sends every login to target B's portal; B's LUN
/// has its own serial, so what libiscsi reads says where it logged in. libiscsi follows a
/// temporary move and stops at a permanent one, naming it.
#[test]
fn libiscsi_follows_a_redirect_to_the_other_portal() {
    let missing = (!have("iscsi-inq")).then(|| "iscsi-inq (libiscsi-bin) is not installed".into());
    if !runs("libiscsi_follows_a_redirect_to_the_other_portal", missing) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (free_port(), free_port());
    for (permanent, serial) in [(false, "REDIR-TEMP"), (true, "REDIR-PERM")] {
        let conf = dir.path().join("a.toml");
        std::fs::write(
            &conf,
            format!(
                "listen = [\"127.0.0.1:{pa}\"]\n[[targets]]\niqn = \"{IQN}\"\nluns = [{{ backend = \"ram:16MiB\", serial = \"STAYED\" }}]\n[targets.redirect]\nto = \"127.0.0.1:{pb}\"\npermanent = {permanent}\n"
            ),
        )
        .unwrap();
        let _a = Kill(
            Command::new(BIN)
                .args(["target", "--config"])
                .arg(&conf)
                .env("MCSI_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let _b = Kill(
            Command::new(BIN)
                .args(["target", "--listen", &format!("127.0.0.1:{pb}")])
                .args(["--iqn", IQN, "--lun", &format!("ram:16MiB,serial={serial}")])
                .env("MCSI_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        wait_listening(pa);
        wait_listening(pb);
        let o = Command::new("iscsi-inq")
            .args(["-e", "1", "-c", "128"])
            .arg(format!("iscsi://127.0.0.1:{pa}/{IQN}/0"))
            .output()
            .unwrap();
        if permanent {
            // libiscsi (1.19) follows only a temporary move: a permanent one ends its login
            // with the status named, which says the target answered 1/02.
            assert!(!o.status.success(), "{}", text(&o));
            assert!(
                text(&o).contains("Target moved permanently(258)"),
                "{}",
                text(&o)
            );
            continue;
        }
        assert!(o.status.success(), "permanent={permanent}: {}", text(&o));
        assert!(
            text(&o).contains(serial) && !text(&o).contains("STAYED"),
            "permanent={permanent}: {}",
            text(&o)
        );
    }
}

/// Network namespaces removed when dropped.
struct Netns(Vec<String>);

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

fn sh(args: &[&str]) {
    let o = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(o.status.success(), "{args:?}: {}", text(&o));
}

/// `mcsi target` in namespace `ns`, once it says it listens.
fn target_in(ns: &str, extra: &[&str]) -> Kill {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, BIN, "target"])
        .args([
            "--listen",
            "10.77.0.2:3260",
            "--iqn",
            IQN,
            "--lun",
            "ram:16MiB",
        ])
        .args(extra)
        .env("MCSI_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(out).read_line(&mut line).unwrap();
    assert!(line.contains("listening on 10.77.0.2:3260"), "{line}");
    Kill(child)
}

/// The initiator in `out` reaches only the NAT's public address 198.51.100.1; the target
/// listens on 10.77.0.2 behind it. With `--advertise 198.51.100.1:3260` iscsi-ls discovers the
/// target and logs in through the NAT; without it, discovery gives 10.77.0.2, which the
/// initiator cannot reach (the control: the NAT really hides the portal).
#[test]
fn behind_nat_discovery_gives_the_public_address_and_the_login_goes_through() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let missing = if !root {
        Some("needs root for network namespaces".to_string())
    } else if !have("nft") {
        Some("nft (nftables) is not installed".to_string())
    } else if !have("iscsi-ls") {
        Some("iscsi-ls (libiscsi-bin) is not installed".to_string())
    } else {
        None
    };
    if !runs(
        "behind_nat_discovery_gives_the_public_address_and_the_login_goes_through",
        missing,
    ) {
        return;
    }
    let id = std::process::id();
    let (out, nat, inn) = (
        format!("mcsi-out-{id}"),
        format!("mcsi-nat-{id}"),
        format!("mcsi-in-{id}"),
    );
    let _ns = Netns(vec![out.clone(), nat.clone(), inn.clone()]);
    for n in [&out, &nat, &inn] {
        sh(&["ip", "netns", "add", n]);
        sh(&["ip", "-n", n, "link", "set", "lo", "up"]);
    }
    sh(&[
        "ip", "-n", &out, "link", "add", "o0", "type", "veth", "peer", "name", "n0", "netns", &nat,
    ]);
    sh(&[
        "ip", "-n", &nat, "link", "add", "n1", "type", "veth", "peer", "name", "i0", "netns", &inn,
    ]);
    for (ns, dev, addr) in [
        (&out, "o0", "198.51.100.2/24"),
        (&nat, "n0", "198.51.100.1/24"),
        (&nat, "n1", "10.77.0.1/24"),
        (&inn, "i0", "10.77.0.2/24"),
    ] {
        sh(&["ip", "-n", ns, "addr", "add", addr, "dev", dev]);
        sh(&["ip", "-n", ns, "link", "set", dev, "up"]);
    }
    sh(&[
        "ip",
        "-n",
        &inn,
        "route",
        "add",
        "default",
        "via",
        "10.77.0.1",
    ]);
    sh(&[
        "ip",
        "netns",
        "exec",
        &nat,
        "sysctl",
        "-qw",
        "net.ipv4.ip_forward=1",
    ]);
    let rules = "table ip nat {\n chain pre {\n  type nat hook prerouting priority dstnat; policy accept;\n  ip daddr 198.51.100.1 tcp dport 3260 dnat to 10.77.0.2:3260\n }\n}\n";
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), rules).unwrap();
    sh(&[
        "ip",
        "netns",
        "exec",
        &nat,
        "nft",
        "-f",
        file.path().to_str().unwrap(),
    ]);
    let ls = |ns: &str| -> Output {
        Command::new("ip")
            .args(["netns", "exec", ns, "timeout", "20", "iscsi-ls", "-s"])
            .arg("iscsi://198.51.100.1:3260")
            .output()
            .unwrap()
    };
    // Advertised: discovery gives the public address, and the login through it reads the LUN.
    {
        let _t = target_in(&inn, &["--advertise", "198.51.100.1:3260"]);
        let t0 = Instant::now();
        let o = loop {
            let o = ls(&out);
            if o.status.success() || t0.elapsed() > Duration::from_secs(10) {
                break o;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        let s = text(&o);
        eprintln!("advertised: iscsi-ls -s gave:\n{s}");
        assert!(o.status.success(), "{s}");
        assert!(s.contains(IQN) && s.contains("198.51.100.1:3260"), "{s}");
        assert!(
            s.contains("Lun:0"),
            "the login through the NAT read no LUN: {s}"
        );
    }
    // Not advertised: discovery (through the NAT) gives the private portal, and the login to
    // it cannot get there.
    let _t = target_in(&inn, &[]);
    let o = ls(&out);
    let s = text(&o);
    eprintln!("not advertised: iscsi-ls -s gave:\n{s}");
    assert!(s.contains("10.77.0.2:3260") || !o.status.success(), "{s}");
    assert!(
        !s.contains("Lun:0"),
        "the private portal should be out of reach: {s}"
    );
}
