//! Arbitrary bytes through the PDU decoder with arbitrary framing: never panics, and keeps the
//! documented buffer invariants (need-more leaves the buffer untouched; a decoded or consumed PDU
//! removes exactly `pdu_len` bytes), and what decodes re-encodes to the same PDU.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use mcsi_proto::pdu::{decode, pdu_len, Framing};

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let Some((mrdsl, rest)) = rest.split_first_chunk::<3>() else {
        return;
    };
    let framing = Framing {
        header_digest: flags & 1 != 0,
        data_digest: flags & 2 != 0,
        max_data_segment_length: u32::from_be_bytes([0, mrdsl[0], mrdsl[1], mrdsl[2]]),
    };
    // Feed in pieces of the size the input asks for, as a socket would.
    let step = usize::from(flags >> 2).max(1) * 7;
    let mut buf = BytesMut::new();
    let mut fed = 0;
    loop {
        let end = (fed + step).min(rest.len());
        buf.extend_from_slice(&rest[fed..end]);
        fed = end;
        loop {
            let before = buf.clone();
            let need = pdu_len(&buf, &framing);
            match decode(&mut buf, &framing) {
                Ok(None) => {
                    assert_eq!(buf, before, "need-more must leave the buffer untouched");
                    if let Some(n) = need {
                        assert!(n > before.len(), "need-more with the whole PDU buffered");
                    }
                    break;
                }
                Ok(Some(pdu)) => {
                    let n = need.expect("a PDU was decoded from fewer than 48 bytes");
                    assert_eq!(before.len() - buf.len(), n, "decoded PDU length");
                    assert_eq!(&before[n..], &buf[..]);
                    // Re-encode and decode again: the same PDU.
                    let enc = pdu.encode(&framing).to_vec();
                    assert_eq!(pdu_len(&enc, &framing), Some(enc.len()));
                    let mut again = BytesMut::from(&enc[..]);
                    let back = decode(&mut again, &framing)
                        .expect("re-encoded PDU does not decode")
                        .expect("re-encoded PDU is incomplete");
                    assert_eq!(back, pdu, "decode(encode(pdu)) != pdu");
                    assert!(again.is_empty());
                }
                Err(e) => {
                    if e.consumed() {
                        let n = need.expect("consumed without a BHS");
                        assert_eq!(before.len() - buf.len(), n, "consumed length");
                        assert!(e.rejected_header().is_some_and(|h| h.len() == 48));
                    } else {
                        assert_eq!(buf, before, "unconsumed error changed the buffer");
                        // The connection ends here.
                        return;
                    }
                }
            }
        }
        if fed >= rest.len() {
            break;
        }
    }
});
