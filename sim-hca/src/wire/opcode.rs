//! The BTH opcode and its metadata: one table for every opcode this device
//! speaks (IBA 9.2.1 for the codes, 9.3 for the header order).
//!
//! Contract: [`Opcode`] is an open code. [`Opcode::try_from`] rejects every
//! byte not in [`Opcode::ALL`] with [`WireError::UnknownOpcode`];
//! reliable datagram (0x40–0x5F), extended RC, and CNP (0x81) are not
//! implemented. Each opcode's [`OpcodeInfo`] is the single source of truth
//! for the transport engine and the parser: which transport it belongs to,
//! which extension headers follow the BTH (in wire order), whether it carries
//! payload, where it sits in a message, and what operation it is.

use ib_types::qp::QpType;

use super::WireError;
use super::ext::{
    AethHeader, AtomicAckEthHeader, AtomicEthHeader, DethHeader, IethHeader, ImmDtHeader,
    RethHeader,
};

/// The transport service an opcode belongs to: bits 7..5 of the opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Reliable connected (opcode prefix 000).
    Rc,
    /// Unreliable connected (prefix 001).
    Uc,
    /// Unreliable datagram (prefix 011).
    Ud,
}

impl Transport {
    /// The 3-bit prefix of this transport's opcodes.
    pub const fn prefix(self) -> u8 {
        match self {
            Self::Rc => 0b000,
            Self::Uc => 0b001,
            Self::Ud => 0b011,
        }
    }

    /// True if a QP of `qp_type` accepts packets of this transport (the
    /// receive check "opcode class matches QP type"; QP0 and QP1 are UD).
    pub const fn serves(self, qp_type: QpType) -> bool {
        matches!(
            (self, qp_type),
            (Self::Rc, QpType::Rc)
                | (Self::Uc, QpType::Uc)
                | (Self::Ud, QpType::Ud | QpType::Smi | QpType::Gsi)
        )
    }
}

/// Where a packet sits in its message (IBA 9.2.1: FIRST, MIDDLE, LAST,
/// ONLY). Single-packet operations (read requests, acknowledges, atomics)
/// are `Only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Position {
    /// First packet of a multi-packet message.
    First,
    /// Neither first nor last.
    Middle,
    /// Last packet of a multi-packet message.
    Last,
    /// The whole message in one packet.
    Only,
}

impl Position {
    /// True for packets that start a message (First, Only).
    pub const fn starts_message(self) -> bool {
        matches!(self, Self::First | Self::Only)
    }

    /// True for packets that end a message (Last, Only).
    pub const fn ends_message(self) -> bool {
        matches!(self, Self::Last | Self::Only)
    }
}

/// The operation an opcode belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// SEND (request).
    Send,
    /// RDMA WRITE (request).
    RdmaWrite,
    /// RDMA READ REQUEST (request).
    RdmaReadRequest,
    /// RDMA READ RESPONSE (response).
    RdmaReadResponse,
    /// ACKNOWLEDGE (response).
    Acknowledge,
    /// ATOMIC ACKNOWLEDGE (response).
    AtomicAcknowledge,
    /// CmpSwap (request).
    CompareSwap,
    /// FetchAdd (request).
    FetchAdd,
}

impl OpKind {
    /// Requests travel requester → responder; the others are responses.
    pub const fn is_request(self) -> bool {
        matches!(
            self,
            Self::Send
                | Self::RdmaWrite
                | Self::RdmaReadRequest
                | Self::CompareSwap
                | Self::FetchAdd
        )
    }
}

/// One extension header (IBA 9.3; RDETH and XRCETH are not implemented).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtHeader {
    /// Datagram ETH: Q_Key and source QP.
    Deth,
    /// RDMA ETH: virtual address, R_Key, DMA length.
    Reth,
    /// Atomic ETH: virtual address, R_Key, swap/add and compare data.
    AtomicEth,
    /// ACK ETH: syndrome and MSN.
    Aeth,
    /// Atomic ACK ETH: the original remote data.
    AtomicAckEth,
    /// Immediate data.
    ImmDt,
    /// Invalidate ETH: the R_Key to invalidate.
    Ieth,
}

impl ExtHeader {
    /// The header's size on the wire.
    pub const fn wire_len(self) -> usize {
        match self {
            Self::Deth => size_of::<DethHeader>(),
            Self::Reth => size_of::<RethHeader>(),
            Self::AtomicEth => size_of::<AtomicEthHeader>(),
            Self::Aeth => size_of::<AethHeader>(),
            Self::AtomicAckEth => size_of::<AtomicAckEthHeader>(),
            Self::ImmDt => size_of::<ImmDtHeader>(),
            Self::Ieth => size_of::<IethHeader>(),
        }
    }
}

/// The extension headers after the BTH: every combination an implemented
/// opcode uses, each listing its headers in wire order (IBA 9.3: DETH,
/// RETH, AtomicETH, AETH, AtomicAckETH, ImmDt, IETH).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtLayout {
    /// Nothing after the BTH.
    None,
    /// ImmDt.
    ImmDt,
    /// RETH.
    Reth,
    /// RETH, ImmDt.
    RethImmDt,
    /// IETH.
    Ieth,
    /// AETH.
    Aeth,
    /// AETH, AtomicAckETH.
    AethAtomicAckEth,
    /// AtomicETH.
    AtomicEth,
    /// DETH.
    Deth,
    /// DETH, ImmDt.
    DethImmDt,
}

impl ExtLayout {
    /// The headers, in wire order.
    pub const fn headers(self) -> &'static [ExtHeader] {
        use ExtHeader as H;
        match self {
            Self::None => &[],
            Self::ImmDt => &[H::ImmDt],
            Self::Reth => &[H::Reth],
            Self::RethImmDt => &[H::Reth, H::ImmDt],
            Self::Ieth => &[H::Ieth],
            Self::Aeth => &[H::Aeth],
            Self::AethAtomicAckEth => &[H::Aeth, H::AtomicAckEth],
            Self::AtomicEth => &[H::AtomicEth],
            Self::Deth => &[H::Deth],
            Self::DethImmDt => &[H::Deth, H::ImmDt],
        }
    }

    /// Total bytes of the extension headers.
    pub const fn wire_len(self) -> usize {
        let headers = self.headers();
        let mut total = 0;
        let mut i = 0;
        while i < headers.len() {
            total += headers[i].wire_len();
            i += 1;
        }
        total
    }

    /// True if the layout has `header`.
    pub const fn contains(self, header: ExtHeader) -> bool {
        let headers = self.headers();
        let mut i = 0;
        while i < headers.len() {
            if headers[i] as u8 == header as u8 {
                return true;
            }
            i += 1;
        }
        false
    }

    /// A short name, for error messages.
    pub const fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::ImmDt => "ImmDt",
            Self::Reth => "RETH",
            Self::RethImmDt => "RETH+ImmDt",
            Self::Ieth => "IETH",
            Self::Aeth => "AETH",
            Self::AethAtomicAckEth => "AETH+AtomicAckETH",
            Self::AtomicEth => "AtomicETH",
            Self::Deth => "DETH",
            Self::DethImmDt => "DETH+ImmDt",
        }
    }
}

/// What the table says about one opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpcodeInfo {
    /// The IBA name, such as `"RC SEND FIRST"`.
    pub name: &'static str,
    /// The transport service.
    pub transport: Transport,
    /// The operation.
    pub kind: OpKind,
    /// Where the packet sits in its message.
    pub position: Position,
    /// The extension headers after the BTH, in order.
    pub ext: ExtLayout,
    /// True if the packet carries payload (possibly zero bytes); false if
    /// any byte between the headers and the ICRC is an error.
    pub payload: bool,
}

impl OpcodeInfo {
    /// A request (requester → responder).
    pub const fn is_request(&self) -> bool {
        self.kind.is_request()
    }

    /// A response (responder → requester).
    pub const fn is_response(&self) -> bool {
        !self.kind.is_request()
    }

    /// Carries immediate data (an ImmDt header).
    pub const fn has_immediate(&self) -> bool {
        self.ext.contains(ExtHeader::ImmDt)
    }

    /// Carries an R_Key to invalidate (an IETH header).
    pub const fn has_invalidate(&self) -> bool {
        self.ext.contains(ExtHeader::Ieth)
    }

    /// Part of a SEND.
    pub const fn is_send(&self) -> bool {
        matches!(self.kind, OpKind::Send)
    }

    /// Part of an RDMA WRITE.
    pub const fn is_write(&self) -> bool {
        matches!(self.kind, OpKind::RdmaWrite)
    }

    /// Part of an RDMA READ (request or response).
    pub const fn is_read(&self) -> bool {
        matches!(
            self.kind,
            OpKind::RdmaReadRequest | OpKind::RdmaReadResponse
        )
    }

    /// Part of an atomic operation (CmpSwap, FetchAdd or their ATOMIC
    /// ACKNOWLEDGE).
    pub const fn is_atomic(&self) -> bool {
        matches!(
            self.kind,
            OpKind::CompareSwap | OpKind::FetchAdd | OpKind::AtomicAcknowledge
        )
    }

    /// Carries an AETH (acknowledges, read response FIRST/LAST/ONLY).
    pub const fn has_aeth(&self) -> bool {
        self.ext.contains(ExtHeader::Aeth)
    }
}

/// Declares [`Opcode`] and its [`OpcodeInfo`] from one table.
macro_rules! opcode_table {
    ($(
        $(#[$meta:meta])*
        $variant:ident = $code:literal, $name:literal,
            $transport:ident, $kind:ident, $position:ident, $ext:ident, $payload:literal;
    )+) => {
        /// A BTH opcode this device implements (IBA 9.2.1).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u8)]
        pub enum Opcode {
            $($(#[$meta])* $variant = $code,)+
        }

        impl Opcode {
            /// Every opcode, in code order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The opcode byte.
            pub const fn code(self) -> u8 {
                self as u8
            }

            /// Reads an opcode byte; unknown codes are an error.
            pub const fn from_code(code: u8) -> Result<Self, WireError> {
                match code {
                    $($code => Ok(Self::$variant),)+
                    opcode => Err(WireError::UnknownOpcode { opcode }),
                }
            }

            /// The table row of this opcode.
            pub const fn info(self) -> &'static OpcodeInfo {
                match self {
                    $(Self::$variant => &OpcodeInfo {
                        name: $name,
                        transport: Transport::$transport,
                        kind: OpKind::$kind,
                        position: Position::$position,
                        ext: ExtLayout::$ext,
                        payload: $payload,
                    },)+
                }
            }
        }
    };
}

opcode_table! {
    // variant = code, name,
    //     transport, operation, position, extension headers, payload;
    /// RC SEND FIRST.
    RcSendFirst = 0x00, "RC SEND FIRST", Rc, Send, First, None, true;
    /// RC SEND MIDDLE.
    RcSendMiddle = 0x01, "RC SEND MIDDLE", Rc, Send, Middle, None, true;
    /// RC SEND LAST.
    RcSendLast = 0x02, "RC SEND LAST", Rc, Send, Last, None, true;
    /// RC SEND LAST WITH IMMEDIATE.
    RcSendLastWithImmediate = 0x03, "RC SEND LAST WITH IMMEDIATE",
        Rc, Send, Last, ImmDt, true;
    /// RC SEND ONLY.
    RcSendOnly = 0x04, "RC SEND ONLY", Rc, Send, Only, None, true;
    /// RC SEND ONLY WITH IMMEDIATE.
    RcSendOnlyWithImmediate = 0x05, "RC SEND ONLY WITH IMMEDIATE",
        Rc, Send, Only, ImmDt, true;
    /// RC RDMA WRITE FIRST.
    RcRdmaWriteFirst = 0x06, "RC RDMA WRITE FIRST", Rc, RdmaWrite, First, Reth, true;
    /// RC RDMA WRITE MIDDLE.
    RcRdmaWriteMiddle = 0x07, "RC RDMA WRITE MIDDLE", Rc, RdmaWrite, Middle, None, true;
    /// RC RDMA WRITE LAST.
    RcRdmaWriteLast = 0x08, "RC RDMA WRITE LAST", Rc, RdmaWrite, Last, None, true;
    /// RC RDMA WRITE LAST WITH IMMEDIATE.
    RcRdmaWriteLastWithImmediate = 0x09, "RC RDMA WRITE LAST WITH IMMEDIATE",
        Rc, RdmaWrite, Last, ImmDt, true;
    /// RC RDMA WRITE ONLY.
    RcRdmaWriteOnly = 0x0A, "RC RDMA WRITE ONLY", Rc, RdmaWrite, Only, Reth, true;
    /// RC RDMA WRITE ONLY WITH IMMEDIATE.
    RcRdmaWriteOnlyWithImmediate = 0x0B, "RC RDMA WRITE ONLY WITH IMMEDIATE",
        Rc, RdmaWrite, Only, RethImmDt, true;
    /// RC RDMA READ REQUEST.
    RcRdmaReadRequest = 0x0C, "RC RDMA READ REQUEST",
        Rc, RdmaReadRequest, Only, Reth, false;
    /// RC RDMA READ RESPONSE FIRST.
    RcRdmaReadResponseFirst = 0x0D, "RC RDMA READ RESPONSE FIRST",
        Rc, RdmaReadResponse, First, Aeth, true;
    /// RC RDMA READ RESPONSE MIDDLE.
    RcRdmaReadResponseMiddle = 0x0E, "RC RDMA READ RESPONSE MIDDLE",
        Rc, RdmaReadResponse, Middle, None, true;
    /// RC RDMA READ RESPONSE LAST.
    RcRdmaReadResponseLast = 0x0F, "RC RDMA READ RESPONSE LAST",
        Rc, RdmaReadResponse, Last, Aeth, true;
    /// RC RDMA READ RESPONSE ONLY.
    RcRdmaReadResponseOnly = 0x10, "RC RDMA READ RESPONSE ONLY",
        Rc, RdmaReadResponse, Only, Aeth, true;
    /// RC ACKNOWLEDGE.
    RcAcknowledge = 0x11, "RC ACKNOWLEDGE", Rc, Acknowledge, Only, Aeth, false;
    /// RC ATOMIC ACKNOWLEDGE.
    RcAtomicAcknowledge = 0x12, "RC ATOMIC ACKNOWLEDGE",
        Rc, AtomicAcknowledge, Only, AethAtomicAckEth, false;
    /// RC CmpSwap.
    RcCompareSwap = 0x13, "RC COMPARE SWAP", Rc, CompareSwap, Only, AtomicEth, false;
    /// RC FetchAdd.
    RcFetchAdd = 0x14, "RC FETCH ADD", Rc, FetchAdd, Only, AtomicEth, false;
    /// RC SEND LAST WITH INVALIDATE.
    RcSendLastWithInvalidate = 0x16, "RC SEND LAST WITH INVALIDATE",
        Rc, Send, Last, Ieth, true;
    /// RC SEND ONLY WITH INVALIDATE.
    RcSendOnlyWithInvalidate = 0x17, "RC SEND ONLY WITH INVALIDATE",
        Rc, Send, Only, Ieth, true;

    /// UC SEND FIRST.
    UcSendFirst = 0x20, "UC SEND FIRST", Uc, Send, First, None, true;
    /// UC SEND MIDDLE.
    UcSendMiddle = 0x21, "UC SEND MIDDLE", Uc, Send, Middle, None, true;
    /// UC SEND LAST.
    UcSendLast = 0x22, "UC SEND LAST", Uc, Send, Last, None, true;
    /// UC SEND LAST WITH IMMEDIATE.
    UcSendLastWithImmediate = 0x23, "UC SEND LAST WITH IMMEDIATE",
        Uc, Send, Last, ImmDt, true;
    /// UC SEND ONLY.
    UcSendOnly = 0x24, "UC SEND ONLY", Uc, Send, Only, None, true;
    /// UC SEND ONLY WITH IMMEDIATE.
    UcSendOnlyWithImmediate = 0x25, "UC SEND ONLY WITH IMMEDIATE",
        Uc, Send, Only, ImmDt, true;
    /// UC RDMA WRITE FIRST.
    UcRdmaWriteFirst = 0x26, "UC RDMA WRITE FIRST", Uc, RdmaWrite, First, Reth, true;
    /// UC RDMA WRITE MIDDLE.
    UcRdmaWriteMiddle = 0x27, "UC RDMA WRITE MIDDLE", Uc, RdmaWrite, Middle, None, true;
    /// UC RDMA WRITE LAST.
    UcRdmaWriteLast = 0x28, "UC RDMA WRITE LAST", Uc, RdmaWrite, Last, None, true;
    /// UC RDMA WRITE LAST WITH IMMEDIATE.
    UcRdmaWriteLastWithImmediate = 0x29, "UC RDMA WRITE LAST WITH IMMEDIATE",
        Uc, RdmaWrite, Last, ImmDt, true;
    /// UC RDMA WRITE ONLY.
    UcRdmaWriteOnly = 0x2A, "UC RDMA WRITE ONLY", Uc, RdmaWrite, Only, Reth, true;
    /// UC RDMA WRITE ONLY WITH IMMEDIATE.
    UcRdmaWriteOnlyWithImmediate = 0x2B, "UC RDMA WRITE ONLY WITH IMMEDIATE",
        Uc, RdmaWrite, Only, RethImmDt, true;

    /// UD SEND ONLY.
    UdSendOnly = 0x64, "UD SEND ONLY", Ud, Send, Only, Deth, true;
    /// UD SEND ONLY WITH IMMEDIATE.
    UdSendOnlyWithImmediate = 0x65, "UD SEND ONLY WITH IMMEDIATE",
        Ud, Send, Only, DethImmDt, true;
}

impl Opcode {
    /// The opcode's name, such as `"RC SEND FIRST"`.
    pub const fn name(self) -> &'static str {
        self.info().name
    }
}

impl TryFrom<u8> for Opcode {
    type Error = WireError;

    fn try_from(code: u8) -> Result<Self, WireError> {
        Self::from_code(code)
    }
}

impl From<Opcode> for u8 {
    fn from(opcode: Opcode) -> u8 {
        opcode.code()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_is_known_or_rejected() {
        let mut known = 0;
        for code in 0..=u8::MAX {
            match Opcode::try_from(code) {
                Ok(op) => {
                    assert_eq!(op.code(), code);
                    known += 1;
                }
                Err(e) => assert_eq!(e, WireError::UnknownOpcode { opcode: code }),
            }
        }
        assert_eq!(known, Opcode::ALL.len());
        assert_eq!(known, 23 + 12 + 2);
        for reserved in [0x15, 0x18, 0x1F, 0x2C, 0x40, 0x60, 0x66, 0x81, 0xFF] {
            assert!(Opcode::try_from(reserved).is_err(), "{reserved:#x}");
        }
    }

    #[test]
    fn transport_is_the_top_three_bits() {
        for op in Opcode::ALL {
            assert_eq!(
                op.code() >> 5,
                op.info().transport.prefix(),
                "{}",
                op.name()
            );
            let prefix = match op.info().transport {
                Transport::Rc => "RC ",
                Transport::Uc => "UC ",
                Transport::Ud => "UD ",
            };
            assert!(op.name().starts_with(prefix));
        }
    }

    #[test]
    fn uc_mirrors_rc_sends_and_writes() {
        // IBA 9.2.1: UC opcodes are the RC codes 0x00-0x0B with prefix 001.
        for op in Opcode::ALL
            .iter()
            .filter(|o| o.info().transport == Transport::Uc)
        {
            let rc = Opcode::try_from(op.code() & 0x1F).unwrap().info();
            let uc = op.info();
            assert_eq!(
                (uc.kind, uc.position, uc.ext, uc.payload),
                (rc.kind, rc.position, rc.ext, rc.payload)
            );
            assert_eq!(&uc.name[3..], &rc.name[3..]);
        }
    }

    /// The table's columns agree with the rules of IBA 9.3, written
    /// independently here.
    #[test]
    fn columns_follow_the_header_rules() {
        for op in Opcode::ALL {
            let i = op.info();
            let name = i.name;
            // Immediate and invalidate are in the name exactly when the
            // headers are present.
            assert_eq!(
                i.has_immediate(),
                name.ends_with("WITH IMMEDIATE"),
                "{name}"
            );
            assert_eq!(
                i.has_invalidate(),
                name.ends_with("WITH INVALIDATE"),
                "{name}"
            );
            // RETH starts every write and every read request.
            let reth =
                (i.is_write() && i.position.starts_message()) || i.kind == OpKind::RdmaReadRequest;
            assert_eq!(i.ext.contains(ExtHeader::Reth), reth, "{name}");
            // AETH: acknowledges and the read responses that bound a message.
            let aeth = matches!(i.kind, OpKind::Acknowledge | OpKind::AtomicAcknowledge)
                || (i.kind == OpKind::RdmaReadResponse && i.position != Position::Middle);
            assert_eq!(i.has_aeth(), aeth, "{name}");
            assert_eq!(
                i.ext.contains(ExtHeader::AtomicEth),
                matches!(i.kind, OpKind::CompareSwap | OpKind::FetchAdd),
                "{name}"
            );
            assert_eq!(
                i.ext.contains(ExtHeader::AtomicAckEth),
                i.kind == OpKind::AtomicAcknowledge,
                "{name}"
            );
            assert_eq!(
                i.ext.contains(ExtHeader::Deth),
                i.transport == Transport::Ud,
                "{name}"
            );
            // Immediate data and invalidate only on the packet that ends a message.
            if i.has_immediate() || i.has_invalidate() {
                assert!(i.position.ends_message(), "{name}");
            }
            // Payload: sends, writes and read responses.
            let payload = matches!(
                i.kind,
                OpKind::Send | OpKind::RdmaWrite | OpKind::RdmaReadResponse
            );
            assert_eq!(i.payload, payload, "{name}");
            // Position words appear in the name of multi-packet operations.
            let word = match i.position {
                Position::First => "FIRST",
                Position::Middle => "MIDDLE",
                Position::Last => "LAST",
                Position::Only => "ONLY",
            };
            if payload {
                assert!(name.contains(word), "{name}");
            }
            assert!(i.is_request() != i.is_response());
        }
    }

    #[test]
    fn layouts_are_in_wire_order() {
        // IBA 9.3 order: DETH, RETH, AtomicETH, AETH, AtomicAckETH, ImmDt, IETH.
        let rank = |h: ExtHeader| h as u8;
        for op in Opcode::ALL {
            let headers = op.info().ext.headers();
            assert!(
                headers.windows(2).all(|w| rank(w[0]) < rank(w[1])),
                "{}",
                op.name()
            );
        }
        assert_eq!(ExtLayout::None.wire_len(), 0);
        assert_eq!(ExtLayout::RethImmDt.wire_len(), 20);
        assert_eq!(ExtLayout::AethAtomicAckEth.wire_len(), 12);
        assert_eq!(ExtLayout::AtomicEth.wire_len(), 28);
        assert_eq!(ExtLayout::DethImmDt.wire_len(), 12);
    }

    #[test]
    fn transport_serves_qp_types() {
        assert!(Transport::Rc.serves(QpType::Rc));
        assert!(!Transport::Rc.serves(QpType::Uc));
        assert!(Transport::Ud.serves(QpType::Gsi) && Transport::Ud.serves(QpType::Smi));
        assert!(!Transport::Ud.serves(QpType::Rc));
    }

    #[test]
    fn spot_checks() {
        let i = Opcode::RcRdmaWriteOnlyWithImmediate.info();
        assert_eq!(i.ext.headers(), &[ExtHeader::Reth, ExtHeader::ImmDt]);
        assert!(i.is_write() && i.has_immediate() && i.is_request());
        let i = Opcode::RcAtomicAcknowledge.info();
        assert!(i.is_atomic() && i.is_response() && !i.payload);
        assert_eq!(Opcode::try_from(0x64), Ok(Opcode::UdSendOnly));
        assert_eq!(u8::from(Opcode::RcSendOnlyWithInvalidate), 0x17);
    }
}
