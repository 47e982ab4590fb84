//! Shells of the HCA miniport, the PCI function driver for the project's
//! HCA: each translates its host's driver callbacks (driver entry, device
//! add, prepare/release hardware, D0 entry/exit, interrupt and DPC,
//! requests, query interface) into calls on `hca-miniport-core`, and
//! supplies that core's platform.
//!
//! - `kmdf` (Windows only): the KMDF driver, on windows-drivers-rs.
//!   Type-checked and linted on every change by `cargo xtask wdk-check`
//!   (against a stand-in WDK on Linux); never linked or run yet, as no
//!   Windows build has been run.
//! - The same shell for the simulated Windows host, which tests and the
//!   main job boot, is not here: it lives with the simulator, in
//!   `sim-shells` (`sim_shells::hca_miniport`), so that this shipped crate
//!   never depends on a simulator.
//! - [`sg_pages`] (every host): the KMDF shell's scatter/gather-to-pages
//!   arithmetic, portable so it is compiled and tested here.

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

pub mod sg_pages;
