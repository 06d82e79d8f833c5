//! Where each connection of a session goes: the source it leaves from (an address of this host
//! or an interface) and the target portal it connects to. Connection `i` takes bind `i mod n`
//! and portal `i mod m`, so two binds on a multi-homed host put a two-connection session on two
//! routes.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

/// The source of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bind {
    /// Leave from this address of the host (`bind(2)` before `connect`): the host's policy
    /// routing picks the route by source address.
    Addr(IpAddr),
    /// Leave through this interface (`SO_BINDTODEVICE`), whatever the routing table prefers.
    Iface(String),
}

/// Why a `--bind` value names no address or interface of this host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindError {
    #[error("empty: give an address of this host or an interface name")]
    Empty,
    #[error("{ip} is not an address of this host (its interfaces have: {local})")]
    NotLocal { ip: IpAddr, local: String },
    #[error("cannot bind {ip}: {why}")]
    Bind { ip: IpAddr, why: String },
    #[error("'{0}' is neither an IP address nor an interface name")]
    Neither(String),
    #[error("no interface named '{name}' on this host (it has: {present})")]
    NoInterface { name: String, present: String },
}

impl Bind {
    /// Parses `ADDR` or `IFACE` and checks it against this host: the address must be one of the
    /// host's, the interface must exist.
    pub fn parse(s: &str) -> Result<Bind, BindError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(BindError::Empty);
        }
        if let Ok(ip) = s.parse::<IpAddr>() {
            // Binding a UDP socket is the kernel's own test of "an address of this host".
            return match std::net::UdpSocket::bind(SocketAddr::new(ip, 0)) {
                Ok(_) => Ok(Bind::Addr(ip)),
                Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => {
                    Err(BindError::NotLocal {
                        ip,
                        local: host_addresses().join(", "),
                    })
                }
                Err(e) => Err(BindError::Bind {
                    ip,
                    why: e.to_string(),
                }),
            };
        }
        if s.len() > 15 || s.contains(['/', ' ', ':']) || s == "." || s == ".." {
            return Err(BindError::Neither(s.to_string()));
        }
        if !std::path::Path::new("/sys/class/net").join(s).exists() {
            return Err(BindError::NoInterface {
                name: s.to_string(),
                present: interfaces().join(", "),
            });
        }
        Ok(Bind::Iface(s.to_string()))
    }

    /// Applies the bind to a socket about to connect to `to`. An address of the other family
    /// than `to` is an error.
    pub(crate) fn apply(
        &self,
        sock: &tokio::net::TcpSocket,
        to: SocketAddr,
    ) -> std::io::Result<()> {
        match self {
            Bind::Addr(ip) => {
                if ip.is_ipv4() != to.is_ipv4() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!("source {ip} and target {to} are not of the same IP family"),
                    ));
                }
                sock.bind(SocketAddr::new(*ip, 0))
            }
            Bind::Iface(name) => sock.bind_device(Some(name.as_bytes())),
        }
    }
}

impl fmt::Display for Bind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Bind::Addr(ip) => write!(f, "{ip}"),
            Bind::Iface(name) => write!(f, "dev {name}"),
        }
    }
}

/// The host's interface names.
fn interfaces() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The host's IPv4 addresses, for messages (from /proc/net/fib_trie's local entries would be
/// exact; the interfaces' names are enough to point the user at `ip addr`).
fn host_addresses() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(s) = std::fs::read_to_string("/proc/net/fib_trie") {
        let lines: Vec<&str> = s.lines().collect();
        for w in lines.windows(2) {
            if w[1].contains("/32 host LOCAL") {
                if let Some(a) = w[0].trim().strip_prefix("|-- ") {
                    if !v.iter().any(|x| x == a) {
                        v.push(a.to_string());
                    }
                }
            }
        }
    }
    if v.is_empty() {
        v.push("see ip addr".into());
    }
    v
}

/// Item `index mod len` of `v`, the one connection `index` takes; `None` when `v` is empty.
pub fn nth<T>(v: &[T], index: usize) -> Option<&T> {
    v.get(index.checked_rem(v.len())?)
}

/// The route of connection `index`: its bind, if any, and its portal (`HOST:PORT`).
pub fn of<'a>(
    binds: &'a [Bind],
    portals: &'a [String],
    default_portal: &'a str,
    index: usize,
) -> (Option<&'a Bind>, &'a str) {
    let portal = nth(portals, index).map_or(default_portal, String::as_str);
    (nth(binds, index), portal)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn binds_are_checked_against_the_host() {
        assert_eq!(
            Bind::parse("127.0.0.1").unwrap(),
            Bind::Addr("127.0.0.1".parse().unwrap())
        );
        assert_eq!(Bind::parse("lo").unwrap(), Bind::Iface("lo".into()));
        let e = Bind::parse("192.0.2.77").unwrap_err();
        assert!(matches!(e, BindError::NotLocal { .. }), "{e}");
        let e = e.to_string();
        assert!(
            e.contains("not an address of this host") && e.contains("127.0.0.1"),
            "{e}"
        );
        let e = Bind::parse("nosuchif0").unwrap_err();
        assert!(matches!(e, BindError::NoInterface { .. }), "{e}");
        let e = e.to_string();
        assert!(
            e.contains("no interface named 'nosuchif0'") && e.contains("lo"),
            "{e}"
        );
        assert_eq!(Bind::parse("a/b"), Err(BindError::Neither("a/b".into())));
        assert_eq!(Bind::parse(""), Err(BindError::Empty));
    }

    #[test]
    fn connections_take_binds_and_portals_in_turn() {
        let b = vec![Bind::Iface("a".into()), Bind::Iface("b".into())];
        let p = vec!["x:1".to_string()];
        assert_eq!(of(&b, &p, "d:3260", 0), (Some(&b[0]), "x:1"));
        assert_eq!(of(&b, &p, "d:3260", 3), (Some(&b[1]), "x:1"));
        assert_eq!(of(&[], &[], "d:3260", 5), (None, "d:3260"));
    }
}
