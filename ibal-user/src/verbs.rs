//! The objects: protection domains, address vectors, CQs, QPs,
//! registered memory. Each borrows what it depends on, so the compiler
//! enforces the destroy order the verbs require (a QP before its PD and
//! CQs, a region before its PD and before its buffer is freed); dropping
//! an object destroys it. Every verb goes through the plugin's hooks
//! (Table 10-1, `crate::proxy`); the plugin lays the CQ and QP rings out
//! and runs post, poll and arm with no kernel call.

use std::marker::PhantomData;

use ib_types::access::AccessFlags;
use ib_types::av::AvAttr;
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::ioctl::{self as v, Empty, QueryAvOut};
use ib_types::mr::{MrKeys, MrRegister};
use ib_types::qp::{QpCaps, QpModify, QpType};
use ib_types::uvp::{PostRefused, UserSend};
use ib_types::wc::WorkCompletion;
use ib_types::wr::RecvWr;

use crate::context::Context;
use crate::error::{Error, Result};

fn refused(e: PostRefused) -> Error {
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
            _buffer: PhantomData,
        })
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
/// polls and arms with its own lock, shared with no post).
#[derive(Debug)]
pub struct Cq<'ctx> {
    ctx: &'ctx Context,
    handle: u64,
    cqe: u32,
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
            cqe: answer.output.cqe,
        })
    }

    /// The CQ handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Entries it holds.
    pub fn cqe(&self) -> u32 {
        self.cqe
    }

    /// Polls up to `out.len()` completions, in user mode: how many.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.ctx
            .plugin("polling")?
            .poll_cq(self.handle, out)
            .map_err(|status| Error::Verb {
                verb: v::VerbId::WaitCqEvent,
                status,
            })
    }

    /// Arms the CQ for its next (or next solicited) completion, in user
    /// mode (one doorbell).
    pub fn arm(&self, for_: uvp_plugin::ArmFor) -> Result<()> {
        let notify = match for_ {
            uvp_plugin::ArmFor::Next => CqNotify::NextCompletion,
            uvp_plugin::ArmFor::Solicited => CqNotify::Solicited,
        };
        self.ctx
            .plugin("arming")?
            .arm_cq(self.handle, notify)
            .map_err(|status| Error::Verb {
                verb: v::VerbId::WaitCqEvent,
                status,
            })
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

/// What a QP is created with.
#[derive(Debug, Clone, Copy)]
pub struct QpInit {
    /// RC, UC or UD.
    pub qp_type: QpType,
    /// Capacities asked for.
    pub caps: QpCaps,
    /// Every send signaled.
    pub sq_sig_all: bool,
}

/// A queue pair, tied to its PD and CQs. `Send` (posts take `&mut`, so a
/// queue has one poster at a time; not `Sync`).
#[derive(Debug)]
pub struct Qp<'pd, 'cq> {
    pd: &'pd Pd<'pd>,
    handle: u64,
    qpn: u32,
    caps: QpCaps,
    _cqs: PhantomData<&'cq Cq<'cq>>,
    /// Not `Sync`: one poster at a time, as the docs promise.
    _one_poster: PhantomData<core::cell::Cell<()>>,
}

impl<'pd, 'cq> Qp<'pd, 'cq> {
    /// Creates a QP in `pd` completing on `send_cq` and `recv_cq`
    /// (`CreateQp`; the plugin's pre lays its rings out). Needs the
    /// plugin.
    pub fn new(
        pd: &'pd Pd<'pd>,
        send_cq: &'cq Cq<'cq>,
        recv_cq: &'cq Cq<'cq>,
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
        let input = ib_types::qp::QpCreate {
            qp_type: init.qp_type,
            pd: PdHandle::from_raw(pd.handle),
            send_cq: CqHandle::from_raw(send_cq.handle),
            recv_cq: CqHandle::from_raw(recv_cq.handle),
            srq: None,
            caps: init.caps,
            sq_sig_all: init.sq_sig_all,
            port: None,
        };
        let answer = ctx.call::<v::CreateQp>(ctx.ca, &input)?;
        Ok(Self {
            pd,
            handle: answer.handle,
            qpn: answer.output.qpn.get(),
            caps: answer.output.caps,
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

    /// Modifies the QP (`ModifyQp`, through the proxy).
    pub fn modify(&self, modify: &QpModify) -> Result<()> {
        self.pd.ctx.call::<v::ModifyQp>(self.handle, modify)?;
        Ok(())
    }

    /// Posts sends, in user mode (one doorbell for the batch): how many.
    /// A UD send names its destination's [`Av`] by handle.
    pub fn post_send(&mut self, requests: &[UserSend<'_>]) -> Result<usize> {
        self.pd
            .ctx
            .plugin("posting")?
            .post_send(self.handle, requests)
            .map_err(refused)
    }

    /// Posts receives, in user mode: how many.
    pub fn post_recv(&mut self, requests: &[RecvWr<'_>]) -> Result<usize> {
        self.pd
            .ctx
            .plugin("posting")?
            .post_recv(self.handle, requests)
            .map_err(refused)
    }
}

impl Drop for Qp<'_, '_> {
    fn drop(&mut self) {
        // Post drops the plugin's QP, then frees its rings.
        let _ = self.pd.ctx.call::<v::DestroyQp>(self.handle, &Empty);
    }
}
