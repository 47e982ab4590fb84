//! User-mode access library: enumerates the HCAs through their proxy
//! interfaces, opens the one asked for (the ABI version checked on both
//! sides at `OpenCa`), takes the CA's UVP plugin (linked, or loaded by
//! absolute path from a verified directory), and offers the verbs as safe
//! Rust objects whose lifetimes encode the destroy order. `docs/ibal-user.md`
//! describes it and compares it with the `ibverbs` crate and rdma-core.
//!
//! Layers:
//! - [`device`]: the OS seam (interfaces, `CreateFile`, `DeviceIoControl`,
//!   process memory). `windows` (Windows only) implements it there; the simulated
//!   host's implementation lives with the tests (`sim-shells`), since this
//!   crate never depends on a simulator.
//! - [`Context`] (one `OpenCa`), [`Pd`], [`Av`], [`Cq`], [`Qp`], [`Srq`],
//!   [`Mr`] over a [`Buffer`], [`Mw`]: every verb is called through the plugin's pre and
//!   post hooks around the proxy IOCTL as the guide's Table 10-1 prescribes
//!   (`proxy`); the plugin lays the rings out, keeps address vectors in
//!   user mode, and runs post, poll and arm with no kernel call.
//! - [`shared`]: the PD, region and AV again, owning what they depend on
//!   (`Arc`) instead of borrowing it, for a C library's objects.
//! - [`plugin`]: loading the UVP the kernel names, never through the DLL
//!   search order.
//!
//! Thread safety, checked below: [`Context`], [`Pd`], [`Av`], [`Cq`],
//! [`Srq`], [`Mr`], [`Mw`] and [`Buffer`] are `Send + Sync` (their calls
//! are `DeviceIoControl`s or the plugin's, which serializes a CQ's polls
//! and an SRQ's posts); [`Qp`] is `Send` only (posts take `&mut`, one
//! poster at a time).

pub mod context;
pub mod device;
pub mod error;
pub mod mw;
pub mod plugin;
mod proxy;
pub mod query;
pub mod shared;
pub mod srq;
pub mod verbs;
#[cfg(windows)]
pub mod windows;
#[cfg(windows)]
pub use windows::WindowsIo;

pub use context::{CaInfo, CaSelector, Context, PluginSource, linked_provider, list_cas};
pub use device::{DeviceFile, DeviceIo, DevicePath, OsStatus};
pub use error::{Error, Result};
pub use ib_types::uvp::UserSend;
pub use mw::Mw;
pub use plugin::{LoadedPlugin, PluginError};
pub use query::PortInfo;
pub use shared::{SharedAv, SharedCq, SharedMr, SharedPd, SharedQp, SharedSrq};
pub use srq::Srq;
pub use uvp_plugin::ArmFor;
pub use verbs::{Av, Buffer, Cq, Mr, Pd, Qp, QpInit};

const _: () = {
    const fn send<T: Send>() {}
    const fn sync<T: Sync>() {}
    send::<Context>();
    sync::<Context>();
    send::<Pd<'static>>();
    sync::<Pd<'static>>();
    send::<Cq<'static>>();
    sync::<Cq<'static>>();
    send::<Buffer<'static>>();
    sync::<Buffer<'static>>();
    send::<Mr<'static, 'static>>();
    sync::<Mr<'static, 'static>>();
    send::<Av<'static>>();
    sync::<Av<'static>>();
    send::<Srq<'static>>();
    sync::<Srq<'static>>();
    send::<Mw<'static, 'static>>();
    sync::<Mw<'static, 'static>>();
    send::<Qp<'static, 'static>>();
    send::<SharedPd>();
    sync::<SharedPd>();
    send::<SharedMr>();
    sync::<SharedMr>();
    send::<SharedAv>();
    sync::<SharedAv>();
    send::<SharedSrq>();
    sync::<SharedSrq>();
};
