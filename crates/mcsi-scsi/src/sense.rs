//! Sense data (SPC-4 4.5): fixed format (response code 70h) and descriptor format (72h), the
//! sense keys, and the additional sense code pairs this device server reports.

use bytes::Bytes;

/// Sense keys (SPC-4 table 27).
pub mod key {
    pub const NO_SENSE: u8 = 0x0;
    pub const RECOVERED_ERROR: u8 = 0x1;
    pub const NOT_READY: u8 = 0x2;
    pub const MEDIUM_ERROR: u8 = 0x3;
    pub const HARDWARE_ERROR: u8 = 0x4;
    pub const ILLEGAL_REQUEST: u8 = 0x5;
    pub const UNIT_ATTENTION: u8 = 0x6;
    pub const DATA_PROTECT: u8 = 0x7;
    pub const BLANK_CHECK: u8 = 0x8;
    pub const VENDOR_SPECIFIC: u8 = 0x9;
    pub const COPY_ABORTED: u8 = 0xA;
    pub const ABORTED_COMMAND: u8 = 0xB;
    pub const VOLUME_OVERFLOW: u8 = 0xD;
    pub const MISCOMPARE: u8 = 0xE;
    pub const COMPLETED: u8 = 0xF;
}

/// Additional sense code and qualifier (ASC, ASCQ) pairs (SPC-4 table 28 / annex D).
pub mod asc {
    pub const NO_ADDITIONAL_SENSE: (u8, u8) = (0x00, 0x00);
    pub const LU_NOT_READY_INIT_REQUIRED: (u8, u8) = (0x04, 0x02);
    pub const WRITE_ERROR: (u8, u8) = (0x0C, 0x00);
    pub const UNRECOVERED_READ_ERROR: (u8, u8) = (0x11, 0x00);
    pub const PARAMETER_LIST_LENGTH_ERROR: (u8, u8) = (0x1A, 0x00);
    pub const MISCOMPARE_DURING_VERIFY: (u8, u8) = (0x1D, 0x00);
    pub const INVALID_COMMAND_OPERATION_CODE: (u8, u8) = (0x20, 0x00);
    pub const LBA_OUT_OF_RANGE: (u8, u8) = (0x21, 0x00);
    pub const INVALID_FIELD_IN_CDB: (u8, u8) = (0x24, 0x00);
    pub const LUN_NOT_SUPPORTED: (u8, u8) = (0x25, 0x00);
    pub const INVALID_FIELD_IN_PARAMETER_LIST: (u8, u8) = (0x26, 0x00);
    pub const PARAMETER_NOT_SUPPORTED: (u8, u8) = (0x26, 0x01);
    pub const PARAMETER_VALUE_INVALID: (u8, u8) = (0x26, 0x02);
    pub const INVALID_RELEASE_OF_PERSISTENT_RESERVATION: (u8, u8) = (0x26, 0x04);
    pub const WRITE_PROTECTED: (u8, u8) = (0x27, 0x00);
    pub const POWER_ON_RESET: (u8, u8) = (0x29, 0x00);
    pub const BUS_DEVICE_RESET: (u8, u8) = (0x29, 0x03);
    pub const I_T_NEXUS_LOSS: (u8, u8) = (0x29, 0x07);
    pub const MODE_PARAMETERS_CHANGED: (u8, u8) = (0x2A, 0x01);
    pub const RESERVATIONS_PREEMPTED: (u8, u8) = (0x2A, 0x03);
    pub const RESERVATIONS_RELEASED: (u8, u8) = (0x2A, 0x04);
    pub const REGISTRATIONS_PREEMPTED: (u8, u8) = (0x2A, 0x05);
    pub const CAPACITY_DATA_CHANGED: (u8, u8) = (0x2A, 0x09);
    pub const ASYMMETRIC_ACCESS_STATE_CHANGED: (u8, u8) = (0x2A, 0x06);
    pub const TARGET_PORT_IN_STANDBY_STATE: (u8, u8) = (0x04, 0x0B);
    pub const TARGET_PORT_IN_UNAVAILABLE_STATE: (u8, u8) = (0x04, 0x0C);
    pub const COMMAND_SEQUENCE_ERROR: (u8, u8) = (0x2C, 0x00);
    pub const COMMANDS_CLEARED_BY_ANOTHER_INITIATOR: (u8, u8) = (0x2F, 0x00);
    pub const SAVING_PARAMETERS_NOT_SUPPORTED: (u8, u8) = (0x39, 0x00);
    pub const REPORTED_LUNS_DATA_HAS_CHANGED: (u8, u8) = (0x3F, 0x0E);
    pub const MEDIUM_NOT_PRESENT: (u8, u8) = (0x3A, 0x00);
    pub const INSUFFICIENT_REGISTRATION_RESOURCES: (u8, u8) = (0x55, 0x04);
    pub const INSUFFICIENT_RESOURCES: (u8, u8) = (0x55, 0x03);
    pub const INTERNAL_TARGET_FAILURE: (u8, u8) = (0x44, 0x00);
    pub const MEDIUM_REMOVAL_PREVENTED: (u8, u8) = (0x53, 0x02);
    pub const SANITIZE_IN_PROGRESS: (u8, u8) = (0x04, 0x1B);
    pub const SANITIZE_COMMAND_FAILED: (u8, u8) = (0x31, 0x03);
}

/// Length of fixed-format sense data as built here (additional sense length 10).
pub const FIXED_LEN: usize = 18;

/// One sense data record, independent of its wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
    /// INFORMATION field (for example the failing LBA or the miscompare offset).
    pub information: Option<u64>,
    /// The three sense-key-specific bytes, SKSV bit included (SPC-4 4.5.2.4).
    pub sks: Option<[u8; 3]>,
}

impl Sense {
    /// Sense with a key and (ASC, ASCQ).
    pub const fn new(key: u8, code: (u8, u8)) -> Self {
        Sense {
            key,
            asc: code.0,
            ascq: code.1,
            information: None,
            sks: None,
        }
    }

    /// ILLEGAL REQUEST, INVALID FIELD IN CDB pointing at `byte` (and `bit`, if given) of the CDB.
    pub fn invalid_cdb_field(byte: u16, bit: Option<u8>) -> Self {
        Sense::new(key::ILLEGAL_REQUEST, asc::INVALID_FIELD_IN_CDB)
            .with_field_pointer(true, byte, bit)
    }

    /// ILLEGAL REQUEST, INVALID FIELD IN PARAMETER LIST pointing at `byte` of the parameter data.
    pub fn invalid_param_field(byte: u16, bit: Option<u8>) -> Self {
        Sense::new(key::ILLEGAL_REQUEST, asc::INVALID_FIELD_IN_PARAMETER_LIST)
            .with_field_pointer(false, byte, bit)
    }

    /// Sets the INFORMATION field.
    pub const fn with_info(mut self, info: u64) -> Self {
        self.information = Some(info);
        self
    }

    /// Progress indication sense-key-specific data (SPC-4 4.5.2.4.4): SKSV=1 and the fraction
    /// done, of 65536.
    pub const fn with_progress(mut self, progress: u16) -> Self {
        let be = progress.to_be_bytes();
        self.sks = Some([0x80, be[0], be[1]]);
        self
    }

    /// Field pointer sense-key-specific data (SPC-4 4.5.2.4.2): SKSV=1, C/D says whether the
    /// pointer is into the CDB (true) or the parameter list, BPV/bit pointer when `bit` is given.
    pub const fn with_field_pointer(mut self, in_cdb: bool, byte: u16, bit: Option<u8>) -> Self {
        let mut b0 = 0x80u8;
        if in_cdb {
            b0 |= 0x40;
        }
        if let Some(bit) = bit {
            b0 |= 0x08 | (bit & 0x07);
        }
        let be = byte.to_be_bytes();
        self.sks = Some([b0, be[0], be[1]]);
        self
    }

    /// Fixed-format sense data (SPC-4 4.5.3), 18 bytes. An INFORMATION value that does not fit
    /// in the 4-byte field is left out with VALID=0, as the standard requires.
    pub fn to_fixed(&self) -> Bytes {
        let mut b = [0u8; FIXED_LEN];
        b[0] = 0x70;
        b[2] = self.key & 0x0F;
        if let Some(info) = self.information {
            if let Ok(v) = u32::try_from(info) {
                b[0] |= 0x80;
                b[3..7].copy_from_slice(&v.to_be_bytes());
            }
        }
        b[7] = (FIXED_LEN - 8) as u8;
        b[12] = self.asc;
        b[13] = self.ascq;
        if let Some(sks) = self.sks {
            b[15..18].copy_from_slice(&sks);
        }
        Bytes::copy_from_slice(&b)
    }

    /// Descriptor-format sense data (SPC-4 4.5.2) with an information descriptor (00h) and a
    /// sense-key-specific descriptor (02h) when those fields are set.
    pub fn to_descriptor(&self) -> Bytes {
        let mut b = vec![0x72, self.key & 0x0F, self.asc, self.ascq, 0, 0, 0, 0];
        if let Some(info) = self.information {
            b.extend_from_slice(&[0x00, 0x0A, 0x80, 0x00]);
            b.extend_from_slice(&info.to_be_bytes());
        }
        if let Some(sks) = self.sks {
            b.extend_from_slice(&[0x02, 0x06, 0x00, 0x00, sks[0], sks[1], sks[2], 0x00]);
        }
        b[7] = (b.len() - 8) as u8;
        Bytes::from(b)
    }

    /// Encodes in descriptor format when `descriptor` (the D_SENSE bit of the control mode page).
    pub fn encode(&self, descriptor: bool) -> Bytes {
        if descriptor {
            self.to_descriptor()
        } else {
            self.to_fixed()
        }
    }

    /// Parses fixed (70h/71h) or descriptor (72h/73h) sense data. None if it is neither.
    pub fn parse(b: &[u8]) -> Option<Sense> {
        let code = b.first()? & 0x7F;
        match code {
            0x70 | 0x71 => {
                if b.len() < 14 {
                    return None;
                }
                let information = if b[0] & 0x80 != 0 {
                    Some(u32::from_be_bytes([b[3], b[4], b[5], b[6]]) as u64)
                } else {
                    None
                };
                let sks = match b.get(15..18) {
                    Some(s) if s[0] & 0x80 != 0 => Some([s[0], s[1], s[2]]),
                    _ => None,
                };
                Some(Sense {
                    key: b[2] & 0x0F,
                    asc: b[12],
                    ascq: b[13],
                    information,
                    sks,
                })
            }
            0x72 | 0x73 => {
                if b.len() < 8 {
                    return None;
                }
                let mut s = Sense::new(b[1] & 0x0F, (b[2], b[3]));
                let end = (8 + b[7] as usize).min(b.len());
                let mut pos = 8;
                while pos + 2 <= end {
                    let (ty, len) = (b[pos], b[pos + 1] as usize);
                    let d = b.get(pos..(pos + 2 + len).min(end))?;
                    match ty {
                        0x00 if d.len() >= 12 => {
                            let mut v = [0u8; 8];
                            v.copy_from_slice(&d[4..12]);
                            s.information = Some(u64::from_be_bytes(v));
                        }
                        0x02 if d.len() >= 7 => s.sks = Some([d[4], d[5], d[6]]),
                        _ => {}
                    }
                    pos += 2 + len;
                }
                Some(s)
            }
            _ => None,
        }
    }

    /// (ASC, ASCQ) as a pair.
    pub const fn code(&self) -> (u8, u8) {
        (self.asc, self.ascq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_layout_by_hand() {
        // LBA OUT OF RANGE with LBA 0x01020304 in INFORMATION, CDB field pointer byte 2.
        let s = Sense::new(key::ILLEGAL_REQUEST, asc::LBA_OUT_OF_RANGE)
            .with_info(0x0102_0304)
            .with_field_pointer(true, 2, None);
        let expect: [u8; 18] = [
            0xF0, 0x00, 0x05, 0x01, 0x02, 0x03, 0x04, 0x0A, 0, 0, 0, 0, 0x21, 0x00, 0x00, 0xC0,
            0x00, 0x02,
        ];
        assert_eq!(&s.to_fixed()[..], &expect[..]);
    }

    #[test]
    fn fixed_info_too_large_is_not_valid() {
        let s = Sense::new(key::MEDIUM_ERROR, asc::UNRECOVERED_READ_ERROR).with_info(1 << 40);
        let b = s.to_fixed();
        assert_eq!(b[0], 0x70);
        assert_eq!(&b[3..7], &[0, 0, 0, 0]);
        assert_eq!(b[12], 0x11);
    }

    #[test]
    fn bit_pointer() {
        let s = Sense::invalid_cdb_field(1, Some(5));
        // SKSV | C/D | BPV | bit 5
        assert_eq!(s.sks, Some([0xCD, 0x00, 0x01]));
        let p = Sense::invalid_param_field(0x0102, None);
        assert_eq!(p.sks, Some([0x80, 0x01, 0x02]));
    }

    #[test]
    fn descriptor_layout_by_hand() {
        let s = Sense::new(key::MISCOMPARE, asc::MISCOMPARE_DURING_VERIFY)
            .with_info(0x1_0000_0010)
            .with_field_pointer(false, 4, None);
        let expect: Vec<u8> = vec![
            0x72, 0x0E, 0x1D, 0x00, 0, 0, 0, 20, // header, additional length 12 + 8
            0x00, 0x0A, 0x80, 0x00, 0, 0, 0, 0x01, 0, 0, 0, 0x10, // information
            0x02, 0x06, 0x00, 0x00, 0x80, 0x00, 0x04, 0x00, // sense key specific
        ];
        assert_eq!(&s.to_descriptor()[..], &expect[..]);
        assert_eq!(Sense::parse(&expect), Some(s));
    }

    #[test]
    fn parse_round_trip_fixed() {
        let s = Sense::new(key::UNIT_ATTENTION, asc::POWER_ON_RESET);
        assert_eq!(Sense::parse(&s.to_fixed()), Some(s));
        assert_eq!(Sense::parse(&[0x00; 18]), None);
        assert_eq!(Sense::parse(&[]), None);
    }
}
