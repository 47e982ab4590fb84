//! Shared receive queues: an SRQ of a PD whose ring the plugin lays out in
//! this process (`CreateSrq`'s pre and post) and posts to with no kernel
//! call; QPs created on it ([`crate::Qp::with_srq`]) take their receives
//! from it and borrow it, so it outlives them.

use ib_types::handle::PdHandle;
use ib_types::ioctl::{self as v, Empty};
use ib_types::srq::{SrqAttr, SrqCreate, SrqModify};
use ib_types::wr::RecvWr;

use crate::error::{Error, Result};
use crate::verbs::{Pd, refused};

/// A shared receive queue of a PD. `Send + Sync`: posts go through the
/// plugin, which serializes an SRQ's posts with its own lock (one per SRQ,
/// shared with no CQ's poll), so any thread may post while QPs borrow it.
///
/// A QP on it borrows it, so it cannot be destroyed first:
///
/// ```compile_fail,E0505
/// # use ib_types::qp::{QpCaps, QpType};
/// # use ib_types::srq::SrqAttr;
/// # use ibal_user::{Cq, Pd, Qp, QpInit, Srq};
/// fn on_srq(pd: &Pd<'_>, cq: &Cq<'_>, attr: &SrqAttr, caps: QpCaps) -> ibal_user::Result<()> {
///     let srq = Srq::new(pd, attr)?;
///     let init = QpInit::new(QpType::Rc, caps, false);
///     let qp = Qp::with_srq(pd, cq, cq, &srq, &init)?;
///     drop(srq);
///     drop(qp);
///     Ok(())
/// }
/// ```
#[derive(Debug)]
pub struct Srq<'pd> {
    pub(crate) pd: &'pd Pd<'pd>,
    handle: u64,
    attr: SrqAttr,
}

impl<'pd> Srq<'pd> {
    /// Creates an SRQ in `pd` of at least `max_wr` receives of `max_sge`
    /// entries each (`CreateSrq`; the plugin's pre lays the ring out).
    /// `srq_limit` arms the limit event at once when non-zero. Needs the
    /// plugin.
    pub fn new(pd: &'pd Pd<'pd>, attr: &SrqAttr) -> Result<Self> {
        let ctx = pd.context();
        ctx.plugin("CreateSrq")?;
        if attr.max_wr == 0 {
            return Err(Error::InvalidArgument("an SRQ of no receives"));
        }
        let input = SrqCreate {
            pd: PdHandle::from_raw(pd.handle()),
            attr: *attr,
        };
        let answer = ctx.call::<v::CreateSrq>(ctx.ca, &input)?;
        Ok(Self {
            pd,
            handle: answer.handle,
            attr: answer.output,
        })
    }

    /// The SRQ handle (async events name it).
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// What the kernel granted at creation (receives, SGEs, limit).
    pub fn attr(&self) -> SrqAttr {
        self.attr
    }

    /// Its current attributes, from the kernel (`QuerySrq`): the limit
    /// reads 0 once the limit event fired (the device disarms it).
    pub fn query(&self) -> Result<SrqAttr> {
        Ok(self
            .pd
            .context()
            .call::<v::QuerySrq>(self.handle, &Empty)?
            .output)
    }

    /// Arms the limit event (`ModifySrq` of the limit): when fewer than
    /// `limit` posted receives remain, the device raises
    /// `AsyncEventCode::SrqLimitReached` for this SRQ once
    /// ([`crate::Context::async_event`]) and disarms. 0 disarms it.
    /// Growing the queue (`max_wr`) is not offered: its ring is the
    /// plugin's and the kernel refuses a user SRQ's resize.
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        let modify = SrqModify {
            max_wr: None,
            srq_limit: Some(limit),
        };
        self.pd
            .context()
            .call::<v::ModifySrq>(self.handle, &modify)?;
        Ok(())
    }

    /// Posts receives to the SRQ, in user mode (one record store for the
    /// batch): how many.
    pub fn post_recv(&self, requests: &[RecvWr<'_>]) -> Result<usize> {
        self.pd
            .context()
            .plugin("posting")?
            .post_srq_recv(self.handle, requests)
            .map_err(refused)
    }
}

impl Drop for Srq<'_> {
    fn drop(&mut self) {
        // Every QP on it borrowed it, so none is left; post drops the
        // plugin's SRQ, then frees its ring.
        let _ = self.pd.context().call::<v::DestroySrq>(self.handle, &Empty);
    }
}
