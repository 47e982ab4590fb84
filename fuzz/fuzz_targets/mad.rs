//! MADs handed to the device's local agents through `MAD_IFC`.
#![no_main]

#[path = "../../sim-hca/tests/fuzz_props/mad.rs"]
#[allow(dead_code, reason = "seeds() is for the corpus writer")]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    property::check(data);
});
