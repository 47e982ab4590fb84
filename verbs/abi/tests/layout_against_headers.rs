//! Every mirrored field offset, struct size and alignment, and constant of
//! `ibverbs-abi`, checked against rdma-core's installed `<infiniband/verbs.h>`.
//!
//! The test writes a C program that prints `offsetof`/`sizeof`/`_Alignof`
//! and the constants' values, compiles it with the system C compiler (`$CC`,
//! else `cc`), runs it and compares each line with the Rust side. The header
//! comes from Debian's `libibverbs-dev` (CI installs it); without it the test
//! fails saying so, it never passes silently.

use std::fmt::Write as _;
use std::mem::{align_of, offset_of, size_of};
use std::path::PathBuf;
use std::process::Command;

use ibverbs_abi::*;

/// One value both sides compute: a C expression and the Rust value.
struct Probe {
    c_expression: String,
    rust_value: i64,
}

#[derive(Default)]
struct Probes(Vec<Probe>);

impl Probes {
    fn push(&mut self, c_expression: String, rust_value: i64) {
        self.0.push(Probe {
            c_expression,
            rust_value,
        });
    }
}

/// `sizeof` and `_Alignof` of a struct.
macro_rules! layout {
    ($probes:ident, $rust:ty, $c:literal) => {
        $probes.push(format!("sizeof({})", $c), size_of::<$rust>() as i64);
        $probes.push(format!("_Alignof({})", $c), align_of::<$rust>() as i64);
    };
}

/// Offsets of fields named alike on both sides (nested paths allowed), and
/// `rust.path => "c.path"` for the few that differ (Rust keywords, C's
/// anonymous unions).
macro_rules! fields {
    ($probes:ident, $rust:ty, $c:literal, [$($field:ident $(. $sub:ident)*),* $(,)?]) => {
        $(
            $probes.push(
                format!("offsetof({}, {})", $c, stringify!($field $(. $sub)*).replace(' ', "")),
                offset_of!($rust, $field $(. $sub)*) as i64,
            );
        )*
    };
    ($probes:ident, $rust:ty, $c:literal, { $($field:ident $(. $sub:ident)* => $c_field:literal),* $(,)? }) => {
        $(
            $probes.push(format!("offsetof({}, {})", $c, $c_field), offset_of!($rust, $field $(. $sub)*) as i64);
        )*
    };
}

/// Constants under their C names.
macro_rules! constants {
    ($probes:ident, [$($name:ident),* $(,)?]) => {
        $( $probes.push(stringify!($name).to_string(), $name as i64); )*
    };
}

fn structs(p: &mut Probes) {
    layout!(p, IbvDeviceOps, "struct _ibv_device_ops");
    fields!(
        p,
        IbvDeviceOps,
        "struct _ibv_device_ops",
        [_dummy1, _dummy2]
    );
    layout!(p, IbvDevice, "struct ibv_device");
    fields!(
        p,
        IbvDevice,
        "struct ibv_device",
        [
            _ops,
            node_type,
            transport_type,
            name,
            dev_name,
            dev_path,
            ibdev_path
        ]
    );

    layout!(p, IbvContextOps, "struct ibv_context_ops");
    fields!(
        p,
        IbvContextOps,
        "struct ibv_context_ops",
        [
            _compat_query_device,
            _compat_query_port,
            _compat_alloc_pd,
            _compat_dealloc_pd,
            _compat_reg_mr,
            _compat_rereg_mr,
            _compat_dereg_mr,
            alloc_mw,
            bind_mw,
            dealloc_mw,
            _compat_create_cq,
            poll_cq,
            req_notify_cq,
            _compat_cq_event,
            _compat_resize_cq,
            _compat_destroy_cq,
            _compat_create_srq,
            _compat_modify_srq,
            _compat_query_srq,
            _compat_destroy_srq,
            post_srq_recv,
            _compat_create_qp,
            _compat_query_qp,
            _compat_modify_qp,
            _compat_destroy_qp,
            post_send,
            post_recv,
            _compat_create_ah,
            _compat_destroy_ah,
            _compat_attach_mcast,
            _compat_detach_mcast,
            _compat_async_event,
        ]
    );
    layout!(p, IbvContext, "struct ibv_context");
    fields!(
        p,
        IbvContext,
        "struct ibv_context",
        [
            device,
            ops,
            cmd_fd,
            async_fd,
            num_comp_vectors,
            mutex,
            abi_compat
        ]
    );
    layout!(p, PthreadMutex, "pthread_mutex_t");
    layout!(p, PthreadCond, "pthread_cond_t");

    layout!(p, VerbsContext, "struct verbs_context");
    fields!(
        p,
        VerbsContext,
        "struct verbs_context",
        [
            query_port,
            advise_mr,
            alloc_null_mr,
            read_counters,
            attach_counters_point_flow,
            create_counters,
            destroy_counters,
            reg_dm_mr,
            alloc_dm,
            free_dm,
            modify_flow_action_esp,
            destroy_flow_action,
            create_flow_action_esp,
            modify_qp_rate_limit,
            alloc_parent_domain,
            dealloc_td,
            alloc_td,
            modify_cq,
            post_srq_ops,
            destroy_rwq_ind_table,
            create_rwq_ind_table,
            destroy_wq,
            modify_wq,
            create_wq,
            query_rt_values,
            create_cq_ex,
            query_device_ex,
            ibv_destroy_flow,
            ibv_create_flow,
            open_qp,
            create_qp_ex,
            get_srq_num,
            create_srq_ex,
            open_xrcd,
            close_xrcd,
            sz,
            context,
        ]
    );
    fields!(p, VerbsContext, "struct verbs_context", {
        priv_ => "priv",
        abi_placeholder2 => "ABI_placeholder2",
        abi_placeholder1 => "ABI_placeholder1",
        _abi_placeholder3 => "_ABI_placeholder3",
    });

    layout!(p, IbvPd, "struct ibv_pd");
    fields!(p, IbvPd, "struct ibv_pd", [context, handle]);
    layout!(p, IbvMr, "struct ibv_mr");
    fields!(
        p,
        IbvMr,
        "struct ibv_mr",
        [context, pd, addr, length, handle, lkey, rkey]
    );
    layout!(p, IbvCompChannel, "struct ibv_comp_channel");
    fields!(
        p,
        IbvCompChannel,
        "struct ibv_comp_channel",
        [context, fd, refcnt]
    );
    layout!(p, IbvCq, "struct ibv_cq");
    fields!(
        p,
        IbvCq,
        "struct ibv_cq",
        [
            context,
            channel,
            cq_context,
            handle,
            cqe,
            mutex,
            cond,
            comp_events_completed,
            async_events_completed,
        ]
    );
    layout!(p, IbvQp, "struct ibv_qp");
    fields!(
        p,
        IbvQp,
        "struct ibv_qp",
        [
            context,
            qp_context,
            pd,
            send_cq,
            recv_cq,
            srq,
            handle,
            qp_num,
            state,
            qp_type,
            mutex,
            cond,
            events_completed,
        ]
    );
    layout!(p, IbvAsyncEvent, "struct ibv_async_event");
    fields!(
        p,
        IbvAsyncEvent,
        "struct ibv_async_event",
        [
            element.cq,
            element.qp,
            element.srq,
            element.wq,
            element.port_num,
            event_type
        ]
    );
    layout!(p, IbvSrq, "struct ibv_srq");
    fields!(
        p,
        IbvSrq,
        "struct ibv_srq",
        [
            context,
            srq_context,
            pd,
            handle,
            mutex,
            cond,
            events_completed
        ]
    );
    layout!(p, IbvAh, "struct ibv_ah");
    fields!(p, IbvAh, "struct ibv_ah", [context, pd, handle]);
    layout!(p, IbvQpEx, "struct ibv_qp_ex");
    fields!(
        p,
        IbvQpEx,
        "struct ibv_qp_ex",
        [
            qp_base,
            comp_mask,
            wr_id,
            wr_flags,
            wr_atomic_cmp_swp,
            wr_atomic_fetch_add,
            wr_bind_mw,
            wr_local_inv,
            wr_rdma_read,
            wr_rdma_write,
            wr_rdma_write_imm,
            wr_send,
            wr_send_imm,
            wr_send_inv,
            wr_send_tso,
            wr_set_ud_addr,
            wr_set_xrc_srqn,
            wr_set_inline_data,
            wr_set_inline_data_list,
            wr_set_sge,
            wr_set_sge_list,
            wr_start,
            wr_complete,
            wr_abort,
            wr_atomic_write,
        ]
    );

    layout!(p, IbvSge, "struct ibv_sge");
    fields!(p, IbvSge, "struct ibv_sge", [addr, length, lkey]);
    layout!(p, IbvMwBindInfo, "struct ibv_mw_bind_info");
    fields!(
        p,
        IbvMwBindInfo,
        "struct ibv_mw_bind_info",
        [mr, addr, length, mw_access_flags]
    );
    layout!(p, IbvSendWr, "struct ibv_send_wr");
    fields!(
        p,
        IbvSendWr,
        "struct ibv_send_wr",
        [
            wr_id,
            next,
            sg_list,
            num_sge,
            opcode,
            send_flags,
            wr,
            wr.rdma.remote_addr,
            wr.rdma.rkey,
            wr.atomic.remote_addr,
            wr.atomic.compare_add,
            wr.atomic.swap,
            wr.atomic.rkey,
            wr.ud.ah,
            wr.ud.remote_qpn,
            wr.ud.remote_qkey,
            qp_type,
            qp_type.xrc.remote_srqn,
        ]
    );
    fields!(p, IbvSendWr, "struct ibv_send_wr", {
        imm.imm_data => "imm_data",
        imm.invalidate_rkey => "invalidate_rkey",
        ext.bind_mw.mw => "bind_mw.mw",
        ext.bind_mw.rkey => "bind_mw.rkey",
        ext.bind_mw.bind_info => "bind_mw.bind_info",
        ext.tso.hdr => "tso.hdr",
        ext.tso.hdr_sz => "tso.hdr_sz",
        ext.tso.mss => "tso.mss",
    });
    layout!(p, IbvRecvWr, "struct ibv_recv_wr");
    fields!(
        p,
        IbvRecvWr,
        "struct ibv_recv_wr",
        [wr_id, next, sg_list, num_sge]
    );
    layout!(p, IbvWc, "struct ibv_wc");
    fields!(
        p,
        IbvWc,
        "struct ibv_wc",
        [
            wr_id,
            status,
            opcode,
            vendor_err,
            byte_len,
            imm_data,
            qp_num,
            src_qp,
            wc_flags,
            pkey_index,
            slid,
            sl,
            dlid_path_bits,
        ]
    );
    fields!(p, IbvWc, "struct ibv_wc", { imm_data => "invalidated_rkey" });

    layout!(p, IbvGid, "union ibv_gid");
    fields!(p, IbvGid, "union ibv_gid", [raw]);
    layout!(p, IbvGlobalRoute, "struct ibv_global_route");
    fields!(
        p,
        IbvGlobalRoute,
        "struct ibv_global_route",
        [dgid, flow_label, sgid_index, hop_limit, traffic_class]
    );
    layout!(p, IbvAhAttr, "struct ibv_ah_attr");
    fields!(
        p,
        IbvAhAttr,
        "struct ibv_ah_attr",
        [
            grh,
            dlid,
            sl,
            src_path_bits,
            static_rate,
            is_global,
            port_num
        ]
    );
    layout!(p, IbvQpCap, "struct ibv_qp_cap");
    fields!(
        p,
        IbvQpCap,
        "struct ibv_qp_cap",
        [
            max_send_wr,
            max_recv_wr,
            max_send_sge,
            max_recv_sge,
            max_inline_data
        ]
    );
    layout!(p, IbvQpAttr, "struct ibv_qp_attr");
    fields!(
        p,
        IbvQpAttr,
        "struct ibv_qp_attr",
        [
            qp_state,
            cur_qp_state,
            path_mtu,
            path_mig_state,
            qkey,
            rq_psn,
            sq_psn,
            dest_qp_num,
            qp_access_flags,
            cap,
            ah_attr,
            alt_ah_attr,
            pkey_index,
            alt_pkey_index,
            en_sqd_async_notify,
            sq_draining,
            max_rd_atomic,
            max_dest_rd_atomic,
            min_rnr_timer,
            port_num,
            timeout,
            retry_cnt,
            rnr_retry,
            alt_port_num,
            alt_timeout,
            rate_limit,
        ]
    );
    layout!(p, IbvQpInitAttr, "struct ibv_qp_init_attr");
    fields!(
        p,
        IbvQpInitAttr,
        "struct ibv_qp_init_attr",
        [qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all]
    );
    layout!(p, IbvRxHashConf, "struct ibv_rx_hash_conf");
    fields!(
        p,
        IbvRxHashConf,
        "struct ibv_rx_hash_conf",
        [
            rx_hash_function,
            rx_hash_key_len,
            rx_hash_key,
            rx_hash_fields_mask,
        ]
    );
    layout!(p, IbvQpInitAttrEx, "struct ibv_qp_init_attr_ex");
    fields!(
        p,
        IbvQpInitAttrEx,
        "struct ibv_qp_init_attr_ex",
        [
            qp_context,
            send_cq,
            recv_cq,
            srq,
            cap,
            qp_type,
            sq_sig_all,
            comp_mask,
            pd,
            xrcd,
            create_flags,
            max_tso_header,
            rwq_ind_tbl,
            rx_hash_conf,
            source_qpn,
            send_ops_flags,
        ]
    );
    layout!(p, IbvSrqAttr, "struct ibv_srq_attr");
    fields!(
        p,
        IbvSrqAttr,
        "struct ibv_srq_attr",
        [max_wr, max_sge, srq_limit]
    );
    layout!(p, IbvSrqInitAttr, "struct ibv_srq_init_attr");
    fields!(
        p,
        IbvSrqInitAttr,
        "struct ibv_srq_init_attr",
        [srq_context, attr]
    );
    layout!(p, IbvPortAttr, "struct ibv_port_attr");
    fields!(
        p,
        IbvPortAttr,
        "struct ibv_port_attr",
        [
            state,
            max_mtu,
            active_mtu,
            gid_tbl_len,
            port_cap_flags,
            max_msg_sz,
            bad_pkey_cntr,
            qkey_viol_cntr,
            pkey_tbl_len,
            lid,
            sm_lid,
            lmc,
            max_vl_num,
            sm_sl,
            subnet_timeout,
            init_type_reply,
            active_width,
            active_speed,
            phys_state,
            link_layer,
            flags,
            port_cap_flags2,
        ]
    );
    layout!(p, IbvDeviceAttr, "struct ibv_device_attr");
    fields!(
        p,
        IbvDeviceAttr,
        "struct ibv_device_attr",
        [
            fw_ver,
            node_guid,
            sys_image_guid,
            max_mr_size,
            page_size_cap,
            vendor_id,
            vendor_part_id,
            hw_ver,
            max_qp,
            max_qp_wr,
            device_cap_flags,
            max_sge,
            max_sge_rd,
            max_cq,
            max_cqe,
            max_mr,
            max_pd,
            max_qp_rd_atom,
            max_ee_rd_atom,
            max_res_rd_atom,
            max_qp_init_rd_atom,
            max_ee_init_rd_atom,
            atomic_cap,
            max_ee,
            max_rdd,
            max_mw,
            max_raw_ipv6_qp,
            max_raw_ethy_qp,
            max_mcast_grp,
            max_mcast_qp_attach,
            max_total_mcast_qp_attach,
            max_ah,
            max_fmr,
            max_map_per_fmr,
            max_srq,
            max_srq_wr,
            max_srq_sge,
            max_pkeys,
            local_ca_ack_delay,
            phys_port_cnt,
        ]
    );
    layout!(p, IbvOdpCaps, "struct ibv_odp_caps");
    fields!(
        p,
        IbvOdpCaps,
        "struct ibv_odp_caps",
        [
            general_caps,
            per_transport_caps.rc_odp_caps,
            per_transport_caps.uc_odp_caps,
            per_transport_caps.ud_odp_caps,
        ]
    );
    layout!(p, IbvTsoCaps, "struct ibv_tso_caps");
    fields!(
        p,
        IbvTsoCaps,
        "struct ibv_tso_caps",
        [max_tso, supported_qpts]
    );
    layout!(p, IbvRssCaps, "struct ibv_rss_caps");
    fields!(
        p,
        IbvRssCaps,
        "struct ibv_rss_caps",
        [
            supported_qpts,
            max_rwq_indirection_tables,
            max_rwq_indirection_table_size,
            rx_hash_fields_mask,
            rx_hash_function,
        ]
    );
    layout!(p, IbvPacketPacingCaps, "struct ibv_packet_pacing_caps");
    fields!(
        p,
        IbvPacketPacingCaps,
        "struct ibv_packet_pacing_caps",
        [qp_rate_limit_min, qp_rate_limit_max, supported_qpts,]
    );
    layout!(p, IbvTmCaps, "struct ibv_tm_caps");
    fields!(
        p,
        IbvTmCaps,
        "struct ibv_tm_caps",
        [max_rndv_hdr_size, max_num_tags, flags, max_ops, max_sge]
    );
    layout!(p, IbvCqModerationCaps, "struct ibv_cq_moderation_caps");
    fields!(
        p,
        IbvCqModerationCaps,
        "struct ibv_cq_moderation_caps",
        [max_cq_count, max_cq_period]
    );
    layout!(p, IbvPciAtomicCaps, "struct ibv_pci_atomic_caps");
    fields!(
        p,
        IbvPciAtomicCaps,
        "struct ibv_pci_atomic_caps",
        [fetch_add, swap, compare_swap]
    );
    layout!(p, IbvQueryDeviceExInput, "struct ibv_query_device_ex_input");
    fields!(
        p,
        IbvQueryDeviceExInput,
        "struct ibv_query_device_ex_input",
        [comp_mask]
    );
    layout!(p, IbvDeviceAttrEx, "struct ibv_device_attr_ex");
    fields!(
        p,
        IbvDeviceAttrEx,
        "struct ibv_device_attr_ex",
        [
            orig_attr,
            comp_mask,
            odp_caps,
            completion_timestamp_mask,
            hca_core_clock,
            device_cap_flags_ex,
            tso_caps,
            rss_caps,
            max_wq_type_rq,
            packet_pacing_caps,
            raw_packet_caps,
            tm_caps,
            cq_mod_caps,
            max_dm_size,
            pci_atomic_caps,
            xrc_odp_caps,
            phys_port_cnt_ex,
        ]
    );
    layout!(p, IbvGidEntry, "struct ibv_gid_entry");
    fields!(
        p,
        IbvGidEntry,
        "struct ibv_gid_entry",
        [gid, gid_index, port_num, gid_type, ndev_ifindex]
    );
}

fn constants(p: &mut Probes) {
    constants!(
        p,
        [
            IBV_NODE_UNKNOWN,
            IBV_NODE_CA,
            IBV_NODE_SWITCH,
            IBV_NODE_ROUTER,
            IBV_NODE_RNIC,
            IBV_NODE_USNIC,
            IBV_NODE_USNIC_UDP,
            IBV_NODE_UNSPECIFIED,
            IBV_TRANSPORT_UNKNOWN,
            IBV_TRANSPORT_IB,
            IBV_TRANSPORT_IWARP,
            IBV_TRANSPORT_USNIC,
            IBV_TRANSPORT_USNIC_UDP,
            IBV_TRANSPORT_UNSPECIFIED,
            IBV_SYSFS_NAME_MAX,
            IBV_SYSFS_PATH_MAX,
            IBV_ATOMIC_NONE,
            IBV_ATOMIC_HCA,
            IBV_ATOMIC_GLOB,
            IBV_MTU_256,
            IBV_MTU_512,
            IBV_MTU_1024,
            IBV_MTU_2048,
            IBV_MTU_4096,
            IBV_PORT_NOP,
            IBV_PORT_DOWN,
            IBV_PORT_INIT,
            IBV_PORT_ARMED,
            IBV_PORT_ACTIVE,
            IBV_PORT_ACTIVE_DEFER,
            IBV_LINK_LAYER_UNSPECIFIED,
            IBV_LINK_LAYER_INFINIBAND,
            IBV_LINK_LAYER_ETHERNET,
            IBV_PORT_IP_BASED_GIDS,
            IBV_PORT_CM_SUP,
            IBV_GID_TYPE_IB,
            IBV_GID_TYPE_ROCE_V1,
            IBV_GID_TYPE_ROCE_V2,
            IBV_ACCESS_LOCAL_WRITE,
            IBV_ACCESS_REMOTE_WRITE,
            IBV_ACCESS_REMOTE_READ,
            IBV_ACCESS_REMOTE_ATOMIC,
            IBV_ACCESS_MW_BIND,
            IBV_ACCESS_ZERO_BASED,
            IBV_ACCESS_ON_DEMAND,
            IBV_ACCESS_HUGETLB,
            IBV_ACCESS_OPTIONAL_FIRST,
            IBV_ACCESS_OPTIONAL_RANGE,
            IBV_ACCESS_RELAXED_ORDERING,
            IBV_QPT_RC,
            IBV_QPT_UC,
            IBV_QPT_UD,
            IBV_QPT_RAW_PACKET,
            IBV_QPT_XRC_SEND,
            IBV_QPT_XRC_RECV,
            IBV_QPT_DRIVER,
            IBV_QPS_RESET,
            IBV_QPS_INIT,
            IBV_QPS_RTR,
            IBV_QPS_RTS,
            IBV_QPS_SQD,
            IBV_QPS_SQE,
            IBV_QPS_ERR,
            IBV_QPS_UNKNOWN,
            IBV_MIG_MIGRATED,
            IBV_MIG_REARM,
            IBV_MIG_ARMED,
            IBV_QP_STATE,
            IBV_QP_CUR_STATE,
            IBV_QP_EN_SQD_ASYNC_NOTIFY,
            IBV_QP_ACCESS_FLAGS,
            IBV_QP_PKEY_INDEX,
            IBV_QP_PORT,
            IBV_QP_QKEY,
            IBV_QP_AV,
            IBV_QP_PATH_MTU,
            IBV_QP_TIMEOUT,
            IBV_QP_RETRY_CNT,
            IBV_QP_RNR_RETRY,
            IBV_QP_RQ_PSN,
            IBV_QP_MAX_QP_RD_ATOMIC,
            IBV_QP_ALT_PATH,
            IBV_QP_MIN_RNR_TIMER,
            IBV_QP_SQ_PSN,
            IBV_QP_MAX_DEST_RD_ATOMIC,
            IBV_QP_PATH_MIG_STATE,
            IBV_QP_CAP,
            IBV_QP_DEST_QPN,
            IBV_QP_RATE_LIMIT,
            IBV_QP_INIT_ATTR_PD,
            IBV_QP_INIT_ATTR_XRCD,
            IBV_QP_INIT_ATTR_CREATE_FLAGS,
            IBV_QP_INIT_ATTR_MAX_TSO_HEADER,
            IBV_QP_INIT_ATTR_IND_TABLE,
            IBV_QP_INIT_ATTR_RX_HASH,
            IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
            IBV_WR_RDMA_WRITE,
            IBV_WR_RDMA_WRITE_WITH_IMM,
            IBV_WR_SEND,
            IBV_WR_SEND_WITH_IMM,
            IBV_WR_RDMA_READ,
            IBV_WR_ATOMIC_CMP_AND_SWP,
            IBV_WR_ATOMIC_FETCH_AND_ADD,
            IBV_WR_LOCAL_INV,
            IBV_WR_BIND_MW,
            IBV_WR_SEND_WITH_INV,
            IBV_WR_TSO,
            IBV_WR_DRIVER1,
            IBV_WR_ATOMIC_WRITE,
            IBV_SEND_FENCE,
            IBV_SEND_SIGNALED,
            IBV_SEND_SOLICITED,
            IBV_SEND_INLINE,
            IBV_SEND_IP_CSUM,
            IBV_WC_SUCCESS,
            IBV_WC_LOC_LEN_ERR,
            IBV_WC_LOC_QP_OP_ERR,
            IBV_WC_LOC_EEC_OP_ERR,
            IBV_WC_LOC_PROT_ERR,
            IBV_WC_WR_FLUSH_ERR,
            IBV_WC_MW_BIND_ERR,
            IBV_WC_BAD_RESP_ERR,
            IBV_WC_LOC_ACCESS_ERR,
            IBV_WC_REM_INV_REQ_ERR,
            IBV_WC_REM_ACCESS_ERR,
            IBV_WC_REM_OP_ERR,
            IBV_WC_RETRY_EXC_ERR,
            IBV_WC_RNR_RETRY_EXC_ERR,
            IBV_WC_LOC_RDD_VIOL_ERR,
            IBV_WC_REM_INV_RD_REQ_ERR,
            IBV_WC_REM_ABORT_ERR,
            IBV_WC_INV_EECN_ERR,
            IBV_WC_INV_EEC_STATE_ERR,
            IBV_WC_FATAL_ERR,
            IBV_WC_RESP_TIMEOUT_ERR,
            IBV_WC_GENERAL_ERR,
            IBV_WC_TM_ERR,
            IBV_WC_TM_RNDV_INCOMPLETE,
            IBV_WC_SEND,
            IBV_WC_RDMA_WRITE,
            IBV_WC_RDMA_READ,
            IBV_WC_COMP_SWAP,
            IBV_WC_FETCH_ADD,
            IBV_WC_BIND_MW,
            IBV_WC_LOCAL_INV,
            IBV_WC_TSO,
            IBV_WC_ATOMIC_WRITE,
            IBV_WC_RECV,
            IBV_WC_RECV_RDMA_WITH_IMM,
            IBV_WC_GRH,
            IBV_WC_WITH_IMM,
            IBV_WC_IP_CSUM_OK,
            IBV_WC_WITH_INV,
            IBV_SRQ_INIT_ATTR_TYPE,
            IBV_SRQ_INIT_ATTR_PD,
            IBV_SRQ_MAX_WR,
            IBV_SRQ_LIMIT,
            IBV_EVENT_CQ_ERR,
            IBV_EVENT_QP_FATAL,
            IBV_EVENT_QP_REQ_ERR,
            IBV_EVENT_QP_ACCESS_ERR,
            IBV_EVENT_COMM_EST,
            IBV_EVENT_SQ_DRAINED,
            IBV_EVENT_PATH_MIG,
            IBV_EVENT_PATH_MIG_ERR,
            IBV_EVENT_DEVICE_FATAL,
            IBV_EVENT_PORT_ACTIVE,
            IBV_EVENT_PORT_ERR,
            IBV_EVENT_LID_CHANGE,
            IBV_EVENT_PKEY_CHANGE,
            IBV_EVENT_SM_CHANGE,
            IBV_EVENT_SRQ_ERR,
            IBV_EVENT_SRQ_LIMIT_REACHED,
            IBV_EVENT_QP_LAST_WQE_REACHED,
            IBV_EVENT_CLIENT_REREGISTER,
            IBV_EVENT_GID_CHANGE,
            IBV_EVENT_WQ_FATAL,
            IBV_QP_EX_WITH_RDMA_WRITE,
            IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM,
            IBV_QP_EX_WITH_SEND,
            IBV_QP_EX_WITH_SEND_WITH_IMM,
            IBV_QP_EX_WITH_RDMA_READ,
            IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP,
            IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD,
        ]
    );
    p.push(
        "(uintptr_t)__VERBS_ABI_IS_EXTENDED".to_string(),
        VERBS_ABI_IS_EXTENDED as i64,
    );
}

/// Compiles and runs the probe program; returns its output lines, one value
/// per probe, in order.
fn run_c_probe(probes: &Probes) -> Vec<i64> {
    let mut source = String::from(
        "#include <stddef.h>\n#include <stdint.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\n\
         int main(void) {\n",
    );
    for probe in &probes.0 {
        writeln!(
            source,
            "    printf(\"%lld\\n\", (long long)({}));",
            probe.c_expression
        )
        .unwrap();
    }
    source.push_str("    return 0;\n}\n");

    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ibverbs-abi-layout");
    std::fs::create_dir_all(&dir).unwrap();
    let c_file = dir.join("probe.c");
    let exe = dir.join("probe");
    std::fs::write(&c_file, source).unwrap();

    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let compiled = Command::new(&compiler)
        .arg("-std=gnu11")
        .arg("-o")
        .arg(&exe)
        .arg(&c_file)
        .output()
        .unwrap_or_else(|error| {
            panic!("cannot run the C compiler `{compiler}` ({error}): install gcc (Debian: build-essential)")
        });
    let stderr = String::from_utf8_lossy(&compiled.stderr);
    assert!(
        !stderr.contains("infiniband/verbs.h"),
        "rdma-core's <infiniband/verbs.h> is not installed: install Debian's `libibverbs-dev` \
         (apt-get install libibverbs-dev); the layout test needs it\n{stderr}"
    );
    assert!(
        compiled.status.success(),
        "the probe program did not compile ({}):\n{stderr}",
        c_file.display()
    );

    let run = Command::new(&exe).output().expect("the probe program runs");
    assert!(run.status.success(), "the probe program failed: {run:?}");
    String::from_utf8(run.stdout)
        .unwrap()
        .lines()
        .map(|line| line.parse().expect("one integer per line"))
        .collect()
}

#[test]
fn every_mirrored_offset_size_and_constant_matches_the_installed_verbs_header() {
    let mut probes = Probes::default();
    structs(&mut probes);
    constants(&mut probes);
    let c_values = run_c_probe(&probes);
    assert_eq!(c_values.len(), probes.0.len(), "one output line per probe");

    let mismatches: Vec<String> = probes
        .0
        .iter()
        .zip(&c_values)
        .filter(|(probe, c_value)| probe.rust_value != **c_value)
        .map(|(probe, c_value)| {
            format!(
                "{}: C says {c_value}, Rust says {}",
                probe.c_expression, probe.rust_value
            )
        })
        .collect();
    assert!(
        mismatches.is_empty(),
        "{} of {} probes differ from <infiniband/verbs.h>:\n{}",
        mismatches.len(),
        probes.0.len(),
        mismatches.join("\n")
    );
    // The suite is only meaningful if it covered what it claims to.
    assert!(probes.0.len() > 400, "{} probes", probes.0.len());
}
