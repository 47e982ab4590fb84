//! Contracts that earlier tests exercised without checking their effect
//! (issue 9, defect 11): close waits for a callback that is really in
//! flight; a link flap on the fabric reaches the CI client's async callback
//! as PortDown then PortActive; RESET_QKEY_COUNTER really resets the count
//! of Q_Key violations; a full receive queue refuses one more WR, posts
//! nothing of it, and takes WRs again once completions free its slots.
//! Each test ends with the host shut down and the verifier clean.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use driver_platform::RequestorMode;
use hca_miniport_core::verbs::CaClient;
use hca_miniport_core::verbs::qp::SendRequest;
use ib_types::access::AccessFlags;
use ib_types::ca::{CaAttrView, CaModify, CaModifyFlags};
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::handle::{AvHandle, CqHandle, PdHandle};
use ib_types::ioctl::{CreateQp, DestroyQp, Empty, ModifyCa, ModifyQp, QueryCa};
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{PortNum, Psn, QKey, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::WcStatus;
use ib_types::wr::{RecvWr, SendFlags, SendOp, SendWr, UdDest};
use support::kernel_pair::{KernelBuf, Setup, poll_all, setup, teardown};
use support::rc_path::{grh_av, rc_to_rts_steps};
use support::{World, lock, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;

const HCA_IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];
const GUIDS: [u64; 2] = [0x0002_C900_0000_6000, 0x0002_C900_0000_7000];

/// A CI client recording async events; its async callback can be held
/// (spinning, as a slow DISPATCH_LEVEL callback would) until released.
#[derive(Default)]
struct Client {
    events: Mutex<Vec<AsyncEventRecord>>,
    hold: AtomicBool,
    entered: AtomicBool,
    release: AtomicBool,
    /// Ticks of `clock` when a held callback returned.
    returned_at: AtomicU32,
    clock: Arc<AtomicU32>,
}

impl CaClient for Client {
    fn completion(&self, _: CqHandle) {}
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.events).push(*event);
        if self.hold.load(Ordering::Acquire) {
            self.entered.store(true, Ordering::Release);
            while !self.release.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            let tick = self.clock.fetch_add(1, Ordering::AcqRel) + 1;
            self.returned_at.store(tick, Ordering::Release);
        }
    }
}

fn port_events(client: &Client) -> Vec<(AsyncEventCode, Option<u8>)> {
    lock(&client.events)
        .iter()
        .map(|e| (e.code, e.port.map(PortNum::get)))
        .collect()
}

#[track_caller]
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn close_ca_returns_only_after_the_callback_in_flight_returned() {
    let w = World::threaded_with_hcas(
        2,
        vec![support::two_port_hca()],
        hca_miniport_core::init::HcaConfig::default(),
    );
    let ci = w.device_at(0).provider().expect("the CI provider");
    let clock = Arc::new(AtomicU32::new(0));
    let client = Arc::new(Client {
        hold: AtomicBool::new(true),
        clock: clock.clone(),
        ..Client::default()
    });
    let ca = ci.open_ca(client.clone()).unwrap();

    // The link of port 1 drops: the PortDown callback runs on a DPC worker
    // and is held there.
    w.function().with_device(|d| d.set_link(1, false));
    wait_until("the callback", || client.entered.load(Ordering::Acquire));

    // Close from another thread (PASSIVE_LEVEL) while it is held.
    let closer = {
        let (ci, clock) = (ci.clone(), clock.clone());
        std::thread::spawn(move || {
            let result = ci.close_ca(ca);
            (result, clock.fetch_add(1, Ordering::AcqRel) + 1)
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let closed_early = closer.is_finished();
    // Released before asserting, so a failure does not leave a DPC worker
    // spinning (the host's shutdown waits for its workers).
    client.release.store(true, Ordering::Release);
    assert!(
        !closed_early,
        "close returned while a callback was in flight"
    );
    let (result, closed_at) = closer.join().unwrap();
    assert_eq!(result, Ok(()));
    let returned_at = client.returned_at.load(Ordering::Acquire);
    assert!(
        returned_at != 0 && returned_at < closed_at,
        "the callback returned (tick {returned_at}) before close did (tick {closed_at})"
    );
    assert_eq!(port_events(&client), [(AsyncEventCode::PortDown, Some(1))]);

    // None follows close: the link comes back, the device reports it (the
    // outer sink sees it), the closed client hears nothing.
    client.hold.store(false, Ordering::Release);
    w.function().with_device(|d| d.set_link(1, true));
    let sink = w.sink();
    wait_until("the port to come back", || {
        lock(&sink.port_changes).last() == Some(&(1, true))
    });
    w.host.scheduler().quiesce().unwrap();
    assert_eq!(port_events(&client).len(), 1, "no callback after close");
    w.finish();
}

#[test]
fn a_link_flap_on_the_fabric_reaches_the_ci_clients_async_callback() {
    let w = World::deterministic(91);
    let ci = w.device_at(0).provider().expect("the CI provider");
    let client = Arc::new(Client::default());
    let ca = ci.open_ca(client.clone()).unwrap();
    w.settle();
    let before = port_events(&client).len();

    // Port 2's link goes down on the fabric (frames to it are lost, the
    // device sees its port go down), then comes back.
    let flap = |up: bool| {
        w.host
            .backplane()
            .with_cluster(|c| {
                let node = c.nodes().next().unwrap();
                c.set_link(node, 2, up).unwrap();
            })
            .expect("a stepped host");
        w.settle();
    };
    flap(false);
    assert_eq!(
        port_events(&client)[before..],
        [(AsyncEventCode::PortDown, Some(2))]
    );
    flap(true);
    assert_eq!(
        port_events(&client)[before..],
        [
            (AsyncEventCode::PortDown, Some(2)),
            (AsyncEventCode::PortActive, Some(2))
        ]
    );
    assert!(
        lock(&client.events)[before..].iter().all(|e| e.handle == 0),
        "port events name no object"
    );
    assert_eq!(ci.close_ca(ca), Ok(()));
    w.finish();
}

/// Posts `wrs` with the core's `post_send` on HCA `i` from a DPC.
fn post_send(
    w: &World,
    i: usize,
    qp: u64,
    wrs: Vec<SendWr<'static>>,
    av: Option<hca_prm::av::Av>,
) -> (usize, IbStatus) {
    let hca = w.hca_at(i);
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    w.in_dpc(move || {
        let requests: Vec<SendRequest<'_>> = wrs
            .iter()
            .map(|wr| SendRequest {
                wr: *wr,
                av,
                inline: None,
            })
            .collect();
        *lock(&sink) = Some(hca.post_send(qp, &requests));
    });
    w.settle();
    lock(&out).take().unwrap()
}

fn post_recv(w: &World, i: usize, qp: u64, wrs: Vec<RecvWr<'static>>) -> (usize, IbStatus) {
    let hca = w.hca_at(i);
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    w.in_dpc(move || *lock(&sink) = Some(hca.post_recv(qp, &wrs)));
    w.settle();
    lock(&out).take().unwrap()
}

fn leak<T>(items: Vec<T>) -> &'static [T] {
    Box::leak(items.into_boxed_slice())
}

fn create_qp(w: &World, s: &Setup, qp_type: QpType, caps: QpCaps) -> (u64, u32, QpCaps) {
    let input = QpCreate {
        qp_type,
        pd: PdHandle::from_raw(s.pd),
        send_cq: CqHandle::from_raw(s.cq),
        recv_cq: CqHandle::from_raw(s.cq),
        srq: None,
        caps,
        sq_sig_all: false,
        port: None,
    };
    let r = w.call_in_dpc_at::<CreateQp>(s.i, KERNEL, s.ca, &input, 0);
    let resp = response::<CreateQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let out = resp.output.unwrap();
    (resp.handle, out.qpn.get(), out.caps)
}

fn modify(w: &World, i: usize, qp: u64, m: &QpModify) {
    let r = w.call_in_dpc_at::<ModifyQp>(i, KERNEL, qp, m, 0);
    assert_eq!(response::<ModifyQp>(&r).status, IbStatus::Success, "{m:?}");
}

fn destroy_qp(w: &World, i: usize, qp: u64) {
    let r = w.call_in_dpc_at::<DestroyQp>(i, KERNEL, qp, &Empty, 0);
    assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
}

const SMALL: QpCaps = QpCaps {
    max_send_wr: 8,
    max_recv_wr: 8,
    max_send_sge: 1,
    max_recv_sge: 1,
    max_inline_data: 0,
};

#[test]
fn reset_qkey_counter_really_resets_the_count_of_qkey_violations() {
    let (w, [x, y]) = support::kernel_pair::two_two_port_hcas(92, GUIDS, &HCA_IPS);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let (ua, _, _) = create_qp(&w, &sx, QpType::Ud, SMALL);
    let (ub, qpn_ub, _) = create_qp(&w, &sy, QpType::Ud, SMALL);
    for (i, qp) in [(x, ua), (y, ub)] {
        let init = QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(PortNum::new(1).unwrap()),
            qkey: Some(QKey::new(0x1111)),
            ..QpModify::default()
        };
        modify(&w, i, qp, &init);
        modify(&w, i, qp, &QpModify::to_state(QpState::Rtr));
        let rts = QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(5).unwrap()),
            ..QpModify::default()
        };
        modify(&w, i, qp, &rts);
    }
    let mx = KernelBuf::register(&w, &sx, *b"QkS ", 4096, AccessFlags::LOCAL_WRITE);
    let my = KernelBuf::register(&w, &sy, *b"QkR ", 4096, AccessFlags::LOCAL_WRITE);
    let rq = leak(vec![my.sge(0, 40 + 64)]);
    let recvs = (0..4)
        .map(|k| RecvWr {
            wr_id: 100 + k,
            sg_list: rq,
        })
        .collect();
    assert_eq!(post_recv(&w, y, ub, recvs), (4, IbStatus::Success));

    let ca_y = sy.ca;
    let qkey_violations = |port: u8| {
        let r = w.call_in_dpc_at::<QueryCa>(y, KERNEL, ca_y, &Empty, 16);
        let needed = response::<QueryCa>(&r).output.unwrap().total_size;
        let r = w.call_in_dpc_at::<QueryCa>(y, KERNEL, ca_y, &Empty, needed);
        let view = CaAttrView::parse(response::<QueryCa>(&r).private).unwrap();
        view.port(PortNum::new(port).unwrap())
            .unwrap()
            .attr()
            .qkey_violations
    };
    let modify_ca = |flags: CaModifyFlags| {
        let m = CaModify::new(PortNum::FIRST, flags, CaModifyFlags::empty()).unwrap();
        let r = w.call_in_dpc_at::<ModifyCa>(y, KERNEL, ca_y, &m, 0);
        assert_eq!(response::<ModifyCa>(&r).status, IbStatus::Success);
    };
    assert_eq!(qkey_violations(1), 0);

    // Three datagrams under the wrong Q_Key: each dropped and counted.
    let av = hca_prm::av::Av::try_from(&grh_av(1, HCA_IPS[1][0])).unwrap();
    let send = |wr_id: u64, qkey: u32| SendWr {
        wr_id,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: leak(vec![mx.sge(0, 64)]),
        ud: Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(qpn_ub).unwrap(),
            remote_qkey: QKey::new(qkey),
        }),
    };
    let bad = (1..=3).map(|k| send(k, 0x2222)).collect();
    assert_eq!(post_send(&w, x, ua, bad, Some(av)), (3, IbStatus::Success));
    assert_eq!(poll_all(&w, x, sx.cq).len(), 3);
    assert!(poll_all(&w, y, sy.cq).is_empty(), "nothing delivered");
    assert_eq!(qkey_violations(1), 3);
    assert_eq!(qkey_violations(2), 0);

    // A modify without the reset flag leaves the count; the P_Key reset
    // leaves it too; RESET_QKEY_COUNTER clears it.
    modify_ca(CaModifyFlags::IS_CM_SUPPORTED);
    assert_eq!(qkey_violations(1), 3);
    modify_ca(CaModifyFlags::RESET_PKEY_COUNTER);
    assert_eq!(qkey_violations(1), 3);
    modify_ca(CaModifyFlags::RESET_QKEY_COUNTER);
    assert_eq!(qkey_violations(1), 0);

    // Counting goes on from zero; a datagram under the right key arrives.
    assert_eq!(
        post_send(&w, x, ua, vec![send(4, 0x2222), send(5, 0x1111)], Some(av)),
        (2, IbStatus::Success)
    );
    assert_eq!(poll_all(&w, x, sx.cq).len(), 2);
    let got = poll_all(&w, y, sy.cq);
    assert_eq!(
        got.iter()
            .map(|wc| (wc.wr_id, wc.status))
            .collect::<Vec<_>>(),
        [(100, WcStatus::Success)]
    );
    assert_eq!(qkey_violations(1), 1);

    destroy_qp(&w, x, ua);
    destroy_qp(&w, y, ub);
    let _ = (poll_all(&w, x, sx.cq), poll_all(&w, y, sy.cq));
    mx.free(&w, x);
    my.free(&w, y);
    teardown(&w, &sx);
    teardown(&w, &sy);
    w.finish();
}

#[test]
fn a_full_receive_queue_refuses_one_more_and_takes_wrs_again_after_completions() {
    let (w, [x, y]) = support::kernel_pair::two_two_port_hcas(93, GUIDS, &HCA_IPS);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let (a, qpn_a, _) = create_qp(&w, &sx, QpType::Rc, SMALL);
    let (b, qpn_b, granted) = create_qp(&w, &sy, QpType::Rc, SMALL);
    let access = AccessFlags::REMOTE_WRITE;
    for m in rc_to_rts_steps(1, access, qpn_b, HCA_IPS[1][0], 1) {
        modify(&w, x, a, &m);
    }
    for m in rc_to_rts_steps(1, access, qpn_a, HCA_IPS[0][0], 1) {
        modify(&w, y, b, &m);
    }
    let depth = granted.max_recv_wr as usize;
    let mx = KernelBuf::register(&w, &sx, *b"RqS ", 4096, AccessFlags::LOCAL_WRITE);
    let my = KernelBuf::register(&w, &sy, *b"RqR ", 4096, AccessFlags::LOCAL_WRITE);
    let slot = |k: usize| leak(vec![my.sge(k * 64, 64)]);
    let recv = |wr_id: u64, k: usize| RecvWr {
        wr_id,
        sg_list: slot(k),
    };

    // Up to the granted depth in one batch whose last WR is one too many:
    // the depth is posted, the extra one refused.
    let wrs: Vec<_> = (0..=depth).map(|k| recv(k as u64, k % depth)).collect();
    assert_eq!(
        post_recv(&w, y, b, wrs),
        (depth, IbStatus::InsufficientResources)
    );
    // Full: a single WR is refused too.
    assert_eq!(
        post_recv(&w, y, b, vec![recv(900, 0)]),
        (0, IbStatus::InsufficientResources)
    );

    // `depth` sends land in the posted receives, in order.
    let send = |wr_id: u64, byte: u8| {
        mx.write(wr_id as usize * 8, &[byte; 8]);
        SendWr {
            wr_id,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: leak(vec![mx.sge(wr_id as usize * 8, 8)]),
            ud: None,
        }
    };
    let sends: Vec<_> = (0..depth as u64).map(|k| send(k, 0x40 + k as u8)).collect();
    assert_eq!(post_send(&w, x, a, sends, None), (depth, IbStatus::Success));
    let sent = poll_all(&w, x, sx.cq);
    assert_eq!(sent.len(), depth);
    assert!(sent.iter().all(|wc| wc.status == WcStatus::Success));
    let got = poll_all(&w, y, sy.cq);
    assert_eq!(
        got.iter()
            .map(|wc| (wc.wr_id, wc.status))
            .collect::<Vec<_>>(),
        (0..depth as u64)
            .map(|k| (k, WcStatus::Success))
            .collect::<Vec<_>>(),
        "exactly the posted receives completed: the refused ones were never posted"
    );
    for k in 0..depth {
        assert_eq!(my.read(k * 64, 8), [0x40 + k as u8; 8]);
    }

    // The completions freed every slot: the depth again, then refused.
    let again: Vec<_> = (0..=depth)
        .map(|k| recv(200 + k as u64, k % depth))
        .collect();
    assert_eq!(
        post_recv(&w, y, b, again),
        (depth, IbStatus::InsufficientResources)
    );
    assert_eq!(
        post_send(&w, x, a, vec![send(50, 0x77)], None),
        (1, IbStatus::Success)
    );
    assert_eq!(poll_all(&w, x, sx.cq)[0].status, WcStatus::Success);
    let got = poll_all(&w, y, sy.cq);
    assert_eq!(
        got.iter()
            .map(|wc| (wc.wr_id, wc.status))
            .collect::<Vec<_>>(),
        [(200, WcStatus::Success)]
    );
    assert_eq!(my.read(0, 8), [0x77; 8]);

    destroy_qp(&w, x, a);
    destroy_qp(&w, y, b);
    let _ = (poll_all(&w, x, sx.cq), poll_all(&w, y, sy.cq));
    mx.free(&w, x);
    my.free(&w, y);
    teardown(&w, &sx);
    teardown(&w, &sy);
    w.finish();
}
