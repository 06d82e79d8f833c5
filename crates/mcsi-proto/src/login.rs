//! login
