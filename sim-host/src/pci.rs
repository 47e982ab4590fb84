//! The PCI bus and the simulated HCA functions on it.
//!
//! **Windows.** The PCI bus driver enumerates functions from configuration
//! space and reports them as children with hardware IDs
//! `PCI\VEN_v&DEV_d&REV_r`, `PCI\VEN_v&DEV_d` and compatible IDs by class
//! code; the PnP manager assigns their resources (memory BARs, MSI-X
//! messages) and hands them to the function driver in the start request
//! (`EvtDevicePrepareHardware`'s raw and translated resource lists). The
//! function driver maps the BAR, connects an ISR per message
//! (`WdfInterruptCreate`), and asks for a DMA adapter (`IoGetDmaAdapter` /
//! `WdfDmaEnablerCreate`), which is when its device can master the bus.
//!
//! **Model.** The [`Backplane`] holds the devices of the `sim-hca` model on
//! their fabric, stepped one of two ways: under the deterministic
//! scheduler (a host task advances the [`Cluster`] to the scheduler's
//! clock; the devices' own deadlines become scheduler timers), in
//! threaded mode on a [`FastFabric`] with a timer thread, or in threaded
//! mode on the [`UdpFabric`], each port a real UDP endpoint (its receive
//! threads and its timer thread deliver the interrupts the devices raise,
//! as the timer thread does on the fast fabric). Each function's
//! device reaches host memory only through its [`DmaPort`], which faults
//! every access until the driver has a DMA adapter. A driver creates one
//! interrupt object per message ([`PciFunction::create_interrupt`]); the
//! PnP manager connects them after the driver's D0 entry and disconnects
//! them before its D0 exit, as KMDF does. Interrupts the device raises are
//! delivered to the connected object's ISR at device IRQL in the driver's
//! context, after the device access that raised them returns (the device
//! is never re-entered from its own interrupt); one raised while its
//! message is not connected is lost. Each object has its own DPC and its
//! interrupt lock ([`HostInterrupt::acquire_lock`]). In D3, after a
//! surprise removal, and through a mapping its driver gave up, BAR0 reads
//! all ones and drops writes; the device is reset when it goes to D3 or
//! away ([`Bar0`]; `docs/host-model.md`).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use driver_platform::{ChildBus, ChildDescription, Irql, Mmio, RegValue};
use ib_types::interface::WinGuid;
use ib_types::status::NtStatus;
use sim_hca::cluster::{Cluster, ClusterError, NodeId};
use sim_hca::device::{Device, DeviceConfig};
use sim_hca::fabric::FabricConfig;
use sim_hca::fast::FastFabric;
use sim_hca::host::{CopyFault, DmaDirection, DmaFault, HostMemory, InterruptSink, bounce_copy};
use sim_hca::udp::{PortAddress, UdpFabric};

use crate::context::{self, Context};
use crate::dma::{DeviceDma, DmaDescription, DmaRemapping, HostDmaAdapter, Iommu};
use crate::driver::{
    DeviceCallbacks, DeviceInit, DriverEntry, INVALID_PARAMETER, NO_SUCH_DEVICE, ProvidedInterface,
    SUCCESS,
};
use crate::irql::IrqlGuard;
use crate::pnp::DeviceServices;
use crate::registry::{RegistryStore, device_parameters_key, service_parameters_key};
use crate::sched::{DeviceDeferred, SchedulerHandle, TimerId};
use crate::verifier::{Verifier, ViolationKind};

/// Hardware ID of the PCI Express root bus the host enumerates at boot.
pub const PCI_ROOT_HARDWARE_ID: &str = "ACPI\\PNP0A08";
/// Service name of the host's built-in PCI bus driver.
pub const PCI_SERVICE: &str = "pci";
/// The device IRQL at which every HCA ISR runs.
pub const HCA_DIRQL: Irql = Irql::device(5);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a test already panicked; keep going so the
    // original panic is the one reported.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A function's path to host memory: every access faults (and is
/// reported) until its driver gets a DMA adapter, then goes through that
/// adapter's IOMMU table.
#[derive(Debug)]
pub struct DmaPort {
    verifier: Verifier,
    view: RwLock<Option<DeviceDma>>,
    faults_before_adapter: AtomicU64,
}

impl DmaPort {
    /// A port with bus mastering off.
    pub fn new(verifier: Verifier) -> Arc<Self> {
        Arc::new(Self {
            verifier,
            view: RwLock::new(None),
            faults_before_adapter: AtomicU64::new(0),
        })
    }

    fn attach(&self, view: Option<DeviceDma>) {
        *self.view.write().unwrap_or_else(|e| e.into_inner()) = view;
    }

    /// Accesses refused because no adapter was attached.
    pub fn faults_before_adapter(&self) -> u64 {
        self.faults_before_adapter.load(Ordering::Relaxed)
    }

    fn with_view<R>(
        &self,
        addr: u64,
        len: usize,
        direction: DmaDirection,
        f: impl FnOnce(&DeviceDma) -> Result<R, DmaFault>,
    ) -> Result<R, DmaFault> {
        let view = self.view.read().unwrap_or_else(|e| e.into_inner());
        match view.as_ref() {
            Some(view) => f(view),
            None => {
                drop(view);
                Err(self.fault_without_adapter(addr, len, direction))
            }
        }
    }

    /// Counts and reports an access refused because no adapter is
    /// attached.
    #[cold]
    fn fault_without_adapter(&self, addr: u64, len: usize, direction: DmaDirection) -> DmaFault {
        self.faults_before_adapter.fetch_add(1, Ordering::Relaxed);
        self.verifier
            .report(None, ViolationKind::DmaFault { addr, len });
        DmaFault {
            addr,
            len,
            direction,
        }
    }
}

impl HostMemory for DmaPort {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), DmaFault> {
        let len = buf.len();
        self.with_view(addr, len, DmaDirection::Read, |v| v.read(addr, buf))
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<(), DmaFault> {
        self.with_view(addr, data.len(), DmaDirection::Write, |v| {
            v.write(addr, data)
        })
    }

    /// Through the adapter's table, touching nothing; without an adapter
    /// the first piece faults, as its access would.
    fn probe(
        &self,
        pieces: &[(u64, usize)],
        direction: DmaDirection,
    ) -> Option<Result<(), (usize, DmaFault)>> {
        let Some(&(addr, len)) = pieces.first() else {
            return Some(Ok(()));
        };
        let mut refused = 0;
        let probed = self.with_view(addr, len, direction, |v| {
            v.probe_pieces(pieces, direction).map_err(|(i, fault)| {
                refused = i;
                fault
            })
        });
        Some(probed.map_err(|fault| (refused, fault)))
    }

    /// Between two functions' ports: frame to frame through both adapters'
    /// tables (`DeviceDma::copy_pages_to`), with the same faults as a read
    /// then a write; to any other memory, a read then a write.
    fn copy_to(
        &self,
        from: u64,
        dest: &dyn HostMemory,
        to: u64,
        len: usize,
    ) -> Result<(), CopyFault> {
        let Some(dest_port) = dest.as_any().and_then(|d| d.downcast_ref::<DmaPort>()) else {
            return bounce_copy(self, from, dest, to, len);
        };
        // Both views (shared) in address order, as `DeviceDma` takes its
        // tables: `attach` takes one view exclusively, holding no other.
        let same = std::ptr::eq(self, dest_port);
        let (src_view, dst_view);
        if same {
            src_view = self.view.read().unwrap_or_else(|e| e.into_inner());
            dst_view = None;
        } else if (self as *const Self) < (dest_port as *const Self) {
            src_view = self.view.read().unwrap_or_else(|e| e.into_inner());
            dst_view = Some(dest_port.view.read().unwrap_or_else(|e| e.into_inner()));
        } else {
            dst_view = Some(dest_port.view.read().unwrap_or_else(|e| e.into_inner()));
            src_view = self.view.read().unwrap_or_else(|e| e.into_inner());
        }
        let dst = dst_view.as_deref().unwrap_or(&src_view);
        match (src_view.as_ref(), dst.as_ref()) {
            (Some(src), Some(dst)) => src.copy_pages_to(from, dst, to, len),
            // No adapter on a side: its access faults, the source first.
            (None, _) => {
                drop((dst_view, src_view));
                let fault = self.fault_without_adapter(from, len, DmaDirection::Read);
                Err(CopyFault::Source(fault))
            }
            (Some(src), None) => {
                let readable = if len == 0 {
                    Ok(())
                } else {
                    src.probe_pieces(&[(from, len)], DmaDirection::Read)
                };
                drop((dst_view, src_view));
                readable.map_err(|(_, fault)| CopyFault::Source(fault))?;
                let fault = dest_port.fault_without_adapter(to, len, DmaDirection::Write);
                Err(CopyFault::Destination(fault))
            }
        }
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// `EvtInterruptIsr`: runs at [`HCA_DIRQL`] with the message that fired;
/// returns whether to queue the interrupt's DPC
/// (`WdfInterruptQueueDpcForIsr`).
pub type InterruptIsr = Arc<dyn Fn(u16) -> bool + Send + Sync>;

/// `EvtInterruptEnable` / `EvtInterruptDisable`: run at [`HCA_DIRQL`]
/// holding the interrupt's lock (no ISR of the function runs meanwhile).
pub type InterruptCallback = Arc<dyn Fn() -> NtStatus + Send + Sync>;

/// What a driver gives `WdfInterruptCreate` for one MSI-X message.
#[derive(Clone)]
pub struct InterruptConfig {
    /// The message (the vector the device raises) this object serves.
    pub message: u16,
    /// The ISR.
    pub isr: InterruptIsr,
    /// The interrupt's DPC: its DPC routine is the driver's
    /// `EvtInterruptDpc` (the work item and timer of this
    /// [`DeviceDeferred`] are not the interrupt's business). KMDF gives
    /// every interrupt object its own DPC, so two messages' DPCs may run
    /// at once on different processors.
    pub dpc: DeviceDeferred,
    /// `EvtInterruptEnable`, if any.
    pub enable: Option<InterruptCallback>,
    /// `EvtInterruptDisable`, if any.
    pub disable: Option<InterruptCallback>,
}

impl std::fmt::Debug for InterruptConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterruptConfig")
            .field("message", &self.message)
            .finish_non_exhaustive()
    }
}

/// One interrupt object (`WDFINTERRUPT`).
struct InterruptObject {
    driver: Arc<str>,
    config: InterruptConfig,
}

/// One function's MSI-X messages: the vectors raised and not yet
/// delivered, and the interrupt objects its driver created.
#[derive(Default)]
struct InterruptLine {
    pending: Mutex<Vec<u16>>,
    /// Read-held while ISRs run, write-held while a routine synchronised
    /// with them runs (`EvtInterruptEnable`/`Disable`, the interrupt
    /// lock): the model of the interrupt spin lock.
    objects: RwLock<Vec<Arc<InterruptObject>>>,
    /// The messages whose interrupt object is connected (by the PnP
    /// manager after the driver's D0 entry, until before its D0 exit). A
    /// leaf lock: the device raises under its own lock, which a thread
    /// holding `objects` may be waiting for.
    connected: Mutex<BTreeSet<u16>>,
    /// Vectors raised with no interrupt connected (lost, as on hardware).
    unclaimed: AtomicU64,
}

impl InterruptSink for InterruptLine {
    fn raise(&self, vector: u16) {
        // An MSI written while no interrupt is connected goes nowhere.
        if lock(&self.connected).contains(&vector) {
            lock(&self.pending).push(vector);
        } else {
            self.unclaimed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl InterruptLine {
    /// Delivers what is pending, in order: each vector to the ISR of its
    /// connected interrupt object at [`HCA_DIRQL`] in its driver's
    /// context, queueing the object's DPC when the ISR asks. A thread
    /// already at device IRQL (in an ISR, or holding the interrupt lock)
    /// has the interrupt masked: the vectors stay pending and are
    /// delivered when it lowers (see [`InterruptLine::synchronized`]).
    fn deliver(&self, verifier: &Verifier) {
        if crate::irql::current() >= HCA_DIRQL {
            return;
        }
        loop {
            let vectors = std::mem::take(&mut *lock(&self.pending));
            if vectors.is_empty() {
                return;
            }
            let objects = self.objects.read().unwrap_or_else(|e| e.into_inner());
            for vector in vectors {
                // Disconnected since it was raised: lost too.
                let connected = lock(&self.connected).contains(&vector);
                let target = objects
                    .iter()
                    .find(|o| connected && o.config.message == vector);
                let Some(object) = target else {
                    self.unclaimed.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                if !verifier.check_callback(&object.driver, "EvtInterruptIsr") {
                    continue;
                }
                let _context =
                    context::enter(Context::driver(verifier.clone(), object.driver.clone()));
                let _irql = IrqlGuard::at(HCA_DIRQL);
                let claimed = crate::stack::measured(
                    crate::stack::RoutineKind::Isr,
                    "EvtInterruptIsr",
                    || (object.config.isr)(vector),
                );
                if claimed {
                    object.config.dpc.insert_dpc();
                }
            }
        }
    }

    /// Runs `f` at [`HCA_DIRQL`] with every ISR of the line excluded
    /// (`KeSynchronizeExecution`, `WdfInterruptAcquireLock`), then
    /// delivers what was raised meanwhile.
    fn synchronized<R>(&self, verifier: &Verifier, f: impl FnOnce() -> R) -> R {
        let result = {
            let _objects = self.objects.write().unwrap_or_else(|e| e.into_inner());
            let _irql = IrqlGuard::at(HCA_DIRQL);
            f()
        };
        self.deliver(verifier);
        result
    }
}

enum Engine {
    Stepped {
        cluster: Box<Mutex<Cluster>>,
        nodes: Vec<NodeId>,
        sched: SchedulerHandle,
        timer: TimerId,
        queued: AtomicBool,
    },
    Threaded {
        fabric: Arc<FastFabric>,
        stop: Arc<AtomicBool>,
        timer_thread: Mutex<Option<JoinHandle<()>>>,
    },
    /// Threaded, each port a real UDP endpoint; the fabric's own threads
    /// run receives and timers.
    Udp { fabric: UdpFabric },
}

/// The simulated HCAs of one or more hosts on their fabric.
pub struct Backplane {
    engine: Engine,
    lines: Vec<Arc<InterruptLine>>,
    ports: Vec<Arc<DmaPort>>,
    configs: Vec<DeviceConfig>,
    verifier: Verifier,
    this: Weak<Backplane>,
}

impl std::fmt::Debug for Backplane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backplane")
            .field("functions", &self.configs.len())
            .field(
                "mode",
                &match self.engine {
                    Engine::Stepped { .. } => "stepped",
                    Engine::Threaded { .. } => "threaded",
                    Engine::Udp { .. } => "udp",
                },
            )
            .finish_non_exhaustive()
    }
}

impl Backplane {
    /// Devices on a [`Cluster`] (fabric faults and all, seeded), stepped by
    /// host tasks on `sched`'s deterministic clock.
    pub fn stepped(
        fabric: FabricConfig,
        seed: u64,
        sched: SchedulerHandle,
        configs: Vec<DeviceConfig>,
    ) -> Result<Arc<Self>, ClusterError> {
        let verifier = sched.verifier().clone();
        let mut cluster = Cluster::new(fabric, seed);
        let mut nodes = Vec::with_capacity(configs.len());
        let mut ports = Vec::with_capacity(configs.len());
        for cfg in &configs {
            let port = DmaPort::new(verifier.clone());
            nodes.push(cluster.add_host_node(cfg.clone(), port.clone())?);
            ports.push(port);
        }
        let timer = sched.new_timer();
        Ok(Arc::new_cyclic(|this| Self {
            engine: Engine::Stepped {
                cluster: Box::new(Mutex::new(cluster)),
                nodes,
                sched,
                timer,
                queued: AtomicBool::new(false),
            },
            lines: configs.iter().map(|_| Arc::default()).collect(),
            ports,
            configs,
            verifier,
            this: this.clone(),
        }))
    }

    /// Devices wired back to back (no loss, no delay) and run on the
    /// calling threads, with a timer thread for their deadlines.
    pub fn threaded(verifier: Verifier, configs: Vec<DeviceConfig>) -> std::io::Result<Arc<Self>> {
        let (lines, ports, devices) = Self::devices(&verifier, &configs);
        let fabric = Arc::new(FastFabric::new(devices));
        let stop = Arc::new(AtomicBool::new(false));
        let backplane = Arc::new_cyclic(|this| Self {
            engine: Engine::Threaded {
                fabric: fabric.clone(),
                stop: stop.clone(),
                timer_thread: Mutex::new(None),
            },
            lines,
            ports,
            configs,
            verifier,
            this: this.clone(),
        });
        let weak = Arc::downgrade(&backplane);
        let thread = std::thread::Builder::new()
            .name("hca-timers".into())
            .spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    let next = fabric.run_timers();
                    let Some(backplane) = weak.upgrade() else {
                        return;
                    };
                    backplane.deliver_interrupts();
                    drop(backplane);
                    let wait_ns = next.map_or(1_000_000, |t| t.saturating_sub(fabric.now_ns()));
                    std::thread::sleep(Duration::from_nanos(wait_ns.clamp(10_000, 1_000_000)));
                }
            })?;
        if let Engine::Threaded { timer_thread, .. } = &backplane.engine {
            *lock(timer_thread) = Some(thread);
        }
        Ok(backplane)
    }

    /// Devices whose ports are real UDP endpoints ([`UdpFabric`]): each
    /// port bound at its address of `addresses` (in port order, function
    /// 0's first; ports beyond them choose the first free 127.0.0.x), its
    /// configuration's address replaced by the bound one. Work runs on
    /// the calling threads; the fabric's receive and timer threads deliver
    /// the interrupts they cause.
    pub fn udp(
        verifier: Verifier,
        mut configs: Vec<DeviceConfig>,
        addresses: &[PortAddress],
    ) -> std::io::Result<Arc<Self>> {
        let (lines, ports, devices) = Self::devices(&verifier, &configs);
        let fabric = UdpFabric::new(devices, addresses)?;
        for (node, cfg) in configs.iter_mut().enumerate() {
            for (port, port_cfg) in (1..).zip(cfg.ports.iter_mut()) {
                if let Some(addr) = fabric.address(node, port) {
                    port_cfg.ipv4 = addr.octets();
                }
            }
        }
        let backplane = Arc::new_cyclic(|this| Self {
            engine: Engine::Udp { fabric },
            lines,
            ports,
            configs,
            verifier,
            this: this.clone(),
        });
        if let Engine::Udp { fabric } = &backplane.engine {
            let weak = Arc::downgrade(&backplane);
            fabric.set_on_activity(Arc::new(move || {
                if let Some(backplane) = weak.upgrade() {
                    backplane.deliver_interrupts();
                }
            }));
        }
        Ok(backplane)
    }

    /// The devices of `configs`, each with its interrupt line and DMA port.
    #[allow(
        clippy::type_complexity,
        reason = "three parallel lists, one entry per function"
    )]
    fn devices(
        verifier: &Verifier,
        configs: &[DeviceConfig],
    ) -> (Vec<Arc<InterruptLine>>, Vec<Arc<DmaPort>>, Vec<Device>) {
        let lines: Vec<Arc<InterruptLine>> = configs.iter().map(|_| Arc::default()).collect();
        let ports: Vec<Arc<DmaPort>> = configs
            .iter()
            .map(|_| DmaPort::new(verifier.clone()))
            .collect();
        let devices = configs
            .iter()
            .zip(&ports)
            .zip(&lines)
            .map(|((cfg, port), line)| {
                Device::new(
                    cfg.clone(),
                    port.clone() as Arc<dyn HostMemory>,
                    line.clone() as Arc<dyn InterruptSink>,
                )
            })
            .collect();
        (lines, ports, devices)
    }

    /// The address port `port` (1-based) of function `index` is bound to,
    /// on the UDP fabric (None on the other engines).
    pub fn udp_address(&self, index: usize, port: u8) -> Option<std::net::Ipv4Addr> {
        match &self.engine {
            Engine::Udp { fabric } => fabric.address(index, port),
            _ => None,
        }
    }

    /// Port `port` (1-based) of function `index`'s datagram counters, on
    /// the UDP fabric (None on the other engines).
    pub fn udp_stats(&self, index: usize, port: u8) -> Option<sim_hca::udp::UdpPortStats> {
        match &self.engine {
            Engine::Udp { fabric } => fabric.stats(index, port),
            _ => None,
        }
    }

    /// Number of HCA functions.
    pub fn len(&self) -> usize {
        self.configs.len()
    }

    /// True with no functions.
    pub fn is_empty(&self) -> bool {
        self.configs.is_empty()
    }

    /// The configuration function `index` was built from.
    pub fn config(&self, index: usize) -> Option<&DeviceConfig> {
        self.configs.get(index)
    }

    /// Runs `f` on device `index` (counters, link control, fault
    /// injection), then lets the fabric and interrupts catch up.
    pub fn with_device<R>(&self, index: usize, f: impl FnOnce(&mut Device) -> R) -> R {
        match &self.engine {
            Engine::Stepped { cluster, nodes, .. } => {
                // Interrupts this raised are delivered by the stepper task,
                // at a point the scheduler's seed chooses.
                let mut cluster = lock(cluster);
                let r = f(cluster.device(nodes[index]));
                self.collect_interrupts(&cluster, nodes);
                drop(cluster);
                self.kick();
                r
            }
            Engine::Threaded { fabric, .. } => {
                let r = fabric.with_device(index, f);
                self.deliver_interrupts();
                r
            }
            Engine::Udp { fabric } => {
                let r = fabric.with_device(index, f);
                self.deliver_interrupts();
                r
            }
        }
    }

    /// Runs `f` on the cluster (stepped mode only): link faults, capture.
    pub fn with_cluster<R>(&self, f: impl FnOnce(&mut Cluster) -> R) -> Option<R> {
        match &self.engine {
            Engine::Stepped { cluster, .. } => {
                let r = f(&mut lock(cluster));
                self.kick();
                Some(r)
            }
            Engine::Threaded { .. } | Engine::Udp { .. } => None,
        }
    }

    fn deliver_interrupts(&self) {
        for line in &self.lines {
            line.deliver(&self.verifier);
        }
    }

    /// Stepped mode: moves the vectors the cluster's devices raised onto
    /// the functions' lines.
    fn collect_interrupts(&self, cluster: &Cluster, nodes: &[NodeId]) {
        for (line, &node) in self.lines.iter().zip(nodes) {
            for vector in cluster.interrupts(node) {
                line.raise(vector);
            }
        }
    }

    /// Stepped mode: makes sure a stepper task is queued.
    fn kick(&self) {
        let Engine::Stepped { sched, queued, .. } = &self.engine else {
            return;
        };
        if !queued.swap(true, Ordering::AcqRel) {
            let this = self.this.clone();
            sched.schedule_task("hca-stepper", move || {
                if let Some(backplane) = this.upgrade() {
                    backplane.step_to_now();
                }
            });
        }
    }

    /// Stepped mode: runs the cluster up to the scheduler's clock, delivers
    /// the interrupts that raised, and arranges to run again at the
    /// cluster's next deadline.
    fn step_to_now(&self) {
        let Engine::Stepped {
            cluster,
            nodes,
            sched,
            timer,
            queued,
        } = &self.engine
        else {
            return;
        };
        queued.store(false, Ordering::Release);
        let now = sched.now_ns();
        let next = {
            let mut cluster = lock(cluster);
            self.collect_interrupts(&cluster, nodes);
            if let Err(limit) = cluster.advance_to(now) {
                self.verifier.report(
                    None,
                    ViolationKind::Protocol {
                        detail: format!("the simulated fabric livelocked: {limit}"),
                    },
                );
            }
            self.collect_interrupts(&cluster, nodes);
            cluster.next_event_ns()
        };
        self.deliver_interrupts();
        match next {
            Some(due) if due <= now => self.kick(),
            Some(due) => {
                let this = self.this.clone();
                sched.schedule_task_at(*timer, "hca-deadline", due, move || {
                    if let Some(backplane) = this.upgrade() {
                        backplane.kick();
                    }
                });
            }
            None => {}
        }
    }

    /// The function at `index` as the PCI bus presents it.
    pub fn function(&self, index: usize, iommu: &Iommu) -> Option<Arc<PciFunction>> {
        let config = self.configs.get(index)?;
        Some(Arc::new(PciFunction {
            backplane: self.this.upgrade()?,
            index,
            bar0_len: hca_prm::regs::bar0_size(config.limits.num_uars),
            message_count: config.limits.num_vectors,
            iommu: iommu.clone(),
            adapter: Mutex::new(None),
            decoding: AtomicBool::new(true),
            present: AtomicBool::new(true),
            mapping: AtomicU64::new(0),
            registry: None,
        }))
    }

    fn mmio(&self, index: usize, op: impl FnOnce(&mut Device) -> u64) -> u64 {
        // The device model's work behind a register is the host's, not
        // the driver's (an interrupt it delivers re-enters the driver).
        let _device = crate::alloc_hook::HostCode::enter();
        self.with_device(index, op)
    }

    /// Faults the devices' DMA ports refused before an adapter existed.
    pub fn faults_before_adapter(&self) -> u64 {
        self.ports.iter().map(|p| p.faults_before_adapter()).sum()
    }

    /// Interrupts raised with no ISR connected.
    pub fn unclaimed_interrupts(&self) -> u64 {
        self.lines
            .iter()
            .map(|l| l.unclaimed.load(Ordering::Relaxed))
            .sum()
    }
}

impl Drop for Backplane {
    fn drop(&mut self) {
        if let Engine::Threaded {
            stop, timer_thread, ..
        } = &self.engine
        {
            stop.store(true, Ordering::Release);
            if let Some(thread) = lock(timer_thread).take()
                && thread.thread().id() != std::thread::current().id()
            {
                let _ = thread.join();
            }
        }
    }
}

/// One HCA function with the resources the PnP manager assigned it: what
/// its function driver finds at `EvtDevicePrepareHardware`
/// (`DeviceServices::resources`).
pub struct PciFunction {
    backplane: Arc<Backplane>,
    index: usize,
    bar0_len: u64,
    message_count: u16,
    iommu: Iommu,
    adapter: Mutex<Option<HostDmaAdapter>>,
    /// The function answers on the bus: not in D3, not surprise-removed.
    decoding: AtomicBool,
    /// Cleared for good by a surprise removal.
    present: AtomicBool,
    /// Bumped when the driver's mappings of BAR0 end (release-hardware):
    /// a [`Bar0`] of an older mapping is stale.
    mapping: AtomicU64,
    /// The registry and the function's instance path, where its INF's DMA
    /// remapping opt-in is read (`None`: a function handed out outside
    /// PnP, taken as opted in).
    registry: Option<(RegistryStore, String)>,
}

impl std::fmt::Debug for PciFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciFunction")
            .field("index", &self.index)
            .field("bar0_len", &self.bar0_len)
            .field("message_count", &self.message_count)
            .finish_non_exhaustive()
    }
}

impl PciFunction {
    /// Position on the backplane.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Hardware IDs, most specific first, as the Windows PCI bus forms
    /// them: with subsystem and revision, with subsystem, with revision,
    /// vendor and device alone.
    pub fn hardware_ids() -> Vec<String> {
        use hca_prm::regs::{
            PCI_DEVICE_ID, PCI_REVISION, PCI_SUBSYSTEM_ID, PCI_SUBSYSTEM_VENDOR_ID, PCI_VENDOR_ID,
        };
        let base = format!("PCI\\VEN_{PCI_VENDOR_ID:04X}&DEV_{PCI_DEVICE_ID:04X}");
        let subsys = format!("SUBSYS_{PCI_SUBSYSTEM_ID:04X}{PCI_SUBSYSTEM_VENDOR_ID:04X}");
        let rev = format!("REV_{PCI_REVISION:02X}");
        vec![
            format!("{base}&{subsys}&{rev}"),
            format!("{base}&{subsys}"),
            format!("{base}&{rev}"),
            base,
        ]
    }

    /// Compatible IDs, most specific first: by class code with and
    /// without the vendor.
    pub fn compatible_ids() -> Vec<String> {
        use hca_prm::regs::{PCI_CLASS_CODE, PCI_VENDOR_ID};
        let [class, subclass, interface] = PCI_CLASS_CODE;
        vec![
            format!("PCI\\VEN_{PCI_VENDOR_ID:04X}&CC_{class:02X}{subclass:02X}{interface:02X}"),
            format!("PCI\\VEN_{PCI_VENDOR_ID:04X}&CC_{class:02X}{subclass:02X}"),
            format!("PCI\\VEN_{PCI_VENDOR_ID:04X}"),
            format!("PCI\\CC_{class:02X}{subclass:02X}{interface:02X}"),
            format!("PCI\\CC_{class:02X}{subclass:02X}"),
        ]
    }

    /// BAR0 mapped for the driver (`MmMapIoSpaceEx`): valid until the
    /// driver's release-hardware returns (`MmUnmapIoSpace`); any access
    /// through it afterwards is a [`ViolationKind::BarAccessAfterUnmap`].
    pub fn bar0(self: &Arc<Self>) -> Bar0 {
        Bar0 {
            function: self.clone(),
            mapping: self.mapping.load(Ordering::Acquire),
            mapped_by: context::current_driver(),
        }
    }

    /// Whether the function answers BAR accesses (in D0 and present).
    pub fn decoding(&self) -> bool {
        self.decoding.load(Ordering::Acquire)
    }

    /// The bus puts the function in D0 (the PnP manager, before the
    /// stack's D0 entry): it decodes its BAR again, and comes up from
    /// reset. A surprise-removed function stays gone.
    pub(crate) fn enter_d0(&self) {
        if self.present.load(Ordering::Acquire) {
            self.decoding.store(true, Ordering::Release);
        }
    }

    /// The bus puts the function in D3 (the PnP manager, after the
    /// stack's D0 exit): it stops decoding its BAR (reads return all
    /// ones, writes are dropped) and loses its state: the device is
    /// reset, as power removal would.
    pub(crate) fn enter_d3(&self) {
        self.decoding.store(false, Ordering::Release);
        self.backplane.with_device(self.index, Device::reset);
    }

    /// The function left the bus (surprise removal): from now on every
    /// BAR read returns all ones and every write is dropped, and the
    /// device does nothing (it is reset: no DMA, no interrupt).
    pub(crate) fn surprise_removed(&self) {
        self.present.store(false, Ordering::Release);
        self.decoding.store(false, Ordering::Release);
        self.backplane.with_device(self.index, Device::reset);
    }

    /// Whether the function is still on the bus (not surprise-removed).
    pub fn present(&self) -> bool {
        self.present.load(Ordering::Acquire)
    }

    /// The driver's mappings of BAR0 end (its release-hardware returned).
    fn unmap_bars(&self) {
        self.mapping.fetch_add(1, Ordering::AcqRel);
    }

    /// MSI-X messages granted.
    pub fn message_count(&self) -> u16 {
        self.message_count
    }

    /// Creates an interrupt object for one message (`WdfInterruptCreate`,
    /// in prepare-hardware or add-device), charged to the calling driver.
    /// It is not connected yet: the PnP manager connects it after the
    /// driver's D0 entry and disconnects it before its D0 exit (see
    /// `docs/host-model.md`, "Interrupts"); a vector the device raises
    /// meanwhile is lost. Fails with `STATUS_NO_SUCH_DEVICE` outside a
    /// driver's context and `STATUS_INVALID_PARAMETER` for a message the
    /// function was not granted or that already has an object.
    pub fn create_interrupt(&self, config: InterruptConfig) -> Result<HostInterrupt, NtStatus> {
        let driver = context::current_driver().ok_or(NO_SUCH_DEVICE)?;
        let line = &self.backplane.lines[self.index];
        let mut objects = line.objects.write().unwrap_or_else(|e| e.into_inner());
        if config.message >= self.message_count
            || objects.iter().any(|o| o.config.message == config.message)
        {
            return Err(INVALID_PARAMETER);
        }
        let (dpc, message, driver_name) = (config.dpc.clone(), config.message, driver.clone());
        objects.push(Arc::new(InterruptObject { driver, config }));
        Ok(HostInterrupt {
            backplane: self.backplane.clone(),
            index: self.index,
            message,
            driver: driver_name,
            dpc,
        })
    }

    /// Whether any interrupt of the function is connected.
    pub fn interrupts_connected(&self) -> bool {
        let line = &self.backplane.lines[self.index];
        !lock(&line.connected).is_empty()
    }

    /// The PnP manager, after `driver`'s `EvtDeviceD0Entry`: connects
    /// each of its interrupt objects, then calls its `EvtInterruptEnable`
    /// at device IRQL under the interrupt lock. The first failure is
    /// returned (the device does not reach D0).
    pub(crate) fn connect_interrupts(&self, driver: &str) -> NtStatus {
        let line = &self.backplane.lines[self.index];
        let objects: Vec<Arc<InterruptObject>> = line
            .objects
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|o| &*o.driver == driver)
            .cloned()
            .collect();
        for object in objects {
            lock(&line.connected).insert(object.config.message);
            if let Some(enable) = &object.config.enable {
                let verifier = &self.backplane.verifier;
                let _context = context::enter(Context::driver(verifier.clone(), driver));
                let status = line.synchronized(verifier, || enable());
                if status != SUCCESS {
                    return status;
                }
            }
        }
        SUCCESS
    }

    /// The PnP manager, before `driver`'s `EvtDeviceD0Exit`: calls each
    /// of its interrupt objects' `EvtInterruptDisable` at device IRQL
    /// under the interrupt lock (not after a surprise removal: the
    /// hardware is gone), disconnects it, and waits for its DPC
    /// (`KeFlushQueuedDpcs`), as KMDF does.
    pub(crate) fn disconnect_interrupts(&self, driver: &str, surprise_removed: bool) {
        let line = &self.backplane.lines[self.index];
        let objects: Vec<Arc<InterruptObject>> = line
            .objects
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|o| &*o.driver == driver && lock(&line.connected).contains(&o.config.message))
            .cloned()
            .collect();
        let verifier = &self.backplane.verifier;
        for object in objects {
            let _context = context::enter(Context::driver(verifier.clone(), driver));
            if let Some(disable) = object.config.disable.as_ref().filter(|_| !surprise_removed) {
                let status = line.synchronized(verifier, || disable());
                if status != SUCCESS {
                    context::report(ViolationKind::Protocol {
                        detail: format!("EvtInterruptDisable failed: {status:?}"),
                    });
                }
            }
            // Under the lock, so no ISR of this object is running when it
            // returns.
            line.synchronized(verifier, || {
                // The host's bookkeeping, not the driver's heap use.
                let _host = crate::alloc_hook::HostCode::enter();
                lock(&line.connected).remove(&object.config.message)
            });
            object.config.dpc.flush_dpc();
        }
    }

    /// Deletes the interrupt objects (the framework deletes them after
    /// release-hardware).
    fn delete_interrupts(&self) {
        let line = &self.backplane.lines[self.index];
        line.objects
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        lock(&line.connected).clear();
    }

    /// The function's DMA adapter (`IoGetDmaAdapter`), charged to the
    /// calling driver; from now on the device masters the bus through it.
    /// A second call returns the same adapter. The device is described
    /// with the host's largest transfer ([`DmaDescription::HOST_MAXIMUM`]).
    pub fn dma_adapter(&self) -> Result<HostDmaAdapter, NtStatus> {
        self.dma_adapter_for(DmaDescription::HOST_MAXIMUM)
    }

    /// [`PciFunction::dma_adapter`] for a device described by
    /// `description` (`DEVICE_DESCRIPTION.MaximumLength`,
    /// `WDF_DMA_ENABLER_CONFIG.MaximumLength`): the adapter gets the map
    /// registers that transfer needs. Whether the device is behind DMA
    /// remapping comes from the registry its INF wrote
    /// ([`PciFunction::dma_remapping`]); a device that is not is flagged
    /// ([`Iommu::create_adapter_for`]). A second call returns the first
    /// adapter, whatever `description` says.
    pub fn dma_adapter_for(&self, description: DmaDescription) -> Result<HostDmaAdapter, NtStatus> {
        let mut slot = lock(&self.adapter);
        if let Some(adapter) = slot.as_ref() {
            return Ok(adapter.clone());
        }
        let driver = context::current_driver().ok_or(NO_SUCH_DEVICE)?;
        let remapping = self.dma_remapping(&driver);
        let adapter = self
            .iommu
            .create_adapter_for(&driver, description, remapping)?;
        self.backplane.ports[self.index].attach(Some(adapter.device_view()));
        *slot = Some(adapter.clone());
        Ok(adapter)
    }

    /// What the function's INF decided about DMA remapping, with `driver`
    /// its function driver ("Enabling DMA remapping for device drivers"):
    /// the per-device `Device Parameters\DMA Management\RemappingSupported`
    /// if present, else the per-driver
    /// `Services\<driver>\Parameters\DmaRemappingCompatible`; 1 (or 2, and
    /// per-device `RemappingFlags` 1: "when DMA verification is enabled",
    /// which the host's verifier always is) opts in, 0 opts out, no value
    /// leaves remapping not enforced.
    pub fn dma_remapping(&self, driver: &str) -> DmaRemapping {
        let Some((registry, path)) = &self.registry else {
            return DmaRemapping::Enforced;
        };
        let dword = |key: &str, name: &str| match registry.get_value(key, name) {
            Some(RegValue::Dword(value)) => Some(value),
            _ => None,
        };
        let per_device = dword(
            &format!("{}\\DMA Management", device_parameters_key(path)),
            "RemappingSupported",
        );
        let per_driver = dword(&service_parameters_key(driver), "DmaRemappingCompatible");
        match per_device.or(per_driver) {
            Some(0) => DmaRemapping::OptedOut,
            Some(_) => DmaRemapping::Enforced,
            None => DmaRemapping::NotEnforced,
        }
    }

    /// Puts the adapter back (`PutDmaAdapter`, release hardware): bus
    /// mastering stops, and whatever the driver left mapped or allocated
    /// is reported as a leak. Returns the number of leaks.
    pub fn put_dma_adapter(&self) -> usize {
        let Some(adapter) = lock(&self.adapter).take() else {
            return 0;
        };
        self.backplane.ports[self.index].attach(None);
        adapter.report_leaks()
    }

    /// Runs `f` on the device itself (tests: counters, link, faults).
    pub fn with_device<R>(&self, f: impl FnOnce(&mut Device) -> R) -> R {
        self.backplane.with_device(self.index, f)
    }
}

/// BAR0 of one function, as mapped for its driver (`MmMapIoSpaceEx`).
///
/// While the function does not decode (D3, surprise-removed) a read
/// returns all ones, as a PCIe read that ends in an Unsupported Request or
/// a master abort does, and a write is dropped. After the driver's
/// release-hardware returned the mapping is gone: an access is a
/// [`ViolationKind::BarAccessAfterUnmap`] (and reads all ones).
#[derive(Clone)]
pub struct Bar0 {
    function: Arc<PciFunction>,
    /// The mapping generation this handle belongs to.
    mapping: u64,
    /// The driver that mapped it, charged when the access is made outside
    /// any driver's context.
    mapped_by: Option<Arc<str>>,
}

impl std::fmt::Debug for Bar0 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Bar0").field(&self.function.index).finish()
    }
}

impl Bar0 {
    /// Whether an access at `offset` reaches the device; reports a stale
    /// mapping.
    fn reaches_device(&self, offset: u64) -> bool {
        let function = &self.function;
        if function.mapping.load(Ordering::Acquire) != self.mapping {
            let kind = ViolationKind::BarAccessAfterUnmap { offset };
            if context::current_driver().is_some() {
                context::report(kind);
            } else {
                function
                    .backplane
                    .verifier
                    .report(self.mapped_by.as_deref(), kind);
            }
            return false;
        }
        function.decoding()
    }
}

impl Mmio for Bar0 {
    fn len(&self) -> u64 {
        self.function.bar0_len
    }

    fn read32(&self, offset: u64) -> u32 {
        if !self.reaches_device(offset) {
            return u32::MAX;
        }
        self.function
            .backplane
            .mmio(self.function.index, |d| u64::from(d.mmio_read32(offset))) as u32
    }

    fn write32(&self, offset: u64, value: u32) {
        if !self.reaches_device(offset) {
            return;
        }
        self.function.backplane.mmio(self.function.index, |d| {
            d.mmio_write32(offset, value);
            0
        });
    }

    fn read64(&self, offset: u64) -> u64 {
        if !self.reaches_device(offset) {
            return u64::MAX;
        }
        self.function
            .backplane
            .mmio(self.function.index, |d| d.mmio_read64(offset))
    }

    fn write64(&self, offset: u64, value: u64) {
        if !self.reaches_device(offset) {
            return;
        }
        self.function.backplane.mmio(self.function.index, |d| {
            d.mmio_write64(offset, value);
            0
        });
    }
}

/// An interrupt object as its driver holds it (`WDFINTERRUPT`).
#[derive(Clone)]
pub struct HostInterrupt {
    backplane: Arc<Backplane>,
    index: usize,
    message: u16,
    /// The driver that created it, charged for misuse outside any
    /// driver's context.
    driver: Arc<str>,
    dpc: DeviceDeferred,
}

impl std::fmt::Debug for HostInterrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostInterrupt")
            .field("function", &self.index)
            .finish_non_exhaustive()
    }
}

impl HostInterrupt {
    /// Queues the interrupt's DPC (`WdfInterruptQueueDpcForIsr`); returns
    /// whether it was queued (not already). Any IRQL.
    pub fn queue_dpc(&self) -> bool {
        self.dpc.insert_dpc()
    }

    /// `WdfInterruptAcquireLock`: raises to the device's IRQL and holds
    /// the interrupt spin lock, so no ISR of the function runs until the
    /// guard drops (`WdfInterruptReleaseLock`, which lowers again).
    /// Acquiring it at device IRQL (from the ISR, or holding it already)
    /// deadlocks on Windows: recorded as a [`ViolationKind::Deadlock`],
    /// then a panic. Acquiring it while the interrupt is not connected
    /// (before `EvtInterruptEnable`, after `EvtInterruptDisable`) is not
    /// allowed: a [`ViolationKind::Protocol`] (the lock is still taken).
    pub fn acquire_lock(&self) -> InterruptLock<'_> {
        let line = &self.backplane.lines[self.index];
        if crate::irql::current() >= HCA_DIRQL {
            self.report(ViolationKind::Deadlock {
                what: "WdfInterruptAcquireLock at device IRQL (in the ISR or holding the lock)"
                    .to_owned(),
            });
            panic!("WdfInterruptAcquireLock at device IRQL deadlocks");
        }
        if !lock(&line.connected).contains(&self.message) {
            self.report(ViolationKind::Protocol {
                detail: "WdfInterruptAcquireLock on an interrupt that is not connected".to_owned(),
            });
        }
        let objects = line.objects.write().unwrap_or_else(|e| e.into_inner());
        let irql = IrqlGuard::at(HCA_DIRQL);
        InterruptLock {
            line,
            verifier: &self.backplane.verifier,
            held: Some((irql, objects)),
        }
    }
}

impl HostInterrupt {
    /// Records a misuse against the driver running, or the creator.
    fn report(&self, kind: ViolationKind) {
        if context::current_driver().is_some() {
            context::report(kind);
        } else {
            self.backplane.verifier.report(Some(&self.driver), kind);
        }
    }
}

type HeldInterruptLock<'a> = (
    IrqlGuard,
    std::sync::RwLockWriteGuard<'a, Vec<Arc<InterruptObject>>>,
);

/// The interrupt spin lock, held (see [`HostInterrupt::acquire_lock`]).
#[must_use = "the interrupt lock is released as soon as the guard drops"]
pub struct InterruptLock<'a> {
    line: &'a InterruptLine,
    verifier: &'a Verifier,
    held: Option<HeldInterruptLock<'a>>,
}

impl std::fmt::Debug for InterruptLock<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterruptLock").finish_non_exhaustive()
    }
}

impl Drop for InterruptLock<'_> {
    fn drop(&mut self) {
        if let Some((irql, objects)) = self.held.take() {
            drop(objects);
            drop(irql);
        }
        // What the device raised while the lock masked it.
        self.line.deliver(self.verifier);
    }
}

/// The host's PCI bus driver: its FDO reports one child per function of
/// the backplane it was given.
#[derive(Debug)]
pub struct PciBusDriver {
    backplane: Arc<Backplane>,
    functions: Vec<usize>,
    iommu: Iommu,
    /// The bus's FDO once added: where a re-plug is reported.
    fdo: Mutex<Weak<PciBusFdo>>,
}

impl PciBusDriver {
    /// A bus presenting `functions` (indices on `backplane`), with DMA
    /// through `iommu`.
    pub fn new(backplane: Arc<Backplane>, functions: Vec<usize>, iommu: Iommu) -> Self {
        Self {
            backplane,
            functions,
            iommu,
            fdo: Mutex::default(),
        }
    }

    /// A function is plugged in again (a hot-plug slot's presence detect):
    /// the bus reports it in its relations once more, and the PnP manager
    /// (`PnpManager::process_bus_relations`) enumerates a new devnode with
    /// the same instance path if the old one is removed; one still present
    /// (or surprise-removed, waiting for its last handle) is left as it
    /// is. `STATUS_NO_SUCH_DEVICE` without a started bus,
    /// `STATUS_INVALID_PARAMETER` for a function the bus does not have.
    pub fn replug(&self, index: usize) -> Result<(), NtStatus> {
        let fdo = lock(&self.fdo).upgrade().ok_or(NO_SUCH_DEVICE)?;
        if !fdo.functions.contains(&index) {
            return Err(INVALID_PARAMETER);
        }
        fdo.host.report_present(function_description(index))
    }
}

impl DriverEntry for PciBusDriver {
    fn add_device(
        &self,
        _init: &DeviceInit,
        host: &DeviceServices,
    ) -> Result<Arc<dyn DeviceCallbacks>, NtStatus> {
        let fdo = Arc::new(PciBusFdo {
            host: host.clone(),
            backplane: self.backplane.clone(),
            functions: self.functions.clone(),
            iommu: self.iommu.clone(),
        });
        *lock(&self.fdo) = Arc::downgrade(&fdo);
        Ok(fdo)
    }
}

struct PciBusFdo {
    host: DeviceServices,
    backplane: Arc<Backplane>,
    functions: Vec<usize>,
    iommu: Iommu,
}

/// The instance ID of function `index` (bus 0, device `index`, function 0).
fn instance_id(index: usize) -> String {
    format!("{index:02x}.0")
}

/// What the bus reports for function `index`.
fn function_description(index: usize) -> ChildDescription {
    ChildDescription {
        instance_id: instance_id(index),
        hardware_ids: PciFunction::hardware_ids(),
        compatible_ids: PciFunction::compatible_ids(),
        description: "Simulated RoCE HCA".to_owned(),
    }
}

impl DeviceCallbacks for PciBusFdo {
    fn prepare_hardware(&self) -> NtStatus {
        for &index in &self.functions {
            if let Err(status) = self.host.report_present(function_description(index)) {
                return status;
            }
        }
        SUCCESS
    }

    fn create_child(&self, child: &ChildDescription) -> Option<Arc<dyn DeviceCallbacks>> {
        let index = *self
            .functions
            .iter()
            .find(|&&i| instance_id(i) == child.instance_id)?;
        let mut function = self.backplane.function(index, &self.iommu)?;
        // The child's INF is applied under this path before its drivers
        // start; the function reads its DMA remapping opt-in there.
        if let Some((registry, bus_path)) = self.host.registry_store()
            && let Some(f) = Arc::get_mut(&mut function)
        {
            f.registry = Some((registry, format!("{bus_path}\\{}", child.instance_id)));
        }
        Some(Arc::new(PciFunctionPdo { function }))
    }

    fn power_managed_queue(&self) -> bool {
        false
    }
}

/// `GUID_BUS_INTERFACE_STANDARD` ({496B8280-6F25-11D0-BEAF-08002BE2092F}):
/// the bus interface a PCI PDO answers `IRP_MN_QUERY_INTERFACE` with.
pub const GUID_BUS_INTERFACE_STANDARD: WinGuid =
    WinGuid::from_u128(0x496b8280_6f25_11d0_beaf_08002be2092f);

/// The version of [`BusInterfaceStandard`] (`BUS_INTERFACE_STANDARD` is
/// version 1).
pub const BUS_INTERFACE_STANDARD_VERSION: u16 = 1;

/// `BUS_INTERFACE_STANDARD` of one PCI function, as its PDO answers
/// `IRP_MN_QUERY_INTERFACE` for [`GUID_BUS_INTERFACE_STANDARD`]; of its
/// routines only `GetDmaAdapter` is modelled. A bus driver whose children
/// use their parent's DMA (the IBAL bus filter's port children) forwards
/// the query to this PDO, so `IoGetDmaAdapter` on the child resolves here.
#[derive(Debug)]
pub struct BusInterfaceStandard {
    function: Weak<PciFunction>,
}

impl BusInterfaceStandard {
    /// `GetDmaAdapter`: the function's own DMA adapter
    /// ([`PciFunction::dma_adapter`]: the one its function driver holds
    /// if it took one already). PASSIVE_LEVEL. `STATUS_NO_SUCH_DEVICE`
    /// once the function is gone.
    pub fn get_dma_adapter(&self) -> Result<HostDmaAdapter, NtStatus> {
        crate::irql::check_max("GetDmaAdapter", Irql::PASSIVE);
        self.function.upgrade().ok_or(NO_SUCH_DEVICE)?.dma_adapter()
    }
}

/// The PDO of one function: hands its resources to the stack, answers the
/// bus interface, and takes the adapter back when the stack lets go of the
/// hardware.
struct PciFunctionPdo {
    function: Arc<PciFunction>,
}

impl DeviceCallbacks for PciFunctionPdo {
    fn release_hardware(&self) -> NtStatus {
        // The function driver above has released first (top-down): its
        // mappings of BAR0 are gone, its interrupt objects deleted, and
        // what it left allocated or mapped for DMA is a leak.
        self.function.unmap_bars();
        self.function.delete_interrupts();
        self.function.put_dma_adapter();
        SUCCESS
    }

    fn resources(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        Some(self.function.clone())
    }

    fn query_interface(&self, guid: &WinGuid, version: u16) -> Option<ProvidedInterface> {
        (*guid == GUID_BUS_INTERFACE_STANDARD && version >= BUS_INTERFACE_STANDARD_VERSION).then(
            || ProvidedInterface {
                version: BUS_INTERFACE_STANDARD_VERSION,
                object: Arc::new(BusInterfaceStandard {
                    function: Arc::downgrade(&self.function),
                }),
            },
        )
    }

    fn power_managed_queue(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::PAGE_SIZE;
    use driver_platform::dma::{CommonBuffer, DmaAdapter};

    /// A function's port without an adapter refuses probes and copies as
    /// it refuses accesses (counted, recorded with no driver; a bad source
    /// blamed before a destination without one); once both ports have
    /// adapters, a probe passes and a copy goes through both tables.
    #[test]
    fn a_port_probes_and_copies_through_its_adapter_only() {
        let verifier = Verifier::new();
        let iommu = Iommu::new(verifier.clone(), 3);
        let a = iommu.create_adapter("hcaA").unwrap();
        let b = iommu.create_adapter("hcaB").unwrap();
        let src = a.alloc_common(2 * PAGE_SIZE).unwrap();
        let dst = b.alloc_common(2 * PAGE_SIZE).unwrap();
        let data: Vec<u8> = (0..2 * PAGE_SIZE).map(|i| (i % 253) as u8).collect();
        assert!(src.write(0, &data));
        let (port_a, port_b) = (
            DmaPort::new(verifier.clone()),
            DmaPort::new(verifier.clone()),
        );
        let (from, to) = (src.bus_address(), dst.bus_address());
        let read_fault = DmaFault {
            addr: from,
            len: 8,
            direction: DmaDirection::Read,
        };
        assert_eq!(
            port_a.probe(&[(from, 8)], DmaDirection::Read),
            Some(Err((0, read_fault)))
        );
        assert_eq!(port_a.probe(&[], DmaDirection::Read), Some(Ok(())));
        assert_eq!(
            port_a.copy_to(from, port_b.as_ref(), to, 8),
            Err(CopyFault::Source(read_fault))
        );
        port_a.attach(Some(a.device_view()));
        assert!(matches!(
            port_a.copy_to(from, port_b.as_ref(), to, 8),
            Err(CopyFault::Destination(f)) if f.addr == to && f.direction == DmaDirection::Write
        ));
        assert!(matches!(
            port_a.copy_to(to, port_b.as_ref(), to, 8),
            Err(CopyFault::Source(f)) if f.addr == to
        ));
        assert_eq!(port_a.faults_before_adapter(), 2);
        assert_eq!(port_b.faults_before_adapter(), 1);
        assert_eq!(a.faults(), 1);
        let records: Vec<_> = verifier
            .take()
            .into_iter()
            .map(|v| match v.kind {
                ViolationKind::DmaFault { addr, len } => (v.driver, addr, len),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(
            records,
            vec![
                (None, from, 8),
                (None, from, 8),
                (None, to, 8),
                (Some("hcaA".to_owned()), to, 8)
            ]
        );
        port_b.attach(Some(b.device_view()));
        assert_eq!(
            port_a.probe(&[(from, 2 * PAGE_SIZE)], DmaDirection::Read),
            Some(Ok(()))
        );
        port_a
            .copy_to(from + 1, port_b.as_ref(), to + 1, 2 * PAGE_SIZE - 2)
            .unwrap();
        let mut copied = vec![0u8; 2 * PAGE_SIZE];
        assert!(dst.read(0, &mut copied));
        assert_eq!(copied[1..2 * PAGE_SIZE - 1], data[1..2 * PAGE_SIZE - 1]);
        assert_eq!((copied[0], copied[2 * PAGE_SIZE - 1]), (0, 0));
        verifier.assert_clean();
    }
}
