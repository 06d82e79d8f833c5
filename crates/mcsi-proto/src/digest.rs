//! digest
