//! The IPv4 header (RFC 791) as RoCEv2 uses it: 20 bytes, no options, never
//! fragmented.
//!
//! Contract: [`Ipv4Repr::parse`] accepts a header only if the version is 4,
//! IHL is 5 (options are unsupported, not skipped), the RFC 1071 checksum
//! verifies, it is not a fragment (MF clear, offset 0) and the total length
//! covers at least the header. The reserved flag bit is ignored on receive
//! and sent as zero. Whether the total length fits the frame, and whether the
//! protocol is UDP, is the packet layer's check.

use core::net::Ipv4Addr;

use ib_types::abi::Be16;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::{HeaderRepr, WireError, assert_layout};

/// The IP protocol number of UDP.
pub const PROTOCOL_UDP: u8 = 17;
/// The only header length supported: 20 bytes (IHL 5).
pub const HEADER_LEN: usize = 20;
/// The largest IPv4 datagram (total length is a 16-bit field).
pub const MAX_TOTAL_LEN: usize = u16::MAX as usize;

/// Flags/fragment field: Don't Fragment.
const FLAG_DF: u16 = 0x4000;
/// Flags/fragment field: More Fragments.
const FLAG_MF: u16 = 0x2000;
/// Flags/fragment field: the 13-bit fragment offset.
const FRAG_OFFSET_MASK: u16 = 0x1FFF;

/// The IPv4 header without options.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct Ipv4Header {
    /// Version (high nibble) and IHL in 32-bit words (low nibble).
    pub version_ihl: u8,
    /// Type of service: DSCP (high 6 bits) and ECN (low 2 bits).
    pub tos: u8,
    /// Header plus payload, in bytes.
    pub total_len: Be16,
    /// Identification.
    pub identification: Be16,
    /// Reserved, DF and MF flags (high 3 bits), fragment offset (low 13).
    pub flags_fragment: Be16,
    /// Time to live.
    pub ttl: u8,
    /// The payload's protocol.
    pub protocol: u8,
    /// RFC 1071 checksum of the header.
    pub checksum: Be16,
    /// Source address.
    pub src: [u8; 4],
    /// Destination address.
    pub dst: [u8; 4],
}
assert_layout!(
    Ipv4Header,
    size = 20,
    version_ihl @ 0,
    tos @ 1,
    total_len @ 2,
    identification @ 4,
    flags_fragment @ 6,
    ttl @ 8,
    protocol @ 9,
    checksum @ 10,
    src @ 12,
    dst @ 16,
);

impl Ipv4Header {
    /// The version nibble.
    pub const fn version(&self) -> u8 {
        self.version_ihl >> 4
    }

    /// The header length in 32-bit words.
    pub const fn ihl(&self) -> u8 {
        self.version_ihl & 0x0F
    }

    /// Differentiated services code point.
    pub const fn dscp(&self) -> u8 {
        self.tos >> 2
    }

    /// Explicit congestion notification codepoint.
    pub const fn ecn(&self) -> u8 {
        self.tos & 0x03
    }

    /// The DF flag.
    pub fn dont_fragment(&self) -> bool {
        self.flags_fragment.get() & FLAG_DF != 0
    }

    /// The MF flag.
    pub fn more_fragments(&self) -> bool {
        self.flags_fragment.get() & FLAG_MF != 0
    }

    /// The fragment offset, in 8-byte units.
    pub fn fragment_offset(&self) -> u16 {
        self.flags_fragment.get() & FRAG_OFFSET_MASK
    }

    /// Source address.
    pub const fn src_addr(&self) -> Ipv4Addr {
        let [a, b, c, d] = self.src;
        Ipv4Addr::new(a, b, c, d)
    }

    /// Destination address.
    pub const fn dst_addr(&self) -> Ipv4Addr {
        let [a, b, c, d] = self.dst;
        Ipv4Addr::new(a, b, c, d)
    }

    /// True if the checksum field verifies (the one's complement sum over the
    /// header, checksum included, is all ones).
    pub fn checksum_ok(&self) -> bool {
        checksum(self.as_bytes()) == 0
    }

    /// Recomputes and stores the checksum.
    pub fn fill_checksum(&mut self) {
        self.checksum = Be16::ZERO;
        self.checksum = Be16::new(checksum(self.as_bytes()));
    }
}

/// The Internet checksum of RFC 1071: the one's complement of the one's
/// complement sum of the 16-bit big-endian words of `bytes` (an odd final
/// byte is padded with zero).
pub fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut words = bytes.chunks_exact(2);
    for word in &mut words {
        sum += u32::from(u16::from_be_bytes([word[0], word[1]]));
    }
    if let [last] = words.remainder() {
        sum += u32::from(*last) << 8;
    }
    // Fold the carries back in (end-around carry); two folds suffice for
    // any input under 128 KiB, loop for the rest.
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

/// A validated IPv4 header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Repr {
    /// Source address.
    pub src: Ipv4Addr,
    /// Destination address.
    pub dst: Ipv4Addr,
    /// Type of service byte (DSCP << 2 | ECN).
    pub tos: u8,
    /// Identification (any value: RoCEv2 datagrams are atomic, RFC 6864).
    pub identification: u16,
    /// The DF flag.
    pub dont_fragment: bool,
    /// Time to live.
    pub ttl: u8,
    /// The payload's protocol.
    pub protocol: u8,
    /// Bytes after the header (total length - 20).
    pub payload_len: u16,
}

impl Ipv4Repr {
    /// The total length this header declares, or [`WireError::TooLong`].
    pub fn total_len(&self) -> Result<u16, WireError> {
        let total = usize::from(self.payload_len) + HEADER_LEN;
        u16::try_from(total).map_err(|_| WireError::TooLong { len: total })
    }
}

impl HeaderRepr for Ipv4Repr {
    type Header = Ipv4Header;

    fn parse(header: &Ipv4Header) -> Result<Self, WireError> {
        if header.version() != 4 {
            return Err(WireError::BadIpVersion {
                version: header.version(),
            });
        }
        match header.ihl() {
            5 => {}
            ihl @ 6.. => return Err(WireError::Ipv4Options { ihl }),
            ihl => {
                return Err(WireError::BadLength {
                    field: "ipv4.ihl",
                    declared: usize::from(ihl) * 4,
                    available: HEADER_LEN,
                });
            }
        }
        if !header.checksum_ok() {
            return Err(WireError::BadIpChecksum);
        }
        if header.more_fragments() || header.fragment_offset() != 0 {
            return Err(WireError::Fragmented);
        }
        let total = usize::from(header.total_len.get());
        let payload_len = total.checked_sub(HEADER_LEN).ok_or(WireError::BadLength {
            field: "ipv4.total_len",
            declared: total,
            available: HEADER_LEN,
        })?;
        Ok(Self {
            src: header.src_addr(),
            dst: header.dst_addr(),
            tos: header.tos,
            identification: header.identification.get(),
            dont_fragment: header.dont_fragment(),
            ttl: header.ttl,
            protocol: header.protocol,
            // total <= u16::MAX, so the difference fits.
            payload_len: payload_len as u16,
        })
    }

    /// Writes the header and its checksum. A payload length too large for a
    /// 16-bit total length saturates; [`Ipv4Repr::total_len`] reports it.
    fn emit(&self, header: &mut Ipv4Header) {
        let total = self.total_len().unwrap_or(u16::MAX);
        *header = Ipv4Header {
            version_ihl: 0x45,
            tos: self.tos,
            total_len: Be16::new(total),
            identification: Be16::new(self.identification),
            flags_fragment: Be16::new(if self.dont_fragment { FLAG_DF } else { 0 }),
            ttl: self.ttl,
            protocol: self.protocol,
            checksum: Be16::ZERO,
            src: self.src.octets(),
            dst: self.dst.octets(),
        };
        header.fill_checksum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::split_header;
    use crate::wire::testing::assert_literal;

    /// A RoCEv2 IPv4 header: 10.0.0.1 -> 10.0.0.2, DSCP 26 ECN 10 (ECT(0)),
    /// total length 60, ID 0x1234, DF, TTL 64, UDP. Checksum worked by hand:
    /// 456a+003c+1234+4000+4011+0a00+0001+0a00+0002 = ebee (no carry),
    /// complement 1411.
    const LITERAL: [u8; 20] = [
        0x45, 0x6A, 0x00, 0x3C, // version 4, IHL 5; TOS; total length 60
        0x12, 0x34, 0x40, 0x00, // identification; DF, offset 0
        0x40, 0x11, 0x14, 0x11, // TTL 64; UDP; checksum
        0x0A, 0x00, 0x00, 0x01, // source
        0x0A, 0x00, 0x00, 0x02, // destination
    ];

    fn literal_repr() -> Ipv4Repr {
        Ipv4Repr {
            src: Ipv4Addr::new(10, 0, 0, 1),
            dst: Ipv4Addr::new(10, 0, 0, 2),
            tos: 0x6A,
            identification: 0x1234,
            dont_fragment: true,
            ttl: 64,
            protocol: PROTOCOL_UDP,
            payload_len: 40,
        }
    }

    #[test]
    fn header_literal() {
        assert_literal(&LITERAL, &literal_repr());
        let (h, _) = split_header::<Ipv4Header>(&LITERAL).unwrap();
        assert_eq!((h.dscp(), h.ecn()), (26, 2));
        assert_eq!(h.checksum.get(), 0x1411);
    }

    #[test]
    fn rfc1071_example() {
        // RFC 1071 section 3: the words 0001 f203 f4f5 f6f7 sum to ddf2
        // (after the end-around carry); the checksum is its complement.
        assert_eq!(
            checksum(&[0x00, 0x01, 0xF2, 0x03, 0xF4, 0xF5, 0xF6, 0xF7]),
            !0xDDF2
        );
        // Odd length: the last byte is the high half of a zero-padded word.
        assert_eq!(checksum(&[0x01]), !0x0100);
        assert_eq!(checksum(&[]), 0xFFFF);
    }

    #[test]
    fn rejections() {
        /// A damage, whether to re-seal the checksum after it, and the
        /// error it must produce.
        type Case = (fn(&mut [u8; 20]), bool, fn(&WireError) -> bool);
        let cases: &[Case] = &[
            (
                |b| b[0] = 0x65,
                true,
                |e| matches!(e, WireError::BadIpVersion { version: 6 }),
            ),
            (
                |b| b[0] = 0x46,
                true,
                |e| matches!(e, WireError::Ipv4Options { ihl: 6 }),
            ),
            (
                |b| b[0] = 0x44,
                true,
                |e| matches!(e, WireError::BadLength { .. }),
            ),
            (
                |b| b[11] ^= 1,
                false,
                |e| matches!(e, WireError::BadIpChecksum),
            ),
            (
                |b| b[8] = 63,
                false,
                |e| matches!(e, WireError::BadIpChecksum),
            ),
            (
                |b| b[6] = 0x20,
                true,
                |e| matches!(e, WireError::Fragmented),
            ),
            (
                |b| b[7] = 0x01,
                true,
                |e| matches!(e, WireError::Fragmented),
            ),
            (
                |b| b[2..4].copy_from_slice(&[0, 19]),
                true,
                |e| matches!(e, WireError::BadLength { .. }),
            ),
        ];
        for (corrupt, reseal, expected) in cases {
            let mut bytes = LITERAL;
            corrupt(&mut bytes);
            if *reseal {
                let (h, _) = Ipv4Header::mut_from_prefix(&mut bytes).unwrap();
                h.fill_checksum();
            }
            let err = Ipv4Repr::parse_prefix(&bytes).unwrap_err();
            assert!(expected(&err), "unexpected {err:?}");
        }
    }

    #[test]
    fn reserved_flag_is_ignored() {
        let mut bytes = LITERAL;
        bytes[6] |= 0x80;
        let (h, _) = Ipv4Header::mut_from_prefix(&mut bytes).unwrap();
        h.fill_checksum();
        assert_eq!(Ipv4Repr::parse_prefix(&bytes).unwrap().0, literal_repr());
    }

    #[test]
    fn oversized_payload_is_reported() {
        let repr = Ipv4Repr {
            payload_len: u16::MAX,
            ..literal_repr()
        };
        assert!(matches!(repr.total_len(), Err(WireError::TooLong { .. })));
    }
}
