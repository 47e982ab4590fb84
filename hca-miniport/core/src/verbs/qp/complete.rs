//! The completion side of kernel QPs (PRM 10.4; guide 6.5.4 note, 6.5.5
//! items 2, 3 and 9, 8.2.3 item 2): the `wr_id` of each polled CQE, from
//! the QP incarnation that wrote it, retiring its WQE.
//!
//! Contract (the parent module's **wr_id**, **Reset** and **Locks**):
//! - Called by `cq::poll_cq` with the object tables held shared and the
//!   CQ's lock held, for the CQ's CQEs in ring order; takes no ring lock
//!   post takes (only a reset's kept `wr_id`s have a lock, and the QP's
//!   control lock for an error completion).
//! - A CQE names its QP by number only, and a number is reused (at once
//!   for the special QPs, after the quiet period for general ones). The
//!   CQ keeps a record of each destroyed QP that still has CQEs in its
//!   ring, with the sequence number just past the last of them
//!   (`cq::RetiredQp`): a CQE polled before that number is the destroyed
//!   QP's, whatever owns the number now. Every CQE of the new owner comes
//!   later in the ring, since the device wrote the old one's before it
//!   answered its destroy and the new one exists only after that.

use alloc::sync::Arc;

use driver_platform::Platform;
use ib_types::qp::{QpState, QpType};
use ib_types::wc::WcStatus;

use super::Qp;
use super::tail::{Retire, RingShadow};
use crate::resources::{Handle, kind};
use crate::sync::Ordering;
use crate::verbs::Objects;
use crate::verbs::cq::RetiredQp;
use crate::verbs::srq::Srq;

/// The incarnation of a QP number a CQE belongs to.
enum Owner<'a, P: Platform> {
    /// The QP that has the number now.
    Live(&'a Arc<Qp<P>>),
    /// A destroyed QP whose CQEs still wait in the CQ.
    Retired(&'a RetiredQp<P>),
}

/// The `wr_id` of a completion just read from the ring of CQ `cq` and
/// polled with sequence number `seq`: its QP number `qpn`, its `key` (the
/// CQE's WQE index in bits 0-15, receive flag in bit 16, SRQ flag in bit
/// 17) and `status`; `retired` are the CQ's records of destroyed QPs. An
/// error completion of a live QP also records the state it implies. 0
/// when no QP (or slot) answers: a CQE that names no outstanding WQE never
/// takes another's `wr_id`. Takes plain values, not the completion, so
/// the caller stores the decoded completion first and keeps none of it
/// live across this.
#[inline(always)]
pub(crate) fn resolve_completion<P: Platform>(
    o: &Objects<P>,
    cq: u64,
    retired: &[RetiredQp<P>],
    (qpn, key, status): (u32, u64, WcStatus),
    seq: u64,
) -> u64 {
    let index = key as u16;
    let (recv, from_srq) = (key & (1 << 16) != 0, key & (1 << 17) != 0);
    // Records are in destroy order: the first one of the number that ends
    // after `seq` is the incarnation that wrote the CQE. Else the live QP,
    // if its completions of this kind go to this CQ (`cq`, a raw handle):
    // a CQE the number's new owner cannot have written (a user QP's, which
    // keeps no record, left in a CQ the kernel drains) touches nothing.
    let owner = retired
        .iter()
        .find(|r| r.qp.qpn == qpn && seq < r.end)
        .map(Owner::Retired)
        .or_else(|| {
            o.qps
                .objects()
                .get_by_number(qpn)
                .filter(|(_, qp)| cq == if recv { qp.recv_cq } else { qp.send_cq })
                .map(|(_, qp)| Owner::Live(qp))
        });
    let Some(owner) = owner else {
        return 0;
    };
    let qp = match owner {
        Owner::Live(qp) => qp,
        Owner::Retired(record) => &record.qp,
    };
    let wr_id = if recv && (from_srq || qp.srq.is_some()) {
        // The SRQ the incarnation received from: the live QP holds a use
        // of its SRQ, so it is in the table; a destroyed QP's record kept
        // its own, which may be gone from the table and its number reused.
        let srq: Option<&Arc<Srq<P>>> = match owner {
            Owner::Live(qp) => qp
                .srq
                .and_then(|raw| o.srqs.get(Handle::<kind::Srq>::from_raw(raw))),
            Owner::Retired(record) => record.srq.as_ref(),
        };
        srq.and_then(|srq| srq.complete(index)).unwrap_or(0)
    } else {
        qp.complete(index, recv, seq)
    };
    if let Owner::Live(qp) = owner {
        qp.note_error_completion(recv, status);
    }
    wr_id
}

impl<P: Platform> Qp<P> {
    /// The send ring's shadow (post and poll: `tail`).
    pub(crate) fn send_shadow(&self) -> RingShadow<'_> {
        RingShadow {
            wr_ids: &self.done.send_wr_ids,
            sizes: Some(&self.done.send_bbs),
            tail: &self.done.send_tail,
            units: 1 << self.geometry.sq_log_bbs,
        }
    }

    /// The receive ring's shadow (post and poll: `tail`).
    pub(crate) fn recv_shadow(&self) -> RingShadow<'_> {
        RingShadow {
            wr_ids: &self.done.recv_wr_ids,
            sizes: None,
            tail: &self.done.recv_tail,
            units: 1 << self.geometry.rq_log_entries,
        }
    }

    /// The `wr_id` of this QP's completion for the WQE at `wqe_index` in
    /// its own receive ring (`recv`) or send ring (PRM 10.4: the device
    /// stores none), retiring that WQE and, for sends, the unsignaled ones
    /// before it. The caller holds the CQ's lock, so completions of one
    /// ring are retired in ring order (`tail`).
    ///
    /// `seq` is the completion's sequence number in its CQ: one polled
    /// before the end a RESET recorded belongs to the work before that
    /// reset, and is looked up in that epoch's kept `wr_id`s without
    /// touching the live ring.
    #[inline(always)]
    pub(crate) fn complete(&self, wqe_index: u16, recv: bool, seq: u64) -> u64 {
        // The common case inline: no reset kept `wr_id`s, one retire.
        if !self.done.reset_kept.load(Ordering::Acquire) {
            let shadow = if recv {
                self.recv_shadow()
            } else {
                self.send_shadow()
            };
            match shadow.retire(wqe_index) {
                Ok(wr_id) => return wr_id,
                Err(Retire::Stale) => return 0,
                Err(Retire::Restarted) => {}
            }
        }
        self.complete_across_reset(wqe_index, recv, seq)
    }

    /// [`complete`](Self::complete) when a reset kept `wr_id`s or moved
    /// the tail under the retire: decided again, the kept epochs first.
    #[cold]
    #[inline(never)]
    fn complete_across_reset(&self, wqe_index: u16, recv: bool, seq: u64) -> u64 {
        let done = &self.done;
        let shadow = if recv {
            self.recv_shadow()
        } else {
            self.send_shadow()
        };
        let slot = (u32::from(wqe_index) & (shadow.units - 1)) as usize;
        // Twice at most: a restarted tail means a reset happened meanwhile,
        // and the completion is then one kept from before it.
        for _ in 0..2 {
            if done.reset_kept.load(Ordering::Acquire) {
                let mut kept = done.before_reset.lock();
                let epochs = if recv { &mut kept.recv } else { &mut kept.send };
                while epochs.front().is_some_and(|(end, _)| *end <= seq) {
                    epochs.pop_front();
                }
                if let Some((_, ids)) = epochs.front() {
                    return ids.get(slot).copied().unwrap_or(0);
                }
                // All polled: back to the lock-free path (a reset sets the
                // flag again under this lock).
                if kept.send.is_empty() && kept.recv.is_empty() {
                    done.reset_kept.store(false, Ordering::Release);
                }
            }
            match shadow.retire(wqe_index) {
                Ok(wr_id) => return wr_id,
                Err(Retire::Stale) => return 0,
                Err(Retire::Restarted) => continue,
            }
        }
        0
    }

    /// Records the state an error completion of this live QP implies (PRM
    /// 10.5): the device raises no event for the QP whose own WQE failed,
    /// so the completion is how the core learns it. Any error but a flush
    /// moves the QP to ERR, except a local error of a UD or UC send, which
    /// moves it to SQE. A QP whose modify is outstanding, or already in
    /// RESET or ERR, is left alone.
    #[inline(always)]
    pub(crate) fn note_error_completion(&self, recv: bool, status: WcStatus) {
        if !matches!(status, WcStatus::Success | WcStatus::WrFlushErr) {
            self.note_failed_completion(recv, status);
        }
    }

    /// [`note_error_completion`](Self::note_error_completion) of a
    /// completion that failed (no success, no flush): rare, out of line.
    #[cold]
    #[inline(never)]
    fn note_failed_completion(&self, recv: bool, status: WcStatus) {
        let local = matches!(
            status,
            WcStatus::LocLenErr
                | WcStatus::LocQpOpErr
                | WcStatus::LocProtErr
                | WcStatus::MwBindErr
                | WcStatus::LocAccessErr
        );
        let next = if !recv && local && matches!(self.qp_type, QpType::Ud | QpType::Uc) {
            QpState::Sqe
        } else {
            QpState::Err
        };
        let mut c = self.control.lock();
        if c.life == super::Life::Live && !matches!(c.state, QpState::Reset | QpState::Err) {
            self.set_state(&mut c, next);
        }
    }
}
