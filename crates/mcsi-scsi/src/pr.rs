//! Persistent reservations (SPC-4 5.9, PERSISTENT RESERVE IN/OUT) and the SPC-2 RESERVE/RELEASE
//! reservation, kept per logical unit.

use crate::sense::{asc, key, Sense};
use crate::Nexus;

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
#[derive(Debug, Default)]
pub(crate) struct PrState {
    generation: u32,
    /// Registered keys, one per I_T nexus, in registration order.
    regs: Vec<(Nexus, u64)>,
    res: Option<Reservation>,
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

fn be64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        v.copy_from_slice(s);
    }
    u64::from_be_bytes(v)
}

impl PrState {
    fn key_of(&self, n: &Nexus) -> Option<u64> {
        self.regs.iter().find(|(r, _)| r == n).map(|(_, k)| *k)
    }

    fn is_holder(&self, n: &Nexus) -> bool {
        match &self.res {
            Some(r) if all_registrants(r.ty) => self.key_of(n).is_some(),
            Some(r) => &r.holder == n,
            None => false,
        }
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
                // CRH=0, SIP_C=0, ATP_C=0, PTPL_C=0; TMV=1, ALLOW COMMANDS=0, PTPL_A=0.
                out.push(0x00);
                out.push(0x80);
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
                    // ALL_TG_PT=0, R_HOLDER
                    d.push(if holder { 0x01 } else { 0x00 });
                    let t = match (&self.res, holder) {
                        (Some(r), true) => r.ty & 0x0F,
                        _ => 0,
                    };
                    d.push(t);
                    d.extend_from_slice(&[0; 4]);
                    d.extend_from_slice(&reg.relative_port.to_be_bytes());
                    // iSCSI TransportID, format 01b (name + ",i,0x" + ISID), SPC-4 7.6.4.6.
                    let name = reg.initiator_port.as_bytes();
                    let mut tid_len = name.len() + 1;
                    tid_len = tid_len.div_ceil(4) * 4;
                    let mut tid = vec![0x40 | 0x05, 0];
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
            return Err(Sense::new(key::ILLEGAL_REQUEST, asc::PARAMETER_LIST_LENGTH_ERROR).into());
        }
        let rk = be64(params, 0);
        let sark = be64(params, 8);
        let flags = params[20];
        // SPEC_I_PT and ALL_TG_PT are not supported.
        if flags & 0x08 != 0 {
            return Err(Sense::invalid_param_field(20, Some(3)).into());
        }
        if flags & 0x04 != 0 {
            return Err(Sense::invalid_param_field(20, Some(2)).into());
        }
        let prtype = scope_type & 0x0F;
        let scope = scope_type >> 4;
        let mine = self.key_of(n);
        let mut uas = UaList::new();
        match sa {
            // REGISTER / REGISTER AND IGNORE EXISTING KEY (SPC-4 5.9.7)
            0x00 | 0x06 => {
                let ignore = sa == 0x06;
                match mine {
                    None => {
                        if !ignore && rk != 0 {
                            return Err(PrError::Conflict);
                        }
                        if sark != 0 {
                            self.regs.push((n.clone(), sark));
                        }
                    }
                    Some(cur) => {
                        if !ignore && rk != cur {
                            return Err(PrError::Conflict);
                        }
                        if sark == 0 {
                            self.unregister(n, &mut uas);
                        } else if let Some(e) = self.regs.iter_mut().find(|(r, _)| r == n) {
                            e.1 = sark;
                        }
                    }
                }
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
                            holder: n.clone(),
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
                        holder: n.clone(),
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
                        .filter(|(r, k)| *k == sark && r != n)
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
                            holder: n.clone(),
                            ty: prtype,
                        });
                    }
                }
                self.generation = self.generation.wrapping_add(1);
            }
            _ => return Err(Sense::invalid_cdb_field(1, Some(4)).into()),
        }
        Ok(uas)
    }

    fn unregister(&mut self, n: &Nexus, uas: &mut UaList) {
        let was_holder = self.is_holder(n);
        self.regs.retain(|(r, _)| r != n);
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
            if reg != n {
                uas.push((
                    reg.clone(),
                    Sense::new(key::UNIT_ATTENTION, asc::REGISTRATIONS_PREEMPTED),
                ));
            }
        }
        self.regs.retain(|(r, _)| r == n);
    }
}
