//! Portable core of the IBAL bus filter (docs/ibal-bus.md): the filter's
//! binding to each HCA below it through the CI interface, the registry of
//! bound CAs, and the per-port children enumerated from the registry list
//! under the filter's Parameters key.
//!
//! Built so far (issue 11, first increment):
//! - [`ci`]: [`ci::CiAccess`], what the filter needs from one HCA's CI
//!   interface (identity, ports, open/close with callbacks, control verb
//!   requests, the direct post/poll/arm calls), implemented by each shell
//!   over what the miniport hands out;
//! - [`ca_registry`]: binding an HCA (version check first, then open and
//!   port query) and the registry of bound CAs, in any arrival and
//!   departure order;
//! - [`children`]: the child list parsed as untrusted input, the children
//!   of each port with their stable instance IDs, and the reconciliation
//!   that turns a changed list into children reported present or missing.
//!
//! - [`al`] (second increment): the access layer for kernel clients over
//!   one CA: clients opened with a held reference, per-client handle
//!   tables, control verbs as requests sent to the CA with handles
//!   translated both ways, the direct post/poll/arm calls, events to the
//!   owning client; close destroying what a client left in dependency
//!   order (refused destroys kept as orphans), P_Key and GID table
//!   changes told to every client, and the CA's removal.
//!
//! - [`proxy`]: the user-mode proxy's per-open handle tables and the
//!   hostile-input policy every user request passes before it goes down
//!   to the miniport's user request path.
//!
//! Not built yet: the access layer in the shells, the AL interface on the
//! children (see docs/ibal-bus.md).

#![cfg_attr(not(test), no_std)]
#![forbid(unsafe_code)]

extern crate alloc;

pub mod al;
pub mod ca_registry;
pub mod children;
pub mod ci;
pub mod proxy;
