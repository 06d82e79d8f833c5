#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `mcsi sim` end to end: a run, its CSV twice, its JSON, and what wrong arguments say.

use std::process::{Command, Output};

fn mcsi(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mcsi"))
        .arg("sim")
        .args(args)
        .output()
        .expect("run mcsi")
}

#[test]
fn a_run_writes_the_same_csv_twice_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let args = |csv: &str| {
        vec![
            "--path".to_string(),
            "rate=10mbit,delay=10ms,loss=0.5%".into(),
            "--connections".into(),
            "2".into(),
            "--iodepth".into(),
            "4".into(),
            "--bs".into(),
            "16KiB".into(),
            "--rw".into(),
            "randwrite".into(),
            "--runtime".into(),
            "2".into(),
            "--csv".into(),
            dir.path().join(csv).display().to_string(),
            "--json".into(),
        ]
    };
    let mut seen = Vec::new();
    for name in ["a.csv", "b.csv"] {
        let a = args(name);
        let out = mcsi(&a.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["bw_mbs"].as_f64().unwrap() > 0.1, "{v}");
        assert_eq!(v["congestion"], "cubic");
        assert!(v["target"]["r2ts"].as_u64().is_some(), "{v}");
        seen.push(std::fs::read_to_string(dir.path().join(name)).unwrap());
    }
    assert_eq!(seen[0], seen[1]);
    assert!(
        seen[0].starts_with("session,ios,errors,bytes,"),
        "{}",
        seen[0]
    );
}

#[test]
fn wrong_arguments_say_what_is_wrong() {
    for (args, says) in [
        (vec!["--bs", "1000"], "multiple of 512"),
        (vec!["--congestion", "bbr"], "reno and cubic"),
        (vec!["--path", "rate=fast"], "--path rate=fast"),
        (vec!["--rw", "trim"], "randwrite"),
        (vec!["--connections", "9"], "at most 8"),
        (vec!["--runtime", "0"], "longer than zero"),
        (vec!["--policy", "fastest"], "fastest"),
        (vec!["--pdu", "100"], "between 512B and 16MiB-1"),
    ] {
        let out = mcsi(&args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
