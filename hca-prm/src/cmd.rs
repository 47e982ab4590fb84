//! The command interface (PRM 4 and 5): opcodes, statuses, the command queue
//! entry, and the mailbox layouts of the device-level commands. Context
//! mailboxes (QP, CQ, EQ, SRQ, MPT) are in [`crate::ctx`] and [`crate::mpt`].

use bitflags::bitflags;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::{Le16, Le32, Le64};

prm_code! {
    /// Command opcodes (PRM 5.1).
    pub enum Opcode: u16 {
        /// Device capabilities.
        QueryDevCap = 0x001,
        /// Hand the device its context tables.
        InitHca = 0x002,
        /// Take the context tables back.
        CloseHca = 0x003,
        /// Do nothing (tests event delivery).
        Nop = 0x004,
        /// Bring a port up.
        InitPort = 0x010,
        /// Take a port down.
        ClosePort = 0x011,
        /// Port attributes, GID and P_Key tables.
        QueryPort = 0x012,
        /// Port capability bits and counter resets.
        SetPort = 0x013,
        /// Set a GID table entry.
        SetGid = 0x014,
        /// Set a P_Key table entry.
        SetPkey = 0x015,
        /// Create an event queue.
        Sw2HwEq = 0x020,
        /// Destroy an event queue.
        Hw2SwEq = 0x021,
        /// Read an event queue context.
        QueryEq = 0x022,
        /// Route event classes to an event queue.
        MapEq = 0x023,
        /// Create a completion queue.
        Sw2HwCq = 0x028,
        /// Destroy a completion queue.
        Hw2SwCq = 0x029,
        /// Read a completion queue context.
        QueryCq = 0x02A,
        /// Move a completion queue to a new ring.
        ResizeCq = 0x02B,
        /// Create a QP (in RESET).
        Sw2HwQp = 0x030,
        /// Change a QP's state and attributes.
        ModifyQp = 0x031,
        /// Read a QP context.
        QueryQp = 0x032,
        /// Destroy a QP.
        Hw2SwQp = 0x033,
        /// Create a shared receive queue.
        Sw2HwSrq = 0x038,
        /// Destroy a shared receive queue.
        Hw2SwSrq = 0x039,
        /// Read an SRQ context.
        QuerySrq = 0x03A,
        /// Set an SRQ's limit.
        ArmSrq = 0x03B,
        /// Create a region or window entry.
        Sw2HwMpt = 0x040,
        /// Destroy a region or window entry.
        Hw2SwMpt = 0x041,
        /// Read an MPT entry.
        QueryMpt = 0x042,
        /// Write translation entries.
        WriteMtt = 0x043,
        /// Attach a QP to a multicast group.
        AttachMcg = 0x048,
        /// Detach a QP from a multicast group.
        DetachMcg = 0x049,
        /// Process a MAD through the local agents.
        MadIfc = 0x050,
    }
}

prm_code! {
    /// Command completion status (PRM 4.4).
    pub enum CmdStatus: u8 {
        /// Success.
        Ok = 0x00,
        /// The device failed; `STATUS.FATAL` follows.
        Internal = 0x01,
        /// Unknown opcode or modifier.
        BadOpcode = 0x02,
        /// A field out of range, reserved bits set, inconsistent sizes.
        BadParam = 0x03,
        /// The device is not in a state for this command.
        BadSysState = 0x04,
        /// Object number outside its table.
        BadIndex = 0x05,
        /// The object is not in the state the command needs.
        BadResState = 0x06,
        /// The object is referenced.
        ResourceBusy = 0x07,
        /// Illegal QP transition or attributes.
        BadQpState = 0x08,
        /// DMA fault or bad length on a mailbox.
        BadMailbox = 0x09,
        /// A size or count beyond the device's limits.
        ExceedLimit = 0x0A,
        /// P_Key index outside the port's table.
        BadPkey = 0x0B,
        /// No such port.
        BadPort = 0x0C,
    }
}

bitflags! {
    /// Command entry flags.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct CmdFlags: u8 {
        /// Complete with a `CMD_COMPLETION` event instead of in the entry.
        const EVENT = 1 << 0;
    }
}

/// Bytes of a command queue entry.
pub const CMD_ENTRY_SIZE: usize = 64;
/// Largest mailbox the device accepts.
pub const MAX_MAILBOX_BYTES: usize = 4096;

/// A command queue entry (PRM 4.1), 64 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CmdEntry {
    /// [`Opcode`].
    pub opcode: Le16,
    /// Opcode modifier.
    pub op_mod: Le16,
    /// Software's token, echoed in the completion.
    pub token: Le16,
    /// [`CmdFlags`].
    pub flags: u8,
    /// Reserved.
    pub reserved_at_0x7: u8,
    /// Input modifier.
    pub in_mod: Le32,
    /// Reserved.
    pub reserved_at_0xc: [u8; 4],
    /// Immediate input or input mailbox bus address.
    pub in_param: Le64,
    /// Output mailbox bus address.
    pub out_param: Le64,
    /// Input mailbox bytes.
    pub in_len: Le32,
    /// Output mailbox bytes.
    pub out_len: Le32,
    /// Device-written immediate output.
    pub out_imm: Le64,
    /// Device-written [`CmdStatus`].
    pub status: u8,
    /// Device-written phase bit, last (PRM 4.2).
    pub done: u8,
    /// Reserved.
    pub reserved_at_0x32: [u8; 14],
}

assert_layout!(CmdEntry, size = 64, opcode @ 0x00, op_mod @ 0x02, token @ 0x04, flags @ 0x06,
    reserved_at_0x7 @ 0x07, in_mod @ 0x08, reserved_at_0xc @ 0x0C, in_param @ 0x10,
    out_param @ 0x18, in_len @ 0x20, out_len @ 0x24, out_imm @ 0x28, status @ 0x30,
    done @ 0x31, reserved_at_0x32 @ 0x32);

/// Byte offset of the device-written part of an entry (`out_imm`, `status`,
/// `done`); the device writes `done` last, at [`CMD_DONE_OFFSET`].
pub const CMD_OUTPUT_OFFSET: usize = 0x28;
/// Byte offset of the `done` byte.
pub const CMD_DONE_OFFSET: usize = 0x31;

/// `in_mod` of `SET_GID` and `SET_PKEY`: `port | index << 8`.
pub const fn port_table_in_mod(port: u8, index: u16) -> u32 {
    port as u32 | (index as u32) << 8
}

/// Splits a `port | index << 8` input modifier; the top byte must be zero.
pub const fn split_port_table_in_mod(in_mod: u32) -> Option<(u8, u16)> {
    if in_mod >> 24 != 0 {
        None
    } else {
        Some((in_mod as u8, (in_mod >> 8) as u16))
    }
}

bitflags! {
    /// Optional features in [`DevCap::flags`].
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct DevCapFlags: u32 {
        /// Reliable connected.
        const RC = 1 << 0;
        /// Unreliable connected.
        const UC = 1 << 1;
        /// Unreliable datagram.
        const UD = 1 << 2;
        /// Shared receive queues.
        const SRQ = 1 << 3;
        /// Memory windows type 1.
        const MW_TYPE1 = 1 << 4;
        /// Memory windows type 2.
        const MW_TYPE2 = 1 << 5;
        /// Atomic operations.
        const ATOMICS = 1 << 6;
        /// Multicast.
        const MULTICAST = 1 << 7;
        /// Port-active events.
        const PORT_ACTIVE_EVENT = 1 << 8;
        /// `RESIZE_CQ`.
        const RESIZE_CQ = 1 << 9;
        /// `MAD_IFC`.
        const LOCAL_MAD = 1 << 10;
    }
}

/// `QUERY_DEV_CAP` output (PRM 5.2), 256 bytes.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct DevCap {
    /// log2 of the QP table capacity.
    pub log_max_qps: u8,
    /// log2 of the CQ table capacity.
    pub log_max_cqs: u8,
    /// log2 of the EQ table capacity (at most 8: 256 EQ doorbells).
    pub log_max_eqs: u8,
    /// log2 of the SRQ table capacity.
    pub log_max_srqs: u8,
    /// log2 of the MPT table capacity.
    pub log_max_mpts: u8,
    /// log2 of the MTT table capacity.
    pub log_max_mtts: u8,
    /// log2 of the largest work queue.
    pub log_max_wqes: u8,
    /// log2 of the largest CQ.
    pub log_max_cqes: u8,
    /// log2 of the largest EQ.
    pub log_max_eqes: u8,
    /// log2 of the largest SRQ.
    pub log_max_srq_wqes: u8,
    /// log2 of the largest command queue.
    pub log_max_cmds: u8,
    /// Ports.
    pub num_ports: u8,
    /// Data segments per send WQE.
    pub max_send_sges: u8,
    /// Data segments per receive WQE.
    pub max_recv_sges: u8,
    /// log2 of the largest send WQE in bytes.
    pub log_max_wqe_size: u8,
    /// Outstanding RDMA reads/atomics per QP, either side.
    pub max_rd_atomic: u8,
    /// Largest inline payload.
    pub max_inline_bytes: Le16,
    /// UAR pages.
    pub num_uars: Le16,
    /// MSI-X vectors.
    pub num_vectors: Le16,
    /// Largest mailbox.
    pub max_mailbox_bytes: Le16,
    /// QPC bytes.
    pub qpc_entry_size: Le16,
    /// CQC bytes.
    pub cqc_entry_size: Le16,
    /// EQC bytes.
    pub eqc_entry_size: Le16,
    /// SRQC bytes.
    pub srqc_entry_size: Le16,
    /// MPT entry bytes.
    pub mpt_entry_size: Le16,
    /// MTT entry bytes (8).
    pub mtt_entry_size: Le16,
    /// Multicast groups.
    pub max_mcast_groups: Le32,
    /// QPs per multicast group.
    pub max_qps_per_mcast_group: Le32,
    /// Largest message.
    pub max_msg_size: Le32,
    /// Node (CA) GUID, host order.
    pub node_guid: Le64,
    /// System image GUID, host order.
    pub system_image_guid: Le64,
    /// IEEE vendor ID (24 bits).
    pub vendor_id: Le32,
    /// Device ID.
    pub device_id: Le16,
    /// Revision.
    pub revision: Le16,
    /// Largest region.
    pub max_mr_size: Le64,
    /// [`DevCapFlags`].
    pub flags: Le32,
    /// Local CA ACK delay exponent.
    pub local_ack_delay: u8,
    /// Reserved.
    pub reserved_at_0x55: [u8; 11],
    /// Reserved.
    pub reserved_at_0x60: [u8; 160],
}

assert_layout!(DevCap, size = 256, log_max_qps @ 0x00, log_max_cqs @ 0x01, log_max_eqs @ 0x02,
    log_max_srqs @ 0x03, log_max_mpts @ 0x04, log_max_mtts @ 0x05, log_max_wqes @ 0x06,
    log_max_cqes @ 0x07, log_max_eqes @ 0x08, log_max_srq_wqes @ 0x09, log_max_cmds @ 0x0A,
    num_ports @ 0x0B, max_send_sges @ 0x0C, max_recv_sges @ 0x0D, log_max_wqe_size @ 0x0E,
    max_rd_atomic @ 0x0F, max_inline_bytes @ 0x10, num_uars @ 0x12, num_vectors @ 0x14,
    max_mailbox_bytes @ 0x16, qpc_entry_size @ 0x18, cqc_entry_size @ 0x1A,
    eqc_entry_size @ 0x1C, srqc_entry_size @ 0x1E, mpt_entry_size @ 0x20,
    mtt_entry_size @ 0x22, max_mcast_groups @ 0x24, max_qps_per_mcast_group @ 0x28,
    max_msg_size @ 0x2C, node_guid @ 0x30, system_image_guid @ 0x38, vendor_id @ 0x40,
    device_id @ 0x44, revision @ 0x46, max_mr_size @ 0x48, flags @ 0x50,
    local_ack_delay @ 0x54, reserved_at_0x55 @ 0x55, reserved_at_0x60 @ 0x60);

prm_code! {
    /// The context tables of `INIT_HCA`, in descriptor order.
    pub enum Table: u8 {
        /// QP contexts.
        Qpc = 0,
        /// CQ contexts.
        Cqc = 1,
        /// EQ contexts.
        Eqc = 2,
        /// SRQ contexts.
        Srqc = 3,
        /// Memory protection entries.
        Mpt = 4,
        /// Memory translation entries.
        Mtt = 5,
    }
}

/// One context table's location (PRM 5.3), 16 bytes.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct TableDesc {
    /// Bus address, 4 KiB aligned.
    pub base: Le64,
    /// Entries = 2^log_count.
    pub log_count: u8,
    /// Reserved.
    pub reserved_at_0x9: [u8; 7],
}

assert_layout!(TableDesc, size = 16, base @ 0, log_count @ 8, reserved_at_0x9 @ 9);

/// `INIT_HCA` input (PRM 5.3), 128 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct InitHca {
    /// Indexed by [`Table`].
    pub tables: [TableDesc; 6],
    /// UAR pages software will use.
    pub num_uars: Le16,
    /// Host page size, log2 (12).
    pub log_page_size: u8,
    /// Reserved.
    pub reserved_at_0x63: [u8; 29],
}

assert_layout!(InitHca, size = 128, tables @ 0x00, num_uars @ 0x60, log_page_size @ 0x62,
    reserved_at_0x63 @ 0x63);

impl InitHca {
    /// The descriptor of `table`.
    pub fn table(&self, table: Table) -> &TableDesc {
        &self.tables[usize::from(table.code())]
    }
}

/// `QUERY_PORT` output, fixed part (PRM 5.4), 128 bytes; the GID table
/// (16 bytes per entry) and the P_Key table (2 bytes per entry) follow.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct PortInfo {
    /// `ib_types::scalars::PortState` code.
    pub state: u8,
    /// `ib_types::scalars::LinkLayer` code (2: Ethernet).
    pub link_layer: u8,
    /// `ib_types::scalars::Mtu` code.
    pub active_mtu: u8,
    /// `ib_types::scalars::Mtu` code.
    pub max_mtu: u8,
    /// GID table entries.
    pub gid_table_len: Le16,
    /// P_Key table entries.
    pub pkey_table_len: Le16,
    /// Port GUID, host order.
    pub port_guid: Le64,
    /// The port's MAC.
    pub mac: [u8; 6],
    /// Reserved.
    pub reserved_at_0x16: [u8; 2],
    /// PortInfo capability bits.
    pub capability_mask: Le32,
    /// Q_Key violations.
    pub qkey_violations: Le32,
    /// P_Key violations.
    pub pkey_violations: Le32,
    /// Largest message.
    pub max_msg_size: Le32,
    /// Packets sent.
    pub tx_packets: Le64,
    /// Packets received.
    pub rx_packets: Le64,
    /// Payload bytes sent.
    pub tx_bytes: Le64,
    /// Payload bytes received.
    pub rx_bytes: Le64,
    /// Malformed frames received.
    pub rx_errors: Le64,
    /// Well-formed frames dropped.
    pub rx_discards: Le64,
    /// Reserved.
    pub reserved_at_0x58: [u8; 40],
}

assert_layout!(PortInfo, size = 128, state @ 0x00, link_layer @ 0x01, active_mtu @ 0x02,
    max_mtu @ 0x03, gid_table_len @ 0x04, pkey_table_len @ 0x06, port_guid @ 0x08,
    mac @ 0x10, reserved_at_0x16 @ 0x16, capability_mask @ 0x18, qkey_violations @ 0x1C,
    pkey_violations @ 0x20, max_msg_size @ 0x24, tx_packets @ 0x28, rx_packets @ 0x30,
    tx_bytes @ 0x38, rx_bytes @ 0x40, rx_errors @ 0x48, rx_discards @ 0x50,
    reserved_at_0x58 @ 0x58);

impl PortInfo {
    /// Bytes of a `QUERY_PORT` answer with the given table sizes.
    pub const fn answer_len(gid_table_len: u16, pkey_table_len: u16) -> usize {
        core::mem::size_of::<Self>() + 16 * gid_table_len as usize + 2 * pkey_table_len as usize
    }
}

bitflags! {
    /// `SET_PORT` counter resets.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SetPortFlags: u32 {
        /// Reset the Q_Key violation counter.
        const RESET_QKEY_COUNTER = 1 << 0;
        /// Reset the P_Key violation counter.
        const RESET_PKEY_COUNTER = 1 << 1;
    }
}

/// `SET_PORT` input (PRM 5.5), 16 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct SetPort {
    /// Capability bits to set.
    pub set_caps: Le32,
    /// Capability bits to clear.
    pub clear_caps: Le32,
    /// [`SetPortFlags`].
    pub flags: Le32,
    /// Reserved.
    pub reserved_at_0xc: [u8; 4],
}

assert_layout!(SetPort, size = 16, set_caps @ 0, clear_caps @ 4, flags @ 8, reserved_at_0xc @ 12);

/// `WRITE_MTT` input header: the first MTT index; `(in_len - 8) / 8`
/// little-endian 64-bit page addresses follow.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct WriteMttHeader {
    /// Index of the first entry written.
    pub first_index: Le64,
}

assert_layout!(WriteMttHeader, size = 8, first_index @ 0);

/// MTT entries one `WRITE_MTT` mailbox can carry.
pub const MAX_MTT_PER_WRITE: usize = (MAX_MAILBOX_BYTES - 8) / 8;

/// Bytes of a MAD (`MAD_IFC` input and output).
pub const MAD_BYTES: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for &op in Opcode::ALL {
            assert_eq!(Opcode::from_code(op.code()).ok(), Some(op));
        }
        for &s in CmdStatus::ALL {
            assert_eq!(CmdStatus::from_code(s.code()).ok(), Some(s));
        }
        assert_eq!(Opcode::from_code(0x005).ok(), None);
        assert_eq!(CmdStatus::from_code(0x0D).ok(), None);
    }

    #[test]
    fn entry_byte_image() {
        let entry = CmdEntry {
            opcode: Le16::new(Opcode::Sw2HwCq.code()),
            token: Le16::new(0xBEEF),
            flags: CmdFlags::EVENT.bits(),
            in_mod: Le32::new(7),
            in_param: Le64::new(0x1_2000),
            in_len: Le32::new(64),
            ..CmdEntry::default()
        };
        let mut expected = [0u8; 64];
        expected[0] = 0x28;
        expected[4..6].copy_from_slice(&[0xEF, 0xBE]);
        expected[6] = 1;
        expected[8] = 7;
        expected[0x10..0x18].copy_from_slice(&0x1_2000u64.to_le_bytes());
        expected[0x20] = 64;
        assert_eq!(entry.as_bytes(), &expected);
    }

    #[test]
    fn port_table_modifier() {
        assert_eq!(port_table_in_mod(2, 5), 0x502);
        assert_eq!(split_port_table_in_mod(0x502), Some((2, 5)));
        assert_eq!(split_port_table_in_mod(0x0100_0502), None);
        assert_eq!(PortInfo::answer_len(16, 4), 128 + 256 + 8);
        assert_eq!(MAX_MTT_PER_WRITE, 511);
    }
}
