//! The device's QP state machine agrees with IBA Table 91 as `ib_types`
//! states it: for random sequences of `MODIFY_QP` requests (random target
//! states and random attribute sets), the device accepts exactly the
//! requests the table accepts, and its QP ends in the state the table
//! predicts.

mod common;

use common::*;
use hca_prm::cmd::CmdStatus;
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::qp::{QpModify, QpState, QpType};
use ib_types::qp_state::check_modify;
use ib_types::scalars::{Gid, Mtu, PortNum, Psn, QKey, Qpn};
use proptest::prelude::*;

/// A modify with a random subset of attributes, each with a valid value.
fn any_modify() -> impl Strategy<Value = QpModify> {
    let state = || proptest::option::of(proptest::sample::select(QpState::ALL));
    (state(), any::<u32>(), any::<bool>()).prop_map(|(to, bits, with_state)| {
        let has = |bit: u32| bits & (1 << bit) != 0;
        QpModify {
            state: if with_state { to } else { None },
            cur_state: None,
            en_sqd_async_notify: has(0).then_some(true),
            access: has(1).then_some(AccessFlags::REMOTE_WRITE),
            pkey_index: has(2).then_some(0),
            port: has(3).then_some(PortNum::FIRST),
            qkey: has(4).then_some(QKey::new(0x77)),
            av: has(5).then(|| AvAttr::roce(PortNum::FIRST, Gid::from_ipv4(IP_B), 0)),
            path_mtu: has(6).then_some(Mtu::Mtu1024),
            timeout: has(7).then_some(10),
            retry_cnt: has(8).then_some(3),
            rnr_retry: has(9).then_some(3),
            rq_psn: has(10).then(|| Psn::new(9).unwrap()),
            max_rd_atomic: has(11).then_some(2),
            alt_path: None,
            min_rnr_timer: has(12).then_some(4),
            sq_psn: has(13).then(|| Psn::new(1).unwrap()),
            max_dest_rd_atomic: has(14).then_some(2),
            path_mig_state: None,
            cap: None,
            dest_qpn: has(15).then(|| Qpn::new(0x42).unwrap()),
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn device_follows_table_91(
        qp_type in proptest::sample::select(&[QpType::Rc, QpType::Uc, QpType::Ud][..]),
        steps in proptest::collection::vec(any_modify(), 1..12),
    ) {
        let mut p = Pair::new();
        let ep = endpoint(&mut p.a, qp_type, AccessFlags::empty());
        let mut state = QpState::Reset;
        for m in &steps {
            let expected = check_modify(qp_type, state, m);
            let status = p.a.drv.modify_qp(&mut p.a.dev, &ep.qp, m);
            match expected {
                Ok(next) => {
                    prop_assert_eq!(status, CmdStatus::Ok, "{:?} {:?} -> {:?}", qp_type, state, m.mask());
                    state = next;
                }
                Err(_) => prop_assert_eq!(status, CmdStatus::BadQpState, "{:?} {:?}: {:?}", qp_type, state, m.mask()),
            }
            let qpc = p.a.drv.query_qp(&mut p.a.dev, ep.qp.qpn).unwrap();
            prop_assert_eq!(qpc.state, state.code());
        }
    }
}

/// PRM 6.1.2: a general QP may be created with no port (0) and gets one at
/// RESET->INIT; a special QP's port names its slot, so 0 is refused, as is
/// a port the device lacks for either.
#[test]
fn a_general_qp_takes_its_port_at_reset_to_init() {
    let mut p = Pair::new();
    let ep = endpoint(&mut p.a, QpType::Ud, AccessFlags::empty());
    let qpc = p.a.drv.query_qp(&mut p.a.dev, ep.qp.qpn).unwrap();
    assert_eq!(qpc.port, 0);
    let init = bring_up::to_init(QpType::Ud, AccessFlags::empty(), 0x11);
    assert_eq!(
        p.a.drv.modify_qp(&mut p.a.dev, &ep.qp, &init),
        CmdStatus::Ok
    );
    let qpc = p.a.drv.query_qp(&mut p.a.dev, ep.qp.qpn).unwrap();
    assert_eq!(qpc.port, 1);

    let cq = &ep.cq;
    let create = |node: &mut Node, qp_type, port| {
        node.drv
            .create_qp(&mut node.dev, qp_type, port, PD, cq, cq, None, (4, 4))
            .map(|_| ())
    };
    assert_eq!(create(&mut p.a, QpType::Gsi, 0), Err(CmdStatus::BadPort));
    assert_eq!(create(&mut p.a, QpType::Rc, 9), Err(CmdStatus::BadPort));
    assert_eq!(create(&mut p.a, QpType::Rc, 1), Ok(()));
}
