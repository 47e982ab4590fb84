//! Bounded run of the `udp_datagram` fuzz target's property (the UDP
//! fabric's datagram-to-frame and frame-to-datagram translations; see
//! `fuzz_props/udp_datagram.rs`): arbitrary bytes, and valid datagrams
//! and frames with a few bytes replaced (the ICRC of a flagged datagram
//! recomputed) and possibly cut short. `cargo xtask fuzz udp_datagram`
//! runs the same property under libFuzzer.

#[path = "../../fuzz/proptest_mutation.rs"]
mod mutation;

#[path = "fuzz_props/udp_datagram.rs"]
mod property;

use proptest::prelude::*;

#[test]
fn seeds_satisfy_the_property() {
    for seed in property::seeds() {
        assert!(property::check(&seed), "a seed the fabric refuses");
    }
}

/// A seed with a few bytes replaced and possibly cut short.
fn mutated_seed() -> impl Strategy<Value = Vec<u8>> {
    mutation::mutated(property::seeds(), 4, usize::MAX, 0.5)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        property::check(&bytes);
    }

    #[test]
    fn mutated_valid_inputs(bytes in mutated_seed()) {
        property::check(&bytes);
    }
}
