//! A configuration value that is wrong, and the field it is in.

/// A configuration value that is wrong, with the path of the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {why}")]
pub struct ConfigError {
    pub field: String,
    pub why: String,
}

pub(super) fn cerr(field: impl Into<String>, why: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        why: why.into(),
    }
}
