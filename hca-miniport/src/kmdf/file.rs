//! Framework file objects: `EvtDeviceFileCreate` and `EvtFileCleanup`, the
//! same as the simulated shell's `file_create` / `file_cleanup`
//! (`sim_shells::hca_miniport`).
//!
//! Each process's open file objects on the device are counted
//! ([`super::device::DeviceShell::file_opened`]). At the cleanup of a process's last one,
//! which the framework calls in that process's context at PASSIVE_LEVEL,
//! the core closes every user context the process still has
//! (`Hca::close_user_contexts_of`: its waits cancelled, its doorbell pages
//! unmapped, its objects destroyed, its pages unlocked) and the callback
//! waits for it: once the process's handles are gone it may exit, and
//! pages still locked then bugcheck (`PROCESS_HAS_LOCKED_PAGES`, 0x76).

use alloc::boxed::Box;
use alloc::sync::Arc;

use driver_platform::Event;
use ib_types::status::NtStatus;
use kmdf_platform::event::KernelEvent;
use kmdf_platform::request::WdfRequest;
use wdk_sys::{
    _WDF_FILEOBJECT_CLASS, _WDF_TRI_STATE, PWDFDEVICE_INIT, ULONG, WDF_FILEOBJECT_CONFIG,
    WDF_NO_OBJECT_ATTRIBUTES, WDFDEVICE, WDFFILEOBJECT, WDFREQUEST,
    call_unsafe_wdf_function_binding,
};

use super::context::shell_of;
use super::platform::{WdfCaller, current_process_id};

/// Registers the file object callbacks on a device being added
/// (`WDF_FILEOBJECT_CONFIG_INIT` + `WdfDeviceInitSetFileObjectConfig`).
///
/// # Safety
/// `device_init` is the framework's live init structure, before
/// `WdfDeviceCreate`.
pub unsafe fn set_file_object_config(device_init: PWDFDEVICE_INIT) {
    let mut config = WDF_FILEOBJECT_CONFIG {
        Size: size_of::<WDF_FILEOBJECT_CONFIG>() as ULONG,
        EvtDeviceFileCreate: Some(evt_device_file_create),
        EvtFileClose: None,
        EvtFileCleanup: Some(evt_file_cleanup),
        AutoForwardCleanupClose: _WDF_TRI_STATE::WdfUseDefault,
        FileObjectClass: _WDF_FILEOBJECT_CLASS::WdfFileObjectWdfCannotUseFsContexts,
    };
    // SAFETY: the caller's live init structure; the config is complete.
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfDeviceInitSetFileObjectConfig,
            device_init,
            &mut config,
            WDF_NO_OBJECT_ATTRIBUTES
        )
    };
}

/// `EvtDeviceFileCreate`: counts the opening process's file object and
/// completes the create.
unsafe extern "C" fn evt_device_file_create(
    device: WDFDEVICE,
    request: WDFREQUEST,
    _file_object: WDFFILEOBJECT,
) {
    // SAFETY: the framework passes its live device.
    if let Some(shell) = unsafe { shell_of(device) } {
        // In the opening process's context (the framework's contract).
        shell.file_opened(current_process_id());
    }
    // SAFETY: the driver owns the create request; this consumes it.
    unsafe { WdfRequest::complete_raw(request, NtStatus::from_raw(0), 0) };
}

/// `EvtFileCleanup`: at the process's last file object, closes its user
/// contexts and waits (see the module doc).
unsafe extern "C" fn evt_file_cleanup(file_object: WDFFILEOBJECT) {
    // SAFETY: the framework passes a live file object of this device.
    let device = unsafe { call_unsafe_wdf_function_binding!(WdfFileObjectGetDevice, file_object) };
    // SAFETY: the file object's device is ours.
    let Some(shell) = (unsafe { shell_of(device) }) else {
        return;
    };
    let process = current_process_id();
    if !shell.file_cleaned_up(process) {
        return;
    }
    let Some(hca) = shell.hca() else {
        return;
    };
    let closed = Arc::new(KernelEvent::new());
    let set = closed.clone();
    hca.close_user_contexts_of(
        WdfCaller::new(process),
        Box::new(move |_left_open| set.set()),
    );
    closed.wait();
}
