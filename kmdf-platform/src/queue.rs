//! I/O queues: the default parallel queue's configuration and its
//! creation, as every shell's queue starts.

use core::ptr;

use wdk_sys::{
    _WDF_IO_QUEUE_DISPATCH_TYPE, _WDF_TRI_STATE, NTSTATUS, TRUE, ULONG, WDF_IO_QUEUE_CONFIG,
    WDF_NO_OBJECT_ATTRIBUTES, WDFDEVICE, WDFQUEUE, call_unsafe_wdf_function_binding,
};

/// `WDF_IO_QUEUE_CONFIG_INIT_DEFAULT_QUEUE(&config,
/// WdfIoQueueDispatchParallel)`: the size, power management left to the
/// framework's default (`WdfUseDefault`: power-managed unless the device is
/// a filter's), the default queue, parallel dispatch with no limit on the
/// requests presented at once. The limit is
/// `Settings.Parallel.NumberOfPresentedRequests`, where 0 is not "no
/// limit" but a queue that presents nothing; the macro sets `(ULONG)-1`.
/// The caller adds its callbacks (and its own power management).
pub fn default_parallel_queue_config() -> WDF_IO_QUEUE_CONFIG {
    let mut config = WDF_IO_QUEUE_CONFIG {
        Size: size_of::<WDF_IO_QUEUE_CONFIG>() as ULONG,
        PowerManaged: _WDF_TRI_STATE::WdfUseDefault,
        DefaultQueue: TRUE as u8,
        DispatchType: _WDF_IO_QUEUE_DISPATCH_TYPE::WdfIoQueueDispatchParallel,
        ..WDF_IO_QUEUE_CONFIG::default()
    };
    config.Settings.Parallel.NumberOfPresentedRequests = ULONG::MAX;
    config
}

/// `WdfIoQueueCreate` of `config` on `device`, with no object attributes
/// (the queue's parent is the device; its handle is not kept: the
/// framework hands it to the callbacks).
///
/// # Safety
/// `device` is a live device, in `EvtDriverDeviceAdd` or
/// `EvtChildListCreateDevice`; PASSIVE_LEVEL.
pub unsafe fn create_queue(device: WDFDEVICE, mut config: WDF_IO_QUEUE_CONFIG) -> NTSTATUS {
    let mut queue: WDFQUEUE = ptr::null_mut();
    // SAFETY: a live device (caller); `config` and the out pointer are
    // valid for the call.
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
