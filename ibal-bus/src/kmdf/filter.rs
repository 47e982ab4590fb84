//! `DriverEntry`, `EvtDriverDeviceAdd` and the filter device's PnP/power
//! callbacks: the binding to the HCA below, the access layer over it, and
//! the children reported on its child list.
//!
//! The callbacks run in the order of the simulated shell
//! (`sim_shells::ibal_bus`), which the scenario tests check:
//!
//! 1. `EvtDriverDeviceAdd`: `WdfFdoInitSetFilter`; the default child list
//!    (`WdfFdoInitSetDefaultChildListConfig`, identification description
//!    [`ChildIdentification`]); the user-mode proxy's file objects and
//!    `EvtIoInCallerContext` ([`super::proxy::configure`]); the device
//!    with its [`FilterShell`]; the device interface
//!    `GUID_IB_AL_DEVICE_INTERFACE`; the proxy's default queue, not
//!    power-managed ([`super::proxy::create_queue`]).
//! 2. `EvtDevicePrepareHardware`: `GUID_IB_CI_INTERFACE` queried at the
//!    required version ([`FfiCi::query`]; `STATUS_REVISION_MISMATCH` fails
//!    the start, nothing opened).
//! 3. `EvtDeviceD0Entry`, the first one (the miniport below is in D0): the
//!    child list read from the Parameters key, the CA opened. Resume does
//!    nothing: the CA stays open across sleep.
//! 4. `EvtDeviceSelfManagedIoInit` (the stack started): `QueryCa` sent
//!    through the interface; its completion (any IRQL up to DISPATCH_LEVEL)
//!    binds and registers the CA, creates its access layer and reports the
//!    children present.
//! 5. `EvtDeviceReleaseHardware`: the access layer detached, what the CA
//!    refused at a client's close destroyed again
//!    (`AccessLayer::destroy_orphans`, PASSIVE_LEVEL, waiting on a
//!    `KEVENT`), the CA deregistered and closed, the interfaces
//!    dereferenced. The children stay (the child list lives with the
//!    device); a restarted stack reconciles them against the list read
//!    again.
//!
//! The CA gone (`AccessLayer::ca_removed`): a child's
//! `EvtDeviceSurpriseRemoval` when the HCA's function reads as gone ([`FilterShell::child_surprise_removed`]); the filter's
//! own `EvtDeviceSurpriseRemoval`, which PnP runs after its children's.
//! A `PortActive` event re-queries the ports (`QueryCa` with a completion
//! routine, as at the start) and tells the clients each table that
//! changed (`AccessLayer::port_changed`).

use alloc::sync::{Arc, Weak};
use alloc::vec::Vec;
use core::ptr;

use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::handle::CqHandle;
use ib_types::interface::GUID_IB_AL_DEVICE_INTERFACE;
use ib_types::status::{IbStatus, NtStatus};
use ibal_bus_core::al::{AccessLayer, CiRequests};
use ibal_bus_core::ca_registry::{BoundCa, CaRegistry, OpenedCa};
use ibal_bus_core::children::{
    ChildEntry, ChildList, ChildSet, PortChild, port_children, read_child_list,
};
use ibal_bus_core::ci::{
    CaEvents, CiAccess, PortIdentity, PortQuery, ports_from_answer, update_known_ports,
};
use kmdf_platform::context::{install, shell_attributes, shell_of};
use kmdf_platform::device::{pnp_power_callbacks, set_pnp_power_callbacks};
use kmdf_platform::sync::{KernelSpinLock, SpinLock};
use wdk_sys::{
    BUS_INTERFACE_STANDARD, GUID, NTSTATUS, PCI_WHICHSPACE_CONFIG, PINTERFACE, PVOID,
    PWDFDEVICE_INIT, ULONG, WDF_CHILD_LIST_CONFIG, WDF_NO_OBJECT_ATTRIBUTES,
    WDF_PNPPOWER_EVENT_CALLBACKS, WDF_POWER_DEVICE_STATE, WDFCMRESLIST, WDFDEVICE, WDFDRIVER,
    WDFOBJECT, call_unsafe_wdf_function_binding,
};

use super::child::{
    BUS_INTERFACE_STANDARD_GUID, ChildIdentification, evt_child_list_create_device,
};
use super::ci::FfiCi;

use super::platform::ParametersKey;
use super::proxy;
use kmdf_platform::event::{KeIrql, KernelEvent};

/// The access layer over one bound CA.
pub type Al = AccessLayer<KernelSpinLock, FfiCi>;

/// `GUID_IB_AL_DEVICE_INTERFACE` as a Windows `GUID`.
static AL_DEVICE_INTERFACE_GUID: GUID = GUID {
    Data1: GUID_IB_AL_DEVICE_INTERFACE.data1.get(),
    Data2: GUID_IB_AL_DEVICE_INTERFACE.data2.get(),
    Data3: GUID_IB_AL_DEVICE_INTERFACE.data3.get(),
    Data4: GUID_IB_AL_DEVICE_INTERFACE.data4,
};

/// The CAs bound by every filter device of this driver, by CA GUID.
static CA_REGISTRY: SpinLock<Option<CaRegistry<FfiCi>>> =
    lock_api::Mutex::const_new(<KernelSpinLock as lock_api::RawMutex>::INIT, None);

/// Every filter device of this driver that still has its shell (the
/// administrator IOCTL reconciles them all, as a registry change does).
static FILTERS: SpinLock<Vec<Weak<FilterShell>>> =
    lock_api::Mutex::const_new(<KernelSpinLock as lock_api::RawMutex>::INIT, Vec::new());

/// Re-reads the child list on every filter device and reports the
/// children that appeared and disappeared (`FilterShell::registry_changed`
/// on each). PASSIVE_LEVEL.
pub fn reconcile_every_filter() {
    let live: Vec<Arc<FilterShell>> = {
        let mut filters = FILTERS.lock();
        filters.retain(|shell| shell.strong_count() > 0);
        filters.iter().filter_map(Weak::upgrade).collect()
    };
    for shell in live {
        shell.registry_changed();
    }
}

kmdf_platform::driver_entry!(evt_driver_device_add);

/// `EvtDriverDeviceAdd`: the filter device on one HCA stack.
unsafe extern "C" fn evt_driver_device_add(
    driver: WDFDRIVER,
    mut device_init: PWDFDEVICE_INIT,
) -> NTSTATUS {
    // SAFETY: the framework's live init structure, before WdfDeviceCreate.
    unsafe { call_unsafe_wdf_function_binding!(WdfFdoInitSetFilter, device_init) };

    let pnp = WDF_PNPPOWER_EVENT_CALLBACKS {
        EvtDevicePrepareHardware: Some(evt_prepare_hardware),
        EvtDeviceReleaseHardware: Some(evt_release_hardware),
        EvtDeviceD0Entry: Some(evt_d0_entry),
        EvtDeviceSelfManagedIoInit: Some(evt_self_managed_io_init),
        EvtDeviceSurpriseRemoval: Some(evt_surprise_removal),
        ..pnp_power_callbacks()
    };
    // SAFETY: the framework's live init structure, before WdfDeviceCreate.
    unsafe { set_pnp_power_callbacks(device_init, pnp) };

    // WDF_CHILD_LIST_CONFIG_INIT: the identification description is
    // compared byte for byte (no compare callback), so it has no padding
    // (`ChildIdentification`).
    let mut children = WDF_CHILD_LIST_CONFIG {
        Size: size_of::<WDF_CHILD_LIST_CONFIG>() as ULONG,
        IdentificationDescriptionSize: size_of::<ChildIdentification>() as ULONG,
        EvtChildListCreateDevice: Some(evt_child_list_create_device),
        ..WDF_CHILD_LIST_CONFIG::default()
    };
    // SAFETY: the framework's live init structure, before WdfDeviceCreate.
    unsafe {
        call_unsafe_wdf_function_binding!(
            WdfFdoInitSetDefaultChildListConfig,
            device_init,
            &mut children,
            WDF_NO_OBJECT_ATTRIBUTES
        )
    };

    // SAFETY: the framework's live init structure, before WdfDeviceCreate.
    unsafe { proxy::configure(device_init) };

    let mut attributes = shell_attributes::<FilterShell>();
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
    let shell = Arc::new_cyclic(|me| FilterShell {
        me: me.clone(),
        device,
        driver,
        binding: SpinLock::new(Binding::Idle),
        list: SpinLock::new(ChildList::default()),
        children: SpinLock::new(ChildSet::default()),
        ports: SpinLock::new(Vec::new()),
        pci: SpinLock::new(None),
        relay: Arc::new(CaRelay {
            al: SpinLock::new(None),
            filter: me.clone(),
        }),
    });
    let weak = Arc::downgrade(&shell);
    // SAFETY: the device just created with a FilterShell context.
    if !unsafe { install(device as WDFOBJECT, shell) } {
        return NtStatus::INVALID_DEVICE_STATE.raw() as NTSTATUS;
    }
    {
        let mut filters = FILTERS.lock();
        filters.retain(|shell| shell.strong_count() > 0);
        filters.push(weak);
    }

    // One device interface per HCA: user mode opens the HCA it means. An
    // open is checked against the stack's named device object, the PDO,
    // whose security the PnP manager sets from the devnode's `Security`
    // property (the INF's IbalBus_Security_AddReg) and applies to the
    // stack: an SDDL on this unnamed filter FDO would not be what decides.
    // SAFETY: the live device just created; the GUID is static.
    let status = unsafe {
        call_unsafe_wdf_function_binding!(
            WdfDeviceCreateDeviceInterface,
            device,
            &AL_DEVICE_INTERFACE_GUID,
            ptr::null()
        )
    };
    if status < 0 {
        return status;
    }
    // SAFETY: the live filter device just created.
    unsafe { proxy::create_queue(device) }
}

/// Forwards the CA's callbacks to the access layer once there is one (the
/// CA is opened before its ports, and so its AL, are known).
#[derive(Debug)]
struct CaRelay {
    al: SpinLock<Option<Arc<Al>>>,
    /// The filter device, which re-queries its ports on a port event.
    filter: Weak<FilterShell>,
}

impl CaRelay {
    fn al(&self) -> Option<Arc<Al>> {
        self.al.lock().clone()
    }
}

impl CaEvents for CaRelay {
    fn completion(&self, cq: CqHandle) {
        if let Some(al) = self.al() {
            al.completion(cq);
        }
    }

    /// Up to DISPATCH_LEVEL (the miniport's DPC); never waits.
    fn async_event(&self, event: &AsyncEventRecord) {
        if let Some(al) = self.al() {
            // `LocalCatastrophic` is routed like any event and is not the
            // CA's removal: the failed miniport answers every request at
            // once and still hands each outstanding WR back flushed, which
            // the clients poll before they destroy what they own; the CA
            // goes at the stack's surprise removal, which follows (as the
            // simulated shell does).
            al.async_event(event);
        }
        // A port came up: its tables may have changed meanwhile, which
        // the CA raises no event for; the answer tells the clients.
        if event.code == AsyncEventCode::PortActive
            && let Some(filter) = self.filter.upgrade()
        {
            filter.requery_ports();
        }
    }
}

/// The HCA's PCI bus interface (`GUID_BUS_INTERFACE_STANDARD`, queried
/// over the filter's own stack, answered by the PCI PDO): its config-space
/// read tells whether the function is still on the bus. Held from
/// prepare-hardware to release-hardware.
struct PciBus(BUS_INTERFACE_STANDARD);

// SAFETY: the interface's context and routines are the PCI driver's,
// callable from any thread; the value is behind a spin lock.
unsafe impl Send for PciBus {}

/// [`PciBus`]'s config-space read, valid while its interface is
/// referenced.
struct ConfigReader {
    get_bus_data: wdk_sys::PGET_SET_DEVICE_DATA,
    context: PVOID,
}

impl ConfigReader {
    /// Whether the function has left the bus: its vendor ID, read from
    /// config space, is all ones (a read of a function that is gone ends
    /// in a master abort), or nothing could be read. PASSIVE_LEVEL.
    fn function_gone(&self) -> bool {
        let Some(get_bus_data) = self.get_bus_data else {
            return false;
        };
        let mut vendor_id: u16 = 0;
        // SAFETY: the interface is referenced (the caller's contract); the
        // buffer is writable for the 2 bytes asked.
        let read = unsafe {
            get_bus_data(
                self.context,
                PCI_WHICHSPACE_CONFIG,
                (&raw mut vendor_id).cast::<core::ffi::c_void>() as PVOID,
                0,
                size_of::<u16>() as ULONG,
            )
        };
        read as usize != size_of::<u16>() || vendor_id == u16::MAX
    }
}

impl PciBus {
    /// Queries the interface from `device`'s stack; `None` when nothing
    /// below answers it (the function-gone check then answers "present").
    ///
    /// # Safety
    /// `device` is the live filter device, in `EvtDevicePrepareHardware`.
    unsafe fn query(device: WDFDEVICE) -> Option<Self> {
        let mut bus = BUS_INTERFACE_STANDARD::default();
        // SAFETY: the live filter device; the structure is writable for
        // its whole size, which is what is declared.
        let status = unsafe {
            call_unsafe_wdf_function_binding!(
                WdfFdoQueryForInterface,
                device,
                &BUS_INTERFACE_STANDARD_GUID,
                (&raw mut bus).cast::<core::ffi::c_void>() as PINTERFACE,
                size_of::<BUS_INTERFACE_STANDARD>() as u16,
                1,
                ptr::null_mut()
            )
        };
        (status >= 0).then_some(Self(bus))
    }

    /// The config-space reader: the routine and its context, copied so
    /// the read runs outside the lock that holds the interface.
    fn config_reader(&self) -> ConfigReader {
        ConfigReader {
            get_bus_data: self.0.GetBusData,
            context: self.0.Context,
        }
    }

    /// Gives the query's reference back. PASSIVE_LEVEL.
    fn release(self) {
        if let Some(dereference) = self.0.InterfaceDereference {
            // SAFETY: the reference the query took, given back once (the
            // value is consumed).
            unsafe { dereference(self.0.Context) };
        }
    }
}

/// Where one filter device is in its binding (as in the simulated shell).
enum Binding {
    /// Not started, or released.
    Idle,
    /// The interface is queried and its version checked.
    Queried(Arc<FfiCi>),
    /// The CA is open; the port query is in flight.
    Opening(OpenedCa<FfiCi>),
    /// The port query failed: the opened CA waits for release-hardware.
    Failed(OpenedCa<FfiCi>),
    /// Bound and registered, with its access layer.
    Bound(Arc<BoundCa<FfiCi>>, Arc<Al>),
    /// Bound, but another stack registered a CA with the same GUID: not
    /// registered, no children; closed at release.
    Duplicate(Arc<BoundCa<FfiCi>>),
}

/// The shell state of one filter device (owned by its context).
pub struct FilterShell {
    me: Weak<FilterShell>,
    device: WDFDEVICE,
    driver: WDFDRIVER,
    binding: SpinLock<Binding>,
    list: SpinLock<ChildList>,
    children: SpinLock<ChildSet>,
    /// The ports as last answered by `QueryCa` (compared on a re-query).
    ports: SpinLock<Vec<PortIdentity>>,
    /// The HCA's PCI bus interface, from prepare- to release-hardware.
    pci: SpinLock<Option<PciBus>>,
    relay: Arc<CaRelay>,
}

impl core::fmt::Debug for FilterShell {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("FilterShell")
            .field("device", &self.device)
            .field("children", &self.children.lock().len())
            .finish_non_exhaustive()
    }
}

// SAFETY: WDF handles are valid from any thread; the mutable state is
// behind spin locks.
unsafe impl Send for FilterShell {}
// SAFETY: as above.
unsafe impl Sync for FilterShell {}

impl FilterShell {
    /// The access layer of the bound CA, while bound.
    pub fn al(&self) -> Option<Arc<Al>> {
        self.relay.al()
    }

    /// The child present under `instance_id` and its entry's device ID
    /// (the entry as last read; its first hardware ID if the entry is gone
    /// from the list).
    pub fn child(&self, instance_id: &str) -> Option<(PortChild, alloc::string::String)> {
        let port = self
            .children
            .lock()
            .iter()
            .find(|c| c.instance_id() == instance_id)
            .cloned()?;
        let device_id = self
            .list
            .lock()
            .entries
            .iter()
            .find(|e: &&ChildEntry| e.name == port.entry)
            .map(|e| e.device_id.clone())
            .or_else(|| port.description.hardware_ids.first().cloned())?;
        Some((port, device_id))
    }

    /// The CA is gone for good (its HCA left the bus or failed): the
    /// access layer tells its clients once and ends their requests with
    /// `STATUS_DEVICE_REMOVED` from now on (`AccessLayer::ca_removed`).
    /// DISPATCH_LEVEL or below.
    fn ca_gone(&self) {
        if let Some(al) = self.al() {
            al.ca_removed();
        }
    }

    /// A child's `EvtDeviceSurpriseRemoval` (PnP runs the children's
    /// before the filter's own): if the HCA's function has left the bus
    /// (its config space reads as gone, [`ConfigReader::function_gone`]) the CA
    /// is gone with it and the access layer is told now, before the
    /// child's client goes down. A child going alone (reported missing,
    /// its own stack failed) finds the function present and leaves the CA
    /// alone; so does a failed HCA whose function stays (its clients drain
    /// the flushed WRs first), whose stack's surprise removal, the
    /// filter's own, tells the access layer. PASSIVE_LEVEL.
    pub fn child_surprise_removed(&self) {
        if self.hca_function_gone() {
            self.ca_gone();
        }
    }

    /// Whether the HCA's function has left the bus
    /// ([`ConfigReader::function_gone`]); `false` when the bus interface
    /// could not be queried. For the children's removal callbacks, which
    /// PnP runs before the filter's release-hardware. PASSIVE_LEVEL.
    pub fn hca_function_gone(&self) -> bool {
        // Read outside the spin lock (at PASSIVE_LEVEL, where the bus
        // driver's routine may always be called). The interface cannot go
        // meanwhile: release-hardware runs after every child's removal.
        let reader = self.pci.lock().as_ref().map(PciBus::config_reader);
        reader.is_some_and(|reader| reader.function_gone())
    }

    /// Reads the child list from the Parameters key. PASSIVE_LEVEL.
    fn read_list(&self) {
        // SAFETY: the driver object outlives its devices; callers are at
        // PASSIVE_LEVEL (D0 entry).
        if let Ok(key) = unsafe { ParametersKey::open(self.driver) } {
            let list = read_child_list(&key);
            *self.list.lock() = list;
        }
    }

    /// A change of the child list in the Parameters key (the simulated
    /// shell's `IbalBusDevice::registry_changed`): the list read again and
    /// the children reported present and missing. PASSIVE_LEVEL. The
    /// proxy's administrator IOCTL calls it on every filter device
    /// ([`reconcile_every_filter`]); no registry change notification is
    /// wired yet (docs/ibal-bus.md).
    pub fn registry_changed(&self) {
        self.read_list();
        let bound = match &*self.binding.lock() {
            Binding::Bound(bound, _) => Some(bound.clone()),
            _ => None,
        };
        if let Some(bound) = bound {
            self.report_children(&bound);
        }
    }

    /// Reports what changed between the children present and those the
    /// list gives `bound`'s ports. DISPATCH_LEVEL or below.
    fn report_children(&self, bound: &BoundCa<FfiCi>) {
        let desired = port_children(bound.identity().ca_guid, bound.ports(), &self.list.lock());
        let changes = self.children.lock().reconcile(desired);
        // SAFETY: the live filter device, created with a default child list.
        let list =
            unsafe { call_unsafe_wdf_function_binding!(WdfFdoGetDefaultChildList, self.device) };
        for gone in &changes.disappeared {
            let mut identification = ChildIdentification::of(gone);
            // SAFETY: the device's child list; the description is
            // initialised and lives for the call (the framework copies it).
            let _ = unsafe {
                call_unsafe_wdf_function_binding!(
                    WdfChildListUpdateChildDescriptionAsMissing,
                    list,
                    identification.header()
                )
            };
        }
        for child in &changes.appeared {
            let mut identification = ChildIdentification::of(child);
            // SAFETY: as above; no address description.
            let _ = unsafe {
                call_unsafe_wdf_function_binding!(
                    WdfChildListAddOrUpdateChildDescriptionAsPresent,
                    list,
                    identification.header(),
                    ptr::null_mut()
                )
            };
        }
    }

    /// The `QueryCa` answered: completes the bind, registers the CA,
    /// creates its access layer and reports the children. Up to
    /// DISPATCH_LEVEL.
    fn ports_answered(&self, ports: Result<Vec<PortIdentity>, IbStatus>) {
        let opened = {
            let mut binding = self.binding.lock();
            match core::mem::replace(&mut *binding, Binding::Idle) {
                Binding::Opening(opened) => opened,
                other => {
                    *binding = other;
                    return;
                }
            }
        };
        let bound = match opened.with_ports(ports) {
            Ok(bound) => Arc::new(bound),
            Err((opened, _error)) => {
                *self.binding.lock() = Binding::Failed(opened);
                return;
            }
        };
        let registered = CA_REGISTRY
            .lock()
            .get_or_insert_with(CaRegistry::default)
            .register(bound.clone());
        if let Err((bound, _error)) = registered {
            *self.binding.lock() = Binding::Duplicate(bound);
            return;
        }
        *self.ports.lock() = bound.ports().to_vec();
        let al = Arc::new(Al::new(bound.ci().clone(), bound.ca_handle()));
        *self.relay.al.lock() = Some(al.clone());
        *self.binding.lock() = Binding::Bound(bound.clone(), al);
        self.report_children(&bound);
    }

    /// Sends `QueryCa` on the opened CA with a completion that finishes
    /// the bind. PASSIVE_LEVEL.
    fn send_port_query(&self) {
        let (ci, ca) = match &*self.binding.lock() {
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
        let bound = match &*self.binding.lock() {
            Binding::Bound(bound, _) => bound.clone(),
            _ => return,
        };
        // Not sent (no resources): the tables stay as last known, and the
        // next port event asks again.
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
        let changed = update_known_ports(&mut self.ports.lock(), ports);
        if let Some(al) = self.al() {
            for (old, new) in &changed {
                al.port_changed(old, new);
            }
        }
    }

    /// Sends `QueryCa` on `ca` through `ci` with a completion routine that
    /// hands the ports (or the failure) to `answered`, now or later. Up to
    /// DISPATCH_LEVEL; never waits. An error is a request not sent.
    fn submit_port_query(
        &self,
        ci: &FfiCi,
        ca: u64,
        answered: fn(&Self, Result<Vec<PortIdentity>, IbStatus>),
    ) -> Result<(), IbStatus> {
        let query = PortQuery::new(ca)?;
        let me = self.me.clone();
        let request = ci.control_request(
            query.ioctl,
            query.input,
            query.output_len,
            alloc::boxed::Box::new(move |status: NtStatus, output: &[u8]| {
                let ports = ports_from_answer(status, output);
                if let Some(shell) = me.upgrade() {
                    answered(&shell, ports);
                }
            }),
        );
        // Completion is reported through the routine, now or later.
        ci.submit(request);
        Ok(())
    }

    /// Release-hardware: the AL detached after the orphans' destroys sent
    /// again, the CA deregistered and closed, the interfaces dereferenced.
    /// PASSIVE_LEVEL.
    fn release(&self) {
        let detached = self.relay.al.lock().take();
        // What the CA refused to destroy at a client's close is sent again
        // now that the clients are gone (PnP removed the children first):
        // the miniport refuses to close a CA whose kernel objects remain.
        // It waits on a KEVENT only for the CA's answers (each command
        // bounded by its timeout); after a removal there are none.
        if let Some(al) = &detached {
            let _ = al.destroy_orphans(&KeIrql, Arc::new(KernelEvent::default()));
        }
        drop(detached);
        self.ports.lock().clear();
        let binding = core::mem::replace(&mut *self.binding.lock(), Binding::Idle);
        let ci = match binding {
            Binding::Idle => None,
            Binding::Queried(ci) => Some(ci),
            Binding::Opening(opened) | Binding::Failed(opened) => {
                let ci = opened.ci().clone();
                let _ = opened.close();
                Some(ci)
            }
            Binding::Duplicate(bound) => Some(close_bound(bound)),
            Binding::Bound(bound, al) => {
                drop(al);
                let guid = bound.identity().ca_guid;
                let mut registry = CA_REGISTRY.lock();
                if let Some(registry) = registry.as_mut()
                    && registry
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
            ci.release();
        }
        if let Some(pci) = self.pci.lock().take() {
            pci.release();
        }
    }
}

/// Closes a bound CA (PASSIVE_LEVEL); returns its interface.
fn close_bound(bound: Arc<BoundCa<FfiCi>>) -> Arc<FfiCi> {
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

/// `EvtDevicePrepareHardware`: the CI interface queried and its version
/// checked.
unsafe extern "C" fn evt_prepare_hardware(
    device: WDFDEVICE,
    _resources_raw: WDFCMRESLIST,
    _resources_translated: WDFCMRESLIST,
) -> NTSTATUS {
    // SAFETY: the framework calls this on the live filter device.
    let Some(shell) = (unsafe { shell_of::<FilterShell>(device as WDFOBJECT) }) else {
        return NtStatus::INVALID_DEVICE_STATE.raw() as NTSTATUS;
    };
    // SAFETY: the live filter device, in prepare-hardware.
    match unsafe { FfiCi::query(device) } {
        Ok(ci) => {
            *shell.binding.lock() = Binding::Queried(Arc::new(ci));
            // SAFETY: the live filter device, in prepare-hardware.
            *shell.pci.lock() = unsafe { PciBus::query(device) };
            0
        }
        Err(status) => status.raw() as NTSTATUS,
    }
}

/// `EvtDeviceD0Entry`: the first one opens the CA; a resume does nothing.
unsafe extern "C" fn evt_d0_entry(device: WDFDEVICE, _from: WDF_POWER_DEVICE_STATE) -> NTSTATUS {
    // SAFETY: the framework calls this on the live filter device.
    let Some(shell) = (unsafe { shell_of::<FilterShell>(device as WDFOBJECT) }) else {
        return NtStatus::INVALID_DEVICE_STATE.raw() as NTSTATUS;
    };
    let ci = match &*shell.binding.lock() {
        Binding::Queried(ci) => ci.clone(),
        // Resume: the CA stayed open across sleep.
        _ => return 0,
    };
    shell.read_list();
    let events: Arc<dyn CaEvents> = shell.relay.clone();
    match OpenedCa::open(ci, events) {
        Ok(opened) => {
            *shell.binding.lock() = Binding::Opening(opened);
            0
        }
        Err(error) => error.nt_status().raw() as NTSTATUS,
    }
}

/// `EvtDeviceSelfManagedIoInit`: the port query.
unsafe extern "C" fn evt_self_managed_io_init(device: WDFDEVICE) -> NTSTATUS {
    // SAFETY: the framework calls this on the live filter device.
    if let Some(shell) = unsafe { shell_of::<FilterShell>(device as WDFOBJECT) } {
        shell.send_port_query();
    }
    0
}

/// `EvtDeviceReleaseHardware`.
unsafe extern "C" fn evt_release_hardware(
    device: WDFDEVICE,
    _resources_translated: WDFCMRESLIST,
) -> NTSTATUS {
    // SAFETY: the framework calls this on the live filter device.
    if let Some(shell) = unsafe { shell_of::<FilterShell>(device as WDFOBJECT) } {
        shell.release();
    }
    0
}

/// `EvtDeviceSurpriseRemoval` of the filter: the HCA is surprise-removed
/// (or failed), so the CA goes, whatever told the access layer before (a
/// child's surprise removal). PnP runs it after the children's.
unsafe extern "C" fn evt_surprise_removal(device: WDFDEVICE) {
    // SAFETY: the framework calls this on the live filter device.
    if let Some(shell) = unsafe { shell_of::<FilterShell>(device as WDFOBJECT) } {
        shell.ca_gone();
    }
}
