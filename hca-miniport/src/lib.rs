//! Shells of the HCA miniport, the PCI function driver for the project's
//! HCA: each translates its host's driver callbacks (driver entry, device
//! add, prepare/release hardware, D0 entry/exit, interrupt and DPC,
//! requests, query interface) into calls on `hca-miniport-core`, and
//! supplies that core's platform.
//!
//! - `kmdf` (Windows only): the KMDF driver, on windows-drivers-rs.
//!   **Never compiled**: `wdk-sys` cannot build on a non-Windows host, and
//!   no Windows build has been run yet.
//! - [`sim`] (other hosts): the same shell for the simulated Windows host
//!   (`sim-host`), which tests and the main job boot.
//! - [`sg_pages`] (every host): the KMDF shell's scatter/gather-to-pages
//!   arithmetic, portable so it is compiled and tested here.

#![cfg_attr(windows, no_std)]

#[cfg(windows)]
extern crate alloc;

// The kernel's panic handler (a bug check); kernel drivers do not unwind.
#[cfg(all(windows, not(test)))]
extern crate wdk_panic;

#[cfg(windows)]
pub mod kmdf;

#[cfg(not(windows))]
pub mod sim;

pub mod sg_pages;
