//! Sans-IO iSCSI (RFC 7143). No sockets, no threads, no clock reads: bytes in, typed values out;
//! time is passed in by the caller.
//!
//! - [`pdu`]: every PDU of RFC 7143 section 11, typed, with the codec: [`pdu::decode`] (need-more
//!   vs typed malformed errors that say whether the PDU was consumed, lengths capped before
//!   buffering, zero-copy payloads), [`pdu::pdu_len`], [`pdu::Bhs`] (a panic-free view of the
//!   48-byte header) and `Pdu::encode` into an [`pdu::Encoded`] of header, payload and trailer
//!   for vectored writes (AHS, padding, CRC32C header and data digests).
//! - [`data`]: a task's data as both sides cut it: PDUs and sequences, the first-burst rule,
//!   residuals.
//! - [`digest`]: CRC32C as iSCSI uses it, with its wire byte order.
//! - [`serial`]: 32-bit serial number arithmetic (RFC 1982) for CmdSN, StatSN, DataSN, R2TSN.
//! - [`seq`]: which PDUs take a StatSN and which only carry it, which carry the command window,
//!   a request's CmdSN, Reject construction (methods on [`pdu::Pdu`]).
//! - [`window`]: the command windows of both sides: the initiator's CmdSN credit and the
//!   target's in-order delivery across connections.
//! - [`text`]: `key=value\0` text segments, continuation over several PDUs, caps.
//! - [`keys`]: the negotiation table of RFC 7143 section 13, one table for both sides, the
//!   [`keys::Negotiator`] and the negotiated [`keys::SessionParams`] and
//!   [`keys::ConnectionParams`].
//! - [`login`]: status classes and details, and the login state machines of both sides
//!   ([`login::TargetLogin`], [`login::InitiatorLogin`]) with the [`login::LoginEnv`] and
//!   [`login::Authenticator`] seams.
//! - [`chap`]: CHAP (RFC 7143 12.1.3, RFC 1994) for both sides, one-way and mutual, MD5, SHA-1,
//!   SHA-256 and SHA3-256.
//! - [`vendor`]: mcsi's `X-org.mcsi.*` keys (the asymmetric mode and connection roles), one
//!   table row each for both sides.

pub mod chap;
mod codec;
pub mod codes;
pub mod data;
pub mod digest;
pub mod keys;
pub mod login;
pub mod pdu;
pub mod seq;
pub mod serial;
pub mod text;
pub mod vendor;
pub mod window;
