//! Helpers shared by the fuzz targets: the byte reader over the fuzz input and a generator of
//! plausible `key=value` text, so that inputs reach past the parsers into negotiation and login.
#![allow(dead_code)]

use mcsi_proto::chap::{decode_binary, encode_binary, ChapAlgorithm, Encoding, Secret};
use mcsi_proto::keys::KEYS;

#[path = "input.rs"]
mod input;
pub use input::Input;

pub const TARGET: &str = "iqn.2024-01.org.mcsi:disk1";
pub const INITIATOR: &str = "iqn.2024-01.org.mcsi:host1";
pub const USER: &str = "alice";
pub const SECRET: &str = "initiator-secret";
pub const TARGET_USER: &str = "disk1";
pub const TARGET_SECRET: &str = "target-secret-99";

const EXTRA_KEYS: &[&str] = &[
    "X-org.mcsi.test",
    "X#vendor",
    "Junk",
    "CHAP_X",
    "AuthMethod",
];

const VALUES: &[&str] = &[
    "Yes",
    "No",
    "None",
    "CRC32C",
    "CRC32C,None",
    "None,CRC32C",
    "CHAP",
    "CHAP,None",
    "None,CHAP",
    "SRP",
    "0",
    "1",
    "2",
    "3",
    "511",
    "512",
    "8192",
    "65536",
    "262144",
    "16777215",
    "16777216",
    "0x10",
    "0x",
    "00",
    "99999999999999999999999",
    "Discovery",
    "Normal",
    TARGET,
    INITIATOR,
    "RFC3720",
    "ResponseFence,FastAbort",
    "5",
    "6",
    "7",
    "8",
    "5,6,7,8",
    "8,7,6,5",
    "255",
    "256",
    "NotUnderstood",
    "Irrelevant",
    "Reject",
    "",
    ",",
    "a,,b",
    USER,
    TARGET_USER,
    "0x00",
    "0b",
    "0bAAAA",
    "0x0123456789abcdef0123456789abcdef",
    "3600",
    "3601",
    "65535",
    "65536",
];

/// The last challenge the target sent (CHAP_A, CHAP_I, CHAP_C), to let inputs answer it right.
#[derive(Default, Clone)]
pub struct Challenge {
    pub algorithm: Option<ChapAlgorithm>,
    pub id: Option<u8>,
    pub challenge: Option<(Vec<u8>, Encoding)>,
}

impl Challenge {
    pub fn learn(&mut self, pairs: &[(String, String)]) {
        for (k, v) in pairs {
            match k.as_str() {
                "CHAP_A" => self.algorithm = v.parse().ok().and_then(ChapAlgorithm::from_code),
                "CHAP_I" => self.id = v.parse().ok(),
                "CHAP_C" => self.challenge = decode_binary("CHAP_C", v).ok(),
                _ => {}
            }
        }
    }

    /// The right response for `secret`, if a challenge was seen.
    pub fn answer(&self, secret: &str) -> Option<String> {
        let (c, enc) = self.challenge.as_ref()?;
        let r = self.algorithm?.response(self.id?, &Secret::from(secret), c);
        Some(encode_binary(&r, *enc))
    }
}

fn key_name(inp: &mut Input<'_>) -> String {
    let i = usize::from(inp.u8());
    if i < KEYS.len() {
        KEYS[i].name.to_owned()
    } else if i - KEYS.len() < EXTRA_KEYS.len() {
        EXTRA_KEYS[i - KEYS.len()].to_owned()
    } else {
        // Raw key bytes (may be invalid: the parser must cope).
        let n = usize::from(inp.u8() % 70);
        String::from_utf8_lossy(inp.take(n)).into_owned()
    }
}

fn value(inp: &mut Input<'_>, ch: &Challenge) -> String {
    let sel = inp.u8();
    match sel {
        0..=199 => VALUES[usize::from(sel) % VALUES.len()].to_owned(),
        200..=219 => ch.answer(SECRET).unwrap_or_default(),
        220..=229 => ch.answer(TARGET_SECRET).unwrap_or_default(),
        230..=239 => ch
            .challenge
            .as_ref()
            .map(|(c, e)| encode_binary(c, *e))
            .unwrap_or_default(),
        240..=247 => {
            let n = usize::from(inp.u8());
            let bytes = inp.take(n).to_vec();
            encode_binary(
                &bytes,
                if sel & 1 == 0 {
                    Encoding::Hex
                } else {
                    Encoding::Base64
                },
            )
        }
        _ => {
            let n = usize::from(inp.u16() % 600);
            String::from_utf8_lossy(inp.take(n)).replace('\0', "")
        }
    }
}

/// Up to `max` pairs drawn from the key table and plausible values.
pub fn pairs(inp: &mut Input<'_>, max: usize, ch: &Challenge) -> Vec<(String, String)> {
    let n = usize::from(inp.u8()) % (max + 1);
    (0..n)
        .map(|_| {
            let k = key_name(inp);
            let v = value(inp, ch);
            (k, v)
        })
        .collect()
}

/// `key=value\0` bytes without validation (the receiver's parser decides).
pub fn raw_text(pairs: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(b'=');
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}
