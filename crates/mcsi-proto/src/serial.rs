//! serial
