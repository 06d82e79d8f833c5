//! What the target offers at login (RFC 7143 13) and keeps to in full feature phase: the
//! negotiation limits, the session's command window, the keepalive and the highest
//! ErrorRecoveryLevel. These are protocol defaults, so they live with the core: the tokio layer
//! (`mcsi-target`'s `[limits]`) and the simulator start from the same [`TargetOffer::default`].

use mcsi_proto::keys::{Digest, LocalParams};
use std::time::Duration;

/// The target's side of a session's negotiation and the protocol timers it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetOffer {
    pub max_connections: u16,
    pub max_recv_data_segment_length: u32,
    pub max_burst_length: u32,
    pub first_burst_length: u32,
    pub max_outstanding_r2t: u16,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    /// Commands a session may have outstanding (its CmdSN window).
    pub queue_depth: u32,
    /// A connection that received nothing for this long gets a NOP-In ping (RFC 7143 11.19);
    /// zero turns the keepalive off.
    pub nop_interval: Duration,
    /// The ping must be answered (NOP-Out with its Target Transfer Tag) within this time, or
    /// the connection is dropped.
    pub nop_timeout: Duration,
    /// Agree to the asymmetric mode (thesis 4.3.2, `X-org.mcsi.Asymmetric`) when an initiator
    /// offers it: responses leave on the session's response connections.
    pub asymmetric: bool,
    /// The highest ErrorRecoveryLevel the target agrees to (RFC 7143 7.1; the initiator's offer
    /// decides below it). At 1 each connection with data digests keeps what it sent until it
    /// is acknowledged and answers SNACKs; at 2 (offered with DefaultTime2Retain 20 s) a failed
    /// connection's tasks wait to be reassigned to another (TASK REASSIGN).
    pub max_erl: u8,
}

impl Default for TargetOffer {
    fn default() -> Self {
        TargetOffer {
            max_connections: 8,
            max_recv_data_segment_length: 262_144,
            max_burst_length: 1_048_576,
            // A write up to 256 KiB goes out whole with its command (immediate data up to our
            // MaxRecvDataSegmentLength, unsolicited Data-Out after it) instead of waiting a round
            // trip for an R2T, which matters most on long links.
            first_burst_length: 262_144,
            max_outstanding_r2t: 8,
            // "No" lets initiators send the first burst without waiting a round trip for an R2T,
            // which matters on long links; InitialR2T is an OR key so an initiator may still ask.
            initial_r2t: false,
            immediate_data: true,
            queue_depth: 128,
            nop_interval: Duration::from_secs(30),
            nop_timeout: Duration::from_secs(15),
            asymmetric: true,
            // What an initiator asks for, up to level 2 (standard initiators offer 0 unless told
            // otherwise).
            max_erl: 2,
        }
    }
}

impl TargetOffer {
    /// The login's offer: both digests, ErrorRecoveryLevel up to `max_erl`, data in order, and
    /// DefaultTime2Retain 0 (no connection recovery) below level 2; DefaultTime2Wait takes the
    /// initiator's value (maximum function against 0).
    pub fn local_params(&self) -> LocalParams {
        LocalParams {
            header_digest: vec![Digest::None, Digest::Crc32c],
            data_digest: vec![Digest::None, Digest::Crc32c],
            max_recv_data_segment_length: self.max_recv_data_segment_length,
            max_connections: self.max_connections,
            initial_r2t: self.initial_r2t,
            immediate_data: self.immediate_data,
            max_burst_length: self.max_burst_length,
            first_burst_length: self.first_burst_length,
            // Level 2 keeps a failed connection's tasks this long for reassignment (the lower
            // of both offers); below, nothing is kept.
            default_time2wait: if self.max_erl >= 2 { 2 } else { 0 },
            default_time2retain: if self.max_erl >= 2 { 20 } else { 0 },
            max_outstanding_r2t: self.max_outstanding_r2t,
            data_pdu_in_order: true,
            data_sequence_in_order: true,
            error_recovery_level: self.max_erl,
            ..LocalParams::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_2_offers_time_to_retain_and_lower_levels_none() {
        let two = TargetOffer::default().local_params();
        assert_eq!(two.error_recovery_level, 2);
        assert_eq!((two.default_time2wait, two.default_time2retain), (2, 20));
        let one = TargetOffer {
            max_erl: 1,
            ..TargetOffer::default()
        }
        .local_params();
        assert_eq!(one.error_recovery_level, 1);
        assert_eq!((one.default_time2wait, one.default_time2retain), (0, 0));
    }
}
