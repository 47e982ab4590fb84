//! Status codes: the IB access-layer status set ([`IbStatus`]), Windows
//! NTSTATUS values ([`NtStatus`]) and the total mapping between them.
//!
//! Contract:
//! - [`IbStatus`] is a closed `u32` code; unknown codes are rejected by
//!   `from_code`, never transmuted.
//! - [`IbStatus::to_ntstatus`] is injective: every IB status has its own
//!   NTSTATUS, so an IOCTL can carry an `IbStatus` through the I/O manager and
//!   get it back exactly. Statuses whose meaning a standard NTSTATUS already
//!   has use it; the IB-specific rest use customer-defined values in
//!   [`NtStatus::IB_FACILITY`] whose low 16 bits are the `IbStatus` code.
//! - [`IbStatus::from_ntstatus`] is total: it inverts the table exactly and
//!   maps every other value by severity, so it never fails and never panics.
//! - Success-ness is preserved in both directions:
//!   `s.is_success() == s.to_ntstatus().is_success()` and
//!   `IbStatus::from_ntstatus(n).is_success() == n.is_success()`.

use core::fmt;

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::abi::Le32;

code_enum! {
    /// The status of an IB access-layer call (the `ib_api_status_t` family).
    ///
    /// Codes are numbered from 0 in declaration order.
    pub enum IbStatus: u32 {
        /// The call completed successfully.
        Success = 0,
        /// A resource other than memory (a table slot, a queue) ran out.
        InsufficientResources = 1,
        /// A memory allocation failed.
        InsufficientMemory = 2,
        /// A parameter is malformed or out of range.
        InvalidParameter = 3,
        /// A setting is valid alone but not in this combination or context.
        InvalidSetting = 4,
        /// The object looked up does not exist.
        NotFound = 5,
        /// The operation timed out.
        Timeout = 6,
        /// The operation was canceled.
        Canceled = 7,
        /// A wait was interrupted before the operation finished.
        Interrupted = 8,
        /// The caller lacks the rights for the operation.
        InvalidPermission = 9,
        /// The operation or option is not supported by this CA.
        Unsupported = 10,
        /// A buffer or counter overflowed; the output was truncated.
        Overflow = 11,
        /// The multicast group already has the maximum number of QPs attached.
        MaxMcastQpsReached = 12,
        /// The QP is not in a state that permits the operation.
        InvalidQpState = 13,
        /// The QP's path-migration state does not permit the operation.
        InvalidApmState = 14,
        /// The port is not in a state that permits the operation.
        InvalidPortState = 15,
        /// The object is not in a state that permits the operation.
        InvalidState = 16,
        /// The object is in use (has dependants, or an operation is pending).
        ResourceBusy = 17,
        /// The P_Key or P_Key index is invalid.
        InvalidPkey = 18,
        /// The L_Key is invalid.
        InvalidLkey = 19,
        /// The R_Key is invalid.
        InvalidRkey = 20,
        /// The requested number of work requests exceeds the CA limit.
        InvalidMaxWrs = 21,
        /// The requested number of scatter/gather entries exceeds the limit.
        InvalidMaxSge = 22,
        /// The requested CQ size is invalid.
        InvalidCqSize = 23,
        /// The requested SRQ size is invalid.
        InvalidSrqSize = 24,
        /// The QP service type is invalid for the operation.
        InvalidServiceType = 25,
        /// The GID or GID index is invalid.
        InvalidGid = 26,
        /// The LID is invalid.
        InvalidLid = 27,
        /// The GUID is invalid.
        InvalidGuid = 28,
        /// The GUID mask is invalid.
        InvalidGuidMask = 29,
        /// The CA handle is invalid.
        InvalidCaHandle = 30,
        /// The address vector handle is invalid.
        InvalidAvHandle = 31,
        /// The CQ handle is invalid.
        InvalidCqHandle = 32,
        /// The QP handle is invalid.
        InvalidQpHandle = 33,
        /// The SRQ handle is invalid.
        InvalidSrqHandle = 34,
        /// The PD handle is invalid.
        InvalidPdHandle = 35,
        /// The memory region handle is invalid.
        InvalidMrHandle = 36,
        /// The fast memory region handle is invalid.
        InvalidFmrHandle = 37,
        /// The memory window handle is invalid.
        InvalidMwHandle = 38,
        /// The multicast handle is invalid.
        InvalidMcastHandle = 39,
        /// The callback is invalid (missing where required).
        InvalidCallback = 40,
        /// The access-layer handle is invalid.
        InvalidAlHandle = 41,
        /// A handle of unspecified kind is invalid.
        InvalidHandle = 42,
        /// A generic failure (`IB_ERROR`). Not named `Error`: that name would
        /// clash with `TryFrom::Error` inside the `code_enum!` expansion.
        GenericError = 43,
        /// The remote side reported an error.
        RemoteError = 44,
        /// Not a failure: the user-mode verbs plug-in handled the call
        /// completely, so the access layer must skip the kernel IOCTL.
        VerbsProcessingDone = 45,
        /// The work request type is not valid for the QP.
        InvalidWrType = 46,
        /// The QP is in the time-wait state and cannot be reused yet.
        QpInTimewait = 47,
        /// The EE context is in the time-wait state.
        EeInTimewait = 48,
        /// The port number is invalid.
        InvalidPort = 49,
        /// The operation has not finished (nothing to report yet).
        NotDone = 50,
        /// A table index is out of range.
        InvalidIndex = 51,
        /// No entry matched the query.
        NoMatch = 52,
        /// Not a failure: the operation was accepted and completes later
        /// (asynchronously, through its callback or IRP).
        Pending = 53,
        /// A failure whose cause is unknown (including a status code from a
        /// newer peer that this side does not know).
        UnknownError = 54,
        /// The CA was removed (surprise removal or the device leaving): the
        /// call was not sent to it.
        DeviceRemoved = 55,
    }
}

impl IbStatus {
    /// True when the status is not a failure.
    ///
    /// Exactly three statuses are not failures, matching `NT_SUCCESS` of their
    /// NTSTATUS:
    /// - [`Success`](Self::Success): done now.
    /// - [`Pending`](Self::Pending): accepted; the result arrives later.
    /// - [`VerbsProcessingDone`](Self::VerbsProcessingDone): the user-mode
    ///   plug-in finished the call; skip the IOCTL and report success.
    ///
    /// A caller that needs "finished successfully now" compares with
    /// `Success` (after turning `VerbsProcessingDone` into it).
    pub const fn is_success(self) -> bool {
        matches!(
            self,
            Self::Success | Self::Pending | Self::VerbsProcessingDone
        )
    }

    /// True for every status [`is_success`](Self::is_success) rejects.
    pub const fn is_error(self) -> bool {
        !self.is_success()
    }

    /// The NTSTATUS this status travels as. Injective over [`IbStatus::ALL`].
    ///
    /// Standard values are used where the meaning matches; everything else is
    /// [`NtStatus::ib_custom`] of the code. `Interrupted` is deliberately not
    /// `STATUS_ALERTED` (0x101): that value has success severity and would
    /// turn a failure into an `NT_SUCCESS` status.
    pub const fn to_ntstatus(self) -> NtStatus {
        match self {
            Self::Success => NtStatus::SUCCESS,
            Self::Pending => NtStatus::PENDING,
            Self::InsufficientResources => NtStatus::INSUFFICIENT_RESOURCES,
            Self::InsufficientMemory => NtStatus::NO_MEMORY,
            Self::InvalidParameter => NtStatus::INVALID_PARAMETER,
            Self::NotFound => NtStatus::NOT_FOUND,
            Self::Timeout => NtStatus::IO_TIMEOUT,
            Self::Canceled => NtStatus::CANCELLED,
            Self::InvalidPermission => NtStatus::ACCESS_DENIED,
            Self::Unsupported => NtStatus::NOT_SUPPORTED,
            Self::Overflow => NtStatus::BUFFER_OVERFLOW,
            Self::InvalidState => NtStatus::INVALID_DEVICE_STATE,
            Self::ResourceBusy => NtStatus::DEVICE_BUSY,
            Self::InvalidHandle => NtStatus::INVALID_HANDLE,
            Self::GenericError => NtStatus::UNSUCCESSFUL,
            Self::DeviceRemoved => NtStatus::DEVICE_REMOVED,
            other => NtStatus::ib_custom(other),
        }
    }

    /// Maps any NTSTATUS to an IB status; total and panic-free.
    ///
    /// 1. A value produced by [`to_ntstatus`](Self::to_ntstatus) maps back to
    ///    its status exactly.
    /// 2. `STATUS_NOT_IMPLEMENTED` and `STATUS_INVALID_DEVICE_REQUEST` map to
    ///    [`Unsupported`](Self::Unsupported) (what a kernel returns for an
    ///    IOCTL or verb it does not implement).
    /// 3. Any other value in [`NtStatus::IB_FACILITY`] (a code this side does
    ///    not know, or a known code with the wrong severity) maps to
    ///    [`Success`](Self::Success) if it is `NT_SUCCESS`, else to
    ///    [`UnknownError`](Self::UnknownError).
    /// 4. Everything else maps by severity: success and informational to
    ///    [`Success`](Self::Success), warning and error to
    ///    [`GenericError`](Self::GenericError).
    pub const fn from_ntstatus(status: NtStatus) -> Self {
        if status.is_ib_facility() {
            if let Ok(ib) = Self::from_code(status.code() as u32)
                && ib.to_ntstatus().raw() == status.raw()
            {
                return ib;
            }
            return if status.is_success() {
                Self::Success
            } else {
                Self::UnknownError
            };
        }
        let mut i = 0;
        while i < Self::ALL.len() {
            if Self::ALL[i].to_ntstatus().raw() == status.raw() {
                return Self::ALL[i];
            }
            i += 1;
        }
        if status.raw() == NtStatus::NOT_IMPLEMENTED.raw()
            || status.raw() == NtStatus::INVALID_DEVICE_REQUEST.raw()
        {
            return Self::Unsupported;
        }
        if status.is_success() {
            Self::Success
        } else {
            Self::GenericError
        }
    }
}

impl From<IbStatus> for NtStatus {
    fn from(status: IbStatus) -> Self {
        status.to_ntstatus()
    }
}

impl From<NtStatus> for IbStatus {
    fn from(status: NtStatus) -> Self {
        IbStatus::from_ntstatus(status)
    }
}

/// The severity field of an NTSTATUS (bits 31..30).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Severity {
    /// 0b00: success.
    Success,
    /// 0b01: informational (still `NT_SUCCESS`).
    Informational,
    /// 0b10: warning (not `NT_SUCCESS`).
    Warning,
    /// 0b11: error.
    Error,
}

/// A Windows NTSTATUS value.
///
/// Layout (most significant first): severity (2 bits), customer flag (1 bit),
/// reserved (1 bit), facility (12 bits), code (16 bits). `NT_SUCCESS` is
/// "the signed value is non-negative", i.e. severity success or
/// informational. In ABI layouts it travels as a [`Le32`] via
/// [`from_le`](Self::from_le) / [`to_le`](Self::to_le).
#[derive(Clone, Copy, PartialEq, Eq, Hash, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(transparent)]
pub struct NtStatus(i32);

impl NtStatus {
    /// `STATUS_SUCCESS`.
    pub const SUCCESS: Self = Self::from_raw(0x0000_0000);
    /// `STATUS_PENDING`: the operation completes later.
    pub const PENDING: Self = Self::from_raw(0x0000_0103);
    /// `STATUS_BUFFER_OVERFLOW` (warning): output truncated to the buffer.
    pub const BUFFER_OVERFLOW: Self = Self::from_raw(0x8000_0005);
    /// `STATUS_DEVICE_BUSY` (warning).
    pub const DEVICE_BUSY: Self = Self::from_raw(0x8000_0011);
    /// `STATUS_UNSUCCESSFUL`: generic failure.
    pub const UNSUCCESSFUL: Self = Self::from_raw(0xC000_0001);
    /// `STATUS_NOT_IMPLEMENTED`.
    pub const NOT_IMPLEMENTED: Self = Self::from_raw(0xC000_0002);
    /// `STATUS_INVALID_HANDLE`.
    pub const INVALID_HANDLE: Self = Self::from_raw(0xC000_0008);
    /// `STATUS_INVALID_PARAMETER`.
    pub const INVALID_PARAMETER: Self = Self::from_raw(0xC000_000D);
    /// `STATUS_INVALID_DEVICE_REQUEST`.
    pub const INVALID_DEVICE_REQUEST: Self = Self::from_raw(0xC000_0010);
    /// `STATUS_NO_MEMORY`.
    pub const NO_MEMORY: Self = Self::from_raw(0xC000_0017);
    /// `STATUS_ACCESS_DENIED`.
    pub const ACCESS_DENIED: Self = Self::from_raw(0xC000_0022);
    /// `STATUS_BUFFER_TOO_SMALL`: an output buffer cannot hold even the
    /// fixed part of the answer.
    pub const BUFFER_TOO_SMALL: Self = Self::from_raw(0xC000_0023);
    /// `STATUS_INSUFFICIENT_RESOURCES`.
    pub const INSUFFICIENT_RESOURCES: Self = Self::from_raw(0xC000_009A);
    /// `STATUS_IO_TIMEOUT`.
    pub const IO_TIMEOUT: Self = Self::from_raw(0xC000_00B5);
    /// `STATUS_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: Self = Self::from_raw(0xC000_00BB);
    /// `STATUS_CANCELLED`.
    pub const CANCELLED: Self = Self::from_raw(0xC000_0120);
    /// `STATUS_INVALID_DEVICE_STATE`.
    pub const INVALID_DEVICE_STATE: Self = Self::from_raw(0xC000_0184);
    /// `STATUS_NOT_FOUND`.
    pub const NOT_FOUND: Self = Self::from_raw(0xC000_0225);
    /// `STATUS_DEVICE_REMOVED`: the device is gone (surprise removal).
    pub const DEVICE_REMOVED: Self = Self::from_raw(0xC000_02B6);

    /// The facility of this project's customer-defined statuses (0x1B1, "IB",
    /// first allocation). Customer values cannot collide with Microsoft's,
    /// which never set bit 29.
    pub const IB_FACILITY: u16 = 0x1B1;

    const CUSTOMER_BIT: u32 = 1 << 29;
    const FACILITY_SHIFT: u32 = 16;
    const FACILITY_MASK: u32 = 0x0FFF;

    /// From the raw 32-bit pattern (as stored in an ABI field).
    pub const fn from_raw(raw: u32) -> Self {
        Self(raw as i32)
    }

    /// The raw 32-bit pattern.
    pub const fn raw(self) -> u32 {
        self.0 as u32
    }

    /// From the signed value (the C `NTSTATUS` type).
    pub const fn from_i32(value: i32) -> Self {
        Self(value)
    }

    /// The signed value (the C `NTSTATUS` type).
    pub const fn as_i32(self) -> i32 {
        self.0
    }

    /// Reads the little-endian ABI form.
    pub const fn from_le(raw: Le32) -> Self {
        Self::from_raw(raw.get())
    }

    /// The little-endian ABI form.
    pub const fn to_le(self) -> Le32 {
        Le32::new(self.raw())
    }

    /// The customer-defined status for `status` in [`Self::IB_FACILITY`]:
    /// success severity for non-failures, error severity otherwise; the low
    /// 16 bits are the `IbStatus` code.
    pub const fn ib_custom(status: IbStatus) -> Self {
        let severity: u32 = if status.is_success() { 0 } else { 0b11 << 30 };
        Self::from_raw(
            severity
                | Self::CUSTOMER_BIT
                | ((Self::IB_FACILITY as u32) << Self::FACILITY_SHIFT)
                | status.code(),
        )
    }

    /// `NT_SUCCESS`: severity success or informational.
    pub const fn is_success(self) -> bool {
        self.0 >= 0
    }

    /// Severity error (warnings are neither success nor error).
    pub const fn is_error(self) -> bool {
        matches!(self.severity(), Severity::Error)
    }

    /// The severity field.
    pub const fn severity(self) -> Severity {
        match self.raw() >> 30 {
            0 => Severity::Success,
            1 => Severity::Informational,
            2 => Severity::Warning,
            _ => Severity::Error,
        }
    }

    /// Bit 29: the value is customer-defined, not Microsoft's.
    pub const fn is_customer(self) -> bool {
        self.raw() & Self::CUSTOMER_BIT != 0
    }

    /// The 12-bit facility.
    pub const fn facility(self) -> u16 {
        ((self.raw() >> Self::FACILITY_SHIFT) & Self::FACILITY_MASK) as u16
    }

    /// The 16-bit code.
    pub const fn code(self) -> u16 {
        self.raw() as u16
    }

    /// A customer value in [`Self::IB_FACILITY`].
    pub const fn is_ib_facility(self) -> bool {
        self.is_customer() && self.facility() == Self::IB_FACILITY
    }
}

impl fmt::Debug for NtStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NtStatus({:#010x})", self.raw())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[test]
    fn codes_round_trip() {
        for (i, &s) in IbStatus::ALL.iter().enumerate() {
            assert_eq!(s.code(), i as u32, "{s:?} is not numbered in order");
            assert_eq!(IbStatus::from_code(s.code()), Ok(s));
        }
        assert_eq!(IbStatus::ALL.len(), 56);
        assert!(IbStatus::from_code(56).is_err());
    }

    #[test]
    fn ntstatus_mapping_is_injective_and_invertible() {
        let mut seen = HashSet::new();
        for &s in IbStatus::ALL {
            let nt = s.to_ntstatus();
            assert!(seen.insert(nt.raw()), "{s:?} shares {nt:?}");
            assert_eq!(IbStatus::from_ntstatus(nt), s);
            assert_eq!(s.is_success(), nt.is_success(), "{s:?} / {nt:?}");
            assert_eq!(s.is_error(), !nt.is_success());
        }
    }

    #[test]
    fn only_three_statuses_succeed() {
        let ok: Vec<_> = IbStatus::ALL
            .iter()
            .copied()
            .filter(|s| s.is_success())
            .collect();
        assert_eq!(
            ok,
            [
                IbStatus::Success,
                IbStatus::VerbsProcessingDone,
                IbStatus::Pending
            ]
        );
    }

    #[test]
    fn standard_values() {
        let table: &[(IbStatus, u32)] = &[
            (IbStatus::Success, 0),
            (IbStatus::Pending, 0x103),
            (IbStatus::GenericError, 0xC000_0001),
            (IbStatus::InvalidHandle, 0xC000_0008),
            (IbStatus::InvalidParameter, 0xC000_000D),
            (IbStatus::InsufficientMemory, 0xC000_0017),
            (IbStatus::InvalidPermission, 0xC000_0022),
            (IbStatus::InsufficientResources, 0xC000_009A),
            (IbStatus::Timeout, 0xC000_00B5),
            (IbStatus::Unsupported, 0xC000_00BB),
            (IbStatus::Canceled, 0xC000_0120),
            (IbStatus::InvalidState, 0xC000_0184),
            (IbStatus::NotFound, 0xC000_0225),
            (IbStatus::DeviceRemoved, 0xC000_02B6),
            (IbStatus::Overflow, 0x8000_0005),
            (IbStatus::ResourceBusy, 0x8000_0011),
            // Customer values: severity | C | facility 0x1B1 | code.
            (IbStatus::VerbsProcessingDone, 0x21B1_002D),
            (IbStatus::InvalidQpState, 0xE1B1_000D),
            (IbStatus::Interrupted, 0xE1B1_0008),
            (IbStatus::UnknownError, 0xE1B1_0036),
        ];
        for &(s, raw) in table {
            assert_eq!(s.to_ntstatus().raw(), raw, "{s:?}");
        }
    }

    #[test]
    fn ntstatus_fields() {
        let custom = IbStatus::InvalidLkey.to_ntstatus();
        assert!(custom.is_customer() && custom.is_ib_facility());
        assert_eq!(custom.facility(), NtStatus::IB_FACILITY);
        assert_eq!(custom.code(), 19);
        assert_eq!(custom.severity(), Severity::Error);
        assert!(custom.is_error() && !custom.is_success());

        let table: &[(NtStatus, Severity, bool, bool)] = &[
            (NtStatus::SUCCESS, Severity::Success, true, false),
            (NtStatus::PENDING, Severity::Success, true, false),
            (
                NtStatus::from_raw(0x4000_0000),
                Severity::Informational,
                true,
                false,
            ),
            (NtStatus::BUFFER_OVERFLOW, Severity::Warning, false, false),
            (NtStatus::NOT_FOUND, Severity::Error, false, true),
        ];
        for &(nt, sev, ok, err) in table {
            assert_eq!(nt.severity(), sev, "{nt:?}");
            assert_eq!(nt.is_success(), ok, "{nt:?}");
            assert_eq!(nt.is_error(), err, "{nt:?}");
            assert!(!nt.is_customer());
        }
        assert_eq!(NtStatus::NOT_FOUND.as_i32(), -1_073_741_275);
        assert_eq!(NtStatus::from_i32(-1_073_741_275), NtStatus::NOT_FOUND);
        assert_eq!(
            NtStatus::from_le(NtStatus::CANCELLED.to_le()),
            NtStatus::CANCELLED
        );
        assert_eq!(NtStatus::CANCELLED.as_bytes(), &[0x20, 0x01, 0x00, 0xC0]);
        assert_eq!(format!("{:?}", NtStatus::PENDING), "NtStatus(0x00000103)");
    }

    #[test]
    fn unknown_ntstatus_maps_by_severity() {
        let table: &[(u32, IbStatus)] = &[
            (0x0000_0101, IbStatus::Success),      // STATUS_ALERTED
            (0x4000_0000, IbStatus::Success),      // informational
            (0x8000_001A, IbStatus::GenericError), // STATUS_NO_MORE_ENTRIES
            (0xC000_0023, IbStatus::GenericError), // STATUS_BUFFER_TOO_SMALL
            (0xC000_0002, IbStatus::Unsupported),  // STATUS_NOT_IMPLEMENTED
            (0xC000_0010, IbStatus::Unsupported),  // STATUS_INVALID_DEVICE_REQUEST
            (0xE000_0001, IbStatus::GenericError), // customer, other facility
            (0xE1B1_0037, IbStatus::UnknownError), // our facility, unknown code
            (0xE1B1_FFFF, IbStatus::UnknownError),
            (0x21B1_0037, IbStatus::Success), // our facility, success
            (0xE1B1_002D, IbStatus::UnknownError), // known code, wrong severity
            (0x21B1_0013, IbStatus::Success), // known code, wrong severity
            (0x61B1_0013, IbStatus::Success), // informational
            (0xA1B1_0013, IbStatus::UnknownError), // warning
        ];
        for &(raw, want) in table {
            assert_eq!(
                IbStatus::from_ntstatus(NtStatus::from_raw(raw)),
                want,
                "{raw:#x}"
            );
        }
    }

    proptest! {
        #[test]
        fn every_ntstatus_maps(raw: u32) {
            let nt = NtStatus::from_raw(raw);
            let ib = IbStatus::from_ntstatus(nt);
            prop_assert_eq!(IbStatus::from_ntstatus(nt), ib);
            prop_assert_eq!(ib.is_success(), nt.is_success());
            // Mapping back and forth again settles on the same status.
            prop_assert_eq!(IbStatus::from_ntstatus(ib.to_ntstatus()), ib);
            prop_assert_eq!(NtStatus::from(ib), ib.to_ntstatus());
        }
    }
}
