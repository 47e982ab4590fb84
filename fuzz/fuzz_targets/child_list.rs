//! The IBAL bus filter's child list read from a hostile Parameters key.
#![no_main]

#[path = "../../ibal-bus/core/tests/fuzz_props/child_list.rs"]
#[allow(dead_code, reason = "seeds() is for the corpus writer")]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    property::check(data);
});
