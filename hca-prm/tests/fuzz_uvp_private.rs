//! Bounded run of the `uvp_private` fuzz target's property (the UVP private data records as the kernel reads them from a process; see
//! `fuzz_props/uvp_private.rs`): arbitrary bytes, and the encoders' valid inputs
//! with a few bytes replaced and possibly cut short. `cargo xtask fuzz
//! uvp_private` runs the same property under libFuzzer.

#[path = "../../fuzz/proptest_mutation.rs"]
mod mutation;

#[path = "fuzz_props/uvp_private.rs"]
mod property;

use proptest::prelude::*;

#[test]
fn seeds_satisfy_the_property() {
    for seed in property::seeds() {
        assert!(
            property::check(&seed) > 0,
            "a seed the parser refuses: {seed:?}"
        );
    }
}

/// A seed with a few bytes replaced and possibly cut short.
fn mutated_seed() -> impl Strategy<Value = Vec<u8>> {
    mutation::mutated(property::seeds(), 4, usize::MAX, 0.5)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        property::check(&bytes);
    }

    #[test]
    fn mutated_valid_inputs(bytes in mutated_seed()) {
        property::check(&bytes);
    }
}
