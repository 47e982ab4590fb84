//! Bounded run of the `mad` fuzz target's property (MADs handed to the
//! device's local agents through `MAD_IFC`; see `fuzz_props/mad.rs`):
//! arbitrary bytes, and valid MADs with a few bytes replaced and possibly
//! cut short. `cargo xtask fuzz mad` runs the same property under
//! libFuzzer.

#[path = "../../fuzz/proptest_mutation.rs"]
mod mutation;

#[path = "fuzz_props/mad.rs"]
mod property;

use proptest::prelude::*;

#[test]
fn seeds_satisfy_the_property() {
    for seed in property::seeds() {
        assert!(property::check(&seed), "a seed MAD the device refuses");
    }
}

/// Found by the `mad` fuzz target: a SubnGet of an attribute the agent
/// does not answer (here PortInfo, directed route and LID routed) came
/// back with its SMP data zeroed instead of echoed with the "unsupported
/// method/attribute" status like every other unanswered MAD.
#[test]
fn unanswered_smp_get_is_echoed() {
    for class in [0x01, 0x81] {
        let mut mad = vec![0x5A; 256];
        mad[..8].copy_from_slice(&[1, class, 1, 0x01, 0, 0, 0, 0]);
        mad[16..18].copy_from_slice(&0x0015u16.to_be_bytes());
        assert!(property::check(&[vec![1], mad].concat()));
    }
}

/// A seed with a few bytes replaced and possibly cut short (rarely: the
/// size check is one branch).
fn mutated_seed() -> impl Strategy<Value = Vec<u8>> {
    // Most edits land in the MAD header, where the agent looks.
    mutation::mutated(property::seeds(), 6, 24, 0.1)
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
