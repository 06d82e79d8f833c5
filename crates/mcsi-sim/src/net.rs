//! The simulated network: hosts running the simulator's TCP (or smoltcp's) on virtual time,
//! joined by mcsi-link's link model. Initiator hosts sit on the link's command side (their packets go `Up`), the
//! target host on the other; the link's queues, rates, delays and losses are the emulator's
//! own code, driven by the virtual clock instead of a TUN device.

use crate::stream::Stream;
use crate::UnknownName;
use mcsi_link::{Dir, Link, Nanos};
use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{self, ChecksumCapabilities, Device, DeviceCapabilities, Medium};
use smoltcp::socket::tcp::{self, CongestionControl};
use smoltcp::time::{Duration as SmolDuration, Instant as SmolInstant};
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr, Ipv4Address};
use std::collections::VecDeque;

/// The iSCSI port the target listens on.
pub const PORT: u16 = 3260;

/// TCP settings for every socket of a run.
#[derive(Debug, Clone, Copy)]
pub struct TcpConfig {
    pub stack: TcpStack,
    pub congestion: Congestion,
    /// Send and receive buffer per socket, bytes (the window it can offer and fill).
    pub buffer: usize,
    /// The IP MTU: segments carry this less 40 bytes.
    pub mtu: usize,
}

/// Which TCP the hosts run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpStack {
    /// The simulator's own, written to behave as Linux's does ([`crate::tcp`]).
    Linuxlike,
    /// smoltcp's (a complete TCP, but with a 1 s RTO floor and no SACK-based recovery).
    Smoltcp,
}

impl TcpStack {
    pub fn parse(s: &str) -> Result<TcpStack, UnknownName> {
        match s {
            "linuxlike" => Ok(TcpStack::Linuxlike),
            "smoltcp" => Ok(TcpStack::Smoltcp),
            other => Err(UnknownName::new("TCP stack", other, "linuxlike or smoltcp")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TcpStack::Linuxlike => "linuxlike",
            TcpStack::Smoltcp => "smoltcp",
        }
    }
}

/// smoltcp refused to open a socket.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("listen: {0}")]
    Listen(#[from] tcp::ListenError),
    #[error("connect: {0}")]
    Connect(#[from] tcp::ConnectError),
}

/// A socket's congestion control.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Congestion {
    Reno,
    Cubic,
}

impl Congestion {
    pub fn parse(s: &str) -> Result<Congestion, UnknownName> {
        match s {
            "reno" => Ok(Congestion::Reno),
            "cubic" => Ok(Congestion::Cubic),
            other => Err(UnknownName::new(
                "congestion control",
                other,
                "the simulator has reno and cubic",
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Congestion::Reno => "reno",
            Congestion::Cubic => "cubic",
        }
    }
}

/// A network interface whose wire is two packet queues.
struct Wire {
    rx: VecDeque<Vec<u8>>,
    tx: VecDeque<Vec<u8>>,
    mtu: usize,
}

struct RxToken(Vec<u8>);
struct TxToken<'a>(&'a mut VecDeque<Vec<u8>>);

impl phy::RxToken for RxToken {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut b = vec![0; len];
        let r = f(&mut b);
        self.0.push_back(b);
        r
    }
}

impl Device for Wire {
    type RxToken<'a>
        = RxToken
    where
        Self: 'a;
    type TxToken<'a>
        = TxToken<'a>
    where
        Self: 'a;

    fn receive(&mut self, _: SmolInstant) -> Option<(RxToken, TxToken<'_>)> {
        let p = self.rx.pop_front()?;
        Some((RxToken(p), TxToken(&mut self.tx)))
    }

    fn transmit(&mut self, _: SmolInstant) -> Option<TxToken<'_>> {
        Some(TxToken(&mut self.tx))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut c = DeviceCapabilities::default();
        c.medium = Medium::Ip;
        c.max_transmission_unit = self.mtu;
        // Nothing corrupts a packet in the simulation: checksums would only cost time.
        c.checksum = ChecksumCapabilities::ignored();
        c
    }
}

/// One simulated machine on smoltcp: an interface and its TCP sockets.
pub struct SmolHost {
    wire: Wire,
    iface: Interface,
    sockets: SocketSet<'static>,
    pub addr: Ipv4Address,
    /// When smoltcp next wants a poll, µs of virtual time.
    next_poll: Option<i64>,
}

/// The address of initiator host `i` (the target is 10.1.0.1).
pub fn initiator_addr(i: usize) -> Ipv4Address {
    Ipv4Address::new(
        10,
        2 + (i / 62_500) as u8,
        ((i / 250) % 250) as u8,
        (i % 250) as u8 + 1,
    )
}

pub fn target_addr() -> Ipv4Address {
    Ipv4Address::new(10, 1, 0, 1)
}

impl SmolHost {
    pub fn new(addr: Ipv4Address, mtu: usize, seed: u64) -> SmolHost {
        let mut wire = Wire {
            rx: VecDeque::new(),
            tx: VecDeque::new(),
            mtu,
        };
        let mut cfg = Config::new(HardwareAddress::Ip);
        cfg.random_seed = seed;
        let mut iface = Interface::new(cfg, &mut wire, SmolInstant::ZERO);
        iface.update_ip_addrs(|a| {
            let _ = a.push(IpCidr::new(IpAddress::Ipv4(addr), 8));
        });
        SmolHost {
            wire,
            iface,
            sockets: SocketSet::new(Vec::new()),
            addr,
            next_poll: Some(0),
        }
    }

    fn socket(tcp: &TcpConfig) -> tcp::Socket<'static> {
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; tcp.buffer]),
            tcp::SocketBuffer::new(vec![0; tcp.buffer]),
        );
        s.set_congestion_control(match tcp.congestion {
            Congestion::Reno => CongestionControl::Reno,
            Congestion::Cubic => CongestionControl::Cubic,
        });
        s.set_ack_delay(Some(SmolDuration::from_millis(10)));
        // Both mcsi's initiator and its target set TCP_NODELAY.
        s.set_nagle_enabled(false);
        s
    }

    pub fn listen(&mut self, tcp: &TcpConfig) -> Result<SocketHandle, SocketError> {
        let mut s = SmolHost::socket(tcp);
        s.listen(PORT)?;
        Ok(self.sockets.add(s))
    }

    pub fn connect(
        &mut self,
        tcp: &TcpConfig,
        to: Ipv4Address,
        local_port: u16,
    ) -> Result<SocketHandle, SocketError> {
        let mut s = SmolHost::socket(tcp);
        s.connect(
            self.iface.context(),
            (IpAddress::Ipv4(to), PORT),
            local_port,
        )?;
        self.next_poll = Some(0);
        Ok(self.sockets.add(s))
    }

    /// Runs the stack at `now`: takes in what arrived, sends what is due.
    fn poll(&mut self, now_us: i64) {
        let now = SmolInstant::from_micros(now_us);
        self.iface.poll(now, &mut self.wire, &mut self.sockets);
        self.next_poll = self
            .iface
            .poll_at(now, &self.sockets)
            .map(|t| t.total_micros());
    }

    fn state(&self, h: SocketHandle) -> tcp::State {
        self.sockets.get::<tcp::Socket<'static>>(h).state()
    }

    /// Moves bytes between socket `h` and `stream` both ways. True when any moved.
    pub fn exchange(&mut self, h: SocketHandle, stream: &mut Stream) -> bool {
        let s = self.sockets.get_mut::<tcp::Socket<'static>>(h);
        let mut moved = false;
        while s.can_recv() {
            let got = s.recv(|b| {
                stream.deliver(b);
                (b.len(), b.len())
            });
            match got {
                Ok(n) if n > 0 => moved = true,
                _ => break,
            }
        }
        if stream.queued() > 0 && s.can_send() {
            stream.drain_into(|b| {
                let n = s.send_slice(b).unwrap_or(0);
                moved |= n > 0;
                n
            });
        }
        if stream.is_closed() && stream.queued() == 0 && s.may_send() {
            s.close();
        }
        moved
    }
}

/// A socket of either stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sock {
    Smol(SocketHandle),
    Own(usize),
}

/// A simulated machine on either stack.
pub enum Host {
    Smol(Box<SmolHost>),
    Own(Box<crate::tcp::Host>),
}

impl Host {
    pub fn new(addr: Ipv4Address, tcp: &TcpConfig, seed: u64) -> Host {
        match tcp.stack {
            TcpStack::Smoltcp => Host::Smol(Box::new(SmolHost::new(addr, tcp.mtu, seed))),
            TcpStack::Linuxlike => {
                Host::Own(Box::new(crate::tcp::Host::new(addr.octets(), tcp.mtu)))
            }
        }
    }

    fn cc(tcp: &TcpConfig) -> crate::tcp::Cc {
        match tcp.congestion {
            Congestion::Reno => crate::tcp::Cc::Reno,
            Congestion::Cubic => crate::tcp::Cc::Cubic,
        }
    }

    pub fn listen(&mut self, tcp: &TcpConfig) -> Result<Sock, SocketError> {
        match self {
            Host::Smol(h) => h.listen(tcp).map(Sock::Smol),
            Host::Own(h) => Ok(Sock::Own(h.listen(tcp, PORT, Host::cc(tcp)))),
        }
    }

    pub fn connect(
        &mut self,
        tcp: &TcpConfig,
        to: Ipv4Address,
        local_port: u16,
    ) -> Result<Sock, SocketError> {
        match self {
            Host::Smol(h) => h.connect(tcp, to, local_port).map(Sock::Smol),
            Host::Own(h) => Ok(Sock::Own(h.connect(
                tcp,
                Host::cc(tcp),
                to.octets(),
                PORT,
                local_port,
            ))),
        }
    }

    /// The connection is up (and data may flow).
    pub fn established(&self, s: Sock) -> bool {
        match (self, s) {
            (Host::Smol(h), Sock::Smol(k)) => {
                matches!(h.state(k), tcp::State::Established | tcp::State::CloseWait)
            }
            (Host::Own(h), Sock::Own(k)) => h.state(k) == crate::tcp::State::Established,
            _ => false,
        }
    }

    /// Bytes in the socket's send buffer (sent and unacknowledged, or not yet sent).
    pub fn send_queue(&self, s: Sock) -> usize {
        match (self, s) {
            (Host::Smol(h), Sock::Smol(k)) => h.sockets.get::<tcp::Socket<'static>>(k).send_queue(),
            (Host::Own(h), Sock::Own(k)) => h.send_queue(k),
            _ => 0,
        }
    }

    /// Moves bytes between the socket and `stream` both ways. True when any moved.
    pub fn exchange(&mut self, s: Sock, stream: &mut Stream) -> bool {
        match (self, s) {
            (Host::Smol(h), Sock::Smol(k)) => h.exchange(k, stream),
            (Host::Own(h), Sock::Own(k)) => h.exchange(k, stream),
            _ => false,
        }
    }

    /// The sockets that took in segments since the last call (their application may have
    /// something to do); smoltcp does not say, so all of its sockets are named.
    pub fn take_ready(&mut self, into: &mut Vec<Sock>, scratch: &mut Vec<usize>) {
        match self {
            Host::Own(h) => {
                h.take_ready(scratch);
                into.extend(scratch.drain(..).map(Sock::Own));
            }
            Host::Smol(h) => into.extend(h.sockets.iter().map(|(k, _)| Sock::Smol(k))),
        }
    }

    /// The connection's TCP state where the stack exposes it (the simulator's own does).
    pub fn tcp_state(&self, s: Sock) -> Option<mcsi_tcp::TcpState> {
        match (self, s) {
            (Host::Own(h), Sock::Own(k)) => Some(h.tcp_state(k)),
            _ => None,
        }
    }

    /// Segments retransmitted and retransmission timeouts, where the stack counts them.
    pub fn retransmits(&self) -> Option<(u64, u64)> {
        match self {
            Host::Own(h) => Some(h.retransmits()),
            Host::Smol(_) => None,
        }
    }

    fn poll(&mut self, now_ns: Nanos) {
        match self {
            Host::Smol(h) => h.poll((now_ns / 1000) as i64),
            Host::Own(h) => h.poll(now_ns),
        }
    }

    fn next_poll(&self) -> Option<Nanos> {
        match self {
            Host::Smol(h) => h.next_poll.map(|us| us.max(0) as u64 * 1000),
            Host::Own(h) => h.next_poll(),
        }
    }

    fn has_rx(&self) -> bool {
        match self {
            Host::Smol(h) => !h.wire.rx.is_empty(),
            Host::Own(h) => !h.rx.is_empty(),
        }
    }

    fn rx(&mut self) -> &mut VecDeque<Vec<u8>> {
        match self {
            Host::Smol(h) => &mut h.wire.rx,
            Host::Own(h) => &mut h.rx,
        }
    }

    fn tx(&mut self) -> &mut VecDeque<Vec<u8>> {
        match self {
            Host::Smol(h) => &mut h.wire.tx,
            Host::Own(h) => &mut h.tx,
        }
    }

    fn addr(&self) -> [u8; 4] {
        match self {
            Host::Smol(h) => h.addr.octets(),
            Host::Own(h) => h.addr,
        }
    }
}

/// All hosts and the link between the initiators' side and the target.
pub struct Net {
    pub link: Link,
    pub initiators: Vec<Host>,
    pub target: Host,
    /// Packets the link dropped, by direction (up, down).
    pub drops: [u64; 2],
    index: std::collections::HashMap<[u8; 4], usize>,
}

impl Net {
    pub fn new(link: Link, initiators: Vec<Host>, target: Host) -> Net {
        let index = initiators
            .iter()
            .enumerate()
            .map(|(i, h)| (h.addr(), i))
            .collect();
        Net {
            link,
            initiators,
            target,
            drops: [0; 2],
            index,
        }
    }

    /// Whether initiator host `i` wants a poll at `now`.
    pub fn initiator_due(&self, i: usize, now_ns: Nanos) -> bool {
        let h = &self.initiators[i];
        h.next_poll().is_some_and(|t| t <= now_ns) || h.has_rx()
    }

    /// Whether the target host wants a poll at `now`.
    pub fn target_due(&self, now_ns: Nanos) -> bool {
        self.target.next_poll().is_some_and(|t| t <= now_ns) || self.target.has_rx()
    }

    /// When initiator host `i` next wants a poll, if ever.
    pub fn initiator_next(&self, i: usize) -> Option<Nanos> {
        self.initiators[i].next_poll()
    }

    /// Polls initiator host `i` at `now` (its driver queued bytes).
    pub fn poll_initiator(&mut self, i: usize, now_ns: Nanos) {
        self.initiators[i].poll(now_ns);
    }

    /// Polls the target host at `now` (its driver queued bytes).
    pub fn poll_target(&mut self, now_ns: Nanos) {
        self.target.poll(now_ns);
    }

    /// Hands what initiator hosts `from` and the target sent to the link, and what the link
    /// delivers by `now` to the hosts; the initiators that were given packets are added to
    /// `delivered`.
    pub fn carry(&mut self, now_ns: Nanos, from: &[usize], delivered: &mut Vec<usize>) {
        for &i in from {
            let h = &mut self.initiators[i];
            while let Some(p) = h.tx().pop_front() {
                if self.link.enqueue(Dir::Up, p, now_ns).is_err() {
                    self.drops[0] += 1;
                }
            }
        }
        while let Some(p) = self.target.tx().pop_front() {
            if self.link.enqueue(Dir::Down, p, now_ns).is_err() {
                self.drops[1] += 1;
            }
        }
        while let Some(d) = self.link.poll_transmit(now_ns) {
            match d.dir {
                Dir::Up => self.target.rx().push_back(d.pkt),
                Dir::Down => {
                    let dst = d.pkt.get(16..20).and_then(|a| <[u8; 4]>::try_from(a).ok());
                    if let Some(&h) = dst.and_then(|a| self.index.get(&a)) {
                        self.initiators[h].rx().push_back(d.pkt);
                        delivered.push(h);
                    }
                }
            }
        }
    }

    /// The next time the link or the target host is due, ns (the initiators' hosts are
    /// asked one by one: [`Net::initiator_next`]).
    pub fn next_event(&self) -> Option<Nanos> {
        let waiting = self.target.has_rx().then_some(0);
        [waiting, self.target.next_poll(), self.link.next_deadline()]
            .into_iter()
            .flatten()
            .min()
    }
}
