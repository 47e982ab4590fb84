//! Doorbells (PRM 9): UAR pages and their 64-bit doorbells, doorbell
//! records in host memory, and the EQ doorbell registers of page 0.
//!
//! Contract:
//! - Offsets are BAR0 byte offsets. UAR page `u` is BAR0 page `1 + u`
//!   ([`uar_offset`]); within it, [`SQ_DOORBELL`] and [`CQ_DOORBELL`] each
//!   take one 64-bit store of the value [`SqDoorbell::encode`] /
//!   [`CqDoorbell::encode`] returns. Software makes its WQEs visible first
//!   (a release fence) — that ordering is the platform's, not this module's.
//! - `decode` is what the device applies to a value software wrote: it
//!   never panics and rejects undefined bits and commands (a CQ arm command
//!   of 0 or 3) as errors.
//! - [`EqDoorbell`] is the 32-bit value of `EQ_DOORBELL[n]` at
//!   [`eq_doorbell_offset`]; it carries the low 24 bits of the consumer
//!   counter, which the device extends with [`EqDoorbell::consumer_after`].
//! - [`DoorbellRecord`] is the 4-byte little-endian counter of PRM 9.2 (RQ,
//!   SRQ and CQ records); the store itself (a single aligned 32-bit write
//!   after the WQEs, with release order) is the platform's.

use ib_types::AbiError;
use ib_types::scalars::Qpn;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::Le32;

/// Bytes of a UAR page (one host page).
pub const UAR_PAGE_SIZE: u64 = 4096;
/// Offset of the send queue doorbell in a UAR page.
pub const SQ_DOORBELL: u64 = 0x000;
/// Offset of the CQ doorbell in a UAR page.
pub const CQ_DOORBELL: u64 = 0x008;
/// Offset of `EQ_DOORBELL[0]` in BAR0 page 0.
pub const EQ_DOORBELL_BASE: u64 = 0x800;
/// Stride of the `EQ_DOORBELL` registers.
pub const EQ_DOORBELL_STRIDE: u64 = 8;
/// EQs whose doorbell fits in page 0: `(4096 - 0x800) / 8`.
pub const MAX_EQ_DOORBELLS: u32 = ((UAR_PAGE_SIZE - EQ_DOORBELL_BASE) / EQ_DOORBELL_STRIDE) as u32;

/// Bits 0–23 of the SQ and CQ doorbells: the QPN or CQN.
pub const DB_OBJECT_MASK: u64 = 0x00FF_FFFF;
/// Bits 24–25 of the CQ doorbell: the arm command ([`CqArm`]).
pub const CQ_DB_CMD_MASK: u64 = 0x3 << CQ_DB_CMD_SHIFT;
/// Shift of the CQ doorbell's arm command.
pub const CQ_DB_CMD_SHIFT: u32 = 24;
/// Shift of the counter in bits 32–63 of the SQ and CQ doorbells.
pub const DB_COUNTER_SHIFT: u32 = 32;
/// Bits 0–23 of `EQ_DOORBELL`: the low 24 bits of the consumer counter.
pub const EQ_DB_CONSUMER_MASK: u32 = 0x00FF_FFFF;
/// Bit 31 of `EQ_DOORBELL`: arm the EQ.
pub const EQ_DB_ARM: u32 = 1 << 31;

/// BAR0 offset of UAR page `uar_index`.
pub const fn uar_offset(uar_index: u32) -> u64 {
    UAR_PAGE_SIZE * (1 + uar_index as u64)
}

/// BAR0 offset of `EQ_DOORBELL[eqn]`, or `None` for an EQ beyond
/// [`MAX_EQ_DOORBELLS`] (the registers must stay in page 0).
pub const fn eq_doorbell_offset(eqn: u32) -> Option<u64> {
    if eqn < MAX_EQ_DOORBELLS {
        Some(EQ_DOORBELL_BASE + EQ_DOORBELL_STRIDE * eqn as u64)
    } else {
        None
    }
}

/// The value of a send queue doorbell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SqDoorbell {
    /// The QP.
    pub qpn: Qpn,
    /// The send producer counter: basic blocks posted, wrapping.
    pub producer: u32,
}

impl SqDoorbell {
    /// The 64-bit value to store.
    pub const fn encode(self) -> u64 {
        (self.producer as u64) << DB_COUNTER_SHIFT | self.qpn.get() as u64
    }

    /// Reads a value; bits 24–31 must be zero.
    pub const fn decode(value: u64) -> Result<Self, AbiError> {
        if value as u32 & !(DB_OBJECT_MASK as u32) != 0 {
            return Err(AbiError::ReservedNotZero {
                field: "SQ_DOORBELL bits 24-31",
            });
        }
        Ok(Self {
            qpn: Qpn::from_low_bits(value as u32),
            producer: (value >> DB_COUNTER_SHIFT) as u32,
        })
    }
}

prm_code! {
    /// The arm command of a CQ doorbell.
    pub enum CqArm: u8 {
        /// Raise an event for the next solicited (or error) completion.
        Solicited = 1,
        /// Raise an event for the next completion.
        Next = 2,
    }
}

/// The value of a CQ doorbell. The CQN is checked to fit 24 bits on
/// construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqDoorbell {
    cqn: u32,
    cmd: CqArm,
    consumer: u32,
}

impl CqDoorbell {
    /// A doorbell arming `cqn` (below 2^24) with the consumer counter at
    /// the time of arming.
    pub const fn new(cqn: u32, cmd: CqArm, consumer: u32) -> Result<Self, AbiError> {
        if cqn as u64 & !DB_OBJECT_MASK != 0 {
            return Err(AbiError::OutOfRange {
                field: "CQ_DOORBELL cqn",
                value: cqn as u64,
            });
        }
        Ok(Self { cqn, cmd, consumer })
    }

    /// The CQ.
    pub const fn cqn(self) -> u32 {
        self.cqn
    }

    /// The arm command.
    pub const fn cmd(self) -> CqArm {
        self.cmd
    }

    /// The consumer counter at the time of arming.
    pub const fn consumer(self) -> u32 {
        self.consumer
    }

    /// The 64-bit value to store.
    pub const fn encode(self) -> u64 {
        (self.consumer as u64) << DB_COUNTER_SHIFT
            | (self.cmd.code() as u64) << CQ_DB_CMD_SHIFT
            | self.cqn as u64
    }

    /// Reads a value; the command must be 1 or 2 and bits 26–31 zero.
    pub const fn decode(value: u64) -> Result<Self, AbiError> {
        let low = value as u32 as u64;
        if low & !(DB_OBJECT_MASK | CQ_DB_CMD_MASK) != 0 {
            return Err(AbiError::ReservedNotZero {
                field: "CQ_DOORBELL bits 26-31",
            });
        }
        let cmd = match CqArm::from_code(((low & CQ_DB_CMD_MASK) >> CQ_DB_CMD_SHIFT) as u8) {
            Ok(cmd) => cmd,
            Err(e) => return Err(e),
        };
        Ok(Self {
            cqn: (low & DB_OBJECT_MASK) as u32,
            cmd,
            consumer: (value >> DB_COUNTER_SHIFT) as u32,
        })
    }
}

/// The value of an `EQ_DOORBELL[n]` register.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EqDoorbell {
    /// The consumer counter; only its low 24 bits travel.
    pub consumer: u32,
    /// Arm the EQ for one interrupt.
    pub arm: bool,
}

impl EqDoorbell {
    /// The 32-bit value to write: the consumer counter's low 24 bits, and
    /// [`EQ_DB_ARM`] when arming.
    pub const fn encode(self) -> u32 {
        let arm = if self.arm { EQ_DB_ARM } else { 0 };
        self.consumer & EQ_DB_CONSUMER_MASK | arm
    }

    /// Reads a value (`consumer` is the low 24 bits); bits 24–30 must be
    /// zero.
    pub const fn decode(value: u32) -> Result<Self, AbiError> {
        if value & !(EQ_DB_CONSUMER_MASK | EQ_DB_ARM) != 0 {
            return Err(AbiError::ReservedNotZero {
                field: "EQ_DOORBELL bits 24-30",
            });
        }
        Ok(Self {
            consumer: value & EQ_DB_CONSUMER_MASK,
            arm: value & EQ_DB_ARM != 0,
        })
    }

    /// The device's full consumer counter after this doorbell, given the
    /// one it held (`current`): the counter advanced to the next value
    /// whose low 24 bits are the doorbell's. Exact while software moves
    /// the counter by less than 2^24 between doorbells, which any EQ of at
    /// most 2^24 entries guarantees.
    pub const fn consumer_after(self, current: u32) -> u32 {
        let step = self.consumer.wrapping_sub(current) & EQ_DB_CONSUMER_MASK;
        current.wrapping_add(step)
    }
}

/// A doorbell record (PRM 9.2): a 4-byte little-endian counter in DMA
/// memory, 4-byte aligned. The RQ record (`rq_dbr`) and SRQ record (`dbr`)
/// hold the receive WQEs posted; the CQ record (`ci_dbr`) holds the CQEs
/// consumed. Software writes it, the device reads it.
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
#[repr(transparent)]
pub struct DoorbellRecord(Le32);

assert_layout!(DoorbellRecord, size = 4);

impl DoorbellRecord {
    /// A record holding `counter`.
    pub const fn new(counter: u32) -> Self {
        Self(Le32::new(counter))
    }

    /// The counter.
    pub const fn get(self) -> u32 {
        self.0.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn offsets() {
        assert_eq!((SQ_DOORBELL, CQ_DOORBELL), (0x000, 0x008));
        assert_eq!(uar_offset(0), 0x1000);
        assert_eq!(uar_offset(3), 0x4000);
        assert_eq!(uar_offset(u32::MAX), 0x1000_0000_0000);
        assert_eq!(eq_doorbell_offset(0), Some(0x800));
        assert_eq!(eq_doorbell_offset(5), Some(0x828));
        assert_eq!(eq_doorbell_offset(255), Some(0xFF8));
        assert_eq!(eq_doorbell_offset(256), None);
        assert_eq!(MAX_EQ_DOORBELLS, 256);
    }

    #[test]
    fn values() {
        let sq = SqDoorbell {
            qpn: Qpn::new(0x12_3456).unwrap(),
            producer: 0xDEAD_BEEF,
        };
        assert_eq!(sq.encode(), 0xDEAD_BEEF_0012_3456);
        assert_eq!(SqDoorbell::decode(sq.encode()), Ok(sq));
        assert!(SqDoorbell::decode(0x0100_0000).is_err());
        assert!(SqDoorbell::decode(0x8000_0000).is_err());

        let cq = CqDoorbell::new(0xAB_CDEF, CqArm::Next, 7).unwrap();
        assert_eq!(cq.encode(), 0x0000_0007_02AB_CDEF);
        let solicited = CqDoorbell::new(1, CqArm::Solicited, 0).unwrap();
        assert_eq!(solicited.encode(), 0x0100_0001);
        assert_eq!(CqDoorbell::decode(cq.encode()), Ok(cq));
        assert_eq!(
            (cq.cqn(), cq.cmd(), cq.consumer()),
            (0xAB_CDEF, CqArm::Next, 7)
        );
        assert!(CqDoorbell::new(0x100_0000, CqArm::Next, 0).is_err());
        for bad in [0x0000_0005, 0x0300_0005, 0x0600_0005, 0x8200_0005] {
            assert!(CqDoorbell::decode(bad).is_err(), "{bad:#x}");
        }

        let eq = EqDoorbell {
            consumer: 0x0123_4567,
            arm: true,
        };
        assert_eq!(eq.encode(), 0x8023_4567);
        assert_eq!(
            EqDoorbell::decode(0x8023_4567),
            Ok(EqDoorbell {
                consumer: 0x23_4567,
                arm: true
            })
        );
        assert!(EqDoorbell::decode(0x0100_0000).is_err());
        assert!(EqDoorbell::decode(0x4000_0000).is_err());

        let rec = DoorbellRecord::new(0x0102_0304);
        assert_eq!(rec.as_bytes(), &[4, 3, 2, 1]);
        assert_eq!(rec.get(), 0x0102_0304);
    }

    #[test]
    fn eq_consumer_extension() {
        let db = |consumer| EqDoorbell {
            consumer,
            arm: false,
        };
        // Across the 24-bit wrap of the register.
        assert_eq!(
            EqDoorbell::decode(db(0x0100_0002).encode())
                .unwrap()
                .consumer_after(0x00FF_FFF0),
            0x0100_0002
        );
        // Across the 32-bit wrap of the counter.
        assert_eq!(db(0x0000_0003).consumer_after(0xFFFF_FFFE), 3);
        // No movement.
        assert_eq!(db(0x0000_1234).consumer_after(0x0500_1234), 0x0500_1234);
    }

    proptest! {
        #[test]
        fn round_trips(q in 0..=Qpn::MAX.get(), counter: u32, cqn in 0u32..=0xFF_FFFF, solicited: bool, arm: bool, step in 0u32..0x100_0000) {
            let sq = SqDoorbell { qpn: Qpn::new(q).unwrap(), producer: counter };
            prop_assert_eq!(SqDoorbell::decode(sq.encode()), Ok(sq));
            let cmd = if solicited { CqArm::Solicited } else { CqArm::Next };
            let cq = CqDoorbell::new(cqn, cmd, counter).unwrap();
            prop_assert_eq!(CqDoorbell::decode(cq.encode()), Ok(cq));
            let next = counter.wrapping_add(step);
            let eq = EqDoorbell::decode(EqDoorbell { consumer: next, arm }.encode()).unwrap();
            prop_assert_eq!(eq.arm, arm);
            prop_assert_eq!(eq.consumer_after(counter), next);
        }

        #[test]
        fn decode_is_total(v: u64) {
            if let Ok(sq) = SqDoorbell::decode(v) { prop_assert_eq!(sq.encode(), v); }
            if let Ok(cq) = CqDoorbell::decode(v) { prop_assert_eq!(cq.encode(), v); }
            if let Ok(eq) = EqDoorbell::decode(v as u32) { prop_assert_eq!(eq.encode(), v as u32); }
        }
    }
}
