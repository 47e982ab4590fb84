//! What a work queue's poster and its CQ's poller share: the `wr_id` of
//! each posted WQE and the consumer counter, all atomics. No lock is shared
//! between post and poll.
//!
//! Protocol (one poster and one poller per queue, each holding `&mut` of
//! its side):
//! - The poster reads `consumer` (Acquire) to find free slots, writes a
//!   slot's `wr_id` (and size) before the WQE, then makes the WQE visible
//!   to the device (release barrier, doorbell or record).
//! - The poller sees the WQE's CQE (owner bit, then the from-device
//!   barrier), reads the slot, then publishes the new `consumer` (Release).
//!   A slot is rewritten only after the consumer passed it, so a `wr_id` is
//!   never overwritten before its completion was read.
//! - Send and receive completions of one queue arrive in order on one CQ
//!   (PRM 10.2, 10.3), so the consumer follows the CQEs' `wqe_index`. SRQ
//!   completions of different QPs may reach different CQs out of order, so
//!   an SRQ slot carries its own busy flag instead: set by the poster,
//!   cleared (Release) by whichever poller completes it.
//!
//! The `loom_` models below (`cargo xtask loom`) run this code's atomics
//! (`crate::sync`) through every interleaving of a post racing a poll; they
//! fail if the poller publishes a slot before reading it. Loom does not
//! model load buffering, so the Acquire/Release pairs are argued above, not
//! model-checked.

use std::sync::{Arc, PoisonError, RwLock};

use rustc_hash::FxHashMap;

use crate::sync::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// A send or receive queue's shared state: per slot the `wr_id` and the
/// slots the WQE occupies (send basic blocks; 1 for receives).
#[derive(Debug)]
pub(crate) struct WorkQueueShared {
    slots: Box<[Slot]>,
    /// Slots completed (wrapping): written by the poller only.
    consumer: AtomicU32,
}

/// One slot of a work queue: the `wr_id` and size of the WQE posted there,
/// side by side (one bounds check reaches both).
#[derive(Debug)]
struct Slot {
    wr_id: AtomicU64,
    size: AtomicU32,
}

impl WorkQueueShared {
    /// A queue of `slots` slots (a power of two, at most 2^16).
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            slots: (0..slots)
                .map(|_| Slot {
                    wr_id: AtomicU64::new(0),
                    size: AtomicU32::new(0),
                })
                .collect(),
            consumer: AtomicU32::new(0),
        }
    }

    fn mask(&self) -> u32 {
        (self.slots.len() as u32).wrapping_sub(1)
    }

    /// The consumer counter, for the poster (Acquire: the poller's reads of
    /// the slots it freed happen before the poster rewrites them).
    #[inline]
    pub(crate) fn consumer(&self) -> u32 {
        self.consumer.load(Ordering::Acquire)
    }

    /// True while WQEs before `producer` have not all completed.
    pub(crate) fn outstanding(&self, producer: u32) -> bool {
        self.consumer() != producer
    }

    /// Records the WQE posted at `counter`, occupying `size` slots.
    #[inline]
    pub(crate) fn record(&self, counter: u32, wr_id: u64, size: u32) {
        if let Some(slot) = self.slots.get((counter & self.mask()) as usize) {
            slot.wr_id.store(wr_id, Ordering::Relaxed);
            slot.size.store(size, Ordering::Relaxed);
        }
    }

    /// The poller's side: the WQE whose `wqe_index` a CQE names completed,
    /// and with it every WQE before it. Returns its `wr_id`.
    #[inline]
    pub(crate) fn complete(&self, wqe_index: u16) -> u64 {
        let consumer = self.consumer.load(Ordering::Relaxed);
        // The full counter of the WQE: at most 2^16 slots are outstanding,
        // so the low 16 bits place it after the consumer.
        let counter = consumer.wrapping_add(u32::from(wqe_index.wrapping_sub(consumer as u16)));
        let Some(slot) = self.slots.get((counter & self.mask()) as usize) else {
            // No slots at all: nothing was posted to complete.
            self.consumer
                .store(counter.wrapping_add(1), Ordering::Release);
            return 0;
        };
        let wr_id = slot.wr_id.load(Ordering::Relaxed);
        let size = slot.size.load(Ordering::Relaxed).max(1);
        self.consumer
            .store(counter.wrapping_add(size), Ordering::Release);
        wr_id
    }
}

/// An SRQ's shared state: per slot the `wr_id` and whether the WQE there
/// is still outstanding.
#[derive(Debug)]
pub(crate) struct SrqShared {
    wr_ids: Box<[AtomicU64]>,
    busy: Box<[AtomicBool]>,
}

impl SrqShared {
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            wr_ids: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            busy: (0..slots).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    fn slot(&self, counter: u32) -> usize {
        (counter & (self.wr_ids.len() as u32).wrapping_sub(1)) as usize
    }

    /// The poster's side: claims the slot of `counter` for `wr_id`; false
    /// if the WQE there has not completed yet.
    #[inline]
    pub(crate) fn claim(&self, counter: u32, wr_id: u64) -> bool {
        let slot = self.slot(counter);
        let (Some(busy), Some(id)) = (self.busy.get(slot), self.wr_ids.get(slot)) else {
            return false;
        };
        // Acquire: the poller's read of the old `wr_id` happens before the
        // store below.
        if busy.load(Ordering::Acquire) {
            return false;
        }
        id.store(wr_id, Ordering::Relaxed);
        busy.store(true, Ordering::Relaxed);
        true
    }

    /// The poller's side: the WQE at `wqe_index` completed; its `wr_id`.
    #[inline]
    pub(crate) fn complete(&self, wqe_index: u16) -> u64 {
        let slot = self.slot(u32::from(wqe_index));
        let wr_id = self
            .wr_ids
            .get(slot)
            .map_or(0, |w| w.load(Ordering::Relaxed));
        if let Some(busy) = self.busy.get(slot) {
            busy.store(false, Ordering::Release);
        }
        wr_id
    }
}

/// A work queue's state from before a RESET (guide 6.5.5 item 3): its
/// completions still in the CQ are those before `end`, the sequence number
/// (CQEs consumed since the CQ was created, `Cq::next_sequence`) of the
/// first CQE written after the reset.
#[derive(Debug, Clone)]
pub(crate) struct BeforeReset {
    pub(crate) end: u64,
    pub(crate) queue: Arc<WorkQueueShared>,
}

/// The queue a CQE of sequence number `sequence` completes: the oldest kept
/// one it comes before, else the current one.
#[inline]
fn queue_at<'a>(
    current: &'a WorkQueueShared,
    before_reset: &'a [BeforeReset],
    sequence: u64,
) -> &'a WorkQueueShared {
    // Nearly always empty (no reset, or its completions all polled): one
    // test then, no iterator set up.
    if before_reset.is_empty() {
        return current;
    }
    before_reset
        .iter()
        .find(|kept| sequence < kept.end)
        .map_or(current, |kept| &kept.queue)
}

/// Where a QP's completions find their `wr_id`s.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    pub(crate) send: Arc<WorkQueueShared>,
    pub(crate) recv: Option<Arc<WorkQueueShared>>,
    pub(crate) srq: Option<Arc<SrqShared>>,
    /// The send queue's states from before its resets, oldest first (empty
    /// unless a reset left completions to poll).
    pub(crate) send_before_reset: Vec<BeforeReset>,
    /// Likewise for the receive queue.
    pub(crate) recv_before_reset: Vec<BeforeReset>,
}

impl Route {
    /// A new QP's route: no reset yet.
    pub(crate) fn new(
        send: Arc<WorkQueueShared>,
        recv: Option<Arc<WorkQueueShared>>,
        srq: Option<Arc<SrqShared>>,
    ) -> Self {
        Self {
            send,
            recv,
            srq,
            send_before_reset: Vec::new(),
            recv_before_reset: Vec::new(),
        }
    }

    /// The send queue state a send CQE of sequence number `sequence` (in
    /// the send CQ) completes.
    #[inline]
    pub(crate) fn send_at(&self, sequence: u64) -> &WorkQueueShared {
        queue_at(&self.send, &self.send_before_reset, sequence)
    }

    /// The receive queue state a receive CQE of `sequence` (in the
    /// receive CQ) completes; `None` for a QP on an SRQ.
    #[inline]
    pub(crate) fn recv_at(&self, sequence: u64) -> Option<&WorkQueueShared> {
        let current = self.recv.as_deref()?;
        Some(queue_at(current, &self.recv_before_reset, sequence))
    }
}

/// One work queue's part of a reset: its new state, what to keep of the
/// old one (when it had work outstanding), and the sequence number its CQ
/// has consumed up to (kept states ending there are done).
pub(crate) struct QueueRestart {
    pub(crate) queue: Arc<WorkQueueShared>,
    pub(crate) kept: Option<BeforeReset>,
    pub(crate) polled: u64,
}

fn restart_list(list: &mut Vec<BeforeReset>, restart: QueueRestart) {
    list.retain(|kept| kept.end > restart.polled);
    list.extend(restart.kept);
}

/// The context's QPs by number, for the pollers. Written when a QP is set
/// up, reset or dropped (the control path); the post path never touches
/// it. Every write bumps the generation, so a poller that keeps the route
/// it found last ([`Directory::route`]) knows with one load whether it is
/// still the QP's: a poll needs no lock while its CQEs come from the QP it
/// saw last (rdma-core's mlx5 keeps its CQ's last QP the same way).
#[derive(Debug, Default)]
pub(crate) struct Directory {
    routes: RwLock<FxHashMap<u32, Arc<Route>>>,
    /// Writes so far (bumped under the write lock, Release). A plain
    /// atomic under loom too: the directory is not part of the model.
    generation: std::sync::atomic::AtomicU64,
}

impl Directory {
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, FxHashMap<u32, Arc<Route>>> {
        self.routes.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks a write done (under the write lock).
    fn bump(&self) {
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    pub(crate) fn insert(&self, qpn: u32, route: Route) {
        let mut map = self.write();
        map.insert(qpn, Arc::new(route));
        self.bump();
    }

    /// After a RESET of QP `qpn`: its queues' new states, the old ones
    /// kept for the completions still to be polled (those whose CQs have
    /// consumed everything of them are dropped).
    pub(crate) fn restart(&self, qpn: u32, send: QueueRestart, recv: Option<QueueRestart>) {
        let mut map = self.write();
        let Some(route) = map.get_mut(&qpn) else {
            return;
        };
        // A poller may hold the old route: the QP gets a new one.
        let route = Arc::make_mut(route);
        route.send = Arc::clone(&send.queue);
        restart_list(&mut route.send_before_reset, send);
        if let Some(recv) = recv {
            route.recv = Some(Arc::clone(&recv.queue));
            restart_list(&mut route.recv_before_reset, recv);
        }
        self.bump();
    }

    pub(crate) fn remove(&self, qpn: u32) {
        let mut map = self.write();
        map.remove(&qpn);
        self.bump();
    }

    /// The generation now: a route found at another one may be stale.
    #[inline]
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// QP `qpn`'s route and the generation it is current for.
    pub(crate) fn route(&self, qpn: u32) -> Option<(Arc<Route>, u64)> {
        let map = self.routes.read().unwrap_or_else(PoisonError::into_inner);
        // Stable while the read lock is held: writers bump under theirs.
        let generation = self.generation();
        map.get(&qpn).map(|route| (Arc::clone(route), generation))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_completion_frees_its_wqe_and_picks_the_queue_of_its_sequence() {
        let queue = WorkQueueShared::new(4);
        queue.record(0, 10, 2);
        queue.record(2, 11, 1);
        assert_eq!(queue.complete(0), 10);
        assert_eq!(queue.consumer(), 2, "both slots of the first WQE");
        assert_eq!(queue.complete(2), 11);
        assert_eq!(queue.consumer(), 3);
        // A slot never recorded (size 0) still frees one slot.
        assert_eq!(queue.complete(3), 0);
        assert_eq!(queue.consumer(), 4);
        let empty = WorkQueueShared::new(0);
        assert_eq!(empty.complete(5), 0, "no slots: no wr_id");

        let current = WorkQueueShared::new(1);
        let old = Arc::new(WorkQueueShared::new(1));
        let kept = [BeforeReset {
            end: 7,
            queue: Arc::clone(&old),
        }];
        assert!(core::ptr::eq(queue_at(&current, &[], 0), &current));
        assert!(core::ptr::eq(queue_at(&current, &kept, 6), &*old));
        assert!(core::ptr::eq(queue_at(&current, &kept, 7), &current));
    }
}

#[cfg(all(test, loom))]
mod loom_queue {
    use super::*;

    /// Post against poll on a send queue of 2 slots, one WQE per slot:
    /// WQEs 0 and 1 fill it; the poster puts WQE 2 into slot 0 as soon as
    /// the consumer says the slot is free (as `SendQueue::write_wqe` checks
    /// for room), while the poller completes WQE 0 then WQE 1. The poller
    /// always gets the `wr_id` each WQE was posted with, never the one
    /// written into its slot later.
    #[test]
    fn loom_send_slots_post_against_poll() {
        loom::model(|| {
            let queue = loom::sync::Arc::new(WorkQueueShared::new(2));
            queue.record(0, 100, 1);
            queue.record(1, 101, 1);
            let poster = {
                let queue = queue.clone();
                loom::thread::spawn(move || {
                    let in_flight = 2u32.wrapping_sub(queue.consumer());
                    let room = in_flight < 2;
                    if room {
                        queue.record(2, 102, 1);
                    }
                    room
                })
            };
            assert_eq!(queue.complete(0), 100);
            assert_eq!(queue.complete(1), 101);
            if poster.join().unwrap() {
                assert_eq!(queue.complete(2), 102);
            }
        });
    }

    /// An SRQ slot is claimed by the poster only after the poller that
    /// completed its previous WQE read that WQE's `wr_id`.
    #[test]
    fn loom_srq_slot_claim_against_complete() {
        loom::model(|| {
            let srq = loom::sync::Arc::new(SrqShared::new(1));
            assert!(srq.claim(0, 7));
            let poller = {
                let srq = srq.clone();
                loom::thread::spawn(move || srq.complete(0))
            };
            let claimed = srq.claim(1, 8);
            assert_eq!(poller.join().unwrap(), 7);
            // Whichever won, the slot ends claimed by the poster at most
            // once, and a failed claim changed nothing.
            assert!(claimed || srq.claim(1, 8));
            assert!(!srq.claim(2, 9), "busy until its completion");
        });
    }
}
