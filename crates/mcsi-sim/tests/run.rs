#![allow(clippy::unwrap_used, clippy::expect_used)]

//! Whole simulated runs: the protocol cores over smoltcp and the link models, checked against
//! what the link allows and against each other.

use mcsi_link::{LinkConfig, PathBy, PathConfig};
use mcsi_sim::initiator::{Rw, Workload};
use mcsi_sim::net::{Congestion, TcpConfig, TcpStack};
use mcsi_sim::{Report, Scenario};
use std::time::Duration;

fn scenario(link: &str, rw: Rw, bs: u32, iodepth: u32, conns: usize, secs: u64) -> Scenario {
    let mut path = PathConfig::default();
    path.apply_spec(link).unwrap();
    Scenario {
        link: LinkConfig {
            paths: vec![path],
            path_by: PathBy::Port,
            seed: 1,
        },
        tcp: TcpConfig {
            stack: TcpStack::Linuxlike,
            congestion: Congestion::Cubic,
            buffer: 4 << 20,
            mtu: 1500,
        },
        initiators: 1,
        connections: conns,
        policy: "round-robin".into(),
        work: Workload {
            rw,
            bs,
            iodepth,
            runtime: Duration::from_secs(secs),
            blocks: u64::MAX,
        },
        lun: "ram:64MiB".into(),
        disk: None,
        pdu: None,
        seed: 1,
    }
}

fn csv(r: &Report) -> String {
    let mut v = Vec::new();
    r.write_csv(&mut v).unwrap();
    String::from_utf8(v).unwrap()
}

fn ok(s: &Scenario) -> Report {
    let r = mcsi_sim::run(s).unwrap();
    for x in &r.sessions {
        assert!(x.failure.is_none(), "{x:?}");
        assert_eq!(x.errors, 0, "{x:?}");
        assert!(x.ios > 0, "{x:?}");
    }
    r
}

#[test]
fn the_same_scenario_gives_the_same_csv() {
    // Loss in bursts, jitter, two connections and several initiators: every random draw
    // (link, TCP initial sequence numbers, offsets) comes from the scenario's seeds.
    let mut s = scenario(
        "rate=20mbit,delay=10ms,jitter=2ms,loss-ge=2%/20%/100%/0%",
        Rw::RandRead,
        16 << 10,
        4,
        2,
        3,
    );
    s.initiators = 3;
    let a = ok(&s);
    let b = ok(&s);
    assert_eq!(csv(&a), csv(&b));
    assert_eq!(a.packets, b.packets);
    assert!(
        a.drops[0] + a.drops[1] > 0,
        "the loss model dropped packets"
    );
    // Another seed draws other losses.
    s.link.seed = 2;
    let c = ok(&s);
    assert_ne!(csv(&a), csv(&c));
}

#[test]
fn bulk_reads_fill_the_link() {
    // 100 Mbit/s carry at most 12.5 MB/s of IP packets; TCP/IP headers (40 of 1500 bytes) and
    // iSCSI's (48 bytes per 256 KiB Data-In) leave 12.16 MB/s of data.
    let r = ok(&scenario(
        "rate=100mbit,delay=5ms",
        Rw::Read,
        128 << 10,
        8,
        1,
        5,
    ));
    let bw = r.sessions[0].bw_mbs;
    assert!((11.5..=12.17).contains(&bw), "{bw} MB/s");
}

#[test]
fn one_read_at_a_time_takes_a_round_trip() {
    // 10 ms of round trip and no rate limit: each 4 KiB read costs the round trip and nothing
    // visible beyond it (the stacks run in no time).
    let r = ok(&scenario("delay=5ms", Rw::Read, 4096, 1, 1, 2));
    let x = &r.sessions[0];
    assert!((10.0..10.1).contains(&x.lat_mean_ms), "{x:?}");
    // Login: the TCP handshake, then two Login Request/Response exchanges (security
    // negotiation, then operational negotiation).
    assert!((30.0..30.5).contains(&x.login_ms), "{x:?}");
}

#[test]
fn writes_beyond_the_first_burst_are_asked_for_with_r2ts() {
    // 1 MiB writes: 256 KiB go unsolicited (the target's FirstBurstLength), the rest is asked
    // for in R2Ts.
    let r = ok(&scenario(
        "rate=200mbit,delay=1ms",
        Rw::Write,
        1 << 20,
        2,
        2,
        2,
    ));
    let x = &r.sessions[0];
    // One R2T per write for its last 768 KiB (within MaxBurstLength); writes still in flight
    // at the end (at most 2 connections x depth 2) may have had theirs too.
    assert!(
        (x.ios..=x.ios + 4).contains(&r.target.r2ts),
        "{:?} {x:?}",
        r.target
    );
    // The link's 25 MB/s, less TCP/IP and iSCSI headers and the R2T round trips (the
    // simulation is deterministic: 21.5 MB/s).
    assert!((20.0..25.0).contains(&x.bw_mbs), "{x:?}");
    // The control: writes within the first burst are never asked for.
    let r = ok(&scenario(
        "rate=200mbit,delay=1ms",
        Rw::Write,
        256 << 10,
        2,
        2,
        2,
    ));
    assert_eq!(r.target.r2ts, 0, "{:?}", r.target);
    assert!(r.sessions[0].ios > 0);
}

#[test]
fn sessions_share_a_bottleneck_fairly() {
    // The queue holds what the four sessions keep in flight (1 MiB): nothing is lost, and the
    // link is shared evenly.
    let mut s = scenario(
        "rate=50mbit,delay=10ms,queue=1000p",
        Rw::Read,
        64 << 10,
        4,
        1,
        10,
    );
    s.initiators = 4;
    let r = ok(&s);
    let total: f64 = r.sessions.iter().map(|x| x.bw_mbs).sum();
    assert_eq!(r.drops, [0, 0]);
    assert!(total > 5.9 && total <= 6.1, "{total} MB/s");
    assert!(r.fairness > 0.98, "{}", r.fairness);
}

#[test]
fn the_pdu_size_sets_how_reads_and_writes_are_cut() {
    // 64 KiB reads in 8 KiB PDUs: 8 Data-In each; without it, one (the initiator takes 256 KiB).
    // Besides the reads the target sees a command without data and READ CAPACITY (one
    // Data-In).
    let mut s = scenario("rate=100mbit,delay=1ms", Rw::Read, 64 << 10, 2, 1, 1);
    let whole = ok(&s);
    assert_eq!(whole.target.data_in, 1 + (whole.target.commands - 2));
    s.pdu = Some(8192);
    let cut = ok(&s);
    assert_eq!(
        cut.target.data_in,
        1 + 8 * (cut.target.commands - 2),
        "{:?}",
        cut.target
    );
    // And writes: the target takes 8 KiB per Data-Out, so its R2Ts ask for the rest after
    // the first burst.
    s.work.rw = Rw::Write;
    let w = ok(&s);
    assert!(w.sessions[0].ios > 0 && w.sessions[0].errors == 0);
    s.pdu = Some(100);
    assert!(mcsi_sim::run(&s).is_err());
}

#[test]
fn three_hundred_initiators_share_one_target() {
    // Every session logs in, moves data, and none is starved; the link is full. (Each event
    // runs only the hosts and connections that have something to do, so that this costs what
    // its packets cost.)
    let mut s = scenario(
        "rate=1gbit,delay=1ms,queue=5000p",
        Rw::Read,
        64 << 10,
        2,
        1,
        2,
    );
    s.initiators = 300;
    let r = ok(&s);
    assert_eq!(r.sessions.len(), 300);
    assert!(r.sessions.iter().all(|x| x.ios > 0 && x.failure.is_none()));
    let total: f64 = r.sessions.iter().map(|x| x.bw_mbs).sum();
    assert!(total > 110.0 && total <= 125.0, "{total} MB/s");
    assert!(r.fairness > 0.8, "{}", r.fairness);
}

#[test]
fn smoltcp_and_the_simulators_tcp_agree_without_loss() {
    // Two independent TCPs under the same cores and link: on a lossless link they must give
    // the same figures within the difference of their segment sizes (smoltcp has no
    // timestamps: 1460 against 1448 bytes).
    let mut s = scenario("rate=20mbit,delay=10ms", Rw::Read, 64 << 10, 4, 2, 5);
    let own = ok(&s).bw_mbs;
    s.tcp.stack = TcpStack::Smoltcp;
    let smol = ok(&s).bw_mbs;
    assert!((own / smol - 1.0).abs() < 0.02, "{own} against {smol}");
    assert!(own > 2.3, "{own}");
}

#[test]
fn seed_001s_disks_set_the_pace_of_random_reads() {
    // One Cheetah 9LP: a random 4 KiB read costs a seek, half a turn and the transfer (about
    // 8.5 ms), whatever the link adds; eight drives striped serve eight at once.
    let mut s = scenario("rate=1gbit,delay=100us", Rw::RandRead, 4096, 1, 1, 5);
    s.disk = Some(mcsi_sim::disk::DiskConfig::seed_001(1));
    let one = ok(&s);
    let lat = one.sessions[0].lat_mean_ms;
    assert!((7.5..10.0).contains(&lat), "{lat} ms");
    let d = one.disk.unwrap();
    assert!(d.requests >= one.sessions[0].ios, "{d:?}");
    s.work.iodepth = 8;
    s.disk = Some(mcsi_sim::disk::DiskConfig::seed_001(8));
    let eight = ok(&s);
    assert!(
        eight.iops > 3.0 * one.iops,
        "{} against {}",
        eight.iops,
        one.iops
    );
    // Sequential reads meet the drive's read-ahead.
    s.work.rw = Rw::Read;
    s.work.iodepth = 1;
    s.disk = Some(mcsi_sim::disk::DiskConfig::seed_001(1));
    let seq = ok(&s);
    assert!(
        seq.iops > 5.0 * one.iops,
        "{} against {}",
        seq.iops,
        one.iops
    );
}

#[test]
fn a_link_without_delay_or_rate_runs_without_waiting_for_timers() {
    // Packets arrive the instant they leave: the loop must take them in at once, not at the
    // next delayed ACK or keepalive.
    let r = ok(&scenario("", Rw::Read, 4096, 1, 1, 1));
    let x = &r.sessions[0];
    assert!(x.lat_mean_ms < 0.1, "{x:?}");
    assert!(x.ios > 10_000, "{x:?}");
}
