//! The extended transport headers that follow the BTH (IBA 9.3):
//! DETH, RETH, AtomicETH, AETH (with its syndrome), AtomicAckETH, ImmDt and
//! IETH, and [`ExtRepr`], the validated set one packet carries.
//!
//! Contract: every layout is big-endian with 24-bit fields behind accessors.
//! Every bit pattern of every header is a valid value except the AETH
//! syndrome, whose reserved encodings are [`WireError::BadSyndrome`].
//! Reserved bytes (the DETH byte before SrcQP) are ignored and sent as zero.
//! Which headers a packet has is decided by its opcode
//! ([`ExtLayout`]); [`ExtRepr::parse`] reads exactly that layout.

use ib_types::abi::{Be32, Be64};
use ib_types::scalars::{QKey, Qpn};
use ib_types::wr::RKey;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::opcode::ExtLayout;
use super::{HeaderRepr, WireError, assert_layout, u24_from_be, u24_to_be};

/// RDMA extended transport header (IBA 9.3.3): the target of a write or read.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct RethHeader {
    /// Remote virtual address.
    pub va: Be64,
    /// Remote key.
    pub rkey: Be32,
    /// Length of the whole transfer in bytes.
    pub dma_len: Be32,
}
assert_layout!(RethHeader, size = 16, va @ 0, rkey @ 8, dma_len @ 12);

/// A RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RethRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: RKey,
    /// Length of the whole transfer in bytes.
    pub dma_len: u32,
}

impl HeaderRepr for RethRepr {
    type Header = RethHeader;

    fn parse(h: &RethHeader) -> Result<Self, WireError> {
        Ok(Self {
            va: h.va.get(),
            rkey: RKey::new(h.rkey.get()),
            dma_len: h.dma_len.get(),
        })
    }

    fn emit(&self, h: &mut RethHeader) {
        *h = RethHeader {
            va: Be64::new(self.va),
            rkey: Be32::new(self.rkey.get()),
            dma_len: Be32::new(self.dma_len),
        };
    }
}

/// Atomic extended transport header (IBA 9.3.4).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct AtomicEthHeader {
    /// Remote virtual address (8-byte aligned, checked by the responder).
    pub va: Be64,
    /// Remote key.
    pub rkey: Be32,
    /// Swap value (CmpSwap) or addend (FetchAdd).
    pub swap_add: Be64,
    /// Compare value (CmpSwap; ignored by FetchAdd).
    pub compare: Be64,
}
assert_layout!(AtomicEthHeader, size = 28, va @ 0, rkey @ 8, swap_add @ 12, compare @ 20);

/// An AtomicETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicEthRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: RKey,
    /// Swap value (CmpSwap) or addend (FetchAdd).
    pub swap_add: u64,
    /// Compare value.
    pub compare: u64,
}

impl HeaderRepr for AtomicEthRepr {
    type Header = AtomicEthHeader;

    fn parse(h: &AtomicEthHeader) -> Result<Self, WireError> {
        Ok(Self {
            va: h.va.get(),
            rkey: RKey::new(h.rkey.get()),
            swap_add: h.swap_add.get(),
            compare: h.compare.get(),
        })
    }

    fn emit(&self, h: &mut AtomicEthHeader) {
        *h = AtomicEthHeader {
            va: Be64::new(self.va),
            rkey: Be32::new(self.rkey.get()),
            swap_add: Be64::new(self.swap_add),
            compare: Be64::new(self.compare),
        };
    }
}

/// Declares a 5-bit code newtype (values 0..=31).
macro_rules! code5 {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
        pub struct $name(u8);

        impl $name {
            /// The largest code.
            pub const MAX: Self = Self(31);

            /// A code below 32, else `None`.
            pub const fn new(code: u8) -> Option<Self> {
                if code <= 31 { Some(Self(code)) } else { None }
            }

            /// The 5-bit code.
            pub const fn code(self) -> u8 {
                self.0
            }
        }
    };
}

code5!(
    /// The 5-bit encoded credit count of an ACK; 31 means the
    /// responder gives no credit information.
    CreditCode
);

impl CreditCode {
    /// "No credit information" (the responder has an SRQ or does not count).
    pub const NONE: Self = Self(31);
}

code5!(
    /// The 5-bit RNR NAK timer code: how long the requester waits before
    /// retrying (code 0 is the longest, 655.36 ms).
    RnrTimer
);

/// Why a responder NAKed (AETH syndrome 011xxxxx, IBA 9.3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum NakCode {
    /// The PSN is ahead of the expected one: the requester retries from
    /// the NAK's PSN.
    PsnSequenceError = 0,
    /// Invalid request (bad opcode sequence, unsupported operation,
    /// misaligned atomic, ...).
    InvalidRequest = 1,
    /// R_Key or access violation.
    RemoteAccessError = 2,
    /// The responder could not complete the request (bad receive WQE, ...).
    RemoteOperationalError = 3,
    /// Invalid RD request (reliable datagram only; parsed for completeness).
    InvalidRdRequest = 4,
}

impl NakCode {
    /// Every code.
    pub const ALL: &'static [Self] = &[
        Self::PsnSequenceError,
        Self::InvalidRequest,
        Self::RemoteAccessError,
        Self::RemoteOperationalError,
        Self::InvalidRdRequest,
    ];
}

/// The AETH syndrome byte, decoded (IBA 9.3.5):
/// `0 00 ccccc` ACK with credit code, `0 01 ttttt` RNR NAK with timer code,
/// `0 11 nnnnn` NAK with code 0–4. Everything else is reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// Positive acknowledge.
    Ack {
        /// Encoded end-to-end credits.
        credits: CreditCode,
    },
    /// Receiver not ready: retry after the timer.
    RnrNak {
        /// The timer code.
        timer: RnrTimer,
    },
    /// Negative acknowledge.
    Nak(NakCode),
}

impl Syndrome {
    /// Decodes a syndrome byte; reserved encodings are an error.
    pub const fn from_byte(byte: u8) -> Result<Self, WireError> {
        let low = byte & 0x1F;
        match byte >> 5 {
            0b000 => Ok(Self::Ack {
                credits: CreditCode(low),
            }),
            0b001 => Ok(Self::RnrNak {
                timer: RnrTimer(low),
            }),
            0b011 => match low {
                0 => Ok(Self::Nak(NakCode::PsnSequenceError)),
                1 => Ok(Self::Nak(NakCode::InvalidRequest)),
                2 => Ok(Self::Nak(NakCode::RemoteAccessError)),
                3 => Ok(Self::Nak(NakCode::RemoteOperationalError)),
                4 => Ok(Self::Nak(NakCode::InvalidRdRequest)),
                _ => Err(WireError::BadSyndrome { syndrome: byte }),
            },
            _ => Err(WireError::BadSyndrome { syndrome: byte }),
        }
    }

    /// The syndrome byte.
    pub const fn to_byte(self) -> u8 {
        match self {
            Self::Ack { credits } => credits.0,
            Self::RnrNak { timer } => 0x20 | timer.0,
            Self::Nak(code) => 0x60 | code as u8,
        }
    }
}

impl TryFrom<u8> for Syndrome {
    type Error = WireError;

    fn try_from(byte: u8) -> Result<Self, WireError> {
        Self::from_byte(byte)
    }
}

/// A message sequence number (24 bits, wrapping), carried in the AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Msn(u32);

impl Msn {
    /// The largest MSN.
    pub const MAX: Self = Self(0x00FF_FFFF);

    /// A value below 2^24, else `None`.
    pub const fn new(value: u32) -> Option<Self> {
        if value <= Self::MAX.0 {
            Some(Self(value))
        } else {
            None
        }
    }

    /// The low 24 bits of `value`.
    pub const fn from_low_bits(value: u32) -> Self {
        Self(value & Self::MAX.0)
    }

    /// The value, below 2^24.
    pub const fn get(self) -> u32 {
        self.0
    }

    /// The next MSN, modulo 2^24.
    pub const fn next(self) -> Self {
        Self::from_low_bits(self.0.wrapping_add(1))
    }
}

/// ACK extended transport header (IBA 9.3.5).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct AethHeader {
    /// The syndrome (see [`Syndrome`]).
    pub syndrome: u8,
    /// The message sequence number (24 bits).
    pub msn: [u8; 3],
}
assert_layout!(AethHeader, size = 4, syndrome @ 0, msn @ 1);

impl AethHeader {
    /// The MSN.
    pub const fn msn(&self) -> Msn {
        Msn(u24_from_be(self.msn))
    }
}

/// An AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AethRepr {
    /// ACK, RNR NAK or NAK.
    pub syndrome: Syndrome,
    /// The responder's message sequence number.
    pub msn: Msn,
}

impl HeaderRepr for AethRepr {
    type Header = AethHeader;

    fn parse(h: &AethHeader) -> Result<Self, WireError> {
        Ok(Self {
            syndrome: Syndrome::try_from(h.syndrome)?,
            msn: h.msn(),
        })
    }

    fn emit(&self, h: &mut AethHeader) {
        *h = AethHeader {
            syndrome: self.syndrome.to_byte(),
            msn: u24_to_be(self.msn.get()),
        };
    }
}

/// Atomic ACK extended transport header (IBA 9.3.6).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct AtomicAckEthHeader {
    /// The value at the target address before the atomic.
    pub orig_remote_data: Be64,
}
assert_layout!(AtomicAckEthHeader, size = 8, orig_remote_data @ 0);

/// An AtomicAckETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicAckEthRepr {
    /// The value at the target address before the atomic.
    pub orig_remote_data: u64,
}

impl HeaderRepr for AtomicAckEthRepr {
    type Header = AtomicAckEthHeader;

    fn parse(h: &AtomicAckEthHeader) -> Result<Self, WireError> {
        Ok(Self {
            orig_remote_data: h.orig_remote_data.get(),
        })
    }

    fn emit(&self, h: &mut AtomicAckEthHeader) {
        h.orig_remote_data = Be64::new(self.orig_remote_data);
    }
}

/// Datagram extended transport header (IBA 9.3.2).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct DethHeader {
    /// The queue key.
    pub qkey: QKey,
    /// Reserved.
    pub reserved_at_4: u8,
    /// The source QP (24 bits).
    pub src_qp: [u8; 3],
}
assert_layout!(DethHeader, size = 8, qkey @ 0, reserved_at_4 @ 4, src_qp @ 5);

impl DethHeader {
    /// The source QP.
    pub const fn src_qp(&self) -> Qpn {
        Qpn::from_low_bits(u24_from_be(self.src_qp))
    }
}

/// A DETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DethRepr {
    /// The queue key.
    pub qkey: QKey,
    /// The sender's QP.
    pub src_qp: Qpn,
}

impl HeaderRepr for DethRepr {
    type Header = DethHeader;

    fn parse(h: &DethHeader) -> Result<Self, WireError> {
        Ok(Self {
            qkey: h.qkey,
            src_qp: h.src_qp(),
        })
    }

    fn emit(&self, h: &mut DethHeader) {
        *h = DethHeader {
            qkey: self.qkey,
            reserved_at_4: 0,
            src_qp: u24_to_be(self.src_qp.get()),
        };
    }
}

/// Immediate data extended transport header (IBA 9.3.7).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct ImmDtHeader {
    /// Opaque immediate data.
    pub imm: Be32,
}
assert_layout!(ImmDtHeader, size = 4, imm @ 0);

/// An ImmDt: opaque data kept in network order, as the verbs layer holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImmDtRepr {
    /// The immediate data.
    pub imm: Be32,
}

impl HeaderRepr for ImmDtRepr {
    type Header = ImmDtHeader;

    fn parse(h: &ImmDtHeader) -> Result<Self, WireError> {
        Ok(Self { imm: h.imm })
    }

    fn emit(&self, h: &mut ImmDtHeader) {
        h.imm = self.imm;
    }
}

/// Invalidate extended transport header (IBA 9.3.8).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct IethHeader {
    /// The R_Key the responder invalidates.
    pub rkey: Be32,
}
assert_layout!(IethHeader, size = 4, rkey @ 0);

/// An IETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IethRepr {
    /// The R_Key to invalidate.
    pub rkey: RKey,
}

impl HeaderRepr for IethRepr {
    type Header = IethHeader;

    fn parse(h: &IethHeader) -> Result<Self, WireError> {
        Ok(Self {
            rkey: RKey::new(h.rkey.get()),
        })
    }

    fn emit(&self, h: &mut IethHeader) {
        h.rkey = Be32::new(self.rkey.get());
    }
}

/// The extension headers of one packet, one variant per [`ExtLayout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtRepr {
    /// No extension header.
    None,
    /// ImmDt.
    ImmDt(ImmDtRepr),
    /// RETH.
    Reth(RethRepr),
    /// RETH, ImmDt.
    RethImmDt(RethRepr, ImmDtRepr),
    /// IETH.
    Ieth(IethRepr),
    /// AETH.
    Aeth(AethRepr),
    /// AETH, AtomicAckETH.
    AethAtomicAckEth(AethRepr, AtomicAckEthRepr),
    /// AtomicETH.
    AtomicEth(AtomicEthRepr),
    /// DETH.
    Deth(DethRepr),
    /// DETH, ImmDt.
    DethImmDt(DethRepr, ImmDtRepr),
}

/// Parses two consecutive headers.
fn parse2<A: HeaderRepr, B: HeaderRepr>(bytes: &[u8]) -> Result<(A, B, &[u8]), WireError> {
    let (a, rest) = A::parse_prefix(bytes)?;
    let (b, rest) = B::parse_prefix(rest)?;
    Ok((a, b, rest))
}

impl ExtRepr {
    /// Which headers these are.
    pub const fn layout(&self) -> ExtLayout {
        match self {
            Self::None => ExtLayout::None,
            Self::ImmDt(_) => ExtLayout::ImmDt,
            Self::Reth(_) => ExtLayout::Reth,
            Self::RethImmDt(..) => ExtLayout::RethImmDt,
            Self::Ieth(_) => ExtLayout::Ieth,
            Self::Aeth(_) => ExtLayout::Aeth,
            Self::AethAtomicAckEth(..) => ExtLayout::AethAtomicAckEth,
            Self::AtomicEth(_) => ExtLayout::AtomicEth,
            Self::Deth(_) => ExtLayout::Deth,
            Self::DethImmDt(..) => ExtLayout::DethImmDt,
        }
    }

    /// Bytes on the wire.
    pub const fn buffer_len(&self) -> usize {
        self.layout().wire_len()
    }

    /// Reads the headers of `layout` from the front of `bytes`, returning
    /// them and the bytes after them.
    pub fn parse(layout: ExtLayout, bytes: &[u8]) -> Result<(Self, &[u8]), WireError> {
        Ok(match layout {
            ExtLayout::None => (Self::None, bytes),
            ExtLayout::ImmDt => {
                let (i, rest) = ImmDtRepr::parse_prefix(bytes)?;
                (Self::ImmDt(i), rest)
            }
            ExtLayout::Reth => {
                let (r, rest) = RethRepr::parse_prefix(bytes)?;
                (Self::Reth(r), rest)
            }
            ExtLayout::RethImmDt => {
                let (r, i, rest) = parse2(bytes)?;
                (Self::RethImmDt(r, i), rest)
            }
            ExtLayout::Ieth => {
                let (i, rest) = IethRepr::parse_prefix(bytes)?;
                (Self::Ieth(i), rest)
            }
            ExtLayout::Aeth => {
                let (a, rest) = AethRepr::parse_prefix(bytes)?;
                (Self::Aeth(a), rest)
            }
            ExtLayout::AethAtomicAckEth => {
                let (a, o, rest) = parse2(bytes)?;
                (Self::AethAtomicAckEth(a, o), rest)
            }
            ExtLayout::AtomicEth => {
                let (a, rest) = AtomicEthRepr::parse_prefix(bytes)?;
                (Self::AtomicEth(a), rest)
            }
            ExtLayout::Deth => {
                let (d, rest) = DethRepr::parse_prefix(bytes)?;
                (Self::Deth(d), rest)
            }
            ExtLayout::DethImmDt => {
                let (d, i, rest) = parse2(bytes)?;
                (Self::DethImmDt(d, i), rest)
            }
        })
    }

    /// Writes the headers at the front of `out`, returning the bytes after.
    pub fn emit<'b>(&self, out: &'b mut [u8]) -> Result<&'b mut [u8], WireError> {
        match self {
            Self::None => Ok(out),
            Self::ImmDt(i) => i.emit_prefix(out),
            Self::Reth(r) => r.emit_prefix(out),
            Self::RethImmDt(r, i) => i.emit_prefix(r.emit_prefix(out)?),
            Self::Ieth(i) => i.emit_prefix(out),
            Self::Aeth(a) => a.emit_prefix(out),
            Self::AethAtomicAckEth(a, o) => o.emit_prefix(a.emit_prefix(out)?),
            Self::AtomicEth(a) => a.emit_prefix(out),
            Self::Deth(d) => d.emit_prefix(out),
            Self::DethImmDt(d, i) => i.emit_prefix(d.emit_prefix(out)?),
        }
    }

    /// The RETH, if present.
    pub const fn reth(&self) -> Option<&RethRepr> {
        match self {
            Self::Reth(r) | Self::RethImmDt(r, _) => Some(r),
            _ => None,
        }
    }

    /// The AETH, if present.
    pub const fn aeth(&self) -> Option<&AethRepr> {
        match self {
            Self::Aeth(a) | Self::AethAtomicAckEth(a, _) => Some(a),
            _ => None,
        }
    }

    /// The DETH, if present.
    pub const fn deth(&self) -> Option<&DethRepr> {
        match self {
            Self::Deth(d) | Self::DethImmDt(d, _) => Some(d),
            _ => None,
        }
    }

    /// The AtomicETH, if present.
    pub const fn atomic_eth(&self) -> Option<&AtomicEthRepr> {
        match self {
            Self::AtomicEth(a) => Some(a),
            _ => None,
        }
    }

    /// The AtomicAckETH, if present.
    pub const fn atomic_ack_eth(&self) -> Option<&AtomicAckEthRepr> {
        match self {
            Self::AethAtomicAckEth(_, o) => Some(o),
            _ => None,
        }
    }

    /// The immediate data, if present.
    pub const fn imm(&self) -> Option<Be32> {
        match self {
            Self::ImmDt(i) | Self::RethImmDt(_, i) | Self::DethImmDt(_, i) => Some(i.imm),
            _ => None,
        }
    }

    /// The R_Key to invalidate, if present.
    pub const fn ieth(&self) -> Option<RKey> {
        match self {
            Self::Ieth(i) => Some(i.rkey),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testing::assert_literal;

    #[test]
    fn reth_literal() {
        let bytes = [
            0x00, 0x00, 0x7F, 0x12, 0x34, 0x56, 0x78, 0x90, // VA
            0x00, 0x00, 0x34, 0x02, // R_Key
            0x00, 0x01, 0x00, 0x00, // DMA length 64 KiB
        ];
        assert_literal(
            &bytes,
            &RethRepr {
                va: 0x0000_7F12_3456_7890,
                rkey: RKey::new(0x3402),
                dma_len: 0x1_0000,
            },
        );
    }

    #[test]
    fn atomic_eth_literal() {
        let bytes = [
            0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x08, // VA
            0xAB, 0xCD, 0xEF, 0x01, // R_Key
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x2A, // swap/add
            0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFE, // compare
        ];
        assert_literal(
            &bytes,
            &AtomicEthRepr {
                va: 0x1000_0008,
                rkey: RKey::new(0xABCD_EF01),
                swap_add: 42,
                compare: u64::MAX - 1,
            },
        );
    }

    #[test]
    fn aeth_literals() {
        let msn = Msn::new(0x01_0203).unwrap();
        let cases = [
            (
                0x1F,
                Syndrome::Ack {
                    credits: CreditCode::NONE,
                },
            ),
            (
                0x00,
                Syndrome::Ack {
                    credits: CreditCode::new(0).unwrap(),
                },
            ),
            (
                0x2E,
                Syndrome::RnrNak {
                    timer: RnrTimer::new(14).unwrap(),
                },
            ),
            (0x60, Syndrome::Nak(NakCode::PsnSequenceError)),
            (0x61, Syndrome::Nak(NakCode::InvalidRequest)),
            (0x62, Syndrome::Nak(NakCode::RemoteAccessError)),
            (0x63, Syndrome::Nak(NakCode::RemoteOperationalError)),
            (0x64, Syndrome::Nak(NakCode::InvalidRdRequest)),
        ];
        for (byte, syndrome) in cases {
            assert_literal(&[byte, 0x01, 0x02, 0x03], &AethRepr { syndrome, msn });
        }
    }

    #[test]
    fn every_syndrome_byte_decodes_or_is_reserved() {
        let mut valid = 0;
        for byte in 0..=u8::MAX {
            match Syndrome::try_from(byte) {
                Ok(s) => {
                    assert_eq!(s.to_byte(), byte);
                    valid += 1;
                }
                Err(e) => {
                    assert_eq!(e, WireError::BadSyndrome { syndrome: byte });
                    // Reserved: bit 7, the 10 class, NAK codes 5..31.
                    assert!(byte >= 0x80 || (0x40..0x60).contains(&byte) || byte >= 0x65);
                }
            }
        }
        assert_eq!(valid, 32 + 32 + NakCode::ALL.len());
    }

    #[test]
    fn deth_literal_ignores_reserved() {
        let bytes = [
            0x80, 0x01, 0x00, 0x00, // Q_Key (the GSI key)
            0x00, // reserved
            0x00, 0x00, 0x01, // source QP 1
        ];
        let repr = DethRepr {
            qkey: QKey::GSI,
            src_qp: Qpn::GSI,
        };
        assert_literal(&bytes, &repr);
        let mut dirty = bytes;
        dirty[4] = 0xFF;
        assert_eq!(DethRepr::parse_prefix(&dirty).unwrap().0, repr);
    }

    #[test]
    fn small_header_literals() {
        assert_literal(
            &[0x00, 0x00, 0x00, 0x00, 0x12, 0x34, 0x56, 0x78],
            &AtomicAckEthRepr {
                orig_remote_data: 0x1234_5678,
            },
        );
        assert_literal(
            &[0xDE, 0xAD, 0xBE, 0xEF],
            &ImmDtRepr {
                imm: Be32::new(0xDEAD_BEEF),
            },
        );
        assert_literal(
            &[0x00, 0x12, 0x34, 0x05],
            &IethRepr {
                rkey: RKey::new(0x0012_3405),
            },
        );
    }

    #[test]
    fn ext_repr_layouts_round_trip() {
        let reth = RethRepr {
            va: 1,
            rkey: RKey::new(2),
            dma_len: 3,
        };
        let imm = ImmDtRepr { imm: Be32::new(4) };
        let aeth = AethRepr {
            syndrome: Syndrome::Ack {
                credits: CreditCode::MAX,
            },
            msn: Msn::MAX,
        };
        let values = [
            ExtRepr::None,
            ExtRepr::ImmDt(imm),
            ExtRepr::Reth(reth),
            ExtRepr::RethImmDt(reth, imm),
            ExtRepr::Ieth(IethRepr { rkey: RKey::new(5) }),
            ExtRepr::Aeth(aeth),
            ExtRepr::AethAtomicAckEth(
                aeth,
                AtomicAckEthRepr {
                    orig_remote_data: 6,
                },
            ),
            ExtRepr::AtomicEth(AtomicEthRepr {
                va: 7,
                rkey: RKey::new(8),
                swap_add: 9,
                compare: 10,
            }),
            ExtRepr::Deth(DethRepr {
                qkey: QKey::new(11),
                src_qp: Qpn::MAX,
            }),
            ExtRepr::DethImmDt(
                DethRepr {
                    qkey: QKey::new(12),
                    src_qp: Qpn::new(13).unwrap(),
                },
                imm,
            ),
        ];
        for value in values {
            let len = value.buffer_len();
            let mut buf = [0xA5u8; 40];
            let rest = value.emit(&mut buf).unwrap();
            assert_eq!(rest.len(), 40 - len);
            let (parsed, rest) = ExtRepr::parse(value.layout(), &buf).unwrap();
            assert_eq!(parsed, value);
            assert_eq!(rest.len(), 40 - len);
            if len > 0 {
                assert!(matches!(
                    ExtRepr::parse(value.layout(), &buf[..len - 1]),
                    Err(WireError::Truncated { .. })
                ));
                assert!(value.emit(&mut buf[..len - 1]).is_err());
            }
        }
    }

    #[test]
    fn msn_wraps() {
        assert_eq!(Msn::MAX.next(), Msn::new(0).unwrap());
        assert_eq!(Msn::new(1 << 24), None);
        assert_eq!(Msn::from_low_bits(0x0100_0001).get(), 1);
    }
}
