//! IB scalars: the identifiers and sequence numbers of the IB architecture.
//!
//! Types whose every bit pattern is meaningful ([`Lid`], [`PKey`], [`QKey`],
//! [`Gid`], [`Guid`] and its typed forms) are zerocopy newtypes stored in
//! network byte order and can sit directly in ABI layouts. The 24-bit
//! quantities ([`Qpn`], [`Psn`]) carry an invariant (the top byte is zero), so
//! they are host values built through a fallible constructor; in layouts they
//! travel as [`Be32`] and are checked on parse.

use core::cmp::Ordering;
use core::fmt;

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Be16, Be32, Be64};

/// Mask of a 24-bit IB field (QPN, PSN).
const MASK_24: u32 = 0x00FF_FFFF;

/// Defines a network-order scalar newtype whose every bit pattern is valid:
/// the zerocopy derives, `new`/`get` in host order, and a hex `Debug`.
macro_rules! net_scalar {
    ($(#[$meta:meta])* $name:ident($wire:ty, $host:ty), $debug:literal) => {
        $(#[$meta])*
        #[derive(
            Clone, Copy, PartialEq, Eq, Hash, Default,
            FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
        )]
        #[repr(transparent)]
        pub struct $name($wire);

        impl $name {
            /// From the host-order value.
            pub const fn new(value: $host) -> Self {
                Self(<$wire>::new(value))
            }

            /// The host-order value.
            pub const fn get(self) -> $host {
                self.0.get()
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, $debug, self.get())
            }
        }
    };
}

net_scalar!(
    /// A local identifier: a port's 16-bit address within a subnet (IBA 4.1.3).
    Lid(Be16, u16),
    "Lid({:#06x})"
);

impl Lid {
    /// LID 0 is reserved: "no LID assigned".
    pub const UNASSIGNED: Self = Self::new(0);
    /// The permissive LID, accepted by every port (IBA 7.11.1).
    pub const PERMISSIVE: Self = Self::new(0xFFFF);

    /// 0x0001..=0xBFFF address a single port.
    pub const fn is_unicast(self) -> bool {
        matches!(self.get(), 0x0001..=0xBFFF)
    }

    /// 0xC000..=0xFFFE address a multicast group.
    pub const fn is_multicast(self) -> bool {
        matches!(self.get(), 0xC000..=0xFFFE)
    }
}

/// Defines a 24-bit IB number held as a host `u32` whose top byte is zero.
macro_rules! ib_u24 {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        #[repr(transparent)]
        pub struct $name(u32);

        impl $name {
            /// The largest value, 2^24 - 1.
            pub const MAX: Self = Self(MASK_24);

            /// Checks that `value` fits in 24 bits.
            pub const fn new(value: u32) -> Result<Self, AbiError> {
                if value & !MASK_24 == 0 {
                    Ok(Self(value))
                } else {
                    Err(AbiError::OutOfRange {
                        field: stringify!($name),
                        value: value as u64,
                    })
                }
            }

            /// Keeps the low 24 bits of `value` (for values already known to
            /// come from a 24-bit field, such as a BTH).
            pub const fn from_low_bits(value: u32) -> Self {
                Self(value & MASK_24)
            }

            /// The host-order value, below 2^24.
            pub const fn get(self) -> u32 {
                self.0
            }

            /// Reads the network-order form used in ABI layouts.
            pub const fn from_be(raw: Be32) -> Result<Self, AbiError> {
                Self::new(raw.get())
            }

            /// The network-order form used in ABI layouts.
            pub const fn to_be(self) -> Be32 {
                Be32::new(self.0)
            }

            /// The three bytes of the field as sent on the wire.
            pub const fn to_be_bytes24(self) -> [u8; 3] {
                let b = self.0.to_be_bytes();
                [b[1], b[2], b[3]]
            }

            /// A value from three wire bytes; every pattern is valid.
            pub const fn from_be_bytes24(bytes: [u8; 3]) -> Self {
                Self(u32::from_be_bytes([0, bytes[0], bytes[1], bytes[2]]))
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#08x})"), self.0)
            }
        }

        impl TryFrom<u32> for $name {
            type Error = AbiError;
            fn try_from(value: u32) -> Result<Self, AbiError> {
                Self::new(value)
            }
        }
    };
}

ib_u24!(
    /// A queue pair number (24 bits; IBA 9.2 DestQP).
    Qpn
);

impl Qpn {
    /// QP0, the subnet management interface QP of each port.
    pub const SMI: Self = Self(0);
    /// QP1, the general services interface QP of each port.
    pub const GSI: Self = Self(1);
    /// The destination QPN that addresses every member of a multicast group.
    pub const MULTICAST: Self = Self(MASK_24);

    /// QP0 and QP1 are special per port and never handed to general clients.
    pub const fn is_special(self) -> bool {
        self.0 <= 1
    }
}

ib_u24!(
    /// A packet sequence number (24 bits, wrapping; IBA 9.7.2).
    Psn
);

impl Psn {
    /// This PSN advanced by `n`, modulo 2^24.
    pub const fn wrapping_add(self, n: u32) -> Self {
        Self(self.0.wrapping_add(n) & MASK_24)
    }

    /// The PSN after this one.
    pub const fn next(self) -> Self {
        self.wrapping_add(1)
    }

    /// How far `self` is ahead of `earlier`, modulo 2^24.
    pub const fn distance_from(self, earlier: Self) -> u32 {
        self.0.wrapping_sub(earlier.0) & MASK_24
    }

    /// Orders two PSNs within the half-window of 2^23 around each other
    /// (IBA 9.7.2): `a` is "less" than `b` when `b` is at most 2^23 - 1 ahead.
    /// Shifting the 24-bit difference into the top of an `i32` makes its sign
    /// the answer.
    pub const fn cmp_wrapping(self, other: Self) -> Ordering {
        let diff = (self.0.wrapping_sub(other.0) << 8) as i32;
        if diff < 0 {
            Ordering::Less
        } else if diff > 0 {
            Ordering::Greater
        } else {
            Ordering::Equal
        }
    }

    /// True when `self` comes strictly before `other` in the wrapped order.
    pub const fn precedes(self, other: Self) -> bool {
        matches!(self.cmp_wrapping(other), Ordering::Less)
    }
}

net_scalar!(
    /// A partition key (IBA 10.9): 15-bit partition number and a membership bit.
    PKey(Be16, u16),
    "PKey({:#06x})"
);

impl PKey {
    /// Bit 15: full member (set) or limited member (clear).
    pub const FULL_MEMBER_BIT: u16 = 0x8000;
    /// The default partition, full membership.
    pub const DEFAULT: Self = Self::new(0xFFFF);
    /// Partition number 0 is invalid in either membership.
    pub const INVALID: Self = Self::new(0);

    /// The 15-bit partition number.
    pub const fn base(self) -> u16 {
        self.get() & !Self::FULL_MEMBER_BIT
    }

    /// True for full membership.
    pub const fn is_full_member(self) -> bool {
        self.get() & Self::FULL_MEMBER_BIT != 0
    }

    /// A partition number of zero is never valid.
    pub const fn is_valid(self) -> bool {
        self.base() != 0
    }

    /// The same partition with full membership.
    pub const fn as_full_member(self) -> Self {
        Self::new(self.get() | Self::FULL_MEMBER_BIT)
    }

    /// The P_Key check of IBA 10.9.3: same valid partition number, and at
    /// least one side a full member (two limited members cannot talk).
    pub const fn matches(self, other: Self) -> bool {
        self.is_valid()
            && self.base() == other.base()
            && (self.is_full_member() || other.is_full_member())
    }
}

net_scalar!(
    /// A queue key for datagram QPs (IBA 10.2.4).
    QKey(Be32, u32),
    "QKey({:#010x})"
);

impl QKey {
    /// Bit 31: a controlled Q_Key, which only privileged consumers may set.
    pub const CONTROLLED_BIT: u32 = 0x8000_0000;
    /// The well-known Q_Key of QP1 (IBA 13.4.6.1).
    pub const GSI: Self = Self::new(0x8001_0000);

    /// Controlled keys (high bit set) need privilege to be put in a QP
    /// context or a send WR (IBA 10.5.2.2).
    pub const fn is_controlled(self) -> bool {
        self.get() & Self::CONTROLLED_BIT != 0
    }
}

/// A 64-bit EUI-64 globally unique identifier, network order.
#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(transparent)]
pub struct Guid(Be64);

impl Guid {
    /// A GUID from its host-order value.
    pub const fn new(value: u64) -> Self {
        Self(Be64::new(value))
    }

    /// The host-order value.
    pub const fn get(self) -> u64 {
        self.0.get()
    }
}

impl fmt::Display for Guid {
    /// The conventional `xxxx:xxxx:xxxx:xxxx` form.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.get();
        write!(
            f,
            "{:04x}:{:04x}:{:04x}:{:04x}",
            v >> 48,
            (v >> 32) & 0xFFFF,
            (v >> 16) & 0xFFFF,
            v & 0xFFFF
        )
    }
}

impl fmt::Debug for Guid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Guid({self})")
    }
}

/// Defines a GUID with a role, so a port GUID cannot be passed as a node GUID.
macro_rules! typed_guid {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(
            Clone, Copy, PartialEq, Eq, Hash, Default, Debug,
            FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
        )]
        #[repr(transparent)]
        pub struct $name(Guid);

        impl $name {
            /// From the host-order value.
            pub const fn new(value: u64) -> Self {
                Self(Guid::new(value))
            }

            /// The untyped GUID.
            pub const fn guid(self) -> Guid {
                self.0
            }

            /// The host-order value.
            pub const fn get(self) -> u64 {
                self.0.get()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

typed_guid!(
    /// The node GUID; for a channel adapter it is also the CA GUID (the
    /// EUI-64 the guide's OpenHCA takes).
    NodeGuid
);
typed_guid!(
    /// A port GUID (the interface ID of the port's default GID).
    PortGuid
);
typed_guid!(
    /// The system image GUID shared by the CAs of one system.
    SystemImageGuid
);

/// A 128-bit global identifier (IBA 4.1.1), network order. On RoCEv2 ports
/// the GIDs are IPv6 addresses, usually IPv4-mapped (`::ffff:a.b.c.d`).
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
pub struct Gid([u8; 16]);

impl Gid {
    /// The all-zero GID (an empty table slot).
    pub const ZERO: Self = Self([0; 16]);
    /// The link-local subnet prefix fe80::/64.
    pub const LINK_LOCAL_PREFIX: u64 = 0xFE80_0000_0000_0000;

    /// From the 16 raw network-order bytes.
    pub const fn from_octets(octets: [u8; 16]) -> Self {
        Self(octets)
    }

    /// The 16 raw network-order bytes.
    pub const fn octets(self) -> [u8; 16] {
        self.0
    }

    /// From a subnet prefix and an interface ID (typically a port GUID).
    pub const fn from_parts(subnet_prefix: u64, interface_id: u64) -> Self {
        let p = subnet_prefix.to_be_bytes();
        let i = interface_id.to_be_bytes();
        Self([
            p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], i[0], i[1], i[2], i[3], i[4], i[5],
            i[6], i[7],
        ])
    }

    /// The IPv4-mapped IPv6 GID `::ffff:a.b.c.d` used by RoCEv2 over IPv4.
    pub const fn from_ipv4(addr: [u8; 4]) -> Self {
        let [a, b, c, d] = addr;
        Self([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, a, b, c, d])
    }

    /// The IPv4 address of an IPv4-mapped GID, else `None`.
    pub const fn ipv4(self) -> Option<[u8; 4]> {
        let o = self.0;
        let mut i = 0;
        while i < 10 {
            if o[i] != 0 {
                return None;
            }
            i += 1;
        }
        if o[10] == 0xFF && o[11] == 0xFF {
            Some([o[12], o[13], o[14], o[15]])
        } else {
            None
        }
    }

    /// The upper 64 bits.
    pub const fn subnet_prefix(self) -> u64 {
        let o = self.0;
        u64::from_be_bytes([o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]])
    }

    /// The lower 64 bits.
    pub const fn interface_id(self) -> u64 {
        let o = self.0;
        u64::from_be_bytes([o[8], o[9], o[10], o[11], o[12], o[13], o[14], o[15]])
    }

    /// Multicast GIDs start with 0xFF (IBA 4.1.1).
    pub const fn is_multicast(self) -> bool {
        self.0[0] == 0xFF
    }

    /// True for the all-zero GID.
    pub const fn is_zero(self) -> bool {
        self.subnet_prefix() == 0 && self.interface_id() == 0
    }
}

impl fmt::Display for Gid {
    /// IPv6 text form: `::ffff:a.b.c.d` for IPv4-mapped GIDs, otherwise eight
    /// uncompressed groups.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some([a, b, c, d]) = self.ipv4() {
            return write!(f, "::ffff:{a}.{b}.{c}.{d}");
        }
        for (i, pair) in self.0.chunks_exact(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:x}", u16::from_be_bytes([pair[0], pair[1]]))?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// A port number. Ports are numbered from 1; 0 is not a port (guide 6.1.3).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct PortNum(u8);

impl PortNum {
    /// Port 1.
    pub const FIRST: Self = Self(1);

    /// Rejects port 0.
    pub const fn new(value: u8) -> Result<Self, AbiError> {
        if value == 0 {
            Err(AbiError::OutOfRange {
                field: "PortNum",
                value: 0,
            })
        } else {
            Ok(Self(value))
        }
    }

    /// The 1-based number.
    pub const fn get(self) -> u8 {
        self.0
    }

    /// The 0-based index into per-port arrays.
    pub const fn index(self) -> usize {
        self.0 as usize - 1
    }
}

code_enum! {
    /// Path MTU codes of IBA 9.4 (PortInfo NeighborMTU / QP path MTU).
    pub enum Mtu: u8 {
        /// 256 bytes.
        Mtu256 = 1,
        /// 512 bytes.
        Mtu512 = 2,
        /// 1024 bytes.
        Mtu1024 = 3,
        /// 2048 bytes.
        Mtu2048 = 4,
        /// 4096 bytes.
        Mtu4096 = 5,
    }
}

impl Mtu {
    /// Payload bytes per packet.
    pub const fn bytes(self) -> u32 {
        128 << self.code()
    }

    /// The largest MTU of at most `bytes`, if any.
    pub const fn at_most(bytes: u32) -> Option<Self> {
        let mut i = Self::ALL.len();
        while i > 0 {
            i -= 1;
            if Self::ALL[i].bytes() <= bytes {
                return Some(Self::ALL[i]);
            }
        }
        None
    }
}

code_enum! {
    /// Logical port state (IBA 14.2.5.6 PortInfo PortState).
    pub enum PortState: u8 {
        /// Link down.
        Down = 1,
        /// Link up, not yet configured by the subnet manager.
        Init = 2,
        /// Configured; only management traffic flows.
        Armed = 3,
        /// All traffic flows.
        Active = 4,
        /// Active, with traffic deferred (IBA 7.2.2).
        ActiveDefer = 5,
    }
}

code_enum! {
    /// The link layer a port runs.
    pub enum LinkLayer: u8 {
        /// Native InfiniBand (LRH addressing).
        InfiniBand = 1,
        /// Ethernet carrying RoCEv2 (GRH addressing over UDP/IP).
        Ethernet = 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use zerocopy::IntoBytes;

    #[test]
    fn scalars_are_network_order() {
        assert_eq!(Lid::new(0x1234).as_bytes(), &[0x12, 0x34]);
        assert_eq!(PKey::new(0xFFFF).as_bytes(), &[0xFF, 0xFF]);
        assert_eq!(QKey::new(0x8001_0000).as_bytes(), &[0x80, 0x01, 0, 0]);
        assert_eq!(
            Guid::new(0x0002_C903_0000_1234).as_bytes(),
            &[0x00, 0x02, 0xC9, 0x03, 0x00, 0x00, 0x12, 0x34]
        );
        assert_eq!(
            Qpn::new(0xABCDEF).unwrap().to_be().as_bytes(),
            &[0, 0xAB, 0xCD, 0xEF]
        );
        assert_eq!(Psn::new(0x010203).unwrap().to_be_bytes24(), [1, 2, 3]);
    }

    #[test]
    fn lid_classes() {
        assert!(!Lid::UNASSIGNED.is_unicast());
        assert!(Lid::new(1).is_unicast() && Lid::new(0xBFFF).is_unicast());
        assert!(Lid::new(0xC000).is_multicast() && Lid::new(0xFFFE).is_multicast());
        assert!(!Lid::PERMISSIVE.is_multicast() && !Lid::PERMISSIVE.is_unicast());
    }

    #[test]
    fn u24_rejects_wide_values() {
        assert_eq!(Qpn::new(0xFF_FFFF), Ok(Qpn::MAX));
        assert_eq!(
            Qpn::new(0x100_0000),
            Err(AbiError::OutOfRange {
                field: "Qpn",
                value: 0x100_0000
            })
        );
        assert!(Psn::from_be(Be32::new(0x8000_0000)).is_err());
        assert_eq!(Qpn::from_low_bits(0x1234_5678).get(), 0x34_5678);
        assert!(Qpn::SMI.is_special() && Qpn::GSI.is_special());
        assert!(!Qpn::new(2).unwrap().is_special());
    }

    #[test]
    fn psn_wraps() {
        let last = Psn::MAX;
        assert_eq!(last.next(), Psn::new(0).unwrap());
        assert_eq!(Psn::new(3).unwrap().distance_from(last), 4);
        assert!(last.precedes(Psn::new(5).unwrap()));
        assert!(!Psn::new(5).unwrap().precedes(last));
        assert_eq!(
            Psn::new(7).unwrap().cmp_wrapping(Psn::new(7).unwrap()),
            Ordering::Equal
        );
        // Exactly half the space apart: the sign bit decides (a - b = 2^23).
        let zero = Psn::new(0).unwrap();
        let half = Psn::new(1 << 23).unwrap();
        assert_eq!(half.cmp_wrapping(zero), Ordering::Less);
    }

    proptest! {
        #[test]
        fn psn_order_is_consistent(a in 0u32..=MASK_24, d in 1u32..(1 << 23)) {
            let a = Psn::new(a).unwrap();
            let b = a.wrapping_add(d);
            prop_assert!(a.precedes(b));
            prop_assert!(!b.precedes(a));
            prop_assert_eq!(b.distance_from(a), d);
            prop_assert_eq!(a.cmp_wrapping(b), b.cmp_wrapping(a).reverse());
        }

        #[test]
        fn u24_bytes_round_trip(v in 0u32..=MASK_24) {
            let q = Qpn::new(v).unwrap();
            prop_assert_eq!(Qpn::from_be_bytes24(q.to_be_bytes24()), q);
            prop_assert_eq!(Qpn::from_be(q.to_be()), Ok(q));
        }

        #[test]
        fn gid_parts_round_trip(p: u64, i: u64) {
            let g = Gid::from_parts(p, i);
            prop_assert_eq!(g.subnet_prefix(), p);
            prop_assert_eq!(g.interface_id(), i);
        }
    }

    #[test]
    fn pkey_membership() {
        let full = PKey::new(0x8001);
        let limited = PKey::new(0x0001);
        assert!(full.is_full_member() && !limited.is_full_member());
        assert!(full.matches(limited) && limited.matches(full) && full.matches(full));
        assert!(!limited.matches(limited), "two limited members cannot talk");
        assert!(!full.matches(PKey::new(0x8002)));
        assert!(!PKey::INVALID.as_full_member().matches(PKey::new(0x8000)));
        assert_eq!(limited.as_full_member(), full);
        assert_eq!(PKey::DEFAULT.base(), 0x7FFF);
    }

    #[test]
    fn qkey_control_bit() {
        assert!(QKey::GSI.is_controlled());
        assert!(!QKey::new(0x1234).is_controlled());
    }

    #[test]
    fn gid_ipv4_mapping() {
        let g = Gid::from_ipv4([192, 168, 1, 7]);
        assert_eq!(
            g.octets(),
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 192, 168, 1, 7]
        );
        assert_eq!(g.ipv4(), Some([192, 168, 1, 7]));
        assert_eq!(format!("{g}"), "::ffff:192.168.1.7");
        let ll = Gid::from_parts(Gid::LINK_LOCAL_PREFIX, 0x0002_c903_0000_0001);
        assert_eq!(ll.ipv4(), None);
        assert_eq!(format!("{ll}"), "fe80:0:0:0:2:c903:0:1");
        assert!(Gid::from_octets([0xFF; 16]).is_multicast());
        assert!(Gid::ZERO.is_zero());
    }

    #[test]
    fn guid_text() {
        assert_eq!(
            format!("{}", PortGuid::new(0x0002_c903_00ab_cdef)),
            "0002:c903:00ab:cdef"
        );
    }

    #[test]
    fn port_numbers_start_at_one() {
        assert!(PortNum::new(0).is_err());
        assert_eq!(PortNum::new(2).unwrap().index(), 1);
    }

    #[test]
    fn mtu_codes() {
        let bytes: Vec<u32> = Mtu::ALL.iter().map(|m| m.bytes()).collect();
        assert_eq!(bytes, [256, 512, 1024, 2048, 4096]);
        assert_eq!(Mtu::at_most(3000), Some(Mtu::Mtu2048));
        assert_eq!(Mtu::at_most(100), None);
        assert_eq!(
            Mtu::from_code(6).unwrap_err(),
            AbiError::InvalidCode {
                type_name: "Mtu",
                value: 6
            }
        );
    }
}
