//! The device's default I/O queue: parallel, power-managed (the framework
//! holds requests while the device is below D0 and delivers them on its
//! return, as the design asks), and the device's `EvtIoInCallerContext`
//! in front of it.
//!
//! As the simulated shell (`sim-shells`) does: a user-mode request (from
//! the bus filter's proxy) first passes [`evt_io_in_caller_context`], at
//! PASSIVE_LEVEL in the requesting thread, where the core takes what the
//! verb needs from the process (`Hca::prepare_user_request` with the
//! process as its caller, [`WdfCaller`]: user buffers probed and locked
//! with MDLs, a doorbell page mapped or unmapped); the prepared request
//! is kept in the request's context and the request enqueued. The queue's
//! handler, in whatever context the queue presents it (a request held
//! across a power transition is delivered from another one), gives it to
//! `Hca::execute_user_request`, which uses only what was prepared and
//! never the process's virtual addresses. Every other request — internal,
//! from a kernel client, or a user request with nothing prepared — goes
//! to `Hca::submit_request`.
//!
//! The queue's `EvtIoStop` ([`evt_io_stop`]): when the device leaves D0
//! the framework waits until every request the driver owns is completed or
//! acknowledged. A wait the core holds (`WaitCqEvent`, `GetAsyncEvent`)
//! may pend far longer, so it is acknowledged without requeue and stays
//! pending in the core; every other request finishes on its own
//! (`hca_miniport_core::verbs::on_queue_stop`). No `EvtIoResume`: a kept
//! wait needs nothing on D0 entry.

use alloc::boxed::Box;

use driver_platform::{NtStatus, RequestorMode};
use hca_miniport_core::verbs::{OnQueueStop, on_queue_stop};
use kmdf_platform::queue::default_parallel_queue_config;
use kmdf_platform::request::WdfRequest;
use wdk_sys::{
    _MODE, FALSE, NTSTATUS, PVOID, ULONG, USHORT, WDF_IO_QUEUE_CONFIG, WDF_REQUEST_PARAMETERS,
    WDFDEVICE, WDFOBJECT, WDFQUEUE, WDFREQUEST, call_unsafe_wdf_function_binding,
};

use super::context::{RequestContext, request_context_attributes, shell_of, take_prepared};
use super::platform::{WdfCaller, current_process_id};

/// `STATUS_DEVICE_NOT_READY`.
const DEVICE_NOT_READY: NtStatus = NtStatus::from_raw(0xC000_00A3);

/// Creates the default queue of `device`.
///
/// # Safety
/// `device` is the live device `EvtDriverDeviceAdd` just created.
pub unsafe fn create_queue(device: WDFDEVICE) -> NTSTATUS {
    let config = WDF_IO_QUEUE_CONFIG {
        EvtIoDeviceControl: Some(evt_io_device_control),
        EvtIoInternalDeviceControl: Some(evt_io_device_control),
        EvtIoStop: Some(evt_io_stop),
        ..default_parallel_queue_config()
    };
    // SAFETY: a live device (caller).
    unsafe { kmdf_platform::queue::create_queue(device, config) }
}

/// `EvtIoDeviceControl` and `EvtIoInternalDeviceControl`.
unsafe extern "C" fn evt_io_device_control(
    queue: WDFQUEUE,
    request: WDFREQUEST,
    _output_len: usize,
    _input_len: usize,
    code: ULONG,
) {
    // SAFETY: the framework passes its live queue.
    let device = unsafe { call_unsafe_wdf_function_binding!(WdfIoQueueGetDevice, queue) };
    // SAFETY: the queue's device is ours.
    let Some(hca) = unsafe { shell_of(device) }.and_then(|shell| shell.hca()) else {
        // SAFETY: the driver owns the delivered request.
        unsafe { WdfRequest::complete_raw(request, DEVICE_NOT_READY, 0) };
        return;
    };
    // SAFETY: the driver owns the delivered request.
    let mode = unsafe { call_unsafe_wdf_function_binding!(WdfRequestGetRequestorMode, request) };
    let mode = if mode == _MODE::UserMode as i8 {
        RequestorMode::User
    } else {
        RequestorMode::Kernel
    };
    let prepared = match mode {
        // SAFETY: the driver owns the live request.
        RequestorMode::User => unsafe { take_prepared(request) },
        RequestorMode::Kernel => None,
    };
    // SAFETY: the driver owns the request; this stack's IOCTLs are
    // METHOD_BUFFERED (ib_types::ioctl).
    match (unsafe { WdfRequest::new(request, code, mode) }, prepared) {
        (Ok(request), Some(prepared)) => hca.execute_user_request(request, prepared),
        (Ok(request), None) => hca.submit_request(request),
        // SAFETY: handed back unwrapped: still the driver's.
        (Err(request), _) => unsafe {
            WdfRequest::complete_raw(request, NtStatus::from_raw(0xC000_009A), 0)
        },
    }
}

/// The I/O control code of a device-control request (internal or not).
///
/// # Safety
/// `request` is a live request the driver owns.
unsafe fn ioctl_code(request: WDFREQUEST) -> ULONG {
    // WDF_REQUEST_PARAMETERS_INIT: zeroed, with its size.
    let mut parameters = WDF_REQUEST_PARAMETERS {
        Size: size_of::<WDF_REQUEST_PARAMETERS>() as USHORT,
        ..WDF_REQUEST_PARAMETERS::default()
    };
    // SAFETY: a live request the driver owns (caller); the out pointer is
    // valid and sized.
    unsafe { call_unsafe_wdf_function_binding!(WdfRequestGetParameters, request, &mut parameters) };
    // SAFETY: the device takes only device-control requests (internal or
    // not), whose parameters are the `DeviceIoControl` member (the
    // internal form's code sits at the same place).
    unsafe { parameters.Parameters.DeviceIoControl.IoControlCode }
}

/// `EvtIoStop`: the device leaves D0 (or is removed) while the driver owns
/// `request`. A wait is acknowledged without requeue and stays pending in
/// the core; anything else is left to complete, which the framework waits
/// for.
unsafe extern "C" fn evt_io_stop(_queue: WDFQUEUE, request: WDFREQUEST, _action_flags: ULONG) {
    // SAFETY: the framework passes a live request the driver owns.
    let code = unsafe { ioctl_code(request) };
    if on_queue_stop(code) == OnQueueStop::KeepPending {
        // SAFETY: a live request the driver owns and keeps (no requeue,
        // so it need not be unmarked cancelable first).
        unsafe {
            call_unsafe_wdf_function_binding!(WdfRequestStopAcknowledge, request, FALSE as u8)
        };
    }
}

/// `EvtIoInCallerContext` of the device (registered with
/// `WdfDeviceInitSetIoInCallerContextCallback`): runs at PASSIVE_LEVEL in
/// the thread that sent the request, before any queue. A user-mode
/// request gets a [`RequestContext`] holding what
/// `Hca::prepare_user_request` took from the current process; then every
/// request goes to the default queue.
///
/// # Safety
/// A KMDF callback: called only by the framework, with the live device
/// and a request the driver owns.
pub unsafe extern "C" fn evt_io_in_caller_context(device: WDFDEVICE, request: WDFREQUEST) {
    // SAFETY: the framework passes a live request the driver owns.
    let mode = unsafe { call_unsafe_wdf_function_binding!(WdfRequestGetRequestorMode, request) };
    if mode == _MODE::UserMode as i8 {
        let mut attributes = request_context_attributes();
        let mut context: PVOID = core::ptr::null_mut();
        // SAFETY: a live request; the attributes name the static type
        // info; out pointer valid.
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfObjectAllocateContext,
                request as WDFOBJECT,
                &mut attributes,
                &mut context
            )
        };
        if status < 0 {
            // SAFETY: the driver owns the request (callback contract).
            unsafe { WdfRequest::complete_raw(request, NtStatus::from_raw(status as u32), 0) };
            return;
        }
        if context.is_null() {
            // STATUS_INSUFFICIENT_RESOURCES.
            // SAFETY: as above.
            unsafe { WdfRequest::complete_raw(request, NtStatus::from_raw(0xC000_009A), 0) };
            return;
        }
        // SAFETY: the framework allocated `size_of::<RequestContext>()`
        // zeroed bytes for this request, aligned for it.
        unsafe {
            context.cast::<RequestContext>().write(RequestContext {
                prepared: core::ptr::null_mut(),
            })
        };
        // SAFETY: the framework passes its live device.
        let hca = unsafe { shell_of(device) }.and_then(|shell| shell.hca());
        // SAFETY: a live request the driver owns (callback contract).
        let code = unsafe { ioctl_code(request) };
        // Without the core, the queue's handler refuses the request.
        if let Some(hca) = hca {
            // SAFETY: the driver owns the request; this stack's IOCTLs
            // are METHOD_BUFFERED. The wrapper is a view used to read the
            // request here; the request itself goes on to the queue.
            if let Ok(mut view) = unsafe { WdfRequest::new(request, code, RequestorMode::User) } {
                let caller = WdfCaller::new(current_process_id());
                let prepared = hca.prepare_user_request(&mut view, &caller);
                // SAFETY: the context was written above and belongs to the
                // request the driver owns; it takes the box (type
                // invariants of `RequestContext`).
                unsafe {
                    (*context.cast::<RequestContext>()).prepared =
                        Box::into_raw(Box::new(prepared));
                }
            }
        }
    }
    // SAFETY: a live device and a request the driver owns; on failure the
    // request is still the driver's to complete.
    let status =
        unsafe { call_unsafe_wdf_function_binding!(WdfDeviceEnqueueRequest, device, request) };
    if status < 0 {
        // SAFETY: not enqueued, so still the driver's (see above).
        unsafe { WdfRequest::complete_raw(request, NtStatus::from_raw(status as u32), 0) };
    }
}
