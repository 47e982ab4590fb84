//! Counted UTF-16 strings for the kernel's `UNICODE_STRING` arguments.

use alloc::vec::Vec;

use wdk_sys::UNICODE_STRING;

/// A counted UTF-16 string for the kernel's `UNICODE_STRING` arguments; the
/// buffer lives as long as this value.
#[derive(Debug)]
pub struct WideString {
    units: Vec<u16>,
}

impl WideString {
    /// `text` in UTF-16 (no terminator: a `UNICODE_STRING` is counted).
    /// `None` when longer than a `UNICODE_STRING` can describe.
    pub fn new(text: &str) -> Option<Self> {
        let units: Vec<u16> = text.encode_utf16().collect();
        u16::try_from(units.len() * 2).ok()?;
        Some(Self { units })
    }

    /// The `UNICODE_STRING` over the buffer, valid while `self` lives and
    /// is not moved.
    pub fn unicode(&mut self) -> UNICODE_STRING {
        let bytes = (self.units.len() * 2) as u16;
        UNICODE_STRING {
            Length: bytes,
            MaximumLength: bytes,
            Buffer: self.units.as_mut_ptr(),
        }
    }
}
