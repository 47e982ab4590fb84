//! What the sim-shells scenario tests share: the machine (two HCAs with
//! two ports each, the real miniport and the real IBAL bus filter), its
//! settling and shutdown, and a kernel client driver bound to every port
//! child (`ibportclient`, `inf/ib-port-client.inf`) that gets the AL
//! interface from its PDO, opens the AL with a reference on its driver
//! object and closes it in its own release-hardware, with the helpers the
//! tests drive its verbs with (synchronous calls, DPC submits, IOCTLs to
//! its PDO, registered memory, RC sides connected over the fabric).

#![allow(dead_code, reason = "each test binary uses part of the support")]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use driver_platform::{CommonBuffer, DevicePowerState, DmaAdapter, Irql, RequestorMode};
use hca_miniport_core::init::HcaConfig;
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::event::AsyncEventRecord;
use ib_types::interface::{AL_INTERFACE_VERSION, GUID_IB_AL_INTERFACE, PortInterfaceData};
use ib_types::ioctl::{
    AllocPd, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyCq, DestroyQp, Empty, ModifyQp,
    QueryCa, RegPhysMr, Verb, decode_response, encode_request, request_len, response_len,
};
use ib_types::qp::QpType;
use ib_types::scalars::{Gid, PortNum, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RKey, RecvWr, SendFlags, SendOp, SendWr, Sge};
use ibal_bus_core::al::ClientEvents;
use sim_hca::device::DeviceConfig;
use sim_host::dma::{HostCommonBuffer, HostDmaAdapter};
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, InterfaceRef, SUCCESS};
use sim_host::event::HostEvent;
use sim_host::host::{Host, HostConfig};
use sim_host::pci::{
    BUS_INTERFACE_STANDARD_VERSION, BusInterfaceStandard, GUID_BUS_INTERFACE_STANDARD,
};
use sim_host::platform::SimPlatform;
use sim_host::pnp::{DevNodeId, DeviceServices, PnpState};
use sim_host::request::{Completion, HostRequest, RequestHandle};
use sim_host::sched::SchedulerHandle;
use sim_shells::hca_miniport::MiniportDriver;
use sim_shells::ibal_bus::{AlClient, AlPortInterface, DriverObjectReference, IbalBusDriver};
use sim_shells::rc_path::{phys_mr_register, rc_qp_create, rc_to_rts_steps};

/// Two HCAs, two ports each; port p of HCA i has the IPv4 address
/// 10.0.i.p.
pub(crate) const HCAS: [u64; 2] = [0x0002_C900_0000_1000, 0x0002_C900_0000_2000];

/// The port clients' service (`inf/ib-port-client.inf`).
pub(crate) const CLIENT: &str = "ibportclient";

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a client's callbacks saw: completion events (with the IRQL they
/// came at), async events, removals, and callbacks after its close.
#[derive(Default)]
pub(crate) struct Recorder {
    pub(crate) completions: Mutex<Vec<(u64, Irql)>>,
    pub(crate) events: Mutex<Vec<AsyncEventRecord>>,
    /// `ca_removed` calls.
    pub(crate) removals: AtomicUsize,
    /// The client closed its AL: a callback from now on touches what it
    /// freed.
    pub(crate) closed: AtomicBool,
    /// Callbacks that came after the close.
    pub(crate) late: AtomicUsize,
}

impl Recorder {
    pub(crate) fn check_open(&self) {
        if self.closed.load(Ordering::Acquire) {
            self.late.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl ClientEvents for Recorder {
    fn completion(&self, cq: u64) {
        self.check_open();
        lock(&self.completions).push((cq, sim_host::irql::current()));
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        self.check_open();
        lock(&self.events).push(*event);
    }
    fn ca_removed(&self) {
        self.check_open();
        self.removals.fetch_add(1, Ordering::AcqRel);
    }
}

/// The AL as one client holds it.
pub(crate) struct Opened {
    pub(crate) interface: InterfaceRef,
    pub(crate) al: Arc<AlPortInterface>,
    pub(crate) client: AlClient,
}

/// The client driver: one device per port child.
pub(crate) struct ClientDriver {
    pub(crate) sched: SchedulerHandle,
    /// The host's count of references on the driver's objects (its record
    /// exists once the driver is registered).
    pub(crate) references: OnceLock<Arc<AtomicUsize>>,
    /// Drop the AL interface without dereferencing it (a broken client).
    pub(crate) leak_interface: bool,
    pub(crate) devices: Mutex<Vec<Arc<PortClient>>>,
}

pub(crate) struct PortClient {
    pub(crate) host: DeviceServices,
    pub(crate) sched: SchedulerHandle,
    pub(crate) references: Arc<AtomicUsize>,
    pub(crate) leak_interface: bool,
    pub(crate) opened: Mutex<Option<Opened>>,
    pub(crate) recorder: Arc<Recorder>,
    /// An object the client will not let go of (a PD its upper edge still
    /// uses): while it holds one it vetoes query-remove.
    pub(crate) pinned: Mutex<Option<u64>>,
    /// What its close in release-hardware returned.
    pub(crate) closed: Mutex<Option<Result<(), IbStatus>>>,
    /// Its common buffers: what is left of them is freed in its
    /// release-hardware.
    pub(crate) dma: Mutex<Vec<Dma>>,
    /// The status of the `QueryCa` it sends in each of its D0 exits.
    pub(crate) d0_exit_queries: Mutex<Vec<NtStatus>>,
    /// The port data its interface gave.
    pub(crate) port: OnceLock<PortInterfaceData>,
}

impl DriverEntry for ClientDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        let device = Arc::new(PortClient {
            host: host.clone(),
            sched: self.sched.clone(),
            references: self.references.get().cloned().unwrap_or_default(),
            leak_interface: self.leak_interface,
            opened: Mutex::default(),
            recorder: Arc::default(),
            pinned: Mutex::default(),
            closed: Mutex::default(),
            d0_exit_queries: Mutex::default(),
            dma: Mutex::default(),
            port: OnceLock::new(),
        });
        lock(&self.devices).push(device.clone());
        Ok(device)
    }
}

impl DeviceCallbacks for PortClient {
    /// Gets the AL interface from its PDO and opens the AL.
    fn prepare_hardware(&self) -> NtStatus {
        let Some(interface) = self
            .host
            .query_interface(&GUID_IB_AL_INTERFACE, AL_INTERFACE_VERSION.packed())
        else {
            return NtStatus::NOT_SUPPORTED;
        };
        let Some(al) = interface.get::<Arc<AlPortInterface>>().cloned() else {
            interface.dereference();
            return NtStatus::INVALID_DEVICE_STATE;
        };
        let _ = self.port.set(al.port_data());
        let reference = Box::new(DriverObjectReference::new(self.references.clone()));
        match al.open(reference, self.recorder.clone()) {
            Ok(client) => {
                *lock(&self.opened) = Some(Opened {
                    interface,
                    al,
                    client,
                });
                SUCCESS
            }
            Err(status) => {
                interface.dereference();
                status.to_ntstatus()
            }
        }
    }

    /// Talks to its HCA on its way down (as a ULP tells its peer it
    /// leaves): a synchronous `QueryCa`, which completes only because the
    /// HCA is still in D0.
    fn d0_exit(&self, _to: DevicePowerState) -> NtStatus {
        let opened = lock(&self.opened)
            .as_ref()
            .map(|o| (o.al.clone(), o.client));
        if let Some((al, client)) = opened {
            let (mut req, issuer) = query_ca_request(&self.host, client.ca_handle());
            let event = HostEvent::new(self.sched.clone());
            req.set_completion_event(event.clone());
            let status = match al.submit_and_wait(client, req, &event) {
                Ok(_) => issuer.completion().map_or(NtStatus::PENDING, |c| c.status),
                Err(_) => NtStatus::INVALID_DEVICE_STATE,
            };
            lock(&self.d0_exit_queries).push(status);
        }
        SUCCESS
    }

    /// Cannot let go while it holds a pinned object.
    fn query_remove(&self) -> NtStatus {
        if lock(&self.pinned).is_some() {
            NtStatus::DEVICE_BUSY
        } else {
            SUCCESS
        }
    }

    /// Closes the AL (which destroys what it left open), frees its
    /// buffers and gives the interface back (or, leaking, drops it).
    fn release_hardware(&self) -> NtStatus {
        if let Some(opened) = lock(&self.opened).take() {
            let drained = Arc::new(HostEvent::new(self.sched.clone()));
            *lock(&self.closed) = Some(opened.al.close(opened.client, drained));
            self.recorder.closed.store(true, Ordering::Release);
            if self.leak_interface {
                drop(opened.interface);
            } else {
                opened.interface.dereference();
            }
        }
        for dma in lock(&self.dma).drain(..) {
            free_dma(&dma);
        }
        SUCCESS
    }
}

pub(crate) fn query_ca_request(host: &DeviceServices, ca: u64) -> (HostRequest, RequestHandle) {
    let room = 16 * 1024;
    let mut bytes = vec![0; request_len::<QueryCa>(0).unwrap()];
    encode_request::<QueryCa>(ca, &Empty, &[], room, &mut bytes).unwrap();
    HostRequest::new(
        &host.verifier().expect("a live device"),
        QueryCa::ID.ioctl().raw(),
        RequestorMode::Kernel,
        bytes,
        response_len::<QueryCa>(room as usize).unwrap(),
    )
}

pub(crate) struct World {
    pub(crate) host: Host,
    pub(crate) driver: Arc<IbalBusDriver>,
    pub(crate) miniport: Arc<MiniportDriver<SimPlatform>>,
    pub(crate) clients: Arc<ClientDriver>,
}

/// The HCAs of [`HCAS`], two ports each; port p of the i-th has the IPv4
/// address 10.0.i.p.
pub(crate) fn hca_configs() -> Vec<DeviceConfig> {
    hca_configs_of(&HCAS, 0)
}

/// HCAs with the GUIDs `guids`, two ports each; port p of the i-th has
/// the IPv4 address 10.`net`.i.p.
pub(crate) fn hca_configs_of(guids: &[u64], net: u8) -> Vec<DeviceConfig> {
    guids
        .iter()
        .enumerate()
        .map(|(i, guid)| {
            let i = i as u8;
            DeviceConfig::with_ports(*guid, &[[10, net, i, 1], [10, net, i, 2]])
        })
        .collect()
}

/// Registers the stand-ins (the port client among them), the real
/// miniport and the real filter.
pub(crate) fn register_stack(
    host: &Host,
) -> (Arc<IbalBusDriver>, Arc<MiniportDriver<SimPlatform>>) {
    let _log = sim_host::samples::register_stand_ins(host);
    let miniport = MiniportDriver::register(host, HcaConfig::default());
    (IbalBusDriver::register(host), miniport)
}

/// The machine of [`hca_configs`] booted with the stack and a port
/// client on every child (deterministic host).
pub(crate) fn world(seed: u64) -> World {
    world_on(HostConfig::deterministic(seed, hca_configs()))
}

pub(crate) fn world_on(config: HostConfig) -> World {
    world_with(config, false)
}

/// [`world_on`] with clients that leak their AL interface if
/// `leak_interface`.
pub(crate) fn world_with(config: HostConfig, leak_interface: bool) -> World {
    let host = Host::new(config).unwrap();
    let (driver, miniport, clients) = boot_with_clients(&host, leak_interface);
    World {
        host,
        driver,
        miniport,
        clients,
    }
}

/// The machine of [`world`] with the host shared, as a user process's
/// OS seam (`sim_shells::user_io::SimIo`) holds it: kernel clients on
/// every port child and user processes on the same HCAs.
pub(crate) struct SharedWorld {
    pub(crate) host: Arc<Host>,
    pub(crate) driver: Arc<IbalBusDriver>,
    pub(crate) miniport: Arc<MiniportDriver<SimPlatform>>,
    pub(crate) clients: Arc<ClientDriver>,
}

/// [`world`], the host shared.
pub(crate) fn shared_world(seed: u64) -> SharedWorld {
    shared_world_on(HostConfig::deterministic(seed, hca_configs()))
}

/// [`world_on`], the host shared.
pub(crate) fn shared_world_on(config: HostConfig) -> SharedWorld {
    let host = Arc::new(Host::new(config).unwrap());
    let (driver, miniport, clients) = boot_with_clients(&host, false);
    SharedWorld {
        host,
        driver,
        miniport,
        clients,
    }
}

/// Registers the stack and the port clients' driver (leaking their AL
/// interface if `leak_interface`), boots and settles; on a threaded host,
/// until every port child's client has opened its AL.
fn boot_with_clients(
    host: &Host,
    leak_interface: bool,
) -> (
    Arc<IbalBusDriver>,
    Arc<MiniportDriver<SimPlatform>>,
    Arc<ClientDriver>,
) {
    let (driver, miniport) = register_stack(host);
    let clients = Arc::new(ClientDriver {
        sched: host.scheduler_handle(),
        references: OnceLock::new(),
        leak_interface,
        devices: Mutex::default(),
    });
    host.register_driver(CLIENT, clients.clone());
    let references = host.pnp().driver_references(CLIENT).unwrap();
    assert!(clients.references.set(references).is_ok());
    host.boot();
    settle(host);
    // A threaded host starts the children's stacks on its workers, and a
    // loaded machine may need more than one settle for every client to
    // have opened its AL: wait for them (bounded) before a test looks.
    if host.scheduler().mode() == sim_host::sched::Mode::Threaded {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while lock(&clients.devices)
            .iter()
            .filter(|c| lock(&c.opened).is_some())
            .count()
            < 2 * HCAS.len()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the port clients open"
            );
            settle(host);
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    (driver, miniport, clients)
}

/// Runs what is queued (deterministic) or waits until it ran (threaded).
pub(crate) fn run_queued(host: &Host) {
    if host.scheduler().mode() == sim_host::sched::Mode::Threaded {
        host.scheduler().quiesce().unwrap();
    } else {
        host.scheduler().run_until_idle(1_000_000).unwrap();
    }
}

/// Runs everything, lets PnP act on the bus relations that changed, and
/// runs again (on the threaded host: three rounds of waiting and acting).
pub(crate) fn settle(host: &Host) {
    if host.scheduler().mode() == sim_host::sched::Mode::Threaded {
        for _ in 0..3 {
            host.scheduler().quiesce().unwrap();
            host.pnp().process_bus_relations();
        }
        return;
    }
    host.scheduler().run_until_idle(1_000_000).unwrap();
    host.pnp().process_bus_relations();
    host.scheduler().run_until_idle(1_000_000).unwrap();
}

/// The instance paths of the started devnodes under `hca`, sorted.
pub(crate) fn started_children(host: &Host, hca: DevNodeId) -> Vec<String> {
    let pnp = host.pnp();
    let mut paths: Vec<String> = pnp
        .children(hca)
        .into_iter()
        .filter(|c| pnp.state(*c) == Some(PnpState::Started))
        .filter_map(|c| pnp.instance_path(c))
        .collect();
    paths.sort();
    paths
}

/// Shuts the host down; the verifier's report must be empty.
pub(crate) fn finish(host: Host) {
    host.shut_down();
    host.verifier().assert_clean();
}

impl ClientDriver {
    /// The newest client on port `port` of HCA `hca` (0 or 1).
    pub(crate) fn client(&self, hca: usize, port: u8) -> Arc<PortClient> {
        let guid = HCAS[hca];
        lock(&self.devices)
            .iter()
            .rev()
            .find(|c| {
                c.port
                    .get()
                    .is_some_and(|d| d.ca_guid.get() == guid && d.port.get() == port)
            })
            .cloned()
            .expect("a client on that port")
    }
}

impl World {
    /// The newest client on port `port` of HCA `hca` (0 or 1).
    pub(crate) fn client(&self, hca: usize, port: u8) -> Arc<PortClient> {
        self.clients.client(hca, port)
    }

    pub(crate) fn references(&self) -> usize {
        self.host
            .pnp()
            .driver_references(CLIENT)
            .unwrap()
            .load(Ordering::Acquire)
    }

    /// The instance paths of the started devnodes under `hca`.
    pub(crate) fn started_children(&self, hca: DevNodeId) -> Vec<String> {
        started_children(&self.host, hca)
    }
}

impl PortClient {
    pub(crate) fn al(&self) -> (Arc<AlPortInterface>, AlClient) {
        let opened = lock(&self.opened);
        let opened = opened.as_ref().expect("the client opened the AL");
        (opened.al.clone(), opened.client)
    }
}

/// A verb request in the `ib_types::ioctl` framing, with no private output.
pub(crate) fn request<V: Verb>(
    verifier: &sim_host::verifier::Verifier,
    handle: u64,
    input: &V::In,
) -> (HostRequest, RequestHandle) {
    request_with::<V>(verifier, handle, input, &[])
}

/// [`request`] with a private input.
pub(crate) fn request_with<V: Verb>(
    verifier: &sim_host::verifier::Verifier,
    handle: u64,
    input: &V::In,
    private: &[u8],
) -> (HostRequest, RequestHandle) {
    let mut bytes = vec![0; request_len::<V>(private.len()).unwrap()];
    encode_request::<V>(handle, input, private, 0, &mut bytes).unwrap();
    HostRequest::new(
        verifier,
        V::ID.ioctl().raw(),
        RequestorMode::Kernel,
        bytes,
        response_len::<V>(0).unwrap(),
    )
}

/// The created handle (or 0) of a completed verb.
pub(crate) fn answer<V: Verb>(done: &Completion) -> Result<u64, IbStatus> {
    answer_out::<V>(done).map(|(handle, _)| handle)
}

/// The created handle (or 0) and fixed output of a completed verb.
pub(crate) fn answer_out<V: Verb>(done: &Completion) -> Result<(u64, Option<V::Out>), IbStatus> {
    if !done.status.is_success() {
        return Err(IbStatus::from_ntstatus(done.status));
    }
    let response = decode_response::<V>(&done.output).map_err(|_| IbStatus::GenericError)?;
    if response.status != IbStatus::Success {
        return Err(response.status);
    }
    if V::ID.creates().is_some() {
        assert_eq!(
            done.information, response.handle,
            "the handle in Information"
        );
    }
    Ok((response.handle, response.output))
}

/// Verb `V` through the client's AL interface, synchronously (this test
/// thread is at PASSIVE_LEVEL).
pub(crate) fn call<V: Verb>(
    host: &Host,
    client: &PortClient,
    handle: u64,
    input: &V::In,
) -> Result<u64, IbStatus> {
    call_out::<V>(host, client, handle, input, &[]).map(|(handle, _)| handle)
}

/// [`call`] with a private input, returning the fixed output too.
pub(crate) fn call_out<V: Verb>(
    host: &Host,
    client: &PortClient,
    handle: u64,
    input: &V::In,
    private: &[u8],
) -> Result<(u64, Option<V::Out>), IbStatus> {
    let (al, id) = client.al();
    let (mut req, issuer) = request_with::<V>(host.verifier(), handle, input, private);
    let event = HostEvent::new(host.scheduler_handle());
    req.set_completion_event(event.clone());
    al.submit_and_wait(id, req, &event)
        .map_err(|_| IbStatus::InvalidState)?;
    answer_out::<V>(&issuer.completion().expect("completed"))
}

/// Submits verb `V` through the client's AL interface from a DPC of the
/// client driver (DISPATCH_LEVEL, a completion to come); returns the
/// issuer's handle and what `submit` returned.
pub(crate) fn submit_in_dpc<V: Verb>(
    host: &Host,
    client: &PortClient,
    handle: u64,
    input: V::In,
) -> (RequestHandle, NtStatus)
where
    V::In: Send + 'static,
{
    let (al, id) = client.al();
    let verifier = host.verifier().clone();
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    host.scheduler_handle().queue_dpc(CLIENT, move || {
        let (req, issuer) = request::<V>(&verifier, handle, &input);
        let status = al.submit(id, req);
        *lock(&sink) = Some((issuer, status));
    });
    run_queued(host);
    let taken = lock(&out).take();
    taken.expect("the DPC ran")
}

/// Sends verb `V` to the client's child (the IOCTL path); returns the
/// issuer's handle.
pub(crate) fn send_ioctl<V: Verb>(
    host: &Host,
    client: &PortClient,
    handle: u64,
    input: &V::In,
) -> RequestHandle {
    let (req, issuer) = request::<V>(host.verifier(), handle, input);
    host.pnp().send_request(client.host.node(), req);
    issuer
}

pub(crate) const CQ_ATTR: CqAttr = CqAttr {
    cqe: 16,
    comp_vector: 0,
};

/// A common buffer of the adapter the client got from its child (the
/// HCA's own), registered physically through the AL.
pub(crate) struct Memory {
    /// The buffer and its adapter, shared with the client, which frees
    /// what is left of it in its release-hardware (before its HCA takes
    /// the adapter back).
    pub(crate) dma: Dma,
    pub(crate) mr: u64,
    pub(crate) start: u64,
    pub(crate) lkey: LKey,
    /// Zero unless registered with remote access ([`register_with`]).
    pub(crate) rkey: RKey,
}

/// A client's common buffer with its adapter, until freed.
pub(crate) type Dma = Arc<Mutex<Option<(HostDmaAdapter, HostCommonBuffer)>>>;

impl Memory {
    pub(crate) fn write(&self, offset: usize, bytes: &[u8]) -> bool {
        lock(&self.dma)
            .as_ref()
            .is_some_and(|(_, buffer)| buffer.write(offset, bytes))
    }

    pub(crate) fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        lock(&self.dma)
            .as_ref()
            .is_some_and(|(_, buffer)| buffer.read(offset, out))
    }
}

/// Frees a client's common buffer if it is still allocated.
pub(crate) fn free_dma(dma: &Dma) {
    if let Some((adapter, buffer)) = lock(dma).take() {
        adapter.free_common(buffer);
    }
}

pub(crate) const MEM_BYTES: usize = 8192;

pub(crate) fn register(host: &Host, client: &PortClient, pd: u64) -> Memory {
    register_with(host, client, pd, AccessFlags::LOCAL_WRITE)
}

/// [`register`] granting `access`.
pub(crate) fn register_with(
    host: &Host,
    client: &PortClient,
    pd: u64,
    access: AccessFlags,
) -> Memory {
    let bus = host
        .pnp()
        .query_interface(
            client.host.node(),
            &GUID_BUS_INTERFACE_STANDARD,
            BUS_INTERFACE_STANDARD_VERSION,
        )
        .expect("the bus interface");
    let adapter = bus
        .call(|b: &BusInterfaceStandard| b.get_dma_adapter())
        .unwrap()
        .unwrap();
    bus.dereference();
    let buffer = adapter.alloc_common(MEM_BYTES).unwrap();
    let base = buffer.bus_address();
    let (mut input, list) = phys_mr_register(base, MEM_BYTES);
    input.access = access;
    let (mr, out) = call_out::<RegPhysMr>(host, client, pd, &input, &list).unwrap();
    let out = out.unwrap();
    let dma: Dma = Arc::new(Mutex::new(Some((adapter, buffer))));
    lock(&client.dma).push(dma.clone());
    Memory {
        dma,
        mr,
        start: out.iova,
        lkey: out.keys.lkey,
        rkey: out.keys.rkey,
    }
}

/// One client's RC side: PD, CQ, QP (its number) and memory.
pub(crate) struct RcSide {
    pub(crate) pd: u64,
    pub(crate) cq: u64,
    pub(crate) qp: u64,
    pub(crate) qpn: u32,
    pub(crate) memory: Memory,
}

pub(crate) fn rc_side(host: &Host, client: &PortClient) -> RcSide {
    let (_, id) = client.al();
    let pd = call::<AllocPd>(host, client, id.ca_handle(), &Empty).unwrap();
    let cq = call::<CreateCq>(host, client, id.ca_handle(), &CQ_ATTR).unwrap();
    let (qp, qpn) = create_qp(host, client, pd, cq);
    rc_side_of(host, client, (pd, cq, qp, qpn))
}

/// The RC side of the client's `(pd, cq, qp, qpn)`, with memory
/// registered on its PD.
pub(crate) fn rc_side_of(
    host: &Host,
    client: &PortClient,
    (pd, cq, qp, qpn): (u64, u64, u64, u32),
) -> RcSide {
    let memory = register(host, client, pd);
    RcSide {
        pd,
        cq,
        qp,
        qpn,
        memory,
    }
}

/// An RC QP on `pd` and `cq`: its handle and number.
pub(crate) fn create_qp(host: &Host, client: &PortClient, pd: u64, cq: u64) -> (u64, u32) {
    let (_, id) = client.al();
    let create = rc_qp_create(QpType::Rc, pd, cq, 8);
    let (qp, out) = call_out::<CreateQp>(host, client, id.ca_handle(), &create, &[]).unwrap();
    (qp, out.unwrap().qpn.get())
}

/// RESET -> INIT -> RTR -> RTS towards `dest` on the port 10.0.`dest_hca`.1.
pub(crate) fn connect(host: &Host, client: &PortClient, qp: u64, dest: u32, dest_hca: u8) {
    connect_ports(host, client, qp, 1, dest, (dest_hca, 1));
}

/// RESET -> INIT -> RTR -> RTS from the client's `port` towards `dest` on
/// the port 10.0.`hca`.`port` given by `(hca, port)`.
pub(crate) fn connect_ports(
    host: &Host,
    client: &PortClient,
    qp: u64,
    port: u8,
    dest: u32,
    (dest_hca, dest_port): (u8, u8),
) {
    let steps = rc_to_rts_steps(
        PortNum::new(port).unwrap(),
        AccessFlags::empty(),
        Qpn::new(dest).unwrap(),
        Gid::from_ipv4([10, 0, dest_hca, dest_port]),
        1,
    );
    for step in &steps {
        call::<ModifyQp>(host, client, qp, step).unwrap();
    }
}

/// Runs `f` in a DPC of the client driver; returns its result.
pub(crate) fn in_dpc<T: Send + 'static>(host: &Host, f: impl FnOnce() -> T + Send + 'static) -> T {
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    host.scheduler_handle()
        .queue_dpc(CLIENT, move || *lock(&sink) = Some(f()));
    run_queued(host);
    let taken = lock(&out).take();
    taken.expect("the DPC ran")
}

pub(crate) fn leak(sges: Vec<Sge>) -> &'static [Sge] {
    Box::leak(sges.into_boxed_slice())
}

pub(crate) fn poll(host: &Host, client: &PortClient, cq: u64) -> Vec<WorkCompletion> {
    let (al, id) = client.al();
    in_dpc(host, move || {
        let mut all = Vec::new();
        let mut wcs = [WorkCompletion::EMPTY; 8];
        loop {
            match al.poll_cq(id, cq, &mut wcs) {
                Ok(0) => break all,
                Ok(n) => all.extend_from_slice(&wcs[..n]),
                Err(status) => panic!("poll: {status:?}"),
            }
        }
    })
}

/// `x` sends `len` bytes of a pattern (seeded by `seed`) from the start of
/// its memory into the second page of `y`'s; returns the posting results
/// (receive, send), to be settled and checked with [`check_transfer`].
pub(crate) fn start_transfer(
    host: &Host,
    (x, sx): (&PortClient, &RcSide),
    (y, sy): (&PortClient, &RcSide),
    len: u32,
    seed: u8,
) -> ((usize, IbStatus), (usize, IbStatus)) {
    let payload = pattern(len, seed);
    assert!(sx.memory.write(0, &payload));
    let (yal, yid) = y.al();
    let recv_sge = leak(vec![Sge::new(sy.memory.start + 4096, 4096, sy.memory.lkey)]);
    let yqp = sy.qp;
    let received = in_dpc(host, move || {
        yal.post_recv(
            yid,
            yqp,
            &[RecvWr {
                wr_id: u64::from(seed),
                sg_list: recv_sge,
            }],
        )
    });
    let (xal, xid) = x.al();
    let send_sge = leak(vec![Sge::new(sx.memory.start, len, sx.memory.lkey)]);
    let xqp = sx.qp;
    let sent = in_dpc(host, move || {
        xal.post_send(
            xid,
            xqp,
            &[SendWr {
                wr_id: u64::from(seed),
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: send_sge,
                ud: None,
            }],
        )
    });
    (received, sent)
}

pub(crate) fn pattern(len: u32, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + u32::from(seed)) as u8).collect()
}

/// The transfer started by [`start_transfer`] arrived, byte for byte.
pub(crate) fn check_transfer(
    host: &Host,
    (x, sx): (&PortClient, &RcSide),
    (y, sy): (&PortClient, &RcSide),
    len: u32,
    seed: u8,
) {
    let sent = poll(host, x, sx.cq);
    let got = poll(host, y, sy.cq);
    assert!(
        sent.len() == 1 && sent[0].status == WcStatus::Success,
        "sent: {sent:?}"
    );
    assert!(
        got.len() == 1 && got[0].status == WcStatus::Success && got[0].byte_len == len,
        "got: {got:?}"
    );
    let mut seen = vec![0; len as usize];
    assert!(sy.memory.read(4096, &mut seen));
    assert_eq!(seen, pattern(len, seed), "the bytes arrived");
}

pub(crate) fn destroy(host: &Host, client: &PortClient, side: RcSide) {
    call::<DestroyQp>(host, client, side.qp, &Empty).unwrap();
    poll(host, client, side.cq);
    call::<DeregMr>(host, client, side.memory.mr, &Empty).unwrap();
    call::<DestroyCq>(host, client, side.cq, &Empty).unwrap();
    call::<DeallocPd>(host, client, side.pd, &Empty).unwrap();
    free_dma(&side.memory.dma);
}
