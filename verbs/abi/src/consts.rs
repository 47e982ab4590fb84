//! verbs.h's enums and limits, under their C names.
//!
//! A C enum is an `int`-sized field in every struct that holds one; each has a
//! type alias here (`IbvQpType`, ...) naming which enum a field carries, and
//! its values as constants. Values a program hands in are open: a library
//! must check them, never assume they are in the lists below.

/// `enum ibv_node_type` (may be -1).
pub type IbvNodeType = i32;
pub const IBV_NODE_UNKNOWN: IbvNodeType = -1;
pub const IBV_NODE_CA: IbvNodeType = 1;
pub const IBV_NODE_SWITCH: IbvNodeType = 2;
pub const IBV_NODE_ROUTER: IbvNodeType = 3;
pub const IBV_NODE_RNIC: IbvNodeType = 4;
pub const IBV_NODE_USNIC: IbvNodeType = 5;
pub const IBV_NODE_USNIC_UDP: IbvNodeType = 6;
pub const IBV_NODE_UNSPECIFIED: IbvNodeType = 7;

/// `enum ibv_transport_type` (may be -1).
pub type IbvTransportType = i32;
pub const IBV_TRANSPORT_UNKNOWN: IbvTransportType = -1;
pub const IBV_TRANSPORT_IB: IbvTransportType = 0;
pub const IBV_TRANSPORT_IWARP: IbvTransportType = 1;
pub const IBV_TRANSPORT_USNIC: IbvTransportType = 2;
pub const IBV_TRANSPORT_USNIC_UDP: IbvTransportType = 3;
pub const IBV_TRANSPORT_UNSPECIFIED: IbvTransportType = 4;

/// Length of `ibv_device`'s `name` and `dev_name`.
pub const IBV_SYSFS_NAME_MAX: usize = 64;
/// Length of `ibv_device`'s `dev_path` and `ibdev_path`.
pub const IBV_SYSFS_PATH_MAX: usize = 256;

/// `__VERBS_ABI_IS_EXTENDED`: the `ibv_context.abi_compat` value that tells
/// `verbs_get_ctx` a `verbs_context` precedes the context.
pub const VERBS_ABI_IS_EXTENDED: usize = usize::MAX;

/// `enum ibv_atomic_cap`.
pub type IbvAtomicCap = u32;
pub const IBV_ATOMIC_NONE: IbvAtomicCap = 0;
pub const IBV_ATOMIC_HCA: IbvAtomicCap = 1;
pub const IBV_ATOMIC_GLOB: IbvAtomicCap = 2;

/// `enum ibv_mtu`.
pub type IbvMtu = u32;
pub const IBV_MTU_256: IbvMtu = 1;
pub const IBV_MTU_512: IbvMtu = 2;
pub const IBV_MTU_1024: IbvMtu = 3;
pub const IBV_MTU_2048: IbvMtu = 4;
pub const IBV_MTU_4096: IbvMtu = 5;

/// `enum ibv_port_state`.
pub type IbvPortState = u32;
pub const IBV_PORT_NOP: IbvPortState = 0;
pub const IBV_PORT_DOWN: IbvPortState = 1;
pub const IBV_PORT_INIT: IbvPortState = 2;
pub const IBV_PORT_ARMED: IbvPortState = 3;
pub const IBV_PORT_ACTIVE: IbvPortState = 4;
pub const IBV_PORT_ACTIVE_DEFER: IbvPortState = 5;

/// `ibv_port_attr.link_layer` values (an anonymous enum, stored in a `u8`).
pub const IBV_LINK_LAYER_UNSPECIFIED: u8 = 0;
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

/// `ibv_port_attr.port_cap_flags`: the port supports IP-based GIDs (RoCE).
pub const IBV_PORT_IP_BASED_GIDS: u32 = 1 << 26;
/// `ibv_port_attr.port_cap_flags`: the port runs a connection manager.
pub const IBV_PORT_CM_SUP: u32 = 1 << 16;

/// `enum ibv_gid_type` (`ibv_gid_entry.gid_type`).
pub type IbvGidType = u32;
pub const IBV_GID_TYPE_IB: IbvGidType = 0;
pub const IBV_GID_TYPE_ROCE_V1: IbvGidType = 1;
pub const IBV_GID_TYPE_ROCE_V2: IbvGidType = 2;

/// `enum ibv_gid_type_sysfs`: what `ibv_query_gid_type@IBVERBS_PRIVATE_34`
/// reports. It lives in rdma-core's private `driver.h` (v44.0), which no
/// Debian package installs, so the layout test cannot check these two.
pub type IbvGidTypeSysfs = u32;
pub const IBV_GID_TYPE_SYSFS_IB_ROCE_V1: IbvGidTypeSysfs = 0;
pub const IBV_GID_TYPE_SYSFS_ROCE_V2: IbvGidTypeSysfs = 1;

/// `enum ibv_access_flags`.
pub const IBV_ACCESS_LOCAL_WRITE: u32 = 1;
pub const IBV_ACCESS_REMOTE_WRITE: u32 = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: u32 = 1 << 2;
pub const IBV_ACCESS_REMOTE_ATOMIC: u32 = 1 << 3;
pub const IBV_ACCESS_MW_BIND: u32 = 1 << 4;
pub const IBV_ACCESS_ZERO_BASED: u32 = 1 << 5;
pub const IBV_ACCESS_ON_DEMAND: u32 = 1 << 6;
pub const IBV_ACCESS_HUGETLB: u32 = 1 << 7;
/// The first optional access bit: a provider may ignore optional bits.
pub const IBV_ACCESS_OPTIONAL_FIRST: u32 = 1 << 20;
/// Every optional access bit (bits 20..29). `ibv_reg_mr` sends flags with any
/// of these through `ibv_reg_mr_iova2`.
pub const IBV_ACCESS_OPTIONAL_RANGE: u32 = ((1 << 30) - 1) & !(IBV_ACCESS_OPTIONAL_FIRST - 1);
pub const IBV_ACCESS_RELAXED_ORDERING: u32 = IBV_ACCESS_OPTIONAL_FIRST;

/// `enum ibv_qp_type`.
pub type IbvQpType = u32;
pub const IBV_QPT_RC: IbvQpType = 2;
pub const IBV_QPT_UC: IbvQpType = 3;
pub const IBV_QPT_UD: IbvQpType = 4;
pub const IBV_QPT_RAW_PACKET: IbvQpType = 8;
pub const IBV_QPT_XRC_SEND: IbvQpType = 9;
pub const IBV_QPT_XRC_RECV: IbvQpType = 10;
pub const IBV_QPT_DRIVER: IbvQpType = 0xff;

/// `enum ibv_qp_state`.
pub type IbvQpState = u32;
pub const IBV_QPS_RESET: IbvQpState = 0;
pub const IBV_QPS_INIT: IbvQpState = 1;
pub const IBV_QPS_RTR: IbvQpState = 2;
pub const IBV_QPS_RTS: IbvQpState = 3;
pub const IBV_QPS_SQD: IbvQpState = 4;
pub const IBV_QPS_SQE: IbvQpState = 5;
pub const IBV_QPS_ERR: IbvQpState = 6;
pub const IBV_QPS_UNKNOWN: IbvQpState = 7;

/// `enum ibv_mig_state`.
pub type IbvMigState = u32;
pub const IBV_MIG_MIGRATED: IbvMigState = 0;
pub const IBV_MIG_REARM: IbvMigState = 1;
pub const IBV_MIG_ARMED: IbvMigState = 2;

/// `enum ibv_qp_attr_mask` (`ibv_modify_qp`'s and `ibv_query_qp`'s mask).
pub const IBV_QP_STATE: u32 = 1 << 0;
pub const IBV_QP_CUR_STATE: u32 = 1 << 1;
pub const IBV_QP_EN_SQD_ASYNC_NOTIFY: u32 = 1 << 2;
pub const IBV_QP_ACCESS_FLAGS: u32 = 1 << 3;
pub const IBV_QP_PKEY_INDEX: u32 = 1 << 4;
pub const IBV_QP_PORT: u32 = 1 << 5;
pub const IBV_QP_QKEY: u32 = 1 << 6;
pub const IBV_QP_AV: u32 = 1 << 7;
pub const IBV_QP_PATH_MTU: u32 = 1 << 8;
pub const IBV_QP_TIMEOUT: u32 = 1 << 9;
pub const IBV_QP_RETRY_CNT: u32 = 1 << 10;
pub const IBV_QP_RNR_RETRY: u32 = 1 << 11;
pub const IBV_QP_RQ_PSN: u32 = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: u32 = 1 << 13;
pub const IBV_QP_ALT_PATH: u32 = 1 << 14;
pub const IBV_QP_MIN_RNR_TIMER: u32 = 1 << 15;
pub const IBV_QP_SQ_PSN: u32 = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
pub const IBV_QP_PATH_MIG_STATE: u32 = 1 << 18;
pub const IBV_QP_CAP: u32 = 1 << 19;
pub const IBV_QP_DEST_QPN: u32 = 1 << 20;
pub const IBV_QP_RATE_LIMIT: u32 = 1 << 25;

/// `enum ibv_qp_init_attr_mask` (`ibv_qp_init_attr_ex.comp_mask`).
pub const IBV_QP_INIT_ATTR_PD: u32 = 1 << 0;
pub const IBV_QP_INIT_ATTR_XRCD: u32 = 1 << 1;
pub const IBV_QP_INIT_ATTR_CREATE_FLAGS: u32 = 1 << 2;
pub const IBV_QP_INIT_ATTR_MAX_TSO_HEADER: u32 = 1 << 3;
pub const IBV_QP_INIT_ATTR_IND_TABLE: u32 = 1 << 4;
pub const IBV_QP_INIT_ATTR_RX_HASH: u32 = 1 << 5;
pub const IBV_QP_INIT_ATTR_SEND_OPS_FLAGS: u32 = 1 << 6;

/// `enum ibv_wr_opcode`.
pub type IbvWrOpcode = u32;
pub const IBV_WR_RDMA_WRITE: IbvWrOpcode = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: IbvWrOpcode = 1;
pub const IBV_WR_SEND: IbvWrOpcode = 2;
pub const IBV_WR_SEND_WITH_IMM: IbvWrOpcode = 3;
pub const IBV_WR_RDMA_READ: IbvWrOpcode = 4;
pub const IBV_WR_ATOMIC_CMP_AND_SWP: IbvWrOpcode = 5;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: IbvWrOpcode = 6;
pub const IBV_WR_LOCAL_INV: IbvWrOpcode = 7;
pub const IBV_WR_BIND_MW: IbvWrOpcode = 8;
pub const IBV_WR_SEND_WITH_INV: IbvWrOpcode = 9;
pub const IBV_WR_TSO: IbvWrOpcode = 10;
pub const IBV_WR_DRIVER1: IbvWrOpcode = 11;
pub const IBV_WR_ATOMIC_WRITE: IbvWrOpcode = 15;

/// `enum ibv_send_flags`.
pub const IBV_SEND_FENCE: u32 = 1 << 0;
pub const IBV_SEND_SIGNALED: u32 = 1 << 1;
pub const IBV_SEND_SOLICITED: u32 = 1 << 2;
pub const IBV_SEND_INLINE: u32 = 1 << 3;
pub const IBV_SEND_IP_CSUM: u32 = 1 << 4;

/// `enum ibv_wc_status`.
pub type IbvWcStatus = u32;
pub const IBV_WC_SUCCESS: IbvWcStatus = 0;
pub const IBV_WC_LOC_LEN_ERR: IbvWcStatus = 1;
pub const IBV_WC_LOC_QP_OP_ERR: IbvWcStatus = 2;
pub const IBV_WC_LOC_EEC_OP_ERR: IbvWcStatus = 3;
pub const IBV_WC_LOC_PROT_ERR: IbvWcStatus = 4;
pub const IBV_WC_WR_FLUSH_ERR: IbvWcStatus = 5;
pub const IBV_WC_MW_BIND_ERR: IbvWcStatus = 6;
pub const IBV_WC_BAD_RESP_ERR: IbvWcStatus = 7;
pub const IBV_WC_LOC_ACCESS_ERR: IbvWcStatus = 8;
pub const IBV_WC_REM_INV_REQ_ERR: IbvWcStatus = 9;
pub const IBV_WC_REM_ACCESS_ERR: IbvWcStatus = 10;
pub const IBV_WC_REM_OP_ERR: IbvWcStatus = 11;
pub const IBV_WC_RETRY_EXC_ERR: IbvWcStatus = 12;
pub const IBV_WC_RNR_RETRY_EXC_ERR: IbvWcStatus = 13;
pub const IBV_WC_LOC_RDD_VIOL_ERR: IbvWcStatus = 14;
pub const IBV_WC_REM_INV_RD_REQ_ERR: IbvWcStatus = 15;
pub const IBV_WC_REM_ABORT_ERR: IbvWcStatus = 16;
pub const IBV_WC_INV_EECN_ERR: IbvWcStatus = 17;
pub const IBV_WC_INV_EEC_STATE_ERR: IbvWcStatus = 18;
pub const IBV_WC_FATAL_ERR: IbvWcStatus = 19;
pub const IBV_WC_RESP_TIMEOUT_ERR: IbvWcStatus = 20;
pub const IBV_WC_GENERAL_ERR: IbvWcStatus = 21;
pub const IBV_WC_TM_ERR: IbvWcStatus = 22;
pub const IBV_WC_TM_RNDV_INCOMPLETE: IbvWcStatus = 23;

/// `enum ibv_wc_opcode`.
pub type IbvWcOpcode = u32;
pub const IBV_WC_SEND: IbvWcOpcode = 0;
pub const IBV_WC_RDMA_WRITE: IbvWcOpcode = 1;
pub const IBV_WC_RDMA_READ: IbvWcOpcode = 2;
pub const IBV_WC_COMP_SWAP: IbvWcOpcode = 3;
pub const IBV_WC_FETCH_ADD: IbvWcOpcode = 4;
pub const IBV_WC_BIND_MW: IbvWcOpcode = 5;
pub const IBV_WC_LOCAL_INV: IbvWcOpcode = 6;
pub const IBV_WC_TSO: IbvWcOpcode = 7;
pub const IBV_WC_ATOMIC_WRITE: IbvWcOpcode = 9;
/// Receive-side opcodes have this bit set (`wc.opcode & IBV_WC_RECV`).
pub const IBV_WC_RECV: IbvWcOpcode = 1 << 7;
pub const IBV_WC_RECV_RDMA_WITH_IMM: IbvWcOpcode = IBV_WC_RECV + 1;

/// `enum ibv_wc_flags`.
pub const IBV_WC_GRH: u32 = 1 << 0;
pub const IBV_WC_WITH_IMM: u32 = 1 << 1;
pub const IBV_WC_IP_CSUM_OK: u32 = 1 << 2;
pub const IBV_WC_WITH_INV: u32 = 1 << 3;

/// `enum ibv_srq_init_attr_mask`.
pub const IBV_SRQ_INIT_ATTR_TYPE: u32 = 1 << 0;
pub const IBV_SRQ_INIT_ATTR_PD: u32 = 1 << 1;

/// `enum ibv_event_type` (`ibv_async_event.event_type`).
pub type IbvEventType = u32;
pub const IBV_EVENT_CQ_ERR: IbvEventType = 0;
pub const IBV_EVENT_QP_FATAL: IbvEventType = 1;
pub const IBV_EVENT_QP_REQ_ERR: IbvEventType = 2;
pub const IBV_EVENT_QP_ACCESS_ERR: IbvEventType = 3;
pub const IBV_EVENT_COMM_EST: IbvEventType = 4;
pub const IBV_EVENT_SQ_DRAINED: IbvEventType = 5;
pub const IBV_EVENT_PATH_MIG: IbvEventType = 6;
pub const IBV_EVENT_PATH_MIG_ERR: IbvEventType = 7;
pub const IBV_EVENT_DEVICE_FATAL: IbvEventType = 8;
pub const IBV_EVENT_PORT_ACTIVE: IbvEventType = 9;
pub const IBV_EVENT_PORT_ERR: IbvEventType = 10;
pub const IBV_EVENT_LID_CHANGE: IbvEventType = 11;
pub const IBV_EVENT_PKEY_CHANGE: IbvEventType = 12;
pub const IBV_EVENT_SM_CHANGE: IbvEventType = 13;
pub const IBV_EVENT_SRQ_ERR: IbvEventType = 14;
pub const IBV_EVENT_SRQ_LIMIT_REACHED: IbvEventType = 15;
pub const IBV_EVENT_QP_LAST_WQE_REACHED: IbvEventType = 16;
pub const IBV_EVENT_CLIENT_REREGISTER: IbvEventType = 17;
pub const IBV_EVENT_GID_CHANGE: IbvEventType = 18;
pub const IBV_EVENT_WQ_FATAL: IbvEventType = 19;

/// `enum ibv_srq_attr_mask`.
pub const IBV_SRQ_MAX_WR: u32 = 1 << 0;
pub const IBV_SRQ_LIMIT: u32 = 1 << 1;

/// `enum ibv_qp_create_send_ops_flags` (`ibv_qp_init_attr_ex.send_ops_flags`).
pub const IBV_QP_EX_WITH_RDMA_WRITE: u64 = 1 << 0;
pub const IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM: u64 = 1 << 1;
pub const IBV_QP_EX_WITH_SEND: u64 = 1 << 2;
pub const IBV_QP_EX_WITH_SEND_WITH_IMM: u64 = 1 << 3;
pub const IBV_QP_EX_WITH_RDMA_READ: u64 = 1 << 4;
pub const IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP: u64 = 1 << 5;
pub const IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD: u64 = 1 << 6;
