//! mcsi-initiator: an iSCSI initiator (RFC 7143) whose sessions span many TCP connections
//! (MC/S), with a pluggable scheduler choosing the connection of each task.
//!
//! ```no_run
//! # async fn demo() -> Result<(), mcsi_initiator::Error> {
//! use mcsi_initiator::{connect, ConnectOptions, IscsiUrl};
//! let url = IscsiUrl::parse("iscsi://127.0.0.1:3260/iqn.2001-04.com.example:t1/1")?;
//! let session = connect(&url, ConnectOptions { connections: 4, ..Default::default() }).await?;
//! let lun = session.open_lun(url.lun).await?;
//! let data = lun.read(0, 8).await?;
//! lun.write(0, data).await?;
//! session.logout().await?;
//! # Ok(()) }
//! ```
//!
//! Layout: the session core, crate `mcsi-initiator-core` (re-exported here as [`core`],
//! [`negotiate`], [`task`], [`window`], [`error`], [`sense`]), holds the protocol logic with no
//! I/O and is unit-tested with plain values; login and negotiation are mcsi-proto's
//! ([`negotiate`] configures them); [`session`] drives everything over tokio with a reader and a
//! writer task per connection. Error recovery is level 0: a lost connection ends the session,
//! which is re-established with the same ISID (session reinstatement) and the commands that had
//! no status are issued again.
//!
//! The asymmetric mode of the thesis (4.3.2-4.3.3: requests on half the connections, responses
//! on the other half) is a vendor extension between mcsi peers ([`mcsi_proto::vendor`]):
//! [`ConnectOptions::asymmetric`] offers it, each login declares its connection's role, and when
//! the target agrees new tasks go only to request connections while the target sends R2T,
//! Data-In and status on the response connections. Responses are matched to tasks by Initiator
//! Task Tag session-wide, so they may arrive on any connection; Data-Out follows its command's
//! connection whichever connection carried the R2T.

mod conn;
pub mod discovery;
pub mod iosize;
pub mod lun;
pub mod route;
pub mod session;
pub mod url;
pub mod volume;

pub use mcsi_initiator_core::{core, error, negotiate, sense, task, window};

pub use crate::core::{Command, DataDir, Response};
pub use discovery::{discover, DiscoveredTarget};
pub use error::{Error, Scope, ScsiError};
pub use lun::{Capabilities, Capacity, Inquiry, Lun};
pub use mcsi_tcp::sched;
pub use mcsi_tcp::{Congestion, TcpState};
pub use negotiate::SessionParams;
pub use route::{Bind, BindError};
pub use sched::{ConnLoad, LeastOutstanding, RoundRobin, Scheduler, TaskInfo};
pub use sense::{Sense, SenseKey};
pub use session::{connect, ConnectOptions, ConnectionStats, Session, SessionStats};
pub use url::IscsiUrl;
pub use volume::{Device, Layout, MemberSpec, MirrorReads, Volume, VolumeSpec};
