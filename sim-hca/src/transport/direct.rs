//! Direct placement: the fast mode's data path (issue 13, measurement 3).
//!
//! On the wire path every payload byte of a 1 MiB RDMA write was touched
//! twelve times (gathered into a zero-filled scratch, copied into a
//! zero-filled frame, checksummed, copied to a transit buffer, checked,
//! copied out). A real HCA's DMA engines read the source once and write
//! the destination once. With direct placement on
//! ([`Device::set_direct_placement`]) the requester still runs the wire
//! path's logic packet by packet — the same key checks, headers, PSNs and
//! counters — but instead of a frame it records each packet's headers and
//! where its payload lies in its own memory (bus address pieces, resolved
//! through its MTT after the lkey check). The receiver hands each packet to
//! the same receive logic as a parsed frame's, its payload still in the
//! sender's memory ([`RxData::InMemory`]); placement copies it once,
//! straight from there to the destination ([`HostMemory::copy_to`]): each
//! payload byte is read once and written once. The copies of a message's
//! packets before its last are merged where they continue each other and
//! made just before the last packet is received, so a 1 MiB write is two
//! copies, not 256 ([`Device::receive_message`]). No ICRC is computed:
//! nothing on a direct path can corrupt a byte, and nothing captures it.
//! A memory that cannot be probed ([`HostMemory::probe`] returns `None`)
//! is read into a one-packet buffer first (two copies per byte).
//!
//! Small messages (issue 13, measurements 1 and 2) go the same way: every
//! packet of a connected service to a unicast peer is a direct packet,
//! inline data carried in the message itself ([`Device::emit_packet_with`]),
//! ACKs, NAKs, read requests and atomics as headers only; no frame is built,
//! checksummed or parsed. The packets one doorbell makes join one message
//! ([`Device::open_message`]), received under one lock, and the responder
//! answers a run of requests in it with one ACK: an ACK acknowledges every
//! packet up to its PSN (IBA 9.7.5.1), so while the last packet queued is
//! a plain ACK of the same QP, the next one replaces it
//! ([`Device::coalesce_ack`], counted in `acks_coalesced`). Anything else
//! the responder sends (a NAK, an RNR NAK, read responses, an atomic
//! acknowledgement) goes after the ACK, so the requester sees the same
//! sequence, minus ACKs it would have applied back to back. Datagrams
//! stay frames (the receiver hands the GRH from the IP header).
//!
//! The data of a read response is read when the requester receives it,
//! and a payload in the sender's memory when the receiver places it: a
//! later operation of the same doorbell may change those bytes first.
//! IBA's relaxed ordering of RDMA reads allows it (a send or write after a
//! read may execute before the read's data is read; an application that
//! needs the order fences the later WQE), and the wire path, which reads
//! each packet when it builds it, shows one of the outcomes IBA allows.
//!
//! A DMA fault reading the source is the sender's fault (as a failed
//! gather is on the wire path): the receiver probes the message's payload
//! before acting on it, stops at the first packet that faults, and the
//! carrier reports it to the sender ([`Device::direct_source_fault`]).
//! The destination is probed when a copy is deferred, so a fault there is
//! the receiver's at the same packet as on the wire path. The one
//! difference from the wire path: the source fault is found when the
//! receiver probes, after the sender queued the message, so traffic
//! queued in between may still be processed. A source unmapped between
//! the probe and the copy (a race with the sender's driver) fails the
//! copy, touching no destination byte, and is reported to the sender at
//! the first packet that copy was for.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;

use ib_types::qp::QpState;
use ib_types::scalars::Psn;
use ib_types::wc::WcStatus;

use crate::device::Device;
use crate::device::qp::Qp;
use crate::host::{DmaFault, HostMemory};
use crate::wire::PacketRepr;
use crate::wire::eth::MacAddr;
use crate::wire::ext::{AethRepr, ExtRepr, Syndrome};
use crate::wire::opcode::Opcode;

use super::{DeferredCopy, Rx, RxData, SourceSpan};
use crate::host::{CopyFault, DmaDirection};
use crate::wire::opcode::Position;

/// What a device sends: a frame, or (direct placement) a message.
#[derive(Debug)]
pub(crate) enum Outgoing {
    Frame(Vec<u8>),
    /// Boxed: messages move between the device, the carrier and their
    /// pools several times each, as a pointer.
    Direct(Box<DirectMessage>),
}

/// Whose payload a direct message carries, which says what a fault
/// reading it means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// Request packets of a send or RDMA write: a fault fails the WQE with
    /// `LOC_PROT_ERR`, as a failed gather does.
    Request,
    /// Read responses to the request at `request_psn`; `replay` for a
    /// duplicate's replay, whose failure the wire path ignores too.
    ReadResponse { request_psn: Psn, replay: bool },
    /// A responder's packets without payload (ACKs, NAKs, atomic
    /// acknowledgements): never a fault. Kept apart from the same QP's
    /// requests, whose source fault ends their message.
    Response,
}

/// Packets of one QP to one destination, whose payloads are still in the
/// sender's memory or carried in the message itself (inline data). The
/// packets a doorbell (or a received message) makes travel together: a
/// packet joins the last message queued if it has the same sender,
/// destination and origin ([`Device::open_message`]).
pub(crate) struct DirectMessage {
    /// The sender's memory.
    source: Option<Arc<dyn HostMemory>>,
    /// The sending QP and its port.
    qp_index: u32,
    port: u8,
    origin: Origin,
    packets: Vec<DirectPacket>,
    /// Payload pieces: bus address in `source`, length.
    pub(crate) pieces: Vec<(u64, usize)>,
    /// Payload bytes the message carries (inline data): `carried[..carried_len]`
    /// is in use; the rest is kept (never zero-filled again) for the next
    /// messages.
    carried: Vec<u8>,
    carried_len: usize,
}

/// One packet of a direct message: its headers and where its payload is.
#[derive(Debug, Clone)]
struct DirectPacket {
    repr: PacketRepr,
    /// The range of the message's `pieces` holding its payload (in the
    /// sender's memory); empty for a payload the message carries.
    pieces: Range<usize>,
    /// The range of the message's `carried` bytes holding its payload.
    carried: Range<usize>,
}

impl std::fmt::Debug for DirectMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectMessage")
            .field("qp_index", &self.qp_index)
            .field("origin", &self.origin)
            .field("packets", &self.packets.len())
            .finish_non_exhaustive()
    }
}

impl DirectMessage {
    /// Number of packets.
    pub(crate) fn len(&self) -> usize {
        self.packets.len()
    }

    /// The destination MAC of the message (every packet has the same).
    pub(crate) fn dst_mac(&self) -> Option<[u8; 6]> {
        self.packets.first().map(|p| p.repr.dst_mac.octets())
    }

    /// The payload bytes packet `packet` carries (empty for a payload in
    /// the sender's memory).
    fn carried(&self, packet: &DirectPacket) -> &[u8] {
        &self.carried[packet.carried.clone()]
    }

    /// Reads packet `index`'s payload (from the sender's memory, or the
    /// bytes the message carries) into `out` (exactly its length).
    fn read_payload(&self, index: usize, out: &mut [u8]) -> Result<(), DmaFault> {
        let packet = &self.packets[index];
        if packet.pieces.is_empty() {
            out.copy_from_slice(self.carried(packet));
            return Ok(());
        }
        let mut at = 0;
        for &(bus, len) in &self.pieces[packet.pieces.clone()] {
            if let Some(source) = &self.source {
                source.read(bus, &mut out[at..at + len])?;
            }
            at += len;
        }
        Ok(())
    }
}

impl Device {
    /// An empty message for packets of QP `qp_index` (pooled).
    pub(crate) fn begin_message(&mut self, qp_index: u32, origin: Origin) -> Box<DirectMessage> {
        let mut msg = self.message_pool.pop().unwrap_or_else(|| {
            Box::new(DirectMessage {
                source: None,
                qp_index,
                port: 0,
                origin,
                packets: Vec::new(),
                pieces: Vec::new(),
                carried: Vec::new(),
                carried_len: 0,
            })
        });
        msg.source = Some(self.mem.clone());
        msg.qp_index = qp_index;
        msg.origin = origin;
        msg.packets.clear();
        msg.pieces.clear();
        msg.carried_len = 0;
        msg
    }

    /// The message for QP `qp_index`'s next packets with `origin` to
    /// `dst` on `port`: the last one queued if it is such a message (so
    /// the packets of one doorbell, or the responses to one received
    /// message, travel and are received together), else a new one. Give
    /// it back with [`Device::queue_message`]; nothing may be queued in
    /// between.
    pub(crate) fn open_message(
        &mut self,
        qp_index: u32,
        origin: Origin,
        port: u8,
        dst: MacAddr,
    ) -> Box<DirectMessage> {
        let continues = matches!(
            self.tx.last(),
            Some((p, Outgoing::Direct(m)))
                if *p == port
                    && m.qp_index == qp_index
                    && m.origin == origin
                    && m.dst_mac() == Some(dst.octets())
        );
        if continues && let Some((_, Outgoing::Direct(msg))) = self.tx.pop() {
            return msg;
        }
        self.begin_message(qp_index, origin)
    }

    /// Adds a packet whose payload is the pieces recorded since the
    /// previous one; false (nothing added) if the headers could not be
    /// emitted as a frame either.
    pub(crate) fn push_packet(
        &mut self,
        msg: &mut DirectMessage,
        port: u8,
        repr: PacketRepr,
    ) -> bool {
        let carried = msg.carried_len..msg.carried_len;
        self.push_direct_packet(msg, port, repr, carried)
    }

    /// Adds a packet of `payload_len` bytes carried in the message itself
    /// (inline data; none for a packet of headers only), written by `fill`.
    /// A `fill` error adds nothing and is returned; headers that could not
    /// be emitted as a frame either add nothing.
    pub(crate) fn push_carried_packet<E>(
        &mut self,
        msg: &mut DirectMessage,
        port: u8,
        repr: PacketRepr,
        fill: impl FnOnce(&mut Device, &mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let start = msg.carried_len;
        let end = start + repr.payload_len;
        if msg.carried.len() < end {
            // Only new room is zero-filled (once), as a new frame buffer.
            self.touch(1, end - msg.carried.len());
            msg.carried.resize(end, 0);
        }
        fill(self, &mut msg.carried[start..end])?;
        if self.push_direct_packet(msg, port, repr, start..end) {
            msg.carried_len = end;
        }
        Ok(())
    }

    fn push_direct_packet(
        &mut self,
        msg: &mut DirectMessage,
        port: u8,
        repr: PacketRepr,
        carried: Range<usize>,
    ) -> bool {
        if repr.check_headers().is_err() {
            return false;
        }
        let start = msg.packets.last().map_or(0, |p| p.pieces.end);
        msg.packets.push(DirectPacket {
            repr,
            pieces: start..msg.pieces.len(),
            carried,
        });
        if let Some(port) = self.port_mut_ref(port) {
            port.counters.tx_packets += 1;
            port.counters.tx_bytes += repr.payload_len as u64;
        }
        true
    }

    /// Direct placement's ACK coalescing (IBA 9.7.5.1.x: an ACK
    /// acknowledges every request packet up to its PSN, so a responder may
    /// answer a run of requests with one): when the last packet queued is
    /// a plain ACK of QP `qp_index` on `port` and nothing was queued after
    /// it, the ACK for `psn` with `aeth` (a plain ACK with a PSN not before
    /// it) replaces it, and the replaced one is never sent. True when it
    /// did. The queued ACK's route is the QP's: its path cannot change
    /// while its packets wait for the carrier (the fast fabric collects a
    /// device's packets after every call, and commands run in calls of
    /// their own).
    pub(crate) fn coalesce_ack(
        &mut self,
        qp_index: u32,
        port: u8,
        psn: Psn,
        aeth: AethRepr,
    ) -> bool {
        if !matches!(aeth.syndrome, Syndrome::Ack { .. }) {
            return false;
        }
        let Some((p, Outgoing::Direct(msg))) = self.tx.last_mut() else {
            return false;
        };
        if *p != port || msg.qp_index != qp_index || msg.origin != Origin::Response {
            return false;
        }
        let Some(last) = msg.packets.last_mut() else {
            return false;
        };
        let plain_ack = last.repr.bth.opcode == Opcode::RcAcknowledge
            && matches!(
                last.repr.ext,
                ExtRepr::Aeth(AethRepr {
                    syndrome: Syndrome::Ack { .. },
                    ..
                })
            );
        if !plain_ack || psn.precedes(last.repr.bth.psn) {
            return false;
        }
        last.repr.bth.psn = psn;
        last.repr.ext = ExtRepr::Aeth(aeth);
        if let Some(port) = self.port_mut_ref(port) {
            port.counters.acks_coalesced += 1;
        }
        true
    }

    /// Queues a message for the carrier (an empty one goes back to the pool).
    pub(crate) fn queue_message(&mut self, port: u8, mut msg: Box<DirectMessage>) {
        msg.port = port;
        if msg.packets.is_empty() {
            self.message_pool.push(msg);
        } else {
            self.tx.push((port, Outgoing::Direct(msg)));
        }
    }

    /// Receives a direct message on `port`, packet by packet, through the
    /// same logic as parsed frames'. Its payload is copied once, from the
    /// sender's memory straight to where it lands: the source is probed
    /// readable first (so a fault is found before the receiver acts on the
    /// packet, as on the wire path), and the copies of the packets before
    /// the message's last are merged and made before that packet — the
    /// one that completes it — is received (nothing the receiver did in
    /// between can be observed: its completions and events come with the
    /// last packet, or report an error, after which the message's data is
    /// undefined anyway; its ACKs leave when the carrier collects them).
    /// A memory that cannot be probed is read into a one-packet buffer
    /// first. Returns the packet the sender's memory could not be read
    /// for, which ends the message; the carrier reports it to the sender
    /// ([`Device::direct_source_fault`]).
    pub(crate) fn receive_message(&mut self, port: u8, msg: &DirectMessage) -> Option<usize> {
        let source = msg.source.clone()?;
        let probed = if msg.pieces.is_empty() {
            // Every payload carried in the message (or none): nothing to read.
            Some(Ok(()))
        } else {
            source.probe(&msg.pieces, DmaDirection::Read)
        };
        let readable = match probed {
            None => {
                return (0..msg.len()).find(|&i| self.receive_buffered(port, msg, i).is_err());
            }
            Some(Ok(())) => msg.len(),
            Some(Err((piece, _))) => msg
                .packets
                .iter()
                .position(|p| p.pieces.contains(&piece))
                .unwrap_or(0),
        };
        let copies = RefCell::new(std::mem::take(&mut self.deferred_copies));
        // The packets of a message share their destination (one sending
        // QP's route): its QP is found once, and stays out of its table
        // slot while they are received.
        let packets = &msg.packets[..readable];
        let target = packets.first().and_then(|first| {
            let same = packets.iter().all(|p| {
                p.repr.dst_ip == first.repr.dst_ip && p.repr.bth.dest_qp == first.repr.bth.dest_qp
            });
            if same {
                self.unicast_destination(port, &first.repr)
            } else {
                None
            }
        });
        let received = match target {
            Some(index) => self.with_qp(index, |dev, qp| {
                dev.receive_packets(port, msg, readable, source.as_ref(), &copies, Some(qp))
            }),
            None => None,
        };
        let mut fault = match received {
            Some(fault) => fault,
            None => self.receive_packets(port, msg, readable, source.as_ref(), &copies, None),
        };
        if fault.is_none() {
            fault = self.make_deferred_copies(source.as_ref(), &copies).err();
        }
        let mut copies = copies.into_inner();
        copies.clear();
        self.deferred_copies = copies;
        fault.or((readable < msg.len()).then_some(readable))
    }

    /// Receives packets `..readable` of `msg` (on `qp` when they are all
    /// its, else each routed on its own); returns the packet whose source
    /// could not be read, which ends the message.
    fn receive_packets(
        &mut self,
        port: u8,
        msg: &DirectMessage,
        readable: usize,
        source: &dyn HostMemory,
        copies: &RefCell<Vec<DeferredCopy>>,
        mut qp: Option<&mut Qp>,
    ) -> Option<usize> {
        for (index, packet) in msg.packets[..readable].iter().enumerate() {
            if self.is_fatal() {
                break;
            }
            let repr = &packet.repr;
            let payload = if packet.pieces.is_empty() {
                // Carried in the message (inline data), or none.
                RxData::Bytes(msg.carried(packet))
            } else {
                let last = matches!(
                    repr.bth.opcode.info().position,
                    Position::Last | Position::Only
                );
                if last && let Err(at) = self.make_deferred_copies(source, copies) {
                    return Some(at);
                }
                RxData::InMemory(SourceSpan {
                    mem: source,
                    pieces: &msg.pieces[packet.pieces.clone()],
                    len: repr.payload_len,
                    defer: (!last).then_some(copies),
                    packet: index,
                })
            };
            let rx = Rx { repr, payload };
            match qp.as_deref_mut() {
                Some(qp) => self.receive_on_qp(port, qp, &rx),
                None => self.receive_packet(port, &[], &rx),
            }
            // Set only if the sender's driver unmapped the source between
            // the probe and a copy made now.
            if self.direct_source_fault_seen.take().is_some() {
                return Some(index);
            }
        }
        None
    }

    /// Makes the copies placement deferred; on a fault reading the source,
    /// the packet that first needed the failed copy (the rest are dropped).
    fn make_deferred_copies(
        &mut self,
        source: &dyn HostMemory,
        copies: &RefCell<Vec<DeferredCopy>>,
    ) -> Result<(), usize> {
        let mut copies = copies.borrow_mut();
        let mut result = Ok(());
        for copy in copies.iter() {
            match source.copy_to(copy.from, self.mem.as_ref(), copy.to, copy.len) {
                Ok(()) => {}
                Err(CopyFault::Source(_)) => {
                    result = Err(copy.packet);
                    break;
                }
                // Probed writable when deferred: the receiver's driver
                // unmapped it since, a fault of this device's.
                Err(CopyFault::Destination(_)) => self.note_fault(),
            }
        }
        copies.clear();
        result
    }

    /// Receives packet `index` of a direct message whose source cannot be
    /// probed: its payload is read into a one-packet buffer first.
    fn receive_buffered(
        &mut self,
        port: u8,
        msg: &DirectMessage,
        index: usize,
    ) -> Result<(), DmaFault> {
        if self.is_fatal() {
            return Ok(());
        }
        let repr = &msg.packets[index].repr;
        let len = repr.payload_len;
        let mut buf = std::mem::take(&mut self.scratch);
        if buf.len() < len {
            buf.resize(len, 0);
        }
        let read = msg.read_payload(index, &mut buf[..len]);
        if read.is_ok() {
            // Read from the source, written into the packet buffer.
            self.touch(2, len);
            self.receive_packet(
                port,
                &[],
                &Rx {
                    repr,
                    payload: RxData::Bytes(&buf[..len]),
                },
            );
        }
        self.scratch = buf;
        read
    }

    /// The payload of packet `index` of a message this device sent could
    /// not be read from its memory: what the wire path does when reading
    /// it fails.
    pub(crate) fn direct_source_fault(&mut self, msg: &DirectMessage, index: usize) {
        self.note_fault();
        // The wire path never sent the packets from the one it could not
        // gather on.
        if let Some(port) = self.port_mut_ref(msg.port) {
            for packet in &msg.packets[index..] {
                port.counters.tx_packets = port.counters.tx_packets.saturating_sub(1);
                port.counters.tx_bytes = port
                    .counters
                    .tx_bytes
                    .saturating_sub(packet.repr.payload_len as u64);
            }
        }
        let psn = msg.packets[index].repr.bth.psn;
        match msg.origin {
            // Headers only: nothing to read.
            Origin::Response => {}
            Origin::Request => {
                self.with_qp(msg.qp_index, |dev, qp| {
                    if let Some(i) = qp
                        .req
                        .inflight
                        .iter()
                        .position(|r| !r.done && r.contains(psn))
                    {
                        dev.finish_record(qp, i, WcStatus::LocProtErr);
                        dev.retire(qp);
                    }
                });
            }
            Origin::ReadResponse { replay: true, .. } => {}
            Origin::ReadResponse {
                request_psn,
                replay: false,
            } => {
                self.with_qp(msg.qp_index, |dev, qp| {
                    if qp.state != QpState::Err {
                        dev.read_source_failed(qp, request_psn);
                    }
                });
            }
        }
    }

    /// Hands the frames the wire path would have sent for `msg` to `f`,
    /// in order (for a carrier of frames). A fault reading a payload is
    /// this device's, and ends the message.
    pub(crate) fn materialize(&mut self, msg: &DirectMessage, mut f: impl FnMut(&[u8])) {
        let mut frame = self.take_frame_buf();
        for (index, packet) in msg.packets.iter().enumerate() {
            let repr = &packet.repr;
            let Some(payload) = frame_payload(repr, &mut frame) else {
                continue;
            };
            if msg
                .read_payload(index, &mut frame[payload.clone()])
                .is_err()
            {
                self.direct_source_fault(msg, index);
                break;
            }
            self.touch(2, payload.len());
            if self.seal_frame(repr, &mut frame).is_ok() {
                f(&frame);
            }
        }
        self.recycle_frame(frame);
    }
}

/// Sizes `frame` for `repr` and writes its headers; returns where its
/// payload goes.
fn frame_payload(repr: &PacketRepr, frame: &mut Vec<u8>) -> Option<Range<usize>> {
    let len = repr.buffer_len();
    if frame.len() < len {
        frame.resize(len, 0);
    }
    frame.truncate(len);
    repr.emit_headers(frame).ok()
}
