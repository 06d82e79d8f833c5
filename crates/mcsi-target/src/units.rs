//! A logical unit made from its LUN spec, with a stable identity: what starting a target and
//! adding a LUN to a running one (`mcsi ctl add-lun`) both do.

use crate::config::{LunBackend, LunSpec};
use mcsi_scsi::backend::{open_backend, Backend, BackendError, ServiceTimeBackend};
use mcsi_scsi::{LogicalUnit, LuConfig};
use std::sync::Arc;

/// Opens the backend of LUN `lun` of target `iqn` and makes its logical unit. A stable
/// identity: serial and NAA from a hash of the stored data's own name where it has one (an RBD
/// image, the same through every gateway), else of the target's name and the LUN number.
/// `state_dir`: where the unit keeps persistent reservations made with APTPL (a file named
/// by its NAA identifier under `pr/`), and reloads them from when it opens; none: APTPL is
/// refused.
pub fn build_lu(
    iqn: &str,
    lun: u16,
    l: &LunSpec,
    state_dir: Option<&std::path::Path>,
) -> Result<Arc<LogicalUnit>, BackendError> {
    let backend = match &l.backend {
        LunBackend::Spec(spec) => open_backend(spec)?,
        LunBackend::Opened(b) => b.clone(),
    };
    let backend: Arc<dyn Backend> = if l.service_time.is_zero() {
        backend
    } else {
        Arc::new(ServiceTimeBackend::new(backend, l.service_time))
    };
    let (h, tail) = match backend.identity() {
        Some(id) => {
            let h2 = fnv1a(format!("{id}#2").as_bytes());
            (fnv1a(id.as_bytes()), h2 as u16)
        }
        None => (fnv1a(format!("{iqn}/{lun}").as_bytes()), lun),
    };
    let naa = l.naa.unwrap_or_else(|| {
        let mut naa = [0u8; 16];
        naa[0] = 0x60 | ((h >> 60) as u8 & 0x0f);
        naa[1..9].copy_from_slice(&h.to_be_bytes());
        naa[9..11].copy_from_slice(&tail.to_be_bytes());
        naa
    });
    let lbppb = l.physical_block_size.map_or(1, |p| p / l.block_size);
    let lu_cfg = LuConfig {
        block_size: l.block_size,
        lbppb_exponent: lbppb.trailing_zeros() as u8,
        read_only: l.read_only,
        serial: l
            .serial
            .clone()
            .unwrap_or_else(|| format!("{:012x}{tail:04x}", h & 0xffff_ffff_ffff)),
        naa_id: naa,
        sanitize_rate: l.sanitize_rate,
        allow_sanitize: l.allow_sanitize,
        pr_file: state_dir.map(|d| {
            let hex = crate::config::naa_text(&naa);
            d.join("pr").join(format!("{hex}.json"))
        }),
        ..LuConfig::default()
    };
    let lu = LogicalUnit::new(backend, lu_cfg);
    lu.load_reservations()?;
    Ok(Arc::new(lu))
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3)
    })
}
