//! Shared receive queue attributes (IBA 11.2.3).

use bitflags::bitflags;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Le32, Repr, ensure_zero};
use crate::handle::PdHandle;

/// SRQ capacities and limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SrqAttr {
    /// Receive WRs the SRQ holds.
    pub max_wr: u32,
    /// SGEs per receive WR.
    pub max_sge: u32,
    /// When the number of posted WRs drops below this, a one-shot
    /// `SrqLimitReached` event fires; 0 disarms.
    pub srq_limit: u32,
}

/// ABI layout of [`SrqAttr`]: 16 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct SrqAttrAbi {
    /// Depth.
    pub max_wr: Le32,
    /// SGEs per WR.
    pub max_sge: Le32,
    /// Limit.
    pub srq_limit: Le32,
    /// Reserved, zero.
    pub reserved_at_0xc: [u8; 4],
}

assert_layout!(SrqAttrAbi, size = 16, max_wr @ 0, max_sge @ 4, srq_limit @ 8,
    reserved_at_0xc @ 12);

impl Repr for SrqAttr {
    type Abi = SrqAttrAbi;

    fn parse(abi: &SrqAttrAbi) -> Result<Self, AbiError> {
        ensure_zero("SrqAttrAbi.reserved_at_0xc", &abi.reserved_at_0xc)?;
        Ok(Self {
            max_wr: abi.max_wr.get(),
            max_sge: abi.max_sge.get(),
            srq_limit: abi.srq_limit.get(),
        })
    }

    fn emit(&self) -> SrqAttrAbi {
        SrqAttrAbi {
            max_wr: Le32::new(self.max_wr),
            max_sge: Le32::new(self.max_sge),
            srq_limit: Le32::new(self.srq_limit),
            ..SrqAttrAbi::default()
        }
    }
}

/// Create SRQ: the protection domain and the initial attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SrqCreate {
    /// Protection domain.
    pub pd: PdHandle,
    /// Requested attributes; the limit must not exceed the depth.
    pub attr: SrqAttr,
}

/// ABI layout of [`SrqCreate`]: 24 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct SrqCreateAbi {
    /// Protection domain.
    pub pd: PdHandle,
    /// Attributes.
    pub attr: SrqAttrAbi,
}

assert_layout!(SrqCreateAbi, size = 24, pd @ 0, attr @ 8);

impl Repr for SrqCreate {
    type Abi = SrqCreateAbi;

    fn parse(abi: &SrqCreateAbi) -> Result<Self, AbiError> {
        if abi.pd.is_null() {
            return Err(AbiError::OutOfRange {
                field: "SrqCreateAbi.pd",
                value: 0,
            });
        }
        let attr = SrqAttr::parse(&abi.attr)?;
        if attr.max_wr == 0 || attr.srq_limit > attr.max_wr {
            return Err(AbiError::OutOfRange {
                field: "SrqCreateAbi.attr (empty, or limit above depth)",
                value: attr.srq_limit.into(),
            });
        }
        Ok(Self { pd: abi.pd, attr })
    }

    fn emit(&self) -> SrqCreateAbi {
        SrqCreateAbi {
            pd: self.pd,
            attr: self.attr.emit(),
        }
    }
}

bitflags! {
    /// Which SRQ attributes a Modify SRQ changes.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SrqAttrMask: u32 {
        /// Resize to `max_wr` (if the CA supports it).
        const MAX_WR = 1 << 0;
        /// Arm the limit event at `srq_limit`.
        const LIMIT = 1 << 1;
    }
}

/// Modify SRQ: a mask and the attributes it names (others must be zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SrqModify {
    /// New depth, if resizing.
    pub max_wr: Option<u32>,
    /// New limit, if arming.
    pub srq_limit: Option<u32>,
}

/// ABI layout of [`SrqModify`]: 20 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct SrqModifyAbi {
    /// [`SrqAttrMask`] bits.
    pub mask: Le32,
    /// Attributes named by the mask.
    pub attr: SrqAttrAbi,
}

assert_layout!(SrqModifyAbi, size = 20, mask @ 0, attr @ 4);

impl SrqModify {
    /// The mask: exactly the attributes present.
    pub fn mask(&self) -> SrqAttrMask {
        let mut mask = SrqAttrMask::empty();
        mask.set(SrqAttrMask::MAX_WR, self.max_wr.is_some());
        mask.set(SrqAttrMask::LIMIT, self.srq_limit.is_some());
        mask
    }
}

impl Repr for SrqModify {
    type Abi = SrqModifyAbi;

    fn parse(abi: &SrqModifyAbi) -> Result<Self, AbiError> {
        let mask = SrqAttrMask::from_bits(abi.mask.get()).ok_or(AbiError::ReservedNotZero {
            field: "SrqModifyAbi.mask",
        })?;
        let attr = SrqAttr::parse(&abi.attr)?;
        let modify = Self {
            max_wr: mask.contains(SrqAttrMask::MAX_WR).then_some(attr.max_wr),
            srq_limit: mask.contains(SrqAttrMask::LIMIT).then_some(attr.srq_limit),
        };
        if attr.max_sge != 0 || modify.emit().as_bytes() != abi.as_bytes() {
            return Err(AbiError::ReservedNotZero {
                field: "SrqModifyAbi (attribute outside the mask)",
            });
        }
        Ok(modify)
    }

    fn emit(&self) -> SrqModifyAbi {
        SrqModifyAbi {
            mask: Le32::new(self.mask().bits()),
            attr: SrqAttr {
                max_wr: self.max_wr.unwrap_or(0),
                max_sge: 0,
                srq_limit: self.srq_limit.unwrap_or(0),
            }
            .emit(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::testing::{assert_decode_total, assert_round_trip};
    use proptest::prelude::*;

    #[test]
    fn create_rules() {
        let good = SrqCreate {
            pd: PdHandle::from_raw(3),
            attr: SrqAttr {
                max_wr: 256,
                max_sge: 2,
                srq_limit: 16,
            },
        };
        assert_round_trip(&good);
        let mut abi = good.emit();
        abi.attr.srq_limit = Le32::new(257);
        assert!(SrqCreate::parse(&abi).is_err(), "limit above depth");
        let mut abi = good.emit();
        abi.pd = PdHandle::NULL;
        assert!(SrqCreate::parse(&abi).is_err(), "null PD");
        let mut abi = good.emit();
        abi.attr.reserved_at_0xc[3] = 1;
        assert!(SrqCreate::parse(&abi).is_err(), "reserved");
    }

    #[test]
    fn modify_mask_follows_fields() {
        let arm = SrqModify {
            max_wr: None,
            srq_limit: Some(8),
        };
        assert_eq!(arm.mask(), SrqAttrMask::LIMIT);
        assert_round_trip(&arm);
        let mut abi = arm.emit();
        abi.attr.max_wr = Le32::new(5);
        assert!(SrqModify::parse(&abi).is_err(), "unmasked attribute set");
        let mut abi = arm.emit();
        abi.mask = Le32::new(4);
        assert!(SrqModify::parse(&abi).is_err(), "unknown mask bit");
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..30)) {
            assert_decode_total::<SrqCreate>(&bytes);
            assert_decode_total::<SrqModify>(&bytes);
        }

        #[test]
        fn modify_round_trips(max_wr: Option<u32>, srq_limit: Option<u32>) {
            assert_round_trip(&SrqModify { max_wr, srq_limit });
        }
    }
}
