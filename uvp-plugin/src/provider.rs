//! The provider's control path: the pre/post hooks of every proxy verb
//! (guide 6.2.2, 6.4.2, 6.5.3, 6.8.1, Table 10-1) and the fast path by
//! handle, behind [`ib_types::uvp::UserVerbsProvider`].
//!
//! Contract:
//! - **Context** (`OpenCa`): post parses the private limits (PRM 13) and
//!   takes the doorbell page the kernel mapped (`OpenCaOut::doorbell`) as
//!   the context's [`UarPage`].
//! - **CQ, QP, SRQ, ResizeCq**: pre allocates the rings and the doorbell
//!   record in the process ([`UserMemory`], one zero-filled allocation per
//!   object: rings first, the record after them) and describes them in the
//!   private input; post builds the fast-path object from that layout and
//!   the kernel's answer. A post that does not build one (the IOCTL failed,
//!   or a response short, hostile or not matching the layout) frees what
//!   pre allocated and returns a status; for a failed IOCTL always its
//!   status (row 3), else `InvalidParameter` (row 2: the library destroys
//!   the kernel object). Destroy's post drops the object, then frees its
//!   memory.
//! - **Address vectors** live in the provider only (guide 6.4.2):
//!   `CreateAv`, `QueryAv`, `ModifyAv` and `DestroyAv` finish in pre with
//!   `VerbsProcessingDone`; no IOCTL. An AV's handle has
//!   [`USER_AV_TAG`] set, so it never equals a kernel handle; the PD it
//!   names must be one this provider saw allocated, and a PD with AVs is
//!   refused `DeallocPd` (`ResourceBusy`) before the IOCTL. The attributes
//!   are refused as the kernel's AV verbs refuse them, with the same status
//!   (`Av::for_device`: the port against the context's `num_ports`, the
//!   static rate, the RoCEv2 layout).
//! - **PD, MR, MW and every other verb**: no private data; post reports the
//!   IOCTL's status (PDs are remembered for the AVs).
//! - Unknown handles (a QP's CQs must be this context's), bad inputs and a
//!   private buffer too small are refused in pre with a status; nothing is
//!   allocated then.
//! - **ModifyQp** to RESET: post restarts the QP's rings (`Qp::reset`).
//! - The fast path takes the object's lock (one per CQ, QP, SRQ), so the
//!   trait's "any thread" promise holds; the objects themselves stay the
//!   lock-free ones of `docs/uvp.md`.

use std::sync::{Arc, Mutex, MutexGuard};

use hca_prm::av::Av;
use hca_prm::uverbs::{
    CreateCqPriv, CreateCqPrivOut, CreateQpPriv, CreateQpPrivOut, CreateSrqPriv, CreateSrqPrivOut,
    OpenCaPriv, ResizeCqPriv,
};
use hca_prm::wqe::{BB_SIZE, MIN_RECV_STRIDE, SEG_SIZE, inline_seg_len};
use ib_types::abi::Repr;
use ib_types::av::AvAttr;
use ib_types::cq::{CqAttr, CqNotify};
use ib_types::handle::{CqHandle, PdHandle};
use ib_types::ioctl::{OpenCaOut, QpCreated as QpCreatedOut, QueryAvOut, VerbId};
use ib_types::mr::MwAttr;
use ib_types::qp::{QpCreate, QpModify, QpState, QpType};
use ib_types::srq::{SrqAttr, SrqCreate};
use ib_types::status::IbStatus;
use ib_types::uvp::{PostCall, PostRefused, PreCall, PreOutcome, UserSend, UserVerbsProvider};
use ib_types::wc::WorkCompletion;
use ib_types::wr::RecvWr;
use rustc_hash::FxHashMap;
use zerocopy::IntoBytes;

use crate::context::{Context, QpCreated};
use crate::cq::{ArmFor, Cq};
use crate::error::PostError;
use crate::mmio::UarPage;
use crate::qp::{Qp, SendRequest};
use crate::srq::Srq;

/// Bit set in every user AV handle: kernel handles never have it.
pub const USER_AV_TAG: u64 = 1 << 63;

/// Bytes after an object's rings for its doorbell record (one 64-byte
/// line, so the record shares no cache line with a ring).
const RECORD_ROOM: usize = 64;

/// UD sends whose AVs are resolved at a time, on the stack (one doorbell
/// per this many; RC and UC batches ring once).
const UD_AV_BATCH: usize = 16;

/// Send WQE bytes before the data segments, per transport (PRM 10.2):
/// the control segment, then the UD address or the RC remote segment.
const fn send_prefix(qp_type: QpType) -> usize {
    match qp_type {
        QpType::Ud | QpType::Smi | QpType::Gsi => SEG_SIZE + 48,
        QpType::Rc => SEG_SIZE + 32,
        QpType::Uc => SEG_SIZE + SEG_SIZE,
    }
}

/// The process memory the provider lays its rings out in.
pub trait UserMemory: Send + Sync {
    /// `len` zero-filled bytes of this process, page aligned: their
    /// address, or `None` when there is no memory.
    fn alloc(&self, len: usize) -> Option<u64>;
    /// Frees what [`alloc`](Self::alloc) returned at `va`.
    fn free(&self, va: u64);
}

/// What the provider needs from the platform it runs on.
#[derive(Clone)]
pub struct Platform {
    /// Ring memory.
    pub memory: Arc<dyn UserMemory>,
    /// Where doorbell stores go (the simulated host's device; on Windows
    /// the page the kernel mapped is written directly).
    #[cfg(not(windows))]
    pub mmio: crate::mmio::MmioHook,
}

impl core::fmt::Debug for Platform {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Platform").finish_non_exhaustive()
    }
}

/// One allocation of the process, freed when dropped.
struct Allocation {
    memory: Arc<dyn UserMemory>,
    va: u64,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.memory.free(self.va);
    }
}

/// What pre allocated, waiting for post.
enum Pending {
    Cq {
        ca: u64,
        layout: CreateCqPriv,
        memory: Allocation,
    },
    Resize {
        cq: u64,
        layout: ResizeCqPriv,
        memory: Allocation,
    },
    Qp {
        ca: u64,
        qp_type: QpType,
        /// Its send and receive CQs' handles.
        cqs: [u64; 2],
        srq: Option<u64>,
        layout: CreateQpPriv,
        memory: Allocation,
    },
    Srq {
        ca: u64,
        layout: CreateSrqPriv,
        memory: Allocation,
    },
}

/// A fast-path object and its memory. The provider's map holds it, and
/// so may the access library ([`QpFastPath`], [`CqFastPath`],
/// [`SrqFastPath`]): when the
/// object is destroyed it leaves the map and is dropped at once (`None`
/// from then on, so a fast path still held refuses every call), and its
/// memory is freed when the last holder lets go. Fields drop in order:
/// the object (which stops using the rings) before the memory.
struct Owned<T> {
    ca: u64,
    /// The object's lock: a queue's posts, or a CQ's polls and arms, from
    /// any number of threads (the trait promises "any thread"; the access
    /// library's `Qp` has one poster at a time but its CQs are shared), and
    /// the control path's resize and reset, are serialized by it.
    object: parking_lot::Mutex<Option<T>>,
    memory: Mutex<Allocation>,
}

impl<T> Owned<T> {
    fn new(ca: u64, object: T, memory: Allocation) -> Arc<Self> {
        Arc::new(Self {
            ca,
            object: parking_lot::Mutex::new(Some(object)),
            memory: Mutex::new(memory),
        })
    }

    #[inline]
    fn lock(&self) -> parking_lot::MutexGuard<'_, Option<T>> {
        self.object.lock()
    }

    /// The object destroyed: dropped now; every later call is refused.
    fn retire(&self) {
        let object = self.lock().take();
        drop(object);
    }
}

/// A CQ as the provider keeps it: its fast path, and whether a resize is
/// under way (from `ResizeCq`'s pre to its post the device may switch to
/// the new ring, into which it copies the completions not yet polled: a
/// poll of the old ring then would hand them out twice, so polls find
/// nothing and arms wait for the post).
struct UserCq {
    cq: Cq,
    resizing: bool,
    /// An arm asked for during a resize, made when it ends.
    deferred_arm: Option<ArmFor>,
}

impl UserCq {
    fn new(cq: Cq) -> Self {
        Self {
            cq,
            resizing: false,
            deferred_arm: None,
        }
    }
}

/// The user address vectors, by handle, shared by the provider's control
/// path and its QPs' fast paths (UD sends resolve their AVs here).
#[derive(Default)]
struct AvTable {
    next: u64,
    avs: FxHashMap<u64, UserAv>,
}

type Avs = Arc<Mutex<AvTable>>;

fn lock_avs(avs: &Mutex<AvTable>) -> MutexGuard<'_, AvTable> {
    avs.lock().unwrap_or_else(|p| p.into_inner())
}

struct UserAv {
    ca: u64,
    pd: u64,
    attr: AvAttr,
    av: Av,
}

#[derive(Default)]
struct State {
    next_cookie: u64,
    pending: FxHashMap<u64, Pending>,
    contexts: FxHashMap<u64, Arc<Context>>,
    /// PD handle -> its CA.
    pds: FxHashMap<u64, u64>,
    cqs: FxHashMap<u64, Arc<Owned<UserCq>>>,
    qps: FxHashMap<u64, Arc<Owned<Qp>>>,
    /// QP handle -> its send and receive CQs' handles (a reset marks them).
    qp_cqs: FxHashMap<u64, [u64; 2]>,
    srqs: FxHashMap<u64, Arc<Owned<Srq>>>,
}

/// The provider of one process: every context it opened and their objects.
pub struct Provider {
    platform: Platform,
    /// Lock order: `state`, then `avs`, then an object's lock; the fast
    /// path takes `avs` (UD sends) and the object's lock one after the
    /// other, never together.
    state: Mutex<State>,
    avs: Avs,
}

impl core::fmt::Debug for Provider {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Provider").finish_non_exhaustive()
    }
}

/// The whole of `bytes` as a `T`.
fn exact<T: Repr>(bytes: &[u8]) -> Result<T, IbStatus> {
    match T::decode(bytes) {
        Ok((value, [])) => Ok(value),
        _ => Err(IbStatus::InvalidParameter),
    }
}

/// `ceil(log2(n))` for `n >= 1`; `None` past 31.
fn log2_ceil(n: u32) -> Option<u8> {
    let log = n.max(1).checked_next_power_of_two()?.trailing_zeros();
    u8::try_from(log).ok()
}

/// Writes `record` into the private buffer: its length.
fn write_private(out: &mut [u8], record: &[u8]) -> Result<usize, IbStatus> {
    let room = out
        .get_mut(..record.len())
        .ok_or(IbStatus::InsufficientMemory)?;
    room.copy_from_slice(record);
    Ok(record.len())
}

impl Provider {
    /// A provider with no context yet.
    pub fn new(platform: Platform) -> Self {
        Self {
            platform,
            state: Mutex::default(),
            avs: Avs::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Allocations the provider holds now (pending and live objects'):
    /// what a test compares with the process's count.
    pub fn allocations(&self) -> usize {
        let s = self.state();
        s.pending.len() + s.cqs.len() + s.qps.len() + s.srqs.len()
    }

    /// User AVs alive.
    pub fn address_vectors(&self) -> usize {
        lock_avs(&self.avs).avs.len()
    }

    fn allocate(&self, len: usize) -> Result<Allocation, IbStatus> {
        let va = self
            .platform
            .memory
            .alloc(len)
            .ok_or(IbStatus::InsufficientMemory)?;
        Ok(Allocation {
            memory: Arc::clone(&self.platform.memory),
            va,
        })
    }

    fn context(&self, ca: u64) -> Result<Arc<Context>, IbStatus> {
        self.state()
            .contexts
            .get(&ca)
            .cloned()
            .ok_or(IbStatus::InvalidCaHandle)
    }

    fn park(&self, pending: Pending) -> u64 {
        let mut s = self.state();
        s.next_cookie += 1;
        let cookie = s.next_cookie;
        s.pending.insert(cookie, pending);
        cookie
    }

    fn ioctl(private_in_len: usize, private_out_max: usize, cookie: u64) -> PreOutcome {
        PreOutcome::Ioctl {
            private_in_len,
            private_out_max,
            cookie,
        }
    }

    // -- pre hooks ----------------------------------------------------------

    fn pre_create_cq(&self, call: &mut PreCall<'_>) -> Result<PreOutcome, IbStatus> {
        let ctx = self.context(call.handle)?;
        let attr: CqAttr = exact(call.input)?;
        let log = log2_ceil(attr.cqe)
            .filter(|&log| log <= ctx.limits().log_max_cqes)
            .ok_or(IbStatus::InvalidCqSize)?;
        let ring = 32usize << log;
        let memory = self.allocate(ring + RECORD_ROOM)?;
        let layout = CreateCqPriv::new(log, memory.va, memory.va + ring as u64)
            .map_err(|_| IbStatus::InvalidCqSize)?;
        let len = write_private(call.private_in, layout.emit().as_bytes())?;
        let cookie = self.park(Pending::Cq {
            ca: call.handle,
            layout,
            memory,
        });
        Ok(Self::ioctl(len, CreateCqPrivOut::SIZE, cookie))
    }

    fn pre_resize_cq(&self, call: &mut PreCall<'_>) -> Result<PreOutcome, IbStatus> {
        let owned = self.cq(call.handle)?;
        let ctx = self.context(owned.ca)?;
        let attr: CqAttr = exact(call.input)?;
        let log = log2_ceil(attr.cqe)
            .filter(|&log| log <= ctx.limits().log_max_cqes)
            .ok_or(IbStatus::InvalidCqSize)?;
        let memory = self.allocate(32usize << log)?;
        let layout = ResizeCqPriv::new(log, memory.va).map_err(|_| IbStatus::InvalidCqSize)?;
        let len = write_private(call.private_in, layout.emit().as_bytes())?;
        // From here to post the device may switch rings at any moment: the
        // CQ's polls find nothing and its arms wait (post ends it).
        {
            let mut object = owned.lock();
            let user = object.as_mut().ok_or(IbStatus::InvalidCqHandle)?;
            if user.resizing {
                return Err(IbStatus::ResourceBusy);
            }
            user.resizing = true;
        }
        let cookie = self.park(Pending::Resize {
            cq: call.handle,
            layout,
            memory,
        });
        Ok(Self::ioctl(len, 0, cookie))
    }

    fn pre_create_qp(&self, call: &mut PreCall<'_>) -> Result<PreOutcome, IbStatus> {
        let ctx = self.context(call.handle)?;
        let create: QpCreate = exact(call.input)?;
        if create.qp_type.is_special() {
            return Err(IbStatus::InvalidPermission);
        }
        // The CQs (and SRQ) must be this provider's, of this context: any
        // library may call the hook, and the rings' completions are polled
        // through this context's directory.
        let srq = create.srq.map(|s| s.raw());
        {
            let s = self.state();
            let ours = |cq: CqHandle| s.cqs.get(&cq.raw()).is_some_and(|o| o.ca == call.handle);
            if !ours(create.send_cq) || !ours(create.recv_cq) {
                return Err(IbStatus::InvalidCqHandle);
            }
            if let Some(srq) = srq
                && s.srqs.get(&srq).is_none_or(|o| o.ca != call.handle)
            {
                return Err(IbStatus::InvalidSrqHandle);
            }
        }
        let caps = &create.caps;
        // The send stride: the prefix and the larger of the SGEs and the
        // inline segment, in a power of two of basic blocks.
        let data = (caps.max_send_sge.max(1) as usize * SEG_SIZE)
            .max(inline_seg_len(caps.max_inline_data as usize));
        let stride = (send_prefix(create.qp_type) + data)
            .next_power_of_two()
            .max(BB_SIZE);
        let log_wqe_bbs = (stride / BB_SIZE).trailing_zeros() as u8;
        let log_wrs = log2_ceil(caps.max_send_wr).ok_or(IbStatus::InvalidMaxWrs)?;
        let sq_log_bbs = log_wrs + log_wqe_bbs;
        if sq_log_bbs > ctx.limits().log_max_wqes {
            return Err(IbStatus::InvalidMaxWrs);
        }
        let sq_bytes = BB_SIZE << sq_log_bbs;
        let rq = match srq {
            Some(_) => None,
            None => {
                let rq_stride = (SEG_SIZE * (1 + caps.max_recv_sge.max(1) as usize))
                    .next_power_of_two()
                    .max(MIN_RECV_STRIDE);
                let log_entries = log2_ceil(caps.max_recv_wr).ok_or(IbStatus::InvalidMaxWrs)?;
                if log_entries > ctx.limits().log_max_wqes {
                    return Err(IbStatus::InvalidMaxWrs);
                }
                Some((log_entries, rq_stride.trailing_zeros() as u8))
            }
        };
        let rq_bytes = rq.map_or(0, |(log, log_stride)| 1usize << (log + log_stride));
        let memory = self.allocate(sq_bytes + rq_bytes + RECORD_ROOM)?;
        let (sq_va, rq_va) = (memory.va, memory.va + sq_bytes as u64);
        let record = rq_va + rq_bytes as u64;
        let layout = CreateQpPriv::new(
            sq_log_bbs,
            log_wqe_bbs,
            sq_va,
            rq.map(|(log, log_stride)| (log, log_stride, rq_va, record)),
        )
        .map_err(|_| IbStatus::InvalidParameter)?;
        let len = write_private(call.private_in, layout.emit().as_bytes())?;
        let cookie = self.park(Pending::Qp {
            ca: call.handle,
            qp_type: create.qp_type,
            cqs: [create.send_cq.raw(), create.recv_cq.raw()],
            srq,
            layout,
            memory,
        });
        Ok(Self::ioctl(len, CreateQpPrivOut::SIZE, cookie))
    }

    fn pre_create_srq(&self, call: &mut PreCall<'_>) -> Result<PreOutcome, IbStatus> {
        let ctx = self.context(call.handle)?;
        let create: SrqCreate = exact(call.input)?;
        let log_entries = log2_ceil(create.attr.max_wr)
            .filter(|&log| log <= ctx.limits().log_max_srq_wqes)
            .ok_or(IbStatus::InvalidSrqSize)?;
        let stride = (SEG_SIZE * (1 + create.attr.max_sge.max(1) as usize))
            .next_power_of_two()
            .max(MIN_RECV_STRIDE);
        let ring = stride << log_entries;
        let memory = self.allocate(ring + RECORD_ROOM)?;
        let layout = CreateSrqPriv::new(
            log_entries,
            stride.trailing_zeros() as u8,
            memory.va,
            memory.va + ring as u64,
        )
        .map_err(|_| IbStatus::InvalidSrqSize)?;
        let len = write_private(call.private_in, layout.emit().as_bytes())?;
        let cookie = self.park(Pending::Srq {
            ca: call.handle,
            layout,
            memory,
        });
        Ok(Self::ioctl(len, CreateSrqPrivOut::SIZE, cookie))
    }

    /// The RoCEv2 AV of `attr` for the context `ca` (guide 6.4.2: built
    /// into the UD WQEs), refused as the kernel's AV verbs refuse it
    /// (`Av::for_device`: port, static rate, layout; IBA 11.2.2); `gone`
    /// when the context is closed.
    fn user_av(s: &State, ca: u64, attr: &AvAttr, gone: IbStatus) -> Result<Av, IbStatus> {
        let ctx = s.contexts.get(&ca).ok_or(gone)?;
        Av::for_device(attr, ctx.limits().num_ports)
    }

    fn pre_av(&self, call: &mut PreCall<'_>) -> Result<PreOutcome, IbStatus> {
        let s = self.state();
        let mut table = lock_avs(&self.avs);
        let t = &mut *table;
        match call.verb {
            VerbId::CreateAv => {
                // The bytes, the PD (its context knows the ports), then
                // the attributes: the kernel checks the attributes before
                // the PD, so only a request wrong in both answers differently.
                let attr: AvAttr = exact(call.input)?;
                let ca = *s.pds.get(&call.handle).ok_or(IbStatus::InvalidPdHandle)?;
                let av = Self::user_av(&s, ca, &attr, IbStatus::InvalidPdHandle)?;
                t.next += 1;
                let handle = USER_AV_TAG | t.next;
                t.avs.insert(
                    handle,
                    UserAv {
                        ca,
                        pd: call.handle,
                        attr,
                        av,
                    },
                );
                Ok(PreOutcome::Done { handle })
            }
            VerbId::QueryAv => {
                let user = t.avs.get(&call.handle).ok_or(IbStatus::InvalidAvHandle)?;
                let out = QueryAvOut {
                    pd: PdHandle::from_raw(user.pd),
                    av: user.attr,
                };
                let bytes = out.emit();
                let room = call
                    .output
                    .get_mut(..bytes.as_bytes().len())
                    .ok_or(IbStatus::InsufficientMemory)?;
                room.copy_from_slice(bytes.as_bytes());
                Ok(PreOutcome::Done { handle: 0 })
            }
            VerbId::ModifyAv => {
                let attr: AvAttr = exact(call.input)?;
                let user = t
                    .avs
                    .get_mut(&call.handle)
                    .ok_or(IbStatus::InvalidAvHandle)?;
                let av = Self::user_av(&s, user.ca, &attr, IbStatus::InvalidAvHandle)?;
                user.attr = attr;
                user.av = av;
                Ok(PreOutcome::Done { handle: 0 })
            }
            _ => {
                t.avs
                    .remove(&call.handle)
                    .ok_or(IbStatus::InvalidAvHandle)?;
                Ok(PreOutcome::Done { handle: 0 })
            }
        }
    }

    // -- post hooks ---------------------------------------------------------

    fn take_pending(&self, cookie: u64) -> Result<Pending, IbStatus> {
        self.state()
            .pending
            .remove(&cookie)
            .ok_or(IbStatus::InvalidParameter)
    }

    fn post_open_ca(&self, call: &PostCall<'_>) -> Result<(), IbStatus> {
        let out: OpenCaOut = exact(call.output)?;
        let doorbell = out.doorbell.ok_or(IbStatus::InvalidParameter)?;
        let limits = OpenCaPriv::parse(call.private_out).map_err(|_| IbStatus::InvalidParameter)?;
        #[cfg(not(windows))]
        let uar = UarPage::simulated(doorbell.va, Arc::clone(&self.platform.mmio));
        #[cfg(windows)]
        // SAFETY: the kernel mapped the context's UAR page at this address
        // into the process for as long as the context's file is open; the
        // context is dropped at `CloseCa`'s post, before that.
        let uar = unsafe { UarPage::mapped(doorbell.va) };
        self.state()
            .contexts
            .insert(call.created, Arc::new(Context::new(limits, uar)));
        Ok(())
    }

    fn post_create(&self, call: &PostCall<'_>, pending: Pending) -> Result<(), IbStatus> {
        match pending {
            Pending::Cq { ca, layout, memory } => {
                let created = CreateCqPrivOut::parse(call.private_out)
                    .map_err(|_| IbStatus::InvalidParameter)?;
                let ctx = self.context(ca)?;
                // SAFETY: the ring and record are `memory`, this process's
                // own allocation, kept (in `Owned`) until after the CQ is
                // dropped; the device reaches it only by DMA of 64-bit
                // words and nothing else of the process uses it. The
                // record starts the `RECORD_ROOM` after the ring (whose
                // length is a multiple of 32 bytes from a page-aligned
                // start, so the record is 8-byte aligned), which holds
                // nothing else: its word is the record's alone.
                let cq = unsafe { ctx.cq_owning_record_word(&layout, &created) }
                    .map_err(|e| e.status())?;
                self.state()
                    .cqs
                    .insert(call.created, Owned::new(ca, UserCq::new(cq), memory));
            }
            Pending::Resize { cq, layout, memory } => {
                let owned = self
                    .state()
                    .cqs
                    .get(&cq)
                    .cloned()
                    .ok_or(IbStatus::InvalidCqHandle)?;
                let mut object = owned.lock();
                let cq = &mut object.as_mut().ok_or(IbStatus::InvalidCqHandle)?.cq;
                // SAFETY: as for a CQ's creation: `memory` is kept in the
                // CQ's `Owned` from now on, in place of the old ring, which
                // the device left (the resize succeeded).
                unsafe { cq.resized(&layout) }.map_err(|e| e.status())?;
                *owned.memory.lock().unwrap_or_else(|p| p.into_inner()) = memory;
            }
            Pending::Qp {
                ca,
                qp_type,
                cqs,
                srq,
                layout,
                memory,
            } => {
                let out: QpCreatedOut = exact(call.output)?;
                let private = CreateQpPrivOut::parse(call.private_out)
                    .map_err(|_| IbStatus::InvalidParameter)?;
                if private.qpn != out.qpn.get() {
                    return Err(IbStatus::InvalidParameter);
                }
                let ctx = self.context(ca)?;
                let created = QpCreated {
                    qp_type,
                    caps: out.caps,
                    private,
                };
                let srq = match srq {
                    Some(handle) => Some(
                        self.state()
                            .srqs
                            .get(&handle)
                            .cloned()
                            .ok_or(IbStatus::InvalidSrqHandle)?,
                    ),
                    None => None,
                };
                let srq_guard = srq.as_ref().map(|s| s.lock());
                let srq_object = match &srq_guard {
                    Some(guard) => Some(guard.as_ref().ok_or(IbStatus::InvalidSrqHandle)?),
                    None => None,
                };
                // SAFETY: as for a CQ's creation, for the QP's rings.
                let qp =
                    unsafe { ctx.qp(&layout, &created, srq_object) }.map_err(|e| e.status())?;
                drop(srq_guard);
                let mut s = self.state();
                s.qps.insert(call.created, Owned::new(ca, qp, memory));
                s.qp_cqs.insert(call.created, cqs);
            }
            Pending::Srq { ca, layout, memory } => {
                let out: SrqAttr = exact(call.output)?;
                let created = CreateSrqPrivOut::parse(call.private_out)
                    .map_err(|_| IbStatus::InvalidParameter)?;
                let ctx = self.context(ca)?;
                // SAFETY: as for a CQ's creation, for the SRQ's ring.
                let srq =
                    unsafe { ctx.srq(&layout, &created, out.max_sge) }.map_err(|e| e.status())?;
                self.state()
                    .srqs
                    .insert(call.created, Owned::new(ca, srq, memory));
            }
        }
        Ok(())
    }

    /// After a successful `AllocMw` in one of this provider's PDs: the
    /// window's context records its type, which its bind WQEs carry.
    fn post_alloc_mw(&self, call: &PostCall<'_>) -> Result<(), IbStatus> {
        let attr: MwAttr = exact(call.input)?;
        let s = self.state();
        if let Some(ctx) = s.pds.get(&call.handle).and_then(|ca| s.contexts.get(ca)) {
            ctx.record_window(call.created, attr.mw_type);
        }
        Ok(())
    }

    fn post_destroy(&self, call: &PostCall<'_>) {
        // What leaves the maps is retired after the state's lock is let go
        // (lock order), QPs before the SRQs and CQs their pollers know.
        let mut qps = Vec::new();
        let mut srqs = Vec::new();
        let mut cqs = Vec::new();
        {
            let mut s = self.state();
            match call.verb {
                VerbId::CloseCa => {
                    let ca = call.handle;
                    s.contexts.remove(&ca);
                    s.pds.retain(|_, c| *c != ca);
                    lock_avs(&self.avs).avs.retain(|_, av| av.ca != ca);
                    let State {
                        qps: qp_map,
                        qp_cqs,
                        srqs: srq_map,
                        cqs: cq_map,
                        ..
                    } = &mut *s;
                    qp_map.retain(|_, o| o.ca != ca || !keep_aside(&mut qps, o));
                    qp_cqs.retain(|qp, _| qp_map.contains_key(qp));
                    srq_map.retain(|_, o| o.ca != ca || !keep_aside(&mut srqs, o));
                    cq_map.retain(|_, o| o.ca != ca || !keep_aside(&mut cqs, o));
                }
                VerbId::DeallocPd => {
                    s.pds.remove(&call.handle);
                }
                VerbId::DestroyCq => cqs.extend(s.cqs.remove(&call.handle)),
                VerbId::DestroyQp => {
                    qps.extend(s.qps.remove(&call.handle));
                    s.qp_cqs.remove(&call.handle);
                }
                VerbId::DestroySrq => srqs.extend(s.srqs.remove(&call.handle)),
                VerbId::DeallocMw => {
                    // Handles are unique: only the window's context knows it.
                    for ctx in s.contexts.values() {
                        ctx.forget_window(call.handle);
                    }
                }
                _ => {}
            }
        }
        qps.iter().for_each(|o| o.retire());
        srqs.iter().for_each(|o| o.retire());
        cqs.iter().for_each(|o| o.retire());
    }

    /// After a successful `ModifyQp`: a QP moved to RESET restarts its
    /// rings (`Qp::reset`), its CQs locked so no poll runs meanwhile (lock
    /// order QP, then CQs, as a poll takes its CQ alone). Any other
    /// transition leaves the rings where they are (guide 6.5.5 item 5).
    fn post_modify_qp(&self, call: &PostCall<'_>) -> Result<(), IbStatus> {
        let modify: QpModify = exact(call.input)?;
        if modify.state != Some(QpState::Reset) {
            return Ok(());
        }
        let (qp, send_cq, recv_cq) = {
            let s = self.state();
            let qp = s.qps.get(&call.handle).cloned();
            let cqs = s
                .qp_cqs
                .get(&call.handle)
                .map(|&[send, recv]| (s.cqs.get(&send).cloned(), s.cqs.get(&recv).cloned()));
            match (qp, cqs) {
                (Some(qp), Some((Some(send), Some(recv)))) => (qp, send, recv),
                _ => return Err(IbStatus::InvalidQpHandle),
            }
        };
        let mut qp = qp.lock();
        let send = send_cq.lock();
        let (Some(qp), Some(send_object)) = (qp.as_mut(), send.as_ref()) else {
            return Err(IbStatus::InvalidQpHandle);
        };
        if Arc::ptr_eq(&send_cq, &recv_cq) {
            qp.reset(&send_object.cq, &send_object.cq);
        } else {
            let recv = recv_cq.lock();
            let recv_object = recv.as_ref().ok_or(IbStatus::InvalidCqHandle)?;
            qp.reset(&send_object.cq, &recv_object.cq);
        }
        Ok(())
    }

    /// The post hook of every verb (the trait's `post`, but for the end
    /// of a resize).
    fn post_hook(&self, call: &PostCall<'_>) -> Result<(), IbStatus> {
        let pending = match call.verb {
            VerbId::CreateCq | VerbId::ResizeCq | VerbId::CreateQp | VerbId::CreateSrq => {
                Some(self.take_pending(call.cookie))
            }
            _ => None,
        };
        // Row 3: a failed IOCTL fails post with its status, after
        // `pending` (dropped here) freed what pre allocated.
        if call.status != IbStatus::Success {
            return Err(call.status);
        }
        let pending = pending.transpose()?;
        match (call.verb, pending) {
            (VerbId::OpenCa, _) => self.post_open_ca(call),
            (VerbId::AllocPd, _) => {
                self.state().pds.insert(call.created, call.handle);
                Ok(())
            }
            (VerbId::AllocMw, _) => self.post_alloc_mw(call),
            (_, Some(pending)) => self.post_create(call, pending),
            (VerbId::ModifyQp, _) => self.post_modify_qp(call),
            _ => {
                self.post_destroy(call);
                Ok(())
            }
        }
    }

    /// A `ResizeCq` ended (its post ran, whatever its outcome): the CQ's
    /// polls go on, from the new ring if the device switched, and an arm
    /// asked for meanwhile is made now.
    fn end_resize(&self, cq: u64) {
        let Ok(owned) = self.cq(cq) else {
            return;
        };
        let mut object = owned.lock();
        if let Some(user) = object.as_mut() {
            user.resizing = false;
            if let Some(for_) = user.deferred_arm.take() {
                user.cq.arm(for_);
            }
        }
    }

    // -- fast path ----------------------------------------------------------

    fn qp(&self, qp: u64) -> Result<Arc<Owned<Qp>>, PostRefused> {
        self.state().qps.get(&qp).cloned().ok_or(PostRefused {
            posted: 0,
            status: IbStatus::InvalidQpHandle,
        })
    }

    fn cq(&self, cq: u64) -> Result<Arc<Owned<UserCq>>, IbStatus> {
        self.state()
            .cqs
            .get(&cq)
            .cloned()
            .ok_or(IbStatus::InvalidCqHandle)
    }

    /// The fast path of QP `qp` (a handle this provider's `CreateQp` post
    /// built), for the access library to hold for the QP's life instead
    /// of its handle: no lookup per post. `None` for a handle it does not
    /// know. Once the QP is destroyed the fast path refuses every post
    /// (`InvalidQpHandle`).
    pub fn qp_fast_path(&self, qp: u64) -> Option<QpFastPath> {
        Some(QpFastPath {
            qp: self.qp(qp).ok()?,
            avs: Arc::clone(&self.avs),
        })
    }

    /// The fast path of CQ `cq`, as [`qp_fast_path`](Self::qp_fast_path):
    /// polls and arms with no lookup; refused (`InvalidCqHandle`) once the
    /// CQ is destroyed.
    pub fn cq_fast_path(&self, cq: u64) -> Option<CqFastPath> {
        Some(CqFastPath(self.cq(cq).ok()?))
    }

    /// The fast path of SRQ `srq`, as [`qp_fast_path`](Self::qp_fast_path):
    /// posts with no lookup; refused (`InvalidSrqHandle`) once the SRQ is
    /// destroyed.
    pub fn srq_fast_path(&self, srq: u64) -> Option<SrqFastPath> {
        Some(SrqFastPath(self.state().srqs.get(&srq).cloned()?))
    }
}

/// Puts `o` aside (to be retired) and answers true.
fn keep_aside<T>(aside: &mut Vec<Arc<Owned<T>>>, o: &Arc<Owned<T>>) -> bool {
    aside.push(Arc::clone(o));
    true
}

const NO_QP: PostRefused = PostRefused {
    posted: 0,
    status: IbStatus::InvalidQpHandle,
};

/// Posts `wrs` to the QP `owned`, resolving UD requests' AVs in `avs`.
#[inline]
fn post_send_to(
    owned: &Owned<Qp>,
    avs: &Mutex<AvTable>,
    wrs: &[UserSend<'_>],
) -> Result<usize, PostRefused> {
    let mut object = owned.lock();
    let qp = object.as_mut().ok_or(NO_QP)?;
    let queue = qp.send_queue();
    // RC and UC: no AV to resolve (a request naming one is refused by
    // the validation), so the batch goes straight from the caller's
    // slice into the ring, nothing copied or allocated on the way.
    if !queue.is_datagram() {
        return queue.post_connected(wrs).map_err(refused);
    }
    drop(object);
    post_datagrams_to(owned, avs, wrs)
}

/// [`post_send_to`] of a UD QP's sends: out of line, so the connected
/// path's frame carries none of the AV batch.
#[inline(never)]
fn post_datagrams_to(
    owned: &Owned<Qp>,
    avs: &Mutex<AvTable>,
    wrs: &[UserSend<'_>],
) -> Result<usize, PostRefused> {
    // UD: each request's AV, resolved under the AV table's lock before
    // the QP's is taken (the two are never held together). A request
    // naming an AV this provider does not hold stops the batch there:
    // the requests before it are posted, then it is refused.
    let mut resolved = [None; UD_AV_BATCH];
    let mut posted = 0;
    for chunk in wrs.chunks(UD_AV_BATCH) {
        let mut known = chunk.len();
        {
            let table = lock_avs(avs);
            for (index, (send, av)) in chunk.iter().zip(&mut resolved).enumerate() {
                *av = match &send.wr.ud {
                    Some(ud) => match table.avs.get(&ud.av.raw()) {
                        Some(user) => Some(user.av),
                        None => {
                            known = index;
                            break;
                        }
                    },
                    None => None,
                };
            }
        }
        let requests = chunk[..known]
            .iter()
            .zip(resolved)
            .map(|(send, av)| SendRequest {
                wr: send.wr,
                av,
                inline: send.inline,
            });
        let mut object = owned.lock();
        let qp = object.as_mut().ok_or(PostRefused { posted, ..NO_QP })?;
        let done = qp.send_queue().post_each(requests);
        posted += done.map_err(|error| {
            refused(PostError {
                posted: posted + error.posted,
                ..error
            })
        })?;
        if known < chunk.len() {
            return Err(PostRefused {
                posted,
                status: IbStatus::InvalidAvHandle,
            });
        }
    }
    Ok(posted)
}

#[inline]
fn post_recv_to(owned: &Owned<Qp>, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused> {
    let mut object = owned.lock();
    let queue = object.as_mut().and_then(Qp::recv_queue).ok_or(NO_QP)?;
    queue.post(wrs).map_err(refused)
}

const NO_SRQ: PostRefused = PostRefused {
    posted: 0,
    status: IbStatus::InvalidSrqHandle,
};

#[inline]
fn post_srq_recv_to(owned: &Owned<Srq>, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused> {
    let mut object = owned.lock();
    object.as_mut().ok_or(NO_SRQ)?.post(wrs).map_err(refused)
}

#[inline]
fn poll(owned: &Owned<UserCq>, out: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
    // The answer is made after the unlock from a count kept in a
    // register, not built under the lock and carried across it.
    let polled = match owned.lock().as_mut() {
        Some(user) if user.resizing => Some(0),
        Some(user) => Some(user.cq.poll(out)),
        None => None,
    };
    polled.ok_or(IbStatus::InvalidCqHandle)
}

fn arm(owned: &Owned<UserCq>, notify: CqNotify) -> Result<(), IbStatus> {
    let for_ = match notify {
        CqNotify::Solicited => ArmFor::Solicited,
        CqNotify::NextCompletion => ArmFor::Next,
    };
    let mut object = owned.lock();
    let user = object.as_mut().ok_or(IbStatus::InvalidCqHandle)?;
    if user.resizing {
        // Made when the resize ends; "next" covers "solicited".
        user.deferred_arm = match (user.deferred_arm, for_) {
            (Some(ArmFor::Next), _) | (_, ArmFor::Next) => Some(ArmFor::Next),
            _ => Some(ArmFor::Solicited),
        };
    } else {
        user.cq.arm(for_);
    }
    Ok(())
}

/// A QP's fast path held by its owner ([`Provider::qp_fast_path`]):
/// posts with no lookup. Posts from several threads are serialized by the
/// QP's lock.
#[derive(Clone)]
pub struct QpFastPath {
    qp: Arc<Owned<Qp>>,
    avs: Avs,
}

impl core::fmt::Debug for QpFastPath {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("QpFastPath").finish_non_exhaustive()
    }
}

impl QpFastPath {
    /// As [`UserVerbsProvider::post_send`] on the QP's handle.
    #[inline]
    pub fn post_send(&self, wrs: &[UserSend<'_>]) -> Result<usize, PostRefused> {
        post_send_to(&self.qp, &self.avs, wrs)
    }

    /// As [`UserVerbsProvider::post_recv`] on the QP's handle.
    #[inline]
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused> {
        post_recv_to(&self.qp, wrs)
    }
}

/// A CQ's fast path held by its owner ([`Provider::cq_fast_path`]):
/// polls and arms with no lookup, serialized by the CQ's lock.
#[derive(Clone)]
pub struct CqFastPath(Arc<Owned<UserCq>>);

impl core::fmt::Debug for CqFastPath {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CqFastPath").finish_non_exhaustive()
    }
}

impl CqFastPath {
    /// As [`UserVerbsProvider::poll_cq`] on the CQ's handle.
    #[inline]
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
        poll(&self.0, out)
    }

    /// As [`UserVerbsProvider::arm_cq`] on the CQ's handle.
    pub fn arm(&self, notify: CqNotify) -> Result<(), IbStatus> {
        arm(&self.0, notify)
    }
}

/// An SRQ's fast path held by its owner ([`Provider::srq_fast_path`]):
/// posts with no lookup, serialized by the SRQ's lock (which no CQ's
/// poll takes).
#[derive(Clone)]
pub struct SrqFastPath(Arc<Owned<Srq>>);

impl core::fmt::Debug for SrqFastPath {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SrqFastPath").finish_non_exhaustive()
    }
}

impl SrqFastPath {
    /// As [`UserVerbsProvider::post_srq_recv`] on the SRQ's handle.
    #[inline]
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused> {
        post_srq_recv_to(&self.0, wrs)
    }
}

fn refused(error: PostError) -> PostRefused {
    PostRefused {
        posted: error.posted,
        status: error.status(),
    }
}

impl UserVerbsProvider for Provider {
    fn pre(&self, call: &mut PreCall<'_>) -> Result<PreOutcome, IbStatus> {
        match call.verb {
            VerbId::OpenCa => Ok(Self::ioctl(0, OpenCaPriv::SIZE, 0)),
            VerbId::CreateCq => self.pre_create_cq(call),
            VerbId::ResizeCq => self.pre_resize_cq(call),
            VerbId::CreateQp => self.pre_create_qp(call),
            VerbId::CreateSrq => self.pre_create_srq(call),
            VerbId::CreateAv | VerbId::QueryAv | VerbId::ModifyAv | VerbId::DestroyAv => {
                self.pre_av(call)
            }
            VerbId::DeallocPd => {
                if lock_avs(&self.avs)
                    .avs
                    .values()
                    .any(|av| av.pd == call.handle)
                {
                    return Err(IbStatus::ResourceBusy);
                }
                Ok(Self::ioctl(0, 0, 0))
            }
            _ => Ok(Self::ioctl(0, 0, 0)),
        }
    }

    fn post(&self, call: &PostCall<'_>) -> Result<(), IbStatus> {
        let result = self.post_hook(call);
        if call.verb == VerbId::ResizeCq {
            self.end_resize(call.handle);
        }
        result
    }

    fn post_send(&self, qp: u64, wrs: &[UserSend<'_>]) -> Result<usize, PostRefused> {
        post_send_to(&*self.qp(qp)?, &self.avs, wrs)
    }

    fn post_recv(&self, qp: u64, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused> {
        post_recv_to(&*self.qp(qp)?, wrs)
    }

    fn post_srq_recv(&self, srq: u64, wrs: &[RecvWr<'_>]) -> Result<usize, PostRefused> {
        let owned = self.state().srqs.get(&srq).cloned().ok_or(NO_SRQ)?;
        post_srq_recv_to(&owned, wrs)
    }

    fn poll_cq(&self, cq: u64, out: &mut [WorkCompletion]) -> Result<usize, IbStatus> {
        poll(&*self.cq(cq)?, out)
    }

    fn arm_cq(&self, cq: u64, notify: CqNotify) -> Result<(), IbStatus> {
        arm(&*self.cq(cq)?, notify)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NoMemory;

    impl UserMemory for NoMemory {
        fn alloc(&self, _: usize) -> Option<u64> {
            None
        }

        fn free(&self, _: u64) {}
    }

    fn post_call(verb: VerbId, cookie: u64, status: IbStatus) -> PostCall<'static> {
        PostCall {
            verb,
            handle: 1,
            input: &[],
            private_in: &[],
            cookie,
            status,
            created: 0,
            output: &[],
            private_out: &[],
        }
    }

    #[test]
    fn post_reports_a_failed_ioctl_even_without_its_pre() {
        let provider = Provider::new(Platform {
            memory: Arc::new(NoMemory),
            #[cfg(not(windows))]
            mmio: Arc::new(|_, _| {}),
        });
        // A post whose cookie names nothing pre made: after a failed IOCTL
        // it still answers the IOCTL's status (row 3); after a successful
        // one it refuses.
        let failed = post_call(VerbId::CreateCq, 99, IbStatus::InvalidCqSize);
        assert_eq!(provider.post(&failed), Err(IbStatus::InvalidCqSize));
        let succeeded = post_call(VerbId::CreateQp, 99, IbStatus::Success);
        assert_eq!(provider.post(&succeeded), Err(IbStatus::InvalidParameter));
        // No memory: pre refuses before anything is sent.
        let mut private = [0u8; 64];
        let attr = CqAttr {
            cqe: 8,
            comp_vector: 0,
        };
        let input = attr.emit();
        let mut pre = PreCall {
            verb: VerbId::CreateCq,
            handle: 1,
            input: input.as_bytes(),
            private_in: &mut private,
            output: &mut [],
        };
        assert_eq!(provider.pre(&mut pre), Err(IbStatus::InvalidCaHandle));
        assert_eq!(provider.allocations(), 0);
    }
}
