//! The entry points the surveyed tools import that this milestone does
//! not offer yet (docs/libibverbs.md, "Status"): CQs, QPs, SRQs,
//! address handles from completions, multicast and completion channels. The binaries are linked `BIND_NOW`, so each must
//! exist; each answers as rdma-core does for a verb the device refuses.
//!
//! The rule: a create on an open context fails with `EOPNOTSUPP` (NULL and
//! `errno`), and with `EINVAL` on a context that is not open; every call
//! naming an object (a CQ, QP, SRQ or channel) fails with
//! `EINVAL`, since the library has created none, so any such pointer is
//! not one of its objects. Errors come back the way each verb reports
//! them: NULL with `errno`, -1 with `errno`, or an errno value.

use std::ffi::{c_int, c_void};

use ibverbs_abi::{
    IbvAh, IbvCompChannel, IbvContext, IbvCq, IbvGid, IbvPd, IbvQp, IbvQpAttr, IbvQpEx,
    IbvQpInitAttr, IbvSrq, IbvSrqInitAttr, IbvWc,
};

use crate::state::context_at;
use crate::util::set_errno;

/// NULL with `errno = EOPNOTSUPP` on an open context, `EINVAL` otherwise.
fn refuse_create<T>(context: *mut IbvContext) -> *mut T {
    set_errno(if context_at(context).is_some() {
        libc::EOPNOTSUPP
    } else {
        libc::EINVAL
    });
    std::ptr::null_mut()
}

/// NULL with `errno = EINVAL`: the object named is not one of ours.
fn refuse_on_object<T>() -> *mut T {
    set_errno(libc::EINVAL);
    std::ptr::null_mut()
}

/// `ibv_create_comp_channel(context)`: NULL, `EOPNOTSUPP` (not yet).
pub extern "C" fn ibv_create_comp_channel(context: *mut IbvContext) -> *mut IbvCompChannel {
    refuse_create(context)
}

/// `ibv_destroy_comp_channel(channel)`: `EINVAL` (no channel exists).
pub extern "C" fn ibv_destroy_comp_channel(_channel: *mut IbvCompChannel) -> c_int {
    libc::EINVAL
}

/// `ibv_create_cq(context, cqe, cq_context, channel, comp_vector)`: NULL,
/// `EOPNOTSUPP` (not yet).
pub extern "C" fn ibv_create_cq(
    context: *mut IbvContext,
    _cqe: c_int,
    _cq_context: *mut c_void,
    _channel: *mut IbvCompChannel,
    _comp_vector: c_int,
) -> *mut IbvCq {
    refuse_create(context)
}

/// `ibv_destroy_cq(cq)`: `EINVAL` (no CQ exists).
pub extern "C" fn ibv_destroy_cq(_cq: *mut IbvCq) -> c_int {
    libc::EINVAL
}

/// `ibv_get_cq_event(channel, cq, cq_context)`: -1, `errno = EINVAL` (no
/// channel exists).
pub extern "C" fn ibv_get_cq_event(
    _channel: *mut IbvCompChannel,
    _cq: *mut *mut IbvCq,
    _cq_context: *mut *mut c_void,
) -> c_int {
    set_errno(libc::EINVAL);
    -1
}

/// `ibv_ack_cq_events(cq, nevents)`: nothing to acknowledge (no CQ exists).
pub extern "C" fn ibv_ack_cq_events(_cq: *mut IbvCq, _nevents: u32) {}

/// `ibv_create_qp(pd, qp_init_attr)`: NULL, `EINVAL` (no PD exists).
pub extern "C" fn ibv_create_qp(_pd: *mut IbvPd, _init: *mut IbvQpInitAttr) -> *mut IbvQp {
    refuse_on_object()
}

/// `ibv_destroy_qp(qp)`: `EINVAL` (no QP exists).
pub extern "C" fn ibv_destroy_qp(_qp: *mut IbvQp) -> c_int {
    libc::EINVAL
}

/// `ibv_modify_qp(qp, attr, attr_mask)`: `EINVAL` (no QP exists).
pub extern "C" fn ibv_modify_qp(_qp: *mut IbvQp, _attr: *mut IbvQpAttr, _mask: c_int) -> c_int {
    libc::EINVAL
}

/// `ibv_query_qp(qp, attr, attr_mask, init_attr)`: `EINVAL` (no QP exists).
pub extern "C" fn ibv_query_qp(
    _qp: *mut IbvQp,
    _attr: *mut IbvQpAttr,
    _mask: c_int,
    _init: *mut IbvQpInitAttr,
) -> c_int {
    libc::EINVAL
}

/// `ibv_qp_to_qp_ex(qp)`: NULL (no QP of ours was made with the extended
/// send operations).
pub extern "C" fn ibv_qp_to_qp_ex(_qp: *mut IbvQp) -> *mut IbvQpEx {
    std::ptr::null_mut()
}

/// `ibv_create_srq(pd, srq_init_attr)`: NULL, `EINVAL` (no PD exists).
pub extern "C" fn ibv_create_srq(_pd: *mut IbvPd, _init: *mut IbvSrqInitAttr) -> *mut IbvSrq {
    refuse_on_object()
}

/// `ibv_destroy_srq(srq)`: `EINVAL` (no SRQ exists).
pub extern "C" fn ibv_destroy_srq(_srq: *mut IbvSrq) -> c_int {
    libc::EINVAL
}

/// `ibv_create_ah_from_wc(pd, wc, grh, port_num)`: NULL, `EINVAL` (no PD
/// exists).
pub extern "C" fn ibv_create_ah_from_wc(
    _pd: *mut IbvPd,
    _wc: *mut IbvWc,
    _grh: *mut c_void,
    _port_num: u8,
) -> *mut IbvAh {
    refuse_on_object()
}

/// `ibv_attach_mcast(qp, gid, lid)`: `EINVAL` (no QP exists).
pub extern "C" fn ibv_attach_mcast(_qp: *mut IbvQp, _gid: *const IbvGid, _lid: u16) -> c_int {
    libc::EINVAL
}

/// `ibv_detach_mcast(qp, gid, lid)`: `EINVAL` (no QP exists).
pub extern "C" fn ibv_detach_mcast(_qp: *mut IbvQp, _gid: *const IbvGid, _lid: u16) -> c_int {
    libc::EINVAL
}
