//! Portable core of the IBAL bus filter: the access layer over the CI
//! interface, per-port child enumeration from the registry list, the AL
//! interface for kernel clients, and the user-mode proxy.
//!
//! Status: not written yet. The crate exists so the workspace has its final
//! shape; it exports nothing.

#![cfg_attr(not(test), no_std)]
#![forbid(unsafe_code)]
