//! Data-Out bookkeeping for one write task (RFC 7143 sections 4.2.5.2, 11.7 and 11.8): immediate
//! data, the unsolicited burst up to FirstBurstLength, and R2Ts for the rest, each at most
//! MaxBurstLength, at most MaxOutstandingR2T at a time. Plain data, no I/O.
//!
//! mcsi negotiates DataPDUInOrder=Yes and DataSequenceInOrder=Yes (both "OR" keys, so offering
//! Yes settles them), so every sequence must arrive with increasing offsets and DataSN from 0.

/// The negotiated values that shape a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BurstParams {
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub first_burst_length: u32,
    pub max_burst_length: u32,
    pub max_outstanding_r2t: u32,
}

impl From<&mcsi_proto::keys::SessionParams> for BurstParams {
    /// The negotiated session's values (MaxOutstandingR2T at least 1).
    fn from(p: &mcsi_proto::keys::SessionParams) -> Self {
        BurstParams {
            initial_r2t: p.initial_r2t,
            immediate_data: p.immediate_data,
            first_burst_length: p.first_burst_length,
            max_burst_length: p.max_burst_length,
            max_outstanding_r2t: u32::from(p.max_outstanding_r2t.max(1)),
        }
    }
}

/// A Data-Out or command that breaks the rules of the data transfer. At ErrorRecoveryLevel 0 the
/// caller ends the connection (RFC 7143 section 7.1.4.1: a sequence error cannot be recovered).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    #[error("immediate data sent although ImmediateData=No")]
    ImmediateDataNotAllowed,
    #[error("unsolicited data announced (F=0) although InitialR2T=Yes")]
    UnsolicitedNotAllowed,
    #[error(
        "unsolicited data of {got} bytes exceeds {limit} (FirstBurstLength / expected length)"
    )]
    TooMuchUnsolicited { got: u64, limit: u32 },
    #[error("unsolicited Data-Out after the unsolicited burst ended")]
    NoUnsolicitedBurst,
    #[error("Data-Out for unknown Target Transfer Tag {0:#010x}")]
    UnknownTtt(u32),
    #[error("Data-Out DataSN {got}, expected {expected}")]
    DataSn { expected: u32, got: u32 },
    #[error("Data-Out BufferOffset {got}, expected {expected}")]
    Offset { expected: u32, got: u32 },
    #[error("Data-Out of {len} bytes at offset {offset} goes past the end of its burst ({end})")]
    BeyondBurst { offset: u32, len: u32, end: u32 },
    #[error("Data-Out sequence ended (F bit) after {got} of {len} bytes")]
    ShortSequence { got: u32, len: u32 },
}

/// One R2T to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct R2tPlan {
    pub ttt: u32,
    pub r2t_sn: u32,
    pub offset: u32,
    pub len: u32,
}

impl R2tPlan {
    /// The R2T PDU (11.8) for task `itt` on `lun`; sequence numbers are stamped when it is sent.
    pub fn pdu(&self, lun: u64, itt: u32) -> mcsi_proto::pdu::Pdu {
        mcsi_proto::pdu::Pdu::R2t(mcsi_proto::pdu::R2t {
            lun,
            itt,
            ttt: self.ttt,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            r2t_sn: self.r2t_sn,
            buffer_offset: self.offset,
            desired_data_transfer_length: self.len,
        })
    }
}

/// Bytes of an accepted Data-Out payload to keep: `data[..len]` goes to buffer offset `offset`.
/// Payload beyond what the command needs is dropped (residual underflow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accept {
    pub offset: u32,
    pub len: u32,
}

#[derive(Debug, Clone, Copy)]
struct Seq {
    next_offset: u32,
    next_data_sn: u32,
    end: u32,
}

#[derive(Debug, Clone, Copy)]
struct Solicited {
    ttt: u32,
    start: u32,
    seq: Seq,
}

/// The data-out state of one task.
#[derive(Debug)]
pub struct WriteTransfer {
    params: BurstParams,
    /// Bytes the command keeps: min(ExpectedDataTransferLength, what the CDB needs).
    want: u32,
    unsolicited: Option<Seq>,
    /// Where the unsolicited data ended; R2Ts ask for [solicit_from, want).
    solicit_from: u32,
    next_r2t_offset: u32,
    next_r2t_sn: u32,
    outstanding: Vec<Solicited>,
    /// Ranges whose data was lost to a digest error (ErrorRecoveryLevel 1 and above), in
    /// arrival order, not yet asked for again; recovery R2Ts ask for them first (7.8).
    lost: Vec<(u32, u32)>,
    /// Recovery R2Ts sent.
    recovered: u32,
}

impl WriteTransfer {
    /// Starts the transfer of a command with ExpectedDataTransferLength `edtl` of which `want`
    /// bytes are needed, carrying `immediate_len` bytes of immediate data and the F bit `final_`.
    pub fn new(
        params: BurstParams,
        edtl: u32,
        want: u32,
        immediate_len: u32,
        final_: bool,
    ) -> Result<Self, TransferError> {
        let unsolicited_limit =
            mcsi_proto::data::unsolicited_limit(edtl, params.first_burst_length);
        if immediate_len > 0 && !params.immediate_data {
            return Err(TransferError::ImmediateDataNotAllowed);
        }
        if immediate_len > unsolicited_limit {
            return Err(TransferError::TooMuchUnsolicited {
                got: immediate_len.into(),
                limit: unsolicited_limit,
            });
        }
        let unsolicited = if final_ || edtl == 0 {
            None
        } else {
            if params.initial_r2t {
                return Err(TransferError::UnsolicitedNotAllowed);
            }
            Some(Seq {
                next_offset: immediate_len,
                next_data_sn: 0,
                end: unsolicited_limit,
            })
        };
        Ok(WriteTransfer {
            params,
            want: want.min(edtl),
            unsolicited,
            solicit_from: immediate_len,
            next_r2t_offset: immediate_len,
            next_r2t_sn: 0,
            outstanding: Vec::new(),
            lost: Vec::new(),
            recovered: 0,
        })
    }

    /// Bytes the command keeps.
    pub fn want(&self) -> u32 {
        self.want
    }

    /// The part of the immediate data to keep.
    pub fn accept_immediate(&self, len: u32) -> Accept {
        Accept {
            offset: 0,
            len: len.min(self.want),
        }
    }

    /// Checks one Data-Out and says which of its bytes to keep.
    pub fn on_data_out(
        &mut self,
        ttt: u32,
        data_sn: u32,
        offset: u32,
        len: u32,
        final_: bool,
    ) -> Result<Accept, TransferError> {
        self.advance(ttt, data_sn, offset, len, final_)
    }

    /// A Data-Out whose data was lost to a digest error (its header was sound): its sequence
    /// goes on as if it had come, and what the command needs of its range is asked for again
    /// by a recovery R2T once no sequence that could still carry it is open (RFC 7143 7.8 a).
    pub fn on_lost_data_out(
        &mut self,
        ttt: u32,
        data_sn: u32,
        offset: u32,
        len: u32,
        final_: bool,
    ) -> Result<(), TransferError> {
        let a = self.advance(ttt, data_sn, offset, len, final_)?;
        self.mark_lost(a.offset, a.len);
        Ok(())
    }

    /// `len` bytes from `offset` were lost (immediate data with a digest error, or a Data-Out's
    /// through [`WriteTransfer::on_lost_data_out`]): what the command needs of them is asked
    /// for again.
    pub fn mark_lost(&mut self, offset: u32, len: u32) {
        let end = offset.saturating_add(len).min(self.want);
        if offset < end {
            self.lost.push((offset, end));
        }
    }

    /// Recovery R2Ts sent so far.
    pub fn recovered(&self) -> u32 {
        self.recovered
    }

    /// The connection that carried the write failed (ErrorRecoveryLevel 2): no open sequence
    /// will bring more. What the R2Ts sent asked for and did not get is asked for again, and an
    /// unsolicited burst under way ends where it got to (R2Ts ask for the rest), once the task
    /// has moved to another connection.
    pub fn reopen(&mut self) {
        for s in std::mem::take(&mut self.outstanding) {
            let len = s.seq.end.saturating_sub(s.seq.next_offset);
            self.mark_lost(s.seq.next_offset, len);
        }
        if let Some(u) = self.unsolicited.take() {
            self.solicit_from = u.next_offset;
            self.next_r2t_offset = self.next_r2t_offset.max(u.next_offset);
        }
    }

    fn advance(
        &mut self,
        ttt: u32,
        data_sn: u32,
        offset: u32,
        len: u32,
        final_: bool,
    ) -> Result<Accept, TransferError> {
        let seq = if ttt == mcsi_proto::pdu::RESERVED_TAG {
            self.unsolicited
                .as_mut()
                .ok_or(TransferError::NoUnsolicitedBurst)?
        } else {
            &mut self
                .outstanding
                .iter_mut()
                .find(|s| s.ttt == ttt)
                .ok_or(TransferError::UnknownTtt(ttt))?
                .seq
        };
        if data_sn != seq.next_data_sn {
            return Err(TransferError::DataSn {
                expected: seq.next_data_sn,
                got: data_sn,
            });
        }
        if offset != seq.next_offset {
            return Err(TransferError::Offset {
                expected: seq.next_offset,
                got: offset,
            });
        }
        let end = u64::from(offset) + u64::from(len);
        if end > u64::from(seq.end) {
            return Err(TransferError::BeyondBurst {
                offset,
                len,
                end: seq.end,
            });
        }
        let end = end as u32;
        seq.next_offset = end;
        seq.next_data_sn = seq.next_data_sn.wrapping_add(1);
        let seq_end = seq.end;
        if ttt == mcsi_proto::pdu::RESERVED_TAG {
            if final_ {
                // The unsolicited burst may end early; R2Ts ask for the rest (4.2.5.2).
                self.solicit_from = end;
                self.next_r2t_offset = end;
                self.unsolicited = None;
            }
        } else if final_ || end == seq_end {
            if end != seq_end {
                return Err(TransferError::ShortSequence {
                    got: end - self.start_of(ttt),
                    len: seq_end - self.start_of(ttt),
                });
            }
            self.outstanding.retain(|s| s.ttt != ttt);
        }
        let keep_end = end.min(self.want);
        let len_kept = keep_end.saturating_sub(offset);
        Ok(Accept {
            offset,
            len: len_kept,
        })
    }

    fn start_of(&self, ttt: u32) -> u32 {
        self.outstanding
            .iter()
            .find(|s| s.ttt == ttt)
            .map(|s| s.start)
            .unwrap_or(0)
    }

    /// R2Ts to send now: once the unsolicited burst is over, as many as MaxOutstandingR2T allows
    /// for the bytes not yet asked for, each at most MaxBurstLength (4.2.5.2, 11.8).
    pub fn next_r2ts(&mut self, alloc_ttt: impl FnMut() -> u32) -> Vec<R2tPlan> {
        self.next_r2ts_upto(usize::MAX, u32::MAX, alloc_ttt)
    }

    /// Like [`WriteTransfer::next_r2ts`], at most `limit` of them, each for at most `max_len`
    /// bytes (a paced session asks one at a time, no more than its bucket's burst).
    pub fn next_r2ts_upto(
        &mut self,
        limit: usize,
        max_len: u32,
        mut alloc_ttt: impl FnMut() -> u32,
    ) -> Vec<R2tPlan> {
        let mut out = Vec::new();
        if self.unsolicited.is_some() {
            return out;
        }
        let max_burst = self.params.max_burst_length.min(max_len).max(1);
        // Lost data first: each range in R2Ts of at most MaxBurstLength (recovery R2Ts, new
        // TTT and R2TSN, 11.8), once the sequence that lost it has ended (as LIO does: the rest
        // of that sequence is still on its way).
        while out.len() < limit
            && (self.outstanding.len() as u32) < self.params.max_outstanding_r2t.max(1)
        {
            let open = |&(o, e): &(u32, u32)| {
                self.outstanding
                    .iter()
                    .any(|s| s.start < e && o < s.seq.end)
            };
            let Some(i) = self.lost.iter().position(|r| !open(r)) else {
                break;
            };
            let (offset, end) = self.lost[i];
            let len = (end - offset).min(max_burst);
            if offset + len == end {
                self.lost.remove(i);
            } else {
                self.lost[i].0 = offset + len;
            }
            out.push(self.solicit(alloc_ttt(), offset, len));
            self.recovered += 1;
        }
        while out.len() < limit
            && (self.outstanding.len() as u32) < self.params.max_outstanding_r2t.max(1)
            && self.next_r2t_offset < self.want
        {
            let offset = self.next_r2t_offset;
            let len = (self.want - offset).min(max_burst);
            self.next_r2t_offset = offset + len;
            out.push(self.solicit(alloc_ttt(), offset, len));
        }
        out
    }

    /// Whether the initiator owes data now: its unsolicited burst is open, or an R2T asked
    /// for data that has not all come.
    pub fn owed(&self) -> bool {
        self.unsolicited.is_some() || !self.outstanding.is_empty()
    }

    /// The target transfer tags of the R2Ts whose data has not all come.
    pub fn open_ttts(&self) -> impl Iterator<Item = u32> + '_ {
        self.outstanding.iter().map(|s| s.ttt)
    }

    /// Whether [`WriteTransfer::next_r2ts`] would give an R2T now.
    pub fn can_solicit(&self) -> bool {
        if self.unsolicited.is_some()
            || self.outstanding.len() as u32 >= self.params.max_outstanding_r2t.max(1)
        {
            return false;
        }
        let open = |&(o, e): &(u32, u32)| {
            self.outstanding
                .iter()
                .any(|s| s.start < e && o < s.seq.end)
        };
        self.next_r2t_offset < self.want || self.lost.iter().any(|r| !open(r))
    }

    /// An R2T for `len` bytes at `offset`, its sequence opened.
    fn solicit(&mut self, ttt: u32, offset: u32, len: u32) -> R2tPlan {
        let plan = R2tPlan {
            ttt,
            r2t_sn: self.next_r2t_sn,
            offset,
            len,
        };
        self.next_r2t_sn = self.next_r2t_sn.wrapping_add(1);
        self.outstanding.push(Solicited {
            ttt,
            start: offset,
            seq: Seq {
                next_offset: offset,
                next_data_sn: 0,
                end: offset + len,
            },
        });
        plan
    }

    /// Some of the data the command needs must be asked for with R2Ts (now, or once the
    /// unsolicited burst under way ends).
    pub fn solicits(&self) -> bool {
        let unasked_end = match &self.unsolicited {
            Some(s) => s.end,
            None => self.solicit_from,
        };
        self.next_r2t_offset.max(unasked_end) < self.want
            || !self.outstanding.is_empty()
            || !self.lost.is_empty()
    }

    /// The unsolicited burst is still arriving (its last PDU, with the F bit, has not come).
    pub fn unsolicited_open(&self) -> bool {
        self.unsolicited.is_some()
    }

    /// The bytes the command keeps of what the initiator may send unasked: its immediate data
    /// and unsolicited burst, within the command's need.
    pub fn unsolicited_len(&self) -> u32 {
        let end = self
            .unsolicited
            .as_ref()
            .map_or(self.solicit_from, |s| s.end);
        end.min(self.want)
    }

    /// All data the command needs has arrived and no sequence is open.
    pub fn done(&self) -> bool {
        self.unsolicited.is_none()
            && self.outstanding.is_empty()
            && self.lost.is_empty()
            && self.next_r2t_offset.max(self.solicit_from) >= self.want
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_r2t_pdu_carries_its_plan() {
        let plan = R2tPlan {
            ttt: 7,
            r2t_sn: 2,
            offset: 8192,
            len: 4096,
        };
        let mcsi_proto::pdu::Pdu::R2t(r) = plan.pdu(1, 0x10) else {
            panic!("an R2T")
        };
        assert_eq!(
            (
                r.lun,
                r.itt,
                r.ttt,
                r.r2t_sn,
                r.buffer_offset,
                r.desired_data_transfer_length
            ),
            (1, 0x10, 7, 2, 8192, 4096)
        );
    }
    use mcsi_proto::pdu::RESERVED_TAG;

    fn params(initial_r2t: bool) -> BurstParams {
        BurstParams {
            initial_r2t,
            immediate_data: true,
            first_burst_length: 8192,
            max_burst_length: 16384,
            max_outstanding_r2t: 2,
        }
    }

    fn ttts() -> impl FnMut() -> u32 {
        let mut n = 100;
        move || {
            n += 1;
            n
        }
    }

    #[test]
    fn immediate_plus_unsolicited_plus_r2ts() {
        // 64 KiB write: 4 KiB immediate, 4 KiB unsolicited Data-Out, 56 KiB by R2T.
        let mut t = WriteTransfer::new(params(false), 65536, 65536, 4096, false).unwrap();
        let mut alloc = ttts();
        assert!(
            t.next_r2ts(&mut alloc).is_empty(),
            "no R2T during the unsolicited burst"
        );
        let a = t.on_data_out(RESERVED_TAG, 0, 4096, 4096, true).unwrap();
        assert_eq!(
            a,
            Accept {
                offset: 4096,
                len: 4096
            }
        );
        let r = t.next_r2ts(&mut alloc);
        // 57344 left: one R2T of 16384 at 8192, one at 24576 (MaxOutstandingR2T = 2).
        assert_eq!(
            r,
            vec![
                R2tPlan {
                    ttt: 101,
                    r2t_sn: 0,
                    offset: 8192,
                    len: 16384
                },
                R2tPlan {
                    ttt: 102,
                    r2t_sn: 1,
                    offset: 24576,
                    len: 16384
                },
            ]
        );
        t.on_data_out(101, 0, 8192, 8192, false).unwrap();
        t.on_data_out(101, 1, 16384, 8192, true).unwrap();
        let r = t.next_r2ts(&mut alloc);
        assert_eq!(
            r,
            vec![R2tPlan {
                ttt: 103,
                r2t_sn: 2,
                offset: 40960,
                len: 16384
            }]
        );
        t.on_data_out(102, 0, 24576, 16384, true).unwrap();
        let r = t.next_r2ts(&mut alloc);
        // The last 8192 bytes.
        assert_eq!(
            r,
            vec![R2tPlan {
                ttt: 104,
                r2t_sn: 3,
                offset: 57344,
                len: 8192
            }]
        );
        assert!(!t.done());
        t.on_data_out(103, 0, 40960, 16384, true).unwrap();
        t.on_data_out(104, 0, 57344, 8192, true).unwrap();
        assert!(t.done());
    }

    #[test]
    fn initial_r2t_forbids_unsolicited_data_out() {
        assert_eq!(
            WriteTransfer::new(params(true), 4096, 4096, 0, false).unwrap_err(),
            TransferError::UnsolicitedNotAllowed
        );
        let mut t = WriteTransfer::new(params(true), 4096, 4096, 0, true).unwrap();
        assert_eq!(
            t.on_data_out(RESERVED_TAG, 0, 0, 512, true).unwrap_err(),
            TransferError::NoUnsolicitedBurst
        );
    }

    #[test]
    fn data_sn_and_offset_are_checked() {
        let mut t = WriteTransfer::new(params(true), 1024, 1024, 0, true).unwrap();
        let r = t.next_r2ts(ttts());
        assert_eq!(r.len(), 1);
        let ttt = r[0].ttt;
        t.on_data_out(ttt, 0, 0, 512, false).unwrap();
        assert_eq!(
            t.on_data_out(ttt, 0, 512, 512, true).unwrap_err(),
            TransferError::DataSn {
                expected: 1,
                got: 0
            }
        );
        assert_eq!(
            t.on_data_out(ttt, 1, 0, 512, true).unwrap_err(),
            TransferError::Offset {
                expected: 512,
                got: 0
            }
        );
        assert_eq!(
            t.on_data_out(ttt, 1, 512, 1024, true).unwrap_err(),
            TransferError::BeyondBurst {
                offset: 512,
                len: 1024,
                end: 1024
            }
        );
        assert_eq!(
            t.on_data_out(7, 1, 512, 512, true).unwrap_err(),
            TransferError::UnknownTtt(7)
        );
    }

    #[test]
    fn expected_length_beyond_need_keeps_only_the_need() {
        // EDTL 10000 for a one-block write: 512 kept, only 512 solicited.
        let mut t = WriteTransfer::new(params(true), 10000, 512, 0, true).unwrap();
        let r = t.next_r2ts(ttts());
        assert_eq!(
            r,
            vec![R2tPlan {
                ttt: 101,
                r2t_sn: 0,
                offset: 0,
                len: 512
            }]
        );
        // Immediate data longer than the need is cut.
        let t2 = WriteTransfer::new(params(false), 10000, 512, 4096, true).unwrap();
        assert_eq!(t2.accept_immediate(4096).len, 512);
        assert!(t2.done());
    }

    #[test]
    fn unsolicited_limit_is_first_burst() {
        assert_eq!(
            WriteTransfer::new(params(false), 65536, 65536, 8193, false).unwrap_err(),
            TransferError::TooMuchUnsolicited {
                got: 8193,
                limit: 8192
            }
        );
        let mut t = WriteTransfer::new(params(false), 65536, 65536, 0, false).unwrap();
        t.on_data_out(RESERVED_TAG, 0, 0, 8192, false).unwrap();
        assert!(matches!(
            t.on_data_out(RESERVED_TAG, 1, 8192, 512, true),
            Err(TransferError::BeyondBurst { .. })
        ));
    }

    #[test]
    fn lost_data_is_asked_for_again_once_its_sequence_ends() {
        // 4 KiB immediate (lost), then the unsolicited burst to FirstBurstLength (8 KiB) in two
        // 2 KiB PDUs, the second lost; 24 KiB more by R2T.
        let mut t = WriteTransfer::new(params(false), 32768, 32768, 4096, false).unwrap();
        t.mark_lost(0, 4096);
        t.on_data_out(RESERVED_TAG, 0, 4096, 2048, false).unwrap();
        // Nothing is asked for while the unsolicited burst is open.
        assert!(t.next_r2ts(ttts()).is_empty());
        // A lost PDU still advances its sequence: a wrong DataSN is an error all the same.
        assert!(t
            .on_lost_data_out(RESERVED_TAG, 5, 6144, 2048, true)
            .is_err());
        t.on_lost_data_out(RESERVED_TAG, 1, 6144, 2048, true)
            .unwrap();
        let r = t.next_r2ts(ttts());
        // Recovery first (the immediate data, the lost PDU), within MaxOutstandingR2T 2.
        let spans = |r: &[R2tPlan]| {
            r.iter()
                .map(|p| (p.r2t_sn, p.offset, p.len))
                .collect::<Vec<_>>()
        };
        assert_eq!(spans(&r), [(0, 0, 4096), (1, 6144, 2048)]);
        assert_eq!(t.recovered(), 2);
        assert!(!t.done());
        t.on_data_out(r[0].ttt, 0, 0, 4096, true).unwrap();
        t.on_data_out(r[1].ttt, 0, 6144, 2048, true).unwrap();
        // Then the rest, in bursts of at most 16 KiB.
        let r = t.next_r2ts(ttts());
        assert_eq!(spans(&r), [(2, 8192, 16384), (3, 24576, 8192)]);
        t.on_data_out(r[1].ttt, 0, 24576, 8192, true).unwrap();
        // The first half of a burst lost: asked for again once the burst has ended.
        t.on_lost_data_out(r[0].ttt, 0, 8192, 8192, false).unwrap();
        assert!(t.next_r2ts(ttts()).is_empty());
        t.on_data_out(r[0].ttt, 1, 16384, 8192, true).unwrap();
        assert!(t.solicits() && !t.done());
        let r = t.next_r2ts(ttts());
        assert_eq!(spans(&r), [(4, 8192, 8192)]);
        t.on_data_out(r[0].ttt, 0, 8192, 8192, true).unwrap();
        assert!(t.done() && !t.solicits());
        assert_eq!(t.recovered(), 3);
    }

    #[test]
    fn a_write_whose_connection_failed_asks_again_for_what_it_was_owed() {
        // 4 KiB immediate, an unsolicited burst open at 6 KiB: it ends there.
        let mut t = WriteTransfer::new(params(false), 32768, 32768, 4096, false).unwrap();
        t.on_data_out(RESERVED_TAG, 0, 4096, 2048, false).unwrap();
        t.reopen();
        assert!(!t.unsolicited_open());
        let spans = |r: &[R2tPlan]| r.iter().map(|p| (p.offset, p.len)).collect::<Vec<_>>();
        let r = t.next_r2ts(ttts());
        assert_eq!(spans(&r), [(6144, 16384), (22528, 10240)]);
        // Half of the first R2T came before the next failure.
        t.on_data_out(r[0].ttt, 0, 6144, 8192, false).unwrap();
        t.reopen();
        let again = t.next_r2ts(ttts());
        assert_eq!(spans(&again), [(14336, 8192), (22528, 10240)]);
        t.on_data_out(again[0].ttt, 0, 14336, 8192, true).unwrap();
        t.on_data_out(again[1].ttt, 0, 22528, 10240, true).unwrap();
        assert!(t.done());
    }
}
