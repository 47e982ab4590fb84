//! Scenario: kernel clients of the access layer on the IBAL bus filter's
//! port children (`sim_shells::ibal_bus`), over the real miniport on two
//! HCAs with two ports each. A client driver bound to every child (the
//! `ibportclient` service of `inf/ib-port-client.inf`) gets the AL
//! interface from its PDO with the port's data, opens the AL with a
//! reference on its driver object, and closes it in its own
//! release-hardware; the tests drive its verbs through the interface and
//! through the IOCTL path of its PDO. Every test ends with the host shut
//! down and the verifier report empty.
#![cfg(not(windows))]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use driver_platform::SystemPowerState;
use driver_platform::{CommonBuffer, DmaAdapter, Irql, RequestorMode};
use hca_miniport_core::init::HcaConfig;
use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::event::{AsyncEventCode, AsyncEventRecord, EventSubject};
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::interface::{
    AL_INTERFACE_VERSION, GUID_IB_AL_INTERFACE, InterfaceVersion, PortInterfaceData,
};
use ib_types::ioctl::{
    AllocPd, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyCq, DestroyQp, Empty, ModifyQp,
    QueryCa, RegPhysMr, Verb, decode_response, encode_request, request_len, response_len,
};
use ib_types::mr::PhysMrRegister;
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, Mtu, PKey, PortNum, Psn, Qpn};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RecvWr, SendFlags, SendOp, SendWr, Sge};
use ibal_bus_core::al::ClientEvents;
use ibal_bus_core::ci::ports_from_attributes;
use sim_hca::device::DeviceConfig;
use sim_host::dma::{HostCommonBuffer, HostDmaAdapter};
use sim_host::driver::{DeviceCallbacks, DeviceInit, DriverEntry, InterfaceRef, SUCCESS};
use sim_host::event::HostEvent;
use sim_host::host::{Host, HostConfig};
use sim_host::pci::{
    BUS_INTERFACE_STANDARD_VERSION, BusInterfaceStandard, GUID_BUS_INTERFACE_STANDARD,
};
use sim_host::pnp::DeviceServices;
use sim_host::request::{Completion, HostRequest, RequestHandle};
use sim_host::sched::SchedulerHandle;
use sim_host::verifier::ViolationKind;
use sim_shells::hca_miniport::MiniportDriver;
use sim_shells::ibal_bus::{AlClient, AlPortInterface, DriverObjectReference, IbalBusDriver};

/// Two HCAs, two ports each; port p of HCA i has the IPv4 address
/// 10.0.i.p.
const HCAS: [u64; 2] = [0x0002_C900_0000_1000, 0x0002_C900_0000_2000];

/// The port clients' service (`inf/ib-port-client.inf`).
const CLIENT: &str = "ibportclient";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a client's callbacks saw: completion events (with the IRQL) and
/// async events.
#[derive(Default)]
struct Recorder {
    completions: Mutex<Vec<(u64, Irql)>>,
    events: Mutex<Vec<AsyncEventRecord>>,
}

impl ClientEvents for Recorder {
    fn completion(&self, cq: u64) {
        lock(&self.completions).push((cq, sim_host::irql::current()));
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.events).push(*event);
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
    /// The host's count of references on the driver's objects (its record
    /// exists once the driver is registered).
    references: OnceLock<Arc<AtomicUsize>>,
    /// Drop the AL interface without dereferencing it (a broken client).
    leak_interface: bool,
    devices: Mutex<Vec<Arc<PortClient>>>,
}

struct PortClient {
    host: DeviceServices,
    sched: SchedulerHandle,
    references: Arc<AtomicUsize>,
    leak_interface: bool,
    opened: Mutex<Option<Opened>>,
    recorder: Arc<Recorder>,
    /// What its close in release-hardware returned.
    closed: Mutex<Option<Result<(), IbStatus>>>,
    /// The port data its interface gave.
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
            leak_interface: self.leak_interface,
            opened: Mutex::default(),
            recorder: Arc::default(),
            closed: Mutex::default(),
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

    /// Closes the AL (it destroyed its objects before) and gives the
    /// interface back.
    fn release_hardware(&self) -> NtStatus {
        if let Some(opened) = lock(&self.opened).take() {
            let drained = Arc::new(HostEvent::new(self.sched.clone()));
            *lock(&self.closed) = Some(opened.al.close(opened.client, drained));
            if self.leak_interface {
                drop(opened.interface);
            } else {
                opened.interface.dereference();
            }
        }
        SUCCESS
    }
}

impl PortClient {
    fn al(&self) -> (Arc<AlPortInterface>, AlClient) {
        let opened = lock(&self.opened);
        let opened = opened.as_ref().expect("the client opened the AL");
        (opened.al.clone(), opened.client)
    }
}

struct World {
    host: Host,
    driver: Arc<IbalBusDriver>,
    clients: Arc<ClientDriver>,
}

fn world(seed: u64, leak_interface: bool) -> World {
    world_on(seed, leak_interface, false)
}

/// [`world`] on the deterministic host, or on the threaded one (two
/// worker threads) if `threaded`.
fn world_on(seed: u64, leak_interface: bool, threaded: bool) -> World {
    let configs = HCAS
        .iter()
        .enumerate()
        .map(|(i, guid)| {
            let i = i as u8;
            DeviceConfig::with_ports(*guid, &[[10, 0, i, 1], [10, 0, i, 2]])
        })
        .collect();
    let config = if threaded {
        HostConfig::threaded(2, configs)
    } else {
        HostConfig::deterministic(seed, configs)
    };
    let host = Host::new(config).unwrap();
    let _log = sim_host::samples::register_stand_ins(&host);
    MiniportDriver::register(&host, HcaConfig::default());
    let driver = IbalBusDriver::register(&host);
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
    settle(&host);
    World {
        host,
        driver,
        clients,
    }
}

fn settle(host: &Host) {
    let run = || {
        if host.scheduler().quiesce().is_err() {
            host.scheduler().run_until_idle(1_000_000).unwrap();
        }
    };
    run();
    host.pnp().process_bus_relations();
    run();
}

fn finish(host: Host) {
    host.shut_down();
    host.verifier().assert_clean();
}

impl World {
    /// The client on port `port` of HCA `hca` (0 or 1).
    fn client(&self, hca: usize, port: u8) -> Arc<PortClient> {
        let guid = HCAS[hca];
        lock(&self.clients.devices)
            .iter()
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
}

/// A verb request in the `ib_types::ioctl` framing, with no private output.
fn request<V: Verb>(
    host: &Host,
    handle: u64,
    input: &V::In,
    private: &[u8],
) -> (HostRequest, RequestHandle) {
    let mut bytes = vec![0; request_len::<V>(private.len()).unwrap()];
    encode_request::<V>(handle, input, private, 0, &mut bytes).unwrap();
    HostRequest::new(
        host.verifier(),
        V::ID.ioctl().raw(),
        RequestorMode::Kernel,
        bytes,
        response_len::<V>(0).unwrap(),
    )
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
    private: &[u8],
) -> Result<(u64, Option<V::Out>), IbStatus> {
    let (al, id) = client.al();
    let (mut req, issuer) = request::<V>(host, handle, input, private);
    let event = HostEvent::new(host.scheduler_handle());
    req.set_completion_event(event.clone());
    al.submit_and_wait(id, req, &event)
        .map_err(|_| IbStatus::InvalidState)?;
    answer::<V>(&issuer.completion().expect("completed"))
}

/// Verb `V` as an internal device-control request sent to the client's
/// child (the IOCTL path), run to completion.
fn ioctl<V: Verb>(
    host: &Host,
    client: &PortClient,
    handle: u64,
    input: &V::In,
) -> Result<(u64, Option<V::Out>), IbStatus> {
    let (req, issuer) = request::<V>(host, handle, input, &[]);
    host.pnp().send_request(client.host.node(), req);
    settle(host);
    answer::<V>(&issuer.completion().expect("completed"))
}

/// Runs `f` in a DPC of the client driver; returns its result.
fn in_dpc<T: Send + 'static>(host: &Host, f: impl FnOnce() -> T + Send + 'static) -> T {
    let out = Arc::new(Mutex::new(None));
    let sink = out.clone();
    host.scheduler_handle()
        .queue_dpc(CLIENT, move || *lock(&sink) = Some(f()));
    settle(host);
    lock(&out).take().expect("the DPC ran")
}

#[test]
fn a_kernel_client_on_a_child_gets_the_al_interface_with_its_ports_data_counted() {
    let w = world(21, false);
    let devices = lock(&w.clients.devices).clone();
    assert_eq!(devices.len(), 4, "one client per port of each HCA");
    for client in &devices {
        let (al, _) = client.al();
        let data = al.port_data();
        let node = client.host.node();
        // The data is the child's: its CA, port, port GUID and P_Key.
        let filter_child = w
            .driver
            .devices()
            .iter()
            .flat_map(|d| d.children())
            .find(|c| {
                w.host
                    .pnp()
                    .instance_path(node)
                    .is_some_and(|p| p.ends_with(c.instance_id()))
            })
            .expect("the client's child");
        assert_eq!(data.ca_guid, filter_child.ca_guid);
        assert_eq!(data.port_guid, filter_child.port_guid);
        assert_eq!(data.port, filter_child.port_num);
        assert_eq!(data.pkey, PKey::new(0xFFFF));
        let opened = lock(&client.opened);
        let version = opened.as_ref().unwrap().interface.version();
        assert_eq!(InterfaceVersion::from_packed(version), AL_INTERFACE_VERSION);
        // The client's reference is counted against its child.
        assert_eq!(w.host.pnp().interface_references(node), 1);
    }
    // Asked at a newer minor, the child answers with its own version (the
    // closest not above); below its version, not at all.
    let node = devices[0].host.node();
    let newer = InterfaceVersion::new(1, 7).packed();
    let answered = w
        .host
        .pnp()
        .query_interface(node, &GUID_IB_AL_INTERFACE, newer)
        .expect("answered");
    assert_eq!(answered.version(), AL_INTERFACE_VERSION.packed());
    answered.dereference();
    let older = InterfaceVersion::new(0, 9).packed();
    assert!(
        w.host
            .pnp()
            .query_interface(node, &GUID_IB_AL_INTERFACE, older)
            .is_none()
    );
    // Every client holds one reference on the client driver's object.
    assert_eq!(w.references(), 4);
    let World { host, clients, .. } = w;
    finish(host);
    // Each closed its AL at its removal, before the HCA's filter let go.
    for client in lock(&clients.devices).iter() {
        assert_eq!(*lock(&client.closed), Some(Ok(())));
        assert_eq!(client.references.load(Ordering::Acquire), 0);
    }
}

#[test]
fn a_leaked_al_interface_reference_is_the_hosts_reference_leak() {
    let w = world(22, true);
    w.host.shut_down();
    let leaks = w
        .host
        .verifier()
        .take()
        .into_iter()
        .filter(|v| {
            matches!(&v.kind, ViolationKind::ReferenceLeak { what } if what.contains(&GUID_IB_AL_INTERFACE.to_string()))
        })
        .count();
    assert_eq!(leaks, 4, "one per client");
}

/// A common buffer of the adapter the client got from its child (the
/// HCA's own), registered physically through the AL: (buffer, adapter,
/// MR handle, IOVA of its first byte, L_Key).
struct Memory {
    adapter: HostDmaAdapter,
    buffer: HostCommonBuffer,
    mr: u64,
    start: u64,
    lkey: LKey,
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
    let (mr, out) = call::<RegPhysMr>(host, client, pd, &input, &list).unwrap();
    let out = out.unwrap();
    Memory {
        adapter,
        buffer,
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

/// AllocPd and CreateCq, then CreateQp, all submitted from DPCs (at
/// DISPATCH_LEVEL) with completion routines; returns (PD, CQ, QP, QPN).
fn create_at_dispatch(host: &Host, client: &PortClient, qp_type: QpType) -> (u64, u64, u64, u32) {
    let (al, id) = client.al();
    let first = {
        let (al, host2) = (al.clone(), host.verifier().clone());
        in_dpc(host, move || {
            assert_eq!(sim_host::irql::current(), Irql::DISPATCH);
            let issuers: Vec<RequestHandle> = [0, 1]
                .into_iter()
                .map(|i| {
                    let (req, issuer) = if i == 0 {
                        dispatch_request::<AllocPd>(&host2, id.ca_handle(), &Empty)
                    } else {
                        let attr = CqAttr {
                            cqe: 64,
                            comp_vector: 0,
                        };
                        dispatch_request::<CreateCq>(&host2, id.ca_handle(), &attr)
                    };
                    assert_eq!(al.submit(id, req), NtStatus::PENDING);
                    issuer
                })
                .collect();
            issuers
        })
    };
    settle(host);
    let pd = answer::<AllocPd>(&first[0].completion().unwrap())
        .unwrap()
        .0;
    let cq = answer::<CreateCq>(&first[1].completion().unwrap())
        .unwrap()
        .0;
    let create = QpCreate {
        qp_type,
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
    let verifier = host.verifier().clone();
    let issuer = in_dpc(host, move || {
        let (req, issuer) = dispatch_request::<CreateQp>(&verifier, id.ca_handle(), &create);
        assert_eq!(al.submit(id, req), NtStatus::PENDING);
        issuer
    });
    settle(host);
    let (qp, out) = answer::<CreateQp>(&issuer.completion().unwrap()).unwrap();
    (pd, cq, qp, out.unwrap().qpn.get())
}

/// A request built in a DPC (no completion event: the issuer's handle
/// tells when it is done).
fn dispatch_request<V: Verb>(
    verifier: &sim_host::verifier::Verifier,
    handle: u64,
    input: &V::In,
) -> (HostRequest, RequestHandle) {
    let mut bytes = vec![0; request_len::<V>(0).unwrap()];
    encode_request::<V>(handle, input, &[], 0, &mut bytes).unwrap();
    HostRequest::new(
        verifier,
        V::ID.ioctl().raw(),
        RequestorMode::Kernel,
        bytes,
        response_len::<V>(0).unwrap(),
    )
}

/// RESET -> INIT -> RTR -> RTS towards `dest` on the port 10.0.`hca`.1.
fn connect(host: &Host, client: &PortClient, qp: u64, dest: u32, dest_hca: u8) {
    let port1 = PortNum::new(1).unwrap();
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
                    dgid: Gid::from_ipv4([10, 0, dest_hca, 1]),
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
        call::<ModifyQp>(host, client, qp, step, &[]).unwrap();
    }
}

fn leak(sges: Vec<Sge>) -> &'static [Sge] {
    Box::leak(sges.into_boxed_slice())
}

/// Arms the CQ and polls everything from DPCs.
fn arm(host: &Host, client: &PortClient, cq: u64) {
    let (al, id) = client.al();
    in_dpc(host, move || al.arm_cq(id, cq, CqNotify::NextCompletion)).unwrap();
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

fn destroy(host: &Host, client: &PortClient, side: RcSide) {
    call::<DestroyQp>(host, client, side.qp, &Empty, &[]).unwrap();
    poll(host, client, side.cq);
    call::<DeregMr>(host, client, side.memory.mr, &Empty, &[]).unwrap();
    call::<DestroyCq>(host, client, side.cq, &Empty, &[]).unwrap();
    call::<DeallocPd>(host, client, side.pd, &Empty, &[]).unwrap();
    side.memory.adapter.free_common(side.memory.buffer);
}

fn rc_side(host: &Host, client: &PortClient) -> RcSide {
    let (pd, cq, qp, qpn) = create_at_dispatch(host, client, QpType::Rc);
    let memory = register(host, client, pd);
    RcSide {
        pd,
        cq,
        qp,
        qpn,
        memory,
    }
}

#[test]
fn clients_on_two_hcas_create_at_dispatch_move_checked_rc_traffic_and_get_their_events() {
    let w = world(23, false);
    let (x, y) = (w.client(0, 1), w.client(1, 1));
    let (sx, sy) = (rc_side(&w.host, &x), rc_side(&w.host, &y));
    connect(&w.host, &x, sx.qp, sy.qpn, 1);
    connect(&w.host, &y, sy.qp, sx.qpn, 0);

    // Y receives into its second page; X sends 3000 bytes of a pattern.
    let payload: Vec<u8> = (0..3000u32).map(|i| (i * 31 + 7) as u8).collect();
    assert!(sx.memory.buffer.write(0, &payload));
    let (yal, yid) = y.al();
    let recv_sge = leak(vec![Sge::new(sy.memory.start + 4096, 4096, sy.memory.lkey)]);
    let yqp = sy.qp;
    let posted = in_dpc(&w.host, move || {
        yal.post_recv(
            yid,
            yqp,
            &[RecvWr {
                wr_id: 9,
                sg_list: recv_sge,
            }],
        )
    });
    assert_eq!(posted, (1, IbStatus::Success));
    arm(&w.host, &x, sx.cq);
    arm(&w.host, &y, sy.cq);
    let (xal, xid) = x.al();
    let send_sge = leak(vec![Sge::new(sx.memory.start, 3000, sx.memory.lkey)]);
    let xqp = sx.qp;
    let posted = in_dpc(&w.host, move || {
        xal.post_send(
            xid,
            xqp,
            &[SendWr {
                wr_id: 8,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: send_sge,
                ud: None,
            }],
        )
    });
    assert_eq!(posted, (1, IbStatus::Success));
    settle(&w.host);
    let sent = poll(&w.host, &x, sx.cq);
    let got = poll(&w.host, &y, sy.cq);
    assert!(sent.len() == 1 && sent[0].wr_id == 8 && sent[0].status == WcStatus::Success);
    assert!(got.len() == 1 && got[0].wr_id == 9 && got[0].status == WcStatus::Success);
    assert_eq!(got[0].byte_len, 3000);
    let mut seen = vec![0; 3000];
    assert!(sy.memory.buffer.read(4096, &mut seen));
    assert_eq!(seen, payload, "the bytes arrived");

    // The completion events reached the owners only, with their handles,
    // at DISPATCH_LEVEL.
    assert_eq!(*lock(&x.recorder.completions), [(sx.cq, Irql::DISPATCH)]);
    assert_eq!(*lock(&y.recorder.completions), [(sy.cq, Irql::DISPATCH)]);
    for other in [w.client(0, 2), w.client(1, 2)] {
        assert!(lock(&other.recorder.completions).is_empty());
        assert!(lock(&other.recorder.events).is_empty());
    }

    // Sleep with the connection up: the children leave D0 before their
    // HCAs and the AL stays; on resume the connected QPs come back in ERR
    // and each owner, only, is told with its own handle.
    w.host.pnp().set_system_power(SystemPowerState::S3).unwrap();
    w.host.pnp().set_system_power(SystemPowerState::S0).unwrap();
    settle(&w.host);
    for (client, side) in [(&x, &sx), (&y, &sy)] {
        let events = lock(&client.recorder.events).clone();
        assert!(
            events
                .iter()
                .any(|e| e.code == AsyncEventCode::QpFatal && e.handle == side.qp),
            "{events:?}"
        );
    }
    for other in [w.client(0, 2), w.client(1, 2)] {
        let events = lock(&other.recorder.events).clone();
        assert!(
            events
                .iter()
                .all(|e| e.code.subject() != EventSubject::Qp
                    && e.code.subject() != EventSubject::Cq),
            "no object event for a client owning none: {events:?}"
        );
    }

    destroy(&w.host, &x, sx);
    destroy(&w.host, &y, sy);
    finish(w.host);
}

#[test]
fn the_same_verbs_through_the_ioctl_path_of_the_child() {
    let w = world(24, false);
    let x = w.client(0, 1);
    let (_, id) = x.al();
    let ca = id.ca_handle();
    // QueryCa: the CA's ports through the AL.
    let room = 16 * 1024;
    let mut bytes = vec![0; request_len::<QueryCa>(0).unwrap()];
    encode_request::<QueryCa>(ca, &Empty, &[], room, &mut bytes).unwrap();
    let (req, issuer) = HostRequest::new(
        w.host.verifier(),
        QueryCa::ID.ioctl().raw(),
        RequestorMode::Kernel,
        bytes,
        response_len::<QueryCa>(room as usize).unwrap(),
    );
    w.host.pnp().send_request(x.host.node(), req);
    settle(&w.host);
    let done = issuer.completion().unwrap();
    assert_eq!(done.status, NtStatus::SUCCESS);
    let len = done.information as usize;
    let response = decode_response::<QueryCa>(&done.output[..len]).unwrap();
    let ports = ports_from_attributes(response.private).unwrap();
    let (al, _) = x.al();
    assert_eq!(ports.len(), 2);
    assert!(
        ports
            .iter()
            .any(|p| p.port_guid == al.port_data().port_guid)
    );

    // Create and destroy, each answered with the client's handles.
    let (pd, _) = ioctl::<AllocPd>(&w.host, &x, ca, &Empty).unwrap();
    let attr = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    let (cq, _) = ioctl::<CreateCq>(&w.host, &x, ca, &attr).unwrap();
    assert!(id.id().owns(pd) && id.id().owns(cq), "the client's handles");
    // The interface path sees the same objects: one implementation.
    assert_eq!(
        call::<DeallocPd>(&w.host, &x, cq, &Empty, &[]),
        Err(IbStatus::InvalidPdHandle),
        "a CQ is no PD on either path"
    );
    ioctl::<DestroyCq>(&w.host, &x, cq, &Empty).unwrap();
    call::<DeallocPd>(&w.host, &x, pd, &Empty, &[]).unwrap();
    assert_eq!(
        ioctl::<DestroyCq>(&w.host, &x, cq, &Empty),
        Err(IbStatus::InvalidCqHandle),
        "destroyed"
    );

    // A user-mode request is no internal device control.
    let mut bytes = vec![0; request_len::<AllocPd>(0).unwrap()];
    encode_request::<AllocPd>(ca, &Empty, &[], 0, &mut bytes).unwrap();
    let (req, issuer) = HostRequest::new(
        w.host.verifier(),
        AllocPd::ID.ioctl().raw(),
        RequestorMode::User,
        bytes,
        response_len::<AllocPd>(0).unwrap(),
    );
    w.host.pnp().send_request(x.host.node(), req);
    settle(&w.host);
    assert_eq!(
        issuer.completion().unwrap().status,
        NtStatus::INVALID_DEVICE_REQUEST
    );
    // No header: refused.
    let (req, issuer) = HostRequest::new(
        w.host.verifier(),
        AllocPd::ID.ioctl().raw(),
        RequestorMode::Kernel,
        vec![1, 2, 3],
        64,
    );
    w.host.pnp().send_request(x.host.node(), req);
    settle(&w.host);
    assert_eq!(
        issuer.completion().unwrap().status,
        NtStatus::INVALID_PARAMETER
    );
    finish(w.host);
}

#[test]
fn handles_of_one_client_are_refused_for_another() {
    let w = world(25, false);
    // Two clients of the same CA (its two ports' children), and one on
    // the other HCA.
    let (a, b, c) = (w.client(0, 1), w.client(0, 2), w.client(1, 1));
    let (_, aid) = a.al();
    let (pd, _) = call::<AllocPd>(&w.host, &a, aid.ca_handle(), &Empty, &[]).unwrap();
    let attr = CqAttr {
        cqe: 16,
        comp_vector: 0,
    };
    let (cq, _) = call::<CreateCq>(&w.host, &a, aid.ca_handle(), &attr, &[]).unwrap();
    for other in [&b, &c] {
        // Through the interface: the AL refuses another client's handles.
        assert_eq!(
            call::<DeallocPd>(&w.host, other, pd, &Empty, &[]),
            Err(IbStatus::InvalidPdHandle)
        );
        let (al, id) = other.al();
        // A's handle of the CA names no CA of B's (tags are per client of
        // one access layer; on the other HCA's AL the same number may be
        // C's own CA handle, which reaches only C's objects).
        if id.ca_handle() != aid.ca_handle() {
            assert_eq!(
                call::<AllocPd>(&w.host, other, aid.ca_handle(), &Empty, &[]),
                Err(IbStatus::InvalidCaHandle)
            );
        }
        assert_eq!(
            al.arm_cq(id, cq, CqNotify::NextCompletion),
            Err(IbStatus::InvalidCqHandle)
        );
        let mut wcs = [WorkCompletion::EMPTY; 1];
        assert_eq!(al.poll_cq(id, cq, &mut wcs), Err(IbStatus::InvalidCqHandle));
        // Through the IOCTL path of its own child: the handle names no
        // client opened there (STATUS_INVALID_HANDLE), or, where its tag
        // is that of the child's own client (another AL's), that client's
        // table refuses it.
        let (req, issuer) = request::<DestroyCq>(&w.host, cq, &Empty, &[]);
        w.host.pnp().send_request(other.host.node(), req);
        settle(&w.host);
        let expected = if id.id().owns(cq) {
            IbStatus::InvalidCqHandle.to_ntstatus()
        } else {
            NtStatus::INVALID_HANDLE
        };
        assert_eq!(issuer.completion().unwrap().status, expected);
    }
    // A's objects are untouched: A still destroys them.
    call::<DestroyCq>(&w.host, &a, cq, &Empty, &[]).unwrap();
    call::<DeallocPd>(&w.host, &a, pd, &Empty, &[]).unwrap();
    finish(w.host);
}

#[test]
fn clients_close_before_their_hca_goes_and_a_stop_waits_for_them() {
    let w = world(26, false);
    let hca = w.host.hcas()[0];
    let filter = w
        .driver
        .devices()
        .into_iter()
        .find(|d| {
            d.bound()
                .is_some_and(|b| b.identity().ca_guid.get() == HCAS[0])
        })
        .unwrap();
    let al = filter.access_layer().expect("an access layer per bound CA");
    assert_eq!(al.open_clients(), 2);
    // A stop would close the CA under the open clients: vetoed.
    assert!(w.host.pnp().stop(hca).is_err());
    assert_eq!(al.open_clients(), 2);
    assert_eq!(w.references(), 4);

    // Removal: the children go first, their clients close there, then the
    // filter lets the CA go.
    w.host.pnp().query_and_remove(hca).unwrap();
    settle(&w.host);
    assert_eq!(al.open_clients(), 0);
    assert!(filter.access_layer().is_none());
    assert_eq!(w.references(), 2, "the other HCA's clients hold theirs");
    for client in lock(&w.clients.devices).iter() {
        let guid = client.port.get().unwrap().ca_guid.get();
        let closed = *lock(&client.closed);
        if guid == HCAS[0] {
            assert_eq!(closed, Some(Ok(())));
        } else {
            assert_eq!(closed, None);
        }
    }
    // The other HCA's clients keep working.
    let c = w.client(1, 1);
    let (_, id) = c.al();
    let (pd, _) = call::<AllocPd>(&w.host, &c, id.ca_handle(), &Empty, &[]).unwrap();
    call::<DeallocPd>(&w.host, &c, pd, &Empty, &[]).unwrap();
    finish(w.host);
}

/// A client that still owns objects when its HCA leaves: its close at its
/// own removal destroys them (the AL closes what a client left open, in
/// dependency order), the filter drops the access layer at release-hardware,
/// the client's reference on its driver is given back, and every later call
/// of the client is refused; nothing leaks.
#[test]
fn a_client_owning_objects_when_its_hca_leaves_closes_cleanly_and_later_calls_are_refused() {
    for surprise in [false, true] {
        let w = world(27, false);
        let a = w.client(0, 1);
        let (al, id) = a.al();
        let (pd, _) = call::<AllocPd>(&w.host, &a, id.ca_handle(), &Empty, &[]).unwrap();
        let hca = w.host.hcas()[0];
        if surprise {
            w.host.pnp().surprise_remove(hca);
            w.host.pnp().remove_when_no_handles_remain(hca, 0);
        } else {
            w.host.pnp().query_and_remove(hca).unwrap();
        }
        settle(&w.host);
        assert_eq!(
            *lock(&a.closed),
            Some(Ok(())),
            "its PD destroyed by the close"
        );
        assert_eq!(w.references(), 2, "only the other HCA's clients' remain");
        let (req, issuer) = request::<DeallocPd>(&w.host, pd, &Empty, &[]);
        assert_eq!(al.submit(id, req), NtStatus::INVALID_DEVICE_STATE);
        assert_eq!(
            issuer.completion().unwrap().status,
            NtStatus::INVALID_DEVICE_STATE
        );
        let mut wcs = [WorkCompletion::EMPTY; 1];
        assert_eq!(al.poll_cq(id, 1, &mut wcs), Err(IbStatus::InvalidState));
        let drained = Arc::new(HostEvent::new(w.host.scheduler_handle()));
        assert_eq!(al.close(id, drained), Ok(()), "gone with the access layer");
        assert_eq!(w.host.verifier().violations(), [], "surprise: {surprise}");
        finish(w.host);
    }
}

/// On the threaded host (requests completing on worker threads while the
/// test thread waits) every client's verbs go through its AL, and the
/// clients close and the filters let go cleanly at shutdown.
#[test]
fn clients_use_the_al_on_the_threaded_host_too() {
    for round in 0..3 {
        let w = world_on(0, false, true);
        // The children's stacks start on worker threads.
        for _ in 0..3 {
            settle(&w.host);
        }
        for (hca, port) in [(0, 1), (0, 2), (1, 1), (1, 2)] {
            let client = w.client(hca, port);
            let (_, id) = client.al();
            let (pd, _) = call::<AllocPd>(&w.host, &client, id.ca_handle(), &Empty, &[]).unwrap();
            let attr = CqAttr {
                cqe: 16,
                comp_vector: 0,
            };
            let (cq, _) = call::<CreateCq>(&w.host, &client, id.ca_handle(), &attr, &[]).unwrap();
            let (al, id) = client.al();
            assert_eq!(al.arm_cq(id, cq, CqNotify::NextCompletion), Ok(()));
            call::<DestroyCq>(&w.host, &client, cq, &Empty, &[]).unwrap();
            call::<DeallocPd>(&w.host, &client, pd, &Empty, &[]).unwrap();
        }
        assert_eq!(w.references(), 4, "round {round}");
        finish(w.host);
    }
}
