//! The thin I/O layer: runs a command in its own network namespace whose only way out is a
//! point-to-point link through the emulator.
//!
//! ```text
//!   command (new netns)                      host netns
//!   mcsi0 100.64.x.2  <-TUN->  [ Link ]  <-TUN->  mcsil<pid>h 100.64.x.1 (= $MCSI_LINK_PEER)
//! ```
//!
//! Both TUN devices are non-persistent and the namespace is anonymous: they vanish with the
//! process, even when it is killed. The command gets SIGKILL if the emulator dies first.
//!
//! Host commands (`sh -c`, in the host namespace, each in its own process group) start once the
//! link is up, so that servers can bind the host-side link address instead of every interface;
//! they are stopped when the command exits.

use crate::link::{Delivery, Dir, Link};
use crate::pcap::PcapWriter;
use crate::stats::Summary;
use crate::sys::{self, SysError};
use crate::{ConfigError, LinkConfig, Nanos};
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Name of the TUN device inside the command's namespace.
pub const NS_DEV: &str = "mcsi0";
/// Host-side TUN devices are named `mcsil<pid>h`.
const HOST_PREFIX: &str = "mcsil";

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub link: LinkConfig,
    /// Program and arguments.
    pub command: Vec<OsString>,
    pub mtu: u32,
    /// Write every delivered packet here (pcap, raw IP).
    pub pcap: Option<PathBuf>,
    /// Write one JSON line per packet event (deliver, drop, filtered) here.
    pub log: Option<PathBuf>,
    /// How long the command gets after SIGTERM/SIGINT was passed on before SIGKILL, and host
    /// commands after SIGTERM once the command has exited.
    pub kill_grace: Duration,
    /// Shell commands run on the host side (`sh -c`) once the link is up, with
    /// `MCSI_LINK_PEER` = host-side address and `MCSI_LINK_ADDR` = command-side address.
    pub host_commands: Vec<String>,
    /// TCP ports that must be listening on the host-side address before the command starts.
    pub host_wait: Vec<u16>,
    /// How long to wait for `host_wait` ports.
    pub host_wait_timeout: Duration,
    /// Paths going down and up, on the link's clock (from the link's start).
    pub path_events: Vec<crate::PathEvent>,
    /// A Unix socket taking `down PATH` / `up PATH` lines while the link runs
    /// ([`crate::control`]).
    pub control: Option<PathBuf>,
    /// Set up the command namespace's MPTCP path manager: every command-side address after the
    /// first is a subflow endpoint, and the limits allow a subflow on each.
    pub mptcp: bool,
}

/// How a host command ended.
#[derive(Debug, Clone)]
pub struct HostOutcome {
    pub command: String,
    /// Readable form of how it ended.
    pub status: String,
    /// Exit code, if it exited rather than being ended by a signal.
    pub code: Option<i32>,
    /// True if it ended while the command was still running (not stopped by the emulator).
    pub ended_early: bool,
}

#[derive(Debug)]
pub struct RunOutcome {
    /// The command's exit code, or 128 + signal number if a signal ended it.
    pub code: u8,
    /// Readable form of how the command ended.
    pub status: String,
    pub summary: Summary,
    pub host_addr: Ipv4Addr,
    pub command_addr: Ipv4Addr,
    /// One entry per host command, in the order given.
    pub host: Vec<HostOutcome>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Sys(#[from] SysError),
    #[error("no command given: use mcsi link run [OPTIONS] -- COMMAND [ARGS]")]
    NoCommand,
    #[error("MTU {0} out of range: use 576..=65535")]
    Mtu(u32),
    #[error("cannot run '{program}': {err}")]
    Spawn { program: String, err: io::Error },
    #[error("{what}: {err}")]
    Output { what: String, err: io::Error },
    #[error("the {0} thread panicked")]
    Thread(&'static str),
    #[error("cannot start host command '{command}': {err}")]
    HostSpawn { command: String, err: io::Error },
    #[error(
        "host command '{command}' ended ({status}) before {addr}:{port} accepted TCP connections"
    )]
    HostDied {
        command: String,
        status: String,
        addr: Ipv4Addr,
        port: u16,
    },
    #[error(
        "nothing listened on {addr}:{port} within {timeout:?} (host commands still running: {running}); \
         a host server must listen on $MCSI_LINK_PEER:{port}"
    )]
    HostWaitTimeout {
        addr: Ipv4Addr,
        port: u16,
        timeout: Duration,
        running: String,
    },
    #[error("{signal} received while waiting for host commands; nothing was run behind the link")]
    Interrupted { signal: String },
}

fn exit_text(status: std::process::ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("killed by {}", sys::signal_name(s)),
        _ => "unknown status".into(),
    }
}

/// A host command: `sh -c` in its own process group, so that stopping it reaches whatever the
/// shell started.
struct HostProc {
    command: String,
    child: std::process::Child,
    pgid: u32,
    done: Option<(std::process::ExitStatus, bool)>,
}

impl HostProc {
    fn spawn(command: &str, host: Ipv4Addr, cmd_addrs: &[Ipv4Addr]) -> Result<Self, RunError> {
        let cmd_addr = cmd_addrs[0];
        let spawn_err = |err| RunError::HostSpawn {
            command: command.to_string(),
            err,
        };
        // Standard output goes to standard error: the command's output stays alone on stdout.
        let out = io::stderr()
            .as_fd()
            .try_clone_to_owned()
            .map_err(spawn_err)?;
        let mut c = std::process::Command::new("sh");
        c.arg("-c")
            .arg(command)
            .env("MCSI_LINK_PEER", host.to_string())
            .env("MCSI_LINK_ADDR", cmd_addr.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::from(out))
            .process_group(0);
        address_env(&mut c, cmd_addrs);
        // SAFETY: getpid is async-signal-safe.
        let parent = unsafe { libc::getpid() };
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            c.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
                if libc::getppid() != parent {
                    libc::_exit(137);
                }
                let mut empty: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut empty);
                libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
                Ok(())
            });
        }
        let child = c.spawn().map_err(spawn_err)?;
        let pgid = child.id();
        tracing::debug!("host command '{command}' started, pid {pgid}");
        Ok(Self {
            command: command.to_string(),
            child,
            pgid,
            done: None,
        })
    }

    /// Reaps the shell if it ended; `early` records whether the command was still running.
    fn poll(&mut self, early: bool) -> Option<std::process::ExitStatus> {
        if self.done.is_none() {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.done = Some((st, early));
            }
        }
        self.done.map(|(st, _)| st)
    }

    /// As [`Self::poll`] while the command runs; a failure is reported as it is seen.
    fn poll_running(&mut self) {
        if self.done.is_none() {
            if let Some(st) = self.poll(true) {
                if !st.success() {
                    tracing::warn!(
                        "host command '{}' ended ({}) while the command was running",
                        self.command,
                        exit_text(st)
                    );
                }
            }
        }
    }

    fn signal_group(&self, sig: libc::c_int) {
        if let Ok(p) = libc::pid_t::try_from(self.pgid) {
            // SAFETY: kill(2) on our own process group; ESRCH when it is already empty.
            unsafe {
                libc::kill(-p, sig);
            }
        }
    }

    fn outcome(&self) -> HostOutcome {
        match self.done {
            Some((st, early)) => HostOutcome {
                command: self.command.clone(),
                status: exit_text(st),
                code: st.code(),
                ended_early: early,
            },
            None => HostOutcome {
                command: self.command.clone(),
                status: "still running".into(),
                code: None,
                ended_early: false,
            },
        }
    }
}

/// Kills the host commands' process groups should this process die without stopping them
/// (SIGKILL): the shells themselves get PR_SET_PDEATHSIG, but what they started does not. A
/// shell in its own process group waits on a pipe whose only writer is this process (the end
/// is close-on-exec); end of file, on any exit, sends SIGKILL to the groups. Dropped after
/// [`stop_hosts`], it finds them empty.
struct Watchdog {
    child: std::process::Child,
}

impl Watchdog {
    fn spawn(pgids: &[u32]) -> Option<Self> {
        if pgids.is_empty() {
            return None;
        }
        let groups: Vec<String> = pgids.iter().map(|p| format!("-{p}")).collect();
        let script = format!(
            "read _; kill -s KILL -- {} 2>/dev/null; exit 0",
            groups.join(" ")
        );
        let mut c = std::process::Command::new("sh");
        c.arg("-c")
            .arg(script)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0);
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            c.pre_exec(|| {
                let mut empty: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut empty);
                libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
                Ok(())
            });
        }
        match c.spawn() {
            Ok(child) => Some(Self { child }),
            Err(e) => {
                tracing::warn!(
                    "cannot start the host command watchdog ({e}); if mcsi link is killed, \
                     what host commands started may outlive it"
                );
                None
            }
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Stops every host command: SIGTERM to each process group (also to the groups of shells that
/// already exited, for what they left behind), SIGKILL to those still there after `grace`.
fn stop_hosts(hosts: &mut [HostProc], grace: Duration) {
    for h in hosts.iter_mut() {
        h.poll(false);
        h.signal_group(libc::SIGTERM);
    }
    let t = Instant::now();
    while t.elapsed() < grace {
        if hosts.iter_mut().all(|h| h.poll(false).is_some()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for h in hosts.iter_mut() {
        if h.poll(false).is_none() {
            tracing::warn!(
                "host command '{}' did not exit within {grace:?} of SIGTERM; killing it",
                h.command
            );
        }
        h.signal_group(libc::SIGKILL);
        if h.done.is_none() {
            if let Ok(st) = h.child.wait() {
                h.done = Some((st, false));
            }
        }
    }
}

/// True if a TCP socket in LISTEN state covers `addr:port` in this namespace: bound to it or to
/// the wildcard. Read from /proc/net/tcp{,6} rather than by connecting, so that one-shot servers
/// (`iperf3 -s -1`) do not take the probe for their one client.
fn listening(addr: Ipv4Addr, port: u16) -> bool {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .any(|f| listening_in(&std::fs::read_to_string(f).unwrap_or_default(), addr, port))
}

/// [`listening`] on the text of /proc/net/tcp or /proc/net/tcp6.
fn listening_in(table: &str, addr: Ipv4Addr, port: u16) -> bool {
    const LISTEN: &str = "0A";
    let matches = |local: &str| -> bool {
        let Some((a, p)) = local.split_once(':') else {
            return false;
        };
        if u16::from_str_radix(p, 16) != Ok(port) {
            return false;
        }
        // The kernel prints each 32-bit word of the address as the host-order value of its
        // network-order bytes.
        let words: Option<Vec<[u8; 4]>> = (0..a.len() / 8)
            .map(|i| {
                a.get(i * 8..i * 8 + 8)
                    .and_then(|w| u32::from_str_radix(w, 16).ok())
                    .map(u32::to_ne_bytes)
            })
            .collect();
        match words.as_deref() {
            Some([w]) => {
                let ip = Ipv4Addr::from(*w);
                ip == addr || ip.is_unspecified()
            }
            Some([w0, w1, w2, w3]) => {
                let mut b = [0u8; 16];
                for (i, w) in [w0, w1, w2, w3].iter().enumerate() {
                    b[i * 4..i * 4 + 4].copy_from_slice(&w[..]);
                }
                let ip = std::net::Ipv6Addr::from(b);
                ip.is_unspecified() || ip.to_ipv4_mapped() == Some(addr)
            }
            _ => false,
        }
    };
    table.lines().any(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        cols.len() > 3 && cols[3] == LISTEN && matches(cols[1])
    })
}

/// Waits until every port in `ports` listens on `addr`, failing early if a host command ends
/// or a terminating signal arrives.
fn wait_ports(
    hosts: &mut [HostProc],
    addr: Ipv4Addr,
    ports: &[u16],
    timeout: Duration,
    set: &libc::sigset_t,
) -> Result<(), RunError> {
    let t = Instant::now();
    for &port in ports {
        loop {
            if listening(addr, port) {
                tracing::debug!("{addr}:{port} is listening");
                break;
            }
            for h in hosts.iter_mut() {
                if let Some(st) = h.poll(true) {
                    return Err(RunError::HostDied {
                        command: h.command.clone(),
                        status: exit_text(st),
                        addr,
                        port,
                    });
                }
            }
            if t.elapsed() > timeout {
                let running: Vec<String> = hosts
                    .iter()
                    .filter(|h| h.done.is_none())
                    .map(|h| format!("'{}'", h.command))
                    .collect();
                return Err(RunError::HostWaitTimeout {
                    addr,
                    port,
                    timeout,
                    running: if running.is_empty() {
                        "none".into()
                    } else {
                        running.join(", ")
                    },
                });
            }
            if let Some((sig, _)) = sys::wait_signal(set, 20) {
                if sig != libc::SIGCHLD {
                    return Err(RunError::Interrupted {
                        signal: sys::signal_name(sig),
                    });
                }
            }
        }
    }
    Ok(())
}

/// Picks a /28 in 100.64.0.0/10 (shared address space, RFC 6598) from the pid, skipping any
/// with an address already used on this host. Returns (host side, command side): the host side
/// is .1, the command side .2 and, for `--path-by source`, the following addresses.
fn pick_addresses(pid: u32) -> (Ipv4Addr, Ipv4Addr) {
    let used = sys::local_ipv4();
    let base = u32::from(Ipv4Addr::new(100, 64, 0, 0));
    let blocks = 1u32 << 18;
    let mut pair = (Ipv4Addr::new(100, 64, 0, 1), Ipv4Addr::new(100, 64, 0, 2));
    for k in 0..blocks {
        let net = base + ((pid.wrapping_add(k)) % blocks) * 16;
        pair = (Ipv4Addr::from(net + 1), Ipv4Addr::from(net + 2));
        if !(net..net + 16).any(|a| used.contains(&Ipv4Addr::from(a))) {
            break;
        }
    }
    pair
}

/// The command side's addresses: `n` from `first` on.
fn command_addresses(first: Ipv4Addr, n: usize) -> Vec<Ipv4Addr> {
    (0..n.clamp(1, crate::config::MAX_SOURCE_PATHS) as u32)
        .map(|i| Ipv4Addr::from(u32::from(first) + i))
        .collect()
}

/// `MCSI_LINK_ADDR_0`, `MCSI_LINK_ADDR_1`, ... for the command side's addresses.
fn address_env(c: &mut std::process::Command, addrs: &[Ipv4Addr]) {
    for (i, a) in addrs.iter().enumerate() {
        c.env(format!("MCSI_LINK_ADDR_{i}"), a.to_string());
    }
}

/// Removes host-side devices left by runs whose process is gone. Ours are non-persistent, so
/// this only finds devices someone made persistent; it must not stop the next run either way.
fn cleanup_stale() {
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(HOST_PREFIX)
            .and_then(|r| r.strip_suffix('h'))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && sys::pid_alive(pid) {
            continue;
        }
        match sys::remove_persistent_tun(&name) {
            Ok(()) => tracing::info!("removed stale link device {name} (pid {pid} is gone)"),
            Err(e) => tracing::warn!("stale link device {name} could not be removed: {e}"),
        }
    }
}

struct Forwarder {
    link: Link,
    ns_tun: OwnedFd,
    host_tun: OwnedFd,
    stop_fd: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    host: [u8; 4],
    cmd: Vec<[u8; 4]>,
    start: Instant,
    start_unix_ns: u64,
    pcap: Option<PcapWriter<BufWriter<File>>>,
    log: Option<BufWriter<File>>,
    filtered: u64,
    late_sum: u64,
    late_max: u64,
    delivered: u64,
    write_errors: u64,
    /// Running average of how late a timed sleep wakes up.
    wake_late_ewma: u64,
    /// The current window of [`BUSY_WINDOW_NS`]: when it began and how long the thread was
    /// blocked in it; and whether polling before deadlines is allowed in this window.
    window_start: Nanos,
    window_blocked: Nanos,
    spin: bool,
    /// The thread's CPU time when the window began, and whether it runs under SCHED_FIFO.
    window_cpu: u64,
    realtime: bool,
    /// Commands from the control socket, and the paths' state shown to it.
    control: std::sync::mpsc::Receiver<crate::control::Command>,
    down_shared: Arc<std::sync::Mutex<Vec<bool>>>,
    down_refreshed: Nanos,
}

/// How often the paths' state is copied out for the control socket's `paths`.
const DOWN_REFRESH_NS: u64 = 20_000_000;

/// Deadlines closer than this are met by polling without sleeping: a sleeping thread wakes
/// tens of microseconds late.
const SPIN_NS: u64 = 10_000;
/// Upper bound of the busy-polling margin before a deadline.
const MAX_SPIN_NS: u64 = 100_000;
const MAX_SLEEP_NS: u64 = 100_000_000;
/// The window over which the thread's busy share is measured.
const BUSY_WINDOW_NS: u64 = 100_000_000;
/// Blocked for less than this share of a window, the next window sleeps right up to each
/// deadline instead of polling before it. A SCHED_FIFO thread that runs more than
/// sched_rt_runtime_us of each sched_rt_period_us (95 % by default) is stopped for the rest
/// of the period: 50 ms without forwarding, which polling at tens of thousands of packets per
/// second brought about (timer lateness up to 50 ms). Sleeping costs tens of microseconds of
/// lateness instead.
const MIN_BLOCKED_SHARE: f64 = 0.25;
/// Above this share of a CPU over a window (the forwarding itself: TUN reads and writes, and
/// the receiving TCP stacks' work the writes do on this thread), the thread leaves SCHED_FIFO
/// until its share falls below [`RT_RESUME_SHARE`]: the kernel would otherwise stop it for
/// 50 ms of each second (RT throttling). Under the normal scheduler it is only delayed now and
/// then by other threads.
const RT_LEAVE_SHARE: f64 = 0.85;
const RT_RESUME_SHARE: f64 = 0.7;

impl Forwarder {
    fn now(&self) -> Nanos {
        self.start.elapsed().as_nanos() as Nanos
    }

    fn run(mut self) -> Summary {
        sys::precise_timers();
        self.realtime = sys::realtime_priority(10);
        if !self.realtime {
            tracing::debug!("SCHED_FIFO refused; timers may be late on a busy machine");
        }
        let may_realtime = self.realtime;
        self.window_cpu = sys::thread_cpu_ns();
        let mut buf = vec![0u8; 65536];
        let fds = [
            self.ns_tun.as_raw_fd(),
            self.host_tun.as_raw_fd(),
            self.stop_fd.as_raw_fd(),
        ];
        loop {
            let now = self.now();
            while let Ok(crate::control::Command::Path { path, up }) = self.control.try_recv() {
                self.link.set_path(path, up, now);
                self.down_refreshed = 0;
            }
            if now.saturating_sub(self.down_refreshed) >= DOWN_REFRESH_NS {
                self.down_refreshed = now;
                let mut d = self.down_shared.lock().unwrap_or_else(|p| p.into_inner());
                for (i, v) in d.iter_mut().enumerate() {
                    *v = self.link.is_down(i);
                }
            }
            while let Some(d) = self.link.poll_transmit(now) {
                self.emit(d);
            }
            if self.stop.load(Ordering::Relaxed) {
                break;
            }
            let wait = match self.link.next_deadline() {
                Some(t) => t.saturating_sub(self.now()).min(MAX_SLEEP_NS),
                None => MAX_SLEEP_NS,
            };
            // Sleep until a little before the deadline, by how late wake-ups have been running,
            // then poll without sleeping.
            let margin = if self.spin {
                (self.wake_late_ewma + self.wake_late_ewma / 2 + SPIN_NS).min(MAX_SPIN_NS)
            } else {
                0
            };
            let sleep = wait.saturating_sub(margin);
            let t_sleep = self.now();
            let ready = sys::wait_readable(fds, Some(sleep));
            let t_woke = self.now();
            self.window_blocked += t_woke.saturating_sub(t_sleep);
            if t_woke.saturating_sub(self.window_start) >= BUSY_WINDOW_NS {
                let span = (t_woke - self.window_start) as f64;
                self.spin = self.window_blocked as f64 >= MIN_BLOCKED_SHARE * span;
                let cpu = sys::thread_cpu_ns();
                let share = cpu.saturating_sub(self.window_cpu) as f64 / span;
                if self.realtime && share > RT_LEAVE_SHARE {
                    self.realtime = !sys::normal_priority();
                } else if may_realtime && !self.realtime && share < RT_RESUME_SHARE {
                    self.realtime = sys::realtime_priority(10);
                }
                self.window_cpu = cpu;
                self.window_start = t_woke;
                self.window_blocked = 0;
            }
            if sleep > 0 && !ready.iter().any(|&r| r) {
                // Capped: a stalled virtual CPU says nothing about the timer.
                let over = self.now().saturating_sub(t_sleep + sleep).min(MAX_SPIN_NS);
                self.wake_late_ewma = (self.wake_late_ewma * 7 + over) / 8;
            }
            if ready[0] {
                self.read_side(Dir::Up, &mut buf);
            }
            if ready[1] {
                self.read_side(Dir::Down, &mut buf);
            }
            if ready[2] {
                let _ = sys::read_packet(fds[2], &mut buf);
            }
        }
        if let Some(p) = self.pcap.as_mut() {
            let _ = p.flush();
        }
        if let Some(l) = self.log.as_mut() {
            let _ = l.flush();
        }
        let mut s = self.link.summary();
        s.elapsed_ns = self.now();
        s.filtered = self.filtered;
        s.timer_late_mean_ns = self.late_sum.checked_div(self.delivered).unwrap_or(0);
        s.timer_late_max_ns = self.late_max;
        s.write_errors = self.write_errors;
        s
    }

    fn read_side(&mut self, dir: Dir, buf: &mut [u8]) {
        let fd = match dir {
            Dir::Up => self.ns_tun.as_raw_fd(),
            Dir::Down => self.host_tun.as_raw_fd(),
        };
        // Bounded so that one busy side cannot starve the timers.
        for _ in 0..256 {
            let n = match sys::read_packet(fd, buf) {
                Ok(Some(n)) => n,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!("reading the {} TUN device: {e}", dir.as_str());
                    return;
                }
            };
            let pkt = &buf[..n];
            let now = self.now();
            if !self.allowed(dir, pkt) {
                self.filtered += 1;
                self.log_event(now, "filtered", dir, None, n, None);
                continue;
            }
            match self.link.enqueue(dir, pkt.to_vec(), now) {
                Ok(_) => {}
                Err((path, cause)) => {
                    self.log_event(now, "drop", dir, Some(path), n, Some(cause.as_str()))
                }
            }
        }
    }

    /// Only IPv4 between the two link addresses crosses: the command reaches the host-side
    /// address and nothing else.
    fn allowed(&self, dir: Dir, pkt: &[u8]) -> bool {
        if pkt.len() < 20 || pkt[0] >> 4 != 4 {
            return false;
        }
        let (src, dst) = (&pkt[12..16], &pkt[16..20]);
        match dir {
            Dir::Up => self.cmd.iter().any(|c| c == src) && dst == self.host,
            Dir::Down => src == self.host && self.cmd.iter().any(|c| c == dst),
        }
    }

    fn emit(&mut self, d: Delivery) {
        let fd = match d.dir {
            Dir::Up => self.host_tun.as_raw_fd(),
            Dir::Down => self.ns_tun.as_raw_fd(),
        };
        let now = self.now();
        if sys::write_packet(fd, &d.pkt).is_err() {
            self.write_errors += 1;
        }
        let late = now.saturating_sub(d.at);
        self.late_sum += late;
        self.late_max = self.late_max.max(late);
        self.delivered += 1;
        if let Some(p) = self.pcap.as_mut() {
            let _ = p.write(self.start_unix_ns + now, &d.pkt);
        }
        self.log_event(now, "deliver", d.dir, Some(d.path), d.pkt.len(), None);
    }

    fn log_event(
        &mut self,
        now: Nanos,
        event: &str,
        dir: Dir,
        path: Option<usize>,
        len: usize,
        cause: Option<&str>,
    ) {
        let Some(l) = self.log.as_mut() else { return };
        let v = serde_json::json!({
            "t_us": now as f64 / 1e3,
            "event": event,
            "dir": dir.as_str(),
            "path": path,
            "len": len,
            "cause": cause,
        });
        let _ = writeln!(l, "{v}");
    }
}

fn create_output(p: &PathBuf, what: &str) -> Result<BufWriter<File>, RunError> {
    File::create(p)
        .map(BufWriter::new)
        .map_err(|source| RunError::Output {
            what: format!("create {what} file {}", p.display()),
            err: source,
        })
}

/// Runs `opts.command` behind the link until it exits; cleans up on every path out.
pub fn run(opts: RunOptions) -> Result<RunOutcome, RunError> {
    let program = opts.command.first().ok_or(RunError::NoCommand)?.clone();
    if !(576..=65535).contains(&opts.mtu) {
        return Err(RunError::Mtu(opts.mtu));
    }
    let mut link = Link::new(&opts.link)?;
    link.schedule(opts.path_events.clone())
        .map_err(|m| RunError::Output {
            what: "--path-down/--path-up".into(),
            err: io::Error::new(io::ErrorKind::InvalidInput, m),
        })?;
    let pcap = match &opts.pcap {
        Some(p) => Some(
            PcapWriter::new(create_output(p, "pcap")?, opts.mtu).map_err(|source| {
                RunError::Output {
                    what: format!("write pcap header to {}", p.display()),
                    err: source,
                }
            })?,
        ),
        None => None,
    };
    let log = opts
        .log
        .as_ref()
        .map(|p| create_output(p, "packet log"))
        .transpose()?;

    // Signals are taken synchronously by this thread; every thread started below inherits
    // the mask, and the command gets a clean one.
    let set = sys::handled_signals();
    let old_mask = sys::block_signals(&set);
    let result = run_blocked(opts, program, link, pcap, log, &set);
    sys::restore_signals(&old_mask);
    result
}

fn run_blocked(
    opts: RunOptions,
    program: OsString,
    link: Link,
    pcap: Option<PcapWriter<BufWriter<File>>>,
    log: Option<BufWriter<File>>,
    set: &libc::sigset_t,
) -> Result<RunOutcome, RunError> {
    cleanup_stale();
    let pid = std::process::id();
    let (host, cmd_addr) = pick_addresses(pid);
    let sources = if opts.link.path_by == crate::PathBy::Source {
        opts.link.paths.len()
    } else {
        1
    };
    let cmd_addrs = command_addresses(cmd_addr, sources);
    let mut link = link;
    link.set_sources(cmd_addrs.iter().map(|a| a.octets()).collect());
    let host_dev = format!("{HOST_PREFIX}{pid}h");
    if std::path::Path::new(&format!("/sys/class/net/{host_dev}")).exists() {
        let _ = sys::remove_persistent_tun(&host_dev);
    }
    let host_tun = sys::open_tun(&host_dev)?;
    sys::disable_ipv6(&host_dev);
    sys::configure_p2p(&host_dev, host, cmd_addr, opts.mtu)?;
    for a in &cmd_addrs[1..] {
        sys::add_host_route(&host_dev, *a)?;
    }

    let mtu = opts.mtu;
    let extra = cmd_addrs[1..].to_vec();
    let mptcp = opts.mptcp;
    let (ns_fd, ns_tun) = std::thread::Builder::new()
        .name("mcsi-link-netns".into())
        .spawn(move || -> Result<(OwnedFd, OwnedFd), SysError> {
            // Only this short-lived thread moves; the namespace lives on through the fds.
            let ns = sys::unshare_net()?;
            sys::link_up("lo")?;
            let tun = sys::open_tun(NS_DEV)?;
            sys::disable_ipv6(NS_DEV);
            sys::configure_p2p(NS_DEV, cmd_addr, host, mtu)?;
            for (k, a) in extra.iter().enumerate() {
                sys::add_alias(NS_DEV, k + 1, *a)?;
            }
            if mptcp {
                sys::mptcp_endpoints(NS_DEV, &extra)?;
            }
            Ok((ns, tun))
        })
        .map_err(|source| RunError::Output {
            what: "start the namespace thread".into(),
            err: source,
        })?
        .join()
        .map_err(|_| RunError::Thread("namespace setup"))??;
    tracing::debug!("link {host_dev} {host} <-> {NS_DEV} {cmd_addr}");

    let stop = Arc::new(AtomicBool::new(false));
    let stop_fd = Arc::new(sys::eventfd()?);
    let (control_tx, control_rx) = std::sync::mpsc::channel();
    let down_shared = Arc::new(std::sync::Mutex::new(vec![false; opts.link.paths.len()]));
    let _control = match &opts.control {
        Some(path) => {
            let wake_fd = stop_fd.clone();
            let shared = crate::control::Shared {
                tx: control_tx,
                down: down_shared.clone(),
                wake: Box::new(move || sys::eventfd_signal(wake_fd.as_raw_fd())),
            };
            Some(
                crate::control::ControlSocket::start(path, opts.link.paths.len(), shared).map_err(
                    |err| RunError::Output {
                        what: format!("--control {}", path.display()),
                        err,
                    },
                )?,
            )
        }
        None => None,
    };
    let start = Instant::now();
    let start_unix_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let fwd = Forwarder {
        link,
        ns_tun,
        host_tun,
        stop_fd: stop_fd.clone(),
        stop: stop.clone(),
        host: host.octets(),
        cmd: cmd_addrs.iter().map(|a| a.octets()).collect(),
        start,
        start_unix_ns,
        pcap,
        log,
        filtered: 0,
        late_sum: 0,
        late_max: 0,
        delivered: 0,
        write_errors: 0,
        wake_late_ewma: 0,
        window_start: 0,
        window_blocked: 0,
        spin: true,
        window_cpu: 0,
        realtime: false,
        control: control_rx,
        down_shared: down_shared.clone(),
        down_refreshed: 0,
    };
    let forwarder = std::thread::Builder::new()
        .name("mcsi-link-fwd".into())
        .spawn(move || fwd.run())
        .map_err(|source| RunError::Output {
            what: "start the forwarding thread".into(),
            err: source,
        })?;
    let shutdown = |forwarder: std::thread::JoinHandle<Summary>| {
        stop.store(true, Ordering::Relaxed);
        sys::eventfd_signal(stop_fd.as_raw_fd());
        forwarder.join().map_err(|_| RunError::Thread("forwarding"))
    };

    // Host commands after the link is up: the host-side address exists for them to bind.
    let mut hosts: Vec<HostProc> = Vec::with_capacity(opts.host_commands.len());
    let spawned = opts.host_commands.iter().try_for_each(|c| {
        hosts.push(HostProc::spawn(c, host, &cmd_addrs)?);
        Ok(())
    });
    let watchdog = Watchdog::spawn(&hosts.iter().map(|h| h.pgid).collect::<Vec<_>>());
    let started = spawned.and_then(|()| {
        wait_ports(
            &mut hosts,
            host,
            &opts.host_wait,
            opts.host_wait_timeout,
            set,
        )
    });
    if let Err(e) = started {
        stop_hosts(&mut hosts, opts.kill_grace);
        drop(watchdog);
        let _ = shutdown(forwarder);
        return Err(e);
    }

    let mut command = std::process::Command::new(&program);
    command
        .args(&opts.command[1..])
        .env("MCSI_LINK_PEER", host.to_string())
        .env("MCSI_LINK_ADDR", cmd_addr.to_string());
    address_env(&mut command, &cmd_addrs);
    let ns_raw = ns_fd.as_raw_fd();
    // SAFETY: getpid is async-signal-safe.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure only makes async-signal-safe system calls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            if libc::setns(ns_raw, libc::CLONE_NEWNET) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The command must not outlive the emulator (and keep its namespace alive).
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
            if libc::getppid() != parent {
                libc::_exit(137);
            }
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            Ok(())
        });
    }
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(source) => {
            stop_hosts(&mut hosts, opts.kill_grace);
            drop(watchdog);
            let _ = shutdown(forwarder);
            return Err(RunError::Spawn {
                program: program.to_string_lossy().into_owned(),
                err: source,
            });
        }
    };
    drop(ns_fd);

    let mut term_since: Option<Instant> = None;
    let mut killed = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Ok(st),
            Ok(None) => {}
            Err(e) => break Err(e),
        }
        if let Some((sig, from_terminal)) = sys::wait_signal(set, 100) {
            if sig != libc::SIGCHLD {
                // A terminal's Ctrl-C already reached the command (same process group).
                if !from_terminal {
                    sys::kill(child.id(), sig);
                }
                tracing::info!(
                    "{} received, waiting for the command to exit",
                    sys::signal_name(sig)
                );
                term_since.get_or_insert_with(Instant::now);
            }
        }
        for h in hosts.iter_mut() {
            h.poll_running();
        }
        if let Some(t) = term_since {
            if !killed && t.elapsed() > opts.kill_grace {
                tracing::warn!("the command did not exit; killing it");
                sys::kill(child.id(), libc::SIGKILL);
                killed = true;
            }
        }
    };
    stop_hosts(&mut hosts, opts.kill_grace);
    drop(watchdog);
    let summary = shutdown(forwarder)?;
    let status = status.map_err(|source| RunError::Output {
        what: "wait for the command".into(),
        err: source,
    })?;
    let code = match (status.code(), status.signal()) {
        (Some(c), _) => (c & 0xff) as u8,
        (None, Some(s)) => (128 + s).clamp(0, 255) as u8,
        _ => 1,
    };
    let text = exit_text(status);
    Ok(RunOutcome {
        code,
        status: text,
        summary,
        host_addr: host,
        command_addr: cmd_addr,
        host: hosts.iter().map(HostProc::outcome).collect(),
    })
}

/// Why `mcsi link run` cannot work on this machine, if it cannot: it needs CAP_NET_ADMIN and
/// CAP_SYS_ADMIN (network namespaces, TUN devices) and /dev/net/tun.
pub fn missing_privileges() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    const CAP_NET_ADMIN: u64 = 1 << 12;
    const CAP_SYS_ADMIN: u64 = 1 << 21;
    if cap_eff & CAP_NET_ADMIN == 0 || cap_eff & CAP_SYS_ADMIN == 0 {
        return Some("needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)".into());
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Some("needs /dev/net/tun".into());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    // Lines as the kernel prints them on a little-endian machine (addresses hand-encoded:
    // 100.64.0.1 is the bytes 64 40 00 01, printed as the u32 0x01004064; 3260 = 0x0CBC).
    const V4: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 01004064:0CBC 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 0100007F:1451 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1
   2: 01004064:1452 02004064:9C40 01 00000000:00000000 00:00000000 00000000     0        0 3 1
   3: 00000000:1453 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4 1
";
    const V6: &str =
        "  sl  local_address                         remote_address                        st
   0: 0000000000000000FFFF000001004064:1454 00000000000000000000000000000000:0000 0A
   1: 00000000000000000000000000000000:1455 00000000000000000000000000000000:0000 0A
   2: 00000000000000000000000001000000:1456 00000000000000000000000000000000:0000 0A
";

    #[test]
    fn listen_table_parsing() {
        if !cfg!(target_endian = "little") {
            return;
        }
        let peer = Ipv4Addr::new(100, 64, 0, 1);
        assert!(listening_in(V4, peer, 3260));
        // Listening on loopback only: not reachable at the link address.
        assert!(!listening_in(V4, peer, 5201));
        assert!(listening_in(V4, Ipv4Addr::LOCALHOST, 5201));
        // An established connection is not a listener.
        assert!(!listening_in(V4, peer, 5202));
        // The wildcard covers every address.
        assert!(listening_in(V4, peer, 5203));
        assert!(!listening_in(V4, Ipv4Addr::new(100, 64, 0, 5), 3260));
        // IPv4-mapped and wildcard IPv6 listeners; ::1 does not cover the link.
        assert!(listening_in(V6, peer, 5204));
        assert!(listening_in(V6, peer, 5205));
        assert!(!listening_in(V6, peer, 5206));
    }

    #[test]
    fn a_loopback_listener_is_seen() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(listening(Ipv4Addr::LOCALHOST, port));
        assert!(!listening(Ipv4Addr::new(127, 0, 0, 2), port));
        drop(l);
        assert!(!listening(Ipv4Addr::LOCALHOST, port));
    }
}
