//! A logical unit of a session: block reads and writes, flush, unmap, inquiry, capacity
//! (SBC-3 / SPC-4 CDBs).

use crate::core::{Command, DataDir, Response};
use crate::error::Error;
use crate::session::Session;
use bytes::Bytes;

/// READ CAPACITY result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub block_size: u32,
    /// Number of logical blocks (last LBA + 1).
    pub blocks: u64,
}

impl Capacity {
    pub fn bytes(&self) -> u64 {
        self.blocks * u64::from(self.block_size)
    }
}

/// Standard INQUIRY data (SPC-4 6.6.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inquiry {
    pub peripheral_qualifier: u8,
    pub device_type: u8,
    pub vendor: String,
    pub product: String,
    pub revision: String,
}

/// What a LUN offers beyond reads and writes ([`Lun::capabilities`]). Limits are in blocks;
/// None where the LUN reports no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    pub max_transfer_blocks: Option<u32>,
    pub optimal_transfer_blocks: Option<u32>,
    pub max_unmap_blocks: Option<u32>,
    pub max_write_same_blocks: Option<u64>,
    /// UNMAP is supported (LBPU).
    pub unmap: bool,
    /// WRITE SAME (16) with the UNMAP bit is supported (LBPWS).
    pub write_same_unmap: bool,
    /// The medium is write-protected (WP).
    pub write_protected: bool,
    /// The FUA bit is honoured (DPOFUA).
    pub fua: bool,
}

/// Attempts for a command that meets UNIT ATTENTION (reported once per nexus after a reset or
/// a new session; the command itself was not executed).
const UA_RETRIES: usize = 4;

/// Handle on one LUN. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Lun {
    session: Session,
    lun: u64,
    cap: Capacity,
}

/// The blocks of `bs` bytes a write of `len` bytes covers, or an error when it is not a whole
/// number of them (a LUN's write and a volume's).
pub(crate) fn whole_blocks(len: usize, bs: u32) -> Result<u64, Error> {
    let bs = u64::from(bs);
    if !(len as u64).is_multiple_of(bs) {
        return Err(Error::InvalidArgument(format!(
            "write of {len} bytes is not a multiple of the {bs}-byte block size"
        )));
    }
    Ok(len as u64 / bs)
}

impl Session {
    /// Open a LUN: reads its capacity (clearing any pending unit attention).
    pub async fn open_lun(&self, lun: u64) -> Result<Lun, Error> {
        if lun > u64::from(u16::MAX) {
            return Err(Error::InvalidArgument(format!(
                "LUN {lun}: this initiator addresses LUNs 0 to 65535"
            )));
        }
        let cap = read_capacity(self, lun).await?;
        if cap.block_size == 0 || cap.block_size > 1 << 20 {
            return Err(Error::Protocol(format!(
                "LUN {lun} reports a block size of {} bytes",
                cap.block_size
            )));
        }
        Ok(Lun {
            session: self.clone(),
            lun,
            cap,
        })
    }
}

async fn run(session: &Session, lun: u64, cdb: Vec<u8>, dir: DataDir) -> Result<Response, Error> {
    let cmd = Command {
        lun,
        cdb: Bytes::from(cdb),
        dir,
    };
    let mut tries = 0;
    loop {
        tries += 1;
        match session.execute(cmd.clone()).await?.check() {
            Err(e) if e.is_unit_attention() && tries < UA_RETRIES => {
                tracing::debug!(lun, error = %e, "unit attention; retrying the command");
            }
            r => return r,
        }
    }
}

async fn read_capacity(session: &Session, lun: u64) -> Result<Capacity, Error> {
    // READ CAPACITY (16): SERVICE ACTION IN (16) 9Eh, service action 10h, allocation length 32.
    let mut cdb = vec![0u8; 16];
    cdb[0] = 0x9e;
    cdb[1] = 0x10;
    cdb[10..14].copy_from_slice(&32u32.to_be_bytes());
    match run(session, lun, cdb, DataDir::Read(32)).await {
        Ok(r) if r.data.len() >= 12 => {
            let d = &r.data;
            let last = u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]);
            let bs = u32::from_be_bytes([d[8], d[9], d[10], d[11]]);
            return Ok(Capacity {
                block_size: bs,
                blocks: last.saturating_add(1),
            });
        }
        Ok(r) => {
            return Err(Error::Protocol(format!(
                "READ CAPACITY (16) returned {} bytes, 12 at least are needed",
                r.data.len()
            )))
        }
        Err(Error::Scsi(_)) => {}
        Err(e) => return Err(e),
    }
    // Fall back to READ CAPACITY (10) for devices without the 16-byte form.
    let mut cdb = vec![0u8; 10];
    cdb[0] = 0x25;
    let r = run(session, lun, cdb, DataDir::Read(8)).await?;
    let d = &r.data;
    if d.len() < 8 {
        return Err(Error::Protocol(format!(
            "READ CAPACITY (10) returned {} bytes, 8 are needed",
            d.len()
        )));
    }
    let last = u32::from_be_bytes([d[0], d[1], d[2], d[3]]);
    let bs = u32::from_be_bytes([d[4], d[5], d[6], d[7]]);
    Ok(Capacity {
        block_size: bs,
        blocks: u64::from(last) + 1,
    })
}

fn rw16(op: u8, lba: u64, blocks: u32) -> Vec<u8> {
    let mut cdb = vec![0u8; 16];
    cdb[0] = op;
    cdb[2..10].copy_from_slice(&lba.to_be_bytes());
    cdb[10..14].copy_from_slice(&blocks.to_be_bytes());
    cdb
}

impl Lun {
    pub fn number(&self) -> u64 {
        self.lun
    }

    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Block size and count as read when the LUN was opened.
    pub fn geometry(&self) -> Capacity {
        self.cap
    }

    pub fn block_size(&self) -> u32 {
        self.cap.block_size
    }

    fn check_range(&self, lba: u64, blocks: u64) -> Result<(), Error> {
        match lba.checked_add(blocks) {
            Some(end) if end <= self.cap.blocks => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "blocks {lba}..{} are outside LUN {} ({} blocks of {} bytes)",
                lba.saturating_add(blocks),
                self.lun,
                self.cap.blocks,
                self.cap.block_size
            ))),
        }
    }

    fn transfer_len(&self, blocks: u64) -> Result<u32, Error> {
        blocks
            .checked_mul(u64::from(self.cap.block_size))
            .and_then(|b| u32::try_from(b).ok())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "a transfer of {blocks} blocks exceeds 4 GiB; split it"
                ))
            })
    }

    /// Read `blocks` blocks at `lba` (READ (16)). A short read (residual underflow) is an error.
    pub async fn read(&self, lba: u64, blocks: u32) -> Result<Bytes, Error> {
        self.check_range(lba, u64::from(blocks))?;
        let len = self.transfer_len(u64::from(blocks))?;
        let r = run(
            &self.session,
            self.lun,
            rw16(0x88, lba, blocks),
            DataDir::Read(len),
        )
        .await?;
        if r.data.len() != len as usize {
            return Err(Error::ShortTransfer {
                expected: u64::from(len),
                actual: r.data.len() as u64,
            });
        }
        Ok(r.data)
    }

    /// Write whole blocks at `lba` (WRITE (16)).
    pub async fn write(&self, lba: u64, data: Bytes) -> Result<(), Error> {
        self.write_fua(lba, data, false).await
    }

    /// Write whole blocks at `lba` (WRITE (16)); `fua`: the data is on the medium before the
    /// command completes (the FUA bit, SBC-3 5.40).
    pub async fn write_fua(&self, lba: u64, data: Bytes, fua: bool) -> Result<(), Error> {
        let bs = u64::from(self.cap.block_size);
        let blocks = whole_blocks(data.len(), self.cap.block_size)?;
        self.check_range(lba, blocks)?;
        self.transfer_len(blocks)?;
        let mut cdb = rw16(0x8a, lba, blocks as u32);
        if fua {
            cdb[1] |= 0x08;
        }
        let r = run(&self.session, self.lun, cdb, DataDir::Write(data)).await?;
        if let crate::task::Residual::Underflow(n) = r.residual {
            if n > 0 {
                return Err(Error::ShortTransfer {
                    expected: blocks * bs,
                    actual: (blocks * bs).saturating_sub(u64::from(n)),
                });
            }
        }
        Ok(())
    }

    /// Make written data durable (SYNCHRONIZE CACHE (10), whole medium).
    pub async fn flush(&self) -> Result<(), Error> {
        let mut cdb = vec![0u8; 10];
        cdb[0] = 0x35;
        run(&self.session, self.lun, cdb, DataDir::None).await?;
        Ok(())
    }

    /// Deallocate blocks (UNMAP, SBC-3 5.28), split into descriptors of at most 2^32-1 blocks.
    pub async fn unmap(&self, lba: u64, blocks: u64) -> Result<(), Error> {
        self.check_range(lba, blocks)?;
        if blocks == 0 {
            return Ok(());
        }
        let mut descs = Vec::new();
        let (mut at, mut left) = (lba, blocks);
        while left > 0 {
            let n = left.min(u64::from(u32::MAX));
            descs.push((at, n as u32));
            at += n;
            left -= n;
        }
        for chunk in descs.chunks(64) {
            let mut p = vec![0u8; 8 + 16 * chunk.len()];
            let dlen = (16 * chunk.len()) as u16;
            p[0..2].copy_from_slice(&(dlen + 6).to_be_bytes());
            p[2..4].copy_from_slice(&dlen.to_be_bytes());
            for (i, (l, n)) in chunk.iter().enumerate() {
                let o = 8 + 16 * i;
                p[o..o + 8].copy_from_slice(&l.to_be_bytes());
                p[o + 8..o + 12].copy_from_slice(&n.to_be_bytes());
            }
            let mut cdb = vec![0u8; 10];
            cdb[0] = 0x42;
            cdb[7..9].copy_from_slice(&(p.len() as u16).to_be_bytes());
            run(&self.session, self.lun, cdb, DataDir::Write(Bytes::from(p))).await?;
        }
        Ok(())
    }

    /// Zero `blocks` blocks at `lba` (WRITE SAME (16) with one block of zeros, in pieces of at
    /// most `max_per_command` blocks); `unmap`: the blocks may be deallocated instead (the
    /// UNMAP bit; only for LUNs that report it, see [`Lun::capabilities`]).
    pub async fn write_zeroes(
        &self,
        lba: u64,
        blocks: u64,
        unmap: bool,
        max_per_command: u64,
    ) -> Result<(), Error> {
        self.check_range(lba, blocks)?;
        let zero = Bytes::from(vec![0u8; self.cap.block_size as usize]);
        let step = max_per_command.clamp(1, u64::from(u32::MAX));
        let (mut at, mut left) = (lba, blocks);
        while left > 0 {
            let n = left.min(step);
            let mut cdb = rw16(0x93, at, n as u32);
            if unmap {
                cdb[1] |= 0x08;
            }
            run(&self.session, self.lun, cdb, DataDir::Write(zero.clone())).await?;
            at += n;
            left -= n;
        }
        Ok(())
    }

    /// What the LUN offers beyond reads and writes, from the Block Limits and Logical Block
    /// Provisioning VPD pages and the MODE SENSE header. A page the LUN does not have leaves
    /// its fields at their safe defaults (no limit known, no UNMAP, no FUA).
    pub async fn capabilities(&self) -> Result<Capabilities, Error> {
        let mut c = Capabilities::default();
        let pages = match self.vpd(0x00).await {
            Ok(d) => d.get(4..).map(<[u8]>::to_vec).unwrap_or_default(),
            Err(Error::Scsi(_)) => Vec::new(),
            Err(e) => return Err(e),
        };
        if pages.contains(&0xB0) {
            let d = self.vpd(0xB0).await?;
            let u32_at = |i: usize| {
                d.get(i..i + 4)
                    .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                    .filter(|&v| v != 0)
            };
            c.max_transfer_blocks = u32_at(8);
            c.optimal_transfer_blocks = u32_at(12);
            c.max_unmap_blocks = u32_at(20);
            c.max_write_same_blocks = d
                .get(36..44)
                .map(|b| u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
                .filter(|&v| v != 0);
        }
        if pages.contains(&0xB2) {
            let d = self.vpd(0xB2).await?;
            let flags = d.get(5).copied().unwrap_or(0);
            c.unmap = flags & 0x80 != 0;
            c.write_same_unmap = flags & 0x40 != 0;
        }
        // MODE SENSE (10), all pages, header only: the device-specific parameter (SBC-3 6.4.1).
        let mut cdb = vec![0u8; 10];
        cdb[0] = 0x5a;
        cdb[2] = 0x3f;
        cdb[7..9].copy_from_slice(&8u16.to_be_bytes());
        match run(&self.session, self.lun, cdb, DataDir::Read(8)).await {
            Ok(r) if r.data.len() >= 4 => {
                c.write_protected = r.data[3] & 0x80 != 0;
                c.fua = r.data[3] & 0x10 != 0;
            }
            Ok(_) | Err(Error::Scsi(_)) => {}
            Err(e) => return Err(e),
        }
        Ok(c)
    }

    /// The logical unit's own designators from the Device Identification VPD page (SPC-4
    /// 7.8.6, association 00b: NAA, T10 vendor ID...), as (designator type, bytes): the same
    /// through every target port that reaches the same logical unit. Empty when the LUN
    /// reports none.
    pub async fn identity(&self) -> Result<Vec<(u8, Bytes)>, Error> {
        // The whole page (its length is two bytes), so that no designator is cut off.
        let d = self.vpd_up_to(0x83, u16::MAX).await?;
        let mut out = Vec::new();
        let end = d
            .get(2..4)
            .map_or(0, |b| 4 + u16::from_be_bytes([b[0], b[1]]) as usize)
            .min(d.len());
        let mut at = 4;
        while at + 4 <= end {
            let len = d[at + 3] as usize;
            if at + 4 + len > end {
                break;
            }
            if (d[at + 1] >> 4) & 0x03 == 0 {
                out.push((d[at + 1] & 0x0F, d.slice(at + 4..at + 4 + len)));
            }
            at += 4 + len;
        }
        Ok(out)
    }

    /// One VPD page (INQUIRY with EVPD), its first 255 bytes.
    async fn vpd(&self, page: u8) -> Result<Bytes, Error> {
        self.vpd_up_to(page, 255).await
    }

    /// One VPD page, at most `alloc` bytes of it.
    async fn vpd_up_to(&self, page: u8, alloc: u16) -> Result<Bytes, Error> {
        let mut cdb = vec![0u8; 6];
        cdb[0] = 0x12;
        cdb[1] = 0x01;
        cdb[2] = page;
        cdb[3..5].copy_from_slice(&alloc.to_be_bytes());
        Ok(run(
            &self.session,
            self.lun,
            cdb,
            DataDir::Read(u32::from(alloc)),
        )
        .await?
        .data)
    }

    /// Standard INQUIRY.
    pub async fn inquiry(&self) -> Result<Inquiry, Error> {
        let mut cdb = vec![0u8; 6];
        cdb[0] = 0x12;
        cdb[3..5].copy_from_slice(&96u16.to_be_bytes());
        let r = run(&self.session, self.lun, cdb, DataDir::Read(96)).await?;
        let d = &r.data;
        if d.len() < 36 {
            return Err(Error::Protocol(format!(
                "INQUIRY returned {} bytes, 36 are needed",
                d.len()
            )));
        }
        let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
        Ok(Inquiry {
            peripheral_qualifier: d[0] >> 5,
            device_type: d[0] & 0x1f,
            vendor: text(&d[8..16]),
            product: text(&d[16..32]),
            revision: text(&d[32..36]),
        })
    }

    /// READ CAPACITY now (the size may have changed since the LUN was opened).
    pub async fn capacity(&self) -> Result<Capacity, Error> {
        read_capacity(&self.session, self.lun).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read16_cdb_layout() {
        // SBC-3 5.16: opcode 88h, LBA in bytes 2-9, transfer length in 10-13.
        let c = rw16(0x88, 0x0102_0304_0506_0708, 0x0a0b_0c0d);
        assert_eq!(
            c,
            vec![0x88, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0x0a, 0x0b, 0x0c, 0x0d, 0, 0]
        );
    }
}
