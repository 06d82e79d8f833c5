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
//!   the server, sessions and connections per target). `portals`: the listening sockets,
//!   bound and closed while the server runs. [`admin`]: what changes a running server,
//!   starting it included (the configuration applied to an empty server).
//! - The session core is the crate `mcsi-target-core`, re-exported here as [`session_core`],
//!   [`keepalive`] and [`transfer`]: what a session decides, with no I/O (no async runtime,
//!   sockets, clock reads or threads; its own tests check its source and dependency graph):
//!   CmdSN order across connections, the task registry, task sets, held commands, a write's
//!   data and its R2Ts (MaxOutstandingR2T), Data-In sequences, response connections in the
//!   asymmetric mode, NOP-In pings on passed-in time. This crate is the tokio layer over it.
//! - `shard`: session threads (a session of several connections wholly on one thread).
//! - `session`: targets ([`Target`]), the session registry, and sessions: the core under a lock, with the
//!   tokio side of each task (what it needs to run, kept in the core until the core hands it
//!   out; only a running task has a future) and connection handles.
//! - `conn`: per-connection reader (decode, dispatch; the session core pings) and writer (StatSN
//!   stamping, vectored writes). `scsi`: one SCSI task from command to status. `control`: NOP, Text, Logout,
//!   Task Management. `text`: SendTargets.
//! - `counters`: what the hot path counts (atomics); [`stats`] shows it. `transport`: what a
//!   connection runs over.
//!
//! No two modules import each other, directly or around a circle
//! (`crates/mcsi/tests/module_graph.rs`):
//! server > login > admission > session, conn > control > scsi > session, and so on down to
//! leaves such as `counters`, `transport`, `config` and `name`.

pub mod admin;
pub(crate) mod admission;
pub mod config;
pub(crate) mod conn;
pub(crate) mod control;
pub(crate) mod counters;
pub(crate) mod login;
pub mod name;
pub(crate) mod portals;
pub mod saved;
pub(crate) mod scsi;
pub mod server;
pub(crate) mod session;
pub(crate) mod shard;
pub mod stats;
pub(crate) mod text;
pub(crate) mod transport;
pub(crate) mod units;

pub(crate) use mcsi_target_core::datain;
/// The session core, a crate of its own (`mcsi-target-core`) so that nothing async can creep in.
pub use mcsi_target_core::{keepalive, qos, session as session_core, transfer};

pub use config::ServerConfig;
pub use server::{Server, StartError};
pub use session::{SessionEnd, Target};
