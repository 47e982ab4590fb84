//! Bounded run of the `port_message` fuzz target's property (the port
//! client's datagrams and RC payloads from a hostile fabric; see
//! `fuzz_props/port_message.rs`): arbitrary bytes and the valid seeds
//! with a few bytes replaced and possibly cut short. `cargo xtask fuzz
//! port_message` runs the same property under libFuzzer.

#[path = "../../../fuzz/proptest_mutation.rs"]
mod mutation;

#[path = "fuzz_props/port_message.rs"]
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
    fn arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..96)) {
        property::check(&data);
    }

    #[test]
    fn mutated_seeds(data in mutation::mutated(property::seeds(), 4, usize::MAX, 0.3)) {
        property::check(&data);
    }
}
