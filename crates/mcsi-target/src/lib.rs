//! The mcsi iSCSI target (RFC 7143) over tokio.
//!
//! Protocol logic (PDU codec, text keys, negotiation, login state machines) lives in the sans-IO
//! `mcsi-proto`; SCSI semantics live in `mcsi-scsi`, which knows nothing of iSCSI. This crate
//! drives both over TCP: portals, connections, sessions with many connections, command ordering,
//! data transfer and task management.
//!
//! Module map (`pub` modules are the library's API, the session core included, for programs
//! that drive it themselves such as a simulator; the others are internal):
//! - [`config`]: TOML config and CLI-built configuration, validated (limits, keepalive, CHAP
//!   users and allow-lists); [`name`]: iSCSI names.
//! - [`server`]: portals, accept loop, a connection's life, session create/join/reinstate,
//!   shutdown. A connection runs over any [`server::Transport`]: TCP from a portal, or a byte
//!   stream handed to [`Server::serve`] (an in-process pipe; tests use `tokio::io::duplex`). `login`: the login phase over the socket, driving mcsi-proto's `TargetLogin`
//!   (negotiation, CHAP) and answering its `LoginEnv` questions (targets, access, TSIHs).
//!   `admission`: limits a peer cannot exceed (logins per second per source, connections of
//!   the server, sessions and connections per target).
//! - [`session_core`]: what a session decides, with no I/O (no tokio, sockets, clock or threads;
//!   `tests/core_is_io_free.rs` checks it): CmdSN order across connections, the task registry,
//!   task sets, held commands, a write's data and its R2Ts (MaxOutstandingR2T), response
//!   connections in the asymmetric mode; [`keepalive`]: NOP-In pings on passed-in time. Unit
//!   tested without sockets or a runtime.
//! - `shard`: session threads (a session of several connections wholly on one thread).
//! - `session`: targets ([`Target`]), the session registry, and sessions: the core under a lock, with the
//!   tokio side of each task (its channels) and connection handles.
//! - `conn`: per-connection reader (decode, dispatch, NOP-In keepalive) and writer (StatSN
//!   stamping, vectored writes). `scsi`: one SCSI task from command to status. `control`: NOP, Text, Logout,
//!   Task Management. `text`: SendTargets.
//! - Plain data, unit tested: `window` (CmdSN window), `taskset` (task attributes),
//!   [`transfer`] (Data-Out / R2T bookkeeping), `datain` (the PDUs that end a task: Data-In
//!   sequences, phase collapse, residuals).

pub(crate) mod admission;
pub mod config;
pub(crate) mod conn;
pub(crate) mod control;
pub(crate) mod datain;
pub mod keepalive;
pub(crate) mod login;
pub mod name;
pub(crate) mod scsi;
pub mod server;
pub(crate) mod session;
pub mod session_core;
pub(crate) mod shard;
pub mod stats;
pub(crate) mod taskset;
pub(crate) mod text;
pub mod transfer;
pub(crate) mod window;

pub use config::ServerConfig;
pub use server::{Server, StartError};
pub use session::{SessionEnd, Target};
