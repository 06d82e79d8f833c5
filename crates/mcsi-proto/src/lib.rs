//! Sans-IO iSCSI (RFC 7143). No sockets, no threads, no clock reads: bytes in, typed values out;
//! time is passed in by the caller.
//!
//! - [`pdu`]: every PDU of RFC 7143 section 11, typed, with encode and decode (AHS, padding,
//!   CRC32C header and data digests).
//! - [`digest`]: CRC32C as iSCSI uses it.
//! - [`serial`]: 32-bit serial number arithmetic (RFC 1982) for CmdSN, StatSN, DataSN, R2TSN.
//! - [`text`]: `key=value\0` text segments.
//! - [`keys`]: the negotiation table of RFC 7143 section 13, one table for both sides.
//! - [`login`]: login stages, status classes and details, and the login state machines.

pub mod digest;
pub mod keys;
pub mod login;
pub mod pdu;
pub mod serial;
pub mod text;
