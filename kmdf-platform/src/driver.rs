//! `DriverEntry`'s one job in a KMDF driver: creating the framework
//! driver object with the driver's `EvtDriverDeviceAdd`.

use wdk_sys::{
    DRIVER_OBJECT, NTSTATUS, PCUNICODE_STRING, PFN_WDF_DRIVER_DEVICE_ADD, ULONG, WDF_DRIVER_CONFIG,
    WDF_NO_HANDLE, WDF_NO_OBJECT_ATTRIBUTES, WDFDRIVER, call_unsafe_wdf_function_binding,
};

/// `WdfDriverCreate` with `device_add` as `EvtDriverDeviceAdd`, no object
/// attributes and no handle wanted: what a shell's `DriverEntry` returns.
///
/// # Safety
/// Called once, from `DriverEntry`, with the loader's driver object and
/// registry path.
pub unsafe fn create_driver(
    driver: &mut DRIVER_OBJECT,
    registry_path: PCUNICODE_STRING,
    device_add: PFN_WDF_DRIVER_DEVICE_ADD,
) -> NTSTATUS {
    let mut config = WDF_DRIVER_CONFIG {
        Size: size_of::<WDF_DRIVER_CONFIG>() as ULONG,
        EvtDriverDeviceAdd: device_add,
        ..WDF_DRIVER_CONFIG::default()
    };
    let handle = WDF_NO_HANDLE as *mut WDFDRIVER;
    // SAFETY: the loader's driver object and registry path, once (the
    // caller's contract).
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfDriverCreate,
            driver as *mut DRIVER_OBJECT,
            registry_path,
            WDF_NO_OBJECT_ATTRIBUTES,
            &mut config,
            handle
        )
    }
}
