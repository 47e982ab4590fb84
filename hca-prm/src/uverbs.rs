//! The vendor private data of the user-mode verbs (docs/prm.md section 13):
//! what the user-mode verbs provider (UVP, crate `uvp-plugin`) and the
//! miniport exchange in the private bytes of the proxy IOCTLs
//! (`ib_types::ioctl`, the guide's `umv_buf`), one record per verb and
//! direction.
//!
//! Contract:
//! - Each record is a `#[repr(C)]` little-endian layout (`*Abi`) with a
//!   compile-time size and offset check, and a validated value with
//!   `parse` (from exactly the record's bytes, never panicking) and
//!   `emit`; whatever parses re-emits to the same bytes.
//! - The kernel reads the `*In` records from a user process: they are
//!   hostile. `parse` checks everything that does not depend on the
//!   device: exact length, reserved bytes zero, logarithms that fit their
//!   shifts, alignment (rings on 64 bytes, the PRM's `page_offset` unit;
//!   doorbell records on 4 bytes), no range that wraps the address space,
//!   and no two of a verb's ranges overlapping. Limits of the device
//!   (ring sizes within its capabilities) are the kernel's to check
//!   against what it brought up.
//! - The `*Out` records come from the kernel; the UVP still parses them.
//! - User address vectors are user-space objects (guide 6.4.2): the UVP
//!   builds the PRM address vector (6.1.1) into its own UD WQEs and answers
//!   `CreateAv` itself; the kernel takes no private data for them and
//!   refuses a user `CreateAv` that reaches it.

use ib_types::AbiError;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::ctx::CQE_LOG_STRIDE;
use crate::doorbell::{CQ_DOORBELL, SQ_DOORBELL, UAR_PAGE_SIZE};
use crate::wqe::{BB_SIZE, MIN_RECV_STRIDE};
use crate::{Le16, Le32, Le64};

/// Alignment of a user ring: the PRM's `page_offset` unit (6.0).
pub const RING_ALIGN: u64 = 64;
/// Alignment of a doorbell record (9.2).
pub const DBR_ALIGN: u64 = 4;
/// Bytes of a doorbell record (9.2).
pub const DBR_BYTES: u64 = 4;
/// The largest ring any record may describe (`2^31` bytes): bounds every
/// shift below and the pages a kernel would lock for one ring.
pub const MAX_LOG_RING_BYTES: u8 = 31;

fn ensure_zero(field: &'static str, bytes: &[u8]) -> Result<(), AbiError> {
    if bytes.iter().all(|&b| b == 0) {
        Ok(())
    } else {
        Err(AbiError::ReservedNotZero { field })
    }
}

/// Reads exactly one `T` from `bytes`.
fn read_exact<T: FromBytes + KnownLayout + Immutable + Unaligned>(
    field: &'static str,
    bytes: &[u8],
) -> Result<T, AbiError> {
    let size = core::mem::size_of::<T>();
    if bytes.len() != size {
        return Err(AbiError::BadLength {
            field,
            declared: bytes.len() as u64,
            available: size as u64,
        });
    }
    T::read_from_bytes(bytes).map_err(|_| AbiError::Truncated {
        needed: size,
        got: bytes.len(),
    })
}

/// A range of user virtual addresses `[va, va + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UserRange {
    /// First byte.
    pub va: u64,
    /// Bytes; non-zero.
    pub len: u64,
}

impl UserRange {
    /// A range that is non-empty, aligned to `align` and does not wrap.
    fn checked(field: &'static str, va: u64, len: u64, align: u64) -> Result<Self, AbiError> {
        if va == 0 || !va.is_multiple_of(align) {
            return Err(AbiError::OutOfRange { field, value: va });
        }
        if len == 0 || va.checked_add(len).is_none() {
            return Err(AbiError::BadLength {
                field,
                declared: len,
                available: u64::MAX - va,
            });
        }
        Ok(Self { va, len })
    }

    /// One past the last byte (no overflow: checked at construction).
    pub fn end(&self) -> u64 {
        self.va.saturating_add(self.len)
    }

    /// True when the two ranges share a byte.
    pub fn overlaps(&self, other: &Self) -> bool {
        self.va < other.end() && other.va < self.end()
    }
}

/// Fails when any two of `ranges` overlap.
fn disjoint(field: &'static str, ranges: &[UserRange]) -> Result<(), AbiError> {
    for (i, a) in ranges.iter().enumerate() {
        for b in &ranges[i + 1..] {
            if a.overlaps(b) {
                return Err(AbiError::OutOfRange { field, value: b.va });
            }
        }
    }
    Ok(())
}

/// `1 << log` bytes, for a log within [`MAX_LOG_RING_BYTES`].
fn ring_bytes(field: &'static str, log: u32) -> Result<u64, AbiError> {
    if log > u32::from(MAX_LOG_RING_BYTES) {
        return Err(AbiError::OutOfRange {
            field,
            value: log.into(),
        });
    }
    Ok(1u64 << log)
}

/// The length of a ring the record declares as `declared` bytes: `1 << log`
/// (bounded by [`MAX_LOG_RING_BYTES`]), and `declared` must say the same.
fn declared_ring_len(
    log_field: &'static str,
    log: u32,
    bytes_field: &'static str,
    declared: u64,
) -> Result<u64, AbiError> {
    let len = ring_bytes(log_field, log)?;
    if declared != len {
        return Err(AbiError::BadLength {
            field: bytes_field,
            declared,
            available: len,
        });
    }
    Ok(len)
}

/// A ring of `len` bytes at `va`, [`RING_ALIGN`] aligned.
fn checked_ring(field: &'static str, va: u64, len: u64) -> Result<UserRange, AbiError> {
    UserRange::checked(field, va, len, RING_ALIGN)
}

/// `log2` of the bytes of a CQ ring of `2^log_entries` CQEs.
fn cq_ring_log(log_entries: u8) -> u32 {
    u32::from(log_entries) + u32::from(CQE_LOG_STRIDE)
}

/// The bytes of a CQ ring of `2^log_entries` CQEs.
fn cq_ring_bytes(field: &'static str, log_entries: u8) -> Result<u64, AbiError> {
    ring_bytes(field, cq_ring_log(log_entries))
}

/// A doorbell record at `va`: [`DBR_BYTES`] long, [`DBR_ALIGN`] aligned.
fn checked_dbr(field: &'static str, va: u64) -> Result<UserRange, AbiError> {
    UserRange::checked(field, va, DBR_BYTES, DBR_ALIGN)
}

/// A receive stride of at least [`MIN_RECV_STRIDE`] bytes (PRM 10.3).
fn check_recv_stride(field: &'static str, log_stride: u8) -> Result<(), AbiError> {
    if usize::from(log_stride) < MIN_RECV_STRIDE.trailing_zeros() as usize {
        return Err(AbiError::OutOfRange {
            field,
            value: log_stride.into(),
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// OpenCa
// ---------------------------------------------------------------------------

/// `OpenCa` private output: the context's doorbell page and the device
/// limits the UVP lays its rings out within.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpenCaPriv {
    /// The UAR page of the context (never 0, the kernel's; PRM 9.1). Its
    /// mapping's address is `OpenCaOut::doorbell`.
    pub uar_index: u32,
    /// `log2` of the largest CQ (entries).
    pub log_max_cqes: u8,
    /// `log2` of the largest work queue (send basic blocks or receive WQEs).
    pub log_max_wqes: u8,
    /// `log2` of the largest send WQE (bytes).
    pub log_max_wqe_size: u8,
    /// `log2` of the largest SRQ (WQEs).
    pub log_max_srq_wqes: u8,
    /// Most SGEs of a send WQE.
    pub max_send_sges: u8,
    /// Most SGEs of a receive WQE.
    pub max_recv_sges: u8,
    /// Most inline bytes of a send WQE.
    pub max_inline: u16,
    /// The device's ports (at least 1): the provider refuses an address
    /// vector on another port, as the kernel's AV verbs do (IBA 11.2.2).
    pub num_ports: u8,
}

/// ABI layout of [`OpenCaPriv`]: 32 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct OpenCaPrivAbi {
    /// UAR page index.
    pub uar_index: Le32,
    /// Bytes of the UAR page (4096, PRM 9.1).
    pub uar_page_size: Le32,
    /// `log_max_cqes`.
    pub log_max_cqes: u8,
    /// `log_max_wqes`.
    pub log_max_wqes: u8,
    /// `log_max_wqe_size`.
    pub log_max_wqe_size: u8,
    /// `log_max_srq_wqes`.
    pub log_max_srq_wqes: u8,
    /// `max_send_sges`.
    pub max_send_sges: u8,
    /// `max_recv_sges`.
    pub max_recv_sges: u8,
    /// `max_inline`.
    pub max_inline: Le16,
    /// Offset of `SQ_DOORBELL` in the page.
    pub sq_doorbell_offset: Le16,
    /// Offset of `CQ_DOORBELL` in the page.
    pub cq_doorbell_offset: Le16,
    /// `num_ports`.
    pub num_ports: u8,
    /// Reserved, zero.
    pub reserved_at_0x15: [u8; 11],
}

assert_layout!(OpenCaPrivAbi, size = 32, uar_index @ 0x00, uar_page_size @ 0x04,
    log_max_cqes @ 0x08, log_max_wqes @ 0x09, log_max_wqe_size @ 0x0A,
    log_max_srq_wqes @ 0x0B, max_send_sges @ 0x0C, max_recv_sges @ 0x0D,
    max_inline @ 0x0E, sq_doorbell_offset @ 0x10, cq_doorbell_offset @ 0x12,
    num_ports @ 0x14, reserved_at_0x15 @ 0x15);

impl OpenCaPriv {
    /// Bytes of the record.
    pub const SIZE: usize = core::mem::size_of::<OpenCaPrivAbi>();

    /// Parses the record (the UVP's side).
    pub fn parse(bytes: &[u8]) -> Result<Self, AbiError> {
        let abi: OpenCaPrivAbi = read_exact("OpenCaPrivAbi", bytes)?;
        ensure_zero("OpenCaPrivAbi.reserved_at_0x15", &abi.reserved_at_0x15)?;
        if abi.uar_index.get() == 0 {
            return Err(AbiError::OutOfRange {
                field: "OpenCaPrivAbi.uar_index",
                value: 0,
            });
        }
        if abi.num_ports == 0 {
            return Err(AbiError::OutOfRange {
                field: "OpenCaPrivAbi.num_ports",
                value: 0,
            });
        }
        let fixed = [
            (
                "OpenCaPrivAbi.uar_page_size",
                u64::from(abi.uar_page_size.get()),
                UAR_PAGE_SIZE,
            ),
            (
                "OpenCaPrivAbi.sq_doorbell_offset",
                abi.sq_doorbell_offset.get().into(),
                SQ_DOORBELL,
            ),
            (
                "OpenCaPrivAbi.cq_doorbell_offset",
                abi.cq_doorbell_offset.get().into(),
                CQ_DOORBELL,
            ),
        ];
        for (field, value, expected) in fixed {
            if value != expected {
                return Err(AbiError::OutOfRange { field, value });
            }
        }
        Ok(Self {
            uar_index: abi.uar_index.get(),
            log_max_cqes: abi.log_max_cqes,
            log_max_wqes: abi.log_max_wqes,
            log_max_wqe_size: abi.log_max_wqe_size,
            log_max_srq_wqes: abi.log_max_srq_wqes,
            max_send_sges: abi.max_send_sges,
            max_recv_sges: abi.max_recv_sges,
            max_inline: abi.max_inline.get(),
            num_ports: abi.num_ports,
        })
    }

    /// The layout.
    pub fn emit(&self) -> OpenCaPrivAbi {
        OpenCaPrivAbi {
            uar_index: Le32::new(self.uar_index),
            uar_page_size: Le32::new(UAR_PAGE_SIZE as u32),
            log_max_cqes: self.log_max_cqes,
            log_max_wqes: self.log_max_wqes,
            log_max_wqe_size: self.log_max_wqe_size,
            log_max_srq_wqes: self.log_max_srq_wqes,
            max_send_sges: self.max_send_sges,
            max_recv_sges: self.max_recv_sges,
            max_inline: Le16::new(self.max_inline),
            sq_doorbell_offset: Le16::new(SQ_DOORBELL as u16),
            cq_doorbell_offset: Le16::new(CQ_DOORBELL as u16),
            num_ports: self.num_ports,
            reserved_at_0x15: [0; 11],
        }
    }
}

// ---------------------------------------------------------------------------
// CreateCq
// ---------------------------------------------------------------------------

/// `CreateCq` private input: a CQ ring and its consumer doorbell record in
/// the caller's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CreateCqPriv {
    /// `log2` of the ring's CQEs (the ring is `32 << log` bytes, PRM 10.4).
    pub log_entries: u8,
    /// The ring (64-byte aligned; zero-filled by the UVP, PRM 10.4's owner
    /// rule).
    pub ring: UserRange,
    /// The consumer record (PRM 9.2; 4-byte aligned, outside the ring).
    pub dbr: UserRange,
}

/// ABI layout of [`CreateCqPriv`]: 32 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CreateCqPrivAbi {
    /// Ring user VA.
    pub ring_va: Le64,
    /// Ring bytes: `32 << log_entries`.
    pub ring_bytes: Le64,
    /// Consumer record user VA.
    pub dbr_va: Le64,
    /// `log2` of the entries.
    pub log_entries: u8,
    /// Reserved, zero.
    pub reserved_at_0x19: [u8; 7],
}

assert_layout!(CreateCqPrivAbi, size = 32, ring_va @ 0x00, ring_bytes @ 0x08, dbr_va @ 0x10,
    log_entries @ 0x18, reserved_at_0x19 @ 0x19);

impl CreateCqPriv {
    /// Bytes of the record.
    pub const SIZE: usize = core::mem::size_of::<CreateCqPrivAbi>();

    /// A CQ of `2^log_entries` CQEs at `ring_va` with its record at
    /// `dbr_va` (the UVP's side; checked as the kernel will).
    pub fn new(log_entries: u8, ring_va: u64, dbr_va: u64) -> Result<Self, AbiError> {
        let bytes = cq_ring_bytes("CreateCqPrivAbi.log_entries", log_entries)?;
        let abi = CreateCqPrivAbi {
            ring_va: Le64::new(ring_va),
            ring_bytes: Le64::new(bytes),
            dbr_va: Le64::new(dbr_va),
            log_entries,
            reserved_at_0x19: [0; 7],
        };
        Self::parse(abi.as_bytes())
    }

    /// Parses and checks the record (the kernel's side; hostile bytes).
    pub fn parse(bytes: &[u8]) -> Result<Self, AbiError> {
        let abi: CreateCqPrivAbi = read_exact("CreateCqPrivAbi", bytes)?;
        ensure_zero("CreateCqPrivAbi.reserved_at_0x19", &abi.reserved_at_0x19)?;
        let expected = declared_ring_len(
            "CreateCqPrivAbi.log_entries",
            cq_ring_log(abi.log_entries),
            "CreateCqPrivAbi.ring_bytes",
            abi.ring_bytes.get(),
        )?;
        let ring = checked_ring("CreateCqPrivAbi.ring_va", abi.ring_va.get(), expected)?;
        let dbr = checked_dbr("CreateCqPrivAbi.dbr_va", abi.dbr_va.get())?;
        disjoint("CreateCqPrivAbi.dbr_va (overlaps the ring)", &[ring, dbr])?;
        Ok(Self {
            log_entries: abi.log_entries,
            ring,
            dbr,
        })
    }

    /// The layout.
    pub fn emit(&self) -> CreateCqPrivAbi {
        CreateCqPrivAbi {
            ring_va: Le64::new(self.ring.va),
            ring_bytes: Le64::new(self.ring.len),
            dbr_va: Le64::new(self.dbr.va),
            log_entries: self.log_entries,
            reserved_at_0x19: [0; 7],
        }
    }
}

/// `CreateCq` private output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CreateCqPrivOut {
    /// The CQ number the UVP puts in its `CQ_DOORBELL` writes.
    pub cqn: u32,
    /// `log2` of the ring's CQEs.
    pub log_entries: u8,
}

/// ABI layout of [`CreateCqPrivOut`]: 16 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CreateCqPrivOutAbi {
    /// CQ number (24 bits).
    pub cqn: Le32,
    /// `log2` of the entries.
    pub log_entries: u8,
    /// Reserved, zero.
    pub reserved_at_0x5: [u8; 1],
    /// Offset of `CQ_DOORBELL` in the context's UAR page.
    pub doorbell_offset: Le16,
    /// Reserved, zero.
    pub reserved_at_0x8: [u8; 8],
}

assert_layout!(CreateCqPrivOutAbi, size = 16, cqn @ 0, log_entries @ 4, reserved_at_0x5 @ 5,
    doorbell_offset @ 6, reserved_at_0x8 @ 8);

impl CreateCqPrivOut {
    /// Bytes of the record.
    pub const SIZE: usize = core::mem::size_of::<CreateCqPrivOutAbi>();

    /// Parses the record (the UVP's side).
    pub fn parse(bytes: &[u8]) -> Result<Self, AbiError> {
        let abi: CreateCqPrivOutAbi = read_exact("CreateCqPrivOutAbi", bytes)?;
        ensure_zero("CreateCqPrivOutAbi.reserved_at_0x5", &abi.reserved_at_0x5)?;
        ensure_zero("CreateCqPrivOutAbi.reserved_at_0x8", &abi.reserved_at_0x8)?;
        check_object_number("CreateCqPrivOutAbi.cqn", abi.cqn.get())?;
        check_offset(
            "CreateCqPrivOutAbi.doorbell_offset",
            abi.doorbell_offset.get(),
            CQ_DOORBELL,
        )?;
        Ok(Self {
            cqn: abi.cqn.get(),
            log_entries: abi.log_entries,
        })
    }

    /// The layout.
    pub fn emit(&self) -> CreateCqPrivOutAbi {
        CreateCqPrivOutAbi {
            cqn: Le32::new(self.cqn),
            log_entries: self.log_entries,
            doorbell_offset: Le16::new(CQ_DOORBELL as u16),
            ..CreateCqPrivOutAbi::default()
        }
    }
}

fn check_object_number(field: &'static str, number: u32) -> Result<(), AbiError> {
    if number > 0x00FF_FFFF {
        return Err(AbiError::OutOfRange {
            field,
            value: number.into(),
        });
    }
    Ok(())
}

fn check_offset(field: &'static str, offset: u16, expected: u64) -> Result<(), AbiError> {
    if u64::from(offset) != expected {
        return Err(AbiError::OutOfRange {
            field,
            value: offset.into(),
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// ResizeCq
// ---------------------------------------------------------------------------

/// `ResizeCq` private input: the new ring of a user CQ in the caller's
/// memory (the consumer record stays where `CreateCq` put it; the device
/// writes 0 to it when it switches, PRM 6.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ResizeCqPriv {
    /// `log2` of the new ring's CQEs.
    pub log_entries: u8,
    /// The new ring (64-byte aligned, zero-filled by the UVP).
    pub ring: UserRange,
}

/// ABI layout of [`ResizeCqPriv`]: 24 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct ResizeCqPrivAbi {
    /// New ring user VA.
    pub ring_va: Le64,
    /// New ring bytes: `32 << log_entries`.
    pub ring_bytes: Le64,
    /// `log2` of the entries.
    pub log_entries: u8,
    /// Reserved, zero.
    pub reserved_at_0x11: [u8; 7],
}

assert_layout!(ResizeCqPrivAbi, size = 24, ring_va @ 0x00, ring_bytes @ 0x08,
    log_entries @ 0x10, reserved_at_0x11 @ 0x11);

impl ResizeCqPriv {
    /// Bytes of the record.
    pub const SIZE: usize = core::mem::size_of::<ResizeCqPrivAbi>();

    /// A new ring of `2^log_entries` CQEs at `ring_va` (the UVP's side;
    /// checked as the kernel will).
    pub fn new(log_entries: u8, ring_va: u64) -> Result<Self, AbiError> {
        let bytes = cq_ring_bytes("ResizeCqPrivAbi.log_entries", log_entries)?;
        let abi = ResizeCqPrivAbi {
            ring_va: Le64::new(ring_va),
            ring_bytes: Le64::new(bytes),
            log_entries,
            reserved_at_0x11: [0; 7],
        };
        Self::parse(abi.as_bytes())
    }

    /// Parses and checks the record (the kernel's side; hostile bytes).
    /// That the new ring does not overlap the CQ's consumer record (or
    /// anything else the kernel pinned) is the kernel's to check.
    pub fn parse(bytes: &[u8]) -> Result<Self, AbiError> {
        let abi: ResizeCqPrivAbi = read_exact("ResizeCqPrivAbi", bytes)?;
        ensure_zero("ResizeCqPrivAbi.reserved_at_0x11", &abi.reserved_at_0x11)?;
        let expected = declared_ring_len(
            "ResizeCqPrivAbi.log_entries",
            cq_ring_log(abi.log_entries),
            "ResizeCqPrivAbi.ring_bytes",
            abi.ring_bytes.get(),
        )?;
        let ring = checked_ring("ResizeCqPrivAbi.ring_va", abi.ring_va.get(), expected)?;
        Ok(Self {
            log_entries: abi.log_entries,
            ring,
        })
    }

    /// The layout.
    pub fn emit(&self) -> ResizeCqPrivAbi {
        ResizeCqPrivAbi {
            ring_va: Le64::new(self.ring.va),
            ring_bytes: Le64::new(self.ring.len),
            log_entries: self.log_entries,
            reserved_at_0x11: [0; 7],
        }
    }
}

// ---------------------------------------------------------------------------
// CreateQp
// ---------------------------------------------------------------------------

/// The receive side of a user QP that has its own receive queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UserRecvQueue {
    /// `log2` of the receive WQEs.
    pub log_entries: u8,
    /// `log2` of the receive stride (bytes; at least 32, PRM 10.3).
    pub log_stride: u8,
    /// The ring (64-byte aligned).
    pub ring: UserRange,
    /// The receive doorbell record (PRM 9.2).
    pub dbr: UserRange,
}

/// `CreateQp` private input: the QP's rings in the caller's memory, laid
/// out by the UVP (PRM 10.2, 10.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CreateQpPriv {
    /// `log2` of the send ring's 64-byte basic blocks.
    pub sq_log_bbs: u8,
    /// `log2` of the basic blocks the UVP gives each send WQE (the WQE
    /// stride; at most the ring).
    pub log_wqe_bbs: u8,
    /// The send ring (64-byte aligned, `64 << sq_log_bbs` bytes).
    pub sq: UserRange,
    /// The receive queue; `None` for a QP on an SRQ.
    pub rq: Option<UserRecvQueue>,
}

/// ABI layout of [`CreateQpPriv`]: 48 bytes. A QP without its own receive
/// queue has `rq_va`, `rq_dbr_va`, `rq_log_entries` and `rq_log_stride`
/// all zero.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CreateQpPrivAbi {
    /// Send ring user VA.
    pub sq_va: Le64,
    /// Receive ring user VA (0: none).
    pub rq_va: Le64,
    /// Receive doorbell record user VA (0: none).
    pub rq_dbr_va: Le64,
    /// Send ring bytes: `64 << sq_log_bbs`.
    pub sq_bytes: Le32,
    /// Receive ring bytes: `1 << (rq_log_entries + rq_log_stride)`, or 0.
    pub rq_bytes: Le32,
    /// `log2` of the send basic blocks.
    pub sq_log_bbs: u8,
    /// `log2` of the basic blocks per send WQE.
    pub log_wqe_bbs: u8,
    /// `log2` of the receive WQEs.
    pub rq_log_entries: u8,
    /// `log2` of the receive stride.
    pub rq_log_stride: u8,
    /// Reserved, zero.
    pub reserved_at_0x24: [u8; 12],
}

assert_layout!(CreateQpPrivAbi, size = 48, sq_va @ 0x00, rq_va @ 0x08, rq_dbr_va @ 0x10,
    sq_bytes @ 0x18, rq_bytes @ 0x1C, sq_log_bbs @ 0x20, log_wqe_bbs @ 0x21,
    rq_log_entries @ 0x22, rq_log_stride @ 0x23, reserved_at_0x24 @ 0x24);

impl CreateQpPriv {
    /// Bytes of the record.
    pub const SIZE: usize = core::mem::size_of::<CreateQpPrivAbi>();

    /// Parses and checks the record (the kernel's side; hostile bytes).
    pub fn parse(bytes: &[u8]) -> Result<Self, AbiError> {
        let abi: CreateQpPrivAbi = read_exact("CreateQpPrivAbi", bytes)?;
        ensure_zero("CreateQpPrivAbi.reserved_at_0x24", &abi.reserved_at_0x24)?;
        let sq_len = declared_ring_len(
            "CreateQpPrivAbi.sq_log_bbs",
            u32::from(abi.sq_log_bbs) + BB_SIZE.trailing_zeros(),
            "CreateQpPrivAbi.sq_bytes",
            abi.sq_bytes.get().into(),
        )?;
        if abi.log_wqe_bbs > abi.sq_log_bbs {
            return Err(AbiError::OutOfRange {
                field: "CreateQpPrivAbi.log_wqe_bbs",
                value: abi.log_wqe_bbs.into(),
            });
        }
        let sq = checked_ring("CreateQpPrivAbi.sq_va", abi.sq_va.get(), sq_len)?;
        let no_rq = abi.rq_va.get() == 0
            && abi.rq_dbr_va.get() == 0
            && abi.rq_bytes.get() == 0
            && abi.rq_log_entries == 0
            && abi.rq_log_stride == 0;
        let rq = if no_rq {
            None
        } else {
            check_recv_stride("CreateQpPrivAbi.rq_log_stride", abi.rq_log_stride)?;
            let rq_len = declared_ring_len(
                "CreateQpPrivAbi.rq_log_entries",
                u32::from(abi.rq_log_entries) + u32::from(abi.rq_log_stride),
                "CreateQpPrivAbi.rq_bytes",
                abi.rq_bytes.get().into(),
            )?;
            let ring = checked_ring("CreateQpPrivAbi.rq_va", abi.rq_va.get(), rq_len)?;
            let dbr = checked_dbr("CreateQpPrivAbi.rq_dbr_va", abi.rq_dbr_va.get())?;
            Some(UserRecvQueue {
                log_entries: abi.rq_log_entries,
                log_stride: abi.rq_log_stride,
                ring,
                dbr,
            })
        };
        if let Some(rq) = rq {
            disjoint(
                "CreateQpPrivAbi (rings and record overlap)",
                &[sq, rq.ring, rq.dbr],
            )?;
        }
        Ok(Self {
            sq_log_bbs: abi.sq_log_bbs,
            log_wqe_bbs: abi.log_wqe_bbs,
            sq,
            rq,
        })
    }

    /// The layout.
    pub fn emit(&self) -> CreateQpPrivAbi {
        let mut abi = CreateQpPrivAbi {
            sq_va: Le64::new(self.sq.va),
            sq_bytes: Le32::new(self.sq.len as u32),
            sq_log_bbs: self.sq_log_bbs,
            log_wqe_bbs: self.log_wqe_bbs,
            ..CreateQpPrivAbi::default()
        };
        if let Some(rq) = self.rq {
            abi.rq_va = Le64::new(rq.ring.va);
            abi.rq_bytes = Le32::new(rq.ring.len as u32);
            abi.rq_dbr_va = Le64::new(rq.dbr.va);
            abi.rq_log_entries = rq.log_entries;
            abi.rq_log_stride = rq.log_stride;
        }
        abi
    }

    /// A layout from its parts (the UVP's side; checked as the kernel
    /// will). `rq` is `(log_entries, log_stride, ring_va, dbr_va)`.
    pub fn new(
        sq_log_bbs: u8,
        log_wqe_bbs: u8,
        sq_va: u64,
        rq: Option<(u8, u8, u64, u64)>,
    ) -> Result<Self, AbiError> {
        let sq_len = ring_bytes(
            "CreateQpPrivAbi.sq_log_bbs",
            u32::from(sq_log_bbs) + BB_SIZE.trailing_zeros(),
        )?;
        let mut abi = CreateQpPrivAbi {
            sq_va: Le64::new(sq_va),
            sq_bytes: Le32::new(sq_len as u32),
            sq_log_bbs,
            log_wqe_bbs,
            ..CreateQpPrivAbi::default()
        };
        if let Some((log_entries, log_stride, ring_va, dbr_va)) = rq {
            let len = ring_bytes(
                "CreateQpPrivAbi.rq_log_entries",
                u32::from(log_entries) + u32::from(log_stride),
            )?;
            abi.rq_va = Le64::new(ring_va);
            abi.rq_bytes = Le32::new(len as u32);
            abi.rq_dbr_va = Le64::new(dbr_va);
            abi.rq_log_entries = log_entries;
            abi.rq_log_stride = log_stride;
        }
        Self::parse(abi.as_bytes())
    }
}

/// `CreateQp` private output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CreateQpPrivOut {
    /// The QP number the UVP puts in its `SQ_DOORBELL` writes.
    pub qpn: u32,
    /// The UAR page whose doorbells the QP honours (the context's).
    pub uar_index: u32,
}

/// ABI layout of [`CreateQpPrivOut`]: 16 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CreateQpPrivOutAbi {
    /// QP number (24 bits).
    pub qpn: Le32,
    /// UAR page index.
    pub uar_index: Le32,
    /// Offset of `SQ_DOORBELL` in the UAR page.
    pub doorbell_offset: Le16,
    /// Reserved, zero.
    pub reserved_at_0xa: [u8; 6],
}

assert_layout!(CreateQpPrivOutAbi, size = 16, qpn @ 0, uar_index @ 4, doorbell_offset @ 8,
    reserved_at_0xa @ 10);

impl CreateQpPrivOut {
    /// Bytes of the record.
    pub const SIZE: usize = core::mem::size_of::<CreateQpPrivOutAbi>();

    /// Parses the record (the UVP's side).
    pub fn parse(bytes: &[u8]) -> Result<Self, AbiError> {
        let abi: CreateQpPrivOutAbi = read_exact("CreateQpPrivOutAbi", bytes)?;
        ensure_zero("CreateQpPrivOutAbi.reserved_at_0xa", &abi.reserved_at_0xa)?;
        check_object_number("CreateQpPrivOutAbi.qpn", abi.qpn.get())?;
        check_offset(
            "CreateQpPrivOutAbi.doorbell_offset",
            abi.doorbell_offset.get(),
            SQ_DOORBELL,
        )?;
        Ok(Self {
            qpn: abi.qpn.get(),
            uar_index: abi.uar_index.get(),
        })
    }

    /// The layout.
    pub fn emit(&self) -> CreateQpPrivOutAbi {
        CreateQpPrivOutAbi {
            qpn: Le32::new(self.qpn),
            uar_index: Le32::new(self.uar_index),
            doorbell_offset: Le16::new(SQ_DOORBELL as u16),
            reserved_at_0xa: [0; 6],
        }
    }
}

// ---------------------------------------------------------------------------
// CreateSrq
// ---------------------------------------------------------------------------

/// `CreateSrq` private input: the SRQ's ring and producer record in the
/// caller's memory (PRM 6.4, 10.3; an SRQ has no doorbell, only its record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CreateSrqPriv {
    /// `log2` of the WQEs.
    pub log_entries: u8,
    /// `log2` of the stride (at least 32 bytes).
    pub log_stride: u8,
    /// The ring.
    pub ring: UserRange,
    /// The producer record.
    pub dbr: UserRange,
}

/// ABI layout of [`CreateSrqPriv`]: 32 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CreateSrqPrivAbi {
    /// Ring user VA.
    pub ring_va: Le64,
    /// Producer record user VA.
    pub dbr_va: Le64,
    /// Ring bytes: `1 << (log_entries + log_stride)`.
    pub ring_bytes: Le32,
    /// `log2` of the WQEs.
    pub log_entries: u8,
    /// `log2` of the stride.
    pub log_stride: u8,
    /// Reserved, zero.
    pub reserved_at_0x16: [u8; 10],
}

assert_layout!(CreateSrqPrivAbi, size = 32, ring_va @ 0x00, dbr_va @ 0x08,
    ring_bytes @ 0x10, log_entries @ 0x14, log_stride @ 0x15, reserved_at_0x16 @ 0x16);

impl CreateSrqPriv {
    /// Bytes of the record.
    pub const SIZE: usize = core::mem::size_of::<CreateSrqPrivAbi>();

    /// A layout from its parts (the UVP's side; checked as the kernel
    /// will).
    pub fn new(
        log_entries: u8,
        log_stride: u8,
        ring_va: u64,
        dbr_va: u64,
    ) -> Result<Self, AbiError> {
        let len = ring_bytes(
            "CreateSrqPrivAbi.log_entries",
            u32::from(log_entries) + u32::from(log_stride),
        )?;
        let abi = CreateSrqPrivAbi {
            ring_va: Le64::new(ring_va),
            dbr_va: Le64::new(dbr_va),
            ring_bytes: Le32::new(len as u32),
            log_entries,
            log_stride,
            reserved_at_0x16: [0; 10],
        };
        Self::parse(abi.as_bytes())
    }

    /// Parses and checks the record (the kernel's side; hostile bytes).
    pub fn parse(bytes: &[u8]) -> Result<Self, AbiError> {
        let abi: CreateSrqPrivAbi = read_exact("CreateSrqPrivAbi", bytes)?;
        ensure_zero("CreateSrqPrivAbi.reserved_at_0x16", &abi.reserved_at_0x16)?;
        check_recv_stride("CreateSrqPrivAbi.log_stride", abi.log_stride)?;
        let len = declared_ring_len(
            "CreateSrqPrivAbi.log_entries",
            u32::from(abi.log_entries) + u32::from(abi.log_stride),
            "CreateSrqPrivAbi.ring_bytes",
            abi.ring_bytes.get().into(),
        )?;
        let ring = checked_ring("CreateSrqPrivAbi.ring_va", abi.ring_va.get(), len)?;
        let dbr = checked_dbr("CreateSrqPrivAbi.dbr_va", abi.dbr_va.get())?;
        disjoint("CreateSrqPrivAbi.dbr_va (overlaps the ring)", &[ring, dbr])?;
        Ok(Self {
            log_entries: abi.log_entries,
            log_stride: abi.log_stride,
            ring,
            dbr,
        })
    }

    /// The layout.
    pub fn emit(&self) -> CreateSrqPrivAbi {
        CreateSrqPrivAbi {
            ring_va: Le64::new(self.ring.va),
            dbr_va: Le64::new(self.dbr.va),
            ring_bytes: Le32::new(self.ring.len as u32),
            log_entries: self.log_entries,
            log_stride: self.log_stride,
            reserved_at_0x16: [0; 10],
        }
    }
}

/// `CreateSrq` private output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CreateSrqPrivOut {
    /// The SRQ number.
    pub srqn: u32,
}

/// ABI layout of [`CreateSrqPrivOut`]: 8 bytes.
#[derive(Debug, Clone, Copy, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CreateSrqPrivOutAbi {
    /// SRQ number (24 bits).
    pub srqn: Le32,
    /// Reserved, zero.
    pub reserved_at_0x4: [u8; 4],
}

assert_layout!(CreateSrqPrivOutAbi, size = 8, srqn @ 0, reserved_at_0x4 @ 4);

impl CreateSrqPrivOut {
    /// Bytes of the record.
    pub const SIZE: usize = core::mem::size_of::<CreateSrqPrivOutAbi>();

    /// Parses the record (the UVP's side).
    pub fn parse(bytes: &[u8]) -> Result<Self, AbiError> {
        let abi: CreateSrqPrivOutAbi = read_exact("CreateSrqPrivOutAbi", bytes)?;
        ensure_zero("CreateSrqPrivOutAbi.reserved_at_0x4", &abi.reserved_at_0x4)?;
        check_object_number("CreateSrqPrivOutAbi.srqn", abi.srqn.get())?;
        Ok(Self {
            srqn: abi.srqn.get(),
        })
    }

    /// The layout.
    pub fn emit(&self) -> CreateSrqPrivOutAbi {
        CreateSrqPrivOutAbi {
            srqn: Le32::new(self.srqn),
            reserved_at_0x4: [0; 4],
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const PAGE: u64 = 4096;

    #[test]
    fn cq_record_bytes_and_checks() {
        let cq = CreateCqPriv::new(4, 0x10_0000_0000, 0x10_0000_2000).unwrap();
        assert_eq!(cq.ring.len, 512);
        let bytes = cq.emit();
        let raw = bytes.as_bytes();
        assert_eq!(&raw[0..8], &0x10_0000_0000u64.to_le_bytes());
        assert_eq!(&raw[8..16], &512u64.to_le_bytes());
        assert_eq!(&raw[16..24], &0x10_0000_2000u64.to_le_bytes());
        assert_eq!(raw[24], 4);
        assert_eq!(CreateCqPriv::parse(raw), Ok(cq));
        // Misaligned ring, misaligned record, record inside the ring,
        // a ring that wraps, a log too large, reserved bytes, lengths.
        assert!(CreateCqPriv::new(4, 0x10_0000_0020, 0x10_0000_2000).is_err());
        assert!(CreateCqPriv::new(4, 0x10_0000_0000, 0x10_0000_2002).is_err());
        assert!(CreateCqPriv::new(4, 0x10_0000_0000, 0x10_0000_0100).is_err());
        assert!(CreateCqPriv::new(4, u64::MAX - 255, 0x1000).is_err());
        assert!(CreateCqPriv::new(27, PAGE, 0x1000_0000_0000).is_err());
        assert!(CreateCqPriv::new(4, 0, 0x1000).is_err());
        let mut bad = bytes;
        bad.reserved_at_0x19[3] = 1;
        assert!(CreateCqPriv::parse(bad.as_bytes()).is_err());
        let mut bad = bytes;
        bad.ring_bytes = Le64::new(1024);
        assert!(CreateCqPriv::parse(bad.as_bytes()).is_err());
        assert!(CreateCqPriv::parse(&raw[..31]).is_err());
        let mut long = raw.to_vec();
        long.push(0);
        assert!(CreateCqPriv::parse(&long).is_err());
    }

    #[test]
    fn resize_record_bytes_and_checks() {
        let resize = ResizeCqPriv::new(5, 0x10_0000_4000).unwrap();
        assert_eq!(resize.ring.len, 1024);
        let bytes = resize.emit();
        let raw = bytes.as_bytes();
        assert_eq!(&raw[0..8], &0x10_0000_4000u64.to_le_bytes());
        assert_eq!(&raw[8..16], &1024u64.to_le_bytes());
        assert_eq!(raw[16], 5);
        assert_eq!(ResizeCqPriv::parse(raw), Ok(resize));
        // Misaligned, null, wrapping, a log too large, reserved bytes, a
        // length that disagrees with the log, short and long records.
        assert!(ResizeCqPriv::new(5, 0x10_0000_4020).is_err());
        assert!(ResizeCqPriv::new(5, 0).is_err());
        assert!(ResizeCqPriv::new(5, u64::MAX - 511).is_err());
        assert!(ResizeCqPriv::new(27, PAGE).is_err());
        let mut bad = bytes;
        bad.reserved_at_0x11[6] = 1;
        assert!(ResizeCqPriv::parse(bad.as_bytes()).is_err());
        let mut bad = bytes;
        bad.ring_bytes = Le64::new(512);
        assert!(ResizeCqPriv::parse(bad.as_bytes()).is_err());
        assert!(ResizeCqPriv::parse(&raw[..23]).is_err());
        let mut long = raw.to_vec();
        long.push(0);
        assert!(ResizeCqPriv::parse(&long).is_err());
    }

    #[test]
    fn qp_record_bytes_and_checks() {
        let qp = CreateQpPriv::new(6, 1, 0x20_0000, Some((4, 5, 0x30_0000, 0x40_0000))).unwrap();
        let raw = qp.emit();
        assert_eq!(raw.sq_bytes.get(), 4096);
        assert_eq!(raw.rq_bytes.get(), 512);
        assert_eq!(CreateQpPriv::parse(raw.as_bytes()), Ok(qp));
        // On an SRQ: no receive queue.
        let srq_qp = CreateQpPriv::new(6, 1, 0x20_0000, None).unwrap();
        assert_eq!(srq_qp.rq, None);
        // Overlaps: RQ inside the SQ, record inside the RQ.
        assert!(CreateQpPriv::new(6, 1, 0x20_0000, Some((4, 5, 0x20_0800, 0x40_0000))).is_err());
        assert!(CreateQpPriv::new(6, 1, 0x20_0000, Some((4, 5, 0x30_0000, 0x30_0010))).is_err());
        // WQE stride larger than the ring, stride below 32, half a receive
        // queue.
        assert!(CreateQpPriv::new(1, 2, 0x20_0000, None).is_err());
        assert!(CreateQpPriv::new(6, 1, 0x20_0000, Some((4, 4, 0x30_0000, 0x40_0000))).is_err());
        let mut half = raw;
        half.rq_dbr_va = Le64::new(0);
        assert!(CreateQpPriv::parse(half.as_bytes()).is_err());
        // Huge logs never overflow a shift.
        let mut huge = raw;
        huge.sq_log_bbs = 255;
        assert!(CreateQpPriv::parse(huge.as_bytes()).is_err());
    }

    #[test]
    fn out_records_round_trip() {
        let open = OpenCaPriv {
            uar_index: 3,
            log_max_cqes: 16,
            log_max_wqes: 14,
            log_max_wqe_size: 9,
            log_max_srq_wqes: 14,
            max_send_sges: 16,
            max_recv_sges: 16,
            max_inline: 256,
            num_ports: 2,
        };
        assert_eq!(OpenCaPriv::parse(open.emit().as_bytes()), Ok(open));
        let mut portless = open.emit();
        portless.num_ports = 0;
        assert!(OpenCaPriv::parse(portless.as_bytes()).is_err());
        let mut kernel_page = open.emit();
        kernel_page.uar_index = Le32::new(0);
        assert!(OpenCaPriv::parse(kernel_page.as_bytes()).is_err());
        let cq = CreateCqPrivOut {
            cqn: 7,
            log_entries: 5,
        };
        assert_eq!(CreateCqPrivOut::parse(cq.emit().as_bytes()), Ok(cq));
        let qp = CreateQpPrivOut {
            qpn: 0x40,
            uar_index: 3,
        };
        assert_eq!(CreateQpPrivOut::parse(qp.emit().as_bytes()), Ok(qp));
        let srq = CreateSrqPrivOut { srqn: 9 };
        assert_eq!(CreateSrqPrivOut::parse(srq.emit().as_bytes()), Ok(srq));
    }

    #[test]
    fn srq_record_checks() {
        let srq = CreateSrqPriv::new(5, 6, 0x50_0000, 0x60_0000).unwrap();
        assert_eq!(CreateSrqPriv::parse(srq.emit().as_bytes()), Ok(srq));
        assert!(CreateSrqPriv::new(5, 4, 0x50_0000, 0x60_0000).is_err());
        assert!(CreateSrqPriv::new(5, 6, 0x50_0000, 0x50_0004).is_err());
        assert!(CreateSrqPriv::new(30, 6, 0x50_0000, 0x60_0000).is_err());
    }

    /// Parses `bytes` with `parse` and, if it parses, checks that it
    /// re-emits to the same bytes.
    fn round_trips<T, A: IntoBytes + Immutable>(
        bytes: &[u8],
        parse: fn(&[u8]) -> Result<T, AbiError>,
        emit: fn(&T) -> A,
    ) {
        if let Ok(value) = parse(bytes) {
            assert_eq!(emit(&value).as_bytes(), bytes);
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_and_reemit(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            round_trips(&bytes, OpenCaPriv::parse, OpenCaPriv::emit);
            round_trips(&bytes, CreateCqPriv::parse, CreateCqPriv::emit);
            round_trips(&bytes, CreateCqPrivOut::parse, CreateCqPrivOut::emit);
            round_trips(&bytes, ResizeCqPriv::parse, ResizeCqPriv::emit);
            round_trips(&bytes, CreateQpPriv::parse, CreateQpPriv::emit);
            round_trips(&bytes, CreateQpPrivOut::parse, CreateQpPrivOut::emit);
            round_trips(&bytes, CreateSrqPriv::parse, CreateSrqPriv::emit);
            round_trips(&bytes, CreateSrqPrivOut::parse, CreateSrqPrivOut::emit);
        }

        #[test]
        fn valid_cq_records_round_trip(log in 0u8..20, ring_page in 1u64..1 << 30, dbr_page in 1u64..1 << 30) {
            let ring_va = ring_page * PAGE;
            let dbr_va = dbr_page * PAGE + 0x40;
            if let Ok(cq) = CreateCqPriv::new(log, ring_va, dbr_va) {
                prop_assert!(!cq.ring.overlaps(&cq.dbr));
                prop_assert_eq!(CreateCqPriv::parse(cq.emit().as_bytes()), Ok(cq));
            }
        }

        #[test]
        fn valid_resize_records_round_trip(log in 0u8..30, ring_va in any::<u64>()) {
            if let Ok(resize) = ResizeCqPriv::new(log, ring_va) {
                prop_assert_eq!(resize.ring.va % RING_ALIGN, 0);
                prop_assert!(resize.ring.va.checked_add(resize.ring.len).is_some());
                prop_assert_eq!(resize.ring.len, 32u64 << log);
                prop_assert_eq!(ResizeCqPriv::parse(resize.emit().as_bytes()), Ok(resize));
            }
        }

        #[test]
        fn parsed_qp_ranges_never_overlap_or_wrap(
            sq_va in any::<u64>(), rq_va in any::<u64>(), dbr_va in any::<u64>(),
            logs in any::<[u8; 4]>(),
        ) {
            let rq = Some((logs[2] % 24, logs[3] % 24, rq_va, dbr_va));
            if let Ok(qp) = CreateQpPriv::new(logs[0] % 26, logs[1] % 26, sq_va, rq) {
                prop_assert!(qp.sq.va.checked_add(qp.sq.len).is_some());
                let rq = qp.rq.unwrap();
                prop_assert!(!qp.sq.overlaps(&rq.ring));
                prop_assert!(!qp.sq.overlaps(&rq.dbr));
                prop_assert!(!rq.ring.overlaps(&rq.dbr));
                prop_assert!(rq.ring.va.checked_add(rq.ring.len).is_some());
            }
        }
    }
}
