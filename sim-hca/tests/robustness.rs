//! Nothing a driver or a peer sends can panic the device (issue 3): random
//! register writes, random commands, random WQEs, and random — including
//! well-formed — packets thrown at a live device. Each property also checks
//! the device still answers a NOP afterwards (or reports itself fatal).

mod common;

use common::*;
use hca_prm::cmd::{CmdStatus, Opcode};
use hca_prm::wqe::WqeOpcode;
use ib_types::access::AccessFlags;
use ib_types::qp::QpType;
use ib_types::scalars::{Mtu, PKey, Psn, QKey, Qpn};
use proptest::prelude::*;
use sim_hca::testkit::Driver;
use sim_hca::wire::bth::BthRepr;
use sim_hca::wire::eth::MacAddr;
use sim_hca::wire::ext::{
    AethRepr, AtomicAckEthRepr, AtomicEthRepr, CreditCode, DethRepr, ExtRepr, IethRepr, ImmDtRepr,
    Msn, RethRepr, Syndrome,
};
use sim_hca::wire::opcode::Opcode as WireOpcode;
use sim_hca::wire::packet::PacketRepr;

/// A connected RC pair and a UD QP on B, ready for traffic.
struct Live {
    p: Pair,
    a: Endpoint,
    b: Endpoint,
    ud: Endpoint,
}

fn live() -> Live {
    let mut p = Pair::new();
    let a = endpoint(&mut p.a, QpType::Rc, AccessFlags::empty());
    let mut b = endpoint(&mut p.b, QpType::Rc, AccessFlags::empty());
    connect(&mut p, &a, &b, QpType::Rc, Mtu::Mtu1024, Retries::PATIENT);
    let mut ud = endpoint(&mut p.b, QpType::Ud, AccessFlags::empty());
    let n = &mut p.b;
    n.drv.modify_qp(
        &mut n.dev,
        &ud.qp,
        &bring_up::to_init(QpType::Ud, AccessFlags::empty(), 7),
    );
    n.drv.modify_qp(
        &mut n.dev,
        &ud.qp,
        &bring_up::to_rtr(QpType::Ud, [0; 4], 0, 0, Mtu::Mtu1024),
    );
    n.drv.modify_qp(
        &mut n.dev,
        &ud.qp,
        &bring_up::to_rts(QpType::Ud, 0, 0, 0, 0),
    );
    for i in 0..4 {
        let sge = Driver::sge(&b.mr, i * 2048, 2048);
        n.drv.post_recv(&mut b.qp, i, &[sge]);
        let sge = Driver::sge(&ud.mr, i * 2048, 2048);
        n.drv.post_recv(&mut ud.qp, i, &[sge]);
    }
    Live { p, a, b, ud }
}

/// The device is either fatal or still runs commands.
fn still_alive(n: &mut Node) {
    if n.dev.is_fatal() {
        return;
    }
    // Registers may have been scribbled on (even a reset): re-bring it up if
    // the command queue is gone, then a NOP must succeed.
    let enabled = n.dev.mmio_read32(hca_prm::regs::offset::STATUS) & 0b100 != 0;
    if !enabled {
        return;
    }
    let (status, _) = n.drv.cmd_param(&mut n.dev, Opcode::Nop, 0, 0);
    assert_eq!(status, CmdStatus::Ok);
}

fn any_opcode() -> impl Strategy<Value = WireOpcode> {
    proptest::sample::select(WireOpcode::ALL)
}

/// Extension headers of the right layout for `op`, with random values.
fn ext_for(op: WireOpcode, r: &[u64; 4]) -> ExtRepr {
    use sim_hca::wire::opcode::ExtLayout as L;
    let reth = RethRepr {
        va: r[0],
        rkey: ib_types::wr::RKey::new(r[1] as u32),
        dma_len: (r[2] as u32) % 10_000,
    };
    let imm = ImmDtRepr {
        imm: ib_types::abi::Be32::new(r[3] as u32),
    };
    let aeth = AethRepr {
        syndrome: match r[1] % 3 {
            0 => Syndrome::Ack {
                credits: CreditCode::NONE,
            },
            1 => Syndrome::RnrNak {
                timer: sim_hca::wire::ext::RnrTimer::new((r[2] % 32) as u8).unwrap(),
            },
            _ => Syndrome::Nak(sim_hca::wire::ext::NakCode::ALL[(r[2] % 5) as usize]),
        },
        msn: Msn::from_low_bits(r[3] as u32),
    };
    let deth = DethRepr {
        qkey: QKey::new(r[0] as u32 % 3 + 6),
        src_qp: Qpn::from_low_bits(r[1] as u32),
    };
    match op.info().ext {
        L::None => ExtRepr::None,
        L::ImmDt => ExtRepr::ImmDt(imm),
        L::Reth => ExtRepr::Reth(reth),
        L::RethImmDt => ExtRepr::RethImmDt(reth, imm),
        L::Ieth => ExtRepr::Ieth(IethRepr {
            rkey: ib_types::wr::RKey::new(r[2] as u32),
        }),
        L::Aeth => ExtRepr::Aeth(aeth),
        L::AethAtomicAckEth => ExtRepr::AethAtomicAckEth(
            aeth,
            AtomicAckEthRepr {
                orig_remote_data: r[0],
            },
        ),
        L::AtomicEth => ExtRepr::AtomicEth(AtomicEthRepr {
            va: r[0],
            rkey: ib_types::wr::RKey::new(r[1] as u32),
            swap_add: r[2],
            compare: r[3],
        }),
        L::Deth => ExtRepr::Deth(deth),
        L::DethImmDt => ExtRepr::DethImmDt(deth, imm),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Well-formed RoCEv2 packets with arbitrary transport fields, aimed at
    /// the live QPs (and at random QPNs): the device acts on them or drops
    /// them, and never panics.
    #[test]
    fn arbitrary_valid_packets(
        packets in proptest::collection::vec(
            (any_opcode(), 0u32..6, any::<u32>(), any::<bool>(), any::<bool>(), any::<[u64; 4]>(), 0usize..1100, any::<u16>()),
            1..24,
        )
    ) {
        let mut l = live();
        let targets = [l.b.qp.qpn, l.ud.qp.qpn, l.a.qp.qpn, 1, 0, 0x00AB_CDEF];
        for (op, target, psn, se, ack, r, len, pkey) in packets {
            let payload_len = if op.info().payload { len } else { 0 };
            let payload = vec![0x5Au8; payload_len];
            let repr = PacketRepr {
                dst_mac: MacAddr::for_ipv4(IP_B.into()),
                src_mac: MacAddr::for_ipv4(IP_A.into()),
                src_ip: IP_A.into(),
                dst_ip: IP_B.into(),
                tos: 0,
                ttl: 64,
                src_port: 0xC000,
                bth: BthRepr {
                    opcode: op,
                    solicited: se,
                    mig_req: false,
                    pkey: if pkey % 4 == 0 { PKey::new(pkey) } else { PKey::DEFAULT },
                    fecn: false,
                    becn: false,
                    dest_qp: Qpn::from_low_bits(targets[target as usize]),
                    ack_req: ack,
                    psn: if psn % 3 == 0 { Psn::new(5000 + psn % 8).unwrap() } else { Psn::from_low_bits(psn) },
                },
                ext: ext_for(op, &r),
                payload_len,
            };
            let mut frame = vec![0u8; repr.buffer_len()];
            repr.emit(&payload, &mut frame).unwrap();
            l.p.b.dev.receive(1, &frame);
            l.p.pump();
        }
        l.p.advance(10_000_000);
        still_alive(&mut l.p.a);
        still_alive(&mut l.p.b);
    }

    /// Arbitrary bytes and single-bit damage to valid frames are dropped and
    /// counted as errors.
    #[test]
    fn garbage_frames(frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 1..32)) {
        let mut l = live();
        let before = l.p.b.dev.port_counters(1).unwrap();
        for f in &frames {
            l.p.b.dev.receive(1, f);
        }
        let after = l.p.b.dev.port_counters(1).unwrap();
        prop_assert_eq!(after.rx_packets, before.rx_packets, "random bytes are never valid RoCEv2");
        prop_assert_eq!(after.rx_errors - before.rx_errors, frames.len() as u64);
        still_alive(&mut l.p.b);
    }

    /// Random register writes anywhere in page 0 and the first UAR pages.
    #[test]
    fn arbitrary_register_writes(writes in proptest::collection::vec((0u64..0x3000, any::<u64>(), any::<bool>()), 1..64)) {
        let mut l = live();
        for (offset, value, wide) in writes {
            let offset = offset & !3;
            if wide {
                l.p.b.dev.mmio_write64(offset & !7, value);
            } else {
                l.p.b.dev.mmio_write32(offset, value as u32);
            }
            let _ = l.p.b.dev.mmio_read32(offset);
        }
        l.p.pump();
        l.p.advance(1_000_000);
    }

    /// Random command entries: every opcode with random modifiers, random
    /// parameters and random mailbox contents.
    #[test]
    fn arbitrary_commands(cmds in proptest::collection::vec(
        (proptest::sample::select(Opcode::ALL), any::<u16>(), any::<u32>(), any::<u64>(), proptest::collection::vec(any::<u8>(), 0..300), 0usize..300),
        1..24,
    )) {
        let mut l = live();
        for (op, op_mod, in_mod, param, input, out_len) in cmds {
            let n = &mut l.p.b;
            let in_mod = if in_mod % 2 == 0 { in_mod % 40 } else { in_mod };
            let op_mod = if op_mod % 2 == 0 { 0 } else { op_mod };
            if input.is_empty() {
                let _ = n.drv.cmd_param(&mut n.dev, op, in_mod, param);
            } else {
                let _ = n.drv.cmd(&mut n.dev, op, op_mod, in_mod, &input, out_len);
            }
        }
        l.p.pump();
        l.p.advance(1_000_000);
        still_alive(&mut l.p.b);
    }

    /// Random bytes in the send ring, then a doorbell: garbage WQEs complete
    /// with LOC_QP_OP_ERR (or flush) and never panic the device.
    #[test]
    fn garbage_wqes(blocks in proptest::collection::vec(any::<[u8; 64]>(), 1..6), fix_index in any::<bool>()) {
        let mut l = live();
        let n = &mut l.p.a;
        let start = l.a.qp.sq_producer;
        for (i, mut block) in blocks.iter().copied().enumerate() {
            if fix_index {
                let index = start.wrapping_add(i as u32) as u16;
                block[4..6].copy_from_slice(&index.to_le_bytes());
                block[0] %= 12;
            }
            n.drv.write_sq_raw(&l.a.qp, start.wrapping_add(i as u32), &block);
        }
        l.a.qp.sq_producer = start.wrapping_add(blocks.len() as u32);
        n.drv.ring_sq(&mut n.dev, &l.a.qp);
        l.p.pump();
        l.p.advance(100_000_000);
        let cqes = l.p.a.drv.drain_cq(&mut l.a.cq);
        for c in &cqes {
            prop_assert!(c.status != 0 || WqeOpcode::from_code(c.opcode).is_ok());
        }
        still_alive(&mut l.p.a);
    }
}
