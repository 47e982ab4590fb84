//! Shared receive queues (IBA 10.2.9, 11.2.3; PRM 6.4, 8.2, 9.2, 10.3).
//!
//! Contract:
//! - **Create** (kernel SRQs): the ring holds the requested depth rounded
//!   up to a power of two, at most the device's `2^log_max_srq_wqes` and at
//!   most 2^16 (a receive WQE's `wqe_index` is 16 bits, PRM 10.3, and the
//!   shadow ring is indexed by it); more is [`IbStatus::InvalidSrqSize`].
//!   The WQE stride is the power of two that holds the 16-byte header and
//!   the requested SGEs (at least 32 bytes, PRM 10.3); more SGEs than the
//!   device's `max_recv_sges` is [`IbStatus::InvalidMaxSge`]. The answer
//!   carries the actual depth and the SGEs the stride holds (capped by the
//!   device). The ring and the producer doorbell record (PRM 9.2) are
//!   zero-filled common buffers from the work item (PASSIVE_LEVEL), the
//!   ring described by MTT entries from the verbs' one allocator; then
//!   `WRITE_MTT` and `SW2HW_SRQ` (the PD's number, the limit) complete the
//!   request from the DPC. The SRQ takes a use of its PD
//!   ([`Hca::reference_pd`]) until it is destroyed. User SRQs are
//!   `verbs::user`'s; a user-mode CreateSrq reaching this path is
//!   [`IbStatus::Unsupported`].
//! - **Query** reads the device's context (`QUERY_SRQ`): the depth and
//!   SGEs are the software's, the limit the device's (0 once the
//!   `SRQ_LIMIT` event has fired: the limit is one-shot, PRM 6.4).
//! - **Modify**: the PRM has no command that resizes an SRQ, so a modify
//!   naming `max_wr` is [`IbStatus::Unsupported`] and changes nothing; a
//!   limit is armed with `ARM_SRQ` (a limit above the depth is
//!   [`IbStatus::InvalidParameter`]; 0 disarms).
//! - **Destroy**: refused with [`IbStatus::ResourceBusy`] while a QP uses
//!   the SRQ ([`Hca::reference_srq`], [`Hca::release_srq`], which the QP
//!   verbs call); otherwise `HW2SW_SRQ`, and only when its completion is
//!   processed are the number, the MTT entries and the PD use given back
//!   and the memory queued for freeing (every event of the SRQ precedes
//!   that completion on the one EQ).
//! - **Post** ([`Hca::post_srq_recv`], the `post_srq_recv` entry of
//!   `ib_types::interface::VerbEntryPoints`): each WR is checked (SGE
//!   count, total length) and needs a free slot *before* anything of it is
//!   written, so a failing WR stops the post and leaves the WRs before it
//!   posted. A slot is free when the WR last posted in it has been
//!   completed: the device stores no `wr_id` (PRM 10.4), so the SRQ keeps
//!   each WR's `wr_id` in a shadow ring by `wqe_index`, and the CQ poll
//!   path takes it back with `Srq::complete` (crate-private), which
//!   frees the slot. The SRQ is the one the completion's QP incarnation
//!   received from, never found by number: a live QP's by its
//!   generation-checked handle (the QP holds a use of it), a destroyed
//!   QP's kept in the CQ's record of that QP (`cq::RetiredQp`), since its
//!   receive CQEs can sit unpolled after the SRQ too is destroyed and its
//!   number reused. The shadow ring is atomics outside
//!   the SRQ's lock (`WrIdSlots`): posters serialise on that lock, the poll
//!   path takes none, so posting to an SRQ never waits for its completions
//!   being polled, nor the other way round. The producer doorbell record is written once per post
//!   after the WQEs (release order, PRM 9.2); posting needs no MMIO.
//! - **Events**: `SRQ_LIMIT` and `SRQ_CATASTROPHIC` go, by SRQ number, to
//!   the client of the CA that owns the SRQ now, as asynchronous events
//!   (`SrqLimitReached`, `SrqCatastrophic`) from the DPC.
//! - The SRQ's number (its context index, which the QP context names) is
//!   the number in its handle (`resources::Handle::number`).

use crate::sync::{AtomicU32, AtomicU64, Ordering};
use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec;
use alloc::vec::Vec;

use driver_platform::{CommonBuffer, Platform, RequestorMode, SpinLock};
use hca_prm::cmd::Opcode;
use hca_prm::ctx::{BufDesc, Srqc};
use hca_prm::doorbell::DoorbellRecord;
use hca_prm::wqe::{MIN_RECV_STRIDE, RecvHeader, recv_sges_per_stride};
use hca_prm::{Le16, Le32, Le64};
use ib_types::ioctl::{CreateSrq, DestroySrq, Empty, ModifySrq, QuerySrq};
use ib_types::srq::SrqAttr;
use ib_types::status::IbStatus;
use ib_types::wr::{RecvWr, WrLimits};
use zerocopy::{FromBytes, IntoBytes};

use super::cq::{LOG_PAGE, PAGE, alloc_pages, write_mtt};
use super::{Accepted, Buffer};
use crate::cmd::Command;
use crate::hca::Hca;
use crate::resources::{EntryRange, Handle, kind};

/// `log2` of the largest SRQ the core builds: `wqe_index` is 16 bits.
pub(super) const LOG_MAX_INDEX: u8 = hca_prm::cqe::LOG_MAX_WQE_INDEX;

/// Where an SRQ is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Life {
    /// Memory and commands under way; the client has no handle yet.
    Creating,
    /// Usable.
    Live,
    /// `HW2SW_SRQ` outstanding.
    Destroying,
}

/// An SRQ's ring and producer state, under the SRQ's own lock.
pub(super) struct Ring<B> {
    pub(super) life: Life,
    pub(super) ring: Option<B>,
    pub(super) dbr: Option<B>,
    pub(super) mtt: Option<EntryRange>,
    /// WRs posted (the producer counter, wrapping).
    pub(super) producer: u32,
    /// The limit armed at the last D0 exit (read back with `QUERY_SRQ`),
    /// re-armed on D0 entry ([`super::restore`]).
    pub(super) saved_limit: u32,
}

/// The `wr_id` of the WR in each slot of an SRQ until its completion is
/// polled, outside the SRQ's lock: posters (serialised by that lock) fill
/// free slots, pollers take them back with no lock at all, so posting and
/// polling never wait for each other (as `qp::Completions` for QPs).
pub(super) struct WrIdSlots {
    slots: Box<[WrIdSlot]>,
}

/// One slot of [`WrIdSlots`].
struct WrIdSlot {
    wr_id: AtomicU64,
    /// `generation << 1 | posted`. The poster sets `posted` (Release) after
    /// writing `wr_id`; the one taker clears it and moves to the next
    /// generation in one compare-and-swap (Release) after reading `wr_id`,
    /// which frees the slot. The generation makes a stale taker's swap
    /// fail once the slot was taken and refilled meanwhile (a taker that
    /// saw "posted" before another took the WR and the poster reposted
    /// would otherwise hand out the old `wr_id` again and free the new
    /// WR's slot: the loom model `loom_srq` found it).
    state: AtomicU32,
}

/// The `posted` bit of [`WrIdSlot::state`].
const POSTED: u32 = 1;

impl WrIdSlots {
    fn new(count: usize) -> Self {
        Self {
            slots: (0..count)
                .map(|_| WrIdSlot {
                    wr_id: AtomicU64::new(0),
                    state: AtomicU32::new(0),
                })
                .collect(),
        }
    }

    /// Whether `slot` exists and holds no WR.
    pub(super) fn is_free(&self, slot: usize) -> bool {
        self.slots
            .get(slot)
            .is_some_and(|s| s.state.load(Ordering::Acquire) & POSTED == 0)
    }

    /// Records `wr_id` in the free `slot`. Posters only, under the SRQ's
    /// lock (one writer per slot at a time; a free slot's state changes
    /// only here).
    pub(super) fn put(&self, slot: usize, wr_id: u64) {
        if let Some(s) = self.slots.get(slot) {
            let free = s.state.load(Ordering::Acquire) & !POSTED;
            s.wr_id.store(wr_id, Ordering::Relaxed);
            s.state.store(free | POSTED, Ordering::Release);
        }
    }

    /// Takes the `wr_id` of `slot` back and frees it; `None` if the slot
    /// is empty (or out of range). Lock-free; of two takers of one posted
    /// WR only one gets it, and a taker never frees a WR posted after the
    /// one it read.
    pub(super) fn take(&self, slot: usize) -> Option<u64> {
        let s = self.slots.get(slot)?;
        let seen = s.state.load(Ordering::Acquire);
        if seen & POSTED == 0 {
            return None;
        }
        // Read before freeing: a poster writes only a free slot.
        let wr_id = s.wr_id.load(Ordering::Relaxed);
        let next_generation = (seen & !POSTED).wrapping_add(POSTED << 1);
        s.state
            .compare_exchange(seen, next_generation, Ordering::AcqRel, Ordering::Relaxed)
            .ok()
            .map(|_| wr_id)
    }
}

/// A shared receive queue.
pub struct Srq<P: Platform> {
    pub(super) srqn: u32,
    /// The raw handle of its PD (one use held).
    pub(super) pd: u64,
    pub(super) log_entries: u8,
    pub(super) log_stride: u8,
    /// SGEs a WR may carry.
    max_sge: u32,
    pub(super) ring: SpinLock<P, Ring<Buffer<P>>>,
    /// The posted WRs' `wr_id`s, by slot (no lock: [`WrIdSlots`]).
    pub(super) wr_ids: WrIdSlots,
}

impl<P: Platform> core::fmt::Debug for Srq<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Srq")
            .field("srqn", &self.srqn)
            .field("log_entries", &self.log_entries)
            .field("max_sge", &self.max_sge)
            .finish_non_exhaustive()
    }
}

/// The sizes of an SRQ: `(log_entries, log_stride, max_sge)`.
fn srq_size(
    attr: &SrqAttr,
    log_max_wqes: u8,
    max_recv_sges: u8,
) -> Result<(u8, u8, u32), IbStatus> {
    let entries = attr
        .max_wr
        .max(1)
        .checked_next_power_of_two()
        .ok_or(IbStatus::InvalidSrqSize)?;
    let log_entries = entries.trailing_zeros() as u8;
    if log_entries > log_max_wqes.min(LOG_MAX_INDEX) {
        return Err(IbStatus::InvalidSrqSize);
    }
    if attr.max_sge > u32::from(max_recv_sges) {
        return Err(IbStatus::InvalidMaxSge);
    }
    let bytes = (16 + 16 * attr.max_sge as usize)
        .max(MIN_RECV_STRIDE)
        .next_power_of_two();
    let log_stride = bytes.trailing_zeros() as u8;
    let max_sge = (recv_sges_per_stride(bytes) as u32).min(u32::from(max_recv_sges));
    Ok((log_entries, log_stride, max_sge))
}

impl<P: Platform> Srq<P> {
    /// For the CQ poll path: the `wr_id` of the receive WQE `wqe_index`
    /// (a CQE's, PRM 10.4), taken back, which frees its slot for posting.
    /// `None` if the slot is empty. No lock ([`WrIdSlots`]): a post to the
    /// SRQ goes on meanwhile.
    pub(crate) fn complete(&self, wqe_index: u16) -> Option<u64> {
        let mask = self.entries() - 1;
        self.wr_ids.take((u32::from(wqe_index) & mask) as usize)
    }

    pub(super) fn entries(&self) -> u32 {
        1 << self.log_entries
    }

    pub(super) fn stride(&self) -> usize {
        1 << self.log_stride
    }

    /// Takes the SRQ's common buffers (for freeing once the device no
    /// longer uses them).
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

    /// A user SRQ (`verbs::user`): the same object with no kernel ring
    /// (the user-mode provider posts to its own) and a one-slot `wr_id`
    /// shadow, as the kernel never posts to it. Holds a use of `pd`.
    pub(super) fn new_user(
        srqn: u32,
        pd: u64,
        log_entries: u8,
        log_stride: u8,
        max_sge: u32,
        mtt: EntryRange,
    ) -> Self {
        Self {
            srqn,
            pd,
            log_entries,
            log_stride,
            max_sge,
            ring: SpinLock::<P, _>::new(Ring {
                life: Life::Creating,
                ring: None,
                dbr: None,
                mtt: Some(mtt),
                producer: 0,
                saved_limit: 0,
            }),
            wr_ids: WrIdSlots::new(1),
        }
    }

    /// The SRQ number.
    pub(super) fn number(&self) -> u32 {
        self.srqn
    }
}

impl<P: Platform> Hca<P> {
    /// The live SRQ behind a raw handle, for a request of `mode`.
    fn find_srq(&self, raw: u64, mode: RequestorMode) -> Result<Arc<Srq<P>>, IbStatus> {
        self.find_object::<kind::Srq>(raw, mode)
    }

    /// Records that a QP receives from the SRQ `srq` (raw handle); destroy
    /// is refused while uses are outstanding. Returns the new use count.
    /// Fails with [`IbStatus::InvalidSrqHandle`] for a stale handle and
    /// [`IbStatus::InvalidState`] for an SRQ being created or destroyed.
    /// The SRQ number the QP context needs is the handle's number
    /// (`resources::Handle::number`, the low 24 bits).
    pub fn reference_srq(&self, srq: u64) -> Result<u32, IbStatus> {
        self.reference_object::<kind::Srq>(srq)
    }

    /// Drops a use recorded by [`reference_srq`](Self::reference_srq);
    /// returns the new use count.
    pub fn release_srq(&self, srq: u64) -> Result<u32, IbStatus> {
        self.release_object::<kind::Srq>(srq)
    }

    /// Posts receive WRs to the SRQ `srq` (a kernel client's handle), in
    /// order, and returns how many were posted with the status of the
    /// first that was not ([`IbStatus::Success`] when all were): the
    /// `post_srq_recv` entry point (`ib_types::interface::PostRecvFn`,
    /// whose shell decodes each `RecvWrDesc` into a [`RecvWr`]). A WR with
    /// more SGEs than the SRQ takes is [`IbStatus::InvalidMaxSge`], one
    /// whose total length overflows 32 bits [`IbStatus::InvalidParameter`],
    /// one that finds no free slot [`IbStatus::InsufficientResources`];
    /// none of them touches the WRs before it. Callable at DISPATCH_LEVEL;
    /// never blocks.
    pub fn post_srq_recv(&self, srq: u64, wrs: &[RecvWr<'_>]) -> (u32, IbStatus) {
        let srq = match self.find_srq(srq, RequestorMode::Kernel) {
            Ok(srq) => srq,
            Err(status) => return (0, status),
        };
        let limits = WrLimits {
            max_sge: srq.max_sge,
            max_inline: 0,
        };
        let mask = srq.entries() - 1;
        let stride = srq.stride();
        let mut state = srq.ring.lock();
        if let Err(status) = self.check_running() {
            return (0, status);
        }
        if state.life != Life::Live {
            return (0, IbStatus::InvalidState);
        }
        let mut posted = 0u32;
        let mut status = IbStatus::Success;
        for wr in wrs {
            if wr.sg_list.len() > srq.max_sge as usize {
                status = IbStatus::InvalidMaxSge;
                break;
            }
            if wr.validate(&limits).is_err() {
                status = IbStatus::InvalidParameter;
                break;
            }
            let counter = state.producer;
            let slot = (counter & mask) as usize;
            if !srq.wr_ids.is_free(slot) {
                status = IbStatus::InsufficientResources;
                break;
            }
            // PRM 10.3: the header, then `num_sges` data segments; the
            // device reads nothing after them, so the rest of the stride is
            // left as it is (no allocation, no zeroing on the hot path).
            // `max_sge` fits the stride and 8 bits (`srq_size`).
            let header = RecvHeader {
                num_sges: wr.sg_list.len() as u8,
                wqe_index: Le16::new(counter as u16),
                ..RecvHeader::default()
            };
            let at = slot * stride;
            let written = state.ring.as_ref().is_some_and(|ring| {
                ring.write(at, header.as_bytes())
                    && ring.write(at + size_of::<RecvHeader>(), wr.sg_list.as_bytes())
            });
            if !written {
                status = IbStatus::GenericError;
                break;
            }
            srq.wr_ids.put(slot, wr.wr_id);
            state.producer = counter.wrapping_add(1);
            posted += 1;
        }
        if posted > 0 {
            // The WQEs before the record that publishes them (PRM 9.2).
            driver_platform::dma::dma_wmb();
            let producer = state.producer;
            if let Some(dbr) = state.dbr.as_ref() {
                dbr.write(0, DoorbellRecord::new(producer).as_bytes());
            }
        }
        (posted, status)
    }

    /// The SRQ's current owner's handle for a device SRQ number, if the
    /// number is live (for event routing).
    pub(crate) fn srq_owner(&self, srqn: u32) -> Option<u64> {
        self.with_objects(|o| o.srqs.get_by_number(srqn).map(|(h, _)| h.raw()))
            .ok()
            .flatten()
    }

    /// Removes an SRQ whose creation failed: its number, MTT entries and
    /// PD use go back.
    pub(super) fn forget_srq(&self, handle: Handle<kind::Srq>, pd: u64, mtt: EntryRange) {
        let _ = self.with_objects_mut(|o| {
            let _ = o.srqs.remove(handle);
            let _ = o.mtt.return_entries(mtt);
            let _ = o.pds.release(Handle::<kind::Pd>::from_raw(pd));
        });
    }
}

impl<P: Platform> Hca<P>
where
    P::Request: 'static,
{
    pub(crate) fn create_srq_request(self: &Arc<Self>, a: Accepted<CreateSrq, P::Request>) {
        if let Err(status) = self.check_ca(a.handle, a.mode) {
            a.responder.fail(status);
            return;
        }
        if a.mode == RequestorMode::User {
            a.responder.fail(IbStatus::Unsupported);
            return;
        }
        let Some(report) = self.report() else {
            a.responder.fail(IbStatus::InvalidState);
            return;
        };
        let cap = report.capabilities;
        let create = a.input;
        let (log_entries, log_stride, max_sge) =
            match srq_size(&create.attr, cap.log_max_srq_wqes, cap.max_recv_sges) {
                Ok(sizes) => sizes,
                Err(status) => {
                    a.responder.fail(status);
                    return;
                }
            };
        let entries = 1u32 << log_entries;
        let limit = create.attr.srq_limit;
        if limit > entries {
            a.responder.fail(IbStatus::InvalidParameter);
            return;
        }
        let pd = create.pd.raw();
        if let Err(status) = self.refuse_user_parents(&[(pd, IbStatus::InvalidPdHandle)]) {
            a.responder.fail(status);
            return;
        }
        let pages = ((1usize << log_stride) << log_entries).div_ceil(PAGE);
        let reserved = self.with_objects_mut(|o| {
            let pd_handle = Handle::<kind::Pd>::from_raw(pd);
            o.pds
                .acquire(pd_handle)
                .map_err(|_| IbStatus::InvalidPdHandle)?;
            let mtt = match o.mtt.take_entries(pages as u32) {
                Ok(mtt) => mtt,
                Err(error) => {
                    let _ = o.pds.release(pd_handle);
                    return Err(IbStatus::from(error));
                }
            };
            let made = o.srqs.insert_with(|h| {
                Arc::new(Srq::<P> {
                    srqn: h.number(),
                    pd,
                    log_entries,
                    log_stride,
                    max_sge,
                    ring: SpinLock::<P, _>::new(Ring {
                        life: Life::Creating,
                        ring: None,
                        dbr: None,
                        mtt: Some(mtt),
                        producer: 0,
                        saved_limit: 0,
                    }),
                    wr_ids: WrIdSlots::new(entries as usize),
                })
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
            Ok(reserved) => reserved,
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
                hca.forget_srq(handle, pd, mtt);
                responder.fail(IbStatus::InvalidState);
                return;
            }
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
                    hca.forget_srq(handle, pd, mtt);
                    responder.fail(status);
                    return;
                }
            };
            let srqc = Srqc {
                pd: Le32::new(Handle::<kind::Pd>::from_raw(pd).number()),
                limit: Le32::new(limit),
                ring: BufDesc {
                    mtt_index: Le32::new(mtt.start()),
                    page_offset: Le32::new(0),
                    log_page_size: LOG_PAGE,
                    log_entries,
                    log_stride,
                    ..BufDesc::default()
                },
                dbr: Le64::new(dbr.bus_address()),
                ..Srqc::default()
            };
            let mut commands = write_mtt(mtt.start(), ring.bus_address(), pages);
            commands.push(
                Command::new(Opcode::Sw2HwSrq, srq.srqn).with_mailbox(srqc.as_bytes().to_vec()),
            );
            {
                let mut state = srq.ring.lock();
                state.ring = Some(ring);
                state.dbr = Some(dbr);
            }
            hca.run_commands(
                commands,
                Box::new(move |hca, result| match result {
                    Ok(_) => {
                        srq.set_life(Life::Live);
                        let out = SrqAttr {
                            max_wr: entries,
                            max_sge,
                            srq_limit: limit,
                        };
                        responder.finish(IbStatus::Success, handle.raw(), Some(&out), &[]);
                    }
                    Err(error) => {
                        hca.free_later(srq.take_buffers());
                        hca.forget_srq(handle, pd, mtt);
                        responder.fail(error.ib_status());
                    }
                }),
            );
        }));
    }

    pub(crate) fn query_srq_request(self: &Arc<Self>, a: Accepted<QuerySrq, P::Request>) {
        let srq = match self.find_srq(a.handle, a.mode) {
            Ok(srq) => srq,
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        };
        let responder = a.responder;
        self.run_commands(
            vec![Command::new(Opcode::QuerySrq, srq.srqn).with_output(size_of::<Srqc>())],
            Box::new(move |_hca, result| {
                let srqc = result.map_err(|e| e.ib_status()).and_then(|outputs| {
                    outputs
                        .first()
                        .and_then(|o| Srqc::read_from_prefix(&o.mailbox).ok())
                        .map(|(srqc, _)| srqc)
                        .ok_or(IbStatus::GenericError)
                });
                match srqc {
                    Ok(srqc) => {
                        let out = SrqAttr {
                            max_wr: srq.entries(),
                            max_sge: srq.max_sge,
                            srq_limit: srqc.limit.get(),
                        };
                        responder.finish(IbStatus::Success, 0, Some(&out), &[]);
                    }
                    Err(status) => responder.fail(status),
                }
            }),
        );
    }

    pub(crate) fn modify_srq_request(self: &Arc<Self>, a: Accepted<ModifySrq, P::Request>) {
        let srq = match self.find_srq(a.handle, a.mode) {
            Ok(srq) => srq,
            Err(status) => {
                a.responder.fail(status);
                return;
            }
        };
        let modify = a.input;
        if modify.max_wr.is_some() {
            // PRM 5.1 has no command that resizes an SRQ.
            a.responder.fail(IbStatus::Unsupported);
            return;
        }
        let Some(limit) = modify.srq_limit else {
            a.responder.finish(IbStatus::Success, 0, Some(&Empty), &[]);
            return;
        };
        if limit > srq.entries() {
            a.responder.fail(IbStatus::InvalidParameter);
            return;
        }
        if srq.ring.lock().life != Life::Live {
            a.responder.fail(IbStatus::InvalidState);
            return;
        }
        let responder = a.responder;
        self.run_commands(
            vec![Command::new(Opcode::ArmSrq, srq.srqn).with_immediate(u64::from(limit))],
            Box::new(move |_hca, result| match result {
                Ok(_) => responder.finish(IbStatus::Success, 0, Some(&Empty), &[]),
                Err(error) => responder.fail(error.ib_status()),
            }),
        );
    }

    pub(crate) fn destroy_srq_request(self: &Arc<Self>, a: Accepted<DestroySrq, P::Request>) {
        let responder = a.responder;
        self.destroy_srq_then(a.handle, a.mode, responder.into_done());
    }

    /// Destroys the SRQ `raw` (see the module doc), then calls `done`
    /// (inline when refused, else from the DPC).
    pub(super) fn destroy_srq_then(
        self: &Arc<Self>,
        raw: u64,
        mode: RequestorMode,
        done: super::Done<P>,
    ) {
        let handle = Handle::<kind::Srq>::from_raw(raw);
        let found = self.with_objects(|o| {
            if !Self::ca_visible(o, mode) {
                return Err(IbStatus::InvalidSrqHandle);
            }
            let srq = o
                .srqs
                .get(handle)
                .cloned()
                .ok_or(IbStatus::InvalidSrqHandle)?;
            if o.srqs.use_count(handle) != Some(0) {
                return Err(IbStatus::ResourceBusy);
            }
            let mut ring = srq.ring.lock();
            if ring.life != Life::Live {
                return Err(IbStatus::ResourceBusy);
            }
            ring.life = Life::Destroying;
            drop(ring);
            Ok(srq)
        });
        let srq = match found.and_then(|r| r) {
            Ok(srq) => srq,
            Err(status) => return done(self, Err(status)),
        };
        self.run_commands(
            vec![Command::new(Opcode::Hw2SwSrq, srq.srqn)],
            Box::new(
                move |hca, result| match hca.forgive_destroy(handle.raw(), result) {
                    Ok(_) => {
                        // Only now is the number free: every event of this SRQ
                        // came before this completion on the one EQ.
                        let mtt = srq.ring.lock().mtt.take();
                        let _ = hca.with_objects_mut(|o| {
                            let _ = o.srqs.remove(handle);
                            if let Some(mtt) = mtt {
                                let _ = o.mtt.return_entries(mtt);
                            }
                            let _ = o.pds.release(Handle::<kind::Pd>::from_raw(srq.pd));
                        });
                        hca.free_later(srq.take_buffers());
                        done(hca, Ok(()));
                    }
                    Err(error) => {
                        srq.set_life(Life::Live);
                        done(hca, Err(error.ib_status()));
                    }
                },
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(max_wr: u32, max_sge: u32) -> SrqAttr {
        SrqAttr {
            max_wr,
            max_sge,
            srq_limit: 0,
        }
    }

    #[test]
    fn sizes_round_up_within_the_device_and_the_index() {
        // 1 SGE: 16 + 16 = 32 bytes, the minimum stride, holding 1.
        assert_eq!(srq_size(&attr(100, 1), 14, 16), Ok((7, 5, 1)));
        // 0 SGEs still gets the minimum stride (which holds 1).
        assert_eq!(srq_size(&attr(1, 0), 14, 16), Ok((0, 5, 1)));
        // 3 SGEs: 64 bytes, which hold 3.
        assert_eq!(srq_size(&attr(64, 3), 14, 16), Ok((6, 6, 3)));
        // 4 SGEs: 80 -> 128 bytes, which hold 7.
        assert_eq!(srq_size(&attr(64, 4), 14, 16), Ok((6, 7, 7)));
        // Capped by the device's SGE limit.
        assert_eq!(srq_size(&attr(64, 4), 14, 5), Ok((6, 7, 5)));
        assert_eq!(
            srq_size(&attr(64, 17), 14, 16),
            Err(IbStatus::InvalidMaxSge)
        );
        assert_eq!(
            srq_size(&attr((1 << 14) + 1, 1), 14, 16),
            Err(IbStatus::InvalidSrqSize)
        );
        assert_eq!(
            srq_size(&attr(1 << 17, 1), 20, 16),
            Err(IbStatus::InvalidSrqSize),
            "wqe_index is 16 bits"
        );
        assert_eq!(
            srq_size(&attr(u32::MAX, 1), 31, 16),
            Err(IbStatus::InvalidSrqSize)
        );
    }

    #[test]
    fn wr_id_slots_hand_each_posted_wr_id_back_once_and_free_the_slot() {
        let slots = WrIdSlots::new(4);
        assert!(slots.is_free(3));
        assert!(!slots.is_free(4), "out of range is never free");
        assert_eq!(slots.take(2), None, "nothing posted");
        slots.put(2, u64::MAX);
        assert!(!slots.is_free(2));
        assert_eq!(slots.take(2), Some(u64::MAX));
        assert_eq!(slots.take(2), None, "taken once");
        assert!(slots.is_free(2));
        slots.put(2, 7);
        assert_eq!(slots.take(2), Some(7), "the slot is reused");
        slots.put(9, 1); // out of range: ignored, no panic
        assert_eq!(slots.take(9), None);
    }

    #[test]
    fn wr_id_slots_taken_from_two_threads_give_each_wr_id_to_one() {
        use std::sync::Arc;
        let slots = Arc::new(WrIdSlots::new(64));
        for slot in 0..64 {
            slots.put(slot, 1000 + slot as u64);
        }
        let takers: Vec<_> = (0..2)
            .map(|_| {
                let slots = Arc::clone(&slots);
                std::thread::spawn(move || {
                    (0..64)
                        .filter_map(|slot| slots.take(slot))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut taken: Vec<u64> = takers.into_iter().flat_map(|t| t.join().unwrap()).collect();
        taken.sort_unstable();
        assert_eq!(taken, (1000..1064).collect::<Vec<_>>());
        assert!((0..64).all(|slot| slots.is_free(slot)));
    }
}

#[cfg(all(test, loom))]
mod loom_srq {
    use super::*;
    use loom::sync::Arc;

    /// The SRQ's `wr_id` slots: a stale taker (a CQE naming a slot whose
    /// WR was already completed) races the real one while the poster
    /// refills the slot as soon as it is free. Every `wr_id` posted is
    /// handed out exactly once or still waits in the slot: never twice,
    /// never lost.
    #[test]
    fn loom_srq_wr_id_slots_hand_each_wr_id_out_once() {
        loom::model(|| {
            let slots = Arc::new(WrIdSlots::new(1));
            slots.put(0, 10);
            let stale = {
                let slots = slots.clone();
                loom::thread::spawn(move || slots.take(0))
            };
            let poster = {
                let slots = slots.clone();
                loom::thread::spawn(move || {
                    let free = slots.is_free(0);
                    if free {
                        slots.put(0, 11);
                    }
                    free
                })
            };
            let real = slots.take(0);
            let stale = stale.join().unwrap();
            let posted = poster.join().unwrap();
            let mut handed: Vec<u64> = [real, stale].into_iter().flatten().collect();
            if posted && !handed.contains(&11) {
                handed.push(slots.take(0).expect("the refilled wr_id is not lost"));
            }
            handed.sort_unstable();
            let posted_ids = if posted { vec![10, 11] } else { vec![10] };
            assert_eq!(handed, posted_ids);
            assert!(slots.is_free(0));
        });
    }
}
