//! KMDF shell of the IBAL bus filter: an upper filter on the HCA stack and the
//! bus driver for its per-port children. It translates WDF callbacks into
//! calls on `ibal-bus-core` and implements that core's platform traits.
//!
//! Status: not written yet. On Windows targets the crate is the (empty)
//! driver image with the kernel's panic handler and allocator, so that
//! `cargo xtask wdk-check` type-checks and lints it against the WDK
//! bindings from the start; on other hosts it is empty.

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

// The kernel's panic handler (a bug check); kernel drivers do not unwind.
#[cfg(all(windows, not(test)))]
extern crate wdk_panic;

// Kernel pool allocations (`ExAllocatePool2`) for `alloc`.
#[cfg(all(windows, not(test)))]
#[global_allocator]
static GLOBAL_ALLOCATOR: wdk_alloc::WdkAllocator = wdk_alloc::WdkAllocator;
