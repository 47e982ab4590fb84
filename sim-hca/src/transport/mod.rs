//! The IB transport engine (IBA chapter 9) over RoCEv2: per-QP requester,
//! completer and responder state, and the device methods that run them.
//!
//! - `send`: the requester. Fetches send WQEs, checks local keys, segments
//!   messages by the path MTU, numbers packets with 24-bit PSNs, and
//!   retransmits (RC) from the oldest unacknowledged PSN.
//! - `complete`: the completer. Consumes ACKs, NAKs, RDMA read responses and
//!   atomic acknowledgements; runs the ACK timeout and RNR timers; retires
//!   WQEs in order and writes their completions.
//! - `recv`: the responder. Validates every packet (IBA 9.6 checks: QP,
//!   state, P_Key, Q_Key, PSN, opcode sequence), places data, enforces
//!   memory protection, answers with ACK/NAK/read responses/atomic
//!   acknowledgements, and replays duplicates without re-executing them.
//! - `flush`: state transitions with effects — error flushing, reset, drain.
//!
//! Errors map to completion statuses in one place per side (the requester's
//! `fail_wqe` and the responder's `responder_error`), as rxe does.

mod complete;
pub(crate) mod direct;
mod flush;
mod recv;
mod send;

use std::collections::VecDeque;

use hca_prm::wqe::WqeOpcode;
use ib_types::scalars::Psn;
use ib_types::wc::WcStatus;
use ib_types::wr::Sge;

/// The most scatter/gather entries a receive WQE may carry (the device
/// limit); receive state keeps them inline so receiving never allocates.
pub(crate) const MAX_SGES: usize = 16;

/// Request packets after which the requester asks for an ACK even in the
/// middle of a long message (the responder ACKs only when asked, which
/// coalesces one ACK per message or per this many packets).
const ACK_REQ_INTERVAL: u32 = 64;

/// The local ACK timeout of IBA 9.7.6.1.3: 4.096 µs · 2^timeout; 0 disables
/// it. Values are clamped at the 5-bit maximum.
pub(crate) fn ack_timeout_ns(timeout: u8) -> Option<u64> {
    if timeout == 0 {
        None
    } else {
        Some(4096u64 << timeout.min(31))
    }
}

/// The RNR NAK timer of IBA Table 45 (code -> microseconds), in ns.
pub(crate) fn rnr_timer_ns(code: u8) -> u64 {
    const MICROS_X100: [u32; 32] = [
        65536, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
        1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
    ];
    // Code 0 is 655.36 ms; code n >= 1 is MICROS_X100[n] * 10 µs.
    let tens_of_us = MICROS_X100[usize::from(code & 0x1F)];
    u64::from(tens_of_us) * 10_000
}

/// A packet as the transport sees it: its validated headers and its
/// payload (in a received frame, or still in the sender's memory with
/// direct placement).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rx<'a> {
    pub repr: &'a crate::wire::PacketRepr,
    pub payload: RxData<'a>,
}

impl<'a> Rx<'a> {
    pub(crate) fn repr(&self) -> &'a crate::wire::PacketRepr {
        self.repr
    }

    pub(crate) fn payload(&self) -> RxData<'a> {
        self.payload
    }
}

/// A received payload: bytes in hand, or (direct placement) pieces of the
/// sender's memory that placement copies straight to their destination.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RxData<'a> {
    Bytes(&'a [u8]),
    InMemory(SourceSpan<'a>),
}

impl RxData<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Bytes(b) => b.len(),
            Self::InMemory(span) => span.len,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A payload still in the sender's memory: `(bus address, length)` pieces
/// in order, `len` bytes in all, probed readable when the message arrived.
#[derive(Clone, Copy)]
pub(crate) struct SourceSpan<'a> {
    pub mem: &'a dyn crate::host::HostMemory,
    pub pieces: &'a [(u64, usize)],
    pub len: usize,
    /// Where placement may defer its copies (merged with the previous
    /// packets'), for the carrier to make before anything the packet
    /// causes can be observed; `None`: copy now.
    pub defer: Option<&'a std::cell::RefCell<Vec<DeferredCopy>>>,
    /// The packet's index in its message.
    pub packet: usize,
}

/// A copy direct placement put off: `len` bytes from bus address `from` of
/// the sender's memory to `to` of the receiver's, first needed by packet
/// `packet` of the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeferredCopy {
    pub from: u64,
    pub to: u64,
    pub len: usize,
    pub packet: usize,
}

/// Adds a copy to `copies`, merged into the last one when it continues it
/// on both sides.
pub(crate) fn defer_copy(copies: &mut Vec<DeferredCopy>, copy: DeferredCopy) {
    if let Some(last) = copies.last_mut()
        && last.from + last.len as u64 == copy.from
        && last.to + last.len as u64 == copy.to
    {
        last.len += copy.len;
        return;
    }
    copies.push(copy);
}

impl std::fmt::Debug for SourceSpan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceSpan")
            .field("pieces", &self.pieces)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl SourceSpan<'_> {
    /// Calls `f(bus_address, at, n)` for the source pieces of bytes
    /// `offset..offset + len` of the payload, `at` counting from `offset`.
    pub(crate) fn for_each_piece<E>(
        &self,
        offset: usize,
        len: usize,
        mut f: impl FnMut(u64, usize, usize) -> Result<(), E>,
    ) -> Result<(), E> {
        let (mut start, mut at) = (0usize, 0usize);
        for &(bus, piece_len) in self.pieces {
            if at == len {
                break;
            }
            let end = start + piece_len;
            let from = offset + at;
            if from < end {
                let skip = from - start;
                let n = (piece_len - skip).min(len - at);
                f(bus + skip as u64, at, n)?;
                at += n;
            }
            start = end;
        }
        Ok(())
    }
}

/// A send WQE the requester has fetched and not yet retired.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendRecord {
    /// Basic-block counter of the WQE's first block.
    pub bb_start: u32,
    /// The control segment's index (reported in the CQE).
    pub wqe_index: u16,
    pub opcode: WqeOpcode,
    pub signaled: bool,
    /// Message length.
    pub len: u32,
    /// First PSN of the operation.
    pub first_psn: Psn,
    /// PSNs the operation consumes (response packets for reads).
    pub npkts: u32,
    /// Packets of the operation known to have arrived: request packets
    /// acknowledged (sends and writes, partial ACKs included) or response
    /// packets received (reads). A retransmission resumes after them.
    pub acked_pkts: u32,
    /// Finished; waiting for earlier WQEs to retire first.
    pub done: bool,
    /// The completion status once done.
    pub status: WcStatus,
}

impl SendRecord {
    /// The last PSN of the operation.
    pub(crate) fn last_psn(&self) -> Psn {
        self.first_psn.wrapping_add(self.npkts.saturating_sub(1))
    }

    /// True for operations that need a response carrying data back.
    pub(crate) fn is_read_or_atomic(&self) -> bool {
        matches!(
            self.opcode,
            WqeOpcode::RdmaRead | WqeOpcode::AtomicCs | WqeOpcode::AtomicFa
        )
    }

    /// True when `psn` lies within the operation's PSN range.
    pub(crate) fn contains(&self, psn: Psn) -> bool {
        self.npkts > 0 && psn.distance_from(self.first_psn) < self.npkts
    }
}

/// Per-QP requester and completer state.
#[derive(Debug, Default)]
pub(crate) struct Requester {
    /// Basic-block counter of the next WQE to fetch.
    pub fetch: u32,
    /// The next PSN to assign.
    pub psn: Psn,
    /// Fetched WQEs not yet retired, oldest first.
    pub inflight: VecDeque<SendRecord>,
    /// RDMA reads and atomics outstanding.
    pub rd_atomic: u32,
    /// Transport retries left before `RETRY_EXC_ERR` (RC): every ACK
    /// timeout, PSN sequence NAK and read-response gap spends one; progress
    /// restores `retry_cnt`.
    pub retries_left: u8,
    /// A retry is under way and no progress has been made since: a gap in
    /// the read responses (an implied NAK) starts no other, so the
    /// responses still in flight from before the retry are ignored; only
    /// the ACK timer retries again.
    pub retrying: bool,
    /// RNR retries left before `RNR_RETRY_EXC_ERR` (RC; 7 = forever).
    pub rnr_left: u8,
    /// When the ACK timeout fires (RC, while requests are outstanding).
    pub ack_deadline: Option<u64>,
    /// While set, an RNR NAK holds transmission until this time, then
    /// retransmission starts at `rnr_psn`.
    pub rnr_until: Option<u64>,
    pub rnr_psn: Psn,
    /// The send queue stopped fetching (SQD) and the drained event is owed.
    pub draining: bool,
}

/// A receive WQE the responder is filling.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecvState {
    pub wqe_index: u16,
    pub from_srq: bool,
    pub sges: [Sge; MAX_SGES],
    pub num_sges: usize,
    /// Bytes placed so far.
    pub offset: u32,
}

/// An RDMA write the responder is placing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteState {
    pub va: u64,
    pub rkey: u32,
    /// Bytes the RETH announced.
    pub total: u32,
    /// Bytes placed so far.
    pub offset: u32,
}

/// What a responder resource remembers for duplicate detection (IBA
/// 9.7.5.1.x): reads are replayed, atomics answered from the cached value.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ResourceKind {
    Read { va: u64, rkey: u32, len: u32 },
    Atomic { orig: u64 },
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct RespResource {
    pub first_psn: Psn,
    pub npkts: u32,
    pub kind: ResourceKind,
}

/// Per-QP responder state.
#[derive(Debug, Default)]
pub(crate) struct Responder {
    /// The PSN the next request must carry.
    pub expected_psn: Psn,
    /// Message sequence number: requests completed.
    pub msn: u32,
    /// The send (or write with immediate) message being received.
    pub recv: Option<RecvState>,
    /// The RDMA write being placed.
    pub write: Option<WriteState>,
    /// A sequence NAK was sent and not yet resolved (send only one).
    pub nak_sent: bool,
    /// Reads and atomics served, newest last, at most `max_dest_rd_atomic`.
    pub resources: VecDeque<RespResource>,
    /// UC: drop packets until the next FIRST or ONLY.
    pub uc_resync: bool,
    /// `COMM_EST` was posted (once, for the first packet in RTR).
    pub comm_est: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers() {
        assert_eq!(ack_timeout_ns(0), None);
        assert_eq!(ack_timeout_ns(1), Some(8192));
        assert_eq!(ack_timeout_ns(14), Some(4096 << 14)); // ~67 ms
        assert_eq!(rnr_timer_ns(0), 655_360_000);
        assert_eq!(rnr_timer_ns(1), 10_000); // 0.01 ms
        assert_eq!(rnr_timer_ns(12), 640_000); // 0.64 ms
        assert_eq!(rnr_timer_ns(31), 491_520_000);
    }

    #[test]
    fn psn_ranges() {
        let r = SendRecord {
            bb_start: 0,
            wqe_index: 0,
            opcode: WqeOpcode::Send,
            signaled: true,
            len: 10,
            first_psn: Psn::new(0xFF_FFFE).unwrap(),
            npkts: 3,
            acked_pkts: 0,
            done: false,
            status: WcStatus::Success,
        };
        assert_eq!(r.last_psn(), Psn::new(0).unwrap());
        assert!(r.contains(Psn::new(0xFF_FFFF).unwrap()));
        assert!(r.contains(Psn::new(0).unwrap()));
        assert!(!r.contains(Psn::new(1).unwrap()));
    }
}
