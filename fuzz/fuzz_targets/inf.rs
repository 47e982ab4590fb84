//! INF files: parse in either encoding, add to the workspace set, bind (`sim_host::inf`).
#![no_main]

#[path = "../../sim-host/tests/fuzz_props/inf.rs"]
#[allow(dead_code, reason = "seeds() is for the corpus writer")]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    property::check(data);
});
