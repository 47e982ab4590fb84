//! The entry points the surveyed tools import that this milestone does
//! not offer yet (docs/libibverbs.md, "Status"): multicast, and the
//! extended QP of the new post-send API. The binaries are linked
//! `BIND_NOW`, so each must exist; each answers as rdma-core does for a
//! verb the device refuses.
//!
//! The rule: multicast on a QP fails with `EINVAL`; no QP has the
//! extended post-send operations. Errors come back the way each verb reports
//! them: NULL with `errno`, -1 with `errno`, or an errno value.

use std::ffi::c_int;

use ibverbs_abi::{IbvGid, IbvQp, IbvQpEx};

/// `ibv_qp_to_qp_ex(qp)`: NULL (no QP of ours was made with the extended
/// send operations).
pub extern "C" fn ibv_qp_to_qp_ex(_qp: *mut IbvQp) -> *mut IbvQpEx {
    std::ptr::null_mut()
}

/// `ibv_attach_mcast(qp, gid, lid)`: `EINVAL` (multicast is not offered).
pub extern "C" fn ibv_attach_mcast(_qp: *mut IbvQp, _gid: *const IbvGid, _lid: u16) -> c_int {
    libc::EINVAL
}

/// `ibv_detach_mcast(qp, gid, lid)`: `EINVAL` (multicast is not offered).
pub extern "C" fn ibv_detach_mcast(_qp: *mut IbvQp, _gid: *const IbvGid, _lid: u16) -> c_int {
    libc::EINVAL
}
