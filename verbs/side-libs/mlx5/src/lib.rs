//! `libmlx5.so.1` for perftest: the mlx5 direct-verbs entry points its
//! binaries link, each answering "not supported".
//!
//! perftest calls them only for Mellanox/NVIDIA devices it recognises by
//! `vendor_part_id` and for `--aes_xts` or connection type `DC`; our device
//! is not one (docs/libibverbs.md), so on its default paths none is called.
//! They exist so the `BIND_NOW` binaries load, and answer as rdma-core's
//! libmlx5 does for a device that is not an mlx5 one: the pointer-returning
//! ones NULL with `errno = EOPNOTSUPP`, the `int` ones `EOPNOTSUPP` (libmlx5
//! returns errno values) with `errno` set too.

use core::ffi::{c_int, c_void};

use ibverbs_abi::{IbvContext, IbvDevice, IbvQp, IbvQpEx, IbvQpInitAttrEx};
use verbs_side_support::{EOPNOTSUPP, export_versioned, set_errno};

/// A null pointer of any type, with `errno = EOPNOTSUPP`.
fn unsupported_null<T>() -> *mut T {
    set_errno(EOPNOTSUPP);
    core::ptr::null_mut()
}

/// `EOPNOTSUPP` as libmlx5's `int` entry points return it, `errno` set too.
fn unsupported_status() -> c_int {
    set_errno(EOPNOTSUPP);
    EOPNOTSUPP
}

/// `mlx5dv_open_device(device, attr)`: no device here is an mlx5 device.
extern "C" fn open_device(_device: *mut IbvDevice, _attr: *mut c_void) -> *mut IbvContext {
    unsupported_null()
}

/// `mlx5dv_create_qp(context, qp_attr, mlx5_qp_attr)`.
extern "C" fn create_qp(
    _context: *mut IbvContext,
    _qp_attr: *mut IbvQpInitAttrEx,
    _mlx5_qp_attr: *mut c_void,
) -> *mut IbvQp {
    unsupported_null()
}

/// `mlx5dv_devx_general_cmd(context, in, inlen, out, outlen)`.
extern "C" fn devx_general_cmd(
    _context: *mut IbvContext,
    _input: *const c_void,
    _input_len: usize,
    _output: *mut c_void,
    _output_len: usize,
) -> c_int {
    unsupported_status()
}

/// `mlx5dv_create_mkey(mkey_init_attr)`.
extern "C" fn create_mkey(_mkey_init_attr: *mut c_void) -> *mut c_void {
    unsupported_null()
}

/// `mlx5dv_destroy_mkey(mkey)`: no mkey was ever created.
extern "C" fn destroy_mkey(_mkey: *mut c_void) -> c_int {
    unsupported_status()
}

/// `mlx5dv_qp_ex_from_ibv_qp_ex(qp)`: NULL, no QP of ours is an mlx5 QP.
extern "C" fn qp_ex_from_ibv_qp_ex(_qp: *mut IbvQpEx) -> *mut c_void {
    unsupported_null()
}

/// `mlx5dv_crypto_login(context, login_attr)`.
extern "C" fn crypto_login(_context: *mut IbvContext, _login_attr: *mut c_void) -> c_int {
    unsupported_status()
}

/// `mlx5dv_dek_create(context, init_attr)`.
extern "C" fn dek_create(_context: *mut IbvContext, _init_attr: *mut c_void) -> *mut c_void {
    unsupported_null()
}

/// `mlx5dv_dek_destroy(dek)`: no key was ever created.
extern "C" fn dek_destroy(_dek: *mut c_void) -> c_int {
    unsupported_status()
}

export_versioned! {
    "mlx5dv_create_qp" => create_qp;
    "mlx5dv_open_device" => open_device;
    "mlx5dv_devx_general_cmd" => devx_general_cmd;
    "mlx5dv_create_mkey" => create_mkey;
    "mlx5dv_destroy_mkey" => destroy_mkey;
    "mlx5dv_qp_ex_from_ibv_qp_ex" => qp_ex_from_ibv_qp_ex;
    "mlx5dv_crypto_login" => crypto_login;
    "mlx5dv_dek_create" => dek_create;
    "mlx5dv_dek_destroy" => dek_destroy;
}
