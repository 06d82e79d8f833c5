//! A connection's state sampled from the kernel's `TCP_INFO`.
//!
//! The layout below mirrors `struct tcp_info` of `linux/tcp.h` up to `tcpi_total_rto_time`
//! (Linux 6.7). Older kernels fill a prefix of it; the kernel reports how many bytes it wrote,
//! and every field that lies beyond that length reads as `None` rather than as zero.

use serde::{Deserialize, Serialize};
use std::mem::{offset_of, size_of};
use std::os::fd::{AsFd, AsRawFd};

/// `struct tcp_info` as Linux 6.7 and later define it.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawTcpInfo {
    state: u8,
    ca_state: u8,
    retransmits: u8,
    probes: u8,
    backoff: u8,
    options: u8,
    wscale: u8,
    /// Bit 0: the delivery-rate sample was application-limited; bits 1-2: TFO client failure.
    app_limited_tfo: u8,
    rto: u32,
    ato: u32,
    snd_mss: u32,
    rcv_mss: u32,
    unacked: u32,
    sacked: u32,
    lost: u32,
    retrans: u32,
    fackets: u32,
    last_data_sent: u32,
    last_ack_sent: u32,
    last_data_recv: u32,
    last_ack_recv: u32,
    pmtu: u32,
    rcv_ssthresh: u32,
    rtt: u32,
    rttvar: u32,
    snd_ssthresh: u32,
    snd_cwnd: u32,
    advmss: u32,
    reordering: u32,
    rcv_rtt: u32,
    rcv_space: u32,
    total_retrans: u32,
    pacing_rate: u64,
    max_pacing_rate: u64,
    bytes_acked: u64,
    bytes_received: u64,
    segs_out: u32,
    segs_in: u32,
    notsent_bytes: u32,
    min_rtt: u32,
    data_segs_in: u32,
    data_segs_out: u32,
    delivery_rate: u64,
    busy_time: u64,
    rwnd_limited: u64,
    sndbuf_limited: u64,
    delivered: u32,
    delivered_ce: u32,
    bytes_sent: u64,
    bytes_retrans: u64,
    dsack_dups: u32,
    reord_seen: u32,
    rcv_ooopack: u32,
    snd_wnd: u32,
    rcv_wnd: u32,
    rehash: u32,
    total_rto: u16,
    total_rto_recoveries: u16,
    total_rto_time: u32,
}

/// The congestion-avoidance state of the sender (`tcpi_ca_state`, `enum tcp_ca_state`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CaState {
    /// Nothing unusual.
    #[default]
    Open,
    /// Duplicate ACKs or SACKs seen; the window is not reduced yet.
    Disorder,
    /// The window was reduced after an ECN echo or a local congestion signal.
    Cwr,
    /// Fast recovery after a loss.
    Recovery,
    /// A retransmission timeout: the window collapsed to one segment.
    Loss,
    /// A value this build does not know.
    Other(u8),
}

impl CaState {
    fn from_raw(v: u8) -> CaState {
        match v {
            0 => CaState::Open,
            1 => CaState::Disorder,
            2 => CaState::Cwr,
            3 => CaState::Recovery,
            4 => CaState::Loss,
            v => CaState::Other(v),
        }
    }

    /// True in the states where the sender has cut its window (CWR, Recovery, Loss).
    pub fn is_reducing(self) -> bool {
        matches!(self, CaState::Cwr | CaState::Recovery | CaState::Loss)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CaState::Open => "open",
            CaState::Disorder => "disorder",
            CaState::Cwr => "cwr",
            CaState::Recovery => "recovery",
            CaState::Loss => "loss",
            CaState::Other(_) => "other",
        }
    }
}

/// One sample of a connection's TCP state. Times are microseconds, rates bytes per second,
/// windows in segments of `snd_mss` bytes unless the name says bytes. Fields a kernel older
/// than the field does not fill are `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpState {
    pub ca_state: CaState,
    /// Congestion window, segments.
    pub cwnd: u32,
    /// Slow-start threshold, segments (`u32::MAX`-like huge values mean "not set yet").
    pub ssthresh: u32,
    /// Sender MSS, bytes.
    pub snd_mss: u32,
    /// Path MTU, bytes.
    pub pmtu: u32,
    /// Smoothed RTT and its variance, microseconds.
    pub rtt_us: u32,
    pub rttvar_us: u32,
    /// Retransmission timeout, microseconds.
    pub rto_us: u32,
    /// Segments sent and not yet acknowledged, of which SACKed, marked lost, and retransmitted
    /// (the kernel's in-flight count is unacked - sacked - lost + retrans).
    pub unacked: u32,
    pub sacked: u32,
    pub lost: u32,
    pub retrans: u32,
    /// Segments retransmitted over the connection's life.
    pub total_retrans: u32,
    /// Lowest RTT seen, microseconds.
    pub min_rtt_us: Option<u32>,
    /// Bytes written by the application and not yet sent.
    pub notsent_bytes: Option<u32>,
    /// The most recent delivery-rate sample, bytes per second, and whether the application
    /// (not the network) limited it.
    pub delivery_rate: Option<u64>,
    pub delivery_rate_app_limited: bool,
    /// The pacing rate the congestion control asks for, bytes per second.
    pub pacing_rate: Option<u64>,
    /// Time spent sending data, and the parts of it limited by the peer's receive window and
    /// by the local send buffer, microseconds over the connection's life.
    pub busy_us: Option<u64>,
    pub rwnd_limited_us: Option<u64>,
    pub sndbuf_limited_us: Option<u64>,
    /// Payload bytes sent (retransmissions included), retransmitted, acknowledged by the peer,
    /// and received.
    pub bytes_sent: Option<u64>,
    pub bytes_retrans: Option<u64>,
    pub bytes_acked: Option<u64>,
    pub bytes_received: Option<u64>,
    /// The peer's advertised receive window, bytes.
    pub snd_wnd: Option<u32>,
    /// Retransmission timeouts over the connection's life (Linux 6.7+).
    pub total_rto: Option<u16>,
}

impl TcpState {
    /// The congestion window in bytes.
    pub fn cwnd_bytes(&self) -> u64 {
        u64::from(self.cwnd) * u64::from(self.snd_mss)
    }

    /// Bytes in flight (sent, not acknowledged, not known lost), as the kernel counts them.
    pub fn in_flight_bytes(&self) -> u64 {
        let segs = (self.unacked + self.retrans).saturating_sub(self.sacked + self.lost);
        u64::from(segs) * u64::from(self.snd_mss)
    }

    /// Room the congestion window leaves for new data: the window minus what is in flight and
    /// what is queued in the socket unsent.
    pub fn free_window_bytes(&self) -> u64 {
        self.cwnd_bytes()
            .saturating_sub(self.in_flight_bytes())
            .saturating_sub(u64::from(self.notsent_bytes.unwrap_or(0)))
    }

    /// The bandwidth-delay product the connection measures: delivery rate times minimum RTT.
    pub fn bdp_bytes(&self) -> Option<u64> {
        let rate = self.delivery_rate?;
        let rtt = self.min_rtt_us?;
        Some(rate.saturating_mul(u64::from(rtt)) / 1_000_000)
    }
}

impl CaState {
    /// The kernel's number for the state.
    pub fn code(self) -> u8 {
        match self {
            CaState::Open => 0,
            CaState::Disorder => 1,
            CaState::Cwr => 2,
            CaState::Recovery => 3,
            CaState::Loss => 4,
            CaState::Other(v) => v,
        }
    }
}

impl TcpState {
    /// The state as `key = number` pairs, for the target's report to mcsi initiators
    /// (`X-org.mcsi.TcpReport`); fields the kernel did not fill are left out.
    pub fn report_pairs(&self) -> Vec<(&'static str, u64)> {
        let mut v = vec![
            ("ca_state", u64::from(self.ca_state.code())),
            ("cwnd", u64::from(self.cwnd)),
            ("ssthresh", u64::from(self.ssthresh)),
            ("snd_mss", u64::from(self.snd_mss)),
            ("pmtu", u64::from(self.pmtu)),
            ("rtt_us", u64::from(self.rtt_us)),
            ("rttvar_us", u64::from(self.rttvar_us)),
            ("rto_us", u64::from(self.rto_us)),
            ("unacked", u64::from(self.unacked)),
            ("sacked", u64::from(self.sacked)),
            ("lost", u64::from(self.lost)),
            ("retrans", u64::from(self.retrans)),
            ("total_retrans", u64::from(self.total_retrans)),
            ("app_limited", u64::from(self.delivery_rate_app_limited)),
        ];
        let opt = [
            ("min_rtt_us", self.min_rtt_us.map(u64::from)),
            ("notsent_bytes", self.notsent_bytes.map(u64::from)),
            ("delivery_rate", self.delivery_rate),
            ("pacing_rate", self.pacing_rate),
            ("busy_us", self.busy_us),
            ("rwnd_limited_us", self.rwnd_limited_us),
            ("sndbuf_limited_us", self.sndbuf_limited_us),
            ("bytes_sent", self.bytes_sent),
            ("bytes_retrans", self.bytes_retrans),
            ("bytes_acked", self.bytes_acked),
            ("bytes_received", self.bytes_received),
            ("snd_wnd", self.snd_wnd.map(u64::from)),
            ("total_rto", self.total_rto.map(u64::from)),
        ];
        v.extend(opt.into_iter().filter_map(|(k, x)| x.map(|x| (k, x))));
        v
    }

    /// A state from a report's pairs; unknown keys are ignored, missing ones are zero or None.
    pub fn from_report(pairs: &[(String, u64)]) -> TcpState {
        let get = |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
        let u32_of = |k: &str| get(k).map(|v| u32::try_from(v).unwrap_or(u32::MAX));
        let u = |k: &str| u32_of(k).unwrap_or(0);
        TcpState {
            ca_state: CaState::from_raw(
                get("ca_state").map_or(0, |v| u8::try_from(v).unwrap_or(u8::MAX)),
            ),
            cwnd: u("cwnd"),
            ssthresh: u("ssthresh"),
            snd_mss: u("snd_mss"),
            pmtu: u("pmtu"),
            rtt_us: u("rtt_us"),
            rttvar_us: u("rttvar_us"),
            rto_us: u("rto_us"),
            unacked: u("unacked"),
            sacked: u("sacked"),
            lost: u("lost"),
            retrans: u("retrans"),
            total_retrans: u("total_retrans"),
            min_rtt_us: u32_of("min_rtt_us"),
            notsent_bytes: u32_of("notsent_bytes"),
            delivery_rate: get("delivery_rate"),
            delivery_rate_app_limited: get("app_limited").is_some_and(|v| v != 0),
            pacing_rate: get("pacing_rate"),
            busy_us: get("busy_us"),
            rwnd_limited_us: get("rwnd_limited_us"),
            sndbuf_limited_us: get("sndbuf_limited_us"),
            bytes_sent: get("bytes_sent"),
            bytes_retrans: get("bytes_retrans"),
            bytes_acked: get("bytes_acked"),
            bytes_received: get("bytes_received"),
            snd_wnd: u32_of("snd_wnd"),
            total_rto: get("total_rto").map(|v| u16::try_from(v).unwrap_or(u16::MAX)),
        }
    }
}

/// Whether a field ending `size` bytes after `offset` lies within the `len` bytes the kernel wrote.
fn filled(len: usize, offset: usize, size: usize) -> bool {
    offset + size <= len
}

macro_rules! opt {
    ($raw:ident, $len:ident, $field:ident) => {
        filled($len, offset_of!(RawTcpInfo, $field), {
            fn sz<T>(_: &T) -> usize {
                size_of::<T>()
            }
            sz(&$raw.$field)
        })
        .then_some($raw.$field)
    };
}

fn decode(raw: &RawTcpInfo, len: usize) -> TcpState {
    TcpState {
        ca_state: CaState::from_raw(raw.ca_state),
        cwnd: raw.snd_cwnd,
        ssthresh: raw.snd_ssthresh,
        snd_mss: raw.snd_mss,
        pmtu: raw.pmtu,
        rtt_us: raw.rtt,
        rttvar_us: raw.rttvar,
        rto_us: raw.rto,
        unacked: raw.unacked,
        sacked: raw.sacked,
        lost: raw.lost,
        retrans: raw.retrans,
        total_retrans: raw.total_retrans,
        min_rtt_us: opt!(raw, len, min_rtt),
        notsent_bytes: opt!(raw, len, notsent_bytes),
        delivery_rate: opt!(raw, len, delivery_rate),
        delivery_rate_app_limited: raw.app_limited_tfo & 1 != 0,
        pacing_rate: opt!(raw, len, pacing_rate),
        busy_us: opt!(raw, len, busy_time),
        rwnd_limited_us: opt!(raw, len, rwnd_limited),
        sndbuf_limited_us: opt!(raw, len, sndbuf_limited),
        bytes_sent: opt!(raw, len, bytes_sent),
        bytes_retrans: opt!(raw, len, bytes_retrans),
        bytes_acked: opt!(raw, len, bytes_acked),
        bytes_received: opt!(raw, len, bytes_received),
        snd_wnd: opt!(raw, len, snd_wnd),
        total_rto: opt!(raw, len, total_rto),
    }
}

/// Sample `TCP_INFO` of a connected TCP socket. Errors are the getsockopt errno (ENOTSOCK,
/// EOPNOTSUPP for a socket that is not TCP, EBADF).
#[cfg(target_os = "linux")]
pub fn tcp_state(sock: impl AsFd) -> std::io::Result<TcpState> {
    let mut raw = RawTcpInfo::default();
    let mut len = size_of::<RawTcpInfo>() as libc::socklen_t;
    // SAFETY: the pointer and length describe `raw`, plain old data that outlives the call;
    // the kernel writes at most `len` bytes and stores the count it wrote in `len`.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut raw as *mut RawTcpInfo).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(decode(&raw, len as usize))
}

#[cfg(not(target_os = "linux"))]
pub fn tcp_state(_sock: impl AsFd) -> std::io::Result<TcpState> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "TCP_INFO is only read on Linux",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Offsets as `linux/tcp.h` defines them (checked against the C header with offsetof; the
    /// fields after `snd_wnd` are Linux 6.7's additions).
    #[test]
    fn layout_matches_the_kernel_header() {
        assert_eq!(offset_of!(RawTcpInfo, rto), 8);
        assert_eq!(offset_of!(RawTcpInfo, pacing_rate), 104);
        assert_eq!(offset_of!(RawTcpInfo, notsent_bytes), 144);
        assert_eq!(offset_of!(RawTcpInfo, min_rtt), 148);
        assert_eq!(offset_of!(RawTcpInfo, delivery_rate), 160);
        assert_eq!(offset_of!(RawTcpInfo, busy_time), 168);
        assert_eq!(offset_of!(RawTcpInfo, rwnd_limited), 176);
        assert_eq!(offset_of!(RawTcpInfo, sndbuf_limited), 184);
        assert_eq!(offset_of!(RawTcpInfo, delivered), 192);
        assert_eq!(offset_of!(RawTcpInfo, bytes_sent), 200);
        assert_eq!(offset_of!(RawTcpInfo, bytes_retrans), 208);
        assert_eq!(offset_of!(RawTcpInfo, snd_wnd), 228);
        assert_eq!(offset_of!(RawTcpInfo, total_rto), 240);
        assert_eq!(offset_of!(RawTcpInfo, total_rto_time), 244);
        assert_eq!(size_of::<RawTcpInfo>(), 248);
    }

    #[test]
    fn fields_beyond_the_kernels_length_are_none() {
        let raw = RawTcpInfo {
            min_rtt: 5,
            delivery_rate: 7,
            snd_wnd: 9,
            ..RawTcpInfo::default()
        };
        // A 4.9 kernel's struct ends after data_segs_out (160 bytes).
        let s = decode(&raw, 160);
        assert_eq!(s.min_rtt_us, Some(5));
        assert_eq!(s.delivery_rate, None);
        assert_eq!(s.snd_wnd, None);
        let s = decode(&raw, 232);
        assert_eq!(s.delivery_rate, Some(7));
        assert_eq!(s.snd_wnd, Some(9));
        assert_eq!(s.total_rto, None);
    }

    #[test]
    fn windows_in_bytes() {
        let s = TcpState {
            cwnd: 10,
            snd_mss: 1000,
            unacked: 6,
            sacked: 1,
            lost: 1,
            retrans: 1,
            notsent_bytes: Some(1500),
            delivery_rate: Some(1_000_000),
            min_rtt_us: Some(20_000),
            ..TcpState::default()
        };
        assert_eq!(s.cwnd_bytes(), 10_000);
        assert_eq!(s.in_flight_bytes(), 5_000);
        assert_eq!(s.free_window_bytes(), 3_500);
        assert_eq!(s.bdp_bytes(), Some(20_000));
    }

    #[test]
    fn report_pairs_round_trip() {
        let s = TcpState {
            ca_state: CaState::Recovery,
            cwnd: 42,
            snd_mss: 1448,
            rtt_us: 40_000,
            min_rtt_us: Some(39_000),
            delivery_rate: Some(6_000_000),
            delivery_rate_app_limited: true,
            total_rto: Some(3),
            ..TcpState::default()
        };
        let pairs: Vec<(String, u64)> = s
            .report_pairs()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(TcpState::from_report(&pairs), s);
        assert_eq!(TcpState::from_report(&[]), TcpState::default());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn samples_a_loopback_connection() {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        c.write_all(&[7u8; 100_000]).unwrap();
        let mut got = vec![0u8; 100_000];
        s.read_exact(&mut got).unwrap();
        let t = tcp_state(&c).unwrap();
        // A fresh Linux connection starts with an initial window of 10 segments (RFC 6928)
        // and loopback's MSS is far above Ethernet's 1460.
        assert!(t.cwnd >= 10, "{t:?}");
        assert!(t.snd_mss > 1460, "{t:?}");
        assert!(t.min_rtt_us.is_some(), "{t:?}");
        assert!(t.bytes_acked.is_some_and(|b| b >= 100_000), "{t:?}");
        assert!(t.delivery_rate.is_some_and(|r| r > 0), "{t:?}");
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(tcp_state(&udp).is_err());
    }
}
