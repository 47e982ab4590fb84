//! `libibumad.so.3` for perftest: the MAD library entry points `ib_send_bw`
//! and `ib_send_lat` link, answering "not supported".
//!
//! perftest sends MADs only to join a multicast group (`--mcg`), which this
//! stack does not support through user MADs (docs/libibverbs.md): nothing
//! here is called in the default modes. The port and agent entry points
//! return `-EOPNOTSUPP` (libibumad returns negative errno values) with
//! `errno` set too. `umad_size` and `umad_get_mad` are pure layout
//! arithmetic and answer with the current kernel ABI's (version 5) layout of
//! `struct ib_user_mad`: a 64-byte header followed by the MAD.

use core::ffi::{c_char, c_int, c_void};

use verbs_side_support::{EOPNOTSUPP, export_versioned, set_errno};

/// `sizeof(struct ib_user_mad)`: five `u32`s (agent id, status, timeout,
/// retries, length) and the 44-byte `ib_mad_addr`.
const USER_MAD_HEADER_LEN: usize = 5 * 4 + 44;

/// libibumad's failure: `-EOPNOTSUPP`, `errno` set too.
fn unsupported() -> c_int {
    set_errno(EOPNOTSUPP);
    -EOPNOTSUPP
}

/// `umad_init()`: there is no user MAD device.
extern "C" fn init() -> c_int {
    unsupported()
}

/// `umad_open_port(ca_name, portnum)`.
extern "C" fn open_port(_ca_name: *const c_char, _portnum: c_int) -> c_int {
    unsupported()
}

/// `umad_close_port(portid)`.
extern "C" fn close_port(_portid: c_int) -> c_int {
    unsupported()
}

/// `umad_register(portid, mgmt_class, mgmt_version, rmpp_version, method_mask)`.
extern "C" fn register(
    _portid: c_int,
    _mgmt_class: c_int,
    _mgmt_version: c_int,
    _rmpp_version: u8,
    _method_mask: *mut u64,
) -> c_int {
    unsupported()
}

/// `umad_unregister(portid, agentid)`.
extern "C" fn unregister(_portid: c_int, _agentid: c_int) -> c_int {
    unsupported()
}

/// `umad_send(portid, agentid, umad, length, timeout_ms, retries)`.
extern "C" fn send(
    _portid: c_int,
    _agentid: c_int,
    _umad: *mut c_void,
    _length: c_int,
    _timeout_ms: c_int,
    _retries: c_int,
) -> c_int {
    unsupported()
}

/// `umad_recv(portid, umad, length, timeout_ms)`.
extern "C" fn recv(
    _portid: c_int,
    _umad: *mut c_void,
    _length: *mut c_int,
    _timeout_ms: c_int,
) -> c_int {
    unsupported()
}

/// `umad_set_addr(umad, dlid, dqp, sl, qkey)`.
extern "C" fn set_addr(
    _umad: *mut c_void,
    _dlid: c_int,
    _dqp: c_int,
    _sl: c_int,
    _qkey: c_int,
) -> c_int {
    unsupported()
}

/// `umad_set_pkey(umad, pkey_index)`.
extern "C" fn set_pkey(_umad: *mut c_void, _pkey_index: c_int) -> c_int {
    unsupported()
}

/// `umad_size()`: the header callers allocate before the MAD.
extern "C" fn size() -> usize {
    USER_MAD_HEADER_LEN
}

/// `umad_get_mad(umad)`: the MAD after the header (address arithmetic only,
/// the buffer is not read).
extern "C" fn get_mad(umad: *mut c_void) -> *mut c_void {
    umad.cast::<u8>().wrapping_add(USER_MAD_HEADER_LEN).cast()
}

export_versioned! {
    "umad_close_port" => close_port;
    "umad_get_mad" => get_mad;
    "umad_init" => init;
    "umad_open_port" => open_port;
    "umad_recv" => recv;
    "umad_register" => register;
    "umad_send" => send;
    "umad_set_addr" => set_addr;
    "umad_set_pkey" => set_pkey;
    "umad_size" => size;
    "umad_unregister" => unregister;
}
