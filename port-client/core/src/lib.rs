//! Portable core of `ibportclient`, the sample kernel client of the access
//! layer on the IBAL bus filter's port children (docs/port-client.md,
//! issue 11): a ping-pong ULP.
//!
//! - [`message`]: the small versioned message two peers exchange over UD
//!   (connection parameters, goodbye), parsed as untrusted input, and the
//!   RC ping/pong payload with its check.
//! - [`config`]: the device settings from its hardware key (the INF's
//!   `ReceiveDepth`), refused with a reason when malformed.
//! - [`session`]: the connection state machine, sans-IO: it takes what
//!   the fabric delivered and answers with [`session::Action`]s its shell
//!   carries out through the AL interface (send a datagram, connect or
//!   reset the RC QP, send an RC message), so the same core can sit in
//!   the simulated-host shell (`sim_shells::port_client`) and a KMDF one.
//!
//! The core never blocks and never allocates beyond the actions it
//! returns; its shell calls it at DISPATCH_LEVEL or below, under the
//! shell's lock.

#![cfg_attr(not(test), no_std)]
#![forbid(unsafe_code)]

extern crate alloc;

pub mod config;
pub mod message;
pub mod session;
