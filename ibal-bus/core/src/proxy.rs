//! The user-mode proxy's core: what the bus filter does with a request a
//! process sends on a handle of an HCA's device interface, before the
//! request goes down the stack to the miniport's user request path, and
//! with the answer on its way back (docs/ibal-bus.md, "The user-mode
//! proxy").
//!
//! Contract:
//! - Each open (file object) has its own [`OpenTable`]: the handles that
//!   open created, recorded from the miniport's successful answers, each
//!   with its kind and the CA context it lives in. A request naming a
//!   handle the open did not create (another open's, even in the same
//!   process; a destroyed one; one of the wrong kind; one of another CA
//!   context of the same open) is refused with that kind's invalid-handle
//!   status before it reaches the miniport.
//! - Every user-mode request is hostile ([`OpenTable::check`]): the code
//!   must be a verb's ([`VerbId::from_ioctl`]: device type, method,
//!   function, access) or the administrator IOCTL
//!   ([`IOCTL_IBAL_CHILD_ENTRY`]); the input must decode as that verb's
//!   request ([`decode_request`]: exact lengths, reserved bytes, counts,
//!   overflow, the verb's own rules); the output must hold the response
//!   header, the fixed output and the `private_out_max` the caller
//!   declared; kernel-only verbs and inputs are refused to user mode.
//! - The ABI version is checked at open time by both sides, in the
//!   `OpenCa` verb: the request's library version ([`OpenCaIn`]) must be
//!   served by [`PROXY_ABI_VERSION`] (else `STATUS_REVISION_MISMATCH`,
//!   nothing forwarded), and the miniport's answer ([`OpenCaOut`]) must
//!   decode, its version included, before the open is recorded.
//! - [`OpenTable::complete`] reads the answer: a successful create records
//!   the new handle; a successful destroy forgets it (a QP's multicast
//!   memberships with it); a successful `CloseCa` forgets everything of
//!   that CA context. A success whose answer does not decode is turned
//!   into `STATUS_INVALID_DEVICE_STATE` for the caller and records
//!   nothing.
//! - The administrator IOCTL adds, replaces or removes one entry of the
//!   filter's child list ([`ChildEntryChange`], parsed as hostile and
//!   checked with [`check_entry`]); a caller that is not an administrator
//!   gets `STATUS_ACCESS_DENIED` before its input is read.
//!
//! Nothing here blocks, allocates more than the table's records, or
//! panics on any input.

use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use ib_types::abi::AbiError;
use ib_types::ioctl::{
    self as v, FILE_DEVICE_INFINIBAND, IoctlCode, ObjectKind, RESPONSE_HEADER_SIZE, RequiredAccess,
    TransferMethod, Verb, VerbId, decode_request, decode_response,
};
use ib_types::scalars::PKey;
use ib_types::status::{IbStatus, NtStatus};

use crate::children::{ChildEntry, EntryError, check_entry};

#[cfg(doc)]
use ib_types::ioctl::{OpenCaIn, OpenCaOut, PROXY_ABI_VERSION};

/// The security descriptor of every HCA stack the filter sits on: SYSTEM
/// and administrators all access; authenticated users read and write (an
/// unprivileged application may use RDMA, as rdma-core's `uverbs` devices
/// allow every local user); anonymous logons and guests nothing.
pub const PROXY_SDDL: &str = "D:P(A;;GA;;;SY)(A;;GA;;;BA)(A;;GRGW;;;AU)";

/// Function number of the administrator IOCTL, above the verbs'.
pub const CHILD_ENTRY_FUNCTION: u16 = 0xF00;

/// The administrator-only IOCTL that adds, replaces or removes one entry
/// of the filter's child list (`StaticChild` and its subkey), then
/// reconciles the children of every port: `METHOD_BUFFERED`, read and
/// write access, input a [`ChildEntryChange`] in the layout of
/// [`ChildEntryChange::parse`], no output.
pub const IOCTL_IBAL_CHILD_ENTRY: IoctlCode = match IoctlCode::new(
    FILE_DEVICE_INFINIBAND,
    CHILD_ENTRY_FUNCTION,
    TransferMethod::Buffered,
    RequiredAccess::READ_WRITE,
) {
    Some(code) => code,
    None => panic!("the function fits 12 bits"),
};

/// `STATUS_REVISION_MISMATCH`.
pub const STATUS_REVISION_MISMATCH: NtStatus = NtStatus::from_raw(0xC000_0059);

/// Why the proxy refused a request (nothing was forwarded).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// Not a verb's code nor the administrator IOCTL
    /// (`STATUS_INVALID_DEVICE_REQUEST`).
    UnknownCode(u32),
    /// A kernel-only verb or input from user mode
    /// ([`IbStatus::InvalidPermission`], `STATUS_ACCESS_DENIED`).
    KernelOnly(VerbId),
    /// The input does not decode as the verb's request
    /// (`STATUS_INVALID_PARAMETER`).
    Malformed(VerbId, AbiError),
    /// `OpenCa` from a library whose ABI version the proxy cannot serve
    /// (`STATUS_REVISION_MISMATCH`).
    AbiVersion(AbiError),
    /// The output cannot hold the response header and fixed output
    /// (`STATUS_BUFFER_TOO_SMALL`).
    OutputTooSmall {
        /// Bytes needed.
        needed: usize,
        /// Bytes given.
        got: usize,
    },
    /// The output is smaller than header + fixed output +
    /// `private_out_max` (`STATUS_INVALID_PARAMETER`).
    PrivateRoomOverstated,
    /// A handle this open did not create, of this kind (the kind's
    /// invalid-handle status).
    ForeignHandle(ObjectKind),
    /// The administrator IOCTL from a caller that is not an administrator
    /// (`STATUS_ACCESS_DENIED`).
    NotAdministrator,
    /// The administrator IOCTL's input is malformed
    /// (`STATUS_INVALID_PARAMETER`).
    BadChildEntry(ChildEntryError),
}

impl Refusal {
    /// The status the request completes with.
    pub fn nt_status(&self) -> NtStatus {
        match self {
            Self::UnknownCode(_) => NtStatus::INVALID_DEVICE_REQUEST,
            Self::KernelOnly(_) => IbStatus::InvalidPermission.to_ntstatus(),
            Self::Malformed(..) | Self::PrivateRoomOverstated | Self::BadChildEntry(_) => {
                NtStatus::INVALID_PARAMETER
            }
            Self::AbiVersion(_) => STATUS_REVISION_MISMATCH,
            Self::OutputTooSmall { .. } => NtStatus::BUFFER_TOO_SMALL,
            Self::ForeignHandle(kind) => invalid_handle(*kind).to_ntstatus(),
            Self::NotAdministrator => NtStatus::ACCESS_DENIED,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownCode(code) => write!(f, "IOCTL {code:#010x} is not the proxy's"),
            Self::KernelOnly(verb) => write!(f, "{} is for kernel callers only", verb.name()),
            Self::Malformed(verb, e) => write!(f, "malformed {} request: {e}", verb.name()),
            Self::AbiVersion(e) => write!(f, "OpenCa: {e}"),
            Self::OutputTooSmall { needed, got } => {
                write!(f, "output of {got} bytes, {needed} needed")
            }
            Self::PrivateRoomOverstated => {
                write!(f, "private_out_max exceeds the output buffer")
            }
            Self::ForeignHandle(kind) => write!(f, "{kind:?} handle not created by this open"),
            Self::NotAdministrator => write!(f, "administrator-only IOCTL"),
            Self::BadChildEntry(e) => write!(f, "child entry: {e}"),
        }
    }
}

impl core::error::Error for Refusal {}

/// The invalid-handle status of each kind.
pub fn invalid_handle(kind: ObjectKind) -> IbStatus {
    match kind {
        ObjectKind::Ca => IbStatus::InvalidCaHandle,
        ObjectKind::Pd => IbStatus::InvalidPdHandle,
        ObjectKind::Av => IbStatus::InvalidAvHandle,
        ObjectKind::Qp => IbStatus::InvalidQpHandle,
        ObjectKind::Cq => IbStatus::InvalidCqHandle,
        ObjectKind::Srq => IbStatus::InvalidSrqHandle,
        ObjectKind::Mr => IbStatus::InvalidMrHandle,
        ObjectKind::Mw => IbStatus::InvalidMwHandle,
        ObjectKind::Mcast => IbStatus::InvalidMcastHandle,
    }
}

/// Calls `$f::<V>($args)` for the verb type of a [`VerbId`].
macro_rules! for_verb {
    ($verb:expr, $f:ident ( $($arg:expr),* )) => {
        match $verb {
            VerbId::OpenCa => $f::<v::OpenCa>($($arg),*),
            VerbId::CloseCa => $f::<v::CloseCa>($($arg),*),
            VerbId::QueryCa => $f::<v::QueryCa>($($arg),*),
            VerbId::ModifyCa => $f::<v::ModifyCa>($($arg),*),
            VerbId::AllocPd => $f::<v::AllocPd>($($arg),*),
            VerbId::DeallocPd => $f::<v::DeallocPd>($($arg),*),
            VerbId::CreateAv => $f::<v::CreateAv>($($arg),*),
            VerbId::QueryAv => $f::<v::QueryAv>($($arg),*),
            VerbId::ModifyAv => $f::<v::ModifyAv>($($arg),*),
            VerbId::DestroyAv => $f::<v::DestroyAv>($($arg),*),
            VerbId::CreateQp => $f::<v::CreateQp>($($arg),*),
            VerbId::QueryQp => $f::<v::QueryQp>($($arg),*),
            VerbId::ModifyQp => $f::<v::ModifyQp>($($arg),*),
            VerbId::DestroyQp => $f::<v::DestroyQp>($($arg),*),
            VerbId::CreateCq => $f::<v::CreateCq>($($arg),*),
            VerbId::QueryCq => $f::<v::QueryCq>($($arg),*),
            VerbId::ResizeCq => $f::<v::ResizeCq>($($arg),*),
            VerbId::DestroyCq => $f::<v::DestroyCq>($($arg),*),
            VerbId::CreateSrq => $f::<v::CreateSrq>($($arg),*),
            VerbId::QuerySrq => $f::<v::QuerySrq>($($arg),*),
            VerbId::ModifySrq => $f::<v::ModifySrq>($($arg),*),
            VerbId::DestroySrq => $f::<v::DestroySrq>($($arg),*),
            VerbId::RegMr => $f::<v::RegMr>($($arg),*),
            VerbId::RegSharedMr => $f::<v::RegSharedMr>($($arg),*),
            VerbId::ReregMr => $f::<v::ReregMr>($($arg),*),
            VerbId::QueryMr => $f::<v::QueryMr>($($arg),*),
            VerbId::DeregMr => $f::<v::DeregMr>($($arg),*),
            VerbId::AllocMw => $f::<v::AllocMw>($($arg),*),
            VerbId::QueryMw => $f::<v::QueryMw>($($arg),*),
            VerbId::DeallocMw => $f::<v::DeallocMw>($($arg),*),
            VerbId::AttachMcast => $f::<v::AttachMcast>($($arg),*),
            VerbId::DetachMcast => $f::<v::DetachMcast>($($arg),*),
            VerbId::WaitCqEvent => $f::<v::WaitCqEvent>($($arg),*),
            VerbId::GetAsyncEvent => $f::<v::GetAsyncEvent>($($arg),*),
            VerbId::RegPhysMr => $f::<v::RegPhysMr>($($arg),*),
            VerbId::LocalMad => $f::<v::LocalMad>($($arg),*),
            VerbId::ReregPhysMr => $f::<v::ReregPhysMr>($($arg),*),
        }
    };
}

/// What a decoded request names: the header's handle, the handles inside
/// its fixed input, and the facts the policy needs.
struct Decoded {
    handle: u64,
    /// Handles inside the fixed input, with the kind each must be.
    embedded: Vec<(ObjectKind, u64)>,
    kernel_only: bool,
    private_out_max: u32,
}

/// The handles a verb's fixed input carries besides the header's (zero
/// means "none" only where the layout allows it: an optional SRQ).
trait EmbeddedHandles: Verb {
    fn embedded(_input: &Self::In) -> Vec<(ObjectKind, u64)> {
        Vec::new()
    }
}

macro_rules! no_embedded {
    ($($verb:ident),+ $(,)?) => { $(impl EmbeddedHandles for v::$verb {})+ };
}

no_embedded!(
    OpenCa,
    CloseCa,
    QueryCa,
    ModifyCa,
    AllocPd,
    DeallocPd,
    CreateAv,
    QueryAv,
    ModifyAv,
    DestroyAv,
    QueryQp,
    ModifyQp,
    DestroyQp,
    CreateCq,
    QueryCq,
    ResizeCq,
    DestroyCq,
    QuerySrq,
    ModifySrq,
    DestroySrq,
    RegMr,
    QueryMr,
    DeregMr,
    AllocMw,
    QueryMw,
    DeallocMw,
    AttachMcast,
    DetachMcast,
    WaitCqEvent,
    GetAsyncEvent,
    RegPhysMr,
    LocalMad,
    ReregPhysMr,
);

impl EmbeddedHandles for v::CreateQp {
    fn embedded(input: &Self::In) -> Vec<(ObjectKind, u64)> {
        let mut handles = alloc::vec![
            (ObjectKind::Pd, input.pd.raw()),
            (ObjectKind::Cq, input.send_cq.raw()),
            (ObjectKind::Cq, input.recv_cq.raw()),
        ];
        if let Some(srq) = input.srq {
            handles.push((ObjectKind::Srq, srq.raw()));
        }
        handles
    }
}

impl EmbeddedHandles for v::CreateSrq {
    fn embedded(input: &Self::In) -> Vec<(ObjectKind, u64)> {
        alloc::vec![(ObjectKind::Pd, input.pd.raw())]
    }
}

impl EmbeddedHandles for v::RegSharedMr {
    fn embedded(input: &Self::In) -> Vec<(ObjectKind, u64)> {
        alloc::vec![(ObjectKind::Pd, input.pd.raw())]
    }
}

impl EmbeddedHandles for v::ReregMr {
    fn embedded(input: &Self::In) -> Vec<(ObjectKind, u64)> {
        input
            .pd
            .map(|pd| alloc::vec![(ObjectKind::Pd, pd.raw())])
            .unwrap_or_default()
    }
}

fn decode<V: EmbeddedHandles>(input: &[u8]) -> Result<Decoded, AbiError> {
    let request = decode_request::<V>(input)?;
    Ok(Decoded {
        handle: request.handle,
        embedded: V::embedded(&request.input),
        kernel_only: request.kernel_only(),
        private_out_max: request.private_out_max,
    })
}

/// What a successful answer says, as far as the table cares.
fn answered<V: Verb>(output: &[u8]) -> Result<(IbStatus, u64), AbiError> {
    let len = answer_len::<V>(output)?;
    let response = decode_response::<V>(&output[..len])?;
    Ok((response.status, response.handle))
}

/// The length of the answer at the front of `output`: header + fixed
/// output + the private length the header declares.
fn answer_len<V: Verb>(output: &[u8]) -> Result<usize, AbiError> {
    let fixed = RESPONSE_HEADER_SIZE + V::ID.out_size();
    let truncated = AbiError::Truncated {
        needed: fixed,
        got: output.len(),
    };
    let declared = output
        .get(4..8)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_le_bytes)
        .ok_or(truncated)?;
    let len = usize::try_from(declared)
        .ok()
        .and_then(|p| fixed.checked_add(p))
        .filter(|len| *len <= output.len())
        .ok_or(truncated)?;
    Ok(len)
}

/// One object an open created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    kind: ObjectKind,
    /// The CA context (the open's `OpenCa` handle) it lives in.
    ca: u64,
    /// The object named in the create's header (a multicast membership's
    /// QP), 0 for a CA.
    parent: u64,
}

/// A verb request the proxy let through: what its answer needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forwarded {
    verb: VerbId,
    /// The header's handle (0 for `OpenCa`).
    target: u64,
    /// The CA context the target lives in (0 for `OpenCa`).
    ca: u64,
}

impl Forwarded {
    /// The verb.
    pub fn verb(&self) -> VerbId {
        self.verb
    }
}

/// What [`OpenTable::check`] decided to let through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checked {
    /// A verb: forward it down the stack and give its answer to
    /// [`OpenTable::complete`].
    Verb(Forwarded),
    /// The administrator IOCTL, from an administrator: apply the change
    /// to the child list, then reconcile.
    ChildEntry(ChildEntryChange),
}

/// The handles one open (file object) created, and the policy every
/// request on it passes.
#[derive(Debug, Default)]
pub struct OpenTable {
    objects: BTreeMap<u64, Record>,
}

impl OpenTable {
    /// An empty table (a new open).
    pub fn new() -> Self {
        Self::default()
    }

    /// Objects this open created and did not destroy.
    pub fn len(&self) -> usize {
        self.objects.len()
    }

    /// True when the open holds nothing.
    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    /// Whether this open created `handle` as a `kind`.
    pub fn owns(&self, kind: ObjectKind, handle: u64) -> bool {
        self.objects.get(&handle).is_some_and(|r| r.kind == kind)
    }

    /// The CA contexts this open holds.
    pub fn cas(&self) -> Vec<u64> {
        self.objects
            .iter()
            .filter(|(_, r)| r.kind == ObjectKind::Ca)
            .map(|(&h, _)| h)
            .collect()
    }

    /// The CA context of `handle` if this open created it as a `kind`,
    /// else the kind's refusal.
    fn context_of(&self, kind: ObjectKind, handle: u64) -> Result<u64, Refusal> {
        match self.objects.get(&handle) {
            Some(r) if r.kind == kind => Ok(r.ca),
            _ => Err(Refusal::ForeignHandle(kind)),
        }
    }

    /// Judges a user-mode request on this open (see the module doc):
    /// `ioctl` and `input` as sent, `output_len` the caller's output
    /// buffer, `is_admin` whether the caller's token is an
    /// administrator's. Reads nothing but its arguments.
    pub fn check(
        &self,
        ioctl: u32,
        input: &[u8],
        output_len: usize,
        is_admin: bool,
    ) -> Result<Checked, Refusal> {
        if ioctl == IOCTL_IBAL_CHILD_ENTRY.raw() {
            if !is_admin {
                return Err(Refusal::NotAdministrator);
            }
            return ChildEntryChange::parse(input)
                .map(Checked::ChildEntry)
                .map_err(Refusal::BadChildEntry);
        }
        let verb = VerbId::from_ioctl(IoctlCode::from_raw(ioctl))
            .map_err(|_| Refusal::UnknownCode(ioctl))?;
        let decoded = for_verb!(verb, decode(input)).map_err(|e| match e {
            AbiError::VersionMismatch { .. } if verb == VerbId::OpenCa => Refusal::AbiVersion(e),
            e => Refusal::Malformed(verb, e),
        })?;
        if decoded.kernel_only {
            return Err(Refusal::KernelOnly(verb));
        }
        let fixed = RESPONSE_HEADER_SIZE + verb.out_size();
        if output_len < fixed {
            return Err(Refusal::OutputTooSmall {
                needed: fixed,
                got: output_len,
            });
        }
        let room = usize::try_from(decoded.private_out_max)
            .ok()
            .and_then(|p| fixed.checked_add(p));
        if room.is_none_or(|room| room > output_len) {
            return Err(Refusal::PrivateRoomOverstated);
        }
        let ca = match verb.target() {
            None => 0,
            Some(kind) => self.context_of(kind, decoded.handle)?,
        };
        for (kind, handle) in &decoded.embedded {
            if self.context_of(*kind, *handle)? != ca {
                return Err(Refusal::ForeignHandle(*kind));
            }
        }
        Ok(Checked::Verb(Forwarded {
            verb,
            target: decoded.handle,
            ca,
        }))
    }

    /// Reads the answer to a forwarded request (`status` and the output
    /// buffer as the miniport left them) and records or forgets what it
    /// created or destroyed. A success whose answer does not decode
    /// records nothing and returns the status the caller gets instead.
    pub fn complete(&mut self, forwarded: &Forwarded, status: NtStatus, output: &[u8]) -> NtStatus {
        if !status.is_success() {
            return status;
        }
        let (ib_status, handle) = match for_verb!(forwarded.verb, answered(output)) {
            Ok(facts) => facts,
            Err(_) => return NtStatus::INVALID_DEVICE_STATE,
        };
        if !ib_status.is_success() {
            return status;
        }
        let verb = forwarded.verb;
        if let Some(kind) = verb.creates() {
            let ca = if kind == ObjectKind::Ca {
                handle
            } else {
                forwarded.ca
            };
            self.objects.insert(
                handle,
                Record {
                    kind,
                    ca,
                    parent: forwarded.target,
                },
            );
        } else if verb == VerbId::CloseCa {
            self.objects.retain(|_, r| r.ca != forwarded.target);
        } else if destroys(verb) {
            let gone = forwarded.target;
            self.objects.remove(&gone);
            // A QP's memberships go with it (the miniport detaches them).
            self.objects
                .retain(|_, r| !(r.kind == ObjectKind::Mcast && r.parent == gone));
        }
        status
    }

    /// The open is cleaned up: everything it recorded is forgotten and
    /// returned (kind and handle), CA contexts last.
    pub fn clear(&mut self) -> Vec<(ObjectKind, u64)> {
        let mut all: Vec<(ObjectKind, u64)> = core::mem::take(&mut self.objects)
            .into_iter()
            .map(|(h, r)| (r.kind, h))
            .collect();
        all.sort_by_key(|(kind, _)| *kind == ObjectKind::Ca);
        all
    }
}

/// The verbs whose success destroys their target.
fn destroys(verb: VerbId) -> bool {
    matches!(
        verb,
        VerbId::DeallocPd
            | VerbId::DestroyAv
            | VerbId::DestroyQp
            | VerbId::DestroyCq
            | VerbId::DestroySrq
            | VerbId::DeregMr
            | VerbId::DeallocMw
            | VerbId::DetachMcast
    )
}

/// Why the administrator IOCTL's input was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChildEntryError {
    /// Shorter than the header, or not exactly header + the strings.
    BadLength,
    /// The operation byte is neither add (1) nor remove (2).
    BadOperation(u8),
    /// A reserved byte, or a field a removal does not take, is not zero.
    ReservedNotZero,
    /// A string is not ASCII.
    NotAscii,
    /// The entry breaks a rule of the list.
    Entry(EntryError),
}

impl fmt::Display for ChildEntryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadLength => write!(f, "length is not the header plus its strings"),
            Self::BadOperation(op) => write!(f, "operation {op} is neither add (1) nor remove (2)"),
            Self::ReservedNotZero => write!(f, "a reserved or unused field is not zero"),
            Self::NotAscii => write!(f, "a string is not ASCII"),
            Self::Entry(e) => write!(f, "{e}"),
        }
    }
}

/// One change to the filter's child list, from the administrator IOCTL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildEntryChange {
    /// Add the entry, or replace the entry of that name.
    Add(ChildEntry),
    /// Remove the entry of that name.
    Remove(String),
}

/// Size of the administrator IOCTL's header.
pub const CHILD_ENTRY_HEADER: usize = 8;
const OP_ADD: u8 = 1;
const OP_REMOVE: u8 = 2;

impl ChildEntryChange {
    /// Parses the administrator IOCTL's input, untrusted:
    ///
    /// ```text
    /// 0  op (1 add or replace, 2 remove)     4  compatible_id_len (0 or more)
    /// 1  name_len                            5  reserved, zero
    /// 2  device_id_len                       6  partition key, little-endian
    /// 3  hardware_id_len
    /// 8  name | device ID | hardware ID | compatible ID   (ASCII, exactly)
    /// ```
    ///
    /// A removal carries only the name (every other field zero). An added
    /// entry's description is its name.
    pub fn parse(input: &[u8]) -> Result<Self, ChildEntryError> {
        let header: [u8; CHILD_ENTRY_HEADER] = input
            .get(..CHILD_ENTRY_HEADER)
            .and_then(|h| h.try_into().ok())
            .ok_or(ChildEntryError::BadLength)?;
        let [
            op,
            name_len,
            device_len,
            hardware_len,
            compatible_len,
            reserved,
            pkey_lo,
            pkey_hi,
        ] = header;
        if reserved != 0 {
            return Err(ChildEntryError::ReservedNotZero);
        }
        let lens = [name_len, device_len, hardware_len, compatible_len].map(usize::from);
        let total: usize = CHILD_ENTRY_HEADER + lens.iter().sum::<usize>();
        if input.len() != total {
            return Err(ChildEntryError::BadLength);
        }
        let mut strings = Vec::with_capacity(4);
        let mut at = CHILD_ENTRY_HEADER;
        for len in lens {
            let bytes = &input[at..at + len];
            at += len;
            if !bytes.is_ascii() {
                return Err(ChildEntryError::NotAscii);
            }
            strings.push(String::from_utf8_lossy(bytes).into_owned());
        }
        let pkey = u16::from_le_bytes([pkey_lo, pkey_hi]);
        let mut strings = strings.into_iter();
        let mut next = || strings.next().unwrap_or_default();
        let (name, device_id, hardware_id, compatible_id) = (next(), next(), next(), next());
        match op {
            OP_REMOVE => {
                if !(device_id.is_empty() && hardware_id.is_empty() && compatible_id.is_empty())
                    || pkey != 0
                {
                    return Err(ChildEntryError::ReservedNotZero);
                }
                let probe = ChildEntry {
                    name: name.clone(),
                    ..ChildEntry::ipoib()
                };
                check_entry(&probe).map_err(ChildEntryError::Entry)?;
                Ok(Self::Remove(name))
            }
            OP_ADD => {
                let entry = ChildEntry {
                    description: name.clone(),
                    name,
                    device_id,
                    hardware_ids: alloc::vec![hardware_id],
                    compatible_ids: if compatible_id.is_empty() {
                        Vec::new()
                    } else {
                        alloc::vec![compatible_id]
                    },
                    pkey: PKey::new(pkey),
                };
                check_entry(&entry).map_err(ChildEntryError::Entry)?;
                Ok(Self::Add(entry))
            }
            other => Err(ChildEntryError::BadOperation(other)),
        }
    }

    /// Encodes the change in the layout [`parse`](Self::parse) reads
    /// (what a management tool sends); `None` if a string is longer than
    /// 255 bytes or an entry has more than one hardware or compatible ID.
    pub fn encode(&self) -> Option<Vec<u8>> {
        let (op, name, device, hardware, compatible, pkey) = match self {
            Self::Remove(name) => (OP_REMOVE, name.as_str(), "", "", "", 0),
            Self::Add(e) => {
                if e.hardware_ids.len() != 1 || e.compatible_ids.len() > 1 {
                    return None;
                }
                (
                    OP_ADD,
                    e.name.as_str(),
                    e.device_id.as_str(),
                    e.hardware_ids[0].as_str(),
                    e.compatible_ids.first().map_or("", String::as_str),
                    e.pkey.get(),
                )
            }
        };
        let lens = [name, device, hardware, compatible].map(|s| u8::try_from(s.len()).ok());
        let [Some(a), Some(b), Some(c), Some(d)] = lens else {
            return None;
        };
        let [lo, hi] = pkey.to_le_bytes();
        let mut out = alloc::vec![op, a, b, c, d, 0, lo, hi];
        for s in [name, device, hardware, compatible] {
            out.extend_from_slice(s.as_bytes());
        }
        Some(out)
    }
}
