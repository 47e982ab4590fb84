//! The fast path's and the setup's errors, each with the IB status a verbs
//! call returns for it.

use hca_prm::wqe::WqeError;
use ib_types::status::IbStatus;
use ib_types::wr::WrError;

use crate::dma::BufferError;

/// Why a work request was not posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostErrorKind {
    /// The queue has no room for the WQE (the consumer has not polled the
    /// completions that free it yet).
    #[error("the work queue is full")]
    QueueFull,
    /// The request breaks the verbs rules of the queue: an operation its
    /// transport does not support, too many SGEs, inline data longer than
    /// the queue takes, a missing or unexpected UD destination.
    #[error(transparent)]
    Request(#[from] WrError),
    /// The request cannot be a WQE (inline data that does not match its
    /// SGEs, an address vector given without a UD destination).
    #[error(transparent)]
    Wqe(#[from] WqeError),
    /// The WQE does not fit the queue's stride.
    #[error("the WQE needs {bytes} bytes, the queue's stride holds {stride}")]
    WqeTooLarge {
        /// Bytes the WQE needs.
        bytes: usize,
        /// Bytes of the stride.
        stride: usize,
    },
}

impl PostErrorKind {
    /// The status a verbs post returns for this failure.
    pub const fn status(&self) -> IbStatus {
        match self {
            Self::QueueFull => IbStatus::InsufficientResources,
            Self::Request(e) => e.status(),
            Self::Wqe(WqeError::TooManySges { .. }) | Self::WqeTooLarge { .. } => {
                IbStatus::InvalidMaxSge
            }
            Self::Wqe(_) => IbStatus::InvalidParameter,
        }
    }
}

/// A post that stopped at a work request: the `posted` requests before it
/// are in the ring (and the device was told about them); it and those after
/// it were not written at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{posted} work requests posted, then: {kind}")]
pub struct PostError {
    /// Requests posted before the failing one.
    pub posted: usize,
    /// Why the next one was refused.
    pub kind: PostErrorKind,
}

impl PostError {
    /// The status a verbs post returns.
    pub const fn status(&self) -> IbStatus {
        self.kind.status()
    }
}

/// Why a CQ, QP or SRQ cannot be set up from what the kernel answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// A ring or record range is not usable memory.
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// A ring is smaller than its layout says, or a size is out of range.
    #[error("{what}: {detail}")]
    Layout {
        /// The object's part.
        what: &'static str,
        /// What is wrong.
        detail: &'static str,
    },
    /// The kernel answered with another UAR page than the context's: the
    /// device would ignore every doorbell (PRM 9.1).
    #[error("the object's UAR page {found} is not the context's {expected}")]
    ForeignUar {
        /// The context's page.
        expected: u32,
        /// The page in the response.
        found: u32,
    },
}

impl SetupError {
    /// The status the object's create returns.
    pub const fn status(&self) -> IbStatus {
        IbStatus::InvalidParameter
    }
}
