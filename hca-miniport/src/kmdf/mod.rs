//! The KMDF shell of the HCA miniport (Windows only).
//!
//! **Type-checked, never run.** `cargo xtask wdk-check` (in CI) compiles
//! and lints it for `x86_64-pc-windows-msvc` against Microsoft's KMDF 1.33
//! headers and mingw-w64's kernel headers (README, "What is
//! type-checked"); it has never been linked with the real WDK
//! (`.github/workflows/windows-drivers.yml`, never run) nor run.
//!
//! It is the same shell as `crate::sim` (the simulated host's), callback for
//! callback, on WDF objects:
//!
//! | file | WDF | core |
//! |---|---|---|
//! | [`driver`] | `DriverEntry`, `EvtDriverDeviceAdd` (PnP/power callbacks, device object and context, IOCTL queue, DMA enabler, work item, timer, `WdfDeviceAddQueryInterface`) | — |
//! | [`device`] | `EvtDevicePrepareHardware` (map BAR0 with `MmMapIoSpaceEx`, one `WDFINTERRUPT` per MSI-X message), `EvtDeviceReleaseHardware`, `EvtDeviceD0Entry`/`Exit` | `Hca::new`/`start`/`stop`, `Hca::d0_exit`/`d0_entry` |
//! | [`interrupt`] | `EvtInterruptIsr`, `EvtInterruptDpc`, the work item and timer routines | `Hca::isr`, `dpc`, `work_item`, `timer` |
//! | [`file`] | `EvtDeviceFileCreate`, `EvtFileCleanup` (a process's last file object closes its user contexts, waited for) | `Hca::close_user_contexts_of` |
//! | [`queue`] | `EvtIoInCallerContext` (a user request's process: its buffers locked, its doorbell page mapped or unmapped, kept in the request's context) and the power-managed IOCTL queue (`EvtIoDeviceControl`, `EvtIoInternalDeviceControl`) | `Hca::prepare_user_request` (with the caller's `WdfCaller`), `Hca::execute_user_request` (user requests, with what was prepared), `Hca::submit_request` |
//! | [`interface`] | the `CiInterface` FFI table (`extern "system"` entry points over the `CiProvider`) | `ci::CiProvider` |
//! | [`platform`] | the `driver_platform` traits on WDF/WDM: reader-writer spin lock, BAR0, DMA enabler and common buffers, MDL locking (SEH shim `probe.c`), scatter/gather mapping, deferred work, registry, the calling process (doorbell pages mapped into it); the spin lock, requests, IRQL and events from `kmdf_platform` | — |
//! | [`context`] | typed object contexts: the device's shell state (`kmdf_platform::context`) and a user request's prepared request | — |
//!
//! What this shell does the same as the bus filter's (spin lock, IRQL,
//! event, `WDFREQUEST`, UTF-16 strings, typed contexts, interface
//! references, `WdfDriverCreate`) is the `kmdf-platform` crate's, linked
//! into both images.
//!
//! `probe.c` (C, compiled by `build.rs` with `cc`) holds the two calls
//! that raise SEH exceptions, under `__try`.
//!
//! Rules: every `unsafe` block holds one unsafe operation and carries a
//! `// SAFETY:` comment; nothing here decides anything the core could.

pub mod context;
pub mod device;
pub mod driver;
pub mod file;
pub mod interface;
pub mod interrupt;
pub mod platform;
pub mod queue;

#[cfg(not(test))]
#[global_allocator]
static GLOBAL_ALLOCATOR: wdk_alloc::WdkAllocator = wdk_alloc::WdkAllocator;
