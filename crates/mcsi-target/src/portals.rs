//! The server's listening sockets, opened and closed while it runs: one per portal address that
//! some target names (a portal two targets share is one socket). Opening is in two steps, so a
//! change can bind every new socket before it changes anything: [`Portals::bind`] binds and
//! listens (nothing is accepted yet), and [`Portals::start`] begins accepting. A bound socket
//! that is dropped instead was never served.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What runs a listener until its stop flag is set: the accept loop (in the server).
pub type AcceptLoop =
    Arc<dyn Fn(TcpListener, watch::Receiver<bool>) -> JoinHandle<()> + Send + Sync>;

/// A socket bound and listening, not yet accepting.
#[derive(Debug)]
pub struct Bound {
    /// The address as the configuration names it (port 0: any free port).
    pub asked: SocketAddr,
    /// The address it is bound to.
    pub local: SocketAddr,
    listener: TcpListener,
}

struct Open {
    asked: SocketAddr,
    local: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// The listening sockets, by the address each was asked for, in the order they were opened.
pub struct Portals {
    mptcp: bool,
    run: AcceptLoop,
    open: Mutex<Vec<Open>>,
}

impl std::fmt::Debug for Portals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Portals")
            .field("mptcp", &self.mptcp)
            .field("open", &self.locals())
            .finish()
    }
}

/// A listener on `addr`, with Multipath TCP when `mptcp` (the kernel falls back to TCP for
/// initiators that do not speak it).
fn listen(addr: SocketAddr, mptcp: bool) -> std::io::Result<TcpListener> {
    let sock = if mptcp {
        mcsi_tcp::mptcp::socket(&addr).map_err(std::io::Error::other)?
    } else {
        socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )?
    };
    // As tokio's own bind: SO_REUSEADDR, a backlog of 1024.
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(1024)?;
    TcpListener::from_std(sock.into())
}

impl Portals {
    pub fn new(mptcp: bool, run: AcceptLoop) -> Portals {
        Portals {
            mptcp,
            run,
            open: Mutex::new(Vec::new()),
        }
    }

    fn open(&self) -> MutexGuard<'_, Vec<Open>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The address the socket asked as `asked` is bound to, if it is open.
    pub fn local(&self, asked: SocketAddr) -> Option<SocketAddr> {
        self.open()
            .iter()
            .find(|o| o.asked == asked)
            .map(|o| o.local)
    }

    /// The addresses the open sockets are bound to, in the order they were opened.
    pub fn locals(&self) -> Vec<SocketAddr> {
        self.open().iter().map(|o| o.local).collect()
    }

    /// Binds and listens on `asked` (with Multipath TCP if the server has it), without
    /// accepting: connections wait in the backlog until [`Portals::start`].
    pub fn bind(&self, asked: SocketAddr) -> std::io::Result<Bound> {
        let listener = listen(asked, self.mptcp)?;
        let local = listener.local_addr()?;
        Ok(Bound {
            asked,
            local,
            listener,
        })
    }

    /// Begins accepting on a bound socket.
    pub fn start(&self, b: Bound) {
        let (stop, rx) = watch::channel(false);
        let task = (self.run)(b.listener, rx);
        self.open().push(Open {
            asked: b.asked,
            local: b.local,
            stop,
            task,
        });
    }

    /// Stops accepting on the socket asked as `asked` and closes it; connections it accepted
    /// go on. The accept loop's end, to wait for; None if no such socket is open.
    pub fn close(&self, asked: SocketAddr) -> Option<JoinHandle<()>> {
        let mut open = self.open();
        let i = open.iter().position(|o| o.asked == asked)?;
        let o = open.remove(i);
        let _ = o.stop.send(true);
        Some(o.task)
    }

    /// Closes every socket and waits for the accept loops to end.
    pub async fn close_all(&self) {
        let all: Vec<Open> = std::mem::take(&mut *self.open());
        for o in all {
            let _ = o.stop.send(true);
            let _ = o.task.await;
        }
    }
}
