//! The simulation harness: several simulated HCAs on one [`Fabric`], driven
//! by a deterministic, single-threaded stepper in virtual time.
//!
//! Contract:
//! - **One seed.** [`Cluster::new`] takes the seed of the whole run. Every
//!   random decision of the harness comes from a named stream of it
//!   ([`Cluster::rng_stream`]): the fabric's fault injector, the placement of
//!   each node's bus addresses, and whatever a test draws for its own
//!   workload. A stream depends only on the seed and its name, so adding a
//!   stream later never shifts the draws of another.
//! - **Deterministic.** No clock, no thread, no OS randomness: the same seed
//!   and the same sequence of calls give the same frames, in the same order,
//!   at the same virtual times, byte for byte.
//! - **Rounds.** [`Cluster::step`] runs one round at the current virtual
//!   time, in this order:
//!   1. for every node, in the order they were added: hand the frames its
//!      device queued to the fabric, then bring the fabric's multicast
//!      memberships of each of its ports in line with
//!      [`Device::multicast_macs`];
//!   2. hand every frame due by now on a node's port to that node's device,
//!      earliest due first (ties: lowest fabric port first, then the
//!      fabric's transmit order);
//!   3. run every device timer due by now ([`Device::handle_timeout`]); a
//!      device that declared a fatal error runs no more timers.
//!
//!   Frames a device queues while handling phase 2 or 3 (replies,
//!   retransmissions), or while the test touches its registers between
//!   rounds, go to the fabric in phase 1 of the next round, stamped with the
//!   time they were queued at. A round that found nothing to do instead jumps
//!   virtual time to the next event ([`Cluster::next_event_ns`]); when there
//!   is none, the cluster is idle and `step` returns false.
//! - **Time.** Virtual nanoseconds, starting at 0, only ever moving forward.
//!   Every device's clock is kept equal to the cluster's, so doorbells a test
//!   rings between rounds see the current time.
//! - **Ports.** Each device port is attached to the fabric with its MAC and
//!   its link up. Ports a caller attaches itself through
//!   [`Cluster::fabric_mut`] (a probe that injects crafted frames, say) are
//!   the caller's: the cluster never receives from them, and frames queued
//!   for them neither count as work nor move the clock.
//! - **Capture.** [`Cluster::capture_to`] records what the fabric carries in
//!   a pcap file, with virtual timestamps (see [`CaptureDirections`]). It
//!   uses the fabric's tap; do not install another one while capturing.

use std::any::Any;
use std::fmt;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::device::{Device, DeviceConfig};
use crate::fabric::{Direction, Fabric, FabricConfig, FabricError, PortId, TapEvent};
use crate::host::{HostMemory, InterruptSink, SIM_PAGE, SimMemory};
use crate::pcap::PcapWriter;
use crate::rng::Rng;

/// The stream of [`Cluster::rng_stream`] the fabric's seed is drawn from.
pub const FABRIC_STREAM: u64 = 0xC105_7E40_0000_0001;
/// The stream the per-node bus address offsets are drawn from.
pub const BUS_LAYOUT_STREAM: u64 = 0xC105_7E40_0000_0002;

/// Bus address space set aside per node: node `n`'s memory hands out bus
/// addresses from `(n + 1) * NODE_BUS_SPAN` plus a seeded offset.
pub const NODE_BUS_SPAN: u64 = 1 << 32;
/// The seeded offset inside a node's span is below this, so each node has
/// at least `NODE_BUS_SPAN - MAX_BUS_OFFSET` (2 GiB) of bus addresses
/// before it could reach the next node's span.
pub const MAX_BUS_OFFSET: u64 = 1 << 31;

/// Rounds at one virtual instant after which [`Cluster::advance_to`] gives
/// up: only a livelock (say, two devices answering each other over a
/// zero-latency fabric forever) gets that far.
pub const MAX_ROUNDS_PER_INSTANT: usize = 100_000;

/// A node of a [`Cluster`]: an index in the order nodes were added.
///
/// Methods taking a `NodeId` panic when it was not handed out by the same
/// cluster; that is a bug in the test, not a simulated condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u32);

impl NodeId {
    /// The node's index: 0 for the first node added, then 1, 2, ...
    pub const fn index(self) -> u32 {
        self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {}", self.0)
    }
}

/// The interrupt sink of one node: remembers every vector raised, in order,
/// until [`IrqLog::take`] drains them.
#[derive(Debug, Default)]
pub struct IrqLog {
    raised: Mutex<Vec<u16>>,
    /// True while `raised` may hold vectors: lets a host that collects
    /// after every register store skip the lock when nothing was raised.
    any: AtomicBool,
}

impl IrqLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<u16>> {
        // Poisoned only if a test already panicked; keep its panic the one
        // reported.
        self.raised.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every vector raised since the last `take`, oldest first.
    pub fn take(&self) -> Vec<u16> {
        // Acquire: pairs with `raise`'s Release, so a vector whose flag was
        // seen is in the list. A vector raised just after this check is
        // taken by the next call, as if it had been raised after this one.
        if !self.any.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut raised = self.lock();
        self.any.store(false, Ordering::Relaxed);
        std::mem::take(&mut *raised)
    }

    /// Vectors raised and not yet taken.
    pub fn pending(&self) -> usize {
        self.lock().len()
    }
}

impl InterruptSink for IrqLog {
    fn raise(&self, vector: u16) {
        let mut raised = self.lock();
        raised.push(vector);
        self.any.store(true, Ordering::Release);
    }
}

/// Why a cluster call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// A port of the new device has the MAC of a port already on the
    /// fabric, or of another of its own ports (ports with the same IPv4
    /// address have the same MAC).
    #[error("MAC {} is already on the fabric", MacText(.mac))]
    MacInUse {
        /// The MAC.
        mac: [u8; 6],
    },
    /// The fabric refused to attach a port (its MAC clashes with a port
    /// the caller attached through [`Cluster::fabric_mut`]).
    #[error("cannot attach a port: {0}")]
    Fabric(#[from] FabricError),
    /// The node has no such port (ports are numbered from 1).
    #[error("{node} has no port {port}")]
    NoSuchPort {
        /// The node.
        node: NodeId,
        /// The port asked for.
        port: u8,
    },
    /// A device configuration with more ports than a port number can name.
    #[error("a device has at most 255 ports, the configuration has {0}")]
    TooManyPorts(usize),
    /// No bus address span is left for another node.
    #[error("no bus address span left for another node")]
    TooManyNodes,
}

/// Formats a MAC as `aa:bb:cc:dd:ee:ff`.
struct MacText<'a>(&'a [u8; 6]);

impl fmt::Display for MacText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

/// The cluster still had work after the allowed number of steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("still busy after {steps} steps, at {now_ns} ns virtual time")]
pub struct StepLimit {
    /// The steps taken (for [`Cluster::advance_to`]: rounds at one instant).
    pub steps: usize,
    /// The virtual time when the limit was hit.
    pub now_ns: u64,
}

/// Which frames a capture records.
///
/// A classic pcap record has no direction field, so the two directions are
/// told apart by their timestamps and by counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CaptureDirections {
    /// Each frame once, as the sending port handed it to the fabric, at its
    /// transmit time, before any fault. Reads like a capture on a mirror
    /// port of the switch; what a receiver got is not shown.
    #[default]
    Transmitted,
    /// Each frame once per direction it crosses a port: a `Tx` record when
    /// it is sent, and an `Rx` record, as delivered (corruption included),
    /// at its arrival time for each copy a port receives. A delivered
    /// unicast frame appears twice, a lost one once, a duplicated one three
    /// times, a multicast frame once plus once per receiver.
    Both,
}

/// Why a capture could not be started or finished.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CaptureError {
    /// [`Cluster::capture_to`] while a capture is running.
    #[error("a capture is already running")]
    AlreadyCapturing,
    /// [`Cluster::finish_capture`] with no capture running.
    #[error("no capture is running")]
    NotCapturing,
    /// [`Cluster::finish_capture`] asked for another writer type than the
    /// one given to [`Cluster::capture_to`]; the writer is dropped.
    #[error("the capture writer is not of the type asked for")]
    WrongWriterType,
    /// Writing the pcap header or a record, or flushing, failed. After the
    /// first failure nothing more is written.
    #[error("writing the capture failed: {0}")]
    Io(#[from] io::Error),
}

/// A capture writer whose concrete type can be recovered at the end.
trait CaptureSink: Write + Send + Any {
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl<W: Write + Send + 'static> CaptureSink for W {
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// A running capture, shared between the cluster and the fabric's tap.
struct Capture {
    pcap: PcapWriter<Box<dyn CaptureSink>>,
    directions: CaptureDirections,
    /// The first write error; nothing is written after it.
    error: Option<io::Error>,
}

impl Capture {
    fn record(&mut self, event: TapEvent<'_>) {
        let wanted = match event.direction {
            Direction::Tx => true,
            Direction::Rx => self.directions == CaptureDirections::Both,
        };
        if !wanted || self.error.is_some() {
            return;
        }
        if let Err(e) = self.pcap.write_frame(event.now_ns, event.frame) {
            self.error = Some(e);
        }
    }
}

type SharedCapture = Arc<Mutex<Option<Capture>>>;

fn lock_capture(shared: &SharedCapture) -> MutexGuard<'_, Option<Capture>> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

/// One device port on the fabric.
#[derive(Debug, Clone, Copy)]
struct Attachment {
    node: usize,
    /// 1-based, as the device numbers its ports.
    device_port: u8,
    fabric_port: PortId,
}

/// One simulated machine: its HCA, host memory and interrupt log.
#[derive(Debug)]
struct Node {
    device: Device,
    /// `None` for a node built on the caller's host memory.
    memory: Option<Arc<SimMemory>>,
    irq: Arc<IrqLog>,
    /// Fabric port of device port `i + 1`.
    fabric_ports: Vec<PortId>,
    /// Per device port, the group MACs the fabric port has joined, sorted.
    joined: Vec<Vec<[u8; 6]>>,
}

/// Simulated HCAs on a simulated fabric, stepped in virtual time. See the
/// module docs for the contract.
pub struct Cluster {
    seed: u64,
    fabric: Fabric,
    nodes: Vec<Node>,
    /// Every device port, in attach order (node order, then port order).
    attachments: Vec<Attachment>,
    now_ns: u64,
    bus_layout: Rng,
    capture: Option<SharedCapture>,
    /// Frames devices queued on a port number they do not have.
    stray_frames: u64,
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster")
            .field("seed", &format_args!("{:#x}", self.seed))
            .field("now_ns", &self.now_ns)
            .field("nodes", &self.nodes.len())
            .field("fabric", &self.fabric)
            .field("capturing", &self.capture.is_some())
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// An empty cluster at virtual time 0 whose randomness all comes from
    /// `seed`.
    pub fn new(fabric: FabricConfig, seed: u64) -> Self {
        let fabric_seed = Self::stream_of(seed, FABRIC_STREAM).next_u64();
        Self {
            seed,
            fabric: Fabric::new(fabric, fabric_seed),
            nodes: Vec::new(),
            attachments: Vec::new(),
            now_ns: 0,
            bus_layout: Self::stream_of(seed, BUS_LAYOUT_STREAM),
            capture: None,
            stray_frames: 0,
        }
    }

    /// Two nodes with one port each, 10.0.0.1 and 10.0.0.2, on a default
    /// fabric (1 µs latency, no faults).
    pub fn pair(seed: u64) -> (Self, NodeId, NodeId) {
        Self::pair_with(FabricConfig::default(), seed)
    }

    /// [`Cluster::pair`] on a fabric of the caller's choosing (with faults,
    /// say).
    pub fn pair_with(fabric: FabricConfig, seed: u64) -> (Self, NodeId, NodeId) {
        let mut cluster = Self::new(fabric, seed);
        let a = cluster
            .add_node(DeviceConfig::with_ports(
                0x0002_C900_0000_1000,
                &[[10, 0, 0, 1]],
            ))
            .expect("an empty fabric accepts 10.0.0.1");
        let b = cluster
            .add_node(DeviceConfig::with_ports(
                0x0002_C900_0000_2000,
                &[[10, 0, 0, 2]],
            ))
            .expect("10.0.0.2 differs from 10.0.0.1");
        (cluster, a, b)
    }

    fn stream_of(seed: u64, stream: u64) -> Rng {
        Rng::from_seed(seed).fork(stream)
    }

    /// The seed the cluster was built with (print it when a test fails).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// A generator for stream `stream` of the cluster's seed, for the
    /// caller's own randomness (workload, fault schedule). It depends only
    /// on the seed and `stream`, never on other streams or on call order.
    /// [`FABRIC_STREAM`] and [`BUS_LAYOUT_STREAM`] are the cluster's.
    pub fn rng_stream(&self, stream: u64) -> Rng {
        Self::stream_of(self.seed, stream)
    }

    /// Adds a machine: a [`SimMemory`] in a bus address span of its own (at
    /// a seeded page offset, so bus addresses never coincide across nodes),
    /// an [`IrqLog`], and a [`Device`] built from `cfg` whose every port is
    /// attached to the fabric with its MAC and its link up, in the fabric
    /// and in the device.
    ///
    /// Fails, adding no node, when a port's MAC is already on the fabric
    /// (ports of two nodes with the same IPv4 address).
    pub fn add_node(&mut self, cfg: DeviceConfig) -> Result<NodeId, ClusterError> {
        let (_, index) = self.room_for(&cfg)?;
        let offset = self.bus_layout.below(MAX_BUS_OFFSET / SIM_PAGE) * SIM_PAGE;
        let bus_base = (u64::from(index) + 1)
            .checked_mul(NODE_BUS_SPAN)
            .and_then(|span_start| span_start.checked_add(offset))
            .ok_or(ClusterError::TooManyNodes)?;

        let memory = Arc::new(SimMemory::new(bus_base));
        self.attach_node(
            cfg,
            Arc::clone(&memory) as Arc<dyn HostMemory>,
            Some(memory),
        )
    }

    /// Adds a machine whose device reaches host memory through `memory`
    /// (a simulated host's IOMMU) instead of a [`SimMemory`] of its own;
    /// otherwise as [`Cluster::add_node`]. [`Cluster::memory`] is not
    /// available for such a node.
    pub fn add_host_node(
        &mut self,
        cfg: DeviceConfig,
        memory: Arc<dyn HostMemory>,
    ) -> Result<NodeId, ClusterError> {
        self.attach_node(cfg, memory, None)
    }

    /// The port count and index of a node built from `cfg`, if both fit.
    fn room_for(&self, cfg: &DeviceConfig) -> Result<(u8, u32), ClusterError> {
        let port_count = cfg.ports.len();
        let num_ports =
            u8::try_from(port_count).map_err(|_| ClusterError::TooManyPorts(port_count))?;
        let index = u32::try_from(self.nodes.len()).map_err(|_| ClusterError::TooManyNodes)?;
        Ok((num_ports, index))
    }

    fn attach_node(
        &mut self,
        cfg: DeviceConfig,
        host_memory: Arc<dyn HostMemory>,
        memory: Option<Arc<SimMemory>>,
    ) -> Result<NodeId, ClusterError> {
        let (num_ports, index) = self.room_for(&cfg)?;
        let irq = Arc::new(IrqLog::new());
        let mut device = Device::new(cfg, host_memory, Arc::clone(&irq) as Arc<dyn InterruptSink>);
        device.set_time(self.now_ns);

        // Refuse a clash with the cluster's own ports before attaching
        // anything, so a refused node leaves nothing on the fabric.
        let macs: Vec<[u8; 6]> = (1..=num_ports)
            .filter_map(|port| device.port_mac(port))
            .collect();
        for (i, mac) in macs.iter().enumerate() {
            let taken = macs[..i].contains(mac)
                || self
                    .attachments
                    .iter()
                    .any(|a| self.fabric.mac(a.fabric_port) == Ok(*mac));
            if taken {
                return Err(ClusterError::MacInUse { mac: *mac });
            }
        }
        let mut fabric_ports = Vec::with_capacity(macs.len());
        for mac in &macs {
            match self.fabric.attach(*mac) {
                Ok(port) => fabric_ports.push(port),
                Err(e) => {
                    // A clash with a port the caller attached. The fabric
                    // cannot detach, so park this node's ports link-down.
                    for &port in &fabric_ports {
                        self.fabric
                            .set_link(port, false, self.now_ns)
                            .expect("just attached");
                    }
                    return Err(e.into());
                }
            }
        }

        let node = self.nodes.len();
        for (i, &fabric_port) in fabric_ports.iter().enumerate() {
            let device_port = i as u8 + 1;
            device.set_link(device_port, true);
            self.attachments.push(Attachment {
                node,
                device_port,
                fabric_port,
            });
        }
        self.nodes.push(Node {
            device,
            memory,
            irq,
            joined: vec![Vec::new(); fabric_ports.len()],
            fabric_ports,
        });
        Ok(NodeId(index))
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes
            .get(id.0 as usize)
            .unwrap_or_else(|| panic!("{id} is not a node of this cluster"))
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes
            .get_mut(id.0 as usize)
            .unwrap_or_else(|| panic!("{id} is not a node of this cluster"))
    }

    /// The nodes, in the order they were added.
    pub fn nodes(&self) -> impl ExactSizeIterator<Item = NodeId> + use<> {
        (0..self.nodes.len() as u32).map(NodeId)
    }

    /// A node's HCA, for its driver to touch (BAR0, counters). Its clock
    /// reads the cluster's time.
    pub fn device(&mut self, id: NodeId) -> &mut Device {
        &mut self.node_mut(id).device
    }

    /// A node's host memory.
    pub fn memory(&self, id: NodeId) -> Arc<SimMemory> {
        match &self.node(id).memory {
            Some(memory) => Arc::clone(memory),
            None => panic!("{id} reaches the host's memory, not a SimMemory of its own"),
        }
    }

    /// Drains the interrupt vectors a node's device raised, oldest first.
    pub fn interrupts(&self, id: NodeId) -> Vec<u16> {
        self.node(id).irq.take()
    }

    /// A node's interrupt log itself (for a simulated host to poll).
    pub fn interrupt_log(&self, id: NodeId) -> Arc<IrqLog> {
        Arc::clone(&self.node(id).irq)
    }

    /// The fabric port of a node's device port `port` (1-based).
    pub fn fabric_port(&self, id: NodeId, port: u8) -> Option<PortId> {
        let index = usize::from(port).checked_sub(1)?;
        self.node(id).fabric_ports.get(index).copied()
    }

    /// The current virtual time, in nanoseconds.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// The fabric, for counters and link state.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// The fabric, to change faults or attach probe ports of the caller's
    /// own (see the module docs on ports the cluster does not own).
    pub fn fabric_mut(&mut self) -> &mut Fabric {
        &mut self.fabric
    }

    /// Frames devices queued on a port number they do not have; they are
    /// dropped (a device bug, counted rather than fatal to the run).
    pub fn stray_frames(&self) -> u64 {
        self.stray_frames
    }

    /// Brings a node's port (1-based) up or down now: a link flap, seen by
    /// the fabric (frames in flight to the port are lost) and by the device
    /// (its port state changes and it reports the change).
    pub fn set_link(&mut self, id: NodeId, port: u8, up: bool) -> Result<(), ClusterError> {
        let fabric_port = self
            .fabric_port(id, port)
            .ok_or(ClusterError::NoSuchPort { node: id, port })?;
        self.fabric
            .set_link(fabric_port, up, self.now_ns)
            .expect("cluster ports are attached");
        self.node_mut(id).device.set_link(port, up);
        Ok(())
    }

    /// Moves virtual time forward to `t` (never back) on every clock.
    fn set_now(&mut self, t: u64) {
        if t > self.now_ns {
            self.now_ns = t;
            for node in &mut self.nodes {
                node.device.set_time(t);
            }
        }
    }

    /// The earliest virtual time at which the cluster has something to do
    /// (never before [`Cluster::now_ns`]), or `None` when it is idle: no
    /// device has frames queued, no frame is on its way to a node's port,
    /// no device timer is set.
    pub fn next_event_ns(&self) -> Option<u64> {
        if self.nodes.iter().any(|n| n.device.tx_pending() > 0) {
            return Some(self.now_ns);
        }
        let frames = self
            .attachments
            .iter()
            .filter_map(|a| self.fabric.next_due_ns(a.fabric_port).ok().flatten());
        let timers = self.nodes.iter().filter_map(|n| Self::timer_of(&n.device));
        frames.chain(timers).min().map(|t| t.max(self.now_ns))
    }

    /// True when [`Cluster::next_event_ns`] is `None`.
    pub fn is_idle(&self) -> bool {
        self.next_event_ns().is_none()
    }

    /// A device's next timer. A device that declared a fatal error runs no
    /// more timers (its QPs may still hold deadlines).
    fn timer_of(device: &Device) -> Option<u64> {
        if device.is_fatal() {
            None
        } else {
            device.poll_timeout()
        }
    }

    /// One round, or a jump in time: see the module docs. Returns false
    /// only when the cluster is idle.
    pub fn step(&mut self) -> bool {
        if self.round() {
            return true;
        }
        match self.next_event_ns() {
            Some(t) => {
                debug_assert!(t > self.now_ns, "a round at {t} ns left work due");
                self.set_now(t);
                true
            }
            None => false,
        }
    }

    /// Steps until idle; returns the steps taken, or fails when still busy
    /// after `max_steps`.
    pub fn run_until_idle(&mut self, max_steps: usize) -> Result<usize, StepLimit> {
        for steps in 0..max_steps {
            if !self.step() {
                return Ok(steps);
            }
        }
        if self.is_idle() {
            Ok(max_steps)
        } else {
            Err(StepLimit {
                steps: max_steps,
                now_ns: self.now_ns,
            })
        }
    }

    /// Runs everything due up to `now_ns() + ns`, each at its own time,
    /// then sets the clock to that time even if nothing was due.
    pub fn run_for(&mut self, ns: u64) -> Result<usize, StepLimit> {
        self.advance_to(self.now_ns.saturating_add(ns))
    }

    /// Runs everything due up to `target_ns`, each event at its own time,
    /// then sets the clock to `target_ns` (a target in the past only runs
    /// what is due now). Returns the rounds that did work; fails after
    /// [`MAX_ROUNDS_PER_INSTANT`] rounds without time moving (a livelock).
    pub fn advance_to(&mut self, target_ns: u64) -> Result<usize, StepLimit> {
        let mut rounds = 0;
        let mut rounds_at_instant = 0;
        loop {
            if self.round() {
                rounds += 1;
                rounds_at_instant += 1;
                if rounds_at_instant >= MAX_ROUNDS_PER_INSTANT {
                    return Err(StepLimit {
                        steps: rounds_at_instant,
                        now_ns: self.now_ns,
                    });
                }
                continue;
            }
            match self.next_event_ns() {
                Some(t) if t <= target_ns => {
                    self.set_now(t);
                    rounds_at_instant = 0;
                }
                _ => break,
            }
        }
        self.set_now(target_ns);
        Ok(rounds)
    }

    /// Phases 1–3 of a round at the current time; true if anything was
    /// done.
    fn round(&mut self) -> bool {
        let sent = self.transmit_queued();
        self.sync_multicast();
        let delivered = self.deliver_due();
        let fired = self.run_due_timers();
        sent || delivered || fired
    }

    /// Phase 1a: every device's queued frames go to the fabric, stamped now.
    fn transmit_queued(&mut self) -> bool {
        let now = self.now_ns;
        let mut sent = false;
        for node in &mut self.nodes {
            if node.device.tx_pending() == 0 {
                continue;
            }
            sent = true;
            let fabric = &mut self.fabric;
            let stray = &mut self.stray_frames;
            let ports = &node.fabric_ports;
            node.device.drain_tx(|port, frame| {
                match usize::from(port).checked_sub(1).and_then(|i| ports.get(i)) {
                    Some(&fabric_port) => fabric
                        .transmit(fabric_port, frame, now)
                        .expect("cluster ports are attached"),
                    None => *stray += 1,
                }
            });
        }
        sent
    }

    /// Phase 1b: every port's fabric group memberships follow its device.
    fn sync_multicast(&mut self) {
        for node in &mut self.nodes {
            for (i, &fabric_port) in node.fabric_ports.iter().enumerate() {
                let wanted = node.device.multicast_macs(i as u8 + 1);
                reconcile_groups(&mut self.fabric, fabric_port, &mut node.joined[i], wanted);
            }
        }
    }

    /// Phase 2: every frame due by now on a node's port goes to its device,
    /// earliest due first, ties to the lowest fabric port.
    fn deliver_due(&mut self) -> bool {
        let now = self.now_ns;
        let mut delivered = false;
        loop {
            let mut earliest: Option<(u64, Attachment)> = None;
            for a in &self.attachments {
                let due = self.fabric.next_due_ns(a.fabric_port).ok().flatten();
                if let Some(due) = due
                    && due <= now
                    && earliest.is_none_or(|(best, _)| due < best)
                {
                    earliest = Some((due, *a));
                }
            }
            let Some((_, a)) = earliest else {
                return delivered;
            };
            let device = &mut self.nodes[a.node].device;
            device.set_time(now);
            self.fabric
                .receive(a.fabric_port, now, |frame| {
                    device.receive(a.device_port, frame);
                })
                .expect("cluster ports are attached");
            delivered = true;
        }
    }

    /// Phase 3: every device timer due by now runs.
    fn run_due_timers(&mut self) -> bool {
        let now = self.now_ns;
        let mut fired = false;
        for node in &mut self.nodes {
            if Self::timer_of(&node.device).is_some_and(|t| t <= now) {
                node.device.handle_timeout(now);
                fired = true;
            }
        }
        fired
    }

    /// Starts recording the fabric's frames to `writer` as a pcap capture
    /// with virtual timestamps; `directions` says which records are
    /// written. Fails if a capture is running or the header cannot be
    /// written.
    pub fn capture_to<W: Write + Send + 'static>(
        &mut self,
        writer: W,
        directions: CaptureDirections,
    ) -> Result<(), CaptureError> {
        if self.capture.is_some() {
            return Err(CaptureError::AlreadyCapturing);
        }
        let pcap = PcapWriter::new(Box::new(writer) as Box<dyn CaptureSink>)?;
        let shared: SharedCapture = Arc::new(Mutex::new(Some(Capture {
            pcap,
            directions,
            error: None,
        })));
        let tap_side = Arc::clone(&shared);
        self.fabric.set_tap(Box::new(move |event| {
            if let Some(capture) = lock_capture(&tap_side).as_mut() {
                capture.record(event);
            }
        }));
        self.capture = Some(shared);
        Ok(())
    }

    /// Stops the capture, flushes its writer and hands it back; `W` is the
    /// type given to [`Cluster::capture_to`]. Fails with the first write
    /// error the capture met, if any.
    pub fn finish_capture<W: Write + Send + 'static>(&mut self) -> Result<W, CaptureError> {
        let shared = self.capture.take().ok_or(CaptureError::NotCapturing)?;
        drop(self.fabric.take_tap());
        let capture = lock_capture(&shared)
            .take()
            .expect("a running capture holds its writer");
        if let Some(e) = capture.error {
            return Err(e.into());
        }
        let mut pcap = capture.pcap;
        pcap.flush()?;
        <dyn CaptureSink>::into_any(pcap.into_inner())
            .downcast::<W>()
            .map(|writer| *writer)
            .map_err(|_| CaptureError::WrongWriterType)
    }
}

/// Makes `port`'s group memberships on `fabric` exactly `wanted`; `joined`
/// is what the port has joined so far (sorted) and is updated.
fn reconcile_groups(
    fabric: &mut Fabric,
    port: PortId,
    joined: &mut Vec<[u8; 6]>,
    mut wanted: Vec<[u8; 6]>,
) {
    wanted.sort_unstable();
    wanted.dedup();
    if *joined == wanted {
        return;
    }
    for group in joined.iter().filter(|g| wanted.binary_search(g).is_err()) {
        // Only group MACs are ever recorded as joined, so this cannot fail.
        let _ = fabric.leave_multicast(port, *group);
    }
    // A MAC the fabric refuses as a group is left out of `joined` (and
    // simply refused again on later rounds).
    wanted.retain(|group| {
        joined.binary_search(group).is_ok() || fabric.join_multicast(port, *group).is_ok()
    });
    *joined = wanted;
}

#[cfg(test)]
mod tests {
    use core::net::Ipv4Addr;

    use hca_prm::cmd::{CmdEntry, CmdStatus, InitHca, Opcode, Table};
    use hca_prm::regs::{CmdqConfig, offset};
    use hca_prm::{Le16, Le32, Le64};
    use ib_types::scalars::{PKey, PortState, Psn, QKey, Qpn};
    use zerocopy::{FromZeros, IntoBytes};

    use super::*;
    use crate::device::PortCounters;
    use crate::fabric::FaultConfig;
    use crate::host::BufferId;
    use crate::pcap::PcapReader;
    use crate::wire::bth::BthRepr;
    use crate::wire::eth::MacAddr;
    use crate::wire::ext::{DethRepr, ExtRepr};
    use crate::wire::{Opcode as WireOpcode, PacketRepr};

    const IP_A: [u8; 4] = [10, 0, 0, 1];
    const IP_B: [u8; 4] = [10, 0, 0, 2];
    const IP_PROBE: [u8; 4] = [10, 0, 0, 99];
    /// A QP number no test device has.
    const MISSING_QP: u32 = 0x123;
    const LATENCY_NS: u64 = FabricConfig::DEFAULT_LATENCY_NS;

    fn mac_of(ip: [u8; 4]) -> [u8; 6] {
        MacAddr::for_ipv4(Ipv4Addr::from(ip)).octets()
    }

    /// A valid RoCEv2 UD SEND ONLY frame from `src` to QP `dest_qp` at `dst`.
    fn ud_frame(src: [u8; 4], dst: [u8; 4], dest_qp: u32, payload: &[u8]) -> Vec<u8> {
        let repr = PacketRepr {
            dst_mac: MacAddr::for_ipv4(dst.into()),
            src_mac: MacAddr::for_ipv4(src.into()),
            src_ip: src.into(),
            dst_ip: dst.into(),
            tos: 0,
            ttl: 64,
            src_port: 0xC000,
            bth: BthRepr {
                opcode: WireOpcode::UdSendOnly,
                solicited: false,
                mig_req: false,
                pkey: PKey::DEFAULT,
                fecn: false,
                becn: false,
                dest_qp: Qpn::new(dest_qp).unwrap(),
                ack_req: false,
                psn: Psn::new(0).unwrap(),
            },
            ext: ExtRepr::Deth(DethRepr {
                qkey: QKey::new(0x1111_1111),
                src_qp: Qpn::new(0x42).unwrap(),
            }),
            payload_len: payload.len(),
        };
        let mut frame = vec![0; repr.buffer_len()];
        repr.emit(payload, &mut frame).unwrap();
        frame
    }

    /// Attaches a probe port of the test's own, at 10.0.0.99.
    fn attach_probe(cluster: &mut Cluster) -> PortId {
        cluster.fabric_mut().attach(mac_of(IP_PROBE)).unwrap()
    }

    /// The probe sends `frame` now.
    fn inject(cluster: &mut Cluster, probe: PortId, frame: &[u8]) {
        let now = cluster.now_ns();
        cluster.fabric_mut().transmit(probe, frame, now).unwrap();
    }

    fn port1(cluster: &mut Cluster, node: NodeId) -> PortCounters {
        cluster.device(node).port_counters(1).unwrap()
    }

    const PAGE: u64 = SIM_PAGE;

    /// Just enough of a driver to bring a port to ACTIVE and ask its state:
    /// a one-entry polled command queue and one page each of mailboxes and
    /// context tables.
    struct MiniDriver {
        node: NodeId,
        /// Page 0: the command queue; 1: input mailbox; 2: output mailbox.
        buffer: BufferId,
        input_bus: u64,
        output_bus: u64,
        submitted: u32,
    }

    impl MiniDriver {
        fn bring_up(cluster: &mut Cluster, node: NodeId) -> Self {
            let memory = cluster.memory(node);
            let buffer = memory.alloc(3 * PAGE as usize);
            let [cmdq_bus, input_bus, output_bus] =
                [0, 1, 2].map(|page| memory.map(buffer, page * PAGE, PAGE).unwrap());
            let device = cluster.device(node);
            device.mmio_write64(offset::CMDQ_BASE, cmdq_bus);
            let config = CmdqConfig {
                log_size: 0,
                enable: true,
            };
            device.mmio_write32(offset::CMDQ_CONFIG, config.to_bits());
            let mut driver = Self {
                node,
                buffer,
                input_bus,
                output_bus,
                submitted: 0,
            };

            let tables = memory.alloc(6 * PAGE as usize);
            let mut init = InitHca::new_zeroed();
            for (i, table) in init.tables.iter_mut().enumerate() {
                table.base = Le64::new(memory.map(tables, i as u64 * PAGE, PAGE).unwrap());
                // Two QPs (the special QPs of one port), one of the rest.
                table.log_count = u8::from(i == usize::from(Table::Qpc.code()));
            }
            init.num_uars = Le16::new(1);
            init.log_page_size = 12;
            driver.expect_ok(cluster, Opcode::InitHca, 0, init.as_bytes());
            driver.expect_ok(cluster, Opcode::InitPort, 1, &[]);
            driver
        }

        /// Runs one command; returns its status and the output mailbox.
        fn command(
            &mut self,
            cluster: &mut Cluster,
            opcode: Opcode,
            in_mod: u32,
            input: &[u8],
        ) -> (u8, Vec<u8>) {
            let memory = cluster.memory(self.node);
            memory.cpu_write(self.buffer, PAGE as usize, input);
            let entry = CmdEntry {
                opcode: Le16::new(opcode.code()),
                in_mod: Le32::new(in_mod),
                in_param: Le64::new(self.input_bus),
                in_len: Le32::new(input.len() as u32),
                out_param: Le64::new(self.output_bus),
                out_len: Le32::new(PAGE as u32),
                ..CmdEntry::default()
            };
            memory.cpu_write(self.buffer, 0, entry.as_bytes());
            self.submitted += 1;
            // Commands run inside the doorbell write.
            cluster
                .device(self.node)
                .mmio_write32(offset::CMDQ_DOORBELL, self.submitted);
            let mut done = CmdEntry::new_zeroed();
            memory.cpu_read(self.buffer, 0, done.as_mut_bytes());
            let mut output = vec![0; PAGE as usize];
            memory.cpu_read(self.buffer, 2 * PAGE as usize, &mut output);
            (done.status, output)
        }

        fn expect_ok(&mut self, cluster: &mut Cluster, opcode: Opcode, in_mod: u32, input: &[u8]) {
            let (status, _) = self.command(cluster, opcode, in_mod, input);
            assert_eq!(status, CmdStatus::Ok.code(), "{opcode:?}");
        }

        /// `QUERY_PORT`'s state byte (`PortInfo::state`, offset 0).
        fn port_state(&mut self, cluster: &mut Cluster, port: u8) -> u8 {
            let (status, output) = self.command(cluster, Opcode::QueryPort, port.into(), &[]);
            assert_eq!(status, CmdStatus::Ok.code());
            output[0]
        }
    }

    #[test]
    fn a_probe_frame_reaches_the_peer_device_and_is_counted() {
        let (mut cluster, a, b) = Cluster::pair(1);
        let probe = attach_probe(&mut cluster);

        inject(
            &mut cluster,
            probe,
            &ud_frame(IP_PROBE, IP_B, MISSING_QP, b"hello"),
        );
        assert_eq!(cluster.next_event_ns(), Some(LATENCY_NS));
        cluster.run_until_idle(100).unwrap();
        assert_eq!(cluster.now_ns(), LATENCY_NS, "delivered at its due time");
        let counters = port1(&mut cluster, b);
        assert_eq!(counters.rx_discards, 1, "no QP {MISSING_QP:#x} there");
        assert_eq!((counters.rx_errors, counters.rx_packets), (0, 0));
        assert_eq!(port1(&mut cluster, a), PortCounters::default());

        // One flipped bit in the payload breaks the ICRC.
        let mut corrupt = ud_frame(IP_PROBE, IP_B, MISSING_QP, b"hello");
        let last = corrupt.len() - 1;
        corrupt[last - 6] ^= 0x10;
        inject(&mut cluster, probe, &corrupt);
        cluster.run_until_idle(100).unwrap();
        let counters = port1(&mut cluster, b);
        assert_eq!((counters.rx_errors, counters.rx_discards), (1, 1));
        let b_port = cluster.fabric_port(b, 1).unwrap();
        assert_eq!(cluster.fabric().counters(b_port).unwrap().rx_frames, 2);
    }

    #[test]
    fn frames_a_device_queues_go_out_next_round() {
        let (mut cluster, a, b) = Cluster::pair(2);
        let frame = ud_frame(IP_A, IP_B, MISSING_QP, b"from a");
        cluster
            .device(a)
            .send_frame(1, |buf| buf.extend_from_slice(&frame));
        // A frame on a port the device does not have is counted, not sent.
        cluster
            .device(a)
            .send_frame(7, |buf| buf.extend_from_slice(&frame));
        assert_eq!(
            cluster.next_event_ns(),
            Some(0),
            "queued frames are due now"
        );

        assert!(cluster.step(), "round 1 transmits");
        assert_eq!(cluster.device(a).tx_pending(), 0);
        assert_eq!(cluster.stray_frames(), 1);
        let a_port = cluster.fabric_port(a, 1).unwrap();
        assert_eq!(cluster.fabric().counters(a_port).unwrap().tx_frames, 1);
        assert!(cluster.step(), "round 2 jumps to the arrival");
        assert_eq!(cluster.now_ns(), LATENCY_NS);
        assert!(cluster.step(), "round 3 delivers");
        assert_eq!(port1(&mut cluster, b).rx_discards, 1);
        assert!(!cluster.step(), "then idle");
    }

    #[test]
    fn link_flaps_reach_fabric_and_device() {
        let (mut cluster, _a, b) = Cluster::pair(3);
        let probe = attach_probe(&mut cluster);
        let b_port = cluster.fabric_port(b, 1).unwrap();
        let mut driver = MiniDriver::bring_up(&mut cluster, b);
        let active = PortState::Active.code();
        assert_eq!(driver.port_state(&mut cluster, 1), active);
        // No EQ is mapped, so each port change shows as an unmapped event.
        let events = |cluster: &mut Cluster| cluster.device(b).counters().unmapped_events;
        let after_init = events(&mut cluster);

        cluster.set_link(b, 1, false).unwrap();
        assert!(!cluster.fabric().link_up(b_port).unwrap());
        assert_eq!(driver.port_state(&mut cluster, 1), PortState::Down.code());
        assert_eq!(events(&mut cluster), after_init + 1);
        let frame = ud_frame(IP_PROBE, IP_B, MISSING_QP, b"x");
        inject(&mut cluster, probe, &frame);
        cluster.run_until_idle(100).unwrap();
        assert_eq!(port1(&mut cluster, b), PortCounters::default());
        let fabric_drops =
            |cluster: &Cluster| cluster.fabric().counters(b_port).unwrap().dropped_link_down;
        assert_eq!(fabric_drops(&cluster), 1);

        // A flap while a frame is in flight loses it.
        cluster.set_link(b, 1, true).unwrap();
        inject(&mut cluster, probe, &frame);
        cluster.run_for(LATENCY_NS / 2).unwrap();
        cluster.set_link(b, 1, false).unwrap();
        cluster.set_link(b, 1, true).unwrap();
        cluster.run_until_idle(100).unwrap();
        assert_eq!(fabric_drops(&cluster), 2);
        assert_eq!(port1(&mut cluster, b), PortCounters::default());
        assert_eq!(events(&mut cluster), after_init + 4);

        // Up again: frames arrive.
        assert_eq!(driver.port_state(&mut cluster, 1), active);
        inject(&mut cluster, probe, &frame);
        cluster.run_until_idle(100).unwrap();
        assert_eq!(port1(&mut cluster, b).rx_discards, 1);

        assert_eq!(
            cluster.set_link(b, 2, false),
            Err(ClusterError::NoSuchPort { node: b, port: 2 })
        );
    }

    /// Records of a capture: (timestamp, frame).
    fn records(pcap: &[u8]) -> Vec<(u64, Vec<u8>)> {
        let reader = PcapReader::new(pcap).unwrap();
        assert_eq!(reader.linktype(), crate::pcap::LINKTYPE_ETHERNET);
        reader
            .map(|r| r.map(|r| (r.timestamp_ns, r.data.to_vec())).unwrap())
            .collect()
    }

    #[test]
    fn capture_records_each_direction_once() {
        for (directions, expected) in [
            (CaptureDirections::Transmitted, 3),
            (CaptureDirections::Both, 5),
        ] {
            let (mut cluster, _a, _b) = Cluster::pair(4);
            let probe = attach_probe(&mut cluster);
            cluster.capture_to(Vec::new(), directions).unwrap();
            assert!(matches!(
                cluster.capture_to(Vec::new(), directions),
                Err(CaptureError::AlreadyCapturing)
            ));
            let to_a = ud_frame(IP_PROBE, IP_A, MISSING_QP, b"a");
            let to_b = ud_frame(IP_PROBE, IP_B, MISSING_QP, b"b");
            let to_nobody = ud_frame(IP_PROBE, [10, 0, 0, 77], MISSING_QP, b"?");
            inject(&mut cluster, probe, &to_a);
            cluster.run_for(10_000).unwrap();
            inject(&mut cluster, probe, &to_b);
            inject(&mut cluster, probe, &to_nobody);
            cluster.run_until_idle(100).unwrap();

            let pcap: Vec<u8> = cluster.finish_capture().unwrap();
            let got = records(&pcap);
            assert_eq!(got.len(), expected, "{directions:?}");
            let tx = [(0, to_a), (10_000, to_b.clone()), (10_000, to_nobody)];
            if directions == CaptureDirections::Transmitted {
                assert_eq!(got, tx);
            } else {
                // The unknown destination is lost: it shows once.
                assert_eq!(got[..2], [tx[0].clone(), (LATENCY_NS, tx[0].1.clone())]);
                assert_eq!(got[2..4], tx[1..]);
                assert_eq!(got[4], (10_000 + LATENCY_NS, to_b));
            }
            assert!(matches!(
                cluster.finish_capture::<Vec<u8>>(),
                Err(CaptureError::NotCapturing)
            ));
        }
    }

    #[test]
    fn finishing_with_the_wrong_writer_type_is_an_error() {
        let (mut cluster, _a, _b) = Cluster::pair(5);
        cluster
            .capture_to(io::Cursor::new(Vec::new()), CaptureDirections::Both)
            .unwrap();
        assert!(matches!(
            cluster.finish_capture::<Vec<u8>>(),
            Err(CaptureError::WrongWriterType)
        ));
    }

    #[test]
    fn a_failing_writer_is_reported_at_the_end() {
        /// Accepts the pcap header, then fails.
        struct HeaderOnly(usize);
        impl Write for HeaderOnly {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                if self.0 >= 24 {
                    return Err(io::Error::other("disk full"));
                }
                self.0 += buf.len();
                Ok(buf.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let (mut cluster, _a, _b) = Cluster::pair(6);
        let probe = attach_probe(&mut cluster);
        cluster
            .capture_to(HeaderOnly(0), CaptureDirections::Transmitted)
            .unwrap();
        inject(&mut cluster, probe, &ud_frame(IP_PROBE, IP_A, 5, b""));
        cluster.run_until_idle(10).unwrap();
        assert!(matches!(
            cluster.finish_capture::<HeaderOnly>(),
            Err(CaptureError::Io(_))
        ));
    }

    /// A seeded workload on a faulty fabric with three nodes (one with two
    /// ports), a probe, link flaps and device-sent frames. Returns the
    /// capture, every device port's counters, the fabric's totals, and
    /// the final time.
    fn scripted_run(seed: u64) -> (Vec<u8>, Vec<PortCounters>, crate::fabric::PortCounters, u64) {
        let fabric = FabricConfig {
            faults: FaultConfig {
                drop_ppm: 50_000,
                duplicate_ppm: 50_000,
                reorder_ppm: 200_000,
                reorder_window_ns: 5_000,
                corrupt_ppm: 100_000,
            },
            ..FabricConfig::default()
        };
        let (mut cluster, a, b) = Cluster::pair_with(fabric, seed);
        let ip_c1 = [10, 0, 0, 3];
        let ip_c2 = [10, 0, 1, 3];
        let c = cluster
            .add_node(DeviceConfig::with_ports(
                0x0002_C900_0000_3000,
                &[ip_c1, ip_c2],
            ))
            .unwrap();
        let probe = attach_probe(&mut cluster);
        cluster
            .capture_to(Vec::new(), CaptureDirections::Both)
            .unwrap();

        let ports = [(a, 1, IP_A), (b, 1, IP_B), (c, 1, ip_c1), (c, 2, ip_c2)];
        let mut rng = cluster.rng_stream(1);
        for i in 0..300u32 {
            let (to_node, to_port, to_ip) = ports[rng.below(4) as usize];
            let payload = i.to_le_bytes();
            if rng.chance_ppm(500_000) {
                inject(
                    &mut cluster,
                    probe,
                    &ud_frame(IP_PROBE, to_ip, MISSING_QP, &payload),
                );
            } else {
                // A device sends: to another node's port, or to the probe
                // (which the cluster leaves queued: it is the test's port).
                let (from_node, from_port, from_ip) = ports[rng.below(4) as usize];
                let to_ip = if from_node == to_node {
                    IP_PROBE
                } else {
                    to_ip
                };
                let frame = ud_frame(from_ip, to_ip, MISSING_QP, &payload);
                cluster
                    .device(from_node)
                    .send_frame(from_port, |buf| buf.extend_from_slice(&frame));
            }
            if rng.chance_ppm(30_000) {
                let up = rng.chance_ppm(500_000);
                cluster.set_link(to_node, to_port, up).unwrap();
            }
            cluster.run_for(rng.below(3_000)).unwrap();
        }
        for &(node, port, _) in &ports {
            cluster.set_link(node, port, true).unwrap();
        }
        cluster.run_until_idle(10_000).unwrap();
        assert!(cluster.is_idle());

        let totals = cluster.fabric().total_counters();
        assert_eq!(
            totals.tx_frames + totals.replicated + totals.duplicated,
            totals.rx_frames + totals.dropped() + cluster.fabric().queued_frames() as u64,
            "seed {seed}: the fabric conserves frames"
        );
        let counters = ports
            .iter()
            .map(|&(node, port, _)| cluster.device(node).port_counters(port).unwrap())
            .collect();
        let now = cluster.now_ns();
        (cluster.finish_capture().unwrap(), counters, totals, now)
    }

    #[test]
    fn same_seed_same_run() {
        let first = scripted_run(42);
        let second = scripted_run(42);
        assert_eq!(first, second, "seed 42 is not reproducible");

        let (pcap, counters, totals, _) = &first;
        // The workload exercised what it meant to.
        assert!(records(pcap).len() > 300);
        assert!(totals.dropped_fault > 0 && totals.corrupted > 0 && totals.reordered > 0);
        assert!(counters.iter().all(|c| c.rx_discards > 0));
        assert!(counters.iter().any(|c| c.rx_errors > 0));

        let other = scripted_run(43);
        assert_ne!(first.0, other.0, "another seed, another run");
    }

    #[test]
    fn run_until_idle_terminates_and_reports_a_step_limit() {
        let mut empty = Cluster::new(FabricConfig::default(), 0);
        assert_eq!(empty.run_until_idle(0), Ok(0));
        assert!(!empty.step());

        let (mut cluster, _a, b) = Cluster::pair(7);
        let probe = attach_probe(&mut cluster);
        for i in 0..10u8 {
            inject(
                &mut cluster,
                probe,
                &ud_frame(IP_PROBE, IP_B, MISSING_QP, &[i]),
            );
            cluster.advance_to(cluster.now_ns() + 100).unwrap();
        }
        // The frame sent at 0 arrived at 1000; one step jumps to the next.
        assert_eq!(port1(&mut cluster, b).rx_discards, 1);
        assert_eq!(
            cluster.run_until_idle(1),
            Err(StepLimit {
                steps: 1,
                now_ns: 1_100
            })
        );
        let steps = cluster.run_until_idle(1_000).unwrap();
        assert!(steps > 0 && steps < 1_000, "{steps} steps");
        assert!(cluster.is_idle());
        assert_eq!(cluster.run_until_idle(1_000), Ok(0));
        assert_eq!(port1(&mut cluster, b).rx_discards, 10);
        assert_eq!(cluster.now_ns(), 900 + LATENCY_NS);
    }

    #[test]
    fn run_for_processes_events_on_the_way_and_keeps_clocks_together() {
        let (mut cluster, a, b) = Cluster::pair(8);
        let probe = attach_probe(&mut cluster);
        cluster
            .capture_to(Vec::new(), CaptureDirections::Both)
            .unwrap();
        inject(
            &mut cluster,
            probe,
            &ud_frame(IP_PROBE, IP_B, MISSING_QP, b"1"),
        );
        cluster.run_for(10 * LATENCY_NS).unwrap();
        assert_eq!(cluster.now_ns(), 10 * LATENCY_NS);
        assert_eq!(cluster.device(a).now_ns(), 10 * LATENCY_NS);
        assert_eq!(cluster.device(b).now_ns(), 10 * LATENCY_NS);
        assert_eq!(port1(&mut cluster, b).rx_discards, 1);
        // Time never goes back.
        cluster.advance_to(5).unwrap();
        assert_eq!(cluster.now_ns(), 10 * LATENCY_NS);

        let pcap: Vec<u8> = cluster.finish_capture().unwrap();
        let stamps: Vec<u64> = records(&pcap).iter().map(|r| r.0).collect();
        assert_eq!(stamps, [0, LATENCY_NS], "received at its arrival time");
    }

    #[test]
    fn nodes_get_disjoint_seeded_bus_addresses() {
        let first_mapping = |seed: u64| -> Vec<u64> {
            let (cluster, a, b) = Cluster::pair(seed);
            [a, b]
                .iter()
                .map(|&node| {
                    let memory = cluster.memory(node);
                    let buffer = memory.alloc(PAGE as usize);
                    memory.map(buffer, 0, PAGE).unwrap()
                })
                .collect()
        };
        let mut offsets = Vec::new();
        for seed in 0..8 {
            let bus = first_mapping(seed);
            assert_eq!(bus, first_mapping(seed), "seed {seed}");
            for (node, &addr) in bus.iter().enumerate() {
                let span_start = (node as u64 + 1) * NODE_BUS_SPAN;
                assert!((span_start..span_start + MAX_BUS_OFFSET).contains(&addr));
                assert_eq!(addr % PAGE, 0);
                offsets.push(addr - span_start);
            }
        }
        offsets.sort_unstable();
        offsets.dedup();
        assert!(offsets.len() > 8, "offsets follow the seed: {offsets:x?}");
    }

    #[test]
    fn a_clashing_node_is_refused_whole() {
        let (mut cluster, _a, _b) = Cluster::pair(9);
        let ports_before = cluster.fabric().port_count();
        let clash = DeviceConfig::with_ports(0x77, &[[10, 0, 0, 5], IP_B]);
        assert_eq!(
            cluster.add_node(clash),
            Err(ClusterError::MacInUse { mac: mac_of(IP_B) })
        );
        let twins = DeviceConfig::with_ports(0x78, &[[10, 0, 0, 5], [10, 0, 0, 5]]);
        assert_eq!(
            cluster.add_node(twins),
            Err(ClusterError::MacInUse {
                mac: mac_of([10, 0, 0, 5])
            })
        );
        assert_eq!(cluster.fabric().port_count(), ports_before);
        assert_eq!(cluster.nodes().len(), 2);

        // A clash with a port the test attached itself is the fabric's call.
        let probe = attach_probe(&mut cluster);
        let err = cluster
            .add_node(DeviceConfig::with_ports(0x79, &[[10, 0, 0, 6], IP_PROBE]))
            .unwrap_err();
        assert!(matches!(
            err,
            ClusterError::Fabric(FabricError::MacInUse { port, .. }) if port == probe
        ));
        assert_eq!(cluster.nodes().len(), 2);
    }

    #[test]
    fn group_memberships_follow_what_the_device_wants() {
        const G1: [u8; 6] = [0x01, 0x00, 0x5E, 0x00, 0x00, 0x01];
        const G2: [u8; 6] = [0x01, 0x00, 0x5E, 0x00, 0x00, 0x02];
        let mut fabric = Fabric::new(FabricConfig::default(), 0);
        let member = fabric.attach(mac_of(IP_A)).unwrap();
        let sender = fabric.attach(mac_of(IP_B)).unwrap();
        let reaches_member = |fabric: &mut Fabric, group: [u8; 6]| {
            let mut frame = vec![0; 60];
            frame[..6].copy_from_slice(&group);
            let before = fabric.queued_frames();
            fabric.transmit(sender, &frame, 0).unwrap();
            let queued = fabric.queued_frames() > before;
            while fabric.receive(member, u64::MAX, |_| ()).unwrap().is_some() {}
            queued
        };

        let mut joined = Vec::new();
        reconcile_groups(&mut fabric, member, &mut joined, vec![G2, G1, G2]);
        assert_eq!(joined, [G1, G2]);
        assert!(reaches_member(&mut fabric, G1) && reaches_member(&mut fabric, G2));

        reconcile_groups(&mut fabric, member, &mut joined, vec![G2]);
        assert_eq!(joined, [G2]);
        assert!(!reaches_member(&mut fabric, G1) && reaches_member(&mut fabric, G2));

        // Not a multicast group: refused, not recorded.
        reconcile_groups(&mut fabric, member, &mut joined, vec![BROADCAST, G2]);
        assert_eq!(joined, [G2]);
        reconcile_groups(&mut fabric, member, &mut joined, Vec::new());
        assert!(joined.is_empty() && !reaches_member(&mut fabric, G2));
    }
    const BROADCAST: [u8; 6] = crate::fabric::BROADCAST_MAC;

    #[test]
    fn the_irq_log_keeps_vectors_in_order_until_taken() {
        let (cluster, a, _b) = Cluster::pair(10);
        let log = cluster.interrupt_log(a);
        log.raise(3);
        log.raise(1);
        log.raise(3);
        assert_eq!(log.pending(), 3);
        assert_eq!(cluster.interrupts(a), [3, 1, 3]);
        assert!(cluster.interrupts(a).is_empty());
        // Taking an empty log skips its lock; a vector raised after that
        // is still taken next time.
        assert!(cluster.interrupts(a).is_empty());
        log.raise(2);
        assert_eq!(log.pending(), 1);
        assert_eq!(cluster.interrupts(a), [2]);
        assert_eq!(log.pending(), 0);
    }

    #[test]
    fn rng_streams_depend_only_on_seed_and_name() {
        let (x, _, _) = Cluster::pair(11);
        let (y, _, _) = Cluster::pair(11);
        assert_eq!(x.rng_stream(5), y.rng_stream(5));
        assert_ne!(x.rng_stream(5), x.rng_stream(6));
        assert_ne!(x.rng_stream(5), Cluster::pair(12).0.rng_stream(5));
        assert_eq!(x.seed(), 11);
    }
}
