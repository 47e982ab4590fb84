//! An intrusive FIFO list of numbers `0..capacity` with O(1) push, pop and
//! removal of any member: the free list behind every allocator here.
//!
//! FIFO (push at the back, pop at the front) so that a released number is
//! handed out again as late as possible: the longer a number stays unused,
//! the less likely anything still refers to its previous owner.

use alloc::vec::Vec;

/// End of the list.
const NIL: u32 = u32::MAX;
/// `prev` of a number that is not in the list.
const UNLINKED: u32 = u32::MAX - 1;

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
}

/// A set of numbers below a fixed capacity, kept in insertion order.
///
/// # Invariants
/// `links[n].prev != UNLINKED` exactly for the `len` members, which form a
/// doubly linked chain from `head` to `tail`. Capacity is at most
/// `u32::MAX - 1` so that no number equals a sentinel.
#[derive(Debug, Clone)]
pub(crate) struct FreeList {
    links: Vec<Link>,
    head: u32,
    tail: u32,
    len: u32,
}

impl FreeList {
    /// The largest capacity: the two sentinels are not numbers.
    pub(crate) const MAX_CAPACITY: u32 = u32::MAX - 1;

    /// An empty list over `0..capacity` (capped at [`Self::MAX_CAPACITY`]).
    /// This is the only allocation.
    pub(crate) fn new(capacity: u32) -> Self {
        let capacity = capacity.min(Self::MAX_CAPACITY);
        let unlinked = Link {
            prev: UNLINKED,
            next: NIL,
        };
        Self {
            links: alloc::vec![unlinked; capacity as usize],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Members in the list.
    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    /// True when `number` is in the list (false when out of range).
    pub(crate) fn contains(&self, number: u32) -> bool {
        self.links
            .get(number as usize)
            .is_some_and(|link| link.prev != UNLINKED)
    }

    /// The oldest member, without removing it.
    pub(crate) fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// Appends `number`; false (and no change) when out of range or already
    /// a member.
    pub(crate) fn push_back(&mut self, number: u32) -> bool {
        if number as usize >= self.links.len() || self.contains(number) {
            return false;
        }
        let old_tail = self.tail;
        self.links[number as usize] = Link {
            prev: old_tail,
            next: NIL,
        };
        match self.links.get_mut(old_tail as usize) {
            Some(link) => link.next = number,
            None => self.head = number,
        }
        self.tail = number;
        self.len += 1;
        true
    }

    /// Removes and returns the oldest member.
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let number = self.front()?;
        self.remove(number);
        Some(number)
    }

    /// Removes `number` wherever it is; false (and no change) when it is
    /// not a member.
    pub(crate) fn remove(&mut self, number: u32) -> bool {
        if !self.contains(number) {
            return false;
        }
        let Link { prev, next } = self.links[number as usize];
        match self.links.get_mut(prev as usize) {
            Some(link) => link.next = next,
            None => self.head = next,
        }
        match self.links.get_mut(next as usize) {
            Some(link) => link.prev = prev,
            None => self.tail = prev,
        }
        self.links[number as usize] = Link {
            prev: UNLINKED,
            next: NIL,
        };
        self.len -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_order_and_removal_from_the_middle() {
        let mut list = FreeList::new(8);
        for n in [3, 1, 4, 5] {
            assert!(list.push_back(n));
        }
        assert!(!list.push_back(4), "already a member");
        assert!(!list.push_back(8), "out of range");
        assert!(list.remove(4));
        assert!(!list.remove(4));
        assert!(!list.remove(100));
        assert_eq!(list.len(), 3);
        assert_eq!(list.pop_front(), Some(3));
        assert!(list.push_back(3));
        assert_eq!(list.pop_front(), Some(1));
        assert_eq!(list.pop_front(), Some(5));
        assert_eq!(list.pop_front(), Some(3));
        assert_eq!(list.pop_front(), None);
        assert_eq!(list.len(), 0);
    }

    #[test]
    fn removing_head_and_tail_keeps_the_chain() {
        let mut list = FreeList::new(4);
        for n in 0..4 {
            list.push_back(n);
        }
        assert!(list.remove(0));
        assert!(list.remove(3));
        assert_eq!(list.front(), Some(1));
        assert!(list.push_back(0));
        assert_eq!(list.pop_front(), Some(1));
        assert_eq!(list.pop_front(), Some(2));
        assert_eq!(list.pop_front(), Some(0));
        assert_eq!(list.pop_front(), None);
    }
}
