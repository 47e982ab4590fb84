//! The device, the context and its operation tables.
//!
//! A program reaches the data-path verbs through `ibv_context.ops` (the
//! `ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq` and
//! `ibv_req_notify_cq` inlines) and the extended verbs through the
//! [`VerbsContext`] that rdma-core places immediately before the
//! `ibv_context` (`verbs_get_ctx`: `abi_compat` must be
//! [`VERBS_ABI_IS_EXTENDED`](crate::VERBS_ABI_IS_EXTENDED), `sz` must reach
//! the member, and the member must be non-NULL).

use core::ffi::{c_char, c_int, c_void};
use core::mem::{offset_of, size_of};

use crate::{
    CompatIbvPortAttr, IBV_SYSFS_NAME_MAX, IBV_SYSFS_PATH_MAX, IbvAllocDmAttr,
    IbvCounterAttachAttr, IbvCounters, IbvCountersInitAttr, IbvCq, IbvCqEx, IbvCqInitAttrEx,
    IbvDeviceAttr, IbvDeviceAttrEx, IbvDm, IbvFlow, IbvFlowAction, IbvFlowActionEspAttr,
    IbvFlowAttr, IbvModifyCqAttr, IbvMr, IbvMw, IbvMwBind, IbvNodeType, IbvOpsWr,
    IbvParentDomainInitAttr, IbvPd, IbvPortAttr, IbvQp, IbvQpInitAttrEx, IbvQpOpenAttr,
    IbvQpRateLimitAttr, IbvQueryDeviceExInput, IbvRecvWr, IbvRwqIndTable, IbvRwqIndTableInitAttr,
    IbvSendWr, IbvSge, IbvSrq, IbvSrqInitAttrEx, IbvTd, IbvTdInitAttr, IbvTransportType,
    IbvValuesEx, IbvWc, IbvWq, IbvWqAttr, IbvWqInitAttr, IbvXrcd, IbvXrcdInitAttr, PthreadMutex,
    VerbsExPrivate,
};

/// `struct _ibv_device_ops`: two slots rdma-core keeps for binary
/// compatibility and never calls.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvDeviceOps {
    pub _dummy1:
        Option<unsafe extern "C" fn(device: *mut IbvDevice, cmd_fd: c_int) -> *mut IbvContext>,
    pub _dummy2: Option<unsafe extern "C" fn(context: *mut IbvContext)>,
}
const _: () = assert!(size_of::<IbvDeviceOps>() == 16);

/// `struct ibv_device`: one entry of `ibv_get_device_list`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvDevice {
    pub _ops: IbvDeviceOps,
    pub node_type: IbvNodeType,
    pub transport_type: IbvTransportType,
    /// The device's name (`ibv_get_device_name`), NUL-terminated.
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    /// The uverbs character device's name (`uverbs0`).
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    /// The sysfs directory `ibv_devinfo` reads `board_id` from.
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}
const _: () = assert!(size_of::<IbvDevice>() == 664);

/// An operation slot rdma-core keeps only for binary compatibility
/// (`void *(*_compat_xxx)(void)`): never called through by programs.
pub type CompatSlot = Option<unsafe extern "C" fn() -> *mut c_void>;

/// `struct ibv_context_ops`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvContextOps {
    pub _compat_query_device: Option<
        unsafe extern "C" fn(context: *mut IbvContext, device_attr: *mut IbvDeviceAttr) -> c_int,
    >,
    pub _compat_query_port: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            port_num: u8,
            port_attr: *mut CompatIbvPortAttr,
        ) -> c_int,
    >,
    pub _compat_alloc_pd: CompatSlot,
    pub _compat_dealloc_pd: CompatSlot,
    pub _compat_reg_mr: CompatSlot,
    pub _compat_rereg_mr: CompatSlot,
    pub _compat_dereg_mr: CompatSlot,
    pub alloc_mw: Option<unsafe extern "C" fn(pd: *mut IbvPd, mw_type: u32) -> *mut IbvMw>,
    pub bind_mw: Option<
        unsafe extern "C" fn(qp: *mut IbvQp, mw: *mut IbvMw, mw_bind: *mut IbvMwBind) -> c_int,
    >,
    pub dealloc_mw: Option<unsafe extern "C" fn(mw: *mut IbvMw) -> c_int>,
    pub _compat_create_cq: CompatSlot,
    /// `ibv_poll_cq`.
    pub poll_cq:
        Option<unsafe extern "C" fn(cq: *mut IbvCq, num_entries: c_int, wc: *mut IbvWc) -> c_int>,
    /// `ibv_req_notify_cq`.
    pub req_notify_cq: Option<unsafe extern "C" fn(cq: *mut IbvCq, solicited_only: c_int) -> c_int>,
    pub _compat_cq_event: CompatSlot,
    pub _compat_resize_cq: CompatSlot,
    pub _compat_destroy_cq: CompatSlot,
    pub _compat_create_srq: CompatSlot,
    pub _compat_modify_srq: CompatSlot,
    pub _compat_query_srq: CompatSlot,
    pub _compat_destroy_srq: CompatSlot,
    /// `ibv_post_srq_recv`.
    pub post_srq_recv: Option<
        unsafe extern "C" fn(
            srq: *mut IbvSrq,
            recv_wr: *mut IbvRecvWr,
            bad_recv_wr: *mut *mut IbvRecvWr,
        ) -> c_int,
    >,
    pub _compat_create_qp: CompatSlot,
    pub _compat_query_qp: CompatSlot,
    pub _compat_modify_qp: CompatSlot,
    pub _compat_destroy_qp: CompatSlot,
    /// `ibv_post_send`.
    pub post_send: Option<
        unsafe extern "C" fn(
            qp: *mut IbvQp,
            wr: *mut IbvSendWr,
            bad_wr: *mut *mut IbvSendWr,
        ) -> c_int,
    >,
    /// `ibv_post_recv`.
    pub post_recv: Option<
        unsafe extern "C" fn(
            qp: *mut IbvQp,
            wr: *mut IbvRecvWr,
            bad_wr: *mut *mut IbvRecvWr,
        ) -> c_int,
    >,
    pub _compat_create_ah: CompatSlot,
    pub _compat_destroy_ah: CompatSlot,
    pub _compat_attach_mcast: CompatSlot,
    pub _compat_detach_mcast: CompatSlot,
    pub _compat_async_event: CompatSlot,
}
const _: () = assert!(size_of::<IbvContextOps>() == 32 * 8);

/// `struct ibv_context`.
#[repr(C)]
#[derive(Debug)]
pub struct IbvContext {
    pub device: *mut IbvDevice,
    pub ops: IbvContextOps,
    pub cmd_fd: c_int,
    /// The descriptor `ibv_get_async_event` reads; programs poll it.
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: PthreadMutex,
    /// [`VERBS_ABI_IS_EXTENDED`](crate::VERBS_ABI_IS_EXTENDED) when a
    /// [`VerbsContext`] precedes this context.
    pub abi_compat: *mut c_void,
}
#[cfg(target_arch = "x86_64")]
const _: () = assert!(size_of::<IbvContext>() == 8 + 32 * 8 + 12 + 4 + 40 + 8);

/// `struct verbs_context`: the extended operations, laid out before (and
/// ending with) the `ibv_context` a program holds.
#[repr(C)]
#[derive(Debug)]
pub struct VerbsContext {
    /// `ibv_query_port` (the macro's `___ibv_query_port` calls it with
    /// `sizeof(struct ibv_port_attr)`).
    pub query_port: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            port_num: u8,
            port_attr: *mut IbvPortAttr,
            port_attr_len: usize,
        ) -> c_int,
    >,
    pub advise_mr: Option<
        unsafe extern "C" fn(
            pd: *mut IbvPd,
            advice: u32,
            flags: u32,
            sg_list: *mut IbvSge,
            num_sges: u32,
        ) -> c_int,
    >,
    pub alloc_null_mr: Option<unsafe extern "C" fn(pd: *mut IbvPd) -> *mut IbvMr>,
    pub read_counters: Option<
        unsafe extern "C" fn(
            counters: *mut IbvCounters,
            counters_value: *mut u64,
            ncounters: u32,
            flags: u32,
        ) -> c_int,
    >,
    pub attach_counters_point_flow: Option<
        unsafe extern "C" fn(
            counters: *mut IbvCounters,
            attr: *mut IbvCounterAttachAttr,
            flow: *mut IbvFlow,
        ) -> c_int,
    >,
    pub create_counters: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            init_attr: *mut IbvCountersInitAttr,
        ) -> *mut IbvCounters,
    >,
    pub destroy_counters: Option<unsafe extern "C" fn(counters: *mut IbvCounters) -> c_int>,
    pub reg_dm_mr: Option<
        unsafe extern "C" fn(
            pd: *mut IbvPd,
            dm: *mut IbvDm,
            dm_offset: u64,
            length: usize,
            access: u32,
        ) -> *mut IbvMr,
    >,
    pub alloc_dm: Option<
        unsafe extern "C" fn(context: *mut IbvContext, attr: *mut IbvAllocDmAttr) -> *mut IbvDm,
    >,
    pub free_dm: Option<unsafe extern "C" fn(dm: *mut IbvDm) -> c_int>,
    pub modify_flow_action_esp: Option<
        unsafe extern "C" fn(action: *mut IbvFlowAction, attr: *mut IbvFlowActionEspAttr) -> c_int,
    >,
    pub destroy_flow_action: Option<unsafe extern "C" fn(action: *mut IbvFlowAction) -> c_int>,
    pub create_flow_action_esp: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            attr: *mut IbvFlowActionEspAttr,
        ) -> *mut IbvFlowAction,
    >,
    pub modify_qp_rate_limit:
        Option<unsafe extern "C" fn(qp: *mut IbvQp, attr: *mut IbvQpRateLimitAttr) -> c_int>,
    pub alloc_parent_domain: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            attr: *mut IbvParentDomainInitAttr,
        ) -> *mut IbvPd,
    >,
    pub dealloc_td: Option<unsafe extern "C" fn(td: *mut IbvTd) -> c_int>,
    pub alloc_td: Option<
        unsafe extern "C" fn(context: *mut IbvContext, init_attr: *mut IbvTdInitAttr) -> *mut IbvTd,
    >,
    pub modify_cq:
        Option<unsafe extern "C" fn(cq: *mut IbvCq, attr: *mut IbvModifyCqAttr) -> c_int>,
    pub post_srq_ops: Option<
        unsafe extern "C" fn(
            srq: *mut IbvSrq,
            op: *mut IbvOpsWr,
            bad_op: *mut *mut IbvOpsWr,
        ) -> c_int,
    >,
    pub destroy_rwq_ind_table:
        Option<unsafe extern "C" fn(rwq_ind_table: *mut IbvRwqIndTable) -> c_int>,
    pub create_rwq_ind_table: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            init_attr: *mut IbvRwqIndTableInitAttr,
        ) -> *mut IbvRwqIndTable,
    >,
    pub destroy_wq: Option<unsafe extern "C" fn(wq: *mut IbvWq) -> c_int>,
    pub modify_wq: Option<unsafe extern "C" fn(wq: *mut IbvWq, wq_attr: *mut IbvWqAttr) -> c_int>,
    pub create_wq: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            wq_init_attr: *mut IbvWqInitAttr,
        ) -> *mut IbvWq,
    >,
    pub query_rt_values:
        Option<unsafe extern "C" fn(context: *mut IbvContext, values: *mut IbvValuesEx) -> c_int>,
    pub create_cq_ex: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            init_attr: *mut IbvCqInitAttrEx,
        ) -> *mut IbvCqEx,
    >,
    pub priv_: *mut VerbsExPrivate,
    /// `ibv_query_device_ex` (NULL: the inline falls back to `ibv_query_device`).
    pub query_device_ex: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            input: *const IbvQueryDeviceExInput,
            attr: *mut IbvDeviceAttrEx,
            attr_size: usize,
        ) -> c_int,
    >,
    pub ibv_destroy_flow: Option<unsafe extern "C" fn(flow: *mut IbvFlow) -> c_int>,
    pub abi_placeholder2: Option<unsafe extern "C" fn()>,
    pub ibv_create_flow:
        Option<unsafe extern "C" fn(qp: *mut IbvQp, flow_attr: *mut IbvFlowAttr) -> *mut IbvFlow>,
    pub abi_placeholder1: Option<unsafe extern "C" fn()>,
    pub open_qp: Option<
        unsafe extern "C" fn(context: *mut IbvContext, attr: *mut IbvQpOpenAttr) -> *mut IbvQp,
    >,
    /// `ibv_create_qp_ex` (NULL: the inline fails with `EOPNOTSUPP` unless
    /// the request is a plain `ibv_create_qp`).
    pub create_qp_ex: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            qp_init_attr_ex: *mut IbvQpInitAttrEx,
        ) -> *mut IbvQp,
    >,
    pub get_srq_num: Option<unsafe extern "C" fn(srq: *mut IbvSrq, srq_num: *mut u32) -> c_int>,
    pub create_srq_ex: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            srq_init_attr_ex: *mut IbvSrqInitAttrEx,
        ) -> *mut IbvSrq,
    >,
    pub open_xrcd: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            xrcd_init_attr: *mut IbvXrcdInitAttr,
        ) -> *mut IbvXrcd,
    >,
    pub close_xrcd: Option<unsafe extern "C" fn(xrcd: *mut IbvXrcd) -> c_int>,
    pub _abi_placeholder3: u64,
    /// The size of the `verbs_context` the library built
    /// (`size_of::<VerbsContext>()`): `verbs_get_ctx_op` treats a member as
    /// present when `sz >= size_of::<VerbsContext>() - offset_of!(member)`.
    pub sz: usize,
    /// The context programs hold.
    pub context: IbvContext,
}
const _: () = assert!(offset_of!(VerbsContext, context) == 40 * 8);
const _: () = assert!(
    size_of::<VerbsContext>() == offset_of!(VerbsContext, context) + size_of::<IbvContext>()
);
