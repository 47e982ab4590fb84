//! The WDF and WDM code both KMDF shells share (Windows only): the
//! miniport's (`hca-miniport/src/kmdf/`) and the bus filter's
//! (`ibal-bus/src/kmdf/`). It is linked into both driver images; on any
//! other host it is empty.
//!
//! **Type-checked, never run.** `cargo xtask wdk-check` compiles and lints
//! it for `x86_64-pc-windows-msvc` with the shells (README, "What is
//! type-checked").
//!
//! | module | what | Windows |
//! |---|---|---|
//! | `device` | `pnp_power_callbacks`, `set_pnp_power_callbacks` | `WDF_PNPPOWER_EVENT_CALLBACKS_INIT`, `WdfDeviceInitSetPnpPowerEventCallbacks` |
//! | `driver` | `driver_entry!` (the image's exported `DriverEntry`), `create_driver` | `WdfDriverCreate` |
//! | `sync` | `KernelSpinLock` (`lock_api::RawMutex`), `SpinLock<T>`, `try_at_dispatch`, `at_dispatch` | `KSPIN_LOCK`, `KeAcquireSpinLockRaiseToDpc`/`KeReleaseSpinLock`, `KeTryToAcquireSpinLockAtDpcLevel` |
//! | `event` | `KeIrql` (`driver_platform::IrqlQuery`), `KernelEvent` (`driver_platform::Event`) | `KeGetCurrentIrql`; a notification `KEVENT` |
//! | `queue` | `default_parallel_queue_config`, `create_queue` | `WDF_IO_QUEUE_CONFIG_INIT_DEFAULT_QUEUE`, `WdfIoQueueCreate` |
//! | `request` | `WdfRequest` (`driver_platform::Request`), `system_buffer` | a `WDFREQUEST` with METHOD_BUFFERED buffers (`WdfRequestRetrieveInputBuffer`/`OutputBuffer`) |
//! | `string` | `WideString` | a counted `UNICODE_STRING` over an owned UTF-16 buffer |
//! | `context` | `ContextTypeInfo`, `declare_context_type!`, `ShellContext<T>` with `install`/`shell_of`/`take` and the cleanup callback, `object_attributes` | `WDF_DECLARE_CONTEXT_TYPE`, `WDF_OBJECT_ATTRIBUTES_INIT`, `WdfObjectGetTypedContextWorker` |
//! | `ffi` | `slice_or_empty`, `slice_checked`: a client's (pointer, count) arrays as slices | — |
//! | `interface` | `interface_reference`/`interface_dereference` for an interface whose context is an `Arc` of a device's shell; `add_query_interface` | `InterfaceReference`/`InterfaceDereference`, `WdfObjectReferenceActual`/`WdfObjectDereferenceActual`; `WdfDeviceAddQueryInterface` |
//!
//! Rules: every `unsafe` block holds one unsafe operation and carries a
//! `// SAFETY:` comment; nothing here decides anything a core could.

#![cfg_attr(windows, no_std)]

#[cfg(windows)]
extern crate alloc;

#[cfg(windows)]
pub mod context;
#[cfg(windows)]
pub mod device;
#[cfg(windows)]
pub mod driver;
#[cfg(windows)]
pub mod event;
#[cfg(windows)]
pub mod ffi;
#[cfg(windows)]
pub mod interface;
#[cfg(windows)]
pub mod queue;
#[cfg(windows)]
pub mod request;
#[cfg(windows)]
pub mod string;
#[cfg(windows)]
pub mod sync;
