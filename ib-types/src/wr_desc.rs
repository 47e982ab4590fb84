//! Work-request descriptors for the kernel fast-path entry points of the CI
//! and AL interfaces (`post_send`, `post_recv`, `post_srq_recv`).
//!
//! [`SendWr`] and [`RecvWr`] borrow their scatter/gather list as a Rust
//! slice, which cannot cross a function table between separately built
//! drivers. A descriptor is the same request as a `#[repr(C)]` record: the
//! list becomes a pointer and a count, the operation an opcode with its
//! operands in fixed fields. Descriptors are call arguments in memory, so
//! their integers are native (little-endian on every Windows target); the
//! immediate data stays in network order as in [`SendOp`].
//!
//! Building a descriptor is safe. Reading one back needs the scatter/gather
//! slice, which only the caller of the entry point (the provider's shell,
//! where `unsafe` lives) can rebuild from the pointer and count; [`decode`]
//! then checks everything else, and rejects operand fields the opcode does
//! not use, so a descriptor has one meaning.
//!
//! [`decode`]: SendWrDesc::decode

use crate::abi::{AbiError, Be32};
use crate::access::AccessFlags;
use crate::handle::{AvHandle, MwHandle};
use crate::scalars::{QKey, Qpn};
use crate::wr::{
    LKey, MwBind, RKey, RecvWr, RemoteAddr, SendFlags, SendOp, SendWr, Sge, UdDest, WrOpcode,
};

/// A send work request as a fixed record (88 bytes on 64-bit targets).
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct SendWrDesc {
    /// Consumer cookie.
    pub wr_id: u64,
    /// First scatter/gather entry (may be null when `num_sge` is 0).
    pub sg_list: *const Sge,
    /// Entries at `sg_list`.
    pub num_sge: u32,
    /// [`WrOpcode`] code.
    pub opcode: u8,
    /// Zero.
    pub reserved_at_0x15: [u8; 3],
    /// [`SendFlags`] bits.
    pub flags: u32,
    /// Immediate data (SendWithImm, RdmaWriteWithImm), network order.
    pub imm: Be32,
    /// Remote address (RDMA, atomics) or window start (BindMw).
    pub remote_addr: u64,
    /// Remote key (RDMA, atomics), key to invalidate (SendWithInvalidate,
    /// LocalInvalidate) or the window's new key (BindMw).
    pub rkey: u32,
    /// Region key a window is bound to (BindMw).
    pub bind_lkey: u32,
    /// Compare value (CompareSwap), addend (FetchAdd) or window length
    /// (BindMw).
    pub compare_add: u64,
    /// Swap value (CompareSwap).
    pub swap: u64,
    /// The window (BindMw) or the destination address vector (UD sends).
    pub handle: u64,
    /// Destination QP (UD sends).
    pub remote_qpn: u32,
    /// Q_Key (UD sends).
    pub remote_qkey: u32,
    /// Window rights, [`AccessFlags`] bits (BindMw).
    pub bind_access: u32,
    /// Zero.
    pub reserved_at_0x54: [u8; 4],
}

#[cfg(target_pointer_width = "64")]
assert_layout!(SendWrDesc, size = 88, wr_id @ 0, sg_list @ 8, num_sge @ 16, opcode @ 20,
    reserved_at_0x15 @ 21, flags @ 24, imm @ 28, remote_addr @ 32, rkey @ 40,
    bind_lkey @ 44, compare_add @ 48, swap @ 56, handle @ 64, remote_qpn @ 72,
    remote_qkey @ 76, bind_access @ 80, reserved_at_0x54 @ 84);

impl SendWrDesc {
    const ZERO: Self = Self {
        wr_id: 0,
        sg_list: core::ptr::null(),
        num_sge: 0,
        opcode: 0,
        reserved_at_0x15: [0; 3],
        flags: 0,
        imm: Be32::ZERO,
        remote_addr: 0,
        rkey: 0,
        bind_lkey: 0,
        compare_add: 0,
        swap: 0,
        handle: 0,
        remote_qpn: 0,
        remote_qkey: 0,
        bind_access: 0,
        reserved_at_0x54: [0; 4],
    };

    /// The descriptor of `wr`. It points at `wr.sg_list`, which must stay
    /// alive for as long as the descriptor is used.
    pub fn encode(wr: &SendWr<'_>) -> Self {
        let mut d = Self {
            wr_id: wr.wr_id,
            sg_list: wr.sg_list.as_ptr(),
            // A list longer than u32::MAX cannot be valid; saturating makes
            // `decode` refuse it instead of silently truncating.
            num_sge: u32::try_from(wr.sg_list.len()).unwrap_or(u32::MAX),
            opcode: wr.op.opcode().code(),
            flags: wr.flags.bits(),
            ..Self::ZERO
        };
        let remote = |d: &mut Self, r: RemoteAddr| {
            d.remote_addr = r.addr;
            d.rkey = r.rkey.get();
        };
        match wr.op {
            SendOp::Send => {}
            SendOp::SendWithImm { imm } => d.imm = imm,
            SendOp::SendWithInvalidate { rkey } | SendOp::LocalInvalidate { rkey } => {
                d.rkey = rkey.get();
            }
            SendOp::RdmaWrite { remote: r } | SendOp::RdmaRead { remote: r } => remote(&mut d, r),
            SendOp::RdmaWriteWithImm { remote: r, imm } => {
                remote(&mut d, r);
                d.imm = imm;
            }
            SendOp::CompareSwap {
                remote: r,
                compare,
                swap,
            } => {
                remote(&mut d, r);
                d.compare_add = compare;
                d.swap = swap;
            }
            SendOp::FetchAdd { remote: r, add } => {
                remote(&mut d, r);
                d.compare_add = add;
            }
            SendOp::BindMw { mw, rkey, bind } => {
                d.handle = mw.raw();
                d.rkey = rkey.get();
                d.bind_lkey = bind.mr_lkey.get();
                d.remote_addr = bind.addr;
                d.compare_add = bind.length;
                d.bind_access = bind.access.bits();
            }
        }
        if let Some(ud) = wr.ud {
            d.handle = ud.av.raw();
            d.remote_qpn = ud.remote_qpn.get();
            d.remote_qkey = ud.remote_qkey.get();
        }
        d
    }

    /// Reads the descriptor back, given the scatter/gather entries its
    /// pointer and count designate. Fails on a count that disagrees with
    /// `sg_list`, unknown opcodes or flag bits, and any operand field the
    /// opcode does not use being non-zero. Whether the request makes sense
    /// for the QP is [`SendWr::validate`]'s job.
    pub fn decode<'a>(&self, sg_list: &'a [Sge]) -> Result<SendWr<'a>, AbiError> {
        if self.num_sge as usize != sg_list.len() {
            return Err(AbiError::BadLength {
                field: "SendWrDesc.num_sge",
                declared: self.num_sge.into(),
                available: sg_list.len() as u64,
            });
        }
        let opcode = WrOpcode::from_code(self.opcode)?;
        let remote = RemoteAddr {
            addr: self.remote_addr,
            rkey: RKey::new(self.rkey),
        };
        let op = match opcode {
            WrOpcode::Send => SendOp::Send,
            WrOpcode::SendWithImm => SendOp::SendWithImm { imm: self.imm },
            WrOpcode::SendWithInvalidate => SendOp::SendWithInvalidate { rkey: remote.rkey },
            WrOpcode::RdmaWrite => SendOp::RdmaWrite { remote },
            WrOpcode::RdmaWriteWithImm => SendOp::RdmaWriteWithImm {
                remote,
                imm: self.imm,
            },
            WrOpcode::RdmaRead => SendOp::RdmaRead { remote },
            WrOpcode::CompareSwap => SendOp::CompareSwap {
                remote,
                compare: self.compare_add,
                swap: self.swap,
            },
            WrOpcode::FetchAdd => SendOp::FetchAdd {
                remote,
                add: self.compare_add,
            },
            WrOpcode::BindMw => SendOp::BindMw {
                mw: MwHandle::from_raw(self.handle),
                rkey: remote.rkey,
                bind: MwBind {
                    mr_lkey: LKey::new(self.bind_lkey),
                    addr: self.remote_addr,
                    length: self.compare_add,
                    access: AccessFlags::from_raw(self.bind_access)?,
                },
            },
            WrOpcode::LocalInvalidate => SendOp::LocalInvalidate { rkey: remote.rkey },
        };
        // For every opcode but BindMw a non-zero handle is a UD destination.
        let ud = (opcode != WrOpcode::BindMw && self.handle != 0)
            .then(|| -> Result<UdDest, AbiError> {
                Ok(UdDest {
                    av: AvHandle::from_raw(self.handle),
                    remote_qpn: Qpn::new(self.remote_qpn)?,
                    remote_qkey: QKey::new(self.remote_qkey),
                })
            })
            .transpose()?;
        let wr = SendWr {
            wr_id: self.wr_id,
            op,
            flags: SendFlags::from_raw(self.flags)?,
            sg_list,
            ud,
        };
        // One meaning per descriptor: re-encoding must give the same fields.
        if !Self::encode(&wr).same_fields(self) {
            return Err(AbiError::ReservedNotZero {
                field: "SendWrDesc (operand unused by the opcode, or reserved)",
            });
        }
        Ok(wr)
    }

    /// Field-wise equality, ignoring the list pointer (the caller resolved it).
    fn same_fields(&self, other: &Self) -> bool {
        let key = |d: &Self| {
            (
                (d.wr_id, d.num_sge, d.opcode, d.reserved_at_0x15, d.flags),
                (
                    d.imm,
                    d.remote_addr,
                    d.rkey,
                    d.bind_lkey,
                    d.compare_add,
                    d.swap,
                ),
                (d.handle, d.remote_qpn, d.remote_qkey, d.bind_access),
                d.reserved_at_0x54,
            )
        };
        key(self) == key(other)
    }
}

/// A receive work request as a fixed record (24 bytes on 64-bit targets).
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct RecvWrDesc {
    /// Consumer cookie.
    pub wr_id: u64,
    /// First scatter/gather entry (may be null when `num_sge` is 0).
    pub sg_list: *const Sge,
    /// Entries at `sg_list`.
    pub num_sge: u32,
    /// Zero.
    pub reserved_at_0x14: [u8; 4],
}

#[cfg(target_pointer_width = "64")]
assert_layout!(RecvWrDesc, size = 24, wr_id @ 0, sg_list @ 8, num_sge @ 16,
    reserved_at_0x14 @ 20);

impl RecvWrDesc {
    /// The descriptor of `wr`; `wr.sg_list` must outlive it.
    pub fn encode(wr: &RecvWr<'_>) -> Self {
        Self {
            wr_id: wr.wr_id,
            sg_list: wr.sg_list.as_ptr(),
            num_sge: u32::try_from(wr.sg_list.len()).unwrap_or(u32::MAX),
            reserved_at_0x14: [0; 4],
        }
    }

    /// Reads the descriptor back given its scatter/gather entries.
    pub fn decode<'a>(&self, sg_list: &'a [Sge]) -> Result<RecvWr<'a>, AbiError> {
        if self.num_sge as usize != sg_list.len() {
            return Err(AbiError::BadLength {
                field: "RecvWrDesc.num_sge",
                declared: self.num_sge.into(),
                available: sg_list.len() as u64,
            });
        }
        if self.reserved_at_0x14 != [0; 4] {
            return Err(AbiError::ReservedNotZero {
                field: "RecvWrDesc.reserved_at_0x14",
            });
        }
        Ok(RecvWr {
            wr_id: self.wr_id,
            sg_list,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::testing::Corruption;

    const SGL: [Sge; 2] = [
        Sge::new(0x1000, 8, LKey::new(0x101)),
        Sge::new(0x2000, 100, LKey::new(0x201)),
    ];

    fn every_op() -> Vec<SendOp> {
        let remote = RemoteAddr {
            addr: 0x7000_0008,
            rkey: RKey::new(0x0003_0207),
        };
        vec![
            SendOp::Send,
            SendOp::SendWithImm {
                imm: Be32::new(0xdead_beef),
            },
            SendOp::SendWithInvalidate {
                rkey: RKey::new(0x501),
            },
            SendOp::RdmaWrite { remote },
            SendOp::RdmaWriteWithImm {
                remote,
                imm: Be32::new(7),
            },
            SendOp::RdmaRead { remote },
            SendOp::CompareSwap {
                remote,
                compare: 1,
                swap: 2,
            },
            SendOp::FetchAdd { remote, add: 3 },
            SendOp::BindMw {
                mw: MwHandle::from_raw(44),
                rkey: RKey::new(0x0009_0002),
                bind: MwBind {
                    mr_lkey: LKey::new(0x0008_0001),
                    addr: 0x9000,
                    length: 4096,
                    access: AccessFlags::REMOTE_READ,
                },
            },
            SendOp::LocalInvalidate {
                rkey: RKey::new(0x0009_0002),
            },
        ]
    }

    #[test]
    fn every_opcode_round_trips() {
        let ops = every_op();
        assert_eq!(ops.len(), WrOpcode::ALL.len());
        for op in ops {
            let sg_list: &[Sge] = if op.opcode().is_memory_op() {
                &[]
            } else {
                &SGL
            };
            let wr = SendWr {
                wr_id: 0xABCD,
                op,
                flags: SendFlags::SIGNALED | SendFlags::FENCE,
                sg_list,
                ud: None,
            };
            let desc = SendWrDesc::encode(&wr);
            assert_eq!(desc.sg_list, sg_list.as_ptr());
            assert_eq!(desc.decode(sg_list), Ok(wr), "{:?}", op.opcode());
        }
    }

    #[test]
    fn ud_destination_round_trips() {
        let wr = SendWr {
            wr_id: 1,
            op: SendOp::SendWithImm { imm: Be32::new(5) },
            flags: SendFlags::SIGNALED,
            sg_list: &SGL[..1],
            ud: Some(UdDest {
                av: AvHandle::from_raw(0x33),
                remote_qpn: Qpn::new(0x12_3456).unwrap(),
                remote_qkey: QKey::new(0x1111_2222),
            }),
        };
        let desc = SendWrDesc::encode(&wr);
        assert_eq!(desc.decode(&SGL[..1]), Ok(wr));
    }

    #[test]
    fn decode_rejects_ambiguous_or_bad_descriptors() {
        let wr = SendWr {
            wr_id: 1,
            op: SendOp::Send,
            flags: SendFlags::empty(),
            sg_list: &SGL,
            ud: None,
        };
        let good = SendWrDesc::encode(&wr);
        let cases: &[Corruption<SendWrDesc>] = &[
            (|d| d.opcode = 10, "unknown opcode"),
            (|d| d.flags = 1 << 7, "unknown flag"),
            (|d| d.swap = 1, "swap on a send"),
            (|d| d.bind_access = 1, "bind rights on a send"),
            (|d| d.reserved_at_0x54 = [0, 0, 1, 0], "reserved"),
            (|d| d.num_sge = 1, "count disagrees with the list"),
            (
                |d| {
                    d.handle = 3;
                    d.remote_qpn = 1 << 24;
                },
                "24-bit QPN",
            ),
        ];
        for (corrupt, what) in cases {
            let mut d = good;
            corrupt(&mut d);
            assert!(d.decode(&SGL).is_err(), "{what} must be rejected");
        }
    }

    #[test]
    fn recv_round_trip() {
        let wr = RecvWr {
            wr_id: 9,
            sg_list: &SGL,
        };
        let desc = RecvWrDesc::encode(&wr);
        assert_eq!(desc.decode(&SGL), Ok(wr));
        assert!(desc.decode(&SGL[..1]).is_err());
        let mut bad = desc;
        bad.reserved_at_0x14[0] = 1;
        assert!(bad.decode(&SGL).is_err());
    }
}
