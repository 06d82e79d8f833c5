//! iSCSI PDUs (RFC 7143 section 11): one typed struct per opcode, and the [`Pdu`] enum over them.
//!
//! Field names follow the RFC in snake_case. Data segments are `bytes::Bytes` slices of the
//! receive buffer: decoding never copies a payload, and encoding hands the payload back untouched
//! so that header and data go out in one vectored write.

use bytes::Bytes;

/// Length of the Basic Header Segment.
pub const BHS_LEN: usize = 48;

/// Opcodes (RFC 7143 section 11.1.1). Initiator opcodes are 0x00-0x1f, target opcodes 0x20-0x3f.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    NopOut = 0x00,
    ScsiCommand = 0x01,
    TaskMgmtRequest = 0x02,
    LoginRequest = 0x03,
    TextRequest = 0x04,
    DataOut = 0x05,
    LogoutRequest = 0x06,
    SnackRequest = 0x10,
    NopIn = 0x20,
    ScsiResponse = 0x21,
    TaskMgmtResponse = 0x22,
    LoginResponse = 0x23,
    TextResponse = 0x24,
    DataIn = 0x25,
    LogoutResponse = 0x26,
    R2t = 0x31,
    AsyncMessage = 0x32,
    Reject = 0x3f,
}

/// The reserved Initiator/Target Task Tag value (RFC 7143 section 11.1.3 / 11.18).
pub const RESERVED_TAG: u32 = 0xffff_ffff;

/// Login stages (RFC 7143 section 11.12.3): CSG and NSG fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    Security = 0,
    Operational = 1,
    /// Value 2 is reserved on the wire; a PDU carrying it is malformed.
    FullFeature = 3,
}

/// SCSI task attributes (RFC 7143 section 11.3.1, ATTR field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskAttr {
    Untagged,
    Simple,
    Ordered,
    HeadOfQueue,
    Aca,
    /// Values 5-7 are reserved; kept so the target can answer them.
    Reserved(u8),
}

/// The Initiator Session ID (6 bytes: T/A, A, B, C, D fields), kept as its raw bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Isid(pub [u8; 6]);

/// NOP-Out (11.18).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NopOut {
    pub immediate: bool,
    pub lun: u64,
    pub itt: u32,
    pub ttt: u32,
    pub cmd_sn: u32,
    pub exp_stat_sn: u32,
    /// Ping data, echoed in the NOP-In.
    pub data: Bytes,
}

/// SCSI Command (11.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScsiCommand {
    pub immediate: bool,
    /// F bit: no unsolicited Data-Out PDUs follow.
    pub final_: bool,
    pub read: bool,
    pub write: bool,
    pub attr: TaskAttr,
    pub lun: u64,
    pub itt: u32,
    pub expected_data_transfer_length: u32,
    pub cmd_sn: u32,
    pub exp_stat_sn: u32,
    /// The CDB: the 16 bytes of the BHS followed by the Extended CDB AHS, if any (11.3.5).
    /// Trailing zero padding of the 16-byte field is kept.
    pub cdb: Bytes,
    /// Bidirectional Read Expected Data Transfer Length AHS (11.3.6), if present.
    pub bidi_read_length: Option<u32>,
    /// Immediate data.
    pub data: Bytes,
}

/// Task Management Function Request (11.5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskMgmtRequest {
    pub immediate: bool,
    /// The function code (11.5.1): 1 ABORT TASK, 2 ABORT TASK SET, 3 CLEAR ACA, 4 CLEAR TASK SET,
    /// 5 LOGICAL UNIT RESET, 6 TARGET WARM RESET, 7 TARGET COLD RESET, 8 TASK REASSIGN.
    pub function: u8,
    pub lun: u64,
    pub itt: u32,
    pub referenced_task_tag: u32,
    pub cmd_sn: u32,
    pub exp_stat_sn: u32,
    pub ref_cmd_sn: u32,
    pub exp_data_sn: u32,
}

/// Login Request (11.12).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoginRequest {
    pub transit: bool,
    pub continue_: bool,
    pub csg: Stage,
    pub nsg: Stage,
    pub version_max: u8,
    pub version_min: u8,
    pub isid: Isid,
    pub tsih: u16,
    pub itt: u32,
    pub cid: u16,
    pub cmd_sn: u32,
    pub exp_stat_sn: u32,
    pub data: Bytes,
}

/// Text Request (11.10).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextRequest {
    pub immediate: bool,
    pub final_: bool,
    pub continue_: bool,
    pub lun: u64,
    pub itt: u32,
    pub ttt: u32,
    pub cmd_sn: u32,
    pub exp_stat_sn: u32,
    pub data: Bytes,
}

/// SCSI Data-Out (11.7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataOut {
    pub final_: bool,
    pub lun: u64,
    pub itt: u32,
    pub ttt: u32,
    pub exp_stat_sn: u32,
    pub data_sn: u32,
    pub buffer_offset: u32,
    pub data: Bytes,
}

/// Logout Request (11.14).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogoutRequest {
    pub immediate: bool,
    /// 0 close the session, 1 close the connection, 2 remove the connection for recovery.
    pub reason: u8,
    pub itt: u32,
    pub cid: u16,
    pub cmd_sn: u32,
    pub exp_stat_sn: u32,
}

/// SNACK Request (11.16).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnackRequest {
    /// 0 Data/R2T, 1 Status, 2 DataACK, 3 R-Data.
    pub snack_type: u8,
    pub lun: u64,
    pub itt: u32,
    pub ttt: u32,
    pub exp_stat_sn: u32,
    pub beg_run: u32,
    pub run_length: u32,
}

/// NOP-In (11.19).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NopIn {
    pub lun: u64,
    pub itt: u32,
    pub ttt: u32,
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
    pub data: Bytes,
}

/// SCSI Response (11.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScsiResponse {
    /// o bit.
    pub bidi_overflow: bool,
    /// u bit.
    pub bidi_underflow: bool,
    /// O bit.
    pub overflow: bool,
    /// U bit.
    pub underflow: bool,
    /// 0x00 Command Completed at Target, 0x01 Target Failure.
    pub response: u8,
    /// SCSI status (valid when response is 0).
    pub status: u8,
    pub itt: u32,
    pub snack_tag: u32,
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
    pub exp_data_sn: u32,
    pub bidi_residual_count: u32,
    pub residual_count: u32,
    /// Sense data without the 2-byte SenseLength prefix; the codec adds and strips it (11.4.7).
    pub sense: Bytes,
}

/// Task Management Function Response (11.6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskMgmtResponse {
    /// 0 complete, 1 task does not exist, 2 LUN does not exist, 3 task still allegiant,
    /// 4 reassignment not supported, 5 function not supported, 6 authorization failed,
    /// 255 rejected.
    pub response: u8,
    pub itt: u32,
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
}

/// Login Response (11.13).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoginResponse {
    pub transit: bool,
    pub continue_: bool,
    pub csg: Stage,
    pub nsg: Stage,
    pub version_max: u8,
    pub version_active: u8,
    pub isid: Isid,
    pub tsih: u16,
    pub itt: u32,
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
    pub status_class: u8,
    pub status_detail: u8,
    pub data: Bytes,
}

/// Text Response (11.11).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextResponse {
    pub final_: bool,
    pub continue_: bool,
    pub lun: u64,
    pub itt: u32,
    pub ttt: u32,
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
    pub data: Bytes,
}

/// SCSI Data-In (11.7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataIn {
    pub final_: bool,
    /// A bit (acknowledge requested; ERL > 0 only).
    pub ack: bool,
    /// O bit (only with status).
    pub overflow: bool,
    /// U bit (only with status).
    pub underflow: bool,
    /// S bit and Status field: `Some(status)` when this PDU carries the command's status.
    pub status: Option<u8>,
    pub lun: u64,
    pub itt: u32,
    pub ttt: u32,
    /// Meaningful only when `status` is set; otherwise sent as 0 (reserved).
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
    pub data_sn: u32,
    pub buffer_offset: u32,
    pub residual_count: u32,
    pub data: Bytes,
}

/// Logout Response (11.15).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogoutResponse {
    /// 0 closed, 1 CID not found, 2 recovery not supported, 3 cleanup failed.
    pub response: u8,
    pub itt: u32,
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
    pub time2wait: u16,
    pub time2retain: u16,
}

/// Ready To Transfer (11.8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct R2t {
    pub lun: u64,
    pub itt: u32,
    pub ttt: u32,
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
    pub r2t_sn: u32,
    pub buffer_offset: u32,
    pub desired_data_transfer_length: u32,
}

/// Asynchronous Message (11.9).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AsyncMessage {
    pub lun: u64,
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
    /// 0 SCSI event, 1 logout request, 2 connection drop, 3 session drop, 4 renegotiate,
    /// 5 task termination, 255 vendor.
    pub async_event: u8,
    pub async_vcode: u8,
    pub parameter1: u16,
    pub parameter2: u16,
    pub parameter3: u16,
    /// Sense data (for a SCSI event) and iSCSI event data, as on the wire after SenseLength.
    pub data: Bytes,
}

/// Reject (11.17).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    /// Reason code (11.17.1): 0x02 data digest error, 0x03 SNACK reject, 0x04 protocol error,
    /// 0x05 command not supported, 0x06 immediate command reject, 0x07 task in progress,
    /// 0x08 invalid data ack, 0x09 invalid PDU field, 0x0a long op reject, 0x0b deprecated,
    /// 0x0c waiting for logout.
    pub reason: u8,
    pub stat_sn: u32,
    pub exp_cmd_sn: u32,
    pub max_cmd_sn: u32,
    pub data_sn_r2t_sn: u32,
    /// The complete header (BHS) of the rejected PDU.
    pub header: Bytes,
}

/// Any iSCSI PDU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pdu {
    NopOut(NopOut),
    ScsiCommand(ScsiCommand),
    TaskMgmtRequest(TaskMgmtRequest),
    LoginRequest(LoginRequest),
    TextRequest(TextRequest),
    DataOut(DataOut),
    LogoutRequest(LogoutRequest),
    SnackRequest(SnackRequest),
    NopIn(NopIn),
    ScsiResponse(ScsiResponse),
    TaskMgmtResponse(TaskMgmtResponse),
    LoginResponse(LoginResponse),
    TextResponse(TextResponse),
    DataIn(DataIn),
    LogoutResponse(LogoutResponse),
    R2t(R2t),
    AsyncMessage(AsyncMessage),
    Reject(Reject),
}

pub use crate::codec::{
    decode, max_pdu_len, pdu_len, reject_reason, Bhs, DecodeError, EncodeError, Encoded, Framing,
    Gather, AHS_BIDI_READ_LENGTH, AHS_EXTENDED_CDB, MAX_AHS_LEN, MAX_CDB_LEN,
    MAX_DATA_SEGMENT_FIELD,
};
