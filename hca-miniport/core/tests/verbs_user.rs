//! User-mode resources on the simulated host: a test-side "user process"
//! makes the proxy calls of the user-mode verbs provider (UVP). It opens a
//! user context (its doorbell page mapped into the process), creates CQs
//! and QPs whose rings live in its own memory (`hca_prm::uverbs` private
//! data), and moves data with the shipped provider's fast path
//! (`uvp_plugin`: WQEs into its rings, its own doorbell page, CQEs polled
//! from its memory), while a kernel client drives a QP on the other HCA. Hostile private data, foreign handles and another process's
//! doorbell page are refused; close with live objects leaves nothing
//! behind. Each test ends with the host shut down and the verifier clean.

mod support;

use std::sync::{Arc, Mutex};

use driver_platform::{Mmio, RequestorMode};
use hca_miniport_core::mr::MemoryRegion;
use hca_miniport_core::verbs::qp::SendRequest;
use hca_prm::doorbell::{SQ_DOORBELL, SqDoorbell};
use hca_prm::uverbs::{CreateCqPriv, CreateCqPrivOut, CreateQpPriv, CreateQpPrivOut, OpenCaPriv};
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::cq::CqAttr;
use ib_types::handle::PdHandle;
use ib_types::ioctl::{
    AllocPd, CloseCa, CreateAv, CreateCq, CreateQp, DeallocPd, DestroyCq, DestroyQp, Empty,
    ModifyQp, OpenCa, OpenCaIn, QueryCq, QueryQp, Verb,
};
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, PortNum, Psn, QKey, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{RecvWr, SendFlags, SendOp, SendWr, Sge};
use sim_hca::device::DeviceConfig;
use sim_host::caller::HostCaller;
use sim_host::memory::Process;
use sim_host::platform::SimPlatform;
use support::rc_path::rc_to_rts_steps;
use support::{World, response};
use zerocopy::IntoBytes;

const KERNEL: RequestorMode = RequestorMode::Kernel;

const IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];
const GUIDS: [u64; 2] = [0x0002_C900_0000_2000, 0x0002_C900_0000_3000];

/// Two HCAs on one fabric; returns the world and each index's port-1 IP.
fn two_hcas(seed: u64) -> (World, [[u8; 4]; 2]) {
    let configs = vec![
        DeviceConfig::with_ports(GUIDS[0], &IPS[0]),
        DeviceConfig::with_ports(GUIDS[1], &IPS[1]),
    ];
    let w = World::with_hcas(seed, configs, hca_miniport_core::init::HcaConfig::default());
    let ip = |i: usize| {
        let guid = w.hca_at(i).report().unwrap().capabilities.node_guid.get();
        if guid == GUIDS[0] {
            IPS[0][0]
        } else {
            IPS[1][0]
        }
    };
    let ips = [ip(0), ip(1)];
    (w, ips)
}

/// Deterministic, non-trivial bytes.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

fn status_of<V: Verb>(c: &sim_host::request::Completion) -> IbStatus {
    response::<V>(c).status
}

/// The user HCA.
const U: usize = 0;
/// The kernel client's HCA.
const K: usize = 1;

/// One process's user context: its proxy calls, and the shipped
/// provider's fast path (`uvp_plugin`) for its rings.
struct Uvp {
    caller: HostCaller,
    ca: u64,
    doorbell: u64,
    uar: u32,
    fast: uvp_plugin::Context,
}

/// A user memory region.
struct UserMr {
    handle: u64,
    lkey: ib_types::wr::LKey,
}

/// A user CQ: ring and consumer record in the process, polled by the
/// provider.
struct UserCq {
    handle: u64,
    log: u8,
    ring: u64,
    dbr: u64,
    fast: uvp_plugin::Cq,
}

/// A user QP: rings and receive record in the process, posted to by the
/// provider.
struct UserQp {
    handle: u64,
    qpn: u32,
    /// Receives posted so far (which buffer slot the next one takes).
    recvs_posted: u32,
    fast: uvp_plugin::Qp,
}

impl Uvp {
    fn process(&self) -> &Process {
        self.caller.process()
    }

    fn open(w: &World, pid: u32) -> Self {
        let process = Process::new(pid);
        let caller = HostCaller::new(w.host.pool().kernel_space(), &process);
        let c = w.user_call_at::<OpenCa>(U, &caller, 0, &OpenCaIn::CURRENT, &[], 64);
        let r = response::<OpenCa>(&c);
        assert_eq!(r.status, IbStatus::Success);
        let out = r.output.unwrap();
        let private = OpenCaPriv::parse(r.private).unwrap();
        let doorbell = out.doorbell.expect("a user open maps a doorbell page");
        assert_eq!(doorbell.size, 4096);
        assert_ne!(private.uar_index, 0, "never the kernel's page");
        // The simulator's side of the provider's MMIO primitive: a store
        // to the mapped page reaches the device in the calling thread.
        let mapped = process.clone();
        let hook = Arc::new(move |address: u64, value: u64| {
            let _ = mapped.write_device64(address, value);
        });
        Self {
            caller,
            ca: r.handle,
            doorbell: doorbell.va,
            uar: private.uar_index,
            fast: uvp_plugin::Context::new(
                private,
                uvp_plugin::UarPage::simulated(doorbell.va, hook),
            ),
        }
    }

    fn call<V: Verb>(
        &self,
        w: &World,
        handle: u64,
        input: &V::In,
        private: &[u8],
    ) -> sim_host::request::Completion {
        w.user_call_at::<V>(U, &self.caller, handle, input, private, 64)
    }

    /// Makes one call without private data and asserts its status.
    #[track_caller]
    fn expect<V: Verb>(&self, w: &World, handle: u64, input: &V::In, status: IbStatus) {
        assert_eq!(
            status_of::<V>(&self.call::<V>(w, handle, input, &[])),
            status
        );
    }

    fn alloc_pd(&self, w: &World) -> u64 {
        let c = self.call::<AllocPd>(w, self.ca, &Empty, &[]);
        let r = response::<AllocPd>(&c);
        assert_eq!(r.status, IbStatus::Success);
        r.handle
    }

    fn create_cq(&self, w: &World, log: u8) -> UserCq {
        let ring = self.process().alloc(32 << log).unwrap();
        let dbr = self.process().alloc(64).unwrap();
        let layout = CreateCqPriv::new(log, ring, dbr).unwrap();
        let attr = CqAttr {
            cqe: 1 << log,
            comp_vector: 0,
        };
        let c = self.call::<CreateCq>(w, self.ca, &attr, layout.emit().as_bytes());
        let r = response::<CreateCq>(&c);
        assert_eq!(r.status, IbStatus::Success);
        assert_eq!(r.output.unwrap().cqe, 1 << log);
        let out = CreateCqPrivOut::parse(r.private).unwrap();
        assert_eq!(out.log_entries, log);
        // SAFETY: the ring and record are allocations of this process,
        // which outlives the CQ; its frames are atomic words, and the
        // device reaches them by DMA only.
        let fast = unsafe { self.fast.cq(&layout, &out) }.unwrap();
        UserCq {
            handle: r.handle,
            log,
            ring,
            dbr,
            fast,
        }
    }

    /// An RC or UD QP with 8 one-BB send WQEs and 8 32-byte receives.
    fn create_qp(&self, w: &World, qp_type: QpType, pd: u64, cq: &UserCq) -> UserQp {
        let (sq_log_bbs, log_wqe_bbs) = match qp_type {
            QpType::Ud => (4, 1),
            _ => (3, 0),
        };
        let sq = self.process().alloc(64 << sq_log_bbs).unwrap();
        let rq = self.process().alloc(32 << 3).unwrap();
        let rq_dbr = self.process().alloc(64).unwrap();
        let layout =
            CreateQpPriv::new(sq_log_bbs, log_wqe_bbs, sq, Some((3, 5, rq, rq_dbr))).unwrap();
        let input = qp_create(qp_type, pd, cq.handle);
        let c = self.call::<CreateQp>(w, self.ca, &input, layout.emit().as_bytes());
        let r = response::<CreateQp>(&c);
        assert_eq!(r.status, IbStatus::Success, "{qp_type:?}");
        let created = r.output.unwrap();
        let out = CreateQpPrivOut::parse(r.private).unwrap();
        assert_eq!(out.qpn, created.qpn.get());
        assert_eq!(out.uar_index, self.uar);
        assert_eq!(created.caps.max_send_wr, 8);
        assert_eq!(created.caps.max_recv_wr, 8);
        let created = uvp_plugin::QpCreated {
            qp_type,
            caps: created.caps,
            private: out,
        };
        // SAFETY: as for `create_cq`.
        let fast = unsafe { self.fast.qp(&layout, &created, None) }.unwrap();
        UserQp {
            handle: r.handle,
            qpn: out.qpn,
            recvs_posted: 0,
            fast,
        }
    }

    fn modify(&self, w: &World, qp: u64, m: &QpModify) -> IbStatus {
        status_of::<ModifyQp>(&self.call::<ModifyQp>(w, qp, m, &[]))
    }

    /// Posts one receive (`wr_id` 0) with the provider: the WQE into the
    /// ring, then the record.
    fn post_recv(&self, qp: &mut UserQp, sges: &[Sge]) {
        let wr = RecvWr {
            wr_id: 0,
            sg_list: sges,
        };
        assert_eq!(qp.fast.recv_queue().unwrap().post(&[wr]), Ok(1));
        qp.recvs_posted += 1;
    }

    /// Posts one send with the provider: the WQE into the ring, then the
    /// SQ doorbell on this process's page.
    fn post_send(&self, qp: &mut UserQp, wr: &SendWr<'_>, av: Option<&hca_prm::av::Av>) {
        let request = uvp_plugin::SendRequest {
            wr: *wr,
            av: av.copied(),
            inline: None,
        };
        assert_eq!(qp.fast.send_queue().post(&[request]), Ok(1));
    }

    /// Rings the SQ doorbell for `qpn` with `producer` on this process's
    /// page, through the provider's MMIO primitive.
    fn ring(&self, qpn: u32, producer: u32) {
        let doorbell = SqDoorbell {
            qpn: Qpn::from_low_bits(qpn),
            producer,
        };
        assert!(self.fast.uar_page().write64(SQ_DOORBELL, doorbell.encode()));
    }

    /// Polls every completion the CQ holds with the provider.
    fn poll(&self, cq: &mut UserCq) -> Vec<WorkCompletion> {
        self.poll_at_most(cq, usize::MAX)
    }

    /// Polls at most `limit` completions with the provider (the rest stay
    /// in the ring, the consumer record saying so).
    fn poll_at_most(&self, cq: &mut UserCq, limit: usize) -> Vec<WorkCompletion> {
        let mut out = Vec::new();
        let mut batch = [WorkCompletion::EMPTY; 8];
        while out.len() < limit {
            let room = (limit - out.len()).min(batch.len());
            let n = cq.fast.poll(&mut batch[..room]);
            if n == 0 {
                break;
            }
            out.extend_from_slice(&batch[..n]);
        }
        assert_eq!(cq.fast.stray_completions(), 0);
        out
    }

    /// Registers `len` bytes of process memory with the user RegMr verb
    /// (the pages are locked in this process).
    fn register(&self, w: &World, pd: u64, va: u64, len: u64) -> UserMr {
        let input = ib_types::mr::MrRegister {
            vaddr: va,
            length: len,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        };
        let c = self.call::<ib_types::ioctl::RegMr>(w, pd, &input, &[]);
        let r = response::<ib_types::ioctl::RegMr>(&c);
        assert_eq!(r.status, IbStatus::Success);
        UserMr {
            handle: r.handle,
            lkey: r.output.unwrap().lkey,
        }
    }

    fn dereg(&self, w: &World, mr: &UserMr) {
        let c = self.call::<ib_types::ioctl::DeregMr>(w, mr.handle, &Empty, &[]);
        assert_eq!(status_of::<ib_types::ioctl::DeregMr>(&c), IbStatus::Success);
    }

    fn close(&self, w: &World) -> IbStatus {
        status_of::<CloseCa>(&self.call::<CloseCa>(w, self.ca, &Empty, &[]))
    }
}

fn deregister(w: &World, i: usize, region: MemoryRegion<SimPlatform>) {
    let mt = w.hca_at(i).memory_translation().unwrap();
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    mt.deregister(
        &w.hca_at(i),
        region,
        Box::new(move |r| *support::lock(&sink) = Some(r.is_ok())),
    );
    w.settle();
    assert_eq!(support::lock(&out).take(), Some(true));
}

fn qp_create(qp_type: QpType, pd: u64, cq: u64) -> QpCreate {
    support::small_qp_create(qp_type, pd, cq)
}

fn av_to(ip: [u8; 4]) -> AvAttr {
    support::rc_path::grh_av(1, ip)
}

/// RESET to RTS for an RC QP, or to RTS for a UD QP with Q_Key 0x11.
fn to_rts(qp_type: QpType, dest: u32, dest_ip: [u8; 4]) -> Vec<QpModify> {
    let init = QpModify {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(PortNum::FIRST),
        ..QpModify::default()
    };
    match qp_type {
        QpType::Ud => vec![
            QpModify {
                qkey: Some(QKey::new(0x11)),
                ..init
            },
            QpModify::to_state(QpState::Rtr),
            QpModify {
                sq_psn: Some(Psn::new(1).unwrap()),
                ..QpModify::to_state(QpState::Rts)
            },
        ],
        _ => rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, dest, dest_ip, 1).to_vec(),
    }
}

/// Takes a user RC QP (`(handle, qpn)`) and the kernel's RC QP to RTS,
/// each aimed at the other.
#[track_caller]
fn connect_rc(w: &World, uvp: &Uvp, (qp, qpn): (u64, u32), k: &Kernel, ips: [[u8; 4]; 2]) {
    for m in to_rts(QpType::Rc, k.qpn, ips[K]) {
        assert_eq!(uvp.modify(w, qp, &m), IbStatus::Success);
    }
    for m in to_rts(QpType::Rc, qpn, ips[U]) {
        assert_eq!(k.modify(w, &m), IbStatus::Success);
    }
}

/// Frees a kernel CQ, PD and CA on the user-side HCA, in that order.
#[track_caller]
fn free_kernel_cq_pd_and_ca(w: &World, kcq: u64, kpd: u64, kca: u64) {
    assert_eq!(
        status_of::<DestroyCq>(&w.call_in_dpc_at::<DestroyCq>(U, KERNEL, kcq, &Empty, 0)),
        IbStatus::Success
    );
    assert_eq!(
        status_of::<DeallocPd>(&w.call_in_dpc_at::<DeallocPd>(U, KERNEL, kpd, &Empty, 0)),
        IbStatus::Success
    );
    assert_eq!(
        status_of::<CloseCa>(&w.call_in_dpc_at::<CloseCa>(U, KERNEL, kca, &Empty, 0)),
        IbStatus::Success
    );
}

/// The kernel client on HCA `K`: CA, PD, CQ, one QP and a registered
/// common buffer.
struct Kernel {
    ca: u64,
    pd: u64,
    cq: u64,
    qp: u64,
    qpn: u32,
    buffer: sim_host::dma::HostCommonBuffer,
    region: MemoryRegion<SimPlatform>,
}

impl Kernel {
    fn new(w: &World, qp_type: QpType) -> Self {
        use driver_platform::{CommonBuffer, DmaAdapter};
        let c = w.call_in_dpc_at::<OpenCa>(K, KERNEL, 0, &OpenCaIn::CURRENT, 0);
        let ca = response::<OpenCa>(&c).handle;
        let pd = response::<AllocPd>(&w.call_in_dpc_at::<AllocPd>(K, KERNEL, ca, &Empty, 0)).handle;
        let attr = CqAttr {
            cqe: 64,
            comp_vector: 0,
        };
        let cq =
            response::<CreateCq>(&w.call_in_dpc_at::<CreateCq>(K, KERNEL, ca, &attr, 0)).handle;
        let input = qp_create(qp_type, pd, cq);
        let c = w.call_in_dpc_at::<CreateQp>(K, KERNEL, ca, &input, 0);
        let r = response::<CreateQp>(&c);
        assert_eq!(r.status, IbStatus::Success);
        let (qp, qpn) = (r.handle, r.output.unwrap().qpn.get());
        let buffer = w.adapter_at(K).alloc_common(8192).unwrap();
        let bus = buffer.bus_address();
        let pages = vec![bus, bus + 4096];
        let mt = w.hca_at(K).memory_translation().unwrap();
        let out = Arc::new(Mutex::new(None));
        let (hca, sink) = (w.hca_at(K), out.clone());
        let pd_number = support::number_of(pd);
        w.in_dpc(move || {
            let request = hca_miniport_core::mr::PhysicalRegion {
                iova: bus,
                length: 8192,
                first_byte_offset: 0,
                page_shift: 12,
                pages: &pages,
                access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
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
        Self {
            ca,
            pd,
            cq,
            qp,
            qpn,
            buffer,
            region,
        }
    }

    fn modify(&self, w: &World, m: &QpModify) -> IbStatus {
        status_of::<ModifyQp>(&w.call_in_dpc_at::<ModifyQp>(K, KERNEL, self.qp, m, 0))
    }

    fn sge(&self, offset: u64, len: u32) -> Sge {
        Sge::new(self.region.start() + offset, len, self.region.lkey())
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

    fn post_recv(&self, w: &World, wr_id: u64, sges: Vec<Sge>) {
        let out = Arc::new(Mutex::new(None));
        let (hca, sink, qp) = (w.hca_at(K), out.clone(), self.qp);
        w.in_dpc(move || {
            let wrs = [RecvWr {
                wr_id,
                sg_list: &sges,
            }];
            *support::lock(&sink) = Some(hca.post_recv(qp, &wrs));
        });
        w.settle();
        assert_eq!(support::lock(&out).take(), Some((1, IbStatus::Success)));
    }

    fn post_send(&self, w: &World, wr_id: u64, sges: Vec<Sge>) {
        let out = Arc::new(Mutex::new(None));
        let (hca, sink, qp) = (w.hca_at(K), out.clone(), self.qp);
        w.in_dpc(move || {
            let wr = SendWr {
                wr_id,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: &sges,
                ud: None,
            };
            let requests = [SendRequest {
                wr,
                av: None,
                inline: None,
            }];
            *support::lock(&sink) = Some(hca.post_send(qp, &requests));
        });
        w.settle();
        assert_eq!(support::lock(&out).take(), Some((1, IbStatus::Success)));
    }

    fn poll(&self, w: &World) -> Vec<WorkCompletion> {
        support::kernel_pair::poll_all(w, K, self.cq)
    }

    fn finish(self, w: &World) {
        let Kernel {
            ca,
            pd,
            cq,
            qp,
            buffer,
            region,
            ..
        } = self;
        deregister(w, K, region);
        w.adapter_at(K).free_common(buffer);
        assert_eq!(
            status_of::<DestroyQp>(&w.call_in_dpc_at::<DestroyQp>(K, KERNEL, qp, &Empty, 0)),
            IbStatus::Success
        );
        assert_eq!(
            status_of::<DestroyCq>(&w.call_in_dpc_at::<DestroyCq>(K, KERNEL, cq, &Empty, 0)),
            IbStatus::Success
        );
        assert_eq!(
            status_of::<DeallocPd>(&w.call_in_dpc_at::<DeallocPd>(K, KERNEL, pd, &Empty, 0)),
            IbStatus::Success
        );
        assert_eq!(
            status_of::<CloseCa>(&w.call_in_dpc_at::<CloseCa>(K, KERNEL, ca, &Empty, 0)),
            IbStatus::Success
        );
    }
}

/// Reads the device's count of dropped doorbells (PRM 2).
fn dropped_doorbells(w: &World) -> u32 {
    w.function()
        .bar0()
        .read32(hca_prm::regs::offset::DROPPED_DOORBELLS)
}

#[test]
fn a_user_rc_qp_moves_data_both_ways_with_a_kernel_qp_on_another_hca() {
    let (w, ips) = two_hcas(71);
    let uvp = Uvp::open(&w, 7);
    let pd = uvp.alloc_pd(&w);
    let mut cq = uvp.create_cq(&w, 4);
    let mut qp = uvp.create_qp(&w, QpType::Rc, pd, &cq);
    let k = Kernel::new(&w, QpType::Rc);

    // QueryCa on the context: the attribute block does not fit 64 bytes,
    // so the size report comes back (the verb ran for this context).
    let c = uvp.call::<ib_types::ioctl::QueryCa>(&w, uvp.ca, &Empty, &[]);
    let r = response::<ib_types::ioctl::QueryCa>(&c);
    assert_eq!(r.status, IbStatus::Overflow);
    assert!(r.output.unwrap().total_size > 64);

    // Query through the user path: the QP is the caller's, in RESET.
    let c = uvp.call::<QueryQp>(&w, qp.handle, &Empty, &[]);
    let q = response::<QueryQp>(&c).output.unwrap();
    assert_eq!(
        (q.qp_type, q.state, q.qpn.get()),
        (QpType::Rc, QpState::Reset, qp.qpn)
    );
    let c = uvp.call::<QueryCq>(&w, cq.handle, &Empty, &[]);
    assert_eq!(response::<QueryCq>(&c).output.unwrap().cqe, 16);

    connect_rc(&w, &uvp, (qp.handle, qp.qpn), &k, ips);

    // The user's buffer: 8 KiB of process memory, registered.
    let buf = uvp.process().alloc(8192).unwrap();
    let region = uvp.register(&w, pd, buf, 8192);
    let user_sge = |offset: u64, len: u32| Sge::new(buf + offset, len, region.lkey);

    // Kernel -> user: the user posts a receive in its own ring.
    let to_user = pattern(5, 3000);
    k.write(0, &to_user);
    uvp.post_recv(&mut qp, &[user_sge(0, 4096)]);
    k.post_send(&w, 41, vec![k.sge(0, 3000)]);
    let wcs = uvp.poll(&mut cq);
    assert_eq!(wcs.len(), 1);
    let wc = wcs[0];
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 3000));
    assert_eq!(wc.qp_num.get(), qp.qpn);
    let mut got = vec![0; 3000];
    uvp.process().read(buf, &mut got).unwrap();
    assert_eq!(got, to_user);
    let kwc = k.poll(&w);
    assert_eq!(kwc.len(), 1);
    assert_eq!((kwc[0].wr_id, kwc[0].status), (41, WcStatus::Success));

    // User -> kernel: the user builds the WQE and rings its own page.
    let to_kernel = pattern(77, 2500);
    uvp.process().write(buf + 4096, &to_kernel).unwrap();
    k.post_recv(&w, 51, vec![k.sge(4096, 4096)]);
    let sges = [user_sge(4096, 2500)];
    let wr = SendWr {
        wr_id: 0,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: &sges,
        ud: None,
    };
    uvp.post_send(&mut qp, &wr, None);
    w.settle();
    let kwc = k.poll(&w);
    assert_eq!(kwc.len(), 1);
    assert_eq!(
        (kwc[0].wr_id, kwc[0].status, kwc[0].byte_len),
        (51, WcStatus::Success, 2500)
    );
    assert_eq!(k.read(4096, 2500), to_kernel);
    let wcs = uvp.poll(&mut cq);
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].status, WcStatus::Success);

    // Another process's doorbell page cannot ring this QP: the device
    // drops the doorbell (PRM 9.1) and nothing is sent.
    let other = Uvp::open(&w, 8);
    assert_ne!(other.uar, uvp.uar);
    k.post_recv(&w, 52, vec![k.sge(0, 4096)]);
    let dropped = dropped_doorbells(&w);
    // A doorbell naming the QP one basic block further, from the wrong
    // page: honoured, it would run the (empty) next slot and fail the QP.
    let producer = qp.fast.send_queue().producer();
    other.ring(qp.qpn, producer + 1);
    w.settle();
    assert_eq!(dropped_doorbells(&w), dropped + 1);
    assert!(k.poll(&w).is_empty(), "nothing was sent");
    // The owner's post rings its own page.
    uvp.post_send(&mut qp, &wr, None);
    w.settle();
    let kwc = k.poll(&w);
    assert_eq!((kwc.len(), kwc[0].wr_id), (1, 52));
    assert_eq!(uvp.poll(&mut cq).len(), 1);

    // Handles of one context are not another's, nor is a kernel object a
    // user's: refused, nothing changed.
    let c = other.call::<QueryQp>(&w, qp.handle, &Empty, &[]);
    assert_eq!(status_of::<QueryQp>(&c), IbStatus::InvalidQpHandle);
    let c = other.call::<DestroyQp>(&w, qp.handle, &Empty, &[]);
    assert_eq!(status_of::<DestroyQp>(&c), IbStatus::InvalidQpHandle);
    let c = other.call::<DestroyCq>(&w, cq.handle, &Empty, &[]);
    assert_eq!(status_of::<DestroyCq>(&c), IbStatus::InvalidCqHandle);
    let c = other.call::<AllocPd>(&w, uvp.ca, &Empty, &[]);
    assert_eq!(status_of::<AllocPd>(&c), IbStatus::InvalidCaHandle);
    // A kernel client's objects on the user's HCA.
    let kca =
        response::<OpenCa>(&w.call_in_dpc_at::<OpenCa>(U, KERNEL, 0, &OpenCaIn::CURRENT, 0)).handle;
    let kpd = response::<AllocPd>(&w.call_in_dpc_at::<AllocPd>(U, KERNEL, kca, &Empty, 0)).handle;
    let attr = CqAttr {
        cqe: 8,
        comp_vector: 0,
    };
    let kcq = response::<CreateCq>(&w.call_in_dpc_at::<CreateCq>(U, KERNEL, kca, &attr, 0)).handle;
    uvp.expect::<QueryCq>(&w, kcq, &Empty, IbStatus::InvalidCqHandle);
    uvp.expect::<DestroyCq>(&w, kcq, &Empty, IbStatus::InvalidCqHandle);
    uvp.expect::<DeallocPd>(&w, kpd, &Empty, IbStatus::InvalidPdHandle);
    uvp.expect::<AllocPd>(&w, kca, &Empty, IbStatus::InvalidCaHandle);
    uvp.expect::<CloseCa>(&w, kca, &Empty, IbStatus::InvalidCaHandle);
    // The kernel sees the user's objects (kernel requests see everything)
    // but its CA stays its own: the user QP is not on its CA to close.
    free_kernel_cq_pd_and_ca(&w, kcq, kpd, kca);
    // A QP over another context's CQ and PD.
    let other_pd = other.alloc_pd(&w);
    let other_cq = other.create_cq(&w, 3);
    let layout = CreateQpPriv::new(
        3,
        0,
        other.process().alloc(512).unwrap(),
        Some((
            3,
            5,
            other.process().alloc(256).unwrap(),
            other.process().alloc(64).unwrap(),
        )),
    )
    .unwrap();
    let c = other.call::<CreateQp>(
        &w,
        other.ca,
        &qp_create(QpType::Rc, pd, other_cq.handle),
        layout.emit().as_bytes(),
    );
    assert_eq!(status_of::<CreateQp>(&c), IbStatus::InvalidPdHandle);
    let c = other.call::<CreateQp>(
        &w,
        other.ca,
        &qp_create(QpType::Rc, other_pd, cq.handle),
        layout.emit().as_bytes(),
    );
    assert_eq!(status_of::<CreateQp>(&c), IbStatus::InvalidCqHandle);
    // User AVs are the provider's: a user CreateAv reaching the kernel.
    uvp.expect::<CreateAv>(&w, pd, &av_to(ips[K]), IbStatus::Unsupported);

    // Destroy through the user path; the CQ is busy while the QP lives.
    uvp.expect::<DestroyCq>(&w, cq.handle, &Empty, IbStatus::ResourceBusy);
    uvp.expect::<DestroyQp>(&w, qp.handle, &Empty, IbStatus::Success);
    uvp.expect::<DestroyCq>(&w, cq.handle, &Empty, IbStatus::Success);
    uvp.dereg(&w, &region);

    // Close the other context with its CQ and PD still live: everything
    // goes, its page is unmapped and its pages unlocked.
    let free_uars = w.hca_at(U).free_uar_pages();
    assert_eq!(other.close(&w), IbStatus::Success);
    assert_eq!(w.hca_at(U).free_uar_pages(), free_uars + 1);
    assert_eq!(other.process().space().device_mapping_count(), 0);
    assert_eq!(other.process().space().locked_pages(), 0);
    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(w.hca_at(U).user_context_count(), 0);
    assert_eq!(uvp.process().space().locked_pages(), 0);
    assert_eq!(uvp.process().exit(), 0);
    assert_eq!(other.process().exit(), 0);
    k.finish(&w);
    w.finish();
}

/// What a refused request must leave unchanged.
#[derive(Debug, PartialEq, Eq)]
struct Footprint {
    mtt: hca_miniport_core::mr::TranslationUsage,
    locked: usize,
    contexts: usize,
    uars: u32,
}

fn footprint(w: &World, uvp: &Uvp) -> Footprint {
    Footprint {
        mtt: w.hca_at(U).memory_translation().unwrap().usage(),
        locked: uvp.process().space().locked_pages(),
        contexts: w.hca_at(U).user_context_count(),
        uars: w.hca_at(U).free_uar_pages(),
    }
}

#[test]
fn hostile_ring_descriptions_are_refused_and_change_nothing() {
    use hca_prm::uverbs::{CreateCqPrivAbi, CreateQpPrivAbi};
    use hca_prm::{Le32, Le64};
    use sim_host::memory::Protection;
    let (w, _) = two_hcas(72);
    let uvp = Uvp::open(&w, 9);
    let pd = uvp.alloc_pd(&w);
    let cq = uvp.create_cq(&w, 3);
    let before = footprint(&w, &uvp);
    let p = uvp.process();
    let ring = p.alloc(8192).unwrap();
    let dbr = p.alloc(64).unwrap();
    let read_only = p.alloc_with(4096, Protection::ReadOnly).unwrap();
    let good = CreateCqPriv::new(4, ring, dbr).unwrap().emit();
    let attr = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    let cq_status = |bytes: &[u8], attr: &CqAttr| {
        status_of::<CreateCq>(&uvp.call::<CreateCq>(&w, uvp.ca, attr, bytes))
    };
    let with = |f: &dyn Fn(&mut CreateCqPrivAbi)| {
        let mut abi = good;
        f(&mut abi);
        abi
    };
    let bad = IbStatus::InvalidParameter;
    let cases: Vec<(&str, Vec<u8>, CqAttr, IbStatus)> = vec![
        ("no private data", vec![], attr, bad),
        ("short", good.as_bytes()[..31].to_vec(), attr, bad),
        ("long", [good.as_bytes(), &[0]].concat(), attr, bad),
        (
            "reserved",
            with(&|a| a.reserved_at_0x19[0] = 1).as_bytes().to_vec(),
            attr,
            bad,
        ),
        (
            "misaligned ring",
            with(&|a| a.ring_va = Le64::new(ring + 8))
                .as_bytes()
                .to_vec(),
            attr,
            bad,
        ),
        (
            "misaligned record",
            with(&|a| a.dbr_va = Le64::new(dbr + 2)).as_bytes().to_vec(),
            attr,
            bad,
        ),
        (
            "ring wraps",
            with(&|a| a.ring_va = Le64::new(u64::MAX - 511))
                .as_bytes()
                .to_vec(),
            attr,
            bad,
        ),
        (
            "record in the ring",
            with(&|a| a.dbr_va = Le64::new(ring + 64))
                .as_bytes()
                .to_vec(),
            attr,
            bad,
        ),
        (
            "length disagrees",
            with(&|a| a.ring_bytes = Le64::new(1024))
                .as_bytes()
                .to_vec(),
            attr,
            bad,
        ),
        (
            "zero size",
            with(&|a| a.ring_bytes = Le64::new(0)).as_bytes().to_vec(),
            attr,
            bad,
        ),
        (
            "huge",
            with(&|a| {
                a.log_entries = 26;
                a.ring_bytes = Le64::new(32 << 26);
                a.dbr_va = Le64::new(ring - 64);
            })
            .as_bytes()
            .to_vec(),
            CqAttr {
                cqe: 1 << 26,
                ..attr
            },
            IbStatus::InvalidCqSize,
        ),
        (
            "more entries asked than the ring",
            good.as_bytes().to_vec(),
            CqAttr { cqe: 17, ..attr },
            IbStatus::InvalidCqSize,
        ),
        (
            "another vector",
            good.as_bytes().to_vec(),
            CqAttr {
                comp_vector: 1,
                ..attr
            },
            bad,
        ),
        (
            "unmapped ring",
            with(&|a| a.ring_va = Le64::new(ring + 0x10_0000))
                .as_bytes()
                .to_vec(),
            attr,
            IbStatus::InvalidPermission,
        ),
        (
            "read-only ring",
            with(&|a| a.ring_va = Le64::new(read_only))
                .as_bytes()
                .to_vec(),
            attr,
            IbStatus::InvalidPermission,
        ),
        (
            "ring past its allocation",
            with(&|a| a.ring_va = Le64::new(ring + 8192 - 256))
                .as_bytes()
                .to_vec(),
            attr,
            IbStatus::InvalidPermission,
        ),
    ];
    for (what, bytes, attr, expected) in cases {
        assert_eq!(cq_status(&bytes, &attr), expected, "{what}");
        assert_eq!(footprint(&w, &uvp), before, "{what}");
    }

    // QPs: the same for rings and records, and layouts the device cannot
    // take.
    let sq = p.alloc(4096).unwrap();
    let rq = p.alloc(4096).unwrap();
    let rq_dbr = p.alloc(64).unwrap();
    let good = CreateQpPriv::new(3, 0, sq, Some((3, 5, rq, rq_dbr)))
        .unwrap()
        .emit();
    let input = qp_create(QpType::Rc, pd, cq.handle);
    let qp_status = |bytes: &[u8], input: &QpCreate| {
        status_of::<CreateQp>(&uvp.call::<CreateQp>(&w, uvp.ca, input, bytes))
    };
    let with = |f: &dyn Fn(&mut CreateQpPrivAbi)| {
        let mut abi = good;
        f(&mut abi);
        abi.as_bytes().to_vec()
    };
    let cases: Vec<(&str, Vec<u8>, QpCreate, IbStatus)> = vec![
        ("no private data", vec![], input, bad),
        (
            "rings overlap",
            with(&|a| a.rq_va = Le64::new(sq + 256)),
            input,
            bad,
        ),
        (
            "record in a ring",
            with(&|a| a.rq_dbr_va = Le64::new(sq + 64)),
            input,
            bad,
        ),
        (
            "half a receive queue",
            with(&|a| a.rq_dbr_va = Le64::new(0)),
            input,
            bad,
        ),
        (
            "no receive queue without an SRQ",
            CreateQpPriv::new(3, 0, sq, None)
                .unwrap()
                .emit()
                .as_bytes()
                .to_vec(),
            input,
            bad,
        ),
        (
            "sq wraps",
            with(&|a| a.sq_va = Le64::new(u64::MAX - 511)),
            input,
            bad,
        ),
        (
            "deeper than the device",
            with(&|a| {
                a.sq_log_bbs = 21;
                a.sq_bytes = Le32::new(64 << 21);
                a.sq_va = Le64::new(0x7000_0000_0000);
            }),
            input,
            IbStatus::InvalidMaxWrs,
        ),
        (
            "WQE stride beyond the device",
            with(&|a| {
                a.sq_log_bbs = 7;
                a.log_wqe_bbs = 7;
                a.sq_bytes = Le32::new(64 << 7);
                a.sq_va = Le64::new(0x7000_0000_0000);
            }),
            input,
            IbStatus::InvalidParameter,
        ),
        (
            "more WRs than the ring",
            good.as_bytes().to_vec(),
            QpCreate {
                caps: QpCaps {
                    max_send_wr: 9,
                    ..input.caps
                },
                ..input
            },
            IbStatus::InvalidMaxWrs,
        ),
        (
            "special QP",
            good.as_bytes().to_vec(),
            QpCreate {
                qp_type: QpType::Gsi,
                port: Some(PortNum::FIRST),
                ..input
            },
            IbStatus::InvalidPermission,
        ),
        (
            "unmapped receive ring",
            with(&|a| a.rq_va = Le64::new(rq + 0x10_0000)),
            input,
            IbStatus::InvalidPermission,
        ),
        (
            "read-only send ring",
            with(&|a| a.sq_va = Le64::new(read_only)),
            input,
            IbStatus::InvalidPermission,
        ),
        (
            "a stale CQ",
            good.as_bytes().to_vec(),
            qp_create(QpType::Rc, pd, cq.handle ^ (1 << 30)),
            IbStatus::InvalidCqHandle,
        ),
        (
            "a CQ for a PD",
            good.as_bytes().to_vec(),
            qp_create(QpType::Rc, cq.handle, cq.handle),
            IbStatus::InvalidPdHandle,
        ),
    ];
    for (what, bytes, input, expected) in cases {
        assert_eq!(qp_status(&bytes, &input), expected, "{what}");
        assert_eq!(footprint(&w, &uvp), before, "{what}");
    }

    // Regions: kernel addresses, unmapped or read-only memory for a
    // writable region, a stale PD, a CQ for a PD.
    let reg = |pd: u64, vaddr: u64, access: AccessFlags| {
        let input = ib_types::mr::MrRegister {
            vaddr,
            length: 4096,
            access,
        };
        status_of::<ib_types::ioctl::RegMr>(&uvp.call::<ib_types::ioctl::RegMr>(
            &w,
            pd,
            &input,
            &[],
        ))
    };
    let write = AccessFlags::LOCAL_WRITE;
    let kernel_va = sim_host::memory::KERNEL_VA_BASE;
    assert_eq!(reg(pd, kernel_va, write), IbStatus::InvalidPermission);
    assert_eq!(
        reg(pd, ring + 0x10_0000, write),
        IbStatus::InvalidPermission
    );
    assert_eq!(reg(pd, read_only, write), IbStatus::InvalidPermission);
    assert_eq!(reg(pd ^ (1 << 30), ring, write), IbStatus::InvalidPdHandle);
    assert_eq!(reg(cq.handle, ring, write), IbStatus::InvalidPdHandle);
    assert_eq!(footprint(&w, &uvp), before);
    // A read-only region of read-only memory is fine, and goes with the
    // context.
    assert_eq!(reg(pd, read_only, AccessFlags::empty()), IbStatus::Success);

    let before = footprint(&w, &uvp);

    // Garbage framing of every length on the user path: refused, nothing
    // changed, never a panic.
    for len in 0..160 {
        let bytes = pattern(len as u8, len);
        for code in [CreateCq::ID, CreateQp::ID, OpenCa::ID, CloseCa::ID].map(|v| v.ioctl().raw()) {
            let c = w.user_raw_at(U, &uvp.caller, code, bytes.clone(), 256);
            assert!(c.status.is_error(), "{len} bytes");
        }
        assert_eq!(footprint(&w, &uvp), before);
    }

    // Arbitrary private bytes: never a success that was not asked for,
    // never a change.
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        cases: 96,
        ..Default::default()
    });
    let strategy = proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80);
    runner
        .run(&strategy, |bytes| {
            let cq_status = status_of::<CreateCq>(&uvp.call::<CreateCq>(&w, uvp.ca, &attr, &bytes));
            let qp_status =
                status_of::<CreateQp>(&uvp.call::<CreateQp>(&w, uvp.ca, &input, &bytes));
            proptest::prop_assert_ne!(cq_status, IbStatus::Success);
            proptest::prop_assert_ne!(qp_status, IbStatus::Success);
            proptest::prop_assert_eq!(footprint(&w, &uvp), footprint_of(&before));
            Ok(())
        })
        .unwrap();

    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(uvp.process().exit(), 0);
    w.finish();
}

fn footprint_of(f: &Footprint) -> Footprint {
    Footprint {
        mtt: f.mtt,
        locked: f.locked,
        contexts: f.contexts,
        uars: f.uars,
    }
}

#[test]
fn a_user_ud_qp_exchanges_datagrams_and_close_takes_live_objects_with_it() {
    let (w, ips) = two_hcas(73);
    let uvp = Uvp::open(&w, 11);
    let pd = uvp.alloc_pd(&w);
    let mut cq = uvp.create_cq(&w, 4);
    let mut qp = uvp.create_qp(&w, QpType::Ud, pd, &cq);
    let k = Kernel::new(&w, QpType::Ud);
    for m in to_rts(QpType::Ud, 0, [0; 4]) {
        assert_eq!(uvp.modify(&w, qp.handle, &m), IbStatus::Success);
        assert_eq!(k.modify(&w, &m), IbStatus::Success);
    }
    let buf = uvp.process().alloc(8192).unwrap();
    let region = uvp.register(&w, pd, buf, 8192);

    // Kernel -> user datagram: 40 bytes of GRH, then the payload.
    let payload = pattern(9, 1000);
    k.write(0, &payload);
    uvp.post_recv(&mut qp, &[Sge::new(buf, 2048, region.lkey)]);
    let av = hca_prm::av::Av::try_from(&av_to(ips[U])).unwrap();
    {
        let out = Arc::new(Mutex::new(None));
        let (hca, sink, kqp, sge, qpn) = (w.hca_at(K), out.clone(), k.qp, k.sge(0, 1000), qp.qpn);
        w.in_dpc(move || {
            let sges = [sge];
            let wr = SendWr {
                wr_id: 61,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: &sges,
                ud: Some(ib_types::wr::UdDest {
                    av: ib_types::handle::AvHandle::from_raw(1),
                    remote_qpn: Qpn::new(qpn).unwrap(),
                    remote_qkey: QKey::new(0x11),
                }),
            };
            let requests = [SendRequest {
                wr,
                av: Some(av),
                inline: None,
            }];
            *support::lock(&sink) = Some(hca.post_send(kqp, &requests));
        });
        w.settle();
        assert_eq!(support::lock(&out).take(), Some((1, IbStatus::Success)));
    }
    let wcs = uvp.poll(&mut cq);
    assert_eq!(wcs.len(), 1);
    let wc = wcs[0];
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 1040));
    assert_eq!(wc.src_qp.get(), k.qpn);
    let mut got = vec![0; 1000];
    uvp.process().read(buf + 40, &mut got).unwrap();
    assert_eq!(got, payload);
    assert_eq!(k.poll(&w).len(), 1);

    // User -> kernel datagram: the provider puts the PRM address vector
    // into its own WQE (user AVs never reach the kernel).
    let payload = pattern(99, 700);
    uvp.process().write(buf + 4096, &payload).unwrap();
    k.post_recv(&w, 62, vec![k.sge(4096, 2048)]);
    let av = hca_prm::av::Av::try_from(&av_to(ips[K])).unwrap();
    let sges = [Sge::new(buf + 4096, 700, region.lkey)];
    let wr = SendWr {
        wr_id: 0,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: &sges,
        ud: Some(ib_types::wr::UdDest {
            av: ib_types::handle::AvHandle::from_raw(1),
            remote_qpn: Qpn::new(k.qpn).unwrap(),
            remote_qkey: QKey::new(0x11),
        }),
    };
    uvp.post_send(&mut qp, &wr, Some(&av));
    w.settle();
    let kwc = k.poll(&w);
    assert_eq!(kwc.len(), 1);
    assert_eq!(
        (kwc[0].wr_id, kwc[0].status, kwc[0].byte_len),
        (62, WcStatus::Success, 740)
    );
    assert_eq!(k.read(4096 + 40, 700), payload);
    assert_eq!(uvp.poll(&mut cq).len(), 1);

    // The process exits without destroying anything: the proxy's cleanup
    // closes the context, which destroys the QP and CQ, deregisters the
    // region, frees the PD, unmaps the doorbell page and unlocks every
    // ring and region page.
    let c = uvp.call::<ib_types::ioctl::QueryMr>(&w, region.handle, &Empty, &[]);
    assert_eq!(
        response::<ib_types::ioctl::QueryMr>(&c)
            .output
            .unwrap()
            .length,
        8192
    );
    let usage = w.hca_at(U).memory_translation().unwrap().usage();
    assert_eq!(usage.regions, 1);
    let mtt_before_open = usage.mtt_free;
    assert!(uvp.process().space().locked_pages() > 0);
    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(uvp.process().space().locked_pages(), 0);
    assert_eq!(uvp.process().space().device_mapping_count(), 0);
    let usage = w.hca_at(U).memory_translation().unwrap().usage();
    assert!(usage.mtt_free > mtt_before_open);
    assert_eq!(usage.regions, 0);
    let c = uvp.call::<ib_types::ioctl::QueryMr>(&w, region.handle, &Empty, &[]);
    assert_eq!(
        status_of::<ib_types::ioctl::QueryMr>(&c),
        IbStatus::InvalidMrHandle
    );
    assert_eq!(w.hca_at(U).user_context_count(), 0);
    // Its handles are gone; a second close is refused.
    assert_eq!(uvp.close(&w), IbStatus::InvalidCaHandle);
    uvp.expect::<QueryQp>(&w, qp.handle, &Empty, IbStatus::InvalidQpHandle);
    // The doorbell page is gone from the process.
    assert!(uvp.process().write_device64(uvp.doorbell, 0).is_err());
    assert_eq!(uvp.process().exit(), 0);
    k.finish(&w);
    w.finish();
}

#[test]
fn a_user_rc_qp_receives_through_a_user_srq() {
    use hca_prm::uverbs::{CreateSrqPriv, CreateSrqPrivOut};
    use ib_types::ioctl::{CreateSrq, DestroySrq, ModifySrq, QuerySrq};
    use ib_types::srq::{SrqAttr, SrqCreate, SrqModify};
    let (w, ips) = two_hcas(74);
    let uvp = Uvp::open(&w, 12);
    let pd = uvp.alloc_pd(&w);
    let mut cq = uvp.create_cq(&w, 4);
    let p = uvp.process();

    // The SRQ: 8 WQEs of 32 bytes and its producer record, in the process.
    let srq_ring = p.alloc(256).unwrap();
    let srq_dbr = p.alloc(64).unwrap();
    let layout = CreateSrqPriv::new(3, 5, srq_ring, srq_dbr).unwrap();
    let create = SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr: SrqAttr {
            max_wr: 8,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    let c = uvp.call::<CreateSrq>(&w, uvp.ca, &create, layout.emit().as_bytes());
    let r = response::<CreateSrq>(&c);
    assert_eq!(r.status, IbStatus::Success);
    assert_eq!(r.output.unwrap().max_wr, 8);
    let srq = r.handle;
    let srq_out = CreateSrqPrivOut::parse(r.private).unwrap();
    // SAFETY: the ring and record are allocations of this process, which
    // outlives the SRQ; its frames are atomic words, reached by DMA only.
    let mut fast_srq = unsafe { uvp.fast.srq(&layout, &srq_out, 1) }.unwrap();
    // Too many SGEs for the stride; a kernel client's PD.
    let c = uvp.call::<CreateSrq>(
        &w,
        uvp.ca,
        &SrqCreate {
            attr: SrqAttr {
                max_sge: 2,
                ..create.attr
            },
            ..create
        },
        CreateSrqPriv::new(3, 5, p.alloc(256).unwrap(), p.alloc(64).unwrap())
            .unwrap()
            .emit()
            .as_bytes(),
    );
    assert_eq!(status_of::<CreateSrq>(&c), IbStatus::InvalidMaxSge);
    let c = uvp.call::<QuerySrq>(&w, srq, &Empty, &[]);
    assert_eq!(response::<QuerySrq>(&c).output.unwrap().max_wr, 8);
    let arm = SrqModify {
        max_wr: None,
        srq_limit: Some(2),
    };
    uvp.expect::<ModifySrq>(&w, srq, &arm, IbStatus::Success);

    // An RC QP on it: no receive queue of its own.
    let sq = p.alloc(512).unwrap();
    let qp_layout = CreateQpPriv::new(3, 0, sq, None).unwrap();
    let input = QpCreate {
        srq: Some(ib_types::handle::SrqHandle::from_raw(srq)),
        caps: QpCaps {
            max_recv_wr: 0,
            max_recv_sge: 0,
            ..qp_create(QpType::Rc, pd, cq.handle).caps
        },
        ..qp_create(QpType::Rc, pd, cq.handle)
    };
    let c = uvp.call::<CreateQp>(&w, uvp.ca, &input, qp_layout.emit().as_bytes());
    let r = response::<CreateQp>(&c);
    assert_eq!(r.status, IbStatus::Success);
    let (qp, qpn) = (r.handle, r.output.unwrap().qpn.get());
    let created = uvp_plugin::QpCreated {
        qp_type: QpType::Rc,
        caps: r.output.unwrap().caps,
        private: CreateQpPrivOut::parse(r.private).unwrap(),
    };
    // SAFETY: as for the SRQ.
    let fast_qp = unsafe { uvp.fast.qp(&qp_layout, &created, Some(&fast_srq)) }.unwrap();
    let k = Kernel::new(&w, QpType::Rc);
    connect_rc(&w, &uvp, (qp, qpn), &k, ips);

    // The provider posts to the SRQ ring and its record; the kernel sends.
    let buf = p.alloc(4096).unwrap();
    let region = uvp.register(&w, pd, buf, 4096);
    let sges = [Sge::new(buf, 4096, region.lkey)];
    let wr = RecvWr {
        wr_id: 0x5A,
        sg_list: &sges,
    };
    assert_eq!(fast_srq.post(&[wr]), Ok(1));
    let payload = pattern(44, 1800);
    k.write(0, &payload);
    k.post_send(&w, 71, vec![k.sge(0, 1800)]);
    let wcs = uvp.poll(&mut cq);
    assert_eq!(wcs.len(), 1);
    // The SRQ's wr_id: the completion came from the SRQ's ring.
    assert_eq!((wcs[0].wr_id, wcs[0].byte_len), (0x5A, 1800));
    // The provider's QP goes once its completions are in (its directory
    // entry routes them to the SRQ).
    drop(fast_qp);
    let mut got = vec![0; 1800];
    p.read(buf, &mut got).unwrap();
    assert_eq!(got, payload);
    assert_eq!(k.poll(&w).len(), 1);

    // Busy while the QP uses it; the close takes QP, SRQ, CQ and PD.
    uvp.expect::<DestroySrq>(&w, srq, &Empty, IbStatus::ResourceBusy);
    uvp.dereg(&w, &region);
    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(p.space().locked_pages(), 0);
    assert_eq!(p.exit(), 0);
    k.finish(&w);
    w.finish();
}

/// [`submit_user_raw_unsettled`], then lets the host run what it started.
fn submit_user_raw<V: Verb<In = Empty>>(
    w: &World,
    uvp: &Uvp,
    handle: u64,
) -> sim_host::request::RequestHandle {
    let issuer = submit_user_raw_unsettled::<V>(w, uvp, handle);
    w.settle();
    issuer
}

/// Submits `V` (no input, no private data) as a raw user request from
/// `uvp`'s caller and returns the issuer's handle at once (the request
/// may stay pending).
fn submit_user_raw_unsettled<V: Verb<In = Empty>>(
    w: &World,
    uvp: &Uvp,
    handle: u64,
) -> sim_host::request::RequestHandle {
    use ib_types::ioctl::{encode_request, request_len, response_len};
    let mut bytes = vec![0; request_len::<V>(0).unwrap()];
    encode_request::<V>(handle, &Empty, &[], 0, &mut bytes).unwrap();
    let (request, issuer) = w.raw_request(
        V::ID.ioctl().raw(),
        RequestorMode::User,
        bytes,
        response_len::<V>(0).unwrap(),
    );
    w.hca_at(U).submit_user_request(request, uvp.caller.clone());
    issuer
}

/// Issues a user WaitCqEvent on `cq` and returns the issuer's handle
/// (the request may stay pending).
fn wait_cq(w: &World, uvp: &Uvp, cq: u64) -> sim_host::request::RequestHandle {
    submit_user_raw::<ib_types::ioctl::WaitCqEvent>(w, uvp, cq)
}

#[test]
fn wait_cq_event_completes_on_the_armed_cqs_event_and_is_cancellable() {
    let (w, ips) = two_hcas(75);
    let uvp = Uvp::open(&w, 13);
    let pd = uvp.alloc_pd(&w);
    let mut cq = uvp.create_cq(&w, 4);
    let mut qp = uvp.create_qp(&w, QpType::Rc, pd, &cq);
    let k = Kernel::new(&w, QpType::Rc);
    connect_rc(&w, &uvp, (qp.handle, qp.qpn), &k, ips);
    let buf = uvp.process().alloc(4096).unwrap();
    let region = uvp.register(&w, pd, buf, 4096);
    // Armed through the provider's doorbell page, then a wait: pending
    // until the completion arrives.
    cq.fast.arm(uvp_plugin::ArmFor::Next);
    let waiting = wait_cq(&w, &uvp, cq.handle);
    assert!(!waiting.is_done(), "nothing completed yet");
    uvp.post_recv(&mut qp, &[Sge::new(buf, 4096, region.lkey)]);
    k.write(0, b"wake up");
    k.post_send(&w, 81, vec![k.sge(0, 7)]);
    let done = waiting.completion().expect("the event completed the wait");
    assert_eq!(
        status_of::<ib_types::ioctl::WaitCqEvent>(&done),
        IbStatus::Success
    );
    assert_eq!(uvp.poll(&mut cq).len(), 1);
    assert_eq!(k.poll(&w).len(), 1);

    // An event that fires before the wait is kept for it: arming with
    // CQEs already beyond the consumer fires at once (PRM 9.3).
    uvp.post_recv(&mut qp, &[Sge::new(buf, 4096, region.lkey)]);
    k.post_send(&w, 82, vec![k.sge(0, 7)]);
    cq.fast.arm(uvp_plugin::ArmFor::Next);
    w.settle();
    let early = wait_cq(&w, &uvp, cq.handle);
    assert!(early.is_done());
    assert_eq!(uvp.poll(&mut cq).len(), 1);
    assert_eq!(k.poll(&w).len(), 1);

    // A wait nobody wakes is cancelled by the proxy's cancel routine.
    let stuck = wait_cq(&w, &uvp, cq.handle);
    assert!(!stuck.is_done());
    w.hca_at(U).cancel_user_waits();
    assert!(!stuck.is_done(), "not cancelled: kept");
    stuck.cancel();
    w.hca_at(U).cancel_user_waits();
    let c = stuck.completion().unwrap();
    assert_eq!(c.status, ib_types::status::NtStatus::CANCELLED);
    // Another process cannot wait on this CQ.
    let other = Uvp::open(&w, 14);
    let foreign = wait_cq(&w, &other, cq.handle);
    let c = foreign.completion().unwrap();
    assert_eq!(
        status_of::<ib_types::ioctl::WaitCqEvent>(&c),
        IbStatus::InvalidCqHandle
    );

    // A wait pending at close ends with the CQ.
    let orphan = wait_cq(&w, &uvp, cq.handle);
    assert!(!orphan.is_done());
    uvp.dereg(&w, &region);
    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(
        orphan.completion().unwrap().status,
        ib_types::status::NtStatus::CANCELLED
    );
    assert_eq!(other.close(&w), IbStatus::Success);
    assert_eq!(uvp.process().exit(), 0);
    k.finish(&w);
    w.finish();
}

/// Issues a user GetAsyncEvent on the context and returns the issuer's
/// handle (the request may stay pending).
fn get_async_event(w: &World, uvp: &Uvp) -> sim_host::request::RequestHandle {
    submit_user_raw::<ib_types::ioctl::GetAsyncEvent>(w, uvp, uvp.ca)
}

#[test]
fn a_user_qps_access_error_reaches_its_process_as_an_async_event() {
    use ib_types::event::AsyncEventCode;
    use ib_types::ioctl::GetAsyncEvent;
    let (w, ips) = two_hcas(76);
    let uvp = Uvp::open(&w, 15);
    let pd = uvp.alloc_pd(&w);
    let cq = uvp.create_cq(&w, 4);
    let qp = uvp.create_qp(&w, QpType::Rc, pd, &cq);
    let k = Kernel::new(&w, QpType::Rc);
    connect_rc(&w, &uvp, (qp.handle, qp.qpn), &k, ips);

    // A wait posted before the event.
    let waiting = get_async_event(&w, &uvp);
    assert!(!waiting.is_done());

    // The kernel writes to the user QP with an R_Key that names nothing:
    // the user QP (the responder) raises WQ_ACCESS_ERROR.
    let out = Arc::new(Mutex::new(None));
    let (hca, sink, kqp, sge) = (w.hca_at(K), out.clone(), k.qp, k.sge(0, 64));
    w.in_dpc(move || {
        let sges = [sge];
        let wr = SendWr {
            wr_id: 91,
            op: SendOp::RdmaWrite {
                remote: ib_types::wr::RemoteAddr {
                    addr: 0x1000,
                    rkey: ib_types::wr::RKey::new(0x00DE_AD00),
                },
            },
            flags: SendFlags::SIGNALED,
            sg_list: &sges,
            ud: None,
        };
        let requests = [SendRequest {
            wr,
            av: None,
            inline: None,
        }];
        *support::lock(&sink) = Some(hca.post_send(kqp, &requests));
    });
    w.settle();
    assert_eq!(support::lock(&out).take(), Some((1, IbStatus::Success)));
    let kwc = k.poll(&w);
    assert_eq!(kwc.len(), 1);
    assert_ne!(kwc[0].status, WcStatus::Success);

    let c = waiting.completion().expect("the event completed the wait");
    let r = response::<GetAsyncEvent>(&c);
    assert_eq!(r.status, IbStatus::Success);
    let record = r.output.unwrap();
    assert_eq!(
        (record.code, record.handle),
        (AsyncEventCode::WqAccessError, qp.handle)
    );
    // The cached state took it.
    let c = uvp.call::<QueryQp>(&w, qp.handle, &Empty, &[]);
    assert_eq!(response::<QueryQp>(&c).output.unwrap().state, QpState::Err);

    // No more events: the next request pends until cancelled.
    let stuck = get_async_event(&w, &uvp);
    assert!(!stuck.is_done());
    stuck.cancel();
    w.hca_at(U).cancel_user_waits();
    assert_eq!(
        stuck.completion().unwrap().status,
        ib_types::status::NtStatus::CANCELLED
    );
    // Another process cannot take this context's events.
    let other = Uvp::open(&w, 16);
    let mut bytes = vec![0; ib_types::ioctl::request_len::<GetAsyncEvent>(0).unwrap()];
    ib_types::ioctl::encode_request::<GetAsyncEvent>(uvp.ca, &Empty, &[], 0, &mut bytes).unwrap();
    let c = w.user_raw_at(U, &other.caller, GetAsyncEvent::ID.ioctl().raw(), bytes, 64);
    assert_eq!(status_of::<GetAsyncEvent>(&c), IbStatus::InvalidCaHandle);

    // A request pending at close ends with the context.
    let orphan = get_async_event(&w, &uvp);
    assert!(!orphan.is_done());
    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(
        orphan.completion().unwrap().status,
        ib_types::status::NtStatus::CANCELLED
    );
    assert_eq!(other.close(&w), IbStatus::Success);
    assert_eq!(uvp.process().exit(), 0);
    k.finish(&w);
    w.finish();
}

#[test]
fn close_waits_for_creates_in_flight_and_user_objects_need_the_caller() {
    let (w, _) = two_hcas(77);
    let uvp = Uvp::open(&w, 17);
    let pd = uvp.alloc_pd(&w);
    let cq = uvp.create_cq(&w, 3);

    // A CreateCq whose commands are still outstanding when the process's
    // close arrives (both from its thread, before the DPC ran).
    let ring = uvp.process().alloc(256).unwrap();
    let dbr = uvp.process().alloc(64).unwrap();
    let layout = CreateCqPriv::new(3, ring, dbr).unwrap();
    let attr = CqAttr {
        cqe: 8,
        comp_vector: 0,
    };
    let mut bytes = vec![0; ib_types::ioctl::request_len::<CreateCq>(CreateCqPriv::SIZE).unwrap()];
    ib_types::ioctl::encode_request::<CreateCq>(
        uvp.ca,
        &attr,
        layout.emit().as_bytes(),
        64,
        &mut bytes,
    )
    .unwrap();
    let (request, creating) = w.raw_request(
        CreateCq::ID.ioctl().raw(),
        RequestorMode::User,
        bytes,
        ib_types::ioctl::response_len::<CreateCq>(64).unwrap(),
    );
    w.hca_at(U).submit_user_request(request, uvp.caller.clone());
    assert!(!creating.is_done(), "the device has not answered yet");
    let closing = submit_user_raw_unsettled::<CloseCa>(&w, &uvp, uvp.ca);
    assert_eq!(
        status_of::<CloseCa>(&closing.completion().unwrap()),
        IbStatus::ResourceBusy
    );
    w.settle();
    let created = response::<CreateCq>(&creating.completion().unwrap()).status;
    assert_eq!(created, IbStatus::Success);

    // A user request without its process (plain submit_request) sees no
    // user context's objects; nor does a kernel request (they are the
    // process's: `user_handles.rs`).
    let c = w.call::<QueryCq>(RequestorMode::User, cq.handle, &Empty, 0);
    assert_eq!(status_of::<QueryCq>(&c), IbStatus::InvalidCqHandle);
    let c = w.call::<AllocPd>(RequestorMode::User, uvp.ca, &Empty, 0);
    assert_eq!(status_of::<AllocPd>(&c), IbStatus::InvalidCaHandle);
    let c = w.call::<DeallocPd>(RequestorMode::User, pd, &Empty, 0);
    assert_eq!(status_of::<DeallocPd>(&c), IbStatus::InvalidPdHandle);
    let c = w.call::<OpenCa>(RequestorMode::User, 0, &OpenCaIn::CURRENT, 64);
    assert_eq!(status_of::<OpenCa>(&c), IbStatus::Unsupported);
    let c = w.call::<QueryCq>(KERNEL, cq.handle, &Empty, 0);
    assert_eq!(status_of::<QueryCq>(&c), IbStatus::InvalidCqHandle);

    // Now the close goes through, taking both CQs.
    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(uvp.process().space().locked_pages(), 0);
    assert_eq!(uvp.process().exit(), 0);
    w.finish();
}

/// Sends `V` down HCA `U`'s device stack (the IOCTL path through the
/// shell's `io_request`) from the test thread at PASSIVE_LEVEL, as a
/// user-mode request of `process` when one is given; returns the
/// completion.
fn through_stack<V: Verb>(
    w: &World,
    process: Option<&Process>,
    handle: u64,
    input: &V::In,
) -> sim_host::request::Completion {
    let mut bytes = vec![0; ib_types::ioctl::request_len::<V>(0).unwrap()];
    ib_types::ioctl::encode_request::<V>(handle, input, &[], 64, &mut bytes).unwrap();
    let (mut request, issuer) = w.raw_request(
        V::ID.ioctl().raw(),
        RequestorMode::User,
        bytes,
        ib_types::ioctl::response_len::<V>(64).unwrap(),
    );
    if let Some(process) = process {
        request.set_process(process.clone());
    }
    w.host.pnp().send_request(w.device_at(U).node(), request);
    w.settle();
    issuer.completion().expect("the request completed")
}

#[test]
fn user_requests_through_the_device_stack_reach_the_user_path_in_their_callers_context() {
    let (w, _) = two_hcas(78);
    let process = Process::new(23);
    // Without its process a user OpenCa has nothing to map into: the
    // kernel path refuses it.
    let c = through_stack::<OpenCa>(&w, None, 0, &OpenCaIn::CURRENT);
    assert_eq!(status_of::<OpenCa>(&c), IbStatus::Unsupported);
    assert_eq!(process.space().device_mapping_count(), 0);

    // With it: a context whose doorbell page is mapped into that process.
    let c = through_stack::<OpenCa>(&w, Some(&process), 0, &OpenCaIn::CURRENT);
    let r = response::<OpenCa>(&c);
    assert_eq!(r.status, IbStatus::Success);
    let ca = r.handle;
    let doorbell = r.output.unwrap().doorbell.unwrap();
    assert_eq!(process.space().device_mapping_count(), 1);
    assert_ne!(doorbell.va, 0);

    // A PD, and a region of the process's memory locked in its space.
    let c = through_stack::<AllocPd>(&w, Some(&process), ca, &Empty);
    let pd = response::<AllocPd>(&c).handle;
    let va = process.alloc(2 * 4096).unwrap();
    let input = ib_types::mr::MrRegister {
        vaddr: va,
        length: 2 * 4096,
        access: AccessFlags::LOCAL_WRITE,
    };
    let c = through_stack::<ib_types::ioctl::RegMr>(&w, Some(&process), pd, &input);
    assert_eq!(status_of::<ib_types::ioctl::RegMr>(&c), IbStatus::Success);
    assert_eq!(process.space().locked_pages(), 2);

    // Another process naming the context's objects is refused.
    let other = Process::new(24);
    let c = through_stack::<AllocPd>(&w, Some(&other), ca, &Empty);
    assert_eq!(status_of::<AllocPd>(&c), IbStatus::InvalidCaHandle);

    // Close through the stack: the doorbell unmapped, the pages unlocked.
    let c = through_stack::<CloseCa>(&w, Some(&process), ca, &Empty);
    assert_eq!(status_of::<CloseCa>(&c), IbStatus::Success);
    assert_eq!(process.space().device_mapping_count(), 0);
    assert_eq!(process.space().locked_pages(), 0);
    assert_eq!(process.exit(), 0);
    w.finish();
}

/// A user ResizeCq request of `cq` to `2^log` CQEs with its new ring at
/// `ring` (private bytes `private` if given, else the valid record).
fn resize_request(
    w: &World,
    uvp: &Uvp,
    cq: u64,
    cqe: u32,
    private: &[u8],
) -> (
    sim_host::request::HostRequest,
    sim_host::request::RequestHandle,
) {
    use ib_types::ioctl::ResizeCq;
    let attr = CqAttr {
        cqe,
        comp_vector: 0,
    };
    let mut bytes = vec![0; ib_types::ioctl::request_len::<ResizeCq>(private.len()).unwrap()];
    ib_types::ioctl::encode_request::<ResizeCq>(cq, &attr, private, 0, &mut bytes).unwrap();
    let _ = uvp;
    w.raw_request(
        ResizeCq::ID.ioctl().raw(),
        RequestorMode::User,
        bytes,
        ib_types::ioctl::response_len::<ResizeCq>(0).unwrap(),
    )
}

/// Resizes a user CQ synchronously; on success the test-side CQ moves to
/// the new ring, polled from 0 (PRM 6.2).
fn resize(w: &World, uvp: &Uvp, cq: &mut UserCq, log: u8) -> IbStatus {
    use ib_types::ioctl::ResizeCq;
    let ring = uvp.process().alloc(32 << log).unwrap();
    let layout = hca_prm::uverbs::ResizeCqPriv::new(log, ring).unwrap();
    let c = uvp.call::<ResizeCq>(
        w,
        cq.handle,
        &CqAttr {
            cqe: 1 << log,
            comp_vector: 0,
        },
        layout.emit().as_bytes(),
    );
    let r = response::<ResizeCq>(&c);
    if r.status == IbStatus::Success {
        assert_eq!(r.output.unwrap().cqe, 1 << log);
        cq.ring = ring;
        cq.log = log;
        // SAFETY: the new ring is an allocation of this process, which
        // outlives the CQ; atomic words, reached by DMA only.
        unsafe { cq.fast.resized(&layout) }.unwrap();
    }
    r.status
}

#[test]
fn a_user_cq_resized_under_traffic_loses_no_completion_and_a_failed_resize_keeps_the_old_ring() {
    let (w, ips) = two_hcas(79);
    let uvp = Uvp::open(&w, 31);
    let pd = uvp.alloc_pd(&w);
    let mut cq = uvp.create_cq(&w, 3);
    let mut qp = uvp.create_qp(&w, QpType::Rc, pd, &cq);
    let k = Kernel::new(&w, QpType::Rc);
    connect_rc(&w, &uvp, (qp.handle, qp.qpn), &k, ips);
    let buf = uvp.process().alloc(8 * 512).unwrap();
    let region = uvp.register(&w, pd, buf, 8 * 512);
    // Message `n` is `100 + n` bytes: a completion's length names it.
    let mut sent = 0u32;
    let mut received: Vec<u32> = Vec::new();
    let post_receives = |uvp: &Uvp, qp: &mut UserQp, count: u32| {
        for _ in 0..count {
            let slot = u64::from(qp.recvs_posted & 7) * 512;
            uvp.post_recv(qp, &[Sge::new(buf + slot, 512, region.lkey)]);
        }
    };
    // The kernel side polls its send completions as it goes (its send
    // queue holds 8).
    let send = |w: &World, k: &Kernel, count: u32, sent: &mut u32| {
        for _ in 0..count {
            let len = 100 + *sent;
            k.write(0, &pattern(*sent as u8, len as usize));
            k.post_send(w, u64::from(*sent), vec![k.sge(0, len)]);
            let done = k.poll(w);
            assert_eq!(done.len(), 1);
            assert_eq!(
                (done[0].wr_id, done[0].status),
                (u64::from(*sent), WcStatus::Success)
            );
            *sent += 1;
        }
    };
    let take = |wcs: Vec<WorkCompletion>, received: &mut Vec<u32>| {
        for wc in wcs {
            assert_eq!(wc.status, WcStatus::Success);
            received.push(wc.byte_len - 100);
        }
    };

    // Six messages; the UVP takes two and leaves four in the 8-entry ring
    // (its consumer record says 2).
    post_receives(&uvp, &mut qp, 6);
    send(&w, &k, 6, &mut sent);
    let first = uvp.poll_at_most(&mut cq, 2);
    assert_eq!(first.len(), 2);
    take(first, &mut received);

    // A resize to 2 entries cannot hold the four outstanding: refused,
    // nothing pinned or taken for it, and the old ring still in use: the
    // four and a seventh message are polled from it.
    let locked = uvp.process().space().locked_pages();
    let usage = w.hca_at(U).memory_translation().unwrap().usage();
    assert_eq!(resize(&w, &uvp, &mut cq, 1), IbStatus::InvalidCqSize);
    assert_eq!(uvp.process().space().locked_pages(), locked);
    assert_eq!(w.hca_at(U).memory_translation().unwrap().usage(), usage);
    assert_eq!(cq.log, 3);
    post_receives(&uvp, &mut qp, 1);
    send(&w, &k, 1, &mut sent);
    take(uvp.poll(&mut cq), &mut received);
    assert_eq!(received, (0..7).collect::<Vec<_>>());

    // Two more left in the old ring, unpolled.
    post_receives(&uvp, &mut qp, 2);
    send(&w, &k, 2, &mut sent);

    // Grow to 32 while two more messages are in flight: the resize
    // request's commands and the sends' completions race in one run of
    // the machine. The UVP does not poll until its request is answered.
    post_receives(&uvp, &mut qp, 2);
    let new_ring = uvp.process().alloc(32 << 5).unwrap();
    let layout = hca_prm::uverbs::ResizeCqPriv::new(5, new_ring).unwrap();
    let (request, issuer) = resize_request(&w, &uvp, cq.handle, 32, layout.emit().as_bytes());
    for n in 0..2u32 {
        let len = 100 + sent + n;
        k.write(
            4096 + (n as usize) * 1024,
            &pattern((sent + n) as u8, len as usize),
        );
    }
    {
        let (hca, sink, kqp, base, lkey, start) = (
            w.hca_at(K),
            Arc::new(Mutex::new(Vec::new())),
            k.qp,
            k.region.start() + 4096,
            k.region.lkey(),
            sent,
        );
        let sink2 = sink.clone();
        w.in_dpc(move || {
            for n in 0..2u32 {
                let sges = [Sge::new(base + u64::from(n) * 1024, 100 + start + n, lkey)];
                let wr = SendWr {
                    wr_id: u64::from(start + n),
                    op: SendOp::Send,
                    flags: SendFlags::SIGNALED,
                    sg_list: &sges,
                    ud: None,
                };
                let requests = [SendRequest {
                    wr,
                    av: None,
                    inline: None,
                }];
                support::lock(&sink2).push(hca.post_send(kqp, &requests));
            }
        });
        w.hca_at(U).submit_user_request(request, uvp.caller.clone());
        assert!(!issuer.is_done(), "the device has not answered yet");
        // A close meanwhile is refused: the resize is under way.
        let closing = submit_user_raw_unsettled::<CloseCa>(&w, &uvp, uvp.ca);
        assert_eq!(
            status_of::<CloseCa>(&closing.completion().unwrap()),
            IbStatus::ResourceBusy
        );
        w.settle();
        assert_eq!(
            *support::lock(&sink),
            vec![(1, IbStatus::Success), (1, IbStatus::Success)]
        );
    }
    sent += 2;
    assert_eq!(k.poll(&w).len(), 2);
    let r = issuer.completion().unwrap();
    assert_eq!(
        response::<ib_types::ioctl::ResizeCq>(&r).status,
        IbStatus::Success
    );
    cq.ring = new_ring;
    cq.log = 5;
    // SAFETY: the new ring is an allocation of this process, which
    // outlives the CQ; atomic words, reached by DMA only.
    unsafe { cq.fast.resized(&layout) }.unwrap();
    // The new ring holds the two left behind and the two sent meanwhile,
    // in order; none lost, none twice.
    take(uvp.poll(&mut cq), &mut received);
    assert_eq!(received, (0..11).collect::<Vec<_>>());
    let c = uvp.call::<QueryCq>(&w, cq.handle, &Empty, &[]);
    assert_eq!(response::<QueryCq>(&c).output.unwrap().cqe, 32);

    // Traffic continues into the new ring's slots beyond the old ring's
    // size (the receive queue holds 8, so the provider polls each batch
    // before it posts the next: their receive WQEs are free only then).
    for _ in 0..2 {
        post_receives(&uvp, &mut qp, 8);
        send(&w, &k, 8, &mut sent);
        take(uvp.poll(&mut cq), &mut received);
    }
    assert!(cq.fast.consumer() > 8);
    assert_eq!(received, (0..sent).collect::<Vec<_>>());
    // Each message's bytes arrived (the last one checked).
    let last = sent - 1;
    let mut got = vec![0; (100 + last) as usize];
    let slot = u64::from((qp.recvs_posted - 1) & 7) * 512;
    uvp.process().read(buf + slot, &mut got).unwrap();
    assert_eq!(got, pattern(last as u8, (100 + last) as usize));

    // Shrinking back to 8 with nothing outstanding works too.
    assert_eq!(resize(&w, &uvp, &mut cq, 3), IbStatus::Success);
    post_receives(&uvp, &mut qp, 3);
    send(&w, &k, 3, &mut sent);
    take(uvp.poll(&mut cq), &mut received);
    assert_eq!(received, (0..sent).collect::<Vec<_>>());

    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(uvp.process().space().locked_pages(), 0);
    assert_eq!(uvp.process().exit(), 0);
    k.finish(&w);
    w.finish();
}

/// The kernel client RDMA-writes `bytes` (staged at offset 0 of its
/// buffer) to `addr` through `rkey`; returns its completion's status.
fn kernel_rdma_write(
    w: &World,
    k: &Kernel,
    wr_id: u64,
    bytes: &[u8],
    addr: u64,
    rkey: ib_types::wr::RKey,
) -> WcStatus {
    k.write(0, bytes);
    let out = Arc::new(Mutex::new(None));
    let (hca, sink, qp, sge) = (w.hca_at(K), out.clone(), k.qp, k.sge(0, bytes.len() as u32));
    w.in_dpc(move || {
        let sges = [sge];
        let wr = SendWr {
            wr_id,
            op: SendOp::RdmaWrite {
                remote: ib_types::wr::RemoteAddr { addr, rkey },
            },
            flags: SendFlags::SIGNALED,
            sg_list: &sges,
            ud: None,
        };
        let requests = [SendRequest {
            wr,
            av: None,
            inline: None,
        }];
        *support::lock(&sink) = Some(hca.post_send(qp, &requests));
    });
    w.settle();
    assert_eq!(support::lock(&out).take(), Some((1, IbStatus::Success)));
    let wcs = k.poll(w);
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].wr_id, wr_id);
    wcs[0].status
}

#[test]
fn user_windows_bound_by_user_wqes_rereg_and_shared_regions_work_and_old_keys_are_refused() {
    use ib_types::ioctl::{AllocMw, DeallocMw, DeregMr, QueryMw, RegSharedMr, ReregMr};
    use ib_types::mr::{MrRereg, MrShare, MwAttr, MwType};
    use ib_types::wr::{MwBind, RKey};
    let (w, ips) = two_hcas(80);
    let uvp = Uvp::open(&w, 41);
    let other = Uvp::open(&w, 42);
    let pd = uvp.alloc_pd(&w);
    let mut cq = uvp.create_cq(&w, 4);
    let mut qp = uvp.create_qp(&w, QpType::Rc, pd, &cq);
    let k = Kernel::new(&w, QpType::Rc);
    connect_rc(&w, &uvp, (qp.handle, qp.qpn), &k, ips);

    // Region A allows binding; a type 2 window in the same PD.
    let a_buf = uvp.process().alloc(8192).unwrap();
    let input = ib_types::mr::MrRegister {
        vaddr: a_buf,
        length: 8192,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
    };
    let c = uvp.call::<ib_types::ioctl::RegMr>(&w, pd, &input, &[]);
    let r = response::<ib_types::ioctl::RegMr>(&c);
    assert_eq!(r.status, IbStatus::Success);
    let (a_mr, a_keys) = (r.handle, r.output.unwrap());
    let attr = MwAttr {
        mw_type: MwType::Type2,
        rkey: RKey::new(0),
    };
    let c = uvp.call::<AllocMw>(&w, pd, &attr, &[]);
    let r = response::<AllocMw>(&c);
    assert_eq!(r.status, IbStatus::Success);
    let (mw, first_rkey) = (r.handle, r.output.unwrap().rkey);
    let c = uvp.call::<QueryMw>(&w, mw, &Empty, &[]);
    let q = response::<QueryMw>(&c).output.unwrap();
    assert_eq!((q.pd.raw(), q.attr.rkey), (pd, first_rkey));
    // Not another process's to query, free, or allocate in.
    let c = other.call::<QueryMw>(&w, mw, &Empty, &[]);
    assert_eq!(status_of::<QueryMw>(&c), IbStatus::InvalidMwHandle);
    let c = other.call::<DeallocMw>(&w, mw, &Empty, &[]);
    assert_eq!(status_of::<DeallocMw>(&c), IbStatus::InvalidMwHandle);
    let c = other.call::<AllocMw>(&w, pd, &attr, &[]);
    assert_eq!(status_of::<AllocMw>(&c), IbStatus::InvalidPdHandle);

    // The UVP binds it with a WQE of its own over A[1024, 3072) with a
    // new tag, and rings its own doorbell.
    let raw = first_rkey.get();
    let bound_rkey = RKey::new((raw & !0xFF) | (raw.wrapping_add(1) & 0xFF));
    let wr = SendWr {
        wr_id: 0,
        op: SendOp::BindMw {
            mw: ib_types::handle::MwHandle::from_raw(mw),
            rkey: bound_rkey,
            bind: MwBind {
                mr_lkey: a_keys.lkey,
                addr: a_buf + 1024,
                length: 2048,
                access: AccessFlags::REMOTE_WRITE,
            },
        },
        flags: SendFlags::SIGNALED,
        sg_list: &[],
        ud: None,
    };
    uvp.post_send(&mut qp, &wr, None);
    w.settle();
    let wcs = uvp.poll(&mut cq);
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].status, WcStatus::Success);
    let c = uvp.call::<QueryMw>(&w, mw, &Empty, &[]);
    assert_eq!(
        response::<QueryMw>(&c).output.unwrap().attr.rkey,
        bound_rkey
    );

    // The peer writes through the window's key; the bytes land in A.
    let data = pattern(9, 2000);
    assert_eq!(
        kernel_rdma_write(&w, &k, 1, &data, a_buf + 1024, bound_rkey),
        WcStatus::Success
    );
    let mut got = vec![0; 2000];
    uvp.process().read(a_buf + 1024, &mut got).unwrap();
    assert_eq!(got, data);
    // A region with a window bound is not deregistered.
    uvp.expect::<DeregMr>(&w, a_mr, &Empty, IbStatus::ResourceBusy);

    // Re-registration of region B to a new range C of the process: new
    // keys, B's pages unlocked, C's locked with the caller's locker.
    let b_buf = uvp.process().alloc(4096).unwrap();
    let b = uvp.register(&w, pd, b_buf, 4096);
    let c = uvp.call::<ib_types::ioctl::QueryMr>(&w, b.handle, &Empty, &[]);
    let b_keys = response::<ib_types::ioctl::QueryMr>(&c)
        .output
        .unwrap()
        .keys;
    let locked = uvp.process().space().locked_pages();
    let c_buf = uvp.process().alloc(8192).unwrap();
    let rereg = MrRereg {
        translation: Some((c_buf, 8192)),
        ..MrRereg::default()
    };
    // Not another process's region, nor into another process's PD.
    let c = other.call::<ReregMr>(&w, b.handle, &rereg, &[]);
    assert_eq!(status_of::<ReregMr>(&c), IbStatus::InvalidMrHandle);
    let other_pd = other.alloc_pd(&w);
    let to_other = MrRereg {
        pd: Some(PdHandle::from_raw(other_pd)),
        ..MrRereg::default()
    };
    uvp.expect::<ReregMr>(&w, b.handle, &to_other, IbStatus::InvalidPdHandle);
    let c = uvp.call::<ReregMr>(&w, b.handle, &rereg, &[]);
    let r = response::<ReregMr>(&c);
    assert_eq!(r.status, IbStatus::Success);
    let c_keys = r.output.unwrap();
    assert_ne!(c_keys.rkey, b_keys.rkey);
    assert_eq!(uvp.process().space().locked_pages(), locked - 1 + 2);

    // Shared into the same PD at another address: the same pages as C.
    let share = MrShare {
        pd: PdHandle::from_raw(pd),
        vaddr: 0x7000_0000,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    };
    let c = other.call::<RegSharedMr>(&w, b.handle, &share, &[]);
    assert_eq!(status_of::<RegSharedMr>(&c), IbStatus::InvalidMrHandle);
    let c = uvp.call::<RegSharedMr>(&w, b.handle, &share, &[]);
    let r = response::<RegSharedMr>(&c);
    assert_eq!(r.status, IbStatus::Success);
    let (shared, shared_out) = (r.handle, r.output.unwrap());
    let c = uvp.call::<ib_types::ioctl::QueryMr>(&w, shared, &Empty, &[]);
    assert_eq!(
        response::<ib_types::ioctl::QueryMr>(&c)
            .output
            .unwrap()
            .vaddr,
        shared_out.vaddr
    );

    // The peer writes through C's new key, and through the shared one.
    let data = pattern(21, 3000);
    assert_eq!(
        kernel_rdma_write(&w, &k, 2, &data, c_buf + 100, c_keys.rkey),
        WcStatus::Success
    );
    let mut got = vec![0; 3000];
    uvp.process().read(c_buf + 100, &mut got).unwrap();
    assert_eq!(got, data);
    let data = pattern(33, 1500);
    assert_eq!(
        kernel_rdma_write(
            &w,
            &k,
            3,
            &data,
            shared_out.vaddr + 5000,
            shared_out.keys.rkey
        ),
        WcStatus::Success
    );
    let mut got = vec![0; 1500];
    uvp.process().read(c_buf + 5000, &mut got).unwrap();
    assert_eq!(got, data);

    // B's old key is refused by the responder (the connection then
    // breaks, so this comes last), and nothing was written.
    uvp.process().write(b_buf, &[0u8; 64]).unwrap();
    assert_eq!(
        kernel_rdma_write(&w, &k, 4, &pattern(44, 64), b_buf, b_keys.rkey),
        WcStatus::RemAccessErr
    );
    let mut got = vec![0; 64];
    uvp.process().read(b_buf, &mut got).unwrap();
    assert_eq!(got, vec![0u8; 64]);

    // Close with the window still bound and three regions: the window
    // goes first, then the regions; nothing stays locked.
    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(uvp.process().space().locked_pages(), 0);
    assert_eq!(uvp.process().exit(), 0);
    assert_eq!(other.close(&w), IbStatus::Success);
    assert_eq!(other.process().exit(), 0);
    k.finish(&w);
    w.finish();
}

/// The kernel client on HCA `K` sends `payload` from its UD QP to the
/// multicast group `ip` (Q_Key 0x11); returns its completion status.
fn kernel_send_to_group(w: &World, k: &Kernel, payload: &[u8], ip: [u8; 4]) -> WcStatus {
    k.write(0, payload);
    let av = hca_prm::av::Av::try_from(&av_to(ip)).unwrap();
    let out = Arc::new(Mutex::new(None));
    let (hca, sink, kqp, sge) = (
        w.hca_at(K),
        out.clone(),
        k.qp,
        k.sge(0, payload.len() as u32),
    );
    w.in_dpc(move || {
        let sges = [sge];
        let wr = SendWr {
            wr_id: 90,
            op: SendOp::Send,
            flags: SendFlags::SIGNALED,
            sg_list: &sges,
            ud: Some(ib_types::wr::UdDest {
                av: ib_types::handle::AvHandle::from_raw(1),
                remote_qpn: Qpn::new(0xFF_FFFF).unwrap(),
                remote_qkey: QKey::new(0x11),
            }),
        };
        let requests = [SendRequest {
            wr,
            av: Some(av),
            inline: None,
        }];
        *support::lock(&sink) = Some(hca.post_send(kqp, &requests));
    });
    w.settle();
    assert_eq!(support::lock(&out).take(), Some((1, IbStatus::Success)));
    let wcs = k.poll(w);
    assert_eq!(wcs.len(), 1);
    wcs[0].status
}

#[test]
fn a_user_ud_qp_joins_a_multicast_group_and_leaves_it_on_detach_destroy_and_close() {
    use ib_types::ioctl::{AttachMcast, DetachMcast};
    use ib_types::mcast::McastGroup;
    let (w, _) = two_hcas(81);
    let uvp = Uvp::open(&w, 51);
    let other = Uvp::open(&w, 52);
    let pd = uvp.alloc_pd(&w);
    let mut cq = uvp.create_cq(&w, 4);
    let mut qp = uvp.create_qp(&w, QpType::Ud, pd, &cq);
    let rc_qp = uvp.create_qp(&w, QpType::Rc, pd, &cq);
    let k = Kernel::new(&w, QpType::Ud);
    for m in to_rts(QpType::Ud, 0, [0; 4]) {
        assert_eq!(uvp.modify(&w, qp.handle, &m), IbStatus::Success);
        assert_eq!(k.modify(&w, &m), IbStatus::Success);
    }
    let buf = uvp.process().alloc(8192).unwrap();
    let region = uvp.register(&w, pd, buf, 8192);
    const GROUP: [u8; 4] = [239, 5, 6, 7];
    let group = McastGroup {
        mgid: Gid::from_ipv4(GROUP),
        mlid: Lid::UNASSIGNED,
    };

    // Only the owner attaches its QP, and only a UD QP.
    let c = other.call::<AttachMcast>(&w, qp.handle, &group, &[]);
    assert_eq!(status_of::<AttachMcast>(&c), IbStatus::InvalidQpHandle);
    uvp.expect::<AttachMcast>(&w, rc_qp.handle, &group, IbStatus::InvalidServiceType);
    let c = uvp.call::<AttachMcast>(&w, qp.handle, &group, &[]);
    let r = response::<AttachMcast>(&c);
    assert_eq!(r.status, IbStatus::Success);
    let membership = r.handle;

    // The peer's datagram to the group reaches the user QP.
    let payload = pattern(61, 900);
    uvp.post_recv(&mut qp, &[Sge::new(buf, 2048, region.lkey)]);
    assert_eq!(
        kernel_send_to_group(&w, &k, &payload, GROUP),
        WcStatus::Success
    );
    let wcs = uvp.poll(&mut cq);
    assert_eq!(wcs.len(), 1);
    let wc = wcs[0];
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 940));
    let mut got = vec![0; 900];
    uvp.process().read(buf + 40, &mut got).unwrap();
    assert_eq!(got, payload);

    // Another process cannot detach it; the owner can, and then nothing
    // arrives.
    let c = other.call::<DetachMcast>(&w, membership, &Empty, &[]);
    assert_eq!(status_of::<DetachMcast>(&c), IbStatus::InvalidMcastHandle);
    uvp.expect::<DetachMcast>(&w, membership, &Empty, IbStatus::Success);
    uvp.expect::<DetachMcast>(&w, membership, &Empty, IbStatus::InvalidMcastHandle);
    uvp.post_recv(&mut qp, &[Sge::new(buf + 4096, 2048, region.lkey)]);
    assert_eq!(
        kernel_send_to_group(&w, &k, &payload, GROUP),
        WcStatus::Success
    );
    assert!(uvp.poll(&mut cq).is_empty());

    // Attached again, then the QP destroyed: the membership goes with it.
    let c = uvp.call::<AttachMcast>(&w, qp.handle, &group, &[]);
    let again = response::<AttachMcast>(&c).handle;
    uvp.expect::<DestroyQp>(&w, qp.handle, &Empty, IbStatus::Success);
    uvp.expect::<DetachMcast>(&w, again, &Empty, IbStatus::InvalidMcastHandle);
    // The receive the destroyed QP never consumed is flushed.
    let flushed = uvp.poll(&mut cq);
    assert_eq!(flushed.len(), 1);
    assert_eq!(flushed[0].status, WcStatus::WrFlushErr);

    // A new UD QP attached and left attached at close: close detaches it
    // (the QP's destroy does), and a datagram after close reaches nobody.
    let mut last = uvp.create_qp(&w, QpType::Ud, pd, &cq);
    for m in to_rts(QpType::Ud, 0, [0; 4]) {
        assert_eq!(uvp.modify(&w, last.handle, &m), IbStatus::Success);
    }
    uvp.expect::<AttachMcast>(&w, last.handle, &group, IbStatus::Success);
    uvp.post_recv(&mut last, &[Sge::new(buf, 2048, region.lkey)]);
    assert_eq!(
        kernel_send_to_group(&w, &k, &payload, GROUP),
        WcStatus::Success
    );
    assert_eq!(uvp.poll(&mut cq).len(), 1);
    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(
        kernel_send_to_group(&w, &k, &payload, GROUP),
        WcStatus::Success
    );
    assert_eq!(uvp.process().space().locked_pages(), 0);
    assert_eq!(uvp.process().exit(), 0);
    assert_eq!(other.close(&w), IbStatus::Success);
    k.finish(&w);
    w.finish();
}

#[test]
fn hostile_resize_records_and_region_changes_are_refused_and_change_nothing() {
    use hca_prm::Le64;
    use hca_prm::uverbs::{ResizeCqPriv, ResizeCqPrivAbi};
    use ib_types::ioctl::{AllocMw, ReregMr, ResizeCq};
    use ib_types::mr::{MrRereg, MwAttr, MwType};
    use sim_host::memory::Protection;
    let (w, _) = two_hcas(82);
    let uvp = Uvp::open(&w, 61);
    let other = Uvp::open(&w, 62);
    let pd = uvp.alloc_pd(&w);
    let cq = uvp.create_cq(&w, 3);
    let p = uvp.process();
    let ring = p.alloc(8192).unwrap();
    let read_only = p.alloc_with(4096, Protection::ReadOnly).unwrap();
    let good = ResizeCqPriv::new(5, ring).unwrap().emit();
    let resize_status = |caller: &Uvp, cq: u64, cqe: u32, bytes: &[u8]| {
        let attr = CqAttr {
            cqe,
            comp_vector: 0,
        };
        status_of::<ResizeCq>(&caller.call::<ResizeCq>(&w, cq, &attr, bytes))
    };
    let with = |f: &dyn Fn(&mut ResizeCqPrivAbi)| {
        let mut abi = good;
        f(&mut abi);
        abi
    };
    // A kernel client's CQ on the same HCA (not the user's to resize).
    let kca =
        response::<OpenCa>(&w.call_in_dpc_at::<OpenCa>(U, KERNEL, 0, &OpenCaIn::CURRENT, 0)).handle;
    let attr = CqAttr {
        cqe: 8,
        comp_vector: 0,
    };
    let kcq = response::<CreateCq>(&w.call_in_dpc_at::<CreateCq>(U, KERNEL, kca, &attr, 0)).handle;
    let before = footprint(&w, &uvp);
    let bad = IbStatus::InvalidParameter;
    let cases: Vec<(ResizeCqPrivAbi, u32, IbStatus)> = vec![
        // Misaligned ring, reserved bytes, a length that is not the log's.
        (with(&|a| a.ring_va = Le64::new(ring + 8)), 32, bad),
        (with(&|a| a.reserved_at_0x11[0] = 1), 32, bad),
        (with(&|a| a.ring_bytes = Le64::new(2048)), 32, bad),
        // A ring that wraps, and a log no shift survives.
        (with(&|a| a.ring_va = Le64::new(u64::MAX - 1023)), 32, bad),
        (with(&|a| a.log_entries = 200), 32, bad),
        // Beyond the device's CQ size; more CQEs asked than the ring holds.
        (
            ResizeCqPriv::new(24, 0x10_0000_0000).unwrap().emit(),
            1,
            IbStatus::InvalidCqSize,
        ),
        (good, 33, IbStatus::InvalidCqSize),
        // Over the CQ's own consumer record, or over its current ring.
        (with(&|a| a.ring_va = Le64::new(cq.dbr & !63)), 32, bad),
        (with(&|a| a.ring_va = Le64::new(cq.ring)), 32, bad),
        // Memory the process does not have, kernel memory, read-only pages.
        (
            with(&|a| a.ring_va = Le64::new(ring + 0x10_0000)),
            32,
            IbStatus::InvalidPermission,
        ),
        (
            with(&|a| a.ring_va = Le64::new(sim_host::memory::KERNEL_VA_BASE)),
            32,
            IbStatus::InvalidPermission,
        ),
        (
            with(&|a| a.ring_va = Le64::new(read_only)),
            32,
            IbStatus::InvalidPermission,
        ),
    ];
    for (i, (abi, cqe, expected)) in cases.iter().enumerate() {
        assert_eq!(
            resize_status(&uvp, cq.handle, *cqe, abi.as_bytes()),
            *expected,
            "case {i}"
        );
        assert_eq!(footprint(&w, &uvp), before, "case {i}");
    }
    // Short and long records; no record.
    assert_eq!(
        resize_status(&uvp, cq.handle, 32, &good.as_bytes()[..23]),
        bad
    );
    let mut long = good.as_bytes().to_vec();
    long.push(0);
    assert_eq!(resize_status(&uvp, cq.handle, 32, &long), bad);
    assert_eq!(resize_status(&uvp, cq.handle, 32, &[]), bad);
    // Another process's CQ, a PD handle, a kernel CQ.
    assert_eq!(
        resize_status(&other, cq.handle, 32, good.as_bytes()),
        IbStatus::InvalidCqHandle
    );
    assert_eq!(
        resize_status(&uvp, pd, 32, good.as_bytes()),
        IbStatus::InvalidCqHandle
    );
    assert_eq!(
        resize_status(&uvp, kcq, 32, good.as_bytes()),
        IbStatus::InvalidCqHandle
    );
    assert_eq!(footprint(&w, &uvp), before);

    // A kernel request cannot resize a user CQ either (its ring is the
    // provider's): refused, nothing changed.
    let c = w.call_in_dpc_at::<ResizeCq>(
        U,
        KERNEL,
        cq.handle,
        &CqAttr {
            cqe: 64,
            comp_vector: 0,
        },
        0,
    );
    assert_eq!(status_of::<ResizeCq>(&c), IbStatus::InvalidCqHandle);
    assert_eq!(footprint(&w, &uvp), before);

    // Arbitrary private bytes: never a success, never a change.
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        cases: 96,
        ..Default::default()
    });
    let strategy = proptest::collection::vec(proptest::prelude::any::<u8>(), 0..48);
    runner
        .run(&strategy, |bytes| {
            proptest::prop_assert_ne!(
                resize_status(&uvp, cq.handle, 32, &bytes),
                IbStatus::Success
            );
            proptest::prop_assert_eq!(footprint(&w, &uvp), footprint_of(&before));
            Ok(())
        })
        .unwrap();

    // Region changes: a re-registration to memory the process lacks or
    // to kernel memory is refused, the region intact with its keys.
    let buf = p.alloc(4096).unwrap();
    let region = uvp.register(&w, pd, buf, 4096);
    let c = uvp.call::<ib_types::ioctl::QueryMr>(&w, region.handle, &Empty, &[]);
    let kept = response::<ib_types::ioctl::QueryMr>(&c).output.unwrap();
    let before = footprint(&w, &uvp);
    for va in [ring + 0x10_0000, sim_host::memory::KERNEL_VA_BASE] {
        let rereg = MrRereg {
            translation: Some((va, 4096)),
            ..MrRereg::default()
        };
        uvp.expect::<ReregMr>(&w, region.handle, &rereg, IbStatus::InvalidPermission);
        assert_eq!(footprint(&w, &uvp), before);
        let c = uvp.call::<ib_types::ioctl::QueryMr>(&w, region.handle, &Empty, &[]);
        let now = response::<ib_types::ioctl::QueryMr>(&c).output.unwrap();
        assert_eq!(
            (now.keys, now.vaddr, now.length),
            (kept.keys, kept.vaddr, kept.length)
        );
    }
    // A window in a kernel PD, or in another process's PD.
    let kpd = response::<AllocPd>(&w.call_in_dpc_at::<AllocPd>(U, KERNEL, kca, &Empty, 0)).handle;
    let other_pd = other.alloc_pd(&w);
    let attr = MwAttr {
        mw_type: MwType::Type2,
        rkey: ib_types::wr::RKey::new(0),
    };
    for target in [kpd, other_pd, cq.handle] {
        uvp.expect::<AllocMw>(&w, target, &attr, IbStatus::InvalidPdHandle);
    }
    assert_eq!(footprint(&w, &uvp), before);

    // After all that, a valid resize works.
    let mut cq = cq;
    assert_eq!(resize(&w, &uvp, &mut cq, 5), IbStatus::Success);
    free_kernel_cq_pd_and_ca(&w, kcq, kpd, kca);
    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(other.close(&w), IbStatus::Success);
    assert_eq!(uvp.process().exit(), 0);
    w.finish();
}

/// The two events a user context hears when its CQ and QP are lost (in
/// any order): the CQ's error and the QP's fatal error.
#[track_caller]
fn assert_told_cq_error_and_qp_fatal(
    mut told: Vec<(ib_types::event::AsyncEventCode, u64)>,
    cq: &UserCq,
    qp: &UserQp,
) {
    use ib_types::event::AsyncEventCode;
    told.sort_by_key(|(_, handle)| *handle);
    let mut expected = vec![
        (AsyncEventCode::CqError, cq.handle),
        (AsyncEventCode::QpFatal, qp.handle),
    ];
    expected.sort_by_key(|(_, handle)| *handle);
    assert_eq!(told, expected);
}

/// Destroys the QP and its CQ, closes the context, and checks that the
/// process is left with nothing locked and exits cleanly.
#[track_caller]
fn destroy_close_and_exit(w: &World, uvp: &Uvp, qp: &UserQp, cq: &UserCq) {
    uvp.expect::<DestroyQp>(w, qp.handle, &Empty, IbStatus::Success);
    uvp.expect::<DestroyCq>(w, cq.handle, &Empty, IbStatus::Success);
    assert_eq!(uvp.close(w), IbStatus::Success);
    assert_eq!(uvp.process().space().locked_pages(), 0);
    assert_eq!(uvp.process().exit(), 0);
}

#[test]
fn user_objects_do_not_survive_sleep_their_process_is_told_and_they_still_free() {
    // Sleep and resume under a live user context (`verbs::restore`): its
    // CQ and QP cannot be given back to the device (their counters live in
    // the provider), so the process hears of each through GetAsyncEvent,
    // the QP reads ERR, its region keeps its key, and destroy and close
    // free everything.
    use ib_types::ioctl::GetAsyncEvent;
    let (w, _) = two_hcas(79);
    let uvp = Uvp::open(&w, 12);
    let pd = uvp.alloc_pd(&w);
    let cq = uvp.create_cq(&w, 4);
    let qp = uvp.create_qp(&w, QpType::Ud, pd, &cq);
    for m in to_rts(QpType::Ud, 0, [0; 4]) {
        assert_eq!(uvp.modify(&w, qp.handle, &m), IbStatus::Success);
    }
    let buf = uvp.process().alloc(8192).unwrap();
    let region = uvp.register(&w, pd, buf, 8192);
    let waiting = get_async_event(&w, &uvp);
    assert!(!waiting.is_done());

    w.sleep();
    w.resume();

    let mut told = Vec::new();
    let c = waiting.completion().expect("an event after resume");
    let r = response::<GetAsyncEvent>(&c);
    assert_eq!(r.status, IbStatus::Success);
    let record = r.output.unwrap();
    told.push((record.code, record.handle));
    let next = get_async_event(&w, &uvp);
    let c = next.completion().expect("the second event was queued");
    let record = response::<GetAsyncEvent>(&c).output.unwrap();
    told.push((record.code, record.handle));
    assert_told_cq_error_and_qp_fatal(told, &cq, &qp);
    let c = uvp.call::<QueryQp>(&w, qp.handle, &Empty, &[]);
    assert_eq!(response::<QueryQp>(&c).output.unwrap().state, QpState::Err);
    let c = uvp.call::<ib_types::ioctl::QueryMr>(&w, region.handle, &Empty, &[]);
    let keys = response::<ib_types::ioctl::QueryMr>(&c).output.unwrap();
    assert_eq!(keys.keys.lkey, region.lkey);

    destroy_close_and_exit(&w, &uvp, &qp, &cq);
    w.finish();
}

#[test]
fn a_catastrophic_error_tells_a_user_context_and_its_objects_still_free() {
    use hca_prm::regs::FatalSyndrome;
    use ib_types::ioctl::GetAsyncEvent;
    let (w, _) = two_hcas(83);
    let uvp = Uvp::open(&w, 13);
    let pd = uvp.alloc_pd(&w);
    let cq = uvp.create_cq(&w, 4);
    let qp = uvp.create_qp(&w, QpType::Ud, pd, &cq);
    let waiting = get_async_event(&w, &uvp);
    w.function_at(U)
        .with_device(|d| d.declare_fatal(FatalSyndrome::Internal));
    w.settle();
    let c = waiting.completion().expect("an event after the failure");
    let first = response::<GetAsyncEvent>(&c).output.unwrap();
    let c = get_async_event(&w, &uvp)
        .completion()
        .expect("the second event was queued");
    let second = response::<GetAsyncEvent>(&c).output.unwrap();
    let told = vec![(first.code, first.handle), (second.code, second.handle)];
    assert_told_cq_error_and_qp_fatal(told, &cq, &qp);
    destroy_close_and_exit(&w, &uvp, &qp, &cq);
    w.finish();
}

#[test]
fn user_modify_ca_is_refused_by_policy_and_changes_no_port() {
    use ib_types::ca::{CaAttrView, CaModify, CaModifyFlags, PortCaps};
    use ib_types::ioctl::{ModifyCa, QueryCa};
    let (w, _) = two_hcas(83);
    let uvp = Uvp::open(&w, 63);
    let other = Uvp::open(&w, 64);
    let kca =
        response::<OpenCa>(&w.call_in_dpc_at::<OpenCa>(U, KERNEL, 0, &OpenCaIn::CURRENT, 0)).handle;
    let needed = response::<QueryCa>(&w.call_in_dpc_at::<QueryCa>(U, KERNEL, kca, &Empty, 16))
        .output
        .unwrap()
        .total_size;
    let port_caps = |port: u8| {
        let c = w.call_in_dpc_at::<QueryCa>(U, KERNEL, kca, &Empty, needed);
        let r = response::<QueryCa>(&c);
        assert_eq!(r.status, IbStatus::Success);
        let view = CaAttrView::parse(r.private).unwrap();
        view.port(PortNum::new(port).unwrap()).unwrap().attr().caps
    };
    let before = [port_caps(1), port_caps(2)];
    assert!(!before[0].contains(PortCaps::IS_SM));
    let footprint_before = footprint(&w, &uvp);
    let set_sm = CaModify::new(
        PortNum::FIRST,
        CaModifyFlags::IS_SM | CaModifyFlags::RESET_QKEY_COUNTER,
        CaModifyFlags::empty(),
    )
    .unwrap();
    // On its own context: refused by policy, no port changed.
    uvp.expect::<ModifyCa>(&w, uvp.ca, &set_sm, IbStatus::InvalidPermission);
    // Another process's context and the kernel's CA are not its handles.
    let c = other.call::<ModifyCa>(&w, uvp.ca, &set_sm, &[]);
    assert_eq!(status_of::<ModifyCa>(&c), IbStatus::InvalidCaHandle);
    uvp.expect::<ModifyCa>(&w, kca, &set_sm, IbStatus::InvalidCaHandle);
    assert_eq!([port_caps(1), port_caps(2)], before);
    assert_eq!(footprint(&w, &uvp), footprint_before);
    // The kernel client (the access layer) still may.
    let c = w.call_in_dpc_at::<ModifyCa>(U, KERNEL, kca, &set_sm, 0);
    assert_eq!(status_of::<ModifyCa>(&c), IbStatus::Success);
    assert!(port_caps(1).contains(PortCaps::IS_SM));
    assert_eq!(uvp.close(&w), IbStatus::Success);
    assert_eq!(other.close(&w), IbStatus::Success);
    assert_eq!(uvp.process().exit(), 0);
    w.finish();
}

/// Sends `V` on a process's handle (`sim_host::file`) and runs the host
/// until it completes.
fn on_handle<V: Verb>(
    w: &World,
    handle: &sim_host::file::FileHandle,
    object: u64,
    input: &V::In,
    private: &[u8],
) -> sim_host::request::Completion {
    let issuer = send_on_handle::<V>(handle, object, input, private);
    w.settle();
    issuer.completion().expect("the request completed")
}

#[test]
fn a_process_exiting_with_user_objects_open_leaves_no_page_locked() {
    let (w, _) = two_hcas(80);
    let process = Process::new(26);
    let node = w.device_at(U).node();
    let handle = w.host.pnp().open_file(&process, node).unwrap();
    let c = on_handle::<OpenCa>(&w, &handle, 0, &OpenCaIn::CURRENT, &[]);
    let ca = response::<OpenCa>(&c).handle;
    let pd = response::<AllocPd>(&on_handle::<AllocPd>(&w, &handle, ca, &Empty, &[])).handle;
    let va = process.alloc(2 * 4096).unwrap();
    let region = ib_types::mr::MrRegister {
        vaddr: va,
        length: 2 * 4096,
        access: AccessFlags::LOCAL_WRITE,
    };
    let c = on_handle::<ib_types::ioctl::RegMr>(&w, &handle, pd, &region, &[]);
    assert_eq!(status_of::<ib_types::ioctl::RegMr>(&c), IbStatus::Success);
    let (ring, dbr) = (process.alloc(32 << 4).unwrap(), process.alloc(64).unwrap());
    let layout = CreateCqPriv::new(4, ring, dbr).unwrap();
    let attr = CqAttr {
        cqe: 1 << 4,
        comp_vector: 0,
    };
    let c = on_handle::<CreateCq>(&w, &handle, ca, &attr, layout.emit().as_bytes());
    assert_eq!(status_of::<CreateCq>(&c), IbStatus::Success);
    let waits = on_handle_pending::<ib_types::ioctl::GetAsyncEvent>(&handle, ca);
    assert!(process.space().locked_pages() > 2);
    assert_eq!(process.space().device_mapping_count(), 1);

    // The process leaks its handle and exits: its wait is cancelled, the
    // miniport's cleanup closes its context (in its context), and nothing
    // of it stays locked or mapped (PROCESS_HAS_LOCKED_PAGES otherwise).
    drop(handle);
    assert_eq!(w.host.pnp().exit_process(&process), 0);
    w.settle();
    assert!(waits.is_done());
    assert_eq!(w.hca_at(U).user_context_count(), 0);
    assert_eq!(w.host.pnp().file_object_count(node), 0);
    w.finish();
}

/// Sends `V` on a handle without waiting for it.
fn on_handle_pending<V: Verb>(
    handle: &sim_host::file::FileHandle,
    object: u64,
) -> sim_host::request::RequestHandle
where
    V::In: Default,
{
    send_on_handle::<V>(handle, object, &V::In::default(), &[])
}

#[test]
fn a_user_request_held_across_sleep_is_served_on_resume_without_touching_the_process() {
    let (w, _) = two_hcas(81);
    let process = Process::new(27);
    let handle = w
        .host
        .pnp()
        .open_file(&process, w.device_at(U).node())
        .unwrap();
    let c = on_handle::<OpenCa>(&w, &handle, 0, &OpenCaIn::CURRENT, &[]);
    let ca = response::<OpenCa>(&c).handle;
    let pd = response::<AllocPd>(&on_handle::<AllocPd>(&w, &handle, ca, &Empty, &[])).handle;
    let va = process.alloc(4096).unwrap();
    let region = ib_types::mr::MrRegister {
        vaddr: va,
        length: 4096,
        access: AccessFlags::LOCAL_WRITE,
    };
    // Sent while the device sleeps: the shell's EvtIoInCallerContext locks
    // the region's page in the issuing thread, the power-managed queue
    // holds the request, and the power manager delivers it on resume,
    // outside the process, where the verb uses only the page locked
    // before (touching the process there would be
    // UserMemoryOutsideProcessContext, which `finish` would report).
    w.sleep();
    let mut bytes = vec![0; ib_types::ioctl::request_len::<ib_types::ioctl::RegMr>(0).unwrap()];
    ib_types::ioctl::encode_request::<ib_types::ioctl::RegMr>(pd, &region, &[], 64, &mut bytes)
        .unwrap();
    let held = handle.send(
        <ib_types::ioctl::RegMr as Verb>::ID.ioctl().raw(),
        bytes,
        ib_types::ioctl::response_len::<ib_types::ioctl::RegMr>(64).unwrap(),
    );
    assert!(!held.is_done());
    assert_eq!(
        process.space().locked_pages(),
        1,
        "locked in the caller's context"
    );
    w.resume();
    let c = held.completion().expect("delivered on resume");
    assert_eq!(
        status_of::<ib_types::ioctl::RegMr>(&c),
        IbStatus::Success,
        "served with what was locked in the caller's context"
    );
    let mr = response::<ib_types::ioctl::RegMr>(&c).handle;
    assert_eq!(process.space().locked_pages(), 1);
    assert!(
        w.host.verifier().violations().is_empty(),
        "{:?}",
        w.host.verifier().violations()
    );
    // The region is the process's: deregistered on its handle, the page
    // unlocked.
    let c = on_handle::<ib_types::ioctl::DeregMr>(&w, &handle, mr, &Empty, &[]);
    assert_eq!(status_of::<ib_types::ioctl::DeregMr>(&c), IbStatus::Success);
    assert_eq!(process.space().locked_pages(), 0);
    handle.close();
    assert_eq!(w.host.pnp().exit_process(&process), 0);
    w.finish();
}

/// Sends `V` on a process's handle without running the host (a request
/// the power-managed queue may hold).
fn send_on_handle<V: Verb>(
    handle: &sim_host::file::FileHandle,
    object: u64,
    input: &V::In,
    private: &[u8],
) -> sim_host::request::RequestHandle {
    let mut bytes = vec![0; ib_types::ioctl::request_len::<V>(private.len()).unwrap()];
    ib_types::ioctl::encode_request::<V>(object, input, private, 64, &mut bytes).unwrap();
    handle.send(
        V::ID.ioctl().raw(),
        bytes,
        ib_types::ioctl::response_len::<V>(64).unwrap(),
    )
}

#[test]
fn open_create_and_close_held_across_sleep_touch_the_process_only_in_its_context() {
    let (w, _) = two_hcas(82);
    let process = Process::new(28);
    let handle = w
        .host
        .pnp()
        .open_file(&process, w.device_at(U).node())
        .unwrap();
    // OpenCa while asleep: the doorbell page is mapped into the process
    // by EvtIoInCallerContext; the context is made on resume.
    w.sleep();
    let open = send_on_handle::<OpenCa>(&handle, 0, &OpenCaIn::CURRENT, &[]);
    assert!(!open.is_done());
    assert_eq!(process.space().device_mapping_count(), 1);
    w.resume();
    let c = open.completion().expect("delivered on resume");
    assert_eq!(status_of::<OpenCa>(&c), IbStatus::Success);
    let ca = response::<OpenCa>(&c).handle;

    // CreateCq while asleep: ring and doorbell record locked in the
    // caller's context, the CQ made on resume.
    let (ring, dbr) = (process.alloc(32 << 4).unwrap(), process.alloc(64).unwrap());
    let layout = CreateCqPriv::new(4, ring, dbr).unwrap();
    let attr = CqAttr {
        cqe: 1 << 4,
        comp_vector: 0,
    };
    w.sleep();
    let create = send_on_handle::<CreateCq>(&handle, ca, &attr, layout.emit().as_bytes());
    assert_eq!(process.space().locked_pages(), 2);
    w.resume();
    let c = create.completion().expect("delivered on resume");
    assert_eq!(status_of::<CreateCq>(&c), IbStatus::Success);
    assert_eq!(process.space().locked_pages(), 2);

    // CloseCa while asleep: the doorbell page is unmapped in the caller's
    // context at once; the objects go on resume.
    w.sleep();
    let close = send_on_handle::<ib_types::ioctl::CloseCa>(&handle, ca, &Empty, &[]);
    assert_eq!(process.space().device_mapping_count(), 0);
    w.resume();
    let c = close.completion().expect("delivered on resume");
    assert_eq!(status_of::<ib_types::ioctl::CloseCa>(&c), IbStatus::Success);
    assert_eq!(process.space().locked_pages(), 0);
    assert_eq!(w.hca_at(U).user_context_count(), 0);
    assert!(
        w.host.verifier().violations().is_empty(),
        "{:?}",
        w.host.verifier().violations()
    );
    handle.close();
    assert_eq!(w.host.pnp().exit_process(&process), 0);
    w.finish();
}

#[test]
fn a_doorbell_page_mapped_for_an_open_cancelled_in_the_queue_is_unmapped_at_the_process_cleanup() {
    let (w, _) = two_hcas(83);
    let process = Process::new(29);
    let handle = w
        .host
        .pnp()
        .open_file(&process, w.device_at(U).node())
        .unwrap();
    // An OpenCa held while the device sleeps had its doorbell page mapped
    // by EvtIoInCallerContext; the process exits before the device
    // resumes, so the framework cancels the request in the queue and the
    // open is never answered with the page: it waits for the process's
    // cleanup, which unmaps it in the process.
    w.sleep();
    let open = send_on_handle::<OpenCa>(&handle, 0, &OpenCaIn::CURRENT, &[]);
    assert_eq!(process.space().device_mapping_count(), 1);
    drop(handle);
    assert_eq!(w.host.pnp().exit_process(&process), 0);
    w.settle();
    assert!(open.is_done(), "cancelled in the queue");
    assert_eq!(process.space().device_mapping_count(), 0);
    w.resume();
    assert_eq!(w.hca_at(U).user_context_count(), 0);
    w.finish();
}

#[test]
fn a_prepared_request_cancelled_in_the_queue_leaves_nothing_locked() {
    let (w, _) = two_hcas(84);
    let process = Process::new(30);
    let handle = w
        .host
        .pnp()
        .open_file(&process, w.device_at(U).node())
        .unwrap();
    let c = on_handle::<OpenCa>(&w, &handle, 0, &OpenCaIn::CURRENT, &[]);
    let ca = response::<OpenCa>(&c).handle;
    let pd = response::<AllocPd>(&on_handle::<AllocPd>(&w, &handle, ca, &Empty, &[])).handle;
    let va = process.alloc(2 * 4096).unwrap();
    let region = ib_types::mr::MrRegister {
        vaddr: va,
        length: 2 * 4096,
        access: AccessFlags::LOCAL_WRITE,
    };
    // Held while the device sleeps, with its pages locked in the caller's
    // context; the process exits before the device resumes: the framework
    // cancels the held request, and the prepared locks go with it.
    w.sleep();
    let held = send_on_handle::<ib_types::ioctl::RegMr>(&handle, pd, &region, &[]);
    assert_eq!(process.space().locked_pages(), 2);
    drop(handle);
    assert_eq!(w.host.pnp().exit_process(&process), 0);
    w.settle();
    assert!(held.is_done());
    assert_eq!(process.space().locked_pages(), 0);
    w.resume();
    assert_eq!(w.hca_at(U).user_context_count(), 0);
    w.finish();
}

#[test]
fn the_queued_phase_uses_only_what_the_caller_context_phase_locked() {
    let (w, _) = two_hcas(85);
    let uvp = Uvp::open(&w, 31);
    let pd = uvp.alloc_pd(&w);
    let (a, b) = (
        uvp.process().alloc(4096).unwrap(),
        uvp.process().alloc(4096).unwrap(),
    );
    let reg = |va: u64| {
        let region = ib_types::mr::MrRegister {
            vaddr: va,
            length: 4096,
            access: AccessFlags::LOCAL_WRITE,
        };
        let mut bytes = vec![0; ib_types::ioctl::request_len::<ib_types::ioctl::RegMr>(0).unwrap()];
        ib_types::ioctl::encode_request::<ib_types::ioctl::RegMr>(pd, &region, &[], 64, &mut bytes)
            .unwrap();
        w.raw_request(
            <ib_types::ioctl::RegMr as Verb>::ID.ioctl().raw(),
            RequestorMode::User,
            bytes,
            ib_types::ioctl::response_len::<ib_types::ioctl::RegMr>(64).unwrap(),
        )
    };
    // Phase 1 for a registration of `a` locks `a`'s page...
    let (mut request_a, _) = reg(a);
    let prepared = w
        .hca_at(U)
        .prepare_user_request(&mut request_a, &uvp.caller);
    assert_eq!(prepared.locked_ranges(), 1);
    assert_eq!(uvp.process().space().locked_pages(), 1);
    driver_platform::Request::complete(request_a, ib_types::status::NtStatus::CANCELLED, 0);
    // ...and a request for `b` run with it is refused: the queued phase
    // never locks what phase 1 did not, so nothing of `b` is locked.
    let (request_b, issuer) = reg(b);
    w.hca_at(U).execute_user_request(request_b, prepared);
    w.settle();
    let c = issuer.completion().expect("answered");
    assert_ne!(status_of::<ib_types::ioctl::RegMr>(&c), IbStatus::Success);
    // The unused lock of `a` went with the prepared request.
    assert_eq!(uvp.process().space().locked_pages(), 0);
    w.finish();
}
