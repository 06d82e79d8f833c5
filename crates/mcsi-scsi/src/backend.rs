//! Storage behind a logical unit: the [`Backend`] trait and the RAM, file, block-device and
//! failure-injection backends.

use bytes::{Bytes, BytesMut};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// Why a backend operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The backend spec string could not be understood.
    #[error("invalid backend spec '{spec}': {why} (use ram:SIZE, file:PATH, file:PATH:SIZE, block:PATH or rbd:POOL/IMAGE)")]
    Spec { spec: String, why: String },
    /// Opening or creating the backing store failed.
    #[error("cannot open {path}: {why}")]
    Open { path: PathBuf, why: String },
    /// An I/O system call failed at this byte offset. The OS error is part of the message (and
    /// deliberately not a `source()` too, so that error chains do not print it twice).
    #[error("{op} at byte offset {offset} failed: {cause}")]
    Io {
        op: &'static str,
        offset: u64,
        cause: io::Error,
    },
    /// The request reaches past the end of the backend.
    #[error("{op} of {len} bytes at offset {offset} is past the end ({size} bytes)")]
    OutOfRange {
        op: &'static str,
        offset: u64,
        len: u64,
        size: u64,
    },
    /// A failure injected by [`FailingBackend`].
    #[error("injected {op} failure at byte offset {offset}")]
    Injected { op: &'static str, offset: u64 },
    /// The store cannot take the size asked for.
    #[error("{0}")]
    Resize(String),
    /// The record shared by the gateways of the stored data ([`SharedState`]) could not be
    /// read, stored or watched.
    #[error("{0}")]
    Shared(String),
}

impl BackendError {
    /// The byte offset the failure happened at, when it is known.
    pub fn offset(&self) -> Option<u64> {
        match self {
            BackendError::Io { offset, .. }
            | BackendError::OutOfRange { offset, .. }
            | BackendError::Injected { offset, .. } => Some(*offset),
            _ => None,
        }
    }
}

/// Byte-addressed storage. Implementations are internally synchronised: calls may come from many
/// threads at once, and writes to disjoint ranges must not interfere.
pub trait Backend: Send + Sync + 'static {
    /// Capacity in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`. Unwritten or unmapped areas read as zeros.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError>;
    /// Reads `len` bytes from `offset` as a buffer of its own (the data-in of a READ). The
    /// default zero-fills a buffer and calls `read_at`; the RAM backend hands out its memory
    /// without a copy where it can.
    fn read_bytes(&self, offset: u64, len: usize) -> Result<Bytes, BackendError> {
        let mut buf = vec![0u8; len];
        self.read_at(offset, &mut buf)?;
        Ok(Bytes::from(buf))
    }
    /// Writes `data` at `offset`.
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackendError>;
    /// Makes every completed write durable (fdatasync for files and block devices).
    fn flush(&self) -> Result<(), BackendError>;
    /// Writes zeros over the range, which stays allocated (WRITE SAME of a zero block without
    /// UNMAP). The default writes zero buffers of up to 1 MiB; a store with an operation of its
    /// own (librbd's write-zeroes) sends no data.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        let zeros = vec![0u8; len.min(1 << 20) as usize];
        let mut pos = offset;
        let end = offset.saturating_add(len);
        while pos < end {
            let n = ((end - pos) as usize).min(zeros.len());
            self.write_at(pos, &zeros[..n])?;
            pos += n as u64;
        }
        Ok(())
    }
    /// Deallocates the range; it reads as zeros afterwards.
    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError>;
    /// Extents `(offset, len, mapped)` covering `[offset, offset+len)` in order.
    fn mapped(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, BackendError>;
    /// True when the calls may block on I/O (the transport then uses a blocking pool).
    fn blocking(&self) -> bool;
    /// True when a `write_at` either writes all of its bytes or none, and a concurrent reader
    /// of this process is the only other way to see the data (so the unit's range locks make
    /// it atomic): WRITE ATOMIC(16) is offered only then. A file can fail part way (ENOSPC on
    /// a sparse file, a medium error) and leave part written, and an RBD write across objects
    /// is visible half done from another gateway, so those do not offer it.
    fn atomic_writes(&self) -> bool {
        false
    }
    /// One line for logs: kind, path, size.
    fn describe(&self) -> String;
    /// Grows the store to `size` bytes, or (None) takes the size it has now (a file its
    /// administrator extended); the new size. A store never shrinks under its initiators: a
    /// smaller size is refused. The default: this store cannot change size.
    fn grow(&self, size: Option<u64>) -> Result<u64, BackendError> {
        let _ = size;
        Err(BackendError::Resize(format!(
            "{} cannot change size (file, block and rbd LUNs can)",
            self.describe()
        )))
    }
    /// A name of the stored data itself, the same wherever it is opened (an RBD image through
    /// any gateway): the LUN's identity (VPD 80h and 83h) then follows the data rather than
    /// the target's name and LUN number. None for storage local to one machine.
    fn identity(&self) -> Option<String> {
        None
    }
    /// The backend's asynchronous interface, when it has one: reads, writes, flushes and
    /// COMPARE AND WRITE then complete through a callback, and no thread waits for them.
    fn aio(&self) -> Option<&dyn AsyncBackend> {
        None
    }
    /// Where the unit's persistent reservations live when every gateway of the stored data
    /// must see the same ones (an RBD image): the unit then reads and changes them there
    /// instead of in its memory and its own file. None for storage local to one machine.
    fn shared_reservations(&self) -> Option<&dyn SharedState> {
        None
    }
    /// Where the unit's ALUA port group states live when every gateway of the stored data
    /// must see the same ones (an RBD image): configured states seed it, and a change through
    /// any gateway (SET TARGET PORT GROUPS, a reload) is stored there and announced. None for
    /// storage local to one machine.
    fn shared_port_groups(&self) -> Option<&dyn SharedState> {
        None
    }
}

/// A small record kept with the stored data, which every gateway on it reads and replaces
/// (the persistent reservations of an RBD image, its port group states): versioned, so that two gateways changing it
/// at once cannot lose one change, and announced, so that each gateway hears of the others'
/// changes before the change is acknowledged.
pub trait SharedState: Send + Sync {
    /// The stored bytes (empty: nothing stored yet) and their version.
    fn read(&self) -> Result<(Vec<u8>, u64), BackendError>;
    /// Stores `bytes` if the stored version is still `version`: false (nothing written) when
    /// another gateway replaced it first.
    fn replace(&self, bytes: &[u8], version: u64) -> Result<bool, BackendError>;
    /// Tells every other gateway that the record changed, and returns once each has heard
    /// (an error when one did not answer in time: it reads the record again once it does).
    fn announce(&self) -> Result<(), BackendError>;
    /// Calls `heard` on each announcement of another gateway, and when announcements may have
    /// been missed (a broken watch): the unit then reads the record again before its next
    /// command.
    fn watch(&self, heard: Box<dyn Fn() + Send + Sync>) -> Result<(), BackendError>;
}

/// One operation of the asynchronous path.
#[derive(Debug, Clone)]
pub enum AioOp {
    /// `len` bytes from `offset`; unwritten areas read as zeros.
    Read { offset: u64, len: usize },
    /// `data` at `offset`.
    Write { offset: u64, data: Bytes },
    /// Every completed write made durable.
    Flush,
    /// `data` written at `offset` only if the store holds `compare` there, atomically with
    /// respect to every other writer of the store (other gateways included, for a shared one).
    /// `compare` and `data` have the same length.
    CompareAndWrite {
        offset: u64,
        compare: Bytes,
        data: Bytes,
    },
}

/// How an [`AioOp`] ended, when it did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AioDone {
    /// The data a read returned, of the length asked for.
    Read(Bytes),
    /// A write, flush or COMPARE AND WRITE done.
    Done,
    /// COMPARE AND WRITE found other data: the first differing byte, counted from the start of
    /// the compared range. Nothing was written.
    Miscompare { at: u64 },
}

/// Called once when an [`AioOp`] ends, from whichever thread the backend completes on.
pub type AioCompletion = Box<dyn FnOnce(Result<AioDone, BackendError>) + Send + 'static>;

/// A backend whose I/O completes through callbacks (librbd's `rbd_aio_*`, a queue of its own).
pub trait AsyncBackend: Send + Sync {
    /// Starts `op`. `done` is called exactly once, possibly before `submit` returns, and
    /// must be quick: it runs on the backend's completion thread.
    fn submit(&self, op: AioOp, done: AioCompletion);
    /// Whether [`AioOp::CompareAndWrite`] is offered for `len` bytes at `offset` (a store may
    /// do it atomically only within one of its objects). Where it is not, the logical unit
    /// compares and writes under its own range lock, which holds for this gateway only.
    fn compare_and_write_ok(&self, offset: u64, len: u64) -> bool;
}

fn check_range(op: &'static str, offset: u64, len: u64, size: u64) -> Result<(), BackendError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(BackendError::OutOfRange {
            op,
            offset,
            len,
            size,
        }),
    }
}

/// Opens a backend from a spec: `ram:SIZE`, `file:PATH`, `file:PATH:SIZE`, `block:PATH` or
/// (with the `rbd` feature) `rbd:POOL/IMAGE[,conf=PATH][,id=NAME][,cache=on|off]`.
pub fn open_backend(spec: &str) -> Result<Arc<dyn Backend>, BackendError> {
    let bad = |why: &str| BackendError::Spec {
        spec: spec.to_string(),
        why: why.to_string(),
    };
    let (kind, rest) = spec
        .split_once(':')
        .ok_or_else(|| bad("missing ':' after the backend kind"))?;
    match kind {
        "ram" => {
            let size = mcsi_units::parse_size(rest).map_err(|e| bad(&e.to_string()))?;
            Ok(Arc::new(RamBackend::new(size)?))
        }
        "file" => {
            if rest.is_empty() {
                return Err(bad("missing file path"));
            }
            // A trailing ":SIZE" is taken as a size only when it parses as one, so that paths
            // containing ':' still work without a size.
            if let Some((path, size)) = rest.rsplit_once(':') {
                if let Ok(size) = mcsi_units::parse_size(size) {
                    if path.is_empty() {
                        return Err(bad("missing file path"));
                    }
                    return Ok(Arc::new(FileBackend::create(Path::new(path), size)?));
                }
            }
            Ok(Arc::new(FileBackend::open(Path::new(rest))?))
        }
        "block" => {
            if rest.is_empty() {
                return Err(bad("missing block device path"));
            }
            Ok(Arc::new(BlockBackend::open(Path::new(rest))?))
        }
        #[cfg(feature = "rbd")]
        "rbd" => {
            let r = crate::rbd::RbdSpec::parse(rest).map_err(|e| bad(&e.to_string()))?;
            Ok(Arc::new(crate::rbd::RbdBackend::open(r)?))
        }
        #[cfg(not(feature = "rbd"))]
        "rbd" => Err(bad(
            "this build has no rbd backend (build with --features rbd, which needs librbd-dev)",
        )),
        other => Err(bad(&format!("unknown backend kind '{other}'"))),
    }
}

// ---------------------------------------------------------------------------------------------
// RAM

/// Allocation unit of the RAM backend. Chunks are allocated on first write and freed by unmap.
/// A read within one chunk is served without a copy, so the unit is at least the usual largest
/// I/O of initiators (128 KiB).
pub const RAM_CHUNK: u64 = 128 * 1024;

/// The smallest read served as a slice of its chunk: a smaller one is copied, so that a held
/// read never pins more than 4 times its own length (a queue of 512-byte reads over chunks that
/// are then written would otherwise hold a whole 128 KiB chunk per read).
pub const RAM_SLICE_MIN: usize = (RAM_CHUNK / 4) as usize;

/// Memory-backed storage, allocated lazily in [`RAM_CHUNK`] pieces.
///
/// Chunks are shared buffers: a read of at least [`RAM_SLICE_MIN`] inside one chunk returns a
/// slice of it (no copy), and a write to a chunk that such a read still holds copies the chunk
/// first (copy-on-write), so the read keeps the data it saw.
pub struct RamBackend {
    size: u64,
    chunks: Vec<RwLock<Option<Bytes>>>,
    allocated: AtomicU64,
}

impl RamBackend {
    /// A zero-filled RAM disk of `size` bytes; nothing is allocated until written.
    pub fn new(size: u64) -> Result<Self, BackendError> {
        let n = size.div_ceil(RAM_CHUNK);
        // One lock per chunk: 1 TiB is 16 Mi chunks, beyond that the table itself is too big.
        if n > (1 << 24) {
            return Err(BackendError::Spec {
                spec: format!("ram:{size}"),
                why: "RAM backend larger than 1 TiB".into(),
            });
        }
        let chunks = (0..n).map(|_| RwLock::new(None)).collect();
        Ok(RamBackend {
            size,
            chunks,
            allocated: AtomicU64::new(0),
        })
    }

    /// Bytes of memory currently allocated for data.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed) * RAM_CHUNK
    }

    fn chunk_len(&self, idx: u64) -> usize {
        let start = idx * RAM_CHUNK;
        (self.size - start).min(RAM_CHUNK) as usize
    }

    /// Calls `f(chunk index, offset in chunk, range in caller's buffer)` for each piece.
    fn pieces(offset: u64, len: u64, mut f: impl FnMut(u64, usize, std::ops::Range<usize>)) {
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let idx = pos / RAM_CHUNK;
            let in_chunk = (pos % RAM_CHUNK) as usize;
            let n = ((RAM_CHUNK - pos % RAM_CHUNK).min(end - pos)) as usize;
            let b = (pos - offset) as usize;
            f(idx, in_chunk, b..b + n);
            pos += n as u64;
        }
    }
}

/// The chunk as a mutable buffer: in place when no read holds a slice of it, else a copy.
fn writable(c: Bytes) -> BytesMut {
    c.try_into_mut()
        .unwrap_or_else(|shared| BytesMut::from(&shared[..]))
}

fn lock_poisoned(op: &'static str, offset: u64) -> BackendError {
    BackendError::Io {
        op,
        offset,
        cause: io::Error::other("lock poisoned by a panicked thread"),
    }
}

impl Backend for RamBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        check_range("read", offset, buf.len() as u64, self.size)?;
        let mut res = Ok(());
        Self::pieces(offset, buf.len() as u64, |idx, at, r| {
            let dst = &mut buf[r];
            match self.chunks[idx as usize].read() {
                Ok(g) => match g.as_ref() {
                    Some(c) => dst.copy_from_slice(&c[at..at + dst.len()]),
                    None => dst.fill(0),
                },
                Err(_) => res = Err(lock_poisoned("read", offset)),
            }
        });
        res
    }

    fn read_bytes(&self, offset: u64, len: usize) -> Result<Bytes, BackendError> {
        check_range("read", offset, len as u64, self.size)?;
        let idx = offset / RAM_CHUNK;
        let at = (offset % RAM_CHUNK) as usize;
        if len >= RAM_SLICE_MIN && at + len <= self.chunk_len(idx) {
            // Inside one allocated chunk: a slice of it.
            match self.chunks[idx as usize].read() {
                Ok(g) => {
                    if let Some(c) = g.as_ref() {
                        return Ok(c.slice(at..at + len));
                    }
                }
                Err(_) => return Err(lock_poisoned("read", offset)),
            }
        }
        // Across chunks or holes: append each piece to an unfilled buffer (one copy, no
        // zero-fill first).
        let mut out = Vec::with_capacity(len);
        let mut res = Ok(());
        Self::pieces(offset, len as u64, |idx, at, r| {
            match self.chunks[idx as usize].read() {
                Ok(g) => match g.as_ref() {
                    Some(c) => out.extend_from_slice(&c[at..at + r.len()]),
                    None => out.resize(out.len() + r.len(), 0),
                },
                Err(_) => res = Err(lock_poisoned("read", offset)),
            }
        });
        res.map(|_| Bytes::from(out))
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        check_range("write", offset, data.len() as u64, self.size)?;
        let mut res = Ok(());
        Self::pieces(offset, data.len() as u64, |idx, at, r| {
            let src = &data[r];
            match self.chunks[idx as usize].write() {
                Ok(mut g) => {
                    let c = g.take().unwrap_or_else(|| {
                        self.allocated.fetch_add(1, Ordering::Relaxed);
                        Bytes::from(vec![0u8; self.chunk_len(idx)])
                    });
                    let mut m = writable(c);
                    m[at..at + src.len()].copy_from_slice(src);
                    *g = Some(m.freeze());
                }
                Err(_) => res = Err(lock_poisoned("write", offset)),
            }
        });
        res
    }

    fn flush(&self) -> Result<(), BackendError> {
        Ok(())
    }

    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        check_range("unmap", offset, len, self.size)?;
        let mut res = Ok(());
        Self::pieces(offset, len, |idx, at, r| {
            match self.chunks[idx as usize].write() {
                Ok(mut g) => {
                    if r.len() == self.chunk_len(idx) {
                        if g.take().is_some() {
                            self.allocated.fetch_sub(1, Ordering::Relaxed);
                        }
                    } else if let Some(c) = g.take() {
                        let mut m = writable(c);
                        m[at..at + r.len()].fill(0);
                        *g = Some(m.freeze());
                    }
                }
                Err(_) => res = Err(lock_poisoned("unmap", offset)),
            }
        });
        res
    }

    fn mapped(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, BackendError> {
        check_range("mapped", offset, len, self.size)?;
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        let mut res = Ok(());
        Self::pieces(offset, len, |idx, at, r| {
            let m = match self.chunks[idx as usize].read() {
                Ok(g) => g.is_some(),
                Err(_) => {
                    res = Err(lock_poisoned("mapped", offset));
                    true
                }
            };
            let start = idx * RAM_CHUNK + at as u64;
            push_extent(&mut out, start, r.len() as u64, m);
        });
        res.map(|_| out)
    }

    fn atomic_writes(&self) -> bool {
        // A copy into memory under the unit's range lock: it cannot stop half way.
        true
    }
    fn blocking(&self) -> bool {
        false
    }

    fn describe(&self) -> String {
        format!("ram ({} bytes)", self.size)
    }
}

fn push_extent(out: &mut Vec<(u64, u64, bool)>, start: u64, len: u64, mapped: bool) {
    if len == 0 {
        return;
    }
    if let Some(last) = out.last_mut() {
        if last.2 == mapped && last.0 + last.1 == start {
            last.1 += len;
            return;
        }
    }
    out.push((start, len, mapped));
}

// ---------------------------------------------------------------------------------------------
// Files

fn io_err(op: &'static str, offset: u64) -> impl FnOnce(io::Error) -> BackendError {
    move |cause| BackendError::Io { op, offset, cause }
}

fn fdatasync(file: &File) -> Result<(), BackendError> {
    file.sync_data().map_err(io_err("flush", 0))
}

/// Writes zeros over a range, in bounded pieces.
fn write_zeros(file: &File, offset: u64, len: u64) -> Result<(), BackendError> {
    let zeros = vec![0u8; len.min(1 << 20) as usize];
    let mut pos = offset;
    let end = offset + len;
    while pos < end {
        let n = (end - pos).min(zeros.len() as u64) as usize;
        file.write_all_at(&zeros[..n], pos)
            .map_err(io_err("unmap", pos))?;
        pos += n as u64;
    }
    Ok(())
}

/// A regular file, read and written with pread/pwrite; unmap punches holes.
pub struct FileBackend {
    file: File,
    path: PathBuf,
    /// Bytes; only grows ([`Backend::grow`]).
    size: AtomicU64,
    punch_hole: AtomicBool,
}

impl FileBackend {
    /// Opens an existing regular file; its current length is the capacity.
    pub fn open(path: &Path) -> Result<Self, BackendError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| BackendError::Open {
                path: path.to_path_buf(),
                why: if e.kind() == io::ErrorKind::NotFound {
                    "no such file (use file:PATH:SIZE to create it)".to_string()
                } else {
                    e.to_string()
                },
            })?;
        Self::from_file(file, path)
    }

    /// Opens or creates a regular file of `size` bytes. A shorter file is extended sparsely;
    /// a longer one is refused rather than truncated.
    pub fn create(path: &Path, size: u64) -> Result<Self, BackendError> {
        let open_err = |why: String| BackendError::Open {
            path: path.to_path_buf(),
            why,
        };
        if size == 0 {
            return Err(open_err("size must be greater than zero".into()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .map_err(|e| open_err(e.to_string()))?;
        let meta = file.metadata().map_err(|e| open_err(e.to_string()))?;
        if !meta.file_type().is_file() {
            return Err(open_err(
                "not a regular file (use block:PATH for devices)".into(),
            ));
        }
        let cur = meta.len();
        if cur > size {
            return Err(open_err(format!(
                "file is {cur} bytes, larger than the requested {size}; refusing to truncate \
                 (give no size to use the whole file, or a size of at least {cur})"
            )));
        }
        if cur < size {
            file.set_len(size).map_err(|e| open_err(e.to_string()))?;
        }
        Self::from_file(file, path)
    }

    fn from_file(file: File, path: &Path) -> Result<Self, BackendError> {
        let open_err = |why: String| BackendError::Open {
            path: path.to_path_buf(),
            why,
        };
        let meta = file.metadata().map_err(|e| open_err(e.to_string()))?;
        if !meta.file_type().is_file() {
            return Err(open_err(
                "not a regular file (use block:PATH for block devices)".into(),
            ));
        }
        if meta.len() == 0 {
            return Err(open_err(
                "file is empty (use file:PATH:SIZE to give it a size)".into(),
            ));
        }
        Ok(FileBackend {
            file,
            path: path.to_path_buf(),
            size: AtomicU64::new(meta.len()),
            punch_hole: AtomicBool::new(true),
        })
    }
}

impl Backend for FileBackend {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn grow(&self, size: Option<u64>) -> Result<u64, BackendError> {
        let now = self.size();
        let io = |e: io::Error| BackendError::Resize(format!("{}: {e}", self.path.display()));
        let new = match size {
            Some(n) => {
                if n < now {
                    return Err(BackendError::Resize(format!(
                        "{} is {now} bytes; a LUN only grows (asked for {n})",
                        self.path.display()
                    )));
                }
                if n > now {
                    self.file.set_len(n).map_err(io)?;
                }
                n
            }
            None => {
                let n = self.file.metadata().map_err(io)?.len();
                if n < now {
                    return Err(BackendError::Resize(format!(
                        "{} shrank to {n} bytes from {now}: its LUN keeps serving {now} (blocks past the end now read and write as errors); give the file its size back",
                        self.path.display()
                    )));
                }
                n
            }
        };
        self.size.fetch_max(new, Ordering::AcqRel);
        Ok(self.size())
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        check_range("read", offset, buf.len() as u64, self.size())?;
        self.file
            .read_exact_at(buf, offset)
            .map_err(io_err("read", offset))
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        check_range("write", offset, data.len() as u64, self.size())?;
        self.file
            .write_all_at(data, offset)
            .map_err(io_err("write", offset))
    }

    fn flush(&self) -> Result<(), BackendError> {
        fdatasync(&self.file)
    }

    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        check_range("unmap", offset, len, self.size())?;
        if len == 0 {
            return Ok(());
        }
        if self.punch_hole.load(Ordering::Relaxed) {
            let (Ok(off), Ok(l)) = (i64::try_from(offset), i64::try_from(len)) else {
                return write_zeros(&self.file, offset, len);
            };
            // SAFETY: plain syscall on an fd we own; no pointers are passed.
            let rc = unsafe {
                libc::fallocate(
                    self.file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    off,
                    l,
                )
            };
            if rc == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => {
                    self.punch_hole.store(false, Ordering::Relaxed);
                }
                _ => return Err(io_err("unmap", offset)(e)),
            }
        }
        write_zeros(&self.file, offset, len)
    }

    fn mapped(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, BackendError> {
        check_range("mapped", offset, len, self.size())?;
        let end = offset + len;
        let mut out = Vec::new();
        let fd = self.file.as_raw_fd();
        let mut pos = offset;
        while pos < end {
            let Ok(p) = i64::try_from(pos) else {
                push_extent(&mut out, pos, end - pos, true);
                break;
            };
            // SAFETY: lseek on an fd we own; the file position is not used by pread/pwrite.
            let data = unsafe { libc::lseek(fd, p, libc::SEEK_DATA) };
            if data < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    // No data after pos: the rest is a hole.
                    Some(libc::ENXIO) => {
                        push_extent(&mut out, pos, end - pos, false);
                        break;
                    }
                    // SEEK_DATA unsupported: report everything mapped.
                    Some(libc::EINVAL) => {
                        push_extent(&mut out, pos, end - pos, true);
                        break;
                    }
                    _ => return Err(io_err("mapped", pos)(e)),
                }
            }
            let data = (data as u64).min(end);
            push_extent(&mut out, pos, data - pos, false);
            if data >= end {
                break;
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data as i64, libc::SEEK_HOLE) };
            if hole < 0 {
                return Err(io_err("mapped", data)(io::Error::last_os_error()));
            }
            let hole = (hole as u64).min(end);
            push_extent(&mut out, data, hole - data, true);
            pos = hole;
        }
        Ok(out)
    }

    fn blocking(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        format!("file {} ({} bytes)", self.path.display(), self.size())
    }
}

// ---------------------------------------------------------------------------------------------
// Block devices

// _IOR(0x12, 114, size_t) and _IO(0x12, 119) from <linux/fs.h>.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKDISCARD: libc::c_ulong = 0x1277;

/// A block device; size from BLKGETSIZE64, unmap via BLKDISCARD when the device supports it.
pub struct BlockBackend {
    file: File,
    path: PathBuf,
    /// The size served: the device's when opened, or when it last grew.
    size: AtomicU64,
    discard: AtomicBool,
}

impl BlockBackend {
    /// Opens a block device read-write.
    pub fn open(path: &Path) -> Result<Self, BackendError> {
        let open_err = |why: String| BackendError::Open {
            path: path.to_path_buf(),
            why,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| open_err(e.to_string()))?;
        let meta = file.metadata().map_err(|e| open_err(e.to_string()))?;
        if !meta.file_type().is_block_device() {
            return Err(open_err(
                "not a block device (use file:PATH for regular files)".into(),
            ));
        }
        let size = device_size(&file).map_err(|e| open_err(e.to_string()))?;
        if size == 0 {
            return Err(open_err("device has zero size".into()));
        }
        Ok(BlockBackend {
            file,
            path: path.to_path_buf(),
            size: AtomicU64::new(size),
            discard: AtomicBool::new(true),
        })
    }
}

/// A block device's size now (BLKGETSIZE64).
fn device_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at `size`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if rc != 0 {
        return Err(io::Error::other(format!(
            "BLKGETSIZE64 failed: {}",
            io::Error::last_os_error()
        )));
    }
    Ok(size)
}

impl Backend for BlockBackend {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// A block device grows by its own tools (`lvextend`, `losetup -c`, a SAN's resize): this
    /// takes its size now, or `size` when the device has that much.
    fn grow(&self, size: Option<u64>) -> Result<u64, BackendError> {
        let now = self.size();
        let dev = device_size(&self.file)
            .map_err(|e| BackendError::Resize(format!("{}: {e}", self.path.display())))?;
        let new = size.unwrap_or(dev);
        if new > dev {
            return Err(BackendError::Resize(format!(
                "{} is {dev} bytes: grow the device itself (lvextend, losetup -c, ...), then grow the LUN without --size",
                self.path.display()
            )));
        }
        if new < now {
            return Err(BackendError::Resize(format!(
                "{} is served as {now} bytes; a LUN only grows (asked for {new})",
                self.path.display()
            )));
        }
        self.size.store(new, Ordering::Release);
        Ok(new)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        check_range("read", offset, buf.len() as u64, self.size())?;
        self.file
            .read_exact_at(buf, offset)
            .map_err(io_err("read", offset))
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        check_range("write", offset, data.len() as u64, self.size())?;
        self.file
            .write_all_at(data, offset)
            .map_err(io_err("write", offset))
    }

    fn flush(&self) -> Result<(), BackendError> {
        fdatasync(&self.file)
    }

    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        check_range("unmap", offset, len, self.size())?;
        if len == 0 {
            return Ok(());
        }
        if self.discard.load(Ordering::Relaxed) {
            let range: [u64; 2] = [offset, len];
            // SAFETY: BLKDISCARD reads two u64 (start, length) through the pointer.
            let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), BLKDISCARD as _, range.as_ptr()) };
            if rc == 0 {
                // Discarded blocks need not read as zeros on every device; make sure they do.
                return write_zeros(&self.file, offset, len);
            }
            self.discard.store(false, Ordering::Relaxed);
        }
        write_zeros(&self.file, offset, len)
    }

    fn mapped(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, BackendError> {
        check_range("mapped", offset, len, self.size())?;
        let mut out = Vec::new();
        push_extent(&mut out, offset, len, true);
        Ok(out)
    }

    fn blocking(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        format!(
            "block device {} ({} bytes)",
            self.path.display(),
            self.size()
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Service time

/// Wraps a backend so that each read and write takes at least `service` (it sleeps first): a
/// stand-in for a disk's service time in experiments on RAM (seed 004's response times
/// include the storage's). Calls block, so the transport runs them on its blocking pool, one
/// thread per I/O in flight.
pub struct ServiceTimeBackend {
    inner: Arc<dyn Backend>,
    service: std::time::Duration,
}

impl ServiceTimeBackend {
    pub fn new(inner: Arc<dyn Backend>, service: std::time::Duration) -> Self {
        ServiceTimeBackend { inner, service }
    }
}

impl Backend for ServiceTimeBackend {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn grow(&self, size: Option<u64>) -> Result<u64, BackendError> {
        self.inner.grow(size)
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        std::thread::sleep(self.service);
        self.inner.read_at(offset, buf)
    }
    fn read_bytes(&self, offset: u64, len: usize) -> Result<Bytes, BackendError> {
        std::thread::sleep(self.service);
        self.inner.read_bytes(offset, len)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        std::thread::sleep(self.service);
        self.inner.write_at(offset, data)
    }
    fn flush(&self) -> Result<(), BackendError> {
        self.inner.flush()
    }
    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.inner.unmap(offset, len)
    }
    fn mapped(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, BackendError> {
        self.inner.mapped(offset, len)
    }
    fn atomic_writes(&self) -> bool {
        self.inner.atomic_writes()
    }
    fn blocking(&self) -> bool {
        true
    }
    fn identity(&self) -> Option<String> {
        self.inner.identity()
    }
    fn describe(&self) -> String {
        format!(
            "{} with a service time of {:?}",
            self.inner.describe(),
            self.service
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Failure injection

/// Wraps a backend and makes every read, write and flush fail once `ok_ops` of them succeeded.
/// Used by robustness tests; `heal` and `fail_after` change the budget at run time.
pub struct FailingBackend {
    inner: Arc<dyn Backend>,
    remaining: AtomicU64,
    failures: AtomicU64,
}

impl FailingBackend {
    /// Lets `ok_ops` I/O operations (read, write, flush, unmap) succeed, then fails all others.
    pub fn new(inner: Arc<dyn Backend>, ok_ops: u64) -> Self {
        FailingBackend {
            inner,
            remaining: AtomicU64::new(ok_ops),
            failures: AtomicU64::new(0),
        }
    }

    /// Resets the budget: `ok_ops` more operations succeed.
    pub fn fail_after(&self, ok_ops: u64) {
        self.remaining.store(ok_ops, Ordering::SeqCst);
    }

    /// Stops injecting failures.
    pub fn heal(&self) {
        self.remaining.store(u64::MAX, Ordering::SeqCst);
    }

    /// How many operations were failed so far.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::SeqCst)
    }

    pub(crate) fn take(&self, op: &'static str, offset: u64) -> Result<(), BackendError> {
        let ok = self
            .remaining
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| match r {
                0 => None,
                u64::MAX => Some(u64::MAX),
                r => Some(r - 1),
            })
            .is_ok();
        if ok {
            Ok(())
        } else {
            self.failures.fetch_add(1, Ordering::SeqCst);
            Err(BackendError::Injected { op, offset })
        }
    }
}

impl Backend for FailingBackend {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn grow(&self, size: Option<u64>) -> Result<u64, BackendError> {
        self.inner.grow(size)
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.take("read", offset)?;
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.take("write", offset)?;
        self.inner.write_at(offset, data)
    }
    fn flush(&self) -> Result<(), BackendError> {
        self.take("flush", 0)?;
        self.inner.flush()
    }
    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.take("unmap", offset)?;
        self.inner.unmap(offset, len)
    }
    fn mapped(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, BackendError> {
        self.inner.mapped(offset, len)
    }
    fn blocking(&self) -> bool {
        self.inner.blocking()
    }
    fn describe(&self) -> String {
        format!("failing({})", self.inner.describe())
    }
    fn identity(&self) -> Option<String> {
        self.inner.identity()
    }
    fn aio(&self) -> Option<&dyn AsyncBackend> {
        self.inner.aio().map(|_| self as &dyn AsyncBackend)
    }
}

/// Failures are injected on the asynchronous path too, when the inner backend has one.
impl AsyncBackend for FailingBackend {
    fn submit(&self, op: AioOp, done: AioCompletion) {
        let (name, offset) = match &op {
            AioOp::Read { offset, .. } => ("read", *offset),
            AioOp::Write { offset, .. } => ("write", *offset),
            AioOp::Flush => ("flush", 0),
            AioOp::CompareAndWrite { offset, .. } => ("write", *offset),
        };
        if let Err(e) = self.take(name, offset) {
            return done(Err(e));
        }
        match self.inner.aio() {
            Some(a) => a.submit(op, done),
            None => done(Err(BackendError::Io {
                op: name,
                offset,
                cause: io::Error::other("the inner backend has no asynchronous path"),
            })),
        }
    }
    fn compare_and_write_ok(&self, offset: u64, len: u64) -> bool {
        self.inner
            .aio()
            .is_some_and(|a| a.compare_and_write_ok(offset, len))
    }
}

// ---------------------------------------------------------------------------------------------
// RAM behind a completion thread

/// A RAM store shaped like a network backend: every operation goes through one queue to one
/// worker thread, which runs it after an optional latency and calls its completion there.
/// Synchronous calls go straight to the RAM. It exercises the asynchronous device path without a
/// cluster (tests, and latency experiments without a thread per I/O).
pub struct AioRamBackend {
    ram: Arc<RamBackend>,
    queue: std::sync::mpsc::Sender<(AioOp, AioCompletion)>,
    submitted: AtomicU64,
}

impl AioRamBackend {
    /// `size` bytes of RAM; each operation completes `latency` after the worker takes it (the
    /// worker runs them one at a time, in order, so operations are atomic among themselves).
    pub fn new(size: u64, latency: std::time::Duration) -> Result<Self, BackendError> {
        let ram = Arc::new(RamBackend::new(size)?);
        let (tx, rx) = std::sync::mpsc::channel::<(AioOp, AioCompletion)>();
        let worker = ram.clone();
        std::thread::Builder::new()
            .name("aio-ram".into())
            .spawn(move || {
                // Ends when the backend is dropped (the sender with it).
                while let Ok((op, done)) = rx.recv() {
                    if !latency.is_zero() {
                        std::thread::sleep(latency);
                    }
                    done(run_on(&*worker, op));
                }
            })
            .map_err(|e| BackendError::Open {
                path: PathBuf::from("aio-ram"),
                why: format!("cannot start its completion thread: {e}"),
            })?;
        Ok(AioRamBackend {
            ram,
            queue: tx,
            submitted: AtomicU64::new(0),
        })
    }

    /// Operations submitted on the asynchronous path so far.
    pub fn submitted(&self) -> u64 {
        self.submitted.load(Ordering::SeqCst)
    }
}

/// Runs an [`AioOp`] with a backend's synchronous calls.
fn run_on(b: &dyn Backend, op: AioOp) -> Result<AioDone, BackendError> {
    match op {
        AioOp::Read { offset, len } => b.read_bytes(offset, len).map(AioDone::Read),
        AioOp::Write { offset, data } => b.write_at(offset, &data).map(|_| AioDone::Done),
        AioOp::Flush => b.flush().map(|_| AioDone::Done),
        AioOp::CompareAndWrite {
            offset,
            compare,
            data,
        } => {
            let cur = b.read_bytes(offset, compare.len())?;
            if let Some(at) = crate::lu::first_diff(&cur, &compare) {
                return Ok(AioDone::Miscompare { at: at as u64 });
            }
            b.write_at(offset, &data).map(|_| AioDone::Done)
        }
    }
}

impl Backend for AioRamBackend {
    fn size(&self) -> u64 {
        self.ram.size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.ram.read_at(offset, buf)
    }
    fn read_bytes(&self, offset: u64, len: usize) -> Result<Bytes, BackendError> {
        self.ram.read_bytes(offset, len)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.ram.write_at(offset, data)
    }
    fn flush(&self) -> Result<(), BackendError> {
        self.ram.flush()
    }
    fn unmap(&self, offset: u64, len: u64) -> Result<(), BackendError> {
        self.ram.unmap(offset, len)
    }
    fn mapped(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, BackendError> {
        self.ram.mapped(offset, len)
    }
    /// True, as for a network store: a command off the asynchronous path (WRITE SAME, a write
    /// waiting for blocks that another holds) may wait for an operation in flight, which must
    /// not happen on the transport's own threads.
    fn atomic_writes(&self) -> bool {
        // A copy into memory under the unit's range lock: it cannot stop half way.
        true
    }
    fn blocking(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        format!("aio-{}", self.ram.describe())
    }
    fn aio(&self) -> Option<&dyn AsyncBackend> {
        Some(self)
    }
}

impl AsyncBackend for AioRamBackend {
    fn submit(&self, op: AioOp, done: AioCompletion) {
        self.submitted.fetch_add(1, Ordering::SeqCst);
        if let Err(std::sync::mpsc::SendError((_, done))) = self.queue.send((op, done)) {
            done(Err(BackendError::Io {
                op: "aio",
                offset: 0,
                cause: io::Error::other("the completion thread has stopped"),
            }));
        }
    }
    fn compare_and_write_ok(&self, _offset: u64, _len: u64) -> bool {
        true
    }
}
