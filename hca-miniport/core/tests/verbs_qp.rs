//! The QP verbs on the simulated host: create (RC, UC, UD, special),
//! query, modify through the state machine, destroy, with requests built
//! by `ib_types::ioctl::encode_request` and issued from DPCs. Each test
//! ends with the host shut down and the verifier clean.

mod support;

use driver_platform::RequestorMode;
use hca_miniport_core::verbs::qp::SendRequest;
use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::cq::CqAttr;
use ib_types::handle::{AvHandle, CqHandle, PdHandle, SrqHandle};
use ib_types::ioctl::{
    AllocPd, CreateCq, CreateQp, DeallocPd, DestroyCq, DestroyQp, Empty, ModifyQp, OpenCa,
    OpenCaIn, QpCreated, QueryQp,
};
use ib_types::qp::{QpAttrMask, QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, Mtu, PortNum, Psn, QKey, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest};
use support::{World, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;
const USER: RequestorMode = RequestorMode::User;

struct Setup {
    ca: u64,
    pd: u64,
    cq: u64,
}

fn setup(w: &World) -> Setup {
    setup_at(w, 0)
}

fn setup_at(w: &World, i: usize) -> Setup {
    let r = w.call_in_dpc_at::<OpenCa>(i, KERNEL, 0, &OpenCaIn::CURRENT, 0);
    let ca = response::<OpenCa>(&r).handle;
    let r = w.call_in_dpc_at::<AllocPd>(i, KERNEL, ca, &Empty, 0);
    let pd = response::<AllocPd>(&r).handle;
    // Room for five QPs of `caps()`' queues: a CQ never takes more
    // work-queue entries than it holds (guide 8.2.3 item 1, `cq::Room`).
    let attr = CqAttr {
        cqe: 256,
        comp_vector: 0,
    };
    let r = w.call_in_dpc_at::<CreateCq>(i, KERNEL, ca, &attr, 0);
    let cq = response::<CreateCq>(&r).handle;
    Setup { ca, pd, cq }
}

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 10,
        max_recv_wr: 12,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 32,
    }
}

fn qp_create(s: &Setup, qp_type: QpType, port: Option<u8>) -> QpCreate {
    QpCreate {
        qp_type,
        pd: PdHandle::from_raw(s.pd),
        send_cq: CqHandle::from_raw(s.cq),
        recv_cq: CqHandle::from_raw(s.cq),
        srq: None,
        caps: caps(),
        sq_sig_all: false,
        port: port.map(|p| PortNum::new(p).unwrap()),
    }
}

fn create(
    w: &World,
    mode: RequestorMode,
    s: &Setup,
    input: &QpCreate,
) -> (IbStatus, u64, Option<QpCreated>) {
    create_at(w, 0, mode, s, input)
}

fn create_at(
    w: &World,
    i: usize,
    mode: RequestorMode,
    s: &Setup,
    input: &QpCreate,
) -> (IbStatus, u64, Option<QpCreated>) {
    let r = w.call_in_dpc_at::<CreateQp>(i, mode, s.ca, input, 0);
    let resp = response::<CreateQp>(&r);
    (resp.status, resp.handle, resp.output)
}

fn modify(w: &World, qp: u64, m: &QpModify) -> IbStatus {
    modify_at(w, 0, qp, m)
}

fn modify_at(w: &World, i: usize, qp: u64, m: &QpModify) -> IbStatus {
    let r = w.call_in_dpc_at::<ModifyQp>(i, KERNEL, qp, m, 0);
    response::<ModifyQp>(&r).status
}

fn query(w: &World, qp: u64) -> ib_types::ioctl::QpQueryOut {
    let r = w.call_in_dpc::<QueryQp>(KERNEL, qp, &Empty, 0);
    let resp = response::<QueryQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    resp.output.unwrap()
}

fn destroy(w: &World, qp: u64) -> IbStatus {
    destroy_at(w, 0, qp)
}

fn destroy_at(w: &World, i: usize, qp: u64) -> IbStatus {
    let r = w.call_in_dpc_at::<DestroyQp>(i, KERNEL, qp, &Empty, 0);
    response::<DestroyQp>(&r).status
}

fn av_to(port: u8, ip: [u8; 4]) -> AvAttr {
    AvAttr {
        port: PortNum::new(port).unwrap(),
        sl: 0,
        dlid: Lid::default(),
        path_bits: 0,
        static_rate: 0,
        grh: Some(Grh {
            dgid: Gid::from_ipv4(ip),
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0,
            sgid_index: 0,
        }),
    }
}

fn to_init(port: u8) -> QpModify {
    QpModify {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(PortNum::new(port).unwrap()),
        access: Some(ib_types::access::AccessFlags::REMOTE_WRITE),
        ..QpModify::default()
    }
}

fn to_rtr(dest: u32) -> QpModify {
    QpModify {
        state: Some(QpState::Rtr),
        av: Some(av_to(1, [10, 0, 0, 1])),
        path_mtu: Some(Mtu::Mtu1024),
        dest_qpn: Some(Qpn::new(dest).unwrap()),
        rq_psn: Some(Psn::new(100).unwrap()),
        max_dest_rd_atomic: Some(4),
        min_rnr_timer: Some(12),
        ..QpModify::default()
    }
}

fn to_rts() -> QpModify {
    QpModify {
        state: Some(QpState::Rts),
        sq_psn: Some(Psn::new(200).unwrap()),
        timeout: Some(14),
        retry_cnt: Some(7),
        rnr_retry: Some(7),
        max_rd_atomic: Some(4),
        ..QpModify::default()
    }
}

#[test]
fn rc_qps_are_created_connected_queried_and_destroyed() {
    let w = World::deterministic(31);
    let s = setup(&w);
    let (status, a, created) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Rc, None));
    assert_eq!(status, IbStatus::Success);
    let created = created.unwrap();
    // General QPs are numbered above the two ports' special QPs.
    assert!(created.qpn.get() >= 4);
    assert!(created.caps.max_send_wr >= 10 && created.caps.max_recv_wr >= 12);
    assert!(created.caps.max_send_sge >= 2 && created.caps.max_inline_data >= 32);
    let (_, b, created_b) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Rc, None));
    let qpn_b = created_b.unwrap().qpn.get();
    assert_ne!(qpn_b, created.qpn.get());

    // The PD and CQ are in use.
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, s.pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::ResourceBusy);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, s.cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::ResourceBusy);

    let q = query(&w, a);
    assert_eq!((q.qp_type, q.state), (QpType::Rc, QpState::Reset));
    assert_eq!(q.caps, created.caps);

    // Illegal transitions and missing or extra attributes: refused with
    // the table's status, state unchanged.
    let rts = QpModify::to_state(QpState::Rts);
    assert_eq!(modify(&w, a, &rts), IbStatus::InvalidState);
    let bare_init = QpModify::to_state(QpState::Init);
    assert_eq!(modify(&w, a, &bare_init), IbStatus::InvalidParameter);
    let extra = QpModify {
        sq_psn: Some(Psn::new(1).unwrap()),
        ..to_init(1)
    };
    assert_eq!(modify(&w, a, &extra), IbStatus::InvalidSetting);
    assert_eq!(query(&w, a).state, QpState::Reset);

    // RESET -> INIT -> RTR -> RTS, each pointing at the other.
    for (qp, dest) in [(a, qpn_b), (b, created.qpn.get())] {
        assert_eq!(modify(&w, qp, &to_init(1)), IbStatus::Success);
        assert_eq!(query(&w, qp).state, QpState::Init);
        assert_eq!(modify(&w, qp, &to_rtr(dest)), IbStatus::Success);
        assert_eq!(modify(&w, qp, &to_rts()), IbStatus::Success);
    }
    let q = query(&w, a);
    assert_eq!(q.state, QpState::Rts);
    assert_eq!(q.attr.dest_qpn.map(Qpn::get), Some(qpn_b));
    assert_eq!(q.attr.sq_psn.map(Psn::get), Some(200));
    assert!(
        !q.attr
            .mask()
            .intersects(QpAttrMask::STATE | QpAttrMask::CAP)
    );
    let wrong_cur = QpModify {
        cur_state: Some(QpState::Sqd),
        ..QpModify::default()
    };
    assert_eq!(modify(&w, a, &wrong_cur), IbStatus::InvalidQpState);
    assert_eq!(query(&w, a).state, QpState::Rts);

    // To ERR and back to RESET clears the attributes.
    assert_eq!(
        modify(&w, a, &QpModify::to_state(QpState::Err)),
        IbStatus::Success
    );
    assert_eq!(
        modify(&w, a, &QpModify::to_state(QpState::Reset)),
        IbStatus::Success
    );
    assert_eq!(query(&w, a).attr, QpModify::default());

    assert_eq!(destroy(&w, a), IbStatus::Success);
    assert_eq!(destroy(&w, a), IbStatus::InvalidQpHandle);
    assert_eq!(destroy(&w, b), IbStatus::Success);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, s.cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, s.pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    w.finish();
}

#[test]
fn ud_and_special_qps_and_refusals() {
    let w = World::deterministic(32);
    let s = setup(&w);
    let (status, ud, _) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Ud, None));
    assert_eq!(status, IbStatus::Success);
    let m = QpModify {
        qkey: Some(QKey::new(0x1234)),
        ..to_init(1)
    };
    let m = QpModify { access: None, ..m };
    assert_eq!(modify(&w, ud, &m), IbStatus::Success);
    assert_eq!(query(&w, ud).attr.qkey, Some(QKey::new(0x1234)));

    // GSI of port 2 at its fixed number; only once.
    let (status, gsi, created) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Gsi, Some(2)));
    assert_eq!(status, IbStatus::Success);
    assert_eq!(created.unwrap().qpn.get(), 3);
    let (status, _, _) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Gsi, Some(2)));
    assert_eq!(status, IbStatus::ResourceBusy);
    let (status, _, _) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Smi, Some(3)));
    assert_eq!(status, IbStatus::InvalidPort);

    // Unsupported for now: user QPs. A QP on an SRQ that does not exist:
    // refused. Too large: refused.
    let (status, _, _) = create(&w, USER, &s, &qp_create(&s, QpType::Rc, None));
    assert_ne!(status, IbStatus::Success);
    let with_srq = QpCreate {
        srq: Some(SrqHandle::from_raw(0x1_0000_0001)),
        caps: QpCaps {
            max_recv_wr: 0,
            max_recv_sge: 0,
            ..caps()
        },
        ..qp_create(&s, QpType::Rc, None)
    };
    assert_eq!(
        create(&w, KERNEL, &s, &with_srq).0,
        IbStatus::InvalidSrqHandle
    );
    let deep = QpCreate {
        caps: QpCaps {
            max_send_wr: 1 << 20,
            ..caps()
        },
        ..qp_create(&s, QpType::Rc, None)
    };
    assert_eq!(create(&w, KERNEL, &s, &deep).0, IbStatus::InvalidMaxWrs);
    let stale_cq = QpCreate {
        send_cq: CqHandle::from_raw(s.cq + (1 << 32)),
        ..qp_create(&s, QpType::Rc, None)
    };
    assert_eq!(
        create(&w, KERNEL, &s, &stale_cq).0,
        IbStatus::InvalidCqHandle
    );

    assert_eq!(destroy(&w, gsi), IbStatus::Success);
    assert_eq!(destroy(&w, ud), IbStatus::Success);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, s.cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, s.pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    w.finish();
}

type Region = hca_miniport_core::mr::MemoryRegion<sim_host::platform::SimPlatform>;

/// A test buffer: a common buffer of `PAGES` pages registered physically
/// (iova = bus address) through the verbs' translation service.
struct Mem {
    buffer: sim_host::dma::HostCommonBuffer,
    region: Region,
    hca: usize,
}

const MEM_BYTES: usize = 8192;

impl Mem {
    fn new(w: &World, pd: u64) -> Self {
        Self::new_at(w, 0, pd)
    }

    fn new_at(w: &World, i: usize, pd: u64) -> Self {
        use driver_platform::{CommonBuffer, DmaAdapter};
        let buffer = w.adapter_at(i).alloc_common(MEM_BYTES).unwrap();
        let bus = buffer.bus_address();
        let pages: Vec<u64> = (0..(MEM_BYTES / 4096) as u64)
            .map(|i| bus + i * 4096)
            .collect();
        let mt = w.hca_at(i).memory_translation().unwrap();
        let out = std::sync::Arc::new(std::sync::Mutex::new(None));
        let (hca, sink) = (w.hca_at(i), out.clone());
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
            mt.register_physical(
                &hca,
                request,
                Box::new(move |r| *support::lock(&sink) = Some(r)),
            );
        });
        w.settle();
        let region = support::lock(&out).take().unwrap().unwrap();
        Mem {
            buffer,
            region,
            hca: i,
        }
    }

    fn addr(&self, offset: usize) -> u64 {
        self.region.start() + offset as u64
    }

    fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge::new(self.addr(offset), len, self.region.lkey())
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
        let mt = w.hca_at(self.hca).memory_translation().unwrap();
        let out = std::sync::Arc::new(std::sync::Mutex::new(None));
        let (hca, sink, region) = (w.hca_at(self.hca), out.clone(), self.region);
        w.in_dpc(move || {
            mt.deregister(
                &hca,
                region,
                Box::new(move |r| *support::lock(&sink) = Some(r.is_ok())),
            );
        });
        w.settle();
        assert_eq!(support::lock(&out).take(), Some(true));
        w.adapter_at(self.hca).free_common(self.buffer);
    }
}

/// Deterministic, non-trivial bytes.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Polls everything the CQ holds, from a DPC.
fn poll_all(w: &World, cq: u64) -> Vec<WorkCompletion> {
    poll_all_at(w, 0, cq)
}

fn poll_all_at(w: &World, i: usize, cq: u64) -> Vec<WorkCompletion> {
    let out = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (hca, sink) = (w.hca_at(i), out.clone());
    w.in_dpc(move || {
        let mut wcs = [WorkCompletion::EMPTY; 4];
        loop {
            let n = hca.poll_cq(cq, &mut wcs).unwrap();
            if n == 0 {
                break;
            }
            support::lock(&sink).extend_from_slice(&wcs[..n]);
        }
    });
    w.settle();
    support::lock(&out).clone()
}

/// Posts sends from a DPC; returns (posted, status).
fn post_send(w: &World, qp: u64, wrs: Vec<SendWr<'static>>) -> (usize, IbStatus) {
    post_send_at(w, 0, qp, wrs, None)
}

/// Posts sends to a QP of HCA `i` from a DPC, with `av` for UD sends.
fn post_send_at(
    w: &World,
    i: usize,
    qp: u64,
    wrs: Vec<SendWr<'static>>,
    av: Option<hca_prm::av::Av>,
) -> (usize, IbStatus) {
    let out = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (hca, sink) = (w.hca_at(i), out.clone());
    w.in_dpc(move || {
        let requests: Vec<SendRequest<'_>> = wrs
            .iter()
            .map(|wr| SendRequest {
                wr: *wr,
                av: wr.ud.and(av),
                inline: None,
            })
            .collect();
        *support::lock(&sink) = Some(hca.post_send(qp, &requests));
    });
    w.settle();
    support::lock(&out).take().unwrap()
}

/// Posts receives from a DPC.
fn post_recv(w: &World, qp: u64, wrs: Vec<RecvWr<'static>>) -> (usize, IbStatus) {
    post_recv_at(w, 0, qp, wrs)
}

fn post_recv_at(w: &World, i: usize, qp: u64, wrs: Vec<RecvWr<'static>>) -> (usize, IbStatus) {
    let out = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (hca, sink) = (w.hca_at(i), out.clone());
    w.in_dpc(move || {
        *support::lock(&sink) = Some(hca.post_recv(qp, &wrs));
    });
    w.settle();
    support::lock(&out).take().unwrap()
}

/// One 8-byte SGE at the start of `mem`.
fn small_sge(mem: &Mem) -> &'static [Sge] {
    leak_sges(vec![mem.sge(0, 8)])
}

fn leak_sges(sges: Vec<Sge>) -> &'static [Sge] {
    Box::leak(sges.into_boxed_slice())
}

/// Connects `qp` on `port` to `dest` at `dest_ip` (RESET to RTS).
fn connect(w: &World, qp: u64, port: u8, dest: u32, dest_ip: [u8; 4]) {
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let init = QpModify {
        access: Some(access),
        ..to_init(port)
    };
    assert_eq!(modify(w, qp, &init), IbStatus::Success);
    let rtr = QpModify {
        av: Some(av_to(port, dest_ip)),
        ..to_rtr(dest)
    };
    assert_eq!(modify(w, qp, &rtr), IbStatus::Success);
    // Both sides use PSN 100 to receive and send.
    let rts = QpModify {
        sq_psn: Some(Psn::new(100).unwrap()),
        ..to_rts()
    };
    assert_eq!(modify(w, qp, &rts), IbStatus::Success);
}

#[test]
fn rc_traffic_between_ports_send_write_read_full_queue_and_flush_on_destroy() {
    let w = World::deterministic(33);
    let s = setup(&w);
    let a_mem = Mem::new(&w, s.pd);
    let b_mem = Mem::new(&w, s.pd);
    let (_, a, ca) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Rc, None));
    let (_, b, cb) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Rc, None));
    let (qpn_a, qpn_b) = (ca.unwrap().qpn.get(), cb.unwrap().qpn.get());

    // Posting before RTS fails at once; receives before INIT too.
    let send = |wr_id: u64, sges: &'static [Sge], op: SendOp| SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        sg_list: sges,
        ud: None,
    };
    let payload = pattern(7, 1000);
    a_mem.write(0, &payload);
    let a_sge = leak_sges(vec![a_mem.sge(0, 1000)]);
    assert_eq!(
        post_send(&w, a, vec![send(1, a_sge, SendOp::Send)]),
        (0, IbStatus::InvalidQpState)
    );
    let b_sge = leak_sges(vec![b_mem.sge(0, 1024)]);
    let recv = |wr_id: u64, sges: &'static [Sge]| RecvWr {
        wr_id,
        sg_list: sges,
    };
    assert_eq!(
        post_recv(&w, b, vec![recv(9, b_sge)]),
        (0, IbStatus::InvalidQpState)
    );

    connect(&w, a, 1, qpn_b, [10, 0, 1, 1]);
    connect(&w, b, 2, qpn_a, [10, 0, 0, 1]);

    // SEND: one receive consumed, bytes equal.
    assert_eq!(
        post_recv(&w, b, vec![recv(100, b_sge)]),
        (1, IbStatus::Success)
    );
    assert_eq!(
        post_send(&w, a, vec![send(7, a_sge, SendOp::Send)]),
        (1, IbStatus::Success)
    );
    let wcs = poll_all(&w, s.cq);
    assert_eq!(wcs.len(), 2, "{wcs:?}");
    let sent = wcs.iter().find(|wc| wc.qp_num.get() == qpn_a).unwrap();
    let got = wcs.iter().find(|wc| wc.qp_num.get() == qpn_b).unwrap();
    assert_eq!((sent.wr_id, sent.status), (7, WcStatus::Success));
    assert_eq!(
        (got.wr_id, got.status, got.byte_len),
        (100, WcStatus::Success, 1000)
    );
    assert_eq!(b_mem.read(0, 1000), payload);

    // RDMA write into B at 4096, RDMA read of B's 0..256 into A at 6000.
    let written = pattern(99, 700);
    a_mem.write(2048, &written);
    let w_sge = leak_sges(vec![a_mem.sge(2048, 700)]);
    let r_sge = leak_sges(vec![a_mem.sge(6000, 256)]);
    let write = SendOp::RdmaWrite {
        remote: RemoteAddr {
            addr: b_mem.addr(4096),
            rkey: b_mem.region.rkey(),
        },
    };
    let read = SendOp::RdmaRead {
        remote: RemoteAddr {
            addr: b_mem.addr(0),
            rkey: b_mem.region.rkey(),
        },
    };
    assert_eq!(
        post_send(&w, a, vec![send(20, w_sge, write), send(21, r_sge, read)]),
        (2, IbStatus::Success)
    );
    let wcs = poll_all(&w, s.cq);
    let ids: Vec<(u64, WcStatus)> = wcs.iter().map(|wc| (wc.wr_id, wc.status)).collect();
    assert_eq!(ids, vec![(20, WcStatus::Success), (21, WcStatus::Success)]);
    assert_eq!(b_mem.read(4096, 700), written);
    assert_eq!(a_mem.read(6000, 256), b_mem.read(0, 256));

    // A bad WR in the middle of a batch (more SGEs than granted; then a UD
    // destination on an RC QP): the earlier WRs stay posted and complete,
    // nothing after the bad one is posted.
    let many = leak_sges(vec![a_mem.sge(0, 8); 40]);
    let bad_sges = send(41, many, write);
    let (posted, status) = post_send(
        &w,
        a,
        vec![
            send(40, small_sge(&a_mem), write),
            bad_sges,
            send(42, small_sge(&a_mem), write),
        ],
    );
    assert_eq!((posted, status), (1, IbStatus::InvalidMaxSge));
    let wcs = poll_all(&w, s.cq);
    let ids: Vec<(u64, WcStatus)> = wcs.iter().map(|wc| (wc.wr_id, wc.status)).collect();
    assert_eq!(ids, vec![(40, WcStatus::Success)]);
    let with_ud = SendWr {
        ud: Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(qpn_b).unwrap(),
            remote_qkey: QKey::new(1),
        }),
        ..send(51, small_sge(&a_mem), SendOp::Send)
    };
    let (posted, status) = post_send(&w, a, vec![send(50, small_sge(&a_mem), write), with_ud]);
    assert_eq!((posted, status), (1, IbStatus::InvalidParameter));
    let wcs = poll_all(&w, s.cq);
    assert_eq!(wcs.iter().map(|wc| wc.wr_id).collect::<Vec<_>>(), vec![50]);

    // A full queue: the WR that does not fit fails, the earlier ones stay
    // posted and complete with their own wr_ids.
    let small = leak_sges(vec![a_mem.sge(0, 8)]);
    let wrs: Vec<SendWr<'static>> = (0..100).map(|i| send(1000 + i, small, write)).collect();
    let (posted, status) = post_send(&w, a, wrs);
    assert_eq!(status, IbStatus::InsufficientResources);
    assert!((16..100).contains(&posted), "{posted}");
    let wcs = poll_all(&w, s.cq);
    let ids: Vec<u64> = wcs.iter().map(|wc| wc.wr_id).collect();
    assert_eq!(ids, (1000..1000 + posted as u64).collect::<Vec<_>>());
    assert!(wcs.iter().all(|wc| wc.status == WcStatus::Success));

    // Destroy with receives outstanding: each is flushed with its wr_id.
    let wrs: Vec<RecvWr<'static>> = (0..5).map(|i| recv(500 + i, b_sge)).collect();
    assert_eq!(post_recv(&w, b, wrs), (5, IbStatus::Success));
    assert_eq!(destroy(&w, b), IbStatus::Success);
    let wcs = poll_all(&w, s.cq);
    let ids: Vec<(u64, WcStatus)> = wcs.iter().map(|wc| (wc.wr_id, wc.status)).collect();
    assert_eq!(
        ids,
        (500..505)
            .map(|i| (i, WcStatus::WrFlushErr))
            .collect::<Vec<_>>()
    );

    assert_eq!(destroy(&w, a), IbStatus::Success);
    a_mem.free(&w);
    b_mem.free(&w);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, s.cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    w.finish();
}

/// The IPv4 address of each port of the two HCAs of [`two_hcas`].
const HCA_IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];
const GUIDS: [u64; 2] = [0x0002_C900_0000_2000, 0x0002_C900_0000_3000];

/// A host with two two-port HCAs on one fabric; returns it and, for each
/// HCA in `GUIDS` order, its index in the world.
fn two_hcas(seed: u64) -> (World, [usize; 2]) {
    use sim_hca::device::DeviceConfig;
    let configs = vec![
        DeviceConfig::with_ports(GUIDS[0], &HCA_IPS[0]),
        DeviceConfig::with_ports(GUIDS[1], &HCA_IPS[1]),
    ];
    let w = World::with_hcas(seed, configs, hca_miniport_core::init::HcaConfig::default());
    let guid = |i: usize| w.hca_at(i).report().unwrap().capabilities.node_guid.get();
    let first = if guid(0) == GUIDS[0] { 0 } else { 1 };
    assert_eq!(guid(first), GUIDS[0]);
    assert_eq!(guid(1 - first), GUIDS[1]);
    (w, [first, 1 - first])
}

/// Connects `qp` of HCA `i` (port 1) to `dest` at `dest_ip`.
fn connect_at(w: &World, i: usize, qp: u64, dest: u32, dest_ip: [u8; 4]) {
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let init = QpModify {
        access: Some(access),
        ..to_init(1)
    };
    assert_eq!(modify_at(w, i, qp, &init), IbStatus::Success);
    let rtr = QpModify {
        av: Some(av_to(1, dest_ip)),
        ..to_rtr(dest)
    };
    assert_eq!(modify_at(w, i, qp, &rtr), IbStatus::Success);
    let rts = QpModify {
        sq_psn: Some(Psn::new(100).unwrap()),
        ..to_rts()
    };
    assert_eq!(modify_at(w, i, qp, &rts), IbStatus::Success);
}

#[test]
fn rc_and_ud_traffic_between_two_hcas_and_destroy_during_traffic() {
    let (w, [x, y]) = two_hcas(41);
    let (sx, sy) = (setup_at(&w, x), setup_at(&w, y));
    let (mx, my) = (Mem::new_at(&w, x, sx.pd), Mem::new_at(&w, y, sy.pd));
    let (_, a, ca) = create_at(&w, x, KERNEL, &sx, &qp_create(&sx, QpType::Rc, None));
    let (_, b, cb) = create_at(&w, y, KERNEL, &sy, &qp_create(&sy, QpType::Rc, None));
    let (qpn_a, qpn_b) = (ca.unwrap().qpn.get(), cb.unwrap().qpn.get());
    connect_at(&w, x, a, qpn_b, HCA_IPS[1][0]);
    connect_at(&w, y, b, qpn_a, HCA_IPS[0][0]);

    // SEND in each direction; bytes checked at the receiver.
    let send = |wr_id: u64, sges: &'static [Sge], op: SendOp| SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        sg_list: sges,
        ud: None,
    };
    let recv = |wr_id: u64, sges: &'static [Sge]| RecvWr {
        wr_id,
        sg_list: sges,
    };
    let to_b = pattern(3, 3000);
    mx.write(0, &to_b);
    let to_a = pattern(201, 1500);
    my.write(4096, &to_a);
    let rb = leak_sges(vec![my.sge(0, 1000), my.sge(1000, 3000)]);
    let ra = leak_sges(vec![mx.sge(4096, 2048)]);
    assert_eq!(
        post_recv_at(&w, y, b, vec![recv(11, rb)]),
        (1, IbStatus::Success)
    );
    assert_eq!(
        post_recv_at(&w, x, a, vec![recv(12, ra)]),
        (1, IbStatus::Success)
    );
    let sa = leak_sges(vec![mx.sge(0, 3000)]);
    let sb = leak_sges(vec![my.sge(4096, 1500)]);
    assert_eq!(
        post_send_at(&w, x, a, vec![send(21, sa, SendOp::Send)], None),
        (1, IbStatus::Success)
    );
    assert_eq!(
        post_send_at(&w, y, b, vec![send(22, sb, SendOp::Send)], None),
        (1, IbStatus::Success)
    );
    let mut at_x = poll_all_at(&w, x, sx.cq);
    let mut at_y = poll_all_at(&w, y, sy.cq);
    at_x.sort_by_key(|wc| wc.wr_id);
    at_y.sort_by_key(|wc| wc.wr_id);
    let summary = |wcs: &[WorkCompletion]| -> Vec<(u64, WcStatus, u32)> {
        wcs.iter()
            .map(|wc| (wc.wr_id, wc.status, wc.byte_len))
            .collect()
    };
    assert_eq!(
        summary(&at_x),
        vec![(12, WcStatus::Success, 1500), (21, WcStatus::Success, 3000)]
    );
    assert_eq!(
        summary(&at_y),
        vec![(11, WcStatus::Success, 3000), (22, WcStatus::Success, 1500)]
    );
    assert_eq!(my.read(0, 3000), to_b);
    assert_eq!(mx.read(4096, 1500), to_a);

    // Destroy during traffic: RDMA writes posted and the destroy issued in
    // the same DPC. Every WR completes exactly once, in order, with its own
    // wr_id: the ones the device finished first succeed, the rest flush.
    let src = leak_sges(vec![mx.sge(0, 2000)]);
    let write = SendOp::RdmaWrite {
        remote: RemoteAddr {
            addr: my.addr(2000),
            rkey: my.region.rkey(),
        },
    };
    // The first four complete before the destroy; their CQEs stay unpolled
    // in the CQ and must survive it.
    let early: Vec<SendWr<'static>> = (0..4).map(|i| send(300 + i, src, write)).collect();
    assert_eq!(post_send_at(&w, x, a, early, None), (4, IbStatus::Success));
    let wrs: Vec<SendWr<'static>> = (4..8).map(|i| send(300 + i, src, write)).collect();
    let posted = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (request, issuer) = w.request::<DestroyQp>(KERNEL, a, &Empty, 0);
    {
        let (hca, posted) = (w.hca_at(x), posted.clone());
        w.in_dpc(move || {
            let requests = support::plain_sends(&wrs);
            *support::lock(&posted) = Some(hca.post_send(a, &requests));
            hca.submit_request(request);
        });
    }
    w.settle();
    assert_eq!(*support::lock(&posted), Some((4, IbStatus::Success)));
    let done = issuer.completion().unwrap();
    assert_eq!(response::<DestroyQp>(&done).status, IbStatus::Success);
    let wcs = poll_all_at(&w, x, sx.cq);
    let ids: Vec<u64> = wcs.iter().map(|wc| wc.wr_id).collect();
    assert_eq!(ids, (300..308).collect::<Vec<_>>());
    let first_flush = wcs
        .iter()
        .position(|wc| wc.status != WcStatus::Success)
        .unwrap_or(wcs.len());
    assert!(first_flush >= 4, "{wcs:?}");
    assert!(
        wcs[first_flush..]
            .iter()
            .all(|wc| wc.status == WcStatus::WrFlushErr),
        "{wcs:?}"
    );
    assert_eq!(destroy_at(&w, y, b), IbStatus::Success);
    // B was connected to a destroyed QP; whatever it got is polled away.
    let _ = poll_all_at(&w, y, sy.cq);

    // UD between the HCAs: the address vector built directly (the AV verb
    // is separate); the receiver gets the 40-byte GRH first.
    let ud_create = |s: &Setup| qp_create(s, QpType::Ud, None);
    let (_, ua, ca) = create_at(&w, x, KERNEL, &sx, &ud_create(&sx));
    let (_, ub, cb) = create_at(&w, y, KERNEL, &sy, &ud_create(&sy));
    let (qpn_ua, qpn_ub) = (ca.unwrap().qpn.get(), cb.unwrap().qpn.get());
    for (i, qp) in [(x, ua), (y, ub)] {
        let init = QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(PortNum::new(1).unwrap()),
            qkey: Some(QKey::new(0x1111)),
            ..QpModify::default()
        };
        assert_eq!(modify_at(&w, i, qp, &init), IbStatus::Success);
        assert_eq!(
            modify_at(&w, i, qp, &QpModify::to_state(QpState::Rtr)),
            IbStatus::Success
        );
        let rts = QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(5).unwrap()),
            ..QpModify::default()
        };
        assert_eq!(modify_at(&w, i, qp, &rts), IbStatus::Success);
    }
    let datagram = pattern(77, 900);
    mx.write(6000, &datagram);
    let rud = leak_sges(vec![my.sge(5000, 40 + 1024)]);
    assert_eq!(
        post_recv_at(&w, y, ub, vec![recv(61, rud)]),
        (1, IbStatus::Success)
    );
    let av = hca_prm::av::Av::try_from(&av_to(1, HCA_IPS[1][0])).unwrap();
    let ud_send = SendWr {
        wr_id: 62,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: leak_sges(vec![mx.sge(6000, 900)]),
        ud: Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(qpn_ub).unwrap(),
            remote_qkey: QKey::new(0x1111),
        }),
    };
    assert_eq!(
        post_send_at(&w, x, ua, vec![ud_send], Some(av)),
        (1, IbStatus::Success)
    );
    let sent = poll_all_at(&w, x, sx.cq);
    assert_eq!(summary(&sent), vec![(62, WcStatus::Success, 900)]);
    let got = poll_all_at(&w, y, sy.cq);
    assert_eq!(summary(&got), vec![(61, WcStatus::Success, 940)]);
    assert_eq!(got[0].src_qp.get(), qpn_ua);
    assert_eq!(my.read(5040, 900), datagram);

    // A local protection error (a key whose tag is wrong) on a UD send
    // moves the QP to SQE, not ERR (PRM 10.5); the device raises no event
    // for it, so the core learns it from the completion.
    let good = mx.sge(6000, 16);
    let stale_key = Sge::new(
        good.addr.get(),
        16,
        ib_types::wr::LKey::new(good.lkey.get() ^ 0x01),
    );
    let bad_send = SendWr {
        wr_id: 63,
        sg_list: leak_sges(vec![stale_key]),
        ..ud_send
    };
    assert_eq!(
        post_send_at(&w, x, ua, vec![bad_send], Some(av)),
        (1, IbStatus::Success)
    );
    let failed = poll_all_at(&w, x, sx.cq);
    assert_eq!(summary(&failed)[0].0, 63);
    assert_eq!(failed[0].status, WcStatus::LocProtErr);
    let r = w.call_in_dpc_at::<QueryQp>(x, KERNEL, ua, &Empty, 0);
    let state = response::<QueryQp>(&r).output.unwrap().state;
    assert_eq!(state, QpState::Sqe);

    for (i, qp) in [(x, ua), (y, ub)] {
        assert_eq!(destroy_at(&w, i, qp), IbStatus::Success);
    }
    mx.free(&w);
    my.free(&w);
    for (i, s) in [(x, &sx), (y, &sy)] {
        let r = w.call_in_dpc_at::<DestroyCq>(i, KERNEL, s.cq, &Empty, 0);
        assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    }
    w.finish();
}

#[test]
fn a_destroyed_qps_number_is_reused_only_after_the_quiet_period() {
    use hca_miniport_core::verbs::qp::QPN_QUIET_PERIOD_NS;
    let config = hca_miniport_core::init::HcaConfig {
        max_log_qps: 3,
        ..hca_miniport_core::init::HcaConfig::default()
    };
    let w = World::with_hcas(43, vec![support::two_port_hca()], config);
    let s = setup(&w);
    // 8 numbers: 0..4 the two ports' special QPs, 4..8 general. Small
    // queues.
    let rc = QpCreate {
        caps: QpCaps {
            max_send_wr: 4,
            max_recv_wr: 4,
            ..caps()
        },
        ..qp_create(&s, QpType::Rc, None)
    };
    let mut live = Vec::new();
    for _ in 0..4 {
        let (status, qp, created) = create(&w, KERNEL, &s, &rc);
        assert_eq!(status, IbStatus::Success);
        live.push((qp, created.unwrap().qpn.get()));
    }
    let mut numbers: Vec<u32> = live.iter().map(|(_, n)| *n).collect();
    numbers.sort_unstable();
    assert_eq!(numbers, vec![4, 5, 6, 7]);
    assert_eq!(
        create(&w, KERNEL, &s, &rc).0,
        IbStatus::InsufficientResources
    );

    // Destroyed, the number waits out the quiet period.
    let (first, first_qpn) = live.remove(0);
    assert_eq!(destroy(&w, first), IbStatus::Success);
    assert_eq!(
        create(&w, KERNEL, &s, &rc).0,
        IbStatus::InsufficientResources
    );
    w.host.scheduler().advance(QPN_QUIET_PERIOD_NS / 2).unwrap();
    assert_eq!(
        create(&w, KERNEL, &s, &rc).0,
        IbStatus::InsufficientResources
    );
    w.host.scheduler().advance(QPN_QUIET_PERIOD_NS / 2).unwrap();
    let (status, again, created) = create(&w, KERNEL, &s, &rc);
    assert_eq!(status, IbStatus::Success);
    assert_eq!(created.unwrap().qpn.get(), first_qpn);
    // The old handle stays stale though the number is back.
    assert_eq!(destroy(&w, first), IbStatus::InvalidQpHandle);

    assert_eq!(destroy(&w, again), IbStatus::Success);
    for (qp, _) in live {
        assert_eq!(destroy(&w, qp), IbStatus::Success);
    }
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, s.cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    w.finish();
}

/// The INIT a special QP takes: P_Key index and Q_Key only (its port is
/// fixed at create).
fn to_init_special() -> QpModify {
    QpModify {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        qkey: Some(QKey::new(0x8001_0000)),
        ..QpModify::default()
    }
}

/// Posts `wr_ids` as receives of one small SGE each to `qp` (in INIT),
/// all of which must be taken.
fn post_recvs(w: &World, qp: u64, mem: &Mem, wr_ids: impl IntoIterator<Item = u64>) {
    let wrs: Vec<RecvWr<'static>> = wr_ids
        .into_iter()
        .map(|wr_id| RecvWr {
            wr_id,
            sg_list: small_sge(mem),
        })
        .collect();
    let count = wrs.len();
    assert_eq!(post_recv(w, qp, wrs), (count, IbStatus::Success));
}

/// What a QP number's two incarnations must show when the first one's
/// flushed receives are polled after the second one was created at its
/// number and posted to (issue 9, defect 2; guide 6.5.4 note, 6.5.5
/// items 3 and 9, 8.2.3 item 2): the first one's `wr_id`s, none of the
/// second's, and the second's ring untouched: it still takes its full
/// depth, and its own flush later reports its own `wr_id`s.
fn check_reused_number(w: &World, s: &Setup, mem: &Mem, number: u32, old: u64, new: u64) {
    let polled = poll_all(w, s.cq);
    assert_eq!(
        polled.iter().map(|wc| wc.wr_id).collect::<Vec<_>>(),
        vec![100, 101, 102],
        "the destroyed QP's completions report its own wr_ids"
    );
    assert!(
        polled
            .iter()
            .all(|wc| wc.status == WcStatus::WrFlushErr && wc.qp_num.get() == number)
    );
    // 12 receives asked for: 16 granted, one posted before the poll.
    post_recvs(w, new, mem, 901..916);
    assert_eq!(
        post_recv(
            w,
            new,
            vec![RecvWr {
                wr_id: 999,
                sg_list: small_sge(mem)
            }]
        ),
        (0, IbStatus::InsufficientResources),
        "exactly the depth fits"
    );
    assert_eq!(destroy(w, new), IbStatus::Success);
    let flushed = poll_all(w, s.cq);
    assert_eq!(
        flushed.iter().map(|wc| wc.wr_id).collect::<Vec<_>>(),
        (900..916).collect::<Vec<_>>(),
        "the new QP's flush reports its own wr_ids"
    );
    assert_eq!(destroy(w, old), IbStatus::InvalidQpHandle);
}

#[test]
fn a_special_qps_late_completions_keep_their_wr_ids_when_its_number_is_reused_at_once() {
    let w = World::deterministic(45);
    let s = setup(&w);
    let mem = Mem::new(&w, s.pd);
    let gsi = qp_create(&s, QpType::Gsi, Some(1));
    let (status, old, created) = create(&w, KERNEL, &s, &gsi);
    assert_eq!(status, IbStatus::Success);
    let number = created.unwrap().qpn.get();
    assert_eq!(modify(&w, old, &to_init_special()), IbStatus::Success);
    post_recvs(&w, old, &mem, 100..103);
    // Destroyed with its flushed receives unpolled; special QPs have no
    // quiet period, so the number is taken again at once.
    assert_eq!(destroy(&w, old), IbStatus::Success);
    let (status, new, created) = create(&w, KERNEL, &s, &gsi);
    assert_eq!(status, IbStatus::Success);
    assert_eq!(created.unwrap().qpn.get(), number);
    assert_eq!(modify(&w, new, &to_init_special()), IbStatus::Success);
    post_recvs(&w, new, &mem, [900]);
    check_reused_number(&w, &s, &mem, number, old, new);
    mem.free(&w);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, s.cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    w.finish();
}

#[test]
fn a_general_qps_late_completions_keep_their_wr_ids_when_its_number_is_reused_after_the_quiet_period()
 {
    use hca_miniport_core::verbs::qp::QPN_QUIET_PERIOD_NS;
    let config = hca_miniport_core::init::HcaConfig {
        max_log_qps: 3,
        ..hca_miniport_core::init::HcaConfig::default()
    };
    let w = World::with_hcas(46, vec![support::two_port_hca()], config);
    let s = setup(&w);
    let mem = Mem::new(&w, s.pd);
    // The four general numbers all taken, so the next create must reuse
    // the destroyed one's.
    let rc = qp_create(&s, QpType::Rc, None);
    let mut others = Vec::new();
    for _ in 0..3 {
        let (status, qp, _) = create(&w, KERNEL, &s, &rc);
        assert_eq!(status, IbStatus::Success);
        others.push(qp);
    }
    let (status, old, created) = create(&w, KERNEL, &s, &rc);
    assert_eq!(status, IbStatus::Success);
    let number = created.unwrap().qpn.get();
    assert_eq!(modify(&w, old, &to_init(1)), IbStatus::Success);
    post_recvs(&w, old, &mem, 100..103);
    assert_eq!(destroy(&w, old), IbStatus::Success);
    w.host.scheduler().advance(QPN_QUIET_PERIOD_NS).unwrap();
    let (status, new, created) = create(&w, KERNEL, &s, &rc);
    assert_eq!(status, IbStatus::Success);
    assert_eq!(created.unwrap().qpn.get(), number);
    assert_eq!(modify(&w, new, &to_init(1)), IbStatus::Success);
    post_recvs(&w, new, &mem, [900]);
    check_reused_number(&w, &s, &mem, number, old, new);
    for qp in others {
        assert_eq!(destroy(&w, qp), IbStatus::Success);
    }
    mem.free(&w);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, s.cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    w.finish();
}
