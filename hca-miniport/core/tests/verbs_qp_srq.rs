//! Kernel QPs on an SRQ on the simulated host (guide 6.5.1, 6.4; PRM 6.1
//! `HAS_SRQ`, 10.4 the CQE's SRQ flag): an RC pair between the two ports
//! of one HCA whose receiver takes its receives from an SRQ; data checked
//! byte for byte and `wr_id`s handed back through the SRQ, the SRQ refilled
//! many times over its depth, the SRQ busy while the QP lives, the limit
//! event still delivered; and device-raised QP events (PRM 8.2) into the
//! cached state and to the client. Each test ends with the host shut down
//! and the verifier clean.

mod support;

use std::sync::{Arc, Mutex};

use driver_platform::{Irql, RequestorMode};
use hca_miniport_core::verbs::CaClient;
use hca_miniport_core::verbs::qp::SendRequest;
use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::cq::CqAttr;
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::handle::{CqHandle, PdHandle, SrqHandle};
use ib_types::ioctl::{
    AllocPd, CreateCq, CreateQp, CreateSrq, DeallocPd, DestroyCq, DestroyQp, DestroySrq, Empty,
    ModifyQp, ModifySrq, QpCreated, QueryQp,
};
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, Mtu, PortNum, Psn, Qpn};
use ib_types::srq::{SrqAttr, SrqCreate, SrqModify};
use ib_types::status::IbStatus;
use ib_types::wc::{WcOpcode, WcStatus, WorkCompletion};
use ib_types::wr::{RKey, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge};
use support::{World, lock, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;

/// A client that records its asynchronous events and the IRQL they came at.
#[derive(Default)]
struct Client {
    events: Mutex<Vec<(AsyncEventRecord, Irql)>>,
}

impl CaClient for Client {
    fn completion(&self, _: CqHandle) {}
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.events).push((*event, sim_host::irql::current()));
    }
}

type Region = hca_miniport_core::mr::MemoryRegion<sim_host::platform::SimPlatform>;

/// A registered common buffer.
struct Mem {
    buffer: sim_host::dma::HostCommonBuffer,
    region: Region,
}

const MEM_BYTES: usize = 8192;

impl Mem {
    fn new(w: &World, pd: u64) -> Self {
        use driver_platform::{CommonBuffer, DmaAdapter};
        let buffer = w.adapter().alloc_common(MEM_BYTES).unwrap();
        let bus = buffer.bus_address();
        let pages: Vec<u64> = (0..(MEM_BYTES / 4096) as u64)
            .map(|i| bus + i * 4096)
            .collect();
        let mt = w.hca().memory_translation().unwrap();
        let out = Arc::new(Mutex::new(None));
        let (hca, sink) = (w.hca(), out.clone());
        let pd_number = support::number_of(pd);
        w.in_dpc(move || {
            let request = hca_miniport_core::mr::PhysicalRegion {
                iova: bus,
                length: MEM_BYTES as u64,
                first_byte_offset: 0,
                page_shift: 12,
                pages: &pages,
                access: AccessFlags::LOCAL_WRITE
                    | AccessFlags::REMOTE_WRITE
                    | AccessFlags::REMOTE_READ,
                pd: pd_number,
            };
            mt.register_physical(&hca, request, Box::new(move |r| *lock(&sink) = Some(r)));
        });
        w.settle();
        let region = lock(&out).take().unwrap().unwrap();
        Mem { buffer, region }
    }

    fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge::new(self.region.start() + offset as u64, len, self.region.lkey())
    }

    fn write(&self, offset: usize, bytes: &[u8]) {
        use driver_platform::CommonBuffer;
        assert!(self.buffer.write(offset, bytes));
    }

    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        use driver_platform::CommonBuffer;
        let mut out = vec![0; len];
        assert!(self.buffer.read(offset, &mut out));
        out
    }

    fn free(self, w: &World) {
        let mt = w.hca().memory_translation().unwrap();
        let out = Arc::new(Mutex::new(None));
        let (hca, sink, region) = (w.hca(), out.clone(), self.region);
        w.in_dpc(move || {
            mt.deregister(
                &hca,
                region,
                Box::new(move |r| *lock(&sink) = Some(r.is_ok())),
            );
        });
        w.settle();
        assert_eq!(lock(&out).take(), Some(true));
        w.adapter().free_common(self.buffer);
    }
}

/// Deterministic, non-trivial bytes.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn leak_sges(sges: Vec<Sge>) -> &'static [Sge] {
    Box::leak(sges.into_boxed_slice())
}

fn create_qp(w: &World, ca: u64, input: &QpCreate) -> (IbStatus, u64, Option<QpCreated>) {
    let r = w.call_in_dpc::<CreateQp>(KERNEL, ca, input, 0);
    let resp = response::<CreateQp>(&r);
    (resp.status, resp.handle, resp.output)
}

fn modify(w: &World, qp: u64, m: &QpModify) -> IbStatus {
    let r = w.call_in_dpc::<ModifyQp>(KERNEL, qp, m, 0);
    response::<ModifyQp>(&r).status
}

/// Connects `qp` on `port` to `dest` at `dest_ip` (RESET to RTS, PSN 100
/// both ways).
fn connect(w: &World, qp: u64, port: u8, dest: u32, dest_ip: [u8; 4]) {
    let port = PortNum::new(port).unwrap();
    let init = QpModify {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(port),
        access: Some(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ),
        ..QpModify::default()
    };
    assert_eq!(modify(w, qp, &init), IbStatus::Success);
    let rtr = QpModify {
        state: Some(QpState::Rtr),
        av: Some(AvAttr {
            port,
            sl: 0,
            dlid: Lid::default(),
            path_bits: 0,
            static_rate: 0,
            grh: Some(Grh {
                dgid: Gid::from_ipv4(dest_ip),
                flow_label: 0,
                hop_limit: 64,
                traffic_class: 0,
                sgid_index: 0,
            }),
        }),
        path_mtu: Some(Mtu::Mtu1024),
        dest_qpn: Some(Qpn::new(dest).unwrap()),
        rq_psn: Some(Psn::new(100).unwrap()),
        max_dest_rd_atomic: Some(4),
        min_rnr_timer: Some(12),
        ..QpModify::default()
    };
    assert_eq!(modify(w, qp, &rtr), IbStatus::Success);
    let rts = QpModify {
        state: Some(QpState::Rts),
        sq_psn: Some(Psn::new(100).unwrap()),
        timeout: Some(14),
        retry_cnt: Some(7),
        rnr_retry: Some(7),
        max_rd_atomic: Some(4),
        ..QpModify::default()
    };
    assert_eq!(modify(w, qp, &rts), IbStatus::Success);
}

/// Polls everything the CQ holds, from a DPC.
fn poll_all(w: &World, cq: u64) -> Vec<WorkCompletion> {
    let out = Arc::new(Mutex::new(Vec::new()));
    let (hca, sink) = (w.hca(), out.clone());
    w.in_dpc(move || {
        let mut wcs = [WorkCompletion::EMPTY; 3];
        loop {
            let n = hca.poll_cq(cq, &mut wcs).unwrap();
            if n == 0 {
                break;
            }
            lock(&sink).extend_from_slice(&wcs[..n]);
        }
    });
    w.settle();
    lock(&out).clone()
}

/// Posts receives to the SRQ from a DPC.
fn post_srq(w: &World, srq: u64, wrs: Vec<RecvWr<'static>>) -> (u32, IbStatus) {
    let out = Arc::new(Mutex::new(None));
    let (hca, sink) = (w.hca(), out.clone());
    w.in_dpc(move || *lock(&sink) = Some(hca.post_srq_recv(srq, &wrs)));
    w.settle();
    lock(&out).take().unwrap()
}

/// Posts receives to a QP from a DPC.
fn post_recv(w: &World, qp: u64, wrs: Vec<RecvWr<'static>>) -> (usize, IbStatus) {
    let out = Arc::new(Mutex::new(None));
    let (hca, sink) = (w.hca(), out.clone());
    w.in_dpc(move || *lock(&sink) = Some(hca.post_recv(qp, &wrs)));
    w.settle();
    lock(&out).take().unwrap()
}

/// Receive slots of the SRQ, each `SLOT` bytes of the receiver's memory.
const DEPTH: usize = 8;
const SLOT: usize = 1024;
/// Bytes of each message.
const MSG: usize = 700;

#[test]
fn rc_receives_from_an_srq_refilled_past_its_depth_with_wr_ids_and_bytes() {
    let w = World::deterministic(57);
    let client = Arc::new(Client::default());
    let hca = w.hca();
    let (ca, pd, cq) = open_pd_cq(&w, client.clone());
    let create = SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr: SrqAttr {
            max_wr: DEPTH as u32,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    let r = w.call_in_dpc::<CreateSrq>(KERNEL, ca, &create, 0);
    let resp = response::<CreateSrq>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let srq = resp.handle;
    let depth = resp.output.unwrap().max_wr as usize;
    assert_eq!(depth, DEPTH);

    let qp = |srq: Option<u64>, recv_cq: u64| QpCreate {
        qp_type: QpType::Rc,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(cq),
        recv_cq: CqHandle::from_raw(recv_cq),
        srq: srq.map(SrqHandle::from_raw),
        caps: QpCaps {
            max_send_wr: 16,
            max_recv_wr: if srq.is_some() { 0 } else { 4 },
            max_send_sge: 1,
            max_recv_sge: if srq.is_some() { 0 } else { 1 },
            max_inline_data: 0,
        },
        sq_sig_all: false,
        port: None,
    };
    // A create that fails after the SRQ's use was taken (a stale receive
    // CQ) gives the use back: the SRQ is destroyable at the end.
    let (status, _, _) = create_qp(&w, ca, &qp(Some(srq), cq ^ (1 << 40)));
    assert_ne!(status, IbStatus::Success);
    let (status, a, ca_out) = create_qp(&w, ca, &qp(None, cq));
    assert_eq!(status, IbStatus::Success);
    let (status, b, cb_out) = create_qp(&w, ca, &qp(Some(srq), cq));
    assert_eq!(status, IbStatus::Success);
    let (qpn_a, cb_out) = (ca_out.unwrap().qpn.get(), cb_out.unwrap());
    let qpn_b = cb_out.qpn.get();
    assert_eq!((cb_out.caps.max_recv_wr, cb_out.caps.max_recv_sge), (0, 0));

    // The SRQ is busy while B lives.
    let r = w.call_in_dpc::<DestroySrq>(KERNEL, srq, &Empty, 0);
    assert_eq!(response::<DestroySrq>(&r).status, IbStatus::ResourceBusy);

    connect(&w, a, 1, qpn_b, [10, 0, 1, 1]);
    connect(&w, b, 2, qpn_a, [10, 0, 0, 1]);

    let a_mem = Mem::new(&w, pd);
    let b_mem = Mem::new(&w, pd);
    // B has no receive queue of its own.
    let b_sge = leak_sges(vec![b_mem.sge(0, SLOT as u32)]);
    assert_eq!(
        post_recv(
            &w,
            b,
            vec![RecvWr {
                wr_id: 1,
                sg_list: b_sge
            }]
        ),
        (0, IbStatus::InvalidQpState)
    );

    // Round r posts DEPTH receives (wr_id r * 100 + slot) into the freed
    // slots, then DEPTH SENDs; the receives complete in order with their
    // own wr_ids, each slot's buffer holds its message. Five rounds: five
    // times the SRQ's depth.
    let recv_wrs = |round: u64| -> Vec<RecvWr<'static>> {
        (0..DEPTH)
            .map(|slot| RecvWr {
                wr_id: round * 100 + slot as u64,
                sg_list: leak_sges(vec![b_mem.sge(slot * SLOT, SLOT as u32)]),
            })
            .collect()
    };
    for round in 1..=5u64 {
        assert_eq!(
            post_srq(&w, srq, recv_wrs(round)),
            (DEPTH as u32, IbStatus::Success)
        );
        // Full: one more does not fit.
        assert_eq!(
            post_srq(&w, srq, recv_wrs(99)[..1].to_vec()),
            (0, IbStatus::InsufficientResources)
        );
        if round == 5 {
            // The limit armed at DEPTH / 2: crossing it raises the event.
            let arm = SrqModify {
                max_wr: None,
                srq_limit: Some(DEPTH as u32 / 2),
            };
            let r = w.call_in_dpc::<ModifySrq>(KERNEL, srq, &arm, 0);
            assert_eq!(response::<ModifySrq>(&r).status, IbStatus::Success);
        }
        let payloads: Vec<Vec<u8>> = (0..DEPTH)
            .map(|i| pattern((round as u8) * 16 + i as u8, MSG))
            .collect();
        let sends: Vec<SendWr<'static>> = payloads
            .iter()
            .enumerate()
            .map(|(i, p)| {
                a_mem.write(i * SLOT, p);
                SendWr {
                    wr_id: round * 1000 + i as u64,
                    op: SendOp::Send,
                    flags: SendFlags::SIGNALED,
                    sg_list: leak_sges(vec![a_mem.sge(i * SLOT, MSG as u32)]),
                    ud: None,
                }
            })
            .collect();
        assert_eq!(w.post_send_in_dpc(0, a, sends), (DEPTH, IbStatus::Success));
        let wcs = poll_all(&w, cq);
        let sent: Vec<(u64, WcStatus)> = wcs
            .iter()
            .filter(|wc| wc.qp_num.get() == qpn_a)
            .map(|wc| (wc.wr_id, wc.status))
            .collect();
        assert_eq!(
            sent,
            (0..DEPTH as u64)
                .map(|i| (round * 1000 + i, WcStatus::Success))
                .collect::<Vec<_>>()
        );
        let got: Vec<(u64, WcStatus, WcOpcode, u32)> = wcs
            .iter()
            .filter(|wc| wc.qp_num.get() == qpn_b)
            .map(|wc| (wc.wr_id, wc.status, wc.opcode, wc.byte_len))
            .collect();
        assert_eq!(
            got,
            (0..DEPTH as u64)
                .map(|i| (
                    round * 100 + i,
                    WcStatus::Success,
                    WcOpcode::Recv,
                    MSG as u32
                ))
                .collect::<Vec<_>>(),
            "round {round}"
        );
        for (i, p) in payloads.iter().enumerate() {
            assert_eq!(&b_mem.read(i * SLOT, MSG), p, "round {round} slot {i}");
        }
    }
    // The limit event: once, at DISPATCH_LEVEL, with the SRQ's handle.
    let record = AsyncEventRecord::new(AsyncEventCode::SrqLimitReached, srq, None, 0).unwrap();
    assert_eq!(lock(&client.events).clone(), vec![(record, Irql::DISPATCH)]);

    // Destroy B with receives posted on the SRQ: nothing of the SRQ is
    // flushed by the QP (the WQEs stay the SRQ's); then the SRQ is free.
    assert_eq!(
        post_srq(&w, srq, recv_wrs(7)[..3].to_vec()),
        (3, IbStatus::Success)
    );
    let r = w.call_in_dpc::<DestroyQp>(KERNEL, b, &Empty, 0);
    assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    let r = w.call_in_dpc::<DestroyQp>(KERNEL, a, &Empty, 0);
    assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    let left = poll_all(&w, cq);
    assert!(left.iter().all(|wc| wc.qp_num.get() != qpn_b), "{left:?}");
    let r = w.call_in_dpc::<DestroySrq>(KERNEL, srq, &Empty, 0);
    assert_eq!(response::<DestroySrq>(&r).status, IbStatus::Success);

    a_mem.free(&w);
    b_mem.free(&w);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    assert_eq!(hca.close_ca(ca), Ok(()));
    w.finish();
}

/// Opens the CA for `client` with a PD and a 64-entry CQ: (CA, PD, CQ).
fn open_pd_cq(w: &World, client: Arc<Client>) -> (u64, u64, u64) {
    let ca = w.hca().open_ca(Some(client)).unwrap();
    let r = w.call_in_dpc::<AllocPd>(KERNEL, ca, &Empty, 0);
    let pd = response::<AllocPd>(&r).handle;
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let r = w.call_in_dpc::<CreateCq>(KERNEL, ca, &attr, 0);
    (ca, pd, response::<CreateCq>(&r).handle)
}

/// A small RC QP on `cq`, receiving from `srq` or from its own queue.
fn rc_create(pd: u64, cq: u64, srq: Option<u64>) -> QpCreate {
    QpCreate {
        qp_type: QpType::Rc,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(cq),
        recv_cq: CqHandle::from_raw(cq),
        srq: srq.map(SrqHandle::from_raw),
        caps: QpCaps {
            max_send_wr: 4,
            max_recv_wr: if srq.is_some() { 0 } else { 4 },
            max_send_sge: 1,
            max_recv_sge: if srq.is_some() { 0 } else { 1 },
            max_inline_data: 0,
        },
        sq_sig_all: false,
        port: None,
    }
}

fn query_state(w: &World, qp: u64) -> QpState {
    let r = w.call_in_dpc::<QueryQp>(KERNEL, qp, &Empty, 0);
    let resp = response::<QueryQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    resp.output.unwrap().state
}

/// Device-raised QP events (PRM 8.2): an RDMA write under a bad R_Key
/// makes the responder (on an SRQ) fail with `WQ_ACCESS_ERROR` and, now in
/// ERR, `SRQ_LAST_WQE`; both reach the client at DISPATCH_LEVEL with the
/// QP's handle, and the cached state (QueryQp) is ERR. The requester gets
/// the error CQE with its `wr_id`.
#[test]
fn a_responder_access_error_moves_the_cached_state_to_err_and_reaches_the_client() {
    let w = World::deterministic(61);
    let client = Arc::new(Client::default());
    let hca = w.hca();
    let (ca, pd, cq) = open_pd_cq(&w, client.clone());
    let create = SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr: SrqAttr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    let r = w.call_in_dpc::<CreateSrq>(KERNEL, ca, &create, 0);
    let srq = response::<CreateSrq>(&r).handle;
    let qp = |srq: Option<u64>| rc_create(pd, cq, srq);
    let (_, a, ca_out) = create_qp(&w, ca, &qp(None));
    let (_, b, cb_out) = create_qp(&w, ca, &qp(Some(srq)));
    let (qpn_a, qpn_b) = (ca_out.unwrap().qpn.get(), cb_out.unwrap().qpn.get());
    connect(&w, a, 1, qpn_b, [10, 0, 1, 1]);
    connect(&w, b, 2, qpn_a, [10, 0, 0, 1]);
    let a_mem = Mem::new(&w, pd);
    let b_mem = Mem::new(&w, pd);
    assert!(lock(&client.events).is_empty());

    let bad = SendOp::RdmaWrite {
        remote: RemoteAddr {
            addr: b_mem.region.start(),
            rkey: RKey::new(b_mem.region.rkey().get() ^ 0x5A5A_0000),
        },
    };
    let wr = SendWr {
        wr_id: 77,
        op: bad,
        flags: SendFlags::SIGNALED,
        sg_list: leak_sges(vec![a_mem.sge(0, 64)]),
        ud: None,
    };
    assert_eq!(w.post_send_in_dpc(0, a, vec![wr]), (1, IbStatus::Success));
    let wcs = poll_all(&w, cq);
    let summary: Vec<(u32, u64, WcStatus)> = wcs
        .iter()
        .map(|wc| (wc.qp_num.get(), wc.wr_id, wc.status))
        .collect();
    assert_eq!(summary, vec![(qpn_a, 77, WcStatus::RemAccessErr)]);
    // The requester learns its QP's ERR from the completion alone.
    assert_eq!(query_state(&w, a), QpState::Err);

    let events = lock(&client.events).clone();
    let record = |code| AsyncEventRecord::new(code, b, None, 0).unwrap();
    assert_eq!(
        events,
        vec![
            (record(AsyncEventCode::WqAccessError), Irql::DISPATCH),
            (record(AsyncEventCode::QpLastWqeReached), Irql::DISPATCH),
        ]
    );
    assert_eq!(query_state(&w, b), QpState::Err);

    // Destroy raises nothing further for the client.
    for q in [a, b] {
        let r = w.call_in_dpc::<DestroyQp>(KERNEL, q, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    }
    let _ = poll_all(&w, cq);
    assert_eq!(lock(&client.events).len(), 2);
    let r = w.call_in_dpc::<DestroySrq>(KERNEL, srq, &Empty, 0);
    assert_eq!(response::<DestroySrq>(&r).status, IbStatus::Success);
    a_mem.free(&w);
    b_mem.free(&w);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    assert_eq!(hca.close_ca(ca), Ok(()));
    w.finish();
}

/// A device-raised ERR that arrives while a `MODIFY_QP` of the same QP is
/// outstanding: the device executed the modify (RTS->RTS, new RNR timer)
/// and only then failed the QP on a bad-R_Key write, so the access-error
/// event precedes the modify's completion in the EQ (the simulated device
/// holds its command completions back, as a real device's firmware may).
/// The modify succeeded on the device and says so; the QP's cached state
/// stays ERR, not the modify's target. A later modify from the stale RTS
/// is then judged from ERR and refused.
#[test]
fn an_err_event_during_an_outstanding_modify_is_not_overwritten_by_its_completion() {
    let w = World::deterministic(62);
    let client = Arc::new(Client::default());
    let hca = w.hca();
    let (ca, pd, cq) = open_pd_cq(&w, client.clone());
    let create = rc_create(pd, cq, None);
    let (_, a, a_out) = create_qp(&w, ca, &create);
    let (_, b, b_out) = create_qp(&w, ca, &create);
    let (qpn_a, qpn_b) = (a_out.unwrap().qpn.get(), b_out.unwrap().qpn.get());
    connect(&w, a, 1, qpn_b, [10, 0, 1, 1]);
    connect(&w, b, 2, qpn_a, [10, 0, 0, 1]);
    let a_mem = Mem::new(&w, pd);
    let b_mem = Mem::new(&w, pd);

    // The modify runs on the device now; its completion is held.
    w.function().with_device(|d| d.hold_command_completions());
    let stay_rts = QpModify {
        min_rnr_timer: Some(3),
        ..QpModify::default()
    };
    let (request, issuer) = w.request::<ModifyQp>(KERNEL, b, &stay_rts, 0);
    let bad = SendWr {
        wr_id: 78,
        op: SendOp::RdmaWrite {
            remote: RemoteAddr {
                addr: b_mem.region.start(),
                rkey: RKey::new(b_mem.region.rkey().get() ^ 0x5A5A_0000),
            },
        },
        flags: SendFlags::SIGNALED,
        sg_list: leak_sges(vec![a_mem.sge(0, 64)]),
        ud: None,
    };
    let core = w.hca();
    w.in_dpc(move || {
        core.submit_request(request);
        let posted = core.post_send(
            a,
            &[SendRequest {
                wr: bad,
                av: None,
                inline: None,
            }],
        );
        assert_eq!(posted, (1, IbStatus::Success));
    });
    // Long enough for the write and its error, far short of the command
    // timeout.
    w.host.scheduler().run_for(1_000_000, 100_000).unwrap();
    assert!(issuer.completion().is_none(), "the completion is held");
    let record = AsyncEventRecord::new(AsyncEventCode::WqAccessError, b, None, 0).unwrap();
    assert_eq!(lock(&client.events).clone(), vec![(record, Irql::DISPATCH)]);

    w.function()
        .with_device(|d| d.release_command_completions());
    w.settle();
    let done = issuer.completion().expect("the modify completed");
    assert_eq!(response::<ModifyQp>(&done).status, IbStatus::Success);
    assert_eq!(query_state(&w, b), QpState::Err);
    // Judged from ERR: staying in ERR takes no attributes (Table 91).
    assert_eq!(modify(&w, b, &stay_rts), IbStatus::InvalidSetting);
    assert_eq!(query_state(&w, b), QpState::Err);

    for q in [a, b] {
        let r = w.call_in_dpc::<DestroyQp>(KERNEL, q, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    }
    let wcs = poll_all(&w, cq);
    assert!(
        wcs.iter()
            .any(|wc| wc.wr_id == 78 && wc.qp_num.get() == qpn_a)
    );
    a_mem.free(&w);
    b_mem.free(&w);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    assert_eq!(hca.close_ca(ca), Ok(()));
    w.finish();
}

/// A destroyed QP's receive completion taken from its SRQ (CQE SRQ flag)
/// that the client polls only after destroying that SRQ too and creating a
/// new one at the same SRQ number: the CQE sitting in the CQ ring is not
/// covered by the one-EQ ordering of events, so the number alone would
/// hand it the new SRQ's `wr_id` and free the new SRQ's slot. It gets the
/// old SRQ's `wr_id`, and the new SRQ's receive still takes the next
/// message with its own.
#[test]
fn a_late_srq_completion_never_reaches_a_reused_srq_number() {
    let w = World::deterministic(63);
    let hca = w.hca();
    let ca = hca.open_ca(None).unwrap();
    let r = w.call_in_dpc::<AllocPd>(KERNEL, ca, &Empty, 0);
    let pd = response::<AllocPd>(&r).handle;
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let mut cqs = [0; 2];
    for cq in &mut cqs {
        let r = w.call_in_dpc::<CreateCq>(KERNEL, ca, &attr, 0);
        *cq = response::<CreateCq>(&r).handle;
    }
    let [send_cq, recv_cq] = cqs;
    let srq_create = SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr: SrqAttr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    let qp = |cq: u64, srq: Option<u64>| rc_create(pd, cq, srq);
    let a_mem = Mem::new(&w, pd);
    let b_mem = Mem::new(&w, pd);
    let recv = |wr_id: u64, at: usize| RecvWr {
        wr_id,
        sg_list: leak_sges(vec![b_mem.sge(at, 256)]),
    };
    let send = |wr_id: u64, seed: u8| {
        a_mem.write(0, &pattern(seed, 128));
        SendWr {
            wr_id,
            op: SendOp::Send,
            flags: SendFlags::empty(),
            sg_list: leak_sges(vec![a_mem.sge(0, 128)]),
            ud: None,
        }
    };
    // A pair whose receiver takes from the first SRQ.
    let r = w.call_in_dpc::<CreateSrq>(KERNEL, ca, &srq_create, 0);
    let old_srq = response::<CreateSrq>(&r).handle;
    let (_, a, a_out) = create_qp(&w, ca, &qp(send_cq, None));
    let (_, b, b_out) = create_qp(&w, ca, &qp(recv_cq, Some(old_srq)));
    let (qpn_a, qpn_b) = (a_out.unwrap().qpn.get(), b_out.unwrap().qpn.get());
    connect(&w, a, 1, qpn_b, [10, 0, 1, 1]);
    connect(&w, b, 2, qpn_a, [10, 0, 0, 1]);
    assert_eq!(
        post_srq(&w, old_srq, vec![recv(1001, 0)]),
        (1, IbStatus::Success)
    );
    assert_eq!(
        w.post_send_in_dpc(0, a, vec![send(1, 0x21)]),
        (1, IbStatus::Success)
    );

    // The receive's CQE stays unpolled while its QP and SRQ go.
    let r = w.call_in_dpc::<DestroyQp>(KERNEL, b, &Empty, 0);
    assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    let r = w.call_in_dpc::<DestroySrq>(KERNEL, old_srq, &Empty, 0);
    assert_eq!(response::<DestroySrq>(&r).status, IbStatus::Success);
    // Create SRQs (destroying those at other numbers) until the old
    // number comes back.
    let new_srq = (0..100_000)
        .find_map(|_| {
            let r = w.call_in_dpc::<CreateSrq>(KERNEL, ca, &srq_create, 0);
            let created = response::<CreateSrq>(&r);
            assert_eq!(created.status, IbStatus::Success);
            if support::number_of(created.handle) == support::number_of(old_srq) {
                return Some(created.handle);
            }
            let r = w.call_in_dpc::<DestroySrq>(KERNEL, created.handle, &Empty, 0);
            assert_eq!(response::<DestroySrq>(&r).status, IbStatus::Success);
            None
        })
        .expect("the SRQ number is reused");
    assert_ne!(new_srq, old_srq);
    assert_eq!(
        post_srq(&w, new_srq, vec![recv(2001, 512)]),
        (1, IbStatus::Success)
    );

    let wcs = poll_all(&w, recv_cq);
    let summary: Vec<(u32, u64, WcStatus)> = wcs
        .iter()
        .map(|wc| (wc.qp_num.get(), wc.wr_id, wc.status))
        .collect();
    assert_eq!(summary, vec![(qpn_b, 1001, WcStatus::Success)]);
    assert_eq!(b_mem.read(0, 128), pattern(0x21, 128));

    // The new SRQ's receive is still posted and takes the next message.
    let (_, c, c_out) = create_qp(&w, ca, &qp(recv_cq, Some(new_srq)));
    let qpn_c = c_out.unwrap().qpn.get();
    let reset = QpModify {
        state: Some(QpState::Reset),
        ..QpModify::default()
    };
    assert_eq!(modify(&w, a, &reset), IbStatus::Success);
    // Reset after a connection: RTR waits out TIME WAIT (guide 6.5.2).
    w.host
        .scheduler()
        .advance(hca_miniport_core::verbs::qp::QPN_QUIET_PERIOD_NS)
        .unwrap();
    connect(&w, a, 1, qpn_c, [10, 0, 1, 1]);
    connect(&w, c, 2, qpn_a, [10, 0, 0, 1]);
    assert_eq!(
        w.post_send_in_dpc(0, a, vec![send(2, 0x42)]),
        (1, IbStatus::Success)
    );
    let summary: Vec<(u32, u64, WcStatus)> = poll_all(&w, recv_cq)
        .iter()
        .map(|wc| (wc.qp_num.get(), wc.wr_id, wc.status))
        .collect();
    assert_eq!(summary, vec![(qpn_c, 2001, WcStatus::Success)]);
    assert_eq!(b_mem.read(512, 128), pattern(0x42, 128));

    for q in [a, c] {
        let r = w.call_in_dpc::<DestroyQp>(KERNEL, q, &Empty, 0);
        assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
    }
    let _ = poll_all(&w, send_cq);
    let r = w.call_in_dpc::<DestroySrq>(KERNEL, new_srq, &Empty, 0);
    assert_eq!(response::<DestroySrq>(&r).status, IbStatus::Success);
    a_mem.free(&w);
    b_mem.free(&w);
    for cq in cqs {
        let r = w.call_in_dpc::<DestroyCq>(KERNEL, cq, &Empty, 0);
        assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    }
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    assert_eq!(hca.close_ca(ca), Ok(()));
    w.finish();
}
