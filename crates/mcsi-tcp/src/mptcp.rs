//! Multipath TCP (RFC 8684, Linux 5.6 and later): one connection whose subflows the kernel
//! spreads over several paths. A socket is opened with `IPPROTO_MPTCP` and is then used as a
//! TCP socket; when the peer does not speak MPTCP the kernel falls back to plain TCP on the same
//! socket. Which paths the subflows take is the path manager's (`ip mptcp endpoint`, `ip mptcp
//! limits`), not the application's.

use socket2::{Domain, Protocol, Socket, Type};
use std::net::SocketAddr;

/// `SOL_MPTCP` and `MPTCP_INFO` (linux/mptcp.h).
const SOL_MPTCP: libc::c_int = 284;
const MPTCP_INFO: libc::c_int = 1;

/// Why an MPTCP socket could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum MptcpError {
    #[error("MPTCP is not available on this host ({0}): it needs Linux 5.6 or later with net.mptcp.enabled = 1 (sysctl -w net.mptcp.enabled=1); leave MPTCP off to use plain TCP")]
    Unavailable(std::io::Error),
    #[error("opening an MPTCP socket: {0}")]
    Io(std::io::Error),
}

/// A stream socket for `addr`'s family with `IPPROTO_MPTCP`.
pub fn socket(addr: &SocketAddr) -> Result<Socket, MptcpError> {
    Socket::new(
        Domain::for_address(*addr),
        Type::STREAM,
        Some(Protocol::MPTCP),
    )
    .map_err(|e| match e.raw_os_error() {
        Some(libc::EPROTONOSUPPORT | libc::ENOPROTOOPT | libc::EINVAL | libc::EAFNOSUPPORT) => {
            MptcpError::Unavailable(e)
        }
        _ => MptcpError::Io(e),
    })
}

/// What the kernel says of an MPTCP socket's subflows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MptcpState {
    /// Subflows established besides the first one (`mptcpi_subflows`).
    pub extra_subflows: u8,
    /// The path manager's limit on them (`mptcpi_subflows_max`).
    pub subflows_max: u8,
}

/// `MPTCP_INFO` of `sock`; None for a plain TCP socket, one that fell back to TCP, or a kernel
/// without it.
pub fn state(sock: &impl std::os::fd::AsRawFd) -> Option<MptcpState> {
    // struct mptcp_info starts with u8 mptcpi_subflows, add_addr_signal, add_addr_accepted,
    // subflows_max; the kernel copies at most the length given.
    let mut buf = [0u8; 64];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: buf outlives the call and len is its size; the kernel writes at most len bytes.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            SOL_MPTCP,
            MPTCP_INFO,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r != 0 || len < 4 {
        return None;
    }
    Some(MptcpState {
        extra_subflows: buf[0],
        subflows_max: buf[3],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_tcp_socket_has_no_mptcp_state() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert_eq!(state(&l), None);
    }

    /// Where the host has MPTCP, a connection over loopback runs it end to end.
    #[test]
    fn an_mptcp_socket_connects_over_loopback() {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let l = match socket(&addr) {
            Ok(s) => s,
            Err(MptcpError::Unavailable(e)) => {
                assert!(
                    std::env::var("CI").as_deref() != Ok("true"),
                    "CI=true needs MPTCP: {e}"
                );
                // Counted where scripts/test counts skips ($MCSI_SKIP_LOG), not only printed.
                let why = format!("an_mptcp_socket_connects_over_loopback: no MPTCP here: {e}");
                eprintln!("{why} (SKIPPED)");
                if let Some(path) = std::env::var_os("MCSI_SKIP_LOG") {
                    use std::io::Write;
                    if let Ok(mut f) = std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(path)
                    {
                        let _ = writeln!(f, "{why}");
                    }
                }
                return;
            }
            Err(e) => panic!("{e}"),
        };
        l.bind(&addr.into()).unwrap();
        l.listen(1).unwrap();
        let at = l.local_addr().unwrap();
        let c = socket(&addr).unwrap();
        c.connect(&at).unwrap();
        let (a, _) = l.accept().unwrap();
        let st = state(&c).expect("MPTCP_INFO on the connected socket");
        assert_eq!(st.extra_subflows, 0, "{st:?}");
        assert!(state(&a).is_some());
    }
}
