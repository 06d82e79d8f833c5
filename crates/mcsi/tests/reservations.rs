//! Persistent reservations made with APTPL survive the target's process killed with SIGKILL:
//! `mcsi target --state-dir` writes them before it answers GOOD and reads them back at start.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use bytes::Bytes;
use common::*;
use mcsi_initiator::{connect, session::reinstate, Command, ConnectOptions, DataDir, IscsiUrl};
use std::path::Path;
use std::process::{Child, Command as Proc, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_mcsi");
const IQN: &str = "iqn.2026-01.org.mcsi:target";

/// `mcsi target` on `port` with a file LUN, and a state directory when `state` is given.
fn spawn(port: u16, state: Option<&Path>, img: &Path) -> Child {
    let mut cmd = Proc::new(BIN);
    cmd.args(["target", "--listen", &format!("127.0.0.1:{port}")]);
    if let Some(dir) = state {
        cmd.arg("--state-dir").arg(dir);
    }
    let child = cmd
        .arg("--lun")
        .arg(format!("file:{}:16MiB", img.display()))
        .env("MCSI_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(port);
    child
}

fn options(name: &str) -> ConnectOptions {
    ConnectOptions {
        initiator_name: name.into(),
        ..ConnectOptions::default()
    }
}

async fn pr_out(
    s: &mcsi_initiator::Session,
    sa: u8,
    ty: u8,
    rk: u64,
    sark: u64,
    aptpl: bool,
) -> u8 {
    let mut p = vec![0u8; 24];
    p[0..8].copy_from_slice(&rk.to_be_bytes());
    p[8..16].copy_from_slice(&sark.to_be_bytes());
    p[20] = u8::from(aptpl);
    let cdb = Bytes::from(vec![0x5f, sa, ty, 0, 0, 0, 0, 0, 24, 0]);
    let r = s
        .execute(Command {
            lun: 0,
            cdb,
            dir: DataDir::Write(Bytes::from(p)),
        })
        .await
        .unwrap();
    r.status
}

/// A command that may meet a unit attention first (power on after the restart): retried.
async fn run(s: &mcsi_initiator::Session, cdb: Vec<u8>, dir: DataDir) -> mcsi_initiator::Response {
    for _ in 0..4 {
        let r = s
            .execute(Command {
                lun: 0,
                cdb: Bytes::from(cdb.clone()),
                dir: dir.clone(),
            })
            .await
            .unwrap();
        if r.status == 2
            && r.sense
                .as_ref()
                .is_some_and(|x| x.key == mcsi_initiator::SenseKey::UnitAttention)
        {
            continue;
        }
        return r;
    }
    panic!("unit attentions without end");
}

/// READ KEYS and READ RESERVATION: (keys, (holder's key, type)).
async fn state(s: &mcsi_initiator::Session) -> (Vec<u64>, Option<(u64, u8)>) {
    let k = run(
        s,
        vec![0x5e, 0, 0, 0, 0, 0, 0, 0x10, 0, 0],
        DataDir::Read(4096),
    )
    .await;
    assert_eq!(k.status, 0);
    let k = k.data;
    let n = u32::from_be_bytes(k[4..8].try_into().unwrap()) as usize / 8;
    let keys = (0..n)
        .map(|i| u64::from_be_bytes(k[8 + 8 * i..16 + 8 * i].try_into().unwrap()))
        .collect();
    let r = run(
        s,
        vec![0x5e, 1, 0, 0, 0, 0, 0, 0x10, 0, 0],
        DataDir::Read(4096),
    )
    .await;
    let r = r.data;
    let res = (u32::from_be_bytes(r[4..8].try_into().unwrap()) == 16).then(|| {
        (
            u64::from_be_bytes(r[8..16].try_into().unwrap()),
            r[21] & 0x0f,
        )
    });
    (keys, res)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aptpl_reservations_survive_sigkill_of_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let (state_dir, img) = (dir.path().join("state"), dir.path().join("lun0.img"));
    let port = free_port();
    let mut target = spawn(port, Some(&state_dir), &img);
    let url: IscsiUrl = format!("iscsi://127.0.0.1:{port}/{IQN}/0").parse().unwrap();
    const HOST_A: &str = "iqn.2026-01.org.mcsi:host-a";
    const HOST_B: &str = "iqn.2026-01.org.mcsi:host-b";
    let a = connect(&url, options(HOST_A)).await.unwrap();
    let isid_a = a.isid();
    let b = connect(&url, options(HOST_B)).await.unwrap();
    // Clear the power-on unit attention of each.
    state(&a).await;
    state(&b).await;
    assert_eq!(pr_out(&a, 0, 0, 0, 0xa1, true).await, 0, "REGISTER, APTPL");
    assert_eq!(pr_out(&b, 0, 0, 0, 0xb2, true).await, 0, "REGISTER, APTPL");
    // WRITE EXCLUSIVE, REGISTRANTS ONLY, held by host A.
    assert_eq!(pr_out(&a, 1, 5, 0xa1, 0, false).await, 0, "RESERVE");
    let before = state(&a).await;
    assert_eq!(before, (vec![0xa1, 0xb2], Some((0xa1, 5))));
    drop(a);
    drop(b);

    // SIGKILL: no shutdown, no flush; then the same target again.
    target.kill().unwrap();
    target.wait().unwrap();
    let mut target = spawn(port, Some(&state_dir), &img);
    let a = reinstate(&url, options(HOST_A), isid_a).await.unwrap();
    assert_eq!(
        state(&a).await,
        before,
        "the keys and the reservation came back"
    );
    // And they are enforced: an initiator that is not registered cannot write.
    let c = connect(&url, options("iqn.2026-01.org.mcsi:host-c"))
        .await
        .unwrap();
    let w = run(
        &c,
        vec![0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0],
        DataDir::Write(Bytes::from(vec![0u8; 512])),
    )
    .await;
    assert_eq!(w.status, 0x18, "RESERVATION CONFLICT");
    let _ = target.kill();
    let _ = target.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_state_dir_aptpl_is_refused() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let mut target = spawn(port, None, &dir.path().join("x.img"));
    let url: IscsiUrl = format!("iscsi://127.0.0.1:{port}/{IQN}/0").parse().unwrap();
    let a = connect(&url, ConnectOptions::default()).await.unwrap();
    state(&a).await;
    let st = pr_out(&a, 0, 0, 0, 0xa1, true).await;
    assert_eq!(
        st, 2,
        "CHECK CONDITION: APTPL is a promise this target cannot keep"
    );
    assert_eq!(state(&a).await, (vec![], None));
    let _ = target.kill();
    let _ = target.wait();
}
