//! The responder: frames arriving from the fabric, checked in the order of
//! IBA 9.6 and handed to the RC, UC or UD receive logic, or to the
//! completer for responses.

use hca_prm::cqe::{Cqe, CqeFlags, RecvOp};
use hca_prm::eqe::Event;
use hca_prm::wqe::RecvWqe;
use ib_types::access::AccessFlags;
use ib_types::qp::{QpState, QpType};
use ib_types::scalars::{PKey, PortNum, Psn, Qpn};
use ib_types::wc::WcStatus;
use ib_types::wr::{Sge, Transport};

use super::Rx;
use super::direct::Origin;
use super::send::{Copy, Route, transport_of};
use super::{MAX_SGES, RecvState, ResourceKind, RespResource, RxData, WriteState};
use crate::device::Device;
use crate::device::dma::{MttRange, Need, XlateError, check_key};
use crate::device::qp::{Qp, special_index};
use crate::wire::bth::BthRepr;
use crate::wire::ext::{
    AethRepr, AtomicAckEthRepr, CreditCode, ExtRepr, Msn, NakCode, RnrTimer, Syndrome,
};
use crate::wire::opcode::{OpKind, Opcode, Position};
use crate::wire::packet::{ETH_LEN, PacketRepr, RocePacket};

/// Bytes of the GRH a UD receive buffer starts with (PRM 10.4).
const GRH_LEN: usize = 40;

/// The wire QPN that addresses every member of a multicast group.
const MULTICAST_QPN: u32 = 0xFF_FFFF;

/// A responder-side error: the NAK to send and the receive completion.
#[derive(Debug, Clone, Copy)]
struct RespError {
    nak: NakCode,
    status: WcStatus,
}

impl RespError {
    const fn invalid_request() -> Self {
        Self {
            nak: NakCode::InvalidRequest,
            status: WcStatus::RemInvReqErr,
        }
    }

    const fn remote_access() -> Self {
        Self {
            nak: NakCode::RemoteAccessError,
            status: WcStatus::RemAccessErr,
        }
    }

    const fn local(status: WcStatus) -> Self {
        Self {
            nak: NakCode::RemoteOperationalError,
            status,
        }
    }
}

/// A receive WQE that could not be used (see `take_recv_wqe`).
#[derive(Debug, Clone, Copy)]
struct RecvFault {
    status: WcStatus,
    /// The WQE, if it was consumed (with no scatter entries); it must
    /// complete with `status`.
    consumed: Option<RecvState>,
}

impl Device {
    /// Takes one frame from the fabric on `port` (1-based).
    pub fn receive(&mut self, port: u8, frame: &[u8]) {
        if self.is_fatal() {
            return;
        }
        let pkt = match RocePacket::parse(frame) {
            Ok(pkt) => pkt,
            Err(_) => {
                if let Some(p) = self.port_mut_ref(port) {
                    p.counters.rx_errors += 1;
                }
                return;
            }
        };
        // The ICRC check of `parse` passed over every payload byte.
        self.touch(1, pkt.payload().len());
        self.receive_packet(
            port,
            frame,
            &Rx {
                repr: pkt.repr(),
                payload: RxData::Bytes(pkt.payload()),
            },
        );
    }

    /// A packet that passed the wire checks (or was placed directly, with
    /// an empty `frame`): routing to its QP(s) and the port counters.
    pub(crate) fn receive_packet(&mut self, port: u8, frame: &[u8], pkt: &Rx<'_>) {
        let accepted = self.accept(port, frame, pkt);
        self.count_received(port, accepted, pkt);
    }

    /// A directly placed packet for `qp`, which
    /// [`Device::unicast_destination`] found for it (or for an earlier
    /// packet of its message with the same destination): what
    /// [`Device::receive_packet`] does, without finding the QP again.
    pub(crate) fn receive_on_qp(&mut self, port: u8, qp: &mut Qp, pkt: &Rx<'_>) {
        let accepted = self.qp_receive(qp, port, &[], pkt);
        self.count_received(port, accepted, pkt);
    }

    fn count_received(&mut self, port: u8, accepted: bool, pkt: &Rx<'_>) {
        if let Some(p) = self.port_mut_ref(port) {
            if accepted {
                p.counters.rx_packets += 1;
                p.counters.rx_bytes += pkt.payload().len() as u64;
            } else {
                p.counters.rx_discards += 1;
            }
        }
    }

    /// The QP (table index) a unicast packet arriving on `port` is for:
    /// the port is active, the destination address is one of its GIDs and
    /// the destination QP exists. `None` for a group destination or when
    /// the packet would be discarded.
    pub(crate) fn unicast_destination(&self, port: u8, repr: &PacketRepr) -> Option<u32> {
        let p = self.port_ref(port)?;
        if !p.is_active() || self.hca.is_none() {
            return None;
        }
        let dest_qp = repr.bth.dest_qp.get();
        if dest_qp == MULTICAST_QPN {
            return None;
        }
        p.gid_index(ib_types::scalars::Gid::from_ipv4(repr.dst_ip.octets()))?;
        let index = match dest_qp {
            0 => special_index(port, QpType::Smi),
            1 => special_index(port, QpType::Gsi),
            n if n < 2 * u32::from(self.num_ports()) => None,
            n => Some(n),
        }?;
        self.qp_ref(index).is_some().then_some(index)
    }

    /// Routes a valid packet to its QP(s); false when it is discarded.
    fn accept(&mut self, port: u8, frame: &[u8], pkt: &Rx<'_>) -> bool {
        let Some(p) = self.port_ref(port) else {
            return false;
        };
        if !p.is_active() || self.hca.is_none() {
            return false;
        }
        let repr = pkt.repr();
        let dst = repr.dst_ip.octets();
        let dest_qp = repr.bth.dest_qp.get();
        if dest_qp == MULTICAST_QPN {
            let gid = ib_types::scalars::Gid::from_ipv4(dst);
            let members: Vec<u32> = self
                .hca
                .as_ref()
                .and_then(|h| h.mcgs.get(&gid))
                .cloned()
                .unwrap_or_default();
            // PRM 11: the P_Key is checked on every packet, multicast
            // included (IBA 9.6.1.1); members whose P_Key does not match
            // do not receive, and a packet no member accepts for that
            // reason is one violation.
            let key = repr.bth.pkey;
            let mut any = false;
            let mut key_refused = false;
            for qpn in members {
                any |= self
                    .with_qp(qpn, |dev, qp| {
                        if qp.port != port {
                            return false;
                        }
                        if !dev.pkey_matches(qp, key) {
                            key_refused = true;
                            return false;
                        }
                        dev.ud_receive(qp, frame, pkt)
                    })
                    .unwrap_or(false);
            }
            if !any && key_refused {
                self.pkey_violation(port);
            }
            return any;
        }
        if p.gid_index(ib_types::scalars::Gid::from_ipv4(dst))
            .is_none()
        {
            return false;
        }
        let index = match dest_qp {
            0 => special_index(port, QpType::Smi),
            1 => special_index(port, QpType::Gsi),
            n if n < 2 * u32::from(self.num_ports()) => None,
            n => Some(n),
        };
        let Some(index) = index else {
            return false;
        };
        self.with_qp(index, |dev, qp| dev.qp_receive(qp, port, frame, pkt))
            .unwrap_or(false)
    }

    /// Per-QP checks, then the transport's receive logic.
    pub(crate) fn qp_receive(&mut self, qp: &mut Qp, port: u8, frame: &[u8], pkt: &Rx<'_>) -> bool {
        let info = pkt.repr().bth.opcode.info();
        if qp.port != port || !info.transport.serves(qp.qp_type) {
            return false;
        }
        if !matches!(
            qp.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        ) {
            return false;
        }
        if !self.pkey_matches(qp, pkt.repr().bth.pkey) {
            self.pkey_violation(qp.port);
            return false;
        }
        if qp.state == QpState::Rtr && qp.qp_type.is_connected() && !qp.resp.comm_est {
            // PRM 8.2 COMM_EST, IBA 11.6.3.1 "Communication Established":
            // a connected QP in RTR received its first packet.
            qp.resp.comm_est = true;
            self.post_qp_event(|qpn| Event::CommEst { qpn }, qp.index);
        }
        match transport_of(qp.qp_type) {
            Transport::Ud => self.ud_receive(qp, frame, pkt),
            Transport::Rc if info.is_response() => {
                self.on_response(qp, pkt);
                true
            }
            Transport::Rc => {
                self.rc_request(qp, pkt);
                true
            }
            Transport::Uc => {
                self.uc_request(qp, pkt);
                true
            }
        }
    }

    /// The P_Key check of IBA 9.6.1.1: the packet's key must match the
    /// QP's (any table entry for GSI). A mismatch is a
    /// [`Device::pkey_violation`].
    fn pkey_matches(&self, qp: &Qp, key: PKey) -> bool {
        let Some(port) = self.port_ref(qp.port) else {
            return false;
        };
        if qp.qp_type == QpType::Gsi {
            port.pkeys.iter().any(|&k| PKey::new(k).matches(key))
        } else {
            port.pkeys
                .get(usize::from(qp.attrs.pkey_index))
                .is_some_and(|&k| PKey::new(k).matches(key))
        }
    }

    /// Counts and traps a P_Key mismatch on `port_no`.
    fn pkey_violation(&mut self, port_no: u8) {
        if let Some(p) = self.port_mut_ref(port_no) {
            p.pkey_violations = p.pkey_violations.saturating_add(1);
        }
        if let Ok(port) = PortNum::new(port_no) {
            self.post_event(Event::PkeyViolation { port });
        }
    }

    /// Takes the next receive WQE from the QP's RQ or SRQ (PRM 10.3).
    /// `Ok(None)` when none is posted; `Err` when the WQE cannot be used,
    /// carrying the WQE (with no scatter entries) if it was consumed, so
    /// that it completes in error.
    fn take_recv_wqe(&mut self, qp: &mut Qp) -> Result<Option<RecvState>, Box<RecvFault>> {
        let fault = |status| {
            Box::new(RecvFault {
                status,
                consumed: None,
            })
        };
        let (ring, dbr, counter, from_srq) = match qp.srqn {
            Some(s) => {
                let Some(srq) = self
                    .hca
                    .as_ref()
                    .and_then(|h| h.srqs.get(s as usize))
                    .and_then(Option::as_ref)
                else {
                    return Err(fault(WcStatus::LocQpOpErr));
                };
                (srq.ring, srq.dbr, srq.consumer, true)
            }
            None => (qp.rq, qp.rq_dbr, qp.rq_consumer, false),
        };
        let Some(producer) = self.read_dbr(dbr) else {
            return Err(fault(WcStatus::LocQpOpErr));
        };
        let posted = producer.wrapping_sub(counter);
        if posted == 0 || posted > 1 << ring.log_entries {
            return Ok(None);
        }
        let stride = 1usize << ring.log_stride;
        let at = u64::from(counter & ((1 << ring.log_entries) - 1)) * stride as u64;
        let mut buf = [0u8; 16 + 16 * MAX_SGES];
        let len = stride.min(buf.len());
        let read = self.hca.as_ref().is_some_and(|h| {
            h.mtt
                .read(
                    self.mem.as_ref(),
                    MttRange::of_ring(&ring),
                    at,
                    &mut buf[..len],
                )
                .is_ok()
        });
        if !read {
            self.note_fault();
            return Err(fault(WcStatus::LocQpOpErr));
        }
        // Consumed whatever it holds: a garbage WQE completes in error.
        if let Some(s) = qp.srqn {
            self.srq_consumed(s, producer);
        } else {
            qp.rq_consumer = counter.wrapping_add(1);
        }
        let mut state = RecvState {
            wqe_index: counter as u16,
            from_srq,
            sges: [Sge::default(); MAX_SGES],
            num_sges: 0,
            offset: 0,
        };
        let Ok(wqe) = RecvWqe::parse(&buf[..len], counter as u16) else {
            // PRM 10.5: a WQE that fails gets its error CQE (IBA: a
            // malformed receive WQE is retired in error, class A).
            return Err(Box::new(RecvFault {
                status: WcStatus::LocQpOpErr,
                consumed: Some(state),
            }));
        };
        state.wqe_index = wqe.wqe_index;
        for sge in wqe
            .sges
            .iter()
            .filter(|s| s.length.get() > 0)
            .take(MAX_SGES)
        {
            state.sges[state.num_sges] = *sge;
            state.num_sges += 1;
        }
        Ok(Some(state))
    }

    /// Advances an SRQ's consumer and fires its limit event once (PRM 6.4).
    fn srq_consumed(&mut self, srqn: u32, producer: u32) {
        let Some(srq) = self
            .hca
            .as_mut()
            .and_then(|h| h.srqs.get_mut(srqn as usize))
            .and_then(Option::as_mut)
        else {
            return;
        };
        srq.consumer = srq.consumer.wrapping_add(1);
        let left = producer.wrapping_sub(srq.consumer);
        if srq.limit > 0 && left < srq.limit {
            srq.limit = 0;
            self.post_event(Event::SrqLimit { srqn });
        }
    }

    /// Places `data` at the receive's current offset.
    fn place(&mut self, qp: &Qp, recv: &mut RecvState, data: RxData<'_>) -> Result<(), WcStatus> {
        let room: u64 = recv.sges[..recv.num_sges]
            .iter()
            .map(|s| u64::from(s.length.get()))
            .sum();
        if u64::from(recv.offset) + data.len() as u64 > room {
            return Err(WcStatus::LocLenErr);
        }
        let sges = recv.sges;
        self.sge_copy(qp, &sges[..recv.num_sges], recv.offset, Copy::In(data))?;
        recv.offset += data.len() as u32;
        Ok(())
    }

    /// Writes a receive completion.
    fn complete_recv(
        &mut self,
        qp: &mut Qp,
        recv: &RecvState,
        op: RecvOp,
        status: WcStatus,
        details: CqeFlags,
    ) {
        let mut details = details;
        if recv.from_srq {
            details |= CqeFlags::SRQ;
        }
        let cqe = Cqe::new_recv(
            Qpn::from_low_bits(qp.index),
            recv.wqe_index,
            op,
            status,
            recv.offset,
        )
        .with_details(details);
        if self.post_cqe(qp.recv_cqn, cqe).is_err() {
            self.cq_write_failed(qp);
        }
    }

    // ----- UD --------------------------------------------------------------

    /// A UD (or SMI/GSI) receive: Q_Key check, a receive WQE, the GRH and
    /// the payload (IBA 9.6.2, PRM 10.4).
    fn ud_receive(&mut self, qp: &mut Qp, frame: &[u8], pkt: &Rx<'_>) -> bool {
        if !matches!(
            qp.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        ) {
            return false;
        }
        let repr = pkt.repr();
        let (deth, imm) = match repr.ext {
            ExtRepr::Deth(d) => (d, None),
            ExtRepr::DethImmDt(d, i) => (d, Some(i.imm)),
            _ => return false,
        };
        // Direct placement carries no frame, and no datagram opcode: an
        // empty `frame` never gets here.
        let Some(ip_header) = frame.get(ETH_LEN..ETH_LEN + 20) else {
            return false;
        };
        if deth.qkey.get() != qp.attrs.qkey {
            let port_no = qp.port;
            if let Some(p) = self.port_mut_ref(port_no) {
                p.qkey_violations = p.qkey_violations.saturating_add(1);
            }
            if let Ok(port) = PortNum::new(port_no) {
                self.post_event(Event::QkeyViolation { port });
            }
            return false;
        }
        let mut recv = match self.take_recv_wqe(qp) {
            Ok(Some(recv)) => recv,
            Ok(None) => return false,
            Err(fault) => {
                if let Some(recv) = fault.consumed {
                    self.complete_recv(qp, &recv, RecvOp::Send, fault.status, CqeFlags::empty());
                }
                self.move_to_error(qp);
                return true;
            }
        };
        // RoCEv2 GRH: 20 bytes of zeros, then the IPv4 header.
        let mut grh = [0u8; GRH_LEN];
        grh[20..].copy_from_slice(ip_header);
        let placed = self
            .place(qp, &mut recv, RxData::Bytes(&grh))
            .and_then(|()| self.place(qp, &mut recv, pkt.payload()));
        let op = imm.map_or(RecvOp::Send, RecvOp::SendImm);
        let pkey_index = self
            .port_ref(qp.port)
            .and_then(|p| {
                p.pkeys
                    .iter()
                    .position(|&k| PKey::new(k).matches(repr.bth.pkey))
            })
            .unwrap_or(0) as u16;
        let mut details = CqeFlags::GRH;
        if repr.bth.solicited {
            details |= CqeFlags::SOLICITED;
        }
        let status = placed.err().unwrap_or(WcStatus::Success);
        let cqe = Cqe::new_recv(
            Qpn::from_low_bits(qp.index),
            recv.wqe_index,
            op,
            status,
            recv.offset,
        )
        .with_source(deth.src_qp, pkey_index, 0, qp.attrs.av.sl)
        .with_details(if recv.from_srq {
            details | CqeFlags::SRQ
        } else {
            details
        });
        if self.post_cqe(qp.recv_cqn, cqe).is_err() {
            self.cq_write_failed(qp);
        } else if status != WcStatus::Success {
            self.move_to_error(qp);
        }
        true
    }

    // ----- UC --------------------------------------------------------------

    /// A UC request: in-order delivery without acknowledgement; a PSN gap
    /// drops the message in progress and waits for the next FIRST/ONLY.
    fn uc_request(&mut self, qp: &mut Qp, pkt: &Rx<'_>) {
        if !matches!(
            qp.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        ) {
            return;
        }
        let repr = pkt.repr();
        let info = repr.bth.opcode.info();
        let psn = repr.bth.psn;
        if psn != qp.resp.expected_psn {
            // Lost packets: abandon the message; its receive WQE is reused.
            if let Some(recv) = qp.resp.recv.as_mut() {
                recv.offset = 0;
            }
            qp.resp.write = None;
            qp.resp.uc_resync = true;
        }
        qp.resp.expected_psn = psn.next();
        if qp.resp.uc_resync {
            if !matches!(info.position, Position::First | Position::Only) {
                return;
            }
            qp.resp.uc_resync = false;
        }
        match self.execute_request(qp, pkt, false) {
            Ok(None) => {}
            Ok(Some(_)) => {
                // UC has no RNR NAK: a message that finds no receive WQE
                // is silently dropped (IBA 9.9.3, UC responder errors), with
                // whatever write state it left, and the responder resumes
                // at the next FIRST or ONLY.
                qp.resp.write = None;
                qp.resp.uc_resync = true;
            }
            Err(e) => {
                // UC has no NAKs: a failed message is dropped; a failed
                // receive buffer completes in error and the QP fails.
                if e.nak == NakCode::RemoteOperationalError || e.status == WcStatus::LocLenErr {
                    self.fail_recv(qp, e.status);
                }
                qp.resp.write = None;
                qp.resp.uc_resync = true;
            }
        }
    }

    // ----- RC --------------------------------------------------------------

    /// An RC request: PSN check, duplicate handling, execution and the
    /// acknowledgement (IBA 9.7.5).
    fn rc_request(&mut self, qp: &mut Qp, pkt: &Rx<'_>) {
        if !matches!(qp.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            return;
        }
        let repr = pkt.repr();
        let psn = repr.bth.psn;
        let expected = qp.resp.expected_psn;
        if psn != expected {
            if psn.precedes(expected) {
                self.rc_duplicate(qp, pkt);
            } else if !qp.resp.nak_sent {
                qp.resp.nak_sent = true;
                self.send_ack(qp, expected, Syndrome::Nak(NakCode::PsnSequenceError));
            }
            return;
        }
        qp.resp.nak_sent = false;
        let info = repr.bth.opcode.info();
        match self.execute_request(qp, pkt, true) {
            Ok(_) if qp.state == QpState::Err => {
                // The request was carried out but its receive completion
                // could not be written (`cq_write_failed`: CQ overflow), so
                // its execution failed after all. No ACK may follow it:
                // the requester would report success for a message this
                // side's software never learned of. The QP is in ERR and
                // answers nothing more (a QP in the Error state sends no
                // responses; rxe likewise); the
                // requester times out and completes with RETRY_EXC_ERR.
            }
            Ok(Some(rnr)) => {
                let timer = RnrTimer::new(rnr).unwrap_or(RnrTimer::MAX);
                self.send_ack(qp, psn, Syndrome::RnrNak { timer });
                // An RNR NAK is a NAK, and after a NAK the responder
                // returns no other until a request with the expected PSN
                // arrives (IBA 9.7.5): the rest of the message must not
                // draw a PSN sequence NAK, which would make the requester
                // retry before the RNR timer and spend its RNR retries.
                qp.resp.nak_sent = true;
            }
            Ok(None) => {
                // Reads and atomics answered already, and advanced the PSN.
                if matches!(info.kind, OpKind::Send | OpKind::RdmaWrite) {
                    qp.resp.expected_psn = psn.next();
                    if repr.bth.ack_req {
                        self.send_ack(
                            qp,
                            psn,
                            Syndrome::Ack {
                                credits: CreditCode::NONE,
                            },
                        );
                    }
                }
            }
            Err(e) => self.request_failed(qp, psn, e),
        }
    }

    /// A request that failed at the responder: the NAK, the error's report
    /// and the QP's move to ERR (IBA 9.7.5.2.x).
    fn request_failed(&mut self, qp: &mut Qp, psn: Psn, e: RespError) {
        self.send_ack(qp, psn, Syndrome::Nak(e.nak));
        if qp.resp.recv.is_none() {
            // No receive WQE carries this error to software: the
            // responder reports it with an affiliated asynchronous
            // error instead (IBA 11.6.3.1: Local Access Violation /
            // Invalid Request Local WQ Error for a request that used
            // no receive WQE), or its owner never learns the QP
            // went to ERR.
            let qpn = Qpn::from_low_bits(qp.index);
            self.post_event(match e.nak {
                NakCode::RemoteAccessError => Event::WqAccessError { qpn },
                NakCode::InvalidRequest => Event::WqInvalidRequest { qpn },
                _ => Event::QpFatal { qpn },
            });
        }
        self.fail_recv(qp, e.status);
    }

    /// Reading the responses of the read request at `request_psn` from
    /// this device's memory failed (direct placement found it late; the
    /// wire path while sending them): the request fails.
    pub(crate) fn read_source_failed(&mut self, qp: &mut Qp, request_psn: Psn) {
        self.request_failed(qp, request_psn, RespError::remote_access());
    }

    /// Completes the receive in progress (if any) with `status` and moves
    /// the QP to ERR.
    fn fail_recv(&mut self, qp: &mut Qp, status: WcStatus) {
        if let Some(recv) = qp.resp.recv.take() {
            self.complete_recv(qp, &recv, RecvOp::Send, status, CqeFlags::empty());
        }
        self.move_to_error(qp);
    }

    /// Executes one in-sequence request packet (RC or UC). `Ok(Some(t))`
    /// asks for an RNR NAK with timer `t`.
    fn execute_request(
        &mut self,
        qp: &mut Qp,
        pkt: &Rx<'_>,
        reliable: bool,
    ) -> Result<Option<u8>, RespError> {
        let repr = pkt.repr();
        let info = repr.bth.opcode.info();
        let pos = info.position;
        let starts = matches!(pos, Position::First | Position::Only);
        let ends = matches!(pos, Position::Last | Position::Only);
        let mtu = qp.attrs.path_mtu.bytes() as usize;
        let payload = pkt.payload();
        // Opcode sequence (IBA 9.7.5.1.4 / C9-84): a message starts only
        // when none is in progress, and continues only one of its kind.
        let in_send =
            qp.resp.recv.is_some_and(|r| r.offset > 0 || !starts) && qp.resp.write.is_none();
        let in_write = qp.resp.write.is_some();
        match info.kind {
            OpKind::Send if starts && (in_write || qp.resp.recv.is_some_and(|r| r.offset > 0)) => {
                return Err(RespError::invalid_request());
            }
            OpKind::Send if !starts && !in_send => return Err(RespError::invalid_request()),
            OpKind::RdmaWrite
                if starts && (in_write || qp.resp.recv.is_some_and(|r| r.offset > 0)) =>
            {
                return Err(RespError::invalid_request());
            }
            OpKind::RdmaWrite if !starts && !in_write => return Err(RespError::invalid_request()),
            OpKind::RdmaReadRequest | OpKind::CompareSwap | OpKind::FetchAdd
                if in_write || qp.resp.recv.is_some_and(|r| r.offset > 0) =>
            {
                return Err(RespError::invalid_request());
            }
            _ => {}
        }
        // Packet sizes: FIRST and MIDDLE carry exactly one MTU; LAST and
        // ONLY at most one (IBA C9-88).
        let size_ok = match pos {
            Position::First | Position::Middle => payload.len() == mtu,
            Position::Last | Position::Only => payload.len() <= mtu,
        };
        if !size_ok && matches!(info.kind, OpKind::Send | OpKind::RdmaWrite) {
            return Err(RespError::invalid_request());
        }
        match info.kind {
            OpKind::Send => self.rx_send(qp, pkt, starts, ends),
            OpKind::RdmaWrite => self.rx_write(qp, pkt, starts, ends),
            OpKind::RdmaReadRequest if reliable => self.rx_read(qp, pkt).map(|()| None),
            OpKind::CompareSwap | OpKind::FetchAdd if reliable => {
                self.rx_atomic(qp, pkt).map(|()| None)
            }
            _ => Err(RespError::invalid_request()),
        }
    }

    fn rx_send(
        &mut self,
        qp: &mut Qp,
        pkt: &Rx<'_>,
        starts: bool,
        ends: bool,
    ) -> Result<Option<u8>, RespError> {
        let repr = pkt.repr();
        if starts && qp.resp.recv.is_none() {
            match self.take_recv_wqe(qp) {
                Ok(Some(recv)) => qp.resp.recv = Some(recv),
                Ok(None) => return Ok(Some(qp.attrs.min_rnr_timer)),
                Err(fault) => {
                    // Where `fail_recv` completes it in error.
                    qp.resp.recv = fault.consumed;
                    return Err(RespError::local(fault.status));
                }
            }
        }
        let Some(mut recv) = qp.resp.recv else {
            return Err(RespError::invalid_request());
        };
        if let Err(status) = self.place(qp, &mut recv, pkt.payload()) {
            qp.resp.recv = Some(recv);
            return Err(if status == WcStatus::LocLenErr {
                RespError {
                    nak: NakCode::InvalidRequest,
                    status,
                }
            } else {
                RespError::local(status)
            });
        }
        qp.resp.recv = Some(recv);
        if !ends {
            return Ok(None);
        }
        let (op, invalidate) = match repr.ext {
            ExtRepr::ImmDt(i) => (RecvOp::SendImm(i.imm), None),
            ExtRepr::Ieth(i) => (RecvOp::SendInv(i.rkey), Some(i.rkey)),
            _ => (RecvOp::Send, None),
        };
        if let Some(rkey) = invalidate {
            let ok = self.hca.as_mut().is_some_and(|h| {
                crate::device::mw::invalidate(&mut h.mpts, rkey.get(), qp.pd, true).is_ok()
            });
            if !ok {
                return Err(RespError {
                    nak: NakCode::RemoteOperationalError,
                    status: WcStatus::RemOpErr,
                });
            }
        }
        let details = if repr.bth.solicited {
            CqeFlags::SOLICITED
        } else {
            CqeFlags::empty()
        };
        qp.resp.recv = None;
        qp.resp.msn = qp.resp.msn.wrapping_add(1);
        self.complete_recv(qp, &recv, op, WcStatus::Success, details);
        Ok(None)
    }

    fn rx_write(
        &mut self,
        qp: &mut Qp,
        pkt: &Rx<'_>,
        starts: bool,
        ends: bool,
    ) -> Result<Option<u8>, RespError> {
        let repr = pkt.repr();
        let payload = pkt.payload();
        let imm = match repr.ext {
            ExtRepr::ImmDt(i) | ExtRepr::RethImmDt(_, i) => Some(i.imm),
            _ => None,
        };
        if ends && imm.is_some() && qp.resp.recv.is_none() {
            // WRITE WITH IMMEDIATE consumes a receive WQE (IBA 9.4.4). The
            // responder checks for it before executing the packet (IBA
            // 9.7.5 order, as rxe: resources before the R_Key and before
            // any data is placed), so an RNR NAK leaves the write as it
            // was and the retried packet finds the same state. The WQE
            // waits in `recv`, where an error completes it.
            match self.take_recv_wqe(qp) {
                Ok(Some(recv)) => qp.resp.recv = Some(recv),
                Ok(None) => return Ok(Some(qp.attrs.min_rnr_timer)),
                Err(fault) => {
                    // Where `fail_recv` completes it in error.
                    qp.resp.recv = fault.consumed;
                    return Err(RespError::local(fault.status));
                }
            }
        }
        let mut whole = None;
        if starts {
            let reth = match repr.ext {
                ExtRepr::Reth(r) | ExtRepr::RethImmDt(r, _) => r,
                _ => return Err(RespError::invalid_request()),
            };
            if !qp.attrs.access.contains(AccessFlags::REMOTE_WRITE) {
                return Err(RespError::invalid_request());
            }
            if reth.dma_len > crate::device::DeviceConfig::MAX_MSG_SIZE {
                return Err(RespError::invalid_request());
            }
            if reth.dma_len > 0 {
                whole = Some(self.remote_grant(
                    qp,
                    reth.rkey.get(),
                    reth.va,
                    u64::from(reth.dma_len),
                    Need::RemoteWrite,
                )?);
            }
            qp.resp.write = Some(WriteState {
                va: reth.va,
                rkey: reth.rkey.get(),
                total: reth.dma_len,
                offset: 0,
            });
        }
        let Some(mut write) = qp.resp.write else {
            return Err(RespError::invalid_request());
        };
        if u64::from(write.offset) + payload.len() as u64 > u64::from(write.total) {
            return Err(RespError::invalid_request());
        }
        if !payload.is_empty() {
            let va = write.va + u64::from(write.offset);
            // A packet carrying the whole message (ONLY) places what its
            // R_Key was just checked for: no second check.
            let grant = match whole {
                Some(grant) if payload.len() as u64 == u64::from(write.total) => grant,
                _ => {
                    self.remote_grant(qp, write.rkey, va, payload.len() as u64, Need::RemoteWrite)?
                }
            };
            let written = self.hca.as_ref().map(|h| {
                h.mtt.place(
                    self.mem.as_ref(),
                    grant.range,
                    grant.offset,
                    &payload,
                    0,
                    payload.len(),
                )
            });
            match written {
                Some(Ok(())) => {}
                // The sender's memory, not ours (see `sge_copy`).
                Some(Err(XlateError::Source(fault))) => {
                    self.direct_source_fault_seen = Some(fault);
                    return Err(RespError::remote_access());
                }
                _ => {
                    self.note_fault();
                    return Err(RespError::remote_access());
                }
            }
            self.touch(2, payload.len());
        }
        write.offset += payload.len() as u32;
        qp.resp.write = Some(write);
        if !ends {
            return Ok(None);
        }
        if write.offset != write.total {
            return Err(RespError::invalid_request());
        }
        if let Some(imm) = imm
            && let Some(mut recv) = qp.resp.recv.take()
        {
            recv.offset = write.total;
            let details = if repr.bth.solicited {
                CqeFlags::SOLICITED
            } else {
                CqeFlags::empty()
            };
            self.complete_recv(
                qp,
                &recv,
                RecvOp::RdmaWriteImm(imm),
                WcStatus::Success,
                details,
            );
        }
        qp.resp.write = None;
        qp.resp.msn = qp.resp.msn.wrapping_add(1);
        Ok(None)
    }

    /// Checks an R_Key for a remote access (PRM 7.1).
    fn remote_grant(
        &self,
        qp: &Qp,
        rkey: u32,
        va: u64,
        len: u64,
        need: Need,
    ) -> Result<crate::device::dma::Grant, RespError> {
        let hca = self.hca.as_ref().ok_or(RespError::remote_access())?;
        check_key(&hca.mpts, rkey, qp.pd, qp.index, va, len, need)
            .map_err(|_| RespError::remote_access())
    }

    fn rx_read(&mut self, qp: &mut Qp, pkt: &Rx<'_>) -> Result<(), RespError> {
        let repr = pkt.repr();
        let ExtRepr::Reth(reth) = repr.ext else {
            return Err(RespError::invalid_request());
        };
        if !qp.attrs.access.contains(AccessFlags::REMOTE_READ) || qp.attrs.max_dest_rd_atomic == 0 {
            return Err(RespError::invalid_request());
        }
        if reth.dma_len > crate::device::DeviceConfig::MAX_MSG_SIZE {
            return Err(RespError::invalid_request());
        }
        if reth.dma_len > 0 {
            self.remote_grant(
                qp,
                reth.rkey.get(),
                reth.va,
                u64::from(reth.dma_len),
                Need::RemoteRead,
            )?;
        }
        let mtu = qp.attrs.path_mtu.bytes();
        let npkts = reth.dma_len.div_ceil(mtu).max(1);
        let psn = repr.bth.psn;
        self.remember(
            qp,
            RespResource {
                first_psn: psn,
                npkts,
                kind: ResourceKind::Read {
                    va: reth.va,
                    rkey: reth.rkey.get(),
                    len: reth.dma_len,
                },
            },
        );
        qp.resp.expected_psn = psn.wrapping_add(npkts);
        qp.resp.msn = qp.resp.msn.wrapping_add(1);
        self.send_read_responses(
            qp,
            psn,
            npkts,
            0,
            reth.va,
            reth.rkey.get(),
            reth.dma_len,
            false,
        )
    }

    /// Sends read response packets `from..npkts` of a read starting at PSN
    /// `first` (`replay`: again, for a duplicate request).
    #[allow(
        clippy::too_many_arguments,
        reason = "a read response stream is described by this many values"
    )]
    fn send_read_responses(
        &mut self,
        qp: &mut Qp,
        first: Psn,
        npkts: u32,
        from: u32,
        va: u64,
        rkey: u32,
        len: u32,
        replay: bool,
    ) -> Result<(), RespError> {
        let Some(route) = self.reply_route(qp) else {
            return Err(RespError::local(WcStatus::LocQpOpErr));
        };
        let mtu = qp.attrs.path_mtu.bytes();
        // Direct placement: the requester reads the data from here. A
        // replay's failure is ignored, as the wire path ignores it.
        let origin = Origin::ReadResponse {
            request_psn: first,
            replay,
        };
        let mut message =
            (self.direct && route.is_unicast()).then(|| self.begin_message(qp.index, origin));
        let mut result = Ok(());
        for pkt in from..npkts {
            let start = pkt * mtu;
            let chunk = (len - start.min(len)).min(mtu) as usize;
            let grant = if chunk > 0 {
                match self.remote_grant(
                    qp,
                    rkey,
                    va + u64::from(start),
                    chunk as u64,
                    Need::RemoteRead,
                ) {
                    Ok(g) => Some(g),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            } else {
                None
            };
            let pos = super::send::Pos::of(pkt, npkts);
            let opcode = match pos {
                super::send::Pos::First => Opcode::RcRdmaReadResponseFirst,
                super::send::Pos::Middle => Opcode::RcRdmaReadResponseMiddle,
                super::send::Pos::Last => Opcode::RcRdmaReadResponseLast,
                super::send::Pos::Only => Opcode::RcRdmaReadResponseOnly,
            };
            let ext = if pos == super::send::Pos::Middle {
                ExtRepr::None
            } else {
                ExtRepr::Aeth(self.aeth(
                    qp,
                    Syndrome::Ack {
                        credits: CreditCode::NONE,
                    },
                ))
            };
            let bth = reply_bth(qp, opcode, first.wrapping_add(pkt), &route);
            let sent = match message.as_mut() {
                Some(msg) => {
                    let located = grant.map_or(Ok(()), |g| {
                        self.hca.as_ref().map_or(Ok(()), |h| {
                            h.mtt.locate(g.range, g.offset, chunk, &mut msg.pieces)
                        })
                    });
                    match located {
                        Ok(()) => {
                            self.push_packet(msg, route.port, route.repr(bth, ext, chunk));
                            Ok(())
                        }
                        Err(_) => {
                            self.note_fault();
                            Err(RespError::remote_access())
                        }
                    }
                }
                None => self.emit_packet_with(&route, bth, ext, chunk, |dev, data| {
                    let Some(g) = grant else {
                        return Ok(());
                    };
                    let read = dev.hca.as_ref().is_some_and(|h| {
                        h.mtt
                            .read(dev.mem.as_ref(), g.range, g.offset, data)
                            .is_ok()
                    });
                    if read {
                        dev.touch(2, data.len());
                        Ok(())
                    } else {
                        dev.note_fault();
                        Err(RespError::remote_access())
                    }
                }),
            };
            if let Err(e) = sent {
                result = Err(e);
                break;
            }
        }
        if let Some(msg) = message {
            self.queue_message(route.port, msg);
        }
        result
    }

    fn rx_atomic(&mut self, qp: &mut Qp, pkt: &Rx<'_>) -> Result<(), RespError> {
        let repr = pkt.repr();
        let ExtRepr::AtomicEth(a) = repr.ext else {
            return Err(RespError::invalid_request());
        };
        if !qp.attrs.access.contains(AccessFlags::REMOTE_ATOMIC) || qp.attrs.max_dest_rd_atomic == 0
        {
            return Err(RespError::invalid_request());
        }
        // IBA 9.4.5: the address must be 8-byte aligned.
        if a.va % 8 != 0 {
            return Err(RespError::invalid_request());
        }
        let grant = self.remote_grant(qp, a.rkey.get(), a.va, 8, Need::RemoteAtomic)?;
        let mut word = [0u8; 8];
        let range: MttRange = grant.range;
        let read = self.hca.as_ref().is_some_and(|h| {
            h.mtt
                .read(self.mem.as_ref(), range, grant.offset, &mut word)
                .is_ok()
        });
        if !read {
            self.note_fault();
            return Err(RespError::remote_access());
        }
        // Memory holds the word in host order; the device serialises
        // atomics, so read-modify-write here is atomic for every requester.
        let orig = u64::from_le_bytes(word);
        let new = match repr.bth.opcode {
            Opcode::RcCompareSwap => {
                if orig == a.compare {
                    a.swap_add
                } else {
                    orig
                }
            }
            _ => orig.wrapping_add(a.swap_add),
        };
        if new != orig {
            let wrote = self.hca.as_ref().is_some_and(|h| {
                h.mtt
                    .write(self.mem.as_ref(), range, grant.offset, &new.to_le_bytes())
                    .is_ok()
            });
            if !wrote {
                self.note_fault();
                return Err(RespError::remote_access());
            }
        }
        let psn = repr.bth.psn;
        self.remember(
            qp,
            RespResource {
                first_psn: psn,
                npkts: 1,
                kind: ResourceKind::Atomic { orig },
            },
        );
        qp.resp.expected_psn = psn.next();
        qp.resp.msn = qp.resp.msn.wrapping_add(1);
        self.send_atomic_ack(qp, psn, orig);
        Ok(())
    }

    /// Keeps a read or atomic for duplicate handling, oldest evicted.
    fn remember(&mut self, qp: &mut Qp, res: RespResource) {
        let capacity = usize::from(qp.attrs.max_dest_rd_atomic.max(1));
        while qp.resp.resources.len() >= capacity {
            qp.resp.resources.pop_front();
        }
        qp.resp.resources.push_back(res);
    }

    /// A duplicate request (IBA 9.7.5.1.2): reads are replayed from the
    /// remembered resource, atomics answered from the cached value and never
    /// re-executed, everything else re-acknowledged when it asks (AckReq).
    fn rc_duplicate(&mut self, qp: &mut Qp, pkt: &Rx<'_>) {
        let repr = pkt.repr();
        let psn = repr.bth.psn;
        let info = repr.bth.opcode.info();
        let found = qp
            .resp
            .resources
            .iter()
            .rev()
            .find(|r| psn.distance_from(r.first_psn) < r.npkts)
            .copied();
        match (info.kind, found) {
            (
                OpKind::RdmaReadRequest,
                Some(RespResource {
                    first_psn,
                    npkts,
                    kind: ResourceKind::Read { va, rkey, len },
                }),
            ) => {
                let from = psn.distance_from(first_psn);
                let _ = self.send_read_responses(qp, first_psn, npkts, from, va, rkey, len, true);
            }
            (
                OpKind::CompareSwap | OpKind::FetchAdd,
                Some(RespResource {
                    kind: ResourceKind::Atomic { orig },
                    first_psn,
                    ..
                }),
            ) => {
                self.send_atomic_ack(qp, first_psn, orig);
            }
            (OpKind::RdmaReadRequest | OpKind::CompareSwap | OpKind::FetchAdd, _) => {
                // Too old to replay: the requester will time out and fail.
            }
            // A duplicate SEND or WRITE packet is acknowledged as a new
            // one is, only when it asks: answering each packet of a resent
            // window floods the requester (one ACK per packet).
            _ if !repr.bth.ack_req => {}
            _ => {
                let last = qp.resp.expected_psn.wrapping_add(0xFF_FFFF);
                self.send_ack(
                    qp,
                    last,
                    Syndrome::Ack {
                        credits: CreditCode::NONE,
                    },
                );
            }
        }
    }

    fn aeth(&self, qp: &Qp, syndrome: Syndrome) -> AethRepr {
        AethRepr {
            syndrome,
            msn: Msn::from_low_bits(qp.resp.msn),
        }
    }

    /// The route back to the QP's peer.
    fn reply_route(&self, qp: &Qp) -> Option<Route> {
        self.route(qp, &qp.attrs.av, qp.attrs.dest_qpn)
    }

    /// Sends an ACK, RNR NAK or NAK for `psn`.
    pub(crate) fn send_ack(&mut self, qp: &Qp, psn: Psn, syndrome: Syndrome) {
        let aeth = self.aeth(qp, syndrome);
        if self.direct && self.coalesce_ack(qp.index, qp.port, psn, aeth) {
            return;
        }
        let Some(route) = self.reply_route(qp) else {
            return;
        };
        let bth = reply_bth(qp, Opcode::RcAcknowledge, psn, &route);
        self.emit_packet(&route, bth, ExtRepr::Aeth(aeth), &[]);
    }

    fn send_atomic_ack(&mut self, qp: &Qp, psn: Psn, orig: u64) {
        let Some(route) = self.reply_route(qp) else {
            return;
        };
        let bth = reply_bth(qp, Opcode::RcAtomicAcknowledge, psn, &route);
        let aeth = self.aeth(
            qp,
            Syndrome::Ack {
                credits: CreditCode::NONE,
            },
        );
        self.emit_packet(
            &route,
            bth,
            ExtRepr::AethAtomicAckEth(
                aeth,
                AtomicAckEthRepr {
                    orig_remote_data: orig,
                },
            ),
            &[],
        );
    }
}

/// The BTH of a response packet to the QP's peer.
fn reply_bth(qp: &Qp, opcode: Opcode, psn: Psn, route: &Route) -> BthRepr {
    BthRepr {
        opcode,
        solicited: false,
        mig_req: false,
        pkey: route.pkey,
        fecn: false,
        becn: false,
        dest_qp: qp.attrs.dest_qpn,
        ack_req: false,
        psn,
    }
}
