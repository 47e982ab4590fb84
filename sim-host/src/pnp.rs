//! The PnP manager: the device tree, building device stacks from INF
//! bindings, start / stop / remove / surprise removal with the orders and
//! vetoes Windows guarantees, bus relations, `IRP_MN_QUERY_INTERFACE`
//! routed down a stack with counted references, device interfaces, and
//! requests travelling down stacks through power-managed queues.
//!
//! Orders (`docs/host-model.md`):
//! - a stack is built bottom-up (PDO, lower filters, function driver, upper
//!   filters) and started bottom-up (prepare hardware, then D0 entry);
//! - a parent starts before its children are enumerated, and children are
//!   removed before their parent;
//! - query-remove and query-stop visit the whole subtree, children first and
//!   each stack top-down; a veto anywhere sends cancel-remove to everyone
//!   who already agreed; a query-remove first notifies the remote I/O
//!   targets open on a devnode (`io_target.rs`) and fails while a handle is
//!   open on it (interface references veto nothing);
//! - surprise removal (also the path of a device its driver reported
//!   failed) runs, per stack and children first, `EvtDeviceSurpriseRemoval`,
//!   D0 exit and release-hardware; `IRP_MN_REMOVE_DEVICE` follows once no
//!   handle is open ([`PnpManager::remove_when_no_handles_remain`]);
//! - a failed start releases the hardware of the layers asked to prepare it
//!   and deletes the stack above the PDO;
//! - leaving D0 runs top-down within a stack, entering D0 bottom-up.
//!
//! The host never holds its own locks while it calls a driver, so a driver
//! may call back into [`DeviceServices`] from any callback.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use driver_platform::{ChildBus, ChildDescription, DevicePowerState, Irql};
use ib_types::interface::WinGuid;
use ib_types::status::NtStatus;

use crate::context::{self, Context};
use crate::driver::{
    DELETE_PENDING, DeviceCallbacks, DeviceInit, DriverEntry, Forward, InterfaceRef,
    NO_SUCH_DEVICE, NOT_SUPPORTED, SUCCESS, StackRole,
};
use crate::irql::IrqlGuard;
use crate::registry::{RegistryStore, RegistryView};
use crate::request::{HostRequest, QueueRecord, StopAction, StoppedRequest};
use crate::sched::SchedulerHandle;
use crate::verifier::{Verifier, ViolationKind};

/// How long a power transition on a threaded host waits for the requests
/// of a stopping queue before it reports them (KMDF waits for ever; the
/// Windows power watchdog bug-checks after minutes).
const STOP_WAIT_THREADED: std::time::Duration = std::time::Duration::from_secs(5);

/// The service name of PDOs the host itself creates (root-enumerated
/// devices, the PCI functions): no driver owns them.
pub const HOST_PDO: &str = "pdo";

type UnloadHook = Arc<dyn Fn(&str) + Send + Sync>;

/// One layer's `EvtDeviceD0Entry` or `EvtDeviceD0Exit` as it returned, for
/// observers ([`PnpManager::on_power_step`]): the main job prints and
/// checks the order the real drivers saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PowerStep {
    /// The devnode whose stack the layer is in.
    pub node: DevNodeId,
    /// The layer's driver.
    pub service: String,
    /// `EvtDeviceD0Entry` if true, `EvtDeviceD0Exit` otherwise.
    pub entry: bool,
    /// What the callback returned.
    pub status: NtStatus,
}

type PowerHook = Arc<dyn Fn(&PowerStep) + Send + Sync>;

/// A devnode's identity in the tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevNodeId(usize);

/// What the INF binding says a devnode's stack is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackPlan {
    /// The function driver's service.
    pub function: String,
    /// Upper filters, lowest first.
    pub upper_filters: Vec<String>,
    /// Lower filters, lowest first.
    pub lower_filters: Vec<String>,
    /// The devnode's security descriptor (the INF's `.HW` `Security`
    /// value, [`crate::inf::Binding::security`]), set on the stack before
    /// any driver's add-device; `None`: open to everyone.
    pub security: Option<crate::security::SecurityDescriptor>,
}

/// Finds the drivers of a device from its IDs (the INF set implements
/// this); the error is the reason the device cannot start.
pub trait Binder: Send + Sync {
    /// The stack for a device with these IDs, or why there is none.
    fn bind(
        &self,
        instance_path: &str,
        hardware_ids: &[String],
        compatible_ids: &[String],
    ) -> Result<StackPlan, String>;
}

/// A devnode's PnP state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PnpState {
    /// Reported by its bus; no drivers yet.
    Enumerated,
    /// Started and running.
    Started,
    /// Stopped for rebalance (query-stop succeeded, resources released).
    Stopped,
    /// Surprise-removed: the hardware is gone; awaiting removal.
    SurpriseRemoved,
    /// Removed: its device objects (the PDO too) are deleted and it is no
    /// longer in the device tree; the host keeps its record for inspection.
    Removed,
    /// Could not start, with the reason (an INF that does not resolve, a
    /// missing driver, a failing callback).
    FailedStart(String),
    /// Reported failed by a driver (`WdfDeviceSetFailed`) and torn down
    /// above its PDO, with the reason; not restarted (`NoRestart`, or
    /// restarted too often).
    Failed(String),
}

/// `WDF_DEVICE_FAILED_ACTION`: what `WdfDeviceSetFailed` asks for after the
/// device's stack is torn down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceFailedAction {
    /// `WdfDeviceFailedAttemptRestart`: build the stack again and start it.
    AttemptRestart,
    /// `WdfDeviceFailedNoRestart`: leave the device failed.
    NoRestart,
}

/// How often a devnode reported failed with `AttemptRestart` is restarted
/// before the framework stops trying ("several consecutive restart
/// attempts", `WDF_DEVICE_FAILED_ACTION`).
pub const MAX_RESTARTS_AFTER_FAILURE: u32 = 3;

struct Layer {
    service: Arc<str>,
    role: StackRole,
    callbacks: Arc<dyn DeviceCallbacks>,
    power_managed: bool,
    /// Requests held while the device is below D0.
    held: VecDeque<HostRequest>,
    /// The requests the power-managed queue presented and the driver has
    /// not completed (for `EvtIoStop` / `EvtIoResume`).
    presented: Arc<QueueRecord>,
}

struct DevNode {
    instance_path: String,
    parent: Option<DevNodeId>,
    children: Vec<DevNodeId>,
    hardware_ids: Vec<String>,
    compatible_ids: Vec<String>,
    description: String,
    /// Bottom (PDO) first.
    stack: Vec<Layer>,
    /// How many layers, from the bottom, prepared hardware and have not
    /// released it yet: release-hardware goes to exactly these.
    prepared: usize,
    /// After a failed D0 entry, how many layers below the failing one
    /// entered D0 (they leave it again if that was the start).
    entered_d0: usize,
    /// Reported failed (`WdfDeviceSetFailed`) and being torn down: by
    /// whom, and what follows.
    failed: Option<(Arc<str>, DeviceFailedAction)>,
    /// Restarts after a failure so far.
    restarts: u32,
    state: PnpState,
    power: DevicePowerState,
    /// References handed out on this stack's interfaces, by the devnode
    /// whose driver holds them (`None`: held from outside any stack).
    interface_refs: BTreeMap<Option<DevNodeId>, Arc<AtomicUsize>>,
    /// Registered device interfaces and whether each is enabled.
    interfaces: BTreeMap<WinGuid, bool>,
    /// The stack's security descriptor (`crate::security`), checked at
    /// `IRP_MJ_CREATE`; `None`: open to everyone.
    security: Option<crate::security::SecurityDescriptor>,
}

impl DevNode {
    /// Empties every layer's queue for a device that is going away: the
    /// requests a driver gave back in `EvtIoStop` and those held below D0,
    /// for the caller to complete.
    fn purge_queues(&mut self) -> Vec<HostRequest> {
        let mut purged = Vec::new();
        for layer in &mut self.stack {
            purged.extend(layer.presented.take_requeued());
            purged.extend(layer.held.drain(..));
        }
        purged
    }

    /// References on this stack's interfaces not given back yet, whoever
    /// holds them.
    fn references_outstanding(&self) -> usize {
        self.interface_refs
            .values()
            .map(|count| count.load(Ordering::Acquire))
            .sum()
    }
}

#[derive(Default)]
struct Tree {
    nodes: Vec<DevNode>,
}

struct DriverRecord {
    entry: Arc<dyn DriverEntry>,
    /// Device objects this driver has in stacks.
    devices: usize,
    /// Loaded (has or had devices and not yet unloaded).
    loaded: bool,
    /// Object references other parties hold (ObReferenceObject).
    references: Arc<AtomicUsize>,
}

/// Device-interface arrival and removal notifications.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InterfaceEvent {
    /// An interface of `class` on `device` was enabled.
    Arrival {
        /// Interface class.
        class: WinGuid,
        /// The devnode.
        device: DevNodeId,
    },
    /// It was disabled (or its device removed).
    Removal {
        /// Interface class.
        class: WinGuid,
        /// The devnode.
        device: DevNodeId,
    },
}

pub(crate) struct PnpInner {
    /// Run with a driver's service name as it unloads (leak checks).
    unload_hooks: Mutex<Vec<UnloadHook>>,
    /// Run after each layer's D0 entry or exit (observers).
    power_hooks: Mutex<Vec<PowerHook>>,
    registry: RegistryStore,
    pub(crate) verifier: Verifier,
    binder: Box<dyn Binder>,
    tree: Mutex<Tree>,
    drivers: Mutex<BTreeMap<String, DriverRecord>>,
    interface_events: Mutex<Vec<InterfaceEvent>>,
    /// Children reported by bus drivers, enumerated after the callback that
    /// reported them returns (bus relations are re-queried asynchronously).
    pending_children: Mutex<Vec<(DevNodeId, ChildReport)>>,
    /// The scheduler a stopping queue waits on (the machine's other
    /// processors run while the power transition waits).
    sched: Mutex<Option<SchedulerHandle>>,
    /// File objects and process handles (`file.rs`).
    pub(crate) files: crate::file::FileTable,
    /// Devices their drivers reported failed, acted on by the PnP worker
    /// (`IoInvalidateDeviceState` is asynchronous too).
    pending_failures: Mutex<Vec<(DevNodeId, Arc<str>, DeviceFailedAction)>>,
    /// Remote I/O targets not closed yet (`io_target.rs`).
    pub(crate) io_targets: Mutex<Vec<Arc<crate::io_target::TargetInner>>>,
    /// The order of system transitions (`power.rs`).
    pub(crate) power_order: Mutex<crate::power::PowerOrderState>,
}

enum ChildReport {
    Present(ChildDescription),
    Missing(String),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The PnP manager of one host.
#[derive(Clone)]
pub struct PnpManager {
    pub(crate) inner: Arc<PnpInner>,
}

impl std::fmt::Debug for PnpManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PnpManager").finish_non_exhaustive()
    }
}

/// What the host gives one device object: child reporting, interface
/// queries on its own stack, device interfaces.
#[derive(Clone)]
pub struct DeviceServices {
    pub(crate) pnp: Weak<PnpInner>,
    node: DevNodeId,
    service: Arc<str>,
}

impl std::fmt::Debug for DeviceServices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceServices")
            .field("node", &self.node)
            .field("service", &self.service)
            .finish()
    }
}

impl DeviceServices {
    /// The devnode this device object belongs to.
    pub fn node(&self) -> DevNodeId {
        self.node
    }

    /// The driver (service) of this device object.
    pub fn service(&self) -> &str {
        &self.service
    }

    /// Sends `IRP_MN_QUERY_INTERFACE` to the top of this device's own stack
    /// (`WdfFdoQueryForInterface`).
    pub fn query_interface(&self, guid: &WinGuid, version: u16) -> Option<InterfaceRef> {
        let pnp = PnpManager {
            inner: self.pnp.upgrade()?,
        };
        pnp.query_interface_as(
            self.node,
            guid,
            version,
            Some((self.service.clone(), self.node)),
        )
    }

    /// The resources assigned to this devnode (the start request's
    /// resource list), as the type the bus gave them, e.g.
    /// `resources::<PciFunction>()`.
    pub fn resources<T: std::any::Any + Send + Sync>(&self) -> Option<Arc<T>> {
        let inner = self.pnp.upgrade()?;
        let pdo = lock(&inner.tree)
            .nodes
            .get(self.node.0)?
            .stack
            .first()?
            .callbacks
            .clone();
        pdo.resources()?.downcast::<T>().ok()
    }

    /// The host's registry and this devnode's instance path: what a bus
    /// driver hands its children's resources (the PCI bus: the DMA
    /// remapping opt-in their INFs wrote).
    pub(crate) fn registry_store(&self) -> Option<(crate::registry::RegistryStore, String)> {
        let inner = self.pnp.upgrade()?;
        let path = lock(&inner.tree)
            .nodes
            .get(self.node.0)?
            .instance_path
            .clone();
        Some((inner.registry.clone(), path))
    }

    /// This driver's view of the registry: its service key and this
    /// device's key (`WdfDriverOpenParametersRegistryKey`,
    /// `WdfDeviceOpenRegistryKey`). Reads are PASSIVE_LEVEL only.
    pub fn registry(&self) -> Option<RegistryView> {
        let inner = self.pnp.upgrade()?;
        let path = lock(&inner.tree)
            .nodes
            .get(self.node.0)?
            .instance_path
            .clone();
        Some(inner.registry.view(&self.service, &path))
    }

    /// Registers a device interface of `class` (disabled until enabled).
    pub fn register_interface(&self, class: WinGuid) {
        if let Some(inner) = self.pnp.upgrade()
            && let Some(node) = lock(&inner.tree).nodes.get_mut(self.node.0)
        {
            node.interfaces.entry(class).or_insert(false);
        }
    }

    /// Enables or disables a registered device interface, notifying
    /// listeners on each change.
    pub fn set_interface_enabled(&self, class: WinGuid, enabled: bool) {
        let Some(inner) = self.pnp.upgrade() else {
            return;
        };
        let changed = {
            let mut tree = lock(&inner.tree);
            let Some(node) = tree.nodes.get_mut(self.node.0) else {
                return;
            };
            match node.interfaces.get_mut(&class) {
                Some(state) if *state != enabled => {
                    *state = enabled;
                    true
                }
                _ => false,
            }
        };
        if changed {
            let ev = if enabled {
                InterfaceEvent::Arrival {
                    class,
                    device: self.node,
                }
            } else {
                InterfaceEvent::Removal {
                    class,
                    device: self.node,
                }
            };
            lock(&inner.interface_events).push(ev);
        }
    }

    /// `WdfDeviceSetFailed` (IRQL <= DISPATCH_LEVEL): the driver met an
    /// error it cannot recover from. The PnP manager acts on it on its
    /// worker ([`PnpManager::process_bus_relations`]): the device goes down
    /// the surprise-removal path (its children removed, then
    /// `EvtDeviceSurpriseRemoval`, D0 exit and release-hardware on its own
    /// stack), its device objects above the PDO are deleted once no handle
    /// is open, and with [`DeviceFailedAction::AttemptRestart`] the stack
    /// is built and started again (at most
    /// [`MAX_RESTARTS_AFTER_FAILURE`] times).
    pub fn set_failed(&self, action: DeviceFailedAction) {
        crate::irql::check_max("WdfDeviceSetFailed", Irql::DISPATCH);
        if let Some(inner) = self.pnp.upgrade() {
            lock(&inner.pending_failures).push((self.node, self.service.clone(), action));
        }
    }

    /// The verifier of this host.
    pub fn verifier(&self) -> Option<Verifier> {
        self.pnp.upgrade().map(|i| i.verifier.clone())
    }

    /// Sends `req` to this device object itself (`IoCallDriver` on its
    /// own device object): it enters the stack at this layer, below any
    /// upper filter, and a request another driver handed over becomes this
    /// driver's own, delivered through its queue, so it may complete it.
    pub fn send_to_own_device(&self, req: HostRequest) {
        let Some(inner) = self.pnp.upgrade() else {
            return req_complete(req, NO_SUCH_DEVICE);
        };
        let pnp = PnpManager { inner };
        let layer = lock(&pnp.inner.tree)
            .nodes
            .get(self.node.0)
            .and_then(|n| n.stack.iter().rposition(|l| l.service == self.service));
        match layer {
            Some(layer) => {
                let _issuing_thread = req.process().map(crate::caller::enter_process);
                pnp.arrive(self.node, layer, req);
            }
            None => req_complete(req, NO_SUCH_DEVICE),
        }
    }
}

impl ChildBus for DeviceServices {
    fn report_present(&self, child: ChildDescription) -> Result<(), NtStatus> {
        let inner = self.pnp.upgrade().ok_or(NO_SUCH_DEVICE)?;
        lock(&inner.pending_children).push((self.node, ChildReport::Present(child)));
        Ok(())
    }

    fn report_missing(&self, instance_id: &str) {
        if let Some(inner) = self.pnp.upgrade() {
            lock(&inner.pending_children)
                .push((self.node, ChildReport::Missing(instance_id.to_owned())));
        }
    }
}

/// Why a query-remove, query-stop or power transition did not happen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} vetoed by {service} on {instance_path}: {status:?}")]
pub struct Veto {
    /// The operation.
    pub what: &'static str,
    /// The devnode that refused.
    pub instance_path: String,
    /// The driver that refused (or `host` for the framework's own reasons).
    pub service: String,
    /// The status it answered.
    pub status: NtStatus,
}

struct Lower<'a> {
    pnp: &'a PnpManager,
    node: DevNodeId,
    /// The layer the request goes to next.
    layer: Option<usize>,
}

impl Forward for Lower<'_> {
    fn forward(&self, req: HostRequest) {
        match self.layer {
            Some(layer) => self.pnp.arrive(self.node, layer, req),
            None => {
                // Below the PDO: nobody handled it.
                req_complete(req, NOT_SUPPORTED);
            }
        }
    }
}

fn req_complete(req: HostRequest, status: NtStatus) {
    use driver_platform::Request;
    req.complete(status, 0);
}

impl PnpManager {
    /// A PnP manager binding drivers with `binder`.
    pub fn new(verifier: Verifier, binder: Box<dyn Binder>) -> Self {
        Self::with_registry(verifier, binder, RegistryStore::new())
    }

    /// A PnP manager whose drivers see `registry` (the store the binder
    /// writes INF registry sections into).
    pub fn with_registry(
        verifier: Verifier,
        binder: Box<dyn Binder>,
        registry: RegistryStore,
    ) -> Self {
        let pnp = Self {
            inner: Arc::new(PnpInner {
                unload_hooks: Mutex::default(),
                power_hooks: Mutex::default(),
                registry,
                verifier,
                binder,
                tree: Mutex::default(),
                drivers: Mutex::default(),
                interface_events: Mutex::default(),
                pending_children: Mutex::default(),
                sched: Mutex::default(),
                files: crate::file::FileTable::default(),
                pending_failures: Mutex::default(),
                io_targets: Mutex::default(),
                power_order: Mutex::default(),
            }),
        };
        // A surprise-removed devnode gets IRP_MN_REMOVE_DEVICE once its last
        // file object closes (weak: the hook must not keep the manager alive).
        let weak = Arc::downgrade(&pnp.inner);
        pnp.on_file_closed(move |node| {
            if let Some(inner) = weak.upgrade() {
                let pnp = PnpManager { inner };
                pnp.remove_when_no_handles_remain(node, pnp.open_handles(node));
            }
        });
        pnp
    }

    /// Runs `hook` with each driver's service name as it unloads: where
    /// the host checks what the driver left behind (pool, DMA).
    pub fn on_unload(&self, hook: impl Fn(&str) + Send + Sync + 'static) {
        lock(&self.inner.unload_hooks).push(Arc::new(hook));
    }

    /// Runs `hook` after each layer's `EvtDeviceD0Entry` and
    /// `EvtDeviceD0Exit` returns (observation only: the order the drivers
    /// saw their power callbacks in).
    pub fn on_power_step(&self, hook: impl Fn(&PowerStep) + Send + Sync + 'static) {
        lock(&self.inner.power_hooks).push(Arc::new(hook));
    }

    fn power_step(&self, node: DevNodeId, service: &str, entry: bool, status: NtStatus) {
        let hooks: Vec<PowerHook> = lock(&self.inner.power_hooks).clone();
        if hooks.is_empty() {
            return;
        }
        let step = PowerStep {
            node,
            service: service.to_owned(),
            entry,
            status,
        };
        for hook in hooks {
            hook(&step);
        }
    }

    /// The scheduler of the machine: a power transition waiting for the
    /// requests of a stopping queue runs it meanwhile (without one, only
    /// what the driver does inside `EvtIoStop` counts), and an
    /// `IRP_MJ_CLOSE` made due by a completion runs as its task.
    pub fn set_scheduler(&self, sched: SchedulerHandle) {
        self.set_file_close_scheduler(sched.clone());
        *lock(&self.inner.sched) = Some(sched);
    }

    /// The registry the drivers see.
    pub fn registry(&self) -> &RegistryStore {
        &self.inner.registry
    }

    /// Registers an in-process driver under its service name.
    pub fn register_driver(&self, service: &str, entry: Arc<dyn DriverEntry>) {
        lock(&self.inner.drivers).insert(
            service.to_owned(),
            DriverRecord {
                entry,
                devices: 0,
                loaded: false,
                references: Arc::new(AtomicUsize::new(0)),
            },
        );
    }

    /// The object-reference counter of a driver (what `ObReferenceObject`
    /// on its driver or device object counts): the access layer takes one
    /// per open client.
    pub fn driver_references(&self, service: &str) -> Option<Arc<AtomicUsize>> {
        lock(&self.inner.drivers)
            .get(service)
            .map(|d| d.references.clone())
    }

    /// True while a driver has device objects in some stack.
    pub fn driver_loaded(&self, service: &str) -> bool {
        lock(&self.inner.drivers)
            .get(service)
            .is_some_and(|d| d.loaded)
    }

    /// Adds a root-enumerated or bus-reported device (a PCI function, for
    /// instance) whose PDO is `pdo`, and starts it.
    pub fn add_device(
        &self,
        parent: Option<DevNodeId>,
        instance_path: &str,
        hardware_ids: Vec<String>,
        compatible_ids: Vec<String>,
        pdo: Arc<dyn DeviceCallbacks>,
    ) -> DevNodeId {
        self.add_device_owned(
            parent,
            instance_path,
            hardware_ids,
            compatible_ids,
            pdo,
            Arc::from(HOST_PDO),
        )
    }

    /// [`PnpManager::add_device`] with the PDO charged to `owner`, the bus
    /// driver that created it (its device object keeps that driver loaded).
    fn add_device_owned(
        &self,
        parent: Option<DevNodeId>,
        instance_path: &str,
        hardware_ids: Vec<String>,
        compatible_ids: Vec<String>,
        pdo: Arc<dyn DeviceCallbacks>,
        owner: Arc<str>,
    ) -> DevNodeId {
        if &*owner != HOST_PDO
            && let Some(d) = lock(&self.inner.drivers).get_mut(&*owner)
        {
            d.devices += 1;
        }
        let callbacks = self.entered(&owner, pdo);
        // A PDO's queue follows its bus driver's choice; KMDF's default
        // for a PDO is power-managed, as for a function driver.
        let power_managed = callbacks.power_managed_queue();
        let id = {
            let mut tree = lock(&self.inner.tree);
            let id = DevNodeId(tree.nodes.len());
            tree.nodes.push(DevNode {
                instance_path: instance_path.to_owned(),
                parent,
                children: Vec::new(),
                hardware_ids,
                compatible_ids,
                description: String::new(),
                stack: vec![Layer {
                    service: owner,
                    role: StackRole::Pdo,
                    power_managed,
                    callbacks,
                    held: VecDeque::new(),
                    presented: Arc::default(),
                }],
                prepared: 0,
                entered_d0: 0,
                failed: None,
                restarts: 0,
                state: PnpState::Enumerated,
                power: DevicePowerState::D3,
                interface_refs: BTreeMap::new(),
                interfaces: BTreeMap::new(),
                security: None,
            });
            if let Some(p) = parent {
                tree.nodes[p.0].children.push(id);
            }
            id
        };
        self.start(id);
        id
    }

    /// The state of a devnode.
    pub fn state(&self, node: DevNodeId) -> Option<PnpState> {
        lock(&self.inner.tree)
            .nodes
            .get(node.0)
            .map(|n| n.state.clone())
    }

    /// The power state of a devnode.
    pub fn power(&self, node: DevNodeId) -> Option<DevicePowerState> {
        lock(&self.inner.tree).nodes.get(node.0).map(|n| n.power)
    }

    /// The children of a devnode in the device tree: a removed child is
    /// no longer one (its PDO is deleted), though `state` still answers
    /// `Removed` for it.
    pub fn children(&self, node: DevNodeId) -> Vec<DevNodeId> {
        lock(&self.inner.tree)
            .nodes
            .get(node.0)
            .map(|n| n.children.clone())
            .unwrap_or_default()
    }

    /// The devnode with this instance path; if a removed one was
    /// re-enumerated, the newest.
    pub fn find(&self, instance_path: &str) -> Option<DevNodeId> {
        lock(&self.inner.tree)
            .nodes
            .iter()
            .rposition(|n| n.instance_path == instance_path)
            .map(DevNodeId)
    }

    /// The instance path of a devnode.
    pub fn instance_path(&self, node: DevNodeId) -> Option<String> {
        lock(&self.inner.tree)
            .nodes
            .get(node.0)
            .map(|n| n.instance_path.clone())
    }

    /// The services of a devnode's stack and their roles, bottom first.
    pub fn stack_services(&self, node: DevNodeId) -> Vec<(String, StackRole)> {
        lock(&self.inner.tree)
            .nodes
            .get(node.0)
            .map(|n| {
                n.stack
                    .iter()
                    .map(|l| (l.service.to_string(), l.role))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Interface references outstanding on a devnode's stack.
    pub fn interface_references(&self, node: DevNodeId) -> usize {
        lock(&self.inner.tree)
            .nodes
            .get(node.0)
            .map_or(0, |n| n.references_outstanding())
    }

    /// The security descriptor of a devnode's stack, if its binding gave
    /// one.
    pub fn security(&self, node: DevNodeId) -> Option<crate::security::SecurityDescriptor> {
        lock(&self.inner.tree)
            .nodes
            .get(node.0)
            .and_then(|n| n.security.clone())
    }

    /// The devnodes with an enabled device interface of `class`, in
    /// devnode order.
    pub fn devices_with_interface(&self, class: WinGuid) -> Vec<DevNodeId> {
        lock(&self.inner.tree)
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.interfaces.get(&class).copied().unwrap_or(false))
            .map(|(i, _)| DevNodeId(i))
            .collect()
    }

    /// Takes the device-interface notifications so far.
    pub fn take_interface_events(&self) -> Vec<InterfaceEvent> {
        std::mem::take(&mut *lock(&self.inner.interface_events))
    }

    /// Every devnode in pre-order (parents before children).
    pub fn preorder(&self) -> Vec<DevNodeId> {
        let tree = lock(&self.inner.tree);
        let mut out = Vec::new();
        let roots: Vec<DevNodeId> = (0..tree.nodes.len())
            .filter(|&i| tree.nodes[i].parent.is_none() && tree.nodes[i].state != PnpState::Removed)
            .map(DevNodeId)
            .collect();
        let mut stack: Vec<DevNodeId> = roots.into_iter().rev().collect();
        while let Some(n) = stack.pop() {
            out.push(n);
            for &c in tree.nodes[n.0].children.iter().rev() {
                stack.push(c);
            }
        }
        out
    }

    /// The subtree of `node` in post-order (children before parents).
    pub(crate) fn subtree_postorder(&self, node: DevNodeId) -> Vec<DevNodeId> {
        let tree = lock(&self.inner.tree);
        let mut out = Vec::new();
        fn walk(tree: &Tree, n: DevNodeId, out: &mut Vec<DevNodeId>) {
            for &c in &tree.nodes[n.0].children {
                walk(tree, c, out);
            }
            out.push(n);
        }
        if node.0 < tree.nodes.len() {
            walk(&tree, node, &mut out);
        }
        out
    }

    /// The callbacks of a devnode's stack with their services, bottom first.
    pub(crate) fn layers(&self, node: DevNodeId) -> Vec<(Arc<str>, Arc<dyn DeviceCallbacks>)> {
        lock(&self.inner.tree)
            .nodes
            .get(node.0)
            .map(|n| {
                n.stack
                    .iter()
                    .map(|l| (l.service.clone(), l.callbacks.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A start that failed, as KMDF and the PnP manager end it: every layer
    /// that was asked to prepare hardware (the failing one included) gets
    /// release-hardware, top-down, then `IRP_MN_REMOVE_DEVICE` deletes the
    /// stack's device objects above the PDO, which stays with the reason.
    fn fail_start(&self, node: DevNodeId, reason: String) {
        self.release_prepared(node);
        self.delete_device_objects(node, PnpState::FailedStart(reason));
    }

    /// Builds the stack from the binding and starts it (bottom-up prepare
    /// hardware and D0 entry), then enumerates its children.
    fn start(&self, node: DevNodeId) {
        let (path, hw, compat) = {
            let tree = lock(&self.inner.tree);
            let n = &tree.nodes[node.0];
            (
                n.instance_path.clone(),
                n.hardware_ids.clone(),
                n.compatible_ids.clone(),
            )
        };
        let needs_stack = lock(&self.inner.tree).nodes[node.0].stack.len() == 1;
        if needs_stack {
            let plan = match self.inner.binder.bind(&path, &hw, &compat) {
                Ok(plan) => plan,
                Err(reason) => return self.fail_start(node, reason),
            };
            // The security property first, so the first open is checked.
            lock(&self.inner.tree).nodes[node.0].security = plan.security.clone();
            let mut order: Vec<(String, StackRole)> = Vec::new();
            order.extend(
                plan.lower_filters
                    .iter()
                    .map(|s| (s.clone(), StackRole::LowerFilter)),
            );
            order.push((plan.function.clone(), StackRole::Function));
            order.extend(
                plan.upper_filters
                    .iter()
                    .map(|s| (s.clone(), StackRole::UpperFilter)),
            );
            for (service, role) in order {
                let entry = lock(&self.inner.drivers)
                    .get(&service)
                    .map(|d| d.entry.clone());
                let Some(entry) = entry else {
                    return self
                        .fail_start(node, format!("driver service `{service}` is not installed"));
                };
                let init = DeviceInit {
                    instance_path: path.clone(),
                    hardware_ids: hw.clone(),
                    role,
                };
                let services = DeviceServices {
                    pnp: Arc::downgrade(&self.inner),
                    node,
                    service: Arc::from(service.as_str()),
                };
                let added = {
                    let _driver = context::enter(Context::driver(
                        self.inner.verifier.clone(),
                        service.as_str(),
                    ));
                    entry.add_device(&init, &services)
                };
                let callbacks = match added {
                    Ok(cb) => self.entered(&Arc::from(service.as_str()), cb),
                    Err(status) => {
                        return self
                            .fail_start(node, format!("`{service}` AddDevice failed: {status:?}"));
                    }
                };
                let power_managed = role == StackRole::Function && callbacks.power_managed_queue();
                if let Some(d) = lock(&self.inner.drivers).get_mut(&service) {
                    d.devices += 1;
                    d.loaded = true;
                }
                self.inner.verifier.driver_loaded(&service);
                lock(&self.inner.tree).nodes[node.0].stack.push(Layer {
                    service: Arc::from(service.as_str()),
                    role,
                    callbacks,
                    power_managed,
                    held: VecDeque::new(),
                    presented: Arc::default(),
                });
            }
        }
        // IRP_MN_START_DEVICE: each layer after the ones below it.
        for (index, (service, cb)) in self.layers(node).into_iter().enumerate() {
            let status = cb.prepare_hardware();
            // Asked to prepare: it hears release-hardware whatever it said.
            if let Some(n) = lock(&self.inner.tree).nodes.get_mut(node.0) {
                n.prepared = index + 1;
            }
            if status != SUCCESS {
                return self.fail_start(
                    node,
                    format!("`{service}` prepare hardware failed: {status:?}"),
                );
            }
        }
        if let Err(reason) = self.enter_d0(node) {
            // The layers that entered D0 leave it, top-down, with their
            // interrupts disconnected, before the hardware is released.
            let entered = lock(&self.inner.tree)
                .nodes
                .get_mut(node.0)
                .map_or(0, |n| std::mem::take(&mut n.entered_d0));
            let function = self.pci_function(node);
            for (service, cb) in self.layers(node).into_iter().take(entered).rev() {
                if let Some(function) = &function {
                    function.disconnect_interrupts(&service, false);
                }
                let status = cb.d0_exit(DevicePowerState::D3);
                self.power_step(node, &service, false, status);
            }
            if let Some(function) = &function {
                function.enter_d3();
            }
            return self.fail_start(node, reason);
        }
        if let Some(n) = lock(&self.inner.tree).nodes.get_mut(node.0) {
            n.state = PnpState::Started;
        }
        for (_service, cb) in self.layers(node) {
            cb.self_managed_io_init();
        }
        self.process_bus_relations();
    }

    /// The PCI function under a devnode's stack, if its PDO has one.
    fn pci_function(&self, node: DevNodeId) -> Option<Arc<crate::pci::PciFunction>> {
        let pdo = lock(&self.inner.tree)
            .nodes
            .get(node.0)?
            .stack
            .first()?
            .callbacks
            .clone();
        pdo.resources()?.downcast().ok()
    }

    /// D0 entry bottom-up, as KMDF runs it for each layer: the hardware
    /// back in D0 first, then per layer `EvtDeviceD0Entry`, its
    /// interrupts connected and `EvtInterruptEnable`,
    /// `EvtDeviceD0EntryPostInterruptsEnabled`; then releases requests the
    /// queues held.
    pub(crate) fn enter_d0(&self, node: DevNodeId) -> Result<(), String> {
        let from = self.power(node).unwrap_or(DevicePowerState::D3);
        let function = self.pci_function(node);
        if let Some(function) = &function {
            function.enter_d0();
        }
        for (index, (service, cb)) in self.layers(node).into_iter().enumerate() {
            let status = cb.d0_entry(from);
            self.power_step(node, &service, true, status);
            if status != SUCCESS {
                if let Some(n) = lock(&self.inner.tree).nodes.get_mut(node.0) {
                    n.entered_d0 = index;
                }
                return Err(format!("`{service}` D0 entry failed: {status:?}"));
            }
            // From here on this layer is in D0: a failure leaves it again.
            let entered = |n: &mut DevNode| n.entered_d0 = index + 1;
            if let Some(function) = &function {
                let status = function.connect_interrupts(&service);
                if status != SUCCESS {
                    if let Some(n) = lock(&self.inner.tree).nodes.get_mut(node.0) {
                        entered(n);
                    }
                    return Err(format!("`{service}` EvtInterruptEnable failed: {status:?}"));
                }
            }
            let status = cb.d0_entry_post_interrupts_enabled(from);
            if status != SUCCESS {
                if let Some(n) = lock(&self.inner.tree).nodes.get_mut(node.0) {
                    entered(n);
                }
                return Err(format!(
                    "`{service}` D0 entry (post interrupts enabled) failed: {status:?}"
                ));
            }
        }
        let (queues, held): (Vec<_>, Vec<(usize, HostRequest)>) = {
            let mut tree = lock(&self.inner.tree);
            let n = &mut tree.nodes[node.0];
            n.power = DevicePowerState::D0;
            let queues = n
                .stack
                .iter()
                .enumerate()
                .filter(|(_, l)| l.power_managed)
                .map(|(i, l)| {
                    (
                        i,
                        l.service.clone(),
                        l.callbacks.clone(),
                        l.presented.clone(),
                    )
                })
                .collect();
            let held = n
                .stack
                .iter_mut()
                .enumerate()
                .flat_map(|(i, l)| l.held.drain(..).map(move |r| (i, r)).collect::<Vec<_>>())
                .collect();
            (queues, held)
        };
        // The queues restart: EvtIoResume for what the drivers kept, then
        // what they gave back, then what arrived meanwhile.
        for (layer, _service, cb, presented) in queues {
            let (resumed, requeued) = presented.restart();
            for (id, ioctl) in resumed {
                cb.io_resume(&StoppedRequest::new(
                    id,
                    ioctl,
                    StopAction::Suspend,
                    presented.clone(),
                    self.inner.verifier.clone(),
                ));
            }
            for req in requeued {
                self.deliver(node, layer, req);
            }
        }
        for (layer, req) in held {
            self.deliver(node, layer, req);
        }
        Ok(())
    }

    /// Stops one power-managed queue (KMDF, before the device's D0 exit):
    /// `EvtIoStop` for every request the driver owns from it, then waits —
    /// running the machine's other processors — until each is completed
    /// or acknowledged. One that never is would hang the transition on
    /// Windows: `RequestBlocksPowerDown`, and the transition goes on.
    fn stop_queue(
        &self,
        service: &str,
        cb: &Arc<dyn DeviceCallbacks>,
        presented: &Arc<QueueRecord>,
        action: StopAction,
    ) {
        for (id, ioctl) in presented.begin_stop() {
            cb.io_stop(&StoppedRequest::new(
                id,
                ioctl,
                action,
                presented.clone(),
                self.inner.verifier.clone(),
            ));
        }
        let sched = lock(&self.inner.sched).clone();
        let deadline = std::time::Instant::now() + STOP_WAIT_THREADED;
        while !presented.still_stopping().is_empty() {
            let waited = match &sched {
                Some(s) if s.mode() == crate::sched::Mode::Deterministic => s.run_one_for_waiter(),
                // Threaded: the workers complete requests on their own.
                Some(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    true
                }
                _ => false,
            };
            if !waited {
                break;
            }
        }
        for (id, ioctl) in presented.still_stopping() {
            self.inner.verifier.report(
                Some(service),
                ViolationKind::RequestBlocksPowerDown {
                    ioctl,
                    request: id.raw(),
                },
            );
        }
    }

    /// D0 exit top-down (the queues hold new requests from now on), as
    /// KMDF runs it for each layer: the power-managed queue stops
    /// (`stop_queue`: `EvtIoStop`), `EvtDeviceD0ExitPreInterruptsDisabled`,
    /// `EvtInterruptDisable` (not after a surprise removal) and the
    /// interrupts disconnected with their DPCs flushed, `EvtDeviceD0Exit`;
    /// then the hardware leaves D0 (state lost, BAR reads all ones).
    pub(crate) fn leave_d0(&self, node: DevNodeId, to: DevicePowerState, action: StopAction) {
        if self.power(node) != Some(DevicePowerState::D0) {
            return;
        }
        // EvtInterruptDisable is skipped only when the hardware is gone.
        let layers: Vec<_> = {
            let mut tree = lock(&self.inner.tree);
            let Some(n) = tree.nodes.get_mut(node.0) else {
                return;
            };
            n.power = to;
            n.stack
                .iter()
                .map(|l| {
                    let queue = l.power_managed.then(|| l.presented.clone());
                    (l.service.clone(), l.callbacks.clone(), queue)
                })
                .collect()
        };
        let function = self.pci_function(node);
        let hardware_gone = function.as_ref().is_some_and(|f| !f.present());
        let report = |service: &str, what: &str, status: NtStatus| {
            self.inner.verifier.report(
                Some(service),
                ViolationKind::Protocol {
                    detail: format!("{what} failed: {status:?}"),
                },
            );
        };
        for (service, cb, queue) in layers.into_iter().rev() {
            if let Some(queue) = queue {
                self.stop_queue(&service, &cb, &queue, action);
            }
            let status = cb.d0_exit_pre_interrupts_disabled(to);
            if status != SUCCESS {
                report(&service, "D0 exit (pre interrupts disabled)", status);
            }
            if let Some(function) = &function {
                function.disconnect_interrupts(&service, hardware_gone);
            }
            let status = cb.d0_exit(to);
            self.power_step(node, &service, false, status);
            if status != SUCCESS {
                report(&service, "D0 exit", status);
            }
        }
        if let Some(function) = &function {
            function.enter_d3();
        }
    }

    /// Enumerates or removes the children bus drivers have reported
    /// (`IoInvalidateDeviceRelations` is asynchronous on Windows: the PnP
    /// manager re-queries bus relations on its own thread). The host does
    /// this after every start and resume; a test calls it to model the
    /// PnP worker getting round to a report made from a DPC or work item.
    /// Devices reported failed (`DeviceServices::set_failed`) are acted on
    /// here too.
    pub fn process_bus_relations(&self) {
        loop {
            let failures = std::mem::take(&mut *lock(&self.inner.pending_failures));
            for (node, service, action) in &failures {
                self.device_failed(*node, service.clone(), *action);
            }
            let pending = std::mem::take(&mut *lock(&self.inner.pending_children));
            if pending.is_empty() && failures.is_empty() {
                return;
            }
            for (parent, report) in pending {
                match report {
                    // The PnP manager asks a started bus for its relations:
                    // a report from a stack torn down since (removed, or
                    // failed) has nobody left to answer.
                    ChildReport::Present(desc) => {
                        if self.state(parent) == Some(PnpState::Started) {
                            self.child_present(parent, desc);
                        }
                    }
                    ChildReport::Missing(id) => {
                        let path =
                            format!("{}\\{}", self.instance_path(parent).unwrap_or_default(), id);
                        // A started child that vanished is surprise-removed;
                        // one that never started is simply removed.
                        if let Some(child) = self.find(&path) {
                            match self.state(child) {
                                Some(PnpState::Started | PnpState::Stopped) => {
                                    self.surprise_remove(child)
                                }
                                Some(PnpState::Removed | PnpState::SurpriseRemoved) | None => {}
                                Some(_) => self.remove(child),
                            }
                        }
                    }
                }
            }
        }
    }

    /// A device its driver reported failed: the surprise-removal path, then
    /// (in `remove_when_no_handles_remain`) its stack above the PDO goes and
    /// is restarted if asked. A device already going is left alone.
    fn device_failed(&self, node: DevNodeId, service: Arc<str>, action: DeviceFailedAction) {
        {
            let mut tree = lock(&self.inner.tree);
            let Some(dn) = tree.nodes.get_mut(node.0) else {
                return;
            };
            if !matches!(dn.state, PnpState::Started | PnpState::Stopped) {
                return;
            }
            dn.failed = Some((service, action));
        }
        // The hardware is still there: only the driver gave up on it.
        self.surprise_removal_sequence(node);
    }

    fn child_present(&self, parent: DevNodeId, desc: ChildDescription) {
        let parent_path = self.instance_path(parent).unwrap_or_default();
        let path = format!("{parent_path}\\{}", desc.instance_id);
        if let Some(existing) = self.find(&path)
            && !matches!(self.state(existing), Some(PnpState::Removed))
        {
            return; // already present: re-enumeration keeps the devnode
        }
        // The parent's bus driver creates the PDO's callbacks.
        let creator = self
            .layers(parent)
            .into_iter()
            .rev()
            .find_map(|(service, cb)| Some((service, cb.create_child(&desc)?)));
        let Some((owner, pdo)) = creator else {
            self.inner.verifier.report(
                None,
                ViolationKind::Protocol {
                    detail: format!(
                        "child {path} reported but no driver of {parent_path} creates its PDO"
                    ),
                },
            );
            return;
        };
        let id = self.add_device_owned(
            Some(parent),
            &path,
            desc.hardware_ids.clone(),
            desc.compatible_ids.clone(),
            pdo,
            owner,
        );
        if let Some(n) = lock(&self.inner.tree).nodes.get_mut(id.0) {
            n.description = desc.description;
        }
    }

    /// Sends a request to the top of a devnode's stack. A user request
    /// that carries its process is sent from a thread of that process:
    /// its synchronous delivery runs in the process's context (`caller`).
    /// It counts in [`Process::requests_issued`](crate::memory::Process::requests_issued).
    pub fn send_request(&self, node: DevNodeId, req: HostRequest) {
        if let Some(process) = req.process() {
            process.count_request();
        }
        let _issuing_thread = req.process().map(crate::caller::enter_process);
        let top = lock(&self.inner.tree)
            .nodes
            .get(node.0)
            .map(|n| n.stack.len());
        match top {
            Some(len) if len > 0 => self.arrive(node, len - 1, req),
            _ => req_complete(req, NO_SUCH_DEVICE),
        }
    }

    /// A request arrives at one layer: its `EvtIoInCallerContext` runs in
    /// the sender's thread, then the request goes to the layer's queue.
    fn arrive(&self, node: DevNodeId, layer: usize, req: HostRequest) {
        // A device that cannot take requests gets none of its callbacks:
        // `deliver` refuses the request.
        let cb = lock(&self.inner.tree)
            .nodes
            .get(node.0)
            .filter(|n| {
                !matches!(
                    n.state,
                    PnpState::Removed
                        | PnpState::SurpriseRemoved
                        | PnpState::FailedStart(_)
                        | PnpState::Enumerated
                )
            })
            .and_then(|n| n.stack.get(layer))
            .map(|l| l.callbacks.clone());
        let req = match cb {
            Some(cb) => match cb.io_in_caller_context(req) {
                Some(req) => req,
                None => return,
            },
            None => req,
        };
        self.deliver(node, layer, req);
    }

    /// Completes with `STATUS_CANCELLED` every request a power-managed
    /// queue holds (not yet presented to its driver) whose issuer asked
    /// for cancellation: a request in a KMDF queue is the framework's,
    /// which completes it when it is cancelled.
    pub(crate) fn complete_canceled_held(&self) {
        use driver_platform::Request;
        let canceled: Vec<HostRequest> = {
            let mut tree = lock(&self.inner.tree);
            let mut out = Vec::new();
            for n in tree.nodes.iter_mut() {
                for l in n.stack.iter_mut() {
                    let (cancel, keep): (VecDeque<_>, VecDeque<_>) =
                        l.held.drain(..).partition(|r| r.is_canceled());
                    l.held = keep;
                    out.extend(cancel);
                }
            }
            out
        };
        for req in canceled {
            req_complete(req, crate::driver::CANCELLED);
        }
    }

    /// Delivers a request to one layer's queue (held below D0 if
    /// power-managed), then its `io_request`.
    fn deliver(&self, node: DevNodeId, layer: usize, mut req: HostRequest) {
        let target = {
            let mut tree = lock(&self.inner.tree);
            let Some(n) = tree.nodes.get_mut(node.0) else {
                drop(tree);
                return req_complete(req, NO_SUCH_DEVICE);
            };
            match n.state {
                PnpState::Removed | PnpState::SurpriseRemoved => {
                    drop(tree);
                    return req_complete(req, NO_SUCH_DEVICE);
                }
                PnpState::FailedStart(_) | PnpState::Failed(_) | PnpState::Enumerated => {
                    drop(tree);
                    return req_complete(req, DELETE_PENDING);
                }
                _ => {}
            }
            let in_d0 = n.power == DevicePowerState::D0;
            let Some(l) = n.stack.get_mut(layer) else {
                drop(tree);
                return req_complete(req, NOT_SUPPORTED);
            };
            if l.power_managed && !in_d0 {
                req.present_from(None);
                req.set_owner(Some(l.service.clone()));
                l.held.push_back(req);
                return;
            }
            req.present_from(l.power_managed.then(|| l.presented.clone()));
            (l.service.clone(), l.callbacks.clone())
        };
        let (service, cb) = target;
        req.set_owner(Some(service));
        let lower = Lower {
            pnp: self,
            node,
            layer: layer.checked_sub(1),
        };
        cb.io_request(&lower, req);
    }

    /// `IRP_MN_QUERY_INTERFACE` sent to the top of `node`'s stack; each layer
    /// top-down may answer, with the closest version it supports not above
    /// the one asked for (the consumer checks [`InterfaceRef::version`]).
    /// An answer above the version asked breaks that contract: it is a
    /// `Protocol` violation charged to the provider and no answer. The
    /// reference is counted against the stack.
    pub fn query_interface(
        &self,
        node: DevNodeId,
        guid: &WinGuid,
        version: u16,
    ) -> Option<InterfaceRef> {
        self.query_interface_as(node, guid, version, None)
    }

    pub(crate) fn query_interface_as(
        &self,
        node: DevNodeId,
        guid: &WinGuid,
        version: u16,
        consumer: Option<(Arc<str>, DevNodeId)>,
    ) -> Option<InterfaceRef> {
        // IRP_MN_QUERY_INTERFACE is sent and handled at PASSIVE_LEVEL only.
        // Recorded against the caller (or, from host code, the consumer),
        // and answered anyway: the violation is the failure.
        if context::is_set() {
            crate::irql::check_max("IRP_MN_QUERY_INTERFACE", Irql::PASSIVE);
        } else if crate::irql::current() > Irql::PASSIVE {
            let driver = consumer.as_ref().map(|(service, _)| service.clone());
            let _caller = context::enter(Context {
                verifier: self.inner.verifier.clone(),
                driver,
            });
            crate::irql::check_max("IRP_MN_QUERY_INTERFACE", Irql::PASSIVE);
        }
        let holder = consumer.as_ref().map(|(_, n)| *n);
        // A removed devnode has no device object left to send the IRP to.
        let refs = lock(&self.inner.tree)
            .nodes
            .get_mut(node.0)
            .filter(|n| n.state != PnpState::Removed)?
            .interface_refs
            .entry(holder)
            .or_default()
            .clone();
        let consumer = consumer.map(|(service, _)| service);
        for (service, cb) in self.layers(node).into_iter().rev() {
            if let Some(provided) = cb.query_interface(guid, version) {
                if provided.version > version {
                    self.inner.verifier.report(
                        Some(&service),
                        ViolationKind::Protocol {
                            detail: format!(
                                "IRP_MN_QUERY_INTERFACE for {guid} answered at version \
                                 {:#06x}, above the {version:#06x} asked for",
                                provided.version
                            ),
                        },
                    );
                    continue;
                }
                return Some(
                    InterfaceRef::new(
                        *guid,
                        provided.version,
                        provided.object,
                        refs,
                        self.inner.verifier.clone(),
                        consumer,
                    )
                    .provided_by(service),
                );
            }
        }
        None
    }

    /// Query-stop, then stop (release hardware) — for resource rebalance.
    /// A veto sends cancel-stop to the layers that agreed.
    pub fn stop(&self, node: DevNodeId) -> Result<(), Veto> {
        self.query("query-stop", node, |cb| cb.query_stop())?;
        self.leave_d0(node, DevicePowerState::D3, StopAction::Suspend);
        self.release_prepared(node);
        if let Some(n) = lock(&self.inner.tree).nodes.get_mut(node.0) {
            n.state = PnpState::Stopped;
        }
        Ok(())
    }

    /// Restarts a stopped devnode (new resources, same stack).
    pub fn restart(&self, node: DevNodeId) {
        if self.state(node) == Some(PnpState::Stopped) {
            self.start(node);
        }
    }

    /// Asks every layer of `node`'s subtree (children first, each stack
    /// top-down); on a veto, everyone who agreed gets cancel-remove. A
    /// query-remove first notifies the remote I/O targets open on each
    /// devnode (`EvtIoTargetQueryRemove`, which may veto) and then fails
    /// if a handle is still open on it, as the PnP manager does; a
    /// cancelled query-remove ends with `EvtIoTargetRemoveCanceled` for the
    /// targets notified. Interface references do not count: they are the
    /// consumer's to give back when its own device goes.
    fn query(
        &self,
        what: &'static str,
        node: DevNodeId,
        ask: impl Fn(&dyn DeviceCallbacks) -> NtStatus,
    ) -> Result<(), Veto> {
        let mut agreed: Vec<Arc<dyn DeviceCallbacks>> = Vec::new();
        let mut notified = Vec::new();
        let removing = what == "query-remove";
        let cancel = |agreed: &[Arc<dyn DeviceCallbacks>], notified| {
            for cb in agreed {
                cb.cancel_remove();
            }
            self.notify_target_remove_canceled(notified);
        };
        for n in self.subtree_postorder(node) {
            if removing {
                if let Err(veto) = self.notify_target_query_remove(n, &mut notified) {
                    cancel(&agreed, notified);
                    return Err(veto);
                }
                let handles = self.open_handles(n);
                if handles > 0 {
                    cancel(&agreed, notified);
                    return Err(Veto {
                        what,
                        instance_path: self.instance_path(n).unwrap_or_default(),
                        service: format!("host ({handles} open handle(s))"),
                        status: crate::driver::UNSUCCESSFUL,
                    });
                }
            }
            for (service, cb) in self.layers(n).into_iter().rev() {
                let status = ask(cb.as_ref());
                if status != SUCCESS {
                    cancel(&agreed, notified);
                    return Err(Veto {
                        what,
                        instance_path: self.instance_path(n).unwrap_or_default(),
                        service: service.to_string(),
                        status,
                    });
                }
                agreed.push(cb);
            }
        }
        Ok(())
    }

    /// Query-remove, then remove the subtree (children first). Refused
    /// while a handle is open on a devnode of the subtree, or when a
    /// driver or a remote I/O target's `EvtIoTargetQueryRemove` vetoes.
    pub fn query_and_remove(&self, node: DevNodeId) -> Result<(), Veto> {
        self.query("query-remove", node, |cb| cb.query_remove())?;
        self.remove(node);
        Ok(())
    }

    /// Surprise removal (`IRP_MN_SURPRISE_REMOVAL`): the hardware is gone.
    /// Each stack of the subtree, children first, goes through KMDF's
    /// sequence: requests its queues held complete with
    /// `STATUS_NO_SUCH_DEVICE`, every layer top-down hears
    /// `EvtDeviceSurpriseRemoval`, then the stack leaves D0 and releases
    /// hardware. `IRP_MN_REMOVE_DEVICE` follows for each devnode only once
    /// the last handle to it is closed and its children are removed
    /// ([`PnpManager::remove_when_no_handles_remain`]).
    pub fn surprise_remove(&self, node: DevNodeId) {
        // The hardware left the bus before anyone hears of it.
        for n in self.subtree_postorder(node) {
            if let Some(function) = self.pci_function(n) {
                function.surprise_removed();
            }
        }
        self.surprise_removal_sequence(node);
    }

    /// KMDF's surprise-removal sequence for each stack of the subtree
    /// (see [`PnpManager::surprise_remove`]); the hardware may still be
    /// there (a device its driver reported failed, `WdfDeviceSetFailed`).
    fn surprise_removal_sequence(&self, node: DevNodeId) {
        let subtree = self.subtree_postorder(node);
        for &n in &subtree {
            let (was, held) = {
                let mut tree = lock(&self.inner.tree);
                let dn = &mut tree.nodes[n.0];
                let was = std::mem::replace(&mut dn.state, PnpState::SurpriseRemoved);
                let held = dn.purge_queues();
                (was, held)
            };
            if matches!(was, PnpState::Removed | PnpState::SurpriseRemoved) {
                // Already gone (or going): nothing more to tell its drivers.
                if let Some(dn) = lock(&self.inner.tree).nodes.get_mut(n.0) {
                    dn.state = was;
                }
                continue;
            }
            for req in held {
                req_complete(req, NO_SUCH_DEVICE);
            }
            if matches!(was, PnpState::Started | PnpState::Stopped) {
                for (_, cb) in self.layers(n).into_iter().rev() {
                    cb.surprise_removal();
                }
            }
            self.leave_d0(n, DevicePowerState::D3, StopAction::Purge);
            self.release_prepared(n);
            self.notify_target_remove_complete(n);
        }
        for &n in &subtree {
            self.remove_when_no_handles_remain(n, self.open_handles(n));
        }
    }

    /// Open handles on a devnode's device: the count that holds back
    /// `IRP_MN_REMOVE_DEVICE` after a surprise removal and fails a
    /// query-remove: the open remote I/O targets (`io_target.rs`) and the
    /// file objects not yet closed (`file.rs`: handles open, or requests
    /// on a cleaned-up file still in flight). Closing the last one
    /// re-checks a surprise-removed devnode (the hook registered in
    /// [`PnpManager::with_registry`]).
    pub(crate) fn open_handles(&self, node: DevNodeId) -> usize {
        self.io_target_handles(node) + self.file_object_count(node)
    }

    /// Whether `device` has an enabled device interface of `class`.
    pub(crate) fn interface_enabled(&self, device: DevNodeId, class: WinGuid) -> bool {
        lock(&self.inner.tree)
            .nodes
            .get(device.0)
            .is_some_and(|n| n.interfaces.get(&class) == Some(&true))
    }

    /// Sends `IRP_MN_REMOVE_DEVICE` to a surprise-removed devnode once
    /// nothing holds it any more: `open_handles` is the number of handles
    /// still open on it, and its children must all be removed (a parent is
    /// removed after its children). Whoever closes a handle to such a
    /// device calls this with the count left; removing the last child
    /// retries its surprise-removed parent.
    pub fn remove_when_no_handles_remain(&self, node: DevNodeId, open_handles: usize) {
        let (parent, waiting_for_children) = {
            let tree = lock(&self.inner.tree);
            let Some(dn) = tree.nodes.get(node.0) else {
                return;
            };
            if dn.state != PnpState::SurpriseRemoved || open_handles > 0 {
                return;
            }
            (
                dn.parent,
                dn.children
                    .iter()
                    .any(|c| tree.nodes[c.0].state != PnpState::Removed),
            )
        };
        if waiting_for_children {
            return;
        }
        let failed = lock(&self.inner.tree)
            .nodes
            .get_mut(node.0)
            .and_then(|n| n.failed.take());
        if let Some((service, action)) = failed {
            return self.failed_device_removed(node, &service, action);
        }
        self.remove(node);
        if let Some(parent) = parent {
            self.remove_when_no_handles_remain(parent, self.open_handles(parent));
        }
    }

    /// The end of a failed device's surprise-removal path: its PDO stays
    /// (the device is still on its bus), the device objects above it are
    /// deleted, and the stack is built and started again if its driver
    /// asked for a restart and the restarts are not used up.
    fn failed_device_removed(&self, node: DevNodeId, service: &str, action: DeviceFailedAction) {
        let restart = action == DeviceFailedAction::AttemptRestart
            && lock(&self.inner.tree)
                .nodes
                .get_mut(node.0)
                .is_some_and(|n| {
                    n.restarts += 1;
                    n.restarts <= MAX_RESTARTS_AFTER_FAILURE
                });
        let reason = format!("`{service}` reported the device failed ({action:?})");
        self.delete_device_objects(node, PnpState::Failed(reason));
        if restart {
            self.start(node);
        }
    }

    /// `EvtDeviceReleaseHardware` for every layer that prepared hardware
    /// and has not released it, top-down.
    fn release_prepared(&self, node: DevNodeId) {
        let prepared = lock(&self.inner.tree)
            .nodes
            .get_mut(node.0)
            .map_or(0, |n| std::mem::take(&mut n.prepared));
        for (_, cb) in self.layers(node).into_iter().take(prepared).rev() {
            cb.release_hardware();
        }
    }

    /// Removes a subtree, children first: each stack leaves D0 top-down,
    /// releases hardware, and its device objects are deleted; a driver
    /// whose last device object goes away unloads.
    pub(crate) fn remove(&self, node: DevNodeId) {
        for n in self.subtree_postorder(node) {
            if self.state(n) == Some(PnpState::Removed) {
                continue;
            }
            self.leave_d0(n, DevicePowerState::D3, StopAction::Purge);
            self.release_prepared(n);
            self.delete_device_objects(n, PnpState::Removed);
        }
    }

    /// The end of `IRP_MN_REMOVE_DEVICE` for one devnode: held requests
    /// complete, its enabled interfaces go (with notifications), a
    /// reference still held on its interfaces is a leak, its device
    /// objects are deleted (drivers left without one unload), and the
    /// remote I/O targets on it or opened by it are done with. A removed
    /// devnode's PDO goes too and the devnode leaves the tree (its parent's
    /// children, the roots): no request or `IRP_MN_QUERY_INTERFACE` reaches
    /// it any more, and it stays in the table only for `state` and the like.
    /// A devnode whose start failed keeps its PDO (the bus still reports
    /// it) and ends in `end`.
    fn delete_device_objects(&self, n: DevNodeId, end: PnpState) {
        let keep_pdo = end != PnpState::Removed;
        let (layers, held, refs, path, interfaces) = {
            let mut tree = lock(&self.inner.tree);
            if !keep_pdo && let Some(parent) = tree.nodes[n.0].parent {
                tree.nodes[parent.0].children.retain(|&c| c != n);
            }
            let dn = &mut tree.nodes[n.0];
            dn.state = end;
            let held = dn.purge_queues();
            let layers: Vec<Arc<str>> = dn
                .stack
                .iter()
                .skip(usize::from(keep_pdo))
                .map(|l| l.service.clone())
                .filter(|s| &**s != HOST_PDO)
                .collect();
            dn.stack.truncate(usize::from(keep_pdo));
            let interfaces: Vec<WinGuid> = dn
                .interfaces
                .iter()
                .filter(|(_, on)| **on)
                .map(|(g, _)| *g)
                .collect();
            dn.interfaces.clear();
            (
                layers,
                held,
                dn.references_outstanding(),
                dn.instance_path.clone(),
                interfaces,
            )
        };
        for req in held {
            req_complete(req, NO_SUCH_DEVICE);
        }
        for class in interfaces {
            lock(&self.inner.interface_events).push(InterfaceEvent::Removal { class, device: n });
        }
        if refs > 0 {
            self.inner.verifier.report(
                None,
                ViolationKind::ReferenceLeak {
                    what: format!("{refs} interface reference(s) on {path} outstanding at removal"),
                },
            );
        }
        for service in layers {
            self.device_object_deleted(&service);
        }
        self.notify_target_remove_complete(n);
        self.close_targets_opened_by(n);
    }

    /// Wraps a driver's callbacks so each runs in that driver's context
    /// (violations are charged to it) and never after it unloaded.
    fn entered(
        &self,
        service: &Arc<str>,
        inner: Arc<dyn DeviceCallbacks>,
    ) -> Arc<dyn DeviceCallbacks> {
        Arc::new(InDriver {
            service: service.clone(),
            verifier: self.inner.verifier.clone(),
            inner,
        })
    }

    fn device_object_deleted(&self, service: &str) {
        let mut drivers = lock(&self.inner.drivers);
        let Some(d) = drivers.get_mut(service) else {
            return;
        };
        d.devices = d.devices.saturating_sub(1);
        if d.devices == 0 && d.loaded {
            d.loaded = false;
            let refs = d.references.load(Ordering::Acquire);
            drop(drivers);
            self.inner.verifier.driver_unloaded(service);
            if refs > 0 {
                self.inner.verifier.report(
                    Some(service),
                    ViolationKind::UnloadWhileReferenced { references: refs },
                );
            }
            let hooks: Vec<UnloadHook> = lock(&self.inner.unload_hooks).clone();
            for hook in hooks {
                hook(service);
            }
        }
    }
}

/// A driver's callbacks as the host calls them: inside the driver's
/// context, and only while its image is loaded.
struct InDriver {
    service: Arc<str>,
    verifier: Verifier,
    inner: Arc<dyn DeviceCallbacks>,
}

impl InDriver {
    /// Calls a request callback (`EvtIoDeviceControl`): at the IRQL of the
    /// caller, as KMDF presents a request on the sender's thread.
    fn call<R>(
        &self,
        callback: &'static str,
        otherwise: R,
        f: impl FnOnce(&dyn DeviceCallbacks) -> R,
    ) -> R {
        if &*self.service == HOST_PDO {
            let _host = context::enter(Context::host(self.verifier.clone()));
            return f(self.inner.as_ref());
        }
        if !self.verifier.check_callback(&self.service, callback) {
            return otherwise;
        }
        let _driver = context::enter(Context::driver(self.verifier.clone(), self.service.clone()));
        crate::stack::measured(crate::stack::RoutineKind::Callback, callback, || {
            f(self.inner.as_ref())
        })
    }

    /// Calls a PnP or power callback as the PnP manager does: on a system
    /// thread at PASSIVE_LEVEL, whatever IRQL the event that caused it came
    /// from (a bus reporting a child missing from its DPC). Returning at
    /// another level is [`ViolationKind::IrqlMismatch`] naming the
    /// callback; the host's thread goes back to its own level regardless.
    fn call_pnp<R>(
        &self,
        callback: &'static str,
        otherwise: R,
        f: impl FnOnce(&dyn DeviceCallbacks) -> R,
    ) -> R {
        self.call(callback, otherwise, |d| {
            // Inside the context, so a mismatch is charged to the driver.
            let _system_thread = IrqlGuard::switched_for(Irql::PASSIVE, callback);
            f(d)
        })
    }
}

impl DeviceCallbacks for InDriver {
    fn prepare_hardware(&self) -> NtStatus {
        self.call_pnp("EvtDevicePrepareHardware", NO_SUCH_DEVICE, |d| {
            d.prepare_hardware()
        })
    }
    fn release_hardware(&self) -> NtStatus {
        self.call_pnp("EvtDeviceReleaseHardware", NO_SUCH_DEVICE, |d| {
            d.release_hardware()
        })
    }
    fn d0_entry(&self, from: DevicePowerState) -> NtStatus {
        self.call_pnp("EvtDeviceD0Entry", NO_SUCH_DEVICE, |d| d.d0_entry(from))
    }
    fn d0_exit(&self, to: DevicePowerState) -> NtStatus {
        self.call_pnp("EvtDeviceD0Exit", NO_SUCH_DEVICE, |d| d.d0_exit(to))
    }
    fn d0_entry_post_interrupts_enabled(&self, from: DevicePowerState) -> NtStatus {
        self.call_pnp(
            "EvtDeviceD0EntryPostInterruptsEnabled",
            NO_SUCH_DEVICE,
            |d| d.d0_entry_post_interrupts_enabled(from),
        )
    }
    fn d0_exit_pre_interrupts_disabled(&self, to: DevicePowerState) -> NtStatus {
        self.call_pnp(
            "EvtDeviceD0ExitPreInterruptsDisabled",
            NO_SUCH_DEVICE,
            |d| d.d0_exit_pre_interrupts_disabled(to),
        )
    }
    fn query_remove(&self) -> NtStatus {
        self.call_pnp("IRP_MN_QUERY_REMOVE_DEVICE", NO_SUCH_DEVICE, |d| {
            d.query_remove()
        })
    }
    fn query_stop(&self) -> NtStatus {
        self.call_pnp("IRP_MN_QUERY_STOP_DEVICE", NO_SUCH_DEVICE, |d| {
            d.query_stop()
        })
    }
    fn self_managed_io_init(&self) {
        self.call_pnp("EvtDeviceSelfManagedIoInit", (), |d| {
            d.self_managed_io_init()
        });
    }
    fn cancel_remove(&self) {
        self.call_pnp("IRP_MN_CANCEL_REMOVE_DEVICE", (), |d| d.cancel_remove());
    }
    fn surprise_removal(&self) {
        self.call_pnp("EvtDeviceSurpriseRemoval", (), |d| d.surprise_removal());
    }
    fn query_power(&self, target: driver_platform::SystemPowerState) -> NtStatus {
        self.call_pnp("IRP_MN_QUERY_POWER", NO_SUCH_DEVICE, |d| {
            d.query_power(target)
        })
    }
    fn file_create(&self, file: &crate::file::FileObject) -> NtStatus {
        self.call_pnp("EvtDeviceFileCreate", NO_SUCH_DEVICE, |d| {
            d.file_create(file)
        })
    }
    fn file_cleanup(&self, file: &crate::file::FileObject) {
        self.call_pnp("EvtFileCleanup", (), |d| d.file_cleanup(file));
    }
    fn file_close(&self, file: &crate::file::FileObject) {
        self.call_pnp("EvtFileClose", (), |d| d.file_close(file));
    }
    fn io_in_caller_context(&self, req: HostRequest) -> Option<HostRequest> {
        if &*self.service != HOST_PDO
            && !self
                .verifier
                .check_callback(&self.service, "EvtIoInCallerContext")
        {
            req_complete(req, NO_SUCH_DEVICE);
            return None;
        }
        self.call("EvtIoInCallerContext", None, |d| {
            d.io_in_caller_context(req)
        })
    }
    fn io_request(&self, lower: &dyn Forward, req: HostRequest) {
        if &*self.service != HOST_PDO
            && !self
                .verifier
                .check_callback(&self.service, "EvtIoDeviceControl")
        {
            return req_complete(req, NO_SUCH_DEVICE);
        }
        self.call("EvtIoDeviceControl", (), |d| d.io_request(lower, req));
    }
    fn query_interface(
        &self,
        guid: &WinGuid,
        version: u16,
    ) -> Option<crate::driver::ProvidedInterface> {
        self.call_pnp("IRP_MN_QUERY_INTERFACE", None, |d| {
            d.query_interface(guid, version)
        })
    }
    fn create_child(&self, child: &ChildDescription) -> Option<Arc<dyn DeviceCallbacks>> {
        self.call_pnp("EvtChildListCreateDevice", None, |d| d.create_child(child))
    }
    fn io_stop(&self, stopped: &StoppedRequest) {
        // From the power transition's system thread, at PASSIVE_LEVEL.
        self.call_pnp("EvtIoStop", (), |d| d.io_stop(stopped));
    }
    fn io_resume(&self, request: &StoppedRequest) {
        self.call_pnp("EvtIoResume", (), |d| d.io_resume(request));
    }
    fn resources(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        self.inner.resources()
    }
    fn power_managed_queue(&self) -> bool {
        self.inner.power_managed_queue()
    }
}
