//! One module per subcommand. Each exposes its clap arguments and a `run` function.

pub mod bench;
pub mod copy;
pub mod http;
pub mod lab;
pub mod link;
pub mod model;
pub mod monitor;
pub mod observe;
pub mod target;

/// `--congestion NAME`: checked against the kernel when the tool starts, so that a name it does
/// not offer is reported at once, with the names it does.
pub fn congestion_arg(name: Option<&str>) -> anyhow::Result<Option<mcsi_initiator::Congestion>> {
    let Some(name) = name else { return Ok(None) };
    let cc =
        mcsi_initiator::Congestion::new(name).map_err(|e| anyhow::anyhow!("--congestion: {e}"))?;
    cc.check()
        .map_err(|e| anyhow::anyhow!("--congestion: {e}"))?;
    Ok(Some(cc))
}
