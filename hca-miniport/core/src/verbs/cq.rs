//! Completion queues (guide 6.8, 8.2, 8.3; PRM 6.2, 9.2, 9.3, 10.4).
//!
//! Contract:
//! - **Create** (kernel CQs): the ring holds the requested depth rounded
//!   up to a power of two, at most the device's `2^log_max_cqes` (more is
//!   [`IbStatus::InvalidCqSize`]); its actual size is answered. The ring is
//!   a zero-filled DMA common buffer (PRM 10.4's owner rule needs the zero
//!   fill) described page by page by MTT entries from the verbs' MTT
//!   allocator (after the EQ's reserved entries); the consumer doorbell
//!   record (PRM 9.2) is one more common buffer of one page, kept across
//!   resizes because `RESIZE_CQ` keeps `ci_dbr`. Both are allocated by the
//!   work item (PASSIVE_LEVEL), then `WRITE_MTT` and `SW2HW_CQ` (UAR page 0,
//!   the core's EQ) complete the request from the DPC. User CQs (rings in
//!   the caller's pinned memory, guide 6.8.1) are `verbs::user`'s; a
//!   user-mode CreateCq reaching this path is [`IbStatus::Unsupported`].
//!   Only comp_vector 0 exists (one EQ).
//! - **Resize** (guide 6.8.2): a new ring and MTT range, then `RESIZE_CQ`:
//!   the device copies the outstanding CQEs into the new ring and resets
//!   the consumer record to 0. While the command is outstanding the CQ
//!   polls empty (software must not consume from the old ring what the
//!   device copies), so no completion is lost or doubled. A resize whose
//!   outstanding entries do not fit fails (`EXCEED_LIMIT`, answered
//!   [`IbStatus::InvalidCqSize`]) and leaves the old ring in use. A resize
//!   to the current size answers at once.
//! - **Room** (guide 8.2.3 item 1: CQ overflow is prevented, since it
//!   cannot be recovered): each CQ counts the CQEs the work queues of the
//!   kernel QPs completing on it can have outstanding (every WR of a send
//!   or receive queue, an SRQ's depth once however many of its QPs complete
//!   here, `Room`). A CreateQp whose queues would take a CQ past its
//!   entries answers [`IbStatus::InsufficientResources`] (nothing created),
//!   and a resize below the count [`IbStatus::InvalidCqSize`]; destroying
//!   the QP gives its share back. Not counted: the completions a destroyed
//!   QP left unpolled (its share is returned at destroy), and user-mode
//!   QPs (`verbs::user`), whose providers own their rings.
//! - **Destroy** (guide 6.8.3): refused with [`IbStatus::ResourceBusy`]
//!   while a QP references the CQ ([`Hca::reference_cq`]); otherwise
//!   `HW2SW_CQ`, and only when its completion is processed is the number
//!   freed and the memory queued for freeing: every event of the CQ
//!   precedes that completion on the one EQ, so none reaches a new owner.
//! - **Poll** ([`Hca::poll_cq`], guide 8.2.1): reads CQEs at the consumer
//!   counter while their owner bit is current (PRM 10.4), converts them
//!   with `hca_prm::cqe`, and writes the consumer record once per batch.
//!   A CQE that does not decode (an unknown status or opcode) is reported
//!   as a [`WcStatus::GeneralErr`] completion, never dropped silently.
//!   It holds the object tables shared and then the CQ's own lock for the
//!   whole batch; it never waits for a command or a post. Work request
//!   IDs are the QPs' (the device stores none): under the CQ lock, each
//!   completion's QP incarnation supplies it by WQE index
//!   (`qp::resolve_completion`): a destroyed QP this CQ still holds CQEs
//!   of (`RetiredQp`, polled before its end), else the live QP with the
//!   number. Several processors may poll one CQ at once: they take turns
//!   on its lock, each completion goes to one of them with its own
//!   `wr_id`, and each QP ring is retired in ring order.
//! - **Arm** ([`Hca::arm_cq`], guide 8.2.2, PRM 9.3): the CQ doorbell on
//!   UAR page 0 with the consumer counter at the time of arming; the device
//!   fires at once if CQEs arrived beyond it. [`poll_and_rearm`] is the
//!   guide's 8.3 algorithm on top.
//! - **Backlog** (`super::restore`, `super::fatal`): completions the device
//!   can no longer deliver through the ring (those unpolled at a D0 exit,
//!   software flushes after a device failure) wait in order in the CQ's
//!   backlog, `wr_id`s resolved; a poll returns them before the ring, and
//!   arming a CQ whose backlog is not empty raises the completion event
//!   from software (the DPC). The arming is remembered until the event, so
//!   D0 entry can arm again.

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec::Vec;

use driver_platform::dma::dma_wmb;
use driver_platform::{CommonBuffer, DmaAdapter, Mmio, Platform, Request, RequestorMode, SpinLock};
use hca_prm::cmd::{CmdStatus, MAX_MTT_PER_WRITE, Opcode};
use hca_prm::cqe::Cqe;
use hca_prm::ctx::{BufDesc, CQE_LOG_STRIDE, Cqc, ResizeCq as ResizeCqInput};
use hca_prm::doorbell::{CQ_DOORBELL, CqArm, CqDoorbell, DoorbellRecord, uar_offset};
use hca_prm::{Le32, Le64, owner};
use ib_types::ioctl::{CqOut, CreateCq, DestroyCq, QueryCq, ResizeCq};
use ib_types::status::IbStatus;
use ib_types::wc::{WcStatus, WorkCompletion};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

pub use ib_types::cq::CqNotify;

use super::qp::{Qp, resolve_completion};
use super::srq::Srq;
use super::{Accepted, Buffer, Objects};
use crate::cmd::{Command, CommandError};
use crate::hca::Hca;
use crate::resources::{EntryRange, Handle, KERNEL_UAR, kind};
use crate::ring::read_owned_entry;

/// `log2` of the host page the core describes rings with (PRM 5.3).
pub(super) const LOG_PAGE: u8 = 12;
/// Bytes of a host page.
pub(super) const PAGE: usize = 1 << LOG_PAGE;
/// Bytes of a CQE.
const CQE_BYTES: usize = 1 << CQE_LOG_STRIDE;

/// Where a CQE's owner byte lies (PRM 10.4: 0x1F, written last).
const CQE_OWNER_AT: usize = core::mem::offset_of!(Cqe, owner);

/// Where a CQ is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Life {
    /// Memory and commands under way; the client has no handle yet.
    Creating,
    /// Usable.
    Live,
    /// `RESIZE_CQ` outstanding: polls return nothing, arming is refused.
    Resizing,
    /// `HW2SW_CQ` outstanding.
    Destroying,
}

/// A destroyed QP whose CQEs still wait in a CQ's ring (guide 6.5.4 note,
/// 6.5.5 items 3 and 9): what resolves their `wr_id`s after the QP's number
/// has a new owner (`qp::resolve_completion`).
pub(crate) struct RetiredQp<P: Platform> {
    /// The destroyed QP (its rings freed, its `wr_id` shadows kept).
    pub(crate) qp: Arc<Qp<P>>,
    /// The SRQ it received from: its receive CQEs free that SRQ's slots
    /// even after the SRQ is destroyed and its number reused.
    pub(crate) srq: Option<Arc<Srq<P>>>,
    /// The sequence number ([`Ring::polled`]) just past its last CQE in
    /// this CQ: every CQE naming its number polled before it is its.
    pub(crate) end: u64,
}

/// A CQ's ring and consumer state, under the CQ's own lock.
pub(super) struct Ring<P: Platform> {
    pub(super) life: Life,
    pub(super) ring: Option<Buffer<P>>,
    pub(super) dbr: Option<Buffer<P>>,
    pub(super) log_entries: u8,
    pub(super) consumer: u32,
    /// CQEs polled over the CQ's life (a resize restarts `consumer`, not
    /// this): the sequence number of the next CQE polled, by which a QP
    /// reset tells its earlier completions from later ones (`qp`).
    pub(super) polled: u64,
    pub(super) mtt: Option<EntryRange>,
    /// Completions the device can no longer deliver through the ring, in
    /// order, `wr_id`s resolved: the entries outstanding at a D0 exit and
    /// software flushes ([`super::restore`], [`super::fatal`]). Polled
    /// before the ring.
    pub(super) backlog: alloc::collections::VecDeque<WorkCompletion>,
    /// How the client last armed the CQ, until its completion event.
    pub(super) armed: Option<CqNotify>,
    /// The CQEs kernel QPs may have outstanding here (`Room`).
    pub(super) room: Room,
    /// The size (`log2`) a resize under way moves to: until it ends, a
    /// QP's work queues must fit both rings.
    pub(super) resizing_to: Option<u8>,
    /// Destroyed QPs with CQEs still in the ring, in destroy order; each
    /// dropped once the poll passed its `end`.
    pub(super) retired: Vec<RetiredQp<P>>,
}

/// How many CQEs the work queues of the kernel QPs using a CQ can have
/// outstanding at once (guide 8.2.3 item 1: CQ overflow is prevented, not
/// recovered): a send queue's and a receive queue's depth each (every WR
/// completes, flushed ones included), an SRQ's depth once however many of
/// its QPs complete here (each of its WQEs completes once). A QP whose
/// queues would take the total past the CQ's entries is refused, and so
/// is a resize below it.
#[derive(Debug, Default)]
pub(super) struct Room {
    total: u32,
    /// Per QP number: its own WQs' depth here, and its SRQ's raw handle if
    /// its receives complete here.
    qps: alloc::collections::BTreeMap<u32, (u32, Option<u64>)>,
    /// Per SRQ (raw handle) completing here: its depth and the QPs sharing it.
    srqs: alloc::collections::BTreeMap<u64, (u32, u32)>,
}

/// The CQEs a new QP may add to one CQ ([`Hca::commit_cq_room`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Demand {
    /// WRs of its own queues completing here.
    pub(super) wrs: u32,
    /// Its SRQ (raw handle, depth), if its receives complete here.
    pub(super) srq: Option<(u64, u32)>,
}

impl Room {
    /// Records `demand` for QP `qpn` if it fits `capacity` entries.
    fn commit(&mut self, qpn: u32, demand: Demand, capacity: u32) -> Result<(), IbStatus> {
        let mut added = demand.wrs;
        if let Some((srq, depth)) = demand.srq
            && !self.srqs.contains_key(&srq)
        {
            added = added.saturating_add(depth);
        }
        let total = self.total.saturating_add(added);
        if total > capacity {
            return Err(IbStatus::InsufficientResources);
        }
        let mine = self.qps.entry(qpn).or_default();
        mine.0 += demand.wrs;
        if let Some((srq, depth)) = demand.srq {
            mine.1 = Some(srq);
            self.srqs.entry(srq).or_insert((depth, 0)).1 += 1;
        }
        self.total = total;
        Ok(())
    }

    /// Forgets what QP `qpn` committed (nothing if it committed nothing).
    fn release(&mut self, qpn: u32) {
        let Some((wrs, srq)) = self.qps.remove(&qpn) else {
            return;
        };
        self.total -= wrs;
        if let Some(srq) = srq
            && let Some(share) = self.srqs.get_mut(&srq)
        {
            share.1 -= 1;
            if share.1 == 0 {
                self.total -= share.0;
                self.srqs.remove(&srq);
            }
        }
    }
}

/// A completion queue.
pub struct Cq<P: Platform> {
    pub(super) cqn: u32,
    pub(super) ring: SpinLock<P, Ring<P>>,
}

impl<P: Platform> core::fmt::Debug for Cq<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Cq")
            .field("cqn", &self.cqn)
            .finish_non_exhaustive()
    }
}

impl<P: Platform> Cq<P> {
    pub(super) fn new(cqn: u32, log_entries: u8, mtt: EntryRange) -> Self {
        Self {
            cqn,
            ring: SpinLock::<P, _>::new(Ring {
                life: Life::Creating,
                ring: None,
                dbr: None,
                log_entries,
                consumer: 0,
                polled: 0,
                mtt: Some(mtt),
                backlog: alloc::collections::VecDeque::new(),
                armed: None,
                room: Room::default(),
                resizing_to: None,
                retired: Vec::new(),
            }),
        }
    }

    /// Takes the CQ's common buffers (for freeing once the device no longer
    /// uses them).
    pub(crate) fn take_buffers(&self) -> Vec<Buffer<P>> {
        let mut ring = self.ring.lock();
        [ring.ring.take(), ring.dbr.take()]
            .into_iter()
            .flatten()
            .collect()
    }

    pub(super) fn set_life(&self, life: Life) {
        self.ring.lock().life = life;
    }

    /// Marks a live CQ resizing (a user CQ's resize, `verbs::user`);
    /// busy otherwise.
    pub(super) fn begin_resize(&self) -> Result<(), IbStatus> {
        let mut ring = self.ring.lock();
        if ring.life != Life::Live {
            return Err(IbStatus::ResourceBusy);
        }
        ring.life = Life::Resizing;
        ring.resizing_to = None;
        Ok(())
    }

    /// The device switched to a ring of `2^log` CQEs described by `mtt`
    /// (in user memory): the CQ is live again; returns the old ring's MTT
    /// entries.
    pub(super) fn switch_ring(&self, log: u8, mtt: EntryRange) -> Option<EntryRange> {
        let mut ring = self.ring.lock();
        ring.log_entries = log;
        ring.consumer = 0;
        ring.life = Life::Live;
        ring.mtt.replace(mtt)
    }

    /// The CQ number.
    pub(super) fn number(&self) -> u32 {
        self.cqn
    }
}

/// How many valid CQEs wait in `ring` from its consumer counter on,
/// calling `each` with every one in ring order.
fn waiting_cqes<P: Platform>(ring: &Ring<P>, mut each: impl FnMut(&Cqe)) -> u32 {
    let log = ring.log_entries;
    let mut waiting = 0u32;
    if let Some(buffer) = ring.ring.as_ref() {
        while waiting < (1u32 << log) {
            let consumer = ring.consumer.wrapping_add(waiting);
            let slot = hca_prm::owner::slot(consumer, log) as usize;
            let mut raw = [0u8; CQE_BYTES];
            if !read_owned_entry(buffer, slot * CQE_BYTES, CQE_OWNER_AT, &mut raw, |b| {
                owner::is_valid(b, consumer, log)
            }) {
                break;
            }
            match Cqe::read_from_bytes(&raw) {
                Ok(cqe) if cqe.is_valid(consumer, log) => {
                    each(&cqe);
                    waiting += 1;
                }
                _ => break,
            }
        }
    }
    waiting
}

/// The sequence number just past the last CQE of QP `qpn` waiting in
/// `ring`, if one waits.
fn last_cqe_of<P: Platform>(ring: &Ring<P>, qpn: u32) -> Option<u64> {
    let mut at = 0u64;
    let mut last = None;
    waiting_cqes(ring, |cqe| {
        at += 1;
        if cqe.qpn.get() & 0x00FF_FFFF == qpn {
            last = Some(ring.polled + at);
        }
    });
    last
}

/// Entries and `log2` for a requested depth, within the device's limit.
fn ring_size(cqe: u32, log_max_cqes: u8) -> Result<(u32, u8), IbStatus> {
    let entries = cqe
        .max(1)
        .checked_next_power_of_two()
        .ok_or(IbStatus::InvalidCqSize)?;
    let log = entries.trailing_zeros() as u8;
    if log > log_max_cqes {
        return Err(IbStatus::InvalidCqSize);
    }
    Ok((entries, log))
}

/// Pages of a ring of `2^log` CQEs.
pub(super) fn ring_pages(log: u8) -> usize {
    (CQE_BYTES << log).div_ceil(PAGE)
}

/// `WRITE_MTT` commands describing `pages` pages of a contiguous buffer at
/// `bus` in MTT entries from `first` (PRM 5.1, 6.0).
pub(super) fn write_mtt(first: u32, bus: u64, pages: usize) -> Vec<Command> {
    let addresses: Vec<u64> = (0..pages as u64).map(|i| bus + i * PAGE as u64).collect();
    addresses
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

/// The ring's buffer descriptor (PRM 6.0).
pub(super) fn buf_desc(mtt: EntryRange, log_entries: u8) -> BufDesc {
    BufDesc {
        mtt_index: Le32::new(mtt.start()),
        page_offset: Le32::new(0),
        log_page_size: LOG_PAGE,
        log_entries,
        log_stride: CQE_LOG_STRIDE,
        ..BufDesc::default()
    }
}

/// A page-rounded, page-aligned common buffer, at PASSIVE_LEVEL.
pub(super) fn alloc_pages<P: Platform>(hca: &Hca<P>, pages: usize) -> Result<Buffer<P>, IbStatus> {
    let buffer = hca
        .dma
        .alloc_common(pages.max(1) * PAGE)
        .map_err(|_| IbStatus::InsufficientMemory)?;
    if !buffer.bus_address().is_multiple_of(PAGE as u64) {
        hca.free_later([buffer]);
        return Err(IbStatus::InsufficientMemory);
    }
    Ok(buffer)
}

impl<P: Platform> Hca<P> {
    /// The live CQ behind a raw handle, for a request of `mode`.
    fn find_cq(&self, raw: u64, mode: RequestorMode) -> Result<Arc<Cq<P>>, IbStatus> {
        self.find_object::<kind::Cq>(raw, mode)
    }

    /// Records that a QP (or SRQ) uses the CQ `cq`; destroy is refused
    /// while uses are outstanding. Fails with [`IbStatus::InvalidCqHandle`]
    /// for a stale handle and [`IbStatus::InvalidState`] for a CQ being
    /// resized or destroyed.
    pub fn reference_cq(&self, cq: u64) -> Result<u32, IbStatus> {
        self.reference_object::<kind::Cq>(cq)
    }

    /// Drops a use recorded by [`reference_cq`](Self::reference_cq).
    pub fn release_cq(&self, cq: u64) -> Result<u32, IbStatus> {
        self.release_object::<kind::Cq>(cq)
    }

    /// Records that kernel QP `qpn` may have `send` CQEs outstanding on
    /// `send_cq` and `recv` on `recv_cq` (the same CQ or two), if they fit
    /// (`Room`); else [`IbStatus::InsufficientResources`] and nothing
    /// recorded. A CQ under resize must hold them in its smaller ring.
    pub(super) fn commit_cq_room(
        &self,
        qpn: u32,
        (send_cq, send): (u64, Demand),
        (recv_cq, recv): (u64, Demand),
    ) -> Result<(), IbStatus> {
        let commit = |raw: u64, demand: Demand| -> Result<(), IbStatus> {
            let cq = self.find_cq(raw, RequestorMode::Kernel)?;
            let mut ring = cq.ring.lock();
            let log = match (ring.life, ring.resizing_to) {
                (Life::Resizing, Some(to)) => ring.log_entries.min(to),
                _ => ring.log_entries,
            };
            ring.room.commit(qpn, demand, 1 << log)
        };
        commit(send_cq, send)?;
        if let Err(status) = commit(recv_cq, recv) {
            self.release_cq_room(qpn, send_cq, send_cq);
            return Err(status);
        }
        Ok(())
    }

    /// Forgets what [`commit_cq_room`](Self::commit_cq_room) recorded for
    /// QP `qpn` on its CQs (nothing for a QP that committed nothing).
    pub(super) fn release_cq_room(&self, qpn: u32, send_cq: u64, recv_cq: u64) {
        for raw in [send_cq, recv_cq] {
            if let Ok(cq) = self.find_cq(raw, RequestorMode::Kernel) {
                cq.ring.lock().room.release(qpn);
            }
        }
    }

    /// Polls up to `wcs.len()` completions of the CQ `cq` (a kernel
    /// client's handle) into `wcs` and returns how many. Callable at
    /// DISPATCH_LEVEL; never blocks. A CQ whose resize is outstanding polls
    /// empty. Callable on several processors at once for one CQ (as
    /// `ibv_poll_cq`): each completion goes to one caller, with its own
    /// `wr_id`.
    pub fn poll_cq(&self, cq: u64, wcs: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
        // The tables shared for the whole poll, then the CQ's lock (the
        // crate's lock order): the `wr_id`s are resolved under both, so
        // polls of one CQ take turns and retire each QP ring in ring order.
        // Post takes the tables shared too and never a CQ's lock.
        self.with_objects(|o| {
            if !Self::ca_visible(o, RequestorMode::Kernel) {
                return Err(IbStatus::InvalidCqHandle);
            }
            let handle = cq;
            let cq = o
                .cqs
                .get(Handle::<kind::Cq>::from_raw(handle))
                .ok_or(IbStatus::InvalidCqHandle)?;
            Ok(Self::poll_locked(o, handle, cq, wcs))
        })?
    }

    /// [`poll_cq`](Self::poll_cq) of `cq` (its raw handle `handle`) with
    /// the tables held (`o`).
    fn poll_locked(o: &Objects<P>, handle: u64, cq: &Cq<P>, wcs: &mut [WorkCompletion]) -> usize {
        let mut ring = cq.ring.lock();
        if !matches!(ring.life, Life::Live | Life::Destroying) {
            return 0;
        }
        // One completion asked and no software completion waiting: the
        // common call, without the batch's loop and backlog.
        if let [wc] = wcs
            && ring.backlog.is_empty()
        {
            let consumer = ring.consumer;
            if !Self::next_completion(o, handle, &ring, consumer, ring.polled, wc) {
                return 0;
            }
            Self::consumed(&mut ring, consumer.wrapping_add(1), 1);
            return 1;
        }
        Self::poll_batch(o, handle, &mut ring, wcs)
    }

    /// [`poll_locked`](Self::poll_locked) of more than one completion, or
    /// with software completions waiting: the backlog first, then the
    /// ring's CQEs in order. Out of line, so the one-CQE call keeps its
    /// own frame and its decode inline.
    #[inline(never)]
    fn poll_batch(
        o: &Objects<P>,
        handle: u64,
        ring: &mut Ring<P>,
        wcs: &mut [WorkCompletion],
    ) -> usize {
        let mut consumer = ring.consumer;
        let mut polled = 0;
        // Software completions first: they precede whatever the device
        // wrote since (restore.rs, fatal.rs); their `wr_id`s were resolved
        // when they were taken off the ring.
        while polled < wcs.len() && !ring.backlog.is_empty() {
            let Some(wc) = ring.backlog.pop_front() else {
                break;
            };
            wcs[polled] = wc;
            polled += 1;
        }
        let from_backlog = polled;
        let first_seq = ring.polled;
        for wc in &mut wcs[from_backlog..] {
            let seq = first_seq + (polled - from_backlog) as u64;
            if !Self::next_completion(o, handle, ring, consumer, seq, wc) {
                break;
            }
            consumer = consumer.wrapping_add(1);
            polled += 1;
        }
        if polled > from_backlog {
            Self::consumed(ring, consumer, (polled - from_backlog) as u64);
        }
        polled
    }

    /// The CQE at `consumer` in the CQ's ring, if the device wrote it,
    /// into `out` as a completion with its `wr_id` resolved (polled with
    /// sequence number `seq`; `handle` is the CQ's raw handle, `o` the
    /// tables held): true; false when the device has not written it.
    #[inline(never)]
    fn next_completion(
        o: &Objects<P>,
        handle: u64,
        ring: &Ring<P>,
        consumer: u32,
        seq: u64,
        out: &mut WorkCompletion,
    ) -> bool {
        let Some(buffer) = ring.ring.as_ref() else {
            return false;
        };
        let log = ring.log_entries;
        let slot = hca_prm::owner::slot(consumer, log) as usize;
        // Read straight into the CQE (no byte array copied into it).
        let mut cqe = Cqe::new_zeroed();
        if !read_owned_entry(
            buffer,
            slot * CQE_BYTES,
            CQE_OWNER_AT,
            cqe.as_mut_bytes(),
            |b| owner::is_valid(b, consumer, log),
        ) {
            return false;
        }
        if !cqe.is_valid(consumer, log) {
            return false;
        }
        // The device stores no wr_id (PRM 10.4): until the QP supplies it
        // below, `wr_id` carries the WQE index and direction.
        // Bit 16: a receive; bit 17: taken from an SRQ (PRM 10.4).
        let flags = cqe.flags();
        let recv = flags.contains(hca_prm::cqe::CqeFlags::RECV);
        let srq = recv && flags.contains(hca_prm::cqe::CqeFlags::SRQ);
        let key = u64::from(cqe.wqe_index()) | (u64::from(recv) << 16) | (u64::from(srq) << 17);
        // The stand-in for a CQE that does not decode is built only then
        // (`unwrap_or` would build it for every CQE). Stored at once, then
        // its `wr_id` resolved from three of its values (none of the rest
        // kept in registers across the lookup).
        let wc = cqe
            .to_work_completion(key)
            .unwrap_or_else(|_| WorkCompletion {
                wr_id: key,
                qp_num: ib_types::scalars::Qpn::from_low_bits(cqe.qpn.get()),
                status: WcStatus::GeneralErr,
                ..WorkCompletion::EMPTY
            });
        *out = wc;
        let completion = (wc.qp_num.get(), key, wc.status);
        out.wr_id = resolve_completion(o, handle, &ring.retired, completion, seq);
        true
    }

    /// After a poll took `count` CQEs off the ring (the consumer now
    /// `consumer`): the counters, one consumer-record update (PRM 9.2),
    /// and the destroyed QPs whose last CQE is now polled forgotten.
    #[inline(always)]
    fn consumed(ring: &mut Ring<P>, consumer: u32, count: u64) {
        ring.consumer = consumer;
        let next = ring.polled + count;
        ring.polled = next;
        // `retain` keeps the vector's memory: no allocation here. Before
        // the record's write, so nothing of the ring is live across it.
        if !ring.retired.is_empty() {
            ring.retired.retain(|r| r.end > next);
        }
        // After the CQEs were read: the device may reuse their slots once
        // it sees the record.
        if let Some(dbr) = ring.dbr.as_ref() {
            dma_wmb();
            dbr.write(0, DoorbellRecord::new(consumer).as_bytes());
        }
    }

    /// Records, in each CQ of the destroyed QP `qp`, where its CQEs end
    /// ([`RetiredQp`]), so they keep resolving against it after its number
    /// is reused. Called when its `HW2SW_QP` completes, before the number
    /// is freed: the device wrote every CQE of the QP before answering.
    /// A CQ with none of its CQEs waiting keeps nothing, and so does a
    /// user QP's (its rings and `wr_id`s are its provider's; the CQ poll
    /// path leaves a CQE no live QP of that CQ can own alone).
    pub(super) fn retire_qp_in_cqs(&self, qp: &Arc<Qp<P>>) {
        if qp.sq.lock().ring.is_none() {
            return;
        }
        let cqs = if qp.send_cq == qp.recv_cq {
            [Some(qp.send_cq), None]
        } else {
            [Some(qp.send_cq), Some(qp.recv_cq)]
        };
        let _ = self.with_objects(|o| {
            let srq = qp
                .srq
                .and_then(|raw| o.srqs.get(Handle::<kind::Srq>::from_raw(raw)).cloned());
            for raw in cqs.into_iter().flatten() {
                let Some(cq) = o.cqs.get(Handle::<kind::Cq>::from_raw(raw)) else {
                    continue;
                };
                let mut ring = cq.ring.lock();
                let Some(end) = last_cqe_of(&ring, qp.qpn) else {
                    continue;
                };
                ring.retired.push(RetiredQp {
                    qp: qp.clone(),
                    srq: srq.clone(),
                    end,
                });
            }
        });
    }

    /// The destroyed QPs every CQ keeps for their unpolled CQEs (for the
    /// failure path, `verbs::fatal`).
    pub(crate) fn retired_qps(&self) -> Vec<Arc<Qp<P>>> {
        self.with_objects(|o| {
            o.cqs
                .iter()
                .flat_map(|(_, cq)| {
                    let ring = cq.ring.lock();
                    ring.retired
                        .iter()
                        .map(|r| r.qp.clone())
                        .collect::<Vec<_>>()
                })
                .collect()
        })
        .unwrap_or_default()
    }

    /// The sequence number (`Ring::polled`) the next CQE the device
    /// writes to CQ `cq` (a raw handle) will be polled with: the CQEs
    /// polled so far plus those waiting from the consumer counter on. A
    /// QP moved to RESET takes it for its send and receive CQs, so that
    /// its completions polled with a smaller number are known as the ones
    /// written before the reset (guide 6.5.5 item 3). 0 for a stale
    /// handle. Limitation: a CQ whose resize is outstanding is counted in
    /// its old ring.
    pub(crate) fn cq_next_sequence(&self, cq: u64) -> u64 {
        let Ok(cq) = self.find_cq(cq, RequestorMode::Kernel) else {
            return 0;
        };
        let ring = cq.ring.lock();
        ring.polled + u64::from(waiting_cqes(&ring, |_| ()))
    }

    /// Arms the CQ `cq` for one completion event (PRM 9.3): the next
    /// completion, or the next solicited one. Fails with
    /// [`IbStatus::InvalidState`] while the CQ is being resized or
    /// destroyed. Callable at DISPATCH_LEVEL.
    pub fn arm_cq(&self, cq: u64, notify: CqNotify) -> Result<(), IbStatus> {
        self.check_running()?;
        let handle = cq;
        let cq = self.find_cq(cq, RequestorMode::Kernel)?;
        let mut ring = cq.ring.lock();
        if ring.life != Life::Live {
            return Err(IbStatus::InvalidState);
        }
        if !ring.backlog.is_empty() {
            // The device does not know of these completions: the event
            // comes from software, from the DPC.
            ring.armed = None;
            drop(ring);
            self.queue_soft_completion(handle);
            return Ok(());
        }
        ring.armed = Some(notify);
        let cmd = match notify {
            CqNotify::Solicited => CqArm::Solicited,
            CqNotify::NextCompletion => CqArm::Next,
        };
        let doorbell =
            CqDoorbell::new(cq.cqn, cmd, ring.consumer).map_err(|_| IbStatus::InvalidCqHandle)?;
        // Under the CQ lock, so the consumer counter carried is current.
        self.bar0
            .write64(uar_offset(KERNEL_UAR) + CQ_DOORBELL, doorbell.encode());
        Ok(())
    }

    /// Removes a CQ whose creation failed, giving back its number and MTT
    /// entries.
    pub(super) fn forget_cq(&self, handle: Handle<kind::Cq>, mtt: EntryRange) {
        let _ = self.with_objects_mut(|o| {
            let _ = o.cqs.remove(handle);
            let _ = o.mtt.return_entries(mtt);
        });
    }

    pub(crate) fn query_cq_request<R: Request>(&self, a: Accepted<QueryCq, R>) {
        match self.find_cq(a.handle, a.mode) {
            Ok(cq) => {
                let ring = cq.ring.lock();
                let out = CqOut {
                    cqe: 1 << ring.log_entries,
                };
                drop(ring);
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
    pub(crate) fn create_cq_request(self: &Arc<Self>, a: Accepted<CreateCq, P::Request>) {
        if let Err(status) = self.check_ca(a.handle, a.mode) {
            a.responder.fail(status);
            return;
        }
        if a.mode == RequestorMode::User {
            a.responder.fail(IbStatus::Unsupported);
            return;
        }
        if a.input.comp_vector != 0 {
            a.responder.fail(IbStatus::InvalidParameter);
            return;
        }
        let cqe = a.input.cqe;
        let reserved = self.with_objects_mut(|o| {
            let (entries, log) = ring_size(cqe, o.log_max_cqes)?;
            let mtt = o
                .mtt
                .take_entries(ring_pages(log) as u32)
                .map_err(IbStatus::from)?;
            match o
                .cqs
                .insert_with(|h| Arc::new(Cq::<P>::new(h.number(), log, mtt)))
            {
                Ok(handle) => {
                    let cq = o.cqs.get(handle).cloned();
                    Ok((handle, cq, entries, log, mtt, o.eqn))
                }
                Err(error) => {
                    let _ = o.mtt.return_entries(mtt);
                    Err(IbStatus::from(error))
                }
            }
        });
        let (handle, cq, entries, log, mtt, eqn) = match reserved.and_then(|r| r) {
            Ok((handle, Some(cq), entries, log, mtt, eqn)) => (handle, cq, entries, log, mtt, eqn),
            Ok((handle, None, _, _, mtt, _)) => {
                self.forget_cq(handle, mtt);
                a.responder.fail(IbStatus::GenericError);
                return;
            }
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        };
        let responder = a.responder;
        self.queue_passive(Box::new(move |hca| {
            // Stopped (every object dropped: the undo finds nothing) or
            // below D0 (the objects stay: give the reservation back).
            if hca.report().is_none() {
                hca.forget_cq(handle, mtt);
                responder.fail(IbStatus::InvalidState);
                return;
            }
            let pages = ring_pages(log);
            let buffers = alloc_pages(hca, pages).and_then(|ring| match alloc_pages(hca, 1) {
                Ok(dbr) => Ok((ring, dbr)),
                Err(status) => {
                    hca.free_later([ring]);
                    Err(status)
                }
            });
            let (ring, dbr) = match buffers {
                Ok(buffers) => buffers,
                Err(status) => {
                    hca.forget_cq(handle, mtt);
                    responder.fail(status);
                    return;
                }
            };
            let cqc = Cqc {
                eqn: Le32::new(eqn),
                uar_index: Le32::new(KERNEL_UAR),
                ring: buf_desc(mtt, log),
                ci_dbr: Le64::new(dbr.bus_address()),
                ..Cqc::default()
            };
            let mut commands = write_mtt(mtt.start(), ring.bus_address(), pages);
            commands
                .push(Command::new(Opcode::Sw2HwCq, cq.cqn).with_mailbox(cqc.as_bytes().to_vec()));
            {
                let mut state = cq.ring.lock();
                state.ring = Some(ring);
                state.dbr = Some(dbr);
            }
            hca.run_commands(
                commands,
                Box::new(move |hca, result| match result {
                    Ok(_) => {
                        cq.set_life(Life::Live);
                        let out = CqOut { cqe: entries };
                        responder.finish(IbStatus::Success, handle.raw(), Some(&out), &[]);
                    }
                    Err(error) => {
                        hca.free_later(cq.take_buffers());
                        hca.forget_cq(handle, mtt);
                        responder.fail(error.ib_status());
                    }
                }),
            );
        }));
    }

    pub(crate) fn resize_cq_request(self: &Arc<Self>, a: Accepted<ResizeCq, P::Request>) {
        let cq = match self.find_cq(a.handle, a.mode) {
            Ok(cq) => cq,
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        };
        let cqe = a.input.cqe;
        let started = self.with_objects(|o| {
            let (entries, log) = ring_size(cqe, o.log_max_cqes)?;
            let mut ring = cq.ring.lock();
            if ring.life != Life::Live {
                return Err(IbStatus::ResourceBusy);
            }
            // A live CQ without a kernel ring is a user CQ: its ring is the
            // provider's and only its own (user) resize may move it.
            if ring.ring.is_none() {
                return Err(IbStatus::InvalidCqHandle);
            }
            if ring.log_entries == log {
                return Ok((entries, log, None));
            }
            // Guide 8.2.3 item 1: never smaller than the QPs' work queues.
            if ring.room.total > entries {
                return Err(IbStatus::InvalidCqSize);
            }
            let mtt = o
                .mtt
                .take_entries(ring_pages(log) as u32)
                .map_err(IbStatus::from)?;
            ring.life = Life::Resizing;
            ring.resizing_to = Some(log);
            Ok((entries, log, Some(mtt)))
        });
        let (entries, log, mtt) = match started.and_then(|r| r) {
            Ok(started) => started,
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        };
        let responder = a.responder;
        let Some(mtt) = mtt else {
            responder.finish(IbStatus::Success, 0, Some(&CqOut { cqe: entries }), &[]);
            return;
        };
        self.queue_passive(Box::new(move |hca| {
            if hca.report().is_none() {
                // Below D0 the CQ stays: back to its old ring.
                let _ = hca.with_objects(|o| o.mtt.return_entries(mtt));
                cq.set_life(Life::Live);
                responder.fail(IbStatus::InvalidState);
                return;
            }
            let pages = ring_pages(log);
            let ring = match alloc_pages(hca, pages) {
                Ok(ring) => ring,
                Err(status) => {
                    let _ = hca.with_objects(|o| o.mtt.return_entries(mtt));
                    cq.set_life(Life::Live);
                    responder.fail(status);
                    return;
                }
            };
            let input = ResizeCqInput {
                ring: buf_desc(mtt, log),
                ..ResizeCqInput::default()
            };
            let mut commands = write_mtt(mtt.start(), ring.bus_address(), pages);
            commands.push(
                Command::new(Opcode::ResizeCq, cq.cqn).with_mailbox(input.as_bytes().to_vec()),
            );
            let new_ring = Some(ring);
            hca.run_commands(
                commands,
                Box::new(move |hca, result| {
                    match result {
                        Ok(_) => {
                            let (old_ring, old_mtt) = {
                                let mut state = cq.ring.lock();
                                let old = core::mem::replace(&mut state.ring, new_ring);
                                let old_mtt = state.mtt.replace(mtt);
                                state.log_entries = log;
                                // The device reset the record to 0 (PRM 6.2).
                                state.consumer = 0;
                                state.life = Life::Live;
                                (old, old_mtt)
                            };
                            hca.free_later(old_ring);
                            if let Some(old_mtt) = old_mtt {
                                let _ = hca.with_objects(|o| o.mtt.return_entries(old_mtt));
                            }
                            let out = CqOut { cqe: entries };
                            responder.finish(IbStatus::Success, 0, Some(&out), &[]);
                        }
                        Err(error) => {
                            hca.free_later(new_ring);
                            let _ = hca.with_objects(|o| o.mtt.return_entries(mtt));
                            cq.set_life(Life::Live);
                            responder.fail(resize_status(error));
                        }
                    }
                }),
            );
        }));
    }

    pub(crate) fn destroy_cq_request(self: &Arc<Self>, a: Accepted<DestroyCq, P::Request>) {
        let responder = a.responder;
        self.destroy_cq_then(a.handle, a.mode, responder.into_done());
    }

    /// Destroys the CQ `raw` (see the module doc), then calls `done`
    /// (inline when refused, else from the DPC).
    pub(super) fn destroy_cq_then(
        self: &Arc<Self>,
        raw: u64,
        mode: RequestorMode,
        done: super::Done<P>,
    ) {
        let handle = Handle::<kind::Cq>::from_raw(raw);
        let found = self.with_objects(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(IbStatus::InvalidCqHandle);
            }
            let cq = o
                .cqs
                .get(handle)
                .cloned()
                .ok_or(IbStatus::InvalidCqHandle)?;
            if o.cqs.use_count(handle) != Some(0) {
                return Err(IbStatus::ResourceBusy);
            }
            let mut ring = cq.ring.lock();
            if ring.life != Life::Live {
                return Err(IbStatus::ResourceBusy);
            }
            ring.life = Life::Destroying;
            drop(ring);
            Ok(cq)
        });
        let cq = match found.and_then(|r| r) {
            Ok(cq) => cq,
            Err(status) => return done(self, Err(status)),
        };
        self.run_commands(
            alloc::vec![Command::new(Opcode::Hw2SwCq, cq.cqn)],
            Box::new(
                move |hca, result| match hca.forgive_destroy(handle.raw(), result) {
                    Ok(_) => {
                        // Only now is the number free: every event of this CQ
                        // came before this completion on the one EQ.
                        let mtt = cq.ring.lock().mtt.take();
                        let _ = hca.with_objects_mut(|o| {
                            let _ = o.cqs.remove(handle);
                            if let Some(mtt) = mtt {
                                let _ = o.mtt.return_entries(mtt);
                            }
                        });
                        hca.free_later(cq.take_buffers());
                        done(hca, Ok(()));
                    }
                    Err(error) => {
                        cq.set_life(Life::Live);
                        done(hca, Err(error.ib_status()));
                    }
                },
            ),
        );
    }
}

/// The status of a failed resize: `EXCEED_LIMIT` means the outstanding
/// entries do not fit the new size (PRM 6.2).
pub(super) fn resize_status(error: CommandError) -> IbStatus {
    match error.prm_status() {
        Some(CmdStatus::ExceedLimit) => IbStatus::InvalidCqSize,
        _ => error.ib_status(),
    }
}

/// The guide's 8.3 poll/re-arm algorithm: polls `cq` until it is empty,
/// handing each batch to `process`; then arms it (`notify`) and polls
/// again, re-arming after every batch found, until a poll after the last
/// arm finds nothing. Completions that arrive while it runs are either
/// polled here or raise a completion event (PRM 9.3 fires at once for
/// CQEs beyond the consumer counter armed with). Returns the completions
/// processed.
pub fn poll_and_rearm<P: Platform>(
    hca: &Hca<P>,
    cq: u64,
    notify: CqNotify,
    wcs: &mut [WorkCompletion],
    process: impl FnMut(&[WorkCompletion]),
) -> Result<usize, IbStatus> {
    rearm_loop(
        |wcs| hca.poll_cq(cq, wcs),
        || hca.arm_cq(cq, notify),
        wcs,
        process,
    )
}

/// The 8.3 loop of [`poll_and_rearm`] over any `poll` and `arm` (the loom
/// model drives it against a model of the device's arming, PRM 9.3).
fn rearm_loop<E>(
    mut poll: impl FnMut(&mut [WorkCompletion]) -> Result<usize, E>,
    mut arm: impl FnMut() -> Result<(), E>,
    wcs: &mut [WorkCompletion],
    mut process: impl FnMut(&[WorkCompletion]),
) -> Result<usize, E> {
    let mut rearm_needed = true;
    let mut total = 0;
    loop {
        let polled = poll(wcs)?;
        if !rearm_needed && polled == 0 {
            return Ok(total);
        }
        process(&wcs[..polled]);
        total += polled;
        arm()?;
        rearm_needed = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::CommandInput;

    #[test]
    fn ring_sizes_round_up_to_a_power_of_two_within_the_device_limit() {
        assert_eq!(ring_size(1, 16), Ok((1, 0)));
        assert_eq!(ring_size(100, 16), Ok((128, 7)));
        assert_eq!(ring_size(128, 16), Ok((128, 7)));
        assert_eq!(ring_size(1 << 16, 16), Ok((1 << 16, 16)));
        assert_eq!(ring_size((1 << 16) + 1, 16), Err(IbStatus::InvalidCqSize));
        assert_eq!(ring_size(u32::MAX, 31), Err(IbStatus::InvalidCqSize));
        // A ring smaller than a page still takes one page.
        assert_eq!(ring_pages(0), 1);
        assert_eq!(ring_pages(7), 1);
        assert_eq!(ring_pages(10), 8);
    }

    #[test]
    fn mtt_writes_split_at_the_mailbox_limit() {
        let commands = write_mtt(40, 0x10_0000, MAX_MTT_PER_WRITE + 3);
        assert_eq!(commands.len(), 2);
        let mailbox = |c: &Command| match &c.input {
            CommandInput::Mailbox(bytes) => bytes.clone(),
            other => panic!("{other:?}"),
        };
        let first = mailbox(&commands[0]);
        assert_eq!(first.len(), 8 + 8 * MAX_MTT_PER_WRITE);
        assert_eq!(first[..8], 40u64.to_le_bytes());
        assert_eq!(first[8..16], 0x10_0000u64.to_le_bytes());
        let second = mailbox(&commands[1]);
        assert_eq!(second.len(), 8 + 8 * 3);
        let start = 40 + MAX_MTT_PER_WRITE as u64;
        assert_eq!(second[..8], start.to_le_bytes());
        let page = 0x10_0000 + (MAX_MTT_PER_WRITE as u64) * PAGE as u64;
        assert_eq!(second[8..16], page.to_le_bytes());
        assert!(write_mtt(0, 0, 0).is_empty());
    }
}

#[cfg(all(test, loom))]
mod loom_arm {
    use super::*;
    use crate::sync::{AtomicBool, AtomicU32, Ordering};
    use loom::sync::{Arc, Mutex};

    /// The device's side of one CQ as PRM 9.3 and 10.4 describe it: CQE
    /// slots with their valid (owner) bit, the producer counter and the
    /// arming, which the device keeps under its own serialisation.
    struct ModelCq {
        valid: [AtomicBool; 2],
        device: Mutex<Device>,
        events: AtomicU32,
    }

    struct Device {
        producer: u32,
        /// Armed with this consumer counter, until the event.
        armed: Option<u32>,
    }

    impl ModelCq {
        /// The device writes the next CQE, then fires if armed.
        fn write_cqe(&self) {
            let mut device = self.device.lock().unwrap();
            let slot = device.producer as usize;
            self.valid[slot].store(true, Ordering::Release);
            device.producer += 1;
            if device.armed.take().is_some() {
                self.events.fetch_add(1, Ordering::AcqRel);
            }
        }

        /// The CQ doorbell with the consumer counter (`Hca::arm_cq`): the
        /// device fires at once for CQEs beyond it, else arms.
        fn arm(&self, consumer: u32) {
            let mut device = self.device.lock().unwrap();
            if device.producer != consumer {
                self.events.fetch_add(1, Ordering::AcqRel);
            } else {
                device.armed = Some(consumer);
            }
        }
    }

    /// CQ arm against poll: the client polls empty, arms, and polls again
    /// (the 8.3 loop, [`rearm_loop`], exactly as `poll_and_rearm` runs it)
    /// while the device writes a CQE. Every interleaving ends with the CQE
    /// polled or a completion event raised: none is lost.
    #[test]
    fn loom_cq_arm_against_poll_loses_no_event() {
        loom::model(|| {
            let cq = Arc::new(ModelCq {
                valid: [AtomicBool::new(false), AtomicBool::new(false)],
                device: Mutex::new(Device {
                    producer: 0,
                    armed: None,
                }),
                events: AtomicU32::new(0),
            });
            let device = {
                let cq = cq.clone();
                loom::thread::spawn(move || cq.write_cqe())
            };
            let consumer = core::cell::Cell::new(0u32);
            let mut wcs = [WorkCompletion::EMPTY; 2];
            let polled = rearm_loop::<()>(
                |wcs| {
                    let mut n = 0;
                    while n < wcs.len()
                        && cq
                            .valid
                            .get(consumer.get() as usize)
                            .is_some_and(|v| v.load(Ordering::Acquire))
                    {
                        consumer.set(consumer.get() + 1);
                        n += 1;
                    }
                    Ok(n)
                },
                || {
                    cq.arm(consumer.get());
                    Ok(())
                },
                &mut wcs,
                |_| {},
            )
            .unwrap();
            device.join().unwrap();
            let events = cq.events.load(Ordering::Acquire);
            assert!(
                polled == 1 || events >= 1,
                "the CQE was neither polled nor announced"
            );
        });
    }
}
