//! SAM-5 LUN encoding (SAM-5 4.6): the 8-byte LUN field as a big-endian `u64`.
//!
//! Indices below 256 use the peripheral device addressing method (bus 0), indices up to 16383
//! flat space addressing, larger ones the extended flat space format (4-byte extended address).

/// Highest index flat space addressing can carry (14 bits).
const FLAT_MAX: u16 = 0x3FFF;

/// Encodes a LUN index as the 8-byte SAM LUN (first byte in the most significant position).
pub fn encode(index: u16) -> u64 {
    let b: [u8; 8] = if index < 256 {
        // Peripheral device addressing, bus identifier 0 (SAM-5 4.6.7).
        [0x00, index as u8, 0, 0, 0, 0, 0, 0]
    } else if index <= FLAT_MAX {
        // Flat space addressing (SAM-5 4.6.8).
        [0x40 | (index >> 8) as u8, index as u8, 0, 0, 0, 0, 0, 0]
    } else {
        // Extended flat space addressing, length 01b = 4 bytes (SAM-5 4.6.10).
        [0xD2, 0x00, (index >> 8) as u8, index as u8, 0, 0, 0, 0]
    };
    u64::from_be_bytes(b)
}

/// Decodes a single-level SAM LUN to its index; None for forms this target does not use
/// (hierarchical levels, logical unit addressing, well-known LUNs).
pub fn decode(raw: u64) -> Option<u16> {
    let b = raw.to_be_bytes();
    match b[0] >> 6 {
        0b00 if b[0] == 0 && b[2..].iter().all(|&x| x == 0) => Some(b[1] as u16),
        0b01 if b[2..].iter().all(|&x| x == 0) => Some((((b[0] & 0x3F) as u16) << 8) | b[1] as u16),
        0b11 if b[0] == 0xD2 && b[4..].iter().all(|&x| x == 0) => {
            let v = u32::from_be_bytes([0, b[1], b[2], b[3]]);
            u16::try_from(v).ok()
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_hand() {
        assert_eq!(encode(0), 0);
        assert_eq!(encode(5), 0x0005_0000_0000_0000);
        assert_eq!(encode(300), 0x412C_0000_0000_0000);
        assert_eq!(encode(0x3FFF), 0x7FFF_0000_0000_0000);
        assert_eq!(encode(0x4000), 0xD200_4000_0000_0000);
        assert_eq!(decode(0x0005_0000_0000_0000), Some(5));
        assert_eq!(decode(0x412C_0000_0000_0000), Some(300));
        // Flat space may also carry small numbers.
        assert_eq!(decode(0x4001_0000_0000_0000), Some(1));
        // Second level present, bus id != 0, well-known LUN: not ours.
        assert_eq!(decode(0x0001_0002_0000_0000), None);
        assert_eq!(decode(0x0105_0000_0000_0000), None);
        assert_eq!(decode(0xC101_0000_0000_0000), None);
    }

    #[test]
    fn round_trip_all() {
        for i in 0..=u16::MAX {
            assert_eq!(decode(encode(i)), Some(i));
        }
    }
}
