//! RoCEv2 wire formats: the bytes the simulated ports put on the fabric.
//!
//! A frame is Ethernet II, IPv4 (20 bytes, no options), UDP to port 4791,
//! the IB Base Transport Header, the extension headers the opcode calls
//! for, the payload, 0–3 pad bytes, and the 4-byte invariant CRC:
//!
//! ```text
//! | Eth 14 | IPv4 20 | UDP 8 | BTH 12 | ext 0..32 | payload | pad | ICRC 4 |
//! ```
//!
//! Contract of every module below:
//! - Headers are `#[repr(C)]` zerocopy layouts of network-endian fields; any
//!   byte string of the right length *is* a layout, so reading one fails only
//!   on length. 24-bit fields sit behind accessors. A compile-time assertion
//!   pins each size and field offset to the IBA / RFC layout.
//! - Parsing is two-level (the smoltcp pattern). A header's validated value
//!   (its `*Repr`, see [`HeaderRepr`]) is built only through `parse`, which
//!   checks every field; [`RocePacket::parse`] validates a whole frame once,
//!   after which none of its accessors can fail or panic.
//! - Codes from the wire ([`Opcode`], AETH syndromes) go through `TryFrom`;
//!   unknown values are a [`WireError`], never a transmute or a panic.
//! - Nothing here allocates: parsing borrows the frame, emitting writes into a
//!   caller-provided buffer, and the ICRC is computed from stack copies.
//!
//! Not supported, and rejected with a distinct error: VLAN tags and IPv6
//! (RoCEv2 over IPv6), IPv4 options and fragments, the reliable-datagram
//! transport (RDETH), extended RC, and the RoCEv2 congestion notification
//! packet (opcode 0x81).

pub mod bth;
pub mod error;
pub mod eth;
pub mod ext;
pub mod icrc;
pub mod ipv4;
pub mod opcode;
pub mod packet;
pub mod udp;

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub use error::{DropReason, WireError};
pub use opcode::{Opcode, OpcodeInfo};
pub use packet::{PacketRepr, RocePacket};

/// A fixed-size header layout and its validated value.
///
/// `emit` then `parse` is the identity on values. Fields the value does not
/// hold are computed by whoever emits the whole packet (checksums, the BTH
/// pad count) and written as zero here.
pub trait HeaderRepr: Sized {
    /// The on-the-wire layout.
    type Header: FromBytes + IntoBytes + KnownLayout + Immutable + Unaligned + 'static;

    /// The header's size on the wire, in bytes.
    const LEN: usize = core::mem::size_of::<Self::Header>();

    /// Validates a header into a value.
    fn parse(header: &Self::Header) -> Result<Self, WireError>;

    /// Writes every field of the header (reserved bits as zero).
    fn emit(&self, header: &mut Self::Header);

    /// Reads and validates a header from the front of untrusted bytes,
    /// returning the value and the bytes after it.
    fn parse_prefix(bytes: &[u8]) -> Result<(Self, &[u8]), WireError> {
        let (header, rest) = split_header::<Self::Header>(bytes)?;
        Ok((Self::parse(header)?, rest))
    }

    /// Writes the header at the front of `out`, returning the bytes after it.
    fn emit_prefix<'b>(&self, out: &'b mut [u8]) -> Result<&'b mut [u8], WireError> {
        let (header, rest) = split_header_mut::<Self::Header>(out)?;
        self.emit(header);
        Ok(rest)
    }
}

/// The short name of a header layout, for error messages.
fn header_name<H>() -> &'static str {
    let full = core::any::type_name::<H>();
    full.rsplit("::").next().unwrap_or(full)
}

/// Borrows a header layout from the front of `bytes`.
pub(crate) fn split_header<H>(bytes: &[u8]) -> Result<(&H, &[u8]), WireError>
where
    H: FromBytes + KnownLayout + Immutable + Unaligned,
{
    H::ref_from_prefix(bytes).map_err(|_| WireError::Truncated {
        header: header_name::<H>(),
        needed: core::mem::size_of::<H>(),
        got: bytes.len(),
    })
}

/// Mutably borrows a header layout from the front of `bytes`.
pub(crate) fn split_header_mut<H>(bytes: &mut [u8]) -> Result<(&mut H, &mut [u8]), WireError>
where
    H: FromBytes + IntoBytes + KnownLayout + Immutable + Unaligned,
{
    let got = bytes.len();
    H::mut_from_prefix(bytes).map_err(|_| WireError::Truncated {
        header: header_name::<H>(),
        needed: core::mem::size_of::<H>(),
        got,
    })
}

/// Reads a 24-bit big-endian field.
pub(crate) const fn u24_from_be(bytes: [u8; 3]) -> u32 {
    u32::from_be_bytes([0, bytes[0], bytes[1], bytes[2]])
}

/// Writes the low 24 bits of `value` big-endian.
pub(crate) const fn u24_to_be(value: u32) -> [u8; 3] {
    let b = value.to_be_bytes();
    [b[1], b[2], b[3]]
}

/// Compile-time size and field-offset assertions for a wire layout:
/// `assert_layout!(T, size = 12, a @ 0, b @ 4);`
macro_rules! assert_layout {
    ($ty:ty, size = $size:expr $(, $field:ident @ $off:expr)* $(,)?) => {
        const _: () = {
            assert!(::core::mem::size_of::<$ty>() == $size, "wire size changed");
            $(
                assert!(
                    ::core::mem::offset_of!($ty, $field) == $off,
                    concat!("wire offset of `", stringify!($field), "` changed")
                );
            )*
        };
    };
}
pub(crate) use assert_layout;

#[cfg(test)]
pub(crate) mod testing {
    //! Checks shared by the header modules' literal tests.
    use super::*;
    use core::fmt::Debug;

    /// `bytes` parse to `value`, and `value` emits exactly `bytes`; every
    /// shorter prefix is reported truncated.
    pub(crate) fn assert_literal<R: HeaderRepr + PartialEq + Debug>(bytes: &[u8], value: &R) {
        assert_eq!(bytes.len(), R::LEN, "literal is not one header long");
        let (parsed, rest) = R::parse_prefix(bytes).expect("literal must parse");
        assert_eq!(&parsed, value, "parse of the literal");
        assert!(rest.is_empty());

        let mut out = vec![0xA5; R::LEN + 3];
        let rest = value.emit_prefix(&mut out).expect("emit");
        assert_eq!(rest, &[0xA5; 3], "emit wrote past the header");
        assert_eq!(&out[..R::LEN], bytes, "emit of the value");

        for cut in 0..bytes.len() {
            assert!(
                matches!(
                    R::parse_prefix(&bytes[..cut]),
                    Err(WireError::Truncated { .. })
                ),
                "a {cut}-byte prefix must be truncated"
            );
            let mut short = vec![0; cut];
            assert!(matches!(
                value.emit_prefix(&mut short),
                Err(WireError::Truncated { .. })
            ));
        }
    }
}
