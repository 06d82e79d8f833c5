//! mcsi-model
