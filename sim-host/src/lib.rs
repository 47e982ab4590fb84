//! Simulated Windows host: the contracts the drivers' portable cores rely
//! on, enforced so that they are tested rather than assumed
//! (`docs/host-model.md`). It is not a Windows emulator: it models exactly
//! what the stack depends on — PnP, power, requests, IRQL, DMA through an
//! IOMMU, the registry and INF-driven binding — and reports every broken
//! rule to the [`verifier`].

pub mod alloc_hook;
pub mod binder;
pub mod caller;
pub mod context;
pub mod dma;
pub mod driver;
pub mod event;
pub mod file;
pub mod host;
pub mod inf;
pub mod inf_lint;
pub mod io_target;
pub mod irql;
pub mod memory;
pub mod pci;
pub mod platform;
pub mod pnp;
pub mod power;
pub mod registry;
pub mod request;
pub mod rw_spin_lock;
pub mod samples;
pub mod sched;
pub mod security;
pub mod stack;
pub mod verifier;
