//! The entry points the surveyed tools import that this milestone does
//! not offer yet (docs/libibverbs.md, "Status"): address handles from
//! completions and multicast. The binaries are linked
//! `BIND_NOW`, so each must exist; each answers as rdma-core does for a
//! verb the device refuses.
//!
//! The rule: `ibv_create_ah_from_wc` and multicast on a QP fail with
//! `EINVAL`. Errors come back the way each verb reports
//! them: NULL with `errno`, -1 with `errno`, or an errno value.

use std::ffi::{c_int, c_void};

use ibverbs_abi::{IbvAh, IbvGid, IbvPd, IbvQp, IbvQpEx, IbvWc};

use crate::util::set_errno;

/// NULL with `errno = EINVAL`: the object named is not one of ours.
fn refuse_on_object<T>() -> *mut T {
    set_errno(libc::EINVAL);
    std::ptr::null_mut()
}

/// `ibv_qp_to_qp_ex(qp)`: NULL (no QP of ours was made with the extended
/// send operations).
pub extern "C" fn ibv_qp_to_qp_ex(_qp: *mut IbvQp) -> *mut IbvQpEx {
    std::ptr::null_mut()
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
