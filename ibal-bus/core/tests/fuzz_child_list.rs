//! Bounded run of the `child_list` fuzz target's property (the filter's
//! child list read from a hostile Parameters key; see
//! `fuzz_props/child_list.rs`): arbitrary scripts and the valid seeds with
//! a few bytes replaced and possibly cut short. `cargo xtask fuzz
//! child_list` runs the same property under libFuzzer.

#[path = "../../../fuzz/proptest_mutation.rs"]
mod mutation;

#[path = "fuzz_props/child_list.rs"]
mod property;

use proptest::prelude::*;

#[test]
fn seeds_satisfy_the_property() {
    for seed in property::seeds() {
        assert!(property::check(&seed), "a valid seed was refused");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_scripts(data in proptest::collection::vec(any::<u8>(), 0..600)) {
        property::check(&data);
    }

    #[test]
    fn mutated_seeds(data in mutation::mutated(property::seeds(), 4, usize::MAX, 0.5)) {
        property::check(&data);
    }
}
