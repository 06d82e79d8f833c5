//! A small raw-PDU iSCSI client on mcsi-proto's codec, and a target on an ephemeral loopback
//! port, shared by the integration tests.
#![allow(dead_code)]

use bytes::{Bytes, BytesMut};
use mcsi_proto::pdu::*;
use mcsi_target::config::{LunSpec, ServerConfig, TargetSpec};
use mcsi_target::Server;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const IQN: &str = "iqn.2026-01.org.mcsi:test";

/// A target whose configuration `f` adjusts (after [`config`]).
pub async fn start_with(f: impl FnOnce(&mut ServerConfig)) -> Server {
    let mut cfg = config(|_| {});
    f(&mut cfg);
    Server::start(&cfg).await.unwrap()
}

pub async fn start(limits: impl FnOnce(&mut mcsi_target::config::Limits)) -> Server {
    Server::start(&config(limits)).await.unwrap()
}

/// One target, one 16 MiB RAM LUN, an ephemeral loopback portal.
pub fn config(limits: impl FnOnce(&mut mcsi_target::config::Limits)) -> ServerConfig {
    let mut l = mcsi_target::config::Limits::default();
    limits(&mut l);
    ServerConfig {
        targets: vec![TargetSpec {
            iqn: IQN.into(),
            alias: None,
            portals: vec!["127.0.0.1:0".parse().unwrap()],
            advertise: Vec::new(),
            redirect: None,
            luns: vec![LunSpec::new("ram:16MiB")],
            limits: l,
            auth: Default::default(),
            qos_initiators: Vec::new(),
            tpgt: 1,
            alua: None,
            lun_maps: Vec::new(),
        }],
        discovery_auth: Default::default(),
        limits: Default::default(),
        // Two, whatever the machine: connections move to their session's thread after login.
        session_threads: 2,
        mptcp: false,
        control: None,
        state_dir: None,
        source: None,
        access_from_flags: false,
    }
}

/// The client's byte stream: a TCP connection to a portal, or an in-process pipe.
pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// How a client reaches the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// TCP to the server's first portal.
    Tcp,
    /// A `tokio::io::duplex` pipe handed to [`Server::serve`]: no socket at all.
    InProcess,
}

pub struct Client {
    pub s: Box<dyn Io>,
    pub buf: BytesMut,
    pub framing: Framing,
    pub cmd_sn: u32,
    pub itt: u32,
    pub tsih: u16,
    /// Every key of every Login Response of the last login.
    pub login_keys: Vec<(String, String)>,
}

pub fn text(pairs: &[(&str, &str)]) -> Bytes {
    let mut v = Vec::new();
    for (k, val) in pairs {
        v.extend_from_slice(format!("{k}={val}\0").as_bytes());
    }
    Bytes::from(v)
}

impl Client {
    pub async fn connect(server: &Server) -> Client {
        Self::open(server, Via::Tcp).await
    }

    /// A TCP connection to `addr` (a portal other than the server's first), not logged in.
    #[allow(dead_code)]
    pub async fn at(addr: std::net::SocketAddr) -> std::io::Result<Client> {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        Ok(Self::over(Box::new(s)))
    }

    /// A client over `s`, not logged in.
    fn over(s: Box<dyn Io>) -> Client {
        Client {
            s,
            buf: BytesMut::new(),
            framing: Framing::default(),
            cmd_sn: 1,
            itt: 1,
            tsih: 0,
            login_keys: Vec::new(),
        }
    }

    pub async fn open(server: &Server, via: Via) -> Client {
        let s: Box<dyn Io> = match via {
            Via::Tcp => {
                let s = TcpStream::connect(server.local_addrs()[0]).await.unwrap();
                s.set_nodelay(true).unwrap();
                Box::new(s)
            }
            Via::InProcess => {
                let (ours, theirs) = tokio::io::duplex(256 * 1024);
                let peer = "127.0.0.2:40000".parse().unwrap();
                // As if it came to the first portal: a target is reached at its portals only.
                let local = server.local_addrs()[0];
                assert!(
                    server.serve(theirs, peer, local),
                    "the server refused the connection"
                );
                Box::new(ours)
            }
        };
        Self::over(s)
    }

    pub async fn send(&mut self, p: Pdu) {
        let e = p.encode(&self.framing);
        self.s.write_all(&e.to_vec()).await.unwrap();
    }

    pub async fn recv(&mut self) -> Pdu {
        tokio::time::timeout(Duration::from_secs(5), self.recv_inner())
            .await
            .expect("no PDU within 5 s")
    }

    pub async fn recv_inner(&mut self) -> Pdu {
        let f = Framing {
            max_data_segment_length: 1 << 24,
            ..self.framing
        };
        loop {
            if let Some(p) = decode(&mut self.buf, &f).unwrap() {
                return p;
            }
            assert!(
                self.s.read_buf(&mut self.buf).await.unwrap() > 0,
                "connection closed"
            );
        }
    }

    /// The next PDU, or None if the connection closes (or breaks the codec) or nothing comes
    /// within 5 s.
    pub async fn try_recv(&mut self) -> Option<Pdu> {
        let f = Framing {
            max_data_segment_length: 1 << 24,
            ..self.framing
        };
        let next = async {
            loop {
                if let Some(p) = decode(&mut self.buf, &f).ok()? {
                    return Some(p);
                }
                match self.s.read_buf(&mut self.buf).await {
                    Ok(n) if n > 0 => {}
                    _ => return None,
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(5), next)
            .await
            .ok()
            .flatten()
    }

    /// Nothing arrives within `ms`.
    pub async fn silent(&mut self, ms: u64) -> bool {
        tokio::time::timeout(Duration::from_millis(ms), self.recv_inner())
            .await
            .is_err()
    }

    pub async fn login(
        &mut self,
        isid: [u8; 6],
        tsih: u16,
        cid: u16,
        keys: &[(&str, &str)],
    ) -> LoginResponse {
        self.try_login(isid, tsih, cid, keys)
            .await
            .expect("connection closed during login")
    }

    /// Like [`Client::login`], but None when the target closes the connection instead of
    /// answering.
    pub async fn try_login(
        &mut self,
        isid: [u8; 6],
        tsih: u16,
        cid: u16,
        keys: &[(&str, &str)],
    ) -> Option<LoginResponse> {
        let mut all = Vec::new();
        if !keys.iter().any(|(k, _)| *k == "InitiatorName") {
            all.push(("InitiatorName", "iqn.2026-01.org.mcsi:client"));
        }
        all.extend_from_slice(keys);
        let mut data = text(&all);
        for _ in 0..4 {
            let req = Pdu::LoginRequest(LoginRequest {
                transit: true,
                continue_: false,
                csg: Stage::Operational,
                nsg: Stage::FullFeature,
                version_max: 0,
                version_min: 0,
                isid: Isid(isid),
                tsih,
                itt: 0,
                cid,
                cmd_sn: self.cmd_sn,
                exp_stat_sn: 0,
                data,
            });
            // A target that closed the connection at once may make the write fail.
            let bytes = req.encode(&self.framing).to_vec();
            self.s.write_all(&bytes).await.ok()?;
            let Pdu::LoginResponse(r) = self.try_recv().await? else {
                panic!("not a login response")
            };
            if r.status_class == 0 {
                self.login_keys
                    .extend(mcsi_proto::text::parse(&r.data, &Default::default()).unwrap());
            }
            if r.status_class != 0 || r.transit {
                self.tsih = r.tsih;
                return Some(r);
            }
            // The target offered keys of its own (RFC 7143 6.2): accept its values.
            let offers: Vec<(String, String)> =
                mcsi_proto::text::parse(&r.data, &Default::default())
                    .unwrap()
                    .into_iter()
                    .filter(|(k, _)| {
                        !all.iter().any(|(s, _)| s == k)
                            && !matches!(
                                k.as_str(),
                                "MaxRecvDataSegmentLength" | "TargetPortalGroupTag" | "TargetAlias"
                            )
                    })
                    .collect();
            assert!(!offers.is_empty(), "target held the login without offers");
            data = mcsi_proto::text::encode(&offers);
        }
        panic!("login did not complete in 4 rounds")
    }

    pub async fn normal(server: &Server, keys: &[(&str, &str)]) -> Client {
        Self::normal_isid(server, [0x80, 1, 2, 3, 4, 5], keys).await
    }

    /// Logs in to a normal session and clears the power-on unit attention.
    pub async fn normal_isid(server: &Server, isid: [u8; 6], keys: &[(&str, &str)]) -> Client {
        Self::normal_via(server, Via::Tcp, isid, keys).await
    }

    /// [`Client::normal_isid`] over `via`.
    pub async fn normal_via(
        server: &Server,
        via: Via,
        isid: [u8; 6],
        keys: &[(&str, &str)],
    ) -> Client {
        let mut c = Client::open(server, via).await;
        let mut k = vec![
            ("TargetName", IQN),
            ("SessionType", "Normal"),
            ("MaxConnections", "4"),
        ];
        k.extend_from_slice(keys);
        let r = c.login(isid, 0, 0, &k).await;
        assert_eq!((r.status_class, r.status_detail), (0, 0));
        assert!(r.transit && r.nsg == Stage::FullFeature);
        c.cmd_sn = r.exp_cmd_sn;
        // Digests agreed in the login frame everything after it.
        let crc = |c: &Client, name: &str| {
            c.login_keys
                .iter()
                .rev()
                .find(|(k, _)| k == name)
                .is_some_and(|(_, v)| v == "CRC32C")
        };
        c.framing.header_digest = crc(&c, "HeaderDigest");
        c.framing.data_digest = crc(&c, "DataDigest");
        for _ in 0..3 {
            let tur = c.command(&[0, 0, 0, 0, 0, 0], false, false, 0, Bytes::new(), true);
            let itt = tur.itt;
            c.send(Pdu::ScsiCommand(tur)).await;
            let (_, st, _, _, _) = c.read_result(itt).await;
            if st == 0 {
                break;
            }
        }
        c
    }

    /// Logs in another connection (`cid`) to `lead`'s session: same ISID, its TSIH.
    pub async fn join(server: &Server, lead: &Client, cid: u16) -> (Client, LoginResponse) {
        Self::join_via(server, Via::Tcp, lead, cid).await
    }

    /// [`Client::join`] over `via`.
    pub async fn join_via(
        server: &Server,
        via: Via,
        lead: &Client,
        cid: u16,
    ) -> (Client, LoginResponse) {
        let mut c = Client::open(server, via).await;
        c.cmd_sn = lead.cmd_sn;
        // ITTs are session-wide: keep this connection's apart from the others'.
        c.itt = u32::from(cid) << 20;
        let r = c
            .login(
                [0x80, 1, 2, 3, 4, 5],
                lead.tsih,
                cid,
                &[("TargetName", IQN)],
            )
            .await;
        (c, r)
    }

    /// An immediate Logout Request (reason 0: session, 1: connection `cid`).
    pub async fn logout(&mut self, reason: u8, cid: u16) -> LogoutResponse {
        let itt = self.next_itt();
        self.send(Pdu::LogoutRequest(LogoutRequest {
            immediate: true,
            reason,
            itt,
            cid,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: 0,
        }))
        .await;
        match self.recv().await {
            Pdu::LogoutResponse(r) if r.itt == itt => r,
            other => panic!("expected a Logout Response, got {other:?}"),
        }
    }

    /// The target closes the connection within 5 s (anything still queued is read and dropped).
    pub async fn closed_by_target(&mut self) -> bool {
        self.closed_within(Duration::from_secs(5)).await
    }

    /// Whether the target closes the connection within `wait` of silence (whatever it sends
    /// meanwhile is read and dropped).
    pub async fn closed_within(&mut self, wait: Duration) -> bool {
        let mut tmp = [0u8; 4096];
        loop {
            match tokio::time::timeout(wait, self.s.read(&mut tmp)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    }

    pub fn next_itt(&mut self) -> u32 {
        self.itt += 1;
        self.itt
    }

    pub fn command(
        &mut self,
        cdb: &[u8],
        read: bool,
        write: bool,
        edtl: u32,
        data: Bytes,
        final_: bool,
    ) -> ScsiCommand {
        let mut c = [0u8; 16];
        c[..cdb.len()].copy_from_slice(cdb);
        let itt = self.next_itt();
        let cmd = ScsiCommand {
            immediate: false,
            final_,
            read,
            write,
            attr: TaskAttr::Simple,
            lun: 0,
            itt,
            expected_data_transfer_length: edtl,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: 0,
            cdb: Bytes::copy_from_slice(&c),
            bidi_read_length: None,
            data,
        };
        self.cmd_sn += 1;
        cmd
    }

    /// Collects Data-In until status; returns (data, status PDU fields).
    pub async fn read_result(&mut self, itt: u32) -> (Vec<u8>, u8, bool, bool, u32) {
        let mut data = Vec::new();
        loop {
            match self.recv().await {
                Pdu::DataIn(d) => {
                    assert_eq!(d.itt, itt);
                    assert_eq!(d.buffer_offset as usize, data.len());
                    data.extend_from_slice(&d.data);
                    if let Some(s) = d.status {
                        return (data, s, d.overflow, d.underflow, d.residual_count);
                    }
                }
                Pdu::ScsiResponse(r) => {
                    assert_eq!(r.itt, itt);
                    return (data, r.status, r.overflow, r.underflow, r.residual_count);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
}

pub fn rw10(op: u8, lba: u32, blocks: u16) -> Vec<u8> {
    let mut c = vec![op, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

pub fn pattern(n: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<u8>>(),
    )
}
