//! The port client's datagrams and RC payloads from a hostile fabric.
#![no_main]

#[path = "../../port-client/core/tests/fuzz_props/port_message.rs"]
#[allow(dead_code, reason = "seeds() is for the corpus writer")]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    property::check(data);
});
