//! A user QP's send and receive queues: WQEs written straight into the
//! rings in the process's memory, one doorbell (send) or one record store
//! (receive) per batch, no kernel call.
//!
//! Thread safety: [`SendQueue::post`] and [`RecvQueue::post`] take
//! `&mut self`, and the two queues are separate values ([`Qp::queues`]),
//! so one thread may post sends while another posts receives and others
//! poll the CQs, with no lock between any of them. Posting to one queue
//! from several threads needs the caller's own lock around that queue
//! (e.g. a `Mutex<SendQueue>`), as with rdma-core's single-threaded QPs.
//!
//! Failure: a post validates each request completely and builds its WQE
//! before writing a byte of the ring, so a refused request leaves nothing
//! behind; the requests before it stay posted (and announced).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use hca_prm::av::Av;
use hca_prm::doorbell::SqDoorbell;
use hca_prm::wqe::{self, BB_SIZE, SendWqe, WqeError, build_recv_wqe};
use ib_types::mr::MwType;
use ib_types::scalars::Qpn;
use ib_types::uvp::UserSend;
use ib_types::wr::{RecvWr, SendOp, SendWr, Transport, WrLimits};

use crate::cq::Cq;
use crate::dma::{DmaBuffer, Record, WordRing};
use crate::error::{PostError, PostErrorKind, SetupError};
use crate::mmio::{Register, UarPage};
use crate::queue::{BeforeReset, Directory, QueueRestart, WorkQueueShared};

/// One send work request as the fast path takes it.
#[derive(Debug, Clone, Copy)]
pub struct SendRequest<'a> {
    /// The work request.
    pub wr: SendWr<'a>,
    /// The destination's address vector (user AVs live in user mode,
    /// PRM 13 `CreateAv`), exactly when `wr.ud` is set.
    pub av: Option<Av>,
    /// The data of the SGEs, exactly when `wr.flags` has INLINE: it is
    /// copied into the WQE, so the buffer needs no registration.
    pub inline: Option<&'a [u8]>,
}

/// The types of a context's memory windows, by window handle, as the
/// provider recorded them at `AllocMw`: a bind WQE's segment carries its
/// window's type (PRM 10.2), and the device refuses a bind of the other
/// type. Shared by the context's send queues; consulted for binds only.
#[derive(Debug, Default)]
pub(crate) struct WindowTypes(Mutex<HashMap<u64, MwType>>);

impl WindowTypes {
    fn map(&self) -> MutexGuard<'_, HashMap<u64, MwType>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn record(&self, mw: u64, mw_type: MwType) {
        self.map().insert(mw, mw_type);
    }

    pub(crate) fn forget(&self, mw: u64) {
        self.map().remove(&mw);
    }

    /// A window's type; type 2 for a window the context never recorded
    /// (the device checks the bind against the window).
    fn of(&self, mw: u64) -> MwType {
        self.map().get(&mw).copied().unwrap_or(MwType::Type2)
    }
}

/// Runs `posts` over `items` until one fails: how many were posted, and
/// the failure.
fn post_each<T>(
    items: &[T],
    mut post: impl FnMut(&T) -> Result<(), PostErrorKind>,
) -> (usize, Option<PostErrorKind>) {
    for (posted, item) in items.iter().enumerate() {
        if let Err(kind) = post(item) {
            return (posted, Some(kind));
        }
    }
    (items.len(), None)
}

fn outcome(posted: usize, failure: Option<PostErrorKind>) -> Result<usize, PostError> {
    match failure {
        None => Ok(posted),
        Some(kind) => Err(PostError { posted, kind }),
    }
}

/// The send queue of a user QP.
#[derive(Debug)]
pub struct SendQueue {
    /// The ring's words, checked once at creation (a power of two the
    /// buffer holds), so a post stores each word with one mask and no
    /// bounds check or per-call view.
    ring: WordRing,
    qpn: Qpn,
    transport: Transport,
    limits: WrLimits,
    /// Basic blocks in the ring (a power of two).
    ring_bbs: u32,
    /// Basic blocks posted (wrapping).
    producer: u32,
    shared: Arc<WorkQueueShared>,
    uar: Arc<UarPage>,
    doorbell: Register,
    /// Bytes of the largest WQE (one slot's stride).
    stride: usize,
    /// The context's window types, for bind WQEs.
    windows: Arc<WindowTypes>,
}

impl SendQueue {
    #[expect(clippy::too_many_arguments, reason = "one private constructor")]
    pub(crate) fn new(
        ring: DmaBuffer,
        qpn: Qpn,
        transport: Transport,
        limits: WrLimits,
        log_bbs: u8,
        stride: usize,
        uar: Arc<UarPage>,
        doorbell_offset: u64,
        windows: Arc<WindowTypes>,
    ) -> Result<Self, SetupError> {
        let doorbell = Register::at(doorbell_offset).ok_or(SetupError::Layout {
            what: "send doorbell",
            detail: "outside the UAR page or misaligned",
        })?;
        let ring = 1usize
            .checked_shl(u32::from(log_bbs))
            .and_then(|bbs| bbs.checked_mul(BB_SIZE / 8))
            .and_then(|words| WordRing::new(ring, words))
            .ok_or(SetupError::Layout {
                what: "send ring",
                detail: "smaller than its basic blocks",
            })?;
        Ok(Self {
            ring,
            qpn,
            transport,
            limits,
            ring_bbs: 1 << log_bbs,
            producer: 0,
            shared: Arc::new(WorkQueueShared::new(1 << log_bbs)),
            uar,
            doorbell,
            stride,
            windows,
        })
    }

    pub(crate) fn shared(&self) -> &Arc<WorkQueueShared> {
        &self.shared
    }

    /// True for a UD queue, whose sends name address vectors.
    #[inline]
    pub fn is_datagram(&self) -> bool {
        self.transport == Transport::Ud
    }

    /// The basic blocks posted so far (the producer counter the doorbell
    /// carries).
    pub fn producer(&self) -> u32 {
        self.producer
    }

    /// Posts `requests` in order: each WQE into the ring, then one
    /// `SQ_DOORBELL` for all of them. Returns how many were posted; on a
    /// refused request, the error says how many went before it (posted and
    /// rung) and nothing of it or after it is in the ring.
    pub fn post(&mut self, requests: &[SendRequest<'_>]) -> Result<usize, PostError> {
        self.post_each(requests.iter().copied())
    }

    /// [`post`](Self::post) of requests as an iterator yields them, so a
    /// caller that converts its own requests needs no buffer for them.
    pub fn post_each<'a>(
        &mut self,
        requests: impl IntoIterator<Item = SendRequest<'a>>,
    ) -> Result<usize, PostError> {
        let mut posted = 0;
        let mut failure = None;
        for request in requests {
            if let Err(kind) = self.write_wqe(&request.wr, request.av.as_ref(), request.inline) {
                failure = Some(kind);
                break;
            }
            posted += 1;
        }
        if posted > 0 {
            self.ring_doorbell();
        }
        outcome(posted, failure)
    }

    /// [`post`](Self::post) of a connected (RC or UC) queue's sends as the
    /// access library hands them over: each encoded from the caller's
    /// request in place (no AV to resolve, nothing copied). A UD send is
    /// refused by the validation (it names a destination).
    #[inline]
    pub(crate) fn post_connected(&mut self, sends: &[UserSend<'_>]) -> Result<usize, PostError> {
        // One request, the common call: no batch loop or count to carry.
        if let [send] = sends {
            self.write_wqe(&send.wr, None, send.inline)
                .map_err(|kind| PostError { posted: 0, kind })?;
            self.ring_doorbell();
            return Ok(1);
        }
        let (posted, failure) =
            post_each(sends, |send| self.write_wqe(&send.wr, None, send.inline));
        if posted > 0 {
            self.ring_doorbell();
        }
        outcome(posted, failure)
    }

    /// After a RESET: the device's counter is 0 again (PRM 6.1.3), so is
    /// the producer, with fresh slots. Returns the old slots when WQEs
    /// were outstanding (their completions may still be in the CQ).
    fn restart(&mut self) -> Option<Arc<WorkQueueShared>> {
        let fresh = Arc::new(WorkQueueShared::new(self.ring_bbs as usize));
        let old = core::mem::replace(&mut self.shared, fresh);
        let producer = core::mem::take(&mut self.producer);
        old.outstanding(producer).then_some(old)
    }

    /// Rings the doorbell with the current producer counter (after a post;
    /// also what flushes receives of a QP in ERR, PRM 10.5).
    pub fn ring_doorbell(&self) {
        let doorbell = SqDoorbell {
            qpn: self.qpn,
            producer: self.producer,
        };
        self.uar.ring(self.doorbell, doorbell.encode());
    }

    /// Validates one WQE, then writes it word by word straight into the
    /// ring at the producer counter (nothing of it is written unless it
    /// is valid and fits). A request of a common shape that the
    /// validation would accept takes the specialised encoder, which checks
    /// only what such a request can break
    /// ([`SendWqe::prepare_common_valid`]); any other is validated whole
    /// and takes the general one.
    ///
    /// Inlined into each post loop, with the general path a function of
    /// its own: the common path then runs in the loop's frame, with none
    /// of the general encoder's spills.
    #[inline(always)]
    fn write_wqe(
        &mut self,
        wr: &SendWr<'_>,
        av: Option<&Av>,
        inline: Option<&[u8]>,
    ) -> Result<(), PostErrorKind> {
        let index = self.producer as u16;
        if let Some(wqe) =
            SendWqe::prepare_common_valid(wr, av, index, inline, self.transport, &self.limits)
        {
            // The words go straight from the encoder's registers into the
            // ring, in this frame: no closure the compiler may call out of
            // line with the WQE spilled to the stack for it.
            let first = self.reserve(wqe.byte_len(), wr.wr_id)?;
            let ring = self.ring.view();
            wqe.emit_words(|i, word| ring.store(first + i, word));
            return Ok(());
        }
        self.write_general_wqe(wr, av, inline)
    }

    /// [`write_wqe`](Self::write_wqe) of a request the specialised encoder
    /// declined: validated whole, then the general encoder.
    #[inline(never)]
    fn write_general_wqe(
        &mut self,
        wr: &SendWr<'_>,
        av: Option<&Av>,
        inline: Option<&[u8]>,
    ) -> Result<(), PostErrorKind> {
        let index = self.producer as u16;
        wr.validate(self.transport, &self.limits)?;
        let stride = self.stride;
        let mut wqe = SendWqe::prepare(wr, av, index, inline).map_err(|e| match e {
            WqeError::TooLong { bytes } => PostErrorKind::WqeTooLarge { bytes, stride },
            other => PostErrorKind::Wqe(other),
        })?;
        // A bind's segment carries its window's type.
        if let SendOp::BindMw { mw, .. } = wr.op
            && self.windows.of(mw.raw()) == MwType::Type1
        {
            wqe.set_bind_type(wqe::MwType::Type1);
        }
        let first = self.reserve(wqe.byte_len(), wr.wr_id)?;
        let ring = &self.ring;
        // Fits: `reserve` checked `len <= stride`.
        let _ = wqe.emit_words(stride, |i, word| ring.store(first + i, word));
        Ok(())
    }

    /// Reserves the slots of a WQE of `len` bytes at the producer counter,
    /// if it fits the stride and the ring has room: records its `wr_id`,
    /// advances the producer and returns the ring word where the WQE's
    /// first word goes (word `i` at `first + i`, which wraps). The caller
    /// stores the words before the doorbell, which alone shows them to
    /// the device.
    #[inline(always)]
    fn reserve(&mut self, len: usize, wr_id: u64) -> Result<usize, PostErrorKind> {
        let stride = self.stride;
        if len > stride {
            return Err(PostErrorKind::WqeTooLarge { bytes: len, stride });
        }
        // Read before the consumer's Acquire load, after which the
        // compiler would read them again.
        let producer = self.producer;
        let shared = &*self.shared;
        // `basic_blocks` without its overflow guard: `len` is at most the
        // stride.
        let bbs = ((len + (BB_SIZE - 1)) >> BB_SIZE.trailing_zeros()) as u32;
        let in_flight = producer.wrapping_sub(shared.consumer());
        if in_flight.saturating_add(bbs) > self.ring_bbs {
            return Err(PostErrorKind::QueueFull);
        }
        shared.record(producer, wr_id, bbs);
        self.producer = producer.wrapping_add(bbs);
        Ok(producer as usize * (BB_SIZE / 8))
    }
}

/// The receive queue of a user QP that has one (not on an SRQ).
#[derive(Debug)]
pub struct RecvQueue {
    ring: DmaBuffer,
    record: Record,
    limits: WrLimits,
    entries: u32,
    producer: u32,
    shared: Arc<WorkQueueShared>,
    /// One stride, where a WQE is built before it is copied.
    scratch: Box<[u8]>,
}

impl RecvQueue {
    pub(crate) fn new(
        ring: DmaBuffer,
        record: Record,
        max_sge: u32,
        log_entries: u8,
        stride: usize,
    ) -> Self {
        Self {
            ring,
            record,
            limits: WrLimits {
                max_sge,
                max_inline: 0,
            },
            entries: 1 << log_entries,
            producer: 0,
            shared: Arc::new(WorkQueueShared::new(1 << log_entries)),
            scratch: vec![0; stride].into_boxed_slice(),
        }
    }

    pub(crate) fn shared(&self) -> &Arc<WorkQueueShared> {
        &self.shared
    }

    /// After a RESET, as [`SendQueue::restart`]; the receive record is 0
    /// again too, as the device's copy of it (PRM 6.1.3: else the device
    /// would take the old count for new work).
    fn restart(&mut self) -> Option<Arc<WorkQueueShared>> {
        let fresh = Arc::new(WorkQueueShared::new(self.entries as usize));
        let old = core::mem::replace(&mut self.shared, fresh);
        let producer = core::mem::take(&mut self.producer);
        self.record.store_release(0);
        old.outstanding(producer).then_some(old)
    }

    /// Posts `wrs` in order: each WQE into the ring, then one store of the
    /// receive doorbell record (Release), which is all the device needs
    /// (PRM 9.2). Failure as for [`SendQueue::post`].
    pub fn post(&mut self, wrs: &[RecvWr<'_>]) -> Result<usize, PostError> {
        let (posted, failure) = post_each(wrs, |wr| {
            write_recv_wqe(
                &self.ring,
                &mut self.scratch,
                &self.limits,
                wr,
                self.producer,
                || {
                    let room = self.producer.wrapping_sub(self.shared.consumer()) < self.entries;
                    if room {
                        self.shared.record(self.producer, wr.wr_id, 1);
                    }
                    room
                },
            )?;
            self.producer = self.producer.wrapping_add(1);
            Ok(())
        });
        if posted > 0 {
            self.record.store_release(self.producer);
        }
        outcome(posted, failure)
    }
}

/// Validates and builds receive WQE `counter` in `scratch`, asks `claim`
/// for its slot (false: the queue is full), then copies it into the ring.
#[inline]
pub(crate) fn write_recv_wqe(
    ring: &DmaBuffer,
    scratch: &mut [u8],
    limits: &WrLimits,
    wr: &RecvWr<'_>,
    counter: u32,
    claim: impl FnOnce() -> bool,
) -> Result<(), PostErrorKind> {
    wr.validate(limits)?;
    let stride = scratch.len();
    build_recv_wqe(wr.sg_list, counter as u16, stride, scratch)?;
    if !claim() {
        return Err(PostErrorKind::QueueFull);
    }
    let slots = ring.len() / stride;
    let slot = counter as usize & (slots - 1);
    // In range by construction: the ring holds `slots` strides.
    let _ = ring.store_words(slot * stride, scratch);
    Ok(())
}

/// A user QP's fast-path half: its queues, and its entry in the context's
/// directory (which its CQs' pollers use), removed when it drops.
#[derive(Debug)]
pub struct Qp {
    qpn: Qpn,
    send: SendQueue,
    recv: Option<RecvQueue>,
    directory: Arc<Directory>,
}

impl Qp {
    pub(crate) fn new(
        qpn: Qpn,
        send: SendQueue,
        recv: Option<RecvQueue>,
        directory: Arc<Directory>,
    ) -> Self {
        Self {
            qpn,
            send,
            recv,
            directory,
        }
    }

    /// The QP number.
    pub fn qpn(&self) -> Qpn {
        self.qpn
    }

    /// The send queue.
    pub fn send_queue(&mut self) -> &mut SendQueue {
        &mut self.send
    }

    /// The receive queue; `None` for a QP on an SRQ.
    pub fn recv_queue(&mut self) -> Option<&mut RecvQueue> {
        self.recv.as_mut()
    }

    /// Both queues at once, e.g. to post on each from its own thread.
    pub fn queues(&mut self) -> (&mut SendQueue, Option<&mut RecvQueue>) {
        (&mut self.send, self.recv.as_mut())
    }

    /// Call after a successful modify to RESET (guide 6.5.4 NOTE, 6.5.5
    /// items 3-5; PRM 6.1.3), with the QP's send and receive CQs (the same
    /// one twice if they are one): both queues restart at their first WQE
    /// as the device does, the receive record is written 0, and the
    /// queues' slots from before stay with the context's pollers for the
    /// completions still in the CQs (those before each CQ's
    /// [`Cq::next_sequence`] now). Other QPs are not touched. Borrowing
    /// the CQs keeps their polls out while the reset marks them. Never
    /// call it for another transition: SQD or SQE back to RTS resumes
    /// where the queues stopped.
    pub fn reset(&mut self, send_cq: &Cq, recv_cq: &Cq) {
        let restart = |kept: Option<Arc<WorkQueueShared>>, queue: &Arc<_>, cq: &Cq| QueueRestart {
            queue: Arc::clone(queue),
            kept: kept.map(|queue| BeforeReset {
                end: cq.next_sequence(),
                queue,
            }),
            polled: cq.polled(),
        };
        let send_kept = self.send.restart();
        let send = restart(send_kept, self.send.shared(), send_cq);
        let recv = self.recv.as_mut().map(|recv| {
            let kept = recv.restart();
            restart(kept, recv.shared(), recv_cq)
        });
        self.directory.restart(self.qpn.get(), send, recv);
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        self.directory.remove(self.qpn.get());
    }
}

#[cfg(all(test, not(windows), not(loom)))]
mod tests {
    use super::*;
    use ib_types::wr::{LKey, SendFlags, Sge};
    use std::sync::atomic::{AtomicU64, AtomicUsize};

    /// A connected send queue of 4 basic blocks over `ring`, whose
    /// doorbell stores `rung` counts.
    fn queue(ring: &[AtomicU64], rung: &Arc<AtomicUsize>) -> SendQueue {
        // SAFETY: `ring` is a live array of atomics that outlives the queue
        // in each test and is accessed only atomically.
        let buffer = unsafe { DmaBuffer::from_raw(ring.as_ptr() as u64, ring.len() * 8) }.unwrap();
        let rung = Arc::clone(rung);
        let uar = UarPage::simulated(
            0x7000_0000,
            Arc::new(move |_, _| {
                rung.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }),
        );
        let limits = WrLimits {
            max_sge: 1,
            max_inline: 64,
        };
        SendQueue::new(
            buffer,
            Qpn::new(7).unwrap(),
            Transport::Rc,
            limits,
            2,
            BB_SIZE,
            Arc::new(uar),
            0x800,
            Arc::default(),
        )
        .unwrap()
    }

    /// `post_connected` of one request (its own path) answers as the batch
    /// path does for the same request: posted and rung, or refused with
    /// the batch path's error, nothing posted and no doorbell.
    #[test]
    fn one_connected_send_is_refused_or_posted_as_a_batch_of_one() {
        let sges = [Sge::new(0x8000, 8, LKey::new(1)); 2];
        let send = |wr_id, sg_list| UserSend {
            wr: SendWr {
                wr_id,
                op: SendOp::Send,
                flags: SendFlags::SIGNALED,
                sg_list,
                ud: None,
            },
            inline: None,
        };
        let good = send(1, &sges[..1]);
        let too_many_sges = send(2, &sges);
        let data = [0u8; 8];
        let inline_mismatch = UserSend {
            wr: SendWr {
                flags: SendFlags::SIGNALED | SendFlags::INLINE,
                ..good.wr
            },
            inline: Some(&data[..4]),
        };
        let (one_ring, batch_ring) = (
            (0..32).map(|_| AtomicU64::new(0)).collect::<Vec<_>>(),
            (0..32).map(|_| AtomicU64::new(0)).collect::<Vec<_>>(),
        );
        let (one_rung, batch_rung) = (Arc::default(), Arc::default());
        let mut one = queue(&one_ring, &one_rung);
        let mut batch = queue(&batch_ring, &batch_rung);
        // Two refused, four posted (the ring's 4 blocks), one refused full.
        let script = [too_many_sges, inline_mismatch, good, good, good, good, good];
        for request in script {
            let by_one = one.post_connected(&[request]);
            let by_batch = batch.post_each([SendRequest {
                wr: request.wr,
                av: None,
                inline: request.inline,
            }]);
            assert_eq!(by_one, by_batch);
            assert_eq!(one.producer(), batch.producer());
            assert_eq!(
                one_rung.load(std::sync::atomic::Ordering::Relaxed),
                batch_rung.load(std::sync::atomic::Ordering::Relaxed)
            );
        }
        assert_eq!(one.producer(), 4);
        assert_eq!(
            one.post_connected(&[good]),
            Err(PostError {
                posted: 0,
                kind: PostErrorKind::QueueFull
            })
        );
        let words = |ring: &[AtomicU64]| {
            ring.iter()
                .map(|w| w.load(std::sync::atomic::Ordering::Relaxed))
                .collect::<Vec<_>>()
        };
        assert_eq!(words(&one_ring), words(&batch_ring));
    }
}
