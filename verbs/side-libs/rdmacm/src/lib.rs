//! `librdmacm.so.1` for perftest: the RDMA connection manager entry points
//! its binaries link, each answering "not supported".
//!
//! perftest uses the connection manager only with `-R`/`--rdma_cm`; its
//! default mode exchanges QP addresses over its own TCP socket
//! (docs/libibverbs.md), so none of these is called. This stack provides no
//! connection manager: every `int` entry point returns -1 with
//! `errno = ENOSYS` (librdmacm's convention for failures),
//! `rdma_create_event_channel` returns NULL with `errno = ENOSYS`, and the
//! release functions have nothing to release. `rdma_event_str` is a pure
//! function of the event number and answers as librdmacm's does.

use core::ffi::{c_char, c_int, c_void};

use ibverbs_abi::{IbvPd, IbvQpInitAttr, IbvQpInitAttrEx};
use verbs_side_support::{ENOSYS, export_versioned, set_errno};

/// librdmacm's failure: -1 with `errno` set.
fn unsupported() -> c_int {
    set_errno(ENOSYS);
    -1
}

/// `rdma_create_event_channel()`: NULL, `errno = ENOSYS`.
extern "C" fn create_event_channel() -> *mut c_void {
    set_errno(ENOSYS);
    core::ptr::null_mut()
}

/// `rdma_destroy_event_channel(channel)`: no channel was ever created.
extern "C" fn destroy_event_channel(_channel: *mut c_void) {}

/// `rdma_create_id(channel, id, context, ps)`.
extern "C" fn create_id(
    _channel: *mut c_void,
    _id: *mut *mut c_void,
    _context: *mut c_void,
    _ps: u32,
) -> c_int {
    unsupported()
}

/// `rdma_destroy_id(id)`.
extern "C" fn destroy_id(_id: *mut c_void) -> c_int {
    unsupported()
}

/// `rdma_bind_addr(id, addr)`.
extern "C" fn bind_addr(_id: *mut c_void, _addr: *mut c_void) -> c_int {
    unsupported()
}

/// `rdma_resolve_addr(id, src_addr, dst_addr, timeout_ms)`.
extern "C" fn resolve_addr(
    _id: *mut c_void,
    _src: *mut c_void,
    _dst: *mut c_void,
    _timeout_ms: c_int,
) -> c_int {
    unsupported()
}

/// `rdma_resolve_route(id, timeout_ms)`.
extern "C" fn resolve_route(_id: *mut c_void, _timeout_ms: c_int) -> c_int {
    unsupported()
}

/// `rdma_create_qp(id, pd, qp_init_attr)`.
extern "C" fn create_qp(
    _id: *mut c_void,
    _pd: *mut IbvPd,
    _qp_init_attr: *mut IbvQpInitAttr,
) -> c_int {
    unsupported()
}

/// `rdma_create_qp_ex(id, qp_init_attr)`.
extern "C" fn create_qp_ex(_id: *mut c_void, _qp_init_attr: *mut IbvQpInitAttrEx) -> c_int {
    unsupported()
}

/// `rdma_destroy_qp(id)`: no QP was ever created through an id.
extern "C" fn destroy_qp(_id: *mut c_void) {}

/// `rdma_connect(id, conn_param)`.
extern "C" fn connect(_id: *mut c_void, _conn_param: *mut c_void) -> c_int {
    unsupported()
}

/// `rdma_listen(id, backlog)`.
extern "C" fn listen(_id: *mut c_void, _backlog: c_int) -> c_int {
    unsupported()
}

/// `rdma_accept(id, conn_param)`.
extern "C" fn accept(_id: *mut c_void, _conn_param: *mut c_void) -> c_int {
    unsupported()
}

/// `rdma_reject(id, private_data, private_data_len)`.
extern "C" fn reject(
    _id: *mut c_void,
    _private_data: *const c_void,
    _private_data_len: u8,
) -> c_int {
    unsupported()
}

/// `rdma_disconnect(id)`.
extern "C" fn disconnect(_id: *mut c_void) -> c_int {
    unsupported()
}

/// `rdma_get_cm_event(channel, event)`.
extern "C" fn get_cm_event(_channel: *mut c_void, _event: *mut *mut c_void) -> c_int {
    unsupported()
}

/// `rdma_ack_cm_event(event)`.
extern "C" fn ack_cm_event(_event: *mut c_void) -> c_int {
    unsupported()
}

/// `rdma_set_option(id, level, optname, optval, optlen)`.
extern "C" fn set_option(
    _id: *mut c_void,
    _level: c_int,
    _optname: c_int,
    _optval: *mut c_void,
    _optlen: usize,
) -> c_int {
    unsupported()
}

/// `rdma_getaddrinfo(node, service, hints, res)`: `*res` is left alone.
extern "C" fn getaddrinfo(
    _node: *const c_char,
    _service: *const c_char,
    _hints: *const c_void,
    _res: *mut *mut c_void,
) -> c_int {
    unsupported()
}

/// `rdma_freeaddrinfo(res)`: `rdma_getaddrinfo` never returned a list.
extern "C" fn freeaddrinfo(_res: *mut c_void) {}

/// `enum rdma_cm_event_type`'s names, in the enum's order.
const EVENT_NAMES: [&core::ffi::CStr; 16] = [
    c"RDMA_CM_EVENT_ADDR_RESOLVED",
    c"RDMA_CM_EVENT_ADDR_ERROR",
    c"RDMA_CM_EVENT_ROUTE_RESOLVED",
    c"RDMA_CM_EVENT_ROUTE_ERROR",
    c"RDMA_CM_EVENT_CONNECT_REQUEST",
    c"RDMA_CM_EVENT_CONNECT_RESPONSE",
    c"RDMA_CM_EVENT_CONNECT_ERROR",
    c"RDMA_CM_EVENT_UNREACHABLE",
    c"RDMA_CM_EVENT_REJECTED",
    c"RDMA_CM_EVENT_ESTABLISHED",
    c"RDMA_CM_EVENT_DISCONNECTED",
    c"RDMA_CM_EVENT_DEVICE_REMOVAL",
    c"RDMA_CM_EVENT_MULTICAST_JOIN",
    c"RDMA_CM_EVENT_MULTICAST_ERROR",
    c"RDMA_CM_EVENT_ADDR_CHANGE",
    c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
];

/// `rdma_event_str(event)`: the event's name, `"UNKNOWN EVENT"` for a
/// number outside the enum.
extern "C" fn event_str(event: u32) -> *const c_char {
    usize::try_from(event)
        .ok()
        .and_then(|index| EVENT_NAMES.get(index))
        .copied()
        .unwrap_or(c"UNKNOWN EVENT")
        .as_ptr()
}

export_versioned! {
    "rdma_accept" => accept;
    "rdma_ack_cm_event" => ack_cm_event;
    "rdma_bind_addr" => bind_addr;
    "rdma_connect" => connect;
    "rdma_create_event_channel" => create_event_channel;
    "rdma_create_id" => create_id;
    "rdma_create_qp" => create_qp;
    "rdma_create_qp_ex" => create_qp_ex;
    "rdma_destroy_event_channel" => destroy_event_channel;
    "rdma_destroy_id" => destroy_id;
    "rdma_destroy_qp" => destroy_qp;
    "rdma_disconnect" => disconnect;
    "rdma_event_str" => event_str;
    "rdma_freeaddrinfo" => freeaddrinfo;
    "rdma_get_cm_event" => get_cm_event;
    "rdma_getaddrinfo" => getaddrinfo;
    "rdma_listen" => listen;
    "rdma_reject" => reject;
    "rdma_resolve_addr" => resolve_addr;
    "rdma_resolve_route" => resolve_route;
    "rdma_set_option" => set_option;
}
