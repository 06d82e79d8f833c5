//! The LUN inventory of one SCSI target: REPORT LUNS and commands to absent LUNs.

use crate::backend::BackendError;
use crate::lu::{bad_cdb, Cdb, Fail, LogicalUnit, Prepared, Res};
use crate::sense::{asc, key, Sense};
use crate::{lun, Command, DataPhase, Nexus, Outcome};
use arc_swap::ArcSwap;
use bytes::Bytes;
use std::sync::Arc;

const REPORT_LUNS: u8 = 0xA0;
const INQUIRY: u8 = 0x12;
const REQUEST_SENSE: u8 = 0x03;

/// The unit of an 8-byte SAM LUN in an inventory.
fn find(luns: &[(u16, Arc<LogicalUnit>)], raw: u64) -> Option<&Arc<LogicalUnit>> {
    let idx = lun::decode(raw)?;
    luns.binary_search_by_key(&idx, |(i, _)| *i)
        .ok()
        .map(|p| &luns[p].1)
}

/// REPORT LUNS parameter data (SPC-4 6.33) for the given LUN indices.
pub(crate) fn report_luns(c: &Cdb, luns: &[u16]) -> Res {
    let select = c.b(2);
    let alloc = c.u32(6) as usize;
    // SPC-4 6.33: the allocation length must be at least 16.
    if alloc < 16 {
        return Err(bad_cdb(6, None));
    }
    let list: &[u16] = match select {
        0x00 | 0x02 => luns,
        // Well-known logical units only: there are none.
        0x01 => &[],
        _ => return Err(bad_cdb(2, None)),
    };
    let mut d = Vec::with_capacity(8 + 8 * list.len());
    d.extend_from_slice(&((list.len() * 8) as u32).to_be_bytes());
    d.extend_from_slice(&[0; 4]);
    for &l in list {
        d.extend_from_slice(&lun::encode(l).to_be_bytes());
    }
    d.truncate(alloc);
    Ok(Outcome::good(Bytes::from(d)))
}

/// The logical units behind one SCSI target. The inventory may change while commands run
/// ([`DeviceServer::add`], [`DeviceServer::remove`]): each command looks its unit up in the
/// inventory of the moment, and a removed unit lives on until the commands that hold it end.
pub struct DeviceServer {
    luns: ArcSwap<Vec<(u16, Arc<LogicalUnit>)>>,
    /// Changes of the inventory, one at a time.
    change: std::sync::Mutex<()>,
}

/// Why the inventory did not change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryError {
    #[error("LUN {0} is already in use")]
    InUse(u16),
    #[error("no LUN {0}")]
    NoSuchLun(u16),
}

impl DeviceServer {
    /// An inventory of `(index, unit)`; a repeated index keeps its first unit.
    pub fn new(mut luns: Vec<(u16, Arc<LogicalUnit>)>) -> Self {
        luns.sort_by_key(|(i, _)| *i);
        luns.dedup_by_key(|(i, _)| *i);
        DeviceServer {
            luns: ArcSwap::from_pointee(luns),
            change: std::sync::Mutex::new(()),
        }
    }

    /// The unit addressed by an 8-byte SAM LUN.
    pub fn lu(&self, raw: u64) -> Option<Arc<LogicalUnit>> {
        find(&self.luns.load(), raw).cloned()
    }

    /// The raw 8-byte LUN this inventory gives `unit`, if it has it.
    pub fn raw_lun_of(&self, unit: &Arc<LogicalUnit>) -> Option<u64> {
        self.luns
            .load()
            .iter()
            .find(|(_, u)| Arc::ptr_eq(u, unit))
            .map(|(i, _)| crate::lun::encode(*i))
    }

    /// `(index, unit)` pairs in index order, as the inventory is now.
    pub fn luns(&self) -> Arc<Vec<(u16, Arc<LogicalUnit>)>> {
        self.luns.load_full()
    }

    /// Adds `unit` as LUN `idx`. Every I_T nexus the other units have seen gets the unit
    /// attention REPORTED LUNS DATA HAS CHANGED (SPC-4 6.33) from them.
    pub fn add(&self, idx: u16, unit: Arc<LogicalUnit>) -> Result<(), InventoryError> {
        let _one = self.change.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.luns.load_full();
        if now.iter().any(|(i, _)| *i == idx) {
            return Err(InventoryError::InUse(idx));
        }
        let mut next: Vec<_> = now.iter().cloned().collect();
        next.push((idx, unit));
        next.sort_by_key(|(i, _)| *i);
        self.luns.store(Arc::new(next));
        self.luns_changed(Some(idx), &[]);
        Ok(())
    }

    /// Removes LUN `idx` and returns its unit (commands that hold it finish on it). Every
    /// I_T nexus the remaining units have seen gets REPORTED LUNS DATA HAS CHANGED.
    pub fn remove(&self, idx: u16) -> Result<Arc<LogicalUnit>, InventoryError> {
        let _one = self.change.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.luns.load_full();
        let Some(pos) = now.iter().position(|(i, _)| *i == idx) else {
            return Err(InventoryError::NoSuchLun(idx));
        };
        let mut next: Vec<_> = now.iter().cloned().collect();
        let (_, unit) = next.remove(pos);
        self.luns.store(Arc::new(next));
        // A nexus that used only the removed unit is told by the others too.
        self.luns_changed(None, &unit.seen_nexuses());
        Ok(unit)
    }

    /// The unit attention of a changed inventory, from every unit but `except` (a new one),
    /// to every nexus it has seen and to those of `also` (a removed unit's).
    fn luns_changed(&self, except: Option<u16>, also: &[Nexus]) {
        let s = Sense::new(key::UNIT_ATTENTION, asc::REPORTED_LUNS_DATA_HAS_CHANGED);
        for (i, lu) in self.luns.load().iter() {
            if Some(*i) != except {
                lu.unit_attention_all(s);
                lu.unit_attention_for(also, s);
            }
        }
    }

    /// Runs a command for a LUN: REPORT LUNS here, absent LUNs answered per SPC-4 (INQUIRY
    /// with peripheral qualifier 011b, REQUEST SENSE with LOGICAL UNIT NOT SUPPORTED, others
    /// CHECK CONDITION 25/00), everything else by the unit.
    pub fn execute(&self, raw: u64, cmd: Command<'_>) -> Outcome {
        let c = Cdb::new(cmd.cdb);
        let luns = self.luns.load();
        if c.op() == REPORT_LUNS {
            let idx: Vec<u16> = luns.iter().map(|(i, _)| *i).collect();
            return match report_luns(&c, &idx) {
                Ok(o) => o,
                Err(Fail::Sense(s)) => Outcome::check(&s),
                Err(Fail::Status(s)) => Outcome::status(s),
            };
        }
        if let Some(lu) = find(&luns, raw) {
            if c.op() == crate::lu::op::EXTENDED_COPY {
                let units: Vec<&LogicalUnit> = luns.iter().map(|(_, u)| &**u).collect();
                return lu.execute_in(cmd, &units);
            }
            return lu.execute(cmd);
        }
        let not_supported = Sense::new(key::ILLEGAL_REQUEST, asc::LUN_NOT_SUPPORTED);
        match c.op() {
            INQUIRY => {
                let alloc = u16::from_be_bytes([c.b(3), c.b(4)]) as usize;
                if c.b(1) & 0x01 != 0 {
                    // No VPD pages for a LUN that does not exist.
                    return Outcome::check(&Sense::invalid_cdb_field(1, Some(0)));
                }
                let mut d = vec![0u8; 36];
                d[0] = 0x7F; // qualifier 011b, type 1Fh: no unit at this LUN (SPC-4 6.6.2)
                d[2] = 0x06;
                d[3] = 0x02;
                d[4] = 31;
                d.truncate(alloc);
                Outcome::good(Bytes::from(d))
            }
            REQUEST_SENSE => {
                let alloc = c.b(4) as usize;
                let mut d = not_supported.encode(c.b(1) & 0x01 != 0).to_vec();
                d.truncate(alloc);
                Outcome::good(Bytes::from(d))
            }
            _ => Outcome::check(&not_supported),
        }
    }

    /// Data phase sizes for a CDB to a LUN (zeros for an absent LUN, except INQUIRY,
    /// REQUEST SENSE and REPORT LUNS).
    pub fn data_phase(&self, raw: u64, cdb: &[u8]) -> DataPhase {
        let c = Cdb::new(cdb);
        match find(&self.luns.load(), raw) {
            Some(lu) => lu.data_phase(cdb),
            None => {
                let inl = match c.op() {
                    REPORT_LUNS => c.u32(6),
                    INQUIRY => u16::from_be_bytes([c.b(3), c.b(4)]) as u32,
                    REQUEST_SENSE => c.b(4) as u32,
                    _ => 0,
                };
                DataPhase {
                    data_out_len: 0,
                    data_in_len: inl.min(1 << 20),
                }
            }
        }
    }

    /// A command whose data-out has a fixed size (WRITE SAME, COMPARE AND WRITE) that arrives
    /// with more data than that (iSCSI ExpectedDataTransferLength `edtl` beyond what its CDB
    /// asks for) is refused instead of run on the first part: CHECK CONDITION, ILLEGAL REQUEST,
    /// INVALID FIELD IN CDB. None for anything else (a read or write that overflows runs and
    /// reports the residual).
    pub fn overflow_refused(&self, raw: u64, cdb: &[u8], edtl: u32) -> Option<Outcome> {
        // Every write passes here: the opcode first, the CDB's data phase only for the few.
        let luns = self.luns.load();
        let lu = find(&luns, raw).filter(|lu| lu.data_out_fixed(cdb))?;
        (edtl > lu.data_phase(cdb).data_out_len)
            .then(|| Outcome::check(&Sense::new(key::ILLEGAL_REQUEST, asc::INVALID_FIELD_IN_CDB)))
    }

    /// Whether aborting the command may end it without waiting for it (see
    /// [`LogicalUnit::abort_ends_wait`]).
    pub fn abort_ends_wait(&self, raw: u64, cdb: &[u8]) -> bool {
        find(&self.luns.load(), raw).is_some_and(|lu| lu.abort_ends_wait(cdb))
    }

    /// Whether the command may wait for backend I/O, on the asynchronous path or a thread
    /// (so it is not run inline).
    pub fn blocking(&self, raw: u64, cdb: &[u8]) -> bool {
        find(&self.luns.load(), raw).is_some_and(|lu| lu.blocking(cdb))
    }

    /// Whether [`DeviceServer::execute`] of the command may block its thread on backend I/O
    /// (run it on a blocking pool).
    pub fn needs_thread(&self, raw: u64, cdb: &[u8]) -> bool {
        find(&self.luns.load(), raw).is_some_and(|lu| lu.needs_thread(cdb))
    }

    /// The first half of a command on the asynchronous path ([`LogicalUnit::prepare`]);
    /// [`Prepared::Sync`] for an absent LUN and REPORT LUNS.
    pub fn prepare(&self, raw: u64, cmd: &Command<'_>) -> Prepared {
        match find(&self.luns.load(), raw) {
            Some(lu) if cmd.cdb.first() != Some(&REPORT_LUNS) => lu.prepare(cmd),
            _ => Prepared::Sync,
        }
    }

    /// Target reset: every unit gets a logical unit reset.
    pub fn reset_all(&self) {
        for (_, lu) in self.luns.load().iter() {
            lu.reset();
        }
    }

    /// An I_T nexus ended (session closed): every unit forgets its per-nexus state.
    pub fn nexus_lost(&self, nexus: &Nexus) {
        for (_, lu) in self.luns.load().iter() {
            lu.nexus_lost(nexus);
        }
    }

    /// Stops the units' background work (a SANITIZE under way) before a shutdown; returns how
    /// many units had some.
    pub fn stop_background(&self) -> usize {
        self.luns
            .load()
            .iter()
            .filter(|(_, lu)| lu.stop_background())
            .count()
    }

    /// Flushes every unit; returns the last error, after trying all.
    pub fn flush_all(&self) -> Result<(), BackendError> {
        let mut res = Ok(());
        for (_, lu) in self.luns.load().iter() {
            if let Err(e) = lu.flush() {
                res = Err(e);
            }
        }
        res
    }
}
