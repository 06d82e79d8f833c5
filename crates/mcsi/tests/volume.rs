//! Several targets as one volume (`volume:SPEC.toml`): `mcsi copy` into a striped and a
//! mirrored volume of two mcsi targets and back, byte-exact; each member holds what the layout
//! says; bad specs are refused with what is wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::LocalTarget;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const IQN: &str = "iqn.2026-01.org.mcsi:volume-test";

fn mcsi() -> &'static str {
    env!("CARGO_BIN_EXE_mcsi")
}

fn run(args: &[&str]) -> Output {
    let out = Command::new(mcsi()).args(args).output().unwrap();
    eprintln!(
        "mcsi {}\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A scratch directory removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("mcsi-volume-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }

    fn file(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn spec(dir: &Scratch, name: &str, head: &str, members: &[&LocalTarget]) -> String {
    let mut t = format!("{head}\n");
    for m in members {
        t.push_str(&format!(
            "\n[[member]]\nurl = \"{}\"\nconnections = 2\n",
            m.url(IQN)
        ));
    }
    let p = dir.file(name);
    std::fs::write(&p, t).unwrap();
    format!("volume:{p}")
}

/// A verified random-write `mcsi bench` over `vol` in the background, its output piped.
fn verified_writes(vol: &str, iodepth: &str, size: &str, runtime: &str) -> std::process::Child {
    Command::new(mcsi())
        .args([
            "bench",
            vol,
            "--rw",
            "randwrite",
            "--verify",
            "--bs",
            "64KiB",
        ])
        .args([
            "--iodepth",
            iodepth,
            "--size",
            size,
            "--runtime",
            runtime,
            "--json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect()
}

/// Two mcsi targets, each serving one `lun`.
fn two_targets(lun: &str) -> (LocalTarget, LocalTarget) {
    (
        LocalTarget::start(mcsi(), IQN, lun),
        LocalTarget::start(mcsi(), IQN, lun),
    )
}

fn read_member(m: &LocalTarget, dir: &Scratch, name: &str, len: &str) -> Vec<u8> {
    let out = dir.file(name);
    let o = run(&["copy", "--no-progress", "--length", len, &m.url(IQN), &out]);
    assert!(o.status.success());
    std::fs::read(out).unwrap()
}

#[test]
fn a_striped_volume_spreads_chunks_and_reads_back_byte_exact() {
    let (a, b) = two_targets("ram:8MiB");
    let dir = Scratch::new("stripe");
    let vol = spec(
        &dir,
        "s.toml",
        "layout = \"stripe\"\nchunk = \"64KiB\"",
        &[&a, &b],
    );
    let data = pattern(12 << 20);
    let src = dir.file("src.bin");
    std::fs::write(&src, &data).unwrap();
    // 192 KiB pieces: every copy chunk crosses chunk and member boundaries.
    let o = run(&["copy", "--no-progress", "--bs", "192KiB", &src, &vol]);
    assert!(o.status.success());
    let back = dir.file("back.bin");
    let o = run(&["copy", "--no-progress", "--bs", "320KiB", &vol, &back]);
    assert!(o.status.success());
    let got = std::fs::read(&back).unwrap();
    assert_eq!(got.len(), 16 << 20, "the volume is both members together");
    assert!(
        got[..data.len()] == data[..],
        "the volume reads back what was written"
    );
    // Each member holds every other 64 KiB chunk.
    let (ma, mb) = (
        read_member(&a, &dir, "a.bin", "6MiB"),
        read_member(&b, &dir, "b.bin", "6MiB"),
    );
    let k = 64 << 10;
    for (c, piece) in data.chunks(k).enumerate() {
        let (m, row) = if c % 2 == 0 {
            (&ma, c / 2)
        } else {
            (&mb, c / 2)
        };
        assert!(
            m[row * k..(row + 1) * k] == *piece,
            "chunk {c} is not where the stripe puts it"
        );
    }
}

#[test]
fn a_mirrored_volume_writes_every_member() {
    let (a, b) = (
        LocalTarget::start(mcsi(), IQN, "ram:8MiB"),
        LocalTarget::start(mcsi(), IQN, "ram:4MiB"),
    );
    let dir = Scratch::new("mirror");
    let vol = spec(&dir, "m.toml", "layout = \"mirror\"", &[&a, &b]);
    let data = pattern(4 << 20);
    let src = dir.file("src.bin");
    std::fs::write(&src, &data).unwrap();
    let o = run(&["copy", "--no-progress", &src, &vol]);
    assert!(o.status.success());
    let back = dir.file("back.bin");
    let o = run(&["copy", "--no-progress", &vol, &back]);
    assert!(o.status.success());
    assert!(
        std::fs::read(&back).unwrap() == data,
        "the mirror (the smaller member's size) reads back what was written"
    );
    for (m, name) in [(&a, "a.bin"), (&b, "b.bin")] {
        assert!(
            read_member(m, &dir, name, "4MiB") == data,
            "{name} misses writes"
        );
    }
}

#[test]
fn bad_volume_specs_say_what_is_wrong() {
    let a = LocalTarget::start(mcsi(), IQN, "ram:4MiB");
    let b4k = LocalTarget::start(mcsi(), IQN, "ram:4MiB,block_size=4096");
    let dir = Scratch::new("bad");
    let dst = dir.file("out.bin");
    let cases: Vec<(String, &str)> = vec![
        (
            spec(&dir, "one.toml", "layout = \"stripe\"", &[&a]),
            "a volume needs two members or more",
        ),
        (
            spec(&dir, "bs.toml", "layout = \"stripe\"", &[&a, &b4k]),
            "has 4096-byte blocks, member 0",
        ),
        (
            spec(
                &dir,
                "chunk.toml",
                "layout = \"stripe\"\nchunk = 1000",
                &[&a, &a],
            ),
            "chunk 1000 bytes is not a multiple of the members' 512-byte blocks",
        ),
        (
            spec(&dir, "layout.toml", "layout = \"raid5\"", &[&a, &a]),
            "'raid5': use stripe, mirror or paths",
        ),
        (
            {
                let p = dir.file("missing.toml");
                std::fs::write(
                    &p,
                    format!(
                        "layout = \"mirror\"\n[[member]]\nurl = \"{}\"\n[[member]]\nurl = \"iscsi://127.0.0.1:{}/{IQN}/0\"\n",
                        a.url(IQN),
                        common::free_port()
                    ),
                )
                .unwrap();
                format!("volume:{p}")
            },
            "member 1 (iscsi://127.0.0.1:",
        ),
        (
            {
                let p = dir.file("key.toml");
                std::fs::write(
                    &p,
                    format!(
                        "layout = \"mirror\"\n[[member]]\nurl = \"{}\"\nconections = 2\n[[member]]\nurl = \"{}\"\n",
                        a.url(IQN),
                        a.url(IQN)
                    ),
                )
                .unwrap();
                format!("volume:{p}")
            },
            "member[0]: unknown field `conections`",
        ),
        (
            format!("volume:{}", Path::new(&dir.file("nope.toml")).display()),
            "volume spec",
        ),
    ];
    for (vol, want) in cases {
        let o = run(&["copy", "--no-progress", "--length", "64KiB", &vol, &dst]);
        assert!(!o.status.success(), "{vol} accepted");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains(want), "{vol}: wanted '{want}' in: {e}");
    }
}

#[test]
fn a_verified_bench_runs_over_a_striped_volume() {
    let (a, b) = two_targets("ram:8MiB");
    let dir = Scratch::new("bench");
    let vol = spec(
        &dir,
        "s.toml",
        "layout = \"stripe\"\nchunk = \"32KiB\"",
        &[&a, &b],
    );
    let out = run(&[
        "bench",
        &vol,
        "--rw",
        "randrw",
        "--verify",
        "--bs",
        "48KiB",
        "--iodepth",
        "8",
        "--size",
        "4MiB",
        "--runtime",
        "1",
        "--json",
    ]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"][0]["error"], 0, "{v}");
    assert_eq!(v["mcsi"]["verify"]["errors"], 0, "{v}");
    assert!(
        v["mcsi"]["verify"]["blocks_checked"].as_u64().unwrap() > 0,
        "{v}"
    );
    let vol_json = &v["mcsi"]["volume"];
    assert_eq!(vol_json["layout"], "stripe", "{v}");
    assert_eq!(vol_json["bytes"], 16 << 20, "{v}");
    let members = vol_json["members"].as_array().unwrap();
    assert_eq!(members.len(), 2);
    for m in members {
        assert!(
            m["tasks"].as_u64().unwrap() > 0,
            "a member carried nothing: {m}"
        );
    }
    let auto = run(&["bench", &vol, "--bs", "auto", "--runtime", "1"]);
    assert!(!auto.status.success());
    assert!(String::from_utf8_lossy(&auto.stderr).contains("give a volume a fixed --bs"));
}

#[test]
fn a_mirror_goes_on_degraded_when_a_member_dies() {
    let a = LocalTarget::start(mcsi(), IQN, "ram:16MiB");
    let b = LocalTarget::start(mcsi(), IQN, "ram:16MiB");
    let dir = Scratch::new("degraded");
    let vol = spec(&dir, "m.toml", "layout = \"mirror\"", &[&a, &b]);
    let bench = verified_writes(&vol, "8", "8MiB", "6");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // Member 1's target dies mid-run (SIGKILL): its session tries again, gives up, and the
    // volume goes on with member 0 alone.
    drop(b);
    let out = bench.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    eprintln!("{log}");
    assert!(out.status.success(), "{log}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"][0]["error"], 0, "{v}");
    assert_eq!(v["mcsi"]["verify"]["errors"], 0, "{v}");
    assert!(
        v["mcsi"]["verify"]["blocks_checked"].as_u64().unwrap() > 0,
        "{v}"
    );
    let m = &v["mcsi"]["volume"]["members"];
    assert_eq!(m[0]["failed"], false, "{v}");
    assert_eq!(m[1]["failed"], true, "{v}");
    assert!(m[1]["dirty_bytes"].as_u64().unwrap() > 0, "{v}");
    assert!(log.contains("goes on degraded"), "{log}");
    drop(a);
}

/// `mcsi target` serving `file` (16 MiB) on `port`.
fn file_target(port: u16, file: &str) -> LocalTarget {
    LocalTarget::start_at(mcsi(), port, IQN, &format!("file:{file}:16MiB"))
}

/// Two file-backed targets as a mirror whose spec begins with `head`: the member files, their
/// ports (a target restarts on its file with [`FileMirror::start`]) and the volume argument.
struct FileMirror {
    files: [String; 2],
    ports: [u16; 2],
    vol: String,
}

impl FileMirror {
    fn new(dir: &Scratch, head: &str) -> (FileMirror, LocalTarget, LocalTarget) {
        let files = [dir.file("a.img"), dir.file("b.img")];
        let ports = [common::free_port(), common::free_port()];
        let mut text = format!("{head}\n");
        for p in ports {
            text.push_str(&format!(
                "[[member]]\nurl = \"iscsi://127.0.0.1:{p}/{IQN}/0\"\n"
            ));
        }
        let spec_file = dir.file("m.toml");
        std::fs::write(&spec_file, text).unwrap();
        let m = FileMirror {
            files,
            ports,
            vol: format!("volume:{spec_file}"),
        };
        let (a, b) = (m.start(0), m.start(1));
        (m, a, b)
    }

    fn start(&self, i: usize) -> LocalTarget {
        file_target(self.ports[i], &self.files[i])
    }
}

#[test]
fn a_failed_mirror_member_comes_back_and_gets_only_what_it_missed() {
    let dir = Scratch::new("resync");
    let (m, ta, mut tb) = FileMirror::new(&dir, "layout = \"mirror\"");
    let [fa, fb] = m.files.clone();
    let vol = m.vol.clone();
    // Both members hold the whole 16 MiB first.
    let src = dir.file("src.bin");
    std::fs::write(&src, pattern(16 << 20)).unwrap();
    assert!(run(&["copy", "--no-progress", &src, &vol]).status.success());
    // Random writes over the first 4 MiB for 12 s; member 1's target dies at 1 s (its session
    // gives up about 3 s later) and comes back on the same file at 7 s.
    let bench = verified_writes(&vol, "4", "4MiB", "12");
    std::thread::sleep(std::time::Duration::from_secs(1));
    drop(tb);
    std::thread::sleep(std::time::Duration::from_secs(6));
    tb = m.start(1);
    let out = bench.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    eprintln!("{log}");
    drop((ta, tb));
    assert!(out.status.success(), "{log}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"][0]["error"], 0, "{v}");
    assert_eq!(v["mcsi"]["verify"]["errors"], 0, "{v}");
    assert!(log.contains("goes on degraded"), "{log}");
    let synced = log
        .lines()
        .find(|l| l.contains("back in sync"))
        .unwrap_or_else(|| panic!("member 1 never came back in sync: {log}"));
    let bytes: u64 = synced
        .split("bytes=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no byte count in: {synced}"));
    assert!(
        bytes > 0 && bytes <= 4 << 20,
        "the resync copied {bytes} bytes; only the 4 MiB region written while away may be copied"
    );
    let m = &v["mcsi"]["volume"]["members"];
    assert_eq!(m[1]["failed"], false, "{v}");
    // Both members now hold the same bytes.
    let (a, b) = (std::fs::read(&fa).unwrap(), std::fs::read(&fb).unwrap());
    assert_eq!(a.len(), b.len());
    assert!(a == b, "the members differ after the resync");
}

#[test]
fn a_restarted_mirror_never_trusts_a_stale_member() {
    let dir = Scratch::new("restart");
    let (m, mut ta, mut tb) = FileMirror::new(&dir, "layout = \"mirror\"\nbitmap = \"m.bitmap\"");
    let [fa, fb] = m.files.clone();
    let vol = m.vol.clone();
    let bitmap = dir.file("m.bitmap");
    let dirty_of = |member: usize| -> serde_json::Value {
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&bitmap).unwrap()).unwrap();
        v["members"][member]["dirty"].clone()
    };
    // Both members hold pattern one; the bitmap file is created clean.
    let one = pattern(16 << 20);
    let src = dir.file("one.bin");
    std::fs::write(&src, &one).unwrap();
    assert!(run(&["copy", "--no-progress", &src, &vol]).status.success());
    assert_eq!(dirty_of(1), serde_json::json!([]));
    // Member 1 is away: the mirror opens degraded, takes 2 MiB of pattern two on member 0
    // alone, and records that member 1 missed regions 0 and 1.
    drop(tb);
    let two: Vec<u8> = pattern(2 << 20).iter().map(|b| b ^ 0x5a).collect();
    let src2 = dir.file("two.bin");
    std::fs::write(&src2, &two).unwrap();
    let o = run(&["copy", "--no-progress", &src2, &vol]);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{log}");
    assert!(log.contains("starts degraded"), "{log}");
    assert_eq!(dirty_of(1), serde_json::json!([[0, 1]]));
    // A new process that can reach only the stale member refuses to serve it.
    drop(ta);
    tb = m.start(1);
    let o = run(&["copy", "--no-progress", &vol, &dir.file("refused.bin")]);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "a stale member alone must not be read: {log}"
    );
    assert!(
        log.contains("no member holds every write") && log.contains("member 1"),
        "{log}"
    );
    // Both back: reads come from member 0 while member 1 gets regions 0 and 1 copied.
    ta = m.start(0);
    let out = dir.file("out.bin");
    let o = run(&["copy", "--no-progress", &vol, &out]);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{log}");
    assert!(log.contains("before this process started"), "{log}");
    let got = std::fs::read(&out).unwrap();
    assert!(
        got[..2 << 20] == two[..],
        "the first 2 MiB are the writes member 1 missed"
    );
    assert!(got[2 << 20..] == one[2 << 20..]);
    // Given a moment (reads over the volume for 3 s), member 1 is in sync and the record clean.
    let o = run(&[
        "bench",
        &vol,
        "--rw",
        "randread",
        "--bs",
        "64KiB",
        "--size",
        "1MiB",
        "--runtime",
        "3",
    ]);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{log}");
    assert_eq!(dirty_of(1), serde_json::json!([]), "{log}");
    drop((ta, tb));
    let (a, b) = (std::fs::read(&fa).unwrap(), std::fs::read(&fb).unwrap());
    assert!(a == b, "the members differ after the resync");
}

/// A mirror process killed while a write was in flight may leave its members different there:
/// one took the write, the other did not. The write-intent record names every region a write
/// is going out to before it goes, so a process killed while writing leaves them named (a clean
/// stop leaves none), and the next start copies those regions from one member to the others
/// before they serve them. The difference is laid out by hand: after the kill, member 1's file
/// is changed in a named region, as if it had missed the last write there.
#[test]
fn a_mirror_killed_mid_write_makes_its_members_agree_at_the_next_start() {
    let dir = Scratch::new("intent");
    let (m, ta, tb) = FileMirror::new(&dir, "layout = \"mirror\"\nbitmap = \"m.bitmap\"");
    let [fa, fb] = m.files.clone();
    let vol = m.vol.clone();
    let bitmap = dir.file("m.bitmap");
    let record = || -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(&bitmap).unwrap()).unwrap()
    };
    let src = dir.file("one.bin");
    std::fs::write(&src, pattern(16 << 20)).unwrap();
    assert!(run(&["copy", "--no-progress", &src, &vol]).status.success());
    // A clean stop names nothing.
    assert_eq!(record()["writing"], serde_json::json!([]));
    // Killed while writing at random over all 16 regions of 1 MiB.
    let mut bench = verified_writes(&vol, "8", "16MiB", "30");
    std::thread::sleep(std::time::Duration::from_secs(3));
    bench.kill().unwrap();
    bench.wait().unwrap();
    let named = record()["writing"].clone();
    let first = named[0][0]
        .as_u64()
        .unwrap_or_else(|| panic!("nothing named: {named}"));
    assert_eq!(record()["members"][1]["dirty"], serde_json::json!([]));
    drop((ta, tb));
    // Member 1 "missed" the last write to a named region.
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&fb).unwrap();
        f.seek(SeekFrom::Start((first << 20) + 4096)).unwrap();
        f.write_all(&[0xee; 8192]).unwrap();
    }
    let held = std::fs::read(&fa).unwrap();
    assert!(held != std::fs::read(&fb).unwrap());
    let (ta, tb) = (m.start(0), m.start(1));
    // The next start reads the named regions from member 0 only, and copies them to member 1
    // (reads for 3 s give it the time).
    let out = dir.file("out.bin");
    let o = run(&["copy", "--no-progress", &vol, &out]);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{log}");
    assert!(
        log.contains("were being written when the mirror last stopped"),
        "{log}"
    );
    assert!(
        std::fs::read(&out).unwrap() == held,
        "a read of region {first} came from member 1"
    );
    // The copy of the named regions to member 1 runs in the background of whichever run has
    // the volume open: it may end during the read above (a slow read), or need reads of 3 s
    // after it, more than one round on a loaded machine (each start copies what is still
    // named, and says so when it is done).
    let mut logs = log.to_string();
    for _ in 0..5 {
        if logs.contains("back in sync") {
            break;
        }
        let o = run(&[
            "bench",
            &vol,
            "--rw",
            "randread",
            "--bs",
            "64KiB",
            "--size",
            "1MiB",
            "--runtime",
            "3",
        ]);
        let log = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{log}");
        logs.push_str(&log);
    }
    assert!(logs.contains("back in sync"), "{logs}");
    assert_eq!(record()["writing"], serde_json::json!([]));
    assert_eq!(record()["members"][1]["dirty"], serde_json::json!([]));
    drop((ta, tb));
    assert!(
        std::fs::read(&fa).unwrap() == std::fs::read(&fb).unwrap(),
        "the members differ after the start that copied the regions being written"
    );
}

/// The write-intent record lets a region go once no write has touched it for a sweep period
/// (5 s) and none is in flight; until then, and while writes go on, it stays named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_write_intent_record_lets_idle_regions_go() {
    use mcsi_initiator::volume::{Layout, MemberSpec, Volume, VolumeSpec};
    let dir = Scratch::new("intent-sweep");
    let (m, ta, tb) = FileMirror::new(&dir, "");
    let bitmap = dir.file("m.bitmap");
    let writing = || -> serde_json::Value {
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&bitmap).unwrap()).unwrap();
        v["writing"].clone()
    };
    let v = Volume::open(&VolumeSpec {
        layout: Layout::Mirror,
        members: m
            .ports
            .iter()
            .map(|p| MemberSpec {
                url: format!("iscsi://127.0.0.1:{p}/{IQN}/0").parse().unwrap(),
                options: mcsi_initiator::ConnectOptions::default(),
            })
            .collect(),
        bitmap: Some(bitmap.clone().into()),
        resync_rate: None,
        reads: Default::default(),
    })
    .await
    .unwrap();
    assert_eq!(writing(), serde_json::json!([]));
    let block = bytes::Bytes::from(vec![3u8; 4096]);
    // Regions 3 and 9, of 1 MiB each.
    let per = (1u64 << 20) / u64::from(v.block_size());
    v.write(3 * per, block.clone()).await.unwrap();
    v.write(9 * per + 1, block.clone()).await.unwrap();
    assert_eq!(writing(), serde_json::json!([[3, 3], [9, 9]]));
    // Region 3 keeps being written; region 9 is left alone.
    let t0 = std::time::Instant::now();
    while t0.elapsed() < std::time::Duration::from_secs(12) {
        v.write(3 * per + 2, block.clone()).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert_eq!(writing(), serde_json::json!([[3, 3]]));
    // Idle for two periods: nothing is named.
    tokio::time::sleep(std::time::Duration::from_secs(11)).await;
    assert_eq!(writing(), serde_json::json!([]));
    v.logout().await;
    drop((ta, tb));
}

/// A mirror of two LUNs of one target, member 0 over a 40 Mbit/s 2 ms route and member 1 over
/// a 4 Mbit/s 20 ms one (`mcsi link run`, routes by source address): 64 KiB random reads at
/// depth 8 for 4 s, once with reads = "soonest" and once with "least-busy". Returns the two
/// bench JSONs.
fn mirror_reads_over_unequal_routes(
    dir: &Scratch,
) -> Option<(serde_json::Value, serde_json::Value)> {
    if !common::runs(
        "mirror_reads_over_unequal_routes",
        mcsi_link::run::missing_privileges(),
    ) {
        return None;
    }
    let port = common::free_port().to_string();
    let target = format!(
        "{} target --listen \"$MCSI_LINK_PEER:{port}\" --iqn {IQN} --lun ram:32MiB --lun ram:32MiB",
        mcsi()
    );
    let d = dir.0.to_string_lossy();
    let mut script = "set -e; ".to_string();
    for reads in ["soonest", "least-busy"] {
        script.push_str(&format!(
            "printf 'layout = \"mirror\"\\nreads = \"{reads}\"\\n[[member]]\\nurl = \"iscsi://%s:{port}/{IQN}/0\"\\nbind = [\"%s\"]\\n[[member]]\\nurl = \"iscsi://%s:{port}/{IQN}/1\"\\nbind = [\"%s\"]\\n' \
               \"$MCSI_LINK_PEER\" \"$MCSI_LINK_ADDR_0\" \"$MCSI_LINK_PEER\" \"$MCSI_LINK_ADDR_1\" > {d}/{reads}.toml; \
             {mcsi} bench volume:{d}/{reads}.toml --rw randread --bs 64KiB --iodepth 8 --size 8MiB --runtime 4 --json > {d}/{reads}.json; ",
            mcsi = mcsi()
        ));
    }
    let args = [
        "link",
        "run",
        "--path",
        "rate=40mbit,delay=2ms",
        "--path",
        "rate=4mbit,delay=20ms",
        "--path-by",
        "source",
        "--host",
        &target,
        "--host-wait",
        &port,
        "--",
        "sh",
        "-c",
        &script,
    ];
    let out = Command::new(mcsi()).args(args).output().unwrap();
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{out:?}");
    let json = |name: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(dir.file(name)).unwrap()).unwrap()
    };
    Some((json("soonest.json"), json("least-busy.json")))
}

#[test]
fn a_mirror_reads_where_a_read_completes_first() {
    let dir = Scratch::new("reads");
    let Some((soonest, least_busy)) = mirror_reads_over_unequal_routes(&dir) else {
        return;
    };
    let share = |v: &serde_json::Value| {
        let m = &v["mcsi"]["volume"]["members"];
        let (a, b) = (
            m[0]["tasks"].as_f64().unwrap(),
            m[1]["tasks"].as_f64().unwrap(),
        );
        a / (a + b).max(1.0)
    };
    let figures = |v: &serde_json::Value| {
        let r = &v["jobs"][0]["read"];
        format!(
            "{:.2} MB/s, mean {:.1} ms, p99 {:.1} ms, {:.0}% of reads on the fast route",
            r["bw_bytes"].as_f64().unwrap() / 1e6,
            r["clat_ns"]["mean"].as_f64().unwrap() / 1e6,
            r["clat_ns"]["percentile"]["99.000000"].as_f64().unwrap() / 1e6,
            share(v) * 100.0
        )
    };
    eprintln!("soonest:    {}", figures(&soonest));
    eprintln!("least-busy: {}", figures(&least_busy));
    for v in [&soonest, &least_busy] {
        assert_eq!(v["jobs"][0]["error"], 0, "{v}");
    }
    // The slow route has a tenth of the rate and ten times the delay: a read waiting behind
    // several on the fast member still finishes before one sent to the slow member, so nearly
    // every read goes to the fast one. Counting commands in flight keeps the slow member busy.
    assert!(
        share(&soonest) > share(&least_busy) && share(&soonest) > 0.9,
        "soonest {} vs least-busy {}",
        share(&soonest),
        share(&least_busy)
    );
}

/// A paths volume: one file served by two targets (two gateways onto shared storage). Verified
/// random writes and reads run through the volume while the preferred target (member 0) is
/// killed: the commands go on through the other, and nothing read back differs from what was
/// written.
#[test]
fn a_paths_volume_is_one_lun_through_two_targets_and_outlives_one() {
    let dir = Scratch::new("paths");
    let shared = dir.file("shared.img");
    let lun = format!("file:{shared}:16MiB");
    let ta = LocalTarget::start(mcsi(), IQN, &lun);
    let tb = LocalTarget::start(mcsi(), IQN, &lun);
    let vol = spec(&dir, "p.toml", "layout = \"paths\"", &[&ta, &tb]);
    // Written through the volume, read through member 1's target directly: one LUN.
    let src = dir.file("src.bin");
    let data = pattern(4 << 20);
    std::fs::write(&src, &data).unwrap();
    assert!(run(&["copy", "--no-progress", &src, &vol]).status.success());
    assert!(read_member(&tb, &dir, "b.bin", "4MiB") == data);
    let bench = verified_writes(&vol, "4", "4MiB", "8");
    std::thread::sleep(std::time::Duration::from_secs(1));
    drop(ta);
    let out = bench.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    eprintln!("{log}");
    drop(tb);
    assert!(out.status.success(), "{log}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"][0]["error"], 0, "{v}");
    assert_eq!(v["mcsi"]["verify"]["errors"], 0, "{v}");
    assert_eq!(v["mcsi"]["volume"]["layout"], "paths", "{v}");
    assert_eq!(v["mcsi"]["volume"]["members"][0]["failed"], true, "{v}");
    assert!(log.contains("goes on degraded"), "{log}");
    // Every I/O went through one member or the other, and every one after the kill (1 s
    // into 8) through member 1: it carried most of the bytes.
    let member = |i: usize| {
        v["mcsi"]["volume"]["members"][i]["bytes"]
            .as_u64()
            .unwrap_or(0)
    };
    let io = |rw: &str| v["jobs"][0][rw]["io_bytes"].as_u64().unwrap_or(0);
    let total = io("write") + io("read");
    assert!(total > 0, "{v}");
    assert!(member(0) + member(1) >= total, "{v}");
    assert!(
        member(1) * 2 >= total,
        "member 1 carried {} of {total} bytes: {v}",
        member(1)
    );
}

/// Two different LUNs are not one LUN through two paths: refused at open, with why.
#[test]
fn a_paths_volume_of_two_different_luns_is_refused() {
    let dir = Scratch::new("paths-refused");
    let ta = LocalTarget::start(mcsi(), IQN, "ram:8MiB");
    let tb = LocalTarget::start(mcsi(), "iqn.2026-01.org.mcsi:another", "ram:8MiB");
    let p = dir.file("p.toml");
    std::fs::write(
        &p,
        format!(
            "layout = \"paths\"\n[[member]]\nurl = \"{}\"\n[[member]]\nurl = \"{}\"\n",
            ta.url(IQN),
            tb.url("iqn.2026-01.org.mcsi:another")
        ),
    )
    .unwrap();
    let o = run(&["bench", &format!("volume:{p}"), "--runtime", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("is another logical unit"), "{err}");
}

/// A paths volume's SYNCHRONIZE CACHE answers for the writes each member acknowledged: they
/// may sit in that gateway's cache only. A member lost after a flush covered its writes costs
/// nothing; one lost with writes no flush had covered makes the next flush fail, once, and the
/// volume goes on through the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paths_flush_fails_once_for_writes_lost_with_a_member() {
    use mcsi_initiator::volume::{Layout, MemberSpec, Volume, VolumeSpec};
    let dir = Scratch::new("paths-flush");
    let lun = format!("file:{}:16MiB", dir.file("shared.img"));
    let mut targets: Vec<Option<LocalTarget>> = (0..3)
        .map(|_| Some(LocalTarget::start(mcsi(), IQN, &lun)))
        .collect();
    let members = targets
        .iter()
        .flatten()
        .map(|t| MemberSpec {
            url: t.url(IQN).parse().unwrap(),
            options: mcsi_initiator::ConnectOptions::default(),
        })
        .collect();
    let v = Volume::open(&VolumeSpec {
        layout: Layout::Paths,
        members,
        bitmap: None,
        resync_rate: None,
        reads: Default::default(),
    })
    .await
    .unwrap();
    let block = bytes::Bytes::from(vec![7u8; 4096]);
    // Member 0 takes the writes; a flush covers them; it dies: nothing was at risk.
    v.write(0, block.clone()).await.unwrap();
    v.flush().await.unwrap();
    targets[0] = None;
    v.write(8, block.clone()).await.unwrap();
    v.flush().await.unwrap();
    // Member 1 took that write and the next, without a flush since: it dies.
    v.write(16, block.clone()).await.unwrap();
    targets[1] = None;
    v.write(24, block.clone()).await.unwrap();
    let e = v.flush().await.unwrap_err();
    assert!(e.to_string().contains("may be gone"), "{e}");
    // Reported once; member 2 goes on.
    v.flush().await.unwrap();
    assert_eq!(v.read(24, 8).await.unwrap(), block);
    let failed: Vec<bool> = v.member_states().iter().map(|m| m.failed).collect();
    assert_eq!(failed, [true, true, false]);
}

/// Whether `b`, the 64 KiB at byte `off` of a volume, reads back whole: `initial`, what it held
/// at first (never written since), or a block of `mcsi bench --verify` (its header: magic, LBA,
/// generation, length, then a CRC32C over the block with that field zero) written for this
/// place.
fn verify_block_ok(b: &[u8], off: u64, initial: &[u8]) -> bool {
    if b == initial {
        return true;
    }
    if b.len() < 32 || &b[0..8] != b"mcsiVRFY" {
        return false;
    }
    let lba = u64::from_le_bytes(b[8..16].try_into().unwrap());
    let len = u32::from_le_bytes(b[24..28].try_into().unwrap());
    let crc = u32::from_le_bytes(b[28..32].try_into().unwrap());
    let mut z = b.to_vec();
    z[28..32].fill(0);
    len as usize == b.len()
        && (lba * 512 == off || lba * 4096 == off)
        && mcsi_proto::digest::crc32c(&z) == crc
}

/// The mirror under fire: two file-backed members under a verified random-write workload
/// while their targets are killed (SIGKILL) and restarted at random, one at a time, each kill
/// once the volume has brought the last one back in sync. At the end the two member files are
/// byte-identical and the workload read back every write it made.
///
/// The volume's own process (the workload) is killed (SIGKILL) twice too, mid-write, and
/// started again from its bitmap: the regions its write-intent record names are copied from
/// one member to the other at the next start. What a killed process had acknowledged cannot
/// be witnessed from outside it; its writes are checked as blocks that read back whole (each
/// block's verify header names its own LBA and checksum) and as members that agree at the end.
///
/// Long (MCSI_MIRROR_STRESS_SECS, default 600 s): run by hand with
/// `cargo test --release -p mcsi --test volume -- --ignored mirror_under_fire --nocapture`.
#[test]
#[ignore = "long: ten minutes of target kills; run by hand (see its doc)"]
fn mirror_under_fire() {
    use std::io::BufRead;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};
    let secs: u64 = std::env::var("MCSI_MIRROR_STRESS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let mut seed: u64 = std::env::var("MCSI_MIRROR_STRESS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("mirror under fire: {secs} s, seed {seed}");
    let mut rand = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let dir = Scratch::new("fire");
    let (m, ta, tb) = FileMirror::new(&dir, "layout = \"mirror\"\nbitmap = \"m.bitmap\"");
    let src = dir.file("src.bin");
    std::fs::write(&src, pattern(16 << 20)).unwrap();
    assert!(run(&["copy", "--no-progress", &src, &m.vol])
        .status
        .success());
    let log = Arc::new(Mutex::new(Vec::<String>::new()));
    let workload = |runtime: u64| {
        let mut bench = verified_writes(&m.vol, "8", "16MiB", &runtime.to_string());
        let (log, err) = (log.clone(), bench.stderr.take().unwrap());
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                log.lock().unwrap().push(line);
            }
        });
        (bench, reader)
    };
    let (mut bench, mut reader) = workload(secs);
    // The volume's process is killed at about a third and two thirds of the kills' time.
    let window = secs.saturating_sub(40);
    let mut volume_kills_at: Vec<Duration> = [window / 3, 2 * window / 3]
        .iter()
        .map(|&at| Duration::from_millis(at * 1000 + rand(3000)))
        .collect();
    let mut volume_kills = 0;
    let count = |log: &Mutex<Vec<String>>, what: &str| {
        log.lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(what))
            .count()
    };
    let synced = |log: &Mutex<Vec<String>>| count(log, "back in sync");
    let failed = |log: &Mutex<Vec<String>>| count(log, "goes on degraded");
    let mut targets = [Some(ta), Some(tb)];
    let t0 = Instant::now();
    let mut kills = 0;
    // Stop killing early enough for the last one to come back before the workload ends.
    while t0.elapsed() + Duration::from_secs(40) < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(1000 + rand(3000)));
        if volume_kills_at
            .first()
            .is_some_and(|&at| t0.elapsed() >= at)
        {
            volume_kills_at.remove(0);
            bench.kill().unwrap();
            bench.wait().unwrap();
            reader.join().unwrap();
            volume_kills += 1;
            log.lock()
                .unwrap()
                .push(format!("(test) volume process killed, {volume_kills}"));
            let left = secs.saturating_sub(t0.elapsed().as_secs()).max(45);
            (bench, reader) = workload(left);
            continue;
        }
        let i = rand(2) as usize;
        targets[i] = None;
        kills += 1;
        std::thread::sleep(Duration::from_millis(500 + rand(4000)));
        targets[i] = Some(m.start(i));
        // Either its session rides through (it logs in again within its own retries) or it
        // gives up, the volume fails the member, tries it again and copies what it missed:
        // every failure is back in sync before the other one is killed.
        std::thread::sleep(Duration::from_secs(5));
        let wait = Instant::now();
        while synced(&log) < failed(&log) {
            assert!(
                wait.elapsed() < Duration::from_secs(60),
                "member {i} was not back in sync 60 s after its target restarted (kill {kills})"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let status = bench.wait().unwrap();
    reader.join().unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(bench.stdout.as_mut().unwrap(), &mut out).unwrap();
    let log = log.lock().unwrap().join("\n");
    assert!(status.success(), "{log}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["jobs"][0]["error"], 0, "{v}");
    assert_eq!(v["mcsi"]["verify"]["errors"], 0, "{v}");
    let resyncs: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("back in sync"))
        .filter_map(|l| {
            l.split("bytes=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    let (a, b) = (
        std::fs::read(&m.files[0]).unwrap(),
        std::fs::read(&m.files[1]).unwrap(),
    );
    let failures = log
        .lines()
        .filter(|l| l.contains("goes on degraded"))
        .count();
    let unsettled = log
        .lines()
        .filter(|l| l.contains("were being written when the mirror last stopped"))
        .count();
    // Every 64 KiB block reads back whole: its verify header names its own LBA and checksum.
    let out = dir.file("whole.bin");
    let o = run(&["copy", "--no-progress", &m.vol, &out]);
    assert!(o.status.success());
    drop(targets);
    let whole = std::fs::read(&out).unwrap();
    let initial = pattern(16 << 20);
    let torn: Vec<usize> = whole
        .chunks(64 << 10)
        .zip(initial.chunks(64 << 10))
        .enumerate()
        .filter(|(i, (c, init))| !verify_block_ok(c, (*i as u64) << 16, init))
        .map(|(i, _)| i)
        .collect();
    println!(
        "{kills} target kills and {volume_kills} volume kills in {:.0} s ({failures} failed a member, the others its session rode through; {unsettled} starts copied regions being written); {} resyncs copied {} MiB; {} verified writes in the last run; torn blocks: {}; members identical: {}",
        t0.elapsed().as_secs_f64(),
        resyncs.len(),
        resyncs.iter().sum::<u64>() >> 20,
        v["jobs"][0]["write"]["total_ios"],
        torn.len(),
        a == b
    );
    assert!(kills >= 1);
    assert_eq!(volume_kills, 2);
    assert!(torn.is_empty(), "blocks {torn:?} do not read back whole");
    assert!(a == b, "the members differ after {kills} kills");
}
