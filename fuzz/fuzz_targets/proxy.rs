//! Proxy request and response framing of every verb (`ib_types::ioctl`).
#![no_main]

#[path = "../../ib-types/tests/fuzz_props/proxy.rs"]
#[allow(dead_code, reason = "seeds() is for the corpus writer")]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    property::check(data);
});
