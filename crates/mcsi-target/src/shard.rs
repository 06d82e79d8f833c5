//! Session threads: each session, with every connection, task and timer of it, runs on one
//! thread of its own choosing among a few, each a single-threaded tokio runtime.
//!
//! A session's connections share its core (CmdSN order, tasks) and hand work to each other: a
//! command that fills a CmdSN gap runs the commands held behind it, a reply may leave on another
//! connection. On one work-stealing runtime those hand-offs wake threads on other cores, and on
//! a busy machine the wakeups cost more than the work (a 4-connection session on loopback
//! reached 0.7x the IOPS of a 1-connection one, most of the difference in the scheduler's
//! context switches). On one thread they are function calls and queue pushes. Sessions spread
//! over the threads by TSIH, which the server hands out in turn, so several sessions still use
//! several cores.
//!
//! A session whose MaxConnections is 1 (every session of the Linux kernel's initiator and of
//! libiscsi) has no such hand-offs and stays on the runtime that accepted it, where its reader
//! and its writer can run on two cores at once: on loopback, a 1-connection session on a thread
//! of its own reached about 0.9x the IOPS it reaches there.
//!
//! The accept loop and logins run where the server was started; once a login has joined or
//! created its session, the connection moves to the session's thread ([`Transport::detach`]).

use crate::transport::Transport;
use tokio::runtime::Handle;
use tracing::Instrument;

/// The session threads of a server; none when sessions run on the caller's runtime.
pub struct Shards {
    handles: Vec<Handle>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
}

impl Shards {
    /// No threads of its own: sessions run on the runtime that started the server.
    pub fn inline() -> Shards {
        Shards {
            handles: Vec::new(),
            stops: Vec::new(),
        }
    }

    /// Starts `n` session threads (`mcsi-session-<i>`).
    pub fn start(n: usize) -> std::io::Result<Shards> {
        let mut s = Shards::inline();
        for i in 0..n {
            let (handle_tx, handle_rx) = std::sync::mpsc::channel();
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            std::thread::Builder::new()
                .name(format!("mcsi-session-{i}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            let _ = handle_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = handle_tx.send(Ok(rt.handle().clone()));
                    // Runs the sessions' tasks until the server is gone; dropping the runtime
                    // then ends what is left of them.
                    rt.block_on(async {
                        let _ = stop_rx.await;
                    });
                })?;
            let handle = handle_rx.recv().map_err(|_| {
                std::io::Error::other("a session thread ended before its runtime started")
            })??;
            s.handles.push(handle);
            s.stops.push(stop_tx);
        }
        Ok(s)
    }

    /// The runtime of the session `tsih`, if sessions have threads of their own.
    pub fn of(&self, tsih: u16) -> Option<&Handle> {
        if self.handles.is_empty() {
            return None;
        }
        self.handles.get(usize::from(tsih) % self.handles.len())
    }

    /// Runs `f` with `stream` on the thread of session `tsih`: the stream is taken off this
    /// runtime and registered on that one. Without session threads, or for `None` (a session
    /// of one connection), runs it here. An error means the stream could not be moved (it is
    /// closed).
    pub async fn run_on<S, F, Fut>(&self, tsih: Option<u16>, stream: S, f: F) -> std::io::Result<()>
    where
        S: Transport,
        F: FnOnce(S) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let Some(h) = tsih.and_then(|t| self.of(t)) else {
            f(stream).await;
            return Ok(());
        };
        let detached = stream.detach()?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let span = tracing::Span::current();
        let moved = async move {
            match S::attach(detached) {
                Ok(stream) => {
                    let _ = tx.send(Ok(()));
                    f(stream).await;
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        };
        h.spawn(moved.instrument(span));
        rx.await
            .unwrap_or_else(|_| Err(std::io::Error::other("the session thread has stopped")))
    }
}

impl Drop for Shards {
    fn drop(&mut self) {
        for s in self.stops.drain(..) {
            let _ = s.send(());
        }
    }
}
