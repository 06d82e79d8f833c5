//! The sequence-number rules of RFC 7143 written once, for both sides: which PDUs take a StatSN
//! and which only carry it (4.2.2.2, 11.1.3), which carry the target's ExpCmdSN/MaxCmdSN, the
//! CmdSN of a request (4.2.2.1), and how a Reject quotes what it rejects (11.17).

use crate::pdu::{self, Framing, Pdu, Reject, RESERVED_TAG};
use bytes::Bytes;

/// How a PDU the target sends uses its connection's StatSN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatSnUse {
    /// It carries a status (SCSI Response, Data-In with status, the responses, Async Message,
    /// Reject, a NOP-In answering a NOP-Out): it takes the connection's next StatSN.
    Takes,
    /// It carries the next StatSN without taking it: R2T, and a NOP-In the target sends on its
    /// own (ITT 0xffffffff).
    Carries,
    /// No StatSN: an initiator's request, a login PDU, or Data-In without status (its field
    /// is reserved).
    Neither,
}

impl Pdu {
    /// How this PDU uses its connection's StatSN.
    pub fn stat_sn_use(&self) -> StatSnUse {
        match self {
            Pdu::ScsiResponse(_)
            | Pdu::TaskMgmtResponse(_)
            | Pdu::TextResponse(_)
            | Pdu::LogoutResponse(_)
            | Pdu::AsyncMessage(_)
            | Pdu::Reject(_) => StatSnUse::Takes,
            Pdu::DataIn(d) if d.status.is_some() => StatSnUse::Takes,
            Pdu::NopIn(n) if n.itt != RESERVED_TAG => StatSnUse::Takes,
            Pdu::NopIn(_) | Pdu::R2t(_) => StatSnUse::Carries,
            _ => StatSnUse::Neither,
        }
    }

    /// The StatSN, ExpCmdSN and MaxCmdSN fields of a target PDU in full feature phase.
    fn seq_fields_mut(&mut self) -> Option<(&mut u32, &mut u32, &mut u32)> {
        Some(match self {
            Pdu::ScsiResponse(p) => (&mut p.stat_sn, &mut p.exp_cmd_sn, &mut p.max_cmd_sn),
            Pdu::DataIn(p) => (&mut p.stat_sn, &mut p.exp_cmd_sn, &mut p.max_cmd_sn),
            Pdu::TaskMgmtResponse(p) => (&mut p.stat_sn, &mut p.exp_cmd_sn, &mut p.max_cmd_sn),
            Pdu::TextResponse(p) => (&mut p.stat_sn, &mut p.exp_cmd_sn, &mut p.max_cmd_sn),
            Pdu::LogoutResponse(p) => (&mut p.stat_sn, &mut p.exp_cmd_sn, &mut p.max_cmd_sn),
            Pdu::AsyncMessage(p) => (&mut p.stat_sn, &mut p.exp_cmd_sn, &mut p.max_cmd_sn),
            Pdu::Reject(p) => (&mut p.stat_sn, &mut p.exp_cmd_sn, &mut p.max_cmd_sn),
            Pdu::NopIn(p) => (&mut p.stat_sn, &mut p.exp_cmd_sn, &mut p.max_cmd_sn),
            Pdu::R2t(p) => (&mut p.stat_sn, &mut p.exp_cmd_sn, &mut p.max_cmd_sn),
            _ => return None,
        })
    }

    /// The same fields, read.
    fn seq_fields(&self) -> Option<(u32, u32, u32)> {
        Some(match self {
            Pdu::ScsiResponse(p) => (p.stat_sn, p.exp_cmd_sn, p.max_cmd_sn),
            Pdu::DataIn(p) => (p.stat_sn, p.exp_cmd_sn, p.max_cmd_sn),
            Pdu::TaskMgmtResponse(p) => (p.stat_sn, p.exp_cmd_sn, p.max_cmd_sn),
            Pdu::TextResponse(p) => (p.stat_sn, p.exp_cmd_sn, p.max_cmd_sn),
            Pdu::LogoutResponse(p) => (p.stat_sn, p.exp_cmd_sn, p.max_cmd_sn),
            Pdu::AsyncMessage(p) => (p.stat_sn, p.exp_cmd_sn, p.max_cmd_sn),
            Pdu::Reject(p) => (p.stat_sn, p.exp_cmd_sn, p.max_cmd_sn),
            Pdu::NopIn(p) => (p.stat_sn, p.exp_cmd_sn, p.max_cmd_sn),
            Pdu::R2t(p) => (p.stat_sn, p.exp_cmd_sn, p.max_cmd_sn),
            _ => return None,
        })
    }

    /// The StatSN a target PDU carries, with whether it took that number (the connection's next
    /// ExpStatSN is then one past it) or only carries the next one; None without a StatSN.
    pub fn stat_sn(&self) -> Option<(u32, bool)> {
        let (sn, _, _) = self.seq_fields()?;
        match self.stat_sn_use() {
            StatSnUse::Takes => Some((sn, true)),
            StatSnUse::Carries => Some((sn, false)),
            StatSnUse::Neither => None,
        }
    }

    /// The ExpCmdSN and MaxCmdSN a target PDU in full feature phase carries.
    pub fn cmd_window(&self) -> Option<(u32, u32)> {
        self.seq_fields().map(|(_, exp, max)| (exp, max))
    }

    /// Fills StatSN, ExpCmdSN and MaxCmdSN of a PDU the target sends, taking the connection's
    /// next StatSN (`stat_sn`, advanced) where [`Pdu::stat_sn_use`] says so.
    pub fn stamp(&mut self, stat_sn: &mut u32, exp_cmd_sn: u32, max_cmd_sn: u32) {
        let sn = match self.stat_sn_use() {
            StatSnUse::Takes => {
                let v = *stat_sn;
                *stat_sn = v.wrapping_add(1);
                v
            }
            StatSnUse::Carries => *stat_sn,
            // Data-In without status: the field is reserved.
            StatSnUse::Neither => 0,
        };
        if let Some((s, e, m)) = self.seq_fields_mut() {
            (*s, *e, *m) = (sn, exp_cmd_sn, max_cmd_sn);
        }
    }

    /// Sends again a PDU sent before (a retransmission asked for by a SNACK, RFC 7143 11.16):
    /// a PDU that took a StatSN keeps the one it took, an R2T carries the connection's current
    /// one (`stat_sn`, not advanced), and ExpCmdSN/MaxCmdSN are the current window's.
    pub fn restamp(&mut self, stat_sn: u32, exp_cmd_sn: u32, max_cmd_sn: u32) {
        let use_ = self.stat_sn_use();
        if let Some((s, e, m)) = self.seq_fields_mut() {
            match use_ {
                StatSnUse::Takes => {}
                StatSnUse::Carries => *s = stat_sn,
                StatSnUse::Neither => *s = 0,
            }
            (*e, *m) = (exp_cmd_sn, max_cmd_sn);
        }
    }

    /// The ExpStatSN an initiator's PDU in full feature phase acknowledges statuses with
    /// (every request and Data-Out carries one); None for other PDUs.
    pub fn exp_stat_sn(&self) -> Option<u32> {
        Some(match self {
            Pdu::NopOut(x) => x.exp_stat_sn,
            Pdu::ScsiCommand(x) => x.exp_stat_sn,
            Pdu::TaskMgmtRequest(x) => x.exp_stat_sn,
            Pdu::TextRequest(x) => x.exp_stat_sn,
            Pdu::LogoutRequest(x) => x.exp_stat_sn,
            Pdu::DataOut(x) => x.exp_stat_sn,
            Pdu::SnackRequest(x) => x.exp_stat_sn,
            _ => return None,
        })
    }

    /// The CmdSN of an initiator's request; None for other PDUs.
    pub fn cmd_sn(&self) -> Option<u32> {
        Some(match self {
            Pdu::NopOut(x) => x.cmd_sn,
            Pdu::ScsiCommand(x) => x.cmd_sn,
            Pdu::TaskMgmtRequest(x) => x.cmd_sn,
            Pdu::TextRequest(x) => x.cmd_sn,
            Pdu::LogoutRequest(x) => x.cmd_sn,
            Pdu::LoginRequest(x) => x.cmd_sn,
            _ => return None,
        })
    }

    /// A Reject (11.17) with `reason`, quoting `header` (the rejected PDU's BHS; only its first
    /// 48 bytes are kept). StatSN and the window are filled when it is sent ([`Pdu::stamp`]).
    pub fn reject(reason: u8, header: Bytes) -> Pdu {
        let header = header.slice(..pdu::BHS_LEN.min(header.len()));
        Pdu::Reject(Reject {
            reason,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            data_sn_r2t_sn: 0,
            header,
        })
    }

    /// A Reject of `pdu`, quoting its BHS.
    pub fn reject_of(reason: u8, pdu: &Pdu) -> Pdu {
        let enc = pdu.encode(&Framing {
            header_digest: false,
            data_digest: false,
            max_data_segment_length: u32::MAX,
        });
        let bhs = &enc.header()[..pdu::BHS_LEN.min(enc.header().len())];
        Pdu::reject(reason, Bytes::copy_from_slice(bhs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pdu::{DataIn, NopIn, R2t, ScsiResponse};

    #[test]
    fn stat_sn_advances_only_for_status() {
        let mut sn = 10;
        let mut r2t = Pdu::R2t(R2t {
            lun: 0,
            itt: 1,
            ttt: 2,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            r2t_sn: 0,
            buffer_offset: 0,
            desired_data_transfer_length: 512,
        });
        r2t.stamp(&mut sn, 5, 9);
        let Pdu::R2t(r) = &r2t else { unreachable!() };
        assert_eq!((r.stat_sn, r.exp_cmd_sn, r.max_cmd_sn, sn), (10, 5, 9, 10));

        let mut din = Pdu::DataIn(DataIn {
            final_: true,
            ack: false,
            overflow: false,
            underflow: false,
            status: None,
            lun: 0,
            itt: 1,
            ttt: pdu::RESERVED_TAG,
            stat_sn: 77,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            data_sn: 0,
            buffer_offset: 0,
            residual_count: 0,
            data: Bytes::new(),
        });
        din.stamp(&mut sn, 5, 9);
        let Pdu::DataIn(d) = &din else { unreachable!() };
        assert_eq!((d.stat_sn, sn), (0, 10));

        let mut nop = Pdu::NopIn(NopIn {
            lun: 0,
            itt: pdu::RESERVED_TAG,
            ttt: 7,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            data: Bytes::new(),
        });
        nop.stamp(&mut sn, 5, 9);
        assert_eq!(sn, 10, "an unsolicited NOP-In does not advance StatSN");

        let mut resp = Pdu::ScsiResponse(ScsiResponse {
            bidi_overflow: false,
            bidi_underflow: false,
            overflow: false,
            underflow: false,
            response: 0,
            status: 0,
            itt: 1,
            snack_tag: 0,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            exp_data_sn: 0,
            bidi_residual_count: 0,
            residual_count: 0,
            sense: Bytes::new(),
        });
        resp.stamp(&mut sn, 6, 9);
        let Pdu::ScsiResponse(r) = &resp else {
            unreachable!()
        };
        assert_eq!((r.stat_sn, r.exp_cmd_sn, sn), (10, 6, 11));
    }

    /// What the target stamps, the initiator reads back the same way.
    #[test]
    fn both_sides_agree_on_stat_sn() {
        let mut sn = 41;
        let mut nop = Pdu::NopIn(NopIn {
            lun: 0,
            itt: 3,
            ttt: RESERVED_TAG,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            data: Bytes::new(),
        });
        nop.stamp(&mut sn, 1, 2);
        assert_eq!(nop.stat_sn(), Some((41, true)));
        assert_eq!(nop.cmd_window(), Some((1, 2)));
        assert_eq!(sn, 42);
        let r = Pdu::reject(9, Bytes::from(vec![1u8; 60]));
        let Pdu::Reject(j) = &r else { unreachable!() };
        assert_eq!((j.reason, j.header.len()), (9, 48));
        assert_eq!(r.stat_sn_use(), StatSnUse::Takes);
    }
}
