//! The QP verbs on the simulated host: create (RC, UC, UD, special),
//! query, modify through the state machine, destroy, with requests built
//! by `ib_types::ioctl::encode_request` and issued from DPCs. Each test
//! ends with the host shut down and the verifier clean.

mod support;

use driver_platform::RequestorMode;
use ib_types::av::{AvAttr, Grh};
use ib_types::cq::CqAttr;
use ib_types::handle::{CqHandle, PdHandle, SrqHandle};
use ib_types::ioctl::{
    AllocPd, CreateCq, CreateQp, DeallocPd, DestroyCq, DestroyQp, Empty, ModifyQp, OpenCa,
    OpenCaIn, QpCreated, QueryQp,
};
use ib_types::qp::{QpAttrMask, QpCaps, QpCreate, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, Mtu, PortNum, Psn, QKey, Qpn};
use ib_types::status::IbStatus;
use support::{World, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;
const USER: RequestorMode = RequestorMode::User;

struct Setup {
    ca: u64,
    pd: u64,
    cq: u64,
}

fn setup(w: &World) -> Setup {
    let r = w.call::<OpenCa>(KERNEL, 0, &OpenCaIn::CURRENT, 0);
    let ca = response::<OpenCa>(&r).handle;
    let r = w.call_in_dpc::<AllocPd>(KERNEL, ca, &Empty, 0);
    let pd = response::<AllocPd>(&r).handle;
    let attr = CqAttr {
        cqe: 64,
        comp_vector: 0,
    };
    let r = w.call_in_dpc::<CreateCq>(KERNEL, ca, &attr, 0);
    let cq = response::<CreateCq>(&r).handle;
    Setup { ca, pd, cq }
}

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 10,
        max_recv_wr: 12,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 32,
    }
}

fn qp_create(s: &Setup, qp_type: QpType, port: Option<u8>) -> QpCreate {
    QpCreate {
        qp_type,
        pd: PdHandle::from_raw(s.pd),
        send_cq: CqHandle::from_raw(s.cq),
        recv_cq: CqHandle::from_raw(s.cq),
        srq: None,
        caps: caps(),
        sq_sig_all: false,
        port: port.map(|p| PortNum::new(p).unwrap()),
    }
}

fn create(
    w: &World,
    mode: RequestorMode,
    s: &Setup,
    input: &QpCreate,
) -> (IbStatus, u64, Option<QpCreated>) {
    let r = w.call_in_dpc::<CreateQp>(mode, s.ca, input, 0);
    let resp = response::<CreateQp>(&r);
    (resp.status, resp.handle, resp.output)
}

fn modify(w: &World, qp: u64, m: &QpModify) -> IbStatus {
    let r = w.call_in_dpc::<ModifyQp>(KERNEL, qp, m, 0);
    response::<ModifyQp>(&r).status
}

fn query(w: &World, qp: u64) -> ib_types::ioctl::QpQueryOut {
    let r = w.call_in_dpc::<QueryQp>(KERNEL, qp, &Empty, 0);
    let resp = response::<QueryQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    resp.output.unwrap()
}

fn destroy(w: &World, qp: u64) -> IbStatus {
    let r = w.call_in_dpc::<DestroyQp>(KERNEL, qp, &Empty, 0);
    response::<DestroyQp>(&r).status
}

fn av_to(port: u8, ip: [u8; 4]) -> AvAttr {
    AvAttr {
        port: PortNum::new(port).unwrap(),
        sl: 0,
        dlid: Lid::default(),
        path_bits: 0,
        static_rate: 0,
        grh: Some(Grh {
            dgid: Gid::from_ipv4(ip),
            flow_label: 0,
            hop_limit: 64,
            traffic_class: 0,
            sgid_index: 0,
        }),
    }
}

fn to_init(port: u8) -> QpModify {
    QpModify {
        state: Some(QpState::Init),
        pkey_index: Some(0),
        port: Some(PortNum::new(port).unwrap()),
        access: Some(ib_types::access::AccessFlags::REMOTE_WRITE),
        ..QpModify::default()
    }
}

fn to_rtr(dest: u32) -> QpModify {
    QpModify {
        state: Some(QpState::Rtr),
        av: Some(av_to(1, [10, 0, 0, 1])),
        path_mtu: Some(Mtu::Mtu1024),
        dest_qpn: Some(Qpn::new(dest).unwrap()),
        rq_psn: Some(Psn::new(100).unwrap()),
        max_dest_rd_atomic: Some(4),
        min_rnr_timer: Some(12),
        ..QpModify::default()
    }
}

fn to_rts() -> QpModify {
    QpModify {
        state: Some(QpState::Rts),
        sq_psn: Some(Psn::new(200).unwrap()),
        timeout: Some(14),
        retry_cnt: Some(7),
        rnr_retry: Some(7),
        max_rd_atomic: Some(4),
        ..QpModify::default()
    }
}

#[test]
fn rc_qps_are_created_connected_queried_and_destroyed() {
    let w = World::deterministic(31);
    let s = setup(&w);
    let (status, a, created) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Rc, None));
    assert_eq!(status, IbStatus::Success);
    let created = created.unwrap();
    // General QPs are numbered above the two ports' special QPs.
    assert!(created.qpn.get() >= 4);
    assert!(created.caps.max_send_wr >= 10 && created.caps.max_recv_wr >= 12);
    assert!(created.caps.max_send_sge >= 2 && created.caps.max_inline_data >= 32);
    let (_, b, created_b) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Rc, None));
    let qpn_b = created_b.unwrap().qpn.get();
    assert_ne!(qpn_b, created.qpn.get());

    // The PD and CQ are in use.
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, s.pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::ResourceBusy);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, s.cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::ResourceBusy);

    let q = query(&w, a);
    assert_eq!((q.qp_type, q.state), (QpType::Rc, QpState::Reset));
    assert_eq!(q.caps, created.caps);

    // Illegal transitions and missing or extra attributes: refused with
    // the table's status, state unchanged.
    let rts = QpModify::to_state(QpState::Rts);
    assert_eq!(modify(&w, a, &rts), IbStatus::InvalidState);
    let bare_init = QpModify::to_state(QpState::Init);
    assert_eq!(modify(&w, a, &bare_init), IbStatus::InvalidParameter);
    let extra = QpModify {
        sq_psn: Some(Psn::new(1).unwrap()),
        ..to_init(1)
    };
    assert_eq!(modify(&w, a, &extra), IbStatus::InvalidSetting);
    assert_eq!(query(&w, a).state, QpState::Reset);

    // RESET -> INIT -> RTR -> RTS, each pointing at the other.
    for (qp, dest) in [(a, qpn_b), (b, created.qpn.get())] {
        assert_eq!(modify(&w, qp, &to_init(1)), IbStatus::Success);
        assert_eq!(query(&w, qp).state, QpState::Init);
        assert_eq!(modify(&w, qp, &to_rtr(dest)), IbStatus::Success);
        assert_eq!(modify(&w, qp, &to_rts()), IbStatus::Success);
    }
    let q = query(&w, a);
    assert_eq!(q.state, QpState::Rts);
    assert_eq!(q.attr.dest_qpn.map(Qpn::get), Some(qpn_b));
    assert_eq!(q.attr.sq_psn.map(Psn::get), Some(200));
    assert!(
        !q.attr
            .mask()
            .intersects(QpAttrMask::STATE | QpAttrMask::CAP)
    );
    let wrong_cur = QpModify {
        cur_state: Some(QpState::Sqd),
        ..QpModify::default()
    };
    assert_eq!(modify(&w, a, &wrong_cur), IbStatus::InvalidQpState);
    assert_eq!(query(&w, a).state, QpState::Rts);

    // To ERR and back to RESET clears the attributes.
    assert_eq!(
        modify(&w, a, &QpModify::to_state(QpState::Err)),
        IbStatus::Success
    );
    assert_eq!(
        modify(&w, a, &QpModify::to_state(QpState::Reset)),
        IbStatus::Success
    );
    assert_eq!(query(&w, a).attr, QpModify::default());

    assert_eq!(destroy(&w, a), IbStatus::Success);
    assert_eq!(destroy(&w, a), IbStatus::InvalidQpHandle);
    assert_eq!(destroy(&w, b), IbStatus::Success);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, s.cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, s.pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    w.finish();
}

#[test]
fn ud_and_special_qps_and_refusals() {
    let w = World::deterministic(32);
    let s = setup(&w);
    let (status, ud, _) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Ud, None));
    assert_eq!(status, IbStatus::Success);
    let m = QpModify {
        qkey: Some(QKey::new(0x1234)),
        ..to_init(1)
    };
    let m = QpModify { access: None, ..m };
    assert_eq!(modify(&w, ud, &m), IbStatus::Success);
    assert_eq!(query(&w, ud).attr.qkey, Some(QKey::new(0x1234)));

    // GSI of port 2 at its fixed number; only once.
    let (status, gsi, created) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Gsi, Some(2)));
    assert_eq!(status, IbStatus::Success);
    assert_eq!(created.unwrap().qpn.get(), 3);
    let (status, _, _) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Gsi, Some(2)));
    assert_eq!(status, IbStatus::ResourceBusy);
    let (status, _, _) = create(&w, KERNEL, &s, &qp_create(&s, QpType::Smi, Some(3)));
    assert_eq!(status, IbStatus::InvalidPort);

    // Unsupported for now: user QPs and QPs on an SRQ. Too large: refused.
    let (status, _, _) = create(&w, USER, &s, &qp_create(&s, QpType::Rc, None));
    assert_ne!(status, IbStatus::Success);
    let with_srq = QpCreate {
        srq: Some(SrqHandle::from_raw(0x1_0000_0001)),
        caps: QpCaps {
            max_recv_wr: 0,
            max_recv_sge: 0,
            ..caps()
        },
        ..qp_create(&s, QpType::Rc, None)
    };
    assert_eq!(create(&w, KERNEL, &s, &with_srq).0, IbStatus::Unsupported);
    let deep = QpCreate {
        caps: QpCaps {
            max_send_wr: 1 << 20,
            ..caps()
        },
        ..qp_create(&s, QpType::Rc, None)
    };
    assert_eq!(create(&w, KERNEL, &s, &deep).0, IbStatus::InvalidMaxWrs);
    let stale_cq = QpCreate {
        send_cq: CqHandle::from_raw(s.cq + (1 << 32)),
        ..qp_create(&s, QpType::Rc, None)
    };
    assert_eq!(
        create(&w, KERNEL, &s, &stale_cq).0,
        IbStatus::InvalidCqHandle
    );

    assert_eq!(destroy(&w, gsi), IbStatus::Success);
    assert_eq!(destroy(&w, ud), IbStatus::Success);
    let r = w.call_in_dpc::<DestroyCq>(KERNEL, s.cq, &Empty, 0);
    assert_eq!(response::<DestroyCq>(&r).status, IbStatus::Success);
    let r = w.call_in_dpc::<DeallocPd>(KERNEL, s.pd, &Empty, 0);
    assert_eq!(response::<DeallocPd>(&r).status, IbStatus::Success);
    w.finish();
}
