//! The miniport's typed object contexts: the device object's
//! `ShellContext<DeviceShell>` (`kmdf_platform::context`, shared with the
//! bus filter's shell: one strong reference to the device's
//! [`DeviceShell`], given back in the device's cleanup callback) and a
//! user request's [`RequestContext`], each with its
//! `WDF_DECLARE_CONTEXT_TYPE` record.

use alloc::boxed::Box;
use alloc::sync::Arc;
use core::ptr;

use kmdf_platform::context::{
    ContextTypeInfo, Shell, ShellContext, context_of, object_attributes, shell_attributes,
    typed_context,
};
use wdk_sys::{WDF_OBJECT_ATTRIBUTES, WDFDEVICE, WDFOBJECT, WDFREQUEST};

use super::device::DeviceShell;
use super::platform::WdfPlatform;
use hca_miniport_core::verbs::PreparedUserRequest;

/// The device object's context.
pub type DeviceContext = ShellContext<DeviceShell>;

/// `WDF_DECLARE_CONTEXT_TYPE(DeviceContext)`.
pub static DEVICE_CONTEXT_TYPE: ContextTypeInfo = ContextTypeInfo::new(
    c"DeviceContext",
    size_of::<DeviceContext>(),
    ptr::addr_of!(DEVICE_CONTEXT_TYPE),
);

impl Shell for DeviceShell {
    fn type_info() -> &'static ContextTypeInfo {
        &DEVICE_CONTEXT_TYPE
    }
}

/// Object attributes that give a device object a [`DeviceContext`] and the
/// cleanup callback that releases it.
pub fn device_attributes() -> WDF_OBJECT_ATTRIBUTES {
    shell_attributes::<DeviceShell>()
}

/// The context of `device`, or null if it has none. Any IRQL.
///
/// # Safety
/// `device` is a live framework device object.
pub unsafe fn device_context(device: WDFDEVICE) -> *mut DeviceContext {
    // SAFETY: forwarded from the caller.
    unsafe { context_of::<DeviceShell>(device as WDFOBJECT) }
}

/// A strong reference to `device`'s shell state, if it has one.
///
/// # Safety
/// `device` is a live framework device object created with
/// [`device_attributes`].
pub unsafe fn shell_of(device: WDFDEVICE) -> Option<Arc<DeviceShell>> {
    // SAFETY: forwarded from the caller.
    unsafe { kmdf_platform::context::shell_of::<DeviceShell>(device as WDFOBJECT) }
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
pub static REQUEST_CONTEXT_TYPE: ContextTypeInfo = ContextTypeInfo::new(
    c"RequestContext",
    size_of::<RequestContext>(),
    ptr::addr_of!(REQUEST_CONTEXT_TYPE),
);

/// Attributes for `WdfObjectAllocateContext` of a [`RequestContext`],
/// with the cleanup callback that frees a prepared request never taken.
pub fn request_context_attributes() -> WDF_OBJECT_ATTRIBUTES {
    WDF_OBJECT_ATTRIBUTES {
        ContextTypeInfo: REQUEST_CONTEXT_TYPE.as_raw(),
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
    // SAFETY: the caller guarantees `request` is live; `RequestContext` is
    // the type of the record the context was allocated with.
    unsafe { typed_context::<RequestContext>(request as WDFOBJECT, &REQUEST_CONTEXT_TYPE) }
}
