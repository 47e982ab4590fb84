//! Multicast attach/detach and local MAD processing on the simulated host:
//! two HCAs on one fabric, every verb issued from a DPC (DISPATCH_LEVEL),
//! a UD datagram to a group checked byte for byte at every attached QP
//! and at none other, memberships dropped with their QP, and the device's
//! agents answering NodeInfo with its GUID. Each test ends with the host
//! shut down and the verifier clean.

mod support;

use driver_platform::RequestorMode;
use hca_miniport_core::verbs::qp::SendRequest;
use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::handle::AvHandle;
use ib_types::ioctl::{
    AttachMcast, CreateQp, DestroyQp, DetachMcast, Empty, LocalMad, LocalMadIn, MAD_SIZE, ModifyQp,
};
use ib_types::mcast::McastGroup;
use ib_types::qp::{QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, PortNum, Psn, QKey, Qpn};
use ib_types::status::IbStatus;
use ib_types::wc::WcStatus;
use ib_types::wr::{RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest};
use support::kernel_pair::{KernelBuf, Setup, poll_all, setup, teardown};
use support::{World, response};

const KERNEL: RequestorMode = RequestorMode::Kernel;

const HCA_IPS: [[[u8; 4]; 2]; 2] = [
    [[10, 0, 0, 1], [10, 0, 1, 1]],
    [[10, 0, 2, 1], [10, 0, 3, 1]],
];
const GUIDS: [u64; 2] = [0x0002_C900_0000_4000, 0x0002_C900_0000_5000];
const QKEY: u32 = 0x2222;
/// The wire QPN addressing every member of a group (IBA 10.5).
const MULTICAST_QPN: u32 = 0xFF_FFFF;

fn two_hcas(seed: u64) -> (World, [usize; 2]) {
    support::kernel_pair::two_two_port_hcas(seed, GUIDS, &HCA_IPS)
}

/// Kernel memory registered with RegMr for local access.
type Buf = KernelBuf;

impl Buf {
    fn new(w: &World, s: &Setup, len: usize) -> Self {
        KernelBuf::register(w, s, *b"McT ", len, AccessFlags::LOCAL_WRITE)
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

fn leak_sges(sges: Vec<Sge>) -> &'static [Sge] {
    Box::leak(sges.into_boxed_slice())
}

fn create_qp(w: &World, s: &Setup, qp_type: QpType) -> (u64, u32) {
    let input = support::small_qp_create(qp_type, s.pd, s.cq);
    let r = w.call_in_dpc_at::<CreateQp>(s.i, KERNEL, s.ca, &input, 0);
    let resp = response::<CreateQp>(&r);
    assert_eq!(resp.status, IbStatus::Success);
    (resp.handle, resp.output.unwrap().qpn.get())
}

/// A UD QP on port 1 in RTS with Q_Key [`QKEY`].
fn ud_qp(w: &World, s: &Setup) -> (u64, u32) {
    let (qp, qpn) = create_qp(w, s, QpType::Ud);
    let steps = [
        QpModify {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(PortNum::new(1).unwrap()),
            qkey: Some(QKey::new(QKEY)),
            ..QpModify::default()
        },
        QpModify::to_state(QpState::Rtr),
        QpModify {
            state: Some(QpState::Rts),
            sq_psn: Some(Psn::new(1).unwrap()),
            ..QpModify::default()
        },
    ];
    for m in steps {
        let r = w.call_in_dpc_at::<ModifyQp>(s.i, KERNEL, qp, &m, 0);
        assert_eq!(response::<ModifyQp>(&r).status, IbStatus::Success);
    }
    (qp, qpn)
}

fn destroy_qp(w: &World, i: usize, qp: u64) -> IbStatus {
    let r = w.call_in_dpc_at::<DestroyQp>(i, KERNEL, qp, &Empty, 0);
    response::<DestroyQp>(&r).status
}

fn attach(w: &World, i: usize, qp: u64, group: &McastGroup) -> (IbStatus, u64) {
    let r = w.call_in_dpc_at::<AttachMcast>(i, KERNEL, qp, group, 0);
    let resp = response::<AttachMcast>(&r);
    (resp.status, resp.handle)
}

fn detach(w: &World, i: usize, membership: u64) -> IbStatus {
    let r = w.call_in_dpc_at::<DetachMcast>(i, KERNEL, membership, &Empty, 0);
    response::<DetachMcast>(&r).status
}

fn group(ip: [u8; 4]) -> McastGroup {
    McastGroup {
        mgid: Gid::from_ipv4(ip),
        mlid: Lid::UNASSIGNED,
    }
}

fn post_recv(w: &World, i: usize, qp: u64, wr_id: u64, sge: Sge) {
    let out = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (hca, sink) = (w.hca_at(i), out.clone());
    let sges = leak_sges(vec![sge]);
    w.in_dpc(move || {
        let wrs = [RecvWr {
            wr_id,
            sg_list: sges,
        }];
        *support::lock(&sink) = Some(hca.post_recv(qp, &wrs));
    });
    w.settle();
    assert_eq!(support::lock(&out).take(), Some((1, IbStatus::Success)));
}

/// Sends `len` bytes of `buf` from UD QP `qp` of HCA `i` to the group
/// `ip` and returns the sender's completion status.
fn send_to_group(w: &World, s: &Setup, qp: u64, buf: &Buf, len: u32, ip: [u8; 4]) -> WcStatus {
    let attr = AvAttr {
        port: PortNum::new(1).unwrap(),
        sl: 0,
        dlid: Lid::default(),
        path_bits: 0,
        static_rate: 0,
        grh: Some(Grh {
            dgid: Gid::from_ipv4(ip),
            flow_label: 0,
            hop_limit: 8,
            traffic_class: 0,
            sgid_index: 0,
        }),
    };
    let av = hca_prm::av::Av::try_from(&attr).unwrap();
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: leak_sges(vec![buf.sge(0, len)]),
        ud: Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(MULTICAST_QPN).unwrap(),
            remote_qkey: QKey::new(QKEY),
        }),
    };
    let out = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (hca, sink) = (w.hca_at(s.i), out.clone());
    w.in_dpc(move || {
        let request = SendRequest {
            wr,
            av: Some(av),
            inline: None,
        };
        *support::lock(&sink) = Some(hca.post_send(qp, &[request]));
    });
    w.settle();
    assert_eq!(support::lock(&out).take(), Some((1, IbStatus::Success)));
    let wcs = poll_all(w, s.i, s.cq);
    assert_eq!(wcs.len(), 1, "{wcs:?}");
    wcs[0].status
}

/// Bytes of the GRH (for RoCEv2: 20 zero bytes and the IPv4 header) that
/// precede a UD receive's payload (PRM 10.4).
const GRH: usize = 40;

#[test]
fn a_datagram_to_a_group_reaches_every_attached_qp_and_no_other() {
    let (w, [x, y]) = two_hcas(81);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let out = Buf::new(&w, &sx, 4096);
    let inbox = Buf::new(&w, &sy, 4 * 4096);
    let (sender, _) = ud_qp(&w, &sx);
    let receivers: Vec<(u64, u32)> = (0..3).map(|_| ud_qp(&w, &sy)).collect();
    let g = group([239, 1, 2, 3]);

    // r0 and r1 stay in the group; r2 joins and leaves.
    let mut memberships = Vec::new();
    for (qp, _) in &receivers {
        let (status, membership) = attach(&w, y, *qp, &g);
        assert_eq!(status, IbStatus::Success);
        memberships.push(membership);
    }
    assert_eq!(detach(&w, y, memberships[2]), IbStatus::Success);
    assert_eq!(detach(&w, y, memberships[2]), IbStatus::InvalidMcastHandle);
    for (k, (qp, _)) in receivers.iter().enumerate() {
        post_recv(&w, y, *qp, 100 + k as u64, inbox.sge(k * 4096, 4096));
    }

    let datagram = pattern(11, 1500);
    out.write(0, &datagram);
    assert_eq!(
        send_to_group(&w, &sx, sender, &out, 1500, [239, 1, 2, 3]),
        WcStatus::Success
    );
    let mut got = poll_all(&w, y, sy.cq);
    got.sort_by_key(|wc| wc.wr_id);
    let seen: Vec<(u64, WcStatus, u32)> = got
        .iter()
        .map(|wc| (wc.wr_id, wc.status, wc.byte_len))
        .collect();
    assert_eq!(
        seen,
        vec![
            (100, WcStatus::Success, (GRH + 1500) as u32),
            (101, WcStatus::Success, (GRH + 1500) as u32),
        ],
        "the detached QP got nothing"
    );
    for (k, (_, qpn)) in receivers.iter().take(2).enumerate() {
        assert_eq!(got[k].qp_num.get(), *qpn);
        assert_eq!(inbox.read(k * 4096 + GRH, 1500), datagram);
    }
    assert_eq!(inbox.read(2 * 4096 + GRH, 1500), vec![0; 1500]);

    // A group nobody joined: the send completes, nobody receives.
    assert_eq!(
        send_to_group(&w, &sx, sender, &out, 64, [239, 9, 9, 9]),
        WcStatus::Success
    );
    assert!(poll_all(&w, y, sy.cq).is_empty());

    // Destroying the members drops their memberships: the handles are
    // stale. r2's receive, never consumed, is flushed.
    for (k, (qp, _)) in receivers.iter().enumerate() {
        assert_eq!(destroy_qp(&w, y, *qp), IbStatus::Success);
        assert_eq!(detach(&w, y, memberships[k]), IbStatus::InvalidMcastHandle);
    }
    let flushed = poll_all(&w, y, sy.cq);
    assert_eq!(
        flushed
            .iter()
            .map(|wc| (wc.wr_id, wc.status))
            .collect::<Vec<_>>(),
        vec![(102, WcStatus::WrFlushErr)]
    );
    assert_eq!(destroy_qp(&w, x, sender), IbStatus::Success);
    let _ = poll_all(&w, x, sx.cq);
    out.free(&w, x);
    inbox.free(&w, y);
    teardown(&w, &sx);
    teardown(&w, &sy);
    w.finish();
}

#[test]
fn destroying_a_qp_leaves_its_groups_and_others_keep_receiving() {
    let (w, [x, y]) = two_hcas(82);
    let (sx, sy) = (setup(&w, x), setup(&w, y));
    let out = Buf::new(&w, &sx, 4096);
    let inbox = Buf::new(&w, &sy, 2 * 4096);
    let (sender, _) = ud_qp(&w, &sx);
    let (leaver, _) = ud_qp(&w, &sy);
    let (stayer, _) = ud_qp(&w, &sy);
    let (g1, g2) = (group([239, 0, 0, 1]), group([239, 0, 0, 2]));
    let (_, l1) = attach(&w, y, leaver, &g1);
    let (_, l2) = attach(&w, y, leaver, &g2);
    let (status, s1) = attach(&w, y, stayer, &g1);
    assert_eq!(status, IbStatus::Success);
    // The same QP twice in a group: the device's "already attached".
    assert_eq!(attach(&w, y, stayer, &g1).0, IbStatus::InvalidState);

    // The device listens on both groups' Ethernet addresses (PRM 10.1:
    // 01:00:5e and the group's low 23 bits).
    let group_macs = || {
        let mut macs = w.function_at(y).with_device(|d| d.multicast_macs(1));
        macs.sort_unstable();
        macs
    };
    let (mac1, mac2) = ([1, 0, 0x5e, 0, 0, 1], [1, 0, 0x5e, 0, 0, 2]);
    assert_eq!(group_macs(), vec![mac1, mac2]);

    // The leaver, in two groups, is destroyed: both memberships go, on the
    // device too (only the stayer's group is left).
    assert_eq!(destroy_qp(&w, y, leaver), IbStatus::Success);
    assert_eq!(group_macs(), vec![mac1]);
    for membership in [l1, l2] {
        assert_eq!(detach(&w, y, membership), IbStatus::InvalidMcastHandle);
    }
    // The stayer still receives from group 1.
    post_recv(&w, y, stayer, 7, inbox.sge(0, 4096));
    let datagram = pattern(99, 700);
    out.write(0, &datagram);
    assert_eq!(
        send_to_group(&w, &sx, sender, &out, 700, [239, 0, 0, 1]),
        WcStatus::Success
    );
    let got = poll_all(&w, y, sy.cq);
    assert_eq!(
        got.iter()
            .map(|wc| (wc.wr_id, wc.status, wc.byte_len))
            .collect::<Vec<_>>(),
        vec![(7, WcStatus::Success, (GRH + 700) as u32)]
    );
    assert_eq!(inbox.read(GRH, 700), datagram);

    // Bad inputs: an RC QP cannot join (only UD), a stale QP, a
    // membership handle of the wrong kind, a GID that is no group
    // (refused when decoded).
    let (rc, _) = create_qp(&w, &sy, QpType::Rc);
    assert_eq!(attach(&w, y, rc, &g1).0, IbStatus::InvalidServiceType);
    assert_eq!(attach(&w, y, leaver, &g1).0, IbStatus::InvalidQpHandle);
    assert_eq!(detach(&w, y, stayer), IbStatus::InvalidMcastHandle);
    let (request, issuer) = w.patched_request::<AttachMcast>(KERNEL, stayer, &g2, |b| {
        b[..16].copy_from_slice(&Gid::from_ipv4([10, 0, 0, 7]).octets());
    });
    let r = w.submit_in_dpc_at(y, request, issuer);
    assert_eq!(
        response::<AttachMcast>(&r).status,
        IbStatus::InvalidParameter
    );

    assert_eq!(detach(&w, y, s1), IbStatus::Success);
    assert!(group_macs().is_empty());

    // A destroy issued while an attach of the QP is in flight (both from
    // one DPC): busy, and the attach completes.
    let (attach_req, attach_issuer) = w.request::<AttachMcast>(KERNEL, stayer, &g2, 0);
    let (destroy_req, destroy_issuer) = w.request::<DestroyQp>(KERNEL, stayer, &Empty, 0);
    let hca = w.hca_at(y);
    w.in_dpc(move || {
        hca.submit_request(attach_req);
        hca.submit_request(destroy_req);
    });
    w.settle();
    let destroyed = destroy_issuer.completion().unwrap();
    assert_eq!(
        response::<DestroyQp>(&destroyed).status,
        IbStatus::ResourceBusy
    );
    let attached = attach_issuer.completion().unwrap();
    assert_eq!(response::<AttachMcast>(&attached).status, IbStatus::Success);
    assert_eq!(group_macs(), vec![mac2]);
    // Now settled, the destroy detaches the stayer from group 2.
    for qp in [rc, stayer] {
        assert_eq!(destroy_qp(&w, y, qp), IbStatus::Success);
    }
    assert!(group_macs().is_empty());
    assert_eq!(destroy_qp(&w, x, sender), IbStatus::Success);
    let _ = poll_all(&w, x, sx.cq);
    let _ = poll_all(&w, y, sy.cq);
    out.free(&w, x);
    inbox.free(&w, y);
    teardown(&w, &sx);
    teardown(&w, &sy);
    w.finish();
}

/// Offsets in a MAD (IBA 13.4.2) and an SMP (IBA 14.2.1.1).
const METHOD: usize = 3;
const STATUS: usize = 4;
const ATTR_ID: usize = 16;
const SMP_DATA: usize = 64;

/// A LID-routed SubnGet of attribute `attr`.
fn subn_get(attr: u16) -> [u8; MAD_SIZE] {
    let mut mad = [0u8; MAD_SIZE];
    mad[0] = 1; // base version
    mad[1] = 0x01; // class: subnet management, LID routed
    mad[2] = 1; // class version
    mad[METHOD] = 0x01; // Get
    mad[8..16].copy_from_slice(&0x1234_5678_9ABC_DEF0u64.to_be_bytes()); // TID
    mad[ATTR_ID..ATTR_ID + 2].copy_from_slice(&attr.to_be_bytes());
    mad
}

fn local_mad(w: &World, i: usize, ca: u64, port: u8, mad: [u8; MAD_SIZE]) -> (IbStatus, Vec<u8>) {
    let input = LocalMadIn {
        port: PortNum::new(port).unwrap(),
        mad,
    };
    let r = w.call_in_dpc_at::<LocalMad>(i, KERNEL, ca, &input, 0);
    let resp = response::<LocalMad>(&r);
    (
        resp.status,
        resp.output.map(|o| o.mad.to_vec()).unwrap_or_default(),
    )
}

fn mad_status(reply: &[u8]) -> u16 {
    u16::from_be_bytes([reply[STATUS], reply[STATUS + 1]])
}

#[test]
fn local_mads_are_answered_by_the_devices_agents() {
    let (w, [x, y]) = two_hcas(83);
    for (i, guid) in [(x, GUIDS[0]), (y, GUIDS[1])] {
        let s = setup(&w, i);
        // NodeInfo: a GetResp with the device's node GUID and the port's
        // GUID, the transaction ID echoed.
        for port in [1u8, 2] {
            let (status, reply) = local_mad(&w, i, s.ca, port, subn_get(0x0011));
            assert_eq!(status, IbStatus::Success);
            assert_eq!(reply[METHOD], 0x81, "GetResp");
            assert_eq!(mad_status(&reply), 0);
            assert_eq!(&reply[8..16], &0x1234_5678_9ABC_DEF0u64.to_be_bytes());
            let data = &reply[SMP_DATA..];
            assert_eq!(data[2], 1, "node type: channel adapter");
            assert_eq!(data[3], 2, "ports");
            assert_eq!(&data[12..20], &guid.to_be_bytes(), "node GUID");
            assert_eq!(
                &data[20..28],
                &(guid + u64::from(port)).to_be_bytes(),
                "port GUID"
            );
            assert_eq!(data[36], port, "local port number");
        }
        // NodeDescription.
        let (status, reply) = local_mad(&w, i, s.ca, 1, subn_get(0x0010));
        assert_eq!((status, mad_status(&reply)), (IbStatus::Success, 0));
        assert!(reply[SMP_DATA..].starts_with(b"simulated RoCE HCA"));
        // Anything else: answered, with the agents' "unsupported
        // method/attribute" status (IBA 13.4.7); a bad base version gets
        // "bad version".
        let (status, reply) = local_mad(&w, i, s.ca, 1, subn_get(0x0015));
        assert_eq!((status, mad_status(&reply)), (IbStatus::Success, 0x000C));
        let mut set = subn_get(0x0011);
        set[METHOD] = 0x02;
        let (status, reply) = local_mad(&w, i, s.ca, 1, set);
        assert_eq!((status, mad_status(&reply)), (IbStatus::Success, 0x000C));
        let mut old = subn_get(0x0011);
        old[0] = 2;
        let (status, reply) = local_mad(&w, i, s.ca, 1, old);
        assert_eq!((status, mad_status(&reply)), (IbStatus::Success, 0x0004));

        // Verb-level refusals: a port the device does not have, a stale CA
        // handle, a user-mode requestor (kernel-only verb).
        assert_eq!(
            local_mad(&w, i, s.ca, 3, subn_get(0x0011)).0,
            IbStatus::InvalidPort
        );
        assert_eq!(
            local_mad(&w, i, s.ca ^ (1 << 40), 1, subn_get(0x0011)).0,
            IbStatus::InvalidCaHandle
        );
        let input = LocalMadIn {
            port: PortNum::new(1).unwrap(),
            mad: subn_get(0x0011),
        };
        let r = w.call_in_dpc_at::<LocalMad>(i, RequestorMode::User, s.ca, &input, 0);
        assert_eq!(response::<LocalMad>(&r).status, IbStatus::InvalidPermission);
        teardown(&w, &s);
    }
    w.finish();
}
