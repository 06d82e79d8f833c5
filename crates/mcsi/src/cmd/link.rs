use std::process::ExitCode;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Placeholder while this subcommand is being built.
    Placeholder,
}

pub fn run(_c: Command) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
