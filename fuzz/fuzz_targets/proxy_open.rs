//! The user-mode proxy's per-open policy and its administrator IOCTL's
//! parser under hostile requests.
#![no_main]

#[path = "../../ibal-bus/core/tests/fuzz_props/proxy_open.rs"]
#[allow(dead_code, reason = "seeds() is for the corpus writer")]
mod property;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    property::check(data);
});
