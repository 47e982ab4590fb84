//! Bounded run of the `proxy` fuzz target's property (proxy request and
//! response framing of every verb under hostile bytes; see
//! `fuzz_props/proxy.rs`): arbitrary bytes, bytes framed with a consistent
//! private length, and the encoders' valid inputs with a few bytes
//! replaced or cut. `cargo xtask fuzz proxy` runs the same property
//! under libFuzzer.

#[path = "../../fuzz/proptest_mutation.rs"]
mod mutation;

#[path = "fuzz_props/proxy.rs"]
mod property;

use ib_types::ioctl::VerbId;
use proptest::prelude::*;

#[test]
fn property_covers_every_verb() {
    assert_eq!(property::COVERED, VerbId::ALL);
}

#[test]
fn seeds_satisfy_the_property() {
    for seed in property::seeds() {
        assert!(property::check(&seed) > 0, "a seed no decoder accepts");
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
