//! PDU framing, decoding and encoding (RFC 7143 section 11).
//!
//! Decoding runs in two steps: [`Bhs`], a view of the 48-byte Basic Header Segment whose accessors
//! cannot panic, gives the PDU's extent; then the whole PDU is split off the receive buffer and
//! turned into a typed [`Pdu`]. Payloads are slices of the split-off buffer (no copy).
//!
//! Wire layout of one PDU (11.1): BHS (48) | AHS (TotalAHSLength * 4) | HeaderDigest (4, if
//! negotiated) | data segment (DataSegmentLength, padded to a multiple of 4) | DataDigest (4, if
//! negotiated and the data segment is not empty). The header digest covers BHS and AHS; the data
//! digest covers the data segment and its padding.

use std::io::IoSlice;

use bytes::{Bytes, BytesMut};

use crate::digest::{self, Crc32c};
use crate::pdu::*;

/// Largest DataSegmentLength the 24-bit field can carry.
pub const MAX_DATA_SEGMENT_FIELD: u32 = 0x00ff_ffff;
/// Largest AHS the 8-bit TotalAHSLength field (in 4-byte words) can describe.
pub const MAX_AHS_LEN: usize = 255 * 4;
/// AHS types (11.2.1.2).
pub const AHS_EXTENDED_CDB: u8 = 1;
pub const AHS_BIDI_READ_LENGTH: u8 = 2;

/// Reject reason codes (11.17.1) the codec's errors map to.
pub mod reject_reason {
    pub const DATA_DIGEST_ERROR: u8 = 0x02;
    pub const SNACK_REJECT: u8 = 0x03;
    pub const PROTOCOL_ERROR: u8 = 0x04;
    pub const COMMAND_NOT_SUPPORTED: u8 = 0x05;
    pub const IMMEDIATE_COMMAND_REJECT: u8 = 0x06;
    pub const TASK_IN_PROGRESS: u8 = 0x07;
    pub const INVALID_DATA_ACK: u8 = 0x08;
    pub const INVALID_PDU_FIELD: u8 = 0x09;
    pub const LONG_OPERATION_REJECT: u8 = 0x0a;
    pub const DEPRECATED: u8 = 0x0b;
    pub const WAITING_FOR_LOGOUT: u8 = 0x0c;
}

/// Framing for one direction of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Framing {
    pub header_digest: bool,
    pub data_digest: bool,
    /// For receiving: our MaxRecvDataSegmentLength; longer data segments are refused before
    /// anything is buffered for them. For sending: the peer's (checked by [`Pdu::try_encode`]).
    pub max_data_segment_length: u32,
}

impl Default for Framing {
    /// No digests and 8192 bytes: the RFC default MaxRecvDataSegmentLength, which is also what a
    /// receiver must accept during login (RFC 7143 12.12).
    fn default() -> Self {
        Framing {
            header_digest: false,
            data_digest: false,
            max_data_segment_length: 8192,
        }
    }
}

impl Framing {
    fn header_digest_len(&self) -> usize {
        if self.header_digest {
            4
        } else {
            0
        }
    }
}

/// Why a PDU could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The header digest does not match. The header cannot be trusted, so neither can its length
    /// fields: nothing is consumed. At ErrorRecoveryLevel 0 the connection must be dropped.
    #[error("header digest mismatch: received {received:#010x}, computed {computed:#010x}")]
    HeaderDigest { received: u32, computed: u32 },
    /// The data digest does not match. The PDU was consumed; answer with Reject reason 0x02.
    #[error(
        "data digest mismatch (ITT {itt:#010x}): received {received:#010x}, computed {computed:#010x}"
    )]
    DataDigest {
        header: Bytes,
        itt: u32,
        received: u32,
        computed: u32,
        /// The PDU as its header describes it, with the data segment as received (not to be
        /// trusted): at ErrorRecoveryLevel 1 and above the receiver keeps the header's part
        /// (a Data-Out's place in its sequence, a command without its immediate data) and asks
        /// for the data again (RFC 7143 7.8). None when the header does not parse.
        damaged: Option<Box<Pdu>>,
    },
    /// DataSegmentLength exceeds what this side accepts (MaxRecvDataSegmentLength, 8192 during
    /// login). Nothing was consumed; this is a protocol error that ends the connection.
    #[error(
        "data segment of {len} bytes exceeds the limit of {max} bytes (MaxRecvDataSegmentLength)"
    )]
    DataSegmentTooLong { len: u32, max: u32 },
    /// An opcode RFC 7143 does not define. The PDU was consumed; answer with Reject 0x04
    /// (protocol error) or 0x05 (command not supported).
    #[error("unknown opcode {opcode:#04x}")]
    UnknownOpcode { opcode: u8, header: Bytes },
    /// A field holds a value the RFC does not allow. The PDU was consumed; answer with Reject 0x09.
    #[error("invalid value in PDU field {field} (opcode {opcode:#04x})")]
    InvalidField {
        field: &'static str,
        opcode: u8,
        header: Bytes,
    },
}

impl DecodeError {
    /// Whether the PDU's bytes were removed from the buffer (its extent was known), so the
    /// connection can answer with a Reject and go on with the next PDU.
    pub fn consumed(&self) -> bool {
        match self {
            DecodeError::HeaderDigest { .. } | DecodeError::DataSegmentTooLong { .. } => false,
            DecodeError::DataDigest { .. }
            | DecodeError::UnknownOpcode { .. }
            | DecodeError::InvalidField { .. } => true,
        }
    }

    /// The Reject reason (11.17.1) to answer with, for errors after which the connection can go on.
    pub fn reject_reason(&self) -> Option<u8> {
        match self {
            DecodeError::HeaderDigest { .. } | DecodeError::DataSegmentTooLong { .. } => None,
            DecodeError::DataDigest { .. } => Some(reject_reason::DATA_DIGEST_ERROR),
            // An opcode RFC 7143 does not define is a protocol error (11.17.1: "Command not
            // supported" is for a defined command the receiver does not implement).
            DecodeError::UnknownOpcode { .. } => Some(reject_reason::PROTOCOL_ERROR),
            DecodeError::InvalidField { .. } => Some(reject_reason::INVALID_PDU_FIELD),
        }
    }

    /// The BHS of the offending PDU (the data segment of a Reject), when it was consumed.
    pub fn rejected_header(&self) -> Option<&Bytes> {
        match self {
            DecodeError::HeaderDigest { .. } | DecodeError::DataSegmentTooLong { .. } => None,
            DecodeError::DataDigest { header, .. }
            | DecodeError::UnknownOpcode { header, .. }
            | DecodeError::InvalidField { header, .. } => Some(header),
        }
    }
}

/// Why a PDU could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("data segment of {len} bytes exceeds the peer's MaxRecvDataSegmentLength of {max}")]
    DataSegmentTooLong { len: usize, max: u32 },
    #[error("CDB of {len} bytes is longer than an Extended CDB AHS can carry (at most {max})")]
    CdbTooLong { len: usize, max: usize },
}

/// A read-only view of a 48-byte Basic Header Segment (11.2.1). Accessors read fixed offsets of a
/// 48-byte array and cannot panic.
#[derive(Debug, Clone, Copy)]
pub struct Bhs<'a>(&'a [u8; BHS_LEN]);

impl<'a> Bhs<'a> {
    /// The BHS at the front of `buf`, if `buf` holds at least 48 bytes.
    pub fn new(buf: &'a [u8]) -> Option<Self> {
        buf.get(..BHS_LEN)
            .and_then(|b| <&[u8; BHS_LEN]>::try_from(b).ok())
            .map(Bhs)
    }

    pub fn bytes(&self) -> &'a [u8; BHS_LEN] {
        self.0
    }

    pub fn byte(&self, off: usize) -> u8 {
        self.0.get(off).copied().unwrap_or(0)
    }

    pub fn be16(&self, off: usize) -> u16 {
        match self.0.get(off..off + 2) {
            Some(&[a, b]) => u16::from_be_bytes([a, b]),
            _ => 0,
        }
    }

    pub fn be32(&self, off: usize) -> u32 {
        match self.0.get(off..off + 4) {
            Some(&[a, b, c, d]) => u32::from_be_bytes([a, b, c, d]),
            _ => 0,
        }
    }

    pub fn be64(&self, off: usize) -> u64 {
        (u64::from(self.be32(off)) << 32) | u64::from(self.be32(off + 4))
    }

    /// The 6-bit opcode.
    pub fn opcode_raw(&self) -> u8 {
        self.byte(0) & 0x3f
    }

    pub fn opcode(&self) -> Option<Opcode> {
        Opcode::from_u8(self.opcode_raw())
    }

    /// I bit.
    pub fn immediate(&self) -> bool {
        self.byte(0) & 0x40 != 0
    }

    /// Byte 1: F bit and opcode-specific flags.
    pub fn flags(&self) -> u8 {
        self.byte(1)
    }

    /// TotalAHSLength in bytes.
    pub fn ahs_len(&self) -> usize {
        usize::from(self.byte(4)) * 4
    }

    pub fn data_segment_length(&self) -> u32 {
        (u32::from(self.byte(5)) << 16) | (u32::from(self.byte(6)) << 8) | u32::from(self.byte(7))
    }

    pub fn lun(&self) -> u64 {
        self.be64(8)
    }

    pub fn itt(&self) -> u32 {
        self.be32(16)
    }

    /// Bytes of the whole PDU under `framing`.
    pub fn pdu_len(&self, framing: &Framing) -> usize {
        let dsl = self.data_segment_length() as usize;
        let dd = if framing.data_digest && dsl > 0 { 4 } else { 0 };
        BHS_LEN + self.ahs_len() + framing.header_digest_len() + pad4(dsl) + dd
    }
}

impl Opcode {
    /// The opcode for a 6-bit value, if RFC 7143 defines it.
    pub fn from_u8(v: u8) -> Option<Opcode> {
        Some(match v {
            0x00 => Opcode::NopOut,
            0x01 => Opcode::ScsiCommand,
            0x02 => Opcode::TaskMgmtRequest,
            0x03 => Opcode::LoginRequest,
            0x04 => Opcode::TextRequest,
            0x05 => Opcode::DataOut,
            0x06 => Opcode::LogoutRequest,
            0x10 => Opcode::SnackRequest,
            0x20 => Opcode::NopIn,
            0x21 => Opcode::ScsiResponse,
            0x22 => Opcode::TaskMgmtResponse,
            0x23 => Opcode::LoginResponse,
            0x24 => Opcode::TextResponse,
            0x25 => Opcode::DataIn,
            0x26 => Opcode::LogoutResponse,
            0x31 => Opcode::R2t,
            0x32 => Opcode::AsyncMessage,
            0x3f => Opcode::Reject,
            _ => return None,
        })
    }

    /// Whether initiators send this opcode (0x00-0x1f).
    pub fn is_initiator(self) -> bool {
        (self as u8) < 0x20
    }
}

impl Stage {
    /// The stage for a 2-bit CSG/NSG value; 2 is reserved.
    pub fn from_u8(v: u8) -> Option<Stage> {
        match v {
            0 => Some(Stage::Security),
            1 => Some(Stage::Operational),
            3 => Some(Stage::FullFeature),
            _ => None,
        }
    }
}

impl TaskAttr {
    pub fn from_bits(v: u8) -> TaskAttr {
        match v & 7 {
            0 => TaskAttr::Untagged,
            1 => TaskAttr::Simple,
            2 => TaskAttr::Ordered,
            3 => TaskAttr::HeadOfQueue,
            4 => TaskAttr::Aca,
            r => TaskAttr::Reserved(r),
        }
    }

    pub fn bits(self) -> u8 {
        match self {
            TaskAttr::Untagged => 0,
            TaskAttr::Simple => 1,
            TaskAttr::Ordered => 2,
            TaskAttr::HeadOfQueue => 3,
            TaskAttr::Aca => 4,
            TaskAttr::Reserved(r) => r & 7,
        }
    }
}

fn pad4(n: usize) -> usize {
    (n + 3) & !3
}

/// Bytes needed for the next PDU once its BHS is in `buf` (for read sizing); `None` if fewer than
/// 48 bytes are buffered. Never more than [`max_pdu_len`]: with header digests the length
/// fields are read before the digest has vouched for them (and before [`decode`] refuses a data
/// segment over the limit), so a peer's bogus length must not size a reservation.
pub fn pdu_len(buf: &[u8], framing: &Framing) -> Option<usize> {
    Bhs::new(buf).map(|b| b.pdu_len(framing).min(max_pdu_len(framing)))
}

/// The largest PDU [`decode`] takes under `framing`: BHS, the largest AHS, header digest, the
/// largest data segment with its padding, data digest.
pub fn max_pdu_len(framing: &Framing) -> usize {
    let data_digest = if framing.data_digest { 4 } else { 0 };
    BHS_LEN
        + 1020
        + framing.header_digest_len()
        + pad4(framing.max_data_segment_length as usize)
        + data_digest
}

/// Decode one PDU from the front of `buf`.
///
/// `Ok(None)`: more bytes are needed; `buf` is untouched. On `Ok(Some)` and on errors whose
/// [`DecodeError::consumed`] is true, the PDU's bytes were removed from `buf`. Never panics; never
/// buffers more than the BHS, AHS (at most 1020 bytes) and a data segment within
/// `framing.max_data_segment_length`. Payloads are split off `buf` without copying.
pub fn decode(buf: &mut BytesMut, framing: &Framing) -> Result<Option<Pdu>, DecodeError> {
    let Some(bhs) = Bhs::new(buf) else {
        return Ok(None);
    };
    let ahs_len = bhs.ahs_len();
    let header_len = BHS_LEN + ahs_len;
    let dsl = bhs.data_segment_length();
    let total = bhs.pdu_len(framing);

    // Header digest first: the length fields are only trusted once the header checks out.
    if framing.header_digest {
        let Some(h) = buf.get(..header_len + 4) else {
            return Ok(None);
        };
        let computed = digest::crc32c(&h[..header_len]);
        let received = wire_digest(h, header_len);
        if computed != received {
            return Err(DecodeError::HeaderDigest { received, computed });
        }
    }
    if dsl > framing.max_data_segment_length {
        return Err(DecodeError::DataSegmentTooLong {
            len: dsl,
            max: framing.max_data_segment_length,
        });
    }
    if buf.len() < total {
        return Ok(None);
    }

    let pdu = buf.split_to(total).freeze();
    let header = pdu.slice(..BHS_LEN);
    let data_start = header_len + framing.header_digest_len();
    let dsl = dsl as usize;
    let data = pdu.slice(data_start..data_start + dsl);
    let bhs = Bhs::new(&pdu).ok_or(DecodeError::InvalidField {
        field: "BHS",
        opcode: 0,
        header: header.clone(),
    })?;

    if framing.data_digest && dsl > 0 {
        let padded_end = data_start + pad4(dsl);
        let computed = digest::crc32c(&pdu[data_start..padded_end]);
        let received = wire_digest(&pdu, padded_end);
        if computed != received {
            let ahs = &pdu[BHS_LEN..header_len];
            let damaged = parse(bhs, ahs, data, header.clone()).ok().map(Box::new);
            return Err(DecodeError::DataDigest {
                itt: bhs.itt(),
                header,
                received,
                computed,
                damaged,
            });
        }
    }

    let ahs = &pdu[BHS_LEN..header_len];
    parse(bhs, ahs, data, header).map(Some)
}

/// The digest stored at `off` (0 if out of range, which the length checks above rule out).
fn wire_digest(buf: &[u8], off: usize) -> u32 {
    match buf.get(off..off + 4) {
        Some(&[a, b, c, d]) => digest::from_wire([a, b, c, d]),
        _ => 0,
    }
}

fn invalid(field: &'static str, bhs: &Bhs<'_>, header: &Bytes) -> DecodeError {
    DecodeError::InvalidField {
        field,
        opcode: bhs.opcode_raw(),
        header: header.clone(),
    }
}

/// PDUs whose data segment must be empty.
fn no_data(bhs: &Bhs<'_>, data: &Bytes, header: &Bytes) -> Result<(), DecodeError> {
    if data.is_empty() {
        Ok(())
    } else {
        Err(invalid("DataSegmentLength", bhs, header))
    }
}

fn parse(bhs: Bhs<'_>, ahs: &[u8], data: Bytes, header: Bytes) -> Result<Pdu, DecodeError> {
    let Some(opcode) = bhs.opcode() else {
        return Err(DecodeError::UnknownOpcode {
            opcode: bhs.opcode_raw(),
            header,
        });
    };
    let f = bhs.flags();
    let final_ = f & 0x80 != 0;
    let b = &bhs;
    Ok(match opcode {
        Opcode::NopOut => Pdu::NopOut(NopOut {
            immediate: b.immediate(),
            lun: b.lun(),
            itt: b.itt(),
            ttt: b.be32(20),
            cmd_sn: b.be32(24),
            exp_stat_sn: b.be32(28),
            data,
        }),
        Opcode::ScsiCommand => {
            let (cdb, bidi_read_length) = parse_command_ahs(b, ahs, &header)?;
            Pdu::ScsiCommand(ScsiCommand {
                immediate: b.immediate(),
                final_,
                read: f & 0x40 != 0,
                write: f & 0x20 != 0,
                attr: TaskAttr::from_bits(f),
                lun: b.lun(),
                itt: b.itt(),
                expected_data_transfer_length: b.be32(20),
                cmd_sn: b.be32(24),
                exp_stat_sn: b.be32(28),
                cdb,
                bidi_read_length,
                data,
            })
        }
        Opcode::TaskMgmtRequest => {
            no_data(b, &data, &header)?;
            Pdu::TaskMgmtRequest(TaskMgmtRequest {
                immediate: b.immediate(),
                function: f & 0x7f,
                lun: b.lun(),
                itt: b.itt(),
                referenced_task_tag: b.be32(20),
                cmd_sn: b.be32(24),
                exp_stat_sn: b.be32(28),
                ref_cmd_sn: b.be32(32),
                exp_data_sn: b.be32(36),
            })
        }
        Opcode::LoginRequest => {
            let (transit, continue_, csg, nsg) = login_flags(b, &header)?;
            Pdu::LoginRequest(LoginRequest {
                transit,
                continue_,
                csg,
                nsg,
                version_max: b.byte(2),
                version_min: b.byte(3),
                isid: isid(b),
                tsih: b.be16(14),
                itt: b.itt(),
                cid: b.be16(20),
                cmd_sn: b.be32(24),
                exp_stat_sn: b.be32(28),
                data,
            })
        }
        Opcode::TextRequest => Pdu::TextRequest(TextRequest {
            immediate: b.immediate(),
            final_,
            continue_: f & 0x40 != 0,
            lun: b.lun(),
            itt: b.itt(),
            ttt: b.be32(20),
            cmd_sn: b.be32(24),
            exp_stat_sn: b.be32(28),
            data,
        }),
        Opcode::DataOut => Pdu::DataOut(DataOut {
            final_,
            lun: b.lun(),
            itt: b.itt(),
            ttt: b.be32(20),
            exp_stat_sn: b.be32(28),
            data_sn: b.be32(36),
            buffer_offset: b.be32(40),
            data,
        }),
        Opcode::LogoutRequest => {
            no_data(b, &data, &header)?;
            Pdu::LogoutRequest(LogoutRequest {
                immediate: b.immediate(),
                reason: f & 0x7f,
                itt: b.itt(),
                cid: b.be16(20),
                cmd_sn: b.be32(24),
                exp_stat_sn: b.be32(28),
            })
        }
        Opcode::SnackRequest => {
            no_data(b, &data, &header)?;
            Pdu::SnackRequest(SnackRequest {
                snack_type: f & 0x0f,
                lun: b.lun(),
                itt: b.itt(),
                ttt: b.be32(20),
                exp_stat_sn: b.be32(28),
                beg_run: b.be32(40),
                run_length: b.be32(44),
            })
        }
        Opcode::NopIn => Pdu::NopIn(NopIn {
            lun: b.lun(),
            itt: b.itt(),
            ttt: b.be32(20),
            stat_sn: b.be32(24),
            exp_cmd_sn: b.be32(28),
            max_cmd_sn: b.be32(32),
            data,
        }),
        Opcode::ScsiResponse => {
            // 11.4.7: the data segment starts with a 2-byte SenseLength.
            let sense = if data.is_empty() {
                Bytes::new()
            } else {
                let Some(&[hi, lo]) = data.get(..2) else {
                    return Err(invalid("SenseLength", b, &header));
                };
                let len = usize::from(u16::from_be_bytes([hi, lo]));
                if 2 + len > data.len() {
                    return Err(invalid("SenseLength", b, &header));
                }
                data.slice(2..2 + len)
            };
            Pdu::ScsiResponse(ScsiResponse {
                bidi_overflow: f & 0x10 != 0,
                bidi_underflow: f & 0x08 != 0,
                overflow: f & 0x04 != 0,
                underflow: f & 0x02 != 0,
                response: b.byte(2),
                status: b.byte(3),
                itt: b.itt(),
                snack_tag: b.be32(20),
                stat_sn: b.be32(24),
                exp_cmd_sn: b.be32(28),
                max_cmd_sn: b.be32(32),
                exp_data_sn: b.be32(36),
                bidi_residual_count: b.be32(40),
                residual_count: b.be32(44),
                sense,
            })
        }
        Opcode::TaskMgmtResponse => {
            no_data(b, &data, &header)?;
            Pdu::TaskMgmtResponse(TaskMgmtResponse {
                response: b.byte(2),
                itt: b.itt(),
                stat_sn: b.be32(24),
                exp_cmd_sn: b.be32(28),
                max_cmd_sn: b.be32(32),
            })
        }
        Opcode::LoginResponse => {
            let (transit, continue_, csg, nsg) = login_flags(b, &header)?;
            Pdu::LoginResponse(LoginResponse {
                transit,
                continue_,
                csg,
                nsg,
                version_max: b.byte(2),
                version_active: b.byte(3),
                isid: isid(b),
                tsih: b.be16(14),
                itt: b.itt(),
                stat_sn: b.be32(24),
                exp_cmd_sn: b.be32(28),
                max_cmd_sn: b.be32(32),
                status_class: b.byte(36),
                status_detail: b.byte(37),
                data,
            })
        }
        Opcode::TextResponse => Pdu::TextResponse(TextResponse {
            final_,
            continue_: f & 0x40 != 0,
            lun: b.lun(),
            itt: b.itt(),
            ttt: b.be32(20),
            stat_sn: b.be32(24),
            exp_cmd_sn: b.be32(28),
            max_cmd_sn: b.be32(32),
            data,
        }),
        Opcode::DataIn => {
            let has_status = f & 0x01 != 0;
            // 11.7.2: the S bit may only be set together with the F bit.
            if has_status && !final_ {
                return Err(invalid("S bit without F bit", b, &header));
            }
            // 11.7.1, 11.7.4, 11.7.5: O, U, StatSN and Residual Count only mean something with
            // the S bit; without it they are reserved and read as 0 (a stray StatSN must not
            // reach the caller's ExpStatSN).
            let with_status = |v: u32| if has_status { v } else { 0 };
            Pdu::DataIn(DataIn {
                final_,
                ack: f & 0x40 != 0,
                overflow: has_status && f & 0x04 != 0,
                underflow: has_status && f & 0x02 != 0,
                status: has_status.then(|| b.byte(3)),
                lun: b.lun(),
                itt: b.itt(),
                ttt: b.be32(20),
                stat_sn: with_status(b.be32(24)),
                exp_cmd_sn: b.be32(28),
                max_cmd_sn: b.be32(32),
                data_sn: b.be32(36),
                buffer_offset: b.be32(40),
                residual_count: with_status(b.be32(44)),
                data,
            })
        }
        Opcode::LogoutResponse => {
            no_data(b, &data, &header)?;
            Pdu::LogoutResponse(LogoutResponse {
                response: b.byte(2),
                itt: b.itt(),
                stat_sn: b.be32(24),
                exp_cmd_sn: b.be32(28),
                max_cmd_sn: b.be32(32),
                time2wait: b.be16(40),
                time2retain: b.be16(42),
            })
        }
        Opcode::R2t => {
            no_data(b, &data, &header)?;
            Pdu::R2t(R2t {
                lun: b.lun(),
                itt: b.itt(),
                ttt: b.be32(20),
                stat_sn: b.be32(24),
                exp_cmd_sn: b.be32(28),
                max_cmd_sn: b.be32(32),
                r2t_sn: b.be32(36),
                buffer_offset: b.be32(40),
                desired_data_transfer_length: b.be32(44),
            })
        }
        Opcode::AsyncMessage => Pdu::AsyncMessage(AsyncMessage {
            lun: b.lun(),
            stat_sn: b.be32(24),
            exp_cmd_sn: b.be32(28),
            max_cmd_sn: b.be32(32),
            async_event: b.byte(36),
            async_vcode: b.byte(37),
            parameter1: b.be16(38),
            parameter2: b.be16(40),
            parameter3: b.be16(42),
            data,
        }),
        Opcode::Reject => Pdu::Reject(Reject {
            reason: b.byte(2),
            stat_sn: b.be32(24),
            exp_cmd_sn: b.be32(28),
            max_cmd_sn: b.be32(32),
            data_sn_r2t_sn: b.be32(36),
            header: data,
        }),
    })
}

fn isid(b: &Bhs<'_>) -> Isid {
    let r = b.bytes();
    Isid([r[8], r[9], r[10], r[11], r[12], r[13]])
}

/// T, C, CSG and NSG of a Login Request or Response (11.12.1-11.12.3).
fn login_flags(b: &Bhs<'_>, header: &Bytes) -> Result<(bool, bool, Stage, Stage), DecodeError> {
    let f = b.flags();
    let transit = f & 0x80 != 0;
    let continue_ = f & 0x40 != 0;
    let csg = Stage::from_u8((f >> 2) & 3).ok_or_else(|| invalid("CSG", b, header))?;
    // NSG is only meaningful with T set; otherwise it is reserved and reported as CSG.
    let nsg = if transit {
        Stage::from_u8(f & 3).ok_or_else(|| invalid("NSG", b, header))?
    } else {
        csg
    };
    if transit && continue_ {
        // 11.12.2: T and C must not both be set.
        return Err(invalid("T and C bits both set", b, header));
    }
    Ok((transit, continue_, csg, nsg))
}

/// The CDB (BHS bytes 32-47 plus an Extended CDB AHS) and the Bidirectional Read Expected Data
/// Transfer Length AHS of a SCSI Command (11.2.1.2, 11.3.5, 11.3.6).
fn parse_command_ahs(
    b: &Bhs<'_>,
    mut ahs: &[u8],
    header: &Bytes,
) -> Result<(Bytes, Option<u32>), DecodeError> {
    let base = &b.bytes()[32..48];
    let mut ext: Option<&[u8]> = None;
    let mut bidi = None;
    while !ahs.is_empty() {
        let Some(&[l0, l1, ahs_type, _]) = ahs.get(..4) else {
            return Err(invalid("AHSLength", b, header));
        };
        // AHSLength counts the bytes after AHSType, including the byte that follows it.
        let len = usize::from(u16::from_be_bytes([l0, l1]));
        if len == 0 {
            return Err(invalid("AHSLength", b, header));
        }
        let Some(body) = ahs.get(4..3 + len) else {
            return Err(invalid("AHSLength", b, header));
        };
        match ahs_type {
            AHS_EXTENDED_CDB => {
                if ext.is_some() {
                    return Err(invalid("Extended CDB AHS repeated", b, header));
                }
                ext = Some(body);
            }
            AHS_BIDI_READ_LENGTH => {
                let Some(&[x0, x1, x2, x3]) = body.get(..4) else {
                    return Err(invalid("Bidirectional Read AHS", b, header));
                };
                if len != 5 || bidi.is_some() {
                    return Err(invalid("Bidirectional Read AHS", b, header));
                }
                bidi = Some(u32::from_be_bytes([x0, x1, x2, x3]));
            }
            // Reserved and vendor-specific AHS types carry nothing we use.
            _ => {}
        }
        let step = pad4(3 + len);
        ahs = ahs.get(step..).unwrap_or(&[]);
    }
    let cdb = match ext {
        None => header.slice(32..48),
        Some(e) => {
            let mut v = Vec::with_capacity(16 + e.len());
            v.extend_from_slice(base);
            v.extend_from_slice(e);
            Bytes::from(v)
        }
    };
    Ok((cdb, bidi))
}

/// Header buffer of an encoded PDU: inline for the common BHS (+ header digest) case.
#[derive(Debug, Clone)]
enum HeaderBuf {
    Inline { buf: [u8; BHS_LEN + 4], len: u8 },
    Heap(Vec<u8>),
}

impl HeaderBuf {
    fn as_slice(&self) -> &[u8] {
        match self {
            HeaderBuf::Inline { buf, len } => &buf[..usize::from(*len)],
            HeaderBuf::Heap(v) => v,
        }
    }
}

/// An encoded PDU: header (BHS + AHS + header digest), data (the payload, not copied) and trailer
/// (padding + data digest, at most 7 bytes), ready for one vectored write.
#[derive(Debug, Clone)]
pub struct Encoded {
    header: HeaderBuf,
    data: Bytes,
    trailer: [u8; 7],
    trailer_len: u8,
}

impl Encoded {
    /// Total bytes on the wire.
    pub fn len(&self) -> usize {
        self.header().len() + self.data.len() + self.trailer().len()
    }

    /// Never true: every PDU has a 48-byte BHS.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn io_slices(&self) -> [IoSlice<'_>; 3] {
        [
            IoSlice::new(self.header()),
            IoSlice::new(&self.data),
            IoSlice::new(self.trailer()),
        ]
    }

    pub fn header(&self) -> &[u8] {
        self.header.as_slice()
    }

    pub fn data(&self) -> &Bytes {
        &self.data
    }

    pub fn trailer(&self) -> &[u8] {
        &self.trailer[..usize::from(self.trailer_len)]
    }

    /// The PDU as one contiguous buffer (copies; for tests and small PDUs).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        v.extend_from_slice(self.header());
        v.extend_from_slice(&self.data);
        v.extend_from_slice(self.trailer());
        v
    }
}

/// A batch of encoded PDUs as the slices of a vectored write, and how far the writes have got:
/// both sides' writers [`Gather::fill`] their slices, write them, and [`Gather::advance`] by
/// what the socket took, until [`Gather::done`]. Empty pieces (no payload, no padding) are left
/// out. It walks the batch in place: nothing is allocated per batch.
#[derive(Debug)]
pub struct Gather<'a> {
    batch: &'a [Encoded],
    /// The first piece not wholly written (PDU, and 0 header, 1 data, 2 trailer), and how much
    /// of it was.
    pdu: usize,
    piece: usize,
    off: usize,
}

impl<'a> Gather<'a> {
    pub fn new(batch: &'a [Encoded]) -> Self {
        let mut g = Gather {
            batch,
            pdu: 0,
            piece: 0,
            off: 0,
        };
        g.skip_empty();
        g
    }

    fn piece(&self, pdu: usize, piece: usize) -> &'a [u8] {
        let batch: &'a [Encoded] = self.batch;
        match (batch.get(pdu), piece) {
            (Some(e), 0) => e.header(),
            (Some(e), 1) => &e.data()[..],
            (Some(e), _) => e.trailer(),
            (None, _) => &[],
        }
    }

    /// Moves past empty pieces to the next one with bytes left.
    fn skip_empty(&mut self) {
        while self.pdu < self.batch.len() && self.piece(self.pdu, self.piece).len() == self.off {
            self.off = 0;
            self.piece += 1;
            if self.piece == 3 {
                self.piece = 0;
                self.pdu += 1;
            }
        }
    }

    /// Everything was written.
    pub fn done(&self) -> bool {
        self.pdu >= self.batch.len()
    }

    /// Puts what is left into `out` (cleared first) as at most `max` slices, at least one while
    /// anything is left.
    pub fn fill(&self, out: &mut Vec<IoSlice<'a>>, max: usize) {
        out.clear();
        let (mut pdu, mut piece, mut off) = (self.pdu, self.piece, self.off);
        while pdu < self.batch.len() && out.len() < max.max(1) {
            let b = self.piece(pdu, piece);
            if b.len() > off {
                out.push(IoSlice::new(&b[off..]));
            }
            off = 0;
            piece += 1;
            if piece == 3 {
                piece = 0;
                pdu += 1;
            }
        }
    }

    /// What is left, as at most `max` slices ([`Gather::fill`] into a new vector).
    pub fn slices(&self, max: usize) -> Vec<IoSlice<'a>> {
        let mut out = Vec::new();
        self.fill(&mut out, max);
        out
    }

    /// `n` more bytes were written.
    pub fn advance(&mut self, mut n: usize) {
        while n > 0 && !self.done() {
            let rem = self.piece(self.pdu, self.piece).len() - self.off;
            let k = n.min(rem);
            self.off += k;
            n -= k;
            self.skip_empty();
        }
    }
}

/// A BHS under construction.
struct BhsBuf([u8; BHS_LEN]);

impl BhsBuf {
    fn new(opcode: Opcode, immediate: bool, flags: u8) -> Self {
        let mut b = [0u8; BHS_LEN];
        b[0] = opcode as u8 | if immediate { 0x40 } else { 0 };
        b[1] = flags;
        BhsBuf(b)
    }
    fn u8(&mut self, off: usize, v: u8) -> &mut Self {
        self.0[off] = v;
        self
    }
    fn u16(&mut self, off: usize, v: u16) -> &mut Self {
        self.0[off..off + 2].copy_from_slice(&v.to_be_bytes());
        self
    }
    fn u32(&mut self, off: usize, v: u32) -> &mut Self {
        self.0[off..off + 4].copy_from_slice(&v.to_be_bytes());
        self
    }
    fn u64(&mut self, off: usize, v: u64) -> &mut Self {
        self.0[off..off + 8].copy_from_slice(&v.to_be_bytes());
        self
    }
    fn isid(&mut self, isid: &Isid) -> &mut Self {
        self.0[8..14].copy_from_slice(&isid.0);
        self
    }
}

fn login_flag_byte(transit: bool, continue_: bool, csg: Stage, nsg: Stage) -> u8 {
    (if transit { 0x80 } else { 0 })
        | (if continue_ { 0x40 } else { 0 })
        | ((csg as u8) << 2)
        | if transit { nsg as u8 } else { 0 }
}

fn flag(b: bool, bit: u8) -> u8 {
    if b {
        bit
    } else {
        0
    }
}

/// Largest CDB a single Extended CDB AHS carries: 16 bytes in the BHS plus AHSLength - 1 bytes,
/// bounded by TotalAHSLength (1020 bytes of AHS, 4 of them AHS header).
pub const MAX_CDB_LEN: usize = 16 + MAX_AHS_LEN - 4 - 8;

impl Pdu {
    pub fn opcode(&self) -> Opcode {
        match self {
            Pdu::NopOut(_) => Opcode::NopOut,
            Pdu::ScsiCommand(_) => Opcode::ScsiCommand,
            Pdu::TaskMgmtRequest(_) => Opcode::TaskMgmtRequest,
            Pdu::LoginRequest(_) => Opcode::LoginRequest,
            Pdu::TextRequest(_) => Opcode::TextRequest,
            Pdu::DataOut(_) => Opcode::DataOut,
            Pdu::LogoutRequest(_) => Opcode::LogoutRequest,
            Pdu::SnackRequest(_) => Opcode::SnackRequest,
            Pdu::NopIn(_) => Opcode::NopIn,
            Pdu::ScsiResponse(_) => Opcode::ScsiResponse,
            Pdu::TaskMgmtResponse(_) => Opcode::TaskMgmtResponse,
            Pdu::LoginResponse(_) => Opcode::LoginResponse,
            Pdu::TextResponse(_) => Opcode::TextResponse,
            Pdu::DataIn(_) => Opcode::DataIn,
            Pdu::LogoutResponse(_) => Opcode::LogoutResponse,
            Pdu::R2t(_) => Opcode::R2t,
            Pdu::AsyncMessage(_) => Opcode::AsyncMessage,
            Pdu::Reject(_) => Opcode::Reject,
        }
    }

    /// The Initiator Task Tag (0xffffffff for Async Message and Reject, which carry none).
    pub fn itt(&self) -> u32 {
        match self {
            Pdu::NopOut(p) => p.itt,
            Pdu::ScsiCommand(p) => p.itt,
            Pdu::TaskMgmtRequest(p) => p.itt,
            Pdu::LoginRequest(p) => p.itt,
            Pdu::TextRequest(p) => p.itt,
            Pdu::DataOut(p) => p.itt,
            Pdu::LogoutRequest(p) => p.itt,
            Pdu::SnackRequest(p) => p.itt,
            Pdu::NopIn(p) => p.itt,
            Pdu::ScsiResponse(p) => p.itt,
            Pdu::TaskMgmtResponse(p) => p.itt,
            Pdu::LoginResponse(p) => p.itt,
            Pdu::TextResponse(p) => p.itt,
            Pdu::DataIn(p) => p.itt,
            Pdu::LogoutResponse(p) => p.itt,
            Pdu::R2t(p) => p.itt,
            Pdu::AsyncMessage(_) | Pdu::Reject(_) => RESERVED_TAG,
        }
    }

    /// The I bit (Login Requests always carry it, 11.12).
    pub fn is_immediate(&self) -> bool {
        match self {
            Pdu::NopOut(p) => p.immediate,
            Pdu::ScsiCommand(p) => p.immediate,
            Pdu::TaskMgmtRequest(p) => p.immediate,
            Pdu::LoginRequest(_) => true,
            Pdu::TextRequest(p) => p.immediate,
            Pdu::LogoutRequest(p) => p.immediate,
            _ => false,
        }
    }

    /// The length of the data segment as it goes on the wire, without padding or digests, and
    /// without touching the buffers (a clone of a buffer built as a `Vec` allocates).
    pub fn data_len(&self) -> usize {
        match self {
            Pdu::NopOut(p) => p.data.len(),
            Pdu::ScsiCommand(p) => p.data.len(),
            Pdu::LoginRequest(p) => p.data.len(),
            Pdu::TextRequest(p) => p.data.len(),
            Pdu::DataOut(p) => p.data.len(),
            Pdu::NopIn(p) => p.data.len(),
            Pdu::ScsiResponse(p) if p.sense.is_empty() => 0,
            Pdu::ScsiResponse(p) => 2 + p.sense.len().min(usize::from(u16::MAX)),
            Pdu::LoginResponse(p) => p.data.len(),
            Pdu::TextResponse(p) => p.data.len(),
            Pdu::DataIn(p) => p.data.len(),
            Pdu::AsyncMessage(p) => p.data.len(),
            Pdu::Reject(p) => p.header.len(),
            Pdu::TaskMgmtRequest(_)
            | Pdu::LogoutRequest(_)
            | Pdu::SnackRequest(_)
            | Pdu::TaskMgmtResponse(_)
            | Pdu::LogoutResponse(_)
            | Pdu::R2t(_) => 0,
        }
    }

    /// The data segment as it goes on the wire (for a SCSI Response, SenseLength + sense data).
    pub fn data_segment(&self) -> Bytes {
        match self {
            Pdu::NopOut(p) => p.data.clone(),
            Pdu::ScsiCommand(p) => p.data.clone(),
            Pdu::LoginRequest(p) => p.data.clone(),
            Pdu::TextRequest(p) => p.data.clone(),
            Pdu::DataOut(p) => p.data.clone(),
            Pdu::NopIn(p) => p.data.clone(),
            Pdu::ScsiResponse(p) => {
                if p.sense.is_empty() {
                    Bytes::new()
                } else {
                    let len = p.sense.len().min(usize::from(u16::MAX));
                    let mut v = Vec::with_capacity(2 + len);
                    v.extend_from_slice(&(len as u16).to_be_bytes());
                    v.extend_from_slice(&p.sense[..len]);
                    Bytes::from(v)
                }
            }
            Pdu::LoginResponse(p) => p.data.clone(),
            Pdu::TextResponse(p) => p.data.clone(),
            Pdu::DataIn(p) => p.data.clone(),
            Pdu::AsyncMessage(p) => p.data.clone(),
            Pdu::Reject(p) => p.header.clone(),
            Pdu::TaskMgmtRequest(_)
            | Pdu::LogoutRequest(_)
            | Pdu::SnackRequest(_)
            | Pdu::TaskMgmtResponse(_)
            | Pdu::LogoutResponse(_)
            | Pdu::R2t(_) => Bytes::new(),
        }
    }

    /// Encode, checking the data segment against `framing.max_data_segment_length` (the peer's
    /// MaxRecvDataSegmentLength) and the CDB against what an Extended CDB AHS can carry.
    pub fn try_encode(&self, framing: &Framing) -> Result<Encoded, EncodeError> {
        let data = self.data_segment();
        if data.len() > framing.max_data_segment_length as usize {
            return Err(EncodeError::DataSegmentTooLong {
                len: data.len(),
                max: framing.max_data_segment_length,
            });
        }
        if let Pdu::ScsiCommand(c) = self {
            if c.cdb.len() > MAX_CDB_LEN {
                return Err(EncodeError::CdbTooLong {
                    len: c.cdb.len(),
                    max: MAX_CDB_LEN,
                });
            }
        }
        Ok(self.encode_with(framing, data))
    }

    /// Encode like [`Pdu::encode`], moving the data segment out of the PDU rather than sharing
    /// it: sharing a buffer that was built as a `Vec` first allocates a reference-counted header
    /// for it, once per Data-In of a read.
    pub fn encode_owned(mut self, framing: &Framing) -> Encoded {
        let data = self.take_data_segment();
        self.encode_with(framing, data)
    }

    /// The data segment, left empty in the PDU where it is a field of its own.
    fn take_data_segment(&mut self) -> Bytes {
        match self {
            Pdu::NopOut(p) => std::mem::take(&mut p.data),
            Pdu::ScsiCommand(p) => std::mem::take(&mut p.data),
            Pdu::LoginRequest(p) => std::mem::take(&mut p.data),
            Pdu::TextRequest(p) => std::mem::take(&mut p.data),
            Pdu::DataOut(p) => std::mem::take(&mut p.data),
            Pdu::NopIn(p) => std::mem::take(&mut p.data),
            Pdu::LoginResponse(p) => std::mem::take(&mut p.data),
            Pdu::TextResponse(p) => std::mem::take(&mut p.data),
            Pdu::DataIn(p) => std::mem::take(&mut p.data),
            Pdu::AsyncMessage(p) => std::mem::take(&mut p.data),
            other => other.data_segment(),
        }
    }

    /// Encode. The caller keeps data segments within the peer's MaxRecvDataSegmentLength
    /// ([`Pdu::try_encode`] checks it). Fields that cannot be represented are clamped: a data
    /// segment beyond 2^24 - 1 bytes is cut there and a CDB beyond [`MAX_CDB_LEN`] bytes is cut.
    pub fn encode(&self, framing: &Framing) -> Encoded {
        self.encode_with(framing, self.data_segment())
    }

    fn encode_with(&self, framing: &Framing, mut data: Bytes) -> Encoded {
        debug_assert!(data.len() <= MAX_DATA_SEGMENT_FIELD as usize);
        if data.len() > MAX_DATA_SEGMENT_FIELD as usize {
            data.truncate(MAX_DATA_SEGMENT_FIELD as usize);
        }
        let mut ahs: Vec<u8> = Vec::new();
        let bhs = self.bhs(&mut ahs);
        let mut bhs = bhs.0;
        debug_assert!(ahs.len() & 3 == 0 && ahs.len() <= MAX_AHS_LEN);
        bhs[4] = (ahs.len() / 4) as u8;
        let dsl = data.len() as u32;
        bhs[5..8].copy_from_slice(&dsl.to_be_bytes()[1..]);

        let header = if ahs.is_empty() {
            let mut buf = [0u8; BHS_LEN + 4];
            buf[..BHS_LEN].copy_from_slice(&bhs);
            let mut len = BHS_LEN;
            if framing.header_digest {
                buf[BHS_LEN..].copy_from_slice(&digest::to_wire(digest::crc32c(&bhs)));
                len += 4;
            }
            HeaderBuf::Inline {
                buf,
                len: len as u8,
            }
        } else {
            let mut v = Vec::with_capacity(BHS_LEN + ahs.len() + 4);
            v.extend_from_slice(&bhs);
            v.extend_from_slice(&ahs);
            if framing.header_digest {
                let d = digest::crc32c(&v);
                v.extend_from_slice(&digest::to_wire(d));
            }
            HeaderBuf::Heap(v)
        };

        let mut trailer = [0u8; 7];
        let pad = pad4(data.len()) - data.len();
        let mut trailer_len = pad;
        if framing.data_digest && !data.is_empty() {
            let mut c = Crc32c::new();
            c.update(&data);
            c.update(&[0u8; 3][..pad]);
            trailer[pad..pad + 4].copy_from_slice(&digest::to_wire(c.finish()));
            trailer_len += 4;
        }
        Encoded {
            header,
            data,
            trailer,
            trailer_len: trailer_len as u8,
        }
    }

    /// The BHS without TotalAHSLength and DataSegmentLength; AHS bytes go to `ahs`.
    fn bhs(&self, ahs: &mut Vec<u8>) -> BhsBuf {
        match self {
            Pdu::NopOut(p) => {
                let mut b = BhsBuf::new(Opcode::NopOut, p.immediate, 0x80);
                b.u64(8, p.lun)
                    .u32(16, p.itt)
                    .u32(20, p.ttt)
                    .u32(24, p.cmd_sn)
                    .u32(28, p.exp_stat_sn);
                b
            }
            Pdu::ScsiCommand(p) => {
                let flags =
                    flag(p.final_, 0x80) | flag(p.read, 0x40) | flag(p.write, 0x20) | p.attr.bits();
                let mut b = BhsBuf::new(Opcode::ScsiCommand, p.immediate, flags);
                b.u64(8, p.lun)
                    .u32(16, p.itt)
                    .u32(20, p.expected_data_transfer_length)
                    .u32(24, p.cmd_sn)
                    .u32(28, p.exp_stat_sn);
                let cdb = &p.cdb[..p.cdb.len().min(MAX_CDB_LEN)];
                let first = cdb.len().min(16);
                b.0[32..32 + first].copy_from_slice(&cdb[..first]);
                if cdb.len() > 16 {
                    // 11.3.5: AHSLength = CDB length - 15 (the reserved byte plus the CDB's rest).
                    let rest = &cdb[16..];
                    let len = rest.len() + 1;
                    ahs.extend_from_slice(&(len as u16).to_be_bytes());
                    ahs.push(AHS_EXTENDED_CDB);
                    ahs.push(0);
                    ahs.extend_from_slice(rest);
                    ahs.resize(pad4(ahs.len()), 0);
                }
                if let Some(len) = p.bidi_read_length {
                    ahs.extend_from_slice(&[0x00, 0x05, AHS_BIDI_READ_LENGTH, 0x00]);
                    ahs.extend_from_slice(&len.to_be_bytes());
                }
                b
            }
            Pdu::TaskMgmtRequest(p) => {
                let mut b = BhsBuf::new(
                    Opcode::TaskMgmtRequest,
                    p.immediate,
                    0x80 | (p.function & 0x7f),
                );
                b.u64(8, p.lun)
                    .u32(16, p.itt)
                    .u32(20, p.referenced_task_tag)
                    .u32(24, p.cmd_sn)
                    .u32(28, p.exp_stat_sn)
                    .u32(32, p.ref_cmd_sn)
                    .u32(36, p.exp_data_sn);
                b
            }
            Pdu::LoginRequest(p) => {
                let flags = login_flag_byte(p.transit, p.continue_, p.csg, p.nsg);
                let mut b = BhsBuf::new(Opcode::LoginRequest, true, flags);
                b.u8(2, p.version_max)
                    .u8(3, p.version_min)
                    .isid(&p.isid)
                    .u16(14, p.tsih)
                    .u32(16, p.itt)
                    .u16(20, p.cid)
                    .u32(24, p.cmd_sn)
                    .u32(28, p.exp_stat_sn);
                b
            }
            Pdu::TextRequest(p) => {
                let flags = flag(p.final_, 0x80) | flag(p.continue_, 0x40);
                let mut b = BhsBuf::new(Opcode::TextRequest, p.immediate, flags);
                b.u64(8, p.lun)
                    .u32(16, p.itt)
                    .u32(20, p.ttt)
                    .u32(24, p.cmd_sn)
                    .u32(28, p.exp_stat_sn);
                b
            }
            Pdu::DataOut(p) => {
                let mut b = BhsBuf::new(Opcode::DataOut, false, flag(p.final_, 0x80));
                b.u64(8, p.lun)
                    .u32(16, p.itt)
                    .u32(20, p.ttt)
                    .u32(28, p.exp_stat_sn)
                    .u32(36, p.data_sn)
                    .u32(40, p.buffer_offset);
                b
            }
            Pdu::LogoutRequest(p) => {
                let mut b =
                    BhsBuf::new(Opcode::LogoutRequest, p.immediate, 0x80 | (p.reason & 0x7f));
                b.u32(16, p.itt)
                    .u16(20, p.cid)
                    .u32(24, p.cmd_sn)
                    .u32(28, p.exp_stat_sn);
                b
            }
            Pdu::SnackRequest(p) => {
                let mut b = BhsBuf::new(Opcode::SnackRequest, false, 0x80 | (p.snack_type & 0x0f));
                b.u64(8, p.lun)
                    .u32(16, p.itt)
                    .u32(20, p.ttt)
                    .u32(28, p.exp_stat_sn)
                    .u32(40, p.beg_run)
                    .u32(44, p.run_length);
                b
            }
            Pdu::NopIn(p) => {
                let mut b = BhsBuf::new(Opcode::NopIn, false, 0x80);
                b.u64(8, p.lun)
                    .u32(16, p.itt)
                    .u32(20, p.ttt)
                    .u32(24, p.stat_sn)
                    .u32(28, p.exp_cmd_sn)
                    .u32(32, p.max_cmd_sn);
                b
            }
            Pdu::ScsiResponse(p) => {
                let flags = 0x80
                    | flag(p.bidi_overflow, 0x10)
                    | flag(p.bidi_underflow, 0x08)
                    | flag(p.overflow, 0x04)
                    | flag(p.underflow, 0x02);
                let mut b = BhsBuf::new(Opcode::ScsiResponse, false, flags);
                b.u8(2, p.response)
                    .u8(3, p.status)
                    .u32(16, p.itt)
                    .u32(20, p.snack_tag)
                    .u32(24, p.stat_sn)
                    .u32(28, p.exp_cmd_sn)
                    .u32(32, p.max_cmd_sn)
                    .u32(36, p.exp_data_sn)
                    .u32(40, p.bidi_residual_count)
                    .u32(44, p.residual_count);
                b
            }
            Pdu::TaskMgmtResponse(p) => {
                let mut b = BhsBuf::new(Opcode::TaskMgmtResponse, false, 0x80);
                b.u8(2, p.response)
                    .u32(16, p.itt)
                    .u32(24, p.stat_sn)
                    .u32(28, p.exp_cmd_sn)
                    .u32(32, p.max_cmd_sn);
                b
            }
            Pdu::LoginResponse(p) => {
                let flags = login_flag_byte(p.transit, p.continue_, p.csg, p.nsg);
                let mut b = BhsBuf::new(Opcode::LoginResponse, false, flags);
                b.u8(2, p.version_max)
                    .u8(3, p.version_active)
                    .isid(&p.isid)
                    .u16(14, p.tsih)
                    .u32(16, p.itt)
                    .u32(24, p.stat_sn)
                    .u32(28, p.exp_cmd_sn)
                    .u32(32, p.max_cmd_sn)
                    .u8(36, p.status_class)
                    .u8(37, p.status_detail);
                b
            }
            Pdu::TextResponse(p) => {
                let flags = flag(p.final_, 0x80) | flag(p.continue_, 0x40);
                let mut b = BhsBuf::new(Opcode::TextResponse, false, flags);
                b.u64(8, p.lun)
                    .u32(16, p.itt)
                    .u32(20, p.ttt)
                    .u32(24, p.stat_sn)
                    .u32(28, p.exp_cmd_sn)
                    .u32(32, p.max_cmd_sn);
                b
            }
            Pdu::DataIn(p) => {
                let mut flags = flag(p.final_, 0x80) | flag(p.ack, 0x40);
                if p.status.is_some() {
                    // 11.7.2: status only travels in the last Data-In (F set).
                    flags |= 0x80 | 0x01 | flag(p.overflow, 0x04) | flag(p.underflow, 0x02);
                }
                let mut b = BhsBuf::new(Opcode::DataIn, false, flags);
                b.u8(3, p.status.unwrap_or(0))
                    .u64(8, p.lun)
                    .u32(16, p.itt)
                    .u32(20, p.ttt)
                    .u32(24, if p.status.is_some() { p.stat_sn } else { 0 })
                    .u32(28, p.exp_cmd_sn)
                    .u32(32, p.max_cmd_sn)
                    .u32(36, p.data_sn)
                    .u32(40, p.buffer_offset)
                    .u32(
                        44,
                        if p.status.is_some() {
                            p.residual_count
                        } else {
                            0
                        },
                    );
                b
            }
            Pdu::LogoutResponse(p) => {
                let mut b = BhsBuf::new(Opcode::LogoutResponse, false, 0x80);
                b.u8(2, p.response)
                    .u32(16, p.itt)
                    .u32(24, p.stat_sn)
                    .u32(28, p.exp_cmd_sn)
                    .u32(32, p.max_cmd_sn)
                    .u16(40, p.time2wait)
                    .u16(42, p.time2retain);
                b
            }
            Pdu::R2t(p) => {
                let mut b = BhsBuf::new(Opcode::R2t, false, 0x80);
                b.u64(8, p.lun)
                    .u32(16, p.itt)
                    .u32(20, p.ttt)
                    .u32(24, p.stat_sn)
                    .u32(28, p.exp_cmd_sn)
                    .u32(32, p.max_cmd_sn)
                    .u32(36, p.r2t_sn)
                    .u32(40, p.buffer_offset)
                    .u32(44, p.desired_data_transfer_length);
                b
            }
            Pdu::AsyncMessage(p) => {
                let mut b = BhsBuf::new(Opcode::AsyncMessage, false, 0x80);
                b.u64(8, p.lun)
                    .u32(16, RESERVED_TAG)
                    .u32(24, p.stat_sn)
                    .u32(28, p.exp_cmd_sn)
                    .u32(32, p.max_cmd_sn)
                    .u8(36, p.async_event)
                    .u8(37, p.async_vcode)
                    .u16(38, p.parameter1)
                    .u16(40, p.parameter2)
                    .u16(42, p.parameter3);
                b
            }
            Pdu::Reject(p) => {
                let mut b = BhsBuf::new(Opcode::Reject, false, 0x80);
                b.u8(2, p.reason)
                    .u32(16, RESERVED_TAG)
                    .u32(24, p.stat_sn)
                    .u32(28, p.exp_cmd_sn)
                    .u32(32, p.max_cmd_sn)
                    .u32(36, p.data_sn_r2t_sn);
                b
            }
        }
    }
}
