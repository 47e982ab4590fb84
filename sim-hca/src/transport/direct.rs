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
use crate::host::{DmaFault, HostMemory};
use crate::wire::PacketRepr;

use super::{DeferredCopy, Rx, RxData, SourceSpan};
use crate::host::{CopyFault, DmaDirection};
use crate::wire::opcode::Position;

/// What a device sends: a frame, or (direct placement) a message.
#[derive(Debug)]
pub(crate) enum Outgoing {
    Frame(Vec<u8>),
    Direct(DirectMessage),
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
}

/// Packets of one QP whose payloads are still in the sender's memory.
pub(crate) struct DirectMessage {
    /// The sender's memory.
    source: Option<Arc<dyn HostMemory>>,
    /// The sending QP and its port.
    qp_index: u32,
    port: u8,
    origin: Origin,
    /// Headers and the range of `pieces` holding each packet's payload.
    packets: Vec<(PacketRepr, Range<usize>)>,
    /// Payload pieces: bus address in `source`, length.
    pub(crate) pieces: Vec<(u64, usize)>,
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
        self.packets.first().map(|(repr, _)| repr.dst_mac.octets())
    }

    /// Reads packet `index`'s payload from the sender's memory into `out`
    /// (exactly its length).
    fn read_payload(&self, index: usize, out: &mut [u8]) -> Result<(), DmaFault> {
        let (_, range) = &self.packets[index];
        let mut at = 0;
        for &(bus, len) in &self.pieces[range.clone()] {
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
    pub(crate) fn begin_message(&mut self, qp_index: u32, origin: Origin) -> DirectMessage {
        let mut msg = self.message_pool.pop().unwrap_or(DirectMessage {
            source: None,
            qp_index,
            port: 0,
            origin,
            packets: Vec::new(),
            pieces: Vec::new(),
        });
        msg.source = Some(self.mem.clone());
        msg.qp_index = qp_index;
        msg.origin = origin;
        msg.packets.clear();
        msg.pieces.clear();
        msg
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
        if repr.check_headers().is_err() {
            return false;
        }
        let start = msg.packets.last().map_or(0, |(_, r)| r.end);
        msg.packets.push((repr, start..msg.pieces.len()));
        if let Some(port) = self.port_mut_ref(port) {
            port.counters.tx_packets += 1;
            port.counters.tx_bytes += repr.payload_len as u64;
        }
        true
    }

    /// Queues a message for the carrier (an empty one goes back to the pool).
    pub(crate) fn queue_message(&mut self, port: u8, mut msg: DirectMessage) {
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
        let readable = match source.probe(&msg.pieces, DmaDirection::Read) {
            None => {
                return (0..msg.len()).find(|&i| self.receive_buffered(port, msg, i).is_err());
            }
            Some(Ok(())) => msg.len(),
            Some(Err((piece, _))) => msg
                .packets
                .iter()
                .position(|(_, range)| range.contains(&piece))
                .unwrap_or(0),
        };
        let copies = RefCell::new(std::mem::take(&mut self.deferred_copies));
        let mut fault = None;
        for (index, (repr, range)) in msg.packets[..readable].iter().enumerate() {
            if self.is_fatal() {
                break;
            }
            let last = matches!(
                repr.bth.opcode.info().position,
                Position::Last | Position::Only
            );
            if last && let Err(at) = self.make_deferred_copies(source.as_ref(), &copies) {
                fault = Some(at);
                break;
            }
            let payload = RxData::InMemory(SourceSpan {
                mem: source.as_ref(),
                pieces: &msg.pieces[range.clone()],
                len: repr.payload_len,
                defer: (!last).then_some(&copies),
                packet: index,
            });
            self.receive_packet(port, &[], &Rx { repr, payload });
            // Set only if the sender's driver unmapped the source between
            // the probe and a copy made now.
            if self.direct_source_fault_seen.take().is_some() {
                fault = Some(index);
                break;
            }
        }
        if fault.is_none() {
            fault = self.make_deferred_copies(source.as_ref(), &copies).err();
        }
        let mut copies = copies.into_inner();
        copies.clear();
        self.deferred_copies = copies;
        fault.or((readable < msg.len()).then_some(readable))
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
        let (repr, _) = &msg.packets[index];
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
            for (repr, _) in &msg.packets[index..] {
                port.counters.tx_packets = port.counters.tx_packets.saturating_sub(1);
                port.counters.tx_bytes = port
                    .counters
                    .tx_bytes
                    .saturating_sub(repr.payload_len as u64);
            }
        }
        let psn = msg.packets[index].0.bth.psn;
        match msg.origin {
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
        for (index, (repr, _)) in msg.packets.iter().enumerate() {
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
