//! The verbs request surface: IOCTL codes, request and response framing, and
//! the registry of verbs with their fixed layouts and policies.
//!
//! # One surface, two paths
//!
//! User mode reaches the verbs through the per-HCA proxy device: every verb
//! is one `METHOD_BUFFERED` `DeviceIoControl` whose code is
//! [`VerbId::ioctl`]. Kernel clients call the `submit` entry point of the CI
//! or AL interface with the very same code and buffers, carried in an
//! internal device-control request, so both paths share one decoder and one
//! implementation.
//!
//! # Framing
//!
//! ```text
//! request  (input buffer)   RequestHeaderAbi  (16) | V::In  | private_in_len bytes
//! response (output buffer)  ResponseHeaderAbi (16) | V::Out | private_out_len bytes
//! ```
//!
//! - The request header's `handle` names the object the verb acts on, or the
//!   parent of the object a create makes ([`VerbId::target`]); it is zero
//!   exactly for [`OpenCa`].
//! - The response header's `handle` is the created object's handle
//!   ([`VerbId::creates`]) on success, zero otherwise: the analogue of
//!   `IoStatus.Information`.
//! - A request is exactly header + `In` + `private_in_len` bytes; a response
//!   exactly header + `Out` + `private_out_len` bytes. Lengths are compared,
//!   never added, so no declared length can overflow anything.
//! - The response `status` is an [`IbStatus`] code, never
//!   [`IbStatus::Pending`] (a pended request is answered when it completes).
//!   On success the fixed `Out` is valid; on failure it is all zero and no
//!   private bytes follow. The one exception is the size report of
//!   [`QueryCa`] (see [`Verb::SIZE_ON_OVERFLOW`]).
//! - The request itself completes with the NTSTATUS of the response status
//!   ([`IbStatus::to_ntstatus`]). For a `METHOD_BUFFERED` IOCTL the I/O
//!   manager copies no output back when that NTSTATUS is an error, so a
//!   user-mode caller sees only the NTSTATUS on failure and recovers the
//!   [`IbStatus`] from it (the mapping is exact both ways); the response
//!   header reaches it only with a success or warning NTSTATUS. Kernel
//!   callers of `submit` see the whole response either way.
//! - The trailing private bytes carry vendor data between the user-mode
//!   plug-in and the miniport (the guide's `umv_buf`), opaque here, except
//!   for [`QueryCa`], whose private output is the CA attribute block of
//!   [`crate::ca`], and [`RegPhysMr`] and [`ReregPhysMr`], whose private
//!   input is the page list of [`PhysMrRegister`] or [`PhysMrRereg`]. The caller bounds the private output with
//!   `private_out_max`; the kernel must not answer with more (the response
//!   decoder cannot see the request, so the caller compares).
//!
//! [`encode_request`] / [`encode_response`] produce only what
//! [`decode_request`] / [`decode_response`] accept, and whatever decodes
//! re-encodes to the same bytes. Decoding untrusted bytes never panics.
//!
//! # Policy
//!
//! - [`VerbId::from_ioctl`] accepts a code only with the InfiniBand device
//!   type, `METHOD_BUFFERED`, a known function and exactly the verb's
//!   [`RequiredAccess`] (read for queries and waits, read and write for the
//!   rest), so the I/O manager has already checked the handle's rights.
//! - Kernel-only verbs ([`VerbId::user_mode_allowed`] false) and kernel-only
//!   inputs (special QPs in [`CreateQp`]) are decided by [`Request::kernel_only`];
//!   the proxy refuses them for user-mode requestors.
//!
//! # ABI version
//!
//! [`PROXY_ABI_VERSION`] is checked at open time, by both sides, in the
//! `parse` of the open layouts: the kernel (reading [`OpenCaIn`]) refuses a
//! library whose version it cannot serve (another major, or a newer minor),
//! and the library (reading [`OpenCaOut`]) refuses a kernel that cannot
//! serve it. Everything after a successful open speaks that version.

use core::fmt;
use core::mem::size_of;

use bitflags::bitflags;
use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Be32, Le16, Le32, Le64, Repr, ensure_zero, parse_bool, read_prefix};
use crate::av::{AvAbi, AvAttr};
use crate::ca::{CA_ATTR_HEADER_SIZE, CaAttrView, CaModify};
use crate::cq::CqAttr;
use crate::event::AsyncEventRecord;
use crate::handle::PdHandle;
use crate::interface::{InterfaceVersion, UvpName, UvpNameAbi};
use crate::mcast::McastGroup;
use crate::mr::{
    MrKeys, MrQuery, MrRegister, MrRereg, MrShare, MwAttr, MwAttrAbi, PhysMrRegister, PhysMrRereg,
};
use crate::qp::{QpAttrMask, QpCaps, QpCapsAbi, QpCreate, QpModify, QpModifyAbi, QpState, QpType};
use crate::scalars::{NodeGuid, PortNum, Qpn};
use crate::srq::{SrqAttr, SrqCreate, SrqModify};
use crate::status::IbStatus;

// ---------------------------------------------------------------------------
// CTL_CODE
// ---------------------------------------------------------------------------

/// `FILE_DEVICE_INFINIBAND`: the device type of every verb code.
pub const FILE_DEVICE_INFINIBAND: u16 = 0x003B;

/// First function number of the vendor range (0..=0x7FF are Microsoft's);
/// verb `i` of the registry has function `FUNCTION_BASE + i`.
pub const FUNCTION_BASE: u16 = 0x800;

/// Largest function number (12 bits).
pub const MAX_FUNCTION: u16 = 0x0FFF;

/// The version of the request surface (layouts and verb table).
pub const PROXY_ABI_VERSION: InterfaceVersion = InterfaceVersion::new(1, 0);

code_enum! {
    /// How the I/O manager passes a code's buffers (`METHOD_*`).
    pub enum TransferMethod: u8 {
        /// `METHOD_BUFFERED`: both buffers go through one system buffer.
        Buffered = 0,
        /// `METHOD_IN_DIRECT`: the output buffer is an MDL, probed for read.
        InDirect = 1,
        /// `METHOD_OUT_DIRECT`: the output buffer is an MDL, probed for write.
        OutDirect = 2,
        /// `METHOD_NEITHER`: raw user addresses.
        Neither = 3,
    }
}

bitflags! {
    /// The rights the caller's file handle must have (`FILE_*_ACCESS`);
    /// empty is `FILE_ANY_ACCESS`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct RequiredAccess: u8 {
        /// `FILE_READ_ACCESS`.
        const READ = 1;
        /// `FILE_WRITE_ACCESS`.
        const WRITE = 2;
    }
}

impl RequiredAccess {
    /// `FILE_ANY_ACCESS`.
    pub const ANY: Self = Self::empty();
    /// `FILE_READ_ACCESS | FILE_WRITE_ACCESS`.
    pub const READ_WRITE: Self = Self::READ.union(Self::WRITE);
}

/// A Windows I/O control code:
/// `DeviceType << 16 | Access << 14 | Function << 2 | Method`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IoctlCode(u32);

impl IoctlCode {
    const DEVICE_SHIFT: u32 = 16;
    const ACCESS_SHIFT: u32 = 14;
    const FUNCTION_SHIFT: u32 = 2;
    const TWO_BITS: u32 = 0b11;

    /// `CTL_CODE`; `None` when `function` does not fit 12 bits.
    pub const fn new(
        device_type: u16,
        function: u16,
        method: TransferMethod,
        access: RequiredAccess,
    ) -> Option<Self> {
        if function > MAX_FUNCTION {
            return None;
        }
        Some(Self::compose(device_type, function, method, access))
    }

    /// `CTL_CODE` for a function known to fit 12 bits.
    const fn compose(
        device_type: u16,
        function: u16,
        method: TransferMethod,
        access: RequiredAccess,
    ) -> Self {
        Self(
            (device_type as u32) << Self::DEVICE_SHIFT
                | (access.bits() as u32) << Self::ACCESS_SHIFT
                | ((function & MAX_FUNCTION) as u32) << Self::FUNCTION_SHIFT
                | method.code() as u32,
        )
    }

    /// Wraps a raw code (every value is a code; [`VerbId::from_ioctl`]
    /// decides whether it is one of ours).
    pub const fn from_raw(raw: u32) -> Self {
        Self(raw)
    }

    /// The raw 32-bit code.
    pub const fn raw(self) -> u32 {
        self.0
    }

    /// The device type (bits 31..16).
    pub const fn device_type(self) -> u16 {
        (self.0 >> Self::DEVICE_SHIFT) as u16
    }

    /// The function number (bits 13..2).
    pub const fn function(self) -> u16 {
        ((self.0 >> Self::FUNCTION_SHIFT) & MAX_FUNCTION as u32) as u16
    }

    /// The transfer method (bits 1..0).
    pub const fn method(self) -> TransferMethod {
        match self.0 & Self::TWO_BITS {
            0 => TransferMethod::Buffered,
            1 => TransferMethod::InDirect,
            2 => TransferMethod::OutDirect,
            _ => TransferMethod::Neither,
        }
    }

    /// The required access (bits 15..14).
    pub const fn access(self) -> RequiredAccess {
        RequiredAccess::from_bits_retain(((self.0 >> Self::ACCESS_SHIFT) & Self::TWO_BITS) as u8)
    }
}

impl fmt::Debug for IoctlCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IoctlCode({:#010x})", self.0)
    }
}

// ---------------------------------------------------------------------------
// Framing
// ---------------------------------------------------------------------------

/// The header of every request (input buffer): 16 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct RequestHeaderAbi {
    /// The object the verb acts on, or the parent of the object it creates
    /// ([`VerbId::target`]); zero for [`OpenCa`].
    pub handle: Le64,
    /// Private bytes following the fixed input.
    pub private_in_len: Le32,
    /// Most private bytes the caller accepts after the fixed output.
    pub private_out_max: Le32,
}

assert_layout!(RequestHeaderAbi, size = 16, handle @ 0, private_in_len @ 8,
    private_out_max @ 12);

/// The header of every response (output buffer): 16 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct ResponseHeaderAbi {
    /// [`IbStatus`] code.
    pub status: Le32,
    /// Private bytes following the fixed output.
    pub private_out_len: Le32,
    /// The created object's handle on success ([`VerbId::creates`]), else 0.
    pub handle: Le64,
}

assert_layout!(ResponseHeaderAbi, size = 16, status @ 0, private_out_len @ 4, handle @ 8);

/// Size of [`RequestHeaderAbi`].
pub const REQUEST_HEADER_SIZE: usize = size_of::<RequestHeaderAbi>();
/// Size of [`ResponseHeaderAbi`].
pub const RESPONSE_HEADER_SIZE: usize = size_of::<ResponseHeaderAbi>();

/// The kinds of object a request header or a response header names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ObjectKind {
    /// An open CA.
    Ca,
    /// A protection domain.
    Pd,
    /// An address vector.
    Av,
    /// A queue pair.
    Qp,
    /// A completion queue.
    Cq,
    /// A shared receive queue.
    Srq,
    /// A memory region.
    Mr,
    /// A memory window.
    Mw,
    /// A multicast membership.
    Mcast,
}

/// A verb: its identity and its fixed input and output layouts.
///
/// Implemented only by the zero-sized types of the registry ([`OpenCa`],
/// [`CreateQp`], ...). The hooks have permissive defaults; a verb overrides
/// them in the registry table.
pub trait Verb: Copy + Eq + fmt::Debug + 'static {
    /// The verb's entry in the registry.
    const ID: VerbId;
    /// The fixed part of the request after the header.
    type In: Repr + Copy + PartialEq + fmt::Debug;
    /// The fixed part of the response after the header.
    type Out: Repr + Copy + PartialEq + fmt::Debug;

    /// The verb answers [`IbStatus::Overflow`] with its fixed output filled
    /// in (reporting the room it needs) and no private bytes, instead of the
    /// zeroed output of other failures.
    const SIZE_ON_OVERFLOW: bool = false;

    /// Request rules beyond `In`'s own: the private bytes, and constraints
    /// that hold for a request but not for the same layout elsewhere.
    fn check_request(_input: &Self::In, _private: &[u8]) -> Result<(), AbiError> {
        Ok(())
    }

    /// Rules of a successful response beyond `Out`'s own.
    fn check_response(_output: &Self::Out, _private: &[u8]) -> Result<(), AbiError> {
        Ok(())
    }

    /// This input may only come from a kernel caller, though the verb is
    /// open to user mode.
    fn kernel_only_input(_input: &Self::In) -> bool {
        false
    }
}

/// A decoded request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request<'a, V: Verb> {
    /// The header's handle (see [`VerbId::target`]).
    pub handle: u64,
    /// The fixed input.
    pub input: V::In,
    /// The private input bytes.
    pub private: &'a [u8],
    /// Most private output bytes the caller accepts.
    pub private_out_max: u32,
}

impl<V: Verb> Request<'_, V> {
    /// The request must come from kernel mode: the verb is kernel-only, or
    /// this input is (a special QP). The proxy refuses such requests from
    /// user-mode requestors with [`IbStatus::InvalidPermission`].
    pub fn kernel_only(&self) -> bool {
        !V::ID.user_mode_allowed() || V::kernel_only_input(&self.input)
    }

    /// Re-encodes the request ([`encode_request`]).
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, AbiError> {
        encode_request::<V>(
            self.handle,
            &self.input,
            self.private,
            self.private_out_max,
            out,
        )
    }
}

/// A decoded response.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Response<'a, V: Verb> {
    /// The verb's status.
    pub status: IbStatus,
    /// The created object's handle, or 0.
    pub handle: u64,
    /// The fixed output: present iff the status is a success (or the
    /// verb's size report, see [`Verb::SIZE_ON_OVERFLOW`]).
    pub output: Option<V::Out>,
    /// The private output bytes (empty on failure).
    pub private: &'a [u8],
}

impl<V: Verb> Response<'_, V> {
    /// Re-encodes the response ([`encode_response`]).
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, AbiError> {
        encode_response::<V>(
            self.status,
            self.handle,
            self.output.as_ref(),
            self.private,
            out,
        )
    }
}

/// `fixed + private_len`, or `None` if the private length does not fit the
/// 32-bit header field or the sum overflows.
fn framed_len(fixed: usize, private_len: usize) -> Option<usize> {
    u32::try_from(private_len).ok()?;
    fixed.checked_add(private_len)
}

/// Bytes of a request of verb `V` with `private_len` private bytes.
pub fn request_len<V: Verb>(private_len: usize) -> Option<usize> {
    framed_len(REQUEST_HEADER_SIZE + V::ID.in_size(), private_len)
}

/// Bytes of a response of verb `V` with `private_len` private bytes.
pub fn response_len<V: Verb>(private_len: usize) -> Option<usize> {
    framed_len(RESPONSE_HEADER_SIZE + V::ID.out_size(), private_len)
}

/// The private length as its header field.
fn private_len_field(field: &'static str, private: &[u8]) -> Result<u32, AbiError> {
    u32::try_from(private.len()).map_err(|_| AbiError::BadLength {
        field,
        declared: private.len() as u64,
        available: u64::from(u32::MAX),
    })
}

/// Copies `parts` one after the other into the front of `out`; a short
/// `out` is left untouched.
fn write_parts(out: &mut [u8], parts: &[&[u8]]) -> Result<usize, AbiError> {
    let needed = parts
        .iter()
        .try_fold(0usize, |n, part| n.checked_add(part.len()))
        .unwrap_or(usize::MAX);
    let short = AbiError::Truncated {
        needed,
        got: out.len(),
    };
    let mut rest = out.get_mut(..needed).ok_or(short)?;
    for part in parts {
        let (head, tail) = rest.split_at_mut_checked(part.len()).ok_or(short)?;
        head.copy_from_slice(part);
        rest = tail;
    }
    Ok(needed)
}

/// The header handle must be non-zero exactly when the verb has a target.
fn check_target<V: Verb>(handle: u64) -> Result<(), AbiError> {
    if V::ID.target().is_some() == (handle != 0) {
        Ok(())
    } else {
        Err(AbiError::OutOfRange {
            field: "RequestHeaderAbi.handle",
            value: handle,
        })
    }
}

/// The response handle must be non-zero exactly for a successful create;
/// the status must be final.
fn check_response_header<V: Verb>(status: IbStatus, handle: u64) -> Result<(), AbiError> {
    if status == IbStatus::Pending {
        return Err(AbiError::OutOfRange {
            field: "ResponseHeaderAbi.status (Pending is not final)",
            value: status.code().into(),
        });
    }
    if (V::ID.creates().is_some() && status.is_success()) != (handle != 0) {
        return Err(AbiError::OutOfRange {
            field: "ResponseHeaderAbi.handle",
            value: handle,
        });
    }
    Ok(())
}

/// The buffer holds at least the header and the fixed layout.
fn check_fixed(bytes: &[u8], fixed: usize) -> Result<(), AbiError> {
    if bytes.len() < fixed {
        return Err(AbiError::Truncated {
            needed: fixed,
            got: bytes.len(),
        });
    }
    Ok(())
}

/// Whether a response with `status` carries the fixed output.
fn carries_output<V: Verb>(status: IbStatus) -> bool {
    status.is_success() || (V::SIZE_ON_OVERFLOW && status == IbStatus::Overflow)
}

/// Writes a request of verb `V` into the front of `out` and returns its
/// length.
///
/// Refuses (as [`decode_request`] would) a handle that disagrees with
/// [`VerbId::target`], an input whose layout does not parse, and private
/// bytes the verb rejects or that do not fit 32 bits; a short `out` gets
/// [`AbiError::Truncated`] and is left untouched.
pub fn encode_request<V: Verb>(
    handle: u64,
    input: &V::In,
    private: &[u8],
    private_out_max: u32,
    out: &mut [u8],
) -> Result<usize, AbiError> {
    check_target::<V>(handle)?;
    let fixed = input.emit();
    V::In::parse(&fixed)?;
    V::check_request(input, private)?;
    let header = RequestHeaderAbi {
        handle: Le64::new(handle),
        private_in_len: Le32::new(private_len_field(
            "RequestHeaderAbi.private_in_len",
            private,
        )?),
        private_out_max: Le32::new(private_out_max),
    };
    write_parts(out, &[header.as_bytes(), fixed.as_bytes(), private])
}

/// Reads and validates a request of verb `V` from untrusted bytes, which
/// must be exactly header + `In` + `private_in_len` bytes.
pub fn decode_request<V: Verb>(bytes: &[u8]) -> Result<Request<'_, V>, AbiError> {
    check_fixed(bytes, REQUEST_HEADER_SIZE + V::ID.in_size())?;
    let (header, rest) = read_prefix::<RequestHeaderAbi>(bytes)?;
    let (fixed, private) = read_prefix::<<V::In as Repr>::Abi>(rest)?;
    let declared = header.private_in_len.get();
    if u64::from(declared) != private.len() as u64 {
        return Err(AbiError::BadLength {
            field: "RequestHeaderAbi.private_in_len",
            declared: declared.into(),
            available: private.len() as u64,
        });
    }
    let handle = header.handle.get();
    check_target::<V>(handle)?;
    let input = V::In::parse(&fixed)?;
    V::check_request(&input, private)?;
    Ok(Request {
        handle,
        input,
        private,
        private_out_max: header.private_out_max.get(),
    })
}

/// Writes a response of verb `V` into the front of `out` and returns its
/// length.
///
/// `output` must be present exactly when the status carries one (success,
/// or the verb's size report on [`IbStatus::Overflow`]); a failure carries
/// no private bytes; `handle` is non-zero exactly for a successful create.
/// Anything [`decode_response`] would reject is refused; a short `out` gets
/// [`AbiError::Truncated`] and is left untouched. Keeping the private bytes
/// within the request's `private_out_max` is the caller's concern.
pub fn encode_response<V: Verb>(
    status: IbStatus,
    handle: u64,
    output: Option<&V::Out>,
    private: &[u8],
    out: &mut [u8],
) -> Result<usize, AbiError> {
    check_response_header::<V>(status, handle)?;
    let fixed = match (carries_output::<V>(status), output) {
        (true, Some(output)) => {
            let fixed = output.emit();
            V::Out::parse(&fixed)?;
            if status.is_success() {
                V::check_response(output, private)?;
            }
            fixed
        }
        (false, None) => <V::Out as Repr>::Abi::new_zeroed(),
        (_, output) => {
            return Err(AbiError::OutOfRange {
                field: "Response.output (present iff the status carries it)",
                value: u64::from(output.is_some()),
            });
        }
    };
    if !status.is_success() && !private.is_empty() {
        return Err(AbiError::BadLength {
            field: "ResponseHeaderAbi.private_out_len (failed status)",
            declared: private.len() as u64,
            available: 0,
        });
    }
    let header = ResponseHeaderAbi {
        status: Le32::new(status.code()),
        private_out_len: Le32::new(private_len_field(
            "ResponseHeaderAbi.private_out_len",
            private,
        )?),
        handle: Le64::new(handle),
    };
    write_parts(out, &[header.as_bytes(), fixed.as_bytes(), private])
}

/// Reads and validates a response of verb `V` from untrusted bytes, which
/// must be exactly header + `Out` + `private_out_len` bytes.
pub fn decode_response<V: Verb>(bytes: &[u8]) -> Result<Response<'_, V>, AbiError> {
    check_fixed(bytes, RESPONSE_HEADER_SIZE + V::ID.out_size())?;
    let (header, rest) = read_prefix::<ResponseHeaderAbi>(bytes)?;
    let (fixed, private) = read_prefix::<<V::Out as Repr>::Abi>(rest)?;
    let declared = header.private_out_len.get();
    if u64::from(declared) != private.len() as u64 {
        return Err(AbiError::BadLength {
            field: "ResponseHeaderAbi.private_out_len",
            declared: declared.into(),
            available: private.len() as u64,
        });
    }
    let status = IbStatus::from_code(header.status.get())?;
    let handle = header.handle.get();
    check_response_header::<V>(status, handle)?;
    if !status.is_success() && !private.is_empty() {
        return Err(AbiError::BadLength {
            field: "ResponseHeaderAbi.private_out_len (failed status)",
            declared: declared.into(),
            available: 0,
        });
    }
    let output = if carries_output::<V>(status) {
        let output = V::Out::parse(&fixed)?;
        if status.is_success() {
            V::check_response(&output, private)?;
        }
        Some(output)
    } else {
        ensure_zero("Response fixed output (failed status)", fixed.as_bytes())?;
        None
    };
    Ok(Response {
        status,
        handle,
        output,
        private,
    })
}

// ---------------------------------------------------------------------------
// The registry
// ---------------------------------------------------------------------------

/// Declares the verb registry from one table: a zero-sized type per verb
/// implementing [`Verb`], and [`VerbId`] with every per-verb property.
///
/// Row: `Name = index: ACCESS, user|kernel, Target -> Created, In => Out`
/// with `_` for "no object", and an optional `{ ... }` of [`Verb`] hook
/// overrides.
macro_rules! verbs {
    (@user user) => { true };
    (@user kernel) => { false };
    (@kind _) => { None };
    (@kind $kind:ident) => { Some(ObjectKind::$kind) };
    ($(
        $(#[$doc:meta])*
        $name:ident = $index:literal : $access:ident, $caller:ident,
            $target:tt -> $creates:tt, $in:ty => $out:ty $({ $($hooks:tt)* })?;
    )+) => {
        code_enum! {
            /// Every verb, valued by its IOCTL function number.
            pub enum VerbId: u16 {
                $(
                    $(#[$doc])*
                    $name = FUNCTION_BASE + $index,
                )+
            }
        }

        $(
            $(#[$doc])*
            #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
            pub struct $name;

            impl Verb for $name {
                const ID: VerbId = VerbId::$name;
                type In = $in;
                type Out = $out;
                $($($hooks)*)?
            }
        )+

        impl VerbId {
            /// The verb's name.
            pub const fn name(self) -> &'static str {
                match self { $(Self::$name => stringify!($name),)+ }
            }

            /// The access the caller's handle needs: read for queries and
            /// waits, read and write for the rest.
            pub const fn access(self) -> RequiredAccess {
                match self { $(Self::$name => RequiredAccess::$access,)+ }
            }

            /// False for kernel-only verbs, refused to user-mode requestors.
            pub const fn user_mode_allowed(self) -> bool {
                match self { $(Self::$name => verbs!(@user $caller),)+ }
            }

            /// What the request header's handle names (`None`: it is zero).
            pub const fn target(self) -> Option<ObjectKind> {
                match self { $(Self::$name => verbs!(@kind $target),)+ }
            }

            /// What the response header's handle names on success (`None`:
            /// it is zero).
            pub const fn creates(self) -> Option<ObjectKind> {
                match self { $(Self::$name => verbs!(@kind $creates),)+ }
            }

            /// Size of the fixed input layout.
            pub const fn in_size(self) -> usize {
                match self { $(Self::$name => size_of::<<$in as Repr>::Abi>(),)+ }
            }

            /// Size of the fixed output layout.
            pub const fn out_size(self) -> usize {
                match self { $(Self::$name => size_of::<<$out as Repr>::Abi>(),)+ }
            }
        }
    };
}

verbs! {
    /// Opens the CA: binds the ABI version and returns the CA handle, the
    /// CA's identity, the caller's doorbell page and the plug-in name.
    OpenCa = 0: READ_WRITE, user, _ -> Ca, OpenCaIn => OpenCaOut;
    /// Closes the CA handle.
    CloseCa = 1: READ_WRITE, user, Ca -> _, Empty => Empty;
    /// Queries the CA attributes; the attribute block is the private
    /// output. When `private_out_max` is too small the answer is
    /// [`IbStatus::Overflow`] with [`QueryCaOut::total_size`] filled in.
    QueryCa = 2: READ, user, Ca -> _, Empty => QueryCaOut {
        const SIZE_ON_OVERFLOW: bool = true;

        fn check_response(output: &QueryCaOut, private: &[u8]) -> Result<(), AbiError> {
            output.check_block(private)
        }
    };
    /// Modifies a port's capabilities and resets its counters.
    ModifyCa = 3: READ_WRITE, user, Ca -> _, CaModify => Empty;
    /// Allocates a protection domain.
    AllocPd = 4: READ_WRITE, user, Ca -> Pd, Empty => Empty;
    /// Deallocates a protection domain.
    DeallocPd = 5: READ_WRITE, user, Pd -> _, Empty => Empty;
    /// Creates an address vector in a PD.
    CreateAv = 6: READ_WRITE, user, Pd -> Av, AvAttr => Empty;
    /// Queries an address vector.
    QueryAv = 7: READ, user, Av -> _, Empty => QueryAvOut;
    /// Modifies an address vector.
    ModifyAv = 8: READ_WRITE, user, Av -> _, AvAttr => Empty;
    /// Destroys an address vector.
    DestroyAv = 9: READ_WRITE, user, Av -> _, Empty => Empty;
    /// Creates a QP. Special QPs (SMI/GSI) are for kernel callers only
    /// ([`Request::kernel_only`]).
    CreateQp = 10: READ_WRITE, user, Ca -> Qp, QpCreate => QpCreated {
        fn kernel_only_input(input: &QpCreate) -> bool {
            input.qp_type.is_special()
        }
    };
    /// Queries a QP.
    QueryQp = 11: READ, user, Qp -> _, Empty => QpQueryOut;
    /// Modifies a QP.
    ModifyQp = 12: READ_WRITE, user, Qp -> _, QpModify => Empty;
    /// Destroys a QP.
    DestroyQp = 13: READ_WRITE, user, Qp -> _, Empty => Empty;
    /// Creates a CQ; answers the actual size.
    CreateCq = 14: READ_WRITE, user, Ca -> Cq, CqAttr => CqOut;
    /// Queries a CQ's size.
    QueryCq = 15: READ, user, Cq -> _, Empty => CqOut;
    /// Resizes a CQ; answers the actual size.
    ResizeCq = 16: READ_WRITE, user, Cq -> _, CqAttr => CqOut;
    /// Destroys a CQ.
    DestroyCq = 17: READ_WRITE, user, Cq -> _, Empty => Empty;
    /// Creates an SRQ; answers the actual attributes.
    CreateSrq = 18: READ_WRITE, user, Ca -> Srq, SrqCreate => SrqAttr;
    /// Queries an SRQ.
    QuerySrq = 19: READ, user, Srq -> _, Empty => SrqAttr;
    /// Modifies an SRQ.
    ModifySrq = 20: READ_WRITE, user, Srq -> _, SrqModify => Empty;
    /// Destroys an SRQ.
    DestroySrq = 21: READ_WRITE, user, Srq -> _, Empty => Empty;
    /// Registers a virtual memory region in a PD.
    RegMr = 22: READ_WRITE, user, Pd -> Mr, MrRegister => MrKeys;
    /// Registers a new region sharing the translation of the target region.
    RegSharedMr = 23: READ_WRITE, user, Mr -> Mr, MrShare => RegSharedOut;
    /// Re-registers a region; answers the new keys.
    ReregMr = 24: READ_WRITE, user, Mr -> _, MrRereg => MrKeys;
    /// Queries a region.
    QueryMr = 25: READ, user, Mr -> _, Empty => MrQuery;
    /// Deregisters a region.
    DeregMr = 26: READ_WRITE, user, Mr -> _, Empty => Empty;
    /// Allocates a memory window in a PD; the request's R_Key must be zero,
    /// the answer carries the initial R_Key.
    AllocMw = 27: READ_WRITE, user, Pd -> Mw, MwAttr => MwAttr {
        fn check_request(input: &MwAttr, _private: &[u8]) -> Result<(), AbiError> {
            if input.rkey.get() == 0 {
                Ok(())
            } else {
                Err(AbiError::ReservedNotZero { field: "AllocMw request MwAttr.rkey" })
            }
        }
    };
    /// Queries a memory window.
    QueryMw = 28: READ, user, Mw -> _, Empty => QueryMwOut;
    /// Deallocates a memory window.
    DeallocMw = 29: READ_WRITE, user, Mw -> _, Empty => Empty;
    /// Attaches the target UD QP to a multicast group.
    AttachMcast = 30: READ_WRITE, user, Qp -> Mcast, McastGroup => Empty;
    /// Detaches a multicast membership.
    DetachMcast = 31: READ_WRITE, user, Mcast -> _, Empty => Empty;
    /// Pends until the armed CQ's completion event fires.
    WaitCqEvent = 32: READ, user, Cq -> _, Empty => Empty;
    /// Pends until the CA reports an asynchronous event.
    GetAsyncEvent = 33: READ, user, Ca -> _, Empty => AsyncEventRecord;
    /// Registers a physical region (kernel only); the page list is the
    /// private input.
    RegPhysMr = 34: READ_WRITE, kernel, Pd -> Mr, PhysMrRegister => RegPhysOut {
        fn check_request(input: &PhysMrRegister, private: &[u8]) -> Result<(), AbiError> {
            input.page_list(private).map(|_| ())
        }
    };
    /// Processes a MAD through the CA's local agents (kernel only).
    LocalMad = 35: READ_WRITE, kernel, Ca -> _, LocalMadIn => LocalMadOut;
    /// Re-registers a region (kernel only; guide Table 4-1 "Reregister
    /// Physical Memory"): each part present changes; a new translation is a
    /// page list, the private input. Answers the new keys and the I/O
    /// virtual address used.
    ReregPhysMr = 36: READ_WRITE, kernel, Mr -> _, PhysMrRereg => RegPhysOut {
        fn check_request(input: &PhysMrRereg, private: &[u8]) -> Result<(), AbiError> {
            input.page_list(private).map(|_| ())
        }
    };
}

const _: () = {
    let mut i = 0;
    while i < VerbId::ALL.len() {
        let function = VerbId::ALL[i].code();
        assert!(
            function == FUNCTION_BASE + i as u16,
            "verbs are numbered in order"
        );
        assert!(function <= MAX_FUNCTION, "function numbers fit 12 bits");
        i += 1;
    }
};

impl VerbId {
    /// The verb's IOCTL code: InfiniBand device type, its function number,
    /// `METHOD_BUFFERED` and its access.
    pub const fn ioctl(self) -> IoctlCode {
        IoctlCode::compose(
            FILE_DEVICE_INFINIBAND,
            self.code(),
            TransferMethod::Buffered,
            self.access(),
        )
    }

    /// The verb of an IOCTL code. Refuses another device type, another
    /// method, an unknown function, and an access field other than the
    /// verb's.
    pub const fn from_ioctl(code: IoctlCode) -> Result<Self, AbiError> {
        if code.device_type() != FILE_DEVICE_INFINIBAND {
            return Err(AbiError::OutOfRange {
                field: "IoctlCode.device_type",
                value: code.device_type() as u64,
            });
        }
        if !matches!(code.method(), TransferMethod::Buffered) {
            return Err(AbiError::OutOfRange {
                field: "IoctlCode.method",
                value: code.method().code() as u64,
            });
        }
        let verb = match Self::from_code(code.function()) {
            Ok(verb) => verb,
            Err(e) => return Err(e),
        };
        if code.access().bits() != verb.access().bits() {
            return Err(AbiError::OutOfRange {
                field: "IoctlCode.access",
                value: code.access().bits() as u64,
            });
        }
        Ok(verb)
    }
}

// ---------------------------------------------------------------------------
// Fixed layouts of the verbs
// ---------------------------------------------------------------------------

/// Fails with `OutOfRange` when a value that must be non-zero (a handle, a
/// GUID, a size) is zero.
fn non_null(field: &'static str, raw: u64) -> Result<(), AbiError> {
    if raw == 0 {
        Err(AbiError::OutOfRange { field, value: 0 })
    } else {
        Ok(())
    }
}

/// The fixed part of a verb that has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Empty;

/// ABI layout of [`Empty`]: 0 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct EmptyAbi {}

assert_layout!(EmptyAbi, size = 0);

impl Repr for Empty {
    type Abi = EmptyAbi;

    fn parse(_abi: &EmptyAbi) -> Result<Self, AbiError> {
        Ok(Self)
    }

    fn emit(&self) -> EmptyAbi {
        EmptyAbi {}
    }
}

/// The keys are their own layout; every bit pattern is a pair of keys.
impl Repr for MrKeys {
    type Abi = MrKeys;

    fn parse(abi: &MrKeys) -> Result<Self, AbiError> {
        Ok(*abi)
    }

    fn emit(&self) -> MrKeys {
        *self
    }
}

/// [`OpenCa`] request: the version of the caller's library.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpenCaIn {
    /// The version the caller speaks; the kernel must satisfy it.
    pub version: InterfaceVersion,
}

impl OpenCaIn {
    /// The request this crate's version sends.
    pub const CURRENT: Self = Self {
        version: PROXY_ABI_VERSION,
    };
}

/// ABI layout of [`OpenCaIn`]: 8 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct OpenCaInAbi {
    /// [`InterfaceVersion::packed`].
    pub abi_version: Le16,
    /// Reserved, zero.
    pub reserved_at_0x2: [u8; 6],
}

assert_layout!(OpenCaInAbi, size = 8, abi_version @ 0, reserved_at_0x2 @ 2);

impl Repr for OpenCaIn {
    type Abi = OpenCaInAbi;

    /// The kernel side of the bind check: [`PROXY_ABI_VERSION`] must satisfy
    /// the caller's version (same major, minor at least the caller's).
    fn parse(abi: &OpenCaInAbi) -> Result<Self, AbiError> {
        ensure_zero("OpenCaInAbi.reserved_at_0x2", &abi.reserved_at_0x2)?;
        let version = InterfaceVersion::from_packed(abi.abi_version.get());
        PROXY_ABI_VERSION.check(version)?;
        Ok(Self { version })
    }

    fn emit(&self) -> OpenCaInAbi {
        OpenCaInAbi {
            abi_version: Le16::new(self.version.packed()),
            ..OpenCaInAbi::default()
        }
    }
}

/// The doorbell (UAR) page mapped into a user-mode caller at open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DoorbellPage {
    /// User virtual address of the mapping; non-zero, page-aligned.
    pub va: u64,
    /// Bytes mapped: a power of two of at least one page; the mapping does
    /// not wrap.
    pub size: u32,
}

impl DoorbellPage {
    /// The smallest mapping, and the alignment of every mapping.
    pub const PAGE_SIZE: u32 = 4096;

    fn check(self) -> Result<Self, AbiError> {
        if !self.size.is_power_of_two() || self.size < Self::PAGE_SIZE {
            return Err(AbiError::OutOfRange {
                field: "OpenCaOutAbi.doorbell_page_size",
                value: self.size.into(),
            });
        }
        if self.va == 0
            || !self.va.is_multiple_of(Self::PAGE_SIZE.into())
            || self.va.checked_add(self.size.into()).is_none()
        {
            return Err(AbiError::OutOfRange {
                field: "OpenCaOutAbi.doorbell_page",
                value: self.va,
            });
        }
        Ok(self)
    }
}

/// [`OpenCa`] response: the kernel's version and what the library needs to
/// drive the CA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpenCaOut {
    /// The kernel's version; it must satisfy the library's.
    pub version: InterfaceVersion,
    /// The CA (node) GUID; non-zero.
    pub ca_guid: NodeGuid,
    /// IEEE OUI of the vendor (24 bits).
    pub vendor_id: u32,
    /// Vendor's device ID.
    pub device_id: u16,
    /// Hardware revision.
    pub revision: u16,
    /// The caller's doorbell page; `None` for kernel callers.
    pub doorbell: Option<DoorbellPage>,
    /// The user-mode verbs provider to load.
    pub uvp_name: UvpName,
}

/// ABI layout of [`OpenCaOut`]: 104 bytes.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct OpenCaOutAbi {
    /// [`InterfaceVersion::packed`] of the kernel.
    pub abi_version: Le16,
    /// Reserved, zero.
    pub reserved_at_0x2: [u8; 6],
    /// CA GUID, network order.
    pub ca_guid: NodeGuid,
    /// Vendor OUI.
    pub vendor_id: Le32,
    /// Device ID.
    pub device_id: Le16,
    /// Revision.
    pub revision: Le16,
    /// Doorbell page user VA, 0 for kernel callers.
    pub doorbell_page: Le64,
    /// Doorbell mapping size, 0 for kernel callers.
    pub doorbell_page_size: Le32,
    /// Reserved, zero.
    pub reserved_at_0x24: [u8; 4],
    /// Plug-in name.
    pub uvp_name: UvpNameAbi,
}

assert_layout!(OpenCaOutAbi, size = 104, abi_version @ 0, reserved_at_0x2 @ 2, ca_guid @ 8,
    vendor_id @ 16, device_id @ 20, revision @ 22, doorbell_page @ 24,
    doorbell_page_size @ 32, reserved_at_0x24 @ 36, uvp_name @ 40);

impl OpenCaOut {
    /// Largest IEEE OUI.
    pub const MAX_VENDOR_ID: u32 = 0x00FF_FFFF;
}

impl Repr for OpenCaOut {
    type Abi = OpenCaOutAbi;

    /// The library side of the bind check: the kernel's version must
    /// satisfy [`PROXY_ABI_VERSION`].
    fn parse(abi: &OpenCaOutAbi) -> Result<Self, AbiError> {
        ensure_zero("OpenCaOutAbi.reserved_at_0x2", &abi.reserved_at_0x2)?;
        ensure_zero("OpenCaOutAbi.reserved_at_0x24", &abi.reserved_at_0x24)?;
        let version = InterfaceVersion::from_packed(abi.abi_version.get());
        version.check(PROXY_ABI_VERSION)?;
        non_null("OpenCaOutAbi.ca_guid", abi.ca_guid.get())?;
        let vendor_id = abi.vendor_id.get();
        if vendor_id > Self::MAX_VENDOR_ID {
            return Err(AbiError::OutOfRange {
                field: "OpenCaOutAbi.vendor_id",
                value: vendor_id.into(),
            });
        }
        let doorbell = match (abi.doorbell_page.get(), abi.doorbell_page_size.get()) {
            (0, 0) => None,
            (va, size) => Some(DoorbellPage { va, size }.check()?),
        };
        Ok(Self {
            version,
            ca_guid: abi.ca_guid,
            vendor_id,
            device_id: abi.device_id.get(),
            revision: abi.revision.get(),
            doorbell,
            uvp_name: UvpName::parse(&abi.uvp_name)?,
        })
    }

    fn emit(&self) -> OpenCaOutAbi {
        let (va, size) = self.doorbell.map_or((0, 0), |d| (d.va, d.size));
        OpenCaOutAbi {
            abi_version: Le16::new(self.version.packed()),
            reserved_at_0x2: [0; 6],
            ca_guid: self.ca_guid,
            vendor_id: Le32::new(self.vendor_id),
            device_id: Le16::new(self.device_id),
            revision: Le16::new(self.revision),
            doorbell_page: Le64::new(va),
            doorbell_page_size: Le32::new(size),
            reserved_at_0x24: [0; 4],
            uvp_name: self.uvp_name.emit(),
        }
    }
}

/// [`QueryCa`] response: the size of the attribute block.
///
/// On success the block (the [`crate::ca`] layout, `total_size` bytes) is
/// the private output. When it does not fit `private_out_max` the answer is
/// [`IbStatus::Overflow`] with this output filled in and no private bytes,
/// so the caller can retry with room for `total_size` bytes. `Overflow` is
/// the status whose meaning is "output did not fit" and whose NTSTATUS
/// (`STATUS_BUFFER_OVERFLOW`) is a warning, for which the I/O manager still
/// copies a buffered output back to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QueryCaOut {
    /// Bytes of the attribute block; at least its header.
    pub total_size: u32,
}

/// ABI layout of [`QueryCaOut`]: 8 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct QueryCaOutAbi {
    /// Bytes of the attribute block.
    pub total_size: Le32,
    /// Reserved, zero.
    pub reserved_at_0x4: [u8; 4],
}

assert_layout!(QueryCaOutAbi, size = 8, total_size @ 0, reserved_at_0x4 @ 4);

impl QueryCaOut {
    /// Checks a successful answer's private bytes: exactly one valid
    /// attribute block of `total_size` bytes.
    pub fn check_block(&self, private: &[u8]) -> Result<(), AbiError> {
        let block = CaAttrView::parse(private)?;
        let block_size = block.attr().layout.total_size;
        if block_size != self.total_size || private.len() as u64 != u64::from(self.total_size) {
            return Err(AbiError::BadLength {
                field: "QueryCaOut.total_size",
                declared: self.total_size.into(),
                available: private.len() as u64,
            });
        }
        Ok(())
    }
}

impl Repr for QueryCaOut {
    type Abi = QueryCaOutAbi;

    fn parse(abi: &QueryCaOutAbi) -> Result<Self, AbiError> {
        ensure_zero("QueryCaOutAbi.reserved_at_0x4", &abi.reserved_at_0x4)?;
        let total_size = abi.total_size.get();
        if (total_size as usize) < CA_ATTR_HEADER_SIZE {
            return Err(AbiError::OutOfRange {
                field: "QueryCaOutAbi.total_size",
                value: total_size.into(),
            });
        }
        Ok(Self { total_size })
    }

    fn emit(&self) -> QueryCaOutAbi {
        QueryCaOutAbi {
            total_size: Le32::new(self.total_size),
            ..QueryCaOutAbi::default()
        }
    }
}

/// [`QueryAv`] response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QueryAvOut {
    /// The AV's protection domain; non-null.
    pub pd: PdHandle,
    /// The address vector.
    pub av: AvAttr,
}

/// ABI layout of [`QueryAvOut`]: 40 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct QueryAvOutAbi {
    /// Protection domain.
    pub pd: PdHandle,
    /// Address vector.
    pub av: AvAbi,
}

assert_layout!(QueryAvOutAbi, size = 40, pd @ 0, av @ 8);

impl Repr for QueryAvOut {
    type Abi = QueryAvOutAbi;

    fn parse(abi: &QueryAvOutAbi) -> Result<Self, AbiError> {
        non_null("QueryAvOutAbi.pd", abi.pd.raw())?;
        Ok(Self {
            pd: abi.pd,
            av: AvAttr::parse(&abi.av)?,
        })
    }

    fn emit(&self) -> QueryAvOutAbi {
        QueryAvOutAbi {
            pd: self.pd,
            av: self.av.emit(),
        }
    }
}

/// [`CreateQp`] response: the QP number and the actual capacities.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpCreated {
    /// The QP number.
    pub qpn: Qpn,
    /// The capacities granted (at least those requested).
    pub caps: QpCaps,
}

/// ABI layout of [`QpCreated`]: 32 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct QpCreatedAbi {
    /// QP number, 24 bits, network order.
    pub qpn: Be32,
    /// Reserved, zero.
    pub reserved_at_0x4: [u8; 4],
    /// Capacities.
    pub caps: QpCapsAbi,
    /// Reserved, zero.
    pub reserved_at_0x1c: [u8; 4],
}

assert_layout!(QpCreatedAbi, size = 32, qpn @ 0, reserved_at_0x4 @ 4, caps @ 8,
    reserved_at_0x1c @ 28);

impl Repr for QpCreated {
    type Abi = QpCreatedAbi;

    fn parse(abi: &QpCreatedAbi) -> Result<Self, AbiError> {
        ensure_zero("QpCreatedAbi.reserved_at_0x4", &abi.reserved_at_0x4)?;
        ensure_zero("QpCreatedAbi.reserved_at_0x1c", &abi.reserved_at_0x1c)?;
        Ok(Self {
            qpn: Qpn::from_be(abi.qpn)?,
            caps: QpCaps::parse(&abi.caps)?,
        })
    }

    fn emit(&self) -> QpCreatedAbi {
        QpCreatedAbi {
            qpn: self.qpn.to_be(),
            caps: self.caps.emit(),
            ..QpCreatedAbi::default()
        }
    }
}

/// [`QueryQp`] response: the QP's fixed properties, its state, and its
/// current attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpQueryOut {
    /// Transport service.
    pub qp_type: QpType,
    /// Current state.
    pub state: QpState,
    /// Every send WR completes signaled.
    pub sq_sig_all: bool,
    /// QP number.
    pub qpn: Qpn,
    /// Current capacities.
    pub caps: QpCaps,
    /// The attributes that are meaningful for the QP's type and state, as a
    /// Modify QP would carry them. The state and capacities are reported in
    /// the fields above, never here ([`Self::OUTSIDE_ATTR`]).
    pub attr: QpModify,
}

impl QpQueryOut {
    /// Attributes reported by the fixed fields and therefore absent from
    /// `attr`.
    pub const OUTSIDE_ATTR: QpAttrMask = QpAttrMask::STATE
        .union(QpAttrMask::CUR_STATE)
        .union(QpAttrMask::CAP);
}

/// ABI layout of [`QpQueryOut`]: 160 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct QpQueryOutAbi {
    /// [`QpType`] code.
    pub qp_type: u8,
    /// [`QpState`] code.
    pub state: u8,
    /// 0 or 1.
    pub sq_sig_all: u8,
    /// Reserved, zero.
    pub reserved_at_0x3: [u8; 1],
    /// QP number, 24 bits, network order.
    pub qpn: Be32,
    /// Capacities.
    pub caps: QpCapsAbi,
    /// Reserved, zero.
    pub reserved_at_0x1c: [u8; 4],
    /// Current attributes with the mask of those present.
    pub attr: QpModifyAbi,
}

assert_layout!(QpQueryOutAbi, size = 160, qp_type @ 0, state @ 1, sq_sig_all @ 2,
    reserved_at_0x3 @ 3, qpn @ 4, caps @ 8, reserved_at_0x1c @ 28, attr @ 32);

impl Repr for QpQueryOut {
    type Abi = QpQueryOutAbi;

    fn parse(abi: &QpQueryOutAbi) -> Result<Self, AbiError> {
        ensure_zero("QpQueryOutAbi.reserved_at_0x3", &abi.reserved_at_0x3)?;
        ensure_zero("QpQueryOutAbi.reserved_at_0x1c", &abi.reserved_at_0x1c)?;
        let attr = QpModify::parse(&abi.attr)?;
        let misplaced = attr.mask().intersection(Self::OUTSIDE_ATTR);
        if !misplaced.is_empty() {
            return Err(AbiError::OutOfRange {
                field: "QpQueryOutAbi.attr.attr_mask (state or caps)",
                value: misplaced.bits().into(),
            });
        }
        Ok(Self {
            qp_type: QpType::from_code(abi.qp_type)?,
            state: QpState::from_code(abi.state)?,
            sq_sig_all: parse_bool("QpQueryOutAbi.sq_sig_all", abi.sq_sig_all)?,
            qpn: Qpn::from_be(abi.qpn)?,
            caps: QpCaps::parse(&abi.caps)?,
            attr,
        })
    }

    fn emit(&self) -> QpQueryOutAbi {
        QpQueryOutAbi {
            qp_type: self.qp_type.code(),
            state: self.state.code(),
            sq_sig_all: self.sq_sig_all.into(),
            qpn: self.qpn.to_be(),
            caps: self.caps.emit(),
            attr: self.attr.emit(),
            ..QpQueryOutAbi::default()
        }
    }
}

/// [`CreateCq`], [`QueryCq`] and [`ResizeCq`] response: the actual size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqOut {
    /// Entries the CQ holds; non-zero.
    pub cqe: u32,
}

/// ABI layout of [`CqOut`]: 8 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CqOutAbi {
    /// Entries.
    pub cqe: Le32,
    /// Reserved, zero.
    pub reserved_at_0x4: [u8; 4],
}

assert_layout!(CqOutAbi, size = 8, cqe @ 0, reserved_at_0x4 @ 4);

impl Repr for CqOut {
    type Abi = CqOutAbi;

    fn parse(abi: &CqOutAbi) -> Result<Self, AbiError> {
        ensure_zero("CqOutAbi.reserved_at_0x4", &abi.reserved_at_0x4)?;
        non_null("CqOutAbi.cqe", abi.cqe.get().into())?;
        Ok(Self { cqe: abi.cqe.get() })
    }

    fn emit(&self) -> CqOutAbi {
        CqOutAbi {
            cqe: Le32::new(self.cqe),
            ..CqOutAbi::default()
        }
    }
}

/// [`RegSharedMr`] response: the new region's keys and actual address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegSharedOut {
    /// Keys of the new region.
    pub keys: MrKeys,
    /// Start address the provider chose.
    pub vaddr: u64,
}

/// ABI layout of [`RegSharedOut`]: 16 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct RegSharedOutAbi {
    /// Keys.
    pub keys: MrKeys,
    /// Start address.
    pub vaddr: Le64,
}

assert_layout!(RegSharedOutAbi, size = 16, keys @ 0, vaddr @ 8);

impl Repr for RegSharedOut {
    type Abi = RegSharedOutAbi;

    fn parse(abi: &RegSharedOutAbi) -> Result<Self, AbiError> {
        Ok(Self {
            keys: abi.keys,
            vaddr: abi.vaddr.get(),
        })
    }

    fn emit(&self) -> RegSharedOutAbi {
        RegSharedOutAbi {
            keys: self.keys,
            vaddr: Le64::new(self.vaddr),
        }
    }
}

/// [`QueryMw`] response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QueryMwOut {
    /// The window's protection domain; non-null.
    pub pd: PdHandle,
    /// Type and current R_Key.
    pub attr: MwAttr,
}

/// ABI layout of [`QueryMwOut`]: 16 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct QueryMwOutAbi {
    /// Protection domain.
    pub pd: PdHandle,
    /// Window attributes.
    pub attr: MwAttrAbi,
}

assert_layout!(QueryMwOutAbi, size = 16, pd @ 0, attr @ 8);

impl Repr for QueryMwOut {
    type Abi = QueryMwOutAbi;

    fn parse(abi: &QueryMwOutAbi) -> Result<Self, AbiError> {
        non_null("QueryMwOutAbi.pd", abi.pd.raw())?;
        Ok(Self {
            pd: abi.pd,
            attr: MwAttr::parse(&abi.attr)?,
        })
    }

    fn emit(&self) -> QueryMwOutAbi {
        QueryMwOutAbi {
            pd: self.pd,
            attr: self.attr.emit(),
        }
    }
}

/// [`RegPhysMr`] response: the keys and the actual I/O virtual address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegPhysOut {
    /// Keys of the region.
    pub keys: MrKeys,
    /// IOVA of the region's first byte, as the provider chose it.
    pub iova: u64,
}

/// ABI layout of [`RegPhysOut`]: 16 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct RegPhysOutAbi {
    /// Keys.
    pub keys: MrKeys,
    /// IOVA.
    pub iova: Le64,
}

assert_layout!(RegPhysOutAbi, size = 16, keys @ 0, iova @ 8);

impl Repr for RegPhysOut {
    type Abi = RegPhysOutAbi;

    fn parse(abi: &RegPhysOutAbi) -> Result<Self, AbiError> {
        Ok(Self {
            keys: abi.keys,
            iova: abi.iova.get(),
        })
    }

    fn emit(&self) -> RegPhysOutAbi {
        RegPhysOutAbi {
            keys: self.keys,
            iova: Le64::new(self.iova),
        }
    }
}

/// Size of a MAD (IBA 13.4).
pub const MAD_SIZE: usize = 256;

/// [`LocalMad`] request: a MAD for the CA's local agents on one port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalMadIn {
    /// The port whose agents process the MAD.
    pub port: PortNum,
    /// The MAD, opaque here (the agents validate it).
    pub mad: [u8; MAD_SIZE],
}

/// ABI layout of [`LocalMadIn`]: 264 bytes.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct LocalMadInAbi {
    /// Port number.
    pub port_num: u8,
    /// Reserved, zero.
    pub reserved_at_0x1: [u8; 7],
    /// The MAD.
    pub mad: [u8; MAD_SIZE],
}

assert_layout!(LocalMadInAbi, size = 264, port_num @ 0, reserved_at_0x1 @ 1, mad @ 8);

impl Repr for LocalMadIn {
    type Abi = LocalMadInAbi;

    fn parse(abi: &LocalMadInAbi) -> Result<Self, AbiError> {
        ensure_zero("LocalMadInAbi.reserved_at_0x1", &abi.reserved_at_0x1)?;
        Ok(Self {
            port: PortNum::new(abi.port_num)?,
            mad: abi.mad,
        })
    }

    fn emit(&self) -> LocalMadInAbi {
        LocalMadInAbi {
            port_num: self.port.get(),
            reserved_at_0x1: [0; 7],
            mad: self.mad,
        }
    }
}

/// [`LocalMad`] response: the agents' reply MAD.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalMadOut {
    /// The reply, opaque here.
    pub mad: [u8; MAD_SIZE],
}

/// ABI layout of [`LocalMadOut`]: 256 bytes.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct LocalMadOutAbi {
    /// The reply MAD.
    pub mad: [u8; MAD_SIZE],
}

assert_layout!(LocalMadOutAbi, size = 256, mad @ 0);

impl Repr for LocalMadOut {
    type Abi = LocalMadOutAbi;

    fn parse(abi: &LocalMadOutAbi) -> Result<Self, AbiError> {
        Ok(Self { mad: abi.mad })
    }

    fn emit(&self) -> LocalMadOutAbi {
        LocalMadOutAbi { mad: self.mad }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::testing::{
        Corruption, assert_corruptions_rejected, assert_decode_total, assert_round_trip,
    };
    use crate::access::AccessFlags;
    use crate::ca::{Atomicity, CaAttr, CaAttrParts, CaCaps, CaLayout, CaLimits};
    use crate::event::AsyncEventCode;
    use crate::handle::CqHandle;
    use crate::mr::MwType;
    use crate::qp::tests::rc_to_rtr;
    use crate::scalars::Gid;
    use crate::wr::{LKey, RKey};
    use proptest::prelude::*;
    use proptest::sample::Index;
    use std::collections::HashSet;

    use RequiredAccess as A;
    use TransferMethod as M;

    // ---- CTL_CODE --------------------------------------------------------

    #[test]
    fn ctl_code_matches_hand_computed_values() {
        let table: &[(u16, u16, TransferMethod, RequiredAccess, u32)] = &[
            (0x3B, 0x800, M::Buffered, A::READ_WRITE, 0x003B_E000),
            (0x3B, 0x802, M::Buffered, A::READ, 0x003B_6008),
            (0x3B, 0xFFF, M::Neither, A::WRITE, 0x003B_BFFF),
            (0xFFFF, 0x001, M::InDirect, A::READ, 0xFFFF_4005),
            (0x0000, 0x000, M::OutDirect, A::ANY, 0x0000_0002),
            // IOCTL_STORAGE_QUERY_PROPERTY and IOCTL_DISK_SET_DRIVE_LAYOUT.
            (0x2D, 0x500, M::Buffered, A::ANY, 0x002D_1400),
            (0x07, 0x004, M::Buffered, A::READ_WRITE, 0x0007_C010),
        ];
        for &(device, function, method, access, raw) in table {
            let code = IoctlCode::new(device, function, method, access).unwrap();
            assert_eq!(code.raw(), raw, "{code:?}");
            let back = IoctlCode::from_raw(raw);
            assert_eq!(back.device_type(), device);
            assert_eq!(back.function(), function);
            assert_eq!(back.method(), method);
            assert_eq!(back.access(), access);
        }
        assert_eq!(
            IoctlCode::new(0x3B, 0x1000, M::Buffered, A::ANY),
            None,
            "13-bit function"
        );
        assert_eq!(
            format!("{:?}", IoctlCode::from_raw(0x003B_E000)),
            "IoctlCode(0x003be000)"
        );
    }

    #[test]
    fn verb_codes_by_hand() {
        let table: &[(VerbId, u32)] = &[
            (VerbId::OpenCa, 0x003B_E000),
            (VerbId::CloseCa, 0x003B_E004),
            (VerbId::QueryCa, 0x003B_6008),
            (VerbId::CreateQp, 0x003B_E028),
            (VerbId::WaitCqEvent, 0x003B_6080),
            (VerbId::GetAsyncEvent, 0x003B_6084),
            (VerbId::LocalMad, 0x003B_E08C),
        ];
        for &(verb, raw) in table {
            assert_eq!(verb.ioctl().raw(), raw, "{verb:?}");
            assert_eq!(VerbId::from_ioctl(IoctlCode::from_raw(raw)), Ok(verb));
        }
    }

    // ---- the registry ----------------------------------------------------

    #[test]
    fn registry_is_consistent() {
        assert_eq!(VerbId::ALL.len(), 37);
        let mut codes = HashSet::new();
        for (i, &verb) in VerbId::ALL.iter().enumerate() {
            let code = verb.ioctl();
            assert!(codes.insert(code.raw()), "{verb:?} shares {code:?}");
            assert_eq!(code.device_type(), FILE_DEVICE_INFINIBAND);
            assert_eq!(code.method(), TransferMethod::Buffered);
            assert_eq!(code.function(), 0x800 + i as u16);
            assert_eq!(code.access(), verb.access());
            assert_eq!(VerbId::from_ioctl(code), Ok(verb));
            assert_eq!(verb.name(), format!("{verb:?}"));

            let name = verb.name();
            let read_only = ["Query", "Wait", "GetAsync"]
                .iter()
                .any(|p| name.starts_with(p));
            let want = if read_only { A::READ } else { A::READ_WRITE };
            assert_eq!(verb.access(), want, "{verb:?}");
            assert_eq!(
                verb.user_mode_allowed(),
                !matches!(
                    verb,
                    VerbId::RegPhysMr | VerbId::LocalMad | VerbId::ReregPhysMr
                ),
                "{verb:?}"
            );
            assert_eq!(verb.target().is_none(), verb == VerbId::OpenCa, "{verb:?}");
            let creates = ["Open", "Alloc", "Create", "Reg", "Attach"]
                .iter()
                .any(|p| name.starts_with(p));
            assert_eq!(verb.creates().is_some(), creates, "{verb:?}");
        }
    }

    #[test]
    fn registry_sizes_and_types() {
        assert_eq!(OpenCa::ID, VerbId::OpenCa);
        assert_eq!(LocalMad::ID, VerbId::LocalMad);
        let table: &[(VerbId, usize, usize)] = &[
            (VerbId::OpenCa, 8, 104),
            (VerbId::CloseCa, 0, 0),
            (VerbId::QueryCa, 0, 8),
            (VerbId::ModifyCa, 12, 0),
            (VerbId::CreateQp, 64, 32),
            (VerbId::QueryQp, 0, 160),
            (VerbId::ModifyQp, 128, 0),
            (VerbId::RegSharedMr, 24, 16),
            (VerbId::GetAsyncEvent, 0, 24),
            (VerbId::RegPhysMr, 32, 16),
            (VerbId::LocalMad, 264, 256),
            (VerbId::ReregPhysMr, 48, 16),
        ];
        for &(verb, in_size, out_size) in table {
            assert_eq!(
                (verb.in_size(), verb.out_size()),
                (in_size, out_size),
                "{verb:?}"
            );
        }
        assert_eq!(
            (VerbId::RegSharedMr.target(), VerbId::RegSharedMr.creates()),
            (Some(ObjectKind::Mr), Some(ObjectKind::Mr))
        );
        assert_eq!(VerbId::DetachMcast.target(), Some(ObjectKind::Mcast));
    }

    #[test]
    fn from_ioctl_rejects_foreign_codes() {
        let ours = VerbId::OpenCa.ioctl();
        let with = |device, function, method, access| {
            VerbId::from_ioctl(IoctlCode::new(device, function, method, access).unwrap())
        };
        assert!(matches!(
            with(0x22, 0x800, M::Buffered, A::READ_WRITE),
            Err(AbiError::OutOfRange {
                field: "IoctlCode.device_type",
                ..
            })
        ));
        for method in [M::InDirect, M::OutDirect, M::Neither] {
            assert!(matches!(
                with(0x3B, 0x800, method, A::READ_WRITE),
                Err(AbiError::OutOfRange {
                    field: "IoctlCode.method",
                    ..
                })
            ));
        }
        for function in [0x000, 0x7FF, 0x825, 0xFFF] {
            assert!(matches!(
                with(0x3B, function, M::Buffered, A::READ_WRITE),
                Err(AbiError::InvalidCode {
                    type_name: "VerbId",
                    ..
                })
            ));
        }
        for (function, access) in [
            (0x800, A::ANY),
            (0x800, A::READ),
            (0x800, A::WRITE),
            (0x802, A::READ_WRITE),
            (0x802, A::ANY),
        ] {
            assert!(matches!(
                with(0x3B, function, M::Buffered, access),
                Err(AbiError::OutOfRange {
                    field: "IoctlCode.access",
                    ..
                })
            ));
        }
        assert_eq!(VerbId::from_ioctl(ours), Ok(VerbId::OpenCa));
    }

    // ---- sample values -----------------------------------------------------

    fn uvp() -> UvpName {
        UvpName::new("ibrs-uvp").unwrap()
    }

    fn open_out(doorbell: Option<DoorbellPage>) -> OpenCaOut {
        OpenCaOut {
            version: PROXY_ABI_VERSION,
            ca_guid: NodeGuid::new(0x0002_c903_0000_1000),
            vendor_id: 0x0002C9,
            device_id: 0x1003,
            revision: 0xA0,
            doorbell,
            uvp_name: uvp(),
        }
    }

    const DOORBELL: DoorbellPage = DoorbellPage {
        va: 0x7ff6_1234_0000,
        size: 4096,
    };

    fn caps() -> QpCaps {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 64,
            max_send_sge: 4,
            max_recv_sge: 2,
            max_inline_data: 64,
        }
    }

    fn rc_create() -> QpCreate {
        QpCreate {
            qp_type: QpType::Rc,
            pd: PdHandle::from_raw(0x10),
            send_cq: CqHandle::from_raw(0x11),
            recv_cq: CqHandle::from_raw(0x12),
            srq: None,
            caps: caps(),
            sq_sig_all: false,
            port: None,
        }
    }

    fn qp_query() -> QpQueryOut {
        QpQueryOut {
            qp_type: QpType::Rc,
            state: QpState::Rtr,
            sq_sig_all: true,
            qpn: Qpn::new(0x1234).unwrap(),
            caps: caps(),
            attr: QpModify {
                state: None,
                ..rc_to_rtr()
            },
        }
    }

    fn keys() -> MrKeys {
        MrKeys {
            lkey: LKey::new(0x0000_0107),
            rkey: RKey::new(0x0000_0207),
        }
    }

    fn phys() -> PhysMrRegister {
        PhysMrRegister {
            iova: 0x1000_0064,
            length: 10_000,
            first_byte_offset: 100,
            page_shift: 12,
            num_pages: 3,
            access: AccessFlags::LOCAL_WRITE,
        }
    }

    fn page_list() -> Vec<u8> {
        [0x10_0000u64, 0x23_0000, 0x11_1000]
            .iter()
            .flat_map(|p| p.to_le_bytes())
            .collect()
    }

    fn mad(seed: u8) -> [u8; MAD_SIZE] {
        core::array::from_fn(|i| (i as u8).wrapping_mul(7) ^ seed)
    }

    /// A valid attribute block: a CA with no ports and some vendor bytes.
    fn ca_block() -> Vec<u8> {
        let parts = CaAttrParts {
            attr: CaAttr {
                node_guid: NodeGuid::new(0x0002_c903_0000_1000),
                system_image_guid: crate::scalars::SystemImageGuid::new(0x0002_c903_0000_1003),
                vendor_id: 0x0002C9,
                device_id: 0x1003,
                revision: 0xA0,
                fw_version: 0x0002_0009_1000,
                limits: CaLimits::default(),
                local_ack_delay: 15,
                atomicity: Atomicity::None,
                caps: CaCaps::RC | CaCaps::UD,
                layout: CaLayout::default(),
            },
            page_sizes: &[4096],
            ports: &[],
            vendor_data: b"vendor",
        };
        let mut out = vec![0; parts.encoded_len().unwrap()];
        assert_eq!(parts.encode(&mut out), Ok(out.len()));
        out
    }

    // ---- Repr of the verb layouts -------------------------------------------

    #[test]
    fn fixed_layouts_round_trip() {
        assert_round_trip(&Empty);
        assert_round_trip(&keys());
        assert_round_trip(&OpenCaIn::CURRENT);
        assert_round_trip(&open_out(None));
        assert_round_trip(&open_out(Some(DOORBELL)));
        assert_round_trip(&open_out(Some(DoorbellPage {
            va: 0x10_0000,
            size: 1 << 16,
        })));
        assert_round_trip(&QueryCaOut { total_size: 4096 });
        assert_round_trip(&QueryAvOut {
            pd: PdHandle::from_raw(3),
            av: AvAttr::roce(PortNum::FIRST, Gid::from_ipv4([10, 0, 0, 2]), 1),
        });
        assert_round_trip(&QpCreated {
            qpn: Qpn::new(0xABCDEF).unwrap(),
            caps: caps(),
        });
        assert_round_trip(&qp_query());
        assert_round_trip(&CqOut { cqe: 255 });
        assert_round_trip(&RegSharedOut {
            keys: keys(),
            vaddr: 0x4000,
        });
        assert_round_trip(&QueryMwOut {
            pd: PdHandle::from_raw(9),
            attr: MwAttr {
                mw_type: MwType::Type2,
                rkey: RKey::new(0x2a01),
            },
        });
        assert_round_trip(&RegPhysOut {
            keys: keys(),
            iova: 0x1000_0064,
        });
        assert_round_trip(&LocalMadIn {
            port: PortNum::new(2).unwrap(),
            mad: mad(1),
        });
        assert_round_trip(&LocalMadOut { mad: mad(2) });

        let bytes = open_out(Some(DOORBELL)).emit();
        assert_eq!(
            &bytes.as_bytes()[..2],
            &[0x00, 0x01],
            "version 1.0 packed LE"
        );
        assert_eq!(
            &bytes.as_bytes()[8..16],
            &0x0002_c903_0000_1000u64.to_be_bytes()
        );
        assert_eq!(&bytes.as_bytes()[24..32], &DOORBELL.va.to_le_bytes());
        let created = QpCreated {
            qpn: Qpn::new(0x123456).unwrap(),
            caps: caps(),
        };
        assert_eq!(&created.emit().as_bytes()[..4], &[0, 0x12, 0x34, 0x56]);
    }

    #[test]
    fn open_versions_are_checked_on_both_sides() {
        let req = |major, minor| OpenCaIn {
            version: InterfaceVersion::new(major, minor),
        };
        assert!(OpenCaIn::parse(&req(1, 0).emit()).is_ok());
        for (major, minor) in [(1, 1), (2, 0), (0, 9)] {
            assert!(
                matches!(
                    OpenCaIn::parse(&req(major, minor).emit()),
                    Err(AbiError::VersionMismatch { .. })
                ),
                "a {major}.{minor} library"
            );
        }
        let kernel = |major, minor| OpenCaOut {
            version: InterfaceVersion::new(major, minor),
            ..open_out(None)
        };
        assert_round_trip(&kernel(1, 1));
        for (major, minor) in [(2, 0), (0, 9)] {
            assert!(
                matches!(
                    OpenCaOut::parse(&kernel(major, minor).emit()),
                    Err(AbiError::VersionMismatch { .. })
                ),
                "a {major}.{minor} kernel"
            );
        }
    }

    #[test]
    fn fixed_layouts_reject_corruption() {
        assert_corruptions_rejected::<OpenCaIn>(
            &OpenCaIn::CURRENT.emit(),
            &[(|a| a.reserved_at_0x2[5] = 1, "reserved")],
        );
        let cases: &[Corruption<OpenCaOutAbi>] = &[
            (|a| a.reserved_at_0x2[0] = 1, "reserved"),
            (|a| a.reserved_at_0x24[3] = 1, "reserved"),
            (|a| a.ca_guid = NodeGuid::new(0), "null CA GUID"),
            (
                |a| a.vendor_id = Le32::new(0x0100_0000),
                "vendor ID past 24 bits",
            ),
            (|a| a.doorbell_page = Le64::new(0), "size without a page"),
            (
                |a| a.doorbell_page_size = Le32::new(0),
                "page without a size",
            ),
            (
                |a| a.doorbell_page_size = Le32::new(6000),
                "size not a power of two",
            ),
            (
                |a| a.doorbell_page_size = Le32::new(2048),
                "size below a page",
            ),
            (
                |a| a.doorbell_page = Le64::new(0x7ff6_1234_0800),
                "unaligned page",
            ),
            (
                |a| a.doorbell_page = Le64::new(u64::MAX - 4095),
                "wrapping page",
            ),
            (
                |a| a.uvp_name.units[0] = Le16::new(u16::from(b'.')),
                "UVP name",
            ),
        ];
        assert_corruptions_rejected::<OpenCaOut>(&open_out(Some(DOORBELL)).emit(), cases);

        let cases: &[Corruption<QueryCaOutAbi>] = &[
            (|a| a.total_size = Le32::new(4), "smaller than the header"),
            (|a| a.reserved_at_0x4[0] = 1, "reserved"),
        ];
        assert_corruptions_rejected::<QueryCaOut>(&QueryCaOut { total_size: 4096 }.emit(), cases);

        let av = QueryAvOut {
            pd: PdHandle::from_raw(3),
            av: AvAttr::roce(PortNum::FIRST, Gid::from_ipv4([10, 0, 0, 2]), 1),
        };
        let cases: &[Corruption<QueryAvOutAbi>] = &[
            (|a| a.pd = PdHandle::NULL, "null PD"),
            (|a| a.av.port_num = 0, "AV port 0"),
        ];
        assert_corruptions_rejected::<QueryAvOut>(&av.emit(), cases);

        let created = QpCreated {
            qpn: Qpn::new(7).unwrap(),
            caps: caps(),
        };
        let cases: &[Corruption<QpCreatedAbi>] = &[
            (|a| a.qpn = Be32::new(1 << 24), "QPN past 24 bits"),
            (|a| a.reserved_at_0x4[1] = 1, "reserved"),
            (|a| a.reserved_at_0x1c[2] = 1, "reserved"),
        ];
        assert_corruptions_rejected::<QpCreated>(&created.emit(), cases);

        let cases: &[Corruption<QpQueryOutAbi>] = &[
            (|a| a.qp_type = 5, "QP type"),
            (|a| a.state = 7, "state"),
            (|a| a.sq_sig_all = 2, "bool"),
            (|a| a.qpn = Be32::new(0x0100_0000), "QPN"),
            (|a| a.reserved_at_0x3[0] = 1, "reserved"),
            (|a| a.reserved_at_0x1c[0] = 1, "reserved"),
            (|a| a.attr = rc_to_rtr().emit(), "state inside attr"),
            (
                |a| {
                    a.attr = QpModify {
                        cap: Some(caps()),
                        ..QpModify::default()
                    }
                    .emit()
                },
                "caps inside attr",
            ),
            (
                |a| a.attr.sq_psn = Be32::new(5),
                "attribute outside the mask",
            ),
        ];
        assert_corruptions_rejected::<QpQueryOut>(&qp_query().emit(), cases);

        let cases: &[Corruption<CqOutAbi>] = &[
            (|a| a.cqe = Le32::new(0), "empty CQ"),
            (|a| a.reserved_at_0x4[0] = 1, "reserved"),
        ];
        assert_corruptions_rejected::<CqOut>(&CqOut { cqe: 1 }.emit(), cases);

        let mw = QueryMwOut {
            pd: PdHandle::from_raw(9),
            attr: MwAttr {
                mw_type: MwType::Type1,
                rkey: RKey::new(1),
            },
        };
        let cases: &[Corruption<QueryMwOutAbi>] = &[
            (|a| a.pd = PdHandle::NULL, "null PD"),
            (|a| a.attr.mw_type = 3, "window type"),
        ];
        assert_corruptions_rejected::<QueryMwOut>(&mw.emit(), cases);

        let local = LocalMadIn {
            port: PortNum::FIRST,
            mad: mad(0),
        };
        let cases: &[Corruption<LocalMadInAbi>] = &[
            (|a| a.port_num = 0, "port 0"),
            (|a| a.reserved_at_0x1[6] = 1, "reserved"),
        ];
        assert_corruptions_rejected::<LocalMadIn>(&local.emit(), cases);
    }

    // ---- framing ----------------------------------------------------------------

    fn req_bytes<V: Verb>(handle: u64, input: &V::In, private: &[u8], max: u32) -> Vec<u8> {
        let len = request_len::<V>(private.len()).unwrap();
        let mut buf = vec![0xEE; len + 3];
        assert_eq!(
            encode_request::<V>(handle, input, private, max, &mut buf),
            Ok(len)
        );
        assert_eq!(&buf[len..], &[0xEE; 3], "wrote past the request");
        buf.truncate(len);
        buf
    }

    fn resp_bytes<V: Verb>(
        status: IbStatus,
        handle: u64,
        output: Option<&V::Out>,
        private: &[u8],
    ) -> Vec<u8> {
        let len = response_len::<V>(private.len()).unwrap();
        let mut buf = vec![0xEE; len + 3];
        assert_eq!(
            encode_response::<V>(status, handle, output, private, &mut buf),
            Ok(len)
        );
        buf.truncate(len);
        buf
    }

    #[test]
    fn lengths() {
        assert_eq!(request_len::<CreateQp>(5), Some(16 + 64 + 5));
        assert_eq!(response_len::<CreateQp>(0), Some(16 + 32));
        assert_eq!(request_len::<CloseCa>(0), Some(16));
        let max = u32::MAX as usize;
        assert_eq!(request_len::<CloseCa>(max), Some(16 + max));
        assert_eq!(request_len::<CloseCa>(max + 1), None);
        assert_eq!(response_len::<QueryCa>(usize::MAX), None);
    }

    #[test]
    fn create_qp_round_trips() {
        let input = rc_create();
        let bytes = req_bytes::<CreateQp>(0xCA, &input, b"uvp->hca", 64);
        assert_eq!(bytes.len(), 16 + 64 + 8);
        assert_eq!(&bytes[..8], &0xCAu64.to_le_bytes());
        assert_eq!(&bytes[8..12], &8u32.to_le_bytes());
        assert_eq!(&bytes[12..16], &64u32.to_le_bytes());
        assert_eq!(&bytes[16..80], input.emit().as_bytes());
        let req = decode_request::<CreateQp>(&bytes).unwrap();
        assert_eq!(
            req,
            Request {
                handle: 0xCA,
                input,
                private: b"uvp->hca",
                private_out_max: 64,
            }
        );
        assert!(!req.kernel_only());

        let created = QpCreated {
            qpn: Qpn::new(0x48).unwrap(),
            caps: caps(),
        };
        let ok = resp_bytes::<CreateQp>(IbStatus::Success, 0x77, Some(&created), b"hca->uvp");
        assert_eq!(&ok[..4], &[0; 4]);
        assert_eq!(&ok[4..8], &8u32.to_le_bytes());
        assert_eq!(&ok[8..16], &0x77u64.to_le_bytes());
        let resp = decode_response::<CreateQp>(&ok).unwrap();
        assert_eq!(
            resp,
            Response {
                status: IbStatus::Success,
                handle: 0x77,
                output: Some(created),
                private: b"hca->uvp",
            }
        );

        let failed = resp_bytes::<CreateQp>(IbStatus::InvalidMaxWrs, 0, None, &[]);
        assert_eq!(failed.len(), 16 + 32);
        assert_eq!(&failed[..4], &IbStatus::InvalidMaxWrs.code().to_le_bytes());
        assert!(failed[4..].iter().all(|&b| b == 0));
        let resp = decode_response::<CreateQp>(&failed).unwrap();
        assert_eq!(resp.status, IbStatus::InvalidMaxWrs);
        assert_eq!((resp.handle, resp.output, resp.private), (0, None, &[][..]));
    }

    #[test]
    fn special_qps_are_kernel_only() {
        let gsi = QpCreate {
            qp_type: QpType::Gsi,
            port: Some(PortNum::FIRST),
            ..rc_create()
        };
        let bytes = req_bytes::<CreateQp>(0xCA, &gsi, &[], 0);
        assert!(decode_request::<CreateQp>(&bytes).unwrap().kernel_only());
        let bytes = req_bytes::<CloseCa>(0xCA, &Empty, &[], 0);
        assert!(!decode_request::<CloseCa>(&bytes).unwrap().kernel_only());
    }

    #[test]
    fn open_ca_round_trips() {
        let bytes = req_bytes::<OpenCa>(0, &OpenCaIn::CURRENT, &[], 0);
        assert_eq!(bytes.len(), 24);
        let req = decode_request::<OpenCa>(&bytes).unwrap();
        assert_eq!(req.input, OpenCaIn::CURRENT);
        let mut with_handle = bytes.clone();
        with_handle[0] = 1;
        assert!(
            decode_request::<OpenCa>(&with_handle).is_err(),
            "OpenCa has no target"
        );

        let out = open_out(Some(DOORBELL));
        let bytes = resp_bytes::<OpenCa>(IbStatus::Success, 0xCA, Some(&out), &[]);
        let resp = decode_response::<OpenCa>(&bytes).unwrap();
        assert_eq!((resp.handle, resp.output), (0xCA, Some(out)));

        let mut newer_library = req_bytes::<OpenCa>(0, &OpenCaIn::CURRENT, &[], 0);
        newer_library[16] = 1; // minor 1
        assert!(matches!(
            decode_request::<OpenCa>(&newer_library),
            Err(AbiError::VersionMismatch { .. })
        ));
    }

    #[test]
    fn query_ca_carries_the_attribute_block() {
        let block = ca_block();
        let out = QueryCaOut {
            total_size: block.len() as u32,
        };
        let bytes = resp_bytes::<QueryCa>(IbStatus::Success, 0, Some(&out), &block);
        let resp = decode_response::<QueryCa>(&bytes).unwrap();
        assert_eq!((resp.output, resp.private), (Some(out), &block[..]));
        assert!(CaAttrView::parse(resp.private).is_ok());

        let mut buf = vec![0; 1024];
        let wrong = QueryCaOut {
            total_size: out.total_size + 4,
        };
        let mut longer = block.clone();
        longer.extend_from_slice(&[0; 4]);
        for (output, private) in [
            (wrong, &block[..]),
            (out, &longer[..]),
            (wrong, &longer[..]),
        ] {
            assert!(
                encode_response::<QueryCa>(IbStatus::Success, 0, Some(&output), private, &mut buf)
                    .is_err()
            );
        }
        let mut mismatched = bytes.clone();
        mismatched[16..20].copy_from_slice(&(out.total_size + 1).to_le_bytes());
        assert!(decode_response::<QueryCa>(&mismatched).is_err());
        let mut no_block = resp_bytes::<QueryCa>(IbStatus::Success, 0, Some(&out), &block);
        no_block[16 + 8 + 4] ^= 0xFF; // inside the block header's page-size offset
        assert!(decode_response::<QueryCa>(&no_block).is_err());

        // Too small a buffer: Overflow with the size, and no block.
        let overflow = resp_bytes::<QueryCa>(IbStatus::Overflow, 0, Some(&out), &[]);
        let resp = decode_response::<QueryCa>(&overflow).unwrap();
        assert_eq!((resp.status, resp.output), (IbStatus::Overflow, Some(out)));
        assert!(
            encode_response::<QueryCa>(IbStatus::Overflow, 0, None, &[], &mut buf).is_err(),
            "the size report is mandatory"
        );
        assert!(
            encode_response::<QueryCa>(IbStatus::Overflow, 0, Some(&out), &block, &mut buf)
                .is_err(),
            "no block with Overflow"
        );
        let mut zeroed = overflow.clone();
        zeroed[16..20].fill(0);
        assert!(decode_response::<QueryCa>(&zeroed).is_err());
        // Other failures carry nothing, and other verbs' Overflow is a plain
        // failure.
        let failed = resp_bytes::<QueryCa>(IbStatus::InvalidHandle, 0, None, &[]);
        assert_eq!(decode_response::<QueryCa>(&failed).unwrap().output, None);
        let cq = resp_bytes::<QueryCq>(IbStatus::Overflow, 0, None, &[]);
        assert_eq!(decode_response::<QueryCq>(&cq).unwrap().output, None);
    }

    #[test]
    fn reg_phys_mr_carries_the_page_list() {
        let pages = page_list();
        let bytes = req_bytes::<RegPhysMr>(0x9, &phys(), &pages, 0);
        let req = decode_request::<RegPhysMr>(&bytes).unwrap();
        assert_eq!((req.input, req.private), (phys(), &pages[..]));
        assert!(req.kernel_only());

        let mut buf = vec![0; 256];
        assert!(encode_request::<RegPhysMr>(0x9, &phys(), &pages[..16], 0, &mut buf).is_err());
        let mut unaligned = pages.clone();
        unaligned[0] = 8;
        assert!(encode_request::<RegPhysMr>(0x9, &phys(), &unaligned, 0, &mut buf).is_err());
        let mut bad = bytes.clone();
        bad[16 + 32] = 8;
        assert!(decode_request::<RegPhysMr>(&bad).is_err());

        let out = RegPhysOut {
            keys: keys(),
            iova: 0x1000_0064,
        };
        let bytes = resp_bytes::<RegPhysMr>(IbStatus::Success, 0x55, Some(&out), &[]);
        assert_eq!(
            decode_response::<RegPhysMr>(&bytes).unwrap().output,
            Some(out)
        );
    }

    #[test]
    fn rereg_phys_mr_carries_the_page_list_only_with_a_translation() {
        let pages = page_list();
        let p = phys();
        let moved = PhysMrRereg {
            translation: Some(crate::mr::PhysTranslation {
                iova: p.iova,
                length: p.length,
                first_byte_offset: p.first_byte_offset,
                page_shift: p.page_shift,
                num_pages: p.num_pages,
            }),
            ..PhysMrRereg::default()
        };
        let bytes = req_bytes::<ReregPhysMr>(0x9, &moved, &pages, 0);
        let req = decode_request::<ReregPhysMr>(&bytes).unwrap();
        assert_eq!((req.input, req.private), (moved, &pages[..]));
        assert!(req.kernel_only());
        let mut buf = vec![0; 256];
        assert!(encode_request::<ReregPhysMr>(0x9, &moved, &pages[..16], 0, &mut buf).is_err());
        let rights = PhysMrRereg {
            access: Some(AccessFlags::LOCAL_WRITE),
            ..PhysMrRereg::default()
        };
        let bytes = req_bytes::<ReregPhysMr>(0x9, &rights, &[], 0);
        assert_eq!(decode_request::<ReregPhysMr>(&bytes).unwrap().input, rights);
        assert!(encode_request::<ReregPhysMr>(0x9, &rights, &pages[..8], 0, &mut buf).is_err());
    }

    #[test]
    fn alloc_mw_request_has_no_rkey() {
        let request = MwAttr {
            mw_type: MwType::Type2,
            rkey: RKey::new(0),
        };
        let bytes = req_bytes::<AllocMw>(0x3, &request, &[], 0);
        assert_eq!(decode_request::<AllocMw>(&bytes).unwrap().input, request);
        let with_key = MwAttr {
            rkey: RKey::new(0x100),
            ..request
        };
        let mut buf = vec![0; 64];
        assert!(encode_request::<AllocMw>(0x3, &with_key, &[], 0, &mut buf).is_err());
        let mut patched = bytes.clone();
        patched[16 + 5] = 1;
        assert_eq!(
            decode_request::<AllocMw>(&patched),
            Err(AbiError::ReservedNotZero {
                field: "AllocMw request MwAttr.rkey"
            })
        );
        let answer = resp_bytes::<AllocMw>(IbStatus::Success, 0x44, Some(&with_key), &[]);
        assert_eq!(
            decode_response::<AllocMw>(&answer).unwrap().output,
            Some(with_key)
        );
    }

    #[test]
    fn event_and_mad_verbs() {
        let event = AsyncEventRecord::new(AsyncEventCode::CqError, 0x21, None, 7).unwrap();
        let bytes = resp_bytes::<GetAsyncEvent>(IbStatus::Success, 0, Some(&event), &[]);
        assert_eq!(
            decode_response::<GetAsyncEvent>(&bytes).unwrap().output,
            Some(event)
        );
        let canceled = resp_bytes::<GetAsyncEvent>(IbStatus::Canceled, 0, None, &[]);
        assert_eq!(
            decode_response::<GetAsyncEvent>(&canceled).unwrap().output,
            None
        );

        let input = LocalMadIn {
            port: PortNum::FIRST,
            mad: mad(3),
        };
        let bytes = req_bytes::<LocalMad>(0xCA, &input, &[], 0);
        let req = decode_request::<LocalMad>(&bytes).unwrap();
        assert!(req.kernel_only());
        assert_eq!(req.input, input);
    }

    #[test]
    fn request_framing_rejections() {
        let bytes = req_bytes::<CreateQp>(0xCA, &rc_create(), b"private", 0);
        for cut in 0..bytes.len() {
            let err = decode_request::<CreateQp>(&bytes[..cut]).unwrap_err();
            if cut < 80 {
                assert_eq!(
                    err,
                    AbiError::Truncated {
                        needed: 80,
                        got: cut
                    }
                );
            } else {
                assert!(matches!(err, AbiError::BadLength { .. }), "{cut}");
            }
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(matches!(
            decode_request::<CreateQp>(&longer),
            Err(AbiError::BadLength { .. })
        ));
        for declared in [6u32, 8, u32::MAX, u32::MAX - 15, 0x8000_0000] {
            let mut patched = bytes.clone();
            patched[8..12].copy_from_slice(&declared.to_le_bytes());
            assert!(
                matches!(
                    decode_request::<CreateQp>(&patched),
                    Err(AbiError::BadLength {
                        field: "RequestHeaderAbi.private_in_len",
                        ..
                    })
                ),
                "private_in_len {declared:#x}"
            );
        }
        let mut null = bytes.clone();
        null[..8].fill(0);
        assert!(decode_request::<CreateQp>(&null).is_err(), "null parent");
        let mut bad_input = bytes.clone();
        bad_input[16] = 9; // QP type
        assert!(decode_request::<CreateQp>(&bad_input).is_err());

        let mut buf = vec![0; 16];
        assert_eq!(
            encode_request::<CloseCa>(0xCA, &Empty, b"xyz", 0, &mut buf),
            Err(AbiError::Truncated {
                needed: 19,
                got: 16
            })
        );
        assert_eq!(buf, [0; 16], "a short buffer is left untouched");
        assert!(encode_request::<CloseCa>(0, &Empty, &[], 0, &mut buf).is_err());
        let invalid = QpCreate {
            pd: PdHandle::NULL,
            ..rc_create()
        };
        let mut buf = vec![0; 128];
        assert!(
            encode_request::<CreateQp>(0xCA, &invalid, &[], 0, &mut buf).is_err(),
            "a value that would not parse"
        );
    }

    #[test]
    fn response_framing_rejections() {
        let out = CqOut { cqe: 256 };
        let ok = resp_bytes::<CreateCq>(IbStatus::Success, 0x33, Some(&out), b"vendor");
        assert!(decode_response::<CreateCq>(&ok).is_ok());
        for cut in 0..ok.len() {
            assert!(decode_response::<CreateCq>(&ok[..cut]).is_err(), "{cut}");
        }
        let patch = |at: usize, with: &[u8]| {
            let mut bytes = ok.clone();
            bytes[at..at + with.len()].copy_from_slice(with);
            bytes
        };
        let cases: &[(Vec<u8>, &str)] = &[
            (patch(4, &5u32.to_le_bytes()), "private_out_len short"),
            (patch(4, &7u32.to_le_bytes()), "private_out_len long"),
            (
                patch(4, &u32::MAX.to_le_bytes()),
                "private_out_len near u32::MAX",
            ),
            (patch(0, &9999u32.to_le_bytes()), "unknown status"),
            (patch(0, &IbStatus::Pending.code().to_le_bytes()), "Pending"),
            (patch(8, &[0; 8]), "successful create without a handle"),
            (patch(16, &[0; 4]), "zero CQ size"),
        ];
        for (bytes, what) in cases {
            assert!(decode_response::<CreateCq>(bytes).is_err(), "{what}");
        }

        let failed = resp_bytes::<CreateCq>(IbStatus::InvalidCqSize, 0, None, &[]);
        let mut nonzero = failed.clone();
        nonzero[16] = 1;
        assert!(matches!(
            decode_response::<CreateCq>(&nonzero),
            Err(AbiError::ReservedNotZero { .. })
        ));
        let mut with_handle = failed.clone();
        with_handle[8] = 1;
        assert!(decode_response::<CreateCq>(&with_handle).is_err());
        let mut with_private = failed.clone();
        with_private[4] = 1;
        with_private.push(0);
        assert!(decode_response::<CreateCq>(&with_private).is_err());

        let query = resp_bytes::<QueryCq>(IbStatus::Success, 0, Some(&out), &[]);
        let mut handle = query.clone();
        handle[15] = 1;
        assert!(
            decode_response::<QueryCq>(&handle).is_err(),
            "handle from a query"
        );

        let mut buf = vec![0; 64];
        let st = IbStatus::Success;
        assert!(encode_response::<CreateCq>(st, 0x33, None, &[], &mut buf).is_err());
        assert!(encode_response::<CreateCq>(st, 0, Some(&out), &[], &mut buf).is_err());
        assert!(encode_response::<QueryCq>(st, 0x33, Some(&out), &[], &mut buf).is_err());
        let fail = IbStatus::InvalidCqSize;
        assert!(encode_response::<CreateCq>(fail, 0, Some(&out), &[], &mut buf).is_err());
        assert!(encode_response::<CreateCq>(fail, 0, None, b"x", &mut buf).is_err());
        assert!(encode_response::<CreateCq>(IbStatus::Pending, 0, None, &[], &mut buf).is_err());
        assert!(
            encode_response::<CreateCq>(st, 0x33, Some(&CqOut { cqe: 0 }), &[], &mut buf).is_err()
        );
        let mut short = vec![0; 23];
        assert_eq!(
            encode_response::<CreateCq>(st, 0x33, Some(&out), &[], &mut short),
            Err(AbiError::Truncated {
                needed: 24,
                got: 23
            })
        );
        assert_eq!(short, [0; 23]);
    }

    // ---- totality ------------------------------------------------------------------

    /// Whatever decodes re-encodes to the same bytes.
    fn request_total<V: Verb>(bytes: &[u8]) {
        if let Ok(req) = decode_request::<V>(bytes) {
            let mut again = vec![0; bytes.len()];
            assert_eq!(req.encode(&mut again), Ok(bytes.len()), "{:?}", V::ID);
            assert_eq!(again, bytes, "{:?}", V::ID);
        }
    }

    fn response_total<V: Verb>(bytes: &[u8]) {
        if let Ok(resp) = decode_response::<V>(bytes) {
            let mut again = vec![0; bytes.len()];
            assert_eq!(resp.encode(&mut again), Ok(bytes.len()), "{:?}", V::ID);
            assert_eq!(again, bytes, "{:?}", V::ID);
        }
    }

    fn every_request(bytes: &[u8]) {
        request_total::<OpenCa>(bytes);
        request_total::<CloseCa>(bytes);
        request_total::<ModifyCa>(bytes);
        request_total::<CreateAv>(bytes);
        request_total::<CreateQp>(bytes);
        request_total::<ModifyQp>(bytes);
        request_total::<ResizeCq>(bytes);
        request_total::<CreateSrq>(bytes);
        request_total::<RegMr>(bytes);
        request_total::<AllocMw>(bytes);
        request_total::<AttachMcast>(bytes);
        request_total::<RegPhysMr>(bytes);
        request_total::<LocalMad>(bytes);
        request_total::<ReregPhysMr>(bytes);
    }

    fn every_response(bytes: &[u8]) {
        response_total::<OpenCa>(bytes);
        response_total::<CloseCa>(bytes);
        response_total::<QueryCa>(bytes);
        response_total::<QueryAv>(bytes);
        response_total::<CreateQp>(bytes);
        response_total::<QueryQp>(bytes);
        response_total::<CreateCq>(bytes);
        response_total::<QuerySrq>(bytes);
        response_total::<RegSharedMr>(bytes);
        response_total::<QueryMr>(bytes);
        response_total::<QueryMw>(bytes);
        response_total::<GetAsyncEvent>(bytes);
        response_total::<RegPhysMr>(bytes);
        response_total::<LocalMad>(bytes);
        response_total::<ReregPhysMr>(bytes);
    }

    /// Valid requests of several verbs.
    fn valid_requests() -> Vec<Vec<u8>> {
        vec![
            req_bytes::<OpenCa>(0, &OpenCaIn::CURRENT, &[], 0),
            req_bytes::<CloseCa>(1, &Empty, b"v", 0),
            req_bytes::<CreateQp>(2, &rc_create(), b"vendor", 16),
            req_bytes::<ModifyQp>(3, &rc_to_rtr(), &[], 0),
            req_bytes::<RegPhysMr>(4, &phys(), &page_list(), 0),
            req_bytes::<AllocMw>(
                5,
                &MwAttr {
                    mw_type: MwType::Type1,
                    rkey: RKey::new(0),
                },
                &[],
                0,
            ),
            req_bytes::<LocalMad>(
                6,
                &LocalMadIn {
                    port: PortNum::FIRST,
                    mad: mad(0),
                },
                &[],
                0,
            ),
        ]
    }

    /// Valid responses of several verbs, successes and failures.
    fn valid_responses() -> Vec<Vec<u8>> {
        let block = ca_block();
        let size = QueryCaOut {
            total_size: block.len() as u32,
        };
        vec![
            resp_bytes::<OpenCa>(IbStatus::Success, 1, Some(&open_out(Some(DOORBELL))), &[]),
            resp_bytes::<QueryCa>(IbStatus::Success, 0, Some(&size), &block),
            resp_bytes::<QueryCa>(IbStatus::Overflow, 0, Some(&size), &[]),
            resp_bytes::<CreateQp>(
                IbStatus::Success,
                2,
                Some(&QpCreated {
                    qpn: Qpn::new(9).unwrap(),
                    caps: caps(),
                }),
                b"vendor",
            ),
            resp_bytes::<CreateQp>(IbStatus::InvalidMaxSge, 0, None, &[]),
            resp_bytes::<QueryQp>(IbStatus::Success, 0, Some(&qp_query()), &[]),
            resp_bytes::<CreateCq>(IbStatus::Success, 3, Some(&CqOut { cqe: 64 }), &[]),
            resp_bytes::<GetAsyncEvent>(
                IbStatus::Success,
                0,
                Some(&AsyncEventRecord::new(AsyncEventCode::SqDrained, 5, None, 0).unwrap()),
                &[],
            ),
            resp_bytes::<CloseCa>(IbStatus::Success, 0, Some(&Empty), &[]),
        ]
    }

    /// A valid sample with a few bytes replaced and its length possibly cut.
    fn mutated(samples: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
        (
            proptest::sample::select(samples),
            proptest::collection::vec((any::<Index>(), any::<u8>()), 0..4),
            proptest::option::of(any::<Index>()),
        )
            .prop_map(|(mut bytes, edits, cut)| {
                for (at, value) in edits {
                    let at = at.index(bytes.len());
                    bytes[at] = value;
                }
                if let Some(cut) = cut {
                    bytes.truncate(cut.index(bytes.len() + 1));
                }
                bytes
            })
    }

    /// A header whose private length agrees with what follows the fixed
    /// part of an `in_size`-byte layout, then random bytes.
    fn framed(body: &[u8], handle: u64, in_size: usize, response: bool) -> Vec<u8> {
        let private = body.len().saturating_sub(in_size) as u32;
        let mut bytes = Vec::with_capacity(16 + body.len());
        if response {
            bytes.extend_from_slice(&(handle as u32 % 60).to_le_bytes());
            bytes.extend_from_slice(&private.to_le_bytes());
            bytes.extend_from_slice(&(handle % 3).to_le_bytes());
        } else {
            bytes.extend_from_slice(&(handle % 3).to_le_bytes());
            bytes.extend_from_slice(&private.to_le_bytes());
            bytes.extend_from_slice(&(handle as u32).to_le_bytes());
        }
        bytes.extend_from_slice(body);
        bytes
    }

    #[test]
    fn samples_are_valid() {
        for bytes in valid_requests() {
            every_request(&bytes);
        }
        for bytes in valid_responses() {
            every_response(&bytes);
        }
    }

    proptest! {
        #[test]
        fn requests_decode_totally(bytes in proptest::collection::vec(any::<u8>(), 0..320)) {
            every_request(&bytes);
        }

        #[test]
        fn responses_decode_totally(bytes in proptest::collection::vec(any::<u8>(), 0..320)) {
            every_response(&bytes);
        }

        #[test]
        fn framed_bytes_decode_totally(
            body in proptest::collection::vec(any::<u8>(), 0..300),
            handle: u64,
        ) {
            for verb in VerbId::ALL {
                every_request(&framed(&body, handle, verb.in_size(), false));
                every_response(&framed(&body, handle, verb.out_size(), true));
            }
        }

        #[test]
        fn mutated_requests_decode_totally(bytes in mutated(valid_requests())) {
            every_request(&bytes);
        }

        #[test]
        fn mutated_responses_decode_totally(bytes in mutated(valid_responses())) {
            every_response(&bytes);
        }

        #[test]
        fn layouts_decode_totally(bytes in proptest::collection::vec(any::<u8>(), 0..270)) {
            assert_decode_total::<OpenCaIn>(&bytes);
            assert_decode_total::<OpenCaOut>(&bytes);
            assert_decode_total::<QueryCaOut>(&bytes);
            assert_decode_total::<QueryAvOut>(&bytes);
            assert_decode_total::<QpCreated>(&bytes);
            assert_decode_total::<QpQueryOut>(&bytes);
            assert_decode_total::<CqOut>(&bytes);
            assert_decode_total::<RegSharedOut>(&bytes);
            assert_decode_total::<QueryMwOut>(&bytes);
            assert_decode_total::<RegPhysOut>(&bytes);
            assert_decode_total::<LocalMadIn>(&bytes);
            assert_decode_total::<LocalMadOut>(&bytes);
        }

        #[test]
        fn ioctl_codes_decode_totally(raw: u32) {
            let code = IoctlCode::from_raw(raw);
            let rebuilt = IoctlCode::new(
                code.device_type(), code.function(), code.method(), code.access(),
            );
            prop_assert_eq!(rebuilt, Some(code));
            if let Ok(verb) = VerbId::from_ioctl(code) {
                prop_assert_eq!(verb.ioctl(), code);
            }
        }
    }
}
