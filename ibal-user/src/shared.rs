//! The verbs objects for callers that cannot hold borrows: a C library's
//! objects (`ibverbs-compat`, our `libibverbs.so.1`), which a program
//! holds by pointer and frees in whatever order it likes. Each owns what
//! it depends on through an [`Arc`] (a region its PD, a PD its context)
//! instead of borrowing it, and is destroyed explicitly with the verb's
//! answer ([`SharedPd::dealloc`], [`SharedMr::deregister`]), so a refused
//! destroy loses nothing, or, if never destroyed, when its last owner
//! drops it. A region covers any range of the process's memory, not only
//! a [`Buffer`](crate::Buffer): the program's own. An address vector
//! ([`SharedAv`]) is kept by the plugin in user mode, as [`crate::Av`].
//! A CQ ([`SharedCq`]) and a QP ([`SharedQp`]) post, poll and arm through
//! the linked plugin's fast path, as [`crate::Cq`] and [`crate::Qp`]; a
//! QP owns its PD and its CQs, and its SRQ ([`SharedSrq`], posted to
//! through the same fast path, as [`crate::Srq`]) if it receives from one.

use std::sync::{Arc, Mutex, PoisonError};

use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::cq::CqAttr;
use ib_types::handle::{AvHandle, CqHandle, PdHandle, SrqHandle};
use ib_types::ioctl::{self as v, Empty, QpQueryOut, QueryAvOut, Verb};
use ib_types::mr::{MrKeys, MrQuery, MrRegister};
use ib_types::qp::{QpCaps, QpModify};
use ib_types::srq::{SrqAttr, SrqCreate, SrqModify};
use ib_types::uvp::UserSend;
use ib_types::wc::WorkCompletion;
use ib_types::wr::RecvWr;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::verbs::{QpInit, arm_cq, poll_cq, refused};

/// Whether the object still exists in the kernel, held while it is being
/// destroyed so that two destroys never both reach the kernel.
#[derive(Debug)]
struct Alive(Mutex<bool>);

impl Alive {
    fn new() -> Self {
        Self(Mutex::new(true))
    }

    /// Asks `ctx` for the verb `V` (no input: a destroy, dealloc or
    /// deregistration) on `handle` if the object is alive; it is dead once
    /// the kernel (or plugin) agrees. A second destroy is an invalid
    /// argument.
    fn destroy<V: Verb<In = Empty>>(&self, ctx: &Context, handle: u64) -> Result<()> {
        let mut alive = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if !*alive {
            return Err(Error::InvalidArgument("already destroyed"));
        }
        ctx.call::<V>(handle, &Empty)?;
        *alive = false;
        Ok(())
    }
}

/// A protection domain owning its context. `Send + Sync`.
#[derive(Debug)]
pub struct SharedPd {
    ctx: Arc<Context>,
    handle: u64,
    alive: Alive,
}

impl SharedPd {
    /// Allocates a PD (`AllocPd`).
    pub fn new(ctx: Arc<Context>) -> Result<Self> {
        let answer = ctx.call::<v::AllocPd>(ctx.ca, &Empty)?;
        Ok(Self {
            ctx,
            handle: answer.handle,
            alive: Alive::new(),
        })
    }

    /// The PD handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Deallocates it (`DeallocPd`); refused (the PD stays) with the
    /// kernel's answer, e.g. while regions or QPs use it.
    pub fn dealloc(&self) -> Result<()> {
        self.alive.destroy::<v::DeallocPd>(&self.ctx, self.handle)
    }
}

impl Drop for SharedPd {
    fn drop(&mut self) {
        let _ = self.dealloc();
    }
}

/// A registered region over a range of the process's memory, owning its
/// PD. `Send + Sync`.
#[derive(Debug)]
pub struct SharedMr {
    pd: Arc<SharedPd>,
    handle: u64,
    keys: MrKeys,
    va: u64,
    len: u64,
    alive: Alive,
}

impl SharedMr {
    /// Registers `len` bytes at `va` of this process with `access`
    /// (`RegMr`): the kernel locks the pages and the device may access
    /// them as `access` allows until the region is deregistered.
    ///
    /// # Safety
    /// `va..va+len` is memory of this process that the caller lets the
    /// device read, and write as `access` allows, from now until the
    /// region is deregistered (or dropped): nothing else relies on its
    /// contents while a work request may touch them, and it stays
    /// allocated as long as the region exists.
    pub unsafe fn register(
        pd: &Arc<SharedPd>,
        va: u64,
        len: u64,
        access: AccessFlags,
    ) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("an empty region"));
        }
        let input = MrRegister {
            vaddr: va,
            length: len,
            access,
        };
        let answer = pd.ctx.call::<v::RegMr>(pd.handle, &input)?;
        Ok(Self {
            pd: Arc::clone(pd),
            handle: answer.handle,
            keys: answer.output,
            va,
            len,
            alive: Alive::new(),
        })
    }

    /// Its PD.
    pub fn pd(&self) -> &Arc<SharedPd> {
        &self.pd
    }

    /// The address of its first byte.
    pub fn va(&self) -> u64 {
        self.va
    }

    /// Its length in bytes (never zero).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false (a region has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Its L_Key and R_Key.
    pub fn keys(&self) -> MrKeys {
        self.keys
    }

    /// Its PD, range, rights and keys, from the kernel (`QueryMr`).
    pub fn query(&self) -> Result<MrQuery> {
        Ok(self.pd.ctx.call::<v::QueryMr>(self.handle, &Empty)?.output)
    }

    /// Deregisters it (`DeregMr`); refused (the region stays) with the
    /// kernel's answer, e.g. while a memory window is bound to it. The
    /// pages are the process's own again once this succeeds.
    pub fn deregister(&self) -> Result<()> {
        self.alive.destroy::<v::DeregMr>(&self.pd.ctx, self.handle)
    }
}

impl Drop for SharedMr {
    fn drop(&mut self) {
        let _ = self.deregister();
    }
}

/// An address vector of a PD, owning its PD; kept by the plugin in user
/// mode (no kernel request), as [`crate::Av`]. `Send + Sync`.
#[derive(Debug)]
pub struct SharedAv {
    pd: Arc<SharedPd>,
    handle: u64,
    alive: Alive,
}

impl SharedAv {
    /// Creates an AV in `pd` (`CreateAv`, finished by the plugin). Needs
    /// the plugin.
    pub fn new(pd: &Arc<SharedPd>, attr: &AvAttr) -> Result<Self> {
        pd.ctx.plugin("CreateAv")?;
        let answer = pd.ctx.call::<v::CreateAv>(pd.handle, attr)?;
        Ok(Self {
            pd: Arc::clone(pd),
            handle: answer.handle,
            alive: Alive::new(),
        })
    }

    /// Its PD.
    pub fn pd(&self) -> &Arc<SharedPd> {
        &self.pd
    }

    /// The AV handle, which a UD send's destination names.
    pub fn handle(&self) -> AvHandle {
        AvHandle::from_raw(self.handle)
    }

    /// Its PD and attributes (`QueryAv`).
    pub fn query(&self) -> Result<QueryAvOut> {
        Ok(self.pd.ctx.call::<v::QueryAv>(self.handle, &Empty)?.output)
    }

    /// Destroys it (`DestroyAv`); refused (the AV stays) with the
    /// plugin's answer.
    pub fn destroy(&self) -> Result<()> {
        self.alive
            .destroy::<v::DestroyAv>(&self.pd.ctx, self.handle)
    }
}

impl Drop for SharedAv {
    fn drop(&mut self) {
        let _ = self.destroy();
    }
}

/// A completion queue owning its context, polled and armed in user mode
/// through the linked plugin's fast path (as [`crate::Cq`]). `Send +
/// Sync`: the plugin serializes a CQ's polls and arms.
#[derive(Debug)]
pub struct SharedCq {
    ctx: Arc<Context>,
    handle: u64,
    /// The linked plugin's fast path: a destroyed CQ's refuses every call.
    fast: Option<uvp_plugin::CqFastPath>,
    cqe: u32,
    alive: Alive,
}

impl SharedCq {
    /// Creates a CQ of at least `cqe` entries (`CreateCq`; the plugin's
    /// pre lays its ring out). Needs the plugin.
    pub fn new(ctx: Arc<Context>, cqe: u32, comp_vector: u32) -> Result<Self> {
        ctx.plugin("CreateCq")?;
        let attr = CqAttr { cqe, comp_vector };
        let answer = ctx.call::<v::CreateCq>(ctx.ca, &attr)?;
        let fast = ctx
            .linked
            .as_ref()
            .and_then(|p| p.cq_fast_path(answer.handle));
        Ok(Self {
            handle: answer.handle,
            fast,
            cqe: answer.output.cqe,
            ctx,
            alive: Alive::new(),
        })
    }

    /// The CQ handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Entries it holds (at least what was asked).
    pub fn cqe(&self) -> u32 {
        self.cqe
    }

    /// Polls up to `out.len()` completions, in user mode: how many.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        poll_cq(&self.ctx, self.fast.as_ref(), self.handle, out)
    }

    /// Arms the CQ for its next (or next solicited) completion, in user
    /// mode (one doorbell).
    pub fn arm(&self, for_: uvp_plugin::ArmFor) -> Result<()> {
        arm_cq(&self.ctx, self.fast.as_ref(), self.handle, for_)
    }

    /// Waits for the CQ's completion event (`WaitCqEvent`, after
    /// [`arm`](Self::arm)); an event that fired before the wait is kept
    /// for it. Blocks the calling thread; ends with the kernel's
    /// `Canceled` when the CQ is destroyed meanwhile.
    pub fn wait_event(&self) -> Result<()> {
        self.ctx.call::<v::WaitCqEvent>(self.handle, &Empty)?;
        Ok(())
    }

    /// Destroys it (`DestroyCq`; a wait pending on it ends); refused (the
    /// CQ stays) with the kernel's answer, e.g. while a QP uses it.
    pub fn destroy(&self) -> Result<()> {
        self.alive.destroy::<v::DestroyCq>(&self.ctx, self.handle)
    }
}

impl Drop for SharedCq {
    fn drop(&mut self) {
        let _ = self.destroy();
    }
}

/// A shared receive queue owning its PD, posted to in user mode through
/// the linked plugin's fast path (as [`crate::Srq`]). `Send + Sync`: the
/// plugin serializes an SRQ's posts with the SRQ's own lock, which no
/// CQ's poll takes. A [`SharedQp`] made on it owns it, so it outlives its
/// QPs; the kernel refuses its destroy while a QP uses it.
#[derive(Debug)]
pub struct SharedSrq {
    pd: Arc<SharedPd>,
    handle: u64,
    /// The linked plugin's fast path: a destroyed SRQ's refuses every post.
    fast: Option<uvp_plugin::SrqFastPath>,
    attr: SrqAttr,
    alive: Alive,
}

impl SharedSrq {
    /// Creates an SRQ in `pd` of at least `attr.max_wr` receives of
    /// `attr.max_sge` entries each (`CreateSrq`; the plugin's pre lays the
    /// ring out); a non-zero `attr.srq_limit` arms the limit event at once.
    /// Needs the plugin.
    pub fn new(pd: &Arc<SharedPd>, attr: &SrqAttr) -> Result<Self> {
        let ctx = &pd.ctx;
        ctx.plugin("CreateSrq")?;
        if attr.max_wr == 0 {
            return Err(Error::InvalidArgument("an SRQ of no receives"));
        }
        let input = SrqCreate {
            pd: PdHandle::from_raw(pd.handle),
            attr: *attr,
        };
        let answer = ctx.call::<v::CreateSrq>(ctx.ca, &input)?;
        Ok(Self {
            pd: Arc::clone(pd),
            handle: answer.handle,
            fast: ctx
                .linked
                .as_ref()
                .and_then(|p| p.srq_fast_path(answer.handle)),
            attr: answer.output,
            alive: Alive::new(),
        })
    }

    /// Its PD.
    pub fn pd(&self) -> &Arc<SharedPd> {
        &self.pd
    }

    /// The SRQ handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// What the kernel granted at creation (receives, SGEs, limit).
    pub fn attr(&self) -> SrqAttr {
        self.attr
    }

    /// Its current attributes (`QuerySrq`): the limit reads 0 once the
    /// limit event fired (the device disarms it).
    pub fn query(&self) -> Result<SrqAttr> {
        Ok(self.pd.ctx.call::<v::QuerySrq>(self.handle, &Empty)?.output)
    }

    /// Modifies it (`ModifySrq`): arms the limit (0 disarms); the kernel
    /// refuses a resize (`max_wr`) with `Unsupported`, changing nothing.
    pub fn modify(&self, modify: &SrqModify) -> Result<()> {
        self.pd.ctx.call::<v::ModifySrq>(self.handle, modify)?;
        Ok(())
    }

    /// Posts receives, in user mode (one record store for the batch): how
    /// many; a refusal says how many went before it.
    pub fn post_recv(&self, requests: &[RecvWr<'_>]) -> Result<usize> {
        match &self.fast {
            Some(fast) => fast.post_recv(requests),
            None => self
                .pd
                .ctx
                .plugin("posting")?
                .post_srq_recv(self.handle, requests),
        }
        .map_err(refused)
    }

    /// Destroys it (`DestroySrq`); refused (the SRQ stays) with the
    /// kernel's answer, e.g. `ResourceBusy` while a QP uses it.
    pub fn destroy(&self) -> Result<()> {
        self.alive
            .destroy::<v::DestroySrq>(&self.pd.ctx, self.handle)
    }
}

impl Drop for SharedSrq {
    fn drop(&mut self) {
        let _ = self.destroy();
    }
}

/// A queue pair owning its PD and CQs (and its SRQ, if it receives from
/// one), posting in user mode through the linked plugin's fast path (as
/// [`crate::Qp`]). `Send + Sync`: each queue's posts are serialized here
/// (a C program may post from several threads, as rdma-core's providers
/// allow).
#[derive(Debug)]
pub struct SharedQp {
    pd: Arc<SharedPd>,
    send_cq: Arc<SharedCq>,
    recv_cq: Arc<SharedCq>,
    /// Its receives come from this SRQ (no receive queue of its own).
    srq: Option<Arc<SharedSrq>>,
    handle: u64,
    fast: Option<uvp_plugin::QpFastPath>,
    qpn: u32,
    caps: QpCaps,
    send_lock: Mutex<()>,
    recv_lock: Mutex<()>,
    alive: Alive,
}

impl SharedQp {
    /// Creates a QP in `pd` completing on `send_cq` and `recv_cq`
    /// (`CreateQp`; the plugin's pre lays its rings out). CQs of another
    /// context than the PD's are refused before any call. Needs the
    /// plugin.
    pub fn new(
        pd: &Arc<SharedPd>,
        send_cq: &Arc<SharedCq>,
        recv_cq: &Arc<SharedCq>,
        init: &QpInit,
    ) -> Result<Self> {
        Self::create(pd, send_cq, recv_cq, None, init)
    }

    /// Creates a QP as [`new`](Self::new) whose receives come from `srq`
    /// (it has no receive queue of its own, and owns the SRQ); an SRQ of
    /// another PD is refused before any call (IBA 10.2.9).
    pub fn with_srq(
        pd: &Arc<SharedPd>,
        send_cq: &Arc<SharedCq>,
        recv_cq: &Arc<SharedCq>,
        srq: &Arc<SharedSrq>,
        init: &QpInit,
    ) -> Result<Self> {
        Self::create(pd, send_cq, recv_cq, Some(srq), init)
    }

    fn create(
        pd: &Arc<SharedPd>,
        send_cq: &Arc<SharedCq>,
        recv_cq: &Arc<SharedCq>,
        srq: Option<&Arc<SharedSrq>>,
        init: &QpInit,
    ) -> Result<Self> {
        let ctx = &pd.ctx;
        ctx.plugin("CreateQp")?;
        if init.qp_type.is_special() {
            return Err(Error::InvalidArgument("special QPs are for kernel clients"));
        }
        if !Arc::ptr_eq(&send_cq.ctx, ctx) || !Arc::ptr_eq(&recv_cq.ctx, ctx) {
            return Err(Error::InvalidArgument(
                "the QP's CQs belong to another context than its PD",
            ));
        }
        if srq.is_some_and(|srq| !Arc::ptr_eq(&srq.pd, pd)) {
            return Err(Error::InvalidArgument(
                "the QP's SRQ belongs to another PD than the QP",
            ));
        }
        let input = ib_types::qp::QpCreate {
            qp_type: init.qp_type,
            pd: PdHandle::from_raw(pd.handle),
            send_cq: CqHandle::from_raw(send_cq.handle),
            recv_cq: CqHandle::from_raw(recv_cq.handle),
            srq: srq.map(|srq| SrqHandle::from_raw(srq.handle)),
            caps: init.caps,
            sq_sig_all: init.sq_sig_all,
            port: None,
        };
        let answer = ctx.call::<v::CreateQp>(ctx.ca, &input)?;
        Ok(Self {
            pd: Arc::clone(pd),
            send_cq: Arc::clone(send_cq),
            recv_cq: Arc::clone(recv_cq),
            srq: srq.map(Arc::clone),
            handle: answer.handle,
            fast: ctx
                .linked
                .as_ref()
                .and_then(|p| p.qp_fast_path(answer.handle)),
            qpn: answer.output.qpn.get(),
            caps: answer.output.caps,
            send_lock: Mutex::new(()),
            recv_lock: Mutex::new(()),
            alive: Alive::new(),
        })
    }

    /// Its PD.
    pub fn pd(&self) -> &Arc<SharedPd> {
        &self.pd
    }

    /// Its send CQ.
    pub fn send_cq(&self) -> &Arc<SharedCq> {
        &self.send_cq
    }

    /// Its receive CQ.
    pub fn recv_cq(&self) -> &Arc<SharedCq> {
        &self.recv_cq
    }

    /// The SRQ its receives come from, if any.
    pub fn srq(&self) -> Option<&Arc<SharedSrq>> {
        self.srq.as_ref()
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

    /// Its type, state, number, capacities and attributes (`QueryQp`).
    pub fn query(&self) -> Result<QpQueryOut> {
        Ok(self.pd.ctx.call::<v::QueryQp>(self.handle, &Empty)?.output)
    }

    /// Modifies it (`ModifyQp`, through the proxy).
    pub fn modify(&self, modify: &QpModify) -> Result<()> {
        self.pd.ctx.call::<v::ModifyQp>(self.handle, modify)?;
        Ok(())
    }

    /// Posts sends, in user mode (one doorbell for the batch): how many;
    /// a refusal says how many went before it.
    pub fn post_send(&self, requests: &[UserSend<'_>]) -> Result<usize> {
        let _one_poster = self
            .send_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
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
    /// receive queue: post to the SRQ ([`SharedSrq::post_recv`]).
    pub fn post_recv(&self, requests: &[RecvWr<'_>]) -> Result<usize> {
        if self.srq.is_some() {
            return Err(Error::InvalidArgument(
                "the QP receives from its SRQ: post there",
            ));
        }
        let _one_poster = self
            .recv_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
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

    /// Destroys it (`DestroyQp`); refused (the QP stays) with the
    /// kernel's answer.
    pub fn destroy(&self) -> Result<()> {
        self.alive
            .destroy::<v::DestroyQp>(&self.pd.ctx, self.handle)
    }
}

impl Drop for SharedQp {
    fn drop(&mut self) {
        let _ = self.destroy();
    }
}
