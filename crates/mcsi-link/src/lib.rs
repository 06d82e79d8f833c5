//! mcsi-link
