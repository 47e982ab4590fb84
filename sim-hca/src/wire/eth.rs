//! Ethernet II framing and MAC addresses.
//!
//! Contract: [`EthHeader`] is the 14-byte Ethernet II header (destination,
//! source, ethertype; no 802.1Q tag, no FCS). [`EthRepr`] holds any ethertype;
//! the packet layer rejects everything but [`ETHERTYPE_IPV4`].
//!
//! Address resolution: the simulated fabric has no ARP. A port's MAC address
//! is a function of its IPv4 address ([`MacAddr::for_ipv4`]), so a sender
//! derives the destination MAC from the destination IP
//! ([`MacAddr::for_ip_destination`]) and a capture still shows consistent,
//! readable addresses.

use core::fmt;
use core::net::Ipv4Addr;

use ib_types::abi::Be16;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::{HeaderRepr, WireError, assert_layout};

/// The ethertype of IPv4.
pub const ETHERTYPE_IPV4: u16 = 0x0800;

/// A 48-bit IEEE MAC address, in transmission order.
#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(transparent)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// The broadcast address `ff:ff:ff:ff:ff:ff`.
    pub const BROADCAST: Self = Self([0xFF; 6]);

    /// The MAC address of the simulated port whose IPv4 address is
    /// `a.b.c.d`: the locally administered unicast address
    /// `02:00:a:b:c:d`. Deriving it replaces ARP on the simulated fabric.
    pub const fn for_ipv4(addr: Ipv4Addr) -> Self {
        let [a, b, c, d] = addr.octets();
        Self([0x02, 0x00, a, b, c, d])
    }

    /// The IPv4 multicast MAC of RFC 1112 section 6.4: `01:00:5e` followed by
    /// the low 23 bits of the group address. `None` if `group` is not a
    /// multicast (224.0.0.0/4) address.
    pub const fn for_ipv4_multicast(group: Ipv4Addr) -> Option<Self> {
        if !group.is_multicast() {
            return None;
        }
        let [_, b, c, d] = group.octets();
        Some(Self([0x01, 0x00, 0x5E, b & 0x7F, c, d]))
    }

    /// The destination MAC for a datagram to `dst` on the simulated fabric:
    /// broadcast for 255.255.255.255, the RFC 1112 mapping for multicast
    /// groups, [`MacAddr::for_ipv4`] for everything else.
    pub const fn for_ip_destination(dst: Ipv4Addr) -> Self {
        if dst.is_broadcast() {
            return Self::BROADCAST;
        }
        match Self::for_ipv4_multicast(dst) {
            Some(mac) => mac,
            None => Self::for_ipv4(dst),
        }
    }

    /// The six octets.
    pub const fn octets(self) -> [u8; 6] {
        self.0
    }

    /// Group addresses (multicast and broadcast) have the I/G bit set.
    pub const fn is_multicast(self) -> bool {
        self.0[0] & 0x01 != 0
    }

    /// True for `ff:ff:ff:ff:ff:ff`.
    pub const fn is_broadcast(self) -> bool {
        let o = self.0;
        o[0] & o[1] & o[2] & o[3] & o[4] & o[5] == 0xFF
    }

    /// Individual (unicast) addresses have the I/G bit clear.
    pub const fn is_unicast(self) -> bool {
        !self.is_multicast()
    }

    /// The U/L bit: set for locally administered addresses.
    pub const fn is_locally_administered(self) -> bool {
        self.0[0] & 0x02 != 0
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MacAddr({self})")
    }
}

/// The Ethernet II header.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct EthHeader {
    /// Destination address.
    pub dst: MacAddr,
    /// Source address.
    pub src: MacAddr,
    /// What the frame carries.
    pub ethertype: Be16,
}
assert_layout!(EthHeader, size = 14, dst @ 0, src @ 6, ethertype @ 12);

/// A validated Ethernet II header (every header is valid).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EthRepr {
    /// Destination address.
    pub dst: MacAddr,
    /// Source address.
    pub src: MacAddr,
    /// The ethertype, such as [`ETHERTYPE_IPV4`].
    pub ethertype: u16,
}

impl HeaderRepr for EthRepr {
    type Header = EthHeader;

    fn parse(header: &EthHeader) -> Result<Self, WireError> {
        Ok(Self {
            dst: header.dst,
            src: header.src,
            ethertype: header.ethertype.get(),
        })
    }

    fn emit(&self, header: &mut EthHeader) {
        header.dst = self.dst;
        header.src = self.src;
        header.ethertype = Be16::new(self.ethertype);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testing::assert_literal;

    #[test]
    fn header_literal() {
        let bytes = [
            0x02, 0x00, 0x0A, 0x00, 0x00, 0x02, // dst 02:00:10.0.0.2
            0x02, 0x00, 0x0A, 0x00, 0x00, 0x01, // src 02:00:10.0.0.1
            0x08, 0x00, // IPv4
        ];
        assert_literal(
            &bytes,
            &EthRepr {
                dst: MacAddr::for_ipv4(Ipv4Addr::new(10, 0, 0, 2)),
                src: MacAddr::for_ipv4(Ipv4Addr::new(10, 0, 0, 1)),
                ethertype: ETHERTYPE_IPV4,
            },
        );
    }

    #[test]
    fn port_mac_is_derived_from_ipv4() {
        let mac = MacAddr::for_ipv4(Ipv4Addr::new(192, 168, 7, 42));
        assert_eq!(mac.octets(), [0x02, 0x00, 192, 168, 7, 42]);
        assert!(mac.is_unicast() && mac.is_locally_administered());
        assert!(!mac.is_broadcast());
        assert_eq!(mac.to_string(), "02:00:c0:a8:07:2a");
    }

    #[test]
    fn multicast_mapping_keeps_low_23_bits() {
        // 239.255.1.2 -> 01:00:5e:7f:01:02 (bit 23 of the group dropped).
        let mac = MacAddr::for_ipv4_multicast(Ipv4Addr::new(239, 255, 1, 2)).unwrap();
        assert_eq!(mac.octets(), [0x01, 0x00, 0x5E, 0x7F, 0x01, 0x02]);
        assert!(mac.is_multicast() && !mac.is_broadcast());
        // 224.128.1.2 maps to the same MAC as 224.0.1.2 (RFC 1112 overlap).
        assert_eq!(
            MacAddr::for_ipv4_multicast(Ipv4Addr::new(224, 128, 1, 2)),
            MacAddr::for_ipv4_multicast(Ipv4Addr::new(224, 0, 1, 2))
        );
        assert_eq!(
            MacAddr::for_ipv4_multicast(Ipv4Addr::new(10, 0, 0, 1)),
            None
        );
    }

    #[test]
    fn destination_resolution() {
        assert_eq!(
            MacAddr::for_ip_destination(Ipv4Addr::BROADCAST),
            MacAddr::BROADCAST
        );
        assert!(MacAddr::BROADCAST.is_broadcast() && MacAddr::BROADCAST.is_multicast());
        assert_eq!(
            MacAddr::for_ip_destination(Ipv4Addr::new(224, 0, 0, 1)).octets(),
            [0x01, 0x00, 0x5E, 0, 0, 1]
        );
        assert_eq!(
            MacAddr::for_ip_destination(Ipv4Addr::new(10, 1, 2, 3)),
            MacAddr::for_ipv4(Ipv4Addr::new(10, 1, 2, 3))
        );
    }
}
