//! Declaration macros shared by the crate: closed code enums read through
//! `TryFrom` (never a transmute) and compile-time layout assertions.

/// Declares a `#[repr($raw)]` enum for a code that crosses a trust boundary.
///
/// Generates `ALL` (every variant, in declaration order, for table-driven
/// tests), `code()`, a fallible `from_code()` returning
/// [`AbiError::InvalidCode`](crate::AbiError::InvalidCode), and the matching
/// `TryFrom`/`From` conversions.
macro_rules! code_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident : $raw:ty {
            $(
                $(#[$vmeta:meta])*
                $variant:ident = $value:expr
            ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr($raw)]
        $vis enum $name {
            $(
                $(#[$vmeta])*
                $variant = $value,
            )+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The raw code of this variant.
            #[inline]
            pub const fn code(self) -> $raw {
                self as $raw
            }

            /// Reads a raw code; unknown codes are an error, never a panic.
            #[inline]
            pub const fn from_code(code: $raw) -> Result<Self, $crate::AbiError> {
                $(
                    if code == Self::$variant as $raw {
                        return Ok(Self::$variant);
                    }
                )+
                Err($crate::AbiError::InvalidCode {
                    type_name: stringify!($name),
                    value: code as u64,
                })
            }
        }

        impl TryFrom<$raw> for $name {
            type Error = $crate::AbiError;
            #[inline]
            fn try_from(code: $raw) -> Result<Self, $crate::AbiError> {
                Self::from_code(code)
            }
        }

        impl From<$name> for $raw {
            #[inline]
            fn from(value: $name) -> $raw {
                value.code()
            }
        }
    };
}

/// Compile-time size and field-offset assertions for an ABI layout.
///
/// `assert_layout!(T, size = 16, a @ 0, b @ 8);`
#[allow(unused_macros, reason = "used by the ABI modules")]
macro_rules! assert_layout {
    ($ty:ty, size = $size:expr $(, $field:ident @ $off:expr)* $(,)?) => {
        const _: () = {
            assert!(::core::mem::size_of::<$ty>() == $size, "ABI size changed");
            $(
                assert!(
                    ::core::mem::offset_of!($ty, $field) == $off,
                    concat!("ABI offset of `", stringify!($field), "` changed")
                );
            )*
        };
    };
}
