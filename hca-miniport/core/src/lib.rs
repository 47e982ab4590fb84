//! Portable core of the HCA miniport: the verbs provider (CI interface) over
//! the project's PRM, generic over the platform traits (MMIO, DMA, interrupts,
//! requests) that the KMDF shell implements on Windows and the simulated host
//! implements on Linux.
//!
//! Status: not written yet (issue 5). The crate exists so the workspace has
//! its final shape; it exports nothing.

#![cfg_attr(not(test), no_std)]
#![forbid(unsafe_code)]
