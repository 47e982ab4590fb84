//! Multicast group membership of UD QPs (IBA 10.5, guide 6.9).

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Repr, ensure_zero};
use crate::scalars::{Gid, Lid};

/// A multicast group to attach a QP to, or detach it from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct McastGroup {
    /// Multicast GID: an IB multicast GID (`ff..`), or on RoCEv2 an
    /// IPv4-mapped GID of a 224.0.0.0/4 address.
    pub mgid: Gid,
    /// Multicast LID (unused on RoCEv2 ports; zero there).
    pub mlid: Lid,
}

impl McastGroup {
    /// True for a GID that names a multicast group.
    pub const fn is_multicast_gid(gid: Gid) -> bool {
        match gid.ipv4() {
            Some([a, ..]) => a & 0xF0 == 0xE0,
            None => gid.is_multicast(),
        }
    }
}

/// ABI layout of [`McastGroup`]: 20 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct McastGroupAbi {
    /// Multicast GID.
    pub mgid: Gid,
    /// Multicast LID.
    pub mlid: Lid,
    /// Reserved, zero.
    pub reserved_at_0x12: [u8; 2],
}

assert_layout!(McastGroupAbi, size = 20, mgid @ 0, mlid @ 16, reserved_at_0x12 @ 18);

impl Repr for McastGroup {
    type Abi = McastGroupAbi;

    fn parse(abi: &McastGroupAbi) -> Result<Self, AbiError> {
        ensure_zero("McastGroupAbi.reserved_at_0x12", &abi.reserved_at_0x12)?;
        if !Self::is_multicast_gid(abi.mgid) {
            return Err(AbiError::OutOfRange {
                field: "McastGroupAbi.mgid (not a multicast GID)",
                value: abi.mgid.interface_id(),
            });
        }
        if abi.mlid.get() != 0 && !abi.mlid.is_multicast() {
            return Err(AbiError::OutOfRange {
                field: "McastGroupAbi.mlid",
                value: abi.mlid.get().into(),
            });
        }
        Ok(Self {
            mgid: abi.mgid,
            mlid: abi.mlid,
        })
    }

    fn emit(&self) -> McastGroupAbi {
        McastGroupAbi {
            mgid: self.mgid,
            mlid: self.mlid,
            ..McastGroupAbi::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::testing::{assert_decode_total, assert_round_trip};
    use proptest::prelude::*;

    #[test]
    fn multicast_gids() {
        let roce = McastGroup {
            mgid: Gid::from_ipv4([239, 1, 2, 3]),
            mlid: Lid::UNASSIGNED,
        };
        assert_round_trip(&roce);
        let ib = McastGroup {
            mgid: Gid::from_parts(0xff12_401b_ffff_0000, 1),
            mlid: Lid::new(0xC001),
        };
        assert_round_trip(&ib);
        for not_group in [
            Gid::from_ipv4([10, 0, 0, 1]),
            Gid::from_parts(0xfe80 << 48, 1),
        ] {
            let abi = McastGroupAbi {
                mgid: not_group,
                ..McastGroupAbi::default()
            };
            assert!(McastGroup::parse(&abi).is_err());
        }
        let mut abi = ib.emit();
        abi.mlid = Lid::new(0x0001);
        assert!(McastGroup::parse(&abi).is_err(), "unicast MLID");
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..24)) {
            assert_decode_total::<McastGroup>(&bytes);
        }
    }
}
