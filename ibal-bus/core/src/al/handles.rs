//! A client's handle table: slots with generations, so a handle of a
//! destroyed object (or of a slot reused since) is refused, and a tag per
//! client, so a handle another client was given is refused here even when
//! its slot and generation happen to match one of ours.
//!
//! A handle is `tag << 48 | generation << 32 | (slot + 1)`: never zero
//! (slot + 1 ≥ 1), opaque to the client.

use alloc::vec::Vec;

/// One slot: its generation and what it holds, if anything.
#[derive(Debug)]
struct Slot<T> {
    generation: u16,
    value: Option<T>,
}

/// A generation-checked handle table owned by one client (`tag`).
#[derive(Debug)]
pub(crate) struct HandleTable<T> {
    tag: u16,
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    live: usize,
}

impl<T> HandleTable<T> {
    /// An empty table whose handles carry `tag`.
    pub(crate) fn new(tag: u16) -> Self {
        Self {
            tag,
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
        }
    }

    /// The tag a handle carries: the client it was given to.
    pub(crate) fn tag_of(handle: u64) -> u16 {
        (handle >> 48) as u16
    }

    fn handle(&self, slot: u32, generation: u16) -> u64 {
        (u64::from(self.tag) << 48) | (u64::from(generation) << 32) | (u64::from(slot) + 1)
    }

    /// The slot a handle names, if it is this table's and live.
    fn slot_of(&self, handle: u64) -> Option<usize> {
        let tag = Self::tag_of(handle);
        let generation = (handle >> 32) as u16;
        let slot = (handle as u32).checked_sub(1)? as usize;
        let entry = self.slots.get(slot)?;
        (tag == self.tag && entry.generation == generation && entry.value.is_some()).then_some(slot)
    }

    /// Stores `value`; returns its handle, or `None` when the table is
    /// full (2^32 - 1 slots).
    pub(crate) fn insert(&mut self, value: T) -> Option<u64> {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let slot = u32::try_from(self.slots.len())
                    .ok()
                    .filter(|s| *s < u32::MAX)?;
                self.slots.push(Slot {
                    generation: 1,
                    value: None,
                });
                slot
            }
        };
        let entry = &mut self.slots[slot as usize];
        entry.value = Some(value);
        let generation = entry.generation;
        self.live += 1;
        Some(self.handle(slot, generation))
    }

    /// The value `handle` names.
    pub(crate) fn get(&self, handle: u64) -> Option<&T> {
        let slot = self.slot_of(handle)?;
        self.slots[slot].value.as_ref()
    }

    /// The value `handle` names, mutably.
    pub(crate) fn get_mut(&mut self, handle: u64) -> Option<&mut T> {
        let slot = self.slot_of(handle)?;
        self.slots[slot].value.as_mut()
    }

    /// Removes what `handle` names; the slot's generation moves on, so the
    /// handle is refused from now on.
    pub(crate) fn remove(&mut self, handle: u64) -> Option<T> {
        let slot = self.slot_of(handle)?;
        let entry = &mut self.slots[slot];
        entry.generation = entry.generation.wrapping_add(1).max(1);
        self.live -= 1;
        self.free.push(slot as u32);
        entry.value.take()
    }

    /// The handles of the live entries `keep` selects, in slot order.
    pub(crate) fn handles_where(&self, mut keep: impl FnMut(&T) -> bool) -> Vec<u64> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(slot, entry)| {
                let value = entry.value.as_ref()?;
                keep(value).then(|| self.handle(slot as u32, entry.generation))
            })
            .collect()
    }

    /// Live entries.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reused_slot_refuses_the_old_handle_and_another_tag() {
        let mut table = HandleTable::new(7);
        let first = table.insert("pd").unwrap();
        assert_eq!(table.remove(first), Some("pd"));
        let second = table.insert("cq").unwrap();
        // Same slot, next generation: the old handle names nothing.
        assert_eq!(first as u32, second as u32);
        assert_ne!(first, second);
        assert_eq!(table.get(first), None);
        assert_eq!(table.remove(first), None);
        assert_eq!(table.get(second), Some(&"cq"));
        // The same slot and generation under another client's tag.
        let other = HandleTable::<&str>::new(8);
        let forged = (second & !(0xFFFF << 48)) | (u64::from(other.tag) << 48);
        assert_eq!(table.get(forged), None);
        // Zero and out-of-range slots name nothing.
        assert_eq!(table.get(0), None);
        assert_eq!(table.get(second + 5), None);
        assert_eq!(table.len(), 1);
    }
}
