//! A configuration value that is wrong, and the field it is in.

/// A configuration value that is wrong, with the path of the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {why}")]
pub struct ConfigError {
    pub field: String,
    pub why: String,
}

pub(super) fn cerr(field: impl Into<String>, why: impl std::fmt::Display) -> ConfigError {
    ConfigError {
        field: field.into(),
        why: why.to_string(),
    }
}

/// A value that is wrong on its own, before anyone says which field it came from (a flag, a
/// file's field and a `mcsi ctl` request each name it their way).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error("'{text}' is not a network (use 10.0.0.0/8, fd00::/8 or an address)")]
    NotANetwork { text: String },
    #[error("'{text}': the prefix length must be 0 to {max}")]
    PrefixLength { text: String, max: u8 },
    #[error("'{text}' is not an address (use IP:PORT such as 127.0.0.1:3260 or [::1]:3260)")]
    NotAPortal { text: String },
    #[error("'{text}' is not 32 hex digits beginning with 6 (NAA type 6, registered extended)")]
    NotANaa { text: String },
    #[error("LUN {lun} is given twice (luns[{first}] and luns[{second}]); give one of them another `lun = N`")]
    LunGivenTwice {
        lun: u16,
        first: usize,
        second: usize,
    },
    #[error("{physical} is not a power-of-two multiple of the block size {block_size} (use e.g. 4096 on 512-byte blocks)")]
    PhysicalBlockSize { physical: u32, block_size: u32 },
    #[error(transparent)]
    Policy(#[from] mcsi_tcp::sched::PolicyError),
    #[error("policy {name:?}: at most {max} weights (one per response connection)")]
    TooManyWeights { name: String, max: usize },
}
