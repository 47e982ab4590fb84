//! The queries: the device (`ibv_query_device`, and the `verbs_context`
//! entry the `ibv_query_device_ex` inline reaches), its ports (the exported
//! `ibv_query_port` and the `verbs_context` entry the inline reaches),
//! GIDs and their types, P_Keys. Each reads the CA's attribute block
//! (`QueryCa`, one IOCTL through the access library) afresh, decoded as
//! untrusted bytes, and converts it to rdma-core's structs.

use std::ffi::c_int;
use std::mem::{offset_of, size_of};

use ib_types::ca::{Atomicity, CaAttr, CaAttrView, CaCaps, PortAttr};
use ib_types::scalars::{Gid, LinkLayer, PKey, PortNum, PortState};
use ibverbs_abi::{
    IBV_ATOMIC_HCA, IBV_ATOMIC_NONE, IBV_GID_TYPE_IB, IBV_GID_TYPE_ROCE_V2,
    IBV_GID_TYPE_SYSFS_IB_ROCE_V1, IBV_GID_TYPE_SYSFS_ROCE_V2, IBV_LINK_LAYER_ETHERNET,
    IBV_LINK_LAYER_INFINIBAND, IBV_PORT_IP_BASED_GIDS, IbvContext, IbvDeviceAttr, IbvDeviceAttrEx,
    IbvGid, IbvGidEntry, IbvPortAttr, IbvQueryDeviceExInput,
};

use crate::device::open_context;
use crate::state::{Context, copy_c_string};
use crate::util::{errno_of, guard, set_errno};

/// `IBV_DEVICE_*` capability bits (`enum ibv_device_cap_flags`) the CA's
/// capabilities map to.
const DEVICE_CAPS: [(CaCaps, u32); 10] = [
    (CaCaps::BAD_PKEY_COUNTER, 1 << 1),
    (CaCaps::BAD_QKEY_COUNTER, 1 << 2),
    (CaCaps::RAW_MCAST, 1 << 3),
    (CaCaps::APM, 1 << 4),
    (CaCaps::CHANGE_PRIMARY_PORT, 1 << 5),
    (CaCaps::AV_PORT_CHECK, 1 << 6),
    (CaCaps::CURRENT_QP_STATE, 1 << 7),
    (CaCaps::SHUTDOWN_PORT, 1 << 8),
    (CaCaps::PORT_ACTIVE_EVENT, 1 << 10),
    (CaCaps::SYSTEM_IMAGE_GUID, 1 << 11),
];
/// `IBV_DEVICE_MEM_WINDOW`: memory windows (either type).
const IBV_DEVICE_MEM_WINDOW: u32 = 1 << 17;
/// `IBV_DEVICE_MEM_WINDOW_TYPE_2B`: type 2 windows bound to a QP.
const IBV_DEVICE_MEM_WINDOW_TYPE_2B: u32 = 1 << 24;
/// `IBV_DEVICE_RC_RNR_NAK_GEN`: an RC responder NAKs for want of a receive.
const IBV_DEVICE_RC_RNR_NAK_GEN: u32 = 1 << 12;

/// The bytes of `struct _compat_ibv_port_attr` (the exported
/// `ibv_query_port@IBVERBS_1.1` fills it): `ibv_port_attr` without
/// `port_cap_flags2`.
const COMPAT_PORT_ATTR_LEN: usize = offset_of!(IbvPortAttr, port_cap_flags2);

/// What one `QueryCa` says, decoded and owned.
struct Snapshot {
    attr: CaAttr,
    page_size_cap: u64,
    ports: Vec<PortSnapshot>,
}

struct PortSnapshot {
    attr: PortAttr,
    gids: Vec<Gid>,
    pkeys: Vec<PKey>,
}

impl Snapshot {
    /// Asks the CA now; an errno value on failure.
    fn of(context: &Context) -> Result<Self, c_int> {
        let bytes = context.ca.query_raw().map_err(|e| errno_of(&e))?;
        let view = CaAttrView::parse(&bytes).map_err(|_| libc::EIO)?;
        Ok(Self {
            attr: view.attr(),
            page_size_cap: view
                .page_sizes()
                .iter()
                .fold(0, |cap, size| cap | u64::from(size.get())),
            ports: view
                .ports()
                .map(|port| PortSnapshot {
                    attr: port.attr(),
                    gids: port.gids().to_vec(),
                    pkeys: port.pkeys().to_vec(),
                })
                .collect(),
        })
    }

    /// Port `port`, or `EINVAL` for a port the CA does not have.
    fn port(&self, port: u32) -> Result<&PortSnapshot, c_int> {
        let port = u8::try_from(port)
            .ok()
            .and_then(|p| PortNum::new(p).ok())
            .ok_or(libc::EINVAL)?;
        self.ports
            .iter()
            .find(|p| p.attr.port_num == port)
            .ok_or(libc::EINVAL)
    }
}

/// Reads the open context `context` and hands its snapshot to `answer`;
/// an errno value when the context is not open or the query fails.
fn with_snapshot<T>(
    context: *const IbvContext,
    answer: impl FnOnce(&Snapshot) -> Result<T, c_int>,
) -> Result<T, c_int> {
    let context = open_context(context)?;
    answer(&Snapshot::of(&context)?)
}

/// `fw_ver`: the PRM's vendor-encoded 64-bit version read as three 16-bit
/// fields, major.minor.sub-minor (bits 47..32, 31..16, 15..0).
fn firmware_text(version: u64) -> String {
    format!(
        "{}.{}.{}",
        (version >> 32) & 0xffff,
        (version >> 16) & 0xffff,
        version & 0xffff
    )
}

fn clamp(value: u32) -> c_int {
    c_int::try_from(value).unwrap_or(c_int::MAX)
}

/// rdma-core's device attributes from the CA's.
fn device_attr_of(snapshot: &Snapshot) -> IbvDeviceAttr {
    let attr = &snapshot.attr;
    let limits = &attr.limits;
    let mut caps = DEVICE_CAPS
        .iter()
        .filter(|(ca, _)| attr.caps.contains(*ca))
        .fold(0, |flags, (_, bit)| flags | bit);
    if attr.caps.contains(CaCaps::RC) {
        caps |= IBV_DEVICE_RC_RNR_NAK_GEN;
    }
    if attr.caps.intersects(CaCaps::MW_TYPE1 | CaCaps::MW_TYPE2) {
        caps |= IBV_DEVICE_MEM_WINDOW;
    }
    if attr.caps.contains(CaCaps::MW_TYPE2) {
        caps |= IBV_DEVICE_MEM_WINDOW_TYPE_2B;
    }
    let max_pkeys = snapshot
        .ports
        .iter()
        .map(|p| p.pkeys.len())
        .max()
        .unwrap_or(0);
    let mut out = IbvDeviceAttr {
        fw_ver: [0; 64],
        node_guid: attr.node_guid.get().to_be(),
        sys_image_guid: attr.system_image_guid.get().to_be(),
        max_mr_size: limits.max_mr_size,
        page_size_cap: snapshot.page_size_cap,
        vendor_id: attr.vendor_id,
        vendor_part_id: u32::from(attr.device_id),
        hw_ver: u32::from(attr.revision),
        max_qp: clamp(limits.max_qps),
        max_qp_wr: clamp(limits.max_wrs_per_qp),
        device_cap_flags: caps,
        max_sge: clamp(limits.max_sges),
        max_sge_rd: clamp(limits.max_sges),
        max_cq: clamp(limits.max_cqs),
        max_cqe: clamp(limits.max_cqes),
        max_mr: clamp(limits.max_mrs),
        max_pd: clamp(limits.max_pds),
        max_qp_rd_atom: clamp(limits.max_qp_rd_atomic),
        max_ee_rd_atom: 0,
        max_res_rd_atom: clamp(limits.max_qp_resp_res.saturating_mul(limits.max_qps)),
        max_qp_init_rd_atom: clamp(limits.max_qp_rd_atomic),
        max_ee_init_rd_atom: 0,
        atomic_cap: match attr.atomicity {
            Atomicity::None => IBV_ATOMIC_NONE,
            Atomicity::Hca => IBV_ATOMIC_HCA,
            Atomicity::Global => ibverbs_abi::IBV_ATOMIC_GLOB,
        },
        max_ee: 0,
        max_rdd: 0,
        max_mw: clamp(limits.max_mws),
        max_raw_ipv6_qp: 0,
        max_raw_ethy_qp: 0,
        max_mcast_grp: clamp(limits.max_mcast_groups),
        max_mcast_qp_attach: clamp(limits.max_qps_per_mcast_group),
        max_total_mcast_qp_attach: clamp(
            limits
                .max_mcast_groups
                .saturating_mul(limits.max_qps_per_mcast_group),
        ),
        max_ah: clamp(limits.max_avs),
        max_fmr: 0,
        max_map_per_fmr: 0,
        max_srq: clamp(limits.max_srqs),
        max_srq_wr: clamp(limits.max_srq_wrs),
        max_srq_sge: clamp(limits.max_srq_sges),
        max_pkeys: u16::try_from(max_pkeys).unwrap_or(u16::MAX),
        local_ca_ack_delay: attr.local_ack_delay,
        phys_port_cnt: u8::try_from(snapshot.ports.len()).unwrap_or(u8::MAX),
    };
    copy_c_string(&mut out.fw_ver, &firmware_text(attr.fw_version));
    out
}

/// rdma-core's port attributes from the port's.
fn port_attr(port: &PortSnapshot) -> IbvPortAttr {
    let attr = &port.attr;
    let ethernet = attr.link_layer == LinkLayer::Ethernet;
    let mut cap_flags = attr.caps.port_info_capability_mask();
    if ethernet {
        // RoCEv2 GIDs are the port's IP addresses.
        cap_flags |= IBV_PORT_IP_BASED_GIDS;
    }
    IbvPortAttr {
        state: u32::from(attr.state.code()),
        max_mtu: u32::from(attr.max_mtu.code()),
        active_mtu: u32::from(attr.active_mtu.code()),
        gid_tbl_len: c_int::try_from(port.gids.len()).unwrap_or(c_int::MAX),
        port_cap_flags: cap_flags,
        max_msg_sz: attr.max_msg_size,
        bad_pkey_cntr: attr.pkey_violations,
        qkey_viol_cntr: attr.qkey_violations,
        pkey_tbl_len: u16::try_from(port.pkeys.len()).unwrap_or(u16::MAX),
        lid: attr.lid.get(),
        sm_lid: attr.sm_lid.get(),
        lmc: attr.lmc,
        // One data VL: the simulated link has no virtual lanes (vl_str 1).
        max_vl_num: 1,
        sm_sl: attr.sm_sl,
        subnet_timeout: attr.subnet_timeout,
        init_type_reply: 0,
        // The simulated link has no width or rate: the lowest IBA values
        // (1X, 2.5 Gbps) rather than codes the tools call invalid.
        active_width: 1,
        active_speed: 1,
        // IBA physical states: LinkUp (5) when the port is up, Disabled (3)
        // when down.
        phys_state: if attr.state == PortState::Down { 3 } else { 5 },
        link_layer: if ethernet {
            IBV_LINK_LAYER_ETHERNET
        } else {
            IBV_LINK_LAYER_INFINIBAND
        },
        flags: 0,
        port_cap_flags2: 0,
    }
}

/// `ibv_query_device(context, device_attr)`: 0, or an errno value
/// (`EINVAL` for a context that is not open or a NULL attribute).
///
/// # Safety
///
/// `device_attr` is NULL or valid for a write of `struct ibv_device_attr`.
pub unsafe extern "C" fn ibv_query_device(
    context: *mut IbvContext,
    device_attr: *mut IbvDeviceAttr,
) -> c_int {
    guard(libc::EIO, || {
        if device_attr.is_null() {
            return libc::EINVAL;
        }
        match with_snapshot(context, |s| Ok(device_attr_of(s))) {
            Ok(attr) => {
                // SAFETY: non-NULL and valid for the write (the contract).
                unsafe { device_attr.write(attr) };
                0
            }
            Err(errno) => errno,
        }
    })
}

/// The `verbs_context.query_device_ex` entry (the `ibv_query_device_ex`
/// inline calls it with `sizeof(struct ibv_device_attr_ex)` as its
/// program was compiled): as rdma-core's providers, `attr_size` bytes are
/// written, the base attributes (`orig_attr`, as [`ibv_query_device`])
/// first and every extended field the size covers after them: what the CA
/// has of them (`device_cap_flags_ex`, the base flags; `phys_port_cnt_ex`)
/// and zero for what it lacks (ODP, completion timestamps and the core
/// clock, TSO, RSS, WQs, packet pacing, raw packet, tag matching, CQ
/// moderation, device memory, PCI atomics), `comp_mask` 0; bytes past
/// the struct this library knows are zeroed. 0, or an errno value:
/// `EINVAL` for a context that is not open, a NULL attribute, a size
/// below `orig_attr`'s, or input with `comp_mask` bits (none is defined).
///
/// # Safety
///
/// `input` is NULL or valid for a read of `struct
/// ibv_query_device_ex_input`; `attr` is NULL or valid for `attr_size`
/// bytes of writes.
pub(crate) unsafe extern "C" fn query_device_ex(
    context: *mut IbvContext,
    input: *const IbvQueryDeviceExInput,
    attr: *mut IbvDeviceAttrEx,
    attr_size: usize,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: NULL or valid for a read (the contract).
        if unsafe { input.as_ref() }.is_some_and(|input| input.comp_mask != 0) {
            return libc::EINVAL;
        }
        if attr.is_null() || attr_size < size_of::<IbvDeviceAttr>() {
            return libc::EINVAL;
        }
        let base = match with_snapshot(context, |s| Ok(device_attr_of(s))) {
            Ok(base) => base,
            Err(errno) => return errno,
        };
        let out = attr.cast::<u8>();
        // SAFETY: `attr` is valid for `attr_size` bytes of writes.
        unsafe { std::ptr::write_bytes(out, 0, attr_size) };
        // SAFETY: `orig_attr` is at offset 0 and `attr_size` covers it.
        unsafe { out.cast::<IbvDeviceAttr>().write_unaligned(base) };
        let flags_at = offset_of!(IbvDeviceAttrEx, device_cap_flags_ex);
        if attr_size >= flags_at + size_of::<u64>() {
            // SAFETY: within the `attr_size` bytes (checked just above).
            unsafe {
                out.wrapping_add(flags_at)
                    .cast::<u64>()
                    .write_unaligned(u64::from(base.device_cap_flags));
            }
        }
        let ports_at = offset_of!(IbvDeviceAttrEx, phys_port_cnt_ex);
        if attr_size >= ports_at + size_of::<u32>() {
            // SAFETY: within the `attr_size` bytes (checked just above).
            unsafe {
                out.wrapping_add(ports_at)
                    .cast::<u32>()
                    .write_unaligned(u32::from(base.phys_port_cnt));
            }
        }
        0
    })
}

/// Writes the first `len` bytes of `port`'s attributes to `out`.
///
/// # Safety
///
/// `out` is valid for `len` bytes of writes, `len <= size_of::<IbvPortAttr>()`.
unsafe fn write_port_attr(port: &PortSnapshot, out: *mut IbvPortAttr, len: usize) {
    let attr = port_attr(port);
    // SAFETY: `attr` is `len` or more readable bytes (a plain-data struct,
    // its padding-free layout checked against the header by ibverbs-abi),
    // `out` is valid for `len` bytes (the caller's contract), and the two
    // do not overlap (`attr` is a local).
    unsafe {
        std::ptr::copy_nonoverlapping(
            std::ptr::from_ref(&attr).cast::<u8>(),
            out.cast::<u8>(),
            len,
        );
    }
}

/// The `verbs_context.query_port` entry (`___ibv_query_port`, the
/// `ibv_query_port` inline, calls it with `sizeof(struct ibv_port_attr)`):
/// fills the first `port_attr_len` bytes (at most the whole struct). 0, or
/// an errno value: `EINVAL` for a context that is not open, a NULL
/// attribute or a port the CA does not have.
///
/// # Safety
///
/// `port_attr` is NULL or valid for `port_attr_len` bytes of writes.
pub(crate) unsafe extern "C" fn query_port_ex(
    context: *mut IbvContext,
    port_num: u8,
    port_attr: *mut IbvPortAttr,
    port_attr_len: usize,
) -> c_int {
    guard(libc::EIO, || {
        if port_attr.is_null() {
            return libc::EINVAL;
        }
        let len = port_attr_len.min(size_of::<IbvPortAttr>());
        with_snapshot(context, |s| {
            let port = s.port(u32::from(port_num))?;
            // SAFETY: `port_attr` is valid for `port_attr_len >= len` bytes.
            unsafe { write_port_attr(port, port_attr, len) };
            Ok(())
        })
        .err()
        .unwrap_or(0)
    })
}

/// `ibv_query_port@IBVERBS_1.1`: the compat entry, filling rdma-core's
/// `struct _compat_ibv_port_attr` (the inline falls back to it when the
/// context has no extended `query_port`). 0 or an errno value, as
/// the `verbs_context` entry.
///
/// # Safety
///
/// `port_attr` is NULL or valid for a write of `struct
/// _compat_ibv_port_attr` (48 bytes).
pub unsafe extern "C" fn ibv_query_port(
    context: *mut IbvContext,
    port_num: u8,
    port_attr: *mut IbvPortAttr,
) -> c_int {
    // SAFETY: the same pointer, valid for the compat struct's bytes.
    unsafe { query_port_ex(context, port_num, port_attr, COMPAT_PORT_ATTR_LEN) }
}

/// GID `index` of port `port`: its entry, `ENODATA` for an empty slot,
/// `EINVAL` for a port or index the CA does not have.
fn gid_entry(snapshot: &Snapshot, port: u32, index: u32) -> Result<IbvGidEntry, c_int> {
    let found = snapshot.port(port)?;
    let gid = usize::try_from(index)
        .ok()
        .and_then(|at| found.gids.get(at))
        .ok_or(libc::EINVAL)?;
    if *gid == Gid::ZERO {
        return Err(libc::ENODATA);
    }
    Ok(IbvGidEntry {
        gid: IbvGid { raw: gid.octets() },
        gid_index: index,
        port_num: port,
        gid_type: if found.attr.link_layer == LinkLayer::Ethernet {
            IBV_GID_TYPE_ROCE_V2
        } else {
            IBV_GID_TYPE_IB
        },
        // No Linux network device carries the simulated port.
        ndev_ifindex: 0,
    })
}

/// `ibv_query_gid(context, port_num, index, gid)`: 0 (an empty slot reads
/// as all zeros, as rdma-core's), or -1 with `errno` (`EINVAL` for a
/// context that is not open, a NULL GID, a bad port or index).
///
/// # Safety
///
/// `gid` is NULL or valid for a write of `union ibv_gid`.
pub unsafe extern "C" fn ibv_query_gid(
    context: *mut IbvContext,
    port_num: u8,
    index: c_int,
    gid: *mut IbvGid,
) -> c_int {
    guard(-1, || {
        let Ok(index) = u32::try_from(index) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if gid.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        let answer = match with_snapshot(context, |s| gid_entry(s, u32::from(port_num), index)) {
            Ok(entry) => entry.gid,
            Err(libc::ENODATA) => IbvGid::default(),
            Err(errno) => {
                set_errno(errno);
                return -1;
            }
        };
        // SAFETY: non-NULL and valid for the write (the contract).
        unsafe { gid.write(answer) };
        0
    })
}

/// `ibv_query_gid_type(context, port_num, index, type)` (rdma-core's
/// private entry `ibv_devinfo` uses): `IBV_GID_TYPE_SYSFS_ROCE_V2` for a
/// RoCEv2 GID, `IBV_GID_TYPE_SYSFS_IB_ROCE_V1` for an InfiniBand one or an
/// empty slot; 0, or -1 with `errno` as [`ibv_query_gid`].
///
/// # Safety
///
/// `gid_type` is NULL or valid for a write of a `u32`.
pub unsafe extern "C" fn ibv_query_gid_type(
    context: *mut IbvContext,
    port_num: u8,
    index: u32,
    gid_type: *mut u32,
) -> c_int {
    guard(-1, || {
        if gid_type.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        let answer = match with_snapshot(context, |s| gid_entry(s, u32::from(port_num), index)) {
            Ok(entry) if entry.gid_type == IBV_GID_TYPE_ROCE_V2 => IBV_GID_TYPE_SYSFS_ROCE_V2,
            Ok(_) | Err(libc::ENODATA) => IBV_GID_TYPE_SYSFS_IB_ROCE_V1,
            Err(errno) => {
                set_errno(errno);
                return -1;
            }
        };
        // SAFETY: non-NULL and valid for the write (the contract).
        unsafe { gid_type.write(answer) };
        0
    })
}

/// `_ibv_query_gid_ex(context, port_num, gid_index, entry, flags,
/// entry_size)` (the `ibv_query_gid_ex` inline): 0, or an errno value:
/// `ENODATA` for an empty slot, `EINVAL` for flags, a short entry, a NULL
/// entry, a context that is not open, a bad port or index.
///
/// # Safety
///
/// `entry` is NULL or valid for `entry_size` bytes of writes.
pub unsafe extern "C" fn _ibv_query_gid_ex(
    context: *mut IbvContext,
    port_num: u32,
    gid_index: u32,
    entry: *mut IbvGidEntry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    guard(libc::EIO, || {
        if flags != 0 || entry.is_null() || entry_size < size_of::<IbvGidEntry>() {
            return libc::EINVAL;
        }
        match with_snapshot(context, |s| gid_entry(s, port_num, gid_index)) {
            Ok(answer) => {
                // SAFETY: non-NULL and valid for at least the struct's
                // bytes (the contract, `entry_size` checked above).
                unsafe { entry.write(answer) };
                0
            }
            Err(errno) => errno,
        }
    })
}

/// `ibv_query_pkey(context, port_num, index, pkey)`: P_Key `index` of the
/// port in network byte order; 0, or -1 with `errno` (`EINVAL` for a
/// context that is not open, a NULL P_Key, a bad port or index).
///
/// # Safety
///
/// `pkey` is NULL or valid for a write of a `u16`.
pub unsafe extern "C" fn ibv_query_pkey(
    context: *mut IbvContext,
    port_num: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    guard(-1, || {
        if pkey.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        let found = with_snapshot(context, |s| {
            let port = s.port(u32::from(port_num))?;
            usize::try_from(index)
                .ok()
                .and_then(|at| port.pkeys.get(at))
                .map(|p| p.get())
                .ok_or(libc::EINVAL)
        });
        match found {
            Ok(value) => {
                // SAFETY: non-NULL and valid for the write (the contract).
                unsafe { pkey.write(value.to_be()) };
                0
            }
            Err(errno) => {
                set_errno(errno);
                -1
            }
        }
    })
}
