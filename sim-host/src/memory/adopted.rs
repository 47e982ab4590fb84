//! Pages of the application's own memory, adopted into a user address
//! space (`AddressSpace::adopt`): the one place the memory model turns a
//! host address it did not allocate into a [`Frame`].
//!
//! Contract (the caller of [`AdoptedFrames::new`] promises it; the public
//! `unsafe fn` `AddressSpace::adopt` passes it on to its caller):
//! - the whole pages are mapped readable and writable in this OS process,
//!   and stay so, never freed or unmapped, for as long as anything can
//!   reach them: until their adoption is released (which is refused while
//!   an MDL lock or an IOMMU mapping still holds a page), or, if the
//!   process exits first, until every lock and mapping of them is gone;
//! - they are not frames the simulator owns (another address space's
//!   allocation, a common buffer): one page of memory is one `Page`;
//! - the application accesses them only as verbs allow: not while a work
//!   request using those bytes is outstanding, so its plain loads and
//!   stores are ordered against the device's atomic accesses by the
//!   doorbell (release) and the completion it polled (acquire), exactly as
//!   on real hardware, where the CPU writes plain and the device by DMA.
//!
//! What the simulator does with them: it only ever accesses words a caller
//! names (a CPU access through the space, a device access through a lock
//! and a mapping), each as a 64-bit atomic (`frame`'s contract); it never
//! frees them (dropping an [`AdoptedFrames`] releases nothing).

use super::PAGE_SIZE;
use super::frame::Frame;

/// `count` adopted pages from the page-aligned host address `first`.
/// Holds an address, not a pointer: the pointer's provenance was exposed
/// when the pages were adopted, and each access rebuilds it from there.
pub(crate) struct AdoptedFrames {
    first: usize,
    count: usize,
}

impl AdoptedFrames {
    /// The `count` pages from `first_page` (page aligned, non-zero, from a
    /// pointer whose provenance the caller exposed).
    ///
    /// # Safety
    /// The module contract holds for those pages.
    pub(crate) unsafe fn new(first_page: usize, count: usize) -> Self {
        debug_assert!(first_page.is_multiple_of(PAGE_SIZE) && first_page != 0);
        Self {
            first: first_page,
            count,
        }
    }

    /// Frame `index`, if the run has it.
    pub(crate) fn get(&self, index: usize) -> Option<&Frame> {
        if index >= self.count {
            return None;
        }
        let address = self.first + index * PAGE_SIZE;
        let frame = std::ptr::with_exposed_provenance::<Frame>(address);
        // SAFETY: by the contract `new`'s caller promised, the page at
        // `address` is mapped, readable and writable, and stays so while
        // this run (reachable from a live `Page`) exists; it is 4 KiB
        // aligned, as `Frame` needs, and `Frame` is 512 `AtomicU64`s, for
        // which every bit pattern is valid. Every access through the
        // reference is atomic (`UnsafeCell` inside, so shared mutation is
        // allowed), and the application's own plain accesses never race
        // with them (the contract's verbs ordering).
        Some(unsafe { &*frame })
    }

    /// Pages in the run.
    pub(crate) fn len(&self) -> usize {
        self.count
    }
}
