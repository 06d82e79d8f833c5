//! Data-In segmentation and residual counts (RFC 7143 sections 11.4.5 and 11.7).

/// One Data-In PDU's share of the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub offset: u32,
    pub len: u32,
    /// F bit: last PDU of a Data-In sequence (a sequence carries at most MaxBurstLength bytes).
    pub final_: bool,
}

/// Splits `len` bytes into Data-In PDUs of at most `mrdsl` bytes (the initiator's
/// MaxRecvDataSegmentLength), ending a sequence at every `max_burst` bytes.
pub fn split(len: u32, mrdsl: u32, max_burst: u32) -> Vec<Piece> {
    let mrdsl = mrdsl.max(1);
    let max_burst = max_burst.max(1);
    let mut out = Vec::with_capacity(len.div_ceil(mrdsl) as usize + 1);
    let mut offset = 0u32;
    let mut in_burst = 0u32;
    while offset < len {
        let n = (len - offset).min(mrdsl).min(max_burst - in_burst);
        offset += n;
        in_burst += n;
        let end_of_burst = in_burst == max_burst || offset == len;
        if end_of_burst {
            in_burst = 0;
        }
        out.push(Piece {
            offset: offset - n,
            len: n,
            final_: end_of_burst,
        });
    }
    out
}

/// Residual of one direction (11.4.5): overflow when the command wanted to move more than the
/// initiator expected, underflow when less.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Residual {
    pub overflow: bool,
    pub underflow: bool,
    pub count: u32,
}

/// `expected`: the initiator's expected length for the direction; `actual`: what the command
/// moved or wanted to move.
pub fn residual(expected: u32, actual: u32) -> Residual {
    use std::cmp::Ordering::*;
    match actual.cmp(&expected) {
        Equal => Residual::default(),
        Greater => Residual {
            overflow: true,
            underflow: false,
            count: actual - expected,
        },
        Less => Residual {
            overflow: false,
            underflow: true,
            count: expected - actual,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_by_segment_and_burst() {
        // 20000 bytes, 8192-byte segments, 16384-byte bursts: 8192 | 8192 (F) | 3616 (F).
        assert_eq!(
            split(20000, 8192, 16384),
            vec![
                Piece {
                    offset: 0,
                    len: 8192,
                    final_: false
                },
                Piece {
                    offset: 8192,
                    len: 8192,
                    final_: true
                },
                Piece {
                    offset: 16384,
                    len: 3616,
                    final_: true
                },
            ]
        );
        // Burst boundary inside a segment: 6000-byte segments, 10000-byte bursts.
        assert_eq!(
            split(12000, 6000, 10000),
            vec![
                Piece {
                    offset: 0,
                    len: 6000,
                    final_: false
                },
                Piece {
                    offset: 6000,
                    len: 4000,
                    final_: true
                },
                Piece {
                    offset: 10000,
                    len: 2000,
                    final_: true
                },
            ]
        );
        assert!(split(0, 8192, 8192).is_empty());
    }

    #[test]
    fn residuals_as_libiscsi_expects() {
        // READ10 of one 512-byte block with EDTL 0, 10000 and 200 (iSCSIResiduals.Read10Invalid).
        assert_eq!(
            residual(0, 512),
            Residual {
                overflow: true,
                underflow: false,
                count: 512
            }
        );
        assert_eq!(
            residual(10000, 512),
            Residual {
                overflow: false,
                underflow: true,
                count: 9488
            }
        );
        assert_eq!(
            residual(200, 512),
            Residual {
                overflow: true,
                underflow: false,
                count: 312
            }
        );
        assert_eq!(residual(512, 512), Residual::default());
    }
}
