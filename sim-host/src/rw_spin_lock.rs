//! The host's reader-writer spin lock, `EX_SPIN_LOCK`
//! (`ExAcquireSpinLockShared` / `ExAcquireSpinLockExclusive` and their
//! releases), the `RawRwSpinLock` of the simulated platform; cores use it
//! as `lock_api::RwLock<HostRwSpinLock, T>` (`driver_platform::RwSpinLock`).
//!
//! Contract (the Windows behaviour it models, with the checks of
//! [`HostSpinLock`](crate::irql::HostSpinLock)):
//!
//! - Both modes raise to DISPATCH_LEVEL before waiting; above
//!   DISPATCH_LEVEL the call is recorded as
//!   [`ViolationKind::IrqlTooHigh`] and acquires without changing the IRQL.
//!   Each holder's previous level is kept per thread (readers are many), and
//!   releasing restores it; a release at another level than the one the
//!   lock was acquired at is recorded as [`ViolationKind::IrqlMismatch`].
//! - Shared holders never wait for each other. An exclusive acquirer marks
//!   itself waiting, which keeps new shared acquirers out, waits until the
//!   shared holders have drained, then excludes everyone.
//! - Recursive acquisition in any combination of modes by the thread that
//!   holds the lock is recorded as [`ViolationKind::Protocol`] and then
//!   panics: exclusive-after-shared or exclusive-after-exclusive deadlocks
//!   on Windows, and shared-after-shared deadlocks as soon as an exclusive
//!   acquirer is waiting between the two. `try_lock_*` on a lock this
//!   thread holds returns false and changes nothing.
//! - Every thread counts its own acquisitions ([`acquisitions`]): how many
//!   shared and exclusive, and how many of each had to wait. Tests use it
//!   to prove which mode a code path takes and that it never waited.
//!
//! Guards are not `Send` ([`lock_api::GuardNoSend`]): releasing restores
//! the IRQL of the acquiring thread.

// The one exception is `lock_api::RawRwLock`, an `unsafe trait`; it is
// allowed on that impl alone.
#![deny(unsafe_code)]

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use driver_platform::Irql;

use crate::context;
use crate::irql::{SPINS_BEFORE_YIELD, check_max, current, report_mismatch, set};
use crate::verifier::ViolationKind;

/// `state` bit: held exclusive.
const EXCLUSIVE: u64 = 1 << 63;
/// `state` bit: an exclusive acquirer is waiting; new shared acquirers wait.
const EXCLUSIVE_WAITING: u64 = 1 << 62;
/// `state` bits: the number of shared holders.
const SHARED_COUNT: u64 = EXCLUSIVE_WAITING - 1;

/// One acquisition of a [`HostRwSpinLock`] by this thread.
#[derive(Debug, Clone, Copy)]
struct Holding {
    /// The lock's address: identifies it while it is held (a held lock
    /// cannot move, its guard borrows it).
    lock: usize,
    /// The level restored on release.
    previous: Irql,
    /// The level the holder runs at while holding.
    held_at: Irql,
    /// Exclusive or shared.
    exclusive: bool,
}

/// How many reader-writer spin lock acquisitions the calling thread made
/// ([`acquisitions`]); `*_waited` count those that found the lock
/// unavailable at first and spun.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RwAcquisitions {
    /// Shared acquisitions (`ExAcquireSpinLockShared`).
    pub shared: u64,
    /// Shared acquisitions that waited for an exclusive holder or waiter.
    pub shared_waited: u64,
    /// Exclusive acquisitions (`ExAcquireSpinLockExclusive`).
    pub exclusive: u64,
    /// Exclusive acquisitions that waited for other holders.
    pub exclusive_waited: u64,
}

impl RwAcquisitions {
    /// The acquisitions made since `earlier` was taken (on this thread).
    pub fn since(self, earlier: Self) -> Self {
        Self {
            shared: self.shared - earlier.shared,
            shared_waited: self.shared_waited - earlier.shared_waited,
            exclusive: self.exclusive - earlier.exclusive,
            exclusive_waited: self.exclusive_waited - earlier.exclusive_waited,
        }
    }
}

/// This thread's reader-writer spin lock state: what it holds (in
/// acquisition order) and its acquisition counts, in one thread-local so
/// that an acquisition checks recursion, records its holding and counts
/// itself in one access, and a release of the lock acquired last (the
/// usual nesting) pops it without a search.
#[derive(Debug, Default)]
struct ThreadState {
    holdings: Vec<Holding>,
    counts: RwAcquisitions,
}

thread_local! {
    static STATE: RefCell<ThreadState> = const {
        RefCell::new(ThreadState {
            holdings: Vec::new(),
            counts: RwAcquisitions { shared: 0, shared_waited: 0, exclusive: 0, exclusive_waited: 0 },
        })
    };
}

/// The reader-writer spin lock acquisitions the calling thread has made so
/// far, over every [`HostRwSpinLock`].
pub fn acquisitions() -> RwAcquisitions {
    STATE.with_borrow(|s| s.counts)
}

/// Counts one acquisition of this thread that had to wait.
fn count_wait(exclusive: bool) {
    STATE.with_borrow_mut(|s| {
        if exclusive {
            s.counts.exclusive_waited += 1;
        } else {
            s.counts.shared_waited += 1;
        }
    });
}

/// The host's reader-writer spin lock; see the [module docs](self).
#[derive(Debug)]
pub struct HostRwSpinLock {
    /// [`EXCLUSIVE`], [`EXCLUSIVE_WAITING`] and the shared holders'
    /// count. Acquire on taking and Release on releasing order the
    /// protected data.
    state: AtomicU64,
}

impl HostRwSpinLock {
    /// A free lock.
    pub const fn new() -> Self {
        Self {
            state: AtomicU64::new(0),
        }
    }

    fn address(&self) -> usize {
        core::ptr::from_ref(self) as usize
    }

    /// Whether this thread holds this lock (in either mode).
    fn held_here(&self) -> bool {
        let me = self.address();
        STATE.with_borrow(|s| s.holdings.iter().any(|h| h.lock == me))
    }

    /// Records and panics on a recursive acquisition `held_exclusive`
    /// holds (see the module docs).
    fn refuse_recursion(exclusive: bool, held_exclusive: bool) -> ! {
        let (now, before) = (mode_name(exclusive), mode_name(held_exclusive));
        context::report(ViolationKind::Protocol {
            detail: format!(
                "recursive reader-writer spin lock acquisition: {now} while this thread holds \
                 it {before} (deadlocks on Windows)"
            ),
        });
        panic!(
            "HostRwSpinLock: recursive acquisition ({now} after {before}) by a thread that \
             holds it; on Windows this thread would deadlock"
        );
    }

    /// Records a call above DISPATCH_LEVEL; returns the calling level and
    /// the level to hold the lock at.
    fn check_acquire_irql(service: &'static str) -> (Irql, Irql) {
        let at = current();
        if at > Irql::DISPATCH {
            check_max(service, Irql::DISPATCH);
        }
        (at, at.max(Irql::DISPATCH))
    }

    /// Before a blocking acquisition: refuses a recursive one (this thread
    /// holds the lock already), else records the holding and counts the
    /// acquisition, in one access to the thread's state. The holding is
    /// recorded before the wait: a blocking acquisition always ends
    /// holding the lock, and nothing of this thread runs meanwhile.
    fn begin_acquire(&self, previous: Irql, held_at: Irql, exclusive: bool) {
        let me = self.address();
        let recursion = STATE.with_borrow_mut(|s| {
            if let Some(held) = s.holdings.iter().find(|h| h.lock == me) {
                return Some(held.exclusive);
            }
            s.holdings.push(Holding {
                lock: me,
                previous,
                held_at,
                exclusive,
            });
            if exclusive {
                s.counts.exclusive += 1;
            } else {
                s.counts.shared += 1;
            }
            None
        });
        if let Some(held_exclusive) = recursion {
            Self::refuse_recursion(exclusive, held_exclusive);
        }
    }

    /// Bookkeeping once a `try_lock_*` took the lock: remember where we
    /// came from, raise, count.
    fn acquired(&self, previous: Irql, held_at: Irql, exclusive: bool) {
        set(held_at);
        STATE.with_borrow_mut(|s| {
            s.holdings.push(Holding {
                lock: self.address(),
                previous,
                held_at,
                exclusive,
            });
            if exclusive {
                s.counts.exclusive += 1;
            } else {
                s.counts.shared += 1;
            }
        });
    }

    /// One attempt at a shared acquisition.
    fn try_take_shared(&self) -> bool {
        let state = self.state.load(Ordering::Relaxed);
        state & (EXCLUSIVE | EXCLUSIVE_WAITING) == 0
            && state & SHARED_COUNT < SHARED_COUNT
            && self
                .state
                .compare_exchange_weak(state, state + 1, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
    }

    /// One attempt at an exclusive acquisition: succeeds when nobody holds
    /// the lock (a waiting mark, ours or another's, is consumed; other
    /// waiters set it again).
    fn try_take_exclusive(&self) -> bool {
        let state = self.state.load(Ordering::Relaxed);
        state & (EXCLUSIVE | SHARED_COUNT) == 0
            && self
                .state
                .compare_exchange_weak(state, EXCLUSIVE, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
    }

    /// Releases this thread's holding in `exclusive` mode: checks the IRQL,
    /// forgets the holding and returns the level to restore (None if this
    /// thread does not hold it so, which is recorded). The holding acquired
    /// last is popped without a search.
    fn release_holding(&self, exclusive: bool) -> Option<Irql> {
        let me = self.address();
        let found = STATE.with_borrow_mut(|s| {
            let h = &mut s.holdings;
            if h.last()
                .is_some_and(|l| l.lock == me && l.exclusive == exclusive)
            {
                return h.pop();
            }
            let at = h
                .iter()
                .rposition(|h| h.lock == me && h.exclusive == exclusive)?;
            Some(h.remove(at))
        });
        let Some(held) = found else {
            // Only reachable through `force_unlock_*` from another thread:
            // the remembered levels belong to the holder.
            context::report(ViolationKind::Protocol {
                detail: format!(
                    "reader-writer spin lock released {} by a thread that does not hold it so",
                    mode_name(exclusive)
                ),
            });
            return None;
        };
        let now = current();
        if now != held.held_at {
            report_mismatch(format!(
                "reader-writer spin lock released at {now:?}, acquired at {:?}",
                held.held_at
            ));
        }
        Some(now.min(held.previous))
    }
}

fn mode_name(exclusive: bool) -> &'static str {
    if exclusive { "exclusive" } else { "shared" }
}

/// Spins (yielding now and then: the holder may be descheduled) until
/// `attempt` succeeds; returns whether it had to wait.
fn spin_until(mut attempt: impl FnMut() -> bool) -> bool {
    let mut spins: u32 = 0;
    while !attempt() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(SPINS_BEFORE_YIELD) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    spins > 0
}

impl Default for HostRwSpinLock {
    fn default() -> Self {
        Self::new()
    }
}

#[expect(
    unsafe_code,
    reason = "lock_api::RawRwLock is an unsafe trait; this is the simulated platform's EX_SPIN_LOCK"
)]
// SAFETY: a shared acquisition succeeds only by a compare-exchange from a
// state with no EXCLUSIVE bit, incrementing the shared count; an exclusive
// one only by a compare-exchange from a state with no EXCLUSIVE bit and a
// zero shared count, to EXCLUSIVE alone. The shared count drops only in
// `unlock_shared` and EXCLUSIVE clears only in `unlock_exclusive`. So an
// exclusive holder coexists with no other holder, which is the RwLock
// contract. Acquire on taking and Release on releasing make a holder's
// writes visible to the next one.
unsafe impl lock_api::RawRwLock for HostRwSpinLock {
    const INIT: Self = Self::new();

    type GuardMarker = lock_api::GuardNoSend;

    fn lock_shared(&self) {
        let (previous, held_at) = Self::check_acquire_irql("ExAcquireSpinLockShared");
        self.begin_acquire(previous, held_at, false);
        // Raise first, as Windows does: the wait happens at DISPATCH_LEVEL.
        set(held_at);
        if spin_until(|| self.try_take_shared()) {
            count_wait(false);
        }
    }

    fn try_lock_shared(&self) -> bool {
        if self.held_here() {
            return false;
        }
        let (previous, held_at) = Self::check_acquire_irql("ExTryAcquireSpinLockSharedAtDpcLevel");
        if !self.try_take_shared() {
            return false;
        }
        self.acquired(previous, held_at, false);
        true
    }

    unsafe fn unlock_shared(&self) {
        let restore = self.release_holding(false);
        // Never below zero, even after a misuse (another thread's
        // `force_unlock_read`) recorded there or above.
        let _ = self
            .state
            .fetch_update(Ordering::Release, Ordering::Relaxed, |s| {
                (s & SHARED_COUNT != 0).then(|| s - 1)
            });
        if let Some(level) = restore {
            set(level);
        }
    }

    fn lock_exclusive(&self) {
        let (previous, held_at) = Self::check_acquire_irql("ExAcquireSpinLockExclusive");
        self.begin_acquire(previous, held_at, true);
        set(held_at);
        let waited = spin_until(|| {
            if self.try_take_exclusive() {
                return true;
            }
            // Keep new readers out while the current ones drain.
            self.state.fetch_or(EXCLUSIVE_WAITING, Ordering::Relaxed);
            false
        });
        if waited {
            count_wait(true);
        }
    }

    fn try_lock_exclusive(&self) -> bool {
        if self.held_here() {
            return false;
        }
        let (previous, held_at) =
            Self::check_acquire_irql("ExTryAcquireSpinLockExclusiveAtDpcLevel");
        if !self.try_take_exclusive() {
            return false;
        }
        self.acquired(previous, held_at, true);
        true
    }

    unsafe fn unlock_exclusive(&self) {
        let restore = self.release_holding(true);
        // Waiters' marks stay: they set them again anyway.
        self.state.fetch_and(!EXCLUSIVE, Ordering::Release);
        if let Some(level) = restore {
            set(level);
        }
    }

    fn is_locked(&self) -> bool {
        self.state.load(Ordering::Relaxed) & (EXCLUSIVE | SHARED_COUNT) != 0
    }

    fn is_locked_exclusive(&self) -> bool {
        self.state.load(Ordering::Relaxed) & EXCLUSIVE != 0
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    use super::*;
    use crate::context::Context;
    use crate::irql::IrqlGuard;
    use crate::verifier::Verifier;

    type RwSpinLock<T> = lock_api::RwLock<HostRwSpinLock, T>;

    fn with_verifier() -> (Verifier, context::ContextGuard) {
        let verifier = Verifier::new();
        let guard = context::enter(Context::driver(verifier.clone(), "testdrv"));
        (verifier, guard)
    }

    #[test]
    fn both_modes_raise_to_dispatch_and_release_restores() {
        let (verifier, _ctx) = with_verifier();
        let lock = RwSpinLock::new(7);
        let before = acquisitions();
        {
            let value = lock.read();
            assert_eq!(current(), Irql::DISPATCH);
            assert!(lock.is_locked() && !lock.is_locked_exclusive());
            assert_eq!(*value, 7);
        }
        assert_eq!(current(), Irql::PASSIVE);
        {
            let mut value = lock.write();
            assert_eq!(current(), Irql::DISPATCH);
            assert!(lock.is_locked_exclusive());
            *value += 1;
        }
        assert_eq!(current(), Irql::PASSIVE);
        assert!(!lock.is_locked());
        // Inside a DPC: stays at DISPATCH_LEVEL.
        let dpc = IrqlGuard::at(Irql::DISPATCH);
        assert_eq!(*lock.read(), 8);
        assert_eq!(current(), Irql::DISPATCH);
        drop(dpc);
        assert_eq!(
            acquisitions().since(before),
            RwAcquisitions {
                shared: 2,
                exclusive: 1,
                ..Default::default()
            }
        );
        verifier.assert_clean();
    }

    #[test]
    fn acquiring_above_dispatch_is_recorded_in_both_modes() {
        let (verifier, _ctx) = with_verifier();
        let lock = RwSpinLock::new(());
        let isr = IrqlGuard::at(Irql::device(5));
        drop(lock.read());
        drop(lock.write());
        assert_eq!(current(), Irql::device(5));
        drop(isr);
        let services: Vec<_> = verifier
            .take()
            .into_iter()
            .map(|v| match v.kind {
                ViolationKind::IrqlTooHigh { service, .. } => service,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            services,
            ["ExAcquireSpinLockShared", "ExAcquireSpinLockExclusive"]
        );
    }

    #[test]
    fn release_at_another_level_is_recorded() {
        let (verifier, _ctx) = with_verifier();
        let lock = RwSpinLock::new(());
        let guard = lock.read();
        crate::irql::lower(Irql::PASSIVE);
        drop(guard);
        assert_eq!(current(), Irql::PASSIVE);
        let log = verifier.take();
        assert!(
            matches!(&log[..], [v] if matches!(&v.kind, ViolationKind::IrqlMismatch { detail } if detail.contains("released at PASSIVE_LEVEL"))),
            "{log:?}"
        );
    }

    /// Runs `second` while this thread holds `lock` per `first`; expects a
    /// recorded protocol violation and a panic, and the lock free after.
    fn assert_recursion_refused(first_exclusive: bool, second_exclusive: bool) {
        let (verifier, _ctx) = with_verifier();
        let lock = RwSpinLock::new(());
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _first = if first_exclusive {
                (Some(lock.write()), None)
            } else {
                (None, Some(lock.read()))
            };
            if second_exclusive {
                drop(lock.write());
            } else {
                drop(lock.read());
            }
        }));
        let message = *result.unwrap_err().downcast::<String>().unwrap();
        assert!(message.contains("recursive acquisition"), "{message}");
        assert_eq!(current(), Irql::PASSIVE, "unwinding released the first");
        assert!(!lock.is_locked());
        let log = verifier.take();
        assert!(
            matches!(&log[..], [v] if matches!(&v.kind, ViolationKind::Protocol { detail } if detail.contains("recursive"))),
            "{log:?}"
        );
    }

    #[test]
    fn recursive_acquisition_in_any_mode_is_recorded_then_panics() {
        assert_recursion_refused(false, true); // the Windows deadlock
        assert_recursion_refused(false, false);
        assert_recursion_refused(true, true);
        assert_recursion_refused(true, false);
    }

    /// Many locks held at once: each is known as held (a try fails, a
    /// recursive acquisition would be refused), and releasing them out of
    /// order (the holdings record pops the latest without a search, and
    /// searches otherwise) keeps DISPATCH_LEVEL until the first one, taken
    /// at PASSIVE_LEVEL, goes.
    #[test]
    fn many_locks_are_tracked_and_released_in_any_order() {
        const MANY: usize = 11;
        let (verifier, _ctx) = with_verifier();
        let locks: Vec<RwSpinLock<usize>> = (0..MANY).map(RwSpinLock::new).collect();
        let mut guards: Vec<Option<_>> = locks
            .iter()
            .enumerate()
            .map(|(i, lock)| {
                Some(if i % 2 == 0 {
                    (Some(lock.read()), None)
                } else {
                    (None, Some(lock.write()))
                })
            })
            .collect();
        for lock in &locks {
            assert!(lock.try_read().is_none() && lock.try_write().is_none());
        }
        // Middle ones first, then the rest, the first one (taken at
        // PASSIVE_LEVEL) last.
        let order = [4, 9, 10, 7].into_iter().chain((1..MANY).rev()).chain([0]);
        for i in order {
            if guards[i].take().is_some() {
                assert!(
                    locks[i].try_write().is_some(),
                    "lock {i} free after its release"
                );
            }
            let left = guards.iter().filter(|g| g.is_some()).count();
            let expected = if left == 0 {
                Irql::PASSIVE
            } else {
                Irql::DISPATCH
            };
            assert_eq!(current(), expected, "{left} still held");
        }
        verifier.assert_clean();
    }

    #[test]
    fn try_on_a_lock_this_thread_holds_changes_nothing() {
        let (verifier, _ctx) = with_verifier();
        let lock = RwSpinLock::new(());
        let guard = lock.read();
        assert!(lock.try_read().is_none() && lock.try_write().is_none());
        assert_eq!(current(), Irql::DISPATCH);
        drop(guard);
        assert_eq!(current(), Irql::PASSIVE);
        verifier.assert_clean();
    }

    #[test]
    fn shared_holders_on_two_threads_hold_at_once_and_exclusive_waits_for_both() {
        let (verifier, _ctx) = with_verifier();
        let lock = Arc::new(RwSpinLock::new(0_u32));
        let both_hold = Arc::new(Barrier::new(3));
        let release = Arc::new(Barrier::new(3));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (lock, both_hold, release) = (lock.clone(), both_hold.clone(), release.clone());
                let verifier = verifier.clone();
                std::thread::spawn(move || {
                    let _ctx = context::enter(Context::driver(verifier, "reader"));
                    let before = acquisitions();
                    let guard = lock.read();
                    assert_eq!(current(), Irql::DISPATCH);
                    // Both readers get here only if neither waits for the other.
                    both_hold.wait();
                    release.wait();
                    drop(guard);
                    assert_eq!(current(), Irql::PASSIVE);
                    acquisitions().since(before)
                })
            })
            .collect();
        both_hold.wait();
        // Both readers hold it now: an exclusive try fails, changing nothing.
        assert!(lock.try_write().is_none());
        assert_eq!(current(), Irql::PASSIVE);
        let (acquired, got) = mpsc::channel();
        let writer = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let mut value = lock.write();
                *value += 1;
                acquired.send(acquisitions()).unwrap();
            })
        };
        // The writer cannot get in while the readers hold it.
        assert!(got.recv_timeout(Duration::from_millis(50)).is_err());
        release.wait();
        let writer_counts = got.recv().unwrap();
        writer.join().unwrap();
        assert_eq!(writer_counts.exclusive, 1);
        assert_eq!(writer_counts.exclusive_waited, 1);
        for reader in readers {
            let counts = reader.join().unwrap();
            assert_eq!(
                counts,
                RwAcquisitions {
                    shared: 1,
                    ..Default::default()
                }
            );
        }
        assert_eq!(*lock.read(), 1);
        verifier.assert_clean();
    }

    #[test]
    fn contending_readers_and_writers_keep_exclusion() {
        const ROUNDS: u64 = 2_000;
        let verifier = Verifier::new();
        let lock = Arc::new(RwSpinLock::new((0_u64, 0_u64)));
        let threads: Vec<_> = (0..3)
            .map(|n| {
                let (lock, verifier) = (lock.clone(), verifier.clone());
                std::thread::spawn(move || {
                    let _ctx = context::enter(Context::driver(verifier, format!("drv{n}")));
                    for round in 0..ROUNDS {
                        if n == 0 {
                            // A reader sees both halves equal: no torn write.
                            let pair = lock.read();
                            assert_eq!(pair.0, pair.1);
                        } else {
                            let mut pair = lock.write();
                            pair.0 += 1;
                            if round % 16 == 0 {
                                std::thread::yield_now();
                            }
                            pair.1 += 1;
                        }
                        assert_eq!(current(), Irql::PASSIVE);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(*lock.read(), (2 * ROUNDS, 2 * ROUNDS));
        verifier.assert_clean();
    }
}
