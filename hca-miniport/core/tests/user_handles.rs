//! The kernel decides which objects a user request may name, whatever the
//! provider (UVP) did: raw proxy requests, built here without the plugin,
//! name a PD, CQ or SRQ of another user context of the same process (or of
//! another process) in a verb issued on a context. Each is refused with
//! the kind's invalid-handle status, and nothing is created, locked or
//! referenced: the other context's objects are destroyed afterwards
//! without being busy. Each test ends with the host shut down and the
//! verifier clean.

mod support;

use driver_platform::RequestorMode;
use hca_prm::uverbs::{CreateCqPriv, CreateQpPriv, CreateSrqPriv};
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::handle::{PdHandle, SrqHandle};
use ib_types::ioctl::{
    AllocMw, AllocPd, AttachMcast, CloseCa, CreateAv, CreateCq, CreateQp, CreateSrq, DeallocMw,
    DeallocPd, DeregMr, DestroyCq, DestroyQp, DestroySrq, DetachMcast, Empty, ModifyQp, ModifySrq,
    OpenCa, OpenCaIn, QueryCq, QueryMr, QueryMw, QueryQp, QuerySrq, RegMr, RegSharedMr, ReregMr,
    ReregPhysMr, ResizeCq, Verb,
};
use ib_types::mcast::McastGroup;
use ib_types::mr::{MrRegister, MrRereg, MrShare, MwAttr, MwType, PhysMrRereg};
use ib_types::qp::{QpCreate, QpState, QpType};
use ib_types::scalars::{Gid, Lid};
use ib_types::srq::{SrqAttr, SrqCreate, SrqModify};
use ib_types::status::IbStatus;
use ib_types::wr::RKey;
use sim_host::caller::HostCaller;
use sim_host::memory::Process;
use support::{World, response};
use zerocopy::IntoBytes;

/// One user context of a process, driven by raw proxy requests.
struct Context<'a> {
    caller: &'a HostCaller,
    ca: u64,
}

/// The handles one context made.
struct Made {
    pd: u64,
    cq: u64,
    srq: u64,
}

impl<'a> Context<'a> {
    fn open(w: &World, caller: &'a HostCaller) -> Self {
        let c = w.user_call_at::<OpenCa>(0, caller, 0, &OpenCaIn::CURRENT, &[], 64);
        let r = response::<OpenCa>(&c);
        assert_eq!(r.status, IbStatus::Success);
        Self {
            caller,
            ca: r.handle,
        }
    }

    fn process(&self) -> &Process {
        self.caller.process()
    }

    /// Status and handle of one raw call.
    fn call<V: Verb>(
        &self,
        w: &World,
        handle: u64,
        input: &V::In,
        private: &[u8],
    ) -> (IbStatus, u64) {
        let c = w.user_call_at::<V>(0, self.caller, handle, input, private, 64);
        let r = response::<V>(&c);
        (r.status, r.handle)
    }

    #[track_caller]
    fn made<V: Verb>(&self, w: &World, handle: u64, input: &V::In, private: &[u8]) -> u64 {
        let (status, made) = self.call::<V>(w, handle, input, private);
        assert_eq!(status, IbStatus::Success, "{:?}", V::ID);
        made
    }

    /// A PD, an 8-entry CQ and an 8-deep SRQ of this context.
    fn make_objects(&self, w: &World) -> Made {
        let pd = self.made::<AllocPd>(w, self.ca, &Empty, &[]);
        let ring = self.process().alloc(32 << 3).unwrap();
        let dbr = self.process().alloc(64).unwrap();
        let layout = CreateCqPriv::new(3, ring, dbr).unwrap();
        let attr = CqAttr {
            cqe: 8,
            comp_vector: 0,
        };
        let cq = self.made::<CreateCq>(w, self.ca, &attr, layout.emit().as_bytes());
        let srq = self.made::<CreateSrq>(w, self.ca, &srq_create(pd), &self.srq_layout());
        Made { pd, cq, srq }
    }

    fn srq_layout(&self) -> Vec<u8> {
        let ring = self.process().alloc(32 << 3).unwrap();
        let dbr = self.process().alloc(64).unwrap();
        let layout = CreateSrqPriv::new(3, 5, ring, dbr).unwrap();
        layout.emit().as_bytes().to_vec()
    }

    /// Ring memory for a QP with its own receive queue, or on an SRQ.
    fn qp_layout(&self, own_rq: bool) -> Vec<u8> {
        let sq = self.process().alloc(64 << 3).unwrap();
        let rq = own_rq.then(|| {
            (
                3,
                5,
                self.process().alloc(32 << 3).unwrap(),
                self.process().alloc(64).unwrap(),
            )
        });
        let layout = CreateQpPriv::new(3, 0, sq, rq).unwrap();
        layout.emit().as_bytes().to_vec()
    }

    /// Destroys what `make_objects` made (the SRQ, CQ and PD must not be
    /// busy: a refused create took no use of them).
    #[track_caller]
    fn destroy(&self, w: &World, made: &Made) {
        assert_eq!(
            self.call::<DestroySrq>(w, made.srq, &Empty, &[]).0,
            IbStatus::Success
        );
        assert_eq!(
            self.call::<DestroyCq>(w, made.cq, &Empty, &[]).0,
            IbStatus::Success
        );
        assert_eq!(
            self.call::<DeallocPd>(w, made.pd, &Empty, &[]).0,
            IbStatus::Success
        );
    }
}

fn srq_create(pd: u64) -> SrqCreate {
    SrqCreate {
        pd: PdHandle::from_raw(pd),
        attr: SrqAttr {
            max_wr: 8,
            max_sge: 1,
            srq_limit: 0,
        },
    }
}

/// RC creates on `own`'s objects naming one parent of `other`'s each: the
/// request, whether it has its own receive queue, the status a foreign
/// parent gets, and which parent it names.
fn parent_mixes(own: &Made, other: &Made) -> [(QpCreate, bool, IbStatus, &'static str); 4] {
    [
        (
            rc_create(own.pd, other.cq, own.cq, None),
            true,
            IbStatus::InvalidCqHandle,
            "send CQ",
        ),
        (
            rc_create(own.pd, own.cq, other.cq, None),
            true,
            IbStatus::InvalidCqHandle,
            "receive CQ",
        ),
        (
            rc_create(own.pd, own.cq, own.cq, Some(other.srq)),
            false,
            IbStatus::InvalidSrqHandle,
            "SRQ",
        ),
        (
            rc_create(other.pd, own.cq, own.cq, None),
            true,
            IbStatus::InvalidPdHandle,
            "PD",
        ),
    ]
}

fn rc_create(pd: u64, send_cq: u64, recv_cq: u64, srq: Option<u64>) -> QpCreate {
    let mut create = support::small_qp_create(QpType::Rc, pd, send_cq);
    create.recv_cq = ib_types::handle::CqHandle::from_raw(recv_cq);
    if let Some(srq) = srq {
        // Receives come from the SRQ: the QP asks for no receive queue.
        create.srq = Some(SrqHandle::from_raw(srq));
        create.caps.max_recv_wr = 0;
        create.caps.max_recv_sge = 0;
    }
    create
}

/// What a refused request must leave unchanged.
#[derive(Debug, PartialEq, Eq)]
struct Footprint {
    mtt: hca_miniport_core::mr::TranslationUsage,
    locked: usize,
}

fn footprint(w: &World, process: &Process) -> Footprint {
    Footprint {
        mtt: w.hca().memory_translation().unwrap().usage(),
        locked: process.space().locked_pages(),
    }
}

#[test]
fn user_creates_naming_another_contexts_pd_cq_or_srq_are_refused_and_change_nothing() {
    let w = World::deterministic(71);
    let process = Process::new(41);
    let caller = HostCaller::new(w.host.pool().kernel_space(), &process);
    // Two contexts of one process, each with its own objects.
    let a = Context::open(&w, &caller);
    let b = Context::open(&w, &caller);
    let mine = a.make_objects(&w);
    let theirs = b.make_objects(&w);
    // A third context in another process.
    let stranger_process = Process::new(42);
    let stranger_caller = HostCaller::new(w.host.pool().kernel_space(), &stranger_process);
    let stranger = Context::open(&w, &stranger_caller);
    let foreign = stranger.make_objects(&w);

    let before = footprint(&w, &process);
    for (other, whose) in [(&theirs, "same process"), (&foreign, "another process")] {
        for (create, own_rq, status, what) in parent_mixes(&mine, other) {
            let layout = a.qp_layout(own_rq);
            let (got, _) = a.call::<CreateQp>(&w, a.ca, &create, &layout);
            assert_eq!(got, status, "CreateQp on context A naming {whose}'s {what}");
            assert_eq!(footprint(&w, &process), before, "{whose}'s {what}");
        }
        // An SRQ of context A in another context's PD.
        let layout = a.srq_layout();
        let (got, _) = a.call::<CreateSrq>(&w, a.ca, &srq_create(other.pd), &layout);
        assert_eq!(got, IbStatus::InvalidPdHandle, "CreateSrq in {whose}'s PD");
        assert_eq!(footprint(&w, &process), before);
    }

    // The same creates with A's own objects succeed: the refusals were
    // about ownership, not the requests' shape.
    let layout = a.qp_layout(true);
    let qp = a.made::<CreateQp>(
        &w,
        a.ca,
        &rc_create(mine.pd, mine.cq, mine.cq, None),
        &layout,
    );
    let layout = a.qp_layout(false);
    let on_srq = a.made::<CreateQp>(
        &w,
        a.ca,
        &rc_create(mine.pd, mine.cq, mine.cq, Some(mine.srq)),
        &layout,
    );
    assert_eq!(
        a.call::<DestroyQp>(&w, qp, &Empty, &[]).0,
        IbStatus::Success
    );
    assert_eq!(
        a.call::<DestroyQp>(&w, on_srq, &Empty, &[]).0,
        IbStatus::Success
    );

    // No refused create took a use of the other contexts' objects.
    b.destroy(&w, &theirs);
    stranger.destroy(&w, &foreign);
    a.destroy(&w, &mine);
    for ctx in [&a, &b, &stranger] {
        assert_eq!(
            ctx.call::<CloseCa>(&w, ctx.ca, &Empty, &[]).0,
            IbStatus::Success
        );
    }
    assert_eq!(w.hca().user_context_count(), 0);
    assert_eq!(process.space().locked_pages(), 0);
    assert_eq!(process.exit(), 0);
    assert_eq!(stranger_process.exit(), 0);
    w.finish();
}

/// The handle a successful create answered.
#[track_caller]
fn made<V: Verb>(done: sim_host::request::Completion) -> u64 {
    let r = response::<V>(&done);
    assert_eq!(r.status, IbStatus::Success);
    r.handle
}

/// A kernel client's objects, made through the request path.
fn kernel_objects(w: &World) -> (u64, Made) {
    let kernel = RequestorMode::Kernel;
    let ca = response::<OpenCa>(&w.call::<OpenCa>(kernel, 0, &OpenCaIn::CURRENT, 0)).handle;
    let pd = made::<AllocPd>(w.call::<AllocPd>(kernel, ca, &Empty, 0));
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let cq = made::<CreateCq>(w.call::<CreateCq>(kernel, ca, &attr, 0));
    let srq = made::<CreateSrq>(w.call::<CreateSrq>(kernel, ca, &srq_create(pd), 0));
    (ca, Made { pd, cq, srq })
}

/// A kernel client's QP, SRQ, AV or region may name only kernel objects, a user QP
/// (or SRQ) only its own context's: a user CQ has no kernel ring (its
/// CQEs would land in the process's memory, where no kernel poll finds
/// them), a user PD's regions are the process's. Each mix is refused with
/// the kind's invalid-handle status and takes nothing: every object is
/// destroyed afterwards without being busy.
#[test]
fn kernel_and_user_creates_never_name_each_others_pd_cq_or_srq() {
    let w = World::deterministic(72);
    let process = Process::new(43);
    let caller = HostCaller::new(w.host.pool().kernel_space(), &process);
    let user = Context::open(&w, &caller);
    let users = user.make_objects(&w);
    let (kernel_ca, kernels) = kernel_objects(&w);
    let kernel = RequestorMode::Kernel;
    let before = footprint(&w, &process);

    for (create, _, status, what) in parent_mixes(&kernels, &users) {
        let r = w.call::<CreateQp>(kernel, kernel_ca, &create, 0);
        let r = response::<CreateQp>(&r);
        assert_eq!(
            (r.status, r.handle),
            (status, 0),
            "kernel CreateQp naming a user {what}"
        );
        assert_eq!(footprint(&w, &process), before, "user {what}");
    }
    let r = w.call::<CreateSrq>(kernel, kernel_ca, &srq_create(users.pd), 0);
    assert_eq!(
        response::<CreateSrq>(&r).status,
        IbStatus::InvalidPdHandle,
        "kernel CreateSrq in a user PD"
    );
    let av = support::rc_path::grh_av(1, [10, 0, 0, 2]);
    let r = w.call::<CreateAv>(kernel, users.pd, &av, 0);
    assert_eq!(
        response::<CreateAv>(&r).status,
        IbStatus::InvalidPdHandle,
        "kernel CreateAv in a user PD"
    );
    // Kernel memory a kernel registration could lock: only the PD is wrong.
    w.install_kernel_locker(0);
    let block = w
        .host
        .pool()
        .alloc(support::DRIVER, *b"Hndl", 4096)
        .unwrap();
    let region = MrRegister {
        vaddr: block.va(),
        length: 4096,
        access: AccessFlags::LOCAL_WRITE,
    };
    let r = w.call::<RegMr>(kernel, users.pd, &region, 0);
    assert_eq!(
        response::<RegMr>(&r).status,
        IbStatus::InvalidPdHandle,
        "kernel RegMr in a user PD"
    );
    w.host.pool().free(block);
    for (create, own_rq, status, what) in parent_mixes(&users, &kernels) {
        let layout = user.qp_layout(own_rq);
        let (got, _) = user.call::<CreateQp>(&w, user.ca, &create, &layout);
        assert_eq!(got, status, "user CreateQp naming a kernel {what}");
        assert_eq!(footprint(&w, &process), before, "kernel {what}");
    }
    let layout = user.srq_layout();
    let (got, _) = user.call::<CreateSrq>(&w, user.ca, &srq_create(kernels.pd), &layout);
    assert_eq!(
        got,
        IbStatus::InvalidPdHandle,
        "user CreateSrq in a kernel PD"
    );

    // Each side's own objects make a QP: the refusals were about owners.
    let r = w.call::<CreateQp>(
        kernel,
        kernel_ca,
        &rc_create(kernels.pd, kernels.cq, kernels.cq, Some(kernels.srq)),
        0,
    );
    let r = response::<CreateQp>(&r);
    assert_eq!(r.status, IbStatus::Success);
    let kernel_qp = r.handle;
    let r = w.call::<DestroyQp>(kernel, kernel_qp, &Empty, 0);
    assert_eq!(response::<DestroyQp>(&r).status, IbStatus::Success);

    // Nothing refused took a use: everything is destroyed, not busy.
    user.destroy(&w, &users);
    for (status, what) in [
        (
            response::<DestroySrq>(&w.call::<DestroySrq>(kernel, kernels.srq, &Empty, 0)).status,
            "kernel SRQ",
        ),
        (
            response::<DestroyCq>(&w.call::<DestroyCq>(kernel, kernels.cq, &Empty, 0)).status,
            "kernel CQ",
        ),
        (
            response::<DeallocPd>(&w.call::<DeallocPd>(kernel, kernels.pd, &Empty, 0)).status,
            "kernel PD",
        ),
        (
            response::<CloseCa>(&w.call::<CloseCa>(kernel, kernel_ca, &Empty, 0)).status,
            "kernel CA",
        ),
    ] {
        assert_eq!(status, IbStatus::Success, "{what}");
    }
    assert_eq!(
        user.call::<CloseCa>(&w, user.ca, &Empty, &[]).0,
        IbStatus::Success
    );
    assert_eq!(process.space().locked_pages(), 0);
    assert_eq!(process.exit(), 0);
    w.finish();
}

/// The status of a kernel request of verb `V` on `handle`.
fn kernel_status<V: Verb>(w: &World, handle: u64, input: &V::In) -> IbStatus {
    response::<V>(&w.call::<V>(RequestorMode::Kernel, handle, input, 64)).status
}

/// A kernel client (another driver) reaches a user context's objects
/// through no verb: destroying, modifying, querying, resizing, windows in
/// its PD, sharing or moving regions into or out of it are each refused
/// with the kind's invalid-handle status, before any effect. The objects
/// are the process's (their rings are its memory, its proxy tracks them):
/// afterwards they still work for their owner, who destroys them cleanly.
#[test]
fn kernel_requests_never_reach_a_user_contexts_objects() {
    let w = World::deterministic(73);
    let process = Process::new(44);
    let caller = HostCaller::new(w.host.pool().kernel_space(), &process);
    let user = Context::open(&w, &caller);
    let users = user.make_objects(&w);
    let layout = user.qp_layout(true);
    let user_qp = user.made::<CreateQp>(
        &w,
        user.ca,
        &rc_create(users.pd, users.cq, users.cq, None),
        &layout,
    );
    let buffer = process.alloc(4096).unwrap();
    let region = MrRegister {
        vaddr: buffer,
        length: 4096,
        access: AccessFlags::LOCAL_WRITE,
    };
    let user_mr = user.made::<RegMr>(&w, users.pd, &region, &[]);
    let window = MwAttr {
        mw_type: MwType::Type2,
        rkey: RKey::new(0),
    };
    let user_mw = user.made::<AllocMw>(&w, users.pd, &window, &[]);
    // A UD QP's WQEs take two basic blocks (the address segment).
    let ud_sq = process.alloc(64 << 4).unwrap();
    let ud_rq = (
        3,
        5,
        process.alloc(32 << 3).unwrap(),
        process.alloc(64).unwrap(),
    );
    let layout = CreateQpPriv::new(4, 1, ud_sq, Some(ud_rq))
        .unwrap()
        .emit()
        .as_bytes()
        .to_vec();
    let ud_qp = user.made::<CreateQp>(
        &w,
        user.ca,
        &support::small_qp_create(QpType::Ud, users.pd, users.cq),
        &layout,
    );
    let group = McastGroup {
        mgid: Gid::from_ipv4([239, 5, 6, 8]),
        mlid: Lid::UNASSIGNED,
    };
    let membership = user.made::<AttachMcast>(&w, ud_qp, &group, &[]);
    // A kernel client with a PD and a region of its own, for the moves.
    let (kernel_ca, kernels) = kernel_objects(&w);
    w.install_kernel_locker(0);
    let block = w
        .host
        .pool()
        .alloc(support::DRIVER, *b"Hndl", 4096)
        .unwrap();
    let kernel_region = MrRegister {
        vaddr: block.va(),
        length: 4096,
        access: AccessFlags::LOCAL_WRITE,
    };
    let kernel_mr =
        made::<RegMr>(w.call::<RegMr>(RequestorMode::Kernel, kernels.pd, &kernel_region, 64));
    let before = footprint(&w, &process);

    // RESET to INIT, as an RC QP's owner would move it.
    let [to_init, _, _] =
        support::rc_path::rc_to_rts_steps(1, AccessFlags::REMOTE_WRITE, 1, [10, 0, 0, 2], 1);
    let resize = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    let arm = SrqModify {
        max_wr: None,
        srq_limit: Some(2),
    };
    let new_access = MrRereg {
        access: Some(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ),
        ..MrRereg::default()
    };
    let into_user_pd = MrRereg {
        pd: Some(PdHandle::from_raw(users.pd)),
        ..MrRereg::default()
    };
    let share = |pd: u64| MrShare {
        pd: PdHandle::from_raw(pd),
        vaddr: 0x7000_0000,
        access: AccessFlags::LOCAL_WRITE,
    };
    let phys_into_user_pd = PhysMrRereg {
        pd: Some(PdHandle::from_raw(users.pd)),
        ..PhysMrRereg::default()
    };
    let refusals = [
        (
            kernel_status::<QueryQp>(&w, user_qp, &Empty),
            IbStatus::InvalidQpHandle,
            "QueryQp of a user QP",
        ),
        (
            kernel_status::<ModifyQp>(&w, user_qp, &to_init),
            IbStatus::InvalidQpHandle,
            "ModifyQp of a user QP",
        ),
        (
            kernel_status::<DestroyQp>(&w, user_qp, &Empty),
            IbStatus::InvalidQpHandle,
            "DestroyQp of a user QP",
        ),
        (
            kernel_status::<QueryCq>(&w, users.cq, &Empty),
            IbStatus::InvalidCqHandle,
            "QueryCq of a user CQ",
        ),
        (
            kernel_status::<ResizeCq>(&w, users.cq, &resize),
            IbStatus::InvalidCqHandle,
            "ResizeCq of a user CQ",
        ),
        (
            kernel_status::<DestroyCq>(&w, users.cq, &Empty),
            IbStatus::InvalidCqHandle,
            "DestroyCq of a user CQ",
        ),
        (
            kernel_status::<QuerySrq>(&w, users.srq, &Empty),
            IbStatus::InvalidSrqHandle,
            "QuerySrq of a user SRQ",
        ),
        (
            kernel_status::<ModifySrq>(&w, users.srq, &arm),
            IbStatus::InvalidSrqHandle,
            "ModifySrq of a user SRQ",
        ),
        (
            kernel_status::<DestroySrq>(&w, users.srq, &Empty),
            IbStatus::InvalidSrqHandle,
            "DestroySrq of a user SRQ",
        ),
        (
            kernel_status::<QueryMr>(&w, user_mr, &Empty),
            IbStatus::InvalidMrHandle,
            "QueryMr of a user region",
        ),
        (
            kernel_status::<ReregMr>(&w, user_mr, &new_access),
            IbStatus::InvalidMrHandle,
            "ReregMr of a user region",
        ),
        (
            kernel_status::<RegSharedMr>(&w, user_mr, &share(kernels.pd)),
            IbStatus::InvalidMrHandle,
            "RegSharedMr of a user region",
        ),
        (
            kernel_status::<DeregMr>(&w, user_mr, &Empty),
            IbStatus::InvalidMrHandle,
            "DeregMr of a user region",
        ),
        (
            kernel_status::<AllocMw>(&w, users.pd, &window),
            IbStatus::InvalidPdHandle,
            "AllocMw in a user PD",
        ),
        (
            kernel_status::<ReregMr>(&w, kernel_mr, &into_user_pd),
            IbStatus::InvalidPdHandle,
            "ReregMr of a kernel region into a user PD",
        ),
        (
            kernel_status::<RegSharedMr>(&w, kernel_mr, &share(users.pd)),
            IbStatus::InvalidPdHandle,
            "RegSharedMr of a kernel region into a user PD",
        ),
        (
            kernel_status::<ReregPhysMr>(&w, kernel_mr, &phys_into_user_pd),
            IbStatus::InvalidPdHandle,
            "ReregPhysMr of a kernel region into a user PD",
        ),
        (
            kernel_status::<QueryMw>(&w, user_mw, &Empty),
            IbStatus::InvalidMwHandle,
            "QueryMw of a user window",
        ),
        (
            kernel_status::<DeallocMw>(&w, user_mw, &Empty),
            IbStatus::InvalidMwHandle,
            "DeallocMw of a user window",
        ),
        (
            kernel_status::<AttachMcast>(&w, ud_qp, &group),
            IbStatus::InvalidQpHandle,
            "AttachMcast of a user QP",
        ),
        (
            kernel_status::<DetachMcast>(&w, membership, &Empty),
            IbStatus::InvalidMcastHandle,
            "DetachMcast of a user QP's membership",
        ),
        (
            kernel_status::<DeallocPd>(&w, users.pd, &Empty),
            IbStatus::InvalidPdHandle,
            "DeallocPd of a user PD",
        ),
    ];
    for (got, status, what) in refusals {
        assert_eq!(got, status, "kernel {what}");
    }
    assert_eq!(footprint(&w, &process), before, "a refusal changed nothing");

    // The owner's objects still work: queried, modified, the region
    // unchanged (the kernel's rereg of its access was refused).
    let (status, _) = user.call::<QueryCq>(&w, users.cq, &Empty, &[]);
    assert_eq!(status, IbStatus::Success);
    let (status, _) = user.call::<ModifyQp>(&w, user_qp, &to_init, &[]);
    assert_eq!(status, IbStatus::Success);
    let c = w.user_call_at::<QueryQp>(0, &caller, user_qp, &Empty, &[], 64);
    let r = response::<QueryQp>(&c);
    assert_eq!(r.status, IbStatus::Success);
    assert_eq!(r.output.unwrap().state, QpState::Init);
    let c = w.user_call_at::<QueryMr>(0, &caller, user_mr, &Empty, &[], 64);
    let r = response::<QueryMr>(&c);
    assert_eq!(r.status, IbStatus::Success);
    assert_eq!(r.output.unwrap().access, AccessFlags::LOCAL_WRITE);
    // The kernel's region stayed in its own PD and is not busy.
    let c = w.call::<QueryMr>(RequestorMode::Kernel, kernel_mr, &Empty, 64);
    assert_eq!(response::<QueryMr>(&c).output.unwrap().pd.raw(), kernels.pd);

    // The owner destroys everything (nothing busy); so does the kernel.
    for (status, what) in [
        (
            user.call::<DetachMcast>(&w, membership, &Empty, &[]).0,
            "membership",
        ),
        (user.call::<DeallocMw>(&w, user_mw, &Empty, &[]).0, "window"),
        (user.call::<DestroyQp>(&w, ud_qp, &Empty, &[]).0, "UD QP"),
        (user.call::<DestroyQp>(&w, user_qp, &Empty, &[]).0, "QP"),
        (user.call::<DeregMr>(&w, user_mr, &Empty, &[]).0, "region"),
    ] {
        assert_eq!(status, IbStatus::Success, "user {what}");
    }
    user.destroy(&w, &users);
    assert_eq!(
        user.call::<CloseCa>(&w, user.ca, &Empty, &[]).0,
        IbStatus::Success
    );
    for (status, what) in [
        (kernel_status::<DeregMr>(&w, kernel_mr, &Empty), "region"),
        (kernel_status::<DestroySrq>(&w, kernels.srq, &Empty), "SRQ"),
        (kernel_status::<DestroyCq>(&w, kernels.cq, &Empty), "CQ"),
        (kernel_status::<DeallocPd>(&w, kernels.pd, &Empty), "PD"),
        (kernel_status::<CloseCa>(&w, kernel_ca, &Empty), "CA"),
    ] {
        assert_eq!(status, IbStatus::Success, "kernel {what}");
    }
    w.host.pool().free(block);
    assert_eq!(process.space().locked_pages(), 0);
    assert_eq!(process.exit(), 0);
    w.finish();
}
