//! The device's default I/O queue: parallel, power-managed (the framework
//! holds requests while the device is below D0 and delivers them on its
//! return, as the design asks). Every device control request — from user
//! mode through the bus filter's proxy, or internal from a kernel client —
//! goes to `Hca::submit_request`, which decodes the verb code and answers.

use driver_platform::{NtStatus, RequestorMode};
use wdk_sys::{
    _MODE, _WDF_IO_QUEUE_DISPATCH_TYPE, _WDF_TRI_STATE, NTSTATUS, TRUE, ULONG, WDF_IO_QUEUE_CONFIG,
    WDF_NO_OBJECT_ATTRIBUTES, WDFDEVICE, WDFQUEUE, WDFREQUEST, call_unsafe_wdf_function_binding,
};

use super::context::shell_of;
use super::platform::WdfRequest;

/// `STATUS_DEVICE_NOT_READY`.
const DEVICE_NOT_READY: NtStatus = NtStatus::from_raw(0xC000_00A3);

/// Creates the default queue of `device`.
///
/// # Safety
/// `device` is the live device `EvtDriverDeviceAdd` just created.
pub unsafe fn create_queue(device: WDFDEVICE) -> NTSTATUS {
    let mut config = WDF_IO_QUEUE_CONFIG {
        Size: size_of::<WDF_IO_QUEUE_CONFIG>() as ULONG,
        PowerManaged: _WDF_TRI_STATE::WdfUseDefault,
        DefaultQueue: TRUE as u8,
        DispatchType: _WDF_IO_QUEUE_DISPATCH_TYPE::WdfIoQueueDispatchParallel,
        EvtIoDeviceControl: Some(evt_io_device_control),
        EvtIoInternalDeviceControl: Some(evt_io_device_control),
        ..WDF_IO_QUEUE_CONFIG::default()
    };
    let mut queue: WDFQUEUE = core::ptr::null_mut();
    // SAFETY: a live device (caller); out pointer valid.
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfIoQueueCreate,
            device,
            &mut config,
            WDF_NO_OBJECT_ATTRIBUTES,
            &mut queue
        )
    }
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
        WdfRequest::complete_raw(request, DEVICE_NOT_READY);
        return;
    };
    // SAFETY: the driver owns the delivered request.
    let mode = unsafe { call_unsafe_wdf_function_binding!(WdfRequestGetRequestorMode, request) };
    let mode = if mode == _MODE::UserMode as i8 {
        RequestorMode::User
    } else {
        RequestorMode::Kernel
    };
    // SAFETY: the driver owns the request; this stack's IOCTLs are
    // METHOD_BUFFERED (ib_types::ioctl).
    match unsafe { WdfRequest::new(request, code, mode) } {
        Ok(request) => hca.submit_request(request),
        Err(request) => WdfRequest::complete_raw(request, NtStatus::from_raw(0xC000_009A)),
    }
}
