#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Property tests: every PDU survives encode -> decode under every framing, every truncation asks
//! for more, and arbitrary bytes never panic the decoder.

use bytes::{Bytes, BytesMut};
use mcsi_proto::pdu::*;
use proptest::prelude::*;

fn bytes_up_to(n: usize) -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..=n).prop_map(Bytes::from)
}

fn stage() -> impl Strategy<Value = Stage> {
    prop_oneof![
        Just(Stage::Security),
        Just(Stage::Operational),
        Just(Stage::FullFeature)
    ]
}

fn attr() -> impl Strategy<Value = TaskAttr> {
    (0u8..8).prop_map(|v| match v {
        0 => TaskAttr::Untagged,
        1 => TaskAttr::Simple,
        2 => TaskAttr::Ordered,
        3 => TaskAttr::HeadOfQueue,
        4 => TaskAttr::Aca,
        r => TaskAttr::Reserved(r),
    })
}

fn framing() -> impl Strategy<Value = Framing> {
    (any::<bool>(), any::<bool>()).prop_map(|(h, d)| Framing {
        header_digest: h,
        data_digest: d,
        max_data_segment_length: 8192,
    })
}

fn login_flags() -> impl Strategy<Value = (bool, bool, Stage, Stage)> {
    (any::<bool>(), any::<bool>(), stage(), stage()).prop_map(|(t, c, csg, nsg)| {
        // T and C never together; NSG is reserved (reported as CSG) without T.
        let c = c && !t;
        (t, c, csg, if t { nsg } else { csg })
    })
}

fn pdu() -> impl Strategy<Value = Pdu> {
    let u = any::<u32>;
    prop_oneof![
        (
            any::<bool>(),
            any::<u64>(),
            u(),
            u(),
            u(),
            u(),
            bytes_up_to(300)
        )
            .prop_map(
                |(immediate, lun, itt, ttt, cmd_sn, exp_stat_sn, data)| Pdu::NopOut(NopOut {
                    immediate,
                    lun,
                    itt,
                    ttt,
                    cmd_sn,
                    exp_stat_sn,
                    data
                })
            ),
        (
            (any::<[bool; 4]>(), attr(), any::<u64>(), u(), u(), u(), u()),
            (
                prop::collection::vec(any::<u8>(), 16..=64),
                prop::option::of(u()),
                bytes_up_to(600)
            )
        )
            .prop_map(
                |(
                    ([immediate, final_, read, write], attr, lun, itt, edtl, cmd_sn, exp_stat_sn),
                    (cdb, bidi_read_length, data),
                )| Pdu::ScsiCommand(ScsiCommand {
                    immediate,
                    final_,
                    read,
                    write,
                    attr,
                    lun,
                    itt,
                    expected_data_transfer_length: edtl,
                    cmd_sn,
                    exp_stat_sn,
                    cdb: Bytes::from(cdb),
                    bidi_read_length,
                    data
                })
            ),
        (
            any::<bool>(),
            0u8..128,
            any::<u64>(),
            (u(), u(), u(), u(), u(), u())
        )
            .prop_map(|(immediate, function, lun, (itt, rtt, cs, es, rcs, eds))| {
                Pdu::TaskMgmtRequest(TaskMgmtRequest {
                    immediate,
                    function,
                    lun,
                    itt,
                    referenced_task_tag: rtt,
                    cmd_sn: cs,
                    exp_stat_sn: es,
                    ref_cmd_sn: rcs,
                    exp_data_sn: eds,
                })
            }),
        (
            login_flags(),
            any::<(u8, u8, [u8; 6], u16, u32, u16, u32, u32)>(),
            bytes_up_to(400)
        )
            .prop_map(
                |(
                    (transit, continue_, csg, nsg),
                    (vmax, vmin, isid, tsih, itt, cid, cs, es),
                    data,
                )| {
                    Pdu::LoginRequest(LoginRequest {
                        transit,
                        continue_,
                        csg,
                        nsg,
                        version_max: vmax,
                        version_min: vmin,
                        isid: Isid(isid),
                        tsih,
                        itt,
                        cid,
                        cmd_sn: cs,
                        exp_stat_sn: es,
                        data,
                    })
                }
            ),
        (
            any::<[bool; 3]>(),
            any::<u64>(),
            u(),
            u(),
            u(),
            u(),
            bytes_up_to(300)
        )
            .prop_map(
                |([immediate, final_, continue_], lun, itt, ttt, cmd_sn, exp_stat_sn, data)| {
                    Pdu::TextRequest(TextRequest {
                        immediate,
                        final_,
                        continue_,
                        lun,
                        itt,
                        ttt,
                        cmd_sn,
                        exp_stat_sn,
                        data,
                    })
                }
            ),
        (
            any::<bool>(),
            any::<u64>(),
            (u(), u(), u(), u(), u()),
            bytes_up_to(600)
        )
            .prop_map(
                |(final_, lun, (itt, ttt, es, dsn, off), data)| Pdu::DataOut(DataOut {
                    final_,
                    lun,
                    itt,
                    ttt,
                    exp_stat_sn: es,
                    data_sn: dsn,
                    buffer_offset: off,
                    data
                })
            ),
        (any::<bool>(), 0u8..128, u(), any::<u16>(), u(), u()).prop_map(
            |(immediate, reason, itt, cid, cmd_sn, exp_stat_sn)| {
                Pdu::LogoutRequest(LogoutRequest {
                    immediate,
                    reason,
                    itt,
                    cid,
                    cmd_sn,
                    exp_stat_sn,
                })
            }
        ),
        (0u8..16, any::<u64>(), u(), u(), u(), u(), u()).prop_map(
            |(snack_type, lun, itt, ttt, es, beg_run, run_length)| {
                Pdu::SnackRequest(SnackRequest {
                    snack_type,
                    lun,
                    itt,
                    ttt,
                    exp_stat_sn: es,
                    beg_run,
                    run_length,
                })
            }
        ),
        (any::<u64>(), u(), u(), u(), u(), u(), bytes_up_to(300)).prop_map(
            |(lun, itt, ttt, ss, ecs, mcs, data)| Pdu::NopIn(NopIn {
                lun,
                itt,
                ttt,
                stat_sn: ss,
                exp_cmd_sn: ecs,
                max_cmd_sn: mcs,
                data
            })
        ),
        (
            any::<[bool; 4]>(),
            any::<(u8, u8)>(),
            (u(), u(), u(), u(), u(), u(), u(), u()),
            bytes_up_to(260)
        )
            .prop_map(
                |(
                    [bo, bu, o, un],
                    (response, status),
                    (itt, st, ss, ecs, mcs, eds, brc, rc),
                    sense,
                )| {
                    Pdu::ScsiResponse(ScsiResponse {
                        bidi_overflow: bo,
                        bidi_underflow: bu,
                        overflow: o,
                        underflow: un,
                        response,
                        status,
                        itt,
                        snack_tag: st,
                        stat_sn: ss,
                        exp_cmd_sn: ecs,
                        max_cmd_sn: mcs,
                        exp_data_sn: eds,
                        bidi_residual_count: brc,
                        residual_count: rc,
                        sense,
                    })
                }
            ),
        (any::<u8>(), u(), u(), u(), u()).prop_map(|(response, itt, ss, ecs, mcs)| {
            Pdu::TaskMgmtResponse(TaskMgmtResponse {
                response,
                itt,
                stat_sn: ss,
                exp_cmd_sn: ecs,
                max_cmd_sn: mcs,
            })
        }),
        (
            login_flags(),
            any::<(u8, u8, [u8; 6], u16, u32)>(),
            (u(), u(), u(), any::<(u8, u8)>()),
            bytes_up_to(400)
        )
            .prop_map(
                |(
                    (transit, continue_, csg, nsg),
                    (vmax, vact, isid, tsih, itt),
                    (ss, ecs, mcs, (class, detail)),
                    data,
                )| {
                    Pdu::LoginResponse(LoginResponse {
                        transit,
                        continue_,
                        csg,
                        nsg,
                        version_max: vmax,
                        version_active: vact,
                        isid: Isid(isid),
                        tsih,
                        itt,
                        stat_sn: ss,
                        exp_cmd_sn: ecs,
                        max_cmd_sn: mcs,
                        status_class: class,
                        status_detail: detail,
                        data,
                    })
                }
            ),
        (
            any::<[bool; 2]>(),
            any::<u64>(),
            (u(), u(), u(), u(), u()),
            bytes_up_to(300)
        )
            .prop_map(
                |([final_, continue_], lun, (itt, ttt, ss, ecs, mcs), data)| {
                    Pdu::TextResponse(TextResponse {
                        final_,
                        continue_,
                        lun,
                        itt,
                        ttt,
                        stat_sn: ss,
                        exp_cmd_sn: ecs,
                        max_cmd_sn: mcs,
                        data,
                    })
                }
            ),
        (
            any::<[bool; 4]>(),
            prop::option::of(any::<u8>()),
            any::<u64>(),
            (u(), u(), u(), u(), u(), u(), u(), u()),
            bytes_up_to(600)
        )
            .prop_map(
                |(
                    [final_, ack, o, un],
                    status,
                    lun,
                    (itt, ttt, ss, ecs, mcs, dsn, off, rc),
                    data,
                )| {
                    // Status fields only exist with the S bit (which implies F).
                    let has = status.is_some();
                    Pdu::DataIn(DataIn {
                        final_: final_ || has,
                        ack,
                        overflow: o && has,
                        underflow: un && has,
                        status,
                        lun,
                        itt,
                        ttt,
                        stat_sn: if has { ss } else { 0 },
                        exp_cmd_sn: ecs,
                        max_cmd_sn: mcs,
                        data_sn: dsn,
                        buffer_offset: off,
                        residual_count: if has { rc } else { 0 },
                        data,
                    })
                }
            ),
        (any::<u8>(), u(), u(), u(), u(), any::<(u16, u16)>()).prop_map(
            |(response, itt, ss, ecs, mcs, (t2w, t2r))| Pdu::LogoutResponse(LogoutResponse {
                response,
                itt,
                stat_sn: ss,
                exp_cmd_sn: ecs,
                max_cmd_sn: mcs,
                time2wait: t2w,
                time2retain: t2r
            })
        ),
        (any::<u64>(), (u(), u(), u(), u(), u(), u(), u(), u())).prop_map(
            |(lun, (itt, ttt, ss, ecs, mcs, r2tsn, off, len))| Pdu::R2t(R2t {
                lun,
                itt,
                ttt,
                stat_sn: ss,
                exp_cmd_sn: ecs,
                max_cmd_sn: mcs,
                r2t_sn: r2tsn,
                buffer_offset: off,
                desired_data_transfer_length: len
            })
        ),
        (
            any::<u64>(),
            (u(), u(), u()),
            any::<(u8, u8, u16, u16, u16)>(),
            bytes_up_to(100)
        )
            .prop_map(|(lun, (ss, ecs, mcs), (ev, vc, p1, p2, p3), data)| {
                Pdu::AsyncMessage(AsyncMessage {
                    lun,
                    stat_sn: ss,
                    exp_cmd_sn: ecs,
                    max_cmd_sn: mcs,
                    async_event: ev,
                    async_vcode: vc,
                    parameter1: p1,
                    parameter2: p2,
                    parameter3: p3,
                    data,
                })
            }),
        (any::<u8>(), u(), u(), u(), u(), bytes_up_to(48)).prop_map(
            |(reason, ss, ecs, mcs, dsn, header)| Pdu::Reject(Reject {
                reason,
                stat_sn: ss,
                exp_cmd_sn: ecs,
                max_cmd_sn: mcs,
                data_sn_r2t_sn: dsn,
                header
            })
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn round_trip(p in pdu(), f in framing()) {
        let enc = p.try_encode(&f).unwrap();
        let wire = enc.to_vec();
        prop_assert_eq!(wire.len() % 4, 0);
        prop_assert_eq!(p.data_len(), p.data_segment().len());
        prop_assert_eq!(pdu_len(&wire, &f), Some(wire.len()));
        let mut buf = BytesMut::from(&wire[..]);
        let back = decode(&mut buf, &f).unwrap().unwrap();
        prop_assert!(buf.is_empty());
        prop_assert_eq!(&back, &p);
        prop_assert_eq!(back.encode(&f).to_vec(), wire.clone());
        // Moving the data segment out encodes the same bytes.
        prop_assert_eq!(back.encode_owned(&f).to_vec(), wire);
    }

    #[test]
    fn every_truncation_needs_more(p in pdu(), f in framing()) {
        let wire = p.encode(&f).to_vec();
        for cut in 0..wire.len() {
            let mut buf = BytesMut::from(&wire[..cut]);
            prop_assert_eq!(decode(&mut buf, &f), Ok(None));
            prop_assert_eq!(buf.len(), cut);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        raw in prop::collection::vec(any::<u8>(), 0..400),
        f in framing(),
    ) {
        let mut buf = BytesMut::from(&raw[..]);
        let before = buf.len();
        match decode(&mut buf, &f) {
            Ok(None) => prop_assert_eq!(buf.len(), before),
            Ok(Some(_)) => prop_assert_eq!(before - buf.len(), pdu_len(&raw, &f).unwrap()),
            Err(e) if e.consumed() => {
                prop_assert_eq!(before - buf.len(), pdu_len(&raw, &f).unwrap());
                prop_assert!(e.rejected_header().is_some());
            }
            Err(_) => prop_assert_eq!(buf.len(), before),
        }
    }

    #[test]
    fn flipped_bit_is_caught_by_digests(p in pdu(), bit in any::<prop::sample::Index>()) {
        let f = Framing { header_digest: true, data_digest: true, max_data_segment_length: 8192 };
        let mut wire = p.encode(&f).to_vec();
        let i = bit.index(wire.len() * 8);
        wire[i / 8] ^= 1 << (i % 8);
        let mut buf = BytesMut::from(&wire[..]);
        // Any single-bit error is detected by CRC32C (or shows up as a length change).
        let undetected = matches!(decode(&mut buf, &f), Ok(Some(_)));
        prop_assert!(!undetected, "undetected corruption at bit {}", i);
    }
}
