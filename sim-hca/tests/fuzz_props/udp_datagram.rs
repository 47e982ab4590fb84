//! The property of the UDP fabric's two translations (`sim_hca::udp`):
//! a received datagram into the frame a device receives
//! ([`frame_from_datagram`]), and a frame a device sent into the datagram
//! a socket sends ([`datagram_from_frame`]). Shared by the bounded
//! property test (`tests/fuzz_udp_datagram.rs`) and the `udp_datagram`
//! cargo-fuzz target, which include this file by path.
//!
//! The input is `[flags] [source IPv4: 4] [source port: 2 BE]
//! [destination IPv4: 4] [bytes]`. Without flag bit 1 the bytes are a
//! datagram received from the source on a socket bound to the
//! destination; with flag bit 0 its ICRC is first recomputed over the
//! headers the fabric rebuilds (a fuzzer cannot forge a CRC), so
//! mutations reach the transport headers. Then:
//! - the rebuilt frame is accepted exactly when the device's parser
//!   ([`RocePacket::parse`]) accepts this file's own model of it (the
//!   specified Ethernet, IPv4 and UDP headers in front of the datagram),
//!   and is then exactly that model, byte for byte;
//! - an accepted frame turns back into the very same datagram, to the
//!   same destination, untouched.
//!
//! With flag bit 1 the bytes are a frame a device sent from the source:
//! the translation never panics, its datagram lies within the frame after
//! the headers, and a frame the parser accepts always translates, into a
//! datagram whose rebuilt frame carries the same transport headers and
//! payload to the same destination, from the socket's address and port.

use std::net::{Ipv4Addr, SocketAddrV4};

use ib_types::scalars::{PKey, Psn, QKey, Qpn};
use ib_types::wr::RKey;
use sim_hca::udp::{FRAME_HEADROOM, datagram_from_frame, frame_from_datagram};
use sim_hca::wire::bth::BthRepr;
use sim_hca::wire::eth::{ETHERTYPE_IPV4, EthRepr, MacAddr};
use sim_hca::wire::ext::{DethRepr, ExtRepr, RethRepr};
use sim_hca::wire::icrc::{self, ICRC_LEN};
use sim_hca::wire::ipv4::{Ipv4Repr, PROTOCOL_UDP};
use sim_hca::wire::opcode::Opcode;
use sim_hca::wire::packet::{ETH_LEN, PacketRepr, RocePacket};
use sim_hca::wire::udp::{ROCEV2_PORT, UdpRepr};
use sim_hca::wire::{DropReason, HeaderRepr};

/// Bytes before the datagram or frame in an input.
const PREFIX: usize = 11;

/// Checks the property on one input; panics on a violation. Returns
/// whether the datagram or frame was accepted.
pub(crate) fn check(data: &[u8]) -> bool {
    let Some((prefix, bytes)) = data.split_first_chunk::<PREFIX>() else {
        return false;
    };
    let flags = prefix[0];
    let from = SocketAddrV4::new(
        Ipv4Addr::new(prefix[1], prefix[2], prefix[3], prefix[4]),
        u16::from_be_bytes([prefix[5], prefix[6]]),
    );
    let to = Ipv4Addr::new(prefix[7], prefix[8], prefix[9], prefix[10]);
    if flags & 2 != 0 {
        sent_frame(bytes, from)
    } else {
        let mut datagram = bytes.to_vec();
        if flags & 1 != 0 {
            reseal(&mut datagram, from, to);
        }
        received_datagram(&datagram, from, to)
    }
}

/// The headers the fabric is specified to rebuild in front of a datagram
/// of `len` bytes from `from` to `to` (`docs/prm.md`, "The UDP fabric").
fn model_headers(from: SocketAddrV4, to: Ipv4Addr, len: usize) -> [u8; FRAME_HEADROOM] {
    let mut out = [0u8; FRAME_HEADROOM];
    let rest = EthRepr {
        dst: MacAddr::for_ip_destination(to),
        src: MacAddr::for_ipv4(*from.ip()),
        ethertype: ETHERTYPE_IPV4,
    }
    .emit_prefix(&mut out)
    .expect("room for Ethernet");
    let rest = Ipv4Repr {
        src: *from.ip(),
        dst: to,
        tos: 0,
        identification: 0,
        dont_fragment: true,
        ttl: 64,
        protocol: PROTOCOL_UDP,
        payload_len: (len + 8) as u16,
    }
    .emit_prefix(rest)
    .expect("room for IPv4");
    UdpRepr {
        src_port: from.port(),
        dst_port: ROCEV2_PORT,
        payload_len: len as u16,
    }
    .emit_prefix(rest)
    .expect("room for UDP");
    out
}

/// Recomputes the ICRC at the end of `datagram` over the rebuilt headers.
fn reseal(datagram: &mut [u8], from: SocketAddrV4, to: Ipv4Addr) {
    let Some(covered) = datagram.len().checked_sub(ICRC_LEN) else {
        return;
    };
    let headers = model_headers(from, to, datagram.len());
    let mut ip = headers[ETH_LEN..].to_vec();
    ip.extend_from_slice(&datagram[..covered]);
    if let Ok(crc) = icrc::compute(&ip) {
        datagram[covered..].copy_from_slice(&crc.to_le_bytes());
    }
}

fn received_datagram(datagram: &[u8], from: SocketAddrV4, to: Ipv4Addr) -> bool {
    let len = datagram.len();
    let mut buf = vec![0xA5; FRAME_HEADROOM + len];
    buf[FRAME_HEADROOM..].copy_from_slice(datagram);
    let result = frame_from_datagram(&mut buf, len, from, to);

    let mut model = model_headers(from, to, len).to_vec();
    model.extend_from_slice(datagram);
    let expected = RocePacket::parse(&model).map(|_| model.len());
    match (&result, &expected) {
        (Ok(n), Ok(m)) => assert_eq!(n, m, "frame length"),
        (Err(e), Err(f)) => assert_eq!(e.reason(), f.reason(), "drop reason"),
        _ => panic!("fabric {result:?}, model {expected:?}"),
    }
    let Ok(n) = result else {
        let reason = result.unwrap_err().reason();
        assert!(
            !matches!(
                reason,
                DropReason::ExtMismatch | DropReason::PayloadMismatch | DropReason::BufferTooSmall
            ),
            "a receive refused for an emit-only reason: {reason:?}"
        );
        return false;
    };
    assert_eq!(&buf[..n], &model[..], "the rebuilt frame is the model");

    // And back: the same datagram to the same place, untouched.
    let mut frame = buf[..n].to_vec();
    let (dst, range) = datagram_from_frame(&mut frame, from).expect("an accepted frame sends");
    assert_eq!(dst, to);
    assert_eq!(range, FRAME_HEADROOM..n);
    assert_eq!(&frame[range], datagram, "the datagram round-trips");
    true
}

fn sent_frame(frame: &[u8], from: SocketAddrV4) -> bool {
    let original = RocePacket::parse(frame)
        .ok()
        .map(|p| (*p.repr(), p.payload().to_vec()));
    let mut copy = frame.to_vec();
    let result = datagram_from_frame(&mut copy, from);
    if let Ok((_, range)) = &result {
        assert_eq!(range.start, FRAME_HEADROOM);
        assert!(range.end <= frame.len() && range.end >= range.start);
    }
    let Some((repr, payload)) = original else {
        return result.is_ok();
    };
    let (dst, range) = result.expect("a frame the parser accepts translates");
    assert_eq!(dst, repr.dst_ip);
    let datagram = copy[range].to_vec();
    let mut buf = vec![0u8; FRAME_HEADROOM + datagram.len()];
    buf[FRAME_HEADROOM..].copy_from_slice(&datagram);
    let n = frame_from_datagram(&mut buf, datagram.len(), from, dst)
        .expect("the datagram of a valid frame is received whole");
    let rebuilt = RocePacket::parse(&buf[..n]).expect("it parses");
    let got = rebuilt.repr();
    assert_eq!(got.bth, repr.bth);
    assert_eq!(got.ext, repr.ext);
    assert_eq!(got.dst_ip, repr.dst_ip);
    assert_eq!((got.src_ip, got.src_port), (*from.ip(), from.port()));
    assert_eq!(rebuilt.payload(), &payload[..]);
    true
}

/// A frame from 127.0.0.1 to 127.0.0.2 (what a device emits).
fn frame(opcode: Opcode, ext: ExtRepr, payload: &[u8]) -> Vec<u8> {
    let repr = PacketRepr {
        dst_mac: MacAddr::for_ipv4(Ipv4Addr::new(127, 0, 0, 2)),
        src_mac: MacAddr::for_ipv4(Ipv4Addr::LOCALHOST),
        src_ip: Ipv4Addr::LOCALHOST,
        dst_ip: Ipv4Addr::new(127, 0, 0, 2),
        tos: 0,
        ttl: 64,
        src_port: 0xC123,
        bth: BthRepr {
            opcode,
            solicited: false,
            mig_req: false,
            pkey: PKey::DEFAULT,
            fecn: false,
            becn: false,
            dest_qp: Qpn::from_low_bits(0x12),
            ack_req: true,
            psn: Psn::from_low_bits(7),
        },
        ext,
        payload_len: payload.len(),
    };
    let mut out = vec![0; repr.buffer_len()];
    repr.emit(payload, &mut out).expect("a valid seed frame");
    out
}

/// Valid datagrams (flagged for resealing) and frames: seeds for the
/// fuzzer's corpus and the property test's mutations.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    let frames = [
        frame(Opcode::RcSendOnly, ExtRepr::None, &[0x11; 61]),
        frame(
            Opcode::RcRdmaWriteOnly,
            ExtRepr::Reth(RethRepr {
                va: 0x7f00_0000_1000,
                rkey: RKey::new(0x0123),
                dma_len: 32,
            }),
            &[0x22; 32],
        ),
        frame(
            Opcode::UdSendOnly,
            ExtRepr::Deth(DethRepr {
                qkey: QKey::new(7),
                src_qp: Qpn::from_low_bits(9),
            }),
            &[0x33; 40],
        ),
    ];
    let from = [127, 0, 0, 1, 0x12, 0xB7];
    let to = [127, 0, 0, 2];
    let mut seeds = Vec::new();
    for f in &frames {
        // The datagram as received, then the frame as sent.
        let mut datagram = vec![1];
        datagram.extend_from_slice(&from);
        datagram.extend_from_slice(&to);
        datagram.extend_from_slice(&f[FRAME_HEADROOM..]);
        seeds.push(datagram);
        let mut sent = vec![2];
        sent.extend_from_slice(&from);
        sent.extend_from_slice(&to);
        sent.extend_from_slice(f);
        seeds.push(sent);
    }
    seeds
}
