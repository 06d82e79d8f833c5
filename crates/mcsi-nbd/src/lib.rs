//! mcsi-nbd: an NBD server, so that any program that speaks NBD (the Linux kernel's nbd client,
//! QEMU, libnbd's `nbdcopy` and `nbdinfo`, fio's nbd engine) can use a block device that only
//! mcsi can reach, such as an iSCSI LUN behind a session of many connections.
//!
//! [`proto`] is the wire format (fixed newstyle handshake, options, requests, simple and
//! structured replies) as plain functions; [`server`] drives it over TCP or a Unix socket for
//! anything that implements [`Export`]. The server takes care of what is the same for every
//! device: the handshake, bounds on what a client may have in flight, requests that are not
//! aligned to the device's block size (widened reads, read-modify-write), range and permission
//! checks, and a stop that lets the requests in flight finish.

pub mod proto;
pub mod server;

pub use server::{
    Export, ExportInfo, ExportStats, Listener, NbdError, Server, ServerOptions, SetupError,
};
