//! The doorbell: one narrow MMIO-write primitive on the context's UAR page.
//!
//! Contract:
//! - [`UarPage::write64`] is the only way the provider reaches the device's
//!   registers: one 64-bit store at an offset inside the context's UAR page
//!   (PRM 9.1: `SQ_DOORBELL`, `CQ_DOORBELL`), preceded by
//!   [`crate::dma::to_device`] so the WQEs and records written before it are
//!   visible to the device first.
//! - On Windows the store is a volatile write to the page the kernel mapped
//!   into the process (`OpenCaOut::doorbell`).
//! - Elsewhere (the simulated host on Linux) there is no device page to
//!   write: the store goes to an [`MmioHook`] the simulator hands over when
//!   the context is created, called in the calling thread with the
//!   doorbell's address and value, exactly as the store would reach the
//!   device. The provider never depends on the simulator; the hook is just
//!   a function.
//! - A store the page does not hold (an offset past the page, or not
//!   8-byte aligned) is refused before it is made.

#[cfg(not(windows))]
use std::sync::Arc;

/// Bytes of a UAR page (PRM 9.1).
pub const UAR_PAGE_BYTES: u64 = hca_prm::doorbell::UAR_PAGE_SIZE;

/// Where a doorbell store goes when there is no real device page (the
/// simulated host): `(address, value)`, run in the calling thread.
#[cfg(not(windows))]
pub type MmioHook = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// The context's UAR page as the provider sees it.
pub struct UarPage {
    base: u64,
    #[cfg(not(windows))]
    hook: MmioHook,
}

impl core::fmt::Debug for UarPage {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("UarPage")
            .field("base", &format_args!("{:#x}", self.base))
            .finish_non_exhaustive()
    }
}

/// A doorbell register's offset in a UAR page, checked when it is made
/// ([`Register::at`]): inside the page and 8-byte aligned, so
/// [`UarPage::ring`] stores there with no check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Register {
    offset: u64,
}

impl Register {
    /// The register at `offset`; `None` outside a page or misaligned.
    pub const fn at(offset: u64) -> Option<Self> {
        if offset.is_multiple_of(8) && offset.saturating_add(8) <= UAR_PAGE_BYTES {
            Some(Self { offset })
        } else {
            None
        }
    }

    /// Its offset in the page.
    pub const fn offset(self) -> u64 {
        self.offset
    }
}

impl UarPage {
    /// The UAR page the kernel mapped at `base` into this process.
    ///
    /// # Safety
    /// `base..base + 4096` must be the context's UAR page, mapped into this
    /// process (uncached) for as long as the returned value lives.
    #[cfg(windows)]
    pub unsafe fn mapped(base: u64) -> Self {
        Self { base }
    }

    /// The UAR page mapped at `base`, whose stores the simulator's `hook`
    /// delivers to the device.
    #[cfg(not(windows))]
    pub fn simulated(base: u64, hook: MmioHook) -> Self {
        Self { base, hook }
    }

    /// The page's address in the process.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Rings a doorbell: the to-device barrier, then one 64-bit store of
    /// `value` at `offset` in the page. False, with nothing stored, for an
    /// offset outside the page or not 8-byte aligned.
    #[inline]
    pub fn write64(&self, offset: u64, value: u64) -> bool {
        match Register::at(offset) {
            Some(register) => {
                self.ring(register, value);
                true
            }
            None => false,
        }
    }

    /// [`write64`](Self::write64) at a register checked once, when the
    /// queue that rings it was set up: no check per store.
    #[inline]
    pub fn ring(&self, register: Register, value: u64) {
        crate::dma::to_device();
        self.store(self.base + register.offset, value);
    }

    #[cfg(windows)]
    #[inline]
    fn store(&self, address: u64, value: u64) {
        let register = address as usize as *mut u64;
        // SAFETY: `address` is 8-byte aligned and inside the UAR page, which
        // is mapped for the life of `self` (`mapped`'s contract); a device
        // register is written with a volatile store.
        unsafe { core::ptr::write_volatile(register, value) };
    }

    #[cfg(not(windows))]
    #[inline]
    fn store(&self, address: u64, value: u64) {
        (self.hook)(address, value);
    }
}

#[cfg(all(test, not(windows)))]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn stores_inside_the_page_reach_the_hook_and_others_are_refused() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&seen);
        let page = UarPage::simulated(
            0x7000_0000,
            Arc::new(move |address, value| sink.lock().unwrap().push((address, value))),
        );
        assert!(page.write64(0, 1));
        assert!(page.write64(8, 2));
        assert!(page.write64(4088, 3));
        assert!(!page.write64(4, 9));
        assert!(!page.write64(4096, 9));
        assert!(!page.write64(u64::MAX - 7, 9));
        assert_eq!(Register::at(4088).map(Register::offset), Some(4088));
        assert!(Register::at(4).is_none() && Register::at(4096).is_none());
        page.ring(Register::at(16).unwrap(), 4);
        assert_eq!(
            *seen.lock().unwrap(),
            [
                (0x7000_0000, 1),
                (0x7000_0008, 2),
                (0x7000_0FF8, 3),
                (0x7000_0010, 4)
            ]
        );
    }
}
