//! Memory protection table entries (PRM 7.1) and the MTT address arithmetic
//! shared by regions and rings (PRM 6.0).

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::{Le32, Le64};

prm_code! {
    /// What an MPT entry holds.
    pub enum MptKind: u8 {
        /// Unused.
        Free = 0,
        /// A memory region.
        Region = 1,
        /// A type 1 memory window.
        WindowType1 = 2,
        /// A type 2 memory window.
        WindowType2 = 3,
    }
}

/// An MPT entry, 64 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct MptEntry {
    /// [`MptKind`].
    pub kind: u8,
    /// 0 invalid, 1 valid (regions) / bound (windows).
    pub state: u8,
    /// The key's low byte.
    pub tag: u8,
    /// Reserved.
    pub reserved_at_0x3: u8,
    /// `ib_types::access::AccessFlags` bits.
    pub access: Le32,
    /// Protection domain (24 bits).
    pub pd: Le32,
    /// First MTT entry (regions).
    pub mtt_index: Le32,
    /// First virtual address.
    pub start: Le64,
    /// Length in bytes.
    pub length: Le64,
    /// Page size, log2 (regions).
    pub log_page_size: u8,
    /// Reserved.
    pub reserved_at_0x21: [u8; 3],
    /// Offset of `start` in its first page (regions).
    pub page_offset: Le32,
    /// Region a bound window lies in.
    pub bound_mr: Le32,
    /// QP a type 2 window is bound to.
    pub bound_qpn: Le32,
    /// Windows bound in this region (device-maintained).
    pub window_count: Le32,
    /// Reserved.
    pub reserved_at_0x34: [u8; 12],
}

assert_layout!(MptEntry, size = 64, kind @ 0x00, state @ 0x01, tag @ 0x02,
    reserved_at_0x3 @ 0x03, access @ 0x04, pd @ 0x08, mtt_index @ 0x0C, start @ 0x10,
    length @ 0x18, log_page_size @ 0x20, reserved_at_0x21 @ 0x21, page_offset @ 0x24,
    bound_mr @ 0x28, bound_qpn @ 0x2C, window_count @ 0x30, reserved_at_0x34 @ 0x34);

/// Bytes of an MTT entry.
pub const MTT_ENTRY_SIZE: usize = 8;
/// Smallest and largest page sizes (log2) of an MTT range.
pub const PAGE_SHIFT_RANGE: core::ops::RangeInclusive<u8> = 12..=30;

/// A key is `index << 8 | tag` (PRM 7.1).
pub const fn key_index(key: u32) -> u32 {
    key >> 8
}

/// The tag byte of a key.
pub const fn key_tag(key: u32) -> u8 {
    key as u8
}

/// Where byte `offset` of an MTT-described buffer lives: the MTT entry to
/// read (relative to the range's first entry) and the offset within that
/// page. `page_offset` is the buffer's offset into its first page.
///
/// Returns `None` on arithmetic overflow; callers bound `offset` by the
/// buffer's length first.
pub const fn mtt_locate(page_offset: u32, log_page_size: u8, offset: u64) -> Option<(u64, u64)> {
    match offset.checked_add(page_offset as u64) {
        Some(linear) => {
            let page_mask = (1u64 << log_page_size) - 1;
            Some((linear >> log_page_size, linear & page_mask))
        }
        None => None,
    }
}

/// How many MTT entries a buffer of `len` bytes starting `page_offset`
/// bytes into its first page needs.
pub const fn mtt_pages(page_offset: u32, log_page_size: u8, len: u64) -> Option<u64> {
    if len == 0 {
        return Some(0);
    }
    match mtt_locate(page_offset, log_page_size, len - 1) {
        Some((last_page, _)) => Some(last_page + 1),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtt_arithmetic() {
        // 10 000 bytes starting 100 bytes into 4 KiB pages: pages 0..=2.
        assert_eq!(mtt_pages(100, 12, 10_000), Some(3));
        assert_eq!(mtt_locate(100, 12, 0), Some((0, 100)));
        assert_eq!(mtt_locate(100, 12, 3996), Some((1, 0)));
        // 100 + 9 999 = 10 099 = 2 * 4096 + 1907.
        assert_eq!(mtt_locate(100, 12, 9_999), Some((2, 1907)));
        assert_eq!(mtt_pages(0, 12, 4096), Some(1));
        assert_eq!(mtt_pages(0, 12, 0), Some(0));
        assert_eq!(mtt_locate(5, 12, u64::MAX), None);
    }

    #[test]
    fn keys() {
        assert_eq!(key_index(0x0001_2345), 0x123);
        assert_eq!(key_tag(0x0001_2345), 0x45);
        for &k in MptKind::ALL {
            assert_eq!(MptKind::from_code(k.code()).ok(), Some(k));
        }
        assert_eq!(MptKind::from_code(4).ok(), None);
    }
}
