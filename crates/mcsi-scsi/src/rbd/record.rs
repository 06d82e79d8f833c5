//! What every gateway of an RBD image shares: its persistent reservations and its port group
//! states, each one RADOS object beside the image (`mcsi.pr.<image id>`, `mcsi.alua.<image
//! id>`, in the image's pool), replaced only at the
//! version it was read at (an assert_version write), and announced with watch/notify: a
//! gateway that changes it notifies the object, and librados returns once every gateway
//! watching it has acknowledged (or after the timeout), each having marked its copy stale.

use super::{errno, rados_ioctx_t, rados_t};
use crate::backend::{BackendError, SharedState};
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

#[allow(non_camel_case_types)]
type rados_write_op_t = *mut c_void;
type WatchCb = extern "C" fn(
    arg: *mut c_void,
    notify_id: u64,
    cookie: u64,
    notifier_id: u64,
    data: *mut c_void,
    data_len: usize,
);
type WatchErrCb = extern "C" fn(arg: *mut c_void, cookie: u64, err: c_int);

#[link(name = "rados")]
extern "C" {
    fn rados_read(
        io: rados_ioctx_t,
        oid: *const c_char,
        buf: *mut c_char,
        len: usize,
        off: u64,
    ) -> c_int;
    fn rados_stat(io: rados_ioctx_t, oid: *const c_char, size: *mut u64, mtime: *mut i64) -> c_int;
    fn rados_get_last_version(io: rados_ioctx_t) -> u64;
    fn rados_create_write_op() -> rados_write_op_t;
    fn rados_release_write_op(op: rados_write_op_t);
    fn rados_write_op_create(op: rados_write_op_t, exclusive: c_int, category: *const c_char);
    fn rados_write_op_assert_version(op: rados_write_op_t, ver: u64);
    fn rados_write_op_write_full(op: rados_write_op_t, buf: *const c_char, len: usize);
    fn rados_write_op_operate(
        op: rados_write_op_t,
        io: rados_ioctx_t,
        oid: *const c_char,
        mtime: *mut i64,
        flags: c_int,
    ) -> c_int;
    fn rados_watch2(
        io: rados_ioctx_t,
        oid: *const c_char,
        cookie: *mut u64,
        cb: WatchCb,
        err: WatchErrCb,
        arg: *mut c_void,
    ) -> c_int;
    fn rados_unwatch2(io: rados_ioctx_t, cookie: u64) -> c_int;
    fn rados_notify_ack(
        io: rados_ioctx_t,
        oid: *const c_char,
        notify_id: u64,
        cookie: u64,
        buf: *const c_char,
        len: c_int,
    ) -> c_int;
    fn rados_notify2(
        io: rados_ioctx_t,
        oid: *const c_char,
        buf: *const c_char,
        len: c_int,
        timeout_ms: u64,
        reply: *mut *mut c_char,
        reply_len: *mut usize,
    ) -> c_int;
    fn rados_buffer_free(buf: *mut c_char);
    fn rados_ioctx_create2(cluster: rados_t, pool_id: i64, ioctx: *mut rados_ioctx_t) -> c_int;
    fn rados_ioctx_destroy(io: rados_ioctx_t);
    fn rados_watch_flush(cluster: rados_t) -> c_int;
    fn rados_get_instance_id(cluster: rados_t) -> u64;
}

/// The largest record read: 1,024 registrations with their names fit in well under it.
const MAX_RECORD: u64 = 4 << 20;
/// How long an announcement waits for every gateway's acknowledgement.
const NOTIFY_TIMEOUT_MS: u64 = 10_000;

/// What the watch callbacks reach (boxed, so that its address stays put while watched).
struct Watcher {
    io: rados_ioctx_t,
    oid: CString,
    /// This client's id: its own announcements are not news to it.
    me: u64,
    heard: Box<dyn Fn() + Send + Sync>,
    /// What the record holds, for messages.
    kind: &'static str,
    /// The watch broke (the cluster lost this client for a while): announcements may have
    /// been missed, and the watch is made again at the next read.
    broken: AtomicBool,
}

/// The record of one image, on the backend's cluster handle (which the backend keeps open
/// longer than this: it drops the record first) and two pool contexts of its own: one reads
/// and replaces, the other watches and announces. A read's version is the context's last
/// version, which any operation on the context sets (an announcement included), so nothing
/// else may run on the reading context between the read and the taking of its version.
pub(super) struct Record {
    cluster: rados_t,
    /// Watches, acknowledges and announces.
    notify_io: rados_ioctx_t,
    /// What the record holds, for messages ("the shared persistent reservations").
    kind: &'static str,
    io: rados_ioctx_t,
    oid: CString,
    /// The read and its version are two calls on the context: one read at a time.
    reading: Mutex<()>,
    watch: Mutex<Option<(u64, Box<Watcher>)>>,
}

// librados handles are thread-safe; the watcher is only read from callbacks.
unsafe impl Send for Record {}
unsafe impl Sync for Record {}

/// What an RBD image shares with its gateways: the object's name prefix, and what it holds.
#[derive(Debug, Clone, Copy)]
pub(super) enum Kind {
    Reservations,
    PortGroups,
}

impl Kind {
    fn prefix(self) -> &'static str {
        match self {
            Kind::Reservations => "mcsi.pr.",
            Kind::PortGroups => "mcsi.alua.",
        }
    }
    fn name(self) -> &'static str {
        match self {
            Kind::Reservations => "the shared persistent reservations",
            Kind::PortGroups => "the shared port group states",
        }
    }
}

fn shared(what: &str, kind: &str, rc: c_int) -> BackendError {
    BackendError::Shared(format!("{what} {kind}: {}", errno(rc.into())))
}

impl Record {
    /// The record of the image `image_id` in pool `pool_id`, created empty when it does not
    /// exist yet.
    pub(super) fn open(
        cluster: rados_t,
        pool_id: i64,
        image_id: &str,
        kind: Kind,
    ) -> Result<Record, BackendError> {
        let oid = CString::new(format!("{}{image_id}", kind.prefix()))
            .map_err(|_| BackendError::Shared(format!("image id {image_id:?} has a NUL")))?;
        let context = || {
            let mut io: rados_ioctx_t = std::ptr::null_mut();
            // SAFETY: a connected cluster handle; the context is destroyed by Drop (or below).
            let rc = unsafe { rados_ioctx_create2(cluster, pool_id, &mut io) };
            if rc < 0 {
                Err(shared("opening the pool of", kind.name(), rc))
            } else {
                Ok(io)
            }
        };
        let io = context()?;
        let notify_io = match context() {
            Ok(n) => n,
            Err(e) => {
                // SAFETY: created above, used by nothing else.
                unsafe { rados_ioctx_destroy(io) };
                return Err(e);
            }
        };
        // From here Drop releases both contexts.
        let record = Record {
            cluster,
            notify_io,
            kind: kind.name(),
            io,
            oid,
            reading: Mutex::new(()),
            watch: Mutex::new(None),
        };
        // SAFETY: a fresh write op, released on every path; valid context and name.
        unsafe {
            let op = rados_create_write_op();
            rados_write_op_create(op, 0, std::ptr::null());
            let rc =
                rados_write_op_operate(op, record.io, record.oid.as_ptr(), std::ptr::null_mut(), 0);
            rados_release_write_op(op);
            if rc < 0 {
                return Err(shared("creating", kind.name(), rc));
            }
        }
        Ok(record)
    }

    /// Makes the watch again after it broke; on failure the unit is told to read again at its
    /// next command, and this tries again then.
    fn rewatch(&self) {
        let mut w = self.watch.lock().unwrap_or_else(|p| p.into_inner());
        let Some((cookie, watcher)) = w.as_mut() else {
            return;
        };
        if !watcher.broken.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: the old cookie is this record's; the watcher outlives the new watch (it is
        // dropped only after rados_unwatch2 and rados_watch_flush in Drop).
        let rc = unsafe {
            rados_unwatch2(self.notify_io, *cookie);
            let arg = std::ptr::from_ref::<Watcher>(watcher).cast_mut().cast();
            rados_watch2(
                self.notify_io,
                self.oid.as_ptr(),
                cookie,
                watch_cb,
                watch_err_cb,
                arg,
            )
        };
        if rc < 0 {
            tracing::warn!("watching {} again: {}", self.kind, errno(rc.into()));
            (watcher.heard)();
        } else {
            watcher.broken.store(false, Ordering::Release);
        }
    }
}

impl SharedState for Record {
    fn read(&self) -> Result<(Vec<u8>, u64), BackendError> {
        self.rewatch();
        let _one = self.reading.lock().unwrap_or_else(|p| p.into_inner());
        let mut size = 0u64;
        let mut mtime = 0i64;
        // SAFETY: out-pointers to locals; valid context and name.
        let rc = unsafe { rados_stat(self.io, self.oid.as_ptr(), &mut size, &mut mtime) };
        if rc < 0 {
            return Err(shared("reading", self.kind, rc));
        }
        // Room past the size seen, in case it grew since: a read that fills the buffer may be
        // short of the whole record, and is made again with more room.
        let mut room = size + 4096;
        loop {
            if room > MAX_RECORD {
                return Err(BackendError::Shared(format!(
                    "{} are larger than {MAX_RECORD} bytes",
                    self.kind
                )));
            }
            let mut buf = vec![0u8; room as usize];
            // SAFETY: the buffer is `room` bytes long.
            let (rc, version) = unsafe {
                let rc = rados_read(
                    self.io,
                    self.oid.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                );
                (rc, rados_get_last_version(self.io))
            };
            if rc < 0 {
                return Err(shared("reading", self.kind, rc));
            }
            let n = rc as usize;
            if n < buf.len() {
                buf.truncate(n);
                return Ok((buf, version));
            }
            room *= 2;
        }
    }

    fn replace(&self, bytes: &[u8], version: u64) -> Result<bool, BackendError> {
        // Not while a read is between its read and its version (the same context).
        let _one = self.reading.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: a fresh write op, released on every path; the buffer outlives the call.
        let rc = unsafe {
            let op = rados_create_write_op();
            rados_write_op_assert_version(op, version);
            rados_write_op_write_full(op, bytes.as_ptr().cast(), bytes.len());
            let rc =
                rados_write_op_operate(op, self.io, self.oid.as_ptr(), std::ptr::null_mut(), 0);
            rados_release_write_op(op);
            rc
        };
        match rc {
            // The version moved on (another gateway stored first).
            rc if rc == -libc::ERANGE || rc == -libc::EOVERFLOW => Ok(false),
            rc if rc < 0 => Err(shared("storing", self.kind, rc)),
            _ => Ok(true),
        }
    }

    fn announce(&self) -> Result<(), BackendError> {
        let mut reply: *mut c_char = std::ptr::null_mut();
        let mut reply_len = 0usize;
        // SAFETY: the payload is a static; the reply buffer, when set, is freed once.
        let rc = unsafe {
            let rc = rados_notify2(
                self.notify_io,
                self.oid.as_ptr(),
                c"pr".as_ptr(),
                2,
                NOTIFY_TIMEOUT_MS,
                &mut reply,
                &mut reply_len,
            );
            if !reply.is_null() {
                rados_buffer_free(reply);
            }
            rc
        };
        if rc < 0 {
            return Err(shared("announcing a change of", self.kind, rc));
        }
        Ok(())
    }

    fn watch(&self, heard: Box<dyn Fn() + Send + Sync>) -> Result<(), BackendError> {
        let mut w = self.watch.lock().unwrap_or_else(|p| p.into_inner());
        if w.is_some() {
            return Err(BackendError::Shared(format!(
                "{} are watched already",
                self.kind
            )));
        }
        let watcher = Box::new(Watcher {
            io: self.notify_io,
            oid: self.oid.clone(),
            // SAFETY: a connected cluster handle.
            me: unsafe { rados_get_instance_id(self.cluster) },
            heard,
            kind: self.kind,
            broken: AtomicBool::new(false),
        });
        let mut cookie = 0u64;
        // SAFETY: the watcher is boxed and kept in `self.watch` until Drop has unwatched and
        // flushed the callbacks.
        let rc = unsafe {
            let arg = std::ptr::from_ref::<Watcher>(&watcher).cast_mut().cast();
            rados_watch2(
                self.notify_io,
                self.oid.as_ptr(),
                &mut cookie,
                watch_cb,
                watch_err_cb,
                arg,
            )
        };
        if rc < 0 {
            return Err(shared("watching", self.kind, rc));
        }
        *w = Some((cookie, watcher));
        Ok(())
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        let w = self
            .watch
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((cookie, watcher)) = w {
            // SAFETY: the cookie is this record's watch; after the flush no callback runs, so
            // the watcher can go.
            unsafe {
                rados_unwatch2(self.notify_io, cookie);
                rados_watch_flush(self.cluster);
            }
            drop(watcher);
        }
        // SAFETY: the record's own contexts, no longer used (no watch, no callback).
        unsafe {
            rados_ioctx_destroy(self.io);
            rados_ioctx_destroy(self.notify_io);
        }
    }
}

extern "C" fn watch_cb(
    arg: *mut c_void,
    notify_id: u64,
    cookie: u64,
    notifier_id: u64,
    _data: *mut c_void,
    _len: usize,
) {
    // SAFETY: `arg` is the boxed Watcher, alive while the watch is (see Record::watch).
    let w = unsafe { &*arg.cast::<Watcher>() };
    if notifier_id != w.me {
        (w.heard)();
    }
    // SAFETY: valid context and name; an empty reply.
    unsafe {
        rados_notify_ack(w.io, w.oid.as_ptr(), notify_id, cookie, std::ptr::null(), 0);
    }
}

extern "C" fn watch_err_cb(arg: *mut c_void, _cookie: u64, err: c_int) {
    // SAFETY: as in watch_cb.
    let w = unsafe { &*arg.cast::<Watcher>() };
    tracing::warn!(
        "the watch on {} broke ({}); they are read again",
        w.kind,
        errno(err.into())
    );
    w.broken.store(true, Ordering::Release);
    (w.heard)();
}
