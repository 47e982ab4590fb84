//! [`RangeAllocator`]: contiguous runs of MTT entries (PRM 6.0).

use alloc::vec::Vec;

use super::ResourceError;

/// A run of consecutive entries `start..start + len`, as handed out by a
/// [`RangeAllocator`] (for a `BufDesc`'s or an MPT entry's `mtt_index`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EntryRange {
    start: u32,
    len: u32,
}

impl EntryRange {
    /// The run `start..start + len` (for handing one back to
    /// [`RangeAllocator::free`] from stored numbers).
    pub const fn new(start: u32, len: u32) -> Self {
        Self { start, len }
    }

    /// The first entry.
    pub const fn start(self) -> u32 {
        self.start
    }

    /// How many entries.
    pub const fn len(self) -> u32 {
        self.len
    }

    /// True for a run of no entries (never handed out).
    pub const fn is_empty(self) -> bool {
        self.len == 0
    }

    /// One past the last entry (as `u64`: it may be 2^32).
    pub const fn end(self) -> u64 {
        self.start as u64 + self.len as u64
    }
}

/// Hands out contiguous runs of entries `0..capacity`, best fit, and
/// coalesces adjacent free runs when runs are freed.
///
/// Memory, allocated once at creation: 4 bytes per entry (the length of the
/// run starting there, which makes [`free`](Self::free) exact) plus a free
/// run list pre-sized for its worst case, `capacity / 2` rounded up runs of
/// 8 bytes (coalesced free runs are separated by at least one allocated
/// entry). So neither `alloc` nor `free` ever allocates.
///
/// # Invariants
/// - `free_runs` is sorted by start, its runs are non-empty, disjoint and
///   never adjacent (adjacent ones are merged).
/// - `allocated_len[s] = n > 0` exactly when `s..s + n` was handed out and
///   not freed; handed-out runs and free runs partition `0..capacity`.
#[derive(Debug, Clone)]
pub struct RangeAllocator {
    free_runs: Vec<EntryRange>,
    allocated_len: Vec<u32>,
    free_entries: u32,
}

impl RangeAllocator {
    /// An allocator over `capacity` entries (`1 << log_max_mtts`).
    pub fn new(capacity: u32) -> Self {
        let mut free_runs = Vec::with_capacity(capacity.div_ceil(2) as usize);
        if capacity > 0 {
            free_runs.push(EntryRange::new(0, capacity));
        }
        Self {
            free_runs,
            allocated_len: alloc::vec![0; capacity as usize],
            free_entries: capacity,
        }
    }

    /// How many entries the allocator covers.
    pub fn capacity(&self) -> u32 {
        self.allocated_len.len() as u32
    }

    /// Entries not handed out.
    pub fn free_entries(&self) -> u32 {
        self.free_entries
    }

    /// The longest run [`alloc`](Self::alloc) can satisfy now.
    pub fn largest_free_run(&self) -> u32 {
        self.free_runs.iter().map(|run| run.len).max().unwrap_or(0)
    }

    /// Takes `len` consecutive entries from the smallest free run that
    /// holds them (the lowest such run on a tie), leaving large runs whole
    /// for large registrations.
    ///
    /// Fails with [`ResourceError::InvalidRange`] for `len` 0,
    /// [`ResourceError::Fragmented`] when enough entries are free but not
    /// contiguously, and [`ResourceError::Exhausted`] otherwise.
    pub fn alloc(&mut self, len: u32) -> Result<EntryRange, ResourceError> {
        if len == 0 {
            return Err(ResourceError::InvalidRange { start: 0, len });
        }
        let mut best: Option<(usize, u32)> = None;
        for (index, run) in self.free_runs.iter().enumerate() {
            if run.len >= len && best.is_none_or(|(_, best_len)| run.len < best_len) {
                best = Some((index, run.len));
                if run.len == len {
                    break;
                }
            }
        }
        let Some((index, _)) = best else {
            return Err(if self.free_entries >= len {
                ResourceError::Fragmented
            } else {
                ResourceError::Exhausted
            });
        };
        let run = &mut self.free_runs[index];
        let taken = EntryRange::new(run.start, len);
        run.start += len;
        run.len -= len;
        if run.len == 0 {
            self.free_runs.remove(index);
        }
        self.allocated_len[taken.start as usize] = len;
        self.free_entries -= len;
        Ok(taken)
    }

    /// Returns a run handed out by [`alloc`](Self::alloc), merging it with
    /// free neighbours.
    ///
    /// Fails with [`ResourceError::InvalidRange`], changing nothing, unless
    /// `range` is exactly a run currently handed out (so a double free, a
    /// part of a run, or two runs at once are refused).
    pub fn free(&mut self, range: EntryRange) -> Result<(), ResourceError> {
        let invalid = ResourceError::InvalidRange {
            start: range.start,
            len: range.len,
        };
        match self.allocated_len.get(range.start as usize) {
            Some(&len) if len != 0 && len == range.len => {}
            _ => return Err(invalid),
        }
        self.allocated_len[range.start as usize] = 0;
        self.free_entries += range.len;

        // The free runs before and after the range are the only ones that
        // can touch it.
        let next = self
            .free_runs
            .partition_point(|run| run.start < range.start);
        let merges_prev = next > 0 && self.free_runs[next - 1].end() == u64::from(range.start);
        let merges_next = self
            .free_runs
            .get(next)
            .is_some_and(|run| u64::from(run.start) == range.end());
        match (merges_prev, merges_next) {
            (true, true) => {
                let after = self.free_runs.remove(next);
                self.free_runs[next - 1].len += range.len + after.len;
            }
            (true, false) => self.free_runs[next - 1].len += range.len,
            (false, true) => {
                let after = &mut self.free_runs[next];
                after.start = range.start;
                after.len += range.len;
            }
            // Within the capacity reserved at creation: no reallocation.
            (false, false) => self.free_runs.insert(next, range),
        }
        Ok(())
    }

    /// True when `range` is exactly a run currently handed out.
    pub fn is_allocated(&self, range: EntryRange) -> bool {
        range.len != 0 && self.allocated_len.get(range.start as usize) == Some(&range.len)
    }
}

#[cfg(test)]
mod tests {
    use alloc::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn runs(allocator: &RangeAllocator) -> Vec<(u32, u32)> {
        allocator
            .free_runs
            .iter()
            .map(|run| (run.start, run.len))
            .collect()
    }

    #[test]
    fn frees_coalesce_with_both_neighbours() {
        let mut mtt = RangeAllocator::new(10);
        let a = mtt.alloc(3).unwrap();
        let b = mtt.alloc(3).unwrap();
        let c = mtt.alloc(3).unwrap();
        assert_eq!((a.start(), b.start(), c.start()), (0, 3, 6));
        assert_eq!(runs(&mtt), [(9, 1)]);
        mtt.free(a).unwrap();
        assert_eq!(runs(&mtt), [(0, 3), (9, 1)]);
        mtt.free(c).unwrap();
        assert_eq!(runs(&mtt), [(0, 3), (6, 4)], "merged with the tail");
        mtt.free(b).unwrap();
        assert_eq!(runs(&mtt), [(0, 10)], "merged with both");
        assert_eq!(mtt.free_entries(), 10);
    }

    #[test]
    fn best_fit_keeps_large_runs_whole() {
        let mut mtt = RangeAllocator::new(16);
        let a = mtt.alloc(4).unwrap();
        let _b = mtt.alloc(2).unwrap();
        let c = mtt.alloc(1).unwrap();
        let _d = mtt.alloc(1).unwrap();
        mtt.free(a).unwrap();
        mtt.free(c).unwrap();
        // Free: 0..4, 6..7, 8..16. One entry goes to the 1-entry hole.
        assert_eq!(mtt.alloc(1).unwrap().start(), 6);
        assert_eq!(mtt.alloc(3).unwrap().start(), 0);
        assert_eq!(mtt.largest_free_run(), 8);
    }

    #[test]
    fn fragmented_and_full_are_told_apart() {
        let mut mtt = RangeAllocator::new(4);
        let runs: Vec<_> = (0..4).map(|_| mtt.alloc(1).unwrap()).collect();
        assert_eq!(mtt.alloc(1), Err(ResourceError::Exhausted));
        mtt.free(runs[0]).unwrap();
        mtt.free(runs[2]).unwrap();
        assert_eq!(mtt.alloc(2), Err(ResourceError::Fragmented));
        assert_eq!(mtt.alloc(3), Err(ResourceError::Exhausted));
        assert_eq!(
            mtt.alloc(0),
            Err(ResourceError::InvalidRange { start: 0, len: 0 })
        );
        assert_eq!(mtt.free_entries(), 2);
    }

    #[test]
    fn bad_frees_change_nothing() {
        let mut mtt = RangeAllocator::new(8);
        let a = mtt.alloc(4).unwrap();
        let b = mtt.alloc(2).unwrap();
        let before = runs(&mtt);
        let bad = [
            EntryRange::new(0, 2),  // part of a run
            EntryRange::new(1, 3),  // not a run's start
            EntryRange::new(0, 6),  // two runs at once
            EntryRange::new(6, 2),  // free entries
            EntryRange::new(99, 1), // out of range
            EntryRange::new(0, 0),  // empty
        ];
        for range in bad {
            assert_eq!(
                mtt.free(range),
                Err(ResourceError::InvalidRange {
                    start: range.start(),
                    len: range.len()
                })
            );
        }
        assert_eq!(runs(&mtt), before);
        mtt.free(a).unwrap();
        assert_eq!(
            mtt.free(a),
            Err(ResourceError::InvalidRange { start: 0, len: 4 }),
            "double free"
        );
        assert!(mtt.is_allocated(b) && !mtt.is_allocated(a));
        assert_eq!(runs(&mtt), [(0, 4), (6, 2)]);
    }

    #[test]
    fn worst_case_fragmentation_fits_the_presized_list() {
        let mut mtt = RangeAllocator::new(7);
        let singles: Vec<_> = (0..7).map(|_| mtt.alloc(1).unwrap()).collect();
        for run in singles.iter().step_by(2) {
            mtt.free(*run).unwrap();
        }
        assert_eq!(runs(&mtt), [(0, 1), (2, 1), (4, 1), (6, 1)]);
        assert!(mtt.free_runs.len() <= mtt.free_runs.capacity());
        assert_eq!(mtt.free_runs.capacity(), 4, "no growth past the worst case");
    }

    #[test]
    fn empty_allocator_refuses_everything() {
        let mut mtt = RangeAllocator::new(0);
        assert_eq!(mtt.alloc(1), Err(ResourceError::Exhausted));
        assert!(mtt.free(EntryRange::new(0, 1)).is_err());
    }

    proptest! {
        /// Against a model of handed-out runs: runs never overlap, stay in
        /// bounds, frees of unknown runs are refused, and once everything is
        /// freed the whole capacity is one run again.
        #[test]
        fn range_allocator_agrees_with_a_model(ops in proptest::collection::vec(
            (any::<bool>(), 1..12u32, any::<usize>()), 1..200,
        )) {
            const CAPACITY: u32 = 40;
            let mut mtt = RangeAllocator::new(CAPACITY);
            let mut model: BTreeMap<u32, u32> = BTreeMap::new();
            for (is_alloc, len, pick) in ops {
                if is_alloc {
                    match mtt.alloc(len) {
                        Ok(range) => {
                            prop_assert_eq!(range.len(), len);
                            prop_assert!(range.end() <= u64::from(CAPACITY));
                            for (&start, &other) in &model {
                                let disjoint = range.end() <= u64::from(start)
                                    || u64::from(start + other) <= u64::from(range.start());
                                prop_assert!(disjoint, "overlap");
                            }
                            model.insert(range.start(), len);
                        }
                        Err(ResourceError::Fragmented) => {
                            prop_assert!(mtt.free_entries() >= len && mtt.largest_free_run() < len);
                        }
                        Err(error) => {
                            prop_assert_eq!(error, ResourceError::Exhausted);
                            prop_assert!(mtt.free_entries() < len);
                        }
                    }
                } else if model.is_empty() {
                    prop_assert!(mtt.free(EntryRange::new(pick as u32 % CAPACITY, len)).is_err());
                } else {
                    let (&start, &run_len) = model.iter().nth(pick % model.len()).unwrap();
                    // A wrong length is refused first, then the right one works once.
                    if len != run_len {
                        prop_assert!(mtt.free(EntryRange::new(start, len)).is_err());
                    }
                    prop_assert_eq!(mtt.free(EntryRange::new(start, run_len)), Ok(()));
                    prop_assert!(mtt.free(EntryRange::new(start, run_len)).is_err());
                    model.remove(&start);
                }
                let used: u32 = model.values().sum();
                prop_assert_eq!(mtt.free_entries(), CAPACITY - used);
                // Free runs are sorted, non-empty and never adjacent.
                for pair in mtt.free_runs.windows(2) {
                    prop_assert!(pair[0].end() < u64::from(pair[1].start()));
                }
                prop_assert!(mtt.free_runs.iter().all(|run| !run.is_empty()));
            }
            for (start, len) in core::mem::take(&mut model) {
                mtt.free(EntryRange::new(start, len)).unwrap();
            }
            prop_assert_eq!(runs(&mtt), [(0, CAPACITY)]);
        }
    }
}
