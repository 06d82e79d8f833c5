//! The congestion-control algorithm of a socket (`TCP_CONGESTION`).
//!
//! A [`Congestion`] is a checked name (at most 15 bytes, as the kernel's `TCP_CA_NAME_MAX`
//! allows) that is `Copy`, so configuration structs can carry it. [`Congestion::check`] asks
//! the kernel whether a socket can use it, and every refusal says what the kernel offers.

use socket2::SockRef;
use std::fmt;
use std::os::fd::AsFd;
use std::str::FromStr;

/// `TCP_CA_NAME_MAX` minus the terminating NUL.
const MAX_NAME: usize = 15;

const AVAILABLE: &str = "/proc/sys/net/ipv4/tcp_available_congestion_control";
const ALLOWED: &str = "/proc/sys/net/ipv4/tcp_allowed_congestion_control";
const DEFAULT: &str = "/proc/sys/net/ipv4/tcp_congestion_control";

/// A congestion-control algorithm's name, such as `cubic`, `reno` or `bbr`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Congestion {
    len: u8,
    name: [u8; MAX_NAME],
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CongestionError {
    #[error("congestion control {0:?} is not a valid name: use 1 to 15 lowercase letters, digits or '_' (for example cubic, reno, bbr)")]
    BadName(String),
    #[error("congestion control {name:?} is not available in this kernel; it offers: {available} (net.ipv4.tcp_available_congestion_control)")]
    NotAvailable { name: String, available: String },
    #[error("congestion control {name:?} is available but this process may not choose it: unprivileged sockets may use {allowed} (net.ipv4.tcp_allowed_congestion_control); run with CAP_NET_ADMIN or allow it with `sysctl -w net.ipv4.tcp_allowed_congestion_control='{allowed} {name}'`")]
    NotAllowed { name: String, allowed: String },
    #[error("setting congestion control {name:?} on a socket: {why}")]
    Io { name: String, why: String },
}

impl Congestion {
    /// Check the spelling only; [`Congestion::check`] asks the kernel.
    pub fn new(name: &str) -> Result<Congestion, CongestionError> {
        let ok = !name.is_empty()
            && name.len() <= MAX_NAME
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !ok {
            return Err(CongestionError::BadName(name.to_string()));
        }
        let mut buf = [0u8; MAX_NAME];
        buf[..name.len()].copy_from_slice(name.as_bytes());
        Ok(Congestion {
            len: name.len() as u8,
            name: buf,
        })
    }

    pub fn as_str(&self) -> &str {
        // Built from a &str of ASCII bytes in `new`.
        std::str::from_utf8(&self.name[..usize::from(self.len)]).unwrap_or("")
    }

    /// Set this algorithm on `sock`. A refusal names what the kernel offers.
    pub fn apply(&self, sock: impl AsFd) -> Result<(), CongestionError> {
        let fd = sock.as_fd();
        SockRef::from(&fd)
            .set_tcp_congestion(self.as_str().as_bytes())
            .map_err(|e| self.explain(&e))
    }

    /// Whether a socket of this process can use the algorithm: tried on a fresh, unconnected
    /// TCP socket, so that a bad name is reported when a tool starts rather than when its
    /// first connection opens.
    pub fn check(&self) -> Result<(), CongestionError> {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).map_err(
            |e| CongestionError::Io {
                name: self.to_string(),
                why: format!("cannot open a socket to try it: {e}"),
            },
        )?;
        self.apply(&s)
    }

    fn explain(&self, e: &std::io::Error) -> CongestionError {
        let name = self.to_string();
        match e.raw_os_error() {
            Some(libc::ENOENT) => CongestionError::NotAvailable {
                name,
                available: read_list(AVAILABLE),
            },
            Some(libc::EPERM) => CongestionError::NotAllowed {
                name,
                allowed: read_list(ALLOWED),
            },
            _ => CongestionError::Io {
                name,
                why: e.to_string(),
            },
        }
    }
}

fn read_list(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|e| format!("(cannot read {path}: {e})"))
}

/// The algorithms this kernel has loaded.
pub fn available() -> Vec<String> {
    std::fs::read_to_string(AVAILABLE)
        .map(|s| s.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// The default algorithm of this network namespace (what a socket gets when nothing is set).
pub fn system_default() -> Option<String> {
    std::fs::read_to_string(DEFAULT)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The algorithm `sock` runs now.
pub fn current(sock: impl AsFd) -> std::io::Result<String> {
    let fd = sock.as_fd();
    let raw = SockRef::from(&fd).tcp_congestion()?;
    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
    Ok(String::from_utf8_lossy(&raw[..end]).into_owned())
}

impl FromStr for Congestion {
    type Err = CongestionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Congestion::new(s)
    }
}

impl fmt::Display for Congestion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for Congestion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Congestion({})", self.as_str())
    }
}

impl serde::Serialize for Congestion {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Congestion {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Congestion::new(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_for_spelling() {
        assert_eq!(Congestion::new("cubic").unwrap().as_str(), "cubic");
        assert_eq!(Congestion::new("bbr").unwrap().to_string(), "bbr");
        for bad in ["", "CUBIC", "cu bic", "a-b", "sixteen_letters_"] {
            let e = Congestion::new(bad).unwrap_err();
            assert!(e.to_string().contains("not a valid name"), "{e}");
        }
        assert!(Congestion::new("fifteen_letters").is_ok());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_kernel_refuses_an_unknown_name_and_says_what_it_offers() {
        let e = Congestion::new("nosuchcc").unwrap().check().unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, CongestionError::NotAvailable { .. }), "{msg}");
        // Every Linux kernel has reno built in.
        assert!(msg.contains("reno"), "{msg}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reno_is_set_and_read_back() {
        let reno = Congestion::new("reno").unwrap();
        reno.check().unwrap();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        reno.apply(&c).unwrap();
        assert_eq!(current(&c).unwrap(), "reno");
        assert!(available().iter().any(|a| a == "reno"));
        assert!(system_default().is_some());
    }
}
