//! User-mode verbs provider (UVP) for the project's HCA: pre/post hooks around
//! the proxy IOCTLs and the kernel-bypass fast path (post send/receive, poll,
//! arm) on mapped rings and doorbells.
//!
//! Status: not written yet. The crate exists so the workspace has its final
//! shape; it exports nothing.
