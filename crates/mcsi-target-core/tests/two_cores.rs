#![allow(clippy::unwrap_used, clippy::expect_used)]

//! A whole iSCSI session through the two protocol cores on virtual time: no runtime, no sockets,
//! no threads. The initiator is `mcsi-initiator-core` (login machine, session core, timers);
//! the target is mcsi-proto's login machine, this crate's session core and plans, and
//! mcsi-scsi's device server over a RAM LUN. Every PDU goes through the codec with the framing
//! each side negotiated, and the clock only moves when the test says so.
//!
//! The target side's driver below is what the tokio layer (`mcsi-target`'s `conn`, `scsi` and
//! `control` modules) does for one connection, written out synchronously: which core call each
//! PDU becomes (a command goes to `SessionCore::command`, which plans, claims, holds or
//! registers it), running the device when the core hands a task out or a command is to run
//! now, sending what the core made (`poll_transmit`: R2Ts, Data-In, status), stamping StatSN.
//! It is the part of the target that is not yet one machine of the core; it shrinks as that
//! moves in.

use bytes::{Bytes, BytesMut};
use mcsi_initiator_core::core::{
    Action, Command, ConnStart, DataDir, Event, Response, SessionCore as InitiatorCore, Timers,
};
use mcsi_initiator_core::error::Error;
use mcsi_initiator_core::negotiate::{
    Login, LoginConfig, LoginDone, LoginStep, Offers, SessionKind,
};
use mcsi_initiator_core::sched::RoundRobin;
use mcsi_initiator_core::window::CmdWindow;
use mcsi_proto::codes::{logout_reason, logout_response, tmf_function, tmf_response};
use mcsi_proto::keys::{ConnectionParams, LocalParams, SessionType};
use mcsi_proto::login::{
    self as plogin, LoginEnv, LoginNumbers, NoAuth, Refusal, TargetAccess, TargetLogin,
    TargetLoginConfig,
};
use mcsi_proto::pdu::{
    decode, Framing, Isid, LoginRequest, LogoutRequest, Pdu, ScsiCommand, TaskMgmtRequest,
};
use mcsi_proto::vendor::ConnRole;
use mcsi_scsi::{DataPhase, DeviceServer, LogicalUnit, LuConfig, Nexus, Outcome, TaskAttribute};
use mcsi_target_core::control::{Logout, Tmf};
use mcsi_target_core::datain::{read_expected, response_pdus};
use mcsi_target_core::session::{
    Arrival, Close, CoreConn, Expired, Note, OrderedRun, SessionCore, TmfStep,
};
use mcsi_target_core::transfer::BurstParams;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

const INITIATOR: &str = "iqn.2026-01.org.mcsi:two-cores-ini";
const TARGET: &str = "iqn.2026-01.org.mcsi:two-cores";
const ISID: Isid = Isid([0x80, 1, 2, 3, 4, 5]);
const BLOCK: usize = 512;
/// The target's NOP-In interval and the time it gives an answer.
const PING: Duration = Duration::from_secs(5);

/// The target's one connection, as its session core knows it: the initiator's
/// MaxRecvDataSegmentLength on it.
#[derive(Debug, Clone)]
struct Tc(u32);

impl CoreConn for Tc {
    fn cid(&self) -> u16 {
        0
    }
    fn role(&self) -> ConnRole {
        ConnRole::Both
    }
    fn same(&self, _: &Self) -> bool {
        true
    }
    fn max_data_in(&self) -> u32 {
        self.0
    }
}

/// What the target attaches to a task (the core keeps its command for its answer).
struct Job;

/// The target's answers to the login's questions: one target, no authentication.
struct Env {
    params: LocalParams,
    stat_sn: u32,
}

impl LoginEnv for Env {
    fn target(
        &mut self,
        _: SessionType,
        target_name: Option<&str>,
        _: &str,
    ) -> Result<TargetAccess, Refusal> {
        assert_eq!(target_name, Some(TARGET));
        Ok(TargetAccess {
            params: self.params.clone(),
            authenticator: Box::new(NoAuth),
            target_alias: None,
            portal_group_tag: None,
            extensions: Vec::new(),
        })
    }

    fn session(
        &mut self,
        _: Isid,
        tsih: u16,
        _: u16,
        _: &str,
        _: Option<&str>,
    ) -> Result<u16, Refusal> {
        Ok(if tsih == 0 { 1 } else { tsih })
    }

    fn numbers(&mut self, req: &LoginRequest) -> LoginNumbers {
        self.stat_sn += 1;
        LoginNumbers {
            stat_sn: self.stat_sn - 1,
            exp_cmd_sn: req.cmd_sn,
            max_cmd_sn: req.cmd_sn.wrapping_add(15),
        }
    }
}

/// Both sides of one session and the wire between them.
struct World {
    now: Instant,
    ini: InitiatorCore<u32>,
    ini_tx: Framing,
    ini_rx: Framing,
    tgt: SessionCore<Tc, Job>,
    /// The target's connection, as its core knows it.
    tc: Tc,
    tgt_tx: Framing,
    tgt_rx: Framing,
    dev: DeviceServer,
    nexus: Nexus,
    burst: BurstParams,
    /// The initiator's MaxRecvDataSegmentLength: the size of Data-In.
    data_in_size: u32,
    stat_sn: u32,
    to_target: VecDeque<Bytes>,
    to_initiator: VecDeque<Bytes>,
    /// The initiator reads nothing (its end of the wire is dead).
    deaf: bool,
    /// Data-Out from the initiator is lost on the way.
    lose_data_out: bool,
    /// ITT and CmdSN of the last SCSI command the target received.
    last_command: (u32, u32),
    completed: Vec<(u32, Result<Response, Error>)>,
    events: Vec<Event>,
    /// PDUs of each kind the target sent: (R2T, Data-In, SCSI Response, NOP-In).
    sent: [u32; 4],
    /// The keepalive gave the connection up.
    ping_unanswered: bool,
}

/// One PDU through the codec.
fn wire(p: &Pdu, tx: &Framing) -> Bytes {
    Bytes::from(p.encode(tx).to_vec())
}

fn unwire(b: Bytes, rx: &Framing) -> Pdu {
    let mut buf = BytesMut::from(&b[..]);
    let p = decode(&mut buf, rx).expect("decodes").expect("whole");
    assert!(buf.is_empty());
    p
}

impl World {
    /// Logs in through both login machines, then starts both session cores.
    fn login(target_first_burst: u32, response_timeout: Duration) -> World {
        let t0 = Instant::now();
        let mut ini_login = Login::new(&LoginConfig {
            initiator_name: INITIATOR.into(),
            target_name: Some(TARGET.into()),
            kind: SessionKind::Normal,
            isid: ISID,
            tsih: 0,
            cid: 0,
            itt: 0,
            cmd_sn: 1,
            offers: Offers {
                max_recv_data_segment_length: 16384,
                ..Offers::default()
            },
            chap: None,
            chap_algorithms: Vec::new(),
            role: ConnRole::Both,
            random: |b| b.fill(0x5a),
        })
        .unwrap();
        let mut env = Env {
            params: LocalParams {
                max_recv_data_segment_length: 8192,
                first_burst_length: target_first_burst,
                initial_r2t: true,
                immediate_data: true,
                max_burst_length: 16384,
                ..LocalParams::default()
            },
            stat_sn: 100,
        };
        let mut tgt_login = TargetLogin::new(TargetLoginConfig::default());
        let login_framing = Framing::default();
        let mut req = ini_login.start_at(t0, Duration::from_secs(15));
        let mut target_done: Option<(mcsi_proto::keys::SessionParams, ConnectionParams)> = None;
        let done: LoginDone = loop {
            let r = match unwire(
                wire(&Pdu::LoginRequest(req), &login_framing),
                &login_framing,
            ) {
                Pdu::LoginRequest(r) => r,
                other => panic!("{other:?}"),
            };
            let resp = match tgt_login.handle(&r, &mut env) {
                plogin::LoginStep::Continue(resp) => resp,
                plogin::LoginStep::FullFeature {
                    response,
                    session,
                    connection,
                    ..
                } => {
                    target_done = Some((session, connection));
                    response
                }
                plogin::LoginStep::Fail(resp) => panic!("login refused: {resp:?}"),
            };
            let resp = match unwire(
                wire(&Pdu::LoginResponse(resp), &login_framing),
                &login_framing,
            ) {
                Pdu::LoginResponse(r) => r,
                other => panic!("{other:?}"),
            };
            assert!(ini_login.handle_timeout(t0).is_ok());
            match ini_login.handle(&resp).expect("login goes on") {
                LoginStep::Send(next) => req = next,
                LoginStep::Done(d) => break *d,
                LoginStep::Redirect(a) => panic!("redirected to {a}"),
            }
        };
        let (tsession, tconn) = target_done.expect("the target reached full feature phase");
        assert_eq!(done.params.first_burst_length, target_first_burst);
        assert!(done.params.initial_r2t);
        let mut ini = InitiatorCore::new(Box::new(RoundRobin::default()));
        ini.set_timers(Timers {
            response: response_timeout,
            stall: Duration::ZERO,
        });
        let mut out = Vec::new();
        ini.start(
            done.params.clone(),
            CmdWindow::new(done.exp_cmd_sn, done.max_cmd_sn),
            &[ConnStart::new(0, done.role, done.stat_sn)],
            &mut out,
        );
        assert!(out.is_empty());
        let tc = Tc(tconn.tx_framing().max_data_segment_length);
        let burst: BurstParams = (&tsession).into();
        let mut tgt = SessionCore::new(done.exp_cmd_sn, 16, false, None);
        tgt.set_burst(burst);
        assert!(tgt.add_conn(tc.clone()).is_ok());
        tgt.start_keepalive(tc.cid(), PING, PING, t0);
        let backend = mcsi_scsi::backend::open_backend("ram:4MiB").unwrap();
        let lu = Arc::new(LogicalUnit::new(backend, LuConfig::default()));
        let mut w = World {
            now: t0,
            ini,
            ini_tx: done.connection.tx_framing(),
            ini_rx: done.connection.rx_framing(),
            tgt,
            tc,
            tgt_tx: tconn.tx_framing(),
            tgt_rx: tconn.rx_framing(),
            dev: DeviceServer::new(vec![(0, lu)]),
            nexus: Nexus {
                initiator_port: format!("{INITIATOR},i,0x800102030405").into(),
                target_port: format!("{TARGET},t,0x0001").into(),
                relative_port: 1,
            },
            burst,
            data_in_size: tconn.tx_framing().max_data_segment_length,
            stat_sn: env.stat_sn,
            to_target: VecDeque::new(),
            to_initiator: VecDeque::new(),
            deaf: false,
            lose_data_out: false,
            last_command: (0, 0),
            completed: Vec::new(),
            events: Vec::new(),
            sent: [0; 4],
            ping_unanswered: false,
        };
        // The initiator's timers start.
        w.initiator_timers();
        w
    }

    fn initiator_actions(&mut self, out: Vec<Action<u32>>) {
        for a in out {
            match a {
                Action::Send { pdu, .. } | Action::Urgent { pdu, .. } => {
                    self.to_target.push_back(wire(&pdu, &self.ini_tx));
                }
                Action::Complete { handle, result } => self.completed.push((handle, result)),
                Action::Event { event, .. } => self.events.push(event),
            }
        }
    }

    fn submit(&mut self, cmd: Command, handle: u32) {
        let mut out = Vec::new();
        self.ini.submit(cmd, handle, &mut out);
        self.initiator_actions(out);
    }

    /// The target sends a PDU: StatSN and the window are stamped on, as its writer does.
    fn target_sends(&mut self, mut p: Pdu) {
        let kind = match &p {
            Pdu::R2t(_) => 0,
            Pdu::DataIn(_) => 1,
            Pdu::ScsiResponse(_) => 2,
            Pdu::NopIn(_) => 3,
            _ => usize::MAX,
        };
        if let Some(n) = self.sent.get_mut(kind) {
            *n += 1;
        }
        let (exp, max) = self.tgt.cmd_sns();
        p.stamp(&mut self.stat_sn, exp, max);
        self.to_initiator.push_back(wire(&p, &self.tgt_tx));
    }

    /// Delivers everything on the wire, both ways, until it is quiet.
    fn settle(&mut self) {
        loop {
            if let Some(b) = self.to_target.pop_front() {
                let p = unwire(b, &self.tgt_rx);
                if self.lose_data_out && matches!(p, Pdu::DataOut(_)) {
                    continue;
                }
                self.tgt.conn_heard(self.tc.cid(), self.now);
                self.target_handles(p);
            } else if let Some(b) = self.to_initiator.pop_front() {
                if self.deaf {
                    continue;
                }
                let p = unwire(b, &self.ini_rx);
                self.ini.conn_heard(0, self.now);
                let mut out = Vec::new();
                self.ini
                    .handle_pdu(0, p, &mut out)
                    .expect("the initiator takes it");
                self.initiator_actions(out);
            } else {
                return;
            }
        }
    }

    fn initiator_timers(&mut self) {
        let mut out = Vec::new();
        self.ini.handle_timeout(self.now, &mut out);
        self.initiator_actions(out);
    }

    /// Virtual time moves on by `d`, waking each side's timers when they are due.
    fn advance(&mut self, d: Duration) {
        let until = self.now + d;
        loop {
            let next = [self.tgt.poll_timeout(), self.ini.poll_timeout()]
                .into_iter()
                .flatten()
                .filter(|t| *t <= until)
                .min();
            let Some(t) = next else { break };
            self.now = t.max(self.now);
            for e in self.tgt.handle_timeout(self.now) {
                assert!(matches!(e, Expired::PingUnanswered { .. }), "{e:?}");
                self.ping_unanswered = true;
            }
            // Its pings.
            while let Some((_, p)) = self.tgt.poll_transmit() {
                self.target_sends(p);
            }
            self.initiator_timers();
            self.settle();
        }
        self.now = until;
    }

    /// What the tokio layer's reader does with one PDU from the initiator: the core takes it,
    /// the driver runs what is to run now and carries out the control requests it hands back.
    fn target_handles(&mut self, p: Pdu) {
        if let Pdu::ScsiCommand(c) = &p {
            self.last_command = (c.itt, c.cmd_sn);
        }
        let tc = self.tc.clone();
        match self.tgt.handle_pdu(&tc, p, &self.dev, || Job) {
            // Its turn has come with all of its data: it runs now, without a task.
            Arrival::Now(now) => {
                let o = self.execute(&now.cmd, now.data);
                self.respond(&now.cmd, now.phase, o);
                if now.claim.tracked {
                    self.tgt.release_inline(now.cmd.lun);
                }
            }
            Arrival::Taken { runs, note } => {
                // Data-Out for a task that ended; nothing else goes astray.
                assert!(
                    note.is_none() || matches!(note, Some(Note::Discarded { .. })),
                    "{note:?}"
                );
                for r in runs {
                    match r {
                        OrderedRun::Control(_, Pdu::TaskMgmtRequest(t)) => self.task_management(t),
                        OrderedRun::Control(_, Pdu::LogoutRequest(l)) => self.logout(l),
                        _ => panic!("not in this test"),
                    }
                }
                self.run_ready();
            }
            Arrival::Snack(s) => panic!("a SNACK reached the core at ErrorRecoveryLevel 0: {s:?}"),
            Arrival::End(fault) => panic!("the connection ends: {fault}"),
        }
    }

    fn logout(&mut self, l: LogoutRequest) {
        let tc = self.tc.clone();
        let plan = self
            .tgt
            .logout(&tc, &l, |_| {})
            .expect("room for the answer");
        assert_eq!(plan, Logout::CloseSession);
        self.run_ready();
        // Its connection closes once the answer is sent; its end ends the session.
        let (c, how) = self.tgt.poll_close().expect("the connection closes");
        assert_eq!(how, Close::AfterFlush);
        let lost = self.tgt.conn_lost(&c, |_| {});
        assert!(lost.clean && lost.session_ends);
        self.tgt.close(|_| {});
    }

    /// Grants writes their budget, runs the tasks the core hands out to their end, and sends
    /// the PDUs the core made (R2Ts, Data-In, status).
    fn run_ready(&mut self) {
        loop {
            let mut progress = false;
            while let Some(g) = self.tgt.poll_grant() {
                assert!(self.tgt.grant(g.itt, g.id), "a live write");
                progress = true;
            }
            let mut ready = Vec::new();
            while let Some(r) = self.tgt.poll_ready() {
                let cmd = r.answer.expect("registered with its command").cmd.clone();
                ready.push((r.itt, r.id, r.data, cmd));
            }
            for (itt, id, data, cmd) in ready {
                let o = self.execute(&cmd, data);
                let tc = self.tc.clone();
                self.tgt.finish(itt, id, &tc, Some(o)).expect("its task");
                progress = true;
            }
            while let Some((_, p)) = self.tgt.poll_transmit() {
                self.target_sends(p);
                progress = true;
            }
            if !progress {
                return;
            }
        }
    }

    fn execute(&self, c: &ScsiCommand, data_out: Bytes) -> Outcome {
        self.dev.execute(
            c.lun,
            mcsi_scsi::Command {
                nexus: &self.nexus,
                cdb: &c.cdb,
                data_out,
                data_in_limit: read_expected(c),
                attr: TaskAttribute::Simple,
                pace: None,
            },
        )
    }

    fn respond(&mut self, c: &ScsiCommand, phase: DataPhase, o: Outcome) {
        let max_burst = self.burst.max_burst_length;
        for p in response_pdus(c, phase, o, self.data_in_size, max_burst) {
            self.target_sends(p);
        }
    }

    fn task_management(&mut self, t: TaskMgmtRequest) {
        let plan = Tmf::plan(&t, self.dev.lu(t.lun).is_some());
        let tc = self.tc.clone();
        match self
            .tgt
            .task_management(&tc, t.itt, &plan, t.immediate, |_| {})
        {
            TmfStep::Answered { runs, .. } => assert!(runs.is_empty()),
            _ => panic!("not in this test"),
        }
        self.run_ready();
    }

    /// The initiator sends an immediate control request built from its core's numbers (as its
    /// tokio layer does); its answer comes back as an [`Event::Control`].
    fn control(&mut self, build: impl FnOnce(&mut InitiatorCore<u32>, u32) -> Pdu) -> Pdu {
        let itt = self.ini.alloc_itt();
        let p = build(&mut self.ini, itt);
        self.to_target.push_back(wire(&p, &self.ini_tx));
        self.settle();
        let at = self
            .events
            .iter()
            .position(|e| matches!(e, Event::Control(p) if p.itt() == itt))
            .expect("the control request is answered");
        match self.events.remove(at) {
            Event::Control(p) => p,
            _ => unreachable!(),
        }
    }

    fn take_completed(&mut self, handle: u32) -> Result<Response, Error> {
        let at = self
            .completed
            .iter()
            .position(|(h, _)| *h == handle)
            .unwrap_or_else(|| panic!("command {handle} did not complete"));
        self.completed.remove(at).1
    }
}

fn rw10(op: u8, lba: u32, blocks: u16) -> Bytes {
    let mut c = vec![op, 0];
    c.extend_from_slice(&lba.to_be_bytes());
    c.push(0);
    c.extend_from_slice(&blocks.to_be_bytes());
    c.push(0);
    Bytes::from(c)
}

fn write(lba: u32, data: Bytes) -> Command {
    Command {
        lun: 0,
        cdb: rw10(0x2a, lba, (data.len() / BLOCK) as u16),
        dir: DataDir::Write(data),
    }
}

fn read(lba: u32, bytes: usize) -> Command {
    Command {
        lun: 0,
        cdb: rw10(0x28, lba, (bytes / BLOCK) as u16),
        dir: DataDir::Read(bytes as u32),
    }
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

/// Login, writes that need R2Ts, reads of what they wrote, ABORT TASK of a write whose data
/// never came, NOP-In pings answered while idle, the initiator's response timer, and a logout:
/// all through the two cores, on virtual time.
#[test]
fn a_whole_session_runs_through_the_two_cores_on_virtual_time() {
    // FirstBurstLength 4 KiB with InitialR2T: a 64 KiB write sends 4 KiB of immediate data and
    // is asked for the rest with R2Ts of MaxBurstLength 16 KiB.
    let mut w = World::login(4096, Duration::from_secs(30));
    // The first command of a new nexus meets the power-on unit attention (SPC-4 5.14).
    w.submit(
        Command {
            lun: 0,
            cdb: Bytes::from_static(&[0; 6]),
            dir: DataDir::None,
        },
        0,
    );
    w.settle();
    let e = w.take_completed(0).unwrap().check().unwrap_err();
    assert!(e.is_unit_attention(), "{e}");
    let a = pattern(64 << 10, 1);
    let b = pattern(64 << 10, 2);
    w.submit(write(0, a.clone()), 1);
    w.submit(write(128, b.clone()), 2);
    w.settle();
    for h in [1, 2] {
        let r = w.take_completed(h).expect("written").check().expect("GOOD");
        assert!(r.data.is_empty());
    }
    // 60 KiB each asked for in 16 KiB bursts: 4 R2Ts per write.
    assert_eq!(w.sent[0], 8, "R2Ts");
    w.submit(read(0, 128 << 10), 3);
    w.settle();
    let r = w.take_completed(3).expect("read").check().expect("GOOD");
    assert_eq!(r.data.len(), 128 << 10);
    assert_eq!(&r.data[..64 << 10], &a[..]);
    assert_eq!(&r.data[64 << 10..], &b[..]);
    // Data-In at the initiator's MaxRecvDataSegmentLength (16 KiB).
    assert_eq!(w.sent[1], 8, "Data-In PDUs");

    // A write whose Data-Out is lost on the wire, then ABORT TASK for it: the target ends it
    // at once (nothing runs for it) and answers "function complete".
    w.lose_data_out = true;
    w.submit(write(256, pattern(32 << 10, 3)), 4);
    w.settle();
    w.lose_data_out = false;
    // MaxOutstandingR2T 1: one R2T, and the next only once its burst has come.
    assert_eq!(w.sent[0], 9, "the write was asked for its data");
    let (itt, cmd_sn) = w.last_command;
    assert!(w.tgt.task(itt).is_some(), "it waits for its data");
    let answer = w.control(|core, tag| {
        Pdu::TaskMgmtRequest(TaskMgmtRequest {
            immediate: true,
            function: tmf_function::ABORT_TASK,
            lun: 0,
            itt: tag,
            referenced_task_tag: itt,
            cmd_sn: core.immediate_cmd_sn(),
            exp_stat_sn: core.exp_stat_sn(0),
            ref_cmd_sn: cmd_sn,
            exp_data_sn: 0,
        })
    });
    let Pdu::TaskMgmtResponse(r) = answer else {
        panic!("{answer:?}")
    };
    assert_eq!(r.response, tmf_response::COMPLETE);
    assert!(w.tgt.task(itt).is_none());
    assert_eq!(w.tgt.task_count(), 0);

    // 32 s of virtual time pass. The idle target pings every 5 s and the initiator answers;
    // the initiator's response timer gives up on the aborted write (no status for 30 s).
    let pings = w.sent[3];
    w.advance(Duration::from_secs(32));
    assert!(
        w.sent[3] >= pings + 5,
        "NOP-In pings: {}",
        w.sent[3] - pings
    );
    assert!(!w.ping_unanswered);
    let no_status: Vec<&Event> = w
        .events
        .iter()
        .filter(|e| matches!(e, Event::NoStatus { .. }))
        .collect();
    assert_eq!(
        no_status,
        vec![&Event::NoStatus {
            itt,
            waited: Duration::from_secs(30)
        }]
    );
    assert!(w.completed.is_empty(), "the aborted write has no status");

    // Logout: the session closes.
    let answer = w.control(|core, tag| {
        Pdu::LogoutRequest(LogoutRequest {
            immediate: true,
            reason: logout_reason::CLOSE_SESSION,
            itt: tag,
            cid: 0,
            cmd_sn: core.immediate_cmd_sn(),
            exp_stat_sn: core.exp_stat_sn(0),
        })
    });
    let Pdu::LogoutResponse(r) = answer else {
        panic!("{answer:?}")
    };
    assert_eq!(r.response, logout_response::CLOSED);
    assert!(w.tgt.is_closing());
}

/// An initiator that stops reading: the target's NOP-In ping goes unanswered and the
/// keepalive gives the connection up one timeout after the ping, on virtual time.
#[test]
fn an_unanswered_ping_ends_the_connection_on_virtual_time() {
    let mut w = World::login(4096, Duration::ZERO);
    w.deaf = true;
    w.advance(Duration::from_millis(9_999));
    assert_eq!(w.sent[3], 1, "one ping at 5 s");
    assert!(!w.ping_unanswered, "its answer is due at 10 s");
    w.advance(Duration::from_millis(1));
    assert!(w.ping_unanswered);
}
