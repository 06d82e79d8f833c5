//! What a SCSI Command PDU asks of the session, decided when it arrives: its task attribute, its
//! write's data transfer, and whether it may run on the reader that received it instead of in a
//! task of its own (RFC 7143 11.3, 4.2.5.2; SAM-5 8.6).

use crate::transfer::{BurstParams, TransferError, WriteTransfer};
use mcsi_proto::pdu::{reject_reason, ScsiCommand, TaskAttr};
use mcsi_scsi::{DataPhase, TaskAttribute};

/// A command as the session will run it.
#[derive(Debug)]
pub struct CommandPlan {
    pub attr: TaskAttribute,
    /// A write's Data-Out bookkeeping (None for a command without data-out).
    pub transfer: Option<WriteTransfer>,
    /// SIMPLE, with all of its data at hand, for a logical unit that does not block: it needs
    /// no task of its own and may run on the reader when its turn comes.
    pub inline: bool,
}

/// The SAM task attribute of an iSCSI one. Untagged is SIMPLE (11.3.1); ACA is not offered,
/// so it is taken as SIMPLE too.
pub fn task_attribute(a: TaskAttr) -> TaskAttribute {
    match a {
        TaskAttr::Ordered => TaskAttribute::Ordered,
        TaskAttr::HeadOfQueue => TaskAttribute::HeadOfQueue,
        _ => TaskAttribute::Simple,
    }
}

/// A command that cannot be taken: its data breaks the negotiated rules. The PDU is rejected
/// with [`CommandRefused::reject_reason`] and its CmdSN used up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CommandRefused(pub TransferError);

impl CommandRefused {
    /// The Reject reason (11.17.1).
    pub fn reject_reason(&self) -> u8 {
        reject_reason::PROTOCOL_ERROR
    }
}

/// Plans command `c` whose CDB needs `phase` under the session's `burst` values; `blocking`
/// says (when asked) whether its logical unit may block on this CDB (a file or block device).
pub fn plan(
    c: &ScsiCommand,
    phase: DataPhase,
    burst: BurstParams,
    blocking: impl FnOnce() -> bool,
) -> Result<CommandPlan, CommandRefused> {
    let edtl = c.expected_data_transfer_length;
    let transfer = if c.write {
        Some(
            WriteTransfer::new(
                burst,
                edtl,
                phase.data_out_len.min(edtl),
                c.data.len() as u32,
                c.final_,
            )
            .map_err(CommandRefused)?,
        )
    } else if !c.data.is_empty() {
        return Err(CommandRefused(TransferError::ImmediateDataNotAllowed));
    } else {
        None
    };
    let attr = task_attribute(c.attr);
    let inline =
        attr == TaskAttribute::Simple && transfer.as_ref().is_none_or(|t| t.done()) && !blocking();
    Ok(CommandPlan {
        attr,
        transfer,
        inline,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn burst() -> BurstParams {
        BurstParams {
            initial_r2t: false,
            immediate_data: true,
            first_burst_length: 65536,
            max_burst_length: 262_144,
            max_outstanding_r2t: 1,
        }
    }

    fn cmd(write: bool, edtl: u32, data: usize, attr: TaskAttr) -> ScsiCommand {
        ScsiCommand {
            immediate: false,
            final_: true,
            read: !write,
            write,
            attr,
            lun: 0,
            itt: 1,
            expected_data_transfer_length: edtl,
            cmd_sn: 1,
            exp_stat_sn: 1,
            cdb: Bytes::from_static(&[0x2a, 0, 0, 0, 0, 0, 0, 0, 8, 0]),
            bidi_read_length: None,
            data: Bytes::from(vec![0u8; data]),
        }
    }

    fn phase(out: u32) -> DataPhase {
        DataPhase {
            data_out_len: out,
            data_in_len: 0,
        }
    }

    #[test]
    fn a_write_with_all_its_data_runs_inline_unless_the_lu_blocks() {
        let c = cmd(true, 4096, 4096, TaskAttr::Simple);
        let p = plan(&c, phase(4096), burst(), || false).unwrap();
        assert!(p.inline && p.transfer.is_some_and(|t| t.done()));
        assert!(!plan(&c, phase(4096), burst(), || true).unwrap().inline);
        // Part of its data still to come: a task of its own, whatever the LU.
        let c = cmd(true, 1 << 20, 4096, TaskAttr::Simple);
        let p = plan(&c, phase(1 << 20), burst(), || panic!("not asked")).unwrap();
        assert!(!p.inline);
    }

    #[test]
    fn ordered_and_head_of_queue_take_a_task_and_untagged_is_simple() {
        let p = plan(
            &cmd(false, 512, 0, TaskAttr::Ordered),
            phase(0),
            burst(),
            || false,
        );
        assert!(p.is_ok_and(|p| p.attr == TaskAttribute::Ordered && !p.inline));
        let p = plan(
            &cmd(false, 512, 0, TaskAttr::HeadOfQueue),
            phase(0),
            burst(),
            || false,
        );
        assert!(p.is_ok_and(|p| p.attr == TaskAttribute::HeadOfQueue && !p.inline));
        let p = plan(
            &cmd(false, 512, 0, TaskAttr::Untagged),
            phase(0),
            burst(),
            || false,
        );
        assert!(p.is_ok_and(|p| p.attr == TaskAttribute::Simple && p.inline));
    }

    #[test]
    fn data_against_the_rules_is_refused_with_a_protocol_error() {
        // Immediate data on a read.
        let e = plan(
            &cmd(false, 512, 512, TaskAttr::Simple),
            phase(0),
            burst(),
            || false,
        )
        .unwrap_err();
        assert_eq!(e, CommandRefused(TransferError::ImmediateDataNotAllowed));
        assert_eq!(e.reject_reason(), reject_reason::PROTOCOL_ERROR);
        // Immediate data when ImmediateData=No.
        let b = BurstParams {
            immediate_data: false,
            ..burst()
        };
        let e = plan(
            &cmd(true, 4096, 4096, TaskAttr::Simple),
            phase(4096),
            b,
            || false,
        );
        assert!(e.is_err());
    }
}
