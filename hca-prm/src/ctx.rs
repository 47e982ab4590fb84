//! Object contexts (PRM 6): buffer descriptors, and the QP, CQ, EQ and SRQ
//! contexts that `SW2HW_*` commands hand the device and `QUERY_*` commands
//! read back, plus the `MODIFY_QP` and `RESIZE_CQ` inputs.

use bitflags::bitflags;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::av::Av;
use crate::mpt::PAGE_SHIFT_RANGE;
use crate::{Le16, Le32, Le64};

/// A ring in host memory described by an MTT range (PRM 6.0), 16 bytes.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct BufDesc {
    /// First MTT entry.
    pub mtt_index: Le32,
    /// Offset of the ring in its first page, a multiple of 64.
    pub page_offset: Le32,
    /// Page size, log2 (12..=30).
    pub log_page_size: u8,
    /// Ring entries = 2^log_entries.
    pub log_entries: u8,
    /// Entry bytes = 2^log_stride.
    pub log_stride: u8,
    /// Reserved.
    pub reserved_at_0xb: [u8; 5],
}

assert_layout!(BufDesc, size = 16, mtt_index @ 0, page_offset @ 4, log_page_size @ 8,
    log_entries @ 9, log_stride @ 10, reserved_at_0xb @ 11);

/// Why a buffer descriptor is unusable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BufDescError {
    /// Page size outside 4 KiB..=1 GiB.
    #[error("page size 2^{0} out of range")]
    PageSize(u8),
    /// The offset is not a multiple of 64 or not inside the first page.
    #[error("page offset {0:#x} is not a 64-byte-aligned offset into the first page")]
    PageOffset(u32),
    /// Entry size different from what the ring type requires.
    #[error("entry size 2^{got}, expected 2^{expected}")]
    Stride {
        /// Found.
        got: u8,
        /// Required.
        expected: u8,
    },
    /// More entries than the device allows.
    #[error("2^{got} entries, at most 2^{max}")]
    TooLarge {
        /// Found.
        got: u8,
        /// Limit.
        max: u8,
    },
    /// The MTT range runs past the MTT table.
    #[error("MTT range {first}..{end} outside the {table} entries")]
    MttRange {
        /// First entry.
        first: u64,
        /// One past the last entry.
        end: u64,
        /// Table size.
        table: u64,
    },
    /// Reserved bytes set.
    #[error("reserved bytes are not zero")]
    Reserved,
}

impl BufDesc {
    /// Ring bytes.
    pub fn len(&self) -> u64 {
        1u64 << (u32::from(self.log_entries) + u32::from(self.log_stride))
    }

    /// False: a ring has at least one entry.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// MTT entries the ring spans.
    pub fn mtt_pages(&self) -> u64 {
        crate::mpt::mtt_pages(self.page_offset.get(), self.log_page_size, self.len())
            .unwrap_or(u64::MAX)
    }

    /// Checks the descriptor for a ring whose entries are `2^stride` bytes
    /// (`None`: any stride from 32 bytes up to `max_stride`), at most
    /// `2^max_log_entries` entries, in an MTT table of `mtt_table` entries.
    pub fn validate(
        &self,
        stride: Option<u8>,
        max_stride: u8,
        max_log_entries: u8,
        mtt_table: u64,
    ) -> Result<(), BufDescError> {
        if self.reserved_at_0xb != [0; 5] {
            return Err(BufDescError::Reserved);
        }
        if !PAGE_SHIFT_RANGE.contains(&self.log_page_size) {
            return Err(BufDescError::PageSize(self.log_page_size));
        }
        let offset = self.page_offset.get();
        if !offset.is_multiple_of(64) || u64::from(offset) >= 1u64 << self.log_page_size {
            return Err(BufDescError::PageOffset(offset));
        }
        match stride {
            Some(expected) if self.log_stride != expected => {
                return Err(BufDescError::Stride {
                    got: self.log_stride,
                    expected,
                });
            }
            None if !(5..=max_stride).contains(&self.log_stride) => {
                return Err(BufDescError::Stride {
                    got: self.log_stride,
                    expected: max_stride,
                });
            }
            _ => {}
        }
        if self.log_entries > max_log_entries {
            return Err(BufDescError::TooLarge {
                got: self.log_entries,
                max: max_log_entries,
            });
        }
        let first = u64::from(self.mtt_index.get());
        let end = first.saturating_add(self.mtt_pages());
        if end > mtt_table {
            return Err(BufDescError::MttRange {
                first,
                end,
                table: mtt_table,
            });
        }
        Ok(())
    }
}

/// Log2 of a send WQE basic block (64 bytes).
pub const SQ_LOG_STRIDE: u8 = 6;
/// Log2 of a CQE (32 bytes).
pub const CQE_LOG_STRIDE: u8 = 5;
/// Log2 of an EQE (32 bytes).
pub const EQE_LOG_STRIDE: u8 = 5;

bitflags! {
    /// QPC flags.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct QpcFlags: u8 {
        /// Every send WQE completes signaled.
        const SQ_SIG_ALL = 1 << 0;
        /// Receives come from the SRQ in `srqn`.
        const HAS_SRQ = 1 << 1;
        /// Raise `SQ_DRAINED` when the send queue has drained (RTS -> SQD).
        const SQD_EVENT = 1 << 2;
        /// The rings are in user memory.
        const USER = 1 << 3;
    }
}

/// QP context (PRM 6.1), 256 bytes.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct Qpc {
    /// `ib_types::qp::QpState` code (device-written).
    pub state: u8,
    /// `ib_types::qp::QpType` code.
    pub qp_type: u8,
    /// Port number.
    pub port: u8,
    /// [`QpcFlags`].
    pub flags: u8,
    /// Protection domain (24 bits).
    pub pd: Le32,
    /// Send CQ.
    pub send_cqn: Le32,
    /// Receive CQ.
    pub recv_cqn: Le32,
    /// SRQ (with `HAS_SRQ`).
    pub srqn: Le32,
    /// The UAR page whose send doorbells this QP honours.
    pub uar_index: Le32,
    /// Send ring, 64-byte basic blocks.
    pub sq: BufDesc,
    /// Receive ring.
    pub rq: BufDesc,
    /// Bus address of the receive doorbell record.
    pub rq_dbr: Le64,
    /// Destination QP (24 bits).
    pub dest_qpn: Le32,
    /// Q_Key.
    pub qkey: Le32,
    /// Send PSN (24 bits).
    pub sq_psn: Le32,
    /// Receive PSN (24 bits).
    pub rq_psn: Le32,
    /// Remote access rights (`ib_types::access` bits).
    pub access: Le32,
    /// P_Key index.
    pub pkey_index: Le16,
    /// `ib_types::scalars::Mtu` code.
    pub path_mtu: u8,
    /// Local ACK timeout exponent.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Outstanding reads/atomics as requester.
    pub max_rd_atomic: u8,
    /// Responder resources.
    pub max_dest_rd_atomic: u8,
    /// Reserved.
    pub reserved_at_0x5d: [u8; 3],
    /// Primary path.
    pub av: Av,
    /// Device: next send WQE (basic block counter) to execute.
    pub sq_wqe_counter: Le32,
    /// Device: next receive WQE to consume.
    pub rq_wqe_counter: Le32,
    /// Reserved.
    pub reserved_at_0x88: [u8; 120],
}

assert_layout!(Qpc, size = 256, state @ 0x00, qp_type @ 0x01, port @ 0x02, flags @ 0x03,
    pd @ 0x04, send_cqn @ 0x08, recv_cqn @ 0x0C, srqn @ 0x10, uar_index @ 0x14, sq @ 0x18,
    rq @ 0x28, rq_dbr @ 0x38, dest_qpn @ 0x40, qkey @ 0x44, sq_psn @ 0x48, rq_psn @ 0x4C,
    access @ 0x50, pkey_index @ 0x54, path_mtu @ 0x56, timeout @ 0x57, retry_cnt @ 0x58,
    rnr_retry @ 0x59, min_rnr_timer @ 0x5A, max_rd_atomic @ 0x5B, max_dest_rd_atomic @ 0x5C,
    reserved_at_0x5d @ 0x5D, av @ 0x60, sq_wqe_counter @ 0x80, rq_wqe_counter @ 0x84,
    reserved_at_0x88 @ 0x88);

/// `MODIFY_QP` input (PRM 6.1.3), 264 bytes.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct ModifyQp {
    /// `ib_types::qp::QpAttrMask` bits.
    pub attr_mask: Le32,
    /// `ib_types::qp::QpState` code, with STATE in the mask.
    pub next_state: u8,
    /// `ib_types::qp::QpState` code, with CUR_STATE in the mask.
    pub cur_state: u8,
    /// Reserved.
    pub reserved_at_0x6: [u8; 2],
    /// The attributes named by the mask.
    pub qpc: Qpc,
}

assert_layout!(ModifyQp, size = 264, attr_mask @ 0, next_state @ 4, cur_state @ 5,
    reserved_at_0x6 @ 6, qpc @ 8);

prm_code! {
    /// CQ context state (PRM 6.2).
    pub enum CqState: u8 {
        /// Unused.
        Free = 0,
        /// Live, not armed.
        Unarmed = 1,
        /// Armed for the next solicited completion.
        ArmedSolicited = 2,
        /// Armed for the next completion.
        ArmedNext = 3,
        /// Overflowed.
        Error = 4,
    }
}

/// CQ context (PRM 6.2), 64 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct Cqc {
    /// [`CqState`] (device-written).
    pub state: u8,
    /// Reserved.
    pub reserved_at_0x1: [u8; 3],
    /// EQ for completion events.
    pub eqn: Le32,
    /// The UAR page whose CQ doorbells this CQ honours.
    pub uar_index: Le32,
    /// Reserved.
    pub reserved_at_0xc: [u8; 4],
    /// The ring, 32-byte CQEs.
    pub ring: BufDesc,
    /// Bus address of the consumer doorbell record.
    pub ci_dbr: Le64,
    /// Device: CQEs written.
    pub producer: Le32,
    /// Reserved.
    pub reserved_at_0x2c: [u8; 20],
}

assert_layout!(Cqc, size = 64, state @ 0x00, reserved_at_0x1 @ 0x01, eqn @ 0x04,
    uar_index @ 0x08, reserved_at_0xc @ 0x0C, ring @ 0x10, ci_dbr @ 0x20, producer @ 0x28,
    reserved_at_0x2c @ 0x2C);

/// `RESIZE_CQ` input (PRM 6.2), 32 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct ResizeCq {
    /// The new ring.
    pub ring: BufDesc,
    /// Reserved.
    pub reserved_at_0x10: [u8; 16],
}

assert_layout!(ResizeCq, size = 32, ring @ 0, reserved_at_0x10 @ 16);

prm_code! {
    /// EQ context state (PRM 6.3).
    pub enum EqState: u8 {
        /// Unused.
        Free = 0,
        /// The next EQE raises the vector.
        Armed = 1,
        /// The vector was raised; no interrupt until re-armed.
        Fired = 2,
    }
}

/// EQ context (PRM 6.3), 64 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct Eqc {
    /// [`EqState`] (device-written).
    pub state: u8,
    /// Reserved.
    pub reserved_at_0x1: u8,
    /// MSI-X vector.
    pub vector: Le16,
    /// Consumer counter (from `EQ_DOORBELL`).
    pub consumer: Le32,
    /// Device: EQEs written.
    pub producer: Le32,
    /// Reserved.
    pub reserved_at_0xc: [u8; 4],
    /// The ring, 32-byte EQEs.
    pub ring: BufDesc,
    /// Reserved.
    pub reserved_at_0x20: [u8; 32],
}

assert_layout!(Eqc, size = 64, state @ 0x00, reserved_at_0x1 @ 0x01, vector @ 0x02,
    consumer @ 0x04, producer @ 0x08, reserved_at_0xc @ 0x0C, ring @ 0x10,
    reserved_at_0x20 @ 0x20);

prm_code! {
    /// SRQ context state (PRM 6.4).
    pub enum SrqState: u8 {
        /// Unused.
        Free = 0,
        /// Live.
        Ready = 1,
        /// Failed (a catastrophic SRQ error).
        Error = 2,
    }
}

/// SRQ context (PRM 6.4), 64 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct Srqc {
    /// [`SrqState`] (device-written).
    pub state: u8,
    /// Reserved.
    pub reserved_at_0x1: [u8; 3],
    /// Protection domain (24 bits).
    pub pd: Le32,
    /// Unused, zero.
    pub cqn: Le32,
    /// Armed limit (0 = disarmed).
    pub limit: Le32,
    /// The ring of receive WQEs.
    pub ring: BufDesc,
    /// Bus address of the producer doorbell record.
    pub dbr: Le64,
    /// Device: WQEs taken.
    pub consumer: Le32,
    /// Reserved.
    pub reserved_at_0x2c: [u8; 20],
}

assert_layout!(Srqc, size = 64, state @ 0x00, reserved_at_0x1 @ 0x01, pd @ 0x04, cqn @ 0x08,
    limit @ 0x0C, ring @ 0x10, dbr @ 0x20, consumer @ 0x28, reserved_at_0x2c @ 0x2C);

/// Context entry sizes the device reports in `QUERY_DEV_CAP`.
pub mod entry_size {
    /// QPC bytes.
    pub const QPC: u16 = 256;
    /// CQC bytes.
    pub const CQC: u16 = 64;
    /// EQC bytes.
    pub const EQC: u16 = 64;
    /// SRQC bytes.
    pub const SRQC: u16 = 64;
    /// MPT entry bytes.
    pub const MPT: u16 = 64;
    /// MTT entry bytes.
    pub const MTT: u16 = 8;
}

const _: () = {
    assert!(entry_size::QPC as usize == core::mem::size_of::<Qpc>());
    assert!(entry_size::CQC as usize == core::mem::size_of::<Cqc>());
    assert!(entry_size::EQC as usize == core::mem::size_of::<Eqc>());
    assert!(entry_size::SRQC as usize == core::mem::size_of::<Srqc>());
    assert!(entry_size::MPT as usize == core::mem::size_of::<crate::mpt::MptEntry>());
};

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(log_entries: u8, log_stride: u8) -> BufDesc {
        BufDesc {
            mtt_index: Le32::new(10),
            page_offset: Le32::new(0),
            log_page_size: 12,
            log_entries,
            log_stride,
            reserved_at_0xb: [0; 5],
        }
    }

    #[test]
    fn buf_desc_rules() {
        let cq = ring(8, CQE_LOG_STRIDE); // 256 x 32 B = 8 KiB: 2 pages
        assert_eq!(cq.len(), 8192);
        assert_eq!(cq.mtt_pages(), 2);
        assert_eq!(cq.validate(Some(CQE_LOG_STRIDE), 6, 16, 12), Ok(()));
        assert!(matches!(
            cq.validate(Some(CQE_LOG_STRIDE), 6, 16, 11),
            Err(BufDescError::MttRange { end: 12, .. })
        ));
        assert!(matches!(
            cq.validate(Some(SQ_LOG_STRIDE), 6, 16, 64),
            Err(BufDescError::Stride { .. })
        ));
        assert!(matches!(
            cq.validate(Some(CQE_LOG_STRIDE), 6, 7, 64),
            Err(BufDescError::TooLarge { .. })
        ));
        let mut odd = cq;
        odd.page_offset = Le32::new(32);
        assert!(matches!(
            odd.validate(None, 9, 16, 64),
            Err(BufDescError::PageOffset(32))
        ));
        odd.page_offset = Le32::new(0);
        odd.log_page_size = 11;
        assert!(matches!(
            odd.validate(None, 9, 16, 64),
            Err(BufDescError::PageSize(11))
        ));
        let mut reserved = cq;
        reserved.reserved_at_0xb[4] = 1;
        assert_eq!(
            reserved.validate(None, 9, 16, 64),
            Err(BufDescError::Reserved)
        );
        // A receive ring of 64-byte WQEs: any stride from 32 bytes up.
        assert_eq!(ring(4, 6).validate(None, 9, 16, 64), Ok(()));
        assert!(ring(4, 4).validate(None, 9, 16, 64).is_err());
    }

    #[test]
    fn state_codes() {
        for &s in CqState::ALL {
            assert_eq!(CqState::from_code(s.code()).ok(), Some(s));
        }
        assert_eq!(EqState::from_code(3).ok(), None);
        assert_eq!(SrqState::from_code(2).ok(), Some(SrqState::Error));
    }
}
