//! The CI interface as the bus filter receives it: the FFI table
//! `ib_types::interface::CiInterface`, registered with
//! `WdfDeviceAddQueryInterface` for `GUID_IB_CI_INTERFACE`. Its entry
//! points are thin `extern "system"` adapters over the device's
//! `CiProvider` (see `hca_miniport_core::ci`); the simulated host's shell
//! hands out the provider itself instead.
//!
//! The header's `context` is the device's `DeviceShell` (an `Arc` pointer).
//! `InterfaceReference`/`InterfaceDereference` take and drop two
//! references per copy: a strong one on the shell, so it outlives every
//! consumer's copy, and one on the `WDFDEVICE` (`WdfObjectReference`), as
//! `WdfDeviceAddQueryInterface` asks of a driver-supplied reference
//! routine: a referenced framework object is not freed, and the driver
//! image is not unloaded while one of its device objects exists, so the
//! entry points stay mapped while a consumer can call them. The provider
//! exists between prepare- and release-hardware; an entry point called
//! outside that window answers `STATUS_DEVICE_NOT_READY`.
//!
//! Requests cross the interface as IRPs, never as `WDFREQUEST`s: a
//! framework request belongs to the driver whose queue delivered it, and
//! only that driver may complete it. [`submit`] hands the caller's IRP to
//! the provider, whose route ([`DeviceObjectRoute`], the core's
//! `SubmitRoute`) passes it to this driver's device object
//! (`IoCallDriver`), where the framework makes it this driver's own
//! request, delivered by the power-managed default queue like every IOCTL
//! (held below D0, stopped with `EvtIoStop` at D0 exit) and completed here
//! by its owner.
//!
//! # Safety contract for consumers
//! Every pointer argument is valid for the documented count (`wrs` for
//! `count` descriptors, each descriptor's `sg_list` for its `num_sge`
//! entries, `wcs` for `capacity` completions, the out parameters), for the
//! duration of the call; `context` is the header's.

use alloc::sync::Arc;
use core::ffi::c_void;

use hca_miniport_core::ci::{CiProvider, SubmitRoute};
use hca_miniport_core::verbs::{CaClient, CqNotify};
use ib_types::abi::Repr;
use ib_types::event::{AsyncEventRecord, AsyncEventRecordAbi};
use ib_types::handle::CqHandle;
use ib_types::interface::{
    CI_INTERFACE_VERSION, CiInterface, EventCallbacks, InterfaceHeader, InterfaceVersion,
    VerbEntryPoints,
};
use ib_types::scalars::NodeGuid;
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendFlags, SendOp, SendWr};
use ib_types::wr_desc::{RecvWrDesc, SendWrDesc};
use kmdf_platform::ffi::slice_or_empty;
use kmdf_platform::interface::{InterfaceOwner, interface_dereference, interface_reference};
use wdk_sys::ntddk::IofCallDriver;
use wdk_sys::{IRP, WDFDEVICE, call_unsafe_wdf_function_binding};

use super::device::DeviceShell;
use super::platform::WdfPlatform;

/// The provider as this shell builds it: its requests are IRPs.
pub type Provider = CiProvider<WdfPlatform, CiIrp>;

/// `STATUS_DEVICE_NOT_READY`.
const NOT_READY: NtStatus = NtStatus::from_raw(0xC000_00A3);
/// WRs decoded per batch on the stack (the fast path does not allocate).
const BATCH: usize = 16;

/// Fills the unused slots of a send batch (never posted).
const PLACEHOLDER_SEND: SendWr<'static> = SendWr {
    wr_id: 0,
    op: SendOp::Send,
    flags: SendFlags::empty(),
    sg_list: &[],
    ud: None,
};

/// The table for `shell`, its header's context a pointer to it (no
/// reference taken: the framework calls `interface_reference` on every
/// copy it hands out). Identity fields are filled at query time
/// (`fill_identity`), once the device is started.
pub fn ci_interface(shell: *const DeviceShell) -> CiInterface {
    CiInterface {
        header: InterfaceHeader {
            size: size_of::<CiInterface>() as u16,
            version: CI_INTERFACE_VERSION.packed(),
            context: shell.cast_mut().cast::<c_void>(),
            interface_reference: Some(interface_reference::<DeviceShell>),
            interface_dereference: Some(interface_dereference::<DeviceShell>),
        },
        ca_guid: NodeGuid::new(0),
        vendor_id: 0,
        device_id: 0,
        revision: 0,
        uvp_name: hca_miniport_core::ci::uvp_name().emit(),
        open_ca: Some(open_ca),
        close_ca: Some(close_ca),
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
/// bytes can be served: the table fits, and the provider has a version
/// not above the one asked for (the table carries `CI_INTERFACE_VERSION`,
/// the closest; the requester checks it).
pub fn accepts(size: u16, version: u16) -> bool {
    usize::from(size) >= size_of::<CiInterface>()
        && Provider::answer_version(InterfaceVersion::from_packed(version)).is_some()
}

/// Fills the identity of the started device into a copy of the table.
pub fn fill_identity(interface: &mut CiInterface, shell: &DeviceShell) {
    if let Some(id) = shell.provider().and_then(|p| p.identity().ok()) {
        interface.ca_guid = id.ca_guid;
        interface.vendor_id = id.vendor_id;
        interface.device_id = id.device_id;
        interface.revision = id.revision;
    }
}

/// The provider behind `context`.
///
/// # Safety
/// `context` is a header context made by [`ci_interface`] whose consumer
/// holds a reference.
unsafe fn provider(context: *mut c_void) -> Option<Arc<Provider>> {
    let shell = context.cast_const().cast::<DeviceShell>();
    // SAFETY: the consumer's reference keeps the shell alive (caller).
    unsafe { (*shell).provider() }
}

impl InterfaceOwner for DeviceShell {
    fn device(&self) -> WDFDEVICE {
        self.device
    }
}

/// A client's callbacks as a [`CaClient`].
struct FfiClient {
    callbacks: EventCallbacks,
    client: *mut c_void,
}

// SAFETY: the client promised (CiOpenCaFn) that its callbacks may run on
// any processor at DISPATCH_LEVEL with its `client` pointer.
unsafe impl Send for FfiClient {}
// SAFETY: as above.
unsafe impl Sync for FfiClient {}

impl CaClient for FfiClient {
    fn completion(&self, cq: CqHandle) {
        if let Some(f) = self.callbacks.completion {
            // SAFETY: the client's own callback with its own context.
            unsafe { f(self.client, cq.raw()) };
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

unsafe extern "system" fn open_ca(
    context: *mut c_void,
    callbacks: *const EventCallbacks,
    client: *mut c_void,
    ca: *mut u64,
) -> NtStatus {
    // SAFETY: header context (consumer contract).
    let Some(ci) = (unsafe { provider(context) }) else {
        return NOT_READY;
    };
    if callbacks.is_null() || ca.is_null() {
        return IbStatus::InvalidParameter.to_ntstatus();
    }
    // SAFETY: non-null and valid for the call (consumer contract).
    let callbacks = unsafe { *callbacks };
    match ci.open_ca(Arc::new(FfiClient { callbacks, client })) {
        Ok(handle) => {
            // SAFETY: a valid out pointer (consumer contract).
            unsafe { ca.write(handle) };
            IbStatus::Success.to_ntstatus()
        }
        Err(status) => status.to_ntstatus(),
    }
}

unsafe extern "system" fn close_ca(context: *mut c_void, ca: u64) -> NtStatus {
    // SAFETY: header context (consumer contract).
    let Some(ci) = (unsafe { provider(context) }) else {
        return NOT_READY;
    };
    match ci.close_ca(ca) {
        Ok(()) => IbStatus::Success.to_ntstatus(),
        Err(status) => status.to_ntstatus(),
    }
}

/// `submit`: `request` is an IRP (`SubmitFn`: the platform's request
/// object) whose next stack location the caller set up for this HCA's
/// device object: `IRP_MJ_INTERNAL_DEVICE_CONTROL` with a verb code and
/// METHOD_BUFFERED buffers, as `IoBuildDeviceIoControlRequest` with
/// `InternalDeviceIoControl` builds it. The provider sends it along its
/// route ([`DeviceObjectRoute`]: `IoCallDriver` to this driver's device
/// object): the framework wraps it in a request of this driver, the
/// power-managed default queue delivers it (`queue`; held below D0,
/// `EvtIoStop` at D0 exit), and this driver completes it, as its owner;
/// the caller learns the status through its IRP. Returns `IoCallDriver`'s
/// status (`STATUS_PENDING` when the request completes later); outside
/// the provider's window `STATUS_DEVICE_NOT_READY`, the IRP not taken.
/// PASSIVE_LEVEL or DISPATCH_LEVEL.
unsafe extern "system" fn submit(context: *mut c_void, request: *mut c_void) -> NtStatus {
    if request.is_null() {
        return IbStatus::InvalidParameter.to_ntstatus();
    }
    // SAFETY: header context, kept alive by the consumer's reference.
    match unsafe { provider(context) } {
        Some(p) => p.submit(CiIrp(request.cast::<IRP>())),
        None => NOT_READY,
    }
}

/// A consumer's IRP as it crosses the interface (`submit`'s request).
#[derive(Debug)]
pub struct CiIrp(*mut IRP);

/// The provider's [`SubmitRoute`]: a consumer's IRP goes to this driver's
/// device object with `IoCallDriver`, so it reaches the core through the
/// power-managed default queue as this driver's own request.
#[derive(Debug)]
pub struct DeviceObjectRoute {
    device: WDFDEVICE,
}

impl DeviceObjectRoute {
    /// The route into `device` (this driver's device object).
    pub fn new(device: WDFDEVICE) -> Self {
        Self { device }
    }
}

// SAFETY: a WDFDEVICE handle is valid from any thread; the route only
// reads it.
unsafe impl Send for DeviceObjectRoute {}
// SAFETY: as above.
unsafe impl Sync for DeviceObjectRoute {}

impl SubmitRoute<CiIrp> for DeviceObjectRoute {
    fn send(&self, request: CiIrp) -> NtStatus {
        // SAFETY: the provider holding this route exists only between
        // prepare- and release-hardware, while the device object lives.
        let device_object =
            unsafe { call_unsafe_wdf_function_binding!(WdfDeviceWdmGetDeviceObject, self.device) };
        // SAFETY: an IRP set up for this device object (consumer contract);
        // the I/O manager owns it from here until it is completed.
        let status = unsafe { IofCallDriver(device_object, request.0) };
        NtStatus::from_raw(status as u32)
    }
}

unsafe extern "system" fn post_send(
    context: *mut c_void,
    qp: u64,
    wrs: *const SendWrDesc,
    count: u32,
    posted: *mut u32,
) -> NtStatus {
    // SAFETY: header context (consumer contract).
    let Some(ci) = (unsafe { provider(context) }) else {
        return NOT_READY;
    };
    if posted.is_null() || (wrs.is_null() && count != 0) {
        return IbStatus::InvalidParameter.to_ntstatus();
    }
    let descs = if count == 0 {
        &[][..]
    } else {
        // SAFETY: `wrs` is valid for `count` descriptors (consumer contract).
        unsafe { core::slice::from_raw_parts(wrs, count as usize) }
    };
    let mut done = 0usize;
    let mut status = IbStatus::Success;
    'batches: for chunk in descs.chunks(BATCH) {
        let mut wrs: [SendWr<'_>; BATCH] = [PLACEHOLDER_SEND; BATCH];
        let mut ready = 0;
        let mut refusal = None;
        for desc in chunk {
            // SAFETY: each descriptor's list is valid (consumer contract).
            let list = unsafe { slice_or_empty(desc.sg_list, desc.num_sge) };
            match desc.decode(list) {
                Ok(wr) => {
                    wrs[ready] = wr;
                    ready += 1;
                }
                Err(_) => {
                    refusal = Some(IbStatus::InvalidParameter);
                    break;
                }
            }
        }
        let (n, s) = ci.post_send(qp, &wrs[..ready]);
        done += n;
        if s != IbStatus::Success {
            status = s;
            break 'batches;
        }
        if let Some(s) = refusal {
            status = s;
            break 'batches;
        }
    }
    // SAFETY: a valid out pointer (consumer contract).
    unsafe { posted.write(done as u32) };
    status.to_ntstatus()
}

/// Decodes receive descriptors in batches and posts each with `post`.
///
/// # Safety
/// `wrs` is valid for `count` descriptors and `posted` is writable
/// (consumer contract).
unsafe fn post_receives(
    wrs: *const RecvWrDesc,
    count: u32,
    posted: *mut u32,
    post: impl Fn(&[RecvWr<'_>]) -> (usize, IbStatus),
) -> NtStatus {
    if posted.is_null() || (wrs.is_null() && count != 0) {
        return IbStatus::InvalidParameter.to_ntstatus();
    }
    let descs = if count == 0 {
        &[][..]
    } else {
        // SAFETY: forwarded from the caller.
        unsafe { core::slice::from_raw_parts(wrs, count as usize) }
    };
    let mut done = 0usize;
    let mut status = IbStatus::Success;
    for chunk in descs.chunks(BATCH) {
        let mut batch = [RecvWr {
            wr_id: 0,
            sg_list: &[],
        }; BATCH];
        let mut ready = 0;
        let mut refusal = None;
        for desc in chunk {
            // SAFETY: forwarded from the caller.
            let list = unsafe { slice_or_empty(desc.sg_list, desc.num_sge) };
            match desc.decode(list) {
                Ok(wr) => {
                    batch[ready] = wr;
                    ready += 1;
                }
                Err(_) => {
                    refusal = Some(IbStatus::InvalidParameter);
                    break;
                }
            }
        }
        let (n, s) = post(&batch[..ready]);
        done += n;
        if s != IbStatus::Success {
            status = s;
            break;
        }
        if let Some(s) = refusal {
            status = s;
            break;
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { posted.write(done as u32) };
    status.to_ntstatus()
}

/// `PostRecv` and `PostSrqRecv`: one adapter shape over the provider's
/// `$post` for the queue (QP or SRQ) handle.
macro_rules! receive_entry_point {
    ($name:ident, $post:ident) => {
        unsafe extern "system" fn $name(
            context: *mut c_void,
            queue: u64,
            wrs: *const RecvWrDesc,
            count: u32,
            posted: *mut u32,
        ) -> NtStatus {
            // SAFETY: header context (consumer contract).
            let Some(ci) = (unsafe { provider(context) }) else {
                return NOT_READY;
            };
            // SAFETY: forwarded consumer contract.
            unsafe { post_receives(wrs, count, posted, |batch| ci.$post(queue, batch)) }
        }
    };
}

receive_entry_point!(post_recv, post_recv);
receive_entry_point!(post_srq_recv, post_srq_recv);

unsafe extern "system" fn poll_cq(
    context: *mut c_void,
    cq: u64,
    wcs: *mut WorkCompletion,
    capacity: u32,
    polled: *mut u32,
) -> NtStatus {
    // SAFETY: header context (consumer contract).
    let Some(ci) = (unsafe { provider(context) }) else {
        return NOT_READY;
    };
    if polled.is_null() || (wcs.is_null() && capacity != 0) {
        return IbStatus::InvalidParameter.to_ntstatus();
    }
    let out = if capacity == 0 {
        &mut [][..]
    } else {
        // SAFETY: `wcs` is valid for `capacity` completions (consumer
        // contract) and not aliased during the call.
        unsafe { core::slice::from_raw_parts_mut(wcs, capacity as usize) }
    };
    let (n, status) = match ci.poll_cq(cq, out) {
        Ok(n) => (n, IbStatus::Success),
        Err(status) => (0, status),
    };
    // SAFETY: a valid out pointer (consumer contract).
    unsafe { polled.write(n as u32) };
    status.to_ntstatus()
}

unsafe extern "system" fn arm_cq(context: *mut c_void, cq: u64, notify: u8) -> NtStatus {
    // SAFETY: header context (consumer contract).
    let Some(ci) = (unsafe { provider(context) }) else {
        return NOT_READY;
    };
    let Ok(notify) = CqNotify::try_from(notify) else {
        return IbStatus::InvalidParameter.to_ntstatus();
    };
    match ci.arm_cq(cq, notify) {
        Ok(()) => IbStatus::Success.to_ntstatus(),
        Err(status) => status.to_ntstatus(),
    }
}
