//! The completion tail of one QP ring (send or receive): how far polled
//! completions reached, in the ring's units (send basic blocks, receive
//! WQEs). Post reads it for room; the poll path moves it when it hands out
//! a completion's `wr_id`; a reset or a software flush restarts it.
//!
//! Contract (the parent module's **wr_id** and **Locks**):
//! - Completions of one ring are retired in the order the device wrote
//!   them: every caller of [`CompletionTail::retire`] holds the lock of the
//!   ring's CQ (`cq::poll_cq` resolves `wr_id`s under it), so two
//!   processors polling one CQ never retire one ring out of order.
//! - A completion is retired only if it lies within the ring's window
//!   ahead of the tail (a WQE the device can have completed): a stale or
//!   out-of-order index moves nothing ([`Retire::Stale`]), so it can never
//!   throw the tail by up to 65535 and wedge the ring.
//! - A restart (reset, flush) bumps an epoch kept in the same atomic as the
//!   counter, so a retire that read the tail before the restart fails its
//!   one compare-and-swap ([`Retire::Restarted`]) whatever the counters
//!   were: a single read-modify-write decides.

use crate::sync::{AtomicU64, Ordering};

/// Bits of the counter in the packed tail (the low half); the epoch is the
/// high half.
const COUNTER_BITS: u32 = 32;

/// A QP ring's completion tail: the counter of units retired (wrapping)
/// and the epoch of its last restart, packed in one atomic.
///
/// # Invariants
/// The low 32 bits are the counter, the high 32 bits the epoch; the
/// counter only moves forward by a retire within the window, or to any
/// value by a restart, which also increments the epoch.
pub(crate) struct CompletionTail(AtomicU64);

/// The tail as read once ([`CompletionTail::mark`]), the base of one
/// retire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TailMark(u64);

impl TailMark {
    /// The units retired when the mark was taken.
    pub(crate) fn counter(self) -> u32 {
        self.0 as u32
    }

    fn epoch(self) -> u32 {
        (self.0 >> COUNTER_BITS) as u32
    }
}

/// Why a retire moved nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retire {
    /// The WQE does not lie in the window ahead of the tail: already
    /// retired, or not a WQE of this ring's current work.
    Stale,
    /// The tail changed since the mark (a reset or flush restarted it):
    /// take a new mark and decide again.
    Restarted,
}

impl Default for CompletionTail {
    fn default() -> Self {
        Self::new()
    }
}

impl CompletionTail {
    /// Nothing retired, epoch 0.
    pub(crate) fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// The units retired (post's view: the ring has `producer - counter`
    /// units in use). Acquire: pairs with the retire's release, which
    /// follows the poll path's read of the retired slots' `wr_id`s, so post
    /// never refills a slot before its `wr_id` was read.
    pub(crate) fn counter(&self) -> u32 {
        self.mark().counter()
    }

    /// The tail now, as the base of a [`retire`](Self::retire).
    pub(crate) fn mark(&self) -> TailMark {
        TailMark(self.0.load(Ordering::Acquire))
    }

    /// Retires the WQE at `wqe_index` (the 16-bit index a CQE carries),
    /// `size` units long, and every WQE before it (unsignaled sends), if
    /// the tail is still at `from` and the WQE lies in the `window` units
    /// ahead of it (the ring's size). On success the tail is just past the
    /// WQE.
    pub(crate) fn retire(
        &self,
        from: TailMark,
        wqe_index: u16,
        size: u32,
        window: u32,
    ) -> Result<(), Retire> {
        let ahead = u32::from(wqe_index.wrapping_sub(from.counter() as u16));
        if size == 0 || ahead.saturating_add(size) > window {
            return Err(Retire::Stale);
        }
        let counter = from.counter().wrapping_add(ahead + size);
        let next = (u64::from(from.epoch()) << COUNTER_BITS) | u64::from(counter);
        self.0
            .compare_exchange(from.0, next, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(|_| Retire::Restarted)
    }

    /// Restarts the tail at `counter` (0 for a reset; the producer when
    /// software completed everything posted) in a new epoch, so that no
    /// retire based on an earlier mark succeeds.
    pub(crate) fn restart(&self, counter: u32) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                let epoch = ((now >> COUNTER_BITS) as u32).wrapping_add(1);
                Some((u64::from(epoch) << COUNTER_BITS) | u64::from(counter))
            });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Defect 3 of issue 9, deterministically: two processors resolved
    /// completions of one send ring out of order (the newer first); the
    /// older one must not move the tail by a 16-bit difference (up to
    /// 65535), which left the ring wedged.
    #[test]
    fn an_older_wqe_retired_after_a_newer_one_moves_nothing() {
        let tail = CompletionTail::new();
        // WQEs of 2 basic blocks at 0, 2 and 4 in a 16-block ring: both
        // pollers mark the tail at 0.
        let older = tail.mark();
        let newer = tail.mark();
        assert_eq!(tail.retire(newer, 4, 2, 16), Ok(()));
        assert_eq!(tail.counter(), 6);
        // The older one, on its stale mark: the tail moved under it.
        assert_eq!(tail.retire(older, 2, 2, 16), Err(Retire::Restarted));
        // And on a fresh mark it is behind the tail: stale, nothing moves.
        assert_eq!(tail.retire(tail.mark(), 2, 2, 16), Err(Retire::Stale));
        assert_eq!(tail.counter(), 6, "the tail never jumps");
        // The ring goes on: the next WQE retires normally.
        assert_eq!(tail.retire(tail.mark(), 6, 2, 16), Ok(()));
        assert_eq!(tail.counter(), 8);
    }

    #[test]
    fn a_retire_wraps_the_16_bit_index_with_the_counter() {
        let tail = CompletionTail::new();
        tail.restart(0xFFFF_FFFE);
        // Counter 0xFFFF_FFFE is index 0xFFFE; the WQE at 0x0001 is 3
        // units ahead.
        assert_eq!(tail.retire(tail.mark(), 0x0001, 1, 8), Ok(()));
        assert_eq!(tail.counter(), 2);
        // Beyond the window: refused.
        assert_eq!(tail.retire(tail.mark(), 10, 1, 8), Err(Retire::Stale));
        assert_eq!(tail.retire(tail.mark(), 2, 0, 8), Err(Retire::Stale));
    }

    #[test]
    fn a_restart_fails_every_retire_marked_before_it_even_at_the_same_counter() {
        let tail = CompletionTail::new();
        let before = tail.mark();
        // A reset while the tail was 0: the counter is 0 again, but the
        // epoch tells.
        tail.restart(0);
        assert_eq!(tail.counter(), 0);
        assert_eq!(tail.retire(before, 0, 1, 4), Err(Retire::Restarted));
        assert_eq!(tail.retire(tail.mark(), 0, 1, 4), Ok(()));
    }
}

#[cfg(all(test, loom))]
mod loom_tail {
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicU64 as SlotWord;

    /// The completion tail against post and a reset: post fills a slot
    /// only when the tail says it is free, and the poll path reads a
    /// slot's `wr_id` before retiring it; a reset racing the retire either
    /// comes after it or makes it fail. No interleaving lets the poll path
    /// hand out a `wr_id` post wrote for a later WQE.
    #[test]
    fn loom_tail_retire_against_post_and_reset() {
        loom::model(|| {
            // A one-slot ring: WQE 0 posted with wr_id 10.
            let tail = Arc::new(CompletionTail::new());
            let slot = Arc::new(SlotWord::new(10));
            let poster = {
                let (tail, slot) = (tail.clone(), slot.clone());
                loom::thread::spawn(move || {
                    // Post WQE 1 into the slot once WQE 0 is retired
                    // (producer 1, ring of 1).
                    if 1u32.wrapping_sub(tail.counter()) < 1 {
                        slot.store(11, Ordering::Release);
                    }
                })
            };
            let resetter = {
                let tail = tail.clone();
                loom::thread::spawn(move || tail.restart(0))
            };
            // The poll path: the completion of WQE 0.
            let mark = tail.mark();
            let wr_id = slot.load(Ordering::Acquire);
            let retired = tail.retire(mark, 0, 1, 1);
            if retired.is_ok() {
                assert_eq!(wr_id, 10, "the wr_id of WQE 0, never a later one");
            }
            poster.join().unwrap();
            resetter.join().unwrap();
        });
    }
}
