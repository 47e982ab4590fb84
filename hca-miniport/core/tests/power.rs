//! System sleep and resume with live verb objects on two HCAs (the
//! miniport's D0 exit and D0 entry, `verbs::restore`): the same handles
//! work afterwards, memory keys are unchanged and usable by the peer,
//! unconnected QPs keep their state and posted receives, SRQs their posted
//! WQEs, connected QPs come back in ERR with an event and their WRs flushed
//! with their `wr_id`s, and cycles leak nothing.

mod power_kit;
mod support;

use driver_platform::Irql;
use ib_types::event::AsyncEventCode;
use ib_types::ioctl::{DeallocPd, DestroyCq, DestroyQp, DestroySrq, Empty, ModifyQp, QueryQp};
use ib_types::qp::{QpModify, QpState, QpType};
use ib_types::scalars::{QKey, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::WcStatus;
use ib_types::wr::{RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, UdDest};
use power_kit::*;
use support::{World, lock, response};

const QKEY: u32 = 0x1111;

fn recv(wr_id: u64, sg_list: &'static [ib_types::wr::Sge]) -> RecvWr<'static> {
    RecvWr { wr_id, sg_list }
}

fn send(wr_id: u64, sg_list: &'static [ib_types::wr::Sge], op: SendOp) -> SendWr<'static> {
    SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        sg_list,
        ud: None,
    }
}

fn ud_send(wr_id: u64, sg_list: &'static [ib_types::wr::Sge], to: u32) -> SendWr<'static> {
    SendWr {
        ud: Some(UdDest {
            av: ib_types::handle::AvHandle::from_raw(1),
            remote_qpn: Qpn::new(to).unwrap(),
            remote_qkey: QKey::new(QKEY),
        }),
        ..send(wr_id, sg_list, SendOp::Send)
    }
}

fn arm(w: &World, i: usize, cq: u64) {
    let hca = w.hca_at(i);
    w.in_dpc(move || {
        hca.arm_cq(cq, ib_types::cq::CqNotify::NextCompletion)
            .unwrap()
    });
    w.settle();
}

#[test]
fn sleep_and_resume_keep_every_handle_keys_and_unconnected_qps() {
    sleep_and_resume(71);
}

#[test]
fn sleep_and_resume_over_more_schedules() {
    for seed in 300..304 {
        sleep_and_resume(seed);
    }
}

fn sleep_and_resume(seed: u64) {
    let (w, [x, y]) = two_hcas(seed, hca_miniport_core::init::HcaConfig::default());
    let (sx, sy) = (side(&w, x), side(&w, y));
    let (mx, my) = (Mem::new(&w, x, sx.pd), Mem::new(&w, y, sy.pd));
    let keys_before = (mx.region.lkey(), mx.region.rkey());
    let mpt_before = mx.query(&w);

    // UD: ua on X with its own receive queue; ub on Y receiving from an
    // SRQ. RC: a on X connected to b on Y.
    let srq = create_srq(&w, &sy, 8, 0);
    let (ua, qpn_ua) = create_qp(&w, &sx, QpType::Ud, None);
    let (ub, qpn_ub) = create_qp(&w, &sy, QpType::Ud, Some(srq));
    ud_to_rts(&w, x, ua, QKEY);
    ud_to_rts(&w, y, ub, QKEY);
    let (a, qpn_a) = create_qp(&w, &sx, QpType::Rc, None);
    let (b, qpn_b) = create_qp(&w, &sy, QpType::Rc, None);
    connect(&w, x, a, qpn_b, HCA_IPS[1][0]);
    connect(&w, y, b, qpn_a, HCA_IPS[0][0]);

    // Traffic before sleep works (UD X -> Y through the SRQ).
    let av_y = hca_prm::av::Av::try_from(&av_to(HCA_IPS[1][0])).unwrap();
    let av_x = hca_prm::av::Av::try_from(&av_to(HCA_IPS[0][0])).unwrap();
    assert_eq!(
        post_srq(
            &w,
            y,
            srq,
            vec![recv(1, my.sge(0, 1064)), recv(2, my.sge(2048, 1064))]
        ),
        (2, IbStatus::Success)
    );
    let first = pattern(1, 500);
    mx.write(0, &first);
    assert_eq!(
        post_send(
            &w,
            x,
            ua,
            vec![ud_send(10, mx.sge(0, 500), qpn_ub)],
            Some(av_y)
        ),
        (1, IbStatus::Success)
    );
    assert_eq!(
        summary(&poll_all(&w, x, sx.cq)),
        vec![(10, WcStatus::Success, 500)]
    );
    assert_eq!(
        summary(&poll_all(&w, y, sy.cq)),
        vec![(1, WcStatus::Success, 540)]
    );
    assert_eq!(my.read(40, 500), first);
    // Y -> X once, so that ua's receive ring has moved on before the sleep.
    assert_eq!(
        post_recv(&w, x, ua, vec![recv(19, mx.sge(2048, 1064))]),
        (1, IbStatus::Success)
    );
    let hello = pattern(6, 100);
    my.write(6000, &hello);
    assert_eq!(
        post_send(
            &w,
            y,
            ub,
            vec![ud_send(18, my.sge(6000, 100), qpn_ua)],
            Some(av_x)
        ),
        (1, IbStatus::Success)
    );
    assert_eq!(
        summary(&poll_all(&w, x, sx.cq)),
        vec![(19, WcStatus::Success, 140)]
    );
    assert_eq!(
        summary(&poll_all(&w, y, sy.cq)),
        vec![(18, WcStatus::Success, 100)]
    );
    assert_eq!(mx.read(2048 + 40, 100), hello);

    // Left posted across the sleep: SRQ WQE 2 (and 3 below) on Y, two
    // receives of ua on X, five receives of the connected a, and one
    // completion of b's not yet polled.
    assert_eq!(
        post_srq(&w, y, srq, vec![recv(3, my.sge(4096, 1064))]),
        (1, IbStatus::Success)
    );
    assert_eq!(
        post_recv(
            &w,
            x,
            ua,
            vec![recv(20, mx.sge(2048, 1064)), recv(21, mx.sge(4096, 1064))]
        ),
        (2, IbStatus::Success)
    );
    let a_recvs: Vec<_> = (0..5).map(|k| recv(500 + k, mx.sge(6144, 64))).collect();
    assert_eq!(post_recv(&w, x, a, a_recvs), (5, IbStatus::Success));
    assert_eq!(
        post_recv(&w, y, b, vec![recv(600, my.sge(7000, 64))]),
        (1, IbStatus::Success)
    );
    assert_eq!(
        post_send(&w, x, a, vec![send(700, mx.sge(0, 32), SendOp::Send)], None),
        (1, IbStatus::Success)
    );
    // The send and the receive it consumed complete; left unpolled on both
    // sides, they must survive the sleep in order.
    w.settle();
    // ua drained (SQD): two sends posted now wait, across the sleep, for
    // the return to RTS.
    assert_eq!(
        modify(&w, x, ua, &QpModify::to_state(QpState::Sqd)),
        IbStatus::Success
    );
    let fourth = pattern(8, 400);
    mx.write(7200, &fourth);
    let fifth = pattern(9, 100);
    mx.write(7700, &fifth);
    assert_eq!(
        post_send(
            &w,
            x,
            ua,
            vec![
                ud_send(14, mx.sge(7200, 400), qpn_ub),
                ud_send(15, mx.sge(7700, 100), qpn_ub)
            ],
            Some(av_y)
        ),
        (2, IbStatus::Success)
    );
    w.settle();

    w.sleep();
    // Below D0 the core refuses (the shell's queue would hold these).
    let r = w.call_in_dpc_at::<QueryQp>(x, KERNEL, ua, &Empty, 0);
    assert_eq!(response::<QueryQp>(&r).status, IbStatus::InvalidState);
    assert_eq!(
        post_send(
            &w,
            x,
            ua,
            vec![ud_send(11, mx.sge(0, 8), qpn_ub)],
            Some(av_y)
        ),
        (0, IbStatus::InvalidState)
    );
    w.resume();

    // The completions written before the sleep come back first, in order,
    // then the connected QP's flushed receives with their wr_ids.
    let at_x = poll_all(&w, x, sx.cq);
    let mut expected = vec![(700, WcStatus::Success)];
    expected.extend((500..505).map(|id| (id, WcStatus::WrFlushErr)));
    let got: Vec<_> = at_x.iter().map(|wc| (wc.wr_id, wc.status)).collect();
    assert_eq!(got, expected);
    assert!(at_x[1..].iter().all(|wc| wc.qp_num.get() == qpn_a));
    let at_y = poll_all(&w, y, sy.cq);
    assert_eq!(summary(&at_y), vec![(600, WcStatus::Success, 32)]);
    assert_eq!(my.read(7000, 32), mx.read(0, 32));

    // Connected QPs: ERR, each client told once, at DISPATCH_LEVEL; the
    // unconnected ones keep their state.
    assert_eq!(qp_state(&w, x, a), QpState::Err);
    assert_eq!(qp_state(&w, y, b), QpState::Err);
    assert_eq!(
        sx.client.events_of(AsyncEventCode::QpFatal),
        vec![(a, Irql::DISPATCH)]
    );
    assert_eq!(
        sy.client.events_of(AsyncEventCode::QpFatal),
        vec![(b, Irql::DISPATCH)]
    );
    assert_eq!(qp_state(&w, x, ua), QpState::Sqd);
    assert_eq!(qp_state(&w, y, ub), QpState::Rts);

    // The MR: same keys, and the device's entry says so.
    assert_eq!((mx.region.lkey(), mx.region.rkey()), keys_before);
    let mpt_after = mx.query(&w);
    assert!(mpt_after.valid);
    assert_eq!(mpt_after.key, mpt_before.key);
    assert_eq!(mpt_after.start, mpt_before.start);

    // UD again. Back to RTS, ua sends the two WRs posted before the sleep
    // (14, 15) into the SRQ WQEs posted before the sleep (2, 3); then two
    // more into new ones (4, 5); Y -> X lands in ua's receive posted
    // before the sleep (20).
    assert_eq!(
        modify(&w, x, ua, &QpModify::to_state(QpState::Rts)),
        IbStatus::Success
    );
    assert_eq!(
        post_srq(
            &w,
            y,
            srq,
            vec![recv(4, my.sge(0, 1064)), recv(5, my.sge(5200, 800))]
        ),
        (2, IbStatus::Success)
    );
    let second = pattern(2, 700);
    mx.write(0, &second);
    let third = pattern(3, 300);
    mx.write(1024, &third);
    assert_eq!(
        post_send(
            &w,
            x,
            ua,
            vec![
                ud_send(12, mx.sge(0, 700), qpn_ub),
                ud_send(13, mx.sge(1024, 300), qpn_ub)
            ],
            Some(av_y)
        ),
        (2, IbStatus::Success)
    );
    let back = pattern(4, 200);
    my.write(6000, &back);
    assert_eq!(
        post_send(
            &w,
            y,
            ub,
            vec![ud_send(30, my.sge(6000, 200), qpn_ua)],
            Some(av_x)
        ),
        (1, IbStatus::Success)
    );
    let mut at_x = poll_all(&w, x, sx.cq);
    at_x.sort_by_key(|wc| wc.wr_id);
    assert_eq!(
        summary(&at_x),
        vec![
            (12, WcStatus::Success, 700),
            (13, WcStatus::Success, 300),
            (14, WcStatus::Success, 400),
            (15, WcStatus::Success, 100),
            (20, WcStatus::Success, 240)
        ]
    );
    assert_eq!(at_x[4].src_qp.get(), qpn_ub);
    assert_eq!(mx.read(2048 + 40, 200), back);
    let mut at_y = poll_all(&w, y, sy.cq);
    at_y.sort_by_key(|wc| wc.wr_id);
    assert_eq!(
        summary(&at_y),
        vec![
            (2, WcStatus::Success, 440),
            (3, WcStatus::Success, 140),
            (4, WcStatus::Success, 740),
            (5, WcStatus::Success, 340),
            (30, WcStatus::Success, 200)
        ]
    );
    assert!(at_y[..4].iter().all(|wc| wc.src_qp.get() == qpn_ua));
    assert_eq!(my.read(2048 + 40, 400), fourth);
    assert_eq!(my.read(4096 + 40, 100), fifth);
    assert_eq!(my.read(40, 700), second);
    assert_eq!(my.read(5200 + 40, 300), third);

    // Re-connecting the RC pair works, and Y writes into X's region with
    // the R_Key X had before the sleep; X reads it back.
    for (i, qp) in [(x, a), (y, b)] {
        let r = w.call_in_dpc_at::<ModifyQp>(i, KERNEL, qp, &QpModify::to_state(QpState::Reset), 0);
        assert_eq!(response::<ModifyQp>(&r).status, IbStatus::Success);
    }
    // Reset after a connection: RTR waits out TIME WAIT (guide 6.5.2).
    w.host
        .scheduler()
        .advance(hca_miniport_core::verbs::qp::QPN_QUIET_PERIOD_NS)
        .unwrap();
    connect(&w, x, a, qpn_b, HCA_IPS[1][0]);
    connect(&w, y, b, qpn_a, HCA_IPS[0][0]);
    let written = pattern(5, 900);
    my.write(0, &written);
    let write = SendOp::RdmaWrite {
        remote: RemoteAddr {
            addr: mx.addr(3000),
            rkey: keys_before.1,
        },
    };
    assert_eq!(
        post_send(&w, y, b, vec![send(800, my.sge(0, 900), write)], None),
        (1, IbStatus::Success)
    );
    assert_eq!(
        summary(&poll_all(&w, y, sy.cq)),
        vec![(800, WcStatus::Success, 900)]
    );
    assert_eq!(mx.read(3000, 900), written);
    let read = SendOp::RdmaRead {
        remote: RemoteAddr {
            addr: my.addr(0),
            rkey: my.region.rkey(),
        },
    };
    assert_eq!(
        post_send(&w, x, a, vec![send(801, mx.sge(5000, 900), read)], None),
        (1, IbStatus::Success)
    );
    assert_eq!(
        summary(&poll_all(&w, x, sx.cq)),
        vec![(801, WcStatus::Success, 900)]
    );
    assert_eq!(mx.read(5000, 900), written);

    // More cycles with everything idle: still working, nothing leaks. X's
    // CQ, armed while empty before each sleep, is armed again after it:
    // the first completion raises exactly one event.
    // The DMA memory held stays the same from cycle to cycle (tables, EQ
    // and command queue freed and allocated again, objects kept), and the
    // device never touched memory outside a live mapping.
    let held = |i: usize| w.adapter_at(i).leaks().len();
    let held_before = (held(x), held(y));
    for round in 0..3u8 {
        arm(&w, x, sx.cq);
        let completions_before = lock(&sx.client.completions).len();
        w.sleep();
        w.resume();
        assert_eq!(lock(&sx.client.completions).len(), completions_before);
        assert_eq!(qp_state(&w, x, ua), QpState::Rts);
        assert_eq!(
            post_srq(
                &w,
                y,
                srq,
                vec![recv(40 + u64::from(round), my.sge(0, 1064))]
            ),
            (1, IbStatus::Success)
        );
        let bytes = pattern(10 + round, 100);
        mx.write(0, &bytes);
        assert_eq!(
            post_send(
                &w,
                x,
                ua,
                vec![ud_send(50, mx.sge(0, 100), qpn_ub)],
                Some(av_y)
            ),
            (1, IbStatus::Success)
        );
        assert_eq!(
            summary(&poll_all(&w, x, sx.cq)),
            vec![(50, WcStatus::Success, 100)]
        );
        let completions = lock(&sx.client.completions)[completions_before..].to_vec();
        assert_eq!(completions, vec![(sx.cq, Irql::DISPATCH)]);
        assert_eq!(
            summary(&poll_all(&w, y, sy.cq)),
            vec![(40 + u64::from(round), WcStatus::Success, 140)]
        );
        assert_eq!(my.read(40, 100), bytes);
        assert_eq!((held(x), held(y)), held_before);
    }
    assert_eq!((w.adapter_at(x).faults(), w.adapter_at(y).faults()), (0, 0));

    // Teardown through the same handles.
    for (i, qp) in [(x, a), (x, ua), (y, b), (y, ub)] {
        let r = w.call_in_dpc_at::<DestroyQp>(i, KERNEL, qp, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    }
    let _ = poll_all(&w, x, sx.cq);
    let _ = poll_all(&w, y, sy.cq);
    let r = w.call_in_dpc_at::<DestroySrq>(y, KERNEL, srq, &Empty, 0);
    assert_eq!(response::<DestroySrq>(&r).status, IbStatus::Success);
    mx.free(&w);
    my.free(&w);
    for s in [&sx, &sy] {
        let r = w.call_in_dpc_at::<DestroyCq>(s.i, KERNEL, s.cq, &Empty, 0);
        assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
        let r = w.call_in_dpc_at::<DeallocPd>(s.i, KERNEL, s.pd, &Empty, 0);
        assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
        assert_eq!(w.hca_at(s.i).close_ca(s.ca), Ok(()));
    }
    w.finish();
}

#[test]
fn released_while_asleep_frees_every_object_of_the_core() {
    // The device is removed while the system sleeps: release-hardware
    // comes without a D0 entry. Objects still held by a client at that
    // point are the core's to free (its rings, contexts' memory); the
    // client's own registrations go with release_after_reset.
    let (w, [x, y]) = two_hcas(73, hca_miniport_core::init::HcaConfig::default());
    let (sx, sy) = (side(&w, x), side(&w, y));
    let srq = create_srq(&w, &sx, 8, 2);
    let (ua, _) = create_qp(&w, &sx, QpType::Ud, None);
    ud_to_rts(&w, x, ua, QKEY);
    let (_on_srq, _) = create_qp(&w, &sx, QpType::Rc, Some(srq));
    let (a, qpn_a) = create_qp(&w, &sx, QpType::Rc, None);
    let (b, qpn_b) = create_qp(&w, &sy, QpType::Rc, None);
    connect(&w, x, a, qpn_b, HCA_IPS[1][0]);
    connect(&w, y, b, qpn_a, HCA_IPS[0][0]);
    let mx = Mem::new(&w, x, sx.pd);
    assert_eq!(
        post_recv(&w, x, a, vec![recv(1, mx.sge(0, 64))]),
        (1, IbStatus::Success)
    );
    w.sleep();
    // Below D0 a deregistration cannot reach the device; the client
    // releases its region's host resources instead.
    let mt = w.hca_at(x).memory_translation().unwrap();
    mt.release_after_reset(&w.hca_at(x), mx.region);
    w.adapter_at(x).free_common(mx.buffer);
    let _ = (sy, ua);
    w.finish();
}

#[test]
fn requests_in_flight_at_d0_exit_are_answered_and_leak_nothing() {
    use ib_types::cq::CqAttr;
    use ib_types::ioctl::{CreateCq, CreateQp};
    for seed in 400..406 {
        let (w, [x, _]) = two_hcas(seed, hca_miniport_core::init::HcaConfig::default());
        let sx = side(&w, x);
        let (ua, _) = create_qp(&w, &sx, QpType::Ud, None);
        let attr = CqAttr {
            cqe: 8,
            comp_vector: 0,
        };
        let (create_cq, cq_issuer) = w.request::<CreateCq>(KERNEL, sx.ca, &attr, 0);
        let qp_input = ib_types::qp::QpCreate {
            qp_type: QpType::Ud,
            pd: ib_types::handle::PdHandle::from_raw(sx.pd),
            send_cq: ib_types::handle::CqHandle::from_raw(sx.cq),
            recv_cq: ib_types::handle::CqHandle::from_raw(sx.cq),
            srq: None,
            caps: ib_types::qp::QpCaps {
                max_send_wr: 4,
                max_recv_wr: 4,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
            port: None,
        };
        let (create_qp_req, qp_issuer) = w.request::<CreateQp>(KERNEL, sx.ca, &qp_input, 0);
        let init = QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: ib_types::scalars::PortNum::new(1).ok(),
            qkey: Some(QKey::new(QKEY)),
            ..QpModify::default()
        };
        let (modify_req, modify_issuer) = w.request::<ModifyQp>(KERNEL, ua, &init, 0);
        {
            let hca = w.hca_at(x);
            w.in_dpc(move || {
                hca.submit_request(create_cq);
                hca.submit_request(create_qp_req);
                hca.submit_request(modify_req);
            });
        }
        // No settle: the power transition and the verbs interleave as the
        // seed decides.
        w.sleep();
        w.resume();
        let done = cq_issuer.completion().expect("CreateCq answered");
        let cq = response::<CreateCq>(&done);
        let done = qp_issuer.completion().expect("CreateQp answered");
        let qp = response::<CreateQp>(&done);
        let done = modify_issuer.completion().expect("ModifyQp answered");
        let modified = response::<ModifyQp>(&done).status;
        // The cache says what the device was told: INIT exactly when the
        // modify succeeded.
        let expected = if modified == IbStatus::Success {
            QpState::Init
        } else {
            QpState::Reset
        };
        assert_eq!(qp_state(&w, x, ua), expected, "seed {seed}");
        for (status, handle) in [(cq.status, cq.handle), (qp.status, qp.handle)] {
            assert!(
                matches!(status, IbStatus::Success | IbStatus::InvalidState),
                "seed {seed}: {status:?}"
            );
            assert_eq!(handle != 0, status == IbStatus::Success);
        }
        // What was created works after the resume and is destroyed.
        if qp.status == IbStatus::Success {
            let r = w.call_in_dpc_at::<DestroyQp>(x, KERNEL, qp.handle, &Empty, 0);
            assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
        }
        if cq.status == IbStatus::Success {
            assert!(poll_all(&w, x, cq.handle).is_empty());
            let r = w.call_in_dpc_at::<DestroyCq>(x, KERNEL, cq.handle, &Empty, 0);
            assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
        }
        let r = w.call_in_dpc_at::<DestroyQp>(x, KERNEL, ua, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
        let _ = poll_all(&w, x, sx.cq);
        let r = w.call_in_dpc_at::<DestroyCq>(x, KERNEL, sx.cq, &Empty, 0);
        assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
        let r = w.call_in_dpc_at::<DeallocPd>(x, KERNEL, sx.pd, &Empty, 0);
        assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
        w.finish();
    }
}

#[test]
fn an_rc_qp_not_yet_connected_keeps_its_state_and_receives() {
    use ib_types::access::AccessFlags;
    use ib_types::scalars::{Mtu, PortNum, Psn};
    let (w, [x, y]) = two_hcas(75, hca_miniport_core::init::HcaConfig::default());
    let (sx, sy) = (side(&w, x), side(&w, y));
    let (mx, my) = (Mem::new(&w, x, sx.pd), Mem::new(&w, y, sy.pd));
    let (c, qpn_c) = create_qp(&w, &sx, QpType::Rc, None);
    let (d, qpn_d) = create_qp(&w, &sy, QpType::Rc, None);
    let init = QpModify {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: PortNum::new(1).ok(),
        access: Some(AccessFlags::REMOTE_WRITE),
        ..QpModify::default()
    };
    assert_eq!(modify(&w, x, c, &init), IbStatus::Success);
    assert_eq!(
        post_recv(
            &w,
            x,
            c,
            vec![recv(70, mx.sge(0, 256)), recv(71, mx.sge(256, 256))]
        ),
        (2, IbStatus::Success)
    );
    w.sleep();
    w.resume();
    assert_eq!(qp_state(&w, x, c), QpState::Init);
    assert!(sx.client.events_of(AsyncEventCode::QpFatal).is_empty());
    // Connected only now: INIT -> RTR -> RTS on X, the whole way on Y.
    let rtr = QpModify {
        state: Some(QpState::Rtr),
        av: Some(av_to(HCA_IPS[1][0])),
        path_mtu: Some(Mtu::Mtu1024),
        dest_qpn: Some(Qpn::new(qpn_d).unwrap()),
        rq_psn: Some(Psn::new(100).unwrap()),
        max_dest_rd_atomic: Some(1),
        min_rnr_timer: Some(12),
        ..QpModify::default()
    };
    assert_eq!(modify(&w, x, c, &rtr), IbStatus::Success);
    let rts = QpModify {
        state: Some(QpState::Rts),
        sq_psn: Some(Psn::new(100).unwrap()),
        timeout: Some(14),
        retry_cnt: Some(7),
        rnr_retry: Some(7),
        max_rd_atomic: Some(1),
        ..QpModify::default()
    };
    assert_eq!(modify(&w, x, c, &rts), IbStatus::Success);
    connect(&w, y, d, qpn_c, HCA_IPS[0][0]);
    let bytes = pattern(21, 200);
    my.write(0, &bytes);
    assert_eq!(
        post_send(&w, y, d, vec![send(72, my.sge(0, 200), SendOp::Send)], None),
        (1, IbStatus::Success)
    );
    assert_eq!(
        summary(&poll_all(&w, x, sx.cq)),
        vec![(70, WcStatus::Success, 200)]
    );
    assert_eq!(mx.read(0, 200), bytes);
    assert_eq!(
        summary(&poll_all(&w, y, sy.cq))
            .into_iter()
            .map(|(id, st, _)| (id, st))
            .collect::<Vec<_>>(),
        vec![(72, WcStatus::Success)]
    );
    for (i, qp) in [(x, c), (y, d)] {
        let r = w.call_in_dpc_at::<DestroyQp>(i, KERNEL, qp, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    }
    // The flushed receive 71 of c.
    assert_eq!(
        summary(&poll_all(&w, x, sx.cq)),
        vec![(71, WcStatus::WrFlushErr, 0)]
    );
    let _ = poll_all(&w, y, sy.cq);
    mx.free(&w);
    my.free(&w);
    for s in [&sx, &sy] {
        let r = w.call_in_dpc_at::<DestroyCq>(s.i, KERNEL, s.cq, &Empty, 0);
        assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    }
    w.finish();
}

/// One step of the sleep-under-traffic property.
#[derive(Debug, Clone)]
enum Step {
    /// Post this many receives on X's UD QP (as far as there is room).
    RecvX(usize),
    /// Send this many datagrams from Y to X (as far as X has receives).
    SendYtoX(usize),
    /// System sleep and resume.
    Sleep,
    /// Poll X's CQ.
    PollX,
    /// Poll Y's CQ.
    PollY,
}

fn step_strategy() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        (1..4usize).prop_map(Step::RecvX),
        (1..4usize).prop_map(Step::SendYtoX),
        Just(Step::Sleep),
        Just(Step::PollX),
        Just(Step::PollY),
    ]
}

/// Bytes of datagram `n`.
fn datagram_len(n: u64) -> usize {
    100 + (n as usize * 37) % 700
}

/// Runs `steps` on a UD pair with sleeps anywhere: every WR completes
/// exactly once, in posting order, with its wr_id and bytes; receives
/// left at the end flush with theirs.
fn ud_traffic_across_sleeps(seed: u64, steps: &[Step]) {
    const DEPTH: usize = 8;
    let (w, [x, y]) = two_hcas(seed, hca_miniport_core::init::HcaConfig::default());
    let (sx, sy) = (side(&w, x), side(&w, y));
    let (mx, my) = (Mem::new(&w, x, sx.pd), Mem::new(&w, y, sy.pd));
    let (ua, qpn_ua) = create_qp(&w, &sx, QpType::Ud, None);
    let (ub, _) = create_qp(&w, &sy, QpType::Ud, None);
    ud_to_rts(&w, x, ua, QKEY);
    ud_to_rts(&w, y, ub, QKEY);
    let av_x = hca_prm::av::Av::try_from(&av_to(HCA_IPS[0][0])).unwrap();
    // The model: receives posted and not yet polled (wr_id, matched send),
    // sends posted and not yet polled.
    let mut recvs: std::collections::VecDeque<(u64, Option<u64>)> = Default::default();
    let mut sends: std::collections::VecDeque<u64> = Default::default();
    let (mut next_recv, mut next_send) = (0u64, 0u64);
    let check_x = |wcs: &[ib_types::wc::WorkCompletion],
                   recvs: &mut std::collections::VecDeque<(u64, Option<u64>)>| {
        for wc in wcs {
            let (wr_id, matched) = recvs
                .pop_front()
                .expect("a completion for a posted receive");
            let sent = matched.expect("only matched receives complete");
            assert_eq!(
                (wc.wr_id, wc.status, wc.byte_len as usize),
                (wr_id, WcStatus::Success, 40 + datagram_len(sent)),
                "seed {seed}"
            );
            let slot = (wr_id as usize % DEPTH) * 1024;
            assert_eq!(
                mx.read(slot + 40, datagram_len(sent)),
                pattern(sent as u8, datagram_len(sent)),
                "seed {seed}: receive {wr_id} got send {sent}"
            );
        }
    };
    for step in steps {
        match *step {
            Step::RecvX(n) => {
                let n = n.min(DEPTH - recvs.len());
                let wrs: Vec<_> = (0..n as u64)
                    .map(|k| {
                        let id = next_recv + k;
                        recv(id, mx.sge((id as usize % DEPTH) * 1024, 1024))
                    })
                    .collect();
                assert_eq!(post_recv(&w, x, ua, wrs), (n, IbStatus::Success));
                for _ in 0..n {
                    recvs.push_back((next_recv, None));
                    next_recv += 1;
                }
            }
            Step::SendYtoX(n) => {
                let free = recvs.iter().filter(|(_, m)| m.is_none()).count();
                let n = n.min(free).min(DEPTH - sends.len());
                let mut wrs = Vec::new();
                for _ in 0..n {
                    let id = next_send;
                    next_send += 1;
                    let at = (id as usize % DEPTH) * 1024;
                    my.write(at, &pattern(id as u8, datagram_len(id)));
                    wrs.push(ud_send(id, my.sge(at, datagram_len(id) as u32), qpn_ua));
                    sends.push_back(id);
                    if let Some(slot) = recvs.iter_mut().find(|(_, m)| m.is_none()) {
                        slot.1 = Some(id);
                    }
                }
                assert_eq!(
                    post_send(&w, y, ub, wrs, Some(av_x)),
                    (n, IbStatus::Success)
                );
            }
            Step::Sleep => {
                w.sleep();
                w.resume();
                assert_eq!(qp_state(&w, x, ua), QpState::Rts);
            }
            Step::PollX => {
                let wcs = poll_all(&w, x, sx.cq);
                check_x(&wcs, &mut recvs);
                // Everything matched has arrived by now (the fabric is
                // lossless and the machine settled).
                assert!(recvs.iter().all(|(_, m)| m.is_none()), "seed {seed}");
            }
            Step::PollY => {
                for wc in poll_all(&w, y, sy.cq) {
                    let id = sends.pop_front().expect("a completion for a posted send");
                    assert_eq!((wc.wr_id, wc.status), (id, WcStatus::Success));
                }
                assert!(sends.is_empty());
            }
        }
    }
    check_x(&poll_all(&w, x, sx.cq), &mut recvs);
    assert!(recvs.iter().all(|(_, m)| m.is_none()), "seed {seed}");
    for wc in poll_all(&w, y, sy.cq) {
        assert_eq!(wc.wr_id, sends.pop_front().unwrap());
    }
    let r = w.call_in_dpc_at::<DestroyQp>(x, KERNEL, ua, &Empty, 0);
    assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    let flushed: Vec<u64> = poll_all(&w, x, sx.cq)
        .iter()
        .map(|wc| {
            assert_eq!(wc.status, WcStatus::WrFlushErr);
            wc.wr_id
        })
        .collect();
    assert_eq!(flushed, recvs.iter().map(|(id, _)| *id).collect::<Vec<_>>());
    let r = w.call_in_dpc_at::<DestroyQp>(y, KERNEL, ub, &Empty, 0);
    assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    let _ = poll_all(&w, y, sy.cq);
    mx.free(&w);
    my.free(&w);
    w.finish();
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(12))]

    #[test]
    fn every_wr_completes_once_in_order_with_sleeps_anywhere(
        seed in 0..u64::MAX,
        steps in proptest::collection::vec(step_strategy(), 1..30),
    ) {
        ud_traffic_across_sleeps(seed, &steps);
    }
}

#[test]
fn windows_keep_their_key_and_multicast_memberships_come_back() {
    use ib_types::access::AccessFlags;
    use ib_types::handle::MwHandle;
    use ib_types::ioctl::{AllocMw, AttachMcast, DeallocMw, QueryMw};
    use ib_types::mcast::McastGroup;
    use ib_types::mr::{MwAttr, MwType};
    use ib_types::scalars::{Gid, Lid};
    use ib_types::wr::{MwBind, RKey};
    let (w, [x, y]) = two_hcas(77, hca_miniport_core::init::HcaConfig::default());
    let (sx, sy) = (side(&w, x), side(&w, y));
    let mx = Mem::new(&w, x, sx.pd);
    let rights = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::MW_BIND;
    let my = Mem::with_access(&w, y, sy.pd, rights);
    let (a, qpn_a) = create_qp(&w, &sx, QpType::Rc, None);
    let (b, qpn_b) = create_qp(&w, &sy, QpType::Rc, None);
    connect(&w, x, a, qpn_b, HCA_IPS[1][0]);
    connect(&w, y, b, qpn_a, HCA_IPS[0][0]);

    // A type 1 window on Y, bound over my[4096..8192].
    let input = MwAttr {
        mw_type: MwType::Type1,
        rkey: RKey::new(0),
    };
    let r = w.call_in_dpc_at::<AllocMw>(y, KERNEL, sy.pd, &input, 0);
    let resp = response::<AllocMw>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let mw = resp.handle;
    let bind = |key: RKey| SendOp::BindMw {
        mw: MwHandle::from_raw(mw),
        rkey: key,
        bind: MwBind {
            mr_lkey: my.region.lkey(),
            addr: my.addr(4096),
            length: 4096,
            access: AccessFlags::REMOTE_WRITE,
        },
    };
    let key1 = w.hca_at(y).next_mw_rkey(mw).unwrap();
    assert_eq!(
        post_send(&w, y, b, vec![send(1, &[], bind(key1))], None),
        (1, IbStatus::Success)
    );
    assert_eq!(
        summary(&poll_all(&w, y, sy.cq))
            .into_iter()
            .map(|(id, st, _)| (id, st))
            .collect::<Vec<_>>(),
        vec![(1, WcStatus::Success)]
    );
    let query = |w: &World| {
        let r = w.call_in_dpc_at::<QueryMw>(y, KERNEL, mw, &Empty, 0);
        let resp = response::<QueryMw>(&r);
        assert_eq!(resp.status, IbStatus::Success);
        resp.output.unwrap().attr.rkey
    };
    assert_eq!(query(&w), key1);

    // A UD QP on Y in a multicast group.
    let (member, _) = create_qp(&w, &sy, QpType::Ud, None);
    ud_to_rts(&w, y, member, QKEY);
    let group = McastGroup {
        mgid: Gid::from_ipv4([239, 1, 2, 3]),
        mlid: Lid::UNASSIGNED,
    };
    let r = w.call_in_dpc_at::<AttachMcast>(y, KERNEL, member, &group, 0);
    assert_eq!(response::<AttachMcast>(&r).status, IbStatus::Success);
    let (sender, _) = create_qp(&w, &sx, QpType::Ud, None);
    ud_to_rts(&w, x, sender, QKEY);

    w.sleep();
    w.resume();

    // The window: same key, as the device says; its binding is gone (a
    // write through the key is refused), and a new bind over it works.
    assert_eq!(query(&w), key1);
    let reconnect = |w: &World| {
        for (i, qp) in [(x, a), (y, b)] {
            assert_eq!(
                modify(w, i, qp, &QpModify::to_state(QpState::Reset)),
                IbStatus::Success
            );
        }
        let _ = poll_all(w, x, sx.cq);
        let _ = poll_all(w, y, sy.cq);
        // Reset after a connection: RTR waits out TIME WAIT (guide 6.5.2).
        w.host
            .scheduler()
            .advance(hca_miniport_core::verbs::qp::QPN_QUIET_PERIOD_NS)
            .unwrap();
        connect(w, x, a, qpn_b, HCA_IPS[1][0]);
        connect(w, y, b, qpn_a, HCA_IPS[0][0]);
    };
    reconnect(&w);
    let via_old = SendOp::RdmaWrite {
        remote: RemoteAddr {
            addr: my.addr(4096),
            rkey: key1,
        },
    };
    assert_eq!(
        post_send(&w, x, a, vec![send(4, mx.sge(0, 16), via_old)], None),
        (1, IbStatus::Success)
    );
    assert_eq!(poll_all(&w, x, sx.cq)[0].status, WcStatus::RemAccessErr);
    reconnect(&w);
    let key2 = w.hca_at(y).next_mw_rkey(mw).unwrap();
    assert_ne!(key2, key1);
    assert_eq!(
        post_send(&w, y, b, vec![send(2, &[], bind(key2))], None),
        (1, IbStatus::Success)
    );
    assert_eq!(poll_all(&w, y, sy.cq)[0].status, WcStatus::Success);
    let through = pattern(31, 600);
    mx.write(0, &through);
    let write = SendOp::RdmaWrite {
        remote: RemoteAddr {
            addr: my.addr(4096 + 100),
            rkey: key2,
        },
    };
    assert_eq!(
        post_send(&w, x, a, vec![send(3, mx.sge(0, 600), write)], None),
        (1, IbStatus::Success)
    );
    assert_eq!(
        summary(&poll_all(&w, x, sx.cq)),
        vec![(3, WcStatus::Success, 600)]
    );
    assert_eq!(my.read(4096 + 100, 600), through);

    // The membership: a datagram to the group reaches the member.
    assert_eq!(
        post_recv(&w, y, member, vec![recv(50, my.sge(0, 1064))]),
        (1, IbStatus::Success)
    );
    let datagram = pattern(32, 300);
    mx.write(1024, &datagram);
    let to_group = hca_prm::av::Av::try_from(&av_to([239, 1, 2, 3])).unwrap();
    assert_eq!(
        post_send(
            &w,
            x,
            sender,
            vec![ud_send(51, mx.sge(1024, 300), 0xFF_FFFF)],
            Some(to_group)
        ),
        (1, IbStatus::Success)
    );
    assert_eq!(
        summary(&poll_all(&w, x, sx.cq)),
        vec![(51, WcStatus::Success, 300)]
    );
    assert_eq!(
        summary(&poll_all(&w, y, sy.cq)),
        vec![(50, WcStatus::Success, 340)]
    );
    assert_eq!(my.read(40, 300), datagram);

    let r = w.call_in_dpc_at::<DeallocMw>(y, KERNEL, mw, &Empty, 0);
    assert_eq!(response::<DeallocMw>(&r).status, IbStatus::Success);
    for (i, qp) in [(x, a), (x, sender), (y, b), (y, member)] {
        let r = w.call_in_dpc_at::<DestroyQp>(i, KERNEL, qp, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    }
    let _ = poll_all(&w, x, sx.cq);
    let _ = poll_all(&w, y, sy.cq);
    mx.free(&w);
    my.free(&w);
    w.finish();
}
