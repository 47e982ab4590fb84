//! ABI building blocks: explicit-endian integers, the decoding error, and the
//! [`Repr`] contract between an ABI layout and its validated value.
//!
//! Layout rules for every ABI struct in this crate:
//! - `#[repr(C)]`, derived `FromBytes + IntoBytes + KnownLayout + Immutable +
//!   Unaligned`: any byte string of the right length is a layout, so reading
//!   one never fails except on length.
//! - Fields are alignment-1 explicit-endian integers ([`Le32`], [`Be32`], ...)
//!   placed at their natural offsets with named reserved bytes in between, so
//!   the layout is the same for 32-bit (WOW64) and 64-bit callers and matches a
//!   naturally aligned C declaration.
//! - Handles are 64-bit; pointers never appear.
//! - Reserved bytes must be zero; `parse` rejects anything else so the space can
//!   be given meaning by a later ABI version.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub use zerocopy::little_endian::{I32 as LeI32, U16 as Le16, U32 as Le32, U64 as Le64};
pub use zerocopy::network_endian::{U16 as Be16, U32 as Be32, U64 as Be64};

/// Why bytes or a layout could not be turned into a valid value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AbiError {
    /// The buffer is shorter than the layout.
    #[error("buffer too short: need {needed} bytes, got {got}")]
    Truncated {
        /// Bytes the layout needs.
        needed: usize,
        /// Bytes supplied.
        got: usize,
    },
    /// A code field holds a value no variant has.
    #[error("{type_name}: unknown code {value:#x}")]
    InvalidCode {
        /// The enum the code was read as.
        type_name: &'static str,
        /// The raw value found.
        value: u64,
    },
    /// A numeric field is outside its legal range.
    #[error("{field}: value {value:#x} out of range")]
    OutOfRange {
        /// The field, as `Type.field`.
        field: &'static str,
        /// The raw value found.
        value: u64,
    },
    /// Reserved bytes or bits are not zero.
    #[error("{field}: reserved bits are not zero")]
    ReservedNotZero {
        /// The field, as `Type.field`.
        field: &'static str,
    },
    /// A length or count field disagrees with the buffer or overflows.
    #[error("{field}: declared length {declared} does not fit the {available} bytes available")]
    BadLength {
        /// The field, as `Type.field`.
        field: &'static str,
        /// What the field declares (saturated on overflow).
        declared: u64,
        /// What the buffer actually holds.
        available: u64,
    },
    /// The peer speaks an ABI version this side does not.
    #[error("ABI version {got:#x} is incompatible with {expected:#x}")]
    VersionMismatch {
        /// The version this side implements.
        expected: u32,
        /// The version the peer announced.
        got: u32,
    },
}

/// Reads a layout from the front of `bytes`, returning it and the rest.
pub fn read_prefix<T>(bytes: &[u8]) -> Result<(T, &[u8]), AbiError>
where
    T: FromBytes + KnownLayout + Immutable + Unaligned,
{
    T::read_from_prefix(bytes).map_err(|_| AbiError::Truncated {
        needed: core::mem::size_of::<T>(),
        got: bytes.len(),
    })
}

/// Reads a layout that must fill `bytes` exactly (fixed-size buffers).
pub fn read_exact<T>(bytes: &[u8]) -> Result<T, AbiError>
where
    T: FromBytes + KnownLayout + Immutable + Unaligned,
{
    let needed = core::mem::size_of::<T>();
    if bytes.len() != needed {
        return Err(AbiError::BadLength {
            field: core::any::type_name::<T>(),
            declared: needed as u64,
            available: bytes.len() as u64,
        });
    }
    read_prefix(bytes).map(|(value, _)| value)
}

/// Checks that reserved bytes are zero.
pub fn ensure_zero(field: &'static str, bytes: &[u8]) -> Result<(), AbiError> {
    if bytes.iter().all(|&b| b == 0) {
        Ok(())
    } else {
        Err(AbiError::ReservedNotZero { field })
    }
}

/// Reads a boolean stored as one byte: 0 or 1, anything else is an error.
pub fn parse_bool(field: &'static str, raw: u8) -> Result<bool, AbiError> {
    match raw {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(AbiError::OutOfRange {
            field,
            value: u64::from(other),
        }),
    }
}

/// A validated value with a fixed ABI layout (the smoltcp `Repr` pattern).
///
/// `emit` then `parse` is the identity on values; `parse` then `emit` is the
/// identity on every layout that `parse` accepts.
pub trait Repr: Sized {
    /// The on-the-wire / in-buffer layout.
    type Abi: FromBytes + IntoBytes + KnownLayout + Immutable + Unaligned;

    /// Validates a layout into a value.
    fn parse(abi: &Self::Abi) -> Result<Self, AbiError>;

    /// Writes the value's layout.
    fn emit(&self) -> Self::Abi;

    /// Reads and validates a value from the front of untrusted bytes.
    fn decode(bytes: &[u8]) -> Result<(Self, &[u8]), AbiError> {
        let (abi, rest) = read_prefix::<Self::Abi>(bytes)?;
        Ok((Self::parse(&abi)?, rest))
    }
}

#[cfg(test)]
#[allow(dead_code, reason = "used by the ABI modules' tests")]
pub(crate) mod testing {
    //! Round-trip checks shared by the crate's tests.
    use super::*;
    use core::fmt::Debug;

    /// Value -> layout -> bytes -> layout -> value is the identity, and the
    /// bytes decode from a buffer with trailing data too.
    pub(crate) fn assert_round_trip<R: Repr + PartialEq + Debug>(value: &R) {
        let abi = value.emit();
        let bytes = abi.as_bytes();
        assert_eq!(bytes.len(), core::mem::size_of::<R::Abi>());
        let (decoded, rest) = R::decode(bytes).expect("emitted layout must parse");
        assert_eq!(&decoded, value);
        assert!(rest.is_empty());
        assert_eq!(decoded.emit().as_bytes(), bytes, "re-emit differs");

        let mut longer = bytes.to_vec();
        longer.extend_from_slice(&[0xA5; 3]);
        let (again, rest) = R::decode(&longer).expect("prefix decode");
        assert_eq!(&again, value);
        assert_eq!(rest, &[0xA5; 3]);

        for cut in 0..bytes.len() {
            assert!(
                matches!(R::decode(&bytes[..cut]), Err(AbiError::Truncated { .. })),
                "a {cut}-byte prefix must be reported truncated"
            );
        }
    }

    /// A way to damage a valid layout, and what the damage is.
    pub(crate) type Corruption<A> = (fn(&mut A), &'static str);

    /// `good` parses, and each corruption of it is rejected.
    pub(crate) fn assert_corruptions_rejected<R: Repr>(good: &R::Abi, cases: &[Corruption<R::Abi>])
    where
        R::Abi: Copy,
    {
        assert!(R::parse(good).is_ok(), "the unbroken layout must parse");
        for (corrupt, what) in cases {
            let mut abi = *good;
            corrupt(&mut abi);
            assert!(R::parse(&abi).is_err(), "{what} must be rejected");
        }
    }

    /// Decoding arbitrary bytes returns a value or an error, never panics, and
    /// whatever parses re-emits to the same bytes.
    pub(crate) fn assert_decode_total<R: Repr + PartialEq + Debug>(bytes: &[u8]) {
        if let Ok((value, _)) = R::decode(bytes) {
            let size = core::mem::size_of::<R::Abi>();
            assert_eq!(value.emit().as_bytes(), &bytes[..size]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ensure_zero_reports_field() {
        assert_eq!(ensure_zero("T.r", &[0, 0, 0]), Ok(()));
        assert_eq!(
            ensure_zero("T.r", &[0, 1, 0]),
            Err(AbiError::ReservedNotZero { field: "T.r" })
        );
    }

    #[test]
    fn read_exact_rejects_wrong_length() {
        assert_eq!(read_exact::<Le32>(&[1, 0, 0, 0]).map(|v| v.get()), Ok(1));
        assert!(matches!(
            read_exact::<Le32>(&[1, 0, 0, 0, 0]),
            Err(AbiError::BadLength { .. })
        ));
        assert!(matches!(
            read_exact::<Le32>(&[1, 0]),
            Err(AbiError::BadLength { .. })
        ));
    }

    #[test]
    fn bools_are_strict() {
        assert_eq!(parse_bool("b", 0), Ok(false));
        assert_eq!(parse_bool("b", 1), Ok(true));
        assert!(parse_bool("b", 2).is_err());
    }
}
