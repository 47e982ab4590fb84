//! User-mode resources (guide 6.2.2, 6.5.3, 6.8.1, 10): per-process CA
//! contexts with their own doorbell (UAR) page, and CQs, QPs and SRQs whose
//! rings live in the caller's pinned memory. The vendor private data both
//! sides share is `hca_prm::uverbs` (docs/prm.md section 13).
//!
//! Contract:
//! - **Entry.** User-mode requests arrive in two phases
//!   (`verbs::caller`): [`Hca::prepare_user_request`] with the
//!   [`CallerProcess`] they came from, in that process's context (the
//!   shell's `EvtIoInCallerContext`, PASSIVE_LEVEL), takes from the process
//!   what the verb needs (locked buffers, a doorbell page mapped or
//!   unmapped); [`Hca::execute_user_request`] runs the verb below wherever
//!   the queue delivers the request, with only that
//!   ([`Hca::submit_user_request`] does both at once). A user request
//!   given to [`Hca::submit_request`] has no process to reach into and is
//!   served by the older policy there (user `OpenCa` unsupported), so no
//!   path lets a user request past the checks below.
//! - **Contexts.** A user `OpenCa` makes a context: one UAR page of its own
//!   (`resources::UarAllocator`, never page 0) mapped uncached into the
//!   caller (`CallerProcess::map_device_page`); the answer carries the
//!   mapping (`OpenCaOut::doorbell`) and, as private output, the page index
//!   and the limits the provider lays rings out within
//!   (`uverbs::OpenCaPriv`). Any number of contexts may be open, beside the
//!   kernel client's CA (guide 6.1.1's one open is the access layer's).
//! - **Ownership.** Every handle a user request names must be the caller's
//!   context or an object that context made, and the context must belong
//!   to the calling process; anything else (a kernel object, another
//!   context's or process's object, a stale or wrong-kind handle) is
//!   refused with the kind's invalid-handle status and changes nothing.
//!   A request made on a context (a create naming its parents, a region
//!   moved or shared into a PD) may name only that context's objects: a
//!   PD, CQ or SRQ of another context of the same process is refused the
//!   same way (`owned_by`), whatever the provider checked. The other way
//!   round, a kernel client's CreateQp, CreateSrq, CreateAv, RegMr or
//!   RegPhysMr naming a user context's PD, CQ or SRQ is refused the same
//!   way (`Hca::refuse_user_parents`), and a kernel request whose header
//!   names a user context's object (destroy, modify, query, resize,
//!   `AllocMw` in its PD, `RegSharedMr` of its region), or that moves or
//!   shares a region into a user PD, is refused at the dispatch before any
//!   effect (`Hca::refuse_user_targets`).
//!   Once a request passed that check it is run by the verb's ordinary
//!   implementation as a trusted one (queries, `ModifyQp`, `ModifySrq`).
//!   `ModifyCa` is refused for user mode by policy with
//!   [`IbStatus::InvalidPermission`] (after the ownership check): the
//!   CA's port attributes are shared, and the access layer's and SM's.
//!   Verbs not listed in `run_user_request` answer
//!   [`IbStatus::Unsupported`] for user mode, never the kernel's behaviour.
//! - **Rings in user memory.** The private input is parsed as hostile
//!   (`uverbs`: exact length, reserved bytes, alignment, overflow, overlap),
//!   then checked against the device (sizes within its capabilities, the
//!   QP's capacities fitting the WQE stride), then the ranges are locked
//!   and DMA-mapped through the `mr` locking path
//!   (`MemoryTranslation::pin_user`, PASSIVE or APC_LEVEL in the caller's
//!   context), described page by page in MTT entries of the one allocator,
//!   and handed to the device with the same `SW2HW_CQ`/`SW2HW_QP`/`SW2HW_SRQ`
//!   as kernel objects, carrying the context's UAR page (a QP also the
//!   `USER` flag). The objects live in the same generation-checked tables
//!   as kernel ones, so events and numbers follow the same rules.
//! - **Doorbells** are authorised by the device: a QP or CQ honours only
//!   the UAR page in its context (PRM 9.1), so a process can ring nothing
//!   but its own objects.
//! - **Destroy** of a user object is the kernel object's destroy, then the
//!   pinned memory is unmapped and unlocked. **Close** of a context
//!   (explicit, or [`Hca::close_user_contexts_of`] for every context of a
//!   process, the proxy's `EvtFileCleanup` of the process's last handle)
//!   first
//!   unmaps the doorbell page (in the caller's context: nothing can ring
//!   any more; for `CloseCa` that is its phase 1), then destroys every QP, SRQ and CQ the context still
//!   holds, deregisters its regions and frees its PDs, and only then frees
//!   the UAR page and answers.
//!   Close is refused with [`IbStatus::ResourceBusy`] while a create of the
//!   context is in flight (also when one was in flight in phase 1, which
//!   then left the page mapped: only the process's context may unmap it).
//! - **Stop** with contexts open (`Hca::stop`): the pinned memory is
//!   unmapped and unlocked with the device quiet; the contexts go with the
//!   objects, and their doorbell mappings, which only the owning process's
//!   context can remove, are left to the proxy, which closes every context
//!   before the device is removed.
//! - **Completion events** (`WaitCqEvent`): the provider arms its CQ
//!   through its doorbell page and waits; the CQ's completion event (from
//!   the DPC) completes every wait pending on it, and an event with no wait
//!   pending is kept for the next one (no lost wake-up). Waits end with
//!   [`IbStatus::Canceled`] when cancelled ([`Hca::cancel_user_waits`],
//!   from the proxy's cancel routine), when their CQ is destroyed, or at
//!   removal (below). User
//!   CQs' events never reach the kernel client's callbacks.
//! - **Asynchronous events** (`GetAsyncEvent`): an event of a user QP,
//!   SRQ or CQ (PRM 8.2, after the QP's cached state took it) goes to its
//!   context, never to the kernel client: it completes the context's
//!   oldest pending `GetAsyncEvent`, or waits in a queue of
//!   [`MAX_QUEUED_EVENTS`] (the oldest dropped when full). Port events,
//!   naming the port and no object — `PortActive`, `PortDown` and the
//!   Table 6-3 traps (P_Key and Q_Key violations) — go to every open
//!   context this way, as well as to the kernel client.
//!   Pending requests end with [`IbStatus::Canceled`] when cancelled or at
//!   close.
//! - **Removal.** Waits of either kind still pending when the device is
//!   stopped for good (`Hca::stop`, at release-hardware after a removal,
//!   orderly or surprise) end with [`IbStatus::Canceled`]
//!   (`STATUS_CANCELLED`), as a driver completes the requests it holds at
//!   removal (`Hca::end_all_user_waits`).
//! - **Resize** of a user CQ (`ResizeCq` with `uverbs::ResizeCqPriv`):
//!   the new ring is checked as hostile like CreateCq's (and must not
//!   overlap what the CQ has pinned), pinned and mapped, then `RESIZE_CQ`
//!   copies the outstanding CQEs into it (PRM 6.2); only after the device
//!   switched is the old ring unpinned. A failed resize (the entries do
//!   not fit: [`IbStatus::InvalidCqSize`]) leaves the old ring in use and
//!   undoes the new one. Close is refused while a resize is under way. A
//!   kernel `ResizeCq` of a user CQ is refused ([`IbStatus::InvalidCqHandle`]):
//!   its ring is the provider's.
//! - **Regions, windows, multicast.** `ReregMr` (the caller's region, a
//!   new PD of the same context, a new range locked with the caller's
//!   locker) and `RegSharedMr` (a region of the context, shared into one
//!   of its PDs) run the kernel's verbs as trusted requests; `AllocMw`
//!   in a context's PD makes a window of the context, `QueryMw` and
//!   `DeallocMw` need one. Binds are posted by the provider in its own
//!   send WQEs (the device checks them, PRM 7.1), so the kernel's part is
//!   the MPT entry. `AttachMcast` on a user UD QP, `DetachMcast` of a
//!   membership of one; destroying the QP (also at close) detaches it.
//!   These count as operations under way: close is refused with
//!   [`IbStatus::ResourceBusy`] until they are answered. Close takes
//!   windows before regions (the device refuses to deregister a region
//!   with a window bound).
//! - User AVs are the provider's by design (guide 6.4.2): a user
//!   `CreateAv` that reaches the kernel is unsupported.
//! - **Regions.** `RegMr` in one of the caller's PDs locks the caller's
//!   pages (`mr`, with the process's locker) and stores the region with
//!   the kernel's (`verbs::region`); `QueryMr` and `DeregMr` need the
//!   caller's region; close deregisters what is left (before the PDs).

use alloc::boxed::Box;
use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use alloc::sync::Arc;
use alloc::vec::Vec;

use driver_platform::{
    CallerProcess, Deferred, Irql, NtStatus, Platform, Request, RequestorMode, SpinLock,
    UserMapping,
};
use hca_prm::cmd::{MAX_MTT_PER_WRITE, Opcode};
use hca_prm::ctx::{BufDesc, CQE_LOG_STRIDE, Cqc, Qpc, QpcFlags, SQ_LOG_STRIDE, Srqc};
use hca_prm::uverbs::{
    CreateCqPriv, CreateCqPrivOut, CreateQpPriv, CreateQpPrivOut, CreateSrqPriv, CreateSrqPrivOut,
    OpenCaPriv, UserRange,
};
use hca_prm::wqe::{BB_SIZE, MAX_SEND_WQE_BYTES, SEG_SIZE, inline_seg_len};
use hca_prm::{Le32, Le64};
use ib_types::event::AsyncEventRecord;
use ib_types::interface::UvpName;
use ib_types::ioctl::{
    self as v, CqOut, DoorbellPage, Empty, IoctlCode, OpenCaOut, PROXY_ABI_VERSION, QpCreated,
    Verb, VerbId, decode_request,
};
use ib_types::mr::MrKeys;
use ib_types::qp::{QpCaps, QpState, QpType};
use ib_types::scalars::{NodeGuid, Qpn};
use ib_types::srq::SrqAttr;
use ib_types::status::IbStatus;
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use super::caller::{PreparedDoorbell, PreparedUserRequest};
use super::cq::{Cq, Life as CqLife};
use super::qp::{
    Geometry, Life as QpLife, MAX_LOG_WQE_SIZE, MAX_LOG_WQES, Qp, RC_PREFIX, UD_ADDR_SEG,
};
use super::srq::{LOG_MAX_INDEX as SRQ_LOG_MAX_INDEX, Life as SrqLife, Srq};
use super::{Accepted, Objects, Responder, UVP_NAME, accept};
use crate::cmd::Command;
use crate::hca::Hca;
use crate::mr::{DynLocker, PinnedUser, VirtualRegion};
use crate::resources::{Handle, UarAllocator, kind};

/// Low bits of a user context's handle (a kernel CA's are `0xCA`), so the
/// two are never taken for each other.
const USER_CA_TAG: u64 = 0xCA1;

/// Events a context keeps for its `GetAsyncEvent` requests.
pub const MAX_QUEUED_EVENTS: usize = 64;

/// `log2` of a host page (PRM 5.3).
const LOG_PAGE: u8 = 12;
/// Bytes of a host page.
const PAGE: u64 = 1 << LOG_PAGE;

type Mapping<P> = <<P as Platform>::Caller as CallerProcess>::Mapping;

/// The user contexts of one started device.
pub(crate) struct UserContexts<P: Platform> {
    /// Doorbell pages mapped for opens that made no context, by process,
    /// until its cleanup unmaps them (`verbs::caller`).
    parked: Vec<(u64, PreparedDoorbell<P>)>,
    contexts: BTreeMap<u64, UserContext<P>>,
    /// Completion-event waits by user CQ (raw handle).
    waits: BTreeMap<u64, CqWaits<P>>,
    /// `None` when the device reports no UAR page beyond the kernel's.
    pub(super) uars: Option<UarAllocator>,
    generation: u32,
}

impl<P: Platform> UserContexts<P> {
    /// No contexts; UAR pages `1..num_uars` to hand out; the first
    /// context's handle carries `first_generation` (the life's,
    /// `resources::life_generation`, so no handle of an earlier life
    /// comes back).
    pub(crate) fn new(num_uars: u32, first_generation: u32) -> Self {
        Self {
            contexts: BTreeMap::new(),
            waits: BTreeMap::new(),
            uars: UarAllocator::new(num_uars).ok(),
            parked: Vec::new(),
            generation: first_generation.wrapping_sub(1),
        }
    }

    /// True when no context is open.
    pub(crate) fn is_empty(&self) -> bool {
        self.contexts.is_empty()
    }

    /// Whether some context holds `raw` as one of its objects (handles
    /// carry their kind, so one raw value names one object).
    pub(crate) fn holds(&self, raw: u64) -> bool {
        self.contexts.values().any(|c| {
            c.pds.contains(&raw)
                || c.cqs.contains_key(&raw)
                || c.srqs.contains_key(&raw)
                || c.qps.contains_key(&raw)
                || c.mrs.contains(&raw)
                || c.mws.contains(&raw)
        })
    }

    /// PDs and CQs the contexts hold (they live in the shared tables).
    pub(crate) fn owned_pds_and_cqs(&self) -> (u32, u32) {
        self.contexts.values().fold((0, 0), |(pds, cqs), c| {
            (pds + c.pds.len() as u32, cqs + c.cqs.len() as u32)
        })
    }

    /// Contexts open now.
    pub(crate) fn len(&self) -> usize {
        self.contexts.len()
    }

    /// Takes every pinned range of every context (the device is stopped).
    pub(crate) fn take_pinned(&mut self) -> Vec<PinnedUser<P>> {
        let mut all = Vec::new();
        for ctx in self.contexts.values_mut() {
            for (_, pins) in ctx
                .cqs
                .iter_mut()
                .chain(ctx.qps.iter_mut())
                .chain(ctx.srqs.iter_mut())
            {
                all.append(pins);
            }
        }
        all
    }
}

/// The `WaitCqEvent` requests pending on one user CQ.
struct CqWaits<P: Platform> {
    /// A completion event arrived with no wait pending: the next wait
    /// completes at once (no lost wake-up between arming and waiting).
    fired: bool,
    /// Behind a lock only to make the tables `Sync` (a request is `Send`,
    /// not `Sync`); reached through `get_mut` under the exclusive table lock.
    waiters: SpinLock<P, Vec<Responder<v::WaitCqEvent, P::Request>>>,
}

/// One process's open CA.
struct UserContext<P: Platform> {
    /// The process that opened it; the only one that may use it.
    process: u64,
    /// Its UAR page.
    uar: u32,
    /// The page's mapping into the process, until close unmaps it.
    mapping: Option<Mapping<P>>,
    /// Set when close begins: no new request is accepted.
    closing: bool,
    /// Creates under way (close waits for none).
    creating: u32,
    /// Asynchronous events of the context's objects not yet taken by a
    /// `GetAsyncEvent` (at most [`MAX_QUEUED_EVENTS`]; older ones are
    /// dropped and counted).
    events: VecDeque<AsyncEventRecord>,
    /// Events dropped because the queue was full.
    events_lost: u64,
    /// `GetAsyncEvent` requests waiting for an event (behind a lock only
    /// to make the tables `Sync`, like [`CqWaits::waiters`]).
    event_waiters: SpinLock<P, Vec<Responder<v::GetAsyncEvent, P::Request>>>,
    pds: BTreeSet<u64>,
    /// Memory regions (raw handles); their pages are the `mr` service's.
    mrs: BTreeSet<u64>,
    /// Memory windows (raw handles) in the context's PDs.
    mws: BTreeSet<u64>,
    /// Objects by raw handle, with the user memory pinned for them.
    cqs: BTreeMap<u64, Vec<PinnedUser<P>>>,
    qps: BTreeMap<u64, Vec<PinnedUser<P>>>,
    srqs: BTreeMap<u64, Vec<PinnedUser<P>>>,
}

impl<P: Platform> UserContext<P> {
    /// Hands `record` to the context: its oldest pending `GetAsyncEvent`,
    /// returned for the caller to answer outside the tables' lock, or else
    /// the queue (the oldest queued event dropped and counted when full).
    fn take_event(
        &mut self,
        record: &AsyncEventRecord,
    ) -> Option<Responder<v::GetAsyncEvent, P::Request>> {
        let waiters = self.event_waiters.get_mut();
        if !waiters.is_empty() {
            return Some(waiters.remove(0));
        }
        if self.events.len() == MAX_QUEUED_EVENTS {
            self.events.pop_front();
            self.events_lost += 1;
        }
        self.events.push_back(*record);
        None
    }
}

/// What a user request's handle must name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owned {
    Ca,
    Pd,
    Cq,
    Qp,
    Srq,
    Mr,
    Mw,
    /// A multicast membership: owned with its QP.
    Mcast,
}

impl Owned {
    fn invalid(self) -> IbStatus {
        match self {
            Self::Ca => IbStatus::InvalidCaHandle,
            Self::Pd => IbStatus::InvalidPdHandle,
            Self::Cq => IbStatus::InvalidCqHandle,
            Self::Qp => IbStatus::InvalidQpHandle,
            Self::Srq => IbStatus::InvalidSrqHandle,
            Self::Mr => IbStatus::InvalidMrHandle,
            Self::Mw => IbStatus::InvalidMwHandle,
            Self::Mcast => IbStatus::InvalidMcastHandle,
        }
    }
}

/// The context of `process` that owns `raw` as a `what`, if it is open.
fn owner<P: Platform>(
    o: &Objects<P>,
    process: u64,
    what: Owned,
    raw: u64,
) -> Result<u64, IbStatus> {
    o.user
        .contexts
        .iter()
        .find(|&(&handle, ctx)| {
            ctx.process == process
                && !ctx.closing
                && match what {
                    Owned::Ca => handle == raw,
                    Owned::Pd => ctx.pds.contains(&raw),
                    Owned::Cq => ctx.cqs.contains_key(&raw),
                    Owned::Qp => ctx.qps.contains_key(&raw),
                    Owned::Srq => ctx.srqs.contains_key(&raw),
                    Owned::Mr => ctx.mrs.contains(&raw),
                    Owned::Mw => ctx.mws.contains(&raw),
                    Owned::Mcast => o
                        .mcasts
                        .get(Handle::<kind::Mcast>::from_raw(raw))
                        .and_then(|m| o.qps.objects().get_by_number(m.qpn()))
                        .is_some_and(|(qp, _)| ctx.qps.contains_key(&qp.raw())),
                }
        })
        .map(|(&handle, _)| handle)
        .ok_or(what.invalid())
}

/// Checks that context `ctx` of `process` owns `raw` as a `what`. A
/// request made on one context may name only that context's objects: one
/// of another context, even of the same process, is refused like a
/// stranger's (its rings and doorbell page are another context's).
fn owned_by<P: Platform>(
    o: &Objects<P>,
    process: u64,
    ctx: u64,
    what: Owned,
    raw: u64,
) -> Result<(), IbStatus> {
    if owner(o, process, what, raw)? == ctx {
        Ok(())
    } else {
        Err(what.invalid())
    }
}

/// The private input bytes of a user request of verb `V` (copied: the
/// request is answered later), or `None` when the framing is bad (the
/// decode in `accept` then answers it).
fn private_input<V: Verb, R: Request>(request: &R) -> Option<Vec<u8>> {
    decode_request::<V>(request.input())
        .ok()
        .map(|r| r.private.to_vec())
}

/// `WRITE_MTT` commands for `pages` (bus addresses) from MTT entry
/// `first` (PRM 5.1, 6.0).
fn write_mtt_pages(first: u32, pages: &[u64]) -> Vec<Command> {
    pages
        .chunks(MAX_MTT_PER_WRITE)
        .enumerate()
        .map(|(chunk, entries)| {
            let start = u64::from(first) + (chunk * MAX_MTT_PER_WRITE) as u64;
            let mut mailbox = Vec::with_capacity(8 + 8 * entries.len());
            mailbox.extend_from_slice(&start.to_le_bytes());
            for address in entries {
                mailbox.extend_from_slice(&address.to_le_bytes());
            }
            Command::new(Opcode::WriteMtt, 0).with_mailbox(mailbox)
        })
        .collect()
}

/// A ring's buffer descriptor in user memory (PRM 6.0).
fn user_desc(mtt: u32, ring: &UserRange, log_entries: u8, log_stride: u8) -> BufDesc {
    BufDesc {
        mtt_index: Le32::new(mtt),
        page_offset: Le32::new((ring.va & (PAGE - 1)) as u32),
        log_page_size: LOG_PAGE,
        log_entries,
        log_stride,
        ..BufDesc::default()
    }
}

/// The capacities a user QP's ring layout grants (PRM 10.2, 10.3), or the
/// status that refuses it: the layout must be within the device's limits
/// and hold what `asked` asks for.
fn user_qp_caps(
    qp_type: QpType,
    asked: &QpCaps,
    layout: &CreateQpPriv,
    cap: &hca_prm::cmd::DevCap,
) -> Result<QpCaps, IbStatus> {
    let log_max_wqes = cap.log_max_wqes.min(MAX_LOG_WQES);
    let max_wqe = (1usize << cap.log_max_wqe_size.min(MAX_LOG_WQE_SIZE)).min(MAX_SEND_WQE_BYTES);
    let (max_send_sges, max_recv_sges) =
        (u32::from(cap.max_send_sges), u32::from(cap.max_recv_sges));
    let max_inline = u32::from(cap.max_inline_bytes.get());
    if asked.max_send_sge > max_send_sges || asked.max_recv_sge > max_recv_sges {
        return Err(IbStatus::InvalidMaxSge);
    }
    if asked.max_inline_data > max_inline {
        return Err(IbStatus::InvalidParameter);
    }
    if layout.sq_log_bbs > log_max_wqes {
        return Err(IbStatus::InvalidMaxWrs);
    }
    let stride = BB_SIZE << layout.log_wqe_bbs;
    if stride > max_wqe {
        return Err(IbStatus::InvalidParameter);
    }
    let prefix = match qp_type {
        QpType::Ud | QpType::Smi | QpType::Gsi => UD_ADDR_SEG,
        QpType::Rc => RC_PREFIX,
        QpType::Uc => SEG_SIZE,
    };
    let needed = SEG_SIZE
        + prefix
        + (asked.max_send_sge.max(1) as usize * SEG_SIZE)
            .max(inline_seg_len(asked.max_inline_data as usize));
    if needed > stride {
        return Err(IbStatus::InvalidMaxSge);
    }
    let room = stride - SEG_SIZE - prefix;
    let send_wrs = 1u32 << (layout.sq_log_bbs - layout.log_wqe_bbs);
    if asked.max_send_wr > send_wrs {
        return Err(IbStatus::InvalidMaxWrs);
    }
    let (recv_wrs, recv_sges) = match layout.rq {
        Some(rq) => {
            if rq.log_entries > log_max_wqes {
                return Err(IbStatus::InvalidMaxWrs);
            }
            let rq_stride = 1usize << rq.log_stride;
            // A stride beyond what the device's SGEs need is refused: it
            // would only make the ring (and the locked memory) larger.
            let largest = (SEG_SIZE * (1 + max_recv_sges as usize)).next_power_of_two();
            if rq_stride > largest.max(hca_prm::wqe::MIN_RECV_STRIDE) {
                return Err(IbStatus::InvalidParameter);
            }
            let sges = (rq_stride / SEG_SIZE - 1) as u32;
            let wrs = 1u32 << rq.log_entries;
            if asked.max_recv_wr > wrs {
                return Err(IbStatus::InvalidMaxWrs);
            }
            if asked.max_recv_sge > sges {
                return Err(IbStatus::InvalidMaxSge);
            }
            (wrs, sges.min(max_recv_sges))
        }
        None => (0, 0),
    };
    Ok(QpCaps {
        max_send_wr: send_wrs,
        max_recv_wr: recv_wrs,
        max_send_sge: ((room / SEG_SIZE) as u32).min(max_send_sges),
        max_recv_sge: recv_sges,
        max_inline_data: ((room - 4) as u32).min(max_inline),
    })
}

impl<P: Platform> Hca<P>
where
    P::Request: 'static,
{
    /// The verb of a user-mode request (see the module doc): like
    /// [`submit_request`](Self::submit_request), with what its
    /// caller-context phase prepared (`verbs::caller`); touches no process
    /// memory. The request is completed exactly once. A kernel-mode
    /// request given here goes to `submit_request`.
    pub(crate) fn run_user_request(
        self: &Arc<Self>,
        request: P::Request,
        prepared: PreparedUserRequest<P>,
    ) {
        let caller = prepared;
        if request.requestor_mode() == RequestorMode::Kernel {
            return self.submit_request(request);
        }
        let code = IoctlCode::from_raw(request.ioctl_code());
        let Ok(verb) = VerbId::from_ioctl(code) else {
            request.complete(NtStatus::INVALID_DEVICE_REQUEST, 0);
            return;
        };
        type R<P> = <P as Platform>::Request;
        let pid = caller.process;
        match verb {
            VerbId::OpenCa => {
                if let Some(a) = accept::<v::OpenCa, R<P>>(request) {
                    self.user_open(a, caller);
                }
            }
            VerbId::CloseCa => {
                if let Some(a) = accept::<v::CloseCa, R<P>>(request) {
                    self.user_close(a, caller);
                }
            }
            VerbId::QueryCa => self.trusted::<v::QueryCa>(request, pid, Owned::Ca, |h, a| {
                h.query_ca_answer(a.responder);
            }),
            // Policy: the CA's attributes (port capability bits, Q_Key
            // violation counter resets, ...) are shared by every process
            // and owned by the kernel's access layer and the SM, so a user
            // process may not change them. Its own context is checked
            // first (a foreign handle is still an invalid handle), then
            // the request is refused with InvalidPermission.
            VerbId::ModifyCa => self.trusted::<v::ModifyCa>(request, pid, Owned::Ca, |_, a| {
                a.responder.fail(IbStatus::InvalidPermission);
            }),
            VerbId::AllocPd => {
                if let Some(a) = accept::<v::AllocPd, R<P>>(request) {
                    self.user_alloc_pd(a, pid);
                }
            }
            VerbId::DeallocPd => {
                if let Some(a) = accept::<v::DeallocPd, R<P>>(request) {
                    self.user_dealloc_pd(a, pid);
                }
            }
            VerbId::CreateCq => {
                let private = private_input::<v::CreateCq, _>(&request);
                if let Some(a) = accept::<v::CreateCq, R<P>>(request) {
                    self.user_create_cq(a, private.unwrap_or_default(), caller);
                }
            }
            VerbId::QueryCq => self.trusted::<v::QueryCq>(request, pid, Owned::Cq, |h, a| {
                h.query_cq_request(a);
            }),
            VerbId::DestroyCq => {
                if let Some(a) = accept::<v::DestroyCq, R<P>>(request) {
                    self.user_destroy(a.responder, a.handle, pid, Owned::Cq);
                }
            }
            VerbId::CreateQp => {
                let private = private_input::<v::CreateQp, _>(&request);
                if let Some(a) = accept::<v::CreateQp, R<P>>(request) {
                    self.user_create_qp(a, private.unwrap_or_default(), caller);
                }
            }
            VerbId::ModifyQp => self.trusted::<v::ModifyQp>(request, pid, Owned::Qp, |h, a| {
                h.modify_qp_request(a);
            }),
            VerbId::QueryQp => self.trusted::<v::QueryQp>(request, pid, Owned::Qp, |h, a| {
                h.query_qp_request(a);
            }),
            VerbId::DestroyQp => {
                if let Some(a) = accept::<v::DestroyQp, R<P>>(request) {
                    self.user_destroy(a.responder, a.handle, pid, Owned::Qp);
                }
            }
            VerbId::RegMr => {
                if let Some(a) = accept::<v::RegMr, R<P>>(request) {
                    self.user_reg_mr(a, caller);
                }
            }
            VerbId::QueryMr => self.trusted::<v::QueryMr>(request, pid, Owned::Mr, |h, a| {
                h.query_mr_request(a);
            }),
            VerbId::DeregMr => {
                if let Some(a) = accept::<v::DeregMr, R<P>>(request) {
                    self.user_destroy(a.responder, a.handle, pid, Owned::Mr);
                }
            }
            VerbId::GetAsyncEvent => {
                if let Some(a) = accept::<v::GetAsyncEvent, R<P>>(request) {
                    self.user_get_async_event(a, pid);
                }
            }
            VerbId::WaitCqEvent => {
                if let Some(a) = accept::<v::WaitCqEvent, R<P>>(request) {
                    self.user_wait_cq(a, pid);
                }
            }
            VerbId::CreateSrq => {
                let private = private_input::<v::CreateSrq, _>(&request);
                if let Some(a) = accept::<v::CreateSrq, R<P>>(request) {
                    self.user_create_srq(a, private.unwrap_or_default(), caller);
                }
            }
            VerbId::QuerySrq => self.trusted::<v::QuerySrq>(request, pid, Owned::Srq, |h, a| {
                h.query_srq_request(a);
            }),
            VerbId::ModifySrq => self.trusted::<v::ModifySrq>(request, pid, Owned::Srq, |h, a| {
                h.modify_srq_request(a);
            }),
            VerbId::DestroySrq => {
                if let Some(a) = accept::<v::DestroySrq, R<P>>(request) {
                    self.user_destroy(a.responder, a.handle, pid, Owned::Srq);
                }
            }
            VerbId::ResizeCq => {
                let private = private_input::<v::ResizeCq, _>(&request);
                if let Some(a) = accept::<v::ResizeCq, R<P>>(request) {
                    self.user_resize_cq(a, private.unwrap_or_default(), caller);
                }
            }
            VerbId::ReregMr => {
                let locks: (&DynLocker<P>, Irql) = (&caller.locks, caller.irql);
                self.trusted_in_context::<v::ReregMr>(
                    request,
                    pid,
                    Owned::Mr,
                    |input| input.pd.map(|pd| (Owned::Pd, pd.raw())),
                    None,
                    move |h, a| h.rereg_mr_request(a, Some(locks)),
                );
            }
            VerbId::RegSharedMr => self.trusted_in_context::<v::RegSharedMr>(
                request,
                pid,
                Owned::Mr,
                |input| Some((Owned::Pd, input.pd.raw())),
                Some(Owned::Mr),
                |h, a| h.reg_shared_mr_request(a),
            ),
            VerbId::AllocMw => self.trusted_in_context::<v::AllocMw>(
                request,
                pid,
                Owned::Pd,
                |_| None,
                Some(Owned::Mw),
                |h, a| h.alloc_mw_request(a),
            ),
            VerbId::QueryMw => self.trusted::<v::QueryMw>(request, pid, Owned::Mw, |h, a| {
                h.query_mw_request(a);
            }),
            VerbId::DeallocMw => {
                if let Some(a) = accept::<v::DeallocMw, R<P>>(request) {
                    self.user_destroy(a.responder, a.handle, pid, Owned::Mw);
                }
            }
            VerbId::AttachMcast => self.trusted_in_context::<v::AttachMcast>(
                request,
                pid,
                Owned::Qp,
                |_| None,
                None,
                |h, a| h.attach_mcast_request(a),
            ),
            VerbId::DetachMcast => self.trusted_in_context::<v::DetachMcast>(
                request,
                pid,
                Owned::Mcast,
                |_| None,
                None,
                |h, a| h.detach_mcast_request(a),
            ),
            _ => self.user_unsupported(verb, request),
        }
    }

    /// Like [`trusted`](Self::trusted), for a verb that makes or changes
    /// something of the caller's context: `also` names a second handle the
    /// same context must own (a region's new PD), the operation counts as
    /// a create under way until it is answered (close is refused meanwhile
    /// rather than racing it), and on success the object it `made` joins
    /// the context before the process sees the answer.
    fn trusted_in_context<V: Verb>(
        self: &Arc<Self>,
        request: P::Request,
        process: u64,
        what: Owned,
        also: impl FnOnce(&V::In) -> Option<(Owned, u64)>,
        made: Option<Owned>,
        run: impl FnOnce(&Arc<Self>, Accepted<V, P::Request>),
    ) {
        let Some(mut a) = accept::<V, P::Request>(request) else {
            return;
        };
        let second = also(&a.input);
        let checked = self.with_objects(|o| {
            let ctx = owner(o, process, what, a.handle)?;
            if let Some((kind, raw)) = second {
                owned_by(o, process, ctx, kind, raw)?;
            }
            Ok(ctx)
        });
        let ctx = match checked.and_then(|r| r) {
            Ok(ctx) => ctx,
            Err(status) => return a.responder.fail(status),
        };
        if let Err(status) = self.begin_create(process, ctx) {
            return a.responder.fail(status);
        }
        let weak = Arc::downgrade(self);
        a.responder.before_answer(Box::new(move |status, handle| {
            let Some(hca) = weak.upgrade() else { return };
            let object = made
                .filter(|_| status == IbStatus::Success)
                .map(|_| (handle, Vec::new()));
            hca.end_create(ctx, made.unwrap_or(Owned::Ca), object);
        }));
        a.mode = RequestorMode::Kernel;
        run(self, a);
    }

    /// Answers [`IbStatus::Unsupported`] to a user request of a verb this
    /// module does not serve for user mode.
    fn user_unsupported(&self, verb: VerbId, request: P::Request) {
        macro_rules! refuse {
            ($($name:ident),*) => {
                match verb {
                    $(VerbId::$name => super::unsupported::<v::$name, P::Request>(request),)*
                }
            };
        }
        refuse!(
            OpenCa,
            CloseCa,
            QueryCa,
            ModifyCa,
            AllocPd,
            DeallocPd,
            CreateAv,
            QueryAv,
            ModifyAv,
            DestroyAv,
            CreateQp,
            QueryQp,
            ModifyQp,
            DestroyQp,
            CreateCq,
            QueryCq,
            ResizeCq,
            DestroyCq,
            CreateSrq,
            QuerySrq,
            ModifySrq,
            DestroySrq,
            RegMr,
            RegSharedMr,
            ReregMr,
            QueryMr,
            DeregMr,
            AllocMw,
            QueryMw,
            DeallocMw,
            AttachMcast,
            DetachMcast,
            WaitCqEvent,
            GetAsyncEvent,
            RegPhysMr,
            LocalMad,
            ReregPhysMr
        );
    }

    /// Runs a user request whose target the caller owns through the verb's
    /// ordinary implementation, as a trusted request.
    fn trusted<V: Verb>(
        self: &Arc<Self>,
        request: P::Request,
        process: u64,
        what: Owned,
        run: impl FnOnce(&Arc<Self>, Accepted<V, P::Request>),
    ) {
        let Some(mut a) = accept::<V, P::Request>(request) else {
            return;
        };
        match self.with_objects(|o| owner(o, process, what, a.handle)) {
            Ok(Ok(_)) => {
                a.mode = RequestorMode::Kernel;
                run(self, a);
            }
            Ok(Err(status)) | Err(status) => a.responder.fail(status),
        }
    }

    fn user_open(&self, a: Accepted<v::OpenCa, P::Request>, mut caller: PreparedUserRequest<P>) {
        if a.responder.private_room() < OpenCaPriv::SIZE {
            return a.responder.fail(IbStatus::InvalidParameter);
        }
        if caller.irql != Irql::PASSIVE {
            return a.responder.fail(IbStatus::InvalidState);
        }
        let Some(report) = self.report() else {
            return a.responder.fail(IbStatus::InvalidState);
        };
        let Ok(uvp_name) = UvpName::new(UVP_NAME) else {
            return a.responder.fail(IbStatus::GenericError);
        };
        // The page was mapped into the process in its context (phase 1);
        // a failure from here on parks it for the process's cleanup.
        let PreparedDoorbell { uar, mapping } = match caller.take_doorbell() {
            Some(Ok(doorbell)) => doorbell,
            Some(Err(status)) => return a.responder.fail(status),
            None => return a.responder.fail(IbStatus::InvalidState),
        };
        let doorbell = DoorbellPage {
            va: mapping.user_va(),
            size: mapping.len() as u32,
        };
        let process = caller.process;
        let mut mapping = Some(mapping);
        let made = self.with_objects_mut(|o| {
            o.user.generation = o.user.generation.wrapping_add(1);
            let mut handle = u64::from(o.user.generation) << 32 | USER_CA_TAG;
            while o.user.contexts.contains_key(&handle) {
                o.user.generation = o.user.generation.wrapping_add(1);
                handle = u64::from(o.user.generation) << 32 | USER_CA_TAG;
            }
            o.user.contexts.insert(
                handle,
                UserContext {
                    process,
                    uar,
                    mapping: mapping.take(),
                    closing: false,
                    creating: 0,
                    events: VecDeque::new(),
                    events_lost: 0,
                    event_waiters: SpinLock::<P, _>::new(Vec::new()),
                    pds: BTreeSet::new(),
                    mrs: BTreeSet::new(),
                    mws: BTreeSet::new(),
                    cqs: BTreeMap::new(),
                    qps: BTreeMap::new(),
                    srqs: BTreeMap::new(),
                },
            );
            handle
        });
        let Ok(handle) = made else {
            if let Some(mapping) = mapping {
                self.park_doorbell(process, PreparedDoorbell { uar, mapping });
            }
            return a.responder.fail(IbStatus::InvalidState);
        };
        let cap = &report.capabilities;
        let out = OpenCaOut {
            version: PROXY_ABI_VERSION,
            ca_guid: NodeGuid::new(cap.node_guid.get()),
            vendor_id: cap.vendor_id.get() & OpenCaOut::MAX_VENDOR_ID,
            device_id: cap.device_id.get(),
            revision: cap.revision.get(),
            doorbell: Some(doorbell),
            uvp_name,
        };
        let private = OpenCaPriv {
            uar_index: uar,
            log_max_cqes: cap.log_max_cqes,
            log_max_wqes: cap.log_max_wqes.min(MAX_LOG_WQES),
            log_max_wqe_size: cap.log_max_wqe_size.min(MAX_LOG_WQE_SIZE),
            log_max_srq_wqes: cap.log_max_srq_wqes.min(SRQ_LOG_MAX_INDEX),
            max_send_sges: cap.max_send_sges,
            max_recv_sges: cap.max_recv_sges,
            max_inline: cap.max_inline_bytes.get(),
            num_ports: cap.num_ports,
        };
        a.responder.finish(
            IbStatus::Success,
            handle,
            Some(&out),
            private.emit().as_bytes(),
        );
    }

    fn user_close(
        self: &Arc<Self>,
        a: Accepted<v::CloseCa, P::Request>,
        caller: PreparedUserRequest<P>,
    ) {
        if caller.irql != Irql::PASSIVE {
            return a.responder.fail(IbStatus::InvalidState);
        }
        let process = caller.process;
        let handle = a.handle;
        let started = self.with_objects_mut(|o| {
            owner(o, process, Owned::Ca, handle)?;
            let ctx = o
                .user
                .contexts
                .get_mut(&handle)
                .ok_or(IbStatus::InvalidCaHandle)?;
            // Phase 1 unmapped the page in the caller's context unless a
            // create was under way then; a page still mapped can be
            // unmapped only in the process, so the close is refused as
            // busy then too, and the context stays as it was.
            if ctx.creating != 0 || ctx.mapping.is_some() {
                return Err(IbStatus::ResourceBusy);
            }
            ctx.closing = true;
            Ok(())
        });
        if let Err(status) = started.and_then(|r| r) {
            return a.responder.fail(status);
        }
        let responder = a.responder;
        self.close_step(
            handle,
            Box::new(move |_, result| match result {
                Ok(()) => responder.finish(IbStatus::Success, 0, Some(&Empty), &[]),
                Err(status) => responder.fail(status),
            }),
        );
    }

    /// Closes every user context `caller`'s process still has open, as
    /// `CloseCa` does (doorbell page unmapped first, in the caller's
    /// context, then the objects destroyed and the pages unlocked): the
    /// proxy's cleanup of the process's last handle on the device
    /// (`EvtFileCleanup`, in that process's context at PASSIVE_LEVEL), so
    /// no page of the process stays locked when it exits. `done` gets the
    /// number of contexts that could not be closed (busy with a create
    /// under way, or the device failed); it may run later, from the DPC.
    pub fn close_user_contexts_of(
        self: &Arc<Self>,
        caller: P::Caller,
        done: Box<dyn FnOnce(usize) + Send>,
    ) {
        if caller.current_irql() != Irql::PASSIVE {
            return done(self.user_contexts_of(caller.process_id()).len());
        }
        self.cancel_user_waits();
        let process = caller.process_id();
        let started = self.with_objects_mut(|o| {
            o.user
                .contexts
                .iter_mut()
                .filter(|(_, c)| c.process == process && !c.closing)
                .map(|(&handle, ctx)| {
                    if ctx.creating != 0 {
                        return (handle, Err(IbStatus::ResourceBusy));
                    }
                    ctx.closing = true;
                    (handle, Ok(ctx.mapping.take()))
                })
                .collect::<Vec<_>>()
        });
        // Doorbell pages mapped for opens that never became contexts
        // (failed, or cancelled in the queue) are unmapped here, in the
        // process, and only then is their UAR page free for another.
        for parked in self.take_parked_doorbells(process) {
            caller.unmap_device_page(parked.mapping);
            let _ = self.with_objects_mut(|o| o.user.uars.as_mut().map(|u| u.free(parked.uar)));
        }
        let Ok(started) = started else {
            return done(0);
        };
        let mut busy = 0;
        let mut closing = Vec::new();
        for (handle, mapping) in started {
            match mapping {
                Ok(mapping) => {
                    if let Some(mapping) = mapping {
                        caller.unmap_device_page(mapping);
                    }
                    closing.push(handle);
                }
                Err(_) => busy += 1,
            }
        }
        self.close_each(closing, busy, done);
    }

    /// Keeps a doorbell page mapped into `process` for an `OpenCa` that
    /// did not make a context, with its UAR page, until the process's
    /// cleanup unmaps it in its context (`close_user_contexts_of`).
    pub(crate) fn park_doorbell(&self, process: u64, doorbell: PreparedDoorbell<P>) {
        let mut doorbell = Some(doorbell);
        let _ = self.with_objects_mut(|o| {
            if let Some(d) = doorbell.take() {
                o.user.parked.push((process, d));
            }
        });
        // With the device's tables gone (stopped) the UAR pages went with
        // them; the mapping is the process's until it exits, as a
        // context's is after a stop (module doc, "Stop").
        drop(doorbell);
    }

    /// The parked doorbell pages of `process`.
    fn take_parked_doorbells(&self, process: u64) -> Vec<PreparedDoorbell<P>> {
        self.with_objects_mut(|o| {
            let (mine, others) = core::mem::take(&mut o.user.parked)
                .into_iter()
                .partition::<Vec<_>, _>(|(p, _)| *p == process);
            o.user.parked = others;
            mine.into_iter().map(|(_, d)| d).collect()
        })
        .unwrap_or_default()
    }

    /// `CloseCa`'s part in the caller (phase 1, `verbs::caller`): the
    /// context's doorbell page is unmapped from the process, so it can
    /// ring nothing of the context any more; the rest of the close runs
    /// when the request is delivered. Nothing happens unless the context
    /// is the process's and no create of it is under way (the close is
    /// refused as busy then).
    pub(crate) fn unmap_closing_doorbell(&self, caller: &P::Caller, irql: Irql, handle: u64) {
        if irql != Irql::PASSIVE {
            return;
        }
        let process = caller.process_id();
        let taken = self.with_objects_mut(|o| {
            owner(o, process, Owned::Ca, handle).ok()?;
            let ctx = o.user.contexts.get_mut(&handle)?;
            if ctx.creating != 0 || ctx.closing {
                return None;
            }
            ctx.mapping.take()
        });
        if let Ok(Some(mapping)) = taken {
            caller.unmap_device_page(mapping);
        }
    }

    /// Closes the contexts `handles` one after another (each may continue
    /// from the DPC), then calls `done` with `failed` plus the closes that
    /// failed.
    fn close_each(
        self: &Arc<Self>,
        mut handles: Vec<u64>,
        failed: usize,
        done: Box<dyn FnOnce(usize) + Send>,
    ) {
        let Some(handle) = handles.pop() else {
            return done(failed);
        };
        self.close_step(
            handle,
            Box::new(move |hca, result| {
                hca.close_each(handles, failed + usize::from(result.is_err()), done);
            }),
        );
    }

    /// Destroys the next object of the closing context `handle` (QPs, then
    /// CQs), or, when none is left, frees its PDs and UAR page and calls
    /// `done`.
    fn close_step(self: &Arc<Self>, handle: u64, done: super::Done<P>) {
        let next = self.with_objects(|o| {
            let ctx = o.user.contexts.get(&handle)?;
            ctx.qps
                .keys()
                .next()
                .map(|&h| (Owned::Qp, h))
                .or_else(|| ctx.srqs.keys().next().map(|&h| (Owned::Srq, h)))
                .or_else(|| ctx.cqs.keys().next().map(|&h| (Owned::Cq, h)))
                // Windows before regions: a region with a window bound is
                // refused deregistration (the device unbinds a window
                // when it is deallocated).
                .or_else(|| ctx.mws.iter().next().map(|&h| (Owned::Mw, h)))
                .or_else(|| ctx.mrs.iter().next().map(|&h| (Owned::Mr, h)))
        });
        match next {
            Ok(Some((what, object))) => {
                self.destroy_owned(
                    handle,
                    what,
                    object,
                    Box::new(move |hca, _result| hca.close_step(handle, done)),
                );
            }
            Ok(None) => {
                let freed = self.with_objects_mut(|o| {
                    let ctx = o.user.contexts.remove(&handle)?;
                    for pd in &ctx.pds {
                        let _ = o.pds.remove(Handle::<kind::Pd>::from_raw(*pd));
                    }
                    if let Some(uars) = o.user.uars.as_mut() {
                        let _ = uars.free(ctx.uar);
                    }
                    Some(ctx.event_waiters.into_inner())
                });
                match freed {
                    Ok(Some(waiters)) => {
                        for waiter in waiters {
                            waiter.fail(IbStatus::Canceled);
                        }
                        done(self, Ok(()));
                    }
                    _ => done(self, Err(IbStatus::InvalidState)),
                }
            }
            Err(status) => done(self, Err(status)),
        }
    }

    /// Destroys the object `object` of context `ctx` and unpins its memory
    /// (the device no longer uses it), whatever the device answered: a
    /// failed destroy means a failed device, which is reset before it runs
    /// again. Then calls `done` with the destroy's result.
    fn destroy_owned(self: &Arc<Self>, ctx: u64, what: Owned, object: u64, done: super::Done<P>) {
        let release: super::Done<P> = Box::new(move |hca, result| {
            // A QP or CQ refused as busy stays (and stays pinned),
            // except when the context is closing and the object is gone
            // from the tables already (the kernel client destroyed it).
            let pins = hca
                .with_objects_mut(|o| {
                    let gone = match what {
                        Owned::Cq => !o.cqs.contains(Handle::<kind::Cq>::from_raw(object)),
                        Owned::Qp => !o
                            .qps
                            .objects()
                            .contains(Handle::<kind::Qp>::from_raw(object)),
                        Owned::Srq => !o.srqs.contains(Handle::<kind::Srq>::from_raw(object)),
                        Owned::Mr => !o.mrs.contains(Handle::<kind::Mr>::from_raw(object)),
                        Owned::Mw => !o.mws.contains(Handle::<kind::Mw>::from_raw(object)),
                        Owned::Ca | Owned::Pd | Owned::Mcast => true,
                    };
                    let closing = o.user.contexts.get(&ctx).is_some_and(|c| c.closing);
                    if result.is_err() && !gone && !closing {
                        return None;
                    }
                    let c = o.user.contexts.get_mut(&ctx)?;
                    match what {
                        Owned::Cq => c.cqs.remove(&object),
                        Owned::Qp => c.qps.remove(&object),
                        Owned::Srq => c.srqs.remove(&object),
                        Owned::Mr => {
                            c.mrs.remove(&object);
                            None
                        }
                        Owned::Mw => {
                            c.mws.remove(&object);
                            None
                        }
                        Owned::Ca | Owned::Pd | Owned::Mcast => None,
                    }
                })
                .ok()
                .flatten();
            if let Some(pins) = pins {
                hca.unpin_all(pins);
            }
            if what == Owned::Cq && result.is_ok() {
                hca.end_waits(|cq| cq == object);
            }
            done(hca, result);
        });
        match what {
            Owned::Cq => self.destroy_cq_then(object, RequestorMode::Kernel, release),
            Owned::Qp => match self.find_qp(object, RequestorMode::Kernel) {
                Ok(qp) => self.destroy_qp_then(object, qp, release),
                Err(status) => release(self, Err(status)),
            },
            Owned::Srq => self.destroy_user_srq(object, release),
            Owned::Mr => self.dereg_mr_then(object, RequestorMode::Kernel, release),
            Owned::Mw => self.dealloc_mw_then(object, RequestorMode::Kernel, release),
            Owned::Ca | Owned::Pd | Owned::Mcast => release(self, Err(IbStatus::InvalidParameter)),
        }
    }

    /// Destroy of a user CQ, QP or SRQ the caller owns.
    fn user_destroy<V: Verb<Out = Empty>>(
        self: &Arc<Self>,
        responder: Responder<V, P::Request>,
        object: u64,
        process: u64,
        what: Owned,
    ) {
        let ctx = match self.with_objects(|o| owner(o, process, what, object)) {
            Ok(Ok(ctx)) => ctx,
            Ok(Err(status)) | Err(status) => return responder.fail(status),
        };
        self.destroy_owned(ctx, what, object, responder.into_done());
    }

    fn unpin_all(&self, pins: Vec<PinnedUser<P>>) {
        let Ok(mtt) = self.memory_translation() else {
            // Stopped: the stop released the pins already.
            return;
        };
        for pin in pins {
            mtt.unpin_user(self, pin);
        }
    }

    /// `WaitCqEvent` on a user CQ of the caller: completes at the CQ's next
    /// completion event (the provider armed it through its doorbell page),
    /// at once if one fired since the last wait, with
    /// [`IbStatus::Canceled`] when cancelled ([`Hca::cancel_user_waits`])
    /// or when the CQ or its context goes away.
    fn user_wait_cq(&self, a: Accepted<v::WaitCqEvent, P::Request>, process: u64) {
        let cq = a.handle;
        let mut slot = Some(a.responder);
        let waited = self.with_objects_mut(|o| {
            owner(o, process, Owned::Cq, cq)?;
            let waits = o.user.waits.entry(cq).or_insert_with(|| CqWaits {
                fired: false,
                waiters: SpinLock::<P, _>::new(Vec::new()),
            });
            if core::mem::take(&mut waits.fired) {
                return Ok(true);
            }
            if let Some(responder) = slot.take() {
                waits.waiters.get_mut().push(responder);
            }
            Ok(false)
        });
        let Some(responder) = slot else { return };
        match waited.and_then(|r| r) {
            Ok(_) => responder.finish(IbStatus::Success, 0, Some(&Empty), &[]),
            Err(status) => responder.fail(status),
        }
    }

    /// RegMr of the caller's memory in one of its PDs: the pages are locked
    /// in the caller's process (PASSIVE or APC level, `mr`), the region is
    /// stored like any other and belongs to the context (close
    /// deregisters it).
    fn user_reg_mr(
        self: &Arc<Self>,
        a: Accepted<v::RegMr, P::Request>,
        caller: PreparedUserRequest<P>,
    ) {
        let process = caller.process;
        let pd = a.handle;
        let ctx = match self.with_objects(|o| owner(o, process, Owned::Pd, pd)) {
            Ok(Ok(ctx)) => ctx,
            Ok(Err(status)) | Err(status) => return a.responder.fail(status),
        };
        if let Err(status) = self.begin_create(process, ctx) {
            return a.responder.fail(status);
        }
        let mt = match self.memory_translation() {
            Ok(mt) => mt,
            Err(status) => {
                self.end_create(ctx, Owned::Mr, None);
                return a.responder.fail(status);
            }
        };
        if let Err(status) = self.reference_pd(pd) {
            self.end_create(ctx, Owned::Mr, None);
            return a.responder.fail(status);
        }
        let request = VirtualRegion {
            mode: RequestorMode::User,
            va: a.input.vaddr,
            length: a.input.length,
            access: a.input.access,
            pd: Handle::<kind::Pd>::from_raw(pd).number(),
        };
        let (weak, responder, mt2) = (Arc::downgrade(self), a.responder, mt.clone());
        mt.register_virtual(
            self,
            &caller.locks,
            caller.irql,
            request,
            Box::new(move |result| {
                let Some(hca) = weak.upgrade() else { return };
                let stored = result
                    .map_err(|error| {
                        let _ = hca.release_pd(pd);
                        error.ib_status()
                    })
                    .and_then(|region| {
                        let keys = MrKeys {
                            lkey: region.lkey(),
                            rkey: region.rkey(),
                        };
                        hca.store_region(&mt2, region, pd).map(|h| (h, keys))
                    });
                match stored {
                    Ok((handle, keys)) => {
                        hca.end_create(ctx, Owned::Mr, Some((handle, Vec::new())));
                        responder.finish(IbStatus::Success, handle, Some(&keys), &[]);
                    }
                    Err(status) => {
                        hca.end_create(ctx, Owned::Mr, None);
                        responder.fail(status);
                    }
                }
            }),
        );
    }

    /// `GetAsyncEvent` on the caller's context: the oldest queued event of
    /// its objects, or, when none is queued, pends until one arrives (or
    /// until cancelled or the context closes: [`IbStatus::Canceled`]).
    fn user_get_async_event(&self, a: Accepted<v::GetAsyncEvent, P::Request>, process: u64) {
        let ca = a.handle;
        let mut slot = Some(a.responder);
        let taken = self.with_objects_mut(|o| {
            owner(o, process, Owned::Ca, ca)?;
            let ctx = o
                .user
                .contexts
                .get_mut(&ca)
                .ok_or(IbStatus::InvalidCaHandle)?;
            if let Some(record) = ctx.events.pop_front() {
                return Ok(Some(record));
            }
            if let Some(responder) = slot.take() {
                ctx.event_waiters.get_mut().push(responder);
            }
            Ok(None)
        });
        let Some(responder) = slot else { return };
        match taken.and_then(|r| r) {
            Ok(Some(record)) => responder.finish(IbStatus::Success, 0, Some(&record), &[]),
            Ok(None) => responder.fail(IbStatus::GenericError),
            Err(status) => responder.fail(status),
        }
    }

    fn user_alloc_pd(&self, a: Accepted<v::AllocPd, P::Request>, process: u64) {
        let made = self.with_objects_mut(|o| {
            let ctx = owner(o, process, Owned::Ca, a.handle)?;
            let pd = o
                .pds
                .insert_with(|_| super::pd::Pd)
                .map_err(IbStatus::from)?;
            if let Some(c) = o.user.contexts.get_mut(&ctx) {
                c.pds.insert(pd.raw());
            }
            Ok(pd.raw())
        });
        match made.and_then(|r| r) {
            Ok(pd) => a.responder.finish(IbStatus::Success, pd, Some(&Empty), &[]),
            Err(status) => a.responder.fail(status),
        }
    }

    fn user_dealloc_pd(&self, a: Accepted<v::DeallocPd, P::Request>, process: u64) {
        let removed = self.with_objects_mut(|o| {
            let ctx = owner(o, process, Owned::Pd, a.handle)?;
            o.pds
                .remove(Handle::<kind::Pd>::from_raw(a.handle))
                .map_err(IbStatus::from)?;
            if let Some(c) = o.user.contexts.get_mut(&ctx) {
                c.pds.remove(&a.handle);
            }
            Ok(())
        });
        match removed.and_then(|r| r) {
            Ok(()) => a.responder.finish(IbStatus::Success, 0, Some(&Empty), &[]),
            Err(status) => a.responder.fail(status),
        }
    }

    /// Pins `ranges`, all or none, with the pages the caller-context phase
    /// locked for them.
    fn pin_ranges(
        &self,
        caller: &PreparedUserRequest<P>,
        ranges: &[UserRange],
    ) -> Result<Vec<PinnedUser<P>>, IbStatus> {
        let mtt = self.memory_translation()?;
        let irql = caller.irql;
        let mut pins = Vec::with_capacity(ranges.len());
        for range in ranges {
            match mtt.pin_user(self, &caller.locks, irql, range.va, range.len) {
                Ok(pin) => pins.push(pin),
                Err(error) => {
                    for pin in pins {
                        mtt.unpin_user(self, pin);
                    }
                    return Err(error.ib_status());
                }
            }
        }
        Ok(pins)
    }

    /// Marks a create of context `ctx` under way (close waits for it).
    fn begin_create(&self, process: u64, ctx: u64) -> Result<u32, IbStatus> {
        self.with_objects_mut(|o| {
            owner(o, process, Owned::Ca, ctx)?;
            let c = o
                .user
                .contexts
                .get_mut(&ctx)
                .ok_or(IbStatus::InvalidCaHandle)?;
            c.creating += 1;
            Ok(c.uar)
        })?
    }

    /// Ends a create: on success the object's pins join the context.
    fn end_create(&self, ctx: u64, what: Owned, object: Option<(u64, Vec<PinnedUser<P>>)>) {
        let leftover = self
            .with_objects_mut(|o| {
                let c = o.user.contexts.get_mut(&ctx)?;
                c.creating = c.creating.saturating_sub(1);
                let (handle, pins) = object?;
                match what {
                    Owned::Cq => c.cqs.insert(handle, pins),
                    Owned::Qp => c.qps.insert(handle, pins),
                    Owned::Srq => c.srqs.insert(handle, pins),
                    Owned::Mr => {
                        c.mrs.insert(handle);
                        Some(pins)
                    }
                    Owned::Mw => {
                        c.mws.insert(handle);
                        Some(pins)
                    }
                    Owned::Ca | Owned::Pd | Owned::Mcast => Some(pins),
                }
            })
            .ok()
            .flatten();
        if let Some(pins) = leftover {
            self.unpin_all(pins);
        }
    }

    fn user_create_cq(
        self: &Arc<Self>,
        a: Accepted<v::CreateCq, P::Request>,
        private: Vec<u8>,
        caller: PreparedUserRequest<P>,
    ) {
        let process = caller.process;
        let ctx = a.handle;
        let uar = match self.begin_create(process, ctx) {
            Ok(uar) => uar,
            Err(status) => return a.responder.fail(status),
        };
        let checked = self.check_user_cq(&a, &private);
        let layout = match checked {
            Ok(layout) => layout,
            Err(status) => {
                self.end_create(ctx, Owned::Cq, None);
                return a.responder.fail(status);
            }
        };
        let pins = match self.pin_ranges(&caller, &[layout.ring, layout.dbr]) {
            Ok(pins) => pins,
            Err(status) => {
                self.end_create(ctx, Owned::Cq, None);
                return a.responder.fail(status);
            }
        };
        let (ring_pages, dbr_bus) = match (&pins[0], pins[1].bus_address(layout.dbr.va)) {
            (ring, Some(dbr)) => (ring.bus_pages.clone(), dbr),
            _ => {
                self.end_create(ctx, Owned::Cq, Some((0, pins)));
                return a.responder.fail(IbStatus::GenericError);
            }
        };
        let log = layout.log_entries;
        let reserved = self.with_objects_mut(|o| {
            let mtt = o
                .mtt
                .take_entries(ring_pages.len() as u32)
                .map_err(IbStatus::from)?;
            match o
                .cqs
                .insert_with(|h| Arc::new(Cq::<P>::new(h.number(), log, mtt)))
            {
                Ok(handle) => match o.cqs.get(handle).cloned() {
                    Some(cq) => Ok((handle, cq, mtt, o.eqn)),
                    None => Err(IbStatus::GenericError),
                },
                Err(error) => {
                    let _ = o.mtt.return_entries(mtt);
                    Err(IbStatus::from(error))
                }
            }
        });
        let (handle, cq, mtt, eqn) = match reserved.and_then(|r| r) {
            Ok(r) => r,
            Err(status) => {
                self.end_create(ctx, Owned::Cq, Some((0, pins)));
                return a.responder.fail(status);
            }
        };
        let cqc = Cqc {
            eqn: Le32::new(eqn),
            uar_index: Le32::new(uar),
            ring: user_desc(mtt.start(), &layout.ring, log, CQE_LOG_STRIDE),
            ci_dbr: Le64::new(dbr_bus),
            ..Cqc::default()
        };
        let mut commands = write_mtt_pages(mtt.start(), &ring_pages);
        commands
            .push(Command::new(Opcode::Sw2HwCq, cq.number()).with_mailbox(cqc.as_bytes().to_vec()));
        let responder = a.responder;
        self.run_commands(
            commands,
            Box::new(move |hca, result| match result {
                Ok(_) => {
                    cq.set_life(CqLife::Live);
                    hca.end_create(ctx, Owned::Cq, Some((handle.raw(), pins)));
                    let private = CreateCqPrivOut {
                        cqn: cq.number(),
                        log_entries: log,
                    };
                    responder.finish(
                        IbStatus::Success,
                        handle.raw(),
                        Some(&CqOut { cqe: 1 << log }),
                        private.emit().as_bytes(),
                    );
                }
                Err(error) => {
                    hca.forget_cq(handle, mtt);
                    hca.end_create(ctx, Owned::Cq, Some((0, pins)));
                    responder.fail(error.ib_status());
                }
            }),
        );
    }

    /// ResizeCq of a user CQ: the new ring (`uverbs::ResizeCqPriv`, parsed
    /// as hostile, within the device's limits, overlapping nothing the CQ
    /// has pinned) is pinned and described in fresh MTT entries, then
    /// `RESIZE_CQ` moves the outstanding CQEs into it (PRM 6.2; the UVP
    /// polls nothing while its request is outstanding, and polls the new
    /// ring from 0 afterwards). Once the device switched, the old ring is
    /// unpinned and its MTT entries returned; a refusal at any step leaves
    /// the old ring in use, unchanged, and undoes the new one.
    fn user_resize_cq(
        self: &Arc<Self>,
        a: Accepted<v::ResizeCq, P::Request>,
        private: Vec<u8>,
        caller: PreparedUserRequest<P>,
    ) {
        let process = caller.process;
        let raw = a.handle;
        // The CQ, its context, and what it has pinned now.
        let found = self.with_objects(|o| {
            let ctx = owner(o, process, Owned::Cq, raw)?;
            let cq = o
                .cqs
                .get(Handle::<kind::Cq>::from_raw(raw))
                .cloned()
                .ok_or(IbStatus::InvalidCqHandle)?;
            let pinned: Vec<UserRange> = o
                .user
                .contexts
                .get(&ctx)
                .and_then(|c| c.cqs.get(&raw))
                .map(|pins| {
                    pins.iter()
                        .map(|p| UserRange {
                            va: p.va,
                            len: p.length,
                        })
                        .collect()
                })
                .unwrap_or_default();
            Ok((ctx, cq, pinned, o.log_max_cqes))
        });
        let (ctx, cq, pinned, log_max) = match found.and_then(|r| r) {
            Ok(found) => found,
            Err(status) => return a.responder.fail(status),
        };
        let Ok(layout) = hca_prm::uverbs::ResizeCqPriv::parse(&private) else {
            return a.responder.fail(IbStatus::InvalidParameter);
        };
        if pinned.iter().any(|p| p.overlaps(&layout.ring)) {
            return a.responder.fail(IbStatus::InvalidParameter);
        }
        let log = layout.log_entries;
        if log > log_max || u64::from(a.input.cqe) > 1u64 << log {
            return a.responder.fail(IbStatus::InvalidCqSize);
        }
        if let Err(status) = self.begin_create(process, ctx) {
            return a.responder.fail(status);
        }
        if let Err(status) = cq.begin_resize() {
            self.end_create(ctx, Owned::Ca, None);
            return a.responder.fail(status);
        }
        // Undoes everything but the new pin (which the caller hands back).
        let abandon = |hca: &Self| {
            cq.set_life(CqLife::Live);
            hca.end_create(ctx, Owned::Ca, None);
        };
        let mut pins = match self.pin_ranges(&caller, &[layout.ring]) {
            Ok(pins) => pins,
            Err(status) => {
                abandon(self);
                return a.responder.fail(status);
            }
        };
        let Some(new_pin) = pins.pop() else {
            abandon(self);
            return a.responder.fail(IbStatus::GenericError);
        };
        let taken = self.with_objects(|o| {
            o.mtt
                .take_entries(new_pin.bus_pages.len() as u32)
                .map_err(IbStatus::from)
        });
        let mtt = match taken.and_then(|r| r) {
            Ok(mtt) => mtt,
            Err(status) => {
                abandon(self);
                self.unpin_all(alloc::vec![new_pin]);
                return a.responder.fail(status);
            }
        };
        let input = hca_prm::ctx::ResizeCq {
            ring: user_desc(mtt.start(), &layout.ring, log, CQE_LOG_STRIDE),
            ..hca_prm::ctx::ResizeCq::default()
        };
        let mut commands = write_mtt_pages(mtt.start(), &new_pin.bus_pages);
        commands.push(
            Command::new(Opcode::ResizeCq, cq.number()).with_mailbox(input.as_bytes().to_vec()),
        );
        let responder = a.responder;
        self.run_commands(
            commands,
            Box::new(move |hca, result| match result {
                Ok(_) => {
                    let old_mtt = cq.switch_ring(log, mtt);
                    // The device no longer reads the old ring: swap the
                    // pins, and unpin the old one.
                    let mut slot = Some(new_pin);
                    let old_pin = hca
                        .with_objects_mut(|o| {
                            if let Some(old) = old_mtt {
                                let _ = o.mtt.return_entries(old);
                            }
                            let pins = o.user.contexts.get_mut(&ctx)?.cqs.get_mut(&raw)?;
                            let new_pin = slot.take()?;
                            Some(core::mem::replace(pins.first_mut()?, new_pin))
                        })
                        .ok()
                        .flatten();
                    hca.unpin_all(old_pin.into_iter().chain(slot).collect());
                    hca.end_create(ctx, Owned::Ca, None);
                    responder.finish(IbStatus::Success, 0, Some(&CqOut { cqe: 1 << log }), &[]);
                }
                Err(error) => {
                    let _ = hca.with_objects(|o| o.mtt.return_entries(mtt));
                    cq.set_life(CqLife::Live);
                    hca.unpin_all(alloc::vec![new_pin]);
                    hca.end_create(ctx, Owned::Ca, None);
                    responder.fail(super::cq::resize_status(error));
                }
            }),
        );
    }

    /// The checks of a user CreateCq that touch nothing.
    fn check_user_cq(
        &self,
        a: &Accepted<v::CreateCq, P::Request>,
        private: &[u8],
    ) -> Result<CreateCqPriv, IbStatus> {
        if a.responder.private_room() < CreateCqPrivOut::SIZE {
            return Err(IbStatus::InvalidParameter);
        }
        if a.input.comp_vector != 0 {
            return Err(IbStatus::InvalidParameter);
        }
        let layout = CreateCqPriv::parse(private).map_err(|_| IbStatus::InvalidParameter)?;
        let log_max = self.with_objects(|o| o.log_max_cqes)?;
        if layout.log_entries > log_max || u64::from(a.input.cqe) > 1u64 << layout.log_entries {
            return Err(IbStatus::InvalidCqSize);
        }
        Ok(layout)
    }

    fn user_create_qp(
        self: &Arc<Self>,
        a: Accepted<v::CreateQp, P::Request>,
        private: Vec<u8>,
        caller: PreparedUserRequest<P>,
    ) {
        let process = caller.process;
        let ctx = a.handle;
        let uar = match self.begin_create(process, ctx) {
            Ok(uar) => uar,
            Err(status) => return a.responder.fail(status),
        };
        let checked = self.check_user_qp(&a, &private, process);
        let (layout, caps, port) = match checked {
            Ok(checked) => checked,
            Err(status) => {
                self.end_create(ctx, Owned::Qp, None);
                return a.responder.fail(status);
            }
        };
        let input = a.input;
        let (pd, send_cq, recv_cq, srq) = (
            input.pd.raw(),
            input.send_cq.raw(),
            input.recv_cq.raw(),
            input.srq.map(|s| s.raw()),
        );
        if let Err(status) = self.reference_qp_parents(pd, send_cq, recv_cq, srq) {
            self.end_create(ctx, Owned::Qp, None);
            return a.responder.fail(status);
        }
        let mut ranges = alloc::vec![layout.sq];
        if let Some(rq) = layout.rq {
            ranges.extend([rq.ring, rq.dbr]);
        }
        let pins = match self.pin_ranges(&caller, &ranges) {
            Ok(pins) => pins,
            Err(status) => {
                self.release_qp_parents(pd, send_cq, recv_cq, srq);
                self.end_create(ctx, Owned::Qp, None);
                return a.responder.fail(status);
            }
        };
        let sq_pages = pins[0].bus_pages.clone();
        let rq_pages = pins.get(1).map(|p| p.bus_pages.clone()).unwrap_or_default();
        let rq_dbr = match (layout.rq, pins.get(2)) {
            (Some(rq), Some(pin)) => pin.bus_address(rq.dbr.va),
            _ => None,
        };
        let geometry = Geometry::user(
            layout.sq_log_bbs,
            layout.log_wqe_bbs,
            layout.rq.map(|rq| (rq.log_entries, rq.log_stride)),
            caps,
        );
        let now = self.deferred.now_ns();
        let total = (sq_pages.len() + rq_pages.len()) as u32;
        let reserved = self.with_objects_mut(|o| {
            let mtt = o.mtt.take_entries(total).map_err(IbStatus::from)?;
            let make = |h: Handle<kind::Qp>| {
                Arc::new(Qp::<P>::new_user(
                    h.number(),
                    input.qp_type,
                    input.sq_sig_all,
                    pd,
                    send_cq,
                    recv_cq,
                    srq,
                    geometry,
                    mtt,
                ))
            };
            match o.qps.create_with(now, make) {
                Ok(handle) => match o.qps.objects().get(handle).cloned() {
                    Some(qp) => Ok((handle, qp, mtt)),
                    None => Err(IbStatus::GenericError),
                },
                Err(error) => {
                    let _ = o.mtt.return_entries(mtt);
                    Err(IbStatus::from(error))
                }
            }
        });
        let (handle, qp, mtt) = match reserved.and_then(|r| r) {
            Ok(r) => r,
            Err(status) => {
                self.release_qp_parents(pd, send_cq, recv_cq, srq);
                self.end_create(ctx, Owned::Qp, Some((0, pins)));
                return a.responder.fail(status);
            }
        };
        let mut qpc = Qpc::new_zeroed();
        qpc.state = QpState::Reset.code();
        qpc.qp_type = input.qp_type.code();
        qpc.port = port;
        let mut flags = QpcFlags::USER;
        if input.sq_sig_all {
            flags |= QpcFlags::SQ_SIG_ALL;
        }
        if let Some(srq) = srq {
            flags |= QpcFlags::HAS_SRQ;
            qpc.srqn = Le32::new(Handle::<kind::Srq>::from_raw(srq).number());
        }
        qpc.flags = flags.bits();
        qpc.pd = Le32::new(Handle::<kind::Pd>::from_raw(pd).number());
        qpc.send_cqn = Le32::new(Handle::<kind::Cq>::from_raw(send_cq).number());
        qpc.recv_cqn = Le32::new(Handle::<kind::Cq>::from_raw(recv_cq).number());
        qpc.uar_index = Le32::new(uar);
        qpc.sq = user_desc(mtt.start(), &layout.sq, layout.sq_log_bbs, SQ_LOG_STRIDE);
        let mut commands = write_mtt_pages(mtt.start(), &sq_pages);
        if let (Some(rq), Some(dbr)) = (layout.rq, rq_dbr) {
            let rq_mtt = mtt.start() + sq_pages.len() as u32;
            qpc.rq = user_desc(rq_mtt, &rq.ring, rq.log_entries, rq.log_stride);
            qpc.rq_dbr = Le64::new(dbr);
            commands.extend(write_mtt_pages(rq_mtt, &rq_pages));
        }
        commands
            .push(Command::new(Opcode::Sw2HwQp, qp.qpn()).with_mailbox(qpc.as_bytes().to_vec()));
        let responder = a.responder;
        self.run_commands(
            commands,
            Box::new(move |hca, result| match result {
                Ok(_) => {
                    qp.set_life(QpLife::Live);
                    hca.end_create(ctx, Owned::Qp, Some((handle.raw(), pins)));
                    let out = QpCreated {
                        qpn: Qpn::from_low_bits(qp.qpn()),
                        caps: qp.caps(),
                    };
                    let private = CreateQpPrivOut {
                        qpn: qp.qpn(),
                        uar_index: uar,
                    };
                    responder.finish(
                        IbStatus::Success,
                        handle.raw(),
                        Some(&out),
                        private.emit().as_bytes(),
                    );
                }
                Err(error) => {
                    hca.forget_qp(handle, &qp);
                    hca.end_create(ctx, Owned::Qp, Some((0, pins)));
                    responder.fail(error.ib_status());
                }
            }),
        );
    }

    /// The checks of a user CreateQp that touch nothing: the layout, the
    /// capacities it grants, the port, and that every parent is the
    /// caller's.
    fn check_user_qp(
        &self,
        a: &Accepted<v::CreateQp, P::Request>,
        private: &[u8],
        process: u64,
    ) -> Result<(CreateQpPriv, QpCaps, u8), IbStatus> {
        if a.responder.private_room() < CreateQpPrivOut::SIZE {
            return Err(IbStatus::InvalidParameter);
        }
        let input = &a.input;
        if input.qp_type.is_special() {
            return Err(IbStatus::InvalidPermission);
        }
        let layout = CreateQpPriv::parse(private).map_err(|_| IbStatus::InvalidParameter)?;
        // A QP on an SRQ has no receive queue, and one without has one.
        if input.srq.is_some() == layout.rq.is_some() {
            return Err(IbStatus::InvalidParameter);
        }
        let report = self.report().ok_or(IbStatus::InvalidState)?;
        let caps = user_qp_caps(input.qp_type, &input.caps, &layout, &report.capabilities)?;
        // No port until RESET->INIT names one, unless the create does.
        let port = input.port.map_or(0, |p| p.get());
        if port > report.capabilities.num_ports {
            return Err(IbStatus::InvalidPort);
        }
        // Every parent must be the creating context's own.
        let ctx = a.handle;
        self.with_objects(|o| {
            owned_by(o, process, ctx, Owned::Pd, input.pd.raw())?;
            owned_by(o, process, ctx, Owned::Cq, input.send_cq.raw())?;
            owned_by(o, process, ctx, Owned::Cq, input.recv_cq.raw())?;
            if let Some(srq) = input.srq {
                owned_by(o, process, ctx, Owned::Srq, srq.raw())?;
            }
            Ok::<(), IbStatus>(())
        })??;
        Ok((layout, caps, port))
    }

    fn destroy_user_srq(self: &Arc<Self>, object: u64, done: super::Done<P>) {
        self.destroy_srq_then(object, RequestorMode::Kernel, done);
    }

    fn user_create_srq(
        self: &Arc<Self>,
        a: Accepted<v::CreateSrq, P::Request>,
        private: Vec<u8>,
        caller: PreparedUserRequest<P>,
    ) {
        let process = caller.process;
        let ctx = a.handle;
        if let Err(status) = self.begin_create(process, ctx) {
            return a.responder.fail(status);
        }
        let (layout, max_sge) = match self.check_user_srq(&a, &private, process) {
            Ok(checked) => checked,
            Err(status) => {
                self.end_create(ctx, Owned::Srq, None);
                return a.responder.fail(status);
            }
        };
        let pd = a.input.pd.raw();
        let limit = a.input.attr.srq_limit;
        let pins = match self.pin_ranges(&caller, &[layout.ring, layout.dbr]) {
            Ok(pins) => pins,
            Err(status) => {
                self.end_create(ctx, Owned::Srq, None);
                return a.responder.fail(status);
            }
        };
        let (ring_pages, dbr_bus) = match (&pins[0], pins[1].bus_address(layout.dbr.va)) {
            (ring, Some(dbr)) => (ring.bus_pages.clone(), dbr),
            _ => {
                self.end_create(ctx, Owned::Srq, Some((0, pins)));
                return a.responder.fail(IbStatus::GenericError);
            }
        };
        let (log_entries, log_stride) = (layout.log_entries, layout.log_stride);
        let reserved = self.with_objects_mut(|o| {
            let pd_handle = Handle::<kind::Pd>::from_raw(pd);
            o.pds
                .acquire(pd_handle)
                .map_err(|_| IbStatus::InvalidPdHandle)?;
            let mtt = match o.mtt.take_entries(ring_pages.len() as u32) {
                Ok(mtt) => mtt,
                Err(error) => {
                    let _ = o.pds.release(pd_handle);
                    return Err(IbStatus::from(error));
                }
            };
            let made = o.srqs.insert_with(|h| {
                Arc::new(Srq::<P>::new_user(
                    h.number(),
                    pd,
                    log_entries,
                    log_stride,
                    max_sge,
                    mtt,
                ))
            });
            match made.map(|h| (h, o.srqs.get(h).cloned())) {
                Ok((handle, Some(srq))) => Ok((handle, srq, mtt)),
                Ok((handle, None)) => {
                    let _ = o.srqs.remove(handle);
                    let _ = o.mtt.return_entries(mtt);
                    let _ = o.pds.release(pd_handle);
                    Err(IbStatus::GenericError)
                }
                Err(error) => {
                    let _ = o.mtt.return_entries(mtt);
                    let _ = o.pds.release(pd_handle);
                    Err(IbStatus::from(error))
                }
            }
        });
        let (handle, srq, mtt) = match reserved.and_then(|r| r) {
            Ok(r) => r,
            Err(status) => {
                self.end_create(ctx, Owned::Srq, Some((0, pins)));
                return a.responder.fail(status);
            }
        };
        let srqc = Srqc {
            pd: Le32::new(Handle::<kind::Pd>::from_raw(pd).number()),
            limit: Le32::new(limit),
            ring: user_desc(mtt.start(), &layout.ring, log_entries, log_stride),
            dbr: Le64::new(dbr_bus),
            ..Srqc::default()
        };
        let mut commands = write_mtt_pages(mtt.start(), &ring_pages);
        commands.push(
            Command::new(Opcode::Sw2HwSrq, srq.number()).with_mailbox(srqc.as_bytes().to_vec()),
        );
        let responder = a.responder;
        self.run_commands(
            commands,
            Box::new(move |hca, result| match result {
                Ok(_) => {
                    srq.set_life(SrqLife::Live);
                    hca.end_create(ctx, Owned::Srq, Some((handle.raw(), pins)));
                    let out = SrqAttr {
                        max_wr: 1 << log_entries,
                        max_sge,
                        srq_limit: limit,
                    };
                    let private = CreateSrqPrivOut { srqn: srq.number() };
                    responder.finish(
                        IbStatus::Success,
                        handle.raw(),
                        Some(&out),
                        private.emit().as_bytes(),
                    );
                }
                Err(error) => {
                    hca.forget_srq(handle, pd, mtt);
                    hca.end_create(ctx, Owned::Srq, Some((0, pins)));
                    responder.fail(error.ib_status());
                }
            }),
        );
    }

    /// The checks of a user CreateSrq that touch nothing; the SGEs a WQE
    /// of the layout holds.
    fn check_user_srq(
        &self,
        a: &Accepted<v::CreateSrq, P::Request>,
        private: &[u8],
        process: u64,
    ) -> Result<(CreateSrqPriv, u32), IbStatus> {
        if a.responder.private_room() < CreateSrqPrivOut::SIZE {
            return Err(IbStatus::InvalidParameter);
        }
        let layout = CreateSrqPriv::parse(private).map_err(|_| IbStatus::InvalidParameter)?;
        let report = self.report().ok_or(IbStatus::InvalidState)?;
        let cap = &report.capabilities;
        // A receive WQE's index is 16 bits (PRM 10.3).
        if layout.log_entries > cap.log_max_srq_wqes.min(SRQ_LOG_MAX_INDEX) {
            return Err(IbStatus::InvalidSrqSize);
        }
        let max_recv_sges = usize::from(cap.max_recv_sges);
        let largest = (SEG_SIZE * (1 + max_recv_sges))
            .next_power_of_two()
            .max(hca_prm::wqe::MIN_RECV_STRIDE);
        let stride = 1usize << layout.log_stride;
        if stride > largest {
            return Err(IbStatus::InvalidParameter);
        }
        let max_sge = (hca_prm::wqe::recv_sges_per_stride(stride).min(max_recv_sges)) as u32;
        let attr = a.input.attr;
        let entries = 1u32 << layout.log_entries;
        if attr.max_wr > entries {
            return Err(IbStatus::InvalidSrqSize);
        }
        if attr.max_sge > max_sge {
            return Err(IbStatus::InvalidMaxSge);
        }
        if attr.srq_limit > entries {
            return Err(IbStatus::InvalidParameter);
        }
        self.with_objects(|o| owned_by(o, process, a.handle, Owned::Pd, a.input.pd.raw()))??;
        Ok((layout, max_sge))
    }
}

impl<P: Platform> Hca<P> {
    /// Refuses a kernel client's create that names a user context's
    /// object as a parent (a user CQ's ring is in the process, where no
    /// kernel poll reads it; a user PD's regions and SRQ's WQEs are the
    /// process's): the status paired with the first such handle of
    /// `parents`. User creates are held to their own context by
    /// `owned_by`, so no create mixes owners.
    pub(crate) fn refuse_user_parents(&self, parents: &[(u64, IbStatus)]) -> Result<(), IbStatus> {
        self.with_objects(
            |o| match parents.iter().find(|&&(raw, _)| o.user.holds(raw)) {
                Some(&(_, status)) => Err(status),
                None => Ok(()),
            },
        )?
    }

    /// Refuses a request that came with no caller process (a kernel
    /// client's, [`Hca::submit_request`]) when the object its header names
    /// ([`VerbId::target`]) is a user context's, or when it moves or shares
    /// a region into a user context's PD (`RegSharedMr`, `ReregMr`,
    /// `ReregPhysMr`): the kind's invalid-handle status, before any effect.
    /// A user context's objects are its process's (their rings are the
    /// process's memory, its proxy tracks and destroys them); user requests
    /// reach them only through `run_user_request`'s ownership check, which
    /// then runs the same verbs as trusted requests, so the check is here,
    /// where the origin is still known, not in the verbs. A request this
    /// cannot decode passes: the verb's own decode answers it.
    pub(crate) fn refuse_user_targets(&self, verb: VerbId, input: &[u8]) -> Result<(), IbStatus> {
        use ib_types::ioctl::ObjectKind;
        let Ok((header, _)) = v::RequestHeaderAbi::read_from_prefix(input) else {
            return Ok(());
        };
        let target = header.handle.get();
        let invalid_target = match verb.target() {
            Some(ObjectKind::Pd) => IbStatus::InvalidPdHandle,
            Some(ObjectKind::Qp) => IbStatus::InvalidQpHandle,
            Some(ObjectKind::Cq) => IbStatus::InvalidCqHandle,
            Some(ObjectKind::Srq) => IbStatus::InvalidSrqHandle,
            Some(ObjectKind::Mr) => IbStatus::InvalidMrHandle,
            Some(ObjectKind::Mw) => IbStatus::InvalidMwHandle,
            Some(ObjectKind::Mcast) => IbStatus::InvalidMcastHandle,
            // The open CA and kernel AVs are never a user context's.
            Some(ObjectKind::Ca | ObjectKind::Av) | None => return Ok(()),
        };
        let new_pd = match verb {
            VerbId::RegSharedMr => decode_request::<v::RegSharedMr>(input)
                .ok()
                .map(|r| r.input.pd),
            VerbId::ReregMr => decode_request::<v::ReregMr>(input)
                .ok()
                .and_then(|r| r.input.pd),
            VerbId::ReregPhysMr => decode_request::<v::ReregPhysMr>(input)
                .ok()
                .and_then(|r| r.input.pd),
            _ => None,
        };
        self.with_objects(|o| {
            if o.user.is_empty() {
                return Ok(());
            }
            let held = match verb.target() {
                Some(ObjectKind::Mcast) => o
                    .mcasts
                    .get(Handle::<kind::Mcast>::from_raw(target))
                    .and_then(|m| o.qps.objects().get_by_number(m.qpn()))
                    .is_some_and(|(qp, _)| o.user.holds(qp.raw())),
                _ => o.user.holds(target),
            };
            if held {
                return Err(invalid_target);
            }
            match new_pd {
                Some(pd) if o.user.holds(pd.raw()) => Err(IbStatus::InvalidPdHandle),
                _ => Ok(()),
            }
        })
        // No tables, no user context: the verb answers as it would.
        .unwrap_or(Ok(()))
    }

    /// A completion event on CQ `cq` (raw handle): completes the waits
    /// pending on it, or remembers the event for the next wait. Returns
    /// false when `cq` is no user CQ. From the DPC.
    pub(crate) fn user_cq_event(&self, cq: u64) -> bool {
        let woken = self.with_objects_mut(|o| {
            if !o.user.contexts.values().any(|c| c.cqs.contains_key(&cq)) {
                return None;
            }
            let waits = o.user.waits.entry(cq).or_insert_with(|| CqWaits {
                fired: false,
                waiters: SpinLock::<P, _>::new(Vec::new()),
            });
            let woken = core::mem::take(waits.waiters.get_mut());
            waits.fired = woken.is_empty();
            Some(woken)
        });
        match woken {
            Ok(Some(woken)) => {
                for responder in woken {
                    responder.finish(IbStatus::Success, 0, Some(&Empty), &[]);
                }
                true
            }
            _ => false,
        }
    }

    /// Completes with [`IbStatus::Canceled`] every pending `WaitCqEvent`
    /// and `GetAsyncEvent` whose request was cancelled (the shell calls it
    /// from the request's cancel routine). Callable at DISPATCH_LEVEL.
    pub fn cancel_user_waits(&self) {
        let canceled = self.with_objects_mut(|o| {
            let mut waits = Vec::new();
            for cq in o.user.waits.values_mut() {
                let (gone, kept): (Vec<_>, Vec<_>) = core::mem::take(cq.waiters.get_mut())
                    .into_iter()
                    .partition(|r| r.is_canceled());
                *cq.waiters.get_mut() = kept;
                waits.extend(gone);
            }
            let mut events = Vec::new();
            for ctx in o.user.contexts.values_mut() {
                let (gone, kept): (Vec<_>, Vec<_>) = core::mem::take(ctx.event_waiters.get_mut())
                    .into_iter()
                    .partition(|r| r.is_canceled());
                *ctx.event_waiters.get_mut() = kept;
                events.extend(gone);
            }
            (waits, events)
        });
        let (waits, events) = canceled.unwrap_or_default();
        for responder in waits {
            responder.fail(IbStatus::Canceled);
        }
        for responder in events {
            responder.fail(IbStatus::Canceled);
        }
    }

    /// An asynchronous event of the object `record.handle` names: for an
    /// object of a user context, completes that context's oldest pending
    /// `GetAsyncEvent` or queues the event, and returns true; false for
    /// anything else (the kernel client's). From the DPC.
    pub(crate) fn user_async_event(&self, record: &AsyncEventRecord) -> bool {
        let object = record.handle;
        let found = self.with_objects_mut(|o| {
            let ctx = o.user.contexts.values_mut().find(|c| {
                c.qps.contains_key(&object)
                    || c.cqs.contains_key(&object)
                    || c.srqs.contains_key(&object)
            })?;
            Some(ctx.take_event(record))
        });
        match found {
            Ok(Some(Some(responder))) => {
                responder.finish(IbStatus::Success, 0, Some(record), &[]);
                true
            }
            Ok(Some(None)) => true,
            _ => false,
        }
    }

    /// An unaffiliated (port) event, a port change or a Table 6-3 trap: every open
    /// user context gets it, as its oldest pending `GetAsyncEvent`'s
    /// answer or queued. From the DPC.
    pub(crate) fn user_port_event(&self, record: &AsyncEventRecord) {
        let waiters = self.with_objects_mut(|o| {
            o.user
                .contexts
                .values_mut()
                .filter(|ctx| !ctx.closing)
                .filter_map(|ctx| ctx.take_event(record))
                .collect::<Vec<_>>()
        });
        for responder in waiters.unwrap_or_default() {
            responder.finish(IbStatus::Success, 0, Some(record), &[]);
        }
    }

    /// Ends every pending `WaitCqEvent` and `GetAsyncEvent` with
    /// [`IbStatus::Canceled`] (`STATUS_CANCELLED`): the device is being
    /// stopped for good (release-hardware after a removal), and a driver
    /// completes the requests it holds at removal as cancelled, rather than
    /// letting them fall with their objects as a generic failure.
    pub(crate) fn end_all_user_waits(&self) {
        self.end_waits(|_| true);
        let events = self.with_objects_mut(|o| {
            o.user
                .contexts
                .values_mut()
                .flat_map(|ctx| core::mem::take(ctx.event_waiters.get_mut()))
                .collect::<Vec<_>>()
        });
        for responder in events.unwrap_or_default() {
            responder.fail(IbStatus::Canceled);
        }
    }

    /// Ends the waits of the CQs `which` selects (destroyed, or their
    /// context closed) with [`IbStatus::Canceled`].
    fn end_waits(&self, which: impl Fn(u64) -> bool) {
        let ended = self.with_objects_mut(|o| {
            let cqs: Vec<u64> = o
                .user
                .waits
                .keys()
                .copied()
                .filter(|&cq| which(cq))
                .collect();
            cqs.into_iter()
                .filter_map(|cq| o.user.waits.remove(&cq))
                .flat_map(|w| w.waiters.into_inner())
                .collect::<Vec<_>>()
        });
        for responder in ended.unwrap_or_default() {
            responder.fail(IbStatus::Canceled);
        }
    }

    /// Unmaps and unlocks the user memory every user object pinned; the
    /// device no longer uses memory (teardown).
    pub(crate) fn release_user_pins(&self) {
        let taken = self.with_objects_mut(|o| (o.mtt.clone(), o.user.take_pinned()));
        if let Ok((mtt, pins)) = taken {
            for pin in pins {
                mtt.unpin_user(self, pin);
            }
        }
    }

    /// The handles of the user contexts `process` has open (not closing):
    /// what the proxy closes, in that process's context, at the cleanup of
    /// the process's last handle on the device (`IRP_MJ_CLEANUP`), so that
    /// no page of the process stays locked when it exits.
    pub fn user_contexts_of(&self, process: u64) -> Vec<u64> {
        self.with_objects(|o| {
            o.user
                .contexts
                .iter()
                .filter(|(_, c)| c.process == process && !c.closing)
                .map(|(&handle, _)| handle)
                .collect()
        })
        .unwrap_or_default()
    }

    /// User contexts open now (diagnostics and leak checks).
    pub fn user_context_count(&self) -> usize {
        self.with_objects(|o| o.user.len()).unwrap_or(0)
    }

    /// UAR pages free for user contexts (diagnostics and leak checks).
    pub fn free_uar_pages(&self) -> u32 {
        self.with_objects(|o| o.user.uars.as_ref().map_or(0, |u| u.free_count()))
            .unwrap_or(0)
    }
}

/// Room check helper kept for the private outputs' sizes.
const _: () = assert!(CreateCqPrivOut::SIZE <= 64 && CreateQpPrivOut::SIZE <= 64);

#[cfg(test)]
mod tests {
    use super::*;

    fn caps_device() -> hca_prm::cmd::DevCap {
        let mut cap = hca_prm::cmd::DevCap::new_zeroed();
        cap.log_max_wqes = 14;
        cap.log_max_wqe_size = 9;
        cap.max_send_sges = 16;
        cap.max_recv_sges = 16;
        cap.max_inline_bytes = hca_prm::Le16::new(256);
        cap
    }

    fn ask(send_wr: u32, sge: u32) -> QpCaps {
        QpCaps {
            max_send_wr: send_wr,
            max_recv_wr: 4,
            max_send_sge: sge,
            max_recv_sge: 1,
            max_inline_data: 0,
        }
    }

    #[test]
    fn user_layouts_grant_what_they_hold() {
        let cap = caps_device();
        // 64 BBs of 2 (128-byte WQEs): 32 send WRs; RQ 16 x 32 bytes.
        let layout =
            CreateQpPriv::new(6, 1, 0x10_0000, Some((4, 5, 0x20_0000, 0x30_0000))).unwrap();
        let caps = user_qp_caps(QpType::Rc, &ask(32, 2), &layout, &cap).unwrap();
        assert_eq!(caps.max_send_wr, 32);
        assert_eq!(caps.max_recv_wr, 16);
        assert_eq!(caps.max_recv_sge, 1);
        assert_eq!(caps.max_send_sge, (128 - 16 - 32) / 16);
        // More WRs than the ring holds; more SGEs than the stride holds.
        assert_eq!(
            user_qp_caps(QpType::Rc, &ask(33, 2), &layout, &cap),
            Err(IbStatus::InvalidMaxWrs)
        );
        assert_eq!(
            user_qp_caps(QpType::Rc, &ask(8, 6), &layout, &cap),
            Err(IbStatus::InvalidMaxSge)
        );
        // A WQE stride beyond the device's largest WQE (512 bytes).
        let big = CreateQpPriv::new(8, 4, 0x10_0000, Some((4, 5, 0x20_0000, 0x30_0000))).unwrap();
        assert_eq!(
            user_qp_caps(QpType::Rc, &ask(1, 1), &big, &cap),
            Err(IbStatus::InvalidParameter)
        );
        // A ring beyond the device's deepest queue.
        let deep =
            CreateQpPriv::new(15, 1, 0x10_0000, Some((4, 5, 0x100_0000, 0x30_0000))).unwrap();
        assert_eq!(
            user_qp_caps(QpType::Rc, &ask(1, 1), &deep, &cap),
            Err(IbStatus::InvalidMaxWrs)
        );
    }

    #[test]
    fn user_rings_beyond_what_a_cqe_wqe_index_names_are_refused() {
        // A device allowing deeper queues than a CQE's 16-bit `wqe_index`
        // names (PRM 10.4): 2^16 units is the deepest ring granted.
        let mut cap = caps_device();
        cap.log_max_wqes = 20;
        let sq = |log| CreateQpPriv::new(log, 0, 0x1000_0000, None).unwrap();
        assert!(user_qp_caps(QpType::Rc, &ask(1, 1), &sq(16), &cap).is_ok());
        assert_eq!(
            user_qp_caps(QpType::Rc, &ask(1, 1), &sq(17), &cap),
            Err(IbStatus::InvalidMaxWrs)
        );
        let rq = |log| {
            CreateQpPriv::new(6, 0, 0x1000_0000, Some((log, 5, 0x2000_0000, 0x30_0000))).unwrap()
        };
        assert!(user_qp_caps(QpType::Rc, &ask(1, 1), &rq(16), &cap).is_ok());
        assert_eq!(
            user_qp_caps(QpType::Rc, &ask(1, 1), &rq(17), &cap),
            Err(IbStatus::InvalidMaxWrs)
        );
    }
}
