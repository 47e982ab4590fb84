//! KMDF shell of the IBAL bus filter: an upper filter on the HCA stack and
//! the bus driver for its per-port children. It translates WDF callbacks
//! into calls on `ibal-bus-core` and implements that core's platform
//! traits (docs/ibal-bus.md, "The KMDF shell").
//!
//! - `kmdf` (Windows only): the KMDF driver, on windows-drivers-rs.
//!   Type-checked and linted on every change by `cargo xtask wdk-check`
//!   (against a stand-in WDK on Linux); never linked or run yet, as no
//!   Windows build has been run.
//! - The same shell for the simulated Windows host, which tests boot, is
//!   not here: it lives with the simulator, in `sim-shells`
//!   (`sim_shells::ibal_bus`), so that this shipped crate never depends on
//!   a simulator. Both run the same callbacks in the same order.
//!
//! On other hosts the crate is empty.

#![cfg_attr(windows, no_std)]

// Kernel drivers must not unwind: the kernel has no unwinder for them, and
// the panic handler (wdk-panic) bug-checks. A profile cannot set `panic`
// per target, so Windows driver builds set
// CARGO_PROFILE_{DEV,RELEASE}_PANIC=abort (the Windows workflow,
// `cargo xtask wdk-check`); say so here rather than fail at link time.
#[cfg(all(windows, not(test), not(panic = "abort")))]
compile_error!(
    "build the KMDF driver with panic=abort: set CARGO_PROFILE_DEV_PANIC=abort and \
     CARGO_PROFILE_RELEASE_PANIC=abort (see .cargo/config.toml)"
);

#[cfg(windows)]
extern crate alloc;

// The kernel's panic handler (a bug check); kernel drivers do not unwind.
#[cfg(all(windows, not(test)))]
extern crate wdk_panic;

#[cfg(windows)]
pub mod kmdf;
