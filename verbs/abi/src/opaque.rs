//! Types the mirrored structs only point to: their layout is not part of
//! what the surveyed tools read, so they stay opaque (never constructed,
//! only named behind pointers).

macro_rules! opaque {
    ($($(#[$doc:meta])* $name:ident;)*) => {$(
        $(#[$doc])*
        #[repr(C)]
        #[derive(Debug)]
        pub struct $name {
            _opaque: [u8; 0],
        }
    )*};
}

opaque! {
    /// `struct ibv_mw`.
    IbvMw;
    /// `struct ibv_mw_bind`.
    IbvMwBind;
    /// `struct ibv_xrcd`.
    IbvXrcd;
    /// `struct ibv_xrcd_init_attr`.
    IbvXrcdInitAttr;
    /// `struct ibv_counters`.
    IbvCounters;
    /// `struct ibv_counters_init_attr`.
    IbvCountersInitAttr;
    /// `struct ibv_counter_attach_attr`.
    IbvCounterAttachAttr;
    /// `struct ibv_flow`.
    IbvFlow;
    /// `struct ibv_flow_attr`.
    IbvFlowAttr;
    /// `struct ibv_flow_action`.
    IbvFlowAction;
    /// `struct ibv_flow_action_esp_attr`.
    IbvFlowActionEspAttr;
    /// `struct ibv_dm`.
    IbvDm;
    /// `struct ibv_alloc_dm_attr`.
    IbvAllocDmAttr;
    /// `struct ibv_qp_rate_limit_attr`.
    IbvQpRateLimitAttr;
    /// `struct ibv_parent_domain_init_attr`.
    IbvParentDomainInitAttr;
    /// `struct ibv_td`.
    IbvTd;
    /// `struct ibv_td_init_attr`.
    IbvTdInitAttr;
    /// `struct ibv_modify_cq_attr`.
    IbvModifyCqAttr;
    /// `struct ibv_ops_wr`.
    IbvOpsWr;
    /// `struct ibv_rwq_ind_table`.
    IbvRwqIndTable;
    /// `struct ibv_rwq_ind_table_init_attr`.
    IbvRwqIndTableInitAttr;
    /// `struct ibv_wq`.
    IbvWq;
    /// `struct ibv_wq_attr`.
    IbvWqAttr;
    /// `struct ibv_wq_init_attr`.
    IbvWqInitAttr;
    /// `struct ibv_values_ex`.
    IbvValuesEx;
    /// `struct ibv_cq_ex` (timestamps, `ibv_rc_pingpong -t`: not on a default path).
    IbvCqEx;
    /// `struct ibv_cq_init_attr_ex`.
    IbvCqInitAttrEx;
    /// `struct verbs_ex_private` (rdma-core's own, never read by programs).
    VerbsExPrivate;
    /// `struct ibv_qp_open_attr`.
    IbvQpOpenAttr;
    /// `struct ibv_srq_init_attr_ex`.
    IbvSrqInitAttrEx;
    /// `struct ibv_data_buf`.
    IbvDataBuf;
    /// `struct _compat_ibv_port_attr` (the pre-1.1 port attribute).
    CompatIbvPortAttr;
}
