//! The few system calls the emulator needs: TUN devices, interface addresses, a network
//! namespace, signals and a precise wait. Linux only.

use std::ffi::CStr;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// What went wrong while setting the link up, and what would fix it.
#[derive(Debug, thiserror::Error)]
pub enum SysError {
    #[error("{what}: {err}; mcsi link needs root or CAP_NET_ADMIN")]
    Permission { what: String, err: io::Error },
    #[error("{what}: {err}; {hint}")]
    Missing {
        what: String,
        hint: &'static str,
        err: io::Error,
    },
    #[error("{what}: {err}")]
    Io { what: String, err: io::Error },
}

pub(crate) fn last(what: impl Into<String>) -> SysError {
    classify(what.into(), io::Error::last_os_error())
}

fn classify(what: String, source: io::Error) -> SysError {
    match source.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => SysError::Permission { what, err: source },
        _ => SysError::Io { what, err: source },
    }
}

fn cvt(r: libc::c_int, what: impl FnOnce() -> String) -> Result<libc::c_int, SysError> {
    if r < 0 {
        Err(last(what()))
    } else {
        Ok(r)
    }
}

#[repr(C)]
struct IfReqFlags {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

#[repr(C)]
struct IfReqAddr {
    name: [libc::c_char; libc::IFNAMSIZ],
    addr: libc::sockaddr_in,
    _pad: [u8; 8],
}

#[repr(C)]
struct IfReqInt {
    name: [libc::c_char; libc::IFNAMSIZ],
    value: libc::c_int,
    _pad: [u8; 20],
}

fn ifname(name: &str) -> Result<[libc::c_char; libc::IFNAMSIZ], SysError> {
    let mut out = [0 as libc::c_char; libc::IFNAMSIZ];
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.bytes().any(|b| b == 0 || b == b'/')
    {
        return Err(SysError::Io {
            what: format!("interface name '{name}'"),
            err: io::Error::from(io::ErrorKind::InvalidInput),
        });
    }
    for (o, b) in out.iter_mut().zip(name.bytes()) {
        *o = b as libc::c_char;
    }
    Ok(out)
}

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;

/// Opens a TUN device (layer 3, no packet information header), non-blocking.
pub(crate) fn open_tun(name: &str) -> Result<OwnedFd, SysError> {
    let path = c"/dev/net/tun";
    // SAFETY: a valid NUL-terminated path; the result is checked.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ENODEV) | Some(libc::ENXIO) => SysError::Missing {
                what: "open /dev/net/tun".into(),
                hint: "the kernel lacks TUN support here: load it (modprobe tun) or create the node (mknod /dev/net/tun c 10 200)",
                err: e,
            },
            _ => classify("open /dev/net/tun".into(), e),
        });
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = IfReqFlags {
        name: ifname(name)?,
        flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
        _pad: [0; 22],
    };
    // SAFETY: TUNSETIFF reads and writes a struct ifreq, which IfReqFlags lays out.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF as _, &mut req) };
    cvt(r, || format!("create TUN device {name} (TUNSETIFF)"))?;
    Ok(fd)
}

/// Removes a persistent TUN device left behind by another process.
pub(crate) fn remove_persistent_tun(name: &str) -> Result<(), SysError> {
    let fd = open_tun(name)?;
    // SAFETY: TUNSETPERSIST takes an integer argument.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETPERSIST as _, 0 as libc::c_ulong) };
    cvt(r, || format!("clear persistence of {name}"))?;
    Ok(())
}

fn inet_socket() -> Result<OwnedFd, SysError> {
    // SAFETY: plain socket(2); checked.
    let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    let s = cvt(s, || "socket(AF_INET)".into())?;
    // SAFETY: s is a fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(s) })
}

fn sockaddr(a: Ipv4Addr) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.octets()),
        },
        sin_zero: [0; 8],
    }
}

fn set_addr(
    s: RawFd,
    req: libc::c_ulong,
    name: &str,
    a: Ipv4Addr,
    what: &str,
) -> Result<(), SysError> {
    let mut r = IfReqAddr {
        name: ifname(name)?,
        addr: sockaddr(a),
        _pad: [0; 8],
    };
    // SAFETY: SIOCSIF{ADDR,DSTADDR,NETMASK} read a struct ifreq with a sockaddr_in.
    let rc = unsafe { libc::ioctl(s, req as _, &mut r) };
    cvt(rc, || format!("set {what} {a} on {name}"))?;
    Ok(())
}

/// Gives `name` the point-to-point addresses local <-> peer (the kernel adds the host route
/// to the peer), sets its MTU and brings it up. Runs in the caller's network namespace.
pub(crate) fn configure_p2p(
    name: &str,
    local: Ipv4Addr,
    peer: Ipv4Addr,
    mtu: u32,
) -> Result<(), SysError> {
    let s = inet_socket()?;
    let fd = s.as_raw_fd();
    set_addr(fd, libc::SIOCSIFADDR, name, local, "address")?;
    set_addr(
        fd,
        libc::SIOCSIFNETMASK,
        name,
        Ipv4Addr::new(255, 255, 255, 255),
        "netmask",
    )?;
    set_addr(fd, libc::SIOCSIFDSTADDR, name, peer, "peer address")?;
    let mut m = IfReqInt {
        name: ifname(name)?,
        value: mtu as libc::c_int,
        _pad: [0; 20],
    };
    // SAFETY: SIOCSIFMTU reads ifr_mtu (an int after the name).
    let rc = unsafe { libc::ioctl(fd, libc::SIOCSIFMTU as _, &mut m) };
    cvt(rc, || format!("set MTU {mtu} on {name}"))?;
    set_up(fd, name)
}

/// Adds `addr` (/32) as a further address of `name`, under the alias label `name:k`.
pub(crate) fn add_alias(name: &str, k: usize, addr: Ipv4Addr) -> Result<(), SysError> {
    let s = inet_socket()?;
    let fd = s.as_raw_fd();
    let alias = format!("{name}:{k}");
    set_addr(fd, libc::SIOCSIFADDR, &alias, addr, "address")?;
    set_addr(
        fd,
        libc::SIOCSIFNETMASK,
        &alias,
        Ipv4Addr::new(255, 255, 255, 255),
        "netmask",
    )
}

/// Routes `addr` (/32) through the interface `dev`.
pub(crate) fn add_host_route(dev: &str, addr: Ipv4Addr) -> Result<(), SysError> {
    let s = inet_socket()?;
    let name = std::ffi::CString::new(dev).map_err(|_| SysError::Io {
        what: format!("interface name '{dev}'"),
        err: io::Error::from(io::ErrorKind::InvalidInput),
    })?;
    // SAFETY: rtentry is plain data; all-zero is a valid empty entry.
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    // SAFETY: a sockaddr_in fits in (and is read through) a struct sockaddr.
    unsafe {
        std::ptr::write(
            (&mut rt.rt_dst as *mut libc::sockaddr).cast::<libc::sockaddr_in>(),
            sockaddr(addr),
        );
        std::ptr::write(
            (&mut rt.rt_genmask as *mut libc::sockaddr).cast::<libc::sockaddr_in>(),
            sockaddr(Ipv4Addr::new(255, 255, 255, 255)),
        );
    }
    rt.rt_flags = libc::RTF_UP | libc::RTF_HOST;
    rt.rt_dev = name.as_ptr().cast_mut();
    // SAFETY: SIOCADDRT reads the rtentry and the device name it points to, both alive here.
    let rc = unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCADDRT as _, &mut rt) };
    cvt(rc, || format!("route {addr} through {dev}"))?;
    Ok(())
}

/// Brings an interface up (also used for the namespace's loopback).
pub(crate) fn link_up(name: &str) -> Result<(), SysError> {
    let s = inet_socket()?;
    set_up(s.as_raw_fd(), name)
}

fn set_up(fd: RawFd, name: &str) -> Result<(), SysError> {
    let mut f = IfReqFlags {
        name: ifname(name)?,
        flags: 0,
        _pad: [0; 22],
    };
    // SAFETY: SIOCGIFFLAGS / SIOCSIFFLAGS use ifr_flags.
    let rc = unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS as _, &mut f) };
    cvt(rc, || format!("read flags of {name}"))?;
    f.flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: as above.
    let rc = unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS as _, &mut f) };
    cvt(rc, || format!("bring {name} up"))?;
    Ok(())
}

/// Turns IPv6 off on an interface so that it sends no router or multicast chatter. Best effort:
/// a kernel without IPv6 has nothing to turn off.
pub(crate) fn disable_ipv6(name: &str) {
    let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1");
}

/// Moves the calling thread into a new network namespace and returns a descriptor of it.
pub(crate) fn unshare_net() -> Result<OwnedFd, SysError> {
    // SAFETY: affects only the calling thread's namespaces.
    let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EINVAL) => SysError::Missing {
                what: "unshare(CLONE_NEWNET)".into(),
                hint: "the kernel lacks network namespaces (CONFIG_NET_NS)",
                err: e,
            },
            _ => classify(
                "create a network namespace (unshare CLONE_NEWNET)".into(),
                e,
            ),
        });
    }
    let p = c"/proc/thread-self/ns/net";
    // SAFETY: valid path; checked.
    let fd = unsafe { libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    let fd = cvt(fd, || "open /proc/thread-self/ns/net".into())?;
    // SAFETY: fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Local IPv4 addresses of the caller's namespace.
pub(crate) fn local_ipv4() -> Vec<Ipv4Addr> {
    let mut out = vec![];
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below; entries are read only while it lives.
    unsafe {
        if libc::getifaddrs(&mut head) != 0 {
            return out;
        }
        let mut p = head;
        while !p.is_null() {
            let a = (*p).ifa_addr;
            if !a.is_null() && i32::from((*a).sa_family) == libc::AF_INET {
                let sin = &*(a as *const libc::sockaddr_in);
                out.push(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()));
            }
            let d = (*p).ifa_ifu;
            if !d.is_null() && i32::from((*d).sa_family) == libc::AF_INET {
                let sin = &*(d as *const libc::sockaddr_in);
                out.push(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()));
            }
            p = (*p).ifa_next;
        }
        libc::freeifaddrs(head);
    }
    out
}

/// An eventfd to wake the forwarding thread.
pub(crate) fn eventfd() -> Result<OwnedFd, SysError> {
    // SAFETY: plain eventfd(2); checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    let fd = cvt(fd, || "eventfd".into())?;
    // SAFETY: fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(crate) fn eventfd_signal(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64.
    let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Waits until one of `fds` is readable or `timeout_ns` passed (nanosecond resolution).
/// Returns which fds are readable.
pub(crate) fn wait_readable<const N: usize>(fds: [RawFd; N], timeout_ns: Option<u64>) -> [bool; N] {
    let mut p = fds.map(|fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    });
    let ts = timeout_ns.map(|t| libc::timespec {
        tv_sec: (t / 1_000_000_000) as libc::time_t,
        tv_nsec: (t % 1_000_000_000) as libc::c_long,
    });
    let tp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: p holds N pollfds; tp is null or points to a live timespec.
    let r = unsafe { libc::ppoll(p.as_mut_ptr(), N as libc::nfds_t, tp, std::ptr::null()) };
    let mut out = [false; N];
    if r > 0 {
        for (o, q) in out.iter_mut().zip(p.iter()) {
            *o = q.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0;
        }
    }
    out
}

/// Reads one packet; `Ok(None)` when nothing is waiting.
pub(crate) fn read_packet(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: buf is valid for buf.len() bytes.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        };
    }
    Ok(Some(n as usize))
}

pub(crate) fn write_packet(fd: RawFd, pkt: &[u8]) -> io::Result<()> {
    // SAFETY: pkt is valid for pkt.len() bytes.
    let n = unsafe { libc::write(fd, pkt.as_ptr().cast(), pkt.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Lets the calling thread's timers fire as exactly as the kernel can (default slack: 50 us).
pub(crate) fn precise_timers() {
    // SAFETY: prctl with integer arguments.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
    }
}

/// Asks for real-time (SCHED_FIFO) scheduling of the calling thread so that its timers are
/// not delayed by other busy processes. Best effort: returns false if refused.
pub(crate) fn realtime_priority(prio: libc::c_int) -> bool {
    let p = libc::sched_param {
        sched_priority: prio,
    };
    // SAFETY: changes the calling thread's scheduling; p is valid.
    unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_FIFO, &p) == 0 }
}

/// Puts the calling thread back under the normal scheduler (SCHED_OTHER). Best effort.
pub(crate) fn normal_priority() -> bool {
    let p = libc::sched_param { sched_priority: 0 };
    // SAFETY: changes the calling thread's scheduling; p is valid.
    unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_OTHER, &p) == 0 }
}

/// CPU time the calling thread has used, in nanoseconds (user and system, softirq work done
/// on its behalf included).
pub(crate) fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec to write.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The signals the emulator handles itself; blocked in every thread and taken with `sigwait`.
pub(crate) fn handled_signals() -> libc::sigset_t {
    // SAFETY: sigset manipulation on a local value.
    unsafe {
        let mut s: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut s);
        for sig in [
            libc::SIGINT,
            libc::SIGTERM,
            libc::SIGHUP,
            libc::SIGQUIT,
            libc::SIGCHLD,
        ] {
            libc::sigaddset(&mut s, sig);
        }
        s
    }
}

pub(crate) fn block_signals(set: &libc::sigset_t) -> libc::sigset_t {
    // SAFETY: valid sigset pointers.
    unsafe {
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, set, &mut old);
        old
    }
}

pub(crate) fn restore_signals(old: &libc::sigset_t) {
    // SAFETY: valid sigset pointer.
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut());
    }
}

/// A signal taken by `sigtimedwait`: its number and whether the kernel sent it (a terminal's
/// Ctrl-C reaches the whole foreground process group, the command included).
pub(crate) fn wait_signal(set: &libc::sigset_t, timeout_ms: u64) -> Option<(libc::c_int, bool)> {
    let ts = libc::timespec {
        tv_sec: (timeout_ms / 1000) as libc::time_t,
        tv_nsec: ((timeout_ms % 1000) * 1_000_000) as libc::c_long,
    };
    // SAFETY: info is written by the kernel; set and ts are valid.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let r = libc::sigtimedwait(set, &mut info, &ts);
        if r <= 0 {
            return None;
        }
        Some((r, info.si_code == libc::SI_KERNEL))
    }
}

pub(crate) fn kill(pid: u32, sig: libc::c_int) {
    if let Ok(p) = libc::pid_t::try_from(pid) {
        // SAFETY: kill(2) on the child's pid.
        unsafe {
            libc::kill(p, sig);
        }
    }
}

pub(crate) fn signal_name(sig: libc::c_int) -> String {
    // SAFETY: strsignal returns a static or thread-local string, copied at once.
    unsafe {
        let p = libc::strsignal(sig);
        if p.is_null() {
            format!("signal {sig}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

pub(crate) fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The calling thread's network namespace gets an MPTCP path manager that opens one subflow
/// from each of `addrs` (endpoints with the `subflow` flag on `dev`) and allows as many
/// subflows and announced addresses. Runs iproute2's `ip mptcp`, which the thread's children
/// run in its namespace.
pub(crate) fn mptcp_endpoints(dev: &str, addrs: &[std::net::Ipv4Addr]) -> Result<(), SysError> {
    let n = addrs.len().max(1).to_string();
    let mut cmds: Vec<Vec<String>> = vec![[
        "mptcp",
        "limits",
        "set",
        "subflow",
        &n,
        "add_addr_accepted",
        &n,
    ]
    .map(String::from)
    .to_vec()];
    for a in addrs {
        cmds.push(
            [
                "mptcp",
                "endpoint",
                "add",
                &a.to_string(),
                "dev",
                dev,
                "subflow",
            ]
            .map(String::from)
            .to_vec(),
        );
    }
    for args in cmds {
        let what = format!("ip {}", args.join(" "));
        let out = std::process::Command::new("ip")
            .args(&args)
            .output()
            .map_err(|err| SysError::Missing {
                what: what.clone(),
                hint: "--mptcp needs iproute2's ip on PATH (apt-get install iproute2)",
                err,
            })?;
        if !out.status.success() {
            return Err(SysError::Io {
                what,
                err: io::Error::other(format!(
                    "{}; --mptcp needs Linux 5.6 or later with net.mptcp.enabled = 1",
                    String::from_utf8_lossy(&out.stderr).trim()
                )),
            });
        }
    }
    Ok(())
}
