//! The `driver_platform` traits on WDF and WDM: what the core is
//! instantiated with on Windows ([`WdfPlatform`]).
//!
//! | trait | here | Windows |
//! |---|---|---|
//! | `RawMutex` (spin lock) | `kmdf_platform::sync::KernelSpinLock` | `KSPIN_LOCK`, `KeAcquireSpinLockRaiseToDpc`/`KeReleaseSpinLock`; `try_lock`: `KeTryToAcquireSpinLockAtDpcLevel` at DISPATCH_LEVEL |
//! | `RawRwLock` (reader-writer spin lock) | [`KernelRwSpinLock`] | `EX_SPIN_LOCK`, `ExAcquireSpinLockShared`/`Exclusive`, `ExReleaseSpinLockShared`/`Exclusive`; the `try_` forms: `ExTryAcquireSpinLockShared`/`ExclusiveAtDpcLevel` at DISPATCH_LEVEL |
//! | `Mmio` | [`Bar0`] | the `MmMapIoSpaceEx` mapping, volatile reads and writes |
//! | `DmaAdapter`, `CommonBuffer` | [`WdfDma`], [`WdfCommonBuffer`] | `WDFDMAENABLER`, `WdfCommonBufferCreate` |
//! | `MemoryLocker`, `LockedPages`, `DmaMapping` | [`MdlLocker`], [`LockedMdl`], [`SgMapping`] | `IoAllocateMdl` + `MmProbeAndLockPages` (in the SEH shim), `MmUnlockPages`/`IoFreeMdl`; `BuildScatterGatherList` into a caller-supplied buffer, `PutScatterGatherList` |
//! | `Deferred` | [`WdfDeferred`] | the interrupt's DPC, a `WDFWORKITEM`, a `WDFTIMER` |
//! | `Registry` | [`WdfRegistry`] | `WdfDriverOpenParametersRegistryKey`, `WdfDeviceOpenRegistryKey` (DWORDs) |
//! | `Request` | `kmdf_platform::request::WdfRequest` | `WDFREQUEST` |
//! | `IrqlQuery` | `kmdf_platform::event::KeIrql` | `KeGetCurrentIrql` |
//! | `Event` | `kmdf_platform::event::KernelEvent` | a notification `KEVENT` |
//! | `CallerProcess` | [`WdfCaller`] | the requesting process (`PsGetCurrentProcessId` in `EvtIoInCallerContext`): its MDL locker; a doorbell page by `IoAllocateMdl` over the page of the BAR0 mapping + `MmBuildMdlForNonPagedPool` + `MmMapLockedPagesSpecifyCache(UserMode, MmNonCached)` (in the shim), undone by `MmUnmapLockedPages` + `IoFreeMdl` |
//!
//! **SEH.** `MmProbeAndLockPages` (bad address) and a `UserMode`
//! `MmMapLockedPagesSpecifyCache` (no room) raise instead of returning a
//! status; Rust cannot catch SEH, so those two calls are made by a small C
//! shim under `__try` (`probe.c`, compiled by `build.rs` with `cc`).
//!
//! **Why `BuildScatterGatherList`.** Registrations are long-lived (until
//! deregistration), so the mapping must not hold adapter resources other
//! transfers need. A scatter/gather list built into a buffer the driver
//! supplies (`CalculateScatterGatherList` sizes it) on the 64-bit
//! scatter/gather enabler needs no map registers, so it can be kept
//! indefinitely and put back with `PutScatterGatherList` at
//! deregistration; its buffer is the driver's, so nothing is allocated at
//! DISPATCH_LEVEL by the HAL. `MapTransferEx` needs map registers
//! allocated with `AllocateAdapterChannelEx` and held for the mapping's
//! life — packet-style DMA, not registrations — and `GetScatterGatherList`
//! allocates the list from pool on every call. The HAL may coalesce pages
//! contiguous in bus space into one element; `crate::sg_pages` splits the
//! elements back into one bus address per page (portable and tested on
//! every host). Ranges above [`MAP_CHUNK`] are mapped as several lists.
//! The execution routine runs before `BuildScatterGatherList` returns for
//! such an adapter; if it ever did not, the mapping is refused (nothing
//! here waits) and the routine puts the late list back itself.

use alloc::boxed::Box;
use alloc::vec::Vec;
use core::cell::UnsafeCell;
use core::ptr;
use core::sync::atomic::{AtomicPtr, AtomicU8, Ordering};

use driver_platform::{
    CommonBuffer, Deferred, DmaAdapter, DmaMapping, Irql, IrqlQuery, LockedPages, MemoryLocker,
    Mmio, NtStatus, Platform, RegValue, Registry, RegistryKey, RequestorMode,
};
use kmdf_platform::event::{KeIrql, KernelEvent};
use kmdf_platform::request::WdfRequest;
use kmdf_platform::string::WideString;
use kmdf_platform::sync::{KernelSpinLock, at_dispatch, try_at_dispatch};
use wdk_sys::ntddk::{
    ExAcquireSpinLockExclusive, ExAcquireSpinLockShared, ExReleaseSpinLockExclusive,
    ExReleaseSpinLockShared, ExTryAcquireSpinLockExclusiveAtDpcLevel,
    ExTryAcquireSpinLockSharedAtDpcLevel, IoAllocateMdl, IoFreeMdl, KeGetCurrentProcessorNumberEx,
    KeQueryInterruptTimePrecise, MmBuildMdlForNonPagedPool, MmIsAddressValid, MmUnlockPages,
    MmUnmapLockedPages, PsGetCurrentProcessId,
};
use wdk_sys::{
    _MODE, _WDF_DMA_DIRECTION, BOOLEAN, EX_SPIN_LOCK, FALSE, HANDLE, KIRQL, KPROCESSOR_MODE,
    LONGLONG, NTSTATUS, PDEVICE_OBJECT, PDMA_ADAPTER, PIRP, PMDL, PSCATTER_GATHER_LIST, PVOID,
    SCATTER_GATHER_LIST, TRUE, ULONG, WDF_NO_OBJECT_ATTRIBUTES, WDFCOMMONBUFFER, WDFDEVICE,
    WDFDMAENABLER, WDFINTERRUPT, WDFKEY, WDFOBJECT, WDFTIMER, WDFWORKITEM,
    call_unsafe_wdf_function_binding,
};

use crate::sg_pages;

/// `STATUS_NOT_SUPPORTED`.
const NOT_SUPPORTED: NtStatus = NtStatus::from_raw(0xC000_00BB);

/// The WDF implementation of the platform.
#[derive(Debug, Clone, Copy, Default)]
pub struct WdfPlatform;

impl Platform for WdfPlatform {
    type RawSpinLock = KernelSpinLock;
    type RawRwSpinLock = KernelRwSpinLock;
    type Mmio = Bar0;
    type Dma = WdfDma;
    type Locker = MdlLocker;
    type Deferred = WdfDeferred;
    type Registry = WdfRegistry;
    type Request = WdfRequest;
    type Irql = KeIrql;
    type Event = KernelEvent;
    type Caller = WdfCaller;
}

// ---------------------------------------------------------------------------
// Reader-writer spin lock

/// The most logical processors Windows supports (32 groups of 64): the
/// bound of `KeGetCurrentProcessorNumberEx`'s system-wide index.
const MAX_PROCESSORS: usize = 2048;

/// An `EX_SPIN_LOCK` as a `lock_api::RawRwLock`: both modes raise to
/// DISPATCH_LEVEL, and releasing restores the IRQL the holder came from.
///
/// Readers are many, so the IRQL a shared holder came from is kept per
/// processor: a holder runs at DISPATCH_LEVEL and cannot migrate, and one
/// processor holds the lock shared at most once (no recursive
/// acquisition, the `EX_SPIN_LOCK` rule), so the slot of the processor it
/// acquired on is its own until it releases. 2 KiB per lock; the core has
/// one per device.
///
/// # Invariants
/// `shared_old_irql[p]` is written by the shared holder on processor `p`
/// right after acquiring and read by it when releasing; `exclusive_old_irql`
/// likewise by the one exclusive holder.
pub struct KernelRwSpinLock {
    lock: UnsafeCell<EX_SPIN_LOCK>,
    exclusive_old_irql: AtomicU8,
    shared_old_irql: [AtomicU8; MAX_PROCESSORS],
}

impl core::fmt::Debug for KernelRwSpinLock {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        // Not the 2048 per-processor slots.
        f.debug_struct("KernelRwSpinLock").finish_non_exhaustive()
    }
}

// SAFETY: an EX_SPIN_LOCK is made to be shared between processors; the
// cell is only touched through the kernel's Ex*SpinLock* routines.
unsafe impl Sync for KernelRwSpinLock {}
// SAFETY: as above; a released spin lock may move between threads.
unsafe impl Send for KernelRwSpinLock {}

impl KernelRwSpinLock {
    /// The calling processor's slot. Called at DISPATCH_LEVEL (holding the
    /// lock), so the processor cannot change under it.
    fn processor_slot(&self) -> &AtomicU8 {
        // SAFETY: a null PROCESSOR_NUMBER pointer asks for the index only
        // (documented); callable at any IRQL.
        let index = unsafe { KeGetCurrentProcessorNumberEx(ptr::null_mut()) } as usize;
        &self.shared_old_irql[index % MAX_PROCESSORS]
    }
}

// SAFETY: `ExAcquireSpinLockExclusive` excludes every other holder and
// `ExAcquireSpinLockShared` every exclusive one until the matching release;
// the kernel's routines give acquire/release ordering.
unsafe impl lock_api::RawRwLock for KernelRwSpinLock {
    // A zeroed EX_SPIN_LOCK is a released one (the documented initial value).
    const INIT: Self = Self {
        lock: UnsafeCell::new(0),
        exclusive_old_irql: AtomicU8::new(0),
        shared_old_irql: [const { AtomicU8::new(0) }; MAX_PROCESSORS],
    };
    type GuardMarker = lock_api::GuardNoSend;

    fn lock_shared(&self) {
        // SAFETY: `self.lock` is a valid EX_SPIN_LOCK in nonpaged memory (the
        // device context); the caller is at DISPATCH_LEVEL or below and does
        // not hold it (the core's lock contract).
        let old = unsafe { ExAcquireSpinLockShared(self.lock.get()) };
        self.processor_slot().store(old, Ordering::Relaxed);
    }

    fn try_lock_shared(&self) -> bool {
        // SAFETY: as in `lock_shared`, tried at DISPATCH_LEVEL as the
        // routine requires (`try_at_dispatch` raised there).
        let acquired = try_at_dispatch(|| unsafe {
            ExTryAcquireSpinLockSharedAtDpcLevel(self.lock.get()) != 0
        });
        match acquired {
            Some(old) => {
                // At DISPATCH_LEVEL, so still on the acquiring processor.
                self.processor_slot().store(old, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    unsafe fn unlock_shared(&self) {
        let old: KIRQL = self.processor_slot().load(Ordering::Relaxed);
        // SAFETY: the caller holds the lock shared (lock_api contract) on
        // this processor, and `old` is the IRQL it came from (invariants).
        unsafe { ExReleaseSpinLockShared(self.lock.get(), old) };
    }

    fn lock_exclusive(&self) {
        // SAFETY: as in `lock_shared`.
        let old = unsafe { ExAcquireSpinLockExclusive(self.lock.get()) };
        self.exclusive_old_irql.store(old, Ordering::Relaxed);
    }

    fn try_lock_exclusive(&self) -> bool {
        // SAFETY: as in `try_lock_shared`.
        let acquired = try_at_dispatch(|| unsafe {
            ExTryAcquireSpinLockExclusiveAtDpcLevel(self.lock.get()) != 0
        });
        match acquired {
            Some(old) => {
                self.exclusive_old_irql.store(old, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    unsafe fn unlock_exclusive(&self) {
        let old: KIRQL = self.exclusive_old_irql.load(Ordering::Relaxed);
        // SAFETY: the caller holds the lock exclusive (lock_api contract),
        // and `old` is the IRQL it came from (invariants).
        unsafe { ExReleaseSpinLockExclusive(self.lock.get(), old) };
    }
}

// ---------------------------------------------------------------------------
// BAR0

/// BAR0 as mapped by `MmMapIoSpaceEx` in prepare-hardware.
///
/// # Invariants
/// `base` maps `len` bytes of the device's register space, non-cached,
/// until the owner unmaps it in release-hardware, after the core stopped.
#[derive(Debug)]
pub struct Bar0 {
    base: *mut u8,
    len: u64,
}

// SAFETY: register accesses are volatile single loads and stores on MMIO,
// valid from any processor.
unsafe impl Send for Bar0 {}
// SAFETY: as above.
unsafe impl Sync for Bar0 {}

impl Bar0 {
    /// Wraps a mapping.
    ///
    /// # Safety
    /// `base` maps `len` bytes of the device's BAR0 for as long as the
    /// returned value is used.
    pub unsafe fn new(base: *mut u8, len: u64) -> Self {
        Self { base, len }
    }

    /// The mapping, for `MmUnmapIoSpace`.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    fn in_range(&self, offset: u64, width: u64) -> bool {
        offset.is_multiple_of(width) && offset.checked_add(width).is_some_and(|end| end <= self.len)
    }
}

impl Mmio for Bar0 {
    fn len(&self) -> u64 {
        self.len
    }

    fn read32(&self, offset: u64) -> u32 {
        if !self.in_range(offset, 4) {
            return u32::MAX;
        }
        // SAFETY: in range and aligned (checked), within the live mapping
        // (type invariants); `READ_REGISTER_ULONG` is this volatile load.
        unsafe { ptr::read_volatile(self.base.wrapping_add(offset as usize).cast::<u32>()) }
    }

    fn write32(&self, offset: u64, value: u32) {
        if self.in_range(offset, 4) {
            // SAFETY: as in `read32`.
            unsafe {
                ptr::write_volatile(self.base.wrapping_add(offset as usize).cast::<u32>(), value)
            };
        }
    }

    fn read64(&self, offset: u64) -> u64 {
        if !self.in_range(offset, 8) {
            return u64::MAX;
        }
        // SAFETY: as in `read32`.
        unsafe { ptr::read_volatile(self.base.wrapping_add(offset as usize).cast::<u64>()) }
    }

    fn write64(&self, offset: u64, value: u64) {
        if self.in_range(offset, 8) {
            // SAFETY: as in `read32`; one 64-bit store (x64, arm64).
            unsafe {
                ptr::write_volatile(self.base.wrapping_add(offset as usize).cast::<u64>(), value)
            };
        }
    }
}

// ---------------------------------------------------------------------------
// DMA

/// The device's DMA enabler.
#[derive(Debug, Clone, Copy)]
pub struct WdfDma {
    enabler: WDFDMAENABLER,
    /// The device's WDM object, for `BuildScatterGatherList`.
    device_object: PDEVICE_OBJECT,
}

// SAFETY: a WDF handle is valid from any thread; the framework serialises
// what needs it.
unsafe impl Send for WdfDma {}
// SAFETY: as above.
unsafe impl Sync for WdfDma {}

impl WdfDma {
    /// Wraps the enabler `EvtDriverDeviceAdd` created for `device`.
    ///
    /// # Safety
    /// `device` is a live framework device and `enabler` its DMA enabler.
    pub unsafe fn new(enabler: WDFDMAENABLER, device: WDFDEVICE) -> Self {
        // SAFETY: a live device (caller); its WDM object lives as long as
        // it does.
        let device_object =
            unsafe { call_unsafe_wdf_function_binding!(WdfDeviceWdmGetDeviceObject, device) };
        Self {
            enabler,
            device_object,
        }
    }

    /// Frees a common buffer (`WdfObjectDelete`). PASSIVE_LEVEL.
    pub fn free_common(&self, buffer: WdfCommonBuffer) {
        // SAFETY: `buffer.handle` is a live common buffer this adapter
        // created; it is consumed, so nothing uses it afterwards.
        unsafe { call_unsafe_wdf_function_binding!(WdfObjectDelete, buffer.handle as WDFOBJECT) };
    }
}

/// A common buffer.
///
/// # Invariants
/// `va` maps `len` bytes that the device reaches at `bus`, until the buffer
/// is deleted by [`WdfDma::free_common`].
#[derive(Debug)]
pub struct WdfCommonBuffer {
    handle: WDFCOMMONBUFFER,
    va: *mut u8,
    bus: u64,
    len: usize,
}

// SAFETY: common-buffer memory is non-paged and shared by design; accesses
// go through bounds-checked volatile copies, each aligned piece one access.
unsafe impl Send for WdfCommonBuffer {}
// SAFETY: as above.
unsafe impl Sync for WdfCommonBuffer {}

impl CommonBuffer for WdfCommonBuffer {
    fn bus_address(&self) -> u64 {
        self.bus
    }

    fn len(&self) -> usize {
        self.len
    }

    /// Word by word (see [`copy_from_shared`]); no ordering of its own: the
    /// core orders with `dma_rmb` (the trait's contract).
    fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        if offset
            .checked_add(out.len())
            .is_none_or(|end| end > self.len)
        {
            return false;
        }
        copy_from_shared(self.va.wrapping_add(offset), out);
        true
    }

    /// Word by word (see [`copy_to_shared`]); the core orders with
    /// `dma_wmb` before publishing (the trait's contract).
    fn write(&self, offset: usize, data: &[u8]) -> bool {
        if offset
            .checked_add(data.len())
            .is_none_or(|end| end > self.len)
        {
            return false;
        }
        copy_to_shared(data, self.va.wrapping_add(offset));
        true
    }
}

/// Bytes `at` may move in one naturally aligned volatile access (8, 4 or
/// 1), with `left` bytes still to copy.
fn access_width(at: *const u8, left: usize) -> usize {
    let addr = at as usize;
    if left >= 8 && addr.is_multiple_of(8) {
        8
    } else if left >= 4 && addr.is_multiple_of(4) {
        4
    } else {
        1
    }
}

/// Copies device-shared memory at `src` into `out` with volatile loads,
/// each naturally aligned 8- or 4-byte piece as one access, in ascending
/// address order (as the simulated host's frames do): a doorbell record or
/// an owner word is never split. The caller guarantees that
/// `src..src + out.len()` lies in a live common buffer.
fn copy_from_shared(src: *const u8, out: &mut [u8]) {
    let mut done = 0;
    while done < out.len() {
        let at = src.wrapping_add(done);
        let width = access_width(at, out.len() - done);
        let piece = &mut out[done..done + width];
        match width {
            8 => {
                // SAFETY: `at` is 8-aligned (checked) and within the live
                // buffer (the caller's guarantee).
                let word = unsafe { ptr::read_volatile(at.cast::<u64>()) };
                piece.copy_from_slice(&word.to_ne_bytes());
            }
            4 => {
                // SAFETY: `at` is 4-aligned (checked) and within the buffer.
                let word = unsafe { ptr::read_volatile(at.cast::<u32>()) };
                piece.copy_from_slice(&word.to_ne_bytes());
            }
            _ => {
                // SAFETY: `at` is within the buffer.
                piece[0] = unsafe { ptr::read_volatile(at) };
            }
        }
        done += width;
    }
}

/// Copies `data` into device-shared memory at `dst` with volatile stores,
/// as [`copy_from_shared`] reads. The caller guarantees that
/// `dst..dst + data.len()` lies in a live common buffer.
fn copy_to_shared(data: &[u8], dst: *mut u8) {
    let mut done = 0;
    while done < data.len() {
        let at = dst.wrapping_add(done);
        let width = access_width(at, data.len() - done);
        let piece = &data[done..done + width];
        if let Ok(bytes) = <[u8; 8]>::try_from(piece) {
            // SAFETY: `at` is 8-aligned (checked) and within the live
            // buffer (the caller's guarantee).
            unsafe { ptr::write_volatile(at.cast::<u64>(), u64::from_ne_bytes(bytes)) };
        } else if let Ok(bytes) = <[u8; 4]>::try_from(piece) {
            // SAFETY: `at` is 4-aligned (checked) and within the buffer.
            unsafe { ptr::write_volatile(at.cast::<u32>(), u32::from_ne_bytes(bytes)) };
        } else {
            // SAFETY: `at` is within the buffer.
            unsafe { ptr::write_volatile(at, piece[0]) };
        }
        done += width;
    }
}

impl DmaAdapter for WdfDma {
    type Buffer = WdfCommonBuffer;
    type Pages = LockedMdl;
    type Mapping = SgMapping;

    fn page_size(&self) -> usize {
        4096
    }

    fn alloc_common(&self, len: usize) -> Result<WdfCommonBuffer, NtStatus> {
        let mut handle: WDFCOMMONBUFFER = ptr::null_mut();
        // SAFETY: `self.enabler` is the device's live enabler; PASSIVE_LEVEL
        // (the trait's contract); `handle` is a valid out pointer.
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfCommonBufferCreate,
                self.enabler,
                len,
                WDF_NO_OBJECT_ATTRIBUTES,
                &mut handle
            )
        };
        if status < 0 {
            return Err(NtStatus::from_raw(status as u32));
        }
        // SAFETY: `handle` is the live buffer just created.
        let va = unsafe {
            call_unsafe_wdf_function_binding!(WdfCommonBufferGetAlignedVirtualAddress, handle)
        };
        // SAFETY: as above.
        let logical = unsafe {
            call_unsafe_wdf_function_binding!(WdfCommonBufferGetAlignedLogicalAddress, handle)
        };
        // SAFETY: `QuadPart` is the whole 64-bit value of the
        // PHYSICAL_ADDRESS union; every bit pattern is valid.
        let bus = unsafe { logical.QuadPart } as u64;
        let buffer = WdfCommonBuffer {
            handle,
            va: va.cast::<u8>(),
            bus,
            len,
        };
        // WdfCommonBufferCreate does not promise zeroed memory; the trait does.
        // SAFETY: `va` maps `len` bytes of the buffer just created.
        unsafe { ptr::write_bytes(buffer.va, 0, len) };
        Ok(buffer)
    }

    fn map(&self, pages: &LockedMdl) -> Result<SgMapping, NtStatus> {
        // The device writes into writable registrations (reads from the
        // device's point of view); the duplex enabler has one adapter per
        // direction.
        let direction = if pages.writable {
            _WDF_DMA_DIRECTION::WdfDmaDirectionReadFromDevice
        } else {
            _WDF_DMA_DIRECTION::WdfDmaDirectionWriteToDevice
        };
        // SAFETY: the device's live enabler; callable at DISPATCH_LEVEL.
        let adapter = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfDmaEnablerWdmGetDmaAdapter,
                self.enabler,
                direction
            )
        };
        if adapter.is_null() {
            return Err(NOT_SUPPORTED);
        }
        let mut mapping = SgMapping {
            chunks: Vec::new(),
            pages: Vec::new(),
        };
        if mapping.pages.try_reserve_exact(pages.page_count()).is_err() {
            return Err(INSUFFICIENT_RESOURCES);
        }
        let end = pages.va + pages.len;
        let mut start = pages.va;
        while start < end {
            // Pieces end on MAP_CHUNK boundaries (page multiples), so no
            // page is split between two lists.
            let piece_end = (start - start % MAP_CHUNK)
                .saturating_add(MAP_CHUNK)
                .min(end);
            // A failure drops `mapping`, which puts back the lists built.
            let chunk =
                self.map_chunk(pages, adapter, start, piece_end - start, &mut mapping.pages)?;
            mapping.chunks.push(chunk);
            start = piece_end;
        }
        if mapping.pages.len() != pages.page_count() {
            return Err(INSUFFICIENT_RESOURCES);
        }
        Ok(mapping)
    }

    fn unmap(&self, mapping: SgMapping) {
        // Dropping puts every list back (`PutScatterGatherList`).
        drop(mapping);
    }
}

// ---------------------------------------------------------------------------
// Locking memory (MDLs)

// The SEH shim (`probe.c`, compiled by build.rs): the two kernel routines
// that raise instead of returning a status, called under `__try`.
unsafe extern "C" {
    /// `MmProbeAndLockPages(mdl, access_mode, writable ? IoWriteAccess :
    /// IoReadAccess)`; the exception code on failure (the MDL unlocked).
    fn HcaProbeAndLockPages(mdl: PMDL, access_mode: KPROCESSOR_MODE, writable: BOOLEAN)
    -> NTSTATUS;
    /// `MmMapLockedPagesSpecifyCache(mdl, UserMode, MmNonCached, NULL,
    /// FALSE, NormalPagePriority)` into the current process.
    fn HcaMapLockedPagesToUser(mdl: PMDL, user_va: *mut PVOID) -> NTSTATUS;
}

/// `STATUS_INVALID_PARAMETER`.
const INVALID_PARAMETER: NtStatus = NtStatus::from_raw(0xC000_000D);
/// `STATUS_INSUFFICIENT_RESOURCES`.
const INSUFFICIENT_RESOURCES: NtStatus = NtStatus::from_raw(0xC000_009A);
/// `STATUS_INVALID_DEVICE_STATE`: a step that must run in the caller's
/// process reached from another one, or at too high an IRQL.
const INVALID_DEVICE_STATE: NtStatus = NtStatus::from_raw(0xC000_0184);

/// The current process's id (`PsGetCurrentProcessId`).
pub fn current_process_id() -> u64 {
    // SAFETY: callable at any IRQL; returns the current process's id.
    let id: HANDLE = unsafe { PsGetCurrentProcessId() };
    id as usize as u64
}

/// Locked pages: an MDL from `IoAllocateMdl`, probed and locked by the
/// shim; unlocked (`MmUnlockPages`) and freed (`IoFreeMdl`) when dropped,
/// at DISPATCH_LEVEL or below, from any process context.
///
/// # Invariants
/// `mdl` describes `len` bytes at `va`, its pages locked, until drop.
#[derive(Debug)]
pub struct LockedMdl {
    mdl: PMDL,
    va: u64,
    len: u64,
    writable: bool,
}

// SAFETY: a locked MDL describes resident pages by frame number; it may be
// used and released from any thread.
unsafe impl Send for LockedMdl {}
// SAFETY: nothing mutates it through a shared reference.
unsafe impl Sync for LockedMdl {}

impl Drop for LockedMdl {
    fn drop(&mut self) {
        // SAFETY: the MDL's pages are locked (type invariants); unlocking
        // is allowed at DISPATCH_LEVEL or below in any context.
        unsafe { MmUnlockPages(self.mdl) };
        // SAFETY: the MDL came from IoAllocateMdl and is no longer used.
        unsafe { IoFreeMdl(self.mdl) };
    }
}

impl LockedPages for LockedMdl {
    fn len(&self) -> u64 {
        self.len
    }
    fn byte_offset(&self) -> u32 {
        (self.va % sg_pages::PAGE_SIZE) as u32
    }
    fn page_count(&self) -> usize {
        sg_pages::span_pages(self.va, self.len) as usize
    }
}

/// Locks memory with MDLs. A user-mode lock must run in the process the
/// locker was made for (a [`WdfCaller`]'s), at APC_LEVEL or below; kernel
/// memory (the kernel locker, `Hca::set_kernel_locker`) must be
/// non-paged when locked at DISPATCH_LEVEL, as kernel clients' registered
/// buffers are.
#[derive(Debug, Default, Clone)]
pub struct MdlLocker {
    /// The process whose user memory this locker may lock (none: kernel
    /// memory only).
    process: Option<u64>,
}

impl MdlLocker {
    /// The locker for kernel clients' memory.
    pub fn kernel() -> Self {
        Self { process: None }
    }
}

impl MemoryLocker for MdlLocker {
    type Pages = LockedMdl;

    fn lock(
        &self,
        mode: RequestorMode,
        va: u64,
        len: u64,
        writable: bool,
    ) -> Result<LockedMdl, NtStatus> {
        // IoAllocateMdl describes at most a ULONG of bytes.
        let Ok(length) = ULONG::try_from(len) else {
            return Err(INVALID_PARAMETER);
        };
        if len == 0 || va.checked_add(len).is_none() {
            return Err(INVALID_PARAMETER);
        }
        let access_mode = match mode {
            RequestorMode::User => {
                // User pages: only in the owning process's context, where
                // the address means what the caller meant, and at most at
                // APC_LEVEL (probing may fault).
                if self.process != Some(current_process_id()) || KeIrql.current_irql() > Irql::APC {
                    return Err(INVALID_DEVICE_STATE);
                }
                _MODE::UserMode as KPROCESSOR_MODE
            }
            RequestorMode::Kernel => _MODE::KernelMode as KPROCESSOR_MODE,
        };
        // SAFETY: only describes the range (nothing is touched yet); no IRP.
        let mdl = unsafe {
            IoAllocateMdl(
                va as usize as PVOID,
                length,
                FALSE as BOOLEAN,
                FALSE as BOOLEAN,
                ptr::null_mut(),
            )
        };
        if mdl.is_null() {
            return Err(INSUFFICIENT_RESOURCES);
        }
        // SAFETY: a fresh MDL for this range; the shim turns a bad address
        // into a status; the mode and IRQL were checked above.
        let status = unsafe { HcaProbeAndLockPages(mdl, access_mode, writable as BOOLEAN) };
        if status < 0 {
            // SAFETY: not locked (the shim failed); no one else has it.
            unsafe { IoFreeMdl(mdl) };
            return Err(NtStatus::from_raw(status as u32));
        }
        Ok(LockedMdl {
            mdl,
            va,
            len,
            writable,
        })
    }

    fn read_kernel(&self, va: u64, out: &mut [u8]) -> Result<(), NtStatus> {
        if out.is_empty() {
            return Ok(());
        }
        let Some(last) = va.checked_add(out.len() as u64 - 1) else {
            return Err(INVALID_PARAMETER);
        };
        // 64-bit Windows keeps kernel space in the upper half of the
        // canonical address space: a user address is never read here.
        if (va as i64) >= 0 {
            return Err(INVALID_PARAMETER);
        }
        // Every page must be resident now; kernel clients' buffers at
        // DISPATCH_LEVEL are non-paged, so this stays true while copying.
        let mut page = va & !(sg_pages::PAGE_SIZE - 1);
        while page <= last {
            // SAFETY: only asks whether the address would fault now.
            if unsafe { MmIsAddressValid(page as usize as PVOID) } == 0 {
                return Err(INVALID_PARAMETER);
            }
            match page.checked_add(sg_pages::PAGE_SIZE) {
                Some(next) => page = next,
                None => break,
            }
        }
        // SAFETY: the range is kernel memory, every page of it resident
        // (checked above) and non-paged by the CI contract for inline data;
        // `out` is ours, so the two do not overlap.
        unsafe {
            ptr::copy_nonoverlapping(va as usize as *const u8, out.as_mut_ptr(), out.len());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Mapping locked pages for the device (scatter/gather lists)

/// Largest piece of a registration one scatter/gather list describes: the
/// DMA enabler's maximum transfer (`MAX_DMA_TRANSFER`), so no list asks
/// the adapter for more than it was configured for. Page multiple.
const MAP_CHUNK: u64 = hca_miniport_core::mr::MAX_DMA_TRANSFER as u64;

/// One scatter/gather list, built by `BuildScatterGatherList` into
/// `buffer` (sized by `CalculateScatterGatherList`).
///
/// # Invariants
/// `list` is null until the execution routine stored the built list (or
/// [`ABANDONED`] once the builder gave up waiting); a stored list lives in
/// `buffer` until `PutScatterGatherList`.
struct SgChunk {
    adapter: PDMA_ADAPTER,
    write_to_device: bool,
    list: AtomicPtr<SCATTER_GATHER_LIST>,
    buffer: Vec<u8>,
}

/// Marks a chunk whose execution routine had not run when
/// `BuildScatterGatherList` returned: the routine, when it runs, puts the
/// list back and frees the chunk itself.
fn abandoned() -> *mut SCATTER_GATHER_LIST {
    ptr::NonNull::dangling().as_ptr()
}

/// The execution routine (`PDRIVER_LIST_CONTROL`) of
/// `BuildScatterGatherList`: records the list. A 64-bit scatter/gather
/// adapter needs no map registers, so it runs before the builder returns;
/// if it ever runs later, the mapping was already refused and the list is
/// put back here.
unsafe extern "C" fn on_list_built(
    _device: PDEVICE_OBJECT,
    _irp: PIRP,
    list: PSCATTER_GATHER_LIST,
    context: PVOID,
) {
    let chunk = context.cast::<SgChunk>();
    // SAFETY: `context` is the boxed chunk the builder leaked for this
    // call; it is freed only below or by the builder after this stored.
    let stored = unsafe { &(*chunk).list }.compare_exchange(
        ptr::null_mut(),
        list,
        Ordering::AcqRel,
        Ordering::Acquire,
    );
    if stored.is_err() {
        // SAFETY: the builder abandoned the chunk (invariants): this
        // routine owns it now, and the list is the adapter's to take back.
        let chunk = unsafe { Box::from_raw(chunk) };
        put_list(&chunk, list);
    }
}

fn put_list(chunk: &SgChunk, list: PSCATTER_GATHER_LIST) {
    // SAFETY: the adapter is valid while the enabler lives (the device
    // outlives its registrations).
    let operations = unsafe { (*chunk.adapter).DmaOperations };
    // SAFETY: as is the adapter's operations table.
    let put = unsafe { (*operations).PutScatterGatherList };
    if let Some(put) = put {
        // SAFETY: `list` was built by this adapter with this direction and
        // is put back once; DISPATCH_LEVEL as the routine requires.
        at_dispatch(|| unsafe { put(chunk.adapter, list, chunk.write_to_device as BOOLEAN) });
    }
}

/// A registration mapped for the device: its scatter/gather lists (put
/// back when dropped) and the bus address of every page.
pub struct SgMapping {
    chunks: Vec<SgChunk>,
    pages: Vec<u64>,
}

// SAFETY: the lists are the adapter's, usable and releasable from any
// thread at DISPATCH_LEVEL or below.
unsafe impl Send for SgMapping {}
// SAFETY: nothing mutates it through a shared reference.
unsafe impl Sync for SgMapping {}

impl core::fmt::Debug for SgMapping {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SgMapping")
            .field("lists", &self.chunks.len())
            .field("pages", &self.pages.len())
            .finish()
    }
}

impl Drop for SgMapping {
    fn drop(&mut self) {
        for chunk in self.chunks.drain(..) {
            let list = chunk.list.load(Ordering::Acquire);
            put_list(&chunk, list);
        }
    }
}

impl DmaMapping for SgMapping {
    fn page_bus_address(&self, index: usize) -> Option<u64> {
        self.pages.get(index).copied()
    }
    fn page_count(&self) -> usize {
        self.pages.len()
    }
}

impl WdfDma {
    /// Builds one scatter/gather list for `len` bytes at `va` of `pages`
    /// and appends the bus address of each page it spans to `out`.
    fn map_chunk(
        &self,
        pages: &LockedMdl,
        adapter: PDMA_ADAPTER,
        va: u64,
        len: u64,
        out: &mut Vec<u64>,
    ) -> Result<SgChunk, NtStatus> {
        let write_to_device = !pages.writable;
        // SAFETY: the adapter lives with the enabler.
        let operations = unsafe { (*adapter).DmaOperations };
        // SAFETY: as does its operations table.
        let ops = unsafe { &*operations };
        let (Some(calculate), Some(build)) =
            (ops.CalculateScatterGatherList, ops.BuildScatterGatherList)
        else {
            return Err(NOT_SUPPORTED);
        };
        let mut list_bytes: ULONG = 0;
        // SAFETY: `pages.mdl` describes `va..va + len` (a sub-range of the
        // locked MDL); the map-register count is optional.
        let status = unsafe {
            calculate(
                adapter,
                pages.mdl,
                va as usize as PVOID,
                len as ULONG,
                &mut list_bytes,
                ptr::null_mut(),
            )
        };
        if status < 0 {
            return Err(NtStatus::from_raw(status as u32));
        }
        let mut buffer = Vec::new();
        if buffer.try_reserve_exact(list_bytes as usize).is_err() {
            return Err(INSUFFICIENT_RESOURCES);
        }
        buffer.resize(list_bytes as usize, 0u8);
        let chunk = Box::into_raw(Box::new(SgChunk {
            adapter,
            write_to_device,
            list: AtomicPtr::new(ptr::null_mut()),
            buffer,
        }));
        // SAFETY: `chunk` is live (leaked just above); its buffer has the
        // size the adapter asked for and does not move (boxed, not resized).
        let buffer_ptr = unsafe { (*chunk).buffer.as_mut_ptr() };
        // SAFETY: the adapter's own routine on a locked MDL sub-range, the
        // caller-supplied list buffer and this device object; DISPATCH_LEVEL
        // as it requires; `chunk` outlives the execution routine (it frees
        // an abandoned chunk itself).
        let status = at_dispatch(|| unsafe {
            build(
                adapter,
                self.device_object,
                pages.mdl,
                va as usize as PVOID,
                len as ULONG,
                Some(on_list_built),
                chunk.cast(),
                write_to_device as BOOLEAN,
                buffer_ptr.cast(),
                list_bytes,
            )
        });
        if status < 0 {
            // SAFETY: the routine is not called when the build fails; the
            // chunk is still ours alone.
            drop(unsafe { Box::from_raw(chunk) });
            return Err(NtStatus::from_raw(status as u32));
        }
        // SAFETY: `chunk` is live until one side frees it (invariants).
        let built = unsafe { &(*chunk).list }.compare_exchange(
            ptr::null_mut(),
            abandoned(),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        let list = match built {
            Err(list) => list,
            // Deferred (map registers were short): never waited for, since
            // nothing here blocks; the routine cleans up when it runs.
            Ok(_) => return Err(INSUFFICIENT_RESOURCES),
        };
        // SAFETY: the routine stored its list and will not touch the chunk
        // again; it is ours.
        let chunk = unsafe { Box::from_raw(chunk) };
        // SAFETY: the HAL built `list` in our buffer: a count followed by
        // that many elements.
        let header = unsafe { &*list };
        let count = header.NumberOfElements as usize;
        // SAFETY: `count` elements follow the header (see above).
        let elements = unsafe { header.Elements.as_slice(count) };
        let ranges = elements.iter().map(|element| {
            // SAFETY: `QuadPart` is the whole PHYSICAL_ADDRESS.
            let bus = unsafe { element.Address.QuadPart } as u64;
            (bus, u64::from(element.Length))
        });
        if sg_pages::append_bus_pages(va, len, ranges, out).is_err() {
            put_list(&chunk, list);
            return Err(INSUFFICIENT_RESOURCES);
        }
        // Out of its box: the routine is done with the chunk's address, and
        // the list lives in `buffer`'s heap block, which does not move.
        Ok(*chunk)
    }
}

// ---------------------------------------------------------------------------
// Deferred work

/// One device's DPC (the first interrupt's), work item and timer.
#[derive(Debug, Clone, Copy)]
pub struct WdfDeferred {
    interrupt: WDFINTERRUPT,
    work_item: WDFWORKITEM,
    timer: WDFTIMER,
}

// SAFETY: WDF handles are valid from any thread; the routines used are
// documented as callable at the IRQLs the trait allows.
unsafe impl Send for WdfDeferred {}
// SAFETY: as above.
unsafe impl Sync for WdfDeferred {}

impl WdfDeferred {
    /// Wraps the device's objects.
    pub fn new(interrupt: WDFINTERRUPT, work_item: WDFWORKITEM, timer: WDFTIMER) -> Self {
        Self {
            interrupt,
            work_item,
            timer,
        }
    }

    /// Cancels the timer and waits for a running timer routine
    /// (release-hardware, PASSIVE_LEVEL).
    pub fn stop_timer_and_wait(&self) {
        // SAFETY: the timer is live until the device is deleted.
        let _ = unsafe { call_unsafe_wdf_function_binding!(WdfTimerStop, self.timer, TRUE as u8) };
    }
}

impl Deferred for WdfDeferred {
    fn queue_dpc(&self) {
        // SAFETY: the interrupt object lives as long as the device;
        // `WdfInterruptQueueDpcForIsr` may be called at any IRQL.
        let _ = unsafe {
            call_unsafe_wdf_function_binding!(WdfInterruptQueueDpcForIsr, self.interrupt)
        };
    }

    fn queue_work_item(&self) {
        // SAFETY: the work item lives as long as the device; enqueueing an
        // enqueued item is a no-op (coalescing, as the trait says).
        unsafe { call_unsafe_wdf_function_binding!(WdfWorkItemEnqueue, self.work_item) };
    }

    fn set_timer(&self, due_ns: Option<u64>) {
        match due_ns {
            None => {
                // SAFETY: the timer is live; not waiting (DISPATCH_LEVEL).
                let _ = unsafe {
                    call_unsafe_wdf_function_binding!(WdfTimerStop, self.timer, FALSE as u8)
                };
            }
            Some(due) => {
                // Relative due time: negative, in 100 ns units, at least 1.
                let ticks = (due.saturating_sub(self.now_ns()) / 100).max(1);
                let relative: LONGLONG = -(ticks.min(i64::MAX as u64) as i64);
                // SAFETY: the timer is live; re-arming replaces the expiry.
                let _ = unsafe {
                    call_unsafe_wdf_function_binding!(WdfTimerStart, self.timer, relative)
                };
            }
        }
    }

    fn now_ns(&self) -> u64 {
        // The routine stores the performance counter through its
        // argument unconditionally (it is not optional): give it a place.
        let mut performance_counter: u64 = 0;
        // SAFETY: callable at any IRQL; the out pointer is valid.
        let ticks = unsafe { KeQueryInterruptTimePrecise(&mut performance_counter) };
        ticks.saturating_mul(100)
    }
}

// ---------------------------------------------------------------------------
// Registry

/// The driver's `Parameters` key and the device's hardware key. Reads
/// `REG_DWORD` values; other types answer `None` for now.
#[derive(Debug, Clone, Copy)]
pub struct WdfRegistry {
    parameters: WDFKEY,
    device: WDFKEY,
}

// SAFETY: WDF handles are valid from any thread (reads are PASSIVE_LEVEL).
unsafe impl Send for WdfRegistry {}
// SAFETY: as above.
unsafe impl Sync for WdfRegistry {}

impl WdfRegistry {
    /// Wraps keys opened in prepare-hardware (either may be null).
    pub fn new(parameters: WDFKEY, device: WDFKEY) -> Self {
        Self { parameters, device }
    }
}

impl Registry for WdfRegistry {
    fn read(&self, key: RegistryKey, name: &str) -> Option<RegValue> {
        let handle = match key {
            RegistryKey::ServiceParameters => self.parameters,
            RegistryKey::Device => self.device,
        };
        if handle.is_null() {
            return None;
        }
        let mut wide = WideString::new(name)?;
        let unicode = wide.unicode();
        let mut value: ULONG = 0;
        // SAFETY: `handle` is an open key; `unicode` describes `wide`, which
        // outlives the call; PASSIVE_LEVEL (the trait's contract).
        let status = unsafe {
            call_unsafe_wdf_function_binding!(WdfRegistryQueryULong, handle, &unicode, &mut value)
        };
        (status >= 0).then_some(RegValue::Dword(value))
    }
}

// ---------------------------------------------------------------------------
// The calling process

/// The process a user-mode request came from, built in
/// `EvtIoInCallerContext` (`queue::evt_io_in_caller_context`) with
/// `PsGetCurrentProcessId`. Its locker locks that process's memory, and
/// it maps device pages into that process, only while running in it:
/// both check the current process and refuse from any other
/// (`STATUS_INVALID_DEVICE_STATE`) rather than reaching into the wrong
/// address space. The core uses it only in `EvtIoInCallerContext`
/// (`Hca::prepare_user_request`) and at the process's file cleanup; the
/// queued phase of a request uses what was prepared, never a caller.
#[derive(Debug, Clone, Default)]
pub struct WdfCaller {
    process_id: u64,
    locker: MdlLocker,
}

impl WdfCaller {
    /// The caller whose process id is `process_id` (stored in a request's
    /// context by `EvtIoInCallerContext`).
    pub fn new(process_id: u64) -> Self {
        Self {
            process_id,
            locker: MdlLocker {
                process: Some(process_id),
            },
        }
    }
}

/// A BAR page mapped into a process: an MDL built over the page of the
/// kernel's BAR0 mapping (`MmBuildMdlForNonPagedPool`), mapped uncached
/// into the process by the shim.
///
/// # Invariants
/// `mdl` describes one page of the live BAR0 mapping, mapped at `va` in
/// the process `process_id` until `unmap_device_page`.
#[derive(Debug)]
pub struct UserPageMapping {
    va: u64,
    mdl: PMDL,
    process_id: u64,
}

// SAFETY: the mapping is a token: it is undone only in its own process's
// context (checked), from whichever thread that is.
unsafe impl Send for UserPageMapping {}
// SAFETY: nothing mutates it through a shared reference.
unsafe impl Sync for UserPageMapping {}

impl driver_platform::UserMapping for UserPageMapping {
    fn user_va(&self) -> u64 {
        self.va
    }

    fn len(&self) -> u64 {
        sg_pages::PAGE_SIZE
    }
}

impl driver_platform::CallerProcess for WdfCaller {
    type Mmio = Bar0;
    type Locker = MdlLocker;
    type Mapping = UserPageMapping;

    fn process_id(&self) -> u64 {
        self.process_id
    }

    fn current_irql(&self) -> Irql {
        KeIrql.current_irql()
    }

    fn locker(&self) -> &MdlLocker {
        &self.locker
    }

    fn map_device_page(&self, bar: &Bar0, offset: u64) -> Result<UserPageMapping, NtStatus> {
        let page = sg_pages::PAGE_SIZE;
        if !offset.is_multiple_of(page) || offset.checked_add(page).is_none_or(|end| end > bar.len)
        {
            return Err(INVALID_PARAMETER);
        }
        if current_process_id() != self.process_id || KeIrql.current_irql() != Irql::PASSIVE {
            return Err(INVALID_DEVICE_STATE);
        }
        // The page of the kernel's BAR0 mapping (non-cached, live until
        // release-hardware, after the proxy closed every context).
        let kernel_va = bar.base.wrapping_add(offset as usize);
        // SAFETY: describes one page of a live mapping; no IRP.
        let mdl = unsafe {
            IoAllocateMdl(
                kernel_va.cast(),
                page as ULONG,
                FALSE as BOOLEAN,
                FALSE as BOOLEAN,
                ptr::null_mut(),
            )
        };
        if mdl.is_null() {
            return Err(INSUFFICIENT_RESOURCES);
        }
        // SAFETY: the MDL describes resident (I/O space) memory mapped in
        // system space; this fills in its frame numbers.
        unsafe { MmBuildMdlForNonPagedPool(mdl) };
        let mut user_va: PVOID = ptr::null_mut();
        // SAFETY: a built MDL; PASSIVE_LEVEL in the caller's process
        // (checked above); the shim turns the raise into a status.
        let status = unsafe { HcaMapLockedPagesToUser(mdl, &mut user_va) };
        if status < 0 {
            // SAFETY: not mapped; no one else has the MDL.
            unsafe { IoFreeMdl(mdl) };
            return Err(NtStatus::from_raw(status as u32));
        }
        Ok(UserPageMapping {
            va: user_va as usize as u64,
            mdl,
            process_id: self.process_id,
        })
    }

    fn unmap_device_page(&self, mapping: UserPageMapping) {
        if current_process_id() != mapping.process_id {
            // Only the owning process's context can unmap (the proxy's
            // cleanup runs there, also at process exit, and the mapping
            // goes with the process's address space). Freeing the MDL of
            // a still-mapped view would be worse than keeping it.
            return;
        }
        // SAFETY: mapped by `map_device_page` in this process (checked),
        // unmapped once (consumed).
        unsafe { MmUnmapLockedPages(mapping.va as usize as PVOID, mapping.mdl) };
        // SAFETY: no longer mapped anywhere.
        unsafe { IoFreeMdl(mapping.mdl) };
    }
}
