//! The owner (phase) bit rule of PRM 4.2, 8.1 and 10.4.
//!
//! Contract: software zero-fills a ring of `2^log_entries` entries once.
//! The device writes the entry for free-running counter value `n` (the
//! command producer counter, the EQ or CQ producer counter) with the owner
//! bit [`phase_for(n, log_entries)`](phase_for): 1 on the first pass through
//! the ring, 0 on the second, and so on. An entry is valid for a consumer at
//! counter `n` exactly when its owner bit equals that phase, so a stale entry
//! from the previous pass is never mistaken for a new one. The sequence is
//! continuous across the wrap of the 32-bit counter, because `2^32` is a
//! multiple of every ring's double size.
//!
//! Only bit 0 ([`OWNER_BIT`]) of the owner byte carries the phase; the
//! others are reserved and ignored on read.

/// The bit of the owner byte (CQE, EQE) or `done` byte (command entry) that
/// holds the phase.
pub const OWNER_BIT: u8 = 0x01;

/// The owner bit the device writes into the entry for counter value
/// `counter` of a ring of `2^log_entries` entries:
/// `1 ^ ((counter >> log_entries) & 1)`.
///
/// A `log_entries` of 32 or more (a ring larger than the counter space) is
/// always on its first pass: the phase is 1.
pub const fn phase_for(counter: u32, log_entries: u8) -> u8 {
    let pass = match counter.checked_shr(log_entries as u32) {
        Some(pass) => pass,
        None => 0,
    };
    1 ^ (pass & 1) as u8
}

/// Whether an entry whose owner byte is `owner_byte` holds the completion
/// for counter value `counter` (rather than being stale or never written).
pub const fn is_valid(owner_byte: u8, counter: u32, log_entries: u8) -> bool {
    owner_byte & OWNER_BIT == phase_for(counter, log_entries)
}

/// The ring slot of counter value `counter`: `counter mod 2^log_entries`.
pub const fn slot(counter: u32, log_entries: u8) -> u32 {
    match 1u32.checked_shl(log_entries as u32) {
        Some(entries) => counter & (entries - 1),
        None => counter,
    }
}

/// The bit of a counter that flips once per pass through a ring of
/// `2^log_entries` entries: `1 << log_entries`, or 0 for a ring of `2^32`
/// entries or more (always on its first pass). Computed once per ring, it
/// makes the owner rule one test per entry ([`is_valid_in_pass`]).
pub const fn pass_bit(log_entries: u8) -> u32 {
    match 1u32.checked_shl(log_entries as u32) {
        Some(bit) => bit,
        None => 0,
    }
}

/// As [`is_valid`], for a ring whose [`pass_bit`] is `pass_bit`: the
/// owner bit is 1 exactly on the passes where the counter's pass bit is 0.
#[inline]
pub const fn is_valid_in_pass(owner_byte: u8, counter: u32, pass_bit: u32) -> bool {
    (owner_byte & OWNER_BIT != 0) == (counter & pass_bit == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn phases_over_several_wraps() {
        // A 4-entry ring: four entries per pass, the phase alternating 1, 0.
        let log = 2;
        let phases: Vec<u8> = (0..20).map(|n| phase_for(n, log)).collect();
        assert_eq!(
            phases,
            [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
        );
        let slots: Vec<u32> = (0..9).map(|n| slot(n, log)).collect();
        assert_eq!(slots, [0, 1, 2, 3, 0, 1, 2, 3, 0]);
    }

    #[test]
    fn zero_filled_ring_is_empty_then_stale() {
        // Simulate a 2-entry ring: the consumer must see exactly the entries
        // written for its counter, never a zeroed or previous-pass one.
        let log = 1;
        let mut ring = [0u8; 2];
        for consumer in 0..16u32 {
            let s = slot(consumer, log) as usize;
            assert!(!is_valid(ring[s], consumer, log), "stale at {consumer}");
            ring[s] = phase_for(consumer, log);
            assert!(is_valid(ring[s], consumer, log), "fresh at {consumer}");
        }
    }

    #[test]
    fn continuous_across_the_counter_wrap() {
        for log in [0u8, 1, 5, 12, 31] {
            let last = u32::MAX;
            // The last counter before the wrap is on an odd pass (phase 0),
            // and counter 0 after it starts an even pass (phase 1).
            assert_eq!(phase_for(last, log), 0, "log {log}");
            assert_eq!(phase_for(0, log), 1, "log {log}");
        }
    }

    #[test]
    fn reserved_owner_bits_are_ignored_and_huge_logs_are_safe() {
        assert!(is_valid(0xFF, 0, 4));
        assert!(is_valid(0xFE, 16, 4));
        assert!(!is_valid(0xFE, 0, 4));
        assert_eq!(phase_for(u32::MAX, 32), 1);
        assert_eq!(phase_for(u32::MAX, 255), 1);
        assert_eq!(slot(u32::MAX, 32), u32::MAX);
    }

    proptest! {
        #[test]
        fn the_pass_bit_answers_as_the_rule(
            counter: u32,
            log in prop_oneof![0u8..32, 32u8..=255],
            owner_byte: u8,
        ) {
            let bit = pass_bit(log);
            // Near the counter's wrap and at a pass's first and last
            // entries too.
            let edge = bit.wrapping_sub(1);
            for counter in [counter, u32::MAX, 0, edge, bit, counter & !edge] {
                prop_assert_eq!(
                    is_valid_in_pass(owner_byte, counter, bit),
                    is_valid(owner_byte, counter, log),
                    "counter {} log {}", counter, log
                );
            }
        }

        #[test]
        fn phase_flips_once_per_pass(n: u32, log in 0u8..31) {
            let next_pass = n.wrapping_add(1 << log);
            prop_assert_eq!(phase_for(n, log) ^ 1, phase_for(next_pass, log));
            prop_assert_eq!(slot(n, log), slot(next_pass, log));
            prop_assert!(is_valid(phase_for(n, log), n, log));
            prop_assert!(!is_valid(phase_for(n, log), next_pass, log));
        }
    }
}
