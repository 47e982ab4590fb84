//! Work queue entries: send WQEs (PRM 10.2) and receive WQEs (PRM 10.3).
//!
//! Contract:
//! - The segment layouts ([`CtrlSeg`], [`UdAddrSeg`], [`RemoteAddrSeg`],
//!   [`AtomicSeg`], [`BindSeg`], [`DataSeg`], the inline header, and
//!   [`RecvHeader`]) are byte layouts: every bit pattern is a layout.
//! - [`SendWqe`] is a validated, typed view of one send WQE. The driver side
//!   builds one from a verbs work request ([`SendWqe::from_wr`], or
//!   [`build_send_wqe`] in one step) and emits it as whole 16-byte segments;
//!   the device side parses one from the bytes of the posted basic blocks
//!   ([`SendWqe::parse`]). `emit` and `parse` check the same shape rules, so
//!   `parse(emit(w)) == w` for every `w` that emits, and whatever parses
//!   re-emits to the same bytes.
//! - [`SendWqe::parse`] never panics, and rejects everything that makes a
//!   WQE garbage (the device completes those with `LOC_QP_OP_ERR`): a
//!   `wqe_index` other than the slot's, `size16` of 0 or past the bytes
//!   supplied, an unknown or (for the transport) disallowed opcode, a missing,
//!   extra or short segment, an inline segment without the inline bit or
//!   longer than the WQE, an atomic without exactly one 8-byte data segment,
//!   a bind with a window type other than 1 or 2 or unknown access bits, and
//!   any non-zero reserved byte. Fields an opcode does not use (the `imm`
//!   field of a SEND, the `compare` operand of a fetch-and-add, the inline
//!   padding) count as reserved and must be zero.
//! - What depends on device state (keys, ranges, the port of a UD address
//!   vector, `max_inline_bytes`, `max_send_sges`) is not checked here.
//! - Wrapping around the end of the ring is the caller's job: the builder
//!   writes one contiguous WQE into scratch memory, which the caller copies
//!   into consecutive 64-byte basic blocks; the device gathers the posted
//!   basic blocks into one buffer before parsing.
//! - Little-endian throughout, except immediate data (network order). The
//!   R_Key that `SEND_INV` and `LOCAL_INV` carry in the `imm` field is
//!   little-endian like every other key in the PRM.

use bitflags::bitflags;
use ib_types::AbiError;
use ib_types::abi::ensure_zero;
use ib_types::access::AccessFlags;
use ib_types::scalars::{QKey, Qpn};
use ib_types::wr::{
    LKey, MAX_MESSAGE_LEN, RKey, RemoteAddr, SendFlags, SendOp, SendWr, Sge, Transport, WrLimits,
    WrOpcode,
};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::av::Av;
use crate::{Be32, Le16, Le32, Le64};

/// Bytes of a send queue basic block.
pub const BB_SIZE: usize = 64;
/// Bytes of a WQE segment (the unit of `size16`).
pub const SEG_SIZE: usize = 16;
/// The longest send WQE `size16` can describe: 255 segments.
pub const MAX_SEND_WQE_BYTES: usize = u8::MAX as usize * SEG_SIZE;
/// Set in the inline segment header; the low 31 bits are the data length.
pub const INLINE_BIT: u32 = 0x8000_0000;
/// The smallest receive WQE stride.
pub const MIN_RECV_STRIDE: usize = 32;

/// Basic blocks a send WQE of `bytes` bytes occupies (the producer counter
/// advances by this much).
#[inline]
pub const fn basic_blocks(bytes: usize) -> usize {
    bytes.div_ceil(BB_SIZE)
}

prm_code! {
    /// Send WQE opcode (PRM 10.2); also the opcode of send CQEs.
    pub enum WqeOpcode: u8 {
        /// No operation (completes if signaled).
        Nop = 0x00,
        /// Send.
        Send = 0x01,
        /// Send with immediate data.
        SendImm = 0x02,
        /// Send invalidating an R_Key at the responder.
        SendInv = 0x03,
        /// RDMA write.
        RdmaWrite = 0x04,
        /// RDMA write with immediate data.
        RdmaWriteImm = 0x05,
        /// RDMA read.
        RdmaRead = 0x06,
        /// Atomic compare and swap.
        AtomicCs = 0x07,
        /// Atomic fetch and add.
        AtomicFa = 0x08,
        /// Bind a memory window.
        BindMw = 0x09,
        /// Invalidate a local key.
        LocalInv = 0x0A,
    }
}

impl WqeOpcode {
    /// The opcode of a verbs operation.
    #[inline]
    pub const fn from_wr(op: WrOpcode) -> Self {
        match op {
            WrOpcode::Send => Self::Send,
            WrOpcode::SendWithImm => Self::SendImm,
            WrOpcode::SendWithInvalidate => Self::SendInv,
            WrOpcode::RdmaWrite => Self::RdmaWrite,
            WrOpcode::RdmaWriteWithImm => Self::RdmaWriteImm,
            WrOpcode::RdmaRead => Self::RdmaRead,
            WrOpcode::CompareSwap => Self::AtomicCs,
            WrOpcode::FetchAdd => Self::AtomicFa,
            WrOpcode::BindMw => Self::BindMw,
            WrOpcode::LocalInvalidate => Self::LocalInv,
        }
    }

    /// The verbs operation, or `None` for NOP (which verbs never post).
    pub const fn to_wr(self) -> Option<WrOpcode> {
        Some(match self {
            Self::Nop => return None,
            Self::Send => WrOpcode::Send,
            Self::SendImm => WrOpcode::SendWithImm,
            Self::SendInv => WrOpcode::SendWithInvalidate,
            Self::RdmaWrite => WrOpcode::RdmaWrite,
            Self::RdmaWriteImm => WrOpcode::RdmaWriteWithImm,
            Self::RdmaRead => WrOpcode::RdmaRead,
            Self::AtomicCs => WrOpcode::CompareSwap,
            Self::AtomicFa => WrOpcode::FetchAdd,
            Self::BindMw => WrOpcode::BindMw,
            Self::LocalInv => WrOpcode::LocalInvalidate,
        })
    }

    /// Whether a QP of `transport` accepts the opcode: NOP everywhere,
    /// the rest as the IBA operation tables say
    /// ([`WrOpcode::is_supported_on`]). SMI and GSI QPs are UD.
    #[inline]
    pub const fn is_allowed_on(self, transport: Transport) -> bool {
        match self.to_wr() {
            None => true,
            Some(op) => op.is_supported_on(transport),
        }
    }

    /// SEND and SEND_IMM: on UD, SMI and GSI QPs the UD address segment
    /// follows the control segment.
    #[inline]
    pub const fn takes_ud_address(self) -> bool {
        matches!(self, Self::Send | Self::SendImm)
    }

    /// RDMA and atomic operations: a remote address segment follows.
    #[inline]
    pub const fn takes_remote(self) -> bool {
        matches!(
            self,
            Self::RdmaWrite | Self::RdmaWriteImm | Self::RdmaRead | Self::AtomicCs | Self::AtomicFa
        )
    }

    /// The two atomics: an atomic segment and one 8-byte data segment.
    #[inline]
    pub const fn is_atomic(self) -> bool {
        matches!(self, Self::AtomicCs | Self::AtomicFa)
    }

    /// Sends and RDMA writes: the data may be inline.
    #[inline]
    pub const fn allows_inline(self) -> bool {
        matches!(
            self,
            Self::Send | Self::SendImm | Self::SendInv | Self::RdmaWrite | Self::RdmaWriteImm
        )
    }

    /// NOP, BIND_MW and LOCAL_INV carry no data segments.
    #[inline]
    pub const fn takes_data(self) -> bool {
        !matches!(self, Self::Nop | Self::BindMw | Self::LocalInv)
    }

    /// Whether the control segment's `imm` field is used (immediate data or
    /// an R_Key); for the others it must be zero.
    #[inline]
    pub const fn uses_imm(self) -> bool {
        matches!(
            self,
            Self::SendImm | Self::SendInv | Self::RdmaWriteImm | Self::LocalInv
        )
    }
}

bitflags! {
    /// Control segment `flags` (PRM 10.2).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct WqeFlags: u8 {
        /// Generate a CQE on success.
        const SIGNALED = 1 << 0;
        /// Set SE in the request: the responder raises a solicited event.
        const SOLICITED = 1 << 1;
        /// Wait for earlier RDMA reads and atomics first.
        const FENCE = 1 << 2;
        /// The data is an inline segment instead of data segments.
        const INLINE = 1 << 3;
    }
}

impl WqeFlags {
    /// The WQE flags of verbs send flags (the bit positions differ): one
    /// load from a table of the four flags' sixteen combinations, built
    /// flag by flag at compile time (a post builds a control word per WR).
    #[inline]
    pub const fn from_send_flags(flags: SendFlags) -> Self {
        Self::from_bits_retain(SEND_TO_WQE_FLAGS[(flags.bits() & SEND_FLAGS_MAPPED) as usize])
    }
}

/// The send flags a WQE carries (SIGNALED, SOLICITED, FENCE, INLINE: bits
/// 0 to 3 of [`SendFlags`]).
const SEND_FLAGS_MAPPED: u32 = SendFlags::SIGNALED
    .union(SendFlags::SOLICITED)
    .union(SendFlags::FENCE)
    .union(SendFlags::INLINE)
    .bits();

/// [`WqeFlags::from_send_flags`]'s table: entry `i` is the WQE flags of
/// the send flags whose bits are `i`.
const SEND_TO_WQE_FLAGS: [u8; SEND_FLAGS_MAPPED as usize + 1] = {
    let mut table = [0; SEND_FLAGS_MAPPED as usize + 1];
    let mut i = 0;
    while i < table.len() {
        table[i] = map_send_flags(SendFlags::from_bits_truncate(i as u32)).bits();
        i += 1;
    }
    table
};

/// The WQE flags of verbs send flags, flag by flag.
const fn map_send_flags(flags: SendFlags) -> WqeFlags {
    let mut out = WqeFlags::empty();
    if flags.contains(SendFlags::SIGNALED) {
        out = out.union(WqeFlags::SIGNALED);
    }
    if flags.contains(SendFlags::SOLICITED) {
        out = out.union(WqeFlags::SOLICITED);
    }
    if flags.contains(SendFlags::FENCE) {
        out = out.union(WqeFlags::FENCE);
    }
    if flags.contains(SendFlags::INLINE) {
        out = out.union(WqeFlags::INLINE);
    }
    out
}

prm_code! {
    /// Memory window type of a bind segment.
    pub enum MwType: u8 {
        /// Type 1: bound by a BIND_MW WQE on any QP of the PD.
        Type1 = 1,
        /// Type 2: bound to one QP.
        Type2 = 2,
    }
}

/// Control segment (PRM 10.2, 16 bytes): the first segment of every WQE.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct CtrlSeg {
    /// [`WqeOpcode`].
    pub opcode: u8,
    /// [`WqeFlags`].
    pub flags: u8,
    /// The WQE's length in 16-byte units, this segment included.
    pub size16: u8,
    /// Reserved, zero.
    pub reserved_at_0x3: u8,
    /// Low 16 bits of the producer counter at the WQE's first basic block.
    pub wqe_index: Le16,
    /// Reserved, zero.
    pub reserved_at_0x6: [u8; 2],
    /// Immediate data (network order bytes), or the R_Key of `SEND_INV` /
    /// `LOCAL_INV` (little-endian).
    pub imm: [u8; 4],
    /// Reserved, zero.
    pub reserved_at_0xc: [u8; 4],
}

assert_layout!(
    CtrlSeg,
    size = 16,
    opcode @ 0x0,
    flags @ 0x1,
    size16 @ 0x2,
    reserved_at_0x3 @ 0x3,
    wqe_index @ 0x4,
    reserved_at_0x6 @ 0x6,
    imm @ 0x8,
    reserved_at_0xc @ 0xC,
);

/// UD address segment (PRM 10.2, 48 bytes; UD, SMI and GSI sends).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct UdAddrSeg {
    /// Address vector.
    pub av: Av,
    /// Destination QP (24 bits).
    pub dest_qpn: Le32,
    /// Q_Key; one with the high bit set is replaced by the QP's own.
    pub qkey: Le32,
    /// Reserved, zero.
    pub reserved_at_0x28: [u8; 8],
}

assert_layout!(
    UdAddrSeg,
    size = 48,
    av @ 0x00,
    dest_qpn @ 0x20,
    qkey @ 0x24,
    reserved_at_0x28 @ 0x28,
);

/// Remote address segment (PRM 10.2, 16 bytes).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct RemoteAddrSeg {
    /// Remote virtual address.
    pub va: Le64,
    /// Remote key.
    pub rkey: RKey,
    /// Reserved, zero.
    pub reserved_at_0xc: [u8; 4],
}

assert_layout!(RemoteAddrSeg, size = 16, va @ 0x0, rkey @ 0x8, reserved_at_0xc @ 0xC);

/// Atomic segment (PRM 10.2, 16 bytes).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct AtomicSeg {
    /// The swap value (compare and swap) or the addend (fetch and add).
    pub swap_or_add: Le64,
    /// The compare value (compare and swap); zero for fetch and add.
    pub compare: Le64,
}

assert_layout!(AtomicSeg, size = 16, swap_or_add @ 0x0, compare @ 0x8);

/// Bind segment (PRM 10.2, 32 bytes).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct BindSeg {
    /// The window's new key: its MPT index and new tag.
    pub new_rkey: RKey,
    /// The L_Key of the region the window is bound in.
    pub mr_key: LKey,
    /// Start of the window.
    pub va: Le64,
    /// Length of the window (0 unbinds).
    pub length: Le64,
    /// The window's rights ([`AccessFlags`] bits).
    pub access: Le32,
    /// [`MwType`].
    pub mw_type: u8,
    /// Reserved, zero.
    pub reserved_at_0x1d: [u8; 3],
}

assert_layout!(
    BindSeg,
    size = 32,
    new_rkey @ 0x00,
    mr_key @ 0x04,
    va @ 0x08,
    length @ 0x10,
    access @ 0x18,
    mw_type @ 0x1C,
    reserved_at_0x1d @ 0x1D,
);

/// Data segment (PRM 10.2, 16 bytes): `addr` (8), `length` (4), `lkey` (4),
/// little-endian — exactly the [`Sge`] layout, which is reused.
pub type DataSeg = Sge;

assert_layout!(DataSeg, size = 16, addr @ 0x0, length @ 0x8, lkey @ 0xC);

/// Receive WQE header (PRM 10.3, 16 bytes), followed by `num_sges` data
/// segments.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct RecvHeader {
    /// Data segments that follow.
    pub num_sges: u8,
    /// Reserved, zero.
    pub reserved_at_0x1: u8,
    /// Low 16 bits of the receive producer counter at this WQE.
    pub wqe_index: Le16,
    /// Reserved, zero.
    pub reserved_at_0x4: [u8; 12],
}

assert_layout!(
    RecvHeader,
    size = 16,
    num_sges @ 0x0,
    reserved_at_0x1 @ 0x1,
    wqe_index @ 0x2,
    reserved_at_0x4 @ 0x4,
);

/// Why a WQE could not be parsed or built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WqeError {
    /// Fewer bytes than the control segment or `size16` needs.
    #[error("WQE needs {needed} bytes, {available} supplied")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes supplied.
        available: usize,
    },
    /// `wqe_index` differs from the slot the WQE was fetched from.
    #[error("wqe_index {found:#06x} does not match the slot's {expected:#06x}")]
    IndexMismatch {
        /// The slot's index.
        expected: u16,
        /// The index in the WQE.
        found: u16,
    },
    /// `size16` is 0.
    #[error("size16 is 0")]
    ZeroSize,
    /// An unknown code or flag bit, a reserved byte set, or a value out of
    /// range.
    #[error(transparent)]
    Abi(#[from] AbiError),
    /// The opcode is not allowed on the QP's transport.
    #[error("{opcode:?} is not allowed on {transport:?} QPs")]
    OpcodeNotAllowed {
        /// The opcode.
        opcode: WqeOpcode,
        /// The QP's transport.
        transport: Transport,
    },
    /// A segment the opcode needs does not fit in the WQE.
    #[error("{opcode:?}: the {segment} segment is missing")]
    MissingSegment {
        /// The opcode.
        opcode: WqeOpcode,
        /// The segment.
        segment: &'static str,
    },
    /// Segments the opcode does not take (data segments after a NOP, a
    /// bind or an invalidate; anything after an inline segment).
    #[error("{opcode:?}: segments the opcode does not take")]
    UnexpectedSegments {
        /// The opcode.
        opcode: WqeOpcode,
    },
    /// A UD address for an opcode that takes none.
    #[error("{opcode:?} takes no UD address segment")]
    UnexpectedUdAddress {
        /// The opcode.
        opcode: WqeOpcode,
    },
    /// Inline data for an opcode that cannot carry it.
    #[error("{opcode:?} cannot carry inline data")]
    InlineNotAllowed {
        /// The opcode.
        opcode: WqeOpcode,
    },
    /// The INLINE flag and the payload disagree.
    #[error("the INLINE flag and the payload disagree")]
    InlineFlagMismatch,
    /// The inline segment header lacks [`INLINE_BIT`].
    #[error("inline header {header:#010x} lacks the inline bit")]
    InlineHeader {
        /// The header word.
        header: u32,
    },
    /// The inline length runs past the WQE.
    #[error("inline length {length} exceeds the {available} bytes left in the WQE")]
    InlineLength {
        /// Declared length.
        length: u32,
        /// Bytes left after the header.
        available: usize,
    },
    /// An atomic without exactly one 8-byte data segment.
    #[error("an atomic needs exactly one 8-byte data segment")]
    AtomicData,
    /// The WQE would be longer than `size16` can describe.
    #[error("a WQE of {bytes} bytes exceeds {MAX_SEND_WQE_BYTES}")]
    TooLong {
        /// The length it would have.
        bytes: usize,
    },
    /// The output buffer is too small.
    #[error("output needs {needed} bytes, {available} supplied")]
    OutputTooSmall {
        /// Bytes needed.
        needed: usize,
        /// Bytes supplied.
        available: usize,
    },
    /// Building: `wr.ud` and the resolved address vector must be given
    /// together.
    #[error("the work request's UD destination and the address vector disagree")]
    AvMismatch,
    /// Building: inline data given without INLINE, missing with it, or of a
    /// length other than the SGEs' total.
    #[error("inline data ({inline:?} bytes) does not match the request (SGE total {sge_total:?})")]
    InlineData {
        /// Bytes of inline data given, if any.
        inline: Option<usize>,
        /// The SGEs' total length with INLINE, else `None`.
        sge_total: Option<u32>,
    },
    /// A receive stride that is not a power of two of at least
    /// [`MIN_RECV_STRIDE`].
    #[error("receive stride {stride} is not a power of two >= {MIN_RECV_STRIDE}")]
    BadStride {
        /// The stride.
        stride: usize,
    },
    /// More receive data segments than the stride (or `num_sges`) holds.
    #[error("{count} data segments do not fit; at most {fit}")]
    TooManySges {
        /// Segments asked for.
        count: usize,
        /// Segments that fit.
        fit: usize,
    },
}

/// The UD address of a datagram send, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UdAddress {
    /// Address vector (passes [`Av::check`]).
    pub av: Av,
    /// Destination QP.
    pub dest_qpn: Qpn,
    /// Q_Key (a controlled key is replaced by the QP's own).
    pub qkey: QKey,
}

/// A memory window bind, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bind {
    /// The window's new key.
    pub new_rkey: RKey,
    /// The region's L_Key.
    pub mr_key: LKey,
    /// Start of the window.
    pub va: u64,
    /// Length (0 unbinds).
    pub length: u64,
    /// The window's rights.
    pub access: AccessFlags,
    /// The window type.
    pub mw_type: MwType,
}

/// A send WQE's operation with exactly its operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WqeOp {
    /// No operation.
    Nop,
    /// Send.
    Send,
    /// Send with immediate data.
    SendImm {
        /// Immediate data, network order.
        imm: Be32,
    },
    /// Send invalidating `rkey` at the responder.
    SendInv {
        /// The key to invalidate.
        rkey: RKey,
    },
    /// RDMA write.
    RdmaWrite {
        /// Where to write.
        remote: RemoteAddr,
    },
    /// RDMA write with immediate data.
    RdmaWriteImm {
        /// Where to write.
        remote: RemoteAddr,
        /// Immediate data, network order.
        imm: Be32,
    },
    /// RDMA read.
    RdmaRead {
        /// Where to read.
        remote: RemoteAddr,
    },
    /// Atomic compare and swap.
    AtomicCs {
        /// The remote word.
        remote: RemoteAddr,
        /// Value expected.
        compare: u64,
        /// Value stored if equal.
        swap: u64,
    },
    /// Atomic fetch and add.
    AtomicFa {
        /// The remote word.
        remote: RemoteAddr,
        /// Value added.
        add: u64,
    },
    /// Bind a memory window.
    BindMw(Bind),
    /// Invalidate a local key.
    LocalInv {
        /// The key to invalidate.
        key: RKey,
    },
}

impl WqeOp {
    /// The operation's opcode.
    #[inline]
    pub const fn opcode(&self) -> WqeOpcode {
        match self {
            Self::Nop => WqeOpcode::Nop,
            Self::Send => WqeOpcode::Send,
            Self::SendImm { .. } => WqeOpcode::SendImm,
            Self::SendInv { .. } => WqeOpcode::SendInv,
            Self::RdmaWrite { .. } => WqeOpcode::RdmaWrite,
            Self::RdmaWriteImm { .. } => WqeOpcode::RdmaWriteImm,
            Self::RdmaRead { .. } => WqeOpcode::RdmaRead,
            Self::AtomicCs { .. } => WqeOpcode::AtomicCs,
            Self::AtomicFa { .. } => WqeOpcode::AtomicFa,
            Self::BindMw(_) => WqeOpcode::BindMw,
            Self::LocalInv { .. } => WqeOpcode::LocalInv,
        }
    }

    /// The remote address of RDMA and atomic operations.
    #[inline]
    pub const fn remote(&self) -> Option<RemoteAddr> {
        match *self {
            Self::RdmaWrite { remote }
            | Self::RdmaWriteImm { remote, .. }
            | Self::RdmaRead { remote }
            | Self::AtomicCs { remote, .. }
            | Self::AtomicFa { remote, .. } => Some(remote),
            _ => None,
        }
    }

    /// The control segment's `imm` bytes.
    #[inline]
    const fn imm_bytes(&self) -> [u8; 4] {
        match *self {
            Self::SendImm { imm } | Self::RdmaWriteImm { imm, .. } => imm.to_bytes(),
            Self::SendInv { rkey: key } | Self::LocalInv { key } => key.get().to_le_bytes(),
            _ => [0; 4],
        }
    }
}

/// The data of a send WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Payload<'a> {
    /// Data segments (empty for NOP, BIND_MW and LOCAL_INV).
    Data(&'a [Sge]),
    /// Inline data.
    Inline(&'a [u8]),
}

impl<'a> Payload<'a> {
    /// The payload of `wr`: its inline bytes `inline` when it asks for
    /// INLINE (they must be as long as its SGEs say), else its SGEs (and
    /// then no inline bytes may be given).
    #[inline(always)]
    fn of(wr: &SendWr<'a>, inline: Option<&'a [u8]>) -> Result<Self, WqeError> {
        if wr.flags.contains(SendFlags::INLINE) {
            let sge_total = Sge::total_len(wr.sg_list);
            match inline {
                Some(data) if sge_total.is_some_and(|t| usize::try_from(t) == Ok(data.len())) => {
                    Ok(Self::Inline(data))
                }
                _ => Err(WqeError::InlineData {
                    inline: inline.map(<[u8]>::len),
                    sge_total,
                }),
            }
        } else if let Some(data) = inline {
            Err(WqeError::InlineData {
                inline: Some(data.len()),
                sge_total: None,
            })
        } else {
            Ok(Self::Data(wr.sg_list))
        }
    }
}

impl Payload<'_> {
    /// Bytes the payload occupies in the WQE.
    #[inline]
    const fn wqe_bytes(&self) -> usize {
        match self {
            Self::Data(sges) => sges.len().saturating_mul(SEG_SIZE),
            Self::Inline(data) => inline_seg_len(data.len()),
        }
    }
}

/// Bytes an inline segment of `len` data bytes occupies, padding included.
#[inline]
pub const fn inline_seg_len(len: usize) -> usize {
    len.saturating_add(4).next_multiple_of(SEG_SIZE)
}

/// A validated send WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SendWqe<'a> {
    /// Low 16 bits of the producer counter at the first basic block.
    pub wqe_index: u16,
    /// Flags exactly as in the control segment: INLINE is set exactly when
    /// the payload is inline.
    pub flags: WqeFlags,
    /// The operation.
    pub op: WqeOp,
    /// The UD address (UD, SMI and GSI sends); `None` otherwise.
    pub ud: Option<UdAddress>,
    /// Data segments or inline data.
    pub payload: Payload<'a>,
}

/// Splits a segment off the front of the WQE's remaining bytes.
fn take<T>(rest: &mut &[u8], opcode: WqeOpcode, segment: &'static str) -> Result<T, WqeError>
where
    T: FromBytes + KnownLayout + Immutable + Unaligned,
{
    let (seg, tail) =
        T::read_from_prefix(rest).map_err(|_| WqeError::MissingSegment { opcode, segment })?;
    *rest = tail;
    Ok(seg)
}

impl UdAddrSeg {
    fn parse(&self) -> Result<UdAddress, WqeError> {
        ensure_zero("UdAddrSeg.reserved_at_0x28", &self.reserved_at_0x28)?;
        self.av.check()?;
        Ok(UdAddress {
            av: self.av,
            dest_qpn: Qpn::new(self.dest_qpn.get())?,
            qkey: QKey::new(self.qkey.get()),
        })
    }
}

impl RemoteAddrSeg {
    fn parse(&self) -> Result<RemoteAddr, WqeError> {
        ensure_zero("RemoteAddrSeg.reserved_at_0xc", &self.reserved_at_0xc)?;
        Ok(RemoteAddr {
            addr: self.va.get(),
            rkey: self.rkey,
        })
    }
}

impl BindSeg {
    fn parse(&self) -> Result<Bind, WqeError> {
        ensure_zero("BindSeg.reserved_at_0x1d", &self.reserved_at_0x1d)?;
        Ok(Bind {
            new_rkey: self.new_rkey,
            mr_key: self.mr_key,
            va: self.va.get(),
            length: self.length.get(),
            access: AccessFlags::from_raw(self.access.get())?,
            mw_type: MwType::from_code(self.mw_type)?,
        })
    }
}

/// Reads the inline segment that must fill `rest` exactly.
fn parse_inline(rest: &[u8], opcode: WqeOpcode) -> Result<&[u8], WqeError> {
    let (header, data) = Le32::ref_from_prefix(rest).map_err(|_| WqeError::MissingSegment {
        opcode,
        segment: "inline",
    })?;
    let header = header.get();
    if header & INLINE_BIT == 0 {
        return Err(WqeError::InlineHeader { header });
    }
    let length = header & !INLINE_BIT;
    let Some((inline, padding)) = usize::try_from(length)
        .ok()
        .and_then(|len| data.split_at_checked(len))
    else {
        return Err(WqeError::InlineLength {
            length,
            available: data.len(),
        });
    };
    if inline_seg_len(inline.len()) != rest.len() {
        return Err(WqeError::UnexpectedSegments { opcode });
    }
    ensure_zero("inline padding", padding)?;
    Ok(inline)
}

impl<'a> SendWqe<'a> {
    /// The view of a verbs send work request.
    ///
    /// `av` is the address vector `wr.ud` names, resolved by the caller;
    /// it must be given exactly when `wr.ud` is. With [`SendFlags::INLINE`],
    /// `inline` holds the data of the SGEs concatenated (the caller reads
    /// it; the builder never dereferences an address) and must be exactly
    /// their total length; without INLINE it must be `None`.
    ///
    /// A bind is emitted for a type 2 window (a work request does not say
    /// its window's type); a type 1 bind is built by setting
    /// [`Bind::mw_type`] on the result, as the kernel and the UVP do from
    /// the type they recorded for the window.
    pub fn from_wr(
        wr: &SendWr<'a>,
        av: Option<&Av>,
        wqe_index: u16,
        inline: Option<&'a [u8]>,
    ) -> Result<Self, WqeError> {
        let wqe = Self::from_wr_unchecked(wr, av, wqe_index, inline)?;
        wqe.check_shape()?;
        Ok(wqe)
    }

    /// [`from_wr`](Self::from_wr) checked for emitting as well (its length
    /// fits `size16`), straight from the work request into the words
    /// [`PreparedSendWqe::emit_words`] stores, with no second check: what a
    /// poster writing into its ring uses. The same checks, in the same
    /// order, with the same errors as `from_wr` then [`emit`](Self::emit)
    /// (the prepared WQE's words are `emit`'s bytes).
    #[inline(always)]
    pub fn prepare(
        wr: &SendWr<'a>,
        av: Option<&Av>,
        wqe_index: u16,
        inline: Option<&'a [u8]>,
    ) -> Result<PreparedSendWqe<'a>, WqeError> {
        PreparedSendWqe::from_wr(wr, av, wqe_index, inline)
    }

    /// The WQE checked as [`emit`](Self::emit) checks it, ready to emit.
    #[inline]
    pub fn prepared(&self) -> Result<PreparedSendWqe<'a>, WqeError> {
        self.check_shape()?;
        let ud = self.ud.map(|ud| (ud.av, ud.dest_qpn.get(), ud.qkey.get()));
        let (imm, operands) = Operands::of(&self.op);
        PreparedSendWqe::new(
            self.op.opcode(),
            self.flags,
            self.wqe_index,
            u32::from_le_bytes(imm),
            ud,
            operands,
            self.payload,
        )
    }

    /// `from_wr` but for the shape check.
    #[inline]
    fn from_wr_unchecked(
        wr: &SendWr<'a>,
        av: Option<&Av>,
        wqe_index: u16,
        inline: Option<&'a [u8]>,
    ) -> Result<Self, WqeError> {
        let op = match wr.op {
            SendOp::Send => WqeOp::Send,
            SendOp::SendWithImm { imm } => WqeOp::SendImm { imm },
            SendOp::SendWithInvalidate { rkey } => WqeOp::SendInv { rkey },
            SendOp::RdmaWrite { remote } => WqeOp::RdmaWrite { remote },
            SendOp::RdmaWriteWithImm { remote, imm } => WqeOp::RdmaWriteImm { remote, imm },
            SendOp::RdmaRead { remote } => WqeOp::RdmaRead { remote },
            SendOp::CompareSwap {
                remote,
                compare,
                swap,
            } => WqeOp::AtomicCs {
                remote,
                compare,
                swap,
            },
            SendOp::FetchAdd { remote, add } => WqeOp::AtomicFa { remote, add },
            SendOp::BindMw { rkey, bind, .. } => WqeOp::BindMw(Bind {
                new_rkey: rkey,
                mr_key: bind.mr_lkey,
                va: bind.addr,
                length: bind.length,
                access: bind.access,
                mw_type: MwType::Type2,
            }),
            SendOp::LocalInvalidate { rkey } => WqeOp::LocalInv { key: rkey },
        };
        let ud = match (wr.ud, av) {
            (None, None) => None,
            (Some(dest), Some(av)) => Some(UdAddress {
                av: *av,
                dest_qpn: dest.remote_qpn,
                qkey: dest.remote_qkey,
            }),
            _ => return Err(WqeError::AvMismatch),
        };
        let payload = Payload::of(wr, inline)?;
        Ok(Self {
            wqe_index,
            flags: WqeFlags::from_send_flags(wr.flags),
            op,
            ud,
            payload,
        })
    }

    /// The rules `emit` and `parse` share: everything but the transport and
    /// the segment framing.
    #[inline]
    fn check_shape(&self) -> Result<(), WqeError> {
        let opcode = self.op.opcode();
        let inline = matches!(self.payload, Payload::Inline(_));
        if self.flags.contains(WqeFlags::INLINE) != inline {
            return Err(WqeError::InlineFlagMismatch);
        }
        if let Some(ud) = &self.ud {
            if !opcode.takes_ud_address() {
                return Err(WqeError::UnexpectedUdAddress { opcode });
            }
            ud.av.check()?;
        }
        if inline && !opcode.allows_inline() {
            return Err(WqeError::InlineNotAllowed { opcode });
        }
        if let WqeOp::BindMw(bind) = self.op {
            AccessFlags::from_raw(bind.access.bits())?;
        }
        if let Payload::Data(sges) = self.payload {
            if !opcode.takes_data() && !sges.is_empty() {
                return Err(WqeError::UnexpectedSegments { opcode });
            }
            if opcode.is_atomic() && !matches!(sges, [one] if one.length.get() == 8) {
                return Err(WqeError::AtomicData);
            }
        }
        Ok(())
    }

    /// The WQE's length in bytes (a multiple of 16), which `emit` refuses
    /// beyond [`MAX_SEND_WQE_BYTES`].
    #[inline]
    pub const fn byte_len(&self) -> usize {
        let opcode = self.op.opcode();
        let mut len = SEG_SIZE;
        if self.ud.is_some() {
            len += size_of::<UdAddrSeg>();
        }
        if opcode.takes_remote() {
            len += size_of::<RemoteAddrSeg>();
        }
        if opcode.is_atomic() {
            len += size_of::<AtomicSeg>();
        }
        if let WqeOp::BindMw(_) = self.op {
            len += size_of::<BindSeg>();
        }
        len.saturating_add(self.payload.wqe_bytes())
    }

    /// Writes the WQE to the front of `out` as whole 16-byte segments and
    /// returns its length. The caller copies it into consecutive basic
    /// blocks ([`basic_blocks`] of them) starting at slot `wqe_index`.
    /// The transport is not known here: the UD address must be present
    /// exactly for SEND and SEND_IMM on UD, SMI and GSI QPs, as `parse`
    /// expects.
    pub fn emit(&self, out: &mut [u8]) -> Result<usize, WqeError> {
        let prepared = self.prepared()?;
        prepared.emit_words(out.len(), |index, word| {
            // In range: `emit_words` checked the WQE fits `out`.
            if let Some(bytes) = out.get_mut(index * WORD..(index + 1) * WORD) {
                bytes.copy_from_slice(&word.to_le_bytes());
            }
        })
    }

    /// Parses and validates the send WQE at the front of `bytes` (the
    /// posted basic blocks from the WQE's slot on, gathered across the
    /// ring's wrap, at most 2^`log_max_wqe_size` bytes). `expected_index`
    /// is the low 16 bits of the producer counter at the slot; `transport`
    /// is the QP's (SMI and GSI QPs are [`Transport::Ud`]). Bytes past
    /// `size16` are not looked at.
    pub fn parse(
        bytes: &'a [u8],
        expected_index: u16,
        transport: Transport,
    ) -> Result<Self, WqeError> {
        let (ctrl, _) = CtrlSeg::read_from_prefix(bytes).map_err(|_| WqeError::Truncated {
            needed: SEG_SIZE,
            available: bytes.len(),
        })?;
        let found = ctrl.wqe_index.get();
        if found != expected_index {
            return Err(WqeError::IndexMismatch {
                expected: expected_index,
                found,
            });
        }
        let len = usize::from(ctrl.size16) * SEG_SIZE;
        if len == 0 {
            return Err(WqeError::ZeroSize);
        }
        let Some(wqe) = bytes.get(..len) else {
            return Err(WqeError::Truncated {
                needed: len,
                available: bytes.len(),
            });
        };
        ensure_zero("CtrlSeg.reserved_at_0x3", &[ctrl.reserved_at_0x3])?;
        ensure_zero("CtrlSeg.reserved_at_0x6", &ctrl.reserved_at_0x6)?;
        ensure_zero("CtrlSeg.reserved_at_0xc", &ctrl.reserved_at_0xc)?;
        let flags = WqeFlags::from_bits(ctrl.flags).ok_or(AbiError::ReservedNotZero {
            field: "CtrlSeg.flags",
        })?;
        let opcode = WqeOpcode::from_code(ctrl.opcode)?;
        if !opcode.is_allowed_on(transport) {
            return Err(WqeError::OpcodeNotAllowed { opcode, transport });
        }
        if !opcode.uses_imm() {
            ensure_zero("CtrlSeg.imm (unused by the opcode)", &ctrl.imm)?;
        }

        let mut rest = &wqe[SEG_SIZE..];
        let ud = if transport == Transport::Ud && opcode.takes_ud_address() {
            Some(take::<UdAddrSeg>(&mut rest, opcode, "UD address")?.parse()?)
        } else {
            None
        };
        let remote = |rest: &mut &[u8]| -> Result<RemoteAddr, WqeError> {
            take::<RemoteAddrSeg>(rest, opcode, "remote address")?.parse()
        };
        let atomic = |rest: &mut &[u8]| take::<AtomicSeg>(rest, opcode, "atomic");
        let imm = Be32::from_bytes(ctrl.imm);
        let key = RKey::new(u32::from_le_bytes(ctrl.imm));
        let op = match opcode {
            WqeOpcode::Nop => WqeOp::Nop,
            WqeOpcode::Send => WqeOp::Send,
            WqeOpcode::SendImm => WqeOp::SendImm { imm },
            WqeOpcode::SendInv => WqeOp::SendInv { rkey: key },
            WqeOpcode::RdmaWrite => WqeOp::RdmaWrite {
                remote: remote(&mut rest)?,
            },
            WqeOpcode::RdmaWriteImm => WqeOp::RdmaWriteImm {
                remote: remote(&mut rest)?,
                imm,
            },
            WqeOpcode::RdmaRead => WqeOp::RdmaRead {
                remote: remote(&mut rest)?,
            },
            WqeOpcode::AtomicCs => {
                let remote = remote(&mut rest)?;
                let seg = atomic(&mut rest)?;
                WqeOp::AtomicCs {
                    remote,
                    compare: seg.compare.get(),
                    swap: seg.swap_or_add.get(),
                }
            }
            WqeOpcode::AtomicFa => {
                let remote = remote(&mut rest)?;
                let seg = atomic(&mut rest)?;
                ensure_zero("AtomicSeg.compare (fetch and add)", seg.compare.as_bytes())?;
                WqeOp::AtomicFa {
                    remote,
                    add: seg.swap_or_add.get(),
                }
            }
            WqeOpcode::BindMw => {
                WqeOp::BindMw(take::<BindSeg>(&mut rest, opcode, "bind")?.parse()?)
            }
            WqeOpcode::LocalInv => WqeOp::LocalInv { key },
        };

        let payload = if flags.contains(WqeFlags::INLINE) {
            if !opcode.allows_inline() {
                return Err(WqeError::InlineNotAllowed { opcode });
            }
            Payload::Inline(parse_inline(rest, opcode)?)
        } else {
            // `rest` is a whole number of segments: `len` and every
            // segment taken so far are multiples of 16.
            let sges = <[Sge]>::ref_from_bytes(rest)
                .map_err(|_| WqeError::UnexpectedSegments { opcode })?;
            Payload::Data(sges)
        };
        let wqe = Self {
            wqe_index: found,
            flags,
            op,
            ud,
            payload,
        };
        wqe.check_shape()?;
        Ok(wqe)
    }
}

/// Builds a send WQE from a verbs work request into `out` and returns its
/// length in bytes (a multiple of 16): [`SendWqe::from_wr`] then
/// [`SendWqe::emit`].
pub fn build_send_wqe(
    wr: &SendWr<'_>,
    av: Option<&Av>,
    wqe_index: u16,
    inline: Option<&[u8]>,
    out: &mut [u8],
) -> Result<usize, WqeError> {
    SendWqe::from_wr(wr, av, wqe_index, inline)?.emit(out)
}

/// Bytes of a WQE word: [`PreparedSendWqe::emit_words`] writes whole
/// little-endian 64-bit words (segments are 16 bytes, so a WQE is whole
/// words).
const WORD: usize = 8;
/// The words of a send WQE an operation contributes after the control
/// segment (and the UD address): the remote address segment, then the
/// atomic segment, or the bind segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Operands {
    words: [u64; 4],
    count: usize,
}

impl Operands {
    const NONE: Self = Self {
        words: [0; 4],
        count: 0,
    };

    #[inline]
    const fn remote(remote: RemoteAddr) -> Self {
        Self {
            words: [remote.addr, remote.rkey.get() as u64, 0, 0],
            count: 2,
        }
    }

    #[inline]
    const fn atomic(remote: RemoteAddr, swap_or_add: u64, compare: u64) -> Self {
        Self {
            words: [remote.addr, remote.rkey.get() as u64, swap_or_add, compare],
            count: 4,
        }
    }

    #[inline]
    const fn bind(bind: &Bind) -> Self {
        Self {
            words: [
                bind.new_rkey.get() as u64 | (bind.mr_key.get() as u64) << 32,
                bind.va,
                bind.length,
                bind.access.bits() as u64 | (bind.mw_type.code() as u64) << 32,
            ],
            count: 4,
        }
    }

    /// The control segment's `imm` bytes and the operand words of `op`.
    #[inline]
    fn of(op: &WqeOp) -> ([u8; 4], Self) {
        let operands = match *op {
            WqeOp::AtomicCs {
                remote,
                compare,
                swap,
            } => Self::atomic(remote, swap, compare),
            WqeOp::AtomicFa { remote, add } => Self::atomic(remote, add, 0),
            WqeOp::BindMw(bind) => Self::bind(&bind),
            _ => match op.remote() {
                Some(remote) => Self::remote(remote),
                None => Self::NONE,
            },
        };
        (op.imm_bytes(), operands)
    }
}

/// A send WQE checked as [`SendWqe::emit`] checks it ([`SendWqe::prepared`],
/// or [`SendWqe::prepare`] straight from a work request), as the words it
/// emits: it emits with no second check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PreparedSendWqe<'a> {
    /// The control segment's first word (opcode, flags, `size16`,
    /// `wqe_index`).
    ctrl: u64,
    /// Its `imm` field as a little-endian value.
    imm: u32,
    /// The UD address: the AV and the word of the destination QP and
    /// Q_Key.
    ud: Option<(Av, u64)>,
    operands: Operands,
    payload: Payload<'a>,
    len: usize,
}

/// `bytes` (at most 8) as the low bytes of a little-endian word, zeros
/// above them.
#[inline]
fn partial_word(bytes: &[u8]) -> u64 {
    let n = bytes.len();
    if let (Some(low), Some(high)) = (bytes.first_chunk::<4>(), bytes.last_chunk::<4>()) {
        // 4 to 8 bytes: two 4-byte loads that overlap where they agree.
        u64::from(u32::from_le_bytes(*low)) | u64::from(u32::from_le_bytes(*high)) << (8 * (n - 4))
    } else {
        bytes
            .iter()
            .rev()
            .fold(0, |word, &byte| word << 8 | u64::from(byte))
    }
}

impl<'a> PreparedSendWqe<'a> {
    /// The WQE of these parts, its length checked against `size16`.
    // Always inlined, as `from_wr` and `emit_words`: a poster's prepared
    // WQE then lives in registers, never copied through memory.
    #[inline(always)]
    fn new(
        opcode: WqeOpcode,
        flags: WqeFlags,
        wqe_index: u16,
        imm: u32,
        ud: Option<(Av, u32, u32)>,
        operands: Operands,
        payload: Payload<'a>,
    ) -> Result<Self, WqeError> {
        let mut len = SEG_SIZE + operands.count * 8;
        if ud.is_some() {
            len += size_of::<UdAddrSeg>();
        }
        let len = len.saturating_add(payload.wqe_bytes());
        let size16 = u8::try_from(len / SEG_SIZE).map_err(|_| WqeError::TooLong { bytes: len })?;
        Ok(Self {
            ctrl: u64::from(opcode.code())
                | u64::from(flags.bits()) << 8
                | u64::from(size16) << 16
                | u64::from(wqe_index) << 32,
            imm,
            ud: ud.map(|(av, qpn, qkey)| (av, u64::from(qpn) | u64::from(qkey) << 32)),
            operands,
            payload,
            len,
        })
    }

    /// [`SendWqe::prepare`]: `SendWqe::from_wr`'s mapping and checks, then
    /// `emit`'s, with no `SendWqe` in between.
    #[inline(always)]
    fn from_wr(
        wr: &SendWr<'a>,
        av: Option<&Av>,
        wqe_index: u16,
        inline: Option<&'a [u8]>,
    ) -> Result<Self, WqeError> {
        let mut bind_access = None;
        let (opcode, imm, operands) = match wr.op {
            SendOp::Send => (WqeOpcode::Send, 0, Operands::NONE),
            SendOp::SendWithImm { imm } => (
                WqeOpcode::SendImm,
                u32::from_le_bytes(imm.to_bytes()),
                Operands::NONE,
            ),
            SendOp::SendWithInvalidate { rkey } => (WqeOpcode::SendInv, rkey.get(), Operands::NONE),
            SendOp::RdmaWrite { remote } => (WqeOpcode::RdmaWrite, 0, Operands::remote(remote)),
            SendOp::RdmaWriteWithImm { remote, imm } => (
                WqeOpcode::RdmaWriteImm,
                u32::from_le_bytes(imm.to_bytes()),
                Operands::remote(remote),
            ),
            SendOp::RdmaRead { remote } => (WqeOpcode::RdmaRead, 0, Operands::remote(remote)),
            SendOp::CompareSwap {
                remote,
                compare,
                swap,
            } => (
                WqeOpcode::AtomicCs,
                0,
                Operands::atomic(remote, swap, compare),
            ),
            SendOp::FetchAdd { remote, add } => {
                (WqeOpcode::AtomicFa, 0, Operands::atomic(remote, add, 0))
            }
            SendOp::BindMw { rkey, bind, .. } => {
                bind_access = Some(bind.access);
                let bind = Bind {
                    new_rkey: rkey,
                    mr_key: bind.mr_lkey,
                    va: bind.addr,
                    length: bind.length,
                    access: bind.access,
                    mw_type: MwType::Type2,
                };
                (WqeOpcode::BindMw, 0, Operands::bind(&bind))
            }
            SendOp::LocalInvalidate { rkey } => (WqeOpcode::LocalInv, rkey.get(), Operands::NONE),
        };
        // As `SendWqe::from_wr`.
        let ud = match (wr.ud, av) {
            (None, None) => None,
            (Some(dest), Some(av)) => Some((*av, dest.remote_qpn.get(), dest.remote_qkey.get())),
            _ => return Err(WqeError::AvMismatch),
        };
        let is_inline = wr.flags.contains(SendFlags::INLINE);
        let payload = Payload::of(wr, inline)?;
        // As `SendWqe::check_shape` (the INLINE flag matches the payload
        // by construction).
        if let Some((av, ..)) = &ud {
            if !opcode.takes_ud_address() {
                return Err(WqeError::UnexpectedUdAddress { opcode });
            }
            av.check()?;
        }
        if is_inline && !opcode.allows_inline() {
            return Err(WqeError::InlineNotAllowed { opcode });
        }
        if let Some(access) = bind_access {
            AccessFlags::from_raw(access.bits())?;
        }
        if let Payload::Data(sges) = payload {
            if !opcode.takes_data() && !sges.is_empty() {
                return Err(WqeError::UnexpectedSegments { opcode });
            }
            if opcode.is_atomic() && !matches!(sges, [one] if one.length.get() == 8) {
                return Err(WqeError::AtomicData);
            }
        }
        Self::new(
            opcode,
            WqeFlags::from_send_flags(wr.flags),
            wqe_index,
            imm,
            ud,
            operands,
            payload,
        )
    }

    /// Its length in bytes (a multiple of 16).
    #[inline]
    pub const fn byte_len(&self) -> usize {
        self.len
    }

    /// A bind's window type (a work request does not say it; the kernel
    /// and the UVP know it from `AllocMw`). Other WQEs are unchanged.
    pub fn set_bind_type(&mut self, mw_type: MwType) {
        if self.ctrl as u8 == WqeOpcode::BindMw.code() {
            let word = &mut self.operands.words[3];
            *word = (*word & 0xFFFF_FFFF) | u64::from(mw_type.code()) << 32;
        }
    }

    /// Writes the WQE as `store(index, word)` for each of its little-endian
    /// 64-bit words in ascending order: word `index` is bytes
    /// `8 * index..8 * index + 8` of what [`SendWqe::emit`] writes (it
    /// writes through this). Refused with nothing stored when the WQE is
    /// longer than `capacity` bytes. Returns its length. A poster stores
    /// the words straight into its ring, wrapping as it goes.
    #[inline(always)]
    pub fn emit_words(
        &self,
        capacity: usize,
        mut store: impl FnMut(usize, u64),
    ) -> Result<usize, WqeError> {
        let len = self.len;
        if len > capacity {
            return Err(WqeError::OutputTooSmall {
                needed: len,
                available: capacity,
            });
        }
        store(0, self.ctrl);
        store(1, u64::from(self.imm));
        let mut at = 2;
        let mut put = |word: u64| {
            store(at, word);
            at += 1;
        };
        if let Some((av, dest)) = &self.ud {
            for chunk in av.as_bytes().chunks_exact(WORD) {
                put(partial_word(chunk));
            }
            put(*dest);
            put(0);
        }
        for &word in &self.operands.words[..self.operands.count.min(4)] {
            put(word);
        }
        match self.payload {
            Payload::Data(sges) => {
                for sge in sges {
                    put(sge.addr.get());
                    put(u64::from(sge.length.get()) | u64::from(sge.lkey.get()) << 32);
                }
            }
            // `len` fits `size16`, so the data length fits 31 bits.
            Payload::Inline(data) => emit_inline_words(data, at, len / WORD, &mut store),
        }
        Ok(len)
    }
}

/// The longest inline data [`SendWqe::prepare_common`] takes: with a
/// remote address segment the WQE is then 255 segments, the most `size16`
/// counts, so a common WQE is never too long.
pub const COMMON_INLINE_MAX: usize = MAX_SEND_WQE_BYTES - 2 * SEG_SIZE - 4;

/// The payload of a [`CommonSendWqe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum CommonPayload<'a> {
    /// No data segment, or one as its two words (address; length and
    /// key): plain words, so the WQE lives in registers, not as the
    /// byte-aligned `Sge` copied through memory.
    Gather(Option<[u64; 2]>),
    /// Inline data (at most [`COMMON_INLINE_MAX`] bytes).
    Inline(&'a [u8]),
}

/// A send WQE of the common shapes (RC or UC SEND, SEND with immediate,
/// RDMA WRITE, RDMA WRITE with immediate; inline, or at most one data
/// segment), built by the specialised encoder [`SendWqe::prepare_common`]:
/// no UD address, bind or atomic operands to branch over, and no error
/// left to report. Its words are those [`SendWqe::prepare`] gives for the
/// same request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommonSendWqe<'a> {
    /// The control segment's first word (opcode, flags, `size16`,
    /// `wqe_index`).
    ctrl: u64,
    /// Its `imm` field as a little-endian value.
    imm: u32,
    /// The remote address segment's two words (RDMA WRITE).
    remote: Option<[u64; 2]>,
    payload: CommonPayload<'a>,
    len: usize,
    /// The message's length (the SGE's, none: 0), for the limits.
    message_len: u32,
}

impl<'a> SendWqe<'a> {
    /// The specialised encoder: the WQE of a request of a common shape —
    /// SEND, SEND with immediate, RDMA WRITE or RDMA WRITE with immediate,
    /// with no UD destination and no address vector, and either inline
    /// (INLINE, `inline` given, one SGE of the inline data's length, at
    /// most [`COMMON_INLINE_MAX`] bytes) or with at most one SGE (no
    /// INLINE, no `inline`). `None` for any other request, which
    /// [`prepare`](Self::prepare) handles (and refuses with its error when
    /// it is bad): a request of these shapes passes every check `prepare`
    /// makes, so this one makes none, and its words are `prepare`'s.
    #[inline(always)]
    pub fn prepare_common(
        wr: &SendWr<'a>,
        av: Option<&Av>,
        wqe_index: u16,
        inline: Option<&'a [u8]>,
    ) -> Option<CommonSendWqe<'a>> {
        if wr.ud.is_some() || av.is_some() {
            return None;
        }
        let (opcode, imm, remote) = match wr.op {
            SendOp::Send => (WqeOpcode::Send, 0, None),
            SendOp::SendWithImm { imm } => {
                (WqeOpcode::SendImm, u32::from_le_bytes(imm.to_bytes()), None)
            }
            SendOp::RdmaWrite { remote } => (WqeOpcode::RdmaWrite, 0, Some(remote)),
            SendOp::RdmaWriteWithImm { remote, imm } => (
                WqeOpcode::RdmaWriteImm,
                u32::from_le_bytes(imm.to_bytes()),
                Some(remote),
            ),
            _ => return None,
        };
        // The payload and the message's length (a common shape has at
        // most one SGE: its length is the message's).
        let (payload, message_len) =
            match (wr.flags.contains(SendFlags::INLINE), inline, wr.sg_list) {
                (true, Some(data), [sge])
                    if data.len() <= COMMON_INLINE_MAX
                        && sge.length.get() as usize == data.len() =>
                {
                    (CommonPayload::Inline(data), sge.length.get())
                }
                (false, None, []) => (CommonPayload::Gather(None), 0),
                (false, None, [sge]) => (
                    CommonPayload::Gather(Some([
                        sge.addr.get(),
                        u64::from(sge.length.get()) | u64::from(sge.lkey.get()) << 32,
                    ])),
                    sge.length.get(),
                ),
                _ => return None,
            };
        let mut len = SEG_SIZE;
        if remote.is_some() {
            len += size_of::<RemoteAddrSeg>();
        }
        len += match payload {
            CommonPayload::Gather(sge) => usize::from(sge.is_some()) * SEG_SIZE,
            // `inline_seg_len` without its overflow guard: the data is at
            // most COMMON_INLINE_MAX bytes.
            CommonPayload::Inline(data) => (data.len() + 4 + (SEG_SIZE - 1)) & !(SEG_SIZE - 1),
        };
        // At most 255 segments: COMMON_INLINE_MAX's bound.
        let size16 = (len / SEG_SIZE) as u8;
        Some(CommonSendWqe {
            ctrl: u64::from(opcode.code())
                | u64::from(WqeFlags::from_send_flags(wr.flags).bits()) << 8
                | u64::from(size16) << 16
                | u64::from(wqe_index) << 32,
            imm,
            remote: remote.map(|r| [r.addr, u64::from(r.rkey.get())]),
            payload,
            len,
            message_len,
        })
    }

    /// [`prepare_common`](Self::prepare_common) of a request that
    /// [`SendWr::validate`] also accepts on a QP of `transport` with
    /// `limits`, checking only what a request of a common shape can still
    /// break: the transport (a common shape names no UD destination, so a
    /// UD QP refuses it), the SGE count, the message length and the inline
    /// limit. `None` for any other request, which a poster validates and
    /// encodes the general way (so every refusal keeps its error).
    #[inline(always)]
    pub fn prepare_common_valid(
        wr: &SendWr<'a>,
        av: Option<&Av>,
        wqe_index: u16,
        inline: Option<&'a [u8]>,
        transport: Transport,
        limits: &WrLimits,
    ) -> Option<CommonSendWqe<'a>> {
        let wqe = Self::prepare_common(wr, av, wqe_index, inline)?;
        // Inline data is at most COMMON_INLINE_MAX bytes, under the
        // message limit: its one bound is the QP's inline limit.
        const _: () = assert!(COMMON_INLINE_MAX <= MAX_MESSAGE_LEN as usize);
        let max_len = match wqe.payload {
            CommonPayload::Inline(_) => limits.max_inline,
            CommonPayload::Gather(_) => MAX_MESSAGE_LEN,
        };
        let valid = transport != Transport::Ud
            && wr.sg_list.len() <= limits.max_sge as usize
            && wqe.message_len <= max_len;
        valid.then_some(wqe)
    }
}

impl CommonSendWqe<'_> {
    /// Its length in bytes (a multiple of 16, at most
    /// [`MAX_SEND_WQE_BYTES`]).
    #[inline]
    pub const fn byte_len(&self) -> usize {
        self.len
    }

    /// Writes the WQE as `store(index, word)` for each of its
    /// little-endian 64-bit words in ascending order, as
    /// [`PreparedSendWqe::emit_words`] does, with no room check: the
    /// caller has checked [`byte_len`](Self::byte_len) against its room.
    #[inline(always)]
    pub fn emit_words(&self, mut store: impl FnMut(usize, u64)) {
        store(0, self.ctrl);
        store(1, u64::from(self.imm));
        let mut at = 2;
        if let Some([addr, rkey]) = self.remote {
            store(2, addr);
            store(3, rkey);
            at = 4;
        }
        match self.payload {
            CommonPayload::Gather(None) => {}
            CommonPayload::Gather(Some([addr, len_key])) => {
                store(at, addr);
                store(at + 1, len_key);
            }
            CommonPayload::Inline(data) => emit_inline_words(data, at, self.len / WORD, &mut store),
        }
    }
}

/// The words of an inline segment of `data` (under 2^31 bytes: a WQE's
/// `size16` bounds it) as `store(at + k, word)`, each once in ascending
/// order, the segment ending at word `end` (the WQE's last: the inline
/// segment is always last): the header and the first 4 bytes, each whole
/// word loaded at its fixed offset, the last 1 to 8 bytes as the data's
/// last word shifted down (no branch on how many), the padding.
#[inline(always)]
fn emit_inline_words(data: &[u8], at: usize, end: usize, store: &mut impl FnMut(usize, u64)) {
    let n = data.len();
    let header = u64::from(n as u32 | INLINE_BIT);
    let (Some(head), Some(last)) = (data.first_chunk::<4>(), data.last_chunk::<WORD>()) else {
        // Under 8 bytes: the header's word, then at most one more.
        let (head, rest) = data.split_at(n.min(4));
        store(at, header | partial_word(head) << 32);
        store(at + 1, partial_word(rest));
        return;
    };
    store(at, header | u64::from(u32::from_le_bytes(*head)) << 32);
    // The words after the header's: all whole but the last, which holds
    // the data's last 1 to 8 bytes. `data[4..n - 1]` has exactly the
    // whole ones (n >= 8).
    let (whole, _) = data[4..n - 1].as_chunks::<WORD>();
    // Up to 64 bytes (at most seven whole words), the words at fixed
    // offsets with no loop; longer data in a loop.
    match whole.len() {
        0 => {}
        1 => store_whole_words::<1>(whole, at + 1, store),
        2 => store_whole_words::<2>(whole, at + 1, store),
        3 => store_whole_words::<3>(whole, at + 1, store),
        4 => store_whole_words::<4>(whole, at + 1, store),
        5 => store_whole_words::<5>(whole, at + 1, store),
        6 => store_whole_words::<6>(whole, at + 1, store),
        7 => store_whole_words::<7>(whole, at + 1, store),
        _ => {
            for (k, word) in whole.iter().enumerate() {
                store(at + 1 + k, u64::from_le_bytes(*word));
            }
        }
    }
    let next = at + 1 + whole.len();
    let in_last = n + WORD - 4 - (next - at) * WORD;
    store(next, u64::from_le_bytes(*last) >> (8 * (WORD - in_last)));
    // The segment's padding: at most one word, when the data ends in the
    // first half of its last 16 bytes.
    if next + 1 < end {
        store(next + 1, 0);
    }
}

/// The first `N` of `words` (which holds at least `N`) as
/// `store(at + k, word)`: `N` known, the loads and stores at fixed
/// offsets.
#[inline(always)]
fn store_whole_words<const N: usize>(
    words: &[[u8; WORD]],
    at: usize,
    store: &mut impl FnMut(usize, u64),
) {
    if let Some(words) = words.first_chunk::<N>() {
        for (k, word) in words.iter().enumerate() {
            store(at + k, u64::from_le_bytes(*word));
        }
    }
}

/// Sequential writer over an output slice whose length was checked first.
struct Writer<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) {
        let end = self.at + bytes.len();
        self.out[self.at..end].copy_from_slice(bytes);
        self.at = end;
    }

    fn zero_rest(&mut self) {
        self.out[self.at..].fill(0);
        self.at = self.out.len();
    }
}

/// Data segments a receive WQE of `stride` bytes holds (at most 255, the
/// range of `num_sges`).
pub const fn recv_sges_per_stride(stride: usize) -> usize {
    let fit = stride.saturating_sub(size_of::<RecvHeader>()) / SEG_SIZE;
    if fit > u8::MAX as usize {
        u8::MAX as usize
    } else {
        fit
    }
}

/// A validated receive WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RecvWqe<'a> {
    /// Low 16 bits of the receive producer counter at this WQE.
    pub wqe_index: u16,
    /// The scatter list (zero-length entries are skipped by the device).
    pub sges: &'a [Sge],
}

impl<'a> RecvWqe<'a> {
    /// Parses the receive WQE in `bytes` (one stride). Bytes after the
    /// `num_sges` data segments are not looked at (a slot may hold stale
    /// segments of an earlier, longer WQE).
    pub fn parse(bytes: &'a [u8], expected_index: u16) -> Result<Self, WqeError> {
        let (header, rest) =
            RecvHeader::ref_from_prefix(bytes).map_err(|_| WqeError::Truncated {
                needed: size_of::<RecvHeader>(),
                available: bytes.len(),
            })?;
        let found = header.wqe_index.get();
        if found != expected_index {
            return Err(WqeError::IndexMismatch {
                expected: expected_index,
                found,
            });
        }
        ensure_zero("RecvHeader.reserved_at_0x1", &[header.reserved_at_0x1])?;
        ensure_zero("RecvHeader.reserved_at_0x4", &header.reserved_at_0x4)?;
        let count = usize::from(header.num_sges);
        let (sges, _) = <[Sge]>::ref_from_prefix_with_elems(rest, count).map_err(|_| {
            WqeError::TooManySges {
                count,
                fit: rest.len() / SEG_SIZE,
            }
        })?;
        Ok(Self {
            wqe_index: found,
            sges,
        })
    }

    /// Writes the WQE as one whole stride into the front of `out` (the tail
    /// zeroed). `stride` must be a power of two of at least
    /// [`MIN_RECV_STRIDE`].
    pub fn emit(&self, stride: usize, out: &mut [u8]) -> Result<(), WqeError> {
        if !stride.is_power_of_two() || stride < MIN_RECV_STRIDE {
            return Err(WqeError::BadStride { stride });
        }
        let fit = recv_sges_per_stride(stride);
        let count = self.sges.len();
        let num_sges = match u8::try_from(count) {
            Ok(n) if count <= fit => n,
            _ => return Err(WqeError::TooManySges { count, fit }),
        };
        let available = out.len();
        let out = out.get_mut(..stride).ok_or(WqeError::OutputTooSmall {
            needed: stride,
            available,
        })?;
        let mut w = Writer { out, at: 0 };
        w.put(
            RecvHeader {
                num_sges,
                wqe_index: Le16::new(self.wqe_index),
                ..RecvHeader::default()
            }
            .as_bytes(),
        );
        w.put(self.sges.as_bytes());
        w.zero_rest();
        Ok(())
    }
}

/// Builds a receive WQE into the first `stride` bytes of `out`:
/// [`RecvWqe::emit`].
pub fn build_recv_wqe(
    sges: &[Sge],
    wqe_index: u16,
    stride: usize,
    out: &mut [u8],
) -> Result<(), WqeError> {
    RecvWqe { wqe_index, sges }.emit(stride, out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::av::tests::any_av;
    use ib_types::handle::{AvHandle, MwHandle};
    use ib_types::scalars::Gid;
    use ib_types::wr::{MwBind, UdDest};
    use proptest::collection::vec;
    use proptest::prelude::*;

    /// A way to damage a valid value, and what the damage is.
    type Corruption<T> = (fn(&mut T), &'static str);

    const KEY: LKey = LKey::new(0x0000_1201);
    const REMOTE: RemoteAddr = RemoteAddr {
        addr: 0x1122_3344_5566_7788,
        rkey: RKey::new(0xAABB_CC01),
    };

    fn wr<'a>(op: SendOp, flags: SendFlags, sg_list: &'a [Sge]) -> SendWr<'a> {
        SendWr {
            wr_id: 1,
            op,
            flags,
            sg_list,
            ud: None,
        }
    }

    /// Every inline length the specialised encoder takes, each of its
    /// operations (with and without a remote address segment): its words
    /// parse back (by the device's parser, not the encoder) to the same
    /// data with zero padding, and equal the general encoder's. The
    /// inline words are loaded at fixed offsets, the last 1 to 8 bytes as
    /// one shifted word: each length puts the data's end at another place.
    #[test]
    fn every_inline_length_encodes_and_parses_back() {
        let pattern: Vec<u8> = (0..COMMON_INLINE_MAX).map(|i| (i * 7 + 1) as u8).collect();
        for op in [SendOp::Send, SendOp::RdmaWrite { remote: REMOTE }] {
            for n in 0..=COMMON_INLINE_MAX {
                let data = &pattern[..n];
                let sge = [Sge::new(0x4000, n as u32, KEY)];
                let wr = wr(op, SendFlags::INLINE | SendFlags::SIGNALED, &sge);
                let wqe = SendWqe::prepare_common(&wr, None, 9, Some(data))
                    .unwrap_or_else(|| panic!("{n} bytes inline are a common shape"));
                let mut bytes = Vec::new();
                wqe.emit_words(|i, word| {
                    assert_eq!(i, bytes.len() / 8, "{n} bytes: words in order, each once");
                    bytes.extend_from_slice(&word.to_le_bytes());
                });
                assert_eq!(bytes.len(), wqe.byte_len(), "{n} bytes");
                let parsed = SendWqe::parse(&bytes, 9, Transport::Rc)
                    .unwrap_or_else(|e| panic!("{n} bytes: {e:?}"));
                assert_eq!(parsed.payload, Payload::Inline(data), "{n} bytes");
                let mut general = vec![0; MAX_SEND_WQE_BYTES];
                let len = build_send_wqe(&wr, None, 9, Some(data), &mut general).unwrap();
                assert_eq!(bytes, general[..len], "{n} bytes");
            }
        }
    }

    fn ud_av() -> Av {
        Av {
            port: 1,
            hop_limit: 64,
            dgid: Gid::from_ipv4([10, 0, 0, 9]),
            ..Av::default()
        }
    }

    #[test]
    fn data_segment_is_the_sge_layout() {
        let seg = DataSeg::new(0x0102_0304_0506_0708, 0x40, LKey::new(0x0A0B_0C0D));
        assert_eq!(
            seg.as_bytes(),
            &[
                8, 7, 6, 5, 4, 3, 2, 1, 0x40, 0, 0, 0, 0x0D, 0x0C, 0x0B, 0x0A
            ]
        );
    }

    #[test]
    fn rdma_write_imm_image() {
        let sges = [
            Sge::new(0x1000, 0x40, KEY),
            Sge::new(0x2000, 0, LKey::new(0x0000_3402)),
        ];
        let op = SendOp::RdmaWriteWithImm {
            remote: REMOTE,
            imm: Be32::new(0xDEAD_BEEF),
        };
        let wr = wr(op, SendFlags::SIGNALED | SendFlags::FENCE, &sges);
        let mut out = [0xEE; 128];
        assert_eq!(build_send_wqe(&wr, None, 0x1234, None, &mut out), Ok(64));
        #[rustfmt::skip]
        let expected: [u8; 64] = [
            // control: opcode, flags (SIGNALED | FENCE), size16, rsvd,
            // wqe_index LE, rsvd, imm (network order), rsvd
            0x05, 0x05, 0x04, 0x00, 0x34, 0x12, 0, 0, 0xDE, 0xAD, 0xBE, 0xEF, 0, 0, 0, 0,
            // remote address: va, rkey, rsvd
            0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0x01, 0xCC, 0xBB, 0xAA, 0, 0, 0, 0,
            // data: addr, length, lkey
            0x00, 0x10, 0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0, 0x01, 0x12, 0, 0,
            0x00, 0x20, 0, 0, 0, 0, 0, 0, 0x00, 0, 0, 0, 0x02, 0x34, 0, 0,
        ];
        assert_eq!(&out[..64], &expected);
        assert_eq!(out[64], 0xEE, "nothing is written past the WQE");
        let wqe = SendWqe::parse(&out, 0x1234, Transport::Rc).unwrap();
        assert_eq!(
            wqe,
            SendWqe {
                wqe_index: 0x1234,
                flags: WqeFlags::SIGNALED | WqeFlags::FENCE,
                op: WqeOp::RdmaWriteImm {
                    remote: REMOTE,
                    imm: Be32::new(0xDEAD_BEEF)
                },
                ud: None,
                payload: Payload::Data(&sges),
            }
        );
        assert_eq!(basic_blocks(64), 1);
    }

    #[test]
    fn ud_send_inline_image() {
        let sges = [Sge::new(0x5000, 5, KEY)];
        let mut wr = wr(
            SendOp::SendWithImm {
                imm: Be32::from_bytes([1, 2, 3, 4]),
            },
            SendFlags::INLINE | SendFlags::SOLICITED,
            &sges,
        );
        wr.ud = Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(0x42).unwrap(),
            remote_qkey: QKey::new(0x8001_0000),
        });
        let av = ud_av();
        let mut out = [0xEE; 128];
        let n = build_send_wqe(&wr, Some(&av), 7, Some(b"hello"), &mut out).unwrap();
        assert_eq!(n, 80);
        let mut expected = [0u8; 80];
        expected[..16].copy_from_slice(&[0x02, 0x0A, 0x05, 0, 7, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0]);
        expected[16..48].copy_from_slice(av.as_bytes());
        expected[48..56].copy_from_slice(&[0x42, 0, 0, 0, 0x00, 0x00, 0x01, 0x80]);
        expected[64..73].copy_from_slice(&[5, 0, 0, 0x80, b'h', b'e', b'l', b'l', b'o']);
        assert_eq!(&out[..80], &expected);
        assert_eq!(basic_blocks(n), 2);

        let wqe = SendWqe::parse(&out[..n], 7, Transport::Ud).unwrap();
        assert_eq!(wqe.payload, Payload::Inline(b"hello"));
        assert_eq!(
            wqe.ud,
            Some(UdAddress {
                av,
                dest_qpn: Qpn::new(0x42).unwrap(),
                qkey: QKey::new(0x8001_0000),
            })
        );
        // On a connected QP the same bytes are a send with trailing junk.
        assert!(SendWqe::parse(&out[..n], 7, Transport::Rc).is_err());
    }

    #[test]
    fn atomic_bind_and_invalidate_images() {
        let result = [Sge::new(0x9000, 8, KEY)];
        let cs = SendOp::CompareSwap {
            remote: REMOTE,
            compare: 0x0102_0304_0506_0708,
            swap: 0x1112_1314_1516_1718,
        };
        let mut out = [0; 64];
        assert_eq!(
            build_send_wqe(
                &wr(cs, SendFlags::empty(), &result),
                None,
                0,
                None,
                &mut out
            ),
            Ok(64)
        );
        assert_eq!(&out[..4], &[0x07, 0x00, 0x04, 0x00]);
        #[rustfmt::skip]
        assert_eq!(&out[32..48], &[
            0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11, // swap_or_add
            0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // compare
        ]);

        let bind = SendOp::BindMw {
            mw: MwHandle::from_raw(3),
            rkey: RKey::new(0x0000_0502),
            bind: MwBind {
                mr_lkey: LKey::new(0x0000_0701),
                addr: 0x1000,
                length: 0x2000,
                access: AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
            },
        };
        let mut out = [0; 48];
        assert_eq!(
            build_send_wqe(&wr(bind, SendFlags::SIGNALED, &[]), None, 9, None, &mut out),
            Ok(48)
        );
        #[rustfmt::skip]
        assert_eq!(&out, &[
            0x09, 0x01, 0x03, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0x02, 0x05, 0, 0, 0x01, 0x07, 0, 0,             // new_rkey, mr_key
            0x00, 0x10, 0, 0, 0, 0, 0, 0,                   // va
            0x00, 0x20, 0, 0, 0, 0, 0, 0,                   // length
            0x06, 0, 0, 0, 0x02, 0, 0, 0,                   // access, mw_type 2, rsvd
        ]);

        let inval = SendOp::LocalInvalidate {
            rkey: RKey::new(0x1234_5678),
        };
        let mut out = [0; 16];
        assert_eq!(
            build_send_wqe(&wr(inval, SendFlags::empty(), &[]), None, 0, None, &mut out),
            Ok(16)
        );
        assert_eq!(
            &out,
            &[
                0x0A, 0, 1, 0, 0, 0, 0, 0, 0x78, 0x56, 0x34, 0x12, 0, 0, 0, 0
            ]
        );
        let wqe = SendWqe::parse(&out, 0, Transport::Uc).unwrap();
        assert_eq!(
            wqe.op,
            WqeOp::LocalInv {
                key: RKey::new(0x1234_5678)
            }
        );
    }

    /// A valid RC compare-and-swap WQE (64 bytes) at index 0x0102.
    fn cs_bytes() -> [u8; 64] {
        let result = [Sge::new(0x9000, 8, KEY)];
        let op = SendOp::CompareSwap {
            remote: REMOTE,
            compare: 1,
            swap: 2,
        };
        let mut out = [0; 64];
        build_send_wqe(
            &wr(op, SendFlags::SIGNALED, &result),
            None,
            0x0102,
            None,
            &mut out,
        )
        .unwrap();
        out
    }

    /// A valid RC inline SEND of "hello" (32 bytes) at index 0x0102.
    fn inline_bytes() -> [u8; 32] {
        let sges = [Sge::new(0, 5, KEY)];
        let mut out = [0; 32];
        let wr = wr(SendOp::Send, SendFlags::INLINE, &sges);
        build_send_wqe(&wr, None, 0x0102, Some(b"hello"), &mut out).unwrap();
        out
    }

    fn is_abi(e: WqeError) -> bool {
        matches!(e, WqeError::Abi(_))
    }

    #[test]
    fn garbage_is_rejected() {
        use WqeError as E;
        type Case = (
            &'static str,
            fn(&mut Vec<u8>),
            Transport,
            fn(WqeError) -> bool,
        );
        #[rustfmt::skip]
        let cs_cases: &[Case] = &[
            ("valid", |_| {}, Transport::Rc, |_| false),
            ("wrong index", |b| b[4] = 3, Transport::Rc, |e| e == E::IndexMismatch { expected: 0x0102, found: 0x0103 }),
            ("size16 0", |b| b[2] = 0, Transport::Rc, |e| e == E::ZeroSize),
            ("size16 past the bytes", |b| b[2] = 5, Transport::Rc, |e| e == E::Truncated { needed: 80, available: 64 }),
            ("ctrl reserved 0x3", |b| b[3] = 1, Transport::Rc, is_abi),
            ("ctrl reserved 0x6", |b| b[7] = 1, Transport::Rc, is_abi),
            ("ctrl reserved 0xc", |b| b[15] = 1, Transport::Rc, is_abi),
            ("unknown flag", |b| b[1] |= 0x10, Transport::Rc, is_abi),
            ("unknown opcode", |b| b[0] = 0x0B, Transport::Rc, is_abi),
            ("atomic on UC", |_| {}, Transport::Uc, |e| matches!(e, E::OpcodeNotAllowed { .. })),
            ("atomic on UD", |_| {}, Transport::Ud, |e| matches!(e, E::OpcodeNotAllowed { .. })),
            ("unused imm set", |b| b[8] = 1, Transport::Rc, is_abi),
            ("no remote", |b| b[2] = 1, Transport::Rc, |e| matches!(e, E::MissingSegment { segment: "remote address", .. })),
            ("no atomic", |b| b[2] = 2, Transport::Rc, |e| matches!(e, E::MissingSegment { segment: "atomic", .. })),
            ("no data", |b| b[2] = 3, Transport::Rc, |e| e == E::AtomicData),
            ("two data", |b| { b[2] = 5; b.extend_from_slice(&[0; 16]) }, Transport::Rc, |e| e == E::AtomicData),
            ("4-byte data", |b| b[56] = 4, Transport::Rc, |e| e == E::AtomicData),
            ("remote reserved", |b| b[31] = 1, Transport::Rc, is_abi),
            ("inline atomic", |b| b[1] |= 0x08, Transport::Rc, |e| matches!(e, E::InlineNotAllowed { .. })),
        ];
        for (what, corrupt, transport, expect) in cs_cases {
            let mut bytes = cs_bytes().to_vec();
            corrupt(&mut bytes);
            match SendWqe::parse(&bytes, 0x0102, *transport) {
                Ok(_) => assert_eq!(*what, "valid", "{what} must be rejected"),
                Err(e) => assert!(expect(e), "{what}: unexpected {e:?}"),
            }
        }

        #[rustfmt::skip]
        let inline_cases: &[Case] = &[
            ("valid", |_| {}, Transport::Rc, |_| false),
            ("no inline bit", |b| b[19] = 0, Transport::Rc, |e| e == E::InlineHeader { header: 5 }),
            ("too long", |b| b[16] = 13, Transport::Rc, |e| e == E::InlineLength { length: 13, available: 12 }),
            ("padding set", |b| b[31] = 1, Transport::Rc, is_abi),
            ("shorter than the segment", |b| b[16] = 1, Transport::Rc, is_abi),
            ("segment after it", |b| { b[2] = 3; b.extend_from_slice(&[0; 16]) }, Transport::Rc, |e| matches!(e, E::UnexpectedSegments { .. })),
            ("flag without segment", |b| b[2] = 1, Transport::Rc, |e| matches!(e, E::MissingSegment { segment: "inline", .. })),
            ("UD without address", |_| {}, Transport::Ud, |e| matches!(e, E::MissingSegment { segment: "UD address", .. })),
            ("inline read", |b| { b[0] = 6; }, Transport::Rc, |e| matches!(e, E::InlineNotAllowed { .. })),
            ("nop with data", |b| { b[0] = 0; b[1] = 0; }, Transport::Rc, |e| matches!(e, E::UnexpectedSegments { .. })),
        ];
        for (what, corrupt, transport, expect) in inline_cases {
            let mut bytes = inline_bytes().to_vec();
            corrupt(&mut bytes);
            match SendWqe::parse(&bytes, 0x0102, *transport) {
                Ok(_) => assert_eq!(*what, "valid", "{what} must be rejected"),
                Err(e) => assert!(expect(e), "{what}: unexpected {e:?}"),
            }
        }

        assert_eq!(
            SendWqe::parse(&[0; 15], 0, Transport::Rc),
            Err(E::Truncated {
                needed: 16,
                available: 15
            })
        );
    }

    #[test]
    fn bad_bind_and_ud_segments() {
        let bind = SendOp::BindMw {
            mw: MwHandle::from_raw(3),
            rkey: RKey::new(0x0502),
            bind: MwBind {
                mr_lkey: KEY,
                addr: 0,
                length: 0,
                access: AccessFlags::REMOTE_READ,
            },
        };
        let mut good = [0; 48];
        build_send_wqe(&wr(bind, SendFlags::empty(), &[]), None, 0, None, &mut good).unwrap();
        let cases: &[Corruption<[u8; 48]>] = &[
            (|b| b[44] = 3, "window type 3"),
            (|b| b[44] = 0, "window type 0"),
            (|b| b[41] = 1, "unknown access bit"),
            (|b| b[47] = 1, "reserved"),
        ];
        for (corrupt, what) in cases {
            let mut bytes = good;
            corrupt(&mut bytes);
            assert!(
                matches!(
                    SendWqe::parse(&bytes, 0, Transport::Rc),
                    Err(WqeError::Abi(_))
                ),
                "{what}"
            );
        }
        good[44] = 1;
        let wqe = SendWqe::parse(&good, 0, Transport::Rc).unwrap();
        assert!(matches!(
            wqe.op,
            WqeOp::BindMw(Bind {
                mw_type: MwType::Type1,
                ..
            })
        ));

        let mut wr = wr(SendOp::Send, SendFlags::empty(), &[]);
        wr.ud = Some(UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(5).unwrap(),
            remote_qkey: QKey::new(1),
        });
        let mut good = [0; 64];
        build_send_wqe(&wr, Some(&ud_av()), 0, None, &mut good).unwrap();
        assert!(SendWqe::parse(&good, 0, Transport::Ud).is_ok());
        let cases: &[Corruption<[u8; 64]>] = &[
            (|b| b[16 + 0x23] = 1, "QPN over 24 bits"),
            (|b| b[16 + 0x05] = 1, "AV reserved"),
            (|b| b[16 + 0x0A] = 0x10, "flow label over 20 bits"),
            (|b| b[16 + 0x2F] = 1, "UD reserved"),
        ];
        for (corrupt, what) in cases {
            let mut bytes = good;
            corrupt(&mut bytes);
            assert!(
                matches!(
                    SendWqe::parse(&bytes, 0, Transport::Ud),
                    Err(WqeError::Abi(_))
                ),
                "{what}"
            );
        }
        let fa = SendOp::FetchAdd {
            remote: REMOTE,
            add: 1,
        };
        let mut bytes = [0; 64];
        let sges = [Sge::new(0, 8, KEY)];
        build_send_wqe(&wr_fa(fa, &sges), None, 0, None, &mut bytes).unwrap();
        assert!(SendWqe::parse(&bytes, 0, Transport::Rc).is_ok());
        bytes[40] = 1;
        assert!(matches!(
            SendWqe::parse(&bytes, 0, Transport::Rc),
            Err(WqeError::Abi(AbiError::ReservedNotZero { .. }))
        ));
    }

    fn wr_fa<'a>(op: SendOp, sges: &'a [Sge]) -> SendWr<'a> {
        wr(op, SendFlags::empty(), sges)
    }

    #[test]
    fn builder_errors() {
        use WqeError as E;
        let data = [Sge::new(0, 4, KEY)];
        let two = [Sge::new(0, 4, KEY), Sge::new(4, 4, KEY)];
        let av = ud_av();
        let dest = UdDest {
            av: AvHandle::from_raw(1),
            remote_qpn: Qpn::new(5).unwrap(),
            remote_qkey: QKey::new(1),
        };
        let mut out = [0; 4096];
        let read = SendOp::RdmaRead { remote: REMOTE };
        let write = SendOp::RdmaWrite { remote: REMOTE };
        let fa = SendOp::FetchAdd {
            remote: REMOTE,
            add: 1,
        };
        let inval = SendOp::LocalInvalidate { rkey: RKey::new(1) };
        let with_ud = |mut w: SendWr<'static>| {
            w.ud = Some(dest);
            w
        };
        type Case<'a> = (
            &'a str,
            SendWr<'a>,
            Option<&'a Av>,
            Option<&'a [u8]>,
            WqeError,
        );
        #[rustfmt::skip]
        let cases: &[Case<'_>] = &[
            ("AV without destination", wr(SendOp::Send, SendFlags::empty(), &data), Some(&av), None, E::AvMismatch),
            ("destination without AV", with_ud(wr(SendOp::Send, SendFlags::empty(), &[])), None, None, E::AvMismatch),
            ("UD address on a write", with_ud(wr(write, SendFlags::empty(), &[])), Some(&av), None,
                E::UnexpectedUdAddress { opcode: WqeOpcode::RdmaWrite }),
            ("INLINE without bytes", wr(SendOp::Send, SendFlags::INLINE, &data), None, None,
                E::InlineData { inline: None, sge_total: Some(4) }),
            ("inline length differs", wr(SendOp::Send, SendFlags::INLINE, &data), None, Some(b"abc"),
                E::InlineData { inline: Some(3), sge_total: Some(4) }),
            ("bytes without INLINE", wr(SendOp::Send, SendFlags::empty(), &data), None, Some(b"abcd"),
                E::InlineData { inline: Some(4), sge_total: None }),
            ("inline read", wr(read, SendFlags::INLINE, &data), None, Some(b"abcd"),
                E::InlineNotAllowed { opcode: WqeOpcode::RdmaRead }),
            ("atomic over two SGEs", wr(fa, SendFlags::empty(), &two), None, None, E::AtomicData),
            ("atomic, no SGE", wr(fa, SendFlags::empty(), &[]), None, None, E::AtomicData),
            ("invalidate with SGE", wr(inval, SendFlags::empty(), &data), None, None,
                E::UnexpectedSegments { opcode: WqeOpcode::LocalInv }),
        ];
        for (what, wr, av, inline, want) in cases {
            assert_eq!(
                build_send_wqe(wr, *av, 0, *inline, &mut out),
                Err(*want),
                "{what}"
            );
        }

        let many = [Sge::new(0, 1, KEY); 255];
        assert_eq!(
            build_send_wqe(
                &wr(SendOp::Send, SendFlags::empty(), &many[..254]),
                None,
                0,
                None,
                &mut out
            ),
            Ok(MAX_SEND_WQE_BYTES)
        );
        assert_eq!(
            build_send_wqe(
                &wr(SendOp::Send, SendFlags::empty(), &many),
                None,
                0,
                None,
                &mut out
            ),
            Err(E::TooLong { bytes: 4096 })
        );
        assert_eq!(
            build_send_wqe(
                &wr(SendOp::Send, SendFlags::empty(), &data),
                None,
                0,
                None,
                &mut out[..16]
            ),
            Err(E::OutputTooSmall {
                needed: 32,
                available: 16
            })
        );
        let bad_av = Av { sl: 16, ..av };
        assert!(matches!(
            build_send_wqe(
                &with_ud(wr(SendOp::Send, SendFlags::empty(), &[])),
                Some(&bad_av),
                0,
                None,
                &mut out
            ),
            Err(E::Abi(_))
        ));
        // The view keeps INLINE and the payload in step.
        let wqe = SendWqe {
            wqe_index: 0,
            flags: WqeFlags::INLINE,
            op: WqeOp::Send,
            ud: None,
            payload: Payload::Data(&[]),
        };
        assert_eq!(wqe.emit(&mut out), Err(E::InlineFlagMismatch));
        let bind = WqeOp::BindMw(Bind {
            new_rkey: RKey::new(1),
            mr_key: KEY,
            va: 0,
            length: 0,
            access: AccessFlags::from_bits_retain(0x100),
            mw_type: MwType::Type1,
        });
        let wqe = SendWqe {
            flags: WqeFlags::empty(),
            op: bind,
            ..wqe
        };
        assert!(matches!(wqe.emit(&mut out), Err(E::Abi(_))));
    }

    #[test]
    fn opcode_mapping_and_transports() {
        for &op in WrOpcode::ALL {
            let wqe = WqeOpcode::from_wr(op);
            assert_eq!(wqe.to_wr(), Some(op));
            for &t in Transport::ALL {
                assert_eq!(wqe.is_allowed_on(t), op.is_supported_on(t));
            }
            assert_eq!(wqe.allows_inline(), op.allows_inline());
            assert_eq!(wqe.takes_data(), !op.is_memory_op());
            assert_eq!(wqe.is_atomic(), op.is_atomic());
        }
        assert_eq!(WqeOpcode::Nop.to_wr(), None);
        assert!(
            Transport::ALL
                .iter()
                .all(|&t| WqeOpcode::Nop.is_allowed_on(t))
        );
        for (i, &op) in WqeOpcode::ALL.iter().enumerate() {
            assert_eq!(usize::from(op.code()), i);
            assert_eq!(WqeOpcode::try_from(op.code()), Ok(op));
        }
        assert!(WqeOpcode::from_code(0x0B).is_err());
        assert_eq!(WqeFlags::from_send_flags(SendFlags::all()), WqeFlags::all());
        assert_eq!(WqeFlags::from_send_flags(SendFlags::FENCE), WqeFlags::FENCE);
    }

    #[test]
    fn recv_image_and_errors() {
        let sges = [Sge::new(0x1000, 0x100, KEY), Sge::new(0x2000, 0x28, KEY)];
        let mut out = [0xEE; 64];
        build_recv_wqe(&sges, 0xBEEF, 64, &mut out).unwrap();
        let mut expected = [0u8; 64];
        expected[..4].copy_from_slice(&[2, 0, 0xEF, 0xBE]);
        expected[16..48].copy_from_slice(sges.as_bytes());
        assert_eq!(out, expected);
        assert_eq!(
            RecvWqe::parse(&out, 0xBEEF),
            Ok(RecvWqe {
                wqe_index: 0xBEEF,
                sges: &sges
            })
        );

        use WqeError as E;
        assert_eq!(
            build_recv_wqe(&[], 0, 48, &mut out),
            Err(E::BadStride { stride: 48 })
        );
        assert_eq!(
            build_recv_wqe(&[], 0, 16, &mut out),
            Err(E::BadStride { stride: 16 })
        );
        assert_eq!(
            build_recv_wqe(&[sges[0]; 4], 0, 64, &mut out),
            Err(E::TooManySges { count: 4, fit: 3 })
        );
        assert_eq!(
            build_recv_wqe(&[], 0, 128, &mut out),
            Err(E::OutputTooSmall {
                needed: 128,
                available: 64
            })
        );
        assert_eq!(recv_sges_per_stride(32), 1);
        assert_eq!(recv_sges_per_stride(1 << 16), 255);

        assert_eq!(
            RecvWqe::parse(&out, 0xBEEE),
            Err(E::IndexMismatch {
                expected: 0xBEEE,
                found: 0xBEEF
            })
        );
        let mut bad = out;
        bad[0] = 4;
        assert_eq!(
            RecvWqe::parse(&bad, 0xBEEF),
            Err(E::TooManySges { count: 4, fit: 3 })
        );
        let mut bad = out;
        bad[1] = 1;
        assert!(matches!(RecvWqe::parse(&bad, 0xBEEF), Err(E::Abi(_))));
        let mut bad = out;
        bad[15] = 1;
        assert!(matches!(RecvWqe::parse(&bad, 0xBEEF), Err(E::Abi(_))));
        assert!(matches!(
            RecvWqe::parse(&out[..8], 0xBEEF),
            Err(E::Truncated { .. })
        ));
        // Stale segments after num_sges are not looked at.
        let mut stale = out;
        stale[0] = 1;
        assert_eq!(RecvWqe::parse(&stale, 0xBEEF).unwrap().sges, &sges[..1]);
    }

    // ---- property tests ----

    /// An owned description of a valid send WQE; [`Owned::view`] borrows it.
    #[derive(Debug, Clone)]
    pub(crate) struct Owned {
        pub(crate) transport: Transport,
        pub(crate) wqe_index: u16,
        pub(crate) flags: WqeFlags,
        pub(crate) op: WqeOp,
        pub(crate) ud: Option<UdAddress>,
        pub(crate) sges: Vec<Sge>,
        pub(crate) inline: Option<Vec<u8>>,
    }

    impl Owned {
        pub(crate) fn view(&self) -> SendWqe<'_> {
            SendWqe {
                wqe_index: self.wqe_index,
                flags: self.flags,
                op: self.op,
                ud: self.ud,
                payload: match &self.inline {
                    Some(data) => Payload::Inline(data),
                    None => Payload::Data(&self.sges),
                },
            }
        }
    }

    fn any_sge() -> impl Strategy<Value = Sge> {
        (any::<u64>(), any::<u32>(), any::<u32>())
            .prop_map(|(addr, len, key)| Sge::new(addr, len, LKey::new(key)))
    }

    fn any_remote() -> impl Strategy<Value = RemoteAddr> {
        (any::<u64>(), any::<u32>()).prop_map(|(addr, key)| RemoteAddr {
            addr,
            rkey: RKey::new(key),
        })
    }

    fn any_op(opcode: WqeOpcode) -> BoxedStrategy<WqeOp> {
        let imm = || any::<u32>().prop_map(Be32::new);
        let key = || any::<u32>().prop_map(RKey::new);
        match opcode {
            WqeOpcode::Nop => Just(WqeOp::Nop).boxed(),
            WqeOpcode::Send => Just(WqeOp::Send).boxed(),
            WqeOpcode::SendImm => imm().prop_map(|imm| WqeOp::SendImm { imm }).boxed(),
            WqeOpcode::SendInv => key().prop_map(|rkey| WqeOp::SendInv { rkey }).boxed(),
            WqeOpcode::RdmaWrite => any_remote()
                .prop_map(|remote| WqeOp::RdmaWrite { remote })
                .boxed(),
            WqeOpcode::RdmaWriteImm => (any_remote(), imm())
                .prop_map(|(remote, imm)| WqeOp::RdmaWriteImm { remote, imm })
                .boxed(),
            WqeOpcode::RdmaRead => any_remote()
                .prop_map(|remote| WqeOp::RdmaRead { remote })
                .boxed(),
            WqeOpcode::AtomicCs => (any_remote(), any::<u64>(), any::<u64>())
                .prop_map(|(remote, compare, swap)| WqeOp::AtomicCs {
                    remote,
                    compare,
                    swap,
                })
                .boxed(),
            WqeOpcode::AtomicFa => (any_remote(), any::<u64>())
                .prop_map(|(remote, add)| WqeOp::AtomicFa { remote, add })
                .boxed(),
            WqeOpcode::BindMw => (
                key(),
                any::<u32>(),
                any::<u64>(),
                any::<u64>(),
                0u32..0x20,
                prop::sample::select(MwType::ALL),
            )
                .prop_map(|(new_rkey, mr, va, length, access, mw_type)| {
                    WqeOp::BindMw(Bind {
                        new_rkey,
                        mr_key: LKey::new(mr),
                        va,
                        length,
                        access: AccessFlags::from_bits_truncate(access),
                        mw_type,
                    })
                })
                .boxed(),
            WqeOpcode::LocalInv => key().prop_map(|key| WqeOp::LocalInv { key }).boxed(),
        }
    }

    fn any_payload(opcode: WqeOpcode) -> BoxedStrategy<(Vec<Sge>, Option<Vec<u8>>)> {
        let data = || vec(any_sge(), 0..6).prop_map(|s| (s, None));
        if opcode.is_atomic() {
            any_sge()
                .prop_map(|s| (vec![Sge::new(s.addr.get(), 8, s.lkey)], None))
                .boxed()
        } else if !opcode.takes_data() {
            Just((Vec::new(), None)).boxed()
        } else if opcode.allows_inline() {
            prop_oneof![
                data(),
                vec(any::<u8>(), 0..200).prop_map(|d| (Vec::new(), Some(d)))
            ]
            .boxed()
        } else {
            data().boxed()
        }
    }

    /// Any valid send WQE, on any transport, with the segments its opcode
    /// takes there.
    pub(crate) fn any_wqe() -> impl Strategy<Value = Owned> {
        (prop::sample::select(Transport::ALL), any::<u16>(), 0u8..8).prop_flat_map(
            |(transport, wqe_index, flag_bits)| {
                let opcodes: Vec<WqeOpcode> = WqeOpcode::ALL
                    .iter()
                    .copied()
                    .filter(|o| o.is_allowed_on(transport))
                    .collect();
                prop::sample::select(opcodes).prop_flat_map(move |opcode| {
                    let ud = if transport == Transport::Ud && opcode.takes_ud_address() {
                        (any_av(), 0..=Qpn::MAX.get(), any::<u32>())
                            .prop_map(|(av, qpn, qkey)| {
                                Some(UdAddress {
                                    av,
                                    dest_qpn: Qpn::new(qpn).unwrap(),
                                    qkey: QKey::new(qkey),
                                })
                            })
                            .boxed()
                    } else {
                        Just(None).boxed()
                    };
                    (any_op(opcode), ud, any_payload(opcode)).prop_map(
                        move |(op, ud, (sges, inline))| {
                            let mut flags = WqeFlags::from_bits_truncate(flag_bits);
                            flags.set(WqeFlags::INLINE, inline.is_some());
                            Owned {
                                transport,
                                wqe_index,
                                flags,
                                op,
                                ud,
                                sges,
                                inline,
                            }
                        },
                    )
                })
            },
        )
    }

    /// The verbs request a WQE description stands for (the test's own
    /// inverse of `from_wr`), with the inline data as one SGE.
    fn to_wr(owned: &Owned, inline_sge: &[Sge; 1]) -> Option<SendWr<'static>> {
        let op = match owned.op {
            WqeOp::Nop => return None,
            WqeOp::Send => SendOp::Send,
            WqeOp::SendImm { imm } => SendOp::SendWithImm { imm },
            WqeOp::SendInv { rkey } => SendOp::SendWithInvalidate { rkey },
            WqeOp::RdmaWrite { remote } => SendOp::RdmaWrite { remote },
            WqeOp::RdmaWriteImm { remote, imm } => SendOp::RdmaWriteWithImm { remote, imm },
            WqeOp::RdmaRead { remote } => SendOp::RdmaRead { remote },
            WqeOp::AtomicCs {
                remote,
                compare,
                swap,
            } => SendOp::CompareSwap {
                remote,
                compare,
                swap,
            },
            WqeOp::AtomicFa { remote, add } => SendOp::FetchAdd { remote, add },
            WqeOp::BindMw(b) if b.mw_type == MwType::Type2 => SendOp::BindMw {
                mw: MwHandle::from_raw(1),
                rkey: b.new_rkey,
                bind: MwBind {
                    mr_lkey: b.mr_key,
                    addr: b.va,
                    length: b.length,
                    access: b.access,
                },
            },
            WqeOp::BindMw(_) => return None,
            WqeOp::LocalInv { key } => SendOp::LocalInvalidate { rkey: key },
        };
        let mut flags = SendFlags::empty();
        for (w, s) in [
            (WqeFlags::SIGNALED, SendFlags::SIGNALED),
            (WqeFlags::SOLICITED, SendFlags::SOLICITED),
            (WqeFlags::FENCE, SendFlags::FENCE),
            (WqeFlags::INLINE, SendFlags::INLINE),
        ] {
            flags.set(s, owned.flags.contains(w));
        }
        let sg_list: Vec<Sge> = if owned.inline.is_some() {
            inline_sge.to_vec()
        } else {
            owned.sges.clone()
        };
        Some(SendWr {
            wr_id: 0,
            op,
            flags,
            sg_list: sg_list.leak(),
            ud: owned.ud.map(|ud| UdDest {
                av: AvHandle::from_raw(1),
                remote_qpn: ud.dest_qpn,
                remote_qkey: ud.qkey,
            }),
        })
    }

    proptest! {
        #[test]
        fn emit_then_parse_is_identity(owned in any_wqe()) {
            let wqe = owned.view();
            let mut out = vec![0xA5; MAX_SEND_WQE_BYTES + 64];
            let len = wqe.emit(&mut out).unwrap();
            prop_assert_eq!(len, wqe.byte_len());
            prop_assert_eq!(len % SEG_SIZE, 0);
            prop_assert_eq!(out[len], 0xA5);
            let parsed = SendWqe::parse(&out, owned.wqe_index, owned.transport).unwrap();
            prop_assert_eq!(parsed, wqe);
        }

        /// `SendWqe::prepare` (straight from the work request, what the
        /// UVP writes into its ring) gives `build_send_wqe`'s bytes or its
        /// error for valid work requests and for ones damaged each way the
        /// checks look at.
        #[test]
        fn prepare_matches_from_wr_then_emit(
            owned in any_wqe(),
            damage in 0u8..8,
            extra in any::<u32>(),
            room in prop_oneof![Just(MAX_SEND_WQE_BYTES), 0usize..200],
        ) {
            let inline_len = owned.inline.as_ref().map_or(0, Vec::len) as u32;
            let Some(mut wr) = to_wr(&owned, &[Sge::new(0x4000, inline_len, KEY)]) else {
                return Ok(());
            };
            let mut av = owned.ud.map(|ud| ud.av);
            let mut inline = owned.inline.clone();
            let many: Vec<Sge> = (0..300).map(|i| Sge::new(i, 1, KEY)).collect();
            match damage {
                0 => {}
                1 => wr.flags ^= SendFlags::INLINE,
                2 => av = if av.is_some() { None } else { Some(crate::av::Av::default()) },
                3 => inline = Some(vec![7; extra as usize % 90]),
                4 => wr.sg_list = &many[..1 + extra as usize % 299],
                5 => {
                    if let SendOp::BindMw { bind, .. } = &mut wr.op {
                        bind.access = AccessFlags::from_bits_retain(extra);
                    }
                }
                6 => inline = None,
                _ => {
                    if let Some(av) = &mut av {
                        av.sl = (extra % 32) as u8;
                    }
                }
            }
            let mut built = vec![0u8; room];
            let expected = build_send_wqe(&wr, av.as_ref(), owned.wqe_index, inline.as_deref(), &mut built)
                .map(|len| built[..len].to_vec());
            let mut words = Vec::new();
            let got = SendWqe::prepare(&wr, av.as_ref(), owned.wqe_index, inline.as_deref())
                .and_then(|p| p.emit_words(room, |_, w| words.extend_from_slice(&w.to_le_bytes())))
                .map(|_| words.clone());
            prop_assert_eq!(&got, &expected);
            // The specialised encoder, where it takes the request, gives
            // the same bytes (and so never takes one the checks refuse).
            if let Some(common) =
                SendWqe::prepare_common(&wr, av.as_ref(), owned.wqe_index, inline.as_deref())
            {
                let mut common_words = Vec::new();
                common.emit_words(|i, w| {
                    assert_eq!(i, common_words.len() / 8, "words in order, each once");
                    common_words.extend_from_slice(&w.to_le_bytes());
                });
                prop_assert_eq!(common.byte_len(), common_words.len());
                let mut unbounded = vec![0u8; MAX_SEND_WQE_BYTES];
                let general = build_send_wqe(&wr, av.as_ref(), owned.wqe_index, inline.as_deref(), &mut unbounded)
                    .map(|len| unbounded[..len].to_vec());
                prop_assert_eq!(Ok(common_words), general);
            }
        }

        /// The specialised encoder takes every request of its shapes (RC
        /// and UC SEND and RDMA WRITE, with or without immediate, inline or
        /// with at most one SGE), so the equality above is tested on them.
        #[test]
        fn prepare_common_takes_its_shapes(owned in any_wqe()) {
            let inline_len = owned.inline.as_ref().map_or(0, Vec::len) as u32;
            let Some(wr) = to_wr(&owned, &[Sge::new(0x4000, inline_len, KEY)]) else {
                return Ok(());
            };
            let common_op = matches!(
                owned.op,
                WqeOp::Send | WqeOp::SendImm { .. } | WqeOp::RdmaWrite { .. } | WqeOp::RdmaWriteImm { .. }
            );
            let common_shape = owned.transport != Transport::Ud
                && common_op
                && (owned.inline.is_some() || owned.sges.len() <= 1);
            let av = owned.ud.map(|ud| ud.av);
            let common =
                SendWqe::prepare_common(&wr, av.as_ref(), owned.wqe_index, owned.inline.as_deref());
            prop_assert_eq!(common.is_some(), common_shape);
        }

        /// The flags table gives every combination of send flags, other
        /// bits set or not, the WQE flags the flag-by-flag mapping gives.
        #[test]
        fn send_flags_table_is_the_flag_by_flag_mapping(bits in any::<u32>()) {
            let flags = SendFlags::from_bits_retain(bits);
            prop_assert_eq!(WqeFlags::from_send_flags(flags), map_send_flags(flags));
            prop_assert_eq!(
                WqeFlags::from_send_flags(flags).contains(WqeFlags::SIGNALED),
                flags.contains(SendFlags::SIGNALED)
            );
        }

        /// The validated specialised encoder takes exactly the requests the
        /// specialised encoder takes that `SendWr::validate` accepts, on
        /// any transport and limits (so a poster may skip `validate` for
        /// them), with the same words; requests damaged each way the
        /// validation looks at included.
        #[test]
        fn prepare_common_valid_is_validate_on_common_shapes(
            owned in any_wqe(),
            transport in prop::sample::select(Transport::ALL),
            max_sge in 0u32..3,
            max_inline in prop_oneof![0u32..80, Just(u32::MAX)],
            damage in 0u8..5,
            extra in any::<u32>(),
        ) {
            let inline_len = owned.inline.as_ref().map_or(0, Vec::len) as u32;
            let Some(mut wr) = to_wr(&owned, &[Sge::new(0x4000, inline_len, KEY)]) else {
                return Ok(());
            };
            let mut inline = owned.inline.clone();
            let big = [Sge::new(0x4000, MAX_MESSAGE_LEN + extra % 2, KEY)];
            let two = [Sge::new(0x4000, 1, KEY), Sge::new(0x8000, 1, KEY)];
            match damage {
                0 => {}
                1 => wr.sg_list = &big,
                2 => wr.sg_list = &two,
                3 => {
                    let data: &'static [u8] = vec![5; extra as usize % 120].leak();
                    let sge: &'static [Sge] = vec![Sge::new(0x4000, data.len() as u32, KEY)].leak();
                    wr.flags |= SendFlags::INLINE;
                    wr.sg_list = sge;
                    inline = Some(data.to_vec());
                }
                _ => wr.sg_list = &[],
            }
            let limits = WrLimits { max_sge, max_inline };
            let av = owned.ud.map(|ud| ud.av);
            let common =
                SendWqe::prepare_common(&wr, av.as_ref(), owned.wqe_index, inline.as_deref());
            let valid = SendWqe::prepare_common_valid(
                &wr, av.as_ref(), owned.wqe_index, inline.as_deref(), transport, &limits,
            );
            let expected = common.filter(|_| wr.validate(transport, &limits).is_ok());
            prop_assert_eq!(valid, expected);
        }

        #[test]
        fn emit_words_stores_each_word_once_in_order(owned in any_wqe()) {
            let wqe = owned.view();
            let mut bytes = vec![0xA5; MAX_SEND_WQE_BYTES];
            let len = wqe.emit(&mut bytes).unwrap();
            let prepared = wqe.prepared().unwrap();
            prop_assert_eq!(prepared.byte_len(), len);
            let mut words = Vec::new();
            prop_assert_eq!(prepared.emit_words(len, |i, w| words.push((i, w))), Ok(len));
            prop_assert_eq!(words.len(), len / 8);
            for (k, (i, w)) in words.iter().enumerate() {
                prop_assert_eq!(*i, k);
                prop_assert_eq!(&w.to_le_bytes()[..], &bytes[8 * k..8 * k + 8]);
            }
            // Too little room: refused before a word is stored.
            let mut stored = 0;
            prop_assert_eq!(
                prepared.emit_words(len - SEG_SIZE, |_, _| stored += 1),
                Err(WqeError::OutputTooSmall { needed: len, available: len - SEG_SIZE })
            );
            prop_assert_eq!(stored, 0);
        }

        #[test]
        fn build_from_wr_then_parse(owned in any_wqe()) {
            let inline_len = owned.inline.as_ref().map_or(0, Vec::len) as u32;
            let Some(wr) = to_wr(&owned, &[Sge::new(0x4000, inline_len, KEY)]) else {
                return Ok(());
            };
            let av = owned.ud.map(|ud| ud.av);
            let mut out = vec![0; MAX_SEND_WQE_BYTES];
            let len = build_send_wqe(&wr, av.as_ref(), owned.wqe_index, owned.inline.as_deref(), &mut out).unwrap();
            let parsed = SendWqe::parse(&out[..len], owned.wqe_index, owned.transport).unwrap();
            prop_assert_eq!(parsed, owned.view());
            prop_assert_eq!(parsed.op.opcode(), WqeOpcode::from_wr(wr.op.opcode()));
        }

        #[test]
        fn damaged_wqes_never_panic_and_reemit(
            owned in any_wqe(),
            hits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut bytes = vec![0; MAX_SEND_WQE_BYTES];
            let len = owned.view().emit(&mut bytes).unwrap();
            bytes.truncate(len);
            for (at, value) in hits {
                let i = at.index(len);
                bytes[i] = value;
            }
            let bytes = &bytes[..cut.index(len + 1)];
            if let Ok(wqe) = SendWqe::parse(bytes, owned.wqe_index, owned.transport) {
                let mut again = vec![0; MAX_SEND_WQE_BYTES];
                let n = wqe.emit(&mut again).unwrap();
                prop_assert_eq!(&again[..n], &bytes[..n]);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(
            bytes in vec(any::<u8>(), 0..320),
            transport in prop::sample::select(Transport::ALL),
        ) {
            // Use the WQE's own index so parsing gets past the first check.
            let index = bytes.get(4..6).map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
            if let Ok(wqe) = SendWqe::parse(&bytes, index, transport) {
                let mut again = vec![0; MAX_SEND_WQE_BYTES];
                let n = wqe.emit(&mut again).unwrap();
                prop_assert_eq!(&again[..n], &bytes[..n]);
            }
        }

        #[test]
        fn recv_round_trip(
            sges in vec(any_sge(), 0..8),
            index: u16,
            log_stride in 5u32..10,
        ) {
            let stride = 1usize << log_stride;
            let mut out = vec![0xA5; stride];
            let fit = recv_sges_per_stride(stride);
            match build_recv_wqe(&sges, index, stride, &mut out) {
                Ok(()) => {
                    let wqe = RecvWqe::parse(&out, index).unwrap();
                    prop_assert_eq!(wqe.sges, &sges[..]);
                    prop_assert!(out[16 + 16 * sges.len()..].iter().all(|&b| b == 0));
                }
                Err(e) => {
                    prop_assert!(sges.len() > fit);
                    prop_assert_eq!(e, WqeError::TooManySges { count: sges.len(), fit });
                }
            }
        }

        #[test]
        fn recv_parse_is_total(bytes in vec(any::<u8>(), 0..200)) {
            let index = bytes.get(2..4).map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
            if let Ok(wqe) = RecvWqe::parse(&bytes, index) {
                let n = 16 + 16 * wqe.sges.len();
                prop_assert_eq!(usize::from(bytes[0]), wqe.sges.len());
                prop_assert_eq!(&wqe.sges.as_bytes(), &&bytes[16..n]);
            }
        }
    }
}
