//! Scenario: power and removal across the IBAL bus filter's port children
//! and their kernel clients (`sim_shells::ibal_bus`, docs/ibal-bus.md
//! "Power and removal"), over the real miniport on two HCAs with two ports
//! each. A client driver bound to every child (`ibportclient`) gets the AL
//! interface from its PDO, opens the AL, and closes it in its own
//! release-hardware. The tests sleep (S3, S4) while clients keep issuing
//! requests, query-remove an HCA whose client cannot let go, and remove and
//! re-plug an HCA. Every test ends with the host shut down and the
//! verifier report empty.
#![cfg(not(windows))]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use driver_platform::{
    CommonBuffer, DevicePowerState, DmaAdapter, RegValue, RequestorMode, SystemPowerState,
};
use hca_miniport_core::cmd::DEFAULT_COMMAND_TIMEOUT_NS;
use hca_miniport_core::init::HcaConfig;
use hca_prm::regs::FatalSyndrome;
use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::interface::{AL_INTERFACE_VERSION, GUID_IB_AL_INTERFACE, PortInterfaceData};
use ib_types::ioctl::{
    AllocPd, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyCq, DestroyQp, Empty, ModifyQp,
    QueryCa, QueryQp, RegPhysMr, Verb, decode_response, encode_request, request_len, response_len,
};
use ib_types::mr::PhysMrRegister;
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, Mtu, PortNum, Psn, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RecvWr, SendFlags, SendOp, SendWr, Sge};
use ibal_bus_core::al::ClientEvents;
use sim_hca::device::DeviceConfig;
use sim_host::dma::{HostCommonBuffer, HostDmaAdapter};
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, InterfaceRef, SUCCESS};
use sim_host::event::HostEvent;
use sim_host::host::{Host, HostConfig};
use sim_host::pci::{
    BUS_INTERFACE_STANDARD_VERSION, BusInterfaceStandard, GUID_BUS_INTERFACE_STANDARD,
};
use sim_host::pnp::{DevNodeId, DeviceServices, PnpState};
use sim_host::power::CriticalSleep;
use sim_host::registry::service_parameters_key;
use sim_host::request::{Completion, HostRequest, RequestHandle};
use sim_host::sched::SchedulerHandle;
use sim_shells::hca_miniport::MiniportDriver;
use sim_shells::ibal_bus::{
    AlClient, AlPortInterface, DriverObjectReference, IbalBusDriver, SERVICE,
};

/// Two HCAs, two ports each; port p of HCA i has the IPv4 address
/// 10.0.i.p.
const HCAS: [u64; 2] = [0x0002_C900_0000_1000, 0x0002_C900_0000_2000];

/// The port clients' service (`inf/ib-port-client.inf`).
const CLIENT: &str = "ibportclient";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a client's callbacks saw.
#[derive(Default)]
struct Recorder {
    completions: Mutex<Vec<u64>>,
    events: Mutex<Vec<AsyncEventRecord>>,
    /// `ca_removed` calls.
    removals: AtomicUsize,
    /// The client closed its AL: a callback from now on touches what it
    /// freed.
    closed: AtomicBool,
    /// Callbacks that came after the close.
    late: AtomicUsize,
}

impl Recorder {
    fn check_open(&self) {
        if self.closed.load(Ordering::Acquire) {
            self.late.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl ClientEvents for Recorder {
    fn completion(&self, cq: u64) {
        self.check_open();
        lock(&self.completions).push(cq);
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
struct Opened {
    interface: InterfaceRef,
    al: Arc<AlPortInterface>,
    client: AlClient,
}

/// The client driver: one device per port child.
struct ClientDriver {
    sched: SchedulerHandle,
    references: OnceLock<Arc<AtomicUsize>>,
    devices: Mutex<Vec<Arc<PortClient>>>,
}

struct PortClient {
    host: DeviceServices,
    sched: SchedulerHandle,
    references: Arc<AtomicUsize>,
    opened: Mutex<Option<Opened>>,
    recorder: Arc<Recorder>,
    /// An object the client will not let go of (a PD its upper edge still
    /// uses): while it holds one it vetoes query-remove.
    pinned: Mutex<Option<u64>>,
    /// What its close in release-hardware returned.
    closed: Mutex<Option<Result<(), IbStatus>>>,
    /// Its common buffers: what is left of them is freed in its
    /// release-hardware.
    dma: Mutex<Vec<Dma>>,
    /// The status of the `QueryCa` it sends in each of its D0 exits.
    d0_exit_queries: Mutex<Vec<NtStatus>>,
    port: OnceLock<PortInterfaceData>,
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
    /// buffers and gives the interface back.
    fn release_hardware(&self) -> NtStatus {
        if let Some(opened) = lock(&self.opened).take() {
            let drained = Arc::new(HostEvent::new(self.sched.clone()));
            *lock(&self.closed) = Some(opened.al.close(opened.client, drained));
            self.recorder.closed.store(true, Ordering::Release);
            opened.interface.dereference();
        }
        for dma in lock(&self.dma).drain(..) {
            free_dma(&dma);
        }
        SUCCESS
    }
}

fn query_ca_request(host: &DeviceServices, ca: u64) -> (HostRequest, RequestHandle) {
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

struct World {
    host: Host,
    driver: Arc<IbalBusDriver>,
    clients: Arc<ClientDriver>,
}

fn hca_configs() -> Vec<DeviceConfig> {
    HCAS.iter()
        .enumerate()
        .map(|(i, guid)| {
            let i = i as u8;
            DeviceConfig::with_ports(*guid, &[[10, 0, i, 1], [10, 0, i, 2]])
        })
        .collect()
}

fn world(seed: u64) -> World {
    world_on(HostConfig::deterministic(seed, hca_configs()))
}

fn world_on(config: HostConfig) -> World {
    let host = Host::new(config).unwrap();
    let _log = sim_host::samples::register_stand_ins(&host);
    MiniportDriver::register(&host, HcaConfig::default());
    let driver = IbalBusDriver::register(&host);
    let clients = Arc::new(ClientDriver {
        sched: host.scheduler_handle(),
        references: OnceLock::new(),
        devices: Mutex::default(),
    });
    host.register_driver(CLIENT, clients.clone());
    let references = host.pnp().driver_references(CLIENT).unwrap();
    assert!(clients.references.set(references).is_ok());
    host.boot();
    settle(&host);
    World {
        host,
        driver,
        clients,
    }
}

/// Runs what is queued (deterministic) or waits until it ran (threaded).
fn run_queued(host: &Host) {
    if host.scheduler().mode() == sim_host::sched::Mode::Threaded {
        host.scheduler().quiesce().unwrap();
    } else {
        host.scheduler().run_until_idle(1_000_000).unwrap();
    }
}

fn settle(host: &Host) {
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

fn finish(host: Host) {
    host.shut_down();
    host.verifier().assert_clean();
}

impl World {
    /// The newest client on port `port` of HCA `hca` (0 or 1).
    fn client(&self, hca: usize, port: u8) -> Arc<PortClient> {
        let guid = HCAS[hca];
        lock(&self.clients.devices)
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

    fn references(&self) -> usize {
        self.host
            .pnp()
            .driver_references(CLIENT)
            .unwrap()
            .load(Ordering::Acquire)
    }

    /// The instance paths of the started devnodes under `hca`.
    fn started_children(&self, hca: DevNodeId) -> Vec<String> {
        let pnp = self.host.pnp();
        let mut paths: Vec<String> = pnp
            .children(hca)
            .into_iter()
            .filter(|c| pnp.state(*c) == Some(PnpState::Started))
            .filter_map(|c| pnp.instance_path(c))
            .collect();
        paths.sort();
        paths
    }
}

impl PortClient {
    fn al(&self) -> (Arc<AlPortInterface>, AlClient) {
        let opened = lock(&self.opened);
        let opened = opened.as_ref().expect("the client opened the AL");
        (opened.al.clone(), opened.client)
    }
}

/// A verb request in the `ib_types::ioctl` framing, with no private output.
fn request<V: Verb>(
    verifier: &sim_host::verifier::Verifier,
    handle: u64,
    input: &V::In,
) -> (HostRequest, RequestHandle) {
    request_with::<V>(verifier, handle, input, &[])
}

/// [`request`] with a private input.
fn request_with<V: Verb>(
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
fn answer<V: Verb>(done: &Completion) -> Result<u64, IbStatus> {
    answer_out::<V>(done).map(|(handle, _)| handle)
}

/// The created handle (or 0) and fixed output of a completed verb.
fn answer_out<V: Verb>(done: &Completion) -> Result<(u64, Option<V::Out>), IbStatus> {
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
fn call<V: Verb>(
    host: &Host,
    client: &PortClient,
    handle: u64,
    input: &V::In,
) -> Result<u64, IbStatus> {
    call_out::<V>(host, client, handle, input, &[]).map(|(handle, _)| handle)
}

/// [`call`] with a private input, returning the fixed output too.
fn call_out<V: Verb>(
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
fn submit_in_dpc<V: Verb>(
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
fn send_ioctl<V: Verb>(
    host: &Host,
    client: &PortClient,
    handle: u64,
    input: &V::In,
) -> RequestHandle {
    let (req, issuer) = request::<V>(host.verifier(), handle, input);
    host.pnp().send_request(client.host.node(), req);
    issuer
}

const CQ_ATTR: CqAttr = CqAttr {
    cqe: 16,
    comp_vector: 0,
};

/// While the system sleeps in `state`, a client keeps issuing requests on
/// both paths (direct submits from DPCs, IOCTLs to its PDO) and direct
/// calls; none completes before resume, every one completes after it, and
/// the objects they created work.
fn requests_during_sleep_complete_after_resume(state: SystemPowerState, critical: bool, seed: u64) {
    let w = world(seed);
    let hca = w.host.hcas()[0];
    let x = w.client(0, 1);
    let (al, id) = x.al();
    let ca = id.ca_handle();
    // A CQ from before the sleep, for the direct calls during it.
    let cq = call::<CreateCq>(&w.host, &x, ca, &CQ_ATTR).unwrap();
    // Requests in flight when the sleep begins: the child goes down only
    // once they are done, while its HCA still works.
    let in_flight = [
        send_ioctl::<AllocPd>(&w.host, &x, ca, &Empty),
        send_ioctl::<CreateCq>(&w.host, &x, ca, &CQ_ATTR),
    ];
    if critical {
        let overridden = w
            .host
            .pnp()
            .set_system_power_critical(state, CriticalSleep::Unqueried);
        assert!(overridden.is_empty());
    } else {
        w.host.pnp().set_system_power(state).unwrap();
    }
    let before_sleep = (
        answer::<AllocPd>(&in_flight[0].completion().expect("done before the sleep")).unwrap(),
        answer::<CreateCq>(&in_flight[1].completion().expect("done before the sleep")).unwrap(),
    );
    settle(&w.host);
    assert_ne!(w.host.pnp().power(hca), Some(DevicePowerState::D0));
    assert_ne!(
        w.host.pnp().power(x.host.node()),
        Some(DevicePowerState::D0)
    );
    // The client went down before its HCA: its exchange on the way down
    // was answered.
    assert_eq!(*lock(&x.d0_exit_queries), [NtStatus::SUCCESS]);

    let mut direct = Vec::new();
    let mut ioctls = Vec::new();
    for _ in 0..3 {
        let (issuer, status) = submit_in_dpc::<AllocPd>(&w.host, &x, ca, Empty);
        assert_eq!(status, NtStatus::PENDING, "held, not refused");
        direct.push(issuer);
        let (issuer, status) = submit_in_dpc::<CreateCq>(&w.host, &x, ca, CQ_ATTR);
        assert_eq!(status, NtStatus::PENDING);
        direct.push(issuer);
        ioctls.push(send_ioctl::<AllocPd>(&w.host, &x, ca, &Empty));
        ioctls.push(send_ioctl::<CreateCq>(&w.host, &x, ca, &CQ_ATTR));
        settle(&w.host);
    }
    // Direct calls cannot be held: arming answers at once with a clear
    // status, polling works on the CQ's host memory.
    assert_eq!(
        al.arm_cq(id, cq, CqNotify::NextCompletion),
        Err(IbStatus::InvalidState)
    );
    let mut wcs = [WorkCompletion::EMPTY; 4];
    assert_eq!(al.poll_cq(id, cq, &mut wcs), Ok(0));
    for issuer in direct.iter().chain(&ioctls) {
        assert!(issuer.completion().is_none(), "held while the HCA sleeps");
    }

    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(&w.host);
    assert_eq!(w.host.pnp().power(hca), Some(DevicePowerState::D0));
    let mut pds = vec![before_sleep.0];
    let mut cqs = vec![cq, before_sleep.1];
    for (i, issuer) in direct.iter().chain(&ioctls).enumerate() {
        let done = issuer.completion().expect("completed after resume");
        if i % 2 == 0 {
            pds.push(answer::<AllocPd>(&done).unwrap());
        } else {
            cqs.push(answer::<CreateCq>(&done).unwrap());
        }
    }
    // The created objects are the client's and work.
    for &cq in &cqs {
        assert!(id.id().owns(cq));
        al.arm_cq(id, cq, CqNotify::NextCompletion).unwrap();
        call::<DestroyCq>(&w.host, &x, cq, &Empty).unwrap();
    }
    for &pd in &pds {
        call::<DeallocPd>(&w.host, &x, pd, &Empty).unwrap();
    }
    finish(w.host);
}

#[test]
fn requests_issued_during_s3_complete_after_resume() {
    requests_during_sleep_complete_after_resume(SystemPowerState::S3, false, 41);
}

#[test]
fn requests_issued_during_s4_complete_after_resume() {
    requests_during_sleep_complete_after_resume(SystemPowerState::S4, false, 42);
}

#[test]
fn requests_issued_during_an_unqueried_critical_sleep_complete_after_resume() {
    requests_during_sleep_complete_after_resume(SystemPowerState::S3, true, 46);
}

/// Query-remove of an HCA asks its children first; a client that cannot
/// let go vetoes, the veto reaches the caller and nothing changes; once it
/// lets go, the removal goes through.
#[test]
fn a_client_that_cannot_let_go_vetoes_the_hcas_query_remove() {
    let w = world(43);
    let hca = w.host.hcas()[0];
    let children_before = w.started_children(hca);
    assert_eq!(children_before.len(), 2);
    let x = w.client(0, 2);
    let (_, id) = x.al();
    let pd = call::<AllocPd>(&w.host, &x, id.ca_handle(), &Empty).unwrap();
    *lock(&x.pinned) = Some(pd);

    let veto = w.host.pnp().query_and_remove(hca).unwrap_err();
    assert_eq!(veto.what, "query-remove");
    assert_eq!(veto.service, CLIENT);
    assert_eq!(veto.status, NtStatus::DEVICE_BUSY);
    assert_eq!(
        Some(veto.instance_path.as_str()),
        w.host.pnp().instance_path(x.host.node()).as_deref(),
        "the veto names the client's child"
    );
    settle(&w.host);
    // Nothing changed: the HCA, its children and their clients are as
    // they were, and the pinned PD is still the client's.
    assert_eq!(w.host.pnp().state(hca), Some(PnpState::Started));
    assert_eq!(w.started_children(hca), children_before);
    assert_eq!(w.driver.registered_cas().len(), 2);
    assert_eq!(w.references(), 4);
    for port in [1, 2] {
        let c = w.client(0, port);
        assert!(lock(&c.closed).is_none());
        let (_, cid) = c.al();
        let pd = call::<AllocPd>(&w.host, &c, cid.ca_handle(), &Empty).unwrap();
        call::<DeallocPd>(&w.host, &c, pd, &Empty).unwrap();
    }

    // The client lets go: the removal succeeds, children first.
    call::<DeallocPd>(&w.host, &x, pd, &Empty).unwrap();
    *lock(&x.pinned) = None;
    w.host.pnp().query_and_remove(hca).unwrap();
    settle(&w.host);
    assert_eq!(w.host.pnp().state(hca), Some(PnpState::Removed));
    assert_eq!(w.driver.registered_cas().len(), 1);
    assert_eq!(w.references(), 2, "the other HCA's clients hold theirs");
    assert_eq!(*lock(&x.closed), Some(Ok(())));
    assert_eq!(*lock(&x.d0_exit_queries), [NtStatus::SUCCESS]);
    finish(w.host);
}

/// An HCA removed in order and plugged in again: its children come back
/// with the same instance paths and instance IDs, their clients open the
/// AL again and work, and the other HCA's clients never noticed.
#[test]
fn an_hca_removed_and_plugged_in_again_gets_its_children_back_the_same() {
    let w = world(44);
    let hca = w.host.hcas()[0];
    let hca_path = w.host.pnp().instance_path(hca).unwrap();
    let paths_before = w.started_children(hca);
    let ids_before: Vec<String> = w
        .driver
        .devices()
        .iter()
        .flat_map(|d| d.children())
        .filter(|c| c.ca_guid.get() == HCAS[0])
        .map(|c| c.instance_id().to_owned())
        .collect();
    assert_eq!((paths_before.len(), ids_before.len()), (2, 2));
    let other = w.client(1, 1);

    w.host.pnp().query_and_remove(hca).unwrap();
    settle(&w.host);
    assert_eq!(w.driver.registered_cas().len(), 1);
    assert_eq!(w.references(), 2);
    w.host.replug_hca(0).unwrap();
    settle(&w.host);

    let again = w.host.hcas()[0];
    assert_ne!(again, hca);
    assert_eq!(w.host.pnp().instance_path(again), Some(hca_path));
    assert_eq!(w.started_children(again), paths_before);
    let ids_after: Vec<String> = w
        .driver
        .devices()
        .iter()
        .filter(|d| d.bound().is_some())
        .flat_map(|d| d.children())
        .filter(|c| c.ca_guid.get() == HCAS[0])
        .map(|c| c.instance_id().to_owned())
        .collect();
    assert_eq!(ids_after, ids_before);
    assert_eq!(w.driver.registered_cas().len(), 2);
    assert_eq!(w.references(), 4, "the new clients opened the AL");
    // The new clients work; so does the other HCA's, which stayed.
    for client in [w.client(0, 1), w.client(0, 2), other.clone()] {
        let (_, id) = client.al();
        let pd = call::<AllocPd>(&w.host, &client, id.ca_handle(), &Empty).unwrap();
        call::<DeallocPd>(&w.host, &client, pd, &Empty).unwrap();
    }
    assert!(Arc::ptr_eq(&w.client(1, 1), &other), "never re-created");
    finish(w.host);
}

/// A common buffer of the adapter the client got from its child (the
/// HCA's own), registered physically through the AL.
struct Memory {
    /// The buffer and its adapter, shared with the client, which frees
    /// what is left of it in its release-hardware (before its HCA takes
    /// the adapter back).
    dma: Dma,
    mr: u64,
    start: u64,
    lkey: LKey,
}

/// A client's common buffer with its adapter, until freed.
type Dma = Arc<Mutex<Option<(HostDmaAdapter, HostCommonBuffer)>>>;

impl Memory {
    fn write(&self, offset: usize, bytes: &[u8]) -> bool {
        lock(&self.dma)
            .as_ref()
            .is_some_and(|(_, buffer)| buffer.write(offset, bytes))
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        lock(&self.dma)
            .as_ref()
            .is_some_and(|(_, buffer)| buffer.read(offset, out))
    }
}

/// Frees a client's common buffer if it is still allocated.
fn free_dma(dma: &Dma) {
    if let Some((adapter, buffer)) = lock(dma).take() {
        adapter.free_common(buffer);
    }
}

const MEM_BYTES: usize = 8192;

fn register(host: &Host, client: &PortClient, pd: u64) -> Memory {
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
    let pages = MEM_BYTES / 4096;
    let input = PhysMrRegister {
        iova: base,
        length: MEM_BYTES as u64,
        first_byte_offset: 0,
        page_shift: 12,
        num_pages: pages as u32,
        access: AccessFlags::LOCAL_WRITE,
    };
    let list: Vec<u8> = (0..pages as u64)
        .flat_map(|i| (base + i * 4096).to_le_bytes())
        .collect();
    let (mr, out) = call_out::<RegPhysMr>(host, client, pd, &input, &list).unwrap();
    let out = out.unwrap();
    let dma: Dma = Arc::new(Mutex::new(Some((adapter, buffer))));
    lock(&client.dma).push(dma.clone());
    Memory {
        dma,
        mr,
        start: out.iova,
        lkey: out.keys.lkey,
    }
}

/// One client's RC side: PD, CQ, QP (its number) and memory.
struct RcSide {
    pd: u64,
    cq: u64,
    qp: u64,
    qpn: u32,
    memory: Memory,
}

fn rc_side(host: &Host, client: &PortClient) -> RcSide {
    let (_, id) = client.al();
    let pd = call::<AllocPd>(host, client, id.ca_handle(), &Empty).unwrap();
    let cq = call::<CreateCq>(host, client, id.ca_handle(), &CQ_ATTR).unwrap();
    let (qp, qpn) = create_qp(host, client, pd, cq);
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
fn create_qp(host: &Host, client: &PortClient, pd: u64, cq: u64) -> (u64, u32) {
    let (_, id) = client.al();
    let create = QpCreate {
        qp_type: QpType::Rc,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(cq),
        recv_cq: CqHandle::from_raw(cq),
        srq: None,
        caps: QpCaps {
            max_send_wr: 8,
            max_recv_wr: 8,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        port: None,
    };
    let (qp, out) = call_out::<CreateQp>(host, client, id.ca_handle(), &create, &[]).unwrap();
    (qp, out.unwrap().qpn.get())
}

/// RESET -> INIT -> RTR -> RTS towards `dest` on the port 10.0.`dest_hca`.1.
fn connect(host: &Host, client: &PortClient, qp: u64, dest: u32, dest_hca: u8) {
    connect_ports(host, client, qp, 1, dest, (dest_hca, 1));
}

/// RESET -> INIT -> RTR -> RTS from the client's `port` towards `dest` on
/// the port 10.0.`hca`.`port` given by `(hca, port)`.
fn connect_ports(
    host: &Host,
    client: &PortClient,
    qp: u64,
    port: u8,
    dest: u32,
    (dest_hca, dest_port): (u8, u8),
) {
    let port1 = PortNum::new(port).unwrap();
    let steps = [
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(port1),
            access: Some(AccessFlags::empty()),
            ..QpModify::default()
        },
        QpModify {
            state: Some(QpState::Rtr),
            av: Some(AvAttr {
                port: port1,
                sl: 0,
                dlid: Lid::default(),
                path_bits: 0,
                static_rate: 0,
                grh: Some(Grh {
                    dgid: Gid::from_ipv4([10, 0, dest_hca, dest_port]),
                    flow_label: 0,
                    hop_limit: 64,
                    traffic_class: 0,
                    sgid_index: 0,
                }),
            }),
            path_mtu: Some(Mtu::Mtu1024),
            dest_qpn: Some(Qpn::new(dest).unwrap()),
            rq_psn: Some(Psn::new(100).unwrap()),
            max_dest_rd_atomic: Some(1),
            min_rnr_timer: Some(12),
            ..QpModify::default()
        },
        QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(100).unwrap()),
            timeout: Some(14),
            retry_cnt: Some(7),
            rnr_retry: Some(7),
            max_rd_atomic: Some(1),
            ..QpModify::default()
        },
    ];
    for step in &steps {
        call::<ModifyQp>(host, client, qp, step).unwrap();
    }
}

/// Runs `f` in a DPC of the client driver; returns its result.
fn in_dpc<T: Send + 'static>(host: &Host, f: impl FnOnce() -> T + Send + 'static) -> T {
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    host.scheduler_handle()
        .queue_dpc(CLIENT, move || *lock(&sink) = Some(f()));
    run_queued(host);
    let taken = lock(&out).take();
    taken.expect("the DPC ran")
}

fn leak(sges: Vec<Sge>) -> &'static [Sge] {
    Box::leak(sges.into_boxed_slice())
}

fn poll(host: &Host, client: &PortClient, cq: u64) -> Vec<WorkCompletion> {
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
fn start_transfer(
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

fn pattern(len: u32, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + u32::from(seed)) as u8).collect()
}

/// The transfer started by [`start_transfer`] arrived, byte for byte.
fn check_transfer(
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

fn destroy(host: &Host, client: &PortClient, side: RcSide) {
    call::<DestroyQp>(host, client, side.qp, &Empty).unwrap();
    poll(host, client, side.cq);
    call::<DeregMr>(host, client, side.memory.mr, &Empty).unwrap();
    call::<DestroyCq>(host, client, side.cq, &Empty).unwrap();
    call::<DeallocPd>(host, client, side.pd, &Empty).unwrap();
    free_dma(&side.memory.dma);
}

/// A connected RC QP cannot survive a sleep (the miniport brings it back
/// in ERR, docs/miniport.md "Power"): posting to it during the sleep is
/// refused with a clear status, a query held during the sleep answers
/// ERR after resume, its owner alone is told (`QpFatal` with its own
/// handle); reconnected, it carries checked traffic again.
#[test]
fn a_connected_qp_that_cannot_survive_sleep_ends_with_a_clear_status() {
    let w = world(45);
    let (x, y) = (w.client(0, 1), w.client(1, 1));
    let (sx, sy) = (rc_side(&w.host, &x), rc_side(&w.host, &y));
    connect(&w.host, &x, sx.qp, sy.qpn, 1);
    connect(&w.host, &y, sy.qp, sx.qpn, 0);
    let posted = start_transfer(&w.host, (&x, &sx), (&y, &sy), 3000, 7);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    settle(&w.host);
    check_transfer(&w.host, (&x, &sx), (&y, &sy), 3000, 7);

    w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
    settle(&w.host);
    // Posting is a direct call: refused at once while the HCA sleeps,
    // nothing posted.
    let (xal, xid) = x.al();
    let send_sge = leak(vec![Sge::new(sx.memory.start, 16, sx.memory.lkey)]);
    let xqp = sx.qp;
    let refused = in_dpc(&w.host, move || {
        xal.post_send(
            xid,
            xqp,
            &[SendWr {
                wr_id: 99,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: send_sge,
                ud: None,
            }],
        )
    });
    assert_eq!(refused, (0, IbStatus::InvalidState));
    // A query on each path, held until after resume.
    let (direct, _) = submit_in_dpc::<QueryQp>(&w.host, &x, sx.qp, Empty);
    let ioctl = send_ioctl::<QueryQp>(&w.host, &x, sx.qp, &Empty);
    settle(&w.host);
    assert!(direct.completion().is_none() && ioctl.completion().is_none());

    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(&w.host);
    for issuer in [&direct, &ioctl] {
        let (_, out) = answer_out::<QueryQp>(&issuer.completion().unwrap()).unwrap();
        assert_eq!(out.unwrap().state, QpState::Err, "it could not survive");
    }
    let fatal = |client: &PortClient| -> Vec<u64> {
        lock(&client.recorder.events)
            .iter()
            .filter(|e| e.code == AsyncEventCode::QpFatal)
            .map(|e| e.handle)
            .collect()
    };
    assert_eq!(fatal(&x), [sx.qp], "told with its own handle");
    assert_eq!(fatal(&y), [sy.qp]);
    assert!(fatal(&w.client(0, 2)).is_empty() && fatal(&w.client(1, 2)).is_empty());

    // The rest survived: new QPs on the same PDs, CQs and memory carry
    // traffic again (the old QPNs are in timewait, so not those).
    let mut sx = sx;
    let mut sy = sy;
    for (client, side) in [(&x, &mut sx), (&y, &mut sy)] {
        call::<DestroyQp>(&w.host, client, side.qp, &Empty).unwrap();
        poll(&w.host, client, side.cq);
        (side.qp, side.qpn) = create_qp(&w.host, client, side.pd, side.cq);
    }
    connect(&w.host, &x, sx.qp, sy.qpn, 1);
    connect(&w.host, &y, sy.qp, sx.qpn, 0);
    let posted = start_transfer(&w.host, (&x, &sx), (&y, &sy), 2000, 9);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    settle(&w.host);
    check_transfer(&w.host, (&x, &sx), (&y, &sy), 2000, 9);
    destroy(&w.host, &x, sx);
    destroy(&w.host, &y, sy);
    finish(w.host);
}

/// On the threaded host, a client thread keeps issuing requests on both
/// paths (direct submits, and IOCTLs through its own device to its PDO)
/// while the system goes to S3 and S4 and back: every request completes,
/// successfully, after resume at the latest; nothing hangs.
#[test]
fn a_client_issuing_without_pause_through_s3_and_s4_on_the_threaded_host_gets_every_completion() {
    let w = world_on(HostConfig::threaded(2, hca_configs()));
    settle(&w.host);
    let x = w.client(0, 1);
    let (al, id) = x.al();
    let ca = id.ca_handle();
    let verifier = w.host.verifier().clone();
    let stop = Arc::new(AtomicBool::new(false));
    let issuing = {
        let (stop, services) = (stop.clone(), x.host.clone());
        std::thread::spawn(move || {
            let mut issued = Vec::new();
            while !stop.load(Ordering::Acquire) {
                let (req, issuer) = request::<AllocPd>(&verifier, ca, &Empty);
                if issued.len() % 2 == 0 {
                    al.submit(id, req);
                } else {
                    services.send_to_own_device(req);
                }
                issued.push(issuer);
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            issued
        })
    };
    for state in [SystemPowerState::S3, SystemPowerState::S4] {
        std::thread::sleep(std::time::Duration::from_millis(5));
        w.host.pnp().set_system_power(state).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(5));
    stop.store(true, Ordering::Release);
    let issued = issuing.join().unwrap();
    settle(&w.host);
    assert!(issued.len() > 10, "the client kept issuing");
    for issuer in &issued {
        let done = issuer.completion().expect("every request completed");
        let pd = answer::<AllocPd>(&done).unwrap();
        call::<DeallocPd>(&w.host, &x, pd, &Empty).unwrap();
    }
    assert_eq!(lock(&x.d0_exit_queries).len(), 2, "one exchange per sleep");
    assert!(
        lock(&x.d0_exit_queries)
            .iter()
            .all(|s| *s == NtStatus::SUCCESS)
    );
    finish(w.host);
}

/// Surprise removal of one HCA while its clients have objects, requests
/// in flight and posted work, and the other HCA's clients move traffic:
/// the removed HCA's requests all complete (none hangs, none succeeds
/// after the hardware went), its clients' AL closes reclaim everything,
/// and the other HCA keeps moving checked traffic.
#[test]
fn surprise_removal_of_one_hca_under_load_leaves_the_other_working() {
    surprise_removal_under_load(HostConfig::deterministic(47, hca_configs()));
}

#[test]
fn surprise_removal_under_load_on_the_threaded_host() {
    surprise_removal_under_load(HostConfig::threaded(2, hca_configs()));
}

fn surprise_removal_under_load(config: HostConfig) {
    let w = world_on(config);
    settle(&w.host);
    let hca0 = w.host.hcas()[0];
    let (a, b) = (w.client(0, 1), w.client(0, 2));
    let (y, z) = (w.client(1, 1), w.client(1, 2));
    // A pair on each HCA, port 1 to port 2.
    let (sa, sb) = (rc_side(&w.host, &a), rc_side(&w.host, &b));
    let (sy, sz) = (rc_side(&w.host, &y), rc_side(&w.host, &z));
    connect_ports(&w.host, &a, sa.qp, 1, sb.qpn, (0, 2));
    connect_ports(&w.host, &b, sb.qp, 2, sa.qpn, (0, 1));
    connect_ports(&w.host, &y, sy.qp, 1, sz.qpn, (1, 2));
    connect_ports(&w.host, &z, sz.qp, 2, sy.qpn, (1, 1));
    for (pair, seed) in [
        (((&*a, &sa), (&*b, &sb)), 3u8),
        (((&*y, &sy), (&*z, &sz)), 4),
    ] {
        let posted = start_transfer(&w.host, pair.0, pair.1, 1500, seed);
        assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
        settle(&w.host);
        check_transfer(&w.host, pair.0, pair.1, 1500, seed);
    }

    // Load on both HCAs: transfers posted, requests in flight on both
    // paths of the HCA that goes.
    let posted = start_transfer(&w.host, (&a, &sa), (&b, &sb), 1000, 5);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    let posted = start_transfer(&w.host, (&y, &sy), (&z, &sz), 1000, 6);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    let (_, aid) = a.al();
    let in_flight = [
        send_ioctl::<AllocPd>(&w.host, &a, aid.ca_handle(), &Empty),
        send_ioctl::<QueryQp>(&w.host, &a, sa.qp, &Empty),
        send_ioctl::<CreateCq>(&w.host, &b, b.al().1.ca_handle(), &CQ_ATTR),
    ];
    let started_ns = w.host.scheduler_handle().now_ns();
    w.host.pnp().surprise_remove(hca0);
    // Nothing of the removal waited for the gone device to time out (the
    // miniport's command timeout, 2 s of platform time).
    let took_ns = w.host.scheduler_handle().now_ns() - started_ns;
    assert!(
        took_ns < DEFAULT_COMMAND_TIMEOUT_NS / 2,
        "the removal took {took_ns} ns"
    );
    settle(&w.host);

    // Every request of the removed HCA completed (none hangs); one the
    // device did not answer before it went ends with the removal's
    // status.
    let statuses: Vec<NtStatus> = in_flight
        .iter()
        .map(|issuer| issuer.completion().expect("completed, not stuck").status)
        .collect();
    assert!(
        statuses
            .iter()
            .all(|s| s.is_success() || *s == NtStatus::DEVICE_REMOVED),
        "{statuses:?}"
    );
    if w.host.scheduler().mode() == sim_host::sched::Mode::Deterministic {
        // The stepped device answers a command only when its task runs:
        // the CreateCq's was outstanding when the device went.
        assert!(statuses.contains(&NtStatus::DEVICE_REMOVED), "{statuses:?}");
    }
    for client in [&a, &b] {
        // Told once, before its own removal went on: the exchange in its
        // D0 exit ended at once with the removal's status.
        assert_eq!(client.recorder.removals.load(Ordering::Acquire), 1);
        assert_eq!(*lock(&client.d0_exit_queries), [NtStatus::DEVICE_REMOVED]);
        // Its close destroyed what it left (nothing sent to the gone CA)
        // and no callback came after it.
        assert_eq!(*lock(&client.closed), Some(Ok(())));
        assert_eq!(client.recorder.late.load(Ordering::Acquire), 0);
    }
    assert_eq!(w.host.pnp().state(hca0), Some(PnpState::Removed));
    assert_eq!(w.driver.registered_cas().len(), 1);
    assert_eq!(w.references(), 2, "the removed HCA's clients let go");

    // The other HCA kept working: its transfer arrived, and more do.
    check_transfer(&w.host, (&y, &sy), (&z, &sz), 1000, 6);
    let posted = start_transfer(&w.host, (&y, &sy), (&z, &sz), 2500, 8);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    settle(&w.host);
    check_transfer(&w.host, (&y, &sy), (&z, &sz), 2500, 8);
    destroy(&w.host, &y, sy);
    destroy(&w.host, &z, sz);
    drop((sa, sb));

    // Plugged in again, the HCA's new clients move checked traffic.
    w.host.replug_hca(0).unwrap();
    settle(&w.host);
    assert_eq!(w.references(), 4);
    let (a, b) = (w.client(0, 1), w.client(0, 2));
    let (sa, sb) = (rc_side(&w.host, &a), rc_side(&w.host, &b));
    connect_ports(&w.host, &a, sa.qp, 1, sb.qpn, (0, 2));
    connect_ports(&w.host, &b, sb.qp, 2, sa.qpn, (0, 1));
    let posted = start_transfer(&w.host, (&a, &sa), (&b, &sb), 1200, 10);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    settle(&w.host);
    check_transfer(&w.host, (&a, &sa), (&b, &sb), 1200, 10);
    destroy(&w.host, &a, sa);
    destroy(&w.host, &b, sb);
    finish(w.host);
}

/// A child that goes alone (its list entry removed at runtime: the bus
/// reports it missing and PnP surprise-removes it) does not take its HCA's
/// CA with it: its client, which holds an object, closes cleanly; the
/// HCA's other clients are told of no removal and keep working.
#[test]
fn a_child_removed_alone_leaves_its_hcas_ca_and_other_clients_alone() {
    let w = world(48);
    let params = service_parameters_key(SERVICE);
    let entry = format!("{params}\\IPoIB-8001");
    let registry = w.host.registry();
    registry.create_key(&entry).unwrap();
    registry
        .set_value(&entry, "DeviceId", RegValue::String("IBA\\IPOIB".into()))
        .unwrap();
    registry
        .set_value(
            &entry,
            "HardwareId",
            RegValue::MultiString(vec!["IBA\\IPOIB".into()]),
        )
        .unwrap();
    registry
        .set_value(&entry, "PartitionKey", RegValue::Dword(0x8001))
        .unwrap();
    let set_list = |names: &[&str]| {
        registry
            .set_value(
                &params,
                "StaticChild",
                RegValue::MultiString(names.iter().map(|s| s.to_string()).collect()),
            )
            .unwrap();
        w.driver.registry_changed();
        settle(&w.host);
    };
    set_list(&["IPoIB", "IPoIB-8001"]);
    assert_eq!(w.references(), 8, "a client per port and partition");
    let on_partition = |pkey: u16| -> Vec<Arc<PortClient>> {
        lock(&w.clients.devices)
            .iter()
            .filter(|c| c.port.get().is_some_and(|d| d.pkey.get() == pkey))
            .cloned()
            .collect()
    };
    let going = on_partition(0x8001);
    let staying = on_partition(0xFFFF);
    assert_eq!((going.len(), staying.len()), (4, 4));
    // The going clients hold a PD each.
    for client in &going {
        let (_, id) = client.al();
        call::<AllocPd>(&w.host, client, id.ca_handle(), &Empty).unwrap();
    }

    set_list(&["IPoIB"]);
    assert_eq!(w.references(), 4);
    for client in &going {
        assert_eq!(*lock(&client.closed), Some(Ok(())));
        assert_eq!(client.recorder.removals.load(Ordering::Acquire), 0);
        assert_eq!(*lock(&client.d0_exit_queries), [NtStatus::SUCCESS]);
    }
    assert_eq!(w.driver.registered_cas().len(), 2);
    for client in &staying {
        assert_eq!(client.recorder.removals.load(Ordering::Acquire), 0);
        let (_, id) = client.al();
        let pd = call::<AllocPd>(&w.host, client, id.ca_handle(), &Empty).unwrap();
        call::<DeallocPd>(&w.host, client, pd, &Empty).unwrap();
    }
    finish(w.host);
}

/// A catastrophic error (the device failed; its function is still on the
/// bus) leaves the CA unusable for new work, but the failed miniport still
/// hands every outstanding WR back as `WR_FLUSH_ERR` and frees what its
/// clients destroy (docs/miniport.md "Catastrophic error"). The filter
/// routes `LocalCatastrophic` to the clients and lets them drain: polls
/// return each posted receive exactly once, flushed, and the destroys
/// reach the CA; PnP then takes the failed stack down, the clients close
/// cleanly, and the restarted HCA gets new clients that work. (The filter
/// once treated the event as the CA's removal: the polls were refused
/// with `DeviceRemoved` and the flushed WRs were lost to their owners.)
#[test]
fn after_a_catastrophic_error_the_clients_drain_their_flushed_wrs_then_let_go() {
    let w = world(49);
    let (a, b) = (w.client(0, 1), w.client(0, 2));
    let (sa, sb) = (rc_side(&w.host, &a), rc_side(&w.host, &b));
    connect_ports(&w.host, &a, sa.qp, 1, sb.qpn, (0, 2));
    connect_ports(&w.host, &b, sb.qp, 2, sa.qpn, (0, 1));
    // A receive on each side that no send will consume.
    for (client, side, wr_id) in [(&a, &sa, 0xA1u64), (&b, &sb, 0xB1)] {
        let (al, id) = client.al();
        let sge = leak(vec![Sge::new(side.memory.start, 64, side.memory.lkey)]);
        let qp = side.qp;
        let posted = in_dpc(&w.host, move || {
            al.post_recv(
                id,
                qp,
                &[RecvWr {
                    wr_id,
                    sg_list: sge,
                }],
            )
        });
        assert_eq!(posted, (1, IbStatus::Success));
    }

    w.host
        .backplane()
        .with_device(0, |d| d.declare_fatal(FatalSyndrome::Internal));
    run_queued(&w.host);
    for (client, side, wr_id) in [(&a, &sa, 0xA1u64), (&b, &sb, 0xB1)] {
        let told = lock(&client.recorder.events)
            .iter()
            .filter(|e| e.code == AsyncEventCode::LocalCatastrophic)
            .count();
        assert_eq!(told, 1, "the client hears of the failure once");
        // New work is refused by the failed CA; what was posted drains.
        let (al, id) = client.al();
        let qp = side.qp;
        let sge = leak(vec![Sge::new(side.memory.start, 64, side.memory.lkey)]);
        let refused = in_dpc(&w.host, move || {
            al.post_recv(
                id,
                qp,
                &[RecvWr {
                    wr_id: 0xEE,
                    sg_list: sge,
                }],
            )
        });
        assert_ne!(refused.1, IbStatus::Success, "no new work on a failed CA");
        let flushed = poll(&w.host, client, side.cq);
        assert_eq!(flushed.len(), 1, "each WR once: {flushed:?}");
        assert_eq!(
            (flushed[0].wr_id, flushed[0].status),
            (wr_id, WcStatus::WrFlushErr)
        );
    }
    // The clients let go of the failed CA's objects: each destroy succeeds.
    for (client, side) in [(&a, sa), (&b, sb)] {
        destroy(&w.host, client, side);
    }

    // PnP takes the failed stack down and starts it again.
    settle(&w.host);
    for client in [&a, &b] {
        assert_eq!(*lock(&client.closed), Some(Ok(())));
        assert_eq!(client.recorder.late.load(Ordering::Acquire), 0);
    }
    settle(&w.host);
    assert_eq!(
        w.references(),
        4,
        "the restarted HCA's children have clients"
    );
    assert_eq!(w.driver.registered_cas().len(), 2);
    let (a, b) = (w.client(0, 1), w.client(0, 2));
    let (sa, sb) = (rc_side(&w.host, &a), rc_side(&w.host, &b));
    connect_ports(&w.host, &a, sa.qp, 1, sb.qpn, (0, 2));
    connect_ports(&w.host, &b, sb.qp, 2, sa.qpn, (0, 1));
    let posted = start_transfer(&w.host, (&a, &sa), (&b, &sb), 1200, 11);
    assert_eq!(posted, ((1, IbStatus::Success), (1, IbStatus::Success)));
    settle(&w.host);
    check_transfer(&w.host, (&a, &sa), (&b, &sb), 1200, 11);
    destroy(&w.host, &a, sa);
    destroy(&w.host, &b, sb);
    finish(w.host);
}
