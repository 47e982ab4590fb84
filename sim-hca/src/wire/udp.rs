//! The UDP header (RFC 768) as RoCEv2 uses it.
//!
//! Contract: the destination port is [`ROCEV2_PORT`] (checked by the packet
//! layer); the source port carries flow entropy, so switches that hash on
//! the 5-tuple spread different QPs over different paths
//! ([`flow_source_port`]); the checksum is sent as 0 (allowed for IPv4, and
//! RoCEv2 relies on the ICRC instead) and ignored on receive, since the ICRC
//! masks it out. [`UdpRepr::parse`] checks only that the length field covers
//! the header; whether it fits the IP payload is the packet layer's check.

use ib_types::abi::Be16;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::{HeaderRepr, WireError, assert_layout};

/// The IANA-assigned RoCEv2 destination port.
pub const ROCEV2_PORT: u16 = 4791;
/// The UDP header length.
pub const HEADER_LEN: usize = 8;

/// The UDP header.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct UdpHeader {
    /// Source port.
    pub src_port: Be16,
    /// Destination port.
    pub dst_port: Be16,
    /// Header plus payload, in bytes.
    pub length: Be16,
    /// Checksum; 0 means "not computed".
    pub checksum: Be16,
}
assert_layout!(UdpHeader, size = 8, src_port @ 0, dst_port @ 2, length @ 4, checksum @ 6);

/// A validated UDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UdpRepr {
    /// Source port (flow entropy for RoCEv2).
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Bytes after the header (length - 8).
    pub payload_len: u16,
}

impl UdpRepr {
    /// The length field this header declares, or [`WireError::TooLong`].
    pub fn length(&self) -> Result<u16, WireError> {
        let len = usize::from(self.payload_len) + HEADER_LEN;
        u16::try_from(len).map_err(|_| WireError::TooLong { len })
    }
}

impl HeaderRepr for UdpRepr {
    type Header = UdpHeader;

    fn parse(header: &UdpHeader) -> Result<Self, WireError> {
        let len = usize::from(header.length.get());
        let payload_len = len.checked_sub(HEADER_LEN).ok_or(WireError::BadLength {
            field: "udp.length",
            declared: len,
            available: HEADER_LEN,
        })?;
        Ok(Self {
            src_port: header.src_port.get(),
            dst_port: header.dst_port.get(),
            // len <= u16::MAX.
            payload_len: payload_len as u16,
        })
    }

    /// Writes the header with a zero checksum. A payload length too large
    /// for the 16-bit length saturates; [`UdpRepr::length`] reports it.
    fn emit(&self, header: &mut UdpHeader) {
        *header = UdpHeader {
            src_port: Be16::new(self.src_port),
            dst_port: Be16::new(self.dst_port),
            length: Be16::new(self.length().unwrap_or(u16::MAX)),
            checksum: Be16::ZERO,
        };
    }
}

/// A RoCEv2 source port from a flow hash: the low 14 bits of `entropy` in
/// the dynamic port range 0xC000..=0xFFFF, so packets of one flow (one QP
/// pair) keep one port and different flows spread.
pub const fn flow_source_port(entropy: u32) -> u16 {
    0xC000 | (entropy as u16 & 0x3FFF)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testing::assert_literal;

    #[test]
    fn header_literal() {
        let bytes = [
            0xC1, 0x23, // source port 49443
            0x12, 0xB7, // destination port 4791
            0x00, 0x28, // length 40
            0x00, 0x00, // no checksum
        ];
        assert_literal(
            &bytes,
            &UdpRepr {
                src_port: 0xC123,
                dst_port: ROCEV2_PORT,
                payload_len: 32,
            },
        );
    }

    #[test]
    fn checksum_is_ignored_on_receive() {
        let bytes = [0xC1, 0x23, 0x12, 0xB7, 0x00, 0x28, 0xAB, 0xCD];
        let (repr, _) = UdpRepr::parse_prefix(&bytes).unwrap();
        assert_eq!(repr.payload_len, 32);
    }

    #[test]
    fn length_below_header_is_rejected() {
        let bytes = [0xC1, 0x23, 0x12, 0xB7, 0x00, 0x07, 0, 0];
        assert!(matches!(
            UdpRepr::parse_prefix(&bytes),
            Err(WireError::BadLength {
                field: "udp.length",
                ..
            })
        ));
    }

    #[test]
    fn flow_ports_stay_in_the_dynamic_range() {
        assert_eq!(flow_source_port(0), 0xC000);
        assert_eq!(flow_source_port(u32::MAX), 0xFFFF);
        assert_eq!(flow_source_port(0x1234_5678), 0xC000 | 0x1678);
    }
}
