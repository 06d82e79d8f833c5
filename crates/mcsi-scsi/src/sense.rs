//! sense
