//! The NBD wire format (the protocol of the `nbd` project, `doc/proto.md`): the fixed newstyle
//! handshake, its options and replies, transmission requests, simple and structured replies.
//! Plain functions over byte slices, unit-tested; the server drives them over a socket.

use bytes::{BufMut, Bytes, BytesMut};

/// `NBDMAGIC`, the first thing the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle magic, and the prefix of every option the client sends.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Prefix of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Prefix of every transmission request (compact headers).
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags (server, 16 bits) and client flags (32 bits) share their low bits.
pub mod handshake {
    pub const FIXED_NEWSTYLE: u16 = 1 << 0;
    pub const NO_ZEROES: u16 = 1 << 1;
    pub const C_FIXED_NEWSTYLE: u32 = 1 << 0;
    pub const C_NO_ZEROES: u32 = 1 << 1;
}

/// Option codes.
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
    pub const EXTENDED_HEADERS: u32 = 11;

    pub fn name(o: u32) -> &'static str {
        match o {
            EXPORT_NAME => "EXPORT_NAME",
            ABORT => "ABORT",
            LIST => "LIST",
            STARTTLS => "STARTTLS",
            INFO => "INFO",
            GO => "GO",
            STRUCTURED_REPLY => "STRUCTURED_REPLY",
            LIST_META_CONTEXT => "LIST_META_CONTEXT",
            SET_META_CONTEXT => "SET_META_CONTEXT",
            EXTENDED_HEADERS => "EXTENDED_HEADERS",
            _ => "unknown",
        }
    }
}

/// Option reply types; errors have bit 31 set.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const ERR_UNSUP: u32 = (1 << 31) | 1;
    pub const ERR_POLICY: u32 = (1 << 31) | 2;
    pub const ERR_INVALID: u32 = (1 << 31) | 3;
    pub const ERR_PLATFORM: u32 = (1 << 31) | 4;
    pub const ERR_TLS_REQD: u32 = (1 << 31) | 5;
    pub const ERR_UNKNOWN: u32 = (1 << 31) | 6;
    pub const ERR_SHUTDOWN: u32 = (1 << 31) | 7;
    pub const ERR_BLOCK_SIZE_REQD: u32 = (1 << 31) | 8;
    pub const ERR_TOO_BIG: u32 = (1 << 31) | 9;
}

/// Information types of NBD_OPT_INFO / NBD_OPT_GO.
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Transmission flags of an export.
pub mod tflag {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_CACHE: u16 = 1 << 10;
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Request types.
pub mod cmd {
    pub const READ: u16 = 0;
    pub const WRITE: u16 = 1;
    pub const DISC: u16 = 2;
    pub const FLUSH: u16 = 3;
    pub const TRIM: u16 = 4;
    pub const CACHE: u16 = 5;
    pub const WRITE_ZEROES: u16 = 6;
    pub const BLOCK_STATUS: u16 = 7;

    pub fn name(c: u16) -> &'static str {
        match c {
            READ => "READ",
            WRITE => "WRITE",
            DISC => "DISC",
            FLUSH => "FLUSH",
            TRIM => "TRIM",
            CACHE => "CACHE",
            WRITE_ZEROES => "WRITE_ZEROES",
            BLOCK_STATUS => "BLOCK_STATUS",
            _ => "unknown",
        }
    }
}

/// Command flags.
pub mod cflag {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// Error values of replies (Linux errno numbers, as the protocol fixes them).
pub mod errno {
    pub const EPERM: u32 = 1;
    pub const EIO: u32 = 5;
    pub const ENOMEM: u32 = 12;
    pub const EINVAL: u32 = 22;
    pub const ENOSPC: u32 = 28;
    pub const EOVERFLOW: u32 = 75;
    pub const ENOTSUP: u32 = 95;
    pub const ESHUTDOWN: u32 = 108;

    pub fn name(e: u32) -> &'static str {
        match e {
            EPERM => "EPERM",
            EIO => "EIO",
            ENOMEM => "ENOMEM",
            EINVAL => "EINVAL",
            ENOSPC => "ENOSPC",
            EOVERFLOW => "EOVERFLOW",
            ENOTSUP => "ENOTSUP",
            ESHUTDOWN => "ESHUTDOWN",
            _ => "?",
        }
    }
}

/// Structured reply chunk types and flags.
pub mod chunk {
    pub const FLAG_DONE: u16 = 1 << 0;
    pub const NONE: u16 = 0;
    pub const OFFSET_DATA: u16 = 1;
    pub const ERROR: u16 = (1 << 15) | 1;
}

/// The server's first 18 bytes: NBDMAGIC, IHAVEOPT, handshake flags.
pub fn greeting(flags: u16) -> [u8; 18] {
    let mut b = [0u8; 18];
    b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&flags.to_be_bytes());
    b
}

/// The 16-byte header of a client option: IHAVEOPT, option, data length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

impl OptionHeader {
    pub const LEN: usize = 16;

    pub fn parse(b: &[u8; 16]) -> Result<OptionHeader, PeerMisbehaved> {
        let magic = u64::from_be_bytes(b[0..8].try_into().unwrap_or_default());
        if magic != IHAVEOPT {
            return Err(PeerMisbehaved::OptionMagic(magic));
        }
        Ok(OptionHeader {
            option: u32::from_be_bytes([b[8], b[9], b[10], b[11]]),
            len: u32::from_be_bytes([b[12], b[13], b[14], b[15]]),
        })
    }
}

/// What a client sent that the protocol does not allow: the connection cannot go on as it is
/// (the option is refused, or the connection ends).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerMisbehaved {
    #[error("option magic {0:#018x}, expected IHAVEOPT {IHAVEOPT:#018x}")]
    OptionMagic(u64),
    #[error("request magic {0:#010x}, expected {REQUEST_MAGIC:#010x}")]
    RequestMagic(u32),
    #[error("{0} bytes of data, 6 at least are needed")]
    InfoTooShort(usize),
    #[error("export name of {name} bytes in {data} bytes of data")]
    NameTooLong { name: usize, data: usize },
    #[error("the export name is not UTF-8")]
    NameNotUtf8,
    #[error("{count} information requests need {} bytes, {follow} follow", 2 * count)]
    InfoRequests { count: usize, follow: usize },
}

/// An option reply: magic, option, reply type, data.
pub fn option_reply(option: u32, kind: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// The data of an NBD_REP_SERVER reply to NBD_OPT_LIST: the name, then a description.
pub fn server_entry(name: &str, description: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + name.len() + description.len());
    b.extend_from_slice(&(name.len() as u32).to_be_bytes());
    b.extend_from_slice(name.as_bytes());
    b.extend_from_slice(description.as_bytes());
    b
}

/// NBD_INFO_EXPORT: size and transmission flags.
pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut b = Vec::with_capacity(12);
    b.extend_from_slice(&info::EXPORT.to_be_bytes());
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b
}

/// NBD_INFO_NAME or NBD_INFO_DESCRIPTION: a string.
pub fn info_text(kind: u16, text: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(2 + text.len());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(text.as_bytes());
    b
}

/// NBD_INFO_BLOCK_SIZE: minimum, preferred and maximum payload sizes.
pub fn info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(14);
    b.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    b.extend_from_slice(&min.to_be_bytes());
    b.extend_from_slice(&preferred.to_be_bytes());
    b.extend_from_slice(&max.to_be_bytes());
    b
}

/// What NBD_OPT_INFO or NBD_OPT_GO asks for: an export name and information types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

impl InfoRequest {
    /// Parses the option data: u32 name length, name, u16 count, count x u16. Every length
    /// is checked against the data actually there.
    pub fn parse(d: &[u8]) -> Result<InfoRequest, PeerMisbehaved> {
        if d.len() < 6 {
            return Err(PeerMisbehaved::InfoTooShort(d.len()));
        }
        let nlen = u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize;
        let rest = &d[4..];
        if nlen > rest.len().saturating_sub(2) {
            return Err(PeerMisbehaved::NameTooLong {
                name: nlen,
                data: d.len(),
            });
        }
        let name = std::str::from_utf8(&rest[..nlen])
            .map_err(|_| PeerMisbehaved::NameNotUtf8)?
            .to_string();
        let rest = &rest[nlen..];
        let n = u16::from_be_bytes([rest[0], rest[1]]) as usize;
        let rest = &rest[2..];
        if rest.len() != 2 * n {
            return Err(PeerMisbehaved::InfoRequests {
                count: n,
                follow: rest.len(),
            });
        }
        let requests = rest
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect();
        Ok(InfoRequest { name, requests })
    }
}

/// A transmission request (compact header, 28 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    pub const LEN: usize = 28;

    pub fn parse(b: &[u8; 28]) -> Result<Request, PeerMisbehaved> {
        let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        if magic != REQUEST_MAGIC {
            return Err(PeerMisbehaved::RequestMagic(magic));
        }
        let u64_at = |i: usize| {
            u64::from_be_bytes([
                b[i],
                b[i + 1],
                b[i + 2],
                b[i + 3],
                b[i + 4],
                b[i + 5],
                b[i + 6],
                b[i + 7],
            ])
        };
        Ok(Request {
            flags: u16::from_be_bytes([b[4], b[5]]),
            kind: u16::from_be_bytes([b[6], b[7]]),
            cookie: u64_at(8),
            offset: u64_at(16),
            length: u32::from_be_bytes([b[24], b[25], b[26], b[27]]),
        })
    }

    pub fn encode(&self) -> [u8; 28] {
        let mut b = [0u8; 28];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// A simple reply header (16 bytes); a successful READ's data follows it.
pub fn simple_reply(cookie: u64, error: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// A structured reply chunk header (20 bytes); `len` bytes of payload follow.
pub fn chunk_header(flags: u16, kind: u16, cookie: u64, len: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// NBD_REPLY_TYPE_OFFSET_DATA with the DONE flag: header and offset (the data follows).
pub fn chunk_offset_data(cookie: u64, offset: u64, data_len: u32) -> [u8; 28] {
    let mut b = [0u8; 28];
    b[..20].copy_from_slice(&chunk_header(
        chunk::FLAG_DONE,
        chunk::OFFSET_DATA,
        cookie,
        data_len + 8,
    ));
    b[20..28].copy_from_slice(&offset.to_be_bytes());
    b
}

/// NBD_REPLY_TYPE_ERROR with the DONE flag: the error and a message for people.
pub fn chunk_error(cookie: u64, error: u32, message: &str) -> Bytes {
    // The message is limited to what fits the chunk comfortably.
    let msg = &message.as_bytes()[..message.len().min(4096)];
    let mut b = BytesMut::with_capacity(20 + 6 + msg.len());
    b.put_slice(&chunk_header(
        chunk::FLAG_DONE,
        chunk::ERROR,
        cookie,
        6 + msg.len() as u32,
    ));
    b.put_u32(error);
    b.put_u16(msg.len() as u16);
    b.put_slice(msg);
    b.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_is_nbdmagic_ihaveopt_flags() {
        let g = greeting(handshake::FIXED_NEWSTYLE | handshake::NO_ZEROES);
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..18], &[0, 3]);
    }

    #[test]
    fn option_header_checks_the_magic() {
        let mut h = [0u8; 16];
        h[0..8].copy_from_slice(b"IHAVEOPT");
        h[8..12].copy_from_slice(&opt::GO.to_be_bytes());
        h[12..16].copy_from_slice(&10u32.to_be_bytes());
        assert_eq!(
            OptionHeader::parse(&h),
            Ok(OptionHeader {
                option: opt::GO,
                len: 10
            })
        );
        h[0] = b'X';
        assert!(matches!(
            OptionHeader::parse(&h),
            Err(PeerMisbehaved::OptionMagic(_))
        ));
    }

    #[test]
    fn info_request_parses_and_checks_lengths() {
        let mut d = Vec::new();
        d.extend_from_slice(&3u32.to_be_bytes());
        d.extend_from_slice(b"abc");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&info::NAME.to_be_bytes());
        assert_eq!(
            InfoRequest::parse(&d),
            Ok(InfoRequest {
                name: "abc".into(),
                requests: vec![info::BLOCK_SIZE, info::NAME]
            })
        );
        // A name longer than the data, a count that does not match, too short.
        let mut long = d.clone();
        long[0..4].copy_from_slice(&1000u32.to_be_bytes());
        assert_eq!(
            InfoRequest::parse(&long),
            Err(PeerMisbehaved::NameTooLong {
                name: 1000,
                data: 13
            })
        );
        assert_eq!(
            InfoRequest::parse(&d[..d.len() - 1]),
            Err(PeerMisbehaved::InfoRequests {
                count: 2,
                follow: 3
            })
        );
        assert_eq!(
            InfoRequest::parse(&d[..5]),
            Err(PeerMisbehaved::InfoTooShort(5))
        );
        let mut huge = d.clone();
        huge[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            InfoRequest::parse(&huge),
            Err(PeerMisbehaved::NameTooLong { .. })
        ));
        let mut latin = d.clone();
        latin[4] = 0xff;
        assert_eq!(InfoRequest::parse(&latin), Err(PeerMisbehaved::NameNotUtf8));
    }

    #[test]
    fn request_round_trips_and_checks_the_magic() {
        let r = Request {
            flags: cflag::FUA,
            kind: cmd::WRITE,
            cookie: 0x0102_0304_0506_0708,
            offset: 1 << 40,
            length: 4096,
        };
        let b = r.encode();
        assert_eq!(Request::parse(&b), Ok(r));
        let mut bad = b;
        bad[3] ^= 1;
        assert!(matches!(
            Request::parse(&bad),
            Err(PeerMisbehaved::RequestMagic(_))
        ));
    }

    #[test]
    fn reply_layouts() {
        let s = simple_reply(7, errno::EIO);
        assert_eq!(&s[0..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&s[4..8], &5u32.to_be_bytes());
        assert_eq!(&s[8..16], &7u64.to_be_bytes());
        let d = chunk_offset_data(9, 4096, 512);
        assert_eq!(&d[4..6], &chunk::FLAG_DONE.to_be_bytes());
        assert_eq!(&d[6..8], &chunk::OFFSET_DATA.to_be_bytes());
        assert_eq!(&d[16..20], &520u32.to_be_bytes());
        assert_eq!(&d[20..28], &4096u64.to_be_bytes());
        let e = chunk_error(9, errno::EINVAL, "bad");
        assert_eq!(e.len(), 20 + 6 + 3);
        assert_eq!(&e[6..8], &chunk::ERROR.to_be_bytes());
        assert_eq!(&e[16..20], &9u32.to_be_bytes());
        assert_eq!(&e[20..24], &22u32.to_be_bytes());
        assert_eq!(&e[24..26], &3u16.to_be_bytes());
    }

    proptest::proptest! {
        /// Whatever a client sends as INFO/GO data is parsed or refused, never a panic, and a
        /// parse never reads past the data.
        #[test]
        fn info_request_never_panics(d in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            if let Ok(r) = InfoRequest::parse(&d) {
                proptest::prop_assert_eq!(4 + r.name.len() + 2 + 2 * r.requests.len(), d.len());
            }
        }

        #[test]
        fn request_round_trips(flags: u16, kind: u16, cookie: u64, offset: u64, length: u32) {
            let r = Request { flags, kind, cookie, offset, length };
            proptest::prop_assert_eq!(Request::parse(&r.encode()), Ok(r));
        }
    }
}
