//! The atomics the core's lock-free protocols use: `core`'s normally, and
//! `loom`'s under `--cfg loom` (`cargo xtask loom`), so the model checker
//! explores every interleaving of exactly the code that ships.
//!
//! A protocol that wants loom coverage takes its atomics from here, keeps
//! its shared state in a small type of its own (loom atomics are not
//! `const` and only work inside `loom::model`), and gets a `loom_` test
//! module under `#[cfg(all(test, loom))]`.

#[cfg(loom)]
#[allow(unused_imports, reason = "each protocol takes the atomics it needs")]
pub(crate) use loom::sync::atomic::{
    AtomicBool, AtomicU8, AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
};

#[cfg(not(loom))]
#[allow(unused_imports, reason = "each protocol takes the atomics it needs")]
pub(crate) use core::sync::atomic::{
    AtomicBool, AtomicU8, AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
};
