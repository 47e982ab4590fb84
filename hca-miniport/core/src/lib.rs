//! Portable core of the HCA miniport: the verbs provider (CI interface) over
//! the project's PRM (`docs/prm.md`), generic over the platform traits
//! (`driver_platform::Platform`) that the KMDF shell implements on Windows
//! and the simulated host implements on Linux. See `docs/miniport.md` for
//! the layers and what is built.
//!
//! Bring-up and events: [`hca::Hca`] is the device object (ISR, DPC and
//! timer entry points); [`init`] brings the device up and down (PRM 3),
//! [`cmd`] runs commands (PRM 4), [`eq`] sizes and drains the event queue
//! and hands events to the higher layers' [`eq::EventSink`] (PRM 8).
//!
//! Memory: [`mr::MemoryTranslation`] registers memory regions over the MPT
//! and MTT (PRM 7; guide 7.1), for the verbs to embed.
//!
//! Verbs: [`verbs`] is the request path of every control verb
//! (`Hca::submit_request`) with the CA, PD and CQ verbs, polling and
//! arming (guide 4, 6.1, 6.2, 6.8, 8.2, 8.3); [`ci::CiProvider`] is the
//! CI interface the shells hand out for `IRP_MN_QUERY_INTERFACE`.
//!
//! Power and failure: [`Hca::d0_exit`] and [`Hca::d0_entry`] keep every
//! verb object across a D0 exit ([`verbs::restore`]); a device failure
//! fails the verbs over to software ([`verbs::fatal`]).

#![cfg_attr(not(any(test, loom)), no_std)]
#![forbid(unsafe_code)]

extern crate alloc;

pub mod ci;
pub mod cmd;
pub mod eq;
pub mod hca;
pub mod init;
pub mod mr;
pub mod resources;
mod ring;
mod sync;
pub mod verbs;

pub use cmd::{Command, CommandError, CommandInput, CommandOutput, Continuation};
pub use eq::{DeviceFailure, EventSink};
pub use hca::{Hca, HcaResources};
pub use init::{BringUpReport, HcaConfig, InitError};
