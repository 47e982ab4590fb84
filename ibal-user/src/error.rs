//! The library's errors: each says which layer refused and why.

use ib_types::abi::AbiError;
use ib_types::interface::InterfaceVersion;
use ib_types::ioctl::VerbId;
use ib_types::status::{IbStatus, NtStatus};

use crate::device::OsStatus;

/// `STATUS_REVISION_MISMATCH`: the proxy refused the library's ABI version.
pub const STATUS_REVISION_MISMATCH: NtStatus = NtStatus::from_raw(0xC000_0059);
/// Win32 `ERROR_REVISION_MISMATCH`, the same refusal through `GetLastError`.
pub const ERROR_REVISION_MISMATCH: u32 = 1306;

/// Why a call of the access library failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The OS refused an operation on the device (enumeration, open,
    /// `DeviceIoControl`) with a status that is not a verb's.
    #[error("the OS refused {what}: {status:?}")]
    Os {
        /// The operation.
        what: &'static str,
        /// The OS status.
        status: OsStatus,
    },
    /// No HCA matches the selector.
    #[error("no HCA matches {0}")]
    NoSuchCa(String),
    /// The two sides speak ABI versions that do not satisfy each other:
    /// the kernel refused ours (`kernel: None`), or answered one ours does
    /// not accept.
    #[error("ABI version mismatch: the library speaks {library:?}, the kernel {kernel:?}")]
    AbiMismatch {
        /// The library's version.
        library: InterfaceVersion,
        /// The kernel's, when it answered one.
        kernel: Option<InterfaceVersion>,
    },
    /// The verb failed with an IB status.
    #[error("{verb:?} failed: {status:?}")]
    Verb {
        /// The verb.
        verb: VerbId,
        /// Its status.
        status: IbStatus,
    },
    /// A buffer does not encode or decode as the verb's ABI says.
    #[error("{verb:?}: malformed buffer: {error}")]
    Abi {
        /// The verb.
        verb: VerbId,
        /// What is wrong.
        error: AbiError,
    },
    /// The call needs the CA's UVP plugin (ring layouts, the fast path)
    /// and none is loaded.
    #[error("{0} needs the CA's UVP plugin, which is not loaded")]
    NeedsPlugin(&'static str),
    /// The plugin could not be loaded.
    #[error(transparent)]
    Plugin(#[from] crate::plugin::PluginError),
    /// The plugin's pre hook refused the call: no IOCTL was sent (Table
    /// 10-1 row 4).
    #[error("the plugin refused {verb:?} before the call: {status:?}")]
    PreCall {
        /// The verb.
        verb: VerbId,
        /// Pre's status.
        status: IbStatus,
    },
    /// The kernel did the call, the plugin's post hook refused its answer;
    /// an object the call created was destroyed (Table 10-1 row 2).
    #[error("the plugin refused the kernel's answer to {verb:?}: {status:?}")]
    PostCall {
        /// The verb.
        verb: VerbId,
        /// Post's status.
        status: IbStatus,
    },
    /// The plugin broke Table 10-1: its post answered success after the
    /// IOCTL failed with `status` (or its pre overran its buffer).
    #[error("the plugin broke the call protocol of {verb:?} (the call failed: {status:?})")]
    PluginBug {
        /// The verb.
        verb: VerbId,
        /// The call's status.
        status: IbStatus,
    },
    /// A fast-path post stopped at a request: `posted` went before it.
    #[error("{posted} work requests posted, the next refused: {status:?}")]
    Refused {
        /// Requests posted before the refused one.
        posted: usize,
        /// Why it was refused.
        status: IbStatus,
    },
    /// A request the library refuses before any call (a size out of range).
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// An operation the library or its plugin does not offer (yet).
    #[error("not supported: {0}")]
    Unsupported(&'static str),
}

impl Error {
    /// The IB status of this failure, as a verbs caller sees it.
    pub fn status(&self) -> IbStatus {
        match self {
            Self::Verb { status, .. }
            | Self::PreCall { status, .. }
            | Self::PostCall { status, .. }
            | Self::PluginBug { status, .. }
            | Self::Refused { status, .. } => *status,
            Self::NeedsPlugin(_) | Self::Unsupported(_) => IbStatus::Unsupported,
            Self::NoSuchCa(_) => IbStatus::InvalidGuid,
            Self::Os { status, .. } => match status {
                OsStatus::Nt(nt) => IbStatus::from_ntstatus(*nt),
                OsStatus::Win32(_) => IbStatus::GenericError,
            },
            _ => IbStatus::InvalidParameter,
        }
    }
}

/// The library's result.
pub type Result<T, E = Error> = core::result::Result<T, E>;
