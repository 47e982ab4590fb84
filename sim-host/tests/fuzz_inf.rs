//! Bounded run of the `inf` fuzz target's property (INF files parsed in
//! either encoding and added to the workspace's set; see
//! `fuzz_props/inf.rs`): arbitrary bytes, the workspace's INFs with a few
//! bytes replaced and possibly cut short, and with lines dropped. `cargo
//! xtask fuzz inf` runs the same property under libFuzzer.

#[path = "../../fuzz/proptest_mutation.rs"]
mod mutation;

#[path = "fuzz_props/inf.rs"]
mod property;

use proptest::prelude::*;
use proptest::sample::Index;

#[test]
fn seeds_satisfy_the_property() {
    for seed in property::seeds() {
        assert!(property::check(&seed), "a workspace INF the parser refuses");
    }
}

/// A seed with a few bytes replaced and possibly cut short.
fn mutated_seed() -> impl Strategy<Value = Vec<u8>> {
    mutation::mutated(property::seeds(), 4, usize::MAX, 0.5)
}

/// A UTF-8 seed with a few lines dropped: sections, keys and strings go
/// missing while the rest stays well formed.
fn seed_without_lines() -> impl Strategy<Value = Vec<u8>> {
    let texts: Vec<String> = property::seeds()
        .into_iter()
        .filter_map(|s| String::from_utf8(s).ok())
        .collect();
    (
        proptest::sample::select(texts),
        proptest::collection::vec(any::<Index>(), 1..4),
    )
        .prop_map(|(text, drops)| {
            let mut lines: Vec<&str> = text.lines().collect();
            for drop in drops {
                if !lines.is_empty() {
                    lines.remove(drop.index(lines.len()));
                }
            }
            lines.join("\n").into_bytes()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        property::check(&bytes);
    }

    #[test]
    fn mutated_valid_inputs(bytes in mutated_seed()) {
        property::check(&bytes);
    }

    #[test]
    fn dropped_lines(bytes in seed_without_lines()) {
        property::check(&bytes);
    }
}
