//! CRC32C digests as iSCSI uses them (RFC 7143 section 13.1 and RFC 3720 appendix B.4).
//!
//! The digest is the standard CRC-32C (Castagnoli, reflected, init and final XOR 0xffffffff).
//! RFC 3720 B.4 lists the CRC of 32 zero bytes as the byte sequence `aa 36 91 8a`, while the
//! CRC value is 0x8a9136aa: the value goes on the wire least significant byte first. The codec
//! uses [`to_wire`] and [`from_wire`] so that this is decided in one place.

/// CRC32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// The four wire bytes of a digest value (RFC 3720 B.4 byte order).
pub fn to_wire(crc: u32) -> [u8; 4] {
    crc.to_le_bytes()
}

/// The digest value carried by four wire bytes.
pub fn from_wire(bytes: [u8; 4]) -> u32 {
    u32::from_le_bytes(bytes)
}

/// Streaming CRC32C over several pieces (for example a data segment followed by its padding).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Crc32c {
    state: u32,
}

impl Crc32c {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add `data` to the digest.
    pub fn update(&mut self, data: &[u8]) {
        self.state = crc32c::crc32c_append(self.state, data);
    }

    /// The digest of everything added so far.
    pub fn finish(&self) -> u32 {
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // RFC 3720 appendix B.4: the CRC bytes as listed there, in wire order.
    #[test]
    fn rfc3720_vectors_in_wire_order() {
        assert_eq!(to_wire(crc32c(&[0u8; 32])), [0xaa, 0x36, 0x91, 0x8a]);
        assert_eq!(to_wire(crc32c(&[0xffu8; 32])), [0x43, 0xab, 0xa8, 0x62]);
        let inc: Vec<u8> = (0u8..32).collect();
        assert_eq!(to_wire(crc32c(&inc)), [0x4e, 0x79, 0xdd, 0x46]);
        let dec: Vec<u8> = (0u8..32).rev().collect();
        assert_eq!(to_wire(crc32c(&dec)), [0x5c, 0xdb, 0x3f, 0x11]);
    }

    #[test]
    fn rfc3720_vector_values() {
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(from_wire([0xaa, 0x36, 0x91, 0x8a]), 0x8a91_36aa);
    }

    // RFC 3720 B.4 "An iSCSI - SCSI Read (10) Command PDU".
    #[test]
    fn rfc3720_read10_pdu() {
        let mut pdu = [0u8; 48];
        pdu[0] = 0x01;
        pdu[1] = 0xc0;
        pdu[16] = 0x14;
        pdu[22] = 0x04;
        pdu[27] = 0x14;
        pdu[31] = 0x18;
        pdu[32] = 0x28;
        pdu[40] = 0x02;
        assert_eq!(to_wire(crc32c(&pdu)), [0x56, 0x3a, 0x96, 0xd9]);
    }

    #[test]
    fn check_value_and_streaming() {
        // The CRC-32C catalogue check value.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        let mut c = Crc32c::new();
        c.update(b"1234");
        c.update(b"");
        c.update(b"56789");
        assert_eq!(c.finish(), 0xe306_9283);
        assert_eq!(Crc32c::new().finish(), 0);
    }
}
