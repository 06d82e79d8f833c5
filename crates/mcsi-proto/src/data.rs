//! Facts of a task's data that both sides apply: how a transfer is cut into PDUs and sequences
//! (RFC 7143 11.7, 11.8), how much may go unsolicited (the first-burst rule of 13.10, 13.13,
//! 13.14), and what a residual says (11.4.5).

/// One data PDU's share of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Buffer offset of its first byte.
    pub offset: u32,
    pub len: u32,
    /// F bit: the last PDU of its sequence.
    pub final_: bool,
}

/// Cuts `len` bytes from `offset` into PDUs of at most `max_pdu` bytes (the receiver's
/// MaxRecvDataSegmentLength), ending a sequence (F bit) every `max_burst` bytes and at the end.
/// A Data-In transfer is several sequences of at most MaxBurstLength; the Data-Out answering one
/// R2T, or an unsolicited burst, is one sequence (`max_burst` at least `len`).
pub fn pieces(offset: u32, len: u32, max_pdu: u32, max_burst: u32) -> Pieces {
    Pieces {
        at: offset,
        end: offset.saturating_add(len),
        max_pdu: max_pdu.max(1),
        max_burst: max_burst.max(1),
        in_burst: 0,
    }
}

/// The iterator of [`pieces`]. It knows its length, so collecting it allocates once.
#[derive(Debug, Clone)]
pub struct Pieces {
    at: u32,
    end: u32,
    max_pdu: u32,
    max_burst: u32,
    in_burst: u32,
}

impl Iterator for Pieces {
    type Item = Piece;

    fn next(&mut self) -> Option<Piece> {
        if self.at >= self.end {
            return None;
        }
        let n = (self.end - self.at)
            .min(self.max_pdu)
            .min(self.max_burst - self.in_burst);
        let offset = self.at;
        self.at += n;
        self.in_burst += n;
        let final_ = self.in_burst == self.max_burst || self.at == self.end;
        if final_ {
            self.in_burst = 0;
        }
        Some(Piece {
            offset,
            len: n,
            final_,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // At least one PDU per max_pdu bytes; a burst edge inside a PDU's span adds one per
        // burst. Exact bounds are not needed, a good lower one is.
        let left = self.end.saturating_sub(self.at);
        let low = left.div_ceil(self.max_pdu) as usize;
        (low, Some(low + left.div_ceil(self.max_burst) as usize))
    }
}

/// What of a write goes without an R2T: `immediate` bytes in the command PDU, then unsolicited
/// Data-Out up to `unsolicited_end`; the rest is asked for by R2Ts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsolicited {
    /// Bytes `[0, immediate)` ride in the SCSI Command PDU (ImmediateData=Yes).
    pub immediate: u32,
    /// Bytes `[immediate, unsolicited_end)` follow as unsolicited Data-Out (InitialR2T=No).
    pub unsolicited_end: u32,
}

impl Unsolicited {
    /// Whether unsolicited Data-Out PDUs follow the command (its F bit is then 0).
    pub fn has_data_out(&self) -> bool {
        self.unsolicited_end > self.immediate
    }
}

/// The most a write of `len` bytes may send unsolicited (immediate data and unsolicited
/// Data-Out together): FirstBurstLength, or the write itself if smaller (13.14).
pub fn unsolicited_limit(len: u32, first_burst_length: u32) -> u32 {
    len.min(first_burst_length)
}

/// How a write of `len` bytes starts under the negotiated ImmediateData, InitialR2T and
/// FirstBurstLength, with command PDUs carrying at most `max_pdu` bytes (13.10, 13.13, 13.14):
/// immediate data when allowed, unsolicited Data-Out up to the first burst when InitialR2T=No.
pub fn unsolicited(
    len: u32,
    first_burst_length: u32,
    immediate_data: bool,
    initial_r2t: bool,
    max_pdu: u32,
) -> Unsolicited {
    let burst = unsolicited_limit(len, first_burst_length);
    let immediate = if immediate_data {
        burst.min(max_pdu)
    } else {
        0
    };
    Unsolicited {
        immediate,
        unsolicited_end: if initial_r2t { immediate } else { burst },
    }
}

/// The residual of one direction of a task (11.4.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Residual {
    #[default]
    None,
    /// This many bytes fewer moved than the initiator expected.
    Underflow(u32),
    /// The command wanted to move this many bytes more than the initiator expected (they were
    /// not moved).
    Overflow(u32),
}

impl Residual {
    /// The residual of a direction where the initiator expected `expected` bytes and the
    /// command moved (or wanted to move) `actual`.
    pub fn of(expected: u32, actual: u32) -> Residual {
        use std::cmp::Ordering::*;
        match actual.cmp(&expected) {
            Equal => Residual::None,
            Greater => Residual::Overflow(actual - expected),
            Less => Residual::Underflow(expected - actual),
        }
    }

    /// From a response's U and O bits and Residual Count (U wins if a peer sets both).
    pub fn from_flags(underflow: bool, overflow: bool, count: u32) -> Residual {
        match (underflow, overflow) {
            (true, _) => Residual::Underflow(count),
            (false, true) => Residual::Overflow(count),
            _ => Residual::None,
        }
    }

    /// The O bit.
    pub fn overflow(self) -> bool {
        matches!(self, Residual::Overflow(_))
    }

    /// The U bit.
    pub fn underflow(self) -> bool {
        matches!(self, Residual::Underflow(_))
    }

    /// The Residual Count field.
    pub fn count(self) -> u32 {
        match self {
            Residual::None => 0,
            Residual::Underflow(n) | Residual::Overflow(n) => n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(offset: u32, len: u32, final_: bool) -> Piece {
        Piece {
            offset,
            len,
            final_,
        }
    }

    #[test]
    fn pieces_by_segment_and_burst() {
        // 20000 bytes, 8192-byte PDUs, 16384-byte bursts: 8192 | 8192 (F) | 3616 (F).
        let v: Vec<_> = pieces(0, 20000, 8192, 16384).collect();
        assert_eq!(
            v,
            vec![p(0, 8192, false), p(8192, 8192, true), p(16384, 3616, true)]
        );
        // A burst edge inside a PDU's span cuts the PDU there.
        let v: Vec<_> = pieces(0, 12000, 6000, 10000).collect();
        assert_eq!(
            v,
            vec![p(0, 6000, false), p(6000, 4000, true), p(10000, 2000, true)]
        );
        // One sequence from an offset (an R2T's answer).
        let v: Vec<_> = pieces(4096, 9000, 4096, u32::MAX).collect();
        assert_eq!(
            v,
            vec![
                p(4096, 4096, false),
                p(8192, 4096, false),
                p(12288, 808, true)
            ]
        );
        assert_eq!(pieces(0, 0, 512, 512).count(), 0);
        // Degenerate limits do not loop for ever.
        assert_eq!(pieces(0, 3, 0, 0).count(), 3);
    }

    #[test]
    fn pieces_cover_the_transfer_once() {
        for len in [1u32, 511, 512, 513, 65536, 100_000] {
            for max_pdu in [512u32, 8192, 262_144] {
                for burst in [512u32, 65536, 1 << 20] {
                    let v: Vec<_> = pieces(0, len, max_pdu, burst).collect();
                    let (low, high) = pieces(0, len, max_pdu, burst).size_hint();
                    assert!(low <= v.len() && v.len() <= high.unwrap());
                    let mut at = 0;
                    let mut in_burst = 0;
                    for x in &v {
                        assert_eq!(x.offset, at);
                        assert!(x.len >= 1 && x.len <= max_pdu);
                        at += x.len;
                        in_burst += x.len;
                        assert!(in_burst <= burst);
                        if x.final_ {
                            in_burst = 0;
                        }
                    }
                    assert_eq!(at, len);
                    assert!(v.last().unwrap().final_);
                }
            }
        }
    }

    #[test]
    fn the_first_burst_rule() {
        // ImmediateData=Yes, InitialR2T=No: immediate up to the PDU size, then Data-Out to the
        // first burst.
        assert_eq!(
            unsolicited(1 << 20, 65536, true, false, 8192),
            Unsolicited {
                immediate: 8192,
                unsolicited_end: 65536
            }
        );
        // InitialR2T=Yes: only the immediate data goes unasked.
        assert_eq!(
            unsolicited(1 << 20, 65536, true, true, 8192).unsolicited_end,
            8192
        );
        // Neither: everything waits for R2Ts.
        assert_eq!(
            unsolicited(4096, 65536, false, true, 8192),
            Unsolicited {
                immediate: 0,
                unsolicited_end: 0
            }
        );
        // A write smaller than the first burst goes whole.
        assert_eq!(
            unsolicited(4096, 65536, false, false, 8192).unsolicited_end,
            4096
        );
    }

    #[test]
    fn residuals() {
        // READ10 of one 512-byte block with EDTL 0, 10000 and 200 (iSCSIResiduals).
        assert_eq!(Residual::of(0, 512), Residual::Overflow(512));
        assert_eq!(Residual::of(10000, 512), Residual::Underflow(9488));
        assert_eq!(Residual::of(200, 512), Residual::Overflow(312));
        assert_eq!(Residual::of(512, 512), Residual::None);
        for r in [
            Residual::None,
            Residual::Underflow(7),
            Residual::Overflow(9),
        ] {
            assert_eq!(
                Residual::from_flags(r.underflow(), r.overflow(), r.count()),
                r
            );
        }
        assert_eq!(Residual::from_flags(true, true, 3), Residual::Underflow(3));
    }
}
