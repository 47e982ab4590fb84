//! The Base Transport Header (IBA 9.2), present in every IB transport packet.
//!
//! ```text
//! byte 0      opcode
//! byte 1      SE (7) | MigReq (6) | PadCnt (5..4) | TVer (3..0)
//! bytes 2-3   P_Key
//! byte 4      FECN (7) | BECN (6) | reserved (5..0)   (RoCEv2: variant, ICRC-masked)
//! bytes 5-7   DestQP (24 bits)
//! byte 8      AckReq (7) | reserved (6..0)
//! bytes 9-11  PSN (24 bits)
//! ```
//!
//! Contract: [`BthRepr::parse`] rejects TVer != 0 ([`WireError::BadTver`])
//! and unknown opcodes ([`WireError::UnknownOpcode`]), in that order, and
//! ignores reserved bits (sent as zero). The pad count is not part of
//! [`BthRepr`]: it follows from the payload length, which only the packet
//! knows, so the packet layer writes it with [`Bth::set_pad_count`] (the
//! way it fills checksums) and validates it against the payload.

use ib_types::scalars::{PKey, Psn, Qpn};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::opcode::Opcode;
use super::{HeaderRepr, WireError, assert_layout, u24_from_be, u24_to_be};

/// Byte 1: solicited event.
const SE: u8 = 0x80;
/// Byte 1: migration request.
const MIG_REQ: u8 = 0x40;
/// Byte 1: pad count, 2 bits.
const PAD_SHIFT: u8 = 4;
/// Byte 1: transport header version, 4 bits.
const TVER_MASK: u8 = 0x0F;
/// Byte 4: forward explicit congestion notification.
const FECN: u8 = 0x80;
/// Byte 4: backward explicit congestion notification.
const BECN: u8 = 0x40;
/// Byte 8: acknowledge request.
const ACK_REQ: u8 = 0x80;

/// The Base Transport Header.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct Bth {
    /// The opcode byte (see [`Opcode`]).
    pub opcode: u8,
    /// SE, MigReq, PadCnt, TVer.
    pub flags: u8,
    /// The partition key.
    pub pkey: PKey,
    /// FECN, BECN and six reserved bits (IBA "Resv8a"; masked in the ICRC).
    pub fecn_becn: u8,
    /// The destination QP number.
    pub dest_qp: [u8; 3],
    /// AckReq and seven reserved bits.
    pub ack_req: u8,
    /// The packet sequence number.
    pub psn: [u8; 3],
}
assert_layout!(
    Bth,
    size = 12,
    opcode @ 0,
    flags @ 1,
    pkey @ 2,
    fecn_becn @ 4,
    dest_qp @ 5,
    ack_req @ 8,
    psn @ 9,
);

impl Bth {
    /// The byte offset of the ICRC-masked FECN/BECN byte.
    pub const VARIANT_BYTE: usize = core::mem::offset_of!(Bth, fecn_becn);

    /// The solicited event bit.
    pub const fn solicited(&self) -> bool {
        self.flags & SE != 0
    }

    /// The migration request bit.
    pub const fn mig_req(&self) -> bool {
        self.flags & MIG_REQ != 0
    }

    /// Pad bytes (0–3) between the payload and the ICRC.
    pub const fn pad_count(&self) -> u8 {
        (self.flags >> PAD_SHIFT) & 0x03
    }

    /// Sets the pad count (only the low 2 bits of `pad` are used).
    pub const fn set_pad_count(&mut self, pad: u8) {
        self.flags = (self.flags & !(0x03 << PAD_SHIFT)) | ((pad & 0x03) << PAD_SHIFT);
    }

    /// The transport header version.
    pub const fn tver(&self) -> u8 {
        self.flags & TVER_MASK
    }

    /// The FECN bit.
    pub const fn fecn(&self) -> bool {
        self.fecn_becn & FECN != 0
    }

    /// The BECN bit.
    pub const fn becn(&self) -> bool {
        self.fecn_becn & BECN != 0
    }

    /// The destination QP.
    pub const fn dest_qp(&self) -> Qpn {
        Qpn::from_low_bits(u24_from_be(self.dest_qp))
    }

    /// The acknowledge request bit.
    pub const fn ack_req(&self) -> bool {
        self.ack_req & ACK_REQ != 0
    }

    /// The packet sequence number.
    pub const fn psn(&self) -> Psn {
        Psn::from_low_bits(u24_from_be(self.psn))
    }
}

/// A validated BTH (without the pad count; see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BthRepr {
    /// The opcode.
    pub opcode: Opcode,
    /// Solicited event: the responder raises a solicited completion event.
    pub solicited: bool,
    /// Migration request (APM state; the simulator does not migrate).
    pub mig_req: bool,
    /// The partition key.
    pub pkey: PKey,
    /// Forward congestion notification (set by a congested switch).
    pub fecn: bool,
    /// Backward congestion notification.
    pub becn: bool,
    /// The destination QP.
    pub dest_qp: Qpn,
    /// Asks the responder for an acknowledge.
    pub ack_req: bool,
    /// The packet sequence number.
    pub psn: Psn,
}

impl HeaderRepr for BthRepr {
    type Header = Bth;

    fn parse(header: &Bth) -> Result<Self, WireError> {
        if header.tver() != 0 {
            return Err(WireError::BadTver {
                tver: header.tver(),
            });
        }
        Ok(Self {
            opcode: Opcode::try_from(header.opcode)?,
            solicited: header.solicited(),
            mig_req: header.mig_req(),
            pkey: header.pkey,
            fecn: header.fecn(),
            becn: header.becn(),
            dest_qp: header.dest_qp(),
            ack_req: header.ack_req(),
            psn: header.psn(),
        })
    }

    /// Writes the header with pad count 0 and TVer 0.
    fn emit(&self, header: &mut Bth) {
        let bit = |set: bool, mask: u8| if set { mask } else { 0 };
        *header = Bth {
            opcode: self.opcode.code(),
            flags: bit(self.solicited, SE) | bit(self.mig_req, MIG_REQ),
            pkey: self.pkey,
            fecn_becn: bit(self.fecn, FECN) | bit(self.becn, BECN),
            dest_qp: u24_to_be(self.dest_qp.get()),
            ack_req: bit(self.ack_req, ACK_REQ),
            psn: u24_to_be(self.psn.get()),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::split_header;
    use crate::wire::testing::assert_literal;
    use zerocopy::FromZeros;

    fn repr() -> BthRepr {
        BthRepr {
            opcode: Opcode::RcSendOnly,
            solicited: true,
            mig_req: false,
            pkey: PKey::DEFAULT,
            fecn: true,
            becn: false,
            dest_qp: Qpn::new(0x00_0012).unwrap(),
            ack_req: true,
            psn: Psn::new(0x12_3456).unwrap(),
        }
    }

    #[test]
    fn header_literal() {
        let bytes = [
            0x04, // RC SEND ONLY
            0x80, // SE, no MigReq, PadCnt 0, TVer 0
            0xFF, 0xFF, // P_Key
            0x80, // FECN
            0x00, 0x00, 0x12, // DestQP
            0x80, // AckReq
            0x12, 0x34, 0x56, // PSN
        ];
        assert_literal(&bytes, &repr());
    }

    #[test]
    fn every_flag_and_the_pad_count() {
        let bytes = [
            0x0A, // RC RDMA WRITE ONLY
            0x70, // MigReq, PadCnt 3
            0x80, 0x01, // P_Key full member of partition 1
            0x7F, // BECN; reserved bits set (ignored)
            0xFF, 0xFF, 0xFE, // DestQP
            0x7F, // no AckReq; reserved bits set (ignored)
            0xFF, 0xFF, 0xFF, // PSN
        ];
        let (h, _) = split_header::<Bth>(&bytes).unwrap();
        assert_eq!((h.pad_count(), h.tver()), (3, 0));
        let (parsed, _) = BthRepr::parse_prefix(&bytes).unwrap();
        let expected = BthRepr {
            opcode: Opcode::RcRdmaWriteOnly,
            solicited: false,
            mig_req: true,
            pkey: PKey::new(0x8001),
            fecn: false,
            becn: true,
            dest_qp: Qpn::new(0xFF_FFFE).unwrap(),
            ack_req: false,
            psn: Psn::MAX,
        };
        assert_eq!(parsed, expected);

        // Re-emitted: reserved bits zero, then the packet layer sets the pad.
        let mut out = Bth::new_zeroed();
        expected.emit(&mut out);
        out.set_pad_count(3);
        assert_eq!(
            out.as_bytes(),
            [
                0x0A, 0x70, 0x80, 0x01, 0x40, 0xFF, 0xFF, 0xFE, 0x00, 0xFF, 0xFF, 0xFF
            ]
        );
        out.set_pad_count(1);
        assert_eq!(out.flags, 0x50);
    }

    #[test]
    fn tver_then_opcode() {
        let mut bytes = [0u8; 12];
        bytes[0] = 0x15; // reserved opcode
        bytes[1] = 0x01; // TVer 1
        assert_eq!(
            BthRepr::parse_prefix(&bytes).unwrap_err(),
            WireError::BadTver { tver: 1 }
        );
        bytes[1] = 0;
        assert_eq!(
            BthRepr::parse_prefix(&bytes).unwrap_err(),
            WireError::UnknownOpcode { opcode: 0x15 }
        );
    }
}
