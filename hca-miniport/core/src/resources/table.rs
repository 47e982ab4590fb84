//! [`ObjectTable`]: objects by device number, with generation-checked
//! handles, a FIFO number free list and per-object use counts.

use alloc::vec::Vec;
use core::fmt;
use core::marker::PhantomData;
use core::ops::Range;

use super::free_list::FreeList;
use super::{Handle, MAX_OBJECTS, ObjectKind, ResourceError};

/// One number's slot.
struct Slot<T> {
    /// The generation of the current (or next) occupant; never 0.
    generation: u32,
    /// Outstanding [`ObjectTable::acquire`]s of the occupant.
    uses: u32,
    occupant: Option<T>,
}

/// Objects of kind `K` indexed by their device number `0..capacity`.
///
/// Numbers are handed out by [`insert_with`](Self::insert_with) from a FIFO
/// free list (the least recently freed number first, so numbers recycle as
/// late as possible). Numbers in the reserved range are never handed out
/// that way but can be occupied explicitly with
/// [`insert_at_with`](Self::insert_at_with); a table whose whole range is
/// reserved is numbered entirely by its owner (as [`super::QpTable`] does).
///
/// # Invariants
/// - A number is in the free list exactly when it is unoccupied and not
///   reserved.
/// - A slot's generation is never 0 and changes on every removal.
/// - `uses` is 0 in every unoccupied slot.
pub struct ObjectTable<K, T> {
    slots: Vec<Slot<T>>,
    free: FreeList,
    reserved: Range<u32>,
    live: u32,
    kind: PhantomData<fn() -> K>,
}

impl<K: ObjectKind, T> ObjectTable<K, T> {
    /// A table for numbers `0..capacity` (e.g. `1 << log_max_cqs`), of
    /// which `reserved` are never handed out by
    /// [`insert_with`](Self::insert_with). The only allocation the table
    /// makes.
    ///
    /// Fails with [`ResourceError::InvalidCapacity`] when `capacity` exceeds
    /// [`MAX_OBJECTS`] or `reserved` is not inside `0..capacity`.
    pub fn new(capacity: u32, reserved: Range<u32>) -> Result<Self, ResourceError> {
        Self::from_generation(capacity, reserved, 1)
    }

    /// Like [`new`](Self::new), with every slot's first occupant at
    /// `generation` (0 is taken as 1): a table of a new life of the device
    /// starts where no handle of an earlier life points
    /// ([`super::life_generation`]). Lookups are unchanged.
    pub fn from_generation(
        capacity: u32,
        reserved: Range<u32>,
        generation: u32,
    ) -> Result<Self, ResourceError> {
        if capacity > MAX_OBJECTS || reserved.start > reserved.end || reserved.end > capacity {
            return Err(ResourceError::InvalidCapacity);
        }
        let generation = generation.max(1);
        let mut slots = Vec::with_capacity(capacity as usize);
        slots.resize_with(capacity as usize, || Slot {
            generation,
            uses: 0,
            occupant: None,
        });
        let mut free = FreeList::new(capacity);
        for number in (0..capacity).filter(|number| !reserved.contains(number)) {
            free.push_back(number);
        }
        Ok(Self {
            slots,
            free,
            reserved,
            live: 0,
            kind: PhantomData,
        })
    }

    /// How many numbers the table covers.
    pub fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Live objects.
    pub fn len(&self) -> u32 {
        self.live
    }

    /// True when no object is live.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Numbers [`insert_with`](Self::insert_with) can still hand out.
    pub fn free_count(&self) -> u32 {
        self.free.len()
    }

    /// True when `number` is in the reserved range.
    pub fn is_reserved(&self, number: u32) -> bool {
        self.reserved.contains(&number)
    }

    /// Takes the least recently freed unreserved number and stores the
    /// object `make(handle)` there. `make` runs only once the number is
    /// secured, so a refusal loses nothing.
    ///
    /// Fails with [`ResourceError::Exhausted`] when no number is free.
    pub fn insert_with(
        &mut self,
        make: impl FnOnce(Handle<K>) -> T,
    ) -> Result<Handle<K>, ResourceError> {
        let number = self.free.pop_front().ok_or(ResourceError::Exhausted)?;
        Ok(self.occupy(number, make))
    }

    /// Stores `make(handle)` at the given number, which may be reserved
    /// (special QPs) or free.
    ///
    /// Fails with [`ResourceError::InvalidNumber`] outside the table and
    /// [`ResourceError::NumberInUse`] when the number is occupied.
    pub fn insert_at_with(
        &mut self,
        number: u32,
        make: impl FnOnce(Handle<K>) -> T,
    ) -> Result<Handle<K>, ResourceError> {
        let slot = self
            .slots
            .get(number as usize)
            .ok_or(ResourceError::InvalidNumber { number })?;
        if slot.occupant.is_some() {
            return Err(ResourceError::NumberInUse { number });
        }
        // A reserved number is not in the free list; `remove` is then a no-op.
        self.free.remove(number);
        Ok(self.occupy(number, make))
    }

    fn occupy(&mut self, number: u32, make: impl FnOnce(Handle<K>) -> T) -> Handle<K> {
        let slot = &mut self.slots[number as usize];
        let handle = Handle::new(number, slot.generation);
        slot.occupant = Some(make(handle));
        self.live += 1;
        handle
    }

    /// Removes the object and returns it. Its number goes to the back of the
    /// free list (unless reserved) and every handle to it becomes stale.
    ///
    /// Fails with [`ResourceError::InvalidHandle`] for a stale handle and
    /// [`ResourceError::Busy`] while the object has uses outstanding.
    pub fn remove(&mut self, handle: Handle<K>) -> Result<T, ResourceError> {
        let number = handle.number();
        let slot = self.live_slot_mut(handle)?;
        if slot.uses != 0 {
            return Err(ResourceError::Busy { uses: slot.uses });
        }
        let Some(object) = slot.occupant.take() else {
            // `live_slot_mut` only returns occupied slots.
            return Err(ResourceError::InvalidHandle { kind: K::KIND });
        };
        slot.generation = match slot.generation.wrapping_add(1) {
            0 => 1,
            next => next,
        };
        self.live -= 1;
        if !self.reserved.contains(&number) {
            self.free.push_back(number);
        }
        Ok(object)
    }

    /// The object, if the handle is still current.
    pub fn get(&self, handle: Handle<K>) -> Option<&T> {
        self.live_slot(handle).ok()?.occupant.as_ref()
    }

    /// The object, mutably, if the handle is still current.
    pub fn get_mut(&mut self, handle: Handle<K>) -> Option<&mut T> {
        self.live_slot_mut(handle).ok()?.occupant.as_mut()
    }

    /// True while the handle's object lives.
    pub fn contains(&self, handle: Handle<K>) -> bool {
        self.live_slot(handle).is_ok()
    }

    /// The current occupant of a bare device number (from an EQE or CQE)
    /// and its handle; `None` for a free or out-of-range number.
    pub fn get_by_number(&self, number: u32) -> Option<(Handle<K>, &T)> {
        let slot = self.slots.get(number as usize)?;
        let object = slot.occupant.as_ref()?;
        Some((Handle::new(number, slot.generation), object))
    }

    /// Like [`get_by_number`](Self::get_by_number), mutably.
    pub fn get_by_number_mut(&mut self, number: u32) -> Option<(Handle<K>, &mut T)> {
        let slot = self.slots.get_mut(number as usize)?;
        let object = slot.occupant.as_mut()?;
        Some((Handle::new(number, slot.generation), object))
    }

    /// Records one more use of the object (a QP on a CQ, an MR in a PD),
    /// returning the new count. [`remove`](Self::remove) refuses while any
    /// use is outstanding.
    ///
    /// Fails with [`ResourceError::InvalidHandle`] for a stale handle and
    /// [`ResourceError::Exhausted`] if the count would overflow.
    pub fn acquire(&mut self, handle: Handle<K>) -> Result<u32, ResourceError> {
        let slot = self.live_slot_mut(handle)?;
        slot.uses = slot.uses.checked_add(1).ok_or(ResourceError::Exhausted)?;
        Ok(slot.uses)
    }

    /// Ends one use recorded by [`acquire`](Self::acquire), returning the
    /// new count.
    ///
    /// Fails with [`ResourceError::InvalidHandle`] for a stale handle and
    /// [`ResourceError::NotAcquired`] when no use is outstanding.
    pub fn release(&mut self, handle: Handle<K>) -> Result<u32, ResourceError> {
        let slot = self.live_slot_mut(handle)?;
        slot.uses = slot.uses.checked_sub(1).ok_or(ResourceError::NotAcquired)?;
        Ok(slot.uses)
    }

    /// Outstanding uses of the object, if the handle is current.
    pub fn use_count(&self, handle: Handle<K>) -> Option<u32> {
        Some(self.live_slot(handle).ok()?.uses)
    }

    /// Every live object with its handle, in number order (for teardown and
    /// for restoring the device after a power transition).
    pub fn iter(&self) -> impl Iterator<Item = (Handle<K>, &T)> + '_ {
        self.slots.iter().enumerate().filter_map(|(number, slot)| {
            let object = slot.occupant.as_ref()?;
            Some((Handle::new(number as u32, slot.generation), object))
        })
    }

    fn live_slot(&self, handle: Handle<K>) -> Result<&Slot<T>, ResourceError> {
        self.slots
            .get(handle.number() as usize)
            .filter(|slot| {
                handle.is_of_its_kind()
                    && slot.occupant.is_some()
                    && slot.generation == handle.generation()
            })
            .ok_or(ResourceError::InvalidHandle { kind: K::KIND })
    }

    fn live_slot_mut(&mut self, handle: Handle<K>) -> Result<&mut Slot<T>, ResourceError> {
        self.slots
            .get_mut(handle.number() as usize)
            .filter(|slot| {
                handle.is_of_its_kind()
                    && slot.occupant.is_some()
                    && slot.generation == handle.generation()
            })
            .ok_or(ResourceError::InvalidHandle { kind: K::KIND })
    }
}

impl<K: ObjectKind, T> fmt::Debug for ObjectTable<K, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectTable")
            .field("kind", &K::KIND)
            .field("capacity", &self.capacity())
            .field("live", &self.live)
            .field("free", &self.free.len())
            .field("reserved", &self.reserved)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use alloc::collections::BTreeMap;
    use alloc::vec::Vec;

    use proptest::prelude::*;

    use super::super::{Kind, kind};
    use super::*;

    type CqTable = ObjectTable<kind::Cq, &'static str>;

    #[test]
    fn stale_handle_after_recycle_finds_nothing() {
        let mut table = CqTable::new(1, 0..0).unwrap();
        let old = table.insert_with(|_| "old owner").unwrap();
        assert_eq!(table.remove(old), Ok("old owner"));
        let new = table.insert_with(|_| "new owner").unwrap();
        assert_eq!(new.number(), old.number(), "the only number is recycled");
        assert_ne!(new, old);
        assert_eq!(table.get(old), None);
        assert!(!table.contains(old));
        assert_eq!(
            table.remove(old),
            Err(ResourceError::InvalidHandle { kind: Kind::Cq })
        );
        assert_eq!(table.get(new), Some(&"new owner"));
        // An event carrying the bare number reaches the current owner only.
        assert_eq!(table.get_by_number(old.number()), Some((new, &"new owner")));
    }

    #[test]
    fn a_table_from_a_generation_issues_no_handle_of_a_table_before_it() {
        let mut first = ObjectTable::<kind::Cq, u8>::new(2, 0..0).unwrap();
        let old = first.insert_with(|_| 1).unwrap();
        let mut next = ObjectTable::<kind::Cq, u8>::from_generation(2, 0..0, 1000).unwrap();
        let new = next.insert_with(|_| 2).unwrap();
        assert_eq!((old.number(), new.number()), (0, 0));
        assert_eq!(new.generation(), 1000);
        assert_ne!(old, new);
        assert_eq!(
            next.get(old),
            None,
            "the earlier table's handle names nothing"
        );
        let zero = ObjectTable::<kind::Cq, u8>::from_generation(1, 0..0, 0).unwrap();
        assert_eq!(zero.slots[0].generation, 1, "generation 0 is never issued");
    }

    #[test]
    fn generation_wraps_past_zero() {
        let mut table = CqTable::new(1, 0..0).unwrap();
        table.slots[0].generation = u32::MAX;
        let last = table.insert_with(|_| "last").unwrap();
        assert_eq!(last.generation(), u32::MAX);
        table.remove(last).unwrap();
        let wrapped = table.insert_with(|_| "wrapped").unwrap();
        assert_eq!(wrapped.generation(), 1, "0 is skipped");
        assert_ne!(wrapped.raw(), 0);
        assert_eq!(table.get(last), None);
    }

    #[test]
    fn handles_are_never_zero() {
        let mut table = CqTable::new(4, 0..0).unwrap();
        let first = table.insert_with(|_| "a").unwrap();
        assert_eq!(first.number(), 0);
        assert_ne!(first.raw(), 0);
        assert_eq!(first.generation(), 1);
    }

    #[test]
    fn numbers_recycle_fifo() {
        let mut table = CqTable::new(3, 0..0).unwrap();
        let handles: Vec<_> = (0..3)
            .map(|_| table.insert_with(|_| "x").unwrap())
            .collect();
        assert_eq!(table.insert_with(|_| "y"), Err(ResourceError::Exhausted));
        table.remove(handles[2]).unwrap();
        table.remove(handles[0]).unwrap();
        assert_eq!(table.insert_with(|_| "z").unwrap().number(), 2);
        assert_eq!(table.insert_with(|_| "z").unwrap().number(), 0);
    }

    #[test]
    fn reserved_numbers_are_never_handed_out_but_can_be_occupied() {
        let mut table = CqTable::new(4, 0..2).unwrap();
        assert_eq!(table.free_count(), 2);
        let a = table.insert_with(|_| "a").unwrap();
        let b = table.insert_with(|_| "b").unwrap();
        assert_eq!((a.number(), b.number()), (2, 3));
        assert_eq!(table.insert_with(|_| "c"), Err(ResourceError::Exhausted));
        let special = table.insert_at_with(1, |_| "special").unwrap();
        assert_eq!(
            table.insert_at_with(1, |_| "again"),
            Err(ResourceError::NumberInUse { number: 1 })
        );
        assert_eq!(table.remove(special), Ok("special"));
        // Freed reserved numbers stay reserved.
        assert_eq!(table.free_count(), 0);
        table.remove(a).unwrap();
        assert_eq!(table.insert_with(|_| "d").unwrap().number(), 2);
    }

    #[test]
    fn insert_at_a_free_number_takes_it_out_of_the_free_list() {
        let mut table = CqTable::new(3, 0..0).unwrap();
        let at = table.insert_at_with(1, |_| "at").unwrap();
        assert_eq!(at.number(), 1);
        assert_eq!(table.insert_with(|_| "a").unwrap().number(), 0);
        assert_eq!(table.insert_with(|_| "b").unwrap().number(), 2);
        assert_eq!(table.insert_with(|_| "c"), Err(ResourceError::Exhausted));
        assert_eq!(
            table.insert_at_with(3, |_| "out"),
            Err(ResourceError::InvalidNumber { number: 3 })
        );
    }

    #[test]
    fn make_sees_its_own_handle_and_runs_only_on_success() {
        let mut table = ObjectTable::<kind::Qp, Handle<kind::Qp>>::new(1, 0..0).unwrap();
        let handle = table.insert_with(|handle| handle).unwrap();
        assert_eq!(table.get(handle), Some(&handle));
        let mut ran = false;
        let refused = table.insert_with(|handle| {
            ran = true;
            handle
        });
        assert_eq!(refused, Err(ResourceError::Exhausted));
        assert!(!ran);
    }

    #[test]
    fn remove_refuses_while_in_use() {
        let mut table = ObjectTable::<kind::Pd, u32>::new(2, 0..0).unwrap();
        let pd = table.insert_with(|_| 7).unwrap();
        assert_eq!(table.acquire(pd), Ok(1));
        assert_eq!(table.acquire(pd), Ok(2));
        assert_eq!(table.remove(pd), Err(ResourceError::Busy { uses: 2 }));
        assert_eq!(table.get(pd), Some(&7), "refusal changes nothing");
        assert_eq!(table.release(pd), Ok(1));
        assert_eq!(table.remove(pd), Err(ResourceError::Busy { uses: 1 }));
        assert_eq!(table.release(pd), Ok(0));
        assert_eq!(table.release(pd), Err(ResourceError::NotAcquired));
        assert_eq!(table.use_count(pd), Some(0));
        assert_eq!(table.remove(pd), Ok(7));
        assert_eq!(
            table.acquire(pd),
            Err(ResourceError::InvalidHandle { kind: Kind::Pd })
        );
        assert_eq!(table.use_count(pd), None);
    }

    #[test]
    fn bad_input_is_refused_without_panics() {
        let mut table = CqTable::new(2, 0..0).unwrap();
        let forged = Handle::<kind::Cq>::from_raw(u64::MAX);
        assert_eq!(table.get(forged), None);
        assert!(table.remove(forged).is_err());
        assert!(table.release(forged).is_err());
        assert_eq!(table.get_by_number(u32::MAX), None);
        assert_eq!(table.get_by_number(1), None);
        let zero = Handle::<kind::Cq>::from_raw(0);
        table.insert_with(|_| "a").unwrap();
        assert_eq!(table.get(zero), None, "generation 0 is never issued");
        assert!(CqTable::new(MAX_OBJECTS + 1, 0..0).is_err());
        assert!(CqTable::new(4, 2..5).is_err());
        #[expect(clippy::reversed_empty_ranges, reason = "testing the refusal")]
        let backwards = 3..1;
        assert!(CqTable::new(4, backwards).is_err());
    }

    #[test]
    fn iter_lists_live_objects_in_number_order() {
        let mut table = CqTable::new(4, 0..0).unwrap();
        let a = table.insert_with(|_| "a").unwrap();
        let b = table.insert_with(|_| "b").unwrap();
        let c = table.insert_with(|_| "c").unwrap();
        table.remove(b).unwrap();
        let listed: Vec<_> = table.iter().collect();
        assert_eq!(listed, [(a, &"a"), (c, &"c")]);
        assert_eq!(table.len(), 2);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32),
        InsertAt(u32, u32),
        Remove(usize),
        RemoveStale(usize),
        Acquire(usize),
        Release(usize),
        LookupNumber(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<u32>().prop_map(Op::Insert),
            (0..10u32, any::<u32>()).prop_map(|(n, v)| Op::InsertAt(n, v)),
            any::<usize>().prop_map(Op::Remove),
            any::<usize>().prop_map(Op::RemoveStale),
            any::<usize>().prop_map(Op::Acquire),
            any::<usize>().prop_map(Op::Release),
            (0..10u32).prop_map(Op::LookupNumber),
        ]
    }

    proptest! {
        /// The table agrees with a map from number to (handle, value, uses);
        /// a handle is valid exactly while its object lives.
        #[test]
        fn table_agrees_with_a_model(ops in proptest::collection::vec(op(), 1..200)) {
            const CAPACITY: u32 = 8;
            const RESERVED: Range<u32> = 0..2;
            let mut table = ObjectTable::<kind::Cq, u32>::new(CAPACITY, RESERVED).unwrap();
            let mut model: BTreeMap<u32, (Handle<kind::Cq>, u32, u32)> = BTreeMap::new();
            let mut dead: Vec<Handle<kind::Cq>> = Vec::new();
            let pick = |model: &BTreeMap<u32, (Handle<kind::Cq>, u32, u32)>, i: usize| {
                model.values().nth(i % model.len().max(1)).map(|entry| entry.0)
            };
            for op in ops {
                match op {
                    Op::Insert(value) => match table.insert_with(|_| value) {
                        Ok(handle) => {
                            prop_assert!(!RESERVED.contains(&handle.number()));
                            prop_assert!(model.insert(handle.number(), (handle, value, 0)).is_none(),
                                "two live objects share a number");
                        }
                        Err(error) => {
                            prop_assert_eq!(error, ResourceError::Exhausted);
                            let unreserved_live = model.keys().filter(|n| !RESERVED.contains(n)).count();
                            prop_assert_eq!(unreserved_live as u32, CAPACITY - RESERVED.end);
                        }
                    },
                    Op::InsertAt(number, value) => match table.insert_at_with(number, |_| value) {
                        Ok(handle) => {
                            prop_assert_eq!(handle.number(), number);
                            prop_assert!(model.insert(number, (handle, value, 0)).is_none());
                        }
                        Err(ResourceError::InvalidNumber { .. }) => prop_assert!(number >= CAPACITY),
                        Err(ResourceError::NumberInUse { .. }) => prop_assert!(model.contains_key(&number)),
                        Err(other) => prop_assert!(false, "unexpected {other:?}"),
                    },
                    Op::Remove(i) => if let Some(handle) = pick(&model, i) {
                        let (_, value, uses) = model[&handle.number()];
                        if uses == 0 {
                            prop_assert_eq!(table.remove(handle), Ok(value));
                            model.remove(&handle.number());
                            dead.push(handle);
                        } else {
                            prop_assert_eq!(table.remove(handle), Err(ResourceError::Busy { uses }));
                        }
                    },
                    Op::RemoveStale(i) => if !dead.is_empty() {
                        let handle = dead[i % dead.len()];
                        prop_assert!(table.remove(handle).is_err());
                    },
                    Op::Acquire(i) => if let Some(handle) = pick(&model, i) {
                        let entry = model.get_mut(&handle.number()).unwrap();
                        entry.2 += 1;
                        prop_assert_eq!(table.acquire(handle), Ok(entry.2));
                    },
                    Op::Release(i) => if let Some(handle) = pick(&model, i) {
                        let entry = model.get_mut(&handle.number()).unwrap();
                        if entry.2 == 0 {
                            prop_assert_eq!(table.release(handle), Err(ResourceError::NotAcquired));
                        } else {
                            entry.2 -= 1;
                            prop_assert_eq!(table.release(handle), Ok(entry.2));
                        }
                    },
                    Op::LookupNumber(number) => {
                        let expected = model.get(&number).map(|(handle, value, _)| (*handle, value));
                        prop_assert_eq!(table.get_by_number(number), expected);
                    }
                }
                // After every step: live handles resolve, dead ones never do.
                prop_assert_eq!(table.len() as usize, model.len());
                for (handle, value, uses) in model.values() {
                    prop_assert_eq!(table.get(*handle), Some(value));
                    prop_assert_eq!(table.use_count(*handle), Some(*uses));
                }
                for handle in &dead {
                    prop_assert!(!table.contains(*handle));
                }
            }
        }
    }
}
