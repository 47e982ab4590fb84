//! The machine the swarm drives: a deterministic simulated Windows host
//! with two HCAs on one seeded fabric, the real miniport and the real bus
//! filter (`ibalbus`) bound from `inf/`, and a kernel client of each HCA's
//! port-1 child that gets the child's AL interface
//! (`IRP_MN_QUERY_INTERFACE`, `GUID_IB_AL_INTERFACE`) and its DMA adapter
//! (the HCA's own) and opens the AL — the same boot as the AL-client scenario's
//! (`tests/tests/miniport_stack/run.rs`), but with the fabric's faults from the
//! seed and every control verb submitted asynchronously from a DPC so the
//! workload can run while commands are outstanding.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use driver_platform::{CommonBuffer, DmaAdapter, RequestorMode};
use hca_miniport_core::init::HcaConfig;
use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::cq::CqNotify;
use ib_types::event::{AsyncEventRecord, EventSubject};
use ib_types::interface::{AL_INTERFACE_VERSION, GUID_IB_AL_INTERFACE};
use ib_types::ioctl::{Verb, decode_response, encode_request, request_len, response_len};
use ib_types::mr::PhysMrRegister;
use ib_types::scalars::{Gid, Lid, PKey, PortNum};
use ib_types::status::{IbStatus, NtStatus};
use ib_types::wc::WorkCompletion;
use ib_types::wr::{LKey, RKey, RecvWr, SendWr};
use sim_hca::device::DeviceConfig;
use sim_hca::fabric::FabricConfig;
use sim_host::dma::{DmaLeak, HostCommonBuffer, HostDmaAdapter};
use sim_host::driver::InterfaceRef;
use sim_host::event::HostEvent;
use sim_host::host::{Host, HostConfig};
use sim_host::memory::PoolBlock;
use sim_host::pci::{
    BUS_INTERFACE_STANDARD_VERSION, BusInterfaceStandard, GUID_BUS_INTERFACE_STANDARD,
};
use sim_host::platform::SimPlatform;
use sim_host::pnp::DevNodeId;
use sim_host::request::{HostRequest, RequestHandle};
use sim_shells::hca_miniport::{MiniportDevice, MiniportDriver};
use sim_shells::ibal_bus::{
    AlClient, AlPortInterface, ClientEvents, DriverObjectReference, IbalBusDevice, IbalBusDriver,
    SimAccessLayer,
};

/// The port client's service, on whose behalf the swarm's kernel clients
/// run (their DPCs, the driver object the AL holds a reference on): the
/// driver a port child binds (`inf/`), as in the main job.
pub(crate) const CLIENT_SERVICE: &str = "ibportclient";

/// The HCAs: node GUID and port 1's IPv4 address.
pub(crate) const HCAS: [(u64, [u8; 4]); 2] = [
    (0x0002_C900_0000_5A01, [10, 9, 0, 1]),
    (0x0002_C900_0000_5A02, [10, 9, 0, 2]),
];

/// Bytes per buffer slot: one message, receive, or RDMA target.
pub(crate) const SLOT: usize = 4096;
/// Slots of registered memory per HCA.
pub(crate) const SLOTS: usize = 64;
/// Slots `0..READ_SOURCE_SLOTS` hold a fixed pattern RDMA READs fetch.
pub(crate) const READ_SOURCE_SLOTS: usize = 2;
/// Slots `READ_SOURCE_SLOTS..FIRST_FREE_SLOT` absorb UC RDMA WRITEs, which
/// complete at the requester before their packets land and so can never
/// target memory that is handed out again.
pub(crate) const FIRST_FREE_SLOT: usize = 4;
/// Bytes of one INLINE send's staged data (more than any QP's granted
/// inline capacity).
pub(crate) const INLINE_STAGE: usize = 1024;
/// Staging entries per HCA, used in turn.
pub(crate) const INLINE_STAGES: usize = 16;

/// Worker threads of the threaded host: two processors, so that two DPCs
/// really run at once (the machine has two cores).
pub(crate) const THREADED_WORKERS: usize = 2;
/// How long the threaded host may take for what the deterministic one
/// bounds by scheduler steps (a request, a queued DPC, bring-up): generous,
/// since the machine is shared.
pub(crate) const REAL_TIME_BOUND: Duration = Duration::from_secs(20);
/// The longest real sleep one [`Machine::run_for`] takes on the threaded
/// host (the workload asks for up to 2 s to wait out a TIME WAIT).
pub(crate) const MAX_REAL_SLEEP: Duration = Duration::from_millis(20);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the client callbacks saw, checked by the swarm after every step.
#[derive(Debug, Default)]
pub(crate) struct EventLog {
    /// CQ handles destroyed (the destroy completed): no completion event
    /// may name one afterwards.
    pub(crate) dead_cqs: HashSet<u64>,
    /// QP handles destroyed: no asynchronous event may name one.
    pub(crate) dead_qps: HashSet<u64>,
    /// Invariant breaches seen inside a callback.
    pub(crate) breaches: Vec<String>,
    /// Completion events, by CQ handle.
    pub(crate) completion_events: u64,
    /// Asynchronous events received.
    pub(crate) async_events: Vec<AsyncEventRecord>,
}

/// The kernel client's AL callbacks on one HCA (its own handles: the AL
/// routes a CQ's or QP's events to its owner only).
pub(crate) struct Client {
    pub(crate) side: usize,
    pub(crate) log: Arc<Mutex<EventLog>>,
}

impl ClientEvents for Client {
    fn completion(&self, cq: u64) {
        let mut log = lock(&self.log);
        log.completion_events += 1;
        if sim_host::irql::current() != driver_platform::Irql::DISPATCH {
            log.breaches.push(format!(
                "HCA {}: completion callback outside DISPATCH_LEVEL",
                self.side
            ));
        }
        if log.dead_cqs.contains(&cq) {
            log.breaches.push(format!(
                "HCA {}: completion event for destroyed CQ {cq:#x}",
                self.side
            ));
        }
    }

    fn async_event(&self, event: &AsyncEventRecord) {
        let mut log = lock(&self.log);
        let dead = match event.code.subject() {
            EventSubject::Qp => log.dead_qps.contains(&event.handle),
            EventSubject::Cq => log.dead_cqs.contains(&event.handle),
            _ => false,
        };
        if dead {
            log.breaches.push(format!(
                "HCA {}: {:?} delivered for destroyed object {:#x}",
                self.side, event.code, event.handle
            ));
        }
        log.async_events.push(*event);
    }
}

/// One open of the AL through a child's AL interface: what the workload
/// calls its verbs on (the AL's `submit` and direct calls, with the
/// client's own handles).
pub(crate) struct AlOpen {
    pub(crate) al: Arc<AlPortInterface>,
    pub(crate) client: AlClient,
}

impl AlOpen {
    /// `AccessLayer::submit`: completes `request` exactly once.
    pub(crate) fn submit(&self, request: HostRequest) -> NtStatus {
        self.al.submit(self.client, request)
    }

    pub(crate) fn post_send(&self, qp: u64, wrs: &[SendWr<'_>]) -> (usize, IbStatus) {
        self.al.post_send(self.client, qp, wrs)
    }

    pub(crate) fn post_recv(&self, qp: u64, wrs: &[RecvWr<'_>]) -> (usize, IbStatus) {
        self.al.post_recv(self.client, qp, wrs)
    }

    pub(crate) fn poll_cq(&self, cq: u64, wcs: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
        self.al.poll_cq(self.client, cq, wcs)
    }

    pub(crate) fn arm_cq(&self, cq: u64, notify: CqNotify) -> Result<(), IbStatus> {
        self.al.arm_cq(self.client, cq, notify)
    }
}

/// One HCA as the client sees it.
pub(crate) struct Side {
    pub(crate) device: Arc<MiniportDevice<SimPlatform>>,
    /// The port-1 IPoIB child the client is a driver of.
    pub(crate) child: DevNodeId,
    /// The child's AL interface reference (given back when the client
    /// lets go).
    pub(crate) interface: Option<InterfaceRef>,
    /// The client's open of the AL.
    pub(crate) ci: Arc<AlOpen>,
    /// The DMA adapter the child gave (the HCA's own, checked).
    pub(crate) adapter: HostDmaAdapter,
    pub(crate) log: Arc<Mutex<EventLog>>,
    pub(crate) ca: u64,
    pub(crate) pd: u64,
    pub(crate) ip: [u8; 4],
    /// The HCA's function on the backplane (its device and fabric node).
    pub(crate) function: usize,
    pub(crate) buffer: Option<HostCommonBuffer>,
    /// Non-paged pool the INLINE sends' data is staged in: an INLINE
    /// SGE is a kernel virtual address of resident memory, which the
    /// provider copies into the WQE (docs/miniport.md `ci`), not a
    /// registered I/O address like the region's.
    pub(crate) inline_block: Option<PoolBlock>,
    /// The next `INLINE_STAGE` entry of `inline_block` to use.
    pub(crate) inline_next: usize,
    pub(crate) mr: u64,
    pub(crate) iova: u64,
    pub(crate) lkey: LKey,
    pub(crate) rkey: RKey,
}

impl Side {
    /// I/O virtual address of byte `offset` of slot `slot`.
    pub(crate) fn addr(&self, slot: usize, offset: usize) -> u64 {
        self.iova + (slot * SLOT + offset) as u64
    }

    pub(crate) fn write(&self, slot: usize, offset: usize, bytes: &[u8]) -> Result<(), String> {
        let buffer = self.buffer.as_ref().ok_or("no buffer")?;
        buffer
            .write(slot * SLOT + offset, bytes)
            .then_some(())
            .ok_or_else(|| "write outside the buffer".to_owned())
    }

    pub(crate) fn read(&self, slot: usize, offset: usize, len: usize) -> Result<Vec<u8>, String> {
        let buffer = self.buffer.as_ref().ok_or("no buffer")?;
        let mut out = vec![0; len];
        buffer
            .read(slot * SLOT + offset, &mut out)
            .then_some(out)
            .ok_or_else(|| "read outside the buffer".to_owned())
    }

    /// Stages `bytes` (at most [`INLINE_STAGE`]) in the kernel pool for an
    /// INLINE send and returns their kernel virtual address. Entries are
    /// used in turn: the provider copies them at the post, long before the
    /// ring of entries comes round.
    pub(crate) fn stage_inline(&mut self, bytes: &[u8]) -> Result<u64, String> {
        let block = self
            .inline_block
            .as_ref()
            .ok_or("no inline staging block")?;
        if bytes.len() > INLINE_STAGE {
            return Err(format!("{} inline bytes to stage", bytes.len()));
        }
        let offset = self.inline_next * INLINE_STAGE;
        self.inline_next = (self.inline_next + 1) % INLINE_STAGES;
        block
            .write(offset, bytes)
            .then_some(block.va() + offset as u64)
            .ok_or_else(|| "write outside the inline staging block".to_owned())
    }

    /// Whether the device failed (catastrophic error or command timeout).
    pub(crate) fn failed(&self) -> bool {
        self.device.hca().is_none_or(|hca| hca.failure().is_some())
    }
}

/// The booted machine.
pub(crate) struct Machine {
    pub(crate) host: Host,
    /// The real bus filter on every HCA stack.
    pub(crate) filter: Arc<IbalBusDriver>,
    /// The port client's driver-object references (the AL holds one per
    /// open client).
    pub(crate) client_references: Arc<AtomicUsize>,
    /// The host runs DPCs on [`THREADED_WORKERS`] OS threads in real time
    /// (`--threaded`) instead of its deterministic scheduler.
    pub(crate) threaded: bool,
    /// The swarm's DPCs running now.
    dpcs_running: Arc<AtomicUsize>,
    /// The swarm's DPCs that started while another one was running.
    dpcs_overlapped: Arc<AtomicU64>,
    pub(crate) driver: Arc<MiniportDriver<SimPlatform>>,
    pub(crate) sides: Vec<Side>,
}

/// A request submitted from a DPC whose completion the swarm awaits.
pub(crate) struct Submitted {
    pub(crate) issuer: RequestHandle,
    pub(crate) verb: &'static str,
    /// A create: the information field is the new handle.
    pub(crate) creates: bool,
}

impl Machine {
    /// Boots the machine with `fabric` between the HCAs, opens a CA with
    /// callbacks, allocates a PD and registers memory on each HCA.
    /// With `threaded` the host is threaded: the HCAs sit back to back on
    /// a lossless fabric (`fabric` is ignored) and time is real.
    pub(crate) fn boot(seed: u64, fabric: FabricConfig, threaded: bool) -> Result<Self, String> {
        let configs = HCAS
            .iter()
            .map(|(guid, ip)| DeviceConfig::with_ports(*guid, &[*ip]))
            .collect();
        let config = if threaded {
            HostConfig {
                seed,
                ..HostConfig::threaded(THREADED_WORKERS, configs)
            }
        } else {
            HostConfig {
                fabric,
                ..HostConfig::deterministic(seed, configs)
            }
        };
        let host = Host::new(config).map_err(|e| e.to_string())?;
        // Stand-ins for the port client; the real miniport and the real
        // bus filter replace the stand-ins registered under their names.
        let _stand_ins = sim_host::samples::register_stand_ins(&host);
        let driver = MiniportDriver::register(&host, HcaConfig::default());
        let filter = IbalBusDriver::register(&host);
        host.boot();
        let client_references = host
            .pnp()
            .driver_references(CLIENT_SERVICE)
            .ok_or("the port client is not registered")?;
        let mut m = Machine {
            host,
            filter,
            client_references,
            threaded,
            dpcs_running: Arc::default(),
            dpcs_overlapped: Arc::default(),
            driver,
            sides: Vec::new(),
        };
        m.settle()?;
        if threaded {
            // Bring-up runs on the workers and the device threads: wait
            // (in real time) until both HCAs have started.
            let deadline = Instant::now() + REAL_TIME_BOUND;
            while m.driver.devices().len() != HCAS.len()
                || !m
                    .driver
                    .devices()
                    .iter()
                    .all(|d| matches!(d.started(), Some(Ok(_))))
            {
                if Instant::now() > deadline {
                    return Err("threaded host: the HCAs did not start within 20 s".to_owned());
                }
                std::thread::sleep(Duration::from_millis(1));
                m.settle()?;
            }
        }
        m.settle_tree()?;
        if m.filter.registered_cas().len() != HCAS.len() {
            return Err(format!(
                "the bus filter registered {} CAs, expected {}",
                m.filter.registered_cas().len(),
                HCAS.len()
            ));
        }
        for node in m.host.hcas() {
            let device = m
                .driver
                .devices()
                .into_iter()
                .find(|d| d.node() == node)
                .ok_or("an HCA without a miniport device")?;
            let side = m.attach(device)?;
            m.sides.push(side);
        }
        if m.sides.len() != 2 {
            return Err(format!("{} HCAs, expected 2", m.sides.len()));
        }
        m.sides.sort_by_key(|s| s.ip);
        for i in 0..2 {
            let pd =
                m.call::<ib_types::ioctl::AllocPd>(i, m.sides[i].ca, &ib_types::ioctl::Empty)?;
            m.sides[i].pd = pd.0;
            m.register_memory(i)?;
        }
        Ok(m)
    }

    /// The kernel client takes hold of a started HCA through its port-1
    /// child, as the main job's does: the child's AL interface
    /// (`IRP_MN_QUERY_INTERFACE`) and DMA adapter (the HCA's own), the AL
    /// opened with its callbacks and a reference on the port client's
    /// driver object. The PD and the memory come after.
    fn attach(&self, device: Arc<MiniportDevice<SimPlatform>>) -> Result<Side, String> {
        let node = device.node();
        if !matches!(device.started(), Some(Ok(_))) {
            return Err(format!("bring-up of {node:?}: {:?}", device.started()));
        }
        let function = device.function().ok_or("no PCI function")?.index();
        let (child, interface) = self.port1_child(node)?;
        let al = interface
            .get::<Arc<AlPortInterface>>()
            .ok_or("the AL interface is not an AlPortInterface")?
            .clone();
        let guid = al.port_data().ca_guid.get();
        let side = HCAS
            .iter()
            .position(|(g, _)| *g == guid)
            .ok_or("an unknown CA GUID")?;
        let adapter = self.child_adapter(child)?;
        if device.adapter().map(|a| a.index()) != Some(adapter.index()) {
            return Err(format!(
                "{node:?}: the child's DMA adapter is not the HCA's"
            ));
        }
        let log = Arc::new(Mutex::new(EventLog::default()));
        let client = Arc::new(Client {
            side,
            log: log.clone(),
        });
        let reference = Box::new(DriverObjectReference::new(self.client_references.clone()));
        let opened = al
            .open(reference, client)
            .map_err(|s| format!("AL open: {s:?}"))?;
        Ok(Side {
            device,
            child,
            interface: Some(interface),
            ci: Arc::new(AlOpen { al, client: opened }),
            adapter,
            log,
            ca: opened.ca_handle(),
            pd: 0,
            ip: HCAS[side].1,
            function,
            buffer: None,
            inline_block: None,
            inline_next: 0,
            mr: 0,
            iova: 0,
            lkey: LKey::new(0),
            rkey: RKey::new(0),
        })
    }

    /// The started port-1 IPoIB child of `hca` (the INF's entry, default
    /// P_Key) and the AL interface it answered with (the other children's
    /// given back).
    pub(crate) fn port1_child(&self, hca: DevNodeId) -> Result<(DevNodeId, InterfaceRef), String> {
        let mut found = None;
        // Removed children stay in the tree; a restarted stack reports
        // new devnodes for them.
        let started = self.host.pnp().children(hca).into_iter().filter(|child| {
            self.host.pnp().state(*child) == Some(sim_host::pnp::PnpState::Started)
        });
        for child in started {
            let Some(interface) = self.host.pnp().query_interface(
                child,
                &GUID_IB_AL_INTERFACE,
                AL_INTERFACE_VERSION.packed(),
            ) else {
                continue;
            };
            // The INF's IPoIB entry (default P_Key): the swarm's own
            // entries (knob `child-churn`) come and go on other P_Keys.
            let port1 = interface.get::<Arc<AlPortInterface>>().is_some_and(|al| {
                al.port_data().port.get() == 1 && al.port_data().pkey == PKey::DEFAULT
            });
            if port1 && found.is_none() {
                found = Some((child, interface));
            } else {
                interface.dereference();
            }
        }
        found.ok_or(format!("{hca:?}: no port-1 child answers the AL interface"))
    }

    /// The DMA adapter of a child (`IoGetDmaAdapter` through the bus
    /// interface its PDO forwards to the HCA's).
    fn child_adapter(&self, child: DevNodeId) -> Result<HostDmaAdapter, String> {
        let bus = self
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

    /// Closes the client's AL open on HCA `side` (PASSIVE_LEVEL; the AL
    /// destroys whatever it still owns) and gives the child's interface
    /// back. Its reference on the client's driver object must be released
    /// by then.
    pub(crate) fn close_client(&mut self, side: usize) -> Result<(), String> {
        let before = self.client_references.load(Ordering::SeqCst);
        let drained = Arc::new(HostEvent::new(self.host.scheduler_handle()));
        let open = self.sides[side].ci.clone();
        open.al
            .close(open.client, drained)
            .map_err(|s| format!("AL close of HCA {side}'s client: {s:?}"))?;
        if self.client_references.load(Ordering::SeqCst) + 1 != before {
            return Err(format!(
                "AL close of HCA {side}'s client: its driver-object reference not released"
            ));
        }
        if let Some(interface) = self.sides[side].interface.take() {
            interface.dereference();
        }
        Ok(())
    }

    /// The kernel client lets go of HCA `side`, which failed, as a port
    /// client does on the surprise removal that follows
    /// `WdfDeviceSetFailed`: its memory deregistered and freed, the PD
    /// deallocated (on a failed device the freeing verbs succeed), the AL
    /// closed and the child's AL interface given back, so the PnP manager
    /// can remove the stack and start it again. The caller has destroyed
    /// the QPs, CQs and AVs.
    pub(crate) fn let_go(&mut self, side: usize) -> Result<(), String> {
        self.deregister_memory(side)?;
        let pd = self.sides[side].pd;
        self.call::<ib_types::ioctl::DeallocPd>(side, pd, &ib_types::ioctl::Empty)?;
        self.close_client(side)
    }

    /// After the PnP manager restarted the stack of HCA `side` (a new
    /// device object and core on the same devnode, the filter bound again
    /// and its children reported): the client queries the AL interface of
    /// the port-1 child again, opens the AL, allocates a PD
    /// and registers memory again. The event log is a new one: handles of
    /// the new core may repeat the old core's.
    pub(crate) fn reattach(&mut self, side: usize) -> Result<(), String> {
        let node = self.sides[side].device.node();
        let old = self.sides[side].device.clone();
        let device = self
            .driver
            .devices()
            .into_iter()
            .find(|d| d.node() == node && !Arc::ptr_eq(d, &old) && d.hca().is_some())
            .ok_or_else(|| format!("HCA {side} was not restarted after its failure"))?;
        self.settle_tree()?;
        let fresh = self.attach(device)?;
        if fresh.ip != self.sides[side].ip {
            return Err(format!("the restarted HCA {side} has another CA GUID"));
        }
        self.sides[side] = fresh;
        let pd = self.call::<ib_types::ioctl::AllocPd>(
            side,
            self.sides[side].ca,
            &ib_types::ioctl::Empty,
        )?;
        self.sides[side].pd = pd.0;
        self.register_memory(side)
    }

    /// Settles, then lets the PnP manager enumerate the children the filter
    /// reported and settles again (their stacks start). Threaded: until
    /// every HCA's port-1 child answers the AL interface.
    pub(crate) fn settle_tree(&self) -> Result<(), String> {
        let deadline = Instant::now() + REAL_TIME_BOUND;
        loop {
            self.settle()?;
            self.host.pnp().process_bus_relations();
            self.settle()?;
            let ready = self.host.hcas().into_iter().all(|hca| {
                self.port1_child(hca)
                    .map(|(_, interface)| interface.dereference())
                    .is_ok()
            });
            if ready || !self.threaded {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("threaded host: the port children did not start within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Runs the scheduler until nothing is ready and no timer is armed
    /// (threaded: waits until nothing is queued or running; a panic on a
    /// worker is an error).
    pub(crate) fn settle(&self) -> Result<(), String> {
        if self.threaded {
            return self.host.scheduler().quiesce().map_err(|e| e.to_string());
        }
        self.host
            .scheduler()
            .run_until_idle(1_000_000)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Lets `ns` of time pass: deterministic, runs what falls due within
    /// `ns` of virtual time (at most `max_steps` items); threaded, sleeps
    /// that long (at most [`MAX_REAL_SLEEP`]) while the workers and the
    /// devices run, then waits for the queued DPCs.
    pub(crate) fn run_for(&self, ns: u64, max_steps: usize) -> Result<(), String> {
        if self.threaded {
            std::thread::sleep(Duration::from_nanos(ns).min(MAX_REAL_SLEEP));
            return self.settle();
        }
        self.host
            .scheduler()
            .run_for(ns, max_steps)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Makes progress: deterministic, runs one item (`false` when nothing
    /// is ready and no timer is armed); threaded, waits for the queued
    /// DPCs and yields a moment to the devices.
    pub(crate) fn run_one(&self) -> Result<bool, String> {
        if self.threaded {
            self.settle()?;
            std::thread::sleep(Duration::from_micros(20));
            return Ok(true);
        }
        self.host
            .scheduler()
            .run_one()
            .map(|ran| ran.is_some())
            .map_err(|e| e.to_string())
    }

    /// Makes progress until `done` holds: deterministic, within `max_steps`
    /// items; threaded, within [`REAL_TIME_BOUND`].
    pub(crate) fn run_until(
        &self,
        what: &str,
        max_steps: usize,
        done: impl Fn() -> bool,
    ) -> Result<(), String> {
        let deadline = Instant::now() + REAL_TIME_BOUND;
        let mut steps = 0;
        while !done() {
            let bounded = if self.threaded {
                Instant::now() < deadline
            } else {
                steps < max_steps
            };
            if !bounded || !self.run_one()? {
                return if done() {
                    Ok(())
                } else if bounded {
                    Err(format!("{what}: never completed (nothing left to run)"))
                } else if self.threaded {
                    Err(format!(
                        "{what}: not completed within {REAL_TIME_BOUND:?} (threaded host)"
                    ))
                } else {
                    Err(format!(
                        "{what}: not completed within {max_steps} scheduler steps"
                    ))
                };
            }
            steps += 1;
        }
        Ok(())
    }

    /// Queues `f` as a DPC of the port client (DISPATCH_LEVEL); the
    /// scheduler runs it when it picks it.
    pub(crate) fn queue_dpc(&self, f: impl FnOnce() + Send + 'static) {
        let (running, overlapped) = (self.dpcs_running.clone(), self.dpcs_overlapped.clone());
        self.host
            .scheduler_handle()
            .queue_dpc(CLIENT_SERVICE, move || {
                // Counts how often the threaded host really runs two of the
                // swarm's DPCs at once (the deterministic one never does).
                if running.fetch_add(1, Ordering::SeqCst) > 0 {
                    overlapped.fetch_add(1, Ordering::Relaxed);
                }
                f();
                running.fetch_sub(1, Ordering::SeqCst);
            });
    }

    /// Runs `f` in a DPC of the port client and returns its result.
    pub(crate) fn in_dpc<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, String> {
        let out = Arc::new(Mutex::new(None));
        let sink = out.clone();
        self.queue_dpc(move || *lock(&sink) = Some(f()));
        self.run_until("a queued DPC", 100_000, || lock(&out).is_some())?;
        let result = lock(&out).take();
        result.ok_or_else(|| "the DPC did not run".to_owned())
    }

    /// The access layer of HCA `side`'s filter, while its CA is bound.
    pub(crate) fn access_layer(&self, side: usize) -> Option<Arc<SimAccessLayer>> {
        let guid = HCAS[side].0;
        self.filter
            .devices()
            .into_iter()
            .filter(|d| {
                d.bound()
                    .is_some_and(|b| b.identity().ca_guid.get() == guid)
            })
            .find_map(|d| d.access_layer())
    }

    /// The bus filter's device on HCA `side`'s stack now (the newest: a
    /// restarted stack has a new one).
    pub(crate) fn filter_device(&self, side: usize) -> Option<Arc<IbalBusDevice>> {
        let guid = HCAS[side].0;
        self.filter.devices().into_iter().rev().find(|d| {
            d.bound()
                .is_some_and(|b| b.identity().ca_guid.get() == guid)
        })
    }

    /// Bus addresses of the common buffers live now on HCA `side`'s DMA
    /// adapter: the miniport's CQ and QP rings among them, so an object
    /// the CA destroyed has given its rings back.
    pub(crate) fn live_buffers(&self, side: usize) -> HashSet<u64> {
        self.sides[side]
            .adapter
            .leaks()
            .into_iter()
            .filter_map(|leak| match leak {
                DmaLeak::CommonBuffer { bus, .. } => Some(bus),
                DmaLeak::Mapping { .. } => None,
            })
            .collect()
    }

    /// How many of the swarm's DPCs started while another was running.
    pub(crate) fn overlapping_dpcs(&self) -> u64 {
        self.dpcs_overlapped.load(Ordering::Relaxed)
    }

    /// Submits verb `V` to HCA `side` from a DPC through the AL's
    /// `submit` (the client's handles); the request completes whenever
    /// the AL, the device and the scheduler get to it.
    pub(crate) fn submit<V: Verb>(
        &self,
        side: usize,
        handle: u64,
        input: &V::In,
        private: &[u8],
    ) -> Result<Submitted, String> {
        let open = self.sides[side].ci.clone();
        self.submit_on::<V>(&open, handle, input, private)
    }

    /// Submits verb `V` on the AL open `open` (any client's) from a DPC.
    pub(crate) fn submit_on<V: Verb>(
        &self,
        open: &Arc<AlOpen>,
        handle: u64,
        input: &V::In,
        private: &[u8],
    ) -> Result<Submitted, String> {
        let mut bytes = vec![0; request_len::<V>(private.len()).ok_or("request size")?];
        encode_request::<V>(handle, input, private, 0, &mut bytes).map_err(|e| e.to_string())?;
        let out_len = response_len::<V>(0).ok_or("response size")?;
        let (request, issuer) = HostRequest::new(
            self.host.verifier(),
            V::ID.ioctl().raw(),
            RequestorMode::Kernel,
            bytes,
            out_len,
        );
        let ci = open.clone();
        self.queue_dpc(move || {
            ci.submit(request);
        });
        Ok(Submitted {
            issuer,
            verb: V::ID.name(),
            creates: V::ID.creates().is_some(),
        })
    }

    /// Runs the scheduler (one item at a time, virtual time jumping to the
    /// next timer when nothing is ready) until `submitted` completes.
    pub(crate) fn wait(&self, submitted: &Submitted) -> Result<(), String> {
        self.run_until(submitted.verb, 2_000_000, || {
            submitted.issuer.completion().is_some()
        })
    }

    /// Submits `V` and waits for it; its status and output.
    pub(crate) fn call_status<V: Verb>(
        &self,
        side: usize,
        handle: u64,
        input: &V::In,
        private: &[u8],
    ) -> Result<(IbStatus, u64, Option<V::Out>), String> {
        let submitted = self.submit::<V>(side, handle, input, private)?;
        self.wait(&submitted)?;
        decode::<V>(&submitted)
    }

    /// Submits `V` on `open` and waits for it; its status and output.
    pub(crate) fn call_on<V: Verb>(
        &self,
        open: &Arc<AlOpen>,
        handle: u64,
        input: &V::In,
        private: &[u8],
    ) -> Result<(IbStatus, u64, Option<V::Out>), String> {
        let submitted = self.submit_on::<V>(open, handle, input, private)?;
        self.wait(&submitted)?;
        decode::<V>(&submitted)
    }

    /// [`Self::call_status`] that requires success.
    pub(crate) fn call<V: Verb>(
        &self,
        side: usize,
        handle: u64,
        input: &V::In,
    ) -> Result<(u64, Option<V::Out>), String> {
        match self.call_status::<V>(side, handle, input, &[])? {
            (IbStatus::Success, handle, out) => Ok((handle, out)),
            (status, _, _) => Err(format!("{}: {status:?}", V::ID.name())),
        }
    }

    /// A common buffer of HCA `side`'s adapter registered physically
    /// through the CI (`RegPhysMr`), the first slots filled with the
    /// pattern RDMA READs fetch.
    fn register_memory(&mut self, side: usize) -> Result<(), String> {
        let bytes = SLOTS * SLOT;
        let adapter = self.sides[side].adapter.clone();
        let buffer = adapter
            .alloc_common(bytes)
            .map_err(|s| format!("common buffer: {s:?}"))?;
        let bus = buffer.bus_address();
        let pages = bytes / 4096;
        let input = PhysMrRegister {
            iova: bus,
            length: bytes as u64,
            first_byte_offset: 0,
            page_shift: 12,
            num_pages: pages as u32,
            access: region_access(),
        };
        let list: Vec<u8> = (0..pages as u64)
            .flat_map(|i| (bus + i * 4096).to_le_bytes())
            .collect();
        self.sides[side].buffer = Some(buffer);
        self.sides[side].inline_block = Some(
            self.host
                .pool()
                .alloc("swarm", *b"Swil", INLINE_STAGE * INLINE_STAGES)
                .map_err(|e| format!("inline staging block: {e:?}"))?,
        );
        let (status, mr, out) = self.call_status::<ib_types::ioctl::RegPhysMr>(
            side,
            self.sides[side].pd,
            &input,
            &list,
        )?;
        let out = match (status, out) {
            (IbStatus::Success, Some(out)) => out,
            (status, _) => return Err(format!("RegPhysMr: {status:?}")),
        };
        let s = &mut self.sides[side];
        s.mr = mr;
        s.iova = out.iova;
        s.lkey = out.keys.lkey;
        s.rkey = out.keys.rkey;
        let source = read_source_pattern();
        s.write(0, 0, &source)
    }

    /// Deregisters and frees HCA `side`'s memory.
    pub(crate) fn deregister_memory(&mut self, side: usize) -> Result<(), String> {
        let mr = self.sides[side].mr;
        let (status, _, _) =
            self.call_status::<ib_types::ioctl::DeregMr>(side, mr, &ib_types::ioctl::Empty, &[])?;
        if status != IbStatus::Success {
            return Err(format!("DeregMr: {status:?}"));
        }
        if let Some(buffer) = self.sides[side].buffer.take() {
            self.sides[side].adapter.free_common(buffer);
        }
        if let Some(block) = self.sides[side].inline_block.take() {
            self.host.pool().free(block);
        }
        Ok(())
    }
}

/// The response of a completed request.
pub(crate) fn decode<V: Verb>(
    submitted: &Submitted,
) -> Result<(IbStatus, u64, Option<V::Out>), String> {
    let done = submitted
        .issuer
        .completion()
        .ok_or_else(|| format!("{}: not completed", submitted.verb))?;
    // The AL completes a request it refuses at once, with no response:
    // its NTSTATUS is the answer.
    if !done.status.is_success() && done.information == 0 {
        return Ok((IbStatus::from_ntstatus(done.status), 0, None));
    }
    // A create's information is the new handle, else the response's
    // length (docs/ibal-bus.md "Verbs as requests").
    let len = if submitted.creates {
        done.output.len()
    } else {
        usize::try_from(done.information).unwrap_or(usize::MAX)
    };
    let bytes = done.output.get(..len).ok_or("information too large")?;
    let response = decode_response::<V>(bytes)
        .map_err(|e| format!("{}: {:?}: {e}", submitted.verb, done.status))?;
    Ok((response.status, response.handle, response.output))
}

/// What the registered memory allows.
pub(crate) fn region_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ
}

/// The bytes of the RDMA READ source slots.
pub(crate) fn read_source_pattern() -> Vec<u8> {
    (0..READ_SOURCE_SLOTS * SLOT)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add((i >> 8) as u8))
        .collect()
}

/// An address vector to port 1 at `ip`.
pub(crate) fn av_to(ip: [u8; 4]) -> Result<AvAttr, String> {
    Ok(AvAttr {
        port: port1()?,
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

pub(crate) fn port1() -> Result<PortNum, String> {
    PortNum::new(1).map_err(|e| e.to_string())
}
