#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Golden PDUs built by hand from the RFC 7143 section 11 layouts, byte by byte. Digest values
//! were computed with a separate bitwise CRC-32C (polynomial 0x82f63b78) and checked against the
//! RFC 3720 B.4 vectors; they are not outputs of this crate.

use bytes::{Bytes, BytesMut};
use mcsi_proto::pdu::*;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    assert_eq!(s.len() & 1, 0, "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn plain() -> Framing {
    Framing::default()
}

fn digests() -> Framing {
    Framing {
        header_digest: true,
        data_digest: true,
        max_data_segment_length: 8192,
    }
}

/// Decode `wire` in one piece, check every shorter prefix asks for more, and check that encoding
/// the result gives `wire` back.
fn golden(wire: &[u8], framing: &Framing) -> Pdu {
    for cut in 0..wire.len() {
        let mut buf = BytesMut::from(&wire[..cut]);
        assert_eq!(decode(&mut buf, framing), Ok(None), "prefix of {cut} bytes");
        assert_eq!(&buf[..], &wire[..cut], "prefix must stay untouched");
        if cut >= BHS_LEN {
            assert_eq!(pdu_len(&wire[..cut], framing), Some(wire.len()));
        } else {
            assert_eq!(pdu_len(&wire[..cut], framing), None);
        }
    }
    let mut buf = BytesMut::from(wire);
    buf.extend_from_slice(b"next");
    let pdu = decode(&mut buf, framing).unwrap().unwrap();
    assert_eq!(&buf[..], b"next", "exactly the PDU is consumed");
    let enc = pdu.encode(framing);
    assert_eq!(enc.len(), wire.len());
    assert_eq!(enc.to_vec(), wire, "re-encoding gives the same bytes");
    let joined: Vec<u8> = enc.io_slices().iter().flat_map(|s| s.to_vec()).collect();
    assert_eq!(joined, wire);
    pdu
}

const LOGIN_BHS: &str = "43 87 00 00  00 00 00 16  80 12 34 56  00 01 00 00
                         00 00 00 01  00 02 00 00  00 00 00 0a  00 00 00 00
                         00 00 00 00  00 00 00 00  00 00 00 00  00 00 00 00";
const LOGIN_DATA: &str = "53 65 73 73 69 6f 6e 54 79 70 65 3d 44 69 73 63 6f 76 65 72 79 00"; // SessionType=Discovery\0

fn login_request() -> LoginRequest {
    LoginRequest {
        transit: true,
        continue_: false,
        csg: Stage::Operational,
        nsg: Stage::FullFeature,
        version_max: 0,
        version_min: 0,
        isid: Isid([0x80, 0x12, 0x34, 0x56, 0x00, 0x01]),
        tsih: 0,
        itt: 1,
        cid: 2,
        cmd_sn: 10,
        exp_stat_sn: 0,
        data: Bytes::from_static(b"SessionType=Discovery\0"),
    }
}

#[test]
fn login_request_golden() {
    let wire = hex(&format!("{LOGIN_BHS} {LOGIN_DATA} 00 00"));
    assert_eq!(wire.len(), 48 + 24);
    let pdu = golden(&wire, &plain());
    assert_eq!(pdu, Pdu::LoginRequest(login_request()));
    assert!(pdu.is_immediate());
    assert_eq!(pdu.opcode(), Opcode::LoginRequest);
    assert_eq!(pdu.itt(), 1);
}

#[test]
fn login_request_golden_with_digests() {
    let wire = hex(&format!(
        "{LOGIN_BHS} 6e f9 37 01 {LOGIN_DATA} 00 00 4f 87 68 12"
    ));
    let pdu = golden(&wire, &digests());
    assert_eq!(pdu, Pdu::LoginRequest(login_request()));
    let enc = pdu.encode(&digests());
    assert_eq!(enc.header().len(), 52);
    assert_eq!(enc.data().len(), 22);
    assert_eq!(enc.trailer(), &hex("00 00 4f 87 68 12")[..]);
}

// RFC 3720 appendix B.4: "An iSCSI - SCSI Read (10) Command PDU", header CRC 56 3a 96 d9.
const READ10_BHS: &str = "01 c0 00 00  00 00 00 00  00 00 00 00  00 00 00 00
                          14 00 00 00  00 00 04 00  00 00 00 14  00 00 00 18
                          28 00 00 00  00 00 00 00  02 00 00 00  00 00 00 00";

#[test]
fn read10_rfc3720_vector_with_header_digest() {
    let wire = hex(&format!("{READ10_BHS} 56 3a 96 d9"));
    let pdu = golden(&wire, &digests());
    let Pdu::ScsiCommand(c) = pdu else {
        panic!("not a SCSI command: {pdu:?}")
    };
    assert!(!c.immediate && c.final_ && c.read && !c.write);
    assert_eq!(c.attr, TaskAttr::Untagged);
    assert_eq!(c.itt, 0x1400_0000);
    assert_eq!(c.expected_data_transfer_length, 1024);
    assert_eq!(c.cmd_sn, 0x14);
    assert_eq!(c.exp_stat_sn, 0x18);
    assert_eq!(
        &c.cdb[..],
        &hex("28 00 00 00 00 00 00 00 02 00 00 00 00 00 00 00")[..]
    );
    assert_eq!(c.bidi_read_length, None);
    assert!(c.data.is_empty());

    // A flipped bit in the header is caught, and nothing is consumed.
    let mut bad = wire.clone();
    bad[20] ^= 0x01;
    let mut buf = BytesMut::from(&bad[..]);
    let err = decode(&mut buf, &digests()).unwrap_err();
    assert!(matches!(
        err,
        DecodeError::HeaderDigest {
            received: 0xd996_3a56,
            ..
        }
    ));
    assert!(!err.consumed());
    assert_eq!(buf.len(), bad.len());
}

const WRITE10_BHS: &str = "01 a1 00 00  00 00 02 00  00 01 00 00  00 00 00 00
                           00 00 00 07  00 00 02 00  00 00 00 03  00 00 00 01
                           2a 00 00 00  00 10 00 00  01 00 00 00  00 00 00 00";

fn write10() -> ScsiCommand {
    ScsiCommand {
        immediate: false,
        final_: true,
        read: false,
        write: true,
        attr: TaskAttr::Simple,
        lun: 0x0001_0000_0000_0000,
        itt: 7,
        expected_data_transfer_length: 512,
        cmd_sn: 3,
        exp_stat_sn: 1,
        cdb: Bytes::from(hex("2a 00 00 00 00 10 00 00 01 00 00 00 00 00 00 00")),
        bidi_read_length: None,
        data: Bytes::from(vec![0xab; 512]),
    }
}

#[test]
fn write10_with_immediate_data() {
    let mut wire = hex(WRITE10_BHS);
    wire.extend_from_slice(&[0xab; 512]);
    assert_eq!(golden(&wire, &plain()), Pdu::ScsiCommand(write10()));

    let mut wire = hex(WRITE10_BHS);
    wire.extend_from_slice(&hex("35 5d 1a dd"));
    wire.extend_from_slice(&[0xab; 512]);
    wire.extend_from_slice(&hex("2f e4 fd b2"));
    assert_eq!(golden(&wire, &digests()), Pdu::ScsiCommand(write10()));

    // Corrupt one payload byte: data digest error, PDU consumed, Reject 0x02 with the BHS.
    wire[52 + 100] ^= 0x40;
    let mut buf = BytesMut::from(&wire[..]);
    let err = decode(&mut buf, &digests()).unwrap_err();
    assert!(err.consumed());
    assert!(buf.is_empty());
    assert_eq!(err.reject_reason(), Some(0x02));
    match err {
        DecodeError::DataDigest {
            header,
            itt,
            received,
            damaged,
            ..
        } => {
            assert_eq!(itt, 7);
            assert_eq!(&header[..], &hex(WRITE10_BHS)[..]);
            assert_eq!(received, 0xb2fd_e42f);
            // The command itself, with the damaged data as received (for ERL 1 recovery).
            let Some(Pdu::ScsiCommand(c)) = damaged.as_deref() else {
                panic!("no command in {damaged:?}")
            };
            let mut want = write10();
            assert_ne!(c.data, want.data);
            want.data = c.data.clone();
            assert_eq!(c, &want);
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn zero_copy_payload() {
    let mut wire = hex(WRITE10_BHS);
    wire.extend_from_slice(&[0xab; 512]);
    let mut buf = BytesMut::from(&wire[..]);
    let base = buf.as_ptr() as usize;
    let Some(Pdu::ScsiCommand(c)) = decode(&mut buf, &plain()).unwrap() else {
        panic!()
    };
    assert_eq!(
        c.data.as_ptr() as usize,
        base + 48,
        "payload points into the receive buffer"
    );
    assert_eq!(c.cdb.as_ptr() as usize, base + 32);
    // Encoding hands the same payload back.
    let enc = Pdu::ScsiCommand(c.clone()).encode(&plain());
    assert_eq!(enc.data().as_ptr(), c.data.as_ptr());
}

const DATAIN_BHS: &str = "25 83 00 00  00 00 00 05  00 00 00 00  00 00 00 00
                          00 00 00 0a  ff ff ff ff  00 00 00 05  00 00 00 04
                          00 00 00 13  00 00 00 00  00 00 00 00  00 00 00 03";

#[test]
fn data_in_with_status() {
    let expected = Pdu::DataIn(DataIn {
        final_: true,
        ack: false,
        overflow: false,
        underflow: true,
        status: Some(0),
        lun: 0,
        itt: 10,
        ttt: RESERVED_TAG,
        stat_sn: 5,
        exp_cmd_sn: 4,
        max_cmd_sn: 0x13,
        data_sn: 0,
        buffer_offset: 0,
        residual_count: 3,
        data: Bytes::from_static(b"hello"),
    });
    let wire = hex(&format!("{DATAIN_BHS} 68 65 6c 6c 6f 00 00 00"));
    assert_eq!(golden(&wire, &plain()), expected);
    let wire = hex(&format!(
        "{DATAIN_BHS} e1 24 cb 2c 68 65 6c 6c 6f 00 00 00 b3 ed 03 90"
    ));
    assert_eq!(golden(&wire, &digests()), expected);
}

#[test]
fn data_in_status_without_final_is_invalid() {
    let mut wire = hex(&format!("{DATAIN_BHS} 68 65 6c 6c 6f 00 00 00"));
    wire[1] = 0x01;
    let mut buf = BytesMut::from(&wire[..]);
    let err = decode(&mut buf, &plain()).unwrap_err();
    assert!(matches!(
        err,
        DecodeError::InvalidField { opcode: 0x25, .. }
    ));
    assert!(err.consumed() && buf.is_empty());
    assert_eq!(err.reject_reason(), Some(0x09));
}

#[test]
fn r2t_golden() {
    let wire = hex("31 80 00 00  00 00 00 00  00 01 00 00  00 00 00 00
         00 00 00 07  00 00 10 00  00 00 00 05  00 00 00 04
         00 00 00 13  00 00 00 00  00 00 02 00  00 01 00 00");
    let expected = Pdu::R2t(R2t {
        lun: 0x0001_0000_0000_0000,
        itt: 7,
        ttt: 0x1000,
        stat_sn: 5,
        exp_cmd_sn: 4,
        max_cmd_sn: 0x13,
        r2t_sn: 0,
        buffer_offset: 0x200,
        desired_data_transfer_length: 0x1_0000,
    });
    assert_eq!(golden(&wire, &plain()), expected);
}

#[test]
fn reject_golden() {
    let wire = hex(&format!(
        "3f 80 09 00  00 00 00 30  00 00 00 00  00 00 00 00
         ff ff ff ff  00 00 00 00  00 00 00 06  00 00 00 04
         00 00 00 13  00 00 00 00  00 00 00 00  00 00 00 00
         {READ10_BHS}"
    ));
    let expected = Pdu::Reject(Reject {
        reason: 0x09,
        stat_sn: 6,
        exp_cmd_sn: 4,
        max_cmd_sn: 0x13,
        data_sn_r2t_sn: 0,
        header: Bytes::from(hex(READ10_BHS)),
    });
    let pdu = golden(&wire, &plain());
    assert_eq!(pdu, expected);
    assert_eq!(pdu.itt(), RESERVED_TAG);
}

#[test]
fn scsi_response_with_sense() {
    let wire = hex("21 80 00 02  00 00 00 14  00 00 00 00  00 00 00 00
         00 00 00 07  00 00 00 00  00 00 00 07  00 00 00 05
         00 00 00 14  00 00 00 00  00 00 00 00  00 00 00 00
         00 12 70 00  05 00 00 00  00 0a 00 00  00 00 24 00
         00 00 00 00");
    let sense = hex("70 00 05 00 00 00 00 0a 00 00 00 00 24 00 00 00 00 00");
    let expected = Pdu::ScsiResponse(ScsiResponse {
        bidi_overflow: false,
        bidi_underflow: false,
        overflow: false,
        underflow: false,
        response: 0,
        status: 0x02,
        itt: 7,
        snack_tag: 0,
        stat_sn: 7,
        exp_cmd_sn: 5,
        max_cmd_sn: 0x14,
        exp_data_sn: 0,
        bidi_residual_count: 0,
        residual_count: 0,
        sense: Bytes::from(sense),
    });
    assert_eq!(golden(&wire, &plain()), expected);

    // SenseLength larger than the segment.
    let mut bad = wire.clone();
    bad[49] = 0x13;
    let err = decode(&mut BytesMut::from(&bad[..]), &plain()).unwrap_err();
    assert!(matches!(
        err,
        DecodeError::InvalidField {
            field: "SenseLength",
            ..
        }
    ));
}

#[test]
fn extended_cdb_and_bidi_ahs() {
    // 32-byte CDB: 16 bytes in the BHS, AHSLength 17 (0x11) = reserved byte + 16 CDB bytes;
    // then the bidirectional read length AHS (AHSLength 5). TotalAHSLength = (20 + 8) / 4 = 7.
    let cdb: Vec<u8> = (0x40u8..0x60).collect();
    let wire = hex("01 e1 00 00  07 00 00 00  00 00 00 00  00 00 00 00
         00 00 00 09  00 00 10 00  00 00 00 21  00 00 00 02
         40 41 42 43  44 45 46 47  48 49 4a 4b  4c 4d 4e 4f
         00 11 01 00  50 51 52 53  54 55 56 57  58 59 5a 5b  5c 5d 5e 5f
         00 05 02 00  00 00 20 00");
    let expected = Pdu::ScsiCommand(ScsiCommand {
        immediate: false,
        final_: true,
        read: true,
        write: true,
        attr: TaskAttr::Simple,
        lun: 0,
        itt: 9,
        expected_data_transfer_length: 0x1000,
        cmd_sn: 0x21,
        exp_stat_sn: 2,
        cdb: Bytes::from(cdb),
        bidi_read_length: Some(0x2000),
        data: Bytes::new(),
    });
    assert_eq!(golden(&wire, &plain()), expected);

    // AHSLength running past TotalAHSLength.
    let mut bad = wire.clone();
    bad[49] = 0x40;
    let err = decode(&mut BytesMut::from(&bad[..]), &plain()).unwrap_err();
    assert!(matches!(
        err,
        DecodeError::InvalidField {
            field: "AHSLength",
            ..
        }
    ));
}

#[test]
fn data_segment_cap_checked_before_buffering() {
    // NOP-Out announcing 0x010000 bytes with only the BHS present.
    let wire = hex("00 80 00 00  00 01 00 00  00 00 00 00  00 00 00 00
         ff ff ff ff  ff ff ff ff  00 00 00 01  00 00 00 01
         00 00 00 00  00 00 00 00  00 00 00 00  00 00 00 00");
    let mut buf = BytesMut::from(&wire[..]);
    let err = decode(&mut buf, &plain()).unwrap_err();
    assert_eq!(
        err,
        DecodeError::DataSegmentTooLong {
            len: 0x1_0000,
            max: 8192
        }
    );
    assert!(!err.consumed());
    assert_eq!(buf.len(), 48);
    let big = Framing {
        max_data_segment_length: 0x1_0000,
        ..plain()
    };
    assert_eq!(decode(&mut buf, &big), Ok(None));
}

#[test]
fn unknown_opcode_consumed_after_whole_pdu() {
    let mut wire = hex("1c 80 00 00  00 00 00 04  00 00 00 00  00 00 00 00
         00 00 00 01  00 00 00 00  00 00 00 00  00 00 00 00
         00 00 00 00  00 00 00 00  00 00 00 00  00 00 00 00");
    wire.extend_from_slice(b"abcd");
    assert_eq!(decode(&mut BytesMut::from(&wire[..50]), &plain()), Ok(None));
    let mut buf = BytesMut::from(&wire[..]);
    let err = decode(&mut buf, &plain()).unwrap_err();
    assert!(matches!(
        err,
        DecodeError::UnknownOpcode { opcode: 0x1c, .. }
    ));
    assert!(err.consumed() && buf.is_empty());
    assert_eq!(err.rejected_header().unwrap().len(), 48);
    assert_eq!(err.reject_reason(), Some(reject_reason::PROTOCOL_ERROR));
}

#[test]
fn login_stage_two_is_invalid() {
    let mut wire = hex(&format!("{LOGIN_BHS} {LOGIN_DATA} 00 00"));
    wire[1] = 0x80 | (2 << 2) | 3;
    let err = decode(&mut BytesMut::from(&wire[..]), &plain()).unwrap_err();
    assert!(matches!(
        err,
        DecodeError::InvalidField { field: "CSG", .. }
    ));
    wire[1] = 0x80 | (1 << 2) | 2;
    let err = decode(&mut BytesMut::from(&wire[..]), &plain()).unwrap_err();
    assert!(matches!(
        err,
        DecodeError::InvalidField { field: "NSG", .. }
    ));
    wire[1] = 0xc0 | (1 << 2) | 3;
    let err = decode(&mut BytesMut::from(&wire[..]), &plain()).unwrap_err();
    assert!(matches!(err, DecodeError::InvalidField { .. }));
}

#[test]
fn try_encode_checks_peer_limit() {
    let mut cmd = write10();
    cmd.data = Bytes::from(vec![0u8; 8193]);
    let err = Pdu::ScsiCommand(cmd).try_encode(&plain()).unwrap_err();
    assert_eq!(
        err,
        EncodeError::DataSegmentTooLong {
            len: 8193,
            max: 8192
        }
    );
    assert!(Pdu::ScsiCommand(write10()).try_encode(&plain()).is_ok());
}

#[test]
fn pdus_back_to_back() {
    let mut wire = hex(&format!("{LOGIN_BHS} {LOGIN_DATA} 00 00"));
    wire.extend_from_slice(&hex(READ10_BHS));
    let mut buf = BytesMut::from(&wire[..]);
    assert!(matches!(
        decode(&mut buf, &plain()),
        Ok(Some(Pdu::LoginRequest(_)))
    ));
    assert!(matches!(
        decode(&mut buf, &plain()),
        Ok(Some(Pdu::ScsiCommand(_)))
    ));
    assert_eq!(decode(&mut buf, &plain()), Ok(None));
}

/// Without the S bit, O, U, StatSN and Residual Count are reserved (RFC 7143 11.7.1, 11.7.4,
/// 11.7.5): they decode as 0 so that garbage there never reaches ExpStatSN, and the PDU
/// re-encodes to what was decoded (found by fuzzing the decoder).
#[test]
fn data_in_without_status_ignores_reserved_fields() {
    let mut wire = hex(&format!("{DATAIN_BHS} 68 65 6c 6c 6f 00 00 00"));
    // F, O and U set, S clear; StatSN (bytes 24..28) is 5 and Residual Count (44..48) is 3.
    wire[1] = 0x86;
    let mut buf = BytesMut::from(&wire[..]);
    let pdu = decode(&mut buf, &plain()).unwrap().unwrap();
    assert!(buf.is_empty());
    let Pdu::DataIn(d) = &pdu else {
        panic!("{pdu:?}")
    };
    assert_eq!(d.status, None);
    assert!(!d.overflow && !d.underflow);
    assert_eq!((d.stat_sn, d.residual_count), (0, 0));
    assert_eq!((d.exp_cmd_sn, d.max_cmd_sn), (4, 0x13));
    let again = pdu.encode(&plain()).to_vec();
    let mut buf = BytesMut::from(&again[..]);
    assert_eq!(decode(&mut buf, &plain()).unwrap().unwrap(), pdu);
}

/// A header whose data segment length is over the limit sizes no reservation beyond the largest
/// PDU the framing takes, even before the header digest has been read and checked.
#[test]
fn a_bogus_length_does_not_size_a_reservation() {
    let mut bhs = vec![0u8; BHS_LEN];
    bhs[0] = 0x01;
    // DataSegmentLength 0xFFFFFF (16 MiB), TotalAHSLength 255 words.
    bhs[4] = 255;
    bhs[5..8].copy_from_slice(&[0xff, 0xff, 0xff]);
    let f = digests();
    let got = pdu_len(&bhs, &f).expect("a BHS");
    assert_eq!(got, max_pdu_len(&f));
    assert!(got <= BHS_LEN + 1020 + 4 + 8192 + 4, "{got}");
    // Within the limit, the length is the PDU's.
    bhs[4] = 0;
    bhs[5..8].copy_from_slice(&[0, 0x10, 0]);
    assert_eq!(pdu_len(&bhs, &f), Some(BHS_LEN + 4 + 4096 + 4));
}

/// A batch written through [`Gather`] in pieces of any size, a few slices at a time, is the
/// batch's bytes in order.
#[test]
fn gather_writes_a_batch_in_pieces() {
    let mut c = write10();
    c.data = Bytes::from((0..1001u32).map(|i| i as u8).collect::<Vec<_>>());
    let batch = [
        Pdu::ScsiCommand(c.clone()).encode(&digests()),
        Pdu::ScsiCommand(write10()).encode(&plain()),
        Pdu::ScsiCommand(c).encode(&plain()),
    ];
    let want: Vec<u8> = batch.iter().flat_map(|e| e.to_vec()).collect();
    for (max, step) in [
        (1usize, 1usize),
        (2, 7),
        (64, 100),
        (3, 4096),
        (64, 1 << 20),
    ] {
        let mut g = Gather::new(&batch);
        let mut got = Vec::new();
        while !g.done() {
            let slices = g.slices(max);
            assert!(!slices.is_empty() && slices.len() <= max);
            // The socket takes at most `step` bytes of what it is offered.
            let mut n = 0;
            for s in &slices {
                let take = s.len().min(step - n);
                got.extend_from_slice(&s[..take]);
                n += take;
                if n == step {
                    break;
                }
            }
            g.advance(n);
        }
        assert_eq!(got, want, "max {max} step {step}");
    }
}
