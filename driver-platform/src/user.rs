//! The calling user process, as the core sees it while it serves a
//! user-mode request in that process's context.
//!
//! On Windows a user-mode verb arrives through the bus filter's proxy in
//! `EvtIoInCallerContext`: PASSIVE_LEVEL, in the requesting thread, so the
//! "current process" is the caller. The KMDF shell hands the core a
//! [`CallerProcess`] there; it is the only way the core reaches into a
//! process:
//!
//! - [`CallerProcess::locker`] locks the caller's memory for DMA
//!   (`MmProbeAndLockPages` with `UserMode`), for rings and doorbell
//!   records in user memory.
//! - [`CallerProcess::map_device_page`] maps one page of the device's BAR
//!   uncached into the caller (a doorbell/UAR page): `MmMapIoSpaceEx` of
//!   the page's physical address (the shell knows the BAR's translated
//!   resource), an MDL built over it (`IoAllocateMdl` +
//!   `MmBuildMdlForNonPagedPool`), then `MmMapLockedPagesSpecifyCache(mdl,
//!   UserMode, MmNonCached, NULL, FALSE, NormalPagePriority)`, inside a
//!   `__try` because a user mapping can raise. PASSIVE_LEVEL only, in the
//!   caller's context.
//! - [`CallerProcess::unmap_device_page`] undoes it: `MmUnmapLockedPages`,
//!   `IoFreeMdl`, `MmUnmapIoSpace`; PASSIVE_LEVEL, in the owning
//!   process's context (the proxy's file cleanup runs there, also when the
//!   process exits without closing).
//!
//! A caller is cheap to clone (a process reference).

use ib_types::status::NtStatus;

use crate::dma::MemoryLocker;
use crate::irql::Irql;
use crate::mmio::Mmio;

/// A device page mapped into a user process.
pub trait UserMapping: Send + Sync {
    /// The user virtual address of the mapping (page aligned).
    fn user_va(&self) -> u64;
    /// Bytes mapped (one page).
    fn len(&self) -> u64;
    /// True for an empty mapping (never, for a live one).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The user process a request came from (see the module doc).
pub trait CallerProcess: Clone + Send + Sync {
    /// The device's register BAR, whose pages can be mapped.
    type Mmio: Mmio;
    /// Locks the caller's memory.
    type Locker: MemoryLocker;
    /// A device page mapped into the caller.
    type Mapping: UserMapping;

    /// Identifies the process (`PsGetProcessId`): objects a process made
    /// are usable by that process only.
    fn process_id(&self) -> u64;

    /// The IRQL of the calling thread (`KeGetCurrentIrql`): reaching into
    /// a process needs PASSIVE_LEVEL (mapping) or at most APC_LEVEL
    /// (locking pageable memory).
    fn current_irql(&self) -> Irql;

    /// Locks the caller's memory for DMA (with `RequestorMode::User`).
    fn locker(&self) -> &Self::Locker;

    /// Maps the page of `bar` at `offset` (page aligned) uncached into the
    /// caller. PASSIVE_LEVEL only, in the caller's context.
    fn map_device_page(&self, bar: &Self::Mmio, offset: u64) -> Result<Self::Mapping, NtStatus>;

    /// Removes a mapping [`map_device_page`](Self::map_device_page) made.
    /// PASSIVE_LEVEL only, in the owning process's context; a process that
    /// already exited has nothing left to unmap.
    fn unmap_device_page(&self, mapping: Self::Mapping);
}
