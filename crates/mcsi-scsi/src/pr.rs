//! Persistent reservations (SPC-4 5.9, PERSISTENT RESERVE IN/OUT) and the SPC-2 RESERVE/RELEASE
//! reservation, kept per logical unit.
//!
//! A unit given a file for them (`LuConfig::pr_file`) persists through power loss (PTPL_C = 1):
//! while the last REGISTER had APTPL set, every change is written to the file and synced before
//! the command completes, and the state is read back when the unit opens (SPC-4 5.9.5). A
//! REGISTER with APTPL = 0 removes the file. Without a file, APTPL is refused.

use crate::sense::{asc, key, Sense};
use crate::Nexus;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Registrations a unit holds at most (one per I_T nexus): a REGISTER of one more is refused
/// with INSUFFICIENT REGISTRATION RESOURCES, so a peer cannot grow the state (or its file)
/// without bound.
pub const MAX_REGISTRATIONS: usize = 1024;

/// Reservation types (SPC-4 table 175).
pub(crate) mod ty {
    pub const WRITE_EXCLUSIVE: u8 = 1;
    pub const EXCLUSIVE_ACCESS: u8 = 3;
    pub const WE_REGISTRANTS_ONLY: u8 = 5;
    pub const EA_REGISTRANTS_ONLY: u8 = 6;
    pub const WE_ALL_REGISTRANTS: u8 = 7;
    pub const EA_ALL_REGISTRANTS: u8 = 8;
}

fn valid_type(t: u8) -> bool {
    matches!(t, 1 | 3 | 5 | 6 | 7 | 8)
}

fn all_registrants(t: u8) -> bool {
    matches!(t, ty::WE_ALL_REGISTRANTS | ty::EA_ALL_REGISTRANTS)
}

/// How a command touches the medium, for the access rules of SPC-4 5.9.1 (table 66).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Allowed under every reservation (INQUIRY, REPORT LUNS, PR IN/OUT, ...).
    Always,
    Read,
    Write,
}

#[derive(Debug, Clone)]
struct Reservation {
    /// The holder; for all-registrants types every registrant holds it.
    holder: Nexus,
    ty: u8,
}

/// Persistent reservation state of one logical unit.
#[derive(Debug, Default, Clone)]
pub(crate) struct PrState {
    generation: u32,
    /// Registered keys, one per I_T nexus, in registration order.
    regs: Vec<(Nexus, u64)>,
    /// Registrations made with ALL_TG_PT (READ FULL STATUS reports the bit). A target has one
    /// target port (one portal group), so such a registration is the same as one made on it.
    all_tg_pt: Vec<Nexus>,
    res: Option<Reservation>,
    /// APTPL of the last successful REGISTER: the state persists through power loss (PTPL_A).
    pub(crate) aptpl: bool,
    /// The unit can persist it (PTPL_C): it has a file for it.
    pub(crate) ptpl_capable: bool,
}

/// An I_T nexus as the file keeps it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct SavedNexus {
    initiator_port: String,
    target_port: String,
    relative_port: u16,
}

impl SavedNexus {
    fn of(n: &Nexus) -> SavedNexus {
        SavedNexus {
            initiator_port: n.initiator_port.to_string(),
            target_port: n.target_port.to_string(),
            relative_port: n.relative_port,
        }
    }

    fn nexus(&self) -> Nexus {
        Nexus {
            initiator_port: self.initiator_port.as_str().into(),
            target_port: self.target_port.as_str().into(),
            relative_port: self.relative_port,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct SavedReg {
    #[serde(flatten)]
    nexus: SavedNexus,
    key: u64,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    all_tg_pt: bool,
}

#[derive(Debug, Serialize, Deserialize)]
struct SavedRes {
    #[serde(flatten)]
    holder: SavedNexus,
    #[serde(rename = "type")]
    ty: u8,
}

/// The file's contents (JSON).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Saved {
    version: u32,
    generation: u32,
    registrations: Vec<SavedReg>,
    reservation: Option<SavedRes>,
    /// APTPL of the last REGISTER. A file is kept only while it is set, so files written
    /// before the field existed hold it set; a shared record keeps it either way.
    #[serde(default = "yes")]
    aptpl: bool,
}

fn yes() -> bool {
    true
}

const SAVED_VERSION: u32 = 1;

/// Writes `bytes` to `path` whole or not at all: a temporary file beside it (owner-only),
/// synced, renamed over it, and the directory synced.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = path.parent().unwrap_or(Path::new("."));
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        // The new directory's entry in its parent, durable too.
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::File::open(parent)?.sync_all()?;
        }
    }
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

/// What a PERSISTENT RESERVE OUT did to other nexuses: unit attentions to queue.
pub(crate) type UaList = Vec<(Nexus, Sense)>;

pub(crate) enum PrError {
    Sense(Sense),
    Conflict,
}

impl From<Sense> for PrError {
    fn from(s: Sense) -> Self {
        PrError::Sense(s)
    }
}

fn length_error() -> Sense {
    Sense::new(key::ILLEGAL_REQUEST, asc::PARAMETER_LIST_LENGTH_ERROR)
}

fn no_room() -> PrError {
    Sense::new(
        key::ILLEGAL_REQUEST,
        asc::INSUFFICIENT_REGISTRATION_RESOURCES,
    )
    .into()
}

/// INVALID FIELD IN PARAMETER LIST at byte `at` of a parameter list that may be longer than
/// the 16-bit field pointer reaches: past that, the sense says which field without where.
fn param_field(at: usize, bit: Option<u8>) -> Sense {
    match u16::try_from(at) {
        Ok(p) => Sense::invalid_param_field(p, bit),
        Err(_) => Sense::new(key::ILLEGAL_REQUEST, asc::INVALID_FIELD_IN_PARAMETER_LIST),
    }
}

/// Whether registration (or reservation holder) `reg` is that of nexus `n`: the same I_T
/// nexus, or `reg` names an initiator device (an iSCSI name without an ISID, from a TransportID
/// of format 00b) and `n` is one of its ports through the same target port.
pub(crate) fn covers(reg: &Nexus, n: &Nexus) -> bool {
    if reg == n {
        return true;
    }
    if !is_device(reg) || reg.target_port != n.target_port || reg.relative_port != n.relative_port {
        return false;
    }
    match n.initiator_port.rsplit_once(",i,0x") {
        Some((name, _)) => name.eq_ignore_ascii_case(&reg.initiator_port),
        None => false,
    }
}

/// Whether `n` names an initiator device (every port of one iSCSI name) rather than one port.
pub(crate) fn is_device(n: &Nexus) -> bool {
    !n.initiator_port.contains(",i,0x")
}

/// An iSCSI TransportID (SPC-4 7.6.4.6) at the start of `b` (`at`: its offset in the
/// parameter list, for the sense's field pointer), and its length. Format 01b names one
/// initiator port: its I_T nexus ("<name>,i,0x<ISID>", as this target names its nexuses)
/// through `n`'s target port (the target has one). Format 00b names an initiator device by
/// its iSCSI name alone: a registration for it is that of every port of that name, those that
/// log in later included ([`covers`]), as LIO registers a node ACL.
fn transport_id(b: &[u8], at: usize, n: &Nexus) -> Result<(Nexus, usize), Sense> {
    if b.len() < 4 {
        return Err(length_error());
    }
    let field = |byte: usize, bit: Option<u8>| param_field(at + byte, bit);
    if b[0] & 0x0F != 0x05 {
        return Err(field(0, Some(3)));
    }
    let device = match b[0] >> 6 {
        0b00 => true,
        0b01 => false,
        _ => return Err(field(0, Some(7))),
    };
    let add = u16::from_be_bytes([b[2], b[3]]) as usize;
    if add < 20 || !add.is_multiple_of(4) || 4 + add > b.len() {
        return Err(field(2, None));
    }
    let text = &b[4..4 + add];
    let text = &text[..text.iter().position(|&c| c == 0).unwrap_or(text.len())];
    let text = std::str::from_utf8(text).map_err(|_| field(4, None))?;
    if device {
        // A name: no ISID, nor a separator this target's port names use.
        if text.is_empty() || text.len() > 223 || text.contains(',') {
            return Err(field(4, None));
        }
        let nexus = Nexus {
            initiator_port: text.to_ascii_lowercase().into(),
            target_port: n.target_port.clone(),
            relative_port: n.relative_port,
        };
        return Ok((nexus, 4 + add));
    }
    let (name, isid) = text
        .rsplit_once(",i,0x")
        .or_else(|| text.rsplit_once(",I,0X"))
        .ok_or_else(|| field(4, None))?;
    // An iSCSI name is at most 223 bytes (RFC 7143 4.2.7.1), and lower case once normalized
    // (RFC 3722), as initiators send it at login.
    if name.is_empty()
        || name.len() > 223
        || isid.len() != 12
        || !isid.bytes().all(|c| c.is_ascii_hexdigit())
    {
        return Err(field(4, None));
    }
    let port = format!(
        "{},i,0x{}",
        name.to_ascii_lowercase(),
        isid.to_ascii_lowercase()
    );
    let nexus = Nexus {
        initiator_port: port.into(),
        target_port: n.target_port.clone(),
        relative_port: n.relative_port,
    };
    Ok((nexus, 4 + add))
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        v.copy_from_slice(s);
    }
    u64::from_be_bytes(v)
}

impl PrState {
    /// No registration; `ptpl_capable`: the unit can persist through power loss.
    pub(crate) fn new(ptpl_capable: bool) -> PrState {
        PrState {
            ptpl_capable,
            ..PrState::default()
        }
    }

    /// Writes the state to `path` while APTPL is set, or removes the file when it is not: what
    /// a PERSISTENT RESERVE OUT that changed the state does before it completes.
    pub(crate) fn persist(&self, path: &Path) -> std::io::Result<()> {
        if !self.aptpl {
            return match std::fs::remove_file(path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
                // The removal durable: a power loss must not bring the state back.
                Ok(()) => match path.parent().filter(|p| !p.as_os_str().is_empty()) {
                    Some(dir) => std::fs::File::open(dir)?.sync_all(),
                    None => Ok(()),
                },
            };
        }
        write_atomic(path, &self.to_bytes())
    }

    /// The state as it is saved (JSON): in a file, or in a record shared by gateways.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let saved = Saved {
            version: SAVED_VERSION,
            generation: self.generation,
            registrations: self
                .regs
                .iter()
                .map(|(n, k)| SavedReg {
                    nexus: SavedNexus::of(n),
                    key: *k,
                    all_tg_pt: self.all_tg_pt.contains(n),
                })
                .collect(),
            reservation: self.res.as_ref().map(|r| SavedRes {
                holder: SavedNexus::of(&r.holder),
                ty: r.ty,
            }),
            aptpl: self.aptpl,
        };
        // Plain data with string keys: serialising cannot fail.
        serde_json::to_vec_pretty(&saved).unwrap_or_default()
    }

    /// The state a unit persisted in `path` (None: no file, nothing persisted). A file that
    /// does not parse, or names a reservation type or more registrations than a unit takes,
    /// is an error: starting without the reservations it holds would break the promise made
    /// to the initiators that set APTPL.
    pub(crate) fn load(path: &Path) -> std::io::Result<Option<PrState>> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        PrState::from_bytes(&bytes).map(Some)
    }

    /// The state saved in `bytes` ([`PrState::to_bytes`]), able to persist (PTPL_C). Bytes
    /// that do not parse, or name a reservation type or more registrations than a unit takes,
    /// are an error.
    pub(crate) fn from_bytes(bytes: &[u8]) -> std::io::Result<PrState> {
        let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
        let s: Saved = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        if s.version != SAVED_VERSION {
            return Err(bad(format!(
                "version {} (this mcsi reads {SAVED_VERSION})",
                s.version
            )));
        }
        if s.registrations.len() > MAX_REGISTRATIONS {
            return Err(bad(format!(
                "{} registrations, more than a unit takes ({MAX_REGISTRATIONS})",
                s.registrations.len()
            )));
        }
        if let Some(r) = &s.reservation {
            if !valid_type(r.ty) {
                return Err(bad(format!("reservation type {}", r.ty)));
            }
        }
        Ok(PrState {
            generation: s.generation,
            regs: s
                .registrations
                .iter()
                .map(|r| (r.nexus.nexus(), r.key))
                .collect(),
            all_tg_pt: s
                .registrations
                .iter()
                .filter(|r| r.all_tg_pt)
                .map(|r| r.nexus.nexus())
                .collect(),
            res: s.reservation.map(|r| Reservation {
                holder: r.holder.nexus(),
                ty: r.ty,
            }),
            aptpl: s.aptpl,
            ptpl_capable: true,
        })
    }

    /// Whether a port of initiator device `d` is registered by itself.
    fn ports_registered(&self, d: &Nexus) -> bool {
        self.regs.iter().any(|(r, _)| r != d && covers(d, r))
    }

    /// The registration of `n`: its own, or else its initiator device's.
    fn reg_of(&self, n: &Nexus) -> Option<usize> {
        self.regs
            .iter()
            .position(|(r, _)| r == n)
            .or_else(|| self.regs.iter().position(|(r, _)| covers(r, n)))
    }

    /// Who holds what `n` reserves: its registration's nexus (an initiator device's
    /// registration makes every port of it the holder, as in LIO).
    fn registrant(&self, n: &Nexus) -> Nexus {
        self.reg_of(n)
            .map_or_else(|| n.clone(), |i| self.regs[i].0.clone())
    }

    fn key_of(&self, n: &Nexus) -> Option<u64> {
        self.reg_of(n).map(|i| self.regs[i].1)
    }

    fn is_holder(&self, n: &Nexus) -> bool {
        match &self.res {
            Some(r) if all_registrants(r.ty) => self.key_of(n).is_some(),
            Some(r) => covers(&r.holder, n),
            None => false,
        }
    }

    /// The unit attentions owed to the nexuses of this state when another gateway of a
    /// shared state turned it into `next` (SPC-4 5.12.11): a registration that is gone was
    /// preempted (REGISTRATIONS PREEMPTED), or cleared with all the others (RESERVATIONS
    /// PREEMPTED); a registrants-only or all-registrants reservation that was released tells
    /// the registrants left (RESERVATIONS RELEASED). A nexus changes its own registration only
    /// through its own gateway, which owes it nothing.
    pub(crate) fn changed_elsewhere(&self, next: &PrState) -> Vec<(Nexus, Sense)> {
        let ua = |code| Sense::new(key::UNIT_ATTENTION, code);
        let cleared = next.regs.is_empty() && next.generation != self.generation;
        let mut out: Vec<(Nexus, Sense)> = self
            .regs
            .iter()
            .filter(|(n, _)| next.key_of(n).is_none())
            .map(|(n, _)| {
                let code = if cleared {
                    asc::RESERVATIONS_PREEMPTED
                } else {
                    asc::REGISTRATIONS_PREEMPTED
                };
                (n.clone(), ua(code))
            })
            .collect();
        if let (Some(r), None) = (&self.res, &next.res) {
            if matches!(
                r.ty,
                ty::WE_REGISTRANTS_ONLY
                    | ty::EA_REGISTRANTS_ONLY
                    | ty::WE_ALL_REGISTRANTS
                    | ty::EA_ALL_REGISTRANTS
            ) {
                out.extend(
                    next.regs
                        .iter()
                        .filter(|(n, _)| self.key_of(n).is_some())
                        .map(|(n, _)| (n.clone(), ua(asc::RESERVATIONS_RELEASED))),
                );
            }
        }
        out
    }

    /// True when any registration or reservation exists (SPC-2 RESERVE then conflicts).
    pub(crate) fn active(&self) -> bool {
        !self.regs.is_empty() || self.res.is_some()
    }

    /// The access check of SPC-4 table 66 for a command of class `access` from `n`.
    pub(crate) fn conflicts(&self, n: &Nexus, access: Access) -> bool {
        let Some(r) = &self.res else { return false };
        if access == Access::Always || self.is_holder(n) {
            return false;
        }
        let registered = self.key_of(n).is_some();
        match r.ty {
            ty::WRITE_EXCLUSIVE => access == Access::Write,
            ty::EXCLUSIVE_ACCESS => true,
            ty::WE_REGISTRANTS_ONLY | ty::WE_ALL_REGISTRANTS => {
                !registered && access == Access::Write
            }
            ty::EA_REGISTRANTS_ONLY | ty::EA_ALL_REGISTRANTS => !registered,
            _ => false,
        }
    }

    /// I_T nexus loss keeps registrations (SPC-4 5.9.4); nothing to do for PR.
    pub(crate) fn clear(&mut self) {
        self.regs.clear();
        self.res = None;
        self.generation = self.generation.wrapping_add(1);
    }

    /// PERSISTENT RESERVE IN (SPC-4 6.13). Returns the full parameter data.
    pub(crate) fn pr_in(&self, n: &Nexus, sa: u8) -> Result<Vec<u8>, Sense> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.generation.to_be_bytes());
        match sa {
            // READ KEYS
            0x00 => {
                out.extend_from_slice(&((self.regs.len() * 8) as u32).to_be_bytes());
                for (_, k) in &self.regs {
                    out.extend_from_slice(&k.to_be_bytes());
                }
            }
            // READ RESERVATION
            0x01 => match &self.res {
                Some(r) => {
                    out.extend_from_slice(&16u32.to_be_bytes());
                    // All-registrants reservations report key zero (SPC-4 6.13.3).
                    let k = if all_registrants(r.ty) {
                        0
                    } else {
                        self.key_of(&r.holder).unwrap_or(0)
                    };
                    out.extend_from_slice(&k.to_be_bytes());
                    out.extend_from_slice(&[0, 0, 0, 0, 0, r.ty & 0x0F, 0, 0]);
                }
                None => out.extend_from_slice(&0u32.to_be_bytes()),
            },
            // REPORT CAPABILITIES (SPC-4 6.13.4): 8 bytes, no generation field.
            0x02 => {
                out.clear();
                out.extend_from_slice(&8u16.to_be_bytes());
                // CRH=0, SIP_C=1, ATP_C=1, PTPL_C; TMV=1, ALLOW COMMANDS=0, PTPL_A.
                out.push(0x08 | 0x04 | u8::from(self.ptpl_capable));
                out.push(0x80 | u8::from(self.aptpl));
                // Persistent reservation type mask: WR_EX_AR, EX_AC_RO, WR_EX_RO, EX_AC, WR_EX,
                // then EX_AC_AR.
                out.push(0x80 | 0x40 | 0x20 | 0x08 | 0x02);
                out.push(0x01);
                out.extend_from_slice(&[0, 0]);
            }
            // READ FULL STATUS (SPC-4 6.13.5)
            0x03 => {
                let mut descs = Vec::new();
                for (reg, k) in &self.regs {
                    let mut d = Vec::with_capacity(24 + 24);
                    d.extend_from_slice(&k.to_be_bytes());
                    d.extend_from_slice(&[0; 4]);
                    let holder = self.is_holder(reg);
                    // ALL_TG_PT, R_HOLDER
                    let all = if self.all_tg_pt.contains(reg) {
                        0x02
                    } else {
                        0
                    };
                    d.push(all | u8::from(holder));
                    let t = match (&self.res, holder) {
                        (Some(r), true) => r.ty & 0x0F,
                        _ => 0,
                    };
                    d.push(t);
                    d.extend_from_slice(&[0; 4]);
                    d.extend_from_slice(&reg.relative_port.to_be_bytes());
                    // iSCSI TransportID, SPC-4 7.6.4.6: format 01b (name + ",i,0x" + ISID),
                    // or 00b (the name) for an initiator device; at least 20 bytes of name.
                    let name = reg.initiator_port.as_bytes();
                    let mut tid_len = name.len() + 1;
                    tid_len = (tid_len.div_ceil(4) * 4).max(20);
                    let format = if is_device(reg) { 0x00 } else { 0x40 };
                    let mut tid = vec![format | 0x05, 0];
                    tid.extend_from_slice(&(tid_len as u16).to_be_bytes());
                    tid.extend_from_slice(name);
                    tid.resize(4 + tid_len, 0);
                    d.extend_from_slice(&(tid.len() as u32).to_be_bytes());
                    d.extend_from_slice(&tid);
                    descs.extend_from_slice(&d);
                }
                out.extend_from_slice(&(descs.len() as u32).to_be_bytes());
                out.extend_from_slice(&descs);
            }
            _ => return Err(Sense::invalid_cdb_field(1, Some(4))),
        }
        let _ = n;
        Ok(out)
    }

    /// PERSISTENT RESERVE OUT (SPC-4 6.14) with the basic 24-byte parameter list.
    pub(crate) fn pr_out(
        &mut self,
        n: &Nexus,
        sa: u8,
        scope_type: u8,
        params: &[u8],
    ) -> Result<UaList, PrError> {
        if params.len() < 24 {
            return Err(length_error().into());
        }
        if sa == 0x07 {
            return self.register_and_move(n, params);
        }
        let rk = be64(params, 0);
        let sark = be64(params, 8);
        let flags = params[20];
        // SPEC_I_PT (REGISTER only): the initiator ports listed after the basic list are
        // registered with the same key. ALL_TG_PT (REGISTER and REGISTER AND IGNORE EXISTING
        // KEY only; ignored by the others) is taken: a target has one target port.
        let spec_i_pt = flags & 0x08 != 0;
        let mut also = Vec::new();
        if spec_i_pt && sa == 0x00 && sark == 0 && self.key_of(n).is_none() {
            // An unregistered nexus unregistering: GOOD, and nothing changes (SPC-4 5.9.7).
            return Ok(UaList::new());
        }
        if spec_i_pt {
            if sa != 0x00 || self.key_of(n).is_some() || sark == 0 {
                // SPC-4 5.9.7: only a REGISTER by an unregistered I_T nexus names others.
                return Err(Sense::invalid_param_field(20, Some(3)).into());
            }
            if params.len() < 28 {
                return Err(length_error().into());
            }
            let tlen =
                u32::from_be_bytes([params[24], params[25], params[26], params[27]]) as usize;
            if params.len() != 28 + tlen {
                return Err(length_error().into());
            }
            let mut at = 28;
            while at < params.len() {
                let (dest, len) = transport_id(&params[at..], at, n)?;
                // A port is registered by itself or through its initiator device, never both:
                // a device whose ports are registered already, or listed, is refused.
                if is_device(&dest)
                    && (self.ports_registered(&dest)
                        || also.iter().any(|a| *a != dest && covers(&dest, a)))
                {
                    return Err(param_field(at, None).into());
                }
                if also
                    .iter()
                    .any(|a| is_device(a) && covers(a, &dest) && *a != dest)
                {
                    return Err(param_field(at, None).into());
                }
                // One already registered keeps its key (as LIO does).
                if dest != *n && self.key_of(&dest).is_none() && !also.contains(&dest) {
                    // Refused as soon as the list outgrows what the unit holds: the list may
                    // name some 10,000 ports, each compared with those before it.
                    if self.regs.len() + 1 + also.len() >= MAX_REGISTRATIONS {
                        return Err(no_room());
                    }
                    also.push(dest);
                }
                at += len;
            }
        } else if params.len() != 24 {
            return Err(length_error().into());
        }
        let all_tg_pt = flags & 0x04 != 0;
        let prtype = scope_type & 0x0F;
        let scope = scope_type >> 4;
        let mine = self.key_of(n);
        let mut uas = UaList::new();
        match sa {
            // REGISTER / REGISTER AND IGNORE EXISTING KEY (SPC-4 5.9.7)
            0x00 | 0x06 => {
                let ignore = sa == 0x06;
                let aptpl = flags & 0x01 != 0;
                if aptpl && !self.ptpl_capable {
                    // SPC-4 6.14.3: a unit that cannot persist refuses APTPL, rather than
                    // accept a promise it would not keep.
                    return Err(Sense::invalid_param_field(20, Some(0)).into());
                }
                match mine {
                    None => {
                        if !ignore && rk != 0 {
                            return Err(PrError::Conflict);
                        }
                        if sark == 0 {
                            // An unregistered nexus unregistering: GOOD, and nothing changes
                            // (SPC-4 5.9.7), APTPL and the generation included.
                            return Ok(uas);
                        }
                        if self.regs.len() + 1 + also.len() > MAX_REGISTRATIONS {
                            return Err(no_room());
                        }
                        // A listed initiator device that n is a port of registers n with it.
                        let own = (!also.iter().any(|d| covers(d, n))).then_some(n);
                        for r in own.into_iter().chain(also.iter()) {
                            self.regs.push((r.clone(), sark));
                            if all_tg_pt {
                                self.all_tg_pt.push(r.clone());
                            }
                        }
                    }
                    Some(cur) => {
                        if !ignore && rk != cur {
                            return Err(PrError::Conflict);
                        }
                        if sark == 0 {
                            self.unregister(n, &mut uas);
                        } else if let Some(i) = self.reg_of(n) {
                            self.regs[i].1 = sark;
                        }
                    }
                }
                self.aptpl = aptpl;
                self.generation = self.generation.wrapping_add(1);
            }
            // RESERVE (SPC-4 5.9.9)
            0x01 => {
                let cur = mine.ok_or(PrError::Conflict)?;
                if rk != cur {
                    return Err(PrError::Conflict);
                }
                if scope != 0 {
                    return Err(Sense::invalid_cdb_field(2, Some(4)).into());
                }
                if !valid_type(prtype) {
                    return Err(Sense::invalid_cdb_field(2, Some(0)).into());
                }
                match &self.res {
                    Some(r) => {
                        if !self.is_holder(n) || r.ty != prtype {
                            return Err(PrError::Conflict);
                        }
                    }
                    None => {
                        self.res = Some(Reservation {
                            holder: self.registrant(n),
                            ty: prtype,
                        })
                    }
                }
            }
            // RELEASE (SPC-4 5.9.11.2)
            0x02 => {
                let cur = mine.ok_or(PrError::Conflict)?;
                if rk != cur {
                    return Err(PrError::Conflict);
                }
                let Some(r) = self.res.clone() else {
                    return Ok(uas);
                };
                if !self.is_holder(n) {
                    return Ok(uas);
                }
                if r.ty != prtype {
                    return Err(Sense::new(
                        key::ILLEGAL_REQUEST,
                        asc::INVALID_RELEASE_OF_PERSISTENT_RESERVATION,
                    )
                    .into());
                }
                self.res = None;
                // Registrants-only and all-registrants releases tell the other registrants.
                if matches!(prtype, 5..=8) {
                    // The issuer's device too: its other ports are owed it (the issuer is
                    // left out where the attentions are delivered).
                    for (reg, _) in &self.regs {
                        if reg != n {
                            uas.push((
                                reg.clone(),
                                Sense::new(key::UNIT_ATTENTION, asc::RESERVATIONS_RELEASED),
                            ));
                        }
                    }
                }
            }
            // CLEAR (SPC-4 5.9.11.6)
            0x03 => {
                let cur = mine.ok_or(PrError::Conflict)?;
                if rk != cur {
                    return Err(PrError::Conflict);
                }
                for (reg, _) in &self.regs {
                    if reg != n {
                        uas.push((
                            reg.clone(),
                            Sense::new(key::UNIT_ATTENTION, asc::RESERVATIONS_PREEMPTED),
                        ));
                    }
                }
                self.clear();
            }
            // PREEMPT / PREEMPT AND ABORT (SPC-4 5.9.11.4); task abort is the transport's.
            0x04 | 0x05 => {
                let cur = mine.ok_or(PrError::Conflict)?;
                if rk != cur {
                    return Err(PrError::Conflict);
                }
                if !valid_type(prtype) {
                    return Err(Sense::invalid_cdb_field(2, Some(0)).into());
                }
                let res = self.res.clone();
                let preempt_all = matches!(&res, Some(r) if all_registrants(r.ty));
                if preempt_all && sark == 0 {
                    // Remove every other registration, take the reservation.
                    self.remove_others(n, &mut uas);
                    self.res = Some(Reservation {
                        holder: self.registrant(n),
                        ty: prtype,
                    });
                } else if sark == 0 {
                    // A zero key only preempts all-registrants reservations (SPC-4 5.9.11.4.3).
                    return Err(Sense::invalid_param_field(8, None).into());
                } else {
                    if !self.regs.iter().any(|(_, k)| *k == sark) {
                        return Err(PrError::Conflict);
                    }
                    let holder_key = match &res {
                        Some(r) if !all_registrants(r.ty) => self.key_of(&r.holder),
                        _ => None,
                    };
                    let victims: Vec<Nexus> = self
                        .regs
                        .iter()
                        .filter(|(r, k)| *k == sark && !covers(r, n))
                        .map(|(r, _)| r.clone())
                        .collect();
                    for v in &victims {
                        self.regs.retain(|(r, _)| r != v);
                        uas.push((
                            v.clone(),
                            Sense::new(key::UNIT_ATTENTION, asc::REGISTRATIONS_PREEMPTED),
                        ));
                    }
                    if holder_key == Some(sark) {
                        self.res = Some(Reservation {
                            holder: self.registrant(n),
                            ty: prtype,
                        });
                    }
                }
                self.generation = self.generation.wrapping_add(1);
            }
            _ => return Err(Sense::invalid_cdb_field(1, Some(4)).into()),
        }
        // Only registered nexuses keep the flag.
        let regs = &self.regs;
        self.all_tg_pt.retain(|a| regs.iter().any(|(r, _)| r == a));
        Ok(uas)
    }

    /// REGISTER AND MOVE (SPC-4 5.9.8): the holder registers another I_T nexus with the
    /// service action key and hands it the reservation, unregistering itself if UNREG is set.
    fn register_and_move(&mut self, n: &Nexus, params: &[u8]) -> Result<UaList, PrError> {
        let rk = be64(params, 0);
        let sark = be64(params, 8);
        let flags = params[17];
        let (unreg, aptpl) = (flags & 0x02 != 0, flags & 0x01 != 0);
        let rel = u16::from_be_bytes([params[18], params[19]]);
        let tlen = u32::from_be_bytes([params[20], params[21], params[22], params[23]]) as usize;
        if params.len() != 24 + tlen || tlen == 0 {
            return Err(length_error().into());
        }
        // The holder, by its key, of a reservation that has one holder (a registered key is
        // never 0).
        if self.key_of(n) != Some(rk) {
            return Err(PrError::Conflict);
        }
        match &self.res {
            Some(r) if self.is_holder(n) && !all_registrants(r.ty) => {}
            _ => return Err(PrError::Conflict),
        }
        if sark == 0 {
            return Err(Sense::invalid_param_field(8, None).into());
        }
        if aptpl && !self.ptpl_capable {
            return Err(Sense::invalid_param_field(17, Some(0)).into());
        }
        if rel != n.relative_port {
            // The target has one target port: the one this command came through.
            return Err(Sense::invalid_param_field(18, None).into());
        }
        let (dest, len) = transport_id(&params[24..], 24, n)?;
        if len != tlen {
            return Err(length_error().into());
        }
        // The nexus the command came through, or its own initiator device.
        if dest == *n || covers(&dest, n) {
            return Err(Sense::invalid_param_field(24, None).into());
        }
        // A device whose ports are registered by themselves, or a port registered through the
        // same device as the holder, cannot take it.
        let dest_reg = self.reg_of(&dest);
        if (is_device(&dest) && self.ports_registered(&dest))
            || (dest_reg.is_some() && dest_reg == self.reg_of(n))
        {
            return Err(Sense::invalid_param_field(24, None).into());
        }
        // The destination's registration (a port's own, or its device's) takes the key and
        // holds the reservation.
        let holder = match dest_reg {
            Some(i) => {
                self.regs[i].1 = sark;
                self.regs[i].0.clone()
            }
            None => {
                if self.regs.len() >= MAX_REGISTRATIONS {
                    return Err(no_room());
                }
                self.regs.push((dest.clone(), sark));
                dest
            }
        };
        if let Some(r) = self.res.as_mut() {
            r.holder = holder;
        }
        if unreg {
            if let Some(i) = self.reg_of(n) {
                let (r, _) = self.regs.remove(i);
                self.all_tg_pt.retain(|a| *a != r);
            }
        }
        self.aptpl = aptpl;
        self.generation = self.generation.wrapping_add(1);
        Ok(UaList::new())
    }

    /// Removes `n`'s registration: its own, or its initiator device's (every port of that
    /// name then unregistered, as a REGISTER with key 0 through any of them does in LIO).
    fn unregister(&mut self, n: &Nexus, uas: &mut UaList) {
        let Some(i) = self.reg_of(n) else {
            return;
        };
        let (gone, _) = self.regs.remove(i);
        let was_holder = self.res.as_ref().is_some_and(|r| r.holder == gone);
        if let Some(r) = &self.res {
            if all_registrants(r.ty) {
                if self.regs.is_empty() {
                    self.res = None;
                }
            } else if was_holder {
                let t = r.ty;
                self.res = None;
                if matches!(t, ty::WE_REGISTRANTS_ONLY | ty::EA_REGISTRANTS_ONLY) {
                    for (reg, _) in &self.regs {
                        uas.push((
                            reg.clone(),
                            Sense::new(key::UNIT_ATTENTION, asc::RESERVATIONS_RELEASED),
                        ));
                    }
                }
            }
        }
    }

    fn remove_others(&mut self, n: &Nexus, uas: &mut UaList) {
        for (reg, _) in &self.regs {
            if !covers(reg, n) {
                uas.push((
                    reg.clone(),
                    Sense::new(key::UNIT_ATTENTION, asc::REGISTRATIONS_PREEMPTED),
                ));
            }
        }
        self.regs.retain(|(r, _)| covers(r, n));
    }
}
