//! A root-enumerated kernel client of the access layer, the old way
//! (docs/ibal-bus.md "The root-enumerated client (the old way)"): the
//! situation of the seed thread on kernel clients and power
//! (`/work/shared/seeds/kernel-clients-power-and-pnp-children.txt`), kept
//! as a sample to show what the port children exist to avoid.
//!
//! The device is root-enumerated (`inf/ib-legacy-client.inf`, hardware ID
//! [`HARDWARE_ID`], service [`SERVICE`]): it is not in any HCA's PnP
//! subtree, so nothing orders its power IRPs against an HCA's.
//!
//! What it does (KMDF / WDM name in brackets):
//! - self-managed I/O init (after `IoRegisterPlugPlayNotification` for
//!   `GUID_IB_AL_DEVICE_INTERFACE` with
//!   `PNPNOTIFY_DEVICE_INTERFACE_INCLUDE_EXISTING_INTERFACES`): links to
//!   every HCA whose interface is enabled; later arrivals come through
//!   [`LegacyClientDriver::interface_events`], the notification callback.
//! - a link to one HCA: a remote I/O target opened on the HCA's interface
//!   (`WdfIoTargetOpen` by symbolic link), `GUID_IB_AL_INTERFACE` queried
//!   over that stack (`WdfIoTargetQueryForInterface`; the IBAL filter on
//!   top answers it), the AL opened with a reference on the driver object,
//!   `QueryCa` for its port's GID, the HCA's DMA adapter through the bus
//!   interface queried over the same stack, then a PD, a CQ, an RC QP and
//!   a registered common buffer. All at PASSIVE_LEVEL, each wait bounded.
//! - target-device-change notifications: query-remove lets go of the link
//!   (destroys its objects, closes the AL, gives the interface back,
//!   `WdfIoTargetCloseForQueryRemove`) unless told to refuse
//!   ([`LegacyClient::refuse_removal`], `STATUS_DEVICE_BUSY`); a cancelled
//!   removal reopens the target and builds the link again; remove-complete
//!   lets go (after a surprise removal) and closes the target.
//! - D0 exit (its own sleep): the shutdown exchange on every connection:
//!   if the peer already said goodbye the connection is closed; otherwise
//!   a goodbye SEND to the peer, waited for boundedly, then a `ModifyQp`
//!   to SQD (drain) as a request, waited for boundedly. If the HCA is
//!   already below D0, the post is refused and the request is held by the
//!   HCA's power-managed queue: the wait times out, the D0 exit returns
//!   (the sleep completes), and the held request completes after resume
//!   ([`ShutdownReport`]).
//! - release-hardware (its removal): lets go of every link and closes the
//!   targets.
//!
//! **The same client bound the new way**, for the side-by-side
//! comparison: [`LegacyClientDriver::register_as_port_client`] registers
//! the same code as the port children's function driver (`ibportclient`,
//! `inf/ib-port-client.inf`); each device then links to its own parent
//! (the AL and bus interfaces queried from its own stack, no target, no
//! interface notification), and is powered down before its HCA.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use driver_platform::{CommonBuffer, DmaAdapter, Event, RequestorMode};
use ib_types::access::AccessFlags;
use ib_types::ca::CaAttrView;
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::event::AsyncEventRecord;
use ib_types::interface::{
    AL_INTERFACE_VERSION, GUID_IB_AL_DEVICE_INTERFACE, GUID_IB_AL_INTERFACE, PortInterfaceData,
};
use ib_types::ioctl::{
    AllocPd, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyCq, DestroyQp, Empty, ModifyQp,
    QueryCa, RegPhysMr, Verb, decode_response, encode_request, request_len, response_len,
};
use ib_types::qp::{QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RecvWr, SendFlags, SendOp, SendWr, Sge};
use ibal_bus_core::al::ClientEvents;
use sim_host::context::{self, Context};
use sim_host::dma::{HostCommonBuffer, HostDmaAdapter};
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, SUCCESS};
use sim_host::event::HostEvent;
use sim_host::host::Host;
use sim_host::io_target::{IoTargetCallbacks, IoTargetName, IoTargetState, RemoteIoTarget};
use sim_host::pci::{
    BUS_INTERFACE_STANDARD_VERSION, BusInterfaceStandard, GUID_BUS_INTERFACE_STANDARD,
};
use sim_host::pnp::{DevNodeId, DeviceServices, InterfaceEvent};
use sim_host::request::{Completion, HostRequest, RequestHandle};
use sim_host::sched::SchedulerHandle;
use sim_host::verifier::Verifier;

use crate::ibal_bus::{AlClient, AlPortInterface, DriverObjectReference};
use crate::rc_path::{phys_mr_register, rc_qp_create, rc_to_rts_steps};

/// The service `inf/ib-legacy-client.inf` installs.
pub const SERVICE: &str = "iblegacyclient";
/// The port children's client service (`inf/ib-port-client.inf`).
pub const PORT_CLIENT_SERVICE: &str = "ibportclient";
/// The root-enumerated device's hardware ID.
pub const HARDWARE_ID: &str = "ROOT\\IBLEGACYCLIENT";

/// The bound on every wait (virtual time on the deterministic host): a
/// legacy client must not hold up a power transition or a removal.
pub const WAIT_BOUND_NS: u64 = 50_000_000;

/// The goodbye message of the shutdown exchange.
pub const GOODBYE: &[u8] = b"GOODBYE";

/// A link's buffer: sends from the first page, receives into the second.
const MEM_BYTES: usize = 8192;
const RECV_OFFSET: usize = 4096;
/// Room for the `QueryCa` attribute block.
const QUERY_CA_ROOM: u32 = 16 * 1024;
/// The `wr_id`s of the link's one send and one receive in flight.
const SEND_WR: u64 = 1;
const RECV_WR: u64 = 2;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The driver: its devices, and the count of references on its objects
/// the AL holds.
pub struct LegacyClientDriver {
    /// Root-enumerated (the old way) or a port child's function driver.
    as_port_client: bool,
    sched: SchedulerHandle,
    verifier: Verifier,
    references: OnceLock<Arc<AtomicUsize>>,
    devices: Mutex<Vec<Arc<LegacyClient>>>,
}

impl std::fmt::Debug for LegacyClientDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LegacyClientDriver").finish_non_exhaustive()
    }
}

impl LegacyClientDriver {
    /// Registers the driver on `host` under [`SERVICE`].
    pub fn register(host: &Host) -> Arc<Self> {
        Self::register_under(host, SERVICE, false)
    }

    /// Registers the same client as the port children's function driver
    /// ([`PORT_CLIENT_SERVICE`], replacing the stand-in): each device links
    /// to its own parent.
    pub fn register_as_port_client(host: &Host) -> Arc<Self> {
        Self::register_under(host, PORT_CLIENT_SERVICE, true)
    }

    fn register_under(host: &Host, service: &'static str, as_port_client: bool) -> Arc<Self> {
        let driver = Arc::new(Self {
            as_port_client,
            sched: host.scheduler_handle(),
            verifier: host.verifier().clone(),
            references: OnceLock::new(),
            devices: Mutex::default(),
        });
        host.register_driver(service, driver.clone());
        if let Some(references) = host.pnp().driver_references(service) {
            let _ = driver.references.set(references);
        }
        driver
    }

    /// Creates the root-enumerated device `ROOT\IBLEGACYCLIENT\<instance>`
    /// (what an installer's `SetupDiCreateDeviceInfo` +
    /// `SetupDiCallClassInstaller(DIF_REGISTERDEVICE)` does) and starts it.
    pub fn install(host: &Host, instance: u32) -> DevNodeId {
        host.pnp().add_device(
            None,
            &format!("{HARDWARE_ID}\\{instance:04}"),
            vec![HARDWARE_ID.to_owned()],
            Vec::new(),
            Arc::new(RootEnumeratedPdo),
        )
    }

    /// The devices added so far, in order.
    pub fn devices(&self) -> Vec<Arc<LegacyClient>> {
        lock(&self.devices).clone()
    }

    /// The PnP manager's device-interface notifications
    /// (`EventCategoryDeviceInterfaceChange` callback, PASSIVE_LEVEL on a
    /// system thread): an arrival of `GUID_IB_AL_DEVICE_INTERFACE` links
    /// every started device to that HCA. Removals need nothing here: the
    /// target-device-change notifications came first.
    pub fn interface_events(&self, events: &[InterfaceEvent]) {
        let _driver = context::enter(Context::driver(self.verifier.clone(), SERVICE));
        if self.as_port_client {
            return;
        }
        for event in events {
            if let InterfaceEvent::Arrival { class, device } = event
                && *class == GUID_IB_AL_DEVICE_INTERFACE
            {
                for client in self.devices() {
                    if client.started.load(Ordering::Acquire) {
                        client.link_to(*device);
                    }
                }
            }
        }
    }
}

impl DriverEntry for LegacyClientDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        let references = self
            .references
            .get()
            .cloned()
            .ok_or(NtStatus::INVALID_DEVICE_STATE)?;
        let device = Arc::new_cyclic(|me| LegacyClient {
            me: me.clone(),
            as_port_client: self.as_port_client,
            host: host.clone(),
            sched: self.sched.clone(),
            verifier: self.verifier.clone(),
            references,
            started: AtomicBool::new(false),
            refuse_removal: AtomicBool::new(false),
            links: Mutex::default(),
            reports: Mutex::default(),
        });
        lock(&self.devices).push(device.clone());
        Ok(device)
    }
}

/// The PDO the root enumerator gives a root-enumerated device (WDM: no
/// KMDF queue).
struct RootEnumeratedPdo;

impl DeviceCallbacks for RootEnumeratedPdo {
    fn power_managed_queue(&self) -> bool {
        false
    }
}

/// How the goodbye of a shutdown exchange went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Goodbye {
    /// The peer's HCA acknowledged it (an RC send completes after the
    /// responder's ACK): it reached the remote end.
    Acknowledged,
    /// The post was refused (the HCA below D0 answers `InvalidState`).
    Refused(IbStatus),
    /// The send completed in error.
    Failed(WcStatus),
    /// No completion within [`WAIT_BOUND_NS`].
    NoAnswer,
    /// The peer said goodbye first: the connection is already closed,
    /// nothing to send.
    AlreadyClosed,
}

/// What one D0 exit's shutdown exchange did on one connection.
#[derive(Debug, Clone)]
pub struct ShutdownReport {
    /// The HCA of the connection's first side.
    pub hca: DevNodeId,
    /// The goodbye.
    pub goodbye: Goodbye,
    /// The drain request (`ModifyQp` to SQD), unless the connection was
    /// already closed.
    pub drain: Option<RequestHandle>,
    /// Whether the drain completed within the bound (else it was held).
    pub drained_in_time: bool,
    /// Receives the exchange found completed in error before it began
    /// (an HCA that left D0 first flushed the connection's receive).
    pub receive_errors: Vec<WcStatus>,
}

impl ShutdownReport {
    /// The drain's result once it completed: the request's status and the
    /// verb's.
    pub fn drain_result(&self) -> Option<Result<(), IbStatus>> {
        self.drain
            .as_ref()?
            .completion()
            .map(|done| answer::<ModifyQp>(&done).map(|_| ()))
    }
}

/// One root-enumerated client device.
pub struct LegacyClient {
    me: Weak<LegacyClient>,
    as_port_client: bool,
    host: DeviceServices,
    sched: SchedulerHandle,
    verifier: Verifier,
    references: Arc<AtomicUsize>,
    started: AtomicBool,
    refuse_removal: AtomicBool,
    links: Mutex<Vec<Arc<HcaLink>>>,
    reports: Mutex<Vec<ShutdownReport>>,
}

impl std::fmt::Debug for LegacyClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LegacyClient")
            .field("host", &self.host)
            .finish_non_exhaustive()
    }
}

impl LegacyClient {
    /// The devnode of this device.
    pub fn node(&self) -> DevNodeId {
        self.host.node()
    }

    /// Makes the device refuse (`true`) or agree to (`false`) a
    /// query-remove of the HCAs it uses: a client that cannot let go.
    pub fn refuse_removal(&self, refuse: bool) {
        self.refuse_removal.store(refuse, Ordering::Release);
    }

    /// Its links, in arrival order.
    pub fn links(&self) -> Vec<Arc<HcaLink>> {
        lock(&self.links).clone()
    }

    /// Its link to the HCA `hca`, if any.
    pub fn link(&self, hca: DevNodeId) -> Option<Arc<HcaLink>> {
        self.links().into_iter().find(|l| l.hca == hca)
    }

    /// What its D0 exits' shutdown exchanges did, oldest first.
    pub fn shutdown_reports(&self) -> Vec<ShutdownReport> {
        lock(&self.reports).clone()
    }

    /// Links to `hca` (an arrival of its interface), unless linked.
    /// PASSIVE_LEVEL.
    fn link_to(&self, hca: DevNodeId) {
        if self.link(hca).is_some() {
            return;
        }
        let link = Arc::new(HcaLink {
            hca,
            client: self.me.clone(),
            own_stack: None,
            target: OnceLock::new(),
            session: Mutex::default(),
            events: Arc::default(),
            let_go: AtomicUsize::new(0),
            came_back: AtomicUsize::new(0),
        });
        let callbacks = Arc::new(LinkCallbacks(Arc::downgrade(&link)));
        let name = IoTargetName::Interface {
            class: GUID_IB_AL_DEVICE_INTERFACE,
            device: hca,
        };
        let Ok(target) = self.host.open_io_target(name, callbacks) else {
            return;
        };
        let _ = link.target.set(target.clone());
        if link.come_up(self).is_err() {
            target.close();
            return;
        }
        lock(&self.links).push(link);
    }

    /// A port child's one link: to its own parent, through its own stack.
    fn link_to_parent(&self) {
        let link = Arc::new(HcaLink {
            hca: self.node(),
            client: self.me.clone(),
            own_stack: Some(self.host.clone()),
            target: OnceLock::new(),
            session: Mutex::default(),
            events: Arc::default(),
            let_go: AtomicUsize::new(0),
            came_back: AtomicUsize::new(0),
        });
        if link.come_up(self).is_ok() {
            lock(&self.links).push(link);
        }
    }

    /// Issues a `QueryCa` on `link` without waiting (a client that keeps
    /// issuing requests, during sleep too). The request completes through
    /// the handle.
    pub fn issue_query_ca(&self, link: &HcaLink) -> Result<RequestHandle, IbStatus> {
        let guard = lock(&link.session);
        let session = guard.as_ref().ok_or(IbStatus::InvalidState)?;
        let (req, issuer) = request::<QueryCa>(
            &self.verifier,
            session.client.ca_handle(),
            &Empty,
            QUERY_CA_ROOM,
        )?;
        session.al.submit(session.client, req);
        Ok(issuer)
    }

    /// Waits for `event` at most [`WAIT_BOUND_NS`]
    /// (`KeWaitForSingleObject` with a timeout: a timer sets it).
    fn wait_bounded(&self, event: &HostEvent) {
        let timer = self.sched.new_timer();
        let expired = event.clone();
        self.sched.set_timer(
            timer,
            SERVICE,
            self.sched.now_ns().saturating_add(WAIT_BOUND_NS),
            move || expired.set(),
        );
        event.wait();
        self.sched.cancel_timer(timer);
    }

    /// Sends verb `V` on `session` (with room for `private_out` bytes of
    /// private output) and waits boundedly. Returns the request's handle
    /// and its completion, `None` if it is still pending (held).
    fn call<V: Verb>(
        &self,
        session: &Session,
        handle: u64,
        input: &V::In,
        private: &[u8],
        private_out: u32,
    ) -> Result<(RequestHandle, Option<Completion>), IbStatus> {
        let in_len = request_len::<V>(private.len()).ok_or(IbStatus::InvalidParameter)?;
        let out_len = response_len::<V>(private_out as usize).ok_or(IbStatus::InvalidParameter)?;
        let mut bytes = vec![0; in_len];
        encode_request::<V>(handle, input, private, private_out, &mut bytes)
            .map_err(|_| IbStatus::InvalidParameter)?;
        let (mut req, issuer) = HostRequest::new(
            &self.verifier,
            V::ID.ioctl().raw(),
            RequestorMode::Kernel,
            bytes,
            out_len,
        );
        let event = HostEvent::new(self.sched.clone());
        req.set_completion_event(event.clone());
        session.al.submit(session.client, req);
        self.wait_bounded(&event);
        let done = issuer.completion();
        Ok((issuer, done))
    }

    /// [`Self::call`] decoded: the created handle (or 0) and fixed output.
    fn verb<V: Verb>(
        &self,
        session: &Session,
        handle: u64,
        input: &V::In,
        private: &[u8],
    ) -> Result<(u64, Option<V::Out>), IbStatus> {
        match self.call::<V>(session, handle, input, private, 0)? {
            (_, Some(done)) => answer::<V>(&done),
            (_, None) => Err(IbStatus::Timeout),
        }
    }

    /// The shutdown exchange of every connection this device started
    /// (see the module doc).
    fn shutdown_exchange(&self) {
        for link in self.links() {
            if !link.events.connected.load(Ordering::Acquire) {
                continue;
            }
            let (messages, receive_errors) = link.received();
            if messages.iter().any(|m| m == GOODBYE) {
                link.events.connected.store(false, Ordering::Release);
                lock(&self.reports).push(ShutdownReport {
                    hca: link.hca,
                    goodbye: Goodbye::AlreadyClosed,
                    drain: None,
                    drained_in_time: true,
                    receive_errors,
                });
                continue;
            }
            let goodbye = link.send(self, GOODBYE);
            link.events.connected.store(false, Ordering::Release);
            let guard = lock(&link.session);
            let Some(session) = guard.as_ref() else {
                continue;
            };
            let Some((qp, _)) = session.qp else {
                continue;
            };
            let drain = QpModify {
                state: Some(QpState::Sqd),
                ..QpModify::default()
            };
            let Ok((drain, done)) = self.call::<ModifyQp>(session, qp, &drain, &[], 0) else {
                continue;
            };
            drop(guard);
            lock(&self.reports).push(ShutdownReport {
                hca: link.hca,
                goodbye,
                drain: Some(drain),
                drained_in_time: done.is_some(),
                receive_errors,
            });
        }
    }

    /// Lets go of every link and closes the targets.
    fn unlink_all(&self) {
        let links = std::mem::take(&mut *lock(&self.links));
        for link in links {
            link.let_go(self);
            if let Some(target) = link.target.get() {
                target.close();
            }
        }
    }
}

/// Connects `a` and `b` (links to two HCAs, of one device or of two) with
/// their RC QPs, a receive posted on each; either side may start the
/// shutdown exchange. PASSIVE_LEVEL.
pub fn connect(a: &HcaLink, b: &HcaLink) -> Result<(), IbStatus> {
    let (ca, cb) = (a.owner()?, b.owner()?);
    let (ga, qa) = a.address()?;
    let (gb, qb) = b.address()?;
    a.connect_to(&ca, gb, qb)?;
    b.connect_to(&cb, ga, qa)?;
    a.events.connected.store(true, Ordering::Release);
    b.events.connected.store(true, Ordering::Release);
    Ok(())
}

impl DeviceCallbacks for LegacyClient {
    /// Registers for interface arrival, existing interfaces included.
    fn self_managed_io_init(&self) {
        self.started.store(true, Ordering::Release);
        if self.as_port_client {
            return self.link_to_parent();
        }
        for hca in self.host.device_interfaces(GUID_IB_AL_DEVICE_INTERFACE) {
            self.link_to(hca);
        }
    }

    /// Its own sleep: the shutdown exchange, every wait bounded.
    fn d0_exit(&self, _to: driver_platform::DevicePowerState) -> NtStatus {
        self.shutdown_exchange();
        SUCCESS
    }

    fn release_hardware(&self) -> NtStatus {
        self.started.store(false, Ordering::Release);
        self.unlink_all();
        SUCCESS
    }
}

/// A link's AL session on one HCA and the objects it made.
struct Session {
    interface: sim_host::driver::InterfaceRef,
    al: Arc<AlPortInterface>,
    client: AlClient,
    port: PortInterfaceData,
    gid: Option<Gid>,
    dma: Option<(HostDmaAdapter, HostCommonBuffer)>,
    pd: Option<u64>,
    cq: Option<u64>,
    qp: Option<(u64, u32)>,
    mr: Option<(u64, u64, LKey)>,
}

/// What a link's AL callbacks saw, and the event a bounded wait for a
/// completion waits on.
#[derive(Default)]
struct LinkEvents {
    waiting: Mutex<Option<HostEvent>>,
    async_events: Mutex<Vec<AsyncEventRecord>>,
    /// Connected, and no goodbye exchanged yet.
    connected: AtomicBool,
}

impl ClientEvents for LinkEvents {
    fn completion(&self, _cq: u64) {
        if let Some(event) = lock(&self.waiting).as_ref() {
            event.set();
        }
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.async_events).push(*event);
    }
}

/// One device's link to one HCA: its remote I/O target and AL session.
pub struct HcaLink {
    /// The HCA (a port child's link: the child itself).
    hca: DevNodeId,
    client: Weak<LegacyClient>,
    /// A port child queries its own stack; a root-enumerated client the
    /// target's.
    own_stack: Option<DeviceServices>,
    target: OnceLock<RemoteIoTarget>,
    session: Mutex<Option<Session>>,
    events: Arc<LinkEvents>,
    let_go: AtomicUsize,
    came_back: AtomicUsize,
}

impl std::fmt::Debug for HcaLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HcaLink")
            .field("hca", &self.hca)
            .finish_non_exhaustive()
    }
}

impl HcaLink {
    /// The HCA's devnode.
    pub fn hca(&self) -> DevNodeId {
        self.hca
    }

    /// The target's state.
    pub fn target_state(&self) -> Option<IoTargetState> {
        self.target.get().map(RemoteIoTarget::state)
    }

    /// Whether the AL session is up (opened, objects made).
    pub fn is_up(&self) -> bool {
        lock(&self.session).is_some()
    }

    /// How many times it let go (query-remove, removal).
    pub fn let_go_count(&self) -> usize {
        self.let_go.load(Ordering::Acquire)
    }

    /// How many times it came back after a cancelled removal.
    pub fn came_back_count(&self) -> usize {
        self.came_back.load(Ordering::Acquire)
    }

    /// The async events its AL client got.
    pub fn async_events(&self) -> Vec<AsyncEventRecord> {
        lock(&self.events.async_events).clone()
    }

    /// The bus address of the link's buffer (a common buffer of its
    /// HCA's DMA adapter), while it has one.
    pub fn buffer_bus_address(&self) -> Option<u64> {
        lock(&self.session)
            .as_ref()
            .and_then(|s| s.dma.as_ref().map(|(_, buffer)| buffer.bus_address()))
    }

    /// The port data the AL interface gave.
    pub fn port(&self) -> Option<PortInterfaceData> {
        lock(&self.session).as_ref().map(|s| s.port)
    }

    /// The AL interface, its DMA adapter and objects (see the module
    /// doc); on a failure what was made is undone.
    fn come_up(&self, client: &LegacyClient) -> Result<(), IbStatus> {
        let interface = self
            .query_interface(&GUID_IB_AL_INTERFACE, AL_INTERFACE_VERSION.packed())
            .ok_or(IbStatus::NotFound)?;
        let Some(al) = interface.get::<Arc<AlPortInterface>>().cloned() else {
            interface.dereference();
            return Err(IbStatus::InvalidState);
        };
        let reference = Box::new(DriverObjectReference::new(client.references.clone()));
        let al_client = match al.open(reference, self.events.clone()) {
            Ok(c) => c,
            Err(status) => {
                interface.dereference();
                return Err(status);
            }
        };
        let port = al.port_data();
        *lock(&self.session) = Some(Session {
            interface,
            al,
            client: al_client,
            port,
            gid: None,
            dma: None,
            pd: None,
            cq: None,
            qp: None,
            mr: None,
        });
        let made = self.make_objects(client);
        if made.is_err() {
            self.let_go(client);
        }
        made
    }

    /// `IRP_MN_QUERY_INTERFACE` over the target's stack, or its own.
    fn query_interface(
        &self,
        guid: &ib_types::interface::WinGuid,
        version: u16,
    ) -> Option<sim_host::driver::InterfaceRef> {
        match (&self.own_stack, self.target.get()) {
            (Some(own), _) => own.query_interface(guid, version),
            (None, Some(target)) => target.query_interface(guid, version),
            (None, None) => None,
        }
    }

    fn owner(&self) -> Result<Arc<LegacyClient>, IbStatus> {
        self.client.upgrade().ok_or(IbStatus::InvalidState)
    }

    /// Sends `bytes` on its connection and waits (boundedly) for the
    /// send's completion. PASSIVE_LEVEL.
    pub fn send_bytes(&self, bytes: &[u8]) -> Goodbye {
        match self.owner() {
            Ok(client) => self.send(&client, bytes),
            Err(status) => Goodbye::Refused(status),
        }
    }

    fn make_objects(&self, client: &LegacyClient) -> Result<(), IbStatus> {
        let mut guard = lock(&self.session);
        let s = guard.as_mut().ok_or(IbStatus::InvalidState)?;
        let ca = s.client.ca_handle();
        // The port's GID, from the CA's attributes.
        let done = client
            .call::<QueryCa>(s, ca, &Empty, &[], QUERY_CA_ROOM)?
            .1
            .ok_or(IbStatus::Timeout)?;
        let len = usize::try_from(done.information).unwrap_or(usize::MAX);
        let response = done
            .output
            .get(..len)
            .and_then(|bytes| decode_response::<QueryCa>(bytes).ok())
            .ok_or(IbStatus::GenericError)?;
        let attrs = CaAttrView::parse(response.private).map_err(|_| IbStatus::GenericError)?;
        s.gid = attrs
            .ports()
            .find(|p| p.port_num() == s.port.port)
            .and_then(|p| p.gids().first().copied());
        s.gid.ok_or(IbStatus::GenericError)?;
        // The HCA's own DMA adapter, through the bus interface its PCI PDO
        // answers at the bottom of the stack the target is open on.
        let bus = self
            .query_interface(&GUID_BUS_INTERFACE_STANDARD, BUS_INTERFACE_STANDARD_VERSION)
            .ok_or(IbStatus::NotFound)?;
        let adapter = bus.call(|b: &BusInterfaceStandard| b.get_dma_adapter());
        bus.dereference();
        let adapter = adapter
            .ok_or(IbStatus::InvalidState)?
            .map_err(IbStatus::from_ntstatus)?;
        let buffer = adapter
            .alloc_common(MEM_BYTES)
            .map_err(IbStatus::from_ntstatus)?;
        let base = buffer.bus_address();
        s.dma = Some((adapter, buffer));
        s.pd = Some(client.verb::<AllocPd>(s, ca, &Empty, &[])?.0);
        let attr = CqAttr {
            cqe: 16,
            comp_vector: 0,
        };
        s.cq = Some(client.verb::<CreateCq>(s, ca, &attr, &[])?.0);
        let (pd, cq) = (s.pd.unwrap_or(0), s.cq.unwrap_or(0));
        let create = rc_qp_create(QpType::Rc, pd, cq, 4);
        let (qp, out) = client.verb::<CreateQp>(s, ca, &create, &[])?;
        s.qp = Some((qp, out.map_or(0, |o| o.qpn.get())));
        let (input, list) = phys_mr_register(base, MEM_BYTES);
        let (mr, out) = client.verb::<RegPhysMr>(s, pd, &input, &list)?;
        let out = out.ok_or(IbStatus::GenericError)?;
        s.mr = Some((mr, out.iova, out.keys.lkey));
        Ok(())
    }

    /// Destroys its objects, closes the AL and gives the interface back.
    /// Errors are not fatal: a removed HCA refuses everything and the
    /// AL's records go with it.
    fn let_go(&self, client: &LegacyClient) {
        let Some(mut s) = lock(&self.session).take() else {
            return;
        };
        if let Some((qp, _)) = s.qp.take() {
            let _ = client.verb::<DestroyQp>(&s, qp, &Empty, &[]);
            // Whatever the destroyed QP left on the CQ goes with it.
            let mut wcs = [WorkCompletion::EMPTY; 8];
            if let Some(cq) = s.cq {
                while matches!(s.al.poll_cq(s.client, cq, &mut wcs), Ok(n) if n > 0) {}
            }
        }
        if let Some((mr, _, _)) = s.mr.take() {
            let _ = client.verb::<DeregMr>(&s, mr, &Empty, &[]);
        }
        if let Some(cq) = s.cq.take() {
            let _ = client.verb::<DestroyCq>(&s, cq, &Empty, &[]);
        }
        if let Some(pd) = s.pd.take() {
            let _ = client.verb::<DeallocPd>(&s, pd, &Empty, &[]);
        }
        if let Some((adapter, buffer)) = s.dma.take() {
            adapter.free_common(buffer);
        }
        let drained = Arc::new(HostEvent::new(client.sched.clone()));
        let _ = s.al.close(s.client, drained);
        s.interface.dereference();
        self.events.connected.store(false, Ordering::Release);
        self.let_go.fetch_add(1, Ordering::AcqRel);
    }

    /// Its port's GID and its QP number.
    fn address(&self) -> Result<(Gid, u32), IbStatus> {
        let guard = lock(&self.session);
        let s = guard.as_ref().ok_or(IbStatus::InvalidState)?;
        let gid = s.gid.ok_or(IbStatus::InvalidState)?;
        let (_, qpn) = s.qp.ok_or(IbStatus::InvalidState)?;
        Ok((gid, qpn))
    }

    /// RESET -> INIT -> RTR -> RTS towards `gid`/`qpn`, a receive posted.
    fn connect_to(&self, client: &LegacyClient, gid: Gid, qpn: u32) -> Result<(), IbStatus> {
        let guard = lock(&self.session);
        let s = guard.as_ref().ok_or(IbStatus::InvalidState)?;
        let (qp, _) = s.qp.ok_or(IbStatus::InvalidState)?;
        let port = s.port.port;
        let dest = Qpn::new(qpn).map_err(|_| IbStatus::InvalidParameter)?;
        let steps = rc_to_rts_steps(port, AccessFlags::empty(), dest, gid, 1);
        for step in &steps {
            client.verb::<ModifyQp>(s, qp, step, &[])?;
        }
        self.post_receive(s)
    }

    fn post_receive(&self, s: &Session) -> Result<(), IbStatus> {
        let (qp, _) = s.qp.ok_or(IbStatus::InvalidState)?;
        let (_, start, lkey) = s.mr.ok_or(IbStatus::InvalidState)?;
        let sge = [Sge::new(start + RECV_OFFSET as u64, 4096, lkey)];
        let wr = [RecvWr {
            wr_id: RECV_WR,
            sg_list: &sge,
        }];
        match s.al.post_recv(s.client, qp, &wr) {
            (1, IbStatus::Success) => Ok(()),
            (_, status) => Err(status),
        }
    }

    /// Posts `bytes` as one signalled SEND and waits boundedly for its
    /// completion.
    fn send(&self, client: &LegacyClient, bytes: &[u8]) -> Goodbye {
        let guard = lock(&self.session);
        let Some(s) = guard.as_ref() else {
            return Goodbye::Refused(IbStatus::InvalidState);
        };
        let (Some((qp, _)), Some((_, start, lkey)), Some(cq), Some((_, buffer))) =
            (s.qp, s.mr, s.cq, s.dma.as_ref())
        else {
            return Goodbye::Refused(IbStatus::InvalidState);
        };
        if bytes.len() > RECV_OFFSET || !buffer.write(0, bytes) {
            return Goodbye::Refused(IbStatus::InvalidParameter);
        }
        let event = HostEvent::new(client.sched.clone());
        *lock(&self.events.waiting) = Some(event.clone());
        let outcome = (|| {
            if let Err(status) = s.al.arm_cq(s.client, cq, CqNotify::NextCompletion) {
                return Goodbye::Refused(status);
            }
            let sge = [Sge::new(start, bytes.len() as u32, lkey)];
            let wr = [SendWr {
                wr_id: SEND_WR,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: &sge,
                ud: None,
            }];
            match s.al.post_send(s.client, qp, &wr) {
                (1, IbStatus::Success) => {}
                (_, status) => return Goodbye::Refused(status),
            }
            client.wait_bounded(&event);
            let mut wcs = [WorkCompletion::EMPTY; 4];
            let n = s.al.poll_cq(s.client, cq, &mut wcs).unwrap_or(0);
            match wcs[..n].iter().find(|wc| wc.wr_id == SEND_WR) {
                Some(wc) if wc.status == WcStatus::Success => Goodbye::Acknowledged,
                Some(wc) => Goodbye::Failed(wc.status),
                None => Goodbye::NoAnswer,
            }
        })();
        *lock(&self.events.waiting) = None;
        outcome
    }

    /// The messages received since the last call (receive completions
    /// polled, the bytes read, a receive posted again), and the statuses
    /// of receives that completed in error. PASSIVE_LEVEL.
    pub fn received(&self) -> (Vec<Vec<u8>>, Vec<WcStatus>) {
        let guard = lock(&self.session);
        let Some(s) = guard.as_ref() else {
            return (Vec::new(), Vec::new());
        };
        let (Some(cq), Some((_, buffer))) = (s.cq, s.dma.as_ref()) else {
            return (Vec::new(), Vec::new());
        };
        let (mut got, mut errors) = (Vec::new(), Vec::new());
        let mut wcs = [WorkCompletion::EMPTY; 4];
        while let Ok(n) = s.al.poll_cq(s.client, cq, &mut wcs) {
            if n == 0 {
                break;
            }
            for wc in wcs[..n].iter().filter(|wc| wc.wr_id == RECV_WR) {
                if wc.status != WcStatus::Success {
                    errors.push(wc.status);
                    continue;
                }
                let mut bytes = vec![0; wc.byte_len as usize];
                if buffer.read(RECV_OFFSET, &mut bytes) {
                    got.push(bytes);
                }
                let _ = self.post_receive(s);
            }
        }
        (got, errors)
    }
}

/// A link's target-device-change callbacks.
struct LinkCallbacks(Weak<HcaLink>);

impl LinkCallbacks {
    fn parts(&self) -> Option<(Arc<HcaLink>, Arc<LegacyClient>)> {
        let link = self.0.upgrade()?;
        let client = link.client.upgrade()?;
        Some((link, client))
    }
}

impl IoTargetCallbacks for LinkCallbacks {
    /// Lets go, unless the device refuses.
    fn query_remove(&self, target: &RemoteIoTarget) -> NtStatus {
        if let Some((link, client)) = self.parts() {
            if client.refuse_removal.load(Ordering::Acquire) {
                return NtStatus::DEVICE_BUSY;
            }
            link.let_go(&client);
        }
        target.close_for_query_remove();
        SUCCESS
    }

    /// Comes back: reopens and builds the link again.
    fn remove_canceled(&self, target: &RemoteIoTarget) {
        if target.state() != IoTargetState::ClosedForQueryRemove || target.reopen().is_err() {
            return;
        }
        if let Some((link, client)) = self.parts()
            && !link.is_up()
            && link.come_up(&client).is_ok()
        {
            link.came_back.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The HCA is gone: lets go (after a surprise removal nothing was let
    /// go yet), closes the target and forgets the link.
    fn remove_complete(&self, target: &RemoteIoTarget) {
        if let Some((link, client)) = self.parts() {
            link.let_go(&client);
            lock(&client.links).retain(|l| !Arc::ptr_eq(l, &link));
        }
        target.close();
    }
}

/// A verb request in the `ib_types::ioctl` framing with room for
/// `private_out` bytes of private output.
fn request<V: Verb>(
    verifier: &Verifier,
    handle: u64,
    input: &V::In,
    private_out: u32,
) -> Result<(HostRequest, RequestHandle), IbStatus> {
    let in_len = request_len::<V>(0).ok_or(IbStatus::InvalidParameter)?;
    let out_len = response_len::<V>(private_out as usize).ok_or(IbStatus::InvalidParameter)?;
    let mut bytes = vec![0; in_len];
    encode_request::<V>(handle, input, &[], private_out, &mut bytes)
        .map_err(|_| IbStatus::InvalidParameter)?;
    Ok(HostRequest::new(
        verifier,
        V::ID.ioctl().raw(),
        RequestorMode::Kernel,
        bytes,
        out_len,
    ))
}

/// The created handle (or 0) and fixed output of a completed verb.
fn answer<V: Verb>(done: &Completion) -> Result<(u64, Option<V::Out>), IbStatus> {
    if !done.status.is_success() {
        return Err(IbStatus::from_ntstatus(done.status));
    }
    let response = decode_response::<V>(&done.output).map_err(|_| IbStatus::GenericError)?;
    if response.status != IbStatus::Success {
        return Err(response.status);
    }
    Ok((response.handle, response.output))
}
