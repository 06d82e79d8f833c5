//! The session's command window: [`mcsi_proto::window::CreditWindow`], written once in the
//! protocol crate for both sides (RFC 7143 4.2.2.1).

pub use mcsi_proto::window::{CreditWindow as CmdWindow, WindowUpdate};
