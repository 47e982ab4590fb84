//! Send and receive WQEs read from memory a process wrote (`hca_prm::wqe`).
#![no_main]

#[path = "../../hca-prm/tests/fuzz_props/wqe.rs"]
#[allow(dead_code, reason = "seeds() is for the corpus writer")]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    property::check(data);
});
