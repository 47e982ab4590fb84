//! The objects: protection domains, CQs, QPs, registered memory. Each
//! borrows what it depends on, so the compiler enforces the destroy order
//! the verbs require (a QP before its PD and CQs, a region before its PD
//! and before its buffer is freed); dropping an object destroys it through
//! the proxy.

use std::marker::PhantomData;
use std::sync::{Mutex, MutexGuard, PoisonError};

use hca_prm::uverbs::{CreateCqPriv, CreateCqPrivOut, CreateQpPriv, CreateQpPrivOut};
use ib_types::access::AccessFlags;
use ib_types::cq::CqAttr;
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::ioctl::{self as v, Empty, VerbId};
use ib_types::mr::{MrKeys, MrRegister};
use ib_types::qp::{QpCaps, QpModify, QpType};
use ib_types::wc::WorkCompletion;
use ib_types::wr::RecvWr;
use zerocopy::IntoBytes;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::proxy::{self, ROOM};

/// Bytes of one CQE (PRM 10.4).
const CQE_BYTES: usize = 32;
/// Bytes of a send basic block (PRM 10.2).
const BB_BYTES: usize = 64;

/// `ceil(log2(n))`, at least `min`.
fn log2_at_least(n: u32, min: u8) -> u8 {
    let log = n.max(1).next_power_of_two().trailing_zeros() as u8;
    log.max(min)
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
        let answer = proxy::call::<v::AllocPd>(&*ctx.file, ctx.ca, &Empty, &[], 0)?;
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
        let _ = proxy::call::<v::DeallocPd>(&*self.ctx.file, self.handle, &Empty, &[], 0);
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
        let answer = proxy::call::<v::RegMr>(&*pd.ctx.file, pd.handle, &input, &[], 0)?;
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
        let _ = proxy::call::<v::DeregMr>(&*self.pd.ctx.file, self.handle, &Empty, &[], 0);
    }
}

/// A completion queue whose ring lives in this process (laid out for the
/// plugin, which polls it with no kernel call). `Send + Sync`: polls and
/// arms take the CQ's own lock, shared with no post.
#[derive(Debug)]
pub struct Cq<'ctx> {
    ctx: &'ctx Context,
    handle: u64,
    cqe: u32,
    ring: u64,
    /// The plugin's half; `None` only inside `Drop`.
    fast: Mutex<Option<uvp_plugin::Cq>>,
}

impl<'ctx> Cq<'ctx> {
    /// Creates a CQ of at least `cqe` entries (`CreateCq`, the ring laid
    /// out in this process). Needs the plugin.
    pub fn new(ctx: &'ctx Context, cqe: u32) -> Result<Self> {
        let fast = ctx.fast.as_ref().ok_or(Error::NeedsPlugin("CreateCq"))?;
        let log = log2_at_least(cqe, 1);
        let ring = ctx.alloc(CQE_BYTES << log)?;
        let result = (|| {
            let layout =
                CreateCqPriv::new(log, ring, ctx.record()?).map_err(|error| Error::Abi {
                    verb: VerbId::CreateCq,
                    error,
                })?;
            let attr = CqAttr {
                cqe: 1 << log,
                comp_vector: 0,
            };
            let answer = proxy::call::<v::CreateCq>(
                &*ctx.file,
                ctx.ca,
                &attr,
                layout.emit().as_bytes(),
                ROOM,
            )?;
            let created = CreateCqPrivOut::parse(&answer.private).map_err(|error| Error::Abi {
                verb: VerbId::CreateCq,
                error,
            });
            // SAFETY: the ring and record are allocations of this process
            // that outlive the plugin's CQ (freed in `Drop` after it), and
            // the device reaches them by DMA only.
            let cq = created.and_then(|created| Ok(unsafe { fast.plugin.cq(&layout, &created) }?));
            match cq {
                Ok(cq) => Ok((answer.handle, answer.output.cqe, cq)),
                Err(e) => {
                    let _ = proxy::call::<v::DestroyCq>(&*ctx.file, answer.handle, &Empty, &[], 0);
                    Err(e)
                }
            }
        })();
        match result {
            Ok((handle, cqe, cq)) => Ok(Self {
                ctx,
                handle,
                cqe,
                ring,
                fast: Mutex::new(Some(cq)),
            }),
            Err(e) => {
                ctx.io.free(ring);
                Err(e)
            }
        }
    }

    /// The CQ handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Entries it holds.
    pub fn cqe(&self) -> u32 {
        self.cqe
    }

    fn lock(&self) -> MutexGuard<'_, Option<uvp_plugin::Cq>> {
        self.fast.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Polls up to `out.len()` completions, in user mode: how many.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        self.lock().as_mut().map_or(0, |cq| cq.poll(out))
    }

    /// Arms the CQ for its next (or next solicited) completion, in user
    /// mode (one doorbell).
    pub fn arm(&self, for_: uvp_plugin::ArmFor) {
        if let Some(cq) = self.lock().as_ref() {
            cq.arm(for_);
        }
    }

    /// Waits for the CQ's completion event (`WaitCqEvent`, after
    /// [`arm`](Self::arm)). An event that fired before the wait is kept
    /// for it, so none is lost. Blocks the calling thread.
    pub fn wait_event(&self) -> Result<()> {
        proxy::call::<v::WaitCqEvent>(&*self.ctx.file, self.handle, &Empty, &[], 0)?;
        Ok(())
    }
}

impl Drop for Cq<'_> {
    fn drop(&mut self) {
        let _ = proxy::call::<v::DestroyCq>(&*self.ctx.file, self.handle, &Empty, &[], 0);
        drop(self.lock().take());
        self.ctx.io.free(self.ring);
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
    caps: QpCaps,
    rings: [Option<u64>; 2],
    /// The plugin's half; `None` only inside `Drop` (it goes before its
    /// rings are freed).
    fast: Option<uvp_plugin::Qp>,
    _cqs: PhantomData<&'cq Cq<'cq>>,
}

impl<'pd, 'cq> Qp<'pd, 'cq> {
    /// Creates a QP in `pd` completing on `send_cq` and `recv_cq`
    /// (`CreateQp`, its rings laid out in this process). Needs the plugin.
    pub fn new(
        pd: &'pd Pd<'pd>,
        send_cq: &'cq Cq<'cq>,
        recv_cq: &'cq Cq<'cq>,
        init: &QpInit,
    ) -> Result<Self> {
        let ctx = pd.ctx;
        let fast = ctx.fast.as_ref().ok_or(Error::NeedsPlugin("CreateQp"))?;
        if init.qp_type.is_special() {
            return Err(Error::InvalidArgument("special QPs are for kernel clients"));
        }
        // Two basic blocks a WQE; a receive WQE of 16 bytes per SGE, at
        // least 64.
        let log_wqe_bbs = 1;
        let sq_log_bbs = log2_at_least(init.caps.max_send_wr, 0) + log_wqe_bbs;
        let rq_log = log2_at_least(init.caps.max_recv_wr, 0);
        let rq_stride = log2_at_least(16 * init.caps.max_recv_sge.max(1), 6);
        let sq = ctx.alloc(BB_BYTES << sq_log_bbs)?;
        let rq = match ctx.alloc(1 << (rq_log + rq_stride)) {
            Ok(rq) => rq,
            Err(e) => {
                ctx.io.free(sq);
                return Err(e);
            }
        };
        let result = (|| {
            let layout = CreateQpPriv::new(
                sq_log_bbs,
                log_wqe_bbs,
                sq,
                Some((rq_log, rq_stride, rq, ctx.record()?)),
            )
            .map_err(|error| Error::Abi {
                verb: VerbId::CreateQp,
                error,
            })?;
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
            let answer = proxy::call::<v::CreateQp>(
                &*ctx.file,
                ctx.ca,
                &input,
                layout.emit().as_bytes(),
                ROOM,
            )?;
            let created = CreateQpPrivOut::parse(&answer.private)
                .map_err(|error| Error::Abi {
                    verb: VerbId::CreateQp,
                    error,
                })
                .and_then(|private| {
                    let created = uvp_plugin::QpCreated {
                        qp_type: init.qp_type,
                        caps: answer.output.caps,
                        private,
                    };
                    // SAFETY: the rings and record are allocations of this
                    // process that outlive the plugin's QP (freed in `Drop`
                    // after it), reached by the device by DMA only.
                    Ok(unsafe { fast.plugin.qp(&layout, &created, None) }?)
                });
            match created {
                Ok(qp) => Ok((answer.handle, answer.output.caps, qp)),
                Err(e) => {
                    let _ = proxy::call::<v::DestroyQp>(&*ctx.file, answer.handle, &Empty, &[], 0);
                    Err(e)
                }
            }
        })();
        match result {
            Ok((handle, caps, fast)) => Ok(Self {
                pd,
                handle,
                caps,
                rings: [Some(sq), Some(rq)],
                fast: Some(fast),
                _cqs: PhantomData,
            }),
            Err(e) => {
                ctx.io.free(sq);
                ctx.io.free(rq);
                Err(e)
            }
        }
    }

    /// The QP handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }

    /// Its number.
    pub fn qpn(&self) -> u32 {
        self.fast.as_ref().map_or(0, |qp| qp.qpn().get())
    }

    fn fast(&mut self) -> Result<&mut uvp_plugin::Qp> {
        self.fast.as_mut().ok_or(Error::NeedsPlugin("posting"))
    }

    /// The capacities granted.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// Modifies the QP (`ModifyQp`, through the proxy).
    pub fn modify(&self, modify: &QpModify) -> Result<()> {
        proxy::call::<v::ModifyQp>(&*self.pd.ctx.file, self.handle, modify, &[], 0)?;
        Ok(())
    }

    /// Posts sends, in user mode (one doorbell for the batch): how many.
    pub fn post_send(&mut self, requests: &[uvp_plugin::SendRequest<'_>]) -> Result<usize> {
        Ok(self.fast()?.send_queue().post(requests)?)
    }

    /// Posts receives, in user mode: how many.
    pub fn post_recv(&mut self, requests: &[RecvWr<'_>]) -> Result<usize> {
        let queue = self
            .fast()?
            .recv_queue()
            .ok_or(Error::InvalidArgument("the QP has no receive queue"))?;
        Ok(queue.post(requests)?)
    }
}

impl Drop for Qp<'_, '_> {
    fn drop(&mut self) {
        let ctx = self.pd.ctx;
        let _ = proxy::call::<v::DestroyQp>(&*ctx.file, self.handle, &Empty, &[], 0);
        drop(self.fast.take());
        for ring in self.rings.iter_mut().filter_map(Option::take) {
            ctx.io.free(ring);
        }
    }
}
