//! End-to-end transport tests: two simulated HCAs driven through the PRM by
//! the test driver, data checked byte for byte.

mod common;

use common::*;
use hca_prm::av::Av;
use hca_prm::cmd::{CmdStatus, Opcode};
use hca_prm::cqe::{CqeFlags, RecvOp};
use hca_prm::wqe::WqeOpcode;
use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::handle::AvHandle;
use ib_types::qp::QpType;
use ib_types::scalars::{Gid, Mtu, PortNum, QKey, Qpn};
use ib_types::wc::WcStatus;
use ib_types::wr::{RemoteAddr, SendFlags, SendOp, SendWr, UdDest};

fn send_wr(wr_id: u64, op: SendOp, sg: &[ib_types::wr::Sge]) -> SendWr<'_> {
    SendWr {
        wr_id,
        op,
        flags: SendFlags::SIGNALED,
        sg_list: sg,
        ud: None,
    }
}

#[test]
fn ud_send_receive_with_grh_and_immediate() {
    let mut p = Pair::new();
    let mut a = endpoint(&mut p.a, QpType::Ud, AccessFlags::empty());
    let mut b = endpoint(&mut p.b, QpType::Ud, AccessFlags::empty());
    for (node, ep) in [(&mut p.a, &a), (&mut p.b, &b)] {
        let q = ep.qp.qp_type;
        assert_eq!(
            node.drv.modify_qp(
                &mut node.dev,
                &ep.qp,
                &bring_up::to_init(q, AccessFlags::empty(), 0x1111)
            ),
            CmdStatus::Ok
        );
        assert_eq!(
            node.drv.modify_qp(
                &mut node.dev,
                &ep.qp,
                &bring_up::to_rtr(q, [0; 4], 0, 0, Mtu::Mtu1024)
            ),
            CmdStatus::Ok
        );
        assert_eq!(
            node.drv
                .modify_qp(&mut node.dev, &ep.qp, &bring_up::to_rts(q, 0, 0, 0, 0)),
            CmdStatus::Ok
        );
    }
    // B posts a receive of 40 (GRH) + 100 bytes.
    let sge = sim_hca::testkit::Driver::sge(&b.mr, 0, 140);
    p.b.drv.post_recv(&mut b.qp, 77, &[sge]);
    // A sends 100 bytes with immediate data.
    let payload: Vec<u8> = (0..100u8).collect();
    p.a.drv.write_mr(&a.mr, 0, &payload);
    let av = Av::try_from(&AvAttr::roce(PortNum::FIRST, Gid::from_ipv4(IP_B), 0)).unwrap();
    let sg = [sim_hca::testkit::Driver::sge(&a.mr, 0, 100)];
    let wr = SendWr {
        wr_id: 5,
        op: SendOp::SendWithImm {
            imm: ib_types::abi::Be32::new(0xCAFE_F00D),
        },
        flags: SendFlags::SIGNALED | SendFlags::SOLICITED,
        sg_list: &sg,
        ud: Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(b.qp.qpn).unwrap(),
            remote_qkey: QKey::new(0x1111),
        }),
    };
    p.a.drv
        .post_send(&mut p.a.dev, &mut a.qp, &wr, Some(&av), None, true)
        .unwrap();
    p.pump();
    let sent = p.a.drv.drain_cq(&mut a.cq);
    assert_eq!(
        summary(&sent),
        vec![(WqeOpcode::SendImm.code(), WcStatus::Success.code(), 0)]
    );
    let got = p.b.drv.drain_cq(&mut b.cq);
    assert_eq!(got.len(), 1, "one receive completion");
    let c = &got[0];
    assert_eq!(c.status, WcStatus::Success.code());
    assert_eq!(c.byte_count.get(), 140);
    assert!(
        c.flags()
            .contains(CqeFlags::RECV | CqeFlags::IMM | CqeFlags::GRH | CqeFlags::SOLICITED)
    );
    assert_eq!(c.imm, 0xCAFE_F00Du32.to_be_bytes());
    assert_eq!(c.src_qp.get(), a.qp.qpn);
    let data = p.b.drv.read_mr(&b.mr, 0, 140);
    assert_eq!(&data[40..], &payload[..]);
    // The GRH holds the IPv4 header: version/IHL 0x45, source 10.0.0.1.
    assert_eq!(data[20], 0x45);
    assert_eq!(&data[32..36], &IP_A);
    let _ = RecvOp::Send;
}

#[test]
fn ud_qkey_mismatch_is_dropped_and_counted() {
    let mut p = Pair::new();
    let mut a = endpoint(&mut p.a, QpType::Ud, AccessFlags::empty());
    let mut b = endpoint(&mut p.b, QpType::Ud, AccessFlags::empty());
    for (node, ep, qkey) in [(&mut p.a, &a, 0x1111), (&mut p.b, &b, 0x2222)] {
        let q = ep.qp.qp_type;
        node.drv.modify_qp(
            &mut node.dev,
            &ep.qp,
            &bring_up::to_init(q, AccessFlags::empty(), qkey),
        );
        node.drv.modify_qp(
            &mut node.dev,
            &ep.qp,
            &bring_up::to_rtr(q, [0; 4], 0, 0, Mtu::Mtu1024),
        );
        node.drv
            .modify_qp(&mut node.dev, &ep.qp, &bring_up::to_rts(q, 0, 0, 0, 0));
    }
    p.b.drv.post_recv(
        &mut b.qp,
        1,
        &[sim_hca::testkit::Driver::sge(&b.mr, 0, 256)],
    );
    let av = Av::try_from(&AvAttr::roce(PortNum::FIRST, Gid::from_ipv4(IP_B), 0)).unwrap();
    let sg = [sim_hca::testkit::Driver::sge(&a.mr, 0, 8)];
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        flags: SendFlags::SIGNALED,
        sg_list: &sg,
        ud: Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(b.qp.qpn).unwrap(),
            remote_qkey: QKey::new(0x1111),
        }),
    };
    p.a.drv
        .post_send(&mut p.a.dev, &mut a.qp, &wr, Some(&av), None, true)
        .unwrap();
    p.pump();
    assert_eq!(
        p.a.drv.drain_cq(&mut a.cq).len(),
        1,
        "the sender completes (UD is unreliable)"
    );
    assert!(
        p.b.drv.drain_cq(&mut b.cq).is_empty(),
        "no receive completion"
    );
    assert_eq!(p.b.dev.port_counters(1).unwrap().rx_discards, 1);
}

fn rc_pair(mtu: Mtu) -> (Pair, Endpoint, Endpoint) {
    let mut p = Pair::new();
    let a = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let b = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    connect(&mut p, &a, &b, QpType::Rc, mtu, Retries::PATIENT);
    (p, a, b)
}

#[test]
fn rc_multi_packet_send_arrives_intact() {
    let (mut p, mut a, mut b) = rc_pair(Mtu::Mtu1024);
    let payload: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
    p.a.drv.write_mr(&a.mr, 0, &payload);
    p.b.drv.post_recv(
        &mut b.qp,
        9,
        &[sim_hca::testkit::Driver::sge(&b.mr, 100, 6000)],
    );
    let sg = [sim_hca::testkit::Driver::sge(&a.mr, 0, 5000)];
    p.a.drv
        .post_send(
            &mut p.a.dev,
            &mut a.qp,
            &send_wr(3, SendOp::Send, &sg),
            None,
            None,
            true,
        )
        .unwrap();
    p.pump();
    let sent = p.a.drv.drain_cq(&mut a.cq);
    assert_eq!(
        summary(&sent),
        vec![(WqeOpcode::Send.code(), WcStatus::Success.code(), 0)]
    );
    let got = p.b.drv.drain_cq(&mut b.cq);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].status, WcStatus::Success.code());
    assert_eq!(got[0].byte_count.get(), 5000);
    assert_eq!(p.b.drv.read_mr(&b.mr, 100, 5000), payload);
    // 5 request packets, fewer ACKs (one per message).
    let tx_a = p.a.dev.port_counters(1).unwrap().tx_packets;
    let tx_b = p.b.dev.port_counters(1).unwrap().tx_packets;
    assert_eq!(tx_a, 5);
    assert_eq!(tx_b, 1, "ACKs are coalesced");
}

#[test]
fn rc_rdma_write_read_and_atomics() {
    let (mut p, mut a, b) = rc_pair(Mtu::Mtu1024);
    let remote = |off: u64| RemoteAddr {
        addr: b.mr.va + off,
        rkey: b.mr.rkey,
    };
    // RDMA write 3000 bytes to B at offset 4096.
    let data: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    p.a.drv.write_mr(&a.mr, 0, &data);
    let sg = [sim_hca::testkit::Driver::sge(&a.mr, 0, 3000)];
    p.a.drv
        .post_send(
            &mut p.a.dev,
            &mut a.qp,
            &send_wr(
                1,
                SendOp::RdmaWrite {
                    remote: remote(4096),
                },
                &sg,
            ),
            None,
            None,
            true,
        )
        .unwrap();
    p.pump();
    assert_eq!(p.b.drv.read_mr(&b.mr, 4096, 3000), data);
    // RDMA read it back into A at offset 8192.
    let sg = [sim_hca::testkit::Driver::sge(&a.mr, 8192, 3000)];
    p.a.drv
        .post_send(
            &mut p.a.dev,
            &mut a.qp,
            &send_wr(
                2,
                SendOp::RdmaRead {
                    remote: remote(4096),
                },
                &sg,
            ),
            None,
            None,
            true,
        )
        .unwrap();
    p.pump();
    assert_eq!(p.a.drv.read_mr(&a.mr, 8192, 3000), data);
    // Atomics on an 8-byte word at B offset 64, initially 40.
    p.b.drv.write_mr(&b.mr, 64, &40u64.to_le_bytes());
    let sg = [sim_hca::testkit::Driver::sge(&a.mr, 16, 8)];
    p.a.drv
        .post_send(
            &mut p.a.dev,
            &mut a.qp,
            &send_wr(
                3,
                SendOp::FetchAdd {
                    remote: remote(64),
                    add: 2,
                },
                &sg,
            ),
            None,
            None,
            true,
        )
        .unwrap();
    p.pump();
    assert_eq!(
        p.a.drv.read_mr(&a.mr, 16, 8),
        40u64.to_le_bytes(),
        "fetch-add returns the old value"
    );
    assert_eq!(p.b.drv.read_mr(&b.mr, 64, 8), 42u64.to_le_bytes());
    p.a.drv
        .post_send(
            &mut p.a.dev,
            &mut a.qp,
            &send_wr(
                4,
                SendOp::CompareSwap {
                    remote: remote(64),
                    compare: 42,
                    swap: 99,
                },
                &sg,
            ),
            None,
            None,
            true,
        )
        .unwrap();
    p.pump();
    assert_eq!(p.a.drv.read_mr(&a.mr, 16, 8), 42u64.to_le_bytes());
    assert_eq!(p.b.drv.read_mr(&b.mr, 64, 8), 99u64.to_le_bytes());
    let cqes = p.a.drv.drain_cq(&mut a.cq);
    assert_eq!(
        summary(&cqes)
            .iter()
            .map(|c| (c.0, c.1))
            .collect::<Vec<_>>(),
        vec![
            (WqeOpcode::RdmaWrite.code(), 0),
            (WqeOpcode::RdmaRead.code(), 0),
            (WqeOpcode::AtomicFa.code(), 0),
            (WqeOpcode::AtomicCs.code(), 0),
        ]
    );
}

#[test]
fn rc_bad_rkey_gives_remote_access_error_and_flushes() {
    let (mut p, mut a, b) = rc_pair(Mtu::Mtu1024);
    let bad = RemoteAddr {
        addr: b.mr.va,
        rkey: ib_types::wr::RKey::new(b.mr.rkey.get() ^ 0x80),
    };
    let sg = [sim_hca::testkit::Driver::sge(&a.mr, 0, 16)];
    p.a.drv
        .post_send(
            &mut p.a.dev,
            &mut a.qp,
            &send_wr(1, SendOp::RdmaWrite { remote: bad }, &sg),
            None,
            None,
            false,
        )
        .unwrap();
    p.a.drv
        .post_send(
            &mut p.a.dev,
            &mut a.qp,
            &send_wr(2, SendOp::RdmaWrite { remote: bad }, &sg),
            None,
            None,
            true,
        )
        .unwrap();
    p.pump();
    let cqes = p.a.drv.drain_cq(&mut a.cq);
    let statuses: Vec<u8> = cqes.iter().map(|c| c.status).collect();
    assert_eq!(
        statuses,
        vec![WcStatus::RemAccessErr.code(), WcStatus::WrFlushErr.code()]
    );
    let qpc = p.a.drv.query_qp(&mut p.a.dev, a.qp.qpn).unwrap();
    assert_eq!(qpc.state, ib_types::qp::QpState::Err.code());
}

#[test]
fn rnr_nak_then_retry_succeeds() {
    let (mut p, mut a, mut b) = rc_pair(Mtu::Mtu1024);
    let sg = [sim_hca::testkit::Driver::sge(&a.mr, 0, 32)];
    p.a.drv
        .post_send(
            &mut p.a.dev,
            &mut a.qp,
            &send_wr(1, SendOp::Send, &sg),
            None,
            None,
            true,
        )
        .unwrap();
    p.pump();
    assert!(
        p.a.drv.drain_cq(&mut a.cq).is_empty(),
        "RNR: not complete yet"
    );
    p.b.drv
        .post_recv(&mut b.qp, 1, &[sim_hca::testkit::Driver::sge(&b.mr, 0, 64)]);
    p.advance(1_000_000);
    let cqes = p.a.drv.drain_cq(&mut a.cq);
    assert_eq!(cqes.len(), 1);
    assert_eq!(cqes[0].status, WcStatus::Success.code());
    assert_eq!(p.b.drv.drain_cq(&mut b.cq).len(), 1);
}

#[test]
fn lost_packets_are_retransmitted() {
    let (mut p, mut a, mut b) = rc_pair(Mtu::Mtu1024);
    let payload: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
    p.a.drv.write_mr(&a.mr, 0, &payload);
    p.b.drv.post_recv(
        &mut b.qp,
        1,
        &[sim_hca::testkit::Driver::sge(&b.mr, 0, 4096)],
    );
    // Drop the 2nd request packet once.
    let mut seen = 0;
    p.filter = Some(Box::new(move |to_b, _| {
        if to_b {
            seen += 1;
            seen != 2
        } else {
            true
        }
    }));
    let sg = [sim_hca::testkit::Driver::sge(&a.mr, 0, 4096)];
    p.a.drv
        .post_send(
            &mut p.a.dev,
            &mut a.qp,
            &send_wr(1, SendOp::Send, &sg),
            None,
            None,
            true,
        )
        .unwrap();
    p.advance(1_000_000_000);
    let cqes = p.a.drv.drain_cq(&mut a.cq);
    assert_eq!(
        summary(&cqes),
        vec![(WqeOpcode::Send.code(), WcStatus::Success.code(), 0)]
    );
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, 4096), payload);
    assert_eq!(p.b.drv.drain_cq(&mut b.cq).len(), 1);
}

#[test]
fn event_mode_commands_complete_through_the_eq() {
    let mut p = Pair::new();
    // Bring-up raised the port-active event; take it and re-arm the EQ.
    p.a.drv.poll_eq(&mut p.a.dev);
    assert!(
        p.a.drv
            .events
            .iter()
            .any(|e| matches!(e, hca_prm::eqe::Event::PortChange { active: true, .. }))
    );
    let before = p.a.irq.0.lock().unwrap().len();
    let (token, status) =
        p.a.drv
            .cmd_by_event(&mut p.a.dev, Opcode::Nop, 0, 0)
            .expect("completion event");
    assert_eq!(status, 0);
    assert_eq!(token & 0x4000, 0x4000);
    assert!(
        p.a.irq.0.lock().unwrap().len() > before,
        "the EQ raised its vector"
    );
}

#[test]
fn a_send_doorbell_rung_while_the_qp_is_in_reset_is_dropped() {
    use hca_prm::regs::offset::DROPPED_DOORBELLS;
    use ib_types::qp::{QpModify, QpState};
    let (mut p, mut a, mut b) = rc_pair(Mtu::Mtu1024);
    let to_reset = QpModify::to_state(QpState::Reset);
    assert_eq!(
        p.a.drv.modify_qp(&mut p.a.dev, &a.qp, &to_reset),
        CmdStatus::Ok
    );
    // A post racing with the reset: its WQEs are written and its doorbell
    // rung after the device took the QP to RESET. PRM 6.1.3: the QP's
    // counters are 0 and stay so until software posts again after
    // RESET->INIT; the doorbell is dropped and counted.
    let dropped = p.a.dev.mmio_read32(DROPPED_DOORBELLS);
    p.a.drv.write_mr(&a.mr, 0, b"stale");
    let sg = [sim_hca::testkit::Driver::sge(&a.mr, 0, 5)];
    for id in 0..3 {
        p.a.drv
            .post_send(
                &mut p.a.dev,
                &mut a.qp,
                &send_wr(id, SendOp::Send, &sg),
                None,
                None,
                true,
            )
            .unwrap();
    }
    assert_eq!(p.a.dev.mmio_read32(DROPPED_DOORBELLS), dropped + 3);
    // The driver starts over at WQE index 0 and reconnects with the PSNs
    // `rc_pair` used (nothing was sent yet).
    a.qp.sq_producer = 0;
    let access = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    for m in [
        bring_up::to_init(QpType::Rc, access, 0),
        bring_up::to_rtr(QpType::Rc, IP_B, b.qp.qpn, 5000, Mtu::Mtu1024),
        bring_up::to_rts(QpType::Rc, 100, 14, 7, 7),
    ] {
        assert_eq!(p.a.drv.modify_qp(&mut p.a.dev, &a.qp, &m), CmdStatus::Ok);
    }
    for id in 0..4 {
        p.b.drv.post_recv(
            &mut b.qp,
            100 + id,
            &[sim_hca::testkit::Driver::sge(&b.mr, 64 * id, 64)],
        );
    }
    p.a.drv.write_mr(&a.mr, 0, b"fresh");
    p.a.drv
        .post_send(
            &mut p.a.dev,
            &mut a.qp,
            &send_wr(9, SendOp::Send, &sg),
            None,
            None,
            true,
        )
        .unwrap();
    p.pump();
    // Exactly the one WQE posted after the reset ran.
    let sent = p.a.drv.drain_cq(&mut a.cq);
    assert_eq!(
        summary(&sent),
        vec![(WqeOpcode::Send.code(), WcStatus::Success.code(), 0)]
    );
    let got = p.b.drv.drain_cq(&mut b.cq);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(p.b.drv.read_mr(&b.mr, 0, 5), b"fresh");
}
