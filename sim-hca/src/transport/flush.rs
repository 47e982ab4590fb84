//! QP state transitions with effects (PRM 6.1.3, 10.5): entering ERR flushes
//! every outstanding and posted WQE with `WR_FLUSH_ERR`; RESET discards work
//! without completions (completions already in CQs stay); SQD drains; RTS
//! from SQD or SQE resumes.

use hca_prm::cqe::{Cqe, RecvOp};
use hca_prm::eqe::Event;
use hca_prm::wqe::{RecvWqe, WqeOpcode};
use ib_types::qp::QpState;
use ib_types::scalars::Qpn;
use ib_types::wc::WcStatus;
use ib_types::wr::Transport;

use super::send::{MAX_WQE_BYTES, transport_of};
use super::{Requester, Responder, SendRecord};
use crate::device::Device;
use crate::device::dma::MttRange;
use crate::device::qp::Qp;

impl Device {
    /// Applies the side effects of a `MODIFY_QP` or destroy from `from` to
    /// `to` (the new state is already stored).
    pub(crate) fn qp_transition(
        &mut self,
        n: u32,
        from: ib_types::qp::QpState,
        to: QpState,
        _now: u64,
    ) {
        self.with_qp(n, |dev, qp| match to {
            QpState::Reset => {
                qp.req = Requester::default();
                qp.resp = Responder::default();
                qp.sq_producer = 0;
                qp.rq_consumer = 0;
            }
            QpState::Init if from == QpState::Reset => {
                qp.req.retries_left = qp.attrs.retry_cnt;
                qp.req.rnr_left = qp.attrs.rnr_retry;
            }
            QpState::Rts => {
                qp.req.retries_left = qp.attrs.retry_cnt;
                qp.req.rnr_left = qp.attrs.rnr_retry;
                if from == QpState::Rtr {
                    qp.req.psn = qp.attrs.sq_psn;
                }
                qp.req.draining = false;
                dev.run_send_queue_of(qp);
            }
            QpState::Sqd if from == QpState::Rts => {
                qp.req.draining = true;
                dev.check_drained(qp);
            }
            QpState::Err => {
                if qp.srqn.is_some() && from != QpState::Err {
                    // IBA 11.6.3.1 "Last WQE Reached": a QP on an SRQ that
                    // enters ERR, whatever took it there, takes no more
                    // WQEs from the SRQ (as `move_to_error` reports).
                    dev.post_qp_event(|qpn| Event::SrqLastWqe { qpn }, qp.index);
                }
                dev.flush_queues(qp);
            }
            _ => {}
        });
    }

    /// A completion of `qp` could not be written: its CQ overflowed or is in
    /// error. IBA 11.6.3.1: a work queue that cannot report completions
    /// gets a Local Work Queue Catastrophic Error (PRM 8.2 `QP_FATAL`), and
    /// the QP moves to ERR (PRM 6.2).
    pub(crate) fn cq_write_failed(&mut self, qp: &mut Qp) {
        if qp.state == QpState::Err {
            return;
        }
        self.post_qp_event(|qpn| Event::QpFatal { qpn }, qp.index);
        self.move_to_error(qp);
    }

    /// Moves a QP to ERR because of an error its own processing found.
    pub(crate) fn move_to_error(&mut self, qp: &mut Qp) {
        if qp.state == QpState::Err {
            return;
        }
        qp.state = QpState::Err;
        if qp.srqn.is_some() {
            self.post_qp_event(|qpn| Event::SrqLastWqe { qpn }, qp.index);
        }
        self.flush_queues(qp);
        let ctx = qp.context();
        let _ = self.write_context(
            hca_prm::cmd::Table::Qpc,
            qp.index,
            zerocopy::IntoBytes::as_bytes(&ctx),
        );
    }

    /// A send WQE failed: RC QPs (and remote errors) go to ERR; a local
    /// error on a UC or UD QP stops only the send queue (SQE, PRM 10.5).
    pub(crate) fn fail_send_queue(&mut self, qp: &mut Qp) {
        let local = qp.req.inflight.iter().any(|r| {
            r.done
                && matches!(
                    r.status,
                    WcStatus::LocLenErr
                        | WcStatus::LocQpOpErr
                        | WcStatus::LocProtErr
                        | WcStatus::LocAccessErr
                        | WcStatus::MwBindErr
                )
        });
        if local && transport_of(qp.qp_type) != Transport::Rc && qp.state == QpState::Rts {
            qp.state = QpState::Sqe;
            self.flush_send(qp);
        } else {
            self.move_to_error(qp);
        }
    }

    /// Completes everything on both queues with flush errors.
    pub(crate) fn flush_queues(&mut self, qp: &mut Qp) {
        self.flush_send(qp);
        self.flush_recv(qp);
    }

    /// Completes outstanding send WQEs (keeping the status of the one that
    /// failed) and every posted, unfetched one, with `WR_FLUSH_ERR`.
    fn flush_send(&mut self, qp: &mut Qp) {
        // Completions are reported in order (PRM 10.5): behind the first
        // error everything is flushed, even WQEs whose operation already
        // finished on the wire; before it, only unfinished ones are.
        let mut behind_error = false;
        for r in qp.req.inflight.iter_mut() {
            if behind_error || !r.done {
                r.done = true;
                r.status = WcStatus::WrFlushErr;
            } else if r.status != WcStatus::Success {
                behind_error = true;
            }
        }
        qp.req.rd_atomic = 0;
        qp.req.ack_deadline = None;
        qp.req.rnr_until = None;
        let mut buf = [0u8; MAX_WQE_BYTES];
        while qp.req.fetch != qp.sq_producer {
            let bb = qp.req.fetch;
            let (bbs, index, opcode) = match self.load_wqe(qp, bb, &mut buf) {
                Some(bbs) => (
                    bbs,
                    u16::from_le_bytes([buf[4], buf[5]]),
                    WqeOpcode::from_code(buf[0]).unwrap_or(WqeOpcode::Nop),
                ),
                None => (1, bb as u16, WqeOpcode::Nop),
            };
            qp.req.fetch = bb.wrapping_add(bbs);
            qp.req.inflight.push_back(SendRecord {
                bb_start: bb,
                wqe_index: index,
                opcode,
                signaled: true,
                len: 0,
                first_psn: qp.req.psn,
                npkts: 0,
                acked_pkts: 0,
                done: true,
                status: WcStatus::WrFlushErr,
            });
        }
        // Retire with the CQ errors ignored: a full CQ cannot stop a flush.
        while let Some(r) = qp.req.inflight.pop_front() {
            if r.signaled || r.status != WcStatus::Success {
                let cqe = Cqe::new_send(
                    Qpn::from_low_bits(qp.index),
                    r.wqe_index,
                    r.opcode,
                    r.status,
                )
                .with_byte_count(r.len);
                let _ = self.post_cqe(qp.send_cqn, cqe);
            }
        }
        self.check_drained(qp);
    }

    /// Completes the receive in progress and every posted receive WQE of the
    /// QP's own RQ with `WR_FLUSH_ERR` (SRQ WQEs are shared and stay).
    fn flush_recv(&mut self, qp: &mut Qp) {
        qp.resp.write = None;
        if let Some(recv) = qp.resp.recv.take() {
            let cqe = Cqe::new_recv(
                Qpn::from_low_bits(qp.index),
                recv.wqe_index,
                RecvOp::Send,
                WcStatus::WrFlushErr,
                0,
            );
            let _ = self.post_cqe(qp.recv_cqn, cqe);
        }
        if qp.srqn.is_some() {
            return;
        }
        let Some(producer) = self.read_dbr(qp.rq_dbr) else {
            return;
        };
        let stride = 1usize << qp.rq.log_stride;
        let mut buf = vec![0u8; stride];
        let range = MttRange::of_ring(&qp.rq);
        let mask = qp.rq_entries() - 1;
        let mut flushed = 0;
        while qp.rq_consumer != producer && flushed < qp.rq_entries() {
            let counter = qp.rq_consumer;
            let at = u64::from(counter & mask) * stride as u64;
            let read = self
                .hca
                .as_ref()
                .is_some_and(|h| h.mtt.read(self.mem.as_ref(), range, at, &mut buf).is_ok());
            let index = if read {
                RecvWqe::parse(&buf, counter as u16).map_or(counter as u16, |w| w.wqe_index)
            } else {
                counter as u16
            };
            qp.rq_consumer = counter.wrapping_add(1);
            flushed += 1;
            let cqe = Cqe::new_recv(
                Qpn::from_low_bits(qp.index),
                index,
                RecvOp::Send,
                WcStatus::WrFlushErr,
                0,
            );
            let _ = self.post_cqe(qp.recv_cqn, cqe);
        }
    }
}
