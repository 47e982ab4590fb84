//! The path of an RC QP as the sample clients here and the scenario tests
//! take it: its create attributes, the physical registration of the
//! common buffer it moves data from and to, and the RESET -> INIT -> RTR
//! -> RTS modifies aimed at a port by its GID. One copy, so that a client
//! and the tests checking it do it the same way.

use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::mr::PhysMrRegister;
use ib_types::qp::{QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Mtu, PortNum, Psn, Qpn};

/// Both sides' first packet sequence number.
const START_PSN: u32 = 100;

/// The page size of a physical registration.
const PAGE_BYTES: u64 = 4096;

/// A QP of `qp_type` on `pd` with both queues on `cq`, `depth` work
/// requests of one SGE each way, no inline data, signalling chosen per
/// request.
pub fn rc_qp_create(qp_type: QpType, pd: u64, cq: u64, depth: u32) -> QpCreate {
    QpCreate {
        qp_type,
        pd: PdHandle::from_raw(pd),
        send_cq: CqHandle::from_raw(cq),
        recv_cq: CqHandle::from_raw(cq),
        srq: None,
        caps: QpCaps {
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: false,
        port: None,
    }
}

/// The physical registration (local write) of the `bytes` of a common
/// buffer at bus address `base`, 4 KiB pages: the fixed input and its page
/// list (the private input of `RegPhysMr`).
pub fn phys_mr_register(base: u64, bytes: usize) -> (PhysMrRegister, Vec<u8>) {
    let pages = (bytes as u64).div_ceil(PAGE_BYTES);
    let input = PhysMrRegister {
        iova: base,
        length: bytes as u64,
        first_byte_offset: 0,
        page_shift: PAGE_BYTES.trailing_zeros() as u8,
        num_pages: pages as u32,
        access: AccessFlags::LOCAL_WRITE,
    };
    let list = (0..pages)
        .flat_map(|i| (base + i * PAGE_BYTES).to_le_bytes())
        .collect();
    (input, list)
}

/// An address vector out of `port` to `dgid` (RoCE GRH: hop limit 64,
/// SGID index 0).
pub fn grh_av(port: PortNum, dgid: Gid) -> AvAttr {
    AvAttr::roce(port, dgid, 0)
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
