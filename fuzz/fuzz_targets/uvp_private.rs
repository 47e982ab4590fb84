//! UVP private data records as the kernel reads them (`hca_prm::uverbs`).
#![no_main]

#[path = "../../hca-prm/tests/fuzz_props/uvp_private.rs"]
#[allow(dead_code, reason = "seeds() is for the corpus writer")]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    property::check(data);
});
