//! Address handles from completions, called in-process as a C program
//! calls them: the library's machine on the UDP fabric at one of this
//! test process's own loopback addresses, and a peer machine (a second
//! embedded machine in this process, used through the access library) at
//! another. The peer sends a datagram to the library's UD QP; the
//! library's receive completion and the GRH area of its buffer (the
//! packet's IPv4 header, as the device wrote it) give
//! `ibv_init_ah_from_wc` the route back (the peer's GID, the local GID's
//! index, the packet's TTL and TOS), and
//! `ibv_create_ah_from_wc` an AH whose reply reaches the peer. Then every
//! refusal on headers built by hand: multicast and unknown destinations,
//! a header neither IPv4 nor IPv6, an IPv6 next header that is not UDP,
//! a completion without a GRH (no global route: refused by `ibv_create_ah`
//! on the RoCE port), NULL pointers and a PD not ours; and both machines
//! end cleanly.

use std::ffi::{c_int, c_void};
use std::net::Ipv4Addr;
use std::ptr::null_mut;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ib_types::access::AccessFlags;
use ib_types::av::{AvAttr, Grh};
use ib_types::qp::{QpCaps, QpModify, QpState, QpType};
use ib_types::scalars::{Gid, Lid, PortNum, QKey, Qpn};
use ib_types::uvp::UserSend;
use ib_types::wc::WorkCompletion;
use ib_types::wr::{RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest};
use ibal_user::{Av, Buffer, CaSelector, Context, Cq, Mr, Pd, PluginSource, Qp, QpInit};
use ibverbs_abi::{
    IBV_ACCESS_LOCAL_WRITE, IBV_QP_PKEY_INDEX, IBV_QP_PORT, IBV_QP_QKEY, IBV_QP_SQ_PSN,
    IBV_QP_STATE, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPT_UD, IBV_SEND_SIGNALED,
    IBV_WC_GRH, IBV_WC_RECV, IBV_WC_SEND, IBV_WC_SUCCESS, IBV_WR_SEND, IbvAh, IbvAhAttr, IbvQp,
    IbvQpAttr, IbvRecvWr, IbvSendWr, IbvSendWrUd, IbvSendWrWr, IbvSge, IbvWc,
};
use ibverbs_compat::{self as verbs, Machine};
use sim_hca::udp::PortAddress;
use sim_shells::embedded::{EmbeddedMachine, Fabric};

mod support;
use support::*;

const QKEY: u32 = 0x1111_2222;
/// The GRH area a UD receive's buffer starts with.
const GRH: usize = 40;
/// The hop limit (TTL) and traffic class (TOS) the peer sends with (and
/// the headers built by hand carry).
const TTL: u8 = 9;
const TOS: u8 = 0x28;

/// This test process's own loopback address number `slot` (127.x.y.slot,
/// x.y from the pid, as verbs/sim-lib's tests pick theirs, x in 64..128)
/// so concurrent runs never contend for one.
fn own_address(slot: u8) -> Ipv4Addr {
    let pid = std::process::id();
    Ipv4Addr::new(127, 0x40 | (pid >> 8) as u8 & 0x3F, pid as u8, slot)
}

/// The library's machine: on the UDP fabric at this process's address 1.
fn boot_on_udp() -> Result<Arc<dyn Machine>, String> {
    let fabric = Fabric::Udp {
        address: PortAddress::Fixed(own_address(1)),
    };
    let machine = Arc::new(TestMachine(EmbeddedMachine::boot(fabric, 8)?));
    assert!(MACHINE.set(Arc::clone(&machine)).is_ok(), "booted once");
    Ok(machine)
}

/// The peer's one completion on `cq`.
fn peer_poll_one(cq: &Cq<'_>) -> WorkCompletion {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut wc = [WorkCompletion::default(); 1];
    loop {
        if cq.poll(&mut wc).unwrap() == 1 {
            return wc[0];
        }
        assert!(
            Instant::now() < deadline,
            "the peer saw no completion in 20 s"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The library's UD QP to RTS through `ibv_modify_qp`.
fn library_ud_to_rts(qp: *mut IbvQp) {
    let steps = [
        (
            IbvQpAttr {
                qp_state: IBV_QPS_INIT,
                pkey_index: 0,
                port_num: 1,
                qkey: QKEY,
                ..IbvQpAttr::default()
            },
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY,
        ),
        (
            IbvQpAttr {
                qp_state: IBV_QPS_RTR,
                ..IbvQpAttr::default()
            },
            IBV_QP_STATE,
        ),
        (
            IbvQpAttr {
                qp_state: IBV_QPS_RTS,
                sq_psn: 7,
                ..IbvQpAttr::default()
            },
            IBV_QP_STATE | IBV_QP_SQ_PSN,
        ),
    ];
    for (mut attr, mask) in steps {
        // SAFETY: `attr` is valid; the QP is checked.
        let answer = unsafe { verbs::ibv_modify_qp(qp, &mut attr, mask as c_int) };
        assert_eq!(answer, 0);
    }
}

/// A RoCEv2 IPv4 GRH area as the device writes it: 20 zeros, then an
/// IPv4 header from `source` to `destination` with a valid checksum.
fn ipv4_area(source: Ipv4Addr, destination: Ipv4Addr) -> [u8; GRH] {
    let mut area = [0; GRH];
    let header = &mut area[20..];
    header[0] = 0x45;
    header[1] = TOS;
    header[2..4].copy_from_slice(&(20u16 + 8 + 64).to_be_bytes());
    header[8] = TTL;
    header[9] = 17;
    header[12..16].copy_from_slice(&source.octets());
    header[16..20].copy_from_slice(&destination.octets());
    let mut sum: u32 = header
        .chunks_exact(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    header[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    area
}

/// An IPv6 GRH from `sgid` to `dgid` with `next_header`.
fn ipv6_area(sgid: Gid, dgid: Gid, next_header: u8) -> [u8; GRH] {
    let mut area = [0; GRH];
    let version_class_flow: u32 = (6 << 28) | (u32::from(TOS) << 20) | 0x12345;
    area[..4].copy_from_slice(&version_class_flow.to_be_bytes());
    area[6] = next_header;
    area[7] = TTL;
    area[8..24].copy_from_slice(&sgid.octets());
    area[24..].copy_from_slice(&dgid.octets());
    area
}

fn init_from(
    context: *mut ibverbs_abi::IbvContext,
    wc: &IbvWc,
    area: &[u8; GRH],
) -> Result<IbvAhAttr, c_int> {
    let mut wc = *wc;
    let mut area = *area;
    let mut attr = IbvAhAttr::default();
    clear_errno();
    // SAFETY: valid pointers; the context is checked.
    let answer = unsafe {
        verbs::ibv_init_ah_from_wc(context, 1, &mut wc, area.as_mut_ptr().cast(), &mut attr)
    };
    match answer {
        0 => Ok(attr),
        -1 => Err(errno()),
        other => panic!("ibv_init_ah_from_wc answered {other}"),
    }
}

#[test]
fn an_address_handle_from_a_received_datagram_reaches_its_sender_and_bad_headers_are_refused() {
    let (here, there) = (own_address(1), own_address(2));
    let (list, context) = open_the_device(boot_on_udp);
    let machine = MACHINE.get().unwrap();
    let (pd, cq) = pd_and_cq(context, 8);
    let mut init = qp_init_attr(cq, IBV_QPT_UD, 2);
    // SAFETY: `init` is valid; the PD and CQ are checked.
    let qp = unsafe { verbs::ibv_create_qp(pd, &mut init) };
    assert!(!qp.is_null(), "errno {}", errno());
    library_ud_to_rts(qp);
    let buffer = ProgramBuffer::new(1);
    // SAFETY: the program's own page, kept until the region is gone.
    let mr =
        unsafe { verbs::ibv_reg_mr(pd, buffer.ptr.cast(), PAGE, IBV_ACCESS_LOCAL_WRITE as c_int) };
    assert!(!mr.is_null(), "errno {}", errno());
    // SAFETY: a live region of ours.
    let lkey = unsafe { (*mr).lkey };
    let mut recv_sge = IbvSge {
        addr: buffer.ptr as u64,
        length: 1024,
        lkey,
    };
    let mut recv = IbvRecvWr {
        wr_id: 1,
        next: null_mut(),
        sg_list: &mut recv_sge,
        num_sge: 1,
    };
    // SAFETY: the open context.
    let post_recv = unsafe { (*context).ops.post_recv }.unwrap();
    let mut bad = null_mut();
    // SAFETY: a valid list and out-pointer.
    assert_eq!(unsafe { post_recv(qp, &mut recv, &mut bad) }, 0);
    // SAFETY: a live QP of ours.
    let library_qpn = unsafe { (*qp).qp_num };

    // The peer: a second machine in this process at `there`.
    let peer_machine = EmbeddedMachine::boot(
        Fabric::Udp {
            address: PortAddress::Fixed(there),
        },
        9,
    )
    .unwrap();
    let payload: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(7)).collect();
    let peer_io = peer_machine.io();
    {
        let peer = Context::open(&peer_io, CaSelector::Index(0), &PluginSource::Linked).unwrap();
        let ppd = Pd::new(&peer).unwrap();
        let pbuf = Buffer::new(&peer, PAGE).unwrap();
        let pmr = Mr::new(&ppd, &pbuf, AccessFlags::LOCAL_WRITE).unwrap();
        let pcq = Cq::new(&peer, 8).unwrap();
        let caps = QpCaps {
            max_send_wr: 2,
            max_recv_wr: 2,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let mut pqp = Qp::new(&ppd, &pcq, &pcq, &QpInit::new(QpType::Ud, caps, false)).unwrap();
        for step in [
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
                sq_psn: Some(ib_types::scalars::Psn::new(3).unwrap()),
                ..QpModify::default()
            },
        ] {
            pqp.modify(&step).unwrap();
        }
        let reply_sge = [Sge::new(pbuf.va() + 2048, 1024, pmr.keys().lkey)];
        assert_eq!(
            pqp.post_recv(&[RecvWr {
                wr_id: 50,
                sg_list: &reply_sge,
            }])
            .unwrap(),
            1
        );
        let to_library = Av::new(
            &ppd,
            &AvAttr {
                port: PortNum::new(1).unwrap(),
                sl: 0,
                dlid: Lid::new(0),
                path_bits: 0,
                static_rate: 0,
                grh: Some(Grh {
                    dgid: Gid::from_ipv4(here.octets()),
                    flow_label: 0,
                    hop_limit: TTL,
                    traffic_class: TOS,
                    sgid_index: 0,
                }),
            },
        )
        .unwrap();
        pbuf.write(0, &payload).unwrap();
        let send_sge = [Sge::new(pbuf.va(), payload.len() as u32, pmr.keys().lkey)];
        let datagram = UserSend {
            wr: SendWr {
                wr_id: 40,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list: &send_sge,
                ud: Some(UdDest {
                    av: to_library.handle(),
                    remote_qpn: Qpn::new(library_qpn).unwrap(),
                    remote_qkey: QKey::new(QKEY),
                }),
            },
            inline: None,
        };
        assert_eq!(pqp.post_send(&[datagram]).unwrap(), 1);
        assert_eq!(peer_poll_one(&pcq).wr_id, 40, "the datagram left");

        // The library receives it, the GRH area first.
        let wc = poll_one(context, cq);
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (1, IBV_WC_SUCCESS, IBV_WC_RECV)
        );
        assert_ne!(wc.wc_flags & IBV_WC_GRH, 0, "a UD receive has a GRH");
        assert_eq!(wc.src_qp, pqp.qpn());
        assert_eq!(buffer.load(GRH, payload.len()), payload);
        let area: [u8; GRH] = buffer.load(0, GRH).try_into().unwrap();
        let attr = init_from(context, &wc, &area).unwrap();
        assert_eq!(
            (attr.is_global, attr.port_num, attr.dlid, attr.sl),
            (1, 1, 0, 0)
        );
        assert_eq!(
            attr.grh.dgid.raw,
            Gid::from_ipv4(there.octets()).octets(),
            "the route goes back to the sender's GID"
        );
        // On the UDP fabric the received TTL and TOS are the rebuilt
        // frame's, 64 and 0 (a socket does not see the sender's: PRM
        // 10.1.1); the headers built by hand below carry others.
        let route = &attr.grh;
        assert_eq!(
            (route.sgid_index, route.hop_limit, route.traffic_class),
            (0, 64, 0),
            "our GID 0; the packet's TTL and TOS"
        );

        // The reply through an AH made from the completion reaches the peer.
        let mut wc_copy = wc;
        let mut area_copy = area;
        // SAFETY: valid pointers; the PD is checked.
        let ah: *mut IbvAh = unsafe {
            verbs::ibv_create_ah_from_wc(pd, &mut wc_copy, area_copy.as_mut_ptr().cast(), 1)
        };
        assert!(!ah.is_null(), "errno {}", errno());
        // SAFETY: a live AH of ours.
        let raw_ah = unsafe { &*ah };
        assert_eq!((raw_ah.context, raw_ah.pd), (context, pd));
        let reply = b"the route back works";
        buffer.store(2048, reply);
        let mut send_sge = IbvSge {
            addr: buffer.ptr as u64 + 2048,
            length: reply.len() as u32,
            lkey,
        };
        // SAFETY: every field of `ibv_send_wr` is plain data or a raw
        // pointer, for which all zeros is valid (NULL), as C programs
        // `memset` it.
        let mut send: IbvSendWr = unsafe { std::mem::zeroed() };
        send.wr_id = 2;
        send.sg_list = &mut send_sge;
        send.num_sge = 1;
        send.opcode = IBV_WR_SEND;
        send.send_flags = IBV_SEND_SIGNALED;
        send.wr = IbvSendWrWr {
            ud: IbvSendWrUd {
                ah,
                remote_qpn: pqp.qpn(),
                remote_qkey: QKEY,
            },
        };
        // SAFETY: the open context.
        let post_send = unsafe { (*context).ops.post_send }.unwrap();
        let mut bad_send = null_mut();
        // SAFETY: a valid list and out-pointer.
        assert_eq!(unsafe { post_send(qp, &mut send, &mut bad_send) }, 0);
        let sent = poll_one(context, cq);
        assert_eq!(
            (sent.wr_id, sent.status, sent.opcode),
            (2, IBV_WC_SUCCESS, IBV_WC_SEND)
        );
        let got = peer_poll_one(&pcq);
        assert_eq!(got.wr_id, 50);
        assert_eq!(got.byte_len as usize, GRH + reply.len());
        let mut echoed = vec![0; reply.len()];
        pbuf.read(2048 + GRH, &mut echoed).unwrap();
        assert_eq!(echoed, reply, "the reply reached the sender");
        // SAFETY: checked against the live handles.
        assert_eq!(unsafe { verbs::ibv_destroy_ah(ah) }, 0);

        // Refusals on headers built by hand.
        let ours = Gid::from_ipv4(here.octets());
        let peer_gid = Gid::from_ipv4(there.octets());
        let by_hand = init_from(context, &wc, &ipv4_area(there, here)).unwrap();
        assert_eq!(
            (
                by_hand.grh.dgid.raw,
                by_hand.grh.hop_limit,
                by_hand.grh.traffic_class
            ),
            (peer_gid.octets(), TTL, TOS),
            "a header built by hand reads as the device's, its TTL and TOS too"
        );
        assert_eq!(
            init_from(context, &wc, &ipv4_area(there, Ipv4Addr::new(239, 1, 2, 3))),
            Err(libc::EINVAL),
            "a multicast destination"
        );
        assert_eq!(
            init_from(context, &wc, &ipv4_area(there, Ipv4Addr::new(10, 9, 8, 7))),
            Err(libc::EINVAL),
            "a destination the port does not have"
        );
        let v6 = init_from(context, &wc, &ipv6_area(peer_gid, ours, 17)).unwrap();
        assert_eq!(
            (v6.grh.dgid.raw, v6.grh.sgid_index, v6.grh.hop_limit),
            (peer_gid.octets(), 0, TTL)
        );
        assert_eq!((v6.grh.traffic_class, v6.grh.flow_label), (TOS, 0x12345));
        assert_eq!(
            init_from(context, &wc, &ipv6_area(peer_gid, ours, 6)),
            Err(libc::EPROTONOSUPPORT),
            "an IPv6 next header neither UDP nor a BTH"
        );
        assert_eq!(
            init_from(context, &wc, &ipv6_area(peer_gid, ours, 0x1B)),
            Err(libc::EINVAL),
            "the RoCE port has no RoCEv1/IB GID"
        );
        let mut multicast = [0xFF; 16];
        multicast[1] = 0x0E;
        assert_eq!(
            init_from(
                context,
                &wc,
                &ipv6_area(peer_gid, Gid::from_octets(multicast), 17)
            ),
            Err(libc::EINVAL)
        );
        assert_eq!(
            init_from(context, &wc, &[0x11; GRH]),
            Err(libc::EPROTONOSUPPORT),
            "neither IPv4 nor IPv6"
        );
        // No GRH: no global route, which the RoCE port's AHs need.
        let local = IbvWc { wc_flags: 0, ..wc };
        let plain = init_from(context, &local, &area).unwrap();
        assert_eq!((plain.is_global, plain.port_num), (0, 1));
        let (mut local_copy, mut area_copy) = (local, area);
        // SAFETY: valid pointers; the PD is checked.
        let no_route = unsafe {
            verbs::ibv_create_ah_from_wc(pd, &mut local_copy, area_copy.as_mut_ptr().cast(), 1)
        };
        assert!(no_route.is_null());
        assert_eq!(errno(), libc::EINVAL);
        // NULL pointers, a PD or context not ours.
        let (mut wc_copy, mut area_copy) = (wc, area);
        let grh_ptr: *mut c_void = area_copy.as_mut_ptr().cast();
        let mut out = IbvAhAttr::default();
        let wc_ptr: *mut IbvWc = &mut wc_copy;
        let out_ptr: *mut IbvAhAttr = &mut out;
        let refused = |context, port, wc, grh, out| {
            clear_errno();
            // SAFETY: each pointer is NULL or valid; NULL ones and the
            // context are checked.
            let answer = unsafe { verbs::ibv_init_ah_from_wc(context, port, wc, grh, out) };
            (answer, errno())
        };
        let no = (-1, libc::EINVAL);
        assert_eq!(refused(context, 1, null_mut(), grh_ptr, out_ptr), no);
        assert_eq!(refused(context, 1, wc_ptr, null_mut(), out_ptr), no);
        assert_eq!(refused(context, 1, wc_ptr, grh_ptr, null_mut()), no);
        assert_eq!(
            refused(cq.cast(), 1, wc_ptr, grh_ptr, out_ptr),
            no,
            "not ours"
        );
        assert_eq!(refused(context, 2, wc_ptr, grh_ptr, out_ptr), no, "port 2");
        clear_errno();
        // SAFETY: the PD pointer is checked.
        let foreign = unsafe { verbs::ibv_create_ah_from_wc(cq.cast(), wc_ptr, grh_ptr, 1) };
        assert!(foreign.is_null());
        assert_eq!(errno(), libc::EINVAL);
    }
    let peer_report = peer_machine.shut_down(Duration::from_secs(10));
    assert_eq!(
        peer_report.problems,
        Vec::<String>::new(),
        "the peer ended cleanly"
    );

    // SAFETY: checked against the live objects.
    assert_eq!(unsafe { verbs::ibv_destroy_qp(qp) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_dereg_mr(mr) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_destroy_cq(cq) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { verbs::ibv_dealloc_pd(pd) }, 0);
    close_the_device(context, list);
    drop(buffer);
    shut_down_cleanly(machine);
}
