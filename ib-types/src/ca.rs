//! Channel adapter and port attributes: the QueryHCA answer (guide 6.1.2)
//! and the ModifyHCA request (guide 6.1.3, Table 6-1).
//!
//! # The attribute buffer
//!
//! QueryHCA answers with one variable-size buffer holding no pointers: every
//! table is found through a byte offset from the start of the buffer.
//!
//! ```text
//! 0                   CaAttrHeaderAbi: sizes, offsets, counts, CA data
//! page_sizes_offset   num_page_sizes x Le32                  (4-byte aligned)
//! ports_offset        num_ports x port_record_size           (4-byte aligned)
//!                     (PortAttrAbi of port 1, then port 2, ...)
//! for each port, in port order:
//!   pkey_table_offset   num_pkeys x PKey (network order)     (2-byte aligned)
//!   gid_table_offset    num_gids x Gid                       (2-byte aligned)
//! end of last table   vendor-private bytes, up to total_size
//! ```
//!
//! [`CaAttrParts::encode`] writes exactly this, with no padding, so its size
//! is the guide's formula ([`ca_attr_size`]): header, page sizes, port
//! records, then two bytes per P_Key and sixteen per GID of every port, plus
//! the vendor bytes a driver may append for its user-mode plug-in. Every field
//! has alignment 1, so alignment only matters to a C reader overlaying the
//! buffer; the rules above are the ones the guide's formula can keep (a GID
//! table after an odd number of P_Keys is only 2-byte aligned). A buffer too
//! small for the answer gets [`AbiError::Truncated`] carrying the size needed,
//! as the query verb reports it.
//!
//! # Decoding contract
//!
//! [`CaAttrView::parse`] checks the whole buffer before handing out anything,
//! so no accessor can fail or panic afterwards:
//! - `total_size` covers at least the header and fits the bytes supplied;
//!   bytes past `total_size` are ignored;
//! - the header, every port record and every code, flag set, range and
//!   reserved byte in them are valid;
//! - every region lies inside `total_size` (checked arithmetic), has the
//!   alignment above, and starts at or after the end of the region before it
//!   in the order above, so no table overlaps the header, the port array or
//!   another table; gaps are allowed and are not interpreted;
//! - every page size is a power of two;
//! - record *i* (0-based) describes port *i + 1*: ports 1..=num_ports appear
//!   exactly once each, in order.
//!
//! The vendor-private bytes are whatever lies between the end of the last
//! region and `total_size`.
//!
//! # Forward compatibility
//!
//! A later layout may give port records more fields: `port_record_size`
//! says how big each record is. A reader accepts any record size that is a
//! multiple of 4 and at least [`PORT_RECORD_SIZE`], reads the prefix it
//! knows and skips the tail unread. The header can grow the same way: the
//! page-size array may start after a longer header, and the bytes in between
//! are skipped. New fields must therefore be optional to understand.

use bitflags::bitflags;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Le16, Le32, Le64, Repr, ensure_zero, read_prefix};
use crate::scalars::{
    Gid, Lid, LinkLayer, Mtu, NodeGuid, PKey, PortGuid, PortNum, PortState, SystemImageGuid,
};

/// Size of the fixed header at the start of the attribute buffer.
pub const CA_ATTR_HEADER_SIZE: usize = core::mem::size_of::<CaAttrHeaderAbi>();

/// Size of the port record this version writes, and the smallest it reads.
pub const PORT_RECORD_SIZE: usize = core::mem::size_of::<PortAttrAbi>();

/// Required alignment (from the buffer start) of the page-size array, the
/// port array and every port record.
const ARRAY_ALIGN: usize = 4;

/// Required alignment of P_Key and GID tables.
const TABLE_ALIGN: usize = 2;

/// Largest IEEE OUI (24 bits).
const MAX_OUI: u32 = 0x00FF_FFFF;

/// Implements a strict `from_raw` for a `u32` bitflags type.
macro_rules! strict_flags {
    ($($name:ident),+ $(,)?) => {$(
        impl $name {
            /// Reads raw flags; unknown bits are an error.
            pub const fn from_raw(raw: u32) -> Result<Self, AbiError> {
                match Self::from_bits(raw) {
                    Some(flags) => Ok(flags),
                    None => Err(AbiError::ReservedNotZero {
                        field: stringify!($name),
                    }),
                }
            }
        }
    )+};
}

/// Checks `value <= max`, naming the field on failure.
fn at_most(field: &'static str, value: u8, max: u8) -> Result<u8, AbiError> {
    if value <= max {
        Ok(value)
    } else {
        Err(AbiError::OutOfRange {
            field,
            value: u64::from(value),
        })
    }
}

code_enum! {
    /// The atomicity guarantee of the CA's atomic operations.
    pub enum Atomicity: u8 {
        /// Atomic operations are not supported.
        None = 0,
        /// Atomic only with respect to other atomics issued through this CA.
        Hca = 1,
        /// Atomic also with respect to every other agent accessing the
        /// memory (other CAs and the host CPUs).
        Global = 2,
    }
}

bitflags! {
    /// Optional features of a CA, reported by QueryHCA.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct CaCaps: u32 {
        /// Ports keep a P_Key violation counter (it can be reset by ModifyHCA).
        const BAD_PKEY_COUNTER = 1 << 0;
        /// Ports keep a Q_Key violation counter (it can be reset by ModifyHCA).
        const BAD_QKEY_COUNTER = 1 << 1;
        /// Raw datagram QPs can take part in multicast.
        const RAW_MCAST = 1 << 2;
        /// Automatic path migration.
        const APM = 1 << 3;
        /// The CA checks that an address vector's port is the QP's port.
        const AV_PORT_CHECK = 1 << 4;
        /// The primary port can be changed on the SQD -> RTS transition.
        const CHANGE_PRIMARY_PORT = 1 << 5;
        /// ModifyQP can change a QP's work-queue depths.
        const MODIFY_WR_DEPTH = 1 << 6;
        /// An SRQ's depth can be changed after creation.
        const MODIFY_SRQ_DEPTH = 1 << 7;
        /// ModifyQP accepts the consumer's view of the current QP state.
        const CURRENT_QP_STATE = 1 << 8;
        /// ModifyHCA can shut a port down.
        const SHUTDOWN_PORT = 1 << 9;
        /// PortInfo InitType / InitTypeReply are supported.
        const INIT_TYPE = 1 << 10;
        /// An asynchronous event is raised when a port becomes active.
        const PORT_ACTIVE_EVENT = 1 << 11;
        /// The header's `system_image_guid` is meaningful.
        const SYSTEM_IMAGE_GUID = 1 << 12;
        /// The SMA and GSA agents run on the adapter itself.
        const HW_AGENTS = 1 << 13;
        /// The local MAD verb is supported.
        const LOCAL_MAD = 1 << 14;
        /// Shared receive queues.
        const SRQ = 1 << 15;
        /// Type 1 memory windows.
        const MW_TYPE1 = 1 << 16;
        /// Type 2 memory windows.
        const MW_TYPE2 = 1 << 17;
        /// Unreliable datagram multicast.
        const MULTICAST = 1 << 18;
        /// Reliable connected transport.
        const RC = 1 << 19;
        /// Unreliable connected transport.
        const UC = 1 << 20;
        /// Unreliable datagram transport.
        const UD = 1 << 21;
    }
}

bitflags! {
    /// Management capabilities of a port (mostly the PortInfo CapabilityMask
    /// bits of IBA 14.2.5.6, renumbered) plus the counters it keeps.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct PortCaps: u32 {
        /// A subnet manager runs on this port.
        const IS_SM = 1 << 0;
        /// The SM on this port was disabled out of band (C16-49).
        const IS_SM_DISABLED = 1 << 1;
        /// A connection manager is available on this port.
        const IS_CM = 1 << 2;
        /// An SNMP tunneling agent is present on this port.
        const IS_SNMP = 1 << 3;
        /// A device management agent is present on this port.
        const IS_DEV_MGMT = 1 << 4;
        /// Vendor-class management is supported on this port.
        const IS_VENDOR = 1 << 5;
        /// The port counts Q_Key violations.
        const QKEY_COUNTER = 1 << 6;
        /// The port counts P_Key violations.
        const PKEY_COUNTER = 1 << 7;
        /// Notices are supported.
        const IS_NOTICE = 1 << 8;
        /// Traps are supported.
        const IS_TRAP = 1 << 9;
        /// Automatic path migration is supported.
        const IS_APM = 1 << 10;
        /// SL-to-VL mapping is supported.
        const IS_SL_MAP = 1 << 11;
        /// The M_Key is kept in non-volatile memory.
        const IS_MKEY_NVRAM = 1 << 12;
        /// The P_Key table is kept in non-volatile memory.
        const IS_PKEY_NVRAM = 1 << 13;
        /// LedInfo is supported.
        const IS_LED_INFO = 1 << 14;
        /// The system image GUID is supported.
        const IS_SYSTEM_IMAGE_GUID = 1 << 15;
        /// Reinitialisation is supported.
        const IS_REINIT = 1 << 16;
        /// Boot management is supported.
        const IS_BOOT_MGMT = 1 << 17;
        /// Client reregistration is supported.
        const IS_CLIENT_REREG = 1 << 18;
    }
}

/// Each PortInfo-backed capability and its CapabilityMask bit (IBA 14.2.5.6).
const PORT_INFO_BITS: [(PortCaps, u32); 17] = [
    (PortCaps::IS_SM, 1),
    (PortCaps::IS_NOTICE, 2),
    (PortCaps::IS_TRAP, 3),
    (PortCaps::IS_APM, 5),
    (PortCaps::IS_SL_MAP, 6),
    (PortCaps::IS_MKEY_NVRAM, 7),
    (PortCaps::IS_PKEY_NVRAM, 8),
    (PortCaps::IS_LED_INFO, 9),
    (PortCaps::IS_SM_DISABLED, 10),
    (PortCaps::IS_SYSTEM_IMAGE_GUID, 11),
    (PortCaps::IS_CM, 16),
    (PortCaps::IS_SNMP, 17),
    (PortCaps::IS_REINIT, 18),
    (PortCaps::IS_DEV_MGMT, 19),
    (PortCaps::IS_VENDOR, 20),
    (PortCaps::IS_BOOT_MGMT, 23),
    (PortCaps::IS_CLIENT_REREG, 25),
];

impl PortCaps {
    /// The PortInfo CapabilityMask advertising these capabilities, as the
    /// SMA reports it (the counter bits have no PortInfo counterpart).
    pub const fn port_info_capability_mask(self) -> u32 {
        let mut mask = 0;
        let mut i = 0;
        while i < PORT_INFO_BITS.len() {
            let (cap, bit) = PORT_INFO_BITS[i];
            if self.contains(cap) {
                mask |= 1 << bit;
            }
            i += 1;
        }
        mask
    }
}

bitflags! {
    /// The attributes ModifyHCA changes on a port (guide Table 6-1).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct CaModifyFlags: u32 {
        /// A connection manager is available ([`PortCaps::IS_CM`]).
        const IS_CM_SUPPORTED = 1 << 0;
        /// An SNMP agent is present ([`PortCaps::IS_SNMP`]).
        const IS_SNMP_SUPPORTED = 1 << 1;
        /// A device management agent is present ([`PortCaps::IS_DEV_MGMT`]).
        const IS_DEV_MGMT_SUPPORTED = 1 << 2;
        /// Vendor management is present ([`PortCaps::IS_VENDOR`]).
        const IS_VENDOR_SUPPORTED = 1 << 3;
        /// A subnet manager runs on the port ([`PortCaps::IS_SM`]).
        const IS_SM = 1 << 4;
        /// SM support was turned off out of band ([`PortCaps::IS_SM_DISABLED`]).
        const IS_SM_DISABLED = 1 << 5;
        /// Zero the port's Q_Key violation counter (an action, not a state).
        const RESET_QKEY_COUNTER = 1 << 6;
        /// Zero the port's P_Key violation counter (an action, not a state).
        const RESET_PKEY_COUNTER = 1 << 7;
    }
}

/// Each capability bit of [`CaModifyFlags`] and the port capability it sets.
const MODIFY_CAPS: [(CaModifyFlags, PortCaps); 6] = [
    (CaModifyFlags::IS_CM_SUPPORTED, PortCaps::IS_CM),
    (CaModifyFlags::IS_SNMP_SUPPORTED, PortCaps::IS_SNMP),
    (CaModifyFlags::IS_DEV_MGMT_SUPPORTED, PortCaps::IS_DEV_MGMT),
    (CaModifyFlags::IS_VENDOR_SUPPORTED, PortCaps::IS_VENDOR),
    (CaModifyFlags::IS_SM, PortCaps::IS_SM),
    (CaModifyFlags::IS_SM_DISABLED, PortCaps::IS_SM_DISABLED),
];

impl CaModifyFlags {
    /// The bits that name a port capability (settable and clearable).
    pub const CAPABILITIES: Self = Self::IS_CM_SUPPORTED
        .union(Self::IS_SNMP_SUPPORTED)
        .union(Self::IS_DEV_MGMT_SUPPORTED)
        .union(Self::IS_VENDOR_SUPPORTED)
        .union(Self::IS_SM)
        .union(Self::IS_SM_DISABLED);

    /// The counter resets (only meaningful in [`CaModify::set`]).
    pub const RESETS: Self = Self::RESET_QKEY_COUNTER.union(Self::RESET_PKEY_COUNTER);

    /// The port capabilities named by the capability bits.
    pub const fn port_caps(self) -> PortCaps {
        let mut caps = PortCaps::empty();
        let mut i = 0;
        while i < MODIFY_CAPS.len() {
            let (flag, cap) = MODIFY_CAPS[i];
            if self.contains(flag) {
                caps = caps.union(cap);
            }
            i += 1;
        }
        caps
    }
}

strict_flags!(CaCaps, PortCaps, CaModifyFlags);

/// Resource limits of a CA (all maxima over the whole CA unless noted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CaLimits {
    /// Queue pairs.
    pub max_qps: u32,
    /// Work requests outstanding on one work queue.
    pub max_wrs_per_qp: u32,
    /// Scatter/gather elements per work request.
    pub max_sges: u32,
    /// Completion queues.
    pub max_cqs: u32,
    /// Entries of one completion queue.
    pub max_cqes: u32,
    /// Shared receive queues.
    pub max_srqs: u32,
    /// Work requests outstanding on one SRQ.
    pub max_srq_wrs: u32,
    /// Scatter/gather elements per SRQ work request.
    pub max_srq_sges: u32,
    /// Protection domains.
    pub max_pds: u32,
    /// Memory regions.
    pub max_mrs: u32,
    /// Bytes of one memory region.
    pub max_mr_size: u64,
    /// Memory windows.
    pub max_mws: u32,
    /// Address vectors.
    pub max_avs: u32,
    /// Multicast groups.
    pub max_mcast_groups: u32,
    /// QPs attached to one multicast group.
    pub max_qps_per_mcast_group: u32,
    /// RDMA reads and atomics one QP may have outstanding as initiator.
    pub max_qp_rd_atomic: u32,
    /// RDMA reads and atomics one QP may serve at once as responder.
    pub max_qp_resp_res: u32,
    /// Bytes of inline data in one send work request.
    pub max_inline_data: u32,
}

/// Where the parts of the attribute buffer live. Decoding reports them;
/// [`CaAttrParts::encode`] computes them and ignores the values supplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CaLayout {
    /// Bytes of the whole answer, vendor bytes included.
    pub total_size: u32,
    /// Offset of the page-size array.
    pub page_sizes_offset: u32,
    /// Entries of the page-size array.
    pub num_page_sizes: u32,
    /// Offset of the port array.
    pub ports_offset: u32,
    /// Bytes of each port record (see the forward-compatibility rule).
    pub port_record_size: u32,
    /// Ports of the CA, numbered 1..=num_ports.
    pub num_ports: u8,
}

/// The fixed part of the CA attributes (the buffer's header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CaAttr {
    /// The CA GUID (EUI-64), which is its node GUID.
    pub node_guid: NodeGuid,
    /// The system image GUID ([`CaCaps::SYSTEM_IMAGE_GUID`] says if valid).
    pub system_image_guid: SystemImageGuid,
    /// IEEE OUI of the vendor (24 bits).
    pub vendor_id: u32,
    /// Vendor-assigned device ID.
    pub device_id: u16,
    /// Hardware revision.
    pub revision: u16,
    /// Firmware version, vendor encoded.
    pub fw_version: u64,
    /// Resource limits.
    pub limits: CaLimits,
    /// Local CA ACK delay exponent (0..=31; 4.096 us * 2^value).
    pub local_ack_delay: u8,
    /// Atomic operation guarantee.
    pub atomicity: Atomicity,
    /// Optional features.
    pub caps: CaCaps,
    /// Sizes, counts and offsets of the buffer.
    pub layout: CaLayout,
}

/// Layout of the buffer header ([`CaAttr`]).
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CaAttrHeaderAbi {
    /// [`CaLayout::total_size`].
    pub total_size: Le32,
    /// [`CaLayout::page_sizes_offset`].
    pub page_sizes_offset: Le32,
    /// [`CaLayout::num_page_sizes`].
    pub num_page_sizes: Le32,
    /// [`CaLayout::ports_offset`].
    pub ports_offset: Le32,
    /// [`CaLayout::port_record_size`].
    pub port_record_size: Le32,
    /// [`CaLayout::num_ports`].
    pub num_ports: u8,
    /// [`CaAttr::local_ack_delay`].
    pub local_ack_delay: u8,
    /// [`Atomicity`] code.
    pub atomicity: u8,
    /// Must be zero.
    pub reserved_at_0x17: [u8; 1],
    /// [`CaAttr::node_guid`].
    pub node_guid: NodeGuid,
    /// [`CaAttr::system_image_guid`].
    pub system_image_guid: SystemImageGuid,
    /// [`CaAttr::fw_version`].
    pub fw_version: Le64,
    /// [`CaAttr::vendor_id`].
    pub vendor_id: Le32,
    /// [`CaAttr::device_id`].
    pub device_id: Le16,
    /// [`CaAttr::revision`].
    pub revision: Le16,
    /// [`CaCaps`] bits.
    pub caps: Le32,
    /// [`CaLimits::max_qps`].
    pub max_qps: Le32,
    /// [`CaLimits::max_wrs_per_qp`].
    pub max_wrs_per_qp: Le32,
    /// [`CaLimits::max_sges`].
    pub max_sges: Le32,
    /// [`CaLimits::max_cqs`].
    pub max_cqs: Le32,
    /// [`CaLimits::max_cqes`].
    pub max_cqes: Le32,
    /// [`CaLimits::max_srqs`].
    pub max_srqs: Le32,
    /// [`CaLimits::max_srq_wrs`].
    pub max_srq_wrs: Le32,
    /// [`CaLimits::max_srq_sges`].
    pub max_srq_sges: Le32,
    /// [`CaLimits::max_pds`].
    pub max_pds: Le32,
    /// [`CaLimits::max_mr_size`].
    pub max_mr_size: Le64,
    /// [`CaLimits::max_mrs`].
    pub max_mrs: Le32,
    /// [`CaLimits::max_mws`].
    pub max_mws: Le32,
    /// [`CaLimits::max_avs`].
    pub max_avs: Le32,
    /// [`CaLimits::max_mcast_groups`].
    pub max_mcast_groups: Le32,
    /// [`CaLimits::max_qps_per_mcast_group`].
    pub max_qps_per_mcast_group: Le32,
    /// [`CaLimits::max_qp_rd_atomic`].
    pub max_qp_rd_atomic: Le32,
    /// [`CaLimits::max_qp_resp_res`].
    pub max_qp_resp_res: Le32,
    /// [`CaLimits::max_inline_data`].
    pub max_inline_data: Le32,
}

assert_layout!(
    CaAttrHeaderAbi,
    size = 136,
    total_size @ 0x00,
    page_sizes_offset @ 0x04,
    num_page_sizes @ 0x08,
    ports_offset @ 0x0C,
    port_record_size @ 0x10,
    num_ports @ 0x14,
    local_ack_delay @ 0x15,
    atomicity @ 0x16,
    reserved_at_0x17 @ 0x17,
    node_guid @ 0x18,
    system_image_guid @ 0x20,
    fw_version @ 0x28,
    vendor_id @ 0x30,
    device_id @ 0x34,
    revision @ 0x36,
    caps @ 0x38,
    max_qps @ 0x3C,
    max_wrs_per_qp @ 0x40,
    max_sges @ 0x44,
    max_cqs @ 0x48,
    max_cqes @ 0x4C,
    max_srqs @ 0x50,
    max_srq_wrs @ 0x54,
    max_srq_sges @ 0x58,
    max_pds @ 0x5C,
    max_mr_size @ 0x60,
    max_mrs @ 0x68,
    max_mws @ 0x6C,
    max_avs @ 0x70,
    max_mcast_groups @ 0x74,
    max_qps_per_mcast_group @ 0x78,
    max_qp_rd_atomic @ 0x7C,
    max_qp_resp_res @ 0x80,
    max_inline_data @ 0x84,
);

impl Repr for CaAttr {
    type Abi = CaAttrHeaderAbi;

    /// Checks the header on its own; the offsets are checked against a buffer
    /// by [`CaAttrView::parse`].
    fn parse(abi: &CaAttrHeaderAbi) -> Result<Self, AbiError> {
        ensure_zero("CaAttrHeaderAbi.reserved_at_0x17", &abi.reserved_at_0x17)?;
        let vendor_id = abi.vendor_id.get();
        if vendor_id > MAX_OUI {
            return Err(AbiError::OutOfRange {
                field: "CaAttr.vendor_id",
                value: u64::from(vendor_id),
            });
        }
        Ok(Self {
            node_guid: abi.node_guid,
            system_image_guid: abi.system_image_guid,
            vendor_id,
            device_id: abi.device_id.get(),
            revision: abi.revision.get(),
            fw_version: abi.fw_version.get(),
            limits: CaLimits {
                max_qps: abi.max_qps.get(),
                max_wrs_per_qp: abi.max_wrs_per_qp.get(),
                max_sges: abi.max_sges.get(),
                max_cqs: abi.max_cqs.get(),
                max_cqes: abi.max_cqes.get(),
                max_srqs: abi.max_srqs.get(),
                max_srq_wrs: abi.max_srq_wrs.get(),
                max_srq_sges: abi.max_srq_sges.get(),
                max_pds: abi.max_pds.get(),
                max_mrs: abi.max_mrs.get(),
                max_mr_size: abi.max_mr_size.get(),
                max_mws: abi.max_mws.get(),
                max_avs: abi.max_avs.get(),
                max_mcast_groups: abi.max_mcast_groups.get(),
                max_qps_per_mcast_group: abi.max_qps_per_mcast_group.get(),
                max_qp_rd_atomic: abi.max_qp_rd_atomic.get(),
                max_qp_resp_res: abi.max_qp_resp_res.get(),
                max_inline_data: abi.max_inline_data.get(),
            },
            local_ack_delay: at_most("CaAttr.local_ack_delay", abi.local_ack_delay, 31)?,
            atomicity: Atomicity::from_code(abi.atomicity)?,
            caps: CaCaps::from_raw(abi.caps.get())?,
            layout: CaLayout {
                total_size: abi.total_size.get(),
                page_sizes_offset: abi.page_sizes_offset.get(),
                num_page_sizes: abi.num_page_sizes.get(),
                ports_offset: abi.ports_offset.get(),
                port_record_size: abi.port_record_size.get(),
                num_ports: abi.num_ports,
            },
        })
    }

    fn emit(&self) -> CaAttrHeaderAbi {
        let (l, lim) = (&self.layout, &self.limits);
        CaAttrHeaderAbi {
            total_size: l.total_size.into(),
            page_sizes_offset: l.page_sizes_offset.into(),
            num_page_sizes: l.num_page_sizes.into(),
            ports_offset: l.ports_offset.into(),
            port_record_size: l.port_record_size.into(),
            num_ports: l.num_ports,
            local_ack_delay: self.local_ack_delay,
            atomicity: self.atomicity.code(),
            reserved_at_0x17: [0; 1],
            node_guid: self.node_guid,
            system_image_guid: self.system_image_guid,
            fw_version: self.fw_version.into(),
            vendor_id: self.vendor_id.into(),
            device_id: self.device_id.into(),
            revision: self.revision.into(),
            caps: self.caps.bits().into(),
            max_qps: lim.max_qps.into(),
            max_wrs_per_qp: lim.max_wrs_per_qp.into(),
            max_sges: lim.max_sges.into(),
            max_cqs: lim.max_cqs.into(),
            max_cqes: lim.max_cqes.into(),
            max_srqs: lim.max_srqs.into(),
            max_srq_wrs: lim.max_srq_wrs.into(),
            max_srq_sges: lim.max_srq_sges.into(),
            max_pds: lim.max_pds.into(),
            max_mr_size: lim.max_mr_size.into(),
            max_mrs: lim.max_mrs.into(),
            max_mws: lim.max_mws.into(),
            max_avs: lim.max_avs.into(),
            max_mcast_groups: lim.max_mcast_groups.into(),
            max_qps_per_mcast_group: lim.max_qps_per_mcast_group.into(),
            max_qp_rd_atomic: lim.max_qp_rd_atomic.into(),
            max_qp_resp_res: lim.max_qp_resp_res.into(),
            max_inline_data: lim.max_inline_data.into(),
        }
    }
}

/// Where a port's tables live. Decoding reports them; [`CaAttrParts::encode`]
/// computes them and ignores the values supplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PortTables {
    /// Entries of the P_Key table.
    pub num_pkeys: u16,
    /// Entries of the GID table.
    pub num_gids: u16,
    /// Offset of the P_Key table from the start of the buffer.
    pub pkey_table_offset: u32,
    /// Offset of the GID table from the start of the buffer.
    pub gid_table_offset: u32,
}

/// The attributes of one port (one record of the port array).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PortAttr {
    /// The port's number (1-based).
    pub port_num: PortNum,
    /// The link layer the port runs.
    pub link_layer: LinkLayer,
    /// Logical port state.
    pub state: PortState,
    /// MTU currently in use.
    pub active_mtu: Mtu,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// The port GUID.
    pub port_guid: PortGuid,
    /// Base LID.
    pub lid: Lid,
    /// LID mask control: the port answers 2^lmc LIDs from `lid` (0..=7).
    pub lmc: u8,
    /// LID of the subnet manager.
    pub sm_lid: Lid,
    /// Service level to reach the subnet manager (0..=15).
    pub sm_sl: u8,
    /// Subnet timeout exponent (0..=31; 4.096 us * 2^value).
    pub subnet_timeout: u8,
    /// Largest message, in bytes.
    pub max_msg_size: u32,
    /// Management capabilities and counters.
    pub caps: PortCaps,
    /// Q_Key violations counted.
    pub qkey_violations: u32,
    /// P_Key violations counted.
    pub pkey_violations: u32,
    /// Counts and offsets of the port's tables.
    pub tables: PortTables,
}

/// Layout of one port record ([`PortAttr`]).
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct PortAttrAbi {
    /// [`PortAttr::port_num`].
    pub port_num: u8,
    /// [`LinkLayer`] code.
    pub link_layer: u8,
    /// [`PortState`] code.
    pub state: u8,
    /// [`Mtu`] code of [`PortAttr::active_mtu`].
    pub active_mtu: u8,
    /// [`Mtu`] code of [`PortAttr::max_mtu`].
    pub max_mtu: u8,
    /// [`PortAttr::lmc`].
    pub lmc: u8,
    /// [`PortAttr::sm_sl`].
    pub sm_sl: u8,
    /// [`PortAttr::subnet_timeout`].
    pub subnet_timeout: u8,
    /// [`PortAttr::port_guid`].
    pub port_guid: PortGuid,
    /// [`PortAttr::lid`].
    pub lid: Lid,
    /// [`PortAttr::sm_lid`].
    pub sm_lid: Lid,
    /// [`PortTables::num_pkeys`].
    pub num_pkeys: Le16,
    /// [`PortTables::num_gids`].
    pub num_gids: Le16,
    /// [`PortTables::pkey_table_offset`].
    pub pkey_table_offset: Le32,
    /// [`PortTables::gid_table_offset`].
    pub gid_table_offset: Le32,
    /// [`PortCaps`] bits.
    pub caps: Le32,
    /// [`PortAttr::max_msg_size`].
    pub max_msg_size: Le32,
    /// [`PortAttr::qkey_violations`].
    pub qkey_violations: Le32,
    /// [`PortAttr::pkey_violations`].
    pub pkey_violations: Le32,
}

assert_layout!(
    PortAttrAbi,
    size = 48,
    port_num @ 0x00,
    link_layer @ 0x01,
    state @ 0x02,
    active_mtu @ 0x03,
    max_mtu @ 0x04,
    lmc @ 0x05,
    sm_sl @ 0x06,
    subnet_timeout @ 0x07,
    port_guid @ 0x08,
    lid @ 0x10,
    sm_lid @ 0x12,
    num_pkeys @ 0x14,
    num_gids @ 0x16,
    pkey_table_offset @ 0x18,
    gid_table_offset @ 0x1C,
    caps @ 0x20,
    max_msg_size @ 0x24,
    qkey_violations @ 0x28,
    pkey_violations @ 0x2C,
);

impl Repr for PortAttr {
    type Abi = PortAttrAbi;

    /// Checks the record on its own; the table offsets are checked against a
    /// buffer by [`CaAttrView::parse`].
    fn parse(abi: &PortAttrAbi) -> Result<Self, AbiError> {
        Ok(Self {
            port_num: PortNum::new(abi.port_num)?,
            link_layer: LinkLayer::from_code(abi.link_layer)?,
            state: PortState::from_code(abi.state)?,
            active_mtu: Mtu::from_code(abi.active_mtu)?,
            max_mtu: Mtu::from_code(abi.max_mtu)?,
            port_guid: abi.port_guid,
            lid: abi.lid,
            lmc: at_most("PortAttr.lmc", abi.lmc, 7)?,
            sm_lid: abi.sm_lid,
            sm_sl: at_most("PortAttr.sm_sl", abi.sm_sl, 15)?,
            subnet_timeout: at_most("PortAttr.subnet_timeout", abi.subnet_timeout, 31)?,
            max_msg_size: abi.max_msg_size.get(),
            caps: PortCaps::from_raw(abi.caps.get())?,
            qkey_violations: abi.qkey_violations.get(),
            pkey_violations: abi.pkey_violations.get(),
            tables: PortTables {
                num_pkeys: abi.num_pkeys.get(),
                num_gids: abi.num_gids.get(),
                pkey_table_offset: abi.pkey_table_offset.get(),
                gid_table_offset: abi.gid_table_offset.get(),
            },
        })
    }

    fn emit(&self) -> PortAttrAbi {
        let t = &self.tables;
        PortAttrAbi {
            port_num: self.port_num.get(),
            link_layer: self.link_layer.code(),
            state: self.state.code(),
            active_mtu: self.active_mtu.code(),
            max_mtu: self.max_mtu.code(),
            lmc: self.lmc,
            sm_sl: self.sm_sl,
            subnet_timeout: self.subnet_timeout,
            port_guid: self.port_guid,
            lid: self.lid,
            sm_lid: self.sm_lid,
            num_pkeys: t.num_pkeys.into(),
            num_gids: t.num_gids.into(),
            pkey_table_offset: t.pkey_table_offset.into(),
            gid_table_offset: t.gid_table_offset.into(),
            caps: self.caps.bits().into(),
            max_msg_size: self.max_msg_size.into(),
            qkey_violations: self.qkey_violations.into(),
            pkey_violations: self.pkey_violations.into(),
        }
    }
}

impl PortAttr {
    /// Applies a ModifyHCA request to this port: capabilities in
    /// [`CaModify::set`] are turned on, those in [`CaModify::clear`] off, and
    /// each requested counter reset zeroes its counter. A request for another
    /// port is refused and changes nothing.
    pub fn apply(&mut self, modify: &CaModify) -> Result<(), AbiError> {
        if modify.port != self.port_num {
            return Err(AbiError::OutOfRange {
                field: "CaModify.port",
                value: u64::from(modify.port.get()),
            });
        }
        self.caps.insert(modify.set.port_caps());
        self.caps.remove(modify.clear.port_caps());
        if modify.set.contains(CaModifyFlags::RESET_QKEY_COUNTER) {
            self.qkey_violations = 0;
        }
        if modify.set.contains(CaModifyFlags::RESET_PKEY_COUNTER) {
            self.pkey_violations = 0;
        }
        Ok(())
    }
}

/// A ModifyHCA request (guide 6.1.3): changes the capabilities one port
/// advertises and resets its violation counters.
///
/// Capability bits in `set` are turned on, those in `clear` turned off, and
/// bits in neither keep their value. Counter resets are actions, so they may
/// appear only in `set`. A bit may not be both set and cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CaModify {
    port: PortNum,
    set: CaModifyFlags,
    clear: CaModifyFlags,
}

/// Layout of [`CaModify`].
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CaModifyAbi {
    /// The port to modify.
    pub port: u8,
    /// Must be zero.
    pub reserved_at_0x1: [u8; 3],
    /// [`CaModifyFlags`] to set (and counters to reset).
    pub set: Le32,
    /// [`CaModifyFlags`] to clear.
    pub clear: Le32,
}

assert_layout!(
    CaModifyAbi,
    size = 12,
    port @ 0x0,
    reserved_at_0x1 @ 0x1,
    set @ 0x4,
    clear @ 0x8,
);

impl CaModify {
    /// A request for `port`; fails if `clear` holds a counter reset or
    /// shares a bit with `set`.
    pub const fn new(
        port: PortNum,
        set: CaModifyFlags,
        clear: CaModifyFlags,
    ) -> Result<Self, AbiError> {
        if clear.intersects(CaModifyFlags::RESETS) || clear.intersects(set) {
            return Err(AbiError::OutOfRange {
                field: "CaModify.clear",
                value: clear.bits() as u64,
            });
        }
        Ok(Self { port, set, clear })
    }

    /// The port to modify.
    pub const fn port(&self) -> PortNum {
        self.port
    }

    /// Capabilities to turn on and counters to reset.
    pub const fn set(&self) -> CaModifyFlags {
        self.set
    }

    /// Capabilities to turn off.
    pub const fn clear(&self) -> CaModifyFlags {
        self.clear
    }

    /// Checks the request against the CA: the port exists, and each counter
    /// it resets is one the CA keeps ([`CaCaps::BAD_QKEY_COUNTER`],
    /// [`CaCaps::BAD_PKEY_COUNTER`]).
    pub fn validate_for(&self, ca: &CaAttr) -> Result<(), AbiError> {
        if self.port.get() > ca.layout.num_ports {
            return Err(AbiError::OutOfRange {
                field: "CaModify.port",
                value: u64::from(self.port.get()),
            });
        }
        let mut supported = CaModifyFlags::CAPABILITIES;
        supported.set(
            CaModifyFlags::RESET_QKEY_COUNTER,
            ca.caps.contains(CaCaps::BAD_QKEY_COUNTER),
        );
        supported.set(
            CaModifyFlags::RESET_PKEY_COUNTER,
            ca.caps.contains(CaCaps::BAD_PKEY_COUNTER),
        );
        let unsupported = self.set.difference(supported);
        if unsupported.is_empty() {
            Ok(())
        } else {
            Err(AbiError::OutOfRange {
                field: "CaModify.set",
                value: u64::from(unsupported.bits()),
            })
        }
    }
}

impl Repr for CaModify {
    type Abi = CaModifyAbi;

    fn parse(abi: &CaModifyAbi) -> Result<Self, AbiError> {
        ensure_zero("CaModifyAbi.reserved_at_0x1", &abi.reserved_at_0x1)?;
        Self::new(
            PortNum::new(abi.port)?,
            CaModifyFlags::from_raw(abi.set.get())?,
            CaModifyFlags::from_raw(abi.clear.get())?,
        )
    }

    fn emit(&self) -> CaModifyAbi {
        CaModifyAbi {
            port: self.port.get(),
            reserved_at_0x1: [0; 3],
            set: self.set.bits().into(),
            clear: self.clear.bits().into(),
        }
    }
}

/// The guide's size formula (6.1.2): header, `num_page_sizes` page sizes,
/// one record per port, each port's P_Key and GID tables given as
/// `(num_pkeys, num_gids)`, and `vendor_len` vendor bytes.
///
/// Fails with [`AbiError::OutOfRange`] for more than 255 ports or a table of
/// more than 65535 entries, and [`AbiError::BadLength`] when the total does
/// not fit the 32-bit `total_size`.
pub fn ca_attr_size<I>(
    num_page_sizes: usize,
    ports: I,
    vendor_len: usize,
) -> Result<usize, AbiError>
where
    I: IntoIterator<Item = (usize, usize)>,
{
    const PKEY: u64 = core::mem::size_of::<PKey>() as u64;
    const GID: u64 = core::mem::size_of::<Gid>() as u64;
    let too_big = |declared: Option<u64>| AbiError::BadLength {
        field: "CaAttr.total_size",
        declared: declared.unwrap_or(u64::MAX),
        available: u64::from(u32::MAX),
    };
    let mut total = (num_page_sizes as u64)
        .checked_mul(4)
        .and_then(|n| n.checked_add(CA_ATTR_HEADER_SIZE as u64))
        .and_then(|n| n.checked_add(vendor_len as u64))
        .ok_or(too_big(None))?;
    for (count, (pkeys, gids)) in ports.into_iter().enumerate() {
        if count >= usize::from(u8::MAX) {
            return Err(AbiError::OutOfRange {
                field: "CaAttr.num_ports",
                value: count as u64 + 1,
            });
        }
        for (field, n) in [("PortAttr.num_pkeys", pkeys), ("PortAttr.num_gids", gids)] {
            if n > usize::from(u16::MAX) {
                return Err(AbiError::OutOfRange {
                    field,
                    value: n as u64,
                });
            }
        }
        // Each term is below 2^21, so only the sum needs checking.
        total = total
            .checked_add(PORT_RECORD_SIZE as u64 + pkeys as u64 * PKEY + gids as u64 * GID)
            .ok_or(too_big(None))?;
    }
    if total > u64::from(u32::MAX) {
        return Err(too_big(Some(total)));
    }
    usize::try_from(total).map_err(|_| too_big(Some(total)))
}

/// One port's contribution to the attribute buffer.
#[derive(Debug, Clone, Copy)]
pub struct PortData<'a> {
    /// The port's attributes (`tables` is filled in by the encoder).
    pub attr: PortAttr,
    /// The P_Key table.
    pub pkeys: &'a [PKey],
    /// The GID table.
    pub gids: &'a [Gid],
}

/// Everything a QueryHCA answer holds, borrowed, ready to be encoded.
#[derive(Debug, Clone, Copy)]
pub struct CaAttrParts<'a> {
    /// The fixed attributes (`layout` is filled in by the encoder).
    pub attr: CaAttr,
    /// Supported page sizes in bytes, each a power of two.
    pub page_sizes: &'a [u32],
    /// The ports, port 1 first, numbered consecutively.
    pub ports: &'a [PortData<'a>],
    /// Vendor-private bytes appended after the tables.
    pub vendor_data: &'a [u8],
}

/// Copies `src` into `out` at `at`, returning the end offset.
fn put(out: &mut [u8], at: usize, src: &[u8]) -> Result<usize, AbiError> {
    let end = at.checked_add(src.len());
    match end.and_then(|end| out.get_mut(at..end)) {
        Some(dst) => {
            dst.copy_from_slice(src);
            Ok(at + src.len())
        }
        None => Err(AbiError::Truncated {
            needed: end.unwrap_or(usize::MAX),
            got: out.len(),
        }),
    }
}

/// Checks that a page size is a power of two.
fn check_page_size(size: u32) -> Result<(), AbiError> {
    if size.is_power_of_two() {
        Ok(())
    } else {
        Err(AbiError::OutOfRange {
            field: "CaAttr.page_sizes",
            value: u64::from(size),
        })
    }
}

impl CaAttrParts<'_> {
    /// Bytes the encoding takes ([`ca_attr_size`]).
    pub fn encoded_len(&self) -> Result<usize, AbiError> {
        ca_attr_size(
            self.page_sizes.len(),
            self.ports.iter().map(|p| (p.pkeys.len(), p.gids.len())),
            self.vendor_data.len(),
        )
    }

    /// Writes the attribute buffer into the front of `out`, filling every
    /// size, count and offset, and returns the bytes written.
    ///
    /// A short `out` gets [`AbiError::Truncated`] with the size needed and is
    /// left untouched. Values [`CaAttrView::parse`] would reject (an
    /// out-of-range field, a bad page size, ports not numbered 1, 2, ...)
    /// are refused with the error `parse` would give; `out` then holds a
    /// partial encoding.
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, AbiError> {
        let size = self.encoded_len()?;
        if out.len() < size {
            return Err(AbiError::Truncated {
                needed: size,
                got: out.len(),
            });
        }
        // `size` fits in u32, so every offset below does too.
        let page_sizes_offset = CA_ATTR_HEADER_SIZE;
        let ports_offset = page_sizes_offset + self.page_sizes.len() * 4;
        let mut attr = self.attr;
        attr.layout = CaLayout {
            total_size: size as u32,
            page_sizes_offset: page_sizes_offset as u32,
            num_page_sizes: self.page_sizes.len() as u32,
            ports_offset: ports_offset as u32,
            port_record_size: PORT_RECORD_SIZE as u32,
            num_ports: self.ports.len() as u8,
        };
        let header = attr.emit();
        CaAttr::parse(&header)?;
        put(out, 0, header.as_bytes())?;

        let mut at = page_sizes_offset;
        for &page_size in self.page_sizes {
            check_page_size(page_size)?;
            at = put(out, at, Le32::new(page_size).as_bytes())?;
        }

        let mut record_at = ports_offset;
        let mut table_at = ports_offset + self.ports.len() * PORT_RECORD_SIZE;
        for (index, port) in self.ports.iter().enumerate() {
            let mut pa = port.attr;
            if usize::from(pa.port_num.get()) != index + 1 {
                return Err(AbiError::OutOfRange {
                    field: "PortAttr.port_num",
                    value: u64::from(pa.port_num.get()),
                });
            }
            let pkey_bytes = port.pkeys.as_bytes();
            pa.tables = PortTables {
                num_pkeys: port.pkeys.len() as u16,
                num_gids: port.gids.len() as u16,
                pkey_table_offset: table_at as u32,
                gid_table_offset: (table_at + pkey_bytes.len()) as u32,
            };
            let record = pa.emit();
            PortAttr::parse(&record)?;
            record_at = put(out, record_at, record.as_bytes())?;
            table_at = put(out, table_at, pkey_bytes)?;
            table_at = put(out, table_at, port.gids.as_bytes())?;
        }
        let end = put(out, table_at, self.vendor_data)?;
        debug_assert_eq!(end, size);
        Ok(end)
    }
}

/// Checks one region of `count` entries of `entry` bytes at `offset` within
/// `bytes`: inside it, aligned, and starting no earlier than `min_start`.
fn region<'a>(
    bytes: &'a [u8],
    (offset_field, count_field): (&'static str, &'static str),
    offset: u32,
    count: usize,
    entry: usize,
    (align, min_start): (usize, usize),
) -> Result<&'a [u8], AbiError> {
    let available = bytes.len() as u64;
    let start = offset as usize;
    if start > bytes.len() {
        return Err(AbiError::BadLength {
            field: offset_field,
            declared: u64::from(offset),
            available,
        });
    }
    if start < min_start || !start.is_multiple_of(align) {
        return Err(AbiError::OutOfRange {
            field: offset_field,
            value: u64::from(offset),
        });
    }
    let end = count.checked_mul(entry).and_then(|n| n.checked_add(start));
    end.and_then(|end| bytes.get(start..end))
        .ok_or(AbiError::BadLength {
            field: count_field,
            declared: end.map_or(u64::MAX, |end| end as u64),
            available,
        })
}

/// A validated attribute buffer. See the module docs for what
/// [`parse`](Self::parse) guarantees; no accessor can fail or panic.
#[derive(Debug, Clone, Copy)]
pub struct CaAttrView<'a> {
    attr: CaAttr,
    /// The buffer, cut to `total_size`.
    bytes: &'a [u8],
    page_sizes: &'a [Le32],
    ports: &'a [u8],
    vendor_data: &'a [u8],
}

/// One port of a [`CaAttrView`].
#[derive(Debug, Clone, Copy)]
pub struct PortView<'a> {
    attr: PortAttr,
    pkeys: &'a [PKey],
    gids: &'a [Gid],
}

impl<'a> PortView<'a> {
    /// Reads record `index` of the port array and slices its tables (bounds
    /// and alignment only; ordering is checked by [`CaAttrView::parse`]).
    fn read(
        bytes: &'a [u8],
        ports: &'a [u8],
        record_size: usize,
        index: usize,
    ) -> Result<Self, AbiError> {
        let record = index
            .checked_mul(record_size)
            .and_then(|start| ports.get(start..)?.get(..record_size))
            .ok_or(AbiError::Truncated {
                needed: record_size,
                got: 0,
            })?;
        let (abi, _) = read_prefix::<PortAttrAbi>(record)?;
        let attr = PortAttr::parse(&abi)?;
        let t = attr.tables;
        let pkeys = region(
            bytes,
            ("PortAttr.pkey_table_offset", "PortAttr.num_pkeys"),
            t.pkey_table_offset,
            usize::from(t.num_pkeys),
            core::mem::size_of::<PKey>(),
            (TABLE_ALIGN, 0),
        )?;
        let gids = region(
            bytes,
            ("PortAttr.gid_table_offset", "PortAttr.num_gids"),
            t.gid_table_offset,
            usize::from(t.num_gids),
            core::mem::size_of::<Gid>(),
            (TABLE_ALIGN, 0),
        )?;
        Ok(Self {
            attr,
            pkeys: <[PKey]>::ref_from_bytes(pkeys).unwrap_or(&[]),
            gids: <[Gid]>::ref_from_bytes(gids).unwrap_or(&[]),
        })
    }

    /// The port's attributes.
    pub fn attr(&self) -> PortAttr {
        self.attr
    }

    /// The port's number.
    pub fn port_num(&self) -> PortNum {
        self.attr.port_num
    }

    /// The P_Key table.
    pub fn pkeys(&self) -> &'a [PKey] {
        self.pkeys
    }

    /// The GID table.
    pub fn gids(&self) -> &'a [Gid] {
        self.gids
    }
}

impl<'a> CaAttrView<'a> {
    /// Validates an attribute buffer from untrusted bytes (see the module
    /// docs for every rule). Bytes past `total_size` are ignored.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, AbiError> {
        let (header, _) = read_prefix::<CaAttrHeaderAbi>(bytes)?;
        let attr = CaAttr::parse(&header)?;
        let layout = attr.layout;
        let total = layout.total_size as usize;
        if total < CA_ATTR_HEADER_SIZE {
            return Err(AbiError::OutOfRange {
                field: "CaAttr.total_size",
                value: u64::from(layout.total_size),
            });
        }
        let bytes = bytes.get(..total).ok_or(AbiError::Truncated {
            needed: total,
            got: bytes.len(),
        })?;

        let page_bytes = region(
            bytes,
            ("CaAttr.page_sizes_offset", "CaAttr.num_page_sizes"),
            layout.page_sizes_offset,
            layout.num_page_sizes as usize,
            core::mem::size_of::<Le32>(),
            (ARRAY_ALIGN, CA_ATTR_HEADER_SIZE),
        )?;
        let page_sizes = <[Le32]>::ref_from_bytes(page_bytes).unwrap_or(&[]);
        for page_size in page_sizes {
            check_page_size(page_size.get())?;
        }

        let record_size = layout.port_record_size as usize;
        if record_size < PORT_RECORD_SIZE || !record_size.is_multiple_of(ARRAY_ALIGN) {
            return Err(AbiError::OutOfRange {
                field: "CaAttr.port_record_size",
                value: u64::from(layout.port_record_size),
            });
        }
        let ports = region(
            bytes,
            ("CaAttr.ports_offset", "CaAttr.num_ports"),
            layout.ports_offset,
            usize::from(layout.num_ports),
            record_size,
            (
                ARRAY_ALIGN,
                layout.page_sizes_offset as usize + page_bytes.len(),
            ),
        )?;

        let mut end = layout.ports_offset as usize + ports.len();
        for index in 0..usize::from(layout.num_ports) {
            let port = PortView::read(bytes, ports, record_size, index)?;
            let t = port.attr.tables;
            if usize::from(port.attr.port_num.get()) != index + 1 {
                return Err(AbiError::OutOfRange {
                    field: "PortAttr.port_num",
                    value: u64::from(port.attr.port_num.get()),
                });
            }
            for (field, offset, table) in [
                (
                    "PortAttr.pkey_table_offset",
                    t.pkey_table_offset,
                    port.pkeys.as_bytes(),
                ),
                (
                    "PortAttr.gid_table_offset",
                    t.gid_table_offset,
                    port.gids.as_bytes(),
                ),
            ] {
                if (offset as usize) < end {
                    return Err(AbiError::OutOfRange {
                        field,
                        value: u64::from(offset),
                    });
                }
                end = offset as usize + table.len();
            }
        }

        Ok(Self {
            attr,
            bytes,
            page_sizes,
            ports,
            vendor_data: bytes.get(end..).unwrap_or(&[]),
        })
    }

    /// The fixed attributes.
    pub fn attr(&self) -> CaAttr {
        self.attr
    }

    /// The buffer, cut to `total_size`.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The supported page sizes (each a power of two).
    pub fn page_sizes(&self) -> &'a [Le32] {
        self.page_sizes
    }

    /// The ports, port 1 first.
    pub fn ports(&self) -> impl Iterator<Item = PortView<'a>> + use<'a> {
        let view = *self;
        (0..usize::from(view.attr.layout.num_ports)).filter_map(move |index| view.port_at(index))
    }

    /// Port `port`, if the CA has it.
    pub fn port(&self, port: PortNum) -> Option<PortView<'a>> {
        if port.get() <= self.attr.layout.num_ports {
            self.port_at(port.index())
        } else {
            None
        }
    }

    /// The vendor-private bytes after the last table.
    pub fn vendor_data(&self) -> &'a [u8] {
        self.vendor_data
    }

    /// Record `index`; `parse` already read it successfully.
    fn port_at(&self, index: usize) -> Option<PortView<'a>> {
        let record_size = self.attr.layout.port_record_size as usize;
        PortView::read(self.bytes, self.ports, record_size, index).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::testing::{assert_decode_total, assert_round_trip};
    use proptest::prelude::*;
    use proptest::sample::{Index, select};

    fn sample_ca() -> CaAttr {
        CaAttr {
            node_guid: NodeGuid::new(0x0002_c903_0000_1000),
            system_image_guid: SystemImageGuid::new(0x0002_c903_0000_1003),
            vendor_id: 0x0002C9,
            device_id: 0x1003,
            revision: 0xA0,
            fw_version: 0x0002_0009_1000,
            limits: CaLimits {
                max_qps: 65_536,
                max_wrs_per_qp: 16_384,
                max_sges: 32,
                max_cqs: 16_384,
                max_cqes: 4_194_303,
                max_srqs: 8_192,
                max_srq_wrs: 16_383,
                max_srq_sges: 31,
                max_pds: 32_764,
                max_mrs: 524_272,
                max_mr_size: u64::MAX,
                max_mws: 0,
                max_avs: 1 << 20,
                max_mcast_groups: 8_192,
                max_qps_per_mcast_group: 248,
                max_qp_rd_atomic: 16,
                max_qp_resp_res: 128,
                max_inline_data: 512,
            },
            local_ack_delay: 15,
            atomicity: Atomicity::Hca,
            caps: CaCaps::BAD_PKEY_COUNTER
                | CaCaps::BAD_QKEY_COUNTER
                | CaCaps::SYSTEM_IMAGE_GUID
                | CaCaps::SRQ
                | CaCaps::RC
                | CaCaps::UC
                | CaCaps::UD
                | CaCaps::MULTICAST,
            layout: CaLayout::default(),
        }
    }

    fn sample_port(port: u8, link_layer: LinkLayer) -> PortAttr {
        PortAttr {
            port_num: PortNum::new(port).unwrap(),
            link_layer,
            state: PortState::Active,
            active_mtu: Mtu::Mtu2048,
            max_mtu: Mtu::Mtu4096,
            port_guid: PortGuid::new(0x0002_c903_0000_1000 + u64::from(port)),
            lid: Lid::new(u16::from(port) + 4),
            lmc: 1,
            sm_lid: Lid::new(1),
            sm_sl: 3,
            subnet_timeout: 18,
            max_msg_size: 1 << 31,
            caps: PortCaps::IS_CM | PortCaps::IS_TRAP | PortCaps::QKEY_COUNTER,
            qkey_violations: 7,
            pkey_violations: 2,
            tables: PortTables::default(),
        }
    }

    const PAGE_SIZES: [u32; 3] = [4096, 2 << 20, 1 << 30];
    const P1_PKEYS: [PKey; 2] = [PKey::DEFAULT, PKey::new(0x8001)];
    const P1_GIDS: [Gid; 2] = [
        Gid::from_parts(Gid::LINK_LOCAL_PREFIX, 0x0002_c903_0000_1001),
        Gid::from_parts(0xFEC0_0000_0000_0001, 0x0002_c903_0000_1001),
    ];
    const P2_PKEYS: [PKey; 1] = [PKey::DEFAULT];
    const P2_GIDS: [Gid; 3] = [
        Gid::from_parts(Gid::LINK_LOCAL_PREFIX, 0x0202_c9ff_fe00_1002),
        Gid::from_ipv4([192, 168, 1, 7]),
        Gid::from_ipv4([10, 0, 0, 2]),
    ];
    const VENDOR: &[u8] = b"PRIV!";

    /// The two-port example and its encoding (cf. the guide's Figure 6-4).
    fn sample_ports() -> [PortData<'static>; 2] {
        [
            PortData {
                attr: sample_port(1, LinkLayer::InfiniBand),
                pkeys: &P1_PKEYS,
                gids: &P1_GIDS,
            },
            PortData {
                attr: sample_port(2, LinkLayer::Ethernet),
                pkeys: &P2_PKEYS,
                gids: &P2_GIDS,
            },
        ]
    }

    fn sample_bytes() -> Vec<u8> {
        let ports = sample_ports();
        let parts = CaAttrParts {
            attr: sample_ca(),
            page_sizes: &PAGE_SIZES,
            ports: &ports,
            vendor_data: VENDOR,
        };
        let mut out = vec![0; parts.encoded_len().unwrap()];
        assert_eq!(parts.encode(&mut out), Ok(out.len()));
        out
    }

    // Offsets of the sample encoding.
    const PORTS_AT: usize = 148;
    const P1: usize = PORTS_AT;
    const P2: usize = PORTS_AT + PORT_RECORD_SIZE;
    const SAMPLE_SIZE: usize = 335;

    #[test]
    fn two_port_example() {
        // The guide's formula, spelled out.
        let formula = CA_ATTR_HEADER_SIZE
            + 3 * 4
            + 2 * PORT_RECORD_SIZE
            + (2 * 2 + 2 * 16)
            + (2 + 3 * 16)
            + VENDOR.len();
        assert_eq!(formula, SAMPLE_SIZE);
        assert_eq!(ca_attr_size(3, [(2, 2), (1, 3)], VENDOR.len()), Ok(formula));

        let bytes = sample_bytes();
        assert_eq!(bytes.len(), SAMPLE_SIZE);
        assert_eq!(bytes[0..4], (SAMPLE_SIZE as u32).to_le_bytes());
        assert_eq!(
            bytes[244..248],
            [0xFF, 0xFF, 0x80, 0x01],
            "P_Keys in network order"
        );
        assert_eq!(bytes[330..], *VENDOR);

        let view = CaAttrView::parse(&bytes).unwrap();
        let attr = view.attr();
        let mut expected = sample_ca();
        expected.layout = CaLayout {
            total_size: 335,
            page_sizes_offset: 136,
            num_page_sizes: 3,
            ports_offset: 148,
            port_record_size: 48,
            num_ports: 2,
        };
        assert_eq!(attr, expected);
        let page_sizes: Vec<u32> = view.page_sizes().iter().map(|p| p.get()).collect();
        assert_eq!(page_sizes, PAGE_SIZES);

        let p1 = view.port(PortNum::FIRST).unwrap();
        let mut want = sample_port(1, LinkLayer::InfiniBand);
        want.tables = PortTables {
            num_pkeys: 2,
            num_gids: 2,
            pkey_table_offset: 244,
            gid_table_offset: 248,
        };
        assert_eq!(p1.attr(), want);
        assert_eq!(p1.pkeys(), P1_PKEYS);
        assert_eq!(p1.gids(), P1_GIDS);

        let p2 = view.port(PortNum::new(2).unwrap()).unwrap();
        let mut want = sample_port(2, LinkLayer::Ethernet);
        want.tables = PortTables {
            num_pkeys: 1,
            num_gids: 3,
            pkey_table_offset: 280,
            gid_table_offset: 282,
        };
        assert_eq!(p2.attr(), want);
        assert_eq!(p2.pkeys(), P2_PKEYS);
        assert_eq!(p2.gids(), P2_GIDS);
        assert_eq!(p2.gids()[1].ipv4(), Some([192, 168, 1, 7]));

        assert!(view.port(PortNum::new(3).unwrap()).is_none());
        let numbers: Vec<u8> = view.ports().map(|p| p.port_num().get()).collect();
        assert_eq!(numbers, [1, 2]);
        assert_eq!(view.vendor_data(), VENDOR);
    }

    #[test]
    fn query_with_short_buffer_reports_size() {
        let ports = sample_ports();
        let parts = CaAttrParts {
            attr: sample_ca(),
            page_sizes: &PAGE_SIZES,
            ports: &ports,
            vendor_data: VENDOR,
        };
        for len in [0, 100, SAMPLE_SIZE - 1] {
            let mut out = vec![0xEE; len];
            assert_eq!(
                parts.encode(&mut out),
                Err(AbiError::Truncated {
                    needed: SAMPLE_SIZE,
                    got: len
                })
            );
            assert!(out.iter().all(|&b| b == 0xEE), "short buffer untouched");
        }
        // A larger buffer takes the answer at its front; the rest is not part of it.
        let mut out = vec![0xEE; SAMPLE_SIZE + 10];
        assert_eq!(parts.encode(&mut out), Ok(SAMPLE_SIZE));
        let view = CaAttrView::parse(&out).unwrap();
        assert_eq!(view.as_bytes(), sample_bytes());
        assert_eq!(view.vendor_data(), VENDOR);
    }

    #[test]
    fn encoder_refuses_invalid_values() {
        let mut ports = sample_ports();
        let mut out = vec![0; 1024];
        let encode = |ports: &[PortData<'_>], attr: CaAttr, pages: &[u32], out: &mut [u8]| {
            CaAttrParts {
                attr,
                page_sizes: pages,
                ports,
                vendor_data: &[],
            }
            .encode(out)
        };
        ports.swap(0, 1);
        assert_eq!(
            encode(&ports, sample_ca(), &[], &mut out),
            Err(AbiError::OutOfRange {
                field: "PortAttr.port_num",
                value: 2
            })
        );
        ports.swap(0, 1);
        ports[1].attr.lmc = 8;
        assert_eq!(
            encode(&ports, sample_ca(), &[], &mut out),
            Err(AbiError::OutOfRange {
                field: "PortAttr.lmc",
                value: 8
            })
        );
        let mut ca = sample_ca();
        ca.vendor_id = 0x0100_0000;
        assert!(matches!(
            encode(&ports[..1], ca, &[], &mut out),
            Err(AbiError::OutOfRange {
                field: "CaAttr.vendor_id",
                ..
            })
        ));
        assert_eq!(
            encode(&[], sample_ca(), &[4096, 3000], &mut out),
            Err(AbiError::OutOfRange {
                field: "CaAttr.page_sizes",
                value: 3000
            })
        );
        assert_eq!(
            encode(&[], sample_ca(), &[], &mut out),
            Ok(CA_ATTR_HEADER_SIZE)
        );
    }

    #[test]
    fn size_formula_limits() {
        assert_eq!(
            ca_attr_size(0, core::iter::empty(), 0),
            Ok(CA_ATTR_HEADER_SIZE)
        );
        assert_eq!(
            ca_attr_size(0, core::iter::repeat_n((0, 0), 255), 0),
            Ok(CA_ATTR_HEADER_SIZE + 255 * PORT_RECORD_SIZE)
        );
        assert_eq!(
            ca_attr_size(0, core::iter::repeat((0, 0)), 0),
            Err(AbiError::OutOfRange {
                field: "CaAttr.num_ports",
                value: 256
            })
        );
        assert_eq!(
            ca_attr_size(0, [(65_536, 0)], 0),
            Err(AbiError::OutOfRange {
                field: "PortAttr.num_pkeys",
                value: 65_536
            })
        );
        assert_eq!(
            ca_attr_size(0, [(0, 65_536)], 0),
            Err(AbiError::OutOfRange {
                field: "PortAttr.num_gids",
                value: 65_536
            })
        );
        assert_eq!(
            ca_attr_size(0, [(65_535, 65_535)], 0),
            Ok(CA_ATTR_HEADER_SIZE + PORT_RECORD_SIZE + 65_535 * 18)
        );
        for (pages, vendor) in [(usize::MAX, 0), (0, usize::MAX), (1 << 30, 0)] {
            assert!(matches!(
                ca_attr_size(pages, core::iter::empty(), vendor),
                Err(AbiError::BadLength {
                    field: "CaAttr.total_size",
                    ..
                })
            ));
        }
        let last_ok = u32::MAX as usize - CA_ATTR_HEADER_SIZE;
        assert_eq!(
            ca_attr_size(0, core::iter::empty(), last_ok),
            Ok(u32::MAX as usize)
        );
        assert!(ca_attr_size(0, core::iter::empty(), last_ok + 1).is_err());
    }

    /// Parses `bytes` after `corrupt` and returns the error.
    fn parse_corrupted(corrupt: impl FnOnce(&mut Vec<u8>)) -> AbiError {
        let mut bytes = sample_bytes();
        corrupt(&mut bytes);
        CaAttrView::parse(&bytes).expect_err("corruption must be rejected")
    }

    fn set32(bytes: &mut [u8], at: usize, value: u32) {
        bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    }

    fn set16(bytes: &mut [u8], at: usize, value: u16) {
        bytes[at..at + 2].copy_from_slice(&value.to_le_bytes());
    }

    #[test]
    fn rejects_truncation() {
        let bytes = sample_bytes();
        assert_eq!(
            CaAttrView::parse(&bytes[..100]).unwrap_err(),
            AbiError::Truncated {
                needed: CA_ATTR_HEADER_SIZE,
                got: 100
            }
        );
        assert_eq!(
            CaAttrView::parse(&bytes[..SAMPLE_SIZE - 1]).unwrap_err(),
            AbiError::Truncated {
                needed: SAMPLE_SIZE,
                got: SAMPLE_SIZE - 1
            }
        );
        assert_eq!(
            parse_corrupted(|b| set32(b, 0, 400)),
            AbiError::Truncated {
                needed: 400,
                got: SAMPLE_SIZE
            }
        );
        assert_eq!(
            parse_corrupted(|b| set32(b, 0, 100)),
            AbiError::OutOfRange {
                field: "CaAttr.total_size",
                value: 100
            }
        );
        // Shrinking total_size cuts the GID table of port 2.
        assert_eq!(
            parse_corrupted(|b| set32(b, 0, 320)),
            AbiError::BadLength {
                field: "PortAttr.num_gids",
                declared: 330,
                available: 320
            }
        );
    }

    #[test]
    fn rejects_bad_offsets_and_counts() {
        let out_of_range = |field, value| AbiError::OutOfRange { field, value };
        // Offsets past the end.
        assert_eq!(
            parse_corrupted(|b| set32(b, 0x04, 336)),
            AbiError::BadLength {
                field: "CaAttr.page_sizes_offset",
                declared: 336,
                available: 335
            }
        );
        assert_eq!(
            parse_corrupted(|b| set32(b, P2 + 0x1C, 1000)),
            AbiError::BadLength {
                field: "PortAttr.gid_table_offset",
                declared: 1000,
                available: 335
            }
        );
        // Counts that overflow or run past the end.
        assert!(matches!(
            parse_corrupted(|b| set32(b, 0x08, u32::MAX)),
            AbiError::BadLength {
                field: "CaAttr.num_page_sizes",
                ..
            }
        ));
        assert!(matches!(
            parse_corrupted(|b| set32(b, 0x10, 0x8000_0000)),
            AbiError::BadLength {
                field: "CaAttr.num_ports",
                ..
            }
        ));
        assert_eq!(
            parse_corrupted(|b| set16(b, P1 + 0x16, 1000)),
            AbiError::BadLength {
                field: "PortAttr.num_gids",
                declared: 248 + 16_000,
                available: 335
            }
        );
        assert!(matches!(
            parse_corrupted(|b| b[0x14] = 3),
            AbiError::OutOfRange {
                field: "PortAttr.pkey_table_offset",
                ..
            }
        ));
        // Tables overlapping the header, the page sizes, the port array or
        // each other.
        for (at, value, field) in [
            (0x04, 132, "CaAttr.page_sizes_offset"),
            (0x0C, 144, "CaAttr.ports_offset"),
            (P1 + 0x18, 64, "PortAttr.pkey_table_offset"),
            (P1 + 0x18, 200, "PortAttr.pkey_table_offset"),
            (P1 + 0x1C, 246, "PortAttr.gid_table_offset"),
            (P2 + 0x18, 270, "PortAttr.pkey_table_offset"),
            // Two ports sharing one table.
            (P2 + 0x1C, 248, "PortAttr.gid_table_offset"),
            // Misalignment.
            (0x04, 138, "CaAttr.page_sizes_offset"),
            (0x0C, 150, "CaAttr.ports_offset"),
            (P1 + 0x18, 245, "PortAttr.pkey_table_offset"),
            (P2 + 0x1C, 283, "PortAttr.gid_table_offset"),
            // Port records too small or oddly sized.
            (0x10, 44, "CaAttr.port_record_size"),
            (0x10, 50, "CaAttr.port_record_size"),
        ] {
            assert_eq!(
                parse_corrupted(|b| set32(b, at, value)),
                out_of_range(field, value.into()),
                "{field} = {value}"
            );
        }
    }

    #[test]
    fn rejects_bad_ports_codes_and_reserved() {
        let out_of_range = |field, value| AbiError::OutOfRange { field, value };
        let invalid = |type_name, value| AbiError::InvalidCode { type_name, value };
        // Port numbering.
        assert_eq!(
            parse_corrupted(|b| {
                b[P1] = 2;
                b[P2] = 1;
            }),
            out_of_range("PortAttr.port_num", 2)
        );
        assert_eq!(
            parse_corrupted(|b| b[P2] = 3),
            out_of_range("PortAttr.port_num", 3)
        );
        assert_eq!(parse_corrupted(|b| b[P1] = 0), out_of_range("PortNum", 0));
        // Codes.
        assert_eq!(parse_corrupted(|b| b[0x16] = 3), invalid("Atomicity", 3));
        assert_eq!(parse_corrupted(|b| b[P1 + 1] = 9), invalid("LinkLayer", 9));
        assert_eq!(parse_corrupted(|b| b[P2 + 2] = 0), invalid("PortState", 0));
        assert_eq!(parse_corrupted(|b| b[P2 + 3] = 6), invalid("Mtu", 6));
        assert_eq!(parse_corrupted(|b| b[P1 + 4] = 0), invalid("Mtu", 0));
        // Ranges.
        assert_eq!(
            parse_corrupted(|b| b[0x15] = 32),
            out_of_range("CaAttr.local_ack_delay", 32)
        );
        assert_eq!(
            parse_corrupted(|b| b[0x33] = 1),
            out_of_range("CaAttr.vendor_id", 0x0100_02C9)
        );
        assert_eq!(
            parse_corrupted(|b| b[P1 + 5] = 8),
            out_of_range("PortAttr.lmc", 8)
        );
        assert_eq!(
            parse_corrupted(|b| b[P1 + 6] = 16),
            out_of_range("PortAttr.sm_sl", 16)
        );
        assert_eq!(
            parse_corrupted(|b| b[P2 + 7] = 32),
            out_of_range("PortAttr.subnet_timeout", 32)
        );
        assert_eq!(
            parse_corrupted(|b| set32(b, 140, 3000)),
            out_of_range("CaAttr.page_sizes", 3000)
        );
        assert_eq!(
            parse_corrupted(|b| set32(b, 136, 0)),
            out_of_range("CaAttr.page_sizes", 0)
        );
        // Reserved bits and bytes.
        let reserved = |field| AbiError::ReservedNotZero { field };
        assert_eq!(
            parse_corrupted(|b| b[0x17] = 1),
            reserved("CaAttrHeaderAbi.reserved_at_0x17")
        );
        assert_eq!(parse_corrupted(|b| b[0x3B] |= 0x80), reserved("CaCaps"));
        assert_eq!(
            parse_corrupted(|b| b[P2 + 0x23] |= 0x01),
            reserved("PortCaps")
        );
    }

    #[test]
    fn reads_larger_records_and_headers() {
        // A later producer: the header grew by 8 bytes and port records by 8;
        // the reader must skip both tails unread.
        const RECORD: usize = 56;
        let (pages_at, ports_at) = (144, 148);
        let tables_at = ports_at + 2 * RECORD;
        let total = tables_at + 2 + 16 + 16 + 4;
        let mut bytes = vec![0xAB; total];
        let mut ca = sample_ca();
        ca.layout = CaLayout {
            total_size: total as u32,
            page_sizes_offset: pages_at as u32,
            num_page_sizes: 1,
            ports_offset: ports_at as u32,
            port_record_size: RECORD as u32,
            num_ports: 2,
        };
        bytes[..CA_ATTR_HEADER_SIZE].copy_from_slice(ca.emit().as_bytes());
        set32(&mut bytes, pages_at, 4096);
        let mut p1 = sample_port(1, LinkLayer::InfiniBand);
        p1.tables = PortTables {
            num_pkeys: 1,
            num_gids: 1,
            pkey_table_offset: tables_at as u32,
            gid_table_offset: tables_at as u32 + 2,
        };
        let mut p2 = sample_port(2, LinkLayer::Ethernet);
        p2.tables = PortTables {
            num_pkeys: 0,
            num_gids: 1,
            pkey_table_offset: tables_at as u32 + 18,
            gid_table_offset: tables_at as u32 + 18,
        };
        for (i, p) in [p1, p2].iter().enumerate() {
            let at = ports_at + i * RECORD;
            bytes[at..at + PORT_RECORD_SIZE].copy_from_slice(p.emit().as_bytes());
        }
        bytes[tables_at..tables_at + 2].copy_from_slice(PKey::DEFAULT.as_bytes());
        bytes[tables_at + 2..tables_at + 18].copy_from_slice(P1_GIDS[0].as_bytes());
        bytes[tables_at + 18..tables_at + 34].copy_from_slice(P2_GIDS[1].as_bytes());

        let view = CaAttrView::parse(&bytes).unwrap();
        assert_eq!(view.attr(), ca);
        assert_eq!(view.page_sizes()[0].get(), 4096);
        let ports: Vec<_> = view.ports().collect();
        assert_eq!(ports.len(), 2);
        assert_eq!(ports[0].attr(), p1);
        assert_eq!(ports[1].attr(), p2);
        assert_eq!(ports[0].pkeys(), [PKey::DEFAULT]);
        assert_eq!(ports[0].gids(), [P1_GIDS[0]]);
        assert!(ports[1].pkeys().is_empty());
        assert_eq!(ports[1].gids(), [P2_GIDS[1]]);
        assert_eq!(view.vendor_data(), [0xAB; 4]);
    }

    #[test]
    fn fixed_reprs_round_trip() {
        let mut ca = sample_ca();
        ca.layout = CaLayout {
            total_size: 1,
            page_sizes_offset: 2,
            num_page_sizes: 3,
            ports_offset: 4,
            port_record_size: 5,
            num_ports: 6,
        };
        assert_round_trip(&ca);
        let mut port = sample_port(2, LinkLayer::Ethernet);
        port.tables = PortTables {
            num_pkeys: 1,
            num_gids: 2,
            pkey_table_offset: 3,
            gid_table_offset: 4,
        };
        assert_round_trip(&port);
        assert_round_trip(
            &CaModify::new(
                PortNum::FIRST,
                CaModifyFlags::IS_SM | CaModifyFlags::RESETS,
                CaModifyFlags::IS_SNMP_SUPPORTED,
            )
            .unwrap(),
        );
        for &a in Atomicity::ALL {
            assert_eq!(Atomicity::from_code(a.code()), Ok(a));
        }
    }

    #[test]
    fn flags_are_strict() {
        assert_eq!(CaCaps::from_raw(CaCaps::all().bits()), Ok(CaCaps::all()));
        assert!(CaCaps::from_raw(1 << 22).is_err());
        assert!(PortCaps::from_raw(1 << 19).is_err());
        assert_eq!(CaModifyFlags::from_raw(0xFF), Ok(CaModifyFlags::all()));
        assert!(CaModifyFlags::from_raw(0x100).is_err());
        assert_eq!(
            CaModifyFlags::CAPABILITIES | CaModifyFlags::RESETS,
            CaModifyFlags::all()
        );
    }

    #[test]
    fn port_info_mask() {
        assert_eq!(PortCaps::empty().port_info_capability_mask(), 0);
        assert_eq!(
            (PortCaps::IS_SM | PortCaps::IS_CM | PortCaps::QKEY_COUNTER)
                .port_info_capability_mask(),
            (1 << 1) | (1 << 16)
        );
        assert_eq!(
            CaModifyFlags::CAPABILITIES
                .port_caps()
                .port_info_capability_mask(),
            (1 << 1) | (1 << 10) | (1 << 16) | (1 << 17) | (1 << 19) | (1 << 20)
        );
    }

    #[test]
    fn modify_semantics() {
        let port1 = PortNum::FIRST;
        let port2 = PortNum::new(2).unwrap();
        assert!(
            CaModify::new(port1, CaModifyFlags::IS_SM, CaModifyFlags::IS_SM).is_err(),
            "set and clear the same bit"
        );
        assert!(
            CaModify::new(
                port1,
                CaModifyFlags::empty(),
                CaModifyFlags::RESET_QKEY_COUNTER
            )
            .is_err(),
            "a reset cannot be cleared"
        );

        let modify = CaModify::new(
            port1,
            CaModifyFlags::IS_SM
                | CaModifyFlags::IS_VENDOR_SUPPORTED
                | CaModifyFlags::RESET_QKEY_COUNTER,
            CaModifyFlags::IS_CM_SUPPORTED,
        )
        .unwrap();
        let mut port = sample_port(1, LinkLayer::InfiniBand);
        port.apply(&modify).unwrap();
        assert_eq!(
            port.caps,
            PortCaps::IS_SM | PortCaps::IS_VENDOR | PortCaps::IS_TRAP | PortCaps::QKEY_COUNTER
        );
        assert_eq!((port.qkey_violations, port.pkey_violations), (0, 2));

        let mut other = sample_port(2, LinkLayer::InfiniBand);
        let before = other;
        assert_eq!(
            other.apply(&modify),
            Err(AbiError::OutOfRange {
                field: "CaModify.port",
                value: 1
            })
        );
        assert_eq!(other, before);

        let mut ca = sample_ca();
        ca.layout.num_ports = 1;
        assert_eq!(modify.validate_for(&ca), Ok(()));
        let far = CaModify::new(port2, CaModifyFlags::IS_SM, CaModifyFlags::empty()).unwrap();
        assert!(far.validate_for(&ca).is_err());
        ca.caps.remove(CaCaps::BAD_QKEY_COUNTER);
        assert_eq!(
            modify.validate_for(&ca),
            Err(AbiError::OutOfRange {
                field: "CaModify.set",
                value: u64::from(CaModifyFlags::RESET_QKEY_COUNTER.bits())
            })
        );

        let mut abi = modify.emit();
        abi.reserved_at_0x1[2] = 1;
        assert!(matches!(
            CaModify::parse(&abi),
            Err(AbiError::ReservedNotZero { .. })
        ));
        let mut abi = modify.emit();
        abi.clear = Le32::new(CaModifyFlags::IS_SM.bits());
        assert!(CaModify::parse(&abi).is_err());
    }

    // ---- Property tests ----

    prop_compose! {
        fn arb_ca_attr()(
            l in prop::array::uniform17(any::<u32>()),
            max_mr_size: u64,
            guids: [u64; 3],
            ids: (u32, u16, u16),
            local_ack_delay in 0u8..=31,
            atomicity in select(Atomicity::ALL),
            caps: u32,
            layout: (u32, u32, u32, u32, u32, u8),
        ) -> CaAttr {
            CaAttr {
                node_guid: NodeGuid::new(guids[0]),
                system_image_guid: SystemImageGuid::new(guids[1]),
                vendor_id: ids.0 & MAX_OUI,
                device_id: ids.1,
                revision: ids.2,
                fw_version: guids[2],
                limits: CaLimits {
                    max_qps: l[0],
                    max_wrs_per_qp: l[1],
                    max_sges: l[2],
                    max_cqs: l[3],
                    max_cqes: l[4],
                    max_srqs: l[5],
                    max_srq_wrs: l[6],
                    max_srq_sges: l[7],
                    max_pds: l[8],
                    max_mrs: l[9],
                    max_mr_size,
                    max_mws: l[10],
                    max_avs: l[11],
                    max_mcast_groups: l[12],
                    max_qps_per_mcast_group: l[13],
                    max_qp_rd_atomic: l[14],
                    max_qp_resp_res: l[15],
                    max_inline_data: l[16],
                },
                local_ack_delay,
                atomicity,
                caps: CaCaps::from_bits_truncate(caps),
                layout: CaLayout {
                    total_size: layout.0,
                    page_sizes_offset: layout.1,
                    num_page_sizes: layout.2,
                    ports_offset: layout.3,
                    port_record_size: layout.4,
                    num_ports: layout.5,
                },
            }
        }
    }

    prop_compose! {
        fn arb_port_attr()(
            port in 1u8..=255,
            codes in (select(LinkLayer::ALL), select(PortState::ALL), select(Mtu::ALL), select(Mtu::ALL)),
            port_guid: u64,
            lids: (u16, u16),
            small in (0u8..=7, 0u8..=15, 0u8..=31),
            max_msg_size: u32,
            caps: u32,
            counters: (u32, u32),
            tables: (u16, u16, u32, u32),
        ) -> PortAttr {
            PortAttr {
                port_num: PortNum::new(port).unwrap(),
                link_layer: codes.0,
                state: codes.1,
                active_mtu: codes.2,
                max_mtu: codes.3,
                port_guid: PortGuid::new(port_guid),
                lid: Lid::new(lids.0),
                lmc: small.0,
                sm_lid: Lid::new(lids.1),
                sm_sl: small.1,
                subnet_timeout: small.2,
                max_msg_size,
                caps: PortCaps::from_bits_truncate(caps),
                qkey_violations: counters.0,
                pkey_violations: counters.1,
                tables: PortTables {
                    num_pkeys: tables.0,
                    num_gids: tables.1,
                    pkey_table_offset: tables.2,
                    gid_table_offset: tables.3,
                },
            }
        }
    }

    /// Owned inputs of one encoding.
    #[derive(Debug, Clone)]
    struct Owned {
        attr: CaAttr,
        page_sizes: Vec<u32>,
        ports: Vec<(PortAttr, Vec<PKey>, Vec<Gid>)>,
        vendor_data: Vec<u8>,
    }

    impl Owned {
        fn encode(&self) -> Vec<u8> {
            let ports: Vec<PortData<'_>> = self
                .ports
                .iter()
                .map(|(attr, pkeys, gids)| PortData {
                    attr: *attr,
                    pkeys,
                    gids,
                })
                .collect();
            let parts = CaAttrParts {
                attr: self.attr,
                page_sizes: &self.page_sizes,
                ports: &ports,
                vendor_data: &self.vendor_data,
            };
            let mut out = vec![0; parts.encoded_len().unwrap()];
            assert_eq!(parts.encode(&mut out), Ok(out.len()));
            out
        }

        /// The contents of a parsed view.
        fn from_view(view: &CaAttrView<'_>) -> Self {
            Self {
                attr: view.attr(),
                page_sizes: view.page_sizes().iter().map(|p| p.get()).collect(),
                ports: view
                    .ports()
                    .map(|p| (p.attr(), p.pkeys().to_vec(), p.gids().to_vec()))
                    .collect(),
                vendor_data: view.vendor_data().to_vec(),
            }
        }

        /// Equality ignoring the layout fields, which the encoder fills in.
        fn assert_same_contents(&self, other: &Self) {
            let mut a = self.clone();
            let mut b = other.clone();
            for owned in [&mut a, &mut b] {
                owned.attr.layout = CaLayout::default();
                for port in &mut owned.ports {
                    port.0.tables = PortTables::default();
                }
            }
            assert_eq!(a.attr, b.attr);
            assert_eq!(a.page_sizes, b.page_sizes);
            assert_eq!(a.ports, b.ports);
            assert_eq!(a.vendor_data, b.vendor_data);
        }
    }

    prop_compose! {
        fn arb_owned()(
            attr in arb_ca_attr(),
            page_sizes in prop::collection::vec((0u32..32).prop_map(|s| 1 << s), 0..=6),
            ports in prop::collection::vec(
                (
                    arb_port_attr(),
                    prop::collection::vec(any::<u16>().prop_map(PKey::new), 0..=8),
                    prop::collection::vec(any::<[u8; 16]>().prop_map(Gid::from_octets), 0..=8),
                ),
                0..=4,
            ),
            vendor_data in prop::collection::vec(any::<u8>(), 0..=16),
        ) -> Owned {
            let mut ports = ports;
            for (i, port) in ports.iter_mut().enumerate() {
                port.0.port_num = PortNum::new(i as u8 + 1).unwrap();
            }
            Owned { attr, page_sizes, ports, vendor_data }
        }
    }

    /// Parses `bytes`; when that succeeds, every accessor must work and the
    /// contents must survive a re-encoding.
    fn exercise(bytes: &[u8]) {
        let Ok(view) = CaAttrView::parse(bytes) else {
            return;
        };
        let layout = view.attr().layout;
        assert_eq!(view.as_bytes().len(), layout.total_size as usize);
        assert_eq!(view.page_sizes().len(), layout.num_page_sizes as usize);
        assert!(view.page_sizes().iter().all(|p| p.get().is_power_of_two()));
        let mut count = 0;
        for (i, port) in view.ports().enumerate() {
            assert_eq!(usize::from(port.port_num().get()), i + 1);
            assert_eq!(
                port.pkeys().len(),
                usize::from(port.attr().tables.num_pkeys)
            );
            assert_eq!(port.gids().len(), usize::from(port.attr().tables.num_gids));
            let again = view
                .port(port.port_num())
                .expect("listed port is reachable");
            assert_eq!(again.attr(), port.attr());
            count += 1;
        }
        assert_eq!(count, usize::from(layout.num_ports));
        if let Some(next) = layout.num_ports.checked_add(1) {
            assert!(view.port(PortNum::new(next).unwrap()).is_none());
        }
        assert!(view.vendor_data().len() <= view.as_bytes().len());

        let owned = Owned::from_view(&view);
        let encoded = owned.encode();
        let reparsed = CaAttrView::parse(&encoded).expect("re-encoding parses");
        owned.assert_same_contents(&Owned::from_view(&reparsed));
    }

    proptest! {
        #[test]
        fn ca_attr_header_round_trips(attr in arb_ca_attr()) {
            assert_round_trip(&attr);
        }

        #[test]
        fn port_attr_round_trips(attr in arb_port_attr()) {
            assert_round_trip(&attr);
        }

        #[test]
        fn ca_modify_round_trips(port in 1u8..=255, set: u32, clear: u32) {
            let set = CaModifyFlags::from_bits_truncate(set);
            let clear = CaModifyFlags::from_bits_truncate(clear)
                .difference(set)
                .difference(CaModifyFlags::RESETS);
            let modify = CaModify::new(PortNum::new(port).unwrap(), set, clear).unwrap();
            assert_round_trip(&modify);
        }

        #[test]
        fn fixed_decoders_are_total(bytes in prop::collection::vec(any::<u8>(), 0..160)) {
            assert_decode_total::<CaAttr>(&bytes);
            assert_decode_total::<PortAttr>(&bytes);
            assert_decode_total::<CaModify>(&bytes);
        }

        #[test]
        fn encode_then_parse_is_identity(owned in arb_owned()) {
            let bytes = owned.encode();
            let sizes = owned.ports.iter().map(|(_, p, g)| (p.len(), g.len()));
            prop_assert_eq!(
                ca_attr_size(owned.page_sizes.len(), sizes, owned.vendor_data.len()),
                Ok(bytes.len())
            );
            let view = CaAttrView::parse(&bytes).unwrap();
            let decoded = Owned::from_view(&view);
            owned.assert_same_contents(&decoded);
            prop_assert_eq!(decoded.encode(), bytes);
        }

        #[test]
        fn parse_never_panics_on_noise(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
            exercise(&bytes);
        }

        #[test]
        fn parse_never_panics_on_damaged_encodings(
            owned in arb_owned(),
            flips in prop::collection::vec((any::<Index>(), 1u8..), 0..6),
            words in prop::collection::vec((any::<Index>(), any::<u32>()), 0..3),
            cut in any::<Index>(),
        ) {
            let mut bytes = owned.encode();
            for (at, mask) in flips {
                let at = at.index(bytes.len());
                bytes[at] ^= mask;
            }
            for (at, value) in words {
                let at = at.index(bytes.len() / 4) * 4;
                bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
            }
            exercise(&bytes);
            let cut = cut.index(bytes.len() + 1);
            exercise(&bytes[..cut]);
        }
    }
}

/// Who an HCA is, as its CI interface reports it (the miniport answers
/// it; the bus filter keys its CA registry on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaIdentity {
    /// The CA (node) GUID.
    pub ca_guid: NodeGuid,
    /// IEEE vendor ID (24 bits).
    pub vendor_id: u32,
    /// Device ID.
    pub device_id: u16,
    /// Hardware revision.
    pub revision: u16,
}
