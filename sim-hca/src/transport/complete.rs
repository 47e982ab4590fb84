//! The completer: acknowledgements, NAKs, read responses and atomic
//! acknowledgements arriving at an RC requester; the ACK timeout and RNR
//! timers; and in-order retirement of send WQEs into the send CQ.

use hca_prm::cqe::Cqe;
use hca_prm::eqe::Event;
use hca_prm::wqe::{Payload, SendWqe, WqeOp};
use ib_types::qp::QpState;
use ib_types::scalars::{Psn, Qpn};
use ib_types::wc::WcStatus;
use ib_types::wr::Transport;

use super::send::{Copy, MAX_WQE_BYTES, transport_of};
use super::{Rx, RxData, ack_timeout_ns, rnr_timer_ns};
use crate::device::qp::Qp;
use crate::device::{Device, UnsentAckTimers};
use crate::wire::ext::{ExtRepr, NakCode, Syndrome};
use crate::wire::opcode::{OpKind, Position};

/// The requester-side status of a NAK (IBA 9.9.2).
fn nak_status(code: NakCode) -> WcStatus {
    match code {
        NakCode::PsnSequenceError => WcStatus::RetryExcErr,
        NakCode::InvalidRequest => WcStatus::RemInvReqErr,
        NakCode::RemoteAccessError => WcStatus::RemAccessErr,
        NakCode::RemoteOperationalError => WcStatus::RemOpErr,
        NakCode::InvalidRdRequest => WcStatus::RemInvRdReqErr,
    }
}

impl Device {
    /// Retires finished WQEs from the front of the send queue, in order,
    /// writing a CQE for each signaled or failed one.
    pub(crate) fn retire(&mut self, qp: &mut Qp) {
        while qp.req.inflight.front().is_some_and(|r| r.done) {
            let Some(r) = qp.req.inflight.pop_front() else {
                break;
            };
            // A read or atomic holds its credit until it retires in order
            // (as rxe does): freeing it when it finishes out of order would
            // let the requester exceed the responder's resources while an
            // earlier read still awaits its (retransmitted) responses.
            if r.is_read_or_atomic() && r.npkts > 0 {
                qp.req.rd_atomic = qp.req.rd_atomic.saturating_sub(1);
            }
            if r.signaled || r.status != WcStatus::Success {
                let cqe = Cqe::new_send(
                    Qpn::from_low_bits(qp.index),
                    r.wqe_index,
                    r.opcode,
                    r.status,
                )
                .with_byte_count(r.len);
                if self.post_cqe(qp.send_cqn, cqe).is_err() && qp.state != QpState::Err {
                    self.cq_write_failed(qp);
                    return;
                }
            }
        }
        if !qp.req.inflight.iter().any(|r| !r.done && r.npkts > 0) {
            qp.req.ack_deadline = None;
        }
        self.check_drained(qp);
    }

    /// Raises `SQ_DRAINED` once an SQD QP has nothing outstanding.
    pub(crate) fn check_drained(&mut self, qp: &mut Qp) {
        if qp.state == QpState::Sqd && qp.req.draining && qp.req.inflight.is_empty() {
            qp.req.draining = false;
            if qp.flags.contains(hca_prm::ctx::QpcFlags::SQD_EVENT) {
                self.post_qp_event(|qpn| Event::SqDrained { qpn }, qp.index);
            }
        }
    }

    /// Handles a response packet for RC QP `qp` (ACK, NAK, read response,
    /// atomic acknowledge).
    pub(crate) fn on_response(&mut self, qp: &mut Qp, pkt: &Rx<'_>) {
        if !matches!(qp.state, QpState::Rts | QpState::Sqd) {
            return;
        }
        let repr = pkt.repr();
        let psn = repr.bth.psn;
        let info = repr.bth.opcode.info();
        let aeth = match repr.ext {
            ExtRepr::Aeth(a) | ExtRepr::AethAtomicAckEth(a, _) => Some(a),
            _ => None,
        };
        match info.kind {
            OpKind::RdmaReadResponse => self.on_read_response(qp, pkt, info.position),
            OpKind::AtomicAcknowledge => {
                if let ExtRepr::AethAtomicAckEth(_, ack) = repr.ext {
                    self.on_atomic_ack(qp, psn, ack.orig_remote_data);
                }
            }
            OpKind::Acknowledge => match aeth.map(|a| a.syndrome) {
                Some(Syndrome::Ack { .. }) => self.ack_through(qp, psn),
                Some(Syndrome::RnrNak { timer }) => self.on_rnr_nak(qp, psn, timer.code()),
                Some(Syndrome::Nak(NakCode::PsnSequenceError)) => {
                    // Everything before the NAK's PSN arrived; the rest is
                    // retried, and the retry is counted (IBA 9.9.2).
                    self.ack_through(qp, psn.wrapping_add(0xFF_FFFF));
                    self.retry(qp, psn);
                }
                Some(Syndrome::Nak(code)) => {
                    self.ack_through(qp, psn.wrapping_add(0xFF_FFFF));
                    if let Some(i) = qp
                        .req
                        .inflight
                        .iter()
                        .position(|r| !r.done && r.contains(psn))
                    {
                        self.finish_record(qp, i, nak_status(code));
                    }
                }
                None => {}
            },
            _ => {}
        }
        self.retire(qp);
        self.run_send_queue_of(qp);
    }

    /// Marks every send and write whose last PSN is at or before `psn` as
    /// done, and the packets through `psn` of a message it ends inside as
    /// acknowledged (IBA 9.7.5.2: ACKs are cumulative, and a message's
    /// packets may be acknowledged before its last). Reads and atomics
    /// complete only with their responses, so acknowledgement stops at one.
    fn ack_through(&mut self, qp: &mut Qp, psn: Psn) {
        let mut progress = false;
        for r in qp.req.inflight.iter_mut() {
            if r.done || r.npkts == 0 {
                continue;
            }
            if r.is_read_or_atomic() {
                break;
            }
            if psn.precedes(r.last_psn()) {
                // A partial ACK: progress if it covers packets not yet
                // acknowledged (a stale one covers none).
                if r.contains(psn) {
                    let through = psn.distance_from(r.first_psn) + 1;
                    if through > r.acked_pkts {
                        r.acked_pkts = through;
                        progress = true;
                    }
                }
                break;
            }
            r.acked_pkts = r.npkts;
            r.done = true;
            progress = true;
        }
        if progress {
            self.progress_made(qp);
        }
    }

    /// Forward progress: fresh retry budgets and a restarted ACK timer
    /// (IBA 9.7.6.1.3: the retry count bounds consecutive retries that make
    /// no progress), and the retry under way, if any, has done its work.
    fn progress_made(&mut self, qp: &mut Qp) {
        qp.req.retrying = false;
        qp.req.retries_left = qp.attrs.retry_cnt;
        qp.req.rnr_left = qp.attrs.rnr_retry;
        qp.req.ack_deadline = ack_timeout_ns(qp.attrs.timeout).map(|t| self.now_ns + t);
    }

    fn on_rnr_nak(&mut self, qp: &mut Qp, psn: Psn, timer: u8) {
        self.ack_through(qp, psn.wrapping_add(0xFF_FFFF));
        let infinite = qp.attrs.rnr_retry == 7;
        if !infinite && qp.req.rnr_left == 0 {
            if let Some(i) = qp
                .req
                .inflight
                .iter()
                .position(|r| !r.done && r.contains(psn))
            {
                self.finish_record(qp, i, WcStatus::RnrRetryExcErr);
            }
            return;
        }
        if !infinite {
            qp.req.rnr_left -= 1;
        }
        qp.req.ack_deadline = None;
        qp.req.rnr_until = Some(self.now_ns + rnr_timer_ns(timer));
        qp.req.rnr_psn = psn;
    }

    fn on_read_response(&mut self, qp: &mut Qp, pkt: &Rx<'_>, pos: Position) {
        let psn = pkt.repr().bth.psn;
        let Some(i) = qp.req.inflight.iter().position(|r| {
            !r.done && r.opcode == hca_prm::wqe::WqeOpcode::RdmaRead && r.contains(psn)
        }) else {
            return; // a duplicate of a finished read
        };
        let r = qp.req.inflight[i];
        let expected = r.first_psn.wrapping_add(r.acked_pkts);
        if psn != expected {
            // A response beyond the expected one: one was lost. The gap is
            // an implied NAK (IBA 9.7.5.2, as rxe's completer): one counted
            // retry from the missing response. Until it makes progress (or
            // the ACK timer retries again), the rest of the old response
            // stream is ignored, not answered with a re-request each.
            if expected.precedes(psn) && !qp.req.retrying {
                self.retry(qp, expected);
            }
            return;
        }
        // Sends and writes before the read are implicitly acknowledged.
        self.ack_through(qp, r.first_psn.wrapping_add(0xFF_FFFF));
        let mtu = qp.attrs.path_mtu.bytes();
        let offset = r.acked_pkts * mtu;
        let payload = pkt.payload();
        let ends = matches!(pos, Position::Last | Position::Only);
        let size_ok = if ends {
            offset + payload.len() as u32 == r.len
        } else {
            payload.len() as u32 == mtu
        };
        if !size_ok {
            self.finish_record(qp, i, WcStatus::BadRespErr);
            return;
        }
        let mut buf = [0u8; MAX_WQE_BYTES];
        let result = self.with_wqe(qp, r.bb_start, &mut buf, |dev, qp, wqe| match wqe.payload {
            Payload::Data(sges) => dev.sge_copy(qp, sges, offset, Copy::In(payload)),
            Payload::Inline(_) => Err(WcStatus::LocQpOpErr),
        });
        match result {
            Some(Ok(())) => {
                qp.req.inflight[i].acked_pkts += 1;
                self.progress_made(qp);
                if ends {
                    self.finish_record(qp, i, WcStatus::Success);
                }
            }
            Some(Err(status)) => self.finish_record(qp, i, status),
            None => self.finish_record(qp, i, WcStatus::LocQpOpErr),
        }
    }

    fn on_atomic_ack(&mut self, qp: &mut Qp, psn: Psn, orig: u64) {
        let Some(i) = qp
            .req
            .inflight
            .iter()
            .position(|r| !r.done && r.is_read_or_atomic() && r.contains(psn))
        else {
            return;
        };
        self.ack_through(qp, psn.wrapping_add(0xFF_FFFF));
        let r = qp.req.inflight[i];
        let mut buf = [0u8; MAX_WQE_BYTES];
        // The original value lands in local memory in host byte order.
        let bytes = orig.to_le_bytes();
        let result = self.with_wqe(qp, r.bb_start, &mut buf, |dev, qp, wqe| match wqe.payload {
            Payload::Data(sges) => dev.sge_copy(qp, sges, 0, Copy::In(RxData::Bytes(&bytes))),
            Payload::Inline(_) => Err(WcStatus::LocQpOpErr),
        });
        self.progress_made(qp);
        let status = match result {
            Some(Ok(())) => WcStatus::Success,
            Some(Err(s)) => s,
            None => WcStatus::LocQpOpErr,
        };
        self.finish_record(qp, i, status);
    }

    /// Re-reads the WQE at basic block `bb` and runs `f` on it.
    fn with_wqe<R>(
        &mut self,
        qp: &mut Qp,
        bb: u32,
        buf: &mut [u8; MAX_WQE_BYTES],
        f: impl FnOnce(&mut Device, &mut Qp, &SendWqe<'_>) -> R,
    ) -> Option<R> {
        let bbs = self.load_wqe(qp, bb, buf)?;
        let wqe = SendWqe::parse(
            &buf[..bbs as usize * 64],
            bb as u16,
            transport_of(qp.qp_type),
        )
        .ok()?;
        Some(f(self, qp, &wqe))
    }

    /// Sends again every unacknowledged packet from `psn` on (RC).
    pub(crate) fn retransmit_from(&mut self, qp: &mut Qp, psn: Psn) {
        if transport_of(qp.qp_type) != Transport::Rc {
            return;
        }
        let mut buf = [0u8; MAX_WQE_BYTES];
        for i in 0..qp.req.inflight.len() {
            let r = qp.req.inflight[i];
            if r.done || r.npkts == 0 || r.last_psn().precedes(psn) {
                continue;
            }
            let from = if r.contains(psn) {
                psn.distance_from(r.first_psn)
            } else {
                0
            };
            // Never before what already arrived: a message resumes after
            // its last acknowledged packet (or received response).
            let from = from.max(r.acked_pkts);
            let sent = self.with_wqe(qp, r.bb_start, &mut buf, |dev, qp, wqe| {
                if matches!(wqe.op, WqeOp::AtomicCs { .. } | WqeOp::AtomicFa { .. }) && from > 0 {
                    return;
                }
                dev.transmit(qp, i, wqe, from);
            });
            if sent.is_none() {
                self.finish_record(qp, i, WcStatus::LocQpOpErr);
                return;
            }
            if qp.state != QpState::Rts && qp.state != QpState::Sqd {
                return;
            }
        }
        self.start_ack_timer_on_send(qp);
    }

    /// A transmission (re)starts `qp`'s local ACK timer: from now, or,
    /// when the carrier reports hand-offs
    /// ([`Device::set_ack_timers_at_hand_off`]), from when the frames
    /// just built have left: until then the timer waits, unarmed, in
    /// `unsent_ack_timers` (IBA 9.7.6.1.3: the timer measures time since
    /// a request was sent).
    pub(crate) fn start_ack_timer_on_send(&mut self, qp: &mut Qp) {
        let Some(timeout) = ack_timeout_ns(qp.attrs.timeout) else {
            qp.req.ack_deadline = None;
            return;
        };
        if !self.ack_timers_at_hand_off {
            qp.req.ack_deadline = Some(self.now_ns + timeout);
            return;
        }
        qp.req.ack_deadline = None;
        // A send queue's run transmits WQE after WQE of one QP: one entry.
        if self.unsent_ack_timers.last() != Some(&qp.index) {
            self.unsent_ack_timers.push(qp.index);
        }
    }

    /// True while `qp` has a request out that its ACK timer guards: in a
    /// state that sends, not held by an RNR wait, with a packet sent and
    /// not yet acknowledged.
    fn awaits_ack(qp: &Qp) -> bool {
        matches!(qp.state, QpState::Rts | QpState::Sqd)
            && qp.req.rnr_until.is_none()
            && qp.req.inflight.iter().any(|r| !r.done && r.npkts > 0)
    }

    /// One transport retry from `psn` (IBA 9.7.6.1.3, 9.9.2): an ACK
    /// timeout, a PSN sequence error NAK or a read-response gap. Each spends
    /// one of `retry_cnt`; with none left, the oldest outstanding WQE
    /// completes with `RETRY_EXC_ERR` (and the QP goes to ERR).
    fn retry(&mut self, qp: &mut Qp, psn: Psn) {
        if qp.req.retries_left == 0 {
            if let Some(i) = qp.req.inflight.iter().position(|r| !r.done && r.npkts > 0) {
                self.finish_record(qp, i, WcStatus::RetryExcErr);
            }
            return;
        }
        qp.req.retries_left -= 1;
        qp.req.retrying = true;
        self.retransmit_from(qp, psn);
    }

    /// The oldest PSN not yet acknowledged, if any request is outstanding.
    fn oldest_unacked(qp: &Qp) -> Option<Psn> {
        qp.req
            .inflight
            .iter()
            .find(|r| !r.done && r.npkts > 0)
            .map(|r| r.first_psn.wrapping_add(r.acked_pkts))
    }

    /// Chooses when the local ACK timer a transmission starts begins to
    /// run (PRM 11). Off (as built), at the device's current time: right
    /// for a carrier whose clock does not move while it hands the frames
    /// on ([`crate::cluster::Cluster`]'s virtual time), or that delivers
    /// them and their answers within the same call
    /// ([`crate::fast::FastFabric`]). On, for a carrier that sends the
    /// frames itself after the device call, taking real time (a socket per
    /// port, [`crate::udp::UdpFabric`]): such a timer waits, unarmed, until
    /// the carrier reports the frames sent ([`Device::take_unsent_ack_timers`],
    /// [`Device::start_ack_timers`]), so time spent sending a long
    /// retransmission is never counted against the peer.
    pub fn set_ack_timers_at_hand_off(&mut self, on: bool) {
        self.ack_timers_at_hand_off = on;
    }

    /// Moves into `timers` the ACK timers waiting for the frames drained so
    /// far ([`Device::set_ack_timers_at_hand_off`]); take them with the
    /// frames, under the same lock.
    pub fn take_unsent_ack_timers(&mut self, timers: &mut UnsentAckTimers) {
        timers.qps.append(&mut self.unsent_ack_timers);
    }

    /// The frames `timers` were taken with were all handed to the network
    /// by `now_ns`: each QP still waiting for an acknowledgement has its
    /// ACK timer run from then (never earlier than it already runs).
    /// Empties `timers`, keeping its capacity.
    pub fn start_ack_timers(&mut self, timers: &mut UnsentAckTimers, now_ns: u64) {
        self.set_time(now_ns);
        let now = self.now_ns;
        for n in timers.qps.drain(..) {
            self.with_qp(n, |_, qp| {
                // Settled meanwhile (acknowledged, failed, flushed, held by
                // an RNR wait): nothing to time. A QP number reused since
                // by another QP is timed only if it awaits an ACK itself.
                if !Self::awaits_ack(qp) {
                    return;
                }
                if let Some(timeout) = ack_timeout_ns(qp.attrs.timeout) {
                    let from_hand_off = now + timeout;
                    qp.req.ack_deadline = Some(
                        qp.req
                            .ack_deadline
                            .map_or(from_hand_off, |d| d.max(from_hand_off)),
                    );
                }
            });
        }
    }

    /// The earliest time any QP's timer fires.
    pub fn poll_timeout(&self) -> Option<u64> {
        // A failed device runs nothing (PRM 2).
        if self.is_fatal() {
            return None;
        }
        self.hca.as_ref()?.timers.next_deadline()
    }

    /// Runs every timer due at `now_ns`: RNR waits end in a retransmission,
    /// ACK timeouts retransmit or fail the WQE with `RETRY_EXC_ERR`.
    pub fn handle_timeout(&mut self, now_ns: u64) {
        self.set_time(now_ns);
        if self.is_fatal() {
            return;
        }
        let now = self.now_ns;
        // By deadline, not by a scan of every QP slot (`device::timers`);
        // in QP-index order, as a scan would find them.
        let due = match self.hca.as_mut() {
            Some(hca) => hca.timers.take_due(now),
            None => return,
        };
        for n in due {
            self.with_qp(n, |dev, qp| dev.qp_timeout(qp, now));
        }
    }

    fn qp_timeout(&mut self, qp: &mut Qp, now: u64) {
        if !matches!(qp.state, QpState::Rts | QpState::Sqd) {
            qp.req.ack_deadline = None;
            qp.req.rnr_until = None;
            return;
        }
        if qp.req.rnr_until.is_some_and(|t| t <= now) {
            qp.req.rnr_until = None;
            let psn = qp.req.rnr_psn;
            self.retransmit_from(qp, psn);
        }
        if qp.req.ack_deadline.is_some_and(|t| t <= now) {
            qp.req.ack_deadline = None;
            if let Some(psn) = Self::oldest_unacked(qp) {
                self.retry(qp, psn);
            }
        }
        self.retire(qp);
        self.run_send_queue_of(qp);
    }
}
