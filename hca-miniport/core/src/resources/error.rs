//! The errors of the resource layer and their IB status at the verbs edge.

use ib_types::status::IbStatus;

use super::Kind;

/// Why a resource operation was refused. Every refusal leaves the structure
/// unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResourceError {
    /// Every number (or entry, or page) that may be handed out is in use.
    #[error("no free resource left")]
    Exhausted,
    /// Enough MTT entries are free in total, but no contiguous run is long
    /// enough.
    #[error("no contiguous free range of the requested length (fragmented)")]
    Fragmented,
    /// Every QP number that is not in use is still in its quiet period; the
    /// earliest becomes reusable at `reusable_at_ns`.
    #[error("every free QP number is still quarantined (reusable at {reusable_at_ns} ns)")]
    AllQuarantined {
        /// When the oldest quarantined number leaves quarantine.
        reusable_at_ns: u64,
    },
    /// The handle is malformed, or names an object that has been removed
    /// (its number may since have been given to another object).
    #[error("invalid or stale {} handle", .kind.name())]
    InvalidHandle {
        /// The kind of object the handle was for.
        kind: Kind,
    },
    /// The number is outside the table, or (when releasing) not in use.
    #[error("number {number} is out of range or not in use")]
    InvalidNumber {
        /// The offending number.
        number: u32,
    },
    /// The number is already occupied by a live object.
    #[error("number {number} is already in use")]
    NumberInUse {
        /// The occupied number.
        number: u32,
    },
    /// The number belongs to a reserved range (special QPs, the kernel's
    /// doorbell page) and cannot be handed out or returned this way.
    #[error("number {number} is reserved")]
    Reserved {
        /// The reserved number.
        number: u32,
    },
    /// The object still has users (dependent objects, operations in flight).
    #[error("object is in use ({uses} users)")]
    Busy {
        /// How many uses are outstanding.
        uses: u32,
    },
    /// A release without a matching acquire.
    #[error("release without a matching acquire")]
    NotAcquired,
    /// A range that is empty, out of bounds, or not exactly an allocated
    /// range (including one already freed).
    #[error("range {start}+{len} is empty, out of bounds or not allocated")]
    InvalidRange {
        /// First entry of the range.
        start: u32,
        /// Entries in the range.
        len: u32,
    },
    /// A memory key whose index is not allocated or whose tag is not the
    /// index's current tag.
    #[error("memory key {key:#x} is not current")]
    InvalidKey {
        /// The raw key.
        key: u32,
    },
    /// A port number outside `1..=num_ports`.
    #[error("port {port} does not exist")]
    InvalidPort {
        /// The port number given.
        port: u8,
    },
    /// A structure was created with a capacity or reserved range its numbers
    /// cannot express (beyond 24 bits, or a reserved range outside it).
    #[error("invalid capacity or reserved range")]
    InvalidCapacity,
}

impl ResourceError {
    /// The IB status a verb returns for this error (the API edge's mapping).
    pub const fn ib_status(self) -> IbStatus {
        match self {
            Self::Exhausted | Self::Fragmented | Self::AllQuarantined { .. } => {
                IbStatus::InsufficientResources
            }
            Self::InvalidHandle { kind } => kind.invalid_handle_status(),
            Self::InvalidNumber { .. } => IbStatus::InvalidIndex,
            Self::NumberInUse { .. } => IbStatus::ResourceBusy,
            Self::Reserved { .. } | Self::InvalidRange { .. } | Self::InvalidCapacity => {
                IbStatus::InvalidParameter
            }
            Self::Busy { .. } => IbStatus::ResourceBusy,
            Self::NotAcquired => IbStatus::InvalidState,
            // The key is either an L_Key or an R_Key; the caller knows which
            // and may refine this to `InvalidRkey`.
            Self::InvalidKey { .. } => IbStatus::InvalidLkey,
            Self::InvalidPort { .. } => IbStatus::InvalidPort,
        }
    }
}

impl From<ResourceError> for IbStatus {
    fn from(error: ResourceError) -> Self {
        error.ib_status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_failure_statuses() {
        let cases = [
            (ResourceError::Exhausted, IbStatus::InsufficientResources),
            (ResourceError::Fragmented, IbStatus::InsufficientResources),
            (
                ResourceError::AllQuarantined { reusable_at_ns: 5 },
                IbStatus::InsufficientResources,
            ),
            (
                ResourceError::InvalidHandle { kind: Kind::Qp },
                IbStatus::InvalidQpHandle,
            ),
            (
                ResourceError::InvalidHandle { kind: Kind::Cq },
                IbStatus::InvalidCqHandle,
            ),
            (
                ResourceError::InvalidHandle { kind: Kind::Eq },
                IbStatus::InvalidHandle,
            ),
            (ResourceError::Busy { uses: 2 }, IbStatus::ResourceBusy),
            (
                ResourceError::InvalidPort { port: 9 },
                IbStatus::InvalidPort,
            ),
            (
                ResourceError::InvalidRange { start: 0, len: 0 },
                IbStatus::InvalidParameter,
            ),
        ];
        for (error, status) in cases {
            assert_eq!(IbStatus::from(error), status, "{error}");
            assert!(!status.is_success());
        }
    }

    #[test]
    fn display_names_the_kind() {
        let text = alloc::format!("{}", ResourceError::InvalidHandle { kind: Kind::Srq });
        assert_eq!(text, "invalid or stale SRQ handle");
    }
}
