//! Rules of the implementer's guide that no other verb test covers, each
//! on the simulated host with requests built by
//! `ib_types::ioctl::encode_request` and issued from DPCs:
//! - TIME WAIT before a connected QP that was reset reaches RTR again
//!   (guide 6.5.2);
//! - the Table 6-3 trap events (P_Key and Q_Key violations) delivered to
//!   the kernel client's async callback and to user contexts, and a link
//!   flap's PortDown and PortActive to every user context;
//! - Reregister Physical Memory (Table 4-1, mandatory), through the same
//!   re-registration path as Reregister Memory Region.
//!
//! Each test ends with the host shut down and the verifier clean.

mod support;

use std::sync::{Arc, Mutex};

use driver_platform::RequestorMode;
use hca_miniport_core::cmd::Command;
use hca_miniport_core::verbs::CaClient;
use hca_miniport_core::verbs::qp::{QPN_QUIET_PERIOD_NS, SendRequest};
use hca_prm::cmd::{Opcode, port_table_in_mod};
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::handle::{AvHandle, CqHandle, PdHandle};
use ib_types::ioctl::{
    AllocPd, CloseCa, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyQp, Empty, GetAsyncEvent,
    ModifyQp, OpenCa, OpenCaIn, QpCreated, QueryMr, QueryQp, RegPhysMr, ReregPhysMr, Verb,
};
use ib_types::mr::{PhysMrRegister, PhysMrRereg, PhysTranslation};
use ib_types::qp::{QpModify, QpState, QpType};
use ib_types::scalars::{PortNum, Psn, QKey, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::WcStatus;
use ib_types::wr::{RKey, RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest};
use sim_host::caller::HostCaller;
use sim_host::memory::Process;
use sim_host::request::RequestHandle;
use support::kernel_pair::{KernelBuf, Setup, poll_all, setup, teardown};
use support::rc_path::{grh_av, rc_to_rts_steps};
use support::{World, lock, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;

#[track_caller]
fn create(w: &World, s: &Setup, qp_type: QpType) -> (u64, QpCreated) {
    let r = w.call_in_dpc_at::<CreateQp>(
        s.i,
        KERNEL,
        s.ca,
        &support::small_qp_create(qp_type, s.pd, s.cq),
        0,
    );
    let resp = response::<CreateQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    (resp.handle, resp.output.unwrap())
}

fn modify(w: &World, s: &Setup, qp: u64, m: &QpModify) -> IbStatus {
    let r = w.call_in_dpc_at::<ModifyQp>(s.i, KERNEL, qp, m, 0);
    response::<ModifyQp>(&r).status
}

#[track_caller]
fn state(w: &World, s: &Setup, qp: u64) -> QpState {
    let r = w.call_in_dpc_at::<QueryQp>(s.i, KERNEL, qp, &Empty, 0);
    let resp = response::<QueryQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    resp.output.unwrap().state
}

#[track_caller]
fn destroy(w: &World, s: &Setup, qp: u64) {
    let r = w.call_in_dpc_at::<DestroyQp>(s.i, KERNEL, qp, &Empty, 0);
    assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);
}

/// The modifies RESET -> INIT -> RTR -> RTS of a connected QP on port 1.
fn connect_steps(dest: u32) -> [QpModify; 3] {
    rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, dest, [10, 0, 1, 1], 1)
}

/// The modifies RESET -> INIT -> RTR -> RTS of a UD QP on port 1.
fn ud_steps() -> [QpModify; 3] {
    ud_steps_with(0)
}

/// The same, the QP using P_Key table entry `pkey_index`, Q_Key 0x1111.
fn ud_steps_with(pkey_index: u16) -> [QpModify; 3] {
    [
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(pkey_index),
            port: Some(PortNum::new(1).unwrap()),
            qkey: Some(QKey::new(0x1111)),
            ..QpModify::default()
        },
        QpModify::to_state(QpState::Rtr),
        QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(5).unwrap()),
            ..QpModify::default()
        },
    ]
}

#[test]
fn a_reset_connected_qp_reaches_rtr_again_only_after_time_wait() {
    let w = World::deterministic(91);
    let s = setup(&w, 0);
    let (a, _) = create(&w, &s, QpType::Rc);
    let [init, rtr, rts] = connect_steps(0x40);
    // A fresh QP has had no connection: no wait.
    for step in [&init, &rtr, &rts] {
        assert_eq!(modify(&w, &s, a, step), IbStatus::Success);
    }
    // The connection ends: ERR, then RESET, then INIT at once.
    assert_eq!(
        modify(&w, &s, a, &QpModify::to_state(QpState::Err)),
        IbStatus::Success
    );
    assert_eq!(
        modify(&w, &s, a, &QpModify::to_state(QpState::Reset)),
        IbStatus::Success
    );
    assert_eq!(modify(&w, &s, a, &init), IbStatus::Success);
    // RTR is refused while TIME WAIT lasts, and nothing changes.
    assert_eq!(modify(&w, &s, a, &rtr), IbStatus::QpInTimewait);
    assert_eq!(state(&w, &s, a), QpState::Init);
    w.host.scheduler().advance(QPN_QUIET_PERIOD_NS - 1).unwrap();
    assert_eq!(modify(&w, &s, a, &rtr), IbStatus::QpInTimewait);
    assert_eq!(state(&w, &s, a), QpState::Init);
    // Once it has passed, the QP connects again.
    w.host.scheduler().advance(1).unwrap();
    assert_eq!(modify(&w, &s, a, &rtr), IbStatus::Success);
    assert_eq!(modify(&w, &s, a, &rts), IbStatus::Success);
    assert_eq!(state(&w, &s, a), QpState::Rts);
    // A reset straight from RTS starts a new TIME WAIT.
    assert_eq!(
        modify(&w, &s, a, &QpModify::to_state(QpState::Reset)),
        IbStatus::Success
    );
    assert_eq!(modify(&w, &s, a, &init), IbStatus::Success);
    assert_eq!(modify(&w, &s, a, &rtr), IbStatus::QpInTimewait);

    // A connected QP reset before it ever reached RTR had no connection.
    let (b, _) = create(&w, &s, QpType::Uc);
    let [init_b, rtr_b, _] = connect_steps(0x41);
    let rtr_b = QpModify {
        max_dest_rd_atomic: None,
        min_rnr_timer: None,
        ..rtr_b
    };
    let init_b = QpModify {
        access: Some(AccessFlags::REMOTE_WRITE),
        ..init_b
    };
    assert_eq!(modify(&w, &s, b, &init_b), IbStatus::Success);
    assert_eq!(
        modify(&w, &s, b, &QpModify::to_state(QpState::Reset)),
        IbStatus::Success
    );
    assert_eq!(modify(&w, &s, b, &init_b), IbStatus::Success);
    assert_eq!(modify(&w, &s, b, &rtr_b), IbStatus::Success);
    // A UC QP that was connected waits too.
    assert_eq!(
        modify(&w, &s, b, &QpModify::to_state(QpState::Reset)),
        IbStatus::Success
    );
    assert_eq!(modify(&w, &s, b, &init_b), IbStatus::Success);
    assert_eq!(modify(&w, &s, b, &rtr_b), IbStatus::QpInTimewait);

    // A datagram QP has no connection and never waits.
    let (u, _) = create(&w, &s, QpType::Ud);
    for _ in 0..2 {
        for step in &ud_steps() {
            assert_eq!(modify(&w, &s, u, step), IbStatus::Success);
        }
        assert_eq!(
            modify(&w, &s, u, &QpModify::to_state(QpState::Reset)),
            IbStatus::Success
        );
    }

    for qp in [a, b, u] {
        destroy(&w, &s, qp);
    }
    teardown(&w, &s);
    w.finish();
}

/// The IPv4 address of each port of the two HCAs.
const HCA_IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];
const GUIDS: [u64; 2] = [0x0002_C900_0000_2000, 0x0002_C900_0000_3000];

/// A kernel client of the CI: the asynchronous events it was given.
#[derive(Default)]
struct Client {
    events: Mutex<Vec<AsyncEventRecord>>,
}

impl CaClient for Client {
    fn completion(&self, _: CqHandle) {}
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.events).push(*event);
    }
}

/// A user process with a context open on HCA `i`.
struct UserContext {
    caller: HostCaller,
    ca: u64,
}

impl UserContext {
    fn open(w: &World, i: usize, pid: u32) -> Self {
        let process = Process::new(pid);
        let caller = HostCaller::new(w.host.pool().kernel_space(), &process);
        let c = w.user_call_at::<OpenCa>(i, &caller, 0, &OpenCaIn::CURRENT, &[], 64);
        let r = response::<OpenCa>(&c);
        assert_eq!(r.status, IbStatus::Success);
        Self {
            caller,
            ca: r.handle,
        }
    }

    /// Issues GetAsyncEvent; the request may stay pending.
    fn get_async_event(&self, w: &World, i: usize) -> RequestHandle {
        let mut bytes = vec![0; ib_types::ioctl::request_len::<GetAsyncEvent>(0).unwrap()];
        ib_types::ioctl::encode_request::<GetAsyncEvent>(self.ca, &Empty, &[], 0, &mut bytes)
            .unwrap();
        let (request, issuer) = w.raw_request(
            GetAsyncEvent::ID.ioctl().raw(),
            RequestorMode::User,
            bytes,
            ib_types::ioctl::response_len::<GetAsyncEvent>(0).unwrap(),
        );
        w.hca_at(i)
            .submit_user_request(request, self.caller.clone());
        w.settle();
        issuer
    }

    fn close(self, w: &World, i: usize) {
        let c = w.user_call_at::<CloseCa>(i, &self.caller, self.ca, &Empty, &[], 0);
        assert_eq!(response::<CloseCa>(&c).status, IbStatus::Success);
        assert_eq!(self.caller.process().exit(), 0);
    }
}

#[track_caller]
fn answered_event(request: &RequestHandle) -> AsyncEventRecord {
    let c = request.completion().expect("GetAsyncEvent was answered");
    let r = response::<GetAsyncEvent>(&c);
    assert_eq!(r.status, IbStatus::Success);
    r.output.unwrap()
}

/// Sends one empty UD datagram from `qp` of HCA `s.i` to QP `dest_qpn`
/// at `dest_ip` with Q_Key `qkey`; returns the sender's completion status.
fn send_datagram(
    w: &World,
    s: &Setup,
    qp: u64,
    dest_ip: [u8; 4],
    dest_qpn: u32,
    qkey: u32,
) -> WcStatus {
    let av = hca_prm::av::Av::try_from(&grh_av(1, dest_ip)).unwrap();
    let wr = SendWr {
        wr_id: 7,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: &[],
        ud: Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(dest_qpn).unwrap(),
            remote_qkey: QKey::new(qkey),
        }),
    };
    post_one_and_complete(w, s, qp, wr, Vec::new(), Some(av))
}

/// Posts `wr` over the SGEs `sges` (and with `av` for UD) on `qp` of HCA
/// `s.i` from a DPC, checks it was taken, and returns the status of the
/// one completion CQ `s.cq` then holds.
fn post_one_and_complete(
    w: &World,
    s: &Setup,
    qp: u64,
    wr: SendWr<'static>,
    sges: Vec<Sge>,
    av: Option<hca_prm::av::Av>,
) -> WcStatus {
    let hca = w.hca_at(s.i);
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    w.in_dpc(move || {
        let request = SendRequest {
            wr: SendWr {
                sg_list: &sges,
                ..wr
            },
            av,
            inline: None,
        };
        *lock(&sink) = Some(hca.post_send(qp, &[request]));
    });
    w.settle();
    assert_eq!(lock(&out).take(), Some((1, IbStatus::Success)));
    let wcs = poll_all(w, s.i, s.cq);
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    wcs[0].status
}

#[test]
fn p_key_and_q_key_violations_reach_the_kernel_client_and_every_user_context() {
    let (w, [x, y]) = support::kernel_pair::two_two_port_hcas(92, GUIDS, &HCA_IPS);
    let sender = setup(&w, x);
    // The receiving HCA's kernel client opens the CA through the CI, with
    // its callbacks; two processes have user contexts there.
    let client = Arc::new(Client::default());
    let ci = w.device_at(y).provider().expect("the CI provider");
    let ca = ci.open_ca(client.clone()).unwrap();
    let r = w.call_in_dpc_at::<AllocPd>(y, KERNEL, ca, &Empty, 0);
    let pd = response::<AllocPd>(&r).handle;
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let r = w.call_in_dpc_at::<CreateCq>(y, KERNEL, ca, &attr, 0);
    let cq = response::<CreateCq>(&r).handle;
    let receiver = Setup { i: y, ca, pd, cq };
    let first = UserContext::open(&w, y, 21);
    let second = UserContext::open(&w, y, 22);
    let pending = first.get_async_event(&w, y);
    assert!(!pending.is_done(), "no event yet");

    let (to, created) = create(&w, &receiver, QpType::Ud);
    let to_qpn = created.qpn.get();
    for step in &ud_steps() {
        assert_eq!(modify(&w, &receiver, to, step), IbStatus::Success);
    }
    let (from, _) = create(&w, &sender, QpType::Ud);
    for step in &ud_steps() {
        assert_eq!(modify(&w, &sender, from, step), IbStatus::Success);
    }
    let port1 = Some(PortNum::new(1).unwrap());

    // A datagram with the wrong Q_Key: dropped by the receiver, which
    // counts a Q_Key violation and traps it.
    assert_eq!(
        send_datagram(&w, &sender, from, HCA_IPS[1][0], to_qpn, 0x2222),
        WcStatus::Success
    );
    let qkey_trap = AsyncEventRecord::new(AsyncEventCode::QkeyTrap, 0, port1, 0).unwrap();
    assert_eq!(*lock(&client.events), vec![qkey_trap]);
    assert_eq!(answered_event(&pending), qkey_trap);
    assert_eq!(answered_event(&second.get_async_event(&w, y)), qkey_trap);

    // A datagram under a P_Key the receiving port does not hold: the
    // sender's P_Key table entry 1 becomes 0x8001, and a QP uses it.
    let done = Arc::new(Mutex::new(None));
    let out = done.clone();
    w.hca_at(x).submit(
        Command::new(Opcode::SetPkey, port_table_in_mod(1, 1)).with_immediate(0x8001),
        Box::new(move |r| *lock(&out) = Some(r.is_ok())),
    );
    w.settle();
    assert_eq!(lock(&done).take(), Some(true));
    let (stranger, _) = create(&w, &sender, QpType::Ud);
    for step in &ud_steps_with(1) {
        assert_eq!(modify(&w, &sender, stranger, step), IbStatus::Success);
    }
    assert_eq!(
        send_datagram(&w, &sender, stranger, HCA_IPS[1][0], to_qpn, 0x1111),
        WcStatus::Success
    );
    let pkey_trap = AsyncEventRecord::new(AsyncEventCode::PkeyTrap, 0, port1, 0).unwrap();
    assert_eq!(*lock(&client.events), vec![qkey_trap, pkey_trap]);
    // Queued for each context until asked for.
    assert_eq!(answered_event(&first.get_async_event(&w, y)), pkey_trap);
    assert_eq!(answered_event(&second.get_async_event(&w, y)), pkey_trap);
    // Nothing reached the receiving QP.
    assert!(poll_all(&w, y, cq).is_empty());

    for (s, qp) in [(&sender, from), (&sender, stranger), (&receiver, to)] {
        destroy(&w, s, qp);
    }
    first.close(&w, y);
    second.close(&w, y);
    teardown(&w, &receiver);
    assert_eq!(ci.close_ca(ca), Ok(()));
    teardown(&w, &sender);
    w.finish();
}

#[test]
fn a_link_flap_reaches_every_user_contexts_get_async_event() {
    let w = World::deterministic(93);
    let first = UserContext::open(&w, 0, 31);
    let second = UserContext::open(&w, 0, 32);
    let pending = first.get_async_event(&w, 0);
    assert!(!pending.is_done(), "no event yet");
    // Port 2's link goes down on the fabric, then comes back.
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
    let port2 = Some(PortNum::new(2).unwrap());
    let down = AsyncEventRecord::new(AsyncEventCode::PortDown, 0, port2, 0).unwrap();
    let active = AsyncEventRecord::new(AsyncEventCode::PortActive, 0, port2, 0).unwrap();
    flap(false);
    // The waiting request is answered; the other context's event is queued.
    assert_eq!(answered_event(&pending), down);
    flap(true);
    assert_eq!(answered_event(&first.get_async_event(&w, 0)), active);
    assert_eq!(answered_event(&second.get_async_event(&w, 0)), down);
    assert_eq!(answered_event(&second.get_async_event(&w, 0)), active);
    // Nothing more: the next request waits.
    assert!(!first.get_async_event(&w, 0).is_done());
    assert!(!second.get_async_event(&w, 0).is_done());
    first.close(&w, 0);
    second.close(&w, 0);
    w.finish();
}

/// Issues `V` to HCA `i` from a DPC with private input bytes.
fn call_with<V: Verb>(
    w: &World,
    i: usize,
    mode: RequestorMode,
    handle: u64,
    input: &V::In,
    private: &[u8],
) -> sim_host::request::Completion {
    let mut bytes = vec![0; ib_types::ioctl::request_len::<V>(private.len()).unwrap()];
    ib_types::ioctl::encode_request::<V>(handle, input, private, 0, &mut bytes).unwrap();
    let out_len = ib_types::ioctl::response_len::<V>(0).unwrap();
    let (request, issuer) = w.raw_request(V::ID.ioctl().raw(), mode, bytes, out_len);
    w.submit_in_dpc_at(i, request, issuer)
}

fn page_bytes(pages: &[u64]) -> Vec<u8> {
    pages.iter().flat_map(|p| p.to_le_bytes()).collect()
}

#[track_caller]
fn query_mr(w: &World, i: usize, mr: u64) -> ib_types::mr::MrQuery {
    let r = w.call_in_dpc_at::<QueryMr>(i, KERNEL, mr, &Empty, 0);
    let resp = response::<QueryMr>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    resp.output.unwrap()
}

/// One signaled RDMA write of `src` to `remote` posted on `qp` of HCA
/// `s.i`; returns its completion status.
fn rdma_write(w: &World, s: &Setup, qp: u64, src: Sge, remote: RemoteAddr) -> WcStatus {
    let wr = SendWr {
        wr_id: 5,
        op: SendOp::RdmaWrite { remote },
        flags: SendFlags::SIGNALED,
        sg_list: &[],
        ud: None,
    };
    post_one_and_complete(w, s, qp, wr, vec![src], None)
}

#[test]
fn reregister_physical_memory_moves_a_region_keeping_its_handle() {
    use driver_platform::{CommonBuffer, DmaAdapter};
    let (w, [x, y]) = support::kernel_pair::two_two_port_hcas(93, GUIDS, &HCA_IPS);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    // An RC pair: Y writes into X's regions.
    let (a, qa) = create(&w, &sx, QpType::Rc);
    let (b, qb) = create(&w, &sy, QpType::Rc);
    let access = AccessFlags::REMOTE_WRITE;
    for step in rc_to_rts_steps(1, access, qb.qpn.get(), HCA_IPS[1][0], 1) {
        assert_eq!(modify(&w, &sx, a, &step), IbStatus::Success);
    }
    for step in rc_to_rts_steps(1, access, qa.qpn.get(), HCA_IPS[0][0], 1) {
        assert_eq!(modify(&w, &sy, b, &step), IbStatus::Success);
    }
    let src = KernelBuf::register(&w, &sy, *b"Srce", 4096, AccessFlags::LOCAL_WRITE);
    src.write(0, &[0xA5; 256]);

    // A physical region over common buffer `first`.
    let first = w.adapter_at(x).alloc_common(4096).unwrap();
    let second = w.adapter_at(x).alloc_common(8192).unwrap();
    let rights = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let phys = PhysMrRegister {
        iova: 0x7000_0000,
        length: 4096,
        first_byte_offset: 0,
        page_shift: 12,
        num_pages: 1,
        access: rights,
    };
    let r = call_with::<RegPhysMr>(
        &w,
        x,
        KERNEL,
        sx.pd,
        &phys,
        &page_bytes(&[first.bus_address()]),
    );
    let resp = response::<RegPhysMr>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let (mr, old) = (resp.handle, resp.output.unwrap());
    let to_old = RemoteAddr {
        addr: 0x7000_0010,
        rkey: old.keys.rkey,
    };
    assert_eq!(
        rdma_write(&w, &sy, b, src.sge(0, 64), to_old),
        WcStatus::Success
    );
    let mut seen = [0u8; 64];
    assert!(first.read(0x10, &mut seen));
    assert_eq!(seen, [0xA5; 64]);

    // Kernel only: a user-mode request is refused, nothing changes.
    let moved = PhysMrRereg {
        translation: Some(PhysTranslation {
            iova: 0x9000_0100,
            length: 6000,
            first_byte_offset: 0x100,
            page_shift: 12,
            num_pages: 2,
        }),
        ..PhysMrRereg::default()
    };
    let second_pages = page_bytes(&[second.bus_address(), second.bus_address() + 4096]);
    let r = call_with::<ReregPhysMr>(&w, x, RequestorMode::User, mr, &moved, &second_pages);
    assert_eq!(
        response::<ReregPhysMr>(&r).status,
        IbStatus::InvalidPermission
    );
    assert_eq!(query_mr(&w, x, mr).vaddr, 0x7000_0000);

    // The translation moves to `second`'s two pages: same handle, new
    // keys, the I/O virtual address used answered.
    let r = call_with::<ReregPhysMr>(&w, x, KERNEL, mr, &moved, &second_pages);
    let resp = response::<ReregPhysMr>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let new = resp.output.unwrap();
    assert_eq!(new.iova, 0x9000_0100);
    assert_ne!(new.keys, old.keys);
    let q = query_mr(&w, x, mr);
    assert_eq!(
        (q.vaddr, q.length, q.access, q.keys, q.pd.raw()),
        (0x9000_0100, 6000, rights, new.keys, sx.pd)
    );
    // Writes land in the new pages, across the page boundary.
    let across = RemoteAddr {
        addr: 0x9000_0100 + 4096 - 0x100 - 32,
        rkey: new.keys.rkey,
    };
    assert_eq!(
        rdma_write(&w, &sy, b, src.sge(0, 64), across),
        WcStatus::Success
    );
    let mut seen = [0u8; 64];
    assert!(second.read(4096 - 32, &mut seen));
    assert_eq!(seen, [0xA5; 64]);

    // Rights and PD only (no page list): the pages stay; the PD use moves.
    let r = w.call_in_dpc_at::<AllocPd>(x, KERNEL, sx.ca, &Empty, 0);
    let pd2 = response::<AllocPd>(&r).handle;
    let rights_and_pd = PhysMrRereg {
        pd: Some(PdHandle::from_raw(pd2)),
        access: Some(AccessFlags::LOCAL_WRITE),
        ..PhysMrRereg::default()
    };
    let r = call_with::<ReregPhysMr>(&w, x, KERNEL, mr, &rights_and_pd, &[]);
    let resp = response::<ReregPhysMr>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    assert_eq!(resp.output.unwrap().iova, 0x9000_0100);
    let q = query_mr(&w, x, mr);
    assert_eq!(
        (q.vaddr, q.access, q.pd.raw()),
        (0x9000_0100, AccessFlags::LOCAL_WRITE, pd2)
    );
    assert_eq!(q.keys.rkey, RKey::new(0), "no remote right, no R_Key");
    let r = w.call_in_dpc_at::<DeallocPd>(x, KERNEL, pd2, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::ResourceBusy);

    // A region registered from virtual memory takes a page list too; its
    // locked pages are released (the verifier checks at the end).
    let virt = KernelBuf::register(&w, &sx, *b"Virt", 4096, rights);
    let back = PhysMrRereg {
        translation: Some(PhysTranslation {
            iova: 0x7000_0000,
            length: 4096,
            first_byte_offset: 0,
            page_shift: 12,
            num_pages: 1,
        }),
        ..PhysMrRereg::default()
    };
    let r = call_with::<ReregPhysMr>(
        &w,
        x,
        KERNEL,
        virt.mr,
        &back,
        &page_bytes(&[first.bus_address()]),
    );
    let resp = response::<ReregPhysMr>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    let moved_keys = resp.output.unwrap().keys;
    let into_first = RemoteAddr {
        addr: 0x7000_0800,
        rkey: moved_keys.rkey,
    };
    src.write(0, &[0x3C; 64]);
    assert_eq!(
        rdma_write(&w, &sy, b, src.sge(0, 64), into_first),
        WcStatus::Success
    );
    assert!(first.read(0x800, &mut seen));
    assert_eq!(seen, [0x3C; 64]);

    // The first region's old R_Key is dead: the responder refuses it.
    assert_ne!(
        rdma_write(&w, &sy, b, src.sge(0, 64), to_old),
        WcStatus::Success
    );

    for (s, qp) in [(&sx, a), (&sy, b)] {
        destroy(&w, s, qp);
    }
    let _ = poll_all(&w, x, sx.cq);
    for region in [mr, virt.mr] {
        let r = w.call_in_dpc_at::<DeregMr>(x, KERNEL, region, &Empty, 0);
        assert_eq!(response::<DeregMr>(&r).status, IbStatus::Success);
    }
    w.host.pool().free(virt.block);
    let r = w.call_in_dpc_at::<DeallocPd>(x, KERNEL, pd2, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    src.free(&w, y);
    w.adapter_at(x).free_common(first);
    w.adapter_at(x).free_common(second);
    teardown(&w, &sx);
    teardown(&w, &sy);
    w.finish();
}
