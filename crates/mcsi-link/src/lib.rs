//! mcsi-link: puts a command behind an emulated link.
//!
//! The emulation is a sans-IO core, [`Link`]: packets go in with a timestamp
//! ([`Link::enqueue`]), come out when due ([`Link::poll_transmit`]), and [`Link::next_deadline`]
//! says when to look again. Per direction a packet meets the loss model, a drop-tail queue, a
//! serializer at the configured rate and a delay line with jitter; with an 802.11 profile the
//! serializer is replaced by one half-duplex medium whose service time is each frame's airtime,
//! shared by both directions. Time is virtual, so every model is tested without sleeping.
//!
//! ```
//! use mcsi_link::{Dir, Link, LinkConfig, PathBy, PathConfig};
//!
//! let mut path = PathConfig::default();
//! path.apply_spec("rate=1mbit,delay=5ms").unwrap();
//! let cfg = LinkConfig { paths: vec![path], path_by: PathBy::Hash, seed: 1 };
//! let mut link = Link::new(&cfg).unwrap();
//! // A 1250-byte packet at t = 0: 10 ms on the wire at 1 Mbit/s, then 5 ms of delay.
//! link.enqueue(Dir::Up, vec![0x45; 1250], 0).unwrap();
//! assert_eq!(link.next_deadline(), Some(10_000_000));
//! assert!(link.poll_transmit(10_000_000).is_none());
//! let out = link.poll_transmit(15_000_000).unwrap();
//! assert_eq!((out.dir, out.at), (Dir::Up, 15_000_000));
//! ```
//!
//! [`run`] is the thin layer that touches the system: a network namespace for the command,
//! a TUN device on each side, a forwarding thread with sub-millisecond timers, signals and
//! cleanup.

pub mod config;
pub mod control;
pub mod dir;
pub mod link;
pub mod loss;
pub mod pcap;
pub mod run;
pub mod stats;
mod sys;
pub mod wifi;

pub use config::{ConfigError, DirConfig, JitterDist, LinkConfig, PathBy, PathConfig, QueueLimit};
pub use dir::DropCause;
pub use link::{Delivery, Dir, FlowKey, Link, PathError, PathEvent};
pub use loss::LossModel;
pub use stats::{DirStats, PathStats, Summary};
pub use wifi::WifiParams;

/// Nanoseconds on the link's clock.
pub type Nanos = u64;
