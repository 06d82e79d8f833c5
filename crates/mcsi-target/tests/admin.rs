//! Live administration of a running server (what `mcsi ctl` asks): listing its targets and
//! sessions, and ending a session with an Async Message that asks for a logout.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use mcsi_proto::pdu::Pdu;
use mcsi_target::admin::{AdminError, Ended};
use std::time::{Duration, Instant};

/// Reads until the Async Message; returns its event and Parameter3.
async fn async_message(c: &mut Client) -> (u8, u16, u32) {
    loop {
        if let Pdu::AsyncMessage(m) = c.recv().await {
            return (m.async_event, m.parameter3, m.stat_sn);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_session_is_asked_to_log_out_and_goes_when_it_does() {
    let server = start(|_| {}).await;
    let admin = server.admin();
    let mut a = Client::normal(&server, &[]).await;
    let (mut a2, _) = Client::join(&server, &a, 1).await;
    let b = Client::normal_isid(&server, [0x80, 0, 0, 0, 0, 9], &[]).await;
    let listed = admin.sessions();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(listed[0].connections.len(), 2);
    let t = admin.targets();
    assert_eq!(t[0].sessions, 2);
    assert_eq!(t[0].luns.len(), 1);

    let tsih = a.tsih;
    let ending = {
        let admin = admin.clone();
        tokio::spawn(async move { admin.end_session(tsih, Duration::from_secs(5)).await })
    };
    // Each connection is asked (AsyncEvent 1, Parameter3 the seconds it has), with a StatSN.
    assert_eq!(async_message(&mut a).await.0, 1);
    let (event, secs, _) = async_message(&mut a2).await;
    assert_eq!((event, secs), (1, 5));
    let t0 = Instant::now();
    let r = a.logout(0, 0).await;
    assert_eq!(r.response, 0, "the logout is accepted");
    // As an initiator does after a Logout Response: its connections close.
    drop(a);
    drop(a2);
    assert_eq!(ending.await.unwrap(), Ok(Ended::LoggedOut));
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "it went when it logged out, not at the grace's end"
    );
    // The other session was not touched.
    let left = admin.sessions();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].tsih, b.tsih);
    assert_eq!(
        admin.end_session(tsih, Duration::from_secs(1)).await,
        Err(AdminError::NoSession(tsih))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_does_not_log_out_is_dropped_at_the_end_of_its_grace() {
    let server = start(|_| {}).await;
    let admin = server.admin();
    let mut a = Client::normal(&server, &[]).await;
    let t0 = Instant::now();
    let ending = {
        let admin = admin.clone();
        let tsih = a.tsih;
        tokio::spawn(async move { admin.end_session(tsih, Duration::from_secs(1)).await })
    };
    assert_eq!(async_message(&mut a).await.0, 1);
    // The initiator ignores it.
    assert!(
        a.closed_by_target().await,
        "the target drops the connection"
    );
    assert_eq!(ending.await.unwrap(), Ok(Ended::Dropped));
    assert!(t0.elapsed() >= Duration::from_secs(1));
    assert!(admin.sessions().is_empty());
}
