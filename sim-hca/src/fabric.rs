//! The simulated Ethernet switch that connects simulated HCA ports.
//!
//! Contract:
//! - **Frames are opaque bytes.** A frame is an Ethernet II frame without FCS:
//!   destination MAC in bytes `0..6`, source MAC in `6..12`, EtherType in
//!   `12..14`. The fabric reads only the destination MAC; it knows nothing of
//!   IP, UDP or InfiniBand. Frames shorter than the Ethernet header or longer
//!   than [`FabricConfig::max_frame_len`] are dropped and counted, never a
//!   panic.
//! - **Sans-IO and deterministic.** Time is passed in as `now_ns` (virtual
//!   nanoseconds); the fabric never reads a clock. Every random decision draws
//!   from the fabric's own [`Rng`], seeded at construction, in a fixed order,
//!   so the same seed and the same calls give the same deliveries, byte for
//!   byte. [`Fabric::next_event_ns`] says when the next frame becomes due so a
//!   stepper can jump virtual time straight there.
//! - **Forwarding.** A unicast destination MAC goes to the one port attached
//!   with that MAC; a group MAC (low bit of the first byte set) goes to every
//!   port that joined that group; the broadcast MAC goes to every port. The
//!   switch never sends a frame back out of the port it came in on (no
//!   hairpin). A frame with no destination is dropped and counted. Copies go
//!   out in ascending port order.
//! - **Delivery.** Each copy becomes due at the receiver `latency_ns` after
//!   it was transmitted, plus a random extra delay when the fault injector
//!   reorders it. [`Fabric::receive`] hands out one due frame at a time, in
//!   (due time, transmit order) order.
//! - **Faults** ([`FaultConfig`], all off by default) are decided per copy,
//!   at the receiving port: drop, corrupt one bit past the Ethernet header,
//!   duplicate, reorder. Link state is set by the caller ([`Fabric::set_link`])
//!   so flaps are scheduled by the simulation from its own seed.
//! - **Accounting.** Every frame and copy is counted exactly once in the
//!   [`PortCounters`] of the port it is charged to, so that at every moment,
//!   summed over all ports ([`Fabric::total_counters`]):
//!
//!   `tx_frames + replicated + duplicated = rx_frames + dropped() + queued`
//!
//!   where `queued` is [`Fabric::queued_frames`].
//! - **No allocation per frame in steady state.** Frame bytes live in pooled
//!   buffers, each sized for the largest accepted frame, that return to a
//!   free list after delivery or drop; the pool allocates only when more
//!   copies are queued at once than ever before
//!   ([`Fabric::buffer_allocations`]).
//! - **Capture.** A tap ([`Fabric::set_tap`]) sees every frame a port hands to
//!   [`Fabric::transmit`] (before any fault) and every frame a port receives
//!   (after faults), which is what a pcap writer records.
//!
//! The fabric is a plain `Send` struct driven through `&mut self`; callers
//! that share it between threads wrap it in a lock.

use std::collections::binary_heap::PeekMut;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt;

use crate::rng::Rng;

/// Length of an Ethernet II header: destination MAC, source MAC, EtherType.
pub const ETHERNET_HEADER_LEN: usize = 14;

/// The broadcast MAC address.
pub const BROADCAST_MAC: [u8; 6] = [0xFF; 6];

/// True for a group (multicast or broadcast) MAC: the I/G bit, the low bit
/// of the first byte, is set.
pub const fn is_group_mac(mac: &[u8; 6]) -> bool {
    mac[0] & 0x01 != 0
}

/// Fault injection rates. Probabilities are in parts per million per frame
/// copy; 0 disables a fault, 1 000 000 or more makes it certain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultConfig {
    /// Chance that a copy is lost on its way to the receiver.
    pub drop_ppm: u32,
    /// Chance that a copy is delivered twice, back to back.
    pub duplicate_ppm: u32,
    /// Chance that a copy is delayed by an extra `1..=reorder_window_ns`
    /// nanoseconds, so frames sent after it can overtake it.
    pub reorder_ppm: u32,
    /// Upper bound of the extra delay of a reordered copy; 0 disables
    /// reordering whatever `reorder_ppm` says.
    pub reorder_window_ns: u64,
    /// Chance that one random bit is flipped in one random byte at offset 14
    /// or later. The Ethernet header is never touched, so the copy still
    /// reaches its port and the receiver's ICRC check has to reject it.
    /// Frames with nothing past the header are never corrupted.
    pub corrupt_ppm: u32,
}

/// Static configuration of a [`Fabric`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FabricConfig {
    /// Time from transmit to the copy being due at its receiver.
    pub latency_ns: u64,
    /// Longest frame accepted (Ethernet header included, FCS excluded);
    /// longer ones are dropped as malformed.
    pub max_frame_len: usize,
    /// Most copies waiting for one receiving port; copies beyond it are
    /// tail-dropped, as a switch with full egress buffers would.
    pub port_queue_limit: usize,
    /// Fault injection rates.
    pub faults: FaultConfig,
}

impl FabricConfig {
    /// Default one-hop latency: 1 µs.
    pub const DEFAULT_LATENCY_NS: u64 = 1_000;
    /// Default largest frame: 9216 bytes, a common switch jumbo limit.
    pub const DEFAULT_MAX_FRAME_LEN: usize = 9_216;
    /// Default egress queue depth per port, in frames.
    pub const DEFAULT_PORT_QUEUE_LIMIT: usize = 4_096;
}

impl Default for FabricConfig {
    fn default() -> Self {
        Self {
            latency_ns: Self::DEFAULT_LATENCY_NS,
            max_frame_len: Self::DEFAULT_MAX_FRAME_LEN,
            port_queue_limit: Self::DEFAULT_PORT_QUEUE_LIMIT,
            faults: FaultConfig::default(),
        }
    }
}

/// A port attached to a [`Fabric`]: an index into its ports, in attach order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortId(u32);

impl PortId {
    /// The port's index: 0 for the first port attached, then 1, 2, ...
    pub const fn index(self) -> u32 {
        self.0
    }
}

impl fmt::Display for PortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "port {}", self.0)
    }
}

/// Which way a frame crossed a port, as seen by the [`TapEvent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The port handed the frame to the fabric.
    Tx,
    /// The fabric handed the frame to the port.
    Rx,
}

/// One frame seen by the capture tap.
#[derive(Debug, Clone, Copy)]
pub struct TapEvent<'a> {
    /// The port the frame left or reached.
    pub port: PortId,
    /// Transmit or receive.
    pub direction: Direction,
    /// The `now_ns` of the [`Fabric::transmit`] or [`Fabric::receive`] call.
    /// A stepper that receives at [`Fabric::next_event_ns`] gets the exact
    /// arrival time.
    pub now_ns: u64,
    /// The frame bytes: as transmitted for `Tx`, as delivered (possibly
    /// corrupted) for `Rx`.
    pub frame: &'a [u8],
}

/// The capture callback installed with [`Fabric::set_tap`].
pub type Tap = Box<dyn FnMut(TapEvent<'_>) + Send>;

/// Per-port counters. Each frame or copy is charged to exactly one port for
/// each event: transmit-side events to the sender, delivery-side events to
/// the receiver. See the module docs for the conservation identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PortCounters {
    /// Frames the port handed to [`Fabric::transmit`], malformed ones included.
    pub tx_frames: u64,
    /// Bytes of those frames.
    pub tx_bytes: u64,
    /// Frames delivered to the port by [`Fabric::receive`].
    pub rx_frames: u64,
    /// Bytes of those frames.
    pub rx_bytes: u64,
    /// Sender side: frames shorter than the Ethernet header or longer than
    /// the configured maximum.
    pub dropped_malformed: u64,
    /// Sender side: frames no port would receive (unknown unicast MAC, a
    /// group nobody else joined, the sender's own MAC, or broadcast with no
    /// other port).
    pub dropped_unknown_dest: u64,
    /// Frames transmitted while the sender's link was down (charged to the
    /// sender), and copies headed for a port whose link was down when they
    /// were sent or went down before they arrived (charged to the receiver).
    pub dropped_link_down: u64,
    /// Receiver side: copies lost to the fault injector.
    pub dropped_fault: u64,
    /// Receiver side: copies tail-dropped because the port's queue was full.
    pub dropped_queue_full: u64,
    /// Sender side: extra copies made by group and broadcast fan-out (the
    /// number of destinations minus one, per forwarded frame).
    pub replicated: u64,
    /// Receiver side: copies the fault injector duplicated.
    pub duplicated: u64,
    /// Receiver side: copies the fault injector delayed.
    pub reordered: u64,
    /// Receiver side: copies the fault injector corrupted.
    pub corrupted: u64,
}

impl PortCounters {
    /// All frames and copies dropped, for whatever reason.
    pub const fn dropped(&self) -> u64 {
        self.dropped_malformed
            + self.dropped_unknown_dest
            + self.dropped_link_down
            + self.dropped_fault
            + self.dropped_queue_full
    }

    /// Adds every counter of `other` to this one.
    fn accumulate(&mut self, other: &PortCounters) {
        self.tx_frames += other.tx_frames;
        self.tx_bytes += other.tx_bytes;
        self.rx_frames += other.rx_frames;
        self.rx_bytes += other.rx_bytes;
        self.dropped_malformed += other.dropped_malformed;
        self.dropped_unknown_dest += other.dropped_unknown_dest;
        self.dropped_link_down += other.dropped_link_down;
        self.dropped_fault += other.dropped_fault;
        self.dropped_queue_full += other.dropped_queue_full;
        self.replicated += other.replicated;
        self.duplicated += other.duplicated;
        self.reordered += other.reordered;
        self.corrupted += other.corrupted;
    }
}

/// Why a fabric call was refused. Dropped frames are not errors; they are
/// counted in [`PortCounters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FabricError {
    /// The port id was not handed out by this fabric.
    #[error("{0} is not attached to this fabric")]
    UnknownPort(PortId),
    /// Another port is already attached with this MAC.
    #[error("MAC {} is already attached as {port}", MacText(.mac))]
    MacInUse {
        /// The MAC asked for.
        mac: [u8; 6],
        /// The port that has it.
        port: PortId,
    },
    /// A port's own address must be unicast.
    #[error("MAC {} is a group address, not a port address", MacText(.0))]
    NotUnicast([u8; 6]),
    /// Only multicast group MACs can be joined (not unicast, not broadcast).
    #[error("MAC {} is not a multicast group address", MacText(.0))]
    NotMulticast([u8; 6]),
    /// The fabric already has `u32::MAX` ports.
    #[error("no more ports can be attached")]
    PortLimit,
}

/// Formats a MAC as `aa:bb:cc:dd:ee:ff`.
struct MacText<'a>(&'a [u8; 6]);

impl fmt::Display for MacText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

/// A copy on its way to a port.
#[derive(Debug)]
struct InFlight {
    /// When the copy may be received.
    due_ns: u64,
    /// Fabric-wide enqueue order; breaks ties between equal due times.
    seq: u64,
    /// The bytes, in a pooled buffer.
    frame: Vec<u8>,
}

impl InFlight {
    fn order_key(&self) -> (u64, u64) {
        (self.due_ns, self.seq)
    }
}

impl PartialEq for InFlight {
    fn eq(&self, other: &Self) -> bool {
        self.order_key() == other.order_key()
    }
}

impl Eq for InFlight {}

impl PartialOrd for InFlight {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for InFlight {
    /// Reversed, so the max-heap `BinaryHeap` yields the earliest copy first.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.order_key().cmp(&self.order_key())
    }
}

/// One attached port.
#[derive(Debug)]
struct Port {
    /// The port's unicast MAC.
    mac: [u8; 6],
    /// Link state; a new port's link is up.
    link_up: bool,
    /// Copies headed for this port, earliest first.
    queue: BinaryHeap<InFlight>,
    /// This port's counters.
    counters: PortCounters,
}

/// A free list of frame buffers.
///
/// Every buffer is created with room for the largest accepted frame, so a
/// reused buffer never grows: the pool allocates only when more copies are
/// queued at once than ever before, and its allocation count is the
/// high-water mark of queued copies.
#[derive(Debug, Default)]
struct FramePool {
    /// Buffers ready for reuse, empty, each with room for any frame.
    free: Vec<Vec<u8>>,
    /// Buffers created.
    allocations: u64,
}

impl FramePool {
    /// A buffer holding a copy of `frame` (at most `max_frame_len` bytes),
    /// reused from the free list when one is there.
    fn copy_of(&mut self, frame: &[u8], max_frame_len: usize) -> Vec<u8> {
        let mut buffer = self.free.pop().unwrap_or_else(|| {
            self.allocations += 1;
            Vec::with_capacity(max_frame_len.max(frame.len()))
        });
        buffer.extend_from_slice(frame);
        buffer
    }

    /// Returns a buffer to the free list.
    fn recycle(&mut self, mut buffer: Vec<u8>) {
        buffer.clear();
        self.free.push(buffer);
    }
}

/// Where one copy goes and what the fault injector did to it.
#[derive(Debug, Clone, Copy)]
struct CopyPlan {
    /// When the copy becomes due.
    due_ns: u64,
    /// Byte offset and bit to flip, if corrupted.
    flip: Option<(usize, u8)>,
    /// Whether a second copy follows.
    duplicate: bool,
}

/// A simulated Ethernet switch. See the module docs for the contract.
pub struct Fabric {
    config: FabricConfig,
    rng: Rng,
    ports: Vec<Port>,
    /// Unicast MAC to port.
    stations: BTreeMap<[u8; 6], PortId>,
    /// Group MAC to its members, sorted ascending, no duplicates.
    groups: BTreeMap<[u8; 6], Vec<PortId>>,
    pool: FramePool,
    /// Scratch list of the current frame's destinations (reused, so routing
    /// does not allocate per frame).
    destinations: Vec<PortId>,
    /// Next enqueue sequence number.
    next_seq: u64,
    tap: Option<Tap>,
}

impl fmt::Debug for Fabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fabric")
            .field("config", &self.config)
            .field("ports", &self.ports.len())
            .field("groups", &self.groups.len())
            .field("queued_frames", &self.queued_frames())
            .field("buffer_allocations", &self.pool.allocations)
            .field("tap", &self.tap.is_some())
            .finish_non_exhaustive()
    }
}

// The fabric moves between threads (behind the caller's lock).
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<Fabric>();
};

impl Fabric {
    /// An empty fabric. All of its random decisions come from `seed`.
    pub fn new(config: FabricConfig, seed: u64) -> Self {
        Self {
            config,
            rng: Rng::from_seed(seed),
            ports: Vec::new(),
            stations: BTreeMap::new(),
            groups: BTreeMap::new(),
            pool: FramePool::default(),
            destinations: Vec::new(),
            next_seq: 0,
            tap: None,
        }
    }

    /// The configuration the fabric runs with.
    pub fn config(&self) -> &FabricConfig {
        &self.config
    }

    /// Changes the fault rates from now on (e.g. a faulty phase followed by
    /// a clean liveness phase). Copies already queued keep their fate.
    pub fn set_faults(&mut self, faults: FaultConfig) {
        self.config.faults = faults;
    }

    /// Attaches a new port with unicast address `mac`; its link is up.
    pub fn attach(&mut self, mac: [u8; 6]) -> Result<PortId, FabricError> {
        if is_group_mac(&mac) {
            return Err(FabricError::NotUnicast(mac));
        }
        if let Some(&port) = self.stations.get(&mac) {
            return Err(FabricError::MacInUse { mac, port });
        }
        let index = u32::try_from(self.ports.len()).map_err(|_| FabricError::PortLimit)?;
        let port = PortId(index);
        self.ports.push(Port {
            mac,
            link_up: true,
            queue: BinaryHeap::new(),
            counters: PortCounters::default(),
        });
        self.stations.insert(mac, port);
        Ok(port)
    }

    /// The number of attached ports.
    pub fn port_count(&self) -> usize {
        self.ports.len()
    }

    /// The unicast MAC `port` was attached with.
    pub fn mac(&self, port: PortId) -> Result<[u8; 6], FabricError> {
        Ok(self.port(port)?.mac)
    }

    /// Makes `port` receive frames sent to the multicast MAC `group`.
    /// Joining twice is the same as joining once.
    pub fn join_multicast(&mut self, port: PortId, group: [u8; 6]) -> Result<(), FabricError> {
        self.port(port)?;
        if !is_group_mac(&group) || group == BROADCAST_MAC {
            return Err(FabricError::NotMulticast(group));
        }
        let members = self.groups.entry(group).or_default();
        if let Err(position) = members.binary_search(&port) {
            members.insert(position, port);
        }
        Ok(())
    }

    /// Stops `port` receiving frames sent to `group`. Copies already queued
    /// for the port still arrive. Leaving a group not joined does nothing.
    pub fn leave_multicast(&mut self, port: PortId, group: [u8; 6]) -> Result<(), FabricError> {
        self.port(port)?;
        if !is_group_mac(&group) || group == BROADCAST_MAC {
            return Err(FabricError::NotMulticast(group));
        }
        if let Some(members) = self.groups.get_mut(&group) {
            if let Ok(position) = members.binary_search(&port) {
                members.remove(position);
            }
            if members.is_empty() {
                self.groups.remove(&group);
            }
        }
        Ok(())
    }

    /// Brings `port`'s link up or down at `now_ns`.
    ///
    /// While the link is down the port's transmissions are dropped and no
    /// copies are sent to it. Taking the link down also loses the copies
    /// still in flight to the port (due after `now_ns`); copies that had
    /// arrived by `now_ns` stay receivable. Frames the port sent before the
    /// link went down are already in the switch and still arrive.
    pub fn set_link(&mut self, port: PortId, up: bool, now_ns: u64) -> Result<(), FabricError> {
        let index = self.port_index(port)?;
        let port = &mut self.ports[index];
        port.link_up = up;
        if up {
            return Ok(());
        }
        let mut entries = std::mem::take(&mut port.queue).into_vec();
        let before = entries.len();
        entries.retain_mut(|entry| {
            let in_flight = entry.due_ns > now_ns;
            if in_flight {
                self.pool.recycle(std::mem::take(&mut entry.frame));
            }
            !in_flight
        });
        port.counters.dropped_link_down += (before - entries.len()) as u64;
        port.queue = BinaryHeap::from(entries);
        Ok(())
    }

    /// Whether `port`'s link is up.
    pub fn link_up(&self, port: PortId) -> Result<bool, FabricError> {
        Ok(self.port(port)?.link_up)
    }

    /// Installs the capture tap, replacing any previous one.
    pub fn set_tap(&mut self, tap: Tap) {
        self.tap = Some(tap);
    }

    /// Removes the capture tap and hands it back (e.g. to flush a writer).
    pub fn take_tap(&mut self) -> Option<Tap> {
        self.tap.take()
    }

    /// `from` sends `frame` at `now_ns`.
    ///
    /// The frame is copied, so the caller's buffer is free on return. It is
    /// shown to the tap, checked, forwarded and put through fault injection
    /// per copy; every outcome, a drop included, is counted rather than
    /// reported, so the only error is an unknown port.
    pub fn transmit(&mut self, from: PortId, frame: &[u8], now_ns: u64) -> Result<(), FabricError> {
        let sender = self.port_index(from)?;
        let counters = &mut self.ports[sender].counters;
        counters.tx_frames += 1;
        counters.tx_bytes += frame.len() as u64;
        if let Some(tap) = self.tap.as_mut() {
            tap(TapEvent {
                port: from,
                direction: Direction::Tx,
                now_ns,
                frame,
            });
        }

        let destination = match frame.first_chunk::<6>() {
            Some(mac)
                if frame.len() >= ETHERNET_HEADER_LEN
                    && frame.len() <= self.config.max_frame_len =>
            {
                *mac
            }
            _ => {
                self.ports[sender].counters.dropped_malformed += 1;
                return Ok(());
            }
        };
        if !self.ports[sender].link_up {
            self.ports[sender].counters.dropped_link_down += 1;
            return Ok(());
        }

        let mut destinations = std::mem::take(&mut self.destinations);
        self.route(from, &destination, &mut destinations);
        match destinations.len() {
            0 => self.ports[sender].counters.dropped_unknown_dest += 1,
            fan_out => self.ports[sender].counters.replicated += fan_out as u64 - 1,
        }
        for &to in &destinations {
            self.forward_copy(to, frame, now_ns);
        }
        self.destinations = destinations;
        Ok(())
    }

    /// Hands `port` its next frame due by `now_ns`, if any.
    ///
    /// The frame is lent to `consume` (and shown to the tap first); its
    /// buffer goes back to the pool when `consume` returns. Frames come out
    /// in due-time order, ties in transmit order. Call in a loop to drain:
    /// `while fabric.receive(port, now, |f| ...)?.is_some() {}`. One frame
    /// per call lets a receiver stop when its own queues are full.
    pub fn receive<R>(
        &mut self,
        port: PortId,
        now_ns: u64,
        consume: impl FnOnce(&[u8]) -> R,
    ) -> Result<Option<R>, FabricError> {
        let index = self.port_index(port)?;
        let queue = &mut self.ports[index].queue;
        let Some(next) = queue.peek_mut() else {
            return Ok(None);
        };
        if next.due_ns > now_ns {
            return Ok(None);
        }
        let frame = PeekMut::pop(next).frame;

        let counters = &mut self.ports[index].counters;
        counters.rx_frames += 1;
        counters.rx_bytes += frame.len() as u64;
        if let Some(tap) = self.tap.as_mut() {
            tap(TapEvent {
                port,
                direction: Direction::Rx,
                now_ns,
                frame: &frame,
            });
        }
        let result = consume(&frame);
        self.pool.recycle(frame);
        Ok(Some(result))
    }

    /// The earliest time any queued frame is due, or `None` when nothing is
    /// queued. It can be at or before the last `now_ns` when due frames have
    /// not been received yet.
    pub fn next_event_ns(&self) -> Option<u64> {
        self.ports
            .iter()
            .filter_map(|port| port.queue.peek().map(|next| next.due_ns))
            .min()
    }

    /// The earliest time a frame queued for `port` is due.
    pub fn next_due_ns(&self, port: PortId) -> Result<Option<u64>, FabricError> {
        Ok(self.port(port)?.queue.peek().map(|next| next.due_ns))
    }

    /// Copies queued for all ports, due or not.
    pub fn queued_frames(&self) -> usize {
        self.ports.iter().map(|port| port.queue.len()).sum()
    }

    /// `port`'s counters.
    pub fn counters(&self, port: PortId) -> Result<PortCounters, FabricError> {
        Ok(self.port(port)?.counters)
    }

    /// Every port's counters added together.
    pub fn total_counters(&self) -> PortCounters {
        let mut total = PortCounters::default();
        for port in &self.ports {
            total.accumulate(&port.counters);
        }
        total
    }

    /// How many frame buffers the pool has allocated: the most copies ever
    /// queued at once. Flat in steady state.
    pub fn buffer_allocations(&self) -> u64 {
        self.pool.allocations
    }

    fn port_index(&self, port: PortId) -> Result<usize, FabricError> {
        let index = port.0 as usize;
        if index < self.ports.len() {
            Ok(index)
        } else {
            Err(FabricError::UnknownPort(port))
        }
    }

    fn port(&self, port: PortId) -> Result<&Port, FabricError> {
        Ok(&self.ports[self.port_index(port)?])
    }

    /// Fills `destinations` (cleared first) with the ports a frame from
    /// `from` to `destination` goes to, ascending, never `from` itself.
    fn route(&self, from: PortId, destination: &[u8; 6], destinations: &mut Vec<PortId>) {
        destinations.clear();
        if *destination == BROADCAST_MAC {
            destinations.extend(
                (0..self.ports.len() as u32)
                    .map(PortId)
                    .filter(|&p| p != from),
            );
        } else if is_group_mac(destination) {
            if let Some(members) = self.groups.get(destination) {
                destinations.extend(members.iter().copied().filter(|&p| p != from));
            }
        } else if let Some(&to) = self.stations.get(destination)
            && to != from
        {
            destinations.push(to);
        }
    }

    /// Sends one copy of `frame` towards `to`, through fault injection.
    fn forward_copy(&mut self, to: PortId, frame: &[u8], now_ns: u64) {
        let index = to.0 as usize;
        if !self.ports[index].link_up {
            self.ports[index].counters.dropped_link_down += 1;
            return;
        }
        let Some(plan) = self.plan_copy(index, frame.len(), now_ns) else {
            return;
        };
        self.enqueue(index, frame, plan);
        if plan.duplicate {
            self.enqueue(index, frame, plan);
        }
    }

    /// Draws the fault injector's decisions for one copy headed for port
    /// `index` and counts them; `None` when the copy is dropped.
    ///
    /// Draw order, fixed for reproducibility: drop; corrupt (then byte, then
    /// bit); duplicate; reorder (then delay). A fault whose rate is 0 draws
    /// nothing, so a fault-free fabric never touches its generator.
    fn plan_copy(&mut self, index: usize, frame_len: usize, now_ns: u64) -> Option<CopyPlan> {
        let faults = self.config.faults;
        let rng = &mut self.rng;
        let counters = &mut self.ports[index].counters;

        if faults.drop_ppm != 0 && rng.chance_ppm(faults.drop_ppm) {
            counters.dropped_fault += 1;
            return None;
        }
        let payload_len = frame_len.saturating_sub(ETHERNET_HEADER_LEN) as u64;
        let flip =
            if faults.corrupt_ppm != 0 && payload_len != 0 && rng.chance_ppm(faults.corrupt_ppm) {
                counters.corrupted += 1;
                let byte = ETHERNET_HEADER_LEN + rng.below(payload_len) as usize;
                let bit = rng.below(8) as u8;
                Some((byte, bit))
            } else {
                None
            };
        let duplicate = faults.duplicate_ppm != 0 && rng.chance_ppm(faults.duplicate_ppm);
        if duplicate {
            counters.duplicated += 1;
        }
        let mut due_ns = now_ns.saturating_add(self.config.latency_ns);
        if faults.reorder_ppm != 0
            && faults.reorder_window_ns != 0
            && rng.chance_ppm(faults.reorder_ppm)
        {
            counters.reordered += 1;
            let extra_ns = 1 + rng.below(faults.reorder_window_ns);
            due_ns = due_ns.saturating_add(extra_ns);
        }
        Some(CopyPlan {
            due_ns,
            flip,
            duplicate,
        })
    }

    /// Queues one copy for port `index`, or tail-drops it if the queue is full.
    fn enqueue(&mut self, index: usize, frame: &[u8], plan: CopyPlan) {
        let port = &mut self.ports[index];
        if port.queue.len() >= self.config.port_queue_limit {
            port.counters.dropped_queue_full += 1;
            return;
        }
        let mut buffer = self.pool.copy_of(frame, self.config.max_frame_len);
        if let Some((byte, bit)) = plan.flip
            && let Some(target) = buffer.get_mut(byte)
        {
            *target ^= 1 << bit;
        }
        port.queue.push(InFlight {
            due_ns: plan.due_ns,
            seq: self.next_seq,
            frame: buffer,
        });
        self.next_seq = self.next_seq.wrapping_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MAC_A: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0A];
    const MAC_B: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0B];
    const MAC_C: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0C];
    const MAC_D: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0D];
    /// An IPv4 multicast MAC (01:00:5e + 23 bits of the group address).
    const GROUP: [u8; 6] = [0x01, 0x00, 0x5E, 0x00, 0x00, 0x01];
    const ROCE_ETHERTYPE: [u8; 2] = [0x08, 0x00];

    fn config() -> FabricConfig {
        FabricConfig {
            latency_ns: 1_000,
            ..FabricConfig::default()
        }
    }

    /// An Ethernet II frame from `src` to `dst` whose payload starts with
    /// the 8-byte tag `tag`, padded to `len` bytes.
    fn frame(dst: [u8; 6], src: [u8; 6], tag: u64, len: usize) -> Vec<u8> {
        let mut frame = Vec::with_capacity(len);
        frame.extend_from_slice(&dst);
        frame.extend_from_slice(&src);
        frame.extend_from_slice(&ROCE_ETHERTYPE);
        frame.extend_from_slice(&tag.to_be_bytes());
        frame.resize(len.max(frame.len()), 0xA5);
        frame
    }

    fn tag_of(frame: &[u8]) -> u64 {
        let bytes: [u8; 8] = frame[14..22].try_into().unwrap();
        u64::from_be_bytes(bytes)
    }

    /// Receives everything due at `port` by `now_ns`.
    fn drain(fabric: &mut Fabric, port: PortId, now_ns: u64) -> Vec<Vec<u8>> {
        let mut frames = Vec::new();
        while let Some(frame) = fabric.receive(port, now_ns, <[u8]>::to_vec).unwrap() {
            frames.push(frame);
        }
        frames
    }

    fn four_ports(fabric: &mut Fabric) -> [PortId; 4] {
        [MAC_A, MAC_B, MAC_C, MAC_D].map(|mac| fabric.attach(mac).unwrap())
    }

    fn assert_conserved(fabric: &Fabric) {
        let total = fabric.total_counters();
        assert_eq!(
            total.tx_frames + total.replicated + total.duplicated,
            total.rx_frames + total.dropped() + fabric.queued_frames() as u64,
            "conservation: {total:?}, queued {}",
            fabric.queued_frames()
        );
    }

    #[test]
    fn unicast_arrives_after_latency() {
        let mut fabric = Fabric::new(config(), 1);
        let [a, b, c, _] = four_ports(&mut fabric);
        let sent = frame(MAC_B, MAC_A, 7, 100);
        fabric.transmit(a, &sent, 5_000).unwrap();

        assert_eq!(fabric.next_event_ns(), Some(6_000));
        assert_eq!(fabric.next_due_ns(b), Ok(Some(6_000)));
        assert!(drain(&mut fabric, b, 5_999).is_empty(), "not due yet");
        assert!(
            drain(&mut fabric, c, 10_000).is_empty(),
            "other ports see nothing"
        );
        assert_eq!(drain(&mut fabric, b, 6_000), [sent]);
        assert_eq!(fabric.next_event_ns(), None);

        let sender = fabric.counters(a).unwrap();
        assert_eq!((sender.tx_frames, sender.tx_bytes), (1, 100));
        let receiver = fabric.counters(b).unwrap();
        assert_eq!((receiver.rx_frames, receiver.rx_bytes), (1, 100));
        assert_eq!(fabric.total_counters().dropped(), 0);
        assert_conserved(&fabric);
    }

    #[test]
    fn frames_come_out_in_transmit_order() {
        let mut fabric = Fabric::new(config(), 1);
        let [a, b, c, _] = four_ports(&mut fabric);
        for tag in 0..5 {
            fabric
                .transmit(a, &frame(MAC_B, MAC_A, tag, 64), 100)
                .unwrap();
            fabric
                .transmit(c, &frame(MAC_B, MAC_C, 100 + tag, 64), 100)
                .unwrap();
        }
        let tags: Vec<u64> = drain(&mut fabric, b, 1_100)
            .iter()
            .map(|f| tag_of(f))
            .collect();
        assert_eq!(tags, [0, 100, 1, 101, 2, 102, 3, 103, 4, 104]);
    }

    #[test]
    fn zero_latency_is_due_at_once() {
        let config = FabricConfig {
            latency_ns: 0,
            ..FabricConfig::default()
        };
        let mut fabric = Fabric::new(config, 1);
        let [a, b, ..] = four_ports(&mut fabric);
        fabric.transmit(a, &frame(MAC_B, MAC_A, 1, 60), 42).unwrap();
        assert_eq!(fabric.next_event_ns(), Some(42));
        assert_eq!(drain(&mut fabric, b, 42).len(), 1);
    }

    #[test]
    fn multicast_replicates_to_members_only_and_respects_leave() {
        let mut fabric = Fabric::new(config(), 1);
        let [a, b, c, d] = four_ports(&mut fabric);
        for port in [a, b, c] {
            fabric.join_multicast(port, GROUP).unwrap();
        }
        fabric.join_multicast(b, GROUP).unwrap(); // idempotent

        fabric.transmit(a, &frame(GROUP, MAC_A, 1, 80), 0).unwrap();
        assert!(
            drain(&mut fabric, a, 1_000).is_empty(),
            "not back to the sender"
        );
        assert_eq!(drain(&mut fabric, b, 1_000).len(), 1);
        assert_eq!(drain(&mut fabric, c, 1_000).len(), 1);
        assert!(drain(&mut fabric, d, 1_000).is_empty(), "not a member");
        assert_eq!(fabric.counters(a).unwrap().replicated, 1);

        fabric.leave_multicast(c, GROUP).unwrap();
        fabric.leave_multicast(d, GROUP).unwrap(); // never joined: no-op
        fabric
            .transmit(a, &frame(GROUP, MAC_A, 2, 80), 2_000)
            .unwrap();
        assert_eq!(drain(&mut fabric, b, 3_000).len(), 1);
        assert!(drain(&mut fabric, c, 3_000).is_empty(), "left the group");

        fabric.leave_multicast(b, GROUP).unwrap();
        fabric
            .transmit(a, &frame(GROUP, MAC_A, 3, 80), 4_000)
            .unwrap();
        assert_eq!(
            fabric.counters(a).unwrap().dropped_unknown_dest,
            1,
            "no members left"
        );
        assert_eq!(fabric.queued_frames(), 0);
        assert_conserved(&fabric);
    }

    #[test]
    fn broadcast_reaches_every_other_port() {
        let mut fabric = Fabric::new(config(), 1);
        let ports = four_ports(&mut fabric);
        fabric
            .transmit(ports[2], &frame(BROADCAST_MAC, MAC_C, 9, 60), 0)
            .unwrap();
        let received: Vec<usize> = ports
            .iter()
            .map(|&port| drain(&mut fabric, port, 1_000).len())
            .collect();
        assert_eq!(received, [1, 1, 0, 1]);
        assert_eq!(fabric.counters(ports[2]).unwrap().replicated, 2);
        assert_conserved(&fabric);
    }

    #[test]
    fn undeliverable_frames_are_counted() {
        let mut fabric = Fabric::new(config(), 1);
        let [a, b, ..] = four_ports(&mut fabric);
        let stranger = [0x02, 0x99, 0x99, 0x99, 0x99, 0x99];
        fabric
            .transmit(a, &frame(stranger, MAC_A, 1, 60), 0)
            .unwrap();
        fabric.transmit(a, &frame(MAC_A, MAC_A, 2, 60), 0).unwrap(); // no hairpin
        fabric.transmit(a, &frame(GROUP, MAC_A, 3, 60), 0).unwrap(); // empty group
        assert_eq!(fabric.counters(a).unwrap().dropped_unknown_dest, 3);

        for short in [&[][..], &[0xFF; 6][..], &MAC_B[..], &[0x02; 13][..]] {
            fabric.transmit(a, short, 0).unwrap();
        }
        let giant = frame(MAC_B, MAC_A, 4, FabricConfig::DEFAULT_MAX_FRAME_LEN + 1);
        fabric.transmit(a, &giant, 0).unwrap();
        let largest = frame(MAC_B, MAC_A, 5, FabricConfig::DEFAULT_MAX_FRAME_LEN);
        fabric.transmit(a, &largest, 0).unwrap();
        let header_only = &frame(MAC_B, MAC_A, 0, 22)[..ETHERNET_HEADER_LEN];
        fabric.transmit(a, header_only, 0).unwrap();
        let counters = fabric.counters(a).unwrap();
        assert_eq!(counters.dropped_malformed, 5);
        assert_eq!(counters.tx_frames, 10);
        assert_eq!(
            drain(&mut fabric, b, 1_000),
            [largest, header_only.to_vec()]
        );
        assert_conserved(&fabric);
    }

    #[test]
    fn link_down_drops_at_sender_and_receiver() {
        let mut fabric = Fabric::new(config(), 1);
        let [a, b, c, _] = four_ports(&mut fabric);
        assert_eq!(fabric.link_up(a), Ok(true));

        fabric.set_link(a, false, 0).unwrap();
        assert_eq!(fabric.link_up(a), Ok(false));
        fabric.transmit(a, &frame(MAC_B, MAC_A, 1, 60), 0).unwrap();
        assert_eq!(fabric.counters(a).unwrap().dropped_link_down, 1);
        fabric.transmit(b, &frame(MAC_A, MAC_B, 2, 60), 0).unwrap();
        assert_eq!(fabric.counters(a).unwrap().dropped_link_down, 2);
        // Broadcast: the down port's copy is lost, the others arrive.
        fabric
            .transmit(b, &frame(BROADCAST_MAC, MAC_B, 3, 60), 0)
            .unwrap();
        assert_eq!(fabric.counters(a).unwrap().dropped_link_down, 3);
        assert_eq!(drain(&mut fabric, c, 1_000).len(), 1);

        fabric.set_link(a, true, 2_000).unwrap();
        fabric
            .transmit(a, &frame(MAC_B, MAC_A, 4, 60), 2_000)
            .unwrap();
        assert_eq!(drain(&mut fabric, b, 3_000).len(), 1);
        assert_conserved(&fabric);
    }

    #[test]
    fn link_down_loses_frames_in_flight_but_keeps_arrived_ones() {
        let mut fabric = Fabric::new(config(), 1);
        let [a, b, ..] = four_ports(&mut fabric);
        fabric.transmit(a, &frame(MAC_B, MAC_A, 1, 60), 0).unwrap(); // due 1000
        fabric
            .transmit(a, &frame(MAC_B, MAC_A, 2, 60), 500)
            .unwrap(); // due 1500
        fabric
            .transmit(a, &frame(MAC_B, MAC_A, 3, 60), 900)
            .unwrap(); // due 1900
        fabric.set_link(b, false, 1_500).unwrap();
        assert_eq!(fabric.counters(b).unwrap().dropped_link_down, 1);
        let tags: Vec<u64> = drain(&mut fabric, b, 5_000)
            .iter()
            .map(|f| tag_of(f))
            .collect();
        assert_eq!(tags, [1, 2]);
        assert_conserved(&fabric);
    }

    #[test]
    fn a_down_sender_still_delivers_what_it_sent_before() {
        let mut fabric = Fabric::new(config(), 1);
        let [a, b, ..] = four_ports(&mut fabric);
        fabric.transmit(a, &frame(MAC_B, MAC_A, 1, 60), 0).unwrap();
        fabric.set_link(a, false, 10).unwrap();
        assert_eq!(drain(&mut fabric, b, 1_000).len(), 1);
    }

    #[test]
    fn refusals() {
        let mut fabric = Fabric::new(config(), 1);
        let a = fabric.attach(MAC_A).unwrap();
        assert_eq!(
            fabric.attach(MAC_A),
            Err(FabricError::MacInUse {
                mac: MAC_A,
                port: a
            })
        );
        assert_eq!(fabric.attach(GROUP), Err(FabricError::NotUnicast(GROUP)));
        assert_eq!(
            fabric.attach(BROADCAST_MAC),
            Err(FabricError::NotUnicast(BROADCAST_MAC))
        );
        assert_eq!(
            fabric.join_multicast(a, MAC_B),
            Err(FabricError::NotMulticast(MAC_B))
        );
        assert_eq!(
            fabric.join_multicast(a, BROADCAST_MAC),
            Err(FabricError::NotMulticast(BROADCAST_MAC))
        );
        assert_eq!(
            fabric.leave_multicast(a, MAC_B),
            Err(FabricError::NotMulticast(MAC_B))
        );

        let ghost = PortId(1);
        let unknown = Err(FabricError::UnknownPort(ghost));
        assert_eq!(fabric.transmit(ghost, &[0; 64], 0), unknown);
        assert_eq!(fabric.receive(ghost, 0, |_| ()), unknown.map(|()| None));
        assert_eq!(fabric.set_link(ghost, false, 0), unknown);
        assert_eq!(fabric.link_up(ghost), unknown.map(|()| true));
        assert_eq!(fabric.join_multicast(ghost, GROUP), unknown);
        assert_eq!(fabric.leave_multicast(ghost, GROUP), unknown);
        assert!(fabric.counters(ghost).is_err());
        assert!(fabric.mac(ghost).is_err());
        assert!(fabric.next_due_ns(ghost).is_err());
        assert_eq!(fabric.mac(a), Ok(MAC_A));
        assert_eq!(fabric.port_count(), 1);

        assert_eq!(
            FabricError::MacInUse {
                mac: MAC_A,
                port: a
            }
            .to_string(),
            "MAC 02:00:00:00:00:0a is already attached as port 0"
        );
    }

    #[test]
    fn tap_sees_both_directions() {
        use std::sync::{Arc, Mutex};

        let mut fabric = Fabric::new(config(), 1);
        let [a, b, c, _] = four_ports(&mut fabric);
        fabric.join_multicast(b, GROUP).unwrap();
        fabric.join_multicast(c, GROUP).unwrap();
        type Seen = Vec<(PortId, Direction, u64, Vec<u8>)>;
        let seen: Arc<Mutex<Seen>> = Arc::default();
        let sink = Arc::clone(&seen);
        fabric.set_tap(Box::new(move |event: TapEvent<'_>| {
            sink.lock().unwrap().push((
                event.port,
                event.direction,
                event.now_ns,
                event.frame.to_vec(),
            ));
        }));

        let sent = frame(GROUP, MAC_A, 1, 70);
        fabric.transmit(a, &sent, 10).unwrap();
        fabric.transmit(a, &[1, 2, 3], 20).unwrap(); // a runt is still seen
        drain(&mut fabric, c, 1_010);
        drain(&mut fabric, b, 1_010);
        assert!(fabric.take_tap().is_some());
        fabric.transmit(a, &sent, 2_000).unwrap(); // no tap any more

        let seen = seen.lock().unwrap();
        let expected = [
            (a, Direction::Tx, 10, sent.clone()),
            (a, Direction::Tx, 20, vec![1, 2, 3]),
            (c, Direction::Rx, 1_010, sent.clone()),
            (b, Direction::Rx, 1_010, sent.clone()),
        ];
        assert_eq!(*seen, expected);
    }

    /// Drives `fabric` through a fixed mixed workload and returns every
    /// delivery as (port, receive time, bytes), stepping by `next_event_ns`.
    fn scripted_run(fabric: &mut Fabric) -> Vec<(PortId, u64, Vec<u8>)> {
        let ports = four_ports(fabric);
        let macs = [MAC_A, MAC_B, MAC_C, MAC_D];
        fabric.join_multicast(ports[1], GROUP).unwrap();
        fabric.join_multicast(ports[3], GROUP).unwrap();
        let mut log = Vec::new();
        let mut now = 0;
        for tag in 0..2_000u64 {
            let from = (tag % 4) as usize;
            let dst = match tag % 7 {
                0 => GROUP,
                1 => BROADCAST_MAC,
                k => macs[((from as u64 + k) % 4) as usize],
            };
            let len = 60 + (tag % 300) as usize;
            fabric
                .transmit(ports[from], &frame(dst, macs[from], tag, len), now)
                .unwrap();
            if tag == 700 {
                fabric.set_link(ports[2], false, now).unwrap();
            }
            if tag == 900 {
                fabric.set_link(ports[2], true, now).unwrap();
            }
            now += 250;
            for &port in &ports {
                for frame in drain(fabric, port, now) {
                    log.push((port, now, frame));
                }
            }
        }
        while let Some(at) = fabric.next_event_ns() {
            for &port in &ports {
                for frame in drain(fabric, port, at) {
                    log.push((port, at, frame));
                }
            }
        }
        assert_conserved(fabric);
        log
    }

    fn faulty_config() -> FabricConfig {
        FabricConfig {
            latency_ns: 1_000,
            faults: FaultConfig {
                drop_ppm: 50_000,
                duplicate_ppm: 30_000,
                reorder_ppm: 100_000,
                reorder_window_ns: 5_000,
                corrupt_ppm: 40_000,
            },
            ..FabricConfig::default()
        }
    }

    #[test]
    fn same_seed_same_run_different_seed_differs() {
        let run = |seed| scripted_run(&mut Fabric::new(faulty_config(), seed));
        let first = run(0x5EED);
        assert!(first.len() > 2_000);
        assert_eq!(first, run(0x5EED));
        assert_ne!(first, run(0x5EED + 1));
    }

    #[test]
    fn fault_rates_land_near_their_configured_ppm() {
        const FRAMES: u64 = 10_000;
        let mut fabric = Fabric::new(faulty_config(), 0xFA17);
        let [a, b, ..] = four_ports(&mut fabric);
        for tag in 0..FRAMES {
            fabric
                .transmit(a, &frame(MAC_B, MAC_A, tag, 128), tag * 100)
                .unwrap();
            drain(&mut fabric, b, tag * 100);
        }
        drain(&mut fabric, b, u64::MAX);
        let counters = fabric.counters(b).unwrap();
        // Expected counts: drop 500 of 10 000; the others apply to the 9 500
        // survivors. Bands are about +-25 %, far outside the binomial noise
        // (the run is deterministic anyway; this guards the mapping from ppm).
        let within =
            |count: u64, expected: u64| (expected * 3 / 4..=expected * 5 / 4).contains(&count);
        assert!(within(counters.dropped_fault, 500), "{counters:?}");
        assert!(within(counters.duplicated, 285), "{counters:?}");
        assert!(within(counters.reordered, 950), "{counters:?}");
        assert!(within(counters.corrupted, 380), "{counters:?}");
        assert_eq!(
            counters.rx_frames,
            FRAMES - counters.dropped_fault + counters.duplicated
        );
        assert_conserved(&fabric);
    }

    #[test]
    fn corruption_flips_exactly_one_bit_past_the_header() {
        let config = FabricConfig {
            faults: FaultConfig {
                corrupt_ppm: 1_000_000,
                ..FaultConfig::default()
            },
            ..config()
        };
        let mut fabric = Fabric::new(config, 3);
        let [a, b, ..] = four_ports(&mut fabric);
        let mut offsets = std::collections::BTreeSet::new();
        for tag in 0..2_000u64 {
            let len = 15 + (tag % 50) as usize;
            let sent = frame(MAC_B, MAC_A, tag, len);
            fabric.transmit(a, &sent, 0).unwrap();
            let [got] = &drain(&mut fabric, b, 1_000)[..] else {
                panic!("one frame expected");
            };
            assert_eq!(got.len(), sent.len());
            assert_eq!(got[..ETHERNET_HEADER_LEN], sent[..ETHERNET_HEADER_LEN]);
            let flipped: u32 = got
                .iter()
                .zip(&sent)
                .map(|(x, y)| (x ^ y).count_ones())
                .sum();
            assert_eq!(flipped, 1, "tag {tag}");
            let offset = got.iter().zip(&sent).position(|(x, y)| x != y).unwrap();
            offsets.insert(offset);
        }
        // Both ends of the corruptible range are reached.
        assert!(offsets.contains(&ETHERNET_HEADER_LEN) && offsets.contains(&63));
        assert_eq!(fabric.counters(b).unwrap().corrupted, 2_000);

        // Nothing past the header: nothing to corrupt.
        fabric
            .transmit(a, &frame(MAC_B, MAC_A, 0, 22)[..14], 0)
            .unwrap();
        assert_eq!(fabric.counters(b).unwrap().corrupted, 2_000);
    }

    #[test]
    fn reordering_reorders_and_never_loses() {
        let config = FabricConfig {
            faults: FaultConfig {
                reorder_ppm: 200_000,
                reorder_window_ns: 10_000,
                ..FaultConfig::default()
            },
            ..config()
        };
        let mut fabric = Fabric::new(config, 4);
        let [a, b, ..] = four_ports(&mut fabric);
        for tag in 0..1_000u64 {
            fabric
                .transmit(a, &frame(MAC_B, MAC_A, tag, 64), tag * 100)
                .unwrap();
        }
        let tags: Vec<u64> = drain(&mut fabric, b, u64::MAX)
            .iter()
            .map(|f| tag_of(f))
            .collect();
        let mut sorted = tags.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1_000).collect::<Vec<_>>(), "all delivered once");
        let inversions = tags.windows(2).filter(|pair| pair[0] > pair[1]).count();
        assert!(inversions > 50, "{inversions} inversions");
        assert!(fabric.counters(b).unwrap().reordered > 100);
    }

    #[test]
    fn a_zero_reorder_window_never_reorders() {
        let config = FabricConfig {
            faults: FaultConfig {
                reorder_ppm: 1_000_000,
                reorder_window_ns: 0,
                ..FaultConfig::default()
            },
            ..config()
        };
        let mut fabric = Fabric::new(config, 4);
        let [a, b, ..] = four_ports(&mut fabric);
        fabric.transmit(a, &frame(MAC_B, MAC_A, 1, 64), 0).unwrap();
        assert_eq!(fabric.next_event_ns(), Some(1_000));
        assert_eq!(fabric.counters(b).unwrap().reordered, 0);
    }

    #[test]
    fn duplication_delivers_exactly_twice() {
        let config = FabricConfig {
            faults: FaultConfig {
                duplicate_ppm: 1_000_000,
                ..FaultConfig::default()
            },
            ..config()
        };
        let mut fabric = Fabric::new(config, 5);
        let [a, b, ..] = four_ports(&mut fabric);
        for tag in 0..100u64 {
            fabric
                .transmit(a, &frame(MAC_B, MAC_A, tag, 64), tag)
                .unwrap();
        }
        let tags: Vec<u64> = drain(&mut fabric, b, u64::MAX)
            .iter()
            .map(|f| tag_of(f))
            .collect();
        let expected: Vec<u64> = (0..100).flat_map(|tag| [tag, tag]).collect();
        assert_eq!(tags, expected);
        assert_eq!(fabric.counters(b).unwrap().duplicated, 100);
        assert_conserved(&fabric);
    }

    #[test]
    fn certain_drop_delivers_nothing() {
        let config = FabricConfig {
            faults: FaultConfig {
                drop_ppm: 1_000_000,
                duplicate_ppm: 1_000_000,
                ..FaultConfig::default()
            },
            ..config()
        };
        let mut fabric = Fabric::new(config, 6);
        let [a, b, ..] = four_ports(&mut fabric);
        for tag in 0..100 {
            fabric
                .transmit(a, &frame(MAC_B, MAC_A, tag, 64), 0)
                .unwrap();
        }
        assert_eq!(fabric.queued_frames(), 0);
        assert_eq!(fabric.counters(b).unwrap().dropped_fault, 100);
        assert_conserved(&fabric);

        // A clean phase afterwards delivers everything.
        fabric.set_faults(FaultConfig::default());
        fabric.transmit(a, &frame(MAC_B, MAC_A, 1, 64), 0).unwrap();
        assert_eq!(drain(&mut fabric, b, 1_000).len(), 1);
    }

    #[test]
    fn full_queues_tail_drop() {
        let config = FabricConfig {
            port_queue_limit: 3,
            ..config()
        };
        let mut fabric = Fabric::new(config, 1);
        let [a, b, ..] = four_ports(&mut fabric);
        for tag in 0..5 {
            fabric
                .transmit(a, &frame(MAC_B, MAC_A, tag, 64), 0)
                .unwrap();
        }
        assert_eq!(fabric.counters(b).unwrap().dropped_queue_full, 2);
        let tags: Vec<u64> = drain(&mut fabric, b, 1_000)
            .iter()
            .map(|f| tag_of(f))
            .collect();
        assert_eq!(tags, [0, 1, 2]);
        assert_conserved(&fabric);
    }

    #[test]
    fn the_pool_stops_allocating_after_warm_up() {
        let mut fabric = Fabric::new(config(), 7);
        let [a, b, c, d] = four_ports(&mut fabric);
        fabric.join_multicast(c, GROUP).unwrap();
        fabric.join_multicast(d, GROUP).unwrap();
        let frames = [
            frame(MAC_B, MAC_A, 1, 64),
            frame(GROUP, MAC_A, 2, 1_100),
            frame(BROADCAST_MAC, MAC_A, 3, 300),
        ];
        let mut now = 0;
        let mut run = |fabric: &mut Fabric, rounds: u64| {
            for round in 0..rounds {
                fabric
                    .transmit(a, &frames[(round % 3) as usize], now)
                    .unwrap();
                now += 200;
                for port in [b, c, d] {
                    while fabric
                        .receive(port, now, |frame| frame.len())
                        .unwrap()
                        .is_some()
                    {}
                }
            }
        };
        run(&mut fabric, 100);
        let warm = fabric.buffer_allocations();
        assert!(warm > 0);
        run(&mut fabric, 10_000);
        assert_eq!(fabric.buffer_allocations(), warm);
        drain(&mut fabric, b, u64::MAX);
        // Every third frame is unicast to b and every third is broadcast:
        // (34 + 33) in the warm-up, (3 334 + 3 333) after it.
        assert_eq!(fabric.counters(b).unwrap().rx_frames, 6_734);
    }

    #[test]
    fn under_faults_the_pool_allocates_only_for_new_peaks() {
        let mut fabric = Fabric::new(faulty_config(), 7);
        let [a, b, c, d] = four_ports(&mut fabric);
        fabric.join_multicast(c, GROUP).unwrap();
        let destinations = [MAC_B, GROUP, BROADCAST_MAC, MAC_D];
        let mut peak_queued = 0;
        for round in 0..10_000u64 {
            let dst = destinations[(round % 4) as usize];
            let len = 60 + (round % 1_000) as usize;
            fabric
                .transmit(a, &frame(dst, MAC_A, round, len), round * 200)
                .unwrap();
            peak_queued = peak_queued.max(fabric.queued_frames());
            for port in [b, c, d] {
                while fabric.receive(port, round * 200, |_| ()).unwrap().is_some() {}
            }
            assert_eq!(
                fabric.buffer_allocations(),
                peak_queued as u64,
                "round {round}"
            );
        }
        assert!(
            peak_queued < 200,
            "bounded by latency and reorder window: {peak_queued}"
        );
    }

    #[test]
    fn next_event_is_exact() {
        let config = FabricConfig {
            faults: FaultConfig {
                reorder_ppm: 500_000,
                reorder_window_ns: 3_000,
                ..FaultConfig::default()
            },
            ..config()
        };
        let mut fabric = Fabric::new(config, 8);
        let ports = four_ports(&mut fabric);
        let macs = [MAC_A, MAC_B, MAC_C, MAC_D];
        for tag in 0..400u64 {
            let from = (tag % 4) as usize;
            let to = ((tag / 4 + 1 + tag) % 4) as usize;
            let dst = if to == from { BROADCAST_MAC } else { macs[to] };
            fabric
                .transmit(ports[from], &frame(dst, macs[from], tag, 64), tag * 37)
                .unwrap();
        }
        let mut delivered = 0;
        while let Some(at) = fabric.next_event_ns() {
            let mut at_this_time = 0;
            for &port in &ports {
                assert!(
                    drain(&mut fabric, port, at - 1).is_empty(),
                    "nothing before {at}"
                );
            }
            for &port in &ports {
                at_this_time += drain(&mut fabric, port, at).len();
            }
            assert!(at_this_time > 0, "something at {at}");
            delivered += at_this_time;
        }
        assert_eq!(delivered as u64, fabric.total_counters().rx_frames);
        assert_eq!(fabric.queued_frames(), 0);
        assert_conserved(&fabric);
    }

    /// One step of the property test.
    #[derive(Debug, Clone)]
    enum Op {
        Attach(u8),
        /// A well-formed frame to one of the known addresses (chosen by
        /// `destination`) or an arbitrary one.
        Transmit {
            from: usize,
            destination: u8,
            payload: Vec<u8>,
        },
        /// Arbitrary bytes, often shorter than an Ethernet header.
        TransmitRaw {
            from: usize,
            bytes: Vec<u8>,
        },
        SetLink {
            port: usize,
            up: bool,
        },
        Join {
            port: usize,
            group: u8,
        },
        Leave {
            port: usize,
            group: u8,
        },
        Advance(u64),
        ReceiveNow {
            port: usize,
        },
        ReceiveAt {
            port: usize,
            at: u64,
        },
        SetFaults(FaultConfig),
    }

    fn ppm() -> impl Strategy<Value = u32> {
        prop_oneof![Just(0), 0..=1_000_000u32, Just(1_000_000), any::<u32>()]
    }

    fn fault_config() -> impl Strategy<Value = FaultConfig> {
        (
            ppm(),
            ppm(),
            ppm(),
            prop_oneof![Just(0), 0..20_000u64, any::<u64>()],
            ppm(),
        )
            .prop_map(
                |(drop_ppm, duplicate_ppm, reorder_ppm, reorder_window_ns, corrupt_ppm)| {
                    FaultConfig {
                        drop_ppm,
                        duplicate_ppm,
                        reorder_ppm,
                        reorder_window_ns,
                        corrupt_ppm,
                    }
                },
            )
    }

    fn op() -> impl Strategy<Value = Op> {
        let index = 0..8usize;
        prop_oneof![
            1 => any::<u8>().prop_map(Op::Attach),
            6 => (index.clone(), any::<u8>(), prop::collection::vec(any::<u8>(), 0..80))
                .prop_map(|(from, destination, payload)| Op::Transmit { from, destination, payload }),
            2 => (index.clone(), prop::collection::vec(any::<u8>(), 0..30))
                .prop_map(|(from, bytes)| Op::TransmitRaw { from, bytes }),
            1 => (index.clone(), any::<bool>()).prop_map(|(port, up)| Op::SetLink { port, up }),
            1 => (index.clone(), 0..3u8).prop_map(|(port, group)| Op::Join { port, group }),
            1 => (index.clone(), 0..3u8).prop_map(|(port, group)| Op::Leave { port, group }),
            2 => (0..3_000u64).prop_map(Op::Advance),
            4 => index.clone().prop_map(|port| Op::ReceiveNow { port }),
            1 => (index, any::<u64>()).prop_map(|(port, at)| Op::ReceiveAt { port, at }),
            1 => fault_config().prop_map(Op::SetFaults),
        ]
    }

    /// The port at `index` modulo the attached ports, or a port id this
    /// fabric never handed out.
    fn pick(ports: &[PortId], index: usize) -> PortId {
        if ports.is_empty() {
            PortId(index as u32)
        } else {
            ports[index % ports.len()]
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn arbitrary_operations_never_panic_and_conserve_frames(
            seed in any::<u64>(),
            faults in fault_config(),
            latency_ns in prop_oneof![Just(0), 0..5_000u64, any::<u64>()],
            port_queue_limit in 0..64usize,
            ops in prop::collection::vec(op(), 0..200),
        ) {
            let config = FabricConfig {
                latency_ns,
                max_frame_len: 64,
                port_queue_limit,
                faults,
            };
            let mut fabric = Fabric::new(config, seed);
            let mut ports: Vec<PortId> = Vec::new();
            let mut now = 0u64;
            let groups = [GROUP, [0x01, 0x00, 0x5E, 0x7F, 0xFF, 0xFA], [0x33, 0x33, 0, 0, 0, 1]];
            let check_delivery = |fabric: &Fabric, port: PortId, bytes: &[u8]| {
                let dst: [u8; 6] = bytes[..6].try_into().unwrap();
                if !is_group_mac(&dst) {
                    prop_assert_eq!(dst, fabric.mac(port).unwrap());
                }
                prop_assert!(bytes.len() >= ETHERNET_HEADER_LEN && bytes.len() <= 64);
                Ok(())
            };
            for op in ops {
                match op {
                    Op::Attach(last) => {
                        let mac = [0x02, 0, 0, 0, 0, last];
                        match fabric.attach(mac) {
                            Ok(port) => ports.push(port),
                            Err(error) => {
                                let in_use = matches!(error, FabricError::MacInUse { .. });
                                prop_assert!(in_use);
                            }
                        }
                    }
                    Op::Transmit { from, destination, payload } => {
                        let from = pick(&ports, from);
                        let dst = match destination % 5 {
                            0 => BROADCAST_MAC,
                            1 => groups[usize::from(destination) % groups.len()],
                            2 | 3 if !ports.is_empty() => {
                                fabric.mac(pick(&ports, usize::from(destination))).unwrap()
                            }
                            _ => [0x02, 0, 0, 0, 0, destination],
                        };
                        let mut bytes = frame(dst, [0x02, 0, 0, 0, 0, 1], 0, 0);
                        bytes.truncate(ETHERNET_HEADER_LEN);
                        bytes.extend_from_slice(&payload);
                        let result = fabric.transmit(from, &bytes, now);
                        prop_assert_eq!(result.is_ok(), !ports.is_empty());
                    }
                    Op::TransmitRaw { from, bytes } => {
                        let result = fabric.transmit(pick(&ports, from), &bytes, now);
                        prop_assert_eq!(result.is_ok(), !ports.is_empty());
                    }
                    Op::SetLink { port, up } => {
                        let port = pick(&ports, port);
                        if fabric.set_link(port, up, now).is_ok() {
                            prop_assert_eq!(fabric.link_up(port), Ok(up));
                        }
                    }
                    Op::Join { port, group } => {
                        let result = fabric.join_multicast(pick(&ports, port), groups[usize::from(group)]);
                        prop_assert_eq!(result.is_ok(), !ports.is_empty());
                    }
                    Op::Leave { port, group } => {
                        let result = fabric.leave_multicast(pick(&ports, port), groups[usize::from(group)]);
                        prop_assert_eq!(result.is_ok(), !ports.is_empty());
                    }
                    Op::Advance(by) => now = now.saturating_add(by),
                    Op::ReceiveNow { port } => {
                        let port = pick(&ports, port);
                        while let Ok(Some(bytes)) = fabric.receive(port, now, <[u8]>::to_vec) {
                            check_delivery(&fabric, port, &bytes)?;
                        }
                    }
                    Op::ReceiveAt { port, at } => {
                        let port = pick(&ports, port);
                        if let Ok(Some(bytes)) = fabric.receive(port, at, <[u8]>::to_vec) {
                            check_delivery(&fabric, port, &bytes)?;
                        }
                    }
                    Op::SetFaults(faults) => fabric.set_faults(faults),
                }
                let total = fabric.total_counters();
                prop_assert_eq!(
                    total.tx_frames + total.replicated + total.duplicated,
                    total.rx_frames + total.dropped() + fabric.queued_frames() as u64
                );
                let earliest = ports
                    .iter()
                    .filter_map(|&port| fabric.next_due_ns(port).unwrap())
                    .min();
                prop_assert_eq!(earliest, fabric.next_event_ns());
            }

            // Drain everything: nothing stays queued forever.
            for &port in &ports {
                while fabric.receive(port, u64::MAX, |_| ()).unwrap().is_some() {}
            }
            prop_assert_eq!(fabric.queued_frames(), 0);
            prop_assert_eq!(fabric.next_event_ns(), None);
            let total = fabric.total_counters();
            prop_assert_eq!(
                total.tx_frames + total.replicated + total.duplicated,
                total.rx_frames + total.dropped()
            );
        }
    }
}
