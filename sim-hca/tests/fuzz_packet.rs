//! Bounded run of the `packet` fuzz target's property (RoCEv2 frames
//! parsed, re-emitted, and delivered to a live device; see
//! `fuzz_props/packet.rs`): arbitrary bytes, and valid frames aimed at
//! the live QPs with a few bytes replaced (checksums recomputed) and
//! possibly cut short. `cargo xtask fuzz packet` runs the same property
//! under libFuzzer.

mod common;
#[path = "../../fuzz/proptest_mutation.rs"]
mod mutation;

#[path = "fuzz_props/packet.rs"]
mod property;

use proptest::prelude::*;

#[test]
fn seeds_satisfy_the_property() {
    for seed in property::seeds() {
        let frames = property::frames(&seed).len();
        assert_eq!(
            property::check(&seed),
            frames,
            "a seed frame the parser refuses"
        );
    }
}

/// A seed with a few bytes replaced and possibly cut short.
fn mutated_seed() -> impl Strategy<Value = Vec<u8>> {
    mutation::mutated(property::seeds(), 4, usize::MAX, 0.5)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        property::check(&bytes);
    }

    #[test]
    fn mutated_valid_inputs(bytes in mutated_seed()) {
        property::check(&bytes);
    }
}
