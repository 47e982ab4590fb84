//! The in-process driver model: what a driver registered with the host
//! provides (the KMDF callbacks this stack uses, as a trait), and what the
//! host gives each device object in return.
//!
//! A driver registers under its service name. When the PnP manager builds a
//! device stack from an INF binding it calls the driver's
//! [`DriverEntry::add_device`] for its layer, and from then on calls that
//! layer's [`DeviceCallbacks`] — always at PASSIVE_LEVEL for PnP and power,
//! in the orders Windows guarantees (see `pnp` and `power`). Every callback
//! has a default that does what a KMDF driver without the callback would
//! get, so a sample driver implements only what it cares about.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use driver_platform::{ChildDescription, DevicePowerState, SystemPowerState};
use ib_types::interface::WinGuid;
use ib_types::status::NtStatus;

use crate::request::{HostRequest, StoppedRequest};
use crate::verifier::{Verifier, ViolationKind};

/// `STATUS_SUCCESS`.
pub const SUCCESS: NtStatus = NtStatus::from_raw(0);
/// `STATUS_UNSUCCESSFUL`: the generic refusal (a veto).
pub const UNSUCCESSFUL: NtStatus = NtStatus::from_raw(0xC000_0001);
/// `STATUS_NOT_SUPPORTED`: nobody in the stack handled the request.
pub const NOT_SUPPORTED: NtStatus = NtStatus::from_raw(0xC000_00BB);
/// `STATUS_NO_SUCH_DEVICE`: the device is gone (surprise removal).
pub const NO_SUCH_DEVICE: NtStatus = NtStatus::from_raw(0xC000_000E);
/// `STATUS_DELETE_PENDING`: the device is being removed.
pub const DELETE_PENDING: NtStatus = NtStatus::from_raw(0xC000_0056);
/// `STATUS_INVALID_PARAMETER`.
pub const INVALID_PARAMETER: NtStatus = NtStatus::from_raw(0xC000_000D);
/// `STATUS_CANCELLED`.
pub const CANCELLED: NtStatus = NtStatus::from_raw(0xC000_0120);

/// Where a device object sits in its stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StackRole {
    /// The physical device object, created by the parent bus.
    Pdo,
    /// A filter below the function driver.
    LowerFilter,
    /// The function driver (FDO).
    Function,
    /// A filter above the function driver.
    UpperFilter,
}

/// What a driver learns when it is asked to add a device object.
#[derive(Debug, Clone)]
pub struct DeviceInit {
    /// The devnode's instance path.
    pub instance_path: String,
    /// Its hardware IDs.
    pub hardware_ids: Vec<String>,
    /// The layer being added.
    pub role: StackRole,
}

/// A queried interface as the host hands it out: the provider's object
/// plus a reference counted against the provider (`InterfaceReference` on
/// query; the consumer must call [`InterfaceRef::dereference`]).
pub struct InterfaceRef {
    guid: WinGuid,
    version: u16,
    object: Arc<dyn Any + Send + Sync>,
    refs: Arc<AtomicUsize>,
    verifier: Verifier,
    consumer: Option<Arc<str>>,
    /// The driver whose device object answered (`None`: the host's PDO).
    provider: Option<Arc<str>>,
    released: bool,
}

impl fmt::Debug for InterfaceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InterfaceRef")
            .field("guid", &self.guid)
            .finish_non_exhaustive()
    }
}

impl InterfaceRef {
    pub(crate) fn new(
        guid: WinGuid,
        version: u16,
        object: Arc<dyn Any + Send + Sync>,
        refs: Arc<AtomicUsize>,
        verifier: Verifier,
        consumer: Option<Arc<str>>,
    ) -> Self {
        refs.fetch_add(1, Ordering::AcqRel);
        Self {
            guid,
            version,
            object,
            refs,
            verifier,
            consumer,
            provider: None,
            released: false,
        }
    }

    /// Records the driver that provides the interface (its routines are
    /// that driver's code).
    pub(crate) fn provided_by(mut self, provider: Arc<str>) -> Self {
        if &*provider != crate::pnp::HOST_PDO {
            self.provider = Some(provider);
        }
        self
    }

    /// The driver that provides the interface, if a driver does.
    pub fn provider(&self) -> Option<&str> {
        self.provider.as_deref()
    }

    /// Calls one of the interface's routines: `routine` runs as the
    /// provider's code (in its driver context, so what it does — completing
    /// a request, say — is charged to the provider), never after the
    /// provider's image unloaded (`CallbackIntoUnloadedDriver`, and `None`).
    /// `None` too if the object is not a `T`.
    pub fn call<T: Any + Send + Sync, R>(&self, routine: impl FnOnce(&T) -> R) -> Option<R> {
        let object = self.object.downcast_ref::<T>()?;
        let Some(provider) = &self.provider else {
            return Some(routine(object));
        };
        if !self.verifier.check_callback(provider, "interface routine") {
            return None;
        }
        let _provider = crate::context::enter(crate::context::Context::driver(
            self.verifier.clone(),
            provider.clone(),
        ));
        Some(routine(object))
    }

    /// The interface GUID.
    pub fn guid(&self) -> WinGuid {
        self.guid
    }

    /// The version the provider answered with (`INTERFACE::Version`): the
    /// closest it supports not above the one asked for. The consumer
    /// decides whether it can use it.
    pub fn version(&self) -> u16 {
        self.version
    }

    /// The provider's object, if it is a `T`.
    pub fn get<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.object.downcast_ref()
    }

    /// The same interface, to answer a query on another device object
    /// with: a bus driver's PDO that forwards a query to its parent's
    /// stack (as the IBAL bus filter's children forward the bus interface
    /// to the HCA's PDO) answers with the parent's object and version. The
    /// consumer's reference is then counted against the PDO's devnode; the
    /// forwarder gives its own reference on the parent back
    /// (`dereference`), as the parent outlives its children.
    pub fn forward(&self) -> ProvidedInterface {
        ProvidedInterface {
            version: self.version,
            object: self.object.clone(),
        }
    }

    /// `InterfaceDereference`: gives the reference back.
    pub fn dereference(mut self) {
        self.released = true;
        self.refs.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for InterfaceRef {
    fn drop(&mut self) {
        if !self.released {
            // The reference stays counted against the provider: removal of
            // the provider will see it outstanding.
            self.verifier.report(
                self.consumer.as_deref(),
                ViolationKind::ReferenceLeak {
                    what: format!(
                        "interface {} dropped without InterfaceDereference",
                        self.guid
                    ),
                },
            );
        }
    }
}

/// An interface a device object answers to `IRP_MN_QUERY_INTERFACE`.
#[derive(Clone)]
pub struct ProvidedInterface {
    /// The version it implements (`major << 8 | minor`).
    pub version: u16,
    /// The object consumers receive.
    pub object: Arc<dyn Any + Send + Sync>,
}

impl fmt::Debug for ProvidedInterface {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProvidedInterface")
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// How a device object passes a request down its stack.
pub trait Forward: Send + Sync {
    /// Sends `req` to the next lower device object (`WdfRequestSend` /
    /// `IoCallDriver`). With no lower device it completes with
    /// `STATUS_NOT_SUPPORTED`.
    fn forward(&self, req: HostRequest);
}

/// One driver's callbacks for one device object.
#[allow(unused_variables, reason = "default callbacks ignore their arguments")]
pub trait DeviceCallbacks: Send + Sync {
    /// `EvtDevicePrepareHardware` (start, before D0).
    fn prepare_hardware(&self) -> NtStatus {
        SUCCESS
    }
    /// `EvtDeviceSelfManagedIoInit`: the stack has started (every layer
    /// prepared and in D0, the devnode started, its queues accepting
    /// requests). Called bottom-up after each start of the stack: the
    /// first one, and a restart after a stop or a failure (KMDF's
    /// `EvtDeviceSelfManagedIoRestart` there); not on resume from sleep.
    /// Where a driver starts I/O it sends down its own stack at start.
    fn self_managed_io_init(&self) {}
    /// `EvtDeviceReleaseHardware` (stop or remove, after leaving D0).
    fn release_hardware(&self) -> NtStatus {
        SUCCESS
    }
    /// `EvtDeviceD0Entry`.
    fn d0_entry(&self, from: DevicePowerState) -> NtStatus {
        SUCCESS
    }
    /// `EvtDeviceD0Exit`.
    fn d0_exit(&self, to: DevicePowerState) -> NtStatus {
        SUCCESS
    }
    /// `EvtDeviceD0EntryPostInterruptsEnabled`: after D0 entry, once the
    /// device's interrupts are connected and enabled (where a driver
    /// starts a device that needs its interrupts).
    fn d0_entry_post_interrupts_enabled(&self, from: DevicePowerState) -> NtStatus {
        SUCCESS
    }
    /// `EvtDeviceD0ExitPreInterruptsDisabled`: before the device's
    /// interrupts are disabled and disconnected, then D0 exit.
    fn d0_exit_pre_interrupts_disabled(&self, to: DevicePowerState) -> NtStatus {
        SUCCESS
    }
    /// `IRP_MN_QUERY_REMOVE_DEVICE`: anything but success vetoes.
    fn query_remove(&self) -> NtStatus {
        SUCCESS
    }
    /// `IRP_MN_QUERY_STOP_DEVICE`: anything but success vetoes.
    fn query_stop(&self) -> NtStatus {
        SUCCESS
    }
    /// `IRP_MN_CANCEL_REMOVE_DEVICE` / `CANCEL_STOP`: the veto of someone
    /// else undid the query.
    fn cancel_remove(&self) {}
    /// `EvtDeviceSurpriseRemoval`: the hardware is gone; complete what is
    /// outstanding.
    fn surprise_removal(&self) {}
    /// `IRP_MN_QUERY_POWER` for a system transition: anything but success
    /// vetoes it.
    fn query_power(&self, target: SystemPowerState) -> NtStatus {
        SUCCESS
    }
    /// `EvtDeviceFileCreate` (`IRP_MJ_CREATE`): a process opens a handle
    /// (`crate::file`). PASSIVE_LEVEL, in the opening process's context;
    /// anything but success fails the open.
    fn file_create(&self, file: &crate::file::FileObject) -> NtStatus {
        SUCCESS
    }
    /// `EvtFileCleanup` (`IRP_MJ_CLEANUP`): the file object's last handle
    /// was closed (requests on it may still be in flight). PASSIVE_LEVEL,
    /// in the closing process's context: release what the driver locked
    /// or mapped in that process.
    fn file_cleanup(&self, file: &crate::file::FileObject) {}
    /// `EvtFileClose` (`IRP_MJ_CLOSE`): the last reference to the file
    /// object is gone. PASSIVE_LEVEL, arbitrary thread context.
    fn file_close(&self, file: &crate::file::FileObject) {}
    /// `EvtIoInCallerContext`: a request reached this device object, in
    /// the issuing thread's context (a user request's process, at the
    /// sender's IRQL), before any queue holds it. The driver reaches into
    /// the caller here (probe and lock its buffers, map pages into it),
    /// keeps what it needs in the request's context
    /// (`HostRequest::set_context`), and returns the request to be queued
    /// (`WdfDeviceEnqueueRequest`), or completes it and returns `None`.
    /// The queue then presents it through [`io_request`](Self::io_request),
    /// possibly much later and in another context (held below D0 and
    /// delivered on resume). The default enqueues it unchanged.
    fn io_in_caller_context(&self, req: HostRequest) -> Option<HostRequest> {
        Some(req)
    }
    /// A request reached this device object: complete it, keep it pending,
    /// or pass it down with `lower.forward(req)` (the default).
    fn io_request(&self, lower: &dyn Forward, req: HostRequest) {
        lower.forward(req);
    }
    /// `EvtIoStop` of this object's power-managed queue: called when the
    /// device leaves D0 (or is removed), once for every request the queue
    /// presented and the driver has not completed. The driver completes
    /// the request, or acknowledges it through `stopped`
    /// (`WdfRequestStopAcknowledge`: keep it, or `requeue` it), now or
    /// later; the transition waits for one or the other. The default —
    /// KMDF without `EvtIoStop` — does neither, so the framework waits for
    /// the driver to complete the request: right for a driver that never
    /// holds a request long, a stuck sleep for one that does.
    fn io_stop(&self, stopped: &StoppedRequest) {}
    /// `EvtIoResume`: the device is back in D0; `request` was acknowledged
    /// without requeue in `io_stop` and the driver still owns it.
    fn io_resume(&self, request: &StoppedRequest) {}
    /// `IRP_MN_QUERY_INTERFACE`: answer for `guid` with the closest
    /// version this object supports not above `version`, or `None` (none
    /// that low, or not this GUID) to pass the query down the stack.
    fn query_interface(&self, guid: &WinGuid, version: u16) -> Option<ProvidedInterface> {
        None
    }
    /// For PDOs: the resources the bus assigned this device (for a PCI
    /// function, a [`crate::pci::PciFunction`]), which the function driver
    /// above finds at start through `DeviceServices::resources`.
    fn resources(&self) -> Option<Arc<dyn Any + Send + Sync>> {
        None
    }
    /// For bus drivers: the PDO callbacks of a child this device reported.
    fn create_child(&self, child: &ChildDescription) -> Option<Arc<dyn DeviceCallbacks>> {
        None
    }
    /// Whether this object's queue holds requests while the device is below
    /// D0 (`WDF_IO_QUEUE_CONFIG::PowerManaged`). The default is KMDF's for
    /// function drivers and PDOs: power-managed. A filter's queues are never
    /// power-managed here (KMDF's default once `WdfFdoInitSetFilter` was
    /// called); a WDM driver without KMDF queues (the host's PCI bus and
    /// root PDOs) answers false.
    fn power_managed_queue(&self) -> bool {
        true
    }
}

/// A driver: `DriverEntry` plus `EvtDriverDeviceAdd`.
pub trait DriverEntry: Send + Sync + 'static {
    /// Creates this driver's device object for a new stack layer.
    fn add_device(
        &self,
        init: &DeviceInit,
        host: &crate::pnp::DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus>;
}
