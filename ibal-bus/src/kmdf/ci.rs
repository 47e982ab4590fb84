//! The HCA's CI interface as the filter holds it: [`FfiCi`] implements
//! `ibal_bus_core::ci::CiAccess` (and the AL's `CiRequests`) one for one
//! over the FFI table `ib_types::interface::CiInterface` that
//! `WdfFdoQueryForInterface` filled in prepare-hardware.
//!
//! **Control verbs** cross the interface as IRPs (the table's `submit`,
//! docs/miniport.md "ci"): the miniport passes the IRP to its own device
//! object with `IoCallDriver`, so the IRP's *next* stack location must be
//! set up for that device object: `IRP_MJ_INTERNAL_DEVICE_CONTROL`, the
//! verb's code, METHOD_BUFFERED buffers in `AssociatedIrp.SystemBuffer`.
//! [`FfiCi::submit`] builds it with `IoAllocateIrp` (not
//! `IoBuildDeviceIoControlRequest`, whose threaded IRP needs
//! PASSIVE_LEVEL: the AL submits at DISPATCH_LEVEL) with as many stack
//! locations as the device attached below the filter needs (the miniport's
//! FDO, or a filter between, whose stack is at least as deep), and a
//! completion routine that hands the status and the bytes the miniport
//! wrote (`Information`) to the request's `CaCompletion`, frees the IRP
//! and returns `STATUS_MORE_PROCESSING_REQUIRED` (the IRP is the
//! filter's, not the I/O manager's). When the interface refuses the IRP
//! without taking it (outside the provider's window), the completion is
//! run here with that status: every request completes exactly once.
//!
//! **CA callbacks.** `open_ca` registers two `extern "system"` callbacks
//! whose client pointer is a boxed `Arc<dyn CaEvents>` kept here until
//! `close_ca` returned (no callback follows it).

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::ffi::c_void;
use core::mem::MaybeUninit;
use core::sync::atomic::{AtomicBool, Ordering};

use ib_types::abi::Repr;
use ib_types::cq::CqNotify;
use ib_types::event::{AsyncEventRecord, AsyncEventRecordAbi};
use ib_types::handle::CqHandle;
use ib_types::interface::{CiInterface, EventCallbacks, GUID_IB_CI_INTERFACE, InterfaceVersion};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendWr};
use ib_types::wr_desc::{RecvWrDesc, SendWrDesc};
use ibal_bus_core::al::{CaCompletion, CiRequests};
use ibal_bus_core::ca_registry::check_version;
use ibal_bus_core::ci::{CaEvents, CaIdentity, CiAccess, REQUIRED_CI_VERSION};
use kmdf_platform::sync::SpinLock;
use wdk_sys::ntddk::{IoAllocateIrp, IoFreeIrp};
use wdk_sys::{
    FALSE, GUID, IRP_MJ_INTERNAL_DEVICE_CONTROL, NTSTATUS, PDEVICE_OBJECT, PINTERFACE, PIRP, PVOID,
    SL_INVOKE_ON_CANCEL, SL_INVOKE_ON_ERROR, SL_INVOKE_ON_SUCCESS, ULONG, WDFDEVICE,
    call_unsafe_wdf_function_binding,
};

/// `STATUS_MORE_PROCESSING_REQUIRED`: a completion routine keeps the IRP.
const MORE_PROCESSING_REQUIRED: NTSTATUS = 0xC000_0016_u32 as NTSTATUS;
/// `STATUS_DEVICE_NOT_READY`: the interface is released.
const NOT_READY: NtStatus = NtStatus::from_raw(0xC000_00A3);
/// `STATUS_REVISION_MISMATCH`.
const REVISION_MISMATCH: NtStatus = NtStatus::from_raw(0xC000_0059);

/// `GUID_IB_CI_INTERFACE` as a Windows `GUID`.
pub static CI_INTERFACE_GUID: GUID = GUID {
    Data1: GUID_IB_CI_INTERFACE.data1.get(),
    Data2: GUID_IB_CI_INTERFACE.data2.get(),
    Data3: GUID_IB_CI_INTERFACE.data3.get(),
    Data4: GUID_IB_CI_INTERFACE.data4,
};

/// The CI interface of the HCA below one filter device.
///
/// # Invariants
/// `table` was filled by the miniport with one reference taken, given back
/// once by [`FfiCi::release`]; `hca_device` is the device object attached
/// below the filter, alive while the filter's device is.
pub struct FfiCi {
    table: CiInterface,
    version: InterfaceVersion,
    hca_device: PDEVICE_OBJECT,
    /// The callbacks' client while the CA is open.
    events: SpinLock<Option<Box<Arc<dyn CaEvents>>>>,
    released: AtomicBool,
}

impl core::fmt::Debug for FfiCi {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("FfiCi")
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

// SAFETY: the table's entry points may be called from any thread at the
// IRQLs they document (the CI's contract); the device object pointer is
// only read; the mutable state is behind a spin lock.
unsafe impl Send for FfiCi {}
// SAFETY: as above.
unsafe impl Sync for FfiCi {}

impl FfiCi {
    /// Queries `GUID_IB_CI_INTERFACE` from the filter's own stack at
    /// [`REQUIRED_CI_VERSION`] and checks what the miniport filled: a
    /// version that does not satisfy it is `STATUS_REVISION_MISMATCH`, a
    /// short or incomplete table `STATUS_NOT_SUPPORTED`; either way the
    /// reference is given back. PASSIVE_LEVEL (prepare-hardware).
    ///
    /// # Safety
    /// `device` is the live filter device, in `EvtDevicePrepareHardware`.
    pub unsafe fn query(device: WDFDEVICE) -> Result<Self, NtStatus> {
        // SAFETY: an all-zero CiInterface is valid: integers, null
        // pointers and `None` entry points.
        let mut table: CiInterface = unsafe { MaybeUninit::zeroed().assume_init() };
        // SAFETY: the live filter device; the table is writable for its
        // whole size, which is what is declared.
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfFdoQueryForInterface,
                device,
                &CI_INTERFACE_GUID,
                (&raw mut table.header).cast::<c_void>() as PINTERFACE,
                size_of::<CiInterface>() as u16,
                REQUIRED_CI_VERSION.packed(),
                core::ptr::null_mut()
            )
        };
        if status < 0 {
            return Err(NtStatus::from_raw(status as u32));
        }
        // SAFETY: the live filter device.
        let hca_device =
            unsafe { call_unsafe_wdf_function_binding!(WdfDeviceWdmGetAttachedDevice, device) };
        let version = InterfaceVersion::from_packed(table.header.version);
        let ci = Self {
            table,
            version,
            hca_device,
            events: SpinLock::new(None),
            released: AtomicBool::new(false),
        };
        let refusal = if check_version(version).is_err() {
            Some(REVISION_MISMATCH)
        } else if usize::from(ci.table.header.size) < size_of::<CiInterface>()
            || ci.table.open_ca.is_none()
            || ci.table.close_ca.is_none()
            || !ci.table.verbs.is_complete()
            || hca_device.is_null()
        {
            Some(NtStatus::NOT_SUPPORTED)
        } else {
            None
        };
        match refusal {
            Some(status) => {
                ci.release();
                Err(status)
            }
            None => Ok(ci),
        }
    }

    /// Gives the interface's reference back (once; later calls do
    /// nothing). DISPATCH_LEVEL or below.
    pub fn release(&self) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(dereference) = self.table.header.interface_dereference {
            // SAFETY: the reference the query took (type invariants), given
            // back once (the flag above).
            unsafe { dereference(self.table.header.context) };
        }
    }

    /// The table's context, or `None` once released.
    fn context(&self) -> Option<*mut c_void> {
        (!self.released.load(Ordering::Acquire)).then_some(self.table.header.context)
    }
}

/// A control-verb request for the CI: what [`FfiCi::submit`] turns into an
/// IRP.
pub struct CaIrp {
    ioctl: u32,
    input: Vec<u8>,
    output_len: usize,
    done: CaCompletion,
}

impl core::fmt::Debug for CaIrp {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CaIrp")
            .field("ioctl", &self.ioctl)
            .field("output_len", &self.output_len)
            .finish_non_exhaustive()
    }
}

/// What an IRP in flight carries to its completion routine; taken exactly
/// once, by the routine or by `submit` when the IRP was not taken.
struct InFlight {
    buffer: Vec<u8>,
    output_len: usize,
    done: CaCompletion,
}

type InFlightSlot = SpinLock<Option<InFlight>>;

impl CiRequests for FfiCi {
    fn control_request(
        &self,
        ioctl: u32,
        input: Vec<u8>,
        output_len: usize,
        done: CaCompletion,
    ) -> CaIrp {
        CaIrp {
            ioctl,
            input,
            output_len,
            done,
        }
    }
}

/// The completion routine of a control-verb IRP (see the module doc).
unsafe extern "C" fn ca_irp_completed(
    _device: PDEVICE_OBJECT,
    irp: PIRP,
    context: PVOID,
) -> NTSTATUS {
    // SAFETY: `context` is the `Arc<InFlightSlot>` reference `submit` gave
    // this routine (`Arc::into_raw`); it runs once per IRP.
    let slot = unsafe { Arc::from_raw(context.cast_const().cast::<InFlightSlot>()) };
    // SAFETY: the IRP this routine was set on, completed, still ours.
    let io_status = unsafe { (*irp).IoStatus };
    // SAFETY: a completed IRP's status is its `Status` member.
    let status = unsafe { io_status.__bindgen_anon_1.Status };
    let information = io_status.Information as usize;
    let taken = slot.lock().take();
    if let Some(in_flight) = taken {
        let written = information.min(in_flight.output_len);
        (in_flight.done)(
            NtStatus::from_raw(status as u32),
            &in_flight.buffer[..written],
        );
    }
    // SAFETY: allocated by `IoAllocateIrp` in `submit`, completed, and no
    // longer referenced by anyone: the filter owns it.
    unsafe { IoFreeIrp(irp) };
    MORE_PROCESSING_REQUIRED
}

impl CiAccess for FfiCi {
    type Request = CaIrp;

    fn version(&self) -> InterfaceVersion {
        self.version
    }

    fn identity(&self) -> Result<CaIdentity, IbStatus> {
        if self.context().is_none() {
            return Err(IbStatus::InvalidState);
        }
        Ok(CaIdentity {
            ca_guid: self.table.ca_guid,
            vendor_id: self.table.vendor_id,
            device_id: self.table.device_id,
            revision: self.table.revision,
        })
    }

    fn open_ca(&self, events: Arc<dyn CaEvents>) -> Result<u64, IbStatus> {
        let (Some(context), Some(open)) = (self.context(), self.table.open_ca) else {
            return Err(IbStatus::InvalidState);
        };
        let client = Box::new(events);
        let client_ptr = (&raw const *client).cast_mut().cast::<c_void>();
        let mut ca: u64 = 0;
        // SAFETY: the table's entry point with its context; the callbacks
        // are static; `client` stays boxed here until `close_ca` returned
        // (or the open failed, when no callback can come).
        let status = unsafe { open(context, &CA_CALLBACKS, client_ptr, &mut ca) };
        if !status.is_success() {
            return Err(IbStatus::from_ntstatus(status));
        }
        *self.events.lock() = Some(client);
        Ok(ca)
    }

    fn close_ca(&self, ca: u64) -> Result<(), IbStatus> {
        let (Some(context), Some(close)) = (self.context(), self.table.close_ca) else {
            return Err(IbStatus::InvalidState);
        };
        // SAFETY: the table's entry point with its context, PASSIVE_LEVEL
        // (the trait's contract).
        let status = unsafe { close(context, ca) };
        if !status.is_success() {
            return Err(IbStatus::from_ntstatus(status));
        }
        // No callback follows a close that returned: the client may go.
        let client = self.events.lock().take();
        drop(client);
        Ok(())
    }

    fn submit(&self, request: CaIrp) -> NtStatus {
        let CaIrp {
            ioctl,
            input,
            output_len,
            done,
        } = request;
        let (Some(context), Some(submit)) = (self.context(), self.table.verbs.submit) else {
            done(NOT_READY, &[]);
            return NOT_READY;
        };
        let mut buffer: Vec<u8> = Vec::new();
        let len = input.len().max(output_len);
        let (Ok(in_len), Ok(out_len)) = (ULONG::try_from(input.len()), ULONG::try_from(output_len))
        else {
            done(NtStatus::INVALID_PARAMETER, &[]);
            return NtStatus::INVALID_PARAMETER;
        };
        if buffer.try_reserve_exact(len).is_err() {
            done(NtStatus::INSUFFICIENT_RESOURCES, &[]);
            return NtStatus::INSUFFICIENT_RESOURCES;
        }
        buffer.extend_from_slice(&input);
        buffer.resize(len, 0);
        // SAFETY: the device attached below the filter lives while the
        // filter's device does (type invariants).
        let stack_size = unsafe { (*self.hca_device).StackSize };
        // SAFETY: DISPATCH_LEVEL or below; no quota charged.
        let irp = unsafe { IoAllocateIrp(stack_size, FALSE as u8) };
        if irp.is_null() {
            done(NtStatus::INSUFFICIENT_RESOURCES, &[]);
            return NtStatus::INSUFFICIENT_RESOURCES;
        }
        let system_buffer = buffer.as_mut_ptr().cast::<c_void>();
        let slot: Arc<InFlightSlot> = Arc::new(SpinLock::new(Some(InFlight {
            buffer,
            output_len,
            done,
        })));
        let routine_reference = Arc::into_raw(slot.clone());
        // SAFETY: a fresh IRP this function owns; nothing else reaches it
        // until it is submitted below.
        let irp_fields = unsafe { &mut *irp };
        // SAFETY: `Overlay` is the member of `Tail` the I/O manager uses
        // for an IRP being sent.
        let overlay = unsafe { irp_fields.Tail.Overlay };
        // SAFETY: `CurrentStackLocation` is the live member for such an IRP.
        let current = unsafe {
            overlay
                .__bindgen_anon_2
                .__bindgen_anon_1
                .CurrentStackLocation
        };
        // A fresh IRP's current location is one past its last, so the next
        // one (which the callee's `IoCallDriver` makes current) is just
        // below it.
        let next = current.wrapping_sub(1);
        // `system_buffer` is non-paged (wdk-alloc) and lives in the slot
        // until the completion routine or the refusal below.
        irp_fields.AssociatedIrp.SystemBuffer = system_buffer;
        // SAFETY: one of the `stack_size` locations of the IRP this
        // function owns.
        let stack = unsafe { &mut *next };
        stack.MajorFunction = IRP_MJ_INTERNAL_DEVICE_CONTROL as u8;
        stack.Parameters.DeviceIoControl.IoControlCode = ioctl;
        stack.Parameters.DeviceIoControl.InputBufferLength = in_len;
        stack.Parameters.DeviceIoControl.OutputBufferLength = out_len;
        // IoSetCompletionRoutine (an inline macro bindgen does not bind).
        stack.CompletionRoutine = Some(ca_irp_completed);
        stack.Context = routine_reference.cast_mut().cast::<c_void>();
        stack.Control = (SL_INVOKE_ON_SUCCESS | SL_INVOKE_ON_ERROR | SL_INVOKE_ON_CANCEL) as u8;
        // SAFETY: the table's entry point with its context and an IRP set
        // up for the HCA's device object (its contract).
        let status = unsafe { submit(context, irp.cast::<c_void>()) };
        if status != NtStatus::PENDING {
            // Not pending: the IRP was completed (its routine ran and took
            // the slot) or never taken; in the latter case it is still ours.
            let untaken = slot.lock().take();
            if let Some(in_flight) = untaken {
                // SAFETY: the routine's reference, never handed to a
                // routine that will run.
                drop(unsafe { Arc::from_raw(routine_reference) });
                // SAFETY: the IRP was not taken: still this function's.
                unsafe { IoFreeIrp(irp) };
                (in_flight.done)(status, &[]);
            }
        }
        status
    }

    fn post_send(&self, qp: u64, wrs: &[SendWr<'_>]) -> (usize, IbStatus) {
        let (Some(context), Some(post)) = (self.context(), self.table.verbs.post_send) else {
            return (0, IbStatus::InvalidState);
        };
        // SAFETY: the table's entry point with its own context.
        unsafe { post_one_by_one(context, qp, wrs, post, SendWrDesc::encode) }
    }

    fn post_recv(&self, qp: u64, wrs: &[RecvWr<'_>]) -> (usize, IbStatus) {
        let (Some(context), Some(post)) = (self.context(), self.table.verbs.post_recv) else {
            return (0, IbStatus::InvalidState);
        };
        // SAFETY: as in `post_send`.
        unsafe { post_one_by_one(context, qp, wrs, post, RecvWrDesc::encode) }
    }

    fn poll_cq(&self, cq: u64, wcs: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
        let (Some(context), Some(poll)) = (self.context(), self.table.verbs.poll_cq) else {
            return Err(IbStatus::InvalidState);
        };
        let capacity = u32::try_from(wcs.len()).unwrap_or(u32::MAX);
        let mut polled: u32 = 0;
        // SAFETY: the table's entry point; `wcs` is writable for
        // `capacity` completions for the call.
        let status = unsafe { poll(context, cq, wcs.as_mut_ptr(), capacity, &mut polled) };
        if status.is_success() {
            Ok((polled as usize).min(wcs.len()))
        } else {
            Err(IbStatus::from_ntstatus(status))
        }
    }

    fn arm_cq(&self, cq: u64, notify: CqNotify) -> Result<(), IbStatus> {
        let (Some(context), Some(arm)) = (self.context(), self.table.verbs.arm_cq) else {
            return Err(IbStatus::InvalidState);
        };
        // SAFETY: the table's entry point with its context.
        let status = unsafe { arm(context, cq, notify.code()) };
        if status.is_success() {
            Ok(())
        } else {
            Err(IbStatus::from_ntstatus(status))
        }
    }
}

/// The callbacks the filter opens the CA with.
static CA_CALLBACKS: EventCallbacks = EventCallbacks {
    completion: Some(ca_completion),
    async_event: Some(ca_async_event),
};

/// A completion event: to the filter's `CaEvents`.
unsafe extern "system" fn ca_completion(client: *mut c_void, cq: u64) {
    // SAFETY: `client` is the boxed `Arc<dyn CaEvents>` `open_ca` passed,
    // alive until `close_ca` returned, and no callback follows that.
    let events = unsafe { &*client.cast_const().cast::<Arc<dyn CaEvents>>() };
    events.completion(CqHandle::from_raw(cq));
}

/// An async event: parsed (untrusted bytes from below; a record that does
/// not parse is dropped) and handed to the filter's `CaEvents`.
unsafe extern "system" fn ca_async_event(client: *mut c_void, record: *const AsyncEventRecordAbi) {
    if record.is_null() {
        return;
    }
    // SAFETY: as in `ca_completion`.
    let events = unsafe { &*client.cast_const().cast::<Arc<dyn CaEvents>>() };
    // SAFETY: the record is valid for the call (the callback's contract).
    let abi = unsafe { *record };
    if let Ok(event) = AsyncEventRecord::parse(&abi) {
        events.async_event(&event);
    }
}

/// Posts `wrs` to `qp` through the table's `post` entry point, one WR per
/// call (no allocation, no batch buffer on the stack), each encoded by
/// `encode`: how many were taken and the status (a success without the WR
/// taken is a broken answer from below).
///
/// # Safety
/// `post` is an entry point of the CI table whose context is `context`,
/// the table still referenced.
unsafe fn post_one_by_one<W, D>(
    context: *mut c_void,
    qp: u64,
    wrs: &[W],
    post: unsafe extern "system" fn(*mut c_void, u64, *const D, u32, *mut u32) -> NtStatus,
    encode: impl Fn(&W) -> D,
) -> (usize, IbStatus) {
    for (done, wr) in wrs.iter().enumerate() {
        let desc = encode(wr);
        let mut posted: u32 = 0;
        // SAFETY: the table's entry point (caller); `desc` and its SGE list
        // live for the call.
        let status = unsafe { post(context, qp, &desc, 1, &mut posted) };
        if !status.is_success() {
            return (done, IbStatus::from_ntstatus(status));
        }
        if posted != 1 {
            return (done, IbStatus::GenericError);
        }
    }
    (wrs.len(), IbStatus::Success)
}
