//! A minimal pcap writer (microsecond timestamps, raw IP link type) for the packets the link
//! delivers.

use std::io::{self, Write};

/// LINKTYPE_RAW: each record starts with an IPv4 or IPv6 header.
const LINKTYPE_RAW: u32 = 101;

pub struct PcapWriter<W: Write> {
    out: W,
    snaplen: u32,
}

impl<W: Write> PcapWriter<W> {
    pub fn new(mut out: W, snaplen: u32) -> io::Result<Self> {
        out.write_all(&0xa1b2_c3d4u32.to_le_bytes())?;
        out.write_all(&2u16.to_le_bytes())?;
        out.write_all(&4u16.to_le_bytes())?;
        out.write_all(&0i32.to_le_bytes())?; // thiszone
        out.write_all(&0u32.to_le_bytes())?; // sigfigs
        out.write_all(&snaplen.to_le_bytes())?;
        out.write_all(&LINKTYPE_RAW.to_le_bytes())?;
        Ok(PcapWriter { out, snaplen })
    }

    /// Writes one packet seen at `unix_ns` nanoseconds since the epoch.
    pub fn write(&mut self, unix_ns: u64, pkt: &[u8]) -> io::Result<()> {
        let cap = pkt.len().min(self.snaplen as usize);
        let secs = (unix_ns / 1_000_000_000) as u32;
        let usecs = ((unix_ns % 1_000_000_000) / 1_000) as u32;
        self.out.write_all(&secs.to_le_bytes())?;
        self.out.write_all(&usecs.to_le_bytes())?;
        self.out.write_all(&(cap as u32).to_le_bytes())?;
        self.out.write_all(&(pkt.len() as u32).to_le_bytes())?;
        self.out.write_all(&pkt[..cap])
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        let mut w = PcapWriter::new(Vec::new(), 4).unwrap();
        w.write(1_500_000_123_456_789, &[0x45, 1, 2, 3, 4, 5])
            .unwrap();
        let b = w.out;
        // 24-byte global header, 16-byte record header, 4 captured bytes.
        assert_eq!(b.len(), 24 + 16 + 4);
        assert_eq!(&b[0..4], &[0xd4, 0xc3, 0xb2, 0xa1]);
        assert_eq!(u32::from_le_bytes(b[20..24].try_into().unwrap()), 101);
        assert_eq!(u32::from_le_bytes(b[24..28].try_into().unwrap()), 1_500_000);
        assert_eq!(u32::from_le_bytes(b[28..32].try_into().unwrap()), 123_456);
        assert_eq!(u32::from_le_bytes(b[32..36].try_into().unwrap()), 4);
        assert_eq!(u32::from_le_bytes(b[36..40].try_into().unwrap()), 6);
    }
}
