//! The IBAL bus filter's shell on the simulated Windows host: the Linux
//! counterpart of the KMDF shell in `ibal-bus/src/kmdf`, callback for
//! callback, binding `ibal-bus-core` to the host's driver model (docs/ibal-bus.md).
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
//!   from the answer (`ci::ports_from_answer`), the bind
//!   completed (`OpenedCa::with_ports`), the CA registered in the driver's
//!   [`CaRegistry`], and one child per port per entry reported present
//!   (`ChildBus::report_present`, a KMDF static child list's
//!   `WdfChildListAddOrUpdateChildDescriptionAsPresent`). A failed query
//!   keeps the opened CA for release-hardware to close.
//! - [`IbalBusDevice::registry_changed`] (the shell's handler of a
//!   registry change notification on the Parameters key, PASSIVE_LEVEL):
//!   re-reads the list and reports the children that appeared present and
//!   those that disappeared missing (`ChildSet::reconcile`).
//! - `release_hardware` (`EvtDeviceReleaseHardware`): drops the access
//!   layer (a client still open finds its calls refused) after sending the
//!   orphans' destroys again (`AccessLayer::destroy_orphans`: what the CA
//!   refused at a client's close, which would keep `close_ca` refusing),
//!   deregisters the CA, closes it (a query still in flight finds the
//!   binding gone), and dereferences the interface.
//!   The children reported stay, as a KMDF child list lives as long as its
//!   device: when the stack starts again (after a stop, or a restart after
//!   a failure) the list is read again and reconciled against them, so a
//!   child whose entry stayed keeps its devnode and instance ID.
//! - `create_child` (the child list's `EvtChildListCreateDevice`): a
//!   [`PortChildPdo`] for the port and entry; its queue is power-managed
//!   (KMDF's default for a PDO). It forwards `IRP_MN_QUERY_INTERFACE` for
//!   `GUID_BUS_INTERFACE_STANDARD` to the HCA's stack, whose PCI PDO
//!   answers, so `IoGetDmaAdapter` on a child gives the HCA's own DMA
//!   adapter (`sim_host::pci::BusInterfaceStandard`). It answers
//!   `GUID_IB_AL_INTERFACE` itself, at [`AL_INTERFACE_VERSION`] when asked
//!   at it or above, with its [`AlPortInterface`] (the port's data and the
//!   access layer's entry points), the consumer's reference counted
//!   against the child's devnode. Its `io_request` is the IOCTL path: an
//!   internal device-control request carrying an AL verb is served by the
//!   same `AccessLayer::submit`, for the client whose tag the header's
//!   handle carries among those opened through this child
//!   (docs/ibal-bus.md "The IOCTL path").
//! - the `QueryCa` completion also creates the [`SimAccessLayer`] over the
//!   bound CA (before the children are reported, so their interface finds
//!   it); release-hardware drops it first. A stop is vetoed
//!   (`query_stop`, `STATUS_DEVICE_BUSY`) while a client is open.
//! - the CA callbacks (`ci::CaEvents`): counted ([`IbalBusDevice::ca_events`])
//!   and forwarded to the access layer, which routes them to the owning
//!   client; `LocalCatastrophic` (the device failed) is routed like the
//!   others and does not remove the CA: the failed miniport still hands
//!   back every outstanding WR flushed and frees what its clients destroy,
//!   and the CA goes at the stack's surprise removal, which follows;
//!   `PortActive` (a port came up: its tables may have changed while it
//!   was down, and the CA raises no table event) sends a `QueryCa` whose
//!   answer is compared port by port with the last one, each change told
//!   to every client (`AccessLayer::port_changed`: `PkeyChange`,
//!   `GidChange`).
//! - surprise removal: a child's (`PortChildPdo`'s
//!   `EvtDeviceSurpriseRemoval`, which PnP runs before the HCA's) tells
//!   the access layer its CA is gone if the HCA's function left the bus,
//!   and so does the filter's own (`surprise_removal`): the clients hear
//!   it before their own removal goes on, requests end with
//!   `STATUS_DEVICE_REMOVED`, closes send no destroy. The child's
//!   `EvtIoStop` (purge, the function gone) acknowledges the AL requests
//!   its queue presented that are still at the gone CA, so the removal
//!   does not wait for the device's command timeout; the client's close
//!   ends them.
//! - the filter's queue is not power-managed (KMDF's default for a
//!   filter); kernel requests pass down unchanged.
//! - the user-mode proxy ([`crate::ibal_proxy`]): add-device registers the
//!   device interface (the stack's security descriptor is the INF's),
//!   self-managed I/O init enables it and release-hardware disables it;
//!   `file_create`, `file_cleanup` and `io_in_caller_context` delegate to
//!   it (user requests judged per open before they go down).
//! - for kernel clients outside the HCA's subtree (a root-enumerated
//!   client, `crate::legacy_client`), which find the HCA by the proxy's
//!   `GUID_IB_AL_DEVICE_INTERFACE`: the filter's own
//!   device answers `IRP_MN_QUERY_INTERFACE` for `GUID_IB_AL_INTERFACE`
//!   sent over that stack (`WdfIoTargetQueryForInterface`) with an
//!   [`AlPortInterface`] of the CA's first port, while the CA is bound.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use driver_platform::{
    ChildBus, ChildDescription, DevicePowerState, Event, Request, RequestorMode,
};
use hca_miniport_core::ci::CiProvider;
use hca_miniport_core::verbs::CaClient;
use ib_types::cq::CqNotify;
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::handle::CqHandle;
use ib_types::interface::{
    AL_INTERFACE_VERSION, GUID_IB_AL_INTERFACE, GUID_IB_CI_INTERFACE, InterfaceVersion,
    PortInterfaceData, WinGuid,
};
use ib_types::scalars::{NodeGuid, PKey};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendWr};
use ibal_bus_core::al::{AccessLayer, CaCompletion, CiRequests};
/// What a client of [`AlPortInterface`] implements and passes (re-exported
/// so a client needs no dependency of its own on the core).
pub use ibal_bus_core::al::{ClientEvents, ClientId, ClientReference};
use ibal_bus_core::ca_registry::{BoundCa, CaRegistry, OpenedCa, check_version};
use ibal_bus_core::children::{ChildList, ChildSet, PortChild, port_children, read_child_list};
use ibal_bus_core::ci::{
    CaEvents, CaIdentity, CiAccess, PortIdentity, PortQuery, REQUIRED_CI_VERSION,
    ports_from_answer, update_known_ports,
};
use sim_host::context::{self, Context};
use sim_host::driver::{
    DeviceCallbacks, DeviceInit, DriverEntry, Forward, InterfaceRef, ProvidedInterface, SUCCESS,
    StackRole,
};
use sim_host::event::HostEvent;
use sim_host::host::Host;
use sim_host::irql::{HostSpinLock, IrqlTracker};
use sim_host::pci::{GUID_BUS_INTERFACE_STANDARD, PciFunction};
use sim_host::platform::SimPlatform;
use sim_host::pnp::DeviceServices;
use sim_host::request::{HostRequest, StopAction, StoppedRequest};
use sim_host::sched::SchedulerHandle;
use sim_host::verifier::Verifier;

/// The service name `inf/hca-miniport.inf` installs the filter under.
pub const SERVICE: &str = "ibalbus";

/// The miniport's CI provider as the host hands it out.
type Provider = CiProvider<SimPlatform>;

/// The access layer over one bound CA, as this shell builds it.
pub type SimAccessLayer = AccessLayer<HostSpinLock, SimCi>;

/// A filter device's access layer while its CA is bound: shared with its
/// children's AL interfaces, emptied at release-hardware.
type AlSlot = Arc<Mutex<Option<Arc<SimAccessLayer>>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The CI interface of one HCA as this shell reaches it: the host's
/// counted reference to the miniport's [`CiProvider`]; every routine runs
/// as the provider's code (`InterfaceRef::call`).
pub struct SimCi {
    interface: Mutex<Option<Arc<InterfaceRef>>>,
    version: InterfaceVersion,
    /// For the requests the access layer builds.
    verifier: Verifier,
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
            // more (the work item is flushed; the access layer is dropped,
            // its clients closed when their children were removed), so
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

impl CiRequests for SimCi {
    /// A kernel request with the filter's completion routine: it runs in
    /// the completer's (the miniport's) thread, as the filter's code, so
    /// the client request the access layer completes from it is completed
    /// by its owner.
    fn control_request(
        &self,
        ioctl: u32,
        input: Vec<u8>,
        output_len: usize,
        done: CaCompletion,
    ) -> HostRequest {
        let (mut request, _issuer) = HostRequest::new(
            &self.verifier,
            ioctl,
            RequestorMode::Kernel,
            input,
            output_len,
        );
        let verifier = self.verifier.clone();
        request.set_completion_routine(Box::new(move |status, _information, output| {
            let _filter = context::enter(Context::driver(verifier, SERVICE));
            done(*status, output);
        }));
        request
    }
}

/// The CA's callbacks: counted, and forwarded to the access layer while
/// the CA is bound (it routes them to the owning client).
#[derive(Debug, Default)]
struct FilterEvents {
    count: AtomicU64,
    al: Mutex<Weak<SimAccessLayer>>,
    /// The filter device, which re-queries its ports on a port event.
    device: Weak<IbalBusDevice>,
}

impl FilterEvents {
    fn al(&self) -> Option<Arc<SimAccessLayer>> {
        lock(&self.al).upgrade()
    }
}

impl CaEvents for FilterEvents {
    fn completion(&self, cq: CqHandle) {
        self.count.fetch_add(1, Ordering::Relaxed);
        if let Some(al) = self.al() {
            al.completion(cq);
        }
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        self.count.fetch_add(1, Ordering::Relaxed);
        if let Some(al) = self.al() {
            // `LocalCatastrophic` is routed like any event and is not the
            // CA's removal: the failed miniport answers every request at
            // once and still hands each outstanding WR back flushed, which
            // the clients poll before they destroy what they own (its
            // destroys succeed). The CA goes at the stack's surprise
            // removal, which PnP runs next (`IbalBusDevice::ca_gone`).
            al.async_event(event);
        }
        // A port came up: its tables may have changed meanwhile, which
        // the CA raises no event for; the answer tells the clients.
        if event.code == AsyncEventCode::PortActive
            && let Some(device) = self.device.upgrade()
        {
            device.requery_ports();
        }
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
    sched: SchedulerHandle,
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
            sched: host.scheduler_handle(),
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
            events: Arc::new(FilterEvents {
                device: me.clone(),
                ..FilterEvents::default()
            }),
            ports: Mutex::default(),
            sched: self.sched.clone(),
            al: AlSlot::default(),
            proxy: crate::ibal_proxy::IbalProxy::new(host.clone(), reconcile),
            ca_interface: Mutex::default(),
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
    /// The bound CA's ports as last queried (at the bind, then after each
    /// port event), against which a new answer is compared.
    ports: Mutex<Vec<PortIdentity>>,
    /// For the events release-hardware waits on.
    sched: SchedulerHandle,
    /// The access layer while the CA is bound.
    al: AlSlot,
    /// The user-mode proxy (`crate::ibal_proxy`).
    proxy: crate::ibal_proxy::IbalProxy,
    /// The AL interface answered on the HCA's own stack while the CA is
    /// bound (for clients outside its subtree).
    ca_interface: Mutex<Option<Arc<AlPortInterface>>>,
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

    /// The access layer over the bound CA, while it is bound.
    pub fn access_layer(&self) -> Option<Arc<SimAccessLayer>> {
        lock(&self.al).clone()
    }

    /// The user-mode proxy of this HCA.
    pub fn proxy(&self) -> &crate::ibal_proxy::IbalProxy {
        &self.proxy
    }

    /// The CA is gone for good (its HCA left the bus, or its failed stack is
    /// surprise-removed): the access layer tells its clients once and ends
    /// their requests with `STATUS_DEVICE_REMOVED` from now on
    /// (`AccessLayer::ca_removed`).
    /// Any IRQL up to DISPATCH_LEVEL.
    pub fn ca_gone(&self) {
        if let Some(al) = self.access_layer() {
            let _filter = self
                .host
                .verifier()
                .map(|verifier| context::enter(Context::driver(verifier, SERVICE)));
            al.ca_removed();
        }
    }

    /// Whether the HCA's PCI function has left the bus (surprise removal).
    /// The simulated host's view of what the KMDF shell would learn from
    /// the miniport; a failed device's function stays present.
    fn hardware_gone(&self) -> bool {
        self.host
            .resources::<PciFunction>()
            .is_some_and(|function| !function.present())
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
    fn ports_answered(&self, ports: Result<Vec<PortIdentity>, IbStatus>) {
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
        *lock(&self.ports) = bound.ports().to_vec();
        // The access layer before the children: their AL interface serves
        // from it.
        let al = Arc::new(SimAccessLayer::new(bound.ci().clone(), bound.ca_handle()));
        *lock(&self.events.al) = Arc::downgrade(&al);
        *lock(&self.al) = Some(al);
        *lock(&self.ca_interface) = self.ca_interface_of(&bound);
        self.report_children(&bound);
    }

    /// The AL interface the HCA's stack answers: the CA's first port with
    /// the default partition (a client finds the others with `QueryCa`).
    fn ca_interface_of(&self, bound: &BoundCa<SimCi>) -> Option<Arc<AlPortInterface>> {
        let port = bound.ports().first()?;
        Some(Arc::new(AlPortInterface {
            data: PortInterfaceData {
                ca_guid: bound.identity().ca_guid,
                port_guid: port.port_guid,
                port: port.port_num,
                pkey: PKey::DEFAULT,
            },
            al: self.al.clone(),
            verifier: self.host.verifier()?,
            opened: Mutex::default(),
        }))
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
        if let Err(error) = self.submit_port_query(&ci, ca, Self::ports_answered) {
            self.ports_answered(Err(error));
        }
    }

    /// A port event on the bound CA (the CA callback, up to
    /// DISPATCH_LEVEL): sends a `QueryCa` whose answer
    /// ([`Self::ports_requeried`]) tells the clients what changed. Never
    /// waits.
    fn requery_ports(&self) {
        let Some(bound) = self.bound() else {
            return;
        };
        // Not sent (no resources, the device going): the tables stay as
        // last known, and the next port event asks again.
        let _ = self.submit_port_query(bound.ci(), bound.ca_handle(), Self::ports_requeried);
    }

    /// The `QueryCa` after a port event answered: each port's tables are
    /// compared with what was known (`AccessLayer::port_changed` tells
    /// every open client of a P_Key or GID table change) and kept. A
    /// failed query changes nothing. Up to DISPATCH_LEVEL.
    fn ports_requeried(&self, ports: Result<Vec<PortIdentity>, IbStatus>) {
        let Ok(ports) = ports else {
            return;
        };
        let changed = update_known_ports(&mut lock(&self.ports), ports);
        if let Some(al) = self.access_layer() {
            let _filter = self
                .host
                .verifier()
                .map(|verifier| context::enter(Context::driver(verifier, SERVICE)));
            for (old, new) in &changed {
                al.port_changed(old, new);
            }
        }
    }

    fn submit_port_query(
        &self,
        ci: &SimCi,
        ca: u64,
        answered: fn(&Self, Result<Vec<PortIdentity>, IbStatus>),
    ) -> Result<(), IbStatus> {
        let query = PortQuery::new(ca)?;
        let verifier = self
            .host
            .verifier()
            .ok_or(IbStatus::from_ntstatus(NtStatus::INVALID_DEVICE_STATE))?;
        let (mut request, _issuer) = HostRequest::new(
            &verifier,
            query.ioctl,
            RequestorMode::Kernel,
            query.input,
            query.output_len,
        );
        let me = self.me.clone();
        request.set_completion_routine(Box::new(move |status, information, output| {
            // An information beyond the buffer is no answer (empty output).
            let len = usize::try_from(*information).unwrap_or(usize::MAX);
            let ports = ports_from_answer(*status, output.get(..len).unwrap_or_default());
            if let Some(device) = me.upgrade() {
                answered(&device, ports);
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
        let Some(verifier) = self.host.verifier() else {
            interface.dereference();
            return NtStatus::INVALID_DEVICE_STATE;
        };
        let ci = Arc::new(SimCi {
            interface: Mutex::new(Some(Arc::new(interface))),
            version,
            verifier,
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

    /// The HCA is surprise-removed (or failed: PnP takes a failed stack
    /// down this way, after its children and their clients): the CA goes,
    /// whether or not a child's surprise removal told the access layer
    /// before.
    fn surprise_removal(&self) {
        self.ca_gone();
    }

    /// `GUID_IB_AL_INTERFACE` asked over the HCA's stack (by a client
    /// outside its subtree, through a remote I/O target) is answered by
    /// the filter while the CA is bound, as a child answers it; anything
    /// else passes down.
    fn query_interface(&self, guid: &WinGuid, version: u16) -> Option<ProvidedInterface> {
        if *guid != GUID_IB_AL_INTERFACE || version < AL_INTERFACE_VERSION.packed() {
            return None;
        }
        let interface = lock(&self.ca_interface).clone()?;
        Some(ProvidedInterface {
            version: AL_INTERFACE_VERSION.packed(),
            object: Arc::new(interface) as Arc<dyn std::any::Any + Send + Sync>,
        })
    }

    /// A stop (resource rebalance) would close the CA under open AL
    /// clients: vetoed while any is open.
    fn query_stop(&self) -> NtStatus {
        match self.access_layer() {
            Some(al) if al.open_clients() != 0 => NtStatus::DEVICE_BUSY,
            _ => SUCCESS,
        }
    }

    fn release_hardware(&self) -> NtStatus {
        // The access layer goes first: no client call reaches the CA once
        // it is closed. PnP removed the children first, and their drivers
        // closed their clients on the way; one still open (a client that
        // ignored its own removal) finds every call refused from now on.
        // The access layer is dropped with the last of its in-flight
        // completions.
        drop(lock(&self.ca_interface).take());
        *lock(&self.events.al) = Weak::new();
        // Dropped outside the lock: it may release clients' references.
        let al = lock(&self.al).take();
        // What the CA refused to destroy at a client's close is sent again
        // now that the clients are gone: the miniport refuses to close a
        // CA whose kernel objects remain. PASSIVE_LEVEL; it waits only for
        // the CA's answers (each command bounded by its timeout).
        if let Some(al) = &al {
            let drained = Arc::new(HostEvent::new(self.sched.clone()));
            let _ = al.destroy_orphans(&IrqlTracker, drained);
        }
        drop(al);
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
        let verifier = self.host.verifier()?;
        let interface = Arc::new(AlPortInterface {
            data: PortInterfaceData {
                ca_guid: port.ca_guid,
                port_guid: port.port_guid,
                port: port.port_num,
                pkey: port.pkey,
            },
            al: self.al.clone(),
            verifier,
            opened: Mutex::default(),
        });
        Some(Arc::new(PortChildPdo {
            port,
            parent: self.host.clone(),
            filter: self.me.clone(),
            interface,
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
    /// The filter itself: told when the child goes because its HCA does.
    filter: Weak<IbalBusDevice>,
    /// The AL interface it answers with, and serves its IOCTLs through.
    interface: Arc<AlPortInterface>,
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

    /// The AL interface this child answers with.
    pub fn al_interface(&self) -> &Arc<AlPortInterface> {
        &self.interface
    }
}

impl DeviceCallbacks for PortChildPdo {
    /// `GUID_BUS_INTERFACE_STANDARD` is forwarded to the HCA's stack, whose
    /// PCI PDO answers it: `IoGetDmaAdapter` on the child gets the HCA's
    /// own adapter. The filter's reference on the HCA's stack is given
    /// back at once; the consumer's is counted against the child.
    /// `GUID_IB_AL_INTERFACE` is answered here, at [`AL_INTERFACE_VERSION`]
    /// when asked at it or above (the closest not above the one asked, as
    /// the CI is), with the child's [`AlPortInterface`]: the consumer's
    /// reference is counted against this child's devnode.
    fn query_interface(&self, guid: &WinGuid, version: u16) -> Option<ProvidedInterface> {
        if *guid == GUID_IB_AL_INTERFACE {
            return (AL_INTERFACE_VERSION.packed() <= version).then(|| ProvidedInterface {
                version: AL_INTERFACE_VERSION.packed(),
                // An `Arc<AlPortInterface>`, so the consumer can keep it
                // in its own routines while it holds the reference.
                object: Arc::new(self.interface.clone()) as Arc<dyn std::any::Any + Send + Sync>,
            });
        }
        if *guid != GUID_BUS_INTERFACE_STANDARD {
            return None;
        }
        let parent = self.parent.query_interface(guid, version)?;
        let provided = parent.forward();
        parent.dereference();
        Some(provided)
    }

    /// `EvtDeviceSurpriseRemoval` of the child. PnP surprise-removes a
    /// subtree children first, so when the HCA vanishes its children hear
    /// it before the filter does; if the HCA's function is gone from the
    /// bus, the CA is gone with it and the access layer is told now
    /// ([`IbalBusDevice::ca_gone`]), before this child's client goes down:
    /// its requests end at once with `STATUS_DEVICE_REMOVED` instead of
    /// waiting at the gone device, and its close sends no destroy. A child
    /// going alone (its entry removed from the list, its own stack failed)
    /// leaves the CA alone.
    fn surprise_removal(&self) {
        if let Some(filter) = self.filter.upgrade()
            && filter.hardware_gone()
        {
            filter.ca_gone();
        }
    }

    /// `EvtIoStop` of the child's queue, for an AL request it presented
    /// that is still at the CA. Leaving D0 for a sleep, or in an orderly
    /// removal, nothing is done: the HCA is still in D0 and answers it
    /// first. When the child is purged because its HCA left the bus, the
    /// gone device answers nothing, and the miniport gives up on it only
    /// at its command timeout or in its own surprise removal, which PnP
    /// runs after the children: waiting here would hold the removal for
    /// the timeout. The request is acknowledged and kept instead; it
    /// completes, once, when the miniport fails over right after
    /// (`STATUS_DEVICE_REMOVED`, the access layer told at
    /// `surprise_removal`).
    fn io_stop(&self, stopped: &StoppedRequest) {
        if stopped.action() == StopAction::Purge
            && self
                .filter
                .upgrade()
                .is_some_and(|filter| filter.hardware_gone())
        {
            stopped.acknowledge();
        }
    }

    /// The IOCTL path: an internal device-control request carrying an AL
    /// verb, served by the same `submit` as the interface's.
    fn io_request(&self, _lower: &dyn Forward, req: HostRequest) {
        self.interface.serve_request(req);
    }
}

/// The reference on a client's driver object the AL holds while the
/// client is open (`ObReferenceObject` on its driver or device object):
/// counted in the host's driver record
/// (`PnpManager::driver_references`), so unloading the client's driver
/// while the AL holds it is the verifier's `UnloadWhileReferenced`.
/// Dropping it dereferences.
#[derive(Debug)]
pub struct DriverObjectReference(Arc<AtomicUsize>);

impl DriverObjectReference {
    /// Takes a reference on the counter of a driver's objects.
    pub fn new(references: Arc<AtomicUsize>) -> Self {
        references.fetch_add(1, Ordering::AcqRel);
        Self(references)
    }
}

impl Drop for DriverObjectReference {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An open client of the AL as it holds it: its identity and its handle of
/// the CA (the target of `QueryCa`, `AllocPd`, `CreateCq`, `CreateQp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AlClient {
    id: ClientId,
    ca: u64,
}

impl AlClient {
    /// The client's identity in the AL.
    pub fn id(&self) -> ClientId {
        self.id
    }

    /// The client's handle of the CA.
    pub fn ca_handle(&self) -> u64 {
        self.ca
    }
}

/// The AL interface one port child answers `GUID_IB_AL_INTERFACE` with
/// (the sim form of `ib_types::interface::AlInterface`): the child's port
/// data and the access layer's entry points over its HCA's CA. Every
/// routine runs as the filter's code, whoever calls it; without a bound
/// CA (before the bind, after release-hardware) each refuses with
/// `InvalidState` / `STATUS_INVALID_DEVICE_STATE`, a request completed.
pub struct AlPortInterface {
    data: PortInterfaceData,
    al: AlSlot,
    verifier: Verifier,
    /// The clients opened through this interface: the only ones requests
    /// on this child's IOCTL path may act for.
    opened: Mutex<Vec<ClientId>>,
}

impl std::fmt::Debug for AlPortInterface {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlPortInterface")
            .field("data", &self.data)
            .finish_non_exhaustive()
    }
}

impl AlPortInterface {
    /// Runs `routine` as the filter's code on the access layer, if the CA
    /// is bound.
    fn with_al<R>(&self, routine: impl FnOnce(&Arc<SimAccessLayer>) -> R) -> Option<R> {
        let al = lock(&self.al).clone()?;
        let _filter = context::enter(Context::driver(self.verifier.clone(), SERVICE));
        Some(routine(&al))
    }

    /// The interface-specific data: CA GUID, port GUID, port number and
    /// the P_Key the child was made for.
    pub fn port_data(&self) -> PortInterfaceData {
        self.data
    }

    /// Opens the AL for a client: the AL holds `reference` (its driver or
    /// device object's, e.g. a [`DriverObjectReference`]) until no
    /// callback can follow, and calls `events`. DISPATCH_LEVEL or below.
    pub fn open(
        &self,
        reference: ClientReference,
        events: Arc<dyn ClientEvents>,
    ) -> Result<AlClient, IbStatus> {
        let client = self
            .with_al(|al| {
                let id = al.open(reference, events)?;
                let ca = al.ca_handle(id).ok_or(IbStatus::InvalidAlHandle)?;
                Ok(AlClient { id, ca })
            })
            .unwrap_or(Err(IbStatus::InvalidState))?;
        lock(&self.opened).push(client.id);
        Ok(client)
    }

    /// Closes a client (PASSIVE_LEVEL; `AccessLayer::close`): waits on
    /// `drained` for its requests and callbacks in flight and destroys
    /// what it left open, in dependency order. After release-hardware the
    /// client is gone with the access layer: `Ok`.
    pub fn close(&self, client: AlClient, drained: Arc<dyn Event>) -> Result<(), IbStatus> {
        if let Some(result) = self.with_al(|al| al.close(client.id, &IrqlTracker, drained)) {
            result?;
        }
        lock(&self.opened).retain(|id| *id != client.id);
        Ok(())
    }

    /// Sends one control-verb request in the `ib_types::ioctl` framing
    /// (`AccessLayer::submit`): completed exactly once, at once when
    /// refused, else when the CA answers (a create's new handle in the
    /// information field). The request becomes the filter's.
    /// DISPATCH_LEVEL or below; never blocks.
    pub fn submit(&self, client: AlClient, mut request: HostRequest) -> NtStatus {
        request.set_owner(Some(SERVICE.into()));
        let mut request = Some(request);
        let submitted =
            self.with_al(|al| al.submit(client.id, request.take().expect("submitted once")));
        match (submitted, request) {
            (Some(status), _) => status,
            (None, Some(request)) => {
                let _filter = context::enter(Context::driver(self.verifier.clone(), SERVICE));
                request.complete(NtStatus::INVALID_DEVICE_STATE, 0);
                NtStatus::INVALID_DEVICE_STATE
            }
            (None, None) => NtStatus::INVALID_DEVICE_STATE,
        }
    }

    /// [`Self::submit`] and a wait for `completed`, which the caller
    /// arranged to be set when the request completes. PASSIVE_LEVEL only:
    /// above it the request comes back unsubmitted in `Err` (boxed).
    pub fn submit_and_wait(
        &self,
        client: AlClient,
        request: HostRequest,
        completed: &dyn Event,
    ) -> Result<NtStatus, Box<HostRequest>> {
        if sim_host::irql::current() != driver_platform::Irql::PASSIVE {
            return Err(Box::new(request));
        }
        let status = self.submit(client, request);
        completed.wait();
        Ok(status)
    }

    /// Posts send WRs to the client's QP (a UD WR's AV is the client's
    /// handle). Direct call, DISPATCH_LEVEL.
    pub fn post_send(&self, client: AlClient, qp: u64, wrs: &[SendWr<'_>]) -> (usize, IbStatus) {
        self.with_al(|al| al.post_send(client.id, qp, wrs))
            .unwrap_or((0, IbStatus::InvalidState))
    }

    /// Posts receive WRs to the client's QP. Direct call.
    pub fn post_recv(&self, client: AlClient, qp: u64, wrs: &[RecvWr<'_>]) -> (usize, IbStatus) {
        self.with_al(|al| al.post_recv(client.id, qp, wrs))
            .unwrap_or((0, IbStatus::InvalidState))
    }

    /// Polls the client's CQ. Direct call.
    pub fn poll_cq(
        &self,
        client: AlClient,
        cq: u64,
        wcs: &mut [WorkCompletion],
    ) -> Result<usize, IbStatus> {
        self.with_al(|al| al.poll_cq(client.id, cq, wcs))
            .unwrap_or(Err(IbStatus::InvalidState))
    }

    /// Arms the client's CQ for one completion event. Direct call.
    pub fn arm_cq(&self, client: AlClient, cq: u64, notify: CqNotify) -> Result<(), IbStatus> {
        self.with_al(|al| al.arm_cq(client.id, cq, notify))
            .unwrap_or(Err(IbStatus::InvalidState))
    }

    /// The IOCTL path (the child's `io_request`, the filter's code): an
    /// internal device-control request is kernel-only
    /// (`STATUS_INVALID_DEVICE_REQUEST` from user mode); the client is the
    /// one whose tag the header's handle carries, among the clients opened
    /// through this child (`STATUS_INVALID_HANDLE` otherwise, and
    /// `STATUS_INVALID_PARAMETER` without a header); then
    /// `AccessLayer::submit`, which checks the handle itself.
    fn serve_request(&self, request: HostRequest) {
        if request.requestor_mode() != RequestorMode::Kernel {
            request.complete(NtStatus::INVALID_DEVICE_REQUEST, 0);
            return;
        }
        let Some(header) = request.input().get(..8) else {
            request.complete(NtStatus::INVALID_PARAMETER, 0);
            return;
        };
        let mut handle = [0; 8];
        handle.copy_from_slice(header);
        let handle = u64::from_le_bytes(handle);
        let client = lock(&self.opened)
            .iter()
            .copied()
            .find(|id| id.owns(handle));
        let Some(id) = client else {
            request.complete(NtStatus::INVALID_HANDLE, 0);
            return;
        };
        let mut request = Some(request);
        if self
            .with_al(|al| al.submit(id, request.take().expect("submitted once")))
            .is_none()
            && let Some(request) = request
        {
            request.complete(NtStatus::INVALID_DEVICE_STATE, 0);
        }
    }
}
