//! Helpers the power and catastrophic-error tests share: two HCAs on one
//! fabric, a recording client, registered memory, posting and polling from
//! DPCs, QP creation and connection through the verbs.

#![allow(dead_code, reason = "each test binary uses part of the kit")]

use std::sync::{Arc, Mutex};

use driver_platform::{Irql, RequestorMode};
use hca_miniport_core::verbs::CaClient;
use hca_miniport_core::verbs::qp::SendRequest;
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::cq::CqAttr;
use ib_types::event::AsyncEventRecord;
use ib_types::handle::{CqHandle, PdHandle, SrqHandle};
use ib_types::ioctl::{AllocPd, CreateCq, CreateQp, CreateSrq, Empty, ModifyQp, QueryQp};
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{PortNum, Psn, QKey};
use ib_types::srq::{SrqAttr, SrqCreate};
use ib_types::status::IbStatus;
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendWr, Sge};

use crate::support::{self, World, lock, response};

pub(crate) const KERNEL: RequestorMode = RequestorMode::Kernel;

/// The IPv4 address of each port of the two HCAs.
pub(crate) const HCA_IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];
const GUIDS: [u64; 2] = [0x0002_C900_0000_2000, 0x0002_C900_0000_3000];

/// A host with two two-port HCAs on one fabric; returns it and, for each
/// HCA in `GUIDS` order, its index in the world.
pub(crate) fn two_hcas(
    seed: u64,
    config: hca_miniport_core::init::HcaConfig,
) -> (World, [usize; 2]) {
    use sim_hca::device::DeviceConfig;
    let configs = vec![
        DeviceConfig::with_ports(GUIDS[0], &HCA_IPS[0]),
        DeviceConfig::with_ports(GUIDS[1], &HCA_IPS[1]),
    ];
    let w = World::with_hcas(seed, configs, config);
    let guid = |i: usize| w.hca_at(i).report().unwrap().capabilities.node_guid.get();
    let first = if guid(0) == GUIDS[0] { 0 } else { 1 };
    assert_eq!(guid(1 - first), GUIDS[1]);
    (w, [first, 1 - first])
}

/// A client recording its callbacks with the IRQL they came at.
#[derive(Default)]
pub(crate) struct Client {
    pub(crate) events: Mutex<Vec<(AsyncEventRecord, Irql)>>,
    pub(crate) completions: Mutex<Vec<(u64, Irql)>>,
}

impl CaClient for Client {
    fn completion(&self, cq: CqHandle) {
        lock(&self.completions).push((cq.raw(), sim_host::irql::current()));
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.events).push((*event, sim_host::irql::current()));
    }
}

impl Client {
    /// The asynchronous events of `code` so far: (handle, IRQL).
    pub(crate) fn events_of(&self, code: ib_types::event::AsyncEventCode) -> Vec<(u64, Irql)> {
        lock(&self.events)
            .iter()
            .filter(|(e, _)| e.code == code)
            .map(|(e, irql)| (e.handle, *irql))
            .collect()
    }
}

/// One HCA's CA (with a recording client), PD and CQ.
pub(crate) struct Side {
    pub(crate) i: usize,
    pub(crate) client: Arc<Client>,
    pub(crate) ca: u64,
    pub(crate) pd: u64,
    pub(crate) cq: u64,
}

pub(crate) fn side(w: &World, i: usize) -> Side {
    let client = Arc::new(Client::default());
    let ca = w.hca_at(i).open_ca(Some(client.clone())).unwrap();
    let r = w.call_in_dpc_at::<AllocPd>(i, KERNEL, ca, &Empty, 0);
    let pd = response::<AllocPd>(&r).handle;
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let r = w.call_in_dpc_at::<CreateCq>(i, KERNEL, ca, &attr, 0);
    let cq = response::<CreateCq>(&r).handle;
    assert_ne!(cq, 0);
    Side {
        i,
        client,
        ca,
        pd,
        cq,
    }
}

/// Creates an SRQ of `depth` one-SGE receives.
pub(crate) fn create_srq(w: &World, s: &Side, depth: u32, limit: u32) -> u64 {
    let create = SrqCreate {
        pd: PdHandle::from_raw(s.pd),
        attr: SrqAttr {
            max_wr: depth,
            max_sge: 1,
            srq_limit: limit,
        },
    };
    let r = w.call_in_dpc_at::<CreateSrq>(s.i, KERNEL, s.ca, &create, 0);
    let resp = response::<CreateSrq>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    resp.handle
}

/// Creates a QP of `qp_type` on `s`'s PD and CQ (on `srq` if given);
/// returns its handle and number.
pub(crate) fn create_qp(w: &World, s: &Side, qp_type: QpType, srq: Option<u64>) -> (u64, u32) {
    let input = QpCreate {
        qp_type,
        pd: PdHandle::from_raw(s.pd),
        send_cq: CqHandle::from_raw(s.cq),
        recv_cq: CqHandle::from_raw(s.cq),
        srq: srq.map(SrqHandle::from_raw),
        caps: QpCaps {
            max_send_wr: 8,
            max_recv_wr: if srq.is_some() { 0 } else { 8 },
            max_send_sge: 1,
            max_recv_sge: if srq.is_some() { 0 } else { 1 },
            max_inline_data: 0,
        },
        sq_sig_all: false,
        port: None,
    };
    let r = w.call_in_dpc_at::<CreateQp>(s.i, KERNEL, s.ca, &input, 0);
    let resp = response::<CreateQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    (resp.handle, resp.output.unwrap().qpn.get())
}

pub(crate) fn modify(w: &World, i: usize, qp: u64, m: &QpModify) -> IbStatus {
    let r = w.call_in_dpc_at::<ModifyQp>(i, KERNEL, qp, m, 0);
    response::<ModifyQp>(&r).status
}

pub(crate) fn qp_state(w: &World, i: usize, qp: u64) -> QpState {
    let r = w.call_in_dpc_at::<QueryQp>(i, KERNEL, qp, &Empty, 0);
    let resp = response::<QueryQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    resp.output.unwrap().state
}

pub(crate) fn av_to(ip: [u8; 4]) -> AvAttr {
    support::rc_path::grh_av(1, ip)
}

/// RESET -> INIT -> RTR -> RTS of an RC QP of HCA `i` (port 1) towards
/// `dest` at `dest_ip`.
pub(crate) fn connect(w: &World, i: usize, qp: u64, dest: u32, dest_ip: [u8; 4]) {
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    for m in support::rc_path::rc_to_rts_steps(1, access, dest, dest_ip, 4) {
        assert_eq!(modify(w, i, qp, &m), IbStatus::Success);
    }
}

/// RESET -> INIT -> RTR -> RTS of a UD QP of HCA `i` (port 1, Q_Key `qkey`).
pub(crate) fn ud_to_rts(w: &World, i: usize, qp: u64, qkey: u32) {
    let init = QpModify {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(PortNum::new(1).unwrap()),
        qkey: Some(QKey::new(qkey)),
        ..QpModify::default()
    };
    assert_eq!(modify(w, i, qp, &init), IbStatus::Success);
    assert_eq!(
        modify(w, i, qp, &QpModify::to_state(QpState::Rtr)),
        IbStatus::Success
    );
    let rts = QpModify {
        state: Some(QpState::Rts),
        sq_psn: Some(Psn::new(5).unwrap()),
        ..QpModify::default()
    };
    assert_eq!(modify(w, i, qp, &rts), IbStatus::Success);
}

pub(crate) type Region = hca_miniport_core::mr::MemoryRegion<sim_host::platform::SimPlatform>;

/// A common buffer of HCA `i` registered physically (iova = bus address).
pub(crate) struct Mem {
    pub(crate) buffer: sim_host::dma::HostCommonBuffer,
    pub(crate) region: Region,
    pub(crate) i: usize,
}

pub(crate) const MEM_BYTES: usize = 8192;

impl Mem {
    pub(crate) fn new(w: &World, i: usize, pd: u64) -> Self {
        Self::with_access(
            w,
            i,
            pd,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
    }

    pub(crate) fn with_access(w: &World, i: usize, pd: u64, access: AccessFlags) -> Self {
        use driver_platform::{CommonBuffer, DmaAdapter};
        let buffer = w.adapter_at(i).alloc_common(MEM_BYTES).unwrap();
        let bus = buffer.bus_address();
        let pages: Vec<u64> = (0..(MEM_BYTES / 4096) as u64)
            .map(|p| bus + p * 4096)
            .collect();
        let mt = w.hca_at(i).memory_translation().unwrap();
        let out = Arc::new(Mutex::new(None));
        let (hca, sink) = (w.hca_at(i), out.clone());
        let pd_number = support::number_of(pd);
        w.in_dpc(move || {
            let request = hca_miniport_core::mr::PhysicalRegion {
                iova: bus,
                length: MEM_BYTES as u64,
                first_byte_offset: 0,
                page_shift: 12,
                pages: &pages,
                access,
                pd: pd_number,
            };
            mt.register_physical(&hca, request, Box::new(move |r| *lock(&sink) = Some(r)));
        });
        w.settle();
        let region = lock(&out).take().unwrap().unwrap();
        Mem { buffer, region, i }
    }

    pub(crate) fn addr(&self, offset: usize) -> u64 {
        self.region.start() + offset as u64
    }

    pub(crate) fn sge(&self, offset: usize, len: u32) -> &'static [Sge] {
        leak(vec![Sge::new(self.addr(offset), len, self.region.lkey())])
    }

    pub(crate) fn write(&self, offset: usize, bytes: &[u8]) {
        use driver_platform::CommonBuffer;
        assert!(self.buffer.write(offset, bytes));
    }

    pub(crate) fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        use driver_platform::CommonBuffer;
        let mut out = vec![0; len];
        assert!(self.buffer.read(offset, &mut out));
        out
    }

    /// The device's view of the region's MPT entry (`QUERY_MPT`).
    pub(crate) fn query(&self, w: &World) -> hca_miniport_core::mr::MptQuery {
        let mt = w.hca_at(self.i).memory_translation().unwrap();
        let out = Arc::new(Mutex::new(None));
        let sink = out.clone();
        mt.query(
            &w.hca_at(self.i),
            &self.region,
            Box::new(move |r| *lock(&sink) = Some(r)),
        );
        w.settle();
        lock(&out).take().unwrap().unwrap()
    }

    /// Deregisters (checked to succeed) and frees the buffer.
    pub(crate) fn free(self, w: &World) {
        let mt = w.hca_at(self.i).memory_translation().unwrap();
        let out = Arc::new(Mutex::new(None));
        let (hca, sink, region) = (w.hca_at(self.i), out.clone(), self.region);
        w.in_dpc(move || {
            mt.deregister(
                &hca,
                region,
                Box::new(move |r| *lock(&sink) = Some(r.is_ok())),
            );
        });
        w.settle();
        assert_eq!(lock(&out).take(), Some(true));
        w.adapter_at(self.i).free_common(self.buffer);
    }
}

pub(crate) fn leak<T>(items: Vec<T>) -> &'static [T] {
    Box::leak(items.into_boxed_slice())
}

/// Deterministic, non-trivial bytes.
pub(crate) fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Polls everything the CQ of HCA `i` holds, from a DPC.
pub(crate) fn poll_all(w: &World, i: usize, cq: u64) -> Vec<WorkCompletion> {
    let out = Arc::new(Mutex::new(Vec::new()));
    let (hca, sink) = (w.hca_at(i), out.clone());
    w.in_dpc(move || {
        let mut wcs = [WorkCompletion::EMPTY; 4];
        while let Ok(n @ 1..) = hca.poll_cq(cq, &mut wcs) {
            lock(&sink).extend_from_slice(&wcs[..n]);
        }
    });
    w.settle();
    lock(&out).clone()
}

/// Posts sends to a QP of HCA `i` from a DPC, with `av` for UD sends.
pub(crate) fn post_send(
    w: &World,
    i: usize,
    qp: u64,
    wrs: Vec<SendWr<'static>>,
    av: Option<hca_prm::av::Av>,
) -> (usize, IbStatus) {
    let out = Arc::new(Mutex::new(None));
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
        *lock(&sink) = Some(hca.post_send(qp, &requests));
    });
    w.settle();
    lock(&out).take().unwrap()
}

/// Posts receives to a QP of HCA `i` from a DPC.
pub(crate) fn post_recv(
    w: &World,
    i: usize,
    qp: u64,
    wrs: Vec<RecvWr<'static>>,
) -> (usize, IbStatus) {
    let out = Arc::new(Mutex::new(None));
    let (hca, sink) = (w.hca_at(i), out.clone());
    w.in_dpc(move || *lock(&sink) = Some(hca.post_recv(qp, &wrs)));
    w.settle();
    lock(&out).take().unwrap()
}

/// Posts receives to an SRQ of HCA `i` from a DPC.
pub(crate) fn post_srq(
    w: &World,
    i: usize,
    srq: u64,
    wrs: Vec<RecvWr<'static>>,
) -> (u32, IbStatus) {
    let out = Arc::new(Mutex::new(None));
    let (hca, sink) = (w.hca_at(i), out.clone());
    w.in_dpc(move || *lock(&sink) = Some(hca.post_srq_recv(srq, &wrs)));
    w.settle();
    lock(&out).take().unwrap()
}

/// (wr_id, status, byte_len) of each completion.
pub(crate) fn summary(wcs: &[WorkCompletion]) -> Vec<(u64, ib_types::wc::WcStatus, u32)> {
    wcs.iter()
        .map(|wc| (wc.wr_id, wc.status, wc.byte_len))
        .collect()
}
