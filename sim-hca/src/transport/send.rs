//! The requester: fetching send WQEs and turning them into request packets.

use std::net::Ipv4Addr;

use hca_prm::wqe::{Payload, SendWqe, WqeFlags, WqeOp, WqeOpcode};
use ib_types::qp::{QpState, QpType};
use ib_types::scalars::{PKey, Psn, QKey, Qpn};
use ib_types::wc::WcStatus;
use ib_types::wr::Transport;

use super::direct::Origin;
use super::{ACK_REQ_INTERVAL, RxData, SendRecord};
use crate::device::Device;
use crate::device::dma::{KeyError, MttRange, Need, XlateError, check_key};
use crate::device::qp::Qp;
use crate::wire::bth::BthRepr;
use crate::wire::eth::MacAddr;
use crate::wire::ext::{AtomicEthRepr, DethRepr, ExtRepr, IethRepr, ImmDtRepr, RethRepr};
use crate::wire::opcode::{Opcode, Transport as WireTransport};
use crate::wire::packet::PacketRepr;
use crate::wire::udp::flow_source_port;

/// Largest send WQE the device reads, in bytes (`2^log_max_wqe_size`).
pub(crate) const MAX_WQE_BYTES: usize = 512;

/// Send ring blocks one window read takes at most (4 KiB).
const SQ_WINDOW_BBS: u32 = 64;

/// What one run of a send queue keeps across its WQEs: the posted send
/// ring blocks read ahead ([`Device::fetch_wqe`]: `blocks` blocks from
/// counter `first`) and the QP's route.
#[derive(Debug, Default)]
pub(crate) struct SqWindow {
    first: u32,
    blocks: u32,
    bytes: Vec<u8>,
    /// The QP's route, once a WQE found it.
    path: Option<Route>,
}

impl SqWindow {
    /// True when blocks `bb..bb + n` are in the window.
    fn covers(&self, bb: u32, n: u32) -> bool {
        let at = bb.wrapping_sub(self.first);
        at < self.blocks && n <= self.blocks - at
    }

    /// Block `bb` (which the window covers).
    fn block(&self, bb: u32) -> &[u8] {
        let at = bb.wrapping_sub(self.first) as usize * 64;
        &self.bytes[at..at + 64]
    }
}

/// Where a message's packet sits in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pos {
    First,
    Middle,
    Last,
    Only,
}

impl Pos {
    pub(crate) fn of(index: u32, count: u32) -> Self {
        match (index == 0, index + 1 == count) {
            (true, true) => Self::Only,
            (true, false) => Self::First,
            (false, true) => Self::Last,
            (false, false) => Self::Middle,
        }
    }

    fn ends(self) -> bool {
        matches!(self, Self::Last | Self::Only)
    }

    fn starts(self) -> bool {
        matches!(self, Self::First | Self::Only)
    }
}

/// The request opcode for a packet of a send or RDMA write message.
fn request_opcode(transport: Transport, op: WqeOpcode, pos: Pos) -> Option<Opcode> {
    use Opcode as O;
    use Pos::*;
    use WqeOpcode as W;
    Some(match (transport, op, pos) {
        (Transport::Rc, W::Send | W::SendImm | W::SendInv, First) => O::RcSendFirst,
        (Transport::Rc, W::Send | W::SendImm | W::SendInv, Middle) => O::RcSendMiddle,
        (Transport::Rc, W::Send, Last) => O::RcSendLast,
        (Transport::Rc, W::SendImm, Last) => O::RcSendLastWithImmediate,
        (Transport::Rc, W::SendInv, Last) => O::RcSendLastWithInvalidate,
        (Transport::Rc, W::Send, Only) => O::RcSendOnly,
        (Transport::Rc, W::SendImm, Only) => O::RcSendOnlyWithImmediate,
        (Transport::Rc, W::SendInv, Only) => O::RcSendOnlyWithInvalidate,
        (Transport::Rc, W::RdmaWrite | W::RdmaWriteImm, First) => O::RcRdmaWriteFirst,
        (Transport::Rc, W::RdmaWrite | W::RdmaWriteImm, Middle) => O::RcRdmaWriteMiddle,
        (Transport::Rc, W::RdmaWrite, Last) => O::RcRdmaWriteLast,
        (Transport::Rc, W::RdmaWriteImm, Last) => O::RcRdmaWriteLastWithImmediate,
        (Transport::Rc, W::RdmaWrite, Only) => O::RcRdmaWriteOnly,
        (Transport::Rc, W::RdmaWriteImm, Only) => O::RcRdmaWriteOnlyWithImmediate,
        (Transport::Uc, W::Send | W::SendImm, First) => O::UcSendFirst,
        (Transport::Uc, W::Send | W::SendImm, Middle) => O::UcSendMiddle,
        (Transport::Uc, W::Send, Last) => O::UcSendLast,
        (Transport::Uc, W::SendImm, Last) => O::UcSendLastWithImmediate,
        (Transport::Uc, W::Send, Only) => O::UcSendOnly,
        (Transport::Uc, W::SendImm, Only) => O::UcSendOnlyWithImmediate,
        (Transport::Uc, W::RdmaWrite | W::RdmaWriteImm, First) => O::UcRdmaWriteFirst,
        (Transport::Uc, W::RdmaWrite | W::RdmaWriteImm, Middle) => O::UcRdmaWriteMiddle,
        (Transport::Uc, W::RdmaWrite, Last) => O::UcRdmaWriteLast,
        (Transport::Uc, W::RdmaWriteImm, Last) => O::UcRdmaWriteLastWithImmediate,
        (Transport::Uc, W::RdmaWrite, Only) => O::UcRdmaWriteOnly,
        (Transport::Uc, W::RdmaWriteImm, Only) => O::UcRdmaWriteOnlyWithImmediate,
        (Transport::Ud, W::Send, Only) => O::UdSendOnly,
        (Transport::Ud, W::SendImm, Only) => O::UdSendOnlyWithImmediate,
        _ => return None,
    })
}

/// The transport a QP type runs (special QPs are datagram QPs).
pub(crate) fn transport_of(qp_type: QpType) -> Transport {
    match qp_type {
        QpType::Rc => Transport::Rc,
        QpType::Uc => Transport::Uc,
        QpType::Ud | QpType::Smi | QpType::Gsi => Transport::Ud,
    }
}

/// Addressing of one packet: everything below the BTH plus the P_Key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Route {
    /// The sending QP.
    pub qp_index: u32,
    pub port: u8,
    pub src_mac: MacAddr,
    pub dst_mac: MacAddr,
    pub src_ip: Ipv4Addr,
    pub dst_ip: Ipv4Addr,
    pub tos: u8,
    pub ttl: u8,
    pub src_port: u16,
    pub pkey: PKey,
}

impl Route {
    /// The headers of a packet on this route.
    pub(crate) fn repr(&self, bth: BthRepr, ext: ExtRepr, payload_len: usize) -> PacketRepr {
        PacketRepr {
            dst_mac: self.dst_mac,
            src_mac: self.src_mac,
            src_ip: self.src_ip,
            dst_ip: self.dst_ip,
            tos: self.tos,
            ttl: self.ttl,
            src_port: self.src_port,
            bth,
            ext,
            payload_len,
        }
    }

    /// True when packets on this route may be placed directly: a unicast
    /// destination (group traffic goes through the switch as frames).
    pub(crate) fn is_unicast(&self) -> bool {
        !self.dst_mac.is_multicast()
    }
}

/// The completion status of a local key check that failed. PRM 7.1: a
/// local access needs a valid region of the QP's PD covering the access,
/// with LOCAL_WRITE for writes into it — "Failure: LOC_PROT_ERR", whichever
/// of these it lacks (a missing right included).
pub(crate) fn key_status(_: KeyError) -> WcStatus {
    WcStatus::LocProtErr
}

impl Device {
    /// Runs `f` with QP `n` taken out of its table slot, so that `f` can use
    /// the rest of the device mutably. `None` if there is no such QP.
    pub(crate) fn with_qp<R>(
        &mut self,
        n: u32,
        f: impl FnOnce(&mut Device, &mut Qp) -> R,
    ) -> Option<R> {
        let mut qp = self.hca.as_mut()?.qps.get_mut(n as usize)?.take()?;
        let result = f(self, &mut qp);
        if let Some(hca) = self.hca.as_mut()
            && let Some(slot) = hca.qps.get_mut(n as usize)
        {
            // The one place a QP's timers change: keep the index exact.
            hca.timers
                .file(n, crate::device::timers::earliest_deadline(&qp.req));
            *slot = Some(qp);
        }
        Some(result)
    }

    /// The route of packets from `qp` to `dgid_ip` with the QP's path
    /// attributes, or of a UD send with its own address vector.
    pub(crate) fn route(&self, qp: &Qp, av: &hca_prm::av::Av, dest_qpn: Qpn) -> Option<Route> {
        let port = self.port_ref(qp.port)?;
        let src_ip = port
            .gids
            .get(usize::from(av.sgid_index))
            .and_then(|g| g.ipv4())
            .unwrap_or(port.ipv4());
        let dst_ip = Ipv4Addr::from(av.dest_ipv4()?);
        let pkey = PKey::new(*port.pkeys.get(usize::from(qp.attrs.pkey_index))?);
        let entropy = av.flow_label.get() ^ qp.wire_qpn().get() ^ dest_qpn.get();
        Some(Route {
            qp_index: qp.index,
            port: qp.port,
            src_mac: MacAddr::for_ipv4(Ipv4Addr::from(port.ipv4())),
            dst_mac: MacAddr::for_ip_destination(dst_ip),
            src_ip: Ipv4Addr::from(src_ip),
            dst_ip,
            tos: av.traffic_class,
            ttl: av.hop_limit,
            src_port: flow_source_port(entropy),
            pkey,
        })
    }

    /// Emits one packet onto the route's port.
    pub(crate) fn emit_packet(
        &mut self,
        route: &Route,
        bth: BthRepr,
        ext: ExtRepr,
        payload: &[u8],
    ) {
        let _ = self.emit_packet_with(route, bth, ext, payload.len(), |dev, out| {
            out.copy_from_slice(payload);
            dev.touch(2, payload.len());
            Ok::<(), ()>(())
        });
    }

    /// Emits one packet of `payload_len` bytes onto the route's port,
    /// built in place in a pooled frame buffer: `fill` writes the payload
    /// straight into the frame (no scratch buffer, no zero-fill of a
    /// reused buffer). A `fill` error sends nothing and is returned.
    /// With direct placement, a connected service's packet to a unicast
    /// peer goes in a direct message instead, its payload (inline data)
    /// carried there: no frame, no ICRC, nothing to parse.
    pub(crate) fn emit_packet_with<E>(
        &mut self,
        route: &Route,
        bth: BthRepr,
        ext: ExtRepr,
        payload_len: usize,
        fill: impl FnOnce(&mut Device, &mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let repr = route.repr(bth, ext, payload_len);
        let info = bth.opcode.info();
        if self.direct && route.is_unicast() && info.transport != WireTransport::Ud {
            let origin = if info.is_response() {
                Origin::Response
            } else {
                Origin::Request
            };
            let mut msg = self.open_message(route.qp_index, origin, route.port, route.dst_mac);
            let pushed = self.push_carried_packet(&mut msg, route.port, repr, fill);
            self.queue_message(route.port, msg);
            return pushed;
        }
        let mut frame = self.take_frame_buf();
        let len = repr.buffer_len();
        if frame.len() < len {
            // Only a new or smaller buffer is zero-filled (once).
            self.touch(1, (len - frame.len()).min(payload_len));
            frame.resize(len, 0);
        }
        frame.truncate(len);
        let Ok(body) = repr.emit_headers(&mut frame) else {
            self.recycle_frame(frame);
            return Ok(());
        };
        if let Err(e) = fill(self, &mut frame[body]) {
            self.recycle_frame(frame);
            return Err(e);
        }
        if self.seal_frame(&repr, &mut frame).is_err() {
            self.recycle_frame(frame);
            return Ok(());
        }
        self.queue_frame(route.port, frame);
        if let Some(port) = self.port_mut_ref(route.port) {
            port.counters.tx_packets += 1;
            port.counters.tx_bytes += payload_len as u64;
        }
        Ok(())
    }

    /// Zeroes the pad of a frame built in place and writes its ICRC.
    pub(crate) fn seal_frame(
        &mut self,
        repr: &PacketRepr,
        frame: &mut [u8],
    ) -> Result<(), crate::wire::WireError> {
        // The ICRC covers every payload byte.
        self.touch(1, repr.payload_len);
        repr.seal(frame)
    }

    /// Reads `bbs` basic blocks of the send ring from counter `bb` into
    /// `out`, across the ring's wrap: one read per contiguous run.
    fn read_sq(&mut self, qp: &Qp, bb: u32, bbs: u32, out: &mut [u8]) -> bool {
        let range = MttRange::of_ring(&qp.sq);
        let entries = qp.sq_entries();
        let mut ok = true;
        if let Some(hca) = self.hca.as_ref() {
            let (mut done, mut slot) = (0u32, bb & (entries - 1));
            while done < bbs {
                // Up to the ring's end, then from its start.
                let run = (bbs - done).min(entries - slot);
                let chunk = &mut out[done as usize * 64..(done + run) as usize * 64];
                if hca
                    .mtt
                    .read(self.mem.as_ref(), range, u64::from(slot) * 64, chunk)
                    .is_err()
                {
                    ok = false;
                    break;
                }
                done += run;
                slot = 0;
            }
        } else {
            ok = false;
        }
        if !ok {
            self.note_fault();
        }
        ok
    }

    /// [`Device::load_wqe`] through `window`: the posted blocks from `bb`
    /// on (up to [`SQ_WINDOW_BBS`]) are read in one go and the WQEs after
    /// it found there, so a doorbell's batch costs one ring read, not two
    /// per WQE. Posted blocks are the device's until they complete, so
    /// nothing changes them meanwhile; the window lives for one run of the
    /// send queue. A window that cannot be read (a fault past the WQE)
    /// falls back to reading the WQE alone, as before.
    fn fetch_wqe(
        &mut self,
        qp: &Qp,
        bb: u32,
        buf: &mut [u8; MAX_WQE_BYTES],
        window: &mut SqWindow,
    ) -> Option<u32> {
        let posted = qp.sq_producer.wrapping_sub(bb);
        let need = |first: &[u8]| (u32::from(first[2]) * 16).div_ceil(64).max(1);
        if !window.covers(bb, 1) || !window.covers(bb, need(window.block(bb))) {
            let blocks = posted.min(SQ_WINDOW_BBS);
            window.bytes.resize(SQ_WINDOW_BBS as usize * 64, 0);
            window.blocks = 0;
            let mut bytes = std::mem::take(&mut window.bytes);
            let read = self.read_sq_quiet(qp, bb, blocks, &mut bytes[..blocks as usize * 64]);
            window.bytes = bytes;
            if !read {
                return self.load_wqe(qp, bb, buf);
            }
            window.first = bb;
            window.blocks = blocks;
        }
        let bbs = need(window.block(bb));
        if bbs > posted || bbs as usize * 64 > MAX_WQE_BYTES {
            buf[..64].copy_from_slice(window.block(bb));
            return Some(bbs.min(posted.max(1)));
        }
        let at = bb.wrapping_sub(window.first) as usize * 64;
        buf[..bbs as usize * 64].copy_from_slice(&window.bytes[at..at + bbs as usize * 64]);
        Some(bbs)
    }

    /// [`Device::read_sq`] that counts no fault (a window read ahead).
    fn read_sq_quiet(&mut self, qp: &Qp, bb: u32, bbs: u32, out: &mut [u8]) -> bool {
        let faults = self.counters.dma_faults;
        let ok = self.read_sq(qp, bb, bbs, out);
        self.counters.dma_faults = faults;
        ok
    }

    /// Reads the WQE whose first block is at `bb` into `buf`; returns the
    /// number of blocks it occupies, or `None` if its blocks were not all
    /// posted or cannot be read.
    pub(crate) fn load_wqe(
        &mut self,
        qp: &Qp,
        bb: u32,
        buf: &mut [u8; MAX_WQE_BYTES],
    ) -> Option<u32> {
        if !self.read_sq(qp, bb, 1, &mut buf[..64]) {
            return None;
        }
        let size16 = u32::from(buf[2]);
        let bbs = (size16 * 16).div_ceil(64).max(1);
        let posted = qp.sq_producer.wrapping_sub(bb);
        if bbs > posted || bbs as usize * 64 > MAX_WQE_BYTES {
            return Some(bbs.min(posted.max(1)));
        }
        if bbs > 1
            && !self.read_sq(
                qp,
                bb.wrapping_add(1),
                bbs - 1,
                &mut buf[64..bbs as usize * 64],
            )
        {
            return None;
        }
        Some(bbs)
    }

    /// Fetches and starts send WQEs of QP `n` as far as its state, FENCE
    /// and the read/atomic limit allow, then retires what finished.
    pub(crate) fn run_send_queue(&mut self, n: u32) {
        self.with_qp(n, |dev, qp| dev.run_send_queue_of(qp));
    }

    pub(crate) fn run_send_queue_of(&mut self, qp: &mut Qp) {
        let mut window = SqWindow {
            bytes: std::mem::take(&mut self.sq_window),
            ..SqWindow::default()
        };
        self.run_send_queue_with(qp, &mut window);
        self.sq_window = window.bytes;
    }

    fn run_send_queue_with(&mut self, qp: &mut Qp, window: &mut SqWindow) {
        if qp.state == QpState::Err {
            self.flush_queues(qp);
            return;
        }
        let transport = transport_of(qp.qp_type);
        let mut buf = [0u8; MAX_WQE_BYTES];
        while qp.state == QpState::Rts && qp.req.rnr_until.is_none() && !self.is_fatal() {
            let bb = qp.req.fetch;
            if bb == qp.sq_producer {
                break;
            }
            let Some(bbs) = self.fetch_wqe(qp, bb, &mut buf, window) else {
                self.fail_unparsable(qp, bb, 1, WcStatus::LocQpOpErr);
                break;
            };
            let wqe = match SendWqe::parse(&buf[..bbs as usize * 64], bb as u16, transport) {
                Ok(wqe) => wqe,
                Err(_) => {
                    self.fail_unparsable(qp, bb, bbs, WcStatus::LocQpOpErr);
                    break;
                }
            };
            let opcode = wqe.op.opcode();
            let is_rd_atomic = matches!(
                opcode,
                WqeOpcode::RdmaRead | WqeOpcode::AtomicCs | WqeOpcode::AtomicFa
            );
            if wqe.flags.contains(WqeFlags::FENCE) && qp.req.rd_atomic > 0 {
                break;
            }
            // The initiator depth (IBA chapter 11, QP attributes): `max_rd_atomic`
            // reads and atomics outstanding at most, so with 0 none is ever
            // started and the WQE waits at the head of the queue (as rxe
            // and qib do) until an SQD -> SQD modify raises the limit, or
            // the QP's ERR flushes it.
            if is_rd_atomic && qp.req.rd_atomic >= u32::from(qp.attrs.max_rd_atomic) {
                break;
            }
            let signaled = wqe.flags.contains(WqeFlags::SIGNALED)
                || qp.flags.contains(hca_prm::ctx::QpcFlags::SQ_SIG_ALL);
            let len = payload_len(&wqe.payload);
            let mtu = qp.attrs.path_mtu.bytes();
            let npkts = match opcode {
                WqeOpcode::Nop | WqeOpcode::BindMw | WqeOpcode::LocalInv => 0,
                WqeOpcode::AtomicCs | WqeOpcode::AtomicFa => 1,
                _ if transport == Transport::Ud => 1,
                _ => len.div_ceil(mtu).max(1),
            };
            let mut record = SendRecord {
                bb_start: bb,
                wqe_index: wqe.wqe_index,
                opcode,
                signaled,
                len,
                first_psn: qp.req.psn,
                npkts,
                acked_pkts: 0,
                done: false,
                status: WcStatus::Success,
            };
            qp.req.fetch = bb.wrapping_add(bbs);
            // Local checks before anything goes on the wire.
            let early = self.check_local(qp, &wqe, len);
            if let Err(status) = early {
                record.done = true;
                record.status = status;
                record.npkts = 0;
                qp.req.inflight.push_back(record);
                self.fail_send_queue(qp);
                return;
            }
            match opcode {
                WqeOpcode::Nop => record.done = true,
                WqeOpcode::BindMw | WqeOpcode::LocalInv => {
                    record.status = self.execute_memory_op(qp, &wqe.op);
                    record.done = true;
                }
                _ => {}
            }
            // Every packet takes the next PSN of the send queue, UD's
            // included (IBA 9.8: the PSN advances by one per packet).
            qp.req.psn = qp.req.psn.wrapping_add(npkts);
            let failed = record.status != WcStatus::Success;
            qp.req.inflight.push_back(record);
            if failed {
                self.fail_send_queue(qp);
                return;
            }
            if npkts > 0 {
                if is_rd_atomic {
                    qp.req.rd_atomic += 1;
                }
                let index = qp.req.inflight.len() - 1;
                self.transmit_via(qp, index, &wqe, 0, &mut window.path);
                if transport != Transport::Rc {
                    // Unreliable services complete when the last packet is
                    // sent.
                    qp.req.inflight[index].done = true;
                }
            }
        }
        self.retire(qp);
    }

    /// Checks the local side of a WQE: every data segment's key, PD, range
    /// and right (PRM 7.1), the UD message size, and the UD address port.
    fn check_local(&mut self, qp: &Qp, wqe: &SendWqe<'_>, len: u32) -> Result<(), WcStatus> {
        let transport = transport_of(qp.qp_type);
        if transport == Transport::Ud {
            if len > self.packet_mtu(qp) {
                return Err(WcStatus::LocLenErr);
            }
            if let Some(ud) = &wqe.ud
                && (ud.av.port != qp.port || ud.av.dest_ipv4().is_none())
            {
                return Err(WcStatus::LocQpOpErr);
            }
        }
        if len > crate::device::DeviceConfig::MAX_MSG_SIZE {
            return Err(WcStatus::LocLenErr);
        }
        let need = match wqe.op.opcode() {
            WqeOpcode::RdmaRead | WqeOpcode::AtomicCs | WqeOpcode::AtomicFa => Need::LocalWrite,
            _ => Need::LocalRead,
        };
        if let Payload::Data(sges) = wqe.payload {
            let hca = self.hca.as_ref().ok_or(WcStatus::FatalErr)?;
            for sge in sges.iter().filter(|s| s.length.get() > 0) {
                check_key(
                    &hca.mpts,
                    sge.lkey.get(),
                    qp.pd,
                    qp.index,
                    sge.addr.get(),
                    u64::from(sge.length.get()),
                    need,
                )
                .map_err(key_status)?;
            }
        }
        Ok(())
    }

    fn port_mtu(&self, port: u8) -> u32 {
        self.port_ref(port).map_or(256, |p| p.cfg.max_mtu.bytes())
    }

    /// The largest payload of one of the QP's packets. A datagram QP has no
    /// path MTU (no UD transition sets the QPC field): its message is one
    /// packet of up to the port's MTU (PRM 11, IBA 9.8: a UD message is a
    /// single packet no longer than the PMTU).
    pub(crate) fn packet_mtu(&self, qp: &Qp) -> u32 {
        match transport_of(qp.qp_type) {
            Transport::Ud => self.port_mtu(qp.port),
            Transport::Rc | Transport::Uc => qp.attrs.path_mtu.bytes(),
        }
    }

    /// Copies message bytes `offset..offset + out.len()` of the WQE's
    /// payload into `out`.
    pub(crate) fn gather(
        &mut self,
        qp: &Qp,
        payload: &Payload<'_>,
        offset: u32,
        out: &mut [u8],
    ) -> Result<(), WcStatus> {
        match payload {
            Payload::Inline(data) => {
                let start = offset as usize;
                let src = data
                    .get(start..start + out.len())
                    .ok_or(WcStatus::LocLenErr)?;
                out.copy_from_slice(src);
                self.touch(2, out.len());
                Ok(())
            }
            Payload::Data(sges) => self.sge_copy(qp, sges, offset, Copy::Out(out)),
        }
    }

    /// Moves bytes between a scatter/gather list (at message offset
    /// `offset`) and `buf`, checking every key.
    pub(crate) fn sge_copy(
        &mut self,
        qp: &Qp,
        sges: &[ib_types::wr::Sge],
        offset: u32,
        mut buf: Copy<'_>,
    ) -> Result<(), WcStatus> {
        let total = buf.len();
        let mut skip = u64::from(offset);
        let mut done = 0usize;
        let hca = self.hca.as_ref().ok_or(WcStatus::FatalErr)?;
        for sge in sges {
            if done == total {
                break;
            }
            let sge_len = u64::from(sge.length.get());
            if skip >= sge_len {
                skip -= sge_len;
                continue;
            }
            let chunk = ((sge_len - skip) as usize).min(total - done);
            let va = sge.addr.get() + skip;
            let need = if matches!(buf, Copy::In(_)) {
                Need::LocalWrite
            } else {
                Need::LocalRead
            };
            let grant = check_key(
                &hca.mpts,
                sge.lkey.get(),
                qp.pd,
                qp.index,
                va,
                chunk as u64,
                need,
            )
            .map_err(key_status)?;
            let result = match &mut buf {
                Copy::Out(out) => hca.mtt.read(
                    self.mem.as_ref(),
                    grant.range,
                    grant.offset,
                    &mut out[done..done + chunk],
                ),
                Copy::In(data) => hca.mtt.place(
                    self.mem.as_ref(),
                    grant.range,
                    grant.offset,
                    data,
                    done,
                    chunk,
                ),
                Copy::Locate(_, pieces) => hca.mtt.locate(grant.range, grant.offset, chunk, pieces),
            };
            if !matches!(buf, Copy::Locate(..)) {
                // A copy reads and writes every byte.
                self.payload_passes = self.payload_passes.wrapping_add(2 * chunk as u64);
            }
            match result {
                Ok(()) => {}
                // The sender's memory, not ours (a race with its driver:
                // the payload was probed readable when it arrived).
                Err(XlateError::Source(fault)) => {
                    self.direct_source_fault_seen = Some(fault);
                    return Err(WcStatus::LocProtErr);
                }
                Err(_) => {
                    self.counters.dma_faults = self.counters.dma_faults.wrapping_add(1);
                    return Err(WcStatus::LocProtErr);
                }
            }
            done += chunk;
            skip = 0;
        }
        if done == total {
            Ok(())
        } else {
            Err(WcStatus::LocLenErr)
        }
    }

    /// Sends the packets of inflight record `index` from packet `from_pkt`
    /// on (for reads: the request for the responses from `from_pkt` on).
    pub(crate) fn transmit(&mut self, qp: &mut Qp, index: usize, wqe: &SendWqe<'_>, from_pkt: u32) {
        self.transmit_via(qp, index, wqe, from_pkt, &mut None);
    }

    /// [`Device::transmit`] with the connected QP's route in `path` once
    /// found (a run of its send queue finds it once for every WQE: the QP's
    /// path cannot change meanwhile).
    fn transmit_via(
        &mut self,
        qp: &mut Qp,
        index: usize,
        wqe: &SendWqe<'_>,
        from_pkt: u32,
        path: &mut Option<Route>,
    ) {
        let record = qp.req.inflight[index];
        let transport = transport_of(qp.qp_type);
        let (av, dest_qpn, qkey) = match (&wqe.ud, transport) {
            (Some(ud), Transport::Ud) => {
                // A controlled Q_Key in a WQE means "use the QP's" (PRM 10.2).
                let qkey = if ud.qkey.is_controlled() {
                    QKey::new(qp.attrs.qkey)
                } else {
                    ud.qkey
                };
                (ud.av, ud.dest_qpn, qkey)
            }
            _ => (qp.attrs.av, qp.attrs.dest_qpn, QKey::new(qp.attrs.qkey)),
        };
        let found = match (*path, wqe.ud.is_some()) {
            (Some(route), false) => Some(route),
            (_, datagram) => {
                let route = self.route(qp, &av, dest_qpn);
                if !datagram {
                    *path = route;
                }
                route
            }
        };
        let Some(route) = found else {
            self.finish_record(qp, index, WcStatus::LocQpOpErr);
            return;
        };
        let mtu = self.packet_mtu(qp);
        match wqe.op {
            WqeOp::RdmaRead { remote } => {
                let skip = from_pkt * mtu;
                let reth = RethRepr {
                    va: remote.addr + u64::from(skip),
                    rkey: remote.rkey,
                    dma_len: record.len - skip.min(record.len),
                };
                let bth = self.bth(
                    qp,
                    Opcode::RcRdmaReadRequest,
                    dest_qpn,
                    record.first_psn.wrapping_add(from_pkt),
                    &route,
                    false,
                    true,
                );
                self.emit_packet(&route, bth, ExtRepr::Reth(reth), &[]);
            }
            WqeOp::AtomicCs {
                remote,
                compare,
                swap,
            } => {
                let ext = ExtRepr::AtomicEth(AtomicEthRepr {
                    va: remote.addr,
                    rkey: remote.rkey,
                    swap_add: swap,
                    compare,
                });
                let bth = self.bth(
                    qp,
                    Opcode::RcCompareSwap,
                    dest_qpn,
                    record.first_psn,
                    &route,
                    false,
                    true,
                );
                self.emit_packet(&route, bth, ext, &[]);
            }
            WqeOp::AtomicFa { remote, add } => {
                let ext = ExtRepr::AtomicEth(AtomicEthRepr {
                    va: remote.addr,
                    rkey: remote.rkey,
                    swap_add: add,
                    compare: 0,
                });
                let bth = self.bth(
                    qp,
                    Opcode::RcFetchAdd,
                    dest_qpn,
                    record.first_psn,
                    &route,
                    false,
                    true,
                );
                self.emit_packet(&route, bth, ext, &[]);
            }
            op => {
                let solicited = wqe.flags.contains(WqeFlags::SOLICITED);
                // Direct placement: RC/UC data gathered from memory, to a
                // unicast peer, located, not copied (inline data is in the
                // WQE: `emit_packet_with` carries it in the message).
                let direct = self.direct
                    && transport != Transport::Ud
                    && matches!(wqe.payload, Payload::Data(_))
                    && route.is_unicast();
                let mut message = direct.then(|| {
                    self.open_message(qp.index, Origin::Request, route.port, route.dst_mac)
                });
                for pkt in from_pkt..record.npkts {
                    let pos = Pos::of(pkt, record.npkts);
                    let Some(opcode) = request_opcode(transport, record.opcode, pos) else {
                        break;
                    };
                    let start = pkt * mtu;
                    let chunk = (record.len - start.min(record.len)).min(mtu) as usize;
                    let ext = match (op, pos.starts(), pos.ends()) {
                        (WqeOp::RdmaWrite { remote }, true, _) => ExtRepr::Reth(RethRepr {
                            va: remote.addr,
                            rkey: remote.rkey,
                            dma_len: record.len,
                        }),
                        (WqeOp::RdmaWriteImm { remote, imm }, true, true) => ExtRepr::RethImmDt(
                            RethRepr {
                                va: remote.addr,
                                rkey: remote.rkey,
                                dma_len: record.len,
                            },
                            ImmDtRepr { imm },
                        ),
                        (WqeOp::RdmaWriteImm { remote, .. }, true, false) => {
                            ExtRepr::Reth(RethRepr {
                                va: remote.addr,
                                rkey: remote.rkey,
                                dma_len: record.len,
                            })
                        }
                        (WqeOp::RdmaWriteImm { imm, .. } | WqeOp::SendImm { imm }, _, true)
                            if transport != Transport::Ud =>
                        {
                            ExtRepr::ImmDt(ImmDtRepr { imm })
                        }
                        (WqeOp::SendInv { rkey }, _, true) => ExtRepr::Ieth(IethRepr { rkey }),
                        (WqeOp::Send, _, _) if transport == Transport::Ud => {
                            ExtRepr::Deth(DethRepr {
                                qkey,
                                src_qp: qp.wire_qpn(),
                            })
                        }
                        (WqeOp::SendImm { imm }, _, _) if transport == Transport::Ud => {
                            ExtRepr::DethImmDt(
                                DethRepr {
                                    qkey,
                                    src_qp: qp.wire_qpn(),
                                },
                                ImmDtRepr { imm },
                            )
                        }
                        _ => ExtRepr::None,
                    };
                    let ack_req = transport == Transport::Rc
                        && (pos.ends() || pkt % ACK_REQ_INTERVAL == ACK_REQ_INTERVAL - 1);
                    let psn = record.first_psn.wrapping_add(pkt);
                    let bth = self.bth(
                        qp,
                        opcode,
                        dest_qpn,
                        psn,
                        &route,
                        solicited && pos.ends(),
                        ack_req,
                    );
                    let sent = match message.as_mut() {
                        Some(msg) => {
                            let located = match &wqe.payload {
                                Payload::Data(sges) => self.sge_copy(
                                    qp,
                                    sges,
                                    start,
                                    Copy::Locate(chunk, &mut msg.pieces),
                                ),
                                Payload::Inline(_) => Err(WcStatus::LocQpOpErr),
                            };
                            located.map(|()| {
                                self.push_packet(msg, route.port, route.repr(bth, ext, chunk));
                            })
                        }
                        None => self.emit_packet_with(&route, bth, ext, chunk, |dev, out| {
                            dev.gather(qp, &wqe.payload, start, out)
                        }),
                    };
                    if let Err(status) = sent {
                        if let Some(msg) = message.take() {
                            self.queue_message(route.port, msg);
                        }
                        self.finish_record(qp, index, status);
                        return;
                    }
                }
                if let Some(msg) = message {
                    self.queue_message(route.port, msg);
                }
            }
        }
        if transport == Transport::Rc && qp.req.ack_deadline.is_none() {
            self.start_ack_timer_on_send(qp);
        }
    }

    #[allow(clippy::too_many_arguments, reason = "one BTH has this many fields")]
    fn bth(
        &self,
        _qp: &Qp,
        opcode: Opcode,
        dest_qp: Qpn,
        psn: Psn,
        route: &Route,
        solicited: bool,
        ack_req: bool,
    ) -> BthRepr {
        BthRepr {
            opcode,
            solicited,
            mig_req: false,
            pkey: route.pkey,
            fecn: false,
            becn: false,
            dest_qp,
            ack_req,
            psn,
        }
    }

    /// Marks inflight record `index` finished with `status`; an error fails
    /// the send queue.
    pub(crate) fn finish_record(&mut self, qp: &mut Qp, index: usize, status: WcStatus) {
        if let Some(r) = qp.req.inflight.get_mut(index)
            && !r.done
        {
            r.done = true;
            r.status = status;
        }
        if status != WcStatus::Success {
            self.fail_send_queue(qp);
        }
    }

    /// A WQE that cannot even be parsed completes with `status` (its index
    /// is whatever the slot says) and fails the queue.
    fn fail_unparsable(&mut self, qp: &mut Qp, bb: u32, bbs: u32, status: WcStatus) {
        qp.req.fetch = bb.wrapping_add(bbs);
        qp.req.inflight.push_back(SendRecord {
            bb_start: bb,
            wqe_index: bb as u16,
            opcode: WqeOpcode::Nop,
            signaled: true,
            len: 0,
            first_psn: qp.req.psn,
            npkts: 0,
            acked_pkts: 0,
            done: true,
            status,
        });
        self.fail_send_queue(qp);
    }

    /// Executes BIND_MW and LOCAL_INV against the MPT (PRM 7.1).
    fn execute_memory_op(&mut self, qp: &Qp, op: &WqeOp) -> WcStatus {
        let Some(hca) = self.hca.as_mut() else {
            return WcStatus::FatalErr;
        };
        match *op {
            WqeOp::LocalInv { key } => {
                crate::device::mw::invalidate(&mut hca.mpts, key.get(), qp.pd, false)
                    .map_or(WcStatus::MwBindErr, |_| WcStatus::Success)
            }
            WqeOp::BindMw(bind) => {
                match crate::device::mw::bind(&mut hca.mpts, &bind, qp.pd, qp.index) {
                    Ok(()) => WcStatus::Success,
                    Err(_) => WcStatus::MwBindErr,
                }
            }
            _ => WcStatus::Success,
        }
    }
}

/// A copy direction for [`Device::sge_copy`].
pub(crate) enum Copy<'a> {
    /// From the SGEs into this buffer (gather).
    Out(&'a mut [u8]),
    /// From this payload into the SGEs (scatter).
    In(RxData<'a>),
    /// No copy: this many bytes of the SGEs, checked as a gather, are
    /// appended to the list as (bus address, length) pieces, for direct
    /// placement to read later.
    Locate(usize, &'a mut Vec<(u64, usize)>),
}

impl Copy<'_> {
    fn len(&self) -> usize {
        match self {
            Self::Out(b) => b.len(),
            Self::In(data) => data.len(),
            Self::Locate(len, _) => *len,
        }
    }
}

/// Message bytes of a payload.
pub(crate) fn payload_len(payload: &Payload<'_>) -> u32 {
    match payload {
        Payload::Inline(data) => data.len() as u32,
        Payload::Data(sges) => sges
            .iter()
            .map(|s| s.length.get())
            .fold(0u32, u32::saturating_add),
    }
}
