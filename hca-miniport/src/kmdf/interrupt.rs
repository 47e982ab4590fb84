//! The interrupt, its DPC, the work item and the timer: each finds the
//! device's shell through its parent device and calls the core's entry
//! point (`Hca::isr` at DIRQL, `Hca::dpc` and `Hca::timer` at
//! DISPATCH_LEVEL, `Hca::work_item` at PASSIVE_LEVEL).

use wdk_sys::{
    BOOLEAN, FALSE, TRUE, ULONG, WDFDEVICE, WDFINTERRUPT, WDFOBJECT, WDFTIMER, WDFWORKITEM,
    call_unsafe_wdf_function_binding,
};

use super::context::{device_context, shell_of};

/// `EvtInterruptIsr`: acknowledges through the core and queues the DPC
/// when it asks. Touches no ring and calls no client (the core's ISR
/// contract).
///
/// # Safety
/// A KMDF callback: called only by the framework, with its live object
/// of a device `evt_driver_device_add` created.
pub unsafe extern "C" fn evt_interrupt_isr(interrupt: WDFINTERRUPT, message_id: ULONG) -> BOOLEAN {
    // SAFETY: the framework passes its live interrupt object.
    let device: WDFDEVICE =
        unsafe { call_unsafe_wdf_function_binding!(WdfInterruptGetDevice, interrupt) };
    // SAFETY: the interrupt's parent is our live device; `device_context`
    // (`WdfObjectGetTypedContextWorker`) may be called at any IRQL.
    let context = unsafe { device_context(device) };
    if context.is_null() {
        return FALSE as BOOLEAN;
    }
    // SAFETY: the context lives as long as the device; its shell pointer is
    // set before the device can interrupt and cleared only at cleanup.
    let shell = unsafe { (*context).shell };
    if shell.is_null() {
        return FALSE as BOOLEAN;
    }
    // No `Arc` and no lock at DIRQL: a plain reference for the call.
    // SAFETY: the context owns a reference to the shell (see above).
    let shell = unsafe { &*shell };
    if shell.isr(message_id as u16) {
        // SAFETY: the live interrupt object; callable from its ISR.
        let _ = unsafe { call_unsafe_wdf_function_binding!(WdfInterruptQueueDpcForIsr, interrupt) };
    }
    TRUE as BOOLEAN
}

/// `EvtInterruptDpc`: the core's DPC.
///
/// # Safety
/// A KMDF callback: called only by the framework, with its live object
/// of a device `evt_driver_device_add` created.
pub unsafe extern "C" fn evt_interrupt_dpc(interrupt: WDFINTERRUPT, _device: WDFOBJECT) {
    // SAFETY: as in the ISR.
    let device: WDFDEVICE =
        unsafe { call_unsafe_wdf_function_binding!(WdfInterruptGetDevice, interrupt) };
    // SAFETY: as in the ISR.
    if let Some(hca) = unsafe { shell_of(device) }.and_then(|shell| shell.hca()) {
        hca.dpc();
    }
}

/// `EvtWorkItemFunc`: the core's passive work (common buffers).
///
/// # Safety
/// A KMDF callback: called only by the framework, with its live object
/// of a device `evt_driver_device_add` created.
pub unsafe extern "C" fn evt_work_item(work_item: WDFWORKITEM) {
    // SAFETY: the framework passes its live work item, parented to the
    // device.
    let device =
        unsafe { call_unsafe_wdf_function_binding!(WdfWorkItemGetParentObject, work_item) };
    // SAFETY: the parent is our live device.
    if let Some(hca) = unsafe { shell_of(device as WDFDEVICE) }.and_then(|shell| shell.hca()) {
        hca.work_item();
    }
}

/// `EvtTimerFunc`: the core's command watchdog.
///
/// # Safety
/// A KMDF callback: called only by the framework, with its live object
/// of a device `evt_driver_device_add` created.
pub unsafe extern "C" fn evt_timer(timer: WDFTIMER) {
    // SAFETY: the framework passes its live timer, parented to the device.
    let device = unsafe { call_unsafe_wdf_function_binding!(WdfTimerGetParentObject, timer) };
    // SAFETY: the parent is our live device.
    if let Some(hca) = unsafe { shell_of(device as WDFDEVICE) }.and_then(|shell| shell.hca()) {
        hca.timer();
    }
}
