//! IRQL tracking: the interrupt request level of each thread, and the
//! rules Windows attaches to it.
//!
//! Contract (the Windows behaviour it models):
//!
//! - Every thread has a current IRQL, starting at PASSIVE_LEVEL
//!   (`KeGetCurrentIrql`, [`current`], [`IrqlTracker`]).
//! - [`raise`] only goes up and [`lower`] only goes down (`KeRaiseIrql`,
//!   `KeLowerIrql`, which bug-check otherwise). Here the wrong direction is
//!   recorded as [`ViolationKind::IrqlMismatch`] and leaves the level
//!   unchanged.
//! - The host runs a driver routine at its documented level inside an
//!   [`IrqlGuard`]: a DPC or a timer routine at DISPATCH_LEVEL, an ISR at its
//!   device IRQL, a work item at PASSIVE_LEVEL. A routine that returns at a
//!   different level than it was entered at is a violation (Windows
//!   bug-checks with `IRQL_UNEXPECTED_VALUE`).
//! - A PASSIVE-only host service (waiting, paged allocation, registry
//!   access) calls [`check_max`] first: being called above its highest
//!   allowed level is recorded as [`ViolationKind::IrqlTooHigh`], and the
//!   service goes on with its normal behaviour.
//! - [`HostSpinLock`] is `KSPIN_LOCK`: acquiring raises to DISPATCH_LEVEL
//!   (a violation above it) and remembers the previous level; releasing
//!   restores it (a violation if the level changed while the lock was held).
//! - [`HostRwSpinLock`](crate::rw_spin_lock::HostRwSpinLock) is
//!   `EX_SPIN_LOCK`, the reader-writer variant, with the same rules.
//!
//! Violations go to the thread's [`context`]; with no context entered they
//! are not recorded. The one misuse that is not merely recorded is a thread
//! re-acquiring a spin lock it holds: on Windows that thread deadlocks
//! forever, here it panics (see [`HostSpinLock`]).

// The one exception is `lock_api::RawMutex`, an `unsafe trait`; it is
// allowed on that impl alone.
#![deny(unsafe_code)]

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use driver_platform::{Irql, IrqlQuery};

use crate::context;
use crate::verifier::ViolationKind;

thread_local! {
    /// The IRQL of this thread.
    static CURRENT: Cell<Irql> = const { Cell::new(Irql::PASSIVE) };
}

/// The IRQL of the calling thread (`KeGetCurrentIrql`).
pub fn current() -> Irql {
    CURRENT.get()
}

/// Sets the calling thread's IRQL with no checks: the host's primitive.
pub(crate) fn set(irql: Irql) {
    CURRENT.set(irql);
}

/// The [`Irql`] whose raw level is `level` (the inverse of
/// [`Irql::level`]).
fn from_level(level: u8) -> Irql {
    match level {
        0 => Irql::PASSIVE,
        1 => Irql::APC,
        2 => Irql::DISPATCH,
        device => Irql::device(device),
    }
}

pub(crate) fn report_mismatch(detail: String) {
    context::report(ViolationKind::IrqlMismatch { detail });
}

/// Raises the calling thread's IRQL to `to` and returns the previous level
/// (`KeRaiseIrql`).
///
/// Raising to a level below the current one is recorded as
/// [`ViolationKind::IrqlMismatch`] and leaves the level unchanged; the
/// current level is returned as "previous" so a matching [`lower`] is a
/// no-op.
pub fn raise(to: Irql) -> Irql {
    let from = current();
    if to < from {
        report_mismatch(format!("KeRaiseIrql to {to:?} below the current {from:?}"));
        return from;
    }
    set(to);
    from
}

/// Lowers the calling thread's IRQL to `to` (`KeLowerIrql`).
///
/// Lowering to a level above the current one is recorded as
/// [`ViolationKind::IrqlMismatch`] and leaves the level unchanged.
pub fn lower(to: Irql) {
    let from = current();
    if to > from {
        report_mismatch(format!("KeLowerIrql to {to:?} above the current {from:?}"));
        return;
    }
    set(to);
    crate::alloc_hook::report_pending();
}

/// Checks that `service` is called at or below `max`; records
/// [`ViolationKind::IrqlTooHigh`] and returns false if not.
///
/// Every PASSIVE-only host service calls this on entry
/// (`check_max("ZwQueryValueKey", Irql::PASSIVE)`) and then does its work
/// anyway: the violation is the test failure, not a changed outcome.
pub fn check_max(service: &'static str, max: Irql) -> bool {
    let at = current();
    if at <= max {
        return true;
    }
    context::report(ViolationKind::IrqlTooHigh {
        service,
        at: at.level(),
        max: max.level(),
    });
    false
}

/// Runs the calling thread at a given IRQL for the guard's lifetime, then
/// restores the previous level.
///
/// On drop, a level different from the one entered means the code run
/// under the guard left the IRQL changed (raised without lowering, lowered
/// below its entry level, leaked a spin lock): that is recorded as
/// [`ViolationKind::IrqlMismatch`], and the previous level is restored
/// regardless.
///
/// Not `Send`: the level it restores belongs to the thread that created it.
#[derive(Debug)]
#[must_use = "the IRQL is restored as soon as the guard is dropped"]
pub struct IrqlGuard {
    /// The level restored on drop.
    previous: Irql,
    /// The level the guarded code started at and must end at.
    entered: Irql,
    /// The routine run under the guard, named in a mismatch report.
    routine: Option<&'static str>,
    /// Pins the guard to its thread.
    _not_send: PhantomData<*const ()>,
}

impl IrqlGuard {
    /// Raises to `irql` on the current thread, as an interrupt or a DPC
    /// preempting it would (an ISR at its DIRQL, a DPC at DISPATCH_LEVEL).
    ///
    /// `irql` below the current level is a [`raise`] in the wrong
    /// direction: recorded, and the guard keeps the current level.
    pub fn at(irql: Irql) -> Self {
        let previous = raise(irql);
        Self {
            previous,
            entered: current(),
            routine: None,
            _not_send: PhantomData,
        }
    }

    /// Sets `irql` whatever the current level is, as if the guarded code
    /// ran on another thread or processor: what the deterministic scheduler
    /// uses to run a work item at PASSIVE_LEVEL on the thread that is
    /// modelling every CPU at once.
    pub fn switched(irql: Irql) -> Self {
        let previous = current();
        set(irql);
        Self {
            previous,
            entered: irql,
            routine: None,
            _not_send: PhantomData,
        }
    }

    /// [`IrqlGuard::switched`] for the named `routine` (a KMDF callback
    /// such as `EvtDeviceD0Entry`), which a mismatch report names.
    pub fn switched_for(irql: Irql, routine: &'static str) -> Self {
        let previous = current();
        set(irql);
        Self {
            previous,
            entered: irql,
            routine: Some(routine),
            _not_send: PhantomData,
        }
    }

    /// The level the guarded code runs at.
    pub fn entered(&self) -> Irql {
        self.entered
    }

    /// The level restored on drop.
    pub fn previous(&self) -> Irql {
        self.previous
    }
}

impl Drop for IrqlGuard {
    fn drop(&mut self) {
        let now = current();
        if now != self.entered {
            let routine = self.routine.unwrap_or("routine");
            report_mismatch(format!(
                "{routine} returned at {now:?}, entered at {:?}",
                self.entered
            ));
        }
        set(self.previous);
        // Back at the level the routine was entered from: a heap call it
        // made above DISPATCH_LEVEL can be reported now (the allocator
        // itself cannot).
        crate::alloc_hook::report_pending();
    }
}

/// The simulated host's [`IrqlQuery`]: the calling thread's tracked IRQL.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IrqlTracker;

impl IrqlQuery for IrqlTracker {
    fn current_irql(&self) -> Irql {
        current()
    }
}

/// A small, process-unique, never-zero id for the calling thread, so a lock
/// can name its owner in one atomic (std's `ThreadId::as_u64` is unstable).
fn thread_id() -> u64 {
    /// The next id to hand out; 0 means "no owner".
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        // 0 until the thread's first call: a constant initialiser keeps
        // every later call a plain thread-local load.
        static ID: Cell<u64> = const { Cell::new(0) };
    }
    let id = ID.get();
    if id != 0 {
        return id;
    }
    // Relaxed: uniqueness needs only the atomicity of fetch_add.
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    ID.set(id);
    id
}

/// After this many failed polls a waiting thread yields its CPU: the holder
/// may be descheduled (there are only two cores and many test threads).
pub(crate) const SPINS_BEFORE_YIELD: u32 = 64;

/// The host's spin lock (`KSPIN_LOCK` with `KeAcquireSpinLock` and
/// `KeReleaseSpinLock`), the `RawSpinLock` of the simulated platform; cores
/// use it as `lock_api::Mutex<HostSpinLock, T>`.
///
/// - `lock` above DISPATCH_LEVEL records [`ViolationKind::IrqlTooHigh`] and
///   acquires without changing the IRQL; otherwise it raises to
///   DISPATCH_LEVEL, then spins until the lock is free. The level it came
///   from is remembered inside the lock.
/// - `unlock` records [`ViolationKind::IrqlMismatch`] if the IRQL is not the
///   one the lock was acquired at (someone lowered or raised it while the
///   lock was held, or locks were released out of order), releases, and
///   restores the remembered level — or keeps the current level if that is
///   already lower, so a mistake is never amplified into raising the IRQL
///   of a thread that holds nothing.
/// - `try_lock` does what `lock` does if the lock is free and returns
///   false, changing nothing, if it is held (also by the calling thread:
///   trying is not a deadlock).
///
/// # Recursive acquisition panics
///
/// A thread calling `lock` on a lock it already holds spins forever on
/// Windows. Here the lock knows its owner thread, records
/// [`ViolationKind::Protocol`] and then panics with a message naming the
/// mistake, since no defined way to continue exists (acquiring twice would
/// break mutual exclusion, returning would hand out a second guard, and
/// spinning would hang the test). This is the host's only panic on a
/// driver's misuse.
///
/// # Guards are not `Send`
///
/// `GuardMarker` is [`lock_api::GuardNoSend`]: releasing restores the IRQL
/// of the thread that acquired, which another thread cannot do (on Windows
/// code at DISPATCH_LEVEL cannot migrate between processors anyway).
#[derive(Debug)]
pub struct HostSpinLock {
    /// The holding thread's [`thread_id`], or 0 when free. Acquire on
    /// taking and Release on freeing order the protected data.
    owner: AtomicU64,
    /// The IRQL the holder came from, restored by `unlock`. Written and read
    /// only by the holder, inside the critical section: Relaxed.
    previous: AtomicU8,
    /// The IRQL the holder runs at while holding (DISPATCH_LEVEL, or the
    /// higher level of a misuse). Same discipline as `previous`.
    held_at: AtomicU8,
}

impl HostSpinLock {
    /// A free lock.
    pub const fn new() -> Self {
        Self {
            owner: AtomicU64::new(0),
            previous: AtomicU8::new(0),
            held_at: AtomicU8::new(0),
        }
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

    /// Bookkeeping once the lock is owned: remember where we came from and
    /// raise.
    fn acquired(&self, previous: Irql, held_at: Irql) {
        self.previous.store(previous.level(), Ordering::Relaxed);
        self.held_at.store(held_at.level(), Ordering::Relaxed);
        set(held_at);
    }

    /// One attempt to take the free lock for thread `me`.
    fn try_take(&self, me: u64) -> bool {
        self.owner
            .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }
}

impl Default for HostSpinLock {
    fn default() -> Self {
        Self::new()
    }
}

#[expect(
    unsafe_code,
    reason = "lock_api::RawMutex is an unsafe trait; this is the simulated platform's spin lock"
)]
// SAFETY: `lock` returns only after `try_take` swapped `owner` from 0 to
// this thread's non-zero id, and `try_lock` returns true only then; `owner`
// goes back to 0 only in `unlock`. So at most one holder exists at a time,
// which is mutual exclusion. Acquire on taking and Release on freeing make
// the previous holder's writes to the protected data visible to the next.
unsafe impl lock_api::RawMutex for HostSpinLock {
    const INIT: Self = Self::new();

    type GuardMarker = lock_api::GuardNoSend;

    fn lock(&self) {
        let me = thread_id();
        if self.owner.load(Ordering::Relaxed) == me {
            context::report(ViolationKind::Protocol {
                detail: "recursive spin lock acquisition: the thread already holds this lock \
                         (deadlocks on Windows)"
                    .to_owned(),
            });
            panic!(
                "HostSpinLock: recursive acquisition by the thread that holds it; \
                 on Windows this thread would deadlock"
            );
        }
        let (previous, held_at) = Self::check_acquire_irql("KeAcquireSpinLock");
        // Raise first, as KeAcquireSpinLock does: the wait happens at
        // DISPATCH_LEVEL.
        set(held_at);
        let mut spins = 0;
        while !self.try_take(me) {
            // Poll with plain loads until it looks free (test-and-test-and-set).
            while self.owner.load(Ordering::Relaxed) != 0 {
                spins += 1;
                if spins % SPINS_BEFORE_YIELD == 0 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        self.acquired(previous, held_at);
    }

    fn try_lock(&self) -> bool {
        let (previous, held_at) = Self::check_acquire_irql("KeTryToAcquireSpinLock");
        if !self.try_take(thread_id()) {
            return false;
        }
        self.acquired(previous, held_at);
        true
    }

    unsafe fn unlock(&self) {
        if self.owner.load(Ordering::Relaxed) != thread_id() {
            // Only reachable through `force_unlock` from another thread: the
            // remembered levels belong to the holder, so leave IRQLs alone.
            context::report(ViolationKind::Protocol {
                detail: "spin lock released by a thread that does not hold it".to_owned(),
            });
            self.owner.store(0, Ordering::Release);
            return;
        }
        let previous = from_level(self.previous.load(Ordering::Relaxed));
        let held_at = from_level(self.held_at.load(Ordering::Relaxed));
        let now = current();
        if now != held_at {
            report_mismatch(format!(
                "spin lock released at {now:?}, acquired at {held_at:?}"
            ));
        }
        self.owner.store(0, Ordering::Release);
        set(now.min(previous));
    }

    fn is_locked(&self) -> bool {
        self.owner.load(Ordering::Relaxed) != 0
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Barrier};

    use super::*;
    use crate::context::Context;
    use crate::verifier::{Verifier, Violation};

    type SpinLock<T> = lock_api::Mutex<HostSpinLock, T>;

    /// Enters a context for a driver named "testdrv" and returns its log.
    fn with_verifier() -> (Verifier, context::ContextGuard) {
        let verifier = Verifier::new();
        let guard = context::enter(Context::driver(verifier.clone(), "testdrv"));
        (verifier, guard)
    }

    fn kinds(violations: Vec<Violation>) -> Vec<ViolationKind> {
        violations.into_iter().map(|v| v.kind).collect()
    }

    fn is_mismatch(kind: &ViolationKind) -> bool {
        matches!(kind, ViolationKind::IrqlMismatch { .. })
    }

    #[test]
    fn threads_start_at_passive_and_raise_and_lower() {
        let (verifier, _ctx) = with_verifier();
        assert_eq!(current(), Irql::PASSIVE);
        assert_eq!(IrqlTracker.current_irql(), Irql::PASSIVE);
        let previous = raise(Irql::DISPATCH);
        assert_eq!(previous, Irql::PASSIVE);
        assert_eq!(IrqlTracker.current_irql(), Irql::DISPATCH);
        lower(previous);
        assert_eq!(current(), Irql::PASSIVE);
        verifier.assert_clean();
    }

    #[test]
    fn wrong_direction_is_recorded_and_changes_nothing() {
        let (verifier, _ctx) = with_verifier();
        lower(Irql::DISPATCH);
        assert_eq!(current(), Irql::PASSIVE);
        raise(Irql::device(5));
        assert_eq!(raise(Irql::DISPATCH), Irql::device(5));
        assert_eq!(current(), Irql::device(5));
        lower(Irql::PASSIVE);
        let log = verifier.take();
        assert_eq!(log.len(), 2);
        assert!(log.iter().all(|v| is_mismatch(&v.kind)));
        assert_eq!(log[0].driver.as_deref(), Some("testdrv"));
    }

    #[test]
    fn guard_raises_and_restores() {
        let (verifier, _ctx) = with_verifier();
        {
            let dpc = IrqlGuard::at(Irql::DISPATCH);
            assert_eq!(
                (dpc.previous(), dpc.entered()),
                (Irql::PASSIVE, Irql::DISPATCH)
            );
            {
                let _isr = IrqlGuard::at(Irql::device(7));
                assert_eq!(current(), Irql::device(7));
            }
            assert_eq!(current(), Irql::DISPATCH);
            {
                let _work_item = IrqlGuard::switched(Irql::PASSIVE);
                assert_eq!(current(), Irql::PASSIVE);
            }
            assert_eq!(current(), Irql::DISPATCH);
        }
        assert_eq!(current(), Irql::PASSIVE);
        verifier.assert_clean();
    }

    #[test]
    fn routine_returning_at_another_level_is_recorded_and_repaired() {
        let (verifier, _ctx) = with_verifier();
        {
            let _dpc = IrqlGuard::at(Irql::DISPATCH);
            lower(Irql::PASSIVE);
        }
        assert_eq!(current(), Irql::PASSIVE);
        let log = kinds(verifier.take());
        assert_eq!(
            log,
            [ViolationKind::IrqlMismatch {
                detail: "routine returned at PASSIVE_LEVEL, entered at DISPATCH_LEVEL".into()
            }]
        );
    }

    #[test]
    fn check_max_records_a_passive_service_at_dispatch() {
        let (verifier, _ctx) = with_verifier();
        assert!(check_max("ZwQueryValueKey", Irql::PASSIVE));
        let _dpc = IrqlGuard::at(Irql::DISPATCH);
        assert!(check_max("KeInsertQueueDpc", Irql::HIGH));
        assert!(!check_max("ZwQueryValueKey", Irql::PASSIVE));
        let log = verifier.take();
        assert_eq!(log.len(), 1);
        assert_eq!(log[0].driver.as_deref(), Some("testdrv"));
        assert_eq!(
            log[0].kind,
            ViolationKind::IrqlTooHigh {
                service: "ZwQueryValueKey",
                at: 2,
                max: 0
            }
        );
    }

    #[test]
    fn lock_raises_to_dispatch_and_unlock_restores() {
        let (verifier, _ctx) = with_verifier();
        let lock = SpinLock::new(5);
        {
            let mut guard = lock.lock();
            assert_eq!(current(), Irql::DISPATCH);
            assert!(lock.is_locked());
            *guard += 1;
        }
        assert_eq!(current(), Irql::PASSIVE);
        assert!(!lock.is_locked());
        // Already at DISPATCH (inside a DPC): stays there.
        let dpc = IrqlGuard::at(Irql::DISPATCH);
        drop(lock.lock());
        assert_eq!(current(), Irql::DISPATCH);
        drop(dpc);
        assert_eq!(*lock.lock(), 6);
        verifier.assert_clean();
    }

    #[test]
    fn nested_locks_restore_in_order() {
        let (verifier, _ctx) = with_verifier();
        let outer = SpinLock::new(());
        let inner = SpinLock::new(());
        let a = outer.lock();
        let b = inner.lock();
        assert_eq!(current(), Irql::DISPATCH);
        drop(b);
        assert_eq!(current(), Irql::DISPATCH, "still holding the outer lock");
        drop(a);
        assert_eq!(current(), Irql::PASSIVE);
        verifier.assert_clean();
    }

    #[test]
    fn out_of_order_release_is_recorded() {
        let (verifier, _ctx) = with_verifier();
        let first = SpinLock::new(());
        let second = SpinLock::new(());
        let a = first.lock();
        let b = second.lock();
        drop(a); // lowers to PASSIVE while `second` is still held
        assert_eq!(current(), Irql::PASSIVE);
        drop(b);
        assert_eq!(current(), Irql::PASSIVE, "never raised by a release");
        let log = kinds(verifier.take());
        assert_eq!(log.len(), 1);
        assert!(is_mismatch(&log[0]));
    }

    #[test]
    fn lowering_while_holding_is_recorded_at_release() {
        let (verifier, _ctx) = with_verifier();
        let lock = SpinLock::new(());
        let guard = lock.lock();
        lower(Irql::PASSIVE);
        drop(guard);
        assert_eq!(current(), Irql::PASSIVE);
        assert_eq!(
            kinds(verifier.take()),
            [ViolationKind::IrqlMismatch {
                detail: "spin lock released at PASSIVE_LEVEL, acquired at DISPATCH_LEVEL".into()
            }]
        );
    }

    #[test]
    fn acquiring_above_dispatch_is_recorded() {
        let (verifier, _ctx) = with_verifier();
        let lock = SpinLock::new(());
        let isr = IrqlGuard::at(Irql::device(6));
        {
            let _guard = lock.lock();
            assert_eq!(current(), Irql::device(6), "never lowered by an acquire");
        }
        assert!(lock.try_lock().is_some());
        assert_eq!(current(), Irql::device(6));
        drop(isr);
        let log = kinds(verifier.take());
        let services: Vec<_> = log
            .iter()
            .map(|k| match k {
                ViolationKind::IrqlTooHigh {
                    service,
                    at: 6,
                    max: 2,
                } => *service,
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(services, ["KeAcquireSpinLock", "KeTryToAcquireSpinLock"]);
    }

    #[test]
    fn try_lock_on_a_held_lock_changes_nothing() {
        let (verifier, _ctx) = with_verifier();
        let lock = SpinLock::new(());
        let guard = lock.try_lock().expect("free");
        assert_eq!(current(), Irql::DISPATCH);
        assert!(lock.try_lock().is_none(), "held by this very thread");
        assert_eq!(current(), Irql::DISPATCH);
        drop(guard);
        assert_eq!(current(), Irql::PASSIVE);
        verifier.assert_clean();
    }

    #[test]
    fn recursive_acquisition_is_recorded_then_panics() {
        let (verifier, _ctx) = with_verifier();
        let lock = SpinLock::new(());
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _first = lock.lock();
            let _second = lock.lock();
        }));
        let message = *result.unwrap_err().downcast::<&str>().unwrap();
        assert!(message.contains("recursive acquisition"), "{message}");
        assert_eq!(
            current(),
            Irql::PASSIVE,
            "unwinding released the first guard"
        );
        assert!(!lock.is_locked());
        let log = kinds(verifier.take());
        assert!(
            matches!(&log[..], [ViolationKind::Protocol { detail }] if detail.contains("recursive"))
        );
    }

    #[test]
    fn contending_threads_keep_mutual_exclusion_and_their_own_irql() {
        const ROUNDS: u64 = 2_000;
        let verifier = Verifier::new();
        let counter = Arc::new(SpinLock::new(0_u64));
        let threads: Vec<_> = (0..2)
            .map(|n| {
                let counter = Arc::clone(&counter);
                let verifier = verifier.clone();
                std::thread::spawn(move || {
                    let _ctx = context::enter(Context::driver(verifier, format!("drv{n}")));
                    for round in 0..ROUNDS {
                        let mut guard = counter.lock();
                        assert_eq!(current(), Irql::DISPATCH);
                        // A non-atomic read-modify-write across a yield:
                        // any lost update means the lock let both in.
                        let seen = *guard;
                        if round % 16 == 0 {
                            std::thread::yield_now();
                        }
                        *guard = seen + 1;
                        drop(guard);
                        assert_eq!(current(), Irql::PASSIVE);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(*counter.lock(), 2 * ROUNDS);
        verifier.assert_clean();
    }

    #[test]
    fn holder_at_dispatch_does_not_raise_other_threads() {
        let (verifier, _ctx) = with_verifier();
        let lock = Arc::new(SpinLock::new(()));
        let held = Arc::new(Barrier::new(2));
        let checked = Arc::new(Barrier::new(2));
        let other = {
            let (lock, held, checked) = (lock.clone(), held.clone(), checked.clone());
            std::thread::spawn(move || {
                held.wait();
                assert_eq!(current(), Irql::PASSIVE);
                assert!(lock.try_lock().is_none());
                assert_eq!(current(), Irql::PASSIVE, "a failed try leaves the level");
                checked.wait();
                let _guard = lock.lock(); // waits for the release below
                assert_eq!(current(), Irql::DISPATCH);
            })
        };
        let guard = lock.lock();
        held.wait();
        checked.wait();
        assert_eq!(current(), Irql::DISPATCH);
        drop(guard);
        other.join().unwrap();
        assert_eq!(current(), Irql::PASSIVE);
        verifier.assert_clean();
    }
}
