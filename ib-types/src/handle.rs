//! Typed object handles.
//!
//! A handle is a 64-bit value the kernel hands out for an object it owns (an
//! index plus a generation in practice; callers must treat it as opaque). One
//! type per object kind lets the compiler reject a CQ handle where a QP handle
//! is due, in Rust code and in ABI layouts alike. Zero is never a live handle.

use core::fmt;

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::Le64;

macro_rules! handles {
    ($($(#[$meta:meta])* $name:ident;)+) => {$(
        $(#[$meta])*
        #[derive(
            Clone, Copy, PartialEq, Eq, Hash, Default,
            FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
        )]
        #[repr(transparent)]
        pub struct $name(Le64);

        impl $name {
            /// The "no object" value.
            pub const NULL: Self = Self(Le64::new(0));

            /// Wraps a raw 64-bit handle value.
            pub const fn from_raw(raw: u64) -> Self {
                Self(Le64::new(raw))
            }

            /// The raw 64-bit value.
            pub const fn raw(self) -> u64 {
                self.0.get()
            }

            /// True for the "no object" value.
            pub const fn is_null(self) -> bool {
                self.raw() == 0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#x})"), self.raw())
            }
        }
    )+};
}

handles! {
    /// An open channel adapter.
    CaHandle;
    /// A protection domain.
    PdHandle;
    /// An address vector (address handle).
    AvHandle;
    /// A queue pair.
    QpHandle;
    /// A completion queue.
    CqHandle;
    /// A shared receive queue.
    SrqHandle;
    /// A memory region.
    MrHandle;
    /// A memory window.
    MwHandle;
    /// A QP's membership in a multicast group.
    McastHandle;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_little_endian_u64() {
        let h = QpHandle::from_raw(0x0102_0304_0506_0708);
        assert_eq!(h.as_bytes(), &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(QpHandle::read_from_bytes(h.as_bytes()).unwrap(), h);
        assert!(CqHandle::NULL.is_null() && !h.is_null());
        assert_eq!(format!("{h:?}"), "QpHandle(0x102030405060708)");
    }
}
