//! Heap accounting for the memory-per-QP measurement: a global allocator
//! over the system's that keeps the number of bytes live. The benchmark
//! binary installs it (`#[global_allocator]` in `main.rs`); the count
//! covers the whole process (the drivers' cores, the simulated host and
//! device), which is what a QP costs here.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// Bytes allocated and not yet freed.
static LIVE: AtomicIsize = AtomicIsize::new(0);
/// Set once the counting allocator served an allocation.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting live bytes.
#[derive(Debug)]
pub struct CountingAlloc;

// SAFETY: every method forwards to `System` with the caller's arguments,
// which upholds `GlobalAlloc`'s contract; the counting is plain atomics
// and never allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        // SAFETY: the caller's layout has a non-zero size (this method's
        // contract), as `System.alloc` requires.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from `System`) with
        // `layout`, this method's contract.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout` and
        // `new_size` is non-zero and fits `isize` (this method's contract).
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

/// Heap bytes live now, if this binary counts them.
pub fn live_bytes() -> Option<isize> {
    INSTALLED
        .load(Ordering::Relaxed)
        .then(|| LIVE.load(Ordering::Relaxed))
}
