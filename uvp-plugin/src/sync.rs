//! The atomics of the provider's post/poll protocol (`queue`): `std`'s
//! normally, `loom`'s under `--cfg loom` (`cargo xtask loom`), so the model
//! checker runs exactly the code that ships. The shared-memory accessors
//! (`dma`) keep real atomics: they address the device's memory.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
