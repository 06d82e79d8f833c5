//! SANITIZE (SBC-4 5.30, 4.33): OVERWRITE, BLOCK ERASE, CRYPTOGRAPHIC ERASE and EXIT FAILURE
//! MODE. A sanitize runs on a thread of its own, owned by the logical unit, not by the command
//! that started it: it goes on across task aborts, resets and the loss of every I_T nexus, as
//! SBC-4 requires. While it runs, every command but INQUIRY, REPORT LUNS and REQUEST SENSE ends
//! with NOT READY, SANITIZE IN PROGRESS, and REQUEST SENSE reports how far it is. With IMMED
//! the command returns once the sanitize has started; without, when it has ended.
//!
//! OVERWRITE writes the initialization pattern over every block, as many passes as asked
//! (inverted between passes when INVERT is set), at most `sanitize_rate` bytes a second when
//! the unit has one. BLOCK ERASE and CRYPTOGRAPHIC ERASE deallocate every block (the backends
//! read deallocated blocks as zeros). A sanitize whose backend I/O fails leaves the unit in
//! sanitize failure mode: media access ends with MEDIUM ERROR, SANITIZE COMMAND FAILED, until a
//! sanitize completes or, when the failed one allowed it (AUSE), EXIT FAILURE MODE.

use super::{bad_cdb, Cdb, Fail, LogicalUnit, Res};
use crate::backend::Backend;
use crate::sense::{asc, key, Sense};
use crate::{Command, Outcome};
use bytes::Bytes;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub(super) const SA_OVERWRITE: u8 = 0x01;
pub(super) const SA_BLOCK_ERASE: u8 = 0x02;
pub(super) const SA_CRYPTO_ERASE: u8 = 0x03;
pub(super) const SA_EXIT_FAILURE_MODE: u8 = 0x1F;

use asc::{SANITIZE_COMMAND_FAILED, SANITIZE_IN_PROGRESS};
/// Bytes written between two looks at the pace.
const PIECE: u64 = 1 << 20;

/// What a running sanitize does.
#[derive(Debug, Clone)]
enum Work {
    /// OVERWRITE: one block's worth of the pattern, passes, invert between passes.
    Overwrite {
        block: Vec<u8>,
        passes: u8,
        invert: bool,
    },
    /// BLOCK ERASE and CRYPTOGRAPHIC ERASE: deallocate everything.
    Erase,
}

/// A sanitize under way, shared by the unit, its thread and a command waiting for it.
#[derive(Default)]
pub(super) struct Job {
    progress: Mutex<Progress>,
    ended: Condvar,
    /// AUSE of the command that started it: whether EXIT FAILURE MODE may end its failure.
    ause: bool,
    /// Set when the unit goes away (the target shuts down): the thread stops at its next piece.
    cancelled: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct Progress {
    done: u64,
    total: u64,
    /// Some once it has ended: Ok, or the sense of its failure.
    result: Option<Result<(), Sense>>,
}

/// The unit's sanitize state.
#[derive(Default)]
pub(super) struct SanitizeState {
    running: Option<Arc<Job>>,
    /// Sanitize failure mode, and whether EXIT FAILURE MODE may end it (AUSE of the failed one).
    failed: Option<bool>,
}

impl Job {
    fn lock(&self) -> std::sync::MutexGuard<'_, Progress> {
        match self.progress.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Waits for the end; returns its result.
    fn wait(&self) -> Result<(), Sense> {
        let mut p = self.lock();
        loop {
            if let Some(r) = &p.result {
                return *r;
            }
            p = match self.ended.wait(p) {
                Ok(g) => g,
                Err(e) => e.into_inner(),
            };
        }
    }

    /// PROGRESS INDICATION (SPC-4 4.5.2.4.4): the fraction done, of 65536.
    fn progress(&self) -> u16 {
        let p = self.lock();
        if p.total == 0 {
            return 0;
        }
        ((p.done as u128 * 65536) / p.total as u128).min(65535) as u16
    }
}

impl SanitizeState {
    /// The unit goes away: a sanitize under way stops at its next piece. True if one ran.
    pub(super) fn cancel(&self) -> bool {
        match &self.running {
            Some(job) if job.lock().result.is_none() => {
                job.cancelled
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }

    /// NOT READY, SANITIZE IN PROGRESS with the progress, while one runs.
    fn in_progress(&mut self) -> Option<Sense> {
        if !self.settle() {
            return None;
        }
        let progress = self.running.as_ref().map_or(0, |j| j.progress());
        Some(Sense::new(key::NOT_READY, SANITIZE_IN_PROGRESS).with_progress(progress))
    }

    /// Takes note of a sanitize that has ended: failure mode after a failure, none after a
    /// success. True while one still runs.
    fn settle(&mut self) -> bool {
        let Some(job) = &self.running else {
            return false;
        };
        let ended = job.lock().result;
        match ended {
            None => true,
            Some(r) => {
                self.failed = r.is_err().then_some(job.ause);
                self.running = None;
                false
            }
        }
    }
}

impl LogicalUnit {
    fn sanitize_state(&self) -> std::sync::MutexGuard<'_, SanitizeState> {
        match self.sanitize.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// While a sanitize runs or after one failed: the sense that ends a command with opcode
    /// `opc`, if it may not run (SBC-4 4.33.3).
    pub(super) fn sanitize_blocks(&self, opc: u8) -> Option<Sense> {
        use super::op;
        if matches!(opc, op::INQUIRY | op::REPORT_LUNS | op::REQUEST_SENSE) {
            return None;
        }
        // Every command passes here: no lock unless a sanitize ran or failed.
        if !self.sanitize_pending.load(Ordering::Acquire) {
            return None;
        }
        let mut st = self.sanitize_state();
        let refused = st.in_progress().or_else(|| {
            // In failure mode only SANITIZE itself may run, to try again or to exit it.
            (st.failed.is_some() && opc != op::SANITIZE)
                .then(|| Sense::new(key::MEDIUM_ERROR, SANITIZE_COMMAND_FAILED))
        });
        self.publish(&st);
        refused
    }

    /// REQUEST SENSE's answer while a sanitize runs: NOT READY, SANITIZE IN PROGRESS, with the
    /// progress indication.
    pub(super) fn sanitize_sense(&self) -> Option<Sense> {
        if !self.sanitize_pending.load(Ordering::Acquire) {
            return None;
        }
        self.sanitize_state().in_progress()
    }

    /// Records, under the state's lock, whether commands must look at it.
    fn publish(&self, st: &SanitizeState) {
        self.sanitize_pending.store(
            st.running.is_some() || st.failed.is_some(),
            Ordering::Release,
        );
    }

    pub(super) fn sanitize(&self, cmd: &Command<'_>, c: &Cdb) -> Res {
        let immed = c.b(1) & 0x80 != 0;
        let ause = c.b(1) & 0x20 != 0;
        let sa = c.b(1) & 0x1F;
        // ZNR (zoned devices only) and the reserved bytes 2 to 6.
        if c.b(1) & 0x40 != 0 {
            return Err(bad_cdb(1, Some(6)));
        }
        if let Some(i) = (2..7).find(|&i| c.b(i) != 0) {
            return Err(bad_cdb(i as u16, None));
        }
        let plen = c.u16(7) as usize;
        let work = match sa {
            SA_OVERWRITE => {
                let bs = self.block_size as usize;
                if plen <= 4 || plen > bs + 4 {
                    return Err(bad_cdb(7, None));
                }
                if cmd.data_out.len() < plen {
                    return Err(super::illegal(asc::PARAMETER_LIST_LENGTH_ERROR));
                }
                let p = &cmd.data_out[..plen];
                let invert = p[0] & 0x80 != 0;
                if p[0] & 0x60 != 0 {
                    return Err(Fail::Sense(Sense::invalid_param_field(0, Some(5))));
                }
                let passes = p[0] & 0x1F;
                if passes == 0 {
                    return Err(Fail::Sense(Sense::invalid_param_field(0, Some(0))));
                }
                let ilen = u16::from_be_bytes([p[2], p[3]]) as usize;
                if ilen == 0 || ilen > bs || ilen + 4 > plen {
                    return Err(Fail::Sense(Sense::invalid_param_field(2, None)));
                }
                // The pattern repeated over one block.
                let pattern = &p[4..4 + ilen];
                let block: Vec<u8> = pattern.iter().copied().cycle().take(bs).collect();
                Work::Overwrite {
                    block,
                    passes,
                    invert,
                }
            }
            SA_BLOCK_ERASE | SA_CRYPTO_ERASE => {
                if plen != 0 {
                    return Err(bad_cdb(7, None));
                }
                Work::Erase
            }
            SA_EXIT_FAILURE_MODE => {
                if plen != 0 {
                    return Err(bad_cdb(7, None));
                }
                let mut st = self.sanitize_state();
                st.settle();
                return match st.failed {
                    Some(false) => Err(bad_cdb(1, Some(4))),
                    _ => {
                        st.failed = None;
                        self.publish(&st);
                        Ok(Outcome::good(Bytes::new()))
                    }
                };
            }
            _ => return Err(bad_cdb(1, Some(4))),
        };
        if self.write_protected() {
            return Err(Fail::Sense(Sense::new(
                key::DATA_PROTECT,
                asc::WRITE_PROTECTED,
            )));
        }
        let job = Arc::new(Job {
            ause,
            ..Job::default()
        });
        {
            let mut st = self.sanitize_state();
            if st.settle() {
                return Err(Fail::Sense(Sense::new(
                    key::NOT_READY,
                    SANITIZE_IN_PROGRESS,
                )));
            }
            st.running = Some(job.clone());
            self.publish(&st);
        }
        let total = match &work {
            Work::Overwrite { passes, .. } => self.blocks() * self.block_size * u64::from(*passes),
            Work::Erase => self.blocks() * self.block_size,
        };
        job.lock().total = total;
        let backend = self.backend.clone();
        let size = self.blocks() * self.block_size;
        let rate = self.cfg.sanitize_rate;
        let runner = job.clone();
        let spawned = std::thread::Builder::new()
            .name("mcsi-sanitize".into())
            .spawn(move || {
                let r = run(&*backend, size, &work, rate, &runner);
                if let Err(e) = &r {
                    tracing::warn!(error = %e, "sanitize failed");
                }
                let mut p = runner.lock();
                p.result =
                    Some(r.map_err(|_| Sense::new(key::MEDIUM_ERROR, SANITIZE_COMMAND_FAILED)));
                drop(p);
                runner.ended.notify_all();
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a sanitize thread");
            self.sanitize_state().running = None;
            return Err(Fail::Status(crate::status::BUSY));
        }
        tracing::info!(
            service_action = sa,
            bytes = total,
            rate = rate,
            immed,
            "sanitize started"
        );
        if immed {
            return Ok(Outcome::good(Bytes::new()));
        }
        let r = job.wait();
        self.sanitize_state().settle();
        match r {
            Ok(()) => Ok(Outcome::good(Bytes::new())),
            Err(s) => Err(Fail::Sense(s)),
        }
    }
}

/// Runs the sanitize work, paced to `rate` bytes a second when nonzero.
fn run(
    backend: &dyn Backend,
    size: u64,
    work: &Work,
    rate: u64,
    job: &Job,
) -> Result<(), crate::backend::BackendError> {
    let start = Instant::now();
    let mut written = 0u64;
    // Waits until `written` bytes are due at the rate, in short naps that look for a stop.
    let pace = |written: u64| {
        if rate == 0 {
            return;
        }
        let due = Duration::from_secs_f64(written as f64 / rate as f64);
        while let Some(wait) = due.checked_sub(start.elapsed()) {
            if job.cancelled.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(wait.min(Duration::from_millis(50)));
        }
    };
    match work {
        Work::Erase => {
            backend.unmap(0, size)?;
            job.lock().done = size;
        }
        Work::Overwrite {
            block,
            passes,
            invert,
        } => {
            let bs = block.len() as u64;
            let per = (PIECE / bs).max(1) * bs;
            for pass in 0..*passes {
                let one: Vec<u8> = if *invert && pass % 2 == 1 {
                    block.iter().map(|b| !b).collect()
                } else {
                    block.clone()
                };
                let piece: Vec<u8> = one.iter().copied().cycle().take(per as usize).collect();
                let mut off = 0;
                while off < size {
                    if job.cancelled.load(std::sync::atomic::Ordering::Relaxed) {
                        return Err(crate::backend::BackendError::Io {
                            op: "sanitize",
                            offset: off,
                            cause: std::io::Error::new(
                                std::io::ErrorKind::Interrupted,
                                "the logical unit was removed",
                            ),
                        });
                    }
                    let n = per.min(size - off);
                    backend.write_at(off, &piece[..n as usize])?;
                    off += n;
                    written += n;
                    job.lock().done = written;
                    pace(written);
                }
            }
            backend.flush()?;
        }
    }
    Ok(())
}
