//! Sense data (SPC-4 4.5): fixed (response codes 70h/71h) and descriptor (72h/73h) formats,
//! turned into a typed [`Sense`].

use std::fmt;

/// Sense keys (SPC-4 table 48).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SenseKey {
    NoSense,
    RecoveredError,
    NotReady,
    MediumError,
    HardwareError,
    IllegalRequest,
    UnitAttention,
    DataProtect,
    BlankCheck,
    VendorSpecific,
    CopyAborted,
    AbortedCommand,
    VolumeOverflow,
    Miscompare,
    Completed,
    Reserved(u8),
}

impl SenseKey {
    /// The key a sense key value names (its low four bits), matched against the values the
    /// device server reports ([`mcsi_scsi::sense::key`]), written once.
    pub fn from_u8(v: u8) -> SenseKey {
        use mcsi_scsi::sense::key;
        match v & 0x0f {
            key::NO_SENSE => SenseKey::NoSense,
            key::RECOVERED_ERROR => SenseKey::RecoveredError,
            key::NOT_READY => SenseKey::NotReady,
            key::MEDIUM_ERROR => SenseKey::MediumError,
            key::HARDWARE_ERROR => SenseKey::HardwareError,
            key::ILLEGAL_REQUEST => SenseKey::IllegalRequest,
            key::UNIT_ATTENTION => SenseKey::UnitAttention,
            key::DATA_PROTECT => SenseKey::DataProtect,
            key::BLANK_CHECK => SenseKey::BlankCheck,
            key::VENDOR_SPECIFIC => SenseKey::VendorSpecific,
            key::COPY_ABORTED => SenseKey::CopyAborted,
            key::ABORTED_COMMAND => SenseKey::AbortedCommand,
            key::VOLUME_OVERFLOW => SenseKey::VolumeOverflow,
            key::MISCOMPARE => SenseKey::Miscompare,
            key::COMPLETED => SenseKey::Completed,
            other => SenseKey::Reserved(other),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SenseKey::NoSense => "NO SENSE",
            SenseKey::RecoveredError => "RECOVERED ERROR",
            SenseKey::NotReady => "NOT READY",
            SenseKey::MediumError => "MEDIUM ERROR",
            SenseKey::HardwareError => "HARDWARE ERROR",
            SenseKey::IllegalRequest => "ILLEGAL REQUEST",
            SenseKey::UnitAttention => "UNIT ATTENTION",
            SenseKey::DataProtect => "DATA PROTECT",
            SenseKey::BlankCheck => "BLANK CHECK",
            SenseKey::VendorSpecific => "VENDOR SPECIFIC",
            SenseKey::CopyAborted => "COPY ABORTED",
            SenseKey::AbortedCommand => "ABORTED COMMAND",
            SenseKey::VolumeOverflow => "VOLUME OVERFLOW",
            SenseKey::Miscompare => "MISCOMPARE",
            SenseKey::Completed => "COMPLETED",
            SenseKey::Reserved(_) => "RESERVED",
        }
    }
}

/// Decoded sense data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sense {
    pub key: SenseKey,
    pub asc: u8,
    pub ascq: u8,
    /// The INFORMATION field when valid (often the failing LBA).
    pub information: Option<u64>,
    /// Response code 71h/73h: deferred error.
    pub deferred: bool,
}

impl Sense {
    /// Decode sense data as carried in a SCSI Response (without the 2-byte SenseLength).
    /// Returns None for data too short or with an unknown response code.
    pub fn parse(b: &[u8]) -> Option<Sense> {
        let code = *b.first()? & 0x7f;
        match code {
            0x70 | 0x71 => {
                // Fixed format: key at byte 2, INFORMATION 3..7 valid when bit 7 of byte 0 is set,
                // ASC/ASCQ at 12/13 (present only if the additional length reaches them).
                let key = SenseKey::from_u8(*b.get(2)?);
                let info = if b[0] & 0x80 != 0 && b.len() >= 7 {
                    Some(u64::from(u32::from_be_bytes([b[3], b[4], b[5], b[6]])))
                } else {
                    None
                };
                Some(Sense {
                    key,
                    asc: b.get(12).copied().unwrap_or(0),
                    ascq: b.get(13).copied().unwrap_or(0),
                    information: info,
                    deferred: code == 0x71,
                })
            }
            0x72 | 0x73 => {
                let key = SenseKey::from_u8(*b.get(1)?);
                let asc = b.get(2).copied().unwrap_or(0);
                let ascq = b.get(3).copied().unwrap_or(0);
                // Descriptors start at byte 8; type 00h is Information (SPC-4 4.5.2.2).
                let add_len = usize::from(b.get(7).copied().unwrap_or(0));
                let end = (8 + add_len).min(b.len());
                let mut info = None;
                let mut i = 8;
                while i + 2 <= end {
                    let typ = b[i];
                    let len = usize::from(b[i + 1]);
                    if typ == 0 && len >= 0x0a && i + 12 <= end && b[i + 2] & 0x80 != 0 {
                        let mut v = [0u8; 8];
                        v.copy_from_slice(&b[i + 4..i + 12]);
                        info = Some(u64::from_be_bytes(v));
                    }
                    i += 2 + len;
                }
                Some(Sense {
                    key,
                    asc,
                    ascq,
                    information: info,
                    deferred: code == 0x73,
                })
            }
            _ => None,
        }
    }

    /// A short description of ASC/ASCQ for the codes an initiator commonly meets.
    pub fn description(&self) -> Option<&'static str> {
        Some(match (self.asc, self.ascq) {
            (0x04, 0x00) => "logical unit not ready, cause not reportable",
            (0x04, 0x01) => "logical unit is in process of becoming ready",
            (0x0c, 0x00) => "write error",
            (0x11, 0x00) => "unrecovered read error",
            (0x1a, 0x00) => "parameter list length error",
            (0x20, 0x00) => "invalid command operation code",
            (0x21, 0x00) => "logical block address out of range",
            (0x24, 0x00) => "invalid field in CDB",
            (0x25, 0x00) => "logical unit not supported",
            (0x26, 0x00) => "invalid field in parameter list",
            (0x27, 0x00) => "write protected",
            (0x28, 0x00) => "not ready to ready change, medium may have changed",
            (0x29, 0x00) => "power on, reset, or bus device reset occurred",
            (0x29, 0x01) => "power on occurred",
            (0x29, 0x03) => "bus device reset function occurred",
            (0x29, 0x07) => "I_T nexus loss occurred",
            (0x2a, 0x01) => "mode parameters changed",
            (0x2a, 0x09) => "capacity data has changed",
            (0x3a, 0x00) => "medium not present",
            (0x3f, 0x0e) => "reported LUNs data has changed",
            (0x47, 0x00) => "SCSI parity error",
            (0x47, 0x05) => "protocol service CRC error",
            (0x49, 0x00) => "invalid message error",
            (0x4b, 0x00) => "data phase error",
            (0x4e, 0x00) => "overlapped commands attempted",
            (0x55, 0x03) => "insufficient resources",
            _ => return None,
        })
    }
}

impl fmt::Display for Sense {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} asc/ascq {:02x}/{:02x}",
            self.key.name(),
            self.asc,
            self.ascq
        )?;
        if let Some(d) = self.description() {
            write!(f, " ({d})")?;
        }
        if let Some(i) = self.information {
            write!(f, ", information {i}")?;
        }
        if self.deferred {
            write!(f, ", deferred")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_format_lba_out_of_range() {
        // Fixed format, VALID bit set, ILLEGAL REQUEST, INFORMATION = 0x1000, additional length
        // 10, ASC/ASCQ 21/00 (SPC-4 4.5.3 layout).
        let b = [
            0xf0, 0, 0x05, 0, 0, 0x10, 0x00, 10, 0, 0, 0, 0, 0x21, 0x00, 0, 0, 0, 0,
        ];
        let s = Sense::parse(&b).unwrap();
        assert_eq!(s.key, SenseKey::IllegalRequest);
        assert_eq!((s.asc, s.ascq), (0x21, 0x00));
        assert_eq!(s.information, Some(0x1000));
        assert!(!s.deferred);
        assert_eq!(
            s.to_string(),
            "ILLEGAL REQUEST asc/ascq 21/00 (logical block address out of range), information 4096"
        );
    }

    #[test]
    fn descriptor_format_with_information() {
        // 72h, MEDIUM ERROR, 11/00, additional length 12, Information descriptor (type 0,
        // length 0Ah, VALID) carrying LBA 0x0102030405060708.
        let b = [
            0x72, 0x03, 0x11, 0x00, 0, 0, 0, 12, 0x00, 0x0a, 0x80, 0, 1, 2, 3, 4, 5, 6, 7, 8,
        ];
        let s = Sense::parse(&b).unwrap();
        assert_eq!(s.key, SenseKey::MediumError);
        assert_eq!((s.asc, s.ascq), (0x11, 0));
        assert_eq!(s.information, Some(0x0102030405060708));
    }

    #[test]
    fn unit_attention_short_fixed() {
        // Only 14 bytes: enough for ASC/ASCQ 29/00.
        let b = [0x70, 0, 0x06, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0x29, 0x00];
        let s = Sense::parse(&b).unwrap();
        assert_eq!(s.key, SenseKey::UnitAttention);
        assert_eq!(s.information, None);
        assert_eq!(s.asc, 0x29);
    }

    #[test]
    fn garbage_is_none() {
        assert_eq!(Sense::parse(&[]), None);
        assert_eq!(Sense::parse(&[0x12, 0, 0]), None);
        assert_eq!(Sense::parse(&[0x70, 0]), None);
    }
}
