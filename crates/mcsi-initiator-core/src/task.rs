//! Per-task data movement, sans-IO: how much of a write goes unsolicited, Data-Out PDUs for an
//! R2T, and reassembly of Data-In with residuals (RFC 7143 4.2.5, 11.4.5, 11.7, 11.8).

use crate::error::Error;
use crate::negotiate::SessionParams;
use bytes::{Bytes, BytesMut};
use mcsi_proto::pdu::{DataIn, DataOut, R2t, RESERVED_TAG};

/// How a write's first bytes travel without an R2T.
pub type WritePlan = mcsi_proto::data::Unsolicited;

/// RFC 7143 13.11-13.14 ([`mcsi_proto::data::unsolicited`]) with the session's parameters;
/// `max_pdu` is the target's MaxRecvDataSegmentLength on the connection that carries the
/// command.
pub fn plan_write(len: u32, p: &SessionParams, max_pdu: u32) -> WritePlan {
    mcsi_proto::data::unsolicited(
        len,
        p.first_burst_length,
        p.immediate_data,
        p.initial_r2t,
        max_pdu,
    )
}

/// Data-Out PDUs carrying `data[offset..offset + len]`, each at most `max_pdu` bytes, DataSN
/// counting from 0 and F on the last (11.7). `ttt` is 0xffffffff for unsolicited data.
/// `exp_stat_sn` is filled by the connection when the PDU goes out.
pub fn data_outs(
    lun: u64,
    itt: u32,
    ttt: u32,
    data: &Bytes,
    offset: u32,
    len: u32,
    max_pdu: u32,
) -> Vec<DataOut> {
    mcsi_proto::data::pieces(offset, len, max_pdu.max(512), u32::MAX)
        .enumerate()
        .map(|(sn, p)| DataOut {
            final_: p.final_,
            lun,
            itt,
            ttt,
            exp_stat_sn: 0,
            data_sn: sn as u32,
            buffer_offset: p.offset,
            data: data.slice(p.offset as usize..(p.offset + p.len) as usize),
        })
        .collect()
}

/// Data-Out PDUs answering an R2T for a write whose whole data is `data`, each at most
/// `max_pdu` bytes (the target's MaxRecvDataSegmentLength on the connection they go on).
pub fn answer_r2t(
    r2t: &R2t,
    lun: u64,
    data: &Bytes,
    p: &SessionParams,
    max_pdu: u32,
) -> Result<Vec<DataOut>, Error> {
    let total = data.len() as u64;
    let off = u64::from(r2t.buffer_offset);
    let len = u64::from(r2t.desired_data_transfer_length);
    if len == 0 {
        return Err(Error::Protocol(format!(
            "R2T (ITT {:#x}) asks for 0 bytes (11.8.4 requires a non-zero length)",
            r2t.itt
        )));
    }
    if off + len > total {
        return Err(Error::Protocol(format!(
            "R2T (ITT {:#x}) asks for bytes {off}..{} of a {total}-byte write",
            r2t.itt,
            off + len
        )));
    }
    if len > u64::from(p.max_burst_length) {
        return Err(Error::Protocol(format!(
            "R2T (ITT {:#x}) asks for {len} bytes, beyond MaxBurstLength {}",
            r2t.itt, p.max_burst_length
        )));
    }
    if r2t.ttt == RESERVED_TAG {
        return Err(Error::Protocol(format!(
            "R2T (ITT {:#x}) carries the reserved Target Transfer Tag",
            r2t.itt
        )));
    }
    Ok(data_outs(
        lun,
        r2t.itt,
        r2t.ttt,
        data,
        r2t.buffer_offset,
        r2t.desired_data_transfer_length,
        max_pdu,
    ))
}

/// The residual a response reported (11.4.5).
pub use mcsi_proto::data::Residual;

/// Most Data-In of one read lost and asked for again at once (ErrorRecoveryLevel 1).
pub const MAX_HOLES: usize = 1024;

/// What [`DataInAssembly::push`] did with a Data-In.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Push {
    /// The next in DataSN order.
    Taken,
    /// One lost before and asked for again (ErrorRecoveryLevel 1).
    Filled,
    /// One already taken: a retransmission that crossed another; ignored.
    Duplicate,
    /// Taken, after a gap in DataSN (ErrorRecoveryLevel 1): the Data-In from `beg_run`, so many,
    /// must be asked for again (a Data SNACK, 11.16).
    Gap { beg_run: u32, run_length: u32 },
}

/// Collects the Data-In PDUs of one read into the buffer the caller gets.
#[derive(Debug)]
pub struct DataInAssembly {
    expected: u32,
    segments: Vec<(u32, Bytes)>,
    received: u64,
    next_data_sn: u32,
    /// ErrorRecoveryLevel 1 and above: a gap or a damaged Data-In is asked for again instead of
    /// ending the connection.
    recover: bool,
    /// DataSNs lost and asked for again, not yet received.
    holes: Vec<u32>,
}

impl DataInAssembly {
    pub fn new(expected: u32) -> Self {
        DataInAssembly {
            expected,
            segments: Vec::new(),
            received: 0,
            next_data_sn: 0,
            recover: false,
            holes: Vec::new(),
        }
    }

    /// Lost Data-In are asked for again (ErrorRecoveryLevel 1 and above).
    pub fn recovering(mut self) -> Self {
        self.recover = true;
        self
    }

    /// The first DataSN still needed: the earliest lost, or the next to come (TASK REASSIGN's
    /// ExpDataSN, RFC 7143 11.5.1).
    pub fn exp_data_sn(&self) -> u32 {
        self.holes.iter().copied().fold(self.next_data_sn, |a, h| {
            if h.wrapping_sub(a) >= 1 << 31 {
                h
            } else {
                a
            }
        })
    }

    /// No Data-In asked for again is still missing.
    pub fn complete(&self) -> bool {
        self.holes.is_empty()
    }

    /// A Data-In arrived with a data digest error (its header sound, ErrorRecoveryLevel 1): the
    /// run of DataSNs to ask for again (it, and any gap before it), or None when it was asked
    /// for already.
    pub fn lost(&mut self, itt: u32, data_sn: u32) -> Result<Option<(u32, u32)>, Error> {
        if !self.recover {
            return Err(Error::Protocol(format!(
                "Data-In (ITT {itt:#x}) DataSN {data_sn} lost to a data digest error"
            )));
        }
        let d = data_sn.wrapping_sub(self.next_data_sn);
        if d >= 1 << 31 {
            // Before the next: one asked for already and lost again is asked for again; one
            // taken already needs nothing.
            return Ok(self.holes.contains(&data_sn).then_some((data_sn, 1)));
        }
        let run = (self.next_data_sn, d + 1);
        self.open_holes(itt, data_sn.wrapping_add(1))?;
        Ok(Some(run))
    }

    /// DataSNs from the next expected up to before `upto` become holes.
    fn open_holes(&mut self, itt: u32, upto: u32) -> Result<(), Error> {
        let n = upto.wrapping_sub(self.next_data_sn) as usize;
        if self.holes.len() + n > MAX_HOLES {
            return Err(Error::Protocol(format!(
                "Data-In (ITT {itt:#x}): more than {MAX_HOLES} Data-In lost"
            )));
        }
        while self.next_data_sn != upto {
            self.holes.push(self.next_data_sn);
            self.next_data_sn = self.next_data_sn.wrapping_add(1);
        }
        Ok(())
    }

    pub fn received(&self) -> u64 {
        self.received
    }

    /// Take one Data-In. DataSN must count up from 0 without gaps: at ErrorRecoveryLevel 0 a gap
    /// means a lost PDU, which only session recovery can repair (7.1.1). Data beyond the
    /// expected length is a protocol error (the target must report overflow instead, 11.7.5).
    ///
    /// At ErrorRecoveryLevel 1 ([`DataInAssembly::recovering`]) a gap is asked for again
    /// ([`Push::Gap`]), a Data-In asked for again fills its hole, and one taken already is
    /// ignored.
    pub fn push(&mut self, d: &DataIn) -> Result<Push, Error> {
        let mut how = Push::Taken;
        if d.data_sn != self.next_data_sn {
            let ahead = d.data_sn.wrapping_sub(self.next_data_sn);
            if !self.recover {
                return Err(Error::Protocol(format!(
                    "Data-In (ITT {:#x}) DataSN {} where {} was expected",
                    d.itt, d.data_sn, self.next_data_sn
                )));
            }
            if ahead >= 1 << 31 {
                match self.holes.iter().position(|h| *h == d.data_sn) {
                    Some(i) => {
                        self.holes.swap_remove(i);
                        how = Push::Filled;
                    }
                    None => return Ok(Push::Duplicate),
                }
            } else {
                how = Push::Gap {
                    beg_run: self.next_data_sn,
                    run_length: ahead,
                };
                self.open_holes(d.itt, d.data_sn)?;
            }
        }
        if how != Push::Filled {
            self.next_data_sn = self.next_data_sn.wrapping_add(1);
        }
        let end = u64::from(d.buffer_offset) + d.data.len() as u64;
        if end > u64::from(self.expected) {
            return Err(Error::Protocol(format!(
                "Data-In (ITT {:#x}) carries bytes {}..{end} of a {}-byte read",
                d.itt, d.buffer_offset, self.expected
            )));
        }
        if !d.data.is_empty() {
            self.received += d.data.len() as u64;
            self.segments.push((d.buffer_offset, d.data.clone()));
        }
        Ok(how)
    }

    /// The data once the status arrived. The Data-In PDUs must cover `[0, n)` exactly once,
    /// where n is the expected length less an underflow residual.
    pub fn finish(mut self, residual: Residual) -> Result<Bytes, Error> {
        let transferred = match residual {
            Residual::Underflow(r) => u64::from(self.expected.saturating_sub(r)),
            _ => u64::from(self.expected),
        };
        if self.received != transferred {
            return Err(Error::Protocol(format!(
                "Data-In carried {} bytes but the status implies {transferred} (expected {}, {:?})",
                self.received, self.expected, residual
            )));
        }
        self.segments.sort_by_key(|s| s.0);
        let mut at = 0u64;
        for (off, b) in &self.segments {
            if u64::from(*off) != at {
                return Err(Error::Protocol(format!(
                    "Data-In segments leave a gap or overlap at offset {at} (next starts at {off})"
                )));
            }
            at += b.len() as u64;
        }
        match self.segments.len() {
            0 => Ok(Bytes::new()),
            1 => Ok(self.segments.pop().map(|s| s.1).unwrap_or_default()),
            _ => {
                let mut out = BytesMut::with_capacity(transferred as usize);
                for (_, b) in &self.segments {
                    out.extend_from_slice(b);
                }
                Ok(out.freeze())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SessionParams {
        SessionParams {
            session: mcsi_proto::keys::SessionParams {
                first_burst_length: 65536,
                max_burst_length: 262144,
                immediate_data: true,
                initial_r2t: false,
                ..Default::default()
            },
            target_max_recv_dsl: 8192,
            ..SessionParams::default()
        }
    }

    #[test]
    fn plan_write_follows_the_four_combinations() {
        let mut p = params();
        // ImmediateData=Yes, InitialR2T=No: 8192 immediate (one PDU), up to 64 KiB unsolicited.
        assert_eq!(
            plan_write(1 << 20, &p, p.target_max_recv_dsl),
            WritePlan {
                immediate: 8192,
                unsolicited_end: 65536
            }
        );
        // A write smaller than one PDU goes entirely immediate, no Data-Out.
        let small = plan_write(4096, &p, p.target_max_recv_dsl);
        assert_eq!(small.immediate, 4096);
        assert!(!small.has_data_out());
        p.initial_r2t = true;
        assert_eq!(
            plan_write(1 << 20, &p, p.target_max_recv_dsl),
            WritePlan {
                immediate: 8192,
                unsolicited_end: 8192
            }
        );
        p.immediate_data = false;
        assert_eq!(
            plan_write(1 << 20, &p, p.target_max_recv_dsl),
            WritePlan {
                immediate: 0,
                unsolicited_end: 0
            }
        );
        p.initial_r2t = false;
        assert_eq!(
            plan_write(1 << 20, &p, p.target_max_recv_dsl),
            WritePlan {
                immediate: 0,
                unsolicited_end: 65536
            }
        );
        // FirstBurstLength below MaxRecvDataSegmentLength caps immediate data too.
        p.immediate_data = true;
        p.first_burst_length = 4096;
        assert_eq!(
            plan_write(1 << 20, &p, p.target_max_recv_dsl).immediate,
            4096
        );
    }

    #[test]
    fn r2t_split_into_pdus() {
        let p = params();
        let data = Bytes::from((0..65536u32).map(|i| i as u8).collect::<Vec<u8>>());
        let r2t = R2t {
            lun: 0,
            itt: 7,
            ttt: 0x55,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            r2t_sn: 0,
            buffer_offset: 10000,
            desired_data_transfer_length: 20000,
        };
        let v = answer_r2t(&r2t, 3, &data, &p, p.target_max_recv_dsl).unwrap();
        // 20000 = 8192 + 8192 + 3616.
        let lens: Vec<usize> = v.iter().map(|d| d.data.len()).collect();
        assert_eq!(lens, vec![8192, 8192, 3616]);
        let offs: Vec<u32> = v.iter().map(|d| d.buffer_offset).collect();
        assert_eq!(offs, vec![10000, 18192, 26384]);
        let sns: Vec<u32> = v.iter().map(|d| d.data_sn).collect();
        assert_eq!(sns, vec![0, 1, 2]);
        let fin: Vec<bool> = v.iter().map(|d| d.final_).collect();
        assert_eq!(fin, vec![false, false, true]);
        assert!(v.iter().all(|d| d.ttt == 0x55 && d.itt == 7 && d.lun == 3));
        assert_eq!(v[1].data[0], (18192u32 % 256) as u8);
    }

    #[test]
    fn r2t_out_of_bounds_is_a_protocol_error() {
        let p = params();
        let data = Bytes::from(vec![0u8; 4096]);
        let mut r2t = R2t {
            lun: 0,
            itt: 1,
            ttt: 2,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            r2t_sn: 0,
            buffer_offset: 2048,
            desired_data_transfer_length: 4096,
        };
        assert!(matches!(
            answer_r2t(&r2t, 0, &data, &p, p.target_max_recv_dsl),
            Err(Error::Protocol(_))
        ));
        r2t.buffer_offset = 0;
        r2t.desired_data_transfer_length = 0;
        assert!(answer_r2t(&r2t, 0, &data, &p, p.target_max_recv_dsl).is_err());
        r2t.desired_data_transfer_length = 4096;
        r2t.ttt = RESERVED_TAG;
        assert!(answer_r2t(&r2t, 0, &data, &p, p.target_max_recv_dsl).is_err());
    }

    fn din(sn: u32, off: u32, data: &[u8]) -> DataIn {
        DataIn {
            final_: false,
            ack: false,
            overflow: false,
            underflow: false,
            status: None,
            lun: 0,
            itt: 9,
            ttt: RESERVED_TAG,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            data_sn: sn,
            buffer_offset: off,
            residual_count: 0,
            data: Bytes::copy_from_slice(data),
        }
    }

    #[test]
    fn reassembles_in_order() {
        let mut a = DataInAssembly::new(10);
        a.push(&din(0, 0, b"0123")).unwrap();
        a.push(&din(1, 4, b"456")).unwrap();
        a.push(&din(2, 7, b"789")).unwrap();
        assert_eq!(&a.finish(Residual::None).unwrap()[..], b"0123456789");
    }

    #[test]
    fn underflow_residual_shortens_the_data() {
        // 10 expected, target had 6: residual 4.
        let mut a = DataInAssembly::new(10);
        a.push(&din(0, 0, b"abcdef")).unwrap();
        assert_eq!(&a.finish(Residual::Underflow(4)).unwrap()[..], b"abcdef");
        // Same data but no residual reported: the target lied about the length.
        let mut a = DataInAssembly::new(10);
        a.push(&din(0, 0, b"abcdef")).unwrap();
        assert!(a.finish(Residual::None).is_err());
    }

    #[test]
    fn gaps_overlaps_and_overruns_are_caught() {
        let mut a = DataInAssembly::new(8);
        a.push(&din(0, 0, b"abcd")).unwrap();
        // DataSN gap.
        assert!(a.push(&din(2, 4, b"efgh")).is_err());
        // Beyond the expected length.
        let mut a = DataInAssembly::new(8);
        assert!(a.push(&din(0, 6, b"xyz")).is_err());
        // Right total, but an overlap leaves a hole.
        let mut a = DataInAssembly::new(8);
        a.push(&din(0, 0, b"abcd")).unwrap();
        a.push(&din(1, 2, b"efgh")).unwrap();
        assert!(a.finish(Residual::Underflow(0)).is_err());
    }

    #[test]
    fn at_level_1_lost_and_missing_data_in_is_asked_for_and_fills_in() {
        let mut a = DataInAssembly::new(16).recovering();
        assert_eq!(a.push(&din(0, 0, b"abcd")), Ok(Push::Taken));
        // DataSN 1 damaged: asked for alone.
        assert_eq!(a.lost(9, 1), Ok(Some((1, 1))));
        assert!(!a.complete());
        // DataSN 3 arrives after 2 never came: 2 is asked for.
        assert_eq!(
            a.push(&din(3, 12, b"mnop")),
            Ok(Push::Gap {
                beg_run: 2,
                run_length: 1
            })
        );
        // Lost again when it came again: asked for again; one taken already needs nothing.
        assert_eq!(a.lost(9, 1), Ok(Some((1, 1))));
        assert_eq!(a.lost(9, 0), Ok(None));
        assert_eq!(a.push(&din(1, 4, b"efgh")), Ok(Push::Filled));
        assert_eq!(a.push(&din(1, 4, b"efgh")), Ok(Push::Duplicate));
        assert_eq!(a.push(&din(2, 8, b"ijkl")), Ok(Push::Filled));
        assert!(a.complete());
        assert_eq!(&a.finish(Residual::None).unwrap()[..], b"abcdefghijklmnop");
        // At level 0 a loss is an error.
        let mut a = DataInAssembly::new(16);
        assert!(a.lost(9, 0).is_err());
        // The holes are bounded.
        let mut a = DataInAssembly::new(16).recovering();
        assert!(a.lost(9, MAX_HOLES as u32 + 5).is_err());
    }

    #[test]
    fn single_segment_is_not_copied() {
        let mut a = DataInAssembly::new(4);
        let d = din(0, 0, b"wxyz");
        let ptr = d.data.as_ptr();
        a.push(&d).unwrap();
        let out = a.finish(Residual::None).unwrap();
        assert_eq!(out.as_ptr(), ptr);
    }
}
