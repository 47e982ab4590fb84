//! DMA by the book (the Windows DMA model): the device sees bus addresses
//! handed out by the device's DMA adapter, never CPU physical addresses, and
//! only while a mapping is live.
//!
//! - Rings, contexts and doorbell records live in common buffers
//!   ([`DmaAdapter::alloc_common`]): contiguous in bus space, CPU-accessible
//!   through copy methods.
//! - Common buffers are memory the device reads and writes while the CPU
//!   does: a copy is atomic per aligned 64-bit word at best, and carries no
//!   ordering of its own. The driver orders its accesses with the two named
//!   barriers, [`dma_wmb`] and [`dma_rmb`], exactly where the device needs
//!   them (the PRM's ordering rules, 9.1 and 9.2: WQEs before the doorbell
//!   or doorbell record; the owner byte of a CQE, EQE or command entry
//!   before the rest of it).
//! - Registered memory is locked ([`MemoryLocker::lock`], an MDL on Windows)
//!   and mapped page by page ([`DmaAdapter::map`]); the bus addresses go into
//!   the HCA's translation table. Unmapping before the device stops using
//!   them is the core's responsibility; the platform's IOMMU model faults any
//!   later access.

use core::sync::atomic::{Ordering, fence};

use ib_types::status::NtStatus;

use crate::request::RequestorMode;

/// The barrier before handing memory to the device (Linux `dma_wmb`,
/// rdma-core `udma_to_device_barrier`): every earlier CPU access to DMA
/// memory — the WQEs written, the CQEs read — is ordered before every later
/// write to DMA memory or to a doorbell register. Call it between writing
/// ring entries and publishing them (a doorbell record, a doorbell), and
/// between reading entries and giving their slots back (a consumer
/// record). A release fence: free on x86 (TSO) beyond stopping the
/// compiler, a `dmb` on ARM64.
#[inline]
pub fn dma_wmb() {
    fence(Ordering::Release);
}

/// The barrier after seeing that the device wrote memory (Linux `dma_rmb`,
/// rdma-core `udma_from_device_barrier`): a read of an owner byte or a
/// `done` byte found valid is ordered before every later read of the
/// entry it guards. Without it the rest of the entry may be read stale. An
/// acquire fence.
#[inline]
pub fn dma_rmb() {
    fence(Ordering::Acquire);
}

/// Memory the CPU and the device share: a common buffer.
pub trait CommonBuffer: Send + Sync {
    /// The bus address of byte 0, for the device.
    fn bus_address(&self) -> u64;
    /// Bytes of the buffer.
    fn len(&self) -> usize;
    /// True for an empty buffer.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies bytes out of the buffer (CPU side), word by word: not atomic
    /// as a whole, and unordered with the device's writes (read an entry's
    /// owner byte first, then [`dma_rmb`], then the entry). Out-of-range
    /// reads are a core bug and are refused with `false`, nothing copied.
    fn read(&self, offset: usize, out: &mut [u8]) -> bool;
    /// Copies bytes into the buffer (CPU side), word by word, with no
    /// ordering of its own: [`dma_wmb`] before publishing what was written.
    /// Out-of-range writes are refused with `false`, nothing written.
    fn write(&self, offset: usize, data: &[u8]) -> bool;
}

/// Pages locked in memory for DMA (an MDL).
pub trait LockedPages: Send + Sync {
    /// Bytes described.
    fn len(&self) -> u64;
    /// True for an empty lock.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Offset of the first byte within its page.
    fn byte_offset(&self) -> u32;
    /// Pages spanned.
    fn page_count(&self) -> usize;
}

/// Locks caller memory for DMA (`MmProbeAndLockPages`). PASSIVE_LEVEL only.
pub trait MemoryLocker: Send + Sync {
    /// The lock it hands out.
    type Pages: LockedPages;
    /// Probes and locks `len` bytes at virtual address `va` of the caller
    /// (`mode` says whose address space), for device writes if `writable`.
    fn lock(
        &self,
        mode: RequestorMode,
        va: u64,
        len: u64,
        writable: bool,
    ) -> Result<Self::Pages, NtStatus>;

    /// Copies `out.len()` bytes of kernel memory at virtual address `va`
    /// into `out`: the CPU reading a kernel client's buffer, as the data of
    /// an inline send (copied into the WQE, never seen by the device).
    /// DISPATCH_LEVEL or below; the memory must be resident (non-paged), as
    /// a kernel client's buffers at DISPATCH_LEVEL are. A range that is not
    /// kernel memory is refused and nothing is copied.
    fn read_kernel(&self, va: u64, out: &mut [u8]) -> Result<(), NtStatus>;
}

/// A live mapping of locked pages: one bus address per page.
pub trait DmaMapping: Send + Sync {
    /// The bus address of page `index`, page aligned.
    fn page_bus_address(&self, index: usize) -> Option<u64>;
    /// Pages mapped.
    fn page_count(&self) -> usize;
}

/// A device's DMA adapter (`IoGetDmaAdapter` / a WDF DMA enabler).
pub trait DmaAdapter: Send + Sync {
    /// Its common buffers.
    type Buffer: CommonBuffer;
    /// The locked pages it maps.
    type Pages: LockedPages;
    /// Its mappings.
    type Mapping: DmaMapping;
    /// Bytes of a page (4096 on every platform this stack targets).
    fn page_size(&self) -> usize;
    /// Allocates a zeroed common buffer. PASSIVE_LEVEL only.
    fn alloc_common(&self, len: usize) -> Result<Self::Buffer, NtStatus>;
    /// Maps locked pages for device access. DISPATCH_LEVEL or below.
    fn map(&self, pages: &Self::Pages) -> Result<Self::Mapping, NtStatus>;
    /// Removes a mapping; the device must no longer use it. DISPATCH_LEVEL
    /// or below.
    fn unmap(&self, mapping: Self::Mapping);
}
