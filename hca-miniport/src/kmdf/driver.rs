//! `DriverEntry` and `EvtDriverDeviceAdd`: the driver object, then per HCA
//! function a device object with its context, PnP/power callbacks, the
//! default I/O queue, the DMA enabler, the work item and timer, and the CI
//! interface registered for `IRP_MN_QUERY_INTERFACE`.

use alloc::boxed::Box;
use alloc::sync::Arc;
use core::ffi::c_void;
use core::ptr;

// The largest single DMA transfer the enabler describes (one scatter/gather
// list), shared with the simulated shell.
use hca_miniport_core::mr::MAX_DMA_TRANSFER;
use ib_types::interface::{CiInterface, GUID_IB_CI_INTERFACE};
use kmdf_platform::context::{install, object_attributes};
use kmdf_platform::device::{pnp_power_callbacks, set_pnp_power_callbacks};
use kmdf_platform::interface::add_query_interface;
use wdk_sys::{
    _WDF_DMA_PROFILE, FALSE, FILE_64_BYTE_ALIGNMENT, GUID, LPGUID, NTSTATUS, PINTERFACE, PVOID,
    PWDFDEVICE_INIT, STATUS_NOT_SUPPORTED, STATUS_SUCCESS, ULONG, WDF_DMA_ENABLER_CONFIG,
    WDF_NO_OBJECT_ATTRIBUTES, WDF_OBJECT_ATTRIBUTES, WDF_PNPPOWER_EVENT_CALLBACKS,
    WDF_TIMER_CONFIG, WDF_WORKITEM_CONFIG, WDFDEVICE, WDFDMAENABLER, WDFDRIVER, WDFOBJECT,
    WDFTIMER, WDFWORKITEM, call_unsafe_wdf_function_binding,
};

use super::context::{device_attributes, shell_of};
use super::device::{
    DeviceShell, evt_d0_entry, evt_d0_entry_post_interrupts, evt_d0_exit,
    evt_d0_exit_pre_interrupts, evt_prepare_hardware, evt_release_hardware, evt_surprise_removal,
};
use super::file::set_file_object_config;
use super::interface::{accepts, ci_interface, fill_identity};
use super::interrupt::{evt_timer, evt_work_item};
use super::platform::WdfDma;
use super::queue::{create_queue, evt_io_in_caller_context};

/// The device's DMA alignment requirement (`FILE_*_ALIGNMENT`: bytes minus
/// one): rings are 64-byte aligned (PRM), the strictest requirement on a
/// structure inside a common buffer; tables and the command queue, 4 KiB
/// aligned, are whole common buffers, which start on a page.
const DMA_ALIGNMENT_REQUIREMENT: ULONG = FILE_64_BYTE_ALIGNMENT;

kmdf_platform::driver_entry!(evt_driver_device_add);

/// `EvtDriverDeviceAdd`.
unsafe extern "C" fn evt_driver_device_add(
    _driver: WDFDRIVER,
    mut device_init: PWDFDEVICE_INIT,
) -> NTSTATUS {
    let pnp = WDF_PNPPOWER_EVENT_CALLBACKS {
        EvtDevicePrepareHardware: Some(evt_prepare_hardware),
        EvtDeviceReleaseHardware: Some(evt_release_hardware),
        EvtDeviceD0Entry: Some(evt_d0_entry),
        EvtDeviceD0EntryPostInterruptsEnabled: Some(evt_d0_entry_post_interrupts),
        EvtDeviceD0ExitPreInterruptsDisabled: Some(evt_d0_exit_pre_interrupts),
        EvtDeviceD0Exit: Some(evt_d0_exit),
        EvtDeviceSurpriseRemoval: Some(evt_surprise_removal),
        ..pnp_power_callbacks()
    };
    // SAFETY: the framework's live init structure, before WdfDeviceCreate.
    unsafe { set_pnp_power_callbacks(device_init, pnp) };

    // User-mode requests pass through the caller's context first, where
    // their process is recorded (`queue::evt_io_in_caller_context`).
    // SAFETY: the framework's live init structure, before WdfDeviceCreate.
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfDeviceInitSetIoInCallerContextCallback,
            device_init,
            Some(evt_io_in_caller_context)
        )
    };

    // A process's last handle closes its user contexts (`file`).
    // SAFETY: the framework's live init structure, before WdfDeviceCreate.
    unsafe { set_file_object_config(device_init) };

    let mut attributes = device_attributes();
    let mut device: WDFDEVICE = ptr::null_mut();
    // SAFETY: the init structure is consumed on success (the framework
    // frees it); out pointer valid.
    let status = unsafe {
        call_unsafe_wdf_function_binding!(
            WdfDeviceCreate,
            &mut device_init,
            &mut attributes,
            &mut device
        )
    };
    if status < 0 {
        return status;
    }

    // Before the DMA enabler, which takes the device's alignment
    // requirement when it is created (WdfDeviceSetAlignmentRequirement).
    // SAFETY: the live device just created.
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfDeviceSetAlignmentRequirement,
            device,
            DMA_ALIGNMENT_REQUIREMENT
        )
    };
    let dma = match create_dma_enabler(device) {
        // SAFETY: the live device just created, and its enabler.
        Ok(enabler) => unsafe { WdfDma::new(enabler, device) },
        Err(status) => return status,
    };
    let work_item = match create_work_item(device) {
        Ok(item) => item,
        Err(status) => return status,
    };
    let timer = match create_timer(device) {
        Ok(timer) => timer,
        Err(status) => return status,
    };
    let shell = Arc::new(DeviceShell::new(device, dma, work_item, timer));
    // The interface's context: kept alive by the reference the device's
    // context owns from here on.
    let shell_ptr = Arc::as_ptr(&shell);
    // SAFETY: the device just created with `device_attributes`; its zeroed
    // context takes ownership of the reference (released by its cleanup
    // callback).
    if !unsafe { install(device as WDFOBJECT, shell) } {
        return STATUS_NOT_SUPPORTED;
    }

    // SAFETY: the live device just created.
    let status = unsafe { create_queue(device) };
    if status < 0 {
        return status;
    }
    register_ci_interface(device, shell_ptr)
}

fn create_dma_enabler(device: WDFDEVICE) -> Result<WDFDMAENABLER, NTSTATUS> {
    let mut config = WDF_DMA_ENABLER_CONFIG {
        Size: size_of::<WDF_DMA_ENABLER_CONFIG>() as ULONG,
        Profile: _WDF_DMA_PROFILE::WdfDmaProfileScatterGather64Duplex,
        MaximumLength: MAX_DMA_TRANSFER,
        ..WDF_DMA_ENABLER_CONFIG::default()
    };
    let mut enabler: WDFDMAENABLER = ptr::null_mut();
    // SAFETY: a live device in EvtDriverDeviceAdd; out pointer valid.
    let status = unsafe {
        call_unsafe_wdf_function_binding!(
            WdfDmaEnablerCreate,
            device,
            &mut config,
            WDF_NO_OBJECT_ATTRIBUTES,
            &mut enabler
        )
    };
    if status < 0 { Err(status) } else { Ok(enabler) }
}

/// `WDF_OBJECT_ATTRIBUTES_INIT` with `device` as the parent (the work item
/// and timer must have their device as parent).
fn parented_to(device: WDFDEVICE) -> WDF_OBJECT_ATTRIBUTES {
    WDF_OBJECT_ATTRIBUTES {
        ParentObject: device as WDFOBJECT,
        ..object_attributes()
    }
}

fn create_work_item(device: WDFDEVICE) -> Result<WDFWORKITEM, NTSTATUS> {
    let mut config = WDF_WORKITEM_CONFIG {
        Size: size_of::<WDF_WORKITEM_CONFIG>() as ULONG,
        EvtWorkItemFunc: Some(evt_work_item),
        AutomaticSerialization: FALSE as u8,
    };
    let mut attributes = parented_to(device);
    let mut item: WDFWORKITEM = ptr::null_mut();
    // SAFETY: valid config and attributes; out pointer valid.
    let status = unsafe {
        call_unsafe_wdf_function_binding!(
            WdfWorkItemCreate,
            &mut config,
            &mut attributes,
            &mut item
        )
    };
    if status < 0 { Err(status) } else { Ok(item) }
}

fn create_timer(device: WDFDEVICE) -> Result<WDFTIMER, NTSTATUS> {
    let mut config = WDF_TIMER_CONFIG {
        Size: size_of::<WDF_TIMER_CONFIG>() as ULONG,
        EvtTimerFunc: Some(evt_timer),
        Period: 0,
        AutomaticSerialization: FALSE as u8,
        ..WDF_TIMER_CONFIG::default()
    };
    let mut attributes = parented_to(device);
    let mut timer: WDFTIMER = ptr::null_mut();
    // SAFETY: valid config and attributes; out pointer valid.
    let status = unsafe {
        call_unsafe_wdf_function_binding!(WdfTimerCreate, &mut config, &mut attributes, &mut timer)
    };
    if status < 0 { Err(status) } else { Ok(timer) }
}

/// `GUID_IB_CI_INTERFACE` as a Windows `GUID`, in static storage: the
/// query-interface configuration points at it.
static CI_INTERFACE_GUID: GUID = GUID {
    Data1: GUID_IB_CI_INTERFACE.data1.get(),
    Data2: GUID_IB_CI_INTERFACE.data2.get(),
    Data3: GUID_IB_CI_INTERFACE.data3.get(),
    Data4: GUID_IB_CI_INTERFACE.data4,
};

/// `WdfDeviceAddQueryInterface` for `GUID_IB_CI_INTERFACE`. The framework
/// copies the table when a consumer asks and calls its
/// `InterfaceReference`.
fn register_ci_interface(device: WDFDEVICE, shell: *const DeviceShell) -> NTSTATUS {
    // The framework copies the structure at registration; a box keeps it
    // in non-paged pool for the call.
    let mut table: Box<CiInterface> = Box::new(ci_interface(shell));
    let guid: *const GUID = &CI_INTERFACE_GUID;
    // SAFETY: a live device; the table is valid for the call.
    unsafe {
        add_query_interface(
            device,
            ptr::addr_of_mut!(table.header).cast::<c_void>() as PINTERFACE,
            guid,
            false,
            Some(evt_process_query_interface),
        )
    }
}

/// `EvtDeviceProcessQueryInterfaceRequest`: refuses a requester whose
/// structure is too small or whose version this provider does not
/// satisfy, and fills the started device's identity into its copy.
/// (Which size and version the framework leaves in `exposed` at this point
/// — the requester's or ours — is to be confirmed on the first Windows
/// build; both are checked against what this provider serves.)
unsafe extern "C" fn evt_process_query_interface(
    device: WDFDEVICE,
    _interface_type: LPGUID,
    exposed: PINTERFACE,
    _specific: PVOID,
) -> NTSTATUS {
    if exposed.is_null() {
        return STATUS_NOT_SUPPORTED;
    }
    let table = exposed.cast::<CiInterface>();
    // SAFETY: `exposed` is the requester's INTERFACE-headed buffer, at
    // least an INTERFACE long.
    let header = unsafe { (*table).header };
    if !accepts(header.size, header.version) {
        return STATUS_NOT_SUPPORTED;
    }
    // SAFETY: the live device the query was sent to.
    if let Some(shell) = unsafe { shell_of(device) } {
        // SAFETY: `accepts` checked the buffer holds a whole CiInterface.
        fill_identity(unsafe { &mut *table }, &shell);
    }
    STATUS_SUCCESS
}
