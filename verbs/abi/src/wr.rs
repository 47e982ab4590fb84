//! Work requests and completions: what `ibv_post_send`, `ibv_post_recv`,
//! `ibv_post_srq_recv` hand to the library and `ibv_poll_cq` fills.

use core::ffi::{c_int, c_void};
use core::fmt;
use core::mem::{offset_of, size_of};

use crate::{IbvAh, IbvMr, IbvMw, IbvWcOpcode, IbvWcStatus, IbvWrOpcode};

/// `struct ibv_sge`: one gather/scatter element.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvSge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}
const _: () = assert!(size_of::<IbvSge>() == 16);

/// `struct ibv_mw_bind_info`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvMwBindInfo {
    pub mr: *mut IbvMr,
    pub addr: u64,
    pub length: u64,
    pub mw_access_flags: u32,
}
const _: () = assert!(size_of::<IbvMwBindInfo>() == 32);

/// `ibv_send_wr`'s first anonymous union: the immediate (big-endian, for
/// the `_WITH_IMM` opcodes) or the rkey to invalidate (`SEND_WITH_INV`).
#[repr(C)]
#[derive(Clone, Copy)]
pub union IbvSendWrImm {
    /// `__be32`: network byte order as the program stored it.
    pub imm_data: u32,
    pub invalidate_rkey: u32,
}

/// `ibv_send_wr.wr.rdma`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvSendWrRdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// `ibv_send_wr.wr.atomic`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvSendWrAtomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// `ibv_send_wr.wr.ud`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvSendWrUd {
    pub ah: *mut IbvAh,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// `ibv_send_wr.wr`: which member is meant follows from the opcode and the
/// QP type.
#[repr(C)]
#[derive(Clone, Copy)]
pub union IbvSendWrWr {
    pub rdma: IbvSendWrRdma,
    pub atomic: IbvSendWrAtomic,
    pub ud: IbvSendWrUd,
}

/// `ibv_send_wr.qp_type.xrc`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvSendWrXrc {
    pub remote_srqn: u32,
}

/// `ibv_send_wr.qp_type`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union IbvSendWrQpType {
    pub xrc: IbvSendWrXrc,
}

/// `ibv_send_wr.bind_mw` (the `IBV_WR_BIND_MW` opcode).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvSendWrBindMw {
    pub mw: *mut IbvMw,
    pub rkey: u32,
    pub bind_info: IbvMwBindInfo,
}

/// `ibv_send_wr.tso` (the `IBV_WR_TSO` opcode).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvSendWrTso {
    pub hdr: *mut c_void,
    pub hdr_sz: u16,
    pub mss: u16,
}

/// `ibv_send_wr`'s last anonymous union.
#[repr(C)]
#[derive(Clone, Copy)]
pub union IbvSendWrExt {
    pub bind_mw: IbvSendWrBindMw,
    pub tso: IbvSendWrTso,
}

/// `struct ibv_send_wr`: a linked list (`next`) of send work requests.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvSendWr {
    pub wr_id: u64,
    pub next: *mut IbvSendWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
    pub opcode: IbvWrOpcode,
    /// `IBV_SEND_*` flags.
    pub send_flags: u32,
    /// The anonymous union holding `imm_data` / `invalidate_rkey`.
    pub imm: IbvSendWrImm,
    pub wr: IbvSendWrWr,
    pub qp_type: IbvSendWrQpType,
    /// The anonymous union holding `bind_mw` / `tso`.
    pub ext: IbvSendWrExt,
}
const _: () = assert!(offset_of!(IbvSendWr, wr) == 40);
const _: () = assert!(size_of::<IbvSendWr>() == 128);

impl fmt::Debug for IbvSendWr {
    /// The unions' meaning depends on the opcode and the QP type, so only
    /// the plain fields are shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbvSendWr")
            .field("wr_id", &self.wr_id)
            .field("next", &self.next)
            .field("sg_list", &self.sg_list)
            .field("num_sge", &self.num_sge)
            .field("opcode", &self.opcode)
            .field("send_flags", &self.send_flags)
            .finish_non_exhaustive()
    }
}

/// The unions' members overlap; which one is meant depends on the opcode
/// and the QP type, which the union does not know, so `Debug` names them
/// only.
macro_rules! union_debug {
    ($($name:ident),*) => {$(
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($name)).finish_non_exhaustive()
            }
        }
    )*};
}
union_debug!(IbvSendWrImm, IbvSendWrWr, IbvSendWrQpType, IbvSendWrExt);

/// `struct ibv_recv_wr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvRecvWr {
    pub wr_id: u64,
    pub next: *mut IbvRecvWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
}
const _: () = assert!(size_of::<IbvRecvWr>() == 32);

/// `struct ibv_wc`: one completion as `ibv_poll_cq` returns it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvWc {
    pub wr_id: u64,
    pub status: IbvWcStatus,
    pub opcode: IbvWcOpcode,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// The anonymous union of `imm_data` (`__be32`, with `IBV_WC_WITH_IMM`)
    /// and `invalidated_rkey` (with `IBV_WC_WITH_INV`): both are one `u32`
    /// at the same place, so one field stands for both.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    /// `IBV_WC_*` flags.
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}
const _: () = assert!(size_of::<IbvWc>() == 48);
