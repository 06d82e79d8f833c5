//! One end of an iSCSI connection's byte stream: PDUs encoded and waiting for the TCP socket,
//! and bytes the socket delivered waiting to be decoded.

use bytes::{Buf, Bytes, BytesMut};
use mcsi_proto::pdu::{decode, DecodeError, Framing, Pdu};
use std::collections::VecDeque;

/// Bytes to send are kept as the encoder's pieces (a data segment is shared, not copied).
#[derive(Default)]
pub struct Stream {
    out: VecDeque<Bytes>,
    queued: usize,
    inbuf: BytesMut,
    closed: bool,
}

impl Stream {
    /// Encodes `p` onto the end of what waits to be sent.
    pub fn send(&mut self, p: &Pdu, framing: &Framing) {
        let e = p.encode(framing);
        let header = Bytes::copy_from_slice(e.header());
        self.queued += header.len();
        self.out.push_back(header);
        if !e.data().is_empty() {
            self.queued += e.data().len();
            self.out.push_back(e.data().clone());
        }
        if !e.trailer().is_empty() {
            self.queued += e.trailer().len();
            self.out.push_back(Bytes::copy_from_slice(e.trailer()));
        }
    }

    /// Bytes waiting for the socket.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// Hands what waits to `take`, which returns how much of each piece it took; stops at the
    /// first piece it does not take whole.
    pub fn drain_into(&mut self, mut take: impl FnMut(&[u8]) -> usize) {
        while let Some(front) = self.out.front_mut() {
            let n = take(front);
            self.queued -= n;
            if n < front.len() {
                front.advance(n);
                return;
            }
            self.out.pop_front();
        }
    }

    /// Bytes the socket delivered.
    pub fn deliver(&mut self, b: &[u8]) {
        self.inbuf.extend_from_slice(b);
    }

    /// The next whole PDU received, if any.
    pub fn decode(&mut self, framing: &Framing) -> Result<Option<Pdu>, DecodeError> {
        if self.inbuf.is_empty() {
            return Ok(None);
        }
        decode(&mut self.inbuf, framing)
    }

    /// The driver is done with the connection: the network closes it once what waits is sent.
    pub fn close(&mut self) {
        self.closed = true;
    }

    /// The driver drops the connection: what waits to be sent is dropped with it, and the
    /// network closes it.
    pub fn abort(&mut self) {
        self.out.clear();
        self.queued = 0;
        self.closed = true;
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }
}
