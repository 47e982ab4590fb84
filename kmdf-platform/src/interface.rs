//! The reference glue of a driver-defined interface (`INTERFACE`'s
//! `InterfaceReference`/`InterfaceDereference`) whose context is the
//! pointer of an `Arc` of a device's shell state: each reference pins the
//! shell (a strong count) and the device object (a tagged WDF object
//! reference), so neither goes while a consumer holds the interface. And
//! the registration of an interface with the framework
//! ([`add_query_interface`]).

use alloc::sync::Arc;
use core::ffi::{CStr, c_void};

use wdk_sys::{
    FALSE, GUID, LONG, NTSTATUS, PFN_WDF_DEVICE_PROCESS_QUERY_INTERFACE_REQUEST, PINTERFACE, TRUE,
    ULONG, WDF_QUERY_INTERFACE_CONFIG, WDFDEVICE, WDFOBJECT, call_unsafe_wdf_function_binding,
};

/// Shell state an interface's context points at.
pub trait InterfaceOwner: Send + Sync + 'static {
    /// The device object the interface is exposed on.
    fn device(&self) -> WDFDEVICE;
}

/// The file name the framework's reference tracking records (its
/// `WdfObjectReference` macro passes `__FILE__`).
const REFERENCE_SOURCE: &CStr = c"kmdf-platform/src/interface.rs";

/// `InterfaceReference`: pins the shell and the device object. Callable at
/// DISPATCH_LEVEL or below.
///
/// # Safety
/// `context` is the pointer of an `Arc<T>` (`Arc::into_raw`) kept alive
/// by the device's context or an earlier reference.
pub unsafe extern "system" fn interface_reference<T: InterfaceOwner>(context: *mut c_void) {
    let shell = context.cast_const().cast::<T>();
    // SAFETY: `context` is an `Arc<T>` pointer kept alive by the device
    // context or an earlier reference (caller); this takes one more.
    unsafe { Arc::increment_strong_count(shell) };
    // SAFETY: the shell is alive (just referenced).
    let device = unsafe { (*shell).device() };
    // SAFETY: the device is alive: the framework calls this while handing
    // out the interface, a consumer while it holds a reference. The tag
    // pairs it with `interface_dereference`'s.
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfObjectReferenceActual,
            device as WDFOBJECT,
            context,
            line!() as LONG,
            REFERENCE_SOURCE.as_ptr()
        )
    };
}

/// `InterfaceDereference`: gives back what [`interface_reference`] took.
///
/// # Safety
/// `context` is the context of an interface reference the consumer holds
/// and gives back now.
pub unsafe extern "system" fn interface_dereference<T: InterfaceOwner>(context: *mut c_void) {
    let shell = context.cast_const().cast::<T>();
    // SAFETY: the consumer still holds the references this gives back.
    let device = unsafe { (*shell).device() };
    // SAFETY: a reference `interface_reference` took, with its tag.
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfObjectDereferenceActual,
            device as WDFOBJECT,
            context,
            line!() as LONG,
            REFERENCE_SOURCE.as_ptr()
        )
    };
    // SAFETY: gives back the strong reference `interface_reference` took;
    // nothing touches the shell after it.
    unsafe { Arc::decrement_strong_count(shell) };
}

/// `WdfDeviceAddQueryInterface`: `device` answers `IRP_MN_QUERY_INTERFACE`
/// for `guid` with a copy of `interface` (the framework copies the
/// structure at registration, and copies it again to each requester after
/// `process`, if any, accepted it), or forwards the query to the parent's
/// stack when `send_to_parent` (then only the header is read). Not an
/// import: the framework calls the table's `InterfaceReference`.
///
/// # Safety
/// `device` is a live device, in its add-device or child-creation
/// callback; `interface` points at an `INTERFACE`-headed structure as long
/// as its header's `Size` says, valid for the call.
pub unsafe fn add_query_interface(
    device: WDFDEVICE,
    interface: PINTERFACE,
    guid: *const GUID,
    send_to_parent: bool,
    process: PFN_WDF_DEVICE_PROCESS_QUERY_INTERFACE_REQUEST,
) -> NTSTATUS {
    let mut config = WDF_QUERY_INTERFACE_CONFIG {
        Size: size_of::<WDF_QUERY_INTERFACE_CONFIG>() as ULONG,
        Interface: interface,
        InterfaceType: guid,
        SendQueryToParentStack: if send_to_parent { TRUE } else { FALSE } as u8,
        EvtDeviceProcessQueryInterfaceRequest: process,
        ImportInterface: FALSE as u8,
    };
    // SAFETY: a live device; the config and the interface are valid for
    // the call (caller).
    unsafe { call_unsafe_wdf_function_binding!(WdfDeviceAddQueryInterface, device, &mut config) }
}
