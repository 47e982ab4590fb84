//! The AL interface a child PDO answers `IRP_MN_QUERY_INTERFACE` for
//! `GUID_IB_AL_INTERFACE` with: the FFI table
//! `ib_types::interface::AlInterface`, whose `extern "system"` entry
//! points call the parent's `AccessLayer`, and the child's port data
//! (CA GUID, port GUID, port number, P_Key).
//!
//! The header's `context` is the child's `ChildShell` (an `Arc` pointer).
//! `InterfaceReference`/`InterfaceDereference` take and drop a strong
//! reference on the shell and one on the PDO's `WDFDEVICE`
//! (`WdfObjectReference`), as in the miniport's CI table: a referenced
//! framework object is not freed, and the driver image is not unloaded
//! while one of its device objects exists.
//!
//! - `open_al` takes a reference on the client's device object
//!   (`ObfReferenceObject`) that the AL holds until no callback can follow,
//!   and returns the client's handle of the CA as its AL handle.
//! - `close_al` (PASSIVE_LEVEL) closes it, waiting on a `KEVENT` for
//!   callbacks in flight.
//! - `submit` passes the client's IRP, set up for the PDO's device object
//!   (`IRP_MJ_INTERNAL_DEVICE_CONTROL`, an `ib_types::ioctl` verb code,
//!   METHOD_BUFFERED buffers), to the PDO with `IoCallDriver`: the
//!   power-managed queue delivers it (`child`), and the AL completes it.
//! - post, poll and arm are direct calls on the client's handles; the
//!   client is the one (opened through this child) that owns the handle.
//!   `post_srq_recv` answers `STATUS_NOT_SUPPORTED` (the AL serves no SRQ
//!   yet).
//!
//! # Safety contract for consumers
//! Every pointer argument is valid for the documented count for the
//! duration of the call; `context` is the header's.

use alloc::boxed::Box;
use alloc::sync::Arc;
use core::ffi::c_void;

use ib_types::abi::Repr;
use ib_types::cq::CqNotify;
use ib_types::event::{AsyncEventRecord, AsyncEventRecordAbi};
use ib_types::interface::{
    AL_INTERFACE_VERSION, AlInterface, EventCallbacks, InterfaceHeader, InterfaceVersion,
    PortInterfaceDataAbi, VerbEntryPoints,
};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr_desc::{RecvWrDesc, SendWrDesc};
use ibal_bus_core::al::{ClientEvents, ClientId};
use kmdf_platform::event::{KeIrql, KernelEvent};
use kmdf_platform::ffi::{slice_checked, slice_or_empty};
use kmdf_platform::interface::{InterfaceOwner, interface_dereference, interface_reference};
use wdk_sys::ntddk::{IofCallDriver, ObfDereferenceObject, ObfReferenceObject};
use wdk_sys::{IRP, WDFDEVICE, call_unsafe_wdf_function_binding};

use super::child::{ChildShell, OpenedClient};
use super::filter::Al;

/// `STATUS_DEVICE_NOT_READY`.
const NOT_READY: NtStatus = NtStatus::from_raw(0xC000_00A3);

/// The table for the child `shell` (no reference taken: the framework
/// calls `interface_reference` on every copy it hands out).
pub fn al_interface(shell: *const ChildShell, port: PortInterfaceDataAbi) -> AlInterface {
    AlInterface {
        header: InterfaceHeader {
            size: size_of::<AlInterface>() as u16,
            version: AL_INTERFACE_VERSION.packed(),
            context: shell.cast_mut().cast::<c_void>(),
            interface_reference: Some(interface_reference::<ChildShell>),
            interface_dereference: Some(interface_dereference::<ChildShell>),
        },
        port,
        open_al: Some(open_al),
        close_al: Some(close_al),
        verbs: VerbEntryPoints {
            submit: Some(submit),
            post_send: Some(post_send),
            post_recv: Some(post_recv),
            post_srq_recv: Some(post_srq_recv),
            poll_cq: Some(poll_cq),
            arm_cq: Some(arm_cq),
        },
    }
}

/// Whether a requester asking for `version` with a structure of `size`
/// bytes can be served: the table fits and this provider's version
/// satisfies the one asked for.
pub fn accepts(size: u16, version: u16) -> bool {
    usize::from(size) >= size_of::<AlInterface>()
        && AL_INTERFACE_VERSION.satisfies(InterfaceVersion::from_packed(version))
}

/// The child behind `context`.
///
/// # Safety
/// `context` is a header context made by [`al_interface`] whose consumer
/// holds a reference.
unsafe fn child<'a>(context: *mut c_void) -> &'a ChildShell {
    // SAFETY: the consumer's reference keeps the shell alive (caller).
    unsafe { &*context.cast_const().cast::<ChildShell>() }
}

impl InterfaceOwner for ChildShell {
    fn device(&self) -> WDFDEVICE {
        self.device
    }
}

/// A reference on a client's device object, released when dropped (the
/// AL drops it once no callback can follow).
struct DeviceObjectReference(*mut c_void);

// SAFETY: an object reference may be released from any thread at
// DISPATCH_LEVEL or below.
unsafe impl Send for DeviceObjectReference {}
// SAFETY: nothing reads or writes through the pointer.
unsafe impl Sync for DeviceObjectReference {}

impl Drop for DeviceObjectReference {
    fn drop(&mut self) {
        // SAFETY: the reference `open_al` took, released once.
        let _ = unsafe { ObfDereferenceObject(self.0) };
    }
}

/// A client's callbacks as the AL's `ClientEvents`.
struct FfiClient {
    callbacks: EventCallbacks,
    client: *mut c_void,
}

// SAFETY: the client promised (AlOpenFn) that its callbacks may run on
// any processor at DISPATCH_LEVEL with its `client` pointer.
unsafe impl Send for FfiClient {}
// SAFETY: as above.
unsafe impl Sync for FfiClient {}

impl ClientEvents for FfiClient {
    fn completion(&self, cq: u64) {
        if let Some(f) = self.callbacks.completion {
            // SAFETY: the client's own callback with its own context.
            unsafe { f(self.client, cq) };
        }
    }

    fn async_event(&self, event: &AsyncEventRecord) {
        if let Some(f) = self.callbacks.async_event {
            let record: AsyncEventRecordAbi = event.emit();
            // SAFETY: as above; the record lives for the call.
            unsafe { f(self.client, &record) };
        }
    }
}

unsafe extern "system" fn open_al(
    context: *mut c_void,
    client_device: *mut c_void,
    callbacks: *const EventCallbacks,
    client: *mut c_void,
    al_handle: *mut u64,
) -> NtStatus {
    // SAFETY: header context (consumer contract).
    let shell = unsafe { child(context) };
    let Some(al) = shell.al() else {
        return NOT_READY;
    };
    if client_device.is_null() || callbacks.is_null() || al_handle.is_null() {
        return IbStatus::InvalidParameter.to_ntstatus();
    }
    // SAFETY: non-null and valid for the call (consumer contract).
    let callbacks = unsafe { *callbacks };
    // SAFETY: the client's live device object (consumer contract).
    let _ = unsafe { ObfReferenceObject(client_device) };
    let reference = DeviceObjectReference(client_device);
    let events = Arc::new(FfiClient { callbacks, client });
    let id = match al.open(Box::new(reference), events) {
        Ok(id) => id,
        Err(status) => return status.to_ntstatus(),
    };
    let Some(handle) = al.ca_handle(id) else {
        return IbStatus::InvalidState.to_ntstatus();
    };
    shell.add_client(&al, handle, id);
    // SAFETY: a valid out pointer (consumer contract).
    unsafe { al_handle.write(handle) };
    IbStatus::Success.to_ntstatus()
}

unsafe extern "system" fn close_al(context: *mut c_void, al_handle: u64) -> NtStatus {
    // SAFETY: header context (consumer contract).
    let shell = unsafe { child(context) };
    let (al, id) = match shell.client(al_handle) {
        OpenedClient::Current(al, id) => (al, id),
        OpenedClient::Stale => {
            // Its AL went with the HCA stack's stop, and released the
            // client's reference then: only the record is left.
            shell.remove_client(al_handle);
            return IbStatus::Success.to_ntstatus();
        }
        OpenedClient::Unknown => return IbStatus::InvalidAlHandle.to_ntstatus(),
    };
    match al.close(id, &KeIrql, Arc::new(KernelEvent::default())) {
        Ok(()) => {
            shell.remove_client(al_handle);
            IbStatus::Success.to_ntstatus()
        }
        Err(status) => status.to_ntstatus(),
    }
}

/// `submit`: the client's IRP, set up for the PDO's device object, goes
/// to the PDO (module doc). Returns `IoCallDriver`'s status.
unsafe extern "system" fn submit(context: *mut c_void, request: *mut c_void) -> NtStatus {
    if request.is_null() {
        return IbStatus::InvalidParameter.to_ntstatus();
    }
    // SAFETY: header context (consumer contract).
    let shell = unsafe { child(context) };
    // SAFETY: the PDO lives while the consumer holds its reference.
    let device_object =
        unsafe { call_unsafe_wdf_function_binding!(WdfDeviceWdmGetDeviceObject, shell.device) };
    // SAFETY: an IRP set up for this device object (consumer contract);
    // the I/O manager owns it from here until it is completed.
    let status = unsafe { IofCallDriver(device_object, request.cast::<IRP>()) };
    NtStatus::from_raw(status as u32)
}

unsafe extern "system" fn post_send(
    context: *mut c_void,
    qp: u64,
    wrs: *const SendWrDesc,
    count: u32,
    posted: *mut u32,
) -> NtStatus {
    let post_one = |al: &Al, client: ClientId, desc: &SendWrDesc| {
        // SAFETY: each descriptor's list is valid (consumer contract).
        let list = unsafe { slice_or_empty(desc.sg_list, desc.num_sge) };
        let wr = desc.decode(list).ok()?;
        Some(al.post_send(client, qp, core::slice::from_ref(&wr)))
    };
    // SAFETY: forwarded consumer contract.
    unsafe { post_each(context, qp, wrs, count, posted, post_one) }
}

unsafe extern "system" fn post_recv(
    context: *mut c_void,
    qp: u64,
    wrs: *const RecvWrDesc,
    count: u32,
    posted: *mut u32,
) -> NtStatus {
    let post_one = |al: &Al, client: ClientId, desc: &RecvWrDesc| {
        // SAFETY: each descriptor's list is valid (consumer contract).
        let list = unsafe { slice_or_empty(desc.sg_list, desc.num_sge) };
        let wr = desc.decode(list).ok()?;
        Some(al.post_recv(client, qp, core::slice::from_ref(&wr)))
    };
    // SAFETY: forwarded consumer contract.
    unsafe { post_each(context, qp, wrs, count, posted, post_one) }
}

/// The body of `post_send` and `post_recv`: the `count` descriptors at
/// `wrs` posted to `qp` one at a time (no allocation and no batch on the
/// stack) by `post_one`, which decodes one and posts it (`None`: it does
/// not decode); how many were posted goes to `posted`.
///
/// # Safety
/// The entry points' consumer contract: `context` a header context made
/// by [`al_interface`] whose consumer holds a reference, `wrs` `count`
/// readable descriptors (or null with 0), `posted` a valid out pointer or
/// null.
unsafe fn post_each<D>(
    context: *mut c_void,
    qp: u64,
    wrs: *const D,
    count: u32,
    posted: *mut u32,
    post_one: impl Fn(&Al, ClientId, &D) -> Option<(usize, IbStatus)>,
) -> NtStatus {
    // SAFETY: header context (consumer contract).
    let shell = unsafe { child(context) };
    // SAFETY: forwarded consumer contract.
    let Some(descs) = (unsafe { slice_checked(wrs, count) }) else {
        return IbStatus::InvalidParameter.to_ntstatus();
    };
    if posted.is_null() {
        return IbStatus::InvalidParameter.to_ntstatus();
    }
    let Some((al, client)) = shell.owner_of(qp) else {
        // SAFETY: a valid out pointer (consumer contract).
        unsafe { posted.write(0) };
        return IbStatus::InvalidQpHandle.to_ntstatus();
    };
    let mut done = 0u32;
    let mut status = IbStatus::Success;
    for desc in descs {
        let Some((n, s)) = post_one(&al, client, desc) else {
            status = IbStatus::InvalidParameter;
            break;
        };
        done += n as u32;
        if s != IbStatus::Success {
            status = s;
            break;
        }
    }
    // SAFETY: a valid out pointer (consumer contract).
    unsafe { posted.write(done) };
    status.to_ntstatus()
}

unsafe extern "system" fn post_srq_recv(
    _context: *mut c_void,
    _srq: u64,
    _wrs: *const RecvWrDesc,
    _count: u32,
    posted: *mut u32,
) -> NtStatus {
    if !posted.is_null() {
        // SAFETY: a valid out pointer (consumer contract).
        unsafe { posted.write(0) };
    }
    NtStatus::NOT_SUPPORTED
}

unsafe extern "system" fn poll_cq(
    context: *mut c_void,
    cq: u64,
    wcs: *mut WorkCompletion,
    capacity: u32,
    polled: *mut u32,
) -> NtStatus {
    // SAFETY: header context (consumer contract).
    let shell = unsafe { child(context) };
    if polled.is_null() || (wcs.is_null() && capacity != 0) {
        return IbStatus::InvalidParameter.to_ntstatus();
    }
    let Some((al, client)) = shell.owner_of(cq) else {
        // SAFETY: a valid out pointer (consumer contract).
        unsafe { polled.write(0) };
        return IbStatus::InvalidCqHandle.to_ntstatus();
    };
    let out = if capacity == 0 {
        &mut [][..]
    } else {
        // SAFETY: `wcs` is valid for `capacity` completions (consumer
        // contract) and not aliased during the call.
        unsafe { core::slice::from_raw_parts_mut(wcs, capacity as usize) }
    };
    let (n, status) = match al.poll_cq(client, cq, out) {
        Ok(n) => (n, IbStatus::Success),
        Err(status) => (0, status),
    };
    // SAFETY: a valid out pointer (consumer contract).
    unsafe { polled.write(n as u32) };
    status.to_ntstatus()
}

unsafe extern "system" fn arm_cq(context: *mut c_void, cq: u64, notify: u8) -> NtStatus {
    // SAFETY: header context (consumer contract).
    let shell = unsafe { child(context) };
    let Ok(notify) = CqNotify::try_from(notify) else {
        return IbStatus::InvalidParameter.to_ntstatus();
    };
    let Some((al, client)) = shell.owner_of(cq) else {
        return IbStatus::InvalidCqHandle.to_ntstatus();
    };
    match al.arm_cq(client, cq, notify) {
        Ok(()) => IbStatus::Success.to_ntstatus(),
        Err(status) => status.to_ntstatus(),
    }
}
