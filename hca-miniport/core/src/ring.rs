//! Reading the entries the device writes into rings (CQEs, EQEs, command
//! entries) by the owner rule (PRM 4.2, 8.1, 10.4).
//!
//! Contract: the device writes an entry with its owner (or `done`) byte
//! last, and ring memory is shared memory, not a lock: a copy of a whole
//! entry racing the device's write can return the new owner byte with an
//! old body. So software reads the owner byte alone, and only if it is
//! valid, orders the rest after it with [`dma_rmb`] and reads the entry.
//! Every device-written entry the core consumes goes through
//! [`read_owned_entry`].

use driver_platform::CommonBuffer;
use driver_platform::dma::dma_rmb;

/// Reads the entry of `entry.len()` bytes at `offset` of `ring` whose owner
/// byte lies at `owner_at` within the entry: the owner byte first; if
/// `valid(owner byte)`, a [`dma_rmb`] and then the whole entry into `entry`
/// (its owner byte included). False, with `entry` unspecified, if the owner
/// byte is not valid or the range leaves the ring.
#[inline(always)]
pub(crate) fn read_owned_entry<B: CommonBuffer>(
    ring: &B,
    offset: usize,
    owner_at: usize,
    entry: &mut [u8],
    valid: impl FnOnce(u8) -> bool,
) -> bool {
    if owner_at >= entry.len() {
        return false;
    }
    let mut owner = [0u8];
    if !ring.read(offset + owner_at, &mut owner) || !valid(owner[0]) {
        return false;
    }
    dma_rmb();
    ring.read(offset, entry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::sync::atomic::{AtomicBool, AtomicU8, Ordering};

    const ENTRY: usize = 32;
    const OWNER_AT: usize = 31;

    /// A ring of one entry that the device writes while the CPU reads it:
    /// the device's write (every byte `0xBB`, owner byte last, so `0xBB`
    /// there means valid) lands in the middle of the first CPU read that
    /// starts at the entry's first byte, after its first half was copied —
    /// the interleaving a real, lock-free ring allows (a CPU copy and a
    /// device write both go in ascending address order).
    struct RacingRing {
        bytes: [AtomicU8; ENTRY],
        written: AtomicBool,
    }

    impl RacingRing {
        fn new() -> Self {
            Self {
                bytes: [const { AtomicU8::new(0) }; ENTRY],
                written: AtomicBool::new(false),
            }
        }

        fn device_writes(&self) {
            if !self.written.swap(true, Ordering::Relaxed) {
                for byte in &self.bytes {
                    byte.store(0xBB, Ordering::Relaxed);
                }
            }
        }

        fn copy(&self, offset: usize, out: &mut [u8]) {
            for (i, b) in out.iter_mut().enumerate() {
                *b = self.bytes[offset + i].load(Ordering::Relaxed);
            }
        }
    }

    impl CommonBuffer for RacingRing {
        fn bus_address(&self) -> u64 {
            0x1000
        }

        fn len(&self) -> usize {
            ENTRY
        }

        fn read(&self, offset: usize, out: &mut [u8]) -> bool {
            if offset.checked_add(out.len()).is_none_or(|end| end > ENTRY) {
                return false;
            }
            if offset == 0 && out.len() == ENTRY && !self.written.load(Ordering::Relaxed) {
                // The first half before the device's write, the rest after.
                let half = ENTRY / 2;
                self.copy(0, &mut out[..half]);
                self.device_writes();
                self.copy(half, &mut out[half..]);
                return true;
            }
            self.device_writes();
            self.copy(offset, out);
            true
        }

        fn write(&self, _offset: usize, _data: &[u8]) -> bool {
            false
        }
    }

    fn valid(owner: u8) -> bool {
        owner == 0xBB
    }

    /// The naive read — copy the entry, then look at its owner byte — takes
    /// a torn entry for a valid one in this interleaving; the owner rule
    /// never does.
    #[test]
    fn an_entry_is_read_whole_only_after_its_owner_byte() {
        let naive = RacingRing::new();
        let mut entry = [0u8; ENTRY];
        assert!(naive.read(0, &mut entry));
        assert!(valid(entry[OWNER_AT]), "the naive read sees a valid owner");
        assert_eq!(entry[0], 0, "...over a stale body: a torn entry");

        let ring = RacingRing::new();
        let mut entry = [0u8; ENTRY];
        assert!(read_owned_entry(&ring, 0, OWNER_AT, &mut entry, valid));
        assert_eq!(entry, [0xBB; ENTRY], "the whole entry, never torn");
    }

    #[test]
    fn an_invalid_owner_or_a_bad_range_reads_nothing_more() {
        struct Zeroes;
        impl CommonBuffer for Zeroes {
            fn bus_address(&self) -> u64 {
                0
            }
            fn len(&self) -> usize {
                ENTRY
            }
            fn read(&self, offset: usize, out: &mut [u8]) -> bool {
                let ok = offset.checked_add(out.len()).is_some_and(|e| e <= ENTRY);
                if ok {
                    out.fill(0);
                }
                ok
            }
            fn write(&self, _offset: usize, _data: &[u8]) -> bool {
                false
            }
        }
        let mut entry = [7u8; ENTRY];
        assert!(!read_owned_entry(&Zeroes, 0, OWNER_AT, &mut entry, valid));
        assert_eq!(entry, [7; ENTRY], "an invalid owner: the entry is not read");
        assert!(!read_owned_entry(&Zeroes, 1, OWNER_AT, &mut entry, |_| {
            true
        }));
        assert!(!read_owned_entry(&Zeroes, 0, ENTRY, &mut entry, |_| true));
    }
}
