//! The user-mode proxy on WDF: the filter's file objects, its
//! `EvtIoInCallerContext` and its default queue (docs/ibal-bus.md, "The
//! user-mode proxy" and "The KMDF shell"). The policy is
//! `ibal_bus_core::proxy`; the callbacks run in the order of the simulated
//! shell's (`sim_shells::ibal_proxy`):
//!
//! - `EvtDeviceFileCreate`: a new [`ProxyOpen`] (an `OpenTable`) as the
//!   file object's context, then the create goes down to the miniport,
//!   which counts the process's opens. A filter that handles creates must
//!   forward them itself (`WDF_FILEOBJECT_CONFIG`: the framework forwards
//!   only the creates of a driver without the callback):
//!   `WdfRequestFormatRequestUsingCurrentType` + `WdfRequestSend` with
//!   `WDF_REQUEST_SEND_OPTION_SEND_AND_FORGET`.
//! - `EvtFileCleanup`: the open's table emptied. Cleanup and close then go
//!   down (`AutoForwardCleanupClose`), where the miniport closes the
//!   process's user contexts at its last open.
//! - `EvtFileClose`: the file object's reference to its open given back
//!   (the context's cleanup callback gives it back otherwise).
//! - `EvtIoInCallerContext` ([`evt_io_in_caller_context`], PASSIVE_LEVEL in
//!   the sending thread for a user-mode request): a kernel-mode request
//!   goes to the default queue unchanged. A user-mode one is judged by its
//!   open's table (`OpenTable::check`): refused ones are completed at
//!   once; the administrator IOCTL is applied here (the Parameters key
//!   written, every filter device reconciled); an accepted verb is sent
//!   down at once from this callback, still in the caller's thread, so the
//!   miniport's own `EvtIoInCallerContext` prepares it in the process; its
//!   completion routine gives the answer to the table
//!   (`OpenTable::complete`) and completes it.
//! - The default queue: parallel and **not power-managed** (KMDF's default
//!   for a filter, set explicitly): its `EvtIoDefault` sends everything
//!   it gets down unchanged, send-and-forget. Holding requests while the
//!   HCA sleeps is the miniport's power-managed queue's job; held here
//!   they would be delivered later in another thread, out of their
//!   process, and the miniport would refuse them.
//!
//! **The administrator check.** The caller is an administrator when an
//! access check (`SeAccessCheck`, with the subject context captured in the
//! caller's thread and the request's requestor mode, `UserMode`) against a
//! descriptor that grants one private right to `BUILTIN\Administrators`
//! only ([`crate::admin_check::ADMINISTRATORS_ONLY`]) grants it. `SeTokenIsAdmin` was not
//! chosen: it answers whether the token *contains* the group, and the
//! filtered token UAC gives an administrator's unelevated programs
//! contains it as a deny-only group, which an access check (and only an
//! access check) refuses to count.

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec;
use alloc::vec::Vec;
use core::ffi::c_void;
use core::ptr;

use driver_platform::{NtStatus, RegValue, Registry, RegistryKey};
use ibal_bus_core::children::{ChildEntry, LIST_VALUE};
use ibal_bus_core::proxy::{
    Checked, ChildEntryChange, Forwarded, IOCTL_IBAL_CHILD_ENTRY, OpenTable,
};
use kmdf_platform::context::{install, shell_attributes, shell_of, take};
use kmdf_platform::queue::default_parallel_queue_config;
use kmdf_platform::request::{Buffer, WdfRequest, system_buffer};
use kmdf_platform::sync::SpinLock;
use wdk_sys::ntddk::{
    SeAccessCheck, SeCaptureSubjectContext, SeLockSubjectContext, SeReleaseSubjectContext,
    SeUnlockSubjectContext,
};
use wdk_sys::{
    _MODE, _WDF_FILEOBJECT_CLASS, _WDF_REQUEST_SEND_OPTIONS_FLAGS, _WDF_REQUEST_TYPE,
    _WDF_TRI_STATE, ACCESS_MASK, GENERIC_MAPPING, NTSTATUS, PWDF_REQUEST_COMPLETION_PARAMS,
    PWDFDEVICE_INIT, SECURITY_SUBJECT_CONTEXT, TRUE, ULONG, USHORT, WDF_FILEOBJECT_CONFIG,
    WDF_IO_QUEUE_CONFIG, WDF_REQUEST_PARAMETERS, WDF_REQUEST_SEND_OPTIONS, WDFCONTEXT, WDFDEVICE,
    WDFFILEOBJECT, WDFIOTARGET, WDFOBJECT, WDFQUEUE, WDFREQUEST, call_unsafe_wdf_function_binding,
};

use super::filter::reconcile_every_filter;

use super::platform::ParametersKey;
use crate::admin_check::{ADMINISTRATORS_ONLY, CHANGE_CHILD_LIST};

/// The values of one entry's subkey (`ibal_bus_core::children`'s layout).
const ENTRY_VALUES: [&str; 5] = [
    "DeviceId",
    "HardwareId",
    "CompatibleId",
    "Description",
    "PartitionKey",
];

/// The proxy's state on one file object (its context): the handles that
/// open created.
#[derive(Debug, Default)]
pub struct ProxyOpen {
    table: SpinLock<OpenTable>,
}

/// An accepted verb on its way down: what its completion routine needs.
struct InFlight {
    open: Arc<ProxyOpen>,
    forwarded: Forwarded,
}

/// Registers the proxy's callbacks on a filter device being added: the
/// file object callbacks and `EvtIoInCallerContext`.
///
/// # Safety
/// `device_init` is the framework's live init structure, before
/// `WdfDeviceCreate`.
pub unsafe fn configure(device_init: PWDFDEVICE_INIT) {
    let mut config = WDF_FILEOBJECT_CONFIG {
        Size: size_of::<WDF_FILEOBJECT_CONFIG>() as ULONG,
        EvtDeviceFileCreate: Some(evt_device_file_create),
        EvtFileClose: Some(evt_file_close),
        EvtFileCleanup: Some(evt_file_cleanup),
        // A filter's default, said explicitly: the miniport below must get
        // the cleanup (it closes the process's contexts) and the close.
        AutoForwardCleanupClose: _WDF_TRI_STATE::WdfTrue,
        // The miniport below shares the FILE_OBJECT: neither may take its
        // FsContext fields.
        FileObjectClass: _WDF_FILEOBJECT_CLASS::WdfFileObjectWdfCannotUseFsContexts,
    };
    let mut attributes = shell_attributes::<ProxyOpen>();
    // SAFETY: the caller's live init structure; the config is complete and
    // the attributes name the static type info.
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfDeviceInitSetFileObjectConfig,
            device_init,
            &mut config,
            &mut attributes
        )
    };
    // SAFETY: as above.
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfDeviceInitSetIoInCallerContextCallback,
            device_init,
            Some(evt_io_in_caller_context)
        )
    };
}

/// Creates the filter device's default queue (see the module doc).
///
/// # Safety
/// `device` is the live filter device `EvtDriverDeviceAdd` just created.
pub unsafe fn create_queue(device: WDFDEVICE) -> NTSTATUS {
    let config = WDF_IO_QUEUE_CONFIG {
        PowerManaged: _WDF_TRI_STATE::WdfFalse,
        EvtIoDefault: Some(evt_io_default),
        ..default_parallel_queue_config()
    };
    // SAFETY: a live device (caller).
    unsafe { kmdf_platform::queue::create_queue(device, config) }
}

/// The device's local I/O target: the miniport below.
///
/// # Safety
/// `device` is a live device.
unsafe fn lower(device: WDFDEVICE) -> WDFIOTARGET {
    // SAFETY: forwarded from the caller.
    unsafe { call_unsafe_wdf_function_binding!(WdfDeviceGetIoTarget, device) }
}

/// Sends `request` down unchanged and forgets it; completes it with the
/// framework's status if it could not be sent.
///
/// # Safety
/// `request` is a live request the driver owns, received on `device`; it
/// is consumed.
unsafe fn send_and_forget(device: WDFDEVICE, request: WDFREQUEST) {
    // SAFETY: a live request the driver owns (caller).
    unsafe { call_unsafe_wdf_function_binding!(WdfRequestFormatRequestUsingCurrentType, request) };
    // WDF_REQUEST_SEND_OPTIONS_INIT(&options, SEND_AND_FORGET).
    let mut options = WDF_REQUEST_SEND_OPTIONS {
        Size: size_of::<WDF_REQUEST_SEND_OPTIONS>() as ULONG,
        Flags: _WDF_REQUEST_SEND_OPTIONS_FLAGS::WDF_REQUEST_SEND_OPTION_SEND_AND_FORGET as ULONG,
        Timeout: 0,
    };
    // SAFETY: a live device (caller).
    let target = unsafe { lower(device) };
    // SAFETY: the formatted request the driver owns; its own target;
    // the options live for the call.
    let sent =
        unsafe { call_unsafe_wdf_function_binding!(WdfRequestSend, request, target, &mut options) };
    if sent == 0 {
        // SAFETY: not sent, so still the driver's.
        let status = unsafe { call_unsafe_wdf_function_binding!(WdfRequestGetStatus, request) };
        // SAFETY: as above; this consumes it.
        unsafe { WdfRequest::complete_raw(request, NtStatus::from_raw(status as u32), 0) };
    }
}

/// `EvtDeviceFileCreate`: the open's table, then the create goes down.
unsafe extern "C" fn evt_device_file_create(
    device: WDFDEVICE,
    request: WDFREQUEST,
    file_object: WDFFILEOBJECT,
) {
    let open = Arc::new(ProxyOpen::default());
    // SAFETY: the framework's new file object (never null for this
    // object class), created with the ProxyOpen attributes; nothing else
    // has seen it yet.
    if file_object.is_null() || !unsafe { install(file_object as WDFOBJECT, open) } {
        // SAFETY: the driver owns the create request; this consumes it.
        unsafe { WdfRequest::complete_raw(request, NtStatus::INSUFFICIENT_RESOURCES, 0) };
        return;
    }
    // SAFETY: the driver owns the create request, received on `device`.
    unsafe { send_and_forget(device, request) };
}

/// `EvtFileCleanup`: the open's table emptied. The objects themselves
/// are destroyed by the miniport, which gets the cleanup next (module doc).
unsafe extern "C" fn evt_file_cleanup(file_object: WDFFILEOBJECT) {
    // SAFETY: the framework passes a live file object of this device,
    // created with the ProxyOpen attributes.
    if let Some(open) = unsafe { shell_of::<ProxyOpen>(file_object as WDFOBJECT) } {
        let forgotten = open.table.lock().clear();
        drop(forgotten);
    }
}

/// `EvtFileClose`: no request can name the file object any more; its
/// reference to the open is given back (completion routines in flight
/// hold their own).
unsafe extern "C" fn evt_file_close(file_object: WDFFILEOBJECT) {
    // SAFETY: the framework passes the live file object once, at close.
    drop(unsafe { take::<ProxyOpen>(file_object as WDFOBJECT) });
}

/// `EvtIoDefault` of the default queue: down, unchanged.
unsafe extern "C" fn evt_io_default(queue: WDFQUEUE, request: WDFREQUEST) {
    // SAFETY: the framework passes its live queue.
    let device = unsafe { call_unsafe_wdf_function_binding!(WdfIoQueueGetDevice, queue) };
    // SAFETY: the driver owns the delivered request, received on `device`.
    unsafe { send_and_forget(device, request) };
}

/// Hands a request back to the framework for the default queue, or
/// completes it with the status it could not be queued with.
///
/// # Safety
/// In `EvtIoInCallerContext`, with a request the driver owns; consumed.
unsafe fn enqueue(device: WDFDEVICE, request: WDFREQUEST) {
    // SAFETY: a live device and a request the driver owns (caller).
    let status =
        unsafe { call_unsafe_wdf_function_binding!(WdfDeviceEnqueueRequest, device, request) };
    if status < 0 {
        // SAFETY: not enqueued, so still the driver's.
        unsafe { WdfRequest::complete_raw(request, NtStatus::from_raw(status as u32), 0) };
    }
}

/// `EvtIoInCallerContext` (see the module doc).
///
/// # Safety
/// A KMDF callback: called only by the framework, with the live filter
/// device and a request the driver owns.
unsafe extern "C" fn evt_io_in_caller_context(device: WDFDEVICE, request: WDFREQUEST) {
    // SAFETY: a live request the driver owns (callback contract).
    let mode = unsafe { call_unsafe_wdf_function_binding!(WdfRequestGetRequestorMode, request) };
    if mode != _MODE::UserMode as i8 {
        // Kernel requests are the access layer's business, not the proxy's.
        // SAFETY: as above.
        unsafe { enqueue(device, request) };
        return;
    }
    // WDF_REQUEST_PARAMETERS_INIT: zeroed, with its size.
    let mut parameters = WDF_REQUEST_PARAMETERS {
        Size: size_of::<WDF_REQUEST_PARAMETERS>() as USHORT,
        ..WDF_REQUEST_PARAMETERS::default()
    };
    // SAFETY: a live request the driver owns; the out pointer is valid and
    // sized.
    unsafe { call_unsafe_wdf_function_binding!(WdfRequestGetParameters, request, &mut parameters) };
    if parameters.Type != _WDF_REQUEST_TYPE::WdfRequestTypeDeviceControl {
        // Only IOCTLs carry verbs; the core refuses any other code the
        // same way (`Refusal::UnknownCode`).
        // SAFETY: the driver owns the request; this consumes it.
        unsafe { WdfRequest::complete_raw(request, NtStatus::INVALID_DEVICE_REQUEST, 0) };
        return;
    }
    // SAFETY: a device-control request, whose parameters are the
    // `DeviceIoControl` member.
    let ioctl = unsafe { parameters.Parameters.DeviceIoControl };
    let (code, output_len) = (ioctl.IoControlCode, ioctl.OutputBufferLength);
    // SAFETY: a live request the driver owns.
    let file = unsafe { call_unsafe_wdf_function_binding!(WdfRequestGetFileObject, request) };
    let open = if file.is_null() {
        None
    } else {
        // SAFETY: the request's file object, of this device, so created
        // with the ProxyOpen attributes; live while the request is.
        unsafe { shell_of::<ProxyOpen>(file as WDFOBJECT) }
    };
    let Some(open) = open else {
        // A user request not sent on one of our opens.
        // SAFETY: the driver owns the request; this consumes it.
        unsafe { WdfRequest::complete_raw(request, NtStatus::INVALID_DEVICE_REQUEST, 0) };
        return;
    };
    // The token is asked only for the IOCTL that needs it.
    let is_admin = code == IOCTL_IBAL_CHILD_ENTRY.raw() && caller_is_administrator();
    // SAFETY: a live request the driver owns, in this callback.
    let checked = unsafe {
        with_buffer(request, Buffer::Input, |input| {
            open.table.lock().check(code, input, output_len, is_admin)
        })
    };
    match checked {
        Err(refusal) => {
            // SAFETY: the driver owns the request; this consumes it.
            unsafe { WdfRequest::complete_raw(request, refusal.nt_status(), 0) };
        }
        Ok(Checked::ChildEntry(change)) => {
            // SAFETY: the framework passes its live device; PASSIVE_LEVEL (a
            // user-mode request's caller context).
            let status = unsafe { apply_child_entry(device, &change) };
            // SAFETY: as above.
            unsafe { WdfRequest::complete_raw(request, status, 0) };
        }
        Ok(Checked::Verb(forwarded)) => {
            // SAFETY: the driver owns the request, received on `device`.
            unsafe { forward_verb(device, request, InFlight { open, forwarded }) };
        }
    }
}

/// Runs `f` over the request's METHOD_BUFFERED `which` buffer (empty
/// when it has none), without copying it.
///
/// # Safety
/// `request` is a live request the driver owns, not sent or completed
/// before `f` returns.
unsafe fn with_buffer<R>(request: WDFREQUEST, which: Buffer, f: impl FnOnce(&[u8]) -> R) -> R {
    // SAFETY: a live request (caller).
    let (buffer, length) = unsafe { system_buffer(request, which) };
    if buffer.is_null() {
        return f(&[]);
    }
    // SAFETY: the framework returned `length` readable bytes of the system
    // buffer, which stays while the driver owns the request (caller).
    f(unsafe { core::slice::from_raw_parts(buffer, length) })
}

/// Sends an accepted verb down at once, in the caller's thread, with the
/// completion routine that gives its answer to the open's table.
///
/// # Safety
/// `request` is a live request the driver owns, received on `device`, in
/// `EvtIoInCallerContext`; it is consumed.
unsafe fn forward_verb(device: WDFDEVICE, request: WDFREQUEST, in_flight: InFlight) {
    // SAFETY: a live request the driver owns (caller).
    unsafe { call_unsafe_wdf_function_binding!(WdfRequestFormatRequestUsingCurrentType, request) };
    let context = Box::into_raw(Box::new(in_flight));
    // SAFETY: a live request; the routine takes the box back exactly once
    // (it runs once for a sent request; an unsent one is handled below).
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfRequestSetCompletionRoutine,
            request,
            Some(evt_verb_completed),
            context.cast::<c_void>()
        )
    };
    // SAFETY: a live device (caller).
    let target = unsafe { lower(device) };
    // SAFETY: the formatted request the driver owns; its own target; no
    // options (asynchronous, with the completion routine).
    let sent = unsafe {
        call_unsafe_wdf_function_binding!(WdfRequestSend, request, target, ptr::null_mut())
    };
    if sent == 0 {
        // Not sent: the completion routine will not run.
        // SAFETY: the box made above, never taken.
        drop(unsafe { Box::from_raw(context) });
        // SAFETY: not sent, so still the driver's.
        let status = unsafe { call_unsafe_wdf_function_binding!(WdfRequestGetStatus, request) };
        // SAFETY: as above; this consumes it.
        unsafe { WdfRequest::complete_raw(request, NtStatus::from_raw(status as u32), 0) };
    }
}

/// The completion routine of a forwarded verb (DISPATCH_LEVEL or below):
/// the answer read into the open's table, the request completed with the
/// status the table gives (a success whose answer does not decode becomes
/// `STATUS_INVALID_DEVICE_STATE`).
unsafe extern "C" fn evt_verb_completed(
    request: WDFREQUEST,
    _target: WDFIOTARGET,
    _params: PWDF_REQUEST_COMPLETION_PARAMS,
    context: WDFCONTEXT,
) {
    // SAFETY: the box `forward_verb` gave as this request's context; the
    // framework calls this routine once.
    let in_flight = unsafe { Box::from_raw(context.cast::<InFlight>()) };
    // SAFETY: the request is the driver's again once its target completed
    // it.
    let status = unsafe { call_unsafe_wdf_function_binding!(WdfRequestGetStatus, request) };
    // SAFETY: as above.
    let information =
        unsafe { call_unsafe_wdf_function_binding!(WdfRequestGetInformation, request) };
    let status = NtStatus::from_raw(status as u32);
    // SAFETY: as above.
    let answered = unsafe {
        with_buffer(request, Buffer::Output, |output| {
            in_flight
                .open
                .table
                .lock()
                .complete(&in_flight.forwarded, status, output)
        })
    };
    // SAFETY: the driver owns the request; this consumes it.
    unsafe { WdfRequest::complete_raw(request, answered, information) };
}

/// Whether the thread that sent the current request acts as an
/// administrator (see the module doc). PASSIVE_LEVEL, in the caller's
/// thread (`EvtIoInCallerContext` of a user-mode request).
fn caller_is_administrator() -> bool {
    let mut subject = SECURITY_SUBJECT_CONTEXT::default();
    // SAFETY: PASSIVE_LEVEL in the caller's thread; `subject` is released
    // below.
    unsafe { SeCaptureSubjectContext(&mut subject) };
    // SAFETY: the context captured above, unlocked below.
    unsafe { SeLockSubjectContext(&mut subject) };
    let mut mapping = GENERIC_MAPPING {
        GenericRead: CHANGE_CHILD_LIST,
        GenericWrite: CHANGE_CHILD_LIST,
        GenericExecute: CHANGE_CHILD_LIST,
        GenericAll: CHANGE_CHILD_LIST,
    };
    let mut granted: ACCESS_MASK = 0;
    let mut status: NTSTATUS = 0;
    // SAFETY: a valid self-relative descriptor (static, 4-byte aligned,
    // its layout checked by `admin_check`'s tests); the captured and
    // locked subject context; no privilege set asked for; out pointers
    // valid. `UserMode`: the request's requestor mode, so the check is
    // made (kernel mode would grant everything).
    let allowed = unsafe {
        SeAccessCheck(
            ADMINISTRATORS_ONLY.as_ptr().cast_mut().cast(),
            &mut subject,
            TRUE as u8,
            CHANGE_CHILD_LIST,
            0,
            ptr::null_mut(),
            &mut mapping,
            _MODE::UserMode as i8,
            &mut granted,
            &mut status,
        )
    };
    // SAFETY: locked above.
    unsafe { SeUnlockSubjectContext(&mut subject) };
    // SAFETY: captured above, released once.
    unsafe { SeReleaseSubjectContext(&mut subject) };
    allowed != 0 && status >= 0
}

/// The administrator IOCTL: writes the change into the filter's
/// Parameters key, then reconciles every filter device's children (the
/// simulated shell's `IbalProxy::apply_child_entry`).
///
/// # Safety
/// `device` is the live filter device; PASSIVE_LEVEL.
unsafe fn apply_child_entry(device: WDFDEVICE, change: &ChildEntryChange) -> NtStatus {
    // SAFETY: a live device (caller).
    let driver = unsafe { call_unsafe_wdf_function_binding!(WdfDeviceGetDriver, device) };
    // SAFETY: the device's live driver object; PASSIVE_LEVEL (caller).
    let key = match unsafe { ParametersKey::open_writable(driver) } {
        Ok(key) => key,
        Err(status) => return status,
    };
    // No list means the default one: it becomes explicit first.
    let mut names = match key.read(RegistryKey::ServiceParameters, LIST_VALUE) {
        Some(RegValue::MultiString(names)) => names,
        None => {
            let ipoib = ChildEntry::ipoib();
            if let Err(status) = write_entry(&key, &ipoib) {
                return status;
            }
            vec![ipoib.name]
        }
        // A list of the wrong type is the administrator's to repair.
        Some(_) => return NtStatus::INVALID_DEVICE_STATE,
    };
    let position = |names: &[alloc::string::String], name: &str| {
        names.iter().position(|n| n.eq_ignore_ascii_case(name))
    };
    let written = match change {
        ChildEntryChange::Add(entry) => {
            if position(&names, &entry.name).is_none() {
                names.push(entry.name.clone());
            }
            write_entry(&key, entry)
        }
        ChildEntryChange::Remove(name) => {
            let Some(at) = position(&names, name) else {
                return NtStatus::NOT_FOUND;
            };
            let removed = names.remove(at);
            key.delete_subkey(&removed, &ENTRY_VALUES)
        }
    };
    if let Err(status) = written {
        return status;
    }
    if let Err(status) = key.write(LIST_VALUE, &RegValue::MultiString(names)) {
        return status;
    }
    drop(key);
    reconcile_every_filter();
    NtStatus::SUCCESS
}

/// Writes one entry's subkey under the Parameters key.
fn write_entry(key: &ParametersKey, entry: &ChildEntry) -> Result<(), NtStatus> {
    let name = &entry.name;
    let values: Vec<(&str, RegValue)> = vec![
        ("DeviceId", RegValue::String(entry.device_id.clone())),
        (
            "HardwareId",
            RegValue::MultiString(entry.hardware_ids.clone()),
        ),
        (
            "CompatibleId",
            RegValue::MultiString(entry.compatible_ids.clone()),
        ),
        ("Description", RegValue::String(entry.description.clone())),
        ("PartitionKey", RegValue::Dword(entry.pkey.get().into())),
    ];
    for (value, data) in &values {
        key.write(&alloc::format!("{name}\\{value}"), data)?;
    }
    Ok(())
}
