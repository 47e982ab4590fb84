//! A failed device (catastrophic error, command timeout, surprise removal):
//! what the verbs do so that no client hangs and nothing leaks
//! (docs/miniport.md, "Catastrophic error").
//!
//! Contract, once `Hca::declare_failed` has run (from the DPC, the
//! timer routine or the shell's surprise-removal callback):
//! - **Commands.** Every outstanding and queued command completed with
//!   `DeviceFailed` before this runs, so every verb request waiting on the
//!   device has been answered with an error ([`IbStatus::InvalidState`]),
//!   and so is every later command at once.
//! - **The device is reset** (`CONTROL.RESET`) so it owns no host memory
//!   any more: a hung or half-dead device must not write into buffers the
//!   core is about to free or hand back. On a removed device the write goes
//!   nowhere.
//! - **Completions.** The device can no longer produce completions, so
//!   software does: each CQ's unpolled CQEs move to its backlog (in order,
//!   `wr_id`s resolved), then every WR outstanding on every QP (and on
//!   destroyed QPs whose flush the device never did) is completed there
//!   with `WR_FLUSH_ERR`, `wr_id` kept, and the CQ's client gets a
//!   completion event. Receive WRs posted to an SRQ belong to no QP's CQ
//!   and are not completed; the SRQ's owner gets
//!   [`AsyncEventCode::SrqCatastrophic`] and destroys it. User-mode CQs,
//!   QPs and SRQs keep their rings in the process's provider, so nothing
//!   is completed for them; each one's context is told (`CqError`,
//!   `QpFatal`, `SrqCatastrophic` through `GetAsyncEvent`).
//! - **QP state.** Every live QP's cached state becomes ERR.
//! - **The client** gets [`AsyncEventCode::LocalCatastrophic`] (the CA is
//!   unusable), from the DPC; after a surprise removal at once, from
//!   [`Hca::surprise_removed`]'s caller (no DPC may run after the
//!   removal).
//! - **Later verbs** are refused with [`IbStatus::InvalidState`], posting
//!   and arming included, except those that free something (close CA,
//!   destroy/deallocate PD, CQ, QP, SRQ, AV, MR, MW, multicast detach): their
//!   device command fails, and that failure is taken as success
//!   (`Hca::forgive_when_failed`) since the reset device holds nothing,
//!   so the object and its memory are freed. Polling keeps working and
//!   returns the backlog. [`crate::Hca::stop`] then frees the rest; nothing
//!   leaks.

use alloc::vec::Vec;

use driver_platform::{Mmio, Platform, Request};
use hca_prm::regs::{Control, offset};
use ib_types::event::{AsyncEventCode, AsyncEventRecord};
use ib_types::ioctl::{RESPONSE_HEADER_SIZE, VerbId};
use ib_types::status::IbStatus;

use super::STATUS_BUFFER_TOO_SMALL;
use super::restore::SoftEvent;
use crate::cmd::{CommandError, CommandOutput};
use crate::hca::Hca;

/// Whether `verb` frees an object (and so still runs on a failed device).
pub(crate) fn frees(verb: VerbId) -> bool {
    matches!(
        verb,
        VerbId::CloseCa
            | VerbId::DeallocPd
            | VerbId::DestroyCq
            | VerbId::DestroyQp
            | VerbId::DestroySrq
            | VerbId::DestroyAv
            | VerbId::DeregMr
            | VerbId::DeallocMw
            | VerbId::DetachMcast
    )
}

/// Completes `request` of `verb` with a failure `status` and no output,
/// without decoding it: the response is the header and the verb's fixed
/// output zeroed, exactly what `encode_response` writes for a failure.
pub(crate) fn refuse_request<R: Request>(mut request: R, verb: VerbId, status: IbStatus) {
    let fixed = RESPONSE_HEADER_SIZE + verb.out_size();
    let out = request.output();
    let Some(response) = out.get_mut(..fixed) else {
        request.complete(STATUS_BUFFER_TOO_SMALL, 0);
        return;
    };
    response.fill(0);
    // ResponseHeaderAbi: status, private_out_len, handle (little-endian).
    response[..4].copy_from_slice(&status.code().to_le_bytes());
    request.complete(status.to_ntstatus(), fixed as u64);
}

impl<P: Platform> Hca<P> {
    /// Whether the device has been declared failed.
    pub(crate) fn is_failed(&self) -> bool {
        self.failure().is_some()
    }

    /// A destroy's command result: on a failed device its failure counts
    /// as success (the reset device holds nothing), so the object is freed.
    pub(crate) fn forgive_when_failed(
        &self,
        result: Result<Vec<CommandOutput>, CommandError>,
    ) -> Result<Vec<CommandOutput>, CommandError> {
        match result {
            Err(
                CommandError::DeviceFailed { .. }
                | CommandError::Timeout { .. }
                | CommandError::NotRunning,
            ) if self.is_failed() => Ok(Vec::new()),
            other => other,
        }
    }

    /// A CQ's, QP's or SRQ's destroy result: forgiven as
    /// [`forgive_when_failed`](Self::forgive_when_failed) does, and also
    /// when the object is one D0 entry could not give back to the device
    /// (`handle` in the lost set, [`super::restore`]): the device has no
    /// such object, so whatever it answers, freeing it is right.
    pub(crate) fn forgive_destroy(
        &self,
        handle: u64,
        result: Result<Vec<CommandOutput>, CommandError>,
    ) -> Result<Vec<CommandOutput>, CommandError> {
        let lost = self.verbs.lost.lock().remove(&handle);
        match self.forgive_when_failed(result) {
            Err(CommandError::Status { .. }) if lost => Ok(Vec::new()),
            Err(error) => {
                if lost {
                    // Not this time (a timeout, say): still lost.
                    self.verbs.lost.lock().insert(handle);
                }
                Err(error)
            }
            ok => ok,
        }
    }

    /// The verbs' side of a device failure (see the module doc). Runs once,
    /// at DISPATCH_LEVEL or below; takes no lock across a client callback.
    pub(crate) fn fail_verbs(&self) {
        self.bar0.write32(offset::CONTROL, Control::RESET.bits());
        // Before the drain polls their CQEs and the CQs forget them.
        let retired = self.retired_qps();
        self.drain_rings_to_backlogs();
        let (qps, srqs, ca, cqs) = match self.with_objects(|o| {
            (
                o.qps
                    .objects()
                    .iter()
                    .map(|(_, q)| q.clone())
                    .collect::<Vec<_>>(),
                o.srqs
                    .iter()
                    .map(|(h, s)| (h.raw(), s.clone()))
                    .collect::<Vec<_>>(),
                o.ca.as_ref().map(|ca| ca.handle),
                o.cqs
                    .iter()
                    .map(|(h, c)| (h.raw(), c.clone()))
                    .collect::<Vec<_>>(),
            )
        }) {
            Ok(found) => found,
            // Never started verbs: nobody to tell.
            Err(_) => return,
        };
        for qp in qps.iter().chain(retired.iter()) {
            // The device is failed: a queue whose accounting cannot be
            // true has nothing trustworthy to flush, and every client
            // hears LocalCatastrophic below.
            let _ = self.flush_in_software(qp);
        }
        for qp in &qps {
            let mut c = qp.control.lock();
            if c.state != ib_types::qp::QpState::Err {
                qp.set_state(&mut c, ib_types::qp::QpState::Err);
            }
        }
        // Kernel SRQs: their owner is told. User CQs, QPs and SRQs: their
        // provider owns their rings, so nothing is flushed for them; each
        // one's context is told instead (`CqError`, `QpFatal`,
        // `SrqCatastrophic`).
        for (srq, object) in &srqs {
            if object.ring.lock().ring.is_none() {
                // A user SRQ (told below), or one still being created.
                continue;
            }
            if let Ok(record) =
                AsyncEventRecord::new(AsyncEventCode::SrqCatastrophic, *srq, None, 0)
            {
                self.queue_soft_event(SoftEvent::Async(record));
            }
        }
        self.give_up_user_objects(&cqs, &srqs, false);
        if ca.is_some() {
            let record = AsyncEventRecord::new(AsyncEventCode::LocalCatastrophic, 0, None, 0)
                .or_else(|_| {
                    AsyncEventRecord::new(
                        AsyncEventCode::LocalCatastrophic,
                        ca.unwrap_or(0),
                        None,
                        0,
                    )
                });
            if let Ok(record) = record {
                self.queue_soft_event(SoftEvent::Async(record));
            }
        }
    }
}
