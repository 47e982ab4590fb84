//! Work completions: the status and opcode codes of IBA 11.6.2 and the
//! record a CQ poll writes into the caller's array.
//!
//! Contract:
//! - [`WcStatus`] and [`WcOpcode`] are closed `u8` codes; device CQE fields
//!   are read into them through `from_code`, so an unknown code is an error.
//! - [`WorkCompletion`] is not a byte-parsed ABI layout: it is filled on the
//!   fast path by a trusted in-process producer (the verbs provider), so it
//!   holds typed fields directly. It is `#[repr(C)]` with every byte named
//!   (no implicit padding), and its size and offsets are asserted at compile
//!   time so the user-mode plug-in and the access library agree on it.

use bitflags::bitflags;

use crate::abi::Be32;
use crate::scalars::{Lid, Qpn};
use crate::wr::{RKey, WrOpcode};

code_enum! {
    /// Completion status (IBA 11.6.2 "Completion Return Status").
    pub enum WcStatus: u8 {
        /// The work request completed successfully.
        Success = 0,
        /// Local length error: a receive buffer was too small, or a send
        /// exceeded the port's message size.
        LocLenErr = 1,
        /// Local QP operation error: an internal QP consistency error.
        LocQpOpErr = 2,
        /// Local EE context operation error (RD only).
        LocEecOpErr = 3,
        /// Local protection error: an SGE does not match its L_Key's region
        /// or rights.
        LocProtErr = 4,
        /// Work request flushed: the QP entered the Error state before the
        /// request was processed.
        WrFlushErr = 5,
        /// Memory window bind error.
        MwBindErr = 6,
        /// Bad response: unexpected transport opcode from the responder.
        BadRespErr = 7,
        /// Local access error: a protection error on a local buffer while
        /// writing data for an RDMA read response or atomic.
        LocAccessErr = 8,
        /// Remote invalid request: the responder saw an invalid request
        /// (unsupported opcode, too long, no receive WQE on RD...).
        RemInvReqErr = 9,
        /// Remote access error: a protection error at the responder.
        RemAccessErr = 10,
        /// Remote operation error: the responder could not complete the
        /// operation.
        RemOpErr = 11,
        /// Transport retry counter exceeded.
        RetryExcErr = 12,
        /// RNR NAK retry counter exceeded.
        RnrRetryExcErr = 13,
        /// Local RDD violation (RD only).
        LocRddViolErr = 14,
        /// Remote invalid RD request (RD only).
        RemInvRdReqErr = 15,
        /// Remote aborted error: the responder aborted the operation.
        RemAbortErr = 16,
        /// Invalid EE context number (RD only).
        InvEecnErr = 17,
        /// Invalid EE context state (RD only).
        InvEecStateErr = 18,
        /// Fatal error: the CA or QP failed.
        FatalErr = 19,
        /// Response timeout.
        RespTimeoutErr = 20,
        /// Any other error.
        GeneralErr = 21,
    }
}

impl WcStatus {
    /// True for [`Success`](Self::Success).
    pub const fn is_success(self) -> bool {
        matches!(self, Self::Success)
    }

    /// True for [`WrFlushErr`](Self::WrFlushErr): the request was never
    /// executed because its QP went to the Error state (IBA 10.3.1: all
    /// outstanding and later WRs complete with "flushed" status). A flush
    /// reports the QP's failure, not a failure of this request.
    pub const fn is_flush(self) -> bool {
        matches!(self, Self::WrFlushErr)
    }
}

code_enum! {
    /// The operation a completion reports. Receive-side opcodes have bit 7
    /// set.
    pub enum WcOpcode: u8 {
        /// A send (with or without immediate or invalidate).
        Send = 0,
        /// An RDMA write (with or without immediate) at the requester.
        RdmaWrite = 1,
        /// An RDMA read.
        RdmaRead = 2,
        /// An atomic compare and swap.
        CompareSwap = 3,
        /// An atomic fetch and add.
        FetchAdd = 4,
        /// A memory window bind.
        BindMw = 5,
        /// A local invalidate.
        LocalInvalidate = 6,
        /// A receive consumed by an incoming send.
        Recv = 0x80,
        /// A receive consumed by an incoming RDMA write with immediate.
        RecvRdmaWithImm = 0x81,
    }
}

impl WcOpcode {
    /// The completion opcode of a send work request's operation.
    pub const fn for_send(opcode: WrOpcode) -> Self {
        match opcode {
            WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::SendWithInvalidate => Self::Send,
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => Self::RdmaWrite,
            WrOpcode::RdmaRead => Self::RdmaRead,
            WrOpcode::CompareSwap => Self::CompareSwap,
            WrOpcode::FetchAdd => Self::FetchAdd,
            WrOpcode::BindMw => Self::BindMw,
            WrOpcode::LocalInvalidate => Self::LocalInvalidate,
        }
    }

    /// True for completions of receive work requests.
    pub const fn is_recv(self) -> bool {
        self.code() & 0x80 != 0
    }
}

bitflags! {
    /// Details of a completion.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct WcFlags: u8 {
        /// Immediate data is valid.
        const WITH_IMM = 1 << 0;
        /// A GRH was received: it occupies the first 40 bytes of the
        /// receive buffer (IBA 11.4.1.2; UD only).
        const GRH = 1 << 1;
        /// The send invalidated one of this side's R_Keys.
        const WITH_INVALIDATE = 1 << 2;
    }
}

/// One completion, as written by poll into a caller-provided array.
///
/// Fields that do not apply to a completion (UD addressing on a connected
/// QP, `byte_len` of a send) are zero. Error completions other than flushes
/// guarantee only `wr_id`, `status`, `qp_num` and `vendor_err`
/// (IBA 11.4.2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct WorkCompletion {
    /// The work request's cookie.
    pub wr_id: u64,
    /// Bytes transferred (receives, RDMA reads, atomics).
    pub byte_len: u32,
    /// With [`WcFlags::WITH_IMM`]: the immediate data in network order as
    /// received (the value's in-memory bytes are the wire bytes; read it with
    /// [`immediate`](Self::immediate)). With [`WcFlags::WITH_INVALIDATE`]:
    /// the invalidated R_Key as a host value. Otherwise zero.
    pub imm_or_invalidated_rkey: u32,
    /// The local QP.
    pub qp_num: Qpn,
    /// The sending QP (UD receives).
    pub src_qp: Qpn,
    /// Device-specific error detail for error completions.
    pub vendor_err: u32,
    /// P_Key index of the packet (GSI receives).
    pub pkey_index: u16,
    /// Source LID (UD receives).
    pub slid: Lid,
    /// Outcome.
    pub status: WcStatus,
    /// Operation.
    pub opcode: WcOpcode,
    /// Details.
    pub flags: WcFlags,
    /// Service level of the packet (UD receives).
    pub sl: u8,
    /// Destination LID path bits (UD receives).
    pub dlid_path_bits: u8,
    /// Zero; names the tail so the struct has no implicit padding.
    pub reserved_at_0x25: [u8; 3],
}

assert_layout!(
    WorkCompletion,
    size = 40,
    wr_id @ 0,
    byte_len @ 8,
    imm_or_invalidated_rkey @ 12,
    qp_num @ 16,
    src_qp @ 20,
    vendor_err @ 24,
    pkey_index @ 28,
    slid @ 30,
    status @ 32,
    opcode @ 33,
    flags @ 34,
    sl @ 35,
    dlid_path_bits @ 36,
    reserved_at_0x25 @ 37,
);

impl WorkCompletion {
    /// The value preallocated arrays start with: all zero, status
    /// `Success`, opcode `Send`.
    pub const EMPTY: Self = Self {
        wr_id: 0,
        byte_len: 0,
        imm_or_invalidated_rkey: 0,
        qp_num: Qpn::from_low_bits(0),
        src_qp: Qpn::from_low_bits(0),
        vendor_err: 0,
        pkey_index: 0,
        slid: Lid::UNASSIGNED,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        flags: WcFlags::empty(),
        sl: 0,
        dlid_path_bits: 0,
        reserved_at_0x25: [0; 3],
    };

    /// True unless the status is `Success` (flushes included).
    pub const fn is_error(&self) -> bool {
        !self.status.is_success()
    }

    /// The immediate data, if [`WcFlags::WITH_IMM`] is set.
    pub const fn immediate(&self) -> Option<Be32> {
        if self.flags.contains(WcFlags::WITH_IMM) {
            Some(Be32::from_bytes(self.imm_or_invalidated_rkey.to_ne_bytes()))
        } else {
            None
        }
    }

    /// The invalidated R_Key, if [`WcFlags::WITH_INVALIDATE`] is set.
    pub const fn invalidated_rkey(&self) -> Option<RKey> {
        if self.flags.contains(WcFlags::WITH_INVALIDATE) {
            Some(RKey::new(self.imm_or_invalidated_rkey))
        } else {
            None
        }
    }

    /// Stores immediate data and sets [`WcFlags::WITH_IMM`] (clearing
    /// [`WcFlags::WITH_INVALIDATE`], which shares the field).
    pub const fn set_immediate(&mut self, imm: Be32) {
        self.imm_or_invalidated_rkey = u32::from_ne_bytes(imm.to_bytes());
        self.flags = self
            .flags
            .difference(WcFlags::WITH_INVALIDATE)
            .union(WcFlags::WITH_IMM);
    }

    /// Stores an invalidated R_Key and sets [`WcFlags::WITH_INVALIDATE`]
    /// (clearing [`WcFlags::WITH_IMM`], which shares the field).
    pub const fn set_invalidated_rkey(&mut self, rkey: RKey) {
        self.imm_or_invalidated_rkey = rkey.get();
        self.flags = self
            .flags
            .difference(WcFlags::WITH_IMM)
            .union(WcFlags::WITH_INVALIDATE);
    }
}

impl Default for WorkCompletion {
    fn default() -> Self {
        Self::EMPTY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes_round_trip() {
        assert_eq!(WcStatus::ALL.len(), 22);
        for (i, &s) in WcStatus::ALL.iter().enumerate() {
            assert_eq!(s.code(), i as u8, "{s:?} is not numbered in order");
            assert_eq!(WcStatus::try_from(s.code()), Ok(s));
            assert_eq!(s.is_success(), s == WcStatus::Success);
            assert_eq!(s.is_flush(), s == WcStatus::WrFlushErr);
        }
        assert!(WcStatus::from_code(22).is_err());
    }

    #[test]
    fn opcode_codes_round_trip() {
        for &op in WcOpcode::ALL {
            assert_eq!(WcOpcode::from_code(op.code()), Ok(op));
            assert_eq!(
                op.is_recv(),
                matches!(op, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm)
            );
        }
        for bad in [7, 0x7F, 0x82, 0xFF] {
            assert!(WcOpcode::from_code(bad).is_err(), "{bad:#x}");
        }
    }

    #[test]
    fn send_opcodes_map() {
        use WcOpcode as C;
        use WrOpcode as W;
        let table: &[(WrOpcode, WcOpcode)] = &[
            (W::Send, C::Send),
            (W::SendWithImm, C::Send),
            (W::SendWithInvalidate, C::Send),
            (W::RdmaWrite, C::RdmaWrite),
            (W::RdmaWriteWithImm, C::RdmaWrite),
            (W::RdmaRead, C::RdmaRead),
            (W::CompareSwap, C::CompareSwap),
            (W::FetchAdd, C::FetchAdd),
            (W::BindMw, C::BindMw),
            (W::LocalInvalidate, C::LocalInvalidate),
        ];
        assert_eq!(table.len(), WrOpcode::ALL.len());
        for &(wr, wc) in table {
            assert_eq!(WcOpcode::for_send(wr), wc, "{wr:?}");
            assert!(!wc.is_recv());
        }
    }

    #[test]
    fn empty_and_error() {
        let mut wc = WorkCompletion::default();
        assert_eq!(wc, WorkCompletion::EMPTY);
        assert!(!wc.is_error());
        assert_eq!((wc.immediate(), wc.invalidated_rkey()), (None, None));
        for &(status, err) in &[
            (WcStatus::WrFlushErr, true),
            (WcStatus::RemAccessErr, true),
            (WcStatus::Success, false),
        ] {
            wc.status = status;
            assert_eq!(wc.is_error(), err, "{status:?}");
        }
    }

    #[test]
    fn immediate_keeps_wire_bytes() {
        let mut wc = WorkCompletion::EMPTY;
        let imm = Be32::from_bytes([0xDE, 0xAD, 0xBE, 0xEF]);
        wc.set_immediate(imm);
        assert_eq!(wc.flags, WcFlags::WITH_IMM);
        assert_eq!(
            wc.imm_or_invalidated_rkey.to_ne_bytes(),
            [0xDE, 0xAD, 0xBE, 0xEF]
        );
        assert_eq!(wc.immediate(), Some(imm));
        assert_eq!(wc.invalidated_rkey(), None);

        wc.set_invalidated_rkey(RKey::new(0x1234_5678));
        assert_eq!(wc.flags, WcFlags::WITH_INVALIDATE);
        assert_eq!(wc.imm_or_invalidated_rkey, 0x1234_5678);
        assert_eq!(wc.invalidated_rkey(), Some(RKey::new(0x1234_5678)));
        assert_eq!(wc.immediate(), None);

        wc.flags |= WcFlags::GRH;
        wc.set_immediate(imm);
        assert_eq!(wc.flags, WcFlags::WITH_IMM | WcFlags::GRH);
    }

    #[test]
    fn layout_is_dense() {
        assert_eq!(core::mem::size_of::<WcFlags>(), 1);
        // Every byte is a named field: the field sizes sum to the struct size.
        let fields = 8 + 4 + 4 + 4 + 4 + 4 + 2 + 2 + 1 + 1 + 1 + 1 + 1 + 3;
        assert_eq!(fields, core::mem::size_of::<WorkCompletion>());
    }
}
