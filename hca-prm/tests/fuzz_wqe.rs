//! Bounded run of the `wqe` fuzz target's property (send and receive WQEs read from memory a process wrote; see
//! `fuzz_props/wqe.rs`): arbitrary bytes, and the encoders' valid inputs
//! with a few bytes replaced and possibly cut short. `cargo xtask fuzz
//! wqe` runs the same property under libFuzzer.

#[path = "../../fuzz/proptest_mutation.rs"]
mod mutation;

#[path = "fuzz_props/wqe.rs"]
mod property;

use proptest::prelude::*;

#[test]
fn seeds_satisfy_the_property() {
    for seed in property::seeds() {
        assert!(
            property::check(&seed),
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
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..320)) {
        property::check(&bytes);
    }

    #[test]
    fn mutated_valid_inputs(bytes in mutated_seed()) {
        property::check(&bytes);
    }
}
