//! Attribute structs: what programs pass in and the library fills.

use core::ffi::{c_char, c_int, c_void};
use core::mem::size_of;

use crate::{
    IbvAtomicCap, IbvCq, IbvMigState, IbvMtu, IbvPd, IbvPortState, IbvQpState, IbvQpType,
    IbvRwqIndTable, IbvSrq, IbvXrcd,
};

/// `union ibv_gid`: 16 bytes in network order, seen either as `raw` or as
/// `global` (two big-endian 64-bit halves), hence the 8-byte alignment.
/// Both views are plain bytes, so one byte array with accessors stands for
/// the union.
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct IbvGid {
    pub raw: [u8; 16],
}
const _: () = assert!(size_of::<IbvGid>() == 16);

impl IbvGid {
    /// `::ffff:a.b.c.d`, the GID RoCEv2 gives an IPv4 address.
    pub const fn from_ipv4_mapped(address: [u8; 4]) -> Self {
        let mut raw = [0; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12] = address[0];
        raw[13] = address[1];
        raw[14] = address[2];
        raw[15] = address[3];
        Self { raw }
    }

    /// `global.subnet_prefix`, in host order.
    pub const fn subnet_prefix(&self) -> u64 {
        let mut half = [0; 8];
        let mut i = 0;
        while i < 8 {
            half[i] = self.raw[i];
            i += 1;
        }
        u64::from_be_bytes(half)
    }

    /// `global.interface_id`, in host order (`ibv_rc_pingpong` addresses its
    /// peer through the GRH when this is non-zero).
    pub const fn interface_id(&self) -> u64 {
        let mut half = [0; 8];
        let mut i = 0;
        while i < 8 {
            half[i] = self.raw[8 + i];
            i += 1;
        }
        u64::from_be_bytes(half)
    }
}

/// `struct ibv_global_route`: the GRH fields of an address.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvGlobalRoute {
    pub dgid: IbvGid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}
const _: () = assert!(size_of::<IbvGlobalRoute>() == 24);

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvAhAttr {
    pub grh: IbvGlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}
const _: () = assert!(size_of::<IbvAhAttr>() == 32);

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvQpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}
const _: () = assert!(size_of::<IbvQpCap>() == 20);

/// `struct ibv_qp_attr` (`ibv_modify_qp`, `ibv_query_qp`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvQpAttr {
    pub qp_state: IbvQpState,
    pub cur_qp_state: IbvQpState,
    pub path_mtu: IbvMtu,
    pub path_mig_state: IbvMigState,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    /// `IBV_ACCESS_*` flags.
    pub qp_access_flags: u32,
    pub cap: IbvQpCap,
    pub ah_attr: IbvAhAttr,
    pub alt_ah_attr: IbvAhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}
const _: () = assert!(size_of::<IbvQpAttr>() == 144);

/// `struct ibv_qp_init_attr` (`ibv_create_qp`; the library writes the
/// granted `cap` back).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvQpInitAttr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub cap: IbvQpCap,
    pub qp_type: IbvQpType,
    pub sq_sig_all: c_int,
}
const _: () = assert!(size_of::<IbvQpInitAttr>() == 64);

/// `struct ibv_rx_hash_conf`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvRxHashConf {
    pub rx_hash_function: u8,
    pub rx_hash_key_len: u8,
    pub rx_hash_key: *mut u8,
    pub rx_hash_fields_mask: u64,
}
const _: () = assert!(size_of::<IbvRxHashConf>() == 24);

/// `struct ibv_qp_init_attr_ex`: an [`IbvQpInitAttr`] followed by the
/// extended members `comp_mask` announces.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvQpInitAttrEx {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub cap: IbvQpCap,
    pub qp_type: IbvQpType,
    pub sq_sig_all: c_int,
    /// `IBV_QP_INIT_ATTR_*`.
    pub comp_mask: u32,
    pub pd: *mut IbvPd,
    pub xrcd: *mut IbvXrcd,
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut IbvRwqIndTable,
    pub rx_hash_conf: IbvRxHashConf,
    pub source_qpn: u32,
    /// `IBV_QP_EX_WITH_*`.
    pub send_ops_flags: u64,
}
const _: () = assert!(size_of::<IbvQpInitAttrEx>() == 136);

/// `struct ibv_srq_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvSrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}
const _: () = assert!(size_of::<IbvSrqAttr>() == 12);

/// `struct ibv_srq_init_attr` (`ibv_create_srq`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvSrqInitAttr {
    pub srq_context: *mut c_void,
    pub attr: IbvSrqAttr,
}
const _: () = assert!(size_of::<IbvSrqInitAttr>() == 24);

/// `struct ibv_port_attr` (`ibv_query_port`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvPortAttr {
    pub state: IbvPortState,
    pub max_mtu: IbvMtu,
    pub active_mtu: IbvMtu,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    /// `IBV_LINK_LAYER_*`.
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}
const _: () = assert!(size_of::<IbvPortAttr>() == 52);

/// `struct ibv_device_attr` (`ibv_query_device`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvDeviceAttr {
    /// NUL-terminated firmware version.
    pub fw_ver: [c_char; 64],
    /// `__be64`.
    pub node_guid: u64,
    /// `__be64`.
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    /// perftest recognises devices by this (docs/libibverbs.md).
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: u32,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: IbvAtomicCap,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}
const _: () = assert!(size_of::<IbvDeviceAttr>() == 232);

/// `ibv_odp_caps.per_transport_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvOdpPerTransportCaps {
    pub rc_odp_caps: u32,
    pub uc_odp_caps: u32,
    pub ud_odp_caps: u32,
}

/// `struct ibv_odp_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvOdpCaps {
    pub general_caps: u64,
    pub per_transport_caps: IbvOdpPerTransportCaps,
}
const _: () = assert!(size_of::<IbvOdpCaps>() == 24);

/// `struct ibv_tso_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvTsoCaps {
    pub max_tso: u32,
    pub supported_qpts: u32,
}

/// `struct ibv_rss_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvRssCaps {
    pub supported_qpts: u32,
    pub max_rwq_indirection_tables: u32,
    pub max_rwq_indirection_table_size: u32,
    pub rx_hash_fields_mask: u64,
    pub rx_hash_function: u8,
}
const _: () = assert!(size_of::<IbvRssCaps>() == 32);

/// `struct ibv_packet_pacing_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvPacketPacingCaps {
    pub qp_rate_limit_min: u32,
    pub qp_rate_limit_max: u32,
    pub supported_qpts: u32,
}

/// `struct ibv_tm_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvTmCaps {
    pub max_rndv_hdr_size: u32,
    pub max_num_tags: u32,
    pub flags: u32,
    pub max_ops: u32,
    pub max_sge: u32,
}

/// `struct ibv_cq_moderation_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvCqModerationCaps {
    pub max_cq_count: u16,
    pub max_cq_period: u16,
}

/// `struct ibv_pci_atomic_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvPciAtomicCaps {
    pub fetch_add: u16,
    pub swap: u16,
    pub compare_swap: u16,
}

/// `struct ibv_device_attr_ex` (`ibv_query_device_ex`; `ibv_devinfo`
/// prints it).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvDeviceAttrEx {
    pub orig_attr: IbvDeviceAttr,
    pub comp_mask: u32,
    pub odp_caps: IbvOdpCaps,
    pub completion_timestamp_mask: u64,
    pub hca_core_clock: u64,
    pub device_cap_flags_ex: u64,
    pub tso_caps: IbvTsoCaps,
    pub rss_caps: IbvRssCaps,
    pub max_wq_type_rq: u32,
    pub packet_pacing_caps: IbvPacketPacingCaps,
    pub raw_packet_caps: u32,
    pub tm_caps: IbvTmCaps,
    pub cq_mod_caps: IbvCqModerationCaps,
    pub max_dm_size: u64,
    pub pci_atomic_caps: IbvPciAtomicCaps,
    pub xrc_odp_caps: u32,
    pub phys_port_cnt_ex: u32,
}
const _: () = assert!(size_of::<IbvDeviceAttrEx>() == 400);

/// `struct ibv_query_device_ex_input` (`ibv_query_device_ex`: no bit
/// of `comp_mask` is defined).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvQueryDeviceExInput {
    pub comp_mask: u32,
}
const _: () = assert!(size_of::<IbvQueryDeviceExInput>() == 4);

/// `struct ibv_gid_entry` (`ibv_query_gid_ex`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvGidEntry {
    pub gid: IbvGid,
    pub gid_index: u32,
    pub port_num: u32,
    /// [`IbvGidType`](crate::IbvGidType).
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}
const _: () = assert!(size_of::<IbvGidEntry>() == 32);
