//! The shared vocabulary and ABI of the InfiniBand stack.
//!
//! Every other crate (the HCA miniport, the IBAL bus filter, the user-mode
//! access library and the UVP plug-in) speaks in these types. The crate is
//! `no_std` with no allocation, and holds no `unsafe` code.
//!
//! Two kinds of types live here:
//! - **ABI layouts** (`*Abi` structs): `#[repr(C)]`, zerocopy-derived, with
//!   explicit endianness, explicit padding and compile-time size and offset
//!   assertions. Every bit pattern is a valid layout, so reading one from bytes
//!   cannot fail except on length.
//! - **Validated values** (the plain names): Rust enums, newtypes and structs
//!   whose invariants hold by construction. `parse` turns an ABI layout into a
//!   value and fails with an [`AbiError`] on anything out of range; `emit` goes
//!   back. Untrusted bytes (IOCTL buffers, device memory) always take this path.
//!
//! IB quantities that travel between nodes (LID, QPN, P_Key, Q_Key, GID, GUID,
//! PSN) are kept in network byte order inside ABI layouts, as the implementer's
//! guide 4.3 asks; host-local quantities (lengths, counts, handles) are
//! little-endian, the only byte order Windows runs on.

#![cfg_attr(not(test), no_std)]
#![forbid(unsafe_code)]

#[macro_use]
mod macros;

pub mod abi;
pub mod access;
pub mod av;
pub mod ca;
pub mod cq;
pub mod event;
pub mod handle;
pub mod interface;
pub mod ioctl;
pub mod mcast;
pub mod mr;
pub mod qp;
pub mod qp_state;
pub mod scalars;
pub mod srq;
pub mod status;
pub mod uvp;
pub mod wc;
pub mod wr;
pub mod wr_desc;

pub use abi::AbiError;
