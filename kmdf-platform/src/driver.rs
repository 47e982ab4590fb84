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

/// The kernel types [`driver_entry!`](crate::driver_entry) names, for the
/// shells that expand it.
#[doc(hidden)]
pub use wdk_sys::{
    DRIVER_OBJECT as DriverObject, NTSTATUS as Status, PCUNICODE_STRING as RegistryPath,
};

/// Defines the image's `DriverEntry` (the symbol the kernel loader calls):
/// [`create_driver`] with `$device_add` as `EvtDriverDeviceAdd`. Expanded
/// once per driver image, in its shell.
#[macro_export]
macro_rules! driver_entry {
    ($device_add:path) => {
        /// `DriverEntry`: the framework driver object, with this driver's
        /// `EvtDriverDeviceAdd`.
        ///
        /// # Safety
        /// Called once by the I/O manager with its driver object and
        /// registry path.
        // SAFETY: "DriverEntry" is the symbol the kernel loader calls;
        // nothing else in the image exports it.
        #[unsafe(export_name = "DriverEntry")]
        pub unsafe extern "system" fn driver_entry(
            driver: &mut $crate::driver::DriverObject,
            registry_path: $crate::driver::RegistryPath,
        ) -> $crate::driver::Status {
            // SAFETY: the loader's driver object and registry path, once.
            unsafe { $crate::driver::create_driver(driver, registry_path, Some($device_add)) }
        }
    };
}
