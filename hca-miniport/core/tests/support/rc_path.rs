//! The RESET -> INIT -> RTR -> RTS path of a kernel or user RC QP aimed
//! at a port addressed by its IPv4 GID, as the data-moving tests take it.

use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::qp::{QpModify, QpState};
use ib_types::scalars::{Gid, Lid, Mtu, PortNum, Psn, Qpn};

/// An address vector out of `port` to the GID of `dest_ip` (GRH, hop
/// limit 64, SGID index 0).
pub(crate) fn grh_av(port: u8, dest_ip: [u8; 4]) -> AvAttr {
    AvAttr {
        port: PortNum::new(port).unwrap(),
        sl: 0,
        dlid: Lid::default(),
        path_bits: 0,
        static_rate: 0,
        grh: Some(Grh {
            dgid: Gid::from_ipv4(dest_ip),
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0,
            sgid_index: 0,
        }),
    }
}

/// The three modifies taking an RC QP on `port` from RESET to RTS towards
/// QP `dest` at `dest_ip`: remote `access` at INIT, 1024-byte MTU, PSN 100
/// both ways, `rd_atomic` reads in flight each way.
pub(crate) fn rc_to_rts_steps(
    port: u8,
    access: AccessFlags,
    dest: u32,
    dest_ip: [u8; 4],
    rd_atomic: u8,
) -> [QpModify; 3] {
    [
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(PortNum::new(port).unwrap()),
            access: Some(access),
            ..QpModify::default()
        },
        QpModify {
            state: Some(QpState::Rtr),
            av: Some(grh_av(port, dest_ip)),
            path_mtu: Some(Mtu::Mtu1024),
            dest_qpn: Some(Qpn::new(dest).unwrap()),
            rq_psn: Some(Psn::new(100).unwrap()),
            max_dest_rd_atomic: Some(rd_atomic),
            min_rnr_timer: Some(12),
            ..QpModify::default()
        },
        QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(100).unwrap()),
            timeout: Some(14),
            retry_cnt: Some(7),
            rnr_retry: Some(7),
            max_rd_atomic: Some(rd_atomic),
            ..QpModify::default()
        },
    ]
}
