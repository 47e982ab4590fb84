//! The simulated HCA: BAR0, the command interface, contexts, event and
//! completion queues, doorbells, and the transport engine, as `docs/prm.md`
//! specifies them.
//!
//! The device is a sans-IO state machine driven through `&mut self`:
//!
//! - the driver side calls [`Device::mmio_read32`]/[`Device::mmio_write32`]
//!   (and the 64-bit forms) exactly as it would touch BAR0;
//! - the fabric side hands in frames with [`Device::receive`] and takes the
//!   frames the device sends with [`Device::drain_tx`];
//! - time is passed in ([`Device::set_time`], [`Device::handle_timeout`]) and
//!   [`Device::poll_timeout`] says when the device next needs to run; a
//!   carrier that sends the drained frames after the call, taking real
//!   time, says when they left ([`Device::start_ack_timers`]).
//!
//! Work a doorbell triggers (commands, sends) runs inside the doorbell write,
//! in the caller's thread, so a fast-mode host needs no device thread. The
//! device reaches host memory only through [`HostMemory`] with bus addresses,
//! and raises interrupts through [`InterruptSink`]. Nothing a driver or a peer
//! does can panic it: bad commands fail with a status, garbage WQEs complete
//! in error, malformed frames are dropped and counted, DMA outside a mapping
//! is a counted fault.

mod command;
pub mod config;
pub(crate) mod dma;
mod event;
pub(crate) mod mw;
mod port;
pub(crate) mod qp;
mod resource;
pub(crate) mod timers;

use std::sync::Arc;

use hca_prm::cmd::{CmdStatus, DevCap};
use hca_prm::regs::{self, CmdqConfig, FatalSyndrome, Status};

use crate::host::{HostMemory, InterruptSink};

pub use config::{DeviceConfig, Limits, PortConfig};
pub use port::PortCounters;
pub use timers::UnsentAckTimers;

pub(crate) use port::Port;
use resource::Hca;

/// Device-wide counters (the RO counter registers and more).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Host accesses outside a live DMA mapping.
    pub dma_faults: u32,
    /// Doorbells ignored (unknown object or unauthorised UAR page).
    pub dropped_doorbells: u32,
    /// Commands completed with a non-zero status.
    pub bad_commands: u32,
    /// Events of a class no EQ is mapped for.
    pub unmapped_events: u64,
    /// Interrupts raised.
    pub interrupts: u64,
}

#[derive(Debug, Default)]
struct CommandQueue {
    base: u64,
    config: CmdqConfig,
    producer: u32,
    consumer: u32,
}

/// A simulated HCA.
pub struct Device {
    cfg: DeviceConfig,
    cap: DevCap,
    pub(crate) mem: Arc<dyn HostMemory>,
    irq: Arc<dyn InterruptSink>,
    pub(crate) now_ns: u64,
    status: Status,
    cmdq: CommandQueue,
    /// Completions of event-completed commands held back by
    /// [`Device::hold_command_completions`] (token, status, `out_imm`).
    held_completions: Option<Vec<(u16, u8, u64)>>,
    pub(crate) counters: DeviceCounters,
    ports: Vec<Port>,
    pub(crate) hca: Option<Hca>,
    /// What waits for [`Device::drain_tx`]: (port, frame or message).
    pub(crate) tx: Vec<(u8, Outgoing)>,
    /// Spent frame buffers, reused so steady-state sending does not allocate.
    frame_pool: Vec<Vec<u8>>,
    /// Spent direct messages, reused likewise.
    #[allow(
        clippy::vec_box,
        reason = "pooled boxes: a message moves as a pointer, and reusing its box allocates nothing"
    )]
    pub(crate) message_pool: Vec<Box<DirectMessage>>,
    /// The packet buffer direct placement reads a payload into (one
    /// packet's worth) when the sender's memory cannot be probed, reused
    /// across packets.
    pub(crate) scratch: Vec<u8>,
    /// Direct placement: reading the sender's memory failed while placing
    /// a packet probed readable (its driver unmapped it meanwhile); the
    /// carrier reports it to the sender.
    pub(crate) direct_source_fault_seen: Option<crate::host::DmaFault>,
    /// The send ring window's buffer (`transport::send`), kept for its
    /// capacity between runs of a send queue.
    pub(crate) sq_window: Vec<u8>,
    /// Copies direct placement deferred within a message (kept for its
    /// capacity between messages).
    pub(crate) deferred_copies: Vec<crate::transport::DeferredCopy>,
    /// Direct placement (fast mode): payloads of RC/UC data packets go from
    /// the sender's memory to the receiver's without a frame. See
    /// [`Device::set_direct_placement`].
    pub(crate) direct: bool,
    /// Passes over payload bytes (issue 13's "bytes touched"): every
    /// zero-fill, checksum pass, read or write of a payload byte by the
    /// device counts one; a copy counts two.
    pub(crate) payload_passes: u64,
    /// The carrier reports when it handed the drained frames to the
    /// network ([`Device::set_ack_timers_at_hand_off`]).
    pub(crate) ack_timers_at_hand_off: bool,
    /// QPs whose ACK timer a transmission started since the carrier last
    /// took them ([`Device::take_unsent_ack_timers`]); a QP may repeat.
    pub(crate) unsent_ack_timers: Vec<u32>,
}

pub(crate) use crate::transport::direct::{DirectMessage, Outgoing};

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("node_guid", &format_args!("{:#x}", self.cfg.node_guid))
            .field("status", &self.status)
            .field("now_ns", &self.now_ns)
            .finish_non_exhaustive()
    }
}

impl Device {
    /// A device fresh out of reset (`READY`), with its ports' links down.
    pub fn new(cfg: DeviceConfig, mem: Arc<dyn HostMemory>, irq: Arc<dyn InterruptSink>) -> Self {
        let cap = cfg.dev_cap();
        let ports = cfg
            .ports
            .iter()
            .enumerate()
            .map(|(i, p)| Port::new(p.clone(), cfg.node_guid + 1 + i as u64, &cfg.limits))
            .collect();
        Self {
            cfg,
            cap,
            mem,
            irq,
            now_ns: 0,
            status: Status::READY,
            cmdq: CommandQueue::default(),
            held_completions: None,
            counters: DeviceCounters::default(),
            ports,
            hca: None,
            tx: Vec::new(),
            frame_pool: Vec::new(),
            message_pool: Vec::new(),
            scratch: Vec::new(),
            direct_source_fault_seen: None,
            deferred_copies: Vec::new(),
            sq_window: Vec::new(),
            direct: false,
            payload_passes: 0,
            ack_timers_at_hand_off: false,
            unsent_ack_timers: Vec::new(),
        }
    }

    /// Turns direct placement on or off (off when built). On, the payload
    /// of an RC or UC send, RDMA write or RDMA read response that gathers
    /// from memory travels as a reference to the sender's memory: the
    /// receiver copies it from there once, straight to where it lands, as
    /// a real HCA's DMA engines do. Headers,
    /// every protection check, PSNs, ACKs and completions are those of the
    /// wire path; only the frame (serialisation, ICRC, copies) is skipped.
    /// For a fabric that neither captures nor injects faults (the fast
    /// mode), and only one whose carrier understands the messages
    /// ([`crate::fast::FastFabric`]); [`Device::drain_tx`] turns any still
    /// queued into ordinary frames.
    pub fn set_direct_placement(&mut self, on: bool) {
        self.direct = on;
    }

    /// Passes the device has made over payload bytes since it was built:
    /// every zero-fill, checksum, read or write of a payload byte counts
    /// one (a copy counts two). Divided by the payload bytes moved, the
    /// number of times each byte is touched (issue 13).
    pub fn payload_bytes_touched(&self) -> u64 {
        self.payload_passes
    }

    /// Counts `passes` passes over `bytes` payload bytes.
    pub(crate) fn touch(&mut self, passes: u64, bytes: usize) {
        self.payload_passes = self
            .payload_passes
            .wrapping_add(passes.wrapping_mul(bytes as u64));
    }

    /// The configuration the device was built with.
    pub fn config(&self) -> &DeviceConfig {
        &self.cfg
    }

    /// Device-wide counters.
    pub fn counters(&self) -> DeviceCounters {
        self.counters
    }

    /// A port's packet counters (`port` is 1-based).
    pub fn port_counters(&self, port: u8) -> Option<PortCounters> {
        self.port(port).map(|p| p.counters)
    }

    /// The MAC of a port (`port` is 1-based): derived from GID 0 (PRM 10.1).
    pub fn port_mac(&self, port: u8) -> Option<[u8; 6]> {
        self.port(port).map(Port::mac)
    }

    /// Gives port `port` (1-based) the IPv4 address `ipv4`: GID 0 becomes
    /// its IPv4-mapped address and the MAC follows it (PRM 10.1), and a
    /// reset keeps it. For a carrier that assigns addresses as it attaches
    /// the device (`crate::udp::UdpFabric`), before a driver reads the
    /// port. False (nothing changed) for a port the device lacks.
    pub fn set_port_ipv4(&mut self, port: u8, ipv4: [u8; 4]) -> bool {
        let Some(index) = usize::from(port)
            .checked_sub(1)
            .filter(|&i| i < self.ports.len())
        else {
            return false;
        };
        self.cfg.ports[index].ipv4 = ipv4;
        let port = &mut self.ports[index];
        port.cfg.ipv4 = ipv4;
        port.gids[0] = ib_types::scalars::Gid::from_ipv4(ipv4);
        true
    }

    /// Number of ports.
    pub fn num_ports(&self) -> u8 {
        self.ports.len() as u8
    }

    /// True once a catastrophic error stopped the device.
    pub fn is_fatal(&self) -> bool {
        self.status.contains(Status::FATAL)
    }

    /// Advances the device's notion of time (monotonic; earlier is ignored).
    pub fn set_time(&mut self, now_ns: u64) {
        self.now_ns = self.now_ns.max(now_ns);
    }

    /// Tests: from now on, commands still execute at their doorbell but the
    /// `CMD_COMPLETION` events of event-completed commands are held back
    /// until [`release_command_completions`](Self::release_command_completions).
    /// A real device's firmware posts a completion some time after it
    /// executed the command, so events the device raises in between (a QP
    /// error after a `MODIFY_QP` took effect) precede the completion.
    pub fn hold_command_completions(&mut self) {
        self.held_completions.get_or_insert_with(Vec::new);
    }

    /// Tests: posts the completions held since
    /// [`hold_command_completions`](Self::hold_command_completions), in
    /// command order, and completes later commands at once again.
    pub fn release_command_completions(&mut self) {
        for (token, status, out_imm) in self.held_completions.take().unwrap_or_default() {
            self.post_event(hca_prm::eqe::Event::CmdCompletion {
                token,
                status,
                out_imm,
            });
        }
    }

    /// The device's current time.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    fn port(&self, port: u8) -> Option<&Port> {
        usize::from(port)
            .checked_sub(1)
            .and_then(|i| self.ports.get(i))
    }

    fn port_mut(&mut self, port: u8) -> Option<&mut Port> {
        usize::from(port)
            .checked_sub(1)
            .and_then(|i| self.ports.get_mut(i))
    }

    /// A port, for the transport engine (`port` is 1-based).
    pub(crate) fn port_ref(&self, port: u8) -> Option<&Port> {
        self.port(port)
    }

    /// A port, mutably, for the transport engine.
    pub(crate) fn port_mut_ref(&mut self, port: u8) -> Option<&mut Port> {
        self.port_mut(port)
    }

    /// Reads a 32-bit register of BAR0 page 0; UAR pages read as 0.
    pub fn mmio_read32(&mut self, offset: u64) -> u32 {
        use regs::offset as o;
        match offset {
            o::MAGIC => regs::MAGIC_VALUE,
            o::PRM_VERSION => {
                u32::from(regs::PRM_VERSION_MAJOR) << 16 | u32::from(regs::PRM_VERSION_MINOR)
            }
            o::FW_VERSION => self.cfg.fw_version as u32,
            0x00C => (self.cfg.fw_version >> 32) as u32,
            o::STATUS => self.status.bits(),
            o::CMDQ_BASE => self.cmdq.base as u32,
            0x01C => (self.cmdq.base >> 32) as u32,
            o::CMDQ_CONFIG => self.cmdq.config.to_bits(),
            o::CMDQ_CONSUMER => self.cmdq.consumer,
            o::DMA_FAULTS => self.counters.dma_faults,
            o::DROPPED_DOORBELLS => self.counters.dropped_doorbells,
            o::BAD_COMMANDS => self.counters.bad_commands,
            _ => 0,
        }
    }

    /// Reads a 64-bit register (two 32-bit reads, low first).
    pub fn mmio_read64(&mut self, offset: u64) -> u64 {
        u64::from(self.mmio_read32(offset)) | u64::from(self.mmio_read32(offset + 4)) << 32
    }

    /// Writes a 32-bit register of BAR0 page 0. Writes to UAR pages must be
    /// 64-bit ([`Device::mmio_write64`]); a 32-bit write there is ignored.
    pub fn mmio_write32(&mut self, offset: u64, value: u32) {
        use regs::offset as o;
        if offset >= regs::PAGE_SIZE {
            self.counters.dropped_doorbells += 1;
            return;
        }
        if offset == o::CONTROL {
            if regs::Control::from_bits_retain(value).contains(regs::Control::RESET) {
                self.reset();
            }
            return;
        }
        if self.is_fatal() {
            return;
        }
        match offset {
            o::CMDQ_BASE => self.set_cmdq_base((self.cmdq.base & !0xFFFF_FFFF) | u64::from(value)),
            0x01C => {
                self.set_cmdq_base((self.cmdq.base & 0xFFFF_FFFF) | u64::from(value) << 32);
            }
            o::CMDQ_CONFIG => self.set_cmdq_config(value),
            o::CMDQ_DOORBELL => self.cmdq_doorbell(value),
            _ => {
                if let Some(eqn) = regs::eqn_of_doorbell(offset) {
                    self.eq_doorbell(eqn, value);
                }
            }
        }
    }

    /// Writes 64 bits: a doorbell in a UAR page, or two 32-bit register
    /// writes (low first) in page 0.
    pub fn mmio_write64(&mut self, offset: u64, value: u64) {
        if offset < regs::PAGE_SIZE {
            self.mmio_write32(offset, value as u32);
            self.mmio_write32(offset + 4, (value >> 32) as u32);
            return;
        }
        if self.is_fatal() {
            return;
        }
        let uar = (offset / regs::PAGE_SIZE - 1) as u32;
        let in_page = offset % regs::PAGE_SIZE;
        self.uar_doorbell(uar, in_page, value);
    }

    /// Resets the device: every context, queue and port state is discarded.
    pub fn reset(&mut self) {
        let links: Vec<bool> = self.ports.iter().map(|p| p.link_up).collect();
        let mut fresh = Device::new(self.cfg.clone(), self.mem.clone(), self.irq.clone());
        for (port, up) in fresh.ports.iter_mut().zip(links) {
            port.link_up = up;
        }
        fresh.now_ns = self.now_ns;
        fresh.counters = self.counters;
        fresh.frame_pool = std::mem::take(&mut self.frame_pool);
        fresh.message_pool = std::mem::take(&mut self.message_pool);
        fresh.direct = self.direct;
        fresh.payload_passes = self.payload_passes;
        fresh.ack_timers_at_hand_off = self.ack_timers_at_hand_off;
        *self = fresh;
    }

    /// Declares a catastrophic error (PRM 2): the device stops processing and
    /// reports `CATASTROPHIC` on the EQ mapped for device errors.
    pub fn declare_fatal(&mut self, syndrome: FatalSyndrome) {
        if self.is_fatal() {
            return;
        }
        self.status = (self.status | Status::FATAL).with_syndrome(syndrome);
        self.post_catastrophic();
    }

    /// Counts a DMA fault.
    pub(crate) fn note_fault(&mut self) {
        self.counters.dma_faults = self.counters.dma_faults.wrapping_add(1);
    }

    /// Queues a frame for the fabric; `build` fills a pooled buffer (the
    /// cluster's tests inject frames with it).
    #[cfg(test)]
    pub(crate) fn send_frame(&mut self, port: u8, build: impl FnOnce(&mut Vec<u8>)) {
        let mut buf = self.frame_pool.pop().unwrap_or_default();
        buf.clear();
        build(&mut buf);
        if buf.is_empty() {
            self.frame_pool.push(buf);
        } else {
            self.tx.push((port, Outgoing::Frame(buf)));
        }
    }

    /// A spent frame buffer (its contents are stale), for a frame to be
    /// built in place; give it back with [`Device::queue_frame`] or
    /// [`Device::recycle_frame`].
    pub(crate) fn take_frame_buf(&mut self) -> Vec<u8> {
        self.frame_pool.pop().unwrap_or_default()
    }

    /// Queues a frame built in a buffer from [`Device::take_frame_buf`].
    pub(crate) fn queue_frame(&mut self, port: u8, frame: Vec<u8>) {
        self.tx.push((port, Outgoing::Frame(frame)));
    }

    /// Returns a frame buffer to the pool.
    pub(crate) fn recycle_frame(&mut self, frame: Vec<u8>) {
        self.frame_pool.push(frame);
    }

    /// Hands every queued outgoing frame to `f(port, frame)`, oldest first.
    /// Direct messages still queued go out as the frames the wire path
    /// would have sent.
    pub fn drain_tx(&mut self, mut f: impl FnMut(u8, &[u8])) {
        let mut tx = std::mem::take(&mut self.tx);
        for (port, out) in tx.drain(..) {
            match out {
                Outgoing::Frame(frame) => {
                    f(port, &frame);
                    self.frame_pool.push(frame);
                }
                Outgoing::Direct(msg) => {
                    self.materialize(&msg, |frame| f(port, frame));
                    self.message_pool.push(msg);
                }
            }
        }
        // Keep the (now empty) vector's capacity.
        self.tx = tx;
    }

    /// Hands every queued outgoing item to `f(port, item)` by value, oldest
    /// first; `f` may return a spent item of its own for the device's pools
    /// (so buffers circulate instead of being copied or allocated).
    pub(crate) fn drain_outgoing(&mut self, mut f: impl FnMut(u8, Outgoing) -> Option<Outgoing>) {
        let mut tx = std::mem::take(&mut self.tx);
        for (port, out) in tx.drain(..) {
            match f(port, out) {
                Some(Outgoing::Frame(frame)) => self.frame_pool.push(frame),
                Some(Outgoing::Direct(msg)) => self.message_pool.push(msg),
                None => {}
            }
        }
        self.tx = tx;
    }

    /// Frames waiting to be drained.
    pub fn tx_pending(&self) -> usize {
        self.tx.len()
    }

    /// The command status counters use.
    fn count_command(&mut self, status: CmdStatus) {
        if status != CmdStatus::Ok {
            self.counters.bad_commands = self.counters.bad_commands.wrapping_add(1);
        }
    }
}

impl Device {
    /// The Ethernet group addresses port `port` must receive: one per
    /// multicast group a QP on that port is attached to (PRM 10.1).
    pub fn multicast_macs(&self, port: u8) -> Vec<[u8; 6]> {
        let Some(hca) = self.hca.as_ref() else {
            return Vec::new();
        };
        let mut macs: Vec<[u8; 6]> = hca
            .mcgs
            .iter()
            .filter(|(_, members)| {
                members.iter().any(|&q| {
                    hca.qps
                        .get(q as usize)
                        .and_then(|s| s.as_ref())
                        .is_some_and(|qp| qp.port == port)
                })
            })
            .filter_map(|(gid, _)| gid.ipv4())
            .filter_map(|ip| crate::wire::eth::MacAddr::for_ipv4_multicast(ip.into()))
            .map(|mac| mac.octets())
            .collect();
        macs.sort_unstable();
        macs.dedup();
        macs
    }
}
