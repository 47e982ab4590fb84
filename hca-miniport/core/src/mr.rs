//! The memory translation service: memory regions over the MPT and the MTT
//! (guide 7.1; PRM 6.0, 7.1). The verbs embed one [`MemoryTranslation`] per
//! started device; it depends on nothing above the command interface.
//!
//! Contract:
//! - **Two resources** (guide 7, "region entry" and "translation entries"):
//!   MPT entries, numbered by a [`KeyAllocator`] (keys `index << 8 | tag`,
//!   PRM 7.1), and runs of MTT entries from a [`RangeAllocator`] over the
//!   entries after [`BringUpReport::reserved_mtt_entries`] (the EQ's). Both
//!   sit behind one [`SpinLock`], held only for the bookkeeping: never
//!   across a command submission, a lock, a map or an unmap.
//! - **Register** ([`register_virtual`](MemoryTranslation::register_virtual),
//!   guide 7.1.1.1): validate, lock the pages (writable iff the rights let
//!   the device write: local write, remote write, remote atomic), map them
//!   through the device's DMA adapter, take an MTT range and an MPT index,
//!   write the mapping's per-page *bus* addresses with `WRITE_MTT` (as many
//!   commands as the mailbox needs), then `SW2HW_MPT`. Every command goes
//!   through [`Hca::submit`]; each step continues from the previous one's
//!   continuation, so nothing blocks and the verb can be issued at
//!   DISPATCH_LEVEL for kernel memory. Any failure undoes what was done
//!   (MTT range and MPT index freed, unmapped, unlocked) before the
//!   caller's continuation hears of it. A CPU address is never written to
//!   the device.
//! - **IRQL.** Locking *user* pages is `MmProbeAndLockPages` on pageable
//!   memory: PASSIVE_LEVEL or APC_LEVEL, in the owning process's context.
//!   The lock is the one synchronous step of a registration, done in the
//!   caller's context before anything goes asynchronous; so the verbs layer
//!   must call `register_virtual` (and a re-registration with a new range)
//!   for user memory at PASSIVE_LEVEL in the caller's thread. From a DPC a
//!   user registration is refused with [`MrError::IrqlTooHigh`] without
//!   touching the locker. Kernel memory may be registered at DISPATCH_LEVEL.
//! - **Physical** ([`register_physical`](MemoryTranslation::register_physical),
//!   guide 7.1.1.2): kernel callers give bus page addresses (already mapped
//!   for this device), a page size, the first byte's offset and a length;
//!   the list must be exactly the pages the region spans, each aligned.
//!   The requested I/O virtual address is used as given.
//! - **Shared** ([`register_shared`](MemoryTranslation::register_shared),
//!   guide 7.1.1.5): a new MPT entry (new keys, any PD, any rights the
//!   pages allow) over the same MTT entries. The translation (MTT range,
//!   locked pages, mapping) is reference-counted and released with its
//!   last region (guide 7.1.1.6).
//! - **Re-register** ([`reregister`](MemoryTranslation::reregister), guide
//!   7.1.1.3, and Reregister Physical Memory of Table 4-1, one path): new
//!   PD and/or rights and/or translation — a virtual range in the address
//!   space the region's pages were locked in, or a physical page list
//!   ([`NewTranslation`]; kernel only, for a region registered either way;
//!   a physical region gets a new range only as a page list,
//!   [`MrError::PhysicalRange`]). A new virtual range that lies in
//!   the pages already locked reuses the translation; otherwise a new one
//!   is built and the old released (unmapped and unlocked if it was
//!   locked) after the switch. Keys: the MPT index
//!   (and so the region's handle) stays, the tag moves on, so the L_Key and
//!   R_Key change and old keys stop matching (PRM 7.1: the device requires
//!   the key's low byte to equal the entry's tag; a re-registration, as
//!   the guide says, is a deregistration and a registration, whose keys
//!   are new). Failure before `HW2SW_MPT` (input, lock, map, MTT, `WRITE_MTT`)
//!   or of `HW2SW_MPT` itself leaves the old region as it was; failure of
//!   the new `SW2HW_MPT` re-creates the old entry with its old key, and
//!   only if that fails too is the region lost ([`MrError::RegionLost`]).
//! - **Deregister** ([`deregister`](MemoryTranslation::deregister), guide
//!   7.1.1.6): refused with [`MrError::WindowsBound`] while windows are
//!   counted as bound ([`MemoryRegion::bind_window`] and
//!   [`MemoryRegion::unbind_window`], for a caller that knows its binds
//!   completed), and so is a device `RESOURCE_BUSY` (the device's own
//!   `window_count`, which is what the verbs rely on: `verbs::region`);
//!   the region comes back untouched. Otherwise
//!   `HW2SW_MPT`, then the key is freed and the translation released if
//!   this was its last region. On a failed device (timeout, catastrophic
//!   error) the host resources are released anyway: the device will be
//!   reset before it runs again, and unmapping is what keeps it out of the
//!   memory meanwhile.
//! - **Query** ([`query`](MemoryTranslation::query)): `QUERY_MPT`, decoded.
//! - **Keys.** MPT index 0 is never handed out, so the raw key 0 (which
//!   `ib_types::mr::MrKeys` uses for "no R_Key") names no entry. A region's
//!   R_Key is its key when its rights include a remote right, else 0.
//!   Windows share the MPT table: the MW code takes, re-tags and frees
//!   their indices through [`alloc_window_key`](MemoryTranslation::alloc_window_key),
//!   [`next_window_key`](MemoryTranslation::next_window_key) and
//!   [`free_window_key`](MemoryTranslation::free_window_key).
//! - Every continuation is called exactly once: from the DPC when a device
//!   command was involved, or inline in the caller when the request was
//!   refused before any command (or the device is already failed).
//! - A [`MemoryRegion`] dropped without deregistering leaks its DMA mapping
//!   (the platform's verifier reports it), as a lost handle would on
//!   Windows; after [`Hca::stop`] use
//!   [`release_after_reset`](MemoryTranslation::release_after_reset).

mod error;

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec::Vec;

use driver_platform::{
    DmaAdapter, DmaMapping, Irql, LockedPages, MemoryLocker, Platform, RequestorMode, SpinLock,
};
use hca_prm::cmd::{MAX_MTT_PER_WRITE, Opcode, Table};
use hca_prm::mpt::{MptEntry, MptKind, PAGE_SHIFT_RANGE, mtt_pages};
use hca_prm::{Le32, Le64};
use ib_types::access::AccessFlags;
use ib_types::wr::{LKey, RKey};
use zerocopy::{FromBytes, IntoBytes};

use crate::cmd::{Command, CommandError};
use crate::hca::Hca;
use crate::init::BringUpReport;
use crate::resources::{EntryRange, KeyAllocator, MemoryKey, RangeAllocator};

pub use error::MrError;

/// log2 of the host page size the core locks and maps (PRM 5.3).
/// The longest transfer both shells declare for the device's DMA (KMDF:
/// `WDF_DMA_ENABLER_CONFIG.MaximumLength`; the simulated host:
/// `DmaDescription::maximum_length`): one scatter/gather list describes at
/// most this many bytes, so a registration is mapped as lists of at most
/// this size (the KMDF shell's pieces). A page multiple.
pub const MAX_DMA_TRANSFER: usize = 1 << 20;

const HOST_PAGE_SHIFT: u8 = 12;
/// Bytes of a host page.
const HOST_PAGE: u64 = 1 << HOST_PAGE_SHIFT;
/// Protection domains are 24-bit (PRM 7.1).
const PD_LIMIT: u32 = 1 << 24;

type Pages<P> = <<P as Platform>::Dma as DmaAdapter>::Pages;

/// Any locker of the platform's pages: the shell's (kernel memory, or a
/// process's in its context) or a user request's pages locked in its
/// caller's context (`verbs::caller::CallerLocks`).
pub type DynLocker<P> = dyn MemoryLocker<Pages = Pages<P>>;
type Mapping<P> = <<P as Platform>::Dma as DmaAdapter>::Mapping;
/// A lock, its mapping, and the bus address of each page.
type LockedAndMapped<P> = (Pages<P>, Mapping<P>, Vec<u64>);

/// What a translation's MTT entries describe, and what releasing it undoes.
enum Backing<P: Platform> {
    /// Pages this service locked and mapped.
    Locked {
        /// The lock (an MDL); dropping it unlocks.
        pages: Pages<P>,
        /// The adapter's mapping of them.
        mapping: Mapping<P>,
        /// Whose address space.
        mode: RequestorMode,
        /// Virtual address of the first locked page (page aligned).
        first_page_va: u64,
    },
    /// A caller's list of bus pages: nothing to undo on the host.
    Physical,
}

/// An MTT range and the pages it describes; shared by the regions over it.
struct Translation<P: Platform> {
    range: EntryRange,
    log_page_size: u8,
    bus_pages: Arc<[u64]>,
    device_writable: bool,
    backing: Backing<P>,
}

/// User memory locked and mapped for the device without a region
/// ([`MemoryTranslation::pin_user`]).
#[must_use = "pinned memory dropped without unpinning leaks its DMA mapping"]
pub(crate) struct PinnedUser<P: Platform> {
    pages: Pages<P>,
    mapping: Mapping<P>,
    /// Bus address of each page, first to last.
    pub(crate) bus_pages: Vec<u64>,
    /// First byte pinned.
    pub(crate) va: u64,
    /// Bytes pinned.
    pub(crate) length: u64,
}

impl<P: Platform> PinnedUser<P> {
    /// The bus address of user address `va` inside the pinned range.
    pub(crate) fn bus_address(&self, va: u64) -> Option<u64> {
        let offset = va.checked_sub(self.va)?;
        if offset >= self.length {
            return None;
        }
        let in_pages = (self.va & (HOST_PAGE - 1)) + offset;
        let page = usize::try_from(in_pages >> HOST_PAGE_SHIFT).ok()?;
        Some(self.bus_pages.get(page)? + (in_pages & (HOST_PAGE - 1)))
    }
}

impl<P: Platform> Translation<P> {
    /// The MTT entry and page offset of virtual address `va`, if the page
    /// holding it and every page up to `va + length` are locked here.
    fn locate(&self, mode: RequestorMode, va: u64, length: u64) -> Option<(u32, u32)> {
        let Backing::Locked {
            mode: locked_mode,
            first_page_va,
            ..
        } = &self.backing
        else {
            return None;
        };
        if *locked_mode != mode {
            return None;
        }
        let first_page = va.checked_sub(*first_page_va)? >> HOST_PAGE_SHIFT;
        let page_offset = (va & (HOST_PAGE - 1)) as u32;
        let pages = mtt_pages(page_offset, HOST_PAGE_SHIFT, length)?;
        let end = first_page.checked_add(pages)?;
        if end > self.bus_pages.len() as u64 {
            return None;
        }
        let entry = u64::from(self.range.start()) + first_page;
        Some((u32::try_from(entry).ok()?, page_offset))
    }
}

/// A registered memory region: an MPT entry of kind region over a
/// (possibly shared) translation. Owned by the verbs layer; give it back to
/// [`MemoryTranslation::deregister`].
#[must_use = "a region dropped without deregistration leaks its DMA mapping"]
pub struct MemoryRegion<P: Platform> {
    key: MemoryKey,
    pd: u32,
    access: AccessFlags,
    start: u64,
    length: u64,
    mtt_index: u32,
    page_offset: u32,
    bound_windows: u32,
    translation: Arc<Translation<P>>,
}

impl<P: Platform> core::fmt::Debug for MemoryRegion<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("key", &format_args!("{:#x}", self.key.raw()))
            .field("pd", &self.pd)
            .field("access", &self.access)
            .field("start", &format_args!("{:#x}", self.start))
            .field("length", &self.length)
            .field("mtt_index", &self.mtt_index)
            .field("bound_windows", &self.bound_windows)
            .finish_non_exhaustive()
    }
}

impl<P: Platform> MemoryRegion<P> {
    /// The MPT key (`index << 8 | tag`).
    pub fn key(&self) -> MemoryKey {
        self.key
    }

    /// The L_Key: the region's key.
    pub fn lkey(&self) -> LKey {
        LKey::new(self.key.raw())
    }

    /// The R_Key: the region's key if its rights include a remote right,
    /// else 0 (`ib_types::mr::MrKeys`).
    pub fn rkey(&self) -> RKey {
        RKey::new(if self.access.has_remote() {
            self.key.raw()
        } else {
            0
        })
    }

    /// The MPT index (stable across re-registration: the region's number).
    pub fn mpt_index(&self) -> u32 {
        self.key.index()
    }

    /// The protection domain number.
    pub fn pd(&self) -> u32 {
        self.pd
    }

    /// The access rights.
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// The first (I/O) virtual address.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// Bytes registered.
    pub fn length(&self) -> u64 {
        self.length
    }

    /// The first MTT entry the MPT entry names.
    pub fn mtt_index(&self) -> u32 {
        self.mtt_index
    }

    /// Offset of [`start`](Self::start) in its first page.
    pub fn page_offset(&self) -> u32 {
        self.page_offset
    }

    /// log2 of the page size of the translation.
    pub fn log_page_size(&self) -> u8 {
        self.translation.log_page_size
    }

    /// The whole MTT range of the translation (shared regions and regions
    /// re-registered within their pages use part or all of it).
    pub fn mtt_range(&self) -> EntryRange {
        self.translation.range
    }

    /// The bus addresses written to the translation's MTT entries, first
    /// to last (the DMA mapping's per-page addresses, or the physical list).
    pub fn bus_pages(&self) -> &[u64] {
        &self.translation.bus_pages
    }

    /// True if the translation's pages are device-writable.
    pub fn device_writable(&self) -> bool {
        self.translation.device_writable
    }

    /// True if the region was registered from locked virtual memory (as
    /// opposed to a physical page list).
    pub fn is_virtual(&self) -> bool {
        matches!(self.translation.backing, Backing::Locked { .. })
    }

    /// True if `other` uses the same translation (a shared registration).
    pub fn shares_translation_with(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.translation, &other.translation)
    }

    /// Regions over this region's translation, this one included.
    pub fn translation_users(&self) -> usize {
        Arc::strong_count(&self.translation)
    }

    /// Memory windows bound to the region, as the MW code counted them.
    pub fn bound_windows(&self) -> u32 {
        self.bound_windows
    }

    /// Hook for the MW code: a window was bound to this region (a bind
    /// completed). Deregistration is refused until it is unbound.
    pub fn bind_window(&mut self) {
        self.bound_windows = self.bound_windows.saturating_add(1);
    }

    /// Hook for the MW code: a window bound to this region was unbound,
    /// invalidated or destroyed. Fails, changing nothing, if none is bound.
    pub fn unbind_window(&mut self) -> Result<(), MrError> {
        self.bound_windows = self
            .bound_windows
            .checked_sub(1)
            .ok_or(MrError::NoWindowBound)?;
        Ok(())
    }

    /// The MPT entry describing the region, with `key`'s tag.
    fn mpt_entry(&self, key: MemoryKey) -> MptEntry {
        MptEntry {
            kind: MptKind::Region.code(),
            state: 1,
            tag: key.tag(),
            access: Le32::new(self.access.bits()),
            pd: Le32::new(self.pd),
            mtt_index: Le32::new(self.mtt_index),
            start: Le64::new(self.start),
            length: Le64::new(self.length),
            log_page_size: self.translation.log_page_size,
            page_offset: Le32::new(self.page_offset),
            ..MptEntry::default()
        }
    }
}

/// A registration of virtual memory (guide 7.1.1.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtualRegion {
    /// Whose address space `va` is in (user: the calling process).
    pub mode: RequestorMode,
    /// First byte.
    pub va: u64,
    /// Bytes (non-zero).
    pub length: u64,
    /// Rights (IBA C11-13: remote write or atomic needs local write).
    pub access: AccessFlags,
    /// Protection domain number (24 bits).
    pub pd: u32,
}

/// A registration of a physical page list (guide 7.1.1.2; kernel only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhysicalRegion<'a> {
    /// The I/O virtual address of the region's first byte.
    pub iova: u64,
    /// Bytes (non-zero).
    pub length: u64,
    /// Offset of the first byte in the first page.
    pub first_byte_offset: u32,
    /// log2 of the page size, 12..=30.
    pub page_shift: u8,
    /// Bus addresses of the pages (from this device's DMA adapter), each
    /// aligned to the page size; exactly the pages the region spans.
    pub pages: &'a [u64],
    /// Rights.
    pub access: AccessFlags,
    /// Protection domain number.
    pub pd: u32,
}

/// A shared registration over an existing region's translation (guide
/// 7.1.1.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedRegion {
    /// The new region's first (I/O) virtual address; its length is the
    /// existing region's.
    pub va: u64,
    /// Rights of the new region (within what the pages allow).
    pub access: AccessFlags,
    /// Protection domain number of the new region.
    pub pd: u32,
}

/// A physical page list: the translation of a physical registration or
/// re-registration (guide 7.1.1.2; kernel callers only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhysicalPages<'a> {
    /// The I/O virtual address of the region's first byte.
    pub iova: u64,
    /// Bytes (non-zero).
    pub length: u64,
    /// Offset of the first byte in the first page.
    pub first_byte_offset: u32,
    /// log2 of the page size, 12..=30.
    pub page_shift: u8,
    /// Bus addresses of the pages, each aligned to the page size; exactly
    /// the pages the region spans.
    pub pages: &'a [u64],
}

/// The new translation of a re-registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NewTranslation<'a> {
    /// A range `va..va+length` of the address space the region's pages
    /// were locked in (Reregister Memory Region); refused for a region
    /// registered from a physical list ([`MrError::PhysicalRange`]).
    Virtual {
        /// First byte.
        va: u64,
        /// Bytes.
        length: u64,
    },
    /// A physical page list (Reregister Physical Memory, guide Table 4-1;
    /// kernel only), for a region registered either way: a virtual
    /// region's locked pages are released once the device switched.
    Physical(PhysicalPages<'a>),
}

/// What a re-registration changes (guide 7.1.1.3); `None` keeps the
/// current value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reregistration<'a> {
    /// A new protection domain.
    pub pd: Option<u32>,
    /// New rights.
    pub access: Option<AccessFlags>,
    /// A new translation.
    pub translation: Option<NewTranslation<'a>>,
}

/// What a re-registration that failed leaves.
pub struct ReregFailure<P: Platform> {
    /// Why it failed.
    pub error: MrError,
    /// The old region, still registered with its old keys; `None` when it
    /// was lost ([`MrError::RegionLost`]).
    pub region: Option<MemoryRegion<P>>,
}

/// A deregistration refused: the region is still registered.
pub struct DeregFailure<P: Platform> {
    /// Why.
    pub error: MrError,
    /// The region, unchanged.
    pub region: MemoryRegion<P>,
}

impl<P: Platform> core::fmt::Debug for ReregFailure<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ReregFailure")
            .field("error", &self.error)
            .field("region", &self.region)
            .finish()
    }
}

impl<P: Platform> core::fmt::Debug for DeregFailure<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DeregFailure")
            .field("error", &self.error)
            .field("region", &self.region)
            .finish()
    }
}

/// An MPT entry as `QUERY_MPT` reported it (PRM 7.1), decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MptQuery {
    /// The entry's kind (raw, as the device reported it; see
    /// [`MptKind`]).
    pub kind: u8,
    /// Valid (regions) or bound (windows).
    pub valid: bool,
    /// The entry's current key (`index << 8 | tag`).
    pub key: MemoryKey,
    /// Rights, as raw bits (unknown bits kept).
    pub access_bits: u32,
    /// Protection domain.
    pub pd: u32,
    /// First MTT entry.
    pub mtt_index: u32,
    /// First virtual address.
    pub start: u64,
    /// Bytes.
    pub length: u64,
    /// log2 of the page size.
    pub log_page_size: u8,
    /// Offset of `start` in its first page.
    pub page_offset: u32,
    /// Windows bound in the region, as the device counts them.
    pub window_count: u32,
}

impl MptQuery {
    /// The entry's kind, if the device reported a known one.
    pub fn kind(&self) -> Option<MptKind> {
        MptKind::from_code(self.kind).ok()
    }

    /// The rights, if the device reported only known bits.
    pub fn access(&self) -> Option<AccessFlags> {
        AccessFlags::from_bits(self.access_bits)
    }
}

/// What the service has handed out, for diagnostics and leak checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TranslationUsage {
    /// MTT entries the service manages (the table after the reserved ones).
    pub mtt_capacity: u32,
    /// MTT entries free.
    pub mtt_free: u32,
    /// MPT entries free (index 0 is never handed out).
    pub mpt_free: u32,
    /// Live regions.
    pub regions: u32,
    /// Live translations (each shared by one or more regions).
    pub translations: u32,
}

/// Continuation of a registration: the region, or why there is none.
pub type RegionContinuation<P> = Box<dyn FnOnce(Result<MemoryRegion<P>, MrError>) + Send>;
/// Continuation of a re-registration.
pub type ReregContinuation<P> = Box<dyn FnOnce(Result<MemoryRegion<P>, ReregFailure<P>>) + Send>;
/// Continuation of a deregistration.
pub type DeregContinuation<P> = Box<dyn FnOnce(Result<(), DeregFailure<P>>) + Send>;
/// Continuation of a query.
pub type QueryContinuation = Box<dyn FnOnce(Result<MptQuery, MrError>) + Send>;

struct Allocators {
    mtt: RangeAllocator,
    keys: KeyAllocator,
    regions: u32,
    translations: u32,
    /// The MPT entries the device holds now, by index, with the MTT run
    /// each describes: what D0 entry writes back (same keys) after the
    /// device lost its tables ([`MemoryTranslation::restore_commands`]).
    live: alloc::collections::BTreeMap<u32, LiveMpt>,
}

/// A registered MPT entry as the device was given it.
struct LiveMpt {
    entry: MptEntry,
    first_mtt: u32,
    bus_pages: Arc<[u64]>,
}

impl LiveMpt {
    fn of<P: Platform>(region: &MemoryRegion<P>, entry: MptEntry) -> Self {
        Self {
            entry,
            first_mtt: region.translation.range.start(),
            bus_pages: Arc::clone(&region.translation.bus_pages),
        }
    }
}

struct Shared<P: Platform> {
    state: SpinLock<P, Allocators>,
    /// The first MTT entry the service manages (after the EQ's).
    mtt_first: u32,
    /// `max_mr_size`.
    max_region_bytes: u64,
    /// MTT entries per `WRITE_MTT` mailbox.
    mtts_per_write: usize,
}

/// The memory translation service of one started device (see the module
/// doc). Cloning gives another handle to the same service.
pub struct MemoryTranslation<P: Platform> {
    shared: Arc<Shared<P>>,
}

impl<P: Platform> Clone for MemoryTranslation<P> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<P: Platform> core::fmt::Debug for MemoryTranslation<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("MemoryTranslation")
            .field("mtt_first", &self.shared.mtt_first)
            .finish_non_exhaustive()
    }
}

/// Continuation of one step of a chain.
type Step = Box<dyn FnOnce(Result<(), CommandError>) + Send>;

impl<P: Platform> MemoryTranslation<P> {
    /// The service for a device brought up as `report` says: MPT entries
    /// `1..2^log_mpts`, MTT entries `reserved_mtt_entries..2^log_mtts`.
    pub fn new(report: &BringUpReport) -> Result<Self, MrError> {
        let mpt_log = report.table(Table::Mpt).log_count;
        let mtt_log = report.table(Table::Mtt).log_count;
        let mpts = 1u64.checked_shl(u32::from(mpt_log)).unwrap_or(u64::MAX);
        let mtts = 1u64.checked_shl(u32::from(mtt_log)).unwrap_or(u64::MAX);
        let mpts =
            u32::try_from(mpts).map_err(|_| crate::resources::ResourceError::InvalidCapacity)?;
        // An MTT index is 32 bits in the MPT entry.
        let mtts = u32::try_from(mtts).unwrap_or(u32::MAX);
        let reserved = report.reserved_mtt_entries.min(mtts);
        let mut keys = KeyAllocator::new(mpts)?;
        // Hold index 0 back: raw key 0 means "no R_Key".
        if mpts > 0 {
            keys.alloc()?;
        }
        let mailbox = usize::from(report.capabilities.max_mailbox_bytes.get());
        let mtts_per_write = (mailbox.saturating_sub(8) / 8).clamp(1, MAX_MTT_PER_WRITE);
        Ok(Self {
            shared: Arc::new(Shared {
                state: SpinLock::<P, _>::new(Allocators {
                    mtt: RangeAllocator::new(mtts - reserved),
                    keys,
                    regions: 0,
                    translations: 0,
                    live: alloc::collections::BTreeMap::new(),
                }),
                mtt_first: reserved,
                max_region_bytes: report.capabilities.max_mr_size.get(),
                mtts_per_write,
            }),
        })
    }

    /// What is handed out now.
    pub fn usage(&self) -> TranslationUsage {
        let state = self.shared.state.lock();
        TranslationUsage {
            mtt_capacity: state.mtt.capacity(),
            mtt_free: state.mtt.free_entries(),
            mpt_free: state.keys.free_count(),
            regions: state.regions,
            translations: state.translations,
        }
    }

    /// Hook for the MW code: takes an MPT index for a memory window (the
    /// table is shared with regions, PRM 7.1) and returns its first key.
    /// The window's `SW2HW_MPT` is the MW code's.
    pub fn alloc_window_key(&self) -> Result<MemoryKey, MrError> {
        self.alloc_key()
    }

    /// Hook for the MW code: the window's entry gets its next tag (a bind
    /// changes the key, PRM 7.1, guide 7.2); returns the new key. Fails,
    /// changing nothing, if the index is not allocated.
    pub fn next_window_key(&self, index: u32) -> Result<MemoryKey, MrError> {
        Ok(self.shared.state.lock().keys.bump_tag(index)?)
    }

    /// Hook for the MW code: frees a window's MPT index after its
    /// `HW2SW_MPT`, whatever its tag (a type 2 window's tag is the
    /// poster's). Fails, changing nothing, if the index is not allocated
    /// or is index 0.
    pub fn free_window_key(&self, index: u32) -> Result<(), MrError> {
        if index == 0 {
            return Err(MrError::Resources(
                crate::resources::ResourceError::Reserved { number: 0 },
            ));
        }
        Ok(self.shared.state.lock().keys.free_index(index)?)
    }

    /// Registers `request.length` bytes at `request.va` (guide 7.1.1.1; see
    /// the module doc). `irql` is the caller's IRQL: user memory needs
    /// PASSIVE_LEVEL or APC_LEVEL and the owning process's context, kernel
    /// memory DISPATCH_LEVEL or below. The pages are locked before this
    /// returns; `continuation` gets the region once `SW2HW_MPT` completes.
    pub fn register_virtual(
        &self,
        hca: &Arc<Hca<P>>,
        locker: &DynLocker<P>,
        irql: Irql,
        request: VirtualRegion,
        continuation: RegionContinuation<P>,
    ) {
        let translation = self
            .validate(request.va, request.length, request.access, request.pd)
            .and_then(|()| {
                self.lock_and_map(
                    hca,
                    locker,
                    irql,
                    request.mode,
                    request.va,
                    request.length,
                    needs_write(request.access),
                )
            });
        let translation = match translation {
            Ok(translation) => translation,
            Err(error) => return continuation(Err(error)),
        };
        let region = MemoryRegion {
            key: MemoryKey::from_raw(0),
            pd: request.pd,
            access: request.access,
            start: request.va,
            length: request.length,
            mtt_index: translation.range.start(),
            page_offset: (request.va & (HOST_PAGE - 1)) as u32,
            bound_windows: 0,
            translation: Arc::new(translation),
        };
        self.write_and_create(hca, region, continuation);
    }

    /// Registers a physical page list (guide 7.1.1.2; kernel callers only).
    /// The list is validated (page size, offset, exactly the pages spanned,
    /// each aligned) before anything is allocated.
    pub fn register_physical(
        &self,
        hca: &Arc<Hca<P>>,
        request: PhysicalRegion<'_>,
        continuation: RegionContinuation<P>,
    ) {
        let pages = PhysicalPages {
            iova: request.iova,
            length: request.length,
            first_byte_offset: request.first_byte_offset,
            page_shift: request.page_shift,
            pages: request.pages,
        };
        match self.physical_translation(&pages, request.access, request.pd) {
            Ok(translation) => {
                let region = MemoryRegion {
                    key: MemoryKey::from_raw(0),
                    pd: request.pd,
                    access: request.access,
                    start: request.iova,
                    length: request.length,
                    mtt_index: translation.range.start(),
                    page_offset: request.first_byte_offset,
                    bound_windows: 0,
                    translation: Arc::new(translation),
                };
                self.write_and_create(hca, region, continuation);
            }
            Err(error) => continuation(Err(error)),
        }
    }

    /// Registers a new region over `existing`'s translation (guide
    /// 7.1.1.5): new keys, `request`'s PD, rights and start address, the
    /// same length and MTT entries. Nothing is locked or written to the
    /// MTT; only `SW2HW_MPT` is issued.
    pub fn register_shared(
        &self,
        hca: &Arc<Hca<P>>,
        existing: &MemoryRegion<P>,
        request: SharedRegion,
        continuation: RegionContinuation<P>,
    ) {
        let checked = self
            .validate(request.va, existing.length, request.access, request.pd)
            .and_then(|()| {
                if needs_write(request.access) && !existing.translation.device_writable {
                    Err(MrError::ReadOnlyPages {
                        access: request.access,
                    })
                } else {
                    Ok(())
                }
            })
            .and_then(|()| self.alloc_key());
        let key = match checked {
            Ok(key) => key,
            Err(error) => return continuation(Err(error)),
        };
        let region = MemoryRegion {
            key,
            pd: request.pd,
            access: request.access,
            start: request.va,
            length: existing.length,
            mtt_index: existing.mtt_index,
            page_offset: existing.page_offset,
            bound_windows: 0,
            translation: Arc::clone(&existing.translation),
        };
        self.create_mpt(hca, region, continuation);
    }

    /// Re-registers `region` (guide 7.1.1.3; see the module doc for what
    /// is reused, which keys result, and what a failure leaves). A new
    /// range of a virtual region is locked in `irql`'s context as
    /// [`register_virtual`](Self::register_virtual) does, with `locker`
    /// (used for nothing else); a new physical page list is validated as
    /// [`register_physical`](Self::register_physical) does. One path for
    /// Reregister Memory Region and Reregister Physical Memory.
    pub fn reregister(
        &self,
        hca: &Arc<Hca<P>>,
        locker: &DynLocker<P>,
        irql: Irql,
        region: MemoryRegion<P>,
        changes: Reregistration<'_>,
        continuation: ReregContinuation<P>,
    ) {
        if changes == Reregistration::default() {
            return refuse(continuation, region, MrError::NothingToChange);
        }
        if region.bound_windows > 0 {
            let count = region.bound_windows;
            return refuse(continuation, region, MrError::WindowsBound { count });
        }
        let pd = changes.pd.unwrap_or(region.pd);
        let access = changes.access.unwrap_or(region.access);
        let (va, length, new_page_offset) = match changes.translation {
            None => (region.start, region.length, region.page_offset),
            Some(NewTranslation::Virtual { va, length }) => {
                (va, length, (va & (HOST_PAGE - 1)) as u32)
            }
            Some(NewTranslation::Physical(p)) => (p.iova, p.length, p.first_byte_offset),
        };
        if let Err(error) = self.validate(va, length, access, pd) {
            return refuse(continuation, region, error);
        }
        // Keep the translation when the range is unchanged or lies in the
        // locked pages, and the pages allow the rights.
        let writable_ok = !needs_write(access) || region.translation.device_writable;
        let kept = match (changes.translation, &region.translation.backing) {
            (None, _) => Some((region.mtt_index, region.page_offset)),
            (Some(NewTranslation::Virtual { .. }), Backing::Locked { mode, .. }) => {
                region.translation.locate(*mode, va, length)
            }
            (Some(NewTranslation::Virtual { .. }), Backing::Physical) => {
                return refuse(continuation, region, MrError::PhysicalRange);
            }
            (Some(NewTranslation::Physical(_)), _) => None,
        };
        let new_translation = match (kept, changes.translation) {
            (Some(_), _) if writable_ok => None,
            (_, Some(NewTranslation::Physical(pages))) => {
                match self.physical_translation(&pages, access, pd) {
                    Ok(translation) => Some(Arc::new(translation)),
                    Err(error) => return refuse(continuation, region, error),
                }
            }
            _ => {
                let Backing::Locked { mode, .. } = &region.translation.backing else {
                    // A physical region needing writable pages it lacks.
                    return refuse(continuation, region, MrError::ReadOnlyPages { access });
                };
                let mode = *mode;
                match self.lock_and_map(hca, locker, irql, mode, va, length, needs_write(access)) {
                    Ok(translation) => Some(Arc::new(translation)),
                    Err(error) => return refuse(continuation, region, error),
                }
            }
        };
        let (translation, mtt_index, page_offset) = match (&new_translation, kept) {
            (Some(t), _) => (Arc::clone(t), t.range.start(), new_page_offset),
            (None, Some((mtt_index, page_offset))) => {
                (Arc::clone(&region.translation), mtt_index, page_offset)
            }
            (None, None) => return refuse(continuation, region, MrError::BadMapping),
        };
        let new = MemoryRegion {
            key: region.key,
            pd,
            access,
            start: va,
            length,
            mtt_index,
            page_offset,
            bound_windows: 0,
            translation,
        };
        let this = self.clone();
        let hca2 = Arc::clone(hca);
        let switch: Step = Box::new(move |written| {
            if let Err(error) = written {
                this.release_region_translation(&hca2, new);
                return refuse(continuation, region, MrError::Command(error));
            }
            this.switch_mpt(&hca2, region, new, continuation);
        });
        match new_translation {
            Some(t) => {
                let (first, pages) = (t.range.start(), Arc::clone(&t.bus_pages));
                // Only the new region may hold the translation while the
                // chain runs (a failure releases it through that one).
                drop(t);
                self.write_mtt(hca, first, pages, 0, switch);
            }
            None => switch(Ok(())),
        }
    }

    /// Deregisters `region` (guide 7.1.1.6; see the module doc): refused,
    /// with the region handed back unchanged, while windows are bound or
    /// when the device refuses `HW2SW_MPT`. Call it while the device is
    /// started: after [`Hca::stop`] commands wait for the next start, so
    /// use [`release_after_reset`](Self::release_after_reset) instead.
    pub fn deregister(
        &self,
        hca: &Arc<Hca<P>>,
        region: MemoryRegion<P>,
        continuation: DeregContinuation<P>,
    ) {
        if region.bound_windows > 0 {
            let count = region.bound_windows;
            return continuation(Err(DeregFailure {
                error: MrError::WindowsBound { count },
                region,
            }));
        }
        let this = self.clone();
        let hca2 = Arc::clone(hca);
        hca.submit(
            Command::new(Opcode::Hw2SwMpt, region.key.index()),
            Box::new(move |result| match result {
                Ok(_) => {
                    this.retire(&hca2, region);
                    continuation(Ok(()));
                }
                Err(CommandError::DeviceFailed { .. } | CommandError::Timeout { .. }) => {
                    this.retire(&hca2, region);
                    continuation(Ok(()));
                }
                // A failed device taken below D0 has no command queue; it
                // holds nothing either.
                Err(CommandError::NotRunning) if hca2.failure().is_some() => {
                    this.retire(&hca2, region);
                    continuation(Ok(()));
                }
                Err(error) => continuation(Err(DeregFailure {
                    error: MrError::Command(error),
                    region,
                })),
            }),
        );
    }

    /// Frees `region`'s host resources without any command: for regions
    /// still registered when the device was stopped or reset (the device
    /// no longer owns its MPT and MTT). Unmaps and unlocks on the last
    /// region of a translation.
    pub fn release_after_reset(&self, hca: &Hca<P>, region: MemoryRegion<P>) {
        self.retire(hca, region);
    }

    /// Reads `region`'s MPT entry back from the device (`QUERY_MPT`).
    pub fn query(
        &self,
        hca: &Arc<Hca<P>>,
        region: &MemoryRegion<P>,
        continuation: QueryContinuation,
    ) {
        let index = region.key.index();
        hca.submit(
            Command::new(Opcode::QueryMpt, index).with_output(size_of::<MptEntry>()),
            Box::new(move |result| {
                continuation(result.map_err(MrError::Command).map(|output| {
                    let entry = MptEntry::read_from_prefix(&output.mailbox)
                        .map(|(entry, _)| entry)
                        .unwrap_or_default();
                    decode(index, &entry)
                }))
            }),
        );
    }

    // ----- steps ----------------------------------------------------------

    /// The checks every region passes before anything is allocated.
    fn validate(
        &self,
        start: u64,
        length: u64,
        access: AccessFlags,
        pd: u32,
    ) -> Result<(), MrError> {
        if length == 0 {
            return Err(MrError::ZeroLength);
        }
        if start.checked_add(length).is_none() {
            return Err(MrError::RangeOverflow { start, length });
        }
        if length > self.shared.max_region_bytes {
            return Err(MrError::TooLong {
                length,
                max: self.shared.max_region_bytes,
            });
        }
        if !access.is_valid_for_region() {
            return Err(MrError::InvalidAccess { access });
        }
        if pd >= PD_LIMIT {
            return Err(MrError::InvalidPd { pd });
        }
        Ok(())
    }

    /// Fails if `pages` MTT entries can never fit.
    fn check_pages(&self, pages: u64) -> Result<u32, MrError> {
        let capacity = self.shared.state.lock().mtt.capacity();
        match u32::try_from(pages) {
            Ok(pages) if pages <= capacity => Ok(pages),
            _ => Err(MrError::TooManyPages { pages, capacity }),
        }
    }

    /// Locks, maps, and takes an MTT range for `va..va+length`; on failure
    /// everything taken is given back.
    #[expect(
        clippy::too_many_arguments,
        reason = "one private step; the inputs are the lock request"
    )]
    fn lock_and_map(
        &self,
        hca: &Hca<P>,
        locker: &DynLocker<P>,
        irql: Irql,
        mode: RequestorMode,
        va: u64,
        length: u64,
        writable: bool,
    ) -> Result<Translation<P>, MrError> {
        let page_offset = (va & (HOST_PAGE - 1)) as u32;
        let pages = mtt_pages(page_offset, HOST_PAGE_SHIFT, length)
            .ok_or(MrError::RangeOverflow { start: va, length })?;
        let pages = self.check_pages(pages)?;
        // MmProbeAndLockPages: APC_LEVEL for pageable (user) memory,
        // DISPATCH_LEVEL for non-paged kernel memory; mapping likewise.
        let ceiling = match mode {
            RequestorMode::User => Irql::APC,
            RequestorMode::Kernel => Irql::DISPATCH,
        };
        if irql > ceiling {
            return Err(MrError::IrqlTooHigh { irql });
        }
        let (locked, mapping, bus_pages) =
            self.pin(hca, locker, mode, va, length, writable, pages)?;
        let range = match self.alloc_range(pages) {
            Ok(range) => range,
            Err(error) => {
                hca.dma.unmap(mapping);
                return Err(error);
            }
        };
        Ok(Translation {
            range,
            log_page_size: HOST_PAGE_SHIFT,
            bus_pages: bus_pages.into(),
            device_writable: writable,
            backing: Backing::Locked {
                pages: locked,
                mapping,
                mode,
                first_page_va: va & !(HOST_PAGE - 1),
            },
        })
    }

    /// Locks `length` bytes at `va` and maps them: the lock, the mapping
    /// and one bus address per page (`pages` of them), or nothing.
    #[expect(
        clippy::too_many_arguments,
        reason = "a private step; the inputs are the lock request"
    )]
    fn pin(
        &self,
        hca: &Hca<P>,
        locker: &DynLocker<P>,
        mode: RequestorMode,
        va: u64,
        length: u64,
        writable: bool,
        pages: u32,
    ) -> Result<LockedAndMapped<P>, MrError> {
        let locked = locker
            .lock(mode, va, length, writable)
            .map_err(MrError::Lock)?;
        let mapping = match hca.dma.map(&locked) {
            Ok(mapping) => mapping,
            Err(status) => return Err(MrError::Map(status)),
        };
        let bus_pages: Option<Vec<u64>> = (0..mapping.page_count())
            .map(|i| {
                mapping
                    .page_bus_address(i)
                    .filter(|bus| bus % HOST_PAGE == 0)
            })
            .collect();
        match bus_pages {
            Some(list)
                if list.len() == locked.page_count() && list.len() as u64 == u64::from(pages) =>
            {
                Ok((locked, mapping, list))
            }
            _ => {
                hca.dma.unmap(mapping);
                Err(MrError::BadMapping)
            }
        }
    }

    /// Locks and maps user memory for a ring or a doorbell record the
    /// device writes or reads (user CQs, QPs and SRQs, guide 6.5.3 and
    /// 6.8.1): the same lock-and-map step as a registration, without an
    /// MPT entry or MTT range (the caller takes MTT entries for rings
    /// itself). PASSIVE_LEVEL or APC_LEVEL, in the owning process's
    /// context; refused above. Always for device writes.
    pub(crate) fn pin_user(
        &self,
        hca: &Hca<P>,
        locker: &DynLocker<P>,
        irql: Irql,
        va: u64,
        length: u64,
    ) -> Result<PinnedUser<P>, MrError> {
        let page_offset = (va & (HOST_PAGE - 1)) as u32;
        let pages = mtt_pages(page_offset, HOST_PAGE_SHIFT, length)
            .ok_or(MrError::RangeOverflow { start: va, length })?;
        let pages = self.check_pages(pages)?;
        if irql > Irql::APC {
            return Err(MrError::IrqlTooHigh { irql });
        }
        let (pages, mapping, bus_pages) =
            self.pin(hca, locker, RequestorMode::User, va, length, true, pages)?;
        Ok(PinnedUser {
            pages,
            mapping,
            bus_pages,
            va,
            length,
        })
    }

    /// Unmaps and unlocks what [`pin_user`](Self::pin_user) pinned; the
    /// device must no longer use it.
    pub(crate) fn unpin_user(&self, hca: &Hca<P>, pinned: PinnedUser<P>) {
        hca.dma.unmap(pinned.mapping);
        drop(pinned.pages);
    }

    /// Validates a physical page list and takes its MTT range.
    fn physical_translation(
        &self,
        request: &PhysicalPages<'_>,
        access: AccessFlags,
        pd: u32,
    ) -> Result<Translation<P>, MrError> {
        self.validate(request.iova, request.length, access, pd)?;
        let shift = request.page_shift;
        if !PAGE_SHIFT_RANGE.contains(&shift) {
            return Err(MrError::InvalidPageShift(shift));
        }
        if u64::from(request.first_byte_offset) >= 1u64 << shift {
            return Err(MrError::InvalidPageOffset {
                offset: request.first_byte_offset,
                page_shift: shift,
            });
        }
        let needed = mtt_pages(request.first_byte_offset, shift, request.length).ok_or(
            MrError::RangeOverflow {
                start: request.iova,
                length: request.length,
            },
        )?;
        if request.pages.len() as u64 != needed {
            return Err(MrError::PageCountMismatch {
                given: request.pages.len(),
                needed,
            });
        }
        let mask = (1u64 << shift) - 1;
        if let Some((index, &address)) = request
            .pages
            .iter()
            .enumerate()
            .find(|(_, p)| **p & mask != 0)
        {
            return Err(MrError::UnalignedPage {
                index,
                address,
                page_shift: shift,
            });
        }
        let pages = self.check_pages(needed)?;
        let range = self.alloc_range(pages)?;
        Ok(Translation {
            range,
            log_page_size: shift,
            bus_pages: Arc::from(request.pages),
            device_writable: true,
            backing: Backing::Physical,
        })
    }

    /// The commands that give a device brought up again (D0 entry) every
    /// registered region back with the same keys: `WRITE_MTT` of each
    /// translation once (shared regions share one), then `SW2HW_MPT` of
    /// each entry as it was last written (index and tag, so L_Key and
    /// R_Key, unchanged). Memory windows are not tracked here.
    pub(crate) fn restore_commands(&self) -> Vec<Command> {
        let state = self.shared.state.lock();
        let mut commands = Vec::new();
        let mut written = alloc::collections::BTreeSet::new();
        for live in state.live.values() {
            if !written.insert(live.first_mtt) {
                continue;
            }
            for (chunk, pages) in live
                .bus_pages
                .chunks(self.shared.mtts_per_write)
                .enumerate()
            {
                let first = u64::from(live.first_mtt) + (chunk * self.shared.mtts_per_write) as u64;
                let mut mailbox = Vec::with_capacity(8 + 8 * pages.len());
                mailbox.extend_from_slice(&first.to_le_bytes());
                for page in pages {
                    mailbox.extend_from_slice(&page.to_le_bytes());
                }
                commands.push(Command::new(Opcode::WriteMtt, 0).with_mailbox(mailbox));
            }
        }
        for (&index, live) in &state.live {
            commands.push(
                Command::new(Opcode::Sw2HwMpt, index).with_mailbox(live.entry.as_bytes().to_vec()),
            );
        }
        commands
    }

    /// Takes a run of `count` MTT entries (absolute entry numbers) for
    /// another user of the MTT, such as a CQ ring: one allocator serves
    /// every user, so no two hand out the same entries.
    pub(crate) fn take_entries(
        &self,
        count: u32,
    ) -> Result<EntryRange, crate::resources::ResourceError> {
        let run = self.shared.state.lock().mtt.alloc(count)?;
        Ok(EntryRange::new(
            run.start() + self.shared.mtt_first,
            run.len(),
        ))
    }

    /// Gives back a run from [`take_entries`](Self::take_entries).
    pub(crate) fn return_entries(
        &self,
        range: EntryRange,
    ) -> Result<(), crate::resources::ResourceError> {
        let start = range.start().checked_sub(self.shared.mtt_first).ok_or(
            crate::resources::ResourceError::InvalidRange {
                start: range.start(),
                len: range.len(),
            },
        )?;
        self.shared
            .state
            .lock()
            .mtt
            .free(EntryRange::new(start, range.len()))
    }

    /// Takes an MTT run of `pages` entries (absolute entry numbers).
    fn alloc_range(&self, pages: u32) -> Result<EntryRange, MrError> {
        let mut state = self.shared.state.lock();
        let run = state.mtt.alloc(pages)?;
        state.translations += 1;
        Ok(EntryRange::new(
            run.start() + self.shared.mtt_first,
            run.len(),
        ))
    }

    fn alloc_key(&self) -> Result<MemoryKey, MrError> {
        Ok(self.shared.state.lock().keys.alloc()?)
    }

    /// `WRITE_MTT` for a fresh translation, then a key and `SW2HW_MPT`.
    fn write_and_create(
        &self,
        hca: &Arc<Hca<P>>,
        mut region: MemoryRegion<P>,
        continuation: RegionContinuation<P>,
    ) {
        match self.alloc_key() {
            Ok(key) => region.key = key,
            Err(error) => {
                self.release_translation(hca, region.translation);
                return continuation(Err(error));
            }
        }
        let this = self.clone();
        let hca2 = Arc::clone(hca);
        let (first, pages) = (
            region.translation.range.start(),
            Arc::clone(&region.translation.bus_pages),
        );
        self.write_mtt(
            hca,
            first,
            pages,
            0,
            Box::new(move |written| match written {
                Ok(()) => this.create_mpt(&hca2, region, continuation),
                Err(error) => {
                    this.free_key(region.key);
                    this.release_translation(&hca2, region.translation);
                    continuation(Err(MrError::Command(error)));
                }
            }),
        );
    }

    /// Writes the translation's entries from `from` on, one mailbox per
    /// command, each command issued from the previous one's continuation.
    fn write_mtt(
        &self,
        hca: &Arc<Hca<P>>,
        first_entry: u32,
        pages: Arc<[u64]>,
        from: usize,
        done: Step,
    ) {
        // The step holds the page list, never the translation: a failure's
        // release must find the translation's last reference free.
        if from >= pages.len() {
            return done(Ok(()));
        }
        let end = pages.len().min(from + self.shared.mtts_per_write);
        let first = u64::from(first_entry) + from as u64;
        let mut mailbox = Vec::with_capacity(8 + 8 * (end - from));
        mailbox.extend_from_slice(&first.to_le_bytes());
        for page in &pages[from..end] {
            mailbox.extend_from_slice(&page.to_le_bytes());
        }
        let this = self.clone();
        let hca2 = Arc::clone(hca);
        hca.submit(
            Command::new(Opcode::WriteMtt, 0).with_mailbox(mailbox),
            Box::new(move |result| match result {
                Ok(_) => this.write_mtt(&hca2, first_entry, pages, end, done),
                Err(error) => done(Err(error)),
            }),
        );
    }

    /// `SW2HW_MPT` of a region whose key is allocated; on failure the key
    /// and (if last) the translation are released.
    fn create_mpt(
        &self,
        hca: &Arc<Hca<P>>,
        region: MemoryRegion<P>,
        continuation: RegionContinuation<P>,
    ) {
        let entry = region.mpt_entry(region.key);
        let this = self.clone();
        let hca2 = Arc::clone(hca);
        hca.submit(
            Command::new(Opcode::Sw2HwMpt, region.key.index())
                .with_mailbox(entry.as_bytes().to_vec()),
            Box::new(move |result| match result {
                Ok(_) => {
                    {
                        let mut state = this.shared.state.lock();
                        state.regions += 1;
                        state
                            .live
                            .insert(region.key.index(), LiveMpt::of(&region, entry));
                    }
                    continuation(Ok(region));
                }
                Err(error) => {
                    this.free_key(region.key);
                    this.release_translation(&hca2, region.translation);
                    continuation(Err(MrError::Command(error)));
                }
            }),
        );
    }

    /// The re-registration's switch: `HW2SW_MPT` of the old entry, then
    /// `SW2HW_MPT` of the new one with the next tag; on failure the old
    /// entry is re-created.
    fn switch_mpt(
        &self,
        hca: &Arc<Hca<P>>,
        old: MemoryRegion<P>,
        mut new: MemoryRegion<P>,
        continuation: ReregContinuation<P>,
    ) {
        let index = old.key.index();
        let this = self.clone();
        let hca2 = Arc::clone(hca);
        hca.submit(
            Command::new(Opcode::Hw2SwMpt, index),
            Box::new(move |result| {
                if let Err(error) = result {
                    this.release_region_translation(&hca2, new);
                    return continuation(Err(ReregFailure {
                        error: MrError::Command(error),
                        region: Some(old),
                    }));
                }
                let next = MemoryKey::new(index, old.key.tag().wrapping_add(1)).unwrap_or(old.key);
                new.key = next;
                let entry = new.mpt_entry(next);
                let (this2, hca3) = (this.clone(), Arc::clone(&hca2));
                hca2.submit(
                    Command::new(Opcode::Sw2HwMpt, index).with_mailbox(entry.as_bytes().to_vec()),
                    Box::new(move |result| match result {
                        Ok(_) => {
                            {
                                let mut state = this2.shared.state.lock();
                                // The allocator's tag follows the device's.
                                let _ = state.keys.bump_tag(index);
                                state.live.insert(index, LiveMpt::of(&new, entry));
                            }
                            let old_translation = old.translation;
                            this2.release_translation(&hca3, old_translation);
                            continuation(Ok(new));
                        }
                        Err(error) => this2.restore(&hca3, old, new, error, continuation),
                    }),
                );
            }),
        );
    }

    /// Re-creates `old`'s MPT entry after the new one was refused.
    fn restore(
        &self,
        hca: &Arc<Hca<P>>,
        old: MemoryRegion<P>,
        new: MemoryRegion<P>,
        error: CommandError,
        continuation: ReregContinuation<P>,
    ) {
        self.release_region_translation(hca, new);
        let entry = old.mpt_entry(old.key);
        let this = self.clone();
        let hca2 = Arc::clone(hca);
        hca.submit(
            Command::new(Opcode::Sw2HwMpt, old.key.index()).with_mailbox(entry.as_bytes().to_vec()),
            Box::new(move |result| match result {
                Ok(_) => {
                    let live = LiveMpt::of(&old, entry);
                    this.shared.state.lock().live.insert(old.key.index(), live);
                    continuation(Err(ReregFailure {
                        error: MrError::Command(error),
                        region: Some(old),
                    }))
                }
                Err(_) => {
                    this.retire(&hca2, old);
                    continuation(Err(ReregFailure {
                        error: MrError::RegionLost(error),
                        region: None,
                    }))
                }
            }),
        );
    }

    /// Releases the translation of a region that never got its MPT entry
    /// (its key is the old region's, so it is not freed).
    fn release_region_translation(&self, hca: &Hca<P>, region: MemoryRegion<P>) {
        self.release_translation(hca, region.translation);
    }

    /// Frees a deregistered region's key and its translation if last.
    fn retire(&self, hca: &Hca<P>, region: MemoryRegion<P>) {
        {
            let mut state = self.shared.state.lock();
            // The key is current unless the device was failed mid-switch;
            // free the index whatever its tag.
            let _ = state.keys.free_index(region.key.index());
            state.live.remove(&region.key.index());
            state.regions = state.regions.saturating_sub(1);
        }
        self.release_translation(hca, region.translation);
    }

    fn free_key(&self, key: MemoryKey) {
        let _ = self.shared.state.lock().keys.free(key);
    }

    /// Drops one reference to a translation; the last one frees the MTT
    /// range, unmaps and unlocks.
    fn release_translation(&self, hca: &Hca<P>, translation: Arc<Translation<P>>) {
        let Some(translation) = Arc::into_inner(translation) else {
            return;
        };
        {
            let mut state = self.shared.state.lock();
            let run = EntryRange::new(
                translation
                    .range
                    .start()
                    .saturating_sub(self.shared.mtt_first),
                translation.range.len(),
            );
            let _ = state.mtt.free(run);
            state.translations = state.translations.saturating_sub(1);
        }
        if let Backing::Locked { pages, mapping, .. } = translation.backing {
            hca.dma.unmap(mapping);
            drop(pages);
        }
    }
}

/// A re-registration refused with the old region intact.
fn refuse<P: Platform>(
    continuation: ReregContinuation<P>,
    region: MemoryRegion<P>,
    error: MrError,
) {
    continuation(Err(ReregFailure {
        error,
        region: Some(region),
    }));
}

/// True when the rights let the device write into the pages (the
/// registration rule makes local write the common factor, IBA C11-13).
pub(crate) fn needs_write(access: AccessFlags) -> bool {
    access.intersects(
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC,
    )
}

fn decode(index: u32, entry: &MptEntry) -> MptQuery {
    MptQuery {
        kind: entry.kind,
        valid: entry.state == 1,
        key: MemoryKey::new(index, entry.tag).unwrap_or(MemoryKey::from_raw(0)),
        access_bits: entry.access.get(),
        pd: entry.pd.get(),
        mtt_index: entry.mtt_index.get(),
        start: entry.start.get(),
        length: entry.length.get(),
        log_page_size: entry.log_page_size,
        page_offset: entry.page_offset.get(),
        window_count: entry.window_count.get(),
    }
}
