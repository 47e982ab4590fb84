//! Resource bookkeeping for the verbs: pure data structures, no device, no
//! platform, no clock (guide 6, 6.5.1.1, 6.8, 7.1).
//!
//! Contract:
//! - [`ObjectTable`] holds objects by their device number (QPN, CQN, SRQN,
//!   EQN, MPT index, PD number) with O(1) insert, lookup and removal. A
//!   [`Handle`] is `kind tag << 56 | generation << 24 | number`; every removal bumps the
//!   slot's generation, so a handle to a removed object never finds the
//!   object that took its number later (guide 6.5.5 item 12: never deliver a
//!   completion or event to a stale owner). Lookup by bare number serves
//!   events from the device and returns the current occupant and its handle.
//!   A new life of the device's tables starts its generations at
//!   [`life_generation`] (the time), so handles do not repeat across lives.
//! - Per-object use counts ([`ObjectTable::acquire`]): removing an object
//!   still in use fails with [`ResourceError::Busy`] (guide 6.8.3: destroy of
//!   a PD, CQ or SRQ still referenced returns busy).
//! - [`QpTable`] numbers QPs with [`QpnAllocator`]: the special QPs of each
//!   port are reserved (PRM 5: QP `2·(port−1)` is the SMI QP, `2·(port−1)+1`
//!   the GSI QP) and a destroyed QP's number is quarantined for a quiet
//!   period before reuse (guide 6.5.2, 6.5.5 item 11: TIME WAIT). Time is
//!   an input (`now_ns`); the core never reads a clock.
//! - [`RangeAllocator`] hands out contiguous MTT ranges (PRM 6.0),
//!   [`KeyAllocator`] MPT indices with 8-bit tags forming keys
//!   `index << 8 | tag` (PRM 7.1), [`UarAllocator`] doorbell pages with page
//!   0 kept for the kernel (PRM 9.1).
//! - Bad input (out-of-range numbers, stale handles, double frees) gets a
//!   [`ResourceError`] and changes nothing; nothing here panics on it.
//! - Memory: every structure allocates once, when it is created, with
//!   vectors sized from the device's limits. Lookups, inserts, removals and
//!   allocations never allocate, so all of them may run at DISPATCH_LEVEL
//!   (the structures are not synchronised; the caller's lock guards them).
//!
//! ```
//! use hca_miniport_core::resources::{kind, ObjectTable, ResourceError};
//!
//! // CQ numbers 0..4; an event names CQ 0 by its bare number.
//! let mut cqs = ObjectTable::<kind::Cq, &str>::new(4, 0..0)?;
//! let old = cqs.insert_with(|_| "old owner")?;
//! cqs.remove(old)?;
//! for _ in 0..4 {
//!     cqs.insert_with(|_| "new owner")?;
//! }
//! // Number 0 now belongs to someone else: the old handle finds nothing.
//! assert_eq!(cqs.get(old), None);
//! assert_eq!(cqs.get_by_number(old.number()).map(|(_, cq)| *cq), Some("new owner"));
//! # Ok::<(), ResourceError>(())
//! ```

#![warn(missing_docs)]

mod error;
mod free_list;
mod keys;
mod qpn;
mod ranges;
mod table;
mod uar;

use core::fmt;
use core::hash::{Hash, Hasher};
use core::marker::PhantomData;

use ib_types::status::IbStatus;

pub use error::ResourceError;
pub use keys::{KeyAllocator, MemoryKey};
pub use qpn::{QpTable, QpnAllocator, SpecialQp, rotation_start};
pub use ranges::{EntryRange, RangeAllocator};
pub use table::ObjectTable;
pub use uar::{KERNEL_UAR, UarAllocator};

/// The most objects of one kind: object numbers and MPT indices are 24-bit
/// quantities (QPNs on the wire, `index << 8` in a 32-bit key).
pub const MAX_OBJECTS: u32 = 1 << 24;

mod sealed {
    pub trait Sealed {}
}

/// A kind of numbered object; implemented by the markers in [`kind`] only.
pub trait ObjectKind: sealed::Sealed {
    /// The kind as a value (for errors).
    const KIND: Kind;
}

macro_rules! kinds {
    ($($(#[$meta:meta])* $name:ident => $label:literal, $status:ident;)+) => {
        /// The kinds of numbered objects, as values.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Kind {
            $($(#[$meta])* $name,)+
        }

        impl Kind {
            /// A short name, as the PRM and the guide spell it.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Self::$name => $label,)+
                }
            }

            /// The kind's tag in the top byte of its handles (never 0).
            pub const fn tag(self) -> u8 {
                self as u8 + 1
            }

            /// The status a verb returns for an invalid handle of this kind.
            pub const fn invalid_handle_status(self) -> IbStatus {
                match self {
                    $(Self::$name => IbStatus::$status,)+
                }
            }
        }

        /// Marker types naming the kind of object a [`Handle`] or
        /// [`ObjectTable`] is for. They have no values.
        pub mod kind {
            $(
                $(#[$meta])*
                #[derive(Debug)]
                pub enum $name {}

                impl super::sealed::Sealed for $name {}

                impl super::ObjectKind for $name {
                    const KIND: super::Kind = super::Kind::$name;
                }
            )+
        }
    };
}

kinds! {
    /// Protection domains.
    Pd => "PD", InvalidPdHandle;
    /// Address vectors.
    Av => "AV", InvalidAvHandle;
    /// Queue pairs.
    Qp => "QP", InvalidQpHandle;
    /// Completion queues.
    Cq => "CQ", InvalidCqHandle;
    /// Shared receive queues.
    Srq => "SRQ", InvalidSrqHandle;
    /// Event queues (internal to the driver; no CI handle kind of their own).
    Eq => "EQ", InvalidHandle;
    /// Memory regions (MPT entries of kind region).
    Mr => "MR", InvalidMrHandle;
    /// Memory windows (MPT entries of kind window).
    Mw => "MW", InvalidMwHandle;
    /// Multicast memberships (one UD QP attached to one group).
    Mcast => "MCAST", InvalidMcastHandle;
}

/// The bits of a handle that hold the object's number.
const NUMBER_MASK: u64 = (1 << 24) - 1;

/// The first generation of the object tables of a life of the device that
/// begins at the platform's monotonic time `now_ns`: the time in
/// microseconds, modulo 2^32, never 0 ([`ObjectTable::from_generation`]).
///
/// Every life (a device object's start, a restart after a failure, a
/// re-plug) makes its tables anew; were they to start at generation 1, its
/// first objects would get exactly the handles the previous life's first
/// objects had (same numbers, same generation), and a client's stale
/// handle would name a new object. Starting at the time instead, a later
/// life starts past every generation an earlier one issued unless one of
/// that life's numbers was reused more than once per microsecond of its
/// life on average (a create and destroy costs device commands, and a
/// number comes back only after every other free one); past 2^32 µs (71
/// minutes) the start wraps, and a stale handle then matches only with
/// probability about (its number's reuses) / 2^32. Deterministic under a
/// simulated clock, where two lives begun at the same virtual instant
/// (no time advanced between them) share their start.
pub fn life_generation(now_ns: u64) -> u32 {
    ((now_ns / 1_000) as u32).max(1)
}

/// A generation-checked reference to an object in an [`ObjectTable`]:
/// `kind tag << 56 | generation << 24 | number`, typed by the object's kind.
///
/// The kind's tag ([`Kind::tag`]) in the top byte means a handle of one
/// kind is never taken for another (a PD handle passed as an AV handle is
/// refused even when both objects have the same number and generation).
/// Numbers are below [`MAX_OBJECTS`] (24 bits). Generations start at 1
/// (a device's tables: at [`life_generation`], so handles do not repeat
/// across its lives) and skip 0 when they wrap, so no handle is 0 (the
/// CI's "no object" value, `ib_types::handle`); a generation repeats only
/// after 2^32 − 1 reuses of one number.
pub struct Handle<K> {
    raw: u64,
    kind: PhantomData<fn() -> K>,
}

impl<K: ObjectKind> Handle<K> {
    pub(crate) const fn new(number: u32, generation: u32) -> Self {
        Self::from_raw(
            (K::KIND.tag() as u64) << 56
                | (generation as u64) << 24
                | (number as u64 & NUMBER_MASK),
        )
    }

    /// True when the handle carries this kind's tag (a client may pass any
    /// value back; a table lookup refuses one that does not).
    pub const fn is_of_its_kind(self) -> bool {
        (self.raw >> 56) as u8 == K::KIND.tag()
    }

    /// Rebuilds a handle from the raw value a client passed back. Any value
    /// is accepted; a table lookup decides whether it names a live object.
    pub const fn from_raw(raw: u64) -> Self {
        Self {
            raw,
            kind: PhantomData,
        }
    }

    /// The raw 64-bit value, as handed to clients.
    pub const fn raw(self) -> u64 {
        self.raw
    }

    /// The object's device number (low 24 bits).
    pub const fn number(self) -> u32 {
        (self.raw & NUMBER_MASK) as u32
    }

    /// The slot generation the handle was issued for (bits 24..56).
    pub const fn generation(self) -> u32 {
        (self.raw >> 24) as u32
    }
}

// Manual impls: derives would demand `K: Clone` etc. of the marker.
impl<K> Clone for Handle<K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for Handle<K> {}

impl<K> PartialEq for Handle<K> {
    fn eq(&self, other: &Self) -> bool {
        self.raw == other.raw
    }
}

impl<K> Eq for Handle<K> {}

impl<K> Hash for Handle<K> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.raw.hash(state);
    }
}

impl<K: ObjectKind> fmt::Debug for Handle<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Handle<{}>(#{} gen {})",
            K::KIND.name(),
            self.number(),
            self.generation()
        )
    }
}

/// Conversions between typed handles and the CI's handle types
/// (`ib_types::handle`), which carry the same 64-bit value.
macro_rules! ci_handles {
    ($($kind:ident => $ci:ident;)+) => {$(
        impl From<Handle<kind::$kind>> for ib_types::handle::$ci {
            fn from(handle: Handle<kind::$kind>) -> Self {
                Self::from_raw(handle.raw())
            }
        }

        impl From<ib_types::handle::$ci> for Handle<kind::$kind> {
            fn from(handle: ib_types::handle::$ci) -> Self {
                Self::from_raw(handle.raw())
            }
        }
    )+};
}

ci_handles! {
    Pd => PdHandle;
    Av => AvHandle;
    Qp => QpHandle;
    Cq => CqHandle;
    Srq => SrqHandle;
    Mr => MrHandle;
    Mw => MwHandle;
    Mcast => McastHandle;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_convert_to_and_from_ci_handles() {
        let handle = Handle::<kind::Cq>::new(5, 2);
        let ci = ib_types::handle::CqHandle::from(handle);
        assert_eq!(ci.raw(), handle.raw());
        assert!(!ci.is_null());
        assert_eq!(Handle::<kind::Cq>::from(ci), handle);
    }

    #[test]
    fn handle_packs_generation_over_number() {
        let handle = Handle::<kind::Qp>::new(0x12_3456, 7);
        assert_eq!(handle.raw(), 0x0300_0000_0712_3456);
        assert!(handle.is_of_its_kind());
        assert!(!Handle::<kind::Pd>::from_raw(handle.raw()).is_of_its_kind());
        assert_eq!(handle.number(), 0x12_3456);
        assert_eq!(handle.generation(), 7);
        assert_eq!(Handle::<kind::Qp>::from_raw(handle.raw()), handle);
        assert_eq!(alloc::format!("{handle:?}"), "Handle<QP>(#1193046 gen 7)");
    }

    #[test]
    fn kinds_map_to_their_handle_statuses() {
        assert_eq!(Kind::Pd.invalid_handle_status(), IbStatus::InvalidPdHandle);
        assert_eq!(Kind::Mw.invalid_handle_status(), IbStatus::InvalidMwHandle);
        assert_eq!(<kind::Srq as ObjectKind>::KIND, Kind::Srq);
    }
}
