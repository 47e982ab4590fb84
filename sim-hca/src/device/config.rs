//! What a simulated HCA is built with: its identity, ports and limits — the
//! "non-volatile settings" of PRM 5.4 — and the capability record it reports.

use hca_prm::cmd::{DevCap, DevCapFlags};
use hca_prm::ctx::entry_size;
use hca_prm::regs;
use hca_prm::{Le16, Le32, Le64};
use ib_types::scalars::Mtu;
use zerocopy::FromZeros;

/// One port's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortConfig {
    /// The port's IPv4 address; GID 0 is its IPv4-mapped GID.
    pub ipv4: [u8; 4],
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
}

/// Limits, as log2 of table sizes and per-queue maxima.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// QP table.
    pub log_max_qps: u8,
    /// CQ table.
    pub log_max_cqs: u8,
    /// EQ table (at most 8).
    pub log_max_eqs: u8,
    /// SRQ table.
    pub log_max_srqs: u8,
    /// MPT table.
    pub log_max_mpts: u8,
    /// MTT table.
    pub log_max_mtts: u8,
    /// Entries per work queue.
    pub log_max_wqes: u8,
    /// Entries per CQ.
    pub log_max_cqes: u8,
    /// Entries per EQ.
    pub log_max_eqes: u8,
    /// Entries per SRQ.
    pub log_max_srq_wqes: u8,
    /// Command queue entries.
    pub log_max_cmds: u8,
    /// Data segments per send WQE.
    pub max_send_sges: u8,
    /// Data segments per receive WQE.
    pub max_recv_sges: u8,
    /// Largest send WQE, log2 bytes.
    pub log_max_wqe_size: u8,
    /// Outstanding reads/atomics per QP.
    pub max_rd_atomic: u8,
    /// Largest inline payload.
    pub max_inline_bytes: u16,
    /// UAR pages.
    pub num_uars: u16,
    /// MSI-X vectors.
    pub num_vectors: u16,
    /// Multicast groups.
    pub max_mcast_groups: u32,
    /// QPs per multicast group.
    pub max_qps_per_mcast_group: u32,
    /// GID table entries per port.
    pub gid_table_len: u16,
    /// P_Key table entries per port.
    pub pkey_table_len: u16,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            log_max_qps: 12,
            log_max_cqs: 12,
            log_max_eqs: 5,
            log_max_srqs: 8,
            log_max_mpts: 14,
            log_max_mtts: 18,
            log_max_wqes: 14,
            log_max_cqes: 16,
            log_max_eqes: 16,
            log_max_srq_wqes: 14,
            log_max_cmds: 4,
            max_send_sges: 16,
            max_recv_sges: 16,
            log_max_wqe_size: 9,
            max_rd_atomic: 16,
            max_inline_bytes: 256,
            num_uars: 1023,
            num_vectors: 32,
            max_mcast_groups: 256,
            max_qps_per_mcast_group: 64,
            gid_table_len: 16,
            pkey_table_len: 16,
        }
    }
}

/// A device's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Node (CA) GUID; port GUIDs are `node_guid + port`.
    pub node_guid: u64,
    /// Firmware version reported in `FW_VERSION`.
    pub fw_version: u64,
    /// The ports, port 1 first.
    pub ports: Vec<PortConfig>,
    /// Limits.
    pub limits: Limits,
}

impl DeviceConfig {
    /// A device with one port per address, 4096-byte MTU, default limits.
    pub fn with_ports(node_guid: u64, addresses: &[[u8; 4]]) -> Self {
        Self {
            node_guid,
            fw_version: 0x0001_0000_0000,
            ports: addresses
                .iter()
                .map(|&ipv4| PortConfig {
                    ipv4,
                    max_mtu: Mtu::Mtu4096,
                })
                .collect(),
            limits: Limits::default(),
        }
    }

    /// Largest message, bytes.
    pub const MAX_MSG_SIZE: u32 = 1 << 31;

    /// The `QUERY_DEV_CAP` record this configuration reports.
    pub fn dev_cap(&self) -> DevCap {
        let l = &self.limits;
        let mut cap = DevCap::new_zeroed();
        cap.log_max_qps = l.log_max_qps;
        cap.log_max_cqs = l.log_max_cqs;
        cap.log_max_eqs = l.log_max_eqs;
        cap.log_max_srqs = l.log_max_srqs;
        cap.log_max_mpts = l.log_max_mpts;
        cap.log_max_mtts = l.log_max_mtts;
        cap.log_max_wqes = l.log_max_wqes;
        cap.log_max_cqes = l.log_max_cqes;
        cap.log_max_eqes = l.log_max_eqes;
        cap.log_max_srq_wqes = l.log_max_srq_wqes;
        cap.log_max_cmds = l.log_max_cmds;
        cap.num_ports = self.ports.len() as u8;
        cap.max_send_sges = l.max_send_sges;
        cap.max_recv_sges = l.max_recv_sges;
        cap.log_max_wqe_size = l.log_max_wqe_size;
        cap.max_rd_atomic = l.max_rd_atomic;
        cap.max_inline_bytes = Le16::new(l.max_inline_bytes);
        cap.num_uars = Le16::new(l.num_uars);
        cap.num_vectors = Le16::new(l.num_vectors);
        cap.max_mailbox_bytes = Le16::new(hca_prm::cmd::MAX_MAILBOX_BYTES as u16);
        cap.qpc_entry_size = Le16::new(entry_size::QPC);
        cap.cqc_entry_size = Le16::new(entry_size::CQC);
        cap.eqc_entry_size = Le16::new(entry_size::EQC);
        cap.srqc_entry_size = Le16::new(entry_size::SRQC);
        cap.mpt_entry_size = Le16::new(entry_size::MPT);
        cap.mtt_entry_size = Le16::new(entry_size::MTT);
        cap.max_mcast_groups = Le32::new(l.max_mcast_groups);
        cap.max_qps_per_mcast_group = Le32::new(l.max_qps_per_mcast_group);
        cap.max_msg_size = Le32::new(Self::MAX_MSG_SIZE);
        cap.node_guid = Le64::new(self.node_guid);
        cap.system_image_guid = Le64::new(self.node_guid);
        cap.vendor_id = Le32::new(regs::IEEE_VENDOR_ID);
        cap.device_id = Le16::new(regs::PCI_DEVICE_ID);
        cap.revision = Le16::new(u16::from(regs::PCI_REVISION));
        cap.max_mr_size = Le64::new(1 << 40);
        cap.flags = Le32::new(DevCapFlags::all().bits());
        cap.local_ack_delay = 8;
        cap
    }
}
