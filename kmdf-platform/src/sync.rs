//! The kernel spin lock as `lock_api::RawMutex`, and raising to
//! DISPATCH_LEVEL for the kernel routines that must be called there.

use core::cell::UnsafeCell;
use core::sync::atomic::{AtomicU8, Ordering};

use wdk_sys::ntddk::{
    KeAcquireSpinLockRaiseToDpc, KeReleaseSpinLock, KeReleaseSpinLockFromDpcLevel,
    KeTryToAcquireSpinLockAtDpcLevel,
};
use wdk_sys::{KIRQL, KSPIN_LOCK};

/// Spin-locked data of a shell.
pub type SpinLock<T> = lock_api::Mutex<KernelSpinLock, T>;

/// A `KSPIN_LOCK` as a `lock_api::RawMutex`: acquiring raises to
/// DISPATCH_LEVEL, releasing restores the IRQL saved at acquisition.
///
/// # Invariants
/// `old_irql` is written only by the holder, right after acquiring, and
/// read only by the holder when releasing.
#[derive(Debug)]
pub struct KernelSpinLock {
    lock: UnsafeCell<KSPIN_LOCK>,
    old_irql: AtomicU8,
}

// SAFETY: a KSPIN_LOCK is made to be shared between processors; the cell
// is only touched through the kernel's spin-lock routines.
unsafe impl Sync for KernelSpinLock {}
// SAFETY: as above; a released spin lock may move between threads.
unsafe impl Send for KernelSpinLock {}

// SAFETY: `lock` excludes other holders until `unlock`; the kernel's
// spin-lock routines give acquire/release ordering.
unsafe impl lock_api::RawMutex for KernelSpinLock {
    // A zeroed KSPIN_LOCK is a released one (`KeInitializeSpinLock` stores 0).
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: Self = Self {
        lock: UnsafeCell::new(0),
        old_irql: AtomicU8::new(0),
    };
    type GuardMarker = lock_api::GuardNoSend;

    fn lock(&self) {
        // SAFETY: `self.lock` is a valid, initialised KSPIN_LOCK; the
        // caller is at DISPATCH_LEVEL or below (the core's lock contract).
        let old = unsafe { KeAcquireSpinLockRaiseToDpc(self.lock.get()) };
        self.old_irql.store(old, Ordering::Relaxed);
    }

    fn try_lock(&self) -> bool {
        // SAFETY: a valid, initialised KSPIN_LOCK, tried at DISPATCH_LEVEL
        // as the routine requires (`try_at_dispatch` raised there).
        let acquired =
            try_at_dispatch(|| unsafe { KeTryToAcquireSpinLockAtDpcLevel(self.lock.get()) != 0 });
        match acquired {
            Some(old) => {
                // Released by `unlock` (KeReleaseSpinLock back to `old`).
                self.old_irql.store(old, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    unsafe fn unlock(&self) {
        let old: KIRQL = self.old_irql.load(Ordering::Relaxed);
        // SAFETY: the caller holds the lock (lock_api contract) and `old`
        // is the IRQL it was acquired from (type invariants).
        unsafe { KeReleaseSpinLock(self.lock.get(), old) };
    }
}

/// Runs the try-acquire `attempt` at DISPATCH_LEVEL, where the kernel's
/// `…AtDpcLevel` try routines must be called, raising there first the way
/// [`at_dispatch`] does. If `attempt` acquired its lock, the IRQL stays at
/// DISPATCH_LEVEL and the IRQL to return to when releasing it comes back;
/// otherwise the IRQL is restored and `None` comes back. Never waits for
/// the lock being tried (the private lock is never contended).
pub fn try_at_dispatch(attempt: impl FnOnce() -> bool) -> Option<KIRQL> {
    let mut raise: KSPIN_LOCK = 0;
    // SAFETY: a released spin lock on this stack that nothing else can
    // reach: acquiring it only raises to DISPATCH_LEVEL.
    let old = unsafe { KeAcquireSpinLockRaiseToDpc(&mut raise) };
    if attempt() {
        // SAFETY: acquired just above; releasing it from DISPATCH_LEVEL
        // keeps the IRQL there for the lock `attempt` took.
        unsafe { KeReleaseSpinLockFromDpcLevel(&mut raise) };
        Some(old)
    } else {
        // SAFETY: acquired just above at `old`; lowers back to it.
        unsafe { KeReleaseSpinLock(&mut raise, old) };
        None
    }
}

/// Raises to DISPATCH_LEVEL for the scope of `f` (the old DMA routines
/// must be called there). x64's `KeRaiseIrql` is an inline intrinsic that
/// bindgen does not bind, so a private spin lock, which nothing else ever
/// takes, does the raising (`KeAcquireSpinLockRaiseToDpc`).
pub fn at_dispatch<R>(f: impl FnOnce() -> R) -> R {
    let raise = <KernelSpinLock as lock_api::RawMutex>::INIT;
    lock_api::RawMutex::lock(&raise);
    let result = f();
    // SAFETY: acquired just above by this thread.
    unsafe { lock_api::RawMutex::unlock(&raise) };
    result
}
