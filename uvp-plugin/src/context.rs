//! A user context's fast-path state: its UAR page, the limits the kernel
//! answered at `OpenCa`, and the QPs its pollers know; and the setup of
//! CQs, QPs and SRQs from the layouts the provider sent (PRM 13) and the
//! kernel's answers.

use std::sync::Arc;

use hca_prm::doorbell::{CQ_DOORBELL, DB_OBJECT_MASK, SQ_DOORBELL};
use hca_prm::uverbs::{
    CreateCqPriv, CreateCqPrivOut, CreateQpPriv, CreateQpPrivOut, CreateSrqPriv, CreateSrqPrivOut,
    OpenCaPriv, UserRange,
};
use hca_prm::wqe::BB_SIZE;
use ib_types::mr::MwType;
use ib_types::qp::{QpCaps, QpType};
use ib_types::scalars::Qpn;
use ib_types::wr::{Transport, WrLimits};

use crate::cq::Cq;
use crate::dma::{DmaBuffer, Record};
use crate::error::SetupError;
use crate::mmio::UarPage;
use crate::qp::{Qp, RecvQueue, SendQueue, WindowTypes};
use crate::queue::{Directory, Route};
use crate::srq::Srq;

/// The kernel's answer to a user `CreateQp`.
#[derive(Debug, Clone, Copy)]
pub struct QpCreated {
    /// The QP's type.
    pub qp_type: QpType,
    /// The capacities granted.
    pub caps: QpCaps,
    /// The private response.
    pub private: CreateQpPrivOut,
}

/// The deepest work queue: a CQE's `wqe_index` names 2^16 slots (PRM 10.4).
const MAX_LOG_QUEUE: u8 = 16;

/// Refuses a queue deeper than a CQE's `wqe_index` can name.
fn check_depth(what: &'static str, log: u8) -> Result<(), SetupError> {
    if log > MAX_LOG_QUEUE {
        return Err(SetupError::Layout {
            what,
            detail: "deeper than a wqe_index names (2^16)",
        });
    }
    Ok(())
}

/// One user context (one `OpenCa` of one process).
#[derive(Debug)]
pub struct Context {
    limits: OpenCaPriv,
    uar: Arc<UarPage>,
    directory: Arc<Directory>,
    windows: Arc<WindowTypes>,
}

/// `range` as a shared buffer.
///
/// # Safety
/// As [`DmaBuffer::from_raw`], for the whole range.
unsafe fn buffer(range: &UserRange) -> Result<DmaBuffer, SetupError> {
    let len = usize::try_from(range.len).map_err(|_| SetupError::Layout {
        what: "range",
        detail: "longer than the address space",
    })?;
    // SAFETY: the caller's contract is `from_raw`'s for this range.
    Ok(unsafe { DmaBuffer::from_raw(range.va, len) }?)
}

/// A doorbell record's range (4-byte aligned, at least 4 bytes).
///
/// # Safety
/// As [`Record::from_raw`].
unsafe fn record(range: &UserRange) -> Result<Record, SetupError> {
    if range.len < 4 {
        return Err(SetupError::Layout {
            what: "doorbell record",
            detail: "shorter than 4 bytes",
        });
    }
    // SAFETY: the caller's contract is `Record::from_raw`'s.
    Ok(unsafe { Record::from_raw(range.va) }?)
}

const fn transport(qp_type: QpType) -> Transport {
    match qp_type {
        QpType::Rc => Transport::Rc,
        QpType::Uc => Transport::Uc,
        QpType::Ud | QpType::Smi | QpType::Gsi => Transport::Ud,
    }
}

impl Context {
    /// The context the kernel opened: its limits (`OpenCa`'s private
    /// response) and its mapped UAR page.
    pub fn new(limits: OpenCaPriv, uar: UarPage) -> Self {
        Self {
            limits,
            uar: Arc::new(uar),
            directory: Arc::default(),
            windows: Arc::default(),
        }
    }

    /// Records memory window `mw` (its handle) of this context as of
    /// `mw_type` (the provider's `AllocMw` post): its binds posted on the
    /// context's QPs carry that type (PRM 7.1, 10.2). A window never
    /// recorded is bound as type 2.
    pub fn record_window(&self, mw: u64, mw_type: MwType) {
        self.windows.record(mw, mw_type);
    }

    /// Forgets window `mw` (deallocated).
    pub fn forget_window(&self, mw: u64) {
        self.windows.forget(mw);
    }

    /// The limits the kernel answered.
    pub fn limits(&self) -> &OpenCaPriv {
        &self.limits
    }

    /// The context's UAR page (its doorbells go through the queues; this
    /// is for rings a queue does not make itself).
    pub fn uar_page(&self) -> &UarPage {
        &self.uar
    }

    /// The CQ created with `layout` (already sent, its ring zero-filled).
    ///
    /// # Safety
    /// `layout`'s ring and record are memory of this process that stays
    /// allocated, and is accessed by others only as 64-bit atomics (the
    /// device's DMA included), for as long as the returned CQ lives
    /// ([`DmaBuffer::from_raw`]).
    pub unsafe fn cq(
        &self,
        layout: &CreateCqPriv,
        created: &CreateCqPrivOut,
    ) -> Result<Cq, SetupError> {
        // SAFETY: the caller's contract is this one's.
        unsafe { self.make_cq(layout, created, false) }
    }

    /// As [`Context::cq`], for a record whose 8-byte aligned word the
    /// caller allocated for it alone: the poll stores the record as one
    /// 64-bit store, not a read-modify-write ([`Record::owning_word`]).
    ///
    /// # Safety
    /// As [`Context::cq`], and as [`Record::owning_word`] for the record:
    /// `layout.dbr` is 8-byte aligned and bytes 4 to 8 after it belong to
    /// no one else (no other record, nothing the device writes).
    pub unsafe fn cq_owning_record_word(
        &self,
        layout: &CreateCqPriv,
        created: &CreateCqPrivOut,
    ) -> Result<Cq, SetupError> {
        // SAFETY: the caller's contract is this one's.
        unsafe { self.make_cq(layout, created, true) }
    }

    /// [`Context::cq`], its record owning its word or not.
    ///
    /// # Safety
    /// As [`Context::cq_owning_record_word`] when `record_owns_word`, else
    /// as [`Context::cq`].
    unsafe fn make_cq(
        &self,
        layout: &CreateCqPriv,
        created: &CreateCqPrivOut,
        record_owns_word: bool,
    ) -> Result<Cq, SetupError> {
        if u64::from(created.cqn) & !DB_OBJECT_MASK != 0
            || created.log_entries != layout.log_entries
        {
            return Err(SetupError::Layout {
                what: "CQ",
                detail: "the response does not match the request",
            });
        }
        if layout.ring.len < 32u64 << layout.log_entries {
            return Err(SetupError::Layout {
                what: "CQ ring",
                detail: "smaller than its entries",
            });
        }
        // SAFETY: the caller's contract covers the layout's ranges.
        let ring = unsafe { buffer(&layout.ring) }?;
        let record = if record_owns_word {
            // SAFETY: the caller's contract covers the record's whole word.
            unsafe { Record::owning_word(layout.dbr.va) }?
        } else {
            // SAFETY: as the ring's.
            unsafe { record(&layout.dbr) }?
        };
        Cq::new(
            created.cqn,
            ring,
            record,
            layout.log_entries,
            Arc::clone(&self.uar),
            CQ_DOORBELL,
            Arc::clone(&self.directory),
        )
    }

    /// The SRQ created with `layout`, with `max_sge` SGEs per WQE granted.
    ///
    /// # Safety
    /// As [`Context::cq`], for `layout`'s ranges and the returned SRQ.
    pub unsafe fn srq(
        &self,
        layout: &CreateSrqPriv,
        created: &CreateSrqPrivOut,
        max_sge: u32,
    ) -> Result<Srq, SetupError> {
        check_depth("SRQ", layout.log_entries)?;
        let stride = 1usize << layout.log_stride;
        if layout.ring.len < (stride as u64) << layout.log_entries {
            return Err(SetupError::Layout {
                what: "SRQ ring",
                detail: "smaller than its entries",
            });
        }
        // SAFETY: the caller's contract covers the layout's ranges.
        let ring = unsafe { buffer(&layout.ring) }?;
        // SAFETY: as above.
        let record = unsafe { record(&layout.dbr) }?;
        Ok(Srq::new(
            created.srqn,
            ring,
            record,
            max_sge,
            layout.log_entries,
            stride,
        ))
    }

    /// The QP created with `layout` (on `srq` when it has one).
    ///
    /// # Safety
    /// As [`Context::cq`], for `layout`'s ranges and the returned QP.
    pub unsafe fn qp(
        &self,
        layout: &CreateQpPriv,
        created: &QpCreated,
        srq: Option<&Srq>,
    ) -> Result<Qp, SetupError> {
        let out = &created.private;
        if out.uar_index != self.limits.uar_index {
            return Err(SetupError::ForeignUar {
                expected: self.limits.uar_index,
                found: out.uar_index,
            });
        }
        let qpn = Qpn::new(out.qpn).map_err(|_| SetupError::Layout {
            what: "QP",
            detail: "the QP number does not fit 24 bits",
        })?;
        if layout.rq.is_some() == srq.is_some() {
            return Err(SetupError::Layout {
                what: "QP",
                detail: "a QP has its own receive queue exactly when it has no SRQ",
            });
        }
        check_depth("send queue", layout.sq_log_bbs)?;
        if let Some(rq) = &layout.rq {
            check_depth("receive queue", rq.log_entries)?;
        }
        if layout.sq.len < (BB_SIZE as u64) << layout.sq_log_bbs {
            return Err(SetupError::Layout {
                what: "send ring",
                detail: "smaller than its basic blocks",
            });
        }
        // SAFETY: the caller's contract covers the layout's ranges.
        let sq = unsafe { buffer(&layout.sq) }?;
        let send = SendQueue::new(
            sq,
            qpn,
            transport(created.qp_type),
            WrLimits {
                max_sge: created.caps.max_send_sge,
                max_inline: created.caps.max_inline_data,
            },
            layout.sq_log_bbs,
            BB_SIZE << layout.log_wqe_bbs,
            Arc::clone(&self.uar),
            SQ_DOORBELL,
            Arc::clone(&self.windows),
        )?;
        let recv = match &layout.rq {
            Some(rq) => {
                let stride = 1usize << rq.log_stride;
                if rq.ring.len < (stride as u64) << rq.log_entries {
                    return Err(SetupError::Layout {
                        what: "receive ring",
                        detail: "smaller than its entries",
                    });
                }
                // SAFETY: the caller's contract covers the layout's ranges.
                let ring = unsafe { buffer(&rq.ring) }?;
                // SAFETY: as above.
                let record = unsafe { record(&rq.dbr) }?;
                Some(RecvQueue::new(
                    ring,
                    record,
                    created.caps.max_recv_sge,
                    rq.log_entries,
                    stride,
                ))
            }
            None => None,
        };
        self.directory.insert(
            qpn.get(),
            Route::new(
                Arc::clone(send.shared()),
                recv.as_ref().map(|r| Arc::clone(r.shared())),
                srq.map(|s| Arc::clone(s.shared())),
            ),
        );
        Ok(Qp::new(qpn, send, recv, Arc::clone(&self.directory)))
    }
}
