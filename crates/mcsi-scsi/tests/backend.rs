#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Backends: RAM laziness, files with holes, spec parsing, failure injection.

use mcsi_scsi::backend::{RAM_CHUNK, RAM_SLICE_MIN};
use mcsi_scsi::{open_backend, Backend, BackendError, FailingBackend, FileBackend, RamBackend};
use std::sync::Arc;

#[test]
fn ram_is_lazy_and_unmap_frees() {
    let r = RamBackend::new(1 << 30).unwrap();
    assert_eq!(r.size(), 1 << 30);
    assert_eq!(r.allocated_bytes(), 0);
    let mut buf = vec![0xFFu8; 4096];
    r.read_at(123_456, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    // A write that straddles two chunks allocates both.
    r.write_at(RAM_CHUNK - 10, &[7u8; 20]).unwrap();
    assert_eq!(r.allocated_bytes(), 2 * RAM_CHUNK);
    let mut b = [0u8; 20];
    r.read_at(RAM_CHUNK - 10, &mut b).unwrap();
    assert_eq!(b, [7u8; 20]);
    assert_eq!(
        r.mapped(0, 3 * RAM_CHUNK).unwrap(),
        vec![(0, 2 * RAM_CHUNK, true), (2 * RAM_CHUNK, RAM_CHUNK, false)]
    );
    // Partial unmap zeroes but keeps the chunk; whole-chunk unmap frees it.
    r.unmap(RAM_CHUNK - 10, 5).unwrap();
    r.read_at(RAM_CHUNK - 10, &mut b).unwrap();
    assert_eq!(&b[..5], &[0; 5]);
    assert_eq!(&b[5..], &[7; 15]);
    r.unmap(0, RAM_CHUNK).unwrap();
    assert_eq!(r.allocated_bytes(), RAM_CHUNK);
    assert!(!r.blocking());
    // Past the end.
    assert!(matches!(
        r.write_at((1 << 30) - 1, &[0, 0]),
        Err(BackendError::OutOfRange { .. })
    ));
    assert!(matches!(
        r.read_at(u64::MAX, &mut b),
        Err(BackendError::OutOfRange { .. })
    ));
}

#[test]
fn file_backend_create_extend_and_punch_holes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    let spec = format!("file:{}:1MiB", path.display());
    let b = open_backend(&spec).unwrap();
    assert_eq!(b.size(), 1 << 20);
    assert!(b.blocking());
    // Freshly created: sparse, all hole.
    let m = b.mapped(0, 1 << 20).unwrap();
    assert!(m.iter().all(|e| !e.2), "{m:?}");
    b.write_at(8192, &[0xAB; 8192]).unwrap();
    b.flush().unwrap();
    let mut buf = vec![0u8; 8192];
    b.read_at(8192, &mut buf).unwrap();
    assert!(buf.iter().all(|&x| x == 0xAB));
    let m = b.mapped(0, 1 << 20).unwrap();
    assert!(
        m.iter()
            .any(|&(o, l, mapped)| mapped && o <= 8192 && o + l >= 16384),
        "{m:?}"
    );
    // Punch the hole back: zeros, and (on file systems with holes) unmapped again.
    b.unmap(8192, 8192).unwrap();
    b.read_at(8192, &mut buf).unwrap();
    assert!(buf.iter().all(|&x| x == 0));
    let m = b.mapped(8192, 8192).unwrap();
    assert_eq!(m.iter().map(|e| e.1).sum::<u64>(), 8192);
    drop(b);
    // Reopen without size: the existing length.
    let b = open_backend(&format!("file:{}", path.display())).unwrap();
    assert_eq!(b.size(), 1 << 20);
    // Extending works, shrinking is refused with a message that says what to do.
    drop(b);
    let b = FileBackend::create(&path, 2 << 20).unwrap();
    assert_eq!(b.size(), 2 << 20);
    let e = open_backend(&format!("file:{}:4KiB", path.display()))
        .err()
        .unwrap();
    let msg = e.to_string();
    assert!(msg.contains("refusing to truncate"), "{msg}");
}

#[test]
fn file_backend_missing_file_says_how_to_create() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nope.img");
    let e = open_backend(&format!("file:{}", path.display()))
        .err()
        .unwrap();
    assert!(e.to_string().contains("file:PATH:SIZE"), "{e}");
}

#[test]
fn spec_errors() {
    for bad in ["", "ram", "ram:", "ram:12XB", "disk:/x", "file:", "block:"] {
        let e = open_backend(bad)
            .err()
            .unwrap_or_else(|| panic!("{bad} accepted"));
        assert!(!e.to_string().is_empty());
    }
    assert_eq!(open_backend("ram:4MiB").unwrap().size(), 4 << 20);
    // A regular file is not a block device.
    let f = tempfile::NamedTempFile::new().unwrap();
    let e = open_backend(&format!("block:{}", f.path().display()))
        .err()
        .unwrap();
    assert!(e.to_string().contains("not a block device"), "{e}");
}

#[test]
fn failing_backend_counts_down() {
    let inner: Arc<dyn Backend> = Arc::new(RamBackend::new(4096).unwrap());
    let f = FailingBackend::new(inner, 2);
    f.write_at(0, &[1]).unwrap();
    let mut b = [0u8; 1];
    f.read_at(0, &mut b).unwrap();
    assert!(matches!(
        f.read_at(0, &mut b),
        Err(BackendError::Injected {
            op: "read",
            offset: 0
        })
    ));
    assert!(matches!(
        f.flush(),
        Err(BackendError::Injected { op: "flush", .. })
    ));
    assert_eq!(f.failures(), 2);
    f.fail_after(1);
    f.write_at(1, &[2]).unwrap();
    assert!(f.write_at(2, &[3]).is_err());
    f.heal();
    for _ in 0..10 {
        f.read_at(0, &mut b).unwrap();
    }
    assert_eq!(b, [1]);
    assert_eq!(f.size(), 4096);
}

#[test]
fn ram_read_bytes_matches_read_at_across_chunks_and_holes() {
    // Chunk 0 unwritten, chunk 1 written with a pattern, chunk 2 unwritten: a read spanning all
    // three must be zeros, then the pattern, then zeros, exactly as read_at gives.
    let r = RamBackend::new(4 * RAM_CHUNK).unwrap();
    let pattern: Vec<u8> = (0..RAM_CHUNK as usize)
        .map(|i| (i % 251) as u8 + 1)
        .collect();
    r.write_at(RAM_CHUNK, &pattern).unwrap();
    let (off, len) = (RAM_CHUNK - 100, RAM_CHUNK as usize + 300);
    let v = r.read_bytes(off, len).unwrap();
    assert_eq!(v.len(), len);
    assert!(v[..100].iter().all(|&b| b == 0));
    assert_eq!(&v[100..100 + RAM_CHUNK as usize], &pattern[..]);
    assert!(v[100 + RAM_CHUNK as usize..].iter().all(|&b| b == 0));
    let mut w = vec![0xEEu8; len];
    r.read_at(off, &mut w).unwrap();
    assert_eq!(v, w);
    assert!(matches!(
        r.read_bytes(4 * RAM_CHUNK - 1, 2),
        Err(BackendError::OutOfRange { .. })
    ));
    // The trait's default (zero-fill + read_at) gives the same through a wrapper.
    let f = FailingBackend::new(Arc::new(RamBackend::new(4 * RAM_CHUNK).unwrap()), u64::MAX);
    f.write_at(RAM_CHUNK, &pattern).unwrap();
    assert_eq!(f.read_bytes(off, len).unwrap(), v);
}

#[test]
fn ram_read_inside_a_chunk_keeps_its_data_across_later_writes() {
    let r = RamBackend::new(2 * RAM_CHUNK).unwrap();
    let n = RAM_SLICE_MIN;
    r.write_at(4096, &vec![1u8; n]).unwrap();
    // A read inside one chunk (served as a slice of it), then a write over the same bytes while
    // the read's buffer is still held: the read keeps what it saw (copy-on-write).
    let before = r.read_bytes(4096, n).unwrap();
    assert!(
        before.clone().try_into_mut().is_err(),
        "a slice of the chunk"
    );
    r.write_at(8192, &[2u8; 512]).unwrap();
    assert!(before.iter().all(|&b| b == 1));
    let after = r.read_bytes(4096, n).unwrap();
    assert!(after[..4096].iter().all(|&b| b == 1));
    assert!(after[4096..4608].iter().all(|&b| b == 2));
    assert!(after[4608..].iter().all(|&b| b == 1));
    // A partial unmap zeroes in place for later reads, not for the held one.
    r.unmap(4096, 512).unwrap();
    assert!(after[..512].iter().all(|&b| b == 1));
    assert!(r.read_bytes(4096, 512).unwrap().iter().all(|&b| b == 0));
    // Reads of an unwritten chunk and of nothing.
    assert!(r
        .read_bytes(RAM_CHUNK + 7, 100)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    assert!(r.read_bytes(0, 0).unwrap().is_empty());
    assert_eq!(r.allocated_bytes(), RAM_CHUNK);
    // A smaller read is a copy of its own: held, it pins no chunk.
    let small = r.read_bytes(4096, RAM_SLICE_MIN - 1).unwrap();
    assert!(small.try_into_mut().is_ok(), "a copy");
}
