//! What the kernel knows about a TCP connection, and which congestion control it runs.
//!
//! Both iSCSI sides use this crate: the initiator to place tasks and size its I/O, the target to
//! report its sending side, and both for statistics, metrics and the monitor.
//!
//! - [`info`]: a connection's state sampled from `TCP_INFO` ([`TcpState`]), with the fields the
//!   running kernel actually filled in.
//! - [`congestion`]: the congestion-control algorithm of a socket (`TCP_CONGESTION`), checked
//!   against what the kernel offers.
//! - [`mptcp`]: Multipath TCP sockets and what the kernel says of their subflows.
//! - [`pace`]: a token bucket on passed-in time that paces what a session sends, and the bytes
//!   a send costs on the wire.
//! - [`sched`]: the policies that choose a connection for each task from its load and TCP
//!   state (round-robin, least-outstanding, tcp-aware, weighted, failover).

pub mod congestion;
pub mod info;
pub mod mptcp;
pub mod pace;
pub mod sched;

pub use congestion::{Congestion, CongestionError};
pub use info::{tcp_state, CaState, TcpState};
