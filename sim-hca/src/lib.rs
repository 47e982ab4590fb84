//! Simulated HCA: a software device implementing the project's PRM
//! (`docs/prm.md`), its IB transport engine, and a RoCEv2 fabric with fault
//! injection and pcap capture.
//!
//! Status: not written yet (issue 3). The crate exists so the workspace has
//! its final shape; it exports nothing.

pub mod fabric;
pub mod rng;
