//! The KMDF shell of the IBAL bus filter (Windows only).
//!
//! **Type-checked, never run.** `cargo xtask wdk-check` (in CI) compiles
//! and lints it for `x86_64-pc-windows-msvc` against Microsoft's KMDF 1.33
//! headers and mingw-w64's kernel headers (README, "What is
//! type-checked"); it has never been linked with the real WDK nor run.
//!
//! It is the same shell as `sim_shells::ibal_bus` (the simulated host's),
//! callback for callback, on WDF objects (docs/ibal-bus.md, "The KMDF
//! shell"):
//!
//! | file | WDF | core |
//! |---|---|---|
//! | [`filter`] | `DriverEntry`; `EvtDriverDeviceAdd` (`WdfFdoInitSetFilter`, the default child list, the device interface); prepare-hardware, first D0 entry, self-managed I/O init, release-hardware | `ca_registry` (`OpenedCa`, `BoundCa`, `CaRegistry`), `children` (`read_child_list`, `port_children`, `ChildSet`), `al::AccessLayer` per bound CA |
//! | [`ci`] | the HCA's `CiInterface` from `WdfFdoQueryForInterface`; control verbs as IRPs from `IoAllocateIrp` with a completion routine | `ci::CiAccess`, `al::CiRequests` |
//! | [`child`] | `EvtChildListCreateDevice` (PDO IDs, text, SDDL, power-managed verb queue, `WdfDeviceAddQueryInterface` for the AL interface and, sent to the parent's stack, the bus interface) | `AccessLayer::submit` |
//! | [`al_interface`] | the `AlInterface` FFI table (`extern "system"` entry points) | `al::AccessLayer` |
//! | [`proxy`] | the user-mode proxy: `EvtDeviceFileCreate` / `EvtFileCleanup` / `EvtFileClose` (an `OpenTable` per file object), `EvtIoInCallerContext` (user requests judged in the caller's thread, verbs sent down with a completion routine, the administrator IOCTL checked with `SeAccessCheck` and written to the Parameters key), the default queue (not power-managed, send-and-forget) | `proxy::OpenTable`, `proxy::ChildEntryChange` |
//! | [`platform`] | the Parameters key (read and written) | `driver_platform::Registry` |
//! | [`context`] | the typed object contexts' records (filter and child shells, the proxy's opens) | — |
//!
//! What this shell does the same as the miniport's (spin lock, IRQL,
//! event, `WDFREQUEST`, UTF-16 strings, typed contexts, interface
//! references, `WdfDriverCreate`) is the `kmdf-platform` crate's, linked
//! into both images.
//!
//! Rules: every `unsafe` block holds one unsafe operation and carries a
//! `// SAFETY:` comment; nothing here decides anything the core could.

pub mod al_interface;
pub mod child;
pub mod ci;
pub mod context;
pub mod filter;
pub mod platform;
pub mod proxy;

// Kernel pool allocations (`ExAllocatePool2`) for `alloc`.
#[cfg(not(test))]
#[global_allocator]
static GLOBAL_ALLOCATOR: wdk_alloc::WdkAllocator = wdk_alloc::WdkAllocator;
