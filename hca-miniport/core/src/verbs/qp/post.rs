//! The data path of kernel QPs (guide 8.1, PRM 9.1, 9.2, 10.2-10.4):
//! posting send and receive WQEs (the `wr_id` lookup completions use is
//! `complete`'s).
//! The contract is the parent module's (**Post**, **wr_id**, **Locks**).

use core::sync::atomic::Ordering;

use alloc::vec::Vec;
use driver_platform::dma::dma_wmb;
use driver_platform::{CommonBuffer, MemoryLocker, Mmio, Platform, RequestorMode};
use hca_prm::doorbell::{DoorbellRecord, SQ_DOORBELL, SqDoorbell, uar_offset};
use hca_prm::wqe::{BB_SIZE, SendWqe, WqeOp};
use ib_types::mr::MwType;
use ib_types::qp::{QpState, QpType};
use ib_types::scalars::Qpn;
use ib_types::status::IbStatus;
use ib_types::wr::{RecvWr, SendFlags, SendOp, SendWr, Sge, Transport, WrLimits};
use zerocopy::IntoBytes;

use super::{Qp, SendRing};
use crate::hca::Hca;
use crate::resources::KERNEL_UAR;
use crate::verbs::Buffer;
use crate::verbs::mw::BindTarget;

/// One send work request for [`Hca::post_send`], with what the core cannot
/// read itself: the PRM address vector of a UD destination (resolved from
/// `wr.ud`'s AV handle by the caller) and, for an inline send, the SGEs'
/// bytes concatenated (the caller reads them; the core never dereferences
/// an address).
#[derive(Debug, Clone, Copy)]
pub struct SendRequest<'a> {
    /// The work request.
    pub wr: SendWr<'a>,
    /// The destination's address vector, exactly when `wr.ud` is set.
    pub av: Option<hca_prm::av::Av>,
    /// The inline data, exactly when `wr.flags` has INLINE.
    pub inline: Option<&'a [u8]>,
}

/// One send for the core's post loop, by reference (no copy of the WR or
/// its address vector per step): the WR, its UD destination's address
/// vector, its inline bytes when the caller gathered them, and whether
/// they are still behind its SGEs in kernel memory instead (a kernel
/// client's inline send, [`Hca::post_kernel_sends`]).
#[derive(Debug, Clone, Copy)]
struct PostItem<'r, 'a> {
    wr: &'r SendWr<'a>,
    av: Option<&'r hca_prm::av::Av>,
    inline: Option<&'r [u8]>,
    gather_inline: bool,
}

/// Reads the bytes `sges` name (kernel virtual addresses of resident
/// memory) through `reader`, concatenated into the front of `out`; returns
/// them. [`IbStatus::InvalidParameter`] if they do not fit `out` or an
/// address is not kernel memory (then `out` holds nothing to use).
#[inline(always)]
fn gather<'o, L: MemoryLocker>(
    reader: &L,
    sges: &[Sge],
    out: &'o mut [u8],
) -> Result<&'o [u8], IbStatus> {
    if let [sge] = sges {
        // One SGE, the common inline send: no loop to carry.
        let Some(dest) = out.get_mut(..sge.length.get() as usize) else {
            return Err(IbStatus::InvalidParameter);
        };
        if !dest.is_empty() {
            reader
                .read_kernel(sge.addr.get(), dest)
                .map_err(|_| IbStatus::InvalidParameter)?;
        }
        return Ok(dest);
    }
    let mut at: usize = 0;
    for sge in sges {
        let len = sge.length.get() as usize;
        if len == 0 {
            // Nothing to read: its address is never looked at.
            continue;
        }
        let Some(dest) = at.checked_add(len).and_then(|end| out.get_mut(at..end)) else {
            return Err(IbStatus::InvalidParameter);
        };
        reader
            .read_kernel(sge.addr.get(), dest)
            .map_err(|_| IbStatus::InvalidParameter)?;
        at += len;
    }
    Ok(&out[..at])
}

/// The checks a send WR of `qp` is validated against: its transport and
/// granted capacities.
#[inline(always)]
fn send_checks<P: Platform>(qp: &Qp<P>) -> (Transport, WrLimits) {
    let caps = &qp.geometry.caps;
    let limits = WrLimits {
        max_sge: caps.max_send_sge,
        max_inline: caps.max_inline_data,
    };
    (transport(qp.qp_type), limits)
}

/// The status of `qp`'s inline WR whose gather failed with `status`: the
/// WR's own error if its checks refuse it (as when they came first), else
/// `status`. Out of line: the post's frame is not sized for `validate`.
#[cold]
#[inline(never)]
fn refused_gather<P: Platform>(qp: &Qp<P>, wr: &SendWr<'_>, status: IbStatus) -> IbStatus {
    let (transport, limits) = send_checks(qp);
    match wr.validate(transport, &limits) {
        Ok(_) => status,
        Err(error) => error.status(),
    }
}

/// The transport a QP type's WRs are checked against.
fn transport(qp_type: QpType) -> Transport {
    match qp_type {
        QpType::Rc => Transport::Rc,
        QpType::Uc => Transport::Uc,
        QpType::Ud | QpType::Smi | QpType::Gsi => Transport::Ud,
    }
}

/// Writes `bytes` into a ring of `ring_bytes` at `offset`, wrapping at its
/// end.
#[inline(always)]
fn write_wrapping<B: CommonBuffer>(ring: &B, ring_bytes: usize, offset: usize, bytes: &[u8]) {
    let first = bytes.len().min(ring_bytes - offset);
    ring.write(offset, &bytes[..first]);
    if first < bytes.len() {
        ring.write(0, &bytes[first..]);
    }
}

impl<P: Platform> Hca<P> {
    /// Gathers the data of a kernel client's inline send: the bytes its
    /// SGEs name, which are kernel virtual addresses of resident memory
    /// (their L_Keys are ignored, as for any inline send), concatenated
    /// into the front of `out`; returns how many. Read with the kernel
    /// memory access the shell installed ([`Hca::set_kernel_locker`]):
    /// [`IbStatus::InvalidState`] without one, [`IbStatus::InvalidParameter`]
    /// if the data does not fit `out` or an address is not kernel memory
    /// (then `out` holds nothing the caller may use). Callable at
    /// DISPATCH_LEVEL.
    pub fn gather_kernel_inline(&self, sges: &[Sge], out: &mut [u8]) -> Result<usize, IbStatus> {
        let total = Sge::total_len(sges).ok_or(IbStatus::InvalidParameter)? as usize;
        if total > out.len() {
            return Err(IbStatus::InvalidParameter);
        }
        if total == 0 {
            return Ok(0);
        }
        let reader = self.kernel_reader()?;
        gather(&*reader, sges, out).map(<[u8]>::len)
    }

    /// The kernel memory access the shell installed
    /// ([`Hca::set_kernel_locker`]); [`IbStatus::InvalidState`] without one.
    fn kernel_reader(&self) -> Result<alloc::sync::Arc<P::Locker>, IbStatus> {
        self.verbs
            .kernel_locker
            .lock()
            .clone()
            .ok_or(IbStatus::InvalidState)
    }

    /// Posts send work requests to the kernel QP `qp` (guide 8.1.1, PRM
    /// 10.2, 9.1). Returns how many were posted and the status of the
    /// first that was not (or `Success`). Every check — state, room,
    /// the WR against the QP's transport and capacities — is made before a
    /// WR is written, so a refused WR leaves the earlier ones posted and
    /// nothing else changed. The WQEs are written to the ring, their
    /// `wr_id`s to the shadow ring, and the doorbell (UAR page 0) is rung
    /// once for the batch. Only the QP's send-ring lock is taken (and the
    /// object-table lock briefly before, to find the QP and the windows of
    /// bind WRs). Callable at DISPATCH_LEVEL.
    ///
    /// Memory windows (`verbs::mw`): a [`SendOp::BindMw`] binds a type 1
    /// or type 2 window (a zero length unbinds a type 1 window);
    /// `LocalInvalidate` and `SendWithInvalidate` of a type 2 window's key
    /// unbind it. A bind naming a stale window is
    /// [`IbStatus::InvalidMwHandle`], one whose new key is not the
    /// window's MPT index [`IbStatus::InvalidRkey`].
    pub fn post_send(&self, qp: u64, wrs: &[SendRequest<'_>]) -> (usize, IbStatus) {
        self.post_items(
            qp,
            wrs.iter().map(|request| PostItem {
                wr: &request.wr,
                av: request.av.as_ref(),
                inline: request.inline,
                gather_inline: false,
            }),
        )
    }

    /// Posts a kernel client's send WRs as the CI takes them
    /// ([`crate::ci::CiProvider::post_send`]), each with its UD
    /// destination's address vector (resolved by the caller; `None` on a
    /// connected QP): as [`post_send`](Self::post_send), except that an
    /// INLINE WR's SGEs are kernel virtual addresses of resident memory
    /// whose bytes the core reads under the ring lock, after the WR's
    /// checks, into the QP's inline scratch and from there into the WQE
    /// (no stack buffer zeroed per call, no copy through the caller).
    /// Without the shell's kernel memory access an inline WR is refused
    /// with [`IbStatus::InvalidState`]; an address that is not kernel
    /// memory with [`IbStatus::InvalidParameter`]. Callable at
    /// DISPATCH_LEVEL; no allocation.
    pub fn post_kernel_sends<'r, 'a: 'r, I>(&self, qp: u64, wrs: I) -> (usize, IbStatus)
    where
        I: Iterator<Item = (&'r SendWr<'a>, Option<&'r hca_prm::av::Av>)> + Clone,
    {
        self.post_items(
            qp,
            wrs.map(|(wr, av)| PostItem {
                wr,
                av,
                inline: None,
                gather_inline: wr.flags.contains(SendFlags::INLINE),
            }),
        )
    }

    /// The post loop of [`post_send`](Self::post_send) and
    /// [`post_kernel_sends`](Self::post_kernel_sends).
    fn post_items<'r, 'a: 'r, I>(&self, qp: u64, wrs: I) -> (usize, IbStatus)
    where
        I: Iterator<Item = PostItem<'r, 'a>> + Clone,
    {
        let qp = match self.find_qp(qp, RequestorMode::Kernel) {
            Ok(qp) => qp,
            Err(status) => return (0, status),
        };
        // The windows that bind WRs name, resolved before the ring lock
        // (the object-table lock is never taken under a ring lock); no
        // allocation for batches without a bind.
        let (mut binds, mut gathers) = (false, false);
        for item in wrs.clone() {
            binds |= matches!(item.wr.op, SendOp::BindMw { .. });
            gathers |= item.gather_inline;
        }
        let windows: Vec<Option<Result<BindTarget, IbStatus>>> = if binds {
            wrs.clone()
                .map(|item| match item.wr.op {
                    SendOp::BindMw { mw, .. } => Some(self.window_for_bind(mw.raw())),
                    _ => None,
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut installed_since = None;
        let reader = match self.inline_reader(&qp, gathers, &mut installed_since) {
            Ok(reader) => reader,
            Err(status) => return (0, status),
        };
        let mut sq = qp.sq.lock();
        // Under the ring lock: refused, or flushed by D0 exit or the
        // failure path (restore.rs, fatal.rs).
        if let Err(status) = self.check_running() {
            return (0, status);
        }
        let mut posted = 0;
        let mut status = IbStatus::Success;
        for (i, item) in wrs.enumerate() {
            let window = windows.get(i).and_then(Option::as_ref);
            if let Err(error) = Self::post_wr(&qp, &mut sq, item, reader, window) {
                status = error;
                break;
            }
            posted += 1;
        }
        if posted > 0 {
            self.ring_sq(&qp, sq.producer);
        }
        (posted, status)
    }

    /// A kernel client's post of one send WR with its UD destination's
    /// address vector (`None` on a connected QP), the common call of
    /// [`crate::ci::CiProvider::post_send`]: as
    /// [`post_kernel_sends`](Self::post_kernel_sends) of that one WR, every
    /// check the same (one per-WR step for both), without a batch's set-up
    /// (no pass over the batch for binds and inline WRs, no windows). A
    /// bind takes the batch path (its window is resolved before the ring
    /// lock). Callable at DISPATCH_LEVEL; no allocation.
    pub fn post_kernel_send(
        &self,
        qp: u64,
        wr: &SendWr<'_>,
        av: Option<&hca_prm::av::Av>,
    ) -> (usize, IbStatus) {
        if matches!(wr.op, SendOp::BindMw { .. }) {
            return self.post_kernel_sends(qp, core::iter::once((wr, av)));
        }
        let qp = match self.find_qp(qp, RequestorMode::Kernel) {
            Ok(qp) => qp,
            Err(status) => return (0, status),
        };
        match qp.kernel_reader.as_deref() {
            Some(reader) => self.post_one(&qp, wr, av, Some(reader)),
            None => self.post_one_with_installed_reader(&qp, wr, av),
        }
    }

    /// [`post_kernel_send`](Self::post_kernel_send) of a QP that captured
    /// no kernel memory access (created before the shell installed one):
    /// an inline WR takes the one installed since.
    #[cold]
    #[inline(never)]
    fn post_one_with_installed_reader(
        &self,
        qp: &Qp<P>,
        wr: &SendWr<'_>,
        av: Option<&hca_prm::av::Av>,
    ) -> (usize, IbStatus) {
        let gather_inline = wr.flags.contains(SendFlags::INLINE);
        let mut installed_since = None;
        match self.inline_reader(qp, gather_inline, &mut installed_since) {
            Ok(reader) => self.post_one(qp, wr, av, reader),
            Err(status) => (0, status),
        }
    }

    /// The post of one WR with its inline `reader` (taken before the ring
    /// lock), under the ring lock: the per-WR step and the doorbell.
    #[inline(always)]
    fn post_one(
        &self,
        qp: &Qp<P>,
        wr: &SendWr<'_>,
        av: Option<&hca_prm::av::Av>,
        reader: Option<&P::Locker>,
    ) -> (usize, IbStatus) {
        let mut sq = qp.sq.lock();
        if let Err(status) = self.check_running() {
            return (0, status);
        }
        let item = PostItem {
            wr,
            av,
            inline: None,
            gather_inline: wr.flags.contains(SendFlags::INLINE),
        };
        match Self::post_wr(qp, &mut sq, item, reader, None) {
            Ok(()) => {
                self.ring_sq(qp, sq.producer);
                (1, IbStatus::Success)
            }
            Err(status) => (0, status),
        }
    }

    /// The kernel memory access for inline WRs (`gathers`: the batch has
    /// one whose bytes the core reads): the QP's own, captured when it was
    /// created, else the one installed since (kept in `installed_since`),
    /// taken before the ring lock (its own lock is never taken under a
    /// ring lock). [`IbStatus::InvalidState`] if an inline WR needs one
    /// and none is installed.
    fn inline_reader<'q>(
        &self,
        qp: &'q Qp<P>,
        gathers: bool,
        installed_since: &'q mut Option<alloc::sync::Arc<P::Locker>>,
    ) -> Result<Option<&'q P::Locker>, IbStatus> {
        match (qp.kernel_reader.as_deref(), gathers) {
            (Some(reader), _) => Ok(Some(reader)),
            (None, true) => Ok(Some(&**installed_since.insert(self.kernel_reader()?))),
            (None, false) => Ok(None),
        }
    }

    /// One send WR under the send ring's lock: its checks — the QP not
    /// closing, its state, the WR against the transport and the granted
    /// capacities, a bind's window (`window`, resolved before the lock) —
    /// then its inline bytes gathered (through `reader`, when
    /// `item.gather_inline`), its WQE built and checked against the room,
    /// written to the ring and its `wr_id` and size to the shadow; the
    /// producer moves past it. A refused WR changes nothing.
    ///
    /// A request of a common shape (RC/UC send or write, inline or one
    /// SGE) is checked by hca-prm's specialised encoder
    /// (`SendWqe::prepare_common_valid`: exactly what `SendWr::validate`
    /// checks of such a request), so its inline bytes are gathered before
    /// that check; a gather that fails reports the WR's own error first,
    /// as when the checks came first. The gather reads at most the QP's
    /// `max_inline_data` bytes (it refuses more before reading). Any other
    /// request takes [`post_general_wr`](Self::post_general_wr), out of
    /// line, so the common path's frame is not sized for it.
    #[inline(always)]
    fn post_wr(
        qp: &Qp<P>,
        sq: &mut SendRing<Buffer<P>>,
        item: PostItem<'_, '_>,
        reader: Option<&P::Locker>,
        window: Option<&Result<BindTarget, IbStatus>>,
    ) -> Result<(), IbStatus> {
        let wr = item.wr;
        if qp.closing.load(Ordering::Acquire) {
            return Err(IbStatus::InvalidQpHandle);
        }
        if !qp.state().accepts_send() {
            return Err(IbStatus::InvalidQpState);
        }
        // The ring's fields borrowed apart, in place (no scratch moved out
        // and back per call). `scratch` is the QP's own, one WQE long,
        // reused under the ring lock: every byte of a WQE is written
        // (`SendWqe::emit`), so nothing is zeroed per call; `inline_bytes`
        // likewise, `max_inline_data` long: a kernel client's inline bytes
        // are gathered into it.
        let SendRing {
            ring,
            producer,
            scratch: wqe,
            inline: inline_bytes,
        } = sq;
        let inline = match (reader, item.gather_inline) {
            (Some(reader), true) => match gather(reader, wr.sg_list, inline_bytes) {
                Ok(bytes) => Some(bytes),
                Err(status) => return Err(refused_gather(qp, wr, status)),
            },
            _ => item.inline,
        };
        let (transport, limits) = send_checks(qp);
        let index = *producer as u16;
        // A request of a common shape (RC/UC send or write, inline or one
        // SGE) takes hca-prm's specialised encoder with the checks such a
        // request can fail, whose words are the general encoder's (hca-prm
        // proves both); the rest, binds included, `validate` and the
        // general one. The scratch is words, so the specialised encoder's
        // words go in with one bounds check each (no byte range per word).
        let common = SendWqe::prepare_common_valid(wr, item.av, index, inline, transport, &limits)
            .filter(|c| c.byte_len() <= wqe.len() * 8);
        let Some(common) = common else {
            return Self::post_general_wr(qp, (ring, producer, wqe), wr, item.av, inline, window);
        };
        // A plain slice: its base and length stay in registers.
        let words = wqe.as_mut_slice();
        common.emit_words(|at, word| {
            if let Some(slot) = words.get_mut(at) {
                *slot = word.to_le();
            }
        });
        Self::commit_wqe(qp, ring, producer, wqe, common.byte_len(), wr.wr_id, || {
            Ok(())
        })
    }

    /// [`post_wr`](Self::post_wr) of a request of no common shape (a bind,
    /// an atomic, a gather list, ...) with its UD destination's `av` and
    /// its `inline` bytes: validated whole, built by the general encoder, a
    /// bind's window and key checked, then committed as the common path
    /// commits. `ring` are the send ring's fields (`ring`, `producer`,
    /// `scratch`).
    #[cold]
    #[inline(never)]
    fn post_general_wr(
        qp: &Qp<P>,
        ring: (&Option<Buffer<P>>, &mut u32, &mut Vec<u64>),
        wr: &SendWr<'_>,
        av: Option<&hca_prm::av::Av>,
        inline: Option<&[u8]>,
        window: Option<&Result<BindTarget, IbStatus>>,
    ) -> Result<(), IbStatus> {
        let (ring, producer, wqe) = ring;
        let (transport, limits) = send_checks(qp);
        wr.validate(transport, &limits)
            .map_err(|error| error.status())?;
        // A bind names a live window, and its new key that window's MPT
        // index (`verbs::mw`); the bind segment carries its type. A type 1
        // bind's key must differ from the last bind's.
        let (bind_type, new_bind_key) = match (wr.op, window) {
            (SendOp::BindMw { rkey, .. }, Some(window)) => {
                let target = window.as_ref().map_err(|error| *error)?;
                if rkey.get() >> 8 != target.index {
                    return Err(IbStatus::InvalidRkey);
                }
                let rkey = rkey.get();
                let last = target.last_bind_rkey.load(Ordering::Acquire);
                if target.mw_type == MwType::Type1 && rkey == last {
                    return Err(IbStatus::InvalidRkey);
                }
                (Some(target.mw_type), Some((target, last, rkey)))
            }
            _ => (None, None),
        };
        let index = *producer as u16;
        let built = SendWqe::from_wr(wr, av, index, inline).and_then(|mut w| {
            if let (WqeOp::BindMw(bind), Some(mw_type)) = (&mut w.op, bind_type) {
                bind.mw_type = crate::verbs::mw::wqe_type(mw_type);
            }
            w.emit(wqe.as_mut_bytes())
        });
        let len = built.map_err(|_| IbStatus::InvalidParameter)?;
        Self::commit_wqe(qp, ring, producer, wqe, len, wr.wr_id, || {
            // The bind's key becomes the window's last, unless another
            // bind of the window (on another QP) took its place meanwhile.
            match new_bind_key {
                Some((target, last, rkey)) => target
                    .last_bind_rkey
                    .compare_exchange(last, rkey, Ordering::AcqRel, Ordering::Acquire)
                    .map(|_| ())
                    .map_err(|_| IbStatus::InvalidRkey),
                None => Ok(()),
            }
        })
    }

    /// The end of one WR's post: the WQE built in `wqe` (`len` bytes)
    /// checked against the room, `last_check` (a bind's key) made, the
    /// `wr_id` and size recorded in the shadow, the WQE copied into the
    /// ring at the producer and the producer moved past it. A refusal
    /// changes nothing.
    #[inline(always)]
    fn commit_wqe(
        qp: &Qp<P>,
        ring: &Option<Buffer<P>>,
        producer: &mut u32,
        wqe: &[u64],
        len: usize,
        wr_id: u64,
        last_check: impl FnOnce() -> Result<(), IbStatus>,
    ) -> Result<(), IbStatus> {
        let g = &qp.geometry;
        let bbs = hca_prm::wqe::basic_blocks(len) as u32;
        let ring_bbs = 1u32 << g.sq_log_bbs;
        let shadow = qp.send_shadow();
        if shadow.in_use(*producer) + bbs > ring_bbs {
            return Err(IbStatus::InsufficientResources);
        }
        let ring = ring.as_ref().ok_or(IbStatus::InvalidQpState)?;
        last_check()?;
        // Read by poll without this lock (`Completions`): stored before the
        // doorbell (its release fence) makes the WQE visible; recorded
        // before the copy, whose call would make the shadow's slices
        // spill.
        shadow.record(*producer, wr_id, bbs);
        let slot = (*producer & (ring_bbs - 1)) as usize;
        let ring_bytes = BB_SIZE << g.sq_log_bbs;
        write_wrapping(ring, ring_bytes, slot * BB_SIZE, &wqe.as_bytes()[..len]);
        *producer = producer.wrapping_add(bbs);
        Ok(())
    }

    /// Posts receive work requests to the kernel QP `qp` (guide 8.1.2, PRM
    /// 10.3, 9.2): as [`post_send`](Self::post_send), with the receive
    /// doorbell record written once for the batch. A QP in ERR gets the
    /// SQ doorbell (unchanged producer) so the device flushes them (PRM
    /// 10.5). Only the QP's receive-ring lock is taken.
    pub fn post_recv(&self, qp: u64, wrs: &[RecvWr<'_>]) -> (usize, IbStatus) {
        let qp = match self.find_qp(qp, RequestorMode::Kernel) {
            Ok(qp) => qp,
            Err(status) => return (0, status),
        };
        // A QP on an SRQ has no receive queue of its own (guide 6.5.1):
        // receives go to the SRQ with `post_srq_recv`.
        if qp.srq.is_some() {
            return (0, IbStatus::InvalidQpState);
        }
        let g = qp.geometry;
        let limits = WrLimits {
            max_sge: g.caps.max_recv_sge,
            max_inline: 0,
        };
        let entries = 1u32 << g.rq_log_entries;
        let stride = 1usize << g.rq_log_stride;
        let mut rq = qp.rq.lock();
        if let Err(status) = self.check_running() {
            return (0, status);
        }
        let mut posted = 0;
        let mut status = IbStatus::Success;
        let mut wqe = [0u8; 1 << 9];
        for wr in wrs {
            if qp.closing.load(Ordering::Acquire) {
                status = IbStatus::InvalidQpHandle;
                break;
            }
            if !qp.state().accepts_recv() {
                status = IbStatus::InvalidQpState;
                break;
            }
            if let Err(error) = wr.validate(&limits) {
                status = error.status();
                break;
            }
            if qp.recv_shadow().in_use(rq.producer) >= entries {
                status = IbStatus::InsufficientResources;
                break;
            }
            let slot = (rq.producer & (entries - 1)) as usize;
            let Some(out) = wqe.get_mut(..stride) else {
                status = IbStatus::InvalidParameter;
                break;
            };
            if hca_prm::wqe::build_recv_wqe(wr.sg_list, rq.producer as u16, stride, out).is_err() {
                status = IbStatus::InvalidParameter;
                break;
            }
            let Some(ring) = rq.ring.as_ref() else {
                status = IbStatus::InvalidQpState;
                break;
            };
            ring.write(slot * stride, out);
            qp.recv_shadow().record(rq.producer, wr.wr_id, 1);
            rq.producer = rq.producer.wrapping_add(1);
            posted += 1;
        }
        if posted > 0 {
            if let Some(dbr) = rq.dbr.as_ref() {
                // The WQEs before the record that publishes them (PRM 9.2).
                dma_wmb();
                dbr.write(0, DoorbellRecord::new(rq.producer).as_bytes());
            }
            drop(rq);
            if qp.state() == QpState::Err {
                let producer = qp.sq.lock().producer;
                self.ring_sq(&qp, producer);
            }
        }
        (posted, status)
    }

    /// The SQ doorbell of `qp` on UAR page 0 (PRM 9.1), after
    /// [`dma_wmb`] so the WQEs are visible first.
    fn ring_sq(&self, qp: &Qp<P>, producer: u32) {
        dma_wmb();
        let doorbell = SqDoorbell {
            qpn: Qpn::from_low_bits(qp.qpn),
            producer,
        };
        self.bar0
            .write64(uar_offset(KERNEL_UAR) + SQ_DOORBELL, doorbell.encode());
    }
}
