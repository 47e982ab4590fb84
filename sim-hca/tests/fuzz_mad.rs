//! Bounded run of the `mad` fuzz target's property (MADs handed to the
//! device's local agents through `MAD_IFC`; see `fuzz_props/mad.rs`):
//! arbitrary bytes, and valid MADs with a few bytes replaced and possibly
//! cut short. `cargo xtask fuzz mad` runs the same property under
//! libFuzzer.

#[path = "fuzz_props/mad.rs"]
mod property;

use proptest::prelude::*;
use proptest::sample::Index;

#[test]
fn seeds_satisfy_the_property() {
    for seed in property::seeds() {
        assert!(property::check(&seed), "a seed MAD the device refuses");
    }
}

/// A seed with a few bytes replaced and possibly cut short (rarely: the
/// size check is one branch).
fn mutated_seed() -> impl Strategy<Value = Vec<u8>> {
    (
        proptest::sample::select(property::seeds()),
        proptest::collection::vec((any::<Index>(), any::<u8>()), 0..6),
        proptest::option::weighted(0.1, any::<Index>()),
    )
        .prop_map(|(mut bytes, edits, cut)| {
            for (at, value) in edits {
                // Most edits land in the MAD header, where the agent looks.
                let at = at.index(bytes.len().min(24));
                bytes[at] = value;
            }
            if let Some(cut) = cut {
                bytes.truncate(cut.index(bytes.len() + 1));
            }
            bytes
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        property::check(&bytes);
    }

    #[test]
    fn arbitrary_full_size_mads(port in 0u8..4, mad in proptest::collection::vec(any::<u8>(), 256)) {
        property::check(&[vec![port], mad].concat());
    }

    #[test]
    fn mutated_valid_inputs(bytes in mutated_seed()) {
        property::check(&bytes);
    }
}
