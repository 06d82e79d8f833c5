#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The target over in-process pipes (`Server::serve` with `tokio::io::duplex`): no socket is
//! opened for the connections. The same login, session, MC/S and data paths as over TCP, with
//! mixed transports in one session.

mod common;

use common::*;
use mcsi_proto::pdu::*;

/// Reads `blocks` 512-byte blocks at `lba` through `c`.
async fn read(c: &mut Client, lba: u32, blocks: u16) -> Vec<u8> {
    let len = u32::from(blocks) * 512;
    let r = c.command(
        &rw10(0x28, lba, blocks),
        true,
        false,
        len,
        Default::default(),
        true,
    );
    let itt = r.itt;
    c.send(Pdu::ScsiCommand(r)).await;
    let (back, status, ..) = c.read_result(itt).await;
    assert_eq!(status, 0, "READ(10) at {lba}");
    back
}

/// Writes `blocks` 512-byte blocks at `lba` through `c` and reads them back.
async fn write_read(c: &mut Client, lba: u32, blocks: u16, seed: u8) {
    let data = pattern(usize::from(blocks) * 512, seed);
    let len = data.len() as u32;
    let w = c.command(
        &rw10(0x2a, lba, blocks),
        false,
        true,
        len,
        data.clone(),
        true,
    );
    let itt = w.itt;
    c.send(Pdu::ScsiCommand(w)).await;
    let (_, status, ..) = c.read_result(itt).await;
    assert_eq!(status, 0, "WRITE(10) at {lba}");
    assert_eq!(
        read(c, lba, blocks).await,
        data.to_vec(),
        "data read back at {lba}"
    );
}

#[tokio::test]
async fn a_session_runs_over_in_process_pipes() {
    let server = start(|_| {}).await;
    let mut lead = Client::normal_via(&server, Via::InProcess, [0x80, 1, 2, 3, 4, 5], &[]).await;
    // 64 KiB: the first burst as immediate data, the rest after R2T.
    write_read(&mut lead, 0, 128, 1).await;

    // A second pipe and a TCP connection join the same session; commands on each are ordered
    // by one CmdSN window.
    let (mut pipe2, r) = Client::join_via(&server, Via::InProcess, &lead, 1).await;
    assert_eq!((r.status_class, r.status_detail), (0, 0));
    assert_eq!(r.tsih, lead.tsih);
    let (mut tcp, r) = Client::join_via(&server, Via::Tcp, &lead, 2).await;
    assert_eq!((r.status_class, r.status_detail), (0, 0));
    let snapshot = server.snapshot();
    assert_eq!(snapshot.len(), 1);
    assert_eq!(snapshot[0].connections.len(), 3, "{snapshot:?}");

    pipe2.cmd_sn = lead.cmd_sn;
    write_read(&mut pipe2, 1000, 16, 2).await;
    tcp.cmd_sn = pipe2.cmd_sn;
    write_read(&mut tcp, 2000, 16, 3).await;
    lead.cmd_sn = tcp.cmd_sn;
    // What the pipe wrote, read over TCP.
    assert_eq!(read(&mut tcp, 1000, 16).await, pattern(8192, 2).to_vec());

    // Logging out one pipe leaves the others running.
    pipe2.cmd_sn = tcp.cmd_sn;
    let r = pipe2.logout(1, 1).await;
    assert_eq!(r.response, 0);
    assert!(pipe2.closed_by_target().await);
    lead.cmd_sn = tcp.cmd_sn;
    write_read(&mut lead, 3000, 8, 4).await;

    let r = lead.logout(0, 0).await;
    assert_eq!(r.response, 0);
    assert!(lead.closed_by_target().await);
    assert!(tcp.closed_by_target().await);
}

#[tokio::test]
async fn in_process_connections_count_against_the_server_limit() {
    let server = start_with(|cfg| cfg.limits.max_server_connections = 1).await;
    let _held = Client::normal_via(&server, Via::InProcess, [0x80, 7, 0, 0, 0, 2], &[]).await;
    let (_ours, theirs) = tokio::io::duplex(4096);
    let peer = "127.0.0.2:40001".parse().unwrap();
    assert!(!server.serve(theirs, peer, server.local_addrs()[0]));
}
