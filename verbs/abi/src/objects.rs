//! The verbs objects a program holds pointers to and reads fields of.

use core::ffi::{c_int, c_void};
use core::mem::size_of;

use crate::{
    IbvContext, IbvDataBuf, IbvMw, IbvMwBindInfo, IbvQpState, IbvQpType, IbvSge, IbvWq,
    PthreadCond, PthreadMutex,
};

/// `struct ibv_pd`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvPd {
    pub context: *mut IbvContext,
    pub handle: u32,
}
const _: () = assert!(size_of::<IbvPd>() == 16);

/// `struct ibv_mr`: programs read `lkey`, `rkey`, `addr` and `length`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvMr {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}
const _: () = assert!(size_of::<IbvMr>() == 48);

/// `struct ibv_comp_channel`: `fd` is a real descriptor programs poll.
#[repr(C)]
#[derive(Debug)]
pub struct IbvCompChannel {
    pub context: *mut IbvContext,
    pub fd: c_int,
    pub refcnt: c_int,
}
const _: () = assert!(size_of::<IbvCompChannel>() == 16);

/// `struct ibv_cq`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvCq {
    pub context: *mut IbvContext,
    pub channel: *mut IbvCompChannel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    /// The CQ's actual capacity (at least what was asked).
    pub cqe: c_int,
    pub mutex: PthreadMutex,
    pub cond: PthreadCond,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}
const _: () = assert!(size_of::<IbvCq>() == 32 + size_of::<PthreadMutex>() + 48 + 8);

/// `struct ibv_qp`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvQp {
    pub context: *mut IbvContext,
    pub qp_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: IbvQpState,
    pub qp_type: IbvQpType,
    pub mutex: PthreadMutex,
    pub cond: PthreadCond,
    pub events_completed: u32,
}
const _: () = assert!(size_of::<IbvQp>() == 64 + size_of::<PthreadMutex>() + 48 + 8);

/// `struct ibv_async_event`'s `element`: the object the event is about
/// (which member is meant follows from `event_type`).
#[repr(C)]
#[derive(Clone, Copy)]
pub union IbvAsyncEventElement {
    pub cq: *mut IbvCq,
    pub qp: *mut IbvQp,
    pub srq: *mut IbvSrq,
    pub wq: *mut IbvWq,
    pub port_num: c_int,
}

impl core::fmt::Debug for IbvAsyncEventElement {
    /// Opaque: which member is meant depends on the event type.
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("IbvAsyncEventElement { .. }")
    }
}

/// `struct ibv_async_event` (`ibv_get_async_event`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvAsyncEvent {
    pub element: IbvAsyncEventElement,
    /// [`IbvEventType`](crate::IbvEventType).
    pub event_type: u32,
}
const _: () = assert!(size_of::<IbvAsyncEvent>() == 16);

/// `struct ibv_srq`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvSrq {
    pub context: *mut IbvContext,
    pub srq_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub handle: u32,
    pub mutex: PthreadMutex,
    pub cond: PthreadCond,
    pub events_completed: u32,
}
const _: () = assert!(size_of::<IbvSrq>() == 32 + size_of::<PthreadMutex>() + 48 + 8);

/// `struct ibv_ah`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvAh {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub handle: u32,
}
const _: () = assert!(size_of::<IbvAh>() == 24);

/// `struct ibv_qp_ex`: the new post-send API's function table, embedding the
/// QP. Reached only through `ibv_qp_to_qp_ex` on a QP created with
/// `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS` (not on any default path of the
/// surveyed tools, docs/libibverbs.md).
#[repr(C)]
#[derive(Debug)]
pub struct IbvQpEx {
    pub qp_base: IbvQp,
    pub comp_mask: u64,
    pub wr_id: u64,
    pub wr_flags: u32,
    pub wr_atomic_cmp_swp: Option<
        unsafe extern "C" fn(
            qp: *mut IbvQpEx,
            rkey: u32,
            remote_addr: u64,
            compare: u64,
            swap: u64,
        ),
    >,
    pub wr_atomic_fetch_add:
        Option<unsafe extern "C" fn(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64, add: u64)>,
    pub wr_bind_mw: Option<
        unsafe extern "C" fn(
            qp: *mut IbvQpEx,
            mw: *mut IbvMw,
            rkey: u32,
            bind_info: *const IbvMwBindInfo,
        ),
    >,
    pub wr_local_inv: Option<unsafe extern "C" fn(qp: *mut IbvQpEx, invalidate_rkey: u32)>,
    pub wr_rdma_read: Option<unsafe extern "C" fn(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64)>,
    pub wr_rdma_write: Option<unsafe extern "C" fn(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64)>,
    /// `imm_data` is big-endian (`__be32`).
    pub wr_rdma_write_imm:
        Option<unsafe extern "C" fn(qp: *mut IbvQpEx, rkey: u32, remote_addr: u64, imm_data: u32)>,
    pub wr_send: Option<unsafe extern "C" fn(qp: *mut IbvQpEx)>,
    /// `imm_data` is big-endian (`__be32`).
    pub wr_send_imm: Option<unsafe extern "C" fn(qp: *mut IbvQpEx, imm_data: u32)>,
    pub wr_send_inv: Option<unsafe extern "C" fn(qp: *mut IbvQpEx, invalidate_rkey: u32)>,
    pub wr_send_tso:
        Option<unsafe extern "C" fn(qp: *mut IbvQpEx, hdr: *mut c_void, hdr_sz: u16, mss: u16)>,
    pub wr_set_ud_addr: Option<
        unsafe extern "C" fn(qp: *mut IbvQpEx, ah: *mut IbvAh, remote_qpn: u32, remote_qkey: u32),
    >,
    pub wr_set_xrc_srqn: Option<unsafe extern "C" fn(qp: *mut IbvQpEx, remote_srqn: u32)>,
    pub wr_set_inline_data:
        Option<unsafe extern "C" fn(qp: *mut IbvQpEx, addr: *mut c_void, length: usize)>,
    pub wr_set_inline_data_list:
        Option<unsafe extern "C" fn(qp: *mut IbvQpEx, num_buf: usize, buf_list: *const IbvDataBuf)>,
    pub wr_set_sge:
        Option<unsafe extern "C" fn(qp: *mut IbvQpEx, lkey: u32, addr: u64, length: u32)>,
    pub wr_set_sge_list:
        Option<unsafe extern "C" fn(qp: *mut IbvQpEx, num_sge: usize, sg_list: *const IbvSge)>,
    pub wr_start: Option<unsafe extern "C" fn(qp: *mut IbvQpEx)>,
    pub wr_complete: Option<unsafe extern "C" fn(qp: *mut IbvQpEx) -> c_int>,
    pub wr_abort: Option<unsafe extern "C" fn(qp: *mut IbvQpEx)>,
    pub wr_atomic_write: Option<
        unsafe extern "C" fn(
            qp: *mut IbvQpEx,
            rkey: u32,
            remote_addr: u64,
            atomic_wr: *const c_void,
        ),
    >,
}
const _: () = assert!(size_of::<IbvQpEx>() == size_of::<IbvQp>() + 24 + 21 * 8);
