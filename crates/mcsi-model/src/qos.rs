//! Network bandwidth for an IP-storage QoS requirement: seed 004 (Nam, Ryu, Park, Ahn,
//! "A network bandwidth computation technique for IP storage with QoS guarantees"), eq. 1-10.
//!
//! A requirement is `Q = {f, iops, sz, rt}`: read ratio, I/O operations per second, request size
//! and response time. Per request, eq. 1-4 count the bytes each direction carries, with
//! `ov = 106` bytes of Ethernet (18), TCP/IP (40) and iSCSI (48) header per frame, frames of
//! `S_f` bytes and `Ŝ_f = S_f - ov` bytes of data per frame:
//!
//! ```text
//! (1) D_r^cs(sz) = ov                                  read: the command
//! (2) D_r^sc(sz) = 2 ov + floor(sz/Ŝ_f) S_f + sz mod Ŝ_f  read: data-in and the response
//! (3) D_w^cs(sz) = ov + sz                          if sz <= Ŝ_f (immediate data)
//!               = ov + floor(sz/Ŝ_f) S_f + sz mod Ŝ_f   otherwise
//! (4) D_w^sc(sz) = ov       if sz <= FirstBurstLength   (the response)
//!               = 2 ov     otherwise                     (an R2T and the response)
//! ```
//!
//! Eq. 5-6 ("prot") average them over the read ratio and multiply by IOPS; eq. 7-8 give the
//! bandwidth that moves one request within `alpha x rt`; eq. 9-10 take the larger of the two.
//!
//! # Which direction and which alpha
//!
//! `f` is the fraction of reads (Q1 with f = 1 is the read workload: the client sends only
//! commands, 106 bytes each). "Toward IP storage" in Tables 1-2 is client to server (c->s).
//! The paper does not print alpha; it follows from Table 1, whose "toward IP storage" column is
//! `m^cs` (eq. 7) for all four requirements, since that exceeds the protocol figure. With
//! MB = 2^20 bytes, solving `alpha = D / (rt x B_table)`:
//!
//! ```text
//!      D (bytes)   rt     Table 1    alpha        alpha range from the table's rounding
//! Q1   106         10 ms  0.05 MB/s  0.2022       0.1838 .. 0.2246   (0.045 .. 0.055)
//! Q2   1130        3 ms   1.84 MB/s  0.1952       0.1947 .. 0.1958   (1.835 .. 1.845)
//! Q3   106         18 ms  0.03 MB/s  0.1872       0.1605 .. 0.2246   (0.025 .. 0.035)
//! Q4   70624       22 ms  15.67 MB/s 0.19537      0.19531 .. 0.19543 (15.665 .. 15.675)
//! ```
//!
//! All four ranges overlap in 0.19531 .. 0.19543 (pinned by Q4, the figure with four
//! significant digits), so [`PAPER_ALPHA`] = 0.1954 reproduces every figure to its printed
//! precision: 0.0517, 1.838, 0.0287, 15.668 MB/s. Table 2's "prot" column is eq. 5 alone:
//! 0.0083, 0.287, 0.0077, 14.01 MB/s against the printed 0.01, 0.29, 0.01, 14.08.
//!
//! # Reading of eq. 7-8
//!
//! The paper prints `floor(f)` and `floor(1 - f)` as the weights in eq. 7-8. Taken literally they
//! are both 0 for any mixed workload (0 < f < 1), which would drop the response-time bound the
//! text asks for ("the transmission delay of each I/O request [is] not greater than alpha rt").
//! They are read here as indicators that reads (f > 0) and writes (f < 1) occur, i.e. ceilings.
//! For f in {0, 1}, the only values the paper evaluates, both readings agree.

use crate::{non_negative, positive, probability, ModelError};
use serde::Serialize;

/// Ethernet (18) + TCP/IP (40) + iSCSI basic header segment (48) bytes per frame (seed 004, §3).
pub const DEFAULT_OVERHEAD: u64 = 106;
/// The paper's maximum Ethernet frame size (§4).
pub const DEFAULT_FRAME: u64 = 1500;
/// RFC 7143's default FirstBurstLength. It is what the paper's Table 2 implies: Q4's 64 KiB
/// writes get 0.02 MB/s toward the client, one response per write (eq. 4's first case).
pub const DEFAULT_FIRST_BURST: u64 = 65536;
/// The alpha that reproduces seed 004's Table 1; see the module documentation for how.
pub const PAPER_ALPHA: f64 = 0.1954;

/// Seed 004's requirements Q1-Q4 (§4): 1 KiB random reads at 82 IOPS within 10 ms, 1 KiB
/// random writes at 266 within 3 ms, 64 KiB reads at 76 within 18 ms, 64 KiB writes at 208
/// within 22 ms, with [`PAPER_ALPHA`].
pub const SEED_004: [Requirement; 4] = [
    Requirement::paper(1.0, 82.0, 1024, 0.010),
    Requirement::paper(0.0, 266.0, 1024, 0.003),
    Requirement::paper(1.0, 76.0, 65536, 0.018),
    Requirement::paper(0.0, 208.0, 65536, 0.022),
];

/// How a requirement's bandwidth is allocated: the paper's three techniques.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Allocation {
    /// `iops x sz`, the same both ways (Table 2, "naive").
    Naive,
    /// Eq. 5-6: the protocol's bytes (Table 2, "prot").
    Prot,
    /// Eq. 9-10: protocol bytes, at least the response-time floor (Table 1, "prot-rt").
    ProtRt,
}

impl Allocation {
    /// `naive`, `prot` or `prot-rt`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "naive" => Some(Allocation::Naive),
            "prot" => Some(Allocation::Prot),
            "prot-rt" => Some(Allocation::ProtRt),
            _ => None,
        }
    }

    /// Bytes per second (client to storage, storage to client).
    pub fn rates(self, r: &Report) -> (f64, f64) {
        let pick = |d: &Direction| match self {
            Allocation::Naive => d.naive,
            Allocation::Prot => d.protocol,
            Allocation::ProtRt => d.bandwidth,
        };
        (pick(&r.c_to_s), pick(&r.s_to_c))
    }
}

/// A storage QoS requirement `Q = {f, iops, sz, rt}` and the share `alpha` of `rt` the network
/// transfer may take.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Requirement {
    /// Fraction of I/O requests that are reads, in [0, 1].
    pub read_ratio: f64,
    /// I/O requests per second.
    pub iops: f64,
    /// Mean request size in bytes.
    pub size_bytes: u64,
    /// Demanded mean response time in seconds.
    pub rt_s: f64,
    /// Share of `rt` allowed for the network transfer of one request, 0 < alpha < 1.
    pub alpha: f64,
}

impl Requirement {
    /// A requirement with the paper's alpha.
    pub const fn paper(read_ratio: f64, iops: f64, size_bytes: u64, rt_s: f64) -> Self {
        Requirement {
            read_ratio,
            iops,
            size_bytes,
            rt_s,
            alpha: PAPER_ALPHA,
        }
    }
}

/// The framing the per-request byte counts assume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Framing {
    /// Ethernet frame size `S_f` in bytes.
    pub frame_bytes: u64,
    /// Protocol overhead per frame `ov_prot` in bytes.
    pub overhead_bytes: u64,
    /// iSCSI FirstBurstLength in bytes.
    pub first_burst_bytes: u64,
    /// Bytes of one TCP acknowledgement frame counted against the direction opposite to a
    /// request's data, one per two data frames (delayed ACK); 0, the paper's model, counts
    /// none. Not in seed 004: mcsi's extension, [`ACK_FRAME`] with Ethernet and TCP/IP
    /// headers as the paper counts them. A lone data frame's acknowledgement rides on the
    /// request's other PDUs and is not counted.
    pub ack_bytes: u64,
}

/// An acknowledgement without data: Ethernet (18) and TCP/IP (40) headers, as `ov` counts them.
pub const ACK_FRAME: u64 = 58;

impl Default for Framing {
    fn default() -> Self {
        Framing {
            frame_bytes: DEFAULT_FRAME,
            overhead_bytes: DEFAULT_OVERHEAD,
            first_burst_bytes: DEFAULT_FIRST_BURST,
            ack_bytes: 0,
        }
    }
}

impl Framing {
    fn check(&self) -> Result<(), ModelError> {
        if self.frame_bytes <= self.overhead_bytes {
            return Err(ModelError::OutOfRange {
                name: "frame",
                value: self.frame_bytes as f64,
                allowed: "the frame must be larger than the per-frame protocol overhead",
            });
        }
        Ok(())
    }

    /// `Ŝ_f`: data bytes per full frame.
    pub fn data_per_frame(&self) -> u64 {
        self.frame_bytes.saturating_sub(self.overhead_bytes)
    }

    /// `floor(sz/Ŝ_f) S_f + sz mod Ŝ_f`: the bytes of `sz` data split into full frames plus a
    /// remainder (whose header is counted by the caller).
    fn fragmented(&self, sz: u64) -> u64 {
        let data = self.data_per_frame().max(1);
        (sz / data) * self.frame_bytes + sz % data
    }

    /// Acknowledgement bytes the other direction sends for `bytes` of data: one ACK frame per
    /// two full frames (`ack_bytes`; 0 in the paper's model).
    fn acks_for(&self, bytes: u64) -> u64 {
        let frames = bytes.div_ceil(self.frame_bytes.max(1));
        (frames / 2) * self.ack_bytes
    }

    /// Eq. 1: client to server bytes of one read (with `ack_bytes`, plus the client's
    /// acknowledgements of the data).
    pub fn read_c2s(&self, sz: u64) -> u64 {
        self.overhead_bytes + self.acks_for(self.read_s2c(sz))
    }

    /// Eq. 2: server to client bytes of one read.
    pub fn read_s2c(&self, sz: u64) -> u64 {
        2 * self.overhead_bytes + self.fragmented(sz)
    }

    /// Eq. 3: client to server bytes of one write.
    pub fn write_c2s(&self, sz: u64) -> u64 {
        if sz <= self.data_per_frame() {
            self.overhead_bytes + sz
        } else {
            self.overhead_bytes + self.fragmented(sz)
        }
    }

    /// Eq. 4: server to client bytes of one write (with `ack_bytes`, plus the server's
    /// acknowledgements of the data).
    pub fn write_s2c(&self, sz: u64) -> u64 {
        let pdus = if sz <= self.first_burst_bytes {
            self.overhead_bytes
        } else {
            2 * self.overhead_bytes
        };
        pdus + self.acks_for(self.write_c2s(sz))
    }
}

/// Bandwidth of one direction, bytes per second.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Direction {
    /// Eq. 9/10: what to allocate, `max(protocol, min_for_rt)`.
    pub bandwidth: f64,
    /// Eq. 5/6 (the paper's "prot"): mean bytes per request times IOPS.
    pub protocol: f64,
    /// Eq. 7/8: the bandwidth that moves the largest request in `alpha x rt`.
    pub min_for_rt: f64,
    /// The paper's "naive" figure: `iops x sz`, the same for both directions.
    pub naive: f64,
}

/// Bytes on the wire for one request of the requirement's size (eq. 1-4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PerRequest {
    pub read_c_to_s: u64,
    pub read_s_to_c: u64,
    pub write_c_to_s: u64,
    pub write_s_to_c: u64,
}

/// Bandwidth for both directions of one requirement.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Report {
    /// Client to IP storage ("toward IP storage").
    pub c_to_s: Direction,
    /// IP storage to client ("toward client").
    pub s_to_c: Direction,
    pub per_request: PerRequest,
}

fn direction(q: &Requirement, read: u64, write: u64) -> Direction {
    let f = q.read_ratio;
    let (read, write) = (read as f64, write as f64);
    // Eq. 5/6.
    let protocol = (f * read + (1.0 - f) * write) * q.iops;
    // Eq. 7/8, with the weights read as "this request type occurs" (see module docs).
    let reads = if f > 0.0 { read } else { 0.0 };
    let writes = if f < 1.0 { write } else { 0.0 };
    let min_for_rt = reads.max(writes) / (q.alpha * q.rt_s);
    Direction {
        bandwidth: protocol.max(min_for_rt),
        protocol,
        min_for_rt,
        naive: q.iops * q.size_bytes as f64,
    }
}

/// Evaluates seed 004's eq. 1-10 for both directions.
pub fn bandwidth(q: &Requirement, framing: &Framing) -> Result<Report, ModelError> {
    probability("read ratio", q.read_ratio)?;
    non_negative("iops", q.iops)?;
    positive("rt", q.rt_s)?;
    if !(q.alpha > 0.0 && q.alpha < 1.0) {
        return Err(ModelError::OutOfRange {
            name: "alpha",
            value: q.alpha,
            allowed: "must lie strictly between 0 and 1 (seed 004, eq. 7-8)",
        });
    }
    framing.check()?;
    let sz = q.size_bytes;
    let per_request = PerRequest {
        read_c_to_s: framing.read_c2s(sz),
        read_s_to_c: framing.read_s2c(sz),
        write_c_to_s: framing.write_c2s(sz),
        write_s_to_c: framing.write_s2c(sz),
    };
    Ok(Report {
        c_to_s: direction(q, per_request.read_c_to_s, per_request.write_c_to_s),
        s_to_c: direction(q, per_request.read_s_to_c, per_request.write_s_to_c),
        per_request,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: f64 = 1048576.0;

    fn q(read_ratio: f64, iops: f64, size_bytes: u64, rt_ms: f64) -> Requirement {
        Requirement {
            read_ratio,
            iops,
            size_bytes,
            rt_s: rt_ms / 1000.0,
            alpha: PAPER_ALPHA,
        }
    }

    /// Seed 004's Q1-Q4 (§4), written out again against [`SEED_004`].
    fn paper() -> [Requirement; 4] {
        let p = [
            q(1.0, 82.0, 1024, 10.0),
            q(0.0, 266.0, 1024, 3.0),
            q(1.0, 76.0, 65536, 18.0),
            q(0.0, 208.0, 65536, 22.0),
        ];
        assert_eq!(p, SEED_004);
        p
    }

    /// `model` matches a figure printed with two decimals: within 5 %, or (for figures so small
    /// that two decimals cannot carry 5 %) rounding to the printed value.
    fn matches(model_mib: f64, printed: f64) -> bool {
        (model_mib - printed).abs() <= 0.05 * printed
            || (model_mib * 100.0).round() / 100.0 == printed
    }

    #[test]
    fn acknowledgements_count_in_the_reverse_direction() {
        let fr = Framing {
            ack_bytes: ACK_FRAME,
            ..Framing::default()
        };
        // 1 KiB: one data frame, whose ACK rides on the other PDUs.
        assert_eq!(fr.read_c2s(1024), 106);
        assert_eq!(fr.write_s2c(1024), 106);
        // 64 KiB: 212 + 47 x 1500 + 18 = 70730 bytes, 48 frames, 24 ACKs.
        assert_eq!(fr.read_c2s(65536), 106 + 24 * 58);
        assert_eq!(fr.write_s2c(65536), 106 + 24 * 58);
        assert_eq!(fr.read_s2c(65536), Framing::default().read_s2c(65536));
        // Q3 toward IP storage grows from 106 to 1498 bytes per read.
        let r = bandwidth(&SEED_004[2], &fr).unwrap();
        assert!((r.c_to_s.min_for_rt - 1498.0 / (PAPER_ALPHA * 0.018)).abs() < 1e-6);
    }

    #[test]
    fn per_request_bytes_by_hand() {
        let fr = Framing::default();
        assert_eq!(fr.data_per_frame(), 1394);
        // 1 KiB: fits one frame.
        assert_eq!(fr.read_c2s(1024), 106);
        assert_eq!(fr.read_s2c(1024), 2 * 106 + 1024);
        assert_eq!(fr.write_c2s(1024), 106 + 1024);
        assert_eq!(fr.write_s2c(1024), 106);
        // 64 KiB: 65536 = 47 x 1394 + 18.
        assert_eq!(fr.read_s2c(65536), 212 + 47 * 1500 + 18);
        assert_eq!(fr.write_c2s(65536), 106 + 47 * 1500 + 18);
        // Exactly FirstBurstLength: one response; one byte more: R2T + response.
        assert_eq!(fr.write_s2c(65536), 106);
        assert_eq!(fr.write_s2c(65537), 212);
        // The boundary of immediate data: sz = Ŝ_f is one frame of exactly S_f bytes.
        assert_eq!(fr.write_c2s(1394), 1500);
        assert_eq!(fr.write_c2s(1395), 106 + 1500 + 1);
        assert_eq!(fr.read_s2c(0), 212);
    }

    #[test]
    fn table1_toward_ip_storage() {
        // Table 1, prot-rt, "toward IP storage" (MB = 2^20 bytes).
        let printed = [0.05, 1.84, 0.03, 15.67];
        for (req, want) in paper().iter().zip(printed) {
            let r = bandwidth(req, &Framing::default()).unwrap();
            let got = r.c_to_s.bandwidth / MIB;
            assert!(
                (got - want).abs() <= 0.05 * want,
                "{req:?}: {got} MiB/s vs {want}"
            );
            // And the response-time term is the one that decides (eq. 9).
            assert_eq!(r.c_to_s.bandwidth, r.c_to_s.min_for_rt);
        }
        // By hand: Q4 = 70624 B / (0.1954 x 0.022 s) = 16428.7 KB/s.
        let r = bandwidth(&paper()[3], &Framing::default()).unwrap();
        assert!((r.c_to_s.min_for_rt - 70624.0 / (0.1954 * 0.022)).abs() < 1e-6);
    }

    #[test]
    fn alpha_derivation_from_table1() {
        // Each figure's rounding interval gives an alpha interval; they must all overlap and
        // PAPER_ALPHA must be in the overlap.
        let printed = [0.05, 1.84, 0.03, 15.67];
        let half_unit = 0.005;
        let (mut lo, mut hi) = (0.0f64, 1.0f64);
        for (req, b) in paper().iter().zip(printed) {
            let fr = Framing::default();
            let d = if req.read_ratio == 1.0 {
                fr.read_c2s(req.size_bytes)
            } else {
                fr.write_c2s(req.size_bytes)
            } as f64;
            lo = lo.max(d / (req.rt_s * (b + half_unit) * MIB));
            hi = hi.min(d / (req.rt_s * (b - half_unit) * MIB));
        }
        assert!(lo < hi, "no single alpha: {lo}..{hi}");
        assert!((0.1953..0.1955).contains(&lo) && (0.1954..0.1955).contains(&hi));
        assert!(lo <= PAPER_ALPHA && PAPER_ALPHA <= hi);
    }

    #[test]
    fn table2_prot_and_naive() {
        // Table 2, prot, "toward IP storage": eq. 5 alone.
        let printed = [0.01, 0.29, 0.01, 14.08];
        for (req, want) in paper().iter().zip(printed) {
            let r = bandwidth(req, &Framing::default()).unwrap();
            let got = r.c_to_s.protocol / MIB;
            assert!(matches(got, want), "{req:?}: {got} MiB/s vs {want}");
        }
        // By hand: Q2 = 1130 B x 266/s = 300580 B/s; Q4 = 70624 x 208 = 14689792 B/s.
        let r2 = bandwidth(&paper()[1], &Framing::default()).unwrap();
        assert_eq!(r2.c_to_s.protocol, 300580.0);
        let r4 = bandwidth(&paper()[3], &Framing::default()).unwrap();
        assert_eq!(r4.c_to_s.protocol, 14689792.0);
        // Q4 prot "toward client" is printed as 0.02: one 106-byte response per write.
        assert_eq!(r4.s_to_c.protocol, 106.0 * 208.0);
        assert!(matches(r4.s_to_c.protocol / MIB, 0.02));
        // Naive: iops x size, both directions.
        assert_eq!(r4.c_to_s.naive, 208.0 * 65536.0);
        assert_eq!(r4.s_to_c.naive, r4.c_to_s.naive);
    }

    #[test]
    fn mixed_workload_keeps_the_rt_bound() {
        // f = 0.5, 4 KiB: both request types occur, the larger decides eq. 7.
        let req = Requirement {
            read_ratio: 0.5,
            iops: 100.0,
            size_bytes: 4096,
            rt_s: 0.01,
            alpha: 0.5,
        };
        let r = bandwidth(&req, &Framing::default()).unwrap();
        // 4096 = 2 x 1394 + 1308. Write c->s: 106 + 3000 + 1308 = 4414; read c->s: 106.
        assert_eq!(r.per_request.write_c_to_s, 4414);
        assert!((r.c_to_s.min_for_rt - 4414.0 / 0.005).abs() < 1e-6);
        // Read s->c: 212 + 3000 + 1308 = 4520; write s->c: 106.
        assert!((r.s_to_c.min_for_rt - 4520.0 / 0.005).abs() < 1e-6);
        // Eq. 5: (0.5 x 106 + 0.5 x 4414) x 100 = 226000.
        assert!((r.c_to_s.protocol - 226000.0).abs() < 1e-9);
        assert_eq!(r.c_to_s.bandwidth, r.c_to_s.min_for_rt);
    }

    #[test]
    fn protocol_term_wins_at_high_iops() {
        // A lax rt makes eq. 5 the larger term in eq. 9.
        let req = Requirement {
            read_ratio: 0.0,
            iops: 1000.0,
            size_bytes: 1024,
            rt_s: 1.0,
            alpha: 0.5,
        };
        let r = bandwidth(&req, &Framing::default()).unwrap();
        assert_eq!(r.c_to_s.protocol, 1130.0 * 1000.0);
        assert_eq!(r.c_to_s.min_for_rt, 2260.0);
        assert_eq!(r.c_to_s.bandwidth, r.c_to_s.protocol);
    }

    #[test]
    fn rejects_bad_input() {
        let fr = Framing::default();
        let mut req = paper()[0];
        req.alpha = 1.0;
        assert!(matches!(
            bandwidth(&req, &fr),
            Err(ModelError::OutOfRange { name: "alpha", .. })
        ));
        req.alpha = 0.0;
        assert!(bandwidth(&req, &fr).is_err());
        let mut req = paper()[0];
        req.rt_s = 0.0;
        assert!(bandwidth(&req, &fr).is_err());
        let mut req = paper()[0];
        req.read_ratio = 1.5;
        assert!(bandwidth(&req, &fr).is_err());
        let mut req = paper()[0];
        req.iops = -1.0;
        assert!(bandwidth(&req, &fr).is_err());
        let small = Framing {
            frame_bytes: 106,
            ..Framing::default()
        };
        let e = bandwidth(&paper()[0], &small).unwrap_err().to_string();
        assert!(e.contains("frame"), "{e}");
    }
}
