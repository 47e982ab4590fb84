//! Ports (PRM 5.4, 10.1): link and logical state, the GID and P_Key tables,
//! capability bits, violation counters and packet counters.

use hca_prm::cmd::PortInfo;
use hca_prm::{Le16, Le32, Le64};
use ib_types::scalars::{Gid, LinkLayer, PortState};
use zerocopy::{FromZeros, IntoBytes};

use super::DeviceConfig;
use super::config::{Limits, PortConfig};

/// A port's packet counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PortCounters {
    /// Packets sent.
    pub tx_packets: u64,
    /// Packets received and accepted.
    pub rx_packets: u64,
    /// Payload bytes sent.
    pub tx_bytes: u64,
    /// Payload bytes received.
    pub rx_bytes: u64,
    /// Malformed frames (bad headers, ICRC) dropped.
    pub rx_errors: u64,
    /// Well-formed frames dropped (unknown QP, key mismatch, wrong state).
    pub rx_discards: u64,
    /// ACKs not sent (so not in `tx_packets`) because the next one sent
    /// acknowledges their packets too: direct placement (the fast mode)
    /// coalesces a run of ACKs of one QP into its last (IBA 9.7.5.1.x).
    pub acks_coalesced: u64,
}

#[derive(Debug)]
pub(crate) struct Port {
    pub cfg: PortConfig,
    pub guid: u64,
    /// `INIT_PORT` done and no `CLOSE_PORT` since.
    pub initialized: bool,
    /// The fabric link is up.
    pub link_up: bool,
    pub gids: Vec<Gid>,
    pub pkeys: Vec<u16>,
    pub caps: u32,
    pub qkey_violations: u32,
    pub pkey_violations: u32,
    pub counters: PortCounters,
}

impl Port {
    pub(crate) fn new(cfg: PortConfig, guid: u64, limits: &Limits) -> Self {
        let mut gids = vec![Gid::ZERO; usize::from(limits.gid_table_len.max(1))];
        gids[0] = Gid::from_ipv4(cfg.ipv4);
        let mut pkeys = vec![0u16; usize::from(limits.pkey_table_len.max(1))];
        pkeys[0] = 0xFFFF;
        Self {
            cfg,
            guid,
            initialized: false,
            link_up: false,
            gids,
            pkeys,
            caps: 0,
            qkey_violations: 0,
            pkey_violations: 0,
            counters: PortCounters::default(),
        }
    }

    /// The port's IPv4 address (GID 0).
    pub(crate) fn ipv4(&self) -> [u8; 4] {
        self.gids[0].ipv4().unwrap_or(self.cfg.ipv4)
    }

    /// The port's MAC, derived from GID 0 (PRM 10.1).
    pub(crate) fn mac(&self) -> [u8; 6] {
        crate::wire::eth::MacAddr::for_ipv4(self.ipv4().into()).octets()
    }

    /// Logical state: DOWN without link, INIT with link before `INIT_PORT`,
    /// ACTIVE with both (the model has no subnet manager to arm ports).
    pub(crate) fn state(&self) -> PortState {
        match (self.link_up, self.initialized) {
            (false, _) => PortState::Down,
            (true, false) => PortState::Init,
            (true, true) => PortState::Active,
        }
    }

    pub(crate) fn is_active(&self) -> bool {
        self.state() == PortState::Active
    }

    /// The `QUERY_PORT` answer: fixed part, GID table, P_Key table.
    pub(crate) fn query(&self, out: &mut Vec<u8>) {
        let mut info = PortInfo::new_zeroed();
        info.state = self.state().code();
        info.link_layer = LinkLayer::Ethernet.code();
        info.active_mtu = self.cfg.max_mtu.code();
        info.max_mtu = self.cfg.max_mtu.code();
        info.gid_table_len = Le16::new(self.gids.len() as u16);
        info.pkey_table_len = Le16::new(self.pkeys.len() as u16);
        info.port_guid = Le64::new(self.guid);
        info.mac = self.mac();
        info.capability_mask = Le32::new(self.caps);
        info.qkey_violations = Le32::new(self.qkey_violations);
        info.pkey_violations = Le32::new(self.pkey_violations);
        info.max_msg_size = Le32::new(DeviceConfig::MAX_MSG_SIZE);
        let c = &self.counters;
        info.tx_packets = Le64::new(c.tx_packets);
        info.rx_packets = Le64::new(c.rx_packets);
        info.tx_bytes = Le64::new(c.tx_bytes);
        info.rx_bytes = Le64::new(c.rx_bytes);
        info.rx_errors = Le64::new(c.rx_errors);
        info.rx_discards = Le64::new(c.rx_discards);
        out.clear();
        out.extend_from_slice(info.as_bytes());
        for gid in &self.gids {
            out.extend_from_slice(gid.as_bytes());
        }
        for pkey in &self.pkeys {
            out.extend_from_slice(&pkey.to_le_bytes());
        }
    }

    /// The index of a GID in the table, if present.
    pub(crate) fn gid_index(&self, gid: Gid) -> Option<usize> {
        if gid.is_zero() {
            return None;
        }
        self.gids.iter().position(|g| *g == gid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_follows_link_and_init() {
        let mut p = Port::new(
            PortConfig {
                ipv4: [10, 0, 0, 1],
                max_mtu: ib_types::scalars::Mtu::Mtu4096,
            },
            7,
            &Limits::default(),
        );
        assert_eq!(p.state(), PortState::Down);
        p.link_up = true;
        assert_eq!(p.state(), PortState::Init);
        p.initialized = true;
        assert!(p.is_active());
        let mut answer = Vec::new();
        p.query(&mut answer);
        assert_eq!(answer.len(), PortInfo::answer_len(16, 16));
        assert_eq!(answer[0], PortState::Active.code());
        assert_eq!(&answer[0x10..0x16], &[2, 0, 10, 0, 0, 1]);
    }
}

/// Byte offsets in a MAD (IBA 13.4.2) and SMP (IBA 14.2.1.1).
mod mad {
    pub(super) const BASE_VERSION: usize = 0;
    pub(super) const MGMT_CLASS: usize = 1;
    pub(super) const METHOD: usize = 3;
    pub(super) const STATUS: usize = 4;
    pub(super) const ATTR_ID: usize = 16;
    /// SMP data for LID-routed and directed-route SMPs.
    pub(super) const SMP_DATA: usize = 64;
    pub(super) const CLASS_SUBN_LID_ROUTED: u8 = 0x01;
    pub(super) const CLASS_SUBN_DIRECTED_ROUTE: u8 = 0x81;
    pub(super) const METHOD_GET: u8 = 0x01;
    pub(super) const METHOD_GET_RESP: u8 = 0x81;
    pub(super) const ATTR_NODE_DESCRIPTION: u16 = 0x0010;
    pub(super) const ATTR_NODE_INFO: u16 = 0x0011;
    /// "Unsupported method/attribute combination" (IBA Table 111).
    pub(super) const STATUS_UNSUPPORTED_ATTR: u16 = 0x000C;
    /// "Bad version" (IBA Table 111).
    pub(super) const STATUS_BAD_VERSION: u16 = 0x0004;
}

/// The local subnet management agent behind `MAD_IFC`: answers SubnGet of
/// NodeInfo and NodeDescription (the SMP data replaced by the attribute);
/// everything else is echoed back as a GetResp with the "unsupported
/// method/attribute" (or "bad version") status. The input is 256 bytes.
pub(crate) fn answer_mad(dev: &super::Device, port_no: u8, request: &[u8]) -> Vec<u8> {
    let mut resp = request.to_vec();
    let class = request[mad::MGMT_CLASS];
    let method = request[mad::METHOD];
    let attr = u16::from_be_bytes([request[mad::ATTR_ID], request[mad::ATTR_ID + 1]]);
    resp[mad::METHOD] = mad::METHOD_GET_RESP;
    let is_smp = matches!(
        class,
        mad::CLASS_SUBN_LID_ROUTED | mad::CLASS_SUBN_DIRECTED_ROUTE
    );
    let status = if request[mad::BASE_VERSION] != 1 {
        mad::STATUS_BAD_VERSION
    } else if !is_smp || method != mad::METHOD_GET {
        mad::STATUS_UNSUPPORTED_ATTR
    } else {
        let data = &mut resp[mad::SMP_DATA..];
        match attr {
            mad::ATTR_NODE_INFO => {
                data.fill(0);
                let cfg = dev.config();
                let port_guid = cfg.node_guid + u64::from(port_no);
                data[0] = 1; // base version
                data[1] = 1; // class version
                data[2] = 1; // node type: channel adapter
                data[3] = dev.num_ports();
                data[4..12].copy_from_slice(&cfg.node_guid.to_be_bytes()); // system image
                data[12..20].copy_from_slice(&cfg.node_guid.to_be_bytes());
                data[20..28].copy_from_slice(&port_guid.to_be_bytes());
                data[28..30].copy_from_slice(&(cfg.limits.pkey_table_len).to_be_bytes());
                data[30..32].copy_from_slice(&hca_prm::regs::PCI_DEVICE_ID.to_be_bytes());
                data[32..36].copy_from_slice(&u32::from(hca_prm::regs::PCI_REVISION).to_be_bytes());
                data[36] = port_no;
                data[37..40].copy_from_slice(&hca_prm::regs::IEEE_VENDOR_ID.to_be_bytes()[1..]);
                0
            }
            mad::ATTR_NODE_DESCRIPTION => {
                data.fill(0);
                let text = b"simulated RoCE HCA";
                data[..text.len()].copy_from_slice(text);
                0
            }
            _ => mad::STATUS_UNSUPPORTED_ATTR,
        }
    };
    resp[mad::STATUS..mad::STATUS + 2].copy_from_slice(&status.to_be_bytes());
    if class == mad::CLASS_SUBN_DIRECTED_ROUTE {
        // The D (direction) bit: a response travels back along the path.
        resp[mad::STATUS] |= 0x80;
    }
    resp
}
