//! The property of RoCEv2 packet parsing (`sim_hca::wire`: Ethernet, IPv4,
//! UDP, BTH, extension headers, pad, ICRC) and of a device's receive path
//! under hostile frames. Shared by the bounded property test
//! (`tests/fuzz_packet.rs`) and the `packet` cargo-fuzz target, which
//! include this file (and `tests/common`, as `crate::common`) by path.
//!
//! The input is a sequence of frames, each `[flags] [len: u16 LE] [bytes]`.
//! With flag bit 0 the IPv4 checksum and the ICRC are recomputed over the
//! declared datagram (a fuzzer cannot forge a CRC), so mutations reach the
//! transport headers. For each frame:
//! - a frame that parses re-emits from its parsed value into a frame that
//!   parses to the same value and payload, with the same bytes in every
//!   header field the value holds (IPv4 identification, flags and the UDP
//!   checksum, reserved bits and pad contents are not held: RoCEv2
//!   ignores them);
//! - delivered to a live device (an RC QP connected to a peer device, a UD
//!   QP, receives posted), it is counted exactly once: as an error exactly
//!   when the parser refuses it, else as received or discarded.
//!
//! Afterwards the two devices exchange whatever they answered and run their
//! timers; every frame either puts on the wire parses, every completion
//! they wrote decodes, and both still run commands (or reported a fatal
//! error).

use hca_prm::cmd::{CmdStatus, Opcode as CmdOpcode};
use ib_types::access::AccessFlags;
use ib_types::qp::QpType;
use ib_types::scalars::{Mtu, PKey, Psn, QKey, Qpn};
use sim_hca::testkit::Driver;
use sim_hca::wire::bth::BthRepr;
use sim_hca::wire::eth::MacAddr;
use sim_hca::wire::ext::{DethRepr, ExtRepr, RethRepr};
use sim_hca::wire::icrc::{self, ICRC_LEN};
use sim_hca::wire::ipv4;
use sim_hca::wire::opcode::Opcode;
use sim_hca::wire::packet::{ETH_LEN, PacketRepr, RocePacket};

use crate::common::*;

/// Most frames one input delivers.
const MAX_FRAMES: usize = 16;
/// The UD QP's Q_Key.
const UD_QKEY: u32 = 7;

/// Checks the property on one input; panics on a violation. Returns how
/// many frames parsed.
pub(crate) fn check(data: &[u8]) -> usize {
    let mut live = Live::new();
    let mut parsed = 0;
    for frame in frames(data).into_iter().take(MAX_FRAMES) {
        parsed += usize::from(round_trip(&frame));
        live.deliver(&frame);
    }
    live.settle();
    parsed
}

/// Splits the input into frames, resealing those flagged.
pub(crate) fn frames(mut data: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while let [flags, lo, hi, rest @ ..] = data {
        let len = usize::from(u16::from_le_bytes([*lo, *hi])).min(rest.len());
        let (frame, tail) = rest.split_at(len);
        let mut frame = frame.to_vec();
        if flags & 1 != 0 {
            reseal(&mut frame);
        }
        out.push(frame);
        data = tail;
    }
    out
}

/// Recomputes the IPv4 header checksum and the ICRC of the datagram the
/// IPv4 header declares, where the frame holds them.
fn reseal(frame: &mut [u8]) {
    const IP: usize = ETH_LEN;
    if frame.len() < IP + ipv4::HEADER_LEN {
        return;
    }
    frame[IP + 10..IP + 12].fill(0);
    let sum = ipv4::checksum(&frame[IP..IP + ipv4::HEADER_LEN]);
    frame[IP + 10..IP + 12].copy_from_slice(&sum.to_be_bytes());
    let total = usize::from(u16::from_be_bytes([frame[IP + 2], frame[IP + 3]]));
    let end = IP + total;
    if total < ipv4::HEADER_LEN + ICRC_LEN || end > frame.len() {
        return;
    }
    if let Ok(crc) = icrc::compute(&frame[IP..end - ICRC_LEN]) {
        frame[end - ICRC_LEN..end].copy_from_slice(&crc.to_le_bytes());
    }
}

/// Parse, re-emit, re-parse. Returns whether the frame parsed.
fn round_trip(frame: &[u8]) -> bool {
    let Ok(p) = RocePacket::parse(frame) else {
        return false;
    };
    let repr = *p.repr();
    assert!(p.len() <= frame.len(), "{repr:?}");
    let mut again = vec![0xA5; repr.buffer_len() + 8];
    assert_eq!(
        repr.emit(p.payload(), &mut again),
        Ok(p.len()),
        "{repr:?} re-emits"
    );
    let again = &again[..p.len()];
    let q = RocePacket::parse(again).expect("a re-emitted frame parses");
    assert_eq!(q.repr(), &repr, "re-parsed value");
    assert_eq!(q.payload(), p.payload(), "re-parsed payload");
    // Every held field has the received bytes: Ethernet, IPv4 TOS, total
    // length, TTL, protocol and addresses, UDP ports and length, and the
    // IB transport headers and payload (the ICRC differs only where an
    // unheld field did). Reserved bits and the pad bytes' contents are
    // ignored on receive and sent as zero (the BTH's resv6 beside
    // FECN/BECN and resv7 beside AckReq, the DETH byte before SrcQP), so
    // they are masked or left out.
    const IP: usize = ETH_LEN;
    const BTH: usize = IP + 28;
    let held = [
        0..ETH_LEN,
        IP + 1..IP + 4,
        IP + 8..IP + 10,
        IP + 12..IP + 20,
        IP + 20..IP + 26,
        BTH..p.len() - ICRC_LEN - usize::from(repr.pad()),
    ];
    let masked = |bytes: &[u8]| {
        let mut bytes = bytes[..p.len()].to_vec();
        bytes[BTH + 4] &= 0xC0;
        bytes[BTH + 8] &= 0x80;
        if matches!(repr.ext, ExtRepr::Deth(..) | ExtRepr::DethImmDt(..)) {
            bytes[BTH + 12 + 4] = 0;
        }
        bytes
    };
    let (again, frame) = (masked(again), masked(frame));
    for range in held {
        assert_eq!(
            &again[range.clone()],
            &frame[range.clone()],
            "{repr:?}: bytes {range:?} re-emitted differently"
        );
    }
    true
}

/// A connected RC pair (A to B) and a UD QP on B, receives posted.
struct Live {
    pair: Pair,
    rc_a: Endpoint,
    rc_b: Endpoint,
    ud_b: Endpoint,
}

impl Live {
    fn new() -> Self {
        let mut pair = Pair::new();
        let rc_a = endpoint(&mut pair.a, QpType::Rc, AccessFlags::empty());
        let mut rc_b = endpoint(&mut pair.b, QpType::Rc, AccessFlags::empty());
        connect(
            &mut pair,
            &rc_a,
            &rc_b,
            QpType::Rc,
            Mtu::Mtu1024,
            Retries::PATIENT,
        );
        let mut ud_b = endpoint(&mut pair.b, QpType::Ud, AccessFlags::empty());
        let b = &mut pair.b;
        let steps = [
            bring_up::to_init(QpType::Ud, AccessFlags::empty(), UD_QKEY),
            bring_up::to_rtr(QpType::Ud, [0; 4], 0, 0, Mtu::Mtu1024),
            bring_up::to_rts(QpType::Ud, 0, 0, 0, 0),
        ];
        for m in &steps {
            assert_eq!(b.drv.modify_qp(&mut b.dev, &ud_b.qp, m), CmdStatus::Ok);
        }
        for i in 0..4 {
            let sge = Driver::sge(&rc_b.mr, i * 2048, 2048);
            b.drv.post_recv(&mut rc_b.qp, i, &[sge]);
            let sge = Driver::sge(&ud_b.mr, i * 2048, 2048);
            b.drv.post_recv(&mut ud_b.qp, i, &[sge]);
        }
        Self {
            pair,
            rc_a,
            rc_b,
            ud_b,
        }
    }

    /// Hands one frame to B's port 1 and checks how it was counted.
    fn deliver(&mut self, frame: &[u8]) {
        let dev = &mut self.pair.b.dev;
        if dev.is_fatal() {
            return;
        }
        let before = dev.port_counters(1).expect("port 1");
        dev.receive(1, frame);
        if dev.is_fatal() {
            return;
        }
        let after = dev.port_counters(1).expect("port 1");
        let errors = after.rx_errors - before.rx_errors;
        let packets = after.rx_packets - before.rx_packets;
        let discards = after.rx_discards - before.rx_discards;
        assert_eq!(errors + packets + discards, 1, "a frame is counted once");
        assert_eq!(
            errors == 1,
            RocePacket::parse(frame).is_err(),
            "an error exactly when the parser refuses the frame"
        );
    }

    /// Lets the devices answer each other and run their timers, then
    /// checks what they put on the wire and in their CQs.
    fn settle(mut self) {
        self.pair.filter = Some(Box::new(|_, frame| {
            if let Err(e) = RocePacket::parse(frame) {
                panic!("a device sent a frame that does not parse: {e:?}");
            }
            true
        }));
        self.pair.advance(100_000_000);
        for (node, cqs) in [
            (
                &mut self.pair.a,
                [&mut self.rc_a.cq].into_iter().collect::<Vec<_>>(),
            ),
            (&mut self.pair.b, vec![&mut self.rc_b.cq, &mut self.ud_b.cq]),
        ] {
            for cq in cqs {
                for cqe in node.drv.drain_cq(cq) {
                    if let Err(e) = cqe.to_work_completion(0) {
                        panic!("a device wrote a CQE that does not decode: {e:?} {cqe:?}");
                    }
                }
            }
            if !node.dev.is_fatal() {
                let (status, _) = node.drv.cmd_param(&mut node.dev, CmdOpcode::Nop, 0, 0);
                assert_eq!(status, CmdStatus::Ok, "the device still runs commands");
            }
        }
    }
}

/// A frame from A to B.
fn frame_to_b(opcode: Opcode, dest_qp: u32, psn: u32, ext: ExtRepr, payload: &[u8]) -> Vec<u8> {
    let repr = PacketRepr {
        dst_mac: MacAddr::for_ipv4(IP_B.into()),
        src_mac: MacAddr::for_ipv4(IP_A.into()),
        src_ip: IP_A.into(),
        dst_ip: IP_B.into(),
        tos: 0,
        ttl: 64,
        src_port: 0xC000,
        bth: BthRepr {
            opcode,
            solicited: false,
            mig_req: false,
            pkey: PKey::DEFAULT,
            fecn: false,
            becn: false,
            dest_qp: Qpn::from_low_bits(dest_qp),
            ack_req: true,
            psn: Psn::from_low_bits(psn),
        },
        ext,
        payload_len: payload.len(),
    };
    let mut frame = vec![0; repr.buffer_len()];
    repr.emit(payload, &mut frame).expect("a valid seed frame");
    frame
}

/// Inputs of valid frames aimed at the live QPs (flagged for resealing,
/// so mutations keep valid checksums): seeds for the fuzzer's corpus and
/// the property test's mutations.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    let live = Live::new();
    let (rc, ud, mr) = (live.rc_b.qp.qpn, live.ud_b.qp.qpn, &live.rc_b.mr);
    let reth = RethRepr {
        va: mr.va,
        rkey: mr.rkey,
        dma_len: 32,
    };
    let deth = DethRepr {
        qkey: QKey::new(UD_QKEY),
        src_qp: Qpn::from_low_bits(9),
    };
    let frames = [
        frame_to_b(Opcode::RcSendOnly, rc, 100, ExtRepr::None, &[0x11; 64]),
        frame_to_b(
            Opcode::RcRdmaWriteOnly,
            rc,
            100,
            ExtRepr::Reth(reth),
            &[0x22; 32],
        ),
        frame_to_b(Opcode::UdSendOnly, ud, 0, ExtRepr::Deth(deth), &[0x33; 40]),
    ];
    let input = |frames: &[&Vec<u8>]| {
        let mut bytes = Vec::new();
        for frame in frames {
            bytes.push(1);
            bytes.extend_from_slice(&(frame.len() as u16).to_le_bytes());
            bytes.extend_from_slice(frame);
        }
        bytes
    };
    let mut seeds: Vec<Vec<u8>> = frames.iter().map(|f| input(&[f])).collect();
    seeds.push(input(&frames.iter().collect::<Vec<_>>()));
    seeds
}
