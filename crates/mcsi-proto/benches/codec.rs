//! Codec throughput: decode and encode of Data-In PDUs (8 KiB and 256 KiB payloads) and of a
//! SCSI Command, with and without digests, and CRC32C over 8 KiB and 1 MiB.
//!
//! `cargo bench -p mcsi-proto --bench codec -- --warm-up-time 1 --measurement-time 3`

use bytes::{Bytes, BytesMut};
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mcsi_proto::digest::crc32c;
use mcsi_proto::pdu::{decode, DataIn, Framing, Pdu, ScsiCommand, TaskAttr};

fn data_in(len: usize) -> Pdu {
    Pdu::DataIn(DataIn {
        final_: true,
        ack: false,
        overflow: false,
        underflow: false,
        status: Some(0),
        lun: 0x0001_0000_0000_0000,
        itt: 0x1234,
        ttt: 0xffff_ffff,
        stat_sn: 10,
        exp_cmd_sn: 11,
        max_cmd_sn: 42,
        data_sn: 0,
        buffer_offset: 0,
        residual_count: 0,
        data: Bytes::from((0..len).map(|i| (i * 7) as u8).collect::<Vec<u8>>()),
    })
}

fn scsi_command() -> Pdu {
    // READ(16) of 8 blocks at LBA 0x1000.
    let mut cdb = [0u8; 16];
    cdb[0] = 0x88;
    cdb[2..10].copy_from_slice(&0x1000u64.to_be_bytes());
    cdb[10..14].copy_from_slice(&8u32.to_be_bytes());
    Pdu::ScsiCommand(ScsiCommand {
        immediate: false,
        final_: true,
        read: true,
        write: false,
        attr: TaskAttr::Simple,
        lun: 0,
        itt: 77,
        expected_data_transfer_length: 4096,
        cmd_sn: 5,
        exp_stat_sn: 9,
        cdb: Bytes::copy_from_slice(&cdb),
        bidi_read_length: None,
        data: Bytes::new(),
    })
}

fn framings() -> [(&'static str, Framing); 2] {
    let plain = Framing {
        header_digest: false,
        data_digest: false,
        max_data_segment_length: 1 << 20,
    };
    let digests = Framing {
        header_digest: true,
        data_digest: true,
        ..plain
    };
    [("plain", plain), ("digests", digests)]
}

fn codec(c: &mut Criterion) {
    let cases = [
        ("data_in_8k", data_in(8 * 1024)),
        ("data_in_256k", data_in(256 * 1024)),
        ("scsi_command", scsi_command()),
    ];
    for (fname, framing) in framings() {
        let mut g = c.benchmark_group(format!("encode_{fname}"));
        for (name, pdu) in &cases {
            let len = pdu.encode(&framing).len();
            g.throughput(Throughput::Bytes(len as u64));
            // Encoding builds the header and trailer; the payload is shared, not copied.
            g.bench_function(*name, |b| b.iter(|| black_box(pdu.encode(&framing)).len()));
        }
        g.finish();

        let mut g = c.benchmark_group(format!("decode_{fname}"));
        for (name, pdu) in &cases {
            let wire = pdu.encode(&framing).to_vec();
            g.throughput(Throughput::Bytes(wire.len() as u64));
            // Each iteration decodes from a fresh buffer (the copy into it is part of the cost,
            // as a socket read would be).
            g.bench_function(*name, |b| {
                b.iter(|| {
                    let mut buf = BytesMut::from(&wire[..]);
                    black_box(decode(&mut buf, &framing))
                })
            });
        }
        g.finish();
    }

    let mut g = c.benchmark_group("crc32c");
    for len in [8 * 1024, 1024 * 1024] {
        let data: Vec<u8> = (0..len).map(|i| (i * 13) as u8).collect();
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_with_input(BenchmarkId::from_parameter(len), &data, |b, d| {
            b.iter(|| crc32c(black_box(d)))
        });
    }
    g.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
