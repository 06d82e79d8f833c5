//! The disks behind the simulated target, after seed 001's setting: Seagate Cheetah 9LP drives
//! (ST39102FC, 10,025 RPM) on a 1 Gbit/s Fibre Channel link, the LUN striped over them.
//!
//! Each drive serves its requests in arrival order: a seek over the cylinder distance (a
//! square-root curve for short seeks, linear for long ones), the rotational latency (uniform
//! over one revolution, drawn from the run's seed), and the media transfer. A read that starts
//! where the drive's last read ended is served from its read-ahead cache, without seek or
//! rotation: the drive went on reading at its media rate after the last read, so the data is
//! there at once after idle time and at the media rate in a stream. Writes are written
//! through. Every transfer then crosses the shared Fibre Channel link, in the first free slot
//! after its data is ready. The seed gives the drive and its rotation speed; the seek times, media rate,
//! cylinder count and stripe unit below are assumptions stated here, typical of the drive and
//! its era, not figures from the seed.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::{Duration, Instant};

/// One drive model.
#[derive(Debug, Clone, Copy)]
pub struct DriveModel {
    pub rpm: f64,
    pub cylinders: u64,
    pub capacity: u64,
    /// Seek times: one cylinder, one third of the stroke (the average of random seeks), full
    /// stroke.
    pub seek_track: Duration,
    pub seek_avg: Duration,
    pub seek_full: Duration,
    /// Media transfer rate, bytes per second (one zone for the whole surface).
    pub media_rate: f64,
    /// Command overhead of the drive's controller.
    pub overhead: Duration,
}

impl DriveModel {
    /// Seagate Cheetah 9LP (ST39102FC): 10,025 RPM from the seed; 9.1 GB, 6,962 cylinders,
    /// 0.6 / 5.4 / 12.2 ms seeks, 24 MB/s media rate, 0.1 ms overhead assumed.
    pub fn cheetah_9lp() -> DriveModel {
        DriveModel {
            rpm: 10_025.0,
            cylinders: 6_962,
            capacity: 9_100_000_000,
            seek_track: Duration::from_micros(600),
            seek_avg: Duration::from_micros(5_400),
            seek_full: Duration::from_micros(12_200),
            media_rate: 24e6,
            overhead: Duration::from_micros(100),
        }
    }

    fn revolution(&self) -> Duration {
        Duration::from_secs_f64(60.0 / self.rpm)
    }

    /// The seek over `d` cylinders.
    pub fn seek(&self, d: u64) -> Duration {
        if d == 0 {
            return Duration::ZERO;
        }
        let third = (self.cylinders / 3).max(2);
        let (t1, ta, tf) = (
            self.seek_track.as_secs_f64(),
            self.seek_avg.as_secs_f64(),
            self.seek_full.as_secs_f64(),
        );
        let s = if d <= third {
            t1 + (ta - t1) * ((d - 1) as f64 / (third - 1) as f64).sqrt()
        } else {
            ta + (tf - ta) * (d - third) as f64 / (self.cylinders - third) as f64
        };
        Duration::from_secs_f64(s)
    }
}

/// What the target's disks are.
#[derive(Debug, Clone, Copy)]
pub struct DiskConfig {
    pub drive: DriveModel,
    pub drives: usize,
    /// The stripe unit over the drives, bytes.
    pub stripe: u64,
    /// Fibre Channel link rate, bytes per second (1 Gbit/s, 8b/10b: 100 MB/s).
    pub fc_rate: f64,
}

impl DiskConfig {
    /// Seed 001's target: 8 Cheetah 9LP drives on 1 Gbit/s Fibre Channel, a 64 KiB stripe
    /// unit (assumed).
    pub fn seed_001(drives: usize) -> DiskConfig {
        DiskConfig {
            drive: DriveModel::cheetah_9lp(),
            drives: drives.max(1),
            stripe: 64 << 10,
            fc_rate: 100e6,
        }
    }

    /// `cheetah-9lp` or `cheetah-9lp:N` (N drives, 8 by default).
    pub fn parse(s: &str) -> Result<DiskConfig, crate::UnknownName> {
        let (name, n) = match s.split_once(':') {
            Some((a, b)) => (
                a,
                b.parse::<usize>()
                    .ok()
                    .filter(|n| (1..=64).contains(n))
                    .ok_or_else(|| {
                        crate::UnknownName::new("disk", s, "the drive count is 1 to 64")
                    })?,
            ),
            None => (s, 8),
        };
        match name {
            "cheetah-9lp" => Ok(DiskConfig::seed_001(n)),
            other => Err(crate::UnknownName::new(
                "disk",
                other,
                "the simulator models cheetah-9lp (seed 001's Seagate Cheetah 9LP), as cheetah-9lp or cheetah-9lp:DRIVES",
            )),
        }
    }

    /// The LUN's size: the drives together.
    pub fn capacity(&self) -> u64 {
        self.drive.capacity * self.drives as u64
    }
}

struct Drive {
    busy_until: Instant,
    cylinder: u64,
    /// Where the last read ended, for the read-ahead cache, and when the media was there (the
    /// read-ahead goes on from that byte at that time).
    next_read: Option<u64>,
    ahead_at: Instant,
    /// When each request it holds is done.
    queued: std::collections::VecDeque<Instant>,
}

/// The disks' state during a run.
pub struct Disks {
    cfg: DiskConfig,
    drives: Vec<Drive>,
    /// The Fibre Channel link's reserved transfers, (start, end), by start.
    fc: Vec<(Instant, Instant)>,
    rng: ChaCha8Rng,
    /// Requests at each drive, most at once over the run.
    pub max_queue: usize,
    pub requests: u64,
    pub cache_hits: u64,
}

impl Disks {
    pub fn new(cfg: DiskConfig, start: Instant, seed: u64) -> Disks {
        Disks {
            cfg,
            drives: (0..cfg.drives)
                .map(|_| Drive {
                    busy_until: start,
                    cylinder: 0,
                    next_read: None,
                    ahead_at: start,
                    queued: std::collections::VecDeque::new(),
                })
                .collect(),
            fc: Vec::new(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            max_queue: 0,
            requests: 0,
            cache_hits: 0,
        }
    }

    /// A transfer of `len` bytes at byte `offset` of the LUN arriving at `now`: when it is
    /// done (every drive it touches has served its part and the data crossed the link).
    pub fn submit(&mut self, now: Instant, offset: u64, len: u64, write: bool) -> Instant {
        self.requests += 1;
        let d = self.cfg.drive;
        let per_cyl = (d.capacity / d.cylinders).max(1);
        let mut done = now;
        let mut at = offset;
        let end = offset + len.max(1);
        while at < end {
            let unit = at / self.cfg.stripe;
            let n = self.drives.len() as u64;
            let drive = (unit % n) as usize;
            let local = (unit / n) * self.cfg.stripe + at % self.cfg.stripe;
            let part = (self.cfg.stripe - at % self.cfg.stripe).min(end - at);
            let rot = d.revolution().mul_f64(self.rng.gen::<f64>());
            let dr = &mut self.drives[drive];
            while dr.queued.front().is_some_and(|t| *t <= now) {
                dr.queued.pop_front();
            }
            let start = dr.busy_until.max(now);
            let hit = !write && dr.next_read == Some(local);
            let media = Duration::from_secs_f64(part as f64 / d.media_rate);
            if hit {
                self.cache_hits += 1;
                // Read ahead since `ahead_at`: the part is in the buffer once the media got
                // past it.
                let there = dr.ahead_at + media;
                dr.busy_until = (start + d.overhead).max(there);
                dr.ahead_at = there;
            } else {
                let cyl = (local / per_cyl).min(d.cylinders - 1);
                let seek = d.seek(cyl.abs_diff(dr.cylinder));
                dr.cylinder = cyl;
                dr.busy_until = start + d.overhead + seek + rot + media;
                dr.ahead_at = dr.busy_until;
            }
            dr.next_read = (!write).then_some(local + part);
            dr.queued.push_back(dr.busy_until);
            self.max_queue = self.max_queue.max(dr.queued.len());
            done = done.max(dr.busy_until);
            at += part;
        }
        // The data crosses the shared Fibre Channel link once the drives have it (reads) or
        // before (writes, counted the same way here): in the first free slot after that, so
        // that a transfer ready early does not wait behind one whose drives are still busy.
        let fc = Duration::from_secs_f64(len as f64 / self.cfg.fc_rate);
        self.fc.retain(|&(_, e)| e > now);
        let mut t = done;
        let mut at = self.fc.len();
        for (i, &(s, e)) in self.fc.iter().enumerate() {
            if t + fc <= s {
                at = i;
                break;
            }
            t = t.max(e);
        }
        self.fc.insert(at, (t, t + fc));
        t + fc
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_seek_curve_meets_its_three_points() {
        let d = DriveModel::cheetah_9lp();
        let ms = |x: Duration| x.as_secs_f64() * 1e3;
        assert!((ms(d.seek(1)) - 0.6).abs() < 1e-9);
        assert!((ms(d.seek(d.cylinders / 3)) - 5.4).abs() < 1e-9);
        assert!((ms(d.seek(d.cylinders)) - 12.2).abs() < 1e-9);
        assert!(d.seek(100) < d.seek(1000));
    }

    #[test]
    fn random_reads_cost_a_seek_and_half_a_turn_and_sequential_ones_hit_the_cache() {
        let t0 = Instant::now();
        let mut disks = Disks::new(DiskConfig::seed_001(1), t0, 1);
        // One at a time: each starts when the last is done.
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut now = t0;
        let n = 2000;
        for _ in 0..n {
            let off = rng.gen_range(0..9_000_000_000u64 / 4096) * 4096;
            now = disks.submit(now, off, 4096, false);
        }
        let per = now.duration_since(t0).as_secs_f64() * 1e3 / f64::from(n);
        // About 0.1 overhead + 5.4 seek (a little less: random distances average a third of
        // the stroke) + 3.0 rotation + 0.17 transfer + 0.04 on the link.
        assert!((7.5..9.5).contains(&per), "{per} ms per random 4 KiB read");
        let t1 = now;
        for i in 0..100 {
            now = disks.submit(now, 1 << 30 | (i * 4096), 4096, false);
        }
        let per = now.duration_since(t1).as_secs_f64() * 1e3 / 100.0;
        assert!(per < 0.5, "{per} ms per sequential 4 KiB read");
        assert_eq!(disks.cache_hits, 99);
        // In a stream the cache gives no more than the media rate (24 MB/s): 64 KiB reads one
        // after another take 2.7 ms each, after the first.
        let t2 = now;
        for i in 0..50 {
            now = disks.submit(now, 2 << 30 | (i * 65536), 65536, false);
        }
        let mbs = 49.0 * 65536.0 / now.duration_since(t2).as_secs_f64() / 1e6;
        assert!((18.0..24.0).contains(&mbs), "{mbs} MB/s streamed");
    }

    #[test]
    fn a_transfer_ready_early_does_not_wait_on_the_link_behind_a_slow_one() {
        let t0 = Instant::now();
        let mut disks = Disks::new(DiskConfig::seed_001(2), t0, 1);
        // A random read on drive 0 (a seek and a turn), then a cache-cold but near one on
        // drive 1: the second's data is ready first and crosses the link first.
        let slow = disks.submit(t0, 8_000_000_000 / 2 * 2, 4096, false);
        let fast = disks.submit(t0, 65536, 4096, false);
        assert!(fast < slow, "{:?} against {:?}", fast - t0, slow - t0);
    }

    #[test]
    fn a_stripe_spreads_large_requests_over_the_drives() {
        let t0 = Instant::now();
        let one = Disks::new(DiskConfig::seed_001(1), t0, 1).submit(t0, 0, 512 << 10, true);
        let eight = Disks::new(DiskConfig::seed_001(8), t0, 1).submit(t0, 0, 512 << 10, true);
        assert!(eight.duration_since(t0) * 3 < one.duration_since(t0));
    }
}
