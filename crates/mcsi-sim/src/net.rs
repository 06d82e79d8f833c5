//! The simulated network: hosts running smoltcp's TCP on virtual time, joined by mcsi-link's
//! link model. Initiator hosts sit on the link's command side (their packets go `Up`), the
//! target host on the other; the link's queues, rates, delays and losses are the emulator's
//! own code, driven by the virtual clock instead of a TUN device.

use crate::stream::Stream;
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
    pub congestion: Congestion,
    /// Send and receive buffer per socket, bytes (the window it can offer and fill).
    pub buffer: usize,
    /// The IP MTU: segments carry this less 40 bytes.
    pub mtu: usize,
}

/// A socket's congestion control.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Congestion {
    Reno,
    Cubic,
}

impl Congestion {
    pub fn parse(s: &str) -> Result<Congestion, String> {
        match s {
            "reno" => Ok(Congestion::Reno),
            "cubic" => Ok(Congestion::Cubic),
            other => Err(format!(
                "congestion control {other:?}: the simulator has reno and cubic"
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

/// One simulated machine: an interface and its TCP sockets.
pub struct Host {
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

impl Host {
    pub fn new(addr: Ipv4Address, mtu: usize, seed: u64) -> Host {
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
        Host {
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

    pub fn listen(&mut self, tcp: &TcpConfig) -> Result<SocketHandle, String> {
        let mut s = Host::socket(tcp);
        s.listen(PORT).map_err(|e| format!("listen: {e}"))?;
        Ok(self.sockets.add(s))
    }

    pub fn connect(
        &mut self,
        tcp: &TcpConfig,
        to: Ipv4Address,
        local_port: u16,
    ) -> Result<SocketHandle, String> {
        let mut s = Host::socket(tcp);
        s.connect(
            self.iface.context(),
            (IpAddress::Ipv4(to), PORT),
            local_port,
        )
        .map_err(|e| format!("connect: {e}"))?;
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

    pub fn state(&self, h: SocketHandle) -> tcp::State {
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

    /// Bytes the socket has received and not yet handed on: a stream has data to decode.
    pub fn has_input(&self, h: SocketHandle) -> bool {
        self.sockets.get::<tcp::Socket<'static>>(h).can_recv()
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
            .map(|(i, h)| (h.addr.octets(), i))
            .collect();
        Net {
            link,
            initiators,
            target,
            drops: [0; 2],
            index,
        }
    }

    /// Polls every host whose stack is due at `now`.
    pub fn poll_due(&mut self, now_ns: Nanos) {
        let now_us = (now_ns / 1000) as i64;
        let due = |h: &Host| h.next_poll.is_some_and(|t| t <= now_us) || !h.wire.rx.is_empty();
        for h in self.initiators.iter_mut().filter(|h| due(h)) {
            h.poll(now_us);
        }
        if due(&self.target) {
            self.target.poll(now_us);
        }
    }

    /// Polls initiator host `i` at `now` (its driver queued bytes).
    pub fn poll_initiator(&mut self, i: usize, now_ns: Nanos) {
        self.initiators[i].poll((now_ns / 1000) as i64);
    }

    /// Polls the target host at `now` (its driver queued bytes).
    pub fn poll_target(&mut self, now_ns: Nanos) {
        self.target.poll((now_ns / 1000) as i64);
    }

    /// Hands what the hosts sent to the link, and what the link delivers by `now` to the hosts.
    pub fn carry(&mut self, now_ns: Nanos) {
        for h in &mut self.initiators {
            while let Some(p) = h.wire.tx.pop_front() {
                if self.link.enqueue(Dir::Up, p, now_ns).is_err() {
                    self.drops[0] += 1;
                }
            }
        }
        while let Some(p) = self.target.wire.tx.pop_front() {
            if self.link.enqueue(Dir::Down, p, now_ns).is_err() {
                self.drops[1] += 1;
            }
        }
        while let Some(d) = self.link.poll_transmit(now_ns) {
            match d.dir {
                Dir::Up => self.target.wire.rx.push_back(d.pkt),
                Dir::Down => {
                    let dst = d.pkt.get(16..20).and_then(|a| <[u8; 4]>::try_from(a).ok());
                    if let Some(h) = dst.and_then(|a| self.index.get(&a)) {
                        self.initiators[*h].wire.rx.push_back(d.pkt);
                    }
                }
            }
        }
    }

    /// The next time anything in the network is due, ns.
    pub fn next_event(&self) -> Option<Nanos> {
        let hosts = self
            .initiators
            .iter()
            .chain(std::iter::once(&self.target))
            .filter_map(|h| h.next_poll)
            .map(|us| us.max(0) as u64 * 1000)
            .min();
        [hosts, self.link.next_deadline()]
            .into_iter()
            .flatten()
            .min()
    }
}
