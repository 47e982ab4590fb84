//! The objects: protection domains, address vectors, CQs, QPs,
//! registered memory (SRQs in `crate::srq`, memory windows in
//! `crate::mw`). Each borrows what it depends on, so the compiler
//! enforces the destroy order the verbs require (a QP before its PD and
//! CQs, a region before its PD and before its buffer is freed); dropping
//! an object destroys it. Every verb goes through the plugin's hooks
//! (Table 10-1, `crate::proxy`); the plugin lays the CQ and QP rings out
//! and runs post, poll and arm with no kernel call.

use std::marker::PhantomData;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::handle::{CqHandle, PdHandle, SrqHandle};
use ib_types::ioctl::{self as v, Empty, QpQueryOut, QueryAvOut};
use ib_types::mcast::McastGroup;
use ib_types::mr::{MrKeys, MrQuery, MrRegister};
use ib_types::qp::{QpCaps, QpModify, QpType};
use ib_types::scalars::Gid;
use ib_types::uvp::{PostRefused, UserSend};
use ib_types::wc::WorkCompletion;
use ib_types::wr::RecvWr;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::srq::Srq;

pub(crate) fn refused(e: PostRefused) -> Error {
    Error::Refused {
        posted: e.posted,
        status: e.status,
    }
}

/// A protection domain. `Send + Sync`.
#[derive(Debug)]
pub struct Pd<'ctx> {
    ctx: &'ctx Context,
    handle: u64,
}

impl<'ctx> Pd<'ctx> {
    /// Allocates a PD (`AllocPd`).
    pub fn new(ctx: &'ctx Context) -> Result<Self> {
        let answer = ctx.call::<v::AllocPd>(ctx.ca, &Empty)?;
        Ok(Self {
            ctx,
            handle: answer.handle,
        })
    }

    /// The PD handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// The context.
    pub fn context(&self) -> &'ctx Context {
        self.ctx
    }
}

impl Drop for Pd<'_> {
    fn drop(&mut self) {
        let _ = self.ctx.call::<v::DeallocPd>(self.handle, &Empty);
    }
}

/// Memory of this process the device may pin: page-aligned, zero-filled,
/// freed when dropped (after every region over it, which borrow it).
/// `Send + Sync`: it is an address range; its bytes are read and written
/// by copies through the OS seam.
#[derive(Debug)]
pub struct Buffer<'ctx> {
    ctx: &'ctx Context,
    va: u64,
    len: usize,
}

impl<'ctx> Buffer<'ctx> {
    /// Allocates `len` bytes.
    pub fn new(ctx: &'ctx Context, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("an empty buffer"));
        }
        Ok(Self {
            ctx,
            va: ctx.alloc(len)?,
            len,
        })
    }

    /// Its address in the process.
    pub fn va(&self) -> u64 {
        self.va
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a buffer has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn range(&self, offset: usize, len: usize) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.va + offset as u64),
            _ => Err(Error::InvalidArgument("past the end of the buffer")),
        }
    }

    /// Copies `out.len()` bytes from `offset`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let va = self.range(offset, out.len())?;
        self.ctx.io.read(va, out).map_err(|status| Error::Os {
            what: "reading a buffer",
            status,
        })
    }

    /// Copies `data` to `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        let va = self.range(offset, data.len())?;
        self.ctx.io.write(va, data).map_err(|status| Error::Os {
            what: "writing a buffer",
            status,
        })
    }
}

impl Drop for Buffer<'_> {
    fn drop(&mut self) {
        self.ctx.io.free(self.va);
    }
}

/// A registered region over a [`Buffer`] in a PD. `Send + Sync`.
#[derive(Debug)]
pub struct Mr<'pd, 'buf> {
    pd: &'pd Pd<'pd>,
    handle: u64,
    keys: MrKeys,
    va: u64,
    len: u64,
    _buffer: PhantomData<&'buf Buffer<'buf>>,
}

impl<'pd, 'buf> Mr<'pd, 'buf> {
    /// Registers all of `buffer` with `access` (`RegMr`).
    pub fn new(pd: &'pd Pd<'pd>, buffer: &'buf Buffer<'buf>, access: AccessFlags) -> Result<Self> {
        let input = MrRegister {
            vaddr: buffer.va,
            length: buffer.len as u64,
            access,
        };
        let answer = pd.ctx.call::<v::RegMr>(pd.handle, &input)?;
        Ok(Self {
            pd,
            handle: answer.handle,
            keys: answer.output,
            va: input.vaddr,
            len: input.length,
            _buffer: PhantomData,
        })
    }

    pub(crate) fn pd(&self) -> &'pd Pd<'pd> {
        self.pd
    }

    /// The address of its first byte (its buffer's).
    pub fn va(&self) -> u64 {
        self.va
    }

    /// Its length in bytes (its buffer's).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false (a buffer has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its PD, range, rights and keys, from the kernel (`QueryMr`).
    pub fn query(&self) -> Result<MrQuery> {
        Ok(self.pd.ctx.call::<v::QueryMr>(self.handle, &Empty)?.output)
    }

    /// The region handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Its L_Key and R_Key.
    pub fn keys(&self) -> MrKeys {
        self.keys
    }
}

impl Drop for Mr<'_, '_> {
    fn drop(&mut self) {
        let _ = self.pd.ctx.call::<v::DeregMr>(self.handle, &Empty);
    }
}

/// An address vector of a PD, kept by the plugin in user mode (guide
/// 6.4.2): creating, querying, modifying and destroying it send no
/// request to the kernel. UD sends name it by [`handle`](Self::handle).
/// `Send + Sync`.
#[derive(Debug)]
pub struct Av<'pd> {
    pd: &'pd Pd<'pd>,
    handle: u64,
}

impl<'pd> Av<'pd> {
    /// Creates an AV in `pd` (`CreateAv`, finished by the plugin). Needs
    /// the plugin.
    pub fn new(pd: &'pd Pd<'pd>, attr: &AvAttr) -> Result<Self> {
        pd.ctx.plugin("CreateAv")?;
        let answer = pd.ctx.call::<v::CreateAv>(pd.handle, attr)?;
        Ok(Self {
            pd,
            handle: answer.handle,
        })
    }

    /// The AV handle, which a UD send's destination names.
    pub fn handle(&self) -> ib_types::handle::AvHandle {
        ib_types::handle::AvHandle::from_raw(self.handle)
    }

    /// Its PD and attributes (`QueryAv`).
    pub fn query(&self) -> Result<QueryAvOut> {
        Ok(self.pd.ctx.call::<v::QueryAv>(self.handle, &Empty)?.output)
    }

    /// Points it elsewhere (`ModifyAv`).
    pub fn modify(&self, attr: &AvAttr) -> Result<()> {
        self.pd.ctx.call::<v::ModifyAv>(self.handle, attr)?;
        Ok(())
    }
}

impl Drop for Av<'_> {
    fn drop(&mut self) {
        let _ = self.pd.ctx.call::<v::DestroyAv>(self.handle, &Empty);
    }
}

/// A completion queue whose ring the plugin laid out in this process and
/// polls with no kernel call. `Send + Sync` (the plugin serializes a CQ's
/// polls and arms with its own lock, shared with no post; while a resize
/// is under way its polls find nothing and its arms are made when it ends,
/// the plugin's doing too; resizes wait for each other, below).
#[derive(Debug)]
pub struct Cq<'ctx> {
    ctx: &'ctx Context,
    handle: u64,
    /// The linked plugin's fast path of this CQ: polls and arms find no
    /// handle. It cannot outlive the CQ (it is dropped with it), and a
    /// destroyed CQ's fast path refuses every call.
    fast: Option<uvp_plugin::CqFastPath>,
    cqe: AtomicU32,
    /// Held by a resize: one at a time (the plugin refuses a second one
    /// under way with `ResourceBusy`).
    resizing: Mutex<()>,
}

impl<'ctx> Cq<'ctx> {
    /// Creates a CQ of at least `cqe` entries (`CreateCq`; the plugin's pre
    /// lays its ring out). Needs the plugin.
    pub fn new(ctx: &'ctx Context, cqe: u32) -> Result<Self> {
        ctx.plugin("CreateCq")?;
        let attr = CqAttr {
            cqe,
            comp_vector: 0,
        };
        let answer = ctx.call::<v::CreateCq>(ctx.ca, &attr)?;
        Ok(Self {
            ctx,
            handle: answer.handle,
            fast: ctx
                .linked
                .as_ref()
                .and_then(|p| p.cq_fast_path(answer.handle)),
            cqe: AtomicU32::new(answer.output.cqe),
            resizing: Mutex::new(()),
        })
    }

    /// The CQ handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Entries it holds (as created, or as last resized).
    pub fn cqe(&self) -> u32 {
        self.cqe.load(Ordering::Relaxed)
    }

    /// Its size, from the kernel (`QueryCq`).
    pub fn query(&self) -> Result<u32> {
        Ok(self.ctx.call::<v::QueryCq>(self.handle, &Empty)?.output.cqe)
    }

    /// Resizes the CQ to at least `cqe` entries (`ResizeCq`): the plugin's
    /// pre lays a new ring out, the device copies the completions not yet
    /// polled into it and switches, and post makes polls go on from the
    /// new ring, so none is lost; the old ring is freed. A size that cannot
    /// hold the completions outstanding is refused by the kernel
    /// (`InvalidCqSize`) and the old ring stays in use. Takes `&self` (the
    /// QPs completing on it borrow it); meanwhile polls from other threads
    /// find nothing (the completions wait in the ring the poll goes on
    /// from) and their arms are made when it ends. Answers the new size.
    pub fn resize(&self, cqe: u32) -> Result<u32> {
        self.ctx.plugin("ResizeCq")?;
        if cqe == 0 {
            return Err(Error::InvalidArgument("a CQ of no entries"));
        }
        let attr = CqAttr {
            cqe,
            comp_vector: 0,
        };
        let _one_at_a_time = self.resizing.lock().unwrap_or_else(|p| p.into_inner());
        let answer = self.ctx.call::<v::ResizeCq>(self.handle, &attr)?;
        self.cqe.store(answer.output.cqe, Ordering::Relaxed);
        Ok(answer.output.cqe)
    }

    /// Polls up to `out.len()` completions, in user mode: how many.
    #[inline]
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        poll_cq(self.ctx, self.fast.as_ref(), self.handle, out)
    }

    /// Arms the CQ for its next (or next solicited) completion, in user
    /// mode (one doorbell).
    pub fn arm(&self, for_: uvp_plugin::ArmFor) -> Result<()> {
        arm_cq(self.ctx, self.fast.as_ref(), self.handle, for_)
    }

    /// Waits for the CQ's completion event (`WaitCqEvent`, after
    /// [`arm`](Self::arm)). An event that fired before the wait is kept
    /// for it, so none is lost. Blocks the calling thread.
    pub fn wait_event(&self) -> Result<()> {
        self.ctx.call::<v::WaitCqEvent>(self.handle, &Empty)?;
        Ok(())
    }
}

impl Drop for Cq<'_> {
    fn drop(&mut self) {
        // Post drops the plugin's CQ, then frees its ring.
        let _ = self.ctx.call::<v::DestroyCq>(self.handle, &Empty);
    }
}

/// What a QP is created with. (Its SRQ, if any, is named to
/// [`Qp::with_srq`], which borrows it.)
#[derive(Debug, Clone, Copy)]
pub struct QpInit {
    /// RC, UC or UD.
    pub qp_type: QpType,
    /// Capacities asked for (on an SRQ, the receive capacities are the
    /// SRQ's: ask for none).
    pub caps: QpCaps,
    /// Every send signaled.
    pub sq_sig_all: bool,
}

impl QpInit {
    /// A QP of `qp_type` with `caps`, sends signaled as requested.
    pub const fn new(qp_type: QpType, caps: QpCaps, sq_sig_all: bool) -> Self {
        Self {
            qp_type,
            caps,
            sq_sig_all,
        }
    }
}

/// A queue pair, tied to its PD, its CQs and its SRQ if any. `Send`
/// (posts take `&mut`, so a queue has one poster at a time; not `Sync`).
#[derive(Debug)]
pub struct Qp<'pd, 'cq> {
    pd: &'pd Pd<'pd>,
    handle: u64,
    /// The linked plugin's fast path of this QP: posts find no handle. It
    /// cannot outlive the QP (it is dropped with it), and a destroyed QP's
    /// fast path refuses every post.
    fast: Option<uvp_plugin::QpFastPath>,
    qpn: u32,
    caps: QpCaps,
    /// Receives come from an SRQ (no receive queue of its own).
    on_srq: bool,
    /// Multicast groups joined (`AttachMcast`): each group's GID and its
    /// membership handle (`DestroyQp` ends the memberships left).
    groups: Vec<(Gid, u64)>,
    _cqs: PhantomData<&'cq Cq<'cq>>,
    /// Not `Sync`: one poster at a time, as the docs promise.
    _one_poster: PhantomData<core::cell::Cell<()>>,
}

impl<'pd, 'cq> Qp<'pd, 'cq> {
    /// Creates a QP in `pd` completing on `send_cq` and `recv_cq`, with a
    /// receive queue of its own (`CreateQp`; the plugin's pre lays its
    /// rings out). Needs the plugin.
    pub fn new(
        pd: &'pd Pd<'pd>,
        send_cq: &'cq Cq<'cq>,
        recv_cq: &'cq Cq<'cq>,
        init: &QpInit,
    ) -> Result<Self> {
        Self::create(pd, send_cq, recv_cq, None, init)
    }

    /// Creates a QP in `pd` completing on `send_cq` and `recv_cq` whose
    /// receives come from `srq` (it has no receive queue of its own; an
    /// SRQ of another PD is refused before any call). The QP borrows the
    /// SRQ as it borrows its CQs. Needs the plugin.
    pub fn with_srq(
        pd: &'pd Pd<'pd>,
        send_cq: &'cq Cq<'cq>,
        recv_cq: &'cq Cq<'cq>,
        srq: &'cq Srq<'cq>,
        init: &QpInit,
    ) -> Result<Self> {
        Self::create(pd, send_cq, recv_cq, Some(srq), init)
    }

    fn create(
        pd: &'pd Pd<'pd>,
        send_cq: &'cq Cq<'cq>,
        recv_cq: &'cq Cq<'cq>,
        srq: Option<&'cq Srq<'cq>>,
        init: &QpInit,
    ) -> Result<Self> {
        let ctx = pd.ctx;
        ctx.plugin("CreateQp")?;
        if init.qp_type.is_special() {
            return Err(Error::InvalidArgument("special QPs are for kernel clients"));
        }
        // The lifetimes cannot tell one context from another: a CQ of
        // another open would only be refused by the kernel after the
        // plugin laid rings out for it.
        if !std::ptr::eq(send_cq.ctx, ctx) || !std::ptr::eq(recv_cq.ctx, ctx) {
            return Err(Error::InvalidArgument(
                "the QP's CQs belong to another context than its PD",
            ));
        }
        // The kernel requires the SRQ's PD to be the QP's (IBA 10.2.9);
        // said here before the plugin lays rings out.
        if srq.is_some_and(|srq| !std::ptr::eq(srq.pd, pd)) {
            return Err(Error::InvalidArgument(
                "the QP's SRQ belongs to another PD than the QP",
            ));
        }
        let input = ib_types::qp::QpCreate {
            qp_type: init.qp_type,
            pd: PdHandle::from_raw(pd.handle),
            send_cq: CqHandle::from_raw(send_cq.handle),
            recv_cq: CqHandle::from_raw(recv_cq.handle),
            srq: srq.map(|srq| SrqHandle::from_raw(srq.handle())),
            caps: init.caps,
            sq_sig_all: init.sq_sig_all,
            port: None,
        };
        let answer = ctx.call::<v::CreateQp>(ctx.ca, &input)?;
        Ok(Self {
            pd,
            handle: answer.handle,
            fast: ctx
                .linked
                .as_ref()
                .and_then(|p| p.qp_fast_path(answer.handle)),
            qpn: answer.output.qpn.get(),
            caps: answer.output.caps,
            on_srq: srq.is_some(),
            groups: Vec::new(),
            _cqs: PhantomData,
            _one_poster: PhantomData,
        })
    }

    /// The QP handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Its number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The capacities granted.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    pub(crate) fn pd(&self) -> &'pd Pd<'pd> {
        self.pd
    }

    /// Its type, state, number, capacities and the attributes it was
    /// modified with, from the kernel (`QueryQp`).
    pub fn query(&self) -> Result<QpQueryOut> {
        Ok(self.pd.ctx.call::<v::QueryQp>(self.handle, &Empty)?.output)
    }

    /// Joins the multicast group `group` (`AttachMcast`; a UD QP only, the
    /// kernel refuses others with `InvalidServiceType`): datagrams sent to
    /// the group's GID reach this QP's receives. Joining a group twice is
    /// refused before any call.
    pub fn attach_mcast(&mut self, group: &McastGroup) -> Result<()> {
        if self.groups.iter().any(|(gid, _)| *gid == group.mgid) {
            return Err(Error::InvalidArgument("the QP is in that group already"));
        }
        let answer = self.pd.ctx.call::<v::AttachMcast>(self.handle, group)?;
        self.groups.push((group.mgid, answer.handle));
        Ok(())
    }

    /// Leaves the multicast group `mgid` (`DetachMcast`). A group it is not
    /// in is refused before any call.
    pub fn detach_mcast(&mut self, mgid: &Gid) -> Result<()> {
        let at = self
            .groups
            .iter()
            .position(|(gid, _)| gid == mgid)
            .ok_or(Error::InvalidArgument("the QP is not in that group"))?;
        self.pd
            .ctx
            .call::<v::DetachMcast>(self.groups[at].1, &Empty)?;
        self.groups.remove(at);
        Ok(())
    }

    /// The GIDs of the multicast groups it is in.
    pub fn mcast_groups(&self) -> impl Iterator<Item = &Gid> {
        self.groups.iter().map(|(gid, _)| gid)
    }

    /// Modifies the QP (`ModifyQp`, through the proxy).
    pub fn modify(&self, modify: &QpModify) -> Result<()> {
        self.pd.ctx.call::<v::ModifyQp>(self.handle, modify)?;
        Ok(())
    }

    /// Posts sends, in user mode (one doorbell for the batch): how many.
    /// A UD send names its destination's [`Av`] by handle.
    #[inline]
    pub fn post_send(&mut self, requests: &[UserSend<'_>]) -> Result<usize> {
        match &self.fast {
            Some(fast) => fast.post_send(requests),
            None => self
                .pd
                .ctx
                .plugin("posting")?
                .post_send(self.handle, requests),
        }
        .map_err(refused)
    }

    /// Posts receives, in user mode: how many. A QP on an SRQ has no
    /// receive queue: post to the SRQ ([`Srq::post_recv`]).
    pub fn post_recv(&mut self, requests: &[RecvWr<'_>]) -> Result<usize> {
        if self.on_srq {
            return Err(Error::InvalidArgument(
                "the QP receives from its SRQ: post there",
            ));
        }
        match &self.fast {
            Some(fast) => fast.post_recv(requests),
            None => self
                .pd
                .ctx
                .plugin("posting")?
                .post_recv(self.handle, requests),
        }
        .map_err(refused)
    }
}

impl Drop for Qp<'_, '_> {
    fn drop(&mut self) {
        // Destroying a QP detaches it from its groups (the miniport sends
        // the detaches, the proxy forgets the memberships). Post drops the
        // plugin's QP, then frees its rings.
        let _ = self.pd.ctx.call::<v::DestroyQp>(self.handle, &Empty);
    }
}

/// A CQ's poll, through its fast path if the plugin gave one, else the
/// plugin's table by handle: how many completions (`Cq` and `SharedCq`).
/// Inlined into the callers, so a poll is one call into the plugin.
#[inline]
pub(crate) fn poll_cq(
    ctx: &Context,
    fast: Option<&uvp_plugin::CqFastPath>,
    handle: u64,
    out: &mut [WorkCompletion],
) -> Result<usize> {
    let polled = match fast {
        Some(fast) => fast.poll(out),
        None => ctx.plugin("polling")?.poll_cq(handle, out),
    };
    polled.map_err(|status| Error::Verb {
        verb: v::VerbId::WaitCqEvent,
        status,
    })
}

/// A CQ's arming for its next (or next solicited) completion, as
/// [`poll_cq`] reaches it.
pub(crate) fn arm_cq(
    ctx: &Context,
    fast: Option<&uvp_plugin::CqFastPath>,
    handle: u64,
    for_: uvp_plugin::ArmFor,
) -> Result<()> {
    let notify = match for_ {
        uvp_plugin::ArmFor::Next => CqNotify::NextCompletion,
        uvp_plugin::ArmFor::Solicited => CqNotify::Solicited,
    };
    let armed = match fast {
        Some(fast) => fast.arm(notify),
        None => ctx.plugin("arming")?.arm_cq(handle, notify),
    };
    armed.map_err(|status| Error::Verb {
        verb: v::VerbId::WaitCqEvent,
        status,
    })
}
