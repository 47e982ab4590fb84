//! From scatter/gather elements to one bus address per page: the part of
//! the KMDF shell's `DmaAdapter::map` that is arithmetic, kept portable so
//! it is compiled and tested on every host (the shell itself is Windows
//! only).
//!
//! A scatter/gather list describes a virtually contiguous buffer as bus
//! ranges that the HAL may coalesce (several pages contiguous in bus
//! space) and that start and end where the buffer does, mid-page. The
//! HCA's translation table wants the bus address of every page the buffer
//! touches, in virtual order.

/// Bytes of a page.
pub const PAGE_SIZE: u64 = 4096;

/// Why a list cannot be turned into pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SgPagesError {
    /// An element is empty, overflows, or its in-page offset disagrees
    /// with the virtual address it describes (a translation is page
    /// granular, so the two always agree in a list the HAL built).
    Malformed,
    /// The elements describe more or fewer bytes than asked for.
    LengthMismatch,
}

/// Appends to `pages` the page-aligned bus address of each page spanned by
/// the `len` bytes at virtual address `va` that `elements` (bus address,
/// length) describe, in order.
pub fn append_bus_pages(
    va: u64,
    len: u64,
    elements: impl IntoIterator<Item = (u64, u64)>,
    pages: &mut alloc_vec::Vec<u64>,
) -> Result<(), SgPagesError> {
    let end = va.checked_add(len).ok_or(SgPagesError::Malformed)?;
    let mut cursor = va;
    for (bus, bytes) in elements {
        bus.checked_add(bytes).ok_or(SgPagesError::Malformed)?;
        if bytes == 0 || bus % PAGE_SIZE != cursor % PAGE_SIZE {
            return Err(SgPagesError::Malformed);
        }
        if cursor.checked_add(bytes).is_none_or(|next| next > end) {
            return Err(SgPagesError::LengthMismatch);
        }
        let mut done = 0;
        while done < bytes {
            // A page is recorded where the buffer enters it: its first
            // byte, or the buffer's own first byte.
            if cursor.is_multiple_of(PAGE_SIZE) || cursor == va {
                pages.push((bus + done) & !(PAGE_SIZE - 1));
            }
            let step = (PAGE_SIZE - cursor % PAGE_SIZE).min(bytes - done);
            done += step;
            cursor += step;
        }
    }
    if cursor != end {
        return Err(SgPagesError::LengthMismatch);
    }
    Ok(())
}

/// Pages spanned by `len` bytes at `va` (`ADDRESS_AND_SIZE_TO_SPAN_PAGES`).
pub fn span_pages(va: u64, len: u64) -> u64 {
    if len == 0 {
        return 0;
    }
    let first = va / PAGE_SIZE;
    let last = (va + (len - 1)) / PAGE_SIZE;
    last - first + 1
}

#[cfg(not(windows))]
use std::vec as alloc_vec;

#[cfg(windows)]
use alloc::vec as alloc_vec;

#[cfg(test)]
mod tests {
    use super::*;

    fn pages(va: u64, len: u64, elements: &[(u64, u64)]) -> Result<Vec<u64>, SgPagesError> {
        let mut out = Vec::new();
        append_bus_pages(va, len, elements.iter().copied(), &mut out).map(|()| out)
    }

    #[test]
    fn coalesced_elements_are_split_into_pages() {
        // Three pages, the first two contiguous in bus space.
        let va = 0x7000_1000;
        let got = pages(va, 3 * 4096, &[(0x9_0000, 8192), (0x5_0000, 4096)]).unwrap();
        assert_eq!(got, vec![0x9_0000, 0x9_1000, 0x5_0000]);
        assert_eq!(span_pages(va, 3 * 4096), 3);
    }

    #[test]
    fn a_buffer_starting_and_ending_mid_page_counts_every_page_it_touches() {
        let va = 0x7000_0f00;
        let len = 0x300; // 0x100 bytes in the first page, 0x200 in the second
        let got = pages(va, len, &[(0x9_0f00, 0x100), (0x4_0000, 0x200)]).unwrap();
        assert_eq!(got, vec![0x9_0000, 0x4_0000]);
        assert_eq!(span_pages(va, len) as usize, got.len());
        // One element over both pages (bus contiguous).
        let got = pages(va, len, &[(0x9_0f00, 0x300)]).unwrap();
        assert_eq!(got, vec![0x9_0000, 0x9_1000]);
        // Inside one page.
        let got = pages(0x7000_0010, 0x20, &[(0x3_0010, 0x20)]).unwrap();
        assert_eq!(got, vec![0x3_0000]);
        assert_eq!(span_pages(0x7000_0010, 0x20), 1);
    }

    #[test]
    fn chunks_append_in_order() {
        // Two lists over one buffer, split at a page boundary.
        let mut out = Vec::new();
        append_bus_pages(0x1800, 0x800, [(0xa800, 0x800)], &mut out).unwrap();
        append_bus_pages(0x2000, 0x1000, [(0xb000, 0x1000)], &mut out).unwrap();
        assert_eq!(out, vec![0xa000, 0xb000]);
    }

    #[test]
    fn lists_that_do_not_match_the_buffer_are_refused() {
        // Offsets disagree.
        assert_eq!(
            pages(0x1000, 0x1000, &[(0x2010, 0x1000)]),
            Err(SgPagesError::Malformed)
        );
        // Too few, too many bytes; an empty element; overflow.
        assert_eq!(
            pages(0x1000, 0x2000, &[(0x2000, 0x1000)]),
            Err(SgPagesError::LengthMismatch)
        );
        assert_eq!(
            pages(0x1000, 0x1000, &[(0x2000, 0x2000)]),
            Err(SgPagesError::LengthMismatch)
        );
        assert_eq!(
            pages(0x1000, 0x1000, &[(0x2000, 0), (0x2000, 0x1000)]),
            Err(SgPagesError::Malformed)
        );
        assert_eq!(
            pages(0x1000, 0x1000, &[(u64::MAX - 0xfff, 0x1001)]),
            Err(SgPagesError::Malformed)
        );
        assert_eq!(pages(u64::MAX, 2, &[]), Err(SgPagesError::Malformed));
    }
}
