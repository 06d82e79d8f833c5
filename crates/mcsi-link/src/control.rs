//! The link's control socket (`mcsi link run --control PATH`): a Unix stream socket taking one
//! command per line while the link runs, so that a route can be failed and restored by hand or
//! from a script at any moment, not only at times given in advance.
//!
//! ```text
//! down 1      path 1 goes down now
//! up 1        path 1 comes back
//! paths       how many paths, and which are down
//! ```
//!
//! Each line gets one answer line, `ok ...` or `error: ...`. At most four clients are served
//! at once, and one that sends nothing for [`CLIENT_IDLE`] is dropped, so that idle clients
//! cannot lock the socket out.

use crate::link::PathError;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// A command the forwarder applies at its next turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// A path goes down (`up` false) or comes back.
    Path { path: usize, up: bool },
}

/// Parses one line against a link of `paths` paths; the error says what is accepted.
pub fn parse(line: &str, paths: usize) -> Result<Command, PathError> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let (up, n) = match words.as_slice() {
        ["down", n] => (false, *n),
        ["up", n] => (true, *n),
        _ => return Err(PathError::CommandSyntax(line.trim().to_string())),
    };
    let path: usize = n
        .parse()
        .map_err(|_| PathError::NotANumber(n.to_string()))?;
    if path >= paths {
        return Err(PathError::NoSuchPath { path, paths });
    }
    Ok(Command::Path { path, up })
}

/// The listening socket and the thread that serves it; the socket file goes when this is
/// dropped.
pub struct ControlSocket {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What the control thread shares with the forwarder: commands to apply, and each path's state
/// as last applied (for `paths`).
pub struct Shared {
    pub tx: mpsc::Sender<Command>,
    pub down: Arc<Mutex<Vec<bool>>>,
    /// Wakes the forwarder (an eventfd).
    pub wake: Box<dyn Fn() + Send>,
}

impl ControlSocket {
    /// Binds `path` (a socket file left by an earlier run is replaced; any other file is an
    /// error) and serves it on a thread.
    pub fn start(path: &Path, paths: usize, shared: Shared) -> std::io::Result<ControlSocket> {
        Self::start_idle(path, paths, shared, CLIENT_IDLE)
    }

    /// [`ControlSocket::start`], dropping clients idle for `idle`.
    fn start_idle(
        path: &Path,
        paths: usize,
        shared: Shared,
        idle: std::time::Duration,
    ) -> std::io::Result<ControlSocket> {
        if let Ok(m) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if !m.file_type().is_socket() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("mcsi-link-control".into())
            .spawn(move || serve(listener, paths, shared, stop2, idle))?;
        Ok(ControlSocket {
            path: path.to_path_buf(),
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Clients at once; more wait for one to leave.
const MAX_CLIENTS: usize = 4;
/// The longest line taken; a longer one is refused and the client dropped.
const MAX_LINE: u64 = 256;
/// A client that sends nothing this long is dropped (its place goes to the next).
pub const CLIENT_IDLE: std::time::Duration = std::time::Duration::from_secs(10);

fn serve(
    listener: UnixListener,
    paths: usize,
    shared: Shared,
    stop: Arc<AtomicBool>,
    idle: std::time::Duration,
) {
    let shared = Arc::new(Mutex::new(shared));
    let clients = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((s, _)) if clients.load(Ordering::Relaxed) < MAX_CLIENTS => {
                clients.fetch_add(1, Ordering::Relaxed);
                let (sh, cl, st) = (shared.clone(), clients.clone(), stop.clone());
                let spawned = std::thread::Builder::new()
                    .name("mcsi-link-control-client".into())
                    .spawn(move || {
                        client(s, paths, &sh, &st, idle);
                        cl.fetch_sub(1, Ordering::Relaxed);
                    });
                if spawned.is_err() {
                    clients.fetch_sub(1, Ordering::Relaxed);
                }
            }
            Ok((mut s, _)) => {
                let _ = writeln!(s, "error: {MAX_CLIENTS} clients already connected");
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => {
                tracing::warn!("control socket: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

fn client(
    s: UnixStream,
    paths: usize,
    shared: &Mutex<Shared>,
    stop: &AtomicBool,
    idle: std::time::Duration,
) {
    let _ = s.set_read_timeout(Some(std::time::Duration::from_millis(50).min(idle)));
    let Ok(mut out) = s.try_clone() else { return };
    let mut r = BufReader::new(s);
    let mut line = String::new();
    let mut heard = std::time::Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if heard.elapsed() >= idle {
            let _ = writeln!(out, "error: nothing received for {idle:?}; closing");
            return;
        }
        // A line cut by the read timeout goes on where it stopped.
        if line.ends_with('\n') {
            line.clear();
        }
        match Read::by_ref(&mut r).take(MAX_LINE).read_line(&mut line) {
            Ok(0) => return,
            Ok(_) if !line.ends_with('\n') && line.len() as u64 >= MAX_LINE => {
                let _ = writeln!(out, "error: line longer than {MAX_LINE} bytes");
                return;
            }
            Ok(_) => heard = std::time::Instant::now(),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(_) => return,
        }
        let answer = answer(line.trim(), paths, shared);
        if writeln!(out, "{answer}").is_err() {
            return;
        }
    }
}

fn answer(line: &str, paths: usize, shared: &Mutex<Shared>) -> String {
    if line.is_empty() {
        return "error: empty line: expected 'down PATH', 'up PATH' or 'paths'".into();
    }
    let sh = shared.lock().unwrap_or_else(|p| p.into_inner());
    if line == "paths" {
        let down = sh.down.lock().unwrap_or_else(|p| p.into_inner());
        let list: Vec<String> = (0..paths)
            .map(|i| {
                format!(
                    "{i} {}",
                    if down.get(i).copied().unwrap_or(false) {
                        "down"
                    } else {
                        "up"
                    }
                )
            })
            .collect();
        return format!("ok {paths} path(s): {}", list.join(", "));
    }
    match parse(line, paths) {
        Ok(c @ Command::Path { path, up }) => {
            if sh.tx.send(c).is_err() {
                return "error: the link has stopped".into();
            }
            (sh.wake)();
            format!("ok path {path} {}", if up { "up" } else { "down" })
        }
        Err(e) => format!("error: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_or_say_what_is_accepted() {
        assert_eq!(parse("down 1", 2), Ok(Command::Path { path: 1, up: false }));
        assert_eq!(
            parse("  up   0 ", 2),
            Ok(Command::Path { path: 0, up: true })
        );
        assert_eq!(
            parse("down 2", 2),
            Err(PathError::NoSuchPath { path: 2, paths: 2 })
        );
        assert_eq!(parse("down x", 2), Err(PathError::NotANumber("x".into())));
        let sideways = parse("sideways 1", 2).unwrap_err();
        assert_eq!(sideways, PathError::CommandSyntax("sideways 1".into()));
        assert!(sideways.to_string().contains("expected 'down PATH'"));
        assert_eq!(
            parse("down", 2),
            Err(PathError::CommandSyntax("down".into()))
        );
    }

    /// Four clients that connect and say nothing do not lock the socket out: each is dropped
    /// after the idle time, and a fifth is then served.
    #[test]
    fn idle_clients_are_dropped_so_that_others_get_in() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctl");
        let (tx, rx) = mpsc::channel();
        let shared = Shared {
            tx,
            down: Arc::new(Mutex::new(vec![false, false])),
            wake: Box::new(|| ()),
        };
        let idle = std::time::Duration::from_millis(300);
        let _sock = ControlSocket::start_idle(&path, 2, shared, idle).unwrap();
        let idlers: Vec<UnixStream> = (0..MAX_CLIENTS)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(100));
        // A fifth while the four hold their places: refused.
        let mut r = String::new();
        BufReader::new(UnixStream::connect(&path).unwrap())
            .read_line(&mut r)
            .unwrap();
        assert!(r.contains("clients already connected"), "{r}");
        // The idlers are told why and dropped.
        for s in idlers {
            let mut line = String::new();
            BufReader::new(s).read_line(&mut line).unwrap();
            assert!(line.contains("nothing received"), "{line}");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        let mut s = UnixStream::connect(&path).unwrap();
        writeln!(s, "down 1").unwrap();
        let mut answer = String::new();
        BufReader::new(s).read_line(&mut answer).unwrap();
        assert_eq!(answer.trim(), "ok path 1 down");
        assert_eq!(rx.recv().unwrap(), Command::Path { path: 1, up: false });
    }
}
