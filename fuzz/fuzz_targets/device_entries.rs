//! EQEs and CQEs read from device memory (`hca_prm::eqe`, `hca_prm::cqe`).
#![no_main]

#[path = "../../hca-prm/tests/fuzz_props/device_entries.rs"]
#[allow(dead_code, reason = "seeds() is for the corpus writer")]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    property::check(data);
});
