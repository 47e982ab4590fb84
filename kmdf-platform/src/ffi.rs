//! Arrays a kernel client passes through an interface table's entry
//! points (a pointer and a count), as slices.

/// The `count` entries at `entries` (an SGE list a work-request descriptor
/// designates); empty when the pointer is null or the count 0.
///
/// # Safety
/// A non-null `entries` is valid for `count` entries for `'a` (the
/// consumer's contract).
pub unsafe fn slice_or_empty<'a, T>(entries: *const T, count: u32) -> &'a [T] {
    if entries.is_null() || count == 0 {
        return &[];
    }
    // SAFETY: forwarded from the caller.
    unsafe { core::slice::from_raw_parts(entries, count as usize) }
}

/// The `count` entries at `entries` (the descriptors of a post), or `None`
/// for a null array with a nonzero count.
///
/// # Safety
/// A non-null `entries` is valid for `count` entries for `'a` (the
/// consumer's contract).
pub unsafe fn slice_checked<'a, T>(entries: *const T, count: u32) -> Option<&'a [T]> {
    if count == 0 {
        return Some(&[]);
    }
    if entries.is_null() {
        return None;
    }
    // SAFETY: forwarded from the caller.
    Some(unsafe { core::slice::from_raw_parts(entries, count as usize) })
}
