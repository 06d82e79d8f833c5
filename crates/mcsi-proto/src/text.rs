//! Text segments: `key=value\0` pairs (RFC 7143 section 6.1), as carried by Login and Text PDUs,
//! possibly spread over several PDUs with the C (continue) bit.
//!
//! Every length a peer controls is capped: the number of pairs, the key length (63 bytes), the
//! value length (255 bytes per value, 8192 for the keys that carry long binary values such as
//! `CHAP_C`), and the total size of one (possibly continued) segment.

use bytes::Bytes;

/// Longest key name (RFC 7143 6.1: standard-label at most 63 characters).
pub const MAX_KEY_LEN: usize = 63;
/// Longest simple value (RFC 7143 6.1).
pub const MAX_VALUE_LEN: usize = 255;
/// Longest value of keys that carry large values (authentication exchanges, lists).
pub const MAX_LONG_VALUE_LEN: usize = 8192;

/// Caps applied while parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextLimits {
    /// Most `key=value` pairs in one segment.
    pub max_pairs: usize,
    /// Most bytes in one segment, including all continuation PDUs.
    pub max_total: usize,
}

impl Default for TextLimits {
    /// 256 pairs, 64 KiB (RFC 7143 6.1 requires accepting at least 8192 bytes of text per
    /// negotiation sequence).
    fn default() -> Self {
        TextLimits {
            max_pairs: 256,
            max_total: 64 * 1024,
        }
    }
}

/// A malformed or oversized text segment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    #[error("text pair {index} has no '=' (every pair must be key=value)")]
    MissingEquals { index: usize },
    #[error("text pair {index} has an empty key")]
    EmptyKey { index: usize },
    #[error("key of {len} bytes exceeds the limit of {MAX_KEY_LEN} bytes")]
    KeyTooLong { len: usize },
    #[error("key {key:?} holds a character outside a-z A-Z 0-9 . - + @ _ (RFC 7143 6.1)")]
    BadKeyChar { key: String },
    #[error("value of key {key} has {len} bytes; at most {max} are allowed")]
    ValueTooLong { key: String, len: usize, max: usize },
    #[error("text is not valid UTF-8 in pair {index}")]
    NotUtf8 { index: usize },
    #[error("more than {max} key=value pairs")]
    TooManyPairs { max: usize },
    #[error("text segment of {len} bytes exceeds the limit of {max} bytes")]
    TooLong { len: usize, max: usize },
    #[error("the last key=value pair is not terminated by a zero byte")]
    Unterminated,
}

/// Keys whose values may exceed 255 bytes: authentication exchanges (challenges and responses
/// are long binary values) and vendor keys.
pub fn is_long_key(key: &str) -> bool {
    const PREFIXES: [&str; 6] = ["CHAP_", "SRP_", "KRB_", "SPKM_", "X-", "X#"];
    PREFIXES.iter().any(|p| key.starts_with(p))
}

fn valid_key_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'+' | b'@' | b'_' | b'#')
}

/// Parse a complete text segment into ordered pairs.
///
/// Empty entries (consecutive zero bytes, as some senders pad) are skipped. Lists are kept as one
/// value (`CRC32C,None`); the negotiation layer splits them. Each element of a list value is held
/// to the 255-byte limit, the whole value to 8192 bytes.
pub fn parse(data: &[u8], limits: &TextLimits) -> Result<Vec<(String, String)>, TextError> {
    if data.len() > limits.max_total {
        return Err(TextError::TooLong {
            len: data.len(),
            max: limits.max_total,
        });
    }
    if data.is_empty() {
        return Ok(Vec::new());
    }
    if data.last() != Some(&0) {
        return Err(TextError::Unterminated);
    }
    let mut out = Vec::new();
    for (index, entry) in data.split(|&b| b == 0).enumerate() {
        if entry.is_empty() {
            continue;
        }
        if out.len() >= limits.max_pairs {
            return Err(TextError::TooManyPairs {
                max: limits.max_pairs,
            });
        }
        let eq = entry
            .iter()
            .position(|&b| b == b'=')
            .ok_or(TextError::MissingEquals { index })?;
        let (k, v) = (&entry[..eq], &entry[eq + 1..]);
        if k.is_empty() {
            return Err(TextError::EmptyKey { index });
        }
        if k.len() > MAX_KEY_LEN {
            return Err(TextError::KeyTooLong { len: k.len() });
        }
        if !k.iter().all(|&c| valid_key_char(c)) {
            return Err(TextError::BadKeyChar {
                key: String::from_utf8_lossy(k).into_owned(),
            });
        }
        let key = std::str::from_utf8(k)
            .map_err(|_| TextError::NotUtf8 { index })?
            .to_owned();
        let value = std::str::from_utf8(v).map_err(|_| TextError::NotUtf8 { index })?;
        check_value(&key, value)?;
        out.push((key, value.to_owned()));
    }
    Ok(out)
}

fn check_value(key: &str, value: &str) -> Result<(), TextError> {
    let too_long = |max: usize| TextError::ValueTooLong {
        key: key.to_owned(),
        len: value.len(),
        max,
    };
    if value.len() > MAX_LONG_VALUE_LEN {
        return Err(too_long(MAX_LONG_VALUE_LEN));
    }
    if !is_long_key(key) && value.split(',').any(|v| v.len() > MAX_VALUE_LEN) {
        return Err(too_long(MAX_VALUE_LEN));
    }
    Ok(())
}

/// Encode pairs as `key=value\0...`.
pub fn encode<K: AsRef<str>, V: AsRef<str>>(pairs: &[(K, V)]) -> Bytes {
    let len: usize = pairs
        .iter()
        .map(|(k, v)| k.as_ref().len() + v.as_ref().len() + 2)
        .sum();
    let mut out = Vec::with_capacity(len);
    for (k, v) in pairs {
        out.extend_from_slice(k.as_ref().as_bytes());
        out.push(b'=');
        out.extend_from_slice(v.as_ref().as_bytes());
        out.push(0);
    }
    Bytes::from(out)
}

/// Split an encoded segment into PDU-sized pieces (the peer's MaxRecvDataSegmentLength, 8192
/// during login). Every piece but the last goes out with the C bit set. A pair may be cut
/// anywhere (RFC 7143 6.1 allows it); the receiver joins the pieces before parsing.
pub fn split(segment: &Bytes, max: usize) -> Vec<Bytes> {
    let max = max.max(1);
    if segment.is_empty() {
        return vec![Bytes::new()];
    }
    (0..segment.len())
        .step_by(max)
        .map(|start| segment.slice(start..(start + max).min(segment.len())))
        .collect()
}

/// Joins the pieces of a text segment sent with the C bit, with the total capped before copying.
#[derive(Debug, Clone, Default)]
pub struct TextAccumulator {
    buf: Vec<u8>,
    limits: TextLimits,
}

impl TextAccumulator {
    pub fn new(limits: TextLimits) -> Self {
        TextAccumulator {
            buf: Vec::new(),
            limits,
        }
    }

    /// Add one PDU's data. With `continue_` set, more pieces follow and `Ok(None)` is returned;
    /// otherwise the joined segment is parsed and the accumulator starts over.
    pub fn push(
        &mut self,
        data: &[u8],
        continue_: bool,
    ) -> Result<Option<Vec<(String, String)>>, TextError> {
        let len = self.buf.len() + data.len();
        if len > self.limits.max_total {
            self.buf.clear();
            return Err(TextError::TooLong {
                len,
                max: self.limits.max_total,
            });
        }
        self.buf.extend_from_slice(data);
        if continue_ {
            return Ok(None);
        }
        let all = std::mem::take(&mut self.buf);
        parse(&all, &self.limits).map(Some)
    }

    /// Whether a continued segment is being collected.
    pub fn is_pending(&self) -> bool {
        !self.buf.is_empty()
    }

    pub fn clear(&mut self) {
        self.buf.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &[u8]) -> Result<Vec<(String, String)>, TextError> {
        parse(s, &TextLimits::default())
    }

    #[test]
    fn parses_pairs_in_order() {
        let v = p(b"InitiatorName=iqn.2024-01.org.example:a\0HeaderDigest=CRC32C,None\0").unwrap();
        assert_eq!(
            v,
            vec![
                (
                    "InitiatorName".to_owned(),
                    "iqn.2024-01.org.example:a".to_owned()
                ),
                ("HeaderDigest".to_owned(), "CRC32C,None".to_owned()),
            ]
        );
        // Values may contain '=' after the first one, and may be empty.
        let v = p(b"X-a=b=c\0K=\0").unwrap();
        assert_eq!(v[0].1, "b=c");
        assert_eq!(v[1].1, "");
        // Padding zero bytes are skipped.
        assert_eq!(p(b"A=1\0\0\0").unwrap().len(), 1);
        assert!(p(b"").unwrap().is_empty());
    }

    #[test]
    fn rejects_malformed() {
        assert_eq!(p(b"A=1"), Err(TextError::Unterminated));
        assert_eq!(p(b"Abc\0"), Err(TextError::MissingEquals { index: 0 }));
        assert_eq!(p(b"A=1\0=2\0"), Err(TextError::EmptyKey { index: 1 }));
        assert!(matches!(p(b"A b=1\0"), Err(TextError::BadKeyChar { .. })));
        assert!(matches!(
            p(b"A=\xff\xfe\0"),
            Err(TextError::NotUtf8 { index: 0 })
        ));
    }

    #[test]
    fn caps() {
        let key = "K".repeat(64);
        assert_eq!(
            p(format!("{key}=1\0").as_bytes()),
            Err(TextError::KeyTooLong { len: 64 })
        );
        let ok_key = "K".repeat(63);
        assert!(p(format!("{ok_key}=1\0").as_bytes()).is_ok());
        let v255 = "v".repeat(255);
        assert!(p(format!("TargetAlias={v255}\0").as_bytes()).is_ok());
        let v256 = "v".repeat(256);
        assert!(matches!(
            p(format!("TargetAlias={v256}\0").as_bytes()),
            Err(TextError::ValueTooLong { max: 255, .. })
        ));
        // A list of short values may exceed 255 bytes in total.
        let list = vec!["v".repeat(200); 3].join(",");
        assert!(p(format!("AuthMethod={list}\0").as_bytes()).is_ok());
        // Long keys may carry up to 8192 bytes.
        let chap = "a".repeat(8190);
        assert!(p(format!("CHAP_C=0x{chap}\0").as_bytes()).is_ok());
        let chap = "a".repeat(8191);
        assert!(matches!(
            p(format!("CHAP_C=0x{chap}\0").as_bytes()),
            Err(TextError::ValueTooLong { max: 8192, .. })
        ));
        let limits = TextLimits {
            max_pairs: 2,
            max_total: 20,
        };
        assert_eq!(
            parse(b"A=1\0B=2\0C=3\0", &limits),
            Err(TextError::TooManyPairs { max: 2 })
        );
        assert_eq!(
            parse(&[b'A'; 21], &limits),
            Err(TextError::TooLong { len: 21, max: 20 })
        );
    }

    #[test]
    fn encode_and_split_round_trip() {
        let pairs = vec![
            ("InitiatorName", "iqn.x"),
            ("SessionType", "Normal"),
            ("X-org.mcsi.mode", "split"),
        ];
        let seg = encode(&pairs);
        assert_eq!(
            &seg[..],
            &b"InitiatorName=iqn.x\0SessionType=Normal\0X-org.mcsi.mode=split\0"[..]
        );
        for max in [1, 3, 7, 16, 1000] {
            let pieces = split(&seg, max);
            assert!(pieces.iter().all(|p| p.len() <= max));
            let mut acc = TextAccumulator::new(TextLimits::default());
            let n = pieces.len();
            let mut result = None;
            for (i, piece) in pieces.iter().enumerate() {
                let r = acc.push(piece, i + 1 < n).unwrap();
                assert_eq!(r.is_some(), i + 1 == n);
                result = r;
            }
            let got = result.unwrap();
            let want: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            assert_eq!(got, want);
            assert!(!acc.is_pending());
        }
        assert_eq!(split(&Bytes::new(), 10), vec![Bytes::new()]);
    }

    #[test]
    fn accumulator_caps_total_before_copying() {
        let mut acc = TextAccumulator::new(TextLimits {
            max_pairs: 10,
            max_total: 10,
        });
        assert_eq!(acc.push(b"A=12345", true), Ok(None));
        assert_eq!(
            acc.push(b"6789\0", false),
            Err(TextError::TooLong { len: 12, max: 10 })
        );
        assert!(!acc.is_pending());
    }
}
