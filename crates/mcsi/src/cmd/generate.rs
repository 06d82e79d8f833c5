//! `mcsi generate`: man pages and shell completions from the command line's own definition,
//! for packages (`scripts/package`) and for users who install by hand.

use anyhow::Context;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Write a man page for mcsi and one for each subcommand (mcsi-target.1, mcsi-ctl.1, ...)
    /// into a directory.
    Man {
        /// The directory (created if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Print the completion script of a shell (bash, zsh, fish, elvish, powershell).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

pub fn run(c: Command, mut cli: clap::Command) -> anyhow::Result<ExitCode> {
    match c {
        Command::Man { out } => {
            std::fs::create_dir_all(&out).with_context(|| format!("--out {}", out.display()))?;
            let n = man(&cli, &out, None)?;
            eprintln!("{n} man pages in {}", out.display());
        }
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut cli, "mcsi", &mut std::io::stdout());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes the page of `cmd` (named `parent-name` under a parent) and of its subcommands;
/// returns how many.
fn man(cmd: &clap::Command, dir: &Path, parent: Option<&str>) -> anyhow::Result<usize> {
    let name = match parent {
        Some(p) => format!("{p}-{}", cmd.get_name()),
        None => cmd.get_name().to_string(),
    };
    // clap takes a command's name as a static string; a generator runs once and exits.
    let leaked: &'static str = Box::leak(name.clone().into_boxed_str());
    let page = cmd.clone().name(leaked).bin_name(leaked);
    let path = dir.join(format!("{name}.1"));
    let mut f = std::fs::File::create(&path).with_context(|| format!("{}", path.display()))?;
    clap_mangen::Man::new(page).render(&mut f)?;
    let mut n = 1;
    for sub in cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
    {
        n += man(sub, dir, Some(&name))?;
    }
    Ok(n)
}
