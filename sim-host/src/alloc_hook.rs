//! The driver heap check: a heap allocation or free made by driver code
//! above DISPATCH_LEVEL is an IRQL violation.
//!
//! Windows: the kernel allocator the drivers link (`wdk-alloc`'s
//! `WdkAllocator`) serves Rust's `alloc` with `ExAllocatePool2`, callable at
//! IRQL <= DISPATCH_LEVEL, and frees with `ExFreePool`, also
//! <= DISPATCH_LEVEL. An ISR (DIRQL) that allocates or drops a `Box`, a
//! `Vec` that grows, a `String` that formats, breaks that rule.
//!
//! The cores allocate through Rust's global allocator, which the host does
//! not otherwise see, so the check is a `#[global_allocator]`:
//! [`DriverHeapCheck`] wraps [`System`] and, on every allocation,
//! reallocation and free, looks at two thread-locals: whether the thread
//! runs driver code ([`crate::context`] sets this on entering a
//! driver's context; [`HostCode`] clears it around the host's own services,
//! such as queueing a DPC or the device answering a register access) and
//! the thread's IRQL ([`crate::irql`]). Above DISPATCH_LEVEL in driver code
//! it notes the call in a per-thread slot of plain integers — the allocator
//! must not allocate, so nothing is reported from inside it — and the host
//! reports it, as [`ViolationKind::IrqlTooHigh`] with the service
//! [`ALLOC_SERVICE`] or [`FREE_SERVICE`], at the next safe point: when the
//! IRQL falls back to DISPATCH_LEVEL or below (an ISR's guard dropping,
//! `KeLowerIrql`) or the driver's context is left.
//!
//! It is opt-in: a binary that boots drivers installs it with
//! [`install_driver_heap_check!`](crate::install_driver_heap_check), and
//! [`is_installed`] tells a test whether its binary did. Without it nothing
//! is checked and the bookkeeping left is one thread-local store per
//! context change.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

use driver_platform::Irql;

use crate::context;
use crate::verifier::ViolationKind;

/// The service an allocation above DISPATCH_LEVEL is reported against.
pub const ALLOC_SERVICE: &str = "ExAllocatePool2 (heap)";
/// The service a free above DISPATCH_LEVEL is reported against.
pub const FREE_SERVICE: &str = "ExFreePool (heap)";

/// Set once the hook has served an allocation: the binary installed it.
static INSTALLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// True while the thread runs driver code (a driver's context, outside
    /// the host's own services).
    static IN_DRIVER: Cell<bool> = const { Cell::new(false) };
    /// The highest IRQL (raw level) of an allocation noted and not yet
    /// reported; 0 when none.
    static PENDING_ALLOC: Cell<u8> = const { Cell::new(0) };
    /// The same for frees.
    static PENDING_FREE: Cell<u8> = const { Cell::new(0) };
    /// Allocations and reallocations this thread has made, for
    /// [`thread_allocations`].
    static THREAD_ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// Allocations and reallocations the calling thread has made through
/// [`DriverHeapCheck`] so far (0 where it is not installed): a test takes
/// the difference around a call that must not allocate.
pub fn thread_allocations() -> u64 {
    THREAD_ALLOCATIONS.try_with(Cell::get).unwrap_or(0)
}

/// True if this binary's global allocator is [`DriverHeapCheck`].
pub fn is_installed() -> bool {
    // Make sure at least one allocation has gone through the allocator.
    drop(std::hint::black_box(Box::new(0u8)));
    INSTALLED.load(Ordering::Relaxed)
}

/// Marks whether the thread runs driver code; returns the previous mark.
/// [`context::enter`] and its guard call this.
pub(crate) fn set_in_driver(in_driver: bool) -> bool {
    IN_DRIVER.replace(in_driver)
}

/// Runs the host's own code (a service a driver calls, the device model
/// behind a register) inside a driver's context: its allocations are the
/// host's, not the driver's, and are not checked. Restores the mark on
/// drop.
#[derive(Debug)]
#[must_use = "the host section ends as soon as the guard is dropped"]
pub struct HostCode {
    previous: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl HostCode {
    /// Enters a host section on the calling thread.
    pub fn enter() -> Self {
        Self {
            previous: set_in_driver(false),
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for HostCode {
    fn drop(&mut self) {
        set_in_driver(self.previous);
    }
}

/// Notes a heap call above DISPATCH_LEVEL in driver code. Touches only
/// constant-initialised thread-locals without destructors, so it never
/// allocates.
fn note(slot: &'static std::thread::LocalKey<Cell<u8>>) {
    if core::ptr::eq(slot, &PENDING_ALLOC) {
        let _ = THREAD_ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
    }
    // Read first: a store on every allocation would bounce the line
    // between cores.
    if !INSTALLED.load(Ordering::Relaxed) {
        INSTALLED.store(true, Ordering::Relaxed);
    }
    let in_driver = IN_DRIVER.try_with(Cell::get).unwrap_or(false);
    if !in_driver {
        return;
    }
    let level = crate::irql::current().level();
    if level > Irql::DISPATCH.level() {
        let _ = slot.try_with(|pending| pending.set(pending.get().max(level)));
    }
}

/// Reports what was noted, if the thread is back at DISPATCH_LEVEL or
/// below: called by the host where an ISR's level ends and where a
/// driver's context is left, while that context is still current so the
/// violation is charged to the driver.
pub(crate) fn report_pending() {
    if crate::irql::current() > Irql::DISPATCH {
        return;
    }
    let alloc = PENDING_ALLOC.replace(0);
    let free = PENDING_FREE.replace(0);
    if alloc == 0 && free == 0 {
        return;
    }
    // Reporting allocates: that is the host's.
    let _host = HostCode::enter();
    for (service, at) in [(ALLOC_SERVICE, alloc), (FREE_SERVICE, free)] {
        if at != 0 {
            context::report(ViolationKind::IrqlTooHigh {
                service,
                at,
                max: Irql::DISPATCH.level(),
            });
        }
    }
}

/// The checking global allocator: [`System`] plus the note above. Install
/// it with [`install_driver_heap_check!`](crate::install_driver_heap_check).
#[derive(Debug, Clone, Copy, Default)]
pub struct DriverHeapCheck;

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees are ours; `note` only reads and
// writes thread-local integers and never allocates, so it cannot re-enter
// the allocator.
unsafe impl GlobalAlloc for DriverHeapCheck {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(&PENDING_ALLOC);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which
        // is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(&PENDING_ALLOC);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(&PENDING_ALLOC);
        // SAFETY: the caller upholds `GlobalAlloc::realloc`'s contract: `ptr`
        // came from this allocator, i.e. from `System`, with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(&PENDING_FREE);
        // SAFETY: `ptr` came from this allocator (so from `System`) with
        // `layout`, as the caller guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Installs [`DriverHeapCheck`] as the binary's global allocator: one line
/// at the top of a test binary (or main job) that boots drivers.
#[macro_export]
macro_rules! install_driver_heap_check {
    () => {
        #[global_allocator]
        static DRIVER_HEAP_CHECK: $crate::alloc_hook::DriverHeapCheck =
            $crate::alloc_hook::DriverHeapCheck;
    };
}
