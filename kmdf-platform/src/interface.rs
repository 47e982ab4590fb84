//! The reference glue of a driver-defined interface (`INTERFACE`'s
//! `InterfaceReference`/`InterfaceDereference`) whose context is the
//! pointer of an `Arc` of a device's shell state: each reference pins the
//! shell (a strong count) and the device object (a tagged WDF object
//! reference), so neither goes while a consumer holds the interface.

use alloc::sync::Arc;
use core::ffi::{CStr, c_void};

use wdk_sys::{LONG, WDFDEVICE, WDFOBJECT, call_unsafe_wdf_function_binding};

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
