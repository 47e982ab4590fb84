//! Fast mode: simulated HCAs wired by a lossless, zero-latency fabric, for
//! real work rather than reproducible tests.
//!
//! Designed for small machines (two cores): there is no spinning engine
//! thread. Work runs in the thread that causes it — a doorbell write runs
//! the device's send path, and the frames it produces are delivered to their
//! destination devices right there, whose responses are delivered in turn,
//! until the fabric is quiet. Only timers (retransmission, RNR waits) need a
//! thread of their own, and [`FastFabric::run_timers`] is what one calls
//! periodically (or [`FastFabric::spawn_timer_thread`] does it).
//!
//! Locking: each device has its own mutex, and no device lock is ever held
//! while another is taken — frames move between devices through a queue the
//! delivering thread owns — so any number of threads may ring doorbells on
//! any devices concurrently without deadlock. Frame buffers are pooled:
//! steady-state traffic allocates nothing.
//!
//! Data is placed directly (`transport::direct`): the fabric neither
//! captures nor injects faults, so every RC/UC packet travels without a
//! frame — a payload in memory goes from the sender's memory to the
//! receiver's, inline data is carried in the message, acknowledgements,
//! reads and atomics are headers only — and a doorbell's packets travel
//! as one message, answered by one ACK. Only datagrams (UD) travel as
//! frames. [`FastFabric::new_wire_path`] keeps every packet a frame.
//!
//! Time is real: nanoseconds since the fabric was built.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::device::{Device, DirectMessage, Outgoing};

/// A device port's place on the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Attachment {
    node: usize,
    port: u8,
    mac: [u8; 6],
}

/// Frames and direct messages in transit inside one delivering thread:
/// (sending node, sending port, item), and spent buffers to swap for the
/// devices' next ones.
#[derive(Debug, Default)]
struct Transit {
    /// When the call that caused them ran: the fabric has no latency, so
    /// every delivery of one call happens at that instant (one clock read
    /// per call, not one per delivery).
    now: u64,
    queue: VecDeque<(usize, u8, Outgoing)>,
    frames: Vec<Vec<u8>>,
    #[allow(
        clippy::vec_box,
        reason = "the devices' pooled boxes, handed back as they are"
    )]
    messages: Vec<Box<DirectMessage>>,
}

/// Devices wired back to back through a switch with no loss and no delay.
pub struct FastFabric {
    nodes: Vec<Arc<Mutex<Device>>>,
    attachments: Vec<Attachment>,
    epoch: Instant,
    /// Transit buffers reused across deliveries.
    spare: Mutex<Vec<Transit>>,
}

impl std::fmt::Debug for FastFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastFabric")
            .field("nodes", &self.nodes.len())
            .field("attachments", &self.attachments)
            .finish_non_exhaustive()
    }
}

/// Locks a device; a poisoned lock (a panicking thread) still yields it.
fn lock(dev: &Mutex<Device>) -> MutexGuard<'_, Device> {
    dev.lock().unwrap_or_else(|e| e.into_inner())
}

impl FastFabric {
    /// Wires `devices` together; every port's link is brought up. Data is
    /// placed directly ([`Device::set_direct_placement`]): this fabric
    /// neither captures nor injects faults.
    pub fn new(devices: Vec<Device>) -> Self {
        Self::build(devices, true)
    }

    /// [`FastFabric::new`] with the wire path kept: every packet is a
    /// frame, with its ICRC (to compare the two paths).
    pub fn new_wire_path(devices: Vec<Device>) -> Self {
        Self::build(devices, false)
    }

    fn build(devices: Vec<Device>, direct: bool) -> Self {
        let mut attachments = Vec::new();
        let nodes: Vec<Arc<Mutex<Device>>> = devices
            .into_iter()
            .enumerate()
            .map(|(node, mut dev)| {
                dev.set_direct_placement(direct);
                for port in 1..=dev.num_ports() {
                    dev.set_link(port, true);
                    if let Some(mac) = dev.port_mac(port) {
                        attachments.push(Attachment { node, port, mac });
                    }
                }
                Arc::new(Mutex::new(dev))
            })
            .collect();
        Self {
            nodes,
            attachments,
            epoch: Instant::now(),
            spare: Mutex::new(Vec::new()),
        }
    }

    /// Nanoseconds since the fabric was built.
    pub fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when there are no devices.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Runs `f` on device `node` (with the current time set), then delivers
    /// every frame it and its peers produce until the fabric is quiet.
    pub fn with_device<R>(&self, node: usize, f: impl FnOnce(&mut Device) -> R) -> R {
        let mut transit = self.take_transit();
        transit.now = self.now_ns();
        let result = {
            let mut dev = lock(&self.nodes[node]);
            dev.set_time(transit.now);
            let r = f(&mut dev);
            Self::collect(&mut dev, node, &mut transit);
            r
        };
        self.deliver(&mut transit);
        self.give_transit(transit);
        result
    }

    /// A 32-bit register write to device `node`'s BAR0.
    pub fn mmio_write32(&self, node: usize, offset: u64, value: u32) {
        self.with_device(node, |d| d.mmio_write32(offset, value));
    }

    /// A 64-bit write (a doorbell in a UAR page) to device `node`'s BAR0.
    pub fn mmio_write64(&self, node: usize, offset: u64, value: u64) {
        self.with_device(node, |d| d.mmio_write64(offset, value));
    }

    /// A 32-bit register read of device `node`'s BAR0.
    pub fn mmio_read32(&self, node: usize, offset: u64) -> u32 {
        self.with_device(node, |d| d.mmio_read32(offset))
    }

    /// Runs every device timer that is due; returns the earliest time a
    /// timer will next be due, if any.
    pub fn run_timers(&self) -> Option<u64> {
        let mut next = None;
        for node in 0..self.nodes.len() {
            let now = self.now_ns();
            let due = lock(&self.nodes[node]).poll_timeout();
            if due.is_some_and(|t| t <= now) {
                self.with_device(node, |d| d.handle_timeout(now));
            }
            let after = lock(&self.nodes[node]).poll_timeout();
            next = match (next, after) {
                (Some(a), Some(b)) => Some(std::cmp::min(a, b)),
                (a, b) => a.or(b),
            };
        }
        next
    }

    /// Starts a thread that runs timers until the returned guard is dropped.
    /// It sleeps until the next timer (at most `max_sleep`), so an idle
    /// fabric costs no CPU.
    pub fn spawn_timer_thread(self: &Arc<Self>, max_sleep: Duration) -> TimerThread {
        let stop = Arc::new(AtomicBool::new(false));
        let fabric = Arc::clone(self);
        let flag = Arc::clone(&stop);
        let handle = std::thread::spawn(move || {
            while !flag.load(Ordering::Acquire) {
                let next = fabric.run_timers();
                let now = fabric.now_ns();
                let wait = next.map_or(max_sleep, |t| Duration::from_nanos(t.saturating_sub(now)));
                std::thread::sleep(wait.min(max_sleep).max(Duration::from_micros(20)));
            }
        });
        TimerThread {
            stop,
            handle: Some(handle),
        }
    }

    fn take_transit(&self) -> Transit {
        self.spare
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default()
    }

    fn give_transit(&self, transit: Transit) {
        self.spare
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(transit);
    }

    /// Moves a device's outgoing frames and messages into `transit`, giving
    /// it spent ones in exchange (nothing is copied or allocated).
    fn collect(dev: &mut Device, node: usize, transit: &mut Transit) {
        let Transit {
            queue,
            frames,
            messages,
            ..
        } = transit;
        dev.drain_outgoing(|port, out| {
            let spare = match out {
                Outgoing::Frame(_) => frames.pop().map(Outgoing::Frame),
                Outgoing::Direct(_) => messages.pop().map(Outgoing::Direct),
            };
            queue.push_back((node, port, out));
            spare
        });
    }

    /// Delivers queued frames and messages, and what their handling
    /// produces, until none is left.
    fn deliver(&self, transit: &mut Transit) {
        while let Some((from_node, from_port, out)) = transit.queue.pop_front() {
            match out {
                Outgoing::Frame(frame) => {
                    self.deliver_frame(from_node, from_port, &frame, transit);
                    transit.frames.push(frame);
                }
                Outgoing::Direct(msg) => {
                    self.deliver_message(from_node, &msg, transit);
                    transit.messages.push(msg);
                }
            }
        }
    }

    fn deliver_frame(&self, from_node: usize, from_port: u8, frame: &[u8], transit: &mut Transit) {
        if frame.len() < 6 {
            return;
        }
        let dst: [u8; 6] = frame[..6].try_into().unwrap_or([0; 6]);
        let now = transit.now;
        if dst[0] & 1 == 0 {
            if let Some(att) = self.attachments.iter().find(|a| a.mac == dst) {
                let mut dev = lock(&self.nodes[att.node]);
                dev.set_time(now);
                dev.receive(att.port, frame);
                Self::collect(&mut dev, att.node, transit);
            }
        } else {
            // Group address: every other port that joined it (the
            // switch never sends a frame back where it came from).
            for att in &self.attachments {
                if att.node == from_node && att.port == from_port {
                    continue;
                }
                let mut dev = lock(&self.nodes[att.node]);
                if dev.multicast_macs(att.port).contains(&dst) {
                    dev.set_time(now);
                    dev.receive(att.port, frame);
                    Self::collect(&mut dev, att.node, transit);
                }
            }
        }
    }

    /// A direct message (always unicast) goes to its destination device
    /// under one lock; a fault reading the sender's memory goes back to
    /// the sender.
    fn deliver_message(&self, from_node: usize, msg: &DirectMessage, transit: &mut Transit) {
        let Some(dst) = msg.dst_mac() else {
            return;
        };
        let Some(att) = self.attachments.iter().find(|a| a.mac == dst) else {
            return;
        };
        let fault = {
            let mut dev = lock(&self.nodes[att.node]);
            dev.set_time(transit.now);
            let fault = dev.receive_message(att.port, msg);
            Self::collect(&mut dev, att.node, transit);
            fault
        };
        if let Some(index) = fault {
            let mut dev = lock(&self.nodes[from_node]);
            dev.direct_source_fault(msg, index);
            Self::collect(&mut dev, from_node, transit);
        }
    }
}

/// Stops the timer thread when dropped.
#[derive(Debug)]
pub struct TimerThread {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Drop for TimerThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
