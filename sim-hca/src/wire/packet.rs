//! Whole RoCEv2 frames: [`RocePacket`], the checked view of a received
//! frame, and [`PacketRepr`], the value a sender emits.
//!
//! Contract of [`RocePacket::parse`]: it checks, in this order, and stops at
//! the first failure with a distinct [`WireError`]:
//! 1. Ethernet: the header is present and the ethertype is IPv4;
//! 2. IPv4: version 4, IHL 5, header checksum, not a fragment, total length
//!    at least 20 and within the frame (bytes after it are Ethernet padding
//!    and ignored), protocol UDP;
//! 3. UDP: length equal to the IPv4 payload, destination port 4791;
//! 4. BTH: TVer 0, opcode known;
//! 5. the extension headers the opcode table prescribes are all present;
//! 6. at least the ICRC follows; payload + pad is a multiple of 4 bytes and
//!    holds the pad count; opcodes without payload have neither payload nor
//!    pad;
//! 7. the ICRC matches.
//!
//! After that, every accessor is infallible and cannot panic. Parsing only
//! borrows the frame; [`PacketRepr::emit`] writes into a caller's buffer.
//! Neither allocates.
//!
//! What the wire layer does not check (the transport engine's job): P_Key
//! and Q_Key matching, QP existence and state, PSN order, MTU-sized
//! FIRST/MIDDLE payloads, R_Key validity.

use core::net::Ipv4Addr;

use ib_types::abi::Be32;
use ib_types::scalars::{PKey, Psn, QKey, Qpn};
use ib_types::wr::RKey;

use super::bth::{Bth, BthRepr};
use super::eth::{ETHERTYPE_IPV4, EthHeader, EthRepr, MacAddr};
use super::ext::{AethRepr, AtomicAckEthRepr, AtomicEthRepr, DethRepr, ExtRepr, RethRepr};
use super::icrc::{self, ICRC_LEN};
use super::ipv4::{self, Ipv4Header, Ipv4Repr, PROTOCOL_UDP};
use super::opcode::{Opcode, OpcodeInfo};
use super::udp::{self, ROCEV2_PORT, UdpHeader, UdpRepr};
use super::{HeaderRepr, WireError, split_header, split_header_mut};

/// Bytes of the Ethernet header.
pub const ETH_LEN: usize = size_of::<EthHeader>();
/// Bytes of every header before the extension headers.
pub const BASE_HEADERS_LEN: usize = ETH_LEN + ipv4::HEADER_LEN + udp::HEADER_LEN + size_of::<Bth>();

/// The pad bytes (0–3) that make `payload_len` a multiple of 4.
pub const fn pad_for(payload_len: usize) -> u8 {
    (payload_len.wrapping_neg() & 3) as u8
}

/// Everything a sender chooses about one RoCEv2 frame, except the payload
/// bytes themselves.
///
/// Fields the repr does not hold are fixed on emit: IPv4 identification 0
/// with DF set (an atomic datagram, RFC 6864), UDP destination port 4791,
/// UDP checksum 0, BTH TVer 0, the pad count from `payload_len`, and the
/// checksum and ICRC computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PacketRepr {
    /// Destination MAC ([`MacAddr::for_ip_destination`] on the simulated
    /// fabric).
    pub dst_mac: MacAddr,
    /// Source MAC.
    pub src_mac: MacAddr,
    /// Source IPv4 address (the sending port's GID, IPv4-mapped).
    pub src_ip: Ipv4Addr,
    /// Destination IPv4 address.
    pub dst_ip: Ipv4Addr,
    /// IPv4 TOS byte: DSCP << 2 | ECN (the AV's traffic class).
    pub tos: u8,
    /// IPv4 TTL (the AV's hop limit).
    pub ttl: u8,
    /// UDP source port: flow entropy ([`udp::flow_source_port`]).
    pub src_port: u16,
    /// The BTH fields.
    pub bth: BthRepr,
    /// The extension headers; their layout must be the opcode's.
    pub ext: ExtRepr,
    /// Payload bytes (zero for opcodes without payload).
    pub payload_len: usize,
}

impl PacketRepr {
    /// The pad count of this packet.
    pub const fn pad(&self) -> u8 {
        pad_for(self.payload_len)
    }

    /// Bytes of the UDP payload: BTH, extension headers, payload, pad, ICRC.
    const fn ib_len(&self) -> usize {
        size_of::<Bth>() + self.ext.buffer_len() + self.payload_len + self.pad() as usize + ICRC_LEN
    }

    /// The IPv4 total length this packet needs (may exceed 65535; `emit`
    /// then fails with [`WireError::TooLong`]).
    pub const fn ip_total_len(&self) -> usize {
        ipv4::HEADER_LEN + udp::HEADER_LEN + self.ib_len()
    }

    /// The frame's length in bytes.
    pub const fn buffer_len(&self) -> usize {
        ETH_LEN + self.ip_total_len()
    }

    /// Checks the repr against the opcode table and the IPv4 size limit.
    fn check(&self, payload: &[u8]) -> Result<&'static OpcodeInfo, WireError> {
        if payload.len() != self.payload_len {
            return Err(WireError::PayloadMismatch {
                declared: self.payload_len,
                got: payload.len(),
            });
        }
        self.check_headers()
    }

    /// The checks of [`PacketRepr::emit`] that do not need the payload
    /// bytes: the extension headers against the opcode table, a payload
    /// only where the opcode has one, and the IPv4 size limit.
    pub fn check_headers(&self) -> Result<&'static OpcodeInfo, WireError> {
        let info = self.bth.opcode.info();
        if self.ext.layout() != info.ext {
            return Err(WireError::ExtMismatch {
                opcode: info.name,
                expected: info.ext.name(),
                got: self.ext.layout().name(),
            });
        }
        if !info.payload && self.payload_len != 0 {
            return Err(WireError::UnexpectedPayload {
                opcode: info.name,
                len: self.payload_len,
            });
        }
        if self.ip_total_len() > ipv4::MAX_TOTAL_LEN {
            return Err(WireError::TooLong {
                len: self.ip_total_len(),
            });
        }
        Ok(info)
    }

    /// Writes the whole frame into the front of `out`: every header, the
    /// payload, zeroed pad, the IPv4 checksum and the ICRC. Returns the
    /// frame's length ([`PacketRepr::buffer_len`]).
    pub fn emit(&self, payload: &[u8], out: &mut [u8]) -> Result<usize, WireError> {
        self.check(payload)?;
        let body = self.emit_headers(out)?;
        out[body].copy_from_slice(payload);
        self.seal(out)?;
        Ok(self.buffer_len())
    }

    /// The first step of building a frame in place: checks the headers
    /// ([`PacketRepr::check_headers`]) and writes them into the front of
    /// `out`; returns where the payload goes. The caller writes the
    /// payload there, then [`PacketRepr::seal`]s the frame. Together, what
    /// [`PacketRepr::emit`] does, without a separate payload buffer.
    pub fn emit_headers(&self, out: &mut [u8]) -> Result<core::ops::Range<usize>, WireError> {
        self.check_headers()?;
        let len = self.buffer_len();
        let got = out.len();
        let frame = out
            .get_mut(..len)
            .ok_or(WireError::BufferTooSmall { needed: len, got })?;
        // Lengths below are bounded by `check` (IPv4 total <= 65535).
        let ip_payload_len = (self.ip_total_len() - ipv4::HEADER_LEN) as u16;

        let rest = EthRepr {
            dst: self.dst_mac,
            src: self.src_mac,
            ethertype: ETHERTYPE_IPV4,
        }
        .emit_prefix(frame)?;
        let rest = Ipv4Repr {
            src: self.src_ip,
            dst: self.dst_ip,
            tos: self.tos,
            identification: 0,
            dont_fragment: true,
            ttl: self.ttl,
            protocol: PROTOCOL_UDP,
            payload_len: ip_payload_len,
        }
        .emit_prefix(rest)?;
        let rest = UdpRepr {
            src_port: self.src_port,
            dst_port: ROCEV2_PORT,
            payload_len: ip_payload_len - udp::HEADER_LEN as u16,
        }
        .emit_prefix(rest)?;
        let (bth, rest) = split_header_mut::<Bth>(rest)?;
        self.bth.emit(bth);
        bth.set_pad_count(self.pad());
        let rest = self.ext.emit(rest)?;
        let start = len - rest.len();
        Ok(start..start + self.payload_len)
    }

    /// The last step of building a frame in place (after
    /// [`PacketRepr::emit_headers`] and the payload): zeroes the pad and
    /// writes the ICRC.
    pub fn seal(&self, out: &mut [u8]) -> Result<(), WireError> {
        let len = self.buffer_len();
        let got = out.len();
        let frame = out
            .get_mut(..len)
            .ok_or(WireError::BufferTooSmall { needed: len, got })?;
        let icrc_at = len - ICRC_LEN;
        frame[icrc_at - usize::from(self.pad())..icrc_at].fill(0);
        let (datagram, icrc_out) = frame[ETH_LEN..].split_at_mut(self.ip_total_len() - ICRC_LEN);
        let crc = icrc::compute(datagram)?;
        icrc_out.copy_from_slice(&crc.to_le_bytes());
        Ok(())
    }
}

/// A received frame that passed every check of [`RocePacket::parse`].
///
/// # Invariants
/// Every header is present and valid, the extension headers match the
/// opcode, the payload slice lies within the frame, and the ICRC matched.
#[derive(Debug, Clone, Copy)]
pub struct RocePacket<'a> {
    eth: &'a EthHeader,
    ip: &'a Ipv4Header,
    udp: &'a UdpHeader,
    bth: &'a Bth,
    repr: PacketRepr,
    payload: &'a [u8],
    icrc: u32,
    len: usize,
}

impl<'a> RocePacket<'a> {
    /// Validates a whole frame (see the module doc for the checks and
    /// their order).
    pub fn parse(frame: &'a [u8]) -> Result<Self, WireError> {
        let (eth, rest) = split_header::<EthHeader>(frame)?;
        if eth.ethertype.get() != ETHERTYPE_IPV4 {
            return Err(WireError::NotIpv4 {
                ethertype: eth.ethertype.get(),
            });
        }

        let (ip, rest) = split_header::<Ipv4Header>(rest)?;
        let ip_repr = Ipv4Repr::parse(ip)?;
        let ip_payload_len = usize::from(ip_repr.payload_len);
        // Bytes after the IPv4 datagram are Ethernet padding.
        let ip_payload = rest.get(..ip_payload_len).ok_or(WireError::BadLength {
            field: "ipv4.total_len",
            declared: ip_payload_len + ipv4::HEADER_LEN,
            available: rest.len() + ipv4::HEADER_LEN,
        })?;
        if ip_repr.protocol != PROTOCOL_UDP {
            return Err(WireError::NotUdp {
                protocol: ip_repr.protocol,
            });
        }

        let (udp, rest) = split_header::<UdpHeader>(ip_payload)?;
        let udp_repr = UdpRepr::parse(udp)?;
        if usize::from(udp_repr.payload_len) != rest.len() {
            return Err(WireError::BadLength {
                field: "udp.length",
                declared: usize::from(udp_repr.payload_len) + udp::HEADER_LEN,
                available: ip_payload_len,
            });
        }
        if udp_repr.dst_port != ROCEV2_PORT {
            return Err(WireError::NotRoce {
                port: udp_repr.dst_port,
            });
        }

        let (bth, rest) = split_header::<Bth>(rest)?;
        let bth_repr = BthRepr::parse(bth)?;
        let info = bth_repr.opcode.info();
        let (ext, rest) = ExtRepr::parse(info.ext, rest)?;

        let body_len = rest
            .len()
            .checked_sub(ICRC_LEN)
            .ok_or(WireError::Truncated {
                header: "ICRC",
                needed: ICRC_LEN,
                got: rest.len(),
            })?;
        let pad = bth.pad_count();
        if body_len % 4 != 0 || usize::from(pad) > body_len || (!info.payload && pad != 0) {
            return Err(WireError::BadPad {
                pad,
                bytes: body_len,
            });
        }
        let payload_len = body_len - usize::from(pad);
        if !info.payload && payload_len != 0 {
            return Err(WireError::UnexpectedPayload {
                opcode: info.name,
                len: payload_len,
            });
        }
        let payload = &rest[..payload_len];

        let datagram_len = ipv4::HEADER_LEN + ip_payload_len;
        let datagram = &frame[ETH_LEN..ETH_LEN + datagram_len];
        icrc::verify(datagram)?;
        let icrc = u32::from_le_bytes([
            rest[body_len],
            rest[body_len + 1],
            rest[body_len + 2],
            rest[body_len + 3],
        ]);

        Ok(Self {
            eth,
            ip,
            udp,
            bth,
            repr: PacketRepr {
                dst_mac: eth.dst,
                src_mac: eth.src,
                src_ip: ip_repr.src,
                dst_ip: ip_repr.dst,
                tos: ip_repr.tos,
                ttl: ip_repr.ttl,
                src_port: udp_repr.src_port,
                bth: bth_repr,
                ext,
                payload_len,
            },
            payload,
            icrc,
            len: ETH_LEN + datagram_len,
        })
    }

    /// The validated values of every header.
    pub const fn repr(&self) -> &PacketRepr {
        &self.repr
    }

    /// The payload, without pad.
    pub const fn payload(&self) -> &'a [u8] {
        self.payload
    }

    /// The frame's length without Ethernet padding.
    pub const fn len(&self) -> usize {
        self.len
    }

    /// Always false: a valid frame has headers.
    pub const fn is_empty(&self) -> bool {
        false
    }

    /// The ICRC the frame carries (and that matched).
    pub const fn icrc(&self) -> u32 {
        self.icrc
    }

    /// The Ethernet header.
    pub const fn eth_header(&self) -> &'a EthHeader {
        self.eth
    }

    /// The IPv4 header.
    pub const fn ipv4_header(&self) -> &'a Ipv4Header {
        self.ip
    }

    /// The UDP header.
    pub const fn udp_header(&self) -> &'a UdpHeader {
        self.udp
    }

    /// The BTH.
    pub const fn bth_header(&self) -> &'a Bth {
        self.bth
    }

    /// The opcode.
    pub const fn opcode(&self) -> Opcode {
        self.repr.bth.opcode
    }

    /// The opcode's table row.
    pub const fn info(&self) -> &'static OpcodeInfo {
        self.repr.bth.opcode.info()
    }

    /// The destination QP.
    pub const fn dest_qp(&self) -> Qpn {
        self.repr.bth.dest_qp
    }

    /// The packet sequence number.
    pub const fn psn(&self) -> Psn {
        self.repr.bth.psn
    }

    /// The partition key.
    pub const fn pkey(&self) -> PKey {
        self.repr.bth.pkey
    }

    /// The pad count.
    pub const fn pad(&self) -> u8 {
        self.repr.pad()
    }

    /// The Q_Key (UD only).
    pub const fn qkey(&self) -> Option<QKey> {
        match self.repr.ext.deth() {
            Some(d) => Some(d.qkey),
            None => None,
        }
    }

    /// The source QP (UD only).
    pub const fn src_qp(&self) -> Option<Qpn> {
        match self.repr.ext.deth() {
            Some(d) => Some(d.src_qp),
            None => None,
        }
    }

    /// The source IPv4 address.
    pub const fn src_ip(&self) -> Ipv4Addr {
        self.repr.src_ip
    }

    /// The destination IPv4 address.
    pub const fn dst_ip(&self) -> Ipv4Addr {
        self.repr.dst_ip
    }

    /// The extension headers.
    pub const fn ext(&self) -> &ExtRepr {
        &self.repr.ext
    }

    /// The DETH, if the opcode has one.
    pub const fn deth(&self) -> Option<&DethRepr> {
        self.repr.ext.deth()
    }

    /// The RETH, if the opcode has one.
    pub const fn reth(&self) -> Option<&RethRepr> {
        self.repr.ext.reth()
    }

    /// The AETH, if the opcode has one.
    pub const fn aeth(&self) -> Option<&AethRepr> {
        self.repr.ext.aeth()
    }

    /// The AtomicETH, if the opcode has one.
    pub const fn atomic_eth(&self) -> Option<&AtomicEthRepr> {
        self.repr.ext.atomic_eth()
    }

    /// The AtomicAckETH, if the opcode has one.
    pub const fn atomic_ack_eth(&self) -> Option<&AtomicAckEthRepr> {
        self.repr.ext.atomic_ack_eth()
    }

    /// The immediate data, if the opcode has it.
    pub const fn imm(&self) -> Option<Be32> {
        self.repr.ext.imm()
    }

    /// The R_Key to invalidate, if the opcode has an IETH.
    pub const fn invalidate_rkey(&self) -> Option<RKey> {
        self.repr.ext.ieth()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ext::{CreditCode, IethRepr, ImmDtRepr, Msn, NakCode, RnrTimer, Syndrome};
    use crate::wire::opcode::ExtLayout;
    use proptest::prelude::*;

    /// RC SEND ONLY WITH IMMEDIATE, written byte by byte from the layouts;
    /// the same datagram as the ICRC known-answer test, with its Ethernet
    /// header and its ICRC (0xb16961b3, little-endian) appended.
    const SEND_FRAME: [u8; 70] = [
        // Ethernet: dst, src, IPv4.
        0x02, 0x00, 0x0A, 0x00, 0x00, 0x02, 0x02, 0x00, 0x0A, 0x00, 0x00, 0x01, 0x08, 0x00,
        // IPv4: v4 IHL 5, TOS 0x6a, total 56, ID 0, DF, TTL 64, UDP,
        // checksum 0x2649, 10.0.0.1 -> 10.0.0.2.
        0x45, 0x6A, 0x00, 0x38, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x26, 0x49, 0x0A, 0x00, 0x00,
        0x01, 0x0A, 0x00, 0x00, 0x02, // UDP: 0xc123 -> 4791, length 36, no checksum.
        0xC1, 0x23, 0x12, 0xB7, 0x00, 0x24, 0x00, 0x00,
        // BTH: opcode 0x05, SE + PadCnt 3, P_Key ffff, DestQP 0x12, AckReq, PSN 1.
        0x05, 0xB0, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x12, 0x80, 0x00, 0x00, 0x01, // ImmDt.
        0xDE, 0xAD, 0xBE, 0xEF, // Payload "hello", pad.
        b'h', b'e', b'l', b'l', b'o', 0x00, 0x00, 0x00, // ICRC.
        0xB3, 0x61, 0x69, 0xB1,
    ];

    fn send_repr() -> PacketRepr {
        PacketRepr {
            dst_mac: MacAddr::for_ipv4(Ipv4Addr::new(10, 0, 0, 2)),
            src_mac: MacAddr::for_ipv4(Ipv4Addr::new(10, 0, 0, 1)),
            src_ip: Ipv4Addr::new(10, 0, 0, 1),
            dst_ip: Ipv4Addr::new(10, 0, 0, 2),
            tos: 0x6A,
            ttl: 64,
            src_port: 0xC123,
            bth: BthRepr {
                opcode: Opcode::RcSendOnlyWithImmediate,
                solicited: true,
                mig_req: false,
                pkey: PKey::DEFAULT,
                fecn: false,
                becn: false,
                dest_qp: Qpn::new(0x12).unwrap(),
                ack_req: true,
                psn: Psn::new(1).unwrap(),
            },
            ext: ExtRepr::ImmDt(ImmDtRepr {
                imm: Be32::new(0xDEAD_BEEF),
            }),
            payload_len: 5,
        }
    }

    fn ack_repr(syndrome: Syndrome) -> PacketRepr {
        PacketRepr {
            bth: BthRepr {
                opcode: Opcode::RcAcknowledge,
                solicited: false,
                ack_req: false,
                ..send_repr().bth
            },
            ext: ExtRepr::Aeth(AethRepr {
                syndrome,
                msn: Msn::new(7).unwrap(),
            }),
            payload_len: 0,
            ..send_repr()
        }
    }

    fn emit_vec(repr: &PacketRepr, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0xEE; repr.buffer_len()];
        assert_eq!(repr.emit(payload, &mut out), Ok(out.len()));
        out
    }

    /// Rewrites the IPv4 and UDP lengths to fit `frame`, then the IPv4
    /// checksum and the ICRC, so a test can damage one thing at a time.
    fn reseal(frame: &mut [u8]) {
        let ip_len = (frame.len() - ETH_LEN) as u16;
        frame[16..18].copy_from_slice(&ip_len.to_be_bytes());
        frame[38..40].copy_from_slice(&(ip_len - 20).to_be_bytes());
        frame[24..26].fill(0);
        let sum = ipv4::checksum(&frame[14..34]);
        frame[24..26].copy_from_slice(&sum.to_be_bytes());
        let end = frame.len() - ICRC_LEN;
        if let Ok(crc) = icrc::compute(&frame[ETH_LEN..end]) {
            frame[end..].copy_from_slice(&crc.to_le_bytes());
        }
    }

    #[test]
    fn send_literal_parses() {
        let p = RocePacket::parse(&SEND_FRAME).unwrap();
        assert_eq!(p.repr(), &send_repr());
        assert_eq!(p.payload(), b"hello");
        assert_eq!(p.opcode(), Opcode::RcSendOnlyWithImmediate);
        assert_eq!(p.dest_qp().get(), 0x12);
        assert_eq!(p.psn().get(), 1);
        assert_eq!(p.pkey(), PKey::DEFAULT);
        assert_eq!(p.pad(), 3);
        assert_eq!(p.imm(), Some(Be32::new(0xDEAD_BEEF)));
        assert_eq!(p.icrc(), 0xB169_61B3);
        assert_eq!(p.len(), SEND_FRAME.len());
        assert_eq!(
            (p.reth(), p.aeth(), p.deth(), p.qkey()),
            (None, None, None, None)
        );
        assert_eq!(p.src_ip(), Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(p.ipv4_header().ttl, 64);
        assert_eq!(p.udp_header().dst_port.get(), ROCEV2_PORT);
        assert!(p.bth_header().solicited());
        assert!(p.info().has_immediate());
    }

    #[test]
    fn send_literal_emits() {
        assert_eq!(send_repr().buffer_len(), SEND_FRAME.len());
        assert_eq!(emit_vec(&send_repr(), b"hello"), SEND_FRAME);
    }

    #[test]
    fn ud_literal_round_trip() {
        // UD SEND ONLY to QP1 with the GSI Q_Key: DETH after the BTH.
        let repr = PacketRepr {
            bth: BthRepr {
                opcode: Opcode::UdSendOnly,
                dest_qp: Qpn::GSI,
                ..send_repr().bth
            },
            ext: ExtRepr::Deth(DethRepr {
                qkey: QKey::GSI,
                src_qp: Qpn::new(0x2A).unwrap(),
            }),
            payload_len: 4,
            ..send_repr()
        };
        let frame = emit_vec(&repr, b"MADs");
        assert_eq!(&frame[42..46], &[0x64, 0x80, 0xFF, 0xFF]); // opcode, SE, P_Key
        assert_eq!(
            &frame[54..62],
            &[0x80, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2A]
        );
        let p = RocePacket::parse(&frame).unwrap();
        assert_eq!(p.qkey(), Some(QKey::GSI));
        assert_eq!(p.src_qp(), Qpn::new(0x2A).ok());
        assert_eq!(p.payload(), b"MADs");
    }

    #[test]
    fn ethernet_padding_is_ignored() {
        // The smallest RoCEv2 frame (an ACK, 62 bytes) padded as a NIC would
        // pad a short frame.
        let mut frame = emit_vec(
            &ack_repr(Syndrome::Ack {
                credits: CreditCode::NONE,
            }),
            &[],
        );
        assert_eq!(frame.len(), 62);
        frame.extend_from_slice(&[0; 4]);
        let p = RocePacket::parse(&frame).unwrap();
        assert_eq!(p.len(), 62);
        assert_eq!(p.aeth().unwrap().msn.get(), 7);
    }

    /// A damage to a valid frame, whether to [`reseal`] after it, and the
    /// error it must produce.
    type Case = (&'static str, fn(&mut Vec<u8>), bool, fn(&WireError) -> bool);

    #[test]
    fn each_check_rejects_its_damage() {
        let cases: &[Case] = &[
            (
                "vlan tag",
                |f| f[12..14].copy_from_slice(&[0x81, 0x00]),
                false,
                |e| matches!(e, WireError::NotIpv4 { ethertype: 0x8100 }),
            ),
            (
                "ip version",
                |f| f[14] = 0x65,
                true,
                |e| matches!(e, WireError::BadIpVersion { .. }),
            ),
            (
                "ip options",
                |f| f[14] = 0x46,
                true,
                |e| matches!(e, WireError::Ipv4Options { ihl: 6 }),
            ),
            (
                "ip checksum",
                |f| f[25] ^= 0xFF,
                false,
                |e| matches!(e, WireError::BadIpChecksum),
            ),
            (
                "ttl changed without checksum",
                |f| f[22] = 1,
                false,
                |e| matches!(e, WireError::BadIpChecksum),
            ),
            (
                "fragment",
                |f| f[20] = 0x20,
                false,
                |e| matches!(e, WireError::BadIpChecksum),
            ),
            (
                "fragment, sealed",
                |f| {
                    f[20] = 0x20;
                    reseal_ip_only(f)
                },
                false,
                |e| matches!(e, WireError::Fragmented),
            ),
            (
                "ip total beyond frame",
                |f| {
                    f[17] += 1;
                    reseal_ip_only(f)
                },
                false,
                |e| {
                    matches!(
                        e,
                        WireError::BadLength {
                            field: "ipv4.total_len",
                            ..
                        }
                    )
                },
            ),
            (
                "tcp",
                |f| {
                    f[23] = 6;
                    reseal_ip_only(f)
                },
                false,
                |e| matches!(e, WireError::NotUdp { protocol: 6 }),
            ),
            (
                "udp length",
                |f| f[39] -= 4,
                false,
                |e| {
                    matches!(
                        e,
                        WireError::BadLength {
                            field: "udp.length",
                            ..
                        }
                    )
                },
            ),
            (
                "udp length below header",
                |f| f[38..40].copy_from_slice(&[0, 4]),
                false,
                |e| {
                    matches!(
                        e,
                        WireError::BadLength {
                            field: "udp.length",
                            ..
                        }
                    )
                },
            ),
            (
                "port",
                |f| f[37] = 0xB8,
                true,
                |e| matches!(e, WireError::NotRoce { port: 4792 }),
            ),
            (
                "tver",
                |f| f[43] |= 0x01,
                true,
                |e| matches!(e, WireError::BadTver { tver: 1 }),
            ),
            (
                "opcode",
                |f| f[42] = 0x15,
                true,
                |e| matches!(e, WireError::UnknownOpcode { opcode: 0x15 }),
            ),
            (
                "opcode needing a RETH",
                |f| {
                    f[42] = 0x0A;
                    f.truncate(58);
                    f.extend([0; 4])
                },
                true,
                |e| {
                    matches!(
                        e,
                        WireError::Truncated {
                            header: "RethHeader",
                            ..
                        }
                    )
                },
            ),
            (
                "no room for the ICRC",
                |f| f.truncate(60),
                true,
                |e| matches!(e, WireError::Truncated { header: "ICRC", .. }),
            ),
            (
                "unaligned payload",
                |f| f.truncate(69),
                true,
                |e| matches!(e, WireError::BadPad { pad: 3, bytes: 7 }),
            ),
            (
                "payload without pad is fine",
                |f| f[43] &= !0x30,
                true,
                |_| false,
            ),
            (
                "icrc",
                |f| f[69] ^= 0x80,
                false,
                |e| matches!(e, WireError::BadIcrc { .. }),
            ),
            (
                "payload byte",
                |f| f[62] = b'j',
                false,
                |e| matches!(e, WireError::BadIcrc { .. }),
            ),
            (
                "bth reserved bits are covered",
                |f| f[50] |= 0x01,
                false,
                |e| matches!(e, WireError::BadIcrc { .. }),
            ),
        ];
        for (what, damage, seal, expected) in cases {
            let mut frame = SEND_FRAME.to_vec();
            damage(&mut frame);
            if *seal {
                reseal(&mut frame);
            }
            match RocePacket::parse(&frame) {
                Err(e) => assert!(expected(&e), "{what}: unexpected {e:?}"),
                Ok(p) => assert_eq!(
                    *what, "payload without pad is fine",
                    "{what}: accepted {p:?}"
                ),
            }
        }
    }

    /// Recomputes only the IPv4 header checksum.
    fn reseal_ip_only(frame: &mut [u8]) {
        frame[24..26].fill(0);
        let sum = ipv4::checksum(&frame[14..34]);
        frame[24..26].copy_from_slice(&sum.to_be_bytes());
    }

    #[test]
    fn responses_without_payload() {
        let mut frame = emit_vec(&ack_repr(Syndrome::Nak(NakCode::RemoteAccessError)), &[]);
        let p = RocePacket::parse(&frame).unwrap();
        assert_eq!(
            p.aeth().unwrap().syndrome,
            Syndrome::Nak(NakCode::RemoteAccessError)
        );
        assert_eq!(p.payload(), b"");

        // Reserved syndrome 0x45.
        frame[54] = 0x45;
        reseal(&mut frame);
        assert_eq!(
            RocePacket::parse(&frame).unwrap_err(),
            WireError::BadSyndrome { syndrome: 0x45 }
        );

        // Four bytes of "payload" on an ACK.
        let mut frame = emit_vec(
            &ack_repr(Syndrome::Ack {
                credits: CreditCode::NONE,
            }),
            &[],
        );
        frame.splice(58..58, [1, 2, 3, 4]);
        reseal(&mut frame);
        assert!(matches!(
            RocePacket::parse(&frame),
            Err(WireError::UnexpectedPayload { len: 4, .. })
        ));
        // A pad count on an ACK.
        frame.drain(58..62);
        frame[43] |= 0x10;
        reseal(&mut frame);
        assert!(matches!(
            RocePacket::parse(&frame),
            Err(WireError::BadPad { pad: 1, .. })
        ));
    }

    #[test]
    fn emit_rejects_inconsistent_reprs() {
        let repr = send_repr();
        let mut out = [0u8; 128];
        assert_eq!(
            repr.emit(b"hell", &mut out),
            Err(WireError::PayloadMismatch {
                declared: 5,
                got: 4
            })
        );
        let wrong_ext = PacketRepr {
            ext: ExtRepr::None,
            ..repr
        };
        assert!(matches!(
            wrong_ext.emit(b"hello", &mut out),
            Err(WireError::ExtMismatch {
                expected: "ImmDt",
                got: "none",
                ..
            })
        ));
        let ack_with_payload = PacketRepr {
            payload_len: 1,
            ..ack_repr(Syndrome::Ack {
                credits: CreditCode::NONE,
            })
        };
        assert!(matches!(
            ack_with_payload.emit(b"x", &mut out),
            Err(WireError::UnexpectedPayload { len: 1, .. })
        ));
        assert_eq!(
            repr.emit(b"hello", &mut out[..69]),
            Err(WireError::BufferTooSmall {
                needed: 70,
                got: 69
            })
        );
        let huge = PacketRepr {
            payload_len: 65_500,
            ..repr
        };
        assert!(matches!(
            huge.emit(&[0; 65_500], &mut [0; 1]),
            Err(WireError::TooLong { .. })
        ));
        // The largest payload that fits behind IPv4, UDP, BTH and ImmDt:
        // payload + pad + ICRC <= 65535 - 44, payload + pad a multiple of 4.
        let max_payload = 65_484;
        let one_more = PacketRepr {
            payload_len: max_payload + 1,
            ..repr
        };
        assert!(matches!(
            one_more.emit(&vec![0; max_payload + 1], &mut out),
            Err(WireError::TooLong { len: 65_536 })
        ));
        let biggest = PacketRepr {
            payload_len: max_payload,
            ..repr
        };
        assert_eq!(biggest.ip_total_len(), 65_532);
        let payload = vec![0x5A; max_payload];
        let frame = emit_vec(&biggest, &payload);
        assert_eq!(RocePacket::parse(&frame).unwrap().payload(), &payload[..]);
    }

    #[test]
    fn pad_for_each_residue() {
        assert_eq!([0, 1, 2, 3, 4, 5].map(pad_for), [0, 3, 2, 1, 0, 3]);
    }

    // ---- Property tests ----

    fn arb_syndrome() -> impl Strategy<Value = Syndrome> {
        prop_oneof![
            (0u8..32).prop_map(|c| Syndrome::Ack {
                credits: CreditCode::new(c).unwrap()
            }),
            (0u8..32).prop_map(|t| Syndrome::RnrNak {
                timer: RnrTimer::new(t).unwrap()
            }),
            proptest::sample::select(NakCode::ALL).prop_map(Syndrome::Nak),
        ]
    }

    fn arb_ext(layout: ExtLayout) -> impl Strategy<Value = ExtRepr> {
        let reth = (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(|(va, k, len)| RethRepr {
            va,
            rkey: RKey::new(k),
            dma_len: len,
        });
        let imm = any::<u32>().prop_map(|i| ImmDtRepr { imm: Be32::new(i) });
        let aeth = (arb_syndrome(), 0u32..1 << 24).prop_map(|(syndrome, msn)| AethRepr {
            syndrome,
            msn: Msn::from_low_bits(msn),
        });
        let deth = (any::<u32>(), 0u32..1 << 24).prop_map(|(q, s)| DethRepr {
            qkey: QKey::new(q),
            src_qp: Qpn::from_low_bits(s),
        });
        let atomic = (any::<u64>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
            |(va, k, swap_add, compare)| AtomicEthRepr {
                va,
                rkey: RKey::new(k),
                swap_add,
                compare,
            },
        );
        let ack = any::<u64>().prop_map(|o| AtomicAckEthRepr {
            orig_remote_data: o,
        });
        let ieth = any::<u32>().prop_map(|k| IethRepr { rkey: RKey::new(k) });
        (reth, imm, aeth, deth, atomic, ack, ieth).prop_map(
            move |(reth, imm, aeth, deth, atomic, ack, ieth)| match layout {
                ExtLayout::None => ExtRepr::None,
                ExtLayout::ImmDt => ExtRepr::ImmDt(imm),
                ExtLayout::Reth => ExtRepr::Reth(reth),
                ExtLayout::RethImmDt => ExtRepr::RethImmDt(reth, imm),
                ExtLayout::Ieth => ExtRepr::Ieth(ieth),
                ExtLayout::Aeth => ExtRepr::Aeth(aeth),
                ExtLayout::AethAtomicAckEth => ExtRepr::AethAtomicAckEth(aeth, ack),
                ExtLayout::AtomicEth => ExtRepr::AtomicEth(atomic),
                ExtLayout::Deth => ExtRepr::Deth(deth),
                ExtLayout::DethImmDt => ExtRepr::DethImmDt(deth, imm),
            },
        )
    }

    fn arb_bth(opcode: Opcode) -> impl Strategy<Value = BthRepr> {
        (
            any::<[bool; 5]>(),
            any::<u16>(),
            0u32..1 << 24,
            0u32..1 << 24,
        )
            .prop_map(
                move |([solicited, mig_req, fecn, becn, ack_req], pkey, qp, psn)| BthRepr {
                    opcode,
                    solicited,
                    mig_req,
                    pkey: PKey::new(pkey),
                    fecn,
                    becn,
                    dest_qp: Qpn::from_low_bits(qp),
                    ack_req,
                    psn: Psn::from_low_bits(psn),
                },
            )
    }

    /// A valid packet and its payload.
    fn arb_packet() -> impl Strategy<Value = (PacketRepr, Vec<u8>)> {
        proptest::sample::select(Opcode::ALL).prop_flat_map(|opcode| {
            let info = opcode.info();
            let max_payload = if info.payload { 300 } else { 0 };
            (
                any::<([u8; 6], [u8; 6], [u8; 4], [u8; 4])>(),
                any::<(u8, u8, u16)>(),
                arb_bth(opcode),
                arb_ext(info.ext),
                proptest::collection::vec(any::<u8>(), 0..=max_payload),
            )
                .prop_map(|((dm, sm, si, di), (tos, ttl, port), bth, ext, payload)| {
                    let repr = PacketRepr {
                        dst_mac: MacAddr(dm),
                        src_mac: MacAddr(sm),
                        src_ip: si.into(),
                        dst_ip: di.into(),
                        tos,
                        ttl,
                        src_port: port,
                        bth,
                        ext,
                        payload_len: payload.len(),
                    };
                    (repr, payload)
                })
        })
    }

    /// Frame offsets of the bytes no check covers: the MAC addresses (an
    /// Ethernet FCS would), the UDP checksum (ignored) and the BTH
    /// FECN/BECN byte (variant, masked in the ICRC).
    fn uncovered(offset: usize) -> bool {
        offset < 12 || offset == 40 || offset == 41 || offset == ETH_LEN + 20 + 8 + 4
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn emit_then_parse_is_identity((repr, payload) in arb_packet()) {
            let frame = emit_vec(&repr, &payload);
            let p = RocePacket::parse(&frame).unwrap();
            prop_assert_eq!(p.repr(), &repr);
            prop_assert_eq!(p.payload(), &payload[..]);
            prop_assert_eq!(p.len(), frame.len());
            // And re-emitting the parsed repr reproduces the bytes.
            prop_assert_eq!(emit_vec(p.repr(), p.payload()), frame);
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = RocePacket::parse(&bytes);
        }

        #[test]
        fn parse_never_panics_on_plausible_prefixes(
            bytes in proptest::collection::vec(any::<u8>(), 0..120),
            opcode in any::<u8>(),
        ) {
            // Keep the frame past the early checks so the later ones run.
            let mut frame = SEND_FRAME[..42].to_vec();
            frame.push(opcode);
            frame.extend_from_slice(&bytes);
            let _ = RocePacket::parse(&frame);
            if frame.len() >= 58 {
                reseal(&mut frame);
                let _ = RocePacket::parse(&frame);
            }
        }

        #[test]
        fn single_byte_flip_is_caught(
            (repr, payload) in arb_packet(),
            at in any::<prop::sample::Index>(),
            xor in 1u8..=255,
        ) {
            let mut frame = emit_vec(&repr, &payload);
            let offset = at.index(frame.len());
            frame[offset] ^= xor;
            let result = RocePacket::parse(&frame);
            if uncovered(offset) {
                prop_assert!(result.is_ok(), "offset {offset}: {result:?}");
            } else {
                prop_assert!(result.is_err(), "offset {offset} accepted");
            }
            let payload_start = BASE_HEADERS_LEN + repr.ext.buffer_len();
            if (payload_start..payload_start + repr.payload_len).contains(&offset) {
                let bad_icrc = matches!(result, Err(WireError::BadIcrc { .. }));
                prop_assert!(bad_icrc, "payload flip at {}: {:?}", offset, result);
            }
        }

        #[test]
        fn many_flips_and_cuts_never_panic(
            (repr, payload) in arb_packet(),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut frame = emit_vec(&repr, &payload);
            for (at, xor) in flips {
                let i = at.index(frame.len());
                frame[i] ^= xor;
            }
            let _ = RocePacket::parse(&frame);
            let len = cut.index(frame.len());
            prop_assert!(RocePacket::parse(&frame[..len]).is_err() || len == frame.len());
        }
    }
}
