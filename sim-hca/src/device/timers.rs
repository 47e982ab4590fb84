//! The QP timers of the device (a requester's ACK timeout and RNR wait,
//! `Requester::ack_deadline` and `Requester::rnr_until`), indexed by
//! deadline: finding the next one and taking the due ones costs
//! `O(log armed)`, whatever the size of the QP table (PRM 11).
//!
//! The QP's own fields stay the truth; this index is a copy kept exact at
//! the one place a QP's timers can change: a QP is only mutated with the
//! rest of the device while it is out of its table slot
//! ([`Device::with_qp`](super::Device)), so putting it back files its
//! earliest deadline here, and `HW2SW_QP` unfiles it. A new timer field in
//! `Requester` must be added to [`earliest_deadline`].

use std::collections::BTreeSet;

use crate::transport::Requester;

/// The earliest deadline a requester has armed, if any.
pub(crate) fn earliest_deadline(req: &Requester) -> Option<u64> {
    match (req.ack_deadline, req.rnr_until) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// ACK timers waiting for their frames to leave (PRM 11): the QPs whose
/// local ACK timer a transmission started or restarted, in frames a carrier
/// drained and has not yet handed to the network. A carrier takes them
/// with the frames ([`Device::take_unsent_ack_timers`]) and starts them
/// once the last of those frames is sent ([`Device::start_ack_timers`]).
///
/// [`Device::take_unsent_ack_timers`]: super::Device::take_unsent_ack_timers
/// [`Device::start_ack_timers`]: super::Device::start_ack_timers
#[derive(Debug, Default)]
pub struct UnsentAckTimers {
    /// QP indices, a QP possibly more than once; kept for its capacity.
    pub(crate) qps: Vec<u32>,
}

impl UnsentAckTimers {
    /// True when no timer waits (the carrier need not report a hand-off).
    pub fn is_empty(&self) -> bool {
        self.qps.is_empty()
    }
}

/// Armed QP timers, earliest first.
#[derive(Debug, Default)]
pub(crate) struct QpTimers {
    /// `(deadline, QP index)` of every QP with a timer armed.
    by_deadline: BTreeSet<(u64, u32)>,
    /// Per QP slot, the deadline it is filed under in `by_deadline`.
    filed: Vec<Option<u64>>,
}

impl QpTimers {
    /// No timer armed, for a QP table of `qp_slots` entries.
    pub(crate) fn new(qp_slots: usize) -> Self {
        Self {
            by_deadline: BTreeSet::new(),
            filed: vec![None; qp_slots],
        }
    }

    /// Files QP `qp`'s earliest deadline (`None`: no timer armed),
    /// replacing what was filed for it.
    pub(crate) fn file(&mut self, qp: u32, deadline: Option<u64>) {
        let Some(filed) = self.filed.get_mut(qp as usize) else {
            return;
        };
        if *filed == deadline {
            return;
        }
        if let Some(old) = filed.take() {
            self.by_deadline.remove(&(old, qp));
        }
        if let Some(new) = deadline {
            self.by_deadline.insert((new, qp));
        }
        *filed = deadline;
    }

    /// The earliest deadline armed.
    pub(crate) fn next_deadline(&self) -> Option<u64> {
        self.by_deadline.first().map(|&(deadline, _)| deadline)
    }

    /// Unfiles every QP with a deadline at or before `now_ns` and returns
    /// them in QP-index order (the order a scan of the table would find
    /// them in). Each is filed again when it goes back into its slot.
    pub(crate) fn take_due(&mut self, now_ns: u64) -> Vec<u32> {
        let mut due = Vec::new();
        while let Some(&(deadline, qp)) = self.by_deadline.first() {
            if deadline > now_ns {
                break;
            }
            self.by_deadline.pop_first();
            if let Some(filed) = self.filed.get_mut(qp as usize) {
                *filed = None;
            }
            due.push(qp);
        }
        due.sort_unstable();
        due
    }

    /// Timers armed.
    #[cfg(test)]
    fn armed(&self) -> usize {
        self.by_deadline.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_deadline_is_the_earliest_filed_and_refiling_replaces() {
        let mut timers = QpTimers::new(8);
        assert_eq!(timers.next_deadline(), None);
        timers.file(5, Some(300));
        timers.file(2, Some(100));
        timers.file(7, Some(200));
        assert_eq!(timers.next_deadline(), Some(100));
        timers.file(2, Some(400));
        assert_eq!(timers.next_deadline(), Some(200));
        assert_eq!(timers.armed(), 3, "refiling replaced QP 2's entry");
        timers.file(7, None);
        timers.file(7, None);
        assert_eq!(timers.next_deadline(), Some(300));
        timers.file(99, Some(1)); // no such slot: ignored
        assert_eq!(timers.armed(), 2);
    }

    #[test]
    fn due_qps_come_out_in_index_order_and_unfiled() {
        let mut timers = QpTimers::new(8);
        timers.file(6, Some(50));
        timers.file(1, Some(90));
        timers.file(3, Some(90));
        timers.file(4, Some(91));
        assert_eq!(timers.take_due(90), vec![1, 3, 6]);
        assert_eq!(timers.next_deadline(), Some(91));
        assert_eq!(timers.take_due(90), Vec::<u32>::new());
        // A QP taken as due can be filed again at its old deadline.
        timers.file(6, Some(50));
        assert_eq!(timers.take_due(100), vec![4, 6]);
        assert_eq!(timers.armed(), 0);
    }

    #[test]
    fn earliest_deadline_takes_the_smaller_of_ack_and_rnr() {
        let mut req = Requester::default();
        assert_eq!(earliest_deadline(&req), None);
        req.ack_deadline = Some(70);
        assert_eq!(earliest_deadline(&req), Some(70));
        req.rnr_until = Some(40);
        assert_eq!(earliest_deadline(&req), Some(40));
        req.ack_deadline = None;
        assert_eq!(earliest_deadline(&req), Some(40));
    }
}
