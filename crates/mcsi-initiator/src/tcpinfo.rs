//! The kernel's TCP_INFO for a connection's socket (Linux), for statistics and for schedulers
//! that look at congestion state.

use std::os::fd::RawFd;

/// A few fields of `struct tcp_info`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// Congestion window, in segments.
    pub cwnd: u32,
    /// Slow-start threshold, in segments.
    pub ssthresh: u32,
    /// Smoothed RTT, microseconds.
    pub rtt_us: u32,
    /// RTT variance, microseconds.
    pub rttvar_us: u32,
    /// Sender MSS, bytes.
    pub snd_mss: u32,
    /// Retransmitted segments over the connection's life.
    pub total_retrans: u32,
    /// Segments currently unacknowledged.
    pub unacked: u32,
}

/// Read TCP_INFO from a connected TCP socket. Errors are the getsockopt errno.
#[cfg(target_os = "linux")]
pub fn tcp_info(fd: RawFd) -> std::io::Result<TcpStats> {
    // SAFETY: tcp_info is plain old data; zeroed is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the pointer and length describe `info`, which outlives the call; the kernel writes
    // at most `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(TcpStats {
        cwnd: info.tcpi_snd_cwnd,
        ssthresh: info.tcpi_snd_ssthresh,
        rtt_us: info.tcpi_rtt,
        rttvar_us: info.tcpi_rttvar,
        snd_mss: info.tcpi_snd_mss,
        total_retrans: info.tcpi_total_retrans,
        unacked: info.tcpi_unacked,
    })
}

#[cfg(not(target_os = "linux"))]
pub fn tcp_info(_fd: RawFd) -> std::io::Result<TcpStats> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "TCP_INFO is only read on Linux",
    ))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn reads_a_loopback_connection() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_s, _) = l.accept().unwrap();
        let t = tcp_info(c.as_raw_fd()).unwrap();
        // A fresh Linux connection starts with an initial window of 10 segments (RFC 6928)
        // and loopback's MSS is far above Ethernet's 1460.
        assert!(t.cwnd >= 10, "{t:?}");
        assert!(t.snd_mss > 1460, "{t:?}");
        assert!(tcp_info(-1).is_err());
    }
}
