//! [`UarAllocator`]: doorbell (UAR) pages for user contexts (PRM 9.1).

use alloc::vec::Vec;

use super::ResourceError;
use super::free_list::FreeList;

/// The UAR page the kernel driver rings its own doorbells (and the EQ
/// doorbells) through; never handed to a user context (PRM 9.1, 6.3).
pub const KERNEL_UAR: u32 = 0;

/// Hands out UAR pages `1..num_uars`, one per user context, so that each
/// page is mapped into exactly one process and a QP or CQ honours doorbells
/// from its owner's page only (PRM 9.1). Freed pages are reused FIFO.
///
/// # Invariants
/// `free` holds exactly the pages other than [`KERNEL_UAR`] not `in_use`.
#[derive(Debug, Clone)]
pub struct UarAllocator {
    free: FreeList,
    in_use: Vec<bool>,
}

impl UarAllocator {
    /// An allocator over the `num_uars` pages given to `INIT_HCA`.
    ///
    /// Fails with [`ResourceError::InvalidCapacity`] for 0 pages: the
    /// kernel's page must exist.
    pub fn new(num_uars: u32) -> Result<Self, ResourceError> {
        if num_uars == 0 {
            return Err(ResourceError::InvalidCapacity);
        }
        let mut free = FreeList::new(num_uars);
        for page in KERNEL_UAR + 1..num_uars {
            free.push_back(page);
        }
        Ok(Self {
            free,
            in_use: alloc::vec![false; num_uars as usize],
        })
    }

    /// Takes a page for a user context.
    ///
    /// Fails with [`ResourceError::Exhausted`] when every user page is taken.
    pub fn alloc(&mut self) -> Result<u32, ResourceError> {
        let page = self.free.pop_front().ok_or(ResourceError::Exhausted)?;
        self.in_use[page as usize] = true;
        Ok(page)
    }

    /// Returns a user context's page.
    ///
    /// Fails with [`ResourceError::Reserved`] for [`KERNEL_UAR`] and
    /// [`ResourceError::InvalidNumber`] for a page not handed out.
    pub fn free(&mut self, page: u32) -> Result<(), ResourceError> {
        if page == KERNEL_UAR {
            return Err(ResourceError::Reserved { number: page });
        }
        match self.in_use.get_mut(page as usize) {
            Some(in_use) if *in_use => *in_use = false,
            _ => return Err(ResourceError::InvalidNumber { number: page }),
        }
        self.free.push_back(page);
        Ok(())
    }

    /// User pages still free.
    pub fn free_count(&self) -> u32 {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use alloc::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn page_zero_stays_the_kernels() {
        let mut uars = UarAllocator::new(3).unwrap();
        assert_eq!(uars.alloc(), Ok(1));
        assert_eq!(uars.alloc(), Ok(2));
        assert_eq!(uars.alloc(), Err(ResourceError::Exhausted));
        assert_eq!(
            uars.free(KERNEL_UAR),
            Err(ResourceError::Reserved { number: 0 })
        );
        assert_eq!(uars.free(1), Ok(()));
        assert_eq!(
            uars.free(1),
            Err(ResourceError::InvalidNumber { number: 1 }),
            "double free"
        );
        assert_eq!(
            uars.free(3),
            Err(ResourceError::InvalidNumber { number: 3 })
        );
        assert_eq!(uars.alloc(), Ok(1));
    }

    #[test]
    fn a_kernel_only_device_has_no_user_pages() {
        let mut uars = UarAllocator::new(1).unwrap();
        assert_eq!(uars.free_count(), 0);
        assert_eq!(uars.alloc(), Err(ResourceError::Exhausted));
        assert!(UarAllocator::new(0).is_err());
    }

    proptest! {
        /// Pages handed out are unique, never the kernel's, and frees of
        /// pages not held are refused.
        #[test]
        fn uar_allocator_agrees_with_a_model(ops in proptest::collection::vec(
            (any::<bool>(), 0..10u32), 1..100,
        )) {
            let mut uars = UarAllocator::new(8).unwrap();
            let mut held: BTreeSet<u32> = BTreeSet::new();
            for (is_alloc, page) in ops {
                if is_alloc {
                    match uars.alloc() {
                        Ok(page) => {
                            prop_assert_ne!(page, KERNEL_UAR);
                            prop_assert!(held.insert(page), "page handed out twice");
                        }
                        Err(_) => prop_assert_eq!(held.len(), 7),
                    }
                } else {
                    prop_assert_eq!(uars.free(page).is_ok(), held.remove(&page));
                }
                prop_assert_eq!(uars.free_count() as usize, 7 - held.len());
            }
        }
    }
}
