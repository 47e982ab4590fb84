//! `libefa.so.1` for perftest: the EFA direct-verbs entry points its
//! binaries link, each answering "not supported".
//!
//! perftest calls them only for connection type `SRD` (and for an EFA device
//! it recognises by `vendor_part_id`); our device is not one
//! (docs/libibverbs.md). They answer as rdma-core's libefa does for a
//! device that is not an EFA one.

use core::ffi::{c_int, c_void};

use ibverbs_abi::{IbvContext, IbvQp, IbvQpInitAttrEx};
use verbs_side_support::{EOPNOTSUPP, export_versioned, set_errno};

/// `efadv_query_device(context, attr, inlen)`: `EOPNOTSUPP` (libefa
/// returns errno values), `errno` set too.
extern "C" fn query_device(_context: *mut IbvContext, _attr: *mut c_void, _attr_len: u32) -> c_int {
    set_errno(EOPNOTSUPP);
    EOPNOTSUPP
}

/// `efadv_create_qp_ex(context, attr_ex, efa_attr, inlen)`: NULL with
/// `errno = EOPNOTSUPP`.
extern "C" fn create_qp_ex(
    _context: *mut IbvContext,
    _attr_ex: *mut IbvQpInitAttrEx,
    _efa_attr: *mut c_void,
    _efa_attr_len: u32,
) -> *mut IbvQp {
    set_errno(EOPNOTSUPP);
    core::ptr::null_mut()
}

export_versioned! {
    "efadv_query_device" => query_device;
    "efadv_create_qp_ex" => create_qp_ex;
}
