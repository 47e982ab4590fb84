//! A kernel client of the access layer on the simulated Windows machine
//! with the whole kernel stack (the main job's until it ran the real
//! sample port client, `main-job/`):
//! two HCAs on the PCI bus, the drivers bound from our INF files
//! (`hcaminiport` is the miniport's simulated-host shell,
//! `sim_shells::hca_miniport`; `ibalbus` the bus filter's,
//! `sim_shells::ibal_bus`, which binds to the miniport's CI and reports
//! the port children; the port client on the children is still the host's
//! stand-in), and a kernel client of each HCA's port-1 child: it asks the
//! child for the AL interface (`IRP_MN_QUERY_INTERFACE`,
//! `GUID_IB_AL_INTERFACE`) and for its DMA adapter (the bus interface,
//! the HCA's own), opens the AL with its callbacks and a reference on its
//! driver object, creates a
//! PD, a CQ, QPs and an AV and registers memory with control verbs
//! through the interface's synchronous helper, and moves RC (send, RDMA
//! write, RDMA read) and UD traffic between the two HCAs through the
//! AL's direct calls, every byte checked, completions signalled by the CQ events it armed for.
//! Then it sleeps the machine (S3) with every object alive and wakes it:
//! the UD pair moves a datagram again (checked), the connected RC QPs come
//! back in ERR with `QpFatal`, are reset and reconnected, and SENDs flow
//! again (checked). Then it tears everything down, closes the AL, gives
//! the interfaces back, shuts down, and requires an empty verifier report.
//!
//! Memory is a common buffer of each HCA's DMA adapter, registered through
//! the AL with `RegPhysMr` (a kernel client's physical registration: the
//! page list of bus addresses). Every handle the client holds is its own
//! (the AL's per-client table), translated to the CA's by the AL. The
//! objects survive sleep because the core
//! keeps them on D0 exit and gives them back on D0 entry
//! (`hca_miniport_core::verbs::restore`; in detail in
//! `hca-miniport/core/tests/power.rs`).
//!
//! The scenario test `tests/tests/miniport_stack.rs` runs this module.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};

use driver_platform::{CommonBuffer, DmaAdapter, Event, RequestorMode, SystemPowerState};
use hca_miniport_core::init::HcaConfig;
use hca_miniport_core::verbs::CqNotify;
use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::cq::CqAttr;
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::handle::{AvHandle, CqHandle, PdHandle};
use ib_types::interface::{AL_INTERFACE_VERSION, GUID_IB_AL_INTERFACE};
use ib_types::ioctl::{
    AllocPd, CreateAv, CreateCq, CreateQp, DeallocPd, DeregMr, DestroyAv, DestroyCq, DestroyQp,
    Empty, ModifyQp, QueryQp, RegPhysMr, Verb, decode_response, encode_request, request_len,
    response_len,
};
use ib_types::mr::PhysMrRegister;
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, Mtu, PortNum, Psn, QKey, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::{WcStatus, WorkCompletion};
use ib_types::wr::{LKey, RKey, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest};
use sim_hca::device::DeviceConfig;
use sim_host::dma::{HostCommonBuffer, HostDmaAdapter};
use sim_host::driver::InterfaceRef;
use sim_host::event::HostEvent;
use sim_host::host::{Host, HostConfig};
use sim_host::pci::{
    BUS_INTERFACE_STANDARD_VERSION, BusInterfaceStandard, GUID_BUS_INTERFACE_STANDARD,
};
use sim_host::platform::SimPlatform;
use sim_host::pnp::DevNodeId;
use sim_host::request::HostRequest;
use sim_shells::hca_miniport::{MiniportDevice, MiniportDriver};
use sim_shells::ibal_bus::{
    AlClient, AlPortInterface, ClientEvents, DriverObjectReference, IbalBusDriver,
};

/// The port client's service, on whose behalf the kernel client runs (its
/// DPCs, the driver object the AL holds a reference on).
const CLIENT_SERVICE: &str = "ibportclient";
/// A memory region the CI registered.
struct Registered {
    handle: u64,
    start: u64,
    lkey: LKey,
    rkey: RKey,
}

/// The main job's seed.
pub(crate) const SEED: u64 = 2026;

/// The HCAs: node GUID and port 1's IPv4 address.
const HCAS: [(u64, [u8; 4]); 2] = [
    (0x0002_C900_0000_1000, [10, 0, 0, 1]),
    (0x0002_C900_0000_2000, [10, 0, 0, 2]),
];

/// Bytes of registered memory per HCA.
const MEM_BYTES: usize = 16 * 1024;

/// RC sends per direction, and each one's size.
const RC_SENDS: [u32; 4] = [1, 100, 1024, 4000];

/// The Q_Key of the UD QPs.
const UD_QKEY: u32 = 0x1111_2222;

/// What the run did, for the main job to print and the scenario test to
/// check.
#[derive(Debug, Default)]
pub(crate) struct Summary {
    /// Human-readable lines.
    pub(crate) lines: Vec<String>,
    /// Payload bytes moved and checked.
    pub(crate) bytes_checked: u64,
    /// Work completions polled, all successful.
    pub(crate) completions: usize,
    /// Completion events the clients received (at DISPATCH_LEVEL).
    pub(crate) completion_events: usize,
    /// The devices started again after S3 -> S0.
    pub(crate) restarted_after_wake: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The kernel client's AL callbacks: completion events on its CQs (its
/// handles, with the IRQL they came at) and asynchronous events.
#[derive(Default)]
struct Client {
    completions: Mutex<Vec<(u64, driver_platform::Irql)>>,
    events: Mutex<Vec<AsyncEventRecord>>,
}

impl ClientEvents for Client {
    fn completion(&self, cq: u64) {
        lock(&self.completions).push((cq, sim_host::irql::current()));
    }
    fn async_event(&self, event: &AsyncEventRecord) {
        lock(&self.events).push(*event);
    }
}

/// One HCA as the client sees it.
struct Side {
    device: Arc<MiniportDevice<SimPlatform>>,
    /// The AL interface of the HCA's port-1 child.
    interface: Option<InterfaceRef>,
    al: Arc<AlPortInterface>,
    /// The client's open of the AL.
    handle: AlClient,
    client: Arc<Client>,
    /// The DMA adapter the child gave (the HCA's own).
    adapter: HostDmaAdapter,
    /// The client's handle of the CA.
    ca: u64,
    pd: u64,
    cq: u64,
    buffer: Option<HostCommonBuffer>,
    region: Option<Registered>,
    ip: [u8; 4],
}

impl Side {
    fn adapter(&self) -> Result<HostDmaAdapter, String> {
        Ok(self.adapter.clone())
    }

    fn buffer(&self) -> Result<&HostCommonBuffer, String> {
        self.buffer.as_ref().ok_or("no buffer".to_owned())
    }

    fn region(&self) -> Result<&Registered, String> {
        self.region.as_ref().ok_or("no region".to_owned())
    }

    fn sge(&self, offset: usize, len: u32) -> Result<Sge, String> {
        let region = self.region()?;
        Ok(Sge::new(region.start + offset as u64, len, region.lkey))
    }

    fn write(&self, offset: usize, bytes: &[u8]) -> Result<(), String> {
        self.buffer()?
            .write(offset, bytes)
            .then_some(())
            .ok_or("write outside the buffer".to_owned())
    }

    fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>, String> {
        let mut out = vec![0; len];
        self.buffer()?
            .read(offset, &mut out)
            .then_some(out)
            .ok_or("read outside the buffer".to_owned())
    }
}

/// Deterministic, non-trivial bytes.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(37).wrapping_add(seed))
        .collect()
}

/// The machine, its miniport and its bus filter.
struct Machine {
    host: Host,
    driver: Arc<MiniportDriver<SimPlatform>>,
    filter: Arc<IbalBusDriver>,
}

impl Machine {
    fn settle(&self) -> Result<(), String> {
        self.host
            .scheduler()
            .run_until_idle(1_000_000)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Settles, then reports the children the filter enumerated and
    /// settles again (their stacks start).
    fn settle_tree(&self) -> Result<(), String> {
        self.settle()?;
        self.host.pnp().process_bus_relations();
        self.settle()
    }

    /// Runs verb `V` through the AL's synchronous helper from this
    /// (PASSIVE_LEVEL) thread: the request's completion sets the event the
    /// helper waits on; the deterministic wait runs the DPCs and work
    /// items that complete it.
    fn call<V: Verb>(
        &self,
        side: &Side,
        handle: u64,
        input: &V::In,
    ) -> Result<(u64, Option<V::Out>), String> {
        self.call_with::<V>(side, handle, input, &[])
    }

    /// [`Self::call`] with private input bytes.
    fn call_with<V: Verb>(
        &self,
        side: &Side,
        handle: u64,
        input: &V::In,
        private: &[u8],
    ) -> Result<(u64, Option<V::Out>), String> {
        let mut bytes = vec![0; request_len::<V>(private.len()).ok_or("request size")?];
        encode_request::<V>(handle, input, private, 0, &mut bytes).map_err(|e| e.to_string())?;
        let out_len = response_len::<V>(0).ok_or("response size")?;
        let (mut request, issuer) = HostRequest::new(
            self.host.verifier(),
            V::ID.ioctl().raw(),
            RequestorMode::Kernel,
            bytes,
            out_len,
        );
        let event = HostEvent::new(self.host.scheduler_handle());
        request.set_completion_event(event.clone());
        side.al
            .submit_and_wait(side.handle, request, &event)
            .map_err(|_| "the synchronous helper refused at PASSIVE_LEVEL".to_owned())?;
        if !event.is_set() {
            return Err(format!("{:?}: the wait returned unset", V::ID));
        }
        let done = issuer
            .completion()
            .ok_or(format!("{:?}: no completion", V::ID))?;
        if !done.status.is_success() {
            return Err(format!("{:?}: {:?}", V::ID, done.status));
        }
        // The whole output is the response (no private output asked); a
        // create's Information is the new handle, else the length.
        let response = decode_response::<V>(&done.output).map_err(|e| e.to_string())?;
        if V::ID.creates().is_some() && done.information != response.handle {
            return Err(format!("{:?}: the handle is not in Information", V::ID));
        }
        if response.status != IbStatus::Success {
            return Err(format!("{:?}: {:?}", V::ID, response.status));
        }
        Ok((response.handle, response.output))
    }

    /// Runs `f` in a DPC of the miniport and returns its result.
    fn in_dpc<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, String> {
        let out = Arc::new(Mutex::new(None));
        let sink = out.clone();
        self.host
            .scheduler_handle()
            .queue_dpc(CLIENT_SERVICE, move || *lock(&sink) = Some(f()));
        self.settle()?;
        lock(&out).take().ok_or("the DPC did not run".to_owned())
    }
}

/// Boots, runs the traffic, sleeps, wakes, shuts down; fails with what went
/// wrong.
pub(crate) fn run(seed: u64) -> Result<Summary, String> {
    let configs = HCAS
        .iter()
        .map(|(guid, ip)| DeviceConfig::with_ports(*guid, &[*ip]))
        .collect();
    let host = Host::new(HostConfig::deterministic(seed, configs)).map_err(|e| e.to_string())?;
    // Stand-ins for the port client; the real miniport and the real bus
    // filter replace the stand-ins registered under their service names.
    let _stand_in_log = sim_host::samples::register_stand_ins(&host);
    let driver = MiniportDriver::register(&host, HcaConfig::default());
    let filter = IbalBusDriver::register(&host);
    host.boot();
    let m = Machine {
        host,
        driver,
        filter,
    };
    m.settle_tree()?;
    let mut summary = Summary::default();
    let client_references = m
        .host
        .pnp()
        .driver_references(CLIENT_SERVICE)
        .ok_or("the port client is not registered")?;

    let mut sides = Vec::new();
    for node in m.host.hcas() {
        let device = m
            .driver
            .devices()
            .into_iter()
            .find(|d| d.node() == node)
            .ok_or("an HCA without a miniport device")?;
        match device.started() {
            Some(Ok(_)) => {}
            other => return Err(format!("bring-up of {node:?}: {other:?}")),
        }
        let (child, interface) = port1_child(&m, node)?;
        let al = interface
            .get::<Arc<AlPortInterface>>()
            .ok_or("the AL interface is not an AlPortInterface")?
            .clone();
        let data = al.port_data();
        let ip = HCAS
            .iter()
            .find(|(guid, _)| *guid == data.ca_guid.get())
            .map(|(_, ip)| *ip)
            .ok_or("an unknown CA GUID")?;
        let filter_bound = m
            .filter
            .devices()
            .iter()
            .filter_map(|d| d.bound())
            .find(|b| b.identity().ca_guid == data.ca_guid)
            .ok_or("the filter did not bind the CA")?;
        let id = filter_bound.identity();
        let uvp = device
            .provider()
            .map(|p| p.uvp_name().as_str().to_owned())
            .unwrap_or_default();
        summary.lines.push(format!(
            "{node:?}: filter bound CA {:#018x} (vendor {:#x} device {:#x}, UVP {uvp:?}); AL {:?} via QUERY_INTERFACE on its child {}: port {} GUID {:#018x} P_Key {:#06x}",
            id.ca_guid.get(),
            id.vendor_id,
            id.device_id,
            AL_INTERFACE_VERSION,
            m.host.pnp().instance_path(child).unwrap_or_default(),
            data.port.get(),
            data.port_guid.get(),
            data.pkey.get(),
        ));
        let stack: Vec<String> = m
            .host
            .pnp()
            .stack_services(node)
            .into_iter()
            .map(|(service, role)| format!("{service} ({role:?})"))
            .collect();
        summary.lines.push(format!(
            "{node:?}: stack bound from inf/ [{}]",
            stack.join(" < ")
        ));
        let adapter = child_adapter(&m, child)?;
        if device.adapter().map(|a| a.index()) != Some(adapter.index()) {
            return Err(format!(
                "{node:?}: the child's DMA adapter is not the HCA's"
            ));
        }
        let client = Arc::new(Client::default());
        let reference = Box::new(DriverObjectReference::new(client_references.clone()));
        let handle = al
            .open(reference, client.clone())
            .map_err(|s| format!("AL open: {s:?}"))?;
        let mut side = Side {
            device,
            interface: Some(interface),
            al,
            handle,
            client,
            adapter,
            ca: handle.ca_handle(),
            pd: 0,
            cq: 0,
            buffer: None,
            region: None,
            ip,
        };
        let (pd, _) = m.call::<AllocPd>(&side, side.ca, &Empty)?;
        let attr = CqAttr {
            cqe: 128,
            comp_vector: 0,
        };
        let (cq, _) = m.call::<CreateCq>(&side, side.ca, &attr)?;
        (side.pd, side.cq) = (pd, cq);
        sides.push(side);
    }
    if sides.len() != 2 {
        return Err(format!("{} HCAs, expected 2", sides.len()));
    }
    for side in &mut sides {
        register_memory(&m, side)?;
    }
    summary.lines.push(
        "each HCA's port-1 child: AL opened with callbacks, PD, CQ, 16 KiB of the child's DMA adapter (the HCA's own) registered with RegPhysMr (synchronous AL calls)"
            .to_owned(),
    );

    let rc = rc_traffic(&m, &sides, &mut summary)?;
    let ud = ud_traffic(&m, &sides, &mut summary)?;

    // Sleep with every object alive: PD, CQ, QPs, AV and regions.
    m.host
        .pnp()
        .set_system_power(SystemPowerState::S3)
        .map_err(|veto| veto.to_string())?;
    let asleep = sides
        .iter()
        .all(|s| s.device.hca().is_some_and(|hca| hca.report().is_none()));
    m.host
        .pnp()
        .set_system_power(SystemPowerState::S0)
        .map_err(|veto| veto.to_string())?;
    m.settle()?;
    let awake = sides.iter().all(|s| {
        s.device
            .provider()
            .is_some_and(|provider| provider.identity().is_ok())
    });
    summary.restarted_after_wake = asleep && awake;
    if !summary.restarted_after_wake {
        return Err("the HCAs did not stop in S3 and start again in S0".to_owned());
    }
    summary.lines.push("S0 -> S3 -> S0 with PD, CQ, QPs, AV and regions alive: each HCA taken down on D0 exit and its objects given back on D0 entry".to_owned());
    after_resume(&m, &sides, rc, ud, &mut summary)?;

    for side in &mut sides {
        summary.completion_events += lock(&side.client.completions).len();
        let wrong_level = lock(&side.client.completions)
            .iter()
            .any(|(_, irql)| *irql != driver_platform::Irql::DISPATCH);
        if wrong_level {
            return Err("a completion callback outside DISPATCH_LEVEL".to_owned());
        }
    }
    let (a, _, b, _) = rc;
    let (ua, _, ub, _, av) = ud;
    let (x, y) = (&sides[0], &sides[1]);
    m.call::<DestroyAv>(x, av, &Empty)?;
    for (side, qp) in [(x, a), (y, b), (x, ua), (y, ub)] {
        m.call::<DestroyQp>(side, qp, &Empty)?;
    }
    // Whatever a destroy flushed is polled away.
    reap(&m, x).ok();
    reap(&m, y).ok();
    for side in &mut sides {
        deregister_memory(&m, side)?;
        m.call::<DestroyCq>(side, side.cq, &Empty)?;
        m.call::<DeallocPd>(side, side.pd, &Empty)?;
        let drained = Arc::new(HostEvent::new(m.host.scheduler_handle()));
        side.al
            .close(side.handle, drained)
            .map_err(|s| format!("AL close: {s:?}"))?;
        if let Some(interface) = side.interface.take() {
            interface.dereference();
        }
    }
    summary.lines.push(format!(
            "torn down: every QP, AV, CQ, PD and region destroyed, the AL closed (its reference on the client's driver given back), interfaces dereferenced ({} completion events, all at DISPATCH_LEVEL)",
            summary.completion_events
        ),
    );
    drop(sides);

    m.host.shut_down();
    // What the routines used of their kernel stacks (sim_host::stack): the
    // numbers docs/host-model.md "Kernel stacks" quotes.
    let high_water = sim_host::stack::high_water()
        .iter()
        .map(|(kind, bytes)| format!("{kind:?} {:.1} KiB", *bytes as f64 / 1024.0))
        .collect::<Vec<_>>()
        .join(", ");
    summary.lines.push(format!(
        "kernel stacks used (most, this process): {high_water}; budget {} KiB in this build",
        sim_host::stack::budget() / 1024
    ));
    let violations = m.host.verifier().violations();
    summary.lines.push(format!(
        "shutdown: every driver unloaded; verifier: {} violation(s)",
        violations.len()
    ));
    if violations.is_empty() {
        Ok(summary)
    } else {
        Err(violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "))
    }
}

/// After S3 -> S0: the UD pair and the AV work as before (a datagram,
/// checked); the connected RC QPs came back in ERR, each side's client told
/// with `QpFatal`; they are reset and connected again, and SENDs flow both
/// ways. The regions keep their keys throughout.
fn after_resume(
    m: &Machine,
    sides: &[Side],
    rc: RcPair,
    ud: UdPair,
    summary: &mut Summary,
) -> Result<(), String> {
    ud_datagram(m, sides, ud, 88, summary)?;
    let (a, qpn_a, b, qpn_b) = rc;
    let (x, y) = (&sides[0], &sides[1]);
    for (side, qp) in [(x, a), (y, b)] {
        let fatal = lock(&side.client.events)
            .iter()
            .any(|e| e.code == AsyncEventCode::QpFatal && e.handle == qp);
        if !fatal {
            return Err(format!("no QpFatal for RC QP {qp:#x} after resume"));
        }
        let (_, query) = m.call::<QueryQp>(side, qp, &Empty)?;
        let state = query.ok_or("QueryQp without output")?.state;
        if state != QpState::Err {
            return Err(format!("RC QP {qp:#x} is {state:?} after resume, not ERR"));
        }
        m.call::<ModifyQp>(side, qp, &QpModify::to_state(QpState::Reset))?;
    }
    // Nothing was outstanding at D0 exit, so nothing was flushed.
    for side in [x, y] {
        let flushed = reap(m, side)?;
        if !flushed.is_empty() {
            return Err(format!("completions after resume: {flushed:?}"));
        }
    }
    // A reset after a connection waits out TIME WAIT before RTR (guide
    // 6.5.2); virtual time moves past it.
    m.host
        .scheduler()
        .advance(hca_miniport_core::verbs::qp::QPN_QUIET_PERIOD_NS)
        .map_err(|e| e.to_string())?;
    connect(m, x, a, qpn_b, y.ip)?;
    connect(m, y, b, qpn_a, x.ip)?;
    rc_sends(m, sides, rc, summary)?;
    summary.lines.push(format!(
        "after resume: UD datagram checked; RC {qpn_a:#x} <-> {qpn_b:#x} back in ERR with QpFatal, reset, reconnected, sends both ways checked"
    ));
    Ok(())
}

/// The port-1 child of `hca` and the AL interface it answered with (the
/// other children's given back).
fn port1_child(m: &Machine, hca: DevNodeId) -> Result<(DevNodeId, InterfaceRef), String> {
    let mut found = None;
    for child in m.host.pnp().children(hca) {
        let Some(interface) = m.host.pnp().query_interface(
            child,
            &GUID_IB_AL_INTERFACE,
            AL_INTERFACE_VERSION.packed(),
        ) else {
            continue;
        };
        let port1 = interface
            .get::<Arc<AlPortInterface>>()
            .is_some_and(|al| al.port_data().port.get() == 1);
        if port1 && found.is_none() {
            found = Some((child, interface));
        } else {
            interface.dereference();
        }
    }
    found.ok_or(format!("{hca:?}: no port-1 child answers the AL interface"))
}

/// The DMA adapter of a child (`IoGetDmaAdapter` through the bus interface
/// its PDO forwards to the HCA's).
fn child_adapter(m: &Machine, child: DevNodeId) -> Result<HostDmaAdapter, String> {
    let bus = m
        .host
        .pnp()
        .query_interface(
            child,
            &GUID_BUS_INTERFACE_STANDARD,
            BUS_INTERFACE_STANDARD_VERSION,
        )
        .ok_or("no bus interface on the child")?;
    let adapter = bus.call(|b: &BusInterfaceStandard| b.get_dma_adapter());
    bus.dereference();
    match adapter {
        Some(Ok(adapter)) => Ok(adapter),
        other => Err(format!("IoGetDmaAdapter on the child: {other:?}")),
    }
}

/// A common buffer of the HCA's adapter registered physically through the
/// AL (`RegPhysMr`, kernel only: the page list of bus addresses as private
/// input; the IOVA is the first page's bus address).
fn register_memory(m: &Machine, side: &mut Side) -> Result<(), String> {
    let buffer = side
        .adapter()?
        .alloc_common(MEM_BYTES)
        .map_err(|s| format!("common buffer: {s:?}"))?;
    let bus = buffer.bus_address();
    let pages = MEM_BYTES / 4096;
    let input = PhysMrRegister {
        iova: bus,
        length: MEM_BYTES as u64,
        first_byte_offset: 0,
        page_shift: 12,
        num_pages: pages as u32,
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
    };
    let list: Vec<u8> = (0..pages as u64)
        .flat_map(|i| (bus + i * 4096).to_le_bytes())
        .collect();
    side.buffer = Some(buffer);
    let (mr, out) = m.call_with::<RegPhysMr>(side, side.pd, &input, &list)?;
    let out = out.ok_or("RegPhysMr without output")?;
    side.region = Some(Registered {
        handle: mr,
        start: out.iova,
        lkey: out.keys.lkey,
        rkey: out.keys.rkey,
    });
    Ok(())
}

fn deregister_memory(m: &Machine, side: &mut Side) -> Result<(), String> {
    let region = side.region.take().ok_or("no region")?;
    m.call::<DeregMr>(side, region.handle, &Empty)?;
    if let Some(buffer) = side.buffer.take() {
        side.adapter()?.free_common(buffer);
    }
    Ok(())
}

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 0,
    }
}

fn create_qp(m: &Machine, side: &Side, qp_type: QpType) -> Result<(u64, u32), String> {
    let create = QpCreate {
        qp_type,
        pd: PdHandle::from_raw(side.pd),
        send_cq: CqHandle::from_raw(side.cq),
        recv_cq: CqHandle::from_raw(side.cq),
        srq: None,
        caps: caps(),
        sq_sig_all: false,
        port: None,
    };
    let (qp, created) = m.call::<CreateQp>(side, side.ca, &create)?;
    let qpn = created.ok_or("CreateQp without output")?.qpn.get();
    Ok((qp, qpn))
}

fn av_to(ip: [u8; 4]) -> Result<AvAttr, String> {
    Ok(AvAttr {
        port: PortNum::new(1).map_err(|e| e.to_string())?,
        sl: 0,
        dlid: Lid::default(),
        path_bits: 0,
        static_rate: 0,
        grh: Some(Grh {
            dgid: Gid::from_ipv4(ip),
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0,
            sgid_index: 0,
        }),
    })
}

fn port1() -> Result<PortNum, String> {
    PortNum::new(1).map_err(|e| e.to_string())
}

/// RESET -> INIT -> RTR -> RTS for an RC QP aimed at `dest` on `dest_ip`.
fn connect(m: &Machine, side: &Side, qp: u64, dest: u32, dest_ip: [u8; 4]) -> Result<(), String> {
    let psn = |v: u32| Psn::new(v).map_err(|e| e.to_string());
    let steps = [
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(port1()?),
            access: Some(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ),
            ..QpModify::default()
        },
        QpModify {
            state: Some(QpState::Rtr),
            av: Some(av_to(dest_ip)?),
            path_mtu: Some(Mtu::Mtu1024),
            dest_qpn: Some(Qpn::new(dest).map_err(|e| e.to_string())?),
            rq_psn: Some(psn(100)?),
            max_dest_rd_atomic: Some(4),
            min_rnr_timer: Some(12),
            ..QpModify::default()
        },
        QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(psn(100)?),
            timeout: Some(14),
            retry_cnt: Some(7),
            rnr_retry: Some(7),
            max_rd_atomic: Some(4),
            ..QpModify::default()
        },
    ];
    for step in &steps {
        m.call::<ModifyQp>(side, qp, step)?;
    }
    Ok(())
}

/// Arms `side`'s CQ, runs the machine, and polls everything through the
/// CI; requires that the arm produced a completion event first.
fn reap(m: &Machine, side: &Side) -> Result<Vec<WorkCompletion>, String> {
    let events_before = lock(&side.client.completions).len();
    let (ci, client) = (side.al.clone(), side.handle);
    let cq = side.cq;
    m.in_dpc(move || ci.arm_cq(client, cq, CqNotify::NextCompletion))?
        .map_err(|s| format!("arm: {s:?}"))?;
    m.settle()?;
    let (ci, client) = (side.al.clone(), side.handle);
    let wcs = m.in_dpc(move || {
        let mut all = Vec::new();
        let mut wcs = [WorkCompletion::EMPTY; 8];
        loop {
            match ci.poll_cq(client, cq, &mut wcs) {
                Ok(0) => break Ok(all),
                Ok(n) => all.extend_from_slice(&wcs[..n]),
                Err(status) => break Err(format!("poll: {status:?}")),
            }
        }
    })??;
    if !wcs.is_empty() && lock(&side.client.completions).len() == events_before {
        return Err("completions arrived without the armed completion event".to_owned());
    }
    Ok(wcs)
}

/// Checks that every completion succeeded with the expected `wr_id`s.
fn expect_ids(wcs: &[WorkCompletion], mut want: Vec<u64>) -> Result<(), String> {
    let mut got: Vec<u64> = wcs.iter().map(|wc| wc.wr_id).collect();
    got.sort_unstable();
    want.sort_unstable();
    if got != want || wcs.iter().any(|wc| wc.status != WcStatus::Success) {
        return Err(format!("completions {wcs:?}, wanted wr_ids {want:?}"));
    }
    Ok(())
}

fn leak(sges: Vec<Sge>) -> &'static [Sge] {
    Box::leak(sges.into_boxed_slice())
}

/// The connected RC pair: (QP on X, its number, QP on Y, its number).
type RcPair = (u64, u32, u64, u32);

fn rc_traffic(m: &Machine, sides: &[Side], summary: &mut Summary) -> Result<RcPair, String> {
    let (x, y) = (&sides[0], &sides[1]);
    let (a, qpn_a) = create_qp(m, x, QpType::Rc)?;
    let (b, qpn_b) = create_qp(m, y, QpType::Rc)?;
    connect(m, x, a, qpn_b, y.ip)?;
    connect(m, y, b, qpn_a, x.ip)?;
    rc_sends(m, sides, (a, qpn_a, b, qpn_b), summary)?;

    // RDMA write from X into Y, then RDMA read of it back into X.
    let written = pattern(55, 3000);
    x.write(0, &written)?;
    let remote = RemoteAddr {
        addr: y.region()?.start + 4096,
        rkey: y.region()?.rkey,
    };
    let wrs = vec![
        SendWr {
            wr_id: 200,
            op: SendOp::RdmaWrite { remote },
            flags: SendFlags::SIGNALED,
            sg_list: leak(vec![x.sge(0, 3000)?]),
            ud: None,
        },
        SendWr {
            wr_id: 201,
            op: SendOp::RdmaRead { remote },
            flags: SendFlags::SIGNALED,
            sg_list: leak(vec![x.sge(4096, 3000)?]),
            ud: None,
        },
    ];
    let (ci, client) = (x.al.clone(), x.handle);
    let (posted, status) = m.in_dpc(move || ci.post_send(client, a, &wrs))?;
    if (posted, status) != (2, IbStatus::Success) {
        return Err(format!("RDMA post: {posted} {status:?}"));
    }
    m.settle()?;
    let done = reap(m, x)?;
    expect_ids(&done, vec![200, 201])?;
    if y.read(4096, 3000)? != written || x.read(4096, 3000)? != written {
        return Err("RDMA write/read bytes differ".to_owned());
    }
    summary.bytes_checked += 6000;
    summary.completions += done.len();
    summary.lines.push(format!(
        "RC {qpn_a:#x} <-> {qpn_b:#x}: {} sends each way ({} bytes), RDMA write and read of 3000 bytes, all checked",
        RC_SENDS.len(),
        RC_SENDS.iter().sum::<u32>()
    ));

    Ok((a, qpn_a, b, qpn_b))
}

/// RC SENDs both ways over the connected pair, every byte checked.
fn rc_sends(
    m: &Machine,
    sides: &[Side],
    pair: RcPair,
    summary: &mut Summary,
) -> Result<(), String> {
    let (x, y) = (&sides[0], &sides[1]);
    let (a, _, b, _) = pair;
    // SENDs both ways: each side receives into slots of 4 KiB at 8 KiB.
    for (from, to, qp_from, qp_to, seed) in [(x, y, a, b, 1u8), (y, x, b, a, 101u8)] {
        let recvs: Vec<RecvWr<'static>> = (0..RC_SENDS.len())
            .map(|i| -> Result<RecvWr<'static>, String> {
                Ok(RecvWr {
                    wr_id: 500 + i as u64,
                    sg_list: leak(vec![to.sge(8192 + i * 1024, 4096)?]),
                })
            })
            .collect::<Result<_, _>>()?;
        let (ci, client) = (to.al.clone(), to.handle);
        let (posted, status) = m.in_dpc(move || ci.post_recv(client, qp_to, &recvs))?;
        if (posted, status) != (RC_SENDS.len(), IbStatus::Success) {
            return Err(format!("post_recv: {posted} {status:?}"));
        }
        let mut sends = Vec::new();
        let mut offset = 0;
        let mut expected = Vec::new();
        for (i, &len) in RC_SENDS.iter().enumerate() {
            let bytes = pattern(seed.wrapping_add(i as u8), len as usize);
            from.write(offset, &bytes)?;
            sends.push(SendWr {
                wr_id: 100 + i as u64,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: leak(vec![from.sge(offset, len)?]),
                ud: None,
            });
            expected.push((8192 + i * 1024, bytes));
            offset += len as usize;
        }
        let (ci, client) = (from.al.clone(), from.handle);
        let (posted, status) = m.in_dpc(move || ci.post_send(client, qp_from, &sends))?;
        if (posted, status) != (RC_SENDS.len(), IbStatus::Success) {
            return Err(format!("post_send: {posted} {status:?}"));
        }
        m.settle()?;
        let sent = reap(m, from)?;
        expect_ids(&sent, (100..100 + RC_SENDS.len() as u64).collect())?;
        let got = reap(m, to)?;
        expect_ids(&got, (500..500 + RC_SENDS.len() as u64).collect())?;
        // Slot i starts at 8192 + i KiB; every message but the last is at
        // most 1 KiB, so no message overwrote another.
        for wc in &got {
            let i = (wc.wr_id - 500) as usize;
            let (at, bytes) = &expected[i];
            if wc.byte_len != RC_SENDS[i] || to.read(*at, bytes.len())? != *bytes {
                return Err(format!(
                    "RC send {i}: {} bytes, payload differs",
                    wc.byte_len
                ));
            }
        }
        summary.bytes_checked += RC_SENDS.iter().map(|&l| u64::from(l)).sum::<u64>();
        summary.completions += sent.len() + got.len();
    }

    Ok(())
}

/// The UD pair: (QP on X, its number, QP on Y, its number, X's AV to Y).
type UdPair = (u64, u32, u64, u32, u64);

fn ud_traffic(m: &Machine, sides: &[Side], summary: &mut Summary) -> Result<UdPair, String> {
    let (x, y) = (&sides[0], &sides[1]);
    let (ua, qpn_ua) = create_qp(m, x, QpType::Ud)?;
    let (ub, qpn_ub) = create_qp(m, y, QpType::Ud)?;
    for (side, qp) in [(x, ua), (y, ub)] {
        let init = QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(port1()?),
            qkey: Some(QKey::new(UD_QKEY)),
            ..QpModify::default()
        };
        m.call::<ModifyQp>(side, qp, &init)?;
        m.call::<ModifyQp>(side, qp, &QpModify::to_state(QpState::Rtr))?;
        let rts = QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(7).map_err(|e| e.to_string())?),
            ..QpModify::default()
        };
        m.call::<ModifyQp>(side, qp, &rts)?;
    }
    // The AV is a CI object; the fast path resolves its handle.
    let (av, _) = m.call::<CreateAv>(x, x.pd, &av_to(y.ip)?)?;
    let pair = (ua, qpn_ua, ub, qpn_ub, av);
    ud_datagram(m, sides, pair, 77, summary)?;
    Ok(pair)
}

/// One 900-byte datagram from X to Y through the AV, checked after the
/// 40-byte GRH.
fn ud_datagram(
    m: &Machine,
    sides: &[Side],
    pair: UdPair,
    seed: u8,
    summary: &mut Summary,
) -> Result<(), String> {
    let (x, y) = (&sides[0], &sides[1]);
    let (ua, qpn_ua, ub, qpn_ub, av) = pair;
    let datagram = pattern(seed, 900);
    x.write(12288, &datagram)?;
    let recv = vec![RecvWr {
        wr_id: 61,
        sg_list: leak(vec![y.sge(12288, 40 + 1024)?]),
    }];
    let (ci, client) = (y.al.clone(), y.handle);
    let (posted, status) = m.in_dpc(move || ci.post_recv(client, ub, &recv))?;
    if (posted, status) != (1, IbStatus::Success) {
        return Err(format!("UD post_recv: {posted} {status:?}"));
    }
    let send = vec![SendWr {
        wr_id: 62,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: leak(vec![x.sge(12288, 900)?]),
        ud: Some(UdDest {
            av: AvHandle::from_raw(av),
            remote_qpn: Qpn::new(qpn_ub).map_err(|e| e.to_string())?,
            remote_qkey: QKey::new(UD_QKEY),
        }),
    }];
    let (ci, client) = (x.al.clone(), x.handle);
    let (posted, status) = m.in_dpc(move || ci.post_send(client, ua, &send))?;
    if (posted, status) != (1, IbStatus::Success) {
        return Err(format!("UD post_send: {posted} {status:?}"));
    }
    m.settle()?;
    let sent = reap(m, x)?;
    expect_ids(&sent, vec![62])?;
    let got = reap(m, y)?;
    expect_ids(&got, vec![61])?;
    let wc = got[0];
    if wc.byte_len != 940 || wc.src_qp.get() != qpn_ua {
        return Err(format!("UD receive: {wc:?}"));
    }
    // The receiver gets the 40-byte GRH first.
    if y.read(12288 + 40, 900)? != datagram {
        return Err("UD payload differs".to_owned());
    }
    summary.bytes_checked += 900;
    summary.completions += 2;
    summary.lines.push(format!(
        "UD {qpn_ua:#x} -> {qpn_ub:#x} through an AV handle: 900 bytes after the 40-byte GRH, checked"
    ));
    Ok(())
}

/// The summary as the main job prints it.
pub(crate) fn render(seed: u64, summary: &Summary) -> String {
    let mut out = format!(
        "\n== simulated Windows host with the real miniport and bus filter (seed {seed}) ==\n"
    );
    for line in &summary.lines {
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(
        out,
        "{} payload bytes checked, {} work completions polled through the AL",
        summary.bytes_checked, summary.completions
    );
    out
}
