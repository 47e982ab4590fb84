//! The lock-free protocol between post and poll on one QP ring (send or
//! receive): the ring's `wr_id` shadow ([`RingShadow`]: post records each
//! WQE's `wr_id` and size by slot before its doorbell; the poll path reads
//! them when the WQE's CQE arrives) and its completion tail
//! ([`CompletionTail`]: how far polled completions reached, in the ring's
//! units, send basic blocks or receive WQEs). Post reads the tail for
//! room; the poll path moves it when it hands out a completion's `wr_id`;
//! a reset or a software flush restarts it. The loom models below drive
//! exactly these types (`cargo xtask loom`).
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

use crate::sync::{AtomicU32, AtomicU64, Ordering};

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
    #[inline]
    pub(crate) fn counter(self) -> u32 {
        self.0 as u32
    }

    #[inline]
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
    #[inline]
    pub(crate) fn counter(&self) -> u32 {
        self.mark().counter()
    }

    /// The tail now, as the base of a [`retire`](Self::retire).
    #[inline]
    pub(crate) fn mark(&self) -> TailMark {
        TailMark(self.0.load(Ordering::Acquire))
    }

    /// Retires the WQE at `wqe_index` (the 16-bit index a CQE carries),
    /// `size` units long, and every WQE before it (unsignaled sends), if
    /// the tail is still at `from` and the WQE lies in the `window` units
    /// ahead of it (the ring's size). On success the tail is just past the
    /// WQE.
    #[inline]
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

/// One QP ring's shadow as post and poll share it, without the ring's
/// lock: by slot, the `wr_id` and (send rings) the size in units of the
/// WQE posted there, and the ring's completion tail.
#[derive(Clone, Copy)]
pub(crate) struct RingShadow<'a> {
    /// `wr_id` by slot.
    pub(crate) wr_ids: &'a [AtomicU64],
    /// Units by slot (a send ring's basic blocks); `None` for a receive
    /// ring, whose WQEs are one unit each.
    pub(crate) sizes: Option<&'a [AtomicU32]>,
    /// How far completions reached.
    pub(crate) tail: &'a CompletionTail,
    /// The ring's size in units (a power of two): the window a completion
    /// must lie in, and the mask of its slot.
    pub(crate) units: u32,
}

impl RingShadow<'_> {
    /// Post, under the ring's lock: units in use with the producer at
    /// `producer` (posted, not yet retired by a polled completion).
    #[inline]
    pub(crate) fn in_use(&self, producer: u32) -> u32 {
        producer.wrapping_sub(self.tail.counter())
    }

    /// Post, under the ring's lock and before the doorbell's release
    /// fence: records the WQE about to be posted at `producer`, `size`
    /// units long. Its slot is free: [`in_use`](Self::in_use) said the
    /// tail passed the WQE that had it, after the poll path read it.
    #[inline]
    pub(crate) fn record(&self, producer: u32, wr_id: u64, size: u32) {
        let slot = (producer & (self.units - 1)) as usize;
        if let Some(id) = self.wr_ids.get(slot) {
            id.store(wr_id, Ordering::Release);
        }
        if let Some(units) = self.sizes.and_then(|sizes| sizes.get(slot)) {
            units.store(size, Ordering::Release);
        }
    }

    /// The poll path, under the CQ's lock: the `wr_id` of the WQE at
    /// `wqe_index` (a CQE's), retiring it and every WQE before it. The
    /// slot is read before the tail moves, so post cannot have refilled
    /// it. A slot past the shadow (a user QP keeps none) gives `wr_id` 0.
    #[inline(always)]
    pub(crate) fn retire(&self, wqe_index: u16) -> Result<u64, Retire> {
        let slot = (u32::from(wqe_index) & (self.units - 1)) as usize;
        let mark = self.tail.mark();
        let wr_id = self
            .wr_ids
            .get(slot)
            .map_or(0, |id| id.load(Ordering::Acquire));
        let size = match self.sizes {
            None => 1,
            Some(sizes) => sizes
                .get(slot)
                .map_or(0, |units| units.load(Ordering::Acquire)),
        };
        self.tail
            .retire(mark, wqe_index, size, self.units)
            .map(|()| wr_id)
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

    /// A send ring of 2 units, each WQE 1 unit, and its shadow.
    struct Ring {
        wr_ids: [AtomicU64; 2],
        sizes: [AtomicU32; 2],
        tail: CompletionTail,
    }

    impl Ring {
        fn new() -> Self {
            Self {
                wr_ids: [AtomicU64::new(0), AtomicU64::new(0)],
                sizes: [AtomicU32::new(0), AtomicU32::new(0)],
                tail: CompletionTail::new(),
            }
        }

        fn shadow(&self) -> RingShadow<'_> {
            RingShadow {
                wr_ids: &self.wr_ids,
                sizes: Some(&self.sizes),
                tail: &self.tail,
                units: 2,
            }
        }
    }

    /// Post against poll on one ring (the wr_id slots and the completion
    /// tail): WQEs 0 and 1 fill the ring; post puts WQE 2 into slot 0 as
    /// soon as the tail says it is free, while the poll path retires WQE 0
    /// then WQE 1. The poll path always hands out the `wr_id` each WQE was
    /// posted with, never the one post wrote into its slot later.
    #[test]
    fn loom_wr_id_slots_post_against_poll() {
        loom::model(|| {
            let ring = Arc::new(Ring::new());
            ring.shadow().record(0, 100, 1);
            ring.shadow().record(1, 101, 1);
            let poster = {
                let ring = ring.clone();
                loom::thread::spawn(move || {
                    // Producer 2: posts WQE 2 if one unit is free.
                    let shadow = ring.shadow();
                    if shadow.in_use(2) < 2 {
                        shadow.record(2, 102, 1);
                        true
                    } else {
                        false
                    }
                })
            };
            let shadow = ring.shadow();
            assert_eq!(shadow.retire(0), Ok(100));
            assert_eq!(shadow.retire(1), Ok(101));
            let posted = poster.join().unwrap();
            assert_eq!(shadow.in_use(2 + u32::from(posted)), u32::from(posted));
            if posted {
                assert_eq!(shadow.retire(2), Ok(102));
            }
        });
    }

    /// The completion tail against a reset and a duplicate: two retires of
    /// one WQE (a stale CQE and the real one) and a reset racing them. At
    /// most one retire of the WQE succeeds before the reset, a retire
    /// marked before the reset never succeeds after it, and the tail ends
    /// at 0 (the reset came last) or 1 (the retire came after it).
    #[test]
    fn loom_completion_tail_retires_once_against_a_reset() {
        loom::model(|| {
            let tail = Arc::new(CompletionTail::new());
            let resetter = {
                let tail = tail.clone();
                loom::thread::spawn(move || tail.restart(0))
            };
            let other = {
                let tail = tail.clone();
                loom::thread::spawn(move || {
                    let mark = tail.mark();
                    tail.retire(mark, 0, 1, 4).is_ok()
                })
            };
            let mark = tail.mark();
            let mine = tail.retire(mark, 0, 1, 4).is_ok();
            let theirs = other.join().unwrap();
            resetter.join().unwrap();
            let end = tail.counter();
            assert!(end <= 1, "the tail never jumps: {end}");
            if mine && theirs {
                // Both succeeded: only possible with the reset between
                // them, and then the second one ends the tail at 1.
                assert_eq!(end, 1);
            }
        });
    }
}
