//! Bounded run of the `proxy_open` fuzz target's property (the user-mode
//! proxy's per-open policy and its administrator IOCTL's parser under
//! hostile requests; see `fuzz_props/proxy_open.rs`): arbitrary scripts
//! and the valid seeds with a few bytes replaced and possibly cut short.
//! `cargo xtask fuzz proxy_open` runs the same property under libFuzzer.

#[path = "../../../fuzz/proptest_mutation.rs"]
mod mutation;

#[path = "fuzz_props/proxy_open.rs"]
mod property;

use proptest::prelude::*;

#[test]
fn seeds_satisfy_the_property() {
    for seed in property::seeds() {
        assert!(property::check(&seed), "a valid seed was refused");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_scripts(data in proptest::collection::vec(any::<u8>(), 0..400)) {
        property::check(&data);
    }

    #[test]
    fn mutated_seeds(data in mutation::mutated(property::seeds(), 4, usize::MAX, 0.5)) {
        property::check(&data);
    }
}
