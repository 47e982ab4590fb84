//! A user CQ's fast path: polling CQEs from the ring by the owner bit
//! (PRM 10.4) and arming through the doorbell page (PRM 9.3), no kernel
//! call.
//!
//! [`Cq::poll`] and [`Cq::arm`] take `&mut self`/`&self` of the CQ alone:
//! one poller per CQ (wrap it in a lock to share it), with no lock shared
//! with the posters of its QPs. The CQ keeps the route (the queues) of the
//! QP its last CQE completed, and the context's QP directory's generation
//! it was found at: a CQE of that QP, the directory unchanged since, takes
//! no lock; another QP's is looked up under the directory's read lock
//! (its writers are QP setup, reset and drop only).

use std::sync::Arc;

use hca_prm::cqe::{Cqe, CqeFlags};
use hca_prm::doorbell::{CqArm, CqDoorbell};
use hca_prm::owner;
use hca_prm::uverbs::ResizeCqPriv;
use ib_types::wc::WorkCompletion;

use crate::dma::{DmaBuffer, Record, WordRing, from_device};
use crate::error::SetupError;
use crate::mmio::{Register, UarPage};
use crate::queue::{Directory, Route};

/// Bytes of a CQE.
const CQE_BYTES: usize = 32;
/// Words of a CQE; the owner byte is the top byte of the last.
const CQE_WORDS: usize = CQE_BYTES / 8;

/// The route of the QP a CQ's last CQE completed, and the directory's
/// generation it was current at.
#[derive(Debug)]
struct LastRoute {
    qpn: u32,
    generation: u64,
    route: Arc<Route>,
}

/// Which completion an armed CQ raises its event for (PRM 9.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArmFor {
    /// The next solicited completion (or any error completion).
    Solicited,
    /// The next completion.
    Next,
}

/// A user completion queue.
#[derive(Debug)]
pub struct Cq {
    cqn: u32,
    /// The CQ's entries as a ring of words, checked once at creation and
    /// resize, so a poll loads a CQE's words with no bounds check.
    ring: WordRing,
    record: Record,
    log_entries: u8,
    /// [`owner::pass_bit`] of the ring: the owner rule's parity, found
    /// once per ring.
    pass_bit: u32,
    /// CQEs consumed (wrapping) in the current ring.
    consumer: u32,
    /// CQEs consumed since the CQ was created, across resizes: the
    /// sequence number of the next CQE (what a QP's reset marks its
    /// earlier completions with, `crate::queue::BeforeReset`).
    polled: u64,
    /// CQEs that named no QP of the context (a QP dropped with
    /// completions outstanding) or could not be decoded.
    stray: u64,
    uar: Arc<UarPage>,
    doorbell: Register,
    directory: Arc<Directory>,
    last: Option<LastRoute>,
}

impl Cq {
    pub(crate) fn new(
        cqn: u32,
        ring: DmaBuffer,
        record: Record,
        log_entries: u8,
        uar: Arc<UarPage>,
        doorbell_offset: u64,
        directory: Arc<Directory>,
    ) -> Result<Self, SetupError> {
        let ring = ring_of(ring, log_entries)?;
        let doorbell = Register::at(doorbell_offset).ok_or(SetupError::Layout {
            what: "CQ doorbell",
            detail: "outside the UAR page or misaligned",
        })?;
        Ok(Self {
            cqn,
            ring,
            record,
            log_entries,
            pass_bit: owner::pass_bit(log_entries),
            consumer: 0,
            polled: 0,
            stray: 0,
            uar,
            doorbell,
            directory,
            last: None,
        })
    }

    /// The CQ number.
    pub fn cqn(&self) -> u32 {
        self.cqn
    }

    /// CQEs consumed so far (the consumer counter).
    pub fn consumer(&self) -> u32 {
        self.consumer
    }

    /// CQEs consumed that named no QP of the context or did not decode;
    /// they produce no work completion.
    pub fn stray_completions(&self) -> u64 {
        self.stray
    }

    /// Moves up to `out.len()` completions into `out`, oldest first, and
    /// returns how many. For each CQE: its owner bit decides whether the
    /// device wrote it on this pass; the from-device barrier; then the
    /// entry. The consumer record is stored once per batch.
    pub fn poll(&mut self, out: &mut [WorkCompletion]) -> usize {
        let start = self.consumer;
        let mut filled = 0;
        while filled < out.len() {
            // The ring's base and mask in registers for this CQE's loads
            // (after the from-device fence the compiler would reload them
            // from `self` per word), not across CQEs: kept across the loop
            // they would be spilled, a store and a load each, where most
            // polls take one CQE.
            let pass_bit = self.pass_bit;
            let counter = self.consumer;
            // The ring's mask takes the slot: its words are the entries'
            // (`ring_of`), so there is always an entry.
            let Some(entry) = self.ring.view().entry::<CQE_WORDS>(counter as usize) else {
                break;
            };
            // The owner byte is the last byte of the entry's last word,
            // which the device writes whole (with the opcode and status).
            let last_word = entry.load(CQE_WORDS - 1);
            if !owner::is_valid_in_pass((last_word >> 56) as u8, counter, pass_bit) {
                break;
            }
            from_device();
            // The words are little-endian (PRM 10.4).
            let words = [entry.load(0), entry.load(1), entry.load(2), last_word].map(u64::to_le);
            let cqe: Cqe = zerocopy::transmute!(words);
            self.consumer = counter.wrapping_add(1);
            let sequence = self.polled;
            self.polled += 1;
            match Self::complete(&mut self.last, &self.directory, &cqe, sequence) {
                Some(wc) => {
                    out[filled] = wc;
                    filled += 1;
                }
                None => self.stray += 1,
            }
        }
        if self.consumer != start {
            self.record.store_release(self.consumer);
        }
        filled
    }

    /// The work completion of `cqe`, the CQ's `sequence`th; `None` for a
    /// CQE of no QP in `directory` or that does not decode. `last` is the
    /// CQ's last route, kept or replaced.
    #[inline]
    fn complete(
        last: &mut Option<LastRoute>,
        directory: &Directory,
        cqe: &Cqe,
        sequence: u64,
    ) -> Option<WorkCompletion> {
        let qpn = cqe.qpn().ok()?.get();
        let generation = directory.generation();
        let current = last
            .as_ref()
            .is_some_and(|last| last.qpn == qpn && last.generation == generation);
        if !current {
            *last = directory.route(qpn).map(|(route, generation)| LastRoute {
                qpn,
                generation,
                route,
            });
        }
        complete(&last.as_ref()?.route, cqe, sequence)
    }

    /// The sequence number the next CQE the device writes will have: the
    /// CQEs consumed since creation plus those waiting in the ring now. A
    /// QP's reset (`crate::Qp::reset`) marks the end of its earlier
    /// completions with it: the device wrote them all before it answered.
    pub fn next_sequence(&self) -> u64 {
        let entries = 1u32 << self.log_entries;
        let mask = entries - 1;
        let mut waiting = 0;
        while waiting < entries {
            let counter = self.consumer.wrapping_add(waiting);
            let at = (counter & mask) as usize * CQE_WORDS;
            let last_word = self.ring.load(at + CQE_WORDS - 1);
            if !owner::is_valid((last_word >> 56) as u8, counter, self.log_entries) {
                break;
            }
            waiting += 1;
        }
        self.polled + u64::from(waiting)
    }

    /// CQEs consumed since the CQ was created (across resizes).
    pub(crate) fn polled(&self) -> u64 {
        self.polled
    }

    /// Moves to the new ring of a successful `ResizeCq` (PRM 6.2, 13): the
    /// device copied the outstanding CQEs to its slot 0 onward and zeroed
    /// the consumer record, so polling goes on from counter 0 there. Call
    /// it only after the kernel answered success, and poll nothing while
    /// the request is outstanding; after a failure the old ring stays.
    ///
    /// # Safety
    /// As [`crate::Context::cq`], for `layout`'s ring and the rest of the
    /// CQ's life.
    pub unsafe fn resized(&mut self, layout: &ResizeCqPriv) -> Result<(), SetupError> {
        if layout.ring.len < (CQE_BYTES as u64) << layout.log_entries {
            return Err(SetupError::Layout {
                what: "CQ ring",
                detail: "smaller than its entries",
            });
        }
        let len = usize::try_from(layout.ring.len).map_err(|_| SetupError::Layout {
            what: "CQ ring",
            detail: "longer than the address space",
        })?;
        // SAFETY: the caller's contract is `from_raw`'s for the new ring.
        let buffer = unsafe { DmaBuffer::from_raw(layout.ring.va, len) }?;
        self.ring = ring_of(buffer, layout.log_entries)?;
        self.log_entries = layout.log_entries;
        self.pass_bit = owner::pass_bit(layout.log_entries);
        self.consumer = 0;
        Ok(())
    }

    /// Arms the CQ for one completion event through the doorbell page,
    /// with the consumer counter as of now: CQEs the device wrote past it
    /// raise the event at once (PRM 9.3), so poll, arm, poll again is
    /// race-free.
    pub fn arm(&self, for_: ArmFor) {
        let cmd = match for_ {
            ArmFor::Solicited => CqArm::Solicited,
            ArmFor::Next => CqArm::Next,
        };
        // The CQN fits 24 bits: checked at setup.
        if let Ok(doorbell) = CqDoorbell::new(self.cqn, cmd, self.consumer) {
            self.uar.ring(self.doorbell, doorbell.encode());
        }
    }
}

/// `buffer` as the ring of a CQ of `2^log_entries` CQEs (its length was
/// checked against them).
fn ring_of(buffer: DmaBuffer, log_entries: u8) -> Result<WordRing, SetupError> {
    1usize
        .checked_shl(u32::from(log_entries))
        .and_then(|entries| entries.checked_mul(CQE_WORDS))
        .and_then(|words| WordRing::new(buffer, words))
        .ok_or(SetupError::Layout {
            what: "CQ ring",
            detail: "smaller than its entries",
        })
}

/// The work completion of `cqe`, the CQ's `sequence`th, of the QP whose
/// route is `route`: its `wr_id` taken from the queue it completes (as it
/// was before a reset, for a CQE written before it); `None` for a CQE that
/// does not decode.
#[inline]
fn complete(route: &Route, cqe: &Cqe, sequence: u64) -> Option<WorkCompletion> {
    let flags = cqe.flags();
    let index = cqe.wqe_index();
    let wr_id = if !flags.contains(CqeFlags::RECV) {
        route.send_at(sequence).complete(index)
    } else if flags.contains(CqeFlags::SRQ) {
        route.srq.as_ref()?.complete(index)
    } else {
        route.recv_at(sequence)?.complete(index)
    };
    cqe.to_work_completion(wr_id).ok()
}
