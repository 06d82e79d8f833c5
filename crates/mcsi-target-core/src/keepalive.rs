//! Target-initiated NOP-In pings (RFC 7143 11.19) as a state machine on passed-in time: a
//! connection that received nothing for `interval` is pinged; the initiator must answer with a
//! NOP-Out carrying the ping's Target Transfer Tag within `timeout`, or the connection is given
//! up (at ErrorRecoveryLevel 0 the session with it). An `interval` of zero turns pings off.
//!
//! The connection's reader tells it when bytes arrive ([`Keepalive::received`]) and when a ping
//! is answered ([`Keepalive::answered`]), sleeps until [`Keepalive::deadline`] and then calls
//! [`Keepalive::on_deadline`]; it reads the clock itself, this type never does.

use mcsi_proto::pdu::{NopIn, Pdu, RESERVED_TAG};
use std::time::{Duration, Instant};

/// The NOP-In of a ping with this TTT: ITT reserved, so the target asks for an answer, and
/// StatSN not advanced (11.19.1).
pub fn ping_pdu(ttt: u32) -> Pdu {
    Pdu::NopIn(NopIn {
        lun: 0,
        itt: RESERVED_TAG,
        ttt,
        stat_sn: 0,
        exp_cmd_sn: 0,
        max_cmd_sn: 0,
        data: bytes::Bytes::new(),
    })
}

#[derive(Debug)]
pub struct Keepalive {
    pub interval: Duration,
    pub timeout: Duration,
    last_rx: Instant,
    /// The unanswered ping: its TTT and when its answer is due.
    pending: Option<(u32, Instant)>,
}

/// What the deadline asks of the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Nothing yet (woken early, or bytes came meanwhile).
    Nothing,
    /// Send a NOP-In ping with this Target Transfer Tag (ITT reserved, StatSN not advanced).
    Ping { ttt: u32 },
    /// The ping with this TTT went unanswered for `timeout`: give the connection up.
    Unanswered { ttt: u32 },
}

impl Keepalive {
    /// A connection that last received something at `now`.
    pub fn new(interval: Duration, timeout: Duration, now: Instant) -> Self {
        Keepalive {
            interval,
            timeout,
            last_rx: now,
            pending: None,
        }
    }

    /// When something must happen next (a ping to send or an answer that is due); `None` with
    /// pings off.
    pub fn deadline(&self) -> Option<Instant> {
        if self.interval.is_zero() {
            return None;
        }
        Some(match self.pending {
            Some((_, due)) => due,
            None => self.last_rx + self.interval,
        })
    }

    /// Bytes arrived at `now`: the connection is not idle. A pending ping still needs its answer.
    pub fn received(&mut self, now: Instant) {
        self.last_rx = now;
    }

    /// A NOP-Out arrived with this TTT: true if it answers the pending ping.
    pub fn answered(&mut self, ttt: u32) -> bool {
        if self.pending.is_some_and(|(t, _)| t == ttt) {
            self.pending = None;
            return true;
        }
        false
    }

    /// The deadline passed (the reader woke at `now`): ping, give up, or nothing yet.
    /// `alloc_ttt` gives the ping's tag (the session's Target Transfer Tags).
    pub fn on_deadline(&mut self, now: Instant, alloc_ttt: impl FnOnce() -> u32) -> Due {
        if self.interval.is_zero() {
            return Due::Nothing;
        }
        if let Some((ttt, due)) = self.pending {
            return if now >= due {
                Due::Unanswered { ttt }
            } else {
                Due::Nothing
            };
        }
        if now < self.last_rx + self.interval {
            return Due::Nothing;
        }
        let ttt = alloc_ttt();
        self.pending = Some((ttt, now + self.timeout));
        Due::Ping { ttt }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ping_asks_for_an_answer_under_its_tag() {
        let Pdu::NopIn(n) = ping_pdu(0x42) else {
            panic!("a NOP-In")
        };
        assert_eq!((n.itt, n.ttt, n.data.len()), (RESERVED_TAG, 0x42, 0));
    }

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn an_idle_connection_is_pinged_and_given_up_when_the_ping_goes_unanswered() {
        let t0 = Instant::now();
        let mut k = Keepalive::new(S(30), S(15), t0);
        assert_eq!(k.deadline(), Some(t0 + S(30)));
        // Woken early: nothing.
        assert_eq!(k.on_deadline(t0 + S(10), || 7), Due::Nothing);
        // Traffic moves the deadline.
        k.received(t0 + S(20));
        assert_eq!(k.deadline(), Some(t0 + S(50)));
        assert_eq!(k.on_deadline(t0 + S(30), || 7), Due::Nothing);
        // Idle for the interval: a ping, whose answer is due within the timeout.
        assert_eq!(k.on_deadline(t0 + S(50), || 7), Due::Ping { ttt: 7 });
        assert_eq!(k.deadline(), Some(t0 + S(65)));
        // Bytes that are not the answer do not settle it, nor does an answer with another tag.
        k.received(t0 + S(55));
        assert!(!k.answered(8));
        assert_eq!(k.deadline(), Some(t0 + S(65)));
        assert_eq!(k.on_deadline(t0 + S(64), || 9), Due::Nothing);
        assert_eq!(k.on_deadline(t0 + S(65), || 9), Due::Unanswered { ttt: 7 });
    }

    #[test]
    fn an_answered_ping_rearms_the_interval() {
        let t0 = Instant::now();
        let mut k = Keepalive::new(S(5), S(2), t0);
        assert_eq!(k.on_deadline(t0 + S(5), || 1), Due::Ping { ttt: 1 });
        k.received(t0 + S(6));
        assert!(k.answered(1));
        assert!(!k.answered(1), "answered once");
        assert_eq!(k.deadline(), Some(t0 + S(11)));
        assert_eq!(k.on_deadline(t0 + S(11), || 2), Due::Ping { ttt: 2 });
    }

    #[test]
    fn an_interval_of_zero_turns_pings_off() {
        let t0 = Instant::now();
        let mut k = Keepalive::new(Duration::ZERO, S(15), t0);
        assert_eq!(k.deadline(), None);
        assert_eq!(k.on_deadline(t0 + S(3600), || 1), Due::Nothing);
    }
}
