//! RoCEv2 frames: parse, re-emit, and a live device's receive path (`sim_hca::wire`).
#![no_main]

#[path = "../../sim-hca/tests/common/mod.rs"]
mod common;

#[path = "../../sim-hca/tests/fuzz_props/packet.rs"]
#[allow(dead_code, reason = "seeds() is for the corpus writer")]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    property::check(data);
});
