//! Completion queue entries (PRM 10.4).
//!
//! Contract:
//! - [`Cqe`] is the 32-byte layout; every bit pattern is a layout.
//! - The device builds entries with [`Cqe::new_send`] / [`Cqe::new_recv`]
//!   and the `with_*` methods, ending with [`Cqe::with_owner`], which sets
//!   the owner bit for the producer counter the entry is written at
//!   ([`owner::phase_for`]). The receive operation
//!   is a [`RecvOp`], so the opcode, the IMM/INV flags and the `imm` field
//!   cannot disagree.
//! - The driver checks [`Cqe::is_valid`] for its consumer counter, then
//!   reads the entry with [`Cqe::op`] or [`Cqe::to_work_completion`]. Codes
//!   (status, opcode) and 24-bit values are checked: an unknown code is an
//!   error, never a guess. Reserved bytes and the undefined bits of `flags`
//!   and `owner` are ignored on read (PRM conventions).
//! - Device rules this module fixes where the PRM leaves a gap: a send
//!   completion for a WQE whose opcode could not be decoded carries NOP
//!   (0x00); a receive completion in error that matched no message (a flush)
//!   carries SEND (0x01) and no IMM/INV flag. The R_Key of an INV completion
//!   is little-endian; immediate data is in network order.
//! - The device stores no `wr_id`: the driver finds it by queue and
//!   `wqe_index`, looking in the SRQ's table when [`CqeFlags::SRQ`] is set.
//!   For SMI/GSI QPs `qpn` is the QP's table index, which the driver maps
//!   back to QP0/QP1 itself.
//! - `wqe_index` is 16 bits, so a work queue (send ring in basic blocks,
//!   receive ring or SRQ in WQEs) is at most [`LOG_MAX_WQE_INDEX`]
//!   (`2^16` units): in a deeper ring two WQEs would answer to one index.

use bitflags::bitflags;
use ib_types::AbiError;
use ib_types::scalars::{Lid, Qpn};
use ib_types::wc::{WcFlags, WcOpcode, WcStatus, WorkCompletion};
use ib_types::wr::RKey;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::owner;
use crate::wqe::WqeOpcode;
use crate::{Be32, Le16, Le32};

/// `log2` of the most units (send basic blocks, receive WQEs) a work queue
/// may have: the ring a CQE's 16-bit `wqe_index` names without ambiguity.
pub const LOG_MAX_WQE_INDEX: u8 = 16;

bitflags! {
    /// CQE `flags` (PRM 10.4).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct CqeFlags: u8 {
        /// A receive completion.
        const RECV = 1 << 0;
        /// `imm` holds immediate data.
        const IMM = 1 << 1;
        /// `imm` holds the R_Key the message invalidated.
        const INV = 1 << 2;
        /// The first 40 bytes of the buffer hold the GRH / IPv4 header.
        const GRH = 1 << 3;
        /// The request had SE set.
        const SOLICITED = 1 << 4;
        /// The receive WQE came from an SRQ.
        const SRQ = 1 << 5;
    }
}

impl CqeFlags {
    /// The flags a receive's details may add: GRH, SOLICITED and SRQ.
    pub const DETAILS: Self = Self::GRH.union(Self::SOLICITED).union(Self::SRQ);
}

/// CQE layout (PRM 10.4, 32 bytes).
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
pub struct Cqe {
    /// The QP (24 bits; for SMI/GSI the QP's table index).
    pub qpn: Le32,
    /// Bytes transferred.
    pub byte_count: Le32,
    /// Immediate data (network order bytes), or the invalidated R_Key
    /// (little-endian).
    pub imm: [u8; 4],
    /// The sending QP (24 bits; UD receives).
    pub src_qp: Le32,
    /// The completed WQE's `wqe_index`.
    pub wqe_index: Le16,
    /// P_Key index (GSI receives).
    pub pkey_index: Le16,
    /// Source LID (0 on RoCEv2).
    pub slid: Le16,
    /// Service level.
    pub sl: u8,
    /// [`CqeFlags`].
    pub flags: u8,
    /// [`WqeOpcode`] of a send; for receives SEND, SEND_IMM, SEND_INV or
    /// RDMA_WRITE_IMM.
    pub opcode: u8,
    /// [`WcStatus`] code.
    pub status: u8,
    /// Device-specific error detail.
    pub vendor_err: u8,
    /// Reserved.
    pub reserved_at_0x1b: [u8; 4],
    /// Bit 0: the owner (phase) bit.
    pub owner: u8,
}

assert_layout!(
    Cqe,
    size = 32,
    qpn @ 0x00,
    byte_count @ 0x04,
    imm @ 0x08,
    src_qp @ 0x0C,
    wqe_index @ 0x10,
    pkey_index @ 0x12,
    slid @ 0x14,
    sl @ 0x16,
    flags @ 0x17,
    opcode @ 0x18,
    status @ 0x19,
    vendor_err @ 0x1A,
    reserved_at_0x1b @ 0x1B,
    owner @ 0x1F,
);

/// The message a receive completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecvOp {
    /// A send (also the operation of flushed receives).
    Send,
    /// A send with immediate data.
    SendImm(Be32),
    /// A send that invalidated an R_Key.
    SendInv(RKey),
    /// An RDMA write with immediate data.
    RdmaWriteImm(Be32),
}

impl RecvOp {
    /// The CQE opcode.
    pub const fn opcode(self) -> WqeOpcode {
        match self {
            Self::Send => WqeOpcode::Send,
            Self::SendImm(_) => WqeOpcode::SendImm,
            Self::SendInv(_) => WqeOpcode::SendInv,
            Self::RdmaWriteImm(_) => WqeOpcode::RdmaWriteImm,
        }
    }

    /// The work completion opcode.
    pub const fn wc_opcode(self) -> WcOpcode {
        match self {
            Self::RdmaWriteImm(_) => WcOpcode::RecvRdmaWithImm,
            _ => WcOpcode::Recv,
        }
    }

    /// The flags the operation implies (RECV, and IMM or INV).
    const fn flags(self) -> CqeFlags {
        match self {
            Self::Send => CqeFlags::RECV,
            Self::SendImm(_) | Self::RdmaWriteImm(_) => CqeFlags::RECV.union(CqeFlags::IMM),
            Self::SendInv(_) => CqeFlags::RECV.union(CqeFlags::INV),
        }
    }

    /// The `imm` field's bytes.
    const fn imm_bytes(self) -> [u8; 4] {
        match self {
            Self::Send => [0; 4],
            Self::SendImm(imm) | Self::RdmaWriteImm(imm) => imm.to_bytes(),
            Self::SendInv(rkey) => rkey.get().to_le_bytes(),
        }
    }
}

/// The operation a CQE reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CqeOp {
    /// A send queue completion: the WQE's opcode.
    Send(WqeOpcode),
    /// A receive completion.
    Recv(RecvOp),
}

/// The work completion opcode of a send CQE by its opcode byte; `None`
/// for a byte that is no [`WqeOpcode`] and for NOP (which has none of its
/// own). One load checks and maps the opcode (a byte indexes all 256
/// entries, so there is no bounds check).
const SEND_WC_OPCODES: [Option<WcOpcode>; 256] = {
    let mut table = [None; 256];
    let mut i = 0;
    while i < WqeOpcode::ALL.len() {
        let opcode = WqeOpcode::ALL[i];
        if let Some(op) = opcode.to_wr() {
            table[opcode.code() as usize] = Some(WcOpcode::for_send(op));
        }
        i += 1;
    }
    table
};

/// Why a CQE could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CqeError {
    /// An unknown status or opcode, or a QPN over 24 bits.
    #[error(transparent)]
    Abi(#[from] AbiError),
    /// The flags do not fit the opcode (IMM/INV on the wrong receive
    /// opcode, receive flags on a send completion, a send-only opcode on a
    /// receive).
    #[error("CQE flags {flags:#04x} do not fit opcode {opcode:#04x}")]
    Flags {
        /// The raw opcode.
        opcode: u8,
        /// The raw flags.
        flags: u8,
    },
    /// A successful NOP completion, which has no work completion opcode
    /// (verbs never post NOPs; the driver handles its own).
    #[error("a successful NOP completion has no work completion")]
    NopCompletion,
}

impl Cqe {
    /// A send queue completion for the WQE at `wqe_index`. Byte count,
    /// vendor error and owner are set with the `with_*` methods.
    pub const fn new_send(qpn: Qpn, wqe_index: u16, opcode: WqeOpcode, status: WcStatus) -> Self {
        Self {
            qpn: Le32::new(qpn.get()),
            byte_count: Le32::new(0),
            imm: [0; 4],
            src_qp: Le32::new(0),
            wqe_index: Le16::new(wqe_index),
            pkey_index: Le16::new(0),
            slid: Le16::new(0),
            sl: 0,
            flags: 0,
            opcode: opcode.code(),
            status: status.code(),
            vendor_err: 0,
            reserved_at_0x1b: [0; 4],
            owner: 0,
        }
    }

    /// A receive completion for the receive WQE at `wqe_index`.
    pub const fn new_recv(
        qpn: Qpn,
        wqe_index: u16,
        op: RecvOp,
        status: WcStatus,
        byte_count: u32,
    ) -> Self {
        let mut cqe = Self::new_send(qpn, wqe_index, op.opcode(), status);
        cqe.byte_count = Le32::new(byte_count);
        cqe.imm = op.imm_bytes();
        cqe.flags = op.flags().bits();
        cqe
    }

    /// Sets the byte count (RDMA reads and atomics on the send side).
    pub const fn with_byte_count(mut self, byte_count: u32) -> Self {
        self.byte_count = Le32::new(byte_count);
        self
    }

    /// Sets the vendor error byte.
    pub const fn with_vendor_err(mut self, vendor_err: u8) -> Self {
        self.vendor_err = vendor_err;
        self
    }

    /// Sets the source of a UD receive: sending QP, P_Key index, source LID
    /// and service level.
    pub const fn with_source(mut self, src_qp: Qpn, pkey_index: u16, slid: u16, sl: u8) -> Self {
        self.src_qp = Le32::new(src_qp.get());
        self.pkey_index = Le16::new(pkey_index);
        self.slid = Le16::new(slid);
        self.sl = sl;
        self
    }

    /// Adds receive details: only [`CqeFlags::DETAILS`] (GRH, SOLICITED,
    /// SRQ) are taken; RECV, IMM and INV come from the constructor.
    pub const fn with_details(mut self, details: CqeFlags) -> Self {
        self.flags |= details.intersection(CqeFlags::DETAILS).bits();
        self
    }

    /// Sets the owner bit for the entry written at producer counter
    /// `counter` of a ring of `2^log_entries` entries.
    pub const fn with_owner(mut self, counter: u32, log_entries: u8) -> Self {
        self.owner = owner::phase_for(counter, log_entries);
        self
    }

    /// Whether the entry holds the completion for consumer counter
    /// `counter`.
    pub const fn is_valid(&self, counter: u32, log_entries: u8) -> bool {
        owner::is_valid(self.owner, counter, log_entries)
    }

    /// The defined flags (undefined bits ignored).
    #[inline]
    pub const fn flags(&self) -> CqeFlags {
        CqeFlags::from_bits_truncate(self.flags)
    }

    /// The completed WQE's index.
    #[inline]
    pub const fn wqe_index(&self) -> u16 {
        self.wqe_index.get()
    }

    /// The local QP.
    #[inline]
    pub fn qpn(&self) -> Result<Qpn, CqeError> {
        Ok(Qpn::new(self.qpn.get())?)
    }

    /// The sending QP of a UD receive (0 otherwise).
    #[inline]
    pub fn src_qp(&self) -> Result<Qpn, CqeError> {
        Ok(Qpn::new(self.src_qp.get())?)
    }

    /// The completion status.
    #[inline]
    pub fn status(&self) -> Result<WcStatus, CqeError> {
        Ok(WcStatus::from_code(self.status)?)
    }

    /// The reported operation, checked against the flags.
    #[inline]
    pub fn op(&self) -> Result<CqeOp, CqeError> {
        let flags = self.flags();
        if !flags.contains(CqeFlags::RECV) {
            let opcode = WqeOpcode::from_code(self.opcode)?;
            return if flags.is_empty() {
                Ok(CqeOp::Send(opcode))
            } else {
                Err(self.mismatch())
            };
        }
        self.recv_op().map(CqeOp::Recv)
    }

    /// The operation of a receive completion (RECV set), checked against
    /// the flags.
    #[inline]
    fn recv_op(&self) -> Result<RecvOp, CqeError> {
        let opcode = WqeOpcode::from_code(self.opcode)?;
        let imm = Be32::from_bytes(self.imm);
        let key = RKey::new(u32::from_le_bytes(self.imm));
        let data = self
            .flags()
            .intersection(CqeFlags::IMM.union(CqeFlags::INV));
        let op = match opcode {
            WqeOpcode::Send => RecvOp::Send,
            WqeOpcode::SendImm => RecvOp::SendImm(imm),
            WqeOpcode::SendInv => RecvOp::SendInv(key),
            WqeOpcode::RdmaWriteImm => RecvOp::RdmaWriteImm(imm),
            _ => return Err(self.mismatch()),
        };
        if op.flags().difference(CqeFlags::RECV) != data {
            return Err(self.mismatch());
        }
        Ok(op)
    }

    /// A send completion's opcode where [`SEND_WC_OPCODES`] has none or
    /// flags are set: the error, in `op`'s order (an unknown opcode, then
    /// any flag, then a successful NOP), or an error NOP's `Send`.
    #[cold]
    fn send_without_table(&self, status: WcStatus) -> Result<WcOpcode, CqeError> {
        match self.op()? {
            CqeOp::Send(opcode) => match opcode.to_wr() {
                Some(op) => Ok(WcOpcode::for_send(op)),
                None if !status.is_success() => Ok(WcOpcode::Send),
                None => Err(CqeError::NopCompletion),
            },
            CqeOp::Recv(_) => Err(self.mismatch()),
        }
    }

    /// The error of flags that do not fit the opcode.
    fn mismatch(&self) -> CqeError {
        CqeError::Flags {
            opcode: self.opcode,
            flags: self.flags,
        }
    }

    /// The work completion this entry reports, for the work request
    /// `wr_id` the driver recorded at [`wqe_index`](Self::wqe_index).
    ///
    /// `imm_or_invalidated_rkey` holds the immediate data in network order
    /// as received, or the invalidated R_Key; `dlid_path_bits` is 0. An
    /// error completion of a NOP (a WQE whose opcode was garbage) reports
    /// [`WcOpcode::Send`]: the opcode of an error completion is undefined
    /// (IBA 11.4.2.1).
    #[inline]
    pub fn to_work_completion(&self, wr_id: u64) -> Result<WorkCompletion, CqeError> {
        let status = self.status()?;
        let mut wc = WorkCompletion {
            wr_id,
            byte_len: self.byte_count.get(),
            qp_num: self.qpn()?,
            src_qp: self.src_qp()?,
            vendor_err: self.vendor_err.into(),
            pkey_index: self.pkey_index.get(),
            slid: Lid::new(self.slid.get()),
            status,
            sl: self.sl,
            ..WorkCompletion::EMPTY
        };
        if !self.flags().contains(CqeFlags::RECV) {
            // As `op`'s send case and the opcode's mapping, by table.
            match SEND_WC_OPCODES[usize::from(self.opcode)] {
                Some(op) if self.flags().is_empty() => wc.opcode = op,
                _ => wc.opcode = self.send_without_table(status)?,
            }
            return Ok(wc);
        }
        let op = self.recv_op()?;
        wc.opcode = op.wc_opcode();
        match op {
            RecvOp::SendImm(imm) | RecvOp::RdmaWriteImm(imm) => wc.set_immediate(imm),
            RecvOp::SendInv(rkey) => wc.set_invalidated_rkey(rkey),
            RecvOp::Send => {}
        }
        if self.flags().contains(CqeFlags::GRH) {
            wc.flags |= WcFlags::GRH;
        }
        Ok(wc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A way to damage a valid value, and what the damage is.
    type Corruption<T> = (fn(&mut T), &'static str);

    fn qpn(n: u32) -> Qpn {
        Qpn::new(n).unwrap()
    }

    #[test]
    fn ud_receive_image() {
        let cqe = Cqe::new_recv(
            qpn(0x12_3456),
            0xBEEF,
            RecvOp::SendImm(Be32::from_bytes([0xDE, 0xAD, 0xBE, 0xEF])),
            WcStatus::Success,
            0x128,
        )
        .with_source(qpn(0x00_0042), 3, 0, 5)
        .with_details(CqeFlags::GRH | CqeFlags::SOLICITED | CqeFlags::RECV)
        .with_owner(0, 4);
        #[rustfmt::skip]
        let expected: [u8; 32] = [
            0x56, 0x34, 0x12, 0x00,   // qpn
            0x28, 0x01, 0x00, 0x00,   // byte_count
            0xDE, 0xAD, 0xBE, 0xEF,   // imm, network order
            0x42, 0x00, 0x00, 0x00,   // src_qp
            0xEF, 0xBE, 0x03, 0x00,   // wqe_index, pkey_index
            0x00, 0x00, 0x05,         // slid, sl
            0x1B,                     // flags: RECV | IMM | GRH | SOLICITED
            0x02, 0x00, 0x00,         // opcode SEND_IMM, status, vendor_err
            0, 0, 0, 0,               // reserved
            0x01,                     // owner, first pass
        ];
        assert_eq!(cqe.as_bytes(), &expected);

        let wc = cqe.to_work_completion(77).unwrap();
        assert_eq!(wc.wr_id, 77);
        assert_eq!(wc.opcode, WcOpcode::Recv);
        assert_eq!(wc.flags, WcFlags::WITH_IMM | WcFlags::GRH);
        assert_eq!(wc.immediate(), Some(Be32::new(0xDEAD_BEEF)));
        assert_eq!(
            (wc.byte_len, wc.qp_num, wc.src_qp, wc.pkey_index, wc.sl),
            (0x128, qpn(0x12_3456), qpn(0x42), 3, 5)
        );
        assert_eq!(cqe.wqe_index(), 0xBEEF);
    }

    #[test]
    fn send_image() {
        let cqe = Cqe::new_send(qpn(7), 0x0040, WqeOpcode::RdmaRead, WcStatus::RemAccessErr)
            .with_byte_count(0x1000)
            .with_vendor_err(0x33)
            .with_owner(16, 4);
        let mut expected = [0u8; 32];
        expected[0] = 7;
        expected[4..8].copy_from_slice(&[0, 0x10, 0, 0]);
        expected[0x10] = 0x40;
        expected[0x18..0x1B].copy_from_slice(&[0x06, 0x0A, 0x33]);
        expected[0x1F] = 0; // second pass
        assert_eq!(cqe.as_bytes(), &expected);
        let wc = cqe.to_work_completion(1).unwrap();
        assert_eq!(
            (wc.opcode, wc.status, wc.vendor_err, wc.flags),
            (
                WcOpcode::RdmaRead,
                WcStatus::RemAccessErr,
                0x33,
                WcFlags::empty()
            )
        );
    }

    #[test]
    fn every_opcode_maps() {
        for &op in WqeOpcode::ALL {
            let cqe = Cqe::new_send(qpn(1), 0, op, WcStatus::Success);
            assert_eq!(cqe.op(), Ok(CqeOp::Send(op)));
            match op.to_wr() {
                Some(wr) => assert_eq!(
                    cqe.to_work_completion(0).unwrap().opcode,
                    WcOpcode::for_send(wr)
                ),
                None => assert_eq!(cqe.to_work_completion(0), Err(CqeError::NopCompletion)),
            }
        }
        // A garbage WQE's error completion is still a work completion.
        let nop = Cqe::new_send(qpn(1), 0, WqeOpcode::Nop, WcStatus::LocQpOpErr);
        assert_eq!(nop.to_work_completion(0).unwrap().opcode, WcOpcode::Send);

        let imm = Be32::new(0x0102_0304);
        let key = RKey::new(0x0A0B_0C0D);
        let table: &[(RecvOp, WcOpcode, WcFlags, u32)] = &[
            (RecvOp::Send, WcOpcode::Recv, WcFlags::empty(), 0),
            (
                RecvOp::SendImm(imm),
                WcOpcode::Recv,
                WcFlags::WITH_IMM,
                u32::from_ne_bytes([1, 2, 3, 4]),
            ),
            (
                RecvOp::SendInv(key),
                WcOpcode::Recv,
                WcFlags::WITH_INVALIDATE,
                0x0A0B_0C0D,
            ),
            (
                RecvOp::RdmaWriteImm(imm),
                WcOpcode::RecvRdmaWithImm,
                WcFlags::WITH_IMM,
                u32::from_ne_bytes([1, 2, 3, 4]),
            ),
        ];
        for &(op, opcode, flags, value) in table {
            let cqe = Cqe::new_recv(qpn(9), 3, op, WcStatus::Success, 10);
            assert_eq!(cqe.op(), Ok(CqeOp::Recv(op)));
            let wc = cqe.to_work_completion(0).unwrap();
            assert_eq!(
                (wc.opcode, wc.flags, wc.imm_or_invalidated_rkey),
                (opcode, flags, value)
            );
        }
        // The invalidated key is little-endian in the CQE.
        let inv = Cqe::new_recv(qpn(9), 3, RecvOp::SendInv(key), WcStatus::Success, 0);
        assert_eq!(inv.imm, [0x0D, 0x0C, 0x0B, 0x0A]);
    }

    #[test]
    fn garbage_is_rejected() {
        let good = Cqe::new_recv(
            qpn(9),
            3,
            RecvOp::SendImm(Be32::new(1)),
            WcStatus::Success,
            10,
        );
        assert!(good.to_work_completion(0).is_ok());
        let cases: &[Corruption<Cqe>] = &[
            (|c| c.status = 22, "unknown status"),
            (|c| c.opcode = 0x0B, "unknown opcode"),
            (
                |c| c.opcode = WqeOpcode::RdmaRead.code(),
                "send-only opcode on a receive",
            ),
            (|c| c.flags &= !CqeFlags::IMM.bits(), "SEND_IMM without IMM"),
            (|c| c.flags |= CqeFlags::INV.bits(), "IMM and INV"),
            (|c| c.opcode = WqeOpcode::Send.code(), "SEND with IMM"),
            (
                |c| c.flags = CqeFlags::GRH.bits(),
                "receive detail on a send",
            ),
            (|c| c.qpn = Le32::new(0x0100_0000), "QPN over 24 bits"),
            (
                |c| c.src_qp = Le32::new(0x8000_0000),
                "source QPN over 24 bits",
            ),
        ];
        for (corrupt, what) in cases {
            let mut cqe = good;
            corrupt(&mut cqe);
            assert!(cqe.to_work_completion(0).is_err(), "{what}");
        }
        // Reserved bytes and undefined bits are ignored on read.
        let mut cqe = good;
        cqe.reserved_at_0x1b = [0xFF; 4];
        cqe.flags |= 0xC0;
        cqe.owner |= 0xFE;
        assert_eq!(
            cqe.to_work_completion(0),
            good.to_work_completion(0),
            "reserved ignored"
        );
    }

    /// The send completion's table answers as `op` and the opcode mapping
    /// do, for every opcode byte, flags byte and status: the same work
    /// completion opcode, or the same error.
    #[test]
    fn send_completions_by_table_answer_as_the_opcode_rules() {
        for opcode in 0..=u8::MAX {
            for flags in [0u8, 0x40, 0x80, CqeFlags::GRH.bits(), CqeFlags::IMM.bits()] {
                for status in [WcStatus::Success, WcStatus::WrFlushErr] {
                    let mut cqe = Cqe::new_send(qpn(1), 0, WqeOpcode::Send, status);
                    cqe.opcode = opcode;
                    cqe.flags = flags;
                    let expected = match cqe.op() {
                        Err(e) => Err(e),
                        Ok(CqeOp::Send(op)) => match op.to_wr() {
                            Some(wr) => Ok(WcOpcode::for_send(wr)),
                            None if !status.is_success() => Ok(WcOpcode::Send),
                            None => Err(CqeError::NopCompletion),
                        },
                        Ok(CqeOp::Recv(_)) => unreachable!("no RECV flag"),
                    };
                    let got = cqe.to_work_completion(0).map(|wc| wc.opcode);
                    assert_eq!(got, expected, "opcode {opcode:#x} flags {flags:#x}");
                }
            }
        }
    }

    #[test]
    fn owner_over_wraps() {
        let log = 2;
        let mut ring = [Cqe::default(); 4];
        for counter in 0..40u32 {
            let slot = owner::slot(counter, log) as usize;
            assert!(!ring[slot].is_valid(counter, log), "stale at {counter}");
            ring[slot] = Cqe::new_send(qpn(1), counter as u16, WqeOpcode::Send, WcStatus::Success)
                .with_owner(counter, log);
            assert!(ring[slot].is_valid(counter, log));
        }
    }

    fn any_recv_op() -> impl Strategy<Value = RecvOp> {
        prop_oneof![
            Just(RecvOp::Send),
            any::<u32>().prop_map(|v| RecvOp::SendImm(Be32::new(v))),
            any::<u32>().prop_map(|v| RecvOp::SendInv(RKey::new(v))),
            any::<u32>().prop_map(|v| RecvOp::RdmaWriteImm(Be32::new(v))),
        ]
    }

    proptest! {
        #[test]
        fn recv_round_trip(
            op in any_recv_op(),
            q in 0..=Qpn::MAX.get(),
            src in 0..=Qpn::MAX.get(),
            index: u16,
            status in prop::sample::select(WcStatus::ALL),
            byte_count: u32,
            pkey_index: u16,
            sl: u8,
            details: u8,
        ) {
            let cqe = Cqe::new_recv(qpn(q), index, op, status, byte_count)
                .with_source(qpn(src), pkey_index, 0, sl)
                .with_details(CqeFlags::from_bits_truncate(details));
            prop_assert_eq!(cqe.op(), Ok(CqeOp::Recv(op)));
            let wc = cqe.to_work_completion(5).unwrap();
            prop_assert_eq!(wc.status, status);
            prop_assert_eq!(wc.opcode, op.wc_opcode());
            prop_assert_eq!((wc.qp_num.get(), wc.src_qp.get()), (q, src));
            prop_assert_eq!((wc.byte_len, wc.pkey_index, wc.sl), (byte_count, pkey_index, sl));
            prop_assert_eq!(wc.flags.contains(WcFlags::GRH), details & CqeFlags::GRH.bits() != 0);
            match op {
                RecvOp::SendImm(imm) | RecvOp::RdmaWriteImm(imm) => prop_assert_eq!(wc.immediate(), Some(imm)),
                RecvOp::SendInv(k) => prop_assert_eq!(wc.invalidated_rkey(), Some(k)),
                RecvOp::Send => prop_assert_eq!(wc.flags.difference(WcFlags::GRH), WcFlags::empty()),
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes: [u8; 32], wr_id: u64, counter: u32, log in 0u8..40) {
            let cqe = Cqe::read_from_bytes(&bytes).unwrap();
            let _ = cqe.is_valid(counter, log);
            if let Ok(wc) = cqe.to_work_completion(wr_id) {
                prop_assert_eq!(wc.wr_id, wr_id);
                prop_assert_eq!(wc.status.code(), bytes[0x19]);
                prop_assert_eq!(wc.opcode.is_recv(), bytes[0x17] & 1 != 0);
            }
        }
    }
}
