//! The IBAL bus filter's shell on the simulated Windows host: the Linux
//! counterpart of the KMDF shell `ibal-bus` will hold (not written yet),
//! binding `ibal-bus-core` to the host's driver model (docs/ibal-bus.md).
//! Tests register it under the service name the INF installs
//! ([`SERVICE`]), replacing the `ibalbus` stand-in of `sim_host::samples`;
//! the host adds it as the upper filter of every HCA stack.
//!
//! What each callback does (KMDF name in brackets):
//! - [`DriverEntry::add_device`] (`EvtDriverDeviceAdd` with
//!   `WdfFdoInitSetFilter`): an [`IbalBusDevice`] for an upper-filter
//!   layer; any other layer is refused (`STATUS_INVALID_DEVICE_REQUEST`).
//! - `prepare_hardware` (`EvtDevicePrepareHardware`): queries
//!   `GUID_IB_CI_INTERFACE` from its own stack at
//!   [`REQUIRED_CI_VERSION`] (`WdfFdoQueryForInterface`) and checks the
//!   version answered (`ca_registry::check_version`): a mismatch fails the
//!   start with `STATUS_REVISION_MISMATCH`, the interface dereferenced and
//!   nothing opened or registered. The miniport below has not started its
//!   HCA yet (every layer prepares before any enters D0), so nothing else
//!   happens here.
//! - `d0_entry` (`EvtDeviceD0Entry`), the first time: the HCA below is
//!   in D0 and started. Reads the child list (PASSIVE_LEVEL registry
//!   reads), opens the CA (`OpenedCa::open`: identity, `open_ca` with the
//!   filter's callbacks; a failure fails the start). Later D0 entries
//!   (resume) do nothing: the CA stays open across sleep.
//! - `self_managed_io_init` (`EvtDeviceSelfManagedIoInit`, and
//!   `EvtDeviceSelfManagedIoRestart` after a stop; PASSIVE_LEVEL, the
//!   stack started and taking requests): sends a `QueryCa` control verb on
//!   the opened CA through the interface's `submit`, with a completion
//!   routine, and does not wait.
//! - the `QueryCa` completion (any IRQL up to DISPATCH_LEVEL): the ports
//!   from the attribute block (`ci::ports_from_attributes`), the bind
//!   completed (`OpenedCa::with_ports`), the CA registered in the driver's
//!   [`CaRegistry`], and one child per port per entry reported present
//!   (`ChildBus::report_present`, a KMDF static child list's
//!   `WdfChildListAddOrUpdateChildDescriptionAsPresent`). A failed query
//!   keeps the opened CA for release-hardware to close.
//! - [`IbalBusDevice::registry_changed`] (the shell's handler of a
//!   registry change notification on the Parameters key, PASSIVE_LEVEL):
//!   re-reads the list and reports the children that appeared present and
//!   those that disappeared missing (`ChildSet::reconcile`).
//! - `release_hardware` (`EvtDeviceReleaseHardware`): deregisters the CA,
//!   closes it (a query still in flight finds the binding gone), and
//!   dereferences the interface.
//!   The children reported stay, as a KMDF child list lives as long as its
//!   device: when the stack starts again (after a stop, or a restart after
//!   a failure) the list is read again and reconciled against them, so a
//!   child whose entry stayed keeps its devnode and instance ID.
//! - `create_child` (the child list's `EvtChildListCreateDevice`): a
//!   [`PortChildPdo`] for the port and entry; its queue is power-managed
//!   (KMDF's default for a PDO). It forwards `IRP_MN_QUERY_INTERFACE` for
//!   `GUID_BUS_INTERFACE_STANDARD` to the HCA's stack, whose PCI PDO
//!   answers, so `IoGetDmaAdapter` on a child gives the HCA's own DMA
//!   adapter (`sim_host::pci::BusInterfaceStandard`). The AL interface is
//!   not built (docs/ibal-bus.md).
//! - the CA callbacks (`ci::CaEvents`): counted ([`IbalBusDevice::ca_events`]);
//!   the access layer that will deliver them to clients is not built.
//! - the filter's queue is not power-managed (KMDF's default for a
//!   filter); kernel requests pass down unchanged.
//! - the user-mode proxy ([`crate::ibal_proxy`]): add-device assigns the
//!   stack's security descriptor and registers the device interface,
//!   self-managed I/O init enables it and release-hardware disables it;
//!   `file_create`, `file_cleanup` and `io_in_caller_context` delegate to
//!   it (user requests judged per open before they go down).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use driver_platform::{ChildBus, ChildDescription, DevicePowerState, Request, RequestorMode};
use hca_miniport_core::ci::CiProvider;
use hca_miniport_core::verbs::CaClient;
use ib_types::cq::CqNotify;
use ib_types::event::AsyncEventRecord;
use ib_types::handle::CqHandle;
use ib_types::interface::{GUID_IB_CI_INTERFACE, InterfaceVersion, WinGuid};
use ib_types::ioctl::{
    Empty, QueryCa, Verb, decode_response, encode_request, request_len, response_len,
};
use ib_types::scalars::NodeGuid;
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendWr};
use ibal_bus_core::ca_registry::{BoundCa, CaRegistry, OpenedCa, check_version};
use ibal_bus_core::children::{ChildList, ChildSet, PortChild, port_children, read_child_list};
use ibal_bus_core::ci::{
    CaEvents, CaIdentity, CiAccess, REQUIRED_CI_VERSION, ports_from_attributes,
};
use sim_host::driver::{
    DeviceCallbacks, DeviceInit, DriverEntry, InterfaceRef, ProvidedInterface, SUCCESS, StackRole,
};
use sim_host::host::Host;
use sim_host::pci::GUID_BUS_INTERFACE_STANDARD;
use sim_host::platform::SimPlatform;
use sim_host::pnp::DeviceServices;
use sim_host::request::HostRequest;

/// The service name `inf/hca-miniport.inf` installs the filter under.
pub const SERVICE: &str = "ibalbus";

/// Room for the `QueryCa` answer's attribute block (a CA of up to a few
/// ports with their tables fits many times over).
const QUERY_CA_ROOM: u32 = 16 * 1024;

/// The miniport's CI provider as the host hands it out.
type Provider = CiProvider<SimPlatform>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The CI interface of one HCA as this shell reaches it: the host's
/// counted reference to the miniport's [`CiProvider`]; every routine runs
/// as the provider's code (`InterfaceRef::call`).
pub struct SimCi {
    interface: Mutex<Option<Arc<InterfaceRef>>>,
    version: InterfaceVersion,
}

impl std::fmt::Debug for SimCi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimCi")
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl SimCi {
    fn call<R>(&self, routine: impl FnOnce(&Provider) -> R) -> Option<R> {
        let interface = lock(&self.interface).clone()?;
        interface.call::<Arc<Provider>, R>(|provider| routine(provider))
    }

    /// `InterfaceDereference`, once no routine is in flight.
    fn dereference(&self) {
        if let Some(interface) = lock(&self.interface).take() {
            // At release nothing of the filter calls the interface any
            // more (the work item is flushed; no client exists yet), so
            // this is the last clone. Were a routine still running, its
            // clone would be the last, and dropping it is reported as a
            // reference leak by the host.
            if let Ok(interface) = Arc::try_unwrap(interface) {
                interface.dereference();
            }
        }
    }
}

/// The filter's callbacks adapted to the miniport's client trait.
struct EventsToClient(Arc<dyn CaEvents>);

impl CaClient for EventsToClient {
    fn completion(&self, cq: CqHandle) {
        self.0.completion(cq);
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        self.0.async_event(event);
    }
}

impl CiAccess for SimCi {
    type Request = HostRequest;

    fn version(&self) -> InterfaceVersion {
        self.version
    }

    fn identity(&self) -> Result<CaIdentity, IbStatus> {
        self.call(|p| p.identity()).ok_or(IbStatus::InvalidState)?
    }

    fn open_ca(&self, events: Arc<dyn CaEvents>) -> Result<u64, IbStatus> {
        self.call(|p| p.open_ca(Arc::new(EventsToClient(events))))
            .ok_or(IbStatus::InvalidState)?
    }

    fn close_ca(&self, ca: u64) -> Result<(), IbStatus> {
        self.call(|p| p.close_ca(ca))
            .ok_or(IbStatus::InvalidState)?
    }

    fn submit(&self, request: HostRequest) -> NtStatus {
        let mut request = Some(request);
        match self.call(|p| p.submit(request.take().expect("submitted once"))) {
            Some(status) => status,
            None => {
                // The interface is gone: the request is still ours.
                if let Some(request) = request {
                    request.complete(NtStatus::INVALID_DEVICE_STATE, 0);
                }
                NtStatus::INVALID_DEVICE_STATE
            }
        }
    }

    fn post_send(&self, qp: u64, wrs: &[SendWr<'_>]) -> (usize, IbStatus) {
        self.call(|p| p.post_send(qp, wrs))
            .unwrap_or((0, IbStatus::InvalidState))
    }

    fn post_recv(&self, qp: u64, wrs: &[RecvWr<'_>]) -> (usize, IbStatus) {
        self.call(|p| p.post_recv(qp, wrs))
            .unwrap_or((0, IbStatus::InvalidState))
    }

    fn poll_cq(&self, cq: u64, wcs: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
        self.call(|p| p.poll_cq(cq, wcs))
            .ok_or(IbStatus::InvalidState)?
    }

    fn arm_cq(&self, cq: u64, notify: CqNotify) -> Result<(), IbStatus> {
        self.call(|p| p.arm_cq(cq, notify))
            .ok_or(IbStatus::InvalidState)?
    }
}

/// Counts the CA's callbacks (the access layer that will route them to
/// clients is not built).
#[derive(Debug, Default)]
struct FilterEvents {
    count: AtomicU64,
}

impl CaEvents for FilterEvents {
    fn completion(&self, _cq: CqHandle) {
        self.count.fetch_add(1, Ordering::Relaxed);
    }
    fn async_event(&self, _event: &AsyncEventRecord) {
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

/// Where one filter device is in its binding.
enum Binding {
    /// Not started, or released.
    Idle,
    /// The interface is queried and its version checked.
    Queried(Arc<SimCi>),
    /// The CA is open; the port query is in flight.
    Opening(OpenedCa<SimCi>),
    /// The port query failed: the opened CA waits for release-hardware.
    Failed(OpenedCa<SimCi>),
    /// Bound and registered.
    Bound(Arc<BoundCa<SimCi>>),
    /// Bound, but a CA with the same GUID was registered by another
    /// stack: not registered, no children; closed at release.
    Duplicate(Arc<BoundCa<SimCi>>),
}

/// The driver: the CA registry shared by its devices, and the devices.
pub struct IbalBusDriver {
    registry: Arc<Mutex<CaRegistry<SimCi>>>,
    devices: Arc<Mutex<Vec<Arc<IbalBusDevice>>>>,
}

impl std::fmt::Debug for IbalBusDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbalBusDriver").finish_non_exhaustive()
    }
}

impl IbalBusDriver {
    /// Registers the filter on `host` under [`SERVICE`] (replacing the
    /// stand-in registered there before).
    pub fn register(host: &Host) -> Arc<Self> {
        let driver = Arc::new(Self {
            registry: Arc::default(),
            devices: Arc::default(),
        });
        host.register_driver(SERVICE, driver.clone());
        driver
    }

    /// The devices added so far, in order.
    pub fn devices(&self) -> Vec<Arc<IbalBusDevice>> {
        lock(&self.devices).clone()
    }

    /// The GUIDs of the CAs registered now.
    pub fn registered_cas(&self) -> Vec<NodeGuid> {
        lock(&self.registry).guids()
    }

    /// A registry change on the filter's Parameters key: every device
    /// re-reads its list. PASSIVE_LEVEL.
    pub fn registry_changed(&self) {
        for device in self.devices() {
            device.registry_changed();
        }
    }
}

impl DriverEntry for IbalBusDriver {
    fn add_device(
        &self,
        init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        if init.role != StackRole::UpperFilter {
            return Err(NtStatus::INVALID_DEVICE_REQUEST);
        }
        // The proxy's administrator IOCTL changes the driver-wide list:
        // every device reconciles, as after a registry notification.
        let devices = Arc::downgrade(&self.devices);
        let reconcile: crate::ibal_proxy::Reconcile = Arc::new(move || {
            let all = devices
                .upgrade()
                .map(|d| lock(&d).clone())
                .unwrap_or_default();
            for device in all {
                device.registry_changed();
            }
        });
        let device = Arc::new_cyclic(|me| IbalBusDevice {
            me: me.clone(),
            host: host.clone(),
            registry: self.registry.clone(),
            binding: Mutex::new(Binding::Idle),
            list: Mutex::default(),
            children: Mutex::default(),
            events: Arc::default(),
            proxy: crate::ibal_proxy::IbalProxy::new(host.clone(), reconcile),
        });
        lock(&self.devices).push(device.clone());
        Ok(device)
    }
}

/// The filter's device object on one HCA stack.
pub struct IbalBusDevice {
    me: Weak<IbalBusDevice>,
    host: DeviceServices,
    registry: Arc<Mutex<CaRegistry<SimCi>>>,
    binding: Mutex<Binding>,
    list: Mutex<ChildList>,
    children: Mutex<ChildSet>,
    events: Arc<FilterEvents>,
    /// The user-mode proxy (`crate::ibal_proxy`).
    proxy: crate::ibal_proxy::IbalProxy,
}

impl std::fmt::Debug for IbalBusDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbalBusDevice")
            .field("host", &self.host)
            .finish_non_exhaustive()
    }
}

impl IbalBusDevice {
    /// The bound CA, once the port query answered.
    pub fn bound(&self) -> Option<Arc<BoundCa<SimCi>>> {
        match &*lock(&self.binding) {
            Binding::Bound(bound) => Some(bound.clone()),
            _ => None,
        }
    }

    /// The children reported present now.
    pub fn children(&self) -> Vec<PortChild> {
        lock(&self.children).iter().cloned().collect()
    }

    /// The child list as last read (entries and refusals).
    pub fn child_list(&self) -> ChildList {
        lock(&self.list).clone()
    }

    /// The user-mode proxy of this HCA.
    pub fn proxy(&self) -> &crate::ibal_proxy::IbalProxy {
        &self.proxy
    }

    /// How many CA callbacks arrived.
    pub fn ca_events(&self) -> u64 {
        self.events.count.load(Ordering::Relaxed)
    }

    /// A registry change on the Parameters key: re-reads the list and
    /// reports what appeared and disappeared. PASSIVE_LEVEL.
    pub fn registry_changed(&self) {
        if let Some(view) = self.host.registry() {
            *lock(&self.list) = read_child_list(&view);
        }
        if let Some(bound) = self.bound() {
            self.report_children(&bound);
        }
    }

    fn report_children(&self, bound: &BoundCa<SimCi>) {
        let desired = port_children(bound.identity().ca_guid, bound.ports(), &lock(&self.list));
        let changes = lock(&self.children).reconcile(desired);
        for gone in &changes.disappeared {
            self.host.report_missing(gone.instance_id());
        }
        for child in changes.appeared {
            // Only fails once the device is gone, when nothing is to report.
            let _ = self.host.report_present(child.description);
        }
    }

    /// The `QueryCa` answered (see the module doc): completes the bind,
    /// registers the CA and reports its children. Up to DISPATCH_LEVEL.
    fn ports_answered(&self, ports: Result<Vec<ibal_bus_core::ci::PortIdentity>, IbStatus>) {
        let mut binding = lock(&self.binding);
        let opened = match std::mem::replace(&mut *binding, Binding::Idle) {
            Binding::Opening(opened) => opened,
            other => {
                *binding = other;
                return;
            }
        };
        drop(binding);
        let bound = match opened.with_ports(ports) {
            Ok(bound) => Arc::new(bound),
            Err((opened, _error)) => {
                *lock(&self.binding) = Binding::Failed(opened);
                return;
            }
        };
        if let Err((bound, _error)) = lock(&self.registry).register(bound.clone()) {
            // Another stack registered this CA: this one stays unbound and
            // closes its CA at release.
            *lock(&self.binding) = Binding::Duplicate(bound);
            return;
        }
        *lock(&self.binding) = Binding::Bound(bound.clone());
        self.report_children(&bound);
    }

    /// Opens the CA (first D0 entry); the port query follows in
    /// self-managed I/O init.
    fn open_ca(&self, ci: Arc<SimCi>) -> NtStatus {
        if let Some(view) = self.host.registry() {
            *lock(&self.list) = read_child_list(&view);
        }
        let opened = match OpenedCa::open(ci, self.events.clone()) {
            Ok(opened) => opened,
            Err(error) => return error.nt_status(),
        };
        *lock(&self.binding) = Binding::Opening(opened);
        SUCCESS
    }

    /// Sends the `QueryCa` on the opened CA, with a completion routine
    /// that finishes the bind (self-managed I/O init). PASSIVE_LEVEL.
    fn send_port_query(&self) {
        let (ci, ca) = match &*lock(&self.binding) {
            Binding::Opening(opened) => (opened.ci().clone(), opened.ca_handle()),
            _ => return,
        };
        if let Err(status) = self.submit_port_query(&ci, ca) {
            self.ports_answered(Err(IbStatus::from_ntstatus(status)));
        }
    }

    fn submit_port_query(&self, ci: &SimCi, ca: u64) -> Result<(), NtStatus> {
        let (Some(in_len), Some(out_len)) = (
            request_len::<QueryCa>(0),
            response_len::<QueryCa>(QUERY_CA_ROOM as usize),
        ) else {
            return Err(NtStatus::INSUFFICIENT_RESOURCES);
        };
        let mut bytes = vec![0; in_len];
        encode_request::<QueryCa>(ca, &Empty, &[], QUERY_CA_ROOM, &mut bytes)
            .map_err(|_| NtStatus::INVALID_PARAMETER)?;
        let verifier = self.host.verifier().ok_or(NtStatus::INVALID_DEVICE_STATE)?;
        let (mut request, _issuer) = HostRequest::new(
            &verifier,
            QueryCa::ID.ioctl().raw(),
            RequestorMode::Kernel,
            bytes,
            out_len,
        );
        let me = self.me.clone();
        request.set_completion_routine(Box::new(move |status, information, output| {
            let ports = if status.is_success() {
                let len = usize::try_from(*information).unwrap_or(usize::MAX);
                match output.get(..len).map(decode_response::<QueryCa>) {
                    Some(Ok(response)) if response.status == IbStatus::Success => {
                        ports_from_attributes(response.private)
                    }
                    Some(Ok(response)) => Err(response.status),
                    _ => Err(IbStatus::GenericError),
                }
            } else {
                Err(IbStatus::from_ntstatus(*status))
            };
            if let Some(device) = me.upgrade() {
                device.ports_answered(ports);
            }
        }));
        // Completion is reported through the routine, now or later.
        ci.submit(request);
        Ok(())
    }
}

impl DeviceCallbacks for IbalBusDevice {
    fn prepare_hardware(&self) -> NtStatus {
        let Some(interface) = self
            .host
            .query_interface(&GUID_IB_CI_INTERFACE, REQUIRED_CI_VERSION.packed())
        else {
            return NtStatus::NOT_SUPPORTED;
        };
        let version = InterfaceVersion::from_packed(interface.version());
        if let Err(error) = check_version(version) {
            interface.dereference();
            return error.nt_status();
        }
        if interface.get::<Arc<Provider>>().is_none() {
            interface.dereference();
            return NtStatus::INVALID_DEVICE_STATE;
        }
        let ci = Arc::new(SimCi {
            interface: Mutex::new(Some(Arc::new(interface))),
            version,
        });
        *lock(&self.binding) = Binding::Queried(ci);
        SUCCESS
    }

    fn d0_entry(&self, _from: DevicePowerState) -> NtStatus {
        let ci = match &*lock(&self.binding) {
            Binding::Queried(ci) => ci.clone(),
            // Resume: the CA stayed open across sleep.
            _ => return SUCCESS,
        };
        self.open_ca(ci)
    }

    fn self_managed_io_init(&self) {
        self.send_port_query();
        self.proxy.started();
    }

    fn file_create(&self, file: &sim_host::file::FileObject) -> NtStatus {
        self.proxy.file_create(file)
    }

    fn file_cleanup(&self, file: &sim_host::file::FileObject) {
        self.proxy.file_cleanup(file);
    }

    fn io_in_caller_context(&self, req: HostRequest) -> Option<HostRequest> {
        self.proxy.in_caller_context(req)
    }

    fn release_hardware(&self) -> NtStatus {
        self.proxy.stopped();
        let binding = std::mem::replace(&mut *lock(&self.binding), Binding::Idle);
        // The children stay (a KMDF child list lives as long as its
        // device): after a restart the list read again is reconciled
        // against them; on removal the PnP manager removes them first.
        let ci = match binding {
            Binding::Idle => None,
            Binding::Queried(ci) => Some(ci),
            Binding::Opening(opened) | Binding::Failed(opened) => {
                let ci = opened.ci().clone();
                let _ = opened.close();
                Some(ci)
            }
            Binding::Duplicate(bound) => Some(close_bound(bound)),
            Binding::Bound(bound) => {
                let guid = bound.identity().ca_guid;
                let mut registry = lock(&self.registry);
                if registry
                    .get(guid)
                    .is_some_and(|registered| Arc::ptr_eq(registered, &bound))
                {
                    registry.deregister(guid);
                }
                drop(registry);
                Some(close_bound(bound))
            }
        };
        if let Some(ci) = ci {
            ci.dereference();
        }
        SUCCESS
    }

    fn create_child(&self, child: &ChildDescription) -> Option<Arc<dyn DeviceCallbacks>> {
        let port = lock(&self.children)
            .iter()
            .find(|c| c.instance_id() == child.instance_id)
            .cloned()?;
        Some(Arc::new(PortChildPdo {
            port,
            parent: self.host.clone(),
        }))
    }

    fn power_managed_queue(&self) -> bool {
        false
    }
}

/// Closes a bound CA (PASSIVE_LEVEL); returns its interface.
fn close_bound(bound: Arc<BoundCa<SimCi>>) -> Arc<SimCi> {
    let ci = bound.ci().clone();
    match Arc::try_unwrap(bound) {
        Ok(bound) => {
            let _ = bound.unbind();
        }
        Err(shared) => {
            let _ = ci.close_ca(shared.ca_handle());
        }
    }
    ci
}

/// The PDO of one port's child (the child list's
/// `EvtChildListCreateDevice`): where it sits. Its queue is
/// power-managed, KMDF's default for a PDO.
pub struct PortChildPdo {
    port: PortChild,
    /// The filter's device on the HCA stack: where the bus interface is
    /// queried.
    parent: DeviceServices,
}

impl std::fmt::Debug for PortChildPdo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortChildPdo")
            .field("instance_id", &self.port.instance_id())
            .finish()
    }
}

impl PortChildPdo {
    /// The port and entry this child stands for.
    pub fn port(&self) -> &PortChild {
        &self.port
    }
}

impl DeviceCallbacks for PortChildPdo {
    /// `GUID_BUS_INTERFACE_STANDARD` is forwarded to the HCA's stack, whose
    /// PCI PDO answers it: `IoGetDmaAdapter` on the child gets the HCA's
    /// own adapter. The filter's reference on the HCA's stack is given
    /// back at once; the consumer's is counted against the child.
    fn query_interface(&self, guid: &WinGuid, version: u16) -> Option<ProvidedInterface> {
        if *guid != GUID_BUS_INTERFACE_STANDARD {
            return None;
        }
        let parent = self.parent.query_interface(guid, version)?;
        let provided = parent.forward();
        parent.dereference();
        Some(provided)
    }
}
