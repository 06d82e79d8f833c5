//! mcsi-target
