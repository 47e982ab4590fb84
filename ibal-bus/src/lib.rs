//! KMDF shell of the IBAL bus filter: an upper filter on the HCA stack and the
//! bus driver for its per-port children. It translates WDF callbacks into
//! calls on `ibal-bus-core` and implements that core's platform traits.
//!
//! Status: not written yet, and never compiled here: `wdk-sys` cannot build
//! on a non-Windows host. On Linux this crate is empty.

#![cfg_attr(windows, no_std)]
