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

/// `--bs-rule`, `--bs-min`, `--bs-max`: how `--bs auto` sizes sequential reads (`mcsi bench`,
/// `mcsi copy`).
#[derive(clap::Args, Debug, Clone)]
pub struct BsAutoArgs {
    /// With --bs auto: `bdp` (the session's measured bandwidth-delay product spread over the
    /// reads outstanding, doubling while the target runs out of data to send) or `cwnd` (seed
    /// 002: the target's cwnd x MSS, lowered on a reduction, held at the ceiling while stable).
    #[arg(long, default_value = "bdp", value_name = "RULE")]
    pub bs_rule: String,
    /// With --bs auto: the smallest and largest size.
    #[arg(long, default_value = "64KiB", value_name = "SIZE")]
    pub bs_min: String,
    #[arg(long, default_value = "8MiB", value_name = "SIZE")]
    pub bs_max: String,
}

impl BsAutoArgs {
    /// The rule and the bounds, checked.
    pub fn parse(&self) -> anyhow::Result<(mcsi_initiator::iosize::Rule, u64, u64)> {
        let rule = mcsi_initiator::iosize::Rule::parse(&self.bs_rule)
            .ok_or_else(|| anyhow::anyhow!("--bs-rule {}: use bdp or cwnd", self.bs_rule))?;
        let min =
            mcsi_units::parse_size(&self.bs_min).map_err(|e| anyhow::anyhow!("--bs-min: {e}"))?;
        let max =
            mcsi_units::parse_size(&self.bs_max).map_err(|e| anyhow::anyhow!("--bs-max: {e}"))?;
        if min == 0 || max < min || max > 16 << 20 {
            anyhow::bail!("--bs-min {min} and --bs-max {max}: need 0 < min <= max <= 16MiB");
        }
        Ok((rule, min, max))
    }
}
