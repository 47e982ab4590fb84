//! The HCA's programmer's reference manual (`docs/prm.md`) as code.
//!
//! Every structure the driver and the device exchange — control registers,
//! command entries and mailboxes, contexts, WQE/CQE/EQE formats, doorbells —
//! is declared here once, `#[repr(C)]` with zerocopy derives, little-endian
//! fields (network order where the PRM says so) and a compile-time size and
//! offset assertion. The device model (`sim-hca`), the miniport core and the
//! user-mode plug-in all build on these declarations, so a layout cannot
//! drift between the two sides of the contract. `no_std`, no allocation, no
//! `unsafe`.
//!
//! Section numbers in the docs refer to `docs/prm.md`.

#![cfg_attr(not(test), no_std)]
#![forbid(unsafe_code)]

/// Compile-time size and field-offset assertions for a layout.
macro_rules! assert_layout {
    ($ty:ty, size = $size:expr $(, $field:ident @ $off:expr)* $(,)?) => {
        const _: () = {
            assert!(::core::mem::size_of::<$ty>() == $size, "PRM size changed");
            $(
                assert!(
                    ::core::mem::offset_of!($ty, $field) == $off,
                    concat!("PRM offset of `", stringify!($field), "` changed")
                );
            )*
        };
    };
}

/// Declares a code enum read from memory through `from_code`/`TryFrom`:
/// an unknown code is an [`AbiError::InvalidCode`], never a transmute.
/// Generates `ALL`, `code()`, `from_code()` and the conversions.
macro_rules! prm_code {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident : $raw:ty {
            $($(#[$vmeta:meta])* $variant:ident = $value:expr),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr($raw)]
        $vis enum $name {
            $($(#[$vmeta])* $variant = $value,)+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The raw code.
            pub const fn code(self) -> $raw {
                self as $raw
            }

            /// Reads a raw code; an unknown code is an error.
            pub const fn from_code(code: $raw) -> Result<Self, ::ib_types::AbiError> {
                $(
                    if code == Self::$variant as $raw {
                        return Ok(Self::$variant);
                    }
                )+
                Err(::ib_types::AbiError::InvalidCode {
                    type_name: stringify!($name),
                    value: code as u64,
                })
            }
        }

        impl TryFrom<$raw> for $name {
            type Error = ::ib_types::AbiError;
            fn try_from(code: $raw) -> Result<Self, ::ib_types::AbiError> {
                Self::from_code(code)
            }
        }

        impl From<$name> for $raw {
            fn from(value: $name) -> $raw {
                value.code()
            }
        }
    };
}

pub mod av;
pub mod cmd;
pub mod cqe;
pub mod ctx;
pub mod doorbell;
pub mod eqe;
pub mod mpt;
pub mod owner;
pub mod regs;
pub mod uverbs;
pub mod wqe;

pub use ib_types::abi::{Be32, Le16, Le32, Le64};
