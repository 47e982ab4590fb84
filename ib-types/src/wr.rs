//! Work requests: scatter/gather entries, memory keys, send and receive work
//! requests, and the checks a verbs provider runs before posting one.
//!
//! Contract:
//! - [`Sge`] and the keys [`LKey`]/[`RKey`] are ABI layouts (every bit
//!   pattern valid). A key is `index << 8 | tag` in this stack.
//! - A send operation is a [`SendOp`] carrying exactly the data its opcode
//!   needs, so "RDMA read without a remote address" cannot be written.
//! - [`SendWr::validate`] and [`RecvWr::validate`] are pure, never panic,
//!   and check everything that can be decided without device state: opcode
//!   per transport, destination, SGE count and total length, inline, atomic
//!   alignment and size, memory-window bind rights. Keys, handles and
//!   ranges against registered memory are the device's to check.
//! - Every rejection is a distinct [`WrError`]; [`WrError::status`] gives the
//!   [`IbStatus`] a verbs call returns for it.

use core::fmt;

use bitflags::bitflags;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::abi::{AbiError, Be32, Le32, Le64};
use crate::access::AccessFlags;
use crate::handle::{AvHandle, MwHandle};
use crate::scalars::{QKey, Qpn};
use crate::status::IbStatus;

/// The largest message of any operation: 2^31 bytes. IBA caps every
/// message at 2 GiB (the maximum message size a CA reports, IBA 11.2.1.2
/// Query HCA, is at most 2^31), whatever the transport.
pub const MAX_MESSAGE_LEN: u32 = 1 << 31;

/// Defines a 32-bit memory key, `index << 8 | tag`, stored little-endian.
macro_rules! memory_key {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(
            Clone, Copy, PartialEq, Eq, Hash, Default,
            FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
        )]
        #[repr(transparent)]
        pub struct $name(Le32);

        impl $name {
            /// The largest key index (24 bits).
            pub const MAX_INDEX: u32 = 0x00FF_FFFF;

            /// A key from its 32-bit value.
            pub const fn new(value: u32) -> Self {
                Self(Le32::new(value))
            }

            /// A key from an index below 2^24 and a tag.
            pub const fn from_parts(index: u32, tag: u8) -> Result<Self, AbiError> {
                if index > Self::MAX_INDEX {
                    return Err(AbiError::OutOfRange {
                        field: concat!(stringify!($name), ".index"),
                        value: index as u64,
                    });
                }
                Ok(Self::new(index << 8 | tag as u32))
            }

            /// The 32-bit value.
            pub const fn get(self) -> u32 {
                self.0.get()
            }

            /// The table index: the upper 24 bits.
            pub const fn index(self) -> u32 {
                self.get() >> 8
            }

            /// The consumer-owned tag: the low 8 bits.
            pub const fn tag(self) -> u8 {
                self.get() as u8
            }

            /// The same index with another tag (the new key of a rebind).
            pub const fn with_tag(self, tag: u8) -> Self {
                Self::new(self.get() & !0xFF | tag as u32)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#010x})"), self.get())
            }
        }
    };
}

memory_key!(
    /// A local key: names registered memory to the local CA (IBA 10.6).
    LKey
);
memory_key!(
    /// A remote key: names registered memory or a window to a peer
    /// (IBA 10.6).
    RKey
);

/// A scatter/gather entry: one virtually contiguous local buffer.
#[derive(
    Debug,
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
pub struct Sge {
    /// Virtual address of the buffer.
    pub addr: Le64,
    /// Length in bytes.
    pub length: Le32,
    /// Key of the region holding the buffer (ignored for inline data).
    pub lkey: LKey,
}

assert_layout!(Sge, size = 16, addr @ 0, length @ 8, lkey @ 12);

impl Sge {
    /// An entry from host values.
    pub const fn new(addr: u64, length: u32, lkey: LKey) -> Self {
        Self {
            addr: Le64::new(addr),
            length: Le32::new(length),
            lkey,
        }
    }

    /// The sum of the entries' lengths, or `None` if it overflows a `u32`.
    pub const fn total_len(list: &[Self]) -> Option<u32> {
        let mut total: u32 = 0;
        let mut i = 0;
        while i < list.len() {
            total = match total.checked_add(list[i].length.get()) {
                Some(t) => t,
                None => return None,
            };
            i += 1;
        }
        Some(total)
    }
}

bitflags! {
    /// Modifiers of a send work request (IBA 11.4.1.1).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SendFlags: u32 {
        /// Wait for earlier RDMA reads and atomics to complete first.
        const FENCE = 1 << 0;
        /// Generate a completion even on a selectively signaled QP.
        const SIGNALED = 1 << 1;
        /// Ask the responder to raise a solicited event.
        const SOLICITED = 1 << 2;
        /// Copy the data into the WQE at post time; the SGEs' keys are not
        /// used and the buffers may be reused as soon as the post returns.
        const INLINE = 1 << 3;
    }
}

impl SendFlags {
    /// Reads raw flags; unknown bits are an error.
    pub const fn from_raw(raw: u32) -> Result<Self, AbiError> {
        match Self::from_bits(raw) {
            Some(flags) => Ok(flags),
            None => Err(AbiError::ReservedNotZero { field: "SendFlags" }),
        }
    }
}

code_enum! {
    /// The service a QP provides, as far as send validation cares. SMI and
    /// GSI QPs (QP0/QP1) validate as [`Ud`](Transport::Ud).
    pub enum Transport: u8 {
        /// Reliable connected.
        Rc = 0,
        /// Unreliable connected.
        Uc = 1,
        /// Unreliable datagram.
        Ud = 2,
    }
}

code_enum! {
    /// The operation of a send work request.
    pub enum WrOpcode: u8 {
        /// Send.
        Send = 0,
        /// Send with 32 bits of immediate data.
        SendWithImm = 1,
        /// Send that invalidates an R_Key at the responder.
        SendWithInvalidate = 2,
        /// RDMA write.
        RdmaWrite = 3,
        /// RDMA write with immediate data (consumes a receive WQE).
        RdmaWriteWithImm = 4,
        /// RDMA read.
        RdmaRead = 5,
        /// Atomic compare and swap.
        CompareSwap = 6,
        /// Atomic fetch and add.
        FetchAdd = 7,
        /// Bind a memory window (type 1 or 2; both are posted as WRs here, there
        /// being no separate bind verb in the request surface).
        BindMw = 8,
        /// Invalidate a local key.
        LocalInvalidate = 9,
    }
}

impl WrOpcode {
    /// RDMA write (with or without immediate) and RDMA read.
    pub const fn is_rdma(self) -> bool {
        matches!(
            self,
            Self::RdmaWrite | Self::RdmaWriteWithImm | Self::RdmaRead
        )
    }

    /// Compare-and-swap and fetch-and-add.
    pub const fn is_atomic(self) -> bool {
        matches!(self, Self::CompareSwap | Self::FetchAdd)
    }

    /// Operations whose local data can be inline: the ones that send data
    /// from the requester (sends and RDMA writes). Reads and atomics write
    /// into local memory; binds and invalidates carry no data.
    pub const fn allows_inline(self) -> bool {
        matches!(
            self,
            Self::Send
                | Self::SendWithImm
                | Self::SendWithInvalidate
                | Self::RdmaWrite
                | Self::RdmaWriteWithImm
        )
    }

    /// Operations that carry no data and so take no SGEs.
    pub const fn is_memory_op(self) -> bool {
        matches!(self, Self::BindMw | Self::LocalInvalidate)
    }

    /// Whether the transport supports the operation (IBA 9.4 / 11.4.1.1
    /// operation tables): RC supports everything; UC has no reads, atomics or
    /// send with invalidate; UD only sends, with or without immediate.
    pub const fn is_supported_on(self, transport: Transport) -> bool {
        match transport {
            Transport::Rc => true,
            Transport::Uc => matches!(
                self,
                Self::Send
                    | Self::SendWithImm
                    | Self::RdmaWrite
                    | Self::RdmaWriteWithImm
                    | Self::BindMw
                    | Self::LocalInvalidate
            ),
            Transport::Ud => matches!(self, Self::Send | Self::SendWithImm),
        }
    }
}

/// A remote buffer: virtual address and the R_Key that grants access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteAddr {
    /// Remote virtual address.
    pub addr: u64,
    /// Key of the remote region or window.
    pub rkey: RKey,
}

/// What a memory-window bind grants: a range of a region, with rights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MwBind {
    /// The L_Key of the region the window is bound to.
    pub mr_lkey: LKey,
    /// Start of the window (virtual address within the region).
    pub addr: u64,
    /// Length of the window in bytes.
    pub length: u64,
    /// The window's rights; only remote rights are meaningful.
    pub access: AccessFlags,
}

/// A send operation with exactly the data it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SendOp {
    /// Send.
    Send,
    /// Send with immediate data.
    SendWithImm {
        /// Immediate data, opaque and in network order.
        imm: Be32,
    },
    /// Send, invalidating `rkey` at the responder.
    SendWithInvalidate {
        /// The remote key to invalidate.
        rkey: RKey,
    },
    /// RDMA write.
    RdmaWrite {
        /// Where to write.
        remote: RemoteAddr,
    },
    /// RDMA write with immediate data.
    RdmaWriteWithImm {
        /// Where to write.
        remote: RemoteAddr,
        /// Immediate data, opaque and in network order.
        imm: Be32,
    },
    /// RDMA read.
    RdmaRead {
        /// Where to read from.
        remote: RemoteAddr,
    },
    /// Atomic compare and swap of the 8 bytes at `remote`.
    CompareSwap {
        /// The remote 64-bit word.
        remote: RemoteAddr,
        /// Value expected.
        compare: u64,
        /// Value stored if the comparison holds.
        swap: u64,
    },
    /// Atomic fetch and add on the 8 bytes at `remote`.
    FetchAdd {
        /// The remote 64-bit word.
        remote: RemoteAddr,
        /// Value added.
        add: u64,
    },
    /// Bind a memory window.
    BindMw {
        /// The window.
        mw: MwHandle,
        /// The window's new R_Key.
        rkey: RKey,
        /// Region, range and rights.
        bind: MwBind,
    },
    /// Invalidate a local key.
    LocalInvalidate {
        /// The key to invalidate.
        rkey: RKey,
    },
}

impl SendOp {
    /// The operation's opcode.
    pub const fn opcode(&self) -> WrOpcode {
        match self {
            Self::Send => WrOpcode::Send,
            Self::SendWithImm { .. } => WrOpcode::SendWithImm,
            Self::SendWithInvalidate { .. } => WrOpcode::SendWithInvalidate,
            Self::RdmaWrite { .. } => WrOpcode::RdmaWrite,
            Self::RdmaWriteWithImm { .. } => WrOpcode::RdmaWriteWithImm,
            Self::RdmaRead { .. } => WrOpcode::RdmaRead,
            Self::CompareSwap { .. } => WrOpcode::CompareSwap,
            Self::FetchAdd { .. } => WrOpcode::FetchAdd,
            Self::BindMw { .. } => WrOpcode::BindMw,
            Self::LocalInvalidate { .. } => WrOpcode::LocalInvalidate,
        }
    }
}

/// The destination of a datagram send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UdDest {
    /// Address vector of the remote port.
    pub av: AvHandle,
    /// Destination QP.
    pub remote_qpn: Qpn,
    /// Q_Key to send with.
    pub remote_qkey: QKey,
}

/// Per-queue limits a work request is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WrLimits {
    /// Most SGEs per work request on this queue.
    pub max_sge: u32,
    /// Most bytes of inline data per send (0: no inline support).
    pub max_inline: u32,
}

/// Why a work request was rejected before posting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WrError {
    /// The transport does not support the operation.
    #[error("{opcode:?} is not supported on {transport:?} QPs")]
    OpcodeNotSupported {
        /// The operation.
        opcode: WrOpcode,
        /// The QP's transport.
        transport: Transport,
    },
    /// A datagram send has no destination.
    #[error("UD send without a destination")]
    MissingUdDest,
    /// A connected QP's send names a datagram destination.
    #[error("datagram destination on a connected QP")]
    UnexpectedUdDest,
    /// The datagram destination's address vector is null.
    #[error("null address vector")]
    NullAvHandle,
    /// The bind names a null memory window.
    #[error("null memory window")]
    NullMwHandle,
    /// More SGEs than the queue allows.
    #[error("{count} SGEs exceed the queue's limit of {max}")]
    TooManySge {
        /// SGEs in the request.
        count: usize,
        /// The queue's limit.
        max: u32,
    },
    /// The SGE lengths sum past `u32::MAX`.
    #[error("SGE lengths overflow 32 bits")]
    LengthOverflow,
    /// The message exceeds [`MAX_MESSAGE_LEN`].
    #[error("message of {len} bytes exceeds {max}")]
    MessageTooLong {
        /// Total length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// INLINE was asked for an operation that cannot carry inline data.
    #[error("{opcode:?} cannot be inline")]
    InlineNotAllowed {
        /// The operation.
        opcode: WrOpcode,
    },
    /// The inline data exceeds the queue's limit.
    #[error("{len} bytes of inline data exceed the queue's limit of {max}")]
    InlineTooLong {
        /// Total length.
        len: u32,
        /// The queue's limit.
        max: u32,
    },
    /// An atomic's remote address is not 8-byte aligned.
    #[error("atomic remote address {addr:#x} is not 8-byte aligned")]
    MisalignedAtomic {
        /// The remote address.
        addr: u64,
    },
    /// An atomic's local buffer is not exactly 8 bytes.
    #[error("atomic local buffer is {len} bytes, not 8")]
    AtomicLength {
        /// Total SGE length.
        len: u32,
    },
    /// A bind or local invalidate carries SGEs.
    #[error("{opcode:?} takes no SGEs")]
    SgeNotAllowed {
        /// The operation.
        opcode: WrOpcode,
    },
    /// A window bind asks for rights a window cannot have.
    #[error("memory window rights {access:?} include non-remote rights")]
    InvalidBindAccess {
        /// The rights asked for.
        access: AccessFlags,
    },
    /// A window's range wraps past the end of the address space.
    #[error("window [{addr:#x}, +{length:#x}) wraps the address space")]
    BindRangeOverflow {
        /// Start of the window.
        addr: u64,
        /// Length of the window.
        length: u64,
    },
}

impl WrError {
    /// The status a verbs call returns for this rejection.
    pub const fn status(&self) -> IbStatus {
        match self {
            Self::OpcodeNotSupported { .. } => IbStatus::InvalidWrType,
            Self::TooManySge { .. } => IbStatus::InvalidMaxSge,
            Self::NullAvHandle => IbStatus::InvalidAvHandle,
            Self::NullMwHandle => IbStatus::InvalidMwHandle,
            Self::InvalidBindAccess { .. } => IbStatus::InvalidPermission,
            Self::InlineNotAllowed { .. } => IbStatus::InvalidSetting,
            Self::MissingUdDest
            | Self::UnexpectedUdDest
            | Self::LengthOverflow
            | Self::MessageTooLong { .. }
            | Self::InlineTooLong { .. }
            | Self::MisalignedAtomic { .. }
            | Self::AtomicLength { .. }
            | Self::SgeNotAllowed { .. }
            | Self::BindRangeOverflow { .. } => IbStatus::InvalidParameter,
        }
    }
}

/// A send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr<'a> {
    /// Consumer cookie returned in the completion.
    pub wr_id: u64,
    /// The operation and its operands.
    pub op: SendOp,
    /// Modifiers.
    pub flags: SendFlags,
    /// Local buffers (gathered for sends and writes, scattered for reads and
    /// atomics).
    pub sg_list: &'a [Sge],
    /// Destination of a datagram send; `None` on connected QPs.
    pub ud: Option<UdDest>,
}

impl SendWr<'_> {
    /// Checks the request against the QP's transport and limits; returns the
    /// total message length. Checks run in a fixed order and the first
    /// failure is reported.
    #[inline]
    pub const fn validate(&self, transport: Transport, limits: &WrLimits) -> Result<u32, WrError> {
        let opcode = self.op.opcode();
        // IBA 11.4.1.1 "Post Send Request": the operation must be one the
        // QP's service type supports (IBA 9.4 operation tables).
        if !opcode.is_supported_on(transport) {
            return Err(WrError::OpcodeNotSupported { opcode, transport });
        }
        // IBA 11.4.1.1: UD sends name the address vector, destination QP and
        // Q_Key; connected QPs take the destination from the QP context.
        match (transport, self.ud) {
            (Transport::Ud, None) => return Err(WrError::MissingUdDest),
            (Transport::Ud, Some(dest)) if dest.av.is_null() => {
                return Err(WrError::NullAvHandle);
            }
            (Transport::Rc | Transport::Uc, Some(_)) => return Err(WrError::UnexpectedUdDest),
            _ => {}
        }
        if self.sg_list.len() > limits.max_sge as usize {
            return Err(WrError::TooManySge {
                count: self.sg_list.len(),
                max: limits.max_sge,
            });
        }
        if opcode.is_memory_op() && !self.sg_list.is_empty() {
            return Err(WrError::SgeNotAllowed { opcode });
        }
        let len = match Sge::total_len(self.sg_list) {
            Some(len) => len,
            None => return Err(WrError::LengthOverflow),
        };
        if len > MAX_MESSAGE_LEN {
            return Err(WrError::MessageTooLong {
                len,
                max: MAX_MESSAGE_LEN,
            });
        }
        if self.flags.contains(SendFlags::INLINE) {
            if !opcode.allows_inline() {
                return Err(WrError::InlineNotAllowed { opcode });
            }
            if len > limits.max_inline {
                return Err(WrError::InlineTooLong {
                    len,
                    max: limits.max_inline,
                });
            }
        }
        match self.op {
            // IBA 9.4.5: the atomic's virtual address must be naturally
            // aligned to 8 bytes, and the operand is one 64-bit word, so the
            // local buffer receiving the original value is exactly 8 bytes.
            SendOp::CompareSwap { remote, .. } | SendOp::FetchAdd { remote, .. } => {
                if remote.addr % 8 != 0 {
                    return Err(WrError::MisalignedAtomic { addr: remote.addr });
                }
                if len != 8 {
                    return Err(WrError::AtomicLength { len });
                }
            }
            // IBA 10.6 (memory windows): a window grants remote rights
            // only. Whether the region allows binding, and the rule that a
            // window with remote write or atomic needs a region with local
            // write, depend on the region and are checked by the device.
            SendOp::BindMw { mw, bind, .. } => {
                if mw.is_null() {
                    return Err(WrError::NullMwHandle);
                }
                if !AccessFlags::REMOTE.contains(bind.access) {
                    return Err(WrError::InvalidBindAccess {
                        access: bind.access,
                    });
                }
                if bind.addr.checked_add(bind.length).is_none() {
                    return Err(WrError::BindRangeOverflow {
                        addr: bind.addr,
                        length: bind.length,
                    });
                }
            }
            _ => {}
        }
        Ok(len)
    }
}

/// A receive work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr<'a> {
    /// Consumer cookie returned in the completion.
    pub wr_id: u64,
    /// Buffers the incoming message is scattered into.
    pub sg_list: &'a [Sge],
}

impl RecvWr<'_> {
    /// Checks the SGE count and that the total length fits 32 bits;
    /// returns the total buffer length. `max_inline` is not used.
    pub const fn validate(&self, limits: &WrLimits) -> Result<u32, WrError> {
        if self.sg_list.len() > limits.max_sge as usize {
            return Err(WrError::TooManySge {
                count: self.sg_list.len(),
                max: limits.max_sge,
            });
        }
        match Sge::total_len(self.sg_list) {
            Some(len) => Ok(len),
            None => Err(WrError::LengthOverflow),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerocopy::IntoBytes;

    const LIMITS: WrLimits = WrLimits {
        max_sge: 4,
        max_inline: 64,
    };
    const KEY: LKey = LKey::new(0x0000_1201);
    const REMOTE: RemoteAddr = RemoteAddr {
        addr: 0x1000,
        rkey: RKey::new(0x0000_3402),
    };
    const BUF: [Sge; 1] = [Sge::new(0x8000, 8, KEY)];

    fn dest() -> UdDest {
        UdDest {
            av: AvHandle::from_raw(9),
            remote_qpn: Qpn::new(0x42).unwrap(),
            remote_qkey: QKey::new(0x1111),
        }
    }

    /// A valid operation for each opcode (in `WrOpcode::ALL` order), with a
    /// local buffer that suits it.
    fn sample(opcode: WrOpcode) -> (SendOp, &'static [Sge]) {
        let imm = Be32::new(0xCAFE);
        let op = match opcode {
            WrOpcode::Send => SendOp::Send,
            WrOpcode::SendWithImm => SendOp::SendWithImm { imm },
            WrOpcode::SendWithInvalidate => SendOp::SendWithInvalidate { rkey: REMOTE.rkey },
            WrOpcode::RdmaWrite => SendOp::RdmaWrite { remote: REMOTE },
            WrOpcode::RdmaWriteWithImm => SendOp::RdmaWriteWithImm {
                remote: REMOTE,
                imm,
            },
            WrOpcode::RdmaRead => SendOp::RdmaRead { remote: REMOTE },
            WrOpcode::CompareSwap => SendOp::CompareSwap {
                remote: REMOTE,
                compare: 1,
                swap: 2,
            },
            WrOpcode::FetchAdd => SendOp::FetchAdd {
                remote: REMOTE,
                add: 3,
            },
            WrOpcode::BindMw => SendOp::BindMw {
                mw: MwHandle::from_raw(5),
                rkey: RKey::new(0x0000_5603),
                bind: MwBind {
                    mr_lkey: KEY,
                    addr: 0x8000,
                    length: 0x1000,
                    access: AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
                },
            },
            WrOpcode::LocalInvalidate => SendOp::LocalInvalidate { rkey: REMOTE.rkey },
        };
        assert_eq!(op.opcode(), opcode);
        let sgl: &'static [Sge] = if opcode.is_memory_op() { &[] } else { &BUF };
        (op, sgl)
    }

    fn wr(op: SendOp, sg_list: &[Sge], transport: Transport) -> SendWr<'_> {
        SendWr {
            wr_id: 7,
            op,
            flags: SendFlags::SIGNALED,
            sg_list,
            ud: (transport == Transport::Ud).then(dest),
        }
    }

    #[test]
    fn opcode_by_transport() {
        use WrOpcode as O;
        // (opcode, RC, UC, UD)
        let table: &[(WrOpcode, bool, bool, bool)] = &[
            (O::Send, true, true, true),
            (O::SendWithImm, true, true, true),
            (O::SendWithInvalidate, true, false, false),
            (O::RdmaWrite, true, true, false),
            (O::RdmaWriteWithImm, true, true, false),
            (O::RdmaRead, true, false, false),
            (O::CompareSwap, true, false, false),
            (O::FetchAdd, true, false, false),
            (O::BindMw, true, true, false),
            (O::LocalInvalidate, true, true, false),
        ];
        assert_eq!(table.len(), O::ALL.len());
        for &(opcode, rc, uc, ud) in table {
            let (op, sgl) = sample(opcode);
            for (transport, ok) in [
                (Transport::Rc, rc),
                (Transport::Uc, uc),
                (Transport::Ud, ud),
            ] {
                assert_eq!(opcode.is_supported_on(transport), ok);
                let got = wr(op, sgl, transport).validate(transport, &LIMITS);
                let want = if ok {
                    Ok(Sge::total_len(sgl).unwrap())
                } else {
                    Err(WrError::OpcodeNotSupported { opcode, transport })
                };
                assert_eq!(got, want, "{opcode:?} on {transport:?}");
            }
        }
    }

    #[test]
    fn each_error() {
        use SendFlags as F;
        use WrError as W;
        use WrOpcode as O;
        let (rc, uc, ud) = (Transport::Rc, Transport::Uc, Transport::Ud);
        let k = |len| Sge::new(0, len, KEY);
        let (five, two_big, huge) = ([BUF[0]; 5], [k(u32::MAX), k(1)], [k(MAX_MESSAGE_LEN), k(1)]);
        let (inline_max, inline_over) = ([k(64)], [k(64), k(1)]);
        let (sixteen, split) = ([k(16)], [k(4), k(4)]);
        let too_long = W::MessageTooLong {
            len: MAX_MESSAGE_LEN + 1,
            max: MAX_MESSAGE_LEN,
        };

        let read = SendOp::RdmaRead { remote: REMOTE };
        let inval = SendOp::LocalInvalidate { rkey: REMOTE.rkey };
        let fetch_add = |addr| SendOp::FetchAdd {
            remote: RemoteAddr { addr, ..REMOTE },
            add: 1,
        };
        let bind = |mw: u64, addr: u64, length: u64, access: AccessFlags| SendOp::BindMw {
            mw: MwHandle::from_raw(mw),
            rkey: RKey::new(0x0000_5603),
            bind: MwBind {
                mr_lkey: KEY,
                addr,
                length,
                access,
            },
        };
        let rw = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
        let null_av = UdDest {
            av: AvHandle::NULL,
            ..dest()
        };

        /// (name, transport, op, flags, SGEs, destination, expected)
        type Case<'a> = (
            &'a str,
            Transport,
            SendOp,
            SendFlags,
            &'a [Sge],
            Option<UdDest>,
            Result<u32, WrError>,
        );
        #[rustfmt::skip]
        let cases: &[Case<'_>] = &[
            ("ud without dest", ud, SendOp::Send, F::empty(), &BUF, None, Err(W::MissingUdDest)),
            ("ud null av", ud, SendOp::Send, F::empty(), &BUF, Some(null_av), Err(W::NullAvHandle)),
            ("rc with dest", rc, SendOp::Send, F::empty(), &BUF, Some(dest()), Err(W::UnexpectedUdDest)),
            ("uc with dest", uc, SendOp::Send, F::empty(), &BUF, Some(dest()), Err(W::UnexpectedUdDest)),
            ("at the SGE limit", rc, SendOp::Send, F::empty(), &five[..4], None, Ok(32)),
            ("too many SGEs", rc, SendOp::Send, F::empty(), &five, None, Err(W::TooManySge { count: 5, max: 4 })),
            ("empty send", rc, SendOp::Send, F::empty(), &[], None, Ok(0)),
            ("length overflow", rc, SendOp::Send, F::empty(), &two_big, None, Err(W::LengthOverflow)),
            ("longest message", rc, SendOp::Send, F::empty(), &huge[..1], None, Ok(MAX_MESSAGE_LEN)),
            ("message too long", rc, SendOp::Send, F::empty(), &huge, None, Err(too_long)),
            ("rdma read too long", rc, read, F::empty(), &huge, None, Err(too_long)),
            ("inline at the limit", rc, SendOp::Send, F::INLINE, &inline_max, None, Ok(64)),
            ("inline too long", rc, SendOp::Send, F::INLINE, &inline_over, None, Err(W::InlineTooLong { len: 65, max: 64 })),
            ("inline rdma read", rc, read, F::INLINE, &BUF, None, Err(W::InlineNotAllowed { opcode: O::RdmaRead })),
            ("inline atomic", rc, fetch_add(0x1000), F::INLINE, &BUF, None, Err(W::InlineNotAllowed { opcode: O::FetchAdd })),
            ("inline bind", rc, bind(5, 0, 1, rw), F::INLINE, &[], None, Err(W::InlineNotAllowed { opcode: O::BindMw })),
            ("inline invalidate", rc, inval, F::INLINE, &[], None, Err(W::InlineNotAllowed { opcode: O::LocalInvalidate })),
            ("misaligned atomic", rc, fetch_add(0x1004), F::empty(), &BUF, None, Err(W::MisalignedAtomic { addr: 0x1004 })),
            ("atomic, 16 bytes", rc, fetch_add(0x1008), F::empty(), &sixteen, None, Err(W::AtomicLength { len: 16 })),
            ("atomic, no buffer", rc, fetch_add(0x1008), F::empty(), &[], None, Err(W::AtomicLength { len: 0 })),
            ("atomic over two SGEs", rc, fetch_add(0x1008), F::FENCE, &split, None, Ok(8)),
            ("bind with SGE", rc, bind(5, 0, 1, rw), F::empty(), &BUF, None, Err(W::SgeNotAllowed { opcode: O::BindMw })),
            ("invalidate with SGE", rc, inval, F::empty(), &BUF, None, Err(W::SgeNotAllowed { opcode: O::LocalInvalidate })),
            ("bind null window", rc, bind(0, 0, 1, rw), F::empty(), &[], None, Err(W::NullMwHandle)),
            ("bind local write", rc, bind(5, 0, 1, rw | AccessFlags::LOCAL_WRITE), F::empty(), &[], None,
                Err(W::InvalidBindAccess { access: rw.union(AccessFlags::LOCAL_WRITE) })),
            ("bind mw-bind right", rc, bind(5, 0, 1, AccessFlags::MW_BIND), F::empty(), &[], None,
                Err(W::InvalidBindAccess { access: AccessFlags::MW_BIND })),
            ("bind atomic only", rc, bind(5, 0, 1, AccessFlags::REMOTE_ATOMIC), F::empty(), &[], None, Ok(0)),
            ("bind wraps", rc, bind(5, u64::MAX, 2, rw), F::empty(), &[], None,
                Err(W::BindRangeOverflow { addr: u64::MAX, length: 2 })),
            ("empty bind at the top", rc, bind(5, u64::MAX, 0, rw), F::empty(), &[], None, Ok(0)),
        ];
        for &(name, transport, op, flags, sg_list, ud, want) in cases {
            let wr = SendWr {
                wr_id: 1,
                op,
                flags,
                sg_list,
                ud,
            };
            assert_eq!(wr.validate(transport, &LIMITS), want, "{name}");
        }
    }

    #[test]
    fn unbounded_limits_still_catch_overflow() {
        let limits = WrLimits {
            max_sge: u32::MAX,
            max_inline: u32::MAX,
        };
        let sgl = [Sge::new(0, u32::MAX / 2 + 1, KEY); 2];
        let wr = SendWr {
            flags: SendFlags::INLINE,
            ..wr(SendOp::Send, &sgl, Transport::Rc)
        };
        assert_eq!(
            wr.validate(Transport::Rc, &limits),
            Err(WrError::LengthOverflow)
        );
    }

    #[test]
    fn error_statuses() {
        let table: &[(WrError, IbStatus)] = &[
            (
                WrError::OpcodeNotSupported {
                    opcode: WrOpcode::RdmaRead,
                    transport: Transport::Ud,
                },
                IbStatus::InvalidWrType,
            ),
            (WrError::MissingUdDest, IbStatus::InvalidParameter),
            (WrError::UnexpectedUdDest, IbStatus::InvalidParameter),
            (WrError::NullAvHandle, IbStatus::InvalidAvHandle),
            (WrError::NullMwHandle, IbStatus::InvalidMwHandle),
            (
                WrError::TooManySge { count: 5, max: 4 },
                IbStatus::InvalidMaxSge,
            ),
            (WrError::LengthOverflow, IbStatus::InvalidParameter),
            (
                WrError::MessageTooLong { len: 0, max: 0 },
                IbStatus::InvalidParameter,
            ),
            (
                WrError::InlineNotAllowed {
                    opcode: WrOpcode::RdmaRead,
                },
                IbStatus::InvalidSetting,
            ),
            (
                WrError::InlineTooLong { len: 0, max: 0 },
                IbStatus::InvalidParameter,
            ),
            (
                WrError::MisalignedAtomic { addr: 1 },
                IbStatus::InvalidParameter,
            ),
            (WrError::AtomicLength { len: 4 }, IbStatus::InvalidParameter),
            (
                WrError::SgeNotAllowed {
                    opcode: WrOpcode::BindMw,
                },
                IbStatus::InvalidParameter,
            ),
            (
                WrError::InvalidBindAccess {
                    access: AccessFlags::LOCAL_WRITE,
                },
                IbStatus::InvalidPermission,
            ),
            (
                WrError::BindRangeOverflow { addr: 1, length: 2 },
                IbStatus::InvalidParameter,
            ),
        ];
        for (err, status) in table {
            assert_eq!(err.status(), *status, "{err}");
        }
    }

    #[test]
    fn recv_validation() {
        let four = [BUF[0]; 4];
        let five = [BUF[0]; 5];
        let big = [Sge::new(0, u32::MAX, KEY), Sge::new(0, 1, KEY)];
        let cases: &[(&[Sge], Result<u32, WrError>)] = &[
            (&[], Ok(0)),
            (&four, Ok(32)),
            (&five, Err(WrError::TooManySge { count: 5, max: 4 })),
            (&big, Err(WrError::LengthOverflow)),
        ];
        for &(sg_list, want) in cases {
            let wr = RecvWr { wr_id: 1, sg_list };
            assert_eq!(wr.validate(&LIMITS), want, "{} SGEs", sg_list.len());
        }
    }

    #[test]
    fn keys_split_into_index_and_tag() {
        let k = LKey::from_parts(0x12_3456, 0x78).unwrap();
        assert_eq!(k.get(), 0x1234_5678);
        assert_eq!((k.index(), k.tag()), (0x12_3456, 0x78));
        assert_eq!(k.with_tag(0x9A), LKey::new(0x1234_569A));
        assert_eq!(
            RKey::from_parts(RKey::MAX_INDEX, 0xFF),
            Ok(RKey::new(u32::MAX))
        );
        assert_eq!(
            RKey::from_parts(0x100_0000, 0),
            Err(AbiError::OutOfRange {
                field: "RKey.index",
                value: 0x100_0000
            })
        );
        assert_eq!(k.as_bytes(), &[0x78, 0x56, 0x34, 0x12]);
        assert_eq!(format!("{k:?}"), "LKey(0x12345678)");
    }

    #[test]
    fn sge_layout() {
        let sge = Sge::new(0x0102_0304_0506_0708, 0x1122_3344, LKey::new(0xAABB_CCDD));
        assert_eq!(
            sge.as_bytes(),
            &[
                8, 7, 6, 5, 4, 3, 2, 1, 0x44, 0x33, 0x22, 0x11, 0xDD, 0xCC, 0xBB, 0xAA
            ]
        );
        assert_eq!(Sge::read_from_bytes(sge.as_bytes()).unwrap(), sge);
        assert_eq!(Sge::total_len(&[]), Some(0));
        assert_eq!(Sge::total_len(&[sge, sge, sge]), Some(0x3366_99CC));
        let quarter = Sge::new(0, 1 << 30, KEY);
        assert_eq!(Sge::total_len(&[quarter; 3]), Some(0xC000_0000));
        assert_eq!(Sge::total_len(&[quarter; 4]), None);
    }

    #[test]
    fn codes_and_flags() {
        for (i, &op) in WrOpcode::ALL.iter().enumerate() {
            assert_eq!(op.code(), i as u8);
            assert_eq!(WrOpcode::from_code(op.code()), Ok(op));
            assert_eq!(op.is_memory_op(), sample(op).1.is_empty());
        }
        assert!(WrOpcode::from_code(10).is_err());
        for &t in Transport::ALL {
            assert_eq!(Transport::try_from(t.code()), Ok(t));
        }
        assert!(Transport::from_code(3).is_err());
        assert_eq!(SendFlags::from_raw(0xF), Ok(SendFlags::all()));
        assert!(SendFlags::from_raw(0x10).is_err());
        let rdma: Vec<_> = WrOpcode::ALL.iter().filter(|o| o.is_rdma()).collect();
        assert_eq!(
            rdma,
            [
                &WrOpcode::RdmaWrite,
                &WrOpcode::RdmaWriteWithImm,
                &WrOpcode::RdmaRead
            ]
        );
        assert!(WrOpcode::CompareSwap.is_atomic() && WrOpcode::FetchAdd.is_atomic());
    }
}
