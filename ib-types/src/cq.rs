//! Completion queue attributes and notification requests (IBA 11.2.7,
//! guide 6.8 and 8.2.2).

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Le32, Repr, ensure_zero};

/// Create CQ / Resize CQ attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqAttr {
    /// Minimum number of entries; the provider may round up and reports the
    /// actual size.
    pub cqe: u32,
    /// Completion vector (event queue / interrupt) the CQ reports on.
    pub comp_vector: u32,
}

/// ABI layout of [`CqAttr`]: 8 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CqAttrAbi {
    /// Entries.
    pub cqe: Le32,
    /// Completion vector.
    pub comp_vector: Le32,
}

assert_layout!(CqAttrAbi, size = 8, cqe @ 0, comp_vector @ 4);

impl Repr for CqAttr {
    type Abi = CqAttrAbi;

    fn parse(abi: &CqAttrAbi) -> Result<Self, AbiError> {
        if abi.cqe.get() == 0 {
            return Err(AbiError::OutOfRange {
                field: "CqAttrAbi.cqe",
                value: 0,
            });
        }
        Ok(Self {
            cqe: abi.cqe.get(),
            comp_vector: abi.comp_vector.get(),
        })
    }

    fn emit(&self) -> CqAttrAbi {
        CqAttrAbi {
            cqe: Le32::new(self.cqe),
            comp_vector: Le32::new(self.comp_vector),
        }
    }
}

code_enum! {
    /// What the next completion event waits for (IBA 11.4.2.2). Arming is
    /// one-shot: after an event fires the CQ must be armed again.
    pub enum CqNotify: u8 {
        /// The next solicited completion (a receive with the SE bit, or any
        /// error completion).
        Solicited = 1,
        /// The next completion of any kind.
        NextCompletion = 2,
    }
}

/// ABI layout of a notification request: 4 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CqNotifyAbi {
    /// [`CqNotify`] code.
    pub notify: u8,
    /// Reserved, zero.
    pub reserved_at_0x1: [u8; 3],
}

assert_layout!(CqNotifyAbi, size = 4, notify @ 0, reserved_at_0x1 @ 1);

impl Repr for CqNotify {
    type Abi = CqNotifyAbi;

    fn parse(abi: &CqNotifyAbi) -> Result<Self, AbiError> {
        ensure_zero("CqNotifyAbi.reserved_at_0x1", &abi.reserved_at_0x1)?;
        Self::from_code(abi.notify)
    }

    fn emit(&self) -> CqNotifyAbi {
        CqNotifyAbi {
            notify: self.code(),
            ..CqNotifyAbi::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::testing::{assert_decode_total, assert_round_trip};
    use proptest::prelude::*;

    #[test]
    fn round_trips_and_rejections() {
        assert_round_trip(&CqAttr {
            cqe: 4096,
            comp_vector: 1,
        });
        for n in CqNotify::ALL {
            assert_round_trip(n);
        }
        assert!(CqAttr::decode(&[0; 8]).is_err(), "a zero-entry CQ");
        assert!(CqNotify::decode(&[3, 0, 0, 0]).is_err());
        assert!(CqNotify::decode(&[1, 0, 1, 0]).is_err());
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..12)) {
            assert_decode_total::<CqAttr>(&bytes);
            assert_decode_total::<CqNotify>(&bytes);
        }
    }
}
