//! The UDP fabric's translations: a received datagram into a frame, a sent
//! frame into a datagram (`sim_hca::udp`).
#![no_main]

#[path = "../../sim-hca/tests/fuzz_props/udp_datagram.rs"]
#[allow(dead_code, reason = "seeds() is for the corpus writer")]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    property::check(data);
});
