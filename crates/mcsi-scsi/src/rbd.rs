//! A Ceph RBD image as a backend (`rbd:POOL/IMAGE[,conf=PATH][,id=NAME][,cache=on|off]`), through librbd and
//! librados (Debian's librbd-dev and librados-dev), over a small extern block of the functions
//! used. READ, WRITE, flushes and COMPARE AND WRITE go through librbd's asynchronous calls
//! (`rbd_aio_*`): a completion callback ends them, and no thread waits. The rest (UNMAP, GET LBA
//! STATUS, WRITE SAME, whose zeros go as `rbd_write_zeroes`, the other commands) uses the
//! synchronous calls on the transport's blocking pool. The image is opened once and shared by every I/O (librbd's handles are
//! thread-safe).

use crate::backend::{
    AioCompletion, AioDone, AioOp, AsyncBackend, Backend, BackendError, SharedState,
};
use bytes::Bytes;
use std::ffi::{c_char, c_int, c_void, CString};
use std::io;
use std::path::PathBuf;

mod record;

#[allow(non_camel_case_types)]
type rados_t = *mut c_void;
#[allow(non_camel_case_types)]
type rados_ioctx_t = *mut c_void;
#[allow(non_camel_case_types)]
type rbd_image_t = *mut c_void;
#[allow(non_camel_case_types)]
type rbd_completion_t = *mut c_void;
type RbdCallback = extern "C" fn(c: rbd_completion_t, arg: *mut c_void);

#[link(name = "rados")]
extern "C" {
    fn rados_create(cluster: *mut rados_t, id: *const c_char) -> c_int;
    fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    fn rados_connect(cluster: rados_t) -> c_int;
    fn rados_shutdown(cluster: rados_t);
    fn rados_ioctx_create(
        cluster: rados_t,
        pool_name: *const c_char,
        ioctx: *mut rados_ioctx_t,
    ) -> c_int;
    fn rados_ioctx_destroy(io: rados_ioctx_t);
    fn rados_cluster_fsid(cluster: rados_t, buf: *mut c_char, len: usize) -> c_int;
    fn rados_ioctx_get_id(io: rados_ioctx_t) -> i64;
}

type DiffCb = extern "C" fn(offset: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int;

#[link(name = "rbd")]
extern "C" {
    fn rbd_open(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    fn rbd_close(image: rbd_image_t) -> c_int;
    fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
    fn rbd_resize(image: rbd_image_t, size: u64) -> c_int;
    fn rbd_get_stripe_unit(image: rbd_image_t, stripe_unit: *mut u64) -> c_int;
    fn rbd_get_id(image: rbd_image_t, id: *mut c_char, id_len: usize) -> c_int;
    fn rbd_get_block_name_prefix(
        image: rbd_image_t,
        prefix: *mut c_char,
        prefix_len: usize,
    ) -> c_int;
    fn rbd_aio_create_completion(
        cb_arg: *mut c_void,
        complete_cb: RbdCallback,
        c: *mut rbd_completion_t,
    ) -> c_int;
    fn rbd_aio_get_return_value(c: rbd_completion_t) -> isize;
    fn rbd_aio_release(c: rbd_completion_t);
    fn rbd_aio_read(
        image: rbd_image_t,
        off: u64,
        len: usize,
        buf: *mut c_char,
        c: rbd_completion_t,
    ) -> c_int;
    fn rbd_aio_write(
        image: rbd_image_t,
        off: u64,
        len: usize,
        buf: *const c_char,
        c: rbd_completion_t,
    ) -> c_int;
    fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
    fn rbd_aio_compare_and_write(
        image: rbd_image_t,
        off: u64,
        len: usize,
        cmp_buf: *const c_char,
        buf: *const c_char,
        c: rbd_completion_t,
        mismatch_off: *mut u64,
        op_flags: c_int,
    ) -> isize;
    fn rbd_read(image: rbd_image_t, ofs: u64, len: usize, buf: *mut c_char) -> isize;
    fn rbd_write(image: rbd_image_t, ofs: u64, len: usize, buf: *const c_char) -> isize;
    fn rbd_discard(image: rbd_image_t, ofs: u64, len: u64) -> c_int;
    fn rbd_write_zeroes(
        image: rbd_image_t,
        ofs: u64,
        len: usize,
        zero_flags: c_int,
        op_flags: c_int,
    ) -> isize;
    fn rbd_flush(image: rbd_image_t) -> c_int;
    fn rbd_diff_iterate2(
        image: rbd_image_t,
        fromsnapname: *const c_char,
        ofs: u64,
        len: u64,
        include_parent: u8,
        whole_object: u8,
        cb: DiffCb,
        arg: *mut c_void,
    ) -> c_int;
}

/// What `rbd:` names: a pool, an image, and how to reach the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdSpec {
    pub pool: String,
    pub image: String,
    /// ceph.conf to read (None: librados's default search, /etc/ceph/ceph.conf first).
    pub conf: Option<String>,
    /// The client's id ("admin" for client.admin; None: librados's default).
    pub id: Option<String>,
    /// librbd's cache (`cache=on`). Off by default: with it a write is acknowledged before the
    /// OSDs have it, and another gateway on the image would read older data meanwhile.
    pub cache: bool,
}

/// An `rbd:` spec that names no image, or asks for what the backend does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RbdSpecError {
    #[error("'{0}' is not POOL/IMAGE")]
    NotPoolImage(String),
    #[error("unknown rbd option '{0}' (use conf=PATH, id=NAME, cache=on|off)")]
    UnknownOption(String),
    #[error("{what} '{value}' contains a NUL byte")]
    NulByte { what: &'static str, value: String },
}

impl RbdSpec {
    /// Parses what follows `rbd:`: `POOL/IMAGE[,conf=PATH][,id=NAME][,cache=on|off]`.
    pub fn parse(rest: &str) -> Result<RbdSpec, RbdSpecError> {
        let mut parts = rest.split(',');
        let name = parts.next().unwrap_or("");
        let Some((pool, image)) = name.split_once('/') else {
            return Err(RbdSpecError::NotPoolImage(name.into()));
        };
        if pool.is_empty() || image.is_empty() || image.contains('/') {
            return Err(RbdSpecError::NotPoolImage(name.into()));
        }
        let mut spec = RbdSpec {
            pool: pool.into(),
            image: image.into(),
            conf: None,
            id: None,
            cache: false,
        };
        for p in parts {
            match p.split_once('=') {
                Some(("conf", v)) if !v.is_empty() => spec.conf = Some(v.into()),
                Some(("id", v)) if !v.is_empty() => spec.id = Some(v.into()),
                Some(("cache", "on")) => spec.cache = true,
                Some(("cache", "off")) => spec.cache = false,
                _ => return Err(RbdSpecError::UnknownOption(p.into())),
            }
        }
        Ok(spec)
    }

    fn describe(&self) -> String {
        format!("rbd:{}/{}", self.pool, self.image)
    }
}

/// An open RBD image: the cluster connection, the pool's I/O context and the image handle.
pub struct RbdBackend {
    spec: RbdSpec,
    cluster: rados_t,
    ioctx: rados_ioctx_t,
    image: rbd_image_t,
    /// The image's size as served (it only grows, by [`Backend::grow`]).
    size: std::sync::atomic::AtomicU64,
    /// The image's stripe unit (its object size unless striped): librbd does COMPARE AND
    /// WRITE atomically only within one.
    stripe_unit: u64,
    /// The cluster's fsid, the pool's id and the image's id: the same through every gateway,
    /// and a new image of the same name gets another.
    identity: String,
    /// The image's persistent reservations, shared by every gateway on it.
    record: Option<record::Record>,
    /// The port group states every gateway of the image shares (mcsi.alua.<image id>).
    alua_record: Option<record::Record>,
}

// librados and librbd handles may be used from any thread at once (librbd serialises what it
// must itself); they are closed only on drop, when no call can be in progress.
unsafe impl Send for RbdBackend {}
unsafe impl Sync for RbdBackend {}

fn cstr(what: &'static str, s: &str) -> Result<CString, RbdSpecError> {
    CString::new(s).map_err(|_| RbdSpecError::NulByte {
        what,
        value: s.into(),
    })
}

/// librados and librbd return a negated errno.
fn errno(rc: i64) -> io::Error {
    io::Error::from_raw_os_error(i32::try_from(-rc).unwrap_or(libc::EIO))
}

impl RbdBackend {
    /// Connects to the cluster and opens the image (a read-only LUN refuses writes itself).
    pub fn open(spec: RbdSpec) -> Result<RbdBackend, BackendError> {
        let name = spec.describe();
        let fail = |step: &str, why: String| BackendError::Open {
            path: PathBuf::from(&name),
            why: format!("{step}: {why}"),
        };
        let bad = |why: RbdSpecError| fail("invalid name", why.to_string());
        let id = spec
            .id
            .as_deref()
            .map(|i| cstr("id", i))
            .transpose()
            .map_err(bad)?;
        let conf = spec
            .conf
            .as_deref()
            .map(|c| cstr("conf", c))
            .transpose()
            .map_err(bad)?;
        let pool = cstr("pool", &spec.pool).map_err(bad)?;
        let image_name = cstr("image", &spec.image).map_err(bad)?;
        let mut b = RbdBackend {
            spec,
            cluster: std::ptr::null_mut(),
            ioctx: std::ptr::null_mut(),
            image: std::ptr::null_mut(),
            size: std::sync::atomic::AtomicU64::new(0),
            stripe_unit: 0,
            identity: String::new(),
            record: None,
            alua_record: None,
        };
        // SAFETY: each call gets valid NUL-terminated strings and out-pointers to this
        // struct's fields; a handle is used only after the call that sets it succeeded, and
        // Drop releases whatever was set (in reverse order) when a later step fails.
        unsafe {
            let rc = rados_create(
                &mut b.cluster,
                id.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            );
            if rc < 0 {
                b.cluster = std::ptr::null_mut();
                return Err(fail("rados_create", errno(rc.into()).to_string()));
            }
            let rc = rados_conf_read_file(
                b.cluster,
                conf.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            );
            if rc < 0 {
                let which = b.spec.conf.as_deref().unwrap_or("the default ceph.conf");
                return Err(fail(
                    &format!("reading {which}"),
                    errno(rc.into()).to_string(),
                ));
            }
            // A cluster that does not answer fails the open in 10 s rather than hanging.
            // UNMAP's promise that unmapped blocks read as zeros (LBPRZ) holds only if librbd
            // zeroes the parts of objects it cannot discard whole, rather than skip them.
            // librbd's cache acknowledges writes before the OSDs have them: a gateway beside
            // this one would read older data meanwhile, so it is off unless asked for.
            let cache = if b.spec.cache { "true" } else { "false" };
            for (k, v) in [
                ("client_mount_timeout", "10"),
                ("rados_mon_op_timeout", "10"),
                ("rbd_skip_partial_discard", "false"),
                ("rbd_cache", cache),
            ] {
                let (k, v) = (
                    cstr("option", k).map_err(bad)?,
                    cstr("value", v).map_err(bad)?,
                );
                rados_conf_set(b.cluster, k.as_ptr(), v.as_ptr());
            }
            let rc = rados_connect(b.cluster);
            if rc < 0 {
                return Err(fail(
                    "connecting to the cluster",
                    errno(rc.into()).to_string(),
                ));
            }
            let rc = rados_ioctx_create(b.cluster, pool.as_ptr(), &mut b.ioctx);
            if rc < 0 {
                b.ioctx = std::ptr::null_mut();
                return Err(fail(
                    &format!("opening pool '{}'", b.spec.pool),
                    errno(rc.into()).to_string(),
                ));
            }
            let rc = rbd_open(b.ioctx, image_name.as_ptr(), &mut b.image, std::ptr::null());
            if rc < 0 {
                b.image = std::ptr::null_mut();
                return Err(fail(
                    &format!("opening image '{}'", b.spec.image),
                    errno(rc.into()).to_string(),
                ));
            }
            let rc = rbd_get_size(b.image, b.size.get_mut());
            if rc < 0 {
                return Err(fail(
                    "reading the image's size",
                    errno(rc.into()).to_string(),
                ));
            }
            let rc = rbd_get_stripe_unit(b.image, &mut b.stripe_unit);
            if rc < 0 {
                return Err(fail(
                    "reading the image's stripe unit",
                    errno(rc.into()).to_string(),
                ));
            }
            let mut fsid = [0u8; 64];
            let mut image_id = [0u8; 64];
            let rc = rados_cluster_fsid(b.cluster, fsid.as_mut_ptr().cast(), fsid.len());
            if rc < 0 {
                return Err(fail(
                    "reading the cluster's fsid",
                    errno(rc.into()).to_string(),
                ));
            }
            let mut rc = rbd_get_id(b.image, image_id.as_mut_ptr().cast(), image_id.len());
            if rc < 0 {
                // An old (format 1) image has no id; its objects' name prefix is as unique.
                image_id = [0u8; 64];
                rc = rbd_get_block_name_prefix(
                    b.image,
                    image_id.as_mut_ptr().cast(),
                    image_id.len(),
                );
            }
            if rc < 0 {
                return Err(fail("reading the image's id", errno(rc.into()).to_string()));
            }
            let text = |buf: &[u8]| {
                let end = buf.iter().position(|&c| c == 0).unwrap_or(buf.len());
                String::from_utf8_lossy(&buf[..end]).into_owned()
            };
            b.identity = format!(
                "ceph:{}/pool:{}/image:{}",
                text(&fsid),
                rados_ioctx_get_id(b.ioctx),
                text(&image_id)
            );
            let id = text(&image_id);
            let pool = rados_ioctx_get_id(b.ioctx);
            b.record = Some(record::Record::open(
                b.cluster,
                pool,
                &id,
                record::Kind::Reservations,
            )?);
            b.alua_record = Some(record::Record::open(
                b.cluster,
                pool,
                &id,
                record::Kind::PortGroups,
            )?);
        }
        if *b.size.get_mut() == 0 {
            return Err(fail("the image", "is empty (0 bytes)".into()));
        }
        Ok(b)
    }

    fn io_err(op: &'static str, offset: u64, rc: i64) -> BackendError {
        BackendError::Io {
            op,
            offset,
            cause: errno(rc),
        }
    }

    fn check(&self, op: &'static str, offset: u64, len: u64) -> Result<(), BackendError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size() => Ok(()),
            _ => Err(BackendError::OutOfRange {
                op,
                offset,
                len,
                size: self.size(),
            }),
        }
    }
}

impl Drop for RbdBackend {
    fn drop(&mut self) {
        // The record's watch goes first: it uses the pool context and the cluster.
        drop(self.record.take());
        drop(self.alua_record.take());
        // SAFETY: each handle is non-null only if its open succeeded, and is released once.
        unsafe {
            if !self.image.is_null() {
                rbd_close(self.image);
            }
            if !self.ioctx.is_null() {
                rados_ioctx_destroy(self.ioctx);
            }
            if !self.cluster.is_null() {
                rados_shutdown(self.cluster);
            }
        }
    }
}

/// Extents rbd_diff_iterate2 reports, gathered by [`diff_cb`].
struct Extents {
    found: Vec<(u64, u64)>,
}

extern "C" fn diff_cb(offset: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Extents` that `mapped` passes and keeps alive for the call.
    let ext = unsafe { &mut *(arg as *mut Extents) };
    if exists != 0 {
        ext.found.push((offset, len as u64));
    }
    0
}

impl Backend for RbdBackend {
    fn size(&self) -> u64 {
        self.size.load(std::sync::atomic::Ordering::Acquire)
    }

    fn grow(&self, size: Option<u64>) -> Result<u64, BackendError> {
        let now = self.size();
        let fail = |step: &str, rc: c_int| {
            BackendError::Resize(format!(
                "{}: {step}: {}",
                self.spec.describe(),
                errno(rc.into())
            ))
        };
        // The image's size now: another gateway or `rbd resize` may have grown it already.
        let mut image = 0u64;
        // SAFETY: the image handle is open for the backend's life; librbd writes one u64
        // through the pointer, reading the image's header again when another client changed it.
        let rc = unsafe { rbd_get_size(self.image, &mut image) };
        if rc < 0 {
            return Err(fail("rbd_get_size", rc));
        }
        let new = match size {
            // rbd_resize also shrinks: never below what the image has, whoever grew it.
            Some(n) if n < image => {
                return Err(BackendError::Resize(format!(
                    "{} is {image} bytes already (grown elsewhere); a LUN only grows: grow-lun without --size takes that size",
                    self.spec.describe()
                )))
            }
            Some(n) => {
                if n > image {
                    // SAFETY: as above.
                    let rc = unsafe { rbd_resize(self.image, n) };
                    if rc < 0 {
                        return Err(fail("rbd_resize", rc));
                    }
                }
                n
            }
            None => image,
        };
        if new < now {
            return Err(BackendError::Resize(format!(
                "{} is {now} bytes; a LUN only grows (the image is {new})",
                self.spec.describe()
            )));
        }
        self.size.store(new, std::sync::atomic::Ordering::Release);
        Ok(new)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.check("read", offset, buf.len() as u64)?;
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset + done as u64;
            let rest = &mut buf[done..];
            // SAFETY: `rest` is valid for writes of its length for the whole call.
            let n = unsafe { rbd_read(self.image, at, rest.len(), rest.as_mut_ptr().cast()) };
            if n < 0 {
                return Err(Self::io_err("read", at, n as i64));
            }
            if n == 0 {
                // Within the image's size librbd reads holes as zeros; nothing more is coming.
                rest.fill(0);
                break;
            }
            done += (n as usize).min(rest.len());
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.check("write", offset, data.len() as u64)?;
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let rest = &data[done..];
            // SAFETY: `rest` is valid for reads of its length for the whole call.
            let n = unsafe { rbd_write(self.image, at, rest.len(), rest.as_ptr().cast()) };
            if n <= 0 {
                return Err(Self::io_err(
                    "write",
                    at,
                    if n == 0 {
                        -(libc::EIO as i64)
                    } else {
                        n as i64
                    },
                ));
            }
            done += (n as usize).min(rest.len());
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), BackendError> {
        // SAFETY: the image handle is open.
        let rc = unsafe { rbd_flush(self.image) };
        if rc < 0 {
            return Err(Self::io_err("flush", 0, rc.into()));
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.check("write zeroes", offset, len)?;
        // Thick: the blocks stay allocated, as WRITE SAME without UNMAP leaves them.
        const RBD_WRITE_ZEROES_FLAG_THICK_PROVISION: c_int = 1;
        // SAFETY: the image handle is open; no buffer is passed.
        let rc = unsafe {
            rbd_write_zeroes(
                self.image,
                offset,
                len as usize,
                RBD_WRITE_ZEROES_FLAG_THICK_PROVISION,
                0,
            )
        };
        if rc < 0 {
            return Err(Self::io_err("write zeroes", offset, rc as i64));
        }
        Ok(())
    }

    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.check("unmap", offset, len)?;
        // SAFETY: the image handle is open.
        let rc = unsafe { rbd_discard(self.image, offset, len) };
        if rc < 0 {
            return Err(Self::io_err("unmap", offset, rc.into()));
        }
        Ok(())
    }

    fn mapped(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, BackendError> {
        self.check("mapped", offset, len)?;
        let mut ext = Extents { found: Vec::new() };
        // SAFETY: `ext` outlives the call, which invokes `diff_cb` with it synchronously.
        let rc = unsafe {
            rbd_diff_iterate2(
                self.image,
                std::ptr::null(),
                offset,
                len,
                1,
                0,
                diff_cb,
                (&mut ext as *mut Extents).cast(),
            )
        };
        if rc < 0 {
            return Err(Self::io_err("mapped", offset, rc.into()));
        }
        ext.found.sort_unstable();
        let end = offset + len;
        let mut out = Vec::new();
        let mut at = offset;
        for (o, l) in ext.found {
            let (o, e) = (o.max(at), (o + l).min(end));
            if e <= o {
                continue;
            }
            if o > at {
                out.push((at, o - at, false));
            }
            out.push((o, e - o, true));
            at = e;
        }
        if at < end {
            out.push((at, end - at, false));
        }
        Ok(out)
    }

    fn blocking(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        format!("{} ({} bytes)", self.spec.describe(), self.size())
    }

    fn aio(&self) -> Option<&dyn AsyncBackend> {
        Some(self)
    }

    fn identity(&self) -> Option<String> {
        Some(self.identity.clone())
    }
    fn shared_reservations(&self) -> Option<&dyn SharedState> {
        self.record.as_ref().map(|r| r as &dyn SharedState)
    }
    fn shared_port_groups(&self) -> Option<&dyn SharedState> {
        self.alua_record.as_ref().map(|r| r as &dyn SharedState)
    }
}

/// One asynchronous operation in flight: the operation (whose buffers librbd reads from until
/// the completion), a read's buffer, and where the result goes. Owned by the completion's
/// argument from submit to callback.
struct AioCtx {
    op: AioOp,
    /// A read's buffer (zero-filled, so a short read leaves zeros: holes).
    buf: Vec<u8>,
    /// Where librbd puts the offset of COMPARE AND WRITE's first differing byte.
    mismatch: u64,
    /// The image's stripe unit, to read a mismatch offset given from an object's start.
    object_size: u64,
    done: AioCompletion,
}

impl AioCtx {
    /// The operation's name and offset, for errors.
    fn what(&self) -> (&'static str, u64) {
        match &self.op {
            AioOp::Read { offset, .. } => ("read", *offset),
            AioOp::Write { offset, .. } => ("write", *offset),
            AioOp::Flush => ("flush", 0),
            AioOp::CompareAndWrite { offset, .. } => ("compare and write", *offset),
        }
    }

    fn complete(self, rc: i64) {
        let (name, offset) = self.what();
        let r = match self.op {
            AioOp::CompareAndWrite { .. } if rc == -(libc::EILSEQ as i64) => {
                // librbd gives the image offset of the first differing byte; some versions give
                // the object's start plus the index within the compared bytes instead. This runs
                // in librbd's callback, so nothing here may panic.
                let object_start = offset - offset % self.object_size.max(1);
                let at = self
                    .mismatch
                    .checked_sub(offset)
                    .or_else(|| self.mismatch.checked_sub(object_start))
                    .unwrap_or(0);
                Ok(AioDone::Miscompare { at })
            }
            _ if rc < 0 => Err(RbdBackend::io_err(name, offset, rc)),
            AioOp::Read { .. } => Ok(AioDone::Read(Bytes::from(self.buf))),
            _ => Ok(AioDone::Done),
        };
        (self.done)(r);
    }
}

extern "C" fn aio_done(c: rbd_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the `AioCtx` that `submit` leaked for this completion, taken back once
    // here; `c` is that completion, released after its return value is read.
    let (ctx, rc) = unsafe {
        let rc = rbd_aio_get_return_value(c);
        rbd_aio_release(c);
        (*Box::from_raw(arg as *mut AioCtx), rc)
    };
    ctx.complete(rc as i64);
}

impl AsyncBackend for RbdBackend {
    fn submit(&self, op: AioOp, done: AioCompletion) {
        let (offset, len) = match &op {
            AioOp::Read { offset, len } => (*offset, *len as u64),
            AioOp::Write { offset, data } => (*offset, data.len() as u64),
            AioOp::Flush => (0, 0),
            AioOp::CompareAndWrite {
                offset,
                compare,
                data,
            } => {
                if compare.len() != data.len() {
                    return done(Err(Self::io_err(
                        "compare and write",
                        *offset,
                        -(libc::EINVAL as i64),
                    )));
                }
                (*offset, data.len() as u64)
            }
        };
        let buf = match &op {
            AioOp::Read { len, .. } => vec![0u8; *len],
            _ => Vec::new(),
        };
        let ctx = AioCtx {
            op,
            buf,
            mismatch: 0,
            object_size: self.stripe_unit,
            done,
        };
        let name = ctx.what().0;
        if let Err(e) = self.check(name, offset, len) {
            return (ctx.done)(Err(e));
        }
        let ctx = Box::into_raw(Box::new(ctx));
        let mut c: rbd_completion_t = std::ptr::null_mut();
        // SAFETY: `ctx` stays valid (leaked) until `aio_done` takes it back, or until it is
        // taken back below when no completion was started. The buffers handed to librbd live
        // in `ctx` (a Vec's heap and the operation's Bytes, neither moved while it is leaked),
        // so they outlive the operation.
        unsafe {
            let rc = rbd_aio_create_completion(ctx.cast(), aio_done, &mut c);
            if rc < 0 {
                let ctx = Box::from_raw(ctx);
                return (ctx.done)(Err(Self::io_err(name, offset, rc.into())));
            }
            let x = &mut *ctx;
            let rc: i64 = match &x.op {
                AioOp::Read { len, .. } => {
                    rbd_aio_read(self.image, offset, *len, x.buf.as_mut_ptr().cast(), c).into()
                }
                AioOp::Write { data, .. } => {
                    rbd_aio_write(self.image, offset, data.len(), data.as_ptr().cast(), c).into()
                }
                AioOp::Flush => rbd_aio_flush(self.image, c).into(),
                AioOp::CompareAndWrite { compare, data, .. } => rbd_aio_compare_and_write(
                    self.image,
                    offset,
                    data.len(),
                    compare.as_ptr().cast(),
                    data.as_ptr().cast(),
                    c,
                    &mut x.mismatch,
                    0,
                ) as i64,
            };
            if rc < 0 {
                // Not started: the callback will not come.
                rbd_aio_release(c);
                let ctx = Box::from_raw(ctx);
                (ctx.done)(Err(Self::io_err(name, offset, rc)));
            }
        }
    }

    fn compare_and_write_ok(&self, offset: u64, len: u64) -> bool {
        // librbd sends COMPARE AND WRITE as one compare-extent-and-write operation on one
        // object, which the OSD runs atomically; librbd 16 refuses (EINVAL) any that is not
        // within one 512-byte sector (and one stripe unit). A single block of a 512-byte-block
        // LUN, as VMware's ATS uses, is within that.
        let su = self.stripe_unit.max(1);
        len > 0 && offset % 512 + len <= 512 && offset / su == (offset + len - 1) / su
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_names_pool_image_conf_and_id() {
        assert_eq!(
            RbdSpec::parse("mcsi/disk,conf=/tmp/c/ceph.conf,id=admin"),
            Ok(RbdSpec {
                pool: "mcsi".into(),
                image: "disk".into(),
                conf: Some("/tmp/c/ceph.conf".into()),
                id: Some("admin".into()),
                cache: false,
            })
        );
        for bad in ["disk", "/disk", "mcsi/", "a/b/c"] {
            assert!(
                matches!(RbdSpec::parse(bad), Err(RbdSpecError::NotPoolImage(_))),
                "{bad}"
            );
        }
        for bad in ["mcsi/disk,colour=red", "mcsi/disk,conf="] {
            assert!(
                matches!(RbdSpec::parse(bad), Err(RbdSpecError::UnknownOption(_))),
                "{bad}"
            );
        }
        assert_eq!(
            cstr("pool", "a\0b"),
            Err(RbdSpecError::NulByte {
                what: "pool",
                value: "a\0b".into()
            })
        );
    }
}
