//! What a PDU from the initiator is to a session in full feature phase (RFC 7143 4.3, 7.1,
//! 11): a command, data, a control request, the answer to the target's ping, or something to
//! reject, and whether a rejected one still uses up its CmdSN.

use crate::control::answers_ping;
use mcsi_proto::pdu::{self, reject_reason, DataOut, Pdu, ScsiCommand};

/// Where a PDU goes ([`route`]).
#[derive(Debug)]
pub enum Route {
    /// The answer to the target's NOP-In ping with this TTT (11.18): nothing to run or answer.
    PingAnswer(u32),
    Command(ScsiCommand),
    DataOut(DataOut),
    /// NOP-Out (a ping from the initiator), Text, Logout or Task Management: run at once when
    /// immediate, else in CmdSN order.
    Control(Pdu),
    /// A SNACK (ErrorRecoveryLevel 1 and above, 11.16): answered from what the connection
    /// kept ([`crate::retain::SentLog`]).
    Snack(pdu::SnackRequest),
    /// Rejected with `reason` (the Reject carries `pdu`'s header). A non-immediate request
    /// still uses up its CmdSN (`consume`), so that the commands after it are not held for
    /// ever.
    Reject {
        reason: u8,
        pdu: Pdu,
        consume: Option<u32>,
    },
}

/// Where `p` goes in a session; a discovery session (`discovery`) carries Text, Logout and
/// NOP-Out only (4.3). A SNACK needs ErrorRecoveryLevel (`erl`) 1 or more (7.1), and a Login
/// Request or a target opcode has no place in full feature phase: both are protocol errors.
pub fn route(p: Pdu, discovery: bool, erl: u8) -> Route {
    let protocol_error = |p: Pdu| {
        let consume = consumed_cmd_sn(&p);
        Route::Reject {
            reason: reject_reason::PROTOCOL_ERROR,
            pdu: p,
            consume,
        }
    };
    match p {
        Pdu::NopOut(ref n) if answers_ping(n).is_some() => {
            Route::PingAnswer(answers_ping(n).unwrap_or_default())
        }
        Pdu::ScsiCommand(_) | Pdu::TaskMgmtRequest(_) if discovery => protocol_error(p),
        Pdu::ScsiCommand(c) => Route::Command(c),
        Pdu::DataOut(d) => Route::DataOut(d),
        Pdu::SnackRequest(s) if erl > 0 => Route::Snack(s),
        Pdu::NopOut(_) | Pdu::TextRequest(_) | Pdu::LogoutRequest(_) | Pdu::TaskMgmtRequest(_) => {
            Route::Control(p)
        }
        // A SNACK, a Login Request, a target opcode: nothing in CmdSN order to use up.
        other => Route::Reject {
            reason: reject_reason::PROTOCOL_ERROR,
            pdu: other,
            consume: None,
        },
    }
}

/// The CmdSN a rejected non-immediate request uses up: NOP-Out, SCSI Command, Task Management,
/// Text and Logout carry one (11.2).
fn consumed_cmd_sn(p: &Pdu) -> Option<u32> {
    (!p.is_immediate()).then(|| p.cmd_sn()).flatten()
}

/// The CmdSN an undecodable PDU that is answered with a Reject still uses up, from its header:
/// a non-immediate request of a kind that carries one (bytes 24..28, 11.2).
pub fn rejected_cmd_sn(header: &[u8]) -> Option<u32> {
    let bhs = pdu::Bhs::new(header)?;
    // NOP-Out, SCSI Command, Task Management, Text, Logout.
    (matches!(bhs.opcode_raw(), 0x00 | 0x01 | 0x02 | 0x04 | 0x06) && !bhs.immediate())
        .then(|| bhs.be32(24))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use mcsi_proto::pdu::{NopOut, SnackRequest, TaskMgmtRequest, RESERVED_TAG};

    fn nop(itt: u32, ttt: u32, immediate: bool) -> Pdu {
        Pdu::NopOut(NopOut {
            immediate,
            lun: 0,
            itt,
            ttt,
            cmd_sn: 7,
            exp_stat_sn: 0,
            data: Bytes::new(),
        })
    }

    fn tmf(immediate: bool) -> Pdu {
        Pdu::TaskMgmtRequest(TaskMgmtRequest {
            immediate,
            function: 1,
            lun: 0,
            itt: 3,
            referenced_task_tag: 1,
            cmd_sn: 9,
            exp_stat_sn: 0,
            ref_cmd_sn: 1,
            exp_data_sn: 0,
        })
    }

    #[test]
    fn each_pdu_goes_where_the_rfc_says() {
        assert!(matches!(
            route(nop(RESERVED_TAG, 5, true), false, 0),
            Route::PingAnswer(5)
        ));
        assert!(matches!(
            route(nop(4, RESERVED_TAG, false), false, 0),
            Route::Control(_)
        ));
        assert!(matches!(route(tmf(true), false, 0), Route::Control(_)));
        // Task management in a discovery session: a protocol error, its CmdSN used up unless
        // immediate.
        assert!(matches!(
            route(tmf(false), true, 0),
            Route::Reject {
                reason: reject_reason::PROTOCOL_ERROR,
                consume: Some(9),
                ..
            }
        ));
        assert!(matches!(
            route(tmf(true), true, 0),
            Route::Reject { consume: None, .. }
        ));
        let snack = Pdu::SnackRequest(SnackRequest {
            snack_type: 0,
            lun: 0,
            itt: 1,
            ttt: RESERVED_TAG,
            exp_stat_sn: 0,
            beg_run: 0,
            run_length: 0,
        });
        assert!(matches!(route(snack.clone(), false, 1), Route::Snack(_)));
        assert!(matches!(
            route(snack, false, 0),
            Route::Reject {
                reason: reject_reason::PROTOCOL_ERROR,
                consume: None,
                ..
            }
        ));
    }

    #[test]
    fn an_undecodable_request_uses_up_its_cmdsn_unless_immediate() {
        let mut h = [0u8; 48];
        h[0] = 0x01; // SCSI Command
        h[24..28].copy_from_slice(&42u32.to_be_bytes());
        assert_eq!(rejected_cmd_sn(&h), Some(42));
        h[0] = 0x41; // immediate
        assert_eq!(rejected_cmd_sn(&h), None);
        h[0] = 0x05; // Data-Out: no CmdSN
        assert_eq!(rejected_cmd_sn(&h), None);
        assert_eq!(rejected_cmd_sn(&h[..10]), None);
    }
}
