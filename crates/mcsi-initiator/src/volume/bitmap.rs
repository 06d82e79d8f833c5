//! A mirror's record of what each member missed, in a small file, so that a process that
//! starts again after running degraded knows which members are stale and never reads from them
//! before they are brought up to date.
//!
//! It also names the regions being written (a write-intent record, as md's bitmap is): a write
//! goes to the members only once its regions are on record as being written, and they leave the
//! record lazily, once no write has touched them for a while. A process killed while a write
//! was in flight may leave the members different there (one took it, the other did not); the
//! next start copies those regions from one member to the others before any is read.
//!
//! The file is JSON, rewritten whole (a temporary file, fsync, rename, fsync of the directory)
//! each time a region becomes dirty or starts being written, before the write is sent or
//! acknowledged, and when a resync has cleaned regions. Regions are listed as inclusive ranges:
//!
//! ```json
//! {"format":"mcsi mirror bitmap","version":2,"region_bytes":1048576,
//!  "members":[{"url":"iscsi://10.0.0.1/iqn.2026-01.org.example:a/0","dirty":[]},
//!             {"url":"iscsi://10.0.0.2/iqn.2026-01.org.example:b/0","dirty":[[0,3],[17,17]]}],
//!  "writing":[[40,41]]}
//! ```
//!
//! Version 1 (without `writing`) still loads.

use crate::error::Error;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

const FORMAT: &str = "mcsi mirror bitmap";
const VERSION: u32 = 2;
/// The version before the write-intent record: read as one with nothing being written.
const VERSION_1: u32 = 1;
/// A bitmap file larger than this is not one this code wrote.
const MAX_FILE_BYTES: u64 = 64 << 20;

#[derive(Debug, Serialize, Deserialize)]
struct FileForm {
    format: String,
    version: u32,
    region_bytes: u64,
    members: Vec<MemberForm>,
    /// Inclusive ranges of regions being written on every member.
    #[serde(default)]
    writing: Vec<[u64; 2]>,
}

#[derive(Debug, Serialize, Deserialize)]
struct MemberForm {
    url: String,
    /// Inclusive ranges of region numbers.
    dirty: Vec<[u64; 2]>,
}

/// The file, a lock that keeps its saves in order, and the generation of the write-intent
/// record that the last save wrote (read without the lock: a write whose regions are on file
/// already does not queue behind a save of others).
#[derive(Debug)]
pub(super) struct BitmapFile {
    path: PathBuf,
    urls: Vec<String>,
    region_bytes: u64,
    saving: tokio::sync::Mutex<()>,
    saved: std::sync::atomic::AtomicU64,
}

/// What a save writes, taken at once: each member's dirty regions, the regions being written,
/// and the generation of that write-intent record.
pub(super) struct Snapshot {
    pub(super) dirty: Vec<Vec<u64>>,
    pub(super) writing: Vec<u64>,
    pub(super) generation: u64,
}

/// What a file recorded: each member's dirty regions as ranges, checked against the volume's
/// size by [`Recorded::bits`].
#[derive(Debug)]
pub(super) struct Recorded {
    dirty: Vec<Vec<[u64; 2]>>,
    writing: Vec<[u64; 2]>,
}

impl BitmapFile {
    pub(super) fn new(path: &Path, urls: Vec<String>, region_bytes: u64) -> BitmapFile {
        BitmapFile {
            path: path.to_path_buf(),
            urls,
            region_bytes,
            saving: tokio::sync::Mutex::new(()),
            saved: std::sync::atomic::AtomicU64::new(0),
        }
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the file if there is one. A file for other members or another region size is an
    /// error that says so: trusting it, or ignoring it, could serve stale blocks.
    pub(super) fn load(&self) -> Result<Option<Recorded>, Error> {
        let shown = self.path.display();
        let bad = |why: String| Error::InvalidArgument(format!("mirror bitmap {shown}: {why}"));
        let len = match std::fs::metadata(&self.path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(bad(e.to_string())),
        };
        if len > MAX_FILE_BYTES {
            return Err(bad(format!(
                "{len} bytes is too large for a bitmap this program wrote"
            )));
        }
        let text = std::fs::read(&self.path).map_err(|e| bad(e.to_string()))?;
        let f: FileForm = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
        if f.format != FORMAT || !(f.version == VERSION || f.version == VERSION_1) {
            return Err(bad(format!(
                "format {:?} version {}, expected {FORMAT:?} version {VERSION}",
                f.format, f.version
            )));
        }
        if f.region_bytes != self.region_bytes {
            return Err(bad(format!(
                "regions of {} bytes, this program uses {}",
                f.region_bytes, self.region_bytes
            )));
        }
        let urls: Vec<&str> = f.members.iter().map(|m| m.url.as_str()).collect();
        if urls != self.urls {
            return Err(bad(format!(
                "it records members {urls:?}, the spec names {:?}; remove the file only if every member holds the same blocks",
                self.urls
            )));
        }
        for m in &f.members {
            if let Some([a, b]) = m.dirty.iter().find(|[a, b]| a > b) {
                return Err(bad(format!(
                    "member {}: range [{a}, {b}] runs backwards",
                    m.url
                )));
            }
        }
        if let Some([a, b]) = f.writing.iter().find(|[a, b]| a > b) {
            return Err(bad(format!("writing: range [{a}, {b}] runs backwards")));
        }
        Ok(Some(Recorded {
            dirty: f.members.into_iter().map(|m| m.dirty).collect(),
            writing: f.writing,
        }))
    }

    /// Writes what `snapshot` takes (once the previous save is done) to the file: durable when
    /// this returns. With `upto`, a save is made only if none has yet written the write-intent
    /// record of that generation or a later one (so that writers waiting for the same record
    /// share one save).
    pub(super) async fn save(
        &self,
        upto: Option<u64>,
        snapshot: impl FnOnce() -> Snapshot,
    ) -> Result<(), Error> {
        use std::sync::atomic::Ordering;
        let on_file = |g: u64| self.saved.load(Ordering::Acquire) >= g;
        if upto.is_some_and(on_file) {
            return Ok(());
        }
        let _order = self.saving.lock().await;
        // A save that ended while this one waited may have written it.
        if upto.is_some_and(on_file) {
            return Ok(());
        }
        let snap = snapshot();
        let form = FileForm {
            format: FORMAT.to_string(),
            version: VERSION,
            region_bytes: self.region_bytes,
            members: self
                .urls
                .iter()
                .zip(snap.dirty)
                .map(|(u, bits)| MemberForm {
                    url: u.clone(),
                    dirty: ranges(&bits),
                })
                .collect(),
            writing: ranges(&snap.writing),
        };
        let path = self.path.clone();
        let io = |e: std::io::Error| Error::Io {
            context: format!("saving the mirror bitmap {}", path.display()),
            kind: e.kind(),
            message: e.to_string(),
        };
        let text = serde_json::to_vec(&form).map_err(|e| io(std::io::Error::other(e)))?;
        let target = path.clone();
        tokio::task::spawn_blocking(move || write_durably(&target, &text))
            .await
            .map_err(|e| io(std::io::Error::other(e)))?
            .map_err(io)?;
        self.saved.fetch_max(snap.generation, Ordering::Release);
        Ok(())
    }
}

impl Recorded {
    /// Member `m`'s dirty regions as a bitmap of `words` words; a region at or beyond `regions`
    /// (the volume's count) is an error, since the file then belongs to a larger volume.
    pub(super) fn bits(&self, m: usize, regions: u64, words: usize) -> Result<Vec<u64>, String> {
        to_bits(
            self.dirty.get(m).cloned().unwrap_or_default(),
            regions,
            words,
        )
    }

    /// The regions being written when the file was last saved, as [`Recorded::bits`] does.
    pub(super) fn writing(&self, regions: u64, words: usize) -> Result<Vec<u64>, String> {
        to_bits(self.writing.clone(), regions, words)
    }
}

/// Inclusive ranges of regions as a bitmap of `words` words, checked against `regions`.
fn to_bits(mut ranges: Vec<[u64; 2]>, regions: u64, words: usize) -> Result<Vec<u64>, String> {
    let mut bits = vec![0u64; words];
    // Overlapping ranges are merged first, so that the words set cost what the bitmap does
    // however many ranges the file lists.
    ranges.sort_unstable();
    let mut merged: Vec<[u64; 2]> = Vec::with_capacity(ranges.len());
    for [a, b] in ranges {
        match merged.last_mut() {
            Some(last) if a <= last[1].saturating_add(1) && a <= b => last[1] = last[1].max(b),
            _ => merged.push([a, b]),
        }
    }
    for &[a, b] in &merged {
        if b >= regions {
            return Err(format!(
                "region {b} lies beyond the volume's {regions} regions"
            ));
        }
        if a > b {
            return Err(format!("range [{a}, {b}] runs backwards"));
        }
        if (b / 64) as usize >= bits.len() {
            return Err(format!(
                "region {b} lies beyond the volume's {} words of regions",
                bits.len()
            ));
        }
        set_range(&mut bits, a, b);
    }
    Ok(bits)
}

/// Sets bits `a..=b` (within `bits`), a word at a time: a range costs what its words do,
/// whatever its length in regions.
fn set_range(bits: &mut [u64], a: u64, b: u64) {
    let (wa, wb) = ((a / 64) as usize, (b / 64) as usize);
    for (i, w) in bits.iter_mut().enumerate().take(wb + 1).skip(wa) {
        let lo = if i == wa { a % 64 } else { 0 };
        let hi = if i == wb { b % 64 } else { 63 };
        // Bits lo..=hi of one word.
        let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
        *w |= mask;
    }
}

/// The set bits of `bits` as inclusive ranges.
fn ranges(bits: &[u64]) -> Vec<[u64; 2]> {
    let mut out: Vec<[u64; 2]> = Vec::new();
    for (i, &w) in bits.iter().enumerate() {
        let mut w = w;
        while w != 0 {
            let r = i as u64 * 64 + u64::from(w.trailing_zeros());
            w &= w - 1;
            match out.last_mut() {
                Some(last) if last[1] + 1 == r => last[1] = r,
                _ => out.push([r, r]),
            }
        }
    }
    out
}

/// Replaces `path` with `data` so that a crash leaves the old file or the new one, never a mix.
fn write_durably(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(&dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_round_trip() {
        let mut bits = vec![0u64; 3];
        for r in [0u64, 1, 2, 63, 64, 65, 130] {
            bits[(r / 64) as usize] |= 1 << (r % 64);
        }
        let rs = ranges(&bits);
        assert_eq!(rs, vec![[0, 2], [63, 65], [130, 130]]);
        let rec = Recorded {
            dirty: vec![rs.clone()],
            writing: vec![],
        };
        assert_eq!(rec.bits(0, 192, 3).unwrap(), bits);
        assert!(rec.bits(0, 130, 3).is_err(), "region 130 of 130");
    }

    /// A range is set a word at a time: a million ranges over a million regions (10^12 bits
    /// one by one) load at once; a backward range is refused.
    #[test]
    fn large_ranges_load_a_word_at_a_time() {
        const REGIONS: u64 = 1 << 20;
        let words = (REGIONS / 64) as usize;
        let rec = Recorded {
            dirty: vec![vec![[0, REGIONS - 1]; 1 << 20]],
            writing: vec![],
        };
        let t0 = std::time::Instant::now();
        let bits = rec.bits(0, REGIONS, words).unwrap();
        assert!(bits.iter().all(|&w| w == u64::MAX));
        // 10^12 single-bit steps would take hours; merged ranges take a moment.
        assert!(t0.elapsed() < std::time::Duration::from_secs(30));
        for (a, b) in [
            (0u64, 0u64),
            (3, 70),
            (63, 64),
            (64, 127),
            (5, 5),
            (65, 190),
        ] {
            let rec = Recorded {
                dirty: vec![vec![[a, b]]],
                writing: vec![[a, b]],
            };
            let got = rec.bits(0, 192, 3).unwrap();
            let mut want = vec![0u64; 3];
            for r in a..=b {
                want[(r / 64) as usize] |= 1 << (r % 64);
            }
            assert_eq!(got, want, "[{a}, {b}]");
            assert_eq!(rec.writing(192, 3).unwrap(), want, "writing [{a}, {b}]");
        }
        let back = Recorded {
            dirty: vec![vec![[9, 3]]],
            writing: vec![],
        };
        assert!(back.bits(0, 192, 3).unwrap_err().contains("backwards"));
    }

    #[tokio::test]
    async fn a_saved_file_loads_and_a_foreign_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.bitmap");
        let urls = vec!["iscsi://a/x/0".to_string(), "iscsi://b/x/0".to_string()];
        let f = BitmapFile::new(&p, urls.clone(), 1 << 20);
        assert!(f.load().unwrap().is_none(), "no file yet");
        let snap = |generation| {
            move || Snapshot {
                dirty: vec![vec![0], vec![0b1011]],
                writing: vec![0b1100_0000],
                generation,
            }
        };
        f.save(Some(3), snap(3)).await.unwrap();
        let rec = f.load().unwrap().unwrap();
        assert_eq!(rec.bits(1, 64, 1).unwrap(), vec![0b1011]);
        assert_eq!(rec.bits(0, 64, 1).unwrap(), vec![0]);
        assert_eq!(rec.writing(64, 1).unwrap(), vec![0b1100_0000]);
        // A record of generation 3 is on file: waiting for 2 or 3 saves nothing.
        std::fs::remove_file(&p).unwrap();
        f.save(Some(2), snap(2)).await.unwrap();
        f.save(Some(3), snap(3)).await.unwrap();
        assert!(!p.exists(), "no save for a generation already on file");
        f.save(Some(4), snap(4)).await.unwrap();
        assert!(p.exists());
        // A version-1 file (before the write-intent record) loads with nothing being written.
        let v1 = std::fs::read_to_string(&p)
            .unwrap()
            .replace("\"version\":2", "\"version\":1")
            .replace(",\"writing\":[[6,7]]", "");
        assert!(
            v1.contains("\"version\":1") && !v1.contains("writing"),
            "{v1}"
        );
        std::fs::write(&p, v1).unwrap();
        let rec = f.load().unwrap().unwrap();
        assert_eq!(rec.writing(64, 1).unwrap(), vec![0]);
        assert_eq!(rec.bits(1, 64, 1).unwrap(), vec![0b1011]);
        let other = BitmapFile::new(&p, vec![urls[1].clone(), urls[0].clone()], 1 << 20);
        let e = other.load().unwrap_err().to_string();
        assert!(e.contains("the spec names"), "{e}");
        let sized = BitmapFile::new(&p, urls, 1 << 16);
        assert!(sized.load().unwrap_err().to_string().contains("regions of"));
        std::fs::write(&p, b"{not json").unwrap();
        assert!(f.load().is_err());
    }
}
