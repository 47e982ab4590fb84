//! Typed object context: the framework allocates it (zeroed) with the
//! device object and hands it back by handle; it holds one strong
//! reference to the device's [`DeviceShell`], given back in the device's
//! cleanup callback.
//!
//! WDF's `WDF_DECLARE_CONTEXT_TYPE` is a C macro; windows-drivers-rs does
//! not generate it, so the type-info record is declared by hand here
//! (one static per context type, its `UniqueType` pointing at itself).
//!
//! # Invariants
//! `DeviceContext::shell` is null or the pointer of an `Arc<DeviceShell>`
//! made by `Arc::into_raw`, owned by the context until cleanup.

use alloc::boxed::Box;
use alloc::sync::Arc;
use core::ptr;

use wdk_sys::{
    _WDF_EXECUTION_LEVEL, _WDF_SYNCHRONIZATION_SCOPE, WDF_OBJECT_ATTRIBUTES,
    WDF_OBJECT_CONTEXT_TYPE_INFO, WDFDEVICE, WDFOBJECT, WDFREQUEST,
    call_unsafe_wdf_function_binding,
};

use super::device::DeviceShell;
use super::platform::WdfPlatform;
use hca_miniport_core::verbs::PreparedUserRequest;

/// The device object's context.
#[derive(Debug)]
#[repr(C)]
pub struct DeviceContext {
    /// The shell state (see the module's invariants).
    pub shell: *const DeviceShell,
}

/// The type-info record of [`DeviceContext`].
#[derive(Debug)]
#[repr(transparent)]
pub struct ContextTypeInfo(WDF_OBJECT_CONTEXT_TYPE_INFO);

// SAFETY: the record is immutable after its static initialisation; the
// raw pointers in it point at static data.
unsafe impl Sync for ContextTypeInfo {}

/// `WDF_DECLARE_CONTEXT_TYPE(DeviceContext)`.
pub static DEVICE_CONTEXT_TYPE: ContextTypeInfo = ContextTypeInfo(WDF_OBJECT_CONTEXT_TYPE_INFO {
    Size: size_of::<WDF_OBJECT_CONTEXT_TYPE_INFO>() as u32,
    ContextName: c"DeviceContext".as_ptr(),
    ContextSize: size_of::<DeviceContext>(),
    UniqueType: ptr::addr_of!(DEVICE_CONTEXT_TYPE).cast::<WDF_OBJECT_CONTEXT_TYPE_INFO>(),
    EvtDriverGetUniqueContextType: None,
});

/// `WDF_OBJECT_ATTRIBUTES_INIT`: the size set, execution level and
/// synchronization scope inherited from the parent, everything else zero.
/// A zeroed structure is not this: its level and scope are the *invalid*
/// enumerators (0), and the framework refuses to create the object.
/// Every attribute structure of the shell starts here.
pub fn object_attributes() -> WDF_OBJECT_ATTRIBUTES {
    WDF_OBJECT_ATTRIBUTES {
        Size: size_of::<WDF_OBJECT_ATTRIBUTES>() as u32,
        ExecutionLevel: _WDF_EXECUTION_LEVEL::WdfExecutionLevelInheritFromParent,
        SynchronizationScope: _WDF_SYNCHRONIZATION_SCOPE::WdfSynchronizationScopeInheritFromParent,
        ..WDF_OBJECT_ATTRIBUTES::default()
    }
}

/// Object attributes that give a device object a [`DeviceContext`] and the
/// cleanup callback that releases it.
pub fn device_attributes() -> WDF_OBJECT_ATTRIBUTES {
    WDF_OBJECT_ATTRIBUTES {
        ContextTypeInfo: &DEVICE_CONTEXT_TYPE.0,
        EvtCleanupCallback: Some(evt_device_cleanup),
        ..object_attributes()
    }
}

/// The context of `device`, or null if it has none.
///
/// # Safety
/// `device` is a live framework device object.
pub unsafe fn device_context(device: WDFDEVICE) -> *mut DeviceContext {
    // SAFETY: the caller guarantees `device` is live; the type info is the
    // static the device was created with.
    let raw = unsafe {
        call_unsafe_wdf_function_binding!(
            WdfObjectGetTypedContextWorker,
            device as WDFOBJECT,
            DEVICE_CONTEXT_TYPE.0.UniqueType
        )
    };
    raw.cast::<DeviceContext>()
}

/// A strong reference to `device`'s shell state, if it has one.
///
/// # Safety
/// `device` is a live framework device object created with
/// [`device_attributes`].
pub unsafe fn shell_of(device: WDFDEVICE) -> Option<Arc<DeviceShell>> {
    // SAFETY: forwarded from the caller.
    let context = unsafe { device_context(device) };
    if context.is_null() {
        return None;
    }
    // SAFETY: the framework allocated the context with the device and keeps
    // it until the device is deleted, which cannot happen during a callback
    // on it.
    let shell = unsafe { (*context).shell };
    if shell.is_null() {
        return None;
    }
    // SAFETY: per the module's invariants `shell` came from `Arc::into_raw`
    // and the context still owns that reference; this takes one more.
    unsafe { Arc::increment_strong_count(shell) };
    // SAFETY: the count taken just above is the one this `Arc` owns.
    Some(unsafe { Arc::from_raw(shell) })
}

/// `EvtCleanupCallback` of the device object: gives the context's
/// reference back.
unsafe extern "C" fn evt_device_cleanup(object: WDFOBJECT) {
    // SAFETY: the framework calls cleanup on a device created with
    // [`device_attributes`], before freeing its context.
    let context = unsafe { device_context(object as WDFDEVICE) };
    if context.is_null() {
        return;
    }
    // SAFETY: as in `shell_of`; cleanup runs once, after every other
    // callback on the device.
    let shell = unsafe { core::mem::replace(&mut (*context).shell, ptr::null()) };
    if !shell.is_null() {
        // SAFETY: the reference the context owned (module invariants).
        drop(unsafe { Arc::from_raw(shell) });
    }
}

/// What a user request's `EvtIoInCallerContext` took from its process.
pub type Prepared = PreparedUserRequest<WdfPlatform>;

/// A user-mode request's context: what `EvtIoInCallerContext` prepared in
/// the requesting process (`queue::evt_io_in_caller_context`,
/// `Hca::prepare_user_request`). Allocated (zeroed) on the request there;
/// the queue's handler takes the prepared request out; the context's
/// cleanup callback frees one never taken (the request completed or
/// cancelled while queued), so its locks are released.
///
/// # Invariants
/// `prepared` is null or the pointer of a `Box<Prepared>` made by
/// `Box::into_raw`, owned by the context until taken or cleaned up.
#[derive(Debug)]
#[repr(C)]
pub struct RequestContext {
    /// The prepared request, or null.
    pub prepared: *mut Prepared,
}

/// `WDF_DECLARE_CONTEXT_TYPE(RequestContext)`.
pub static REQUEST_CONTEXT_TYPE: ContextTypeInfo = ContextTypeInfo(WDF_OBJECT_CONTEXT_TYPE_INFO {
    Size: size_of::<WDF_OBJECT_CONTEXT_TYPE_INFO>() as u32,
    ContextName: c"RequestContext".as_ptr(),
    ContextSize: size_of::<RequestContext>(),
    UniqueType: ptr::addr_of!(REQUEST_CONTEXT_TYPE).cast::<WDF_OBJECT_CONTEXT_TYPE_INFO>(),
    EvtDriverGetUniqueContextType: None,
});

/// Attributes for `WdfObjectAllocateContext` of a [`RequestContext`],
/// with the cleanup callback that frees a prepared request never taken.
pub fn request_context_attributes() -> WDF_OBJECT_ATTRIBUTES {
    WDF_OBJECT_ATTRIBUTES {
        ContextTypeInfo: &REQUEST_CONTEXT_TYPE.0,
        EvtCleanupCallback: Some(evt_request_cleanup),
        ..object_attributes()
    }
}

/// Takes the prepared request out of `request`'s context, if it has one.
///
/// # Safety
/// `request` is a live request the driver owns.
pub unsafe fn take_prepared(request: WDFREQUEST) -> Option<Prepared> {
    // SAFETY: forwarded from the caller.
    let context = unsafe { request_context(request) };
    if context.is_null() {
        return None;
    }
    // SAFETY: the framework keeps the context with the live request; the
    // driver owns the request, so nothing else touches the context now.
    let prepared = unsafe { core::mem::replace(&mut (*context).prepared, ptr::null_mut()) };
    if prepared.is_null() {
        return None;
    }
    // SAFETY: per the type's invariants `prepared` came from
    // `Box::into_raw` and the context owned it until the swap above.
    Some(*unsafe { Box::from_raw(prepared) })
}

/// `EvtCleanupCallback` of a request's [`RequestContext`]: frees a
/// prepared request the queue's handler never took (its unused locks are
/// released; a doorbell page it mapped is parked for the process's
/// cleanup).
unsafe extern "C" fn evt_request_cleanup(object: WDFOBJECT) {
    // SAFETY: the framework calls cleanup on the request the context was
    // allocated on, before freeing the context.
    drop(unsafe { take_prepared(object as WDFREQUEST) });
}

/// The context of `request`, or null if none was allocated (a kernel
/// request).
///
/// # Safety
/// `request` is a live request the driver owns.
pub unsafe fn request_context(request: WDFREQUEST) -> *mut RequestContext {
    // SAFETY: the caller guarantees `request` is live; the type info is
    // the static the context was allocated with.
    let raw = unsafe {
        call_unsafe_wdf_function_binding!(
            WdfObjectGetTypedContextWorker,
            request as WDFOBJECT,
            REQUEST_CONTEXT_TYPE.0.UniqueType
        )
    };
    raw.cast::<RequestContext>()
}
