//! The SCSI device server: CDB parsing, SPC-4/SBC-3 command handling, sense data, reservations,
//! and the [`Backend`] trait with RAM, file and block-device backends.
//!
//! It knows nothing of iSCSI. The transport hands it a [`Command`] (CDB, the data-out buffer, the
//! I_T nexus it came from) and gets back an [`Outcome`] (status, sense, data-in).

pub mod alua;
pub mod backend;
pub mod lun;
#[cfg(feature = "rbd")]
pub mod rbd;
pub mod sense;

mod lu;
mod opcodes;
mod pr;
mod server;

pub use backend::{
    open_backend, AioCompletion, AioDone, AioOp, AioRamBackend, AsyncBackend, Backend,
    BackendError, BlockBackend, FailingBackend, FileBackend, RamBackend, SharedState,
};
pub use lu::{LogicalUnit, Pending, Prepared, Step};
pub use pr::MAX_REGISTRATIONS;
pub use sense::Sense;
pub use server::{DeviceServer, InventoryError};

use bytes::Bytes;
use std::sync::Arc;

/// SCSI status codes (SAM-5).
pub mod status {
    pub const GOOD: u8 = 0x00;
    pub const CHECK_CONDITION: u8 = 0x02;
    pub const CONDITION_MET: u8 = 0x04;
    pub const BUSY: u8 = 0x08;
    pub const RESERVATION_CONFLICT: u8 = 0x18;
    pub const TASK_SET_FULL: u8 = 0x28;
    pub const ACA_ACTIVE: u8 = 0x30;
    pub const TASK_ABORTED: u8 = 0x40;
}

/// An I_T nexus: which initiator port talks to which target port. Reservations and unit
/// attentions are kept per nexus.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Nexus {
    /// SCSI initiator port name, for iSCSI "<initiator name>,i,0x<ISID hex>" (RFC 7143 10.1.1).
    pub initiator_port: Arc<str>,
    /// SCSI target port name, for iSCSI "<target name>,t,0x<TPGT hex>".
    pub target_port: Arc<str>,
    /// Relative target port identifier (the portal group tag), reported in VPD 83h.
    pub relative_port: u16,
}

/// Task attribute as SAM defines it; the transport maps its own encoding onto this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TaskAttribute {
    #[default]
    Simple,
    Ordered,
    HeadOfQueue,
    Aca,
}

/// One SCSI command as the transport delivers it.
#[derive(Debug, Clone)]
pub struct Command<'a> {
    pub nexus: &'a Nexus,
    /// The CDB, possibly followed by zero padding (iSCSI carries at least 16 bytes).
    pub cdb: &'a [u8],
    /// The data-out buffer the initiator sent (may be shorter or longer than the CDB asks for;
    /// the device server checks).
    pub data_out: Bytes,
    /// The most data-in bytes the initiator will accept (iSCSI ExpectedDataTransferLength for
    /// reads). The device server may return more; the transport truncates and reports residuals.
    pub data_in_limit: u32,
    pub attr: TaskAttribute,
    /// What the transport charges for data a command moves toward storage that the initiator
    /// did not send (an EXTENDED COPY's chunks): called with each chunk's bytes before it is
    /// written, it may block until the session's bandwidth lets them go. `None`: not paced.
    pub pace: Option<Pace<'a>>,
}

/// [`Command::pace`]: a callback that waits until a number of bytes may move toward storage.
#[derive(Clone, Copy)]
pub struct Pace<'a>(pub &'a (dyn Fn(u64) + Sync));

impl std::fmt::Debug for Pace<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pace")
    }
}

/// What a command came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub status: u8,
    /// Fixed or descriptor format sense data, present with CHECK CONDITION.
    pub sense: Option<Bytes>,
    /// Data-in, as long as the command produced (already cut to the CDB's allocation length),
    /// except for what `data_in_unread` counts.
    pub data_in: Bytes,
    /// Bytes of data-in the command produced after `data_in` that were never read, because they
    /// lie beyond the command's `data_in_limit` and the transport would not send them. The
    /// transport counts them for the residual (a READ with a too small expected length is an
    /// overflow) without the backend being read for data nobody receives.
    pub data_in_unread: u32,
}

/// What the transport needs to know about a CDB before the data-out phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataPhase {
    /// Bytes of data-out the command needs according to its CDB.
    pub data_out_len: u32,
    /// Bytes of data-in the command will produce at most according to its CDB.
    pub data_in_len: u32,
}

/// Per-LU settings.
#[derive(Debug, Clone)]
pub struct LuConfig {
    pub block_size: u32,
    /// Logical blocks per physical block, as a power of two (READ CAPACITY(16)'s LOGICAL
    /// BLOCKS PER PHYSICAL BLOCK EXPONENT, 0 to 15): 3 for 512-byte blocks on 4 KiB sectors.
    pub lbppb_exponent: u8,
    /// T10 vendor identification (8 ASCII chars, padded).
    pub vendor: String,
    /// Product identification (16 chars, padded).
    pub product: String,
    /// Product revision (4 chars).
    pub revision: String,
    /// Unit serial number (VPD 80h).
    pub serial: String,
    /// NAA / EUI identifier bytes for VPD 83h (8 bytes, NAA 6 registered extended is 16).
    pub naa_id: [u8; 16],
    pub read_only: bool,
    /// Advertise thin provisioning (UNMAP, WRITE SAME with UNMAP, GET LBA STATUS, VPD B2h).
    pub thin_provisioning: bool,
    /// Write cache enabled bit of the caching mode page.
    pub write_cache: bool,
    /// The most a SANITIZE OVERWRITE writes per second, in bytes (0: as fast as the backend
    /// goes), so that wiping one unit leaves room for the others' I/O.
    pub sanitize_rate: u64,
    /// Honour SANITIZE (SBC-4 5.30): it destroys every block of the unit, so it is refused as
    /// an unsupported command (and left out of REPORT SUPPORTED OPERATION CODES) unless the
    /// LUN's configuration allows it.
    pub allow_sanitize: bool,
    /// Where persistent reservations made with APTPL are kept, written and synced before the
    /// command that changed them completes, and read back by
    /// [`LogicalUnit::load_reservations`] (none: APTPL is refused, PTPL_C = 0).
    pub pr_file: Option<std::path::PathBuf>,
}

impl Default for LuConfig {
    /// 512-byte blocks, read-write, thin provisioned, write cache on, generic identity.
    fn default() -> Self {
        LuConfig {
            block_size: 512,
            lbppb_exponent: 0,
            vendor: "MCSI".into(),
            product: "VIRTUAL-DISK".into(),
            revision: "0001".into(),
            serial: "mcsi0000".into(),
            naa_id: [0x60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01],
            read_only: false,
            thin_provisioning: true,
            write_cache: true,
            sanitize_rate: 0,
            allow_sanitize: false,
            pr_file: None,
        }
    }
}

impl Outcome {
    /// GOOD status with data-in.
    pub fn good(data_in: Bytes) -> Self {
        Outcome {
            status: status::GOOD,
            sense: None,
            data_in,
            data_in_unread: 0,
        }
    }

    /// CHECK CONDITION with fixed-format sense data.
    pub fn check(sense: &Sense) -> Self {
        Self::check_as(sense, false)
    }

    /// CHECK CONDITION with `sense` in descriptor format (D_SENSE) or fixed.
    pub fn check_as(sense: &Sense, descriptor: bool) -> Self {
        Outcome {
            status: status::CHECK_CONDITION,
            sense: Some(sense.encode(descriptor)),
            data_in: Bytes::new(),
            data_in_unread: 0,
        }
    }

    /// A status without sense data or data-in (RESERVATION CONFLICT, BUSY, ...).
    pub fn status(status: u8) -> Self {
        Outcome {
            status,
            sense: None,
            data_in: Bytes::new(),
            data_in_unread: 0,
        }
    }
}
