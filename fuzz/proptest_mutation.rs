//! The mutation every bounded twin of a fuzz target shares
//! (`<crate>/tests/fuzz_<target>.rs`, which include this file by path, as
//! the fuzz targets include the properties): one of the encoders' valid
//! inputs with a few bytes replaced and possibly cut short, so the property
//! tests reach past the first length check as libFuzzer's mutations do.
//! Not part of the `fuzz` crate's build.

use proptest::prelude::*;
use proptest::sample::Index;

/// One of `seeds` with fewer than `edits` bytes replaced, each within the
/// first `window` bytes, and cut short with probability `cut`.
pub(crate) fn mutated(
    seeds: Vec<Vec<u8>>,
    edits: usize,
    window: usize,
    cut: f64,
) -> impl Strategy<Value = Vec<u8>> {
    (
        proptest::sample::select(seeds),
        proptest::collection::vec((any::<Index>(), any::<u8>()), 0..edits),
        proptest::option::weighted(cut, any::<Index>()),
    )
        .prop_map(move |(mut bytes, replaced, cut_at)| {
            for (at, value) in replaced {
                let at = at.index(bytes.len().min(window));
                bytes[at] = value;
            }
            if let Some(cut_at) = cut_at {
                bytes.truncate(cut_at.index(bytes.len() + 1));
            }
            bytes
        })
}
