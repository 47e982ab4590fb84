//! Shared receive queues: `ibv_create_srq`, `ibv_modify_srq`,
//! `ibv_query_srq`, `ibv_destroy_srq` and the context's
//! `ops.post_srq_recv`, over [`ibal_user::SharedSrq`] (which owns its PD;
//! posts go through the linked plugin's fast path, no kernel call).
//!
//! An SRQ's `ibv_srq` is the front of its slot in the SRQ table
//! (`crate::slots`, as QPs'), and the slot holds the access library's SRQ
//! and the PD it was made in: `ops.post_srq_recv` reaches it from the
//! program's pointer with no lock, lookup or allocation, converting the
//! list as `ops.post_recv` does (`crate::qp`). It counts as a child of its PD, and counts the QPs
//! made on it (`crate::qp`: their receives come from it, and
//! `ibv_post_recv` on them is refused with `EINVAL` as rdma-core's
//! software providers refuse it): `ibv_destroy_srq` is `EBUSY` while any
//! remains. As in rdma-core, `srq_limit` is ignored at creation (arm it
//! with `ibv_modify_srq`), and the granted `max_wr` and `max_sge` are
//! written back. The device cannot resize an SRQ (PRM: no command does;
//! `IBV_DEVICE_SRQ_RESIZE` is not reported): a modify naming
//! `IBV_SRQ_MAX_WR` is `EOPNOTSUPP` and changes nothing. The limit event
//! fires on the device (`ibv_query_srq` then reads the limit 0) and
//! reaches the program as `IBV_EVENT_SRQ_LIMIT_REACHED` naming the SRQ
//! (`crate::async_events`); `ibv_destroy_srq` takes the slot, destroys,
//! then waits for the acknowledgement of every event taken for the SRQ.
//! `ibv_get_srq_num` (XRC) is not offered: the
//! `verbs_context` slot is NULL, so the inline answers `EOPNOTSUPP`.

use std::ffi::c_int;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ib_types::srq::{SrqAttr, SrqModify};
use ibal_user::SharedSrq;
use ibverbs_abi::{
    IBV_SRQ_LIMIT, IBV_SRQ_MAX_WR, IbvPd, IbvRecvWr, IbvSrq, IbvSrqAttr, IbvSrqInitAttr,
};

use crate::async_events::ObjectKind;
use crate::memory::{ProtectionDomain, pd_for_child, truncated_handle};
use crate::qp::{post_recv_list, set_bad};
use crate::slots::{Lease, Table};
use crate::util::{errno_of, guard, set_errno};

/// A shared receive queue: rdma-core's `ibv_srq` at the front of its slot
/// in [`SRQS`], then the access library's SRQ and the PD it was made in.
pub(crate) struct SharedReceiveQueue {
    raw: Lease<IbvSrq, SharedReceiveQueue>,
    pub(crate) srq: Arc<SharedSrq>,
    pd: Arc<ProtectionDomain>,
    /// QPs receiving from it and not destroyed: destroying it is `EBUSY`.
    pub(crate) children: AtomicUsize,
}

// SAFETY: the `ibv_srq` in `raw`'s slot names the context and PD this SRQ
// holds (`pd`) and the program's `srq_context` (never dereferenced); it is
// written when the slot is reserved and never after (its pthread mutex and condition are
// unused).
unsafe impl Send for SharedReceiveQueue {}
// SAFETY: as for `Send`: shared references only read `raw`.
unsafe impl Sync for SharedReceiveQueue {}

impl SharedReceiveQueue {
    pub(crate) fn as_ptr(&self) -> *mut IbvSrq {
        self.raw.get()
    }
}

/// The live SRQs, found by the `ibv_srq` pointer (`crate::slots`).
static SRQS: Table<IbvSrq, SharedReceiveQueue> = Table::new();

/// The SRQ `ptr` names, if it is one of ours and live.
pub(crate) fn srq_at(ptr: *const IbvSrq) -> Option<Arc<SharedReceiveQueue>> {
    SRQS.get(ptr)
}

/// `ibv_create_srq(pd, srq_init_attr)`: an SRQ of at least `attr.max_wr`
/// receives of `attr.max_sge` entries (`CreateSrq`), the granted sizes
/// written back; `attr.srq_limit` is ignored, as rdma-core documents.
/// NULL with `errno`: `EINVAL` for a PD not ours, NULL attributes, no
/// receives, or sizes past the device's limits (`max_srq_wr`,
/// `max_srq_sge`); the kernel's answer otherwise.
///
/// # Safety
///
/// `init` is NULL or valid for reads and writes of an
/// `ibv_srq_init_attr`; `pd` is checked against the live PDs.
pub unsafe extern "C" fn ibv_create_srq(pd: *mut IbvPd, init: *mut IbvSrqInitAttr) -> *mut IbvSrq {
    guard(std::ptr::null_mut(), || {
        // SAFETY: NULL or valid for reads and writes (the contract).
        let Some(init) = (unsafe { init.as_mut() }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        create_srq(pd, init).unwrap_or_else(|errno| {
            set_errno(errno);
            std::ptr::null_mut()
        })
    })
}

fn create_srq(pd: *mut IbvPd, init: &mut IbvSrqInitAttr) -> Result<*mut IbvSrq, c_int> {
    if init.attr.max_wr == 0 {
        return Err(libc::EINVAL);
    }
    let pd = pd_for_child(pd)?;
    let asked = SrqAttr {
        max_wr: init.attr.max_wr,
        max_sge: init.attr.max_sge,
        srq_limit: 0,
    };
    let srq = match SharedSrq::new(&pd.pd, &asked) {
        Ok(srq) => srq,
        Err(error) => {
            pd.children.fetch_sub(1, Ordering::AcqRel);
            return Err(errno_of(&error));
        }
    };
    let raw = SRQS.reserve(IbvSrq {
        context: pd.raw.context,
        srq_context: init.srq_context,
        pd: pd.as_ptr(),
        handle: truncated_handle(srq.handle()),
        mutex: Default::default(),
        cond: Default::default(),
        events_completed: 0,
    });
    let Some(raw) = raw else {
        // Dropping it destroys it.
        drop(srq);
        pd.children.fetch_sub(1, Ordering::AcqRel);
        return Err(libc::ENOMEM);
    };
    let granted = srq.attr();
    init.attr.max_wr = granted.max_wr;
    init.attr.max_sge = granted.max_sge;
    let made = Arc::new(SharedReceiveQueue {
        raw,
        srq: Arc::new(srq),
        pd,
        children: AtomicUsize::new(0),
    });
    let ptr = made.as_ptr();
    let handle = made.srq.handle();
    made.pd
        .context
        .events
        .track(ObjectKind::Srq, handle, ptr as usize);
    SRQS.publish(&made.raw, Arc::clone(&made));
    Ok(ptr)
}

/// `ibv_modify_srq(srq, srq_attr, srq_attr_mask)`: `IBV_SRQ_LIMIT` arms
/// the limit event at `srq_limit` (0 disarms; `ModifySrq`). 0, or an
/// errno value: `EINVAL` for an SRQ not ours, NULL `srq_attr`, an unknown
/// mask bit, a limit above the SRQ's depth; `EOPNOTSUPP` for
/// `IBV_SRQ_MAX_WR` (the device cannot resize an SRQ; nothing changes).
///
/// # Safety
///
/// `attr` is NULL or valid for reads of an `ibv_srq_attr`.
pub unsafe extern "C" fn ibv_modify_srq(
    srq: *mut IbvSrq,
    attr: *mut IbvSrqAttr,
    mask: c_int,
) -> c_int {
    guard(libc::EIO, || {
        let Some(found) = srq_at(srq) else {
            return libc::EINVAL;
        };
        // SAFETY: NULL or valid for reads (the contract); copied at once.
        let Some(attr) = (unsafe { attr.as_ref() }).copied() else {
            return libc::EINVAL;
        };
        let mask = mask as u32;
        if mask & !(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT) != 0 {
            return libc::EINVAL;
        }
        let modify = SrqModify {
            max_wr: (mask & IBV_SRQ_MAX_WR != 0).then_some(attr.max_wr),
            srq_limit: (mask & IBV_SRQ_LIMIT != 0).then_some(attr.srq_limit),
        };
        if modify.max_wr.is_none() && modify.srq_limit.is_none() {
            return 0;
        }
        match found.srq.modify(&modify) {
            Ok(()) => 0,
            Err(error) => errno_of(&error),
        }
    })
}

/// `ibv_query_srq(srq, srq_attr)`: `QuerySrq`: the depth and SGEs granted
/// and the armed limit (0 once the limit event fired). 0, or an errno
/// value (`EINVAL` for an SRQ not ours or a NULL `srq_attr`).
///
/// # Safety
///
/// `attr` is NULL or valid for writes of an `ibv_srq_attr`.
pub unsafe extern "C" fn ibv_query_srq(srq: *mut IbvSrq, attr: *mut IbvSrqAttr) -> c_int {
    guard(libc::EIO, || {
        let Some(found) = srq_at(srq) else {
            return libc::EINVAL;
        };
        if attr.is_null() {
            return libc::EINVAL;
        }
        match found.srq.query() {
            Ok(now) => {
                let out = IbvSrqAttr {
                    max_wr: now.max_wr,
                    max_sge: now.max_sge,
                    srq_limit: now.srq_limit,
                };
                // SAFETY: non-NULL (checked) and valid for writes (the
                // contract).
                unsafe { attr.write(out) };
                0
            }
            Err(error) => errno_of(&error),
        }
    })
}

/// `ibv_destroy_srq(srq)`: `DestroySrq`, then, as rdma-core, waits until
/// every asynchronous event delivered for it was acknowledged (those not
/// taken yet are dropped). 0, or an errno value: `EINVAL`
/// for an SRQ not ours (or a second destroy), `EBUSY` while QPs receive
/// from it, the kernel's refusal (the SRQ stays) otherwise.
///
/// # Safety
///
/// None beyond C's: the pointer is checked against the live SRQs.
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut IbvSrq) -> c_int {
    guard(libc::EIO, || {
        match SRQS.with(srq, |found| found.children.load(Ordering::Acquire)) {
            None => return libc::EINVAL,
            Some(0) => {}
            Some(_) => return libc::EBUSY,
        }
        // Waits for the posts inside it; every later one is refused. A QP
        // made on it meanwhile makes the device refuse the destroy (busy):
        // the SRQ is live again.
        let Some(taken) = SRQS.take(srq) else {
            return libc::EINVAL;
        };
        if let Err(error) = taken.srq.destroy() {
            SRQS.publish(&taken.raw, Arc::clone(&taken));
            return errno_of(&error);
        }
        taken.pd.context.events.forget(srq as usize);
        taken.pd.children.fetch_sub(1, Ordering::AcqRel);
        0
    })
}

/// `ops.post_srq_recv` (`ibv_post_srq_recv`): the list's receives, posted
/// to the SRQ in user mode as `ops.post_recv` posts a QP's (the same
/// conversion, a record store per chunk, no lock, lookup or allocation).
/// 0, or an errno value with `*bad_wr` the first request not posted
/// (those before it were): `EINVAL` for a malformed request (a negative
/// SGE count, a NULL list) or an SRQ not ours or destroyed; the plugin's refusal otherwise (`ENOMEM` for a full
/// queue, `EINVAL` for more SGEs than the SRQ holds).
///
/// # Safety
///
/// rdma-core's: `wr` is a valid list; `bad_wr` is valid for a write.
pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut IbvSrq,
    wr: *mut IbvRecvWr,
    bad_wr: *mut *mut IbvRecvWr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the contract, passed on.
        let posted = SRQS.with(srq, |found| unsafe {
            post_recv_list(wr, bad_wr, |requests| found.srq.post_recv(requests))
        });
        posted.unwrap_or_else(|| {
            // SAFETY: the contract.
            unsafe { set_bad(bad_wr, wr) };
            libc::EINVAL
        })
    })
}
