//! One module per subcommand. Each exposes its clap arguments and a `run` function.

pub mod link;
pub mod model;
pub mod target;
