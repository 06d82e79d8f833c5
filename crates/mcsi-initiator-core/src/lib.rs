//! The mcsi initiator's session core: what an iSCSI session (RFC 7143) decides on the initiator
//! side, with no I/O. No async runtime, no sockets, no clock reads, no threads, no files and no
//! randomness of its own: inputs are method calls (a PDU from a connection, a command to issue,
//! a connection up or closed, the time now), outputs are [`core::Action`]s and return values.
//! `mcsi-initiator` drives it over tokio; a test or a simulator can drive it on virtual time.
//! `crates/mcsi/tests/io_free_cores.rs` checks this crate's source and dependency graph.
//!
//! - [`core`]: the task table and tags, the CmdSN window, the scheduler's choice of connection,
//!   per-connection StatSN, the answers to target PDUs, and the session's timers.
//! - [`negotiate`]: one connection's login as a state machine, with its deadline.
//! - [`task`]: a write's unsolicited data and R2T answers, a read's Data-In assembly.
//! - [`window`]: the CmdSN window (written once, in mcsi-proto).
//! - [`error`] and [`sense`]: errors by reach, and sense data.

pub mod core;
pub mod error;
pub mod negotiate;
pub mod sense;
pub mod task;
pub mod window;

pub use mcsi_tcp::sched;
