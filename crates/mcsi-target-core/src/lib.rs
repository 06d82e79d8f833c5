//! The mcsi target's session core: what an iSCSI session (RFC 7143) decides in full feature
//! phase, with no I/O. No async runtime, no sockets, no clock reads, no threads, no files and no
//! randomness: inputs are method calls (a PDU's content arriving on a connection, a task ending,
//! a connection added or lost, the time now), outputs are return values. The same core runs
//! under `mcsi-target`'s tokio layer on sockets or in-process pipes, and can run on virtual time.
//! `crates/mcsi/tests/io_free_cores.rs` checks this crate's source and its whole dependency graph.
//!
//! - [`session`]: CmdSN order across a session's connections, the task registry with
//!   connection allegiance, task sets per LUN, held commands, a write's data and R2Ts
//!   (MaxOutstandingR2T), the response connection in the asymmetric mode.
//! - [`dispatch`]: where a PDU from the initiator goes (a command, data, a control request,
//!   the answer to a ping, or a Reject, with the CmdSN a rejected request uses up).
//! - [`command`]: what a SCSI Command PDU asks for when it arrives (task attribute, a write's
//!   transfer, whether it may run on its reader).
//! - [`control`]: NOP-Out, Logout and Task Management as plans (what to abort, in which
//!   scope, with which answer).
//! - [`keepalive`]: NOP-In pings and their timeout on passed-in time.
//! - [`offer`]: what the target offers at login and its protocol timers' defaults.
//! - [`qos`]: a session's bandwidth per direction (seed 004), token buckets on passed-in time.
//! - [`retain`]: what a connection keeps of what it sent for ErrorRecoveryLevel 1 (statuses,
//!   Data-In, R2Ts) and the SNACKs that ask for it again.
//! - [`report`]: when to send an mcsi initiator the target's TCP state (an Async Message).
//! - [`transfer`]: one write's Data-Out and R2T bookkeeping.
//! - [`datain`]: the PDUs that end a task (Data-In sequences, phase collapse, residuals).
//! - [`text`]: Text Request exchanges (requests in pieces, long answers fetched in pieces).
//! - [`taskset`]: task attribute ordering (SIMPLE, ORDERED, HEAD OF QUEUE).

pub mod command;
pub mod control;
pub mod datain;
pub mod dispatch;
pub mod keepalive;
pub mod offer;
pub mod qos;
pub mod report;
pub mod retain;
pub mod session;
pub mod taskset;
pub mod text;
pub mod transfer;
