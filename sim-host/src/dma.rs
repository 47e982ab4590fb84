//! The IOMMU, DMA adapters, memory locking (MDLs) and the device's view of
//! host memory: the Windows DMA model, enforced.
//!
//! Contract:
//! - One [`Iommu`] per host. Each [`HostDmaAdapter`] it creates owns a
//!   disjoint bus-address window ([`Iommu::window`]) in the non-canonical
//!   range from [`BUS_ADDRESS_BASE`], so no bus address is ever a CPU
//!   address (user VAs lie below it, kernel VAs far above) and a bus address
//!   of one adapter is never valid on another.
//! - An adapter's translation table maps bus pages to host pages for live
//!   common buffers and live mappings only. Bus addresses are handed out by
//!   a bump pointer from a seeded offset into the window and never reused,
//!   with at least one unmapped page after every buffer or mapping: an
//!   overrun, a stale address (after [`DmaAdapter::unmap`] or
//!   [`HostDmaAdapter::free_common`]), a CPU address or another adapter's
//!   address all fault.
//! - Common buffers are contiguous in bus space. Mappings of locked pages
//!   ([`DmaAdapter::map`]) give one bus address per page and are, on purpose
//!   and as the seed decides, often not contiguous: a driver must describe
//!   registered memory page by page (MTT), never as base + offset.
//! - A mapping is device-writable only if its pages were locked for device
//!   writes (`writable` in [`MemoryLocker::lock`]); a device write through a
//!   read-only mapping faults.
//! - [`DeviceDma`] (the device's door, [`HostMemory`]) resolves every page of
//!   an access through its adapter's table only. An access either completes
//!   entirely or faults without touching memory; a fault is returned as
//!   [`DmaFault`], counted, and recorded as [`ViolationKind::DmaFault`]
//!   against the adapter's driver. A probe ([`HostMemory::probe`]) checks
//!   pieces the same way touching nothing, and a copy between two views
//!   ([`HostMemory::copy_to`]) leaves what a read of the source then a
//!   write of the destination leaves — the same bytes, faults and records,
//!   the source checked first — but goes frame to frame under both
//!   tables, with no buffer in between.
//! - Freeing is explicit, as on Windows (`FreeCommonBuffer`,
//!   `PutScatterGatherList`): [`HostDmaAdapter::free_common`] and
//!   [`DmaAdapter::unmap`] consume their handle. Dropping a
//!   [`HostCommonBuffer`] or [`HostDmaMapping`] without them leaks it: it
//!   stays live (the device may still use it; nothing dangles) and is listed
//!   by [`HostDmaAdapter::leaks`], which the host reports as
//!   [`ViolationKind::DmaLeak`] at driver unload
//!   ([`HostDmaAdapter::report_leaks`]). RAII freeing would make a leak
//!   impossible to observe, and would let a device DMA into memory the
//!   driver merely forgot about.
//! - Locks ([`HostLockedPages`], an MDL) are released by drop
//!   (`MmUnlockPages`); the trait has no explicit unlock. Locked pages and
//!   mapped pages stay alive however the memory is freed (process exit,
//!   `VirtualFree`, pool free) until the lock and every mapping of them are
//!   gone.
//!
//! - Limits (`IoGetDmaAdapter`'s `DEVICE_DESCRIPTION.MaximumLength` and
//!   `NumberOfMapRegisters`, `WdfDmaEnablerCreate`'s `MaximumLength`): an
//!   adapter is created for a [`DmaDescription`]; one scatter/gather list
//!   ([`HostDmaAdapter::map_transfer`], `GetScatterGatherList` /
//!   `BuildScatterGatherList`) may span at most
//!   [`HostDmaAdapter::map_registers`] pages, and a longer one fails with
//!   `STATUS_INSUFFICIENT_RESOURCES`, mapping nothing.
//!   [`DmaAdapter::map`] stands for the platform's whole-registration map,
//!   which the KMDF shell builds as lists of at most `MaximumLength` bytes
//!   each, so it is not limited by one list's registers.
//! - DMA remapping ([`DmaRemapping`]): the INF's opt-in decides whether
//!   Windows puts the device behind the IOMMU; the adapter records what it
//!   decided, and an adapter whose device is not remapped is flagged (the
//!   model's IOMMU stays strict: it cannot hand out physical addresses).
//!
//! Lock order: an adapter's ledger, then its table. The device path takes
//! only the table (shared) and then touches the pages' real memory without
//! a lock (`crate::memory`'s frames), so map/unmap and device accesses of
//! different adapters never contend, and a CPU access never waits for a
//! device access.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use driver_platform::dma::{CommonBuffer, DmaAdapter, DmaMapping, LockedPages, MemoryLocker};
use driver_platform::request::RequestorMode;
use ib_types::status::NtStatus;
use sim_hca::host::{CopyFault, DmaDirection, DmaFault, HostMemory, bounce_copy};

use crate::memory::{
    AddressSpace, PAGE_SIZE, Page, PageRun, Process, lock, pages_for, range_within, read_lock,
    read_pages, write_lock, write_pages, zeroed_pages,
};
use crate::verifier::{Verifier, ViolationKind};

/// `STATUS_ACCESS_VIOLATION`: what probing a bad range returns.
pub const STATUS_ACCESS_VIOLATION: NtStatus = NtStatus::from_raw(0xC000_0005);

/// First bus address of adapter 0's window: just above the highest x64
/// user-mode address and far below kernel addresses (non-canonical as a
/// CPU address).
pub const BUS_ADDRESS_BASE: u64 = 0x0000_8000_0000_0000;

/// Bytes of each adapter's bus-address window (1 TiB: 2^28 pages, never
/// reused).
pub const ADAPTER_WINDOW_BYTES: u64 = 1 << 40;

/// Adapters one IOMMU can create.
pub const MAX_ADAPTERS: u32 = 1 << 16;

/// The seeded start of an adapter's allocations lies within this many pages
/// of its window's start.
const MAX_WINDOW_SKEW_PAGES: u64 = 1 << 20;

/// The most map registers the host grants one adapter (the HAL's cap):
/// 64 Ki pages, 256 MiB in one scatter/gather list.
pub const MAX_MAP_REGISTERS: usize = 1 << 16;

/// What a driver declares about its device's DMA when it gets its adapter
/// (`DEVICE_DESCRIPTION` for `IoGetDmaAdapter`, `WDF_DMA_ENABLER_CONFIG`
/// for `WdfDmaEnablerCreate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaDescription {
    /// The longest transfer the device does in one list (`MaximumLength`),
    /// bytes; not zero.
    pub maximum_length: usize,
}

impl DmaDescription {
    /// The largest description the host grants in full: what
    /// [`crate::pci::PciFunction::dma_adapter`] assumes.
    pub const HOST_MAXIMUM: Self = Self {
        maximum_length: (MAX_MAP_REGISTERS - 1) * PAGE_SIZE,
    };

    /// The map registers an adapter for this description gets
    /// (`NumberOfMapRegisters`): enough for a `maximum_length` transfer at
    /// any page offset, capped at [`MAX_MAP_REGISTERS`].
    pub fn map_registers(&self) -> usize {
        (self.maximum_length / PAGE_SIZE + 1).min(MAX_MAP_REGISTERS)
    }
}

/// Whether Windows puts a device behind DMA remapping, as its INF decides
/// ("Enabling DMA remapping for device drivers": the per-device
/// `Device Parameters\DMA Management\RemappingSupported`, which overrides
/// the per-driver `Services\<driver>\Parameters\DmaRemappingCompatible`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DmaRemapping {
    /// Opted in (1, or 2 / `RemappingFlags` 1, "only with DMA verification
    /// on", which the host's verifier always is): the device sees only what
    /// its adapter maps.
    Enforced,
    /// Opted out (0): the device would see physical memory, unchecked.
    OptedOut,
    /// No directive: "DMA remapping is not enforced for this device".
    NotEnforced,
}

/// log2 of [`PAGE_SIZE`].
const PAGE_SHIFT: u32 = 12;

/// One in this many page boundaries of a mapping gets a hole in bus space.
const SCATTER_ONE_IN: u64 = 4;

/// A small deterministic generator (SplitMix64): the seed decides window
/// offsets and where mappings are split.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Hashes bus page numbers (our own, not hostile) by one multiplication:
/// consecutive pages land in consecutive buckets.
#[derive(Debug, Default, Clone, Copy)]
struct PageNumberHasher(u64);

impl Hasher for PageNumberHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A translation table entry.
#[derive(Debug)]
struct MappedPage {
    page: Arc<Page>,
    device_writable: bool,
}

/// Bus page number (bus address >> 12) to host page.
type PageTable = HashMap<u64, MappedPage, BuildHasherDefault<PageNumberHasher>>;

/// What an adapter has handed out.
#[derive(Debug)]
struct Ledger {
    /// Next free bus page number (absolute).
    next_page: u64,
    /// One past the window's last page number.
    end_page: u64,
    rng: SplitMix64,
    /// Live common buffers: first bus address -> bytes.
    common_buffers: BTreeMap<u64, usize>,
    /// Live mappings: first bus address -> pages.
    mappings: BTreeMap<u64, usize>,
}

impl Ledger {
    /// Takes `count` bus page numbers, in ascending order, then skips a
    /// guard page. With `scatter`, some page boundaries get a hole of one
    /// to three pages. `None` when the window is exhausted.
    fn take_pages(&mut self, count: usize, scatter: bool) -> Option<Vec<u64>> {
        let mut pages = Vec::with_capacity(count);
        let mut next = self.next_page;
        for i in 0..count {
            if scatter && i > 0 && self.rng.next().is_multiple_of(SCATTER_ONE_IN) {
                next = next.checked_add(1 + self.rng.next() % 3)?;
            }
            pages.push(next);
            next = next.checked_add(1)?;
        }
        let after_guard = next.checked_add(1)?;
        if after_guard > self.end_page {
            return None;
        }
        self.next_page = after_guard;
        Some(pages)
    }
}

struct AdapterShared {
    index: u32,
    driver: String,
    verifier: Verifier,
    window: Range<u64>,
    /// Lock order: `ledger` before `table`.
    ledger: Mutex<Ledger>,
    table: RwLock<PageTable>,
    faults: AtomicU64,
    /// What the driver declared, and the map registers it got.
    description: DmaDescription,
    /// What the INF decided.
    remapping: DmaRemapping,
}

impl fmt::Debug for AdapterShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostDmaAdapter")
            .field("index", &self.index)
            .field("driver", &self.driver)
            .field(
                "window",
                &format_args!("{:#x}..{:#x}", self.window.start, self.window.end),
            )
            .finish_non_exhaustive()
    }
}

impl AdapterShared {
    fn report(&self, kind: ViolationKind) {
        self.verifier.report(Some(&self.driver), kind);
    }
}

#[derive(Debug)]
struct IommuState {
    next_index: u32,
    rng: SplitMix64,
}

#[derive(Debug)]
struct IommuShared {
    verifier: Verifier,
    state: Mutex<IommuState>,
}

/// The host's IOMMU: creates DMA adapters, each with its own bus-address
/// window and translation table. Cloning gives another handle to the same
/// IOMMU.
#[derive(Debug, Clone)]
pub struct Iommu {
    shared: Arc<IommuShared>,
}

impl Iommu {
    /// An IOMMU reporting to `verifier`; `seed` decides window offsets and
    /// how mappings are split, reproducibly.
    pub fn new(verifier: Verifier, seed: u64) -> Self {
        Self {
            shared: Arc::new(IommuShared {
                verifier,
                state: Mutex::new(IommuState {
                    next_index: 0,
                    rng: SplitMix64(seed),
                }),
            }),
        }
    }

    /// Creates the DMA adapter of one device (`IoGetDmaAdapter`); its
    /// violations are attributed to `driver` (the device's function
    /// driver). `STATUS_INSUFFICIENT_RESOURCES` after [`MAX_ADAPTERS`].
    pub fn create_adapter(&self, driver: &str) -> Result<HostDmaAdapter, NtStatus> {
        self.create_adapter_for(driver, DmaDescription::HOST_MAXIMUM, DmaRemapping::Enforced)
    }

    /// [`Iommu::create_adapter`] for a device described by `description`,
    /// whose INF decided `remapping`. `STATUS_INVALID_PARAMETER` for a zero
    /// `maximum_length`. A device that is not remapped is recorded as a
    /// [`ViolationKind::Protocol`] against `driver`: on Windows it would
    /// reach all of memory untranslated, which this host cannot model (its
    /// adapter stays behind the IOMMU).
    pub fn create_adapter_for(
        &self,
        driver: &str,
        description: DmaDescription,
        remapping: DmaRemapping,
    ) -> Result<HostDmaAdapter, NtStatus> {
        if description.maximum_length == 0 {
            return Err(NtStatus::INVALID_PARAMETER);
        }
        if remapping != DmaRemapping::Enforced {
            self.shared.verifier.report(
                Some(driver),
                ViolationKind::Protocol {
                    detail: format!(
                        "DMA adapter for a device without DMA remapping ({remapping:?}): \
                         its INF needs `HKR,\"DMA Management\",RemappingSupported,0x00010001,1` \
                         or the driver's `DmaRemappingCompatible` = 1"
                    ),
                },
            );
        }
        let (index, skew_pages, adapter_seed) = {
            let mut state = lock(&self.shared.state);
            if state.next_index >= MAX_ADAPTERS {
                return Err(NtStatus::INSUFFICIENT_RESOURCES);
            }
            let index = state.next_index;
            state.next_index += 1;
            let skew = state.rng.next() % MAX_WINDOW_SKEW_PAGES;
            (index, skew, state.rng.next())
        };
        let window = Self::window(index);
        let first_page = (window.start >> PAGE_SHIFT) + skew_pages;
        Ok(HostDmaAdapter {
            shared: Arc::new(AdapterShared {
                index,
                driver: driver.to_owned(),
                verifier: self.shared.verifier.clone(),
                ledger: Mutex::new(Ledger {
                    next_page: first_page,
                    end_page: window.end >> PAGE_SHIFT,
                    rng: SplitMix64(adapter_seed),
                    common_buffers: BTreeMap::new(),
                    mappings: BTreeMap::new(),
                }),
                window,
                table: RwLock::new(PageTable::default()),
                faults: AtomicU64::new(0),
                description,
                remapping,
            }),
        })
    }

    /// The bus-address window of adapter `index`.
    pub fn window(index: u32) -> Range<u64> {
        let start = BUS_ADDRESS_BASE + u64::from(index) * ADAPTER_WINDOW_BYTES;
        start..start + ADAPTER_WINDOW_BYTES
    }

    /// The adapter whose window holds `bus`, if any (for diagnostics: a
    /// fault at another adapter's address means a driver handed the device
    /// the wrong device's mapping).
    pub fn window_owner(bus: u64) -> Option<u32> {
        let index = bus.checked_sub(BUS_ADDRESS_BASE)? / ADAPTER_WINDOW_BYTES;
        u32::try_from(index).ok().filter(|&i| i < MAX_ADAPTERS)
    }
}

/// A DMA resource still live: what [`HostDmaAdapter::leaks`] lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DmaLeak {
    /// A common buffer never freed.
    CommonBuffer {
        /// Its bus address.
        bus: u64,
        /// Its bytes.
        len: usize,
    },
    /// A mapping never unmapped.
    Mapping {
        /// Bus address of its first page.
        first_bus: u64,
        /// Its pages.
        pages: usize,
    },
}

impl fmt::Display for DmaLeak {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CommonBuffer { bus, len } => {
                write!(f, "common buffer of {len} bytes at bus {bus:#x}")
            }
            Self::Mapping { first_bus, pages } => {
                write!(f, "mapping of {pages} pages from bus {first_bus:#x}")
            }
        }
    }
}

/// The DMA adapter of one device, attributed to its driver. Cloning gives
/// another handle to the same adapter (a PnP child given its parent's
/// adapter shares it).
#[derive(Debug, Clone)]
pub struct HostDmaAdapter {
    shared: Arc<AdapterShared>,
}

impl HostDmaAdapter {
    /// Its index in the IOMMU.
    pub fn index(&self) -> u32 {
        self.shared.index
    }

    /// The driver its violations are attributed to.
    pub fn driver(&self) -> &str {
        &self.shared.driver
    }

    /// Its bus-address window.
    pub fn window(&self) -> Range<u64> {
        self.shared.window.clone()
    }

    /// What its driver declared (`MaximumLength`).
    pub fn description(&self) -> DmaDescription {
        self.shared.description
    }

    /// Pages one scatter/gather list may span (`NumberOfMapRegisters`).
    pub fn map_registers(&self) -> usize {
        self.shared.description.map_registers()
    }

    /// Whether its device is behind DMA remapping, as its INF decided.
    pub fn remapping(&self) -> DmaRemapping {
        self.shared.remapping
    }

    /// Maps `len` bytes at `offset` into `pages` as one scatter/gather list
    /// (`GetScatterGatherList` / `BuildScatterGatherList` of one transfer).
    /// DISPATCH_LEVEL or below. A list spanning more pages than
    /// [`HostDmaAdapter::map_registers`] is `STATUS_INSUFFICIENT_RESOURCES`
    /// (`CalculateScatterGatherList`: "the number of map registers required
    /// exceeds the number of map registers available"), a range outside the
    /// locked bytes or empty is `STATUS_INVALID_PARAMETER`; either maps
    /// nothing. Unmap with [`DmaAdapter::unmap`] (`PutScatterGatherList`).
    pub fn map_transfer(
        &self,
        pages: &HostLockedPages,
        offset: usize,
        len: usize,
    ) -> Result<HostDmaMapping, NtStatus> {
        crate::irql::check_max("GetScatterGatherList", driver_platform::Irql::DISPATCH);
        if len == 0 || !range_within(offset, len, pages.len) {
            return Err(NtStatus::INVALID_PARAMETER);
        }
        let start = pages.first_byte() + offset;
        let (first, last) = (start / PAGE_SIZE, (start + len - 1) / PAGE_SIZE);
        let count = last - first + 1;
        if count > self.map_registers() {
            return Err(NtStatus::INSUFFICIENT_RESOURCES);
        }
        let bus_pages = self.install(
            &pages.pages[first..=last],
            pages.device_writable,
            false,
            |ledger, bus| {
                ledger.mappings.insert(bus, count);
            },
        )?;
        Ok(HostDmaMapping {
            adapter_index: self.shared.index,
            bus_pages: bus_pages.into_iter().map(|p| p << PAGE_SHIFT).collect(),
            device_writable: pages.device_writable,
        })
    }

    /// The device's view of host memory through this adapter.
    pub fn device_view(&self) -> DeviceDma {
        DeviceDma {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Frees a common buffer (`FreeCommonBuffer`): its bus addresses fault
    /// from now on. A buffer of another adapter is refused and recorded as
    /// a protocol violation (it stays live on its own adapter).
    pub fn free_common(&self, buffer: HostCommonBuffer) {
        crate::irql::check_max("FreeCommonBuffer", driver_platform::Irql::PASSIVE);
        if buffer.adapter_index != self.shared.index {
            self.shared.report(ViolationKind::Protocol {
                detail: format!(
                    "common buffer at bus {:#x} of adapter {} freed through adapter {}",
                    buffer.bus, buffer.adapter_index, self.shared.index
                ),
            });
            return;
        }
        let mut ledger = lock(&self.shared.ledger);
        if ledger.common_buffers.remove(&buffer.bus).is_none() {
            return;
        }
        let mut table = write_lock(&self.shared.table);
        let first = buffer.bus >> PAGE_SHIFT;
        for page_no in first..first + buffer.pages.len() as u64 {
            table.remove(&page_no);
        }
    }

    /// Live common buffers and mappings, in bus-address order.
    pub fn leaks(&self) -> Vec<DmaLeak> {
        let ledger = lock(&self.shared.ledger);
        let mut leaks: Vec<DmaLeak> = ledger
            .common_buffers
            .iter()
            .map(|(&bus, &len)| DmaLeak::CommonBuffer { bus, len })
            .chain(
                ledger
                    .mappings
                    .iter()
                    .map(|(&first_bus, &pages)| DmaLeak::Mapping { first_bus, pages }),
            )
            .collect();
        leaks.sort_by_key(|leak| match leak {
            DmaLeak::CommonBuffer { bus, .. } => *bus,
            DmaLeak::Mapping { first_bus, .. } => *first_bus,
        });
        leaks
    }

    /// Reports each of [`leaks`](Self::leaks) as a
    /// [`ViolationKind::DmaLeak`] against the adapter's driver; returns how
    /// many. Call at driver unload (or when the adapter is put back).
    pub fn report_leaks(&self) -> usize {
        let leaks = self.leaks();
        for leak in &leaks {
            self.shared.report(ViolationKind::DmaLeak {
                what: leak.to_string(),
            });
        }
        leaks.len()
    }

    /// Device accesses refused so far.
    pub fn faults(&self) -> u64 {
        self.shared.faults.load(Ordering::Relaxed)
    }

    /// True if the page holding `bus` is mapped (by a common buffer or a
    /// mapping) right now.
    pub fn is_live(&self, bus: u64) -> bool {
        read_lock(&self.shared.table).contains_key(&(bus >> PAGE_SHIFT))
    }

    /// Takes bus pages and enters `pages` at them, recording the result in
    /// the ledger with `record`.
    fn install(
        &self,
        pages: &[Arc<Page>],
        device_writable: bool,
        contiguous: bool,
        record: impl FnOnce(&mut Ledger, u64),
    ) -> Result<Vec<u64>, NtStatus> {
        let mut ledger = lock(&self.shared.ledger);
        let bus_pages = ledger
            .take_pages(pages.len(), !contiguous)
            .ok_or(NtStatus::INSUFFICIENT_RESOURCES)?;
        let first_bus = bus_pages
            .first()
            .map(|&p| p << PAGE_SHIFT)
            .ok_or(NtStatus::INVALID_PARAMETER)?;
        record(&mut ledger, first_bus);
        let mut table = write_lock(&self.shared.table);
        for (&page_no, page) in bus_pages.iter().zip(pages) {
            table.insert(
                page_no,
                MappedPage {
                    page: Arc::clone(page),
                    device_writable,
                },
            );
        }
        Ok(bus_pages)
    }
}

impl DmaAdapter for HostDmaAdapter {
    type Buffer = HostCommonBuffer;
    type Pages = HostLockedPages;
    type Mapping = HostDmaMapping;

    fn page_size(&self) -> usize {
        PAGE_SIZE
    }

    /// Zeroed, rounded up to whole pages, contiguous in bus space;
    /// `len()` is the length asked for. `STATUS_INVALID_PARAMETER` for
    /// zero bytes.
    fn alloc_common(&self, len: usize) -> Result<HostCommonBuffer, NtStatus> {
        crate::irql::check_max("AllocateCommonBuffer", driver_platform::Irql::PASSIVE);
        if len == 0 {
            return Err(NtStatus::INVALID_PARAMETER);
        }
        let pages = zeroed_pages(pages_for(len));
        let bus_pages = self.install(&pages, true, true, |ledger, bus| {
            ledger.common_buffers.insert(bus, len);
        })?;
        Ok(HostCommonBuffer {
            adapter_index: self.shared.index,
            bus: bus_pages.first().map_or(0, |&p| p << PAGE_SHIFT),
            len,
            pages,
        })
    }

    fn map(&self, pages: &HostLockedPages) -> Result<HostDmaMapping, NtStatus> {
        crate::irql::check_max("MapTransferEx", driver_platform::Irql::DISPATCH);
        let count = pages.pages.len();
        let bus_pages =
            self.install(&pages.pages, pages.device_writable, false, |ledger, bus| {
                ledger.mappings.insert(bus, count);
            })?;
        Ok(HostDmaMapping {
            adapter_index: self.shared.index,
            bus_pages: bus_pages.into_iter().map(|p| p << PAGE_SHIFT).collect(),
            device_writable: pages.device_writable,
        })
    }

    /// A mapping of another adapter is refused and recorded as a protocol
    /// violation (it stays live on its own adapter).
    fn unmap(&self, mapping: HostDmaMapping) {
        crate::irql::check_max("FlushAdapterBuffersEx", driver_platform::Irql::DISPATCH);
        if mapping.adapter_index != self.shared.index {
            self.shared.report(ViolationKind::Protocol {
                detail: format!(
                    "mapping of {} pages of adapter {} unmapped through adapter {}",
                    mapping.bus_pages.len(),
                    mapping.adapter_index,
                    self.shared.index
                ),
            });
            return;
        }
        let Some(&first_bus) = mapping.bus_pages.first() else {
            return;
        };
        let mut ledger = lock(&self.shared.ledger);
        if ledger.mappings.remove(&first_bus).is_none() {
            return;
        }
        let mut table = write_lock(&self.shared.table);
        for bus in &mapping.bus_pages {
            table.remove(&(bus >> PAGE_SHIFT));
        }
    }
}

/// A common buffer: zeroed pages, contiguous in its adapter's bus space.
/// Free it with [`HostDmaAdapter::free_common`]; dropping it leaks it (see
/// the module contract).
#[derive(Debug)]
pub struct HostCommonBuffer {
    adapter_index: u32,
    bus: u64,
    len: usize,
    pages: PageRun,
}

impl CommonBuffer for HostCommonBuffer {
    fn bus_address(&self) -> u64 {
        self.bus
    }

    fn len(&self) -> usize {
        self.len
    }

    /// False (nothing copied) past `len()`. A CPU read of real memory,
    /// word by word and relaxed (see `memory`'s contract).
    fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        range_within(offset, out.len(), self.len) && read_pages(&self.pages, offset, out)
    }

    /// False (nothing copied) past `len()`. A CPU write to real memory,
    /// word by word and relaxed: only the driver's `dma_wmb` orders it
    /// before a later doorbell or doorbell record.
    fn write(&self, offset: usize, data: &[u8]) -> bool {
        range_within(offset, data.len(), self.len) && write_pages(&self.pages, offset, data)
    }
}

/// A live mapping: one page-aligned bus address per locked page. Unmap it
/// with [`DmaAdapter::unmap`]; dropping it leaks it (see the module
/// contract).
#[derive(Debug)]
pub struct HostDmaMapping {
    adapter_index: u32,
    bus_pages: Vec<u64>,
    device_writable: bool,
}

impl HostDmaMapping {
    /// True if the pages are consecutive in bus space (often not: by
    /// design).
    pub fn is_bus_contiguous(&self) -> bool {
        self.bus_pages
            .windows(2)
            .all(|w| w[1] == w[0] + PAGE_SIZE as u64)
    }

    /// True if the device may write through it.
    pub fn device_writable(&self) -> bool {
        self.device_writable
    }
}

impl DmaMapping for HostDmaMapping {
    fn page_bus_address(&self, index: usize) -> Option<u64> {
        self.bus_pages.get(index).copied()
    }

    fn page_count(&self) -> usize {
        self.bus_pages.len()
    }
}

/// Locks memory of the kernel or of one process for DMA
/// (`MmProbeAndLockPages`).
///
/// - [`RequestorMode::User`]: the range must lie in the process's
///   allocations (and be writable when locking for device writes); a
///   locker without a process refuses every user-mode lock.
/// - [`RequestorMode::Kernel`]: the range must lie in kernel allocations
///   (pool blocks).
///
/// Anything else is `STATUS_ACCESS_VIOLATION`; a zero length is
/// `STATUS_INVALID_PARAMETER`.
#[derive(Debug, Clone)]
pub struct HostLocker {
    kernel: AddressSpace,
    process: Option<Process>,
}

impl HostLocker {
    /// A locker for kernel memory in `kernel` and, if given, user memory of
    /// `process` (the caller's process context).
    pub fn new(kernel: &AddressSpace, process: Option<&Process>) -> Self {
        Self {
            kernel: kernel.clone(),
            process: process.cloned(),
        }
    }

    /// The process whose memory it locks in user mode, if any.
    pub fn process(&self) -> Option<&Process> {
        self.process.as_ref()
    }
}

impl MemoryLocker for HostLocker {
    type Pages = HostLockedPages;

    fn lock(
        &self,
        mode: RequestorMode,
        va: u64,
        len: u64,
        writable: bool,
    ) -> Result<HostLockedPages, NtStatus> {
        // Pageable addresses (user memory, paged pool) may be paged out:
        // locking them is for APC_LEVEL and below; non-paged pool may be
        // locked at DISPATCH (MmProbeAndLockPages's documented IRQL).
        match mode {
            RequestorMode::User => {
                crate::irql::check_max("MmProbeAndLockPages", driver_platform::Irql::APC);
            }
            RequestorMode::Kernel => {
                let paged =
                    usize::try_from(len).is_ok_and(|bytes| self.kernel.touches_pageable(va, bytes));
                if paged {
                    crate::irql::check_max(
                        "MmProbeAndLockPages(paged pool)",
                        driver_platform::Irql::APC,
                    );
                } else {
                    crate::irql::check_max("MmProbeAndLockPages", driver_platform::Irql::DISPATCH);
                }
            }
        }
        if len == 0 {
            return Err(NtStatus::INVALID_PARAMETER);
        }
        let space = match mode {
            RequestorMode::Kernel => &self.kernel,
            RequestorMode::User => match &self.process {
                Some(process) => {
                    // A user address means something only in its process.
                    crate::caller::check_process_context(process, "MmProbeAndLockPages(UserMode)");
                    process.space()
                }
                None => return Err(STATUS_ACCESS_VIOLATION),
            },
        };
        let len = usize::try_from(len).map_err(|_| STATUS_ACCESS_VIOLATION)?;
        let locked_by = crate::context::current_driver();
        let pages = space
            .lock_pages(va, len, writable, locked_by.as_ref())
            .map_err(|_| STATUS_ACCESS_VIOLATION)?;
        Ok(HostLockedPages {
            locked_by,
            space: space.clone(),
            va,
            len,
            device_writable: writable,
            pages,
        })
    }

    fn read_kernel(&self, va: u64, out: &mut [u8]) -> Result<(), NtStatus> {
        crate::irql::check_max("read kernel memory", driver_platform::Irql::DISPATCH);
        self.kernel
            .read(va, out)
            .map_err(|_| STATUS_ACCESS_VIOLATION)
    }
}

/// Locked pages (an MDL): the pages spanning `va..va+len`, first to last.
/// Dropping it unlocks them; pages still mapped for a device stay alive
/// through the mapping.
#[derive(Debug)]
pub struct HostLockedPages {
    /// The driver that locked them (charged if a process exits first).
    locked_by: Option<Arc<str>>,
    space: AddressSpace,
    va: u64,
    len: usize,
    device_writable: bool,
    pages: Vec<Arc<Page>>,
}

impl HostLockedPages {
    /// The virtual address locked.
    pub fn va(&self) -> u64 {
        self.va
    }

    /// True if locked for device writes.
    pub fn device_writable(&self) -> bool {
        self.device_writable
    }

    /// Copies bytes out of the locked range through a system mapping
    /// (`MmGetSystemAddressForMdlSafe`); works after the owning process
    /// freed the memory or exited. False (nothing copied) out of range.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        range_within(offset, out.len(), self.len)
            && read_pages(&self.pages, self.first_byte() + offset, out)
    }

    /// Copies bytes into the locked range through a system mapping. False
    /// (nothing copied) out of range.
    pub fn write(&self, offset: usize, data: &[u8]) -> bool {
        range_within(offset, data.len(), self.len)
            && write_pages(&self.pages, self.first_byte() + offset, data)
    }

    fn first_byte(&self) -> usize {
        (self.va % PAGE_SIZE as u64) as usize
    }
}

impl LockedPages for HostLockedPages {
    fn len(&self) -> u64 {
        self.len as u64
    }

    fn byte_offset(&self) -> u32 {
        (self.va % PAGE_SIZE as u64) as u32
    }

    fn page_count(&self) -> usize {
        self.pages.len()
    }
}

impl Drop for HostLockedPages {
    fn drop(&mut self) {
        self.space
            .unlock_pages(self.pages.len(), self.locked_by.as_ref());
    }
}

/// The device's view of host memory through one adapter: the
/// [`HostMemory`] a simulated device is built with. Cloning gives another
/// handle to the same view.
#[derive(Debug, Clone)]
pub struct DeviceDma {
    shared: Arc<AdapterShared>,
}

impl DeviceDma {
    /// Runs `copy(page, offset in page, range of the access)` for each page
    /// of `addr..addr+len` if every page is live (and device-writable for
    /// a write); otherwise faults without calling it. The table stays
    /// locked (shared) throughout, so a concurrent unmap cannot split an
    /// access.
    fn access(
        &self,
        addr: u64,
        len: usize,
        direction: DmaDirection,
        mut copy: impl FnMut(&Page, usize, Range<usize>),
    ) -> Result<(), DmaFault> {
        if len == 0 {
            return Ok(());
        }
        {
            let table = read_lock(&self.shared.table);
            if let Some(pages) = Translation::of(&table, addr, len, direction) {
                pages.for_each_page(&table, 0, len, |page, at, range| {
                    copy(page, at, range);
                });
                return Ok(());
            }
        }
        self.fault(addr, len, direction)
    }

    #[cold]
    fn fault(&self, addr: u64, len: usize, direction: DmaDirection) -> Result<(), DmaFault> {
        Err(self.record_fault(addr, len, direction))
    }

    /// Counts and reports a refused access (`ViolationKind::DmaFault`
    /// against the adapter's driver). Called with no table locked.
    #[cold]
    fn record_fault(&self, addr: u64, len: usize, direction: DmaDirection) -> DmaFault {
        self.shared.faults.fetch_add(1, Ordering::Relaxed);
        self.shared.report(ViolationKind::DmaFault { addr, len });
        DmaFault {
            addr,
            len,
            direction,
        }
    }

    /// Checks, touching nothing, that each `(addr, len)` piece is live for
    /// `direction`; the first refused piece is a fault, counted and
    /// reported exactly as its access would have been.
    pub(crate) fn probe_pieces(
        &self,
        pieces: &[(u64, usize)],
        direction: DmaDirection,
    ) -> Result<(), (usize, DmaFault)> {
        let refused = {
            let table = read_lock(&self.shared.table);
            pieces
                .iter()
                .position(|&(addr, len)| len != 0 && !is_live(&table, addr, len, direction))
        };
        match refused {
            None => Ok(()),
            Some(i) => {
                let (addr, len) = pieces[i];
                Err((i, self.record_fault(addr, len, direction)))
            }
        }
    }

    /// Copies `len` bytes from bus address `from` of this view to `to` of
    /// `dest` (possibly this view) through both adapters' tables: the same
    /// result, faults and reports as a [`read`](HostMemory::read) of the
    /// source then a [`write`](HostMemory::write) of the destination (the
    /// source checked first; all or nothing), but frame to frame, each
    /// byte read once and written once; the pages the check looked up are
    /// kept for the copy (the first eight of each side).
    pub(crate) fn copy_pages_to(
        &self,
        from: u64,
        dest: &DeviceDma,
        to: u64,
        len: usize,
    ) -> Result<(), CopyFault> {
        if len == 0 {
            return Ok(());
        }
        // Both tables stay locked (shared) through the copy, as in
        // `access`, so a concurrent unmap cannot split it; in address
        // order when they differ, so two copies in opposite directions and
        // a waiting map or unmap (which takes one table exclusively,
        // holding no other) cannot deadlock.
        let same = Arc::ptr_eq(&self.shared, &dest.shared);
        let (src_table, dst_table);
        if same {
            src_table = read_lock(&self.shared.table);
            dst_table = None;
        } else if Arc::as_ptr(&self.shared) < Arc::as_ptr(&dest.shared) {
            src_table = read_lock(&self.shared.table);
            dst_table = Some(read_lock(&dest.shared.table));
        } else {
            dst_table = Some(read_lock(&dest.shared.table));
            src_table = read_lock(&self.shared.table);
        }
        let dst_map = dst_table.as_deref().unwrap_or(&src_table);
        let Some(src) = Translation::of(&src_table, from, len, DmaDirection::Read) else {
            drop((dst_table, src_table));
            let fault = self.record_fault(from, len, DmaDirection::Read);
            return Err(CopyFault::Source(fault));
        };
        let Some(dst) = Translation::of(dst_map, to, len, DmaDirection::Write) else {
            drop((dst_table, src_table));
            let fault = dest.record_fault(to, len, DmaDirection::Write);
            return Err(CopyFault::Destination(fault));
        };
        if src.may_overlap(&dst) {
            // One allocation behind both sides: the ranges may overlap in
            // memory, so read it all, then write, as a read then a write
            // does (a loopback within one buffer; rare).
            let mut bounce = vec![0; len];
            src.for_each_page(&src_table, 0, len, |page, at, range| {
                page.device_read(at, &mut bounce[range]);
            });
            dst.for_each_page(dst_map, 0, len, |page, at, range| {
                page.device_write(at, &bounce[range]);
            });
            return Ok(());
        }
        // Stretch by stretch, each within one source and one destination
        // page.
        let (first_src, first_dst) = (src.first_offset, dst.first_offset);
        let mut done = 0usize;
        while done < len {
            let (src_at, dst_at) = (first_src + done, first_dst + done);
            let (src_in, dst_in) = (src_at % PAGE_SIZE, dst_at % PAGE_SIZE);
            let n = (PAGE_SIZE - src_in).min(PAGE_SIZE - dst_in).min(len - done);
            let (Some(src_page), Some(dst_page)) = (
                src.page(&src_table, src_at / PAGE_SIZE),
                dst.page(dst_map, dst_at / PAGE_SIZE),
            ) else {
                break; // Checked live above, under the same locks.
            };
            src_page.device_copy_to(src_in, dst_page, dst_in, n);
            done += n;
        }
        Ok(())
    }
}

/// True if every page of `addr..addr+len` (`len` > 0) is live, and
/// device-writable for a write.
fn is_live(table: &PageTable, addr: u64, len: usize, direction: DmaDirection) -> bool {
    let Some(end) = addr.checked_add(len as u64) else {
        return false;
    };
    ((addr >> PAGE_SHIFT)..=((end - 1) >> PAGE_SHIFT)).all(|page_no| {
        table
            .get(&page_no)
            .is_some_and(|mapped| direction == DmaDirection::Read || mapped.device_writable)
    })
}

/// Pages of one side of an access whose translation is kept from the check
/// to the copy; an access spanning more looks the rest up again (under the
/// same lock).
const KEPT_PAGES: usize = 8;

/// The host pages behind a bus range that is live for an access, looked up
/// once under the table lock: the check that the whole access may proceed
/// and the translation its copy then uses.
struct Translation<'t> {
    /// Bus page number of the range's first page.
    first_page: u64,
    /// Offset of the range's first byte in its first page.
    first_offset: usize,
    /// The first [`KEPT_PAGES`] pages.
    kept: [Option<&'t Page>; KEPT_PAGES],
    /// Every page belongs to the first page's allocation.
    one_allocation: bool,
}

impl<'t> Translation<'t> {
    /// The translation of `addr..addr+len` (`len` > 0) if every page is
    /// live (and device-writable for a write).
    fn of(table: &'t PageTable, addr: u64, len: usize, direction: DmaDirection) -> Option<Self> {
        let end = addr.checked_add(len as u64)?;
        let first_page = addr >> PAGE_SHIFT;
        let mut kept = [None; KEPT_PAGES];
        let mut first: Option<&Page> = None;
        let mut one_allocation = true;
        for (i, page_no) in (first_page..((end - 1) >> PAGE_SHIFT) + 1).enumerate() {
            let mapped = table.get(&page_no)?;
            if direction == DmaDirection::Write && !mapped.device_writable {
                return None;
            }
            let page = &*mapped.page;
            match first {
                None => first = Some(page),
                Some(first) => one_allocation &= first.same_allocation(page),
            }
            if let Some(slot) = kept.get_mut(i) {
                *slot = Some(page);
            }
        }
        Some(Self {
            first_page,
            first_offset: (addr % PAGE_SIZE as u64) as usize,
            kept,
            one_allocation,
        })
    }

    /// Page `index` of the range (0 is the first).
    fn page(&self, table: &'t PageTable, index: usize) -> Option<&'t Page> {
        match self.kept.get(index) {
            Some(kept) => *kept,
            None => table
                .get(&(self.first_page + index as u64))
                .map(|mapped| &*mapped.page),
        }
    }

    /// True unless the two ranges lie in two different allocations, each
    /// wholly in one: only then can they not overlap in memory.
    fn may_overlap(&self, other: &Translation<'_>) -> bool {
        match (self.kept[0], other.kept[0]) {
            (Some(a), Some(b)) => {
                !(self.one_allocation && other.one_allocation) || a.same_allocation(b)
            }
            _ => true,
        }
    }

    /// Runs `f(page, offset in page, range of the access)` for each page
    /// of bytes `skip..skip+len` of the range.
    fn for_each_page(
        &self,
        table: &'t PageTable,
        skip: usize,
        len: usize,
        mut f: impl FnMut(&Page, usize, Range<usize>),
    ) {
        let mut done = 0usize;
        while done < len {
            let at = self.first_offset + skip + done;
            let in_page = at % PAGE_SIZE;
            let chunk = (PAGE_SIZE - in_page).min(len - done);
            let Some(page) = self.page(table, at / PAGE_SIZE) else {
                break; // Checked live when translated, under the same lock.
            };
            f(page, in_page, done..done + chunk);
            done += chunk;
        }
    }
}

impl HostMemory for DeviceDma {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), DmaFault> {
        self.access(addr, buf.len(), DmaDirection::Read, |page, at, range| {
            page.device_read(at, &mut buf[range]);
        })
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<(), DmaFault> {
        self.access(addr, data.len(), DmaDirection::Write, |page, at, range| {
            page.device_write(at, &data[range]);
        })
    }

    fn probe(
        &self,
        pieces: &[(u64, usize)],
        direction: DmaDirection,
    ) -> Option<Result<(), (usize, DmaFault)>> {
        Some(self.probe_pieces(pieces, direction))
    }

    fn copy_to(
        &self,
        from: u64,
        dest: &dyn HostMemory,
        to: u64,
        len: usize,
    ) -> Result<(), CopyFault> {
        match dest.as_any().and_then(|d| d.downcast_ref::<DeviceDma>()) {
            Some(dest) => self.copy_pages_to(from, dest, to, len),
            None => bounce_copy(self, from, dest, to, len),
        }
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{KERNEL_VA_BASE, Pool, Protection, USER_VA_LIMIT};

    struct Host {
        verifier: Verifier,
        iommu: Iommu,
        pool: Pool,
    }

    fn host(seed: u64) -> Host {
        let verifier = Verifier::new();
        Host {
            iommu: Iommu::new(verifier.clone(), seed),
            pool: Pool::new(verifier.clone()),
            verifier,
        }
    }

    fn dma_faults(verifier: &Verifier) -> Vec<(Option<String>, u64, usize)> {
        verifier
            .take()
            .into_iter()
            .filter_map(|v| match v.kind {
                ViolationKind::DmaFault { addr, len } => Some((v.driver, addr, len)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn bus_addresses_differ_from_cpu_addresses_and_between_adapters() {
        let h = host(1);
        let a = h.iommu.create_adapter("hca0").unwrap();
        let b = h.iommu.create_adapter("hca1").unwrap();
        assert!(a.window().end <= b.window().start, "disjoint windows");
        assert_eq!(Iommu::window_owner(a.window().start), Some(a.index()));
        assert_eq!(Iommu::window_owner(b.window().end - 1), Some(b.index()));
        assert_eq!(Iommu::window_owner(0x1000), None);

        let process = Process::new(10);
        let va = process.alloc(3 * PAGE_SIZE).unwrap();
        let locker = HostLocker::new(h.pool.kernel_space(), Some(&process));
        let locked = locker
            .lock(RequestorMode::User, va, 3 * 4096, true)
            .unwrap();
        let ma = a.map(&locked).unwrap();
        let mb = b.map(&locked).unwrap();
        let ca = a.alloc_common(100).unwrap();
        let cb = b.alloc_common(100).unwrap();
        let kernel_block = h.pool.alloc("hca0", *b"Test", 64).unwrap();
        for i in 0..3 {
            let bus_a = ma.page_bus_address(i).unwrap();
            let bus_b = mb.page_bus_address(i).unwrap();
            assert!(a.window().contains(&bus_a));
            assert!(b.window().contains(&bus_b));
            assert!((BUS_ADDRESS_BASE..KERNEL_VA_BASE).contains(&bus_a));
            assert!(bus_a > USER_VA_LIMIT);
        }
        assert!(a.window().contains(&ca.bus_address()));
        assert!(b.window().contains(&cb.bus_address()));

        // CPU addresses handed to the device fault.
        let dev = a.device_view();
        let mut out = [0u8; 8];
        assert!(dev.read(va, &mut out).is_err(), "a user virtual address");
        assert!(
            dev.read(kernel_block.va(), &mut out).is_err(),
            "a kernel VA"
        );
        assert_eq!(dev.read(ma.page_bus_address(1).unwrap(), &mut out), Ok(()));
        assert_eq!(a.faults(), 2);
        let faults = dma_faults(&h.verifier);
        assert_eq!(faults.len(), 2);
        assert_eq!(faults[0], (Some("hca0".to_owned()), va, 8));

        a.unmap(ma);
        b.unmap(mb);
        a.free_common(ca);
        b.free_common(cb);
        h.pool.free(kernel_block);
        assert!(a.leaks().is_empty() && b.leaks().is_empty());
        h.verifier.assert_clean();
    }

    #[test]
    fn another_adapters_mapping_faults_and_is_recorded() {
        let h = host(2);
        let a = h.iommu.create_adapter("hcaA").unwrap();
        let b = h.iommu.create_adapter("hcaB").unwrap();
        let buffer_b = b.alloc_common(PAGE_SIZE).unwrap();
        assert!(buffer_b.write(0, b"secret"));
        let mut out = [0u8; 6];
        assert_eq!(
            a.device_view().read(buffer_b.bus_address(), &mut out),
            Err(DmaFault {
                addr: buffer_b.bus_address(),
                len: 6,
                direction: DmaDirection::Read
            })
        );
        assert_eq!(out, [0; 6], "nothing read");
        assert!(
            a.device_view()
                .write(buffer_b.bus_address(), b"XX")
                .is_err()
        );
        assert_eq!(
            dma_faults(&h.verifier),
            vec![
                (Some("hcaA".into()), buffer_b.bus_address(), 6),
                (Some("hcaA".into()), buffer_b.bus_address(), 2),
            ]
        );
        b.device_view()
            .read(buffer_b.bus_address(), &mut out)
            .unwrap();
        assert_eq!(&out, b"secret", "the refused write touched nothing");
        // Freeing through the wrong adapter is refused and recorded.
        a.free_common(buffer_b);
        assert_eq!(h.verifier.take().len(), 1);
        assert_eq!(b.leaks().len(), 1, "still live on its own adapter");
    }

    #[test]
    fn unmapped_and_freed_addresses_fault() {
        let h = host(3);
        let a = h.iommu.create_adapter("hca").unwrap();
        let dev = a.device_view();
        let block = h.pool.alloc("hca", *b"Mad ", 256).unwrap();
        let locker = HostLocker::new(h.pool.kernel_space(), None);
        let locked = locker
            .lock(RequestorMode::Kernel, block.va(), 256, true)
            .unwrap();
        let mapping = a.map(&locked).unwrap();
        let bus = mapping.page_bus_address(0).unwrap() + u64::from(locked.byte_offset());
        dev.write(bus, b"mad").unwrap();
        let mut out = [0u8; 3];
        assert!(block.read(0, &mut out));
        assert_eq!(&out, b"mad");
        a.unmap(mapping);
        assert!(!a.is_live(bus));
        assert!(dev.read(bus, &mut out).is_err(), "stale after unmap");

        let buffer = a.alloc_common(10).unwrap();
        let cbus = buffer.bus_address();
        a.free_common(buffer);
        assert!(dev.write(cbus, &[1]).is_err(), "stale after free");
        assert_eq!(dma_faults(&h.verifier).len(), 2);
        drop(locked);
        h.pool.free(block);
        assert_eq!(h.pool.kernel_space().locked_pages(), 0);
    }

    #[test]
    fn common_buffers_are_shared_between_cpu_and_device() {
        let h = host(4);
        let a = h.iommu.create_adapter("hca").unwrap();
        let dev = a.device_view();
        let ring = a.alloc_common(3 * PAGE_SIZE - 100).unwrap();
        assert_eq!(ring.len(), 3 * PAGE_SIZE - 100);
        assert_eq!(ring.bus_address() % PAGE_SIZE as u64, 0);
        let mut out = [0xFFu8; 16];
        assert!(ring.read(0, &mut out));
        assert_eq!(out, [0; 16], "zeroed");
        // CPU writes across a page boundary, the device reads them.
        assert!(ring.write(4090, b"0123456789ab"));
        let mut seen = [0u8; 12];
        dev.read(ring.bus_address() + 4090, &mut seen).unwrap();
        assert_eq!(&seen, b"0123456789ab");
        // The device writes across the next boundary, the CPU reads them.
        dev.write(ring.bus_address() + 8190, b"cqe!").unwrap();
        let mut cpu = [0u8; 4];
        assert!(ring.read(8190, &mut cpu));
        assert_eq!(&cpu, b"cqe!");
        // CPU access past len() is refused; the device may touch the whole
        // last page, not the guard page after it.
        assert!(!ring.write(3 * PAGE_SIZE - 100, &[1]));
        assert!(!ring.read(usize::MAX, &mut cpu));
        dev.write(ring.bus_address() + 3 * 4096 - 1, &[1]).unwrap();
        assert!(
            dev.write(ring.bus_address() + 3 * 4096 - 1, &[1, 2])
                .is_err()
        );
        assert_eq!(a.alloc_common(0).unwrap_err(), NtStatus::INVALID_PARAMETER);
        assert_eq!(h.verifier.take().len(), 1);
        a.free_common(ring);
    }

    /// The device reaches the very pages the CPU uses — real, page-aligned
    /// memory — and only through its adapter's translations: each bus page
    /// of a mapping translates to the locked page's frame, and nothing
    /// else leads there.
    #[test]
    fn the_iommu_translates_to_the_cpus_own_page_frames() {
        let h = host(12);
        let a = h.iommu.create_adapter("hca").unwrap();
        let process = Process::new(9);
        let va = process.alloc(3 * PAGE_SIZE).unwrap();
        let locker = HostLocker::new(h.pool.kernel_space(), Some(&process));
        let locked = locker
            .lock(RequestorMode::User, va + 8, 2 * 4096, true)
            .unwrap();
        let mapping = a.map(&locked).unwrap();
        let table = read_lock(&a.shared.table);
        for (i, page) in locked.pages.iter().enumerate() {
            assert_eq!(page.host_address() % PAGE_SIZE, 0, "page aligned");
            let bus = mapping.page_bus_address(i).unwrap();
            let frame = table.get(&(bus >> PAGE_SHIFT)).unwrap().page.host_address();
            assert_eq!(frame, page.host_address(), "page {i}");
        }
        drop(table);
        // A device write there is a CPU-visible write of the process, and
        // the other way round.
        let bus = mapping.page_bus_address(1).unwrap();
        a.device_view().write(bus + 16, b"dma").unwrap();
        let mut out = [0u8; 3];
        process.read(va + 4096 + 16, &mut out).unwrap();
        assert_eq!(&out, b"dma");
        process.write(va + 4096 + 32, b"cpu").unwrap();
        a.device_view().read(bus + 32, &mut out).unwrap();
        assert_eq!(&out, b"cpu");
        a.unmap(mapping);
        h.verifier.assert_clean();
    }

    #[test]
    fn freed_user_buffer_stays_readable_while_locked_and_mapped() {
        let h = host(5);
        let a = h.iommu.create_adapter("hca").unwrap();
        let dev = a.device_view();
        let process = Process::new(42);
        let va = process.alloc(2 * PAGE_SIZE).unwrap();
        process.write(va + 100, b"payload").unwrap();
        let locker = HostLocker::new(h.pool.kernel_space(), Some(&process));
        let locked = locker
            .lock(RequestorMode::User, va + 100, 5000, false)
            .unwrap();
        assert_eq!(locked.byte_offset(), 100);
        assert_eq!(locked.page_count(), 2);
        let mapping = a.map(&locked).unwrap();
        assert!(!mapping.device_writable());
        let bus = mapping.page_bus_address(0).unwrap() + 100;

        process.free(va).unwrap();
        assert!(process.read(va, &mut [0u8; 1]).is_err(), "gone for the CPU");
        let mut out = [0u8; 7];
        dev.read(bus, &mut out).unwrap();
        assert_eq!(&out, b"payload", "still there for the device");
        assert!(locked.read(0, &mut out));
        assert_eq!(&out, b"payload", "and through the MDL");

        // Exit keeps it too, and reports the pages still locked.
        assert_eq!(process.exit(), 2);
        drop(locked);
        assert_eq!(process.space().locked_pages(), 0);
        dev.read(bus, &mut out).unwrap();
        assert_eq!(&out, b"payload", "the mapping holds the pages");
        // Locked read-only: the device may not write.
        assert!(dev.write(bus, b"x").is_err());
        a.unmap(mapping);
        assert!(dev.read(bus, &mut out).is_err());
        assert_eq!(dma_faults(&h.verifier).len(), 2);
    }

    #[test]
    fn lock_checks_the_range_and_the_mode() {
        let h = host(6);
        let process = Process::new(1);
        let va = process.alloc(PAGE_SIZE).unwrap();
        let ro = process.alloc_with(PAGE_SIZE, Protection::ReadOnly).unwrap();
        let block = h.pool.alloc("hca", *b"Buf ", 100).unwrap();
        let user = HostLocker::new(h.pool.kernel_space(), Some(&process));
        let kernel_only = HostLocker::new(h.pool.kernel_space(), None);
        let av = Err(STATUS_ACCESS_VIOLATION);
        let status = |r: Result<HostLockedPages, NtStatus>| r.map(|p| p.page_count());

        assert_eq!(
            status(user.lock(RequestorMode::User, va, 4096, true)),
            Ok(1)
        );
        assert_eq!(
            status(user.lock(RequestorMode::User, va, 4097, true)),
            av,
            "guard page"
        );
        assert_eq!(status(user.lock(RequestorMode::User, va - 1, 2, true)), av);
        assert_eq!(
            status(user.lock(RequestorMode::User, ro, 8, true)),
            av,
            "read-only"
        );
        assert_eq!(status(user.lock(RequestorMode::User, ro, 8, false)), Ok(1));
        assert_eq!(
            status(user.lock(RequestorMode::User, block.va(), 8, false)),
            av,
            "a kernel address from user mode"
        );
        assert_eq!(
            status(user.lock(RequestorMode::Kernel, va, 8, false)),
            av,
            "a user address"
        );
        assert_eq!(
            status(user.lock(RequestorMode::Kernel, block.va(), 100, true)),
            Ok(1)
        );
        assert_eq!(
            status(kernel_only.lock(RequestorMode::User, va, 8, false)),
            av
        );
        assert_eq!(
            status(user.lock(RequestorMode::User, va, 0, false)),
            Err(NtStatus::INVALID_PARAMETER)
        );
        assert_eq!(
            status(user.lock(RequestorMode::User, u64::MAX, 2, false)),
            av
        );
        assert_eq!(
            process.space().locked_pages(),
            0,
            "every lock above was dropped"
        );
        h.pool.free(block);
        h.verifier.assert_clean();
    }

    #[test]
    fn mappings_are_sometimes_not_contiguous_and_seeds_reproduce() {
        let run = |seed| {
            let h = host(seed);
            let a = h.iommu.create_adapter("hca").unwrap();
            let block = h.pool.alloc("hca", *b"Big ", 8 * PAGE_SIZE).unwrap();
            let locker = HostLocker::new(h.pool.kernel_space(), None);
            let locked = locker
                .lock(RequestorMode::Kernel, block.va(), 8 * 4096, true)
                .unwrap();
            let mut contiguous = 0;
            let mut addresses = Vec::new();
            for _ in 0..20 {
                let m = a.map(&locked).unwrap();
                contiguous += usize::from(m.is_bus_contiguous());
                addresses.extend((0..m.page_count()).filter_map(|i| m.page_bus_address(i)));
            }
            (contiguous, addresses)
        };
        let (contiguous, addresses) = run(7);
        assert!(contiguous < 20, "some 8-page mappings are split");
        assert_eq!(run(7).1, addresses, "same seed, same bus addresses");
        assert_ne!(run(8).1, addresses, "another seed, other addresses");
    }

    #[test]
    fn leaks_are_listed_and_reported() {
        let h = host(9);
        let a = h.iommu.create_adapter("hca").unwrap();
        let kept = a.alloc_common(100).unwrap();
        let lost = a.alloc_common(5000).unwrap();
        let lost_bus = lost.bus_address();
        drop(lost);
        let block = h.pool.alloc("hca", *b"Reg ", PAGE_SIZE).unwrap();
        let locker = HostLocker::new(h.pool.kernel_space(), None);
        let locked = locker
            .lock(RequestorMode::Kernel, block.va(), 4096, true)
            .unwrap();
        let mapping = a.map(&locked).unwrap();
        let map_bus = mapping.page_bus_address(0).unwrap();
        drop(mapping);
        // A dropped buffer is still live for the device: nothing dangles.
        a.device_view().write(lost_bus + 4999, &[1]).unwrap();
        assert_eq!(
            a.leaks(),
            vec![
                DmaLeak::CommonBuffer {
                    bus: kept.bus_address(),
                    len: 100
                },
                DmaLeak::CommonBuffer {
                    bus: lost_bus,
                    len: 5000
                },
                DmaLeak::Mapping {
                    first_bus: map_bus,
                    pages: 1
                },
            ]
        );
        a.free_common(kept);
        assert_eq!(a.report_leaks(), 2);
        let v = h.verifier.take();
        assert_eq!(v.len(), 2);
        assert!(v.iter().all(|v| v.driver.as_deref() == Some("hca")
            && matches!(v.kind, ViolationKind::DmaLeak { .. })));
        drop(locked);
        h.pool.free(block);
    }

    #[test]
    fn unmap_through_the_wrong_adapter_is_refused() {
        let h = host(10);
        let a = h.iommu.create_adapter("hcaA").unwrap();
        let b = h.iommu.create_adapter("hcaB").unwrap();
        let block = h.pool.alloc("hcaA", *b"Reg ", 10).unwrap();
        let locker = HostLocker::new(h.pool.kernel_space(), None);
        let locked = locker
            .lock(RequestorMode::Kernel, block.va(), 10, true)
            .unwrap();
        let mapping = a.map(&locked).unwrap();
        let bus = mapping.page_bus_address(0).unwrap();
        b.unmap(mapping);
        let v = h.verifier.take();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].driver.as_deref(), Some("hcaB"));
        assert!(a.is_live(bus));
        assert_eq!(a.leaks().len(), 1);
    }

    #[test]
    fn adapters_are_bounded() {
        let h = host(11);
        assert_eq!(
            Iommu::window(MAX_ADAPTERS - 1).end,
            BUS_ADDRESS_BASE + (1 << 56)
        );
        assert!(Iommu::window(MAX_ADAPTERS - 1).end < KERNEL_VA_BASE);
        lock(&h.iommu.shared.state).next_index = MAX_ADAPTERS;
        assert_eq!(
            h.iommu.create_adapter("x").unwrap_err(),
            NtStatus::INSUFFICIENT_RESOURCES
        );
    }

    mod random_sequences {
        use super::*;
        use proptest::prelude::*;
        use std::collections::HashMap;

        #[derive(Debug, Clone)]
        enum Op {
            Map {
                adapter: bool,
                start_page: usize,
                pages: usize,
                writable: bool,
            },
            Unmap {
                pick: usize,
            },
            AllocCommon {
                adapter: bool,
                len: usize,
            },
            FreeCommon {
                pick: usize,
            },
            Access {
                target: Target,
                offset: u64,
                len: usize,
                write: bool,
            },
        }

        #[derive(Debug, Clone)]
        enum Target {
            Mapping(usize),
            Common(usize),
            Stale(usize),
            Window(u64),
            Cpu,
        }

        fn op() -> impl Strategy<Value = Op> {
            let target = prop_oneof![
                3 => any::<usize>().prop_map(Target::Mapping),
                3 => any::<usize>().prop_map(Target::Common),
                1 => any::<usize>().prop_map(Target::Stale),
                1 => (0u64..64 * 4096).prop_map(Target::Window),
                1 => Just(Target::Cpu),
            ];
            // Mostly small accesses near the start of the target, some long
            // ones and some far past it.
            let offset = prop_oneof![3 => 0u64..4096, 1 => 0u64..3 * 4096];
            let len = prop_oneof![3 => 0usize..256, 1 => 0usize..6000];
            prop_oneof![
                1 => (any::<bool>(), 0usize..8, 1usize..5, any::<bool>()).prop_map(
                    |(adapter, start_page, pages, writable)| Op::Map {
                        adapter,
                        start_page,
                        pages,
                        writable
                    }
                ),
                1 => any::<usize>().prop_map(|pick| Op::Unmap { pick }),
                1 => (any::<bool>(), 1usize..3 * 4096)
                    .prop_map(|(adapter, len)| Op::AllocCommon { adapter, len }),
                1 => any::<usize>().prop_map(|pick| Op::FreeCommon { pick }),
                3 => (target, offset, len, any::<bool>()).prop_map(
                    |(target, offset, len, write)| Op::Access {
                        target,
                        offset,
                        len,
                        write
                    }
                ),
            ]
        }

        /// Live pages of adapter A as the test believes them: bus page
        /// number -> device-writable.
        type Model = HashMap<u64, bool>;

        fn expect_ok(model: &Model, addr: u64, len: usize, write: bool) -> bool {
            if len == 0 {
                return true;
            }
            let Some(end) = addr.checked_add(len as u64) else {
                return false;
            };
            ((addr >> 12)..=((end - 1) >> 12))
                .all(|p| model.get(&p).is_some_and(|&writable| writable || !write))
        }

        proptest! {
            #[test]
            fn faults_exactly_when_not_live(ops in proptest::collection::vec(op(), 1..60), seed: u64) {
                let h = host(seed);
                let adapters = [
                    h.iommu.create_adapter("A").unwrap(),
                    h.iommu.create_adapter("B").unwrap(),
                ];
                let dev = adapters[0].device_view();
                let process = Process::new(1);
                let va = process.alloc(8 * PAGE_SIZE).unwrap();
                let locker = HostLocker::new(h.pool.kernel_space(), Some(&process));
                let mut model = Model::new();
                let mut mappings: Vec<(usize, HostDmaMapping, HostLockedPages)> = Vec::new();
                let mut commons: Vec<(usize, HostCommonBuffer)> = Vec::new();
                let mut stale: Vec<u64> = Vec::new();
                let mut expected_faults = 0u64;

                for op in ops {
                    match op {
                        Op::Map { adapter, start_page, pages, writable } => {
                            let pages = pages.min(8 - start_page);
                            let locked = locker.lock(
                                RequestorMode::User,
                                va + (start_page * PAGE_SIZE) as u64 + 8,
                                (pages * PAGE_SIZE - 8) as u64,
                                writable,
                            ).unwrap();
                            let which = usize::from(adapter);
                            let m = adapters[which].map(&locked).unwrap();
                            prop_assert_eq!(m.page_count(), locked.page_count());
                            if which == 0 {
                                for i in 0..m.page_count() {
                                    model.insert(m.page_bus_address(i).unwrap() >> 12, writable);
                                }
                            }
                            mappings.push((which, m, locked));
                        }
                        Op::Unmap { pick } if !mappings.is_empty() => {
                            let (which, m, _locked) = mappings.swap_remove(pick % mappings.len());
                            for i in 0..m.page_count() {
                                let bus = m.page_bus_address(i).unwrap();
                                if which == 0 {
                                    model.remove(&(bus >> 12));
                                }
                                stale.push(bus);
                            }
                            adapters[which].unmap(m);
                        }
                        Op::AllocCommon { adapter, len } => {
                            let which = usize::from(adapter);
                            let c = adapters[which].alloc_common(len).unwrap();
                            if which == 0 {
                                for p in 0..pages_for(len) as u64 {
                                    model.insert((c.bus_address() >> 12) + p, true);
                                }
                            }
                            commons.push((which, c));
                        }
                        Op::FreeCommon { pick } if !commons.is_empty() => {
                            let (which, c) = commons.swap_remove(pick % commons.len());
                            if which == 0 {
                                for p in 0..pages_for(c.len()) as u64 {
                                    model.remove(&((c.bus_address() >> 12) + p));
                                }
                            }
                            stale.push(c.bus_address());
                            adapters[which].free_common(c);
                        }
                        Op::Access { target, offset, len, write } => {
                            let base = match target {
                                Target::Mapping(i) if !mappings.is_empty() => {
                                    let (_, m, _) = &mappings[i % mappings.len()];
                                    m.page_bus_address(0).unwrap()
                                }
                                Target::Common(i) if !commons.is_empty() => {
                                    commons[i % commons.len()].1.bus_address()
                                }
                                Target::Stale(i) if !stale.is_empty() => stale[i % stale.len()],
                                Target::Window(o) => adapters[0].window().start + o,
                                _ => va,
                            };
                            let addr = base.wrapping_add(offset);
                            let ok = expect_ok(&model, addr, len, write);
                            let data: Vec<u8> = (0..len).map(|i| (i as u8) ^ (seed as u8)).collect();
                            if write {
                                prop_assert_eq!(dev.write(addr, &data).is_ok(), ok);
                                if ok {
                                    let mut back = vec![0u8; len];
                                    prop_assert!(dev.read(addr, &mut back).is_ok());
                                    prop_assert_eq!(back, data);
                                }
                            } else {
                                let mut out = vec![0u8; len];
                                prop_assert_eq!(dev.read(addr, &mut out).is_ok(), ok);
                            }
                            expected_faults += u64::from(!ok);
                        }
                        _ => {}
                    }
                    prop_assert_eq!(adapters[0].faults(), expected_faults);
                }
                let violations = h.verifier.take();
                prop_assert_eq!(violations.len() as u64, expected_faults);
                prop_assert!(violations.iter().all(|v| v.driver.as_deref() == Some("A")));
                prop_assert_eq!(
                    adapters[0].leaks().len() + adapters[1].leaks().len(),
                    mappings.len() + commons.len()
                );
            }
        }
    }
}
