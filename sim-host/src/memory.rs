//! Host memory: 4 KiB pages, the kernel pool, and virtual address spaces
//! (one per user process, one for the kernel).
//!
//! Contract:
//! - A [`Page`] is shared (`Arc<Page>`) by everything that can reach it: the
//!   address space that maps it at a virtual address, an MDL that locks it
//!   ([`crate::dma::HostLockedPages`]) and the IOMMU entries that map it for a
//!   device. It lives as long as the longest of them, so freeing memory or
//!   exiting a process never pulls a page from under a lock or a live DMA
//!   mapping (the kernel still owns locked pages, as on Windows).
//! - A page is real memory: a 4 KiB-aligned frame of atomic words
//!   (`frame`), read and written by the CPU and by devices without a lock,
//!   as physical memory is. A copy is atomic per 64-bit word only, so a
//!   reader racing a writer can see part of an old entry and part of a new
//!   one; CPU accesses are relaxed, device accesses are ordered as PCIe
//!   orders them, and drivers order theirs with the named barriers of
//!   `driver_platform::dma` (see `frame`'s contract).
//! - [`AddressSpace`]: page-aligned allocations, each followed by an
//!   unmapped guard page, and virtual addresses are never reused within a
//!   space's life, so an overrun or a use after free is an error, not
//!   silent corruption. A user process's virtual addresses are **real
//!   pointers**: an allocation is one run of frames whose host address is
//!   the address the process sees, so a user-mode provider's raw-pointer
//!   stores reach the same frames the device reaches through the IOMMU
//!   (always as 64-bit atomics, per `frame`'s contract). The kernel's space
//!   keeps simulated addresses that are never dereferenced. CPU accesses
//!   ([`AddressSpace::read`], [`AddressSpace::write`]) outside allocations,
//!   or writes to read-only ones, are refused with a [`MemoryError`] and
//!   touch nothing.
//! - A user space may also **adopt** pages of this OS process's own memory
//!   (`Process::adopt`, an application's buffer for a memory
//!   registration): they join the space at their own addresses and work as
//!   an allocation's pages do, but the application owns them (the
//!   simulator never frees them, `memory/adopted.rs` holds the one
//!   `unsafe` and its contract); overlapping adoptions of a page are
//!   counted, adoptions touching the simulator's own memory are refused,
//!   and releasing one is refused while a lock or a mapping holds a page.
//! - User address spaces live below `0x8000_0000_0000` (host addresses of
//!   this Linux process), the kernel's at [`KERNEL_VA_BASE`] and above, and
//!   device bus addresses ([`crate::dma`]) in the non-canonical range
//!   between: no CPU address is ever a valid bus address.
//! - [`Pool`] is the kernel pool (`ExAllocatePool2` / `ExFreePoolWithTag`):
//!   blocks tracked per driver and tag. Freeing is explicit
//!   ([`Pool::free`]); dropping a [`PoolBlock`] handle without freeing it
//!   leaks the block, exactly as losing a pool pointer does on Windows, and
//!   [`Pool::leaks`] / [`Pool::report_leaks`] list it at driver unload.
//!
//! Nothing here panics on misuse: errors are returned, and pool misuse is
//! also recorded with the [`Verifier`].

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use ib_types::status::NtStatus;

use crate::verifier::{Verifier, ViolationKind};

mod adopted;
mod frame;

use frame::Side;

/// Bytes of a page.
pub const PAGE_SIZE: usize = 4096;

/// [`PAGE_SIZE`] as an address quantity.
const PAGE_BYTES: u64 = PAGE_SIZE as u64;

/// One past the highest user-mode virtual address (the Windows x64 user
/// range ends at `0x7FFF_FFFF_FFFF`; so does x86-64 Linux's, where a
/// process's addresses come from).
pub const USER_VA_LIMIT: u64 = 0x0000_7FFF_FFFF_0000;

/// Lowest kernel virtual address (pool blocks).
pub const KERNEL_VA_BASE: u64 = 0xFFFF_A000_0000_0000;

/// One past the highest kernel virtual address the model hands out.
const KERNEL_VA_LIMIT: u64 = 0xFFFF_FFFF_FFFF_0000;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a test already panicked; keep going so that
    // panic is the one reported.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn read_lock<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn write_lock<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(PoisonError::into_inner)
}

/// Pages needed to hold `len` bytes.
pub(crate) fn pages_for(len: usize) -> usize {
    len.div_ceil(PAGE_SIZE)
}

/// One page of host memory (physical memory, in Windows terms): a real,
/// page-aligned `frame::Frame` the CPU and devices access without a lock.
/// The pages of one allocation share one `frame::FrameRun`.
pub struct Page {
    run: Arc<frame::FrameRun>,
    index: usize,
}

impl fmt::Debug for Page {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the address: debug output stays the same from run to run.
        f.write_str("Page")
    }
}

impl Page {
    /// A new zero-filled page.
    pub fn zeroed() -> Arc<Self> {
        Arc::new(Self {
            run: Arc::new(frame::FrameRun::zeroed(1)),
            index: 0,
        })
    }

    fn frame(&self) -> &frame::Frame {
        // `index` is in the run by construction (`zeroed_pages`).
        self.run
            .get(self.index)
            .unwrap_or_else(|| unreachable!("page {} of a run of {}", self.index, self.run.len()))
    }

    /// CPU copy of `out.len()` bytes from `offset`; false (and nothing
    /// copied) if the range leaves the page.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        self.frame().read(Side::Cpu, offset, out)
    }

    /// CPU copy of `data` to `offset`; false (and nothing copied) if the
    /// range leaves the page.
    pub fn write(&self, offset: usize, data: &[u8]) -> bool {
        self.frame().write(Side::Cpu, offset, data)
    }

    /// Device (DMA) copy out of the page, with the device's ordering.
    pub(crate) fn device_read(&self, offset: usize, out: &mut [u8]) -> bool {
        self.frame().read(Side::Device, offset, out)
    }

    /// Device (DMA) copy into the page, with the device's ordering.
    pub(crate) fn device_write(&self, offset: usize, data: &[u8]) -> bool {
        self.frame().write(Side::Device, offset, data)
    }

    /// Device (DMA) copy of `len` bytes from `from` in this page to `to`
    /// in `dst`, word to word with the device's ordering and no buffer in
    /// between; false (nothing copied) if either range leaves its page.
    /// The two ranges must not overlap (see [`Page::same_allocation`]).
    pub(crate) fn device_copy_to(&self, from: usize, dst: &Page, to: usize, len: usize) -> bool {
        self.frame().copy_to(from, dst.frame(), to, len)
    }

    /// True if both pages belong to one allocation (one run of frames):
    /// only then may a copy between them overlap.
    pub(crate) fn same_allocation(&self, other: &Page) -> bool {
        Arc::ptr_eq(&self.run, &other.run)
    }

    /// Address of the page's first byte in the simulator's own memory
    /// (page aligned; for diagnostics and tests).
    pub fn host_address(&self) -> usize {
        self.frame().address()
    }
}

/// A run of pages, viewed as one buffer (not necessarily adjacent in any
/// address space), shared by everything that holds it.
pub(crate) type PageRun = Arc<[Arc<Page>]>;

/// `count` fresh zero-filled pages, in one allocation of real memory.
pub(crate) fn zeroed_pages(count: usize) -> PageRun {
    pages_of_run(&Arc::new(frame::FrameRun::zeroed(count)), count)
}

/// The first `count` frames of `run` as pages.
fn pages_of_run(run: &Arc<frame::FrameRun>, count: usize) -> PageRun {
    (0..count.min(run.len()))
        .map(|index| {
            Arc::new(Page {
                run: Arc::clone(run),
                index,
            })
        })
        .collect()
}

/// Copies out of a run of pages viewed as one buffer; false (and nothing
/// copied) if `offset..offset+out.len()` leaves the run.
pub(crate) fn read_pages(pages: &[Arc<Page>], offset: usize, out: &mut [u8]) -> bool {
    // The usual access (a WQE, a CQE, a doorbell record) lies in one page.
    let in_page = offset % PAGE_SIZE;
    if in_page + out.len() <= PAGE_SIZE
        && let Some(page) = pages.get(offset / PAGE_SIZE)
    {
        return page.read(in_page, out);
    }
    if !range_within(offset, out.len(), pages.len() * PAGE_SIZE) {
        return false;
    }
    let mut done = 0;
    while done < out.len() {
        let at = offset + done;
        let chunk = (PAGE_SIZE - at % PAGE_SIZE).min(out.len() - done);
        pages[at / PAGE_SIZE].read(at % PAGE_SIZE, &mut out[done..done + chunk]);
        done += chunk;
    }
    true
}

/// Copies into a run of pages viewed as one buffer; false (and nothing
/// copied) if `offset..offset+data.len()` leaves the run.
pub(crate) fn write_pages(pages: &[Arc<Page>], offset: usize, data: &[u8]) -> bool {
    let in_page = offset % PAGE_SIZE;
    if in_page + data.len() <= PAGE_SIZE
        && let Some(page) = pages.get(offset / PAGE_SIZE)
    {
        return page.write(in_page, data);
    }
    if !range_within(offset, data.len(), pages.len() * PAGE_SIZE) {
        return false;
    }
    let mut done = 0;
    while done < data.len() {
        let at = offset + done;
        let chunk = (PAGE_SIZE - at % PAGE_SIZE).min(data.len() - done);
        pages[at / PAGE_SIZE].write(at % PAGE_SIZE, &data[done..done + chunk]);
        done += chunk;
    }
    true
}

/// True when `offset..offset+len` lies within `0..limit`.
pub(crate) fn range_within(offset: usize, len: usize, limit: usize) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= limit)
}

/// Why a memory operation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// Part of the range is not allocated (never was, freed, a guard page,
    /// or the address space is gone).
    #[error("{len} bytes at {va:#x} are not (all) allocated")]
    Unmapped {
        /// Start of the access.
        va: u64,
        /// Bytes of the access.
        len: usize,
    },
    /// A write (or a lock for device writes) touches read-only memory.
    #[error("{len} bytes at {va:#x} include read-only memory")]
    ReadOnly {
        /// Start of the access.
        va: u64,
        /// Bytes of the access.
        len: usize,
    },
    /// `free` of an address that does not start an allocation.
    #[error("{va:#x} does not start an allocation")]
    NotAnAllocation {
        /// The address given.
        va: u64,
    },
    /// An allocation of zero bytes.
    #[error("zero-length allocation")]
    ZeroLength,
    /// The address space has no room left.
    #[error("address space exhausted")]
    Exhausted,
    /// The process has exited; its address space is gone.
    #[error("the process has exited")]
    ProcessExited,
    /// An adoption whose pages overlap memory the simulator owns in the
    /// space (an allocation, its guard page, a freed allocation's or a
    /// device mapping's reserved address).
    #[error("{len} bytes at {va:#x} overlap the simulator's own memory")]
    OverlapsSimulatorMemory {
        /// Start of the range given.
        va: u64,
        /// Bytes of the range given.
        len: usize,
    },
    /// A release of pages that are not (all) adopted.
    #[error("{len} bytes at {va:#x} are not (all) adopted")]
    NotAdopted {
        /// Start of the range given.
        va: u64,
        /// Bytes of the range given.
        len: usize,
    },
    /// A release that would drop an adopted page an MDL lock or a DMA
    /// mapping still holds (a registered buffer's pages belong to the
    /// registration until it is gone).
    #[error("{len} bytes at {va:#x} include adopted pages still locked or mapped")]
    AdoptedPagesInUse {
        /// Start of the range given.
        va: u64,
        /// Bytes of the range given.
        len: usize,
    },
}

impl From<MemoryError> for NtStatus {
    fn from(e: MemoryError) -> Self {
        match e {
            MemoryError::Unmapped { .. } | MemoryError::ReadOnly { .. } => {
                crate::dma::STATUS_ACCESS_VIOLATION
            }
            MemoryError::NotAnAllocation { .. }
            | MemoryError::ZeroLength
            | MemoryError::OverlapsSimulatorMemory { .. }
            | MemoryError::NotAdopted { .. } => NtStatus::INVALID_PARAMETER,
            MemoryError::AdoptedPagesInUse { .. } => NtStatus::DEVICE_BUSY,
            MemoryError::Exhausted => NtStatus::INSUFFICIENT_RESOURCES,
            MemoryError::ProcessExited => NtStatus::INVALID_DEVICE_STATE,
        }
    }
}

/// Whether the CPU (and a DMA lock) may write an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protection {
    /// Readable and writable (`PAGE_READWRITE`).
    ReadWrite,
    /// Readable only (`PAGE_READONLY`); writes and locks for device writes
    /// are refused.
    ReadOnly,
}

#[derive(Debug)]
struct Allocation {
    pages: PageRun,
    protection: Protection,
    /// Paged pool: may be paged out, so touching or locking it is for
    /// APC_LEVEL and below.
    pageable: bool,
    /// Whose memory it is.
    origin: Origin,
}

/// Whose memory an allocation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// The simulator's own frames (`alloc`).
    Simulator,
    /// One page of the application's memory, adopted this many times
    /// (overlapping adoptions of one page share it).
    Adopted { adoptions: usize },
}

impl Allocation {
    fn bytes(&self) -> u64 {
        self.pages.len() as u64 * PAGE_BYTES
    }
}

#[derive(Debug)]
struct SpaceMap {
    /// Keyed by first virtual address.
    allocations: BTreeMap<u64, Allocation>,
    /// How virtual addresses are chosen.
    placement: Placement,
    /// Set when the owning process exited.
    closed: bool,
    /// Device pages mapped into the space (`MmMapLockedPagesSpecifyCache`
    /// of a BAR page), keyed by first virtual address; one page each.
    device_maps: BTreeMap<u64, DeviceMap>,
}

/// How an address space places its allocations.
#[derive(Debug)]
enum Placement {
    /// Simulated addresses from a bump pointer (the kernel's space): no
    /// reuse, never dereferenced.
    Bump {
        /// Where the next allocation starts.
        next_va: u64,
        /// One past the last address handed out.
        limit: u64,
    },
    /// A user space: an allocation's virtual address is the host address
    /// of its first frame, so it is a valid pointer in this Linux process
    /// (a user-mode provider writes rings through it). Freed runs and
    /// device-mapping reservations are kept until the process exits, so
    /// the allocator cannot hand their addresses out again within the
    /// process's life (no reuse, as with the bump pointer).
    Host {
        /// Frames of freed allocations and unmapped device pages.
        retired: Vec<Arc<frame::FrameRun>>,
    },
}

/// A device page mapped into a space.
#[derive(Debug)]
struct DeviceMap {
    page: Arc<dyn DevicePage>,
    /// In a host-placed space, the two frames (page and guard) whose
    /// address the mapping took, so no allocation can take it.
    reservation: Option<Arc<frame::FrameRun>>,
}

impl SpaceMap {
    /// The allocation containing `va`, with its first address.
    fn containing(&self, va: u64) -> Option<(u64, &Allocation)> {
        let (&start, alloc) = self.allocations.range(..=va).next_back()?;
        (va - start < alloc.bytes()).then_some((start, alloc))
    }

    /// Calls `f(allocation, offset in allocation, range of the access)` for
    /// each allocation-contiguous piece of `va..va+len`, in order; an error
    /// (before any call for that piece) if a byte is unmapped or, when
    /// `for_write`, read-only. Call once with a no-op `f` to validate, then
    /// again to act, so an access fails without touching memory.
    fn walk(
        &self,
        va: u64,
        len: usize,
        for_write: bool,
        mut f: impl FnMut(&Allocation, usize, std::ops::Range<usize>),
    ) -> Result<(), MemoryError> {
        let unmapped = MemoryError::Unmapped { va, len };
        if self.closed {
            return Err(MemoryError::ProcessExited);
        }
        let end = va.checked_add(len as u64).ok_or(unmapped)?;
        let mut cursor = va;
        while cursor < end {
            let (start, alloc) = self.containing(cursor).ok_or(unmapped)?;
            if for_write && alloc.protection == Protection::ReadOnly {
                return Err(MemoryError::ReadOnly { va, len });
            }
            let piece_end = end.min(start + alloc.bytes());
            let in_alloc = usize::try_from(cursor - start).map_err(|_| unmapped)?;
            let from = usize::try_from(cursor - va).map_err(|_| unmapped)?;
            let to = usize::try_from(piece_end - va).map_err(|_| unmapped)?;
            f(alloc, in_alloc, from..to);
            cursor = piece_end;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct SpaceShared {
    /// The owning process, or `None` for the kernel.
    pid: Option<u32>,
    map: RwLock<SpaceMap>,
    /// Pages held by live locks (MDLs) taken in this space.
    locked_pages: AtomicUsize,
    /// The same pages by the driver that locked them (`None`: host code),
    /// so a process that exits with pages locked names the driver.
    locked_by: Mutex<BTreeMap<Option<Arc<str>>, usize>>,
    /// Requests the owning process sent to device stacks.
    requests_issued: AtomicU64,
}

/// A virtual address space: a process's user-mode space or the kernel's.
/// Cloning gives another handle to the same space.
#[derive(Debug, Clone)]
pub struct AddressSpace {
    shared: Arc<SpaceShared>,
}

impl AddressSpace {
    fn with_placement(pid: Option<u32>, placement: Placement) -> Self {
        Self {
            shared: Arc::new(SpaceShared {
                pid,
                map: RwLock::new(SpaceMap {
                    allocations: BTreeMap::new(),
                    placement,
                    closed: false,
                    device_maps: BTreeMap::new(),
                }),
                locked_pages: AtomicUsize::new(0),
                locked_by: Mutex::new(BTreeMap::new()),
                requests_issued: AtomicU64::new(0),
            }),
        }
    }

    /// A new, empty kernel address space (addresses from
    /// [`KERNEL_VA_BASE`]). A host has one, owned by its [`Pool`].
    pub fn kernel() -> Self {
        Self::with_placement(
            None,
            Placement::Bump {
                next_va: KERNEL_VA_BASE,
                limit: KERNEL_VA_LIMIT,
            },
        )
    }

    /// A new, empty user address space for process `pid`: its addresses
    /// are host addresses of its frames (see [`Process`]).
    fn user(pid: u32) -> Self {
        Self::with_placement(
            Some(pid),
            Placement::Host {
                retired: Vec::new(),
            },
        )
    }

    /// True for the kernel's space.
    pub fn is_kernel(&self) -> bool {
        self.shared.pid.is_none()
    }

    /// True if both handles name the same space.
    pub fn same_space(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Allocates `len` bytes (rounded up to pages, zero-filled) and returns
    /// the page-aligned virtual address of the first byte.
    pub fn alloc(&self, len: usize, protection: Protection) -> Result<u64, MemoryError> {
        self.alloc_pages(len, protection, false).map(|(va, _)| va)
    }

    /// [`alloc`](Self::alloc), also returning the pages; `pageable` marks
    /// paged pool.
    pub(crate) fn alloc_pages(
        &self,
        len: usize,
        protection: Protection,
        pageable: bool,
    ) -> Result<(u64, PageRun), MemoryError> {
        if len == 0 {
            return Err(MemoryError::ZeroLength);
        }
        let count = pages_for(len);
        let mut map = write_lock(&self.shared.map);
        if map.closed {
            return Err(MemoryError::ProcessExited);
        }
        // One guard page after every allocation, so an overrun faults.
        let (va, pages) = match &mut map.placement {
            Placement::Bump { next_va, limit } => {
                let va = *next_va;
                *next_va = (count as u64)
                    .checked_add(1)
                    .and_then(|n| n.checked_mul(PAGE_BYTES))
                    .and_then(|bytes| va.checked_add(bytes))
                    .filter(|next| next <= limit)
                    .ok_or(MemoryError::Exhausted)?;
                (va, zeroed_pages(count))
            }
            Placement::Host { .. } => {
                // The guard is a real frame of the run that no page maps:
                // a CPU access through the space is refused there, and a
                // stray store through a pointer lands in memory the run
                // owns.
                let count_with_guard = count.checked_add(1).ok_or(MemoryError::Exhausted)?;
                let run = Arc::new(frame::FrameRun::zeroed(count_with_guard));
                let va = run.get(0).map_or(0, frame::Frame::address) as u64;
                (va, pages_of_run(&run, count))
            }
        };
        map.allocations.insert(
            va,
            Allocation {
                pages: Arc::clone(&pages),
                protection,
                pageable,
                origin: Origin::Simulator,
            },
        );
        Ok((va, pages))
    }

    /// Frees the allocation starting at `va` (`VirtualFree(MEM_RELEASE)`).
    /// CPU accesses to it fail from now on; pages still locked by an MDL or
    /// mapped for a device stay alive until those release them.
    pub fn free(&self, va: u64) -> Result<(), MemoryError> {
        let mut map = write_lock(&self.shared.map);
        if map.closed {
            return Err(MemoryError::ProcessExited);
        }
        // Adopted pages are the application's: they leave the space by
        // `release_adoption`, never by a free.
        if map
            .allocations
            .get(&va)
            .is_none_or(|alloc| alloc.origin != Origin::Simulator)
        {
            return Err(MemoryError::NotAnAllocation { va });
        }
        let freed = map
            .allocations
            .remove(&va)
            .ok_or(MemoryError::NotAnAllocation { va })?;
        if let (Placement::Host { retired }, Some(page)) = (&mut map.placement, freed.pages.first())
        {
            retired.push(Arc::clone(&page.run));
        }
        Ok(())
    }

    /// CPU read of `out.len()` bytes at `va`: every byte must be allocated
    /// (an access may span pages, not the guard page after an allocation).
    /// Nothing is copied on error.
    pub fn read(&self, va: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        let map = read_lock(&self.shared.map);
        // The usual access lies in one allocation: one lookup validates it
        // whole (as `walk` would) before a byte is copied.
        if !map.closed
            && let Some((start, alloc)) = map.containing(va)
            && let Some(end) = va.checked_add(out.len() as u64)
            && end <= start + alloc.bytes()
            && let Ok(at) = usize::try_from(va - start)
        {
            if alloc.pageable {
                check_paged_access();
            }
            read_pages(&alloc.pages, at, out);
            return Ok(());
        }
        let mut pageable = false;
        map.walk(va, out.len(), false, |alloc, _, _| {
            pageable |= alloc.pageable
        })?;
        if pageable {
            check_paged_access();
        }
        map.walk(va, out.len(), false, |alloc, at, r| {
            read_pages(&alloc.pages, at, &mut out[r]);
        })
    }

    /// CPU write of `data` at `va`; refused (nothing written) if any byte is
    /// unmapped or read-only.
    pub fn write(&self, va: u64, data: &[u8]) -> Result<(), MemoryError> {
        let map = read_lock(&self.shared.map);
        let mut pageable = false;
        map.walk(va, data.len(), true, |alloc, _, _| {
            pageable |= alloc.pageable
        })?;
        if pageable {
            check_paged_access();
        }
        map.walk(va, data.len(), true, |alloc, at, r| {
            write_pages(&alloc.pages, at, &data[r]);
        })
    }

    /// Locks the pages spanning `va..va+len` (`MmProbeAndLockPages`): every
    /// byte must be allocated, and writable when `for_device_writes`.
    /// Returns the pages, first to last; they count as locked in this space,
    /// by `locked_by`, until [`unlock_pages`](Self::unlock_pages).
    pub(crate) fn lock_pages(
        &self,
        va: u64,
        len: usize,
        for_device_writes: bool,
        locked_by: Option<&Arc<str>>,
    ) -> Result<Vec<Arc<Page>>, MemoryError> {
        if len == 0 {
            return Err(MemoryError::ZeroLength);
        }
        let map = read_lock(&self.shared.map);
        map.walk(va, len, for_device_writes, |_, _, _| {})?;
        let unmapped = MemoryError::Unmapped { va, len };
        let first_page = va / PAGE_BYTES;
        let last_page = (va + len as u64 - 1) / PAGE_BYTES;
        let mut pages = Vec::with_capacity(pages_for(len) + 1);
        for page_no in first_page..=last_page {
            // Validated above: every byte of the range is allocated, and
            // allocations start on pages, so the page holding `addr` is the
            // whole page.
            let addr = (page_no * PAGE_BYTES).max(va);
            let (start, alloc) = map.containing(addr).ok_or(unmapped)?;
            let index = usize::try_from((addr - start) / PAGE_BYTES).map_err(|_| unmapped)?;
            pages.push(Arc::clone(alloc.pages.get(index).ok_or(unmapped)?));
        }
        self.shared
            .locked_pages
            .fetch_add(pages.len(), Ordering::Relaxed);
        *lock(&self.shared.locked_by)
            .entry(locked_by.cloned())
            .or_default() += pages.len();
        Ok(pages)
    }

    /// True if any allocated byte of `va..va+len` is paged pool (unmapped
    /// bytes are left to the caller's own validation).
    pub(crate) fn touches_pageable(&self, va: u64, len: usize) -> bool {
        let map = read_lock(&self.shared.map);
        let end = va.saturating_add(len as u64);
        let first = map.containing(va).map_or(va, |(start, _)| start);
        map.allocations
            .range(first..end)
            .any(|(_, alloc)| alloc.pageable)
    }

    /// Releases `count` pages `locked_by` locked with
    /// [`lock_pages`](Self::lock_pages).
    pub(crate) fn unlock_pages(&self, count: usize, locked_by: Option<&Arc<str>>) {
        let mut by = lock(&self.shared.locked_by);
        if let Some(held) = by.get_mut(&locked_by.cloned()) {
            *held = held.saturating_sub(count);
            if *held == 0 {
                by.remove(&locked_by.cloned());
            }
        }
        drop(by);
        // Saturating: a mismatch is a model bug, and must not underflow.
        let _ = self
            .shared
            .locked_pages
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(count))
            });
    }

    /// Pages currently locked by MDLs taken in this space.
    pub fn locked_pages(&self) -> usize {
        self.shared.locked_pages.load(Ordering::Relaxed)
    }

    /// [`locked_pages`](Self::locked_pages) by the driver that locked
    /// them (`None`: host code), drivers in name order.
    pub fn locked_pages_by_driver(&self) -> Vec<(Option<Arc<str>>, usize)> {
        lock(&self.shared.locked_by)
            .iter()
            .map(|(driver, pages)| (driver.clone(), *pages))
            .collect()
    }

    /// Live allocations (adopted pages not counted).
    pub fn allocation_count(&self) -> usize {
        read_lock(&self.shared.map)
            .allocations
            .values()
            .filter(|alloc| alloc.origin == Origin::Simulator)
            .count()
    }

    /// Pages of the application's memory adopted now.
    pub fn adopted_page_count(&self) -> usize {
        read_lock(&self.shared.map)
            .allocations
            .values()
            .filter(|alloc| alloc.origin != Origin::Simulator)
            .count()
    }

    /// Adopts the whole pages around `addr..addr+len` of this OS process's
    /// memory into this user space (see [`Process::adopt`]); returns the
    /// first page's address. All or nothing.
    ///
    /// # Safety
    /// As [`Process::adopt`].
    unsafe fn adopt(&self, addr: *mut u8, len: usize) -> Result<u64, MemoryError> {
        let va = addr.addr() as u64;
        let pages = adoption_pages(va, len)?;
        let mut map = write_lock(&self.shared.map);
        if map.closed {
            return Err(MemoryError::ProcessExited);
        }
        let Placement::Host { retired } = &map.placement else {
            // Only a process adopts, and a process's space is host-placed.
            return Err(MemoryError::Unmapped { va, len });
        };
        let wanted = (pages.start * PAGE_SIZE)..(pages.end * PAGE_SIZE);
        let overlaps = |run: &frame::FrameRun| {
            let taken = run.host_range();
            taken.start < wanted.end && wanted.start < taken.end
        };
        let simulator_owned = map
            .allocations
            .values()
            .filter(|alloc| alloc.origin == Origin::Simulator)
            .filter_map(|alloc| alloc.pages.first())
            .any(|page| overlaps(&page.run))
            || retired.iter().any(|run| overlaps(run))
            || map
                .device_maps
                .values()
                .filter_map(|device| device.reservation.as_deref())
                .any(overlaps);
        if simulator_owned {
            return Err(MemoryError::OverlapsSimulatorMemory { va, len });
        }
        // The provenance of `addr` covers the application's buffer; the
        // frames rebuild pointers to its pages from their addresses.
        let _ = addr.expose_provenance();
        // Pages not adopted yet, in runs of adjacent ones (one run per
        // stretch, so a device copy within a stretch needs no buffer).
        let mut fresh: Vec<std::ops::Range<usize>> = Vec::new();
        for page_no in pages.clone() {
            let page_va = (page_no * PAGE_SIZE) as u64;
            match map.allocations.get_mut(&page_va) {
                Some(Allocation {
                    origin: Origin::Adopted { adoptions },
                    ..
                }) => *adoptions += 1,
                _ => match fresh.last_mut() {
                    Some(stretch) if stretch.end == page_no => stretch.end += 1,
                    _ => fresh.push(page_no..page_no + 1),
                },
            }
        }
        for stretch in fresh {
            // SAFETY: the caller promised `Process::adopt`'s contract for
            // every page around `addr..addr+len`, which is the contract of
            // `AdoptedFrames::new`; `stretch` lies in them, page aligned
            // and not zero (`adoption_pages`), and none of its pages is a
            // frame of this space (checked above).
            let frames =
                unsafe { adopted::AdoptedFrames::new(stretch.start * PAGE_SIZE, stretch.len()) };
            let run = Arc::new(frame::FrameRun::adopted(frames));
            for (index, page) in pages_of_run(&run, stretch.len()).iter().enumerate() {
                map.allocations.insert(
                    ((stretch.start + index) * PAGE_SIZE) as u64,
                    Allocation {
                        pages: Arc::from([Arc::clone(page)]),
                        protection: Protection::ReadWrite,
                        pageable: false,
                        origin: Origin::Adopted { adoptions: 1 },
                    },
                );
            }
        }
        Ok((pages.start * PAGE_SIZE) as u64)
    }

    /// Ends one adoption of the whole pages around `va..va+len` (see
    /// [`Process::release_adoption`]). All or nothing.
    fn release_adoption(&self, va: u64, len: usize) -> Result<(), MemoryError> {
        let pages = adoption_pages(va, len)?;
        let mut map = write_lock(&self.shared.map);
        if map.closed {
            return Err(MemoryError::ProcessExited);
        }
        // Validate every page first, so a refusal changes nothing.
        for page_no in pages.clone() {
            match map.allocations.get(&((page_no * PAGE_SIZE) as u64)) {
                Some(Allocation {
                    origin: Origin::Adopted { adoptions },
                    pages: held,
                    ..
                }) => {
                    // The last adoption of a page an MDL or an IOMMU
                    // entry still reaches: the registration holds it.
                    let in_use = held.iter().any(|page| Arc::strong_count(page) > 1);
                    if *adoptions == 1 && in_use {
                        return Err(MemoryError::AdoptedPagesInUse { va, len });
                    }
                }
                _ => return Err(MemoryError::NotAdopted { va, len }),
            }
        }
        for page_no in pages {
            let page_va = (page_no * PAGE_SIZE) as u64;
            if let Some(Allocation {
                origin: Origin::Adopted { adoptions },
                ..
            }) = map.allocations.get_mut(&page_va)
            {
                *adoptions -= 1;
                if *adoptions == 0 {
                    map.allocations.remove(&page_va);
                }
            }
        }
        Ok(())
    }

    /// Drops every allocation and refuses all later use; returns the pages
    /// still locked.
    fn close(&self) -> usize {
        let mut map = write_lock(&self.shared.map);
        map.closed = true;
        map.allocations.clear();
        map.device_maps.clear();
        if let Placement::Host { retired } = &mut map.placement {
            retired.clear();
        }
        self.locked_pages()
    }

    /// Maps one device page into this space at a fresh page-aligned
    /// address (followed by a guard page, never reused) and returns it.
    pub(crate) fn map_device(&self, page: Arc<dyn DevicePage>) -> Result<u64, MemoryError> {
        let mut map = write_lock(&self.shared.map);
        if map.closed {
            return Err(MemoryError::ProcessExited);
        }
        let (va, reservation) = match &mut map.placement {
            Placement::Bump { next_va, limit } => {
                let va = *next_va;
                *next_va = va
                    .checked_add(2 * PAGE_BYTES)
                    .filter(|next| next <= limit)
                    .ok_or(MemoryError::Exhausted)?;
                (va, None)
            }
            Placement::Host { .. } => {
                // The address of two real frames (the page and its guard):
                // unique while reserved, never memory the space maps.
                let run = Arc::new(frame::FrameRun::zeroed(2));
                let va = run.get(0).map_or(0, frame::Frame::address) as u64;
                (va, Some(run))
            }
        };
        map.device_maps.insert(va, DeviceMap { page, reservation });
        Ok(va)
    }

    /// Removes the device mapping at `va`.
    pub(crate) fn unmap_device(&self, va: u64) -> Result<(), MemoryError> {
        let mut map = write_lock(&self.shared.map);
        if map.closed {
            return Err(MemoryError::ProcessExited);
        }
        let removed = map
            .device_maps
            .remove(&va)
            .ok_or(MemoryError::NotAnAllocation { va })?;
        if let (Placement::Host { retired }, Some(run)) = (&mut map.placement, removed.reservation)
        {
            retired.push(run);
        }
        Ok(())
    }

    /// Device pages mapped now.
    pub fn device_mapping_count(&self) -> usize {
        read_lock(&self.shared.map).device_maps.len()
    }

    /// A CPU store of 64 bits to a mapped device page (a doorbell): `va`
    /// must lie in a device mapping, 8-byte aligned. Refused otherwise,
    /// with nothing written.
    pub fn write_device64(&self, va: u64, value: u64) -> Result<(), MemoryError> {
        let map = read_lock(&self.shared.map);
        if map.closed {
            return Err(MemoryError::ProcessExited);
        }
        let unmapped = MemoryError::Unmapped { va, len: 8 };
        let (&start, page) = map.device_maps.range(..=va).next_back().ok_or(unmapped)?;
        let offset = va - start;
        if offset + 8 > PAGE_BYTES || !offset.is_multiple_of(8) {
            return Err(unmapped);
        }
        page.page.write64(offset, value);
        Ok(())
    }
}

/// The page numbers (address / [`PAGE_SIZE`]) covering `va..va+len`, for an
/// adoption: non-empty, not page 0, within the user range.
fn adoption_pages(va: u64, len: usize) -> Result<std::ops::Range<usize>, MemoryError> {
    if len == 0 {
        return Err(MemoryError::ZeroLength);
    }
    let unmapped = MemoryError::Unmapped { va, len };
    let end = va
        .checked_add(len as u64)
        .filter(|&end| end <= USER_VA_LIMIT)
        .ok_or(unmapped)?;
    let first = usize::try_from(va / PAGE_BYTES).map_err(|_| unmapped)?;
    let last = usize::try_from(end.div_ceil(PAGE_BYTES)).map_err(|_| unmapped)?;
    if first == 0 {
        return Err(unmapped);
    }
    Ok(first..last)
}

/// A page of device memory (a BAR page) as a process sees it through a
/// mapping: stores go to the device.
pub trait DevicePage: Send + Sync + fmt::Debug {
    /// A 64-bit store at `offset` in the page.
    fn write64(&self, offset: u64, value: u64);
}

/// A user-mode process: an id and its address space. Cloning gives another
/// handle to the same process.
///
/// Its memory is addressable by real pointers: the address
/// [`alloc`](Self::alloc) returns is the host address of the allocation's
/// first frame, valid until the process exits (a freed allocation's frames
/// stay reserved until then, so no later allocation takes its address).
/// Code playing the process's user mode may store through it as long as
/// every access is a naturally aligned 64-bit atomic (the frames are
/// `AtomicU64` words shared with the device); [`read`](Self::read) and
/// [`write`](Self::write) check the mapping first.
///
/// Exit ([`exit`](Self::exit)) tears the address space down, but pages
/// locked by an MDL stay valid, and reachable by the device through live
/// DMA mappings, until the lock is released: the kernel still owns them.
/// Windows bugchecks (`PROCESS_HAS_LOCKED_PAGES`, 0x76) if a process is
/// deleted with pages still locked, so the host's process teardown checks
/// what [`exit`](Self::exit) returns after the process's handles are
/// closed.
#[derive(Debug, Clone)]
pub struct Process {
    pid: u32,
    space: AddressSpace,
    /// Its primary access token (`crate::security`).
    token: crate::security::Token,
}

impl Process {
    /// A new process with an empty address space, run by an interactive
    /// standard user ([`crate::security::Token::standard_user`]).
    pub fn new(pid: u32) -> Self {
        Self::with_token(pid, crate::security::Token::standard_user())
    }

    /// A new process with an empty address space and the access token
    /// `token` (who runs it: an administrator, an anonymous logon, ...).
    pub fn with_token(pid: u32, token: crate::security::Token) -> Self {
        Self {
            pid,
            space: AddressSpace::user(pid),
            token,
        }
    }

    /// Its primary access token (what `SeAccessCheck` at `CreateFile` and
    /// an administrator-only IOCTL's check read).
    pub fn token(&self) -> &crate::security::Token {
        &self.token
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its address space.
    pub fn space(&self) -> &AddressSpace {
        &self.space
    }

    /// Allocates `len` read-write bytes (`VirtualAlloc`), page aligned.
    pub fn alloc(&self, len: usize) -> Result<u64, MemoryError> {
        self.space.alloc(len, Protection::ReadWrite)
    }

    /// Allocates `len` bytes with the given protection.
    pub fn alloc_with(&self, len: usize, protection: Protection) -> Result<u64, MemoryError> {
        self.space.alloc(len, protection)
    }

    /// Frees the allocation at `va` (see [`AddressSpace::free`]).
    pub fn free(&self, va: u64) -> Result<(), MemoryError> {
        self.space.free(va)
    }

    /// Adopts the application's own memory: the whole pages around
    /// `addr..addr+len`, which this OS process (the program the simulated
    /// process stands for) allocated itself, become pages of this
    /// process's space at their own addresses, so the address is the
    /// pointer, as for [`alloc`](Self::alloc). Reads, writes, MDL locks,
    /// DMA mappings and the device's accesses work on them exactly as on
    /// an allocation (read-write, non-paged); the simulator never frees
    /// them. Returns the first page's address.
    ///
    /// Adopting pages already adopted counts one more adoption of each
    /// (two registrations of buffers sharing a page share it); a range
    /// touching memory the simulator owns in this space (an allocation,
    /// its guard page, a freed allocation's or a device mapping's
    /// reserved address) is refused with
    /// [`MemoryError::OverlapsSimulatorMemory`] and adopts nothing. Pages
    /// leave the space when their last adoption is released
    /// ([`release_adoption`](Self::release_adoption)) or the process
    /// exits.
    ///
    /// # Safety
    /// - The whole pages around `addr..addr+len` are mapped readable and
    ///   writable in this OS process and stay so (never freed, unmapped or
    ///   protected) until they leave the space and nothing reaches them:
    ///   until the release of their last adoption succeeds (it is refused
    ///   while an MDL lock or a DMA mapping holds a page) or, when the
    ///   process exits first, until every lock and mapping of them is
    ///   gone ([`exit`](Self::exit) counts the locked pages).
    /// - They are not memory of the simulator (another space's
    ///   allocation, a common buffer, pool).
    /// - The program touches the bytes a device may access only as verbs
    ///   allow (not while a work request using them is outstanding), so
    ///   its plain accesses never race with the device's atomic ones.
    ///   Bytes of those pages outside the range are never touched unless
    ///   a caller names them.
    pub unsafe fn adopt(&self, addr: *mut u8, len: usize) -> Result<u64, MemoryError> {
        // SAFETY: the caller promised this function's contract, which is
        // `AddressSpace::adopt`'s.
        unsafe { self.space.adopt(addr, len) }
    }

    /// Ends one adoption of the whole pages around `va..va+len`: a page
    /// whose last adoption ends leaves the space (CPU accesses and locks
    /// there fail from now on). Refused, changing nothing, with
    /// [`MemoryError::NotAdopted`] if a page is not adopted, or
    /// [`MemoryError::AdoptedPagesInUse`] if it would drop a page an MDL
    /// lock or a DMA mapping still holds (`VirtualFree` of a registered
    /// buffer: the registration holds its pages until it is gone).
    pub fn release_adoption(&self, va: u64, len: usize) -> Result<(), MemoryError> {
        self.space.release_adoption(va, len)
    }

    /// CPU read in this process (see [`AddressSpace::read`]).
    pub fn read(&self, va: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        self.space.read(va, out)
    }

    /// CPU write in this process (see [`AddressSpace::write`]).
    pub fn write(&self, va: u64, data: &[u8]) -> Result<(), MemoryError> {
        self.space.write(va, data)
    }

    /// A doorbell store to a mapped device page (see
    /// [`AddressSpace::write_device64`]).
    pub fn write_device64(&self, va: u64, value: u64) -> Result<(), MemoryError> {
        self.space.write_device64(va, value)
    }

    /// Ends the process: its allocations are dropped and every later
    /// access, allocation or free fails with
    /// [`MemoryError::ProcessExited`]. Returns the pages still locked by
    /// MDLs (they stay valid until unlocked); non-zero after the process's
    /// handles were cleaned up means a driver kept user pages locked.
    pub fn exit(&self) -> usize {
        self.space.close()
    }

    /// True once [`exit`](Self::exit) ran.
    pub fn has_exited(&self) -> bool {
        read_lock(&self.space.shared.map).closed
    }

    /// Requests this process has sent to device stacks (IOCTLs through
    /// `Pnp::send_request`): a kernel-bypass path is one that leaves this
    /// count unchanged.
    pub fn requests_issued(&self) -> u64 {
        self.space.shared.requests_issued.load(Ordering::Relaxed)
    }

    /// Counts one request sent by this process.
    pub(crate) fn count_request(&self) {
        self.space
            .shared
            .requests_issued
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// A CPU access to paged pool: above APC_LEVEL the page may not be resident,
/// and the page fault it takes bugchecks (IRQL_NOT_LESS_OR_EQUAL), so every
/// such access is reported, resident or not (as Driver Verifier's IRQL
/// checking does by paging pageable memory out). The access still happens.
fn check_paged_access() {
    crate::irql::check_max("touch paged pool", driver_platform::Irql::APC);
}

/// Distinguishes pools, so a block freed to the wrong one is caught.
static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Debug, Clone)]
struct BlockRecord {
    driver: String,
    tag: [u8; 4],
    len: usize,
}

#[derive(Debug)]
struct PoolShared {
    id: u64,
    kernel: AddressSpace,
    verifier: Verifier,
    /// Live blocks, keyed by kernel virtual address.
    blocks: Mutex<BTreeMap<u64, BlockRecord>>,
}

/// The kernel pool of one host, allocating in its kernel address space.
/// Cloning gives another handle to the same pool.
#[derive(Debug, Clone)]
pub struct Pool {
    shared: Arc<PoolShared>,
}

/// A pool allocation: `len` bytes at a kernel virtual address. Free it with
/// [`Pool::free`]; dropping the handle leaks the block (it stays allocated
/// and is listed by [`Pool::leaks`]).
#[derive(Debug)]
pub struct PoolBlock {
    pool_id: u64,
    driver: String,
    va: u64,
    len: usize,
    tag: [u8; 4],
    pages: PageRun,
    /// From paged pool: touched only at APC_LEVEL and below.
    paged: bool,
}

impl PoolBlock {
    /// Kernel virtual address of byte 0 (page aligned).
    pub fn va(&self) -> u64 {
        self.va
    }

    /// Bytes requested.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-byte block.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pool tag.
    pub fn tag(&self) -> [u8; 4] {
        self.tag
    }

    /// Copies bytes out of the block; false (nothing copied) if the range
    /// leaves the requested length.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        if self.paged {
            check_paged_access();
        }
        range_within(offset, out.len(), self.len) && read_pages(&self.pages, offset, out)
    }

    /// True for a block of paged pool ([`Pool::alloc_paged`]).
    pub fn is_paged(&self) -> bool {
        self.paged
    }

    /// Copies bytes into the block; false (nothing copied) if the range
    /// leaves the requested length.
    pub fn write(&self, offset: usize, data: &[u8]) -> bool {
        if self.paged {
            check_paged_access();
        }
        range_within(offset, data.len(), self.len) && write_pages(&self.pages, offset, data)
    }
}

impl Pool {
    /// An empty pool with its own kernel address space, reporting misuse to
    /// `verifier`.
    pub fn new(verifier: Verifier) -> Self {
        Self {
            shared: Arc::new(PoolShared {
                id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
                kernel: AddressSpace::kernel(),
                verifier,
                blocks: Mutex::new(BTreeMap::new()),
            }),
        }
    }

    /// The kernel address space blocks are allocated in: kernel-mode locks
    /// ([`crate::dma::HostLocker`]) and CPU accesses by kernel virtual
    /// address go through it.
    pub fn kernel_space(&self) -> &AddressSpace {
        &self.shared.kernel
    }

    /// Allocates `len` zeroed bytes for `driver` under `tag`. A zero-length
    /// request gets a block of its own address (as on Windows). Every block
    /// starts on a page.
    pub fn alloc(&self, driver: &str, tag: [u8; 4], len: usize) -> Result<PoolBlock, MemoryError> {
        // Non-paged pool: DISPATCH_LEVEL or below.
        crate::irql::check_max("ExAllocatePool2", driver_platform::Irql::DISPATCH);
        self.alloc_block(driver, tag, len, false)
    }

    /// [`Pool::alloc`] from paged pool (`POOL_FLAG_PAGED`): the memory may
    /// be paged out, so allocating it — and touching it — is for APC_LEVEL
    /// and below. Tracked and leak-checked like non-paged blocks.
    pub fn alloc_paged(
        &self,
        driver: &str,
        tag: [u8; 4],
        len: usize,
    ) -> Result<PoolBlock, MemoryError> {
        crate::irql::check_max("ExAllocatePool2(PAGED)", driver_platform::Irql::APC);
        self.alloc_block(driver, tag, len, true)
    }

    fn alloc_block(
        &self,
        driver: &str,
        tag: [u8; 4],
        len: usize,
        paged: bool,
    ) -> Result<PoolBlock, MemoryError> {
        let (va, pages) =
            self.shared
                .kernel
                .alloc_pages(len.max(1), Protection::ReadWrite, paged)?;
        lock(&self.shared.blocks).insert(
            va,
            BlockRecord {
                driver: driver.to_owned(),
                tag,
                len,
            },
        );
        Ok(PoolBlock {
            pool_id: self.shared.id,
            driver: driver.to_owned(),
            va,
            len,
            tag,
            pages,
            paged,
        })
    }

    /// Frees a block (`ExFreePoolWithTag`). A block of another pool is
    /// refused and recorded as a protocol violation (it stays allocated in
    /// its own pool, where it will show as a leak).
    pub fn free(&self, block: PoolBlock) {
        if block.pool_id != self.shared.id {
            self.shared.verifier.report(
                Some(&block.driver),
                ViolationKind::Protocol {
                    detail: format!(
                        "pool block {:#x} (tag {}) freed to a pool that did not allocate it",
                        block.va,
                        tag_text(block.tag)
                    ),
                },
            );
            return;
        }
        lock(&self.shared.blocks).remove(&block.va);
        // The block was allocated here, so its address starts an allocation.
        let _ = self.shared.kernel.free(block.va);
    }

    /// Outstanding bytes of `driver`, per tag, sorted by tag: what leaks if
    /// the driver unloads now.
    pub fn leaks(&self, driver: &str) -> Vec<([u8; 4], usize)> {
        let mut per_tag: BTreeMap<[u8; 4], usize> = BTreeMap::new();
        for record in lock(&self.shared.blocks)
            .values()
            .filter(|r| r.driver == driver)
        {
            *per_tag.entry(record.tag).or_default() += record.len;
        }
        per_tag.into_iter().collect()
    }

    /// Reports each of `driver`'s [`leaks`](Self::leaks) as a
    /// [`ViolationKind::PoolLeak`]; returns how many were reported. Call at
    /// driver unload.
    pub fn report_leaks(&self, driver: &str) -> usize {
        let leaks = self.leaks(driver);
        for &(tag, bytes) in &leaks {
            self.shared
                .verifier
                .report(Some(driver), ViolationKind::PoolLeak { tag, bytes });
        }
        leaks.len()
    }

    /// Live blocks of every driver.
    pub fn block_count(&self) -> usize {
        lock(&self.shared.blocks).len()
    }
}

/// A pool tag as text (`b"Hca "` -> `Hca `), non-printable bytes escaped.
fn tag_text(tag: [u8; 4]) -> String {
    tag.iter()
        .flat_map(|b| b.escape_ascii())
        .map(char::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_copy_within_bounds_only() {
        let page = Page::zeroed();
        assert!(page.write(4090, &[1, 2, 3, 4, 5, 6]));
        assert!(!page.write(4091, &[0; 6]), "past the end");
        assert!(!page.write(usize::MAX, &[0; 2]), "overflow");
        let mut out = [0u8; 6];
        assert!(page.read(4090, &mut out));
        assert_eq!(out, [1, 2, 3, 4, 5, 6]);
        assert!(!page.read(4091, &mut out));
    }

    /// A run of pages viewed as one buffer: an access within a page (the
    /// common buffers' usual one, taken without the general walk), across
    /// a page boundary, or up to the end copies exactly; an empty access at
    /// the end is allowed, and one leaving the run is refused and copies
    /// nothing.
    #[test]
    fn page_runs_copy_within_bounds_only() {
        let pages = zeroed_pages(2);
        let data: Vec<u8> = (1..=20).collect();
        for offset in [0, 13, 4090, 2 * PAGE_SIZE - 20] {
            assert!(write_pages(&pages, offset, &data));
            let mut back = [0u8; 20];
            assert!(read_pages(&pages, offset, &mut back));
            assert_eq!(back[..], data[..], "offset {offset}");
        }
        assert!(read_pages(&pages, 2 * PAGE_SIZE, &mut []));
        assert!(write_pages(&pages, 2 * PAGE_SIZE, &[]));
        assert!(!read_pages(&pages, 2 * PAGE_SIZE + 1, &mut []));
        assert!(!write_pages(&pages, usize::MAX, &[1]));
        let mut out = [0xAAu8; 4];
        assert!(!read_pages(&pages, 2 * PAGE_SIZE - 2, &mut out));
        assert_eq!(out, [0xAA; 4], "a refused read copies nothing");
        assert!(!write_pages(&pages, 2 * PAGE_SIZE - 2, &[9; 4]));
        let mut last = [0u8; 2];
        assert!(read_pages(&pages, 2 * PAGE_SIZE - 2, &mut last));
        assert_eq!(last, [19, 20], "a refused write touches nothing");
    }

    #[test]
    fn process_allocations_are_aligned_disjoint_and_guarded() {
        let p = Process::new(7);
        let a = p.alloc(100).unwrap();
        let b = p.alloc(2 * PAGE_SIZE).unwrap();
        assert_eq!(a % PAGE_BYTES, 0);
        assert_eq!(b % PAGE_BYTES, 0);
        assert!(
            b >= a + 2 * PAGE_BYTES || a >= b + 3 * PAGE_BYTES,
            "disjoint, each followed by its guard page"
        );
        assert!(a > 0 && b < USER_VA_LIMIT);
        p.write(a + 4000, &[9; 96]).unwrap();
        let mut out = [0u8; 96];
        p.read(a + 4000, &mut out).unwrap();
        assert_eq!(out, [9; 96]);
        // The whole page is allocated, the guard page after it is not.
        assert_eq!(
            p.write(a + 4000, &[0; 97]),
            Err(MemoryError::Unmapped {
                va: a + 4000,
                len: 97
            })
        );
        assert_eq!(p.read(a + 4000, &mut out), Ok(()));
        assert_eq!(out, [9; 96], "a refused write touches nothing");
        // A read running into the guard page is refused and copies nothing.
        let mut past = [7u8; 97];
        assert_eq!(
            p.read(a + 4000, &mut past),
            Err(MemoryError::Unmapped {
                va: a + 4000,
                len: 97
            })
        );
        assert_eq!(past, [7; 97], "a refused read copies nothing");
        // Spans pages of one allocation.
        p.write(b + 4090, &[1; 12]).unwrap();
        let mut span = [0u8; 12];
        p.read(b + 4090, &mut span).unwrap();
        assert_eq!(span, [1; 12]);
        assert!(p.read(0, &mut span).is_err());
        assert!(p.read(u64::MAX - 3, &mut span).is_err(), "wraps");
    }

    /// A process's virtual address is the host address of the frame
    /// behind it: the pointer user-mode code stores through is the memory
    /// the device reaches through a lock and the IOMMU.
    #[test]
    fn a_process_address_is_the_host_address_of_its_frame() {
        let p = Process::new(9);
        let va = p.alloc(3 * PAGE_SIZE).unwrap();
        let pages = p.space().lock_pages(va, 3 * PAGE_SIZE, true, None).unwrap();
        for (i, page) in pages.iter().enumerate() {
            assert_eq!(page.host_address() as u64, va + (i * PAGE_SIZE) as u64);
        }
        p.write(va + 4100, &[5; 8]).unwrap();
        let mut out = [0u8; 8];
        assert!(pages[1].read(4, &mut out));
        assert_eq!(out, [5; 8]);
        // Freed, the address stays reserved: no later allocation takes it.
        let other = p.alloc(PAGE_SIZE).unwrap();
        p.free(other).unwrap();
        for _ in 0..64 {
            assert_ne!(p.alloc(PAGE_SIZE).unwrap(), other);
        }
        p.space().unlock_pages(3, None);
        assert_eq!(p.exit(), 0);
    }

    #[test]
    fn live_processes_never_share_an_address() {
        let (one, two) = (Process::new(1), Process::new(2));
        let a = one.alloc(1).unwrap();
        let b = two.alloc(1).unwrap();
        assert!(a + PAGE_BYTES <= b || b + PAGE_BYTES <= a);
        let k = Pool::new(Verifier::new()).alloc("d", *b"Tag1", 1).unwrap();
        assert!(k.va() >= KERNEL_VA_BASE);
    }

    #[test]
    fn free_and_reuse() {
        let p = Process::new(3);
        let a = p.alloc(PAGE_SIZE).unwrap();
        assert_eq!(
            p.free(a + 1),
            Err(MemoryError::NotAnAllocation { va: a + 1 })
        );
        p.free(a).unwrap();
        assert!(p.read(a, &mut [0u8; 1]).is_err(), "freed");
        assert!(p.free(a).is_err(), "double free");
        let b = p.alloc(PAGE_SIZE).unwrap();
        assert_ne!(a, b, "addresses are never reused");
        assert_eq!(p.alloc(0), Err(MemoryError::ZeroLength));
    }

    #[test]
    fn read_only_memory_refuses_writes() {
        let p = Process::new(4);
        let ro = p.alloc_with(PAGE_SIZE, Protection::ReadOnly).unwrap();
        assert_eq!(
            p.write(ro, &[1]),
            Err(MemoryError::ReadOnly { va: ro, len: 1 })
        );
        assert!(p.read(ro, &mut [0u8; 8]).is_ok());
        assert!(p.space().lock_pages(ro, 8, true, None).is_err());
        assert_eq!(p.space().lock_pages(ro, 8, false, None).unwrap().len(), 1);
    }

    #[test]
    fn exit_keeps_locked_pages_alive() {
        let p = Process::new(5);
        let va = p.alloc(2 * PAGE_SIZE).unwrap();
        p.write(va + 4095, &[7, 8]).unwrap();
        let pages = p.space().lock_pages(va + 4095, 2, true, None).unwrap();
        assert_eq!(pages.len(), 2);
        assert_eq!(p.space().locked_pages(), 2);
        assert_eq!(p.exit(), 2, "pages still locked at exit");
        assert!(p.has_exited());
        assert_eq!(p.read(va, &mut [0u8; 1]), Err(MemoryError::ProcessExited));
        assert_eq!(p.alloc(1), Err(MemoryError::ProcessExited));
        let mut out = [0u8; 1];
        assert!(pages[0].read(4095, &mut out));
        assert_eq!(out, [7]);
        assert!(pages[1].read(0, &mut out));
        assert_eq!(out, [8]);
        p.space().unlock_pages(2, None);
        assert_eq!(p.space().locked_pages(), 0);
    }

    #[test]
    fn paged_pool_above_apc_level_is_an_irql_violation() {
        use crate::context::{self, Context};
        use crate::irql::IrqlGuard;
        use driver_platform::Irql;
        let verifier = Verifier::new();
        let pool = Pool::new(verifier.clone());
        let _driver = context::enter(Context::driver(verifier.clone(), "hca"));
        // At PASSIVE both pools are fine.
        let a = pool.alloc_paged("hca", *b"Page", 10).unwrap();
        pool.free(a);
        verifier.assert_clean();
        // In a DPC, non-paged pool is fine and paged pool is not.
        let _dpc = IrqlGuard::at(Irql::DISPATCH);
        let b = pool.alloc("hca", *b"NonP", 10).unwrap();
        pool.free(b);
        verifier.assert_clean();
        let c = pool.alloc_paged("hca", *b"Page", 10).unwrap();
        pool.free(c);
        let v = verifier.take();
        assert!(
            matches!(&v[..], [x] if x.driver.as_deref() == Some("hca")
                && matches!(x.kind, ViolationKind::IrqlTooHigh { service: "ExAllocatePool2(PAGED)", .. })),
            "{v:?}"
        );
    }

    /// Paged pool may be paged out: touching it (through the block or its
    /// kernel address) or locking it above APC_LEVEL is a violation, while
    /// the same operations on non-paged pool are fine at DISPATCH_LEVEL.
    #[test]
    fn paged_pool_touched_or_locked_above_apc_level_is_an_irql_violation() {
        use crate::context::{self, Context};
        use crate::dma::HostLocker;
        use crate::irql::IrqlGuard;
        use driver_platform::Irql;
        use driver_platform::dma::MemoryLocker;
        use driver_platform::request::RequestorMode;
        let verifier = Verifier::new();
        let pool = Pool::new(verifier.clone());
        let _driver = context::enter(Context::driver(verifier.clone(), "hca"));
        let paged = pool.alloc_paged("hca", *b"Page", 16).unwrap();
        let nonpaged = pool.alloc("hca", *b"NonP", 16).unwrap();
        assert!(paged.is_paged() && !nonpaged.is_paged());
        let locker = HostLocker::new(pool.kernel_space(), None);
        let mut out = [0u8; 4];
        // At PASSIVE everything is allowed.
        assert!(paged.write(0, &[1; 4]) && paged.read(0, &mut out));
        pool.kernel_space().read(paged.va(), &mut out).unwrap();
        drop(
            locker
                .lock(RequestorMode::Kernel, paged.va(), 16, true)
                .unwrap(),
        );
        verifier.assert_clean();
        let _dpc = IrqlGuard::at(Irql::DISPATCH);
        // Non-paged pool: touching and locking at DISPATCH are fine.
        assert!(nonpaged.write(0, &[2; 4]) && nonpaged.read(0, &mut out));
        pool.kernel_space().write(nonpaged.va(), &[3; 4]).unwrap();
        drop(
            locker
                .lock(RequestorMode::Kernel, nonpaged.va(), 16, true)
                .unwrap(),
        );
        verifier.assert_clean();
        // Paged pool: each touch and the lock are reported (and still done).
        assert!(paged.write(0, &[4; 4]));
        assert!(paged.read(0, &mut out));
        assert_eq!(out, [4; 4]);
        pool.kernel_space().write(paged.va() + 4, &[5; 4]).unwrap();
        pool.kernel_space().read(paged.va() + 4, &mut out).unwrap();
        drop(
            locker
                .lock(RequestorMode::Kernel, paged.va(), 16, true)
                .unwrap(),
        );
        let services: Vec<_> = verifier
            .take()
            .into_iter()
            .map(|v| match v.kind {
                ViolationKind::IrqlTooHigh {
                    service,
                    at: 2,
                    max: 1,
                } if v.driver.as_deref() == Some("hca") => service,
                other => panic!("unexpected violation {other:?}"),
            })
            .collect();
        assert_eq!(
            services,
            [
                "touch paged pool",
                "touch paged pool",
                "touch paged pool",
                "touch paged pool",
                "MmProbeAndLockPages(paged pool)"
            ]
        );
        drop(_dpc);
        pool.free(paged);
        pool.free(nonpaged);
    }

    #[test]
    fn pool_tracks_blocks_per_driver_and_tag() {
        let verifier = Verifier::new();
        let pool = Pool::new(verifier.clone());
        let a = pool.alloc("hca", *b"QpCx", 100).unwrap();
        let b = pool.alloc("hca", *b"QpCx", 50).unwrap();
        let c = pool.alloc("hca", *b"CqCx", 8000).unwrap();
        let d = pool.alloc("bus", *b"Chld", 0).unwrap();
        assert!(d.is_empty());
        assert!(c.write(7990, &[1; 10]));
        assert!(!c.write(7991, &[1; 10]), "past the requested length");
        let mut out = [0u8; 10];
        assert!(c.read(7990, &mut out));
        assert_eq!(out, [1; 10]);
        // The block is reachable by its kernel virtual address too.
        pool.kernel_space().read(c.va() + 7990, &mut out).unwrap();
        assert_eq!(out, [1; 10]);
        assert_eq!(pool.leaks("hca"), vec![(*b"CqCx", 8000), (*b"QpCx", 150)]);
        pool.free(a);
        pool.free(c);
        assert_eq!(pool.leaks("hca"), vec![(*b"QpCx", 50)]);
        verifier.assert_clean();
        assert_eq!(pool.report_leaks("hca"), 1);
        assert_eq!(pool.report_leaks("bus"), 1);
        let v = verifier.take();
        assert_eq!(
            v[0].kind,
            ViolationKind::PoolLeak {
                tag: *b"QpCx",
                bytes: 50
            }
        );
        assert_eq!(v[0].driver.as_deref(), Some("hca"));
        assert_eq!(v[1].driver.as_deref(), Some("bus"));
        drop(b); // Dropping the handle does not free: still a leak.
        assert_eq!(pool.leaks("hca"), vec![(*b"QpCx", 50)]);
        pool.free(d);
        assert_eq!(pool.block_count(), 1);
    }

    #[test]
    fn freeing_to_the_wrong_pool_is_a_violation() {
        let verifier = Verifier::new();
        let one = Pool::new(verifier.clone());
        let two = Pool::new(verifier.clone());
        let block = one.alloc("hca", *b"Tag ", 10).unwrap();
        two.free(block);
        let v = verifier.take();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].driver.as_deref(), Some("hca"));
        assert_eq!(one.leaks("hca"), vec![(*b"Tag ", 10)]);
    }

    #[test]
    fn error_statuses() {
        let s: NtStatus = MemoryError::Unmapped { va: 0, len: 1 }.into();
        assert_eq!(s.raw(), 0xC000_0005);
        let s: NtStatus = MemoryError::Exhausted.into();
        assert_eq!(s, NtStatus::INSUFFICIENT_RESOURCES);
    }

    #[derive(Debug, Default)]
    struct Recorder(Mutex<Vec<(u64, u64)>>);

    impl DevicePage for Recorder {
        fn write64(&self, offset: u64, value: u64) {
            lock(&self.0).push((offset, value));
        }
    }

    #[test]
    fn device_pages_take_aligned_stores_inside_the_page_only() {
        let process = Process::new(5);
        let page = Arc::new(Recorder::default());
        let va = process.space().map_device(page.clone()).unwrap();
        assert_eq!(va % PAGE_BYTES, 0);
        assert_eq!(process.space().device_mapping_count(), 1);
        process.write_device64(va + 8, 0x1234).unwrap();
        // Unaligned, past the page (the guard page), before it: refused.
        assert!(process.write_device64(va + 4, 1).is_err());
        assert!(process.write_device64(va + PAGE_BYTES, 1).is_err());
        assert!(process.write_device64(va - 8, 1).is_err());
        // Not memory: CPU reads and writes there fail.
        assert!(process.read(va, &mut [0u8; 8]).is_err());
        assert_eq!(*lock(&page.0), vec![(8, 0x1234)]);
        // A later allocation does not reuse the mapping's addresses.
        let next = process.alloc(PAGE_SIZE).unwrap();
        assert!(next >= va + 2 * PAGE_BYTES || va >= next + 2 * PAGE_BYTES);
        process.space().unmap_device(va).unwrap();
        assert!(process.write_device64(va + 8, 1).is_err());
        assert!(process.space().unmap_device(va).is_err());
        // Exit takes mappings with it.
        process.space().map_device(page.clone()).unwrap();
        process.exit();
        assert_eq!(process.space().device_mapping_count(), 0);
        assert_eq!(lock(&page.0).len(), 1);
    }
}
