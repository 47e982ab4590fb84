//! Queue pairs (guide 6.5, 6.7; PRM 6.1, 10.2, 10.3).
//!
//! Contract:
//! - **Create** (kernel QPs: RC, UC, UD, and a port's SMI/GSI QP at its
//!   fixed number, guide 6.7): the send ring holds the requested depth
//!   rounded up to a power of two, each WQE a fixed power-of-two number of
//!   64-byte basic blocks large enough for the control segment, the
//!   transport's address segments and `max(SGEs, inline)` (PRM 10.2), at
//!   most `2^log_max_wqe_size` bytes; the ring is at most
//!   `2^log_max_wqes` basic blocks and at most 2^16 (a CQE's `wqe_index`
//!   is 16 bits, PRM 10.4), the receive ring likewise in WQEs. The receive ring has a power-of-two
//!   stride of at least 32 bytes holding the header and the SGEs (PRM
//!   10.3). Anything beyond the device answers [`IbStatus::InvalidMaxWrs`],
//!   [`IbStatus::InvalidMaxSge`] or [`IbStatus::InvalidParameter`] (inline)
//!   and changes nothing; the granted capacities are answered. Rings and the
//!   receive doorbell record are zero-filled common buffers allocated by
//!   the work item, described by MTT entries of the verbs' one allocator,
//!   then `WRITE_MTT` and `SW2HW_QP` (UAR page 0). The QP takes a use of its
//!   PD ([`Hca::reference_pd`]) and of its CQs ([`Hca::reference_cq`]),
//!   given back on destroy, and room in its CQs for every completion its
//!   work queues can produce (`cq::Room`, guide 8.2.3 item 1:
//!   [`IbStatus::InsufficientResources`] when a CQ lacks it). User QPs (rings in pinned user memory) are
//!   `verbs::user`'s; a user-mode CreateQp reaching this path is
//!   [`IbStatus::Unsupported`].
//! - **On an SRQ** (guide 6.5.1, 6.4; PRM 6.1): with the create's `srq`
//!   set the QP takes a use of the SRQ ([`Hca::reference_srq`], given back
//!   on destroy or a failed create, so the SRQ's destroy is
//!   [`IbStatus::ResourceBusy`] meanwhile), has no receive ring or doorbell
//!   record (granted receive capacities 0) and its context carries
//!   `HAS_SRQ` and the SRQ's number. An SMI QP on an SRQ is
//!   [`IbStatus::InvalidParameter`]. [`Hca::post_recv`] on such a QP is
//!   [`IbStatus::InvalidQpState`]: its receives are posted to the SRQ.
//! - **Modify** (guide 6.5.3): judged by `ib_types::qp_state` (IBA Table
//!   91) against the cached state before any command, so an illegal
//!   transition or a missing or extra attribute is refused with its
//!   status and nothing changes; alternate paths, path migration and
//!   queue resizing are [`IbStatus::Unsupported`]. One modify at a time
//!   ([`IbStatus::ResourceBusy`] while one is outstanding). The state and
//!   attributes are cached only when `MODIFY_QP` succeeds. TIME WAIT
//!   (guide 6.5.2): an RC or UC QP that reached RTR and was then reset may
//!   not reach RTR again until [`QPN_QUIET_PERIOD_NS`] after the reset
//!   completed; until then INIT->RTR is refused with
//!   [`IbStatus::QpInTimewait`] and nothing changes (refused rather than
//!   delayed: the caller, a connection manager, chooses when to retry). A
//!   QP reset before it ever reached RTR, and a datagram QP, never wait.
//! - **Query** (guide 6.5.4): answered from the cache, no command.
//! - **Device events** (PRM 8.2, guide 6.5.3 state caching): an event
//!   the device raises for a QP reaches the live QP with that number only
//!   (`qp_device_event`, called by the verbs' event router before the
//!   client's asynchronous event). `QP_FATAL`, `WQ_INVALID_REQUEST`,
//!   `WQ_ACCESS_ERROR` and `SRQ_LAST_WQE` mean the QP is in ERR (PRM 8.2,
//!   10.5), so the cache says ERR; the
//!   others (`COMM_EST`, `SQ_DRAINED`, `PATH_MIGRATED`) change no state.
//!   The device raises no event for a requester-side WQE error (PRM 10.5:
//!   the error CQE is the notice, the QP goes to ERR, or SQE for UD/UC
//!   local errors), so the cache learns of those only from the client's
//!   next modify. While the QP is being created or destroyed its events
//!   are not delivered (destroy moves it to ERR itself).
//! - **Destroy** (guide 6.5.5): `HW2SW_QP` (the device discards outstanding
//!   work without completions and keeps the CQEs already written, PRM
//!   6.1.3/6.1.4); when it completes the number goes to quarantine
//!   (`QpTable::destroy`), the uses of PD and CQs are dropped, and the
//!   memory is freed by the work item. Multicast attachments (guide 6.5.5
//!   item 6: remove the QP from every group): destroy detaches every
//!   membership first (`DETACH_MCG` each, one after the other; a refusal
//!   is not an obstacle, since `HW2SW_QP` drops attachments too, PRM
//!   6.1.4) and forgets it, so its handle goes stale; an attach or detach
//!   still in flight makes destroy [`IbStatus::ResourceBusy`] before
//!   anything is sent (the per-QP count [`Qp::mcast_attachments`]
//!   disagrees with the memberships). If a later command of the destroy
//!   fails, the QP stays, out of its groups. Destroy then moves a QP
//!   that is not in RESET to ERR, so the device completes every
//!   outstanding WQE with `WR_FLUSH_ERR` (PRM 10.5) before `HW2SW_QP`;
//!   posts are refused
//!   ([`IbStatus::InvalidQpHandle`]) from the moment destroy begins. When
//!   `HW2SW_QP` completes (the device wrote every CQE of the QP before
//!   answering), each of its CQs that still holds CQEs of it records the
//!   destroyed QP with the sequence number just past the last of them
//!   (`cq::RetiredQp`, which also keeps the SRQ it received from); the
//!   number is freed only after that, so its flushed completions get
//!   their `wr_id`s even after the number has a new owner, and never touch
//!   the new owner's rings (guide 6.5.4 note, 6.5.5 items 3 and 9, 8.2.3
//!   item 2). A special QP's number is reused at once, a general QP's
//!   after the quiet period: both are resolved by the record, which the
//!   CQ drops once a poll passes its end. A user QP keeps none (its
//!   `wr_id`s are its provider's), and a CQE resolves against the live QP
//!   only if that QP's completions of its kind go to the CQ polled, so a
//!   CQE no record covers never touches another QP's ring. Deferring the number's reuse
//!   instead would block a special QP's re-creation on the client polling.
//! - **Create details.** A general QP's port is set by RESET->INIT;
//!   `SW2HW_QP` needs a valid one, so the create's port (or port 1) stands
//!   in until then.
//! - **Post** ([`Hca::post_send`], [`Hca::post_recv`], guide 8.1): state
//!   (the cache), room and each WR (`ib_types::wr` validation against the
//!   transport and granted capacities) are checked before the WR is
//!   written, so a refused WR leaves the earlier ones posted and returns
//!   how many were. Send WQEs are built by `hca_prm::wqe` at their real
//!   size in basic blocks (the producer counts BBs; a WQE may wrap the
//!   ring end), then one release fence and one SQ doorbell on UAR page 0
//!   per batch; receive WQEs take a slot each and the doorbell record is
//!   written once per batch (a QP in ERR also gets the SQ doorbell, PRM
//!   10.5). The core takes decoded WRs: a [`SendRequest`] carries the UD
//!   destination's PRM address vector and inline bytes, because reading
//!   memory behind addresses (`SendWrDesc` scatter lists, inline data) is
//!   the shell's job where `unsafe` lives; the AV handle is resolved by the
//!   caller until the AV verbs provide a lookup.
//! - **wr_id** (PRM 10.4): each ring keeps a shadow of `wr_id`s by WQE
//!   index, in atomics outside the ring's lock (`Completions`);
//!   [`Hca::poll_cq`] holds the object tables shared and the CQ's lock
//!   while it reads the CQEs and asks each completion's QP incarnation
//!   (`complete`: a record of a destroyed QP, else the live QP with the
//!   number) for the `wr_id`, retiring that WQE (and, for sends, the
//!   unsignaled ones before it) by advancing the ring's completion tail
//!   (`tail::CompletionTail`), which post reads for room. So several
//!   processors may poll one CQ at once: they take turns on the CQ's lock,
//!   each completion goes to one of them, and each ring is retired in the
//!   order the device wrote its CQEs, so no slot is reposted before its
//!   `wr_id` was read. A CQE naming no WQE in the window ahead of the tail
//!   retires nothing and gets `wr_id` 0. A receive taken from an SRQ (CQE
//!   flag SRQ, PRM 10.4; or any receive of a QP on an SRQ) is looked up in
//!   the incarnation's SRQ by the CQE's WQE index (`Srq::complete`), which
//!   frees that SRQ slot (lock-free: `srq::WrIdSlots`). An error
//!   completion of the live QP records the state it implies; one of a
//!   destroyed QP changes nothing.
//! - **Reset** (PRM 6.1.3, guide 6.5.5 items 3-5): a QP moved to RESET
//!   restarts its rings at WQE index 0, while completions written before
//!   the reset may still wait in its CQs with the old indices. When the
//!   modify is answered the core notes, per CQ, the sequence number the
//!   next CQE will be polled with (`Hca::cq_next_sequence`) and keeps the
//!   rings' `wr_id` shadows; a completion polled with a smaller number is
//!   answered from them, so earlier completions keep their `wr_id`s after
//!   the QP is reconnected and posted to again.
//! - **Locks.** A QP's control lock (state, attributes), then its send-ring
//!   lock, then its receive-ring lock; never the object-table lock or a
//!   CQ's lock while holding one of them. Post takes one ring lock; poll
//!   takes the object tables shared, then the CQ lock, and under it reads
//!   the `wr_id`s without any ring lock (guide 6.5.5 item 2, 8.2.3 item 3:
//!   no cross lock between post and poll on a QP; only a reset's kept
//!   `wr_id`s have a lock, which post never takes, and an error completion
//!   takes the QP's control lock, after the CQ's). The one lock post and
//!   poll have in common is the object tables' (post: the QP, an SRQ, a
//!   window or AV; poll: the CQ and each completion's QP and SRQ), and
//!   both take it *shared* only (`Hca::with_objects`, an `EX_SPIN_LOCK` on
//!   Windows), so it never makes one wait for the other; only a create,
//!   destroy or other table change (exclusive) makes them wait. Polls of
//!   one CQ wait for each other on its lock, never for a post. A receive
//!   completed from an SRQ takes no SRQ lock either (`srq::WrIdSlots`), so
//!   posting to an SRQ and polling its completions share no lock.

use alloc::boxed::Box;
use alloc::collections::VecDeque;
use alloc::sync::Arc;
use alloc::vec::Vec;
// The `Completions` shadow is `tail`'s protocol: its atomics are the ones
// loom drives under `--cfg loom` (`crate::sync`).
use crate::sync::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};

use driver_platform::{CommonBuffer, Deferred, Platform, Request, RequestorMode, SpinLock};
use hca_prm::cmd::Opcode;
use hca_prm::ctx::{BufDesc, ModifyQp as ModifyQpInput, Qpc, QpcFlags};
use hca_prm::doorbell::DoorbellRecord;
use hca_prm::wqe::{BB_SIZE, MAX_SEND_WQE_BYTES, MIN_RECV_STRIDE, SEG_SIZE, inline_seg_len};
use hca_prm::{Le16, Le32, Le64};
use ib_types::ioctl::{CreateQp, DestroyQp, Empty, ModifyQp, QpCreated, QpQueryOut, QueryQp};
use ib_types::qp::{QpCaps, QpModify, QpState, QpType};
use ib_types::scalars::Qpn;
use ib_types::status::IbStatus;
use zerocopy::{FromZeros, IntoBytes};

use super::Accepted;
use super::Buffer;
use super::cq::{Demand, LOG_PAGE, PAGE, alloc_pages, write_mtt};
use crate::cmd::Command;
use crate::hca::Hca;
use crate::resources::{EntryRange, Handle, KERNEL_UAR, SpecialQp, kind};

mod complete;
mod post;
mod tail;

pub(crate) use complete::resolve_completion;
pub use post::SendRequest;
pub(crate) use tail::CompletionTail;

/// The TIME WAIT (guide 6.5.2, 6.5.5 item 11): how long a destroyed QP's
/// number waits before reuse, and how long a connected QP that was reset
/// waits before it may reach RTR again: 2 seconds.
pub const QPN_QUIET_PERIOD_NS: u64 = 2_000_000_000;

/// Largest ring (`log2` of basic blocks or receive WQEs) the core makes,
/// whatever the device reports: a CQE names its WQE by a 16-bit
/// `wqe_index` (PRM 10.4), which a deeper ring would make ambiguous (the
/// wrong `wr_id` returned).
pub(super) const MAX_LOG_WQES: u8 = hca_prm::cqe::LOG_MAX_WQE_INDEX;
/// Largest send WQE (`log2` of bytes) the core considers; `size16` is one
/// byte, so no WQE exceeds 4080 bytes anyway.
pub(super) const MAX_LOG_WQE_SIZE: u8 = 12;

/// `log2` of a send basic block (PRM 10.2).
pub(super) const SQ_LOG_STRIDE: u8 = 6;
/// Bytes of the UD address segment.
pub(super) const UD_ADDR_SEG: usize = 48;
/// Bytes of the remote address and atomic segments (RC's largest prefix).
pub(super) const RC_PREFIX: usize = 32;

/// Where a QP is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Life {
    /// Memory and commands under way; the client has no handle yet.
    Creating,
    /// Usable.
    Live,
    /// `MODIFY_QP` outstanding.
    Modifying,
    /// `HW2SW_QP` outstanding.
    Destroying,
}

/// Ring geometry chosen at create.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    /// `log2` of the send ring's basic blocks.
    pub(super) sq_log_bbs: u8,
    /// `log2` of the basic blocks of one send WQE.
    log_wqe_bbs: u8,
    /// `log2` of the receive ring's WQEs.
    pub(super) rq_log_entries: u8,
    /// `log2` of the receive stride.
    pub(super) rq_log_stride: u8,
    /// The capacities granted.
    caps: QpCaps,
    /// Whether the QP has its own receive ring (not on an SRQ).
    pub(super) has_rq: bool,
}

impl Geometry {
    /// The bytes of this QP's largest send WQE (its stride).
    pub(super) fn send_wqe_bytes(&self) -> usize {
        (BB_SIZE << self.log_wqe_bbs).min(MAX_SEND_WQE_BYTES)
    }

    /// The geometry of a user QP whose rings the user-mode provider laid
    /// out (`verbs::user`, which checks it against the device first).
    pub(super) fn user(
        sq_log_bbs: u8,
        log_wqe_bbs: u8,
        rq: Option<(u8, u8)>,
        caps: QpCaps,
    ) -> Self {
        let (rq_log_entries, rq_log_stride) = rq.unwrap_or((0, 0));
        Self {
            sq_log_bbs,
            log_wqe_bbs,
            rq_log_entries,
            rq_log_stride,
            caps,
            has_rq: rq.is_some(),
        }
    }

    pub(super) fn sq_pages(&self) -> usize {
        (BB_SIZE << self.sq_log_bbs).div_ceil(PAGE)
    }

    pub(super) fn rq_pages(&self) -> usize {
        if !self.has_rq {
            return 0;
        }
        (1usize << (self.rq_log_entries + self.rq_log_stride)).div_ceil(PAGE)
    }
}

/// The device limits the geometry is chosen within.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    log_max_wqes: u8,
    log_max_wqe_size: u8,
    max_send_sges: u32,
    max_recv_sges: u32,
    max_inline: u32,
}

/// The ring geometry for `caps` on a QP of `qp_type`, within `limits`
/// (PRM 10.2, 10.3).
pub(crate) fn geometry(
    qp_type: QpType,
    caps: &QpCaps,
    limits: &Limits,
) -> Result<Geometry, IbStatus> {
    if caps.max_send_sge > limits.max_send_sges || caps.max_recv_sge > limits.max_recv_sges {
        return Err(IbStatus::InvalidMaxSge);
    }
    if caps.max_inline_data > limits.max_inline {
        return Err(IbStatus::InvalidParameter);
    }
    let prefix = match qp_type {
        QpType::Ud | QpType::Smi | QpType::Gsi => UD_ADDR_SEG,
        QpType::Rc => RC_PREFIX,
        QpType::Uc => SEG_SIZE,
    };
    // At least one data segment, so an atomic's 8-byte segment fits.
    let data = (caps.max_send_sge.max(1) as usize * SEG_SIZE)
        .max(inline_seg_len(caps.max_inline_data as usize));
    let wqe_bytes = SEG_SIZE + prefix + data;
    let max_wqe = (1usize << limits.log_max_wqe_size).min(MAX_SEND_WQE_BYTES);
    if wqe_bytes > max_wqe {
        return Err(if caps.max_send_sge > 1 {
            IbStatus::InvalidMaxSge
        } else {
            IbStatus::InvalidParameter
        });
    }
    let wqe_bbs = wqe_bytes.div_ceil(BB_SIZE).next_power_of_two();
    let log_wqe_bbs = wqe_bbs.trailing_zeros() as u8;
    // Every WQE (granted, not only asked for) uses whole stride units, so
    // the granted SGEs and inline fill the stride.
    let stride_bytes = (wqe_bbs * BB_SIZE).min(max_wqe);
    let room = stride_bytes - SEG_SIZE - prefix;
    let send_wrs = caps
        .max_send_wr
        .max(1)
        .checked_next_power_of_two()
        .ok_or(IbStatus::InvalidMaxWrs)?;
    let sq_log_bbs = send_wrs.trailing_zeros() as u8 + log_wqe_bbs;
    if sq_log_bbs > limits.log_max_wqes {
        return Err(IbStatus::InvalidMaxWrs);
    }
    let recv_stride = (SEG_SIZE + SEG_SIZE * caps.max_recv_sge.max(1) as usize)
        .next_power_of_two()
        .max(MIN_RECV_STRIDE);
    let rq_log_stride = recv_stride.trailing_zeros() as u8;
    let recv_wrs = caps
        .max_recv_wr
        .max(1)
        .checked_next_power_of_two()
        .ok_or(IbStatus::InvalidMaxWrs)?;
    let rq_log_entries = recv_wrs.trailing_zeros() as u8;
    if rq_log_entries > limits.log_max_wqes {
        return Err(IbStatus::InvalidMaxWrs);
    }
    let granted = QpCaps {
        max_send_wr: send_wrs,
        max_recv_wr: recv_wrs,
        max_send_sge: ((room / SEG_SIZE) as u32).min(limits.max_send_sges),
        max_recv_sge: ((recv_stride / SEG_SIZE - 1) as u32).min(limits.max_recv_sges),
        max_inline_data: ((room - 4) as u32).min(limits.max_inline),
    };
    Ok(Geometry {
        sq_log_bbs,
        log_wqe_bbs,
        rq_log_entries,
        rq_log_stride,
        caps: granted,
        has_rq: true,
    })
}

/// A QP's control state, under the QP's own lock.
pub(super) struct Control {
    pub(super) life: Life,
    /// The state the last successful `MODIFY_QP` left (or RESET).
    pub(super) state: QpState,
    /// The attributes set so far (never STATE, CUR_STATE or CAP).
    pub(super) attr: QpModify,
    pub(super) mtt: Option<EntryRange>,
    /// The device put the QP in ERR (an event of PRM 8.2) while a
    /// `MODIFY_QP` was outstanding. A device posts a command's completion
    /// some time after executing it, so the error may have come after the
    /// modify took effect: the QP is in ERR whatever the modify did, unless
    /// the modify took it to RESET (a QP in RESET raises no error; the
    /// error came first and the reset cleared it).
    pub(super) err_while_modifying: bool,
    /// The QP is connected (RC/UC) and reached RTR since it was last in
    /// RESET: its reset begins a TIME WAIT.
    pub(super) connected: bool,
    /// Until when (host time, ns) a RESET->INIT QP may not go to RTR: the
    /// TIME WAIT of its last connection (guide 6.5.2); 0 when none.
    pub(super) time_wait_until_ns: u64,
}

impl Control {
    /// The control state of a QP being created, holding its MTT entries.
    fn creating(mtt: EntryRange) -> Self {
        Self {
            life: Life::Creating,
            err_while_modifying: false,
            connected: false,
            time_wait_until_ns: 0,
            state: QpState::Reset,
            attr: QpModify::default(),
            mtt: Some(mtt),
        }
    }
}

/// The send ring, under its own lock (PRM 10.2).
pub(super) struct SendRing<B> {
    pub(super) ring: Option<B>,
    /// Basic blocks posted (the doorbell's producer counter).
    pub(super) producer: u32,
    /// Where a kernel post builds a WQE before copying it into the ring:
    /// the QP's largest WQE in 64-bit words (little-endian), allocated
    /// with the ring and reused.
    pub(super) scratch: Vec<u64>,
    /// Where a kernel client's inline bytes are gathered from its SGEs
    /// before they go into the WQE: `max_inline_data` bytes, allocated
    /// with the ring and reused.
    pub(super) inline: Vec<u8>,
}

impl<B> SendRing<B> {
    /// No ring yet, nothing posted.
    fn empty() -> Self {
        Self {
            ring: None,
            producer: 0,
            scratch: Vec::new(),
            inline: Vec::new(),
        }
    }
}

/// The receive ring and its doorbell record, under their own lock (PRM
/// 10.3, 9.2).
pub(super) struct RecvRing<B> {
    pub(super) ring: Option<B>,
    pub(super) dbr: Option<B>,
    /// Receive WQEs posted.
    pub(super) producer: u32,
}

impl<B> RecvRing<B> {
    /// No ring or doorbell record yet, nothing posted.
    fn empty() -> Self {
        Self {
            ring: None,
            dbr: None,
            producer: 0,
        }
    }
}

/// The poll side's view of a QP's rings, apart from the rings' locks so
/// that polling takes no lock posting takes (guide 6.5.5 item 2): by slot,
/// the `wr_id` (and, for sends, the basic blocks) of each WQE, stored by
/// post before its doorbell and read by poll when the WQE's completion
/// arrives; and how far completions reached (`*_tail`), advanced by poll
/// and read by post for room. The poll path retires a ring's completions
/// under its CQ's lock, in ring order (so polls of one CQ on several
/// processors take turns); the tail's only other writer is a reset or a
/// software flush, which restarts it in a new epoch ([`CompletionTail`]).
pub(crate) struct Completions<P: Platform> {
    pub(crate) send_wr_ids: Vec<AtomicU64>,
    pub(crate) send_bbs: Vec<AtomicU32>,
    /// Basic blocks completed (polled).
    pub(crate) send_tail: CompletionTail,
    pub(crate) recv_wr_ids: Vec<AtomicU64>,
    /// Receive WQEs completed (polled).
    pub(crate) recv_tail: CompletionTail,
    /// Set once a reset kept `wr_id`s in `before_reset`.
    pub(crate) reset_kept: AtomicBool,
    /// The `wr_id`s of the rings before each RESET whose completions may
    /// still wait in the send and receive CQs, each with the CQ sequence
    /// number the first completion after that reset is polled with
    /// (`Hca::cq_next_sequence`). Taken by poll and reset, never by post.
    pub(crate) before_reset: SpinLock<P, BeforeReset>,
}

/// See [`Completions::before_reset`].
#[derive(Default)]
pub(crate) struct BeforeReset {
    pub(crate) send: VecDeque<(u64, Vec<u64>)>,
    pub(crate) recv: VecDeque<(u64, Vec<u64>)>,
}

impl<P: Platform> Completions<P> {
    fn new(send_slots: usize, recv_slots: usize) -> Self {
        Self {
            send_wr_ids: (0..send_slots).map(|_| AtomicU64::new(0)).collect(),
            send_bbs: (0..send_slots).map(|_| AtomicU32::new(0)).collect(),
            send_tail: CompletionTail::new(),
            recv_wr_ids: (0..recv_slots).map(|_| AtomicU64::new(0)).collect(),
            recv_tail: CompletionTail::new(),
            reset_kept: AtomicBool::new(false),
            before_reset: SpinLock::<P, _>::new(BeforeReset::default()),
        }
    }
}

/// A queue pair.
pub struct Qp<P: Platform> {
    pub(super) qpn: u32,
    pub(super) qp_type: QpType,
    pub(super) sq_sig_all: bool,
    pub(super) pd: u64,
    pub(super) send_cq: u64,
    pub(super) recv_cq: u64,
    /// The SRQ the QP receives from (raw handle), holding a use of it.
    pub(super) srq: Option<u64>,
    pub(super) geometry: Geometry,
    /// Multicast groups the QP is attached to (maintained by the multicast
    /// verbs; destroy is refused while it is not zero).
    mcast: AtomicU32,
    /// The cached state's code, read by the posting paths without the
    /// control lock.
    state: AtomicU8,
    /// Set (under both ring locks) when destroy begins: posts are refused
    /// from then on, so none can reach the device after `HW2SW_QP`.
    closing: AtomicBool,
    pub(super) control: SpinLock<P, Control>,
    pub(super) sq: SpinLock<P, SendRing<Buffer<P>>>,
    pub(super) rq: SpinLock<P, RecvRing<Buffer<P>>>,
    /// The port `SW2HW_QP` was given (the create's; 0 for a general QP
    /// created without one), for
    /// re-creating the QP on D0 entry ([`super::restore`]).
    pub(super) create_port: u8,
    /// What poll needs, without the ring locks.
    pub(super) done: Completions<P>,
    /// The kernel memory access installed when the QP was created
    /// ([`Hca::set_kernel_locker`], which the shell calls once after
    /// start): a kernel client's inline send reads its bytes through it
    /// with no lock taken and no reference counted per post. `None` if
    /// none was installed yet (post then takes the current one) or for a
    /// user QP.
    pub(super) kernel_reader: Option<Arc<P::Locker>>,
}

impl<P: Platform> core::fmt::Debug for Qp<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Qp")
            .field("qpn", &self.qpn)
            .field("qp_type", &self.qp_type)
            .finish_non_exhaustive()
    }
}

impl<P: Platform> Qp<P> {
    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The multicast attachment count: the multicast verbs increment it on
    /// attach and decrement it on detach.
    pub fn mcast_attachments(&self) -> &AtomicU32 {
        &self.mcast
    }

    /// The QP's type.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// Counts an attachment about to be made (`verbs::mcast`), under the
    /// control lock so that a destroy that has begun sees it or refuses
    /// it: [`IbStatus::InvalidQpHandle`] once destroy began.
    pub(crate) fn begin_mcast_attach(&self) -> Result<(), IbStatus> {
        let c = self.control.lock();
        match c.life {
            Life::Live | Life::Modifying => {
                self.mcast.fetch_add(1, Ordering::AcqRel);
                Ok(())
            }
            Life::Creating | Life::Destroying => Err(IbStatus::InvalidQpHandle),
        }
    }

    /// Drops an attachment counted by
    /// [`begin_mcast_attach`](Self::begin_mcast_attach) (it failed, or was
    /// detached).
    pub(crate) fn end_mcast_attach(&self) {
        let _ = self
            .mcast
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// The cached state.
    pub fn state(&self) -> QpState {
        QpState::from_code(self.state.load(Ordering::Acquire)).unwrap_or(QpState::Err)
    }

    /// Records the state a successful `MODIFY_QP` left; to RESET the
    /// device's counters return to 0, and so do the rings'.
    pub(super) fn set_state(&self, c: &mut Control, state: QpState) {
        c.state = state;
        self.state.store(state.code(), Ordering::Release);
        if state == QpState::Reset {
            let mut sq = self.sq.lock();
            sq.producer = 0;
            self.done.send_tail.restart(0);
            drop(sq);
            let mut rq = self.rq.lock();
            rq.producer = 0;
            self.done.recv_tail.restart(0);
            if let Some(dbr) = rq.dbr.as_ref() {
                dbr.write(0, DoorbellRecord::new(0).as_bytes());
            }
        }
    }

    /// Before a RESET: keeps each ring's `wr_id`s for the completions
    /// still to be polled (guide 6.5.5 item 3: a reset must not change
    /// what earlier completions report, and new work restarts at WQE index
    /// 0, PRM 6.1.3), tagged with the CQ sequence numbers that end them.
    /// A ring with nothing outstanding keeps nothing.
    fn keep_before_reset(&self, (send_end, recv_end): (u64, u64)) {
        let ids = |slots: &[AtomicU64]| -> Vec<u64> {
            slots.iter().map(|a| a.load(Ordering::Acquire)).collect()
        };
        let done = &self.done;
        let send_outstanding = self.sq.lock().producer != done.send_tail.counter();
        let recv_outstanding =
            self.srq.is_none() && self.rq.lock().producer != done.recv_tail.counter();
        if !(send_outstanding || recv_outstanding) {
            return;
        }
        let mut kept = done.before_reset.lock();
        if send_outstanding {
            kept.send.push_back((send_end, ids(&done.send_wr_ids)));
        }
        if recv_outstanding {
            kept.recv.push_back((recv_end, ids(&done.recv_wr_ids)));
        }
        // Before `set_state` zeroes the tails: a poll that sees a tail
        // move under it looks here.
        done.reset_kept.store(true, Ordering::Release);
    }

    /// Takes the QP's common buffers (for freeing once the device no longer
    /// uses them).
    pub(crate) fn take_buffers(&self) -> Vec<Buffer<P>> {
        let sq = self.sq.lock().ring.take();
        let mut rq = self.rq.lock();
        [sq, rq.ring.take(), rq.dbr.take()]
            .into_iter()
            .flatten()
            .collect()
    }

    pub(super) fn set_life(&self, life: Life) {
        self.control.lock().life = life;
    }

    /// A user QP (`verbs::user`): the same object with no kernel rings
    /// (the user-mode provider posts to rings in its own memory) and
    /// one-slot shadows, as the kernel never posts to it.
    #[expect(clippy::too_many_arguments, reason = "the QP's fixed properties")]
    pub(super) fn new_user(
        qpn: u32,
        qp_type: QpType,
        sq_sig_all: bool,
        pd: u64,
        send_cq: u64,
        recv_cq: u64,
        srq: Option<u64>,
        geometry: Geometry,
        mtt: EntryRange,
    ) -> Self {
        Self {
            qpn,
            qp_type,
            sq_sig_all,
            pd,
            send_cq,
            recv_cq,
            srq,
            geometry,
            mcast: AtomicU32::new(0),
            state: AtomicU8::new(QpState::Reset.code()),
            closing: AtomicBool::new(false),
            control: SpinLock::<P, _>::new(Control::creating(mtt)),
            sq: SpinLock::<P, _>::new(SendRing::empty()),
            rq: SpinLock::<P, _>::new(RecvRing::empty()),
            // User QPs are not re-created from kernel state on D0 entry
            // (`verbs::restore`).
            create_port: 0,
            done: Completions::new(1, 1),
            // A user QP's sends are its provider's.
            kernel_reader: None,
        }
    }

    /// The capacities granted.
    pub(super) fn caps(&self) -> QpCaps {
        self.geometry.caps
    }
}

/// The buffer descriptor of a ring (PRM 6.0).
pub(super) fn desc(mtt: u32, log_entries: u8, log_stride: u8) -> BufDesc {
    BufDesc {
        mtt_index: Le32::new(mtt),
        page_offset: Le32::new(0),
        log_page_size: LOG_PAGE,
        log_entries,
        log_stride,
        ..BufDesc::default()
    }
}

/// Which special QP a type is.
fn special(qp_type: QpType) -> Option<SpecialQp> {
    match qp_type {
        QpType::Smi => Some(SpecialQp::Smi),
        QpType::Gsi => Some(SpecialQp::Gsi),
        _ => None,
    }
}

/// Writes the attributes of `m` into a `MODIFY_QP` input (PRM 6.1.3).
/// Fails with [`IbStatus::Unsupported`] for attributes this device has no
/// place for, and [`IbStatus::InvalidParameter`] for an address vector it
/// cannot encode.
pub(super) fn modify_input(m: &QpModify) -> Result<ModifyQpInput, IbStatus> {
    if m.alt_path.is_some() || m.path_mig_state.is_some() || m.cap.is_some() {
        return Err(IbStatus::Unsupported);
    }
    let mut input = ModifyQpInput::new_zeroed();
    input.attr_mask = Le32::new(m.mask().bits());
    if let Some(state) = m.state {
        input.next_state = state.code();
    }
    if let Some(cur) = m.cur_state {
        input.cur_state = cur.code();
    }
    let q = &mut input.qpc;
    if m.en_sqd_async_notify == Some(true) {
        q.flags = QpcFlags::SQD_EVENT.bits();
    }
    if let Some(access) = m.access {
        q.access = Le32::new(access.bits());
    }
    if let Some(index) = m.pkey_index {
        q.pkey_index = Le16::new(index);
    }
    if let Some(port) = m.port {
        q.port = port.get();
    }
    if let Some(qkey) = m.qkey {
        q.qkey = Le32::new(qkey.get());
    }
    if let Some(av) = m.av.as_ref() {
        q.av = hca_prm::av::Av::try_from(av).map_err(|_| IbStatus::InvalidParameter)?;
    }
    if let Some(mtu) = m.path_mtu {
        q.path_mtu = mtu.code();
    }
    if let Some(timeout) = m.timeout {
        q.timeout = timeout;
    }
    if let Some(retry) = m.retry_cnt {
        q.retry_cnt = retry;
    }
    if let Some(retry) = m.rnr_retry {
        q.rnr_retry = retry;
    }
    if let Some(psn) = m.rq_psn {
        q.rq_psn = Le32::new(psn.get());
    }
    if let Some(n) = m.max_rd_atomic {
        q.max_rd_atomic = n;
    }
    if let Some(timer) = m.min_rnr_timer {
        q.min_rnr_timer = timer;
    }
    if let Some(psn) = m.sq_psn {
        q.sq_psn = Le32::new(psn.get());
    }
    if let Some(n) = m.max_dest_rd_atomic {
        q.max_dest_rd_atomic = n;
    }
    if let Some(qpn) = m.dest_qpn {
        q.dest_qpn = Le32::new(qpn.get());
    }
    Ok(input)
}

/// Merges the attributes of a successful modify into the cache.
fn merge(cache: &mut QpModify, m: &QpModify) {
    macro_rules! take {
        ($($f:ident),*) => { $( if m.$f.is_some() { cache.$f = m.$f; } )* };
    }
    take!(
        en_sqd_async_notify,
        access,
        pkey_index,
        port,
        qkey,
        av,
        path_mtu,
        timeout,
        retry_cnt,
        rnr_retry,
        rq_psn,
        max_rd_atomic,
        min_rnr_timer,
        sq_psn,
        max_dest_rd_atomic,
        dest_qpn
    );
}

impl<P: Platform> Hca<P> {
    /// The live QP behind a raw handle, for a request of `mode`.
    #[inline]
    pub(crate) fn find_qp(&self, raw: u64, mode: RequestorMode) -> Result<Arc<Qp<P>>, IbStatus> {
        self.find_object::<kind::Qp>(raw, mode)
    }

    /// Takes the uses a QP holds: its PD, both CQs and its SRQ if any.
    /// Undoes what it took on failure.
    pub(super) fn reference_qp_parents(
        &self,
        pd: u64,
        send_cq: u64,
        recv_cq: u64,
        srq: Option<u64>,
    ) -> Result<(), IbStatus> {
        if let Some(srq) = srq {
            self.reference_srq(srq)?;
        }
        if let Err(status) = self.reference_qp_parents_no_srq(pd, send_cq, recv_cq) {
            if let Some(srq) = srq {
                let _ = self.release_srq(srq);
            }
            return Err(status);
        }
        Ok(())
    }

    /// The PD and CQ part of [`reference_qp_parents`](Self::reference_qp_parents).
    fn reference_qp_parents_no_srq(
        &self,
        pd: u64,
        send_cq: u64,
        recv_cq: u64,
    ) -> Result<(), IbStatus> {
        self.reference_pd(pd)?;
        if let Err(status) = self.reference_cq(send_cq) {
            let _ = self.release_pd(pd);
            return Err(status);
        }
        if let Err(status) = self.reference_cq(recv_cq) {
            let _ = self.release_cq(send_cq);
            let _ = self.release_pd(pd);
            return Err(status);
        }
        Ok(())
    }

    /// Drops the uses taken by [`reference_qp_parents`](Self::reference_qp_parents).
    pub(super) fn release_qp_parents(&self, pd: u64, send_cq: u64, recv_cq: u64, srq: Option<u64>) {
        if let Some(srq) = srq {
            let _ = self.release_srq(srq);
        }
        let _ = self.release_cq(recv_cq);
        let _ = self.release_cq(send_cq);
        let _ = self.release_pd(pd);
    }

    /// Removes a QP whose creation failed: its table entry (the number to
    /// quarantine), MTT entries and parent uses.
    pub(super) fn forget_qp(&self, handle: Handle<kind::Qp>, qp: &Qp<P>) {
        let mtt = qp.control.lock().mtt.take();
        // The CQ room is kept per QP number: give it back while the number
        // is still this QP's, so a QP created at the number on another
        // processor (special QPs reuse theirs at once) cannot commit into
        // this QP's entry before the release removes it.
        self.release_cq_room(qp.qpn, qp.send_cq, qp.recv_cq);
        let now = self.deferred.now_ns();
        let _ = self.with_objects_mut(|o| {
            let _ = o.qps.destroy(handle, now);
            if let Some(mtt) = mtt {
                let _ = o.mtt.return_entries(mtt);
            }
        });
        self.free_later(qp.take_buffers());
        self.release_qp_parents(qp.pd, qp.send_cq, qp.recv_cq, qp.srq);
    }

    /// An event the device raised for QP number `qpn` (PRM 8.2): records
    /// the state it implies in the live QP's cache and returns that QP's
    /// handle for the client's asynchronous event; `None` when no live QP
    /// has the number (the event is then not delivered). Takes the
    /// object-table lock, then the QP's control lock, one after the other.
    pub(crate) fn qp_device_event(&self, qpn: u32, event: crate::eq::QpEvent) -> Option<u64> {
        use crate::eq::QpEvent;
        let (handle, qp) = self
            .with_objects(|o| {
                o.qps
                    .objects()
                    .get_by_number(qpn)
                    .map(|(h, qp)| (h.raw(), qp.clone()))
            })
            .ok()
            .flatten()?;
        let to_err = matches!(
            event,
            QpEvent::Fatal
                | QpEvent::InvalidRequest
                | QpEvent::AccessError
                | QpEvent::LastWqeReached
        );
        if to_err {
            let mut c = qp.control.lock();
            match c.life {
                Life::Creating | Life::Destroying => return None,
                Life::Live | Life::Modifying => {
                    if c.state != QpState::Reset {
                        qp.set_state(&mut c, QpState::Err);
                    }
                    if c.life == Life::Modifying {
                        c.err_while_modifying = true;
                    }
                }
            }
        }
        Some(handle)
    }

    pub(crate) fn query_qp_request<R: Request>(&self, a: Accepted<QueryQp, R>) {
        match self.find_qp(a.handle, a.mode) {
            Ok(qp) => {
                let c = qp.control.lock();
                let out = QpQueryOut {
                    qp_type: qp.qp_type,
                    state: c.state,
                    sq_sig_all: qp.sq_sig_all,
                    qpn: Qpn::from_low_bits(qp.qpn),
                    caps: qp.geometry.caps,
                    attr: c.attr,
                };
                drop(c);
                a.responder.finish(IbStatus::Success, 0, Some(&out), &[]);
            }
            Err(status) => a.responder.fail(status),
        }
    }
}

impl<P: Platform> Hca<P>
where
    P::Request: 'static,
{
    pub(crate) fn create_qp_request(self: &Arc<Self>, a: Accepted<CreateQp, P::Request>) {
        if let Err(status) = self.check_ca(a.handle, a.mode) {
            a.responder.fail(status);
            return;
        }
        let input = a.input;
        if a.mode == RequestorMode::User {
            a.responder.fail(IbStatus::Unsupported);
            return;
        }
        let Some(report) = self.report() else {
            a.responder.fail(IbStatus::InvalidState);
            return;
        };
        let cap = &report.capabilities;
        let limits = Limits {
            log_max_wqes: cap.log_max_wqes.min(MAX_LOG_WQES),
            log_max_wqe_size: cap.log_max_wqe_size.min(MAX_LOG_WQE_SIZE),
            max_send_sges: cap.max_send_sges.into(),
            max_recv_sges: cap.max_recv_sges.into(),
            max_inline: cap.max_inline_bytes.get().into(),
        };
        let num_ports = cap.num_ports;
        let srq = input.srq.map(|h| h.raw());
        // On an SRQ the QP has no receive ring (the ABI refuses receive
        // capacities with an SRQ), and SMI takes none (PRM 6.1).
        if srq.is_some() && input.qp_type == QpType::Smi {
            a.responder.fail(IbStatus::InvalidParameter);
            return;
        }
        let geometry = match geometry(input.qp_type, &input.caps, &limits) {
            Ok(mut g) => {
                if srq.is_some() {
                    g.has_rq = false;
                    g.rq_log_entries = 0;
                    g.caps.max_recv_wr = 0;
                    g.caps.max_recv_sge = 0;
                }
                g
            }
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        };
        // A special QP's port names its slot; a general QP's is set by
        // RESET->INIT (0 until then, PRM 6.1.2) unless the create names one.
        let which = special(input.qp_type);
        let port = input.port.map_or(0, |p| p.get());
        if (which.is_some() && port == 0) || port > num_ports {
            a.responder.fail(IbStatus::InvalidPort);
            return;
        }
        let (pd, send_cq, recv_cq) = (input.pd.raw(), input.send_cq.raw(), input.recv_cq.raw());
        // A kernel QP's parents are kernel objects (user ones: `verbs::user`).
        let parents = [
            (pd, IbStatus::InvalidPdHandle),
            (send_cq, IbStatus::InvalidCqHandle),
            (recv_cq, IbStatus::InvalidCqHandle),
            (srq.unwrap_or(0), IbStatus::InvalidSrqHandle),
        ];
        if let Err(status) = self.refuse_user_parents(&parents) {
            a.responder.fail(status);
            return;
        }
        if let Err(status) = self.reference_qp_parents(pd, send_cq, recv_cq, srq) {
            a.responder.fail(status);
            return;
        }
        let now = self.deferred.now_ns();
        let pages = (geometry.sq_pages() + geometry.rq_pages()) as u32;
        // Taken before the object tables (its lock is never held with them).
        let kernel_reader = self.verbs.kernel_locker.lock().clone();
        let reserved = self.with_objects_mut(|o| {
            let mtt = o.mtt.take_entries(pages).map_err(IbStatus::from)?;
            let make = |h: Handle<kind::Qp>| {
                Arc::new(Qp::<P> {
                    qpn: h.number(),
                    qp_type: input.qp_type,
                    sq_sig_all: input.sq_sig_all,
                    pd,
                    send_cq,
                    recv_cq,
                    srq,
                    geometry,
                    mcast: AtomicU32::new(0),
                    state: AtomicU8::new(QpState::Reset.code()),
                    closing: AtomicBool::new(false),
                    control: SpinLock::<P, _>::new(Control::creating(mtt)),
                    sq: SpinLock::<P, _>::new(SendRing::empty()),
                    rq: SpinLock::<P, _>::new(RecvRing::empty()),
                    create_port: port,
                    done: Completions::new(1 << geometry.sq_log_bbs, 1 << geometry.rq_log_entries),
                    kernel_reader: kernel_reader.clone(),
                })
            };
            let made = match which {
                Some(which) => o.qps.create_special_with(port, which, make),
                None => o.qps.create_with(now, make),
            };
            match made {
                Ok(handle) => match o.qps.objects().get(handle).cloned() {
                    Some(qp) => Ok((handle, qp, mtt)),
                    None => Err(IbStatus::GenericError),
                },
                Err(error) => {
                    let _ = o.mtt.return_entries(mtt);
                    Err(match error {
                        crate::resources::ResourceError::NumberInUse { .. } => {
                            IbStatus::ResourceBusy
                        }
                        other => IbStatus::from(other),
                    })
                }
            }
        });
        let (handle, qp, mtt) = match reserved.and_then(|r| r) {
            Ok(r) => r,
            Err(status) => {
                self.release_qp_parents(pd, send_cq, recv_cq, srq);
                a.responder.fail(status);
                return;
            }
        };
        // Guide 8.2.3 item 1: the CQs must hold every completion the work
        // queues can produce (`cq::Room`).
        let send = Demand {
            wrs: geometry.caps.max_send_wr,
            srq: None,
        };
        let recv = match srq {
            Some(raw) => match self.find_object::<kind::Srq>(raw, RequestorMode::Kernel) {
                Ok(found) => Demand {
                    wrs: 0,
                    srq: Some((raw, found.entries())),
                },
                Err(status) => {
                    self.forget_qp(handle, &qp);
                    a.responder.fail(status);
                    return;
                }
            },
            None => Demand {
                wrs: geometry.caps.max_recv_wr,
                srq: None,
            },
        };
        if let Err(status) = self.commit_cq_room(handle.number(), (send_cq, send), (recv_cq, recv))
        {
            self.forget_qp(handle, &qp);
            a.responder.fail(status);
            return;
        }
        let responder = a.responder;
        let (pd_number, send_cqn, recv_cqn) = (
            Handle::<kind::Pd>::from_raw(pd).number(),
            Handle::<kind::Cq>::from_raw(send_cq).number(),
            Handle::<kind::Cq>::from_raw(recv_cq).number(),
        );
        self.queue_passive(Box::new(move |hca| {
            if hca.report().is_none() {
                // Stopped (nothing to undo) or below D0 (give it back).
                hca.forget_qp(handle, &qp);
                responder.fail(IbStatus::InvalidState);
                return;
            }
            let g = qp.geometry;
            let sq_pages = g.sq_pages();
            let rq_pages = g.rq_pages();
            let mut buffers = Vec::new();
            let wanted: &[usize] = if g.has_rq {
                &[sq_pages, rq_pages, 1]
            } else {
                &[sq_pages]
            };
            for &pages in wanted {
                match alloc_pages(hca, pages) {
                    Ok(buffer) => buffers.push(buffer),
                    Err(status) => {
                        hca.free_later(buffers);
                        hca.forget_qp(handle, &qp);
                        responder.fail(status);
                        return;
                    }
                }
            }
            let mut it = buffers.into_iter();
            let (Some(sq), rq, dbr) = (it.next(), it.next(), it.next()) else {
                hca.forget_qp(handle, &qp);
                responder.fail(IbStatus::GenericError);
                return;
            };
            let rq_mtt = mtt.start() + sq_pages as u32;
            let mut qpc = Qpc::new_zeroed();
            qpc.state = QpState::Reset.code();
            qpc.qp_type = qp.qp_type.code();
            qpc.port = port;
            let mut flags = QpcFlags::empty();
            if qp.sq_sig_all {
                flags |= QpcFlags::SQ_SIG_ALL;
            }
            if let Some(srq) = qp.srq {
                // PRM 6.1: receives come from the SRQ; `rq` and `rq_dbr`
                // are ignored.
                flags |= QpcFlags::HAS_SRQ;
                qpc.srqn = Le32::new(Handle::<kind::Srq>::from_raw(srq).number());
            }
            qpc.flags = flags.bits();
            qpc.pd = Le32::new(pd_number);
            qpc.send_cqn = Le32::new(send_cqn);
            qpc.recv_cqn = Le32::new(recv_cqn);
            qpc.uar_index = Le32::new(KERNEL_UAR);
            qpc.sq = desc(mtt.start(), g.sq_log_bbs, SQ_LOG_STRIDE);
            let mut commands = write_mtt(mtt.start(), sq.bus_address(), sq_pages);
            if let (Some(rq), Some(dbr)) = (rq.as_ref(), dbr.as_ref()) {
                qpc.rq = desc(rq_mtt, g.rq_log_entries, g.rq_log_stride);
                qpc.rq_dbr = Le64::new(dbr.bus_address());
                commands.extend(write_mtt(rq_mtt, rq.bus_address(), rq_pages));
            }
            commands
                .push(Command::new(Opcode::Sw2HwQp, qp.qpn).with_mailbox(qpc.as_bytes().to_vec()));
            let scratch = alloc::vec![0u64; g.send_wqe_bytes().div_ceil(8)];
            let inline = alloc::vec![0; g.caps.max_inline_data as usize];
            {
                let mut s = qp.sq.lock();
                s.ring = Some(sq);
                s.scratch = scratch;
                s.inline = inline;
            }
            {
                let mut r = qp.rq.lock();
                r.ring = rq;
                r.dbr = dbr;
            }
            hca.run_commands(
                commands,
                Box::new(move |hca, result| match result {
                    Ok(_) => {
                        qp.set_life(Life::Live);
                        let out = QpCreated {
                            qpn: Qpn::from_low_bits(qp.qpn),
                            caps: qp.geometry.caps,
                        };
                        responder.finish(IbStatus::Success, handle.raw(), Some(&out), &[]);
                    }
                    Err(error) => {
                        hca.forget_qp(handle, &qp);
                        responder.fail(error.ib_status());
                    }
                }),
            );
        }));
    }

    pub(crate) fn modify_qp_request(self: &Arc<Self>, a: Accepted<ModifyQp, P::Request>) {
        let qp = match self.find_qp(a.handle, a.mode) {
            Ok(qp) => qp,
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        };
        let modify = a.input;
        let now = self.deferred.now_ns();
        let checked = {
            let mut c = qp.control.lock();
            match c.life {
                Life::Live => {}
                Life::Modifying => return a.responder.fail(IbStatus::ResourceBusy),
                Life::Creating | Life::Destroying => {
                    return a.responder.fail(IbStatus::InvalidQpHandle);
                }
            }
            let next = ib_types::qp_state::check_modify(qp.qp_type, c.state, &modify)
                .map_err(|e| e.status())
                .and_then(|next| {
                    // Guide 6.5.2: after a connected QP's reset, the next
                    // RTR waits out the TIME WAIT; refused, not delayed.
                    if next == QpState::Rtr && now < c.time_wait_until_ns {
                        Err(IbStatus::QpInTimewait)
                    } else {
                        Ok(next)
                    }
                })
                .and_then(|next| modify_input(&modify).map(|input| (next, input)));
            if next.is_ok() {
                c.life = Life::Modifying;
                c.err_while_modifying = false;
            }
            next
        };
        let (next, input) = match checked {
            Ok(r) => r,
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        };
        let responder = a.responder;
        self.run_commands(
            alloc::vec![
                Command::new(Opcode::ModifyQp, qp.qpn).with_mailbox(input.as_bytes().to_vec())
            ],
            Box::new(move |hca, result| {
                // Where the completions written before a reset end in each
                // CQ, read before the QP's lock (a CQ's lock is never
                // taken under it): the device wrote them all before it
                // answered.
                let reset_at = (next == QpState::Reset && result.is_ok()).then(|| {
                    (
                        hca.cq_next_sequence(qp.send_cq),
                        hca.cq_next_sequence(qp.recv_cq),
                    )
                });
                let mut c = qp.control.lock();
                c.life = Life::Live;
                // An error the device raised meanwhile outlives the modify
                // (see `Control::err_while_modifying`); a failed modify
                // leaves the ERR the event recorded.
                let device_err = core::mem::take(&mut c.err_while_modifying);
                match result {
                    Ok(_) => {
                        if let Some(sequences) = reset_at {
                            qp.keep_before_reset(sequences);
                        }
                        if next == QpState::Rtr && qp.qp_type.is_connected() {
                            c.connected = true;
                        }
                        if next == QpState::Reset && core::mem::take(&mut c.connected) {
                            c.time_wait_until_ns =
                                hca.deferred.now_ns().saturating_add(QPN_QUIET_PERIOD_NS);
                        }
                        let next = if device_err && next != QpState::Reset {
                            QpState::Err
                        } else {
                            next
                        };
                        qp.set_state(&mut c, next);
                        if next == QpState::Reset {
                            c.attr = QpModify::default();
                        } else {
                            merge(&mut c.attr, &modify);
                        }
                        drop(c);
                        responder.finish(IbStatus::Success, 0, Some(&Empty), &[]);
                    }
                    Err(error) => {
                        drop(c);
                        responder.fail(error.ib_status());
                    }
                }
            }),
        );
    }

    pub(crate) fn destroy_qp_request(self: &Arc<Self>, a: Accepted<DestroyQp, P::Request>) {
        let qp = match self.find_qp(a.handle, a.mode) {
            Ok(qp) => qp,
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        };
        let responder = a.responder;
        self.destroy_qp_then(a.handle, qp, responder.into_done());
    }

    /// Destroys `qp` (handle `raw`; see the module doc), then calls `done`
    /// (inline when refused, else from the DPC).
    pub(super) fn destroy_qp_then(
        self: &Arc<Self>,
        raw: u64,
        qp: Arc<Qp<P>>,
        done: super::Done<P>,
    ) {
        let handle = Handle::<kind::Qp>::from_raw(raw);
        // Guide 6.5.5 item 6: the QP leaves every multicast group it is in.
        // Its memberships are claimed first (object-table lock), then
        // checked against the count under the control lock: an attach or
        // detach still in flight makes the destroy busy.
        let memberships = match self.claim_memberships(qp.qpn) {
            Ok(memberships) => memberships,
            Err(status) => return done(self, Err(status)),
        };
        {
            let mut c = qp.control.lock();
            let settled = qp.mcast.load(Ordering::Acquire) as usize == memberships.len();
            if c.life != Life::Live || !settled {
                drop(c);
                self.unclaim_memberships(&memberships);
                return done(self, Err(IbStatus::ResourceBusy));
            }
            c.life = Life::Destroying;
        }
        {
            // A post holding a ring lock finishes (doorbell included)
            // before the commands below are submitted; later ones see the
            // flag.
            let _sq = qp.sq.lock();
            let _rq = qp.rq.lock();
            qp.closing.store(true, Ordering::Release);
        }
        // To ERR first (PRM 6.1.3): the device completes every outstanding
        // WQE with WR_FLUSH_ERR, so no posted WR is lost silently; then
        // HW2SW_QP. A QP in RESET has nothing outstanding.
        let mut commands = Vec::new();
        if qp.state() != QpState::Reset {
            let mut input = ModifyQpInput::new_zeroed();
            input.attr_mask = Le32::new(ib_types::qp::QpAttrMask::STATE.bits());
            input.next_state = QpState::Err.code();
            commands.push(
                Command::new(Opcode::ModifyQp, qp.qpn).with_mailbox(input.as_bytes().to_vec()),
            );
        }
        commands.push(Command::new(Opcode::Hw2SwQp, qp.qpn));
        let qpn = qp.qpn;
        self.leave_groups(
            qpn,
            memberships,
            Box::new(move |hca| Self::finish_destroy(hca, qp, handle, commands, done)),
        );
    }

    /// The rest of a destroy, once the QP left its groups: to ERR, then
    /// `HW2SW_QP`.
    fn finish_destroy(
        hca: &Arc<Self>,
        qp: Arc<Qp<P>>,
        handle: Handle<kind::Qp>,
        commands: Vec<Command>,
        done: super::Done<P>,
    ) {
        hca.run_commands(
            commands,
            Box::new(
                move |hca, result| match hca.forgive_destroy(handle.raw(), result) {
                    Ok(_) => {
                        {
                            let mut c = qp.control.lock();
                            c.state = QpState::Reset;
                        }
                        qp.state.store(QpState::Reset.code(), Ordering::Release);
                        // Every event of this QP came before this completion on
                        // the one EQ: the number can go to quarantine now. Its
                        // CQs keep it for the CQEs it left unpolled (written
                        // before this answer), before the number can be reused.
                        hca.retire_qp_in_cqs(&qp);
                        hca.forget_qp(handle, &qp);
                        done(hca, Ok(()));
                    }
                    Err(error) => {
                        qp.closing.store(false, Ordering::Release);
                        qp.set_life(Life::Live);
                        done(hca, Err(error.ib_status()));
                    }
                },
            ),
        );
    }
}

impl<P: Platform> Hca<P> {
    /// The memory translation service the verbs own (the one MTT
    /// allocator), for kernel code that registers memory directly rather
    /// than through the MR verbs (`verbs::region`). Fails with
    /// [`IbStatus::InvalidState`] while the device is not started.
    pub fn memory_translation(&self) -> Result<crate::mr::MemoryTranslation<P>, IbStatus> {
        self.with_objects(|o| o.mtt.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        log_max_wqes: 14,
        log_max_wqe_size: 9,
        max_send_sges: 16,
        max_recv_sges: 16,
        max_inline: 256,
    };

    #[test]
    fn geometry_rounds_up_and_respects_the_device() {
        let caps = QpCaps {
            max_send_wr: 10,
            max_recv_wr: 3,
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let g = geometry(QpType::Rc, &caps, &LIMITS).unwrap();
        // 16 + 32 + 32 = 80 bytes: 2 BBs per WQE.
        assert_eq!(g.log_wqe_bbs, 1);
        assert_eq!(g.sq_log_bbs, 4 + 1);
        assert_eq!(g.caps.max_send_wr, 16);
        assert_eq!(g.caps.max_recv_wr, 4);
        assert!(g.caps.max_send_sge >= 2 && g.caps.max_inline_data >= 60);
        assert_eq!(g.rq_log_stride, 5);
        assert_eq!(g.caps.max_recv_sge, 1);
        let ud = geometry(QpType::Ud, &caps, &LIMITS).unwrap();
        // 16 + 48 + 32 = 96 bytes: 2 BBs.
        assert_eq!(ud.log_wqe_bbs, 1);
        let too_many = QpCaps {
            max_send_sge: 17,
            ..caps
        };
        assert_eq!(
            geometry(QpType::Rc, &too_many, &LIMITS),
            Err(IbStatus::InvalidMaxSge)
        );
        let deep = QpCaps {
            max_send_wr: 1 << 14,
            ..caps
        };
        assert_eq!(
            geometry(QpType::Rc, &deep, &LIMITS),
            Err(IbStatus::InvalidMaxWrs)
        );
        let inline = QpCaps {
            max_inline_data: 257,
            ..caps
        };
        assert_eq!(
            geometry(QpType::Rc, &inline, &LIMITS),
            Err(IbStatus::InvalidParameter)
        );
        let huge = QpCaps {
            max_send_wr: u32::MAX,
            ..caps
        };
        assert_eq!(
            geometry(QpType::Rc, &huge, &LIMITS),
            Err(IbStatus::InvalidMaxWrs)
        );
    }
}
