//! What the kernel knows about a TCP connection, and which congestion control it runs.
//!
//! Both iSCSI sides use this crate: the initiator to place tasks and size its I/O, the target to
//! report its sending side, and both for statistics, metrics and the monitor.
//!
//! - [`info`]: a connection's state sampled from `TCP_INFO` ([`TcpState`]), with the fields the
//!   running kernel actually filled in.
//! - [`congestion`]: the congestion-control algorithm of a socket (`TCP_CONGESTION`), checked
//!   against what the kernel offers.

pub mod congestion;
pub mod info;

pub use congestion::{Congestion, CongestionError};
pub use info::{tcp_state, CaState, TcpState};
