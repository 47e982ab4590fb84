//! The RESET -> INIT -> RTR -> RTS path of an RC QP aimed at a port by its
//! GID, as the sample clients here and the scenario tests take it: one
//! sequence of modifies, so that a client and the tests checking it
//! connect the same way.

use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::qp::{QpModify, QpState};
use ib_types::scalars::{Gid, Lid, Mtu, PortNum, Psn, Qpn};

/// Both sides' first packet sequence number.
const START_PSN: u32 = 100;

/// An address vector out of `port` to `dgid` (GRH, hop limit 64, SGID
/// index 0).
pub fn grh_av(port: PortNum, dgid: Gid) -> AvAttr {
    AvAttr {
        port,
        sl: 0,
        dlid: Lid::default(),
        path_bits: 0,
        static_rate: 0,
        grh: Some(Grh {
            dgid,
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0,
            sgid_index: 0,
        }),
    }
}

/// The three modifies taking an RC QP on `port` from RESET to RTS towards
/// QP `dest` at `dgid`: remote `access` at INIT, 1024-byte MTU, PSN 100
/// both ways, `rd_atomic` reads in flight each way.
pub fn rc_to_rts_steps(
    port: PortNum,
    access: AccessFlags,
    dest: Qpn,
    dgid: Gid,
    rd_atomic: u8,
) -> [QpModify; 3] {
    [
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(port),
            access: Some(access),
            ..QpModify::default()
        },
        QpModify {
            state: Some(QpState::Rtr),
            av: Some(grh_av(port, dgid)),
            path_mtu: Some(Mtu::Mtu1024),
            dest_qpn: Some(dest),
            rq_psn: Some(Psn::from_low_bits(START_PSN)),
            max_dest_rd_atomic: Some(rd_atomic),
            min_rnr_timer: Some(12),
            ..QpModify::default()
        },
        QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::from_low_bits(START_PSN)),
            timeout: Some(14),
            retry_cnt: Some(7),
            rnr_retry: Some(7),
            max_rd_atomic: Some(rd_atomic),
            ..QpModify::default()
        },
    ]
}
