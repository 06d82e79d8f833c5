//! One module per subcommand. Each exposes its clap arguments and a `run` function.

pub mod bench;
pub mod copy;
pub mod lab;
pub mod link;
pub mod model;
pub mod target;
