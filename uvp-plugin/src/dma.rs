//! Memory the provider shares with the device: rings and doorbell records
//! in the process's own memory, reached through raw pointers.
//!
//! Contract:
//! - A [`DmaBuffer`] is a range of user memory the kernel pinned and mapped
//!   for the device (PRM 13). The provider reaches it only through this
//!   module, and only as naturally aligned 64-bit atomic words: the device
//!   reads and writes the same memory at any moment, so a plain store
//!   would be a data race. On the simulated host the memory *is* a run of
//!   `AtomicU64` words (`sim_host::memory`); on Windows it is ordinary
//!   pinned memory, where atomic accesses are ordinary loads and stores.
//! - Stores are relaxed: ordering towards the device comes from the named
//!   barriers below, placed by the queue code (rdma-core's
//!   `udma_to_device_barrier` / `udma_from_device_barrier`).
//! - Out-of-range accesses are refused (`false` / `None`), never performed.
//!
//! This module and [`crate::mmio`] hold the crate's only `unsafe` code.

use core::ptr::NonNull;
use core::sync::atomic::{AtomicU64, Ordering, fence};

/// Bytes of a word, the unit of every access.
const WORD: usize = 8;

/// Orders the provider's earlier stores to shared memory (WQEs, records)
/// before a later store the device acts on (a doorbell): a release fence.
#[inline]
pub fn to_device() {
    fence(Ordering::Release);
}

/// Orders a load that saw the device's ownership mark (a CQE's owner bit)
/// before the loads of the entry it guards: an acquire fence (`dma_rmb`).
#[inline]
pub fn from_device() {
    fence(Ordering::Acquire);
}

/// Why a range cannot be used as a [`DmaBuffer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BufferError {
    /// Null, not 8-byte aligned, empty, not a whole number of words, or
    /// wrapping the address space.
    #[error("{len} bytes at {address:#x} are not an aligned, non-empty range of words")]
    BadRange {
        /// Start of the range.
        address: u64,
        /// Its length.
        len: usize,
    },
}

/// A range of memory shared with the device, accessed as 64-bit atomics.
///
/// # Invariants
/// `base` points to `words` consecutive, 8-byte aligned 64-bit words that
/// stay valid for the buffer's life and that everybody else accesses only
/// atomically (see [`DmaBuffer::from_raw`]).
#[derive(Debug)]
pub struct DmaBuffer {
    base: NonNull<AtomicU64>,
    words: usize,
}

// SAFETY: the buffer is a pointer to memory every party accesses only
// through atomics (type invariant), so moving it to another thread moves no
// unsynchronised state.
unsafe impl Send for DmaBuffer {}
// SAFETY: every method takes `&self` and touches the memory only through
// `AtomicU64` operations, which are safe to run from many threads at once.
unsafe impl Sync for DmaBuffer {}

impl DmaBuffer {
    /// The `len` bytes at `address` as a shared buffer.
    ///
    /// # Safety
    /// For as long as the returned buffer (and anything it moves into)
    /// lives, `address..address + len` must be memory of this process,
    /// valid for reads and writes, that nothing accesses other than through
    /// naturally aligned 64-bit atomic operations (the device's accesses
    /// are DMA and count as such). Memory the provider allocated and the
    /// kernel pinned for a ring or a record satisfies this until it is freed.
    pub unsafe fn from_raw(address: u64, len: usize) -> Result<Self, BufferError> {
        let bad = BufferError::BadRange { address, len };
        let fits = usize::try_from(address)
            .ok()
            .and_then(|start| start.checked_add(len))
            .is_some();
        if len == 0 || !len.is_multiple_of(WORD) || !address.is_multiple_of(WORD as u64) || !fits {
            return Err(bad);
        }
        let base = NonNull::new(address as usize as *mut AtomicU64).ok_or(bad)?;
        Ok(Self {
            base,
            words: len / WORD,
        })
    }

    /// Bytes of the buffer.
    pub fn len(&self) -> usize {
        self.words * WORD
    }

    /// Always false: a buffer has at least one word.
    pub fn is_empty(&self) -> bool {
        self.words == 0
    }

    /// The address of byte 0.
    pub fn address(&self) -> u64 {
        self.base.as_ptr() as usize as u64
    }

    /// Word 0, which every buffer has (`from_raw` refuses an empty one).
    #[inline]
    fn first_word(&self) -> &AtomicU64 {
        // SAFETY: the buffer holds at least one aligned, live word, only
        // accessed atomically (type invariant; `from_raw` refuses an empty
        // range); the reference lives no longer than `&self`.
        unsafe { self.base.as_ref() }
    }

    /// Word `index`, if the buffer has it.
    #[inline]
    fn word(&self, index: usize) -> Option<&AtomicU64> {
        if index >= self.words {
            return None;
        }
        let word = self.base.as_ptr().wrapping_add(index);
        // SAFETY: `index` is within the buffer, so `word` points to one of
        // its aligned, live words, which are only accessed atomically (type
        // invariant); the reference lives no longer than `&self`.
        Some(unsafe { &*word })
    }

    /// Stores `bytes` (a whole number of words, little-endian) at the
    /// word-aligned `offset`, word by word in ascending order; false, with
    /// nothing stored, if the range is not whole words inside the buffer.
    #[inline]
    pub fn store_words(&self, offset: usize, bytes: &[u8]) -> bool {
        let whole = offset.is_multiple_of(WORD) && bytes.len().is_multiple_of(WORD);
        let first = offset / WORD;
        let inside = first
            .checked_add(bytes.len() / WORD)
            .is_some_and(|end| end <= self.words);
        if !whole || !inside {
            return false;
        }
        for (i, chunk) in bytes.chunks_exact(WORD).enumerate() {
            let mut word = [0u8; WORD];
            word.copy_from_slice(chunk);
            if let Some(w) = self.word(first + i) {
                w.store(u64::from_le_bytes(word), Ordering::Relaxed);
            }
        }
        true
    }

    /// The buffer's first `words` words as a ring ([`RingWords`]); `None`
    /// unless `words` is a power of two the buffer holds.
    #[inline]
    pub fn ring_words(&self, words: usize) -> Option<RingWords<'_>> {
        (words.is_power_of_two() && words <= self.words).then_some(RingWords {
            base: self.base,
            mask: words - 1,
            _buffer: core::marker::PhantomData,
        })
    }

    /// Stores `value` as word `index` (bytes `8 * index..8 * index + 8`,
    /// relaxed); false, with nothing stored, past the end.
    #[inline]
    pub fn store_word(&self, index: usize, value: u64) -> bool {
        match self.word(index) {
            Some(w) => {
                w.store(value, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Loads word `index` (bytes `8 * index..8 * index + 8`, relaxed).
    #[inline]
    pub fn load_word_at(&self, index: usize) -> Option<u64> {
        self.word(index).map(|w| w.load(Ordering::Relaxed))
    }

    /// Loads the word at the word-aligned `offset` (relaxed).
    #[inline]
    pub fn load_word(&self, offset: usize) -> Option<u64> {
        if !offset.is_multiple_of(WORD) {
            return None;
        }
        self.word(offset / WORD).map(|w| w.load(Ordering::Relaxed))
    }

    /// Copies whole words from the word-aligned `offset` into `out`, in
    /// ascending order (relaxed); false, with `out` untouched, if the range
    /// is not whole words inside the buffer.
    #[inline]
    pub fn read_words(&self, offset: usize, out: &mut [u8]) -> bool {
        let whole = offset.is_multiple_of(WORD) && out.len().is_multiple_of(WORD);
        let first = offset / WORD;
        let inside = first
            .checked_add(out.len() / WORD)
            .is_some_and(|end| end <= self.words);
        if !whole || !inside {
            return false;
        }
        for (i, chunk) in out.chunks_exact_mut(WORD).enumerate() {
            if let Some(w) = self.word(first + i) {
                chunk.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
            }
        }
        true
    }

    /// Stores the 4-byte little-endian `value` at the 4-byte aligned
    /// `offset` (a doorbell record, PRM 9.2) as one read-modify-write of
    /// its word with `Release` order, keeping the word's other half: the
    /// device reads the record with 64-bit accesses, so the store must not
    /// be a mixed-size one. False if out of range or misaligned.
    #[inline]
    pub fn store_u32_release(&self, offset: usize, value: u32) -> bool {
        if !offset.is_multiple_of(4) {
            return false;
        }
        let Some(word) = self.word(offset / WORD) else {
            return false;
        };
        let shift = (offset % WORD) * 8;
        let mask = 0xFFFF_FFFFu64 << shift;
        // Never fails: the closure always returns `Some`.
        let _ = word.fetch_update(Ordering::Release, Ordering::Relaxed, |old| {
            Some((old & !mask) | (u64::from(value) << shift))
        });
        true
    }

    /// Zero-fills the buffer (a CQ ring before it is handed to the kernel:
    /// PRM 10.4's owner rule needs the first pass to start from zeros).
    pub fn zero(&self) {
        for i in 0..self.words {
            if let Some(w) = self.word(i) {
                w.store(0, Ordering::Relaxed);
            }
        }
    }
}

/// A [`DmaBuffer`]'s first `mask + 1` words (a power of two) as a ring
/// of words, a `Copy` value borrowed from the buffer
/// ([`DmaBuffer::ring_words`]): a store at any index wraps into the ring
/// with one `and`, no bounds check, and a loop storing through it keeps
/// the base in a register (a store through `&DmaBuffer` may, for the
/// compiler, change the buffer's own fields, which it then reloads).
///
/// # Invariants
/// `mask + 1` is a power of two no larger than the buffer's words.
#[derive(Debug, Clone, Copy)]
pub struct RingWords<'a> {
    base: NonNull<AtomicU64>,
    mask: usize,
    _buffer: core::marker::PhantomData<&'a DmaBuffer>,
}

impl<'a> RingWords<'a> {
    /// Stores `value` (relaxed) at ring word `index` modulo the ring's
    /// words.
    #[inline(always)]
    pub fn store(self, index: usize, value: u64) {
        let word = self.base.as_ptr().wrapping_add(index & self.mask);
        // SAFETY: `index & mask` is below the ring's words, which are
        // words of the buffer this borrows (type invariant): live, aligned
        // and accessed only atomically (`DmaBuffer`'s invariant) for as
        // long as the borrow lasts.
        unsafe { &*word }.store(value, Ordering::Relaxed);
    }

    /// Loads ring word `index` modulo the ring's words (relaxed).
    #[inline(always)]
    pub fn load(self, index: usize) -> u64 {
        let word = self.base.as_ptr().wrapping_add(index & self.mask);
        // SAFETY: as `store`'s: `index & mask` is a word of the borrowed
        // buffer, live, aligned and accessed only atomically.
        unsafe { &*word }.load(Ordering::Relaxed)
    }

    /// Entry `entry` modulo the ring's entries, the ring taken as entries
    /// of `N` words (a CQ's CQEs): one mask for the entry, none per word.
    /// `None` unless `N` is a power of two the ring holds at least once.
    #[inline(always)]
    pub fn entry<const N: usize>(self, entry: usize) -> Option<EntryWords<'a, N>> {
        if !N.is_power_of_two() || self.mask < N - 1 {
            return None;
        }
        let first = entry.wrapping_mul(N) & self.mask;
        Some(EntryWords {
            first: self.base.as_ptr().wrapping_add(first),
            _buffer: core::marker::PhantomData,
        })
    }
}

/// The `N` words of one ring entry ([`RingWords::entry`]): a load names
/// its word by a fixed offset, with no mask.
///
/// # Invariants
/// `first` and the `N - 1` words after it are words of the borrowed
/// buffer's ring: `mask + 1` and `N` are powers of two with `N <= mask +
/// 1`, so `mask`'s low `log2(N)` bits are ones, and `first`, a multiple
/// of `N` masked by `mask`, stays one, at most `mask + 1 - N`.
#[derive(Debug, Clone, Copy)]
pub struct EntryWords<'a, const N: usize> {
    first: *mut AtomicU64,
    _buffer: core::marker::PhantomData<&'a DmaBuffer>,
}

impl<const N: usize> EntryWords<'_, N> {
    /// Loads the entry's word `word` modulo `N` (relaxed); a constant
    /// `word` costs no instruction to place.
    #[inline(always)]
    pub fn load(self, word: usize) -> u64 {
        let word = self.first.wrapping_add(word & (N - 1));
        // SAFETY: `word & (N - 1)` is below `N`, so `word` is one of the
        // entry's words (type invariant): live, aligned and accessed only
        // atomically (`DmaBuffer`'s invariant) while the borrow lasts.
        unsafe { &*word }.load(Ordering::Relaxed)
    }
}

/// A [`DmaBuffer`] owned as a ring of a power of two of words, checked
/// once when it is made ([`WordRing::new`]): a load at any index wraps
/// into the ring with one `and`, no bounds check. What a CQ keeps for its
/// whole life, so its poll checks nothing per call: a
/// [`WordRing::view`] is a copy of the base and the mask.
///
/// # Invariants
/// `mask + 1` is a power of two no larger than `buffer`'s words.
#[derive(Debug)]
pub struct WordRing {
    buffer: DmaBuffer,
    mask: usize,
}

impl WordRing {
    /// `buffer`'s first `words` words as a ring; `None` unless `words` is
    /// a power of two the buffer holds.
    pub fn new(buffer: DmaBuffer, words: usize) -> Option<Self> {
        (words.is_power_of_two() && words <= buffer.words).then_some(Self {
            buffer,
            mask: words - 1,
        })
    }

    /// Words in the ring.
    #[inline]
    pub fn words(&self) -> usize {
        self.mask + 1
    }

    /// The ring as a `Copy` view: a loop loading or storing through it
    /// keeps the base and mask in registers across the barriers and
    /// atomic stores it runs (either makes the compiler reload whatever
    /// it reaches through `&self`).
    #[inline(always)]
    pub fn view(&self) -> RingWords<'_> {
        RingWords {
            base: self.buffer.base,
            mask: self.mask,
            _buffer: core::marker::PhantomData,
        }
    }

    /// Stores `value` (relaxed) at ring word `index` modulo the ring's
    /// words.
    #[inline(always)]
    pub fn store(&self, index: usize, value: u64) {
        self.view().store(index, value);
    }

    /// Loads ring word `index` modulo the ring's words (relaxed).
    #[inline(always)]
    pub fn load(&self, index: usize) -> u64 {
        self.view().load(index)
    }
}

/// A doorbell record (PRM 9.2): 4 bytes, 4-byte aligned, stored as one
/// 64-bit read-modify-write of the aligned word that holds it, or, when
/// the word is the record's alone ([`Record::owning_word`]), as one 64-bit
/// store.
#[derive(Debug)]
pub struct Record {
    word: DmaBuffer,
    /// The record's bit offset in its word (0 or 32), fixed at creation
    /// so a store makes no alignment or range check.
    shift: u32,
    /// The word holds nothing but the record (at offset 0): a store may
    /// write the whole word.
    owns_word: bool,
}

impl Record {
    /// The record at `address` (4-byte aligned).
    ///
    /// # Safety
    /// As [`DmaBuffer::from_raw`] for the aligned 8-byte word holding the
    /// record (it lies in the record's page, so any page-granular
    /// allocation holding the record holds the word).
    pub unsafe fn from_raw(address: u64) -> Result<Self, BufferError> {
        if !address.is_multiple_of(4) {
            return Err(BufferError::BadRange { address, len: 4 });
        }
        let word_address = address & !(WORD as u64 - 1);
        // SAFETY: the caller's contract covers this word.
        let word = unsafe { DmaBuffer::from_raw(word_address, WORD) }?;
        Ok(Self {
            word,
            shift: (address - word_address) as u32 * 8,
            owns_word: false,
        })
    }

    /// The record at the 8-byte aligned `address`, whose word's other 4
    /// bytes belong to no one: a store writes the whole word, its upper
    /// half 0, with no read-modify-write.
    ///
    /// # Safety
    /// As [`DmaBuffer::from_raw`] for the 8 bytes at `address`, and nothing
    /// (no other record, no device) gives bytes 4 to 8 a meaning: the
    /// caller allocated them for this record alone.
    pub unsafe fn owning_word(address: u64) -> Result<Self, BufferError> {
        // SAFETY: the caller's contract covers the word at `address`.
        let word = unsafe { DmaBuffer::from_raw(address, WORD) }?;
        Ok(Self {
            word,
            shift: 0,
            owns_word: true,
        })
    }

    /// Stores the counter with `Release` order: the WQEs written before it
    /// are visible to a device that reads it (PRM 9.2). One store of the
    /// whole word when the record owns it, else one read-modify-write of
    /// the word, keeping its other half, as
    /// [`DmaBuffer::store_u32_release`]: the device reads the record with
    /// 64-bit accesses, so a 32-bit store would be a mixed-size one.
    #[inline]
    pub fn store_release(&self, value: u32) {
        if self.owns_word {
            self.word
                .first_word()
                .store(u64::from(value), Ordering::Release);
            return;
        }
        let mask = 0xFFFF_FFFFu64 << self.shift;
        let value = u64::from(value) << self.shift;
        // Never fails: the closure always returns `Some`.
        let _ = self
            .word
            .first_word()
            .fetch_update(Ordering::Release, Ordering::Relaxed, |old| {
                Some((old & !mask) | value)
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer(words: &mut [AtomicU64]) -> DmaBuffer {
        // SAFETY: `words` is a live array of atomics that outlives the
        // buffer in each test and is accessed only atomically.
        unsafe { DmaBuffer::from_raw(words.as_mut_ptr() as u64, words.len() * 8) }.unwrap()
    }

    #[test]
    fn word_accesses_stay_inside_and_keep_neighbours() {
        let mut words: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(u64::MAX)).collect();
        let b = buffer(&mut words);
        assert_eq!(b.len(), 32);
        assert!(b.store_words(8, &[1, 2, 3, 4, 5, 6, 7, 8]));
        assert_eq!(b.load_word(8), Some(0x0807_0605_0403_0201));
        assert!(!b.store_words(4, &[0; 8]), "misaligned");
        assert!(!b.store_words(24, &[0; 16]), "past the end");
        assert!(!b.store_words(8, &[0; 4]), "not a whole word");
        assert_eq!(b.load_word(32), None);
        assert!(b.store_word(3, 0x0102));
        assert_eq!(b.load_word(24), Some(0x0102));
        assert!(!b.store_word(4, 9), "past the end");
        let ring = b.ring_words(4).unwrap();
        ring.store(6, 0x0304);
        assert_eq!(b.load_word_at(2), Some(0x0304), "index 6 wraps to 2");
        assert!(b.ring_words(3).is_none() && b.ring_words(8).is_none());
        assert_eq!(b.load_word_at(3), Some(0x0102));
        assert_eq!(b.load_word_at(4), None);
        assert!(b.store_u32_release(4, 0x1122_3344));
        assert_eq!(b.load_word(0), Some(0x1122_3344_FFFF_FFFF));
        assert!(!b.store_u32_release(2, 0));
        assert!(!b.store_u32_release(32, 0));
        let mut out = [0u8; 16];
        assert!(b.read_words(0, &mut out));
        assert_eq!(&out[8..], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert!(!b.read_words(24, &mut out));
        b.zero();
        assert!(words.iter().all(|w| w.load(Ordering::Relaxed) == 0));
    }

    #[test]
    fn a_record_in_either_half_of_its_word_keeps_the_other() {
        let mut words: Vec<AtomicU64> = (0..2).map(|_| AtomicU64::new(0)).collect();
        let base = words.as_mut_ptr() as u64;
        // SAFETY: word 1 is a live atomic that outlives the record.
        let low = unsafe { Record::from_raw(base + 8) }.unwrap();
        // SAFETY: as above.
        let high = unsafe { Record::from_raw(base + 12) }.unwrap();
        low.store_release(0x1111_1111);
        high.store_release(0x2222_2222);
        low.store_release(0x3333_3333);
        assert_eq!(words[1].load(Ordering::Relaxed), 0x2222_2222_3333_3333);
        assert_eq!(words[0].load(Ordering::Relaxed), 0);
        // SAFETY: refused before anything is accessed.
        assert!(unsafe { Record::from_raw(base + 2) }.is_err());
    }

    #[test]
    fn a_record_owning_its_word_stores_the_whole_word() {
        let mut words: Vec<AtomicU64> = (0..2).map(|_| AtomicU64::new(u64::MAX)).collect();
        let base = words.as_mut_ptr() as u64;
        // SAFETY: word 1 is a live atomic that outlives the record, and
        // its upper half is no one's.
        let record = unsafe { Record::owning_word(base + 8) }.unwrap();
        record.store_release(0x1111_1111);
        assert_eq!(words[1].load(Ordering::Relaxed), 0x1111_1111);
        assert_eq!(words[0].load(Ordering::Relaxed), u64::MAX);
        // SAFETY: refused before anything is accessed.
        assert!(unsafe { Record::owning_word(base + 4) }.is_err());
    }

    #[test]
    fn a_word_ring_wraps_inside_its_words_and_refuses_bad_sizes() {
        let mut words: Vec<AtomicU64> = (0..6).map(AtomicU64::new).collect();
        assert!(
            WordRing::new(buffer(&mut words), 3).is_none(),
            "not a power of two"
        );
        assert!(
            WordRing::new(buffer(&mut words), 8).is_none(),
            "past the end"
        );
        let ring = WordRing::new(buffer(&mut words), 4).unwrap();
        assert_eq!(ring.load(2), 2);
        assert_eq!(ring.load(5), 1, "wraps at 4 words, not 6");
        assert_eq!(ring.load(usize::MAX), 3);
        let view = ring.view();
        assert_eq!(
            (view.load(2), view.load(5), view.load(usize::MAX)),
            (2, 1, 3),
            "the view wraps as the ring does"
        );
        let entry = view.entry::<2>(3).unwrap();
        assert_eq!((entry.load(0), entry.load(1)), (2, 3), "entry 3 is entry 1");
        assert_eq!(entry.load(2), 2, "a word index wraps in its entry");
        assert_eq!(view.entry::<4>(5).unwrap().load(3), 3, "one entry");
        assert!(view.entry::<8>(0).is_none(), "larger than the ring");
        assert!(view.entry::<3>(0).is_none(), "not a power of two");
    }

    #[test]
    fn bad_ranges_are_refused() {
        // SAFETY: every call is refused before anything could be accessed.
        let refused =
            |address: u64, len: usize| unsafe { DmaBuffer::from_raw(address, len) }.is_err();
        assert!(refused(0, 8));
        assert!(refused(8, 0));
        assert!(refused(12, 8));
        assert!(refused(8, 12));
        assert!(refused(u64::MAX - 7, 16));
    }
}
