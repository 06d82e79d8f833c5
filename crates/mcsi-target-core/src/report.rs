//! The target's report of its sending side to mcsi initiators (`X-org.mcsi.TcpReport`, an Async
//! Message with event 255 and mcsi's vendor code): when a sample of the connection's TCP state
//! is worth sending. The layer above samples the socket on a timer; this decides.

use mcsi_proto::pdu::{AsyncMessage, Pdu};
use mcsi_proto::vendor::{encode_report, TCP_REPORT_VCODE};
use mcsi_tcp::TcpState;

/// One connection's reports: what was sent last.
#[derive(Debug, Default)]
pub struct TcpReporter {
    last: Option<(Option<u64>, u32, u8)>,
}

impl TcpReporter {
    /// Whether to sample the socket now: not before the initiator's first command (a report is
    /// about data sent, and an initiator may not expect a PDU before it has made a request).
    pub fn wants_sample(&self, commands_seen: bool) -> bool {
        commands_seen
    }

    /// The report to send for a sample `t`, if any: nothing while the socket has sent nothing
    /// new and its window and congestion state are unchanged (an idle connection's state does
    /// not change).
    pub fn on_sample(&mut self, t: &TcpState) -> Option<Pdu> {
        let now = (t.bytes_sent, t.cwnd, t.ca_state.code());
        if self.last == Some(now) {
            return None;
        }
        self.last = Some(now);
        Some(Pdu::AsyncMessage(AsyncMessage {
            lun: 0,
            stat_sn: 0,
            exp_cmd_sn: 0,
            max_cmd_sn: 0,
            async_event: 255,
            async_vcode: TCP_REPORT_VCODE,
            parameter1: 0,
            parameter2: 0,
            parameter3: 0,
            data: encode_report(&t.report_pairs()),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_start_with_the_first_command_and_skip_an_idle_socket() {
        let mut r = TcpReporter::default();
        let mut t = TcpState {
            cwnd: 10,
            bytes_sent: Some(1000),
            ..Default::default()
        };
        assert!(!r.wants_sample(false), "before the first command");
        assert!(r.wants_sample(true));
        let Some(Pdu::AsyncMessage(m)) = r.on_sample(&t) else {
            panic!("a report once commands came")
        };
        assert_eq!((m.async_event, m.async_vcode), (255, TCP_REPORT_VCODE));
        let pairs = mcsi_proto::vendor::decode_report(&m.data);
        assert!(
            pairs.iter().any(|(k, v)| k == "cwnd" && *v == 10),
            "{pairs:?}"
        );
        assert!(r.on_sample(&t).is_none(), "idle: nothing new");
        t.bytes_sent = Some(5096);
        assert!(r.on_sample(&t).is_some(), "sent more");
        t.cwnd = 20;
        assert!(r.on_sample(&t).is_some(), "window changed");
    }
}
