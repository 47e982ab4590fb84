//! [`KeyAllocator`]: MPT indices and the 8-bit tags that make their keys
//! (PRM 7.1: a key is `index << 8 | tag`; the device requires the key's low
//! byte to equal the entry's tag).

use alloc::vec::Vec;

use super::free_list::FreeList;
use super::{MAX_OBJECTS, ResourceError};

/// A memory key (L_Key or R_Key): `index << 8 | tag`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryKey(u32);

impl MemoryKey {
    /// The key for MPT entry `index` (below 2^24) with `tag`; `None` when
    /// the index does not fit in 24 bits.
    pub const fn new(index: u32, tag: u8) -> Option<Self> {
        if index >= MAX_OBJECTS {
            return None;
        }
        Some(Self(index << 8 | tag as u32))
    }

    /// Wraps a key as a client or a WQE gave it.
    pub const fn from_raw(raw: u32) -> Self {
        Self(raw)
    }

    /// The 32-bit key.
    pub const fn raw(self) -> u32 {
        self.0
    }

    /// The MPT index (high 24 bits).
    pub const fn index(self) -> u32 {
        self.0 >> 8
    }

    /// The tag (low byte).
    pub const fn tag(self) -> u8 {
        self.0 as u8
    }
}

/// Hands out MPT indices (regions and windows share the table) and keeps
/// each index's current tag.
///
/// The tag changes every time an index is freed and whenever
/// [`bump_tag`](Self::bump_tag) is called (re-registration; a window's
/// bind, which must change the key, PRM 7.1 and guide 7.2), so a key held
/// over from an earlier use of the index no longer matches. Tags are 8 bits: a key repeats after 256 changes of
/// its index, which is the PRM's format's limit. Indices are reused FIFO,
/// which makes that as late as possible.
///
/// # Invariants
/// `free` holds exactly the indices not `in_use`.
#[derive(Debug, Clone)]
pub struct KeyAllocator {
    free: FreeList,
    tags: Vec<u8>,
    in_use: Vec<bool>,
}

impl KeyAllocator {
    /// An allocator for `capacity` MPT entries (`1 << log_max_mpts`).
    ///
    /// Fails with [`ResourceError::InvalidCapacity`] above [`MAX_OBJECTS`]
    /// (the index would not fit in a key).
    pub fn new(capacity: u32) -> Result<Self, ResourceError> {
        if capacity > MAX_OBJECTS {
            return Err(ResourceError::InvalidCapacity);
        }
        let mut free = FreeList::new(capacity);
        for index in 0..capacity {
            free.push_back(index);
        }
        Ok(Self {
            free,
            tags: alloc::vec![0; capacity as usize],
            in_use: alloc::vec![false; capacity as usize],
        })
    }

    /// Takes the least recently freed index; its key carries the index's
    /// current tag.
    ///
    /// Fails with [`ResourceError::Exhausted`] when every entry is in use.
    pub fn alloc(&mut self) -> Result<MemoryKey, ResourceError> {
        let index = self.free.pop_front().ok_or(ResourceError::Exhausted)?;
        self.in_use[index as usize] = true;
        Ok(self.key_of(index))
    }

    /// Gives the index a new tag and returns its new key; the old key stops
    /// matching.
    ///
    /// Fails with [`ResourceError::InvalidNumber`] when the index is not
    /// allocated.
    pub fn bump_tag(&mut self, index: u32) -> Result<MemoryKey, ResourceError> {
        if !self.is_allocated(index) {
            return Err(ResourceError::InvalidNumber { number: index });
        }
        let tag = &mut self.tags[index as usize];
        *tag = tag.wrapping_add(1);
        Ok(self.key_of(index))
    }

    /// Frees the key's index, changing its tag so the key is dead.
    ///
    /// Fails with [`ResourceError::InvalidKey`], changing nothing, unless
    /// the key is current (a double free presents a dead key).
    pub fn free(&mut self, key: MemoryKey) -> Result<(), ResourceError> {
        if !self.is_current(key) {
            return Err(ResourceError::InvalidKey { key: key.raw() });
        }
        self.free_index(key.index())
    }

    /// Frees an allocated index whatever its current tag: for entries whose
    /// key the device changed behind the driver (a type 2 window bound by a
    /// user-mode WQE, whose tag the poster chose).
    ///
    /// Fails with [`ResourceError::InvalidNumber`], changing nothing, when
    /// the index is not allocated.
    pub fn free_index(&mut self, index: u32) -> Result<(), ResourceError> {
        if !self.is_allocated(index) {
            return Err(ResourceError::InvalidNumber { number: index });
        }
        self.in_use[index as usize] = false;
        self.tags[index as usize] = self.tags[index as usize].wrapping_add(1);
        self.free.push_back(index);
        Ok(())
    }

    /// The allocated index's current key.
    pub fn current_key(&self, index: u32) -> Option<MemoryKey> {
        self.is_allocated(index).then(|| self.key_of(index))
    }

    /// True when the key's index is allocated and its tag is current.
    pub fn is_current(&self, key: MemoryKey) -> bool {
        self.current_key(key.index()) == Some(key)
    }

    /// Entries still free.
    pub fn free_count(&self) -> u32 {
        self.free.len()
    }

    fn is_allocated(&self, index: u32) -> bool {
        self.in_use.get(index as usize) == Some(&true)
    }

    fn key_of(&self, index: u32) -> MemoryKey {
        // `index < capacity <= MAX_OBJECTS`, so the shift keeps every bit.
        MemoryKey(index << 8 | u32::from(self.tags[index as usize]))
    }
}

#[cfg(test)]
mod tests {
    use alloc::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn keys_are_index_over_tag() {
        let key = MemoryKey::new(0x12_3456, 0x78).unwrap();
        assert_eq!(key.raw(), 0x1234_5678);
        assert_eq!((key.index(), key.tag()), (0x12_3456, 0x78));
        assert_eq!(MemoryKey::new(MAX_OBJECTS, 0), None);
        assert_eq!(hca_prm::mpt::key_index(key.raw()), key.index());
        assert_eq!(hca_prm::mpt::key_tag(key.raw()), key.tag());
    }

    #[test]
    fn a_recycled_index_gets_a_new_key() {
        let mut mpt = KeyAllocator::new(1).unwrap();
        let old = mpt.alloc().unwrap();
        assert_eq!(old.raw(), 0x0000_0000);
        mpt.free(old).unwrap();
        assert!(!mpt.is_current(old));
        let new = mpt.alloc().unwrap();
        assert_eq!(new.index(), old.index());
        assert_ne!(new, old);
        assert_eq!(new.tag(), 1);
        assert_eq!(mpt.alloc(), Err(ResourceError::Exhausted));
    }

    #[test]
    fn bump_tag_invalidates_the_previous_key() {
        let mut mpt = KeyAllocator::new(4).unwrap();
        let first = mpt.alloc().unwrap();
        let second = mpt.bump_tag(first.index()).unwrap();
        assert_eq!(second.index(), first.index());
        assert_eq!(second.tag(), first.tag().wrapping_add(1));
        assert!(!mpt.is_current(first) && mpt.is_current(second));
        assert_eq!(mpt.current_key(first.index()), Some(second));
        assert_eq!(
            mpt.free(first),
            Err(ResourceError::InvalidKey { key: first.raw() }),
            "the old key cannot free the entry"
        );
        assert_eq!(
            mpt.bump_tag(3),
            Err(ResourceError::InvalidNumber { number: 3 })
        );
        assert_eq!(
            mpt.bump_tag(99),
            Err(ResourceError::InvalidNumber { number: 99 })
        );
        mpt.free(second).unwrap();
        assert_eq!(
            mpt.free(second),
            Err(ResourceError::InvalidKey { key: second.raw() }),
            "double free"
        );
        assert_eq!(mpt.free_count(), 4);
    }

    #[test]
    fn free_index_frees_whatever_the_tag() {
        let mut mpt = KeyAllocator::new(2).unwrap();
        let key = mpt.alloc().unwrap();
        assert_eq!(mpt.free_index(key.index()), Ok(()));
        assert!(!mpt.is_current(key));
        assert_eq!(
            mpt.free_index(key.index()),
            Err(ResourceError::InvalidNumber {
                number: key.index()
            }),
            "double free"
        );
        assert_eq!(
            mpt.free_index(7),
            Err(ResourceError::InvalidNumber { number: 7 })
        );
        assert_eq!(mpt.free_count(), 2);
    }

    #[test]
    fn tags_wrap_after_256_changes() {
        let mut mpt = KeyAllocator::new(1).unwrap();
        let first = mpt.alloc().unwrap();
        let mut key = first;
        for _ in 0..256 {
            key = mpt.bump_tag(key.index()).unwrap();
        }
        assert_eq!(key, first, "an 8-bit tag repeats after 256 changes");
        assert!(KeyAllocator::new(MAX_OBJECTS + 1).is_err());
    }

    proptest! {
        /// Against a model of current keys: live keys are unique per index
        /// and current; every key ever superseded is dead until its tag
        /// comes round again (not reached here: fewer than 256 changes).
        #[test]
        fn key_allocator_agrees_with_a_model(ops in proptest::collection::vec(
            (0..3u8, any::<usize>()), 1..200,
        )) {
            let mut mpt = KeyAllocator::new(6).unwrap();
            let mut live: BTreeMap<u32, MemoryKey> = BTreeMap::new();
            let mut dead: Vec<MemoryKey> = Vec::new();
            for (op, pick) in ops {
                let picked = (!live.is_empty()).then(|| *live.values().nth(pick % live.len()).unwrap());
                match (op, picked) {
                    (0, _) => match mpt.alloc() {
                        Ok(key) => prop_assert!(live.insert(key.index(), key).is_none()),
                        Err(error) => {
                            prop_assert_eq!(error, ResourceError::Exhausted);
                            prop_assert_eq!(live.len(), 6);
                        }
                    },
                    (1, Some(key)) => {
                        let new = mpt.bump_tag(key.index()).unwrap();
                        prop_assert_ne!(new, key);
                        live.insert(key.index(), new);
                        dead.push(key);
                    }
                    (2, Some(key)) => {
                        prop_assert_eq!(mpt.free(key), Ok(()));
                        live.remove(&key.index());
                        dead.push(key);
                    }
                    _ => {}
                }
                for key in live.values() {
                    prop_assert!(mpt.is_current(*key));
                }
                for key in &dead {
                    prop_assert!(!mpt.is_current(*key));
                    prop_assert!(mpt.free(*key).is_err());
                }
            }
        }
    }
}
