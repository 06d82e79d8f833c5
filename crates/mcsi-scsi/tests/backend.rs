#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Backends: RAM laziness, files with holes, spec parsing, failure injection.

use mcsi_scsi::backend::RAM_CHUNK;
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
