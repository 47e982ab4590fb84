//! The errors of the memory translation service and their IB status at the
//! verbs edge.

use driver_platform::{Irql, NtStatus};
use ib_types::access::AccessFlags;
use ib_types::status::IbStatus;

use crate::cmd::CommandError;
use crate::resources::ResourceError;

/// `STATUS_ACCESS_VIOLATION`: what probing a bad range returns.
const STATUS_ACCESS_VIOLATION: u32 = 0xC000_0005;

/// Why a registration, re-registration, deregistration or query failed.
/// Every input error is found before anything is allocated, locked or sent
/// to the device, and changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MrError {
    /// A region of zero bytes.
    #[error("a memory region cannot be empty")]
    ZeroLength,
    /// `start + length` wraps the 64-bit address space.
    #[error("range {start:#x}+{length:#x} overflows")]
    RangeOverflow {
        /// The start address.
        start: u64,
        /// The length.
        length: u64,
    },
    /// Longer than the device's `max_mr_size` (PRM 5.2).
    #[error("{length} bytes exceed the device's largest region ({max})")]
    TooLong {
        /// The length asked for.
        length: u64,
        /// `max_mr_size`.
        max: u64,
    },
    /// Remote write or remote atomic without local write (IBA C11-13; the
    /// device refuses it too, PRM 7.1).
    #[error("access {access:?}: remote write or atomic needs local write")]
    InvalidAccess {
        /// The rights asked for.
        access: AccessFlags,
    },
    /// The rights need device writes, but the translation's pages were
    /// locked read-only (a shared region or a re-registration keeping the
    /// translation).
    #[error("access {access:?} needs pages locked for writing")]
    ReadOnlyPages {
        /// The rights asked for.
        access: AccessFlags,
    },
    /// A protection domain number beyond 24 bits (PRM 7.1).
    #[error("PD number {pd:#x} exceeds 24 bits")]
    InvalidPd {
        /// The number given.
        pd: u32,
    },
    /// The region needs more MTT entries than the table has for regions.
    #[error("{pages} pages exceed the {capacity} MTT entries available to regions")]
    TooManyPages {
        /// Pages the region spans.
        pages: u64,
        /// MTT entries the service manages.
        capacity: u32,
    },
    /// A physical page list whose length is not what the region spans.
    #[error("{given} pages given, the region spans {needed}")]
    PageCountMismatch {
        /// Pages in the list.
        given: usize,
        /// Pages the offset and length span.
        needed: u64,
    },
    /// A physical page address not aligned to the page size.
    #[error("page {index} at bus {address:#x} is not aligned to 2^{page_shift}")]
    UnalignedPage {
        /// Its position in the list.
        index: usize,
        /// The address.
        address: u64,
        /// log2 of the page size.
        page_shift: u8,
    },
    /// A page size outside 4 KiB ..= 1 GiB (PRM 6.0).
    #[error("page shift {0} is outside 12..=30")]
    InvalidPageShift(u8),
    /// The first byte's offset is not inside the first page.
    #[error("first byte offset {offset:#x} is not inside a 2^{page_shift}-byte page")]
    InvalidPageOffset {
        /// The offset.
        offset: u32,
        /// log2 of the page size.
        page_shift: u8,
    },
    /// User pages can only be locked at PASSIVE_LEVEL or APC_LEVEL
    /// (`MmProbeAndLockPages` on pageable memory), kernel pages at
    /// DISPATCH_LEVEL or below; the caller is above.
    #[error("user pages cannot be locked at {irql:?}")]
    IrqlTooHigh {
        /// The caller's IRQL.
        irql: Irql,
    },
    /// Locking the pages failed (a bad or read-only range, a kernel address
    /// from user mode, no memory).
    #[error("locking the pages failed: {0:?}")]
    Lock(NtStatus),
    /// Mapping the locked pages for DMA failed.
    #[error("mapping the pages for DMA failed: {0:?}")]
    Map(NtStatus),
    /// The DMA adapter's mapping does not describe the locked pages (a page
    /// missing or not page aligned): a platform bug, refused rather than
    /// written to the device.
    #[error("the DMA mapping does not describe the locked pages")]
    BadMapping,
    /// No MTT range or MPT entry left.
    #[error("out of translation resources: {0}")]
    Resources(ResourceError),
    /// A device command failed.
    #[error("device command failed: {0}")]
    Command(CommandError),
    /// Memory windows are bound to the region (PRM 7.1: `HW2SW_MPT` of a
    /// region with bound windows answers `RESOURCE_BUSY`).
    #[error("{count} memory windows are bound to the region")]
    WindowsBound {
        /// Windows bound.
        count: u32,
    },
    /// An unbind hook without a matching bind.
    #[error("no memory window is bound to the region")]
    NoWindowBound,
    /// A re-registration that changes nothing.
    #[error("a re-registration must change something")]
    NothingToChange,
    /// A new address range for a region registered from a physical page
    /// list: there is nothing to lock; register a new physical region.
    #[error("a physical region cannot be given a new virtual range")]
    PhysicalRange,
    /// The re-registration's `HW2SW_MPT` succeeded, then both the new entry
    /// and the restoration of the old one failed: the region is gone (its
    /// resources were freed) and its keys are dead.
    #[error("re-registration failed and the old region could not be restored: {0}")]
    RegionLost(CommandError),
}

impl MrError {
    /// The IB status a verb reports for this error (at the API edge).
    pub fn ib_status(&self) -> IbStatus {
        match self {
            Self::ZeroLength
            | Self::RangeOverflow { .. }
            | Self::TooLong { .. }
            | Self::PageCountMismatch { .. }
            | Self::UnalignedPage { .. }
            | Self::InvalidPageShift(_)
            | Self::InvalidPageOffset { .. }
            | Self::NothingToChange
            | Self::PhysicalRange => IbStatus::InvalidParameter,
            Self::InvalidAccess { .. } | Self::ReadOnlyPages { .. } => IbStatus::InvalidPermission,
            Self::InvalidPd { .. } => IbStatus::InvalidPdHandle,
            Self::TooManyPages { .. } => IbStatus::InsufficientResources,
            Self::IrqlTooHigh { .. } => IbStatus::InvalidState,
            Self::Lock(status) => {
                if status.raw() == STATUS_ACCESS_VIOLATION {
                    IbStatus::InvalidPermission
                } else {
                    IbStatus::from_ntstatus(*status)
                }
            }
            Self::Map(_) => IbStatus::InsufficientResources,
            Self::BadMapping => IbStatus::GenericError,
            Self::Resources(error) => error.ib_status(),
            Self::Command(error) | Self::RegionLost(error) => error.ib_status(),
            Self::WindowsBound { .. } => IbStatus::ResourceBusy,
            Self::NoWindowBound => IbStatus::InvalidState,
        }
    }
}

impl From<ResourceError> for MrError {
    fn from(error: ResourceError) -> Self {
        Self::Resources(error)
    }
}

impl From<CommandError> for MrError {
    fn from(error: CommandError) -> Self {
        Self::Command(error)
    }
}

impl From<MrError> for IbStatus {
    fn from(error: MrError) -> Self {
        error.ib_status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hca_prm::cmd::{CmdStatus, Opcode};

    #[test]
    fn errors_map_to_failure_statuses() {
        let cases = [
            (MrError::ZeroLength, IbStatus::InvalidParameter),
            (
                MrError::InvalidAccess {
                    access: AccessFlags::REMOTE_WRITE,
                },
                IbStatus::InvalidPermission,
            ),
            (MrError::WindowsBound { count: 1 }, IbStatus::ResourceBusy),
            (
                MrError::Resources(ResourceError::Exhausted),
                IbStatus::InsufficientResources,
            ),
            (
                MrError::Lock(NtStatus::from_raw(STATUS_ACCESS_VIOLATION)),
                IbStatus::InvalidPermission,
            ),
            (
                MrError::Command(CommandError::Status {
                    opcode: Opcode::Hw2SwMpt,
                    status: CmdStatus::ResourceBusy,
                }),
                IbStatus::ResourceBusy,
            ),
            (
                MrError::IrqlTooHigh {
                    irql: Irql::DISPATCH,
                },
                IbStatus::InvalidState,
            ),
        ];
        for (error, status) in cases {
            assert_eq!(IbStatus::from(error), status, "{error}");
        }
    }
}
