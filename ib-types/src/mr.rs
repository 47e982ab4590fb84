//! Memory regions and memory windows (IBA 10.6, 11.2.8; guide 7).
//!
//! Registration requests from user mode are hostile input: every range is
//! checked for overflow, every access set for the registration rule, and a
//! physical page list must describe exactly the region it claims.

use bitflags::bitflags;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Le32, Le64, Repr, ensure_zero};
use crate::access::AccessFlags;
use crate::handle::PdHandle;
use crate::wr::{LKey, RKey};

/// Checks `start..start+len` is non-empty and does not wrap.
fn check_range(field: &'static str, start: u64, len: u64) -> Result<(), AbiError> {
    if len == 0 || start.checked_add(len).is_none() {
        return Err(AbiError::BadLength {
            field,
            declared: len,
            available: u64::MAX - start,
        });
    }
    Ok(())
}

/// Reads access flags that must satisfy the registration rule.
fn region_access(field: &'static str, raw: u32) -> Result<AccessFlags, AbiError> {
    let access = AccessFlags::from_raw(raw)?;
    if !access.is_valid_for_region() {
        return Err(AbiError::OutOfRange {
            field,
            value: raw.into(),
        });
    }
    Ok(access)
}

/// Register (virtual) Memory Region: a range of the caller's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MrRegister {
    /// Start of the range, in the registering process's address space.
    pub vaddr: u64,
    /// Length in bytes (non-zero; the range may not wrap).
    pub length: u64,
    /// Access rights (remote write/atomic need local write).
    pub access: AccessFlags,
}

/// ABI layout of [`MrRegister`]: 24 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct MrRegisterAbi {
    /// Start address.
    pub vaddr: Le64,
    /// Length.
    pub length: Le64,
    /// [`AccessFlags`] bits.
    pub access: Le32,
    /// Reserved, zero.
    pub reserved_at_0x14: [u8; 4],
}

assert_layout!(MrRegisterAbi, size = 24, vaddr @ 0, length @ 8, access @ 16,
    reserved_at_0x14 @ 20);

impl Repr for MrRegister {
    type Abi = MrRegisterAbi;

    fn parse(abi: &MrRegisterAbi) -> Result<Self, AbiError> {
        ensure_zero("MrRegisterAbi.reserved_at_0x14", &abi.reserved_at_0x14)?;
        check_range("MrRegisterAbi.length", abi.vaddr.get(), abi.length.get())?;
        Ok(Self {
            vaddr: abi.vaddr.get(),
            length: abi.length.get(),
            access: region_access("MrRegisterAbi.access", abi.access.get())?,
        })
    }

    fn emit(&self) -> MrRegisterAbi {
        MrRegisterAbi {
            vaddr: Le64::new(self.vaddr),
            length: Le64::new(self.length),
            access: Le32::new(self.access.bits()),
            ..MrRegisterAbi::default()
        }
    }
}

/// The keys of a registered region or a bound window.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct MrKeys {
    /// Local key.
    pub lkey: LKey,
    /// Remote key; zero when the region grants no remote access.
    pub rkey: RKey,
}

assert_layout!(MrKeys, size = 8, lkey @ 0, rkey @ 4);

/// Register Physical Memory Region (kernel callers only): a list of pages
/// already pinned and mapped to bus addresses, and where the region starts
/// in the first page. The page list follows the fixed layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PhysMrRegister {
    /// Requested I/O virtual address of the region's first byte.
    pub iova: u64,
    /// Length in bytes.
    pub length: u64,
    /// Offset of the first byte within the first page.
    pub first_byte_offset: u32,
    /// log2 of the page size, 12 (4 KiB) ..= 30 (1 GiB).
    pub page_shift: u8,
    /// Number of page entries that follow; must be exactly the pages the
    /// region touches.
    pub num_pages: u32,
    /// Access rights.
    pub access: AccessFlags,
}

/// ABI layout of [`PhysMrRegister`]: 32 bytes, followed by `num_pages`
/// little-endian 64-bit page addresses.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct PhysMrRegisterAbi {
    /// Requested IOVA.
    pub iova: Le64,
    /// Length.
    pub length: Le64,
    /// Offset into the first page.
    pub first_byte_offset: Le32,
    /// Page entries that follow.
    pub num_pages: Le32,
    /// [`AccessFlags`] bits.
    pub access: Le32,
    /// log2 page size.
    pub page_shift: u8,
    /// Reserved, zero.
    pub reserved_at_0x1d: [u8; 3],
}

assert_layout!(PhysMrRegisterAbi, size = 32, iova @ 0, length @ 8, first_byte_offset @ 16,
    num_pages @ 20, access @ 24, page_shift @ 28, reserved_at_0x1d @ 29);

/// The names of a physical layout's fields, for its errors.
struct PhysFields {
    page_shift: &'static str,
    first_byte_offset: &'static str,
    length: &'static str,
    num_pages: &'static str,
}

/// Checks a physical translation's fixed part: page size in range, offset
/// inside the first page, a non-empty non-wrapping range, and exactly the
/// pages it spans.
fn check_physical(
    names: &PhysFields,
    iova: u64,
    length: u64,
    offset: u32,
    page_shift: u8,
    num_pages: u32,
) -> Result<(), AbiError> {
    if !(PhysMrRegister::MIN_PAGE_SHIFT..=PhysMrRegister::MAX_PAGE_SHIFT).contains(&page_shift) {
        return Err(AbiError::OutOfRange {
            field: names.page_shift,
            value: page_shift.into(),
        });
    }
    if u64::from(offset) >= 1u64 << page_shift {
        return Err(AbiError::OutOfRange {
            field: names.first_byte_offset,
            value: offset.into(),
        });
    }
    check_range(names.length, iova, length)?;
    let needed = PhysMrRegister::pages_needed(offset, length, page_shift);
    if needed != Some(num_pages.into()) {
        return Err(AbiError::BadLength {
            field: names.num_pages,
            declared: num_pages.into(),
            available: needed.unwrap_or(u64::MAX),
        });
    }
    Ok(())
}

/// Reads a page list of exactly `num_pages` addresses aligned to
/// `1 << page_shift`.
fn read_page_list(num_pages: u32, page_shift: u8, bytes: &[u8]) -> Result<&[Le64], AbiError> {
    let bad_length = || AbiError::BadLength {
        field: "physical page list",
        declared: u64::from(num_pages) * 8,
        available: bytes.len() as u64,
    };
    let pages = <[Le64]>::ref_from_bytes(bytes).map_err(|_| bad_length())?;
    if pages.len() != num_pages as usize {
        return Err(bad_length());
    }
    let page_mask = (1u64 << page_shift) - 1;
    if let Some(bad) = pages.iter().find(|p| p.get() & page_mask != 0) {
        return Err(AbiError::OutOfRange {
            field: "physical page address (unaligned)",
            value: bad.get(),
        });
    }
    Ok(pages)
}

impl PhysMrRegister {
    /// Smallest page shift (4 KiB).
    pub const MIN_PAGE_SHIFT: u8 = 12;
    /// Largest page shift (1 GiB).
    pub const MAX_PAGE_SHIFT: u8 = 30;

    /// The pages a region of `length` bytes starting `offset` bytes into its
    /// first page touches, or `None` on overflow.
    pub const fn pages_needed(offset: u32, length: u64, page_shift: u8) -> Option<u64> {
        let page = 1u64 << page_shift;
        match length.checked_add(offset as u64) {
            Some(end) => match end.checked_add(page - 1) {
                Some(rounded) => Some(rounded >> page_shift),
                None => None,
            },
            None => None,
        }
    }

    /// Reads the page list that follows the fixed layout: exactly
    /// `num_pages` page-aligned addresses.
    pub fn page_list<'a>(&self, bytes: &'a [u8]) -> Result<&'a [Le64], AbiError> {
        read_page_list(self.num_pages, self.page_shift, bytes)
    }
}

impl Repr for PhysMrRegister {
    type Abi = PhysMrRegisterAbi;

    fn parse(abi: &PhysMrRegisterAbi) -> Result<Self, AbiError> {
        ensure_zero("PhysMrRegisterAbi.reserved_at_0x1d", &abi.reserved_at_0x1d)?;
        let (page_shift, offset) = (abi.page_shift, abi.first_byte_offset.get());
        check_physical(
            &PhysFields {
                page_shift: "PhysMrRegisterAbi.page_shift",
                first_byte_offset: "PhysMrRegisterAbi.first_byte_offset",
                length: "PhysMrRegisterAbi.length",
                num_pages: "PhysMrRegisterAbi.num_pages",
            },
            abi.iova.get(),
            abi.length.get(),
            offset,
            page_shift,
            abi.num_pages.get(),
        )?;
        Ok(Self {
            iova: abi.iova.get(),
            length: abi.length.get(),
            first_byte_offset: offset,
            page_shift,
            num_pages: abi.num_pages.get(),
            access: region_access("PhysMrRegisterAbi.access", abi.access.get())?,
        })
    }

    fn emit(&self) -> PhysMrRegisterAbi {
        PhysMrRegisterAbi {
            iova: Le64::new(self.iova),
            length: Le64::new(self.length),
            first_byte_offset: Le32::new(self.first_byte_offset),
            num_pages: Le32::new(self.num_pages),
            access: Le32::new(self.access.bits()),
            page_shift: self.page_shift,
            ..PhysMrRegisterAbi::default()
        }
    }
}

/// Register Shared Memory Region: a new region over the translation of an
/// existing one, in a possibly different PD with possibly different rights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MrShare {
    /// Protection domain of the new region.
    pub pd: PdHandle,
    /// Requested start address of the new region (the provider may choose
    /// another and reports it).
    pub vaddr: u64,
    /// Access rights of the new region.
    pub access: AccessFlags,
}

/// ABI layout of [`MrShare`]: 24 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct MrShareAbi {
    /// Protection domain.
    pub pd: PdHandle,
    /// Requested address.
    pub vaddr: Le64,
    /// [`AccessFlags`] bits.
    pub access: Le32,
    /// Reserved, zero.
    pub reserved_at_0x14: [u8; 4],
}

assert_layout!(MrShareAbi, size = 24, pd @ 0, vaddr @ 8, access @ 16, reserved_at_0x14 @ 20);

impl Repr for MrShare {
    type Abi = MrShareAbi;

    fn parse(abi: &MrShareAbi) -> Result<Self, AbiError> {
        ensure_zero("MrShareAbi.reserved_at_0x14", &abi.reserved_at_0x14)?;
        if abi.pd.is_null() {
            return Err(AbiError::OutOfRange {
                field: "MrShareAbi.pd",
                value: 0,
            });
        }
        Ok(Self {
            pd: abi.pd,
            vaddr: abi.vaddr.get(),
            access: region_access("MrShareAbi.access", abi.access.get())?,
        })
    }

    fn emit(&self) -> MrShareAbi {
        MrShareAbi {
            pd: self.pd,
            vaddr: Le64::new(self.vaddr),
            access: Le32::new(self.access.bits()),
            ..MrShareAbi::default()
        }
    }
}

bitflags! {
    /// What a Re-Register Memory Region changes (guide 7.1.1.3).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct ReregFlags: u32 {
        /// New address range (new translation).
        const TRANSLATION = 1 << 0;
        /// New protection domain.
        const PD = 1 << 1;
        /// New access rights.
        const ACCESS = 1 << 2;
    }
}

/// The names of a reregistration layout's fields, for its errors.
struct ReregFields {
    flags: &'static str,
    nothing_to_change: &'static str,
    pd: &'static str,
    access: &'static str,
    not_canonical: &'static str,
}

/// Checks `abi` is the canonical layout of what was read from it, `emitted`:
/// a field outside the flags, or a reserved byte, that is set differs.
fn ensure_canonical<A: IntoBytes + Immutable>(
    names: &ReregFields,
    emitted: &A,
    abi: &A,
) -> Result<(), AbiError> {
    if emitted.as_bytes() != abi.as_bytes() {
        return Err(AbiError::ReservedNotZero {
            field: names.not_canonical,
        });
    }
    Ok(())
}

/// A reregistration: each part present is changed; the rest stays. `T`
/// is the kind of translation: [`MrRereg`] and [`PhysMrRereg`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rereg<T> {
    /// New translation.
    pub translation: Option<T>,
    /// New protection domain.
    pub pd: Option<PdHandle>,
    /// New access rights.
    pub access: Option<AccessFlags>,
}

// Not derived: a derive would ask `T: Default`, and a page-list
// translation has no meaningful default.
impl<T> Default for Rereg<T> {
    fn default() -> Self {
        Self {
            translation: None,
            pd: None,
            access: None,
        }
    }
}

impl<T> Rereg<T> {
    /// The flags: exactly the parts present.
    pub fn flags(&self) -> ReregFlags {
        let mut flags = ReregFlags::empty();
        flags.set(ReregFlags::TRANSLATION, self.translation.is_some());
        flags.set(ReregFlags::PD, self.pd.is_some());
        flags.set(ReregFlags::ACCESS, self.access.is_some());
        flags
    }

    /// Reads a reregistration: its flags (only known bits, at least one),
    /// then each part they name, the translation by `read_translation`.
    fn read(
        names: &ReregFields,
        raw_flags: u32,
        pd: PdHandle,
        access: u32,
        read_translation: impl FnOnce() -> Result<T, AbiError>,
    ) -> Result<Self, AbiError> {
        let flags = ReregFlags::from_bits(raw_flags)
            .ok_or(AbiError::ReservedNotZero { field: names.flags })?;
        if flags.is_empty() {
            return Err(AbiError::OutOfRange {
                field: names.nothing_to_change,
                value: 0,
            });
        }
        let translation = if flags.contains(ReregFlags::TRANSLATION) {
            Some(read_translation()?)
        } else {
            None
        };
        let pd = if flags.contains(ReregFlags::PD) {
            if pd.is_null() {
                return Err(AbiError::OutOfRange {
                    field: names.pd,
                    value: 0,
                });
            }
            Some(pd)
        } else {
            None
        };
        let access = if flags.contains(ReregFlags::ACCESS) {
            Some(region_access(names.access, access)?)
        } else {
            None
        };
        Ok(Self {
            translation,
            pd,
            access,
        })
    }
}

/// Re-Register Memory Region: the new translation is a range, start and
/// length.
pub type MrRereg = Rereg<(u64, u64)>;

/// ABI layout of [`MrRereg`]: 40 bytes. Fields outside `flags` must be zero.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct MrReregAbi {
    /// [`ReregFlags`] bits.
    pub flags: Le32,
    /// [`AccessFlags`] bits.
    pub access: Le32,
    /// New protection domain.
    pub pd: PdHandle,
    /// New start address.
    pub vaddr: Le64,
    /// New length.
    pub length: Le64,
    /// Reserved, zero.
    pub reserved_at_0x20: [u8; 8],
}

assert_layout!(MrReregAbi, size = 40, flags @ 0, access @ 4, pd @ 8, vaddr @ 16,
    length @ 24, reserved_at_0x20 @ 32);

impl MrRereg {
    /// Its layout's field names, for errors.
    const FIELDS: ReregFields = ReregFields {
        flags: "MrReregAbi.flags",
        nothing_to_change: "MrReregAbi.flags (nothing to change)",
        pd: "MrReregAbi.pd",
        access: "MrReregAbi.access",
        not_canonical: "MrReregAbi (field outside flags, or reserved)",
    };
}

impl Repr for MrRereg {
    type Abi = MrReregAbi;

    fn parse(abi: &MrReregAbi) -> Result<Self, AbiError> {
        let (vaddr, length) = (abi.vaddr.get(), abi.length.get());
        let rereg = Self::read(
            &Self::FIELDS,
            abi.flags.get(),
            abi.pd,
            abi.access.get(),
            || {
                check_range("MrReregAbi.length", vaddr, length)?;
                Ok((vaddr, length))
            },
        )?;
        ensure_canonical(&Self::FIELDS, &rereg.emit(), abi)?;
        Ok(rereg)
    }

    fn emit(&self) -> MrReregAbi {
        let (vaddr, length) = self.translation.unwrap_or((0, 0));
        MrReregAbi {
            flags: Le32::new(self.flags().bits()),
            access: Le32::new(self.access.map_or(0, |a| a.bits())),
            pd: self.pd.unwrap_or(PdHandle::NULL),
            vaddr: Le64::new(vaddr),
            length: Le64::new(length),
            ..MrReregAbi::default()
        }
    }
}

/// The new translation of a Reregister Physical Memory request: a page
/// list, as [`PhysMrRegister`] describes one (the list follows the fixed
/// layout as the request's private input).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PhysTranslation {
    /// Requested I/O virtual address of the region's first byte.
    pub iova: u64,
    /// Length in bytes.
    pub length: u64,
    /// Offset of the first byte within the first page.
    pub first_byte_offset: u32,
    /// log2 of the page size, 12 ..= 30.
    pub page_shift: u8,
    /// Number of page entries in the list: exactly the pages the region
    /// touches.
    pub num_pages: u32,
}

/// Reregister Physical Memory (guide Table 4-1, mandatory; kernel callers
/// only): each part present is changed, the rest stays, as for
/// [`MrRereg`]; a new translation is a physical page list (the private
/// input).
pub type PhysMrRereg = Rereg<PhysTranslation>;

/// ABI layout of [`PhysMrRereg`]: 48 bytes, followed (with
/// [`ReregFlags::TRANSLATION`]) by `num_pages` little-endian 64-bit page
/// addresses. Fields outside `flags` must be zero.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct PhysMrReregAbi {
    /// [`ReregFlags`] bits.
    pub flags: Le32,
    /// [`AccessFlags`] bits.
    pub access: Le32,
    /// New protection domain.
    pub pd: PdHandle,
    /// Requested IOVA.
    pub iova: Le64,
    /// Length.
    pub length: Le64,
    /// Offset into the first page.
    pub first_byte_offset: Le32,
    /// Page entries that follow.
    pub num_pages: Le32,
    /// log2 page size.
    pub page_shift: u8,
    /// Reserved, zero.
    pub reserved_at_0x29: [u8; 7],
}

assert_layout!(PhysMrReregAbi, size = 48, flags @ 0, access @ 4, pd @ 8, iova @ 16,
    length @ 24, first_byte_offset @ 32, num_pages @ 36, page_shift @ 40,
    reserved_at_0x29 @ 41);

impl PhysMrRereg {
    /// Its layout's field names, for errors.
    const FIELDS: ReregFields = ReregFields {
        flags: "PhysMrReregAbi.flags",
        nothing_to_change: "PhysMrReregAbi.flags (nothing to change)",
        pd: "PhysMrReregAbi.pd",
        access: "PhysMrReregAbi.access",
        not_canonical: "PhysMrReregAbi (field outside flags, or reserved)",
    };

    /// Reads the page list that follows the fixed layout: exactly the
    /// translation's `num_pages` aligned addresses, or nothing when the
    /// translation does not change.
    pub fn page_list<'a>(&self, bytes: &'a [u8]) -> Result<&'a [Le64], AbiError> {
        match self.translation {
            Some(t) => read_page_list(t.num_pages, t.page_shift, bytes),
            None => read_page_list(0, PhysMrRegister::MIN_PAGE_SHIFT, bytes),
        }
    }
}

impl Repr for PhysMrRereg {
    type Abi = PhysMrReregAbi;

    fn parse(abi: &PhysMrReregAbi) -> Result<Self, AbiError> {
        let rereg = Self::read(
            &Self::FIELDS,
            abi.flags.get(),
            abi.pd,
            abi.access.get(),
            || {
                let t = PhysTranslation {
                    iova: abi.iova.get(),
                    length: abi.length.get(),
                    first_byte_offset: abi.first_byte_offset.get(),
                    page_shift: abi.page_shift,
                    num_pages: abi.num_pages.get(),
                };
                check_physical(
                    &PhysFields {
                        page_shift: "PhysMrReregAbi.page_shift",
                        first_byte_offset: "PhysMrReregAbi.first_byte_offset",
                        length: "PhysMrReregAbi.length",
                        num_pages: "PhysMrReregAbi.num_pages",
                    },
                    t.iova,
                    t.length,
                    t.first_byte_offset,
                    t.page_shift,
                    t.num_pages,
                )?;
                Ok(t)
            },
        )?;
        ensure_canonical(&Self::FIELDS, &rereg.emit(), abi)?;
        Ok(rereg)
    }

    fn emit(&self) -> PhysMrReregAbi {
        let t = self.translation;
        PhysMrReregAbi {
            flags: Le32::new(self.flags().bits()),
            access: Le32::new(self.access.map_or(0, |a| a.bits())),
            pd: self.pd.unwrap_or(PdHandle::NULL),
            iova: Le64::new(t.map_or(0, |t| t.iova)),
            length: Le64::new(t.map_or(0, |t| t.length)),
            first_byte_offset: Le32::new(t.map_or(0, |t| t.first_byte_offset)),
            num_pages: Le32::new(t.map_or(0, |t| t.num_pages)),
            page_shift: t.map_or(0, |t| t.page_shift),
            ..PhysMrReregAbi::default()
        }
    }
}

/// Query Memory Region results (guide 7.1.1.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MrQuery {
    /// Protection domain.
    pub pd: PdHandle,
    /// Start address (the IOVA for physical regions).
    pub vaddr: u64,
    /// Length.
    pub length: u64,
    /// Access rights.
    pub access: AccessFlags,
    /// Keys.
    pub keys: MrKeys,
}

/// ABI layout of [`MrQuery`]: 40 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct MrQueryAbi {
    /// Protection domain.
    pub pd: PdHandle,
    /// Start.
    pub vaddr: Le64,
    /// Length.
    pub length: Le64,
    /// Keys.
    pub keys: MrKeys,
    /// [`AccessFlags`] bits.
    pub access: Le32,
    /// Reserved, zero.
    pub reserved_at_0x24: [u8; 4],
}

assert_layout!(MrQueryAbi, size = 40, pd @ 0, vaddr @ 8, length @ 16, keys @ 24,
    access @ 32, reserved_at_0x24 @ 36);

impl Repr for MrQuery {
    type Abi = MrQueryAbi;

    fn parse(abi: &MrQueryAbi) -> Result<Self, AbiError> {
        ensure_zero("MrQueryAbi.reserved_at_0x24", &abi.reserved_at_0x24)?;
        Ok(Self {
            pd: abi.pd,
            vaddr: abi.vaddr.get(),
            length: abi.length.get(),
            access: AccessFlags::from_raw(abi.access.get())?,
            keys: abi.keys,
        })
    }

    fn emit(&self) -> MrQueryAbi {
        MrQueryAbi {
            pd: self.pd,
            vaddr: Le64::new(self.vaddr),
            length: Le64::new(self.length),
            keys: self.keys,
            access: Le32::new(self.access.bits()),
            ..MrQueryAbi::default()
        }
    }
}

code_enum! {
    /// Memory window types (IBA 10.6.7).
    pub enum MwType: u8 {
        /// Bound by the Bind Memory Window verb; survives invalidation.
        Type1 = 1,
        /// Bound by a BIND_MW work request to one QP; invalidated by
        /// LOCAL_INV or SEND_WITH_INV.
        Type2 = 2,
    }
}

/// Allocate Memory Window request, and Query Memory Window results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MwAttr {
    /// Window type.
    pub mw_type: MwType,
    /// The window's current R_Key (in a request: ignored, must be zero).
    pub rkey: RKey,
}

/// ABI layout of [`MwAttr`]: 8 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct MwAttrAbi {
    /// [`MwType`] code.
    pub mw_type: u8,
    /// Reserved, zero.
    pub reserved_at_0x1: [u8; 3],
    /// R_Key.
    pub rkey: RKey,
}

assert_layout!(MwAttrAbi, size = 8, mw_type @ 0, reserved_at_0x1 @ 1, rkey @ 4);

impl Repr for MwAttr {
    type Abi = MwAttrAbi;

    fn parse(abi: &MwAttrAbi) -> Result<Self, AbiError> {
        ensure_zero("MwAttrAbi.reserved_at_0x1", &abi.reserved_at_0x1)?;
        Ok(Self {
            mw_type: MwType::from_code(abi.mw_type)?,
            rkey: abi.rkey,
        })
    }

    fn emit(&self) -> MwAttrAbi {
        MwAttrAbi {
            mw_type: self.mw_type.code(),
            rkey: self.rkey,
            ..MwAttrAbi::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::testing::{
        Corruption, assert_corruptions_rejected, assert_decode_total, assert_round_trip,
    };
    use proptest::prelude::*;

    #[test]
    fn register_rules() {
        let good = MrRegister {
            vaddr: 0x7fff_0000_1000,
            length: 8192,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        };
        assert_round_trip(&good);
        let cases: &[Corruption<MrRegisterAbi>] = &[
            (|a| a.length = Le64::new(0), "empty region"),
            (|a| a.vaddr = Le64::new(u64::MAX - 10), "wrapping range"),
            (
                |a| a.access = Le32::new(AccessFlags::REMOTE_WRITE.bits()),
                "C11-13",
            ),
            (|a| a.access = Le32::new(1 << 9), "unknown access bit"),
            (|a| a.reserved_at_0x14 = [1, 0, 0, 0], "reserved"),
        ];
        assert_corruptions_rejected::<MrRegister>(&good.emit(), cases);
    }

    #[test]
    fn physical_page_lists() {
        // 10 000 bytes starting 100 bytes into a 4 KiB page touch 3 pages.
        assert_eq!(PhysMrRegister::pages_needed(100, 10_000, 12), Some(3));
        assert_eq!(PhysMrRegister::pages_needed(0, 4096, 12), Some(1));
        assert_eq!(PhysMrRegister::pages_needed(0, u64::MAX, 12), None);
        let good = PhysMrRegister {
            iova: 0x1000_0064,
            length: 10_000,
            first_byte_offset: 100,
            page_shift: 12,
            num_pages: 3,
            access: AccessFlags::LOCAL_WRITE,
        };
        assert_round_trip(&good);
        let pages: Vec<u8> = [0x10_0000u64, 0x23_0000, 0x11_1000]
            .iter()
            .flat_map(|p| p.to_le_bytes())
            .collect();
        assert_eq!(good.page_list(&pages).unwrap().len(), 3);
        assert!(good.page_list(&pages[..16]).is_err(), "too few pages");
        assert!(good.page_list(&pages[..23]).is_err(), "ragged list");
        let mut unaligned = pages.clone();
        unaligned[0] = 0x08;
        assert!(good.page_list(&unaligned).is_err(), "unaligned page");
        let cases: &[Corruption<PhysMrRegisterAbi>] = &[
            (|a| a.num_pages = Le32::new(4), "page count disagrees"),
            (
                |a| a.first_byte_offset = Le32::new(4096),
                "offset past first page",
            ),
            (|a| a.page_shift = 11, "page too small"),
            (|a| a.page_shift = 31, "page too large"),
            (|a| a.reserved_at_0x1d = [0, 1, 0], "reserved"),
        ];
        assert_corruptions_rejected::<PhysMrRegister>(&good.emit(), cases);
    }

    #[test]
    fn rereg_and_share() {
        let change_pd = MrRereg {
            pd: Some(PdHandle::from_raw(5)),
            ..MrRereg::default()
        };
        assert_eq!(change_pd.flags(), ReregFlags::PD);
        assert_round_trip(&change_pd);
        let all = MrRereg {
            translation: Some((0x1000, 0x2000)),
            pd: Some(PdHandle::from_raw(5)),
            access: Some(AccessFlags::REMOTE_READ),
        };
        assert_round_trip(&all);
        let cases: &[Corruption<MrReregAbi>] = &[
            (|a| a.flags = Le32::new(0), "nothing to change"),
            (|a| a.flags = Le32::new(8 | 2), "unknown flag"),
            (|a| a.length = Le64::new(7), "translation outside the flags"),
            (|a| a.pd = PdHandle::NULL, "null PD"),
        ];
        assert_corruptions_rejected::<MrRereg>(&change_pd.emit(), cases);

        let share = MrShare {
            pd: PdHandle::from_raw(9),
            vaddr: 0x4000,
            access: AccessFlags::REMOTE_READ,
        };
        assert_round_trip(&share);
        let mut abi = share.emit();
        abi.pd = PdHandle::NULL;
        assert!(MrShare::parse(&abi).is_err());
    }

    #[test]
    fn physical_rereg_rules() {
        let translation = PhysTranslation {
            iova: 0x1000_0064,
            length: 10_000,
            first_byte_offset: 100,
            page_shift: 12,
            num_pages: 3,
        };
        let all = PhysMrRereg {
            translation: Some(translation),
            pd: Some(PdHandle::from_raw(5)),
            access: Some(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE),
        };
        assert_eq!(all.flags(), ReregFlags::all());
        assert_round_trip(&all);
        let pages: Vec<u8> = [0x10_0000u64, 0x23_0000, 0x11_1000]
            .iter()
            .flat_map(|p| p.to_le_bytes())
            .collect();
        assert_eq!(all.page_list(&pages).unwrap().len(), 3);
        assert!(all.page_list(&pages[..16]).is_err(), "too few pages");
        let mut unaligned = pages.clone();
        unaligned[0] = 0x08;
        assert!(all.page_list(&unaligned).is_err(), "unaligned page");
        let cases: &[Corruption<PhysMrReregAbi>] = &[
            (|a| a.flags = Le32::new(0), "nothing to change"),
            (|a| a.flags = Le32::new(8 | 1), "unknown flag"),
            (|a| a.num_pages = Le32::new(4), "page count disagrees"),
            (
                |a| a.first_byte_offset = Le32::new(4096),
                "offset past page",
            ),
            (|a| a.page_shift = 11, "page too small"),
            (|a| a.length = Le64::new(0), "empty region"),
            (|a| a.pd = PdHandle::NULL, "null PD"),
            (
                |a| a.access = Le32::new(AccessFlags::REMOTE_WRITE.bits()),
                "C11-13",
            ),
            (|a| a.reserved_at_0x29 = [0, 0, 1, 0, 0, 0, 0], "reserved"),
        ];
        assert_corruptions_rejected::<PhysMrRereg>(&all.emit(), cases);

        // Rights only: no page list, and no translation field may be set.
        let access_only = PhysMrRereg {
            access: Some(AccessFlags::LOCAL_WRITE),
            ..PhysMrRereg::default()
        };
        assert_eq!(access_only.flags(), ReregFlags::ACCESS);
        assert_round_trip(&access_only);
        assert_eq!(access_only.page_list(&[]).unwrap().len(), 0);
        assert!(access_only.page_list(&pages[..8]).is_err());
        let cases: &[Corruption<PhysMrReregAbi>] = &[
            (|a| a.num_pages = Le32::new(1), "translation outside flags"),
            (|a| a.iova = Le64::new(0x1000), "translation outside flags"),
            (|a| a.pd = PdHandle::from_raw(3), "PD outside flags"),
        ];
        assert_corruptions_rejected::<PhysMrRereg>(&access_only.emit(), cases);
    }

    #[test]
    fn query_and_windows() {
        assert_round_trip(&MrQuery {
            pd: PdHandle::from_raw(1),
            vaddr: 0x1000,
            length: 64,
            access: AccessFlags::MW_BIND,
            keys: MrKeys {
                lkey: LKey::new(0x0000_0107),
                rkey: RKey::new(0),
            },
        });
        for &mw_type in MwType::ALL {
            assert_round_trip(&MwAttr {
                mw_type,
                rkey: RKey::new(0x0000_2a01),
            });
        }
        assert!(MwAttr::decode(&[3, 0, 0, 0, 0, 0, 0, 0]).is_err());
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..56)) {
            assert_decode_total::<MrRegister>(&bytes);
            assert_decode_total::<PhysMrRegister>(&bytes);
            assert_decode_total::<MrShare>(&bytes);
            assert_decode_total::<MrRereg>(&bytes);
            assert_decode_total::<PhysMrRereg>(&bytes);
            assert_decode_total::<MrQuery>(&bytes);
            assert_decode_total::<MwAttr>(&bytes);
        }
    }
}
