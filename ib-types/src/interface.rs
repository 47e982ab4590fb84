//! Interface contracts between the drivers: GUIDs, versions, the Windows
//! `INTERFACE` header, and the data a per-port child receives with the AL
//! interface.
//!
//! Kernel drivers find each other's entry points through
//! `IRP_MN_QUERY_INTERFACE`: the consumer names an interface GUID, a version
//! and a size; the provider fills a structure that begins with
//! [`InterfaceHeader`] and takes a reference through its
//! `interface_reference` before returning it. One GUID per interface, and the
//! version inside it decides compatibility ([`InterfaceVersion::satisfies`]).
//!
//! Both verbs interfaces (the miniport's CI interface and the bus filter's
//! AL interface) share [`VerbEntryPoints`]: a `submit` entry point taking a
//! request that carries a verb code and buffers laid out by
//! [`crate::ioctl`] — the same codes and layouts as the user-mode proxy
//! IOCTLs, so the IOCTL path and the direct-call path share one
//! implementation — plus the fast-path entry points (post, poll, arm), which
//! never allocate and may be called at DISPATCH_LEVEL.
//!
//! The GUIDs here were generated for this project; they belong to no other
//! vendor's stack.

use core::ffi::c_void;
use core::fmt;

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Le16, Le32, Repr, ensure_zero};
use crate::event::AsyncEventRecordAbi;
use crate::scalars::{NodeGuid, PKey, PortGuid, PortNum};
use crate::status::NtStatus;
use crate::wc::WorkCompletion;
use crate::wr_desc::{RecvWrDesc, SendWrDesc};

/// A Windows `GUID` in its in-memory layout (little-endian first three
/// fields), 16 bytes.
#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct WinGuid {
    /// First 32 bits.
    pub data1: Le32,
    /// Next 16 bits.
    pub data2: Le16,
    /// Next 16 bits.
    pub data3: Le16,
    /// Last 64 bits, byte order as written.
    pub data4: [u8; 8],
}

assert_layout!(WinGuid, size = 16, data1 @ 0, data2 @ 4, data3 @ 6, data4 @ 8);

impl WinGuid {
    /// A GUID from its textual value read as one big-endian 128-bit number:
    /// `{d464ab57-0634-4589-a89d-ecb6a915035b}` is
    /// `0xd464ab57_0634_4589_a89d_ecb6a915035b`.
    pub const fn from_u128(value: u128) -> Self {
        let b = value.to_be_bytes();
        Self {
            data1: Le32::new(u32::from_be_bytes([b[0], b[1], b[2], b[3]])),
            data2: Le16::new(u16::from_be_bytes([b[4], b[5]])),
            data3: Le16::new(u16::from_be_bytes([b[6], b[7]])),
            data4: [b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]],
        }
    }

    /// The textual value as one 128-bit number (inverse of `from_u128`).
    pub const fn to_u128(self) -> u128 {
        let d1 = self.data1.get().to_be_bytes();
        let d2 = self.data2.get().to_be_bytes();
        let d3 = self.data3.get().to_be_bytes();
        let d4 = self.data4;
        u128::from_be_bytes([
            d1[0], d1[1], d1[2], d1[3], d2[0], d2[1], d3[0], d3[1], d4[0], d4[1], d4[2], d4[3],
            d4[4], d4[5], d4[6], d4[7],
        ])
    }
}

impl PartialOrd for WinGuid {
    fn partial_cmp(&self, other: &Self) -> Option<core::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for WinGuid {
    /// Orders by the textual value.
    fn cmp(&self, other: &Self) -> core::cmp::Ordering {
        self.to_u128().cmp(&other.to_u128())
    }
}

impl fmt::Display for WinGuid {
    /// Registry form: `{xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx}`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.to_u128();
        write!(
            f,
            "{{{:08x}-{:04x}-{:04x}-{:04x}-{:012x}}}",
            v >> 96,
            (v >> 80) & 0xFFFF,
            (v >> 64) & 0xFFFF,
            (v >> 48) & 0xFFFF,
            v & 0xFFFF_FFFF_FFFF
        )
    }
}

impl fmt::Debug for WinGuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WinGuid({self})")
    }
}

/// The CI interface: the HCA miniport's verbs, queried by the bus filter
/// sitting on the same device stack.
pub const GUID_IB_CI_INTERFACE: WinGuid =
    WinGuid::from_u128(0xd464ab57_0634_4589_a89d_ecb6a915035b);

/// The AL interface: the access layer's verbs, queried by per-port children
/// (kernel clients) from their parent.
pub const GUID_IB_AL_INTERFACE: WinGuid =
    WinGuid::from_u128(0x4f888bd5_cfd6_4341_b004_5e77989e8072);

/// Device interface class of each HCA's proxy device: user mode enumerates it
/// to find the HCAs and opens one file per HCA (no single `\Device\ibal`).
pub const GUID_IB_AL_DEVICE_INTERFACE: WinGuid =
    WinGuid::from_u128(0xe1c2b307_5059_4d8b_8a23_04bff7dfe8b7);

/// Bus type GUID reported for the per-port children.
pub const GUID_IB_PORT_BUS_TYPE: WinGuid =
    WinGuid::from_u128(0xedf5a7d1_5f9e_4483_beaf_f51ac27dc444);

/// An interface or ABI version: `major << 8 | minor` in 16 bits, the form the
/// `INTERFACE.Version` field carries.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct InterfaceVersion {
    /// Incompatible changes bump the major version.
    pub major: u8,
    /// Compatible additions (new entry points or fields at the end) bump the
    /// minor version.
    pub minor: u8,
}

impl InterfaceVersion {
    /// A version.
    pub const fn new(major: u8, minor: u8) -> Self {
        Self { major, minor }
    }

    /// The packed 16-bit form.
    pub const fn packed(self) -> u16 {
        (self.major as u16) << 8 | self.minor as u16
    }

    /// From the packed 16-bit form.
    pub const fn from_packed(packed: u16) -> Self {
        Self::new((packed >> 8) as u8, packed as u8)
    }

    /// A provider at `self` can serve a consumer that needs `required`: the
    /// same major version, and at least the required minor version.
    pub const fn satisfies(self, required: Self) -> bool {
        self.major == required.major && self.minor >= required.minor
    }

    /// `Ok` when `self` satisfies `required`, else the version error.
    pub const fn check(self, required: Self) -> Result<(), AbiError> {
        if self.satisfies(required) {
            Ok(())
        } else {
            Err(AbiError::VersionMismatch {
                expected: required.packed() as u32,
                got: self.packed() as u32,
            })
        }
    }
}

impl fmt::Debug for InterfaceVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}.{}", self.major, self.minor)
    }
}

/// Version of the CI interface this crate describes.
pub const CI_INTERFACE_VERSION: InterfaceVersion = InterfaceVersion::new(1, 0);
/// Version of the AL interface this crate describes.
pub const AL_INTERFACE_VERSION: InterfaceVersion = InterfaceVersion::new(1, 0);

/// Takes or drops a reference on an interface's provider.
pub type InterfaceRefFn = unsafe extern "system" fn(context: *mut c_void);

/// The Windows `INTERFACE` header every queried interface starts with.
///
/// # Invariants
/// `size` is the byte size of the whole interface structure the provider
/// filled; `context` is passed back to every entry point; every reference
/// taken through `interface_reference` (the provider takes one before it
/// answers the query) is dropped exactly once through
/// `interface_dereference`.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct InterfaceHeader {
    /// Size of the full interface structure in bytes.
    pub size: u16,
    /// [`InterfaceVersion::packed`].
    pub version: u16,
    /// The provider's context for every entry point.
    pub context: *mut c_void,
    /// Takes a reference on the provider.
    pub interface_reference: Option<InterfaceRefFn>,
    /// Drops a reference on the provider.
    pub interface_dereference: Option<InterfaceRefFn>,
}

#[cfg(target_pointer_width = "64")]
assert_layout!(InterfaceHeader, size = 32, size @ 0, version @ 2, context @ 8,
    interface_reference @ 16, interface_dereference @ 24);

impl InterfaceHeader {
    /// Checks what a provider put in the header against what the consumer
    /// needs: at least `min_size` bytes and a version that satisfies
    /// `required`. A larger size is a newer minor version with more entry
    /// points at the end, and is accepted.
    pub fn check(&self, min_size: usize, required: InterfaceVersion) -> Result<(), AbiError> {
        if usize::from(self.size) < min_size {
            return Err(AbiError::BadLength {
                field: "InterfaceHeader.size",
                declared: self.size.into(),
                available: min_size as u64,
            });
        }
        InterfaceVersion::from_packed(self.version).check(required)
    }
}

/// Completes every verb request: `request` is the platform's request object
/// (the IRP on Windows) carrying a [`crate::ioctl`] verb code and buffers.
/// Returns `STATUS_PENDING` when the request will complete later.
pub type SubmitFn =
    unsafe extern "system" fn(context: *mut c_void, request: *mut c_void) -> NtStatus;

/// Posts `count` send descriptors to the QP `qp`; `posted` receives how
/// many were accepted before the first failure (earlier ones stay posted).
pub type PostSendFn = unsafe extern "system" fn(
    context: *mut c_void,
    qp: u64,
    wrs: *const SendWrDesc,
    count: u32,
    posted: *mut u32,
) -> NtStatus;

/// Posts `count` receive descriptors to a QP or an SRQ (`queue`).
pub type PostRecvFn = unsafe extern "system" fn(
    context: *mut c_void,
    queue: u64,
    wrs: *const RecvWrDesc,
    count: u32,
    posted: *mut u32,
) -> NtStatus;

/// Fills up to `capacity` completions of the CQ `cq` into `wcs`; `polled`
/// receives how many.
pub type PollCqFn = unsafe extern "system" fn(
    context: *mut c_void,
    cq: u64,
    wcs: *mut WorkCompletion,
    capacity: u32,
    polled: *mut u32,
) -> NtStatus;

/// Arms the CQ `cq` for one completion event; `notify` is a
/// [`crate::cq::CqNotify`] code.
pub type ArmCqFn = unsafe extern "system" fn(context: *mut c_void, cq: u64, notify: u8) -> NtStatus;

/// The verb entry points both verbs interfaces carry.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct VerbEntryPoints {
    /// Every control verb.
    pub submit: Option<SubmitFn>,
    /// Post to a send queue.
    pub post_send: Option<PostSendFn>,
    /// Post to a QP's receive queue.
    pub post_recv: Option<PostRecvFn>,
    /// Post to a shared receive queue.
    pub post_srq_recv: Option<PostRecvFn>,
    /// Poll a CQ.
    pub poll_cq: Option<PollCqFn>,
    /// Arm a CQ.
    pub arm_cq: Option<ArmCqFn>,
}

#[cfg(target_pointer_width = "64")]
assert_layout!(VerbEntryPoints, size = 48, submit @ 0, post_send @ 8, post_recv @ 16,
    post_srq_recv @ 24, poll_cq @ 32, arm_cq @ 40);

impl VerbEntryPoints {
    /// True when the provider filled every entry point.
    pub fn is_complete(&self) -> bool {
        self.submit.is_some()
            && self.post_send.is_some()
            && self.post_recv.is_some()
            && self.post_srq_recv.is_some()
            && self.poll_cq.is_some()
            && self.arm_cq.is_some()
    }
}

/// A completion event on the CQ `cq` (one-shot: the CQ must be re-armed).
pub type CompletionCallbackFn = unsafe extern "system" fn(client: *mut c_void, cq: u64);

/// An asynchronous event; the record is valid only during the call.
pub type AsyncEventCallbackFn =
    unsafe extern "system" fn(client: *mut c_void, event: *const AsyncEventRecordAbi);

/// The callbacks a client registers when it opens a CA or the AL. They are
/// called from a DPC (DISPATCH_LEVEL), never from the ISR, and never after
/// the matching close has returned.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct EventCallbacks {
    /// Completion events.
    pub completion: Option<CompletionCallbackFn>,
    /// Asynchronous events.
    pub async_event: Option<AsyncEventCallbackFn>,
}

#[cfg(target_pointer_width = "64")]
assert_layout!(EventCallbacks, size = 16, completion @ 0, async_event @ 8);

/// Opens the CA for one client (the bus filter; the guide's OpenHCA may be
/// called once): registers its callbacks and returns the CA handle in `ca`.
///
/// This is how the CA is opened in the kernel: the bus filter opens it once
/// through the CI interface, with callbacks, and every kernel client goes
/// through the AL. The `OpenCa` verb of [`crate::ioctl`] is the user-mode
/// proxy's open (a user context, no callbacks: user mode waits for events
/// with `WaitCqEvent`); the bus filter forwards it to `submit`.
pub type CiOpenCaFn = unsafe extern "system" fn(
    context: *mut c_void,
    callbacks: *const EventCallbacks,
    client: *mut c_void,
    ca: *mut u64,
) -> NtStatus;

/// Closes the CA. PASSIVE_LEVEL only: it waits for callbacks in flight
/// (guide 6.1.4), and none follows its return.
pub type CiCloseCaFn = unsafe extern "system" fn(context: *mut c_void, ca: u64) -> NtStatus;

/// The CI interface (HCA miniport -> bus filter), answered to
/// `IRP_MN_QUERY_INTERFACE` for [`GUID_IB_CI_INTERFACE`].
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct CiInterface {
    /// Size, version [`CI_INTERFACE_VERSION`], context, reference counting.
    pub header: InterfaceHeader,
    /// The CA GUID.
    pub ca_guid: NodeGuid,
    /// IEEE OUI of the vendor.
    pub vendor_id: u32,
    /// PCI device ID.
    pub device_id: u16,
    /// Hardware revision.
    pub revision: u16,
    /// The UVP user mode must load for this HCA.
    pub uvp_name: UvpNameAbi,
    /// Opens the CA.
    pub open_ca: Option<CiOpenCaFn>,
    /// Closes the CA.
    pub close_ca: Option<CiCloseCaFn>,
    /// The verbs.
    pub verbs: VerbEntryPoints,
}

#[cfg(target_pointer_width = "64")]
assert_layout!(CiInterface, size = 176, header @ 0, ca_guid @ 32, vendor_id @ 40,
    device_id @ 44, revision @ 46, uvp_name @ 48, open_ca @ 112, close_ca @ 120,
    verbs @ 128);

/// Opens the access layer for a kernel client. The AL takes a reference on
/// `client_device` (the client's DEVICE_OBJECT) and drops it only when no
/// callback can follow, so the client cannot unload under a callback.
/// Returns the AL handle in `al`.
pub type AlOpenFn = unsafe extern "system" fn(
    context: *mut c_void,
    client_device: *mut c_void,
    callbacks: *const EventCallbacks,
    client: *mut c_void,
    al: *mut u64,
) -> NtStatus;

/// Closes an AL handle, destroying what the client left open. PASSIVE_LEVEL
/// only; no callback follows its return.
pub type AlCloseFn = unsafe extern "system" fn(context: *mut c_void, al: u64) -> NtStatus;

/// The AL interface (bus filter -> a per-port child), answered by the
/// child's PDO to `IRP_MN_QUERY_INTERFACE` for [`GUID_IB_AL_INTERFACE`].
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct AlInterface {
    /// Size, version [`AL_INTERFACE_VERSION`], context, reference counting.
    pub header: InterfaceHeader,
    /// Which CA, port and partition this child serves.
    pub port: PortInterfaceDataAbi,
    /// Opens the AL for the client.
    pub open_al: Option<AlOpenFn>,
    /// Closes it.
    pub close_al: Option<AlCloseFn>,
    /// The verbs, on AL handles.
    pub verbs: VerbEntryPoints,
}

#[cfg(target_pointer_width = "64")]
assert_layout!(AlInterface, size = 120, header @ 0, port @ 32, open_al @ 56, close_al @ 64,
    verbs @ 72);

/// The name of the user-mode verbs provider DLL the kernel reports for an
/// HCA: a bare base name (no directory, no extension), so user mode can only
/// load it from the stack's own verified directory.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UvpName {
    len: u8,
    bytes: [u8; UvpName::MAX_LEN],
}

impl UvpName {
    /// Longest name, leaving one UTF-16 unit for the terminating NUL.
    pub const MAX_LEN: usize = 31;

    /// Accepts 1..=31 characters of `[A-Za-z0-9_-]`.
    pub const fn new(name: &str) -> Result<Self, AbiError> {
        let src = name.as_bytes();
        if src.is_empty() || src.len() > Self::MAX_LEN {
            return Err(AbiError::BadLength {
                field: "UvpName",
                declared: src.len() as u64,
                available: Self::MAX_LEN as u64,
            });
        }
        let mut bytes = [0u8; Self::MAX_LEN];
        let mut i = 0;
        while i < src.len() {
            let c = src[i];
            if !(c.is_ascii_alphanumeric() || c == b'_' || c == b'-') {
                return Err(AbiError::OutOfRange {
                    field: "UvpName (character)",
                    value: c as u64,
                });
            }
            bytes[i] = c;
            i += 1;
        }
        Ok(Self {
            len: src.len() as u8,
            bytes,
        })
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        // Only ASCII was admitted by `new`/`parse`.
        core::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or("")
    }
}

impl fmt::Debug for UvpName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UvpName({:?})", self.as_str())
    }
}

/// ABI layout of [`UvpName`]: 32 UTF-16 units, NUL-terminated and NUL-padded
/// (64 bytes), ready for a wide-string loader call.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UvpNameAbi {
    /// UTF-16LE code units.
    pub units: [Le16; 32],
}

assert_layout!(UvpNameAbi, size = 64, units @ 0);

impl Repr for UvpName {
    type Abi = UvpNameAbi;

    fn parse(abi: &UvpNameAbi) -> Result<Self, AbiError> {
        let mut ascii = [0u8; Self::MAX_LEN];
        let mut len = 0;
        while len < Self::MAX_LEN && abi.units[len].get() != 0 {
            let unit = abi.units[len].get();
            ascii[len] = u8::try_from(unit).map_err(|_| AbiError::OutOfRange {
                field: "UvpNameAbi (non-ASCII unit)",
                value: unit.into(),
            })?;
            len += 1;
        }
        if abi.units[len..].iter().any(|u| u.get() != 0) {
            return Err(AbiError::ReservedNotZero {
                field: "UvpNameAbi (after the terminating NUL)",
            });
        }
        let text = core::str::from_utf8(&ascii[..len]).map_err(|_| AbiError::OutOfRange {
            field: "UvpNameAbi",
            value: 0,
        })?;
        Self::new(text)
    }

    fn emit(&self) -> UvpNameAbi {
        let mut abi = UvpNameAbi {
            units: [Le16::new(0); 32],
        };
        for (unit, &b) in abi
            .units
            .iter_mut()
            .zip(&self.bytes[..usize::from(self.len)])
        {
            *unit = Le16::new(b.into());
        }
        abi
    }
}

/// Interface-specific data a per-port child receives with the AL interface:
/// which CA, which port, and which partition it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PortInterfaceData {
    /// The CA (node) GUID.
    pub ca_guid: NodeGuid,
    /// The port's GUID.
    pub port_guid: PortGuid,
    /// The port number.
    pub port: PortNum,
    /// The partition the child was instantiated for.
    pub pkey: PKey,
}

/// ABI layout of [`PortInterfaceData`]: 24 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct PortInterfaceDataAbi {
    /// CA GUID, network order.
    pub ca_guid: NodeGuid,
    /// Port GUID, network order.
    pub port_guid: PortGuid,
    /// P_Key, network order.
    pub pkey: PKey,
    /// Port number.
    pub port_num: u8,
    /// Reserved, zero.
    pub reserved_at_0x13: [u8; 5],
}

assert_layout!(PortInterfaceDataAbi, size = 24, ca_guid @ 0, port_guid @ 8, pkey @ 16,
    port_num @ 18, reserved_at_0x13 @ 19);

impl Repr for PortInterfaceData {
    type Abi = PortInterfaceDataAbi;

    fn parse(abi: &PortInterfaceDataAbi) -> Result<Self, AbiError> {
        ensure_zero(
            "PortInterfaceDataAbi.reserved_at_0x13",
            &abi.reserved_at_0x13,
        )?;
        if !abi.pkey.is_valid() {
            return Err(AbiError::OutOfRange {
                field: "PortInterfaceDataAbi.pkey",
                value: abi.pkey.get().into(),
            });
        }
        Ok(Self {
            ca_guid: abi.ca_guid,
            port_guid: abi.port_guid,
            port: PortNum::new(abi.port_num)?,
            pkey: abi.pkey,
        })
    }

    fn emit(&self) -> PortInterfaceDataAbi {
        PortInterfaceDataAbi {
            ca_guid: self.ca_guid,
            port_guid: self.port_guid,
            pkey: self.pkey,
            port_num: self.port.get(),
            ..PortInterfaceDataAbi::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::testing::{assert_decode_total, assert_round_trip};
    use proptest::prelude::*;

    #[test]
    fn guid_memory_layout_and_text() {
        let g = GUID_IB_CI_INTERFACE;
        assert_eq!(
            g.as_bytes(),
            &[
                0x57, 0xab, 0x64, 0xd4, 0x34, 0x06, 0x89, 0x45, 0xa8, 0x9d, 0xec, 0xb6, 0xa9, 0x15,
                0x03, 0x5b
            ]
        );
        assert_eq!(format!("{g}"), "{d464ab57-0634-4589-a89d-ecb6a915035b}");
        assert_eq!(WinGuid::from_u128(g.to_u128()), g);
        let all = [
            GUID_IB_CI_INTERFACE,
            GUID_IB_AL_INTERFACE,
            GUID_IB_AL_DEVICE_INTERFACE,
            GUID_IB_PORT_BUS_TYPE,
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn version_compatibility() {
        let v1_2 = InterfaceVersion::new(1, 2);
        assert_eq!(v1_2.packed(), 0x0102);
        assert_eq!(InterfaceVersion::from_packed(0x0102), v1_2);
        assert!(v1_2.satisfies(InterfaceVersion::new(1, 0)));
        assert!(v1_2.satisfies(v1_2));
        assert!(!v1_2.satisfies(InterfaceVersion::new(1, 3)), "older minor");
        assert!(!v1_2.satisfies(InterfaceVersion::new(2, 0)), "other major");
        assert_eq!(
            InterfaceVersion::new(2, 0).check(CI_INTERFACE_VERSION),
            Err(AbiError::VersionMismatch {
                expected: 0x0100,
                got: 0x0200
            })
        );
    }

    #[test]
    fn uvp_names() {
        let name = UvpName::new("ibrs-uvp").unwrap();
        assert_eq!(name.as_str(), "ibrs-uvp");
        assert_round_trip(&name);
        assert_eq!(name.emit().units[0].get(), u16::from(b'i'));
        for bad in [
            "",
            "..\\evil",
            "a/b",
            "x.dll",
            "name with space",
            &"a".repeat(32),
        ] {
            assert!(UvpName::new(bad).is_err(), "{bad:?} must be refused");
        }
        let mut abi = name.emit();
        abi.units[20] = Le16::new(u16::from(b'x'));
        assert!(UvpName::parse(&abi).is_err(), "bytes after the NUL");
        let mut abi = name.emit();
        abi.units[0] = Le16::new(0x263A);
        assert!(UvpName::parse(&abi).is_err(), "non-ASCII");
        let empty = UvpNameAbi {
            units: [Le16::new(0); 32],
        };
        assert!(UvpName::parse(&empty).is_err(), "empty name");
    }

    #[test]
    fn port_data_round_trip() {
        let data = PortInterfaceData {
            ca_guid: NodeGuid::new(0x0002_c903_0000_1000),
            port_guid: PortGuid::new(0x0002_c903_0000_1001),
            port: PortNum::new(2).unwrap(),
            pkey: PKey::DEFAULT,
        };
        assert_round_trip(&data);
        let mut abi = data.emit();
        abi.pkey = PKey::new(0x8000);
        assert!(PortInterfaceData::parse(&abi).is_err(), "invalid partition");
        let mut abi = data.emit();
        abi.port_num = 0;
        assert!(PortInterfaceData::parse(&abi).is_err(), "port 0");
    }

    #[test]
    fn header_check() {
        let header = InterfaceHeader {
            size: core::mem::size_of::<CiInterface>() as u16,
            version: InterfaceVersion::new(1, 3).packed(),
            context: core::ptr::null_mut(),
            interface_reference: None,
            interface_dereference: None,
        };
        let size = core::mem::size_of::<CiInterface>();
        assert_eq!(header.check(size, CI_INTERFACE_VERSION), Ok(()));
        assert!(
            header.check(size + 8, CI_INTERFACE_VERSION).is_err(),
            "too small"
        );
        assert!(
            header.check(size, InterfaceVersion::new(1, 4)).is_err(),
            "older minor than required"
        );
        let empty = VerbEntryPoints {
            submit: None,
            post_send: None,
            post_recv: None,
            post_srq_recv: None,
            poll_cq: None,
            arm_cq: None,
        };
        assert!(!empty.is_complete());
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..70)) {
            assert_decode_total::<PortInterfaceData>(&bytes);
            assert_decode_total::<UvpName>(&bytes);
        }

        #[test]
        fn guid_u128_round_trip(v: u128) {
            prop_assert_eq!(WinGuid::from_u128(v).to_u128(), v);
        }
    }
}
