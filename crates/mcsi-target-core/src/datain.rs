//! The PDUs that end a task: Data-In segmentation, phase collapse and residual counts (RFC 7143
//! sections 11.4, 11.4.5 and 11.7).

use mcsi_proto::data::{pieces, Residual};
use mcsi_proto::pdu::{DataIn, Pdu, ScsiCommand, ScsiResponse, RESERVED_TAG};
use mcsi_scsi::{status, DataPhase, Outcome};

/// The data-in length the initiator expects: EDTL for a read, the Bidirectional Read Expected
/// Data Transfer Length AHS for a bidirectional command (11.3.6), else nothing.
pub fn read_expected(cmd: &ScsiCommand) -> u32 {
    match (cmd.read, cmd.write) {
        (true, false) => cmd.expected_data_transfer_length,
        (true, true) => cmd.bidi_read_length.unwrap_or(0),
        _ => 0,
    }
}

/// The PDUs that end a task (11.4, 11.7): Data-In split by the initiator's
/// MaxRecvDataSegmentLength with sequences of at most MaxBurstLength, status in the last Data-In
/// when it is GOOD without sense (phase collapse) and the command is not bidirectional, else a
/// SCSI Response. Residuals compare the initiator's expected lengths with what the command
/// moved (reads) or needed (writes).
pub fn response_pdus(
    cmd: &ScsiCommand,
    phase: DataPhase,
    outcome: Outcome,
    mrdsl: u32,
    max_burst: u32,
) -> Vec<Pdu> {
    let read_exp = read_expected(cmd);
    let write_exp = if cmd.write {
        cmd.expected_data_transfer_length
    } else {
        0
    };
    let produced = u32::try_from(outcome.data_in.len())
        .unwrap_or(u32::MAX)
        .saturating_add(outcome.data_in_unread);
    let read_res = Residual::of(read_exp, produced);
    let write_res = Residual::of(write_exp, phase.data_out_len);
    let (main, bidi) = match (cmd.read, cmd.write) {
        (true, false) => (read_res, None),
        (false, true) => (write_res, None),
        (true, true) => (write_res, Some(read_res)),
        // No direction flagged (EDTL 0): report what the CDB wanted as overflow.
        (false, false) if produced > 0 || phase.data_in_len > 0 => (read_res, None),
        (false, false) => (write_res, None),
    };
    let have = u32::try_from(outcome.data_in.len()).unwrap_or(u32::MAX);
    let send_len = if cmd.read {
        produced.min(read_exp).min(have)
    } else {
        0
    };
    let collapse =
        outcome.status == status::GOOD && outcome.sense.is_none() && send_len > 0 && bidi.is_none();
    let pieces: Vec<_> = pieces(0, send_len, mrdsl, max_burst).collect();
    let n = pieces.len();
    let mut out = Vec::with_capacity(n + 1);
    // The pieces follow each other from offset 0, so each is split off the front. The last (for
    // a read in one Data-In, the only) one takes what is left as it is: slicing a buffer that
    // came from a Vec would allocate a shared header first.
    let mut rest = outcome.data_in;
    if rest.len() > send_len as usize {
        rest.truncate(send_len as usize);
    }
    for (i, p) in pieces.into_iter().enumerate() {
        debug_assert_eq!(p.offset as usize + rest.len(), send_len as usize);
        let last = i + 1 == n;
        let with_status = last && collapse;
        out.push(Pdu::DataIn(DataIn {
            final_: p.final_ || last,
            ack: false,
            overflow: with_status && main.overflow(),
            underflow: with_status && main.underflow(),
            status: with_status.then_some(outcome.status),
            lun: cmd.lun,
            itt: cmd.itt,
            ttt: RESERVED_TAG,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            data_sn: i as u32,
            buffer_offset: p.offset,
            residual_count: if with_status { main.count() } else { 0 },
            data: rest.split_to(p.len as usize),
        }));
    }
    if !collapse {
        let b = bidi.unwrap_or_default();
        out.push(Pdu::ScsiResponse(ScsiResponse {
            bidi_overflow: b.overflow(),
            bidi_underflow: b.underflow(),
            overflow: main.overflow(),
            underflow: main.underflow(),
            response: 0,
            status: outcome.status,
            itt: cmd.itt,
            snack_tag: 0,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            exp_data_sn: n as u32,
            bidi_residual_count: b.count(),
            residual_count: main.count(),
            sense: outcome.sense.unwrap_or_default(),
        }));
    }
    out
}

#[cfg(test)]
mod response_tests {
    use super::*;
    use bytes::Bytes;
    use mcsi_proto::pdu::TaskAttr;

    fn cmd(read: bool, write: bool, edtl: u32) -> ScsiCommand {
        ScsiCommand {
            immediate: false,
            final_: true,
            read,
            write,
            attr: TaskAttr::Simple,
            lun: 0,
            itt: 0x42,
            expected_data_transfer_length: edtl,
            cmd_sn: 1,
            exp_stat_sn: 1,
            cdb: Bytes::from_static(&[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]),
            bidi_read_length: None,
            data: Bytes::new(),
        }
    }

    fn read_phase(n: u32) -> DataPhase {
        DataPhase {
            data_out_len: 0,
            data_in_len: n,
        }
    }

    #[test]
    fn read_with_phase_collapse() {
        // 20000 bytes to an initiator with MRDSL 8192: 3 Data-In, status in the last.
        let data = Bytes::from(vec![7u8; 20000]);
        let pdus = response_pdus(
            &cmd(true, false, 20000),
            read_phase(20000),
            Outcome::good(data),
            8192,
            1 << 20,
        );
        assert_eq!(pdus.len(), 3);
        let Pdu::DataIn(last) = &pdus[2] else {
            panic!("{pdus:?}")
        };
        assert_eq!(
            (last.data_sn, last.buffer_offset, last.data.len()),
            (2, 16384, 3616)
        );
        assert_eq!(last.status, Some(0));
        assert!(last.final_ && !last.underflow && !last.overflow);
        let Pdu::DataIn(first) = &pdus[0] else {
            panic!()
        };
        assert!(first.status.is_none() && !first.final_);
    }

    #[test]
    fn read_residuals_of_libiscsi_read10_invalid() {
        let block = Bytes::from(vec![1u8; 512]);
        // EDTL 10000: one block sent, underflow 9488 in the status-carrying Data-In.
        let p = response_pdus(
            &cmd(true, false, 10000),
            read_phase(512),
            Outcome::good(block.clone()),
            8192,
            1 << 20,
        );
        let Pdu::DataIn(d) = &p[0] else { panic!() };
        assert_eq!(
            (d.data.len(), d.underflow, d.residual_count),
            (512, true, 9488)
        );
        // EDTL 200: 200 bytes sent, overflow 312.
        let p = response_pdus(
            &cmd(true, false, 200),
            read_phase(512),
            Outcome::good(block.clone()),
            8192,
            1 << 20,
        );
        let Pdu::DataIn(d) = &p[0] else { panic!() };
        assert_eq!(
            (d.data.len(), d.overflow, d.residual_count),
            (200, true, 312)
        );
        // EDTL 0 and no direction flag: no data, SCSI Response GOOD with overflow 512.
        let p = response_pdus(
            &cmd(false, false, 0),
            read_phase(512),
            Outcome::good(block),
            8192,
            1 << 20,
        );
        assert_eq!(p.len(), 1);
        let Pdu::ScsiResponse(r) = &p[0] else {
            panic!()
        };
        assert_eq!(
            (r.status, r.overflow, r.residual_count, r.exp_data_sn),
            (0, true, 512, 0)
        );
    }

    /// A READ the device server cut to the expected length (the rest unread) gets the same
    /// residuals as one it read whole.
    #[test]
    fn unread_data_in_counts_for_the_residual() {
        for (edtl, read, have, unread) in [(200u32, true, 512, 7680), (0, false, 0, 8192)] {
            let mut o = Outcome::good(Bytes::from(vec![1u8; have]));
            o.data_in_unread = unread;
            let mut whole = Outcome::good(Bytes::from(vec![1u8; 8192]));
            whole.data_in_unread = 0;
            let cut = response_pdus(&cmd(read, false, edtl), read_phase(8192), o, 8192, 1 << 20);
            let full = response_pdus(
                &cmd(read, false, edtl),
                read_phase(8192),
                whole,
                8192,
                1 << 20,
            );
            assert_eq!(cut, full, "EDTL {edtl}");
        }
    }

    #[test]
    fn write_residuals() {
        // WRITE10 of 2 blocks with EDTL one block: overflow 512 (test_write10_residuals).
        let phase = DataPhase {
            data_out_len: 1024,
            data_in_len: 0,
        };
        let p = response_pdus(
            &cmd(false, true, 512),
            phase,
            Outcome::good(Bytes::new()),
            8192,
            1 << 20,
        );
        let Pdu::ScsiResponse(r) = &p[0] else {
            panic!()
        };
        assert_eq!(
            (r.overflow, r.underflow, r.residual_count),
            (true, false, 512)
        );
        // EDTL 10000 for one block: underflow 9488.
        let phase = DataPhase {
            data_out_len: 512,
            data_in_len: 0,
        };
        let p = response_pdus(
            &cmd(false, true, 10000),
            phase,
            Outcome::good(Bytes::new()),
            8192,
            1 << 20,
        );
        let Pdu::ScsiResponse(r) = &p[0] else {
            panic!()
        };
        assert_eq!(
            (r.overflow, r.underflow, r.residual_count),
            (false, true, 9488)
        );
    }

    #[test]
    fn check_condition_goes_in_a_response_with_sense() {
        let sense =
            Bytes::from_static(&[0x70, 0, 5, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x21, 0, 0, 0, 0, 0]);
        let o = Outcome {
            status: status::CHECK_CONDITION,
            sense: Some(sense.clone()),
            data_in: Bytes::new(),
            data_in_unread: 0,
        };
        let p = response_pdus(&cmd(true, false, 512), read_phase(512), o, 8192, 1 << 20);
        assert_eq!(p.len(), 1);
        let Pdu::ScsiResponse(r) = &p[0] else {
            panic!()
        };
        assert_eq!(
            (r.status, &r.sense, r.underflow, r.residual_count),
            (2, &sense, true, 512)
        );
    }
}
